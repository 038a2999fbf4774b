"""Why a checkpoint disagrees with its model: findings that name the likely cause in words.

Three kinds of evidence, cheapest first:
- the checkpoint's config.json against the one the HF config implies (rotary_base, norm
  epsilon, head counts, ...);
- every tensor against the HF weight it comes from, by the family's own mapping: a mismatch is
  classified (rows of QKV swapped, MLP fc and gate swapped, a constant scale, NaN/Inf) or
  quantified;
- the runtime comparison: error that grows with position (rotary settings), the first layer
  where the hidden states part, output that ends at once or never ends (end ids), and a
  tokenizer that encodes the prompts differently from the model's own.
Static findings fail verify on their own: a checkpoint that does not hold its model's config
and weights is wrong even where the prompt set happens not to show it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..convert.plan import plan_conversion
from ..core.dtypes import FLOATS, torch_dtype
from ..core.errors import TrtBuilderError
from ..spec.modes import FloatMode, WeightOnlyInt8

#: Config keys that say how the checkpoint was made rather than what the model is.
_BUILD_KEYS = {"dtype", "logits_dtype", "mapping", "quantization", "producer"}

#: The likely cause a config mismatch points at, by key.
_CONFIG_CAUSES = {
    "rotary_base": "rotary settings (rotary_base)",
    "rotary_scaling": "rotary settings (rotary_scaling)",
    "rotary_pct": "rotary settings (rotary_pct)",
    "rotary_embedding_dim": "rotary settings (rotary_embedding_dim)",
    "norm_epsilon": "the norm epsilon (norm_epsilon)",
    "hidden_act": "the MLP activation (hidden_act)",
    "num_key_value_heads": "the KV head count (num_key_value_heads)",
    "position_embedding_type": "the position embedding type",
}

#: Relative error of the residual stream above which a layer is said to have parted.
LAYER_PARTED = 0.1


@dataclass(frozen=True)
class Finding:
    cause: str  # the likely cause, in words
    evidence: str  # what was measured
    fatal: bool = True  # fails verify on its own

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-6)
        except (TypeError, ValueError):
            return False
    return bool(a == b)


def _show(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else repr(value)


def check_config(got: dict[str, Any], expected: dict[str, Any]) -> list[Finding]:
    """Fields of the checkpoint's config.json that differ from what the HF config implies."""
    findings = []
    for key, want in expected.items():
        if key in _BUILD_KEYS or _same(got.get(key), want):
            continue
        cause = _CONFIG_CAUSES.get(key, f"the config field {key}")
        if key not in got and key not in _CONFIG_CAUSES:  # another producer's choice
            findings.append(
                Finding(
                    cause,
                    f"config.json lacks {key} (the HF model implies {_show(want)}); "
                    "TensorRT-LLM then uses its default",
                    fatal=False,
                )
            )
            continue
        findings.append(
            Finding(
                cause,
                f"config.json has {key} = {_show(got.get(key))}, the HF model implies {_show(want)}",
            )
        )
    return findings


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal within one unit in the last place of the stored dtype."""
    eps = torch.finfo(got.dtype).eps if got.is_floating_point() else 0.0
    diff = (got.float() - want.float()).abs()
    return bool((diff <= eps * want.float().abs() + 1e-30).all())


def _scale(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """The constant c with got == c * want, if there is one (c != 1)."""
    w, g = want.double(), got.double()
    norm = float((w * w).sum())
    if norm == 0.0:
        return None
    c = float((g * w).sum()) / norm
    if abs(c - 1.0) < 1e-3 or not math.isfinite(c):
        return None
    eps = torch.finfo(got.dtype).eps if got.is_floating_point() else 0.0
    ok = bool(((g - c * w).abs() <= 2 * eps * (c * w).abs() + 1e-30).all())
    return c if ok else None


def _sections(parts: list[torch.Tensor], labels: tuple[str, ...]) -> list[tuple[str, int]]:
    """(label, first row) of each source's rows in the fused tensor."""
    out, row = [], 0
    for label, part in zip(labels, parts, strict=True):
        out.append((label, row))
        row += part.shape[0]
    return out


def _where(row: int, sections: list[tuple[str, int]]) -> str:
    label, first = next((lab, f) for lab, f in reversed(sections) if row >= f)
    return f"{label} row {row - first}"


