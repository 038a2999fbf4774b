"""The SmoothQuant room (`--dtype int8`: W8A8 in TensorRT-LLM's plugin formats, per-token or
per-tensor activation scales)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from ...core.errors import SpecError
from ...spec.gates import Gate
from ..base import Mode, ModeOptions, WeightStorage
from ..kvcache.spec import KV_CACHE_CHOICES, check_kv
from ..sixteen import check_16_bit
from ..sixteen import sixteen_bit as _sixteen
from ..weight_only.spec import INT8_WEIGHTS

GRANULARITIES = ("per-token", "per-tensor")
#: The plugin formats' quant_algo, by granularity.
QUANT_ALGO = {True: "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
              False: "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN"}  # fmt: skip


def check_alpha(alpha: object) -> float | None:
    """SmoothQuant's alpha as a number from 0 to 1, or None for "auto" (searched): the one
    validation of it (the spec's [int8] alpha, --sq-alpha, the config)."""
    if alpha is None or alpha == "auto":
        return None
    try:
        value = float(alpha)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = -1.0
    if isinstance(alpha, bool) or not 0.0 <= value <= 1.0:
        raise SpecError(
            f"SmoothQuant's alpha (--sq-alpha, int8.alpha) is auto or a number from 0 to 1, "
            f"not {alpha!r}"
        )
    return value


#: Global alphas tried.
ALPHAS = (0.4, 0.5, 0.6, 0.7, 0.8)
#: Alphas tried per layer and GEMM group. 0.9 was dropped: groups that chose it fitted their
#: GEMM better but lost on the search split.
GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


@dataclass(frozen=True)
class SearchSet:
    """What the search tries and scores on: its cache key (with the calibration and the model).
    `batch` and `device` change how it runs, not what it finds."""

    per_token: bool = True
    alphas: tuple[float, ...] = ALPHAS
    grid: tuple[float, ...] = GRID
    tokens: int = 4096
    fit_tokens: int = 1024

    def key_fields(self) -> dict[str, Any]:
        return asdict(self)

    def slug(self) -> str:
        """Its recipe directory's name, after the calibration's."""
        return "per-token" if self.per_token else "per-tensor"

    def read_by_convert(self, directory: Path) -> Path:
        """What convert reads of its recipe `directory`: recipe.json (the chosen alphas)."""
        return directory / "recipe.json"


@dataclass(frozen=True)
class SmoothQuant(Mode):
    """W8A8 SmoothQuant in TensorRT-LLM's plugin formats: int8 weights with one scale per output
    channel, int8 activations with a dynamic scale per token (`per_token`) or one static scale
    per tensor, smoothed by `alpha` (docs/quantization.md). `kv_cache` int8 adds the INT8 KV cache.

    The plugin formats (W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN / _PER_TENSOR_PLUGIN) rather than
    the native W8A8_SQ_PER_CHANNEL: only they offer per-token activation scales, and every
    pinned release (0.20-1.2) builds them with the SmoothQuant plugin."""

    CHOICES: ClassVar[dict[str, str]] = {"int8": "int8 (calibrated SmoothQuant W8A8)"}
    GATES: ClassVar[dict[str, Gate]] = {
        # per-token activation scales (with or without the INT8 KV cache)
        "int8": Gate(min_top1=0.85, max_kl=6e-2, max_ppl_delta_pct=3.0),
        # one static activation scale per tensor (--sq-granularity per-tensor): a coarser
        # format; SmolLM2 with searched alphas: top-1 0.82, KL 0.12, perplexity +3.8%
        "int8-static": Gate(min_top1=0.75, max_kl=0.2, max_ppl_delta_pct=6.0),
    }
    DOCTOR: ClassVar[dict[str, tuple[str, ...]]] = {"int8": ("int8",)}
    FAMILY_FLAG: ClassVar[str | None] = "smoothquant"
    #: TensorRT-LLM's PyTorch backend has no W8A8 SmoothQuant linear method
    #: (tensorrt_llm/_torch/modules/linear.py; docs/llmapi.md).
    REFUSED_BY: ClassVar[dict[str, str]] = {
        "llmapi": "--dtype int8 (SmoothQuant) is not built for --target llmapi: TensorRT-LLM's "
        "PyTorch backend has no SmoothQuant linear; use --dtype fp8 (SM 89+) or int8-wo, "
        "or --target engine"
    }

    alpha: float | None = (
        0.5  # None: searched (the recipe stage, modes/smoothquant/recipe/search.py)
    )
    per_token: bool = True
    kv_cache: str = "model"  # model, int8 or fp8
    dtype: str = "float16"

    def __post_init__(self) -> None:
        check_alpha(self.alpha)
        check_16_bit("SmoothQuant", self.dtype)
        check_kv(self.kv_cache)

    @classmethod
    def choose(cls, choice: str, kv_cache: str, options: ModeOptions) -> Mode:
        if options.granularity not in GRANULARITIES:
            raise SpecError(f"int8.granularity must be one of {', '.join(GRANULARITIES)}")
        return cls(options.alpha, options.granularity == "per-token", kv_cache)

    @classmethod
    def variants(cls) -> Iterator[Mode]:
        for per_token in (True, False):
            for kv in KV_CACHE_CHOICES:
                yield cls(None, per_token, kv)

    @classmethod
    def of_checkpoint(cls, quant_algo: object, kv_cache: str, dtype: str) -> Mode | None:
        for per_token, algo in QUANT_ALGO.items():
            if quant_algo == algo:
                return cls(None, per_token, kv_cache, _sixteen(dtype))  # as fp8.py
        return None

    @property
    def needs_calibration(self) -> bool:
        return True

    @property
    def searches(self) -> bool:
        return self.alpha is None  # "auto": searched

    def recipe_set(self) -> SearchSet:
        return SearchSet(per_token=self.per_token)

    @property
    def base_name(self) -> str:
        return "int8-sq" + ("" if self.per_token else "-static")

    @property
    def quant_algo(self) -> str | None:
        return QUANT_ALGO[self.per_token]

    @property
    def gate_key(self) -> str:
        return "int8" if self.per_token else "int8-static"

    @property
    def gemm_needs(self) -> tuple[str, ...]:
        return ("int8",)

    @property
    def activations(self) -> str | None:
        return "int8"

    @property
    def dynamic_activations(self) -> bool:
        return self.per_token

    @property
    def weights(self) -> WeightStorage | None:
        return INT8_WEIGHTS

    def to_json(self) -> dict[str, Any]:
        return {"mode": "smoothquant", "version": 2, **asdict(self)}  # 2: kv_cache
