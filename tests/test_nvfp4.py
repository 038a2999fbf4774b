"""NVFP4 on tiny random Llamas, against nvidia-modelopt 0.47: the number format is modelopt's
bit for bit (codes, block scales, global scale, packing); our TensorRT-LLM checkpoint has
modelopt's export's layout tensor for tensor, and its weights and weight scales given the same
weights; the llmapi target's checkpoint has modelopt's unified export's layout, quantization
table and config, and runs as the engine checkpoint does; tensor-parallel ranks merge back
bit for bit; the refusals. (modelopt's NVFP4 fake quantization asserts a CUDA device, so its
quantized model's logits cannot be compared here: the H200 run does.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trt_builder.calibrate.stats import calibrate
from trt_builder.checkpoint import nvfp4
from trt_builder.convert.model import convert_model
from trt_builder.core.errors import ConversionError, SpecError
from trt_builder.modes import Nvfp4
from trt_builder.runtimes.checkpoint import CheckpointRuntime
from trt_builder.spec.build import CalibrationOptions, make_spec

pytestmark = pytest.mark.integration
IDS = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 300, 21]])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def calibrated(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibration")
    calibrate(tiny_llama, out, CalibrationOptions(samples=8, seq_len=64))
    return out


@pytest.fixture(scope="module")
def modelopt_nvfp4(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """modelopt's NVFP4_DEFAULT_CFG on the tiny Llama in float16, exported for trtllm-build and
    in the unified Hugging Face format: (the TensorRT-LLM checkpoint, the unified one)."""
    import copy

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16)
    ids = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop=lambda m: m(ids))
    engine = tmp_path_factory.mktemp("modelopt-nvfp4")
    unified = tmp_path_factory.mktemp("modelopt-nvfp4-hf")
    export_hf_checkpoint(copy.deepcopy(model), export_dir=str(unified))
    export_tensorrt_llm_checkpoint(model, decoder_type="llama", dtype=torch.float16,
                                   export_dir=str(engine), inference_tensor_parallel=1)  # fmt: skip
    return engine, unified


def test_the_format_is_modelopts_bit_for_bit() -> None:
    """Codes, block scales (an all-zero block included), global scale and packing equal
    NVFP4QTensor.quantize's; decoding them gives its dequantized values; e2m1 rounds to
    nearest, ties to the even code, and saturates at 6."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 256, generator=gen) * torch.rand(64, 1, generator=gen) * 3).half()
    w[3, :16] = 0
    packed, scales, scale_2 = NVFP4QTensor.quantize(w, 16)
    ours_2 = nvfp4.global_scale(w.float().abs().amax())
    ours_scales = nvfp4.block_scales(w, ours_2)
    codes = nvfp4.quantize_blocks(w, ours_scales, ours_2)
    assert torch.equal(scale_2.float(), ours_2)
    assert torch.equal(_bits(scales), _bits(ours_scales))
    assert torch.equal(packed._quantized_data, nvfp4.pack_columns(codes))
    assert torch.equal(nvfp4.unpack_columns(nvfp4.pack_columns(codes)), codes)
    theirs = packed.dequantize(torch.float32, scale=scales, double_scale=scale_2,
                               block_sizes={-1: 16})  # fmt: skip
    assert torch.equal(theirs, nvfp4.dequantize(codes, ours_scales, ours_2))
    zeros = torch.zeros(4, 32)  # deliberate difference: modelopt writes NaN scales and 6s
    zero_2 = nvfp4.global_scale(zeros.abs().amax())
    assert zero_2 > 0 and bool((nvfp4.block_scales(zeros, zero_2).float() == 1).all())
    assert not bool(nvfp4.quantize_blocks(zeros, nvfp4.block_scales(zeros, zero_2), zero_2).any())
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0, -0.75])
    assert nvfp4.from_codes(nvfp4.to_codes(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, -1]


def test_rounding_to_e2m1_values_is_the_codes_rounding_to_the_bit() -> None:
    """round_e2m1 (the values, with no codes: what the search and the runtime use for every
    activation) gives from_codes(to_codes(x)) bit for bit: every e2m1 value and midpoint with
    its float32 neighbours either side, both signs and both zeros, values beyond 6 and
    infinities, 1e6 random values at every scale, and float64 inputs that underflow float32
    (the sign is the input's)."""
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0,
                         5.0, 6.0, 7.0, 12.0, 1e30, float("inf")])  # fmt: skip
    up, down = grid.nextafter(torch.tensor(float("inf"))), grid.nextafter(torch.tensor(0.0))
    near = torch.cat((grid, up, down))
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(10**6, generator=gen) * torch.logspace(-8, 3, 10**6).float()
    tiny = torch.tensor([-1e-300, 1e-300, -0.3, -0.0], dtype=torch.float64)
    for x in (torch.cat((near, -near)), wide, tiny):
        ours = nvfp4.round_e2m1(x)
        codes = nvfp4.from_codes(nvfp4.to_codes(x))
        assert ours.dtype == codes.dtype == torch.float32
        assert torch.equal(ours.view(torch.int32), codes.view(torch.int32))
    signed = nvfp4.round_e2m1(tiny).view(torch.int32)  # -0.0 from a negative input, +0.0 from -0.0
    assert torch.equal(signed, torch.tensor([-0.0, 0.0, -0.5, 0.0]).view(torch.int32))


