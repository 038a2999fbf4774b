"""The load-test sweep of docs/benchmarks.md, on this host's CPU or GPU: one model's float16 and
int8 (SmoothQuant) repositories with in-flight batching, and float16 one request at a time
(`max_batch_size` 1), each served by a real tritonserver with trt-builder's reference backend
(PyTorch, on the GPU where there is one; not TensorRT-LLM) and swept over concurrency by
`trt-builder bench`; then `bench --compare`: int8 against float16, in-flight batching against
one request at a time. `--only fp8,fp8-llmapi`: the fp8 engine target's repository against the
fp8 `--target llmapi` one (the llmapi contract: text in, the whole text so far in each streamed
response), compared.

    python benchmarks/bench_sweep.py [--model DIR | --synthetic TOKENIZER_DIR]
        [--layers 30] [--concurrency 1,2,4,8] [--requests 12] [--repeats 2] [--output-tokens 32]
        [--only NAME,...] [--work DIR] [--out DIR]

--model: a local model directory; default, the embedded default model (SmolLM2-135M-Instruct).
--synthetic: SmolLM2-135M's shape with random weights (seed 0) and the tokenizer given (a
directory with tokenizer.json), for a host without the default model's GGUF reader; its answers
are noise, so verify's gates are opened, and every answer is --output-tokens long (bench
--ignore-eos; also with --ignore-eos for any model). Needs tritonserver (`trt-builder[serve]`
or the NGC container's) and aiperf (`scripts/setup.sh --bench` or TRT_BUILDER_AIPERF). Prints
each build's points and the comparisons; writes each bench's JSON and HTML page, and the
comparisons', into --out. --only builds and benches some of the five (float16, int8,
float16-batch1 by default; fp8, fp8-llmapi); a comparison whose other side is not run is made from that build's JSON already
in --out (an earlier run's, on the same kind of host), and says so. The work directory (models,
engines, repositories) is removed afterwards unless given.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _cli import executable, synthetic_llama, timed

#: SmolLM2-135M-Instruct's shape (its config.json); the weights are random.
SMOLLM2_135M = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "hidden_act": "silu",
    "tie_word_embeddings": True, "architectures": ["LlamaForCausalLM"],
}  # fmt: skip
#: (name, trt-builder build flags): the three repositories the sweep serves.
BUILDS = (
    ("float16", ["--dtype", "float16"]),
    ("int8", ["--dtype", "int8"]),
    ("float16-batch1", ["--dtype", "float16", "--max-batch-size", "1"]),
    ("fp8", ["--dtype", "fp8"]),
    ("fp8-llmapi", ["--dtype", "fp8", "--target", "llmapi"]),
)
#: What runs unless --only says otherwise (the fp8 pair: --only fp8,fp8-llmapi).
DEFAULT = ("float16", "int8", "float16-batch1")
COMPARISONS = (("int8-vs-float16", "float16", "int8"),
               ("batching-vs-batch1", "float16-batch1", "float16"),
               ("llmapi-vs-engine", "fp8", "fp8-llmapi"))  # fmt: skip


def device() -> str:
    import torch

    return f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path)
    source.add_argument("--synthetic", type=Path, metavar="TOKENIZER_DIR")
    parser.add_argument("--layers", type=int, default=30, help="--synthetic's layers.")
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--only", default=",".join(DEFAULT))
    parser.add_argument("--work", type=Path)
    parser.add_argument("--out", type=Path, default=Path("bench-sweep"))
    args = parser.parse_args()

    work: Path = (args.work or Path(tempfile.mkdtemp(prefix="trt-builder-sweep-"))).resolve()
    if args.work is None:
        atexit.register(shutil.rmtree, work, True)
    work.mkdir(parents=True, exist_ok=True)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = ["--model", str(args.model.resolve())] if args.model else []
    bench_flags = ["--concurrency", args.concurrency, "--requests", str(args.requests),
                   "--repeats", str(args.repeats), "--warmup", "2",
                   "--output-tokens", str(args.output_tokens)]  # fmt: skip
    build_flags = ["--config", str(work / "streaming.toml")]
    if args.synthetic:
        start = time.perf_counter()
        synthetic_llama(
            work / "synthetic", args.synthetic, {**SMOLLM2_135M, "num_hidden_layers": args.layers}
        )
        print(f"wrote SmolLM2-135M's shape, random weights, in {time.perf_counter() - start:.1f} s")
        model = ["--model", str(work / "synthetic")]
        # random weights give near-flat logits: agreement with the float model means nothing
        build_flags += ["--min-top1", "0", "--max-kl", "1000", "--max-ppl-delta", "1000"]
    if args.synthetic or args.ignore_eos:
        bench_flags.append("--ignore-eos")
    (work / "streaming.toml").write_text("[triton]\nstreaming = true\n")
    found = Path(executable())
    exe = [str(found)] if found.is_file() else [sys.executable, "-m", "trt_builder.cli.main"]
    env_note = f"{device()}; trt-builder bench {' '.join(bench_flags)}"
    print(env_note, flush=True)

    repositories: dict[str, str] = {}
    only = set(args.only.split(","))
    if not only <= {name for name, _ in BUILDS}:
        parser.error(f"--only takes {', '.join(name for name, _ in BUILDS)}")
    if "--ignore-eos" in bench_flags and "fp8-llmapi" in only:
        parser.error("the llmapi model has no input that ignores the end token: fp8-llmapi "
                     "cannot run with --synthetic or --ignore-eos")  # fmt: skip
    for name, flags in [(n, f) for n, f in BUILDS if n in only]:
        seconds, stdout = timed([*exe, "build", *model, *flags, *build_flags, "--out",
                                 str(work / "engines"), "--triton-root",
                                 str(work / f"triton-{name}"), "--json"], work)  # fmt: skip
        package = next(s for s in json.loads(stdout)["stages"] if s["name"] == "package")
        repositories[name] = str((work / package["output"]).resolve())
        print(f"built {name} in {seconds:.0f} s", flush=True)

    figures: dict[str, dict[str, object]] = {}
    for name, repository in repositories.items():
        seconds, _ = timed([*exe, "bench", repository, *bench_flags,
                            "--out", str(out / f"{name}.json")], work)  # fmt: skip
        result = json.loads((out / f"{name}.json").read_text())
        figures[name] = {
            "served_by": result["serving"],
            "points": {f"{p['mode']} {p['load']:g}": {k: s["mean"] for k, s in p["summary"].items()}
                       for p in result["points"]},
        }  # fmt: skip
        print(f"\n{name} ({seconds:.0f} s; {result['serving'].get('implementation')}):")
        print(
            f"{'load':16s}{'tok/s':>10s}{'req/s':>8s}{'TTFT p50':>10s}{'ITL p50':>9s}{'errors':>8s}"
        )
        for load, f in figures[name]["points"].items():  # type: ignore[union-attr]
            print(f"{load:16s}{f['output_token_throughput']:10.1f}{f['request_throughput']:8.2f}"
                  f"{f['ttft_ms.p50']:10.0f}{f['itl_ms.p50']:9.1f}{f['errors']:8.0f}")  # fmt: skip
    for label, a, b in COMPARISONS:
        target = out / f"{label}.json"
        if not ((out / f"{a}.json").is_file() and (out / f"{b}.json").is_file()):
            print(f"\n{label}: not compared ({a} or {b} was neither run nor in {out})")
            continue
        earlier = [n for n in (a, b) if n not in only]
        timed([*exe, "bench", "--compare", str(out / f"{a}.json"), str(out / f"{b}.json"),
               "--out", str(target)], work)  # fmt: skip
        rows = json.loads(target.read_text())["comparison"]
        note = f"; {', '.join(earlier)} from an earlier run's JSON" if earlier else ""
        print(f"\n{label} (B = {b} against A = {a}{note}):")
        for r in rows:
            if r["metric"] in ("output_token_throughput", "ttft_ms.p50", "itl_ms.p50"):
                ratio = "–" if r["ratio"] is None else f"{r['ratio']:.2f}x"
                print(f"  {r['mode']} {r['load']:g} {r['metric']}: {ratio} ({r['verdict']})")
    (out / "sweep.json").write_text(json.dumps({"device": device(), "bench": bench_flags,
                                                "builds": figures}, indent=2) + "\n")  # fmt: skip
    print(f"\nwrote {out}/: each build's bench JSON and HTML, the comparisons, sweep.json")


if __name__ == "__main__":
    main()
