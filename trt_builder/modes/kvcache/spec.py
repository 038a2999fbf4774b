"""The KV cache's room: what `--kv-cache` offers (model, int8, fp8) and everything each choice
decides, whatever the mode beside it: its name suffix, its `kv_cache_quant_algo`, what it adds
to a verify gate and the GPU feature it needs (which targets run it: each target's room says). Its scales are computed
and written by modes/kvcache/convert.py, for every converter and target."""

from __future__ import annotations

from ...core.errors import SpecError

KV_CACHE_CHOICES = ("model", "int8", "fp8")  # model: the KV cache in the model dtype
#: The suffix of a mode name for each quantized KV cache.
KV_SUFFIX = {"model": "", "int8": "-kv8", "fp8": "-fp8kv"}
#: The checkpoint's kv_cache_quant_algo for each (TensorRT-LLM's QuantAlgo names).
KV_QUANT_ALGO = {"int8": "INT8", "fp8": "FP8"}
#: How much a quantized KV cache may raise a build's held-out perplexity, in percent of the
#: same build's without it: verify decodes such a checkpoint's held-out text through the cache,
#: where its rounding shows (docs/verify.md), and its gate is the mode's with this on top. A
#: share, not points over the float model: the cache's rounding costs more on a build that is
#: already further from it (FP8 cache, default model: about 0.06% on float16 and 0.2% on fp8,
#: 1.48% on w4a8-awq and 1.43% on nvfp4, the same with a finer scale: docs/verify.md). FP8's
#: e4m3 keeps 3 mantissa bits: a coarser cache than INT8's balanced one.
KV_PPL_PCT = {"int8": 0.5, "fp8": 2.0}
#: The GPU feature (spec/gpus.py: FEATURES) each quantized KV cache needs.
KV_NEEDS = {"int8": "int8", "fp8": "fp8"}
#: `trt-builder doctor`'s rows for them: row name -> the GPU features it needs.
KV_DOCTOR = {f"kv-cache {kv}": (need,) for kv, need in KV_NEEDS.items()}


def check_kv(kv_cache: str) -> None:
    if kv_cache not in KV_CACHE_CHOICES:
        raise SpecError(f"kv_cache must be one of {', '.join(KV_CACHE_CHOICES)}, not {kv_cache!r}")


#: modelopt's description of an FP8 (e4m3) tensor in config.json's quantization_config.
FP8_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}
#: config.json's kv_cache_scheme for each quantized KV cache modelopt's unified format writes.
KV_SCHEME = {"fp8": FP8_SCHEME}


def kv_quant_algo_of_scheme(scheme: object) -> str | None:
    """The kv_cache_quant_algo of config.json's modelopt `kv_cache_scheme` (None: none):
    modelopt's unified format writes one for the FP8 KV cache alone."""
    return KV_QUANT_ALGO["fp8"] if scheme else None


def kv_cache_of(quant_algo: object) -> str:
    """The --kv-cache choice of a checkpoint's kv_cache_quant_algo (None: model)."""
    return next((kv for kv, algo in KV_QUANT_ALGO.items() if algo == quant_algo), "model")


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
