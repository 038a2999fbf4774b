"""SmoothQuant W8A8 and the INT8 KV cache: the checkpoint in TensorRT-LLM's plugin format, its
arithmetic, the checkpoint runtime's plugin GEMM, and the calibration reused across recipes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tiny_models import make_tiny
from trt_builder.calibrate.stats import calibrate, load_stats
from trt_builder.core.errors import ConversionError, SpecError
from trt_builder.modes import SmoothQuant
from trt_builder.modes.smoothquant.convert import convert_smoothquant
from trt_builder.runtimes import int8
from trt_builder.runtimes.checkpoint import CheckpointRuntime
from trt_builder.runtimes.int8 import int8_matmul
from trt_builder.spec.build import CalibrationOptions

pytestmark = pytest.mark.integration
IDS = torch.tensor([5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 300, 21])


@pytest.fixture(scope="module")
def calibrated(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibration")
    calibrate(tiny_llama, out, CalibrationOptions(samples=8, seq_len=64))
    return out


def _convert(hf: Path, calibration: Path, tmp: Path, mode: SmoothQuant) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    convert_smoothquant(hf, tmp, mode, calibration)
    return tmp


def test_per_token_checkpoint_layout_and_arithmetic(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    ck = _convert(tiny_llama, calibrated, tmp_path, SmoothQuant(alpha=0.5))
    w = load_file(ck / "rank0.safetensors")
    p = "transformer.layers.0."
    assert w[p + "attention.qkv.weight"].dtype == torch.int8
    assert w[p + "attention.qkv.per_channel_scale"].shape == (
        1,
        w[p + "attention.qkv.weight"].shape[0],
    )
    assert w[p + "attention.dense.smoother"].shape == (1, 64) and w[
        p + "mlp.proj.smoother"
    ].shape == (1, 128)
    assert float(w[p + "input_layernorm.scale_to_int"]) == 1.0  # per token: unused
    assert not any(
        k.endswith(("act_scale", "quantization_scaling_factor", "kv_cache_scaling_factor"))
        for k in w
    )
    assert w["lm_head.weight"].dtype == torch.float16  # lm_head stays in the model dtype

    hf = load_file(tiny_llama / "model.safetensors")
    stats = load_stats(calibrated)
    ax = stats["model.layers.0.self_attn.q_proj.input_absmax"]
    W = torch.cat([hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]).float()
    s = (ax.clamp(min=1e-5).sqrt() / W.abs().amax(dim=0).clamp(min=1e-5).sqrt()).clamp(min=1e-5)
    smoothed = W * s  # alpha 0.5: s = sqrt(ax) / sqrt(max|W|)
    step = w[p + "attention.qkv.per_channel_scale"].reshape(-1, 1)  # aw / 127 per row
    dequant = w[p + "attention.qkv.weight"].float() * step
    assert bool(((dequant - smoothed).abs() <= step / 2 + 1e-6).all())  # round to nearest
    gamma = hf["model.layers.0.input_layernorm.weight"].float()
    torch.testing.assert_close(w[p + "input_layernorm.weight"].float(), (gamma / s).half().float())


def test_the_runtime_gemm_is_the_plugin_arithmetic(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    ck = _convert(tiny_llama, calibrated, tmp_path, SmoothQuant(alpha=0.5, dtype="float16"))
    model = CheckpointRuntime.load(ck)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).half().float()
    w = load_file(ck / "rank0.safetensors")
    p = "transformer.layers.1.attention.qkv"
    m = x.abs().amax(dim=-1, keepdim=True)  # per token: int8 = round(x * 127 / max|x|)
    q = torch.round(x * 127 / m).clamp(-128, 127)
    expected = (q @ w[p + ".weight"].float().T) * w[p + ".per_channel_scale"] * (m / 127)
    torch.testing.assert_close(model._sq_linear(x, p), expected.half().float())


@pytest.mark.parametrize("int_mm", [False, True], ids=["float32-blocks", "int-mm"])
@pytest.mark.parametrize("k", [576, 1024, 1025, 4100])
def test_the_int8_gemm_accumulates_exactly(
    k: int, int_mm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Extreme operands (-128 x -127 in every channel of one row) past the float32 block: each
    output equals the integer dot product, rounded once to float32 as int32 -> float is, by
    both CPU paths (which one runs depends on the CPU: runtimes/int8.py times them)."""
    monkeypatch.setattr(int8, "cpu_int_mm_faster", lambda: int_mm)
    gen = torch.Generator().manual_seed(k)
    x = torch.randint(-128, 128, (7, k), dtype=torch.int8, generator=gen)
    w = torch.randint(-127, 128, (16, k), dtype=torch.int8, generator=gen)
    x[0], w[0] = -128, -127
    exact = x.long() @ w.long().T
    assert int(exact[0, 0]) == 128 * 127 * k
    assert torch.equal(int8_matmul(x.reshape(7, 1, k), w), exact.float().reshape(7, 1, 16))


