"""The runtime's census: what a maintainer has to find and change in more than one place.

    python bench/census.py [ROOT ...]      # default: this repository

For each ROOT (a checkout of this project, say `git worktree add /tmp/old 572540a`) it prints,
from the source alone (ast, nothing imported):
  - plan and binding types: classes of the package named *Plan or *Binding;
  - module-level caches: module-level assignments of RuntimeCache(...), and of runtimes
    (Runtime(...) or a subclass of it) with the caches each holds;
  - resets: functions whose name starts with "reset" (public and private);
  - names defined in more than one module: functions and classes (top level) of the package
    defined in two or more of its modules;
  - private names read across modules: `module._name` reads and `from module import _name`
    of a project module, in the package, selfcheck.py and bench/ (torch's and the DSL's not
    counted);
  - the longest module of the package.
"""

import argparse
import ast
import collections
import pathlib
import sys

PROJECT_MODULES = ("nvfp4_group_gemm", "core", "runtime", "moe", "launch", "sm100", "sm100_moe", "hopper", "switches",
                   "op", "checkpoint", "moe_layer", "export", "routing", "expert_parallel", "submission", "backend",
                   "kernel", "swap_ab", "schedules", "config", "ptx", "bundle", "selfcheck")


# The types a runtime's plan and binding caches hold (the rest are backends' parts of a plan, or
# a size plan)
RUNTIME_TYPES = ("Plan", "Binding", "MoePlan", "MoeBinding", "Sm100MoePlan", "Sm100MoeBinding")


def package_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted((root / "nvfp4_group_gemm").rglob("*.py"))


def tool_files(root: pathlib.Path) -> list[pathlib.Path]:
    return [path for path in [root / "selfcheck.py", *sorted((root / "bench").glob("*.py"))]
            if path.exists() and path.name != "census.py"]


def census(root: pathlib.Path) -> dict:
    plan_types, caches, runtimes, resets = [], [], [], []
    defined = collections.defaultdict(set)
    private_reads = []
    longest = (0, "")
    runtime_classes = {"Runtime"}
    trees = {}
    for path in package_files(root):
        text = path.read_text(encoding="utf-8")
        module = path.relative_to(root).as_posix()
        longest = max(longest, (text.count("\n") + 1, module))
        trees[module] = ast.parse(text)
        for node in ast.walk(trees[module]):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(base, "attr", getattr(base, "id", None)) in runtime_classes for base in node.bases):
                runtime_classes.add(node.name)
    for module, tree in trees.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined[node.name].add(module)
                if isinstance(node, ast.ClassDef) and node.name.endswith(("Plan", "Binding")) and not node.name.startswith(
                        ("Backend", "_")):
                    bases = [ast.unparse(base) for base in node.bases]
                    extends = [base for base in bases if base.endswith(("Plan", "Binding"))]
                    plan_types.append(f"{module}:{node.name}" + (f" (extends {', '.join(extends)})" if extends else ""))
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_").startswith("reset"):
                resets.append(f"{module}:{node.name}")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                func = node.value.func
                called = getattr(func, "attr", getattr(func, "id", None))
                target = ", ".join(ast.unparse(t) for t in node.targets)
                if called == "RuntimeCache":
                    caches.append(f"{module}:{target}")
                elif called in runtime_classes:
                    runtimes.append(f"{module}:{target} ({called})")
    for path in [*package_files(root), *tool_files(root)]:
        module = path.relative_to(root).as_posix()
        tree = trees.get(module) or ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in PROJECT_MODULES:
                    private_reads.append(f"{module}: {owner.id}.{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").split(".")[0] in PROJECT_MODULES):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private_reads.append(f"{module}: from {'.' * node.level}{node.module or ''} import {alias.name}")
    multiply_defined = {name: sorted(modules) for name, modules in defined.items() if len(modules) > 1}
    runtime_types = [t for t in plan_types if t.split(":")[1].split(" ")[0] in RUNTIME_TYPES]
    return {"plan and binding types": sorted(plan_types),
            "  of them what a runtime caches, not extending another": sorted(
                t for t in runtime_types if "extends" not in t),
            "module-level RuntimeCaches": sorted(caches),
            "runtimes": sorted(runtimes), "resets": sorted(resets), "names defined in more than one module":
            multiply_defined, "private names read across modules": sorted(set(private_reads)),
            "longest module": f"{longest[1]} ({longest[0]} lines)"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", default=[str(pathlib.Path(__file__).resolve().parent.parent)])
    parser.add_argument("-v", "--verbose", action="store_true", help="list every item, not only the counts")
    args = parser.parse_args(argv)
    for root in map(pathlib.Path, args.roots):
        result = census(root)
        print(f"== {root}")
        for what, items in result.items():
            if isinstance(items, str):
                print(f"{what}: {items}")
                continue
            print(f"{what}: {len(items)}")
            if args.verbose:
                for item in items:
                    print(f"    {item}" if not isinstance(items, dict) else f"    {item}: {', '.join(items[item])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
