"""The NVFP4 room (`--dtype nvfp4`: W4A4 in e2m1 blocks of 16 with e4m3 block scales,
TensorRT-LLM's FP4Linear on Blackwell; served weight-only on older GPUs through Marlin)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

from ...spec.gates import Gate
from ..base import Mode, ModeOptions, WeightStorage
from ..kvcache.spec import KV_NEEDS, check_kv
from ..sixteen import check_16_bit
from ..sixteen import sixteen_bit as _sixteen

#: What its checkpoint's config says it holds.
QUANT_ALGO = "NVFP4"
#: Values per e4m3 block scale (TensorRT-LLM's FP4Linear and vLLM: 16).
GROUP_SIZE = 16
#: The KV caches it is built with: the PyTorch backend has no INT8 KV cache, and Blackwell no
#: INT8 at all in TensorRT-LLM's builder.
KV_CACHES = ("model", "fp8")
#: 4 bits a weight, an e4m3 scale per 16, two float32 scales per linear (its weight's global
#: scale and its input's)
NVFP4_WEIGHTS = WeightStorage("nvfp4", Fraction(4) + Fraction(8, GROUP_SIZE),
                              scale_bytes_per_linear=8)  # fmt: skip
#: compressed-tensors' words for an NVFP4 tensor, as modelopt 0.47 writes them in config.json
FP4_SCHEME = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}


@dataclass(frozen=True)
class Nvfp4SearchSet:
    """What the NVFP4 search tries and scores on (modes/nvfp4/recipe/search.py): its cache key,
    with the calibration and the model; FP8's texts, Hessians and GPTQ settings."""

    dtype: str = "float16"
    tokens: int = 4096
    fit_tokens: int = 6144
    damp: float = 0.01  # GPTQ's dampening: a fraction of the Hessian's mean diagonal
    block: int = 128  # columns updated together (GPTQ's lazy batch)
    seed: int = 0

    def key_fields(self) -> dict[str, Any]:
        return {"mode": "nvfp4", **asdict(self)}

    def slug(self) -> str:
        return f"nvfp4-{self.dtype}"

    def read_by_convert(self, directory: Path) -> Path:
        """recipe.json and the weights beside it."""
        return directory


