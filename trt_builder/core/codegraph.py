"""trt-builder's own import graph, read from the source (ast), and the code digest it gives.

A stage's cache key holds the digest of the code its output depends on: the stage's module and
every trt-builder module it imports, directly or not, at module level or inside a function
(lazy imports of torch-heavy code count too), with the data files of their packages. Nothing is
listed by hand, so the key cannot miss a module: an edited source reruns exactly the stages that
import it. Imports under `if TYPE_CHECKING:` are for annotations only and do not count.

The same graph is what tests/test_architecture.py checks: no cycles, and no sub-package that
imports one above it in LAYERS.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[1]
TOP = PACKAGE.name  # "trt_builder"

#: The sub-packages from the bottom up: a sub-package imports only from those before it (and
#: from itself). The pipeline's parts come in the order the pipeline runs them, except that
#: what executes and scores a model (runtimes) comes before the stages that use it.
LAYERS = (
    "core",  # errors, atomic files, digests, layout, locks, versions, dtypes, the stage protocol
    "spec",  # the build spec, quantization modes, verify gates, target GPUs
    "models",  # the architecture registry: one module per family
    "checkpoint",  # the TensorRT-LLM checkpoint format: safetensors I/O, parallel ranks
    "source",  # --model, the hub, fetch (stage 1), the HF model's files and loaders
    "runtimes",  # the checkpoint runtime, generation helpers, scoring
    "calibrate",  # the corpus and activation statistics (stage 2)
    "recipe",  # the INT8 recipe search, simulated in memory (stage 3)
    "convert",  # HF -> TensorRT-LLM checkpoint, SmoothQuant, the INT8 KV cache (stage 4)
    "verify",  # the checkpoint against transformers, diagnosis, reports (stage 5)
    "engine",  # trtllm-build, releases, the memory plan, the engine runtime, doctor (stage 6)
    "triton",  # the Triton repository, client, serving, the Triton runtime (stage 7)
    "bench",  # load tests of a deployment (aiperf), their comparison and HTML page
    "pipeline",  # the stages in order, the plan, standalone verify
    "fleet",  # nightly rebuilds, their history and reports, gc
    "cli",  # the command line
)


@dataclass(frozen=True)
class Import:
    """One import of a trt-builder module by another."""

    source: str  # the importing module, e.g. "trt_builder.convert.stage"
    target: str  # the imported module (a package's __init__ is the package's name)
    line: int
    top_level: bool  # False: inside a function (a lazy import)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every importable module under `root` (a .py file whose folders are all packages)."""
    found: dict[str, Path] = {}
    for dirpath, dirs, files in os.walk(root):
        folder = Path(dirpath)
        if not (folder / "__init__.py").is_file():
            dirs.clear()  # not a package: nothing below is importable as trt_builder.*
            continue
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                found[_module_name(folder / name, root)] = folder / name
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(body: list[ast.stmt], top_level: bool) -> list[tuple[ast.stmt, bool]]:
    """Every statement in `body`, nested ones too (imports are statements, so expressions need
    no visit), with whether it runs at import time; TYPE_CHECKING blocks are skipped."""
    out: list[tuple[ast.stmt, bool]] = []
    todo = [(stmt, top_level) for stmt in reversed(body)]
    while todo:
        stmt, top = todo.pop()
        if isinstance(stmt, ast.If) and _is_type_checking(stmt):
            todo += [(s, top) for s in reversed(stmt.orelse)]
            continue
        out.append((stmt, top))
        inner = top and not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
        nested: list[ast.stmt] = []
        for name in ("body", "orelse", "finalbody"):
            nested += getattr(stmt, name, None) or []
        for handler in getattr(stmt, "handlers", None) or []:
            nested += handler.body
        for case in getattr(stmt, "cases", None) or []:
            nested += case.body
        todo += [(s, inner) for s in reversed(nested)]
    return out


