"""`trt-builder build --dtype int8` on the GPU at the size users build, against nvidia-modelopt
0.47's INT8 SmoothQuant `quantize` plus `export_tensorrt_llm_checkpoint`, same model, same
calibration data, same run.

    python benchmarks/int8_build_gpu.py --tokenizer DIR [--layers 32] [--work DIR]

Needs a CUDA GPU and nvidia-modelopt 0.47 (a test-only dependency, never the product's). The
model: Llama-2-7B's shape (hidden 4096, 32 layers, 32 heads, intermediate 11008) with random
bfloat16 weights from a fixed seed, written once as a local model directory, with the
vocabulary of the tokenizer given (`--tokenizer`, a directory with tokenizer.json; SmolLM2's
49152 tokens in the recorded run, for 32000). The build runs as a user runs it, in a child
process: `trt-builder build --model DIR --dtype int8 --calib-device cuda --device cuda`; each
stage's time and peak GPU memory come from its record. modelopt runs on the model loaded on
the GPU, its forward loop over the very samples calibrate used. Exits 1 when calibrate, recipe
and convert together take more than 1.5x modelopt's quantize plus export, or the whole build
more than 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _cli import synthetic_llama

LLAMA2_7B = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"],
}  # fmt: skip
GIB = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--work", type=Path, default=Path("/tmp/int8-build-gpu"))
    parser.add_argument("--report", type=Path, help="Also write the figures here (JSON).")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    work: Path = args.work
    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        start = time.perf_counter()
        synthetic_llama(
            model_dir, args.tokenizer, {**LLAMA2_7B, "num_hidden_layers": args.layers}, "cuda"
        )
        print(f"wrote the synthetic model in {time.perf_counter() - start:.1f} s", flush=True)
    out = work / "engines"
    shutil.rmtree(out, ignore_errors=True)
    exe = shutil.which("trt-builder")
    cli = [exe] if exe else [sys.executable, "-m", "trt_builder.cli.main"]  # not installed
    command = [*cli, "build", "--model", str(model_dir), "--dtype", "int8", "--calib-device",
               "cuda", "--device", "cuda", "--out", str(out), "--triton-root",
               str(work / "triton"), "--json",
               # random weights give near-flat logits: top-1 agreement means nothing there
               "--min-top1", "0", "--max-kl", "1000", "--max-ppl-delta", "1000"]  # fmt: skip
    # what a fresh process pays to import torch and transformers' Llama (the build's first
    # stage that needs them pays it too; modelopt's figures below leave it out)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers.models.llama.modeling_llama"],
                   check=True, env=os.environ)  # fmt: skip
    import_s = time.perf_counter() - start
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=os.environ)
    build_s = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-4000:])
        sys.exit(f"the build failed (exit {proc.returncode})")
    result = json.loads(proc.stdout)
    stages = {s["name"]: s for s in result["stages"]}
    steps = {
        name: {
            "status": s["status"],
            "seconds": round(s["seconds"], 2),
            "peak_gpu_gib": round(s["details"]["peak_gpu_bytes"] / GIB, 2)
            if s["details"].get("peak_gpu_bytes")
            else None,
        }
        for name, s in stages.items()
    }
    ours = sum(stages[n]["seconds"] for n in ("calibrate", "recipe", "convert"))
    recipe = json.loads((Path(stages["recipe"]["output"]) / "recipe.json").read_text())

    # modelopt on the same model and the same calibration samples
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trt_builder.calibrate.corpus import load_texts, make_samples
    from trt_builder.spec.build import CalibrationOptions

    options = CalibrationOptions()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = make_samples(tokenizer, load_texts(options.dataset)[0], options)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    batches = [ids[i : i + options.batch_size] for i in range(0, len(ids), options.batch_size)]

    def forward_loop(m: torch.nn.Module) -> None:
        for batch in batches:
            m(batch.cuda(), use_cache=False)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        mtq.quantize(model, mtq.INT8_SMOOTHQUANT_CFG, forward_loop)
    torch.cuda.synchronize()
    quantize_s = time.perf_counter() - start
    quantize_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        export_tensorrt_llm_checkpoint(model, "llama", torch.float16, work / "modelopt",
                                       inference_tensor_parallel=1)  # fmt: skip
    export_s = time.perf_counter() - start
    export_peak = torch.cuda.max_memory_allocated()
    theirs = quantize_s + export_s
    shutil.rmtree(work / "modelopt", ignore_errors=True)

    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": f"Llama-2-7B shape, {args.layers} layers, vocabulary {len(tokenizer)}, bfloat16",
        "build_wall_s": round(build_s, 2),
        "import_torch_transformers_s": round(import_s, 2),
        "steps": steps,
        "recipe": {k: recipe[k] for k in ("chosen", "alpha", "tokens", "device", "seconds")},
        "candidates": [
            {k: c[k] for k in ("name", "kl", "kl_se", "ppl_delta_pct", "top1", "windows")}
            for c in recipe["candidates"]
        ],  # fmt: skip
        "calibrate_recipe_convert_s": round(ours, 2),
        "modelopt_model_load_s": round(load_s, 2),
        "modelopt_quantize_s": round(quantize_s, 2),
        "modelopt_quantize_peak_gib": round(quantize_peak / GIB, 2),
        "modelopt_export_s": round(export_s, 2),
        "modelopt_export_peak_gib": round(export_peak / GIB, 2),
        "ratio": round(ours / theirs, 3),
    }
    print(json.dumps(report, indent=1))
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=1) + "\n")
    missed = []
    if ours > 1.5 * theirs:
        missed.append(
            "calibrate + recipe + convert take more than 1.5x modelopt's quantize + export"
        )
    if build_s > 120:
        missed.append("the whole build takes more than 2 minutes")
    for line in missed:
        print(f"GOAL MISSED: {line}")
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
