"""Every registered family: conversion against an independent producer (nvidia-modelopt 0.47),
tensor/pipeline-parallel ranks, and the checkpoint runtime against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import compare_with_modelopt_config
from tiny_models import FAMILIES, make_tiny
from trt_builder.checkpoint.mapping import Mapping
from trt_builder.checkpoint.parallel import merge
from trt_builder.convert.floats import convert_checkpoint
from trt_builder.core.errors import SpecError
from trt_builder.modes import FloatMode, WeightOnlyInt8
from trt_builder.runtimes.checkpoint import CheckpointRuntime

pytestmark = pytest.mark.integration

IDS = torch.tensor([5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 300, 21])
#: modelopt's decoder_type per family (its MODEL_NAME_TO_TYPE)
DECODER_TYPE = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen",
    "qwen3": "qwen",
    "gpt2": "gpt",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        make_tiny(family, root / family, tokenizer_dir)
    return {family: root / family for family in FAMILIES}


def _hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2_5_VLForConditionalGeneration

    if "Qwen2_5_VL" in (path / "config.json").read_text():
        return Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _convert(src: Path, dst: Path, mode: object = FloatMode("float16"), **kw: int) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    convert_checkpoint(src, dst, mode, **kw)  # type: ignore[arg-type]
    return dst


def _ranks(path: Path) -> list[dict[str, torch.Tensor]]:
    world = json.loads((path / "config.json").read_text())["mapping"]["world_size"]
    return [load_file(path / f"rank{r}.safetensors") for r in range(world)]


@pytest.mark.parametrize("family", sorted(DECODER_TYPE))
def test_bit_identical_to_modelopt(models: dict[str, Path], family: str, tmp_path: Path) -> None:
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    ours_dir = _convert(models[family], tmp_path / "ours")
    ours = load_file(ours_dir / "rank0.safetensors")
    export_tensorrt_llm_checkpoint(
        _hf(models[family]), decoder_type=DECODER_TYPE[family], dtype=torch.float16,
        export_dir=str(tmp_path / "modelopt"), inference_tensor_parallel=1,
    )  # fmt: skip
    theirs = load_file(tmp_path / "modelopt" / "rank0.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name
    compare_with_modelopt_config(
        json.loads((ours_dir / "config.json").read_text()),
        json.loads((tmp_path / "modelopt" / "config.json").read_text()),
        family,
    )


def test_qwen2_5_vl_decoder_matches_modelopt_on_the_same_weights(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """modelopt cannot export the VL model; its decoder weights loaded into a Qwen2 model can."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vl = _hf(models["qwen2.5-vl"])
    text = vl.config.text_config.to_dict()
    text.pop("rope_parameters", None)
    qwen2 = Qwen2ForCausalLM(
        Qwen2Config(**{k: v for k, v in text.items() if k != "model_type"})
    ).eval()
    state = {
        k.replace("model.language_model.", "model."): v
        for k, v in vl.state_dict().items()
        if "visual" not in k
    }
    qwen2.load_state_dict(state, strict=True)
    export_tensorrt_llm_checkpoint(
        qwen2,
        decoder_type="qwen",
        dtype=torch.float16,
        export_dir=str(tmp_path / "mo"),
        inference_tensor_parallel=1,
    )
    theirs = load_file(tmp_path / "mo" / "rank0.safetensors")
    ours = load_file(_convert(models["qwen2.5-vl"], tmp_path / "ours") / "rank0.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("mode", "max_kl"),
    [(FloatMode("float32"), 1e-6), (FloatMode("float16"), 1e-4), (WeightOnlyInt8(), 1e-2)],
)
def test_reference_runtime_agrees_with_transformers(
    models: dict[str, Path], family: str, mode: object, max_kl: float, tmp_path: Path
) -> None:
    with torch.no_grad():
        ref = _hf(models[family])(input_ids=IDS[None]).logits[0].float()
    got = CheckpointRuntime.load(_convert(models[family], tmp_path, mode)).forward(IDS)
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    assert kl <= max_kl
    if isinstance(mode, FloatMode) and mode.dtype == "float32":
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("family", "tp", "pp"),
    [
        ("llama", 2, 1),
        ("llama", 4, 1),
        ("qwen2", 2, 2),
        ("gpt2", 2, 1),
        ("qwen3", 1, 2),
        ("mistral", 4, 2),
    ],
)
def test_parallel_ranks_reassemble_into_tp1(
    models: dict[str, Path], family: str, tp: int, pp: int, tmp_path: Path
) -> None:
    single = _ranks(_convert(models[family], tmp_path / "tp1"))[0]
    path = _convert(models[family], tmp_path / "tpN", tp=tp, pp=pp)
    config = json.loads((path / "config.json").read_text())
    assert config["mapping"] == {
        "world_size": tp * pp,
        "tp_size": tp,
        "pp_size": pp,
        "cp_size": 1,
        "gpus_per_node": 8,
    }
    ranks = _ranks(path)
    assert len(ranks) == tp * pp
    if pp > 1:  # embeddings on the first stage, ln_f and lm_head on the last, layers renumbered
        assert "transformer.vocab_embedding.weight" in ranks[0] and "lm_head.weight" not in ranks[0]
        assert (
            "lm_head.weight" in ranks[-1] and "transformer.vocab_embedding.weight" not in ranks[-1]
        )
        assert {n.split(".")[2] for n in ranks[-1] if n.startswith("transformer.layers.")} == {"0"}
    merged = merge(ranks, Mapping.from_config(config))
    assert sorted(merged) == sorted(single)
    for name, tensor in single.items():
        assert torch.equal(merged[name], tensor), name


