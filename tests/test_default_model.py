"""The README's main job, as a new user runs it: `trt-builder build --dtype int8` on the
embedded SmolLM2-135M-Instruct (a real trained model), then the same command again; and the
converter against nvidia-modelopt on that model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import build_default, compare_with_modelopt_config
from trt_builder.checkpoint.mapping import Mapping
from trt_builder.checkpoint.parallel import merge
from trt_builder.convert.floats import convert_checkpoint
from trt_builder.modes import FloatMode

pytestmark = pytest.mark.integration


def test_build_int8_on_the_default_model(default_build: tuple[Path, dict]) -> None:
    cwd, result = default_build
    assert result["model"] == "SmolLM2-135M-Instruct" and result["variant"] == "int8-sq-tp1-pp1"
    stages = {s["name"]: s for s in result["stages"]}
    assert [(s["name"], s["status"]) for s in result["stages"]] == [
        ("fetch", "ran"), ("calibrate", "ran"), ("recipe", "ran"), ("convert", "ran"),
        ("verify", "ran"),
        ("engine", "skipped"), ("package", "ran"),
    ]  # fmt: skip
    calibration = Path(stages["calibrate"]["output"])
    assert calibration.name == "bundled-64x256-seed0" and calibration.parent.name == "calibration"

    variant = cwd / "engines" / "SmolLM2-135M-Instruct" / result["revision"] / "int8-sq-tp1-pp1"
    config = json.loads((variant / "checkpoint" / "config.json").read_text())
    quant = config["quantization"]
    assert quant["quant_algo"] == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    recipe = json.loads((variant / "checkpoint" / "recipe.json").read_text())
    alphas = [c["alpha"] for c in recipe["candidates"]]
    assert alphas == [0.4, 0.5, 0.6, 0.7, 0.8, "per layer"]
    finalists = [c for c in recipe["candidates"] if c["windows"] == recipe["windows"] == 16]
    assert len(finalists) == 2 and recipe["device"] == "cpu"
    assert recipe["chosen"] == min(finalists, key=lambda c: c["kl"])["name"]
    assert quant["smoothquant_val"] == recipe["alpha"]
    assert sorted(recipe["alphas"]) == sorted(str(i) for i in range(30))
    assert quant["kv_cache_quant_algo"] is None
    assert config["rotary_base"] == 100000.0 and config["num_key_value_heads"] == 3
    weights = load_file(variant / "checkpoint" / "rank0.safetensors")
    linears = [k for k in weights if k.endswith(("qkv.weight", "dense.weight", "fc.weight",
                                                  "gate.weight", "proj.weight"))]  # fmt: skip
    assert len(linears) == 5 * 30 and all(weights[k].dtype == torch.int8 for k in linears)
    assert weights["lm_head.weight"].dtype == torch.float16  # every linear but lm_head in INT8

    report = json.loads((variant / "reports" / "verify.json").read_text())
    assert report["passed"] and report["quant_algo"] == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    assert report["recipe"] == recipe
    # the bar on held-out text: perplexity +1.5% at most, top-1 agreement 94% at least
    assert report["perplexity"]["delta_pct"] <= 1.5 and report["perplexity"]["top1"] >= 0.94
    chat = [p for p in report["prompts"] if "boiling point" in p["prompt"]]
    assert (
        chat and "100" in chat[0]["reference_text"]
    )  # a real model answers, so the check means something

    repo = cwd / "triton_repo" / f"smollm2-135m-instruct-{result['revision'][7:15]}-int8-sq-tp1-pp1"
    assert Path(result["triton_repository"]).resolve() == repo.resolve()
    assert sorted(p.parent.name for p in repo.glob("*/config.pbtxt")) == [
        "ensemble",
        "postprocessing",
        "preprocessing",
        "tensorrt_llm",
    ]
    assert stages["engine"]["details"]["reason"] == "skipped: TensorRT-LLM not installed"

    again = build_default(cwd)
    assert [s["status"] for s in again["stages"]] == [
        "cached",
        "cached",
        "cached",
        "cached",
        "cached",
        "skipped",
        "cached",
    ]


def test_smollm2_float16_is_bit_identical_to_modelopt_and_tp3_reassembles(
    default_build: tuple[Path, dict], tmp_path: Path
) -> None:
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    cwd, result = default_build
    hf = cwd / "engines" / "SmolLM2-135M-Instruct" / result["revision"] / "hf"
    (tmp_path / "ours").mkdir()
    convert_checkpoint(hf, tmp_path / "ours", FloatMode("float16"))
    ours = load_file(tmp_path / "ours" / "rank0.safetensors")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    export_tensorrt_llm_checkpoint(
        model,
        decoder_type="llama",
        dtype=torch.float16,
        export_dir=str(tmp_path / "mo"),
        inference_tensor_parallel=1,
    )
    theirs = load_file(tmp_path / "mo" / "rank0.safetensors")
    assert sorted(ours) == sorted(theirs) and len(ours) == 3 + 30 * 7
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    compare_with_modelopt_config(
        json.loads((tmp_path / "ours" / "config.json").read_text()),
        json.loads((tmp_path / "mo" / "config.json").read_text()),
        "llama",
    )

    (tmp_path / "tp3").mkdir()
    convert_checkpoint(hf, tmp_path / "tp3", FloatMode("float16"), tp=3)  # 9 heads, 3 KV heads
    config = json.loads((tmp_path / "tp3" / "config.json").read_text())
    merged = merge(
        [load_file(tmp_path / "tp3" / f"rank{r}.safetensors") for r in range(3)],
        Mapping.from_config(config),
    )
    assert all(torch.equal(merged[name], tensor) for name, tensor in ours.items())
