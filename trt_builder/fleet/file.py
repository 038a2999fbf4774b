"""The fleet file: the models a nightly run rebuilds, each with its variants, as one TOML file.

Every variant is an ordinary build spec (the keys of `trt-builder build --config`), merged
from the fleet's `[defaults]`, its model's keys and its own. Paths in the file are relative to
the file. docs/nightly.md has the format.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..bench.figures import HEADLINE
from ..bench.options import BenchOptions
from ..core.digests import sha256_json
from ..core.errors import SpecError
from ..source.resolve import DEFAULT_MODEL_NAME
from ..spec.build import BuildSpec, load_toml, make_spec

#: GitHub Actions runs at most 256 jobs from one matrix.
MAX_MATRIX = 256


@dataclass(frozen=True)
class Tolerance:
    """How much worse than the last good run a metric may get: the larger of an absolute
    amount and a fraction of the old value."""

    absolute: float = 0.0
    relative: float = 0.0

    def allowed(self, old: float) -> float:
        return max(self.absolute, self.relative * abs(old))

    def describe(self) -> str:
        parts = [f"{self.absolute:g}"] if self.absolute else []
        parts += [f"{self.relative:.0%} of the old value"] if self.relative else []
        return " or ".join(parts) or "none"


@dataclass(frozen=True)
class Metric:
    """A verify figure the nightly compares run to run."""

    name: str  # the key in the verify stage's record (and in the history)
    label: str
    higher_is_better: bool
    fmt: str


METRICS = (
    Metric("top1", "top-1 agreement", True, "{:.4f}"),
    Metric("kl_mean", "mean KL", False, "{:.3e}"),
    Metric("ppl_delta_pct", "held-out perplexity increase (%)", False, "{:+.3f}"),
    Metric("greedy_agreement", "greedy agreement", True, "{:.3f}"),
)
METRIC_NAMES = tuple(m.name for m in METRICS)

#: The bench figures a nightly tracks at each of an entry's load points (its `bench` table),
#: by bench/figures.py name: as metrics named bench.<mode><load>.<figure>, e.g.
#: bench.concurrency4.output_token_throughput. Which way is better is bench's own (HEADLINE).
BENCH_FIGURES = (
    ("output_token_throughput", "output tokens/s", "{:.2f}"),
    ("request_throughput", "requests/s", "{:.3f}"),
    ("ttft_ms.p50", "time to first token p50 (ms)", "{:.1f}"),
    ("itl_ms.p50", "inter-token latency p50 (ms)", "{:.2f}"),
    ("errors", "errors", "{:.0f}"),
)
BENCH_TOLERANCE_NAMES = tuple(f"bench.{f[0]}" for f in BENCH_FIGURES)

#: Defaults, for verify on a fixed prompt set and held-out text (deterministic on one device):
#: half a point of top-1, half the KL again (at least 1e-5), a quarter point of perplexity,
#: a tenth of greedy agreement (one early divergence moves it a lot).
DEFAULT_TOLERANCES = {
    "top1": Tolerance(absolute=0.005),
    "kl_mean": Tolerance(absolute=1e-5, relative=0.5),
    "ppl_delta_pct": Tolerance(absolute=0.25),
    "greedy_agreement": Tolerance(absolute=0.1),
    # bench figures, at every load point: load tests of the same build on the same host vary
    # run to run by several percent (docs/benchmarks.md); an error is never allowed
    "bench.output_token_throughput": Tolerance(relative=0.10),
    "bench.request_throughput": Tolerance(relative=0.10),
    "bench.ttft_ms.p50": Tolerance(relative=0.25),
    "bench.itl_ms.p50": Tolerance(relative=0.15),
    "bench.errors": Tolerance(absolute=0.0),
}


def bench_metrics(options: BenchOptions) -> tuple[Metric, ...]:
    """The nightly metrics of a bench: BENCH_FIGURES at each load point."""
    return tuple(
        Metric(f"bench.{mode}{load:g}.{key}", f"{label} at {mode} {load:g}", HEADLINE[key] > 0, fmt)
        for mode, load in options.points()
        for key, label, fmt in BENCH_FIGURES
    )


def tolerance_for(tolerances: dict[str, Tolerance], name: str) -> Tolerance:
    """A metric's tolerance: its own, or for a bench metric the one of its figure."""
    if name in tolerances:
        return tolerances[name]
    head, _, rest = name.partition(".")
    return tolerances[f"{head}.{rest.partition('.')[2]}"]


