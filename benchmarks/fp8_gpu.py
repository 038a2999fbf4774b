"""FP8 on a CUDA GPU: the checkpoint runtime's tensor-core GEMMs (torch._scaled_mm) against its
CPU simulation, next to the float16 checkpoint's CUDA-vs-CPU agreement (the noise floor of the
other kernels) and FP8 against float16. A random Llama of SmolLM2-135M's width; `--std` sets
its initializer range (a larger one gives peaked logits, as a trained model has).

    python benchmarks/fp8_gpu.py --layers 4 --std 0.02 0.2
    python benchmarks/fp8_gpu.py --dtype w4a8-awq   # W4A8 AWQ: its FP8 GEMM on the tensor cores
    python benchmarks/fp8_gpu.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf   # the default model

With `--gguf` it runs the default model instead (fetched from the GGUF as `build` fetches it,
calibrated, searched and converted on CUDA as `build --dtype fp8 --kv-cache fp8` does, and as
`--no-fp8-search` does) on verify's held-out text, and verifies the FP8 checkpoints on CUDA and
on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _agree(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def main() -> None:
    from tiny_models import make_tiny_llama, make_tokenizer
    from trt_builder.calibrate.stats import calibrate
    from trt_builder.convert.model import convert_model
    from trt_builder.modes import FloatMode, Fp8, W4a8Awq
    from trt_builder.runtimes.checkpoint import CheckpointRuntime
    from trt_builder.spec.build import CalibrationOptions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--std", type=float, nargs="+", default=[0.02, 0.2])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument(
        "--dtype",
        choices=("fp8", "w4a8-awq"),
        default="fp8",
        help="w4a8-awq: SmolLM2's padded twin's widths (multiples of 128)",
    )
    args = parser.parse_args()
    if args.gguf:
        default_model(args.gguf)
        return
    with tempfile.TemporaryDirectory(prefix="fp8-gpu-") as tmp:
        root = Path(tmp)
        make_tokenizer(root / "tok")
        for std in args.std:
            work = root / f"std{std}"
            heads = (9, 3) if args.dtype == "fp8" else (12, 4)  # W4A8: group 128 divides 768
            make_tiny_llama(work / "hf", root / "tok", hidden_size=heads[0] * 64,
                            intermediate_size=1536, num_attention_heads=heads[0],
                            num_key_value_heads=heads[1], head_dim=64,
                            num_hidden_layers=args.layers, initializer_range=std)  # fmt: skip
            (work / "cal").mkdir()
            calibrate(work / "hf", work / "cal", CalibrationOptions(samples=8, seq_len=64))
            cks = {}
            quantized = Fp8(kv_cache="fp8", search=False) if args.dtype == "fp8" else W4a8Awq()
            for name, mode in ((args.dtype, quantized), ("float16", FloatMode("float16"))):
                cks[name] = work / name
                cks[name].mkdir()
                convert_model(mode, work / "hf", cks[name], tp=1, pp=1, calibration=work / "cal")
            gen = torch.Generator().manual_seed(3)
            ids = torch.randint(3, 380, (args.prompts, args.tokens), generator=gen)
            out: dict[tuple[str, str], torch.Tensor] = {}
            for name, ck in cks.items():
                for device in ("cpu", "cuda"):
                    runtime = CheckpointRuntime.load(ck, device)
                    start = time.perf_counter()
                    out[name, device] = runtime.forward(ids.to(device)).cpu()
                    elapsed = time.perf_counter() - start
                    print(f"std {std} {name} {device}: forward {elapsed:.3f} s", flush=True)
            n = ids.numel()
            print(f"std {std}: teacher-forced top-1 over {n} positions: "
                  f"{args.dtype} cuda vs cpu {_agree(out[args.dtype, 'cuda'], out[args.dtype, 'cpu']):.4f}; "
                  f"float16 cuda vs cpu {_agree(out['float16', 'cuda'], out['float16', 'cpu']):.4f}; "
                  f"{args.dtype} vs float16 (cpu) {_agree(out[args.dtype, 'cpu'], out['float16', 'cpu']):.4f}",
                  flush=True)  # fmt: skip


def default_model(gguf: Path) -> None:
    from safetensors.torch import save_file

    from trt_builder.calibrate.corpus import corpus_windows
    from trt_builder.calibrate.stats import calibrate
    from trt_builder.convert.model import convert_model
    from trt_builder.modes import Fp8, gate_for
    from trt_builder.modes.fp8.recipe.search import WEIGHTS, search_fp8
    from trt_builder.modes.fp8.spec import Fp8SearchSet
    from trt_builder.runtimes.checkpoint import CheckpointRuntime
    from trt_builder.runtimes.fp8 import fp8_kernel_runs as real_runs
    from trt_builder.source.fetch import fetch_gguf
    from trt_builder.source.hf import load_tokenizer
    from trt_builder.spec.build import CalibrationOptions
    from trt_builder.verify.compare import verify_checkpoint

    with tempfile.TemporaryDirectory(prefix="fp8-gpu-") as tmp:
        root = Path(tmp)
        (root / "hf").mkdir()
        start = time.perf_counter()
        fetch_gguf(gguf.resolve(), root / "hf")
        (root / "cal").mkdir()
        calibrate(root / "hf", root / "cal", CalibrationOptions(device="cuda"))
        print(f"fetch + calibrate: {time.perf_counter() - start:.1f} s", flush=True)
        start = time.perf_counter()
        recipe, tensors = search_fp8(root / "hf", root / "cal", Fp8SearchSet(), device="cuda",
                                     offload=root / "offload")  # fmt: skip
        (root / "recipe").mkdir()
        save_file(tensors, str(root / "recipe" / WEIGHTS))
        (root / "recipe" / "recipe.json").write_text(json.dumps(recipe))
        print(f"recipe on CUDA: {time.perf_counter() - start:.1f} s, chose {recipe['chosen']}: "
              + "; ".join(f"{c['name']} KL {c['kl']:.4f} top-1 {c['top1']:.4f}"
                          for c in recipe["candidates"]), flush=True)  # fmt: skip
        for name, mode in (
            ("ck", Fp8(kv_cache="fp8")),
            ("nosearch", Fp8(kv_cache="fp8", search=False)),
        ):
            (root / name).mkdir()
            convert_model(mode, root / "hf", root / name, tp=1, pp=1, calibration=root / "cal",
                          recipe=root / "recipe" / "recipe.json")  # fmt: skip
        windows = corpus_windows(load_tokenizer(root / "hf", "the model"), 2048)
        ids = torch.tensor(windows)
        import trt_builder.runtimes.checkpoint as checkpoint_module
        import trt_builder.runtimes.fp8 as fp8_module

        out = {}
        for label, device, kernel in (("cuda", "cuda", True), ("cuda-simulated", "cuda", False),
                                      ("cpu", "cpu", False)):  # fmt: skip
            # the simulation on the GPU too: tells the tensor cores' sums from other kernels'
            runs = (lambda _d: True) if kernel else (lambda _d: False)
            checkpoint_module.fp8_kernel_runs = fp8_module.fp8_kernel_runs = runs  # type: ignore[assignment]
            runtime = CheckpointRuntime.load(root / "ck", device)
            start = time.perf_counter()
            out[label] = torch.cat([runtime.forward(ids[i : i + 2].to(device)).cpu()
                                    for i in range(0, len(ids), 2)])  # fmt: skip
            print(f"{label}: teacher-forced forward of {ids.numel()} tokens "
                  f"{time.perf_counter() - start:.2f} s", flush=True)  # fmt: skip
        checkpoint_module.fp8_kernel_runs = fp8_module.fp8_kernel_runs = real_runs
        for a, b in (("cuda", "cpu"), ("cuda-simulated", "cpu"), ("cuda", "cuda-simulated")):
            print(f"default model fp8 + FP8 KV: teacher-forced top-1 {a} vs {b} over "
                  f"{ids.numel()} held-out positions: {_agree(out[a], out[b]):.4f}; max |logit "
                  f"difference| {float((out[a] - out[b]).abs().max()):.3f}", flush=True)  # fmt: skip
        for name, device in (("ck", "cuda"), ("ck", "cpu"), ("nosearch", "cuda")):
            report = verify_checkpoint(root / name, root / "hf", gate=gate_for("fp8-fp8kv"),
                                       device=device)  # fmt: skip
            print(f"verify of {name} on {device}: passed {report['passed']}, top-1 {report['top1']:.4f}, "
                  f"KL {report['kl_mean']:.4f}, perplexity {report['perplexity']['delta_pct']:+.2f}% "
                  f"(decoded from {report['perplexity'].get('decoded_from')}), "
                  f"{report['seconds']} s {report['seconds_by_part']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
