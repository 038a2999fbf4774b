"""The engine target (--target engine, the default): a TensorRT-LLM checkpoint for trtllm-build
(0.20-1.2), its engine, and an inflight_batcher_llm Triton repository. Its stages are the
pipeline's own: convert (convert.py here), engine/ (trtllm-build) and package (triton.py here,
writing triton/repository.py's layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ..base import Target

if TYPE_CHECKING:
    from ...spec.build import BuildSpec


class EngineTarget(Target):
    name: ClassVar[str] = "engine"
    MAKES: ClassVar[str] = (
        "a TensorRT-LLM checkpoint, trtllm-build's engine (0.20-1.2) and an "
        "inflight_batcher_llm Triton repository; the limits are trtllm-build's"
    )
    builds_engine: ClassVar[bool] = True

    @property
    def variant_suffix(self) -> str:
        return ""

    def convert_params(self, spec: BuildSpec) -> dict[str, Any]:
        return {"mode": spec.mode.to_json(), "tp": spec.tp, "pp": spec.pp}
