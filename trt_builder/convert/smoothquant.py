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
- for the INT8 KV cache, K and V channels balanced by an exact rewrite (trt_builder/convert/kvcache.py):
  factors on the qkv rows go into their `per_channel_scale` (and bias), those on dense's input
  into its `smoother`; `kv_cache_scaling_factor` = the balanced range / 127.
Layout and names follow TensorRT-LLM's llama and gpt converters (docs/quantization.md); tensor- and
pipeline-parallel ranks are split as the float layout's, SmoothQuant's [1, n] vectors with the
rows (qkv, fc, gate scales) or columns (dense, proj smoothers) they belong to. Written by hand:
TensorRT-LLM's converter needs TensorRT-LLM, and modelopt's exporter writes the native format.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..calibrate.stats import load_stats
from ..checkpoint.mapping import Mapping
from ..checkpoint.parallel import shard
from ..checkpoint.safetensors_io import StreamingWriter
from ..core.dtypes import torch_dtype
from ..core.errors import ConversionError
from ..models.family import Family, TensorRule
from ..models.registry import refuse_smoothquant
from ..runtimes.int8 import GEMMS, GROUPS, KEEPS_SMOOTHER, group_name, quantize_rows, smoother
from ..spec.modes import FloatMode, SmoothQuant
from .kvcache import KVBalance, balance, qkv_ranges, refuse_unsupported
from .plan import plan_conversion
from .write import checker, finish, load_sources

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
        job = _Job.plan(mode, calibration, alphas, config, family, rules, index)
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
    if mode.kv_int8:
        refuse_unsupported(config, family, {r.name for r in rules})


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


def _under_source_names(
    stats: dict[str, torch.Tensor], layers: dict[int, list[TensorRule]]
) -> dict[str, torch.Tensor]:
    """The statistics, also under the rules' source names where those differ: calibration names
    the modules of the transformers model (`transformer.h.0.attn.c_attn`), the hub's original
    GPT-2 files name their tensors without the base model's prefix (`h.0.attn.c_attn.weight`)."""
    missing = {m for m in _gemm_modules(layers) if f"{m}.input_absmax" not in stats}
    if not missing:
        return stats
    by_suffix: dict[str, list[str]] = {}  # every dotted tail of a calibrated module -> modules
    for key in stats:
        module = key.removesuffix(".input_absmax")
        if module != key:
            parts = module.split(".")
            for i in range(1, len(parts)):
                by_suffix.setdefault(".".join(parts[i:]), []).append(module)
    out = dict(stats)
    for m in missing:
        found = by_suffix.get(m, [])
        if len(found) == 1:  # else _missing_statistics names it
            for kind in ("input_absmax", "output_absmax"):
                out[f"{m}.{kind}"] = stats[f"{found[0]}.{kind}"]
    return out


def _meta(rule: TensorRule) -> torch.Tensor:
    return torch.empty(rule.shape, device="meta")


