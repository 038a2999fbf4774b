"""SmoothQuant W8A8 (and the INT8 KV cache) in TensorRT-LLM's plugin checkpoint format.

From calibration statistics (trt_builder/calibrate/stats.py), per decoder layer:
- a smoother per input channel, s_c = max(ax_c^alpha / max_j|W_jc|^(1-alpha), 1e-5), over every
  GEMM that reads that input (q, k, v together; fc and gate together). W' = W diag(s); for qkv
  and fc/gate it is folded into the norm before them (gamma / s, and beta / s for GPT-2's
  LayerNorm), for dense and proj it is stored as `smoother` and divided out of the activation
  at run time;
- int8 weights per output channel, Wq = round_half_even(W' * 127 / aw_j) with aw_j the row's
  max |W'|, and `per_channel_scale` aw_j / 127 (per token) or the static product of input and
  output scales (per tensor);
- static activation scales (`scale_to_int`, `quantization_scaling_factor`, `act_scale`) from the
  input and output ranges;
- for the INT8 KV cache, K and V channels balanced by an exact rewrite (trt_builder/modes/kvcache/convert.py):
  factors on the qkv rows go into their `per_channel_scale` (and bias), those on dense's input
  into its `smoother`; `kv_cache_scaling_factor` = the balanced range / 127.
Layout and names follow TensorRT-LLM's llama and gpt converters (docs/quantization.md); tensor- and
pipeline-parallel ranks are split as the float layout's, SmoothQuant's [1, n] vectors with the
rows (qkv, fc, gate scales) or columns (dense, proj smoothers) they belong to. Written by hand:
TensorRT-LLM's converter needs TensorRT-LLM, and modelopt's exporter writes the native format.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ...calibrate.stats import load_stats
from ...checkpoint.mapping import Mapping
from ...convert.dispatch import register
from ...convert.layers import LayerJob, split_layers
from ...convert.plan import plan_conversion
from ...convert.write import finish
from ...core.dtypes import torch_dtype
from ...core.errors import ConversionError
from ...core.fsio import write_json
from ...models.family import Family, TensorRule
from ...models.registry import refuse_smoothquant
from ...runtimes.int8 import GEMMS, GROUPS, KEEPS_SMOOTHER, group_name, quantize_rows, smoother
from .. import FloatMode, SmoothQuant
from ..kvcache.convert import KVBalance, KVCacheScales

F32 = torch.float32
#: The norms in front of qkv and fc, which take their smoothers (with biases: GPT-2's LayerNorm).
NORMS = ("input_layernorm.weight", "input_layernorm.bias", "post_layernorm.weight",
         "post_layernorm.bias")  # fmt: skip


def _layer_tensors(
    floats: dict[str, torch.Tensor],
    stats: dict[str, torch.Tensor],
    sources: dict[str, tuple[str, ...]],
    mode: SmoothQuant,
    dtype: torch.dtype,
    kv: KVBalance | None = None,
    alphas: dict[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """One layer's checkpoint tensors, in writing order, from its float tensors (TensorRT-LLM
    names without the layer prefix); `kv` balances K and V for the INT8 KV cache; `alphas`
    overrides mode.alpha per GEMM group (qkv, dense, fc, proj)."""
    out: dict[str, torch.Tensor] = {}
    rows = {"attention.qkv.weight": kv.qkv_rows} if kv is not None else {}

    def ax(name: str) -> torch.Tensor:
        module = sources[name][0].removesuffix(".weight")
        return stats[f"{module}.input_absmax"].to(floats[name].device)

    def ay(name: str) -> torch.Tensor:  # on the weights' device, as ax (meta when planning)
        if kv is not None and name == "attention.qkv.weight":
            return kv.qkv_range.to(floats[name].device)
        return (
            torch.stack(
                [stats[f"{s.removesuffix('.weight')}.output_absmax"].amax() for s in sources[name]]
            )
            .amax()
            .to(floats[name].device)
        )

    smoothed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (W', s)
    static_in: dict[str, torch.Tensor] = {}  # name -> scale_to_int of its input
    for lead, group in GROUPS.items():
        members = [m for m in group if m in floats]  # GPT-2's MLP has no gate
        weights = [floats[m].float() for m in members]
        alpha = (alphas or {}).get(group_name(lead), mode.alpha)
        s = smoother(ax(lead), weights, float(alpha or 0.0))
        to_int = 127.0 / (ax(lead).float() / s).amax().clamp(min=1e-8)
        for m, w in zip(members, weights, strict=True):
            smoothed[m] = (w * s[None, :], s)
            static_in[m] = to_int
    for name, tensor in floats.items():
        if name in NORMS:  # the GEMM reads norm / s: gamma / s, and a LayerNorm's beta / s
            gemm = "attention.qkv.weight" if name.startswith("input") else "mlp.fc.weight"
            s = smoothed[gemm][1]
            out[name] = (tensor.float() / s).to(dtype)
            if name.endswith(".weight"):
                scale = static_in[gemm] if not mode.per_token else torch.tensor(1.0)
                out[name.replace(".weight", ".scale_to_int")] = scale.reshape(1).to(F32)
        elif name in smoothed:
            w, s = smoothed[name]
            q, aw = quantize_rows(w)
            if name in rows:  # exact: the int8 rows stay, their scales take the factor
                aw = aw * rows[name].to(aw.device)
            if name == "attention.dense.weight" and kv is not None:
                s = s * kv.dense_in.to(s.device)  # its input channels come multiplied
            out[name] = q
            base = name.removesuffix(".weight")
            if mode.per_token:
                out[f"{base}.per_channel_scale"] = (aw / 127.0).reshape(1, -1).to(F32)
            else:
                y = ay(name).float().clamp(min=1e-8)
                pcs = (127.0 / y) / (static_in[name] * 127.0 / aw)
                out[f"{base}.per_channel_scale"] = pcs.reshape(1, -1).to(F32)
                out[f"{base}.act_scale"] = (y / 127.0).reshape(1, 1).to(F32)
            if name in KEEPS_SMOOTHER:
                out[f"{base}.smoother"] = s.reshape(1, -1).to(F32)
                if not mode.per_token:
                    block = name.split(".")[0]  # attention / mlp
                    out[f"{block}.quantization_scaling_factor"] = static_in[name].reshape(1).to(F32)
        elif name == "attention.qkv.bias" and kv is not None:
            out[name] = (tensor.float() * kv.qkv_rows.to(tensor.device)).to(dtype)
        else:  # biases, q/k norms: the model dtype
            out[name] = tensor.to(dtype)
    if kv is not None:
        out["attention.kv_cache_scaling_factor"] = kv.scale.to(F32)
    return out


def convert_smoothquant(
    hf_dir: Path,
    out_dir: Path,
    mode: SmoothQuant,
    calibration: Path,
    *,
    tp: int = 1,
    pp: int = 1,
    alphas: dict[int, dict[str, float]] | None = None,
    remember: Callable[[Path, str], None] | None = None,
) -> dict[str, Any]:
    """Convert `hf_dir` with the statistics in `calibration` into a SmoothQuant checkpoint;
    `alphas` (layer -> group -> alpha, from the recipe search) overrides mode.alpha;
    `remember` is given each rank file's sha256, hashed as it was written."""
    family, config, rules, index, notes = plan_conversion(
        hf_dir, FloatMode(mode.dtype), tp=tp, pp=pp
    )
    with ExitStack() as stack:
        stack.enter_context(index)  # closed on every way out, refusals included
        job = plan_job(mode, calibration, alphas, config, family, rules, index)
        tensors = job.write(stack, out_dir, remember)
    # config.json last, once every rank file is complete
    summary = finish(out_dir, config, family, tensors=tensors, notes=notes)
    return {**summary, "alpha": "per layer" if alphas else mode.alpha}


