"""The FP8 recipe search: each weight's e4m3 rounding, error-compensated or to nearest, chosen
by measured accuracy, in memory.

The format and the scales are fixed (modes/fp8/convert.py: amax / 448 per weight and per input); what
is left to choose is which e4m3 neighbour each weight takes. On the calibration device (the GPU
where there is one), from the calibration's statistics, on two texts, half each: prose of the
search split of the bundled corpus (`calibrate/data/search.jsonl`: used neither for calibration
nor for verify) and text the float model samples itself (calibrate/corpus.py
`sampled_windows`: its chat template and its own turns), so that a rounding fitted to technical
prose is not chosen for a chat model on that prose alone:

1. **Hessians.** One float pass over `fit_tokens` with hooks: for each GEMM group
   (qkv, dense, fc+gate, proj: one input and one weight scale each), H = X^T X of its input.
   Layers are taken in chunks whose Hessians fit in memory, a pass each.
2. **Round.** Each group's weights, read from the HF files by the family's rules and rounded to
   the mode's dtype as convert reads them, at convert's scale: to nearest (modelopt's rounding)
   and error-compensated (rounding.py), batched over the layers.
3. **Per layer.** On the scoring windows' float inputs (not the fit's), each group's GEMM error
   (FP8 activations included) under each rounding: the compensated one where it is lower.
4. **Score** "amax" (nearest everywhere), "compensated" (everywhere) and, where it differs from
   both, "per layer", simulated in the transformers model on `tokens` not fitted on (score.py:
   mean KL from the float model per window, perplexity, top-1, each also by text; successive
   halving), and choose the least mean KL.

The recipe (recipe.json) and the chosen e4m3 weights that differ from nearest rounding
(weights.safetensors, by checkpoint name, with their scales) leave this step; convert writes
them in place of its own rounding.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ....calibrate.corpus import corpus_windows, sampled_windows
from ....calibrate.stats import load_stats
from ....checkpoint.fp8 import FP8_MAX, to_e4m3, weight_scale
from ....checkpoint.safetensors_io import DTYPES, SafetensorsIndex
from ....checkpoint.weights import weight_files
from ....core.dtypes import torch_dtype
from ....core.records import Records
from ....models.family import TensorRule
from ....models.registry import family_for
from ....recipe.gptq import working_set
from ....recipe.score import (
    WINDOW,
    Scorer,
    choose_simplest,
    figures,
    halving,
    mean_se,
    searched_model,
)
from ....runtimes.fp8 import fp8_matmul
from ....runtimes.int8 import GROUPS, group_name
from ....source.files import read_hf_config
from ...smoothquant.recipe.simulate import Group, gemm_groups, in_model
from ...smoothquant.recipe.simulate import weight as simulated_weight
from ..spec import Fp8SearchSet
from .rounding import compensated_e4m3

#: What each candidate rounds with, per group.
NEAREST, COMPENSATED = "nearest", "compensated"


@dataclass(frozen=True)
class Fp8Group:
    """One weight scale and one input: a group's transformers modules (simulate.Group) and its
    checkpoint tensors, whose rows, in order, are the modules' outputs."""

    group: Group
    tensors: tuple[TensorRule, ...]

    @property
    def key(self) -> str:
        return self.group.key

    @property
    def shape(self) -> tuple[int, int]:
        return sum(r.shape[0] for r in self.tensors), self.tensors[0].shape[1]

    def module_rows(self) -> list[int]:
        return [rows for rule in self.tensors for rows in rule.rows()]


def fp8_groups(model: Any, hf_config: dict[str, Any], names: set[str]) -> list[Fp8Group]:
    """Every FP8 GEMM group of the model, from the family's tensor rules."""
    family = family_for(hf_config)
    rules = {r.name: r for r in family.tensors(hf_config, names)}
    lead = {group_name(lead): lead for lead in GROUPS}
    groups = []
    for group in gemm_groups(family, hf_config, names):
        members = [f"transformer.layers.{group.layer}.{m}" for m in GROUPS[lead[group.name]]]
        tensors = tuple(rules[m] for m in members if m in rules)  # GPT-2's MLP has no gate
        groups.append(Fp8Group(in_model(model, group), tensors))
    return groups


