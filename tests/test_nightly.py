"""`trt-builder nightly` on a fleet of three tiny models: incremental rebuilds, revisions,
regression gates and the reports (JSON, JUnit XML against a schema, Markdown)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiny_models import make_fleet_models, tiny_fleet
from trt_builder.cli.main import main
from trt_builder.core.errors import HubUnreachable, InputError
from trt_builder.fleet.file import DEFAULT_TOLERANCES, METRICS, Tolerance, load_fleet
from trt_builder.fleet.nightly import History, compare, resolve_revisions, run_nightly
from trt_builder.fleet.report import markdown

SCHEMAS = Path(__file__).parent / "schemas"
NOTHING = {"cached", "cached-failed", "skipped"}


@pytest.fixture(scope="module")
def tiny_fleet_models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("fleet-models")
    make_fleet_models(root, tokenizer_dir)
    return root


def _fleet(tmp_path: Path, models: Path, int8: str = "") -> Path:
    for item in models.iterdir():
        if not (tmp_path / item.name).exists():
            (tmp_path / item.name).symlink_to(item)
    path = tmp_path / "fleet.toml"
    path.write_text(tiny_fleet("tiny", heldout_tokens=256, int8=int8))
    return path


def _nightly(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any], str]:
    code = main(["nightly", *args, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else {}, err


def _by_id(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["id"]: e for e in result["entries"]}


def _validate_junit(path: Path) -> Any:
    import xmlschema
    from junitparser import JUnitXml

    xmlschema.XMLSchema(SCHEMAS / "junit.xsd").validate(path)
    return JUnitXml.fromfile(str(path))


@pytest.mark.integration
def test_fleet_nightly_builds_then_rebuilds_only_what_changed_and_gates_regressions(
    tiny_fleet_models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = _fleet(tmp_path, tiny_fleet_models)
    ids = ["tiny-llama/fp16", "tiny-llama/int8", "tiny-qwen2/bf16", "tiny-gpt2/fp16"]

    # 1. The first night builds everything.
    code, first, err = _nightly(capsys, str(fleet))
    assert code == 0, err
    entries = _by_id(first)
    assert list(entries) == ids and first["ok"]
    for entry_id, e in entries.items():
        assert e["status"] == "passed" and e["stages"]["verify"] == "ran", entry_id
        assert {"convert", "verify", "package"} <= set(e["rebuilt"]), entry_id
        assert all(e["metrics"][m.name] is not None for m in METRICS), entry_id
    assert entries["tiny-llama/fp16"]["stages"]["fetch"] == "ran"
    assert entries["tiny-llama/int8"]["stages"]["fetch"] == "cached"  # hf/ is shared
    assert entries["tiny-llama/int8"]["stages"]["calibrate"] == "ran"
    history = json.loads((tmp_path / "engines" / ".trt-builder" / "nightly-tiny.json").read_text())
    assert [r["run_id"] for r in history["runs"]] == [first["run_id"]]

    # 2. The second night is a no-op: nothing rebuilt, no weight byte read, and (in a fresh
    # process) neither torch nor transformers imported. Its time is in benchmarks/nightly.py.
    probe = (
        "import sys; from trt_builder.cli.main import main; code = main(sys.argv[1:]); "
        "print(code, 'torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, "nightly", str(fleet), "--json"],
        capture_output=True, text=True, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.stderr.split()[-3:] == ["0", "False", "False"], proc.stderr[-2000:]
    second = _by_id(json.loads(proc.stdout))
    for entry_id, e in second.items():
        assert set(e["stages"].values()) <= NOTHING and e["rebuilt"] == [], (entry_id, e["stages"])
        assert e["hashed_bytes"] == 0 and e["status"] == "passed"
        assert e["metrics"] == entries[entry_id]["metrics"] and e["regressions"] == []

    # 3. Changing one entry's quantization rebuilds that entry from convert on; its
    # calibration is reused and every other entry stays cached.
    _fleet(tmp_path, tiny_fleet_models, int8="int8 = { alpha = 0.8 }")
    code, third, err = _nightly(capsys, str(fleet))
    assert code == 0, err
    third_entries = _by_id(third)
    changed = third_entries["tiny-llama/int8"]
    assert changed["stages"]["fetch"] == "cached" and changed["stages"]["calibrate"] == "cached"
    assert changed["stages"]["convert"] == "ran" and changed["stages"]["verify"] == "ran"
    assert changed["baseline"] is None  # a new specification starts a new baseline
    for entry_id in ids[:1] + ids[2:]:
        assert third_entries[entry_id]["rebuilt"] == [], entry_id

    # 4. An injected regression (the last good run's perplexity made better than this
    # build's by a point, beyond the 0.25 tolerance) fails the run, naming what got worse.
    path = tmp_path / "engines" / ".trt-builder" / "nightly-tiny.json"
    data = json.loads(path.read_text())
    good = data["runs"][-1]["entries"]["tiny-llama/fp16"]
    new_ppl = good["metrics"]["ppl_delta_pct"]
    good["metrics"]["ppl_delta_pct"] = new_ppl - 1.0
    path.write_text(json.dumps(data))
    code, fourth, err = _nightly(capsys, str(fleet), "--report-dir", "reports")
    assert code == 11 and not fourth["ok"]
    bad = _by_id(fourth)["tiny-llama/fp16"]
    assert bad["status"] == "regressed" and bad["rebuilt"] == []
    message = bad["regression_messages"][0]
    old_text, new_text = f"{new_ppl - 1.0:+.3f}", f"{new_ppl:+.3f}"
    for needle in ("tiny-llama", "ppl_delta_pct", old_text, new_text):
        assert needle in message, (needle, message)
        assert needle in err  # the one-line error names them too
    assert [r["metric"] for r in bad["regressions"]] == ["ppl_delta_pct"]
    assert all(e["status"] == "passed" for k, e in _by_id(fourth).items() if k != bad["id"])

    suites = _validate_junit(tmp_path / "reports" / "nightly.junit.xml")
    assert (suites.tests, suites.failures, suites.errors) == (24, 1, 0)
    failed = [(s.name, c.name) for s in suites for c in s if not c.is_passed and not c.is_skipped]
    assert failed == [("tiny-llama/fp16", "regression.ppl_delta_pct")]
    summary = (tmp_path / "reports" / "nightly.md").read_text()
    assert "❌ not good" in summary and message.replace("|", "/") in summary
    assert f"**{new_text}** (was {old_text})" in summary
    assert json.loads((tmp_path / "reports" / "nightly.json").read_text())["ok"] is False

    # A regressed run is not a baseline: the next night compares with the same good run...
    code, _, _ = _nightly(capsys, str(fleet))
    assert code == 11
    # ...until the regression is accepted, which makes this run the baseline.
    code, accepted, err = _nightly(capsys, str(fleet), "--accept", "tiny-llama/fp16")
    assert code == 0, err
    assert _by_id(accepted)["tiny-llama/fp16"]["accepted"] is True
    code, after, err = _nightly(capsys, str(fleet))
    assert code == 0, err
    assert _by_id(after)["tiny-llama/fp16"]["baseline"]["run_id"] == accepted["run_id"]


def _hub_cache(model: Path, repo: str, sha: str, ref: str = "main") -> None:
    """`model` as the local HF cache holds a hub repo at commit `sha` (what fetch reads offline)."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / sha
    snap.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(sha)
    for item in model.iterdir():
        shutil.copy2(item, snap / item.name)


