"""Runtimes behind verify's interface that need NVIDIA's stack: a TensorRT-LLM engine directory
(run by TensorRT-LLM's ModelRunner) and a live Triton deployment (through tritonclient).

Both generate greedily for a batch of prompts; the engine runtime also gives teacher-forced
logits when the engine was built with --gather_context_logits. Neither can run on the machines
this project is developed on (docs/design.md): their tests are marked `trtllm` and `triton`,
and the logic around the calls (end ids, trimming, request shapes) is tested on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import EngineError, InputError


def trim(tokens: list[int], end_ids: set[int]) -> list[int]:
    """The continuation up to and including its first end id (a runtime given one end id keeps
    going past the others, and pads after it)."""
    for i, token in enumerate(tokens):
        if token in end_ids:
            return tokens[: i + 1]
    return tokens


def primary_end_id(end_ids: set[int], preferred: int | None) -> int:
    """The single end id a TensorRT-LLM request takes: the tokenizer's, else the smallest."""
    if preferred is not None and preferred in end_ids:
        return preferred
    if not end_ids:
        raise InputError(
            "the model has no end-of-sequence id: set eos_token_id in generation_config.json"
        )
    return min(end_ids)


class EngineRuntime:
    """An engine directory run by TensorRT-LLM's ModelRunner on this host's GPU (rank 0)."""

    name = "tensorrt-llm"

    def __init__(self, engine_dir: Path, *, eos_token_id: int | None = None) -> None:
        try:
            import tensorrt_llm
            from tensorrt_llm.runtime import ModelRunner
        except ImportError:
            raise EngineError(
                "--runtime tensorrt-llm needs TensorRT-LLM on an NVIDIA GPU host (the NGC "
                "container); verify the checkpoint with the reference runtime here"
            ) from None
        if not (engine_dir / "config.json").is_file():
            raise InputError(f"{engine_dir} has no config.json: pass an engine directory")
        from ..digests import sha256_file
        from ..engine import check_engine

        check_engine(engine_dir, digest=sha256_file)  # before TensorRT fails deep inside
        self.runner = ModelRunner.from_dir(engine_dir=str(engine_dir), rank=tensorrt_llm.mpi_rank())
        self.eos_token_id = eos_token_id
        self.teacher_forced = bool(getattr(self.runner, "gather_context_logits", False))

    def greedy_batch(
        self, prompts: list[list[int]], max_new_tokens: int, end_ids: set[int], pad_id: int = 0
    ) -> list[list[int]]:
        out = self.runner.generate(
            batch_input_ids=[torch.tensor(p, dtype=torch.int32) for p in prompts],
            max_new_tokens=max_new_tokens,
            end_id=primary_end_id(end_ids, self.eos_token_id),
            pad_id=pad_id,
            top_k=1,
            output_sequence_lengths=True,
            return_dict=True,
        )
        ids, lengths = out["output_ids"], out["sequence_lengths"]
        return [
            trim(ids[row, 0, len(p) : int(lengths[row, 0])].tolist(), end_ids)
            for row, p in enumerate(prompts)
        ]

    def forward(self, ids: torch.Tensor, **_: Any) -> torch.Tensor:
        """Teacher-forced logits [tokens, vocab] (engines built with --gather_context_logits)."""
        if not self.teacher_forced:
            raise EngineError("the engine was built without --gather_context_logits")
        out = self.runner.generate(
            batch_input_ids=[ids.to(torch.int32)], max_new_tokens=1, top_k=1,
            end_id=-1, pad_id=0, return_dict=True,
        )  # fmt: skip
        return out["context_logits"][0].float().cpu()