def test_kv_heads_are_duplicated_when_fewer_than_ranks(
    models: dict[str, Path], tmp_path: Path
) -> None:
    ranks = _ranks(_convert(models["llama"], tmp_path, tp=4))  # 4 heads, 2 KV heads, head 16
    qkv = [r["transformer.layers.0.attention.qkv.weight"] for r in ranks]
    assert all(q.shape == (16 + 2 * 16, 64) for q in qkv)  # one q head, one (shared) k and v head
    assert torch.equal(qkv[0][16:48], qkv[1][16:48]) and not torch.equal(
        qkv[1][16:48], qkv[2][16:48]
    )


def test_vocab_is_padded_for_a_split_lm_head(tokenizer_dir: Path, tmp_path: Path) -> None:
    make_tiny("gpt2", tmp_path / "m", tokenizer_dir, vocab_size=385)
    ranks = _ranks(_convert(tmp_path / "m", tmp_path / "ck", tp=2))
    heads = [r["lm_head.weight"] for r in ranks]
    assert [h.shape[0] for h in heads] == [193, 193]
    assert torch.count_nonzero(heads[1][-1]) == 0  # the padding row
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["vocab_size"] == 385


def test_tp_checkpoint_runs_like_tp1(models: dict[str, Path], tmp_path: Path) -> None:
    one = CheckpointRuntime.load(
        _convert(models["qwen2"], tmp_path / "a", FloatMode("float32"))
    ).forward(IDS)
    two = CheckpointRuntime.load(
        _convert(models["qwen2"], tmp_path / "b", FloatMode("float32"), tp=2, pp=2)
    ).forward(IDS)
    assert torch.equal(one, two)


