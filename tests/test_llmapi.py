"""--target llmapi: the Hugging Face checkpoint TensorRT-LLM's PyTorch backend and vLLM load
(targets/llmapi/checkpoint/unified.py, targets/llmapi/checkpoint/loaders.py), the same numbers as the engine target's
checkpoint, modelopt 0.47's export_hf_checkpoint given the same amax, and the llmapi Triton
repository served by the real tritonserver (the reference backend behind the template's
contract). The refusals, with nothing written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from trt_builder.calibrate.stats import calibrate, load_stats
from trt_builder.checkpoint.reader import read_checkpoint
from trt_builder.convert.model import convert_model
from trt_builder.modes import FloatMode, Fp8, QuantMode
from trt_builder.spec.build import CalibrationOptions
from trt_builder.targets.llmapi.checkpoint.loaders import CONTRACTS, check_unified
from trt_builder.targets.llmapi.convert import convert_llmapi

pytestmark = pytest.mark.integration
E4M3 = torch.float8_e4m3fn
MODES = {"float16": FloatMode("float16"), "fp8": Fp8(search=False),
         "fp8-fp8kv": Fp8(kv_cache="fp8", search=False)}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from tiny_models import make_tiny

    path = tmp_path_factory.mktemp("gpt2") / "gpt2"
    make_tiny("gpt2", path, tokenizer_dir)
    return path


@pytest.fixture(scope="module")
def calibrated(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibration")
    calibrate(tiny_llama, out, CalibrationOptions(samples=8, seq_len=64))
    return out


def _llmapi(hf: Path, out: Path, mode: QuantMode, calibration: Path) -> Path:
    out.mkdir(parents=True)
    convert_llmapi(mode, hf, out, calibration=calibration, recipe=None)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E4M3 else t


@pytest.mark.parametrize("name", sorted(MODES))
def test_read_back_it_is_the_engine_targets_checkpoint(
    name: str, tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """The Hugging Face checkpoint read into TensorRT-LLM names is the engine target's
    checkpoint bit for bit: the same weights, scales and config, so verify, the runtime and the
    reference backend run the same numbers for both targets. The FP8 KV cache's scale reads as
    1.0, as TensorRT-LLM's PyTorch backend runs it."""
    mode = MODES[name]
    hf = _llmapi(tiny_llama, tmp_path / "hf", mode, calibrated)
    engine = tmp_path / "engine"
    engine.mkdir()
    convert_model(mode, tiny_llama, engine, tp=1, pp=1, calibration=calibrated)
    config, tensors = read_checkpoint(hf)
    want_config, want = read_checkpoint(engine)
    assert sorted(tensors) == sorted(want)
    for key in want:
        assert tensors[key].dtype == want[key].dtype and tensors[key].shape == want[key].shape, key
        if key.endswith("kv_cache_scaling_factor"):
            assert tensors[key].tolist() == [1.0]
            continue
        assert torch.equal(_bits(tensors[key]), _bits(want[key])), key
    for key in set(want_config) - {"quantization"}:
        assert config[key] == want_config[key], key
    quant, want_quant = config["quantization"], want_config["quantization"]
    assert (quant["quant_algo"], quant["kv_cache_quant_algo"]) == (
        want_quant["quant_algo"], want_quant["kv_cache_quant_algo"])  # fmt: skip


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_every_family_the_target_builds_reads_back_as_its_engine_checkpoint(
    family: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The other Llama-style families (Qwen2's qkv bias, Qwen3's q/k norms) in fp8: the
    Hugging Face checkpoint holds the model's own names and reads back bit for bit."""
    from tiny_models import make_tiny

    hf = tmp_path / family
    make_tiny(family, hf, tokenizer_dir)
    calibration = tmp_path / "cal"
    calibration.mkdir()
    calibrate(hf, calibration, CalibrationOptions(samples=4, seq_len=32))
    ours = _llmapi(hf, tmp_path / "llmapi", MODES["fp8"], calibration)
    source = set(load_file(hf / "model.safetensors"))
    written = set(load_file(ours / "model.safetensors"))
    scales = {n for n in written if n.endswith(("weight_scale", "input_scale"))}
    assert written - scales == source and scales
    engine = tmp_path / "engine"
    engine.mkdir()
    convert_model(MODES["fp8"], hf, engine, tp=1, pp=1, calibration=calibration)
    _, tensors = read_checkpoint(ours)
    _, want = read_checkpoint(engine)
    assert sorted(tensors) == sorted(want)
    assert all(torch.equal(_bits(tensors[k]), _bits(want[k])) for k in want)


def test_the_files_and_tensors_the_loaders_read(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """fp8 + FP8 KV cache: hf_quant_config.json's table (TensorRT-LLM's), config.json's
    quantization_config (vLLM's), per linear an e4m3 [out, in] weight with float32 scalar
    scales, q/k/v and gate/up sharing one weight scale, k_scale and v_scale the calibrated K
    (after RoPE) and V amax / 448, the tokenizer beside them; each loader's contract holds,
    and a checkpoint without an input_scale breaks vLLM's and not TensorRT-LLM's."""
    hf = _llmapi(tiny_llama, tmp_path / "hf", MODES["fp8-fp8kv"], calibrated)
    assert {"config.json", "hf_quant_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "generation_config.json"} <= {p.name for p in hf.iterdir()}  # fmt: skip
    table = json.loads((hf / "hf_quant_config.json").read_text())
    assert table["quantization"] == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                     "exclude_modules": ["lm_head", "model.embed_tokens"]}  # fmt: skip
    assert table["producer"]["name"] == "trt-builder"
    config = json.loads((hf / "config.json").read_text())
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "FP8")
    assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    assert config["torch_dtype"] == config["dtype"] == "float16"
    w = load_file(hf / "model.safetensors")
    stats = load_stats(calibrated)
    for i in range(2):
        p = f"model.layers.{i}."
        for linear in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
            assert w[p + linear + ".weight"].dtype == E4M3
            for scale in ("weight_scale", "input_scale"):
                assert w[f"{p}{linear}.{scale}"].dtype == torch.float32
                assert w[f"{p}{linear}.{scale}"].shape == ()
            amax = stats[f"{p}{linear}.input_absmax"].float().amax()
            assert w[f"{p}{linear}.input_scale"] == amax / 448
        q, k, v = (w[f"{p}self_attn.{x}_proj.weight_scale"] for x in "qkv")
        assert q == k == v
        assert w[f"{p}mlp.gate_proj.weight_scale"] == w[f"{p}mlp.up_proj.weight_scale"]
        v_amax = stats[f"{p}self_attn.v_proj.output_absmax"].float().amax()
        assert w[f"{p}self_attn.v_proj.v_scale"] == v_amax / 448
        k_rows = stats[f"{p}self_attn.k_proj.output_absmax"].float().view(2, 16)  # 2 heads of 16
        k_amax = torch.hypot(k_rows[:, :8], k_rows[:, 8:]).amax()  # RoPE pairs (d, d + 8)
        assert torch.allclose(w[f"{p}self_attn.k_proj.k_scale"], k_amax / 448, rtol=1e-6)
    assert w["lm_head.weight"].dtype == w["model.embed_tokens.weight"].dtype == torch.float16
    for contract in CONTRACTS.values():
        assert check_unified(hf, contract) == [], contract.loader
    del w["model.layers.1.mlp.down_proj.input_scale"]
    save_file(w, str(hf / "model.safetensors"))
    broken = {c.loader: check_unified(hf, c) for c in CONTRACTS.values()}
    assert (
        broken["tensorrt-llm 1.2"] == [] and "input_scale is missing" in broken["vllm 0.10-0.34"][0]
    )


def test_the_float16_checkpoint_is_the_model_transformers_runs(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """transformers loads the float16 checkpoint as the source model in float16: the same
    logits, bit for bit (the names are the model's own)."""
    from transformers import AutoModelForCausalLM

    hf = _llmapi(tiny_llama, tmp_path / "hf", MODES["float16"], calibrated)
    ids = torch.tensor([[5, 17, 42, 99, 7, 250, 3]])
    ours = AutoModelForCausalLM.from_pretrained(hf).eval()
    source = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16).eval()
    assert ours.dtype == torch.float16
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, source(ids).logits)


