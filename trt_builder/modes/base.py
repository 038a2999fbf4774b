"""What every quantization mode answers. A mode is one room (a module of this package): a
frozen config with everything the mode decides. The rest of trt-builder asks it (these
methods), or the registry (`__init__.py`); it never tests a mode's name or class."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, Protocol

from ..spec.gates import Gate
from .kvcache.spec import KV_NEEDS, KV_SUFFIX, KVCache


class RecipeSet(Protocol):
    """What a mode's recipe search tries and scores on (its room's spec.py; the search itself
    is its room's recipe/): the recipe stage's key, with the calibration and the model."""

    def key_fields(self) -> dict[str, Any]: ...

    def slug(self) -> str:
        """Its recipe directory's name, after the calibration's."""
        ...

    def read_by_convert(self, directory: Path) -> Path:
        """What convert reads of its recipe `directory`."""
        ...


@dataclass(frozen=True)
class ModeOptions:
    """What the spec's option sections ([int8], [fp8]) say; each room takes what it uses."""

    alpha: float | None = None  # SmoothQuant: None searches it
    granularity: str = "per-token"  # SmoothQuant: per-token or per-tensor
    wo_clip: bool = True  # weight-only INT8: calibrated clipping
    fp8_search: bool = True  # FP8: the searched rounding
    group_size: int = 0  # INT4: the group size (0: as the model takes it)


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
    #: The targets (targets/) that do not build it, by name: why, and what to use instead.
    REFUSED_BY: ClassVar[dict[str, str]] = {}
    #: The llmapi target's loaders that run its quantized Hugging Face checkpoint, by the
    #: names of targets/llmapi/checkpoint/loaders.py: CONTRACTS (read from their source there).
    LOADED_BY: ClassVar[tuple[str, ...]] = ()
    #: What a user of a loader that refuses its checkpoint does instead (said with the refusal).
    INSTEAD_OF_REFUSING_LOADERS: ClassVar[str | None] = None

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
        (modes/weight_only/convert.py)."""
        return False

    @property
    def quantizes_hf_weights(self) -> bool:
        """Whether its Hugging Face checkpoint (the llmapi target) holds the quantized weights
        themselves, where the engine target's holds float weights trtllm-build quantizes (W8A16:
        INT8 rows and their scales, modes/weight_only/checkpoint.py, docs/llmapi.md)."""
        return False

    @property
    def searches(self) -> bool:
        """Whether it leaves a choice to the recipe stage's measured accuracy (what it
        searches: recipe_set)."""
        return False

    def hf_config_groups(self) -> dict[str, Any]:
        """What config.json's modelopt quantization_config says of its GEMMs beyond quant_algo
        (modelopt 0.47's export_hf_checkpoint), for the llmapi target."""
        return {}

    def hf_quant_fields(self, quantization: dict[str, Any]) -> dict[str, Any]:
        """What hf_quant_config.json's `quantization` table says beyond quant_algo, its KV cache
        and exclude_modules (modelopt 0.47's keys), from the engine checkpoint's `quantization`
        (config.json), for the llmapi target."""
        return {}

    def hf_linear_problems(
        self, header: dict[str, Any], base: str, *, input_scale_required: bool, source: str
    ) -> list[str]:
        """How the tensors of one quantized linear of its Hugging Face checkpoint (`base`, e.g.
        model.layers.0.self_attn.q_proj; `header`: the safetensors headers) differ from what the
        llmapi loaders read (`source`: where that is read); empty when they conform."""
        return []

    def pad_multiple(self, tp: int) -> int:
        """The multiple its kernels need every width of the model to be at `tp` (0: none): a
        model whose widths are not is built through its padded twin (source/twin.py)."""
        return 0

    def recipe_set(self) -> RecipeSet | None:
        """What its recipe search tries and scores on, searched or not (None: it has none)."""
        return None

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
    def hf_gpu_needs(self) -> tuple[str, ...]:
        """The GPU features its Hugging Face checkpoint (the llmapi target) needs of the GPU
        that serves it: a loader may run it where the engine cannot (NVFP4 through Marlin)."""
        return self.gpu_needs

    @property
    def fp8_context_fmha(self) -> bool:
        """Whether TensorRT-LLM's builder keeps FP8 context FMHA beside an FP8 KV cache for
        this mode's linears (builder.py: FP8, W4A8_AWQ and NVFP4)."""
        return "fp8" in self.gemm_needs

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
        """Why the target named `target` does not build this mode (its KV cache aside: the
        target decides that), or None."""
        return self.REFUSED_BY.get(target)

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """The config as the stage keys record it (versioned)."""