#: The folders of rooms (core/rooms.py): a room's module sits at the layer it is named after.
ROOM_FOLDERS = ("modes", "targets")


def _loaded_rooms(source: str, tree: ast.Module) -> list[tuple[str, str]]:
    """The (folder, layer) pairs whose room parts a module loads by name
    (`load_rooms("modes", "convert")`, core/rooms.py)."""
    if "load_rooms" not in source:
        return []
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or len(node.args) != 2:
            continue
        if getattr(node.func, "id", getattr(node.func, "attr", None)) != "load_rooms":
            continue
        folder, layer = node.args
        if isinstance(folder, ast.Constant) and isinstance(layer, ast.Constant):
            found.append((str(folder.value), str(layer.value)))
    return found


def _discovers(source: str, tree: ast.Module) -> bool:
    """Whether a module loads its package's modules by name (pkgutil.iter_modules)."""
    return "iter_modules" in source and any(
        isinstance(node, ast.Attribute) and node.attr == "iter_modules" for node in ast.walk(tree)
    )


def parse_imports(name: str, path: Path, known: set[str]) -> list[Import]:
    """The trt-builder modules that module `name` (at `path`) imports. A module that discovers
    its package's modules by name imports every one of them."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []
    for node, top_level in _statements(tree.body, True):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in known else base)
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        for target in targets:
            if target in known and target != name:
                found.append(Import(name, target, getattr(node, "lineno", 0), top_level))
    for folder, wanted in _loaded_rooms(source, tree):
        for other in sorted(known):
            parts = other.split(".")
            if len(parts) > 3 and parts[1] == folder and parts[3] == wanted:
                found.append(Import(name, other, 0, False))
    if _discovers(source, tree):
        for other in sorted(known):
            if other.rpartition(".")[0] == package and other != name:
                found.append(Import(name, other, 0, True))
    return found


@dataclass(frozen=True)
class Graph:
    """trt-builder's modules and the imports between them."""

    root: Path
    paths: dict[str, Path]
    imports: tuple[Import, ...]

    def targets(self, name: str) -> list[str]:
        return sorted({i.target for i in self.imports if i.source == name})

    def closure(self, name: str) -> list[str]:
        """`name` and every module it imports, directly or not (with their packages'
        __init__, which Python runs first)."""
        seen: set[str] = set()
        todo = [name]
        while todo:
            module = todo.pop()
            if module in seen or module not in self.paths:
                continue
            seen.add(module)
            todo += self.targets(module)
            parent = module.rpartition(".")[0]
            while parent:
                todo.append(parent)
                parent = parent.rpartition(".")[0]
        return sorted(seen)

    def cycles(self) -> list[list[str]]:
        """Every import cycle, as the modules around it (empty when the graph is acyclic)."""
        found: list[list[str]] = []
        state: dict[str, int] = {}  # 1: on the current path, 2: done
        path: list[str] = []

        def visit(module: str) -> None:
            state[module] = 1
            path.append(module)
            for target in self.targets(module):
                if state.get(target) == 1:
                    found.append(path[path.index(target) :] + [target])
                elif target not in state:
                    visit(target)
            path.pop()
            state[module] = 2

        for module in sorted(self.paths):
            if module not in state:
                visit(module)
        return found


def parsed_graph(root: Path = PACKAGE) -> Graph:
    """The import graph, every module parsed now (no memo): what the architecture tests walk."""
    paths = modules(root)
    known = set(paths)
    imports = tuple(i for name, path in paths.items() for i in parse_imports(name, path, known))
    return Graph(root, paths, imports)


#: Each module's parsed imports, kept beside Python's own bytecode cache and trusted the way
#: Python trusts a .pyc: while the source's size and mtime are those it was parsed at.
_MEMO = "__pycache__/trt-builder-imports.json"