@dataclass
class _Job:
    """One SmoothQuant conversion: the decoder layers' rules (by layer), the other tensors
    (embedding first, then ln_f and lm_head), and how each layer is smoothed and quantized."""

    mode: SmoothQuant
    stats: dict[str, torch.Tensor]
    alphas: dict[int, dict[str, float]] | None
    config: dict[str, Any]
    layers: dict[int, list[TensorRule]]
    others: list[TensorRule]
    index: Any
    dtype: torch.dtype
    mapping: Mapping
    device: str = "cpu"

    @classmethod
    def plan(cls, mode: SmoothQuant, calibration: Path,
             alphas: dict[int, dict[str, float]] | None, config: dict[str, Any], family: Family,
             rules: list[TensorRule], index: Any) -> _Job:  # fmt: skip
        """Check what can be checked before writing; the quantization goes into `config`."""
        _refuse(mode, config, family, rules)
        # the layer arithmetic runs on the GPU where there is one (the tensors are written from
        # the CPU); statistics are small, and go there once
        device = "cuda" if torch.cuda.is_available() else "cpu"
        stats = {k: v.to(device) for k, v in load_stats(calibration).items()}
        layers: dict[int, list[TensorRule]] = {}
        others: list[TensorRule] = []
        for rule in rules:
            if rule.name.startswith("transformer.layers."):
                layers.setdefault(int(rule.name.split(".")[2]), []).append(rule)
            else:
                others.append(rule)
        stats = _under_source_names(stats, layers)
        _missing_statistics(layers, stats)
        config["quantization"].update(
            quant_algo=mode.quant_algo,
            kv_cache_quant_algo="INT8" if mode.kv_int8 else None,
            smoothquant_val=mode.alpha,
        )
        return cls(mode, stats, alphas, config, layers, others, index, torch_dtype(mode.dtype),
                   Mapping.from_config(config), device)  # fmt: skip

    def layer(self, i: int, read: Any) -> dict[str, torch.Tensor]:
        """Layer i's checkpoint tensors, from its float tensors as `read` gives them."""
        group = self.layers[i]
        floats = {r.name.split(".", 3)[3]: read(r) for r in group}
        sources = {r.name.split(".", 3)[3]: r.sources for r in group}
        kv = None
        if self.mode.kv_int8:
            kv = balance(qkv_ranges(self.stats, sources["attention.qkv.weight"]), self.config)
        tensors = _layer_tensors(floats, self.stats, sources, self.mode, self.dtype, kv,
                                 (self.alphas or {}).get(i))  # fmt: skip
        return {f"transformer.layers.{i}.{k}": v for k, v in tensors.items()}

    def real(self, rule: TensorRule) -> torch.Tensor:
        """A rule's source tensors, concatenated, in float32; refuses NaN and Inf."""
        parts = load_sources(rule, self.index)
        tensor = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(self.device).float()
        if not bool(torch.isfinite(tensor).all()):
            raise ConversionError(
                f"{rule.name} ({', '.join(rule.sources)}) contains NaN or Inf values"
            )
        return tensor

    def rank_plans(self) -> list[dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
        """Each rank file's tensors (dtype, shape) in writing order, from meta tensors: split
        into ranks as the float layout's (checkpoint/parallel.py)."""
        plans: list[dict[str, tuple[torch.dtype, tuple[int, ...]]]] = [
            {} for _ in range(self.mapping.world)
        ]

        def add(name: str, t: torch.Tensor) -> None:
            for rank, local, pieces in shard(name, [t], self.mapping):
                shape = (sum(p.shape[0] for p in pieces), *pieces[0].shape[1:])
                plans[rank][local] = (t.dtype, shape)

        for rule in self.others[:1]:  # the embedding first, as in the float layout
            add(rule.name, torch.empty(rule.shape, dtype=self.dtype, device="meta"))
        for i in sorted(self.layers):
            for name, t in self.layer(i, _meta).items():
                add(name, t)
        for rule in self.others[1:]:
            add(rule.name, torch.empty(rule.shape, dtype=self.dtype, device="meta"))
        return plans

    def write(
        self, stack: ExitStack, out_dir: Path, remember: Callable[[Path, str], None] | None
    ) -> int:
        """Smooth, quantize and write every rank file; the count of tensors written."""
        plans = self.rank_plans()
        writers = [
            stack.enter_context(
                StreamingWriter(
                    out_dir / f"rank{rank}.safetensors", plan, {"format": "pt"}, remember
                )
            )
            for rank, plan in enumerate(plans)
        ]

        def put(name: str, parts: list[torch.Tensor], check: Any = None) -> None:
            for rank, local, pieces in shard(name, parts, self.mapping):
                writers[rank].write(local, pieces, check)

        for rule in self.others[:1]:
            put(rule.name, load_sources(rule, self.index), checker(rule, self.dtype))
        order = sorted(self.layers)
        # the next layer's float tensors are read (and moved to the GPU) on a thread while
        # this one is smoothed, quantized and written: reading and writing overlap
        with ThreadPoolExecutor(1, thread_name_prefix="convert-read") as pool:
            ahead = pool.submit(self.read_layer, order[0]) if order else None
            for n, i in enumerate(order):
                assert ahead is not None
                floats = ahead.result()
                if n + 1 < len(order):
                    ahead = pool.submit(self.read_layer, order[n + 1])
                self.write_layer(i, floats, put)
        for rule in self.others[1:]:
            put(rule.name, load_sources(rule, self.index), checker(rule, self.dtype))
        return sum(len(p) for p in plans)

    def read_layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's float tensors (`real`), by rule name."""
        return {rule.name: self.real(rule) for rule in self.layers[i]}

    def write_layer(self, i: int, floats: dict[str, torch.Tensor], put: Any) -> None:
        """Smooth, quantize and write layer i from its float tensors."""
        for name, tensor in self.layer(i, lambda rule: floats[rule.name]).items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ConversionError(
                    f"{name} is not finite after smoothing: recalibrate (trt-builder calibrate --force)"
                )
            put(name, [tensor.cpu()])
