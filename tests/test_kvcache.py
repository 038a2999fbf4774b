"""The INT8 KV cache on float and weight-only checkpoints, and its K/V balancing
(trt_builder/modes/kvcache/convert.py): exact in float, replicated across ranks, better than one plain scale."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tiny_models import make_tiny
from trt_builder.calibrate.stats import calibrate, load_stats
from trt_builder.convert.floats import convert_checkpoint
from trt_builder.core.errors import ConversionError
from trt_builder.modes import FloatMode, WeightOnlyInt8
from trt_builder.modes.kvcache import convert as kvcache
from trt_builder.runtimes.checkpoint import CheckpointRuntime, KVCache
from trt_builder.spec.build import CalibrationOptions

pytestmark = pytest.mark.integration
IDS = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 300, 21, 8, 90, 33, 2]])
CAL = CalibrationOptions(samples=8, seq_len=64)


@pytest.fixture(scope="module")
def calibrated(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibration")
    calibrate(tiny_llama, out, CAL)
    return out


def _convert(hf: Path, tmp: Path, mode: object, calibration: Path | None, **kw: int) -> Path:
    tmp.mkdir(parents=True)
    convert_checkpoint(hf, tmp, mode, calibration=calibration, **kw)  # type: ignore[arg-type]
    return tmp


def _decoded(model: CheckpointRuntime, ids: torch.Tensor = IDS, prefix: int = 4) -> torch.Tensor:
    """Logits with every token after `prefix` fed one at a time through the (INT8) KV cache."""
    cache = KVCache()
    steps = [model.forward(ids[:, :prefix], cache)]
    steps += [model.forward(ids[:, t : t + 1], cache) for t in range(prefix, ids.shape[1])]
    return torch.cat(steps, dim=1)


def test_the_balancing_is_exact_in_float(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    plain = CheckpointRuntime.load(_convert(tiny_llama, tmp_path / "a", FloatMode("float32"), None))
    ck = _convert(tiny_llama, tmp_path / "b", FloatMode("float32", kv_cache="int8"), calibrated)
    kv8 = CheckpointRuntime.load(ck)
    config = kv8.config
    assert (
        config["quantization"]["kv_cache_quant_algo"] == "INT8"
        and config["num_key_value_heads"] < config["num_attention_heads"]
    )
    a = load_file(tmp_path / "a" / "rank0.safetensors")
    b = load_file(ck / "rank0.safetensors")
    assert not torch.equal(
        a["transformer.layers.0.attention.qkv.weight"],
        b["transformer.layers.0.attention.qkv.weight"],
    )
    # prompts attend to their own unquantized K/V: the rewrite (GQA, RoPE pairs, dense columns)
    # must leave the logits as they were
    torch.testing.assert_close(kv8.forward(IDS), plain.forward(IDS), atol=2e-4, rtol=1e-4)
    # two tensor-parallel ranks hold the same scale and give the same model
    tp2 = _convert(
        tiny_llama, tmp_path / "tp2", FloatMode("float32", kv_cache="int8"), calibrated, tp=2
    )
    scale = "transformer.layers.1.attention.kv_cache_scaling_factor"
    ranks = [load_file(tp2 / f"rank{r}.safetensors") for r in range(2)]
    assert torch.equal(ranks[0][scale], b[scale]) and torch.equal(ranks[1][scale], b[scale])
    torch.testing.assert_close(
        _decoded(CheckpointRuntime.load(tp2)), _decoded(kv8), atol=1e-4, rtol=1e-4
    )


def test_gpt2_learned_positions_and_fused_qkv(tmp_path: Path, tokenizer_dir: Path) -> None:
    make_tiny("gpt2", tmp_path / "gpt2", tokenizer_dir)
    (tmp_path / "cal").mkdir()
    calibrate(tmp_path / "gpt2", tmp_path / "cal", CAL)
    plain = CheckpointRuntime.load(
        _convert(tmp_path / "gpt2", tmp_path / "a", FloatMode("float32"), None)
    )
    kv8 = CheckpointRuntime.load(
        _convert(
            tmp_path / "gpt2",
            tmp_path / "b",
            FloatMode("float32", kv_cache="int8"),
            tmp_path / "cal",
        )
    )
    torch.testing.assert_close(kv8.forward(IDS), plain.forward(IDS), atol=2e-4, rtol=1e-4)
    assert kv8.kv_int8 and torch.isfinite(_decoded(kv8)).all()


def test_balancing_beats_one_plain_scale(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure the balancing fixes: V ranges far below K's (SmolLM2's layer 0: 0.6 against
    10.8), so one scale over q, k and v leaves V a few levels. Made here by an exact rewrite of
    the tiny model (V 50x smaller, dense 50x larger), decoded over held-out text."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from trt_builder.calibrate.corpus import corpus_windows

    hf = tmp_path / "hf"
    shutil.copytree(tiny_llama, hf)
    weights = load_file(hf / "model.safetensors")
    for i in range(2):
        weights[f"model.layers.{i}.self_attn.v_proj.weight"] /= 50
        weights[f"model.layers.{i}.self_attn.o_proj.weight"] *= 50
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "cal").mkdir()
    calibrate(hf, tmp_path / "cal", CAL)
    ids = torch.tensor(corpus_windows(AutoTokenizer.from_pretrained(hf), 64, window=32))

    def decoded(ck: Path) -> torch.Tensor:
        return torch.cat([_decoded(CheckpointRuntime.load(ck), row[None]) for row in ids])

    reference = decoded(_convert(hf, tmp_path / "f", FloatMode("float32"), None))
    kv8 = FloatMode("float32", kv_cache="int8")
    balanced = decoded(_convert(hf, tmp_path / "b", kv8, tmp_path / "cal"))

    def plain(ranges: torch.Tensor, config: dict, **_: object) -> kvcache.KVBalance:
        """TensorRT-LLM's own convention: no rewrite, s = max |q|, |k|, |v| / 127."""
        heads, _kv, head, _r = kvcache.shape_of(config)
        return kvcache.KVBalance(torch.ones(ranges.numel()), torch.ones(heads * head),
                                 ranges.max(), (ranges.max() / 127).reshape(1))  # fmt: skip

    monkeypatch.setattr(kvcache, "balance", plain)  # the name the KV room calls
    naive = decoded(_convert(hf, tmp_path / "n", kv8, tmp_path / "cal"))
    err_balanced = float((balanced - reference).abs().mean())
    err_naive = float((naive - reference).abs().mean())
    assert 0 < err_balanced < 0.5 * err_naive


