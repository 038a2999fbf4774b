"""Convert a fixed set of models through the CLI and print every checkpoint file's sha256.

Run it before and after a change that must not alter conversion (a refactor), then diff the two
JSON files. Only the CLI is used, so the same script runs against any version of trt-builder
(PYTHONPATH=<a checkout> runs that checkout's package through this venv's executable):

    .venv/bin/python scripts/checkpoint_digests.py > before.json
    ... change ...
    .venv/bin/python scripts/checkpoint_digests.py > after.json && diff before.json after.json

Every row of the mode matrix (tests/mode_matrix.py: MATRIX, every mode and both targets) on the
default model (SmolLM2-135M-Instruct), and the tiny random families of tests/tiny_models.py in
float16 (plus int8, int8 with the INT8 KV cache, int8-wo and tp2 for tiny Llama). Each runs the
stages a checkpoint depends on, one command each: fetch, calibrate, recipe, convert (a stage a
mode does not use does nothing, or work no checkpoint depends on). Work files go to a temporary
directory, removed at exit. `--skip-default` leaves the default model out (it takes half an
hour on 2 cores); `--only VARIANT` (repeatable) keeps those of its rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from mode_matrix import MATRIX  # noqa: E402

from tiny_models import FAMILIES, make_tiny, make_tokenizer  # noqa: E402

TINY_LLAMA_EXTRA = (
    ("int8", ["--dtype", "int8", "--heldout-tokens", "256", "--calib-samples", "8"]),
    ("int8-kv", ["--dtype", "int8", "--kv-cache", "int8", "--calib-samples", "8"]),
    ("int8-wo", ["--dtype", "int8-wo"]),
    ("fp16-tp2", ["--dtype", "float16", "--tp", "2"]),
)


def _content(path: Path) -> bytes:
    """A file's bytes; the recipe search's record without its timings (they differ every run)."""
    if path.name != "recipe.json":
        return path.read_bytes()
    record = json.loads(path.read_text())
    record.pop("seconds", None)
    record.pop("seconds_by_part", None)  # FP8's
    return json.dumps(record, sort_keys=True).encode()


def digests(checkpoint: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(_content(p)).hexdigest()
        for p in sorted(checkpoint.iterdir())
        if p.is_file() and p.name != "stage.json"
    }


def convert(exe: str, cwd: Path, model: str | None, args: list[str]) -> dict[str, str]:
    """fetch, calibrate, recipe, convert: the stages a checkpoint depends on."""
    for command in ("fetch", "calibrate", "recipe", "convert"):
        argv = [exe, command, "--json", *(["--model", model] if model else []), *args]
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout)
    stage = next(s for s in result["stages"] if s["name"] == "convert")
    return digests(cwd / stage["output"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-default", action="store_true")
    parser.add_argument("--exe", default=str(Path(sys.executable).with_name("trt-builder")))
    parser.add_argument("--only", action="append", default=[], help="a row's name")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trt-builder-digests-"))
    try:
        tokenizer = work / "tokenizer"
        make_tokenizer(tokenizer)
        out: dict[str, dict[str, str]] = {}
        rows = {f"tiny-{family}/float16": (f"tiny-{family}", ["--dtype", "float16"])
                for family in FAMILIES}  # fmt: skip
        rows |= {f"tiny-llama/{name}": ("tiny-llama", extra) for name, extra in TINY_LLAMA_EXTRA}
        if not args.skip_default:
            rows |= {f"default/{variant}": (None, list(argv)) for variant, argv in MATRIX.items()}
        for name, (model, argv) in rows.items():
            if args.only and name not in args.only:
                continue
            if model is not None and not (work / model).exists():
                make_tiny(model.removeprefix("tiny-"), work / model, tokenizer)
            out[name] = convert(args.exe, work, None if model is None else str(work / model), argv)
        print(json.dumps(out, indent=2, sort_keys=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
