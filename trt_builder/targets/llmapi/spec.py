"""The llmapi target (--target llmapi, docs/llmapi.md): a Hugging Face checkpoint (modelopt's
unified format for a quantized one) that TensorRT-LLM's PyTorch backend (`LLM(...)`,
trtllm-serve) and vLLM load, and a Triton repository of the llmapi model; no engine. Its room
holds the rest: the checkpoint format and the loaders' table (checkpoint/), its conversion
(convert.py), TensorRT-LLM's LLM() as verify's runtime (engine.py) and its repository and
trtllm-serve command (triton.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ...core.errors import UnsupportedModelError
from ...modes import Mode
from ..base import Target

if TYPE_CHECKING:
    from ...spec.build import BuildSpec


class LlmApiTarget(Target):
    name: ClassVar[str] = "llmapi"
    MAKES: ClassVar[str] = (
        "a Hugging Face checkpoint for TensorRT-LLM's PyTorch backend (LLM(), "
        "trtllm-serve) and vLLM, and a Triton llmapi repository; no engine; the limits are LLM() "
        "arguments (model.yaml, trtllm-serve.yaml)"
    )
    builds_engine: ClassVar[bool] = False
    #: TensorRT-LLM's PyTorch backend has no INT8 KV cache (its KV cache dtypes are the
    #: model's, FP8 and NVFP4).
    KV_CACHES: ClassVar[tuple[str, ...]] = ("model", "fp8")
    #: vLLM's LLM() loads its checkpoints (runtimes/vllm.py), of the modes whose rooms name its
    #: loader (Mode.LOADED_BY; checkpoint/loaders.py: CONTRACTS).
    VERIFY_RUNTIMES: ClassVar[tuple[str, ...]] = ("reference", "vllm")
    VERIFY_LOADERS: ClassVar[dict[str, str]] = {"vllm": "vllm 0.10-0.34"}

    def verify_refusal(self, runtime: str, mode: Mode) -> str | None:
        loader = self.VERIFY_LOADERS.get(runtime)
        if loader is None or mode.quant_algo is None or loader in mode.LOADED_BY:
            return None
        return (
            f"verify.runtime {runtime} cannot run --dtype {mode.name}: {loader}'s modelopt loader "
            f"refuses {mode.quant_algo} (docs/llmapi.md); use verify.runtime reference"
        )

    def gpu_needs(self, mode: Mode) -> tuple[str, ...]:
        return mode.hf_gpu_needs  # its loaders' (vLLM's Marlin runs NVFP4 weight-only)

    def kv_refusal(self, mode: Mode, dtype: str) -> str | None:
        """No INT8 KV cache; and its LLM API refuses a pre-quantized checkpoint without
        quant_algo (docs/llmapi.md), so a quantized KV cache needs a quantized mode."""
        if mode.kv_cache not in self.KV_CACHES:
            return (
                f"--kv-cache {mode.kv_cache} is not built for --target llmapi: TensorRT-LLM's "
                f"PyTorch backend has no {mode.kv_cache.upper()} KV cache; use --kv-cache fp8 "
                "(SM 89+) or model, or --target engine"
            )
        if mode.kv_cache != "model" and mode.quant_algo is None:
            return (
                f"--dtype {dtype} --kv-cache {mode.kv_cache} is not built for --target llmapi: "
                "TensorRT-LLM's LLM API refuses a pre-quantized checkpoint without quant_algo; "
                f"use --dtype fp8 --kv-cache {mode.kv_cache}, or serve the float checkpoint "
                f"with kv_cache_config dtype {mode.kv_cache}"
            )
        return None

    def refuse_family(self, family: Any, architecture: str) -> None:
        if family.no_llmapi:
            raise UnsupportedModelError(
                f"--target llmapi is not built for {architecture}: {family.no_llmapi}"
            )

    def engine_refusal(self) -> str | None:
        return (
            "--target llmapi builds no engine: TensorRT-LLM's PyTorch backend runs its "
            "checkpoint; run trt-builder package (or build), or use --target engine"
        )

    def here(self, report: dict[str, Any], *, tritonserver: bool) -> str:
        """It builds wherever torch runs (float dtypes, int8-wo and fp8; not SmoothQuant or the
        INT8 KV cache); its repository is served on the reference backend by any tritonserver
        with the Python backend; where TensorRT-LLM >= 1.0 is installed, its own LLM() runs the
        checkpoint (verify --runtime llmapi) and the repository gets its own llmapi model
        (docs/llmapi.md)."""
        serve = (
            "served on the reference backend (llmapi contract)"
            if tritonserver
            else "not served: no tritonserver"
        )
        version = str(report.get("tensorrt_llm") or "")
        installed = (
            f"; TensorRT-LLM {version} here runs its checkpoint (LLM(), verify --runtime llmapi, "
            "trtllm-serve) and its own llmapi model serves the repository"
            if version[:1].isdigit() and not version.startswith("0.")
            else ""
        )
        return f"yes: builds (float dtypes, int8-wo, fp8), {serve}{installed}"

    def convert_params(self, spec: BuildSpec) -> dict[str, Any]:
        # one Hugging Face checkpoint: tp and pp are serving's
        return {"mode": spec.mode.to_json(), "target": self.name}
