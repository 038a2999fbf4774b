"""STAND-IN for a streaming (decoupled) Triton server, used only by tests of trt-builder's
client: server and model readiness and the gRPC stream (ModelStreamInfer) on a local port,
through tritonclient's own service definition. It runs no model: for each request it streams
"[stand-in]", " piece 1", ... then an empty final response, as a decoupled model does. Its
decoupled "tensorrt_llm" model streams token ids counting up from the prompt's last one."""

from __future__ import annotations

import struct
from concurrent import futures

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from .triton_http import bytes_elements

MODELS = ("ensemble", "tensorrt_llm")


def _response(
    request_id: str, text: str | None, final: bool
) -> service_pb2.ModelStreamInferResponse:
    response = service_pb2.ModelInferResponse(model_name="ensemble", id=request_id)
    if text is not None:
        response.outputs.add(name="text_output", datatype="BYTES", shape=[1, 1])
        data = text.encode()
        response.raw_output_contents.append(struct.pack("<I", len(data)) + data)
    response.parameters["triton_final_response"].bool_param = final
    return service_pb2.ModelStreamInferResponse(infer_response=response)


def _tokens(request_id: str, sent: dict):  # type: ignore[no-untyped-def]
    prompt = struct.unpack(f"<{len(sent['input_ids']) // 4}i", sent["input_ids"])
    count = struct.unpack("<i", sent["request_output_len"])[0]
    for step in range(1, count + 1):
        response = service_pb2.ModelInferResponse(model_name="tensorrt_llm", id=request_id)
        response.outputs.add(name="output_ids", datatype="INT32", shape=[1, 1, 1])
        response.raw_output_contents.append(struct.pack("<i", prompt[-1] + step))
        response.parameters["triton_final_response"].bool_param = False
        yield service_pb2.ModelStreamInferResponse(infer_response=response)
    final = service_pb2.ModelInferResponse(model_name="tensorrt_llm", id=request_id)
    final.parameters["triton_final_response"].bool_param = True
    yield service_pb2.ModelStreamInferResponse(infer_response=final)


class _Service(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[dict] = []

    def ServerReady(self, request, context):  # noqa: N802 (the service's names)
        return service_pb2.ServerReadyResponse(ready=True)

    def ModelReady(self, request, context):  # noqa: N802
        return service_pb2.ModelReadyResponse(ready=request.name in MODELS)

    def ModelConfig(self, request, context):  # noqa: N802
        config = model_config_pb2.ModelConfig(name=request.name)
        config.model_transaction_policy.decoupled = True
        return service_pb2.ModelConfigResponse(config=config)

    def ModelStreamInfer(self, request_iterator, context):  # noqa: N802
        for request in request_iterator:
            names = [i.name for i in request.inputs]
            sent = dict(zip(names, request.raw_input_contents, strict=True))
            self.requests.append(sent)
            if request.model_name == "tensorrt_llm":
                yield from _tokens(request.id, sent)
                continue
            pieces = int(struct.unpack("<i", sent["max_tokens"])[0])
            yield _response(request.id, "[stand-in]", False)
            for i in range(1, pieces + 1):
                yield _response(request.id, f" piece {i}", False)
            yield _response(request.id, None, True)


class StandInStreamingTriton:
    def __init__(self) -> None:
        self.service = _Service()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self.service, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def text(self, name: str, index: int = -1) -> str:
        return bytes_elements(self.service.requests[index][name])[0]

    def shutdown(self) -> None:
        self.server.stop(0)