def test_weight_only_with_the_int8_kv_cache(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    unclipped = WeightOnlyInt8(kv_cache="int8", clip=False)  # clipping: tests/test_int8_wo_clip.py
    ck = _convert(tiny_llama, tmp_path / "wo", unclipped, calibrated)
    model = CheckpointRuntime.load(ck)
    assert model.config["quantization"] == {**model.config["quantization"], "quant_algo": "W8A16",
                                            "kv_cache_quant_algo": "INT8"}  # fmt: skip
    w = load_file(ck / "rank0.safetensors")
    # one factor for all of V (the dense weight's INT8 rows keep their rounding)
    plain = _convert(tiny_llama, tmp_path / "plain", WeightOnlyInt8(clip=False), None)
    ratio = (
        w["transformer.layers.0.attention.dense.weight"].float()
        / load_file(plain / "rank0.safetensors")[
            "transformer.layers.0.attention.dense.weight"
        ].float()
    )
    assert float(ratio.max() - ratio.min()) < 1e-2 * float(ratio.abs().mean())
    assert torch.isfinite(_decoded(model)).all()


def test_refusals(tiny_llama: Path, calibrated: Path, tmp_path: Path, tokenizer_dir: Path) -> None:
    with pytest.raises(ConversionError, match="needs a calibration: run trt-builder calibrate"):
        _convert(tiny_llama, tmp_path / "a", FloatMode("float16", kv_cache="int8"), None)
    make_tiny("qwen3", tmp_path / "qwen3", tokenizer_dir)
    (tmp_path / "q3cal").mkdir()
    calibrate(tmp_path / "qwen3", tmp_path / "q3cal", CalibrationOptions(samples=2, seq_len=16))
    with pytest.raises(
        ConversionError, match="not supported for Qwen3ForCausalLM .* drop --kv-cache int8"
    ):
        _convert(
            tmp_path / "qwen3",
            tmp_path / "b",
            FloatMode("float16", kv_cache="int8"),
            tmp_path / "q3cal",
        )
    stats = load_stats(calibrated)
    with pytest.raises(ConversionError, match="recalibrate"):
        kvcache.balance(
            stats["model.layers.0.self_attn.k_proj.output_absmax"],
            {"num_attention_heads": 4, "hidden_size": 64},
        )


def test_the_pipeline_calibrates_for_the_int8_kv_cache(tiny_llama: Path, tmp_path: Path) -> None:
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    def build(dtype: str, **kw: object) -> tuple[dict[str, str], Path]:
        spec = make_spec(model=str(tiny_llama), dtype=dtype, kv_cache="int8", out=tmp_path / "e",
                         triton_root=tmp_path / "t", **{"calibrate.samples": 8, "calibrate.seq_len": 64},
                         **kw)  # fmt: skip
        result = run(spec, only=("fetch", "calibrate", "convert"))
        return {r.name: r.status for r in result.records}, Path(result.layout.checkpoint)

    statuses, ck = build("int8-wo")
    assert statuses == {"fetch": "ran", "calibrate": "ran", "convert": "ran"}
    assert ck.parent.name == "int8-wo-kv8-tp1-pp1"
    assert "transformer.layers.1.attention.kv_cache_scaling_factor" in load_file(
        ck / "rank0.safetensors"
    )
    statuses, ck = build("float16", tp=2)  # the same calibration serves every variant
    assert statuses == {"fetch": "cached", "calibrate": "cached", "convert": "ran"}
    assert ck.parent.name == "float16-kv8-tp2-pp1" and (ck / "rank1.safetensors").is_file()


def test_verify_passes_a_balanced_checkpoint(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """The static check knows the balancing's rewrite (no false 'differs from the model')."""
    from trt_builder.checkpoint.reader import read_checkpoint
    from trt_builder.verify.diagnose import check_static

    ck = _convert(tiny_llama, tmp_path / "kv8", FloatMode("float16", kv_cache="int8"), calibrated)
    config, weights = read_checkpoint(ck)
    findings, notes = check_static(ck, config, weights, tiny_llama)
    assert findings == [] and "compared through the runtime only" in notes[0]
    # and still finds a real fault in the tensors it compares
    weights["transformer.layers.1.mlp.proj.weight"] = (
        weights["transformer.layers.1.mlp.proj.weight"] * 2
    )
    findings, _ = check_static(ck, config, weights, tiny_llama)
    assert [f.cause for f in findings] == [
        "a wrong weight scale in transformer.layers.1.mlp.proj.weight"
    ]
