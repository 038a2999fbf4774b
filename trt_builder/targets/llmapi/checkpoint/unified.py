"""The Hugging Face checkpoint of `--target llmapi` (docs/llmapi.md): what TensorRT-LLM's PyTorch
backend (`LLM(model=dir)`, trtllm-serve) and vLLM load, in modelopt's unified format where it is
quantized, written from the TensorRT-LLM checkpoint convert makes (TP=1) by running the
family's tensor rules backwards, and read back into one by the same rules. So verify, the
checkpoint runtime and the reference backend run it as they run the engine target's, and the
two targets hold the same quantized numbers.

The format (docs/llmapi.md has the per-release table and its sources):
- `model.safetensors`: the model's own tensor names; q, k, v and gate, up unfused. FP8:
  `<module>.weight` float8_e4m3fn [out, in], `<module>.weight_scale` and `<module>.input_scale`
  float32 scalars (shape []), dequantization scales; with the FP8 KV cache
  `self_attn.k_proj.k_scale` and `self_attn.v_proj.v_scale` (amax / 448, float32 []).
- `hf_quant_config.json` (quantized only), the file TensorRT-LLM reads:
  `{"producer": {...}, "quantization": {"quant_algo", "kv_cache_quant_algo", "exclude_modules"}}`;
  `config.json` carries the same as `quantization_config` (`"quant_method": "modelopt"`), the
  key vLLM and transformers read.

A vision-language model (Qwen2.5-VL) is written whole, as the PyTorch backend serves it: the
language model as above, the vision tower copied from the source unquantized in the checkpoint's
dtype under the hub's names (`visual.*`; targets/llmapi/checkpoint/loaders.py has what each loader reads),
and listed in exclude_modules as modelopt lists it (`visual*`) and plainly (`visual`, which
vLLM 0.10-0.11 match as a substring). read_unified reads the language model alone.

q, k and v (and gate and up) are written with one weight scale, the larger, as the engine
checkpoint holds them: both loaders fuse those GEMMs and requantize each shard to the largest
scale of the group (TensorRT-LLM's FP8QDQLinearMethod, vLLM's requantize_with_max_scale), so a
shared scale is what they compute, rounded once instead of twice (modelopt 0.47's
export_hf_checkpoint writes each its own; docs/llmapi.md lists the differences).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ....checkpoint.config import engine_config
from ....checkpoint.fp8 import E4M3, to_e4m3
from ....checkpoint.int4 import pack_rows, unpack_rows
from ....checkpoint.safetensors_io import SafetensorsIndex
from ....checkpoint.weights import weight_files
from ....core.errors import InputError
from ....models.family import TensorRule
from ....models.registry import family_for
from ....modes import Mode, mode_of
from ....modes.kvcache.spec import KV_SCHEME
from ....modes.quantization import hf_quantization
from ....modes.weight_only.checkpoint import WEIGHT_ONLY_LINEARS, quantize_rows

#: The weights file written; its quantization file.
WEIGHTS = "model.safetensors"
HF_QUANT = "hf_quant_config.json"
#: The K and V cache scales, on the k and v projections (modelopt's names, vLLM remaps them).
KV_SCALES = ("k_proj.k_scale", "v_proj.v_scale")
#: In the TensorRT-LLM-named tensors read_unified gives, the per-row scale of a W8A16 GEMM
#: whose `weight` is the checkpoint's int8 (a name of trt-builder's: the engine checkpoint has
#: float weights, which trtllm-build quantizes; runtimes/checkpoint.py multiplies the two).
WEIGHT_SCALE = ".weight_only_scale"
#: The key read_unified adds to the TensorRT-LLM config it makes of a Hugging Face checkpoint:
#: the checkpoint runtime then quantizes W4A8 inputs as the PyTorch backend does, not as the
#: engine does (checkpoint/w4a8.py); no file holds it.
PYTORCH_BACKEND = "trt_builder_pytorch_backend"
#: W4A8 AWQ's per-GEMM FP8 scalars: Hugging Face name -> TensorRT-LLM name.
W4A8_SCALARS = {"weight_scale_2": "weights_scaling_factor_2",
                "input_scale": "activation_scaling_factor"}  # fmt: skip


def is_unified(directory: Path) -> bool:
    """Whether `directory` holds a Hugging Face checkpoint (config.json with `architectures`)
    rather than a TensorRT-LLM one (`architecture`)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "architecture" not in config and "architectures" in config


def _base(name: str) -> str:
    return name.removesuffix(".weight")


#: The norm whose output each GEMM reads, by TensorRT-LLM's names within a decoder layer.
NORM_BEFORE = {"attention.qkv": "input_layernorm", "mlp.fc": "post_layernorm",
               "mlp.gate": "post_layernorm"}  # fmt: skip
