"""What every runtime's greedy generation shares: trimming at the first end id, and the one end id a TensorRT-LLM request takes."""

from __future__ import annotations

from ..core.errors import InputError


def trim(tokens: list[int], end_ids: set[int]) -> list[int]:
    """The continuation up to and including its first end id (a runtime given one end id keeps
    going past the others, and pads after it)."""
    for i, token in enumerate(tokens):
        if token in end_ids:
            return tokens[: i + 1]
    return tokens


def primary_end_id(end_ids: set[int], preferred: int | None) -> int:
    """The single end id a TensorRT-LLM request takes: the tokenizer's, else the smallest."""
    if preferred is not None and preferred in end_ids:
        return preferred
    if not end_ids:
        raise InputError(
            "the model has no end-of-sequence id: set eos_token_id in generation_config.json"
        )
    return min(end_ids)
