"""`trt-builder bench` as a library call: one target benched, or two benched one after the other
and compared, or two earlier results compared; the results written (JSON, and the HTML page
of a comparison)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.errors import InputError, SpecError
from ..core.fsio import write_json, write_text
from .options import BenchOptions


def load_result(path: Path) -> dict[str, Any]:
    """A result `trt-builder bench` wrote, or InputError naming what it is instead."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(
            f"cannot read {path} ({exc}): give a result trt-builder bench wrote"
        ) from None
    if not isinstance(data, dict) or "points" not in data:
        raise InputError(
            f"{path} is not a bench result (no points): give a file trt-builder bench wrote"
        )
    return data


def run_bench(
    targets: tuple[str, ...],
    options: BenchOptions | None,
    out: Path,
    *,
    compare_files: tuple[Path, Path] | None = None,
    tokenizer: Path | None = None,
    progress: Callable[[str, str], None] | None = None,
) -> list[dict[str, Any]]:
    """Bench each of `targets` (URLs or repositories; two: written to <out>.a.json and
    <out>.b.json) with `options`, or read `compare_files`; where there are two results, write
    their comparison to `out` and its HTML page beside it. The results. `progress`: (target,
    text) as it goes."""
    if compare_files:
        if targets:
            raise SpecError("give targets to run, or --compare with two results, not both")
        results = [load_result(path) for path in compare_files]
    else:
        if len(targets) not in (1, 2) or options is None:
            raise SpecError("give one target (a URL or a repository), two to compare, or --compare")
        if options.prompts.endswith(".jsonl") and not Path(options.prompts).is_file():
            raise InputError(f"--prompts {options.prompts}: no such file")
        from .run import bench

        results = []
        for i, target in enumerate(targets):
            path = out if len(targets) == 1 else out.with_name(f"{out.stem}.{'ab'[i]}.json")

            def said(text: str, name: str = target) -> None:
                if progress is not None:
                    progress(name, text)

            results.append(bench(target, options, path, tokenizer=tokenizer, progress=said))
    if len(results) == 2:
        from .compare import compare
        from .report import html_page

        page = html_page(results)
        write_json(out, {"results": results, "comparison": compare(*results)})
        write_text(out.with_suffix(".html"), page)
    return results
