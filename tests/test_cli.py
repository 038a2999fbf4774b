"""The CLI end to end on a tiny model: stages, cache, manifest, errors and exit codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from xml.etree import ElementTree

import pytest

from conftest import edit_json
from trt_builder.cli.main import main

pytestmark = pytest.mark.integration


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict | None, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def _common(model: Path, tmp: Path) -> list[str]:
    return [
        "--model",
        str(model),
        "--out",
        str(tmp / "engines"),
        "--triton-root",
        str(tmp / "triton"),
    ]


def _statuses(result: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in result["stages"]}


def test_build_then_rerun_skips_everything(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["build", *_common(tiny_llama, tmp_path), "--dtype", "float16", "--json"]
    code, result, _ = _cli(capsys, *args)
    assert code == 0 and result is not None and result["ok"]
    assert _statuses(result) == {
        "fetch": "ran",
        "convert": "ran",
        "verify": "ran",
        "engine": "skipped",
        "package": "ran",
    }
    variant = Path(result["variant_dir"])
    assert (variant / "checkpoint" / "rank0.safetensors").is_file()
    report = json.loads((variant / "reports" / "verify.json").read_text())
    assert report["passed"] and report["top1"] >= 0.99 and report["kl_mean"] <= 1e-3
    assert report["perplexity"]["tokens"] > 0 and report["by_layer"] and report["by_position"]
    junit = ElementTree.parse(variant / "reports" / "verify.junit.xml").getroot()
    assert junit.get("failures") == "0" and int(junit.get("tests") or 0) > 5
    assert (variant / "reports" / "verify.html").read_text().count("<svg") == 3
    assert (Path(result["triton_repository"]) / "ensemble" / "config.pbtxt").is_file()
    engine = result["stages"][3]
    assert engine["details"]["reason"] == "skipped: TensorRT-LLM not installed"
    assert engine["details"]["command"].startswith("trtllm-build --checkpoint_dir ")

    manifest = json.loads((variant / "manifest.json").read_text())
    assert manifest["spec"]["dtype"] == "float16" and manifest["source"]["kind"] == "local"
    assert set(manifest["tools"]) >= {"trt-builder", "torch", "transformers"}
    convert = manifest["stages"]["convert"]
    assert len(convert["key"]) == 64 and set(convert["inputs"]) == {
        "hf/config.json",
        "hf/model.safetensors",
    }
    assert set(convert["outputs"]) == {"config.json", "rank0.safetensors"}
    assert all(len(d) == 64 for d in convert["outputs"].values())

    code, again, _ = _cli(capsys, *args)
    assert code == 0 and again is not None
    assert result["hashed_bytes"] > 0 and again["hashed_bytes"] == 0  # nothing re-read
    assert _statuses(again) == {
        "fetch": "cached",
        "convert": "cached",
        "verify": "cached",
        "engine": "skipped",
        "package": "cached",
    }

    code, changed, _ = _cli(
        capsys, *args, "--max-batch-size", "4"
    )  # read by engine and package only
    assert code == 0 and _statuses(changed or {}) == {
        "fetch": "cached",
        "convert": "cached",
        "verify": "cached",
        "engine": "skipped",
        "package": "ran",
    }

    code, human, err = _cli(capsys, *args[:-1])  # without --json: a summary table on stderr
    assert (
        code == 0 and human is None and "cached" in err and "trtllm-build --checkpoint_dir" in err
    )


def test_dry_run_writes_nothing(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result, _ = _cli(capsys, "build", *_common(tiny_llama, tmp_path), "--dry-run", "--json")
    assert code == 0 and result is not None and result["dry_run"]
    assert set(_statuses(result).values()) == {"would run"}
    assert not (tmp_path / "engines").exists() and not (tmp_path / "triton").exists()
    assert not list(tmp_path.rglob("digests.json")) and not list(tmp_path.rglob("*.lock"))
    plan = result["engine_plan"]
    assert plan["command"].startswith("trtllm-build --checkpoint_dir ")
    assert plan["memory"] == "after fetch: the model's config is not here yet"
    # once fetched, the dry run shows the memory plan too (as data and in words)
    assert _cli(capsys, "fetch", *_common(tiny_llama, tmp_path), "--json")[0] == 0
    code, result, _ = _cli(capsys, "build", *_common(tiny_llama, tmp_path), "--dry-run", "--json")
    memory = (result or {})["engine_plan"]["memory"]
    assert (
        memory["gpu"] == "H100-80GB"
        and memory["kv_tokens"] > 0
        and memory["proposed_max_batch_size"] >= 1
    )
    code, _, err = _cli(capsys, "build", *_common(tiny_llama, tmp_path), "--dry-run")
    assert (
        code == 0
        and "memory plan on H100-80GB per rank: weights" in err
        and "engine command: trtllm-build" in err
    )


def test_stages_one_at_a_time(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [*_common(tiny_llama, tmp_path), "--dtype", "float32", "--json"]
    code, _, err = _cli(capsys, "convert", *common)
    assert code == 3 and "convert needs" in err and "run the earlier stages" in err
    for stage in ("fetch", "convert", "verify", "engine", "package"):
        code, result, _ = _cli(capsys, stage, *common)
        assert code == 0 and result is not None and [s["name"] for s in result["stages"]] == [stage]
    code, result, _ = _cli(capsys, "build", *common)
    assert code == 0 and set(_statuses(result or {}).values()) == {"cached", "skipped"}


def test_verify_gate_failure_exits_6_and_stays_failed(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "strict.toml"
    config.write_text("[verify]\nmin_top1 = 1.0\nmax_kl = 0.0\n")
    args = ["build", *_common(tiny_llama, tmp_path), "--dtype", "bfloat16", "--config", str(config)]
    code, _, err = _cli(capsys, *args)
    assert code == 6 and "verify failed: " in err and "mean KL" in err and "Traceback" not in err
    report = next((tmp_path / "engines").glob("*/*/bfloat16-tp1-pp1/reports/verify.json"))
    assert json.loads(report.read_text())["passed"] is False
    assert not (tmp_path / "triton").exists()  # later stages did not run
    code, _, err = _cli(capsys, *args)  # cached, and still a failure
    assert code == 6 and "verify failed" in err


def test_standalone_verify_catches_a_wrong_rotary_base(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli(capsys, "fetch", *_common(tiny_llama, tmp_path))
    _, result, _ = _cli(capsys, "convert", *_common(tiny_llama, tmp_path), "--json")
    checkpoint = tmp_path / "ck"
    shutil.copytree(Path(result["variant_dir"]) / "checkpoint", checkpoint)  # type: ignore[index]
    report = tmp_path / "v.json"
    verify = [
        "verify",
        "--checkpoint",
        str(checkpoint),
        "--reference",
        str(tiny_llama),
        "--report",
        str(report),
    ]
    code, _, err = _cli(capsys, *verify)
    assert code == 0 and json.loads(report.read_text())["passed"]
    edit_json(checkpoint / "config.json", rotary_base=100.0)
    code, _, err = _cli(capsys, *verify)
    assert code == 6 and "verify failed: top-1 agreement" in err
    assert json.loads(report.read_text())["passed"] is False


def test_unsupported_architecture_and_debug_traceback(
    tiny_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit_json(tiny_copy / "config.json", architectures=["MambaForCausalLM"])
    code, _, err = _cli(capsys, "build", *_common(tiny_copy, tmp_path))
    assert (
        code == 4
        and "MambaForCausalLM is not supported: supported are GPT2LMHeadModel, LlamaForCausalLM"
        in err
        and "Traceback" not in err
    )
    code, _, err = _cli(capsys, "build", *_common(tiny_copy, tmp_path), "--debug")
    assert code == 4 and "Traceback" in err
    code, result, _ = _cli(capsys, "build", *_common(tiny_copy, tmp_path), "--json")
    assert code == 4 and result == {"ok": False, "error": result["error"], "exit_code": 4}  # type: ignore[index]


def test_second_build_of_the_same_target_names_the_lock_holder(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    from trt_builder.core.locks import locked

    code, result, _ = _cli(capsys, "fetch", *_common(tiny_llama, tmp_path), "--json")
    variant = Path(result["variant_dir"])  # type: ignore[index]
    with locked(variant.parent / f".{variant.name}.lock", timeout=1):
        code, _, err = _cli(
            capsys, "build", *_common(tiny_llama, tmp_path), "--lock-timeout", "0.2"
        )
    assert (
        code == 9 and f"is being built by pid {os.getpid()} on " in err and "--lock-timeout" in err
    )
    code, _, _ = _cli(capsys, "build", *_common(tiny_llama, tmp_path), "--lock-timeout", "0.2")
    assert code == 0  # released


def test_build_killed_during_verify_leaves_no_report_and_rerun_completes(
    tiny_llama: Path, tmp_path: Path
) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    exe = str(Path(sys.executable).with_name("trt-builder"))
    args = [exe, "build", *_common(tiny_llama, tmp_path), "--dtype", "float32", "--json"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    tmp_reports: list[Path] = []
    while not tmp_reports and time.time() < deadline and proc.poll() is None:
        tmp_reports = list((tmp_path / "engines").glob("*/*/float32-tp1-pp1/.reports.tmp-*"))
        time.sleep(0.02)
    assert tmp_reports, "verify never started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    variant = tmp_reports[0].parent
    assert not (variant / "reports").exists() and (variant / "checkpoint" / "stage.json").is_file()

    done = subprocess.run(args, capture_output=True, text=True, check=True)
    stages = {s["name"]: s["status"] for s in json.loads(done.stdout)["stages"]}
    assert stages == {
        "fetch": "cached",
        "convert": "cached",
        "verify": "ran",
        "engine": "skipped",
        "package": "ran",
    }
    assert json.loads((variant / "reports" / "verify.json").read_text())["passed"]
    assert not list(variant.glob(".reports.tmp-*"))


def test_engine_and_package_refuse_a_checkpoint_that_failed_verify(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [*_common(tiny_llama, tmp_path), "--dtype", "bfloat16"]
    for stage in ("fetch", "convert"):
        assert _cli(capsys, stage, *common)[0] == 0
    code, result, _ = _cli(capsys, "package", *common, "--json")  # no verify yet: said, not refused
    assert code == 0 and any("has not been verified" in n for n in result["notices"])  # type: ignore[index]
    strict = tmp_path / "strict.toml"
    strict.write_text("[verify]\nmin_top1 = 1.0\nmax_kl = 0.0\n")
    assert _cli(capsys, "verify", *common, "--config", str(strict))[0] == 6
    for stage in ("engine", "package"):
        code, _, err = _cli(capsys, stage, *common)
        assert code == 6 and f"{stage} refuses this checkpoint: it failed verify" in err


def test_real_stages_rerun_exactly_when_what_they_read_changes(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trt_builder.core import stage as framework
    from trt_builder.core.digests import sha256_file
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    def build(**kw: object) -> dict[str, str]:
        spec = make_spec(
            model=str(tiny_llama), out=tmp_path / "e", triton_root=tmp_path / "t", **kw
        )
        return {r.name: r.status for r in run(spec).records}

    def expect(fetch: str, convert: str, verify: str, package: str) -> dict[str, str]:
        return {
            "fetch": fetch,
            "convert": convert,
            "verify": verify,
            "engine": "skipped",
            "package": package,
        }

    assert build() == expect("ran", "ran", "ran", "ran")
    # A spec field: a new variant; the shared fetch output is reused.
    assert build(dtype="float32") == expect("cached", "ran", "ran", "ran")
    # A tool version: transformers is read by fetch, verify and package, not by convert.
    real = framework.tool_versions
    monkeypatch.setattr(
        framework,
        "tool_versions",
        lambda names: {
            **real(names),
            **({"transformers": "9.9"} if "transformers" in names else {}),
        },
    )
    assert build() == expect("ran", "cached", "ran", "ran")
    monkeypatch.setattr(framework, "tool_versions", real)
    # An input file: the tokenizer is read by verify and package, not by convert.
    hf = next((tmp_path / "e").glob("*/*/hf"))
    assert build() == expect("ran", "cached", "ran", "ran")
    assert build()["fetch"] == "cached"
    tokenizer = hf / "tokenizer_config.json"
    record = json.loads((hf / "stage.json").read_text())
    tokenizer.write_text(tokenizer.read_text().replace("}", ', "model_max_length": 4096}', 1))
    # Record the edit as fetch's own output, as a re-fetch of a changed tokenizer would.
    record["outputs"]["tokenizer_config.json"] = sha256_file(tokenizer)
    (hf / "stage.json").write_text(json.dumps(record))
    assert build() == expect("cached", "cached", "ran", "ran")


def test_impossible_tp_is_refused_before_any_work(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _cli(capsys, "build", *_common(tiny_llama, tmp_path), "--tp", "3")
    assert code == 2 and "--tp 3 does not divide this model" in err and "use one of 1, 2, 4" in err
    assert not (tmp_path / "engines").exists()
    code, result, _ = _cli(
        capsys,
        "build",
        *_common(tiny_llama, tmp_path),
        "--tp",
        "2",
        "--pp",
        "2",
        "--dtype",
        "float32",
        "--json",
    )
    assert code == 0 and result["variant"] == "float32-tp2-pp2"  # type: ignore[index]
    checkpoint = Path(result["variant_dir"]) / "checkpoint"  # type: ignore[index]
    assert sorted(p.name for p in checkpoint.glob("rank*.safetensors")) == [
        f"rank{r}.safetensors" for r in range(4)
    ]
    assert "--workers 4" in result["stages"][3]["details"]["command"]  # type: ignore[index]


def test_a_cached_rerun_imports_neither_torch_nor_transformers(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What keeps an unchanged rerun near interpreter start-up (docs/benchmarks.md)."""
    import subprocess
    import sys

    args = ["build", *_common(tiny_llama, tmp_path), "--dtype", "float32"]
    assert _cli(capsys, *args)[0] == 0
    probe = (
        "import sys; from trt_builder.cli.main import main; code = main(sys.argv[1:]); "
        "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, check=True
    ).stdout
    assert out.split()[-3:] == ["0", "False", "False"]


