"""The README's main job, as a new user runs it: `trt-builder build --dtype int8` on the
embedded SmolLM2-135M-Instruct (a real trained model), then the same command again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _build(tmp_path: Path) -> dict:
    exe = shutil.which("trt-builder") or str(Path(sys.executable).with_name("trt-builder"))
    proc = subprocess.run(
        [exe, "build", "--dtype", "int8", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_build_int8_on_the_default_model(tmp_path: Path) -> None:
    result = _build(tmp_path)
    assert result["model"] == "SmolLM2-135M-Instruct" and result["variant"] == "int8-wo-tp1-pp1"
    assert any("weight-only (W8A16)" in n for n in result["notices"])
    stages = {s["name"]: s for s in result["stages"]}
    assert [s["status"] for s in result["stages"]] == ["ran", "ran", "ran", "skipped", "ran"]

    variant = (
        tmp_path / "engines" / "SmolLM2-135M-Instruct" / result["revision"] / "int8-wo-tp1-pp1"
    )
    config = json.loads((variant / "checkpoint" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W8A16" and config["rotary_base"] == 100000.0
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3

    report = json.loads((variant / "reports" / "verify.json").read_text())
    assert report["passed"] and report["top1"] >= 0.95 and report["kl_mean"] <= 0.02
    chat = [p for p in report["prompts"] if "boiling point" in p["prompt"]]
    assert (
        chat and "100" in chat[0]["reference_text"]
    )  # a real model answers, so the check means something

    repo = (
        tmp_path
        / "triton_repo"
        / f"smollm2-135m-instruct-{result['revision'][7:15]}-int8-wo-tp1-pp1"
    )
    assert Path(result["triton_repository"]).resolve() == repo.resolve()
    assert sorted(p.parent.name for p in repo.glob("*/config.pbtxt")) == [
        "ensemble",
        "postprocessing",
        "preprocessing",
        "tensorrt_llm",
    ]
    assert stages["engine"]["details"]["reason"] == "skipped: TensorRT-LLM not installed"

    again = _build(tmp_path)
    assert [s["status"] for s in again["stages"]] == [
        "cached",
        "cached",
        "cached",
        "skipped",
        "cached",
    ]
