"""calibrate: activation statistics checked against an independent computation, its own cached
artifact shared by variants, and its inputs (bundled set, text and JSONL files) refused clearly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import FAMILIES, make_tiny
from trt_builder.calibrate.corpus import load_texts, make_samples
from trt_builder.calibrate.stats import calibrate, calibration_dtype, load_stats
from trt_builder.core.errors import InputError
from trt_builder.spec.build import CalibrationOptions, make_spec

pytestmark = pytest.mark.integration
SMALL = CalibrationOptions(samples=6, seq_len=32, batch_size=4)


def test_statistics_match_an_independent_computation(tiny_llama: Path, tmp_path: Path) -> None:
    summary = calibrate(tiny_llama, tmp_path, SMALL)
    stats = load_stats(tmp_path)
    assert summary["tokens"] == 6 * 32 and summary["linears"] == 2 * 7
    ids = make_samples(AutoTokenizer.from_pretrained(tiny_llama), load_texts("bundled")[0], SMALL)
    dtype = getattr(torch, summary["dtype"])  # bfloat16 on a CPU that computes it natively
    assert dtype == (calibration_dtype("cpu") or torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype).eval()
    layer = model.model.layers[0]
    with torch.no_grad():  # layer 0's q/k/v input is the normed embedding: no hooks needed
        x = layer.input_layernorm(model.model.embed_tokens(ids))
        k = layer.self_attn.k_proj(x)
    p = "model.layers.0.self_attn."
    torch.testing.assert_close(stats[p + "q_proj.input_absmax"], x.abs().amax(dim=(0, 1)).float())
    torch.testing.assert_close(stats[p + "k_proj.output_absmax"], k.abs().amax(dim=(0, 1)).float())
    torch.testing.assert_close(
        stats[p + "q_proj.input_sqmean"], x.float().square().mean(dim=(0, 1))
    )
    assert set(stats) == {
        f"model.layers.{i}.{m}.{kind}"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        for kind in ("input_absmax", "input_sqmean", "output_absmax")
    }  # fmt: skip


def test_gpt2_conv1d_layers_are_calibrated(tokenizer_dir: Path, tmp_path: Path) -> None:
    make_tiny("gpt2", tmp_path / "gpt2", tokenizer_dir)
    (tmp_path / "out").mkdir()
    calibrate(tmp_path / "gpt2", tmp_path / "out", SMALL)
    stats = load_stats(tmp_path / "out")
    assert stats["transformer.h.1.attn.c_attn.input_absmax"].shape == (64,)
    assert stats["transformer.h.1.attn.c_attn.output_absmax"].shape == (3 * 64,)
    assert stats["transformer.h.1.mlp.c_proj.output_absmax"].min() > 0


def test_samples_follow_the_seed(tiny_llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    texts = load_texts("bundled")[0]
    a, b = make_samples(tok, texts, SMALL), make_samples(tok, texts, SMALL)
    c = make_samples(tok, texts, CalibrationOptions(samples=6, seq_len=32, seed=1))
    assert torch.equal(a, b) and not torch.equal(a, c) and a.shape == (6, 32)


def test_text_and_jsonl_sets_and_their_errors(tiny_llama: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("First document about rivers.\n\nSecond one, about mountains.\n")
    assert load_texts(str(text))[0] == [
        "First document about rivers.",
        "Second one, about mountains.",
    ]
    rows = tmp_path / "set.jsonl"
    rows.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    with pytest.raises(
        InputError, match='set.jsonl line 3 is not a JSON object with a "text" field'
    ):
        load_texts(str(rows))
    with pytest.raises(InputError, match="is not a file: give a .txt or .jsonl file"):
        load_texts(str(tmp_path / "missing.txt"))
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    with pytest.raises(
        InputError, match="gives only 0 samples of 512 tokens: lower --calib-samples"
    ):
        make_samples(tok, ["short"], CalibrationOptions(samples=2, seq_len=512))


def test_a_cached_artifact_shared_by_variants(tiny_llama: Path, tmp_path: Path) -> None:
    from trt_builder.pipeline.build import run  # tritonclient: absent on the GPU machine

    def spec(**kw: object) -> object:
        return make_spec(model=str(tiny_llama), out=tmp_path / "engines", triton_root=tmp_path / "t",
                         **{"calibrate.samples": 6, "calibrate.seq_len": 32}, **kw)  # fmt: skip

    run(spec(), only=("fetch",))
    first = run(spec(), only=("calibrate",)).records[0]
    assert first.status == "ran" and Path(first.output).name == "bundled-6x32-seed0"
    again = run(spec(dtype="bfloat16"), only=("calibrate",)).records[0]  # a quantization knob
    assert again.status == "cached" and again.key == first.key and again.output == first.output
    other = run(spec(**{"calibrate.seed": 3}), only=("calibrate",)).records[0]
    assert other.status == "ran" and Path(other.output).name == "bundled-6x32-seed3"
    assert Path(first.output).is_dir()  # both settings kept side by side
    build = run(spec(), only=("fetch", "calibrate", "convert"))
    assert [r.name for r in build.records] == ["fetch", "convert"]  # float16 needs none


@pytest.mark.gpu
def test_cuda_calibration_agrees_with_cpu(tiny_llama: Path, tmp_path: Path) -> None:
    """On CUDA the model is placed by accelerate's device_map (every GPU, offloading what does
    not fit); the statistics agree with the CPU's."""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cuda").mkdir()
    calibrate(tiny_llama, tmp_path / "cpu", SMALL)
    summary = calibrate(
        tiny_llama, tmp_path / "cuda", CalibrationOptions(samples=6, seq_len=32, device="cuda")
    )
    cpu, cuda = load_stats(tmp_path / "cpu"), load_stats(tmp_path / "cuda")
    assert summary["device"] == "cuda" and summary["peak_gpu_bytes"] > 0
    assert cpu.keys() == cuda.keys()
    for name in cpu:
        torch.testing.assert_close(cuda[name], cpu[name], rtol=1e-3, atol=1e-4)
    assert not (tmp_path / "cuda" / "offload").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_one_layer_at_a_time_gives_the_whole_models_statistics_bit_for_bit(
    family: str, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """calibrate runs the model one decoder layer at a time (calibrate/layers.py): its
    statistics are those of the whole model run over the same batches, to the bit, in every
    family; while a layer computes, no other layer's weights are off the meta device."""
    from trt_builder.calibrate import layers, stats
    from trt_builder.models.registry import family_for
    from trt_builder.source.files import read_hf_config
    from trt_builder.source.hf import load_hf_model

    make_tiny(family, tmp_path / "m", tokenizer_dir)
    monkeypatch.setattr(stats, "calibration_dtype", lambda device: None)  # float32, both
    loaded: list[int] = []
    run = layers.LayerByLayer.run

    def counting(self: layers.LayerByLayer, carried: list[layers.Carried]) -> Any:
        def count(*_: Any) -> None:
            loaded.append(sum(any(p.device.type != "meta" for p in self.model.get_submodule(n)
                                  .parameters()) for n in self.layer_names))  # fmt: skip

        for name in self.layer_names:
            self.model.get_submodule(name).register_forward_pre_hook(count)
        return run(self, carried)

    monkeypatch.setattr(layers.LayerByLayer, "run", counting)
    (tmp_path / "out").mkdir()
    calibrate(tmp_path / "m", tmp_path / "out", SMALL)
    ours = load_stats(tmp_path / "out", modules=True)
    hf = tmp_path / "m"
    ids = make_samples(AutoTokenizer.from_pretrained(hf), load_texts("bundled")[0], SMALL)
    whole = stats.collect(load_hf_model(hf).eval(), ids, SMALL.batch_size,
                          family_for(read_hf_config(hf)))  # fmt: skip
    assert ours.keys() == whole.keys() and len(ours) > 0
    for name, value in whole.items():
        assert torch.equal(ours[name], value), name
    batches = -(-SMALL.samples // SMALL.batch_size)
    assert loaded == [1] * (2 * batches)  # 2 layers, each batch through each, one loaded


@pytest.mark.gpu
def test_one_layer_at_a_time_on_cuda_gives_the_whole_models_statistics(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on a CUDA GPU (the path a 7B build takes: accelerate's disk offload with the
    layers read onto the GPU one at a time): the statistics are those of the whole model run on
    the GPU over the same batches, in float32."""
    import dataclasses

    from trt_builder.calibrate import stats
    from trt_builder.models.registry import family_for
    from trt_builder.source.files import read_hf_config
    from trt_builder.source.hf import load_hf_model

    monkeypatch.setattr(stats, "calibration_dtype", lambda device: None)  # float32, both
    options = dataclasses.replace(SMALL, device="cuda")
    summary = calibrate(tiny_llama, tmp_path, options)
    assert summary["device"] == "cuda" and summary["peak_gpu_bytes"] > 0
    ours = load_stats(tmp_path, modules=True)
    ids = make_samples(AutoTokenizer.from_pretrained(tiny_llama), load_texts("bundled")[0], SMALL)
    whole = stats.collect(load_hf_model(tiny_llama).eval().to("cuda"), ids, SMALL.batch_size,
                          family_for(read_hf_config(tiny_llama)))  # fmt: skip
    assert ours.keys() == whole.keys() and len(ours) > 0
    for name, value in whole.items():
        torch.testing.assert_close(ours[name], value.cpu(), rtol=1e-5, atol=1e-6, msg=name)
