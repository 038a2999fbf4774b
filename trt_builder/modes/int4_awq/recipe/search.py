"""The INT4 AWQ recipe search: each GEMM group's AWQ exponent and its weights' INT4 rounding,
chosen by measured accuracy, in memory.

The format is fixed (modes/int4_awq/convert.py: signed INT4 in groups, absmax / 7 scales of
W / p, p AWQ's per-input-channel scale from an exponent alpha). Left to choose: alpha per GEMM
group (qkv, dense, fc with gate, proj: the GEMMs that read one input), and which INT4 value each
weight takes. On the calibration device, on FP8's texts (half prose of the search split, half
text the model samples itself; modes/fp8/recipe/search.py `_texts`):

1. **Hessians.** One float pass over `fit_tokens` with hooks: for each group, H = X^T X of its
   input (FP8's chunks and hooks).
2. **Alpha.** For each group, on the grid 0, 0.1, ..., 1 and no scale at all, the output error
   of nearest rounding on the fit tokens, tr(dW H dW^T) with dW = W - p Q(W / p): the least.
   (convert alone chooses alpha with H's diagonal: the calibration keeps no covariance.)
3. **Clip.** Each group's scale: absmax / 7 shrunk by the ratio on AWQ's auto_clip grid whose
   nearest rounding has the least output error with the group's block of diag(p) H diag(p)
   (clipping.py).
4. **Round.** At those scales: to nearest, and error-compensated (rounding.py: GPTQ's update
   at the group scales, on diag(p) H diag(p)).
5. **Score** "awq" (convert's own choice: diagonal alpha, absmax scales, nearest), "hessian"
   (step 2's alpha, step 3's scales, nearest) and "compensated" (the same, step 4's
   rounding), simulated in the
   transformers model on `tokens` not fitted on (recipe/score.py: mean KL from the float model
   per window; successive halving), and choose the least mean KL, or a simpler candidate within
   two standard errors of it.

The recipe (recipe.json: the choice, each group's alpha by checkpoint tensor name) and, unless
"awq" is chosen, the chosen INT4 values (weights.safetensors, packed as the checkpoint packs them,
with their group scales, by checkpoint name) leave this step; convert writes them.

FP8's search lends its texts, Hessian hooks, chunking and weight reading (the same groups and
the same GEMM inputs); the INT4 arithmetic is checkpoint/int4.py's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ....checkpoint.int4 import dequantize, pack_rows, quantize_groups
from ....checkpoint.safetensors_io import SafetensorsIndex
from ....checkpoint.weights import weight_files
from ....core.dtypes import torch_dtype
from ....core.records import Records
from ....models.registry import family_for
from ....recipe.gptq import tf32
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
from ..checkpoint import awq_linear, awq_pqs, linear_shapes
from ..spec import Int4Awq, Int4SearchSet
from .clipping import clipped_scales
from .rounding import compensated_int4

#: The candidates from the simplest: one not worse than a later one by two standard errors of
#: their paired per-window KL difference is chosen over it.
SIMPLEST_FIRST = ("awq", "hessian", "compensated")
#: The candidate convert computes itself from the recipe's alphas: the others' INT4 values and
#: (clipped) group scales travel in the recipe's weights file.
CONVERTS = "awq"
#: The file beside recipe.json that holds the chosen INT4 values and group scales.
WEIGHTS = "weights.safetensors"


class Linears:
    """Per candidate and group: (p in the model dtype [in], INT4 values [rows, in], group
    scales [rows, in / group]), and each group's alpha per candidate."""

    def __init__(self) -> None:
        self.tensors: dict[str, dict[str, tuple[torch.Tensor, ...]]] = {
            name: {} for name in SIMPLEST_FIRST
        }
        self.alpha: dict[str, dict[str, float | None]] = {name: {} for name in SIMPLEST_FIRST}
        self.hessian_seconds = 0.0


def _alphas(
    weight: torch.Tensor, sqmean: torch.Tensor, h: torch.Tensor, group: int, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], float | None, float | None]:
    """(convert's own INT4 tensors of the linear, their alpha by the calibrated diagonal,
    the alpha (None: no scale) whose nearest rounding has the least tr(dW H dW^T)), from one
    pass over the grid (each alpha's rounding computed once for both); on CUDA the products in
    TF32 (a 7B model's candidates are 30 TFLOP a layer; an error's relative change from TF32
    is about 1e-3, far below what separates the alphas' errors)."""
    best: list[tuple[float, float | None]] = []
    hf = h.to(weight.device, torch.float32)

    def score(alpha: float | None, _pqs: torch.Tensor, effective: torch.Tensor) -> None:
        delta = weight - effective
        error = float(((delta @ hf) * delta).sum())
        if not best or error < best[0][0]:
            best[:] = [(error, alpha)]

    with tf32():
        diagonal, diagonal_alpha, _ = awq_linear(weight, sqmean, group, dtype, each=score)
    return diagonal, diagonal_alpha, best[0][1]