class Rounded:
    """Each group's scales and its e4m3 weights under each rounding."""

    def __init__(self) -> None:
        self.input_scale: dict[str, torch.Tensor] = {}
        self.weight_scale: dict[str, torch.Tensor] = {}
        self.weights: dict[str, dict[str, torch.Tensor]] = {NEAREST: {}, COMPENSATED: {}}
        self.hessian_seconds = 0.0


def _hessian_hooks(model: Any, groups: list[Fp8Group], hessians: dict[str, torch.Tensor]) -> list:
    def hook(key: str) -> Any:
        def add(_module: Any, args: tuple[Any, ...], _output: Any) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            x = x.to(torch.float64 if x.device.type == "cpu" else torch.float32)
            if key in hessians:
                hessians[key].addmm_(x.T, x)
            else:
                hessians[key] = x.T @ x

        return add

    return [
        model.get_submodule(g.group.modules[0]).register_forward_hook(hook(g.key)) for g in groups
    ]


def _memory_budget(device: str) -> int:
    """Bytes the search may hold for Hessians and rounding at once: 40% of the GPU's free
    memory once PyTorch's allocator has handed back what it holds unused (the forward passes
    before leave much of it cached, which the driver does not count as free, and a cached
    block too small for the next tensor would not serve it anyway), or 8 GiB of host memory."""
    where = torch.device(device)
    if where.type == "cuda":
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(where)[0] * 0.4)
    return 8 << 30


def _itemsize(device: str) -> int:
    """float64 on the CPU, float32 on a GPU (compensated_e4m3's and the Hessians' dtype)."""
    return 8 if torch.device(device).type == "cpu" else 4


def _chunks(groups: list[Fp8Group], budget: int, itemsize: int) -> Iterator[list[Fp8Group]]:
    """Consecutive layers' groups whose Hessians fit in `budget` (at least one layer)."""
    chunk: list[Fp8Group] = []
    held = 0
    for layer in sorted({g.group.layer for g in groups}):
        mine = [g for g in groups if g.group.layer == layer]
        size = sum(g.shape[1] ** 2 * itemsize for g in mine)
        if chunk and held + size > budget:
            yield chunk
            chunk, held = [], 0
        chunk += mine
        held += size
    if chunk:
        yield chunk


def chunk_hessians(
    model: Any,
    groups: list[Fp8Group],
    fit_ids: torch.Tensor,
    *,
    batch: int,
    device: str,
    progress: Any,
) -> Iterator[tuple[list[Fp8Group], dict[str, torch.Tensor], float]]:
    """Per chunk of consecutive layers whose Hessians fit in memory: (its groups, each group's
    input Hessian H = X^T X over `fit_ids`, the seconds the pass took). The searches that round
    against H (FP8's, INT4's, NVFP4's) take their groups' Hessians from here."""
    for chunk in _chunks(groups, _memory_budget(device), _itemsize(device)):
        layers = f"{chunk[0].group.layer}-{chunk[-1].group.layer}"
        progress(f"input Hessians of layers {layers}")
        begun = time.perf_counter()
        hessians: dict[str, torch.Tensor] = {}
        handles = _hessian_hooks(model, chunk, hessians)
        try:
            with torch.inference_mode():
                for row in range(0, fit_ids.shape[0], batch):
                    model(fit_ids[row : row + batch].to(device), use_cache=False, logits_to_keep=1)
        finally:
            for handle in handles:
                handle.remove()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        yield chunk, hessians, time.perf_counter() - begun


