"""The package's shape: an acyclic import graph (read with ast), sub-packages that import only
those below them, and stage keys whose code digest follows the imports."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trt_builder.core import codegraph
from trt_builder.core.codegraph import (
    LAYERS,
    ROOM_FOLDERS,
    Graph,
    code_digest,
    graph,
    layer,
    parsed_graph,
)

PACKAGE = codegraph.PACKAGE
STAGE_MODULES = {
    "fetch": "trt_builder.source.stage",
    "calibrate": "trt_builder.calibrate.stage",
    "recipe": "trt_builder.recipe.stage",
    "convert": "trt_builder.convert.stage",
    "verify": "trt_builder.verify.stage",
    "engine": "trt_builder.engine.stage",
    "package": "trt_builder.triton.stage",
}


def upward_imports(g: Graph) -> list[str]:
    """Imports of a sub-package from one above it in LAYERS, as 'a -> b (line)'."""
    order = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for imp in g.imports:
        src, dst = layer(imp.source), layer(imp.target)
        if src and dst and order[dst] > order[src]:
            bad.append(f"{imp.source} -> {imp.target} (line {imp.line})")
    return bad


def _package(root: Path, files: dict[str, str]) -> Path:
    """A throwaway package named trt_builder under `root`, for the checks' own failures."""
    pkg = root / "trt_builder"
    for name, text in {"__init__.py": "", **files}.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_the_import_graph_has_no_cycle() -> None:
    g = parsed_graph()
    assert len(g.paths) > 60 and len(g.imports) > 200  # the real package, read whole
    assert g.cycles() == []


def test_the_cycle_check_sees_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    """A lazy import inside a function is an edge too: it cannot hide a cycle."""
    pkg = _package(tmp_path, {
        "core/__init__.py": "",
        "core/a.py": "def f():\n    from .b import g\n    return g\n",
        "core/b.py": "from .a import f\n\ng = f\n",
        "core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
    })  # fmt: skip
    cycles = parsed_graph(pkg).cycles()
    assert cycles == [["trt_builder.core.a", "trt_builder.core.b", "trt_builder.core.a"]]
    # an import for annotations only is not an edge
    assert parsed_graph(pkg).targets("trt_builder.core.c") == []


def test_every_sub_package_has_its_place_in_the_declared_order() -> None:
    on_disk = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert sorted([*LAYERS, *ROOM_FOLDERS]) == on_disk


def test_every_module_of_a_room_is_named_after_its_layer() -> None:
    """A room (core/rooms.py) holds modules named after layers (its spec.py, convert.py,
    recipe/, ...), and an empty __init__: its layer is what its name says."""
    rooms = [room for folder in ROOM_FOLDERS for room in (PACKAGE / folder).iterdir()
             if (room / "__init__.py").is_file()]  # fmt: skip
    assert {room.parent.name for room in rooms} == set(ROOM_FOLDERS)
    for room in rooms:
        named = {
            p.stem for p in room.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()
        }
        assert named - {"__init__"} <= set(LAYERS), room
        assert "spec" in named, room  # what it is: its frozen config
        assert (room / "__init__.py").read_text().strip() == "", room


def test_a_room_at_its_layer_is_what_load_rooms_imports() -> None:
    """The convert stage's key covers every room's converter, the recipe's every search, and
    convert's does not cover a search (editing a search does not reconvert)."""
    g = parsed_graph()
    convert = set(g.closure(STAGE_MODULES["convert"]))
    recipe = set(g.closure(STAGE_MODULES["recipe"]))
    assert {
        "trt_builder.modes.fp8.convert",
        "trt_builder.modes.smoothquant.convert",
        "trt_builder.modes.floats.convert",
        "trt_builder.modes.weight_only.convert",
    } <= convert
    assert {
        "trt_builder.modes.fp8.recipe.search",
        "trt_builder.modes.smoothquant.recipe.search",
    } <= recipe
    assert not {m for m in convert if ".recipe." in m and m.startswith("trt_builder.modes.")}


def test_no_sub_package_imports_one_above_it() -> None:
    assert upward_imports(parsed_graph()) == []


def test_the_order_check_sees_an_upward_import(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {
        "core/__init__.py": "",
        "core/stage.py": "def f():\n    from ..cli.main import main\n",
        "cli/__init__.py": "",
        "cli/main.py": "from ..core.stage import f\n\ndef main():\n    return f\n",
    })  # fmt: skip
    assert upward_imports(parsed_graph(pkg)) == [
        "trt_builder.core.stage -> trt_builder.cli.main (line 2)"
    ]


