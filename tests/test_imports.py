"""The project's import graph, read with ast (no module is imported): no cycle, and
submission.py (the one file the leaderboard receives) imports nothing of the project but
`task`.

Project modules: every .py file in the repository root (a top-level module each, as the runner
runs them from one folder), every package in it (a folder with an __init__.py: nvfp4_group_gemm/),
and the scripts in bench/ and examples/ (each run with its own folder first on sys.path, then
the root). Every import counts, at any depth: a function's lazy import is an edge as much as
a top-level one, and so is `importlib.import_module("name")` with a constant name. Relative
imports are resolved against the importing module's package.

An edge goes to the most specific project module an import names (`from pkg import mod` ->
pkg.mod when that is a module, else pkg), and to the packages above it that the import runs
(their __init__), except those that contain the importing module: Python imports a package
before its submodules, so a submodule importing its own package is no cycle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT_FOLDERS = ("bench", "examples")


@dataclass(frozen=True)
class Module:
    name: str  # dotted, as imported (scripts: `bench/peers`)
    path: Path
    package: str  # the package a relative import starts from ("" for top-level modules)
    search: tuple  # the folders its absolute imports are looked up in, in order


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def project_modules(root: Path) -> list[Module]:
    modules = []
    for path in sorted(root.glob("*.py")):
        modules.append(Module(path.stem, path, "", (root,)))
    packages = sorted(init.parent.name for init in root.glob("*/__init__.py"))
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
                owner = ".".join(parts)
            else:
                owner = ".".join(parts[:-1])
            modules.append(Module(".".join(parts), path, owner, (root,)))
    for folder in SCRIPT_FOLDERS:
        for path in sorted((root / folder).glob("*.py")):
            modules.append(Module(f"{folder}/{path.stem}", path, "", (root / folder, root)))
    return modules


def imported_names(tree: ast.AST) -> list[tuple[int, int, str, list[str]]]:
    """(line, level, module, names) of every import at any depth: `import a.b` -> (0, 'a.b',
    []); `from .x import y, z` -> (1, 'x', ['y', 'z']); import_module('a') -> (0, 'a', [])."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, 0, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.level, node.module or "",
                          [alias.name for alias in node.names]))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id == "__import__")
                   or (isinstance(node.func, ast.Attribute)
                       and node.func.attr == "import_module"))):
            found.append((node.lineno, 0, node.args[0].value, []))
    return found


