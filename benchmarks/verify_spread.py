"""How far verify's figures move with the order of float32 sums alone: what another CPU gives.

    .venv/bin/python benchmarks/verify_spread.py [--variant int8-sq-tp1-pp1 ...] [--keep DIR]

Builds the default model's rows (tests/mode_matrix.py) in a temporary directory, then verifies
each checkpoint once per kernel choice this CPU can emulate: MKL's code path for the float32
GEMMs (`MKL_CBWR`: AUTO, COMPATIBLE, AVX2) and ATen's vectorised kernels
(`ATEN_CPU_CAPABILITY=default`: none). The checkpoint and the reference are the same in
every run; only the rounding of the float32 sums differs, as it differs between CPUs (and
between the CPU and the GPU's engine). A row whose activations are quantized (SmoothQuant, FP8)
rounds every activation again, so a sum an ulp apart lands on the other INT8/e4m3 neighbour
now and then, and the flip carries on through the layers: its figures are one draw from a
spread this prints; a row of float activations moves by far less.

Prints one line per row and kernel choice, then per row the range of each figure (top-1 and KL
on the prompt set, the held-out perplexity increase in points): tests/test_modes.py's
tolerances stand on these ranges (docs/benchmarks.md records them with the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli import executable, timed  # noqa: E402
from mode_matrix import MATRIX  # noqa: E402

ROWS = ("float16-tp1-pp1", "int8-wo-tp1-pp1", "int8-sq-tp1-pp1", "int8-sq-static-tp1-pp1",
        "fp8-nosearch-tp1-pp1", "fp8-tp1-pp1")  # fmt: skip
#: (MKL_CBWR, ATEN_CPU_CAPABILITY) pairs; None: the best this CPU has
SETTINGS = (("AUTO", None), ("COMPATIBLE", None), ("AVX2", None), ("AUTO", "default"))


def figures(checkpoint: Path, reference: Path, cwd: Path, env: dict[str, str]) -> tuple[float, ...]:
    argv = [executable(), "verify", "--checkpoint", str(checkpoint), "--reference", str(reference),
            "--report", str(cwd / "verify.json"), "--json"]  # fmt: skip
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if not proc.stdout.strip().startswith("{"):
        sys.exit(f"verify failed ({proc.returncode}): {proc.stderr[-1500:]}")
    report = json.loads(proc.stdout)
    return report["top1"], report["kl_mean"], report["perplexity"]["delta_pct"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", choices=sorted(MATRIX))
    parser.add_argument(
        "--keep", type=Path, help="build in DIR and keep it (default: a temporary one)"
    )
    args = parser.parse_args()
    cwd = args.keep or Path(tempfile.mkdtemp(prefix="verify-spread-"))
    cwd.mkdir(parents=True, exist_ok=True)
    try:
        print(f"{'row':<24} {'MKL_CBWR':<11} {'ATen':<8} {'top1':>7} {'KL':>8} {'ppl +%':>7}")
        for variant in args.variant or ROWS:
            _, out = timed([executable(), "build", *MATRIX[variant], "--json"], cwd)
            result = json.loads(out)
            checkpoint = cwd / result["variant_dir"] / "checkpoint"
            reference = checkpoint.parents[1] / "hf"
            seen = []
            for mkl, aten in SETTINGS:
                env = {**os.environ, "MKL_CBWR": mkl}
                env.pop("ATEN_CPU_CAPABILITY", None)
                if aten is not None:
                    env["ATEN_CPU_CAPABILITY"] = aten
                got = figures(checkpoint, reference, cwd, env)
                seen.append(got)
                print(f"{variant:<24} {mkl:<11} {aten or 'best':<8} "
                      f"{got[0]:7.4f} {got[1]:8.5f} {got[2]:7.3f}", flush=True)  # fmt: skip
            spans = [max(s[i] for s in seen) - min(s[i] for s in seen) for i in range(3)]
            kl_low = min(s[1] for s in seen)
            print(f"{variant:<24} range: top1 {spans[0]:.4f} ({round(spans[0] * 413)} of 413 "
                  f"tokens), KL {spans[1]:.5f} ({spans[1] / kl_low:.0%} of the lowest), "
                  f"ppl {spans[2]:.3f} points", flush=True)  # fmt: skip
    finally:
        if args.keep is None:
            shutil.rmtree(cwd, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