def _memo(root: Path) -> dict[str, Any]:
    try:
        data = json.loads((root / _MEMO).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_memo(root: Path, memo: dict[str, Any]) -> None:
    """Best effort: a read-only install parses every time instead."""
    path = root / _MEMO
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(exist_ok=True)
        tmp.write_text(json.dumps(memo, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


@cache
def graph(root: Path = PACKAGE) -> Graph:
    """The import graph of the package at `root` (read once per process; a module is parsed
    again only when its source changed)."""
    paths = modules(root)
    known = set(paths)
    # which names are modules decides what an import resolves to: a new module reparses all
    names = hashlib.sha256("\n".join(sorted(known)).encode()).hexdigest()
    memo = _memo(root)
    parsed = memo.get("modules", {}) if memo.get("known") == names else {}
    fresh: dict[str, Any] = {}
    imports: list[Import] = []
    for name, path in paths.items():
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns]
        hit = parsed.get(name)
        if isinstance(hit, dict) and hit.get("stamp") == stamp:
            found = [Import(name, target, line, top) for target, line, top in hit["imports"]]
        else:
            found = parse_imports(name, path, known)
        fresh[name] = {"stamp": stamp, "imports": [[i.target, i.line, i.top_level] for i in found]}
        imports += found
    if fresh != parsed:
        _save_memo(root, {"known": names, "modules": fresh})
    return Graph(root, paths, tuple(imports))


def layer(module: str) -> str:
    """The sub-package a module belongs to ("" for the top-level package); a room's module
    (trt_builder.modes.fp8.convert) sits at the layer it is named after, and the folders of
    rooms themselves (their registry, base class, a room's empty __init__) at "spec"."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ROOM_FOLDERS:
        return parts[3] if len(parts) > 3 else "spec"
    return parts[1] if len(parts) > 1 else ""


def _data_files(folder: Path, paths: set[Path]) -> list[Path]:
    """The files under a package's folder that are not its modules: its data (the bundled
    corpus, the prompt set, the Triton python models)."""
    out = []
    for dirpath, dirs, files in os.walk(folder):
        here = Path(dirpath)
        if here != folder and (here / "__init__.py").is_file():
            dirs.clear()  # a sub-package has its own data
            continue
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        out += [here / f for f in sorted(files) if here / f not in paths and not f.endswith(".pyc")]
    return out


def _outside(module: str, g: Graph) -> tuple[Path | None, list[str]]:
    """A module outside the package (a stage defined in a test or a plugin): its file and the
    trt-builder modules it imports (none known for code without a file, e.g. `python -c`).
    Its own helper modules are not followed: a plugin's key covers its stage's module and, from
    there, trt-builder only."""
    import sys

    file = getattr(sys.modules.get(module), "__file__", None)
    if file is None:
        return None, []
    path = Path(file)
    return path, sorted({i.target for i in parse_imports(module, path, set(g.paths))})


def code_digest(module: str, root: Path = PACKAGE) -> str:
    """sha256 over the source of `module`, of every trt-builder module it imports (directly
    or not), and of the data files of the packages they belong to. A module outside the
    package counts with its own file and the trt-builder modules it imports."""
    g = graph(root)
    extra: set[Path] = set()
    if module in g.paths:
        names = g.closure(module)
    else:
        path, targets = _outside(module, g)
        extra.update([path] if path is not None else [])
        names = sorted({n for t in targets for n in g.closure(t)})
    files = {g.paths[n] for n in names}
    folders = {g.paths[n].parent for n in names}
    every = set(g.paths.values())
    for folder in sorted(folders):
        files.update(_data_files(folder, every))
    named = [(path.relative_to(root).as_posix(), path) for path in sorted(files)]
    named += [(path.name, path) for path in sorted(extra)]
    h = hashlib.sha256()
    for name, path in named:
        h.update(name.encode() + b"\0" + _file_digest(path, *_stamp(path)).encode() + b"\0")
    return h.hexdigest()


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@cache
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    """One source file's sha256, read once per process while its size and mtime hold (every
    stage of every build digests the same files)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()
