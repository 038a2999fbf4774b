from __future__ import annotations

from pathlib import Path

import pytest

from trt_builder.core.errors import SpecError
from trt_builder.modes import FloatMode, Fp8, SmoothQuant, WeightOnlyInt8, mode_for
from trt_builder.spec.build import BuildLimits, BuildSpec, Int8Options, load_toml, make_spec


def test_defaults_and_variant() -> None:
    spec = make_spec()
    assert spec.model is None and spec.dtype == "float16" and spec.tp == 1
    assert spec.variant == "float16-tp1-pp1"
    assert spec.to_json()["mode"] == {
        "mode": "float",
        "version": 2,
        "dtype": "float16",
        "kv_cache": "model",
    }


def test_toml_then_flags_override(tmp_path: Path) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(
        'dtype = "bfloat16"\ntp = 1\n[limits]\nmax_batch_size = 4\nmax_seq_len = 512\nmax_input_len = 256\n[verify]\nmax_new_tokens = 4\n'
    )
    spec = make_spec(load_toml(path), dtype="float32", **{"limits.max_batch_size": 2})
    assert spec.dtype == "float32"  # the flag wins
    assert spec.limits == BuildLimits(max_batch_size=2, max_input_len=256, max_seq_len=512)
    assert spec.verify.max_new_tokens == 4  # kept from TOML
    assert make_spec(load_toml(path), dtype=None).dtype == "bfloat16"  # unset flag leaves TOML


@pytest.mark.parametrize(
    ("toml", "flags", "needle"),
    [
        (
            {"dtyp": "float16"},
            {},
            "unknown key(s) dtyp in the build spec: valid keys are model, revision, dtype",
        ),
        ({"limits": {"max_batch": 3}}, {}, "unknown key(s) max_batch in [limits]"),
        ({}, {"tp": 0}, "tp must be a positive integer"),
        ({}, {"dtype": "int4"}, "use one of float16, bfloat16, float32, auto, int8, int8-wo"),
        (
            {"limits": {"max_input_len": 4096, "max_seq_len": 2048}},
            {},
            "raise max_seq_len or lower max_input_len",
        ),
        ({"target_gpu": "GTX1080"}, {}, "unknown target GPU 'GTX1080': use one of"),
        ({"verify": {"min_top1": 95}}, {}, "give a value between 0 and 1"),
        ({"revision": "main; rm -rf /"}, {}, "is not a branch, tag or commit sha"),
    ],
)
def test_invalid_specs_name_the_fix(toml: dict, flags: dict, needle: str) -> None:
    with pytest.raises(SpecError) as info:
        make_spec(toml, **flags)
    assert needle in str(info.value)
    assert info.value.exit_code == 2


def test_bad_toml_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("dtype = \n")
    with pytest.raises(SpecError, match="is not valid TOML"):
        load_toml(bad)
    with pytest.raises(SpecError, match="does not exist: check the --config path"):
        load_toml(tmp_path / "missing.toml")


def test_modes_dispatch_by_dtype() -> None:
    assert mode_for("bfloat16") == FloatMode("bfloat16")
    mode = mode_for("int8")
    assert mode == SmoothQuant(alpha=None)
    assert mode.quant_algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN" and mode.needs_calibration
    assert mode_for("int8-wo") == WeightOnlyInt8()
    assert BuildSpec(dtype="int8-wo").variant == "int8-wo-tp1-pp1"
    assert BuildSpec(dtype="int8").variant == "int8-sq-tp1-pp1"
    static = BuildSpec(
        dtype="int8", kv_cache="int8", int8=Int8Options(alpha=0.6, granularity="per-tensor")
    )
    assert static.mode == SmoothQuant(alpha=0.6, per_token=False, kv_cache="int8")
    assert static.variant == "int8-sq-static-kv8-tp1-pp1"
    assert static.mode.quant_algo == "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN"
    assert make_spec(**{"dtype": "int8", "int8.alpha": "0.7"}).int8.alpha == 0.7  # a CLI string
    # the INT8 KV cache goes with every dtype, and calibrates
    assert BuildSpec(dtype="int8-wo", kv_cache="int8").variant == "int8-wo-kv8-tp1-pp1"
    assert BuildSpec(dtype="float16", kv_cache="int8").mode == FloatMode("float16", kv_cache="int8")
    assert BuildSpec(dtype="bfloat16", kv_cache="int8").mode.needs_calibration
    # int8-wo calibrates for its clipping unless the spec turns it off (--no-wo-clip)
    assert BuildSpec(dtype="int8-wo").mode.needs_calibration
    plain = make_spec(**{"dtype": "int8-wo", "int8.wo_clip": False}).mode
    assert plain == WeightOnlyInt8(clip=False) and not plain.needs_calibration
    # ... and builds beside the clipped variant, not over it
    assert (
        make_spec(**{"dtype": "int8-wo", "int8.wo_clip": False}).variant == "int8-wo-noclip-tp1-pp1"
    )
    assert plain.to_json()["version"] == 3 and plain.name == "int8-wo-noclip"
    with pytest.raises(SpecError, match="int8.wo_clip must be true or false"):
        Int8Options(wo_clip="no")  # type: ignore[arg-type]
    with pytest.raises(
        SpecError, match=r"int8.alpha\) is auto or a number from 0 to 1, not 'high'"
    ):
        Int8Options(alpha="high")
    with pytest.raises(SpecError, match="is auto or a number from 0 to 1, not 1.5"):
        SmoothQuant(alpha=1.5)
    with pytest.raises(SpecError, match="float16 or bfloat16 activations"):
        WeightOnlyInt8(dtype="float32")


