from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import edit_json
from trt_builder.convert.floats import convert_checkpoint
from trt_builder.convert.model import convert_model
from trt_builder.core.digests import sha256_file
from trt_builder.core.errors import ConversionError, UnsupportedModelError
from trt_builder.modes import FloatMode, WeightOnlyInt8

pytestmark = pytest.mark.integration


def _convert(src: Path, dst: Path, mode: object = FloatMode("float16")) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    convert_checkpoint(src, dst, mode)  # type: ignore[arg-type]
    return load_file(dst / "rank0.safetensors")


def test_llama_names_shapes_and_mapping(tiny_llama: Path, tmp_path: Path) -> None:
    out = _convert(tiny_llama, tmp_path / "ck")
    hf = load_file(tiny_llama / "model.safetensors")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["dtype"] == "float16"
    assert (
        cfg["num_key_value_heads"] == 2 and cfg["head_size"] == 16 and cfg["rotary_scaling"] is None
    )
    assert cfg["mapping"]["world_size"] == 1 and cfg["quantization"]["quant_algo"] is None
    assert len(out) == 1 + 2 * 7 + 2 and all(t.dtype == torch.float16 for t in out.values())
    layer = "transformer.layers.1"
    qkv = torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]).half()
    assert torch.equal(out[f"{layer}.attention.qkv.weight"], qkv)
    assert out[f"{layer}.attention.qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    # TensorRT-LLM's "fc" is HF gate_proj and its "gate" is HF up_proj.
    assert torch.equal(
        out[f"{layer}.mlp.fc.weight"], hf["model.layers.1.mlp.gate_proj.weight"].half()
    )
    assert torch.equal(
        out[f"{layer}.mlp.gate.weight"], hf["model.layers.1.mlp.up_proj.weight"].half()
    )
    assert torch.equal(
        out[f"{layer}.post_layernorm.weight"],
        hf["model.layers.1.post_attention_layernorm.weight"].half(),
    )
    assert torch.equal(out["lm_head.weight"], hf["lm_head.weight"].half())


def test_output_is_bit_identical_across_runs(tiny_llama: Path, tmp_path: Path) -> None:
    _convert(tiny_llama, tmp_path / "a")
    _convert(tiny_llama, tmp_path / "b")
    for name in ("config.json", "rank0.safetensors"):
        assert sha256_file(tmp_path / "a" / name) == sha256_file(tmp_path / "b" / name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_dtypes(tiny_llama: Path, tmp_path: Path, dtype: str) -> None:
    out = _convert(tiny_llama, tmp_path / "ck", FloatMode(dtype))
    assert {t.dtype for t in out.values()} == {getattr(torch, dtype)}


def test_w8a16_writes_model_dtype_weights_and_quant_algo(tiny_llama: Path, tmp_path: Path) -> None:
    out = _convert(tiny_llama, tmp_path / "ck", WeightOnlyInt8())
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["quantization"] == {
        "quant_algo": "W8A16",
        "kv_cache_quant_algo": None,
        "exclude_modules": None,
    }
    assert out["transformer.layers.0.mlp.proj.weight"].dtype == torch.float16
    assert not any(n.endswith("per_channel_scale") for n in out)


def test_rope_theta_and_llama3_scaling_are_carried(tokenizer_dir: Path, tmp_path: Path) -> None:
    from tiny_models import make_tiny_llama

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}  # fmt: skip
    make_tiny_llama(tmp_path / "m", tokenizer_dir, rope_parameters=scaling)
    _convert(tmp_path / "m", tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["rotary_base"] == 500000.0
    assert cfg["rotary_scaling"]["type"] == "llama3" and cfg["rotary_scaling"]["factor"] == 8.0
    assert cfg["rotary_scaling"]["original_max_position_embeddings"] == 64


def test_tied_embeddings_fill_lm_head(tokenizer_dir: Path, tmp_path: Path) -> None:
    from tiny_models import make_tiny_llama

    make_tiny_llama(tmp_path / "m", tokenizer_dir, tie_word_embeddings=True)
    out = _convert(tmp_path / "m", tmp_path / "ck")
    assert torch.equal(out["lm_head.weight"], out["transformer.vocab_embedding.weight"])


def test_unmapped_tensor_is_named(tiny_copy: Path, tmp_path: Path) -> None:
    weights = load_file(tiny_copy / "model.safetensors")
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(weights, str(tiny_copy / "model.safetensors"))
    with pytest.raises(
        ConversionError, match=r"e\.g\. model\.layers\.0\.self_attn\.q_norm\.weight"
    ):
        _convert(tiny_copy, tmp_path / "ck")


def test_shape_mismatch_and_nan_are_named(tiny_copy: Path, tmp_path: Path) -> None:
    edit_json(tiny_copy / "config.json", intermediate_size=96)
    with pytest.raises(
        ConversionError,
        match=r"transformer\.layers\.0\.mlp\.fc\.weight .* has shape \(128, 64\), the config implies \(96, 64\)",
    ):
        _convert(tiny_copy, tmp_path / "a")
    edit_json(tiny_copy / "config.json", intermediate_size=128)
    weights = load_file(tiny_copy / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(weights, str(tiny_copy / "model.safetensors"))
    with pytest.raises(
        ConversionError,
        match=r"transformer\.layers\.1\.mlp\.proj\.weight \(model\.layers\.1\.mlp\.down_proj\.weight\) contains NaN",
    ):
        _convert(tiny_copy, tmp_path / "b")


def test_missing_tensor_and_unsupported_architecture(tiny_copy: Path, tmp_path: Path) -> None:
    weights = load_file(tiny_copy / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, str(tiny_copy / "model.safetensors"))
    with pytest.raises(ConversionError, match="tensor model.norm.weight is missing"):
        _convert(tiny_copy, tmp_path / "a")
    edit_json(tiny_copy / "config.json", architectures=["FalconForCausalLM"])
    with pytest.raises(
        UnsupportedModelError,
        match="FalconForCausalLM is not supported: supported are GPT2LMHeadModel, LlamaForCausalLM",
    ):
        _convert(tiny_copy, tmp_path / "b")


def test_float16_overflow_is_named_with_the_fix(tiny_copy: Path, tmp_path: Path) -> None:
    weights = load_file(tiny_copy / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e6  # beyond float16's 65504
    save_file(weights, str(tiny_copy / "model.safetensors"))
    with pytest.raises(
        ConversionError,
        match=r"transformer\.layers\.0\.mlp\.gate\.weight .* beyond float16's range: convert with --dtype bfloat16",
    ):
        _convert(tiny_copy, tmp_path / "a")
    assert (
        _convert(tiny_copy, tmp_path / "b", FloatMode("bfloat16"))[
            "transformer.layers.0.mlp.gate.weight"
        ][0, 0]
        == 1e6
    )


def test_each_qkv_source_is_checked_on_its_own(tiny_copy: Path, tmp_path: Path) -> None:
    weights = load_file(tiny_copy / "model.safetensors")
    q, k = (
        weights["model.layers.0.self_attn.q_proj.weight"],
        weights["model.layers.0.self_attn.k_proj.weight"],
    )
    # Move 16 rows from q to k: the same total, a wrong split between q and k.
    weights["model.layers.0.self_attn.q_proj.weight"] = q[:48].clone()
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.cat([q[48:], k]).clone()
    save_file(weights, str(tiny_copy / "model.safetensors"))
    with pytest.raises(
        ConversionError,
        match=r"\(model\.layers\.0\.self_attn\.q_proj\.weight\) has shape \(48, 64\), the config implies \(64, 64\)",
    ):
        _convert(tiny_copy, tmp_path / "a")
    assert not (tmp_path / "a" / "rank0.safetensors").exists()  # refused before writing


def test_the_index_decides_which_files_are_weights(tiny_copy: Path, tmp_path: Path) -> None:
    """Mistral repos also ship consolidated.safetensors in another naming: the index wins."""
    save_file(
        {"tok_embeddings.weight": torch.ones(4, 4)}, str(tiny_copy / "consolidated.safetensors")
    )
    with pytest.raises(
        ConversionError, match="not mapped by the llama family, e.g. tok_embeddings.weight"
    ):
        _convert(tiny_copy, tmp_path / "a")
    index = {
        "metadata": {},
        "weight_map": {n: "model.safetensors" for n in load_file(tiny_copy / "model.safetensors")},
    }
    (tiny_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "lm_head.weight" in _convert(tiny_copy, tmp_path / "b")


def test_config_missing_a_key_is_named(tiny_copy: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_copy / "config.json").read_text())
    del config["num_attention_heads"]
    (tiny_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="config.json lacks 'num_attention_heads'"):
        _convert(tiny_copy, tmp_path / "a")


def test_no_input_mapping_outlives_its_tensor(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trt_builder.convert import floats as convert_module

    seen: list[int] = []
    real = convert_module.load_sources

    def counting(rule, index):  # type: ignore[no-untyped-def]
        maps = Path("/proc/self/maps").read_text()
        seen.append(maps.count(str(tiny_llama / "model.safetensors")))
        return real(rule, index)

    monkeypatch.setattr(convert_module, "load_sources", counting)
    _convert(tiny_llama, tmp_path / "ck", FloatMode("float16"))
    assert len(seen) == 17 and max(seen) == 0


def test_int8_wo_clipping_refuses_statistics_without_mean_squares(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A calibration from before input_sqmean existed names the fix."""
    (tmp_path / "cal").mkdir()
    save_file({"model.layers.0.self_attn.q_proj.input_absmax": torch.ones(64)},
              str(tmp_path / "cal" / "calibration.safetensors"))  # fmt: skip
    with pytest.raises(ConversionError, match=r"no input_sqmean .* calibrate --force\)$"):
        convert_model(
            WeightOnlyInt8(), tiny_llama, tmp_path / "ck", tp=1, pp=1, calibration=tmp_path / "cal"
        )
    assert not (tmp_path / "ck").exists()
