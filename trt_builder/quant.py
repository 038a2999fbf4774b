"""One frozen dataclass per precision / quantization mode, chosen from `--dtype`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import SpecError

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "auto")  # auto: the checkpoint's own
DTYPE_CHOICES = ("float16", "bfloat16", "float32", "auto", "int8", "int8-wo")


@dataclass(frozen=True)
class FloatMode:
    """Weights and activations in one floating-point dtype (`auto`: the checkpoint's own, with
    float32 written as float16)."""

    dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.dtype not in FLOAT_DTYPES:
            raise SpecError(f"dtype {self.dtype!r} is not a float dtype: use one of {FLOAT_DTYPES}")

    @property
    def name(self) -> str:
        return self.dtype

    @property
    def quant_algo(self) -> str | None:
        return None

    def to_json(self) -> dict:
        return {"mode": "float", "version": 1, **asdict(self)}


@dataclass(frozen=True)
class WeightOnlyInt8:
    """W8A16: int8 weights with one scale per output channel (amax/128), activations in `dtype`.

    qkv, dense, fc, gate and proj are quantized; embeddings, norms and lm_head are not.
    """

    dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.dtype not in ("float16", "bfloat16"):
            raise SpecError(
                f"INT8 weight-only needs float16 or bfloat16 activations, not {self.dtype!r}"
            )

    @property
    def name(self) -> str:
        return "int8-wo"

    @property
    def quant_algo(self) -> str | None:
        return "W8A16"

    def to_json(self) -> dict:
        return {"mode": "weight_only_int8", "version": 1, **asdict(self)}


QuantMode = FloatMode | WeightOnlyInt8


def mode_for(dtype: str) -> tuple[QuantMode, str | None]:
    """Return the mode for a `--dtype` value and a notice to show the user, if any."""
    if dtype in FLOAT_DTYPES:
        return FloatMode(dtype), None
    if dtype == "int8-wo":
        return WeightOnlyInt8(), None
    if dtype == "int8":
        return WeightOnlyInt8(), (
            "--dtype int8 builds INT8 weight-only (W8A16) until calibrated SmoothQuant lands; "
            "say --dtype int8-wo to keep this choice when it does"
        )
    raise SpecError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_CHOICES)}")
