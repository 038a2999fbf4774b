"""Where every artifact of a build lives."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


def safe_name(text: str) -> str:
    """A directory-safe form of a model name or repo id (``org/name`` -> ``org--name``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text.replace("/", "--")).strip("-.") or "model"


@dataclass(frozen=True)
class Layout:
    """``<root>/<model>/<revision>/`` holds ``hf/`` (shared by every variant) and one
    ``<variant>/`` per precision and parallelism, with ``checkpoint/``, ``engine/``,
    ``reports/`` and ``manifest.json``. The Triton repository is ``<triton_root>/<name>/``.
    """

    root: Path
    model: str
    revision: str
    variant: str
    triton_root: Path
    #: The verify reports' directory in the variant (another per verify runtime: VerifyOptions).
    reports_dir: str = "reports"

    @property
    def model_dir(self) -> Path:
        return self.root / safe_name(self.model) / safe_name(self.revision)

    @property
    def hf(self) -> Path:
        return self.model_dir / "hf"

    def calibration(self, settings: str) -> Path:
        """Calibration statistics, shared by every variant: one directory per settings."""
        return self.model_dir / "calibration" / settings

    def recipe(self, settings: str) -> Path:
        """An INT8 recipe search's result, shared by the variants it applies to."""
        return self.model_dir / "recipe" / settings

    @property
    def variant_dir(self) -> Path:
        return self.model_dir / self.variant

    @property
    def checkpoint(self) -> Path:
        return self.variant_dir / "checkpoint"

    @property
    def engine(self) -> Path:
        return self.variant_dir / "engine"

    @property
    def reports(self) -> Path:
        return self.variant_dir / self.reports_dir

    @property
    def manifest(self) -> Path:
        return self.variant_dir / "manifest.json"

    @property
    def triton_name(self) -> str:
        """``<model>-<revision, 8 hex>-<variant>``: two revisions never share a repository."""
        short = self.revision.removeprefix("sha256-")[:8]
        return f"{safe_name(self.model)}-{safe_name(short)}-{self.variant}".lower()

    @property
    def triton(self) -> Path:
        return self.triton_root / self.triton_name

    @property
    def digest_memo(self) -> Path:
        return self.root / ".trt-builder" / "digests.json"

    @property
    def lock(self) -> Path:
        return self.model_dir / f".{self.variant}.lock"
