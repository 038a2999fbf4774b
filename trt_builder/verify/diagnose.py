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

from ..checkpoint.parallel import tp_kind
from ..convert.plan import plan_conversion
from ..core.dtypes import FLOATS, torch_dtype
from ..core.errors import InputError, TrtBuilderError
from ..modes import mode_of
from ..modes.kvcache.spec import KV_QUANT_ALGO, kv_cache_of

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


class Exact:
    """What a float checkpoint holds: the model's weights cast to the checkpoint dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def expect(self, source: torch.Tensor) -> torch.Tensor:
        return source.to(self.dtype)

    def rows(self, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """Per row: equal within one unit in the last place."""
        eps = torch.finfo(got.dtype).eps if got.is_floating_point() else 0.0
        diff = (got.float() - want.float()).abs()
        ok = diff <= eps * want.float().abs() + 1e-30
        return ok.reshape(ok.shape[0], -1).all(1) if ok.dim() else ok.reshape(1)

    def same(self, got: torch.Tensor, want: torch.Tensor) -> bool:
        """The whole tensor is what convert writes (bit for bit, the common case, in one pass
        without temporaries; else row by row within the rule)."""
        return (got.dtype == want.dtype and torch.equal(got, want)) or bool(
            self.rows(got, want).all()
        )

    def inside(self, got: torch.Tensor) -> torch.Tensor:
        """The entries that hold the model's values as they are: all of them."""
        return torch.ones_like(got, dtype=torch.bool)


@dataclass(frozen=True)
class Clipping:
    """The INT8 weight-only clipping a checkpoint says its weights went through
    (`producer.weight_clipping` in config.json, modes/weight_only/convert.py): row j of each listed
    linear is the model's row clamped to +-(r * its absmax), the bound rounded to the checkpoint
    dtype, for one r of `ratios`; a row-parallel linear per tensor-parallel column slice."""

    linears: tuple[str, ...]
    ratios: tuple[float, ...]
    tp: int = 1

    @classmethod
    def of(cls, config: dict[str, Any]) -> Clipping | None:
        record = (config.get("producer") or {}).get("weight_clipping")
        if not record:
            return None
        tp = int((config.get("mapping") or {}).get("tp_size", 1))
        return cls(tuple(record["linears"]), tuple(float(r) for r in record["ratios"]), tp)

    def matcher(self, name: str, dtype: torch.dtype) -> Exact | Clipped:
        if not (name.startswith("transformer.layers.") and name.endswith(self.linears)):
            return Exact(dtype)
        return Clipped(dtype, self.ratios, self.tp if tp_kind(name) == "row" else 1)