def test_modules_loaded_by_name_are_edges_of_the_module_that_loads_them() -> None:
    """The registry imports its family modules by name: they count as its imports (so the
    convert stage's key covers every family); the rooms' parts are loaded by name by
    core/rooms.py (their edges: test_a_room_at_its_layer_is_what_load_rooms_imports), and nothing
    else loads modules by name."""
    g = parsed_graph()
    families = {"trt_builder.models.llama", "trt_builder.models.qwen", "trt_builder.models.gpt2"}
    assert families <= set(g.targets("trt_builder.models.registry"))
    assert families <= set(g.closure(STAGE_MODULES["convert"]))
    dynamic = sorted(n for n, p in g.paths.items() if "import_module(" in p.read_text())
    assert dynamic == ["trt_builder.core.rooms", "trt_builder.models.registry"]


def _digests(root: Path) -> dict[str, str]:
    codegraph.graph.cache_clear()
    return {stage: code_digest(module, root) for stage, module in STAGE_MODULES.items()}


@pytest.mark.parametrize(
    ("edited", "changes"),
    [
        # the plugin GEMM's arithmetic: the search simulates it, convert stores its operands,
        # the checkpoint runtime (verify) executes them
        ("runtimes/int8.py", {"recipe", "convert", "verify"}),
        ("runtimes/scoring.py", {"verify"}),
        # editing the converter does not rerun the search, nor editing the search the converter
        # (convert reruns when the recipe it reads comes out different)
        ("modes/smoothquant/convert.py", {"convert"}),
        ("modes/smoothquant/recipe/search.py", {"recipe"}),
        # the bundled corpus: calibration, the recipe's search split, verify's held-out text
        ("calibrate/data/search.jsonl", {"calibrate", "recipe", "convert", "verify"}),
        # a family module, loaded by the registry by name; the memory plan reads families too
        ("models/llama.py", {"calibrate", "recipe", "convert", "verify", "engine", "package"}),
        # copied into the repository by package, imported by nobody
        ("triton/python_models/preprocessing.py", {"package"}),
        # the stage framework: every stage
        ("core/stage.py", set(STAGE_MODULES)),
    ],
)
def test_a_stage_key_changes_exactly_with_the_code_it_imports(
    tmp_path: Path, edited: str, changes: set[str]
) -> None:
    root = tmp_path / "trt_builder"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    try:
        before = _digests(root)
        path = root / edited
        path.write_bytes(path.read_bytes() + (b"\n# edited\n" if edited.endswith(".py") else b""))
        if not edited.endswith(".py"):
            path.write_text(path.read_text() + '{"text": "one more document"}\n')
        after = _digests(root)
    finally:
        codegraph.graph.cache_clear()
    assert {stage for stage in STAGE_MODULES if before[stage] != after[stage]} == changes


