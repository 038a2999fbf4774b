"""The engine stage: the exact trtllm-build command, run through a stand-in executable here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from trt_builder.convert import plan as convert_plan
from trt_builder.convert.stage import ConvertStage
from trt_builder.core.errors import EngineError
from trt_builder.engine.build import EXECUTABLE_ENV, UNPLANNED, build_command, run_build
from trt_builder.pipeline.build import BuildResult, run
from trt_builder.spec.build import make_spec

STAND_IN = Path(__file__).parent / "standins" / "trtllm-build"


def _record(result: BuildResult, name: str) -> Any:
    return next(r for r in result.records if r.name == name)


def _spec(model: Path, tmp_path: Path, **kw: Any) -> Any:
    return make_spec(
        model=str(model),
        dtype="float32",
        out=tmp_path / "engines",
        triton_root=tmp_path / "triton",
        **kw,
    )


def test_command_has_gemm_plugin_and_limits(tmp_path: Path) -> None:
    spec = make_spec(
        **{"limits.max_batch_size": 4, "limits.max_seq_len": 512, "limits.max_input_len": 256}
    )
    argv = build_command(spec, tmp_path / "ck", tmp_path / "eng")
    flags = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert argv[0] == "trtllm-build"
    assert flags["--gemm_plugin"] == "auto" and flags["--gpt_attention_plugin"] == "auto"
    assert flags["--checkpoint_dir"] == str(tmp_path / "ck")
    assert flags["--output_dir"] == str(tmp_path / "eng")
    assert (flags["--max_batch_size"], flags["--max_seq_len"], flags["--max_input_len"]) == (
        "4",
        "512",
        "256",
    )
    assert flags["--kv_cache_type"] == "paged" and flags["--workers"] == "1"
    # limits left to the memory plan: the command says so until the plan has the model's config
    unplanned = dict(
        zip(*[iter(build_command(make_spec(), tmp_path, tmp_path)[1:])] * 2, strict=True)
    )
    assert unplanned["--max_batch_size"] == unplanned["--max_num_tokens"] == UNPLANNED
    assert unplanned["--max_seq_len"] == "2048"


def test_gemm_plugin_choice_must_match_the_activations(tmp_path: Path) -> None:
    from trt_builder.core.errors import SpecError
    from trt_builder.engine.build import check_gemm_plugin

    spec = make_spec(dtype="bfloat16", **{"engine.gemm_plugin": "bfloat16"})
    assert "--gemm_plugin bfloat16" in " ".join(build_command(spec, tmp_path, tmp_path))
    with pytest.raises(
        SpecError, match="--gemm-plugin float16 does not match the bfloat16 .* auto"
    ):
        make_spec(dtype="bfloat16", **{"engine.gemm_plugin": "float16"})
    with pytest.raises(SpecError, match="does not match the float32 activations"):
        make_spec(dtype="float32", **{"engine.gemm_plugin": "float16"})
    make_spec(dtype="int8", **{"engine.gemm_plugin": "float16"})  # int8 activations come from fp16
    with pytest.raises(SpecError, match="engine.gemm_plugin 'int8' is not one of auto"):
        make_spec(**{"engine.gemm_plugin": "int8"})
    # --dtype auto: known from the checkpoint only, checked by the engine stage before the build
    make_spec(dtype="auto", **{"engine.gemm_plugin": "float16"})
    check_gemm_plugin("float16", "float16")
    check_gemm_plugin("auto", "bfloat16")
    with pytest.raises(EngineError, match="does not match the checkpoint's bfloat16 activations"):
        check_gemm_plugin("float16", "bfloat16")


def test_build_timeout_takes_durations() -> None:
    from trt_builder.cli.options import DURATION

    assert [DURATION.convert(v, None, None) for v in ("90m", "4h", "600", "45s", 30)] == [
        5400,
        14400,
        600,
        45,
        30,
    ]
    with pytest.raises(Exception, match="is not a duration"):
        DURATION.convert("soon", None, None)
    assert make_spec(**{"engine.timeout_s": 5400}).engine.timeout_s == 5400


def _checkpoint(tmp_path: Path) -> list[str]:
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text("{}")
    spec = make_spec(**{"limits.max_batch_size": 4, "limits.max_num_tokens": 1024})
    return build_command(spec, tmp_path / "ck", tmp_path / "eng", executable=str(STAND_IN))


def test_phases_stream_to_the_callback_and_the_log(tmp_path: Path) -> None:
    argv = _checkpoint(tmp_path)
    seen: list[str] = []
    build = run_build(argv, tmp_path / "build.log", on_phase=seen.append)
    assert seen == [
        "reading the checkpoint and flags",
        "constructing the network",
        "TensorRT is optimizing the engine (the longest phase)",
        "engine generated in 0.01 s",
        "writing rank0.engine",
        "all ranks built",
    ]
    assert [phase for phase, _ in build.phases] == seen
    assert all(b >= a for (_, a), (_, b) in zip(build.phases, build.phases[1:], strict=False))
    assert "Build TensorRT engine" in (tmp_path / "build.log").read_text()


def test_failed_build_quotes_the_last_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = _checkpoint(tmp_path)
    monkeypatch.setenv("FAKE_TRTLLM_FAIL", "1")
    with pytest.raises(
        EngineError, match=r"exited with 3; last lines: .*out of memory while building layer 7"
    ):
        run_build(argv, tmp_path / "build.log")
    assert "out of memory" in (tmp_path / "build.log").read_text()


def test_silent_hang_meets_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = _checkpoint(tmp_path)
    monkeypatch.setenv("FAKE_TRTLLM_HANG", "1")
    with pytest.raises(
        EngineError,
        match=r"ran past 2 s \(TensorRT is optimizing the engine .*\) and was stopped; raise "
        r"--build-timeout",
    ):
        run_build(argv, tmp_path / "build.log", timeout_s=2)


@pytest.mark.integration
def test_stage_runs_the_executable_and_package_includes_the_engine(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EXECUTABLE_ENV, str(STAND_IN))
    result = run(_spec(tiny_llama, tmp_path))
    engine = _record(result, "engine")
    assert engine.status == "ran" and engine.details["executable"] == str(STAND_IN)
    assert "--gemm_plugin auto" in engine.details["command"]
    assert engine.details["executed"].startswith(str(STAND_IN))  # what really ran, temp dir and all
    assert (result.layout.engine / "rank0.engine").read_bytes().startswith(b"STAND-IN")
    assert _record(result, "package").details["engine_included"] is True
    assert (result.layout.triton / "tensorrt_llm" / "1" / "engine" / "rank0.engine").is_file()
    manifest = json.loads(result.layout.manifest.read_text())
    assert manifest["stages"]["engine"]["outputs"].keys() >= {"rank0.engine", "config.json"}
    # the limits the spec left open come from the memory plan, into the command, the engine
    # and the Triton repository alike
    memory = engine.details["memory_plan"]
    batch, tokens = memory["limits"]["max_batch_size"], memory["limits"]["max_num_tokens"]
    assert batch == memory["proposed_max_batch_size"] == 256  # a tiny model: the cap
    assert (
        tokens == 8192 and f"--max_batch_size {batch} --max_input_len" in engine.details["command"]
    )
    built = json.loads((result.layout.engine / "config.json").read_text())["build_config"]
    assert (built["max_batch_size"], built["max_num_tokens"]) == (batch, tokens)
    assert manifest["spec"]["limits"]["max_batch_size"] == batch
    assert (
        f"max_batch_size: {batch}"
        in (result.layout.triton / "tensorrt_llm" / "config.pbtxt").read_text()
    )
    assert [p["phase"] for p in engine.details["phases"]][-2:] == [
        "writing rank0.engine",
        "all ranks built",
    ]
    # nothing changed: a dry run finds every stage cached, the engine's key included
    again = run(_spec(tiny_llama, tmp_path), dry_run=True)
    assert {r.name: r.status for r in again.records}["engine"] == "cached"


@pytest.mark.integration
def test_the_engine_manifest_is_checked_before_packaging(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trt_builder.core.digests import sha256_file
    from trt_builder.engine import build as engine_module
    from trt_builder.engine.build import MANIFEST, check_engine

    monkeypatch.setenv(EXECUTABLE_ENV, str(STAND_IN))
    result = run(_spec(tiny_llama, tmp_path))
    engine = result.layout.engine
    manifest = json.loads((engine / MANIFEST).read_text())
    assert manifest["files"]["rank0.engine"] == sha256_file(engine / "rank0.engine")
    assert manifest["argv"][:2] == ["--checkpoint_dir", str(result.layout.checkpoint.resolve())]
    assert len(manifest["checkpoint_digest"]) == 64 and manifest["tensorrt_llm"] == "absent"
    assert check_engine(engine, digest=sha256_file) is None

    # another TensorRT here than at the build: refused, saying to rebuild
    built = dict(manifest, tensorrt="10.10.0.31")
    (engine / MANIFEST).write_text(json.dumps(built))
    monkeypatch.setattr(
        engine_module, "tool_version", lambda name: "10.11.0.33" if name == "tensorrt" else "absent"
    )
    with pytest.raises(
        EngineError, match=r"built with tensorrt 10.10.0.31, this host has 10.11.0.33: rebuild"
    ):
        check_engine(engine, digest=sha256_file)
    # a GPU of another SM
    (engine / MANIFEST).write_text(json.dumps(dict(manifest, sm=[80])))
    h100 = {"name": "NVIDIA H100 80GB HBM3", "sm": 90, "memory_mib": 81559, "driver": "575.57.08"}
    monkeypatch.setattr(engine_module, "gpu_info", lambda: [h100])
    with pytest.raises(EngineError, match=r"built on SM 80, this host's GPUs are SM 90"):
        check_engine(engine, digest=sha256_file)
    (engine / MANIFEST).write_text(json.dumps(manifest))
    assert check_engine(engine, digest=sha256_file) is None

    # an engine file changed after the build: package refuses it
    with open(engine / "rank0.engine", "ab") as f:
        f.write(b"x")
    with pytest.raises(EngineError, match="rank0.engine no longer matches its digest.*rebuild"):
        run(_spec(tiny_llama, tmp_path), only=("package",), force=True)
    # an engine built by hand (no manifest) still ships, with a note
    (engine / MANIFEST).unlink()
    again = run(_spec(tiny_llama, tmp_path), only=("package",), force=True)
    assert any("not checked" in n for n in again.notices)


@pytest.mark.integration
def test_engine_from_an_older_checkpoint_is_not_packaged(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EXECUTABLE_ENV, str(STAND_IN))
    assert _record(run(_spec(tiny_llama, tmp_path)), "engine").status == "ran"

    # The converter changes (a new field) and TensorRT-LLM is gone: the checkpoint is rebuilt,
    # the engine cannot be, and the old engine must not ship with the new checkpoint.
    monkeypatch.delenv(EXECUTABLE_ENV)
    original = convert_plan.trtllm_config
    monkeypatch.setattr(
        convert_plan,
        "trtllm_config",
        lambda *a, **k: {**original(*a, **k), "residual_mlp": False},
    )
    monkeypatch.setattr(ConvertStage, "version", 2)
    result = run(_spec(tiny_llama, tmp_path))
    statuses = {r.name: r.status for r in result.records}
    assert statuses["convert"] == "ran" and statuses["engine"] == "skipped"
    assert (result.layout.engine / "rank0.engine").is_file()  # the user's engine is kept ...
    assert _record(result, "package").details["engine_included"] is False  # ... but not shipped
    assert any("built from another checkpoint" in n for n in result.notices)
    version = _record(result, "package").details["version"]
    assert version == 2 and (result.layout.triton / "tensorrt_llm" / "2").is_dir()
    assert not (result.layout.triton / "tensorrt_llm" / "2" / "engine").exists()


@pytest.mark.integration
def test_hand_built_engine_is_packaged_only_when_it_matches(
    tiny_llama: Path, tmp_path: Path
) -> None:
    result = run(_spec(tiny_llama, tmp_path))
    checkpoint = json.loads((result.layout.checkpoint / "config.json").read_text())
    engine = result.layout.engine
    engine.mkdir()
    (engine / "rank0.engine").write_bytes(b"hand-built")
    build = {"max_batch_size": 2, "max_input_len": 100, "max_seq_len": 200, "max_num_tokens": 400,
             "max_beam_width": 1, "kv_cache_type": "PAGED",
             "plugin_config": {"use_paged_context_fmha": True}}  # fmt: skip
    (engine / "config.json").write_text(
        json.dumps(
            {"pretrained_config": {**checkpoint, "hidden_size": 4096}, "build_config": build}
        )
    )
    assert _record(run(_spec(tiny_llama, tmp_path)), "package").details["engine_included"] is False
    (engine / "config.json").write_text(
        json.dumps({"pretrained_config": checkpoint, "build_config": build})
    )
    package = _record(run(_spec(tiny_llama, tmp_path)), "package")
    assert package.status == "ran" and package.details["engine_included"] is True
    # the repository takes the engine's own limits, not the spec's
    llm = (result.layout.triton / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "max_batch_size: 2" in llm and 'string_value: "200"' not in llm
    pre = (result.layout.triton / "preprocessing" / "config.pbtxt").read_text()
    assert 'key: "max_input_len"\n  value {\n    string_value: "100"' in pre


@pytest.mark.integration
def test_failed_build_leaves_no_engine_dir(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EXECUTABLE_ENV, str(STAND_IN))
    monkeypatch.setenv("FAKE_TRTLLM_FAIL", "1")
    with pytest.raises(EngineError, match="out of memory"):
        run(_spec(tiny_llama, tmp_path))
    variant = next((tmp_path / "engines").glob("*/*/float32-tp1-pp1"))
    assert not (variant / "engine").exists()
    assert not [p for p in variant.iterdir() if p.name.startswith(".engine.tmp-")]


@pytest.mark.integration
def test_partial_output_is_discarded_and_the_rerun_succeeds(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EXECUTABLE_ENV, str(STAND_IN))
    monkeypatch.setenv("FAKE_TRTLLM_FAIL", "partial")  # half an engine written, then exit 3
    with pytest.raises(EngineError, match=r"exited with 3; last lines: .*out of memory"):
        run(_spec(tiny_llama, tmp_path))
    variant = next((tmp_path / "engines").glob("*/*/float32-tp1-pp1"))
    assert not (variant / "engine").exists()
    assert not [p for p in variant.iterdir() if p.name.startswith(".engine.tmp-")]
    assert "Build TensorRT engine" in (variant / "engine-build.log").read_text()
    monkeypatch.delenv("FAKE_TRTLLM_FAIL")
    result = run(_spec(tiny_llama, tmp_path))
    statuses = {r.name: r.status for r in result.records}
    assert statuses["convert"] == "cached" and statuses["engine"] == "ran"
    assert (variant / "engine" / "rank0.engine").read_bytes().startswith(b"STAND-IN ENGINE: not")


@pytest.mark.integration
def test_the_build_timeout_comes_from_the_spec(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EXECUTABLE_ENV, str(STAND_IN))
    monkeypatch.setenv("FAKE_TRTLLM_HANG", "1")
    phases: list[object] = []
    with pytest.raises(EngineError, match=r"ran past 2 s \(TensorRT is optimizing"):
        run(
            _spec(tiny_llama, tmp_path, **{"engine.timeout_s": 2}),
            listener=lambda event, name, text: phases.append(text) if event == "progress" else None,
        )
    assert phases[-1] == "TensorRT is optimizing the engine (the longest phase)"
    variant = next((tmp_path / "engines").glob("*/*/float32-tp1-pp1"))
    assert not (variant / "engine").exists()


@pytest.mark.trtllm
@pytest.mark.gpu
def test_real_trtllm_build_on_tiny_model(tiny_llama: Path, tmp_path: Path) -> None:
    """On a GPU host with TensorRT-LLM: a real engine, whose config.json names the release."""
    result = run(
        _spec(tiny_llama, tmp_path, require_engine=True),
        only=("fetch", "convert", "verify", "engine"),
    )
    config = json.loads((result.layout.engine / "config.json").read_text())
    assert config["version"] != "stand-in"
    assert (result.layout.engine / "rank0.engine").stat().st_size > 1000
    assert _record(result, "engine").details["tensorrt_llm"] != "absent"


def test_qwen3_needs_tensorrt_llm_1_0() -> None:
    from trt_builder.engine.releases import check_release

    with pytest.raises(
        EngineError, match="Qwen3ForCausalLM engines need TensorRT-LLM >= 1.0, this host has 0.21.0"
    ):
        check_release("Qwen3ForCausalLM", "0.21.0")
    check_release("Qwen3ForCausalLM", "1.2.1")
    check_release("Qwen3ForCausalLM", "absent")  # a stand-in or unknown install: not refused
    check_release("LlamaForCausalLM", "0.20.0")


@pytest.mark.parametrize("version", ["0.20.0", "0.21.0", "1.0.0", "1.1.0", "1.2.1"])
@pytest.mark.parametrize(
    ("dtype", "kv_cache"),
    [("float16", "model"), ("bfloat16", "model"), ("int8-wo", "model"), ("int8", "model"),
     ("int8", "int8"), ("float16", "int8"), ("fp8", "model"), ("fp8", "fp8"),
     ("float16", "fp8")],
)  # fmt: skip
def test_flags_per_release_and_mode(
    tmp_path: Path, version: str, dtype: str, kv_cache: str
) -> None:
    from trt_builder.engine.releases import release_for

    release = release_for(version)
    spec = make_spec(dtype=dtype, kv_cache=kv_cache, tp=2)
    argv = build_command(spec, tmp_path / "ck", tmp_path / "eng", release=release)
    flags = dict(zip(argv[1::2], argv[2::2], strict=True))
    # built at all: no flag we pass is one this release rejects; and the guard holds for each
    for flag in flags:
        rejecting = dataclasses.replace(release, rejects=frozenset({flag}))
        with pytest.raises(EngineError, match=f"internal: {flag} is not accepted"):
            build_command(spec, tmp_path / "ck", tmp_path / "eng", release=rejecting)
    # SmoothQuant's plugins switch on from the checkpoint's quant_algo: no release takes a flag
    assert not any("smooth_quant" in f or "quantiz" in f for f in flags)
    # the builder turns paged context FMHA off for these itself: the command says so
    paged_off = kv_cache == "int8" or (kv_cache == "fp8" and dtype != "fp8")
    assert flags["--use_paged_context_fmha"] == ("disable" if paged_off else "enable")
    # FP8 context FMHA only with FP8 linears, and then on exactly with the FP8 KV cache
    assert flags.get("--use_fp8_context_fmha") == (
        None if dtype != "fp8" else "enable" if kv_cache == "fp8" else "disable"
    )
    assert flags["--tokens_per_block"] == "32" and flags["--workers"] == "2"
    assert flags["--gemm_plugin"] == "auto" and flags["--context_fmha"] == "enable"


def test_unpinned_releases_are_refused() -> None:
    from trt_builder.engine.releases import check_release, release_for

    assert release_for("1.2.0rc8").version == "1.2" and release_for("0.21.0").tensorrt == "10.11"
    for version in ("0.19.0", "1.3.0", "2.0.0"):
        with pytest.raises(EngineError, match=r"not a pinned release .* tensorrt-llm>=0.20,<1.3"):
            check_release("LlamaForCausalLM", version)
