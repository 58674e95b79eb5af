"""The package's import graph runs one way: each layer imports only the layers below it.

geometry and dims (pure arithmetic) < comm < functional (differentiable collectives) < spatial
(blocks: the record, the grid, the kernels, the rules) < nn (layers) < parallel (strategies) <
models, data, inference < train < plan < the command line. A kernel or a rule that reached
up into a layer would make the two folders a loop again, so this reads every ``import`` of
every module (inside functions too) and checks the arrow. Inside a package, the modules'
own imports at import time (those at module level) form no circle either: a circle makes
the order of imports decide which names exist. Pure: no torch, no processes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "parallelkit"
# Lowest first; a package may import its own modules and any package of a lower rank.
LAYERS = [
    {"geometry", "dims"},
    {"comm"},
    {"functional"},
    {"spatial"},
    {"nn"},
    {"parallel", "xla"},
    {"models", "data", "inference", "local_ranks", "testing"},
    {"train"},
    {"plan"},  # reads the training configuration it plans for
    {"cli", "parallelkit"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _part(module: str) -> str:
    """The package (or top-level module) of ``parallelkit.x.y``: ``x``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "parallelkit"


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "parallelkit":
                found += [f"parallelkit.{a.name}" for a in node.names]
            elif node.module.startswith("parallelkit."):
                found += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("parallelkit.")]
    return found


def _upward() -> list[str]:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        here = _part(".".join(rel.parts))
        for target in _imports(path):
            there = _part(target)
            if there != here and RANK.get(there, 0) > RANK.get(here, len(LAYERS)):
                wrong.append(f"{rel} ({here}) imports {target} ({there})")
    return sorted(set(wrong))


def _design_layers() -> list[set[str]]:
    """The layers of docs/design.md's table, lowest first: the packages and modules named in
    each row's ``parallelkit/...`` paths."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    table = text[text.index("| layer | where |") :].split("\n\n", 1)[0]
    layers = []
    for line in table.splitlines()[2:]:
        where = line.split("|")[2]
        names = re.findall(r"`parallelkit/(\w+)", where)
        if names:
            layers.append({"parallelkit" if n == "__init__" else n for n in names})
    return layers


def test_the_design_docs_table_is_these_layers() -> None:
    """docs/design.md's layer table says what this test checks, in the same order."""
    assert _design_layers() == LAYERS


def test_every_package_has_a_layer() -> None:
    names = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()}
    names = {n for n in names if not n.startswith(("_", "."))}
    assert names <= RANK.keys(), f"place {sorted(names - RANK.keys())} in LAYERS"


def test_no_upward_import() -> None:
    assert _upward() == []


def test_an_upward_import_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a kernel importing a layer is reported."""
    fake = tmp_path / "parallelkit"
    (fake / "spatial").mkdir(parents=True)
    (fake / "spatial" / "kernel.py").write_text(
        "def f():\n    from parallelkit.nn import spatial_parallel\n"
    )
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    assert _upward() == [
        "parallelkit/spatial/kernel (spatial) imports parallelkit.nn.spatial_parallel (nn)"
    ]


# train's rooms, lowest first: the config's shape, the ranks, what a run keeps on disk, the
# tasks, the config read and checked against them, the loop, prediction.
TRAIN_ROOMS = [
    {"schema", "keys"}, {"ranks"}, {"store"}, {"tasks"}, {"config"}, {"loop"}, {"predict"}
]  # fmt: skip
TRAIN_RANK = {name: i for i, names in enumerate(TRAIN_ROOMS) for name in names}


def _train_upward() -> list[str]:
    """Imports (inside functions too) from one room of ``parallelkit/train`` to a higher one."""
    wrong = []
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        rel = path.relative_to(PACKAGE / "train")
        here = rel.parts[0].removesuffix(".py")
        for target in _imports(path):
            parts = target.split(".")
            if parts[:2] != ["parallelkit", "train"] or len(parts) < 3:
                continue
            there = parts[2]
            if here in TRAIN_RANK and TRAIN_RANK.get(there, 0) > TRAIN_RANK[here]:
                wrong.append(f"train/{rel} ({here}) imports {target} ({there})")
    return sorted(set(wrong))


def test_every_room_of_train_has_a_floor() -> None:
    rooms = {p.stem for p in (PACKAGE / "train").iterdir() if not p.name.startswith("_")}
    assert rooms - {"__pycache__"} == TRAIN_RANK.keys()


def test_train_rooms_import_downward() -> None:
    assert _train_upward() == []


def test_an_upward_import_between_rooms_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: a rank's start-up reaching up into the loop, late, is reported."""
    fake = tmp_path / "parallelkit"
    (fake / "train" / "ranks").mkdir(parents=True)
    (fake / "train" / "ranks" / "launch.py").write_text(
        "def rank():\n    from parallelkit.train.loop import trainer\n"
    )
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    assert _train_upward() == [
        "train/ranks/launch.py (ranks) imports parallelkit.train.loop.trainer (loop)"
    ]


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _at_import_time(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports when it is imported: its module-level
    imports (not those inside functions or under ``TYPE_CHECKING``); ``from pkg import mod``
    is the module ``pkg.mod``."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                continue
            if isinstance(node, ast.If | ast.Try):
                visit(node.body + node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)

    visit(ast.parse(path.read_text()).body)
    return found & modules


def _circles() -> list[list[str]]:
    """Every set of modules that import one another, round, at import time (the strongly
    connected components of more than one module, by Tarjan's algorithm)."""
    paths = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph = {m: _at_import_time(p, set(paths)) - {m} for m, p in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle() -> None:
    assert _circles() == []


def test_an_import_circle_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: three modules of one package importing one another, round, and a
    fourth importing one of them inside a function only (no circle)."""
    fake = tmp_path / "parallelkit"
    (fake / "train").mkdir(parents=True)
    (fake / "train" / "__init__.py").write_text("")
    (fake / "train" / "config.py").write_text("from parallelkit.train.tasks import TASKS\n")
    (fake / "train" / "tasks.py").write_text("from parallelkit.train import rundir\n")
    (fake / "train" / "rundir.py").write_text("import parallelkit.train.config\n")
    late = "def run():\n    from parallelkit.train import config\n"
    (fake / "train" / "launch.py").write_text(late)
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    assert _circles() == [
        ["parallelkit.train.config", "parallelkit.train.rundir", "parallelkit.train.tasks"]
    ]