def import_graph(root: Path) -> tuple[dict[str, Module], list[Edge]]:
    modules = project_modules(root)
    by_path = {}  # (search folder, dotted name) -> module name
    for module in modules:
        folder = module.search[0]
        dotted = module.path.stem if "/" in module.name else module.name
        by_path[(folder, dotted)] = module.name

    def find(module: Module, dotted: str, relative: bool) -> str | None:
        folders = (root,) if relative else module.search
        for folder in folders:
            if (folder, dotted) in by_path:
                return by_path[(folder, dotted)]
        return None

    edges = []
    for module in modules:
        tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
        for line, level, name, names in imported_names(tree):
            if level:
                base = module.package.split(".") if module.package else []
                if level - 1 >= len(base):
                    continue  # beyond the top: Python raises; not an edge
                base = base[: len(base) - (level - 1)]
                dotted = ".".join(base + ([name] if name else []))
            else:
                dotted = name
            targets = []
            for item in names or [None]:
                if item is not None and find(module, f"{dotted}.{item}", bool(level)):
                    targets.append(f"{dotted}.{item}")
                else:
                    targets.append(dotted)
            for target in dict.fromkeys(targets):
                parts = target.split(".")
                # the module itself and each package above it that the import runs
                for depth in range(len(parts), 0, -1):
                    prefix = ".".join(parts[:depth])
                    if depth < len(parts) and (module.name == prefix
                                               or module.name.startswith(prefix + ".")):
                        continue  # a package containing the importer: imported before it
                    found = find(module, prefix, bool(level))
                    if found is not None and found != module.name:
                        edges.append(Edge(module.name, found, line))
    return {module.name: module for module in modules}, edges


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected group of modules that import each
    other, shortest first found from the group's first module (Tarjan's algorithm)."""
    graph: dict[str, list[Edge]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge)
        graph.setdefault(edge.target, [])
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph[node]:
            if edge.target not in index:
                visit(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)

    cycles = []
    for group in groups:
        start = min(group)
        # breadth-first from start back to start inside the group: the shortest cycle
        paths = {start: []}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:
            following = []
            for node in frontier:
                for edge in graph[node]:
                    if edge.target not in group:
                        continue
                    if edge.target == start:
                        cycle = paths[node] + [edge]
                        break
                    if edge.target not in paths:
                        paths[edge.target] = paths[node] + [edge]
                        following.append(edge.target)
                if cycle:
                    break
            frontier = following
        cycles.append(cycle)
    return cycles


def describe(cycle: list[Edge], modules: dict[str, Module], root: Path) -> str:
    names = " -> ".join([cycle[0].source] + [edge.target for edge in cycle])
    where = "; ".join(f"{modules[edge.source].path.relative_to(root)}:{edge.line} imports "
                      f"{edge.target}" for edge in cycle)
    return f"import cycle: {names} ({where})"


# ---------------------------------------------------------------------------------------
# The repository
# ---------------------------------------------------------------------------------------


def test_the_project_has_no_import_cycle():
    modules, edges = import_graph(REPO_ROOT)
    assert "eval" in modules and "submission" in modules and edges
    cycles = [describe(cycle, modules, REPO_ROOT) for cycle in find_cycles(edges)]
    assert not cycles, "\n".join(cycles)


def test_submission_imports_nothing_of_the_project_but_task():
    _modules, edges = import_graph(REPO_ROOT)
    mine = sorted({(edge.target, edge.line) for edge in edges if edge.source == "submission"})
    assert [target for target, _ in mine if target != "task"] == [], (
        "submission.py is the one file the leaderboard receives; it imports "
        + ", ".join(f"{target} (line {line})" for target, line in mine if target != "task"))


def test_eval_and_selfcheck_import_one_way():
    _modules, edges = import_graph(REPO_ROOT)
    pairs = {(edge.source, edge.target) for edge in edges}
    assert ("eval", "selfcheck") in pairs and ("selfcheck", "case_files") in pairs
    assert ("selfcheck", "eval") not in pairs


# ---------------------------------------------------------------------------------------
# The graph on made-up trees: what counts as an edge, and a cycle named
# ---------------------------------------------------------------------------------------


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def cycles_of(root: Path) -> list[str]:
    modules, edges = import_graph(root)
    return [describe(cycle, modules, root) for cycle in find_cycles(edges)]


def test_a_lazy_import_closes_a_cycle(tmp_path):
    root = write(tmp_path, {
        "harness.py": "import os\n\ndef main():\n    import checker\n    return checker\n",
        "checker.py": "import torch\nfrom harness import main\n",
        "task.py": "",
    })
    assert cycles_of(root) == [
        ("import cycle: checker -> harness -> checker (checker.py:2 imports harness; "
        "harness.py:4 imports checker)")]


def test_a_package_and_a_top_level_module_in_a_cycle_through_a_relative_import(tmp_path):
    root = write(tmp_path, {
        "submission.py": "def backend():\n    import nvfp4_hopper\n",
        "nvfp4_hopper/__init__.py": "from .backend import Backend\n",
        "nvfp4_hopper/backend.py": "import submission\nclass Backend: pass\n",
    })
    assert cycles_of(root) == [
        ("import cycle: nvfp4_hopper -> nvfp4_hopper.backend -> submission -> nvfp4_hopper "
        "(nvfp4_hopper/__init__.py:1 imports nvfp4_hopper.backend; nvfp4_hopper/backend.py:1 "
        "imports submission; submission.py:2 imports nvfp4_hopper)")]


def test_one_way_imports_and_a_submodule_importing_its_package_are_no_cycle(tmp_path):
    root = write(tmp_path, {
        "submission.py": "from task import input_t\n",
        "task.py": "input_t = object\n",
        "nvfp4_group_gemm/__init__.py": "from .runtime import custom_kernel\n",
        "nvfp4_group_gemm/runtime.py": ("import submission\nfrom . import hopper\n"
                                        "from nvfp4_group_gemm.hopper import kernel\n"
                                        "custom_kernel = None\n"),
        "nvfp4_group_gemm/hopper/__init__.py": "",
        "nvfp4_group_gemm/hopper/kernel.py": "from .. import runtime_free\n",
        "nvfp4_group_gemm/runtime_free.py": "import importlib\n",
        "bench/peers.py": "from helpers import x\nimport submission\n",
        "bench/helpers.py": "x = 1\n",
        "examples/entry.py": "from nvfp4_group_gemm import custom_kernel\n",
    })
    _modules, edges = import_graph(root)
    pairs = {(edge.source, edge.target) for edge in edges}
    assert pairs == {
        ("submission", "task"),
        ("nvfp4_group_gemm", "nvfp4_group_gemm.runtime"),
        ("nvfp4_group_gemm.runtime", "submission"),
        ("nvfp4_group_gemm.runtime", "nvfp4_group_gemm.hopper"),
        ("nvfp4_group_gemm.runtime", "nvfp4_group_gemm.hopper.kernel"),
        ("nvfp4_group_gemm.hopper.kernel", "nvfp4_group_gemm.runtime_free"),
        ("bench/peers", "bench/helpers"),
        ("bench/peers", "submission"),
        ("examples/entry", "nvfp4_group_gemm"),
    }
    assert find_cycles(edges) == []