def round_groups(
    model: Any,
    groups: list[Fp8Group],
    index: SafetensorsIndex,
    stats: dict[str, torch.Tensor],
    fit_ids: torch.Tensor,
    choice: Int4SearchSet,
    group: int,
    *,
    batch: int,
    device: str,
    progress: Any,
) -> Linears:
    """Every group's linears under every candidate (steps 1 to 3); the error-compensated
    rounding batched over the chunk's groups of one shape (one GPTQ column loop for all of
    them: at 7B on a GPU, per group, the loop's kernel launches took most of the search)."""
    out = Linears()
    dtype = torch_dtype(choice.dtype)
    for chunk, hessians, seconds in chunk_hessians(model, groups, fit_ids, batch=batch,
                                                   device=device, progress=progress):  # fmt: skip
        layers = f"{chunk[0].group.layer}-{chunk[-1].group.layer}"
        out.hessian_seconds += seconds
        progress(f"choosing alpha and rounding layers {layers}")
        for same in _by_shape(chunk):
            scaled_h = {}  # group key -> diag(p) H diag(p), the Hessian of the GEMM's input
            for g in same:
                weight = _read(g, index, model, device, dtype).float()
                sqmean = stats[f"{g.group.modules[0]}.input_sqmean"].float().to(device)
                h = hessians.pop(g.key)
                diagonal, diagonal_alpha, alpha = _alphas(weight, sqmean, h, group, dtype)
                pqs = awq_pqs(weight, sqmean, alpha, group, dtype)
                p = pqs.double().to(h.device)
                scaled = h * p[:, None] * p  # float64; GPTQ works in float32 on a GPU
                scaled_h[g.key] = scaled if scaled.device.type == "cpu" else scaled.float()
                gemm_weight = weight / pqs.float()  # what the GEMM multiplies by: W / p
                scales = clipped_scales(gemm_weight, scaled_h[g.key], group, dtype)
                values = quantize_groups(gemm_weight, scales)
                out.alpha["awq"][g.key] = diagonal_alpha
                out.tensors["awq"][g.key] = (diagonal["prequant_scaling_factor"],
                                             diagonal["weight"], diagonal["weights_scaling_factor"])  # fmt: skip
                for name in ("hessian", "compensated"):
                    out.alpha[name][g.key] = alpha
                out.tensors["hessian"][g.key] = (pqs, values, scales)
                del weight, h, scaled, gemm_weight
            for part in _sub_batches(same, device):
                tensors = [out.tensors["hessian"][g.key] for g in part]
                compensated = compensated_int4(
                    torch.stack([_read(g, index, model, device, dtype).float() / pqs.float()
                                 for g, (pqs, _, _) in zip(part, tensors, strict=True)]),
                    torch.stack([scaled_h.pop(g.key) for g in part]),
                    torch.stack([scales for _, _, scales in tensors]),
                    damp=choice.damp,
                    block=choice.block,
                )  # fmt: skip
                for g, (pqs, _, scales), values in zip(part, tensors, compensated.unbind(),
                                                       strict=True):  # fmt: skip
                    out.tensors["compensated"][g.key] = (pqs, values, scales)
    return out


class Int4Simulation(Fp8Simulation):
    """The model's INT4 GEMM groups with their forwards replaced, installed as FP8's are:
    `tensors` (group key -> p, values, scales of the group's rows) says what the next forward
    computes, dequantized when it runs; a group missing from it runs in float."""

    def __init__(self, model: Any, groups: list[Fp8Group], dtype: torch.dtype) -> None:
        self.model, self.groups, self.dtype = model, groups, dtype
        self.tensors: dict[str, tuple[torch.Tensor, ...]] = {}

    def _forward(self, key: str, module: Any, original: Any, rows: slice) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            found = self.tensors.get(key)
            if found is None:
                return original(x)
            pqs, values, scales = found
            weight = dequantize(values[rows].to(x.device), scales[rows].to(x.device), self.dtype)
            y = (x.float() * pqs.float().to(x.device)) @ weight.T
            if module.bias is not None:
                y = y + module.bias.float()
            return y.to(x.dtype)

        return forward