def test_against_modelopt_export_hf_checkpoint_given_its_amax(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """modelopt 0.47's FP8_DEFAULT_CFG + FP8_KV_CFG through export_hf_checkpoint, its amax
    written into our statistics: every tensor has modelopt's name, dtype and shape; the scales,
    norms, embedding and lm_head are modelopt's bit for bit (k_scale to a float32 rounding:
    ours is the bound after RoPE, here given modelopt's measured amax). Two deliberate
    differences (docs/llmapi.md):
    - modelopt gives q, k and v (gate and up) each its own weight scale, and both loaders
      requantize them to the largest at load; ours are rounded once at the largest;
    - modelopt's HF export divides the float16 weight by a 0-dim float32 scale, which torch
      computes in float16, then rounds to e4m3: twice. Ours divide in float32 (as its TensorRT-
      LLM export does, bit-identical there), so each weight is the e4m3 value nearest the exact
      quotient, and never further from it than modelopt's."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16)
    ids = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    cfg = {"quant_cfg": mtq.FP8_DEFAULT_CFG["quant_cfg"] + mtq.FP8_KV_CFG["quant_cfg"],
           "algorithm": "max"}  # fmt: skip
    mtq.quantize(model, cfg, forward_loop=lambda m: m(ids))
    export_hf_checkpoint(model, export_dir=str(tmp_path / "modelopt"))
    theirs = load_file(tmp_path / "modelopt" / "model.safetensors")
    stats = load_stats(calibrated)
    for i in range(2):
        p = f"model.layers.{i}."
        for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.gate_proj",
                       "mlp.down_proj"):  # fmt: skip
            key = f"{p}{module}.input_absmax"
            amax = model.get_submodule(f"model.layers.{i}.{module}").input_quantizer.amax
            stats[key] = torch.full_like(stats[key], float(amax.float()))
        attention = model.model.layers[i].self_attn
        v = f"{p}self_attn.v_proj.output_absmax"
        stats[v] = torch.full_like(stats[v], float(attention.v_bmm_quantizer.amax.float()))
        k = f"{p}self_attn.k_proj.output_absmax"  # hypot(a / sqrt 2, a / sqrt 2) = a
        a = float(attention.k_bmm_quantizer.amax.float())
        stats[k] = torch.full_like(stats[k], a / math.sqrt(2))
    (tmp_path / "cal").mkdir()
    save_file(stats, str(tmp_path / "cal" / "calibration.safetensors"))
    ours_dir = _llmapi(tiny_llama, tmp_path / "ours", MODES["fp8-fp8kv"], tmp_path / "cal")
    ours = load_file(ours_dir / "model.safetensors")
    source = {n: t.half() for n, t in load_file(tiny_llama / "model.safetensors").items()}
    assert sorted(ours) == sorted(theirs)
    fused = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
             "mlp.up_proj"}  # fmt: skip
    differ = total = 0
    for name in sorted(ours):
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape
        module = ".".join(name.split(".")[3:5])
        if ours[name].dtype == E4M3:
            scale = ours[name.removesuffix("weight") + "weight_scale"].double()
            exact = source[name].double() / scale
            assert torch.equal(_bits(ours[name]), _bits(exact.to(E4M3))), name  # nearest
            if module in fused:  # at modelopt's own scale, their shard is within a step
                their = theirs[name].double() * theirs[name + "_scale"].double() / scale
                assert ((their - ours[name].double()).abs() <= exact.abs() / 8 + 2**-9).all()
                continue
            mine, their = ours[name].double(), theirs[name].double()
            assert ((mine - exact).abs() <= (their - exact).abs()).all(), name
            differ += int((mine != their).sum())
            total += mine.numel()
            continue
        if module in fused and name.endswith(".weight_scale"):
            group = ("q", "k", "v") if "self_attn" in name else ("gate", "up")
            base = name.split(module)[0] + module.split(".")[0]
            largest = max(theirs[f"{base}.{g}_proj.weight_scale"] for g in group)
            assert ours[name] == largest, name
        elif name.endswith("k_scale"):
            assert torch.allclose(ours[name], theirs[name], rtol=1e-6), name
        else:
            assert torch.equal(ours[name], theirs[name]), name
    assert 0 < differ < total / 100  # modelopt's float16 quotient lands elsewhere, rarely
    their_config = json.loads((tmp_path / "modelopt" / "config.json").read_text())
    our_config = json.loads((ours_dir / "config.json").read_text())
    drop = {"producer"}
    assert {k: v for k, v in our_config["quantization_config"].items() if k not in drop} == {
        k: v for k, v in their_config["quantization_config"].items() if k not in drop}  # fmt: skip
    their_table = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())
    our_table = json.loads((ours_dir / "hf_quant_config.json").read_text())
    assert our_table["quantization"] == their_table["quantization"]
    for contract in CONTRACTS.values():  # the independent producer conforms to the table too
        assert check_unified(tmp_path / "modelopt", contract) == [], contract.loader


def test_int8_wo_is_what_the_pytorch_backend_reads_and_what_the_runtime_runs(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """int8-wo (W8A16), TensorRT-LLM's PyTorch backend only: per linear an int8 [out, in]
    weight and a scale per output row, as modelopt 0.47's export_hf_checkpoint writes after
    INT8_WEIGHT_ONLY_CFG (same names, dtypes and shapes; tested below against its output).
    The difference: our scale is amax / 127 rounded to the model dtype before the weights are
    rounded against it (the loader casts it to the model dtype: modelopt's weights are rounded
    against a float32 scale the GEMM does not use), so each INT8 value is the nearest to the
    weight at the scale the GEMM uses, and at most one step from modelopt's. vLLM refuses
    W8A16 (its contract says so; the build notes it). Read back, the checkpoint runtime
    multiplies the INT8 values by their scales, as the GEMM does."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from trt_builder.modes import WeightOnlyInt8
    from trt_builder.runtimes.checkpoint import CheckpointRuntime

    out = tmp_path / "ours"
    out.mkdir()
    summary = convert_llmapi(WeightOnlyInt8(clip=False), tiny_llama, out, calibration=None,
                             recipe=None)  # fmt: skip
    assert summary["loaders"] == ["tensorrt-llm 1.0", "tensorrt-llm 1.1", "tensorrt-llm 1.2"]
    assert "vllm 0.10-0.34 refuse W8A16" in summary["notes"][-1]
    vllm = check_unified(out, CONTRACTS["vllm 0.10-0.34"])
    assert len(vllm) == 1 and "quant_algo 'W8A16'" in vllm[0]
    table = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert table == {"quant_algo": "W8A16", "kv_cache_quant_algo": None,
                     "exclude_modules": ["lm_head", "model.embed_tokens"]}  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16)
    ids = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, mtq.INT8_WEIGHT_ONLY_CFG, forward_loop=lambda m: m(ids))
    export_hf_checkpoint(model, export_dir=str(tmp_path / "modelopt"))
    theirs = load_file(tmp_path / "modelopt" / "model.safetensors")
    ours = load_file(out / "model.safetensors")
    source = {n: t.half() for n, t in load_file(tiny_llama / "model.safetensors").items()}
    assert sorted(ours) == sorted(theirs)
    quantized = [n for n in ours if ours[n].dtype == torch.int8]
    assert len(quantized) == 14
    for name in sorted(ours):
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape
        if name in quantized:
            scale = ours[name + "_scale"]
            assert torch.equal(scale, theirs[name + "_scale"].half().float()), name
            exact = source[name].float() / scale[:, None]
            assert ((ours[name].float() - exact).abs() <= 0.5 + 1e-6).all(), name  # nearest
            assert (ours[name].float() - theirs[name].float()).abs().max() <= 1, name
        elif not name.endswith("weight_scale"):
            assert torch.equal(ours[name], theirs[name]), name
    runtime = CheckpointRuntime.load(out)
    weight = runtime._dense["transformer.layers.0.mlp.proj.weight"]
    assert torch.equal(weight, ours["model.layers.0.mlp.down_proj.weight"].float()
                       * ours["model.layers.0.mlp.down_proj.weight_scale"][:, None])  # fmt: skip


