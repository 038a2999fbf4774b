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

import torch

from ..core.digests import sha256_file
from ..core.errors import EngineError, InputError
from ..runtimes.generation import primary_end_id, trim
from .build import check_engine


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
                "container); verify the checkpoint with the checkpoint runtime here"
            ) from None
        if not (engine_dir / "config.json").is_file():
            raise InputError(f"{engine_dir} has no config.json: pass an engine directory")

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
