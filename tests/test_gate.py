"""`python eval.py gate FILE`: the leaderboard bot's checks. One crafted file per rule (each
breaks that rule alone), a clean file that passes every check, and the command line; and what
.ci/run checks on submission.py besides (the gate, both runners' DSL releases, no
DeprecationWarning from our code under 4.5.2)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gate

REPO_ROOT = Path(__file__).resolve().parents[1]

# A submission the bot accepts; it imports no torch, so that `python3 FILE` (the compile
# step) takes a fraction of a second
CLEAN = '''"""A submission the bot accepts."""
import math


def custom_kernel(data):
    abc, _sfs, _sfs_reordered, _sizes = data
    return [c.zero_() for _a, _b, c in abc]


SCALE = math.sqrt(2.0)
'''

NEXT = len(CLEAN.splitlines()) + 1  # the number of a line added after CLEAN

# One file per rule, each breaking that rule alone: (name, content, the failing check, text
# that its FAIL line or its details hold)
VIOLATIONS = [
    ("too_big", CLEAN + "#" * (1_000_000 - len(CLEAN)) + "\n",  # one byte over
     "size", "1,000,001 bytes; the limit is 1,000,000"),
    ("bad_utf8", CLEAN.encode() + b"# caf\xe9\n", "utf-8",
     f"not valid UTF-8: byte 0xe9 at offset {len(CLEAN) + 5} (line {NEXT})"),
    ("control_byte", CLEAN + "X = 1\x0c\n", "control", f"line {NEXT}: 0x0c"),
    ("syntax_error", CLEAN + "def broken(:\n", "syntax",
     f"ast.parse fails: invalid syntax at line {NEXT}"),
    ("stream_in_comment", CLEAN + "# the harness times the default Stream\n", "stream",
     f"line {NEXT}: # the harness times the default Stream"),
    ("imports_numpyx", CLEAN.replace("import math\n", "import math\nimport numpyx\n"), "imports",
     "line 3: import numpyx  (`numpyx` is not on the runner)"),
    ("imports_requests_lazily",
     CLEAN + "\n\ndef fetch():\n    import requests.adapters\n    return requests\n",
     "imports", f"line {NEXT + 3}: import requests.adapters  (`requests` is not on the runner)"),
    ("sleeps", CLEAN + "import time\ntime.sleep(30)\n", "compile",
     "`python3 submission.py` did not finish within 2 s (the runner's limit is 120 s); killed"),
    ("exits_with_3", CLEAN + "raise SystemExit(3)\n", "compile",
     "`python3 submission.py` exited with code 3"),
    ("patches_the_timer", CLEAN + "\n\ndef cheat():\n    import torch\n\n"
                                  "    torch.cuda.Event.elapsed_time = lambda self, end: 1.0\n",
     "kernelguard", ("refused: should_filter true (high_critical); classification hacked (kernelguard "
                    "0.3.1); patterns: TIMER_MONKEYPATCH")),
    ("no_entry", CLEAN.replace("def custom_kernel(data):", "def kernel(data):"), "entry",
     "no top-level `custom_kernel`: the harness imports custom_kernel from the file"),
    ("entry_of_two_arguments", CLEAN.replace("def custom_kernel(data):", "def custom_kernel(data, extra):"),
     "entry", "`def custom_kernel` at line 5 does not take one positional argument"),
]


def craft(tmp_path: Path, name: str, content) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def run_gate(*args: str, timeout: float = 120):
    return subprocess.run([sys.executable, "eval.py", "gate", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


needs_kernelguard = pytest.mark.skipif(
    gate.kernelguard_command() is None,
    reason="kernelguard is not installed (pip install -e '.[test]' installs it)")


@needs_kernelguard
def test_a_clean_file_passes_every_check(tmp_path):
    completed = run_gate(str(craft(tmp_path, "clean", CLEAN)))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[1:-1]] == [
        "ok   size", "ok   utf-8", "ok   control", "ok   syntax", "ok   stream", "ok   entry", "ok   imports",
        "ok   compile", "ok   kernelguard"]
    assert "ok   kernelguard: kept: should_filter false; classification valid" in completed.stdout
    assert lines[-1] == f"gate: ok, all 9 checks passed: {tmp_path / 'clean.py'}"


@pytest.mark.parametrize(("name", "content", "rule", "found"), VIOLATIONS,
                         ids=[v[0] for v in VIOLATIONS])
def test_each_rule_fails_its_own_file(tmp_path, capsys, name, content, rule, found):
    if rule == "kernelguard" and gate.kernelguard_command() is None:
        pytest.skip("kernelguard is not installed (pip install -e '.[test]' installs it)")
    path = craft(tmp_path, name, content)
    start = time.monotonic()
    status = gate.main([str(path), "--compile-timeout", "2"])
    elapsed = time.monotonic() - start
    out = capsys.readouterr().out
    assert status == 1, out
    fails = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert fails and fails[0].startswith(f"FAIL {rule}: "), out
    # the rule's own FAIL line and its details name what was found
    assert found in out[out.index(fails[0]):], out
    assert out.splitlines()[-1].startswith(f"gate: FAIL ({rule}")
    if name == "sleeps":
        assert elapsed < 15  # killed at the limit, not after its 30 s sleep


def test_a_rule_that_needs_the_text_is_skipped_not_passed(tmp_path, capsys):
    path = craft(tmp_path, "bad_utf8", CLEAN.encode() + b"\xff\n")
    assert gate.main([str(path), "--compile-timeout", "5"]) == 1
    out = capsys.readouterr().out
    assert "skip stream: not checked: the file is not UTF-8" in out
    assert "skip kernelguard: not checked: the file is not UTF-8" in out
    # Python refuses to run a file that is not UTF-8: the compile step fails too
    assert out.splitlines()[-1].startswith("gate: FAIL (utf-8, compile; not checked: syntax, "
                                           "stream, entry, imports, kernelguard)")


def test_every_line_with_stream_is_listed_with_its_number(tmp_path):
    text = "x = 1\n# STREAM one\ny = 'upstream'\nz = 2\ncuda_Stream = 3\n"
    check = gate.check_stream(text)
    assert not check.passed and check.summary.startswith("`stream` (any case) on 3 lines")
    assert check.details == ["line 2: # STREAM one", "line 3: y = 'upstream'",
                             "line 5: cuda_Stream = 3"]
    assert gate.check_stream("x = 1\n").passed


def test_imports_at_any_depth_and_relative_ones_are_read():
    import ast

    tree = ast.parse("import os, torch.nn\nfrom . import sibling\nclass K:\n"
                     "    def f(self):\n        from cutlass.cute import nvgpu\n"
                     "        import importlib\n        importlib.import_module('yaml')\n"
                     "        __import__('cuda.bindings.driver')\n")
    assert gate.imports_of(tree) == [(1, "os"), (1, "torch.nn"), (2, "."),
                                     (5, "cutlass.cute"), (6, "importlib"), (7, "yaml"),
                                     (8, "cuda.bindings.driver")]
    check = gate.check_imports(tree, ast.unparse(tree))
    assert not check.passed
    assert [detail.split("(")[-1] for detail in check.details] == [
        "a relative import)", "`yaml` is not on the runner)"]


def test_the_runner_files_are_allowed_and_its_eval_is_not():
    assert all(gate.allowed_module(name) for name in
               ("task", "utils", "reference", "torch", "cutlass", "cuda", "numpy", "triton",
                "os", "collections", "__future__"))
    assert not any(gate.allowed_module(name) for name in
                   ("eval", "submission", "nvfp4_group_gemm", "requests", "numpyx"))


def test_without_kernelguard_its_check_fails_and_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(gate, "kernelguard_command", lambda: None)
    check = gate.check_kernelguard(CLEAN)
    assert check.passed is False
    assert check.summary.startswith("kernelguard is not installed: pip install kernelguard==0.3.1")


@needs_kernelguard
def test_kernelguard_reports_each_pattern_it_matched():
    check = gate.check_kernelguard(CLEAN + "torch.cuda.Event.elapsed_time = lambda s, e: 1.0\n")
    assert check.passed is False
    assert check.details == [("TIMER_MONKEYPATCH (critical severity): matched because "
                              "torch.cuda.Event.elapsed_time method patched")]
    kept = gate.check_kernelguard(CLEAN + "import torch\nSCALED = torch._scaled_mm\n")
    assert kept.passed and kept.summary.startswith("kept: should_filter false"), kept.summary


def test_the_compile_step_runs_beside_the_runners_files_only(tmp_path):
    """The runner's folder holds submission.py, task.py, utils.py, reference.py: a file that
    imports a project module that the runner lacks fails there even though this repository
    has it."""
    ok = gate.check_compile(CLEAN.encode() + b"import reference, utils\n", 60)
    assert ok.passed, ok.details
    missing = gate.check_compile(b"import case_files\n", 60)
    assert missing.passed is False and "exited with code 1" in missing.summary
    assert missing.details[-1] == "ModuleNotFoundError: No module named 'case_files'"


def test_eval_py_gate_help_lists_every_check():
    shown = run_gate("--help", timeout=60)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: eval.py gate [-h]")
    for word in ("--compile-timeout", "size", "utf-8", "control", "syntax", "stream", "imports",
                 "compile", "kernelguard"):
        assert word in shown.stdout


def test_a_missing_file_or_a_bad_timeout_is_one_line_and_exit_2(tmp_path, capsys):
    assert gate.main([str(tmp_path / "absent.py")]) == 2
    assert capsys.readouterr().err == f"gate: {tmp_path / 'absent.py'}: no such file\n"
    with pytest.raises(SystemExit) as raised:
        gate.main(["x.py", "--compile-timeout", "0"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err == ("eval.py gate: --compile-timeout 0: expected a number of seconds > 0 "
                   "(--help lists the options)\n")


def test_ci_runs_the_gate_on_submission_py():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "\npython eval.py gate submission.py\n" in ci


def test_ci_checks_both_runners_dsl_releases():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "RUNNER_DSL=4.5.2" in ci and "NEWEST_DSL=4.8.1" in ci
    assert 'compile_report "$RUNNER_VENV" "$RUNNER_DSL"' in ci and 'compile_report "$NEWEST_VENV" "$NEWEST_DSL"' in ci
    # compile_report: the table to a file; every kernel at G = 1 and 8 there (the tests build G = 2 too)
    assert '"$1/bin/python" eval.py compile --groups "$COMPILE_GROUPS" > "$report"' in ci
    assert "\nCOMPILE_GROUPS=1,8\n" in ci
    # every pip call goes through `quiet` (pip's notes on absent local index folders dropped)
    pip_lines = [line for line in ci.splitlines() if "pip " in line and "install" in line
                 or "pip index" in line]
    assert pip_lines and all("quiet " in line for line in pip_lines), pip_lines


def test_ci_runs_the_other_releases_beside_the_tests_and_fails_on_either():
    """.ci/run: the other releases' stream (both compile checks, their flow tests, the wheel's
    smoke test) starts before the tests, in a process group of its own that the script's exit
    ends; its output follows the tests'; the exit status fails when either failed."""
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    body = ci[ci.index("other_releases() {"):ci.index("\n}\n", ci.index("other_releases() {"))]
    for step in ('compile_report "$RUNNER_VENV" "$RUNNER_DSL"', 'compile_report "$NEWEST_VENV" "$NEWEST_DSL"',
                 'flow_tests "$RUNNER_VENV"', 'flow_tests "$NEWEST_VENV"', ".ci/wheel_smoke.py"):
        assert step in body, step
    order = [ci.index(text) for text in (
        "python -m pip wheel -q --no-deps -w build/wheel .",  # built before the stream starts
        "set -m\n( other_releases ) > \"$others_log\" 2>&1 < /dev/null &\nothers=$!\nset +m\n",
        "trap 'kill -- -\"$others\" 2>/dev/null || true' EXIT",
        "python -m pytest -q tests || tests_status=$?",
        'wait "$others" || others_status=$?',
        'cat "$others_log"',
    )]
    assert order == sorted(order), order
    assert ci.rstrip().endswith('[ "$tests_status" -eq 0 ] && [ "$others_status" -eq 0 ]')