class TritonRuntime:
    """A deployment of the tensorrt_llm model (the engine itself, token ids in and out) on a
    live Triton server, over HTTP or gRPC. Greedy only: Triton returns no context logits
    unless the engine gathers them, and the ids path is what the comparison needs."""

    name = "triton"

    def __init__(self, url: str, *, model: str = "tensorrt_llm", timeout: float = 60.0) -> None:
        from ..triton.client import connect

        self.client_module, self.client, grpc = connect(url, model=model, timeout=timeout)
        self.model = model
        self.timeout = timeout
        self.teacher_forced = False
        self.decoupled = self._decoupled()
        if self.decoupled and not grpc:
            raise InputError(
                f"model {model} on {url} streams (decoupled): verify it over gRPC "
                "(--url grpc://HOST:8001)"
            )

    def _decoupled(self) -> bool:
        """Whether the deployed model streams (model_transaction_policy.decoupled)."""
        try:
            config = self.client.get_model_config(self.model)
        except Exception:  # an older server or a restricted endpoint: assume not
            return False
        if isinstance(config, dict):  # HTTP: JSON
            return bool((config.get("model_transaction_policy") or {}).get("decoupled"))
        return bool(config.config.model_transaction_policy.decoupled)

    def request(
        self, prompt: list[int], max_new_tokens: int, end_id: int, pad_id: int
    ) -> list[Any]:
        """The inputs of one request to the tensorrt_llm model (batch of one)."""
        c = self.client_module

        def tensor(name: str, value: np.ndarray) -> Any:
            item = c.InferInput(name, list(value.shape), "INT32")
            item.set_data_from_numpy(value)
            return item

        return [
            tensor("input_ids", np.array([prompt], dtype=np.int32)),
            tensor("input_lengths", np.array([[len(prompt)]], dtype=np.int32)),
            tensor("request_output_len", np.array([[max_new_tokens]], dtype=np.int32)),
            tensor("end_id", np.array([[end_id]], dtype=np.int32)),
            tensor("pad_id", np.array([[pad_id]], dtype=np.int32)),
            tensor("runtime_top_k", np.array([[1]], dtype=np.int32)),
        ]

    def greedy_batch(
        self, prompts: list[list[int]], max_new_tokens: int, end_ids: set[int], pad_id: int = 0
    ) -> list[list[int]]:
        end_id = primary_end_id(end_ids, None)
        if self.decoupled:
            return [
                trim(self._streamed(prompt, max_new_tokens, end_id, pad_id), end_ids)
                for prompt in prompts
            ]
        out = []
        for prompt in prompts:
            try:
                result = self.client.infer(
                    self.model,
                    self.request(prompt, max_new_tokens, end_id, pad_id),
                    outputs=[
                        self.client_module.InferRequestedOutput(n)
                        for n in ("output_ids", "sequence_length")
                    ],
                    client_timeout=self.timeout,
                )
            except Exception as exc:  # tritonclient's InferenceServerException and transport errors
                raise EngineError(
                    f"Triton refused or timed out on a request to {self.model} ({exc})"
                ) from None
            ids, length = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
            out.append(trim(ids[0, 0, len(prompt) : int(length[0, 0])].tolist(), end_ids))
        return out

    def _streamed(
        self, prompt: list[int], max_new_tokens: int, end_id: int, pad_id: int
    ) -> list[int]:
        """One greedy request to a decoupled model: the new tokens of every streamed response
        (the repository excludes the input from the output), up to the final response."""
        from ..triton.client import stream_results

        flag = self.client_module.InferInput("streaming", [1, 1], "BOOL")
        flag.set_data_from_numpy(np.array([[True]]))
        inputs = [*self.request(prompt, max_new_tokens, end_id, pad_id), flag]
        tokens: list[int] = []
        for result in stream_results(self.client, self.model, inputs, timeout=self.timeout):
            ids = result.as_numpy("output_ids")
            if ids is not None:
                tokens += ids.reshape(-1).tolist()
        return tokens

    def forward(self, ids: torch.Tensor, **_: Any) -> torch.Tensor:
        raise EngineError("a Triton deployment gives no teacher-forced logits")
