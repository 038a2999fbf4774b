"""Time `trt-builder build --dtype int8` on the default model: a first build, then unchanged reruns.

Prints the figures recorded in docs/benchmarks.md. The rerun is compared, in the same run,
with `trt-builder --version` (the interpreter and CLI start-up alone). `--before DIR` (a
checkout of an earlier commit: `git worktree add DIR COMMIT`) first times that checkout's
first build in the same run, with the same interpreter, and prints both stage by stage, with
the recipe's choice and the verify figures of each. Exits 1 when the first build's pipeline
takes 90 s or more, verify 20 s or more (issue 44), or an unchanged rerun 2 s or more.

    .venv/bin/python benchmarks/rebuild.py [--repeats 5] [--workdir DIR] [--before DIR]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _cli import executable, timed

#: The goals: the first build's pipeline (every stage's seconds) and its verify (issue 44).
PIPELINE_GOAL_S, VERIFY_GOAL_S = 90.0, 20.0


def first_build(argv: list[str], work: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A first build in `work`: wall seconds, each stage's seconds, the recipe's choice and
    alphas, the verify figures."""
    seconds, out = timed(argv, work, env)
    result = json.loads(out)
    stages = {s["name"]: s for s in result["stages"]}
    recipe = json.loads((work / stages["recipe"]["output"] / "recipe.json").read_text())
    report = json.loads((work / result["variant_dir"] / "reports" / "verify.json").read_text())
    return {
        "wall": seconds,
        "stages": {name: s["seconds"] for name, s in stages.items()},
        "chosen": recipe["chosen"],
        "alphas": recipe["alphas"],
        "candidates": {c["name"]: (c["kl"], c["kl_se"]) for c in recipe["candidates"]},
        "verify": {
            "top1": report["top1"],
            "kl": report["kl_mean"],
            "ppl": report["perplexity"]["delta_pct"],
            "heldout top1": report["perplexity"]["top1"],
        },  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--before", type=Path, help="a checkout of an earlier commit")
    args = parser.parse_args()
    exe = executable()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="trt-builder-bench-"))
    if args.workdir is None:  # GBs of checkpoints: never left behind, whatever happens
        atexit.register(shutil.rmtree, work, True)
    work.mkdir(parents=True, exist_ok=True)
    build = [exe, "build", "--dtype", "int8", "--json"]

    before = None
    if args.before is not None:  # the earlier checkout's package first on the path
        old = work / "before"
        old.mkdir(exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(args.before.resolve())}
        before = first_build([sys.executable, "-m", "trt_builder.cli.main", *build[1:]], old, env)
        shutil.rmtree(old, ignore_errors=True)
    after = first_build(build, work)
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
    runs = {"before": before, "after": after} if before else {"first build": after}
    print("| stage | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for name in after["stages"]:
        cells = [f"{r['stages'].get(name, 0.0):.1f} s" for r in runs.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    pipeline = {k: sum(r["stages"].values()) for k, r in runs.items()}
    print("| **pipeline** | " + " | ".join(f"**{v:.1f} s**" for v in pipeline.values()) + " |")
    print(
        "| wall (with start-up) | " + " | ".join(f"{r['wall']:.1f} s" for r in runs.values()) + " |"
    )
    for key, r in runs.items():
        kl = ", ".join(f"{n} {m:.5f} ± {se:.5f}" for n, (m, se) in r["candidates"].items())
        print(f"{key}: recipe chose {r['chosen']} (KL: {kl}); verify "
              + ", ".join(f"{k} {v:.4f}" for k, v in r["verify"].items()))  # fmt: skip
    if before:
        same = before["chosen"] == after["chosen"] and before["alphas"] == after["alphas"]
        print(f"the recipe's choice and every alpha the same before and after: {same}")
    print(
        f"unchanged rerun: median {statistics.median(reruns):.2f} s, max {max(reruns):.2f} s over {len(reruns)} runs"
    )
    print(
        f"CLI start-up alone (trt-builder --version): {startup:.2f} s; rerun / start-up = {statistics.median(reruns) / startup:.2f}"
    )
    missed = []
    if pipeline[next(reversed(runs))] >= PIPELINE_GOAL_S:
        missed.append(f"the first build's pipeline took {pipeline[next(reversed(runs))]:.1f} s")
    if after["stages"].get("verify", 0.0) >= VERIFY_GOAL_S:
        missed.append(f"verify took {after['stages']['verify']:.1f} s")
    if statistics.median(reruns) >= 2.0:  # the goal: an unchanged rerun in under 2 s
        missed.append(f"an unchanged rerun took {statistics.median(reruns):.2f} s")
    if missed:
        sys.exit("GOAL MISSED: " + "; ".join(missed))


if __name__ == "__main__":
    main()
