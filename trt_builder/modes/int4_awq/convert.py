"""W4A16 AWQ (`quant_algo: W4A16_AWQ`) in TensorRT-LLM's checkpoint format.

Per decoder layer, for each GEMM TensorRT-LLM's WeightOnlyGroupwiseQuantLinear replaces (qkv,
dense, fc, gate, proj):
- `prequant_scaling_factor`: AWQ's per-input-channel scale p, in the model dtype ([in]): the
  engine multiplies the GEMM's input by it (rounded to the model dtype), so the weight is
  stored as W / p, and channels whose activations are large get a finer grid;
- `weights_scaling_factor`: float32 [out, in / group], each group's absmax of W / p over 7;
- `weight`: the INT4 values of W / p at those scales, packed two per byte along the output
  rows (checkpoint/int4.py), each rank packing its own.

p = 1 / s with s_k = a_k^alpha / w_k^(1 - alpha) (AWQ's form, checkpoint.py): a_k the
calibrated RMS of input channel k, w_k the mean over rows of |W[:, k]| relative to its group's
absmax, normalised so that max(s) * min(s) = 1. fc and gate, which read one input, share one
alpha and p (SHARES_INPUT). The recipe stage chooses each GEMM's alpha (or no scale) and the
INT4 values (error-compensated or to nearest: modes/int4_awq/recipe/search.py), and convert
writes them (`Searched`); without a recipe (the library's callers) alpha minimises the
calibrated output error of nearest rounding, sum_k E[x_k^2] * sum_n (W[n, k] - p_k * Q(W /
p)[n, k])^2 (channels taken as uncorrelated: the calibration keeps each channel's mean square,
not their covariance), the search's "awq" candidate. Norms, biases, the embedding, ln_f and
lm_head stay in the model dtype, as `exclude_modules` says. With the FP8 KV cache each layer
gets `kv_cache_scaling_factor` (modes/kvcache/convert.py).

Written by hand: TensorRT-LLM's quantize scripts need TensorRT-LLM and a GPU, and modelopt is a
test oracle here, not a dependency.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ...calibrate.stats import load_stats
from ...checkpoint.fp8 import FP8_LINEARS
from ...checkpoint.int4 import pack_rows, unpack_rows
from ...checkpoint.mapping import Mapping
from ...checkpoint.safetensors_io import SafetensorsIndex
from ...checkpoint.w4a8 import input_scales, weight_scale_2
from ...convert.dispatch import register
from ...convert.layers import LayerJob, split_layers
from ...convert.plan import plan_conversion
from ...convert.write import finish
from ...core.dtypes import torch_dtype
from ...core.errors import ConversionError, SpecError
from ...core.fsio import write_json
from .. import FloatMode
from ..kvcache.convert import KVCacheScales
from .checkpoint import CLIP_RATIOS, awq_linear, awq_pqs, linear_shapes, rounded_at
from .spec import Int4Awq

#: The GEMMs stored as INT4 (TensorRT-LLM names within a decoder layer): FP8's five.
INT4_LINEARS = FP8_LINEARS
#: What config.json's exclude_modules lists: the modules kept in the model dtype.
EXCLUDED = ["lm_head", "transformer.vocab_embedding"]
#: GEMMs that read the same input (a norm's output) as another, TensorRT-LLM names: their
#: pre-quantization scale is chosen once, for both (the scale of q, k and v, one GEMM here, is
#: one too). The llmapi target folds it into that norm (targets/llmapi/checkpoint/unified.py),
#: as modelopt's unified export does and TensorRT-LLM's PyTorch backend needs: it reads no
#: pre_quant_scale for its fused gate_up GEMM.
SHARES_INPUT = {"mlp.fc.weight": "mlp.gate.weight"}


def convert_int4_awq(
    hf_dir: Path,
    out_dir: Path,
    mode: Int4Awq,
    calibration: Path,
    *,
    tp: int = 1,
    pp: int = 1,
    recipe: Path | None = None,
    remember: Callable[[Path, str], None] | None = None,
) -> dict[str, Any]:
    """Convert `hf_dir` with the statistics in `calibration` into a W4A16 AWQ checkpoint, or
    a W4A8 AWQ one for a mode whose GEMMs take FP8 inputs (modes/w4a8_awq: each linear's
    weights_scaling_factor_2 and activation_scaling_factor besides, checkpoint/w4a8.py);
    `recipe`: the recipe stage's recipe.json, whose alphas and rounding it writes (without one,
    alpha by the calibrated diagonal error and nearest rounding: the search's "awq")."""
    family, config, rules, index, notes = plan_conversion(
        hf_dir, FloatMode(mode.dtype), tp=tp, pp=pp
    )
    chosen: dict[str, float | None] = {}
    ratios: list[float] = []
    with ExitStack() as stack:
        stack.enter_context(index)  # closed on every way out, refusals included
        try:
            group = mode.group_for(linear_shapes(config), tp)
        except SpecError as exc:
            raise ConversionError(str(exc)) from None
        stats = load_stats(calibration)
        searched = None if recipe is None else Searched.read(recipe, group, stack, mode.base_name)
        fp8_inputs = mode.activations is not None  # W4A8: FP8 inputs and the weight's FP8 stage
        kv_cache = KVCacheScales.of(mode, config, family, {r.name for r in rules}, calibration,
                                    stats=stats)  # fmt: skip
        layers, others = split_layers(rules)
        config["quantization"].update(
            quant_algo=mode.quant_algo,
            kv_cache_quant_algo=mode.kv_cache_quant_algo,
            group_size=group,
            has_zero_point=False,
            pre_quant_scale=True,
            exclude_modules=list(EXCLUDED),
        )
        dtype = torch_dtype(mode.dtype)

        def tensors(
            i: int, floats: dict[str, torch.Tensor], sources: dict[str, tuple[str, ...]]
        ) -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for name, tensor in floats.items():
                if name not in INT4_LINEARS:  # norms, biases, q/k norms
                    out[name] = tensor.to(dtype)
                    continue
                base = name.removesuffix(".weight")
                if tensor.is_meta:  # the plan: shapes and dtypes alone
                    rows, width = tensor.shape
                    out[name] = torch.empty(rows, width, dtype=torch.int8, device="meta")
                    out[f"{base}.weights_scaling_factor"] = torch.empty(
                        rows, width // group, device="meta"
                    )
                    out[f"{base}.prequant_scaling_factor"] = torch.empty(
                        width, dtype=dtype, device="meta"
                    )
                    if fp8_inputs:
                        for scalar in ("weights_scaling_factor_2", "activation_scaling_factor"):
                            out[f"{base}.{scalar}"] = torch.empty(1, device="meta")
                    continue
                if name in SHARES_INPUT.values() and _partner(name) in floats:
                    continue  # chosen with the GEMM whose input it shares, below
                together = [name, *(n for n in [SHARES_INPUT.get(name)] if n in floats)]
                module = sources[name][0].removesuffix(".weight")  # q/k/v share one input
                sqmean = _stat(stats, module, "input_sqmean").to(tensor.device)
                counts = [len(floats[n]) for n in together]
                whole = torch.cat([floats[n] for n in together]) if len(together) > 1 else tensor
                if searched is None:
                    linear, alpha, ratio = awq_linear(whole, sqmean, group, dtype)
                    ratios.append(ratio)
                else:
                    alpha = searched.alpha(f"transformer.layers.{i}.{name}")
                    linear = searched.linear(
                        i, together, counts, whole, sqmean, alpha, group, dtype
                    )
                fp8_scales = {}
                if fp8_inputs:  # one per GEMM, shared by the GEMMs of one input (TensorRT-LLM
                    # asserts them equal across a fused qkv or gate_up)
                    absmax = _stat(stats, module, "input_absmax").to(tensor.device)
                    pqs, a = input_scales(absmax, linear["prequant_scaling_factor"], whole)
                    if not torch.isfinite((pqs.float() / a).to(dtype)).all():
                        raise ConversionError(
                            f"{module}: its W4A8 input scale makes TensorRT-LLM's "
                            f"pre-quantization scale over it overflow {mode.dtype} (an input "
                            "channel 65504 times quieter than the loudest): build --dtype "
                            "int4-awq"
                        )
                    linear["prequant_scaling_factor"] = pqs
                    fp8_scales = {
                        "weights_scaling_factor_2": weight_scale_2(
                            linear["weight"], linear["weights_scaling_factor"]
                        ),
                        "activation_scaling_factor": a,
                    }
                values = linear["weight"].split(counts)
                scales = linear["weights_scaling_factor"].split(counts)
                for n, v, sc in zip(together, values, scales, strict=True):
                    b = n.removesuffix(".weight")
                    chosen[f"transformer.layers.{i}.{b}"] = alpha
                    out[f"{b}.weight"] = v.contiguous()
                    out[f"{b}.weights_scaling_factor"] = sc.contiguous()
                    out[f"{b}.prequant_scaling_factor"] = linear["prequant_scaling_factor"].clone()
                    out.update({f"{b}.{k}": t.clone() for k, t in fp8_scales.items()})
            scale = kv_cache.scale(sources["attention.qkv.weight"])
            if scale is not None:
                out["attention.kv_cache_scaling_factor"] = scale.to(
                    floats["attention.qkv.weight"].device
                )
            return out

        device = "cuda" if torch.cuda.is_available() else "cpu"  # the layer arithmetic
        job = LayerJob(tensors, layers, others, index, dtype, Mapping.from_config(config),
                       device, per_rank=_pack)  # fmt: skip
        written = job.write(stack, out_dir, remember)
    record = finish(out_dir, config, family, tensors=written, notes=notes)
    if searched is not None:
        write_json(out_dir / "recipe.json", searched.found)  # trtllm-build reads only its own
        record["recipe"] = {k: searched.found[k] for k in ("chosen", "tokens", "device")}
    alphas = sorted(set(chosen.values()), key=lambda a: -1.0 if a is None else a)
    record["awq"] = {
        "group_size": group,
        "alphas": {
            ("none" if a is None else str(a)): sum(1 for v in chosen.values() if v == a)
            for a in alphas
        },
        "error_vs_plain_rounding": round(sum(ratios) / len(ratios), 4) if ratios else None,
    }
    return record


