"""The NVFP4 recipe search: each block's scale and each weight's e2m1 rounding, chosen by
measured accuracy, in memory.

The format and the global scale are fixed (modes/nvfp4/convert.py: global scale amax / (6 x
448)); left to choose are each block's e4m3 scale, among the grid around its absmax / (6 s2)
(modes/nvfp4/checkpoint.py), and which e2m1 value each weight takes. On FP8's texts and with FP8's
Hessians (modes/fp8/recipe/search.py: the same GEMM groups, fit tokens apart from scoring
tokens, half prose of the search split and half the model's own text):

1. **Hessians.** H = X^T X of each group's float input (qkv, dense, fc with gate, proj).
2. **Scales.** Each block's scale with the least output error of its nearest rounding with
   its 16 x 16 block of H (scales.py).
3. **Round.** Each group's weights to nearest at convert's scales (convert's, modelopt's
   rounding), to nearest at step 2's, and error-compensated at step 2's (GPTQ's update at the
   block scales, recipe/gptq.py).
4. **Score** "amax", "scales" and "compensated", simulated in the transformers model with
   the inputs quantized as the FP4 GEMM quantizes them (calibrated global scales), by mean KL
   from the float model per window; the least, or a simpler one within two standard errors.

The recipe (recipe.json) and, unless "amax" (convert's own) is chosen, the chosen codes
(weights.safetensors, packed as the checkpoint packs them, with their block scales, by
checkpoint name) leave this step; convert writes them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ....calibrate.stats import load_stats
from ....checkpoint import nvfp4
from ....checkpoint.safetensors_io import SafetensorsIndex
from ....checkpoint.weights import weight_files
from ....core.dtypes import torch_dtype
from ....core.records import Records
from ....recipe.gptq import compensated_on_grid
from ....recipe.score import Scorer, choose_simplest, figures, halving, mean_se, searched_model
from ....source.files import read_hf_config
from ...fp8.recipe.search import (
    Fp8Group,
    Fp8Simulation,
    _by_shape,
    _Laps,
    _read,
    _sub_batches,
    _texts,
    chunk_hessians,
    fp8_groups,
)
from ..spec import Nvfp4SearchSet
from .scales import searched_scales

#: The candidates from the simplest: "amax" (convert's own: block scales from the amax, nearest
#: codes), "scales" (searched block scales, nearest codes), "compensated" (those scales, GPTQ's
#: codes).
SIMPLEST_FIRST = ("amax", "scales", "compensated")
#: The candidate convert computes itself: the others' codes and block scales travel in the
#: recipe's weights file.
CONVERTS = "amax"
#: The file beside recipe.json that holds the compensated codes.
WEIGHTS = "weights.safetensors"


def _e2m1_grid(values: torch.Tensor) -> torch.Tensor:
    return nvfp4.round_e2m1(values).to(values.dtype)


class Blocks:
    """Per candidate and group: (codes [rows, in], block scales, global weight scale, input
    global scale)."""

    def __init__(self) -> None:
        self.tensors: dict[str, dict[str, tuple[torch.Tensor, ...]]] = {
            name: {} for name in SIMPLEST_FIRST
        }
        self.hessian_seconds = 0.0


def round_groups(
    model: Any,
    groups: list[Fp8Group],
    index: SafetensorsIndex,
    stats: dict[str, torch.Tensor],
    fit_ids: torch.Tensor,
    choice: Nvfp4SearchSet,
    *,
    batch: int,
    device: str,
    progress: Any,
) -> Blocks:
    """Every group's codes both ways (steps 1 and 2); the error-compensated rounding batched
    over the chunk's groups of one shape (one GPTQ column loop for all of them)."""
    out = Blocks()
    dtype = torch_dtype(choice.dtype)
    for chunk, hessians, seconds in chunk_hessians(model, groups, fit_ids, batch=batch,
                                                   device=device, progress=progress):  # fmt: skip
        layers = f"{chunk[0].group.layer}-{chunk[-1].group.layer}"
        out.hessian_seconds += seconds
        progress(f"rounding layers {layers}")
        for same in _by_shape(chunk):
            for g in same:
                weight = _read(g, index, model, device, dtype).float()
                scale_2 = nvfp4.global_scale(weight.abs().amax())
                scales = nvfp4.block_scales(weight, scale_2)
                amax = stats[f"{g.group.modules[0]}.input_absmax"].float().amax()
                a = nvfp4.global_scale(amax).to(device)
                out.tensors["amax"][g.key] = (nvfp4.quantize_blocks(weight, scales, scale_2),
                                              scales, scale_2, a)  # fmt: skip
                scales = searched_scales(weight, hessians[g.key], scale_2)
                out.tensors["scales"][g.key] = (nvfp4.quantize_blocks(weight, scales, scale_2),
                                                scales, scale_2, a)  # fmt: skip
                del weight
            for part in _sub_batches(same, device):
                tensors = [out.tensors["scales"][g.key] for g in part]
                values = compensated_on_grid(
                    torch.stack([_read(g, index, model, device, dtype).float() for g in part]),
                    torch.stack([hessians.pop(g.key) for g in part]),
                    torch.stack([(scales.float() * scale_2).repeat_interleave(nvfp4.BLOCK, dim=1)
                                 for _, scales, scale_2, _ in tensors]),
                    _e2m1_grid, damp=choice.damp, block=choice.block,
                )  # fmt: skip
                for g, (_, scales, scale_2, a), v in zip(part, tensors, values.unbind(),
                                                         strict=True):  # fmt: skip
                    out.tensors["compensated"][g.key] = (nvfp4.to_codes(v), scales, scale_2, a)
    return out


