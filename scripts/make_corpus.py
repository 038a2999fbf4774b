"""Regenerate trt_builder/calibrate/data/ from the Python documentation's topic texts.

    python3.11 scripts/make_corpus.py

The texts are `pydoc_data.topics` of CPython 3.11 (the language reference sections that
`help()` shows), under the PSF License; see trt_builder/calibrate/data/README.md. Topics are sorted
by name and cut into documents of whole paragraphs (about 1,500 characters), dealt out in turn:
three of every five to calibration, one to search (the INT8 recipe's scoring), one to held-out
(verify's perplexity and the recipe's final figures); no text is in two sets.
"""

from __future__ import annotations

import json
import pydoc_data.topics
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "trt_builder" / "calibrate" / "data"
SPLITS = ("calibration", "calibration", "search", "calibration", "heldout")
DOCUMENT_CHARS = 1500


def clean(text: str) -> str:
    """Prose only: drop grammar productions and indented code blocks, join wrapped lines."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if (
            not lines
            or lines[0].startswith((" ", "+", "|", ">>>"))  # code, tables, examples
            or set(lines[-1].strip()) <= {"*", "=", "-", "~"}  # headings
        ):
            continue
        paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(p for p in paragraphs if len(p) > 40)


def main() -> None:
    if sys.version_info[:2] != (3, 11):
        sys.exit("run with Python 3.11: the corpus is CPython 3.11's topic texts")
    OUT.mkdir(parents=True, exist_ok=True)
    records: dict[str, list[dict[str, str]]] = {name: [] for name in SPLITS}
    documents = []  # (topic, text of about DOCUMENT_CHARS, whole paragraphs)
    for topic in sorted(pydoc_data.topics.topics):
        current: list[str] = []
        for paragraph in clean(pydoc_data.topics.topics[topic]).split("\n\n"):
            current.append(paragraph)
            if sum(map(len, current)) >= DOCUMENT_CHARS:
                documents.append((topic, "\n\n".join(current)))
                current = []
        if current:
            documents.append((topic, "\n\n".join(current)))
    for i, (topic, text) in enumerate(documents):
        records[SPLITS[i % len(SPLITS)]].append(
            {"source": f"python-3.11-docs:{topic}", "text": text}
        )
    for name, rows in records.items():
        with open(OUT / f"{name}.jsonl", "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{name}: {len(rows)} texts, {sum(len(r['text']) for r in rows)} characters")


if __name__ == "__main__":
    main()
