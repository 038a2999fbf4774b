"""The pipeline: fetch -> calibrate -> recipe -> convert -> verify -> engine -> package, each stage
cached by its key (core/stage.py), in one function: run()."""

from __future__ import annotations

import json
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..calibrate.stage import CalibrateStage
from ..checkpoint.mapping import check_mapping
from ..convert.stage import ConvertStage
from ..core.allocator import reuse_freed_memory
from ..core.digests import DigestCache
from ..core.errors import InputError, SpecError, TrtBuilderError, VerifyFailed
from ..core.fsio import write_json
from ..core.layout import Layout
from ..core.locks import locked
from ..core.stage import BuildContext, Stage, StageRecord, plan_stage, run_stage, verify_state
from ..core.versions import tool_versions
from ..engine.build import build_command
from ..engine.memplan import resolve_limits
from ..engine.stage import EngineStage
from ..models.registry import family_for, refuse_mode
from ..recipe.stage import RecipeStage
from ..source.fetch import config_alone
from ..source.files import read_hf_config
from ..source.resolve import resolve_source
from ..source.stage import FetchStage
from ..source.twin import PadStage, twin_of
from ..spec.build import BuildSpec
from ..triton.stage import PackageStage
from ..verify.stage import VerifyStage

STAGES: tuple[Stage, ...] = (
    FetchStage(),
    PadStage(),
    CalibrateStage(),
    RecipeStage(),
    ConvertStage(),
    VerifyStage(),
    EngineStage(),
    PackageStage(),
)
STAGE_NAMES = tuple(s.name for s in STAGES)

#: (event, stage name, record): "start", "end" (the record), "abort", and "progress" with the
#: running stage's phase line as text.
Listener = Callable[[str, str, StageRecord | str | None], None]


@dataclass
class BuildResult:
    """What a build (or one stage, or a dry run) did, as data."""

    spec: BuildSpec
    layout: Layout
    records: list[StageRecord] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    seconds: float = 0.0
    dry_run: bool = False
    hashed_bytes: int = 0  # bytes read to compute digests (0 on an unchanged rerun)
    engine_plan: dict[str, Any] | None = None  # dry run: the trtllm-build command, memory plan
    error: TrtBuilderError | None = None  # what ended the run early (run(check=False))

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.layout.model,
            "revision": self.layout.revision,
            "variant": self.layout.variant,
            "variant_dir": str(self.layout.variant_dir.resolve()),
            "triton_repository": str(self.layout.triton.resolve()),
            "dry_run": self.dry_run,
            "seconds": round(self.seconds, 3),
            "hashed_bytes": self.hashed_bytes,
            "notices": self.notices,
            "stages": [r.to_json() for r in self.records],
            **({"engine_plan": self.engine_plan} if self.engine_plan is not None else {}),
        }


def _engine_plan(ctx: BuildContext) -> dict[str, Any]:
    """For a dry run: the trtllm-build command and, once the model's config is here, the
    memory plan on the target GPU (or why the spec does not fit)."""
    layout = ctx.layout
    command = shlex.join(
        build_command(ctx.spec, layout.checkpoint.resolve(), layout.engine.resolve())
    )
    plan: dict[str, Any] = {"command": command, "target_gpu": ctx.spec.target_gpu}
    if ctx.memory is not None:
        plan["memory"] = ctx.memory.to_json()
    elif not (layout.hf / "config.json").is_file():
        plan["memory"] = "after fetch: the model's config is not here yet"
    return plan


#: Stages that use the engine's build limits.
_USE_LIMITS = ("engine", "package")


def plan_limits(ctx: BuildContext, only: tuple[str, ...]) -> None:
    """The pipeline's step after fetch: fill in the limits the spec leaves to the memory plan,
    from the model's config, and refuse a spec that does not fit the target GPU (before any
    calibrate or convert work). Only for a run that builds or packages an engine; once."""
    if ctx.memory is not None or not set(_USE_LIMITS) & set(only):
        return
    if not (ctx.layout.hf / "config.json").is_file():
        return
    config = read_hf_config(ctx.layout.hf)
    twin = twin_of(config, ctx.spec.mode, ctx.spec.tp)  # the engine is the twin's, if any
    ctx.spec, ctx.memory = resolve_limits(ctx.spec, config if twin is None else twin.config(config))


def prepare(spec: BuildSpec, *, force: bool = False, offline: bool | None = None) -> BuildContext:
    """Resolve the model and lay out where this build's artifacts go. `offline`: ask no hub
    (None: as HF_HUB_OFFLINE says)."""
    digests = DigestCache(spec.out / ".trt-builder" / "digests.json")
    source = resolve_source(spec.model, spec.revision, digests, offline=offline)
    layout = Layout(spec.out, source.name, source.revision, spec.variant, spec.triton_root,
                    spec.verify.reports_dir)  # fmt: skip
    ctx = BuildContext(spec, source, layout, digests, force=force, offline=offline)
    check_model_early(ctx)
    return ctx