class Nvfp4Simulation(Fp8Simulation):
    """The model's NVFP4 GEMM groups with their forwards replaced, installed as FP8's are:
    `tensors` (group key -> codes, block scales, global scales of the group's rows) says what
    the next forward computes: its input quantized in blocks at the calibrated global scale,
    the weights decoded; a group missing from it runs in float."""

    def __init__(self, model: Any, groups: list[Fp8Group]) -> None:
        self.model, self.groups = model, groups
        self.tensors: dict[str, tuple[torch.Tensor, ...]] = {}

    def _forward(self, key: str, module: Any, original: Any, rows: slice) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            found = self.tensors.get(key)
            if found is None:
                return original(x)
            codes, scales, scale_2, a = found
            weight = nvfp4.dequantize(codes[rows].to(x.device), scales[rows].to(x.device),
                                      scale_2.to(x.device))  # fmt: skip
            y = nvfp4.fake_quantize(x, a.to(x.device)) @ weight.T
            if module.bias is not None:
                y = y + module.bias.float()
            return y.to(x.dtype)

        return forward


def search_nvfp4(
    hf_dir: Path,
    calibration: Path,
    choice: Nvfp4SearchSet,
    *,
    device: str,
    batch: int = 8,
    offload: Path,
    progress: Any = lambda _text: None,
    records: Records | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the recipe, as recipe.json holds it; the chosen codes, packed, with their block scales,
    by checkpoint tensor name, on the CPU: none where "amax", convert's own, is chosen)."""
    start = time.perf_counter()
    hf_config = read_hf_config(hf_dir)
    device, tokenizer, model, first = searched_model(hf_dir, device, offload)
    laps = _Laps(start)
    laps("load")
    fit_ids, ids = _texts(model, tokenizer, choice, progress, records)  # type: ignore[arg-type]
    laps("sample")
    with SafetensorsIndex(weight_files(hf_dir)) as index:
        groups = fp8_groups(model, hf_config, set(index.names()))
        stats = load_stats(calibration, modules=True)
        blocks = round_groups(model, groups, index, stats, fit_ids, choice,
                              batch=batch, device=first, progress=progress)  # fmt: skip
    laps("hessians and rounding")
    sim = Nvfp4Simulation(model, groups)
    progress("the float model's log-probabilities")
    scorer = Scorer(model, ids, batch, first)
    with sim.installed():
        per_window, finalists = halving(lambda t: setattr(sim, "tensors", t), scorer,
                                        blocks.tensors, progress)  # fmt: skip
    candidates = [{"name": name, "windows": int(per_window[name]["kl"].numel()),
                   **figures(per_window[name])} for name in SIMPLEST_FIRST]  # fmt: skip
    winner, runner = choose_simplest(per_window, finalists, SIMPLEST_FIRST)
    lead, lead_se = mean_se(per_window[runner]["kl"] - per_window[winner]["kl"])
    laps("score")
    tensors = chosen_tensors(groups, blocks.tensors[winner]) if winner != CONVERTS else {}
    recipe = {
        "mode": "nvfp4",
        "method": (
            "each block's e4m3 scale and each weight's e2m1 rounding at the global scale: "
            "convert's (scales from the amax, nearest: amax), each block's scale on the e4m3 "
            "grid around it by its output error with its block of the fit tokens' input "
            "Hessian (nearest: scales), or those scales with error-compensated rounding "
            "against the float GEMM (GPTQ's update, act-order: compensated); simulated in memory with the "
            "inputs block-quantized as the FP4 GEMM does; fitted and scored on prose of the "
            "search split and text the model sampled itself, half each, by mean KL divergence "
            "from the float model (standard errors over windows of 256 tokens); the least KL, "
            "or the simpler candidate within two standard errors of it"
        ),
        "device": device,
        "dtype": choice.dtype,
        "seed": choice.seed,
        "tokens": int(ids.numel()),
        "windows": int(ids.shape[0]),
        "fit_tokens": int(fit_ids.numel()),
        "candidates": candidates,
        "chosen": winner,
        "lead_over_runner_up": {"runner_up": runner, "kl": lead, "se": lead_se},
        "weights": WEIGHTS if tensors else None,
        "seconds": round(time.perf_counter() - start, 2),
        "seconds_by_part": {
            **laps.seconds,
            "hessians (of hessians and rounding)": round(blocks.hessian_seconds, 2),
        },  # fmt: skip
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
    }
    return recipe, tensors


def chosen_tensors(
    groups: list[Fp8Group], chosen: dict[str, tuple[torch.Tensor, ...]]
) -> dict[str, torch.Tensor]:
    """The chosen codes of every group, split into their checkpoint tensors and packed, with
    each one's block scales (convert checks they are its own)."""
    out: dict[str, torch.Tensor] = {}
    for group in groups:
        codes, scales = chosen[group.key][:2]
        rows = [rule.shape[0] for rule in group.tensors]
        for rule, c, s in zip(group.tensors, codes.cpu().split(rows), scales.cpu().split(rows),
                              strict=True):  # fmt: skip
            out[rule.name] = nvfp4.pack_columns(c.contiguous())
            out[rule.name.removesuffix(".weight") + ".weights_scaling_factor"] = s.contiguous()
    return out
