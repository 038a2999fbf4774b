"""W4A8 AWQ on tiny random Llamas: the padded twin computes what the model computes (transformers
runs both); nvidia-modelopt 0.47's W4A8_AWQ_BETA_CFG export, run by the checkpoint runtime,
computes what modelopt's own quantized model computes; our checkpoint has modelopt's layout
tensor for tensor and its FP8 scalars mean what modelopt's mean; the mode's refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tiny_models import make_tiny_llama
from trt_builder.calibrate.stats import calibrate
from trt_builder.checkpoint.fp8 import to_e4m3
from trt_builder.checkpoint.int4 import unpack_rows
from trt_builder.checkpoint.w4a8 import fp8_weight, w4a8_input
from trt_builder.convert.model import convert_model
from trt_builder.core.errors import SpecError
from trt_builder.modes import W4a8Awq
from trt_builder.runtimes.checkpoint import CheckpointRuntime
from trt_builder.source.padding import Twin
from trt_builder.source.twin import write_twin
from trt_builder.spec.build import CalibrationOptions, make_spec

pytestmark = pytest.mark.integration
IDS = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 300, 21]])
LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
#: A tiny Llama whose widths are multiples of 128, as W4A8 needs (qkv (4 + 2 x 2) x 32 = 256).
ALIGNED = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=256)  # fmt: skip


def _logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits.float()


def test_the_padded_twin_computes_what_the_model_computes(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    model = tmp_path / "model"
    # 6 heads of 32 over 2 groups: 192 wide, not a multiple of 128; the twin adds two groups
    make_tiny_llama(model, tokenizer_dir, hidden_size=192, num_attention_heads=6,
                    num_key_value_heads=2, intermediate_size=160)  # fmt: skip
    config = json.loads((model / "config.json").read_text())
    twin = Twin.of(config, 128, "test")
    assert twin is not None
    assert (twin.to_hidden, twin.to_heads, twin.to_kv_heads, twin.to_inter) == (384, 12, 4, 256)
    out = tmp_path / "twin"
    out.mkdir()
    write_twin(model, out, twin)
    padded = json.loads((out / "config.json").read_text())
    assert (padded["hidden_size"], padded["num_attention_heads"], padded["head_dim"]) == (
        384,
        12,
        32,
    )
    before, after = _logits(model), _logits(out)
    assert before.abs().max() > 1.0  # peaked logits: a zeroed or scrambled twin would show
    # float32 rounding apart (the norms' scale and epsilon, sums over more channels)
    assert torch.equal(before.argmax(-1), after.argmax(-1))
    assert (before - after).abs().max() < 1e-3, (before - after).abs().max()


def test_a_twin_is_made_only_where_it_is_needed_and_exact() -> None:
    from transformers import GPT2Config

    aligned = {"architectures": ["LlamaForCausalLM"], "vocab_size": 384, "num_hidden_layers": 2,
               "hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 4,
               "intermediate_size": 1536, "rms_norm_eps": 1e-5}  # fmt: skip
    assert Twin.of(aligned, 128, "w4a8-awq") is None
    # a LayerNorm model whose widths are multiples already needs no twin
    assert Twin.of({**GPT2Config(n_embd=768, n_head=12, n_layer=2).to_dict(),
                    "architectures": ["GPT2LMHeadModel"]}, 128, "w4a8-awq") is None  # fmt: skip
    smollm2 = {**aligned, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}
    twin = Twin.of(smollm2, 128, "w4a8-awq")
    assert twin is not None and (twin.to_hidden, twin.to_heads, twin.to_kv_heads) == (768, 12, 4)
    assert twin.config(smollm2)["rms_norm_eps"] == pytest.approx(0.75e-5)
    gpt2 = {
        **GPT2Config(n_embd=576, n_head=9, n_layer=2).to_dict(),
        "architectures": ["GPT2LMHeadModel"],
    }
    with pytest.raises(
        SpecError, match="only an RMSNorm model is padded exactly: use --dtype int4-awq"
    ):
        Twin.of(gpt2, 128, "--dtype w4a8-awq")


def test_the_w4a8_input_and_weight_follow_the_two_backends() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 256).to(torch.float16).float() * 3
    a = torch.tensor([0.02])
    # without a pre-quantization scale the PyTorch backend quantizes as the FP8 GEMM does
    assert torch.equal(w4a8_input(x, None, a, torch.float16, engine=False), to_e4m3(x, a))
    pqs = (torch.rand(256) + 0.5).to(torch.float16)
    engine = w4a8_input(x, pqs.float(), a, torch.float16).float()
    pytorch = w4a8_input(x, pqs.float(), a, torch.float16, engine=False).float()
    exact = to_e4m3(x * pqs.float(), a).float()
    # two roundings of the model dtype apart: close, not always equal
    assert (engine != pytorch).any() and ((engine - exact).abs() <= exact.abs() / 8 + 2**-9).all()
    values = torch.randint(-8, 8, (8, 256), dtype=torch.int8)
    scales = torch.rand(8, 2) * 0.01 + 1e-3
    s2 = torch.tensor([float((values.float().abs().amax() * scales.amax()) / 448)])
    # in float16 the engine's loader and the PyTorch backend's divide alike
    assert torch.equal(fp8_weight(values, scales, s2, torch.float16),
                       fp8_weight(values, scales, s2, torch.float16, engine=False))  # fmt: skip
    w8 = fp8_weight(values, scales, s2, torch.float16).float()
    assert w8.abs().max() <= 448
    want = values.float() * scales.repeat_interleave(128, 1) / s2
    assert ((w8 - want).abs() <= want.abs() / 16 + 2**-9).all()  # e4m3: 3 mantissa bits


@pytest.fixture(scope="module")
def aligned_llama(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-128")
    make_tiny_llama(path, tokenizer_dir, **ALIGNED)
    return path


@pytest.fixture(scope="module")
def modelopt_w4a8(aligned_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """modelopt's W4A8_AWQ_BETA_CFG on the aligned tiny Llama in float16, exported for
    trtllm-build: (its directory, its logits on IDS, the quantized model)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(aligned_llama, dtype=torch.float16)
    ids = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, copy.deepcopy(mtq.W4A8_AWQ_BETA_CFG), forward_loop=lambda m: m(ids))
    out = tmp_path_factory.mktemp("modelopt-w4a8")
    export_tensorrt_llm_checkpoint(model, decoder_type="llama", dtype=torch.float16,
                                   export_dir=str(out), inference_tensor_parallel=1)  # fmt: skip
    with torch.no_grad():
        logits = model(IDS).logits.float()
    return out, logits, model


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "rank0.safetensors"), framework="pt") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118