@pytest.mark.parametrize(
    ("mode", "floor"),
    [(SmoothQuant(alpha=0.5), 0.75), (SmoothQuant(alpha=0.5, per_token=False), 0.5)],
    ids=["per-token", "per-tensor"],
)
def test_the_runtime_follows_transformers(
    tiny_llama: Path, calibrated: Path, tmp_path: Path, mode: SmoothQuant, floor: float
) -> None:
    from transformers import AutoModelForCausalLM

    model = CheckpointRuntime.load(_convert(tiny_llama, calibrated, tmp_path, mode))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(IDS[None]).logits[0]
    got = model.forward(IDS)
    assert torch.isfinite(got).all()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= floor  # a random tiny model


def test_static_scales_and_the_int8_kv_cache(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    mode = SmoothQuant(alpha=0.5, per_token=False, kv_cache="int8")
    ck = _convert(tiny_llama, calibrated, tmp_path / "static", mode)
    w = load_file(ck / "rank0.safetensors")
    p = "transformer.layers.0."
    for name in ("attention.qkv.act_scale", "attention.quantization_scaling_factor",
                 "mlp.quantization_scaling_factor", "attention.kv_cache_scaling_factor"):  # fmt: skip
        assert w[p + name].dtype == torch.float32 and float(w[p + name].reshape(-1)[0]) > 0
    stats = load_stats(calibrated)
    # balanced K and V span the larger of their calibrated ranges (trt_builder/modes/kvcache/convert.py)
    kv = max(float(stats[f"model.layers.0.self_attn.{x}_proj.output_absmax"].max()) for x in "kv")
    assert float(w[p + "attention.kv_cache_scaling_factor"]) == pytest.approx(kv / 127)

    with_kv = CheckpointRuntime.load(ck)
    plain_ck = _convert(
        tiny_llama, calibrated, tmp_path / "nokv", SmoothQuant(0.5, per_token=False)
    )
    plain, wp = CheckpointRuntime.load(plain_ck), load_file(plain_ck / "rank0.safetensors")
    # the balancing only rescales: the same int8 weights, scales multiplied by its factors
    assert torch.equal(w[p + "attention.qkv.weight"], wp[p + "attention.qkv.weight"])
    assert not torch.equal(w[p + "attention.dense.smoother"], wp[p + "attention.dense.smoother"])
    assert with_kv.greedy(IDS.tolist(), 6, set()) != [] and with_kv.kv_int8
    # the prompt itself attends to unquantized K/V, as in the engine: the same context logits.
    # Exact in float32 arithmetic; in float16 the rescaled values round differently, and a
    # random model's INT8 activations amplify that
    for model in (with_kv, plain):
        model.dtype = torch.float32
    torch.testing.assert_close(with_kv.forward(IDS), plain.forward(IDS), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_tensor_and_pipeline_parallel_ranks(
    tiny_llama: Path, calibrated: Path, tmp_path: Path, tp: int, pp: int
) -> None:
    from trt_builder.checkpoint.reader import read_checkpoint

    mode = SmoothQuant(alpha=0.5, per_token=False, kv_cache="int8")  # every kind of tensor
    one = _convert(tiny_llama, calibrated, tmp_path / "one", mode)
    split = tmp_path / "split"
    split.mkdir()
    convert_smoothquant(tiny_llama, split, mode, calibrated, tp=tp, pp=pp)
    assert sorted(p.name for p in split.glob("rank*")) == [
        f"rank{r}.safetensors" for r in range(tp * pp)
    ]
    rank0 = load_file(split / "rank0.safetensors")
    whole = load_file(one / "rank0.safetensors")
    p = "transformer.layers.0."
    # scales of column-parallel outputs and smoothers of row-parallel inputs are split with
    # their weights; the rest is replicated
    assert (
        rank0[p + "attention.qkv.per_channel_scale"].shape[1]
        == rank0[p + "attention.qkv.weight"].shape[0]
    )
    assert rank0[p + "mlp.fc.per_channel_scale"].shape[1] == rank0[p + "mlp.fc.weight"].shape[0]
    assert (
        rank0[p + "attention.dense.smoother"].shape[1]
        == rank0[p + "attention.dense.weight"].shape[1]
    )
    assert rank0[p + "mlp.proj.smoother"].shape[1] == rank0[p + "mlp.proj.weight"].shape[1]
    assert torch.equal(
        rank0[p + "attention.dense.per_channel_scale"],
        whole[p + "attention.dense.per_channel_scale"],
    )
    # the ranks merge back into exactly the single-rank checkpoint (KV heads duplicated for tp 4)
    config, merged = read_checkpoint(split)
    assert config["mapping"]["world_size"] == tp * pp
    assert merged.keys() == whole.keys()
    assert all(torch.equal(merged[k], whole[k]) for k in whole)


def test_refusals(tiny_llama: Path, calibrated: Path, tmp_path: Path, tokenizer_dir: Path) -> None:
    with pytest.raises(SpecError, match="--tp 3"):
        convert_smoothquant(tiny_llama, tmp_path, SmoothQuant(), calibrated, tp=3)
    make_tiny("qwen3", tmp_path / "qwen3", tokenizer_dir)  # upstream's attention: no q/k norm
    with pytest.raises(
        ConversionError, match="not supported for Qwen3ForCausalLM yet: use --dtype int8-wo"
    ):
        convert_smoothquant(tmp_path / "qwen3", tmp_path / "out", SmoothQuant(), calibrated)


def test_alphas_per_layer_and_group(tiny_llama: Path, calibrated: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from trt_builder.modes.smoothquant.recipe.search import fit_per_layer
    from trt_builder.modes.smoothquant.spec import GRID

    same = {i: {g: 0.6 for g in ("qkv", "dense", "fc", "proj")} for i in range(2)}
    a = load_file(
        _convert(tiny_llama, calibrated, tmp_path / "a", SmoothQuant(0.6)) / "rank0.safetensors"
    )
    b = tmp_path / "b"
    b.mkdir()
    convert_smoothquant(tiny_llama, b, SmoothQuant(0.4), calibrated, alphas=same)
    assert all(torch.equal(a[k], v) for k, v in load_file(b / "rank0.safetensors").items())
    c = tmp_path / "c"
    c.mkdir()
    convert_smoothquant(tiny_llama, c, SmoothQuant(0.6), calibrated, alphas={1: {"fc": 0.3}})
    w = load_file(c / "rank0.safetensors")
    differ = {k for k, v in w.items() if not torch.equal(a[k], v)}
    # only layer 1's fc/gate group: its norm, weights and scales
    assert differ and all(k.startswith("transformer.layers.1.") for k in differ)
    assert {k.split(".", 3)[3] for k in differ} <= {
        "post_layernorm.weight", "mlp.fc.weight", "mlp.gate.weight",
        "mlp.fc.per_channel_scale", "mlp.gate.per_channel_scale"}  # fmt: skip

    from trt_builder.models.registry import family_for
    from trt_builder.modes.smoothquant.recipe.simulate import Simulation, gemm_groups
    from trt_builder.source.files import read_hf_config

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    hf_config = read_hf_config(tiny_llama)
    groups = gemm_groups(family_for(hf_config), hf_config, set(model.state_dict()))
    sim = Simulation(model, groups, load_stats(calibrated), True)
    with sim.installed():
        fitted, sensitivity = fit_per_layer(sim, IDS[None], GRID, 8, "cpu")
    assert set(fitted) == set(sensitivity) == {f"{i}.{g}" for i in range(2)
                                              for g in ("qkv", "dense", "fc", "proj")}  # fmt: skip
    assert all(v in GRID for v in fitted.values())
    assert all(0 < v < 1 for v in sensitivity.values())
    # the fit's choice for layer 0's qkv is the alpha whose plugin GEMM, as the reference
    # runtime computes it, is closest to the float projection on the same input
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(IDS))
        attn = model.model.layers[0].self_attn
        y = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    errors = {}
    for alpha in GRID:
        ck = _convert(tiny_llama, calibrated, tmp_path / f"g{alpha}", SmoothQuant(alpha))
        runtime = CheckpointRuntime.load(ck)
        runtime.dtype = torch.float32  # the fit's arithmetic: no float16 rounding
        h = runtime._norm(runtime._dense["transformer.vocab_embedding.weight"][IDS],
                          "transformer.layers.0.input_layernorm")  # fmt: skip
        out = runtime._linear(h, "transformer.layers.0.attention.qkv")
        errors[alpha] = float((out - y).pow(2).sum())
    assert errors[fitted["0.qkv"]] == pytest.approx(min(errors.values()), rel=1e-3)


def test_changing_the_recipe_reuses_the_calibration(tiny_llama: Path, tmp_path: Path) -> None:
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    def build(**kw: object) -> dict[str, str]:
        spec = make_spec(model=str(tiny_llama), dtype="int8", out=tmp_path / "e", triton_root=tmp_path / "t",
                         **{"calibrate.samples": 8, "calibrate.seq_len": 64}, **kw)  # fmt: skip
        return {r.name: r.status for r in run(spec, only=("fetch", "calibrate", "convert")).records}

    assert build(**{"int8.alpha": 0.5}) == {"fetch": "ran", "calibrate": "ran", "convert": "ran"}
    assert build(**{"int8.alpha": 0.6}) == {
        "fetch": "cached",
        "calibrate": "cached",
        "convert": "ran",
    }
    assert build(**{"int8.alpha": 0.6, "int8.granularity": "per-tensor"})["calibrate"] == "cached"
    assert build(**{"int8.alpha": 0.6, "kv_cache": "int8"})["calibrate"] == "cached"


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_qwen2_ranks_reassemble_and_run_as_one(
    tokenizer_dir: Path, tmp_path: Path, tp: int, pp: int
) -> None:
    """Qwen2 (qkv biases, grouped KV heads) in SmoothQuant with the INT8 KV cache, split into
    ranks: they merge back into the TP=1 checkpoint bit for bit, and the checkpoint runtime on
    the split checkpoint gives the TP=1 logits."""
    from trt_builder.checkpoint.reader import read_checkpoint

    model, calibration = tmp_path / "qwen2", tmp_path / "calibration"
    make_tiny("qwen2", model, tokenizer_dir)
    calibration.mkdir()
    calibrate(model, calibration, CalibrationOptions(samples=8, seq_len=64))
    mode = SmoothQuant(alpha=0.5, kv_cache="int8")
    one = _convert(model, calibration, tmp_path / "one", mode)
    split = tmp_path / "split"
    split.mkdir()
    convert_smoothquant(model, split, mode, calibration, tp=tp, pp=pp)
    assert len(list(split.glob("rank*.safetensors"))) == tp * pp
    whole = load_file(one / "rank0.safetensors")
    assert "transformer.layers.0.attention.qkv.bias" in whole
    config, merged = read_checkpoint(split)
    assert config["mapping"]["world_size"] == tp * pp
    assert merged.keys() == whole.keys() and all(torch.equal(merged[k], whole[k]) for k in whole)
    torch.testing.assert_close(
        CheckpointRuntime.load(split).forward(IDS), CheckpointRuntime.load(one).forward(IDS),
        atol=0, rtol=0,
    )  # fmt: skip