@dataclass(frozen=True)
class Nvfp4(Mode):
    """NVFP4 (`quant_algo: NVFP4`): each GEMM's weights in e2m1 (checkpoint/nvfp4.py), blocks
    of 16 input channels with an e4m3 scale, and one float32 global scale per weight (its amax
    / (6 x 448)); its input quantized the same way at run time, each block's scale from the
    block, the global one calibrated (the input's amax / (6 x 448)). qkv, dense, fc, gate and
    proj are quantized; embeddings, norms and lm_head are not (`exclude_modules`).

    The engine target builds it for Blackwell (SM 100+: FP4 tensor cores). The llmapi
    target's checkpoint also runs on older GPUs, weight-only (activations in the model dtype)
    through Marlin: vLLM on SM 75+, TensorRT-LLM 1.3.0rc20+ on SM 89-99 when asked
    (docs/quantization.md); verify measures what Blackwell computes, the quantized inputs
    included, which is the larger error."""

    CHOICES: ClassVar[dict[str, str]] = {
        "nvfp4": "nvfp4 (NVFP4 W4A4: e2m1 in blocks of 16, SM 100+; the llmapi target also "
        "weight-only on older GPUs)"
    }
    GATES: ClassVar[dict[str, Gate]] = {
        # W4A4: the inputs are 4-bit too (SmolLM2-135M: 0.73, 0.42, +21.7%)
        "nvfp4": Gate(min_top1=0.65, max_kl=0.8, max_ppl_delta_pct=35.0),
    }
    DOCTOR: ClassVar[dict[str, tuple[str, ...]]] = {"nvfp4": ("fp4",)}
    #: NVFP4LinearMethod (TensorRT-LLM 1.x, Blackwell) and vLLM's ModelOptNvFp4LinearMethod
    #: (0.10 on; Marlin below Blackwell).
    LOADED_BY: ClassVar[tuple[str, ...]] = ("tensorrt-llm 1.0", "tensorrt-llm 1.1",
                                            "tensorrt-llm 1.2", "vllm 0.10-0.34")  # fmt: skip

    dtype: str = "float16"
    kv_cache: str = "model"

    def __post_init__(self) -> None:
        check_16_bit("NVFP4", self.dtype)
        check_kv(self.kv_cache)

    @classmethod
    def choose(cls, choice: str, kv_cache: str, options: ModeOptions) -> Mode:
        return cls(kv_cache=kv_cache)

    @classmethod
    def variants(cls) -> Iterator[Mode]:
        for kv in KV_CACHES:
            yield cls(kv_cache=kv)

    @classmethod
    def of_checkpoint(cls, quant_algo: object, kv_cache: str, dtype: str) -> Mode | None:
        return cls(_sixteen(dtype), kv_cache) if quant_algo == QUANT_ALGO else None

    def kv_refusal(self) -> str | None:
        if self.kv_cache not in KV_CACHES:
            return (
                f"nvfp4 is not built with --kv-cache {self.kv_cache}: use --kv-cache fp8 "
                "(TensorRT-LLM builds no INT8 on Blackwell, and its PyTorch backend has no INT8 "
                "KV cache)"
            )
        return None

    @property
    def needs_calibration(self) -> bool:
        return True  # each GEMM input's global scale

    @property
    def searches(self) -> bool:
        return True  # the e2m1 rounding, by measured accuracy (recipe/search.py)

    def recipe_set(self) -> Nvfp4SearchSet:
        return Nvfp4SearchSet(dtype=self.dtype)

    @property
    def base_name(self) -> str:
        return "nvfp4"

    @property
    def quant_algo(self) -> str | None:
        return QUANT_ALGO

    @property
    def gate_key(self) -> str:
        return "nvfp4"

    @property
    def gemm_needs(self) -> tuple[str, ...]:
        return ("fp4",)

    @property
    def hf_gpu_needs(self) -> tuple[str, ...]:
        kv = KV_NEEDS.get(self.kv_cache)  # Marlin runs the GEMMs weight-only below SM 100
        return (kv,) if kv else ()

    @property
    def fp8_context_fmha(self) -> bool:
        return True  # TensorRT-LLM keeps FP8 context FMHA for NVFP4 (builder.py)

    @property
    def activations(self) -> str | None:
        return "e2m1"

    @property
    def weights(self) -> WeightStorage | None:
        return NVFP4_WEIGHTS

    def hf_config_groups(self) -> dict[str, Any]:
        return {"config_groups": {"group_0": {"input_activations": dict(FP4_SCHEME),
                                              "weights": dict(FP4_SCHEME),
                                              "targets": ["Linear"]}}}  # fmt: skip

    def hf_quant_fields(self, quantization: dict[str, Any]) -> dict[str, Any]:
        return {"group_size": GROUP_SIZE}

    def hf_linear_problems(
        self, header: dict[str, Any], base: str, *, input_scale_required: bool, source: str
    ) -> list[str]:
        """uint8 [out, in / 2] (two e2m1 codes a byte along the input), float8_e4m3fn
        weight_scale [out, in / 16], float32 scalar weight_scale_2 and input_scale
        (NVFP4LinearMethod; vLLM's ModelOptNvFp4LinearMethod)."""
        weight, scale = header.get(f"{base}.weight"), header.get(f"{base}.weight_scale")
        if weight is None or weight["dtype"] != "U8" or len(weight["shape"]) != 2:
            return [f"{base}.weight is not a U8 [out, in / 2] matrix of e2m1 pairs ({source})"]
        out, width = weight["shape"][0], weight["shape"][1] * 2
        problems = []
        if scale is None or scale["dtype"] != "F8_E4M3" or scale["shape"] != [out, width // 16]:
            problems.append(f"{base}.weight_scale is not F8_E4M3 [{out}, {width // 16}] ({source})")
        for name in ("weight_scale_2", "input_scale"):
            got = header.get(f"{base}.{name}")
            if got is None:
                problems.append(f"{base}.{name} is missing ({source})")
            elif got["dtype"] != "F32" or got["shape"] not in ([], [1]):
                problems.append(
                    f"{base}.{name} is {got['dtype']} {got['shape']}, not F32 [] ({source})"
                )
        return problems

    def to_json(self) -> dict[str, Any]:
        return {"mode": "nvfp4", "version": 1, **asdict(self)}
