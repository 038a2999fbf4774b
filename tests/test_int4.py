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


@pytest.fixture(scope="module")
def modelopt_unified(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """modelopt's INT4_AWQ_CFG at group 64 exported in its unified Hugging Face format (what
    TensorRT-LLM's PyTorch backend loads): (its directory, its logits on IDS)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16)
    cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer":
            entry["cfg"]["block_sizes"][-1] = 64
            entry["cfg"]["block_sizes"].pop("-1", None)
    ids = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, cfg, forward_loop=lambda m: m(ids))
    # the export's first step, run first so that the logits are of the model it writes: q/k/v's
    # and gate/up's scales averaged, the weights requantized, the scale folded into the norms
    requantize_resmooth_fused_llm_layers(model)
    with torch.no_grad():
        logits = model(IDS).logits.float()
    out = tmp_path_factory.mktemp("modelopt-int4-hf")
    export_hf_checkpoint(model, export_dir=str(out))
    return out, logits


def _headers(directory: Path) -> dict[str, tuple[str, list[int]]]:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118
                found[name] = (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape())
    return found


def test_the_runtime_computes_modelopts_unified_int4_checkpoint_as_modelopt_does(
    modelopt_unified: tuple, tiny_llama: Path
) -> None:
    """read_unified takes modelopt's unified W4A16_AWQ checkpoint as TensorRT-LLM's PyTorch
    backend does (q/k/v and gate/up scales folded into the norms, o_proj's and down_proj's
    pre_quant_scale applied, uint8 pairs of rows) and its logits are modelopt's quantized
    model's, far closer than either is to the float model."""
    from transformers import AutoModelForCausalLM

    from trt_builder.runtimes.checkpoint import CheckpointRuntime as Runtime
    from trt_builder.targets.llmapi.checkpoint.unified import read_unified

    path, theirs = modelopt_unified
    headers = _headers(path)
    assert headers["model.layers.0.self_attn.q_proj.weight"][0] == "U8"
    assert "model.layers.0.self_attn.q_proj.pre_quant_scale" not in headers
    assert "model.layers.0.self_attn.o_proj.pre_quant_scale" in headers
    ours = Runtime(*read_unified(path)).forward(IDS).float()
    float_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        exact = float_model(IDS).logits
    rounding = (theirs - exact).abs().mean()
    assert (ours - theirs).abs().mean() < 0.05 * rounding, (ours - theirs).abs().mean()


def test_our_llmapi_checkpoint_has_modelopts_unified_layout_and_runs_as_the_engine_ones(
    modelopt_unified: tuple, tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """The llmapi target's W4A16_AWQ checkpoint has every tensor of modelopt's unified export,
    with its dtype and shape (q/k/v and gate/up without pre_quant_scale: folded into the norms;
    o_proj and down_proj with theirs), hf_quant_config.json's keys and values but the
    producer, and the loaders' check passes (the conversion runs it: TensorRT-LLM 1.0-1.2
    load it, vLLM is said to refuse W4A16_AWQ). Its logits are the engine checkpoint's, to
    the rounding of the folded norms."""
    from transformers import AutoModelForCausalLM

    from trt_builder.targets.llmapi.checkpoint.unified import read_unified
    from trt_builder.targets.llmapi.convert import convert_llmapi

    path, _ = modelopt_unified
    hf, engine = tmp_path / "hf", tmp_path / "engine"
    hf.mkdir(), engine.mkdir()
    summary = convert_llmapi(Int4Awq(), tiny_llama, hf, calibration=calibrated, recipe=None)
    assert summary["loaders"] == ["tensorrt-llm 1.0", "tensorrt-llm 1.1", "tensorrt-llm 1.2"]
    assert any("vllm 0.10-0.34 refuse W4A16_AWQ: for vLLM, build --dtype fp8" in n
               for n in summary["notes"])  # fmt: skip
    theirs, ours = _headers(path), _headers(hf)
    assert sorted(ours) == sorted(theirs)
    for name, got in theirs.items():
        assert ours[name] == got, name
    quant = json.loads((hf / "hf_quant_config.json").read_text())["quantization"]
    their_quant = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert quant == their_quant
    convert_model(Int4Awq(), tiny_llama, engine, tp=1, pp=1, calibration=calibrated)
    # the engine checkpoint's tensors bit for bit, but the norms and the scales folded into them
    _, read_back = read_unified(hf)
    written = load_file(engine / "rank0.safetensors")
    folded = ("layernorm.weight", "qkv.prequant_scaling_factor", "fc.prequant_scaling_factor",
              "gate.prequant_scaling_factor")  # fmt: skip
    assert sorted(n for n in written if not n.endswith(folded)) == sorted(
        n for n in read_back if not n.endswith(folded)
    )
    for name in [n for n in written if not n.endswith(folded)]:
        assert torch.equal(read_back[name], written[name]), name
    from_hf = CheckpointRuntime(*read_unified(hf)).forward(IDS)
    from_engine = CheckpointRuntime.load(engine).forward(IDS)
    float_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        exact = float_model(IDS).logits
    quantization = (from_engine - exact).abs().mean()
    assert (from_hf - from_engine).abs().mean() < 0.02 * quantization  # 0.45% measured


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


def test_compensated_rounding_lowers_the_gemm_error_at_the_same_group_scales() -> None:
    """GPTQ's update at fixed group scales: every value stays in -8..7 at convert's own group
    scales, and the GEMM's output error on correlated inputs, tr(dW H dW^T), is lower than
    round-to-nearest's for every weight of the batch."""
    from trt_builder.checkpoint.int4 import group_scales, quantize_groups
    from trt_builder.modes.int4_awq.recipe.rounding import compensated_int4

    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(3, 32, 128, generator=gen)
    mixing = torch.eye(128) + torch.randn(128, 128, generator=gen) / 4  # correlated channels
    x = torch.randn(2048, 128, generator=gen) @ mixing
    h = (x.T @ x).double()
    scales = torch.stack([group_scales(w, 64) for w in weights])
    nearest = torch.stack([quantize_groups(w, s) for w, s in zip(weights, scales, strict=True)])
    compensated = compensated_int4(weights, h.expand(3, -1, -1), scales)
    assert compensated.dtype == torch.int8 and int(compensated.min()) >= -8
    assert int(compensated.max()) <= 7

    def error(values: torch.Tensor) -> torch.Tensor:
        delta = weights.double() - values.double() * scales.double().repeat_interleave(64, 2)
        return torch.einsum("bni,ij,bnj->b", delta, h, delta)

    assert bool((error(compensated) < 0.9 * error(nearest)).all()), (
        error(compensated),
        error(nearest),
    )


def test_clipped_group_scales_lower_each_groups_output_error_on_heavy_tailed_weights() -> None:
    """AWQ's clip search, scored with the input Hessian's diagonal blocks: on weights with
    heavy tails (Student-t, as trained weights have) most groups take a ratio below 1, no
    group's error d H_gg d^T is above absmax's, and the whole error is lower."""
    from trt_builder.checkpoint.int4 import dequantize, group_scales, quantize_groups
    from trt_builder.modes.int4_awq.recipe.clipping import clipped_scales

    gen = torch.Generator().manual_seed(0)
    heavy = torch.distributions.StudentT(3.0).sample((64, 256))
    mixing = torch.eye(256) + torch.randn(256, 256, generator=gen) / 8
    x = torch.randn(4096, 256, generator=gen) @ mixing
    h = x.T @ x
    plain, clipped = group_scales(heavy, 64), clipped_scales(heavy, h, 64, torch.float16)

    def group_errors(scales: torch.Tensor) -> torch.Tensor:
        d = (heavy - dequantize(quantize_groups(heavy, scales), scales, torch.float16)).double()
        d = d.reshape(64, 4, 64)
        blocks = h.double().reshape(4, 64, 4, 64).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
        return torch.einsum("rgi,gij,rgj->rg", d, blocks, d)

    assert float((clipped < plain).double().mean()) > 0.5
    assert bool((group_errors(clipped) <= group_errors(plain) * (1 + 1e-6)).all())
    assert float(group_errors(clipped).sum()) < 0.9 * float(group_errors(plain).sum())


def test_the_search_scores_its_candidates_and_convert_writes_what_it_chose(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """The recipe: each candidate scored with standard errors, the choice one of them, an alpha
    (or none) for every quantized GEMM, fc and gate alike; convert writes the recipe's alphas
    and, unless convert's own "awq" is chosen, its INT4 values and (clipped) group scales bit
    for bit; a recipe of other weights, or made at another group size, is refused."""
    from safetensors.torch import save_file

    from trt_builder.modes.int4_awq.recipe.search import WEIGHTS, search_int4
    from trt_builder.modes.int4_awq.spec import Int4SearchSet

    found, tensors = search_int4(tiny_llama, calibrated, Int4SearchSet(tokens=1024, fit_tokens=1024),
                                 device="cpu", offload=tmp_path / "offload")  # fmt: skip
    assert [c["name"] for c in found["candidates"]] == ["awq", "hessian", "compensated"]
    assert all(c["kl"] > 0 and c["kl_se"] > 0 for c in found["candidates"])
    assert found["chosen"] in ("awq", "hessian", "compensated") and found["group_size"] == 64
    alphas = found["alphas"]
    assert len(alphas) == 2 * 5  # two layers: qkv, dense, fc, gate, proj
    for i in range(2):
        assert (
            alphas[f"transformer.layers.{i}.mlp.fc.weight"]
            == alphas[f"transformer.layers.{i}.mlp.gate.weight"]
        )
    recipe = tmp_path / "recipe"
    recipe.mkdir()
    if tensors:
        save_file(tensors, str(recipe / WEIGHTS))
    (recipe / "recipe.json").write_text(json.dumps(found))
    out = tmp_path / "ck"
    out.mkdir()
    summary = convert_model(Int4Awq(), tiny_llama, out, tp=1, pp=1, calibration=calibrated,
                            recipe=recipe / "recipe.json")  # fmt: skip
    assert summary["recipe"]["chosen"] == found["chosen"]
    written = load_file(out / "rank0.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(written[name], tensor), name
    assert bool(torch.isfinite(CheckpointRuntime.load(out).forward(IDS)).all())
    if tensors:  # a scale no clip ratio of these weights gives: a recipe of other weights
        name = "transformer.layers.1.mlp.proj.weights_scaling_factor"
        save_file({**tensors, name: tensors[name] * 0.5}, str(recipe / WEIGHTS))
        (tmp_path / "tampered").mkdir()
        with pytest.raises(ConversionError, match=r"mlp\.proj\.weight was made from other weights"):
            convert_model(Int4Awq(), tiny_llama, tmp_path / "tampered", tp=1, pp=1,
                          calibration=calibrated, recipe=recipe / "recipe.json")  # fmt: skip
    found["group_size"] = 128
    (recipe / "recipe.json").write_text(json.dumps(found))
    (tmp_path / "other").mkdir()
    with pytest.raises(ConversionError, match=r"searched at group size 128.*--group-size 64"):
        convert_model(Int4Awq(), tiny_llama, tmp_path / "other", tp=1, pp=1,
                      calibration=calibrated, recipe=recipe / "recipe.json")  # fmt: skip
