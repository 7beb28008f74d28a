"""``python eval.py gate [FILE]``: the leaderboard bot's checks on a file, before you submit it.

FILE defaults to submission.py. One line per check (`ok` or `FAIL`, the check's name, what was
found), the offending lines under a failed check, then a closing line; exit 0 when every check
passed, 1 otherwise, 2 when the command cannot run as asked (one line on stderr).

The checks, in the order the bot meets them (sources: docs/EVAL.md, "The leaderboard's gate"):
  size         at most 1,000,000 bytes and not empty (kernelbot api_utils.py: HTTP 413 above)
  utf-8        the bytes decode as UTF-8 (kernelbot, kernelboard lib/file_handler.py)
  control      no control byte other than tab, newline, carriage return (kernelboard)
  syntax       ast.parse succeeds (kernelboard)
  stream       no `stream` in any case anywhere, comments and strings included (kernelbot
               api_utils.py:272 and cogs/leaderboard_cog.py:112: `"stream" in code.lower()`)
  entry        a top-level `custom_kernel` taking one positional argument (the harness calls
               custom_kernel(data) from the file's module)
  imports      every import (inside functions too) is of the standard library or a runner
               package: torch, cutlass, cuda (cuda-python), numpy, triton, or a file the runner
               puts beside the submission: task, utils, reference (this project's policy: what
               every B200 runner has had; the runner supplies no other file of ours)
  compile      `python3 submission.py` (the runner's compile step) exits 0 within 120 s, run
               in a fresh folder holding the file as submission.py beside task.py, utils.py
               and reference.py, as on the runner (kernelbot run_eval.py, consts.py)
  kernelguard  `kernelguard --api-mode` on the text: no `should_filter: true` and no
               classification `hacked` (kernelbot src/libkernelbot/kernelguard.py, pinned
               kernelguard==0.3.1; pip install kernelguard==0.3.1)
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent
DEFAULT_FILE = REPO_ROOT / "submission.py"

MAX_BYTES = 1_000_000  # kernelbot api_utils.py, kernelboard MAX_CONTENT_LENGTH
# kernelboard lib/file_handler.py's _TEXT_CTRL_RE: control bytes other than \t \n \r
CONTROL_BYTES = re.compile(rb"[\x00-\x08\x0B\x0C\x0E-\x1F]")
FORBIDDEN_WORD = "stream"
# what the harness imports from the file and calls with one argument, the input set
ENTRY = "custom_kernel"
# Packages on the runner (torch, the CuTe DSL, cuda-python, numpy, triton) and the files the
# runner puts beside submission.py (it supplies eval.py too: a submission has no business there)
RUNNER_PACKAGES = ("torch", "cutlass", "cuda", "numpy", "triton")
RUNNER_FILES = ("task", "utils", "reference")
COMPILE_TIMEOUT_S = 120.0  # kernelbot consts.py: the compile step's limit
KERNELGUARD_VERSION = "0.3.1"  # the bot's pin


@dataclass
class Check:
    name: str
    passed: bool | None  # None: not run (an earlier check it needs failed)
    summary: str
    details: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """`ok  `, `FAIL` or `skip`, the check and what it found; then every offending line."""
        status = {True: "ok  ", False: "FAIL", None: "skip"}[self.passed]
        return [f"{status} {self.name}: {self.summary}", *(f"       {line}" for line in self.details)]


def _excerpt(line: str, width: int = 100) -> str:
    """A source line for a detail: stripped, whole when short, else its start and a marker
    (cut at a word boundary where there is one)."""
    line = line.strip()
    if len(line) <= width:
        return line
    cut = line.rfind(" ", 0, width)
    return line[: cut if cut > width // 2 else width] + " [...]"


def check_size(data: bytes) -> Check:
    size = len(data)
    if size == 0:
        return Check("size", False, "the file is empty; the bot refuses an empty file")
    if size > MAX_BYTES:
        return Check("size", False, f"{size:,} bytes; the limit is {MAX_BYTES:,} (the bot answers "
                                    "HTTP 413)")
    return Check("size", True, f"{size:,} bytes (limit {MAX_BYTES:,})")


def check_utf8(data: bytes) -> tuple[Check, str | None]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        return Check("utf-8", False, f"not valid UTF-8: byte {data[error.start]:#04x} at offset "
                                     f"{error.start} (line {line}): {error.reason}"), None
    return Check("utf-8", True, "valid UTF-8"), text


def check_control_bytes(data: bytes) -> Check:
    found = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        codes = sorted({match.group()[0] for match in CONTROL_BYTES.finditer(line)})
        if codes:
            found.append(f"line {number}: " + ", ".join(f"{code:#04x}" for code in codes))
    if found:
        return Check("control", False, f"control bytes on {len(found)} line"
                                       f"{'s' * (len(found) != 1)} (only tab, newline and "
                                       "carriage return are allowed)", found)
    return Check("control", True, "no control bytes other than tab, newline, carriage return")


def check_syntax(text: str, name: str) -> tuple[Check, ast.Module | None]:
    try:
        tree = ast.parse(text, filename=name)
    except SyntaxError as error:
        return Check("syntax", False, f"ast.parse fails: {error.msg} at line {error.lineno}"), None
    return Check("syntax", True, "ast.parse succeeds"), tree


def check_entry(tree: ast.Module) -> Check:
    """The harness calls `custom_kernel(data)` from the file's module: a top-level function (or
    a name bound at top level, such as an import) taking one positional argument."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == ENTRY:
            arguments = node.args
            positional = arguments.posonlyargs + arguments.args
            required = len(positional) - len(arguments.defaults)
            takes_one = (required <= 1 and (len(positional) >= 1 or arguments.vararg is not None)
                         and not any(default is None for default in arguments.kw_defaults))
            if isinstance(node, ast.AsyncFunctionDef):
                return Check("entry", False, f"`{ENTRY}` at line {node.lineno} is async: the harness calls it")
            if not takes_one:
                return Check("entry", False, f"`def {ENTRY}` at line {node.lineno} does not take one positional "
                                             "argument: the harness calls custom_kernel(data)")
            return Check("entry", True, f"`def {ENTRY}(...)` at line {node.lineno} takes one positional argument")
        bound = _bound_names(node)
        if ENTRY in bound:
            return Check("entry", True, f"`{ENTRY}` bound at line {node.lineno} (not a def: its arguments are "
                                        "checked when the harness calls it)")
    return Check("entry", False, f"no top-level `{ENTRY}`: the harness imports custom_kernel from the file")


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {target.id for target in targets if isinstance(target, ast.Name)}
    return set()


