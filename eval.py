"""Evaluation harness: the competition's protocol, plus a readable report.

Protocol (as the leaderboard's eval_better_bench_grouped_gemm.py):
  python eval.py MODE FILE        MODE in test | benchmark | leaderboard | profile
  - results are `key: value` lines written to the file descriptor in POPCORN_FD;
  - FILE holds one case per line: `m: [..]; n: [..]; k: [..]; g: 8; seed: 1111`
    (an invalid case file exits with 113);
  - POPCORN_SEED, when set, is combined into every case's seed;
  - the submission runs in one spawned worker process;
  - benchmark: 15 inputs (seed + 42 each), one correctness pass over all of them, then per
    repeat an L2 flush and one CUDA event pair around 15 back-to-back calls (duration / 15),
    until the competition's stop rules hold.
Additions:
  - without POPCORN_FD the lines go to stdout; without FILE the shipped cases are used
    (tests/cases/tests.txt for test, tests/cases/benchmarks.txt otherwise);
  - case files are checked completely before anything runs: the keys m, n, k, g, seed each
    once, integers, m/n/k lists of g sizes, 1 <= g <= 64, M >= 1, N >= 1, K a positive
    multiple of 256, seed >= 0; blank lines and `#` comments are allowed; an empty file is
    invalid; the first problem is reported as one line (file, line, rule), exit 113;
  - after benchmark/leaderboard a table per case: mean and best µs, host µs per call,
    TFLOP/s, GB/s, % of the competition's speed of light, and the geometric mean;
  - --submission PATH runs another file than submission.py; --json PATH writes the results
    of any mode; --plot PATH (benchmark/leaderboard, needs matplotlib) draws them;
  - without --submission (and without POPCORN_FD, where it is always submission.py) the file
    follows the GPU (default_entry): submission.py on a B200 (sm_100), the library's entry
    examples/library_submission.py on an H100/H200 (sm_90, announced in one line), and
    examples/torch_submission.py anywhere else (announced in one line);
  - --case-timeout S (default 600; 0: none): a case (one call into the submission's process:
    the import, a test, a benchmark with its warm-up) that is not done after S seconds kills
    the process, fails in one line naming the case and the limit, the remaining cases are not
    run, exit 112;
  - --hardened (benchmark/leaderboard): every repeat runs on fresh clones of the 15 inputs in
    shuffled order, and every output of every repeat is checked;
  - leaderboard mode checks every output of every repeat (the competition's loop checks the
    last one only) and exits 112 on failure;
  - test mode runs on the CPU too; the timing modes need CUDA and say so;
  - progress of the timing modes goes to stderr, one line per case;
  - the harness survives its submission, in every mode: a worker process that exits
    (sys.exit, os._exit), aborts or faults fails the case it was running in one line (`the
    submission's process exited with code 7`), the remaining cases are reported as not run
    (`not run: ...`, status fail in the protocol, "not run" in --json), and the exit code is
    112; a submission that does not import fails the first case once, the rest are not run;
    a wrong output type (None, not g tensors) fails the case in one line;
  - the test mode's closing line (`10 of 10 test cases passed (FILE)`), and on a machine
    without a supported GPU the line naming examples/torch_submission.py, go to stderr and
    to stdout (once where both are the same terminal);
  - the whole command line and environment are checked before any work: output paths
    (--json, --plot) must be writable files, --submission a .py file, POPCORN_SEED an
    integer in 0..2**32-1 (numpy's seed range; utils.set_seed seeds numpy), POPCORN_FD an
    open, writable file descriptor; a case seed must be below 2**64 (torch.manual_seed's
    range), also once combined with POPCORN_SEED (else exit 113, naming the line);
  - Ctrl-C ends the run with one line on stderr and exit code 130;
  - python eval.py compile [ARGS...] runs build_report.main(ARGS) (no GPU needed), after
    checking --groups (1..64, no duplicates), --modules (build_report's backends), --json
    (a writable file) and --dump-dir (a writable folder, or a new one in an existing folder);
    it prints a line per kernel built on stderr;
  - python eval.py gate [FILE] runs gate.main: the leaderboard bot's checks on FILE (default
    submission.py), one line per check, exit 0 when all pass, 1 otherwise;
  - python eval.py --help lists every mode; python eval.py MODE --help lists its options;
  - python eval.py selfcheck [--json PATH] [--random N] [--repeats R] [--kernels A,B] runs
    selfcheck.main: every kernel this GPU's chain can pick, forced, and custom_kernel, on the
    tests, the benchmarks and N random group sets, checked against the exact sum, timed on
    the benchmark shapes (sm_100 kernels chained and unchained); one table and a JSON report
    (exit 2 without a GPU).
Exit codes: 0 every case passed; 112 a case failed (or did not run, or timed out); 113 invalid case file;
2 the command cannot run as asked (bad option, missing file, unwritable output path, bad
POPCORN_SEED or POPCORN_FD, no CUDA GPU for a timing mode, matplotlib missing for --plot),
always as one line on stderr; 130 interrupted (Ctrl-C); compile mode returns build_report's
code; gate 1 when a check failed.
"""

import argparse
import base64
import collections
import dataclasses
import fcntl
import importlib.util
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path

# Disable CuTe DSL file caching for more stable benchmarking (as the competition does).
os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"

import torch

from case_files import (  # noqa: F401 - re-exported: eval.py's names for them stay
    CASE_FORMAT,
    CASE_KEYS,
    CASE_SEED_LIMIT,
    K_MULTIPLE,
    MAX_GROUPS,
    CaseError,
    TestCase,
    _combine,
    get_test_cases,
    parse_case,
    read_test_cases,
)
from reference import generate_input, match_outputs, ref_kernel
from utils import clear_l2_cache_large as clear_l2_cache
from utils import set_seed

REPO_ROOT = Path(__file__).resolve().parent
DEFAULT_SUBMISSION = REPO_ROOT / "submission.py"
TORCH_EXAMPLE = REPO_ROOT / "examples" / "torch_submission.py"
LIBRARY_ENTRY = REPO_ROOT / "examples" / "library_submission.py"
DEFAULT_TEST_FILE = REPO_ROOT / "tests" / "cases" / "tests.txt"
DEFAULT_BENCHMARK_FILE = REPO_ROOT / "tests" / "cases" / "benchmarks.txt"

NUM_ITERATIONS_PER_BENCHMARK = 15
TIMING_MODES = ("benchmark", "leaderboard", "profile")

# Speed of light (µs) of the four official benchmark shapes, from the competition's task.yml
# (B200 at 1.5 GHz, max of FP4 tensor-core time and DRAM time), keyed by (m, n, k).
SPEED_OF_LIGHT_US = {
    ((80, 176, 128, 72, 64, 248, 96, 160), (4096,) * 8, (7168,) * 8): 18.833,
    ((40, 76, 168, 72, 164, 148, 196, 160), (7168,) * 8, (2048,) * 8): 10.667,
    ((192, 320), (3072, 3072), (4096, 4096)): 2.406,
    ((128, 384), (4096, 4096), (1536, 1536)): 1.525,
}


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------


