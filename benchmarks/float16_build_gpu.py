"""`trt-builder build --dtype float16` on the GPU at the size users build: a first build of a
Llama-2-7B-shaped model, as a user runs it, with each stage's time and verify's by part.

    python benchmarks/float16_build_gpu.py --tokenizer DIR [--layers 32] [--work DIR]

Needs a CUDA GPU. The model: Llama-2-7B's shape with random bfloat16 weights from a fixed seed
and the vocabulary of `--tokenizer` (written once under `--work`, shared with
int8_build_gpu.py). The build runs in a child process: `trt-builder build --model DIR --dtype
float16 --device cuda`. Exits 1 when the whole build takes more than 60 s or verify more than
20 s.
"""

from __future__ import annotations

import json
import sys

from _cli import gpu_build, gpu_build_args


def main() -> None:
    args = gpu_build_args(__doc__)

    import torch

    built = gpu_build(args.work, args.tokenizer, args.layers, ["--dtype", "float16"])
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": f"Llama-2-7B shape, {args.layers} layers, bfloat16 source, float16 build",
        **{
            k: built[k]
            for k in ("build_wall_s", "import_torch_transformers_s", "steps", "verify_by_part")
        },  # fmt: skip
    }
    print(json.dumps(report, indent=1))
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=1) + "\n")
    missed = []
    if built["build_wall_s"] > 60:
        missed.append("the whole build takes more than 60 s")
    if built["steps"]["verify"]["seconds"] > 20:
        missed.append("verify takes more than 20 s")
    for line in missed:
        print(f"GOAL MISSED: {line}")
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