HUB_FLEET = """
[fleet]
name = "hub"
[defaults.verify]
heldout_tokens = 128
[[models]]
id = "tiny"
model = "org/nightly-tiny"
revision = "main"
{pin}
  [[models.variants]]
  name = "fp32"
  dtype = "float32"
"""


@pytest.mark.integration
def test_upstream_revisions_online_offline_and_with_the_hub_down(
    tiny_llama: Path, tmp_path: Path
) -> None:
    sha1, sha2 = "1" * 40, "2" * 40
    _hub_cache(tiny_llama, "org/nightly-tiny", sha1)
    _hub_cache(tiny_llama, "org/nightly-tiny", sha2)
    path = tmp_path / "fleet.toml"
    path.write_text(HUB_FLEET.replace("{pin}", ""))
    upstream = {"sha": sha1}
    asked: list[tuple[str, str]] = []

    def hub(repo: str, revision: str) -> str:
        asked.append((repo, revision))
        return upstream["sha"]

    def entry(result: Any) -> Any:
        (only,) = result.entries
        return only

    # Online: the branch is resolved through the hub API and built.
    first = run_nightly(load_fleet(path), resolver=hub, offline=False)
    assert asked == [("org/nightly-tiny", "main")]
    assert first.revisions["tiny"].source == "hub" and entry(first).revision == sha1
    assert entry(first).status == "passed" and "fetch" in entry(first).rebuilt

    # Upstream moved: the new commit is built from fetch on, and the summary says so.
    upstream["sha"] = sha2
    moved = run_nightly(load_fleet(path), resolver=hub, offline=False)
    e = entry(moved)
    assert (e.revision, e.previous_revision) == (sha2, sha1)
    assert e.rebuilt == ["fetch", "convert", "verify", "package"]
    assert e.baseline is not None and e.baseline["revision"] == sha1  # compared across commits
    assert f"revision moved `{sha1[:12]}` → `{sha2[:12]}`" in markdown(moved)

    def offline_hub(repo: str, revision: str) -> str:
        raise AssertionError("offline runs ask no hub")

    # Offline: the last run's commit (nothing rebuilt), or the pin when the fleet has one.
    offline = run_nightly(load_fleet(path), resolver=offline_hub, offline=True)
    assert offline.revisions["tiny"].source == "history" and entry(offline).revision == sha2
    assert entry(offline).rebuilt == []
    path.write_text(HUB_FLEET.replace("{pin}", f'pin = "{sha1}"'))
    pinned = run_nightly(load_fleet(path), resolver=offline_hub, offline=True)
    assert pinned.revisions["tiny"].source == "pin" and entry(pinned).revision == sha1
    assert entry(pinned).rebuilt == []  # sha1 was built on the first night

    # The hub is down: the pin is built, and the summary says upstream was not checked.
    def down(repo: str, revision: str) -> str:
        raise HubUnreachable("cannot reach the hub for org/nightly-tiny (connection refused)")

    fallback = run_nightly(load_fleet(path), resolver=down, offline=False)
    assert entry(fallback).status == "passed" and entry(fallback).revision == sha1
    assert any("upstream was not checked" in n for n in entry(fallback).notices)


