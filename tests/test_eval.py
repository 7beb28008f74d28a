"""eval.py: test-file parser, seeds, statistics, report, and end-to-end runs on the CPU."""

import importlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import build_report
import eval as harness

REPO_ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ", ".join(build_report.BACKEND_MODULES)  # as compile's --modules messages list them
TORCH_SUBMISSION = REPO_ROOT / "examples" / "torch_submission.py"


# ---------------------------------------------------------------------------------------
# Parser, seeds, statistics
# ---------------------------------------------------------------------------------------


def test_parser_reads_the_official_format(tmp_path):
    path = tmp_path / "cases.txt"
    path.write_text("m: [40, 56]; n: [512, 384]; k: [256, 256]; g: 2; seed: 1111\n"
                    "\n"
                    "# a comment line, then a case with tuples and a trailing comment\n"
                    "  m: (7, 9); n: [8, 16]; k: [256, 512]; g: 2; seed: 3  # small\n"
                    "\n\n")
    cases = harness.get_test_cases(str(path), None)
    assert [c.args for c in cases] == [
        {"m": (40, 56), "n": (512, 384), "k": (256, 256), "g": 2, "seed": 1111},
        {"m": (7, 9), "n": (8, 16), "k": (256, 512), "g": 2, "seed": 3},
    ]
    assert cases[0].spec == "m: [40, 56]; n: [512, 384]; k: [256, 256]; g: 2; seed: 1111"
    assert cases[1].spec == "m: (7, 9); n: [8, 16]; k: [256, 512]; g: 2; seed: 3"


GOOD = "m: [40]; n: [64]; k: [256]; g: 1; seed: 1"


@pytest.mark.parametrize(("line", "message"), [
    ("m: [40]; n [512]; k: [256]; g: 1; seed: 1",
     ("'n [512]' is not `key: value`; rule: a case is `m: [M, ...]; n: [N, ...]; k: [K, ...]; "
     "g: G; seed: S`")),
    (GOOD + ";", "'' is not `key: value`"),
    ("m: [40]; n: 5.5; k: [256]; g: 1; seed: 1", "'n: 5.5' is not `key: value`"),
    ("m: [40]; n: [64]; k: [256]; g: 2; seed: 1",
     "m has 1 value but g = 2; rule: m, n and k each list exactly g sizes"),
    ("m: [40, 56]; n: [64, 64]; k: [256, 256]; g: 3; seed: 1",
     "m has 2 values but g = 3; rule: m, n and k each list exactly g sizes"),
    ("m: [40, 56]; n: [64]; k: [256, 256]; g: 2; seed: 1", "n has 1 value but g = 2"),
    ("m: [40]; n: [64]; k: []; g: 1; seed: 1", "k has 0 values but g = 1"),
    ("m: [-40]; n: [64]; k: [256]; g: 1; seed: 1", "m[0] = -40; rule: M >= 1"),
    ("m: [40, 0]; n: [64, 64]; k: [256, 256]; g: 2; seed: 1", "m[1] = 0; rule: M >= 1"),
    ("m: [40]; n: [0]; k: [256]; g: 1; seed: 1", "n[0] = 0; rule: N >= 1"),
    ("m: [40]; n: [64]; k: [128]; g: 1; seed: 1",
     "k[0] = 128; rule: K is a positive multiple of 256"),
    ("m: [40]; n: [64]; k: [0]; g: 1; seed: 1", "k[0] = 0; rule: K is a positive multiple"),
    ("m: [40]; n: [64]; k: [256]; g: 1", "missing 'seed'; rule: a case is"),
    ("n: [64]; k: [256]; seed: 1", "missing 'm', 'g'"),
    ("m: [a, 56]; n: [64, 64]; k: [256, 256]; g: 2; seed: 1",
     "m = '[a, 56]'; rule: m is a list [..] of g integers"),
    ("m: 40; n: [64]; k: [256]; g: 1; seed: 1", "m = '40'; rule: m is a list"),
    ("m: [40,]; n: [64]; k: [256]; g: 1; seed: 1", "m = '[40,]'"),
    ("m: [40]; n: [64]; k: [256]; g: one; seed: 1", "g = 'one'; rule: g is an integer"),
    ("m: [40]; n: [64]; k: [256]; g: 0; seed: 1", "g = '0'; rule: g is an integer, 1 <= g <= 64"),
    ("m: [40]; n: [64]; k: [256]; g: 65; seed: 1", "g = '65'"),
    ("m: [40]; n: [64]; k: [256]; g: 1; seed: -3", "seed = '-3'; rule: seed is an integer >= 0"),
    (GOOD + "; mode: fast", "unknown key 'mode'; rule: the keys are m, n, k, g, seed"),
    (GOOD + "; g: 1", "'g' given twice; rule: each key once"),
])
def test_invalid_case_lines_name_the_line_and_the_rule_and_exit_113(tmp_path, capsys, line,
                                                                     message):
    path = tmp_path / "cases.txt"
    path.write_text(GOOD + "\n# comment\n" + line + "\n")
    with pytest.raises(SystemExit) as exit_info:
        harness.get_test_cases(str(path), None)
    assert exit_info.value.code == 113
    err = capsys.readouterr().err
    assert err.startswith(f"invalid test case file {path}:3: "), err
    assert message in err
    assert err.count("\n") == 1  # one line


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n\n   \n"])
def test_a_case_file_without_cases_is_invalid(tmp_path, capsys, content):
    path = tmp_path / "cases.txt"
    path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        harness.get_test_cases(str(path), None)
    assert exit_info.value.code == 113
    assert capsys.readouterr().err == (f"invalid test case file {path}: no test case (only "
                                       "blank lines or comments); rule: at least one case "
                                       "line\n")


def test_every_line_is_checked_before_anything_runs(tmp_path):
    # The error sits in the last line: nothing may run before the file has been read whole.
    path = tmp_path / "cases.txt"
    path.write_text("\n".join([GOOD] * 5 + ["m: [40]; n: [64]; k: [256]; g: 2; seed: 1"]))
    with pytest.raises(harness.CaseError, match=r"cases.txt:6: m has 1 value but g = 2"):
        harness.read_test_cases(str(path))


