"""The stage framework: keys over inputs, parameters and tool versions; atomic output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from trt_builder.core import versions
from trt_builder.core.digests import DigestCache
from trt_builder.core.layout import Layout
from trt_builder.core.stage import BuildContext, Stage, run_stage
from trt_builder.source.resolve import ModelSource
from trt_builder.spec.build import BuildSpec


class CopyStage(Stage):
    """A toy stage: concatenates its input files, with a parameter and a tool."""

    version: ClassVar[int] = 1

    def __init__(self, name: str, reads: list[str], param: str, tool: str) -> None:
        self.name = name
        self.reads = reads
        self.param = param
        self.tools = (tool,)
        self.runs = 0

    def output_dir(self, ctx: BuildContext) -> Path:
        return ctx.spec.out / self.name

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        return {r: ctx.spec.out / r for r in self.reads}

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        return {"p": getattr(ctx.spec, self.param)}

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        self.runs += 1
        text = "".join(
            (ctx.spec.out / r).read_text() if (ctx.spec.out / r).is_file() else "dir"
            for r in self.reads
        )
        (work / "out.txt").write_text(text)
        return {}


def _ctx(root: Path, **spec: Any) -> BuildContext:
    s = BuildSpec(out=root, **spec)
    layout = Layout(root, "m", "r", s.variant, root / "triton")
    return BuildContext(
        s, ModelSource("local", str(root), "m", "r"), layout, DigestCache(root / "memo.json")
    )


def test_key_invalidates_exactly_the_stages_that_read_the_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a.txt").write_text("A")
    (tmp_path / "b.txt").write_text("B")
    first = CopyStage("first", ["a.txt"], "dtype", "torch")
    second = CopyStage("second", ["b.txt"], "tp", "transformers")
    third = CopyStage("third", ["first"], "pp", "safetensors")  # reads first's output
    stages = [first, second, third]

    def build(**spec: Any) -> list[str]:
        ctx = _ctx(tmp_path, **spec)
        return [run_stage(s, ctx).status for s in stages]

    assert build() == ["ran", "ran", "ran"]
    assert build() == ["cached", "cached", "cached"]

    (tmp_path / "b.txt").write_text("B2")  # an input file changes
    assert build() == ["cached", "ran", "cached"]

    assert build(dtype="bfloat16") == [
        "ran",
        "cached",
        "cached",
    ]  # a spec field: first's output is unchanged ("A")
    (tmp_path / "a.txt").write_text("A2")
    assert build(dtype="bfloat16") == [
        "ran",
        "cached",
        "ran",
    ]  # first's output changed, so third reruns

    versions.tool_version.cache_clear()
    real = versions.tool_version
    monkeypatch.setattr(
        "trt_builder.core.stage.tool_versions",
        lambda names: {
            n: ("9.9" if n == "transformers" else real(n)) for n in ("trt-builder", *names)
        },
    )
    assert build(dtype="bfloat16") == ["cached", "ran", "cached"]  # a tool version


def test_force_and_damaged_output_rerun(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("A")
    stage = CopyStage("first", ["a.txt"], "dtype", "torch")
    assert run_stage(stage, _ctx(tmp_path)).status == "ran"
    ctx = _ctx(tmp_path)
    ctx.force = True
    assert run_stage(stage, ctx).status == "ran"
    (tmp_path / "first" / "out.txt").write_text("tampered")
    assert run_stage(stage, _ctx(tmp_path)).status == "ran"
    assert (tmp_path / "first" / "out.txt").read_text() == "A"


KILLED_STAGE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_stages import CopyStage, _ctx
    from trt_builder.core.stage import run_stage

    class Slow(CopyStage):
        def run(self, ctx, work):
            (work / "out.txt").write_text("half")
            Path({flag!r}).write_text("ready")
            time.sleep(60)
            return {{}}

    run_stage(Slow("first", ["a.txt"], "dtype", "torch"), _ctx(Path({root!r})))
    """
)


def test_stage_killed_midway_leaves_no_final_dir_and_rerun_succeeds(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("A")
    flag = tmp_path / "flag"
    script = KILLED_STAGE.format(
        tests=str(Path(__file__).parent), flag=str(flag), root=str(tmp_path)
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    )
    deadline = time.time() + 60
    while not flag.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert flag.exists(), "the stage never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "first").exists()
    assert any(
        p.name.startswith(".first.tmp-") for p in tmp_path.iterdir()
    )  # the half-written sibling

    record = run_stage(CopyStage("first", ["a.txt"], "dtype", "torch"), _ctx(tmp_path))
    assert record.status == "ran"
    assert (tmp_path / "first" / "out.txt").read_text() == "A"
    assert not any(p.name.startswith(".first.") for p in tmp_path.iterdir())  # leftovers cleaned
