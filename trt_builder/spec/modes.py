"""One frozen dataclass per precision / quantization mode, chosen from `--dtype`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..core.errors import SpecError

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "auto")  # auto: the checkpoint's own
DTYPE_CHOICES = ("float16", "bfloat16", "float32", "auto", "int8", "int8-wo")


@dataclass(frozen=True)
class FloatMode:
    """Weights and activations in one floating-point dtype (`auto`: the checkpoint's own, with
    float32 written as float16)."""

    dtype: str = "float16"
    kv_int8: bool = False  # the INT8 KV cache (calibrated, trt_builder/convert/kvcache.py)

    def __post_init__(self) -> None:
        if self.dtype not in FLOAT_DTYPES:
            raise SpecError(f"dtype {self.dtype!r} is not a float dtype: use one of {FLOAT_DTYPES}")

    @property
    def needs_calibration(self) -> bool:
        return self.kv_int8

    @property
    def name(self) -> str:
        return self.dtype + ("-kv8" if self.kv_int8 else "")

    @property
    def quant_algo(self) -> str | None:
        return None

    def to_json(self) -> dict:
        return {"mode": "float", "version": 1, **asdict(self)}


@dataclass(frozen=True)
class WeightOnlyInt8:
    """W8A16: int8 weights with one scale per output channel (amax/128), activations in `dtype`.

    qkv, dense, fc, gate and proj are quantized; embeddings, norms and lm_head are not. `clip`:
    each row of qkv, dense, fc and gate is written clamped to the fraction of its range that
    minimises the calibrated output error of the builder's rounding (convert/clipping.py).
    """

    dtype: str = "float16"
    kv_int8: bool = False  # the INT8 KV cache (calibrated, trt_builder/convert/kvcache.py)
    clip: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in ("float16", "bfloat16"):
            raise SpecError(
                f"INT8 weight-only needs float16 or bfloat16 activations, not {self.dtype!r}"
            )

    @property
    def needs_calibration(self) -> bool:
        return self.kv_int8 or self.clip

    @property
    def name(self) -> str:
        # plain rounding is another build of the model: its own variant, not the clipped one's
        return "int8-wo" + ("" if self.clip else "-noclip") + ("-kv8" if self.kv_int8 else "")

    @property
    def quant_algo(self) -> str | None:
        return "W8A16"

    def to_json(self) -> dict:
        return {"mode": "weight_only_int8", "version": 2, **asdict(self)}  # 2: clip


@dataclass(frozen=True)
class SmoothQuant:
    """W8A8 SmoothQuant in TensorRT-LLM's plugin formats: int8 weights with one scale per output
    channel, int8 activations with a dynamic scale per token (`per_token`) or one static scale
    per tensor, smoothed by `alpha` (docs/quantization.md). `kv_int8` adds the INT8 KV cache.

    The plugin formats (W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN / _PER_TENSOR_PLUGIN) rather than
    the native W8A8_SQ_PER_CHANNEL: only they offer per-token activation scales, and every
    pinned release (0.20-1.2) builds them with the SmoothQuant plugin."""

    alpha: float | None = 0.5  # None: searched (trt_builder/convert/recipe.py)
    per_token: bool = True
    kv_int8: bool = False
    dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise SpecError(f"SmoothQuant alpha must be between 0 and 1, not {self.alpha}")
        if self.dtype not in ("float16", "bfloat16"):
            raise SpecError(
                f"SmoothQuant needs float16 or bfloat16 activations, not {self.dtype!r}"
            )

    @property
    def needs_calibration(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return "int8-sq" + ("" if self.per_token else "-static") + ("-kv8" if self.kv_int8 else "")

    @property
    def quant_algo(self) -> str | None:
        granularity = "PER_TOKEN" if self.per_token else "PER_TENSOR"
        return f"W8A8_SQ_PER_CHANNEL_{granularity}_PLUGIN"

    def to_json(self) -> dict:
        return {"mode": "smoothquant", "version": 1, **asdict(self)}


QuantMode = FloatMode | WeightOnlyInt8 | SmoothQuant


KV_CACHE_CHOICES = ("model", "int8")  # model: the KV cache in the model dtype
GRANULARITIES = ("per-token", "per-tensor")


def mode_for(
    dtype: str,
    *,
    kv_cache: str = "model",
    alpha: float | None = None,
    granularity: str = "per-token",
    wo_clip: bool = True,
) -> tuple[QuantMode, str | None]:
    """Return the mode for a `--dtype` value (and the INT8 options) and a notice, if any."""
    if kv_cache not in KV_CACHE_CHOICES:
        raise SpecError(f"kv_cache must be one of {', '.join(KV_CACHE_CHOICES)}, not {kv_cache!r}")
    if granularity not in GRANULARITIES:
        raise SpecError(f"int8.granularity must be one of {', '.join(GRANULARITIES)}")
    kv_int8 = kv_cache == "int8"
    if dtype == "int8":  # calibrated SmoothQuant W8A8, the default INT8 recipe
        return SmoothQuant(alpha, granularity == "per-token", kv_int8), None
    if dtype in FLOAT_DTYPES:
        return FloatMode(dtype, kv_int8), None
    if dtype == "int8-wo":
        return WeightOnlyInt8(kv_int8=kv_int8, clip=wo_clip), None
    raise SpecError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_CHOICES)}")