def test_fp8_modes_and_where_they_are_refused() -> None:
    fp8 = BuildSpec(dtype="fp8")
    assert fp8.mode == Fp8() and fp8.mode.quant_algo == "FP8" and fp8.mode.needs_calibration
    assert fp8.variant == "fp8-tp1-pp1"
    assert BuildSpec(dtype="fp8", kv_cache="fp8").variant == "fp8-fp8kv-tp1-pp1"
    assert BuildSpec(dtype="float16", kv_cache="fp8").mode.kv_cache_quant_algo == "FP8"
    assert BuildSpec(dtype="int8-wo", kv_cache="fp8").variant == "int8-wo-fp8kv-tp1-pp1"
    for gpu in ("L4", "L40S", "H100-80GB", "H200", "B200"):  # SM 89 and up
        assert BuildSpec(dtype="fp8", kv_cache="fp8", target_gpu=gpu).mode.kv_fp8
    for gpu, sm in (("A10G", 86), ("A100-80GB", 80)):
        with pytest.raises(SpecError, match=rf"SM {sm}, which has no FP8 \(--dtype fp8 need"):
            BuildSpec(dtype="fp8", target_gpu=gpu)
        with pytest.raises(SpecError, match="--kv-cache fp8 need SM 89 or newer.*--kv-cache int8"):
            BuildSpec(dtype="float16", kv_cache="fp8", target_gpu=gpu)
    with pytest.raises(SpecError, match="use --kv-cache fp8"):
        BuildSpec(dtype="fp8", kv_cache="int8")
    with pytest.raises(SpecError, match="FP8 needs float16 or bfloat16"):
        Fp8(dtype="float32")
    with pytest.raises(SpecError, match="kv_cache must be one of model, int8, fp8"):
        BuildSpec(kv_cache="fp16")


def test_fp8_rounding_is_searched_unless_switched_off() -> None:
    """The searched rounding is the default; off, the variant says so (another build of the
    model, not the same one) and the mode's JSON, which is in convert's key, differs."""
    searched = make_spec(dtype="fp8").mode
    plain = make_spec({"dtype": "fp8", "fp8": {"search": False}}).mode
    assert isinstance(searched, Fp8) and searched.search and searched.name == "fp8"
    assert isinstance(plain, Fp8) and not plain.search and plain.name == "fp8-nosearch"
    assert make_spec(dtype="fp8", kv_cache="fp8", **{"fp8.search": False}).variant == (
        "fp8-nosearch-fp8kv-tp1-pp1"
    )
    assert searched.to_json() != plain.to_json() and searched.to_json()["version"] == 2
    with pytest.raises(SpecError, match="fp8.search must be true or false"):
        make_spec({"dtype": "fp8", "fp8": {"search": "yes"}})
    with pytest.raises(SpecError, match=r"unknown key\(s\) rounding in \[fp8\]"):
        make_spec({"dtype": "fp8", "fp8": {"rounding": "nearest"}})


def test_the_documented_toml_spec_is_valid(tmp_path: Path) -> None:
    """docs/cli.md's example spec parses, every key in its place."""
    import re

    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    block = re.search(r"## TOML spec\n\n```toml\n(.*?)```", text, re.S)
    assert block is not None
    path = tmp_path / "spec.toml"
    path.write_text(block.group(1))
    spec = make_spec(load_toml(path))
    assert spec.dtype == "int8" and spec.kv_cache == "model" and spec.engine.timeout_s == 14400
    assert spec.limits.max_batch_size == 64 and spec.calibrate.samples == 64


def test_every_default_gate_is_the_one_docs_verify_md_documents() -> None:
    """The gate table in docs/verify.md against the rooms' gates (DEFAULT_GATES), gate by
    gate: a gate loosened (or tightened) in code without its documented figure fails here."""
    import re

    from trt_builder.modes import DEFAULT_GATES

    text = (Path(__file__).resolve().parents[1] / "docs" / "verify.md").read_text()
    documented = {}
    for row in re.findall(r"^\| ([a-z0-9-]+)[^|]* \| ([0-9.e-]+) \| ([0-9.e-]+) \| ([0-9.]+)% \|",
                          text, flags=re.M):  # fmt: skip
        mode, top1, kl, ppl = row
        documented[mode] = (float(top1), float(kl), float(ppl))
    assert documented == {
        key: (gate.min_top1, gate.max_kl, gate.max_ppl_delta_pct)
        for key, gate in DEFAULT_GATES.items()
    }


def test_verify_runtime_vllm_is_taken_where_vllm_loads_the_checkpoint() -> None:
    """[verify] runtime: vLLM runs the llmapi target's checkpoints of the modes its modelopt
    loader lists, with reports of its own; anything else is refused by the spec, in one line
    naming what to use."""
    spec = make_spec({"target": "llmapi", "dtype": "fp8", "verify": {"runtime": "vllm"}})
    assert spec.verify.runtime == "vllm" and spec.verify.reports_dir == "reports-vllm"
    assert make_spec({"target": "llmapi", "verify": {"runtime": "vllm"}}).verify.runtime == "vllm"
    assert make_spec().verify.reports_dir == "reports"
    with pytest.raises(SpecError, match=r"does not run what --target engine writes: use --target "
                       r"llmapi, or verify\.runtime reference"):  # fmt: skip
        make_spec({"verify": {"runtime": "vllm"}})
    for dtype, algo in (("int8-wo", "W8A16"), ("int4-awq", "W4A16_AWQ"), ("w4a8-awq", "W4A8_AWQ")):
        with pytest.raises(SpecError, match=rf"cannot run --dtype {dtype}: .* refuses {algo}"):
            make_spec({"target": "llmapi", "dtype": dtype, "verify": {"runtime": "vllm"}})
    with pytest.raises(SpecError, match=r"verify\.runtime must be one of reference, vllm, not 'x'"):
        make_spec({"verify": {"runtime": "x"}})
