"""`trt-builder gc`: retention by age and revisions, never what a fleet references."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from trt_builder.cli.main import main
from trt_builder.fleet.nightly import History

FLEET = """
[fleet]
name = "gc"
[defaults.verify]
heldout_tokens = 128
[[models]]
model = "mine"
  [[models.variants]]
  name = "fp32"
  dtype = "float32"
{extra}
"""
SECOND = '  [[models.variants]]\n  name = "fp16"\n  dtype = "float16"\n'


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main([*args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def _tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir()}


@pytest.mark.integration
def test_gc_removes_what_the_fleet_dropped_and_old_revisions_but_never_a_reference(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(tiny_llama, tmp_path / "mine")
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET.replace("{extra}", SECOND))
    code, first = _json(capsys, "nightly", str(fleet))
    assert code == 0 and first["ok"]
    (revision,) = {e["revision"] for e in first["entries"]}
    engines, triton = tmp_path / "engines", tmp_path / "triton_repo"
    fp16 = engines / "mine" / revision / "float16-tp1-pp1"
    fp16_repo = f"mine-{revision.removeprefix('sha256-')[:8]}-float16-tp1-pp1"
    assert fp16.is_dir() and (triton / fp16_repo).is_symlink()

    # The fp16 variant leaves the fleet. Within the default 7 days nothing goes; a dry run
    # lists it and removes nothing.
    fleet.write_text(FLEET.replace("{extra}", ""))
    assert _json(capsys, "gc", str(fleet))[1]["removed"] == []
    before = _tree(tmp_path)
    code, dry = _json(capsys, "gc", str(fleet), "--older-than", "0", "--dry-run")
    assert code == 0 and _tree(tmp_path) == before
    assert {(r["kind"], Path(r["path"]).name) for r in dry["removed"]} == {
        ("variant", "float16-tp1-pp1"), ("triton", fp16_repo)}  # fmt: skip
    code, done = _json(capsys, "gc", str(fleet), "--older-than", "0")
    assert code == 0 and done["removed"] == dry["removed"] and done["freed_bytes"] > 0
    assert not fp16.exists() and not (triton / fp16_repo).exists()
    assert not (triton / ".versions" / fp16_repo).exists()
    assert (engines / "mine" / revision / "float32-tp1-pp1" / "checkpoint").is_dir()
    memo = json.loads((engines / ".trt-builder" / "digests.json").read_text())
    assert not [k for k in memo if "/float16-tp1-pp1/" in k]  # forgotten with the files
    code, again = _json(capsys, "nightly", str(fleet))  # the referenced variant is whole
    assert code == 0 and again["entries"][0]["rebuilt"] == []

    # The model changes: a new revision is built. The old one is kept as the one before (for a
    # rollback) until keep-revisions 0 lets it go, whole: variant, hf/, its Triton repository.
    config = tmp_path / "mine" / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_new_tokens": 7}))
    code, moved = _json(capsys, "nightly", str(fleet))
    new_revision = moved["entries"][0]["revision"]
    assert code == 0 and new_revision != revision
    assert moved["entries"][0]["previous_revision"] == revision
    code, kept = _json(capsys, "gc", str(fleet), "--older-than", "0")
    assert kept["removed"] == [] and (engines / "mine" / revision).is_dir()
    code, gone = _json(capsys, "gc", str(fleet), "--older-than", "0", "--keep-revisions", "0")
    assert {r["kind"] for r in gone["removed"]} == {"variant", "triton", "revision"}
    assert not (engines / "mine" / revision).exists()
    assert sorted(p.name for p in (engines / "mine").iterdir()) == [new_revision]
    code, last = _json(capsys, "nightly", str(fleet))
    assert code == 0 and last["entries"][0]["rebuilt"] == []


def test_history_references_the_last_run_and_the_last_good_one(tmp_path: Path) -> None:
    """What gc keeps of a hub model: the revision the last run built and, when that run
    failed, the last one that passed (what is likely deployed)."""
    history = History(tmp_path / "h.json")
    for run_id, revision, status in (("1", "aaa", "passed"), ("2", "bbb", "passed"),
                                     ("3", "ccc", "failed")):  # fmt: skip
        history.append({"run_id": run_id, "entries": {"m/v": {"status": status,
                        "revision": revision, "fingerprint": "f", "metrics": {}}}}, keep=10)  # fmt: skip
    assert History(tmp_path / "h.json").referenced("m/v") == {"ccc", "bbb"}
    assert history.last_good("m/v", "f")["run_id"] == "2"  # type: ignore[index]
    assert history.last_good("m/v", "other") is None
    history.append({"run_id": "4", "entries": {}}, keep=2)
    # keep=2 keeps "3" and "4", and "2", the baseline of m/v
    assert [r["run_id"] for r in History(tmp_path / "h.json").runs] == ["2", "3", "4"]


def test_gc_keeps_every_revision_of_a_hub_model_it_knows_nothing_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[[models]]\nmodel = "org/m"\n  [[models.variants]]\n  dtype = "float16"\n')
    old = tmp_path / "engines" / "org--m" / ("a" * 40) / "float16-tp1-pp1"
    old.mkdir(parents=True)
    (old / "manifest.json").write_text("{}")
    code, result = _json(capsys, "gc", str(fleet), "--older-than", "0", "--keep-revisions", "0")
    assert code == 0 and result["removed"] == [] and old.is_dir()
    assert any("every revision of org/m's float16-tp1-pp1 is kept" in n for n in result["notes"])


def test_gc_refuses_a_bad_duration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[[models]]\nmodel = "org/m"\n  [[models.variants]]\n  dtype = "float16"\n')
    assert main(["gc", str(fleet), "--older-than", "soon"]) == 2
    assert "is not a duration" in capsys.readouterr().err


def test_gc_leaves_a_revision_being_fetched_and_directories_it_did_not_make(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[[models]]\nmodel = "org/m"\npin = "' + "b" * 40 + '"\n'
                     '  [[models.variants]]\n  dtype = "float16"\n')  # fmt: skip
    engines = tmp_path / "engines"
    downloading = engines / "org--m" / ("c" * 40)  # fetch of a new commit under way
    (downloading / ".hf.tmp-1a2b3c4d").mkdir(parents=True)
    (downloading / ".hf.lock").touch()
    foreign = engines / "notes" / "2024" / "drafts"  # not a trt-builder layout
    foreign.mkdir(parents=True)
    (foreign / "todo.txt").write_text("keep me")
    old_revision = engines / "org--m" / ("d" * 40)  # ours: a fetched revision, no variant left
    (old_revision / "hf").mkdir(parents=True)
    (old_revision / "hf" / "stage.json").write_text("{}")
    for shared in ("calibration", "recipe"):  # what its variants shared goes with it
        (old_revision / shared / "bundled-64x256-seed0").mkdir(parents=True)
    code, result = _json(capsys, "gc", str(fleet), "--older-than", "0", "--keep-revisions", "0")
    assert code == 0
    assert [Path(r["path"]).name for r in result["removed"]] == ["d" * 40]
    assert downloading.is_dir() and (foreign / "todo.txt").is_file()
    assert not old_revision.exists()


def test_gc_keeps_what_a_vanished_local_model_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fleet entry whose local model file is gone still protects its built revisions, under
    the name the layout gave them (a .gguf's stem)."""
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        '[[models]]\nmodel = "gone/m.gguf"\n  [[models.variants]]\n  dtype = "float16"\n'
    )
    built = tmp_path / "engines" / "m" / "sha256-0123456789ab" / "float16-tp1-pp1"
    built.mkdir(parents=True)
    (built / "manifest.json").write_text("{}")
    code, result = _json(capsys, "gc", str(fleet), "--older-than", "0", "--keep-revisions", "0")
    assert code == 0 and result["removed"] == [] and built.is_dir()
    assert any("every revision of m's float16-tp1-pp1 is kept" in n for n in result["notes"])