def test_ci_deprecation_hook_records_the_projects_warnings_only(tmp_path):
    """.ci/deprecations/sitecustomize.py (PYTHONPATH in the 4.5.2 step): a DeprecationWarning
    reported against a project file is written to the log, in child processes too; one
    reported against a library's file or code made at run time (`<string>`) is not."""
    project = tmp_path / "project"
    library = tmp_path / "site-packages"
    project.mkdir()
    library.mkdir()
    (library / "dsl.py").write_text(
        "import warnings\n"
        "def old_api():\n"
        "    warnings.warn('old_api is deprecated', DeprecationWarning, stacklevel=2)\n"
        "warnings.warn('the library itself', DeprecationWarning)\n")
    (project / "kernel.py").write_text(
        "import subprocess, sys\n"
        "import dsl\n"
        "dsl.old_api()\n"
        "exec(\"import warnings\\nwarnings.warn('made at run time', DeprecationWarning)\")\n"
        "subprocess.run([sys.executable, 'child.py'], check=True)\n")
    (project / "child.py").write_text("import dsl\n\n\ndsl.old_api()\n")
    log = tmp_path / "deprecations.txt"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    env.update(NVFP4_DEPRECATIONS_LOG=str(log), NVFP4_PROJECT_ROOT=str(project),
               PYTHONPATH=f"{REPO_ROOT / '.ci' / 'deprecations'}:{library}")
    completed = subprocess.run([sys.executable, "kernel.py"], cwd=project, env=env,
                               capture_output=True, text=True, timeout=60, check=False)
    assert completed.returncode == 0, completed.stderr
    assert log.read_text().splitlines() == [
        "kernel.py:3: DeprecationWarning: old_api is deprecated",
        "child.py:4: DeprecationWarning: old_api is deprecated"]


@needs_kernelguard
def test_the_leaderboard_file_matches_no_kernelguard_pattern_but_its_fallbacks():
    """submission.py is kept by kernelguard and matches only SCALED_MM_REF (the documented last
    link, torch._scaled_mm): a new pattern (say sys.modules access) is caught here first."""
    check = gate.check_kernelguard((REPO_ROOT / "submission.py").read_text(encoding="utf-8"))
    assert check.passed, check.summary
    assert [detail.split(" ")[0] for detail in check.details] == ["SCALED_MM_REF"], check.details
