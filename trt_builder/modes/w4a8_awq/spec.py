"""The W4A8 AWQ room (`--dtype w4a8-awq`: INT4 AWQ's weights with FP8 inputs, TensorRT-LLM's
W4A(fp)8 groupwise GEMM, SM 89 and 90)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from ...core.errors import SpecError
from ...spec.gates import Gate
from ..base import Mode, ModeOptions, WeightStorage
from ..int4_awq.spec import KV_CACHES, Int4Awq, Int4SearchSet, int4_storage

#: The group size TensorRT-LLM's W4A(fp)8 kernels take ("Only group size 128 supported for
#: fine grained W4A(fp)8 kernels"; its Python layer refuses 64).
W4A8_GROUP = 128
#: What its checkpoint's config says it holds.
QUANT_ALGO = "W4A8_AWQ"
_STORAGE = int4_storage(W4A8_GROUP)
#: INT4 groups, and per linear two float32 scalars (the weight's FP8 stage, the input's scale).
W4A8_WEIGHTS = WeightStorage("int4", _STORAGE.bits, scale_bytes_per_linear=8)


@dataclass(frozen=True)
class W4a8Awq(Int4Awq):
    """W4A8 AWQ (`quant_algo: W4A8_AWQ`): INT4 AWQ's weights (modes/int4_awq: signed INT4 in
    groups of 128 input channels, AWQ's pre-quantization scale, the recipe's search) with FP8
    inputs: each GEMM's input multiplied by its pre-quantization scale and quantized to e4m3
    with a calibrated per-tensor scale, each weight's group scale divided by a per-GEMM FP8
    scale (checkpoint/w4a8.py). The group is 128 alone (TensorRT-LLM's W4A(fp)8 kernels); a
    model whose widths are not multiples of 128 x tp is built through its exactly equivalent
    padded twin (source/padding.py: SmolLM2-135M's 576 become 768), since neither TensorRT-LLM's
    engine nor its PyTorch backend nor modelopt takes them (docs/upstream/w4a8-padding.md)."""

    CHOICES: ClassVar[dict[str, str]] = {
        "w4a8-awq": "w4a8-awq (W4A8 AWQ: INT4 weights in groups of 128, FP8 inputs, SM 89-90)"
    }
    GATES: ClassVar[dict[str, Gate]] = {
        "w4a8-awq": Gate(min_top1=0.65, max_kl=0.8, max_ppl_delta_pct=30.0),
    }
    DOCTOR: ClassVar[dict[str, tuple[str, ...]]] = {"w4a8-awq": ("int4", "fp8")}
    #: TensorRT-LLM's PyTorch backend loads modelopt's W4A8_AWQ checkpoint (W4A8_AWQ_LinearMethod,
    #: its FP8 GEMM from PR #6005 of 2025-07: 1.0 on); vLLM's modelopt loader does not list
    #: W4A8_AWQ (docs/upstream/four-bit-unified-checkpoint.md).
    LOADED_BY: ClassVar[tuple[str, ...]] = ("tensorrt-llm 1.0", "tensorrt-llm 1.1",
                                            "tensorrt-llm 1.2")  # fmt: skip
    INSTEAD_OF_REFUSING_LOADERS = "for vLLM, build --dtype fp8 (SM 89+)"

    group_size: int = W4A8_GROUP

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size != W4A8_GROUP:
            raise SpecError(
                f"w4a8-awq takes group size {W4A8_GROUP} alone (TensorRT-LLM's W4A(fp)8 kernels): "
                f"leave --group-size out, or build --dtype int4-awq --group-size {self.group_size}"
            )

    @classmethod
    def choose(cls, choice: str, kv_cache: str, options: ModeOptions) -> Mode:
        return cls(kv_cache=kv_cache, group_size=options.group_size or W4A8_GROUP)

    @classmethod
    def variants(cls) -> Iterator[Mode]:
        for kv in KV_CACHES:
            yield cls(kv_cache=kv)

    def pad_multiple(self, tp: int) -> int:
        # TensorRT-LLM's groupwise layers pad every width to max(128, group) x tp for W4A8
        # (quantization/layers.py), which a checkpoint cannot hold: the twin has them
        return W4A8_GROUP * tp

    def recipe_set(self) -> Int4SearchSet:
        return Int4SearchSet(dtype=self.dtype, group_size=W4A8_GROUP)

    @property
    def base_name(self) -> str:
        return "w4a8-awq"

    @property
    def quant_algo(self) -> str | None:
        return QUANT_ALGO

    @property
    def gate_key(self) -> str:
        return "w4a8-awq"

    @property
    def gemm_needs(self) -> tuple[str, ...]:
        return ("int4", "fp8")

    @property
    def activations(self) -> str | None:
        return "e4m3"

    @property
    def weights(self) -> WeightStorage | None:
        return W4A8_WEIGHTS

    def hf_linear_problems(
        self, header: dict[str, Any], base: str, *, input_scale_required: bool, source: str
    ) -> list[str]:
        """INT4 AWQ's tensors, and the float32 scalars weight_scale_2 and input_scale, which
        W4A8_AWQ_LinearMethod reads for every linear."""
        problems = super().hf_linear_problems(
            header, base, input_scale_required=input_scale_required, source=source
        )
        for suffix in ("weight_scale_2", "input_scale"):
            found = header.get(f"{base}.{suffix}")
            if found is None or found["dtype"] != "F32" or found["shape"] not in ([], [1]):
                problems.append(f"{base}.{suffix} is not a float32 scalar ({source})")
        return problems

    def to_json(self) -> dict[str, Any]:
        return {"mode": "w4a8_awq", "version": 1, **asdict(self)}