def _moved_rows(
    name: str, got: torch.Tensor, parts: list[torch.Tensor], labels: tuple[str, ...]
) -> Finding | None:
    """Rows of the tensor that are the model's rows, but in other places (q and k swapped,
    heads permuted, ...): each misplaced row is looked up among the expected rows."""
    want = parts[0] if len(parts) == 1 else torch.cat(parts)
    if got.dim() != 2 or got.shape != want.shape:
        return None
    index = {bytes(row.numpy().tobytes()): i for i, row in enumerate(want.contiguous().cpu())}
    wrong = [i for i in range(got.shape[0]) if not torch.equal(got[i], want[i])]
    found = [index.get(bytes(got[i].contiguous().cpu().numpy().tobytes())) for i in wrong]
    if not wrong or any(f is None for f in found):
        return None
    sections = _sections(parts, labels)
    spans: list[list[int]] = []  # runs of [first got row, first source row, length]
    for i, f in zip(wrong, found, strict=True):
        assert f is not None
        if spans and spans[-1][0] + spans[-1][2] == i and spans[-1][1] + spans[-1][2] == f:
            spans[-1][2] += 1
        else:
            spans.append([i, f, 1])
    described = [
        f"{_where(i, sections)}{'' if n == 1 else f' (+{n - 1})'} holds {_where(f, sections)}"
        for i, f, n in spans[:4]
    ]
    moved = {
        lab
        for i, f, n in spans
        for lab in (_where(i, sections).split()[0], _where(f, sections).split()[0])
    }
    what = " and ".join(sorted(moved)) if len(labels) > 1 else "rows"
    return Finding(
        f"{what} rows swapped inside {name}" if len(moved) > 1 else f"rows permuted inside {name}",
        f"{len(wrong)} rows are the model's rows in the wrong place: {'; '.join(described)}"
        + (" ..." if len(spans) > 4 else ""),
    )


def check_weights(
    weights: dict[str, torch.Tensor], rules: Iterable[Any], read: Any, dtype: torch.dtype
) -> list[Finding]:
    """Each checkpoint tensor against its HF source cast as convert casts it. `rules` are the
    family's TensorRules; `read(name)` gives an HF tensor."""
    rules = list(rules)
    expected: dict[str, list[torch.Tensor]] = {}

    def parts(rule: Any) -> list[torch.Tensor]:
        if rule.name not in expected:
            expected[rule.name] = [
                (read(s).t() if rule.transpose else read(s)).to(dtype) for s in rule.sources
            ]
        return expected[rule.name]

    by_name = {rule.name: rule for rule in rules}
    findings: list[Finding] = []
    reported: set[str] = set()
    for rule in rules:
        got = weights.get(rule.name)
        if got is None:
            findings.append(Finding(f"{rule.name} is missing", "the checkpoint has no such tensor"))
            continue
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            bad = int((~torch.isfinite(got)).sum())
            findings.append(
                Finding(
                    f"NaN or Inf values in {rule.name}",
                    f"{bad} of {got.numel()} values are not finite",
                )
            )
            continue
        if got.dtype == torch.int8 or rule.name in reported:
            continue  # pre-quantized weights are compared through the runtime only
        want_parts = parts(rule)
        want = want_parts[0] if len(want_parts) == 1 else torch.cat(want_parts)
        if tuple(got.shape) != tuple(want.shape):
            findings.append(
                Finding(
                    f"{rule.name} has the wrong shape",
                    f"{list(got.shape)}, the model implies {list(want.shape)}",
                )
            )
            continue
        if _close(got, want):
            continue
        labels = ("q", "k", "v") if len(want_parts) == 3 else tuple(rule.sources)
        finding = _moved_rows(rule.name, got, want_parts, labels)
        if finding:
            findings.append(finding)
            continue
        sibling = _swap_partner(rule.name)
        if sibling in by_name and sibling in weights:
            other = parts(by_name[sibling])
            other_want = other[0] if len(other) == 1 else torch.cat(other)
            if (
                got.shape == other_want.shape
                and _close(got, other_want)
                and _close(weights[sibling], want)
            ):
                layer = rule.name.rsplit(".mlp.", 1)[0]
                findings.append(
                    Finding(
                        f"MLP fc and gate swapped in {layer}",
                        f"{rule.name} holds the weights of {sibling} and the other way round",
                    )
                )
                reported.add(sibling)
                continue
        scale = _scale(got, want)
        if scale is not None:
            findings.append(
                Finding(
                    f"a wrong weight scale in {rule.name}",
                    f"it is the model's weight times {scale:.4g}, exactly",
                )
            )
            continue
        diff = (got.float() - want.float()).abs()
        findings.append(
            Finding(
                f"{rule.name} differs from the model's weights",
                f"max abs error {float(diff.max()):.3g}; {int((diff > 0).sum())} of {diff.numel()} values differ",
            )
        )
    return findings


def _swap_partner(name: str) -> str:
    if name.endswith("mlp.fc.weight"):
        return name.replace("mlp.fc.weight", "mlp.gate.weight")
    if name.endswith("mlp.gate.weight"):
        return name.replace("mlp.gate.weight", "mlp.fc.weight")
    return ""


#: Tensors the INT8 KV cache's balancing rewrites.
BALANCED = ("attention.qkv.weight", "attention.qkv.bias", "attention.dense.weight")


