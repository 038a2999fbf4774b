"""`trt-builder gc`: remove old variants (and their Triton repositories) by a retention policy,
never one that a fleet references.

A fleet references, for each entry, the revision it builds now (a local model's content, a
pinned commit) and the revisions its last run and its last good run built (from the nightly
history): the last good one may be what is deployed. Everything else under the fleets' engines
and Triton roots is a candidate, removed when it was last built longer ago than `older_than`
and it is not among the newest `keep_revisions` revisions of its model.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ..core.digests import DigestCache
from ..core.errors import InputError
from ..core.layout import Layout, safe_name
from ..source.resolve import DEFAULT_MODEL_NAME, resolve_source
from ..triton.repository import INFO
from .file import Fleet
from .nightly import History

#: Directories of a revision that are not variants.
_SHARED = ("hf", "calibration", "recipe", "reference")
_VERSIONS = ".versions"


@dataclass(frozen=True)
class Unit:
    """A variant of a model revision: its engines directory and its Triton repository."""

    model: str  # the model's directory name
    revision: str  # the revision's directory name
    variant: str

    @property
    def triton_name(self) -> str:
        return Layout(Path(), self.model, self.revision, self.variant, Path()).triton_name

    @property
    def id(self) -> str:
        return f"{self.model}/{self.revision}/{self.variant}"


@dataclass
class Removal:
    path: Path
    kind: str  # variant | revision | triton
    bytes: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "bytes": self.bytes,
                "reason": self.reason}  # fmt: skip


@dataclass
class GcResult:
    dry_run: bool
    removed: list[Removal] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # referenced units, by id
    notes: list[str] = field(default_factory=list)

    @property
    def freed(self) -> int:
        return sum(r.bytes for r in self.removed)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": True,
            "dry_run": self.dry_run,
            "removed": [r.to_json() for r in self.removed],
            "freed_bytes": self.freed,
            "kept_referenced": sorted(self.kept),
            "notes": self.notes,
        }


@dataclass
class _Refs:
    units: set[Unit] = field(default_factory=set)
    revisions: set[tuple[str, str]] = field(default_factory=set)  # (model, revision)
    # (model, variant): every revision of this variant is kept (an entry whose revision is
    # unknown here, e.g. another matrix job's, or a local model that has gone)
    whole_variants: set[tuple[str, str]] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)


def _references(fleets: list[Fleet]) -> _Refs:

    refs = _Refs()
    for fleet in fleets:
        history = History(fleet.history)
        digests = DigestCache(fleet.out / ".trt-builder" / "digests.json")
        for entry in fleet.entries:
            spec = entry.spec(entry.pin)
            revisions = set(history.referenced(entry.id))
            if entry.hub:
                name = str(entry.model)
                for sha in (entry.pin, entry.revision):
                    if sha and len(sha) == 40:
                        revisions.add(sha)
                if not revisions:
                    refs.whole_variants.add((safe_name(name), spec.variant))
                    refs.notes.append(
                        f"{entry.id}: no revision recorded here (no nightly run, no pin): every "
                        f"revision of {name}'s {spec.variant} is kept"
                    )
                    continue
            else:
                try:
                    source = resolve_source(entry.model, None, digests)
                    name = source.name
                    revisions.add(source.revision)
                except InputError as exc:  # a local model that is gone: keep what it built
                    name = _local_name(entry.model)
                    refs.whole_variants.add((safe_name(name), spec.variant))
                    refs.notes.append(
                        f"{entry.id}: {exc}; every revision of {name}'s {spec.variant} is kept"
                    )
            for revision in revisions:
                unit = Unit(safe_name(name), safe_name(revision), spec.variant)
                refs.units.add(unit)
                refs.revisions.add((unit.model, unit.revision))
    return refs


def _local_name(model: str | None) -> str:
    """The model directory name the layout gives a local model (as resolve_source names it)."""

    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(dirpath) / name).lstat().st_size
            except OSError:
                pass
    return total


def _last_used(*paths: Path) -> float:
    """The newest mtime of a manifest or directory among `paths` (0 when none exists)."""
    stamps = []
    for path in paths:
        for candidate in (path / "manifest.json", path):
            try:
                stamps.append(candidate.stat().st_mtime)
                break
            except OSError:
                continue
    return max(stamps, default=0.0)


def _unique(paths: list[Path]) -> list[Path]:
    """Roots as given, once each (fleets may share them)."""
    return list({path.resolve(): path for path in paths}.values())


def _units_on_disk(
    outs: list[Path], triton_roots: list[Path]
) -> dict[Unit, tuple[Path | None, Path | None]]:
    """Every variant under the roots: (its engines directory, its Triton versions)."""
    found: dict[Unit, list[Path | None]] = {}
    for out in outs:
        if out.is_dir():
            for model_dir in sorted(out.iterdir()):
                if not model_dir.is_dir() or model_dir.name.startswith("."):
                    continue
                for rev_dir in sorted(p for p in model_dir.iterdir() if p.is_dir()):
                    for var in sorted(p for p in rev_dir.iterdir() if p.is_dir()):
                        if var.name in _SHARED or var.name.startswith("."):
                            continue
                        if not (var / "manifest.json").is_file():  # not (yet) a variant we built
                            continue
                        unit = Unit(model_dir.name, rev_dir.name, var.name)
                        found.setdefault(unit, [None, None])[0] = var
    names = {u.triton_name: u for u in found}
    for root in triton_roots:
        versions = root / _VERSIONS
        if not versions.is_dir():
            continue
        for repo in sorted(p for p in versions.iterdir() if p.is_dir()):
            owner = names.get(repo.name)
            if owner is not None:
                found[owner][1] = repo
    return {u: (paths[0], paths[1]) for u, paths in found.items()}


def _orphan_repositories(triton_roots: list[Path], known: set[str]) -> list[Path]:
    """Triton repositories trt-builder published whose engines variant no longer exists."""

    out = []
    for root in triton_roots:
        versions = root / _VERSIONS
        if not versions.is_dir():
            continue
        for repo in sorted(p for p in versions.iterdir() if p.is_dir()):
            if repo.name not in known and any(repo.glob(f"*/{INFO}")):
                out.append(repo)
    return out


#: The policy where neither the caller nor the first fleet's [gc] sets one: what was last built
#: a week ago or more goes, and one unreferenced revision of each model stays for a rollback.
DEFAULT_OLDER_THAN = 7 * 86400
DEFAULT_KEEP_REVISIONS = 1


def collect(
    fleets: list[Fleet],
    *,
    older_than: float | None = None,
    keep_revisions: int | None = None,
    dry_run: bool = False,
) -> GcResult:
    """Remove (or with dry_run, list) what no fleet references and the policy lets go. The
    policy: the arguments, else the first fleet's [gc] table, else the defaults above."""
    settings = fleets[0].gc if fleets else {}
    if older_than is None:
        older_than = settings.get("older_than", DEFAULT_OLDER_THAN)
    if keep_revisions is None:
        keep_revisions = settings.get("keep_revisions", DEFAULT_KEEP_REVISIONS)
    refs = _references(fleets)
    result = GcResult(dry_run, notes=list(refs.notes))
    now = time.time()
    outs = _unique([f.out for f in fleets])
    triton_roots = _unique([f.triton_root for f in fleets])
    units = _units_on_disk(outs, triton_roots)
    result.kept = [u.id for u in units if u in refs.units]

    # The newest keep_revisions unreferenced revisions of each model stay whole.
    by_model: dict[str, dict[str, float]] = {}
    for unit, (var, repo) in units.items():
        if (unit.model, unit.revision) in refs.revisions:
            continue
        used = _last_used(*(p for p in (var, repo) if p is not None))
        revs = by_model.setdefault(unit.model, {})
        revs[unit.revision] = max(revs.get(unit.revision, 0.0), used)
    spared = {
        (model, rev)
        for model, revs in by_model.items()
        for rev in sorted(revs, key=lambda r: revs[r], reverse=True)[:keep_revisions]
    }

    for unit, (var, repo) in sorted(units.items(), key=lambda kv: kv[0].id):
        if unit in refs.units or (unit.model, unit.variant) in refs.whole_variants:
            continue
        if (unit.model, unit.revision) in spared:
            continue
        age = now - _last_used(*(p for p in (var, repo) if p is not None))
        if age < older_than:
            continue
        days = age / 86400
        reason = f"not in any fleet; last built {days:.1f} days ago"
        lock = [var.parent / f".{var.name}.lock"] if var is not None else []
        if var is not None and not _remove(var, "variant", reason, result, locks=lock):
            continue
        if repo is not None:
            _remove_repository(repo, reason, result)

    # A revision none of whose variants is left, and that no fleet references, goes whole.
    for out in outs:
        if not out.is_dir():
            continue
        for model_dir in sorted(p for p in out.iterdir() if p.is_dir()):
            if model_dir.name.startswith("."):
                continue
            for rev_dir in sorted(p for p in model_dir.iterdir() if p.is_dir()):
                if (model_dir.name, rev_dir.name) in refs.revisions | spared:
                    continue
                if not (rev_dir / "hf" / "stage.json").is_file():
                    continue  # not a fetched revision of ours (or one being fetched now)
                left = [p for p in rev_dir.iterdir() if p.name not in _SHARED
                        and not _leftover(p.name) and not _removed(p, result)]  # fmt: skip
                age = now - _last_used(rev_dir / "hf")  # not rev_dir: removing changed it
                if not left and age >= older_than:
                    _remove(rev_dir, "revision", "no variant left and no fleet references it",
                            result, locks=sorted(rev_dir.glob(".*.lock")))  # fmt: skip
            if not dry_run and model_dir.is_dir() and not any(model_dir.iterdir()):
                model_dir.rmdir()

    known = {u.triton_name for u in units}
    referenced = {u.triton_name for u in refs.units}
    for repo in _orphan_repositories(triton_roots, known):
        age = now - _last_used(repo)
        if repo.name not in referenced and age >= older_than:
            _remove_repository(repo, "its engines variant is gone", result)

    if not dry_run and result.removed:
        for out in outs:
            memo = DigestCache(out / ".trt-builder" / "digests.json")
            memo.forget([r.path for r in result.removed])
            memo.save()
    return result