def test_the_runtime_computes_modelopts_w4a8_linears_as_modelopt_does(
    modelopt_w4a8: tuple, aligned_llama: Path
) -> None:
    """Each o_proj and down_proj of modelopt's quantized model (their own pre-quantization scale,
    not averaged over q/k/v or gate/up as the export requantizes those) against the checkpoint
    runtime's GEMM on modelopt's export, fed the same inputs: within a few percent of the
    quantization's own error, with the PyTorch backend's input rounding closest to modelopt's
    (it multiplies by p in the model dtype and divides by a in float32, as modelopt's fake
    quantization does; the engine divides p by a into float16 first)."""
    from transformers import AutoModelForCausalLM

    out, model = modelopt_w4a8[0], modelopt_w4a8[2]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W4A8_AWQ"
    float_model = AutoModelForCausalLM.from_pretrained(aligned_llama, dtype=torch.float32)
    runtime = CheckpointRuntime.load(out)
    assert runtime.w4a8 and runtime.engine_inputs
    seen: dict[str, torch.Tensor] = {}
    for layer in range(2):
        for module, name in (
            ("self_attn.o_proj", "attention.dense"),
            ("mlp.down_proj", "mlp.proj"),
        ):
            theirs = model.model.layers[layer].get_submodule(module)
            hook = theirs.register_forward_hook(
                lambda m, i, o: seen.update(x=i[0][0].detach().float(), y=o[0].detach().float())
            )
            with torch.no_grad():
                model(IDS)
            hook.remove()
            weight = float_model.model.layers[layer].get_submodule(module).weight.float()
            noise = (seen["x"] @ weight.T - seen["y"]).abs().mean()
            for engine, within in ((True, 0.08), (False, 0.03)):
                runtime.engine_inputs = engine
                runtime._dense = {n: runtime._dequantize(n) for n in runtime.w}
                ours = runtime._w4a8_linear(seen["x"], f"transformer.layers.{layer}.{name}")
                off = (ours - seen["y"]).abs().mean()
                assert off < within * noise, (layer, name, engine, float(off), float(noise))