class PopcornOutput:
    """`key: value` lines to the file descriptor named by POPCORN_FD."""

    def __init__(self, fd: int):
        # A duplicate: closing it at the end leaves the caller's descriptor (which may be
        # stdout) open
        self.file = os.fdopen(os.dup(fd), "w")
        os.set_inheritable(fd, False)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.file.close()

    def print(self, *args, **kwargs):
        print(*args, **kwargs, file=self.file, flush=True)

    def log(self, key, value):
        self.print(f"{key}: {value}")


class StdoutOutput(PopcornOutput):
    """The same lines on stdout, when no POPCORN_FD is given."""

    def __init__(self):
        self.file = sys.stdout

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.file.flush()


# ---------------------------------------------------------------------------------------
# Test cases: the competition's format and parser live in case_files.py (selfcheck.py reads
# them too); eval.py's names for them stay (tests and bench/ use harness.get_test_cases, ...)
# ---------------------------------------------------------------------------------------

# POPCORN_SEED also goes to utils.set_seed, whose numpy seed takes 0..2**32-1.
POPCORN_SEED_LIMIT = 2**32


# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stats:
    runs: int
    mean: float
    std: float
    err: float
    best: float
    worst: float


def calculate_stats(durations: list[float]) -> Stats:
    """Stats of durations in nanoseconds (sample standard deviation, error of the mean)."""
    runs = len(durations)
    total = sum(durations)
    best = min(durations)
    worst = max(durations)
    avg = total / runs
    variance = sum((x - avg) ** 2 for x in durations)
    std = math.sqrt(variance / (runs - 1))
    err = std / math.sqrt(runs)
    return Stats(runs=runs, mean=avg, std=std, err=err, best=float(best), worst=float(worst))


@dataclasses.dataclass
class BenchResult:
    stats: Stats
    host_ns_per_call: float  # CPU time of the 15 launches / 15, mean over repeats


def _clone_data(data):
    """Recursively clone every tensor (fresh allocations, so new pointers)."""
    if isinstance(data, tuple):
        return tuple(_clone_data(x) for x in data)
    if isinstance(data, list):
        return [_clone_data(x) for x in data]
    if isinstance(data, dict):
        return {k: _clone_data(v) for k, v in data.items()}
    if isinstance(data, torch.Tensor):
        return data.clone()
    return data


# ---------------------------------------------------------------------------------------
# Worker side (runs in the spawned process)
# ---------------------------------------------------------------------------------------

_submission_path: str | None = None


def _init_worker(submission_path: str):
    os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"
    global _submission_path
    _submission_path = submission_path