def _leftover(name: str) -> bool:
    """Lock files, a killed build's temporary outputs, a failed gc's set-aside: none of them
    keeps a revision (whether a build is running is for its lock to say)."""
    return name.endswith((".lock", ".owner")) or ".tmp-" in name or ".gc-" in name


def _removed(path: Path, result: GcResult) -> bool:
    return any(r.path == path for r in result.removed)


def _remove(
    path: Path, kind: str, reason: str, result: GcResult, *, locks: Sequence[Path] = ()
) -> bool:
    """Remove `path` (renamed aside first, so it never looks whole while half deleted), unless
    a build holds one of `locks` (then it is left for the next gc). Lock files stay: removing
    one while another process waits on it would let two processes hold "the" lock."""
    size = _size(path)
    if result.dry_run:
        result.removed.append(Removal(path, kind, size, reason))
        return True
    held: list[FileLock] = []
    try:
        try:
            for lock_path in locks:
                guard = FileLock(str(lock_path))
                guard.acquire(timeout=0)
                held.append(guard)
        except Timeout:
            result.notes.append(f"{path} is being built: left for the next gc")
            return False
        aside = path.with_name(f".{path.name}.gc-{os.getpid()}")
        try:
            os.replace(path, aside)
        except OSError as exc:
            result.notes.append(f"{path} cannot be removed ({exc.strerror}): left as it is")
            return False
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        for guard in held:
            guard.release()
    result.removed.append(Removal(path, kind, size, reason))
    return True


def _remove_repository(versions: Path, reason: str, result: GcResult) -> None:
    """A published repository: its `.versions/<name>/` and the `<name>` link to it."""
    root = versions.parent.parent
    link = root / versions.name
    if not _remove(versions, "triton", reason, result, locks=[root / f".{versions.name}.lock"]):
        return
    if not result.dry_run:
        if link.is_symlink():
            link.unlink()
