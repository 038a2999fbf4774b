"""The INT4 AWQ room (`--dtype int4-awq`: W4A16 AWQ, TensorRT-LLM's weight-only groupwise GEMM)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from fractions import Fraction
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
    #: Its Hugging Face checkpoint is not written yet (issue 41).
    REFUSED_BY: ClassVar[dict[str, str]] = {
        "llmapi": "int4-awq's Hugging Face checkpoint is not written yet: use --target engine",
    }

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
        return cls(_sixteen(dtype), kv_cache) if quant_algo == QUANT_ALGO else None

    def kv_refusal(self) -> str | None:
        if self.kv_cache not in KV_CACHES:
            return (
                f"int4-awq is not built with --kv-cache {self.kv_cache}: use --kv-cache fp8 "
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

    def to_json(self) -> dict[str, Any]:
        return {"mode": "int4_awq", "version": 1, **asdict(self)}


def check_group_size(group: int) -> None:
    """The one validation of a group size (the spec's [int4] section, --group-size)."""
    if group not in (0, *GROUP_SIZES):
        raise SpecError(
            f"group size {group!r} is not taken by TensorRT-LLM's INT4 kernels: use 64 or 128 "
            "(or leave it out: 128 where the model takes it, else 64)"
        )
