"""Time `trt-builder nightly` on a fleet of three tiny models (Llama, Qwen2, GPT-2; four entries):
the first night, an unchanged second night, and a night after one entry's quantization changed.
With --default-model, also a fleet of the embedded SmolLM2-135M-Instruct (int8 and float16).

Prints the figures recorded in docs/benchmarks.md. The unchanged night is compared, in the same
run, with `trt-builder --version` (the interpreter and CLI start-up alone).

    .venv/bin/python benchmarks/nightly.py [--repeats 5] [--workdir DIR] [--default-model]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _cli import executable  # noqa: E402
from _cli import timed as run  # noqa: E402


def timed(argv: list[str], cwd: Path) -> tuple[float, dict]:
    seconds, out = run(argv, cwd)
    return seconds, json.loads(out) if out.strip().startswith("{") else {}


def rebuilt(result: dict) -> str:
    parts = [f"{e['id']}: {', '.join(e['rebuilt']) or 'nothing'}" for e in result["entries"]]
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--default-model", action="store_true")
    args = parser.parse_args()
    from tiny_models import make_fleet_models, make_tokenizer, tiny_fleet

    exe = executable()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="trt-builder-nightly-"))
    if args.workdir is None:
        atexit.register(shutil.rmtree, work, True)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["HF_HUB_OFFLINE"] = "1"
    make_tokenizer(work / "tokenizer")
    make_fleet_models(work, work / "tokenizer")
    fleet = work / "fleet.toml"
    fleet.write_text(tiny_fleet("bench", heldout_tokens=512))
    nightly = [exe, "nightly", str(fleet), "--json"]

    first, result = timed(nightly, work)
    first_rebuilt = rebuilt(result)
    seconds = []
    for _ in range(args.repeats):
        s, result = timed(nightly, work)
        assert all(not e["rebuilt"] for e in result["entries"]), rebuilt(result)
        seconds.append(s)
    startup = statistics.median(timed([exe, "--version"], work)[0] for _ in range(args.repeats))
    fleet.write_text(tiny_fleet("bench", heldout_tokens=512, int8="int8 = { alpha = 0.8 }"))
    changed, result = timed(nightly, work)

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(f"fleet: 3 tiny models, {len(result['entries'])} entries")
    print(f"first night: {first:.1f} s wall ({first_rebuilt})")
    print(
        f"unchanged night (median of {args.repeats}): {statistics.median(seconds):.2f} s wall, "
        f"max {max(seconds):.2f} s; CLI start-up alone {startup:.2f} s "
        f"(ratio {statistics.median(seconds) / startup:.2f})"
    )
    print(f"one entry's quantization changed: {changed:.1f} s wall ({rebuilt(result)})")
    if args.default_model:
        smollm2(exe, work, args.repeats)


SMOLLM2 = """
[fleet]
name = "smollm2"
[[models]]
  [[models.variants]]
  name = "int8"
  dtype = "int8"
  [[models.variants]]
  name = "fp16"
  dtype = "float16"
"""


def smollm2(exe: str, work: Path, repeats: int) -> None:
    """The embedded default model in two variants: the first night and unchanged nights."""
    fleet = work / "smollm2.toml"
    fleet.write_text(SMOLLM2)
    nightly = [exe, "nightly", str(fleet), "--json", "--report-dir", str(work / "smollm2-reports")]
    first, result = timed(nightly, work)
    stages = "; ".join(
        f"{e['id']}: " + ", ".join(e["rebuilt"]) + f" ({e['seconds']:.0f} s)"
        for e in result["entries"]
    )
    seconds = []
    for _ in range(repeats):
        s, result = timed(nightly, work)
        assert all(not e["rebuilt"] and e["hashed_bytes"] == 0 for e in result["entries"])
        seconds.append(s)
    print(f"SmolLM2-135M-Instruct fleet, first night: {first:.1f} s wall ({stages})")
    print(
        f"SmolLM2-135M-Instruct fleet, unchanged night (median of {repeats}): "
        f"{statistics.median(seconds):.2f} s wall, max {max(seconds):.2f} s"
    )


if __name__ == "__main__":
    main()
