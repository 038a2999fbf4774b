"""SmoothQuant W8A8 (and the INT8 KV cache) in TensorRT-LLM's plugin checkpoint format.

From calibration statistics (trt_builder/calibrate.py), per decoder layer:
- a smoother per input channel, s_c = max(ax_c^alpha / max_j|W_jc|^(1-alpha), 1e-5), over every
  GEMM that reads that input (q, k, v together; fc and gate together). W' = W diag(s); for qkv
  and fc/gate it is folded into the norm before them (gamma / s), for dense and proj it is
  stored as `smoother` and divided out of the activation at run time;
- int8 weights per output channel, Wq = round_half_even(W' * 127 / aw_j) with aw_j the row's
  max |W'|, and `per_channel_scale` aw_j / 127 (per token) or the static product of input and
  output scales (per tensor);
- static activation scales (`scale_to_int`, `quantization_scaling_factor`, `act_scale`) from the
  input and output ranges;
- `kv_cache_scaling_factor` = max |q|, |k|, |v| projection output / 127 for the INT8 KV cache.
Layout and names follow TensorRT-LLM's llama converter (docs/quantization.md). Written by hand:
TensorRT-LLM's converter needs TensorRT-LLM, and modelopt's exporter writes the native format.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from .calibrate import load_stats
from .convert import _TORCH_DTYPES, _checker, _load, finish, plan_conversion
from .errors import ConversionError
from .models import TensorRule
from .quant import FloatMode, SmoothQuant
from .safetensors_io import StreamingWriter

#: The INT8 GEMMs of a layer; dense and proj keep their smoother (the others fold it into the
#: norm in front of them).
GEMMS = ("attention.qkv.weight", "attention.dense.weight", "mlp.fc.weight", "mlp.gate.weight",
         "mlp.proj.weight")  # fmt: skip
KEEPS_SMOOTHER = ("attention.dense.weight", "mlp.proj.weight")
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
F32 = torch.float32


def smoother(ax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s per input channel for GEMMs that share an input: ax^alpha / max|W|^(1-alpha)."""
    wmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0).float()
    s = ax.float().clamp(min=1e-5).pow(alpha) / wmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, aw per output row): round half to even of w * 127 / aw."""
    aw = w.abs().amax(dim=1).float().clamp(min=1e-8)
    q = torch.round(w.float() * (127.0 / aw)[:, None]).clamp(-127, 127).to(torch.int8)
    return q, aw


def _layer_tensors(
    floats: dict[str, torch.Tensor],
    stats: dict[str, torch.Tensor],
    sources: dict[str, tuple[str, ...]],
    mode: SmoothQuant,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """One layer's checkpoint tensors, in writing order, from its float tensors (TensorRT-LLM
    names without the layer prefix)."""
    out: dict[str, torch.Tensor] = {}

    def ax(name: str) -> torch.Tensor:
        module = sources[name][0].removesuffix(".weight")
        return stats[f"{module}.input_absmax"].to(floats[name].device)

    def ay(name: str) -> torch.Tensor:
        return torch.stack(
            [stats[f"{s.removesuffix('.weight')}.output_absmax"].reshape(()) for s in sources[name]]
        ).amax()

    groups = {
        "attention.qkv.weight": ["attention.qkv.weight"],
        "attention.dense.weight": ["attention.dense.weight"],
        "mlp.fc.weight": ["mlp.fc.weight", "mlp.gate.weight"],
        "mlp.proj.weight": ["mlp.proj.weight"],
    }
    smoothed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (W', s)
    static_in: dict[str, torch.Tensor] = {}  # name -> scale_to_int of its input
    for lead, members in groups.items():
        weights = [floats[m].float() for m in members]
        s = smoother(ax(lead), weights, float(mode.alpha or 0.0))
        to_int = 127.0 / (ax(lead).float() / s).amax().clamp(min=1e-8)
        for m, w in zip(members, weights, strict=True):
            smoothed[m] = (w * s[None, :], s)
            static_in[m] = to_int
    for name, tensor in floats.items():
        if name in ("input_layernorm.weight", "post_layernorm.weight"):
            gemm = "attention.qkv.weight" if name.startswith("input") else "mlp.fc.weight"
            s = smoothed[gemm][1]
            out[name] = (tensor.float() / s).to(dtype)
            scale = static_in[gemm] if not mode.per_token else torch.tensor(1.0)
            out[name.replace(".weight", ".scale_to_int")] = scale.reshape(1).to(F32)
        elif name in smoothed:
            w, s = smoothed[name]
            q, aw = quantize_rows(w)
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
        else:  # biases, q/k norms: the model dtype
            out[name] = tensor.to(dtype)
    if mode.kv_int8:
        out["attention.kv_cache_scaling_factor"] = (
            (ay("attention.qkv.weight") / 127.0).reshape(1).to(F32)
        )
    return out


def convert_smoothquant(
    hf_dir: Path, out_dir: Path, mode: SmoothQuant, calibration: Path, *, tp: int = 1, pp: int = 1
) -> dict[str, Any]:
    """Convert `hf_dir` with the statistics in `calibration` into a SmoothQuant checkpoint."""
    if tp != 1 or pp != 1:
        raise ConversionError(
            "SmoothQuant checkpoints are written for tp=1, pp=1 so far: build the INT8 engine "
            "without --tp/--pp, or use --dtype int8-wo for split ranks"
        )
    family, config, rules, index, notes = plan_conversion(hf_dir, FloatMode(mode.dtype))
    if config["architecture"] not in SUPPORTED:
        raise ConversionError(
            f"SmoothQuant is not supported for {config['architecture']} yet: use --dtype int8-wo "
            f"(SmoothQuant supports {', '.join(SUPPORTED)})"
        )
    if mode.alpha is None:
        raise ConversionError("SmoothQuant alpha is not chosen: run the recipe search first")
    stats = load_stats(calibration)
    config["quantization"].update(
        quant_algo=mode.quant_algo,
        kv_cache_quant_algo="INT8" if mode.kv_int8 else None,
        smoothquant_val=mode.alpha,
    )
    dtype = _TORCH_DTYPES[mode.dtype]
    layers: dict[int, list[TensorRule]] = {}
    others: list[TensorRule] = []
    for rule in rules:
        parts = rule.name.split(".")
        if rule.name.startswith("transformer.layers."):
            layers.setdefault(int(parts[2]), []).append(rule)
        else:
            others.append(rule)
    missing = [
        f"{s.removesuffix('.weight')}.input_absmax"
        for group in layers.values()
        for rule in group
        if rule.name.split(".", 3)[3] in GEMMS
        for s in rule.sources
        if f"{s.removesuffix('.weight')}.input_absmax" not in stats
    ]
    if missing:
        raise ConversionError(
            f"the calibration has no statistics for {missing[0]}: recalibrate this model "
            "(trt-builder calibrate --force)"
        )

    def layer(i: int, read: Any) -> dict[str, torch.Tensor]:
        group = layers[i]
        floats = {r.name.split(".", 3)[3]: read(r) for r in group}
        sources = {r.name.split(".", 3)[3]: r.sources for r in group}
        return {f"transformer.layers.{i}.{k}": v for k, v in
                _layer_tensors(floats, stats, sources, mode, dtype).items()}  # fmt: skip

    def meta(rule: TensorRule) -> torch.Tensor:
        return torch.empty(rule.shape, device="meta")

    def real(rule: TensorRule) -> torch.Tensor:
        parts = _load(rule, index)
        tensor = (parts[0] if len(parts) == 1 else torch.cat(parts)).float()
        if not bool(torch.isfinite(tensor).all()):
            raise ConversionError(
                f"{rule.name} ({', '.join(rule.sources)}) contains NaN or Inf values"
            )
        return tensor

    plan: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for rule in others[:1]:  # the embedding first, as in the float layout
        plan[rule.name] = (dtype, rule.shape)
    for i in sorted(layers):
        for name, t in layer(i, meta).items():
            plan[name] = (t.dtype, tuple(t.shape))
    for rule in others[1:]:
        plan[rule.name] = (dtype, rule.shape)
    check_cache = {r.name: _checker(r, dtype) for r in rules}
    with ExitStack() as stack:
        stack.enter_context(index)
        writer = stack.enter_context(
            StreamingWriter(out_dir / "rank0.safetensors", plan, {"format": "pt"})
        )
        for rule in others[:1]:
            writer.write(rule.name, _load(rule, index), check_cache[rule.name])
        for i in sorted(layers):
            for name, tensor in layer(i, real).items():
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise ConversionError(
                        f"{name} is not finite after smoothing: recalibrate (trt-builder calibrate --force)"
                    )
                writer.write(name, tensor)
        for rule in others[1:]:
            writer.write(rule.name, _load(rule, index), check_cache[rule.name])
    return {**finish(out_dir, config, family, tensors=len(plan), notes=notes), "alpha": mode.alpha}
