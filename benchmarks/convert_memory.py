"""Convert a synthetic Llama-2-7B-shaped bfloat16 checkpoint (~13.5 GB, generated shard by shard)
to float16 at TP=1 and TP=2; report peak RSS and wall time against a plain copy of the same
input bytes, measured in the same run.

    .venv/bin/python benchmarks/convert_memory.py [--workdir DIR] [--layers 32] [--keep]

Needs about 2 x 13.5 GB of free disk in --workdir (input plus one output at a time).
"""

from __future__ import annotations

import argparse
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

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def generate(root: Path, layers: int) -> int:
    """Write the checkpoint one layer per shard; returns the bytes written."""
    import torch
    from safetensors.torch import save_file

    cfg = {**LLAMA2_7B, "num_hidden_layers": layers}
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    count = layers + 2

    def save(i: int, shard: dict[str, torch.Tensor]) -> None:  # one shard in memory at a time
        save_file(
            shard,
            str(root / f"model-{i:05d}-of-{count:05d}.safetensors"),
            metadata={"format": "pt"},
        )

    save(0, {"model.embed_tokens.weight": rand(vocab, h)})
    for i in range(layers):
        p = f"model.layers.{i}."
        save(i + 1, {
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(h, h),
            p + "self_attn.v_proj.weight": rand(h, h), p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })  # fmt: skip
    save(
        count - 1,
        {
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
            "lm_head.weight": rand(vocab, h),
        },
    )
    return sum(p.stat().st_size for p in root.glob("*.safetensors"))


def plain_copy(src: Path, dst: Path) -> float:
    dst.mkdir()
    start = time.perf_counter()
    for path in sorted(src.glob("*.safetensors")):
        shutil.copyfile(path, dst / path.name)
    os.sync()
    seconds = time.perf_counter() - start
    shutil.rmtree(dst)
    return seconds


# The child reports its own VmHWM: ru_maxrss would include the parent's RSS at fork, which
# Linux carries over exec (the generator's tensors, here).
CONVERT = (
    "import re, sys; from pathlib import Path; from trt_builder.convert.floats import convert_checkpoint; "
    "from trt_builder.modes import FloatMode; out = Path(sys.argv[2]); out.mkdir(); "
    "convert_checkpoint(Path(sys.argv[1]), out, FloatMode('float16'), tp=int(sys.argv[3])); "
    "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
)


def convert(src: Path, dst: Path, tp: int) -> tuple[float, float]:
    """(wall seconds including the final sync, peak RSS GiB) of a conversion in a child process."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CONVERT, str(src), str(dst), str(tp)], capture_output=True, text=True
    )
    os.sync()
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"conversion at TP={tp} failed: {proc.stderr[-2000:]}")
    shutil.rmtree(dst)
    return seconds, int(proc.stdout.split()[-1]) / (1 << 20)  # VmHWM is in KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    parser.add_argument("--repeats", type=int, default=5, help="alternating copy/convert rounds")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="trt-builder-7b-"))
    src = work / "llama2-7b-synthetic"
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / (1 << 30):.0f} GiB RAM"
    )
    if not (src / "config.json").is_file():
        start = time.perf_counter()
        size = generate(src, args.layers)
        print(
            f"generated {size / 1e9:.2f} GB of bfloat16 weights in {time.perf_counter() - start:.0f} s"
        )
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    # The disk is shared and noisy: alternate copy and conversions, and compare medians.
    copies: list[float] = []
    runs: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    for _ in range(args.repeats):
        copies.append(plain_copy(src, work / "copy"))
        for tp in runs:
            runs[tp].append(convert(src, work / f"tp{tp}", tp))
    copy = statistics.median(copies)
    print(f"plain copy of the input ({size / 1e9:.2f} GB, shutil.copyfile + sync): "
          f"{', '.join(f'{c:.1f}' for c in copies)} s; median {copy:.1f} s")  # fmt: skip
    failed = []
    for tp, results in runs.items():
        seconds = statistics.median(r[0] for r in results)
        rss = max(r[1] for r in results)
        if seconds > 1.5 * copy or rss > 2.0:
            failed.append(f"TP={tp}")
        print(
            f"convert bfloat16 -> float16, TP={tp}: {', '.join(f'{r[0]:.1f}' for r in results)} s; "
            f"median {seconds:.1f} s = {seconds / copy:.2f} x copy; peak RSS {rss:.2f} GiB"
        )
    if failed:  # the goals: peak RSS <= 2 GiB, wall time <= 1.5 x the copy
        print(f"GOAL MISSED for {', '.join(failed)}: peak RSS <= 2 GiB and <= 1.5 x copy")
    if not args.keep:
        shutil.rmtree(src)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
