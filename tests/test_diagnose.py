"""The diagnosis on its own: small tensors, each kind of finding and its words."""

from __future__ import annotations

import torch

from trt_builder.models.family import TensorRule
from trt_builder.modes.weight_only.convert import GRID, clamp_rows
from trt_builder.verify.diagnose import (
    Clipping,
    check_config,
    check_weights,
    end_findings,
    layer_finding,
    position_finding,
)

GEN = torch.Generator().manual_seed(0)
HF = {
    "q": torch.randn(4, 3, generator=GEN),
    "k": torch.randn(2, 3, generator=GEN),
    "v": torch.randn(2, 3, generator=GEN),
    "up": torch.randn(5, 3, generator=GEN),
    "gate": torch.randn(5, 3, generator=GEN),
}
RULES = [
    TensorRule("qkv.weight", ("q", "k", "v"), (8, 3), source_shapes=((4, 3), (2, 3), (2, 3))),
    TensorRule("l.mlp.fc.weight", ("gate",), (5, 3)),
    TensorRule("l.mlp.gate.weight", ("up",), (5, 3)),
]


def _good() -> dict[str, torch.Tensor]:
    return {
        "qkv.weight": torch.cat([HF["q"], HF["k"], HF["v"]]).half(),
        "l.mlp.fc.weight": HF["gate"].half(),
        "l.mlp.gate.weight": HF["up"].half(),
    }