def check_stream(text: str) -> Check:
    found = [f"line {number}: {_excerpt(line)}"
             for number, line in enumerate(text.splitlines(), start=1)
             if FORBIDDEN_WORD in line.lower()]
    if FORBIDDEN_WORD in text.lower():
        return Check("stream", False,
                     f"`{FORBIDDEN_WORD}` (any case) on {len(found)} line"
                     f"{'s' * (len(found) != 1)}; the bot refuses the file: \"Your code contains "
                     "work on another stream\"", found)
    return Check("stream", True, f"no `{FORBIDDEN_WORD}` in any case")


def allowed_module(name: str) -> bool:
    """Whether a top-level module name is one the runner has."""
    return name in sys.stdlib_module_names or name in RUNNER_PACKAGES or name in RUNNER_FILES


def imports_of(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module as written) of every import statement, at any depth (functions, classes,
    try blocks), relative ones with their dots; and of `importlib.import_module("x")` and
    `__import__("x")` with a constant name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id == "__import__")
                   or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                       and isinstance(node.func.value, ast.Name)
                       and node.func.value.id == "importlib"))):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def check_imports(tree: ast.AST, text: str) -> Check:
    source = text.splitlines()
    bad = []
    for line, module in imports_of(tree):
        top = module.split(".")[0]
        if module.startswith(".") or not allowed_module(top):
            why = "a relative import" if module.startswith(".") else f"`{top}` is not on the runner"
            bad.append(f"line {line}: {_excerpt(source[line - 1])}  ({why})")
    allowed = ", ".join(RUNNER_PACKAGES + RUNNER_FILES)
    if bad:
        return Check("imports", False, f"{len(bad)} import{'s' * (len(bad) != 1)} of modules the "
                                       f"runner lacks (allowed: the standard library, {allowed})",
                     bad)
    return Check("imports", True, f"only the standard library and {allowed}")