def test_missing_test_file_exits_113(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        harness.get_test_cases(str(tmp_path / "absent.txt"), None)
    assert exit_info.value.code == 113


def test_seed_combining():
    assert harness._combine(1, 2) == 7  # 1 + (3 * 4) / 2
    assert harness._combine(1111, 0) == 1111 + 1111 * 1112 // 2
    path = REPO_ROOT / "tests" / "cases" / "tests.txt"
    plain = harness.get_test_cases(str(path), None)
    combined = harness.get_test_cases(str(path), 987654321)
    assert all(c.args["seed"] == 1111 for c in plain)
    assert all(c.args["seed"] == 1111 + (1111 + 987654321) * (1111 + 987654322) // 2
               for c in combined)


def test_shipped_cases_are_the_official_ten_tests_and_four_benchmarks():
    tests = harness.get_test_cases(str(harness.DEFAULT_TEST_FILE), None)
    benchmarks = harness.get_test_cases(str(harness.DEFAULT_BENCHMARK_FILE), None)
    assert len(tests) == 10 and len(benchmarks) == 4
    assert tests[8].args["m"] == (40, 56, 384, 512)
    for case in tests + benchmarks:
        g = case.args["g"]
        assert len(case.args["m"]) == len(case.args["n"]) == len(case.args["k"]) == g
        assert all(k % 256 == 0 for k in case.args["k"])
    keys = {(c.args["m"], c.args["n"], c.args["k"]) for c in benchmarks}
    assert keys == set(harness.SPEED_OF_LIGHT_US)


def test_stats():
    stats = harness.calculate_stats([1.0, 2.0, 3.0, 4.0])
    assert stats.runs == 4 and stats.mean == 2.5 and stats.best == 1.0 and stats.worst == 4.0
    assert stats.std == pytest.approx(math.sqrt(5.0 / 3.0))
    assert stats.err == pytest.approx(math.sqrt(5.0 / 3.0) / 2.0)


def test_case_metrics_and_report():
    small = {"m": (2, 4), "n": (8, 8), "k": (256, 256), "g": 2}
    metrics = harness.case_metrics(small)
    assert metrics["flops"] == 2 * 2 * 8 * 256 + 2 * 4 * 8 * 256
    # A + B: (M + N) * K / 2 bytes; scales: (M + N) * K / 16; C: 2 * M * N.
    assert metrics["bytes"] == (10 * 128 + 10 * 16 + 32) + (12 * 128 + 12 * 16 + 64)
    assert metrics["sol_us"] is None

    benchmarks = harness.get_test_cases(str(harness.DEFAULT_BENCHMARK_FILE), None)
    means_us = [40.0, 20.0, 5.0, 3.0]
    results = [harness.BenchResult(harness.calculate_stats([mean * 1e3, mean * 1e3 + 2]),
                                   host_ns_per_call=12e3) for mean in means_us]
    report = harness.build_report("benchmark", "s.py", {"device": "X"}, benchmarks, results,
                                  False)
    first = report["cases"][0]
    assert first["mean_us"] == pytest.approx(40.001)
    assert first["sol_us"] == 18.833
    assert first["sol_pct"] == pytest.approx(100 * 18.833 / 40.001)
    flops = sum(2 * m * 4096 * 7168 for m in (80, 176, 128, 72, 64, 248, 96, 160))
    assert first["tflops"] == pytest.approx(flops / 40.001e-6 / 1e12)
    assert first["host_us_per_call"] == pytest.approx(12.0)
    expected_geomean = math.prod(m + 0.001 for m in means_us) ** 0.25
    assert report["geomean_us"] == pytest.approx(expected_geomean)
    text = harness.format_report(report)
    assert "host µs/call" in text and "18.833" in text and "geometric mean" in text


# ---------------------------------------------------------------------------------------
# Benchmark protocol, in process, with CUDA events replaced by wall-clock stand-ins
# ---------------------------------------------------------------------------------------


class WallClockEvent:
    def __init__(self, enable_timing=False):
        self.time_s = None

    def record(self):
        self.time_s = time.perf_counter()

    def elapsed_time(self, end):
        return (end.time_s - self.time_s) * 1e3


@pytest.fixture
def cpu_timing(monkeypatch):
    """Run the timing loop on the CPU: no-op synchronize and L2 flush, wall-clock events."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "Event", WallClockEvent)
    monkeypatch.setattr(harness, "clear_l2_cache", lambda: None)
    # The harness loads each file as module `submission`; the real one comes back afterwards.
    saved = sys.modules.pop("submission", None)

    def use(submission_path):
        sys.modules.pop("submission", None)
        monkeypatch.setattr(harness, "_submission_path", str(submission_path))

    yield use
    sys.modules.pop("submission", None)
    if saved is not None:
        sys.modules["submission"] = saved


SMALL_CASE = harness.TestCase(args={"m": (40, 72), "n": (64, 128), "k": (256, 256), "g": 2,
                                    "seed": 5}, spec="small")

# Correct for its first `good_calls` calls, then leaves C untouched on every 15th call
# (counted from the first timed call): the competition's loop, which checks only the last
# output of a repeat, would not see it.
FAILS_LATER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {examples!r})
    import torch_submission

    calls = []

    def custom_kernel(data):
        calls.append(data)
        if len(calls) > 15 and (len(calls) - 16) % 15 == 0:
            return [c for _, _, c in data[0]]
        return torch_submission.custom_kernel(data)
""")

RECORDS_INPUTS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {examples!r})
    import torch_submission

    seen = []  # keeps every input alive, so no allocation is reused

    def custom_kernel(data):
        seen.append(data)
        return torch_submission.custom_kernel(data)
""")


def write_submission(tmp_path, name, template):
    path = tmp_path / name
    path.write_text(template.format(examples=str(TORCH_SUBMISSION.parent)))
    return path


def test_benchmark_protocol_times_15_inputs_and_stops(cpu_timing):
    cpu_timing(TORCH_SUBMISSION)
    result = harness._run_single_benchmark(SMALL_CASE, False, 6, 1e12)
    assert isinstance(result, harness.BenchResult)
    assert 3 <= result.stats.runs <= 6
    assert result.stats.best <= result.stats.mean <= result.stats.worst
    assert result.host_ns_per_call > 0


def test_recheck_catches_an_error_in_any_output_of_a_repeat(cpu_timing, tmp_path):
    cpu_timing(write_submission(tmp_path, "fails_later.py", FAILS_LATER))
    unchecked = harness._run_single_benchmark(SMALL_CASE, False, 4, 1e12)
    assert isinstance(unchecked, harness.BenchResult)  # plain benchmark: no recheck
    cpu_timing(write_submission(tmp_path, "fails_later_again.py", FAILS_LATER))
    checked = harness._run_single_benchmark(SMALL_CASE, True, 4, 1e12)
    assert isinstance(checked, str)
    assert checked.startswith("repeat 0, input 0: mismatch found!")
    assert "Number of mismatched elements" in checked


def test_hardened_mode_uses_fresh_shuffled_clones(cpu_timing, tmp_path):
    cpu_timing(write_submission(tmp_path, "records.py", RECORDS_INPUTS))
    result = harness._run_single_benchmark(SMALL_CASE, False, 4, 1e12, hardened=True)
    assert isinstance(result, harness.BenchResult)
    seen = sys.modules["submission"].seen
    correctness_pass, timed = seen[:15], seen[15:]
    assert len(timed) == 15 * result.stats.runs

    def fingerprint(data):
        return bytes(data[0][0][0].view(torch.uint8).reshape(-1)[:64].tolist())

    originals = [fingerprint(d) for d in correctness_pass]
    assert len(set(originals)) == 15
    orders = []
    pointers = set()
    for repeat in range(result.stats.runs):
        batch = timed[15 * repeat: 15 * (repeat + 1)]
        orders.append([originals.index(fingerprint(d)) for d in batch])
        pointers.update(d[0][0][0].data_ptr() for d in batch)
    assert all(sorted(order) == list(range(15)) for order in orders)
    assert any(order != list(range(15)) for order in orders)
    assert len(pointers) == 15 * result.stats.runs  # a new allocation for every call


# ---------------------------------------------------------------------------------------
# End to end (spawned worker, POPCORN protocol), on the CPU
# ---------------------------------------------------------------------------------------

SKIPS_TAIL_ROWS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {examples!r})
    import torch_submission

    def custom_kernel(data):
        # Computes every group, but only writes rows below the last multiple of 32 of M,
        # as a kernel with a missing residue predicate would.
        abc = data[0]
        saved = [c.clone() for _, _, c in abc]
        outputs = torch_submission.custom_kernel(data)
        for c, before in zip(outputs, saved):
            full_rows = c.shape[0] // 32 * 32
            c[full_rows:] = before[full_rows:]
        return outputs
""")

RAISES = textwrap.dedent("""
    def custom_kernel(data):
        raise ValueError("group 0: field a: dtype uint8, expected float4_e2m1fn_x2")
""")


def run_eval(*args, env_extra=None, popcorn=True, tmp_path=None):
    env = dict(os.environ)
    env.pop("POPCORN_SEED", None)
    env.update(env_extra or {})
    if not popcorn:
        env.pop("POPCORN_FD", None)
        return subprocess.run([sys.executable, "eval.py", *args], check=False, cwd=REPO_ROOT,
                              env=env,
                              capture_output=True, text=True, timeout=300), None
    read_fd, write_fd = os.pipe()
    env["POPCORN_FD"] = str(write_fd)
    process = subprocess.Popen([sys.executable, "eval.py", *args], cwd=REPO_ROOT, env=env,
                               pass_fds=(write_fd,), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    os.close(write_fd)
    with os.fdopen(read_fd) as reader:
        popcorn_text = reader.read()
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), \
        dict(line.split(": ", 1) for line in popcorn_text.splitlines())


def test_end_to_end_correct_submission_passes_through_popcorn_fd():
    completed, lines = run_eval("test", "tests/cases/tests.txt",
                                "--submission", str(TORCH_SUBMISSION))
    assert completed.returncode == 0, completed.stderr
    assert lines["test-count"] == "10" and lines["check"] == "pass"
    assert all(lines[f"test.{i}.status"] == "pass" for i in range(10))
    assert lines["test.8.spec"] == "m: [40, 56, 384, 512]; n: [512, 384, 256, 128]; " \
                                   "k: [256, 256, 256, 256]; g: 4; seed: 1111"
    assert "check:" not in completed.stdout  # protocol lines go to the fd only


def test_end_to_end_subtly_wrong_submission_fails_and_names_the_mismatch(tmp_path):
    wrong = write_submission(tmp_path, "skips_tail_rows.py", SKIPS_TAIL_ROWS)
    completed, lines = run_eval("test", "--submission", str(wrong))
    assert completed.returncode == 112
    assert lines["check"] == "fail"
    # Cases whose every M is a multiple of 32 pass; the others fail and say where.
    for i, case in enumerate(harness.get_test_cases(str(harness.DEFAULT_TEST_FILE), None)):
        aligned = all(m % 32 == 0 for m in case.args["m"])
        assert lines[f"test.{i}.status"] == ("pass" if aligned else "fail"), i
    error = lines["test.8.error"]  # m = [40, 56, 384, 512]: group 0 rows 32..39 are stale
    assert error.startswith("mismatch found! custom implementation doesn't match reference: 0")
    assert "Number of mismatched elements" in error and "ERROR AT (32, 0, 0)" in error


