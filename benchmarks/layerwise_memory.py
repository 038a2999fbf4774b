"""Peak memory of `trt-builder calibrate` on a Llama-2-7B-shaped model at several depths: does it
grow with the number of decoder layers? (issue 43)

    .venv/bin/python benchmarks/layerwise_memory.py [--layers 4 8] [--samples 4] [--seq-len 128]
        [--before DIR] [--device cpu|cuda] [--work DIR] [--tokenizer DIR]

For each depth: a local model directory of Llama-2-7B's shape (hidden 4096, intermediate 11008,
32 heads) with that many decoder layers, random bfloat16 weights written tensor by tensor (the
whole model is never in memory here), SmolLM2's tokenizer and vocabulary (49152 tokens; `--tokenizer DIR` where the default model's
package is not installed, as on the GPU machine); then
`trt-builder fetch` and `trt-builder calibrate` on it as a user runs them, each in a child
process whose peak resident memory (ru_maxrss) is read when it ends, and the peak GPU memory
from the calibration's record on CUDA. `--before DIR` (a checkout of an earlier commit) runs
the same commands with that checkout's package, in the same run. The calibration set is
reduced (the default 4 samples x 128 tokens, stated in the output): the weights, not the
tokens, are what this measures. Prints a table; removes everything it wrote at exit.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _cli import GIB, LLAMA2_7B

#: Runs the CLI in this child and prints the child's own peak resident memory (VmHWM, KiB) as
#: the last line of stderr: ru_maxrss would carry the parent's peak over exec (the generator's
#: tensors, here; docs/benchmarks.md, convert_memory.py).
PEAK_RSS = (
    "import re, sys; from trt_builder.cli.main import main; code = main(sys.argv[1:]); "
    "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1), "
    "file=sys.stderr); sys.exit(code)"
)


def write_model(out: Path, tokenizer: Path, layers: int) -> float:
    """A Llama-2-7B-shaped model with `layers` decoder layers, random bfloat16 weights (std
    0.02, norms 1) from seed 0, written one tensor at a time into 2 GB shards; its GiB."""
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = LlamaConfig(**{**LLAMA2_7B, "num_hidden_layers": layers}, vocab_size=len(tok),
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    with init_empty_weights():
        shapes = {n: p.shape for n, p in LlamaForCausalLM(config).named_parameters()}
    out.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    shard: dict[str, Any] = {}
    weight_map: dict[str, str] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        shard[name] = tensor
        size += tensor.numel() * 2
        total += tensor.numel() * 2
        if size >= 2 * 10**9:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    tok.save_pretrained(out)
    return total / GIB


def measured(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, dict[str, Any]]:
    """(the peak RSS in GiB of `trt-builder ARGV` run in a child, its --json result)."""
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    kib = int(proc.stderr.strip().splitlines()[-1])
    return kib / (1 << 20), json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--before", type=Path, help="a checkout of an earlier commit")
    parser.add_argument("--work", type=Path, help="where to write (default: a temporary dir)")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: SmolLM2's)")
    args = parser.parse_args()

    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    work = args.work or Path(tempfile.mkdtemp(prefix="trt-builder-layerwise-"))
    atexit.register(shutil.rmtree, work, True)
    tokenizer = args.tokenizer or Path(
        run(make_spec(out=work / "default"), only=("fetch",)).layout.hf
    )
    versions = {"after": os.environ.copy()}
    if args.before is not None:  # the earlier checkout's package first on the path
        versions = {"before": {**os.environ, "PYTHONPATH": str(args.before.resolve())},
                    **versions}  # fmt: skip
    rows = []
    print(f"calibration: {args.samples} samples x {args.seq_len} tokens, --device {args.device}")
    for layers in args.layers:
        model = work / f"llama-7b-shape-{layers}"
        gib = write_model(model, tokenizer, layers)
        for version, env in versions.items():
            out = work / f"engines-{version}-{layers}"
            common = ["--model", str(model), "--out", str(out), "--dtype", "int8", "--json"]
            run_args = [*common, "--calib-samples", str(args.samples), "--calib-seq-len",
                        str(args.seq_len), "--calib-device", args.device]  # fmt: skip
            fetch_rss, _ = measured(["fetch", *common], work, env)
            rss, result = measured(["calibrate", *run_args], work, env)
            stage = next(s for s in result["stages"] if s["name"] == "calibrate")
            peak_gpu = stage["details"].get("peak_gpu_bytes")
            rows.append((layers, gib, version, fetch_rss, rss, stage["seconds"],
                         peak_gpu / GIB if peak_gpu else None))  # fmt: skip
            print(f"{layers} layers ({gib:.1f} GiB of weights), {version}: fetch peak RSS "
                  f"{fetch_rss:.2f} GiB; calibrate peak RSS {rss:.2f} GiB, "
                  f"{stage['seconds']:.1f} s", flush=True)  # fmt: skip
            shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(model, ignore_errors=True)
    print("\n| layers | weights | version | calibrate peak RSS | calibrate | peak GPU |")
    print("|---|---|---|---|---|---|")
    for layers, gib, version, _, rss, seconds, gpu in rows:
        gpu_text = f"{gpu:.2f} GiB" if gpu is not None else "-"
        print(
            f"| {layers} | {gib:.1f} GiB | {version} | {rss:.2f} GiB | {seconds:.1f} s | "
            f"{gpu_text} |"
        )


if __name__ == "__main__":
    main()
