"""A SmoothQuant candidate simulated in the transformers model, in memory: each decoder linear's
forward becomes the plugin GEMM (trt_builder/runtimes/int8.py) of the candidate's smoother,
int8 weights and activations, computed from the module's own weight when it runs (so a model
that accelerate offloads layer by layer is simulated the same way, with nothing kept).

What it leaves out, and why the ranking does not depend on it: the checkpoint dtype's rounding
of every stored activation (float16 or bfloat16; the model runs in its calibration dtype) and
the INT8 KV cache (an exact rewrite of the qkv scales plus its own rounding, the same for every
alpha). `tests/test_recipe.py` measures the simulation against converting and running.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from ....models.family import Family
from ....models.registry import family_for
from ....runtimes.int8 import (
    GROUPS,
    group_name,
    int8_matmul,
    quantize_rows,
    quantize_static,
    quantize_tokens,
    smoother,
)


@dataclass(frozen=True)
class Group:
    """The GEMMs of one decoder layer that read one input (and so share a smoother)."""

    layer: int
    name: str  # qkv, dense, fc, proj
    modules: tuple[str, ...]  # their transformers module paths, in the checkpoint's order

    @property
    def key(self) -> str:
        return f"{self.layer}.{self.name}"


def gemm_groups(family: Family, hf_config: dict[str, Any], names: set[str]) -> list[Group]:
    """Every INT8 GEMM group of the model, from the family's tensor rules."""
    rules = {r.name: r for r in family.tensors(hf_config, names)}
    groups = []
    for name in rules:
        match = re.fullmatch(r"transformer\.layers\.(\d+)\.(.+)", name)
        if match is None or match.group(2) not in GROUPS:
            continue
        layer = int(match.group(1))
        members = [f"transformer.layers.{layer}.{m}" for m in GROUPS[match.group(2)]]
        modules = tuple(
            s.removesuffix(".weight")
            for member in members
            if member in rules  # GPT-2's MLP has no gate
            for s in rules[member].sources
        )
        groups.append(Group(layer, group_name(match.group(2)), modules))
    return sorted(groups, key=lambda g: (g.layer, list(GROUPS).index(f"{_lead(g.name)}")))


def in_model(model: Any, group: Group) -> Group:
    """The group with its modules named as in `model`, where the file names them apart
    (Family.same_linear: the hub's GPT-2 files, `h.0.attn.c_attn`, load as
    `transformer.h.0.attn.c_attn`; a hub-layout Qwen2.5-VL's `model.layers.*` as
    `model.language_model.layers.*`), as calibration's `load_stats(modules=True)` names them."""
    paths: list[str] = []  # the model's module paths, listed on the first miss

    def path(module: str) -> str:
        try:
            model.get_submodule(module)
        except AttributeError:
            if not paths:
                paths.extend(n for n, _ in model.named_modules())
            return family.same_linear(module, paths) or module
        return module

    family = family_for(model.config.to_dict())

    return replace(group, modules=tuple(path(m) for m in group.modules))


def _lead(name: str) -> str:
    return next(lead for lead in GROUPS if group_name(lead) == name)


class Simulation:
    """The model's INT8 GEMM groups with their forwards replaced; `alphas` (group key -> alpha,
    or None for a group kept in float) says what the next forward computes. A group missing
    from `alphas` runs in float."""

    def __init__(self, model: Any, groups: list[Group], stats: dict[str, torch.Tensor],
                 per_token: bool) -> None:  # fmt: skip
        self.model, self.stats, self.per_token = model, stats, per_token
        self.groups = [in_model(model, g) for g in groups]
        self.alphas: dict[str, float | None] = {}

    @contextmanager
    def installed(self) -> Iterator[Simulation]:
        saved = []
        try:
            for group in self.groups:
                members = [self.model.get_submodule(m) for m in group.modules]
                for module in members:
                    saved.append((module, module.forward))
                    module.forward = self._forward(group, members, module, module.forward)
            yield self
        finally:
            for module, forward in saved:
                module.forward = forward

    def _forward(self, group: Group, members: list[Any], module: Any, original: Any) -> Any:
        ax = self.stats[f"{group.modules[0]}.input_absmax"]
        ay = torch.stack([self.stats[f"{m}.output_absmax"].amax() for m in group.modules]).amax()

        wmax: list[torch.Tensor] = []  # the group's max |W| per input channel, once

        def forward(x: torch.Tensor) -> torch.Tensor:
            alpha = self.alphas.get(group.key)
            if alpha is None:
                return original(x)
            if not wmax or wmax[0].device != module.weight.device:
                wmax[:] = [column_max(members)]
            return plugin_gemm(x, module, wmax[0], ax, ay, alpha, self.per_token)

        return forward


def weight(module: Any) -> torch.Tensor:
    """A linear's weight as [out, in] (GPT-2's Conv1D stores [in, out])."""
    return module.weight.T if type(module).__name__ == "Conv1D" else module.weight


def column_max(members: list[Any]) -> torch.Tensor:
    """max |W| per input channel over a group's linears (the smoother's denominator)."""
    return torch.stack([weight(m).abs().amax(dim=0).float() for m in members]).amax(dim=0)


def plugin_gemm(
    x: torch.Tensor,
    module: Any,
    wmax: torch.Tensor,
    ax: torch.Tensor,
    ay: torch.Tensor,
    alpha: float,
    per_token: bool,
) -> torch.Tensor:
    """One linear of a group as the SmoothQuant plugin computes it, from the float weights:
    smoother over the group, int8 weight rows, int8 activations, exact accumulation."""
    device = module.weight.device
    s = smoother(ax.to(device), wmax, alpha)
    q, aw = quantize_rows(weight(module).float() * s)
    xs = x.float() / s
    if per_token:
        qx, row_scale = quantize_tokens(xs)
        y = int8_matmul(qx, q) * (aw / 127.0) * row_scale
    else:
        to_int = 127.0 / (ax.to(device).float() / s).amax().clamp(min=1e-8)
        ay = ay.to(device).float().clamp(min=1e-8)
        pcs = (127.0 / ay) / (to_int * 127.0 / aw)
        y = int8_matmul(quantize_static(xs, to_int), q) * pcs * (ay / 127.0)
    if module.bias is not None:
        y = y + module.bias.float()
    return y.to(x.dtype)
