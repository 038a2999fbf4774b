"""STAND-IN for a Triton server, used only by tests of trt-builder's client: a few KServe v2
HTTP endpoints (server and model readiness, infer on "ensemble") on a local port. It runs no
model: it answers "[stand-in] ..." with what it was sent, so the request path can be checked.
SLOW=seconds delays every answer (for timeouts)."""

from __future__ import annotations

import json
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

DTYPES = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}


def bytes_elements(raw: bytes) -> list[str]:
    """Triton's BYTES tensor encoding: each element a 4-byte little-endian length, then it."""
    out, at = [], 0
    while at < len(raw):
        (n,) = struct.unpack_from("<I", raw, at)
        out.append(raw[at + 4 : at + 4 + n].decode())
        at += 4 + n
    return out


def _decode(item: dict, raw: bytes) -> list:
    if item["datatype"] == "BYTES":
        return bytes_elements(raw)
    return np.frombuffer(raw, dtype=DTYPES[item["datatype"]]).tolist()


class StandInTriton(ThreadingHTTPServer):
    def __init__(self, slow: float = 0.0) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.slow = slow
        self.requests: list[dict] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: StandInTriton

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _reply(self, code: int, body: dict | None = None) -> None:
        data = json.dumps(body or {}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v2/health/ready":
            self._reply(200)
        elif self.path.startswith("/v2/models/") and self.path.endswith("/ready"):
            self._reply(200 if self.path == "/v2/models/ensemble/ready" else 400,
                        {"error": "model is not ready"})  # fmt: skip
        else:
            self._reply(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        header_len = int(self.headers.get("Inference-Header-Content-Length") or len(body))
        request, raw = json.loads(body[:header_len]), body[header_len:]
        inputs = {}
        for item in request["inputs"]:
            size = (item.get("parameters") or {}).get("binary_data_size")
            if size is None:
                inputs[item["name"]] = item["data"]
            else:
                inputs[item["name"]], raw = _decode(item, raw[:size]), raw[size:]
        self.server.requests.append(inputs)
        time.sleep(self.server.slow)
        text = (inputs.get("text_input") or inputs.get("messages"))[0]
        answer = f"[stand-in] {inputs['max_tokens'][0]} tokens for: {text}"
        self._reply(
            200,
            {
                "model_name": "ensemble",
                "outputs": [
                    {"name": "text_output", "datatype": "BYTES", "shape": [1, 1], "data": [answer]}
                ],
            },
        )