REFUSALS = {  # argv -> (exit code, words the one line must have)
    ("--dtype", "int8"): (2, ("SmoothQuant", "fp8", "int8-wo")),
    ("--dtype", "int8", "--sq-granularity", "per-tensor"): (2, ("SmoothQuant", "fp8")),
    ("--dtype", "float16", "--kv-cache", "int8"): (2, ("INT8 KV cache", "--kv-cache fp8")),
    ("--dtype", "int8-wo", "--kv-cache", "int8"): (2, ("INT8 KV cache", "--kv-cache fp8")),
    ("--dtype", "float16", "--kv-cache", "fp8"): (2, ("quant_algo", "--dtype fp8 --kv-cache fp8")),
}


@pytest.mark.parametrize("argv", list(REFUSALS), ids=" ".join)
def test_what_the_target_does_not_build_is_refused_in_one_line(
    argv: tuple[str, ...], tiny_llama: Path, tmp_path: Path
) -> None:
    code, words = REFUSALS[argv]
    proc = _cli("build", "--model", str(tiny_llama), "--target", "llmapi", *argv,
                "--out", str(tmp_path / "e"), "--triton-root", str(tmp_path / "t"))  # fmt: skip
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), lines
    assert not (tmp_path / "e").exists() and not (tmp_path / "t").exists()