_PREQUANT = re.compile(r"^(transformer\.layers\.\d+\.)(.+)\.prequant_scaling_factor$")


def fold_prequant(tensors: dict[str, torch.Tensor]) -> None:
    """AWQ's pre-quantization scale of the GEMMs that read a norm's output (NORM_BEFORE),
    folded into that norm, in place: its weight (and bias) times the scale, rounded to its
    dtype, and the scale dropped, as modelopt 0.47's unified export does
    (fuse_prequant_layernorm). TensorRT-LLM's PyTorch backend reads no pre_quant_scale for its
    fused qkv and gate_up GEMMs; fc and gate carry one scale (modes/int4_awq/convert.py)."""
    folded: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        match = _PREQUANT.match(name)
        if match is None or match.group(2) not in NORM_BEFORE:
            continue
        scale = tensors.pop(name)
        norm = match.group(1) + NORM_BEFORE[match.group(2)]
        if norm in folded:
            if not torch.equal(folded[norm], scale):
                raise ValueError(f"internal: the GEMMs after {norm} have different AWQ scales")
            continue
        folded[norm] = scale
        for part in (f"{norm}.weight", f"{norm}.bias"):
            if part in tensors:
                kept = tensors[part]
                tensors[part] = (kept.float() * scale.float()).to(kept.dtype)


def _int4_parts(packed: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """A packed INT4 weight [out / 2, in] split into its sources' rows, each packed on its own
    and stored as modelopt stores it (uint8)."""
    values = unpack_rows(packed)
    return [pack_rows(v).view(torch.uint8) for v in values.split(rows)]


def hf_tensors(
    tensors: dict[str, torch.Tensor],
    rules: list[TensorRule],
    kv_scales: dict[str, torch.Tensor],
    weight_only: torch.dtype | None = None,
    *,
    int4: bool = False,
) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of a TP=1 TensorRT-LLM checkpoint's `tensors` (taken from the
    dict as they are placed), by the family's `rules` for the source model; `kv_scales`: the
    k_scale / v_scale tensors by Hugging Face name, for the FP8 KV cache; `weight_only`: the
    model dtype of a W8A16 checkpoint, whose GEMM weights are written as INT8 values
    (modes/weight_only/checkpoint.py); `int4`: the GEMM weights are packed INT4 groups
    (checkpoint/int4.py), whose pre-quantization scales are folded into the norms before
    where they can be (fold_prequant)."""
    out: dict[str, torch.Tensor] = {}
    if int4:
        fold_prequant(tensors)
    for rule in rules:
        tensor = tensors.pop(rule.name)
        scales: dict[str, torch.Tensor] = {}
        row_scales: list[torch.Tensor] = []
        packed = int4 and tensor.dtype == torch.int8  # INT4 rows: unpacked to be split
        parts = tensor.split(rule.rows()) if len(rule.sources) > 1 and not packed else [tensor]
        if packed:
            base = _base(rule.name)
            parts = _int4_parts(tensor, rule.rows())
            group_scales = tensors.pop(f"{base}.weights_scaling_factor")
            row_scales = list(group_scales.split(rule.rows()))
            pre_quant = tensors.pop(f"{base}.prequant_scaling_factor", None)
            if pre_quant is not None:  # o_proj, down_proj: one source each
                scales["pre_quant_scale"] = pre_quant
            for hf_name, engine in W4A8_SCALARS.items():  # W4A8: every source the GEMM's
                if f"{base}.{engine}" in tensors:
                    scales[hf_name] = tensors.pop(f"{base}.{engine}").float().reshape(())
        if tensor.dtype == torch.uint8:  # NVFP4: codes paired along the input, rows as they are
            base = _base(rule.name)
            row_scales = list(tensors.pop(f"{base}.weights_scaling_factor").split(rule.rows()))
            scales = {
                "weight_scale_2": tensors.pop(f"{base}.weights_scaling_factor_2").reshape(()),
                "input_scale": tensors.pop(f"{base}.activation_scaling_factor").reshape(()),
            }
        if weight_only is not None and rule.name.endswith(WEIGHT_ONLY_LINEARS):
            q, row = quantize_rows(tensor, weight_only)
            parts = q.split(rule.rows()) if len(rule.sources) > 1 else [q]
            row_scales = list(row.split(rule.rows())) if len(rule.sources) > 1 else [row]
        if tensor.dtype == E4M3:
            base = _base(rule.name)
            scales = {
                "weight_scale": tensors.pop(f"{base}.weights_scaling_factor").reshape(()),
                "input_scale": tensors.pop(f"{base}.activation_scaling_factor").reshape(()),
            }
        for source, part in zip(rule.sources, parts, strict=True):
            part = part.t() if rule.transpose else part
            if source in out:  # the tied lm_head: the embedding, stored once
                if not torch.equal(out[source], part):
                    raise ValueError(f"internal: {rule.name} differs from {source}, stored once")
                continue
            out[source] = part.contiguous()
            for suffix, scale in scales.items():
                out[f"{_base(source)}.{suffix}"] = scale.clone()
        for source, row in zip(rule.sources, row_scales, strict=False):
            out[f"{_base(source)}.weight_scale"] = row.contiguous()
    for name in [n for n in tensors if n.endswith(".kv_cache_scaling_factor")]:
        del tensors[name]  # the engine's: the Hugging Face checkpoint has k_scale and v_scale
    if tensors:
        raise ValueError(f"internal: no Hugging Face name for {sorted(tensors)[0]}")
    return {**out, **kv_scales}


def vision_tensors(
    index: SafetensorsIndex, prefixes: tuple[str, ...], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The vision tower's tensors of the source `index` (those under `prefixes`, a family's
    `vision_tower`), unquantized in `dtype`, under the hub's prefix `prefixes[0]`
    (transformers 4.52-4.57 saved Qwen2.5-VL's as `model.visual.`, which TensorRT-LLM main
    does not rename for it)."""
    out: dict[str, torch.Tensor] = {}
    for name in index.names():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is not None:
            tensor = index.read(name)
            kind = dtype if tensor.is_floating_point() else tensor.dtype
            out[prefixes[0] + name.removeprefix(prefix)] = tensor.to(kind, copy=True)
    return out


