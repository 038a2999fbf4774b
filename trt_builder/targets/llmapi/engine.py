"""The llmapi target's checkpoint run by TensorRT-LLM's own `LLM(...)` (its PyTorch backend, the
default since 1.0) on this host's GPU, behind verify's two methods (`verify --runtime llmapi`).

Written against TensorRT-LLM's source, read one stored file at a time (no copy at a release
tag; docs/llmapi.md), and kept to the calls that read the same in every version read:
- `LLM(model, tokenizer=None, tokenizer_mode="auto", skip_tokenizer_init=False, ..., **kwargs)`
  and `LLM.generate(inputs, sampling_params=None, use_tqdm=True, ...)`, where a list of
  token-id lists is a batch and the outputs come back in its order:
  `tensorrt_llm/llmapi/llm.py` at 4c05a748 (by its content the 1.1/1.2 line: `LLM` is
  `_TorchLLM`, kwargs checked against `TorchLlmArgs`), the same at 00966934 (by its content
  before 1.0) and in a 2026 main version;
- `SamplingParams(end_id, pad_id, max_tokens, top_k, return_context_logits, detokenize)`:
  `tensorrt_llm/sampling_params.py` at 000a01de (1.0.0rc4) and at b35ac1b6 (1.2.0rc2), each
  dated by the `version.py` stored at the same commit; `top_k=1` is greedy in both;
- `KvCacheConfig(enable_block_reuse, free_gpu_memory_fraction)` (`llmapi/llm_args.py`; a
  strict pydantic model) and `LLM`, `SamplingParams`, `KvCacheConfig` in `tensorrt_llm.llmapi`;
- `RequestOutput.outputs[0].token_ids` (the new tokens: `exclude_input_from_output` defaults
  to True) and `.finish_reason` ("stop" at the end id), `RequestOutput.context_logits`
  [prompt, vocab]: `tensorrt_llm/executor/result.py` at 005bc848 (undated, late 2025 or
  later); with `detokenize` False (or no tokenizer) nothing is decoded.
Context logits on request (`return_context_logits`) in the PyTorch backend: TRTLLMSampler's
since PR #4538 (May 2025), both samplers' since #6867 (August 2025); the 1.1/1.2-era
`tests/unittest/_torch/sampler/test_return_logits.py` asks for them per request with either
sampler and xfails their length where a prefix was reused from the KV cache (nvbugs/5577178),
hence no block reuse here. A TensorRT-LLM that returns none is a one-line error.

TensorRT-LLM cannot be installed on the machines this project is developed on: the real run is
tests/test_llmapi_runtime.py's `trtllm` test; the calls above are tested against a stand-in
module with these signatures.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch

from ...core.errors import EngineError, InputError
from ...runtimes.generation import primary_end_id, trim
from .checkpoint.unified import is_unified

#: The first TensorRT-LLM whose `LLM` runs the PyTorch backend by default.
MIN_VERSION = (1, 0)
#: Of the GPU memory free once the model is loaded: the reference model runs beside it.
KV_CACHE_FRACTION = 0.5


def check_llmapi_checkpoint(directory: Path) -> None:
    """Refuse a directory that is not the llmapi target's checkpoint (a Hugging Face one:
    config.json with `architectures`, safetensors weights), in one line."""
    if not is_unified(directory) or not any(directory.glob("*.safetensors")):
        raise InputError(
            f"{directory} is not an llmapi checkpoint (config.json with `architectures` and "
            "safetensors weights): pass <variant>/checkpoint of a --target llmapi build"
        )


def import_llmapi() -> tuple[Any, str]:
    """(`tensorrt_llm.llmapi`, TensorRT-LLM's version) where TensorRT-LLM >= 1.0 is installed;
    otherwise a one-line EngineError that says where verify --runtime llmapi runs."""
    from packaging.version import InvalidVersion, Version

    try:
        with contextlib.redirect_stdout(sys.stderr):  # its import prints a banner on stdout
            import tensorrt_llm
            from tensorrt_llm import llmapi
    except ImportError:
        raise EngineError(
            "--runtime llmapi needs TensorRT-LLM >= 1.0 on an NVIDIA GPU host (the NGC "
            "container); verify the checkpoint with the checkpoint runtime here (--runtime reference)"
        ) from None
    version = str(getattr(tensorrt_llm, "__version__", "unknown"))
    try:
        too_old = Version(version).release[:2] < MIN_VERSION
    except InvalidVersion:
        too_old = True
    if too_old:
        raise EngineError(
            f"--runtime llmapi needs TensorRT-LLM >= 1.0 (its LLM() runs the PyTorch backend by "
            f"default), this host has {version}: upgrade it or use the NGC container"
        )
    return llmapi, version


class LlmApiRuntime:
    """An llmapi checkpoint directory run by TensorRT-LLM's `LLM(...)`: token ids in and out,
    greedy generation and teacher-forced (context) logits."""

    name = "llmapi"
    teacher_forced = True

    def __init__(self, checkpoint: Path, *, eos_token_id: int | None = None) -> None:
        check_llmapi_checkpoint(checkpoint)
        self.llmapi, self.version = import_llmapi()
        self.eos_token_id = eos_token_id
        self.llm = self.llmapi.LLM(
            model=str(checkpoint),
            skip_tokenizer_init=True,  # ids in and out: verify decodes with the model's tokenizer
            kv_cache_config=self.llmapi.KvCacheConfig(
                enable_block_reuse=False,  # a prefix read from the cache has no context logits
                free_gpu_memory_fraction=KV_CACHE_FRACTION,
            ),
        )

    def _generate(self, prompts: list[list[int]], **params: Any) -> list[Any]:
        sampling = self.llmapi.SamplingParams(top_k=1, detokenize=False, **params)
        return list(self.llm.generate(prompts, sampling_params=sampling, use_tqdm=False))

    def greedy_batch(
        self, prompts: list[list[int]], max_new_tokens: int, end_ids: set[int], pad_id: int = 0
    ) -> list[list[int]]:
        end_id = primary_end_id(end_ids, self.eos_token_id)
        outputs = self._generate(prompts, max_tokens=max_new_tokens, end_id=end_id, pad_id=pad_id)
        return [continuation(out.outputs[0], end_id, end_ids) for out in outputs]

    def forward(self, ids: torch.Tensor, **_: Any) -> torch.Tensor:
        """Teacher-forced logits: [tokens, vocab] for one sequence, [batch, tokens, vocab] for
        a batch of them."""
        rows = ids.reshape(-1, ids.shape[-1]).tolist()
        # one token is generated, so any valid end id will do
        outputs = self._generate(rows, max_tokens=1, end_id=self.eos_token_id or 0,
                                 return_context_logits=True)  # fmt: skip
        logits = [out.context_logits for out in outputs]
        if any(x is None for x in logits):
            raise EngineError(
                f"TensorRT-LLM {self.version} returned no context logits (teacher-forced "
                "figures): verify this checkpoint with --runtime reference"
            )
        return torch.stack([x.float().cpu() for x in logits]).reshape(*ids.shape, -1)


def continuation(output: Any, end_id: int, end_ids: set[int]) -> list[int]:
    """A CompletionOutput's tokens up to its first end id, ending with the end id where it
    stopped on one: the reference's continuations keep theirs."""
    tokens = list(output.token_ids)
    if output.finish_reason == "stop" and not (tokens and tokens[-1] in end_ids):
        tokens.append(end_id)  # a sampler that leaves the end id out of the tokens
    return trim(tokens, end_ids)