_FLEET_KEYS = ("name", "out", "triton_root", "history", "keep_runs", "runner_labels")
_MODEL_KEYS = ("id", "model", "revision", "pin", "variants")
_VARIANT_KEYS = ("name", "tolerance", "runner_labels", "bench")
_FIXED_SPEC_KEYS = ("out", "triton_root", "model", "revision")  # set by the fleet, not per variant
_SHA = re.compile(r"[0-9a-f]{40}")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Entry:
    """One model x variant of the fleet: what one nightly job builds and checks."""

    id: str  # "<model id>/<variant name>"
    model_id: str
    name: str
    model: str | None  # as --model: a hub repo id, a local path (absolute here), None: default
    revision: str | None  # requested: a branch, tag or commit sha (hub models only)
    pin: str | None  # the commit sha built offline
    table: dict[str, Any]  # the merged spec table, without model/revision/out/triton_root
    tolerances: dict[str, Tolerance]
    runner_labels: tuple[str, ...]
    out: Path
    triton_root: Path
    bench: BenchOptions | None = None  # a load test of the repository after each good build

    @property
    def metrics(self) -> tuple[Metric, ...]:
        """What the nightly compares run to run: verify's figures, and the bench's."""
        return METRICS + (bench_metrics(self.bench) if self.bench is not None else ())

    @property
    def hub(self) -> bool:
        """A hub repo id (its revision is resolved), not a local path or the default model."""
        return self.model is not None and not Path(self.model).is_absolute()

    def spec(self, revision: str | None = None) -> BuildSpec:
        """The build spec of this entry, at `revision` (a commit sha for a hub model)."""
        return make_spec(
            copy.deepcopy(self.table),
            model=self.model,
            revision=revision if self.hub else None,
            out=self.out,
            triton_root=self.triton_root,
        )

    def fingerprint(self, spec: BuildSpec) -> str:
        """What the verify metrics measure, less the revision: a changed fingerprint starts a new
        baseline (the gates, limits, target GPU and Triton settings do not change them)."""
        return sha256_json(
            {
                "model": self.model if self.hub else self.model_id,
                "mode": spec.mode.to_json(),
                "tp": spec.tp,
                "pp": spec.pp,
                "calibration": spec.calibrate.key_fields() if spec.mode.needs_calibration else None,
                "verify": {
                    "max_new_tokens": spec.verify.max_new_tokens,
                    "heldout_tokens": spec.verify.heldout_tokens,
                    "device": spec.verify.device,
                    # vLLM's figures are not the checkpoint runtime's: a baseline of their own
                    # (absent for the checkpoint runtime: those fingerprints stay as they were)
                    **(
                        {"runtime": spec.verify.runtime}
                        if spec.verify.runtime != "reference"
                        else {}
                    ),  # fmt: skip
                },
                # a bench measures the deployment too: its load, the Triton settings and the
                # limits (max_batch_size) change its figures (absent without a bench, so the
                # fingerprints of entries without one are what they were)
                **(
                    {
                        "bench": {
                            **self.bench.to_json(),
                            "triton": dataclasses.asdict(spec.triton),
                            "limits": dataclasses.asdict(spec.limits),
                        }
                    }  # fmt: skip
                    if self.bench is not None
                    else {}
                ),
            }
        )[:16]


@dataclass(frozen=True)
class Fleet:
    path: Path
    name: str
    entries: tuple[Entry, ...]
    out: Path
    triton_root: Path
    history: Path
    keep_runs: int = 100
    runner_labels: tuple[str, ...] = ("self-hosted", "linux", "gpu")
    gc: dict[str, int] = field(default_factory=dict)  # [gc] older_than (s), keep_revisions

    def select(self, ids: tuple[str, ...]) -> tuple[Entry, ...]:
        """The entries named (an entry id, or a model id for all its variants); all if none."""
        if not ids:
            return self.entries
        known = {e.id for e in self.entries} | {e.model_id for e in self.entries}
        unknown = [i for i in ids if i not in known]
        if unknown:
            raise SpecError(
                f"--entry {unknown[0]!r} is not in {self.path}: use one of "
                + ", ".join(e.id for e in self.entries)
            )
        return tuple(e for e in self.entries if e.id in ids or e.model_id in ids)

    def matrix(self, entries: tuple[Entry, ...]) -> dict[str, Any]:
        """A GitHub Actions matrix (`strategy.matrix: ${{ fromJSON(...) }}`): a job an entry,
        on a runner with the fleet's labels and the target GPU's."""
        if len(entries) > MAX_MATRIX:
            raise SpecError(
                f"{len(entries)} entries exceed GitHub's {MAX_MATRIX} jobs a matrix: split the "
                "fleet, or pass --entry MODEL_ID for a part of it"
            )
        include = []
        for entry in entries:
            spec = entry.spec(None if not entry.hub else entry.pin)
            include.append(
                {
                    "entry": entry.id,
                    "model": entry.model_id,
                    "variant": entry.name,
                    "dtype": spec.dtype,
                    "tp": spec.tp,
                    "pp": spec.pp,
                    "gpus": spec.tp * spec.pp,
                    "target_gpu": spec.target_gpu,
                    "runs_on": [*entry.runner_labels, spec.target_gpu.lower()],
                }
            )
        return {"include": include}


