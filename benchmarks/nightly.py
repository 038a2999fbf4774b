"""Time `trt-builder nightly` on a fleet of three tiny models (Llama, Qwen2, GPT-2; four entries):
the first night, an unchanged second night, and a night after one entry's quantization changed.

Prints the figures recorded in docs/benchmarks.md. The unchanged night is compared, in the same
run, with `trt-builder --version` (the interpreter and CLI start-up alone).

    .venv/bin/python benchmarks/nightly.py [--repeats 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

FLEET = """
[fleet]
name = "bench"
[defaults.verify]
heldout_tokens = 512
[[models]]
model = "tiny-llama"
  [[models.variants]]
  name = "fp16"
  dtype = "float16"
  [[models.variants]]
  name = "int8"
  dtype = "int8"
  {int8}
  [models.variants.verify]
  min_top1 = 0.8
  max_kl = 0.05
[[models]]
model = "tiny-qwen2"
  [[models.variants]]
  name = "bf16"
  dtype = "bfloat16"
  [models.variants.verify]
  min_top1 = 0.9
  max_kl = 0.01
[[models]]
model = "tiny-gpt2"
  [[models.variants]]
  name = "fp16"
  dtype = "float16"
"""


def timed(argv: list[str], cwd: Path) -> tuple[float, dict]:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return seconds, json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}


def rebuilt(result: dict) -> str:
    parts = [f"{e['id']}: {', '.join(e['rebuilt']) or 'nothing'}" for e in result["entries"]]
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    from tiny_models import make_tiny, make_tokenizer

    exe = shutil.which("trt-builder") or str(Path(sys.executable).with_name("trt-builder"))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="trt-builder-nightly-"))
    if args.workdir is None:
        atexit.register(shutil.rmtree, work, True)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["HF_HUB_OFFLINE"] = "1"
    make_tokenizer(work / "tokenizer")
    for family in ("llama", "qwen2", "gpt2"):
        make_tiny(family, work / f"tiny-{family}", work / "tokenizer")
    fleet = work / "fleet.toml"
    fleet.write_text(FLEET.replace("{int8}", ""))
    nightly = [exe, "nightly", str(fleet), "--json"]

    first, result = timed(nightly, work)
    first_rebuilt = rebuilt(result)
    seconds = []
    for _ in range(args.repeats):
        s, result = timed(nightly, work)
        assert all(not e["rebuilt"] for e in result["entries"]), rebuilt(result)
        seconds.append(s)
    startup = statistics.median(timed([exe, "--version"], work)[0] for _ in range(args.repeats))
    fleet.write_text(FLEET.replace("{int8}", "int8 = { alpha = 0.8 }"))
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


if __name__ == "__main__":
    main()
