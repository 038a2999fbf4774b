"""SmoothQuant for GPT-2 (Conv1D weights stored [in, out], fused qkv with a bias, LayerNorm with
a bias, no gate): the checkpoint's tensors, the checkpoint runtime against transformers and
against the recipe's simulation, parallel ranks, the INT8 KV cache, the hub's unprefixed files
and the pipeline with its recipe search."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import make_tiny
from trt_builder.calibrate.stats import calibrate, load_model, load_stats
from trt_builder.checkpoint.reader import read_checkpoint
from trt_builder.models.registry import family_for
from trt_builder.modes import SmoothQuant
from trt_builder.modes.smoothquant.convert import convert_smoothquant
from trt_builder.modes.smoothquant.recipe.simulate import Simulation, gemm_groups
from trt_builder.runtimes.checkpoint import CheckpointRuntime
from trt_builder.runtimes.scoring import kl
from trt_builder.source.files import read_hf_config
from trt_builder.spec.build import CalibrationOptions

pytestmark = pytest.mark.integration
IDS = torch.randint(0, 384, (4, 64), generator=torch.Generator().manual_seed(1))
P = "transformer.layers.0."
#: Every layer's tensors in either granularity: name -> (dtype, shape) of the tiny GPT-2
#: (hidden 64, inner 256); None: the model dtype.
LAYER = {
    "input_layernorm.weight": (None, (64,)),
    "input_layernorm.bias": (None, (64,)),
    "input_layernorm.scale_to_int": (torch.float32, (1,)),
    "attention.qkv.weight": (torch.int8, (192, 64)),
    "attention.qkv.per_channel_scale": (torch.float32, (1, 192)),
    "attention.qkv.bias": (None, (192,)),
    "attention.dense.weight": (torch.int8, (64, 64)),
    "attention.dense.per_channel_scale": (torch.float32, (1, 64)),
    "attention.dense.smoother": (torch.float32, (1, 64)),
    "attention.dense.bias": (None, (64,)),
    "post_layernorm.weight": (None, (64,)),
    "post_layernorm.bias": (None, (64,)),
    "post_layernorm.scale_to_int": (torch.float32, (1,)),
    "mlp.fc.weight": (torch.int8, (256, 64)),
    "mlp.fc.per_channel_scale": (torch.float32, (1, 256)),
    "mlp.fc.bias": (None, (256,)),
    "mlp.proj.weight": (torch.int8, (64, 256)),
    "mlp.proj.per_channel_scale": (torch.float32, (1, 64)),
    "mlp.proj.smoother": (torch.float32, (1, 256)),
    "mlp.proj.bias": (None, (64,)),
}
#: What static (per-tensor) activation scales add.
STATIC = {
    "attention.quantization_scaling_factor": (torch.float32, (1,)),
    "mlp.quantization_scaling_factor": (torch.float32, (1,)),
    **{f"{x}.act_scale": (torch.float32, (1, 1))
       for x in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.proj")},
}  # fmt: skip


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> tuple[Path, Path]:
    """A tiny GPT-2 with random biases and LayerNorm weights (GPT-2's initialisation makes
    them 0 and 1, which would hide what happens to them), and its calibration."""
    root = tmp_path_factory.mktemp("gpt2-sq")
    make_tiny("gpt2", root / "gpt2", tokenizer_dir)
    weights = load_file(root / "gpt2" / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, t in weights.items():
        if name.endswith(".bias") and t.dim() == 1:
            weights[name] = 0.2 * torch.randn(t.shape, generator=g)
        elif ".ln_" in name and name.endswith(".weight"):
            weights[name] = 0.5 + torch.rand(t.shape, generator=g)
    save_file(weights, str(root / "gpt2" / "model.safetensors"), metadata={"format": "pt"})
    (root / "calibration").mkdir()
    calibrate(root / "gpt2", root / "calibration", CalibrationOptions(samples=8, seq_len=64))
    return root / "gpt2", root / "calibration"


def _convert(hf: Path, calibration: Path, out: Path, mode: SmoothQuant, **kw: object) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    convert_smoothquant(hf, out, mode, calibration, **kw)  # type: ignore[arg-type]
    return out


def _bare(hf: Path, out: Path) -> Path:
    """The hub's original GPT-2 layout (gpt2, distilgpt2): `h.0....`, no `transformer.`."""
    shutil.copytree(hf, out)
    weights = load_file(out / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    return out


@pytest.mark.parametrize("per_token", [True, False], ids=["per-token", "per-tensor"])
def test_the_checkpoint_and_its_logits(
    gpt2: tuple[Path, Path], tmp_path: Path, per_token: bool
) -> None:
    """Every layer's tensors, named, typed and shaped as TensorRT-LLM's GPT converter writes
    them; the smoother folded into both LayerNorm parameters; the logits close to the float
    model's."""
    from transformers import AutoModelForCausalLM

    hf_dir, calibration = gpt2
    ck = _convert(hf_dir, calibration, tmp_path, SmoothQuant(0.5, per_token=per_token))
    w = load_file(ck / "rank0.safetensors")
    expected = {**LAYER, **({} if per_token else STATIC)}
    layer0 = {k.removeprefix(P): v for k, v in w.items() if k.startswith(P)}
    assert sorted(layer0) == sorted(expected)
    for name, (dtype, shape) in expected.items():
        assert layer0[name].dtype == (dtype or torch.float16), name
        assert tuple(layer0[name].shape) == shape, name
    assert not any("gate" in k or "kv_cache_scaling_factor" in k for k in w)
    config = json.loads((ck / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == SmoothQuant(0.5, per_token=per_token).quant_algo

    hf = load_file(hf_dir / "model.safetensors")
    stats = load_stats(calibration)
    ax = stats["transformer.h.0.attn.c_attn.input_absmax"]
    W = hf["transformer.h.0.attn.c_attn.weight"].T.float()  # Conv1D: [in, out]
    s = (ax.clamp(min=1e-5).sqrt() / W.abs().amax(dim=0).clamp(min=1e-5).sqrt()).clamp(min=1e-5)
    for part in ("weight", "bias"):  # LayerNorm(x) / s = xhat * gamma / s + beta / s
        ln = hf[f"transformer.h.0.ln_1.{part}"].float()
        torch.testing.assert_close(
            w[P + f"input_layernorm.{part}"].float(), (ln / s).half().float()
        )
    step = w[P + "attention.qkv.per_channel_scale"].reshape(-1, 1)
    if per_token:  # aw / 127 per row: the int8 rows round W diag(s) to nearest
        dequant = w[P + "attention.qkv.weight"].float() * step
        assert bool(((dequant - W * s).abs() <= step / 2 + 1e-6).all())

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(IDS).logits.float().flatten(0, 1)
    got = CheckpointRuntime.load(ck).forward(IDS).flatten(0, 1)
    shuffled = ref[torch.randperm(ref.shape[0], generator=torch.Generator().manual_seed(0))]
    random = float(kl(ref, shuffled).mean())  # another token's logits: ~2.4 nats
    assert float(kl(ref, got).mean()) < 0.01 * random
    assert float((got.argmax(-1) == ref.argmax(-1)).double().mean()) >= 0.9


@pytest.mark.parametrize("per_token", [False, True], ids=["per-tensor", "per-token"])
def test_the_simulation_is_converting_and_running(
    gpt2: tuple[Path, Path], tmp_path: Path, per_token: bool
) -> None:
    """The recipe's simulation on the transformers GPT-2 (smoother dividing the LayerNorm's
    output) against the converted checkpoint (smoother folded into its weight and bias), both
    in float32 (set past the mode's check): static scales give the very same logits, per-token
    scales the same up to a few activations whose int8 rounding flips (KL under 1% of the
    quantization's own)."""
    hf_dir, calibration = gpt2
    hf_config = read_hf_config(hf_dir)
    model = load_model(hf_dir, "cpu", tmp_path / "offload").eval()
    groups = gemm_groups(family_for(hf_config), hf_config, set(model.state_dict()))
    assert [g.key for g in groups] == [f"{i}.{g}" for i in range(2)
                                       for g in ("qkv", "dense", "fc", "proj")]  # fmt: skip
    assert groups[2].modules == ("transformer.h.0.mlp.c_fc",)  # no gate
    alphas = {g.key: (0.3, 0.5, 0.8, 0.6)[i % 4] for i, g in enumerate(groups)}
    by_layer: dict[int, dict[str, float]] = {}
    for g in groups:
        by_layer.setdefault(g.layer, {})[g.name] = alphas[g.key]
    mode = SmoothQuant(0.5, per_token=per_token)
    object.__setattr__(mode, "dtype", "float32")
    ck = _convert(hf_dir, calibration, tmp_path / "ck", mode, alphas=by_layer)
    converted = CheckpointRuntime.load(ck).forward(IDS).flatten(0, 1)

    sim = Simulation(model, groups, load_stats(calibration), per_token)
    with torch.inference_mode(), sim.installed():
        sim.alphas = dict(alphas)
        simulated = model(IDS).logits.float().flatten(0, 1)
        sim.alphas = {}
        floats = model(IDS).logits.float().flatten(0, 1)
    quantization = float(kl(floats, converted).mean())
    assert quantization > 1e-4  # the INT8 GEMMs do change the logits
    if per_token:
        assert float(kl(simulated, converted).mean()) < 0.01 * quantization
        assert float((simulated.argmax(-1) == converted.argmax(-1)).double().mean()) >= 0.99
    else:
        assert torch.equal(simulated, converted)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_ranks_reassemble_and_run_as_one(
    gpt2: tuple[Path, Path], tmp_path: Path, tp: int, pp: int
) -> None:
    """Static scales and the INT8 KV cache (every kind of tensor) split into ranks: they merge
    back into the TP=1 checkpoint bit for bit, and the checkpoint runtime on the split
    checkpoint gives the TP=1 logits."""
    hf_dir, calibration = gpt2
    mode = SmoothQuant(0.5, per_token=False, kv_cache="int8")
    one = _convert(hf_dir, calibration, tmp_path / "one", mode)
    split = _convert(hf_dir, calibration, tmp_path / "split", mode, tp=tp, pp=pp)
    assert len(list(split.glob("rank*.safetensors"))) == tp * pp
    if tp == 2:  # qkv's scales with its rows (per Q/K/V head group), the smoothers with columns
        rank0 = load_file(split / "rank0.safetensors")
        assert rank0[P + "attention.qkv.per_channel_scale"].shape == (1, 96)
        assert rank0[P + "attention.qkv.bias"].shape == (96,)
        assert rank0[P + "mlp.proj.smoother"].shape == (1, 128)
    whole = load_file(one / "rank0.safetensors")
    config, merged = read_checkpoint(split)
    assert config["mapping"]["world_size"] == tp * pp
    assert merged.keys() == whole.keys() and all(torch.equal(merged[k], whole[k]) for k in whole)
    torch.testing.assert_close(
        CheckpointRuntime.load(split).forward(IDS), CheckpointRuntime.load(one).forward(IDS),
        atol=0, rtol=0,
    )  # fmt: skip


def test_the_int8_kv_cache_is_an_exact_rewrite(gpt2: tuple[Path, Path], tmp_path: Path) -> None:
    """GPT-2 (learned positions, qkv bias) with the INT8 KV cache: the balancing keeps the int8
    weights and rescales qkv's scales and bias and dense's smoother; the prompt's own logits
    (it attends to unquantized K/V) are those without it, written and run in float32 (in
    float16 the rescaled bias rounds differently, and INT8 activations amplify that) with
    static scales (a per-token scale is the row's max, whose last bit the rewrite can move)."""
    hf_dir, calibration = gpt2
    modes = SmoothQuant(0.5, per_token=False, kv_cache="int8"), SmoothQuant(0.5, per_token=False)
    for mode in modes:
        object.__setattr__(mode, "dtype", "float32")
    kv = _convert(hf_dir, calibration, tmp_path / "kv", modes[0])
    plain = _convert(hf_dir, calibration, tmp_path / "plain", modes[1])
    wk, wp = load_file(kv / "rank0.safetensors"), load_file(plain / "rank0.safetensors")
    assert torch.equal(wk[P + "attention.qkv.weight"], wp[P + "attention.qkv.weight"])
    assert not torch.equal(wk[P + "attention.qkv.bias"], wp[P + "attention.qkv.bias"])
    assert float(wk[P + "attention.kv_cache_scaling_factor"]) > 0
    with_kv, without = CheckpointRuntime.load(kv), CheckpointRuntime.load(plain)
    assert with_kv.kv_int8 and with_kv.greedy(IDS[0].tolist(), 6, set()) != []
    torch.testing.assert_close(with_kv.forward(IDS), without.forward(IDS), atol=1e-5, rtol=1e-5)


def test_the_pipeline_searches_and_converts(gpt2: tuple[Path, Path], tmp_path: Path) -> None:
    """`--dtype int8` on GPT-2: calibrate, the recipe search (four groups a layer, fc without a
    gate) and convert; the hub's unprefixed files (`h.0....`, calibrated as the model's
    `transformer.h.0....`) give the very same recipe and checkpoint."""
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    def build(model: Path, out: Path) -> dict[str, Path]:
        spec = make_spec(model=str(model), dtype="int8", out=out, triton_root=out / "t",
                         **{"calibrate.samples": 8, "calibrate.seq_len": 64})  # fmt: skip
        result = run(spec, only=("fetch", "calibrate", "recipe", "convert"))
        assert {r.name: r.status for r in result.records} == dict.fromkeys(
            ("fetch", "calibrate", "recipe", "convert"), "ran"
        )
        return {r.name: Path(r.output) for r in result.records}

    ours = build(gpt2[0], tmp_path / "a")
    recipe = json.loads((ours["recipe"] / "recipe.json").read_text())
    assert {k for k, _ in recipe["sensitivity"]} == {
        f"{layer}.{g}" for layer in (0, 1) for g in ("qkv", "dense", "fc", "proj")
    }
    config = json.loads((ours["convert"] / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    assert config["quantization"]["smoothquant_val"] == recipe["alpha"]

    bare = build(_bare(gpt2[0], tmp_path / "bare"), tmp_path / "b")
    bare_recipe = json.loads((bare["recipe"] / "recipe.json").read_text())
    assert bare_recipe["alphas"] == recipe["alphas"] and bare_recipe["chosen"] == recipe["chosen"]
    a = load_file(ours["convert"] / "rank0.safetensors")
    b = load_file(bare["convert"] / "rank0.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