def refuse_unbuildable(hf_config: dict[str, Any], spec: BuildSpec) -> None:
    """Refuse an unsupported architecture, a tp/pp the model cannot be split into, or
    SmoothQuant for a family it does not build."""
    family = family_for(hf_config)
    if spec.tp * spec.pp > 1:
        check_mapping(family.config(hf_config), spec.tp, spec.pp)
    architecture = str((hf_config.get("architectures") or ["?"])[0])
    refuse_mode(family, architecture, spec.mode.FAMILY_FLAG)
    spec.build_target.refuse_family(family, architecture)
    twin_of(hf_config, spec.mode, spec.tp)  # a mode's widths the model cannot be padded to


def check_model_early(ctx: BuildContext) -> None:
    """Refuse an unbuildable model before any work, from its config.json alone: a local
    directory's, or a hub model's before its weights are fetched (a GGUF file's is checked by
    convert: reading even its metadata costs importing transformers on every run)."""
    source = ctx.source
    if source.kind == "local" or (source.kind == "hub" and not ctx.layout.hf.is_dir()):
        config = config_alone(source.kind, source.ref, source.revision, offline=ctx.offline)
        refuse_unbuildable(config, ctx.spec)


def _missing_inputs(stage: Stage, ctx: BuildContext) -> list[Path]:
    return [p for p in stage.inputs(ctx).values() if not p.exists()]


def run(
    spec: BuildSpec,
    *,
    only: tuple[str, ...] = STAGE_NAMES,
    force: bool = False,
    dry_run: bool = False,
    lock_timeout: float = 600.0,
    listener: Listener | None = None,
    offline: bool | None = None,
    check: bool = True,
) -> BuildResult:
    """Run the stages named in `only`, in pipeline order: fetch, the memory plan, calibrate,
    convert, verify, engine, package. Returns what ran (BuildResult). A stage's error ends
    the run: it is raised, or with `check=False` returned as `result.error` beside the records
    of the stages before it. `offline`: ask no hub (None: as HF_HUB_OFFLINE says)."""
    start = time.perf_counter()
    reuse_freed_memory()  # core/allocator.py: large tensors are not faulted in afresh each time
    ctx = prepare(spec, force=force, offline=offline)
    result = BuildResult(spec, ctx.layout, notices=ctx.notices, dry_run=dry_run)
    emit = listener or (lambda *_: None)
    warm = None if dry_run else _warm_imports(ctx, only)
    try:
        if dry_run:
            _dry_run(ctx, only, result)
        else:
            with locked(ctx.layout.lock, lock_timeout):
                for stage in STAGES:
                    if _wanted(stage, ctx, only):
                        waited = 0.0
                        if stage.name != "fetch":
                            if warm is not None:  # the imports are done before anything uses them
                                waited = time.perf_counter()
                                warm.join()
                                warm, waited = None, time.perf_counter() - waited
                            plan_limits(ctx, only)
                        _run_one(stage, ctx, result, lock_timeout, emit, waited)
    except TrtBuilderError as exc:  # what ran before it stays in the result
        result.error = exc
    finally:
        if warm is not None:  # never left running into the interpreter's exit
            warm.join()
        if not dry_run:  # a dry run leaves the disk as it found it
            ctx.digests.save()
        result.spec = ctx.spec  # with the limits the memory plan set
        result.hashed_bytes = ctx.digests.hashed_bytes
        result.seconds = time.perf_counter() - start
    if check and result.error is not None:
        raise result.error
    return result


_TORCH_STAGES = frozenset({"pad", "calibrate", "recipe", "convert", "verify"})


def _warm_imports(ctx: BuildContext, only: tuple[str, ...]) -> threading.Thread | None:
    """On a first build from a local directory (fetch will run, and stages that need torch
    after it), import torch and transformers on a thread while fetch copies the model: on the
    H200 host a fresh process spends 14-18 s on them, which the first such stage would
    otherwise wait for. The run joins the thread before the next stage starts. Only while fetch
    imports none of them itself: transformers' and huggingface-hub's lazy modules are not safe
    to import from two threads at once (a GGUF fetch dequantizes through transformers; a hub
    fetch runs huggingface-hub; pickles are read with torch)."""
    if "fetch" not in only or not _TORCH_STAGES & set(only):
        return None
    if ctx.source.kind != "local" or ctx.spec.allow_pickle:
        return None
    if plan_stage(FetchStage(), ctx).status != "pending":
        return None
    thread = threading.Thread(target=_import_torch, name="warm-imports", daemon=True)
    thread.start()
    return thread


def _import_torch() -> None:
    try:
        import safetensors.torch  # noqa: F401
        import transformers.modeling_utils  # noqa: F401
    except BaseException:  # only a head start: the stage that needs them imports them itself
        return


