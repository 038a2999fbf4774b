"""Verify: compare a converted checkpoint, run by a runtime, with the transformers model."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..calibrate.corpus import corpus_windows
from ..checkpoint.reader import read_checkpoint
from ..checkpoint.safetensors_io import SafetensorsIndex
from ..checkpoint.weights import weight_files
from ..core.errors import InputError
from ..core.records import Records
from ..modes.kvcache.spec import kv_cache_of
from ..runtimes.checkpoint import CheckpointRuntime
from ..runtimes.scoring import kl, kl_reported, nll, nll_reported
from ..source.hf import end_ids, load_hf_model, load_tokenizer, pick_device
from ..spec.gates import Gate
from . import diagnose
from .diagnose import Finding
from .prompts import load_prompts
from .reference import RecordedReference


def encode_prompts(tokenizer: Any) -> list[tuple[str, list[int]]]:
    prompts = load_prompts()
    out = [(text, tokenizer(text).input_ids) for text in prompts["text"]]
    if tokenizer.chat_template:
        for turns in prompts["chat"]:
            ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
            ids = (
                ids["input_ids"] if hasattr(ids, "keys") else ids
            )  # a BatchEncoding in transformers 5
            out.append((turns[-1]["content"], list(ids)))
    return out


def _rel_error(cand: torch.Tensor, ref: torch.Tensor) -> float:
    """|cand - ref| / |ref|; a padded twin's wider hidden state (source/twin.py) against the
    model's channels, its added channels (zero in the twin) against zero."""
    ref = ref.float()
    if cand.shape[-1] > ref.shape[-1]:
        ref = torch.nn.functional.pad(ref, (0, cand.shape[-1] - ref.shape[-1]))
    return float((cand.float() - ref).norm() / ref.norm().clamp(min=1e-30))


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _scoring(candidate: Any) -> tuple[Any, Any, Any]:
    """(KL, NLL, max |error|) for what the candidate's forward gives: logits, or log-probabilities
    of the tokens it reports, -inf for the rest (`log_probabilities`: runtimes/vllm.py), whose
    error is taken in log-probability over those tokens."""
    if not getattr(candidate, "log_probabilities", False):
        return kl, nll, lambda ref, cand: float((ref - cand).abs().max())

    def error(ref: torch.Tensor, cand: torch.Tensor) -> float:
        diff = (torch.log_softmax(ref.double(), -1) - cand.double()).abs()
        return float(diff[torch.isfinite(cand)].max())

    return kl_reported, nll_reported, error


class _ByPosition:
    """KL and top-1 agreement summed by token position over all prompts."""

    def __init__(self) -> None:
        self.kl: list[float] = []
        self.hits: list[float] = []
        self.count: list[int] = []

    def add(self, kl: torch.Tensor, hits: torch.Tensor) -> None:
        for i, (k, h) in enumerate(zip(kl.tolist(), hits.tolist(), strict=True)):
            if i == len(self.kl):
                self.kl.append(0.0)
                self.hits.append(0.0)
                self.count.append(0)
            self.kl[i] += k
            self.hits[i] += h
            self.count[i] += 1

    def rows(self) -> list[dict[str, float]]:
        return [
            {"position": i, "kl_mean": k / n, "top1": h / n, "count": n}
            for i, (k, h, n) in enumerate(zip(self.kl, self.hits, self.count, strict=True))
        ]


