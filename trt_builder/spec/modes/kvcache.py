"""The KV cache's room: what `--kv-cache` offers (model, int8, fp8) and everything each choice
decides, whatever the mode beside it: its name suffix, its `kv_cache_quant_algo`, what it adds
to a verify gate, the GPU feature it needs, and which targets run it. Its scales are computed
and written by convert/kvcache.py, for every converter and target."""

from __future__ import annotations

from ...core.errors import SpecError

KV_CACHE_CHOICES = ("model", "int8", "fp8")  # model: the KV cache in the model dtype
#: The suffix of a mode name for each quantized KV cache.
KV_SUFFIX = {"model": "", "int8": "-kv8", "fp8": "-fp8kv"}
#: The checkpoint's kv_cache_quant_algo for each (TensorRT-LLM's QuantAlgo names).
KV_QUANT_ALGO = {"int8": "INT8", "fp8": "FP8"}
#: What a quantized KV cache may add to a mode's held-out perplexity gate, in points: verify
#: decodes such a checkpoint's held-out text through the cache, where its rounding shows
#: (docs/verify.md), and the cache is to cost at most this over the same build without it.
#: FP8's e4m3 keeps 3 mantissa bits: a coarser cache than INT8's balanced one on the default
#: model (docs/benchmarks.md).
KV_PPL_POINTS = {"int8": 0.5, "fp8": 1.5}
#: The GPU feature (spec/gpus.py: FEATURES) each quantized KV cache needs.
KV_NEEDS = {"int8": "int8", "fp8": "fp8"}
#: `trt-builder doctor`'s rows for them: row name -> the GPU features it needs.
KV_DOCTOR = {f"kv-cache {kv}": (need,) for kv, need in KV_NEEDS.items()}


def check_kv(kv_cache: str) -> None:
    if kv_cache not in KV_CACHE_CHOICES:
        raise SpecError(f"kv_cache must be one of {', '.join(KV_CACHE_CHOICES)}, not {kv_cache!r}")


def kv_cache_of(quant_algo: object) -> str:
    """The --kv-cache choice of a checkpoint's kv_cache_quant_algo (None: model)."""
    return next((kv for kv, algo in KV_QUANT_ALGO.items() if algo == quant_algo), "model")


def kv_refusal(kv_cache: str, target: str, quant_algo: str | None, dtype: str) -> str | None:
    """Why `target` does not build this KV cache beside a mode of `quant_algo` (`dtype`: the
    --dtype given), or None. TensorRT-LLM's PyTorch backend (llmapi) has no INT8 KV cache (its
    KV cache dtypes are the model's, FP8 and NVFP4), and its LLM API refuses a pre-quantized
    checkpoint without quant_algo (docs/llmapi.md)."""
    if target != "llmapi":
        return None
    if kv_cache == "int8":
        return (
            "--kv-cache int8 is not built for --target llmapi: TensorRT-LLM's PyTorch backend "
            "has no INT8 KV cache; use --kv-cache fp8 (SM 89+) or model, or --target engine"
        )
    if kv_cache == "fp8" and quant_algo is None:
        return (
            f"--dtype {dtype} --kv-cache fp8 is not built for --target llmapi: TensorRT-LLM's "
            "LLM API refuses a pre-quantized checkpoint without quant_algo; use --dtype fp8 "
            "--kv-cache fp8, or serve the float checkpoint with kv_cache_config dtype fp8"
        )
    return None


class KVCache:
    """What every mode says of its KV cache (`kv_cache`: model, int8 or fp8)."""

    kv_cache: str

    @property
    def kv_int8(self) -> bool:
        return self.kv_cache == "int8"

    @property
    def kv_fp8(self) -> bool:
        return self.kv_cache == "fp8"

    @property
    def kv_cache_quant_algo(self) -> str | None:
        return KV_QUANT_ALGO.get(self.kv_cache)
