"""Decoding steps of the reference backend's in-flight batch: the batch-invariant step
(CheckpointRuntime.decode: GEMMs on fixed 8-row blocks, each sequence's attention over its own
cache) against the padded step it replaced (the caches left-padded and stacked into one forward,
then cut apart again), same model, same caches, same run.

    .venv/bin/python benchmarks/decode_batching.py [--device cpu|cuda] [--batches 1,8,32]
        [--steps 8] [--layers 30] [--dtype float16]

SmolLM2-135M-Instruct's shape with random weights (`--layers` fewer for a quick run), prompts
of 16 to 64 random tokens. Prints, per batch size, the milliseconds of one step and the tokens
per second of each way, their ratio, and how many sequences' logits equal, bit for bit, those
they get decoded alone.
"""

from __future__ import annotations

import argparse
import atexit
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_runtime import SMOLLM2  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from trt_builder.convert.floats import convert_checkpoint
    from trt_builder.modes import FloatMode
    from trt_builder.runtimes.checkpoint import CheckpointRuntime, KVCache

    work = Path(tempfile.mkdtemp(prefix="trt-builder-decode-"))
    atexit.register(shutil.rmtree, work, True)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**SMOLLM2, "num_hidden_layers": args.layers})).save_pretrained(
        work / "hf"
    )
    (work / "ck").mkdir()
    convert_checkpoint(work / "hf", work / "ck", FloatMode(args.dtype))
    runtime = CheckpointRuntime.load(work / "ck", args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    gpu = f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads{gpu}; SmolLM2-135M's shape, {args.layers} layers, "
          f"{args.dtype}; median step of {args.steps}")  # fmt: skip

    def prefilled(prompts: list[list[int]]) -> tuple[list[KVCache], list[int]]:
        caches = [KVCache() for _ in prompts]
        tokens = [int(runtime.forward(torch.tensor(p), c, last=True)[-1].argmax())
                  for p, c in zip(prompts, caches, strict=True)]  # fmt: skip
        return caches, tokens

    def padded_step(tokens: list[int], caches: list[KVCache]) -> torch.Tensor:
        """The step before batch invariance, as it was: stack, one forward, cut apart."""
        longest = max(c.length for c in caches)
        pads = [longest - c.length for c in caches]
        layers = len(caches[0].keys)
        keys = [torch.cat([F.pad(c.keys[i], (0, 0, p, 0)) for c, p in zip(caches, pads, strict=True)])
                for i in range(layers)]  # fmt: skip
        values = [torch.cat([F.pad(c.values[i], (0, 0, p, 0)) for c, p in zip(caches, pads, strict=True)])
                  for i in range(layers)]  # fmt: skip
        batch = KVCache(keys, values, torch.tensor(pads, device=keys[0].device))
        ids = torch.tensor([[t] for t in tokens])
        logits = runtime.forward(ids, batch)[:, -1]
        for row, (c, pad) in enumerate(zip(caches, pads, strict=True)):
            c.keys = [k[row : row + 1, :, pad:] for k in batch.keys]
            c.values = [v[row : row + 1, :, pad:] for v in batch.values]
        return logits

    generator = torch.Generator().manual_seed(1)
    for b in (int(x) for x in args.batches.split(",")):
        lengths = torch.randint(16, 65, (b,), generator=generator).tolist()
        prompts = [torch.randint(0, SMOLLM2["vocab_size"], (n,), generator=generator).tolist()
                   for n in lengths]  # fmt: skip
        alone = [prefilled([p]) for p in prompts]
        reference = [runtime.decode(t, c)[0].cpu() for c, t in alone]  # each one's first step
        figures = {}
        for name, step in (("invariant", runtime.decode), ("padded", padded_step)):
            caches, tokens = prefilled(prompts)
            first = step(tokens, caches).cpu()
            same = sum(torch.equal(first[r], reference[r]) for r in range(b))
            times = []
            for _ in range(args.steps):
                sync()
                start = time.perf_counter()
                step(tokens, caches)
                sync()
                times.append(time.perf_counter() - start)
            figures[name] = (statistics.median(times), same)
        (new, new_same), (old, old_same) = figures["invariant"], figures["padded"]
        print(f"batch {b:3d}: invariant {new * 1e3:7.1f} ms/step ({b / new:7.1f} tok/s), "
              f"padded {old * 1e3:7.1f} ms/step ({b / old:7.1f} tok/s), invariant/padded "
              f"{old / new:.2f}x tokens/s; logits equal to alone: invariant {new_same}/{b}, "
              f"padded {old_same}/{b}")  # fmt: skip


if __name__ == "__main__":
    main()