def test_end_to_end_raising_submission_is_a_failed_test(tmp_path):
    completed, lines = run_eval("test", "tests/cases/tests.txt", "--submission",
                                str(write_submission(tmp_path, "raises.py", RAISES)))
    assert completed.returncode == 112
    assert lines["test.0.status"] == "fail"
    assert lines["test.0.error"] == ("custom_kernel raised ValueError: group 0: field a: "
                                     "dtype uint8, expected float4_e2m1fn_x2")


def test_without_popcorn_fd_lines_go_to_stdout_and_seed_is_combined(tmp_path):
    cases = tmp_path / "one.txt"
    cases.write_text("m: [40]; n: [64]; k: [256]; g: 1; seed: 1111\n")
    completed, _ = run_eval("test", str(cases), "--submission", str(TORCH_SUBMISSION),
                            env_extra={"POPCORN_SEED": "12345"}, popcorn=False)
    assert completed.returncode == 0, completed.stderr
    assert "test-count: 1" in completed.stdout and "check: pass" in completed.stdout


def test_invalid_case_file_exits_113_with_one_line(tmp_path):
    cases = tmp_path / "bad.txt"
    cases.write_text("m: [40]; n: [64]; k: [256]; g: 1; seed: 1111\n"
                     "m: [40]; n: [64, 64]; k: [256, 256]; g: 2; seed: 1111\n")
    completed, _ = run_eval("test", str(cases), "--submission", str(TORCH_SUBMISSION),
                            popcorn=False)
    assert completed.returncode == 113
    assert completed.stderr == (f"invalid test case file {cases}:2: m has 1 value but g = 2; "
                                "rule: m, n and k each list exactly g sizes\n")
    assert completed.stdout == ""  # nothing ran


ONE_CASE = "m: [40]; n: [64]; k: [256]; g: 1; seed: 1111\n"