def test_our_w4a8_checkpoint_has_modelopts_layout_and_runs(
    aligned_llama: Path, modelopt_w4a8: tuple, tmp_path: Path
) -> None:
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    calibrate(aligned_llama, calibration, CalibrationOptions(samples=8, seq_len=64))
    ours = tmp_path / "ours"
    ours.mkdir()
    summary = convert_model(W4a8Awq(), aligned_llama, ours, tp=1, pp=1, calibration=calibration)
    assert summary["awq"]["group_size"] == 128
    config = json.loads((ours / "config.json").read_text())
    theirs_config = json.loads((modelopt_w4a8[0] / "config.json").read_text())
    for key in ("quant_algo", "group_size", "has_zero_point", "pre_quant_scale"):
        assert config["quantization"][key] == theirs_config["quantization"][key], key
    mine, theirs = _tensors(ours), _tensors(modelopt_w4a8[0])
    layer = "transformer.layers.0."
    for linear in LINEARS:
        for suffix in ("weight", "weights_scaling_factor", "weights_scaling_factor_2",
                       "activation_scaling_factor", "prequant_scaling_factor"):  # fmt: skip
            name = f"{layer}{linear}.{suffix}"
            assert (mine[name].dtype, mine[name].shape) == (
                theirs[name].dtype,
                theirs[name].shape,
            ), name
    for together in (["attention.qkv"], ["attention.dense"], ["mlp.fc", "mlp.gate"], ["mlp.proj"]):
        # s2 is the FP8 stage's scale of the INT4 weights of one input: their largest
        # magnitude maps to 448
        largest = max(
            float((unpack_rows(mine[f"{layer}{n}.weight"]).float().abs()
                   * mine[f"{layer}{n}.weights_scaling_factor"].repeat_interleave(128, 1)).amax())
            for n in together
        )  # fmt: skip
        s2 = mine[f"{layer}{together[0]}.weights_scaling_factor_2"]
        assert largest / float(s2) == pytest.approx(448), together
    # fc and gate read one input: one input scale and one weight scale 2, as TensorRT-LLM's
    # PyTorch backend asserts for its fused gate_up
    for suffix in ("activation_scaling_factor", "weights_scaling_factor_2"):
        assert torch.equal(mine[f"{layer}mlp.fc.{suffix}"], mine[f"{layer}mlp.gate.{suffix}"])
    # convert alone (AWQ's alpha by the calibrated error, nearest rounding), run as the engine
    # computes it, is no further from the float model than modelopt's export run the same way
    want = _logits(aligned_llama)[0]
    with torch.no_grad():
        got = CheckpointRuntime.load(ours).forward(IDS)[0].float()
        theirs = CheckpointRuntime.load(modelopt_w4a8[0]).forward(IDS)[0].float()
    assert torch.isfinite(got).all()
    assert (got - want).abs().mean() < (theirs - want).abs().mean() * 1.05


def test_w4a8_refusals() -> None:
    with pytest.raises(SpecError, match="w4a8-awq takes group size 128 alone"):
        make_spec(dtype="w4a8-awq", **{"int4.group_size": 64})
    with pytest.raises(
        SpecError, match=r"w4a8-awq is not built with --kv-cache int8: use --kv-cache fp8"
    ):
        make_spec(dtype="w4a8-awq", kv_cache="int8")