def check_compile(data: bytes, timeout_s: float) -> Check:
    """`python3 submission.py` as the runner's compile step runs it: in a fresh folder holding
    the file as submission.py and the files the runner supplies (task.py, utils.py,
    reference.py), no PYTHONPATH, within `timeout_s` seconds; the process group is killed on
    expiry."""
    with tempfile.TemporaryDirectory(prefix="gate-compile-") as folder:
        (Path(folder) / "submission.py").write_bytes(data)
        for name in RUNNER_FILES:
            shutil.copyfile(REPO_ROOT / f"{name}.py", Path(folder) / f"{name}.py")
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        start = time.monotonic()
        process = subprocess.Popen([sys.executable, "submission.py"], cwd=folder, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   stdin=subprocess.DEVNULL, text=True, errors="replace",
                                   start_new_session=True)
        try:
            _out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return Check("compile", False, f"`python3 submission.py` did not finish within "
                                           f"{timeout_s:g} s (the runner's limit is "
                                           f"{COMPILE_TIMEOUT_S:g} s); killed")
        elapsed = time.monotonic() - start
    if process.returncode != 0:
        tail = [line for line in err.strip().splitlines() if line.strip()][-6:]
        return Check("compile", False, f"`python3 submission.py` exited with code "
                                       f"{process.returncode} after {elapsed:.1f} s", tail)
    return Check("compile", True, f"`python3 submission.py` exited 0 in {elapsed:.1f} s "
                                  f"(limit {timeout_s:g} s)")


def kernelguard_command() -> list[str] | None:
    """kernelguard's command line tool: beside this Python first (a virtual environment that
    is not activated), else on PATH; None when it is not installed."""
    for folder in (Path(sys.executable).parent, None):
        for name in ("kernelguard", "kguard"):
            found = shutil.which(name, path=str(folder) if folder else None)
            if found:
                return [found]
    return None


def kernelguard_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("kernelguard")
    except metadata.PackageNotFoundError:
        return None


