"""eval.py: test-file parser, seeds, statistics, report, and end-to-end runs on the CPU."""

import importlib
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import eval as harness

REPO_ROOT = Path(__file__).resolve().parents[1]
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
    assert first.startswith("submission.py needs an NVIDIA B200 (sm_100) or H100/H200 (sm_90); ")
    assert "so examples/torch_submission.py runs instead" in first
    assert "10 of 10 test cases passed (examples/torch_submission.py)" in rest
    assert "check: pass" in completed.stdout and "test.9.status: pass" in completed.stdout
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
    (["tset"], {}, "eval.py: argument mode: invalid choice: 'tset'"),
    (["test", "--plot", "x.png"], {}, "--plot applies to benchmark and leaderboard, not test"),
    (["profile", "--plot", "x.png"], {}, "--plot applies to benchmark and leaderboard"),
    (["test", "--hardened"], {}, "--hardened applies to benchmark and leaderboard, not test"),
    (["test", "--json", "/nonexistent-folder/r.json"], {},
     "--json /nonexistent-folder/r.json: the folder /nonexistent-folder does not exist"),
    (["benchmark", "--plot", "/nonexistent-folder/p.png"], {}, "--plot /nonexistent-folder"),
    (["test"], {"POPCORN_SEED": "abc"}, "POPCORN_SEED = 'abc': expected an integer"),
    (["compile", "--groups", "abc"], {},
     "compile: --groups 'abc': expected comma-separated group counts between 1 and 64"),
    (["compile", "--groups=0,2"], {}, "compile: --groups '0,2'"),
    (["test", "--bogus"], {}, "eval.py: unrecognized arguments: --bogus"),
    (["test", "--submission", "absent.py"], {}, "submission file not found: "),
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


def load_bench(name: str):
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO_ROOT / "bench"))


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
    module = load_bench(script)
    try:
        status = module.main(argv)
    except SystemExit as exit_info:  # argparse
        status = exit_info.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err

def test_peers_shapes_option_selects_benchmark_shapes_in_order():
    peers = load_bench("peers")
    assert peers.shape_list("2,3") == [2, 3]
    assert peers.shape_list("3,0") == [3, 0]
    assert [peers.BENCHMARKS[i][2][0] for i in peers.shape_list("2,3")] == [4096, 1536]
    for bad in ("", "0,,1", "-1", "0,1,2,3,0"):
        with pytest.raises(ValueError):
            peers.shape_list(bad)


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
    peers = load_bench("peers")
    assert peers.main(["--plot", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err.startswith("--plot needs matplotlib, which is not installed")


def test_peers_plot_shows_ours_beside_cublas_and_the_roofline(monkeypatch):
    peers = load_bench("peers")
    drawn = []
    monkeypatch.setattr(harness, "write_plot", lambda *args: drawn.append(args))
    row = {"shape": "G=2 M=192..320 N=3072 K=4096", "ours_us": 46.3, "cublas_us": 44.3,
           "roofline_us": 20.4}
    peers.plot_rows([row], "peers.png", "NVIDIA H200")
    ((path, title, shapes),) = drawn
    assert path == "peers.png" and "NVIDIA H200" in title
    assert shapes == [("G=2 M=192..320\nN=3072 K=4096\nours / cuBLAS 1.05", {
        "ours (submission.py)": 46.3,
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


def test_the_package_installs_no_top_level_modules(tmp_path):
    pytest.importorskip("setuptools", reason="builds the wheel with the installed setuptools")
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "task.py", "utils.py", "reference.py",
                 "eval.py", "submission.py"):
        (source / name).write_bytes((REPO_ROOT / name).read_bytes())
    completed = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr
    (wheel,) = (tmp_path / "dist").glob("nvfp4_group_gemm-*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert names and all(name.startswith("nvfp4_group_gemm-") and ".dist-info/" in name
                         for name in names), names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA")))
    assert b"Requires-Dist: nvidia-cutlass-dsl==4.3.5" in metadata
    assert b"Provides-Extra: plot" in metadata
