"""What every quantization mode answers. A mode is one room (a module of this package): a
frozen config with everything the mode decides. The rest of trt-builder asks it (these
methods), or the registry (`__init__.py`); it never tests a mode's name or class."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from ..gates import Gate
from .kvcache import KV_NEEDS, KV_SUFFIX, KVCache


@dataclass(frozen=True)
class ModeOptions:
    """What the spec's option sections ([int8], [fp8]) say; each room takes what it uses."""

    alpha: float | None = None  # SmoothQuant: None searches it
    granularity: str = "per-token"  # SmoothQuant: per-token or per-tensor
    wo_clip: bool = True  # weight-only INT8: calibrated clipping
    fp8_search: bool = True  # FP8: the searched rounding


@dataclass(frozen=True)
class WeightStorage:
    """How a mode stores its quantized linears, for the memory plan (engine/memplan.py)."""

    name: str  # as the plan names the linears' dtype
    bits: Fraction  # per weight
    scale_bytes_per_row: int = 0  # per output row of each linear (per-channel scales)
    scale_bytes_per_linear: int = 0  # per linear (per-tensor scales)

    def bytes(self, params: int, rows: int, linears: int) -> int:
        """Bytes of `params` weights in `linears` linears of `rows` output rows in all."""
        return (
            int(params * self.bits / 8)
            + rows * self.scale_bytes_per_row
            + (linears * self.scale_bytes_per_linear)
        )


class Mode(KVCache, ABC):
    """The base of every mode's frozen config (each a dataclass with `dtype` and `kv_cache`)."""

    #: The --dtype values this room answers, each with its words in --dtype's help.
    CHOICES: ClassVar[dict[str, str]]
    #: Its default verify gates, by gate key (measured on SmolLM2-135M-Instruct,
    #: docs/benchmarks.md, with headroom for other models).
    GATES: ClassVar[dict[str, Gate]]
    #: `trt-builder doctor`'s rows for it: row name -> the GPU features it needs.
    DOCTOR: ClassVar[dict[str, tuple[str, ...]]]

    #: The models.family.Family flag that says a family builds this mode (None: every family).
    FAMILY_FLAG: ClassVar[str | None] = None

    dtype: str

    @classmethod
    @abstractmethod
    def choose(cls, choice: str, kv_cache: str, options: ModeOptions) -> Mode:
        """The config of --dtype `choice` (one of CHOICES) with `kv_cache` and `options`."""

    @classmethod
    @abstractmethod
    def variants(cls) -> Iterator[Mode]:
        """Every config this room can make (each mode name once), for lookups by name."""

    @classmethod
    @abstractmethod
    def of_checkpoint(cls, quant_algo: object, kv_cache: str, dtype: str) -> Mode | None:
        """The mode of a checkpoint whose config says `quant_algo` and `dtype` (`kv_cache`:
        its KV cache's --kv-cache choice), when it holds this room's; else None. What the
        checkpoint does not record (a searched choice, an option) is the default."""

    @property
    def name(self) -> str:
        """The mode's name (its variant directory's start), KV suffix included."""
        return self.base_name + KV_SUFFIX[self.kv_cache]

    @property
    @abstractmethod
    def base_name(self) -> str:
        """The name without its KV cache's suffix."""

    @property
    def quant_algo(self) -> str | None:
        return None

    @property
    @abstractmethod
    def gate_key(self) -> str:
        """Its DEFAULT_GATES key."""

    @property
    def needs_calibration(self) -> bool:
        return self.kv_cache != "model"

    @property
    def static_weights(self) -> bool:
        """Whether its checkpoint's weights follow from the source weights alone (no
        calibration, no search), so verify's static check can recompute them."""
        return False

    @property
    def clips(self) -> bool:
        """Whether convert clips its weights where calibration says it lowers the error
        (convert/clipping.py)."""
        return False

    @property
    def quantizes_hf_weights(self) -> bool:
        """Whether its Hugging Face checkpoint (the llmapi target) holds the quantized weights
        themselves, where the engine target's holds float weights trtllm-build quantizes (W8A16:
        INT8 rows and their scales, checkpoint/weight_only.py, docs/llmapi.md)."""
        return False

    @property
    def searches(self) -> bool:
        """Whether it leaves a choice to the recipe stage's measured accuracy
        (recipe/candidates.py: SEARCHES)."""
        return False

    @property
    def gemm_needs(self) -> tuple[str, ...]:
        """The GPU features (spec/gpus.py: FEATURES) its GEMMs need."""
        return ()

    @property
    def gpu_needs(self) -> tuple[str, ...]:
        """The GPU features the mode needs, its KV cache's included."""
        kv = KV_NEEDS.get(self.kv_cache)
        return self.gemm_needs + ((kv,) if kv and kv not in self.gemm_needs else ())

    @property
    def activations(self) -> str | None:
        """The format its GEMMs quantize their inputs to ("int8", "e4m3"); None: they take
        the activations' dtype."""
        return None

    @property
    def dynamic_activations(self) -> bool:
        """Whether those inputs are scaled per token at run time (not by a calibrated scale)."""
        return False

    @property
    def weights(self) -> WeightStorage | None:
        """How its quantized linears are stored; None: in the activations' dtype."""
        return None

    def kv_refusal(self) -> str | None:
        """Why this mode is not built with its KV cache, or None."""
        return None

    def target_refusal(self, target: str) -> str | None:
        """Why `target` does not build this mode (its KV cache aside), or None."""
        return None

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """The config as the stage keys record it (versioned)."""
