"""The engine stage: the exact trtllm-build command, run through a stand-in executable here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from trt_builder.engine import EXECUTABLE_ENV, build_command, run_build
from trt_builder.errors import EngineError
from trt_builder.pipeline import run
from trt_builder.spec import make_spec

STAND_IN = Path(__file__).parent / "standins" / "trtllm-build"


def test_command_has_gemm_plugin_and_limits(tmp_path: Path) -> None:
    spec = make_spec(
        **{"limits.max_batch_size": 4, "limits.max_seq_len": 512, "limits.max_input_len": 256}
    )
    argv = build_command(spec, tmp_path / "ck", tmp_path / "eng")
    flags = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert argv[0] == "trtllm-build"
    assert flags["--gemm_plugin"] == "auto" and flags["--gpt_attention_plugin"] == "auto"
    assert flags["--checkpoint_dir"] == str(tmp_path / "ck") and flags["--output_dir"] == str(
        tmp_path / "eng"
    )
    assert (flags["--max_batch_size"], flags["--max_seq_len"], flags["--max_input_len"]) == (
        "4",
        "512",
        "256",
    )
    assert flags["--kv_cache_type"] == "paged" and flags["--workers"] == "1"


def test_failed_build_quotes_the_last_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text("{}")
    monkeypatch.setenv("FAKE_TRTLLM_FAIL", "1")
    argv = build_command(make_spec(), tmp_path / "ck", tmp_path / "eng", executable=str(STAND_IN))
    with pytest.raises(
        EngineError, match=r"exited with 3; last lines: .*out of memory while building layer 7"
    ):
        run_build(argv, tmp_path / "build.log")
    assert "out of memory" in (tmp_path / "build.log").read_text()


@pytest.mark.integration
def test_stage_runs_the_executable_and_package_includes_the_engine(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EXECUTABLE_ENV, str(STAND_IN))
    spec = make_spec(
        model=str(tiny_llama),
        dtype="float32",
        out=tmp_path / "engines",
        triton_root=tmp_path / "triton",
    )
    result = run(spec)
    engine = next(r for r in result.records if r.name == "engine")
    assert engine.status == "ran" and engine.details["executable"] == str(STAND_IN)
    assert "--gemm_plugin auto" in engine.details["command"]
    assert (result.layout.engine / "rank0.engine").read_bytes().startswith(b"STAND-IN")
    package = next(r for r in result.records if r.name == "package")
    assert package.details["engine_included"] is True
    assert (result.layout.triton / "tensorrt_llm" / "1" / "engine" / "rank0.engine").is_file()
    manifest = json.loads(result.layout.manifest.read_text())
    assert manifest["stages"]["engine"]["outputs"].keys() >= {"rank0.engine", "config.json"}


@pytest.mark.integration
def test_failed_build_leaves_no_engine_dir(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EXECUTABLE_ENV, str(STAND_IN))
    monkeypatch.setenv("FAKE_TRTLLM_FAIL", "1")
    spec = make_spec(
        model=str(tiny_llama),
        dtype="float32",
        out=tmp_path / "engines",
        triton_root=tmp_path / "triton",
    )
    with pytest.raises(EngineError, match="out of memory"):
        run(spec)
    layout_root = next((tmp_path / "engines").glob("*/*/float32-tp1-pp1"))
    assert not (layout_root / "engine").exists()
    assert not [p for p in layout_root.iterdir() if p.name.startswith(".engine.tmp-")]


@pytest.mark.trtllm
@pytest.mark.gpu
def test_real_trtllm_build_on_tiny_model(tiny_llama: Path, tmp_path: Path) -> None:
    """On a GPU host with TensorRT-LLM: a real engine, whose config.json names the release."""
    spec = make_spec(
        model=str(tiny_llama), dtype="float16", out=tmp_path / "engines", require_engine=True
    )
    result = run(spec, only=("fetch", "convert", "engine"))
    config = json.loads((result.layout.engine / "config.json").read_text())
    assert (
        config["version"] != "stand-in"
        and (result.layout.engine / "rank0.engine").stat().st_size > 1000
    )
    assert (
        shutil.which("trtllm-build")
        and subprocess.run(["trtllm-build", "--help"], capture_output=True).returncode == 0
    )
    assert os.environ.get(EXECUTABLE_ENV) is None
