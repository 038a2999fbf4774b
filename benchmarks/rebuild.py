"""Time `trt-builder build --dtype int8` on the default model: a first build, then unchanged reruns.

Prints the figures recorded in docs/benchmarks.md. The rerun is compared, in the same run,
with `trt-builder --version` (the interpreter and CLI start-up alone).

    .venv/bin/python benchmarks/rebuild.py [--repeats 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _cli import executable, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    exe = executable()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="trt-builder-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    build = [exe, "build", "--dtype", "int8", "--json"]

    first, out = timed(build, work)
    stages = {s["name"]: s["seconds"] for s in json.loads(out)["stages"]}
    reruns = []
    for _ in range(args.repeats):
        seconds, out = timed(build, work)
        statuses = {s["status"] for s in json.loads(out)["stages"]}
        assert statuses <= {"cached", "skipped"}, statuses
        reruns.append(seconds)
    startup = statistics.median(timed([exe, "--version"], work)[0] for _ in range(args.repeats))

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(
        f"first build: {first:.1f} s wall ("
        + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items())
        + ")"
    )
    print(
        f"unchanged rerun: median {statistics.median(reruns):.2f} s, max {max(reruns):.2f} s over {len(reruns)} runs"
    )
    print(
        f"CLI start-up alone (trt-builder --version): {startup:.2f} s; rerun / start-up = {statistics.median(reruns) / startup:.2f}"
    )
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    if statistics.median(reruns) >= 2.0:  # the goal: an unchanged rerun in under 2 s
        sys.exit(
            f"GOAL MISSED: unchanged rerun took {statistics.median(reruns):.2f} s (goal < 2 s)"
        )


if __name__ == "__main__":
    main()