def test_a_family_the_pytorch_backend_lacks_and_a_bad_target_are_refused(
    tiny_gpt2: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    proc = _cli("build", "--model", str(tiny_gpt2), "--target", "llmapi",
                "--out", str(tmp_path / "e"), "--triton-root", str(tmp_path / "t"))  # fmt: skip
    assert proc.returncode == 4, proc.stderr
    assert "no GPT-2 model" in proc.stderr and "--target engine" in proc.stderr
    assert not (tmp_path / "e").exists()
    proc = _cli(
        "build", "--model", str(tiny_llama), "--target", "vllm", "--out", str(tmp_path / "e")
    )
    assert proc.returncode == 2 and "'vllm' is not one of 'engine', 'llmapi'" in proc.stderr
    assert not (tmp_path / "e").exists()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("trt-builder")
    return subprocess.run([str(exe), *argv], capture_output=True, text=True, timeout=600)


# -- served by the real tritonserver -----------------------------------------------------------

OPEN_GATE = {"verify.min_top1": 0.0, "verify.max_kl": 1e6, "verify.max_ppl_delta_pct": 1e6,
             "verify.heldout_tokens": 128, "calibrate.samples": 8, "calibrate.seq_len": 64}  # fmt: skip
TEXTS = ["def main():", "The answer is", "import numpy as np\n"]


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The tiny Llama built --target llmapi --dtype fp8 --kv-cache fp8 (no search), packaged
    plain and streaming, each served; the checkpoint runtime's greedy answers to TEXTS."""
    from test_serve import _ports
    from transformers import AutoTokenizer

    from trt_builder.pipeline import run
    from trt_builder.runtimes.checkpoint import CheckpointRuntime
    from trt_builder.spec.build import make_spec
    from trt_builder.triton.server import start

    root = tmp_path_factory.mktemp("llmapi-served")
    spec = {"model": str(tiny_llama), "target": "llmapi", "dtype": "fp8", "kv_cache": "fp8",
            "fp8.search": False, "out": root / "engines", **OPEN_GATE}  # fmt: skip
    plain = run(make_spec(**spec, triton_root=root / "a"))
    stream = run(make_spec(**spec, triton_root=root / "b", **{"triton.streaming": True}))
    checkpoint = plain.layout.checkpoint
    runtime = CheckpointRuntime.load(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    want = {}
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        new = runtime.greedy(ids, 12, {2})
        want[text] = (tokenizer.decode(new, skip_special_tokens=True),
                      tokenizer.decode(ids + new, skip_special_tokens=True))  # fmt: skip
    with (
        start(plain.layout.triton, **_ports(root / "a.log")) as a,
        start(stream.layout.triton, **_ports(root / "b.log")) as b,
    ):
        yield {"plain": a, "streaming": b, "want": want, "build": plain}


def test_the_build_writes_the_checkpoint_and_the_llmapi_repository(served: dict[str, Any]) -> None:
    import yaml

    build = served["build"]
    assert build.layout.variant == "fp8-nosearch-fp8kv-llmapi-tp1-pp1"
    stages = {r.name: r.status for r in build.records}
    assert "engine" not in stages and stages["package"] == "ran" and stages["verify"] == "ran"
    repo = build.layout.triton
    assert sorted(p.name for p in repo.iterdir()) == [
        "stage.json", "tensorrt_llm", "trt-builder-repository.json"]  # fmt: skip
    settings = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    # through the repository link, as the engine target's gpt_model_path names its engine
    assert settings["model"] == f"{repo.parent.resolve()}/{repo.name}/tensorrt_llm/1/checkpoint"
    assert settings["backend"] == "pytorch" and settings["triton_config"] == {
        "max_batch_size": 0, "decoupled": False}  # fmt: skip
    assert (repo / "tensorrt_llm" / "1" / "checkpoint" / "hf_quant_config.json").is_file()
    # trtllm-serve, outside Triton: its options file beside the checkpoint, and the command
    serve = yaml.safe_load((repo / "tensorrt_llm" / "1" / "trtllm-serve.yaml").read_text())
    assert serve == {k: settings[k] for k in ("max_batch_size", "max_num_tokens", "max_seq_len",
                                              "kv_cache_config")}  # fmt: skip
    package = next(r for r in build.records if r.name == "package")
    assert package.details["command"].split() == [
        "trtllm-serve", settings["model"], "--backend", "pytorch", "--host", "0.0.0.0",
        "--port", "8000", "--tp_size", "1", "--pp_size", "1", "--extra_llm_api_options",
        settings["model"].removesuffix("/checkpoint") + "/trtllm-serve.yaml"]  # fmt: skip


def test_the_reference_backend_answers_what_the_checkpoint_runtime_answers(
    served: dict[str, Any],
) -> None:
    """The template's contract over HTTP and gRPC: text_output holds the prompt and the answer
    (exclude_input_from_output false, its default), or the answer alone; finish_reason when
    asked; streamed, every response the whole text so far, the last one the answer."""
    from trt_builder.triton import client

    want = served["want"]
    for url in (served["plain"].http_url, served["plain"].grpc_url):
        for text in TEXTS:
            request = client.Request(prompt=text, max_tokens=12)
            assert client.generate(url, request) == want[text][0], (url, text)
    import tritonclient.http as http

    c = http.InferenceServerClient(served["plain"].http_url.split("://")[1])
    inputs = [_input(http, "text_input", np.array([TEXTS[0]], dtype=object), "BYTES"),
              _input(http, "sampling_param_max_tokens", np.array([12], np.int32), "INT32"),
              _input(http, "return_finish_reason", np.array([True]), "BOOL")]  # fmt: skip
    result = c.infer("tensorrt_llm", inputs)
    assert result.as_numpy("text_output")[0].decode() == want[TEXTS[0]][1]
    assert result.as_numpy("finish_reason")[0].decode() in ("stop", "length")
    url = served["streaming"].grpc_url
    for text in TEXTS:
        pieces = list(client.stream(url, client.Request(prompt=text, max_tokens=12)))
        assert "".join(pieces) == want[text][0] and len(pieces) > 1, text


def test_temperature_zero_is_greedy_and_what_sampling_params_refuses_is_refused_in_its_words(
    served: dict[str, Any],
) -> None:
    """sampling_param_temperature 0.0 (with top_k 50, which alone would sample) answers as
    greedy decoding does: TensorRT-LLM's SamplingParams takes temperature 0 as greedy (1.2+;
    examples/llm-api/llm_sampling.py); a negative one comes back as its ValueError's text."""
    import tritonclient.http as http

    c = http.InferenceServerClient(served["plain"].http_url.split("://")[1])

    def ask(**sampling: tuple[np.ndarray, str]) -> Any:
        inputs = [
            _input(http, "text_input", np.array([TEXTS[0]], dtype=object), "BYTES"),
            _input(http, "sampling_param_max_tokens", np.array([12], np.int32), "INT32"),
        ]
        inputs += [_input(http, f"sampling_param_{k}", v, t) for k, (v, t) in sampling.items()]
        return c.infer("tensorrt_llm", inputs)  # fmt: skip

    greedy = ask(temperature=(np.array([0.0], np.float32), "FP32"),
                 top_k=(np.array([50], np.int32), "INT32"),
                 seed=(np.array([7], np.uint64), "UINT64"))  # fmt: skip
    assert greedy.as_numpy("text_output")[0].decode() == served["want"][TEXTS[0]][1]
    with pytest.raises(Exception, match="require temperature >= 0, got temperature=-0.5"):
        ask(temperature=(np.array([-0.5], np.float32), "FP32"))
    assert served["plain"].process.poll() is None


def test_streaming_on_a_plain_repository_is_the_templates_error(served: dict[str, Any]) -> None:
    import tritonclient.http as http

    c = http.InferenceServerClient(served["plain"].http_url.split("://")[1])
    inputs = [_input(http, "text_input", np.array(["hi"], dtype=object), "BYTES"),
              _input(http, "streaming", np.array([True]), "BOOL")]  # fmt: skip
    with pytest.raises(Exception, match="Streaming is only supported in decoupled mode"):
        c.infer("tensorrt_llm", inputs)
    assert served["plain"].process.poll() is None  # the server goes on


def test_an_image_to_a_text_models_repository_is_refused_before_it_is_sent(
    served: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from trt_builder.cli.main import main

    code = main(["infer", "--url", served["plain"].grpc_url, "--prompt", "hi", "--image",
                 "https://example.com/cat.png"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 3 and "--image: tensorrt_llm declares no image_url input" in err
    assert len(err.strip().splitlines()) == 1


def _input(module: Any, name: str, value: np.ndarray, dtype: str) -> Any:
    item = module.InferInput(name, list(value.shape), dtype)
    item.set_data_from_numpy(value)
    return item


def test_package_check_refuses_an_llmapi_repository_that_would_not_load(
    served: dict[str, Any], tmp_path: Path
) -> None:
    """package --check validates the llmapi layout: model.yaml and config.pbtxt must agree on
    the transaction policy (model.py reads one, Triton the other); no batch dimension; only
    known model.yaml keys."""
    import shutil

    from trt_builder.cli.main import main

    repo = tmp_path / "repo"
    shutil.copytree(served["build"].layout.triton.resolve(), repo)
    assert main(["package", "--check", str(repo)]) == 0
    cases = [
        ("tensorrt_llm/1/model.yaml", "decoupled: false", "decoupled: true", "must agree"),
        ("tensorrt_llm/config.pbtxt", 'backend: "python"', 'backend: "python"\nmax_batch_size: 8',
         "without max_batch_size"),
        ("tensorrt_llm/1/model.yaml", "backend: pytorch", "backend: pytorch\nspeculative: 1",
         "unknown keys"),
    ]  # fmt: skip
    for path, old, new, words in cases:
        text = (repo / path).read_text()
        assert old in text
        (repo / path).write_text(text.replace(old, new, 1))
        proc = _cli("package", "--check", str(repo))
        assert proc.returncode == 8 and words in proc.stderr, (path, proc.stderr)
        (repo / path).write_text(text)


def test_a_repository_for_tensorrt_llms_own_model_links_the_containers_template(
    served: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """[triton] backend tensorrtllm: model.py and helpers.py link to the template where the NGC
    container keeps it, config.pbtxt is the template's without the reference backend's
    parameters; package --check passes; serve here refuses in one line (exit 8), nothing
    started. auto picks it where TensorRT-LLM is installed."""
    import os

    from trt_builder.cli.main import main
    from trt_builder.pipeline import run
    from trt_builder.spec.build import make_spec
    from trt_builder.targets.llmapi.triton import (
        LLMAPI_IN,
        TEMPLATE,
        llmapi_backend,
        validate_llmapi,
    )

    build = served["build"]
    spec = make_spec(model=build.spec.model, target="llmapi", dtype="fp8", kv_cache="fp8",
                     out=build.spec.out, triton_root=tmp_path / "t",
                     **{**OPEN_GATE, "fp8.search": False, "triton.backend": "tensorrtllm"})  # fmt: skip
    result = run(spec)
    assert {r.name: r.status for r in result.records}["convert"] == "cached"
    package = next(r for r in result.records if r.name == "package")
    assert package.details["backend"] == "tensorrtllm" and TEMPLATE in package.details["note"]
    repo = result.layout.triton
    version = repo / "tensorrt_llm" / "1"
    assert os.readlink(version / "model.py") == f"{TEMPLATE}/model.py"
    assert os.readlink(version / "helpers.py") == f"{TEMPLATE}/helpers.py"
    config = validate_llmapi(repo)
    assert "implementation" not in config.parameters
    assert [t.name for t in config.input] == [name for name, *_ in LLMAPI_IN]
    assert (version / "checkpoint" / "model.safetensors").is_file()
    assert main(["package", "--check", str(repo)]) == 0
    capsys.readouterr()
    code = main(["serve", str(repo), "--http-port", "1", "--grpc-port", "2", "--metrics-port", "3"])
    err = capsys.readouterr().err
    assert code == 8 and f"linked from {TEMPLATE}, which this host lacks" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert llmapi_backend("auto") == "reference"  # TensorRT-LLM is not installed here
    fake = tmp_path / "site" / "tensorrt_llm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(fake.parent))
    assert llmapi_backend("auto") == "tensorrtllm" and llmapi_backend("reference") == "reference"


def test_a_new_version_of_an_llmapi_repository_is_reloaded(served: dict[str, Any]) -> None:
    """`package` publishes version 2 of the served llmapi repository; Server.reload (what serve
    does when the link moves) loads the llmapi model alone at version 2 (it once asked Triton
    for the engine target's four models, which an llmapi repository does not have, and
    failed), and it answers as before. Last in this module: the plain server is at version 2
    after it."""
    import urllib.request
    from dataclasses import replace

    from trt_builder.pipeline import run
    from trt_builder.triton.client import Request, generate

    server, build = served["plain"], served["build"]
    want = generate(server.http_url, Request(prompt=TEXTS[0], max_tokens=12))
    spec = replace(
        build.spec, triton=replace(build.spec.triton, kv_cache_free_gpu_mem_fraction=0.8)
    )
    assert {r.name: r.status for r in run(spec).records}["package"] == "ran"
    assert server.reload() == 2
    index = urllib.request.Request(f"{server.http_url}/v2/repository/index", data=b"{}")
    with urllib.request.urlopen(index) as answer:
        ready = {(m["name"], m["version"]) for m in json.loads(answer.read())
                 if m.get("state") == "READY"}  # fmt: skip
    assert ready == {("tensorrt_llm", "2")}
    assert generate(server.http_url, Request(prompt=TEXTS[0], max_tokens=12)) == want