def round_groups(
    model: Any,
    groups: list[Fp8Group],
    index: SafetensorsIndex,
    stats: dict[str, torch.Tensor],
    fit_ids: torch.Tensor,
    choice: Fp8SearchSet,
    *,
    batch: int,
    device: str,
    progress: Any,
) -> Rounded:
    """Every group's weights rounded both ways (steps 1 and 2)."""
    out = Rounded()
    dtype = torch_dtype(choice.dtype)
    for chunk, hessians, seconds in chunk_hessians(model, groups, fit_ids, batch=batch,
                                                   device=device, progress=progress):  # fmt: skip
        layers = f"{chunk[0].group.layer}-{chunk[-1].group.layer}"
        out.hessian_seconds += seconds
        progress(f"rounding layers {layers}")
        for same in _by_shape(chunk):
            weights = [_read(g, index, model, device, dtype) for g in same]
            scales = torch.cat([weight_scale([w]) for w in weights])
            for g, w, s in zip(same, weights, scales, strict=True):
                out.weight_scale[g.key] = s.reshape(1)
                out.input_scale[g.key] = _input_scale(stats, g)
                out.weights[NEAREST][g.key] = to_e4m3(w, s)
            for part in _sub_batches(same, device):
                picked = [same.index(g) for g in part]
                compensated = compensated_e4m3(
                    torch.stack([weights[i] for i in picked]).float(),
                    torch.stack([hessians.pop(g.key).to(device) for g in part]),
                    scales[picked],
                    damp=choice.damp,
                    block=choice.block,
                )
                for g, q in zip(part, compensated.unbind(), strict=True):
                    out.weights[COMPENSATED][g.key] = q
            del weights
    return out


def _by_shape(groups: list[Fp8Group]) -> list[list[Fp8Group]]:
    shapes: dict[tuple[str, tuple[int, int]], list[Fp8Group]] = {}
    for g in groups:
        shapes.setdefault((g.group.name, g.shape), []).append(g)
    return list(shapes.values())