def compare(
    reference: Any,
    candidate: Any,
    tokenizer: Any,
    stop: set[int],
    *,
    max_new_tokens: int,
    device: str,
    candidate_tokenizer: Any = None,
    pad_id: int = 0,
) -> dict[str, Any]:
    """Teacher-forced and greedy comparison of candidate with reference over the prompt set.

    Teacher-forced sequences are each prompt plus the reference's greedy continuation, run by
    both (token ids from the model's tokenizer); a runtime without teacher-forced logits
    (`teacher_forced` False) is compared on generation alone. The candidate generates for all prompts in one
    batch, from its own tokenizer's ids; texts are compared after decoding."""
    prompts = encode_prompts(tokenizer)
    teacher_forced = getattr(candidate, "teacher_forced", True)
    kl_of, _, error_of = _scoring(candidate)
    cand_tok = candidate_tokenizer or tokenizer
    cand_prompts = prompts if candidate_tokenizer is None else encode_prompts(candidate_tokenizer)
    cand_conts = candidate.greedy_batch(
        [ids for _, ids in cand_prompts], max_new_tokens, stop, pad_id
    )
    per_prompt = []
    positions = _ByPosition()
    layer_err: list[list[float]] = []
    agree = total = 0
    kl_sum = 0.0
    max_err = 0.0
    ref_conts = hf_greedy_batch(reference, [ids for _, ids in prompts], max_new_tokens, stop,
                                device, pad_id)  # fmt: skip
    for (text, ids), cand_cont, ref_cont in zip(prompts, cand_conts, ref_conts, strict=True):
        seq = torch.tensor(ids + ref_cont)
        ref_text = tokenizer.decode(ref_cont, skip_special_tokens=True)
        cand_text = cand_tok.decode(cand_cont, skip_special_tokens=True)
        row: dict[str, Any] = {"prompt": text[:80], "tokens": len(seq)}
        if teacher_forced:
            with torch.inference_mode():
                out = reference(seq[None].to(device), output_hidden_states=True)
            ref_logits = out.logits[0].float().cpu()
            hidden: list[torch.Tensor] = []
            cand_logits = candidate.forward(seq, hidden=hidden).cpu()
            ref_hidden = [h[0] for h in (out.hidden_states or ())]
            if hidden and len(ref_hidden) == len(hidden):
                # ours: after each layer, then the final norm; transformers': the embeddings,
                # after layers 0..L-2, then the final norm (applied to the last layer's output)
                pairs = [
                    *zip(hidden[:-2], ref_hidden[1:-1], strict=True),
                    (hidden[-1], ref_hidden[-1]),
                ]
                layer_err.append([_rel_error(c.cpu(), r.cpu()) for c, r in pairs])
            token_kl = kl_of(ref_logits, cand_logits)
            hits = ref_logits.argmax(-1) == cand_logits.argmax(-1)
            positions.add(token_kl, hits.double())
            row.update(
                top1=hits.double().mean().item(),
                kl_mean=token_kl.mean().item(),
                max_abs_logit_error=error_of(ref_logits, cand_logits),
            )
            agree += int(hits.sum())
            total += len(seq)
            kl_sum += token_kl.sum().item()
            max_err = max(max_err, row["max_abs_logit_error"])
        per_prompt.append(
            {
                **row,
                "greedy_match_tokens": _first_difference(ref_cont, cand_cont),
                "greedy_tokens": len(ref_cont),
                "text_match": ref_text == cand_text,
                "reference_text": ref_text,
                "candidate_text": cand_text,
                "reference_ended": bool(ref_cont) and ref_cont[-1] in stop,
                "candidate_ended": bool(cand_cont) and cand_cont[-1] in stop,
                "candidate_empty": len(cand_cont) == 0
                or (cand_cont[0] in stop and ref_cont[:1] != cand_cont[:1]),
            }
        )
    greedy_tokens = sum(p["greedy_tokens"] for p in per_prompt)
    by_layer = []
    if layer_err:
        n = len(layer_err[0])
        for i in range(n):
            row = {"layer": i, "rel_error": sum(e[i] for e in layer_err) / len(layer_err)}
            by_layer.append({**row, "final": True} if i == n - 1 else row)
    return {
        "top1": agree / total if total else None,
        "kl_mean": kl_sum / total if total else None,
        "max_abs_logit_error": max_err if total else None,
        "greedy_agreement": sum(p["greedy_match_tokens"] for p in per_prompt)
        / max(greedy_tokens, 1),
        "tokens": total,
        "prompts": per_prompt,
        "by_position": positions.rows(),
        "by_layer": by_layer,
    }


