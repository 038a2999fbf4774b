"""NVFP4 (`quant_algo: NVFP4`) in TensorRT-LLM's checkpoint format.

Per decoder layer, for each GEMM TensorRT-LLM's FP4Linear / FP4RowLinear replaces (qkv, dense,
fc, gate, proj), as modelopt 0.47's export writes them (checkpoint/nvfp4.py: the format):
- `weight`: uint8 [out, in / 2], the e2m1 codes of W (rounded to the model dtype first, the
  model modelopt quantizes), two a byte along the input; each rank packs its own;
- `weights_scaling_factor`: float8_e4m3fn [out, in / 16], the block scales (the recipe's, or
  each block's absmax / (6 s2) rounded to e4m3; not swizzled:
  trtllm-build interleaves them itself);
- `weights_scaling_factor_2`: float32 scalar (shape [], as modelopt writes it), amax(|W|) /
  (6 x 448); fc and gate share the larger
  of theirs (modelopt unifies them; TensorRT-LLM's PyTorch backend asserts one for its fused
  gate_up), q, k and v one (one GEMM);
- `activation_scaling_factor`: float32 scalar, the calibrated amax of the GEMM's input /
  (6 x 448): the global scale of its run-time block quantization.
Norms, biases, the embedding, ln_f and lm_head stay in the model dtype (`exclude_modules`).
With the FP8 KV cache each layer gets `kv_cache_scaling_factor` (modes/kvcache/convert.py).

Written by hand, like the other formats: TensorRT-LLM's quantize scripts need TensorRT-LLM and a
GPU, and modelopt is a test oracle here (tests/test_nvfp4.py compares with its export).
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
from ...checkpoint.mapping import Mapping
from ...checkpoint.nvfp4 import (
    BLOCK,
    block_scales,
    global_scale,
    pack_columns,
    quantize_blocks,
    unpack_columns,
)
from ...checkpoint.safetensors_io import SafetensorsIndex
from ...convert.dispatch import register
from ...convert.layers import LayerJob, split_layers
from ...convert.plan import plan_conversion
from ...convert.write import finish
from ...core.dtypes import torch_dtype
from ...core.errors import ConversionError
from ...core.fsio import write_json
from .. import FloatMode
from ..kvcache.convert import KVCacheScales
from .checkpoint import is_candidate
from .spec import GROUP_SIZE, Nvfp4

#: The GEMMs stored in NVFP4 (TensorRT-LLM names within a decoder layer): FP8's five.
FP4_LINEARS = FP8_LINEARS
#: What config.json's exclude_modules lists: the modules kept in the model dtype.
EXCLUDED = ["lm_head", "transformer.vocab_embedding"]
#: GEMMs that share one global weight scale (gate and fc: one fused GEMM in the PyTorch backend).
SHARED_SCALE = {"mlp.fc.weight": "mlp.gate.weight", "mlp.gate.weight": "mlp.fc.weight"}


def input_global_scale(stats: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """activation_scaling_factor (a float32 scalar): the calibrated absmax of `module`'s input
    over 6 x 448."""
    try:
        amax = stats[f"{module}.input_absmax"].float().amax()
    except KeyError:
        raise ConversionError(
            f"the calibration has no statistics for {module}: recalibrate this model "
            "(trt-builder calibrate --force)"
        ) from None
    return global_scale(amax).reshape(())


def nvfp4_linear(weight: torch.Tensor, scale_2: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear's tensors (its codes unpacked: each rank packs its own) at global scale
    `scale_2`."""
    scales = block_scales(weight, scale_2)
    return {
        "weight": quantize_blocks(weight, scales, scale_2),
        "weights_scaling_factor": scales,
        "weights_scaling_factor_2": scale_2.reshape(()).float(),
    }