def _dry_run(ctx: BuildContext, only: tuple[str, ...], result: BuildResult) -> None:
    """What would run, with keys; the engine command and memory plan (a refusal is reported)."""
    refusal = None
    try:
        plan_limits(ctx, only)
    except SpecError as exc:  # a dry run reports it, it does not refuse
        refusal = f"does not fit: {exc}"
    result.records = [_plan(stage, ctx) for stage in STAGES if _wanted(stage, ctx, only)]
    if "engine" in only:
        result.engine_plan = _engine_plan(ctx)
        if refusal:
            result.engine_plan["memory"] = refusal
    elif refusal:
        ctx.notices.append(refusal)


def _check_ready(stage: Stage, ctx: BuildContext) -> None:
    """Refuse to start a stage whose inputs or limits are not there."""
    if stage.name in _USE_LIMITS and not ctx.spec.limits.resolved:
        raise InputError(
            f"{stage.name} needs the model's config.json in {ctx.layout.hf} for its "
            "memory plan: run trt-builder fetch (or build) first, or set "
            "--max-batch-size and --max-num-tokens"
        )
    missing = _missing_inputs(stage, ctx)
    if missing:
        raise InputError(
            f"{stage.name} needs {missing[0]}, which does not exist: run the earlier stages "
            f"(trt-builder build, or the stage that writes it) first"
        )
    if stage.needs_verified_checkpoint:
        _check_verified(stage, ctx)


def _run_one(
    stage: Stage,
    ctx: BuildContext,
    result: BuildResult,
    lock_timeout: float,
    emit: Listener,
    waited: float = 0.0,
) -> None:
    """Run (or reuse) one stage and record it; a failed verify gate ends the run. `waited`:
    the seconds spent before it on the rest of the imports it needs, counted in its time."""
    _check_ready(stage, ctx)
    emit("start", stage.name, None)
    ctx.progress = _progress(emit, stage.name)
    out = stage.output_dir(ctx)
    try:  # outputs shared between variants (hf/) need a lock of their own
        with locked(out.parent / f".{out.name}.lock", lock_timeout):
            record = run_stage(stage, ctx)
    except BaseException:
        emit("abort", stage.name, None)
        raise
    if waited:
        record.seconds = round(record.seconds + waited, 3)
    result.records.append(record)
    for note in record.details.get("notes") or []:  # e.g. "the vision tower is not converted"
        if note not in ctx.notices:
            ctx.notices.append(note)
    emit("end", stage.name, record)
    _write_manifest(ctx, result)
    if record.status in ("failed", "cached-failed"):
        raise VerifyFailed(_verify_message(ctx, record))


def _progress(emit: Listener, name: str) -> Callable[[str], None]:
    return lambda text: emit("progress", name, text)


def _wanted(stage: Stage, ctx: BuildContext, only: tuple[str, ...]) -> bool:
    """A stage named in `only`; an optional stage (calibrate) also needs the mode to need it,
    unless it is the one asked for."""
    if stage.name not in only:
        return False
    return stage.wanted(ctx, explicit=only == (stage.name,))


def _check_verified(stage: Stage, ctx: BuildContext) -> None:
    """Engine and package refuse a checkpoint that failed verify, and say when none ran."""
    state = verify_state(ctx)
    report = ctx.layout.reports / "verify.json"
    if state == "failed":
        raise VerifyFailed(
            f"{stage.name} refuses this checkpoint: it failed verify ({report}); fix the model, "
            "or change the gate in the spec's [verify] table and rerun verify"
        )
    notice = "the checkpoint has not been verified: run trt-builder verify (or build)"
    if state == "not run" and notice not in ctx.notices:
        ctx.notices.append(notice)


def _plan(stage: Stage, ctx: BuildContext) -> StageRecord:
    unplanned = stage.name in _USE_LIMITS and not ctx.spec.limits.resolved
    if unplanned or _missing_inputs(stage, ctx):
        return StageRecord(stage.name, "would run", output=str(stage.output_dir(ctx)))
    record = plan_stage(stage, ctx)
    if record.status == "pending":
        record.status = "would run"
    return record


def _verify_message(ctx: BuildContext, record: StageRecord) -> str:
    failures = "; ".join(record.details.get("failures") or ["gate failed"])
    return f"verify failed: {failures} (report: {ctx.layout.reports / 'verify.html'})"


def _write_manifest(ctx: BuildContext, result: BuildResult) -> None:
    """Merge this run's stage records into the variant's manifest.json."""
    path = ctx.layout.manifest
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        manifest = {}
    stages = manifest.get("stages", {})
    for record in result.records:
        stages[record.name] = record.to_json()
    manifest.update(
        {
            "manifest_version": 1,
            "trt_builder": __version__,
            "spec": ctx.spec.to_json(),
            "source": ctx.source.to_json(),
            "layout": {
                "variant_dir": str(ctx.layout.variant_dir),
                "hf": str(ctx.layout.hf),
                "triton": str(ctx.layout.triton),
            },
            "tools": tool_versions(("torch", "transformers", "safetensors", "tensorrt-llm")),
            "stages": {name: stages[name] for name in STAGE_NAMES if name in stages},
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    )
    write_json(path, manifest)