def test_engine_phases_show_as_lines_in_a_ci_log(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Not a terminal (a CI log): each trtllm-build phase is a line of its own (the stand-in
    trtllm-build prints the real log's phase markers; it builds nothing)."""
    from trt_builder.engine.build import EXECUTABLE_ENV

    monkeypatch.setenv(EXECUTABLE_ENV, str(Path(__file__).parent / "standins" / "trtllm-build"))
    code, _, err = _cli(capsys, "build", *_common(tiny_llama, tmp_path), "--dtype", "float32",
                        "--build-timeout", "10m")  # fmt: skip
    assert code == 0
    lines = [line.strip() for line in err.splitlines()]
    phases = [line for line in lines if line.startswith("engine ") and "(at " in line]
    assert phases[0].startswith("engine reading the checkpoint and flags (at ")
    assert any(p.startswith("engine TensorRT is optimizing the engine") for p in phases)
    assert phases[-1].startswith("engine all ranks built")


def test_package_check_validates_an_existing_repository(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [*_common(tiny_llama, tmp_path), "--dtype", "float32"]
    assert _cli(capsys, "build", *common, "--json")[0] == 0
    repo = next((tmp_path / "triton").glob("*-float32-tp1-pp1"))
    code, result, _ = _cli(capsys, "package", "--check", str(repo), "--json")
    assert code == 0 and result is not None and result["info"]["version"] == 1
    assert result["models"] == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm"]
    config = repo / "ensemble" / "config.pbtxt"
    # the ensemble's steps are JSON in its `steps` parameter (escaped in the text format)
    config.write_text(config.read_text().replace('\\"QUERY\\"', '\\"QUESTION\\"', 1))
    code, _, err = _cli(capsys, "package", "--check", str(repo))
    assert code == 8 and "ensemble ensemble: preprocessing has no input 'QUESTION'" in err
    assert len(err.strip().splitlines()) == 1


def test_sq_alpha_auto_is_the_default_it_is_documented_as(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--sq-alpha auto` is accepted (plan reads the config alone); a number outside 0..1 and a
    word are refused by the option with exit 2, naming what it takes."""
    assert (
        main(
            ["plan", "--model", str(tiny_llama), "--dtype", "int8", "--sq-alpha", "auto", "--json"]
        )
        == 0
    )
    assert (
        main(["plan", "--model", str(tiny_llama), "--dtype", "int8", "--sq-alpha", "0.6", "--json"])
        == 0
    )
    capsys.readouterr()
    for target, words in (("engine", "trtllm-build"), ("llmapi", "LLM() arguments")):
        assert main(["plan", "--model", str(tiny_llama), "--target", target, "--json"]) == 0
        planned = json.loads(capsys.readouterr().out)
        assert planned["target"] == target and words in planned["makes"]
    for bad in ("1.5", "half"):  # one validation, SmoothQuant's room's, for flag and file
        message = f"alpha (--sq-alpha, int8.alpha) is auto or a number from 0 to 1, not '{bad}'"
        assert main(["plan", "--model", str(tiny_llama), "--dtype", "int8", "--sq-alpha", bad]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags", [["--dtype", "int8"], ["--dtype", "int8-wo"], ["--kv-cache", "int8"]]
)
def test_int8_for_an_sm_100_target_is_refused_before_any_work(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    """TensorRT-LLM's builder refuses INT8 on SM 100-119: build and plan refuse B200 first,
    and write nothing; float16 for B200 plans."""
    out = tmp_path / "engines"
    for command in (
        ["build", "--model", str(tiny_llama), "--out", str(out)],
        ["plan", "--model", str(tiny_llama)],
    ):
        assert main([*command, "--target-gpu", "B200", *flags]) == 2  # a spec error
        err = capsys.readouterr().err
        assert "B200 is SM 100, where TensorRT-LLM builds no INT8" in err
        assert "use --dtype fp8, float16 or bfloat16" in err and "Traceback" not in err
    assert not out.exists()
    for dtype in ("float16", "fp8"):  # FP8 per-tensor builds on Blackwell
        assert main(["plan", "--model", str(tiny_llama), "--target-gpu", "B200", "--dtype", dtype,
                     "--kv-cache", "fp8"]) == 0  # fmt: skip


@pytest.mark.parametrize(
    ("gpu", "flags"),
    [("A100-80GB", ["--dtype", "fp8"]), ("A10G", ["--kv-cache", "fp8"]),
     ("A100-40GB", ["--dtype", "fp8", "--kv-cache", "fp8"])],
)  # fmt: skip
def test_fp8_below_sm_89_is_refused_before_any_work(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], gpu: str,
    flags: list[str],
) -> None:  # fmt: skip
    """No FP8 GEMM or FP8 KV cache kernel below SM 89: build and plan refuse A100 and A10G in
    one line naming int8, exit 2, and write nothing."""
    out = tmp_path / "engines"
    for command in (
        ["build", "--model", str(tiny_llama), "--out", str(out)],
        ["plan", "--model", str(tiny_llama)],
    ):
        assert main([*command, "--target-gpu", gpu, *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "which has no FP8" in err[0] and "use --dtype int8" in err[0]
    assert not out.exists()


def test_qwen3_smoothquant_is_refused_before_any_work(
    tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Upstream's SmoothQuant attention has no q/k norm: Qwen3 with --dtype int8 is refused from
    its config.json alone (no fetch, no calibration), int8-wo offered instead."""
    from tiny_models import make_tiny

    model, out = tmp_path / "qwen3", tmp_path / "engines"
    make_tiny("qwen3", model, tokenizer_dir)
    assert main(["build", "--model", str(model), "--dtype", "int8", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "SmoothQuant is not supported for Qwen3ForCausalLM yet: use --dtype int8-wo" in err
    assert not any(out.rglob("*.safetensors"))  # nothing fetched
    assert main(["plan", "--model", str(model), "--dtype", "int8"]) != 0
    assert "SmoothQuant is not supported for Qwen3ForCausalLM" in capsys.readouterr().err
    assert main(["plan", "--model", str(model), "--dtype", "int8-wo"]) == 0


def test_a_chat_template_that_leaves_the_sandbox_is_bad_input_not_an_internal_error(
    tiny_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model whose chat template calls a method jinja's sandbox forbids (transformers renders
    it in ImmutableSandboxedEnvironment; verify renders the prompt set's chats): exit 3 with one
    line that says what the template did and what to replace, no traceback, no verify report
    (before: "internal error: SecurityError", exit 1)."""
    (tiny_copy / "chat_template.jinja").write_text("{{ [].append(1) }}{{ messages[0].content }}")
    config = json.loads((tiny_copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tiny_copy / "tokenizer_config.json").write_text(json.dumps(config))
    code, _, err = _cli(capsys, "build", *_common(tiny_copy, tmp_path), "--dtype", "float32")
    assert code == 3, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "chat template tried to leave jinja's sandbox (SecurityError" in lines[0]
    assert "replace the template" in lines[0]
    assert not list((tmp_path / "engines").glob("*/*/*/reports/verify.json"))
