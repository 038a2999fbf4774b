"""INT8 weight-only clipping (trt_builder/modes/weight_only/convert.py): every written row is what the
builder then quantizes on the evaluated grid, never worse than plain rounding on the calibrated
output error, composed after the INT8 KV cache's balance; int8-wo builds calibrate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trt_builder.calibrate.corpus import load_texts, make_samples
from trt_builder.calibrate.stats import calibrate, calibration_dtype, load_stats
from trt_builder.convert import floats
from trt_builder.convert.model import convert_model
from trt_builder.convert.plan import plan_conversion
from trt_builder.convert.write import load_sources
from trt_builder.modes import WeightOnlyInt8
from trt_builder.modes.kvcache.convert import KVCacheScales
from trt_builder.modes.weight_only.checkpoint import WEIGHT_ONLY_LINEARS
from trt_builder.modes.weight_only.convert import CLIPPED_LINEARS, GRID
from trt_builder.runtimes.checkpoint import weight_only_int8
from trt_builder.spec.build import CalibrationOptions

pytestmark = pytest.mark.integration
CAL = CalibrationOptions(samples=8, seq_len=64)
F16 = torch.float16


@pytest.fixture(scope="module")
def calibrated(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibration")
    calibrate(tiny_llama, out, CAL)
    return out


def _convert(hf: Path, tmp: Path, mode: WeightOnlyInt8, calibration: Path) -> tuple[dict, dict]:
    tmp.mkdir(parents=True)
    summary = convert_model(mode, hf, tmp, tp=1, pp=1, calibration=calibration)
    return summary, load_file(tmp / "rank0.safetensors")


def _sources(hf: Path, mode: WeightOnlyInt8, calibration: Path) -> dict[str, torch.Tensor]:
    """The float32 weights of every quantized linear as the converter has them before the
    clipping (after the INT8 KV cache's balance for `mode.kv_int8`), by TensorRT-LLM name."""
    family, config, rules, index, _ = plan_conversion(hf, mode)
    with index:
        kv = KVCacheScales.of(mode, config, family, {r.name for r in rules}, calibration)
        rewrite = floats._kv_cache(kv, rules, v_channels=mode.weights is None)[0]
        out = {}
        for rule in rules:
            if rule.name.startswith("transformer.layers.") and rule.name.endswith(
                WEIGHT_ONLY_LINEARS
            ):
                parts = [p.float() for p in load_sources(rule, index)]
                out[rule.name] = torch.cat(
                    rewrite[rule.name](parts) if rule.name in rewrite else parts
                )
    return out


def _ratios(original: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
    """The grid ratio of each written row, checked: the row is the original clamped to
    +-fp16(r * amax), cast, and its absmax (which sets the builder's scale) is that bound."""
    amax = original.abs().amax(1, keepdim=True)
    bounds = torch.stack([(amax[:, 0] * r).to(F16) for r in GRID], 1)  # [rows, grid]
    top = written.abs().amax(1)
    match = bounds == top[:, None]
    assert bool(match.any(1).all()), "a written row's absmax is no fp16(r * amax) of the grid"
    ratios = torch.tensor(GRID)[match.int().argmax(1)]  # the first (largest) r that matches
    bound = top.float()[:, None]
    assert torch.equal(written, original.clamp(-bound, bound).to(F16))
    return ratios


def _error(original: torch.Tensor, written: torch.Tensor, sqmean: torch.Tensor) -> torch.Tensor:
    return (original.double() - weight_only_int8(written, F16).double()).square() @ sqmean.double()


def test_rows_are_clipped_on_the_builders_grid_and_never_worse(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    summary, clipped = _convert(tiny_llama, tmp_path / "clip", WeightOnlyInt8(), calibrated)
    _, plain = _convert(tiny_llama, tmp_path / "plain", WeightOnlyInt8(clip=False), calibrated)
    stats = load_stats(calibrated)
    originals = _sources(tiny_llama, WeightOnlyInt8(), calibrated)
    inputs = {"qkv": "self_attn.q_proj", "dense": "self_attn.o_proj", "fc": "mlp.gate_proj",
              "gate": "mlp.up_proj", "proj": "mlp.down_proj"}  # fmt: skip
    assert len(originals) == 2 * 5
    ratios, totals = [], []
    for name, original in originals.items():
        layer, linear = name.split(".")[2], name.split(".")[-2]
        assert torch.equal(plain[name], original.to(F16))  # clip=False: the cast alone
        if not name.endswith(CLIPPED_LINEARS):  # proj
            assert torch.equal(clipped[name], plain[name])
            continue
        ratios.append(_ratios(original, clipped[name]))
        sqmean = stats[f"model.layers.{layer}.{inputs[linear]}.input_sqmean"]
        err_clip = _error(original, clipped[name], sqmean)
        err_plain = _error(original, plain[name], sqmean)
        assert bool((err_clip <= err_plain * (1 + 1e-6)).all()), name
        totals.append((float(err_clip.sum()), float(err_plain.sum())))
    r = torch.cat(ratios)
    total_clip, total_plain = (sum(t) for t in zip(*totals, strict=True))
    assert summary["weight_clipping"] == {
        "rows": r.numel(),
        "clipped": int((r < 1).sum()),
        "mean_ratio": round(float(r.double().mean()), 5),
    }
    assert int((r < 1).sum()) > 0.05 * r.numel() and total_clip < 0.99 * total_plain
    # untouched: norms, embeddings, lm_head
    assert torch.equal(clipped["lm_head.weight"], plain["lm_head.weight"])


def test_the_statistic_is_the_mean_square_of_each_input_channel(
    tiny_llama: Path, calibrated: Path
) -> None:
    ids = make_samples(AutoTokenizer.from_pretrained(tiny_llama), load_texts("bundled")[0], CAL)
    dtype = calibration_dtype("cpu") or torch.float32  # what the calibration ran in
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype).eval()
    layer = model.model.layers[0]
    with torch.no_grad():  # layer 0's q/k/v input is the normed embedding: no hooks needed
        x = layer.input_layernorm(model.model.embed_tokens(ids)).float()
    stats = load_stats(calibrated)
    torch.testing.assert_close(
        stats["model.layers.0.self_attn.q_proj.input_sqmean"], x.square().mean(dim=(0, 1))
    )
    assert stats["model.layers.1.mlp.down_proj.input_sqmean"].shape == (128,)


def test_clipping_comes_after_the_kv_cache_balance(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """The builder quantizes the balanced weights: they are what is clipped on its grid."""
    mode = WeightOnlyInt8(kv_cache="int8")
    summary, written = _convert(tiny_llama, tmp_path / "kv", mode, calibrated)
    balanced = _sources(tiny_llama, mode, calibrated)
    r = torch.cat([_ratios(balanced[name], written[name]) for name in balanced])
    assert summary["weight_clipping"]["clipped"] == int((r < 1).sum()) > 0
    assert summary["kv_cache_quant_algo"] == "INT8"


def test_row_parallel_slices_are_clipped_each_on_its_own(
    tiny_llama: Path, calibrated: Path, tmp_path: Path
) -> None:
    """With tp 2 each rank quantizes its half of dense's columns: each half of a row is clipped
    to a grid ratio of its own absmax."""
    (tmp_path / "tp2").mkdir()
    convert_model(
        WeightOnlyInt8(), tiny_llama, tmp_path / "tp2", tp=2, pp=1, calibration=calibrated
    )
    dense = "transformer.layers.0.attention.dense.weight"
    original = _sources(tiny_llama, WeightOnlyInt8(), calibrated)[dense]
    ratios = [
        _ratios(half, load_file(tmp_path / "tp2" / f"rank{rank}.safetensors")[dense])
        for rank, half in enumerate(original.chunk(2, 1))
    ]
    assert not torch.equal(ratios[0], ratios[1])  # each half its own search


def test_an_int8_wo_build_calibrates_and_no_wo_clip_does_not(
    tiny_llama: Path, tmp_path: Path
) -> None:
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    def build(**kw: object) -> dict[str, str]:
        spec = make_spec(model=str(tiny_llama), dtype="int8-wo", out=tmp_path / "e",
                         triton_root=tmp_path / "t", **{"calibrate.samples": 8,
                         "calibrate.seq_len": 64}, **kw)  # fmt: skip
        result = run(spec, only=("fetch", "calibrate", "convert"))
        return {r.name: r.status for r in result.records}

    assert build() == {"fetch": "ran", "calibrate": "ran", "convert": "ran"}
    assert build(**{"int8.wo_clip": False}) == {"fetch": "cached", "convert": "ran"}