def tower_exclusions(prefixes: tuple[str, ...]) -> list[str]:
    """exclude_modules' entries for a vision tower: modelopt's `visual*` and the plain prefix
    (vLLM 0.10-0.11 match entries as substrings, so `visual*` matches nothing there)."""
    plain = prefixes[0].rstrip(".")
    return [f"{plain}*", plain]


def quantization(
    mode: Mode,
    exclude_modules: list[str],
    *,
    tower: bool = False,
    fields: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(hf_quant_config.json, config.json's quantization_config) of a quantized checkpoint, as
    modelopt 0.47's export_hf_checkpoint writes them for FP8; None for a float one. The
    producer is trt-builder: TensorRT-LLM does not read it, and vLLM reads config.json's
    quantization_config first (its hf_quant_config.json path alone asks for modelopt). With a
    vision `tower`, config.json lists the exclusions under `exclude_modules` too: vLLM
    0.10-0.11 read that key there, not `ignore` (the language model's lm_head and embedding
    are never quantized there, so without a tower the file stays modelopt's). `fields`: the
    mode's further keys of hf_quant_config.json (Mode.hf_quant_fields)."""
    quant_algo, kv_cache_quant_algo = mode.quant_algo, mode.kv_cache_quant_algo
    if quant_algo is None:  # TensorRT-LLM's LLM API refuses a pre-quantized one without it
        return None
    from .... import __version__

    producer = {"name": "trt-builder", "version": __version__}
    hf_quant = {
        "producer": producer,
        "quantization": {
            "quant_algo": quant_algo,
            "kv_cache_quant_algo": kv_cache_quant_algo,
            **(fields or {}),
            "exclude_modules": exclude_modules,
        },
    }
    config: dict[str, Any] = dict(mode.hf_config_groups())
    config.update(ignore=exclude_modules, quant_algo=quant_algo)
    if tower:
        config["exclude_modules"] = exclude_modules
    if mode.kv_cache in KV_SCHEME:
        config["kv_cache_scheme"] = KV_SCHEME[mode.kv_cache]
    config.update(producer=producer, quant_method="modelopt")
    return hf_quant, config


def read_unified(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(TensorRT-LLM config, TP=1 tensors) of a Hugging Face checkpoint's language model (a
    vision tower is not read), as the PyTorch backend would run it: fused q/k/v and gate/up whose shards have different weight scales are
    requantized to the largest (TensorRT-LLM's FP8QDQLinearMethod), the fused input scale is
    the largest, and the FP8 KV cache's scale is 1.0: TensorRT-LLM's PyTorch backend does not
    read k_scale and v_scale (docs/llmapi.md)."""
    hf_config = json.loads((directory / "config.json").read_text())
    family = family_for(hf_config)
    stored: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as fh:
            names = [n for n in fh.keys() if not n.startswith(family.vision_tower)]  # noqa: SIM118
            stored.update({name: fh.get_tensor(name) for name in names})
    quant = hf_quantization(directory, hf_config)
    rules = list(family.tensors(hf_config, set(stored)))
    tensors: dict[str, torch.Tensor] = {}
    for rule in rules:
        try:
            parts = [stored[s].t() if rule.transpose else stored[s] for s in rule.sources]
        except KeyError as exc:
            raise InputError(
                f"{directory} lacks tensor {exc}: it is not a whole checkpoint"
            ) from None
        fp4 = (
            parts[0].dtype == torch.uint8
            and stored[f"{_base(rule.sources[0])}.weight_scale"].dtype == E4M3
        )
        if fp4:  # NVFP4: one global weight and input scale per fused GEMM
            base = _base(rule.name)
            tensors[f"{base}.weights_scaling_factor"] = torch.cat(
                [stored[f"{_base(s)}.weight_scale"] for s in rule.sources]
            )
            for name, engine in (("weight_scale_2", "weights_scaling_factor_2"),
                                 ("input_scale", "activation_scaling_factor")):  # fmt: skip
                found = [stored[f"{_base(s)}.{name}"].float().reshape(()) for s in rule.sources]
                if any(not torch.equal(f, found[0]) for f in found):
                    raise InputError(
                        f"{directory}: the {name} of {', '.join(rule.sources)} differ: TensorRT-LLM "
                        "asserts one per fused GEMM; requantize them to one (trt-builder writes one)"
                    )
                tensors[f"{base}.{engine}"] = found[0]
        elif parts[0].dtype == torch.uint8:  # INT4 pairs: repacked as the engine's, fused
            base = _base(rule.name)
            group = [stored[f"{_base(s)}.weight_scale"].float() for s in rule.sources]
            tensors[f"{base}.weights_scaling_factor"] = torch.cat(group)
            values = [unpack_rows(p.view(torch.int8)) for p in parts]
            parts = [pack_rows(torch.cat(values))]
            pre_quant = [f"{_base(s)}.pre_quant_scale" for s in rule.sources]
            if pre_quant[0] in stored:  # o_proj, down_proj; the others' is in their norm
                tensors[f"{base}.prequant_scaling_factor"] = stored[pre_quant[0]]
            for hf_name, engine in W4A8_SCALARS.items():  # W4A8: one per fused GEMM
                found = [stored[n].float().reshape(1) for n in
                         (f"{_base(s)}.{hf_name}" for s in rule.sources) if n in stored]  # fmt: skip
                if found and (len(found) < len(parts)
                              or any(not torch.equal(f, found[0]) for f in found)):  # fmt: skip
                    raise InputError(
                        f"{directory}: the {hf_name} of {', '.join(rule.sources)} differ: "
                        "TensorRT-LLM asserts one per fused GEMM (trt-builder writes one)"
                    )
                if found:
                    tensors[f"{base}.{engine}"] = found[0]
        elif parts[0].dtype == torch.int8:  # W8A16: INT8 values and a scale per output row
            rows = [stored[f"{_base(s)}.weight_scale"].float().reshape(-1) for s in rule.sources]
            tensors[_base(rule.name) + WEIGHT_SCALE] = torch.cat(rows)
        if parts[0].dtype == E4M3:
            base = _base(rule.name)
            scales = [stored[f"{_base(s)}.weight_scale"].float().reshape(1) for s in rule.sources]
            inputs = [stored[f"{_base(s)}.input_scale"].float().reshape(1) for s in rule.sources]
            shared = torch.stack(scales).amax(0)
            if any(not torch.equal(s, shared) for s in scales):
                parts = [to_e4m3(p.float() * s, shared) for p, s in zip(parts, scales, strict=True)]
            tensors[f"{base}.weights_scaling_factor"] = shared
            tensors[f"{base}.activation_scaling_factor"] = torch.stack(inputs).amax(0)
        tensors[rule.name] = torch.cat(parts) if len(parts) > 1 else parts[0]
    dtype = str(tensors["transformer.vocab_embedding.weight"].dtype).removeprefix("torch.")
    if mode_of(quant, dtype).kv_fp8:
        for name in [r.name for r in rules if r.name.endswith(".attention.qkv.weight")]:
            key = name.removesuffix("qkv.weight") + "kv_cache_scaling_factor"
            tensors[key] = torch.ones(1, dtype=torch.float32)
    kv = quant.get("kv_cache_quant_algo")
    config = engine_config(
        family, hf_config, dtype, quant_algo=quant.get("quant_algo"), kv_cache_quant_algo=kv,
        exclude_modules=quant.get("exclude_modules"),
    )  # fmt: skip
    config[PYTORCH_BACKEND] = True
    return config, tensors