@pytest.mark.skipif(harness.supported_gpu()[0], reason="checks the machine without a supported GPU")
def test_test_mode_without_a_supported_gpu_runs_the_torch_example(tmp_path):
    report_path = tmp_path / "report.json"
    completed, _ = run_eval("test", "--json", str(report_path), popcorn=False)
    assert completed.returncode == 0, completed.stderr
    first, *rest = completed.stderr.splitlines()
    assert first.startswith("submission.py needs an NVIDIA B200 (sm_100), the library an "
                            "H100/H200 (sm_90); ")
    assert "so examples/torch_submission.py runs instead" in first
    assert "10 of 10 test cases passed (examples/torch_submission.py)" in rest
    assert "check: pass" in completed.stdout and "test.9.status: pass" in completed.stdout
    # The reader's lines go to stdout too: the one naming the example first, the closing
    # line last
    out = completed.stdout.splitlines()
    assert out[0] == first
    assert out[-1] == "10 of 10 test cases passed (examples/torch_submission.py)"
    report = json.loads(report_path.read_text())
    assert report["mode"] == "test" and report["check"] == "pass" and report["passed"] == 10
    assert report["submission"] == str(TORCH_SUBMISSION)
    assert [case["status"] for case in report["cases"]] == ["pass"] * 10
    assert report["cases"][8]["m"] == [40, 56, 384, 512]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_explicit_submission_and_the_runners_protocol_stay_strict(tmp_path):
    cases = tmp_path / "one.txt"
    cases.write_text(ONE_CASE)
    report_path = tmp_path / "report.json"
    # --submission names submission.py: it runs, and fails on the CPU with its own message.
    completed, _ = run_eval("test", str(cases), "--submission", "submission.py", "--json",
                            str(report_path), popcorn=False)
    assert completed.returncode == 112
    assert "runs instead" not in completed.stderr
    assert "0 of 1 test cases passed (submission.py)" in completed.stderr
    case = json.loads(report_path.read_text())["cases"][0]
    assert case["status"] == "fail"
    assert "group 0: a.device = 'cpu'; rule: every tensor must be on a CUDA device" \
        in case["error"]
    # POPCORN_FD set (the runner) and no --submission: submission.py, as on the leaderboard.
    completed, lines = run_eval("test", str(cases))
    assert completed.returncode == 112
    assert "runs instead" not in completed.stderr
    assert lines["test.0.status"] == "fail" and "a.device = 'cpu'" in lines["test.0.error"]


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["tset"], {}, ("eval.py: unknown mode 'tset'; the modes are test, benchmark, leaderboard, "
                    "profile, selfcheck, compile, gate (--help lists the options)")),
    ([], {}, "eval.py: a mode is required: test, benchmark, leaderboard, profile, selfcheck,"),
    (["test", "--case-timeout", "-1"], {},
     "--case-timeout -1: expected seconds >= 0 (0: no limit)"),
    (["test", "--plot", "x.png"], {}, "--plot applies to benchmark and leaderboard, not test"),
    (["profile", "--plot", "x.png"], {}, "--plot applies to benchmark and leaderboard"),
    (["test", "--hardened"], {}, "--hardened applies to benchmark and leaderboard, not test"),
    (["test", "--json", "/nonexistent-folder/r.json"], {},
     "--json /nonexistent-folder/r.json: the folder /nonexistent-folder does not exist"),
    (["benchmark", "--plot", "/nonexistent-folder/p.png"], {}, "--plot /nonexistent-folder"),
    (["test"], {"POPCORN_SEED": "abc"}, "POPCORN_SEED = 'abc': expected an integer"),
    (["compile", "--groups", "abc"], {},
     "eval.py compile: --groups 'abc': expected comma-separated group counts between 1 and 64"),
    (["compile", "--groups=0,2"], {}, "eval.py compile: --groups '0,2'"),
    (["test", "--bogus"], {}, "eval.py test: unrecognized arguments: --bogus"),
    (["test", "--submission", "absent.py"], {}, "submission file not found: "),
    (["test", "absent-cases.txt"], {}, "eval.py test: case file absent-cases.txt: no such file"),
    (["benchmark", "tests"], {}, "eval.py benchmark: case file tests: is a folder"),
])
def test_bad_arguments_give_one_line_and_exit_2(monkeypatch, capsys, argv, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        status = harness.main(argv)
    except SystemExit as exit_info:  # argparse
        status = exit_info.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
@pytest.mark.parametrize(("script", "message"), [
    (["eval.py", "benchmark"], "benchmark mode needs a CUDA GPU, and torch"),
    (["bench/peers.py"], "peers.py needs a CUDA GPU, and torch"),
    (["bench/host_overhead.py"], "host_overhead.py needs a CUDA GPU, and torch"),
    (["bench/breakdown.py"], "breakdown.py times the sm_90 swap-AB kernels and needs an H100/H200"),
])
def test_commands_without_a_gpu_fail_with_one_line_and_no_traceback(script, message):
    completed = subprocess.run([sys.executable, *script], cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=300, check=False)
    assert completed.returncode == 2
    assert completed.stderr.startswith(message) and completed.stderr.count("\n") == 1, \
        completed.stderr


@pytest.mark.parametrize(("script", "argv", "message"), [
    ("peers", ["--repeats", "0"],
     "peers.py: argument --repeats: invalid positive integer value: '0'"),
    ("peers", ["--json", "/nonexistent-folder/r.json"], "--json /nonexistent-folder/r.json"),
    ("peers", ["--configs", "--plot", "p.png"], "--json and --plot apply to the comparison"),
    ("peers", ["--shapes", "4"], "peers.py: argument --shapes: invalid shape list (distinct indices 0..3"),
    ("peers", ["--shapes", "2,2"], "peers.py: argument --shapes: invalid shape list"),
    ("peers", ["--shapes", "x"], "peers.py: argument --shapes: invalid shape list"),
    ("host_overhead", ["--repeats", "x"],
     "host_overhead.py: argument --repeats: invalid positive integer value: 'x'"),
    ("host_overhead", ["--submission", "absent.py"], "submission file not found: "),
    ("breakdown", ["--repeats", "0"], "breakdown.py: argument --repeats: invalid positive integer value: '0'"),
    ("breakdown", ["--shapes", "4"], "breakdown.py: argument --shapes: invalid shape list (distinct indices 0..3"),
    ("breakdown", ["--configs", "auto,fastest"], "breakdown.py: --configs 'auto,fastest': unknown ['fastest']"),
    ("breakdown", ["--configs", ","], "breakdown.py: --configs ',': no config named; known: ['auto',"),
])
def test_bench_scripts_reject_bad_arguments_with_one_line(capsys, script, argv, message):
    module = importlib.import_module(script)  # bench/ is on the tests' path (pyproject)
    try:
        status = module.main(argv)
    except SystemExit as exit_info:  # argparse
        status = exit_info.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err

def test_first_call_device_figures_time_first_calls_and_hits(monkeypatch):
    """host_overhead --first-call-device on CUDA stand-ins: per repeat 15 never-seen input
    sets back to back, 15 more behind the sleep, 15 hits on the set itself, no two sets with
    the same output (every set alive to the end); the figures are the medians of what the
    events measured."""
    import host_overhead

    import utils

    elapsed_ms = iter([0.015 * (i + 1) for i in range(100)])

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            pass

        def elapsed_time(self, other):
            return next(elapsed_ms)

    sleeps = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", sleeps.append)
    monkeypatch.setattr(utils, "clear_l2_cache", lambda: None)
    from reference import generate_input

    data = generate_input(m=(40,), n=(64,), k=(256,), g=1, seed=3, device="cpu")
    seen = []
    figures = host_overhead.first_call_device_us(lambda d: seen.append(d[0][0][2].data_ptr()), data, 2)
    own = data[0][0][2].data_ptr()
    assert seen[:3] == [own] * 3  # bound, checked, hitting first
    rounds = [seen[3 + 45 * r: 3 + 45 * (r + 1)] for r in range(2)]
    first_calls = [ptr for calls in rounds for ptr in calls[:30]]
    assert own not in first_calls and len(set(first_calls)) == 60  # every first call its own c
    assert all(calls[30:] == [own] * 15 for calls in rounds)
    assert len(sleeps) == 4
    # events per repeat: first calls, first calls alone, hits alone (ms per 15 calls -> µs per call)
    assert figures["first calls device"] == pytest.approx((0.015 + 0.060) / 2 * 1e3 / 15)
    assert figures["first calls alone device"] == pytest.approx((0.030 + 0.075) / 2 * 1e3 / 15)
    assert figures["hits alone device"] == pytest.approx((0.045 + 0.090) / 2 * 1e3 / 15)
    assert figures["first calls host"] >= 0


def test_peers_shapes_option_selects_benchmark_shapes_in_order():
    import peers
    assert peers.shape_list("2,3") == [2, 3]
    assert peers.shape_list("3,0") == [3, 0]
    assert [peers.BENCHMARKS[i][2][0] for i in peers.shape_list("2,3")] == [4096, 1536]
    for bad in ("", "0,,1", "-1", "0,1,2,3,0"):
        with pytest.raises(ValueError):
            peers.shape_list(bad)


# ---------------------------------------------------------------------------------------
# The harness survives its submission (tests/submissions/: one failure each)
# ---------------------------------------------------------------------------------------

SUBMISSIONS = REPO_ROOT / "tests" / "submissions"
TWO_CASES = ("m: [40]; n: [64]; k: [256]; g: 1; seed: 1111\n"
             "m: [40, 8]; n: [64, 64]; k: [256, 256]; g: 2; seed: 1111\n")
LOST = "not run: the submission's process ended in an earlier case"
NOT_IMPORTED = "not run: the submission could not be imported"


def run_quick(*args, env_extra=None, timeout=60, **popen):
    """eval.py without POPCORN_FD (the protocol's lines on stdout), killed after `timeout`
    seconds: a hang fails the test instead of stalling it."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("POPCORN_FD", "POPCORN_SEED")}
    env.update(env_extra or {})
    popen.setdefault("capture_output", True)
    return subprocess.run([sys.executable, "eval.py", *args], check=False, cwd=REPO_ROOT,
                          env=env, text=True, timeout=timeout, **popen)


def protocol(stdout: str) -> dict:
    return dict(line.split(": ", 1) for line in stdout.splitlines()
                if re.match(r"^[\w.-]+: ", line))


@pytest.mark.parametrize(("name", "message", "not_run"), [
    ("exits_in_kernel", "the submission's process exited with code 3", LOST),
    ("hard_exit", "the submission's process exited with code 7", LOST),
    ("aborts", "the submission's process was ended by signal 6 (SIGABRT)", LOST),
    ("faults", "the submission's process was ended by signal 11 (SIGSEGV)", LOST),
    ("exits_at_import",
     "could not import the submission: the submission's process exited with code 1",
     NOT_IMPORTED),
])
def test_a_submission_that_ends_its_process_fails_the_case_in_one_line(tmp_path, name,
                                                                       message, not_run):
    cases = tmp_path / "two.txt"
    cases.write_text(TWO_CASES)
    report_path = tmp_path / "report.json"
    completed = run_quick("test", str(cases), "--submission", str(SUBMISSIONS / f"{name}.py"),
                          "--json", str(report_path))
    assert completed.returncode == 112, completed.stderr
    lines = protocol(completed.stdout)
    assert lines["test-count"] == "2" and lines["check"] == "fail"
    assert (lines["test.0.status"], lines["test.0.error"]) == ("fail", message)
    assert (lines["test.1.status"], lines["test.1.error"]) == ("fail", not_run)
    closing = f"0 of 2 test cases passed, 1 not run (tests/submissions/{name}.py)"
    assert completed.stdout.splitlines()[-1] == closing
    assert completed.stderr.splitlines() == [
        f"test: case 1 of 2 (G=1 M=40 N=64 K=256): FAILED: {message}; 1 case not run",
        closing, f"results written to {report_path}"]
    report = json.loads(report_path.read_text())
    assert [case["status"] for case in report["cases"]] == ["fail", "not run"]
    assert report["cases"][0]["error"] == message and report["not_run"] == 1


@pytest.mark.parametrize(("name", "errors"), [
    ("returns_none", [("custom_kernel returned None; expected a list of 1 tensor (C of each "
                      "group)"),
                      ("custom_kernel returned None; expected a list of 2 tensors (C of each "
                      "group)")]),
    ("returns_wrong_items", [("custom_kernel's output 0 is list; expected a tensor (C of group "
                             "0)")] * 2),
])
def test_a_wrong_output_type_fails_the_case_in_one_line(tmp_path, name, errors):
    cases = tmp_path / "two.txt"
    cases.write_text(TWO_CASES)
    completed = run_quick("test", str(cases), "--submission", str(SUBMISSIONS / f"{name}.py"))
    assert completed.returncode == 112
    lines = protocol(completed.stdout)
    assert [lines["test.0.error"], lines["test.1.error"]] == errors  # both cases ran
    assert completed.stderr == f"0 of 2 test cases passed (tests/submissions/{name}.py)\n"


def test_output_problem_names_what_custom_kernel_returned():
    c = torch.zeros(2, 2)
    assert harness.output_problem([c, c], 2) is None
    assert harness.output_problem((c,), 1) is None
    assert harness.output_problem(c, 1) == ("custom_kernel returned a Tensor; expected a list "
                                            "of 1 tensor (C of each group)")
    assert harness.output_problem([c], 3) == ("custom_kernel returned 1 output; expected 3 "
                                              "tensors (C of each group)")
    assert harness.output_problem([c, "x"], 2) == ("custom_kernel's output 1 is str; expected "
                                                   "a tensor (C of group 1)")
    good, message = harness._match([c], [torch.zeros(2, 2, dtype=torch.bool)])
    assert not good and message.startswith("the output could not be compared: RuntimeError")


def test_an_import_error_is_reported_once(tmp_path):
    cases = tmp_path / "three.txt"
    cases.write_text(TWO_CASES + ONE_CASE)
    completed = run_quick("test", str(cases), "--submission", str(SUBMISSIONS / "import_error.py"))
    assert completed.returncode == 112
    lines = protocol(completed.stdout)
    assert lines["test.0.error"] == ("could not import the submission: ModuleNotFoundError: "
                                     "No module named 'nvfp4_module_that_does_not_exist'")
    assert lines["test.1.error"] == lines["test.2.error"] == NOT_IMPORTED
    assert completed.stdout.count("ModuleNotFoundError") == 1
    assert completed.stderr.count("ModuleNotFoundError") == 1  # the progress line
    assert "Traceback" not in completed.stderr


class DyingPool:
    """A pool whose process ends in the `dies_at`-th call of a case function (warm-ups
    count): before it, each call gives a passing result of its kind."""

    def __init__(self, dies_at: int, import_fails: bool = False):
        self.calls, self.dies_at, self.import_fails = 0, dies_at, import_fails

    def apply(self, function, args=()):
        if function is harness._import_submission:
            if self.import_fails:
                raise harness.SubmissionLost("the submission's process exited with code 1",
                                             "not run: x")
            return None
        self.calls += 1
        if self.calls == self.dies_at:
            raise harness.SubmissionLost("the submission's process exited with code 7", LOST)
        if function is harness._run_single_test:
            return True, ""
        if function is harness._run_single_benchmark:
            return harness.BenchResult(harness.calculate_stats([1e3, 2e3]), 1e3)
        return "profiler table"


THREE_TESTS = [harness.TestCase(args={"m": (8,), "n": (64,), "k": (256,), "g": 1, "seed": i},
                                spec=f"case {i}") for i in range(3)]


@pytest.mark.parametrize(("mode", "dies_at", "failed", "not_run"), [
    ("test", 2, 1, [2]),
    ("benchmark", 1, 0, [1, 2]),  # the warm-up on case 0
    ("benchmark", 3, 1, [2]),  # the warm-up, case 0, then case 1
    ("leaderboard", 2, 1, [0, 2]),  # the warm-up of case 1: no case was timed
    ("leaderboard", 5, 1, [2]),  # three warm-ups, case 0, then case 1
    ("profile", 2, 1, [2]),
])
def test_every_mode_ends_the_same_way_when_the_submission_is_lost(capsys, mode, dies_at,
                                                                  failed, not_run):
    runner = {"test": harness.run_testing, "profile": harness.run_profiling,
              "benchmark": harness.run_benchmarking, "leaderboard": harness.run_leaderboard}
    args = (harness.StdoutOutput(), DyingPool(dies_at), THREE_TESTS)
    if mode in ("benchmark", "leaderboard"):
        args += (False,)
    status, results = runner[mode](*args)
    assert status == 112 and len(results) == 3
    captured = capsys.readouterr()
    lines = protocol(captured.out)
    key = "test" if mode == "test" else "benchmark"
    assert lines[f"{key}.{failed}.error"] == "the submission's process exited with code 7"
    assert lines["check"] == "fail"
    assert captured.out.count(": the submission's process exited with code 7") == 1
    for idx in range(3):
        assert lines[f"{key}.{idx}.spec"] == f"case {idx}"
        assert captured.out.count(f"{key}.{idx}.spec: ") == 1
    assert [idx for idx in range(3) if lines.get(f"{key}.{idx}.error") == LOST] == not_run
    ran = [idx for idx in range(3) if idx != failed and idx not in not_run]
    assert all(f"{key}.{idx}.status: fail" not in captured.out for idx in ran)
    assert captured.err.splitlines()[-1] == (
        f"{mode}: case {failed + 1} of 3 (G=1 M=8 N=64 K=256): FAILED: the submission's "
        f"process exited with code 7; {len(not_run)} case{'s' * (len(not_run) != 1)} not run")
    # The reports: the failed case and the ones not run, as such
    machine = {"device": "cpu"}
    if mode == "test":
        report = harness.build_test_report("s.py", machine, THREE_TESTS, results)
    elif mode == "profile":
        report = harness.build_profile_report("s.py", machine, THREE_TESTS, results)
    else:
        report = harness.build_report(mode, "s.py", machine, THREE_TESTS, results, False)
        table = harness.format_report(report)
        assert "FAILED: the submission's process exited with code 7" in table
        assert table.count("NOT RUN: the submission's process ended in an earlier case") == \
            len(not_run)
    statuses = [case.get("status", "pass" if "error" not in case else "fail")
                for case in report["cases"]]
    assert [i for i, status in enumerate(statuses) if status == "not run"] == not_run
    assert statuses[failed] == "fail"


def test_every_mode_reports_an_import_failure_once(capsys):
    status, results = harness.run_benchmarking(harness.StdoutOutput(),
                                               DyingPool(0, import_fails=True), THREE_TESTS,
                                               False)
    assert status == 112
    out = capsys.readouterr().out
    assert out.count("could not import the submission") == 1
    assert [str(r) for r in results] == [
        "could not import the submission: the submission's process exited with code 1",
        "not run: the submission could not be imported",
        "not run: the submission could not be imported"]


@pytest.mark.parametrize(("mode", "name", "message", "table"), [
    ("benchmark", "hard_exit", "the submission's process exited with code 7", True),
    ("leaderboard", "exits_in_kernel", "the submission's process exited with code 3", True),
    ("profile", "exits_at_import",
     "could not import the submission: the submission's process exited with code 1", False),
])
def test_the_timing_modes_survive_the_submissions_process(monkeypatch, capsys, tmp_path, mode,
                                                          name, message, table):
    # The timing modes need CUDA; the submission's process dies before its first CUDA call,
    # so with the driver told that CUDA is there, the whole path runs on a CPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("POPCORN_FD", raising=False)
    cases = tmp_path / "two.txt"
    cases.write_text(TWO_CASES)
    report_path = tmp_path / "report.json"
    started = time.perf_counter()
    status = harness.main([mode, str(cases), "--submission", str(SUBMISSIONS / f"{name}.py"),
                           "--json", str(report_path)])
    assert status == 112 and time.perf_counter() - started < 60
    captured = capsys.readouterr()
    lines = protocol(captured.out)
    assert lines["benchmark.0.error"] == message and lines["check"] == "fail"
    assert lines["benchmark.1.error"].startswith("not run: ")
    assert f"{mode}: case 1 of 2 (G=1 M=40 N=64 K=256): FAILED: {message}; 1 case not run" \
        in captured.err.splitlines()
    report = json.loads(report_path.read_text())
    assert report["cases"][1]["status"] == "not run"
    if table:
        assert f" FAILED: {message}" in captured.out and " NOT RUN: " in captured.out


def test_the_worker_answers_errors_in_one_line_and_notices_its_end():
    with harness.Worker(str(TORCH_SUBMISSION)) as worker:
        assert worker.apply(harness._describe_machine)["torch"] == torch.__version__
        with pytest.raises(harness.WorkerError) as raised:
            worker.apply(divmod, (1, 0))
        assert str(raised.value) == "ZeroDivisionError: integer division or modulo by zero"
        assert worker.apply(harness._import_submission) is None  # still alive
        for _ in range(2):  # the end, then every later call, without waiting
            with pytest.raises(harness.SubmissionLost) as raised:
                worker.apply(os._exit, (5,))
            assert str(raised.value) == "the submission's process exited with code 5"
    assert not worker.process.is_alive()


def test_describe_exit():
    assert harness.describe_exit(0) == "the submission's process exited with code 0"
    assert harness.describe_exit(-9) == "the submission's process was ended by signal 9 (SIGKILL)"
    assert harness.describe_exit(-200) == "the submission's process was ended by signal 200"


def test_ctrl_c_prints_one_line_exits_130_and_ends_the_submissions_process(tmp_path):
    cases = tmp_path / "one.txt"
    cases.write_text(ONE_CASE)
    ready = tmp_path / "ready"
    env = {key: value for key, value in os.environ.items() if key != "POPCORN_FD"}
    env["EVAL_TEST_READY"] = str(ready)
    # A session of its own: SIGINT goes to the whole group, as Ctrl-C in a terminal does. SIGINT
    # handled here while it starts, so that it is not ignored there: a shell's background job (a
    # CI script started with `&`) starts with SIGINT ignored, and a child inherits that.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            [sys.executable, "eval.py", "test", str(cases), "--submission",
             str(SUBMISSIONS / "sleeps.py")], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), process.communicate(timeout=10)
        worker_pid = int(ready.read_text())
        os.killpg(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    assert stderr == "eval.py: interrupted (Ctrl-C)\n"
    assert "test.0.status" not in stdout
    with pytest.raises(ProcessLookupError):
        os.kill(worker_pid, 0)


# ---------------------------------------------------------------------------------------
# Every input checked before any work
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["test", "--json", "/proc/x.json"], {},
     "--json /proc/x.json: cannot be created ("),
    (["test", "--json", str(REPO_ROOT / "tests")], {},
     f"--json {REPO_ROOT / 'tests'}: is a folder; expected a file name"),
    (["test", "--json", str(REPO_ROOT / "eval.py" / "r.json")], {},
     f"--json {REPO_ROOT / 'eval.py' / 'r.json'}: {REPO_ROOT / 'eval.py'} is not a folder"),
    (["benchmark", "--plot", "/proc/x.png"], {}, "--plot /proc/x.png: cannot be created ("),
    (["test", "--submission", "README.md"], {},
     "--submission README.md: expected a Python file (.py) that defines custom_kernel"),
    (["test"], {"POPCORN_SEED": "-5"},
     ("POPCORN_SEED = '-5': expected an integer between 0 and 4294967295 (2**32 - 1, the range "
     "of the numpy seed that utils.set_seed sets)")),
    (["test"], {"POPCORN_SEED": "4294967296"},
     "POPCORN_SEED = '4294967296': expected an integer between 0 and 4294967295"),
    (["test"], {"POPCORN_FD": "abc"},
     ("POPCORN_FD = 'abc': expected the number of an open file descriptor to write the results "
     "to")),
    (["test"], {"POPCORN_FD": "99"},
     ("POPCORN_FD = '99': file descriptor 99 is not open; expected the number of an open file "
     "descriptor")),
    (["test"], {"POPCORN_FD": "-1"}, "POPCORN_FD = '-1': expected the number of an open file"),
    (["compile", "--groups", "2,2"], {},
     ("eval.py compile: --groups '2,2': 2 given more than once; expected distinct group counts between "
     "1 and 64, e.g. 1,2,8")),
    (["compile", "--groups=1,8,1,8"], {}, "eval.py compile: --groups '1,8,1,8': 1, 8 given more than"),
    (["compile", "--modules", "nvfp4_hoper"], {},
     ("eval.py compile: --modules 'nvfp4_hoper': unknown module 'nvfp4_hoper'; the modules are "
     f"{BACKENDS} (comma-separated)")),
    (["compile", "--modules", "submission,,"], {}, None),  # valid: checked, then refused below
    (["compile", "--modules", ","], {},
     f"eval.py compile: --modules ',': no module named; the modules are {BACKENDS}"),
    (["compile", "--modules", "submission,submission"], {},
     "eval.py compile: --modules 'submission,submission': a module named more than once"),
    (["compile", "--json", "/proc/x.json"], {},
     "eval.py compile: --json /proc/x.json: cannot be created ("),
    (["compile", "--json", "/nonexistent-folder/r.json"], {},
     ("eval.py compile: --json /nonexistent-folder/r.json: the folder /nonexistent-folder does not "
     "exist")),
    (["compile", "--json", str(REPO_ROOT)], {}, f"eval.py compile: --json {REPO_ROOT}: is a folder"),
    (["compile", "--dump-dir", "/proc/x"], {},
     "eval.py compile: --dump-dir /proc/x: cannot write in /proc ("),
    (["compile", "--dump-dir", "/nonexistent/d"], {},
     ("eval.py compile: --dump-dir /nonexistent/d: the folder /nonexistent does not exist (create it "
      "first, or name a folder in an existing one)")),
    (["compile", "--dump-dir", str(REPO_ROOT / "eval.py")], {},
     f"eval.py compile: --dump-dir {REPO_ROOT / 'eval.py'}: is a file; expected a folder"),
    (["compile", "--dump-dir", str(REPO_ROOT / "eval.py" / "x")], {},
     f"eval.py compile: --dump-dir {REPO_ROOT / 'eval.py' / 'x'}: {REPO_ROOT / 'eval.py'} is a file"),
])
def test_every_input_is_checked_before_any_work(monkeypatch, capsys, argv, env, message):
    if message is None:  # a valid --modules list, with an output path refused after it
        argv = [*argv, "--json", "/proc/x.json"]
        message = "eval.py compile: --json /proc/x.json: cannot be created ("
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if "POPCORN_FD" not in env:
        monkeypatch.delenv("POPCORN_FD", raising=False)
    if env.get("POPCORN_FD") == "99":
        with pytest.raises(OSError):
            os.fstat(99)  # not open here either
    try:
        status = harness.main(argv)
    except SystemExit as exit_info:  # argparse
        status = exit_info.code
    assert status == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""  # nothing ran, nothing compiled


def test_output_paths_are_checked_and_leave_nothing_behind(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("POPCORN_FD", raising=False)
    target = tmp_path / "report.json"
    harness.check_output_file("--json", str(target))  # writable: no error, no file left
    assert not target.exists()
    target.write_text("kept")
    harness.check_output_file("--json", str(target))  # an existing file is not truncated
    assert target.read_text() == "kept"
    harness.check_output_file("--json", "/dev/null")
    harness.check_output_folder("--dump-dir", str(tmp_path / "new"))  # made by the run
    with pytest.raises(harness.UsageError, match=r"the folder .*/new does not exist"):
        harness.check_output_folder("--dump-dir", str(tmp_path / "new" / "deeper"))
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == [target]


def test_output_paths_in_a_folder_without_write_permission_are_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root writes anyway
            pytest.skip("running as root: a folder without write permission is writable")
        with pytest.raises(harness.UsageError, match=r"--json .*/locked/r.json: cannot be "
                                                     r"created \(Permission denied\)"):
            harness.check_output_file("--json", str(locked / "r.json"))
        with pytest.raises(harness.UsageError, match=r"cannot write in .*/locked \(Permission"):
            harness.check_output_folder("--dump-dir", str(locked / "dumps"))
    finally:
        locked.chmod(0o700)


def test_popcorn_fd_must_be_open_for_writing(monkeypatch, capsys):
    read_end, write_end = os.pipe()
    try:
        monkeypatch.setenv("POPCORN_FD", str(read_end))
        assert harness.main(["test"]) == 2
        assert capsys.readouterr().err == (
            f"POPCORN_FD = '{read_end}': file descriptor {read_end} is not open for writing; "
            "expected the number of an open file descriptor to write the results to\n")
    finally:
        os.close(read_end)
        os.close(write_end)


def test_case_seeds_beyond_the_generators_range_are_a_case_file_error(tmp_path, capsys):
    path = tmp_path / "cases.txt"
    largest = 2**64 - 1
    path.write_text(f"{GOOD}\nm: [40]; n: [64]; k: [256]; g: 1; seed: {largest}\n")
    assert harness.get_test_cases(str(path), None)[1].args["seed"] == largest
    # Combined with POPCORN_SEED, the second case's seed leaves the range: exit 113, that line
    with pytest.raises(SystemExit) as exit_info:
        harness.get_test_cases(str(path), 5)
    assert exit_info.value.code == 113
    combined = harness._combine(largest, 5)
    assert capsys.readouterr().err == (
        f"invalid test case file {path}:2: seed = {largest} combined with POPCORN_SEED = 5 is "
        f"{combined}; rule: the combined seed < 2**64 (the range of torch.manual_seed, which "
        "seeds the input generator)\n")
    # Through eval.py: before anything runs
    completed = run_quick("test", str(path), "--submission", str(TORCH_SUBMISSION),
                          env_extra={"POPCORN_SEED": "5"})
    assert completed.returncode == 113 and completed.stdout == ""
    assert completed.stderr.startswith(f"invalid test case file {path}:2: seed = ")


def test_the_closing_line_goes_to_stdout_too_and_once_to_a_terminal(tmp_path):
    cases = tmp_path / "one.txt"
    cases.write_text(ONE_CASE)
    closing = "1 of 1 test cases passed (examples/torch_submission.py)"
    completed = run_quick("test", str(cases), "--submission", str(TORCH_SUBMISSION))
    assert completed.returncode == 0
    assert completed.stdout.splitlines()[-2:] == ["check: pass", closing]
    assert completed.stderr.splitlines() == [closing]
    # stdout and stderr the same file (as a terminal is): the line once
    together = run_quick("test", str(cases), "--submission", str(TORCH_SUBMISSION),
                         capture_output=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert together.stdout.splitlines().count(closing) == 1


# ---------------------------------------------------------------------------------------
# compile mode
# ---------------------------------------------------------------------------------------


def test_compile_mode_without_build_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "REPO_ROOT", tmp_path)
    assert harness.main(["compile", "--anything"]) == 2
    assert "build_report.py" in capsys.readouterr().err


def test_compile_mode_passes_arguments_and_returns_the_exit_code(tmp_path, monkeypatch):
    (tmp_path / "build_report.py").write_text(
        "received = []\n"
        "def main(argv):\n"
        "    received.append(argv)\n"
        "    return 3\n")
    monkeypatch.setattr(harness, "REPO_ROOT", tmp_path)
    monkeypatch.delitem(sys.modules, "build_report", raising=False)
    assert harness.main(["compile", "--arch", "sm_100a", "-v"]) == 3
    assert sys.modules["build_report"].received == [["--arch", "sm_100a", "-v"]]
    sys.modules.pop("build_report")


def test_case_file_may_follow_an_option():
    args = harness.parse_args(["benchmark", "--hardened", "tests/cases/tests.txt"])
    assert args.mode == "benchmark" and args.hardened and args.file == "tests/cases/tests.txt"
    args = harness.parse_args(["test"])
    assert args.file is None and not args.hardened


# ---------------------------------------------------------------------------------------
# Progress, plots, packaging, the pytest summary line
# ---------------------------------------------------------------------------------------


class InProcessPool:
    """The worker pool's apply, run in this process (with cpu_timing's stand-ins); timing
    runs are cut to 3 repeats, so that the CPU gets through them quickly."""

    def apply(self, function, args=()):
        if function is harness._run_single_benchmark:
            test, recheck, _max_repeats, *rest = args
            args = (test, recheck, 3, *rest)
        return function(*args)


def test_benchmark_run_reports_progress_per_case_and_plots_it(cpu_timing, capsys, tmp_path):
    matplotlib_image = pytest.importorskip("matplotlib.image", reason="needs matplotlib")
    cpu_timing(TORCH_SUBMISSION)
    small = {"m": (8, 16), "n": (64, 128), "k": (256, 256), "g": 2}
    tests = [harness.TestCase(args={**small, "seed": 5}, spec="first"),
             harness.TestCase(args={**small, "m": (4, 4), "seed": 6}, spec="second")]
    status, results = harness.run_benchmarking(harness.StdoutOutput(), InProcessPool(), tests,
                                               False)
    assert status == 0 and all(isinstance(r, harness.BenchResult) for r in results)
    captured = capsys.readouterr()
    progress = captured.err.splitlines()
    assert progress[0] == "benchmark: warm-up on case 1 (G=2 M=8..16 N=64..128 K=256)"
    assert progress[1].startswith("benchmark: case 1 of 2 (G=2 M=8..16 N=64..128 K=256): ")
    assert progress[2] == (f"benchmark: case 2 of 2 (G=2 M=4 N=64..128 K=256): "
                           f"{results[1].stats.mean / 1e3:.2f} µs (3 repeats)")
    assert "benchmark.1.mean: " in captured.out  # the protocol's lines are unchanged

    report = harness.build_report("benchmark", str(TORCH_SUBMISSION), {"device": "cpu"}, tests,
                                  results, False)
    path = tmp_path / "bench.png"
    harness.plot_report(report, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib_image.imread(str(path))
    assert pixels.shape[0] > 300 and pixels.shape[1] > 600
    # The bars are drawn: the first series' colour covers a visible area.
    ours = torch.tensor([0x1F, 0x77, 0xB4]) / 255
    rgb = torch.from_numpy(pixels[:, :, :3].copy())
    assert int(((rgb - ours).abs().max(dim=2).values < 0.02).sum()) > 500


def test_plot_report_puts_our_mean_beside_the_speed_of_light(monkeypatch):
    drawn = []
    monkeypatch.setattr(harness, "write_plot", lambda *args: drawn.append(args))
    benchmarks = harness.get_test_cases(str(harness.DEFAULT_BENCHMARK_FILE), None)
    results = [harness.BenchResult(harness.calculate_stats([mean * 1e3] * 2), 9e3)
               for mean in (40.0, 20.0, 5.0)] + ["custom_kernel raised X"]
    report = harness.build_report("benchmark", "/x/submission.py", {"device": "GPU X"},
                                  benchmarks, results, False)
    harness.plot_report(report, "out.png")
    ((path, title, shapes),) = drawn
    assert path == "out.png"
    assert title.startswith("submission.py, benchmark on GPU X: geometric mean 15.87 µs")
    labels = [label for label, _ in shapes]
    assert labels[0].startswith("case 0\nG=8 M=64..248\nN=4096 K=7168\n")
    assert shapes[0][1] == {"ours (mean)": 40.0, "B200 speed of light": 18.833}
    assert shapes[2][1] == {"ours (mean)": 5.0, "B200 speed of light": 2.406}
    assert shapes[3][1] == {"error": "custom_kernel raised X"}


def test_plot_without_matplotlib_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert harness.main(["benchmark", "--plot", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err == ("--plot needs matplotlib, which is not installed: "
                                       "pip install -e '.[plot]' (or pip install matplotlib)\n")
    import peers
    assert peers.main(["--plot", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err.startswith("--plot needs matplotlib, which is not installed")


def test_peers_plot_shows_ours_beside_cublas_and_the_roofline(monkeypatch):
    import peers
    drawn = []
    monkeypatch.setattr(harness, "write_plot", lambda *args: drawn.append(args))
    row = {"shape": "G=2 M=192..320 N=3072 K=4096", "ours_us": 46.3, "cublas_us": 44.3,
           "roofline_us": 20.4}
    peers.plot_rows([row], "peers.png", "NVIDIA H200")
    ((path, title, shapes),) = drawn
    assert path == "peers.png" and "NVIDIA H200" in title
    assert shapes == [("G=2 M=192..320\nN=3072 K=4096\nours / cuBLAS 1.05", {
        "ours (nvfp4_group_gemm)": 46.3,
        "cuBLAS bf16, pre-dequantized": 44.3,
        "bf16 roofline (790 TFLOP/s)": 20.4,
    })]


def test_gpu_skip_summary_line():
    import conftest

    assert conftest.gpu_skip_summary([]) is None
    reasons = (["needs an sm_90 (Hopper) GPU"] * 3 + ["needs two CUDA devices"]
               + ["cuobjdump not on PATH (cross-check only)"])
    assert conftest.gpu_skip_summary(reasons) == (
        "4 tests skipped for lack of a GPU (3: needs an sm_90 (Hopper) GPU, 1: needs two CUDA "
        "devices); 1 skipped otherwise: cuobjdump not on PATH (cross-check only)")


def test_pytest_prints_the_gpu_skip_line(tmp_path):
    (tmp_path / "conftest.py").write_text((REPO_ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_sample.py").write_text(textwrap.dedent("""
        import pytest

        def test_runs():
            pass

        @pytest.mark.skipif(True, reason="needs an sm_100 or sm_90 GPU")
        @pytest.mark.parametrize("x", [1, 2])
        def test_gpu(x):
            pass

        @pytest.mark.skip(reason="not today")
        def test_other():
            pass
    """))
    completed = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                               timeout=300, check=False)
    assert completed.returncode == 0, completed.stdout
    lines = completed.stdout.splitlines()
    assert ("2 tests skipped for lack of a GPU (2: needs an sm_100 or sm_90 GPU); 1 skipped "
            "otherwise: not today") in lines
    assert lines[-1].startswith("1 passed, 3 skipped")  # pytest's own closing line stays last


def test_the_wheel_holds_the_package_and_no_top_level_module(tmp_path):
    """The wheel: nvfp4_group_gemm and its hopper subpackage, its version from __version__, the
    DSL as a range; none of the repository's scripts (task, utils, reference, eval, submission)."""
    pytest.importorskip("setuptools", reason="builds the wheel with the installed setuptools")
    import shutil
    import zipfile

    import nvfp4_group_gemm

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "task.py", "utils.py", "reference.py", "eval.py", "submission.py"):
        (source / name).write_bytes((REPO_ROOT / name).read_bytes())
    shutil.copytree(REPO_ROOT / "nvfp4_group_gemm", source / "nvfp4_group_gemm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    completed = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr
    (wheel,) = (tmp_path / "dist").glob(f"nvfp4_group_gemm-{nvfp4_group_gemm.__version__}-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top_level == {"nvfp4_group_gemm"}, names
    assert {"nvfp4_group_gemm/core/__init__.py", "nvfp4_group_gemm/core/runtime.py", "nvfp4_group_gemm/hopper/swap_ab.py", "nvfp4_group_gemm/bundle.py"} <= set(names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA")))
    assert b"Requires-Dist: nvidia-cutlass-dsl<4.9,>=4.3.5" in metadata, metadata[:2000]
    assert b"Provides-Extra: plot" in metadata


def test_popcorn_fd_may_be_stdout():
    """POPCORN_FD=1: the results go to stdout, which stays open for the closing lines."""
    env = dict(os.environ, POPCORN_FD="1")
    env.pop("POPCORN_SEED", None)
    completed = subprocess.run([sys.executable, "eval.py", "test"], check=False, cwd=REPO_ROOT, env=env,
                               capture_output=True, text=True, timeout=300)
    assert "Traceback" not in completed.stderr and "Bad file descriptor" not in completed.stderr
    assert "test-count: 10" in completed.stdout and "check: " in completed.stdout
    assert completed.returncode in (0, 112)  # a CPU machine runs submission.py under the protocol: 112


def test_attribute_reads_read_every_tensor_a_check_needs(monkeypatch):
    """The floor beside --fresh: attribute_reads returns the pointers of input_key and each
    tensor's dtype, shape, strides and device, a, b, c then the reordered scales; the timing
    runs on clones (new pointers), one figure per clone."""
    import host_overhead

    from nvfp4_group_gemm import core as submission
    from reference import generate_input

    data = generate_input(m=(40, 72), n=(128, 128), k=(256, 256), g=2, seed=3, device="cpu")
    pointers, attributes, sizes = host_overhead.attribute_reads(data)
    assert pointers == submission.input_key(data) and sizes == tuple(data[3])
    tensors = [*data[0][0], *data[0][1], *data[2][0], *data[2][1]]
    assert attributes == [(t.dtype, t.shape, t.stride(), -1) for t in tensors]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    figures = host_overhead.fresh_pointer_us(host_overhead.attribute_reads, data, 3)
    assert len(figures) == 3 and all(f > 0 for f in figures)


# ---------------------------------------------------------------------------------------
# What a new user meets first: --help, a hung case, the file that runs, compile's messages
# ---------------------------------------------------------------------------------------


def test_help_lists_every_mode():
    completed = run_quick("--help")
    assert completed.returncode == 0 and completed.stderr == ""
    lines = completed.stdout.splitlines()
    assert lines[0] == "usage: python eval.py MODE [FILE] [options]"
    listed = [line.split()[0] for line in lines if line.startswith("  ")]
    assert listed == ["test", "benchmark", "leaderboard", "profile", "selfcheck", "compile",
                      "gate"]
    assert "python eval.py MODE --help" in completed.stdout


@pytest.mark.parametrize("mode", ["test", "benchmark", "leaderboard", "profile"])
def test_each_protocol_mode_has_help_of_its_own(mode, capsys):
    with pytest.raises(SystemExit) as raised:
        harness.main([mode, "--help"])
    assert raised.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: eval.py {mode} [-h]")
    assert "--case-timeout S" in out and "--submission" in out and "--json" in out
    timed = mode in ("benchmark", "leaderboard")
    assert ("--hardened" in out) == timed and ("--plot" in out) == timed


def test_selfcheck_gate_and_compile_have_help_of_their_own(capsys, monkeypatch):
    assert harness.main(["selfcheck", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: eval.py selfcheck") and "--random" in out
    with pytest.raises(SystemExit) as raised:
        harness.main(["gate", "--help"])
    assert raised.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: eval.py gate") and "--compile-timeout" in out
    monkeypatch.delitem(sys.modules, "build_report", raising=False)
    with pytest.raises(SystemExit) as raised:
        harness.main(["compile", "--help"])
    assert raised.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("eval.py compile [ARGS...]: build every kernel")
    assert "--groups" in out and "--dump-dir" in out


def test_a_case_that_hangs_is_killed_at_the_case_timeout(tmp_path):
    """sleeps.py's custom_kernel sleeps 600 s: with --case-timeout 2 the first case fails in
    one line naming the case and the limit, the second does not run, exit 112, and the
    submission's process is gone."""
    cases = tmp_path / "two.txt"
    cases.write_text(TWO_CASES)
    ready = tmp_path / "ready"
    report_path = tmp_path / "report.json"
    start = time.monotonic()
    completed = run_quick("test", str(cases), "--submission", str(SUBMISSIONS / "sleeps.py"),
                          "--case-timeout", "2", "--json", str(report_path),
                          env_extra={"EVAL_TEST_READY": str(ready)})
    assert time.monotonic() - start < 45
    assert completed.returncode == 112, completed.stderr
    timed_out = "not done after 2 s (--case-timeout): the submission's process was killed"
    not_run = "not run: an earlier case timed out (--case-timeout)"
    assert completed.stderr.splitlines()[0] == (
        f"test: case 1 of 2 (G=1 M=40 N=64 K=256): FAILED: {timed_out}; 1 case not run")
    lines = protocol(completed.stdout)
    assert (lines["test.0.status"], lines["test.0.error"]) == ("fail", timed_out)
    assert (lines["test.1.status"], lines["test.1.error"]) == ("fail", not_run)
    assert lines["check"] == "fail"
    report = json.loads(report_path.read_text())
    assert [case["status"] for case in report["cases"]] == ["fail", "not run"]
    with pytest.raises(ProcessLookupError):
        os.kill(int(ready.read_text()), 0)


def test_the_default_case_timeout_leaves_the_competitions_limits_room():
    args = harness.parse_args(["test"])
    assert args.case_timeout == harness.CASE_TIMEOUT_S == 600  # > 180 s test, 300 s ranked
    assert harness.parse_args(["benchmark", "--case-timeout", "0"]).case_timeout == 0


@pytest.mark.parametrize(("capability", "entry"), [
    ((10, 0), "submission.py"),
    ((10, 3), "submission.py"),
    ((9, 0), "examples/library_submission.py"),
    ((8, 0), "examples/torch_submission.py"),
    ((9, 2), "examples/torch_submission.py"),
    ((12, 0), "examples/torch_submission.py"),
    (None, "examples/torch_submission.py"),
])
def test_the_file_that_runs_follows_the_gpu(capability, entry):
    assert harness.default_entry(capability) == REPO_ROOT / entry


@pytest.mark.parametrize(("mode", "capability", "entry", "said"), [
    ("test", (10, 0), "submission.py", None),
    ("benchmark", (10, 0), "submission.py", None),
    ("leaderboard", (9, 0), "examples/library_submission.py",
     ("an H100/H200 (sm_90): examples/library_submission.py runs (the library, "
     "nvfp4_group_gemm)")),
    ("benchmark", (8, 0), "examples/torch_submission.py",
     ("here the GPU is NVIDIA Fake (compute capability 8.0), so examples/torch_submission.py "
     "runs instead")),
    ("test", None, "examples/torch_submission.py",
     f"here torch {torch.__version__} sees no CUDA GPU, so examples/torch_submission.py runs"),
])
def test_without_submission_the_mode_runs_the_gpus_file(monkeypatch, capsys, mode, capability,
                                                        entry, said):
    monkeypatch.delenv("POPCORN_FD", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Fake")
    assert harness.choose_submission(harness.parse_args([mode])) == REPO_ROOT / entry
    err = capsys.readouterr().err
    assert (said in err) if said else err == ""
    # the runner's protocol: always submission.py, whatever the GPU
    monkeypatch.setenv("POPCORN_FD", "1")
    assert harness.choose_submission(harness.parse_args([mode])) == REPO_ROOT / "submission.py"


def test_compile_failure_reasons_are_never_cut_mid_word():
    import build_report

    reason = ("ValueError: NVFP4_SM100_KERNEL='fastest': must be one of persistent, per_tile, "
              "scaled_mm (the kernels of the sm100 backend, tried in this order when the "
              "variable is unset)")
    report = build_report.failed_report("sm100_persistent_gemm_t256", "sm_100a", 8,
                                        reason + "\nsecond line of the reason")
    lines = build_report.format_table([report]).splitlines()[2:]
    assert max(map(len, lines)) <= build_report.TABLE_WIDTH
    # the reason whole, wrapped between words: its words come back in order
    first = lines[0].split("FAILED: ", 1)[1]
    assert " ".join([first, *(line.strip() for line in lines[1:])]).split() == (
        reason + " second line of the reason").split()
    line = build_report.progress_line(1, 3, [report])
    assert len(line) <= build_report.TABLE_WIDTH and line.endswith(build_report.CUT_MARKER)
    shown = line.split("FAILED: ", 1)[1].removesuffix(build_report.CUT_MARKER)
    assert reason.startswith(shown) and reason[len(shown)] == " "  # a word boundary
    short = build_report.failed_report("sm100_per_tile_gemm", "sm_100a", 1, "ValueError: bad")
    assert build_report.progress_line(2, 3, [short]).endswith("FAILED: ValueError: bad")


def test_pytest_keeps_its_temporary_files_in_the_repository(tmp_path):
    """tmp_path lives in build/pytest-tmp/run-PID (not the machine's shared /tmp), and a run
    removes its folder when it ends. PID: the run's process (under pytest-xdist, the
    controller that started this worker)."""
    run = os.getppid() if "PYTEST_XDIST_WORKER" in os.environ else os.getpid()
    assert tmp_path.is_relative_to(REPO_ROOT / "build" / "pytest-tmp" / f"run-{run}")
    sample = tmp_path / "sample"
    sample.mkdir()
    (sample / "conftest.py").write_text((REPO_ROOT / "tests" / "conftest.py").read_text())
    (sample / "test_where.py").write_text(
        "def test_where(tmp_path):\n    (tmp_path / 'x').write_bytes(b'1' * 1000)\n"
        "    print('TMP', tmp_path)\n")
    completed = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p",
                                "no:cacheprovider", "--rootdir", str(sample), str(sample)],
                               cwd=sample,
                               capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 0, completed.stdout
    (where,) = [Path(line.split()[1]) for line in completed.stdout.splitlines()
                if line.startswith("TMP ")]
    assert where.parent.parent == sample / "build" / "pytest-tmp"
    assert not where.parent.exists() and list((sample / "build" / "pytest-tmp").iterdir()) == []


def test_traceback_prints_the_first_exception_once(tmp_path):
    """A raising submission: each case reports the exception in one line; --traceback also
    prints its first traceback, once, with the submission's frames."""
    raising = tmp_path / "raising.py"
    raising.write_text("def helper(data):\n    raise RuntimeError('deliberate failure in helper')\n\n\n"
                       "def custom_kernel(data):\n    return helper(data)\n")
    env = {key: value for key, value in os.environ.items() if key != "POPCORN_FD"}
    for flag, tracebacks in (([], 0), (["--traceback"], 1)):
        completed = subprocess.run([sys.executable, "eval.py", "test", "--submission", str(raising), *flag],
                                   cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert completed.returncode == 112
        assert completed.stdout.count("custom_kernel raised RuntimeError: deliberate failure in helper") == 10
        assert completed.stderr.count("Traceback (most recent call last)") == tracebacks, completed.stderr
        assert ("in helper" in completed.stderr) == bool(tracebacks)