@pytest.fixture(scope="module")
def modelopt_w4a8_unified(aligned_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """modelopt's W4A8_AWQ_BETA_CFG on the aligned tiny Llama, exported in its unified Hugging
    Face format (what TensorRT-LLM's PyTorch backend loads)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(aligned_llama, dtype=torch.float16)
    ids = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, copy.deepcopy(mtq.W4A8_AWQ_BETA_CFG), forward_loop=lambda m: m(ids))
    out = tmp_path_factory.mktemp("modelopt-w4a8-hf")
    export_hf_checkpoint(model, export_dir=str(out))
    return out


def _headers(directory: Path) -> dict[str, tuple[str, list[int]]]:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118
                found[name] = (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape())
    return found


def test_our_llmapi_w4a8_checkpoint_has_modelopts_unified_layout(
    modelopt_w4a8_unified: Path, aligned_llama: Path, tmp_path: Path
) -> None:
    """The llmapi target's W4A8_AWQ checkpoint has every tensor of modelopt's unified export,
    with its dtype and shape, and hf_quant_config.json's quantization table; read back, its
    INT4 values, group scales and FP8 scalars are the engine checkpoint's, and the runtime
    quantizes its inputs as the PyTorch backend does; modelopt's own export reads back too."""
    from trt_builder.targets.llmapi.checkpoint.unified import read_unified
    from trt_builder.targets.llmapi.convert import convert_llmapi

    calibration, hf, engine = tmp_path / "calibration", tmp_path / "hf", tmp_path / "engine"
    for d in (calibration, hf, engine):
        d.mkdir()
    calibrate(aligned_llama, calibration, CalibrationOptions(samples=8, seq_len=64))
    summary = convert_llmapi(W4a8Awq(), aligned_llama, hf, calibration=calibration, recipe=None)
    assert summary["loaders"] == ["tensorrt-llm 1.0", "tensorrt-llm 1.1", "tensorrt-llm 1.2"]
    theirs, ours = _headers(modelopt_w4a8_unified), _headers(hf)
    assert sorted(ours) == sorted(theirs)
    for name, got in theirs.items():
        assert ours[name] == got, name
    quant = json.loads((hf / "hf_quant_config.json").read_text())["quantization"]
    their_quant = json.loads((modelopt_w4a8_unified / "hf_quant_config.json").read_text())
    assert quant == their_quant["quantization"]
    convert_model(W4a8Awq(), aligned_llama, engine, tp=1, pp=1, calibration=calibration)
    config, read_back = read_unified(hf)
    written = _tensors(engine)
    for linear in LINEARS:
        for suffix in ("weight", "weights_scaling_factor", "weights_scaling_factor_2",
                       "activation_scaling_factor"):  # fmt: skip
            name = f"transformer.layers.1.{linear}.{suffix}"
            assert torch.equal(read_back[name].reshape(written[name].shape), written[name]), name
    runtime = CheckpointRuntime(config, read_back)
    assert runtime.w4a8 and not runtime.engine_inputs
    theirs_runtime = CheckpointRuntime(*read_unified(modelopt_w4a8_unified))
    assert theirs_runtime.w4a8 and torch.isfinite(theirs_runtime.forward(IDS)).all()


def test_a_model_the_twin_cannot_pad_is_refused_before_any_work(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPT-2's LayerNorm would change with added channels: exit 2, naming int4-awq, nothing
    fetched or written."""
    from tiny_models import make_tiny
    from trt_builder.cli.main import main

    model = tmp_path / "gpt2"
    make_tiny("gpt2", model, tokenizer_dir)
    out = tmp_path / "engines"
    code = main(["build", "--model", str(model), "--dtype", "w4a8-awq", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "only an RMSNorm model is padded exactly: use --dtype int4-awq" in err
    assert "Traceback" not in err and not out.exists()


def test_an_unused_channels_scale_cannot_overflow_the_engines_division() -> None:
    """A padded twin's added channels see no input and hold no weight: their pre-quantization
    scale becomes the input scale, so the engine's p / a there is 1, not float16's inf (which
    made modelopt's export of the twin NaN: benchmarks/w4a8.py); the others keep theirs."""
    from trt_builder.checkpoint.w4a8 import activation_scale, input_scales

    absmax = torch.tensor([2.0, 0.5, 0.0, 0.0])
    weight = torch.tensor([[1.0, -1.0, 0.0, 0.3], [0.5, 0.2, 0.0, 0.0]])
    pqs = torch.tensor([0.5, 2.0, 170.0, 3.0], dtype=torch.float16)
    p, a = input_scales(absmax, pqs, weight)
    assert torch.equal(a, activation_scale(absmax, pqs)) and float(a) == pytest.approx(1 / 448)
    assert float((pqs[2].float() / a).to(torch.float16)) == float("inf")  # what it was
    assert p.dtype == torch.float16 and torch.equal(p[[0, 1, 3]], pqs[[0, 1, 3]])
    assert float(p[2]) == pytest.approx(float(a), rel=1e-3)  # unused: p / a is 1
