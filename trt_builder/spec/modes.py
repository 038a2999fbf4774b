"""One frozen dataclass per precision / quantization mode, chosen from `--dtype`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..core.errors import SpecError

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "auto")  # auto: the checkpoint's own
DTYPE_CHOICES = ("float16", "bfloat16", "float32", "auto", "int8", "int8-wo", "fp8")
KV_CACHE_CHOICES = ("model", "int8", "fp8")  # model: the KV cache in the model dtype
#: The suffix of a mode name for each quantized KV cache.
KV_SUFFIX = {"model": "", "int8": "-kv8", "fp8": "-fp8kv"}


def _check_kv(kv_cache: str) -> None:
    if kv_cache not in KV_CACHE_CHOICES:
        raise SpecError(f"kv_cache must be one of {', '.join(KV_CACHE_CHOICES)}, not {kv_cache!r}")


def _check_16_bit(mode: str, dtype: str) -> None:
    if dtype not in ("float16", "bfloat16"):
        raise SpecError(f"{mode} needs float16 or bfloat16 activations, not {dtype!r}")


class _KVCache:
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
        return {"int8": "INT8", "fp8": "FP8"}.get(self.kv_cache)


@dataclass(frozen=True)
class FloatMode(_KVCache):
    """Weights and activations in one floating-point dtype (`auto`: the checkpoint's own, with
    float32 written as float16)."""

    dtype: str = "float16"
    #: model, int8 (calibrated, trt_builder/convert/kvcache.py) or fp8 (calibrated, convert/fp8.py)
    kv_cache: str = "model"

    def __post_init__(self) -> None:
        if self.dtype not in FLOAT_DTYPES:
            raise SpecError(f"dtype {self.dtype!r} is not a float dtype: use one of {FLOAT_DTYPES}")
        _check_kv(self.kv_cache)

    @property
    def needs_calibration(self) -> bool:
        return self.kv_cache != "model"

    @property
    def name(self) -> str:
        return self.dtype + KV_SUFFIX[self.kv_cache]

    @property
    def quant_algo(self) -> str | None:
        return None

    def to_json(self) -> dict:
        return {"mode": "float", "version": 2, **asdict(self)}  # 2: kv_cache


@dataclass(frozen=True)
class WeightOnlyInt8(_KVCache):
    """W8A16: int8 weights with one scale per output channel (amax/128), activations in `dtype`.

    qkv, dense, fc, gate and proj are quantized; embeddings, norms and lm_head are not. `clip`:
    each row of qkv, dense, fc and gate is written clamped to the fraction of its range that
    minimises the calibrated output error of the builder's rounding (convert/clipping.py).
    """

    dtype: str = "float16"
    kv_cache: str = "model"  # model, int8 or fp8
    clip: bool = True

    def __post_init__(self) -> None:
        _check_16_bit("INT8 weight-only", self.dtype)
        _check_kv(self.kv_cache)

    @property
    def needs_calibration(self) -> bool:
        return self.kv_cache != "model" or self.clip

    @property
    def name(self) -> str:
        # plain rounding is another build of the model: its own variant, not the clipped one's
        return "int8-wo" + ("" if self.clip else "-noclip") + KV_SUFFIX[self.kv_cache]

    @property
    def quant_algo(self) -> str | None:
        return "W8A16"

    def to_json(self) -> dict:
        return {"mode": "weight_only_int8", "version": 3, **asdict(self)}  # 2: clip, 3: kv_cache


@dataclass(frozen=True)
class SmoothQuant(_KVCache):
    """W8A8 SmoothQuant in TensorRT-LLM's plugin formats: int8 weights with one scale per output
    channel, int8 activations with a dynamic scale per token (`per_token`) or one static scale
    per tensor, smoothed by `alpha` (docs/quantization.md). `kv_cache` int8 adds the INT8 KV cache.

    The plugin formats (W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN / _PER_TENSOR_PLUGIN) rather than
    the native W8A8_SQ_PER_CHANNEL: only they offer per-token activation scales, and every
    pinned release (0.20-1.2) builds them with the SmoothQuant plugin."""

    alpha: float | None = 0.5  # None: searched (trt_builder/convert/recipe.py)
    per_token: bool = True
    kv_cache: str = "model"  # model, int8 or fp8
    dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise SpecError(f"SmoothQuant alpha must be between 0 and 1, not {self.alpha}")
        _check_16_bit("SmoothQuant", self.dtype)
        _check_kv(self.kv_cache)

    @property
    def needs_calibration(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return "int8-sq" + ("" if self.per_token else "-static") + KV_SUFFIX[self.kv_cache]

    @property
    def quant_algo(self) -> str | None:
        granularity = "PER_TOKEN" if self.per_token else "PER_TENSOR"
        return f"W8A8_SQ_PER_CHANNEL_{granularity}_PLUGIN"

    def to_json(self) -> dict:
        return {"mode": "smoothquant", "version": 2, **asdict(self)}  # 2: kv_cache


@dataclass(frozen=True)
class Fp8(_KVCache):
    """FP8 per-tensor W8A8 (`quant_algo: FP8`, TensorRT-LLM's FP8Linear): e4m3 weights and
    activations, each GEMM with one float32 dequantization scale per tensor for its weight and
    one for its input (amax / 448, the input's from calibration); norms, embeddings and lm_head
    stay in `dtype`, lm_head listed in `exclude_modules` (convert/fp8.py, docs/quantization.md).

    `search`: the recipe stage chooses each weight's e4m3 rounding, error-compensated against
    the float GEMM or plain round-to-nearest, by measured accuracy (recipe/fp8.py); off, every
    weight is rounded to nearest, as modelopt's exporter writes it (no recipe stage)."""

    dtype: str = "float16"
    kv_cache: str = "model"  # model, int8 or fp8
    search: bool = True

    def __post_init__(self) -> None:
        _check_16_bit("FP8", self.dtype)
        _check_kv(self.kv_cache)

    @property
    def needs_calibration(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return "fp8" + ("" if self.search else "-nosearch") + KV_SUFFIX[self.kv_cache]

    @property
    def quant_algo(self) -> str | None:
        return "FP8"

    def to_json(self) -> dict:
        return {"mode": "fp8", "version": 2, **asdict(self)}  # 2: search


QuantMode = FloatMode | WeightOnlyInt8 | SmoothQuant | Fp8


GRANULARITIES = ("per-token", "per-tensor")


def mode_for(
    dtype: str,
    *,
    kv_cache: str = "model",
    alpha: float | None = None,
    granularity: str = "per-token",
    wo_clip: bool = True,
    fp8_search: bool = True,
) -> tuple[QuantMode, str | None]:
    """Return the mode for a `--dtype` value (and the INT8 options) and a notice, if any."""
    _check_kv(kv_cache)
    if granularity not in GRANULARITIES:
        raise SpecError(f"int8.granularity must be one of {', '.join(GRANULARITIES)}")
    if dtype == "int8":  # calibrated SmoothQuant W8A8, the default INT8 recipe
        return SmoothQuant(alpha, granularity == "per-token", kv_cache), None
    if dtype in FLOAT_DTYPES:
        return FloatMode(dtype, kv_cache), None
    if dtype == "int8-wo":
        return WeightOnlyInt8(kv_cache=kv_cache, clip=wo_clip), None
    if dtype == "fp8":
        return Fp8(kv_cache=kv_cache, search=fp8_search), None
    raise SpecError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_CHOICES)}")
