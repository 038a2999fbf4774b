"""The FP8 room (`--dtype fp8`: per-tensor W8A8 in e4m3, TensorRT-LLM's FP8Linear)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

from ...spec.gates import Gate
from ..base import Mode, ModeOptions, WeightStorage
from ..kvcache.spec import FP8_SCHEME, KV_CACHE_CHOICES, check_kv
from ..sixteen import check_16_bit
from ..sixteen import sixteen_bit as _sixteen

#: e4m3 weights, two float32 scales per linear (its weight's and its input's)
FP8_WEIGHTS = WeightStorage("fp8", Fraction(8), scale_bytes_per_linear=8)


@dataclass(frozen=True)
class Fp8SearchSet:
    """What the FP8 search tries and scores on (modes/fp8/recipe/search.py): its cache key, with the
    calibration and the model. The weights are rounded to `dtype` before FP8, as convert
    rounds them. `fit_tokens` give each GEMM's input Hessian and the next `tokens` score the
    candidates, each half prose of the search split and half text the model samples itself;
    `seed` shuffles the split's documents (0: as bundled) and seeds the sampling."""

    dtype: str = "float16"
    tokens: int = 4096
    fit_tokens: int = 6144
    damp: float = 0.01  # GPTQ's dampening: a fraction of the Hessian's mean diagonal
    block: int = 128  # columns updated together (GPTQ's lazy batch)
    seed: int = 0

    def key_fields(self) -> dict[str, Any]:
        return {"mode": "fp8", **asdict(self)}

    def slug(self) -> str:
        """Its recipe directory's name, after the calibration's (the rounded weights depend on
        the dtype)."""
        return f"fp8-{self.dtype}"

    def read_by_convert(self, directory: Path) -> Path:
        """What convert reads of its recipe `directory`: recipe.json and the weights beside it."""
        return directory


@dataclass(frozen=True)
class Fp8(Mode):
    """FP8 per-tensor W8A8 (`quant_algo: FP8`, TensorRT-LLM's FP8Linear): e4m3 weights and
    activations, each GEMM with one float32 dequantization scale per tensor for its weight and
    one for its input (amax / 448, the input's from calibration); norms, embeddings and lm_head
    stay in `dtype`, lm_head listed in `exclude_modules` (modes/fp8/convert.py, docs/quantization.md).

    `search`: the recipe stage chooses each weight's e4m3 rounding, error-compensated against
    the float GEMM or plain round-to-nearest, by measured accuracy (modes/fp8/recipe/search.py); off, every
    weight is rounded to nearest, as modelopt's exporter writes it (no recipe stage)."""

    CHOICES: ClassVar[dict[str, str]] = {"fp8": "fp8 (calibrated FP8 W8A8, SM 89+)"}
    GATES: ClassVar[dict[str, Gate]] = {
        # FP8 per-tensor W8A8 with calibrated amax scales
        "fp8": Gate(min_top1=0.85, max_kl=0.1, max_ppl_delta_pct=5.0),
    }
    DOCTOR: ClassVar[dict[str, tuple[str, ...]]] = {"fp8": ("fp8",)}
    #: FP8QDQLinearMethod (TensorRT-LLM 1.x) and vLLM's ModelOptFp8LinearMethod.
    LOADED_BY: ClassVar[tuple[str, ...]] = ("tensorrt-llm 1.0", "tensorrt-llm 1.1",
                                            "tensorrt-llm 1.2", "vllm 0.10-0.34")  # fmt: skip

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

    def recipe_set(self) -> Fp8SearchSet:
        return Fp8SearchSet(dtype=self.dtype)

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

    def hf_config_groups(self) -> dict[str, Any]:
        return {
            "config_groups": {
                "group_0": {
                    "input_activations": FP8_SCHEME,
                    "weights": FP8_SCHEME,
                    "targets": ["Linear"],
                }  # fmt: skip
            }
        }

    def hf_linear_problems(
        self, header: dict[str, Any], base: str, *, input_scale_required: bool, source: str
    ) -> list[str]:
        """e4m3 values, [out, in], a float32 scalar weight scale and (where the loader needs
        it) input scale (FP8QDQLinearMethod; vLLM's ModelOptFp8LinearMethod)."""
        problems = []
        weight = header.get(f"{base}.weight")
        if weight is None or weight["dtype"] != "F8_E4M3" or len(weight["shape"]) != 2:
            problems.append(f"{base}.weight is not an F8_E4M3 [out, in] matrix ({source})")
        for name, required in (("weight_scale", True), ("input_scale", input_scale_required)):
            got = header.get(f"{base}.{name}")
            if got is None:
                if required:
                    problems.append(f"{base}.{name} is missing ({source})")
            elif got["dtype"] != "F32" or got["shape"] not in ([], [1]):
                problems.append(
                    f"{base}.{name} is {got['dtype']} {got['shape']}, not F32 [] ({source})"
                )
        return problems

    def to_json(self) -> dict[str, Any]:
        return {"mode": "fp8", "version": 2, **asdict(self)}  # 2: search
