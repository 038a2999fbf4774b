"""FP8 per-tensor W8A8 and the FP8 KV cache on tiny random Llamas: the checkpoint against
nvidia-modelopt 0.47's FP8_DEFAULT_CFG + FP8_KV_CFG export given the same amax, the layout
trtllm-build's FP8 loader reads, the runtime's GEMM and KV cache against e4m3 arithmetic, and
tensor-parallel ranks that reassemble."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trt_builder.calibrate.stats import calibrate, load_stats
from trt_builder.convert.model import convert_model
from trt_builder.modes import FloatMode, Fp8, QuantMode, SmoothQuant, WeightOnlyInt8
from trt_builder.modes.fp8.checkpoint import CONTRACTS, check_fp8
from trt_builder.runtimes.checkpoint import CheckpointRuntime
from trt_builder.runtimes.fp8 import fp8_matmul
from trt_builder.spec.build import CalibrationOptions

pytestmark = pytest.mark.integration
IDS = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 300, 21]])
E4M3 = torch.float8_e4m3fn
#: The linears modelopt quantizes in a Llama layer, by TensorRT-LLM name -> HF module.
LINEARS = {"attention.qkv": "self_attn.q_proj", "attention.dense": "self_attn.o_proj",
           "mlp.fc": "mlp.up_proj", "mlp.gate": "mlp.gate_proj", "mlp.proj": "mlp.down_proj"}  # fmt: skip


@pytest.fixture(scope="module")
def calibrated(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibration")
    calibrate(tiny_llama, out, CalibrationOptions(samples=8, seq_len=64))
    return out


def _convert(hf: Path, out: Path, mode: QuantMode, calibration: Path, tp: int = 1) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    convert_model(mode, hf, out, tp=tp, pp=1, calibration=calibration)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Comparable bytes (torch.equal has no float8 kernel on the CPU)."""
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def test_bit_identical_to_modelopt_given_its_amax(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """modelopt calibrates its own activation amax; given those (written into our calibration
    in place of ours), every tensor modelopt writes that TensorRT-LLM reads is ours bit for bit.
    Deliberate differences: modelopt also writes k_ and v_cache_scaling_factor, which
    TensorRT-LLM's loader only merges into kv_cache_scaling_factor by max; our exclude_modules
    lists the embedding beside lm_head."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16)
    ids = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    cfg = {"quant_cfg": mtq.FP8_DEFAULT_CFG["quant_cfg"] + mtq.FP8_KV_CFG["quant_cfg"],
           "algorithm": "max"}  # fmt: skip
    mtq.quantize(model, cfg, forward_loop=lambda m: m(ids))
    export_tensorrt_llm_checkpoint(
        model, decoder_type="llama", dtype=torch.float16, export_dir=str(tmp_path / "modelopt"),
        inference_tensor_parallel=1,
    )  # fmt: skip
    theirs = load_file(tmp_path / "modelopt" / "rank0.safetensors")
    # their input amax, as our statistics (one value on every channel: the per-tensor max)
    stats = load_stats(calibrated)
    for i, layer in enumerate(model.model.layers):
        for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.gate_proj",
                       "mlp.down_proj"):  # fmt: skip
            quantizer = layer.get_submodule(module).input_quantizer
            key = f"model.layers.{i}.{module}.input_absmax"
            stats[key] = torch.full_like(stats[key], float(quantizer.amax.float()))
    (tmp_path / "cal").mkdir()
    save_file(stats, str(tmp_path / "cal" / "calibration.safetensors"))
    ours_dir = _convert(
        tiny_llama, tmp_path / "ours", Fp8(kv_cache="fp8", search=False), tmp_path / "cal"
    )
    ours = load_file(ours_dir / "rank0.safetensors")
    merged_by_trtllm = {n for n in theirs if n.endswith((".k_cache_scaling_factor",
                                                         ".v_cache_scaling_factor"))}  # fmt: skip
    assert merged_by_trtllm and not merged_by_trtllm & set(ours)
    assert sorted(ours) == sorted(set(theirs) - merged_by_trtllm)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype, name
        assert ours[name].shape == theirs[name].shape, name
        assert torch.equal(_bits(ours[name]), _bits(theirs[name])), name
    quant = json.loads((ours_dir / "config.json").read_text())["quantization"]
    their_quant = json.loads((tmp_path / "modelopt" / "config.json").read_text())["quantization"]
    assert (quant["quant_algo"], quant["kv_cache_quant_algo"]) == ("FP8", "FP8")
    assert (their_quant["quant_algo"], their_quant["kv_cache_quant_algo"]) == ("FP8", "FP8")
    assert their_quant["exclude_modules"] == ["lm_head"]
    assert quant["exclude_modules"] == ["lm_head", "transformer.vocab_embedding"]
    # the independent producer's checkpoint conforms to the release table read from upstream
    their_config = json.loads((tmp_path / "modelopt" / "config.json").read_text())
    for contract in CONTRACTS.values():
        assert check_fp8(tmp_path / "modelopt", their_config, contract) == [], contract.release


def test_the_layout_trtllm_build_reads(tiny_llama: Path, calibrated: Path, tmp_path: Path) -> None:
    """Per FP8 linear: e4m3 weight [out, in], float32 (1,) weights_ and activation_scaling_factor
    (TensorRT-LLM's FP8Linear); one qkv scale over q, k, v; gate and fc sharing theirs; the
    activation scale the calibrated input amax / 448; everything else in the model dtype."""
    ck = _convert(tiny_llama, tmp_path / "ck", Fp8(search=False), calibrated)
    w = load_file(ck / "rank0.safetensors")
    hf = load_file(tiny_llama / "model.safetensors")
    stats = load_stats(calibrated)
    p = "transformer.layers.1."
    for linear, module in LINEARS.items():
        assert w[f"{p}{linear}.weight"].dtype == E4M3
        for scale in ("weights_scaling_factor", "activation_scaling_factor"):
            assert w[f"{p}{linear}.{scale}"].dtype == torch.float32
            assert w[f"{p}{linear}.{scale}"].shape == (1,)
        ax = stats[f"model.layers.1.{module}.input_absmax"].amax()
        assert float(w[f"{p}{linear}.activation_scaling_factor"]) == float(ax / 448)
    qkv = torch.cat([hf[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"]).half()
    wsf = w[f"{p}attention.qkv.weights_scaling_factor"]
    assert float(wsf) == float(qkv.abs().amax().float() / 448)
    # dequantized, every weight is within half an e4m3 step of the float16 weight
    deq = w[f"{p}attention.qkv.weight"].float() * wsf
    assert bool(((deq - qkv.float()).abs() <= qkv.float().abs() / 16 + 2**-9 * wsf).all())
    assert torch.equal(
        w[f"{p}mlp.fc.weights_scaling_factor"], w[f"{p}mlp.gate.weights_scaling_factor"]
    )
    for name in (
        "transformer.vocab_embedding.weight",
        "lm_head.weight",
        f"{p}input_layernorm.weight",
    ):
        assert w[name].dtype == torch.float16, name
    assert not any("kv_cache_scaling_factor" in n for n in w)


def test_every_pinned_release_has_a_checkpoint_contract() -> None:
    from trt_builder.engine.releases import RELEASES

    assert sorted(CONTRACTS) == sorted(r.version for r in RELEASES)
    for contract in CONTRACTS.values():
        assert {e.name for e in contract.layer} >= {
            "attention.qkv.weight", "attention.qkv.activation_scaling_factor",
            "mlp.proj.weights_scaling_factor", "attention.kv_cache_scaling_factor",
        }  # fmt: skip


def test_the_conformance_check_names_what_trtllm_build_would_not_load(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """Ours conforms at tp 2 with the FP8 KV cache (the converter checks it too); a scale in
    float16, a missing scale, a weight of the wrong shape, a layer left out of exclude_modules
    but stored in float16, and a quant_algo the FP8 loader does not take are each named."""
    ck = _convert(tiny_llama, tmp_path / "ck", Fp8(kv_cache="fp8", search=False), calibrated, tp=2)
    config = json.loads((ck / "config.json").read_text())
    for contract in CONTRACTS.values():
        assert check_fp8(ck, config, contract) == []
    rank = load_file(ck / "rank0.safetensors")
    p = "transformer.layers.1."
    rank[f"{p}attention.dense.activation_scaling_factor"] = torch.ones((), dtype=torch.float16)
    del rank[f"{p}mlp.fc.weights_scaling_factor"]
    rank[f"{p}mlp.proj.weight"] = rank[f"{p}mlp.proj.weight"][:, :8].contiguous()
    rank[f"{p}mlp.gate.weight"] = torch.zeros(
        rank[f"{p}mlp.gate.weight"].shape, dtype=torch.float16
    )
    save_file(rank, str(ck / "rank0.safetensors"))
    problems = check_fp8(ck, config, CONTRACTS["1.2"])
    assert len(problems) == 4, problems
    for name, said in (("attention.dense.activation_scaling_factor", "F16 []"),
                       ("mlp.fc.weights_scaling_factor", "missing"),
                       ("mlp.proj.weight", "F8_E4M3 [64, 8]"),
                       ("mlp.gate.weight", "F16")):  # fmt: skip
        assert any(f"rank 0: {p}{name}" in x and said in x for x in problems), (name, problems)
    # excluded by its module name (fnmatchcase, as quantize_layers matches): not an FP8 linear
    config["quantization"]["exclude_modules"] = ["lm_head", f"{p}mlp.gate"]
    assert not any("mlp.gate.weight" in x for x in check_fp8(ck, config, CONTRACTS["1.2"]))
    config["quantization"]["quant_algo"] = "FP8_PER_CHANNEL_PER_TOKEN"
    assert "quant_algo 'FP8_PER_CHANNEL_PER_TOKEN' is not FP8" in check_fp8(
        ck, config, CONTRACTS["1.2"]
    )


def test_the_runtime_gemm_is_e4m3_arithmetic(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """The runtime's linear: e4m3(x / a), saturated at 448, times the stored e4m3 weight, scaled
    by a * w; on the CPU every product is exact, so it equals a float64 sum of them closely."""
    ck = _convert(tiny_llama, tmp_path / "ck", Fp8(search=False), calibrated)
    model = CheckpointRuntime.load(ck)
    w = load_file(ck / "rank0.safetensors")
    name = "transformer.layers.0.mlp.proj"
    a, ws = w[f"{name}.activation_scaling_factor"], w[f"{name}.weights_scaling_factor"]
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).half().float()
    x[0, 0] = 1e4 * float(a)  # past 448 steps: saturates
    q = (x.double() / a.double()).clamp(-448, 448).float().to(E4M3).double()
    assert float(q[0, 0]) == 448.0
    expected = (q @ w[f"{name}.weight"].double().T) * float(a * ws)
    torch.testing.assert_close(model._linear(x, name), expected.float().half().float())
    # batch rows do not change a row's answer (static scales; fixed-row blocks while decoding)
    torch.testing.assert_close(model._linear(x[:1], name, fixed=True), model._linear(x, name, fixed=True)[:1], rtol=0, atol=0)  # fmt: skip


def test_fp8_matmul_refuses_nothing_it_cannot_run() -> None:
    """Asked for the tensor cores where the shape does not fit them (K or N not a multiple of
    16), the GEMM says so and runs simulated, with the same result."""
    x = torch.randn(3, 24).to(E4M3)
    w = torch.randn(8, 24).to(E4M3)
    one = torch.ones(1)
    with pytest.warns(UserWarning, match="K=24, N=8 runs simulated"):
        y = fp8_matmul(x, w, one, one * 2, kernel=True)
    torch.testing.assert_close(y, (x.float() @ w.float().T) * 2)


def test_the_fp8_kv_cache(tiny_llama: Path, calibrated: Path, tmp_path: Path) -> None:
    """kv_cache_scaling_factor by modelopt's rule, never below 1.0 (the tiny model's K and V
    stay far below 448); what the cache gives back is e4m3 of x / s times s, saturated; a
    decode through it differs from the float16 cache's where it reads the cache back."""
    fp8kv = _convert(
        tiny_llama, tmp_path / "fp8kv", FloatMode("float16", kv_cache="fp8"), calibrated
    )
    plain = _convert(tiny_llama, tmp_path / "plain", FloatMode("float16"), calibrated)
    w, base = load_file(fp8kv / "rank0.safetensors"), load_file(plain / "rank0.safetensors")
    scales = sorted(n for n in w if n.endswith("kv_cache_scaling_factor"))
    assert scales == [f"transformer.layers.{i}.attention.kv_cache_scaling_factor" for i in (0, 1)]
    assert all(w[n].dtype == torch.float32 and w[n].tolist() == [1.0] for n in scales)
    assert all(torch.equal(w[n], base[n]) for n in base)  # the weights are as they were
    assert (
        json.loads((fp8kv / "config.json").read_text())["quantization"]["kv_cache_quant_algo"]
        == "FP8"
    )
    model, reference = CheckpointRuntime.load(fp8kv), CheckpointRuntime.load(plain)
    x = torch.tensor([0.3, -0.0123, 1000.0, 17.0])
    # 0.0123 is below e4m3's smallest normal (2^-6): a subnormal, in steps of 2^-9
    assert model._kv_store(0, x).tolist() == [0.3125, -0.01171875, 448.0, 16.0]
    decoded = model.forward_decoded(IDS, 4)
    float_decoded = reference.forward_decoded(IDS, 4)
    # the first 4 are one prefill, which attends to its own K/V unquantized, as the engine does
    assert torch.equal(decoded[:, :4], float_decoded[:, :4])
    assert not torch.equal(decoded[:, 4:], float_decoded[:, 4:])
    assert (decoded.argmax(-1) == float_decoded.argmax(-1)).float().mean() >= 0.5


def test_tensor_parallel_ranks_reassemble(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """tp 2: each rank holds its slice of the e4m3 weights and the per-tensor scales whole; the
    ranks merged run exactly as the single-rank checkpoint."""
    one = _convert(tiny_llama, tmp_path / "tp1", Fp8(kv_cache="fp8", search=False), calibrated)
    two = _convert(
        tiny_llama, tmp_path / "tp2", Fp8(kv_cache="fp8", search=False), calibrated, tp=2
    )
    r0, r1 = (load_file(two / f"rank{r}.safetensors") for r in (0, 1))
    full = load_file(one / "rank0.safetensors")
    name = "transformer.layers.0.mlp.proj"
    assert r0[f"{name}.weight"].shape == (64, 64) and full[f"{name}.weight"].shape == (64, 128)
    assert torch.equal(r0[f"{name}.weights_scaling_factor"], r1[f"{name}.weights_scaling_factor"])
    a = CheckpointRuntime.load(two).forward(IDS)
    b = CheckpointRuntime.load(one).forward(IDS)
    assert torch.equal(a, b)


def test_the_runtime_follows_transformers(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """The FP8 checkpoint's next-token choices mostly agree with the float model's (the tiny
    random model's logits are close together, so not all)."""
    from transformers import AutoModelForCausalLM

    ck = _convert(tiny_llama, tmp_path / "ck", Fp8(search=False), calibrated)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(IDS).logits
    ours = CheckpointRuntime.load(ck).forward(IDS)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= 0.5 and float((ours - ref).abs().max()) < 2.0


@pytest.fixture(scope="module")
def wide_fp8(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An FP8 checkpoint with the FP8 KV cache of 2 layers of SmolLM2-135M's width (hidden
    576, 9 heads of 64, 3 KV heads, intermediate 1536: every K and N a multiple of 16)."""
    from tiny_models import make_tiny_llama

    root = tmp_path_factory.mktemp("wide-fp8")
    make_tiny_llama(root / "hf", tokenizer_dir, hidden_size=576, intermediate_size=1536,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64)  # fmt: skip
    (root / "cal").mkdir()
    calibrate(root / "hf", root / "cal", CalibrationOptions(samples=8, seq_len=64))
    return _convert(root / "hf", root / "ck", Fp8(kv_cache="fp8", search=False), root / "cal")


@pytest.mark.gpu
def test_on_cuda_the_tensor_cores_run_and_agree_with_the_cpu(
    wide_fp8: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an SM 89+ GPU every FP8 GEMM runs on the tensor cores (torch._scaled_mm, no shape
    falls back), and each linear's output, given the same input, is the CPU simulation's to
    within the tensor cores' accumulation (measured on the H200: 1.6e-4 of the output range).
    Whole-model agreement on random weights is only printed: there a float32 difference that
    moves one activation across an e4m3 rounding boundary changes it by up to 1/16, and random
    logits are close together (H200: 0.88-0.94 teacher-forced top-1 against 0.9995 for the same
    model in float16); benchmarks/fp8_gpu.py measures it on the default model."""
    import warnings

    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(3, 380, (32, 48), generator=torch.Generator().manual_seed(3))
    cpu = CheckpointRuntime.load(wide_fp8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a simulated fallback warns
        cuda = CheckpointRuntime.load(wide_fp8, "cuda")
        on_gpu = cuda.forward(ids.cuda()).cpu()
        x = torch.randn(64, 576, generator=torch.Generator().manual_seed(4)).half().float()
        for linear in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate"):
            name = f"transformer.layers.1.{linear}"
            gpu_y, cpu_y = cuda._linear(x.cuda(), name).cpu(), cpu._linear(x, name)
            scale = float(cpu_y.abs().max())
            torch.testing.assert_close(gpu_y, cpu_y, rtol=0, atol=2e-3 * scale, msg=name)
    assert len(calls) >= 2 * 5  # every linear of both layers, at least once
    top1 = float((on_gpu.argmax(-1) == cpu.forward(ids).argmax(-1)).float().mean())
    print(f"random model: cuda vs cpu teacher-forced top-1 {top1:.4f} of {ids.numel()}")


@pytest.mark.gpu
def test_the_fp8_gemm_on_tensor_cores_equals_the_simulation_closely() -> None:
    """Random e4m3 operands of a 7B layer's shape: _scaled_mm's float32 sums against the
    simulation's exact products summed in float32: within 1e-3 of the output's range (the
    H200 measured 1.6e-4: Hopper's FP8 accumulation is not full float32)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=g).to(E4M3)
    w = (torch.randn(11008, 4096, generator=g) * 0.5).to(E4M3)
    a, ws = torch.tensor([0.02]), torch.tensor([0.003])
    sim = fp8_matmul(x, w, a, ws, kernel=False)
    tc = fp8_matmul(x.cuda(), w.cuda(), a.cuda(), ws.cuda()).cpu()
    torch.testing.assert_close(tc, sim, rtol=0, atol=1e-3 * float(sim.abs().max()))


@pytest.mark.parametrize("mode", [SmoothQuant(alpha=0.5, kv_cache="fp8"),
                                  WeightOnlyInt8(kv_cache="fp8")], ids=["int8-sq", "int8-wo"])  # fmt: skip
def test_the_fp8_kv_cache_beside_int8_linears(
    mode: QuantMode, tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """SmoothQuant and INT8 weight-only take the FP8 KV cache too (TensorRT-LLM refuses neither):
    its scales beside their own tensors, and a decode through it."""
    ck = _convert(tiny_llama, tmp_path / "ck", mode, calibrated)
    quant = json.loads((ck / "config.json").read_text())["quantization"]
    assert quant["kv_cache_quant_algo"] == "FP8" and quant["quant_algo"] == mode.quant_algo
    w = load_file(ck / "rank0.safetensors")
    assert [w[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"].tolist()
            for i in (0, 1)] == [[1.0], [1.0]]  # fmt: skip
    runtime = CheckpointRuntime.load(ck)
    assert runtime.kv_fp8 and bool(torch.isfinite(runtime.forward_decoded(IDS, 4)).all())


@pytest.mark.gpu
def test_converting_on_cuda_writes_the_cpus_bytes(
    tiny_llama: Path, calibrated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where there is a GPU the FP8 layer arithmetic runs there (as SmoothQuant's); the float32
    division and the e4m3 cast round the same on both, so the checkpoint is byte for byte the
    CPU's."""
    on_gpu = _convert(tiny_llama, tmp_path / "gpu", Fp8(kv_cache="fp8", search=False), calibrated)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    on_cpu = _convert(tiny_llama, tmp_path / "cpu", Fp8(kv_cache="fp8", search=False), calibrated)
    a, b = load_file(on_gpu / "rank0.safetensors"), load_file(on_cpu / "rank0.safetensors")
    assert sorted(a) == sorted(b)
    differ = [name for name in a if not torch.equal(_bits(a[name]), _bits(b[name]))]
    assert differ == []