def _refuse(
    mode: SmoothQuant, config: dict[str, Any], family: Family, rules: list[TensorRule]
) -> None:
    """What SmoothQuant cannot convert, before any work."""
    refuse_smoothquant(family, config["architecture"])
    if mode.alpha is None:
        raise ConversionError("SmoothQuant alpha is not chosen: run the recipe search first")


def _missing_statistics(
    layers: dict[int, list[TensorRule]], stats: dict[str, torch.Tensor]
) -> None:
    """Refuse a calibration that lacks an input range of one of the INT8 GEMMs."""
    missing = [
        f"{m}.input_absmax" for m in _gemm_modules(layers) if f"{m}.input_absmax" not in stats
    ]
    if missing:
        raise ConversionError(
            f"the calibration has no statistics for {missing[0]}: recalibrate this model "
            "(trt-builder calibrate --force)"
        )


def _gemm_modules(layers: dict[int, list[TensorRule]]) -> list[str]:
    """The HF modules of the INT8 GEMMs, as the rules' sources name them, in the rules' order."""
    return [
        s.removesuffix(".weight")
        for group in layers.values()
        for rule in group
        if rule.name.split(".", 3)[3] in GEMMS
        for s in rule.sources
    ]


def plan_job(
    mode: SmoothQuant,
    calibration: Path,
    alphas: dict[int, dict[str, float]] | None,
    config: dict[str, Any],
    family: Family,
    rules: list[TensorRule],
    index: Any,
) -> LayerJob:
    """Check what can be checked before writing; the quantization goes into `config`."""
    _refuse(mode, config, family, rules)
    # the layer arithmetic runs on the GPU where there is one (the tensors are written from
    # the CPU); statistics are small, and go there once
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stats = {k: v.to(device) for k, v in load_stats(calibration).items()}
    layers, others = split_layers(rules)
    _missing_statistics(layers, stats)
    kv_cache = KVCacheScales.of(mode, config, family, {r.name for r in rules}, calibration,
                                stats=stats)  # fmt: skip
    config["quantization"].update(
        quant_algo=mode.quant_algo,
        kv_cache_quant_algo=mode.kv_cache_quant_algo,
        smoothquant_val=mode.alpha,
    )
    dtype = torch_dtype(mode.dtype)

    def layer_tensors(
        i: int, floats: dict[str, torch.Tensor], sources: dict[str, tuple[str, ...]]
    ) -> dict[str, torch.Tensor]:
        qkv = sources["attention.qkv.weight"]
        kv = kv_cache.balance(qkv)
        out = _layer_tensors(floats, stats, sources, mode, dtype, kv, (alphas or {}).get(i))
        scale = kv_cache.scale(qkv, kv)
        if scale is not None and kv is None:  # the INT8 cache's is written with its balancing
            out["attention.kv_cache_scaling_factor"] = scale.to(
                floats["attention.qkv.weight"].device
            )
        return out

    return LayerJob(layer_tensors, layers, others, index, dtype, Mapping.from_config(config),
                    device)  # fmt: skip


@register(SmoothQuant)
def _smoothquant(mode: SmoothQuant, hf_dir: Path, out_dir: Path, *, tp: int, pp: int,
                 calibration: Path | None, recipe: Path | None = None,
                 remember: Callable[[Path, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    assert calibration is not None  # SmoothQuant always calibrates
    found, per_layer = None, None
    if mode.alpha is None:  # the recipe stage chose them
        if recipe is None or not recipe.is_file():
            raise ConversionError("SmoothQuant alpha auto needs the recipe: run trt-builder recipe")
        found = json.loads(recipe.read_text())
        per_layer = {int(k): v for k, v in found["alphas"].items()}
        mode = replace(mode, alpha=float(found["alpha"]))
    summary = convert_smoothquant(hf_dir, out_dir, mode, calibration, tp=tp, pp=pp,
                                  alphas=per_layer, remember=remember)  # fmt: skip
    if found is not None:
        write_json(out_dir / "recipe.json", found)  # trtllm-build reads only its own files
        summary["recipe"] = {k: found[k] for k in ("chosen", "alpha", "tokens", "device")}
    return summary
