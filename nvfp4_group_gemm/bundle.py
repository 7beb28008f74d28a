"""Builds ``submission.py``, the leaderboard file, from the package: the rooms of the core
(``nvfp4_group_gemm/core/``: the sm_100a kernels, validation, the fallback chain and its
self-check, the caches, ``custom_kernel``) concatenated in dependency order behind a header
that names their source. The bot receives one self-contained file; the package keeps the one
copy of its logic.

    python -m nvfp4_group_gemm.bundle            # write submission.py in the current folder
    python -m nvfp4_group_gemm.bundle --check    # exit 1 if submission.py differs from the bundle

The file: the header, the core's docstring (``core/__init__.py``'s), every room's imports of
other packages merged into one block at the top (their imports of each other dropped: in one
file a room's names are simply there), then each room's body in the order of ``ROOMS`` (read
from ``core/__init__.py``), under a banner naming the room and its docstring as comments.
Nothing of ``core/__init__.py`` but its docstring is bundled: its one-namespace machinery is
what the single file is by construction. Text only: nothing here imports the core.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().with_name("core")
SOURCE = "nvfp4_group_gemm/core/"
HEADER = (
    "# GPU MODE nvfp4_group_gemm leaderboard file: the rooms of nvfp4_group_gemm/core/, bundled by\n"
    "# `python -m nvfp4_group_gemm.bundle`. Edit those modules and bundle again; the tests fail\n"
    "# while this file differs from the bundle.\n"
)
BANNER = "# " + "=" * 77 + "\n"


def rooms() -> list[str]:
    """The rooms' module names in dependency order: core/__init__.py's ROOMS tuple."""
    tree = ast.parse((CORE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ROOMS" for t in node.targets):
            return [element.id for element in node.value.elts]
    raise ValueError(f"{CORE / '__init__.py'} has no ROOMS tuple")


def _is_import_block(node: ast.stmt) -> bool:
    """An import, or a guarded one (try: import ... except ImportError: ...)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    return isinstance(node, ast.Try) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body)


def _split(text: str) -> tuple[str, list[ast.stmt], str]:
    """(docstring, its leading import statements, the rest of the text) of one module."""
    tree = ast.parse(text)
    body = tree.body
    docstring = ast.get_docstring(tree, clean=False) or ""
    start = 1 if docstring else 0
    imports = []
    for node in body[start:]:
        if not _is_import_block(node):
            break
        imports.append(node)
    lines = text.splitlines(keepends=True)
    end = imports[-1].end_lineno if imports else (body[0].end_lineno if docstring else 0)
    for node in body:  # every intra-package import is in the leading block (a room's imports)
        if isinstance(node, ast.ImportFrom) and node.level and node not in imports:
            raise ValueError(f"a relative import outside the leading block, line {node.lineno}")
    return docstring, imports, "".join(lines[end:]).strip("\n") + "\n"


class _Imports:
    """The external imports of every room, merged: `import x` and `from m import a, b`
    (unaliased names of one module joined), stdlib first, then the rest, each sorted; guarded
    imports (try blocks) after them, once each."""

    def __init__(self):
        self.plain: set[str] = set()
        self.names: dict[str, set[str]] = {}
        self.aliased: set[tuple[str, str]] = set()
        self.guarded: list[str] = []

    def add(self, node: ast.stmt, text: str) -> None:
        if isinstance(node, ast.Import):
            self.plain.update(f"{a.name} as {a.asname}" if a.asname else a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                return  # one room importing another: in one file the names are there
            for a in node.names:
                if a.asname:
                    self.aliased.add((node.module, f"{a.name} as {a.asname}"))
                else:
                    self.names.setdefault(node.module, set()).add(a.name)
        else:
            segment = ast.get_source_segment(text, node)
            if segment not in self.guarded:
                self.guarded.append(segment)

    def text(self) -> str:
        def stdlib(module: str) -> bool:
            return module.split(".")[0] in sys.stdlib_module_names

        sections = []
        for in_stdlib in (True, False):
            lines = [f"import {name}" for name in sorted(self.plain) if stdlib(name) == in_stdlib]
            froms = [(module, ", ".join(sorted(names))) for module, names in self.names.items()]
            froms += list(self.aliased)
            lines += [f"from {module} import {names}" for module, names in sorted(froms) if stdlib(module) == in_stdlib]
            if lines:
                sections.append("\n".join(lines) + "\n")
        sections += [segment + "\n" for segment in self.guarded]
        return "\n".join(sections)


def bundled_text() -> str:
    """The leaderboard file's text: the header, the core's docstring, the merged imports, then
    each room's body in dependency order."""
    init_text = (CORE / "__init__.py").read_text(encoding="utf-8")
    tree = ast.parse(init_text)
    docstring_node = tree.body[0]
    docstring = "".join(init_text.splitlines(keepends=True)[docstring_node.lineno - 1:docstring_node.end_lineno])
    imports = _Imports()
    bodies = []
    for room in rooms():
        text = (CORE / f"{room}.py").read_text(encoding="utf-8")
        room_doc, room_imports, body = _split(text)
        for node in room_imports:
            imports.add(node, text)
        comment = "".join(f"# {line}".rstrip() + "\n" for line in room_doc.strip().splitlines())
        bodies.append(f"{BANNER}# {SOURCE}{room}.py\n{comment}{BANNER}{body}")
    return HEADER + docstring + "\n" + imports.text() + "\n\n" + "\n\n".join(bodies)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvfp4_group_gemm.bundle", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="submission.py", help="the file to write or check (default submission.py)")
    parser.add_argument("--check", action="store_true", help="only compare: exit 1 if the file differs from the bundle")
    args = parser.parse_args(argv)
    out = Path(args.out)
    text = bundled_text()
    if args.check:
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            print(f"bundle: {out} differs from {SOURCE} bundled; run `python -m nvfp4_group_gemm.bundle`",
                  file=sys.stderr)
            return 1
        print(f"bundle: {out} is the bundle of {SOURCE}")
        return 0
    out.write_text(text, encoding="utf-8")
    print(f"bundle: wrote {out} ({len(text.encode())} bytes) from {SOURCE} ({len(rooms())} rooms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