def _where(path: Path, *parts: object) -> str:
    return f"{path}: " + "".join(str(p) for p in parts)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on `base`, tables merged key by key."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _tolerances(table: Any, where: str) -> dict[str, Tolerance]:
    if not isinstance(table, dict):
        raise SpecError(
            f"{where}: tolerance is a table of metric = number or {{absolute, relative}}"
        )
    out = {}
    for name, value in table.items():
        if name not in METRIC_NAMES + BENCH_TOLERANCE_NAMES:
            raise SpecError(
                f"{where}: unknown metric {name!r} in tolerance: use "
                f"{', '.join(METRIC_NAMES + BENCH_TOLERANCE_NAMES)}"
            )
        if _is_number(value):
            value = {"absolute": value}
        if (
            not isinstance(value, dict)
            or set(value) - {"absolute", "relative"}
            or not all(_is_number(v) for v in value.values())
        ):
            raise SpecError(
                f"{where}: tolerance.{name} is a number (absolute) or "
                "{ absolute = X, relative = Y } with numbers"
            )
        tol = Tolerance(float(value.get("absolute", 0.0)), float(value.get("relative", 0.0)))
        if tol.absolute < 0 or tol.relative < 0:
            raise SpecError(f"{where}: tolerance.{name} must not be negative")
        out[name] = tol
    return out


def _table(value: Any, where: str) -> dict[str, Any]:
    """A TOML table (an absent one is empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(f"{where} is a table, not {type(value).__name__} {value!r}")
    return value


def _tables(value: Any, where: str, what: str) -> list[dict[str, Any]]:
    """A non-empty array of tables ([[...]])."""
    if not isinstance(value, list) or not value:
        raise SpecError(f"{where}: no {what}: add at least one")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise SpecError(f"{where}: {what} entry {i} is {item!r}, not a table")
    return value


def _path(base: Path, value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where} is a path (a string)")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _model_ref(base: Path, value: Any, where: str) -> str | None:
    """A local path (made absolute against the fleet file) or a hub repo id, as given."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where}.model is a hub repo id or a path (a string)")
    local = base / Path(value).expanduser()
    if local.exists() or value.startswith((".", "/", "~")) or value.endswith(".gguf"):
        return str(local.resolve())
    return value


