"""Every mode `trt-builder build` offers, built on the embedded default model as a user runs it
(`trt-builder build ... --json`, one process each, its own exit code) through verify and
package. The builds share the default build's directory, so one fetch, one calibration and one
recipe search per mode serve them all. A `--dtype`, `--kv-cache` or `--sq-granularity` choice
added to the CLI without a row here fails `test_the_matrix_covers_every_mode_the_cli_offers`."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from mode_matrix import MATRIX

from trt_builder.cli.main import cli
from trt_builder.spec.modes import KV_PPL_POINTS, checkpoint_mode, gate_for

pytestmark = pytest.mark.integration

#: The llmapi rows, each with the engine-target row whose checkpoint holds the same numbers
#: (None: int8-wo, whose INT8 values the llmapi checkpoint holds, rounded as modelopt's export
#: rounds them, where trtllm-build rounds the engine target's: docs/llmapi.md).
LLMAPI = {"float16-llmapi-tp1-pp1": "float16-tp1-pp1", "fp8-llmapi-tp1-pp1": "fp8-tp1-pp1",
          "fp8-fp8kv-llmapi-tp1-pp1": "fp8-fp8kv-tp1-pp1", "int8-wo-llmapi-tp1-pp1": None}  # fmt: skip
#: The INT8 KV cache's cost, in points of held-out perplexity, over the same build without it.
KV_CACHE_POINTS = 0.5


def _choices(name: str) -> set[str]:
    option = next(p for p in cli.commands["build"].params if p.name == name)
    assert isinstance(option.type, click.Choice)
    return set(option.type.choices)


def test_the_matrix_covers_every_mode_the_cli_offers() -> None:
    offered = {
        "dtype": _choices("dtype"),
        "kv_cache": _choices("kv_cache"),
        "sq_granularity": _choices("sq_granularity"),
        "target": _choices("target"),
    }
    built: dict[str, set[str]] = {key: set() for key in offered}
    for argv in MATRIX.values():
        flags = dict(zip(argv[::2], argv[1::2], strict=False))
        built["dtype"].add(flags["--dtype"])
        built["kv_cache"].add(flags.get("--kv-cache", "model"))
        built["target"].add(flags.get("--target", "engine"))
        if flags["--dtype"] == "int8":
            built["sq_granularity"].add(flags.get("--sq-granularity", "per-token"))
    assert built == offered
    assert any("--no-wo-clip" in argv for argv in MATRIX.values())
    assert any("--no-fp8-search" in argv for argv in MATRIX.values())
    assert any("--tp" in argv for argv in MATRIX.values())


def _build(cwd: Path, argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("trt-builder") or str(Path(sys.executable).with_name("trt-builder"))
    return subprocess.run([exe, "build", *argv, "--json"], cwd=cwd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def matrix(default_build: tuple[Path, dict[str, Any]]) -> Any:
    """Builds a row once, when a test first asks for it, in the default build's directory:
    variant -> (the process, its --json result)."""
    cwd, _ = default_build
    built: dict[str, tuple[subprocess.CompletedProcess[str], Any]] = {}

    def row(variant: str) -> tuple[subprocess.CompletedProcess[str], Any]:
        if variant not in built:
            proc = _build(cwd, MATRIX[variant])
            result = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else None
            built[variant] = (proc, result)
        return built[variant]

    return row


@pytest.mark.parametrize("variant", sorted(set(MATRIX) - set(LLMAPI)))
def test_every_mode_builds_through_verify_and_package(
    variant: str, matrix: Any, default_build: tuple[Path, dict[str, Any]]
) -> None:
    cwd, _ = default_build
    proc, result = matrix(variant)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["ok"] and result["variant"] == variant
    stages = {s["name"]: s for s in result["stages"]}
    assert stages["verify"]["status"] in ("ran", "cached") and stages["verify"]["details"]["passed"]
    assert stages["package"]["status"] in ("ran", "cached")
    assert stages["engine"]["details"]["reason"] == "skipped: TensorRT-LLM not installed"
    checkpoint = cwd / result["variant_dir"] / "checkpoint"
    report = json.loads((cwd / result["variant_dir"] / "reports" / "verify.json").read_text())
    # the documented gate of the mode the checkpoint holds, met figure by figure
    gate = gate_for(checkpoint_mode(checkpoint))
    assert report["passed"] and report["failures"] == [] and report["diagnosis"] == []
    assert report["top1"] >= gate.min_top1 and report["kl_mean"] <= gate.max_kl
    assert gate.max_ppl_delta_pct is not None
    assert report["perplexity"]["delta_pct"] <= gate.max_ppl_delta_pct
    repo = cwd / result["triton_repository"]
    assert sorted(p.parent.name for p in repo.glob("*/config.pbtxt")) == [
        "ensemble", "postprocessing", "preprocessing", "tensorrt_llm",
    ]  # fmt: skip
    config = json.loads((checkpoint / "config.json").read_text())
    tp = int(dict(zip(MATRIX[variant][::2], MATRIX[variant][1::2], strict=False)).get("--tp", 1))
    assert config["mapping"]["tp_size"] == tp
    assert len(list(checkpoint.glob("rank*.safetensors"))) == tp
    kv = config["quantization"]["kv_cache_quant_algo"]
    assert (kv == "INT8") == ("-kv8" in variant) and (kv == "FP8") == ("-fp8kv" in variant)
    assert (report["perplexity"].get("decoded_from") is not None) == (kv is not None)
    if variant.startswith("fp8"):  # what trtllm-build's FP8 loader reads (convert/fp8.py)
        assert config["quantization"]["quant_algo"] == "FP8"
        assert config["quantization"]["exclude_modules"] == [
            "lm_head",
            "transformer.vocab_embedding",
        ]


@pytest.mark.parametrize("variant", sorted(LLMAPI))
def test_the_llmapi_target_builds_through_verify_and_package_with_the_engine_targets_numbers(
    variant: str, matrix: Any, default_build: tuple[Path, dict[str, Any]]
) -> None:
    """The default model --target llmapi: the Hugging Face checkpoint, no engine stage, the
    llmapi repository; verify passes the mode's gate, and its figures are those of the engine
    target's build of the same mode (the same weights and scales; the FP8 KV cache's scale 1.0
    in both here: the engine target's is never below 1.0, and SmolLM2's K and V stay under
    448), but for int8-wo, whose INT8 values the llmapi checkpoint holds itself."""
    cwd, _ = default_build
    proc, result = matrix(variant)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["ok"] and result["variant"] == variant
    stages = {s["name"]: s for s in result["stages"]}
    assert "engine" not in stages and stages["package"]["status"] in ("ran", "cached")
    checkpoint = cwd / result["variant_dir"] / "checkpoint"
    assert (checkpoint / "model.safetensors").is_file() and (
        checkpoint / "tokenizer.json"
    ).is_file()
    quantized = not variant.startswith("float16")
    assert (checkpoint / "hf_quant_config.json").is_file() == quantized
    report = json.loads((cwd / result["variant_dir"] / "reports" / "verify.json").read_text())
    gate = gate_for(checkpoint_mode(checkpoint))
    assert report["passed"] and report["top1"] >= gate.min_top1 and report["kl_mean"] <= gate.max_kl
    repo = cwd / result["triton_repository"]
    assert [p.parent.name for p in repo.glob("*/config.pbtxt")] == ["tensorrt_llm"]
    assert len(list(repo.glob("tensorrt_llm/*/model.yaml"))) == 1
    engine_row = LLMAPI[variant]
    if engine_row is None:
        return
    engine_proc, engine = matrix(engine_row)
    assert engine_proc.returncode == 0, engine_proc.stderr[-3000:]
    engine_report = json.loads(
        (cwd / engine["variant_dir"] / "reports" / "verify.json").read_text()
    )
    for key in ("top1", "kl_mean", "greedy_agreement"):
        assert report[key] == engine_report[key], key
    assert report["perplexity"]["delta_pct"] == engine_report["perplexity"]["delta_pct"]


@pytest.mark.parametrize(
    "with_cache, without", [("int8-sq-kv8-tp1-pp1", "int8-sq-tp1-pp1"),
                            ("int8-wo-kv8-tp1-pp1", "int8-wo-tp1-pp1"),
                            ("float16-kv8-tp1-pp1", "float16-tp1-pp1"),
                            ("fp8-fp8kv-tp1-pp1", "fp8-tp1-pp1"),
                            ("float16-fp8kv-tp1-pp1", "float16-tp1-pp1")]
)  # fmt: skip
def test_a_quantized_kv_cache_costs_at_most_its_budget_of_perplexity(
    with_cache: str, without: str, matrix: Any, default_build: tuple[Path, Any]
) -> None:
    """The cache's cost, decoded on verify's held-out windows: the build with the KV cache
    (its verify report) against the same build without it, decoded the same way."""
    from trt_builder.calibrate.corpus import corpus_windows
    from trt_builder.runtimes.checkpoint import CheckpointRuntime
    from trt_builder.source.hf import load_hf_model, load_tokenizer
    from trt_builder.verify.compare import perplexity

    cwd, _ = default_build
    (proc, cached), (plain_proc, plain_build) = matrix(with_cache), matrix(without)
    assert proc.returncode == 0 and plain_proc.returncode == 0, proc.stderr + plain_proc.stderr
    report = json.loads((cwd / cached["variant_dir"] / "reports" / "verify.json").read_text())
    ppl = report["perplexity"]
    hf = cwd / report["reference"]
    windows = corpus_windows(load_tokenizer(hf, "the model"), ppl["tokens"])
    reference = load_hf_model(hf).eval()
    candidate = CheckpointRuntime.load(cwd / plain_build["variant_dir"] / "checkpoint")
    plain = perplexity(
        reference, candidate, windows, device="cpu", decoded_from=ppl["decoded_from"]
    )
    assert plain["tokens"] == ppl["tokens"] and math.isclose(plain["reference"], ppl["reference"])
    cost = ppl["delta_pct"] - plain["delta_pct"]
    budget = KV_PPL_POINTS["fp8"] if "-fp8kv" in with_cache else KV_CACHE_POINTS
    assert cost <= budget, (with_cache, ppl["delta_pct"], plain["delta_pct"])


def test_a_split_the_default_model_cannot_take_is_refused_before_any_work(
    default_build: tuple[Path, dict[str, Any]],
) -> None:
    """Bad input still gets one line and its exit code, and no checkpoint, whole or partial, is
    written (the variant keeps the manifest of the fetch that ran before the refusal)."""
    cwd, result = default_build
    proc = _build(cwd, ("--dtype", "int8", "--tp", "2"))
    why = (
        "--tp 2 does not divide this model (9 attention heads, 3 KV heads, intermediate size "
        "1536): use one of 1, 3"
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"error: {why}"]
    assert json.loads(proc.stdout) == {"ok": False, "error": why, "exit_code": 2}
    variant = cwd / "engines" / "SmolLM2-135M-Instruct" / result["revision"] / "int8-sq-tp2-pp1"
    assert not (variant / "checkpoint").exists() and not list(variant.glob(".checkpoint.tmp-*"))
    assert not list((cwd / "triton_repo").glob("*tp2*"))