#: Held-out windows of an INT8-KV-cache checkpoint are decoded token by token after this many.
DECODED_FROM = 32


def perplexity(
    reference: Any,
    candidate: Any,
    windows: list[list[int]],
    *,
    device: str,
    batch: int = 8,
    decoded_from: int | None = None,
) -> dict[str, Any]:
    """Perplexity of both models on the held-out windows, with KL and top-1: teacher-forced, or
    with `decoded_from`, the candidate's tokens after that many fed one at a time through its
    KV cache (CheckpointRuntime.forward_decoded)."""
    ref_nll: list[torch.Tensor] = []
    cand_nll: list[torch.Tensor] = []
    kl_of, nll_of, error_of = _scoring(candidate)
    kl_sum = hits = count = 0.0
    max_err = 0.0
    for start in range(0, len(windows), batch):
        ids = torch.tensor(windows[start : start + batch])
        with torch.inference_mode():
            ref = reference(ids.to(device)).logits.float().cpu()
        if decoded_from is None:
            cand = candidate.forward(ids).cpu()
        else:
            cand = candidate.forward_decoded(ids, decoded_from).cpu()
        for row in range(ids.shape[0]):
            ref_nll.append(nll(ref[row], ids[row]))
            cand_nll.append(nll_of(cand[row], ids[row]))
            kl_sum += float(kl_of(ref[row], cand[row]).sum())
            hits += float((ref[row].argmax(-1) == cand[row].argmax(-1)).sum())
            count += ids.shape[1]
            max_err = max(max_err, error_of(ref[row], cand[row]))
    if not ref_nll:
        return {}
    ppl_ref = math.exp(float(torch.cat(ref_nll).mean()))
    ppl_cand = math.exp(float(torch.cat(cand_nll).mean()))
    return {
        "reference": ppl_ref,
        "candidate": ppl_cand,
        "delta_pct": 100.0 * (ppl_cand / ppl_ref - 1.0),
        "tokens": int(count),
        "top1": hits / count,
        "kl_mean": kl_sum / count,
        "max_abs_logit_error": max_err,
        "decoded_from": decoded_from,
    }


