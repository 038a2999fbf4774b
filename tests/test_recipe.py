"""The INT8 recipe search: its simulation against converting and running, the stage's cache
key, and what it writes (nothing but the recipe)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trt_builder.calibrate import stats as stats_module
from trt_builder.calibrate.stats import calibrate, load_model, load_stats
from trt_builder.models.registry import family_for
from trt_builder.modes import SmoothQuant
from trt_builder.modes.smoothquant.convert import convert_smoothquant
from trt_builder.modes.smoothquant.recipe.simulate import Simulation, gemm_groups
from trt_builder.runtimes.checkpoint import CheckpointRuntime
from trt_builder.runtimes.scoring import kl
from trt_builder.source.files import read_hf_config
from trt_builder.spec.build import CalibrationOptions

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def calibrated(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibration")
    with pytest.MonkeyPatch.context() as mp:  # float32 statistics: see the test below
        mp.setattr(stats_module, "calibration_dtype", lambda device: None)
        calibrate(tiny_llama, out, CalibrationOptions(samples=8, seq_len=64))
    return out


@pytest.mark.parametrize("per_token", [False, True])
def test_the_simulation_is_converting_and_running(
    tiny_llama: Path, calibrated: Path, tmp_path: Path, per_token: bool
) -> None:
    """A candidate with a different alpha per layer and group, simulated in the transformers
    model, against the same candidate converted and run by the checkpoint runtime. Written in
    float32 (a dtype the builder refuses for SmoothQuant, set here past the mode's check) so
    that no rounding of the stored norms separates the two: static scales give the very same
    logits, per-token scales the same up to a few activations whose int8 rounding flips with the
    order of two float32 products (KL under 1% of the quantization's own). The statistics are
    float32 ones: bfloat16-valued ranges (a CPU calibration, `calibration_dtype`) make such
    rounding ties common enough that static scales differ in a few activations too."""
    hf_config = read_hf_config(tiny_llama)
    model = load_model(tiny_llama, "cpu", tmp_path / "offload").eval()
    groups = gemm_groups(family_for(hf_config), hf_config, set(model.state_dict()))
    assert [g.key for g in groups[:4]] == ["0.qkv", "0.dense", "0.fc", "0.proj"]
    assert groups[2].modules == ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")
    alphas = {g.key: (0.3, 0.5, 0.8, 0.6)[i % 4] for i, g in enumerate(groups)}
    by_layer: dict[int, dict[str, float]] = {}
    for g in groups:
        by_layer.setdefault(g.layer, {})[g.name] = alphas[g.key]
    mode = SmoothQuant(0.5, per_token=per_token)
    object.__setattr__(mode, "dtype", "float32")
    convert_smoothquant(tiny_llama, tmp_path, mode, calibrated, alphas=by_layer)
    assert not (tmp_path / "offload").exists() or not any((tmp_path / "offload").iterdir())
    ids = torch.randint(0, 384, (4, 64), generator=torch.Generator().manual_seed(1))
    converted = CheckpointRuntime.load(tmp_path).forward(ids).flatten(0, 1)

    sim = Simulation(model, groups, load_stats(calibrated), per_token)
    with torch.inference_mode(), sim.installed():
        sim.alphas = dict(alphas)
        simulated = model(ids).logits.float().flatten(0, 1)
        sim.alphas = {}
        floats = model(ids).logits.float().flatten(0, 1)
    quantization = float(kl(floats, converted).mean())
    assert quantization > 1e-3  # the INT8 GEMMs do change the logits
    if per_token:
        assert float(kl(simulated, converted).mean()) < 0.01 * quantization
        assert float((simulated.argmax(-1) == converted.argmax(-1)).double().mean()) >= 0.99
    else:
        assert torch.equal(simulated, converted)
    # and the model is its float self again once the simulation is removed
    with torch.inference_mode():
        assert torch.equal(model(ids).logits.float().flatten(0, 1), floats)


def test_the_recipe_stage(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--dtype int8` (alpha auto) runs the search as its own stage, on the float model it
    loads once; its recipe is all it writes, convert builds the recipe's alphas, and a variant
    that differs only in the KV cache reuses the recipe."""
    from trt_builder.calibrate import stats
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    monkeypatch.setattr(stats, "calibration_dtype", lambda device: None)  # as on a GPU
    loads: list[object] = []
    real_load = stats.load_hf_model
    monkeypatch.setattr(
        stats, "load_hf_model", lambda *a, **kw: loads.append(1) or real_load(*a, **kw)
    )

    def build(**kw: object) -> tuple[dict[str, str], object]:
        spec = make_spec(model=str(tiny_llama), dtype="int8", out=tmp_path / "e", triton_root=tmp_path / "t",
                         **{"calibrate.samples": 8, "calibrate.seq_len": 64}, **kw)  # fmt: skip
        result = run(spec, only=("fetch", "calibrate", "recipe", "convert"))
        return {r.name: r.status for r in result.records}, result

    statuses, result = build()
    assert statuses == {"fetch": "ran", "calibrate": "ran", "recipe": "ran", "convert": "ran"}
    assert len(loads) == 1  # the search's (calibrate's: calibrate/layers.py)
    records = {r.name: r for r in result.records}  # type: ignore[attr-defined]
    recipe_dir = Path(records["recipe"].output)
    assert sorted(p.name for p in recipe_dir.iterdir()) == ["recipe.json", "stage.json"]
    recipe = json.loads((recipe_dir / "recipe.json").read_text())
    names = [c["name"] for c in recipe["candidates"]]
    assert names == ["alpha 0.4", "alpha 0.5", "alpha 0.6", "alpha 0.7", "alpha 0.8", "per layer"]
    for c in recipe["candidates"]:
        assert c["kl"] > 0 and c["kl_se"] > 0 and 0 < c["top1"] <= 1 and c["windows"] >= 1
    finalists = [c for c in recipe["candidates"] if c["windows"] == recipe["windows"]]
    assert recipe["chosen"] == min(finalists, key=lambda c: c["kl"])["name"]
    assert sorted(recipe["alphas"]) == ["0", "1"]
    assert {k for k, _ in recipe["sensitivity"]} == {
        f"{layer}.{g}" for layer in (0, 1) for g in ("qkv", "dense", "fc", "proj")
    }

    checkpoint = Path(records["convert"].output)
    assert json.loads((checkpoint / "recipe.json").read_text()) == recipe
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["quantization"]["smoothquant_val"] == recipe["alpha"]
    # nothing but the winner was ever written: no candidate checkpoint anywhere
    written = {p.name for p in (tmp_path / "e").rglob("*.safetensors")}
    assert written == {"model.safetensors", "calibration.safetensors", "rank0.safetensors"}

    statuses, _ = build(kv_cache="int8")
    assert statuses == {"fetch": "cached", "calibrate": "cached", "recipe": "cached",
                        "convert": "ran"}  # fmt: skip
    statuses, _ = build(**{"int8.alpha": 0.6})  # a fixed alpha needs no search
    assert "recipe" not in statuses and statuses["convert"] == "ran"
    assert len(loads) == 1


def test_the_calibrations_model_does_not_outlive_its_stage(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8-wo calibrates, then converts: the model calibrate ran layer by layer is gone
    (freed) before convert starts, not held through convert and verify."""
    import gc
    import weakref

    from trt_builder.calibrate import layers
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec
    from trt_builder.targets.engine import convert as engine_convert

    refs: list[weakref.ref[torch.nn.Module]] = []
    real_load, real_convert = layers.load_hf_model, engine_convert.convert_model

    def load(*args: object, **kwargs: object) -> torch.nn.Module:
        refs.append(weakref.ref(model := real_load(*args, **kwargs)))
        return model

    def convert(*args: object, **kwargs: object) -> object:
        gc.collect()
        alive.append(refs[0]() is not None)
        return real_convert(*args, **kwargs)

    alive: list[bool] = []
    monkeypatch.setattr(layers, "load_hf_model", load)
    monkeypatch.setattr(engine_convert, "convert_model", convert)
    spec = make_spec(model=str(tiny_llama), dtype="int8-wo", out=tmp_path / "e", triton_root=tmp_path / "t",
                     **{"calibrate.samples": 8, "calibrate.seq_len": 64})  # fmt: skip
    statuses = {r.name: r.status for r in run(spec, only=("fetch", "calibrate", "convert")).records}
    assert statuses == {"fetch": "ran", "calibrate": "ran", "convert": "ran"}
    assert len(refs) == 1 and alive == [False]