@pytest.mark.parametrize(
    ("tp", "pp", "needle"),
    [
        (
            3,
            1,
            "--tp 3 does not divide this model (4 attention heads, 2 KV heads, intermediate size 128): use one of 1, 2, 4",
        ),
        (1, 3, "--pp 3 does not divide 2 layers: use one of 1, 2"),
    ],
)
def test_impossible_splits_are_refused_before_writing(
    models: dict[str, Path], tmp_path: Path, tp: int, pp: int, needle: str
) -> None:
    with pytest.raises(SpecError) as info:
        _convert(models["llama"], tmp_path, tp=tp, pp=pp)
    assert needle in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_vision_tower_is_left_out_and_said(models: dict[str, Path], tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    summary = convert_checkpoint(models["qwen2.5-vl"], tmp_path, FloatMode("float16"))
    assert any("vision tower is not" in n for n in summary["notes"])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architecture"] == "Qwen2ForCausalLM" and config["qwen_type"] == "qwen2"
    assert not any("visual" in n for n in load_file(tmp_path / "rank0.safetensors"))


def test_family_configs_carry_what_tensorrt_llm_reads(
    models: dict[str, Path], tmp_path: Path
) -> None:
    def config(family: str) -> dict:
        return json.loads((_convert(models[family], tmp_path / family) / "config.json").read_text())

    gpt2 = config("gpt2")
    assert (
        gpt2["position_embedding_type"] == "learned_absolute" and gpt2["hidden_act"] == "gelu_new"
    )
    assert gpt2["architecture"] == "GPT2LMHeadModel" and gpt2["bias"] is True
    qwen3 = config("qwen3")
    assert (
        qwen3["qwen_type"] == "qwen3" and qwen3["attn_bias"] is False and qwen3["head_size"] == 32
    )
    assert (
        config("qwen2")["attn_bias"] is True
        and config("mistral")["architecture"] == "MistralForCausalLM"
    )


def test_auto_dtype_keeps_half_and_turns_float32_into_float16(
    models: dict[str, Path], tmp_path: Path
) -> None:
    assert (
        json.loads(
            (
                _convert(models["llama"], tmp_path / "a", FloatMode("auto")) / "config.json"
            ).read_text()
        )["dtype"]
        == "float16"
    )
    config_path = models["mistral"] / "config.json"
    original = config_path.read_text()
    try:
        config_path.write_text(original.replace('"dtype": "float32"', '"dtype": "bfloat16"'))
        converted = _convert(models["mistral"], tmp_path / "b", FloatMode("auto"))
        assert json.loads((converted / "config.json").read_text())["dtype"] == "bfloat16"
        assert load_file(converted / "rank0.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    finally:
        config_path.write_text(original)


@pytest.mark.parametrize("family", FAMILIES)
def test_build_end_to_end_for_every_family(
    models: dict[str, Path], family: str, tmp_path: Path
) -> None:
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    spec = make_spec(
        model=str(models[family]), dtype="float32", out=tmp_path / "e", triton_root=tmp_path / "t"
    )
    result = run(spec)
    assert [r.status for r in result.records] == ["ran", "ran", "ran", "skipped", "ran"]
    report = json.loads((result.layout.reports / "verify.json").read_text())
    assert report["passed"] and report["top1"] == 1.0
    if family == "qwen2.5-vl":
        assert any("the vision tower is not" in n for n in result.notices)


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_qwen2_5_vl_builds_in_the_calibrated_modes_with_their_searches(
    models: dict[str, Path], dtype: str, tmp_path: Path
) -> None:
    """transformers 5 runs a hub-layout Qwen2.5-VL's `model.layers.*` as
    `model.language_model.layers.*`: calibration, the recipe's search (on the running model)
    and convert (on the file) each find the linears under their own names."""
    from trt_builder.calibrate.stats import load_stats
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    spec = make_spec(model=str(models["qwen2.5-vl"]), dtype=dtype, out=tmp_path / "e",
                     triton_root=tmp_path / "t", **{"calibrate.samples": 8,
                     "calibrate.seq_len": 64, "verify.heldout_tokens": 64, "verify.min_top1": 0.0,
                     "verify.max_kl": 1e6, "verify.max_ppl_delta_pct": 1e6})  # fmt: skip
    result = run(spec)
    assert {r.name: r.status for r in result.records} == {
        "fetch": "ran", "calibrate": "ran", "recipe": "ran", "convert": "ran", "verify": "ran",
        "engine": "skipped", "package": "ran"}  # fmt: skip
    calibration = result.layout.calibration(spec.calibrate.slug())
    assert "model.layers.0.self_attn.q_proj.input_absmax" in load_stats(calibration)
    running = load_stats(calibration, modules=True)
    assert "model.language_model.layers.0.self_attn.q_proj.input_absmax" in running


@pytest.mark.parametrize(
    ("family", "tp"), [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen3", 4), ("gpt2", 2)]
)
def test_tp_ranks_match_modelopt(
    models: dict[str, Path], family: str, tp: int, tmp_path: Path
) -> None:
    """An independent producer's split (KV duplication at TP=4 included). modelopt shards the
    embeddings (use_parallel_embedding); we keep TensorRT-LLM's default and replicate them."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    ours = _ranks(_convert(models[family], tmp_path / "ours", tp=tp))
    export_tensorrt_llm_checkpoint(
        _hf(models[family]), decoder_type=DECODER_TYPE[family], dtype=torch.float16,
        export_dir=str(tmp_path / "mo"), inference_tensor_parallel=tp,
    )  # fmt: skip
    for rank in range(tp):
        theirs = load_file(tmp_path / "mo" / f"rank{rank}.safetensors")
        assert sorted(ours[rank]) == sorted(theirs)
        for name, tensor in theirs.items():
            if "embedding" not in name:
                assert torch.equal(ours[rank][name], tensor), (rank, name)


def test_gpt2_files_without_the_transformer_prefix(models: dict[str, Path], tmp_path: Path) -> None:
    """The hub's original gpt2 / distilgpt2 files name tensors `wte.weight`, `h.0....`."""
    import shutil

    from safetensors.torch import save_file

    bare = tmp_path / "bare"
    shutil.copytree(models["gpt2"], bare)
    weights = load_file(bare / "model.safetensors")
    save_file(
        {k.removeprefix("transformer."): v for k, v in weights.items()},
        str(bare / "model.safetensors"),
    )
    a = load_file(_convert(models["gpt2"], tmp_path / "a") / "rank0.safetensors")
    b = load_file(_convert(bare, tmp_path / "b") / "rank0.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_sliding_window_is_said(tokenizer_dir: Path, tmp_path: Path) -> None:
    make_tiny("mistral", tmp_path / "m", tokenizer_dir, sliding_window=64)
    (tmp_path / "ck").mkdir()
    summary = convert_checkpoint(tmp_path / "m", tmp_path / "ck", FloatMode("float16"))
    assert any("max_attention_window_size=64" in n for n in summary["notes"])