def test_history_trimming_keeps_each_entrys_baseline(tmp_path: Path) -> None:
    """An entry that keeps regressing must not lose the good run it is compared with when
    the history is trimmed (matrix jobs add a run each, so runs pile up fast)."""
    history = History(tmp_path / "h.json")

    def run(run_id: str, status: str, entry: str = "m/v") -> dict[str, Any]:
        return {"run_id": run_id, "entries": {entry: {"status": status, "revision": "r",
                                                      "fingerprint": "f", "metrics": {}}}}  # fmt: skip

    history.append(run("good", "passed"), keep=3)
    for i in range(5):
        history.append(run(f"bad{i}", "regressed"), keep=3)
        history.append(run(f"other{i}", "passed", entry="x/y"), keep=3)
    kept = [r["run_id"] for r in History(tmp_path / "h.json").runs]
    assert kept == ["good", "other3", "bad4", "other4"]
    assert history.last_good("m/v", "f")["run_id"] == "good"  # type: ignore[index]


def _variant(engines: Path, model: str, revision: str, variant: str) -> Path:
    path = engines / model / revision / variant
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    hf = engines / model / revision / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "stage.json").write_text("{}")
    return path


def test_a_matrix_jobs_root_drops_its_own_old_revisions_and_a_killed_builds_leftovers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In CI each job's engines root knows one entry's history. The other variants of the
    same model (other jobs') keep their own directories, not the whole model, so this entry's
    old revision still goes, together with what a killed build left in it."""
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[[models]]\nmodel = "org/m"\n  [[models.variants]]\n  dtype = "float16"\n'
                     '  [[models.variants]]\n  dtype = "bfloat16"\n')  # fmt: skip
    engines = tmp_path / "engines"
    old, new = "a" * 40, "b" * 40
    _variant(engines, "org--m", old, "float16-tp1-pp1")
    (engines / "org--m" / old / ".float16-tp1-pp1.lock.owner").write_text("pid 1")  # SIGKILLed
    (engines / "org--m" / old / ".hf.tmp-1a2b3c4d").mkdir()  # a killed re-fetch
    _variant(engines, "org--m", new, "float16-tp1-pp1")
    other = _variant(engines, "org--m", old, "bfloat16-tp1-pp1")  # no history here: kept
    History(engines / ".trt-builder" / "nightly-fleet.json").append(
        {"run_id": "1", "entries": {"m/float16-tp1-pp1": {"status": "passed", "revision": new,
                                                          "fingerprint": "f", "metrics": {}}}},
        keep=10,
    )  # fmt: skip
    code, result = _json(capsys, "gc", str(fleet), "--older-than", "0", "--keep-revisions", "0")
    assert code == 0
    assert [Path(r["path"]).name for r in result["removed"]] == ["float16-tp1-pp1"]
    assert other.is_dir() and (engines / "org--m" / new / "float16-tp1-pp1").is_dir()
    # Once the other variant is gone too, the revision goes whole, leftovers included.
    shutil.rmtree(other)
    code, result = _json(capsys, "gc", str(fleet), "--older-than", "0", "--keep-revisions", "0")
    assert [(r["kind"], Path(r["path"]).name) for r in result["removed"]] == [("revision", old)]
    assert sorted(p.name for p in (engines / "org--m").iterdir()) == [new]


def test_gc_over_fleets_sharing_a_root_counts_each_thing_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("a", "b"):
        (tmp_path / f"{name}.toml").write_text(
            f'[fleet]\nname = "{name}"\n[[models]]\nmodel = "org/{name}"\npin = "{"c" * 40}"\n'
            '  [[models.variants]]\n  dtype = "float16"\n'
        )
    _variant(tmp_path / "engines", "org--gone", "d" * 40, "float16-tp1-pp1")
    code, result = _json(capsys, "gc", str(tmp_path / "a.toml"), str(tmp_path / "b.toml"),
                         "--older-than", "0", "--keep-revisions", "0", "--dry-run")  # fmt: skip
    assert code == 0
    assert [r["kind"] for r in result["removed"]] == ["variant", "revision"]


def test_the_library_takes_the_policy_from_the_first_fleets_gc_table(tmp_path: Path) -> None:
    """collect() without a policy reads [gc] as the CLI does: an explicit argument wins."""
    from trt_builder.fleet.file import load_fleet
    from trt_builder.fleet.gc import collect

    fleet = tmp_path / "fleet.toml"
    fleet.write_text(f'[gc]\nolder_than = "0"\nkeep_revisions = 0\n[[models]]\nmodel = "org/m"\n'
                     f'pin = "{"c" * 40}"\n  [[models.variants]]\n  dtype = "float16"\n')  # fmt: skip
    _variant(tmp_path / "engines", "org--gone", "d" * 40, "float16-tp1-pp1")
    fleets = [load_fleet(fleet)]
    assert [r.kind for r in collect(fleets, dry_run=True).removed] == ["variant", "revision"]
    # the default and an argument of a week keep the just-made variant
    assert collect(fleets, older_than=7 * 86400, dry_run=True).removed == []
    fleet.write_text(fleet.read_text().replace('older_than = "0"\nkeep_revisions = 0\n', ""))
    assert collect([load_fleet(fleet)], dry_run=True).removed == []
