"""FP8 per-tensor W8A8 (`quant_algo: FP8`) in TensorRT-LLM's checkpoint format, and the FP8 KV
cache's scales.

Per decoder layer, for each GEMM TensorRT-LLM's FP8Linear / FP8RowLinear replaces (qkv, dense,
fc, gate, proj):
- `weight`: float8_e4m3fn of W / weights_scaling_factor, W first rounded to the model dtype (the
  model modelopt quantizes is loaded in it), divided in float32 and cast as modelopt's exporter
  casts it (round to nearest even; |W| / scale <= 448 by construction, clamped all the same:
  the cast saturates on the CPU but need not elsewhere);
- `weights_scaling_factor`: float32 (1,), amax(|W|) / 448, a dequantization scale; the fused qkv
  has one over q, k and v together, and gate and fc share the larger of theirs (modelopt unifies
  them; TensorRT-LLM's fuse_gate_mlp requantizes with the max anyway);
- `activation_scaling_factor`: float32 (1,), the calibrated amax of the GEMM's input / 448.
The GEMM computes e4m3(x / a) @ e4m3-weight^T * (a * w) (runtimes/fp8.py). Norms, biases, the
embedding, ln_f and lm_head stay in the model dtype; `exclude_modules` lists lm_head and the
embedding (modelopt writes ["lm_head"]; the embedding is listed too so that the config says
what the file holds, docs/quantization.md). With the FP8 KV cache each layer gets
`kv_cache_scaling_factor` (modes/kvcache/convert.py fp8_kv_scale).

Written by hand, like SmoothQuant's: TensorRT-LLM's converter needs TensorRT-LLM, and modelopt
is a test oracle here, not a dependency (tests compare with its export).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...calibrate.stats import load_stats
from ...checkpoint.fp8 import E4M3, FP8_LINEARS, FP8_MAX, to_e4m3, weight_scale
from ...checkpoint.mapping import Mapping
from ...checkpoint.safetensors_io import SafetensorsIndex
from ...convert.dispatch import register
from ...convert.layers import LayerJob, split_layers
from ...convert.plan import plan_conversion
from ...convert.write import finish
from ...core.dtypes import torch_dtype
from ...core.errors import ConversionError
from ...core.fsio import write_json
from ...models.family import Family, TensorRule
from .. import FloatMode, Fp8
from ..kvcache.convert import KVCacheScales
from .checkpoint import CONTRACTS, check_fp8

F32 = torch.float32
#: GEMMs that share one weight scale (gate and fc: one fused GEMM in the engine).
SHARED_SCALE = {"mlp.fc.weight": "mlp.gate.weight", "mlp.gate.weight": "mlp.fc.weight"}
#: What config.json's exclude_modules lists: the modules kept in the model dtype.
EXCLUDED = ["lm_head", "transformer.vocab_embedding"]


def input_scale(stats: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """activation_scaling_factor (float32 (1,)) from the calibrated absmax of `module`'s input."""
    try:
        amax = stats[f"{module}.input_absmax"].float().amax()
    except KeyError:
        raise ConversionError(
            f"the calibration has no statistics for {module}: recalibrate this model "
            "(trt-builder calibrate --force)"
        ) from None
    return (amax / FP8_MAX).clamp(min=torch.finfo(F32).tiny).reshape(1)


