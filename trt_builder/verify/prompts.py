"""The fixed prompt set verify compares on (data/prompts.json)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def load_prompts() -> dict[str, Any]:
    """{"text": [...], "chat": [[turns], ...]}: the prompts, plain and as chats."""
    return json.loads(resources.files(__package__).joinpath("data/prompts.json").read_text())