def _sub_batches(groups: list[Fp8Group], device: str) -> Iterator[list[Fp8Group]]:
    """Groups of one shape, as many at a time as the batched GPTQ update's working set allows
    (recipe/gptq.py: working_set)."""
    n, k = groups[0].shape
    each, once = working_set(n, k, _itemsize(device))
    size = max(1, (_memory_budget(device) - once) // each)
    for start in range(0, len(groups), size):
        yield groups[start : start + size]


def _read(
    group: Fp8Group, index: SafetensorsIndex, model: Any, device: str, dtype: torch.dtype
) -> Any:
    """The group's checkpoint weights [rows, in] in the mode's dtype, as convert reads them:
    from the model in memory where it holds a tensor as the file does (the same values, and no
    second read of the weights), else from the file."""
    sources = [(rule, source) for rule in group.tensors for source in rule.sources]
    parts = []
    for (rule, source), path in zip(sources, group.group.modules, strict=True):
        held = simulated_weight(model.get_submodule(path)).detach()
        entry = index.entries[source]
        if (
            held.device.type != "meta"
            and held.dtype == DTYPES[entry.dtype]
            and (held.shape == (entry.shape[::-1] if rule.transpose else entry.shape))
        ):
            parts.append(held)
        else:  # offloaded, or loaded in another dtype than the file's
            parts.append(index.read(source).t() if rule.transpose else index.read(source))
    return torch.cat([p.to(device) for p in parts]).float().to(dtype)


def _input_scale(stats: dict[str, torch.Tensor], group: Fp8Group) -> torch.Tensor:
    amax = stats[f"{group.group.modules[0]}.input_absmax"].float().amax()
    return (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny).reshape(1)


class Fp8Simulation:
    """The model's FP8 GEMM groups with their forwards replaced: `weights` (group key -> e4m3
    weights of the group's rows) says what the next forward computes; a group missing from it
    runs in float."""

    def __init__(self, model: Any, groups: list[Fp8Group], rounded: Rounded) -> None:
        self.model, self.groups, self.rounded = model, groups, rounded
        self.weights: dict[str, torch.Tensor] = {}

    @contextmanager
    def installed(self) -> Iterator[Fp8Simulation]:
        saved = []
        try:
            for group in self.groups:
                start = 0
                for path, rows in zip(group.group.modules, group.module_rows(), strict=True):
                    module = self.model.get_submodule(path)
                    saved.append((module, module.forward))
                    module.forward = self._forward(group.key, module, module.forward,
                                                   slice(start, start + rows))  # fmt: skip
                    start += rows
            yield self
        finally:
            for module, forward in saved:
                module.forward = forward

    def _forward(self, key: str, module: Any, original: Any, rows: slice) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            weights = self.weights.get(key)
            if weights is None:
                return original(x)
            return self.gemm(key, module, x, weights[rows])

        return forward

    def gemm(self, key: str, module: Any, x: torch.Tensor, weights: torch.Tensor) -> Any:
        """One linear as FP8Linear computes it: e4m3 input at its static scale, e4m3 weights."""
        a = self.rounded.input_scale[key].to(x.device)
        w = self.rounded.weight_scale[key].to(x.device)
        y = fp8_matmul(to_e4m3(x, a), weights.to(x.device), a, w, exact=False)
        if module.bias is not None:
            y = y + module.bias.float()
        return y.to(x.dtype)


@contextmanager
def gemm_errors(sim: Fp8Simulation, errors: dict[str, torch.Tensor]) -> Iterator[None]:
    """While the float model runs: per group, the squared error of its GEMMs under each
    rounding [nearest, compensated] and the squared output [float], on the inputs it sees."""
    handles = []
    for group in sim.groups:
        start = 0
        for path, rows in zip(group.group.modules, group.module_rows(), strict=True):
            module = sim.model.get_submodule(path)
            part = slice(start, start + rows)
            start += rows

            def hook(mod: Any, args: tuple[Any, ...], output: Any, key: str = group.key,
                     part: slice = part) -> None:  # fmt: skip
                y = output.detach().float()
                acc = errors.setdefault(key, torch.zeros(3, dtype=torch.float64))
                for j, rounding in enumerate((NEAREST, COMPENSATED)):
                    yq = sim.gemm(key, mod, args[0], sim.rounded.weights[rounding][key][part])
                    acc[j] += float((yq.float() - y).pow(2).sum())
                acc[2] += float(y.pow(2).sum())

            handles.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _texts(
    model: Any, tokenizer: Any, choice: Fp8SearchSet, progress: Any, records: Records | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fit windows, the scoring windows): each half prose of the search split and half
    text the model samples itself, the scoring ones alternating (so that the first half of
    them, which every candidate is scored on, holds both). The sampled text is the float
    model's alone: kept in `records` for every search of the model (FP8, INT4 AWQ, W4A8,
    NVFP4 ask for the same)."""
    fit, scored = choice.fit_tokens // 2 // WINDOW, choice.tokens // 2 // WINDOW
    prose = torch.tensor(corpus_windows(tokenizer, (fit + scored) * WINDOW, WINDOW,
                                        split="search", seed=choice.seed))  # fmt: skip
    progress(f"sampling {fit + scored} windows of the model's own text")
    sampled = sampled_windows(model, tokenizer, fit + scored, WINDOW, seed=choice.seed,
                              records=records)  # fmt: skip
    fit_ids = torch.cat([prose[:fit], sampled[:fit]])
    score = torch.stack([prose[fit:], sampled[fit : fit + len(prose) - fit]], dim=1)
    return fit_ids, score.flatten(0, 1)


def search_fp8(
    hf_dir: Path,
    calibration: Path,
    choice: Fp8SearchSet,
    *,
    device: str,
    batch: int = 8,
    offload: Path,
    progress: Any = lambda _text: None,
    records: Records | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the recipe, as recipe.json holds it; the chosen e4m3 weights that differ from nearest
    rounding and their scales, by checkpoint tensor name, on the CPU)."""
    start = time.perf_counter()
    hf_config = read_hf_config(hf_dir)
    device, tokenizer, model, first = searched_model(hf_dir, device, offload)
    laps = _Laps(start)
    laps("load")
    fit_ids, ids = _texts(model, tokenizer, choice, progress, records)
    laps("sample")
    with SafetensorsIndex(weight_files(hf_dir)) as index:
        groups = fp8_groups(model, hf_config, set(index.names()))
        stats = load_stats(calibration, modules=True)  # by the running model's paths
        rounded = round_groups(model, groups, index, stats, fit_ids, choice,
                               batch=batch, device=first, progress=progress)  # fmt: skip
    laps("hessians and rounding")
    sim = Fp8Simulation(model, groups, rounded)
    errors: dict[str, torch.Tensor] = {}
    progress("the float model's log-probabilities and each GEMM's error")
    with gemm_errors(sim, errors):
        scorer = Scorer(model, ids, batch, first)
    per_layer = {k: COMPENSATED if e[1] < e[0] else NEAREST for k, e in errors.items()}
    trials = {"amax": rounded.weights[NEAREST], "compensated": rounded.weights[COMPENSATED]}
    if len(set(per_layer.values())) > 1:
        trials["per layer"] = {k: rounded.weights[r][k] for k, r in per_layer.items()}
    with sim.installed():
        per_window, finalists = halving(lambda t: setattr(sim, "weights", t), scorer, trials,
                                        progress)  # fmt: skip
    candidates: list[dict[str, Any]] = [
        {"name": name, "windows": int(per_window[name]["kl"].numel()), **figures(per_window[name]),
         "prose": figures({k: v[0::2] for k, v in per_window[name].items()}),
         "sampled": figures({k: v[1::2] for k, v in per_window[name].items()})}
        for name in trials
    ]  # fmt: skip
    winner, runner = choose_simplest(per_window, finalists, SIMPLEST_FIRST)
    lead, lead_se = mean_se(per_window[runner]["kl"] - per_window[winner]["kl"])
    everywhere = {"amax": NEAREST, "compensated": COMPENSATED}
    chosen = dict.fromkeys(per_layer, everywhere[winner]) if winner in everywhere else per_layer
    laps("score")
    tensors = chosen_tensors(groups, rounded, chosen)
    recipe = {
        "mode": "fp8",
        "method": (
            "each weight's e4m3 rounding at convert's per-tensor scales: to nearest (amax), "
            "error-compensated against the float GEMM (GPTQ's update, act-order, Hessians from "
            "the fit tokens), or per GEMM group whichever has the lower GEMM error on the "
            "scoring windows; simulated in memory; fitted and scored on prose of the search "
            "split and text the model sampled itself, half each, by mean KL divergence from "
            "the float model (standard errors over windows of 256 tokens); the least KL, or a "
            "simpler candidate within two standard errors of it"
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
        "rounding": _by_layer(chosen),
        "gemm_error": _relative_errors(errors),
        "weights": WEIGHTS if tensors else None,
        "seconds": round(time.perf_counter() - start, 2),
        "seconds_by_part": {
            **laps.seconds,
            "hessians (of hessians and rounding)": round(rounded.hessian_seconds, 2),
        },  # fmt: skip
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
    }
    return recipe, tensors


#: The candidates from the simplest: one that is not worse than a later one by two standard
#: errors of their paired per-window KL difference is chosen over it.
SIMPLEST_FIRST = ("amax", "compensated", "per layer")


class _Laps:
    """Seconds since the last lap, by name."""

    def __init__(self, start: float) -> None:
        self.last = start
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self.last, 2)
        self.last = now