def check_static(checkpoint: Path, config: dict[str, Any], weights: dict[str, torch.Tensor],
                 reference_dir: Path) -> tuple[list[Finding], list[str]]:  # fmt: skip
    """Config and weight findings for a checkpoint whose HF model is in `reference_dir`;
    plus notes on what could not be checked."""

    algo = (config.get("quantization") or {}).get("quant_algo")
    dtype = str(config.get("dtype"))
    mode = WeightOnlyInt8(dtype) if algo == "W8A16" else FloatMode(dtype) if algo is None else None
    if mode is None:
        return [], [f"weights of a {algo} checkpoint are compared through the runtime only"]
    try:
        _, expected_config, rules, index, _ = plan_conversion(reference_dir, mode)
    except TrtBuilderError as exc:
        return [], [f"the HF model could not be mapped for a static check ({exc})"]
    notes = []
    if (config.get("quantization") or {}).get("kv_cache_quant_algo") == "INT8":
        # the INT8 KV cache's balancing rescales qkv rows and dense columns (kvcache.py)
        expected_config["quantization"]["kv_cache_quant_algo"] = "INT8"
        rules = [r for r in rules if not r.name.endswith(BALANCED)]
        notes.append("qkv and dense of an INT8-KV-cache checkpoint are rescaled by its K/V "
                     "balancing: they are compared through the runtime only")  # fmt: skip
    with index:
        findings = check_config(config, expected_config)
        findings += check_weights(weights, rules, index.read, weights_dtype(weights, dtype))
    return findings, notes


def weights_dtype(weights: dict[str, torch.Tensor], dtype: str) -> torch.dtype:
    for tensor in weights.values():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch_dtype(dtype if dtype in FLOATS else "float32")


# -- runtime evidence ------------------------------------------------------------------------


def position_finding(by_position: list[dict[str, float]]) -> Finding | None:
    """Error that is small at the first positions and large later points at rotary settings
    (at position 0 rope is the identity) or the position embedding."""
    kls = [p["kl_mean"] for p in by_position if p.get("count", 1) > 0]
    if len(kls) < 12:
        return None
    early = sum(kls[:2]) / 2
    late = sum(kls[len(kls) // 2 :]) / len(kls[len(kls) // 2 :])
    if late > 1e-2 and late > 20 * max(early, 1e-6):
        return Finding(
            "rotary settings (rotary_base / rotary_scaling) or the position embedding",
            f"the error grows with position: mean KL {early:.2e} at positions 0-1, {late:.2e} "
            f"from position {len(kls) // 2} on",
            fatal=False,
        )
    return None


def layer_finding(by_layer: list[dict[str, float]]) -> Finding | None:
    for row in by_layer:
        if row["rel_error"] > LAYER_PARTED:
            where = "the final norm" if row.get("final") else f"layer {row['layer']}"
            return Finding(
                f"the hidden states part at {where}",
                f"relative error of the residual stream {row['rel_error']:.3g} there "
                f"(> {LAYER_PARTED}); look at that layer's tensors first",
                fatal=False,
            )
    return None


def end_findings(prompts: list[dict[str, Any]], stop: set[int]) -> list[Finding]:
    empty = [p for p in prompts if p.get("candidate_empty")]
    findings = []
    if empty:
        findings.append(
            Finding(
                "end-of-sequence ids: the output ends at once",
                f"{len(empty)} prompt(s) end on their first token, e.g. {empty[0]['prompt']!r}; "
                f"end ids {sorted(stop)} come from the tokenizer and generation_config.json",
            )
        )
    runaway = [p for p in prompts if p.get("reference_ended") and not p.get("candidate_ended")]
    if runaway and len(runaway) == sum(1 for p in prompts if p.get("reference_ended")):
        findings.append(
            Finding(
                "end-of-sequence ids: the output never ends",
                f"the reference ends {len(runaway)} prompt(s) with an end id and the candidate "
                f"none of them (end ids {sorted(stop)})",
                fatal=False,
            )
        )
    return findings


def tokenizer_finding(candidate: Any, reference: Any, texts: list[str]) -> Finding | None:
    """A candidate tokenizer that is not the model's own: different vocabulary, special
    tokens or encodings of the prompt set."""
    differences = []
    if len(candidate) != len(reference):
        differences.append(f"vocabulary {len(candidate)} vs the model's {len(reference)}")
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        a, b = getattr(candidate, attr, None), getattr(reference, attr, None)
        if a != b:
            differences.append(f"{attr} {a} vs {b}")
    differ = [t for t in texts if candidate(t).input_ids != reference(t).input_ids]
    if differ:
        differences.append(
            f"{len(differ)} of {len(texts)} prompts encode differently, e.g. {differ[0][:40]!r}"
        )
    if not differences:
        return None
    return Finding("a tokenizer that is not the model's own", "; ".join(differences))
