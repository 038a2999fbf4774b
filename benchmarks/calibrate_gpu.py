"""Calibration time and peak GPU memory on a synthetic Llama-2-7B-shaped model, against
nvidia-modelopt's INT8 SmoothQuant `quantize` call on the same model and data, same run.

    python benchmarks/calibrate_gpu.py [--samples 512] [--seq-len 512] [--batch 16] [--layers 32]

Needs a CUDA GPU and nvidia-modelopt 0.47 (a test-only dependency, never the product's). The
model is random bfloat16 weights of Llama-2-7B's shape made on the GPU; the data is random token
ids from a fixed seed (the time does not depend on the values). Both calls are timed without
model loading: ours is `trt_builder.calibrate.stats.collect` (the statistics over the whole
model, which the calibrate stage's layer-by-layer pass gives to the bit), modelopt's is `mtq.quantize(model, INT8_SMOOTHQUANT_CFG, forward_loop)` (its
calibration and smoothing). Exits 1 if ours takes more than 1.2x modelopt's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

LLAMA2_7B = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trt_builder.calibrate.stats import collect
    from trt_builder.models.registry import family_for

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    config = LlamaConfig(**{**LLAMA2_7B, "num_hidden_layers": args.layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    weights = torch.cuda.memory_allocated()
    ids = torch.randint(0, config.vocab_size, (args.samples, args.seq_len),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    batches = [ids[i : i + args.batch] for i in range(0, args.samples, args.batch)]
    with torch.inference_mode():
        model(batches[0].cuda(), use_cache=False)  # warm-up: kernels, allocator
    torch.cuda.synchronize()

    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    stats = collect(model, ids, args.batch, family_for({"architectures": ["LlamaForCausalLM"]}))
    torch.cuda.synchronize()
    ours = time.perf_counter() - start
    ours_peak = torch.cuda.max_memory_allocated()

    import modelopt.torch.quantization as mtq

    def forward_loop(m: torch.nn.Module) -> None:
        for batch in batches:
            m(batch.cuda(), use_cache=False)

    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        mtq.quantize(model, mtq.INT8_SMOOTHQUANT_CFG, forward_loop)
    torch.cuda.synchronize()
    theirs = time.perf_counter() - start
    theirs_peak = torch.cuda.max_memory_allocated()

    gib = 1 << 30
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": f"Llama-2-7B shape, {args.layers} layers, bfloat16, {weights / gib:.2f} GiB of weights",
        "data": f"{args.samples} x {args.seq_len} tokens, batch {args.batch}",
        "linears": len(stats) // 2,
        "ours_s": round(ours, 2),
        "ours_peak_gib": round(ours_peak / gib, 2),
        "modelopt_s": round(theirs, 2),
        "modelopt_peak_gib": round(theirs_peak / gib, 2),
        "ratio": round(ours / theirs, 3),
    }
    print(json.dumps(result, indent=1))
    if ours > 1.2 * theirs:
        print("GOAL MISSED: calibration takes more than 1.2x modelopt's quantize")
        sys.exit(1)


if __name__ == "__main__":
    main()
