"""The fleet file: merging, validation with one-line errors, and the CI matrix (against a schema
of what GitHub Actions takes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trt_builder.cli.main import main
from trt_builder.core.errors import SpecError
from trt_builder.fleet.file import load_fleet

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = Path(__file__).parent / "schemas"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def _matrix_schema() -> dict:
    return json.loads((SCHEMAS / "github-matrix.schema.json").read_text())


def test_variants_merge_defaults_model_and_their_own_keys(tmp_path: Path) -> None:
    (tmp_path / "models" / "mine").mkdir(parents=True)
    path = _write(tmp_path, """
[fleet]
name = "n"
out = "roots/engines"
[defaults]
target_gpu = "A100-80GB"
[defaults.verify]
heldout_tokens = 512
min_top1 = 0.9
[tolerance]
top1 = 0.02
[[models]]
model = "models/mine"
limits = { max_input_len = 512 }
  [[models.variants]]
  dtype = "int8"
  [models.variants.verify]
  max_kl = 0.1
  [models.variants.tolerance]
  kl_mean = { relative = 0.2 }
[[models]]
id = "hubby"
model = "org/Some-Model"
  [[models.variants]]
  name = "bf16-tp2"
  dtype = "bfloat16"
  tp = 2
  target_gpu = "L40S"
""")  # fmt: skip
    fleet = load_fleet(path)
    local, hub = fleet.entries
    assert local.id == "mine/int8-sq-tp1-pp1" and hub.id == "hubby/bf16-tp2"
    assert local.model == str((tmp_path / "models" / "mine").resolve())  # relative to the file
    assert hub.model == "org/Some-Model" and hub.revision == "main" and hub.hub
    spec = local.spec()
    assert spec.out == tmp_path / "roots" / "engines" and spec.target_gpu == "A100-80GB"
    assert (spec.verify.heldout_tokens, spec.verify.min_top1, spec.verify.max_kl) == (512, 0.9, 0.1)
    assert spec.limits.max_input_len == 512
    assert local.tolerances["top1"].absolute == 0.02
    assert local.tolerances["kl_mean"].relative == 0.2 and hub.tolerances["kl_mean"].relative == 0.5
    assert hub.spec("a" * 40).revision == "a" * 40 and hub.spec().target_gpu == "L40S"
    assert fleet.history == tmp_path / "roots" / "engines" / ".trt-builder" / "nightly-n.json"
    # What the metrics measure is the fingerprint: a gate or the target GPU is not part of it.
    loose = load_fleet(_write(tmp_path, path.read_text().replace("max_kl = 0.1", "max_kl = 0.2")))
    assert loose.entries[0].fingerprint(loose.entries[0].spec()) == local.fingerprint(spec)
    other = load_fleet(_write(tmp_path, path.read_text().replace('dtype = "int8"', 'dtype = "int8-wo"')))  # fmt: skip
    assert other.entries[0].fingerprint(other.entries[0].spec()) != local.fingerprint(spec)


BASE = """
[[models]]
model = "org/m"
  [[models.variants]]
  dtype = "float16"