def _load_custom_kernel():
    """Import the submission file as module `submission` (once per worker)."""
    module = sys.modules.get("submission")
    if module is None:
        path = Path(_submission_path or DEFAULT_SUBMISSION)
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location("submission", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["submission"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["submission"]
            raise
    custom_kernel = getattr(module, "custom_kernel", None)
    if not callable(custom_kernel):
        raise TypeError(f"{Path(module.__file__).name} defines no function custom_kernel")
    return custom_kernel


def _import_submission() -> str | None:
    """Worker: import the submission once, before the first case; None, or why not (one
    line)."""
    try:
        _load_custom_kernel()
    except Exception as E:  # noqa: BLE001 - reported once, as the first case's failure
        return one_line(f"could not import the submission: {_describe_error(E)}")
    return None


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one_line(text: str) -> str:
    """A message fit for one `key: value` line of the protocol."""
    return " ".join(str(text).split("\n")).strip()


def _describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _raised(error: BaseException) -> str:
    """The submission's exception in one line for the report; with eval.py --traceback, its
    first one's traceback printed in full to stderr too."""
    global _TRACEBACK_PENDING
    if _TRACEBACK_PENDING is None:
        _TRACEBACK_PENDING = os.environ.get(TRACEBACK_SWITCH) == "1"
    if _TRACEBACK_PENDING:
        _TRACEBACK_PENDING = False
        import traceback

        print("eval.py --traceback: the submission's first exception:", file=sys.stderr)
        traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()
    return _describe_error(error)


# Set by `--traceback` for the submission's process (spawned: it inherits the environment)
TRACEBACK_SWITCH = "EVAL_PRINT_TRACEBACK"
_TRACEBACK_PENDING = None  # None: the switch not read yet in this process


def output_problem(output, g: int) -> str | None:
    """Why `output` is not what custom_kernel must return (a list or tuple of g tensors, C of
    each group), or None; checked before the comparison, which assumes that form."""
    if not isinstance(output, (list, tuple)):
        what = "None" if output is None else f"a {type(output).__name__}"
        return (f"custom_kernel returned {what}; expected a list of {g} "
                f"tensor{'s' * (g != 1)} (C of each group)")
    if len(output) != g:
        return (f"custom_kernel returned {len(output)} output{'s' * (len(output) != 1)}; "
                f"expected {g} tensor{'s' * (g != 1)} (C of each group)")
    for index, item in enumerate(output):
        if not isinstance(item, torch.Tensor):
            return (f"custom_kernel's output {index} is {type(item).__name__}; expected a "
                    f"tensor (C of group {index})")
    return None


def _match(expected, output) -> tuple[bool, str]:
    """match_outputs, after the output's form is checked; never raises."""
    problem = output_problem(output, len(expected))
    if problem:
        return False, problem
    try:
        return match_outputs(expected, output)
    except Exception as E:  # noqa: BLE001 - e.g. an output of a dtype torch cannot compare
        return False, one_line(f"the output could not be compared: {_describe_error(E)}")


def _run_single_test(test: TestCase):
    try:
        custom_kernel = _load_custom_kernel()
    except Exception as E:  # noqa: BLE001 - reported as a failed test, not a harness crash
        return False, f"could not import the submission: {_describe_error(E)}"
    try:
        data = generate_input(**test.args)
        _synchronize()
    except Exception as E:  # noqa: BLE001 - reported as a failed test, not a harness crash
        return False, f"could not generate the input: {_describe_error(E)}"
    try:
        submission_output = custom_kernel(_clone_data(data))
        _synchronize()
    except Exception as E:  # noqa: BLE001 - reported as a failed test, not a harness crash
        return False, f"custom_kernel raised {_raised(E)}"
    return check_output(data, submission_output)


def check_output(data, output):
    """The competition's check: reference on `data`, then rtol = atol = 1e-3 (after the
    output's form: a list of g tensors)."""
    problem = output_problem(output, len(data[0]))
    if problem:
        return False, problem
    return _match(ref_kernel(data), output)


def _run_single_benchmark(
    test: TestCase, recheck: bool, max_repeats: int, max_time_ns: float, hardened: bool = False
) -> BenchResult | str:
    try:
        custom_kernel = _load_custom_kernel()
    except Exception as E:  # noqa: BLE001 - reported as a failed benchmark
        return f"could not import the submission: {_describe_error(E)}"

    args = dict(test.args)
    data_list = []
    for _ in range(NUM_ITERATIONS_PER_BENCHMARK):
        if "seed" in args:
            args["seed"] += 42
        data_list.append(generate_input(**args))
    check_copy = _clone_data(data_list)

    # One obligatory correctness pass over all inputs.
    outputs = []
    try:
        for data in data_list:
            outputs.append(custom_kernel(_clone_data(data)))
    except Exception as E:  # noqa: BLE001
        return f"custom_kernel raised {_raised(E)}"
    # The reference is deterministic: compute each expected output once, reuse it for every
    # recheck below.
    expected = [ref_kernel(data) for data in check_copy]
    for index, output in enumerate(outputs):
        good, message = _match(expected[index], output)
        if not good:
            return f"input {index}: {message}"

    # Timing runs: at least 3 repeats and 100 ms; then stop once the relative error of the
    # mean is below 0.1%, the summed kernel time exceeds max_time_ns, or 2 minutes passed.
    order_rng = random.Random(args.get("seed", 0))
    check_every_repeat = recheck or hardened
    durations = []
    host_durations = []
    bm_start_time = time.perf_counter_ns()
    for repeat in range(max_repeats):
        order = list(range(NUM_ITERATIONS_PER_BENCHMARK))
        if hardened:
            order_rng.shuffle(order)
            run_inputs = [_clone_data(data_list[j]) for j in order]
        else:
            run_inputs = data_list
        torch.cuda.synchronize()

        outputs = []
        clear_l2_cache()
        start_event = torch.cuda.Event(enable_timing=True)
        end_event = torch.cuda.Event(enable_timing=True)
        start_event.record()
        host_start = time.perf_counter()
        try:
            for data in run_inputs:
                outputs.append(custom_kernel(data))
        except Exception as E:  # noqa: BLE001
            return f"repeat {repeat}: custom_kernel raised {_raised(E)}"
        host_elapsed_s = time.perf_counter() - host_start
        end_event.record()
        torch.cuda.synchronize()
        duration = (start_event.elapsed_time(end_event) / NUM_ITERATIONS_PER_BENCHMARK) * 1e6

        if check_every_repeat:
            for index, output in zip(order, outputs):
                good, message = _match(expected[index], output)
                if not good:
                    return f"repeat {repeat}, input {index}: {message}"

        durations.append(duration)
        host_durations.append(host_elapsed_s * 1e9 / NUM_ITERATIONS_PER_BENCHMARK)

        total_bm_duration = time.perf_counter_ns() - bm_start_time
        if repeat > 1 and total_bm_duration > 1e8:
            stats = calculate_stats(durations)
            if (
                stats.err / stats.mean < 0.001
                or stats.mean * stats.runs > max_time_ns
                or total_bm_duration > 120e9
            ):
                break

    return BenchResult(
        stats=calculate_stats(durations),
        host_ns_per_call=sum(host_durations) / len(host_durations),
    )


def _run_single_profile_torch(test: TestCase) -> str:
    from torch.cuda.nvtx import range as nvtx_range
    from torch.profiler import ProfilerActivity, profile

    custom_kernel = _load_custom_kernel()
    with nvtx_range("generate input"):
        data = generate_input(**test.args)
        torch.cuda.synchronize()
    cloned = _clone_data(data)
    with (
        profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
        nvtx_range("custom_kernel"),
    ):
        custom_kernel(cloned)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)


def _run_single_profile_ncu(test: TestCase) -> str:
    """Runs the kernel once inside the 'custom_kernel' NVTX range; eval runs under ncu."""
    from torch.cuda.nvtx import range as nvtx_range

    custom_kernel = _load_custom_kernel()
    with nvtx_range("generate input"):
        data = generate_input(**test.args)
        torch.cuda.synchronize()
    cloned = _clone_data(data)
    with nvtx_range("custom_kernel"):
        custom_kernel(cloned)
        torch.cuda.synchronize()
    return ""


def _describe_machine() -> dict:
    """Worker: the machine in words, once the submission is imported. The import comes first,
    before this process touches CUDA: the CuTe DSL imported after CUDA is initialized makes 34
    driver entry-point queries (cuGetProcAddress_v2) that the driver answers "invalid argument"
    (harmless; compute-sanitizer's memcheck reports each). A failed import is reported by
    load_submission, which imports again."""
    _import_submission()
    info = {"torch": torch.__version__, "dsl": _dsl_version(), "device": "cpu"}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        info.update(device=torch.cuda.get_device_name(), compute_capability=f"{major}.{minor}",
                    cuda=torch.version.cuda)
    return info


def _dsl_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return "not installed"


# ---------------------------------------------------------------------------------------
# The submission's process
# ---------------------------------------------------------------------------------------


class SubmissionLost(Exception):
    """The submission cannot go on: its process ended (exit, abort, fault) or it did not
    import. The case in progress fails with this one-line message; the others do not run,
    for the reason in `not_run`."""

    def __init__(self, message: str, not_run: str):
        super().__init__(message)
        self.not_run = not_run


class WorkerError(Exception):
    """A function run in the submission's process raised (one line); the case fails, the
    process goes on."""


def describe_exit(exitcode: int | None) -> str:
    """How the submission's process ended, in one line."""
    if exitcode is None:
        return "the submission's process stopped answering"
    if exitcode >= 0:
        return f"the submission's process exited with code {exitcode}"
    try:
        name = f" ({signal.Signals(-exitcode).name})"
    except ValueError:
        name = ""
    return f"the submission's process was ended by signal {-exitcode}{name}"


def _worker_loop(connection, submission_path: str) -> None:
    """Body of the submission's process: runs (function, args) requests until None or EOF.

    A function's exception is answered as one line; SystemExit (the submission's sys.exit)
    ends the process with its code, as os._exit, an abort or a fault end it: the driver
    sees the process end. Ctrl-C is the driver's to handle: this process ignores SIGINT and
    is ended by the driver."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(submission_path)
    while True:
        try:
            request = connection.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        function, args = request
        try:
            reply = ("ok", function(*args))
        except SystemExit:
            raise
        except BaseException as error:  # noqa: BLE001 - answered as the case's failure
            reply = ("error", one_line(_raised(error)))
        try:
            connection.send(reply)
        except Exception as error:  # noqa: BLE001 - e.g. a result that does not pickle
            connection.send(("error", one_line(f"the result could not be sent back: "
                                                f"{_describe_error(error)}")))


CASE_LIMIT = object()  # Worker.apply's default timeout: the worker's case_timeout


class Worker:
    """The submission's process: one spawned process (as the competition's Pool(1)) that
    runs this module's functions with `apply`, and notices when it ends: `apply` then raises
    SubmissionLost saying how, instead of waiting for ever. A call that takes longer than
    `case_timeout` seconds (None or 0: no limit) kills the process and raises SubmissionLost
    naming the limit."""

    def __init__(self, submission_path: str, case_timeout: float | None = None):
        self.case_timeout = case_timeout or None
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self.process = context.Process(target=_worker_loop, args=(child, submission_path),
                                       name="submission", daemon=True)
        self.process.start()
        child.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.close(wait=exc_type is None)
        return False

    def close(self, wait: bool = True) -> None:
        """Ends the process: asked to stop (wait), else (Ctrl-C, an error) terminated."""
        if wait and self.process.is_alive():
            try:
                self._connection.send(None)
                self.process.join(10)
            except OSError:
                pass
        for end in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                end()
                self.process.join(2)
        self._connection.close()

    def _lost(self) -> SubmissionLost:
        self.process.join(5)
        return SubmissionLost(describe_exit(self.process.exitcode),
                              "not run: the submission's process ended in an earlier case")

    def apply(self, function, args=(), timeout=CASE_LIMIT):
        """function(*args) in the submission's process; raises WorkerError (it raised) or
        SubmissionLost (the process ended, or the call took longer than `timeout` seconds:
        the worker's case_timeout unless given; None: no limit)."""
        timeout = self.case_timeout if timeout is CASE_LIMIT else timeout
        try:
            self._connection.send((function, tuple(args)))
        except (BrokenPipeError, ConnectionError):
            raise self._lost() from None
        ready = multiprocessing.connection.wait([self._connection, self.process.sentinel],
                                                timeout)
        if not ready:
            self.process.kill()
            self.process.join(5)
            raise SubmissionLost(f"not done after {timeout:g} s (--case-timeout): "
                                 "the submission's process was killed",
                                 "not run: an earlier case timed out (--case-timeout)")
        if self._connection not in ready:
            raise self._lost()
        try:
            kind, value = self._connection.recv()
        except (EOFError, OSError):
            raise self._lost() from None
        if kind == "error":
            raise WorkerError(value)
        return value


def load_submission(pool) -> None:
    """Imports the submission in its process before the first case; raises SubmissionLost
    (reported once, as the first case's failure) when it does not import."""
    not_run = "not run: the submission could not be imported"
    try:
        problem = pool.apply(_import_submission)
    except SubmissionLost as lost:
        raise SubmissionLost(f"could not import the submission: {lost}", not_run) from None
    except WorkerError as error:
        problem = f"could not import the submission: {error}"
    if problem:
        raise SubmissionLost(problem, not_run)


# ---------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------


def _progress(message: str) -> None:
    """One progress line on stderr (the protocol's lines go elsewhere)."""
    print(message, file=sys.stderr, flush=True)


def _same_file(first, second) -> bool:
    try:
        return os.path.sameopenfile(first.fileno(), second.fileno())
    except (OSError, ValueError, AttributeError):
        return False


def _announce(message: str) -> None:
    """A line for the reader as well as the log: on stderr (with the progress) and on
    stdout (with the results), once where the two are the same file (a terminal)."""
    _progress(message)
    if not _same_file(sys.stdout, sys.stderr):
        print(message, file=sys.stdout, flush=True)


def describe_case(args: dict) -> str:
    """`G=8 M=64..248 N=4096 K=7168`: a case's sizes in one short label."""

    def span(values) -> str:
        values = tuple(values or ())
        if not values:
            return "-"
        low, high = min(values), max(values)
        return str(low) if low == high else f"{low}..{high}"

    return (f"G={args.get('g')} M={span(args.get('m'))} N={span(args.get('n'))}"
            f" K={span(args.get('k'))}")


class CaseFailure(str):
    """A case that failed (where a mode's results have no other form for it); the text
    says why."""


class NotRun(CaseFailure):
    """A case that did not run; the text says why (`not run: ...`)."""


def stop_cases(logger, mode: str, tests: list[TestCase], results: list, failed_idx: int,
               lost: SubmissionLost, spec_logged: bool, as_result=lambda text: text):
    """The one way every mode ends when the submission is lost: case `failed_idx` fails
    with the message, every other case without a result yet is not run; each is logged
    (`{key}.{idx}.status: fail` and its error, key test or benchmark) and gets its result,
    as_result(CaseFailure or NotRun); one progress line says what happened."""
    key = "test" if mode == "test" else "benchmark"
    not_run = 0
    for idx in range(len(results), len(tests)):
        if idx != failed_idx or not spec_logged:
            logger.log(f"{key}.{idx}.spec", tests[idx].spec)
        if idx == failed_idx:
            text = CaseFailure(lost)
        else:
            text = NotRun(lost.not_run)
            not_run += 1
        logger.log(f"{key}.{idx}.status", "fail")
        logger.log(f"{key}.{idx}.error", text)
        results.append(as_result(text))
    _progress(f"{mode}: case {failed_idx + 1} of {len(tests)} "
              f"({describe_case(tests[failed_idx].args)}): FAILED: {lost}"
              + (f"; {not_run} case{'s' * (not_run != 1)} not run" if not_run else ""))


def run_testing(logger, pool, tests: list[TestCase]):
    """Returns (exit status, [(passed, message)] per case)."""
    results = []
    logger.log("test-count", len(tests))
    spec_logged = False
    try:
        load_submission(pool)
        for idx, test in enumerate(tests):
            logger.log(f"test.{idx}.spec", test.spec)
            spec_logged = True
            try:
                good, message = pool.apply(_run_single_test, (test,))
            except WorkerError as error:
                good, message = False, str(error)
            spec_logged = False
            results.append((good, message))
            if not good:
                logger.log(f"test.{idx}.status", "fail")
                logger.log(f"test.{idx}.error", message)
            else:
                logger.log(f"test.{idx}.status", "pass")
                if message:
                    logger.log(f"test.{idx}.message", message)
    except SubmissionLost as lost:
        stop_cases(logger, "test", tests, results, len(results), lost, spec_logged,
                   as_result=lambda text: (False, text))
    passed = all(good for good, _ in results)
    logger.log("check", "pass" if passed else "fail")
    return (0 if passed else 112), results


def run_single_benchmark(pool, test, recheck, max_repeats, max_time_ns, hardened=False):
    """One case's timing in the submission's process: BenchResult or the failure (str);
    raises SubmissionLost."""
    try:
        return pool.apply(_run_single_benchmark,
                          (test, recheck, max_repeats, max_time_ns, hardened))
    except WorkerError as error:
        return str(error)


def _log_benchmark(logger, idx: int, result) -> bool:
    if isinstance(result, BenchResult):
        for field in dataclasses.fields(Stats):
            logger.log(f"benchmark.{idx}.{field.name}", getattr(result.stats, field.name))
        return True
    logger.log(f"benchmark.{idx}.status", "fail")
    logger.log(f"benchmark.{idx}.error", str(result))
    return False


def _report_progress(mode: str, idx: int, count: int, test: TestCase, result) -> None:
    if isinstance(result, BenchResult):
        outcome = f"{result.stats.mean / 1e3:.2f} µs ({result.stats.runs} repeats)"
    else:
        outcome = "FAILED"
    _progress(f"{mode}: case {idx + 1} of {count} ({describe_case(test.args)}): {outcome}")


def run_benchmarking(logger, pool, tests: list[TestCase], hardened: bool):
    passed = True
    results = []
    counted = spec_logged = False
    try:
        load_submission(pool)
        _progress(f"benchmark: warm-up on case 1 ({describe_case(tests[0].args)})")
        run_single_benchmark(pool, tests[0], False, 100, 10e7, hardened)  # warm-up
        logger.log("benchmark-count", len(tests))
        counted = True
        for idx, test in enumerate(tests):
            logger.log(f"benchmark.{idx}.spec", test.spec)
            spec_logged = True
            result = run_single_benchmark(pool, test, False, 100, 10e9, hardened)
            spec_logged = False
            passed = _log_benchmark(logger, idx, result) and passed
            results.append(result)
            _report_progress("benchmark", idx, len(tests), test, result)
    except SubmissionLost as lost:
        if not counted:
            logger.log("benchmark-count", len(tests))
        stop_cases(logger, "benchmark", tests, results, len(results), lost, spec_logged)
        passed = False
    logger.log("check", "pass" if passed else "fail")
    return (0 if passed else 112), results


def run_leaderboard(logger, pool, tests: list[TestCase], hardened: bool):
    passed = True
    results = []
    counted = False
    idx = 0
    try:
        load_submission(pool)
        for idx, test in enumerate(tests):  # warm up every shape
            _progress(f"leaderboard: warm-up {idx + 1} of {len(tests)} "
                      f"({describe_case(test.args)})")
            run_single_benchmark(pool, test, False, 50, 5e8, hardened)
        logger.log("benchmark-count", len(tests))
        counted = True
        for idx, test in enumerate(tests):
            result = run_single_benchmark(pool, test, True, 100, 30e9, hardened)
            logger.log(f"benchmark.{idx}.spec", test.spec)
            results.append(result)
            _report_progress("leaderboard", idx, len(tests), test, result)
            if not _log_benchmark(logger, idx, result):
                passed = False
                break
    except SubmissionLost as lost:
        if not counted:
            logger.log("benchmark-count", len(tests))
        stop_cases(logger, "leaderboard", tests, results, idx, lost, False)
        passed = False
    logger.log("check", "pass" if passed else "fail")
    return (0 if passed else 112), results


def run_profiling(logger, pool, tests: list[TestCase]):
    """Returns (exit status, [profiler table, or CaseFailure / NotRun, per case])."""
    use_ncu = os.getenv("POPCORN_NCU", "0") not in ("", "0")
    logger.log("benchmark-count", len(tests))
    reports = []
    spec_logged = False
    try:
        load_submission(pool)
        for idx, test in enumerate(tests):
            logger.log(f"benchmark.{idx}.spec", test.spec)
            spec_logged = True
            worker = _run_single_profile_ncu if use_ncu else _run_single_profile_torch
            try:
                report = pool.apply(worker, (test,))
            except WorkerError as error:
                report = CaseFailure(error)
            spec_logged = False
            reports.append(report)
            if isinstance(report, CaseFailure):
                logger.log(f"benchmark.{idx}.status", "fail")
                logger.log(f"benchmark.{idx}.error", report)
                outcome = "FAILED"
            else:
                logger.log(
                    f"benchmark.{idx}.report",
                    base64.b64encode(report.encode("utf-8"), b"+*").decode("utf-8"),
                )
                outcome = "done"
            _progress(f"profile: case {idx + 1} of {len(tests)} ({describe_case(test.args)}) "
                      f"{outcome}")
    except SubmissionLost as lost:
        stop_cases(logger, "profile", tests, reports, len(reports), lost, spec_logged)
    passed = not any(isinstance(report, CaseFailure) for report in reports)
    logger.log("check", "pass" if passed else "fail")
    return (0 if passed else 112), reports


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def case_metrics(args: dict) -> dict:
    """FLOPs and bytes of one case: A, B (packed fp4), scales (1 byte per 16), C (fp16)."""
    m, n, k = tuple(args["m"]), tuple(args["n"]), tuple(args["k"])
    flops = sum(2 * mi * ni * ki for mi, ni, ki in zip(m, n, k))
    num_bytes = sum(
        (mi + ni) * ki // 2 + (mi + ni) * ki // 16 + 2 * mi * ni for mi, ni, ki in zip(m, n, k)
    )
    return {"flops": flops, "bytes": num_bytes, "sol_us": SPEED_OF_LIGHT_US.get((m, n, k))}


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def build_report(mode: str, submission: str, machine: dict, tests, results,
                 hardened: bool) -> dict:
    cases = []
    for test, result in zip(tests, results):
        metrics = case_metrics(test.args)
        case = {"spec": test.spec, **{key: test.args.get(key) for key in ("m", "n", "k", "g")}}
        if isinstance(result, BenchResult):
            mean_us = result.stats.mean / 1e3
            case.update(
                runs=result.stats.runs,
                mean_us=mean_us,
                best_us=result.stats.best / 1e3,
                std_us=result.stats.std / 1e3,
                err_us=result.stats.err / 1e3,
                host_us_per_call=result.host_ns_per_call / 1e3,
                tflops=metrics["flops"] / (mean_us * 1e-6) / 1e12,
                gbps=metrics["bytes"] / (mean_us * 1e-6) / 1e9,
                sol_us=metrics["sol_us"],
                sol_pct=(100.0 * metrics["sol_us"] / mean_us) if metrics["sol_us"] else None,
            )
        else:
            if isinstance(result, NotRun):
                case["status"] = "not run"
            case["error"] = str(result)
        cases.append(case)
    timed = [c for c in cases if "mean_us" in c]
    report = {
        "mode": mode,
        "hardened": hardened,
        "submission": submission,
        "machine": machine,
        "cases": cases,
        "geomean_us": geometric_mean([c["mean_us"] for c in timed]) if timed else None,
    }
    with_sol = [c["sol_pct"] for c in timed if c["sol_pct"]]
    report["geomean_sol_pct"] = geometric_mean(with_sol) if with_sol else None
    return report


def format_report(report: dict) -> str:
    machine = report["machine"]
    lines = [
        (f"GPU: {machine.get('device')} (compute capability "
         f"{machine.get('compute_capability')}), torch {machine.get('torch')}, "
         f"CUDA {machine.get('cuda')}, nvidia-cutlass-dsl {machine.get('dsl')}"),
        f"submission: {report['submission']}   mode: {report['mode']}"
        + ("   hardened: fresh clones, shuffled, every output checked" if report["hardened"]
           else ""),
        "",
        (f"{'case':<5} {'G':>2} {'M':>16} {'N':>10} {'K':>10} {'mean µs':>10} {'best µs':>10}"
         f" {'host µs/call':>12} {'TFLOP/s':>9} {'GB/s':>8} {'B200 SOL µs':>11} {'% SOL':>7}"),
    ]

    def span(values) -> str:
        values = tuple(values or ())
        if not values:
            return "-"
        low, high = min(values), max(values)
        return str(low) if low == high else f"{low}..{high}"

    for idx, case in enumerate(report["cases"]):
        head = (f"{idx:<5} {case['g']!s:>2} {span(case['m']):>16} {span(case['n']):>10}"
                f" {span(case['k']):>10}")
        if "error" in case:
            if case.get("status") == "not run":
                lines.append(f"{head} NOT RUN: {case['error'].removeprefix('not run: ')[:400]}")
            else:
                lines.append(f"{head} FAILED: {case['error'][:400]}")
            continue
        sol = f"{case['sol_us']:.3f}" if case["sol_us"] else "-"
        pct = f"{case['sol_pct']:.1f}" if case["sol_pct"] else "-"
        lines.append(
            f"{head} {case['mean_us']:>10.2f} {case['best_us']:>10.2f}"
            f" {case['host_us_per_call']:>12.2f} {case['tflops']:>9.1f} {case['gbps']:>8.1f}"
            f" {sol:>11} {pct:>7}"
        )
    if report["geomean_us"] is not None:
        line = f"geometric mean: {report['geomean_us']:.2f} µs"
        if report["geomean_sol_pct"] is not None:
            line += f", {report['geomean_sol_pct']:.1f} % of the B200 speed of light"
        lines.append(line)
    return "\n".join(lines)


def _case_fields(test: TestCase) -> dict:
    return {"spec": test.spec, **{key: test.args.get(key) for key in ("m", "n", "k", "g")}}


def build_test_report(submission: str, machine: dict, tests, results) -> dict:
    """The data of a test run: each case's status (and error), the count passed."""
    cases = []
    for test, (good, message) in zip(tests, results):
        status = "pass" if good else "not run" if isinstance(message, NotRun) else "fail"
        case = {**_case_fields(test), "status": status}
        if message:
            case["error" if not good else "message"] = str(message)
        cases.append(case)
    passed = sum(1 for case in cases if case["status"] == "pass")
    not_run = sum(1 for case in cases if case["status"] == "not run")
    return {"mode": "test", "submission": submission, "machine": machine, "cases": cases,
            "passed": passed, "not_run": not_run,
            "check": "pass" if passed == len(cases) else "fail"}


def build_profile_report(submission: str, machine: dict, tests, reports) -> dict:
    """The data of a profile run: each case's profiler table (empty under POPCORN_NCU), or
    why it failed or did not run."""
    cases = []
    for test, report in zip(tests, reports):
        if isinstance(report, CaseFailure):
            status = "not run" if isinstance(report, NotRun) else "fail"
            cases.append({**_case_fields(test), "status": status, "error": str(report)})
        else:
            cases.append({**_case_fields(test), "status": "pass", "report": report})
    return {"mode": "profile", "submission": submission, "machine": machine, "cases": cases}


def _short_us(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


PLOT_COLORS = ("#1f77b4", "#ff7f0e", "#7f7f7f", "#2ca02c")


def write_plot(path, title: str, shapes: list[tuple[str, dict]]) -> None:
    """A PNG with one panel per shape: a bar per named figure (µs), its value written on it.

    `shapes`: (label, {series name: µs or None, or the key "error": text}) per shape; a
    series that is None for a shape is left out of that panel. Needs matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for _, values in shapes:
        series += [name for name in values if name != "error" and name not in series]
    colors = {name: PLOT_COLORS[i % len(PLOT_COLORS)] for i, name in enumerate(series)}
    fig, axes = plt.subplots(1, len(shapes), figsize=(max(4.0, 2.6 * len(shapes)), 4.2),
                             squeeze=False)
    for ax, (label, values) in zip(axes[0], shapes):
        ax.set_title(label, fontsize=8)
        if values.get("error"):
            ax.text(0.5, 0.5, "failed", ha="center", va="center", color="red",
                    transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        names = [name for name in series if values.get(name) is not None]
        bars = ax.bar(range(len(names)), [values[name] for name in names],
                      color=[colors[name] for name in names])
        ax.bar_label(bars, labels=[_short_us(values[name]) for name in names], fontsize=7)
        ax.set_xticks([])
        ax.set_ylabel("µs per call (lower is better)", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.margins(y=0.15)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[name]) for name in series]
    fig.legend(handles, series, loc="lower center", ncol=len(series), fontsize=8,
               frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_report(report: dict, path) -> None:
    """eval.py's picture of a benchmark/leaderboard report: per case, our mean µs beside
    the competition's B200 speed of light (the four official shapes)."""
    machine = report["machine"]
    shapes = []
    for idx, case in enumerate(report["cases"]):
        label = f"case {idx}\n{describe_case(case)}".replace(" N=", "\nN=")
        if "error" in case:
            shapes.append((label, {"error": case["error"]}))
            continue
        if case.get("sol_pct"):
            label += f"\n{case['sol_pct']:.1f} % of the speed of light"
        shapes.append((label, {"ours (mean)": case["mean_us"],
                               "B200 speed of light": case["sol_us"]}))
    title = (f"{Path(report['submission']).name}, {report['mode']} on {machine.get('device')}")
    if report.get("geomean_us") is not None:
        title += f": geometric mean {report['geomean_us']:.2f} µs"
        if report.get("geomean_sol_pct") is not None:
            title += f", {report['geomean_sol_pct']:.1f} % of the B200 speed of light"
    write_plot(path, title, shapes)


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse with the harness's failure style: one line on stderr, exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


class UsageError(Exception):
    """The command cannot run as asked: reported as one line, exit 2."""


class _CompileOptionParser(argparse.ArgumentParser):
    """The options of build_report that eval.py checks before anything compiles (the
    rest pass through to build_report untouched)."""

    def error(self, message):
        raise UsageError(f"eval.py compile: {message}")


def _check_compile_args(argv: list[str], backend_modules=None) -> None:
    """build_report's options, checked before anything compiles: --groups (distinct counts
    in 1..MAX_GROUPS), --modules (names among `backend_modules`, when known), --json (a
    writable file), --dump-dir (a writable folder); raises UsageError."""
    parser = _CompileOptionParser(prog="eval.py compile", add_help=False)
    for option in ("--groups", "--modules", "--json", "--dump-dir"):
        parser.add_argument(option)
    options, _rest = parser.parse_known_args(argv)
    if options.groups is not None:
        value = options.groups
        items = [item.strip() for item in value.split(",") if item.strip()]
        if not items or not all(item.isdigit() and 1 <= int(item) <= MAX_GROUPS
                                for item in items):
            raise UsageError(f"eval.py compile: --groups {value!r}: expected comma-separated group "
                             f"counts between 1 and {MAX_GROUPS}, e.g. 1,2,8")
        counts = collections.Counter(int(item) for item in items)
        twice = sorted(count for count, times in counts.items() if times > 1)
        if twice:
            raise UsageError(f"eval.py compile: --groups {value!r}: {', '.join(map(str, twice))} given "
                             f"more than once; expected distinct group counts between 1 and "
                             f"{MAX_GROUPS}, e.g. 1,2,8")
    if options.modules is not None and backend_modules is not None:
        value = options.modules
        names = [name.strip() for name in value.split(",") if name.strip()]
        allowed = ", ".join(backend_modules)
        unknown = [name for name in names if name not in backend_modules]
        if not names or unknown:
            what = (f"unknown module{'s' * (len(unknown) != 1)} {', '.join(map(repr, unknown))}"
                    if unknown else "no module named")
            raise UsageError(f"eval.py compile: --modules {value!r}: {what}; the modules are "
                             f"{allowed} (comma-separated)")
        if len(set(names)) != len(names):
            raise UsageError(f"eval.py compile: --modules {value!r}: a module named more than once; "
                             f"the modules are {allowed} (comma-separated)")
    check_output_file("eval.py compile: --json", options.json)
    check_output_folder("eval.py compile: --dump-dir", options.dump_dir)


def run_compile(argv: list[str]) -> int:
    """`python eval.py compile ARGS...` -> build_report.main(ARGS); needs no GPU."""
    path = REPO_ROOT / "build_report.py"
    if not path.exists():
        print(f"compile mode needs {path} (it compiles the kernels for sm_100a and reports "
              "their resources); it does not exist yet.", file=sys.stderr)
        return 2
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    spec = importlib.util.spec_from_file_location("build_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_report"] = module
    spec.loader.exec_module(module)
    if "-h" in argv or "--help" in argv:
        print(f"eval.py compile [ARGS...]: {MODES['compile']}; ARGS are build_report.py's:",
              flush=True)
    try:
        _check_compile_args(argv, getattr(module, "BACKEND_MODULES", None))
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    return int(module.main(list(argv)))


PROTOCOL_MODES = ("test", "benchmark", "leaderboard", "profile")
# Every mode, with its line in `python eval.py --help` (each mode has --help of its own)
MODES = {
    "test": "check the submission on the test cases (tests/cases/tests.txt); runs on a CPU",
    "benchmark": "time it the leaderboard's way on the benchmark cases (CUDA GPU)",
    "leaderboard": "the ranked run: warm-up, then timing with every output checked (CUDA GPU)",
    "profile": "a torch profiler table per case (CUDA GPU; POPCORN_NCU=1: under ncu)",
    "selfcheck": "every kernel this GPU's chain can pick, forced, checked and timed (GPU)",
    "compile": "build every kernel for its architecture, report registers and shared memory "
               "(no GPU)",
    "gate": "the leaderboard bot's checks on a file before you submit it (no GPU)",
}
EXIT_CODES = ("exit codes: 0 pass; 112 a case failed, did not run or timed out; 113 invalid "
              "case file; 2 cannot run as asked (one line on stderr); 130 Ctrl-C; gate: 1 a "
              "check failed")
CASE_TIMEOUT_S = 600.0  # per case (one call into the submission's process); 0: none


def main_help() -> str:
    """`python eval.py --help`: every mode in a line, and where each mode's options are."""
    width = max(map(len, MODES))
    return "\n".join([
        "usage: python eval.py MODE [FILE] [options]",
        "",
        "Test and time a submission with the competition's protocol (docs/EVAL.md).",
        "",
        "modes (python eval.py MODE --help: that mode's options):",
        *(f"  {mode:<{width}}  {text}" for mode, text in MODES.items()),
        "",
        *textwrap.wrap(EXIT_CODES, 79),
    ]) + "\n"


def mode_parser(mode: str) -> argparse.ArgumentParser:
    """The options of one of the protocol's modes (test, benchmark, leaderboard, profile)."""
    timed = mode in ("benchmark", "leaderboard")
    parser = OneLineArgumentParser(
        prog=f"eval.py {mode}",
        description=f"{MODES[mode][0].upper()}{MODES[mode][1:]}.",
        epilog=EXIT_CODES,
    )
    default_file = "tests/cases/tests.txt" if mode == "test" else "tests/cases/benchmarks.txt"
    parser.add_argument("file", nargs="?", help=f"case file (default: {default_file})")
    parser.add_argument("--submission", default=None, metavar="PATH",
                        help="submission file defining custom_kernel (default, by the GPU: "
                             "submission.py on a B200 (sm_100), examples/library_submission.py "
                             "on an H100/H200 (sm_90), examples/torch_submission.py elsewhere)")
    parser.add_argument("--json", dest="json_path", metavar="PATH",
                        help="write the results here")
    parser.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT_S, metavar="S",
                        help=f"seconds one case may take (default {CASE_TIMEOUT_S:g}; 0: no "
                             "limit): on expiry the submission's process is killed, the case "
                             "fails, the rest do not run, exit 112")
    parser.add_argument("--traceback", action="store_true",
                        help="print the full traceback of the submission's first exception, once, to stderr "
                             "(the report shows each failing case's exception in one line)")
    parser.add_argument("--plot", dest="plot_path", metavar="PATH",
                        help=("draw the results into this PNG (needs matplotlib: pip install "
                              "-e '.[plot]')") if timed else argparse.SUPPRESS)
    parser.add_argument("--hardened", action="store_true",
                        help=("fresh shuffled input clones per repeat, every output checked")
                        if timed else argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line of a protocol mode: MODE first (an option before it is moved after
    it, as `--hardened benchmark` was accepted), then the case file and options in any order.
    Raises SystemExit (2 and one line on stderr for a bad command, 0 after --help)."""
    argv = list(argv)
    if not argv:
        OneLineArgumentParser(prog="eval.py").error(
            f"a mode is required: {', '.join(MODES)}")
    if argv[0] in ("-h", "--help"):
        print(main_help(), end="")
        raise SystemExit(0)
    if argv[0] not in PROTOCOL_MODES:
        later = next((item for item in argv if item in PROTOCOL_MODES), None)
        if argv[0].startswith("-") and later is not None:
            argv.remove(later)
            argv.insert(0, later)
        else:
            OneLineArgumentParser(prog="eval.py").error(
                f"unknown mode {argv[0]!r}; the modes are {', '.join(MODES)}")
    # Intermixed: `benchmark --hardened FILE` puts the file after an option
    args = mode_parser(argv[0]).parse_intermixed_args(argv[1:])
    args.mode = argv[0]
    return args


def gpu_capability() -> tuple[int, int] | None:
    """The compute capability of the current CUDA GPU, or None without one."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def describe_gpu(capability: tuple[int, int] | None) -> str:
    if capability is None:
        return f"torch {torch.__version__} sees no CUDA GPU"
    major, minor = capability
    return f"the GPU is {torch.cuda.get_device_name()} (compute capability {major}.{minor})"


def default_entry(capability: tuple[int, int] | None) -> Path:
    """The file a mode runs without --submission, by compute capability (None: no CUDA GPU):
    submission.py, the leaderboard file, on a B200 (sm_100, 10.x); the library's entry
    examples/library_submission.py (nvfp4_group_gemm) on an H100/H200 (sm_90, 9.0); the
    PyTorch example examples/torch_submission.py anywhere else."""
    if capability is not None and capability[0] == 10:
        return DEFAULT_SUBMISSION
    if capability is not None and tuple(capability) == (9, 0):
        return LIBRARY_ENTRY
    return TORCH_EXAMPLE


def supported_gpu() -> tuple[bool, str]:
    """Whether this machine has a GPU the project has kernels for (sm_100: submission.py;
    sm_90: the library), and the GPU in words."""
    capability = gpu_capability()
    return default_entry(capability) != TORCH_EXAMPLE, describe_gpu(capability)


def _display_path(path: Path) -> str:
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def check_output_file(option: str, value: str | None) -> None:
    """`value` (an option's output file) can be written: not a folder, in an existing
    folder, creatable there; raises UsageError. Leaves no file behind."""
    if value is None:
        return
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{option} {value}: is a folder; expected a file name")
    folder = path.resolve().parent
    if not folder.exists():
        raise UsageError(f"{option} {value}: the folder {folder} does not exist")
    if not folder.is_dir():
        raise UsageError(f"{option} {value}: {folder} is not a folder")
    if path.exists() and not path.is_file():
        return  # a device or a pipe (/dev/null, /dev/stdout): written as it is
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        what = "cannot be written" if existed else "cannot be created"
        raise UsageError(f"{option} {value}: {what} "
                         f"({error.strerror or _describe_error(error)})") from None
    if not existed:
        path.unlink(missing_ok=True)


def check_output_folder(option: str, value: str | None) -> None:
    """`value` (an option's output folder) is a folder that can be written, or one that can
    be created in an existing, writable folder (its parent: no chain of folders is made, as
    --json's folder must exist); raises UsageError."""
    if value is None:
        return
    path = Path(value).resolve()
    existing = path if path.exists() else path.parent
    if not existing.exists():
        ancestor = existing
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise UsageError(f"{option} {value}: {ancestor} is a file; expected a folder")
        raise UsageError(f"{option} {value}: the folder {existing} does not exist (create it "
                         "first, or name a folder in an existing one)")
    if not existing.is_dir():
        where = "is a file" if existing == path else f"{existing} is a file"
        raise UsageError(f"{option} {value}: {where}; expected a folder")
    try:
        handle, name = tempfile.mkstemp(dir=existing, prefix=".eval-write-check-")
        os.close(handle)
        os.unlink(name)
    except OSError as error:
        raise UsageError(f"{option} {value}: cannot write in {existing} "
                         f"({error.strerror or _describe_error(error)})") from None


def check_options(args: argparse.Namespace) -> None:
    """Everything about the command line that can be checked before any work; raises
    UsageError."""
    timed = args.mode in ("benchmark", "leaderboard")
    if not args.case_timeout >= 0:  # NaN too
        raise UsageError(f"--case-timeout {args.case_timeout:g}: expected seconds >= 0 (0: no "
                         "limit)")
    if args.hardened and not timed:
        raise UsageError(f"--hardened applies to benchmark and leaderboard, not {args.mode}")
    if args.plot_path is not None:
        if not timed:
            raise UsageError(f"--plot applies to benchmark and leaderboard, not {args.mode}")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib, which is not installed: "
                             "pip install -e '.[plot]' (or pip install matplotlib)") from None
    check_output_file("--json", args.json_path)
    check_output_file("--plot", args.plot_path)
    if args.submission is not None:
        if Path(args.submission).suffix != ".py":
            raise UsageError(f"--submission {args.submission}: expected a Python file (.py) "
                             "that defines custom_kernel")
        if not Path(args.submission).is_file():
            raise UsageError(f"submission file not found: {Path(args.submission).resolve()}")


def choose_submission(args: argparse.Namespace) -> Path:
    """The file to run: --submission; else, under the runner's protocol (POPCORN_FD),
    submission.py; else default_entry() for this machine's GPU. The library's entry and the
    PyTorch example are announced in one line."""
    if args.submission is not None:
        return Path(args.submission).resolve()
    if os.getenv("POPCORN_FD"):
        entry = DEFAULT_SUBMISSION  # the runner's protocol: always submission.py
    else:
        capability = gpu_capability()
        entry = default_entry(capability)
    if not entry.is_file():
        raise UsageError(f"submission file not found: {entry}")
    if entry == LIBRARY_ENTRY:
        _progress(f"an H100/H200 (sm_90): {_display_path(LIBRARY_ENTRY)} runs (the library, "
                  "nvfp4_group_gemm); submission.py is the B200 leaderboard file "
                  "(--submission submission.py runs it anyway)")
    elif entry == TORCH_EXAMPLE:
        _announce(f"submission.py needs an NVIDIA B200 (sm_100), the library an H100/H200 "
                  f"(sm_90); here {describe_gpu(capability)}, so {_display_path(TORCH_EXAMPLE)} "
                  "runs instead, to show the harness end to end (--submission submission.py "
                  "runs submission.py anyway).")
    return entry


def _popcorn_seed() -> int | None:
    """POPCORN_SEED (taken out of the environment, as the competition does), checked."""
    seed = os.environ.pop("POPCORN_SEED", None)
    if not seed:
        return None
    rule = (f"expected an integer between 0 and {POPCORN_SEED_LIMIT - 1} (2**32 - 1, the "
            "range of the numpy seed that utils.set_seed sets)")
    try:
        value = int(seed)
    except ValueError:
        raise UsageError(f"POPCORN_SEED = {seed!r}: {rule}") from None
    if not 0 <= value < POPCORN_SEED_LIMIT:
        raise UsageError(f"POPCORN_SEED = {seed!r}: {rule}")
    return value


def _popcorn_fd() -> int | None:
    """POPCORN_FD, checked: the number of an open file descriptor open for writing."""
    value = os.getenv("POPCORN_FD")
    if not value:
        return None
    rule = "expected the number of an open file descriptor to write the results to"
    try:
        fd = int(value)
        if fd < 0:
            raise ValueError(value)
    except ValueError:
        raise UsageError(f"POPCORN_FD = {value!r}: {rule}") from None
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except (OSError, OverflowError, ValueError):
        raise UsageError(f"POPCORN_FD = {value!r}: file descriptor {fd} is not open; "
                         f"{rule}") from None
    if flags & os.O_ACCMODE not in (os.O_WRONLY, os.O_RDWR):
        raise UsageError(f"POPCORN_FD = {value!r}: file descriptor {fd} is not open for "
                         f"writing; {rule}")
    return fd


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] == "compile":
            return run_compile(argv[1:])
        if argv and argv[0] == "selfcheck":
            import selfcheck  # every kernel this GPU's chain can pick, checked and timed

            return selfcheck.main(argv[1:])
        if argv and argv[0] == "gate":
            import gate  # the leaderboard bot's checks on a file

            return gate.main(argv[1:])
        return run(parse_args(argv))
    except KeyboardInterrupt:
        print("eval.py: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 130


def run(args: argparse.Namespace) -> int:
    """One mode, from the checked command line to the report; the exit status."""
    try:
        check_options(args)
        seed = _popcorn_seed()
        fd = _popcorn_fd()
        default_file = DEFAULT_TEST_FILE if args.mode == "test" else DEFAULT_BENCHMARK_FILE
        if args.file and not Path(args.file).is_file():  # a wrong path is a usage error, not a bad case file
            raise UsageError(f"eval.py {args.mode}: case file {args.file}: "
                             f"{'is a folder' if Path(args.file).is_dir() else 'no such file'}")
        tests = get_test_cases(args.file or str(default_file), seed)  # invalid: exit 113
        if args.mode in TIMING_MODES and not torch.cuda.is_available():
            raise UsageError(f"{args.mode} mode needs a CUDA GPU, and torch {torch.__version__} "
                             "sees none. `python eval.py test` runs on the CPU.")
        submission = choose_submission(args)
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    set_seed(seed or 42)
    if args.traceback:
        os.environ[TRACEBACK_SWITCH] = "1"

    logger = PopcornOutput(fd) if fd is not None else StdoutOutput()
    with logger, Worker(str(submission), args.case_timeout) as pool:
        try:
            # the process's start (spawn, torch's import) is not a case: no case timeout
            machine = pool.apply(_describe_machine, timeout=None)
        except (SubmissionLost, WorkerError) as error:
            # The process did not start; the first case reports how it ended
            machine = {"torch": torch.__version__, "dsl": _dsl_version(),
                       "device": f"unknown ({error})"}
        if args.mode == "test":
            status, results = run_testing(logger, pool, tests)
        elif args.mode == "profile":
            status, results = run_profiling(logger, pool, tests)
        else:
            runner = run_benchmarking if args.mode == "benchmark" else run_leaderboard
            status, results = runner(logger, pool, tests, args.hardened)

    shown = _display_path(submission)
    if args.mode == "test":
        report = build_test_report(str(submission), machine, tests, results)
        not_run = f", {report['not_run']} not run" if report["not_run"] else ""
        _announce(f"{report['passed']} of {len(tests)} test cases passed{not_run} ({shown})")
    elif args.mode == "profile":
        report = build_profile_report(str(submission), machine, tests, results)
    else:
        report = build_report(args.mode, str(submission), machine, tests[: len(results)],
                              results, args.hardened)
        print(format_report(report))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        _progress(f"results written to {args.json_path}")
    if args.plot_path:
        plot_report(report, args.plot_path)
        _progress(f"plot written to {args.plot_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