def _relative_errors(errors: dict[str, torch.Tensor]) -> list[list[Any]]:
    """[group, nearest's GEMM error, compensated's] relative to the output, worst first."""
    rows = [[key, float(e[0] / e[2].clamp(min=1e-30)), float(e[1] / e[2].clamp(min=1e-30))]
            for key, e in errors.items()]  # fmt: skip
    return sorted(rows, key=lambda row: -float(row[1]))


#: The file beside recipe.json that holds the chosen compensated weights.
WEIGHTS = "weights.safetensors"


def _by_layer(chosen: dict[str, str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for key, rounding in chosen.items():
        layer, name = key.split(".", 1)
        out.setdefault(layer, {})[name] = rounding
    return out


def chosen_tensors(
    groups: list[Fp8Group], rounded: Rounded, chosen: dict[str, str]
) -> dict[str, torch.Tensor]:
    """The compensated weights of the groups that chose them, split into their checkpoint
    tensors, with each one's weights_scaling_factor (convert checks it is its own)."""
    out: dict[str, torch.Tensor] = {}
    for group in groups:
        if chosen.get(group.key) != COMPENSATED:
            continue
        weights = rounded.weights[COMPENSATED][group.key].cpu()
        rows = [rule.shape[0] for rule in group.tensors]
        for rule, part in zip(group.tensors, torch.split(weights, rows), strict=True):
            out[rule.name] = part.contiguous()
            scale = re.sub(r"\.weight$", ".weights_scaling_factor", rule.name)
            out[scale] = rounded.weight_scale[group.key].cpu().clone()  # one per tensor
    return out
