"""The INT4 AWQ room (`--dtype int4-awq`: W4A16 AWQ, TensorRT-LLM's weight-only groupwise GEMM)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

from ...core.errors import SpecError
from ...spec.gates import Gate
from ..base import Mode, ModeOptions, WeightStorage
from ..kvcache.spec import check_kv
from ..sixteen import check_16_bit
from ..sixteen import sixteen_bit as _sixteen

#: The group sizes TensorRT-LLM's fine-grained INT4 kernels take (CUTLASS fpA_intB: "Only group
#: size 64 and 128 supported for fine grained kernels"), the larger first.
GROUP_SIZES = (128, 64)
#: What its checkpoint's config says it holds.
QUANT_ALGO = "W4A16_AWQ"
#: The KV caches it is built with: TensorRT-LLM runs W4A16 AWQ with an FP8 KV cache on both
#: of its backends; the PyTorch backend has no INT8 KV cache.
KV_CACHES = ("model", "fp8")


@dataclass(frozen=True)
class Int4SearchSet:
    """What the INT4 AWQ search tries and scores on (modes/int4_awq/recipe/search.py): its cache
    key, with the calibration and the model. The weights are rounded to `dtype` first, as
    convert rounds them; `group_size` as the mode asks (0: as the model takes it at TP 1).
    `fit_tokens` give each GEMM group's input Hessian, the next `tokens` score the candidates
    (FP8's texts: half prose of the search split, half the model's own text); `seed` shuffles
    the split and seeds the sampling."""

    dtype: str = "float16"
    group_size: int = 0
    tokens: int = 4096
    fit_tokens: int = 6144
    damp: float = 0.01  # GPTQ's dampening: a fraction of the Hessian's mean diagonal
    block: int = 128  # columns updated together (GPTQ's lazy batch)
    seed: int = 0

    def key_fields(self) -> dict[str, Any]:
        return {"mode": "int4_awq", **asdict(self)}

    def slug(self) -> str:
        return f"int4-awq-{self.dtype}-g{self.group_size or 'auto'}"

    def read_by_convert(self, directory: Path) -> Path:
        """recipe.json and the weights beside it."""
        return directory


def int4_storage(group: int) -> WeightStorage:
    """4 bits per weight and a model-dtype scale (16 bits) per `group` weights, as the engine
    holds them."""
    return WeightStorage("int4", Fraction(4) + Fraction(16, group))


@dataclass(frozen=True)
class Int4Awq(Mode):
    """W4A16 AWQ (`quant_algo: W4A16_AWQ`): signed INT4 weights, one scale per group of
    `group_size` input channels of a row (0: 128 where the model's shapes take it, else 64:
    group_for), and per input channel AWQ's
    pre-quantization scale, chosen from the calibrated activations so that the channels the
    activations load most lose least to the rounding (modes/int4_awq/convert.py); activations
    stay in `dtype`. qkv, dense, fc, gate and proj are quantized; embeddings, norms and lm_head
    are not (`exclude_modules`)."""

    CHOICES: ClassVar[dict[str, str]] = {
        "int4-awq": "int4-awq (W4A16 AWQ: INT4 weights in groups, SM 80-90)"
    }
    GATES: ClassVar[dict[str, Gate]] = {
        "int4-awq": Gate(min_top1=0.65, max_kl=0.8, max_ppl_delta_pct=30.0),
    }
    DOCTOR: ClassVar[dict[str, tuple[str, ...]]] = {"int4-awq": ("int4",)}
    #: TensorRT-LLM's PyTorch backend loads modelopt's W4A16_AWQ checkpoint from 1.0 on
    #: (W4A16_AWQ_LinearMethod, PR #3258 of 2025-04; docs/upstream/four-bit-unified-checkpoint.md);
    #: vLLM's modelopt loader does not list W4A16_AWQ (0.10-0.34).
    LOADED_BY: ClassVar[tuple[str, ...]] = ("tensorrt-llm 1.0", "tensorrt-llm 1.1",
                                            "tensorrt-llm 1.2")  # fmt: skip
    INSTEAD_OF_REFUSING_LOADERS = "for vLLM, build --dtype fp8 (SM 89+)"

    dtype: str = "float16"
    kv_cache: str = "model"
    group_size: int = 0  # 0: 128 where the model takes it, else 64

    def __post_init__(self) -> None:
        check_16_bit("INT4 AWQ", self.dtype)
        check_kv(self.kv_cache)
        check_group_size(self.group_size)

    @classmethod
    def choose(cls, choice: str, kv_cache: str, options: ModeOptions) -> Mode:
        return cls(kv_cache=kv_cache, group_size=options.group_size)

    @classmethod
    def variants(cls) -> Iterator[Mode]:
        for group in (0, *GROUP_SIZES):
            for kv in KV_CACHES:
                yield cls(kv_cache=kv, group_size=group)

    @classmethod
    def of_checkpoint(cls, quant_algo: object, kv_cache: str, dtype: str) -> Mode | None:
        mode = cls(_sixteen(dtype), kv_cache)  # W4A8 AWQ's room inherits this: its own algo
        return mode if quant_algo == mode.quant_algo else None

    def kv_refusal(self) -> str | None:
        if self.kv_cache not in KV_CACHES:
            return (
                f"{self.base_name} is not built with --kv-cache {self.kv_cache}: use --kv-cache fp8 "
                "(TensorRT-LLM's PyTorch backend has no INT8 KV cache)"
            )
        return None

    def group_for(self, shapes: dict[str, tuple[int, int]], tp: int) -> int:
        """The group size for a model whose quantized linears are `shapes` (by name: out and in
        features, whole), split at `tp`: the one asked for, or the largest that fits. A size
        fits where every linear's in and out features are multiples of max(64, size) x tp:
        TensorRT-LLM's WeightOnlyGroupwiseQuantLinear pads other sizes up to that multiple
        (quantization/layers.py), which no checkpoint of ours holds. SpecError naming the
        size that would do when the one asked for does not fit, or none does."""

        def fits(group: int) -> bool:
            multiple = max(64, group) * tp
            return all(n % multiple == 0 for shape in shapes.values() for n in shape)

        fitting = [g for g in GROUP_SIZES if fits(g)]
        if self.group_size and self.group_size not in fitting:
            multiple = max(64, self.group_size) * tp
            bad = next(k for k, shape in shapes.items() if any(n % multiple for n in shape))
            raise SpecError(
                f"--group-size {self.group_size} does not fit {bad} ({shapes[bad][1]} in, "
                f"{shapes[bad][0]} out features: TensorRT-LLM needs multiples of {multiple} at "
                f"--tp {tp}): "
                + (
                    f"use --group-size {fitting[0]}"
                    if fitting
                    else "this model takes no INT4 group size"
                )
            )
        if not fitting:
            listed = ", ".join(f"{k} {o}x{i}" for k, (o, i) in shapes.items())
            raise SpecError(
                f"int4-awq needs every quantized linear's in and out features to be multiples of "
                f"{64 * tp} at --tp {tp} ({listed}; TensorRT-LLM pads others, which a checkpoint "
                "cannot hold): use --dtype int8-wo or fp8"
            )
        return self.group_size or fitting[0]

    @property
    def needs_calibration(self) -> bool:
        return True  # AWQ's scales weigh the channels by the calibrated activations

    @property
    def searches(self) -> bool:
        return True  # alpha and the rounding, by measured accuracy (recipe/search.py)

    def recipe_set(self) -> Int4SearchSet:
        return Int4SearchSet(dtype=self.dtype, group_size=self.group_size)

    @property
    def base_name(self) -> str:
        return "int4-awq" + (f"-g{self.group_size}" if self.group_size else "")

    @property
    def quant_algo(self) -> str | None:
        return QUANT_ALGO

    @property
    def gate_key(self) -> str:
        return "int4-awq"

    @property
    def gemm_needs(self) -> tuple[str, ...]:
        return ("int4",)

    @property
    def weights(self) -> WeightStorage | None:
        return int4_storage(self.group_size or GROUP_SIZES[0])

    def hf_quant_fields(self, quantization: dict[str, Any]) -> dict[str, Any]:
        # TensorRT-LLM reads the group size from here alone: config.json's quantization_config
        # has none for W4A16_AWQ (modelopt 0.47 writes none there either)
        return {key: quantization[key] for key in ("group_size", "has_zero_point",
                                                   "pre_quant_scale")}  # fmt: skip

    def hf_linear_problems(
        self, header: dict[str, Any], base: str, *, input_scale_required: bool, source: str
    ) -> list[str]:
        """uint8 [out / 2, in] (two INT4 rows a byte), float32 weight_scale [out, in / group];
        pre_quant_scale [in] on o_proj and down_proj, which the PyTorch backend reads
        unconditionally, and on no other linear: it reads none for its fused qkv and gate_up
        GEMMs, so one there would be dropped without a word (W4A16_AWQ_LinearMethod)."""
        weight, scale = header.get(f"{base}.weight"), header.get(f"{base}.weight_scale")
        if weight is None or weight["dtype"] != "U8" or len(weight["shape"]) != 2:
            return [f"{base}.weight is not a U8 [out / 2, in] matrix of INT4 pairs ({source})"]
        out, width = weight["shape"][0] * 2, weight["shape"][1]
        problems = []
        if (
            scale is None
            or scale["dtype"] != "F32"
            or len(scale["shape"]) != 2
            or scale["shape"][0] != out
            or width % scale["shape"][1]
        ):
            problems.append(f"{base}.weight_scale is not F32 [{out}, in / group] ({source})")
        pqs = header.get(f"{base}.pre_quant_scale")
        reads_pqs = base.endswith(("o_proj", "down_proj"))
        if reads_pqs and (pqs is None or pqs["shape"] != [width]):
            problems.append(f"{base}.pre_quant_scale [{width}] is missing ({source})")
        if not reads_pqs and pqs is not None:
            problems.append(
                f"{base}.pre_quant_scale is not read for a fused GEMM: fold it into the norm "
                f"before ({source})"
            )
        return problems

    def to_json(self) -> dict[str, Any]:
        return {"mode": "int4_awq", "version": 2, **asdict(self)}  # 2: fc and gate share a scale


def check_group_size(group: int) -> None:
    """The one validation of a group size (the spec's [int4] section, --group-size)."""
    if group not in (0, *GROUP_SIZES):
        raise SpecError(
            f"group size {group!r} is not taken by TensorRT-LLM's INT4 kernels: use 64 or 128 "
            "(or leave it out: 128 where the model takes it, else 64)"
        )
