"""Verify: compare a converted checkpoint, run by a runtime, with the transformers model."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .errors import InputError
from .gates import Gate, load_prompts


def pick_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise InputError(
            "verify device cuda was asked for but torch sees no CUDA GPU: use --device cpu"
        )
    return choice


def end_ids(hf_dir: Path, tokenizer: Any) -> set[int]:
    """End-of-sequence ids from generation_config.json and the tokenizer."""
    ids: set[int] = set()
    gen = hf_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


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


def _kl(ref_logits: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(ref_logits.double(), -1)
    lq = torch.log_softmax(cand_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def compare(
    reference: Any,
    candidate: Any,
    tokenizer: Any,
    stop: set[int],
    *,
    max_new_tokens: int,
    device: str,
) -> dict[str, Any]:
    """Teacher-forced and greedy comparison of candidate with reference over the prompt set."""
    per_prompt = []
    agree = total = 0
    kl_sum = 0.0
    max_err = 0.0
    for text, ids in encode_prompts(tokenizer):
        ref_cont = hf_greedy(reference, ids, max_new_tokens, stop, device)
        seq = torch.tensor(ids + ref_cont)
        with torch.inference_mode():
            ref_logits = reference(seq[None].to(device)).logits[0].float().cpu()
        cand_logits = candidate.forward(seq).cpu()
        kl = _kl(ref_logits, cand_logits)
        hits = (ref_logits.argmax(-1) == cand_logits.argmax(-1)).sum().item()
        cand_cont = candidate.greedy(ids, max_new_tokens, stop)
        same = next(
            (i for i, (a, b) in enumerate(zip(ref_cont, cand_cont, strict=False)) if a != b),
            min(len(ref_cont), len(cand_cont)),
        )
        per_prompt.append(
            {
                "prompt": text[:80],
                "tokens": len(seq),
                "top1": hits / len(seq),
                "kl_mean": kl.mean().item(),
                "max_abs_logit_error": (ref_logits - cand_logits).abs().max().item(),
                "greedy_match_tokens": same,
                "greedy_tokens": len(ref_cont),
                "reference_text": tokenizer.decode(ref_cont),
                "candidate_text": tokenizer.decode(cand_cont),
                "candidate_empty": len(cand_cont) == 0
                or cand_cont[0] in stop
                and ref_cont[:1] != cand_cont[:1],
            }
        )
        agree += hits
        total += len(seq)
        kl_sum += kl.sum().item()
        max_err = max(max_err, per_prompt[-1]["max_abs_logit_error"])
    greedy_tokens = sum(p["greedy_tokens"] for p in per_prompt)
    return {
        "top1": agree / total,
        "kl_mean": kl_sum / total,
        "max_abs_logit_error": max_err,
        "greedy_agreement": sum(p["greedy_match_tokens"] for p in per_prompt)
        / max(greedy_tokens, 1),
        "tokens": total,
        "prompts": per_prompt,
    }


def hf_greedy(
    model: Any, ids: list[int], max_new_tokens: int, stop: set[int], device: str
) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids], device=device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(stop) or None,
            pad_token_id=next(iter(stop), 0),
        )
    return out[0, len(ids) :].tolist()


def load_reference(hf_dir: Path) -> Any:
    """The transformers model, float32: a causal LM, or a vision-language model whose language
    model was converted (its text path is what is compared)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(hf_dir)
    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)


def verify_checkpoint(
    checkpoint: Path,
    reference_dir: Path,
    *,
    gate: Gate,
    max_new_tokens: int = 16,
    device: str = "auto",
) -> dict[str, Any]:
    """Run the checkpoint through the reference runtime and compare it with transformers."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .runtime.reference import ReferenceModel

    hf_logging.disable_progress_bar()
    device = pick_device(device)
    if not (reference_dir / "config.json").is_file():
        raise InputError(
            f"{reference_dir} has no config.json: --reference must be a Hugging Face model directory"
        )
    start = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(reference_dir)
        reference = load_reference(reference_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(
            f"transformers cannot load {reference_dir} as the reference ({exc}): "
            "pass a Hugging Face model directory with its tokenizer"
        ) from None
    reference = reference.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs
    candidate = ReferenceModel.load(checkpoint, device=device)
    metrics = compare(
        reference,
        candidate,
        tokenizer,
        end_ids(reference_dir, tokenizer),
        max_new_tokens=max_new_tokens,
        device=device,
    )
    failures = []
    if metrics["top1"] < gate.min_top1:
        failures.append(f"top-1 agreement {metrics['top1']:.4f} < {gate.min_top1}")
    if metrics["kl_mean"] > gate.max_kl:
        failures.append(f"mean KL {metrics['kl_mean']:.2e} > {gate.max_kl:.0e}")
    empty = [p["prompt"] for p in metrics["prompts"] if p["candidate_empty"]]
    if empty:
        failures.append(f"empty output for {len(empty)} prompt(s), e.g. {empty[0]!r}")
    return {
        "passed": not failures,
        "failures": failures,
        "gate": asdict(gate),
        "runtime": "reference",
        "device": device,
        "checkpoint": str(checkpoint),
        "reference": str(reference_dir),
        "reference_dtype": "float32",
        "checkpoint_dtype": candidate.config["dtype"],
        "quant_algo": candidate.quant_algo,
        "seconds": round(time.perf_counter() - start, 2),
        **{k: v for k, v in metrics.items()},
    }