@pytest.mark.integration
def test_an_offline_night_asks_no_hub_even_where_the_environment_allows_it(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_nightly(offline=True) fetches a pinned hub model from the local HF cache with
    HF_HUB_OFFLINE unset: no stage reads the environment to decide."""
    import huggingface_hub

    sha = "3" * 40
    _hub_cache(tiny_llama, "org/nightly-tiny", sha)
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def online(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an offline night asked the hub")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", online)
    path = tmp_path / "fleet.toml"
    path.write_text(HUB_FLEET.replace("{pin}", f'pin = "{sha}"'))
    result = run_nightly(load_fleet(path), offline=True)
    (entry,) = result.entries
    assert entry.status == "passed", entry.message
    assert entry.revision == sha and "fetch" in entry.rebuilt


def test_offline_without_a_pin_or_history_is_an_entry_error(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(HUB_FLEET.replace("org/nightly-tiny", "org/never-fetched").replace("{pin}", ""))
    fleet = load_fleet(path)
    history = History(fleet.history)
    (revision,) = resolve_revisions(fleet, fleet.entries, history, offline=True).values()
    assert isinstance(revision, InputError)
    assert "add pin = " in str(revision) and "org/never-fetched" in str(revision)
    result = run_nightly(fleet, offline=True)
    (e,) = result.entries
    assert e.status == "error" and e.exit_code == 3 and not result.ok


@pytest.mark.parametrize(
    ("name", "old", "new", "regressed"),
    [
        ("top1", 0.99, 0.986, False),  # within 0.005
        ("top1", 0.99, 0.98, True),
        ("top1", 0.95, 0.99, False),  # better is never a regression
        ("kl_mean", 1e-4, 1.4e-4, False),  # within half the old value
        ("kl_mean", 1e-4, 1.6e-4, True),
        ("kl_mean", 1e-6, 9e-6, False),  # tiny values: the 1e-5 floor
        ("kl_mean", 1e-4, math.nan, True),  # non-finite is always worse
        ("ppl_delta_pct", 0.5, 0.7, False),
        ("ppl_delta_pct", 0.5, 0.8, True),
        ("greedy_agreement", 0.9, 0.75, True),
    ],
)
def test_compare_applies_each_metric_direction_and_tolerance(
    name: str, old: float, new: float, regressed: bool
) -> None:
    found = compare({name: new}, {name: old}, DEFAULT_TOLERANCES)
    assert [r.metric.name for r in found] == ([name] if regressed else [])


def test_tolerance_is_the_larger_of_absolute_and_relative() -> None:
    tol = Tolerance(absolute=0.01, relative=0.1)
    assert tol.allowed(0.05) == 0.01 and tol.allowed(1.0) == 0.1
    assert (
        compare({"top1": 0.5}, {"top1": 0.9}, {**DEFAULT_TOLERANCES, "top1": Tolerance(0.5)}) == []
    )


def test_an_unexpected_error_in_one_entry_is_reported_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    path = tmp_path / "fleet.toml"
    path.write_text(
        '[[models]]\nmodel = "a"\n  [[models.variants]]\n  dtype = "float16"\n'
        '  [[models.variants]]\n  dtype = "bfloat16"\n'
    )
    calls: list[str] = []

    def broken(spec: Any, **_: Any) -> Any:
        calls.append(spec.dtype)
        raise RuntimeError("a bug")

    monkeypatch.setattr("trt_builder.pipeline.build.run", broken)
    result = run_nightly(load_fleet(path))
    assert calls == ["float16", "bfloat16"] and not result.ok
    for e in result.entries:
        assert (
            e.status == "error"
            and e.message == "internal error: RuntimeError: a bug (please report it)"
        )
        assert e.traceback and "RuntimeError: a bug" in e.traceback
    from trt_builder.fleet.report import write_reports

    paths = write_reports(result, tmp_path / "reports")
    suites = _validate_junit(paths["junit"])
    assert (suites.errors, suites.failures) == (2, 0)
    history = History(load_fleet(path).history)  # the run is recorded all the same
    assert [e["status"] for e in history.runs[-1]["entries"].values()] == ["error", "error"]


def test_a_damaged_history_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    path.write_text("{not json")
    with pytest.raises(InputError, match="unreadable .*move it away to start a new baseline"):
        History(path)
    path.write_text('{"runs": []}')
    with pytest.raises(InputError, match="is not a trt-builder nightly history"):
        History(path)


def test_with_the_hub_down_and_no_pin_the_local_cache_gives_the_revision(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online, the hub unreachable, no pin and no history: the local HF cache's ref (tests
    otherwise run with HF_HUB_OFFLINE=1, which would hide that path)."""
    sha = "3" * 40
    _hub_cache(tiny_llama, "org/cached-tiny", sha)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    path = tmp_path / "fleet.toml"
    path.write_text(HUB_FLEET.replace("org/nightly-tiny", "org/cached-tiny").replace("{pin}", ""))
    fleet = load_fleet(path)

    def down(repo: str, revision: str) -> str:
        raise HubUnreachable("cannot reach the hub for org/cached-tiny (connection refused)")

    (revision,) = resolve_revisions(
        fleet, fleet.entries, History(fleet.history), offline=False, resolver=down
    ).values()
    assert not isinstance(revision, Exception)
    assert (revision.sha, revision.source) == (sha, "cache")
    assert revision.note and "upstream was not checked" in revision.note


def test_accepting_an_entry_the_run_does_not_build_is_refused(tmp_path: Path) -> None:
    from trt_builder.core.errors import SpecError

    path = tmp_path / "fleet.toml"
    two = (
        HUB_FLEET.replace("{pin}", "")
        + '  [[models.variants]]\n  name = "fp16"\n  dtype = "float16"\n'
    )
    path.write_text(two)
    with pytest.raises(SpecError, match="--accept tiny/fp16 names no entry this run builds"):
        run_nightly(load_fleet(path), select=("tiny/fp32",), accept=("tiny/fp16",), offline=True)
    assert not load_fleet(path).history.exists()  # refused before any work
    # A model id accepts the variants of it that run.
    path.write_text(two.replace("org/nightly-tiny", "org/accept-tiny"))
    result = run_nightly(load_fleet(path), select=("tiny/fp32",), accept=("tiny",), offline=True)
    assert [e.entry.id for e in result.entries] == ["tiny/fp32"]


@pytest.mark.integration
def test_an_engine_that_cannot_be_built_is_an_error_that_keeps_what_ran(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU runner's fleet (require_engine) on a host without TensorRT-LLM: the entry errors
    with exit 7's message, and its stages, figures and revision are still reported."""
    (tmp_path / "tiny").symlink_to(tiny_llama)
    path = tmp_path / "fleet.toml"
    path.write_text(
        "[defaults]\nrequire_engine = true\n[defaults.verify]\nheldout_tokens = 128\n"
        '[[models]]\nmodel = "tiny"\n  [[models.variants]]\n  dtype = "float32"\n'
    )
    code, result, err = _nightly(capsys, str(path), "--report-dir", "reports")
    assert code == 11 and "TensorRT-LLM" in err
    (e,) = result["entries"]
    assert e["status"] == "error" and e["exit_code"] == 7 and e["revision"]
    assert e["stages"]["verify"] == "ran" and e["metrics"]["top1"] is not None
    suites = _validate_junit(tmp_path / "reports" / "nightly.junit.xml")
    assert (suites.errors, suites.failures) == (1, 0)


@pytest.mark.integration
def test_a_history_that_cannot_be_written_still_leaves_the_reports(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import errno

    (tmp_path / "tiny").symlink_to(tiny_llama)
    path = tmp_path / "fleet.toml"
    path.write_text(
        "[defaults.verify]\nheldout_tokens = 128\n"
        '[[models]]\nmodel = "tiny"\n  [[models.variants]]\n  dtype = "float32"\n'
    )

    def full(self: History, run: dict[str, Any], keep: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(History, "append", full)
    code, result, err = _nightly(capsys, str(path), "--report-dir", "reports")
    assert code == 10 and result["ok"] is True  # one JSON document on stdout, the run's
    assert "No space left on device" in result["history_error"] and "not recorded" in err
    assert (
        json.loads((tmp_path / "reports" / "nightly.json").read_text())["run_id"]
        == result["run_id"]
    )