def check_kernelguard(text: str) -> Check:
    """The bot's kernelguard pre-check: the text on stdin of `kernelguard --api-mode`, the
    last non-empty line of its output read as JSON (as kernelbot does)."""
    command = kernelguard_command()
    if command is None:
        return Check("kernelguard", False, f"kernelguard is not installed: pip install "
                                           f"kernelguard=={KERNELGUARD_VERSION} (or pip install "
                                           "-e '.[test]')")
    version = kernelguard_version() or "version unknown"
    try:
        process = subprocess.run([*command, "--api-mode"], input=text, text=True,
                                 capture_output=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        return Check("kernelguard", False, "kernelguard did not answer within 300 s")
    lines = [line for line in process.stdout.splitlines() if line.strip()]
    result = None
    if process.returncode == 0 and lines:
        try:
            result = json.loads(lines[-1])
        except ValueError:
            result = None
    if not isinstance(result, dict):
        tail = (process.stderr.strip() or process.stdout.strip()).splitlines()[-3:]
        return Check("kernelguard", False, f"kernelguard {version} failed (exit "
                                           f"{process.returncode}) without a verdict", tail)
    patterns = [item for item in result.get("matched_patterns", []) if isinstance(item, dict)]
    # each pattern with kernelguard's reason for it (its evidence)
    details = [f"{item.get('pattern', '?')} ({item.get('severity', '?')} severity): matched because "
               f"{item.get('evidence') or 'kernelguard gave no evidence'}" for item in patterns]
    classification = str(result.get("classification", "unknown"))
    should_filter = bool(result.get("should_filter"))
    pin = "" if version == KERNELGUARD_VERSION else f"; the bot pins {KERNELGUARD_VERSION}"
    passed = not should_filter and classification != "hacked"
    # the verdict first: kept unless should_filter (the bot refuses then) or classified hacked
    if should_filter:
        verdict = "refused: should_filter true" + (f" ({result['filter_reason']})" if result.get("filter_reason") else "")
    elif classification == "hacked":
        verdict = "refused: classification hacked"
    else:
        verdict = "kept: should_filter false"
    names = ", ".join(str(item.get("pattern", "?")) for item in patterns) or "none"
    summary = (f"{verdict}; classification {classification} (kernelguard {version}{pin}); patterns: {names}"
               + ("; a pattern alone does not refuse a file, the bot acts on should_filter" if patterns and passed
                  else ""))
    return Check("kernelguard", passed, summary, details)


def iter_checks(path: Path, compile_timeout_s: float = COMPILE_TIMEOUT_S):
    """Every check on the file at `path`, in the bot's order, each as soon as it is done; a
    check that needs the text or the syntax tree is skipped when those are not available."""
    data = path.read_bytes()
    size = check_size(data)
    yield size
    utf8, text = check_utf8(data)
    yield utf8
    yield check_control_bytes(data)
    tree = None
    if text is None:
        yield Check("syntax", None, "not checked: the file is not UTF-8")
        yield Check("stream", None, "not checked: the file is not UTF-8")
    else:
        syntax, tree = check_syntax(text, path.name)
        yield syntax
        yield check_stream(text)
    yield (check_entry(tree) if tree is not None else Check("entry", None, "not checked: the file does not parse"))
    yield (check_imports(tree, text) if tree is not None
           else Check("imports", None, "not checked: the file does not parse"))
    # The bot refuses a file of the wrong size before it runs or reads anything else
    if not size.passed:
        yield Check("compile", None, "not checked: the bot refuses the file's size first")
        yield Check("kernelguard", None, "not checked: the bot refuses the file's size first")
        return
    yield check_compile(data, compile_timeout_s)
    yield (check_kernelguard(text) if text is not None
           else Check("kernelguard", None, "not checked: the file is not UTF-8"))


def run_checks(path: Path, compile_timeout_s: float = COMPILE_TIMEOUT_S) -> list[Check]:
    return list(iter_checks(path, compile_timeout_s))


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="eval.py gate",
        description="The leaderboard bot's checks on a file before you submit it: size, UTF-8, "
                    "control bytes, syntax, no `stream` in any case, imports the runner has, "
                    "`python3 FILE` within 120 s, kernelguard's verdict. One line per check; "
                    "exit 0 when all pass, 1 otherwise.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    parser.add_argument("file", nargs="?", default=str(DEFAULT_FILE),
                        help="the file to check (default: submission.py)")
    parser.add_argument("--compile-timeout", type=float, default=COMPILE_TIMEOUT_S, metavar="S",
                        help=f"seconds `python3 FILE` may take (default {COMPILE_TIMEOUT_S:g}, "
                             "the runner's limit)")
    args = parser.parse_args(argv)
    if not args.compile_timeout > 0:
        parser.error(f"--compile-timeout {args.compile_timeout:g}: expected a number of "
                     "seconds > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    path = Path(args.file)
    if not path.is_file():
        print(f"gate: {args.file}: no such file", file=sys.stderr)
        return 2
    print(f"gate: {args.file} (the leaderboard bot's checks)", flush=True)
    checks = []
    for check in iter_checks(path, args.compile_timeout):
        checks.append(check)
        print("\n".join(check.lines()), flush=True)
    failed = [check.name for check in checks if check.passed is False]
    skipped = [check.name for check in checks if check.passed is None]
    if failed or skipped:
        not_checked = f"; not checked: {', '.join(skipped)}" if skipped else ""
        print(f"gate: FAIL ({', '.join(failed)}{not_checked}): fix {args.file} before "
              "submitting it", flush=True)
        return 1
    print(f"gate: ok, all {len(checks)} checks passed: {args.file}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