class Clipped(Exact):
    """What a clipped linear holds: each row (of each column slice) the model's row clamped at
    a bound that is a ratio of the grid times the row's absmax."""

    def __init__(self, dtype: torch.dtype, ratios: tuple[float, ...], slices: int) -> None:
        super().__init__(dtype)
        self.ratios = torch.tensor(ratios, dtype=torch.float32)
        self.slices = slices

    def expect(self, source: torch.Tensor) -> torch.Tensor:
        return source.float()  # the bound is taken on the unrounded row, as convert takes it

    def rows(self, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        ok = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
        ratios = self.ratios.to(got.device)
        for g, w in zip(got.chunk(self.slices, 1), want.chunk(self.slices, 1), strict=True):
            bound = g.float().abs().amax(1, keepdim=True)  # a clipped row's max is its bound
            grid = (w.abs().amax(1, keepdim=True) * ratios).to(self.dtype).float()
            on_grid = (grid == bound).any(1)
            clamped = torch.minimum(torch.maximum(w, -bound), bound).to(self.dtype)
            ok &= on_grid & (clamped == g).all(1)
        return ok

    def inside(self, got: torch.Tensor) -> torch.Tensor:
        """The entries below their row's bound: the model's values, unclipped."""
        parts = [g.abs() < g.abs().amax(1, keepdim=True) for g in got.float().chunk(self.slices, 1)]
        return torch.cat(parts, 1)


def _row_keys(rows: torch.Tensor, dtype: torch.dtype) -> list[bytes]:
    """A key per row that clipping leaves as it is: the row's quartiles in `dtype` (clamping
    is monotone, so it changes only the order statistics beyond the bound)."""
    n = rows.shape[1]
    at = [n // 2] if n < 8 else [n // 4, n // 2, (3 * n) // 4]
    values = rows.to(dtype).sort(dim=1).values[:, at].contiguous()
    return [bytes(row.view(torch.uint8).numpy().tobytes()) for row in values.cpu()]


def _scale(got: torch.Tensor, want: torch.Tensor, match: Exact) -> float | None:
    """The constant c with got == c * want on the entries the rule leaves as they are (c != 1),
    if there is one."""
    inside = match.inside(got)
    w, g = want.double()[inside], got.double()[inside]
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
    name: str, got: torch.Tensor, parts: list[torch.Tensor], labels: tuple[str, ...], match: Exact
) -> Finding | None:
    """Rows of the tensor that are the model's rows, but in other places (q and k swapped,
    heads permuted, ...): each misplaced row is looked up among the expected rows."""
    want = parts[0] if len(parts) == 1 else torch.cat(parts)
    if got.dim() != 2 or got.shape != want.shape:
        return None
    wrong = (~match.rows(got, want)).nonzero().flatten().tolist()
    if not wrong:
        return None
    index: dict[bytes, list[int]] = {}
    for i, key in enumerate(_row_keys(want, got.dtype)):
        index.setdefault(key, []).append(i)
    found = []
    for i, key in zip(wrong, _row_keys(got[wrong], got.dtype), strict=True):
        candidates = index.get(key, [])[:16]
        f = next((k for k in candidates if bool(match.rows(got[i : i + 1], want[k : k + 1]))), None)
        if f is None:
            return None
        found.append(f)
    sections = _sections(parts, labels)
    spans: list[list[int]] = []  # runs of [first got row, first source row, length]
    for i, f in zip(wrong, found, strict=True):
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
    weights: dict[str, torch.Tensor],
    rules: Iterable[Any],
    read: Any,
    dtype: torch.dtype,
    clipping: Clipping | None = None,
) -> list[Finding]:
    """Each checkpoint tensor against its HF source as convert writes it: cast, or for the
    linears a `clipping` record names, clamped by its rule. `rules` are the family's
    TensorRules; `read(name)` gives an HF tensor. One rule's expected tensors are held at a
    time (a swap partner's are read again), so this costs one tensor's memory, not a model's."""
    rules = list(rules)

    def matcher(rule: Any) -> Exact:
        return clipping.matcher(rule.name, dtype) if clipping else Exact(dtype)

    def parts(rule: Any, device: torch.device) -> list[torch.Tensor]:
        """The rule's sources as convert writes them, on `device` (the checkpoint tensor's:
        on a GPU the comparison runs there)."""
        match = matcher(rule)
        sources = [read(s).t() if rule.transpose else read(s) for s in rule.sources]
        return [match.expect(s.to(device)) for s in sources]

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
        finding = _check_one(
            rule, got, parts(rule, got.device), matcher(rule), weights, by_name, parts
        )
        if finding is not None:
            findings.append(finding)
            if finding.cause.startswith("MLP fc and gate swapped"):
                reported.add(_swap_partner(rule.name))
    return findings