@pytest.mark.integration
def test_the_pipelines_keys_follow_an_edit_to_an_indirectly_imported_module(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build, then the same build with the package read from an edited copy: the stages whose
    code imports the edited module (the plugin GEMM's arithmetic: convert, and verify through
    the checkpoint runtime) would rerun; fetch, which does not, stays cached."""
    from trt_builder.pipeline import run
    from trt_builder.spec.build import make_spec

    spec = make_spec(model=str(tiny_llama), dtype="float32", out=tmp_path / "engines",
                     triton_root=tmp_path / "triton", **{"verify.heldout_tokens": 128})  # fmt: skip
    only = ("fetch", "convert", "verify")
    assert [r.status for r in run(spec, only=only).records] == ["ran", "ran", "ran"]
    assert [r.status for r in run(spec, only=only, dry_run=True).records] == ["cached"] * 3

    copy = tmp_path / "copy" / "trt_builder"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    arithmetic = copy / "runtimes" / "int8.py"
    arithmetic.write_text(arithmetic.read_text() + "\n# edited\n")
    monkeypatch.setattr(codegraph, "PACKAGE", copy)
    try:
        records = run(spec, only=only, dry_run=True).records
    finally:
        codegraph.graph.cache_clear()
    assert [(r.name, r.status) for r in records] == [
        ("fetch", "cached"),
        ("convert", "would run"),
        ("verify", "would run"),
    ]


def test_the_memo_of_parsed_imports_is_the_parse(tmp_path: Path) -> None:
    """The per-process graph reuses a module's parsed imports only while its source is as it
    was: the memoized graph equals a fresh parse, before and after an edit that adds an import."""
    root = tmp_path / "trt_builder"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    try:
        assert graph(root).imports == parsed_graph(root).imports  # writes the memo
        codegraph.graph.cache_clear()
        assert graph(root).imports == parsed_graph(root).imports  # reads it
        layout = root / "core" / "layout.py"
        layout.write_text(layout.read_text() + "\nfrom .errors import InputError  # noqa\n")
        codegraph.graph.cache_clear()
        again = graph(root)
        assert again.imports == parsed_graph(root).imports
        assert "trt_builder.core.errors" in again.targets("trt_builder.core.layout")
    finally:
        codegraph.graph.cache_clear()


def mode_decisions(pkg: Path) -> list[str]:
    """What decides a mode outside its room (modes/): an isinstance on a mode class, a
    startswith on a mode's name, or a quant_algo (or kv_cache_quant_algo) string, as
    'file:line what'."""
    import ast

    from trt_builder.modes import KV_CACHE_CHOICES, ROOMS
    from trt_builder.modes.kvcache.spec import KV_QUANT_ALGO

    classes = {room.__name__ for room in ROOMS}
    algos = {m.quant_algo for room in ROOMS for m in room.variants()} | set(KV_QUANT_ALGO.values())
    algos.discard(None)
    names = {m.base_name for room in ROOMS for m in room.variants()} - set(KV_CACHE_CHOICES)
    found = []
    for path in sorted(pkg.rglob("*.py")):
        where = path.relative_to(pkg).as_posix()
        if where.startswith("modes/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            said = None
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in algos or (len(node.value) > 3 and any(
                        a.startswith(node.value) for a in algos)):  # fmt: skip
                    said = f"quant_algo string {node.value!r}"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id == "isinstance" and len(node.args) == 2:
                    used = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                    if used & classes:
                        said = f"isinstance on {', '.join(sorted(used & classes))}"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value
                if (node.func.attr == "startswith" and isinstance(target, ast.Attribute)
                        and target.attr == "name" and node.args
                        and isinstance(node.args[0], ast.Constant)
                        and any(str(n).startswith(str(node.args[0].value)) for n in names)):  # fmt: skip
                    said = f"mode name prefix {node.args[0].value!r}"
            if said:
                found.append(f"{where}:{getattr(node, 'lineno', 0)} {said}")
    return found


def test_no_mode_is_decided_outside_its_room() -> None:
    """Every mode decides in its room (modes/<mode>/): elsewhere the code asks the mode (its
    methods, or a registry keyed by its config's type), never its name, class or quant_algo."""
    assert mode_decisions(PACKAGE) == []


def test_the_room_check_sees_each_way_of_deciding_a_mode_elsewhere(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {
        "engine/a.py": "def f(mode, q):\n    if isinstance(mode, (Fp8, int)):\n        return 1\n"
                       "    return q['quant_algo'] == 'W8A16'\n",
        "verify/b.py": "def g(mode, algo):\n    return mode.name.startswith('int8') or "
                       "algo.startswith('W8A8_SQ_')\n",
        "modes/c.py": "X = isinstance(1, Fp8) and 'FP8'\n",  # in a room: its own business
    })  # fmt: skip
    assert mode_decisions(pkg) == [
        "engine/a.py:2 isinstance on Fp8",
        "engine/a.py:4 quant_algo string 'W8A16'",
        "verify/b.py:2 mode name prefix 'int8'",
        "verify/b.py:2 quant_algo string 'W8A8_SQ_'",
    ]


def target_decisions(pkg: Path) -> list[str]:
    """What decides a target outside its room (targets/<target>/): a comparison of something
    named like a target with a target's name, or a name `is_<target>`, as 'file:line what'."""
    import ast

    from trt_builder.targets import TARGETS

    found = []
    for path in sorted(pkg.rglob("*.py")):
        where = path.relative_to(pkg).as_posix()
        if where.startswith("targets/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            said = None
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = {s.value for s in sides if isinstance(s, ast.Constant)} & set(TARGETS)
                targets = [s for s in sides if "target" in (getattr(s, "id", None)
                           or getattr(s, "attr", None) or "")]  # fmt: skip
                if named and targets:
                    said = f"target == {sorted(named)[0]!r}"
            elif isinstance(node, (ast.Name, ast.Attribute, ast.FunctionDef)):
                name = getattr(node, "id", None) or getattr(node, "attr", None) or node.name
                if name in {f"is_{t}" for t in TARGETS}:
                    said = f"name {name}"
            if said:
                found.append(f"{where}:{getattr(node, 'lineno', 0)} {said}")
    return sorted(set(found))


def test_no_target_is_decided_outside_its_room() -> None:
    """Every target decides in its room (targets/<target>/): the stages ask the target object
    (BuildSpec.build_target) or a registry keyed by its type, never its name."""
    assert target_decisions(PACKAGE) == []


def test_the_target_check_sees_a_branch_on_a_target_name(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {
        "convert/a.py": "def f(ctx):\n    if ctx.spec.target == 'llmapi':\n        return 1\n",
        "triton/b.py": "def is_llmapi(configs):\n    return target != 'engine'\n",
        "targets/llmapi/c.py": "X = target == 'llmapi'\n",  # in its room: its own business
    })  # fmt: skip
    assert target_decisions(pkg) == [
        "convert/a.py:2 target == 'llmapi'",
        "triton/b.py:1 name is_llmapi",
        "triton/b.py:2 target == 'engine'",
    ]