def _check(weights: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    return [
        (f.cause, f.evidence) for f in check_weights(weights, RULES, HF.__getitem__, torch.float16)
    ]


def test_a_faithful_checkpoint_has_no_findings() -> None:
    assert _check(_good()) == []


def test_misplaced_rows_are_located() -> None:
    w = _good()
    qkv = w["qkv.weight"].clone()
    qkv[[1, 5]] = qkv[[5, 1]]  # q row 1 <-> k row 1
    w["qkv.weight"] = qkv
    ((cause, evidence),) = _check(w)
    assert cause == "k and q rows swapped inside qkv.weight"
    assert "q row 1 holds k row 1" in evidence and "k row 1 holds q row 1" in evidence


def test_swapped_fc_and_gate_scale_and_other_differences() -> None:
    w = _good()
    w["l.mlp.fc.weight"], w["l.mlp.gate.weight"] = w["l.mlp.gate.weight"], w["l.mlp.fc.weight"]
    assert _check(w) == [("MLP fc and gate swapped in l", "l.mlp.fc.weight holds the weights of l.mlp.gate.weight and the other way round")]  # fmt: skip
    w = _good()
    w["l.mlp.gate.weight"] = w["l.mlp.gate.weight"] * 0.5
    assert _check(w)[0][0] == "a wrong weight scale in l.mlp.gate.weight"
    assert "times 0.5" in _check(w)[0][1]
    w = _good()
    w["l.mlp.gate.weight"] = w["l.mlp.gate.weight"] + 0.25
    assert _check(w)[0][0] == "l.mlp.gate.weight differs from the model's weights"


def test_nan_missing_and_misshapen_tensors() -> None:
    w = _good()
    w["l.mlp.fc.weight"][0, 0] = float("inf")
    del w["l.mlp.gate.weight"]
    causes = [c for c, _ in _check(w)]
    assert causes == ["NaN or Inf values in l.mlp.fc.weight", "l.mlp.gate.weight is missing"]
    w = _good()
    w["l.mlp.fc.weight"] = w["l.mlp.fc.weight"][:4]
    assert _check(w) == [
        ("l.mlp.fc.weight has the wrong shape", "[4, 3], the model implies [5, 3]")
    ]


def test_config_differences_and_missing_fields() -> None:
    expected = {
        "rotary_base": 100000.0,
        "norm_epsilon": 1e-5,
        "qwen_type": "qwen2",
        "dtype": "float16",
    }
    got = {"rotary_base": 10000.0, "norm_epsilon": 9.999999747378752e-06, "dtype": "bfloat16"}
    findings = check_config(got, expected)
    assert [(f.cause, f.fatal) for f in findings] == [
        ("rotary settings (rotary_base)", True),
        ("the config field qwen_type", False),  # absent: another producer's choice
    ]


def test_runtime_evidence() -> None:
    growing = [{"position": i, "kl_mean": 1e-5 if i < 2 else 0.5, "count": 3} for i in range(20)]
    finding = position_finding(growing)
    assert finding and finding.cause.startswith("rotary settings") and not finding.fatal
    assert (
        position_finding([{"position": i, "kl_mean": 0.5, "count": 3} for i in range(20)]) is None
    )
    layers = [{"layer": 0, "rel_error": 0.001}, {"layer": 1, "rel_error": 0.7}]
    assert layer_finding(layers).cause == "the hidden states part at layer 1"  # type: ignore[union-attr]
    prompts = [
        {"prompt": "Hi", "candidate_empty": True},
        {"prompt": "Yo", "candidate_empty": False},
    ]
    (finding,) = end_findings(prompts, {2})
    assert (
        finding.cause == "end-of-sequence ids: the output ends at once"
        and "end ids [2]" in finding.evidence
    )


def test_only_a_candidate_that_followed_the_reference_to_its_end_says_the_end_ids_are_wrong() -> (
    None
):
    """verify's prompt records (verify/compare.py): a candidate that produced the reference's
    tokens up to its end token and went on points at the end ids; one whose greedy text parted
    earlier (a 4-bit mode's, measured on the default model) says nothing about them."""
    followed = {"prompt": "Hi", "reference_ended": True, "candidate_ended": False,
                "greedy_tokens": 5, "greedy_match_tokens": 5}  # fmt: skip
    parted = {**followed, "prompt": "Yo", "greedy_match_tokens": 2}
    (finding,) = end_findings([followed, parted], {2})
    assert finding.cause == "end-of-sequence ids: the output never ends"
    assert "the reference ends 1 prompt(s)" in finding.evidence
    assert end_findings([parted], {2}) == []
    assert end_findings([followed, {**followed, "candidate_ended": True}], {2}) == []


# -- INT8 weight-only clipping: the rule the checkpoint records, not equality -----------------

CLIP_GEN = torch.Generator().manual_seed(1)
CLIP_HF = {
    name: torch.randn(rows, 16, generator=CLIP_GEN)
    for name, rows in (("q", 8), ("k", 4), ("v", 4), ("up", 10), ("gate", 10))
}
CLIP_RULES = [
    TensorRule(
        "transformer.layers.0.attention.qkv.weight", ("q", "k", "v"), (16, 16),
        source_shapes=((8, 16), (4, 16), (4, 16)),
    ),
    TensorRule("transformer.layers.0.mlp.fc.weight", ("gate",), (10, 16)),
    TensorRule("transformer.layers.0.mlp.gate.weight", ("up",), (10, 16)),
]  # fmt: skip
CLIP_RECORD = Clipping(("qkv.weight", "fc.weight", "gate.weight"), GRID)


def _clipped(ratio: float = 0.9) -> dict[str, torch.Tensor]:
    """Every row clamped at `ratio` of its absmax, as convert writes a clipped row."""
    ratios = torch.full((16,), ratio)
    qkv = torch.cat([CLIP_HF["q"], CLIP_HF["k"], CLIP_HF["v"]])
    return {
        "transformer.layers.0.attention.qkv.weight": clamp_rows(qkv, ratios, torch.float16).half(),
        "transformer.layers.0.mlp.fc.weight": clamp_rows(CLIP_HF["gate"], ratio, torch.float16).half(),
        "transformer.layers.0.mlp.gate.weight": clamp_rows(CLIP_HF["up"], ratio, torch.float16).half(),
    }  # fmt: skip


def _check_clipped(weights: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    found = check_weights(weights, CLIP_RULES, CLIP_HF.__getitem__, torch.float16, CLIP_RECORD)
    return [(f.cause, f.evidence) for f in found]


def test_clipped_rows_pass_by_the_recorded_rule_and_equality_would_fail_them() -> None:
    weights = _clipped()
    assert _check_clipped(weights) == []
    # without the record the same weights differ from the model's (what failed int8-wo builds)
    plain = check_weights(weights, CLIP_RULES, CLIP_HF.__getitem__, torch.float16)
    assert plain and all("differs from the model's weights" in f.cause for f in plain)
    # a ratio off the recorded grid is not the rule: rows clamped at 0.7 are named
    ((cause, evidence),) = _check_clipped(
        {**weights, "transformer.layers.0.mlp.fc.weight": _clipped(0.7)["transformer.layers.0.mlp.fc.weight"]}
    )  # fmt: skip
    assert cause == "transformer.layers.0.mlp.fc.weight differs from the model's weights"
    assert evidence.startswith("10 of 10 rows are not the model's rows clipped")


def test_faults_in_clipped_weights_are_named() -> None:
    qkv_name = "transformer.layers.0.attention.qkv.weight"
    w = _clipped()
    qkv = w[qkv_name].clone()
    qkv[[1, 9]] = qkv[[9, 1]]  # q row 1 <-> k row 1
    w[qkv_name] = qkv
    ((cause, evidence),) = _check_clipped(w)
    assert cause == f"k and q rows swapped inside {qkv_name}"
    assert "q row 1 holds k row 1" in evidence
    w = _clipped()
    fc, gate = "transformer.layers.0.mlp.fc.weight", "transformer.layers.0.mlp.gate.weight"
    w[fc], w[gate] = w[gate], w[fc]
    assert _check_clipped(w) == [("MLP fc and gate swapped in transformer.layers.0", f"{fc} holds the weights of {gate} and the other way round")]  # fmt: skip
    w = _clipped()
    w[gate] = w[gate] * 1.5
    ((cause, evidence),) = _check_clipped(w)
    assert cause == f"a wrong weight scale in {gate}" and "times 1.5" in evidence
    w = _clipped()
    moved = w[fc].clone()
    moved[[2, 7]] = moved[[7, 2]]
    w[fc] = moved
    ((cause, evidence),) = _check_clipped(w)
    assert cause == f"rows permuted inside {fc}" and "gate row 2 holds gate row 7" in evidence


def test_row_parallel_linears_are_clipped_per_tensor_parallel_slice() -> None:
    dense = "transformer.layers.0.attention.dense.weight"
    source = {"o": torch.randn(6, 32, generator=torch.Generator().manual_seed(2))}
    rules = [TensorRule(dense, ("o",), (6, 32))]
    halves = [clamp_rows(h, 0.85, torch.float16) for h in source["o"].chunk(2, 1)]
    per_rank = torch.cat(halves, 1).half()
    record = Clipping(("dense.weight",), GRID, tp=2)
    assert check_weights({dense: per_rank}, rules, source.__getitem__, torch.float16, record) == []
    whole = clamp_rows(source["o"], 0.85, torch.float16).half()  # one bound over both slices
    (finding,) = check_weights({dense: whole}, rules, source.__getitem__, torch.float16, record)
    assert finding.cause == f"{dense} differs from the model's weights"