def _check_one(
    rule: Any,
    got: torch.Tensor,
    want_parts: list[torch.Tensor],
    match: Exact,
    weights: dict[str, torch.Tensor],
    by_name: dict[str, Any],
    parts: Any,
) -> Finding | None:
    """The finding for one tensor, if it is not what convert writes: the most specific cause
    first (moved rows, fc and gate swapped, a constant scale), else the size of the error."""
    want = want_parts[0] if len(want_parts) == 1 else torch.cat(want_parts)
    if tuple(got.shape) != tuple(want.shape):
        return Finding(
            f"{rule.name} has the wrong shape",
            f"{list(got.shape)}, the model implies {list(want.shape)}",
        )
    if match.same(got, want):
        return None
    ok = match.rows(got, want)
    labels = ("q", "k", "v") if len(want_parts) == 3 else tuple(rule.sources)
    finding = _moved_rows(rule.name, got, want_parts, labels, match)
    if finding:
        return finding
    sibling = _swap_partner(rule.name)
    if sibling in by_name and sibling in weights:
        other = parts(by_name[sibling], got.device)
        other_want = other[0] if len(other) == 1 else torch.cat(other)
        if (
            got.shape == other_want.shape
            and match.same(got, other_want)
            and match.same(weights[sibling], want)
        ):
            layer = rule.name.rsplit(".mlp.", 1)[0]
            return Finding(
                f"MLP fc and gate swapped in {layer}",
                f"{rule.name} holds the weights of {sibling} and the other way round",
            )
    scale = _scale(got, want, match)
    if scale is not None:
        return Finding(
            f"a wrong weight scale in {rule.name}",
            f"it is the model's weight times {scale:.4g}, exactly",
        )
    diff = (got.float() - want.float()).abs()
    if isinstance(match, Clipped):
        rows = int((~ok).sum())
        return Finding(
            f"{rule.name} differs from the model's weights",
            f"{rows} of {ok.numel()} rows are not the model's rows clipped by the checkpoint's "
            f"rule (clamped to {min(match.ratios.tolist()):g}-1 of their absmax); max abs "
            f"error {float(diff[~ok].max()):.3g}",
        )
    return Finding(
        f"{rule.name} differs from the model's weights",
        f"max abs error {float(diff.max()):.3g}; {int((diff > 0).sum())} of {diff.numel()} values differ",
    )


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
    try:  # without its KV cache, whose tensors are checked below
        mode = mode_of({"quant_algo": algo}, dtype)
    except InputError:
        mode = None
    if mode is None or not mode.static_weights:
        return [], [f"weights of a {algo} checkpoint are compared through the runtime only"]
    try:
        _, expected_config, rules, index, _ = plan_conversion(reference_dir, mode)
    except TrtBuilderError as exc:
        return [], [f"the HF model could not be mapped for a static check ({exc})"]
    notes = []
    kv = kv_cache_of((config.get("quantization") or {}).get("kv_cache_quant_algo"))
    if kv != "model":  # weights as they are
        expected_config["quantization"]["kv_cache_quant_algo"] = KV_QUANT_ALGO[kv]
    if kv == "int8":
        # the INT8 KV cache's balancing rescales qkv rows and dense columns (kvcache.py)
        rules = [r for r in rules if not r.name.endswith(BALANCED)]
        notes.append("qkv and dense of an INT8-KV-cache checkpoint are rescaled by its K/V "
                     "balancing: they are compared through the runtime only")  # fmt: skip
    clipping = Clipping.of(config)
    if clipping is not None:
        notes.append(f"clipped rows of {', '.join(clipping.linears)} checked against the clipping "
                     "rule the checkpoint records (producer.weight_clipping)")  # fmt: skip
    with index:
        findings = check_config(config, expected_config)
        findings += check_weights(
            weights, rules, index.read, weights_dtype(weights, dtype), clipping
        )
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
    # evidence only where the candidate followed the reference up to its end token: one that
    # parted earlier (a lossy mode's greedy text) need not end where the reference does
    followed = [p for p in prompts if p.get("reference_ended")
                and p.get("greedy_match_tokens", 0) >= p.get("greedy_tokens", 0) - 1]  # fmt: skip
    runaway = [p for p in followed if not p.get("candidate_ended")]
    if runaway and len(runaway) == len(followed):
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
