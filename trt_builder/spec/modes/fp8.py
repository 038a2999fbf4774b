"""The FP8 room (`--dtype fp8`: per-tensor W8A8 in e4m3, TensorRT-LLM's FP8Linear)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, ClassVar

from ..gates import Gate
from .base import Mode, ModeOptions, WeightStorage
from .kvcache import KV_CACHE_CHOICES, check_kv
from .sixteen import check_16_bit
from .sixteen import sixteen_bit as _sixteen

#: e4m3 weights, two float32 scales per linear (its weight's and its input's)
FP8_WEIGHTS = WeightStorage("fp8", Fraction(8), scale_bytes_per_linear=8)


@dataclass(frozen=True)
class Fp8(Mode):
    """FP8 per-tensor W8A8 (`quant_algo: FP8`, TensorRT-LLM's FP8Linear): e4m3 weights and
    activations, each GEMM with one float32 dequantization scale per tensor for its weight and
    one for its input (amax / 448, the input's from calibration); norms, embeddings and lm_head
    stay in `dtype`, lm_head listed in `exclude_modules` (convert/fp8.py, docs/quantization.md).

    `search`: the recipe stage chooses each weight's e4m3 rounding, error-compensated against
    the float GEMM or plain round-to-nearest, by measured accuracy (recipe/fp8.py); off, every
    weight is rounded to nearest, as modelopt's exporter writes it (no recipe stage)."""

    CHOICES: ClassVar[dict[str, str]] = {"fp8": "fp8 (calibrated FP8 W8A8, SM 89+)"}
    GATES: ClassVar[dict[str, Gate]] = {
        # FP8 per-tensor W8A8 with calibrated amax scales
        "fp8": Gate(min_top1=0.85, max_kl=0.1, max_ppl_delta_pct=5.0),
    }
    DOCTOR: ClassVar[dict[str, tuple[str, ...]]] = {"fp8": ("fp8",)}

    dtype: str = "float16"
    kv_cache: str = "model"  # model, int8 or fp8
    search: bool = True

    def __post_init__(self) -> None:
        check_16_bit("FP8", self.dtype)
        check_kv(self.kv_cache)

    @classmethod
    def choose(cls, choice: str, kv_cache: str, options: ModeOptions) -> Mode:
        return cls(kv_cache=kv_cache, search=options.fp8_search)

    @classmethod
    def variants(cls) -> Iterator[Mode]:
        for search in (True, False):
            for kv in KV_CACHE_CHOICES:
                yield cls(kv_cache=kv, search=search)

    @classmethod
    def of_checkpoint(cls, quant_algo: object, kv_cache: str, dtype: str) -> Mode | None:
        # a simulation's float32 checkpoint (the recipe search's) holds its mode too
        return cls(_sixteen(dtype), kv_cache) if quant_algo == "FP8" else None

    @property
    def needs_calibration(self) -> bool:
        return True

    @property
    def searches(self) -> bool:
        return self.search

    @property
    def base_name(self) -> str:
        return "fp8" + ("" if self.search else "-nosearch")

    @property
    def quant_algo(self) -> str | None:
        return "FP8"

    @property
    def gate_key(self) -> str:
        return "fp8"

    @property
    def gemm_needs(self) -> tuple[str, ...]:
        return ("fp8",)

    @property
    def activations(self) -> str | None:
        return "e4m3"

    @property
    def weights(self) -> WeightStorage | None:
        return FP8_WEIGHTS

    def kv_refusal(self) -> str | None:
        if self.kv_int8:
            return "--dtype fp8 with --kv-cache int8 is not built: use --kv-cache fp8 (or model)"
        return None

    def to_json(self) -> dict[str, Any]:
        return {"mode": "fp8", "version": 2, **asdict(self)}  # 2: search