def _labels(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise SpecError(f"{where}: runner_labels is a list of runner labels (strings)")
    return tuple(value)


def _check_id(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise SpecError(
            f"{where}: {value!r} is not a valid id: letters, digits, '.', '_' and '-' only"
        )
    return value


@dataclass(frozen=True)
class _Head:
    """The fleet-wide settings: [fleet], [defaults] and [tolerance]."""

    name: str
    out: Path
    triton_root: Path
    history: Path
    keep_runs: int
    labels: tuple[str, ...]
    defaults: dict[str, Any]
    tolerances: dict[str, Tolerance]


def _head(path: Path, data: dict[str, Any], base: Path) -> _Head:
    unknown = sorted(set(data) - {"fleet", "defaults", "tolerance", "models", "gc"})
    if unknown:
        raise SpecError(_where(path, f"unknown table(s) {', '.join(unknown)}: use [fleet], "
                               "[defaults], [tolerance], [gc] and [[models]]"))  # fmt: skip
    head = _table(data.get("fleet"), _where(path, "[fleet]"))
    bad = sorted(set(head) - set(_FLEET_KEYS))
    if bad:
        raise SpecError(_where(path, f"[fleet] has unknown key(s) {', '.join(bad)}: valid keys "
                               f"are {', '.join(_FLEET_KEYS)}"))  # fmt: skip
    name = _check_id(head.get("name", path.stem), _where(path, "[fleet] name"))
    out = _path(base, head.get("out", "engines"), _where(path, "[fleet] out"))
    triton_root = _path(base, head.get("triton_root", "triton_repo"), _where(path, "[fleet] triton_root"))  # fmt: skip
    history = (
        _path(base, head["history"], _where(path, "[fleet] history"))
        if "history" in head
        else out / ".trt-builder" / f"nightly-{name}.json"
    )
    keep_runs = head.get("keep_runs", 100)
    if not isinstance(keep_runs, int) or isinstance(keep_runs, bool) or keep_runs < 2:
        raise SpecError(_where(path, "[fleet] keep_runs must be an integer >= 2"))
    labels = _labels(head.get("runner_labels", ["self-hosted", "linux", "gpu"]),
                     _where(path, "[fleet]"))  # fmt: skip
    defaults = _table(data.get("defaults"), _where(path, "[defaults]"))
    for key in _FIXED_SPEC_KEYS:
        if key in defaults:
            raise SpecError(_where(path, f"[defaults] cannot set {key}: it is set by [fleet] or "
                                   "each [[models]] entry"))  # fmt: skip
    tolerances = {**DEFAULT_TOLERANCES, **_tolerances(data.get("tolerance") or {}, _where(path, "[tolerance]"))}  # fmt: skip
    return _Head(name, out, triton_root, history, keep_runs, labels, defaults, tolerances)


@dataclass(frozen=True)
class _Model:
    """One [[models]] entry, checked: what its variants share."""

    id: str
    ref: str | None  # as Entry.model
    revision: str | None
    pin: str | None
    table: dict[str, Any]  # its spec keys


def _model(model: dict[str, Any], where: str, base: Path, taken: set[str]) -> _Model:
    bad = sorted({"out", "triton_root"} & set(model))
    if bad:
        raise SpecError(f"{where}: {bad[0]} is set once, in [fleet]")
    ref = _model_ref(base, model.get("model"), where)
    model_id = _check_id(
        model.get("id") or (Path(ref).stem if ref and Path(ref).is_absolute()
                            else (ref or DEFAULT_MODEL_NAME).split("/")[-1]),
        f"{where}.id",
    )  # fmt: skip
    if model_id in taken:
        raise SpecError(f"{where}: model id {model_id!r} is used twice: give each an id")
    hub = ref is not None and not Path(ref).is_absolute()
    revision, pin = model.get("revision"), model.get("pin")
    if revision is not None and not isinstance(revision, str):
        raise SpecError(f"{where}: revision is a branch, tag or commit sha (a string)")
    if not hub and (revision is not None or pin is not None):
        raise SpecError(
            f"{where}: revision and pin apply to hub repo ids, not to a local path or the "
            "default model (their revision is their content): drop them"
        )
    if hub and revision is None:
        revision = "main"
    if pin is not None and not (isinstance(pin, str) and _SHA.fullmatch(pin)):
        raise SpecError(f"{where}: pin must be a 40-hex commit sha, got {pin!r}")
    if "variants" not in model:
        raise SpecError(f"{where}: no [[models.variants]]: add at least one (e.g. dtype = \"float16\")")  # fmt: skip
    table = {k: v for k, v in model.items() if k not in _MODEL_KEYS}
    return _Model(model_id, ref, revision, pin, table)


def _variant(variant: dict[str, Any], where: str, head: _Head, model: _Model) -> tuple[Entry, str]:
    """The entry of one [[models.variants]] table, with the variant directory it builds."""
    bad = sorted(set(_FIXED_SPEC_KEYS) & set(variant))
    if bad:
        raise SpecError(f"{where}: {bad[0]} is set by the model or [fleet], not a variant")
    table = _merge(_merge(head.defaults, model.table),
                   {k: v for k, v in variant.items() if k not in _VARIANT_KEYS})  # fmt: skip
    entry = Entry(
        id="",
        model_id=model.id,
        name="",
        model=model.ref,
        revision=model.revision,
        pin=model.pin,
        table=table,
        tolerances={**head.tolerances, **_tolerances(variant.get("tolerance") or {}, where)},
        runner_labels=_labels(variant.get("runner_labels", list(head.labels)), where),
        out=head.out,
        triton_root=head.triton_root,
    )
    fixed = model.revision if model.revision and _SHA.fullmatch(model.revision) else None
    try:
        spec = entry.spec(fixed)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None
    name = _check_id(variant.get("name", spec.variant), f"{where}.name")
    bench = _bench(variant.get("bench"), f"{where}.bench", spec.triton.streaming)
    return replace(entry, id=f"{model.id}/{name}", name=name, bench=bench), spec.variant


def _bench(value: Any, where: str, streaming: bool) -> BenchOptions | None:
    """A variant's `bench` table: BenchOptions' fields (lists for concurrency and rates)."""
    if value is None:
        return None
    table = _table(value, where)
    fields = {f.name for f in dataclasses.fields(BenchOptions)}
    bad = sorted(set(table) - fields)
    if bad:
        raise SpecError(f"{where} has unknown key(s) {', '.join(bad)}: valid keys are {', '.join(sorted(fields))}")  # fmt: skip
    if not streaming:
        raise SpecError(
            f"{where}: bench streams tokens from the repository: set [triton] streaming = true "
            "for this variant"
        )
    kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    try:
        return BenchOptions(**kwargs)
    except (SpecError, TypeError) as exc:
        raise SpecError(f"{where}: {exc}") from None


def load_fleet(path: Path) -> Fleet:
    """Read and check a fleet file: every entry's spec is validated before anything runs."""
    data = load_toml(path)
    base = path.resolve().parent
    head = _head(path, data, base)
    if "models" not in data:
        raise SpecError(_where(path, "no [[models]]: add at least one model with its [[models.variants]]"))  # fmt: skip
    entries: list[Entry] = []
    built: dict[tuple[str, str], str] = {}  # (model, variant directory) -> entry id
    for i, table in enumerate(_tables(data["models"], _where(path, "the fleet"), "[[models]]")):
        where = _where(path, f"models[{i}]")
        model = _model(table, where, base, {e.model_id for e in entries})
        for j, variant in enumerate(_tables(table["variants"], where, "[[models.variants]]")):
            vwhere = f"{where}.variants[{j}]"
            entry, directory = _variant(variant, vwhere, head, model)
            if any(e.id == entry.id for e in entries):
                raise SpecError(f"{vwhere}: entry {entry.id!r} is defined twice: name the variants")
            other = built.get((model.ref or "default", directory))
            if other:
                raise SpecError(
                    f"{vwhere}: {entry.id} and {other} build the same directory ({directory}): "
                    "variants of a model must differ in dtype, quantization, tp or pp"
                )
            built[(model.ref or "default", directory)] = entry.id
            entries.append(entry)
    gc = _gc_table(data.get("gc"), _where(path, "[gc]"))
    return Fleet(path, head.name, tuple(entries), head.out, head.triton_root, head.history,
                 head.keep_runs, head.labels, gc)  # fmt: skip


def gc_settings(path: Path) -> dict[str, int]:
    """The fleet file's [gc] table (see Fleet.gc)."""
    return load_fleet(path).gc


def _gc_table(value: Any, where: str) -> dict[str, int]:
    """[gc]: `older_than` (seconds, from "7d", "12h", "30m" or a number of seconds) and
    `keep_revisions`, each present only when set."""
    table = _table(value, where)
    bad = sorted(set(table) - {"older_than", "keep_revisions"})
    if bad:
        raise SpecError(f"{where} has unknown key(s) {', '.join(bad)}: valid keys are "
                        "older_than, keep_revisions")  # fmt: skip
    out: dict[str, int] = {}
    if "older_than" in table:
        out["older_than"] = parse_duration(table["older_than"], f"{where} older_than")
    if "keep_revisions" in table:
        keep = table["keep_revisions"]
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise SpecError(f"{where} keep_revisions is a count >= 0, not {keep!r}")
        out["keep_revisions"] = keep
    return out


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any, where: str, least: int = 0) -> int:
    """Seconds from a number of seconds or a string with a unit: "90m", "4h", "7d"."""
    if _is_number(value):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip().lower()
        unit = _UNITS.get(text[-1])
        try:
            seconds = float(text[:-1] if unit else text) * (unit or 1)
        except ValueError:
            raise SpecError(f"{where}: {value!r} is not a duration: give seconds, or e.g. 90m, "
                            "4h or 7d") from None  # fmt: skip
    else:
        raise SpecError(f"{where}: {value!r} is not a duration: give seconds, or e.g. 90m, 4h or 7d")  # fmt: skip
    if not math.isfinite(seconds):
        raise SpecError(f"{where}: {value!r} is not a duration: give seconds, or e.g. 90m, 4h or 7d")  # fmt: skip
    if seconds < least:
        raise SpecError(f"{where}: {value!r} is too short: give at least {least} second(s)")
    return int(seconds)
