"""The INT8 recipe search: SmoothQuant's alphas chosen by measured accuracy, in memory.

On the calibration device (the GPU where there is one, offloaded as calibration is), from the
calibration's statistics and the search split of the bundled corpus
(`calibrate/data/search.jsonl`: used neither for calibration nor for verify's held-out figures):

1. **Fit per layer.** One float pass over `fit_tokens` with hooks: for every decoder layer and
   GEMM group (qkv, dense, fc+gate, proj), the alpha of `grid` whose plugin GEMM output is
   closest (squared error) to the float GEMM's on the float model's own inputs. The smoother
   only changes how its own GEMMs are quantized, so each group is chosen alone. The remaining
   error of each group, relative to its output (noise over signal), is its sensitivity.
2. **Score.** Each candidate (every global alpha of `alphas`, and the fitted alphas per layer)
   is simulated in the transformers model (simulate.py) on `tokens` of the split (before the
   fit's): per window of 256 tokens, the mean KL divergence from the float model, the
   perplexity increase and the top-1 agreement. The float model's distributions are computed
   once. Successive halving: every candidate is scored on the first half of the windows, the
   two best on all of them.
3. **Choose** the finalist with the least mean KL. KL is a sum of non-negative per-token
   terms, so its mean settles on fewer tokens than a perplexity difference does. Each figure
   is reported with its standard error over the windows, and the winner's lead over the
   runner-up with the standard error of the paired per-window difference.

Nothing is written: only the recipe (recipe.json) leaves this step; convert builds the winner.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ....calibrate.corpus import corpus_windows
from ....calibrate.stats import load_stats
from ....checkpoint.safetensors_io import SafetensorsIndex
from ....checkpoint.weights import weight_files
from ....models.registry import family_for
from ....recipe.score import WINDOW, Scorer, figures, halving, mean_se, searched_model
from ....source.files import read_hf_config
from ..spec import SearchSet
from .simulate import Group, Simulation, column_max, gemm_groups, plugin_gemm


def fit_per_layer(
    sim: Simulation, ids: torch.Tensor, grid: tuple[float, ...], batch: int, device: str
) -> tuple[dict[str, float], dict[str, float]]:
    """(the alpha of `grid` per group key whose plugin GEMMs are closest to the float ones on
    the float model's inputs for `ids`, each group's relative error at that alpha)."""
    errors: dict[str, torch.Tensor] = {}
    energy: dict[str, float] = {}
    handles = []
    for group in sim.groups:
        members = [sim.model.get_submodule(m) for m in group.modules]
        ax = sim.stats[f"{group.modules[0]}.input_absmax"]
        ay = torch.stack([sim.stats[f"{m}.output_absmax"].amax() for m in group.modules]).amax()
        wmax = column_max(members)
        for module in members:
            hook = _fit_hook(group, module, wmax, ax, ay, sim.per_token, grid, errors, energy)
            handles.append(module.register_forward_hook(hook))
    sim.alphas = {}
    try:
        with torch.inference_mode():
            for row in range(0, ids.shape[0], batch):
                sim.model(ids[row : row + batch].to(device), use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    chosen = {key: grid[int(err.argmin())] for key, err in errors.items()}
    relative = {key: float(err.min()) / max(energy[key], 1e-30) for key, err in errors.items()}
    return chosen, relative


def _fit_hook(group: Group, module: Any, wmax: torch.Tensor, ax: torch.Tensor, ay: torch.Tensor,
              per_token: bool, grid: tuple[float, ...], errors: dict[str, torch.Tensor],
              energy: dict[str, float]) -> Any:  # fmt: skip
    def hook(mod: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
        x, y = args[0].detach(), output.detach().float()
        err = errors.setdefault(group.key, torch.zeros(len(grid), dtype=torch.float64))
        for j, alpha in enumerate(grid):
            yq = plugin_gemm(x, module, wmax, ax, ay, alpha, per_token).float()
            err[j] += float((yq - y).pow(2).sum())
        energy[group.key] = energy.get(group.key, 0.0) + float(y.pow(2).sum())

    return hook


def search(
    hf_dir: Path,
    calibration: Path,
    choice: SearchSet,
    *,
    device: str,
    batch: int = 8,
    offload: Path,
    progress: Any = lambda _text: None,
) -> dict[str, Any]:
    """The recipe: every candidate's figures, the chosen alphas (global, and per layer and
    group), each group's sensitivity; as recipe.json holds it."""
    start = time.perf_counter()
    hf_config = read_hf_config(hf_dir)
    family = family_for(hf_config)
    with SafetensorsIndex(weight_files(hf_dir)) as index:
        names = set(index.names())
    groups = gemm_groups(family, hf_config, names)
    device, tokenizer, model, first = searched_model(hf_dir, device, offload)
    windows = torch.tensor(
        corpus_windows(tokenizer, choice.tokens + choice.fit_tokens, WINDOW, split="search")
    )
    scored = choice.tokens // WINDOW
    ids, fit_ids = windows[:scored], windows[scored:]
    sim = Simulation(model, groups, load_stats(calibration, modules=True), choice.per_token)
    with sim.installed():
        progress("fitting alphas per layer and GEMM group")
        fitted, sensitivity = fit_per_layer(sim, fit_ids, choice.grid, batch, first)
        progress("the float model's log-probabilities")
        scorer = Scorer(model, ids, batch, first)
        trials: dict[str, dict[str, float | None]] = {
            f"alpha {a}": {g.key: a for g in groups} for a in choice.alphas
        }
        trials["per layer"] = {k: v for k, v in fitted.items()}
        per_window, finalists = halving(partial(setattr, sim, "alphas"), scorer, trials,
                                        progress)  # fmt: skip
    del model, sim
    candidates: list[dict[str, Any]] = [
        {"name": name, "alpha": float(name.split()[1]) if name != "per layer" else "per layer",
         "windows": int(per_window[name]["kl"].numel()), **figures(per_window[name])}
        for name in trials
    ]  # fmt: skip
    ranked = sorted((c for c in candidates if c["name"] in finalists),
                    key=lambda c: (c["kl"], -c["top1"]))  # fmt: skip
    winner, runner = ranked[0], ranked[-1]
    diff = per_window[str(runner["name"])]["kl"] - per_window[str(winner["name"])]["kl"]
    lead, lead_se = mean_se(diff)
    shared = min(int(v["kl"].numel()) for v in per_window.values())  # every candidate's windows
    best_global = min((n for n in trials if n != "per layer"),
                      key=lambda n: float(per_window[n]["kl"][:shared].mean()))  # fmt: skip
    layered = winner["alpha"] == "per layer"
    alphas: dict[str, dict[str, float]] = {}
    for g in groups:
        alphas.setdefault(str(g.layer), {})[g.name] = (
            fitted[g.key] if layered else float(winner["alpha"])
        )
    return {
        "method": (
            "global alphas, and alphas per layer and GEMM group fitted to the float GEMM "
            "outputs; simulated in memory; scored on the search split by mean KL divergence "
            "from the float model (standard errors over windows of 256 tokens)"
        ),
        "device": device,
        "tokens": int(ids.numel()),
        "windows": int(ids.shape[0]),
        "fit_tokens": int(fit_ids.numel()),
        "candidates": candidates,
        "chosen": winner["name"],
        "lead_over_runner_up": {"runner_up": runner["name"], "kl": lead, "se": lead_se},
        "alpha": float(best_global.split()[1]),  # smoothquant_val: the best single alpha
        "alphas": alphas,
        "sensitivity": sorted(([k, v] for k, v in sensitivity.items()), key=lambda kv: -kv[1]),
        "seconds": round(time.perf_counter() - start, 2),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
    }
