"""INT4 AWQ (W4A16) on tiny random Llamas: nvidia-modelopt 0.47's INT4_AWQ_CFG export, run by
the checkpoint runtime, computes what modelopt's own quantized model computes (the packing, the
group scales and the pre-quantization scale read as modelopt writes them for trtllm-build); our
checkpoint has modelopt's layout tensor for tensor; AWQ's scales lower the calibrated error; the
mode's refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trt_builder.calibrate.stats import calibrate
from trt_builder.checkpoint.int4 import pack_rows, unpack_rows
from trt_builder.convert.model import convert_model
from trt_builder.core.errors import ConversionError, SpecError
from trt_builder.modes import Int4Awq
from trt_builder.runtimes.checkpoint import CheckpointRuntime
from trt_builder.spec.build import CalibrationOptions, make_spec

pytestmark = pytest.mark.integration
IDS = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 300, 21]])
LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


@pytest.fixture(scope="module")
def calibrated(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibration")
    calibrate(tiny_llama, out, CalibrationOptions(samples=8, seq_len=64))
    return out


@pytest.fixture(scope="module")
def modelopt_export(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """modelopt's INT4_AWQ_CFG at group 64 (the tiny model's 64 channels take no 128) on the
    tiny Llama in float16, exported for trtllm-build: (its directory, its logits on IDS)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16)
    cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer":
            entry["cfg"]["block_sizes"][-1] = 64
            entry["cfg"]["block_sizes"].pop("-1", None)
    ids = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, cfg, forward_loop=lambda m: m(ids))
    out = tmp_path_factory.mktemp("modelopt-int4")
    export_tensorrt_llm_checkpoint(model, decoder_type="llama", dtype=torch.float16,
                                   export_dir=str(out), inference_tensor_parallel=1)  # fmt: skip
    with torch.no_grad():
        logits = model(IDS).logits.float()
    return out, logits


def test_the_runtime_computes_modelopts_int4_checkpoint_as_modelopt_does(
    modelopt_export: tuple, tiny_llama: Path
) -> None:
    """The checkpoint runtime reads modelopt's file (int8 bytes of two INT4 rows each, float32
    group scales, float16 pre-quantization scales) and its logits are modelopt's quantized
    model's, to float16 rounding: far closer than either is to the float model."""
    from transformers import AutoModelForCausalLM

    path, theirs = modelopt_export
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W4A16_AWQ"
    assert config["quantization"]["group_size"] == 64
    ours = CheckpointRuntime.load(path).forward(IDS).float()
    float_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        exact = float_model(IDS).logits
    rounding = (theirs - exact).abs().mean()
    assert (ours - theirs).abs().mean() < 0.05 * rounding, (ours - theirs).abs().mean()
    # a runtime that read the nibbles the other way round would not be close
    w = load_file(path / "rank0.safetensors")["transformer.layers.0.attention.qkv.weight"]
    swapped = pack_rows(unpack_rows(w)[torch.arange(w.shape[0] * 2) ^ 1])
    assert not torch.equal(swapped, w)


