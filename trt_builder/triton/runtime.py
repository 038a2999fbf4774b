"""A live Triton deployment of the tensorrt_llm model as a runtime behind verify's interface (through tritonclient)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..core.errors import InputError, TritonError
from ..runtimes.generation import primary_end_id, trim
from .client import connect, stream_results


class TritonRuntime:
    """A deployment of the tensorrt_llm model (the engine itself, token ids in and out) on a
    live Triton server, over HTTP or gRPC. Greedy only: Triton returns no context logits
    unless the engine gathers them, and the ids path is what the comparison needs."""

    name = "triton"

    def __init__(self, url: str, *, model: str = "tensorrt_llm", timeout: float = 60.0) -> None:

        self.client_module, self.client, grpc = connect(url, timeout=timeout)
        self.grpc = grpc
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
                    # HTTP: the client's network_timeout (connect) bounds it instead
                    **({"client_timeout": self.timeout} if self.grpc else {}),
                )
            except Exception as exc:  # tritonclient's InferenceServerException and transport errors
                raise TritonError(
                    f"Triton refused or timed out on a request to {self.model} ({exc})"
                ) from None
            ids, length = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
            # exclude_input_in_output: the new tokens only, sequence_length of them
            out.append(trim(ids[0, 0, : int(length[0, 0])].tolist(), end_ids))
        return out

    def _streamed(
        self, prompt: list[int], max_new_tokens: int, end_id: int, pad_id: int
    ) -> list[int]:
        """One greedy request to a decoupled model: the new tokens of every streamed response
        (the repository excludes the input from the output), up to the final response."""

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
        raise TritonError("a Triton deployment gives no teacher-forced logits")