#: The recipe's e4m3 weight for (checkpoint name, float weight, its scale), None where it has
#: none; it refuses one rounded at another scale.
Chosen = Callable[[str, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def layer_tensors(
    floats: dict[str, torch.Tensor],
    stats: dict[str, torch.Tensor],
    sources: dict[str, tuple[str, ...]],
    dtype: torch.dtype,
    chosen: Chosen | None = None,
) -> dict[str, torch.Tensor]:
    """One layer's FP8 checkpoint tensors, in writing order, from its float tensors
    (TensorRT-LLM names without the layer prefix); a weight `chosen` gives (the recipe's
    rounding) is written as given, the others rounded to nearest."""
    rounded = {n: t.to(dtype) for n, t in floats.items()}  # the model modelopt would load
    out: dict[str, torch.Tensor] = {}
    for name, tensor in rounded.items():
        if name not in FP8_LINEARS:  # norms, biases, q/k norms
            out[name] = tensor
            continue
        shared = [tensor] + (
            [rounded[SHARED_SCALE[name]]] if SHARED_SCALE.get(name) in rounded else []
        )
        wsf = weight_scale(shared)
        base = name.removesuffix(".weight")
        out[name] = _weight(name, tensor, wsf, chosen)
        out[f"{base}.weights_scaling_factor"] = wsf.to(tensor.device)
        module = sources[name][0].removesuffix(".weight")  # q/k/v and gate/up share one input
        out[f"{base}.activation_scaling_factor"] = input_scale(stats, module).to(tensor.device)
    return out


def _weight(name: str, tensor: torch.Tensor, scale: torch.Tensor, chosen: Chosen | None) -> Any:
    """The e4m3 weight: the recipe's where it has one, else rounded to nearest. (The plan's meta
    tensors are never looked up.)"""
    given = None if chosen is None or tensor.is_meta else chosen(name, tensor, scale)
    return to_e4m3(tensor, scale) if given is None else given.to(tensor.device)


def convert_fp8(
    hf_dir: Path,
    out_dir: Path,
    mode: Fp8,
    calibration: Path,
    *,
    tp: int = 1,
    pp: int = 1,
    recipe: Path | None = None,
    remember: Callable[[Path, str], None] | None = None,
) -> dict[str, Any]:
    """Convert `hf_dir` with the statistics in `calibration` into an FP8 checkpoint; `recipe`:
    the recipe stage's recipe.json, whose chosen weight rounding it writes (mode.search)."""
    family, config, rules, index, notes = plan_conversion(
        hf_dir, FloatMode(mode.dtype), tp=tp, pp=pp
    )
    with ExitStack() as stack:
        stack.enter_context(index)  # closed on every way out, refusals included
        found, chosen = _recipe(mode, recipe, stack)
        job = _plan(mode, calibration, config, family, rules, index, chosen)
        tensors = job.write(stack, out_dir, remember)
    record = finish(out_dir, config, family, tensors=tensors, notes=notes)
    if found is not None:
        write_json(out_dir / "recipe.json", found)  # trtllm-build reads only its own files
        record["recipe"] = {k: found[k] for k in ("chosen", "tokens", "device")}
    for contract in CONTRACTS.values():  # a converter bug, caught before an engine build
        problems = check_fp8(out_dir, config, contract)
        if problems:
            raise ConversionError(
                f"the FP8 checkpoint does not conform to trtllm-build {contract.release}: "
                f"{problems[0]} ({len(problems)} problems)"
            )
    return record


def _recipe(
    mode: Fp8, recipe: Path | None, stack: ExitStack
) -> tuple[dict[str, Any] | None, Chosen | None]:
    """(recipe.json, its weights by checkpoint name) for a searched mode; (None, None) else."""
    if not mode.search:
        return None, None
    if recipe is None or not recipe.is_file():
        raise ConversionError(
            "FP8 with a searched rounding needs the recipe: run trt-builder recipe --dtype fp8 "
            "(or build with --no-fp8-search)"
        )
    found = json.loads(recipe.read_text())
    if not found.get("weights"):
        return found, None
    weights = stack.enter_context(SafetensorsIndex([recipe.parent / found["weights"]]))
    names = set(weights.names())

    def chosen(name: str, tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        if name not in names:
            return None
        weight = weights.read(name)
        at = weights.read(name.removesuffix(".weight") + ".weights_scaling_factor")
        if weight.shape != tensor.shape or weight.dtype != E4M3 or not torch.equal(at, scale.cpu()):
            raise ConversionError(
                f"the recipe's FP8 rounding of {name} was made from other weights: rerun the "
                "recipe (trt-builder recipe --dtype fp8 --force)"
            )
        return weight

    return found, chosen


def _in_layer(
    chosen: Chosen, i: int, name: str, tensor: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor | None:
    return chosen(f"transformer.layers.{i}.{name}", tensor, scale)


def _plan(
    mode: Fp8,
    calibration: Path,
    config: dict[str, Any],
    family: Family,
    rules: list[TensorRule],
    index: Any,
    chosen: Chosen | None,
) -> LayerJob:
    """Check what can be checked before writing; the quantization goes into `config`."""
    stats = load_stats(calibration)
    kv_cache = KVCacheScales.of(mode, config, family, {r.name for r in rules}, calibration,
                                stats=stats)  # fmt: skip
    layers, others = split_layers(rules)
    config["quantization"].update(
        quant_algo=mode.quant_algo,
        kv_cache_quant_algo=mode.kv_cache_quant_algo,
        exclude_modules=list(EXCLUDED),
    )
    dtype = torch_dtype(mode.dtype)

    def tensors(
        i: int, floats: dict[str, torch.Tensor], sources: dict[str, tuple[str, ...]]
    ) -> dict[str, torch.Tensor]:
        mine = None if chosen is None else partial(_in_layer, chosen, i)
        out = layer_tensors(floats, stats, sources, dtype, mine)
        scale = kv_cache.scale(sources["attention.qkv.weight"])
        if scale is not None:
            out["attention.kv_cache_scaling_factor"] = scale.to(
                floats["attention.qkv.weight"].device
            )
        return out

    # the layer arithmetic runs on the GPU where there is one, as SmoothQuant's: the division
    # and the cast are IEEE float32 and round to nearest even on both, so the bytes are the same
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return LayerJob(tensors, layers, others, index, dtype, Mapping.from_config(config), device)


@register(Fp8)
def _fp8(mode: Fp8, hf_dir: Path, out_dir: Path, *, tp: int, pp: int,
         calibration: Path | None, recipe: Path | None = None,
         remember: Callable[[Path, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    assert calibration is not None  # FP8 always calibrates: the activation scales
    return convert_fp8(hf_dir, out_dir, mode, calibration, tp=tp, pp=pp, recipe=recipe,
                       remember=remember)  # fmt: skip
