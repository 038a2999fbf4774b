"""The float room: weights and activations in one floating-point dtype (`--dtype float16`,
bfloat16, float32, auto)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from ...core.errors import SpecError
from ...spec.gates import Gate
from ..base import Mode, ModeOptions
from ..kvcache.spec import KV_CACHE_CHOICES, check_kv

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "auto")  # auto: the checkpoint's own


@dataclass(frozen=True)
class FloatMode(Mode):
    """Weights and activations in one floating-point dtype (`auto`: the checkpoint's own, with
    float32 written as float16)."""

    CHOICES: ClassVar[dict[str, str]] = {
        "float16": "float16 (default)", "bfloat16": "bfloat16", "float32": "float32",
        "auto": "auto",
    }  # fmt: skip
    GATES: ClassVar[dict[str, Gate]] = {
        "float32": Gate(min_top1=0.999, max_kl=1e-4, max_ppl_delta_pct=0.01),
        "float16": Gate(min_top1=0.99, max_kl=1e-3, max_ppl_delta_pct=0.1),
        "bfloat16": Gate(min_top1=0.95, max_kl=1e-2, max_ppl_delta_pct=1.0),
    }
    DOCTOR: ClassVar[dict[str, tuple[str, ...]]] = {
        "float16": (), "bfloat16": ("bf16",), "float32": (),
    }  # fmt: skip

    dtype: str = "float16"
    #: model, int8 (calibrated, modes/kvcache/convert.py) or fp8 (calibrated, modes/kvcache/convert.py)
    kv_cache: str = "model"

    def __post_init__(self) -> None:
        if self.dtype not in FLOAT_DTYPES:
            raise SpecError(f"dtype {self.dtype!r} is not a float dtype: use one of {FLOAT_DTYPES}")
        check_kv(self.kv_cache)

    @classmethod
    def choose(cls, choice: str, kv_cache: str, options: ModeOptions) -> Mode:
        return cls(choice, kv_cache)

    @classmethod
    def variants(cls) -> Iterator[Mode]:
        for dtype in FLOAT_DTYPES:
            for kv in KV_CACHE_CHOICES:
                yield cls(dtype, kv)

    @classmethod
    def of_checkpoint(cls, quant_algo: object, kv_cache: str, dtype: str) -> Mode | None:
        return cls(dtype, kv_cache) if quant_algo is None and dtype in cls.GATES else None

    @property
    def static_weights(self) -> bool:
        return True

    @property
    def base_name(self) -> str:
        return self.dtype

    @property
    def gate_key(self) -> str:
        return self.dtype

    def to_json(self) -> dict[str, Any]:
        return {"mode": "float", "version": 2, **asdict(self)}  # 2: kv_cache
