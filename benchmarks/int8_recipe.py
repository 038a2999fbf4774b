"""Every INT8 recipe step on SmolLM2-135M-Instruct, measured on held-out text: perplexity
increase and top-1 agreement against the float32 transformers model, teacher-forced, and for
the INT8 KV cache also token by token through the cache (where its error shows).

    .venv/bin/python benchmarks/int8_recipe.py [--hf DIR] [--tokens 8192]

The held-out text (`trt_builder/calibrate/data/heldout.jsonl`) is used neither for calibration nor for the
alpha search. Checks the goals of the INT8 work: SmolLM2 `int8` perplexity +1.5% at most and
top-1 94% at least with every linear but lm_head in INT8; `int8-wo` +0.6% at most; the INT8 KV
cache adds 0.5 percentage point at most on either. Exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from _cli import held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", type=Path)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from trt_builder.calibrate.stats import calibrate
    from trt_builder.convert.floats import convert_checkpoint
    from trt_builder.modes import SmoothQuant, WeightOnlyInt8
    from trt_builder.modes.smoothquant.convert import convert_smoothquant
    from trt_builder.modes.smoothquant.recipe.search import search
    from trt_builder.modes.smoothquant.spec import SearchSet
    from trt_builder.runtimes.checkpoint import CheckpointRuntime
    from trt_builder.spec.build import CalibrationOptions

    work, hf, ids = held_out(args.hf, args.tokens, "trt-builder-int8-")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.cat([model(ids[i : i + 8]).logits.float() for i in range(0, len(ids), 8)])
    del model
    prefix = 32

    def figures(logits: torch.Tensor, start: int = 0) -> dict[str, float]:
        target = ids[:, start + 1 :]
        lc = torch.log_softmax(logits[:, start:-1].double(), -1).gather(-1, target[..., None])
        lr = torch.log_softmax(ref[:, start:-1].double(), -1).gather(-1, target[..., None])
        ppl = 100.0 * (math.exp(float(lr.mean() - lc.mean())) - 1.0)
        top1 = float((logits[:, start:].argmax(-1) == ref[:, start:].argmax(-1)).double().mean())
        return {"ppl_delta_pct": ppl, "top1": top1}

    def teacher_forced(runtime: Any) -> torch.Tensor:
        return torch.cat([runtime.forward(ids[i : i + 8]) for i in range(0, len(ids), 8)])

    def decoded(runtime: Any) -> torch.Tensor:
        """Logits with every token after the first `prefix` fed one at a time through the KV
        cache (as generation reads it, and as verify decodes an INT8-KV-cache checkpoint)."""
        batches = [ids[i : i + 8] for i in range(0, len(ids), 8)]
        return torch.cat([runtime.forward_decoded(batch, prefix) for batch in batches])

    calibration = work / "calibration"
    calibration.mkdir()
    start = time.perf_counter()
    calibrate(hf, calibration, CalibrationOptions())
    print(f"calibration: 64 x 256 tokens of the bundled set, {time.perf_counter() - start:.0f} s")
    rows: dict[str, dict[str, float]] = {}

    def measure(name: str, ck: Path, *, decode: bool = False) -> None:
        runtime = CheckpointRuntime.load(ck)
        rows[name] = figures(teacher_forced(runtime))
        if decode:
            rows[name] |= {f"decode_{k}": v for k, v in figures(decoded(runtime), prefix).items()}
        print(f"{name}: {json.dumps({k: round(v, 4) for k, v in rows[name].items()})}", flush=True)

    def sq(name: str, mode: SmoothQuant, alphas: Any = None, **kw: Any) -> None:
        ck = work / name
        ck.mkdir()
        convert_smoothquant(hf, ck, mode, calibration, alphas=alphas)
        measure(name, ck, **kw)

    def record_layers(record: dict[str, Any]) -> dict[int, dict[str, float]]:
        return {int(k): v for k, v in record["alphas"].items()}

    for name, mode in (("int8-wo (W8A16)", WeightOnlyInt8()),
                       ("int8-wo + INT8 KV cache", WeightOnlyInt8(kv_cache="int8"))):  # fmt: skip
        ck = work / name
        ck.mkdir()
        convert_checkpoint(hf, ck, mode, calibration=calibration)
        measure(name, ck, decode=True)
    sq("plain: per-tensor static, alpha 0.5", SmoothQuant(0.5, per_token=False))
    for alpha in (0.4, 0.5, 0.6, 0.7, 0.8):
        sq(f"per-token, alpha {alpha}", SmoothQuant(alpha))
    record = search(hf, calibration, SearchSet(), device="cpu", offload=work / "offload")
    alpha, per_layer = float(record["alpha"]), record_layers(record)
    print(f"search (search split, {record['tokens']} tokens, {record['seconds']} s): "
          f"{json.dumps(record['candidates'])} -> {record['chosen']}")  # fmt: skip
    print(f"alphas per layer: {json.dumps(record['alphas'])}")
    name = f"int8 default: the search's choice ({record['chosen']})"
    sq(name, SmoothQuant(alpha), alphas=per_layer, decode=True)
    sq("int8 + INT8 KV cache", SmoothQuant(alpha, kv_cache="int8"), alphas=per_layer, decode=True)

    chosen, kv = rows[name], rows["int8 + INT8 KV cache"]
    wo, wo_kv = rows["int8-wo (W8A16)"], rows["int8-wo + INT8 KV cache"]
    missed = []
    if chosen["ppl_delta_pct"] > 1.5 or chosen["top1"] < 0.94:
        missed.append("int8: perplexity <= +1.5% and top-1 >= 94%")
    if wo["ppl_delta_pct"] > 0.6:
        missed.append("int8-wo: perplexity <= +0.6%")
    if kv["decode_ppl_delta_pct"] - chosen["decode_ppl_delta_pct"] > 0.5:
        missed.append("INT8 KV cache on int8: <= +0.5 percentage point")
    if wo_kv["decode_ppl_delta_pct"] - wo["decode_ppl_delta_pct"] > 0.5:
        missed.append("INT8 KV cache on int8-wo: <= +0.5 percentage point")
    print(json.dumps(rows))
    if missed:
        print("GOAL MISSED: " + "; ".join(missed))
        sys.exit(1)


if __name__ == "__main__":
    main()