def hf_greedy_batch(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop: set[int],
    device: str,
    pad_id: int = 0,
) -> list[list[int]]:
    """The transformers model's greedy continuations of every prompt in one left-padded batch
    (one generate call: on 2 cores, ten one-prompt calls spent 9 s in generate's per-step
    overhead); each ends after its first end id."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(stop) or None,
            pad_token_id=pad_id,
        )
    conts = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        conts.append(row[:end])
    return conts


RUNTIMES = ("reference", "tensorrt-llm", "triton", "llmapi", "vllm")
#: Greedy agreement required of a runtime that gives no teacher-forced logits (an engine built
#: without --gather_context_logits, a Triton deployment), unless the gate sets one.
GREEDY_ONLY_MIN = 0.8

#: Opens the runtime under test, given the model's tokenizer (an engine, an llmapi checkpoint in
#: LLM() or a deployment; the checkpoint runtime is opened here). pipeline.standalone has them.
RuntimeOpener = Callable[[Any], Any]


def gate_failures(metrics: dict[str, Any], ppl: dict[str, Any], gate: Gate, *,
                  teacher_forced: bool) -> list[str]:  # fmt: skip
    """What fails the gate: teacher-forced top-1 and KL (where the runtime gives logits), the
    held-out perplexity increase, greedy agreement (required of a greedy-only runtime)."""
    failures = []
    if teacher_forced and not math.isfinite(metrics["kl_mean"]):
        failures.append("the candidate's logits are not finite (NaN or Inf)")
    if teacher_forced and metrics["top1"] < gate.min_top1:
        failures.append(f"top-1 agreement {metrics['top1']:.4f} < {gate.min_top1}")
    if teacher_forced and metrics["kl_mean"] > gate.max_kl:
        failures.append(f"mean KL {metrics['kl_mean']:.2e} > {gate.max_kl:.0e}")
    if ppl and gate.max_ppl_delta_pct is not None and ppl["delta_pct"] > gate.max_ppl_delta_pct:
        failures.append(
            f"held-out perplexity {ppl['delta_pct']:+.2f}% > +{gate.max_ppl_delta_pct}%"
        )
    min_greedy = gate.min_greedy
    if min_greedy is None and not teacher_forced:
        min_greedy = GREEDY_ONLY_MIN
    if min_greedy is not None and metrics["greedy_agreement"] < min_greedy:
        failures.append(f"greedy agreement {metrics['greedy_agreement']:.3f} < {min_greedy}")
    return failures


def _models(
    reference_dir: Path, tokenizer_dir: Path | None, device: str, records: Records | None
) -> tuple[Any, Any, Any]:
    """(the model's tokenizer, the deployment's if it is another, the transformers model: loaded
    on its first call that `records` (the reference model's, core/records.py) does not hold)."""
    if not (reference_dir / "config.json").is_file():
        raise InputError(
            f"{reference_dir} has no config.json: --reference must be a Hugging Face model directory"
        )
    tokenizer = load_tokenizer(reference_dir, "a Hugging Face model directory with its tokenizer")
    candidate_tokenizer = (
        load_tokenizer(tokenizer_dir, "--tokenizer as a directory with tokenizer files")
        if tokenizer_dir is not None and tokenizer_dir.resolve() != reference_dir.resolve()
        else None
    )
    # on a GPU, loaded there, in the dtype its weights are stored in where they share one
    # 16-bit dtype, and made float32 there (exact): a float32 copy on the host first, then
    # moved, cost 7 s of a 7B model's verify
    placed: dict[str, Any] = {}
    if device.startswith("cuda"):
        placed = {"device_map": device, "dtype": stored_dtype(reference_dir) or torch.float32}

    def load() -> Any:
        try:
            reference = load_hf_model(reference_dir, **placed)
        except (OSError, ValueError, KeyError) as exc:
            raise InputError(
                f"transformers cannot load {reference_dir} as the reference ({exc}): "
                "pass a Hugging Face model directory with its tokenizer"
            ) from None
        return reference.to(device).float().eval()  # type: ignore[arg-type]  # transformers' stubs

    return tokenizer, candidate_tokenizer, RecordedReference(load, records)


def stored_dtype(hf_dir: Path) -> torch.dtype | None:
    """The 16-bit float dtype every tensor of the model's weight files is stored in, or None
    (float32 or mixed dtypes, whose reference must load as float32 from the start)."""
    with SafetensorsIndex(weight_files(hf_dir)) as index:  # the headers alone
        found = {entry.dtype for entry in index.entries.values()}
    one = {"BF16": torch.bfloat16, "F16": torch.float16}
    return one[found.pop()] if len(found) == 1 and found <= set(one) else None


def _runtime_findings(metrics: dict[str, Any], stop: set[int], failed: bool) -> list[Finding]:
    """Findings from the comparison itself; where it pointed at the cause only once it failed."""
    findings = diagnose.end_findings(metrics["prompts"], stop)
    if failed or any(f.fatal for f in findings):
        for extra in (
            diagnose.position_finding(metrics["by_position"]),
            diagnose.layer_finding(metrics["by_layer"]),
        ):
            if extra:
                findings.append(extra)
    return findings


def _read(checkpoint: Path, device: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The checkpoint's config and tensors, on `device` (where the runtime and the static check
    run), four copies to it at a time (each lets go of the GIL)."""
    config, weights = read_checkpoint(checkpoint)
    if device == "cpu":
        return config, weights
    with ThreadPoolExecutor(4, thread_name_prefix="to-device") as pool:
        moved = pool.map(lambda t: t.to(device), weights.values())
        return config, dict(zip(weights, moved, strict=True))


class _Laps:
    """Seconds of each part of a verify run, in the report's `seconds_by_part`."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self.last = round(now - self.last, 2), now


def verify_checkpoint(
    checkpoint: Path | None,
    reference_dir: Path,
    *,
    gate: Gate,
    max_new_tokens: int = 16,
    device: str = "auto",
    tokenizer_dir: Path | None = None,
    heldout_tokens: int = 2048,
    runtime: str = "reference",
    open_runtime: RuntimeOpener | None = None,
    engine_dir: Path | None = None,
    url: str | None = None,
    records: Records | None = None,
) -> dict[str, Any]:
    """Run the model through a runtime and compare it with transformers.

    `runtime` names what runs it: "reference" (the checkpoint runtime on `checkpoint`), or
    "tensorrt-llm" / "llmapi" / "triton", opened by `open_runtime` (the engine in `engine_dir`,
    TensorRT-LLM's LLM() on the llmapi `checkpoint`, the deployment at `url`: each recorded in
    the report). `records`: the reference model's outputs kept between runs (core/records.py,
    reference.py). The checkpoint, where given, is also checked statically against the HF model.
    `tokenizer_dir` is the tokenizer the deployment uses (default: the model's own). Returns
    the report; `passed` is False when a gate or a fatal finding fails."""
    from transformers.utils import logging as hf_logging

    _check_runtime(runtime, checkpoint, open_runtime)
    hf_logging.disable_progress_bar()
    device = pick_device(device)
    laps = _Laps()
    tokenizer, candidate_tokenizer, reference, config, weights = _load(
        checkpoint, reference_dir, tokenizer_dir, device, runtime, laps, records
    )
    findings: list[Finding] = []
    notes: list[str] = []
    if checkpoint is not None:  # the config and every tensor against the HF model
        findings, notes = diagnose.check_static(checkpoint, config, weights, reference_dir)
        laps.lap("static_check")
    candidate = _candidate(runtime, config, weights, device, open_runtime, tokenizer)
    del weights
    laps.lap("runtime_load")
    teacher_forced = getattr(candidate, "teacher_forced", True)
    decoded_from = _kv_cache_decoding(config, runtime, notes)
    stop = end_ids(reference_dir, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop, default=0)
    findings += _tokenizer_findings(candidate_tokenizer, tokenizer)
    metrics = compare(reference, candidate, tokenizer, stop, max_new_tokens=max_new_tokens,
                      device=device, candidate_tokenizer=candidate_tokenizer, pad_id=pad_id)  # fmt: skip
    laps.lap("prompts")
    windows = corpus_windows(tokenizer, heldout_tokens) if teacher_forced else []
    ppl = perplexity(reference, candidate, windows, device=device, decoded_from=decoded_from)
    laps.lap("heldout")
    failures = gate_failures(metrics, ppl, gate, teacher_forced=teacher_forced)
    findings += _runtime_findings(metrics, stop, bool(failures))
    failures += [f"{f.cause}: {f.evidence}" for f in findings if f.fatal]
    quant = config.get("quantization") or {}
    return _finite(
        {
            "passed": not failures,
            "failures": failures,
            "diagnosis": [f.as_dict() for f in findings],
            "notes": notes,
            "gate": asdict(gate),
            "runtime": runtime,
            "teacher_forced": teacher_forced,
            "device": device,
            "checkpoint": str(checkpoint) if checkpoint is not None else None,
            "engine": str(engine_dir) if engine_dir is not None else None,
            "url": url,
            "reference": str(reference_dir),
            "tokenizer": str(tokenizer_dir or reference_dir),
            "reference_dtype": "float32",
            "checkpoint_dtype": config.get("dtype"),
            "quant_algo": quant.get("quant_algo"),
            "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
            "end_ids": sorted(stop),
            "pad_id": pad_id,
            "seconds": round(time.perf_counter() - laps.start, 2),
            "seconds_by_part": laps.seconds,
            **metrics,
            "perplexity": ppl,
            "recipe": _recipe(checkpoint),
        }
    )


def _check_runtime(
    runtime: str, checkpoint: Path | None, open_runtime: RuntimeOpener | None
) -> None:
    if runtime not in RUNTIMES:
        raise InputError(f"unknown runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    if runtime == "reference" and checkpoint is None:
        raise InputError("the checkpoint runtime runs a checkpoint: pass --checkpoint")
    if runtime != "reference" and open_runtime is None:
        raise InputError(f"--runtime {runtime} needs its engine or deployment opened first")


def _load(
    checkpoint: Path | None, reference_dir: Path, tokenizer_dir: Path | None, device: str,
    runtime: str, laps: _Laps, records: Records | None,
) -> tuple[Any, Any, Any, dict[str, Any], dict[str, torch.Tensor]]:  # fmt: skip
    """(tokenizer, the deployment's tokenizer or None, the transformers reference, the
    checkpoint's config and tensors). The checkpoint is read (and moved to the device) on a
    thread while transformers loads the reference: a rank file convert wrote around the page
    cache comes from the disk (a 7B float16 one in 9-13 s on the H200 host), the reference
    mostly from the cache."""
    config: dict[str, Any] = {}
    weights: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(1, thread_name_prefix="verify-read") as pool:
        target = device if runtime == "reference" else "cpu"
        reading = pool.submit(_read, checkpoint, target) if checkpoint is not None else None
        tokenizer, candidate_tokenizer, reference = _models(
            reference_dir, tokenizer_dir, device, records
        )
        laps.lap("reference_load")
        if reading is not None:
            config, weights = reading.result()
            laps.lap("checkpoint_read")  # what was left of the read once the reference loaded
    return tokenizer, candidate_tokenizer, reference, config, weights


def _candidate(runtime: str, config: dict[str, Any], weights: dict[str, torch.Tensor],
               device: str, open_runtime: RuntimeOpener | None, tokenizer: Any) -> Any:  # fmt: skip
    """The runtime under test: the checkpoint runtime, or the one `open_runtime` opens."""
    if runtime == "reference":
        return CheckpointRuntime(config, weights, device)
    assert open_runtime is not None
    return open_runtime(tokenizer)


def _kv_cache_decoding(config: dict[str, Any], runtime: str, notes: list[str]) -> int | None:
    """Where the held-out windows are decoded token by token through a quantized KV cache
    (None: not decoded), with a note saying why."""
    kv_algo = (config.get("quantization") or {}).get("kv_cache_quant_algo")
    if kv_cache_of(kv_algo) == "model":
        return None
    notes.append(
        f"the {kv_algo} KV cache's error shows where tokens are read back from the cache: in "
        "generation and in the held-out perplexity, whose windows are decoded token by token "
        f"after their first {DECODED_FROM}; not in the prompt set's teacher-forced figures, "
        "since a prefill attends to its own K/V unquantized (docs/quantization.md)"
    )
    return DECODED_FROM if runtime == "reference" else None


def _tokenizer_findings(candidate_tokenizer: Any, tokenizer: Any) -> list[Finding]:
    """A deployment's tokenizer that splits the prompts otherwise than the model's."""
    if candidate_tokenizer is None:
        return []
    texts = list(load_prompts()["text"])
    finding = diagnose.tokenizer_finding(candidate_tokenizer, tokenizer, texts)
    return [finding] if finding else []


def record_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The figures of a report that the stage record keeps (the manifest, the nightly's
    comparisons), with the likely cause of a failure."""
    summary = {
        k: report[k]
        for k in ("passed", "failures", "top1", "kl_mean", "greedy_agreement", "device")
    }
    summary["ppl_delta_pct"] = (report.get("perplexity") or {}).get("delta_pct")
    summary["likely_cause"] = next(
        (d["cause"] for d in report["diagnosis"] if d["fatal"]),
        report["diagnosis"][0]["cause"] if report["diagnosis"] else None,
    )
    return summary


def _recipe(checkpoint: Path | None) -> Any:
    """The INT8 recipe search's record, where convert ran one (checkpoint/recipe.json)."""
    path = checkpoint / "recipe.json" if checkpoint is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def _finite(value: Any) -> Any:
    """The report with NaN and Inf as null, so that it stays valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
