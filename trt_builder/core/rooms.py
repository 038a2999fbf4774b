"""Rooms: a quantization mode (`trt_builder/modes/<mode>/`) or a target
(`trt_builder/targets/<target>/`) keeps everything it decides in one folder, whatever stage
decides it. Each module of a room is named after the layer it sits at (core/codegraph.py:
LAYERS): `spec.py` (its frozen config, its choices and refusals), `checkpoint.py`, `runtimes.py`,
`recipe/`, `convert.py`, `engine.py`, `triton.py`, ... A stage asks for its layer's part of every
room of a folder with `load_rooms(folder, layer)`; each part registers what it does there (a converter, a search, a
packager), keyed by the room's type. The import graph counts the call as imports of those parts,
so a stage's key covers the rooms' code at its layer (docs/design.md, "Rooms")."""

from __future__ import annotations

import importlib
from functools import cache
from pathlib import Path

#: The folders that hold rooms, each a package of rooms.
ROOM_FOLDERS = ("modes", "targets")
_TOP = Path(__file__).resolve().parents[1]


@cache
def load_rooms(folder: str, layer: str) -> None:
    """Import the module (or sub-package) for `layer` of every room in `folder` (one of
    ROOM_FOLDERS) that has one."""
    for room in sorted((_TOP / folder).iterdir()):
        if (room / f"{layer}.py").is_file() or (room / layer / "__init__.py").is_file():
            importlib.import_module(f"{_TOP.name}.{folder}.{room.name}.{layer}")
