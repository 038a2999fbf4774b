"""Verify catches the conversion bugs that bite TensorRT-LLM users, on a real trained model,
and says what is wrong: each fault below, put into a good SmolLM2-135M float16 checkpoint,
fails verify with a finding that names the likely cause; the clean checkpoint passes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from trt_builder.checkpoint.reader import read_checkpoint
from trt_builder.convert.floats import convert_checkpoint
from trt_builder.convert.model import convert_model
from trt_builder.core.records import Records
from trt_builder.modes import FloatMode, WeightOnlyInt8, gate_for
from trt_builder.verify.compare import verify_checkpoint
from trt_builder.verify.diagnose import check_static
from trt_builder.verify.reference import FORMAT

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def clean(smollm2_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2-fp16")
    convert_checkpoint(smollm2_hf, out, FloatMode("float16"))
    return out


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Records:
    """Where this module's verify runs keep the reference's outputs (verify/reference.py): the
    faults are in the checkpoints, the reference is the same for all."""
    return Records(tmp_path_factory.mktemp("reference-records"), "smollm2", FORMAT)


def _verify(checkpoint: Path, reference: Path, **kwargs: Any) -> dict[str, Any]:
    return verify_checkpoint(
        checkpoint, reference, gate=gate_for("float16"), device="cpu", max_new_tokens=8,
        heldout_tokens=1024, **kwargs,
    )  # fmt: skip


def test_the_reference_on_record_gives_the_report_it_computed_without_loading_the_model(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first verify computes the transformers reference and keeps its outputs; a second
    verify of the model takes them from the records, loads no model, and reports the same
    figures to the bit; a reference of another key is computed anew."""
    from trt_builder.verify import compare

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    convert_checkpoint(tiny_llama, checkpoint, FloatMode("float16"))
    loads: list[int] = []
    real = compare.load_hf_model
    monkeypatch.setattr(compare, "load_hf_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    kept = tmp_path / "records"

    def figures(report: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in report.items() if k not in ("seconds", "seconds_by_part")}

    computed = _verify(checkpoint, tiny_llama, records=Records(kept, "tiny", FORMAT))
    assert loads == [1] and len(list(kept.glob("forward-*.safetensors"))) > 1
    assert len(list(kept.glob("generate-*.safetensors"))) == 1
    again = _verify(checkpoint, tiny_llama, records=Records(kept, "tiny", FORMAT))
    assert loads == [1] and figures(again) == figures(computed)
    assert again["top1"] > 0.5 and again["by_layer"] and again["perplexity"]["tokens"] > 0
    _verify(checkpoint, tiny_llama, records=Records(kept, "another", FORMAT))
    assert loads == [1, 1]


def _edit_config(ck: Path, **fields: Any) -> None:
    config = json.loads((ck / "config.json").read_text())
    config.update(fields)
    (ck / "config.json").write_text(json.dumps(config))


def _edit_weights(ck: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    weights = load_file(ck / "rank0.safetensors")
    edit(weights)
    save_file(weights, str(ck / "rank0.safetensors"), metadata={"format": "pt"})


QKV = "transformer.layers.2.attention.qkv.weight"


def _swap_q_k(w: dict[str, torch.Tensor]) -> None:
    qkv = w[QKV].clone()  # SmolLM2: q is rows 0-575 (9 heads), k 576-767 (3 KV heads)
    qkv[0:192], qkv[576:768] = w[QKV][576:768], w[QKV][0:192]
    w[QKV] = qkv


def _swap_fc_gate(w: dict[str, torch.Tensor]) -> None:
    p = "transformer.layers.4.mlp."
    w[p + "fc.weight"], w[p + "gate.weight"] = w[p + "gate.weight"], w[p + "fc.weight"]


def _double_scale(w: dict[str, torch.Tensor]) -> None:
    w["transformer.layers.7.mlp.proj.weight"] = w["transformer.layers.7.mlp.proj.weight"] * 2


def _nan(w: dict[str, torch.Tensor]) -> None:
    w["transformer.layers.11.attention.dense.weight"][3, 5] = float("nan")


FAULTS: dict[str, tuple[Callable[[Path], None], str, str]] = {
    # fault -> (injection, the cause verify must name, a piece of its evidence)
    "rotary_base": (
        lambda ck: _edit_config(ck, rotary_base=10000.0),
        "rotary settings (rotary_base)",
        "rotary_base = 10000, the HF model implies 100000",
    ),
    "q_k_swapped": (
        lambda ck: _edit_weights(ck, _swap_q_k),
        f"k and q rows swapped inside {QKV}",
        "q row 0 (+191) holds k row 0",
    ),
    "fc_gate_swapped": (
        lambda ck: _edit_weights(ck, _swap_fc_gate),
        "MLP fc and gate swapped in transformer.layers.4",
        "holds the weights of",
    ),
    "scale_doubled": (
        lambda ck: _edit_weights(ck, _double_scale),
        "a wrong weight scale in transformer.layers.7.mlp.proj.weight",
        "times 2",
    ),
    "norm_epsilon": (
        lambda ck: _edit_config(ck, norm_epsilon=1e-4),
        "the norm epsilon (norm_epsilon)",
        "norm_epsilon = 0.0001, the HF model implies 1e-05",
    ),
    "nan": (
        lambda ck: _edit_weights(ck, _nan),
        "NaN or Inf values in transformer.layers.11.attention.dense.weight",
        "1 of 331776 values are not finite",
    ),
}


def test_the_clean_checkpoint_passes(clean: Path, smollm2_hf: Path, records: Records) -> None:
    report = _verify(clean, smollm2_hf, records=records)
    assert report["passed"], report["failures"]
    assert report["diagnosis"] == [] and report["top1"] >= 0.995 and report["kl_mean"] <= 1e-3
    assert report["perplexity"]["tokens"] == 1024 and abs(report["perplexity"]["delta_pct"]) < 0.1
    assert len(report["by_layer"]) == 30 and report["by_layer"][-1]["final"]
    assert max(r["rel_error"] for r in report["by_layer"]) < 0.01


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_an_injected_fault_fails_verify_naming_its_cause(
    fault: str, clean: Path, smollm2_hf: Path, tmp_path: Path, records: Records
) -> None:
    inject, cause, evidence = FAULTS[fault]
    ck = tmp_path / "ck"
    shutil.copytree(clean, ck)
    inject(ck)
    report = _verify(ck, smollm2_hf, records=records)
    assert not report["passed"]
    fatal = [d for d in report["diagnosis"] if d["fatal"]]
    assert fatal and fatal[0]["cause"] == cause and evidence in fatal[0]["evidence"], fatal
    assert any(cause in failure for failure in report["failures"])
    json.dumps(report, allow_nan=False)  # the report stays valid JSON (NaN metrics included)


def test_a_tokenizer_from_another_model_fails_verify(
    clean: Path, smollm2_hf: Path, tokenizer_dir: Path, records: Records
) -> None:
    report = _verify(clean, smollm2_hf, tokenizer_dir=tokenizer_dir, records=records)
    assert not report["passed"]
    (finding,) = [d for d in report["diagnosis"] if d["fatal"]]
    assert finding["cause"] == "a tokenizer that is not the model's own"
    assert "vocabulary 384 vs the model's 49152" in finding["evidence"]
    assert "prompts encode differently" in finding["evidence"]


# -- INT8 weight-only: clipped weights are checked by the clipping's rule, faults still named --


@pytest.fixture(scope="module")
def clipped(
    default_build: tuple[Path, dict[str, Any]],
    smollm2_hf: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """The default model's int8-wo checkpoint, clipped from the default build's calibration."""
    cwd, result = default_build
    calibration = next(s["output"] for s in result["stages"] if s["name"] == "calibrate")
    out = tmp_path_factory.mktemp("smollm2-int8-wo")
    summary = convert_model(
        WeightOnlyInt8(), smollm2_hf, out, tp=1, pp=1, calibration=cwd / calibration
    )
    assert summary["weight_clipping"]["clipped"] > 0  # rows were clipped: the case at hand
    return out


def _static(ck: Path, reference: Path) -> list[dict[str, Any]]:
    config, weights = read_checkpoint(ck)
    findings, _ = check_static(ck, config, weights, reference)
    return [f.as_dict() for f in findings]


def _scale_gate(w: dict[str, torch.Tensor]) -> None:
    w["transformer.layers.7.mlp.gate.weight"] = w["transformer.layers.7.mlp.gate.weight"] * 2


def _move_row(w: dict[str, torch.Tensor]) -> None:
    dense = w["transformer.layers.5.attention.dense.weight"].clone()
    dense[[3, 10]] = dense[[10, 3]]
    w["transformer.layers.5.attention.dense.weight"] = dense


CLIPPED_FAULTS = {
    "q_k_swapped": (_swap_q_k, f"k and q rows swapped inside {QKV}", "q row 0 (+191) holds k row 0"),
    "fc_gate_swapped": (_swap_fc_gate, "MLP fc and gate swapped in transformer.layers.4", "holds the weights of"),
    "scale_doubled": (_scale_gate, "a wrong weight scale in transformer.layers.7.mlp.gate.weight", "times 2"),
    "row_moved": (_move_row, "rows permuted inside transformer.layers.5.attention.dense.weight", "row 3 holds"),
}  # fmt: skip


def test_a_clipped_int8_wo_checkpoint_passes_the_static_check(
    clipped: Path, smollm2_hf: Path
) -> None:
    config = json.loads((clipped / "config.json").read_text())
    assert config["producer"]["weight_clipping"]["linears"] == [
        "qkv.weight", "dense.weight", "fc.weight", "gate.weight"
    ]  # fmt: skip
    assert _static(clipped, smollm2_hf) == []


@pytest.mark.parametrize("fault", sorted(CLIPPED_FAULTS))
def test_a_fault_in_a_clipped_int8_wo_checkpoint_is_named(
    fault: str, clipped: Path, smollm2_hf: Path, tmp_path: Path
) -> None:
    inject, cause, evidence = CLIPPED_FAULTS[fault]
    ck = tmp_path / "ck"
    shutil.copytree(clipped, ck)
    _edit_weights(ck, inject)
    (finding,) = _static(ck, smollm2_hf)
    assert finding["fatal"] and finding["cause"] == cause and evidence in finding["evidence"], (
        finding
    )


def test_the_reference_loads_in_its_stored_dtype_only_where_every_tensor_shares_one(
    tmp_path: Path,
) -> None:
    """On a GPU the reference is loaded in the dtype its weights are stored in and made float32
    there, which is exact only where no tensor is stored wider: a float32 norm among bfloat16
    weights keeps the float32 load."""
    from trt_builder.verify.compare import stored_dtype

    save_file({"w": torch.ones(2, dtype=torch.bfloat16)}, str(tmp_path / "a.safetensors"))
    assert stored_dtype(tmp_path) == torch.bfloat16
    save_file({"norm": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    assert stored_dtype(tmp_path) is None