"""


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[fleat]\n" + BASE, "unknown table(s) fleat"),
        ("[fleet]\nnmae = 'x'\n" + BASE, "[fleet] has unknown key(s) nmae"),
        ("[defaults]\nout = 'x'\n" + BASE, "[defaults] cannot set out"),
        ("[fleet]\nname = 'a b'\n" + BASE, "is not a valid id"),
        ("", "no [[models]]"),
        ("[[models]]\nmodel = 'org/m'\n", "no [[models.variants]]"),
        (BASE.replace('"float16"', '"float8"'), "models[0].variants[0]: dtype 'float8'"),
        (BASE + '  [[models.variants]]\n  name = "again"\n  dtype = "float16"\n',
         "build the same directory"),
        (BASE + '  [[models.variants]]\n  name = "float16-tp1-pp1"\n  dtype = "int8-wo"\n',
         "is defined twice"),
        (BASE + BASE, "model id 'm' is used twice"),
        (BASE.replace('model = "org/m"', 'model = "org/m"\npin = "main"'), "pin must be a 40-hex"),
        ('[[models]]\nmodel = "./here"\nrevision = "v1"\n  [[models.variants]]\n  dtype = "float16"\n',
         "revision and pin apply to hub repo ids"),
        (BASE.replace("  dtype", "  out = 'x'\n  dtype"), "out is set by the model or [fleet]"),
        ("[tolerance]\ntop5 = 0.1\n" + BASE, "unknown metric 'top5'"),
        ("[tolerance]\ntop1 = { absolute = -1 }\n" + BASE, "must not be negative"),
        (BASE + "  [models.variants.verify]\n  min_top1 = 2\n", "verify.min_top1 is a fraction"),
        # Values of the wrong type: one line, never a traceback.
        ("fleet = 3\n" + BASE, "[fleet] is a table, not int 3"),
        ("defaults = 'x'\n" + BASE, "[defaults] is a table, not str"),
        ("models = [1]", "[[models]] entry 0 is 1, not a table"),
        ('[[models]]\nmodel = "org/m"\nvariants = [1]\n', "[[models.variants]] entry 0 is 1"),
        (BASE.replace('model = "org/m"', 'model = "org/m"\nrevision = 5'),
         "revision is a branch, tag or commit sha (a string)"),
        ('[tolerance]\ntop1 = { absolute = "x" }\n' + BASE, "with numbers"),
        ("[tolerance]\ntop1 = true\n" + BASE, "tolerance.top1 is a number"),
        # the builder refuses INT8 on SM 100-119: the night refuses the entry before any work
        (BASE.replace('"float16"', '"int8"\n  target_gpu = "B200"'),
         "models[0].variants[0]: --target-gpu B200 is SM 100, where TensorRT-LLM builds no INT8"),
        # ... and FP8 below SM 89
        (BASE.replace('"float16"', '"fp8"\n  kv_cache = "fp8"\n  target_gpu = "A100-80GB"'),
         "models[0].variants[0]: --target-gpu A100-80GB is SM 80, which has no FP8"),
        # the llmapi target: SmoothQuant refused before any work
        (BASE.replace('"float16"', '"int8"\n  target = "llmapi"'),
         "models[0].variants[0]: --dtype int8 (SmoothQuant) is not built for --target llmapi"),
    ],
)  # fmt: skip
def test_a_bad_fleet_is_refused_with_its_place_and_the_fix(
    tmp_path: Path, text: str, needle: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(SpecError) as exc:
        load_fleet(path)
    assert needle in str(exc.value) and str(path) in str(exc.value)


def test_a_bad_fleet_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, BASE.replace('"float16"', '"float8"'))
    assert main(["nightly", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "use one of" in err
    assert main(["nightly", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_matrix_is_one_line_of_json_github_takes_and_each_entry_runs_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import jsonschema

    assert main(["nightly", str(REPO / "fleet.toml"), "--matrix"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one line: `echo "matrix=$(...)" >> $GITHUB_OUTPUT`
    matrix = json.loads(out)
    jsonschema.validate(matrix, _matrix_schema())
    fleet = load_fleet(REPO / "fleet.toml")
    assert [job["entry"] for job in matrix["include"]] == [e.id for e in fleet.entries]
    tp2 = next(job for job in matrix["include"] if job["tp"] == 2)
    assert tp2["gpus"] == 2 and "2-gpus" in tp2["runs_on"]
    l40s = next(job for job in matrix["include"] if job["target_gpu"] == "L40S")
    assert l40s["runs_on"][-1] == "l40s"
    for job in matrix["include"]:  # --entry takes every id the matrix hands out
        assert main(["nightly", str(REPO / "fleet.toml"), "--matrix", "--entry", job["entry"]]) == 0
        assert json.loads(capsys.readouterr().out)["include"] == [job]
    assert main(["nightly", str(REPO / "fleet.toml"), "--matrix", "--entry", "smollm2-135m"]) == 0
    assert len(json.loads(capsys.readouterr().out)["include"]) == 6  # a model id: its variants
    assert main(["nightly", str(REPO / "fleet.toml"), "--matrix", "--entry", "nope"]) == 2
    assert "--entry 'nope' is not in" in capsys.readouterr().err


def test_matrix_schema_rejects_what_github_would(tmp_path: Path) -> None:
    """The schema is not vacuous: a matrix over GitHub's 256 jobs, or a job missing its
    runner labels, fails it; and the fleet refuses to print the first."""
    import jsonschema

    job = {"entry": "m/v", "model": "m", "variant": "v", "dtype": "float16", "tp": 1, "pp": 1,
           "gpus": 1, "target_gpu": "H100-80GB", "runs_on": ["self-hosted"]}  # fmt: skip
    jsonschema.validate({"include": [job]}, _matrix_schema())
    for bad in ({"include": [job] * 257}, {"include": [{**job, "runs_on": []}]},
                {"include": [{**job, "entry": "no-slash"}]}, {"matrix": [job]}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, _matrix_schema())
    many = "\n".join(
        f'[[models]]\nmodel = "org/m{i}"\n  [[models.variants]]\n  dtype = "float16"\n'
        for i in range(257)
    )
    fleet = load_fleet(_write(tmp_path, many))
    with pytest.raises(SpecError, match="exceed GitHub's 256 jobs"):
        fleet.matrix(fleet.entries)


def test_one_entry_builds_both_targets(tmp_path: Path) -> None:
    """A model's variants may build the engine target and the llmapi target of one mode: two
    entries, two variant directories."""
    fleet = load_fleet(_write(tmp_path, BASE.replace('"float16"', '"fp8"') +
                              '  [[models.variants]]\n  dtype = "fp8"\n  target = "llmapi"\n'))  # fmt: skip
    specs = [entry.spec(None) for entry in fleet.entries]
    assert [(s.target, s.variant) for s in specs] == [
        ("engine", "fp8-tp1-pp1"), ("llmapi", "fp8-llmapi-tp1-pp1")]  # fmt: skip


def test_the_example_fleet_loads() -> None:
    fleet = load_fleet(REPO / "fleet.toml")
    assert fleet.out == REPO / "engines" and fleet.triton_root == REPO / "triton_repo"
    default = fleet.select(("smollm2-135m",))
    assert {e.model for e in default} == {None}  # the embedded default model
    assert {e.spec().variant for e in default} >= {"fp8-tp1-pp1", "fp8-fp8kv-tp1-pp1",
                                                   "int4-awq-tp1-pp1"}  # fmt: skip
    assert all(e.spec().require_engine for e in fleet.entries)


def test_the_documented_fleet_file_loads(tmp_path: Path) -> None:
    """docs/nightly.md's fleet example, every key in its place."""
    text = (REPO / "docs" / "nightly.md").read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    fleet = load_fleet(_write(tmp_path, example.replace("<40-hex commit>", "c" * 40)))
    entry, served = fleet.entries
    assert entry.id == "smollm2-360m/int8" and entry.pin == "c" * 40
    spec = entry.spec(entry.pin)
    assert spec.limits.max_seq_len == 4096 and spec.kv_cache == "int8" and spec.require_engine
    assert spec.verify.min_top1 == 0.9 and entry.tolerances["top1"].absolute == 0.01
    assert entry.bench is None
    assert served.id == "smollm2-360m/fp16-served" and served.bench is not None
    assert served.bench.concurrency == (1, 8) and served.bench.repeats == 3
    assert served.tolerances["bench.output_token_throughput"].relative == 0.05
    assert served.spec(served.pin).triton.streaming


def test_gc_settings_are_checked(tmp_path: Path) -> None:
    from trt_builder.fleet.file import gc_settings

    assert gc_settings(_write(tmp_path, BASE + "[gc]\nolder_than = '12h'\nkeep_revisions = 0\n")) == {
        "older_than": 43200, "keep_revisions": 0}  # fmt: skip
    for bad, needle in (("keep_revisions = 'x'", "keep_revisions is a count"),
                        ("keep_revisions = -1", "keep_revisions is a count"),
                        ("older_than = true", "is not a duration"),
                        ("older_than = -5", "too short"),
                        ("older_than = 'soon'", "is not a duration")):  # fmt: skip
        with pytest.raises(SpecError, match=needle):
            gc_settings(_write(tmp_path, BASE + f"[gc]\n{bad}\n"))
