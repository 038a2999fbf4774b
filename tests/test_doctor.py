"""`trt-builder doctor` against a stand-in nvidia-smi (named as such) and stated versions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trt_builder.engine import doctor
from trt_builder.pipeline import doctor as host_doctor

STANDINS = Path(__file__).parent / "standins"


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("PATH", f"{STANDINS}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TRT_BUILDER_TRTLLM_BUILD", str(STANDINS / "trtllm-build"))
    versions = {"tensorrt-llm": "1.1.0", "tensorrt": "10.13.3.9", "torch": "2.13.0"}
    monkeypatch.setattr(doctor, "tool_version", lambda name: versions.get(name, "absent"))
    return monkeypatch


def test_a_hopper_host_builds_every_engine_but_nvfp4(
    host: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    host.setenv(
        "FAKE_SMI_GPUS",
        "NVIDIA H100 80GB HBM3, 9.0, 81559, 575.57.08;NVIDIA H100 80GB HBM3, 9.0, 81559, 575.57.08",
    )
    report = doctor.inspect(tmp_path / "engines")  # not there yet: its parent's disk
    assert [g["sm"] for g in report["gpus"]] == [90, 90] and report["gpus"][0][
        "memory_mib"
    ] == 81559
    assert report["cuda_driver"] == "12.9" and report["tensorrt"] == "10.13.3.9"
    assert report["free_disk_gib"] > 0 and report["host_memory_gib"] > 0
    engine = report["engine"]
    assert engine.pop("nvfp4") == (
        "no: NVFP4 GEMMs need SM 100 or newer (Blackwell: B200), this GPU is SM 90"
    )
    assert set(engine.values()) == {"yes"}


def test_what_a_host_cannot_build(host: pytest.MonkeyPatch, tmp_path: Path) -> None:
    host.setenv("FAKE_SMI_GPUS", "NVIDIA B200, 10.0, 183359, 580.95.05")
    b200 = doctor.inspect(tmp_path)["engine"]
    assert b200["float16"] == "yes" and b200["bfloat16"] == "yes"
    assert list(b200) == ["float16", "bfloat16", "float32", "int8", "int8-wo", "kv-cache int8",
                          "fp8", "kv-cache fp8", "int4-awq", "w4a8-awq", "nvfp4"]  # fmt: skip
    assert (
        b200["int4-awq"]
        == b200["w4a8-awq"]
        == "no: TensorRT-LLM builds INT4 weights on SM 80-90 (Ampere, Ada, Hopper), this GPU is SM 100"
    )
    assert all("refuses INT8 and SmoothQuant on SM 100" in b200[m]
               for m in ("int8-wo", "int8", "kv-cache int8"))  # fmt: skip
    assert b200["fp8"] == "yes" and b200["kv-cache fp8"] == "yes" and b200["nvfp4"] == "yes"
    host.setenv("FAKE_SMI_GPUS", "NVIDIA T4, 7.5, 15360, 575.57.08")
    t4 = doctor.inspect(tmp_path)["engine"]
    assert "bfloat16 needs SM 80" in t4["bfloat16"]
    assert all(t4[m] == "no: FP8 needs SM 89 or newer, this GPU is SM 75"
               for m in ("fp8", "kv-cache fp8"))  # fmt: skip
    assert [m for m, said in t4.items() if said != "yes"] == ["bfloat16", "fp8", "kv-cache fp8",
                                                              "int4-awq", "w4a8-awq", "nvfp4"]  # fmt: skip
    host.setenv("FAKE_SMI_GPUS", "NVIDIA A100-SXM4-80GB, 8.0, 81920, 575.57.08")
    a100 = doctor.inspect(tmp_path)["engine"]
    assert a100["int4-awq"] == "yes"
    assert a100["w4a8-awq"] == "no: FP8 needs SM 89 or newer, this GPU is SM 80"
    host.setenv("FAKE_SMI_GPUS", "")
    assert doctor.inspect(tmp_path)["engine"]["float16"] == "no: no NVIDIA GPU visible"
    host.setattr(
        doctor, "tool_version", lambda name: "1.3.0" if name == "tensorrt-llm" else "absent"
    )
    assert "not a pinned release" in doctor.inspect(tmp_path)["engine"]["int8"]


def test_doctor_command(
    host: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trt_builder.cli.main import main

    host.setenv("FAKE_SMI_GPUS", "NVIDIA L4, 8.9, 23034, 575.57.08")
    assert main(["doctor", "--out", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"][0]["name"] == "NVIDIA L4"
    assert main(["doctor", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "NVIDIA L4 (SM 89, 22 GiB)" in text and "int8 engine              yes" in text


def test_this_machine_without_tensorrt_llm(tmp_path: Path) -> None:
    """The real host here: no TensorRT-LLM, so no mode builds an engine, and it says why; every
    mode builds all the rest, and the wheel's tritonserver serves it on the reference backend."""
    report = host_doctor.inspect(tmp_path)
    if report["tensorrt_llm"] != "absent":
        pytest.skip("TensorRT-LLM is installed here")
    assert set(report["engine"]) == set(doctor.MODES)
    for mode, can in report["modes"].items():
        assert can["engine"] == "no: TensorRT-LLM is not installed (the NGC container has it)"
        assert (
            can["build"] == "yes: every stage but the engine (whose trtllm-build command it prints)"
        ), mode
        if report["tritonserver"]:  # the serve extra (setup.sh installs it)
            assert can["serve"].startswith("yes: the checkpoint, on the reference backend"), mode
    llmapi = report["targets"]["llmapi"]
    assert "Hugging Face checkpoint" in llmapi["makes"] and "no engine" in llmapi["makes"]
    assert llmapi["here"].startswith("yes: builds (float dtypes, int8-wo, fp8)")
    assert "runs its checkpoint" not in llmapi["here"]  # no TensorRT-LLM here