def convert_nvfp4(
    hf_dir: Path,
    out_dir: Path,
    mode: Nvfp4,
    calibration: Path,
    *,
    tp: int = 1,
    pp: int = 1,
    recipe: Path | None = None,
    remember: Callable[[Path, str], None] | None = None,
) -> dict[str, Any]:
    """Convert `hf_dir` with the statistics in `calibration` into an NVFP4 checkpoint;
    `recipe`: the recipe stage's recipe.json, whose e2m1 rounding it writes (without one, to
    nearest: modelopt's rounding, the search's "amax")."""
    family, config, rules, index, notes = plan_conversion(
        hf_dir, FloatMode(mode.dtype), tp=tp, pp=pp
    )
    with ExitStack() as stack:
        stack.enter_context(index)  # closed on every way out, refusals included
        shapes = {r.name: r.shape for r in rules if r.name.endswith(FP4_LINEARS)}
        odd = next((n for n, shape in shapes.items() if shape[-1] % (BLOCK * tp)), None)
        if odd is not None:
            raise ConversionError(
                f"{odd} has {shapes[odd][-1]} input features: NVFP4 needs multiples of "
                f"{BLOCK} per rank (--tp {tp}): use --dtype fp8 or int4-awq"
            )
        stats = load_stats(calibration)
        found, chosen = _recipe(recipe, stack)
        kv_cache = KVCacheScales.of(mode, config, family, {r.name for r in rules}, calibration,
                                    stats=stats)  # fmt: skip
        layers, others = split_layers(rules)
        config["quantization"].update(
            quant_algo=mode.quant_algo,
            kv_cache_quant_algo=mode.kv_cache_quant_algo,
            group_size=GROUP_SIZE,
            exclude_modules=list(EXCLUDED),
        )
        dtype = torch_dtype(mode.dtype)

        def tensors(
            i: int, floats: dict[str, torch.Tensor], sources: dict[str, tuple[str, ...]]
        ) -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for name, tensor in floats.items():
                if name not in FP4_LINEARS:  # norms, biases, q/k norms
                    out[name] = tensor.to(dtype)
                    continue
                base = name.removesuffix(".weight")
                module = sources[name][0].removesuffix(".weight")  # q/k/v share one input
                if tensor.is_meta:  # the plan: shapes and dtypes alone
                    rows, width = tensor.shape
                    out[name] = torch.empty(rows, width, dtype=torch.uint8, device="meta")
                    out[f"{base}.weights_scaling_factor"] = torch.empty(
                        rows, width // BLOCK, dtype=torch.float8_e4m3fn, device="meta"
                    )
                    for scalar in ("weights_scaling_factor_2", "activation_scaling_factor"):
                        out[f"{base}.{scalar}"] = torch.empty((), device="meta")
                    continue
                weight = tensor.to(dtype).float()  # the model modelopt would load
                amax = weight.abs().amax()
                partner = SHARED_SCALE.get(name)
                if partner in floats:
                    amax = torch.maximum(amax, floats[partner].to(dtype).float().abs().amax())
                linear = nvfp4_linear(weight, global_scale(amax))
                if chosen is not None:
                    searched = chosen(f"transformer.layers.{i}.{name}", linear)
                    if searched is not None:
                        linear["weight"], linear["weights_scaling_factor"] = searched
                out.update({f"{base}.{k}": v for k, v in linear.items()})
                out[f"{base}.activation_scaling_factor"] = input_global_scale(stats, module).to(
                    tensor.device
                )
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
    if found is not None:
        write_json(out_dir / "recipe.json", found)  # trtllm-build reads only its own files
        record["recipe"] = {k: found[k] for k in ("chosen", "tokens", "device")}
    return record


def _recipe(
    recipe: Path | None, stack: ExitStack
) -> tuple[dict[str, Any] | None, Callable[[str, dict[str, torch.Tensor]], Any] | None]:
    """(recipe.json, the chosen codes and block scales of a checkpoint tensor given its
    nearest-rounded tensors: None where the recipe takes convert's own); (None, None) without a
    recipe. Each recipe block scale must be one of the candidates of convert's own
    (modes/nvfp4/checkpoint.py), or the recipe was made from other weights."""
    if recipe is None:
        return None, None
    if not recipe.is_file():
        raise ConversionError("nvfp4 needs its recipe: run trt-builder recipe --dtype nvfp4")
    found = json.loads(recipe.read_text())
    if not found.get("weights"):
        return found, None
    weights = stack.enter_context(SafetensorsIndex([recipe.parent / found["weights"]]))
    names = set(weights.names())

    def chosen(
        name: str, linear: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if name not in names:
            return None
        at = weights.read(name.removesuffix(".weight") + ".weights_scaling_factor")
        own = linear["weights_scaling_factor"].cpu()
        if at.shape != own.shape or not bool(is_candidate(at, own).all()):
            raise ConversionError(
                f"the recipe's NVFP4 rounding of {name} was made from other weights: rerun the "
                "recipe (trt-builder recipe --dtype nvfp4 --force)"
            )
        device = linear["weights_scaling_factor"].device
        return unpack_columns(weights.read(name)).to(device), at.to(device)

    return found, chosen


def _pack(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A rank's e2m1 codes, packed (its other tensors as they are)."""
    return pack_columns(tensor) if tensor.dtype == torch.uint8 else tensor


@register(Nvfp4)
def _nvfp4(mode: Nvfp4, hf_dir: Path, out_dir: Path, *, tp: int, pp: int,
           calibration: Path | None, recipe: Path | None = None,
           remember: Callable[[Path, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    assert calibration is not None  # the inputs' global scales
    return convert_nvfp4(
        hf_dir, out_dir, mode, calibration, tp=tp, pp=pp, recipe=recipe, remember=remember
    )