class Searched:
    """The recipe stage's INT4 choices (modes/int4_awq/recipe/search.py): each GEMM's alpha, and
    for a compensated rounding the INT4 values (packed) and group scales by checkpoint name."""

    def __init__(
        self, found: dict[str, Any], weights: SafetensorsIndex | None, dtype: str = "int4-awq"
    ) -> None:
        self.found, self.weights, self.dtype = found, weights, dtype

    @classmethod
    def read(cls, recipe: Path, group: int, stack: ExitStack, dtype: str) -> Searched:
        """The recipe.json `recipe` of a build of --dtype `dtype` (named in its refusals)."""
        if not recipe.is_file():
            raise ConversionError(
                f"{dtype} needs its recipe: run trt-builder recipe --dtype {dtype}"
            )
        found = json.loads(recipe.read_text())
        if found.get("group_size") != group:
            raise ConversionError(
                f"the INT4 recipe was searched at group size {found.get('group_size')}, this "
                f"conversion takes {group}: build with --group-size {group} (the recipe follows "
                "it)"
            )
        weights = None
        if found.get("weights"):
            weights = stack.enter_context(SafetensorsIndex([recipe.parent / found["weights"]]))
        return cls(found, weights, dtype)

    def alpha(self, name: str) -> float | None:
        try:
            return self.found["alphas"][name]  # type: ignore[no-any-return]
        except KeyError:
            raise ConversionError(
                f"the INT4 recipe has no alpha for {name}: it was made for another model; "
                f"rerun it (trt-builder recipe --dtype {self.dtype} --force)"
            ) from None

    def linear(self, layer: int, names: list[str], counts: list[int], weight: torch.Tensor,
               sqmean: torch.Tensor, alpha: float | None, group: int,
               dtype: torch.dtype) -> dict[str, torch.Tensor]:  # fmt: skip
        """The INT4 tensors of the GEMMs `names` (their `counts` rows together in `weight`) at
        `alpha`: the recipe's values where it has them, checked against the group scales
        they were rounded at, else rounded to nearest."""
        weight = weight.to(dtype).float()
        pqs = awq_pqs(weight, sqmean, alpha, group, dtype)
        values, scales, _ = rounded_at(weight, pqs, group, dtype)
        if self.weights is not None:
            parts = [self._tensors(f"transformer.layers.{layer}.{name}", own)
                     for name, own in zip(names, scales.split(counts), strict=True)]  # fmt: skip
            values = torch.cat([v for v, _ in parts]).to(values.device)
            scales = torch.cat([s for _, s in parts]).to(scales.device)
        return {"weight": values, "weights_scaling_factor": scales,
                "prequant_scaling_factor": pqs}  # fmt: skip

    def _tensors(self, name: str, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The recipe's INT4 values and group scales of `name`, its scales checked against
        `own` (absmax / 7 of these weights): each one of the clip ratios' (modes/int4_awq/
        recipe/clipping.py) or a recipe made from other weights."""
        assert self.weights is not None
        at = self.weights.read(name.removesuffix(".weight") + ".weights_scaling_factor")
        ratio = at / own.cpu()
        if at.shape != own.shape or not bool(
            ((ratio >= CLIP_RATIOS[-1] * (1 - 1e-6)) & (ratio <= 1 + 1e-6)).all()
        ):
            raise ConversionError(
                f"the recipe's INT4 rounding of {name} was made from other weights: rerun the "
                f"recipe (trt-builder recipe --dtype {self.dtype} --force)"
            )
        return unpack_rows(self.weights.read(name)), at


def _partner(name: str) -> str:
    """The GEMM whose input `name` shares and whose scale it takes (SHARES_INPUT)."""
    return next(k for k, v in SHARES_INPUT.items() if v == name)


def _pack(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A rank's INT4 values, packed (its other tensors as they are)."""
    return pack_rows(tensor) if tensor.dtype == torch.int8 else tensor


def _stat(stats: dict[str, torch.Tensor], module: str, name: str) -> torch.Tensor:
    try:
        return stats[f"{module}.{name}"]
    except KeyError:
        raise ConversionError(
            f"the calibration has no {name} for {module}: recalibrate this model "
            "(trt-builder calibrate --force)"
        ) from None


@register(Int4Awq)
def _int4_awq(mode: Int4Awq, hf_dir: Path, out_dir: Path, *, tp: int, pp: int,
              calibration: Path | None, recipe: Path | None = None,
              remember: Callable[[Path, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    assert calibration is not None  # AWQ always calibrates: its scales
    return convert_int4_awq(
        hf_dir, out_dir, mode, calibration, tp=tp, pp=pp, recipe=recipe, remember=remember
    )