def search_int4(
    hf_dir: Path,
    calibration: Path,
    choice: Int4SearchSet,
    *,
    device: str,
    batch: int = 8,
    offload: Path,
    progress: Any = lambda _text: None,
    records: Records | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the recipe, as recipe.json holds it; the chosen INT4 values, packed, with their group
    scales, by checkpoint tensor name, on the CPU: none where "awq", convert's own, is chosen)."""
    from ....calibrate.stats import load_stats

    start = time.perf_counter()
    hf_config = read_hf_config(hf_dir)
    family = family_for(hf_config)
    group = Int4Awq(group_size=choice.group_size).group_for(
        linear_shapes(family.config(hf_config)), 1
    )
    device, tokenizer, model, first = searched_model(hf_dir, device, offload)
    laps = _Laps(start)
    laps("load")
    fit_ids, ids = _texts(model, tokenizer, choice, progress, records)  # type: ignore[arg-type]
    laps("sample")
    with SafetensorsIndex(weight_files(hf_dir)) as index:
        groups = fp8_groups(model, hf_config, set(index.names()))
        stats = load_stats(calibration, modules=True)
        linears = round_groups(model, groups, index, stats, fit_ids, choice, group,
                               batch=batch, device=first, progress=progress)  # fmt: skip
    laps("hessians, alpha and rounding")
    sim = Int4Simulation(model, groups, torch_dtype(choice.dtype))
    progress("the float model's log-probabilities")
    scorer = Scorer(model, ids, batch, first)
    with sim.installed():
        per_window, finalists = halving(lambda t: setattr(sim, "tensors", t), scorer,
                                        linears.tensors, progress)  # fmt: skip
    candidates = [{"name": name, "windows": int(per_window[name]["kl"].numel()),
                   **figures(per_window[name])} for name in SIMPLEST_FIRST]  # fmt: skip
    winner, runner = choose_simplest(per_window, finalists, SIMPLEST_FIRST)
    lead, lead_se = mean_se(per_window[runner]["kl"] - per_window[winner]["kl"])
    laps("score")
    alphas = {name: linears.alpha[winner][g.key] for g in groups for name in _names(g)}
    tensors = chosen_tensors(groups, linears.tensors[winner]) if winner != CONVERTS else {}
    recipe = {
        "mode": "int4_awq",
        "method": (
            "each GEMM group's AWQ exponent (awq_lite's grid, or no scale) and its INT4 "
            "rounding at the group scales: convert's own (alpha by the calibrated diagonal "
            "error, nearest), alpha by the fit tokens' output error with their input Hessians "
            "and each group's scale clipped by its block of them (nearest), or those with "
            "error-compensated rounding (GPTQ's update at the group scales, act-order); simulated in memory; fitted and scored on prose of the "
            "search split and text the model sampled itself, half each, by mean KL divergence "
            "from the float model (standard errors over windows of 256 tokens); the least KL, "
            "or a simpler candidate within two standard errors of it"
        ),
        "device": device,
        "dtype": choice.dtype,
        "group_size": group,
        "seed": choice.seed,
        "tokens": int(ids.numel()),
        "windows": int(ids.shape[0]),
        "fit_tokens": int(fit_ids.numel()),
        "candidates": candidates,
        "chosen": winner,
        "lead_over_runner_up": {"runner_up": runner, "kl": lead, "se": lead_se},
        "alphas": alphas,
        "weights": WEIGHTS if tensors else None,
        "seconds": round(time.perf_counter() - start, 2),
        "seconds_by_part": {
            **laps.seconds,
            "hessians (of hessians, alpha and rounding)": round(linears.hessian_seconds, 2),
        },  # fmt: skip
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
    }
    return recipe, tensors


def _names(group: Fp8Group) -> list[str]:
    """The checkpoint weight names of a group (qkv; dense; fc and gate; proj)."""
    return [rule.name for rule in group.tensors]


def chosen_tensors(
    groups: list[Fp8Group], chosen: dict[str, tuple[torch.Tensor, ...]]
) -> dict[str, torch.Tensor]:
    """The chosen INT4 values of every group, split into their checkpoint tensors and packed,
    with each one's group scales (convert checks they are its own)."""
    out: dict[str, torch.Tensor] = {}
    for group in groups:
        _, values, scales = chosen[group.key]
        rows = [rule.shape[0] for rule in group.tensors]
        for rule, v, s in zip(group.tensors, values.cpu().split(rows), scales.cpu().split(rows),
                              strict=True):  # fmt: skip
            base = rule.name.removesuffix(".weight")
            out[rule.name] = pack_rows(v.contiguous())
            out[f"{base}.weights_scaling_factor"] = s.contiguous()
    return out
