"""Where a fact about an upstream consumer was read: the conformance tables cite it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """Where an entry was read: repository, path, version (commit), line."""

    repo: str
    path: str
    version: str
    line: int | None = None

    def __str__(self) -> str:
        at = f":{self.line}" if self.line else ""
        return f"{self.repo}:{self.path}{at}@{self.version}"
