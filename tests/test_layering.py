"""The architecture as a test: floors and rooms, each importing only from itself and below.

Floors (top-level folders, one namespace): compression ← comms ← peers ← diloco. Inside diloco/, rooms:
the library (diloco/*.py) ← the bundled job (diloco/job) ← simulation (diloco/sim) ← measuring
(diloco/bench) ← the command line (diloco/cli). Every import is counted, also those inside functions
(the lazy ones), so a shortcut upward fails here rather than in a review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"compression": "diloco.compression", "comms": "diloco.comms", "peers": "diloco.peers", "diloco": "diloco"}
ORDER = ("diloco.compression", "diloco.comms", "diloco.peers", "diloco", "diloco.job", "diloco.sim", "diloco.bench",
         "diloco.cli")


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def level(module: str) -> int:
    """The index in ORDER of the innermost floor or room that holds `module`; `python -m diloco`
    (diloco/__main__.py) is the command line's door."""
    if module == "diloco.__main__":
        return ORDER.index("diloco.cli")
    return ORDER.index(max((room for room in ORDER if module == room or module.startswith(room + ".")), key=len))


def _source(node: ast.ImportFrom, package: str) -> str:
    """The module a `from … import …` reads from, relative imports resolved against `package`."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imports(module: str, path: Path) -> set[str]:
    """The diloco modules `module` imports anywhere in its file, relative imports resolved."""
    package = _package(module, path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("diloco")}
        elif isinstance(node, ast.ImportFrom):
            target = _source(node, package)
            if target.startswith("diloco"):
                out.add(target)
                out |= {f"{target}.{a.name}" for a in node.names}  # `from . import train` names a module
    return out


def test_the_four_folders_and_the_rooms_import_only_downward():
    found = modules()
    assert {"diloco.wrapper", "diloco.job.train", "diloco.sim.simulate", "diloco.bench.convergence",
            "diloco.cli.main", "diloco.comms.collective", "diloco.compression.pipeline"} <= set(found)
    upward = []
    for module, path in sorted(found.items()):
        for target in sorted(imports(module, path)):
            if target not in found:  # a name imported from a module, not a module
                continue
            if level(target) > level(module):
                upward.append(f"{module} imports {target} ({ORDER[level(target)]} is above {ORDER[level(module)]})")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule is not vacuous: a library module importing the bundled job, even inside a function, is caught."""
    bad = tmp_path / "wrapper.py"
    bad.write_text("def f():\n    from .job.train import run_job\n    from . import cli\n")
    got = imports("diloco.wrapper", bad)
    assert {"diloco.job.train", "diloco.cli"} <= got
    assert level("diloco.job.train") > level("diloco.wrapper") and level("diloco.cli") > level("diloco.wrapper")
    assert level("diloco.comms.collective") < level("diloco.peers.reaper") < level("diloco.swarm")


def runtime_imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The diloco modules `module` imports when it runs (lazy imports included, `if TYPE_CHECKING:` blocks left
    out: annotations are not imports); `from . import x` imports the module x, not its package again."""
    package = _package(module, path)
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for sub in node.body for n in ast.walk(sub)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = _source(node, package)
            named = {f"{target}.{a.name}" for a in node.names} & known
            out |= named or {target}
    return {t for t in out if t in known and t != module}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph` (its strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while (w := stack.pop()) != v:
                part.append(w)
            if part:
                found.append(sorted([v, *part]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_another_that_imports_it_back():
    found = modules()
    graph = {m: runtime_imports(m, p, set(found)) for m, p in found.items()}
    assert graph["diloco.wrapper"] and not cycles(graph), cycles(graph)


def test_the_cycle_check_sees_a_circle_through_a_lazy_import(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from .b import f\n")
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n")
    known = {"diloco.a", "diloco.b"}
    graph = {"diloco.a": runtime_imports("diloco.a", a, known), "diloco.b": runtime_imports("diloco.b", b, known)}
    assert not cycles(graph)  # an annotation's import is no circle
    b.write_text("def f():\n    from . import a\n")
    graph["diloco.b"] = runtime_imports("diloco.b", b, known)
    assert cycles(graph) == [["diloco.a", "diloco.b"]]
