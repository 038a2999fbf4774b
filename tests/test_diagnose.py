"""The diagnosis on its own: small tensors, each kind of finding and its words."""

from __future__ import annotations

import torch

from trt_builder.models.family import TensorRule
from trt_builder.verify.diagnose import (
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
