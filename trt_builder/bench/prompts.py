"""The prompts of a bench, as aiperf's single-turn JSONL: verify's bundled prompt set, or a
user's JSONL file (each line a JSON object with a "text" string, "output_length" optional),
checked line by line before any request is sent."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ..core.errors import InputError
from .options import BenchOptions


def bundled() -> list[str]:
    """verify's prompt set (trt_builder/verify/data/prompts.json)."""
    raw = resources.files("trt_builder.verify").joinpath("data/prompts.json").read_text("utf-8")
    return [str(t) for t in json.loads(raw)["text"]]


def read_jsonl(path: Path) -> list[dict[str, object]]:
    """The lines of a user's prompt file; InputError naming the line that is not a prompt."""
    try:
        lines = path.read_text("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(
            f"cannot read {path} ({exc}): give a UTF-8 JSONL file of prompts"
        ) from None
    rows: list[dict[str, object]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        text = row.get("text") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise InputError(
                f"{path} line {number} has no text: each line must be a JSON object with a "
                '"text" string (and optionally "output_length")'
            )
        length = row.get("output_length") if isinstance(row, dict) else None
        if length is not None and (not isinstance(length, int) or length < 1):
            raise InputError(f"{path} line {number}: output_length must be a whole number above 0")
        row = {"text": text}
        if length:
            row["output_length"] = length
        rows.append(row)
    if not rows:
        raise InputError(f'{path} holds no prompt: one JSON object with a "text" string a line')
    return rows


def write_prompts(options: BenchOptions, out: Path, chat: Path | None = None) -> Path | None:
    """aiperf's input file for `options.prompts` in `out` (None: synthetic prompts). `chat`: a
    tokenizer directory whose chat template each prompt is rendered with, as one user turn
    (for a model that takes text, as the llmapi model does: the ensemble renders the chat
    itself)."""
    if options.prompts == "synthetic":
        return None
    if options.prompts == "bundled":
        rows: list[dict[str, object]] = [{"text": t} for t in bundled()]
    else:
        rows = read_jsonl(Path(options.prompts))
    if chat is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(chat))
        if not tokenizer.chat_template:
            raise InputError(
                f"{chat} has no chat template to render the prompts with: give the model's "
                "tokenizer (--tokenizer), or --prompts synthetic"
            )
        for row in rows:
            turn = [{"role": "user", "content": str(row["text"])}]
            row["text"] = tokenizer.apply_chat_template(
                turn, tokenize=False, add_generation_prompt=True
            )
    path = out / "prompts.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps({"output_length": options.output_tokens} | row) + "\n")
    return path
