"""The stage framework: a cache key over inputs, parameters and tool versions; atomic output."""

from __future__ import annotations

import errno
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from . import codegraph
from .digests import DigestCache, sha256_json
from .errors import OutputError
from .fsio import atomic_dir, write_json
from .layout import Layout
from .versions import tool_versions

if TYPE_CHECKING:  # annotations only: the stages' context is made of the parts above core
    from ..engine.memplan import MemoryPlan
    from ..source.resolve import ModelSource
    from ..spec.build import BuildSpec

MARKER = "stage.json"


class StageSkipped(Exception):
    """Raised by a stage's run() when it cannot run here; nothing is written."""

    def __init__(self, reason: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.details = details or {}


@dataclass
class BuildContext:
    """What every stage sees: the spec, the resolved source, the layout and the digest memo."""

    spec: BuildSpec
    source: ModelSource
    layout: Layout
    digests: DigestCache
    force: bool = False
    offline: bool | None = None  # ask no hub (None: as HF_HUB_OFFLINE says)
    notices: list[str] = field(default_factory=list)
    memory: MemoryPlan | None = None  # the engine's memory plan, once limits are resolved
    progress: Callable[[str], None] = lambda _text: None  # a running stage's phase line


@dataclass
class StageRecord:
    """What a stage did; stored in its output's stage.json and in the variant manifest."""

    name: str
    status: str  # "ran" | "cached" | "skipped" | "failed"
    key: str = ""
    output: str = ""
    inputs: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    finished_at: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Stage(ABC):
    """A step of the pipeline, and everything the pipeline asks of one (each stage is a
    subclass). `run` writes into `work`, which becomes `output_dir` whole."""

    name: ClassVar[str]
    version: ClassVar[int]  # bump when the same inputs would now give a different output
    tools: ClassVar[tuple[str, ...]]
    #: Whether it refuses a checkpoint that failed verify (and notes one never verified).
    needs_verified_checkpoint: ClassVar[bool] = False
    #: Whether it publishes its output itself (`place`), not by renaming `work` into place.
    publishes: ClassVar[bool] = False

    def wanted(self, ctx: BuildContext, *, explicit: bool) -> bool:
        """Whether a build runs it for this spec (`explicit`: it alone was asked for)."""
        return True

    @abstractmethod
    def output_dir(self, ctx: BuildContext) -> Path:
        """See the class."""

    @abstractmethod
    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        """See the class."""

    @abstractmethod
    def params(self, ctx: BuildContext) -> dict[str, Any]:
        """See the class."""

    @abstractmethod
    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        """See the class."""

    def place(self, ctx: BuildContext, work: Path, link: Path) -> None:
        """Publish the finished `work` at `link` (only where `publishes`)."""
        raise NotImplementedError


def digest_inputs(ctx: BuildContext, inputs: dict[str, Path]) -> dict[str, str]:
    """One digest per declared input; a stage output is digested without its marker."""
    return {label: ctx.digests.digest(path, exclude=(MARKER,)) for label, path in inputs.items()}


def stage_key(
    stage: Stage, inputs: dict[str, str], params: dict[str, Any], tools: dict[str, str]
) -> str:
    return sha256_json(
        {
            "stage": stage.name,
            "version": stage.version,
            "inputs": inputs,
            "params": params,
            "tools": tools,
        }
    )


def stage_tools(stage: Stage) -> dict[str, str]:
    """The tool versions in a stage's key, and the digest of trt-builder's code it runs: its
    module and every trt-builder module that imports, directly or not (core/codegraph.py)."""
    tools = tool_versions(stage.tools)
    tools["trt-builder code"] = codegraph.code_digest(type(stage).__module__, codegraph.PACKAGE)
    return tools


def read_marker(output: Path) -> dict[str, Any] | None:
    import json

    try:
        return json.loads((output / MARKER).read_text())
    except (OSError, ValueError):
        return None


def built_from(ctx: BuildContext, output: Path, label: str, source: Path) -> bool:
    """Whether `output` was made (its stage.json says) from `source` as it is now."""
    marker = read_marker(output)
    if marker is None or not source.exists():
        return False
    return bool(
        marker.get("inputs", {}).get(label) == ctx.digests.digest(source, exclude=(MARKER,))
    )


def verify_state(ctx: BuildContext) -> str:
    """ "passed", "failed", or "not run" (no report for the checkpoint as it is now)."""
    if not built_from(ctx, ctx.layout.reports, "checkpoint", ctx.layout.checkpoint):
        return "not run"
    marker = read_marker(ctx.layout.reports) or {}
    return "failed" if marker.get("status") == "failed" else "passed"


def plan_stage(stage: Stage, ctx: BuildContext) -> StageRecord:
    """Compute the key and say whether the stage would run or is cached (no side effects)."""
    inputs = digest_inputs(ctx, stage.inputs(ctx))
    params = stage.params(ctx)
    tools = stage_tools(stage)
    key = stage_key(stage, inputs, params, tools)
    output = stage.output_dir(ctx)
    marker = read_marker(output)
    cached = (
        not ctx.force
        and marker is not None
        and marker.get("key") == key
        # An output edited or damaged since it was written is not a cache hit.
        and ctx.digests.tree(output, exclude=(MARKER,)) == marker.get("outputs")
    )
    record = StageRecord(
        stage.name, "cached" if cached else "pending", key, str(output), inputs, params, tools
    )
    if cached and marker is not None:
        record.outputs = marker.get("outputs", {})
        record.details = marker.get("details", {})
        record.status = "cached" if marker.get("status") != "failed" else "cached-failed"
    return record


def run_stage(stage: Stage, ctx: BuildContext) -> StageRecord:
    """Run a stage unless its key matches the recorded one; output appears atomically."""
    record = plan_stage(stage, ctx)
    if record.status.startswith("cached"):
        return record
    output = Path(record.output)
    start = time.perf_counter()
    work: Path | None = None
    try:
        placer = (lambda tmp, final: stage.place(ctx, tmp, final)) if stage.publishes else None
        with atomic_dir(output, placer) as work:
            try:
                record.details = stage.run(ctx, work) or {}
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                    raise
                raise OutputError(
                    f"{stage.name} cannot write {output} ({exc.strerror}): free disk space, "
                    "or choose another --out"
                ) from None
            record.status = "failed" if record.details.get("failed") else "ran"
            record.outputs = ctx.digests.tree(work)
            record.seconds = round(time.perf_counter() - start, 3)
            record.finished_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            write_json(work / MARKER, record.to_json())
    except StageSkipped as skip:
        record.status = "skipped"
        record.details = {"reason": skip.reason, **skip.details}
    if work is not None and record.status in ("ran", "failed"):
        ctx.digests.move(work, output)
    record.seconds = round(time.perf_counter() - start, 3)
    return record
