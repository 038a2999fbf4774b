"""The weight-only INT8 room (`--dtype int8-wo`, W8A16)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, ClassVar

from ...spec.gates import Gate
from ..base import Mode, ModeOptions, WeightStorage
from ..kvcache.spec import KV_CACHE_CHOICES, check_kv
from ..sixteen import check_16_bit
from ..sixteen import sixteen_bit as _sixteen

INT8_WEIGHTS = WeightStorage("int8", Fraction(8), scale_bytes_per_row=4)  # a float32 per row


@dataclass(frozen=True)
class WeightOnlyInt8(Mode):
    """W8A16: int8 weights with one scale per output channel (amax/128), activations in `dtype`.

    qkv, dense, fc, gate and proj are quantized; embeddings, norms and lm_head are not. `clip`:
    each row of qkv, dense, fc and gate is written clamped to the fraction of its range that
    minimises the calibrated output error of the builder's rounding (modes/weight_only/convert.py).
    """

    CHOICES: ClassVar[dict[str, str]] = {"int8-wo": "int8-wo (W8A16)"}
    GATES: ClassVar[dict[str, Gate]] = {
        "int8-wo": Gate(min_top1=0.95, max_kl=2e-2, max_ppl_delta_pct=2.0),
    }
    DOCTOR: ClassVar[dict[str, tuple[str, ...]]] = {"int8-wo": ("int8",)}
    #: WeightOnlyQuantLinearMethod (TensorRT-LLM 1.x); vLLM's modelopt path has no W8A16.
    LOADED_BY: ClassVar[tuple[str, ...]] = ("tensorrt-llm 1.0", "tensorrt-llm 1.1",
                                            "tensorrt-llm 1.2")  # fmt: skip

    dtype: str = "float16"
    kv_cache: str = "model"  # model, int8 or fp8
    clip: bool = True

    def __post_init__(self) -> None:
        check_16_bit("INT8 weight-only", self.dtype)
        check_kv(self.kv_cache)

    @classmethod
    def choose(cls, choice: str, kv_cache: str, options: ModeOptions) -> Mode:
        return cls(kv_cache=kv_cache, clip=options.wo_clip)

    @classmethod
    def variants(cls) -> Iterator[Mode]:
        for clip in (True, False):
            for kv in KV_CACHE_CHOICES:
                yield cls(kv_cache=kv, clip=clip)

    @classmethod
    def of_checkpoint(cls, quant_algo: object, kv_cache: str, dtype: str) -> Mode | None:
        # a simulation's float32 checkpoint (the recipe search's) holds its mode too
        return cls(_sixteen(dtype), kv_cache) if quant_algo == "W8A16" else None

    @property
    def needs_calibration(self) -> bool:
        return self.kv_cache != "model" or self.clip

    @property
    def static_weights(self) -> bool:
        return True  # the clipping a checkpoint records is replayed (verify/diagnose.py)

    @property
    def quantizes_hf_weights(self) -> bool:
        return True

    @property
    def clips(self) -> bool:
        return self.clip

    @property
    def base_name(self) -> str:
        # plain rounding is another build of the model: its own variant, not the clipped one's
        return "int8-wo" + ("" if self.clip else "-noclip")

    @property
    def quant_algo(self) -> str | None:
        return "W8A16"

    @property
    def gate_key(self) -> str:
        return "int8-wo"

    @property
    def gemm_needs(self) -> tuple[str, ...]:
        return ("int8",)

    @property
    def weights(self) -> WeightStorage | None:
        return INT8_WEIGHTS

    def hf_linear_problems(
        self, header: dict[str, Any], base: str, *, input_scale_required: bool, source: str
    ) -> list[str]:
        """INT8 values, [out, in], and one float scale per output row (WeightOnlyQuantLinearMethod)."""
        weight, scale = header.get(f"{base}.weight"), header.get(f"{base}.weight_scale")
        if weight is None or weight["dtype"] != "I8" or len(weight["shape"]) != 2:
            return [f"{base}.weight is not an I8 [out, in] matrix ({source})"]
        if scale is None or scale["shape"] != weight["shape"][:1]:
            return [f"{base}.weight_scale is not one scale per output row ({source})"]
        return []

    def to_json(self) -> dict[str, Any]:
        return {"mode": "weight_only_int8", "version": 3, **asdict(self)}  # 2: clip, 3: kv_cache
