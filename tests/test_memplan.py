"""The memory plan (trt_builder/engine/memplan.py, docs/engine.md): worked examples checked by hand,
refusals that name what would fit, and `trt-builder plan`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trt_builder.core.errors import SpecError
from trt_builder.engine.memplan import GIB, Limits, MemoryPlan, plan, proposed_batch, resolve_limits
from trt_builder.modes import Fp8, SmoothQuant
from trt_builder.spec.build import make_spec

LLAMA2_7B = {
    "architecture": "LlamaForCausalLM", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "vocab_size": 32000, "hidden_act": "silu",
}  # fmt: skip
LIMITS = Limits(max_batch_size=8, max_input_len=1024, max_seq_len=4096, max_num_tokens=8192)


def _plan(config: dict = LLAMA2_7B, **changes: object) -> MemoryPlan:
    """Llama-2-7B float16 on an H100-80GB, tp=1, pp=1, unless `changes` say otherwise."""
    inputs = {"gpu": "H100-80GB", "tp": 1, "pp": 1, "dtype": "float16", "linear": None,
              "kv_dtype": None, "limits": LIMITS}  # fmt: skip
    return plan(config, **{**inputs, **changes})  # type: ignore[arg-type]


def test_llama2_7b_float16_on_an_80gb_gpu() -> None:
    p = _plan()
    # 6,738,415,616 parameters (Llama-2-7B's count) x 2 bytes
    assert p.weight_bytes == 6_738_415_616 * 2
    # 2 (K, V) x 32 layers x 32 KV heads x 128 x 2 bytes = 0.5 MiB a token
    assert p.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    # activations: 2 x 8192 tokens x (4*4096 + 3*4096 + 4096 + 2*11008) x 2 B + 8 x 32000 x 4 B logits
    assert p.activation_bytes == 2 * 8192 * (8 * 4096 + 2 * 11008) * 2 + 8 * 32000 * 4
    free = 80 * GIB - p.weight_bytes - p.activation_bytes - GIB
    assert p.kv_budget_bytes == int(free * 0.9)
    assert p.kv_tokens == p.kv_budget_bytes // (512 * 1024) == 119394
    assert p.max_sequences(4096) == 119394 // 4096 == 29
    assert proposed_batch(p) == 16  # a power of two


def test_llama2_7b_int8_and_the_int8_kv_cache() -> None:
    fp16, int8 = _plan(), _plan(linear=SmoothQuant().weights)
    kv8 = _plan(linear=SmoothQuant().weights, kv_dtype="int8")
    linears = 32 * (4096 * 3 * 4096 + 4096 * 4096 + 3 * 4096 * 11008)
    assert (
        fp16.weight_bytes - int8.weight_bytes
        == linears - 32 * (3 * 4096 + 4096 + 3 * 11008 + 4096) * 4
    )
    assert int8.weight_bytes / GIB == pytest.approx(6.53, abs=0.01)
    assert kv8.kv_bytes_per_token * 2 == int8.kv_bytes_per_token
    assert kv8.max_sequences(4096) == 63 and int8.max_sequences(4096) == 31


def test_llama2_7b_fp8_and_the_fp8_kv_cache() -> None:
    """1-byte linears with two float32 scales each (5 linears a layer), a 1-byte KV cache."""
    fp16, fp8 = _plan(), _plan(linear=Fp8().weights)
    fp8kv = _plan(linear=Fp8().weights, kv_dtype="fp8")
    linears = 32 * (4096 * 3 * 4096 + 4096 * 4096 + 3 * 4096 * 11008)
    assert fp16.weight_bytes - fp8.weight_bytes == linears - 32 * 5 * 8
    assert fp8.weight_dtype == "fp8" and fp8kv.kv_dtype == "fp8"
    assert fp8kv.kv_bytes_per_token * 2 == fp8.kv_bytes_per_token
    assert fp8kv.max_sequences(4096) == 63 and fp8.max_sequences(4096) == 31


def test_ranks_split_weights_and_duplicate_too_few_kv_heads() -> None:
    gqa = {**LLAMA2_7B, "num_key_value_heads": 2}
    one, tp4, pp2 = _plan(gqa), _plan(gqa, tp=4), _plan(gqa, pp=2)
    # 2 KV heads over 4 ranks: each rank keeps one whole head, so per-token KV halves, not quarters
    assert (
        one.kv_bytes_per_token == 2 * 32 * 2 * 128 * 2
        and tp4.kv_bytes_per_token == one.kv_bytes_per_token // 2
    )
    assert tp4.weight_bytes < one.weight_bytes / 2  # the embedding stays whole on every rank
    # a pipeline stage holds half the layers, and the larger of embedding and lm_head
    assert pp2.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert one.weight_bytes / 2 < pp2.weight_bytes < one.weight_bytes


def test_a_spec_that_cannot_fit_is_refused_with_what_would() -> None:
    llama2_70b = {**LLAMA2_7B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                  "num_attention_heads": 64, "num_key_value_heads": 8}  # fmt: skip
    spec = make_spec(dtype="float16", target_gpu="H100-80GB")
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
          "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
          "vocab_size": 32000, "hidden_act": "silu", "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-5}  # fmt: skip
    with pytest.raises(
        SpecError,
        match=r"does not fit H100-80GB .* use --tp 2 \(.* GiB of weights per rank\) or --dtype int8",
    ) as info:
        resolve_limits(spec, hf)
    assert "\n" not in str(info.value)
    fits = resolve_limits(make_spec(dtype="float16", target_gpu="H100-80GB", tp=2), hf)[1]
    assert fits.fits and fits.weight_bytes < 70 * GIB
    # 128.5 GiB of weights fit one H200 (141 GiB), with room for a few sequences only
    h200 = _plan(llama2_70b, gpu="H200")
    assert (
        h200.weight_bytes / GIB == pytest.approx(128.5, abs=0.1)
        and 1 <= h200.max_sequences(4096) < 8
    )


LLAMA2_7B_HF = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "vocab_size": 32000, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
}  # fmt: skip


def test_limits_left_open_come_from_the_plan() -> None:
    # Llama-2-7B float16, max_seq_len 4096 on 80 GB: 29 sequences fit (worked example above),
    # so max_batch_size 16 (a power of two) and max_num_tokens TensorRT-LLM's 8192
    spec = make_spec(**{"limits.max_seq_len": 4096})
    resolved, memory = resolve_limits(spec, LLAMA2_7B_HF)
    assert (resolved.limits.max_batch_size, resolved.limits.max_num_tokens) == (16, 8192)
    assert memory.limits == resolved.limits and memory.max_sequences(4096) >= 16
    assert spec.limits.max_batch_size is None  # the spec itself is frozen, unchanged
    # INT8 with the INT8 KV cache holds 63: 32
    int8 = resolve_limits(make_spec(dtype="int8", kv_cache="int8", **{"limits.max_seq_len": 4096}),
                          LLAMA2_7B_HF)[0]  # fmt: skip
    assert int8.limits.max_batch_size == 32
    # what the user set stays; max_num_tokens follows a small batch x short sequences
    given = make_spec(**{"limits.max_batch_size": 2, "limits.max_seq_len": 1024,
                         "limits.max_input_len": 512})  # fmt: skip
    assert resolve_limits(given, LLAMA2_7B_HF)[0].limits.max_num_tokens == 2048
    # an L4 (24 GB) holds 13.5 GiB of weights and few sequences: 2 of 4096 -> 2
    l4 = resolve_limits(make_spec(target_gpu="L4", **{"limits.max_seq_len": 4096}), LLAMA2_7B_HF)
    assert l4[0].limits.max_batch_size == 2 and l4[1].max_sequences(4096) in (2, 3)


def test_plan_command(
    tiny_llama: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from trt_builder.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", str(tiny_llama), "--dtype", "int8", "--kv-cache", "int8",
                 "--target-gpu", "L4", "--json"]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["gpu"] == "L4" and data["weight_dtype"] == "int8" and data["kv_dtype"] == "int8"
    assert data["kv_tokens"] > 0 and data["proposed_max_batch_size"] == 256
    assert data["limits"]["max_batch_size"] == 256 and data["limits"]["max_num_tokens"] == 8192
    assert main(["plan", "--model", str(tiny_llama), "--max-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "KV cache per token" in out and "max_batch_size" in out and "8 (given; 256 fit)" in out


#: meta-llama/Llama-2-7b-hf's config.json, as the hub serves it.
LLAMA2_7B_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": True,
    "vocab_size": 32000,
}  # fmt: skip


def test_plan_reads_config_json_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No weights, no tokenizer: the plan needs the config alone, and writes nothing."""
    from trt_builder.cli.main import main
    from trt_builder.core.digests import DigestCache

    model = tmp_path / "llama-2-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA2_7B_CONFIG_JSON))
    assert main(["plan", "--model", str(model), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # 6.74e9 parameters in float16; 2 (K, V) x 32 layers x 32 KV heads x 128 x 2 bytes
    assert round(plan["weight_bytes"] / 1e9, 2) == 13.48
    assert plan["kv_bytes_per_token"] == 512 * 1024
    # weights beside it are neither read nor hashed (a 7B model's would be 13.5 GB)
    (model / "model.safetensors").write_bytes(b"not read")

    def hashed(*args: object) -> str:
        raise AssertionError("plan hashed a model file")

    monkeypatch.setattr(DigestCache, "file", hashed)
    assert main(["plan", "--model", str(model)]) == 0
    text = capsys.readouterr().out
    assert "12.55 GiB (float16 linears)" in text and "512.0 KiB (float16)" in text
    assert not (tmp_path / "engines").exists()  # nothing fetched, nothing written


def test_the_mlp_the_plan_counts_is_the_registrys() -> None:
    """GPT-2's registry entry says plain MLP (fc, proj): one intermediate x hidden matrix per
    layer fewer than the same shape as a SwiGLU family. An architecture the registry does not
    know is refused, not planned with a guess."""
    from trt_builder.core.errors import UnsupportedModelError

    inputs = {"gpu": "H100-80GB", "tp": 1, "pp": 1, "dtype": "float16", "linear": None,
              "kv_dtype": None, "limits": Limits(max_batch_size=1, max_num_tokens=2048)}  # fmt: skip
    gated = plan(LLAMA2_7B, **inputs).weight_bytes
    plain = plan({**LLAMA2_7B, "architecture": "GPT2LMHeadModel"}, **inputs).weight_bytes
    assert gated - plain == 32 * 11008 * 4096 * 2
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM is not supported"):
        plan({**LLAMA2_7B, "architecture": "FalconForCausalLM"}, **inputs)