def test_our_checkpoint_has_modelopts_layout(
    modelopt_export: tuple, tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """Every tensor modelopt writes, ours writes with its dtype and shape; the quantization
    table's keys agree. Deliberate difference: exclude_modules lists the embedding too."""
    path, _ = modelopt_export
    ours = tmp_path / "ours"
    ours.mkdir()
    convert_model(Int4Awq(), tiny_llama, ours, tp=1, pp=1, calibration=calibrated)
    with safe_open(path / "rank0.safetensors", "pt") as f, safe_open(ours / "rank0.safetensors", "pt") as g:  # fmt: skip
        assert sorted(g.keys()) == sorted(f.keys())
        for name in f.keys():
            a, b = f.get_slice(name), g.get_slice(name)
            assert (b.get_dtype(), b.get_shape()) == (a.get_dtype(), a.get_shape()), name
    theirs_q = json.loads((path / "config.json").read_text())["quantization"]
    ours_q = json.loads((ours / "config.json").read_text())["quantization"]
    for key in (
        "quant_algo",
        "kv_cache_quant_algo",
        "group_size",
        "has_zero_point",
        "pre_quant_scale",
    ):
        assert ours_q[key] == theirs_q[key], key
    assert theirs_q["exclude_modules"] == ["lm_head"]
    assert ours_q["exclude_modules"] == ["lm_head", "transformer.vocab_embedding"]


def test_awq_scales_lower_the_calibrated_error_and_the_runtime_runs_them(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """The converter's summary: AWQ's chosen scales against plain rounding (alpha 0); the
    checkpoint's weights, as the runtime computes with them, are the float weights to INT4
    precision (within half a group step of W / p, times p)."""
    out = tmp_path / "ck"
    out.mkdir()
    summary = convert_model(Int4Awq(), tiny_llama, out, tp=1, pp=1, calibration=calibrated)
    assert summary["awq"]["group_size"] == 64
    assert 0 < summary["awq"]["error_vs_plain_rounding"] <= 1
    runtime = CheckpointRuntime.load(out)
    hf = load_file(tiny_llama / "model.safetensors")
    w = load_file(out / "rank0.safetensors")
    for linear, source in (("attention.dense", "self_attn.o_proj"), ("mlp.proj", "mlp.down_proj")):
        name = f"transformer.layers.0.{linear}"
        effective = runtime._dense[f"{name}.weight"] * w[f"{name}.prequant_scaling_factor"].float()
        original = hf[f"model.layers.0.{source}.weight"].half().float()
        step = w[f"{name}.weights_scaling_factor"].repeat_interleave(64, 1)
        step = step * w[f"{name}.prequant_scaling_factor"].float()
        assert bool(((effective - original).abs() <= 0.5 * step * 1.01 + 1e-3).all()), name
    logits = runtime.forward(IDS)
    assert bool(torch.isfinite(logits).all())


def test_refusals_name_the_fix(tiny_llama: Path, calibrated: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"--kv-cache int8: use --kv-cache fp8"):
        make_spec(dtype="int4-awq", kv_cache="int8")
    with pytest.raises(SpecError, match=r"use 64 or 128"):
        make_spec(dtype="int4-awq", **{"int4.group_size": 32})
    with pytest.raises(SpecError, match=r"use --target engine"):
        make_spec(dtype="int4-awq", target="llmapi")
    (tmp_path / "ck").mkdir()
    with pytest.raises(
        ConversionError,
        match=r"--group-size 128 does not fit .* multiples of 128 at --tp 1\): use --group-size 64",
    ):
        convert_model(Int4Awq(group_size=128), tiny_llama, tmp_path / "ck", tp=1, pp=1,
                      calibration=calibrated)  # fmt: skip
    assert list((tmp_path / "ck").iterdir()) == []
    with pytest.raises(ConversionError, match=r"multiples of 128 at --tp 2 .* use --dtype int8-wo"):
        convert_model(Int4Awq(), tiny_llama, tmp_path / "ck", tp=2, pp=1, calibration=calibrated)


def test_tensor_parallel_ranks_merge_back_into_the_single_rank_checkpoint(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A Llama of hidden 128 (TensorRT-LLM's multiple of 64 x tp at tp 2), group 64 (128 fits
    tp 1 alone), at tp 2: each rank
    holds its rows of qkv, fc and gate and its columns of dense and proj, with their group
    scales, dense's and proj's pre-quantization scales split with their columns, the INT4 rows
    packed per rank; merged, the ranks are the tp 1 checkpoint bit for bit, and the runtime
    gives its logits."""
    from tiny_models import make_tiny_llama

    hf = tmp_path / "hf"
    make_tiny_llama(hf, tokenizer_dir, hidden_size=128, intermediate_size=256)
    calibration = tmp_path / "cal"
    calibration.mkdir()
    calibrate(hf, calibration, CalibrationOptions(samples=4, seq_len=32))
    for tp in (1, 2):
        (tmp_path / f"tp{tp}").mkdir()
        convert_model(Int4Awq(group_size=64), hf, tmp_path / f"tp{tp}", tp=tp, pp=1,
                      calibration=calibration)  # fmt: skip
    one = load_file(tmp_path / "tp1" / "rank0.safetensors")
    ranks = [load_file(tmp_path / "tp2" / f"rank{r}.safetensors") for r in (0, 1)]
    dense = "transformer.layers.0.attention.dense"
    assert ranks[0][f"{dense}.weight"].shape == (64, 64)  # [out / 2, in / 2]: packed, split
    assert ranks[0][f"{dense}.weights_scaling_factor"].shape == (128, 1)
    assert torch.equal(ranks[1][f"{dense}.prequant_scaling_factor"],
                       one[f"{dense}.prequant_scaling_factor"][64:])  # fmt: skip
    qkv = "transformer.layers.0.attention.qkv"
    assert ranks[0][f"{qkv}.weight"].shape == (64, 128)  # [(64 + 2 x 32) / 2, 128]
    assert torch.equal(
        ranks[0][f"{qkv}.prequant_scaling_factor"], one[f"{qkv}.prequant_scaling_factor"]
    )
    from trt_builder.checkpoint.reader import read_checkpoint

    _, merged = read_checkpoint(tmp_path / "tp2")
    assert sorted(merged) == sorted(one)
    for name, tensor in one.items():
        assert torch.equal(merged[name], tensor), name
    assert torch.equal(CheckpointRuntime.load(tmp_path / "tp2").forward(IDS),
                       CheckpointRuntime.load(tmp_path / "tp1").forward(IDS))  # fmt: skip
