"""Compare the PTX of two builds of the sm_100a kernels, kernel by kernel, up to names.

Dumps come from `python eval.py compile --dump-dir DIR` (build_report keeps one PTX per
`<module>.<kernel>.G<n>` folder). Kernels are paired by `<kernel>.G<n>`, so a moved module
still pairs. Before comparing, each PTX is normalised (`normalize_ptx`): comments, `.file`
and `.loc` lines, `.section .debug*` blocks and blank lines go, and every declared symbol
(`.entry`/`.func` names, which embed module names, argument signatures and counters, and
`.global`/`.const`/`.shared` variables) becomes SYM0, SYM1, ... in order of declaration.

    python bench/ptx_diff.py BASE_DUMP OTHER_DUMP      # two existing dumps
    python bench/ptx_diff.py BASE_DUMP --build         # build this tree's kernels, compare
    python bench/ptx_diff.py BASE_DUMP --build --out DIR   # ... and keep that build in DIR

A library entry of the other build (`<kernel>_on_stream`, nvfp4_group_gemm.sm100) with no
kernel of its name in the base is compared with the base's `<kernel>`: the same device code.

Prints `identical up to names` or a unified diff of the normalised PTX per kernel; exit 0 when
every kernel pairs and is identical, 1 otherwise. Only PTX whose `.target` is --arch
(default sm_100a) is compared.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

_DEBUG_SECTION = re.compile(r"^\s*\.section\s+\.debug\w*\s*\{.*?^\s*\}", re.MULTILINE | re.DOTALL)
_DROPPED_LINE = re.compile(r"^\s*\.(?:file|loc)\b")
_FUNCTION = re.compile(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)")
_VARIABLE = re.compile(
    r"^\s*(?:\.(?:visible|extern|weak)\s+)*\.(?:global|const|shared)\b"
    r"(?:\s+\.\w+(?:\s+\d+)?)*\s+([A-Za-z_$][\w$]*)",
    re.MULTILINE,
)


def normalize_ptx(text: str) -> str:
    """`text` without comments/debug lines, declared symbols renamed SYM0, SYM1, ..."""
    text = _DEBUG_SECTION.sub("", text.replace("\0", ""))
    lines = [re.sub(r"//.*", "", line).rstrip() for line in text.splitlines()]
    text = "\n".join(line for line in lines if line.strip() and not _DROPPED_LINE.match(line))
    declared = sorted(
        (m.start(1), m.group(1)) for pattern in (_FUNCTION, _VARIABLE) for m in pattern.finditer(text)
    )
    names: dict[str, str] = {}
    for _position, name in declared:
        names.setdefault(name, f"SYM{len(names)}")
    if not names:
        return text + "\n"
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    symbol = re.compile(rf"(?<![\w$])({alternatives})(?=_param_\d|[^\w$]|$)")
    return symbol.sub(lambda m: names[m.group(1)], text) + "\n"


def collect(dump: Path, arch: str) -> dict[str, Path]:
    """`<kernel>.G<n>` -> PTX file, for the PTX files under `dump` that target `arch`."""
    found: dict[str, Path] = {}
    for path in sorted(dump.rglob("*.ptx")):
        if not re.search(rf"^\s*\.target\s+{re.escape(arch)}\b", path.read_text(errors="replace"), re.MULTILINE):
            continue
        key = ".".join(path.parent.name.split(".")[-2:])
        if key in found:
            key = f"{key}/{path.name}"
        found[key] = path
    return found


def build(dump: Path, groups: str | None) -> None:
    """This tree's kernels, built with `eval.py compile` into `dump` (progress on stderr)."""
    command = [sys.executable, "eval.py", "compile", "--dump-dir", str(dump)]
    command += ["--groups", groups] if groups else []
    result = subprocess.run(command, check=False, cwd=REPO_ROOT, stdout=sys.stderr)
    if result.returncode:
        print(f"warning: {' '.join(command)} exited with {result.returncode}", file=sys.stderr)


# The library's entries of the same kernels (nvfp4_group_gemm.sm100: `<kernel>_on_stream`) must
# compile to the same device code as the leaderboard file's `<kernel>`
LIBRARY_SUFFIX = "_on_stream"


def base_key(key: str, base_keys) -> str:
    """The base kernel `key` of the other build is compared with: itself, or for a library
    entry the base has no kernel of that name for, the leaderboard kernel it launches."""
    if key in base_keys:
        return key
    kernel, _, groups = key.partition(".")
    return f"{kernel.removesuffix(LIBRARY_SUFFIX)}.{groups}"


def compare(base: Path, other: Path, arch: str, max_lines: int) -> bool:
    a, b = collect(base, arch), collect(other, arch)
    b_keys = set(b)
    for key in sorted(b_keys):
        paired = base_key(key, a)
        if paired != key and paired in a:
            a[key] = a[paired]
    if not a and not b:
        print(f"no {arch} PTX found in {base} or {other}")
        return False
    same = True
    for key in sorted(a.keys() | b.keys()):
        if key not in b or key not in a:
            print(f"{key}: only in {base if key in a else other}")
            same = False
            continue
        diff = list(difflib.unified_diff(
            normalize_ptx(a[key].read_text(errors="replace")).splitlines(),
            normalize_ptx(b[key].read_text(errors="replace")).splitlines(),
            str(a[key]), str(b[key]), lineterm="",
        ))
        if not diff:
            print(f"{key}: identical up to names")
            continue
        same = False
        print(f"{key}: DIFFERS ({len(diff)} diff lines)")
        print("\n".join(diff[:max_lines]) + (f"\n... {len(diff) - max_lines} more" if len(diff) > max_lines else ""))
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="dump folder of the base build")
    parser.add_argument("other", type=Path, nargs="?", help="dump folder to compare (or --build)")
    parser.add_argument("--build", action="store_true", help="build this tree's kernels and compare those")
    parser.add_argument("--out", type=Path, help="with --build: keep the build here (default: a temp folder)")
    parser.add_argument("--groups", help="with --build: group counts (eval.py compile's default: 1,2,8)")
    parser.add_argument("--arch", default="sm_100a", help="PTX .target to compare (default sm_100a)")
    parser.add_argument("--max-lines", type=int, default=200, help="diff lines shown per kernel")
    args = parser.parse_args(argv)
    if args.build == (args.other is not None):
        parser.error("give either OTHER or --build")
    if not args.build:
        return 0 if compare(args.base, args.other, args.arch, args.max_lines) else 1
    with tempfile.TemporaryDirectory(prefix="ptx_diff_") as temp:
        dump = args.out or Path(temp)
        build(dump, args.groups)
        return 0 if compare(args.base, dump, args.arch, args.max_lines) else 1


if __name__ == "__main__":
    sys.exit(main())