def test_activations_are_quantized_as_the_fp4_gemm_quantizes_them() -> None:
    """The run-time quantization of a GEMM's input (TensorRT-LLM's recipe: SF = e4m3(S x (m x
    1/6)), values times 1 / (SF / S)): its block scales are those modelopt's formula gives for
    the same global scale, bit for bit, and its codes differ only where a value lies within an
    ulp of a rounding midpoint (measured: 58 of 65536); a block whose scale underflows to 0
    contributes 0 (the kernel does not clamp it up); beyond the calibrated range the block
    scale saturates at 448 and the values at 6."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 1024, generator=gen) * 4).to(torch.bfloat16).float()
    a = nvfp4.global_scale(torch.tensor(20.0))
    packed, scales, _ = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=a)
    codes, sf = nvfp4.quantize_activations(x, a)
    assert torch.equal(_bits(sf.squeeze(-1).to(torch.float8_e4m3fn)), _bits(scales))
    differ = int((codes != nvfp4.unpack_columns(packed._quantized_data)).sum())
    assert differ < 0.002 * codes.numel(), differ
    tiny = torch.full((1, 32), 1e-9)
    tiny[0, 16:] = 100.0  # the second block saturates: 100 is beyond a's range
    out = nvfp4.fake_quantize(tiny, nvfp4.global_scale(torch.tensor(1.0)))
    assert torch.equal(out[0, :16], torch.zeros(16))  # SF = e4m3(tiny) = 0
    assert torch.allclose(out[0, 16:], torch.full((16,), 6 * 448 * 1.0 / 2688))


def test_our_checkpoint_is_modelopts_given_the_same_weights(
    modelopt_nvfp4: tuple, tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """Every tensor modelopt writes for trtllm-build, ours writes with its dtype and shape; the
    weights, block scales and global weight scales are bit-identical (fc and gate share the
    larger global scale, as modelopt unifies them); the input scales differ by the calibration
    alone; the quantization table agrees (deliberate difference: exclude_modules lists the
    embedding too)."""
    path, _ = modelopt_nvfp4
    ours = tmp_path / "ours"
    ours.mkdir()
    convert_model(Nvfp4(), tiny_llama, ours, tp=1, pp=1, calibration=calibrated)
    theirs, mine = load_file(path / "rank0.safetensors"), load_file(ours / "rank0.safetensors")
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():
        assert (mine[name].dtype, mine[name].shape) == (tensor.dtype, tensor.shape), name
        if not name.endswith("activation_scaling_factor"):
            assert torch.equal(_bits(mine[name]), _bits(tensor)), name
    quant = json.loads((ours / "config.json").read_text())["quantization"]
    their_quant = json.loads((path / "config.json").read_text())["quantization"]
    for key in ("quant_algo", "kv_cache_quant_algo", "group_size"):
        assert quant[key] == their_quant[key], key
    assert quant["exclude_modules"] == ["lm_head", "transformer.vocab_embedding"]
    runtime = CheckpointRuntime.load(ours)
    assert runtime.fp4 and bool(torch.isfinite(runtime.forward(IDS)).all())


def test_the_llmapi_checkpoint_is_modelopts_unified_one_and_runs_as_the_engine_one(
    modelopt_nvfp4: tuple, tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """The llmapi target's NVFP4 checkpoint: modelopt's unified export's tensors with their
    dtypes and shapes, its hf_quant_config.json table and config.json quantization_config but
    the producer; TensorRT-LLM 1.0-1.2 and vLLM load it (the conversion checks); read back it
    is the engine checkpoint bit for bit (same logits)."""
    from trt_builder.targets.llmapi.checkpoint.unified import read_unified
    from trt_builder.targets.llmapi.convert import convert_llmapi

    _, unified = modelopt_nvfp4
    hf, engine = tmp_path / "hf", tmp_path / "engine"
    hf.mkdir(), engine.mkdir()
    summary = convert_llmapi(Nvfp4(), tiny_llama, hf, calibration=calibrated, recipe=None)
    assert summary["loaders"] == ["tensorrt-llm 1.0", "tensorrt-llm 1.1", "tensorrt-llm 1.2",
                                  "vllm 0.10-0.34"]  # fmt: skip

    def headers(directory: Path) -> dict[str, tuple[str, list[int]]]:
        found = {}
        for path in directory.glob("*.safetensors"):
            with safe_open(path, "pt") as f:
                for name in f.keys():  # noqa: SIM118
                    found[name] = (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape())
        return found

    assert headers(hf) == headers(unified)
    table = json.loads((hf / "hf_quant_config.json").read_text())["quantization"]
    assert table == json.loads((unified / "hf_quant_config.json").read_text())["quantization"]
    ours = json.loads((hf / "config.json").read_text())["quantization_config"]
    theirs = json.loads((unified / "config.json").read_text())["quantization_config"]
    assert ours.pop("producer")["name"] == "trt-builder"
    theirs.pop("producer")
    assert ours == theirs
    convert_model(Nvfp4(), tiny_llama, engine, tp=1, pp=1, calibration=calibrated)
    from_hf = CheckpointRuntime(*read_unified(hf)).forward(IDS)
    assert torch.equal(from_hf, CheckpointRuntime.load(engine).forward(IDS))
    # modelopt's own unified export reads too
    assert bool(torch.isfinite(CheckpointRuntime(*read_unified(unified)).forward(IDS)).all())


def test_tensor_parallel_ranks_merge_back_bit_for_bit(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """At tp 2 each rank packs its own codes (dense's and proj's columns split at a block
    boundary, with their block scales); merged, the ranks are the tp 1 checkpoint bit for bit
    and give its logits."""
    from trt_builder.checkpoint.reader import read_checkpoint

    for tp in (1, 2):
        (tmp_path / f"tp{tp}").mkdir()
        convert_model(Nvfp4(), tiny_llama, tmp_path / f"tp{tp}", tp=tp, pp=1,
                      calibration=calibrated)  # fmt: skip
    one = load_file(tmp_path / "tp1" / "rank0.safetensors")
    rank = load_file(tmp_path / "tp2" / "rank1.safetensors")
    dense = "transformer.layers.0.attention.dense"
    assert rank[f"{dense}.weight"].shape == (64, 16)  # [out, in / 2 / 2]
    assert rank[f"{dense}.weights_scaling_factor"].shape == (64, 2)
    _, merged = read_checkpoint(tmp_path / "tp2")
    assert sorted(merged) == sorted(one)
    for name, tensor in one.items():
        assert torch.equal(_bits(merged[name]), _bits(tensor)), name
    assert torch.equal(CheckpointRuntime.load(tmp_path / "tp2").forward(IDS),
                       CheckpointRuntime.load(tmp_path / "tp1").forward(IDS))  # fmt: skip


def test_refusals_name_the_fix() -> None:
    with pytest.raises(SpecError, match=r"SM 100 or newer .*: use --target llmapi"):
        make_spec(dtype="nvfp4", target_gpu="H100-80GB")
    with pytest.raises(SpecError, match=r"SM 100, where TensorRT-LLM builds no INT8"):
        make_spec(dtype="nvfp4", kv_cache="int8", target_gpu="B200")
    with pytest.raises(SpecError, match=r"--kv-cache int8: use --kv-cache fp8"):
        make_spec(dtype="nvfp4", kv_cache="int8", target="llmapi")
    assert make_spec(dtype="nvfp4", target_gpu="B200").variant == "nvfp4-tp1-pp1"
    # the llmapi checkpoint runs on Hopper through Marlin (weight-only)
    assert make_spec(dtype="nvfp4", target="llmapi", target_gpu="H100-80GB").mode == Nvfp4()


def test_compensated_rounding_lowers_the_gemm_error_at_the_same_block_scales() -> None:
    """GPTQ's update on the e2m1 grid at convert's block scales: every value an e2m1 value,
    and the GEMM's output error on correlated inputs lower than nearest rounding's."""
    from trt_builder.modes.nvfp4.recipe.search import _e2m1_grid
    from trt_builder.recipe.gptq import compensated_on_grid

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 128, generator=gen)
    x = torch.randn(2048, 128, generator=gen) @ (
        torch.eye(128) + torch.randn(128, 128, generator=gen) / 4
    )
    h = (x.T @ x).double()
    scale_2 = nvfp4.global_scale(weight.abs().amax())
    scales = nvfp4.block_scales(weight, scale_2)
    steps = (scales.float() * scale_2).repeat_interleave(16, dim=1)
    values = compensated_on_grid(weight[None], h[None], steps[None], _e2m1_grid)[0]
    assert torch.equal(nvfp4.from_codes(nvfp4.to_codes(values)), values.float())
    nearest = nvfp4.dequantize(nvfp4.quantize_blocks(weight, scales, scale_2), scales, scale_2)

    def error(effective: torch.Tensor) -> float:
        delta = (weight - effective).double()
        return float(torch.einsum("ni,ij,nj->", delta, h, delta))

    assert error(values.float() * steps) < 0.9 * error(nearest)


def test_searched_block_scales_lower_each_blocks_output_error_on_the_e4m3_grid() -> None:
    """Each block's scale from its candidates (the e4m3 grid around convert's own): on heavy
    tailed weights a third or more of the blocks take another (up or down), each is a candidate, no block's error with its
    Hessian block is above convert's scale's, and the whole error is lower."""
    from trt_builder.modes.nvfp4.checkpoint import is_candidate
    from trt_builder.modes.nvfp4.recipe.scales import searched_scales

    gen = torch.Generator().manual_seed(0)
    weight = torch.distributions.StudentT(3.0).sample((32, 256))
    x = torch.randn(4096, 256, generator=gen) @ (
        torch.eye(256) + torch.randn(256, 256, generator=gen) / 8
    )
    h = x.T @ x
    scale_2 = nvfp4.global_scale(weight.abs().amax())
    own, searched = nvfp4.block_scales(weight, scale_2), searched_scales(weight, h, scale_2)
    assert searched.dtype == torch.float8_e4m3fn and bool(is_candidate(searched, own).all())

    def block_errors(scales: torch.Tensor) -> torch.Tensor:
        values = nvfp4.dequantize(nvfp4.quantize_blocks(weight, scales, scale_2), scales, scale_2)
        d = (weight - values).double().reshape(32, 16, 16)
        blocks = h.double().reshape(16, 16, 16, 16).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
        return torch.einsum("rbi,bij,rbj->rb", d, blocks, d)

    assert float((_bits(searched) != _bits(own)).double().mean()) > 0.25
    assert bool((block_errors(searched) <= block_errors(own) * (1 + 1e-6)).all())
    assert float(block_errors(searched).sum()) < 0.9 * float(block_errors(own).sum())


def test_the_search_scores_its_candidates_and_convert_writes_what_it_chose(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """The recipe scores convert's own rounding, searched block scales and compensated rounding
    with standard errors; convert writes the chosen codes and block scales (the recipe's bit
    for bit; for amax, its own nearest) and refuses a recipe scale that none of its own
    candidates is (a recipe of other weights)."""
    from safetensors.torch import save_file

    from trt_builder.modes.nvfp4.recipe.search import WEIGHTS, search_nvfp4
    from trt_builder.modes.nvfp4.spec import Nvfp4SearchSet

    found, tensors = search_nvfp4(tiny_llama, calibrated, Nvfp4SearchSet(tokens=1024, fit_tokens=1024),
                                  device="cpu", offload=tmp_path / "offload")  # fmt: skip
    assert [c["name"] for c in found["candidates"]] == ["amax", "scales", "compensated"]
    assert all(c["kl"] > 0 and c["kl_se"] > 0 for c in found["candidates"])
    assert bool(tensors) == (found["chosen"] != "amax")
    recipe = tmp_path / "recipe"
    recipe.mkdir()
    if tensors:
        save_file(tensors, str(recipe / WEIGHTS))
    (recipe / "recipe.json").write_text(json.dumps(found))
    searched, plain = tmp_path / "searched", tmp_path / "plain"
    searched.mkdir(), plain.mkdir()
    summary = convert_model(Nvfp4(), tiny_llama, searched, tp=1, pp=1, calibration=calibrated,
                            recipe=recipe / "recipe.json")  # fmt: skip
    convert_model(Nvfp4(), tiny_llama, plain, tp=1, pp=1, calibration=calibrated)
    assert summary["recipe"]["chosen"] == found["chosen"]
    written = load_file(searched / "rank0.safetensors")
    for name, tensor in (tensors or load_file(plain / "rank0.safetensors")).items():
        assert torch.equal(_bits(written[name]), _bits(tensor)), name
    if tensors:  # a block scale far from any candidate of these weights' own
        name = "transformer.layers.1.mlp.proj.weights_scaling_factor"
        far = (tensors[name].float() * 4).clamp(max=448).to(torch.float8_e4m3fn)
        save_file({**tensors, name: far}, str(recipe / WEIGHTS))
        (tmp_path / "tampered").mkdir()
        with pytest.raises(ConversionError, match=r"mlp\.proj\.weight was made from other weights"):
            convert_model(Nvfp4(), tiny_llama, tmp_path / "tampered", tp=1, pp=1,
                          calibration=calibrated, recipe=recipe / "recipe.json")  # fmt: skip
