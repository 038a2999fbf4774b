"""The bundled corpus (calibration, search and held-out splits, in data/) and calibration sets from files or the hub."""

from __future__ import annotations

import hashlib
import json
import random
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..core.errors import InputError
from ..core.records import Records
from ..spec.build import BUNDLED, CalibrationOptions

#: The format of sampled_windows' records (core/records.py): bump when it samples differently.
SAMPLED_FORMAT = 1


def corpus_windows(
    tokenizer: Any, tokens: int, window: int = 256, split: str = "heldout", *, seed: int = 0
) -> list[list[int]]:
    """A split of the bundled corpus (by default the held-out text, never used for calibration
    or the recipe search), tokenized and cut into windows; `tokens` in all, at most. `seed`
    other than 0 shuffles the split's documents first (0: in their bundled order)."""
    texts = bundled_texts(split)
    if seed:
        random.Random(seed).shuffle(texts)
    ids = tokenizer("\n\n".join(texts)).input_ids[:tokens]
    return [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]


def bundled_texts(split: str) -> list[str]:
    """The documents of one split of the bundled corpus: calibration, search or heldout."""
    path = resources.files(__package__).joinpath(f"data/{split}.jsonl")
    return _jsonl(path.read_text("utf-8"), f"the bundled {split} set")


def load_texts(dataset: str) -> tuple[list[str], str]:
    """(documents, a digest of them) of a calibration set."""
    if dataset == BUNDLED:
        texts = bundled_texts("calibration")
    elif dataset.startswith("hf:"):
        texts = _hf_dataset(dataset.removeprefix("hf:"))
    else:
        path = Path(dataset)
        if not path.is_file():
            raise InputError(
                f"calibration set {dataset} is not a file: give a .txt or .jsonl file, "
                "'bundled', or hf:NAME for a Hugging Face dataset"
            )
        raw = path.read_text("utf-8", errors="replace")
        if path.suffix == ".jsonl":
            texts = _jsonl(raw, path.name)
        else:  # plain text: documents are separated by blank lines
            texts = [t.strip() for t in raw.split("\n\n") if t.strip()]
    if not texts:
        raise InputError(f"calibration set {dataset} holds no text")
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()
    return texts, digest


def _jsonl(raw: str, what: str) -> list[str]:
    texts = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            texts.append(str(row["text"]))
        except (ValueError, KeyError, TypeError):
            raise InputError(
                f'{what} line {number} is not a JSON object with a "text" field: fix that line'
            ) from None
    return texts


def _hf_dataset(spec: str) -> list[str]:
    name, _, rest = spec.partition(":")
    split, _, field = rest.partition(":")
    try:
        import datasets
    except ImportError:
        raise InputError(
            "an hf: calibration set needs the datasets package: pip install datasets (or give a "
            ".txt / .jsonl file)"
        ) from None
    try:
        rows = datasets.load_dataset(name, split=split or "train")
    except Exception as exc:  # datasets raises many kinds; offline is the usual one
        raise InputError(
            f"cannot load dataset {name} ({exc}): check the name, or work online"
        ) from None
    column = field or "text"
    if column not in rows.column_names:
        raise InputError(
            f"dataset {name} has no {column!r} column: name one as hf:{name}:{split or 'train'}:COLUMN"
        )
    return [str(t) for t in rows[column] if str(t).strip()]


def make_samples(tokenizer: Any, texts: list[str], options: CalibrationOptions) -> torch.Tensor:
    """[samples, seq_len] token ids: documents shuffled by the seed, joined with the end id,
    cut into windows."""
    order = list(range(len(texts)))
    random.Random(options.seed).shuffle(order)
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream: list[int] = []
    need = options.samples * options.seq_len
    for i in order:
        stream += tokenizer(texts[i], add_special_tokens=False).input_ids + [sep]
        if len(stream) >= need:
            break
    have = len(stream) // options.seq_len
    if have < options.samples:
        raise InputError(
            f"the calibration set gives only {have} samples of {options.seq_len} tokens: lower "
            f"--calib-samples or --calib-seq-len, or give more text"
        )
    return torch.tensor(stream[:need]).view(options.samples, options.seq_len)


def sampled_windows(
    model: Any,
    tokenizer: Any,
    count: int,
    window: int = 256,
    *,
    seed: int = 0,
    records: Records | None = None,
) -> torch.Tensor:
    """[count, window] token ids the model writes itself: chats, where the tokenizer has a chat
    template (the template's opening up to the user's words, then sampled turns), else text
    after the start token; two of half a window each to a window, packed as the calibration
    set packs documents (half the decoding steps of one to a window). The model's own
    distribution, its chat formatting included: what a corpus of prose lacks. Sampled at
    temperature 1 with top-p 0.95, seeded without touching the global random state; nothing
    ends a sample early. Kept in the model's `records` (core/records.py) where given: every
    search of the model asks for the same (the same tokens, to the bit, as sampling them)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    if records is not None:
        options = dict(count=count, window=window, seed=seed, dtype=str(model.dtype),
                       device=str(device))  # fmt: skip
        kept = records.cached(
            "sampled",
            lambda: {"ids": sampled_windows(model, tokenizer, count, window, seed=seed)},
            **options,
        )
        return kept["ids"]

    prefix = _chat_opening(tokenizer)
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    half = window // 2
    new = max(half - len(prefix), 1)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_p=0.95, top_k=0,
                              max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                              pad_token_id=end)  # fmt: skip
    ids = torch.tensor([prefix] * 2 * count, device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out.cpu().reshape(count, -1)[:, :window]


def _chat_opening(tokenizer: Any) -> list[int]:
    """The token ids before a user's first words in the tokenizer's chat template, or the start
    token alone (the end token where there is none)."""
    if getattr(tokenizer, "chat_template", None):
        mark = "\x00"
        text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
        if mark in text:
            return list(tokenizer(text.split(mark)[0], add_special_tokens=False).input_ids)
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    return [start if start is not None else 0]
