"""``python eval.py selfcheck``: what every kernel of this GPU's chain does, in one command.

On the GPU it finds, it runs the runtime of that architecture (sm_100: submission.py's, the
leaderboard file; sm_90: the library's, nvfp4_group_gemm) and every kernel its automatic
choice can pick (sm_100: the persistent kernel at 128 and 256 tokens per tile, the per-tile kernel, torch._scaled_mm;
sm_90: the automatic swap-AB choice, the in-GEMM-decode kernel, the exact decode), each
forced, and custom_kernel itself (the automatic choice, its self-check and fallback), on the
10 official tests, the 4 benchmarks and random group sets (all 16 fp4 codes, general e4m3
scales). Every output is checked against the exact sum (float64) at the competition's
tolerance; the benchmark shapes are timed with the leaderboard's method (L2 flushed, 15
input sets per timed loop, CUDA events), every sm_100 kernel twice: with its calls chained by
programmatic dependent launch (submission.SM100_CHAIN_CALLS, the default) and without, so that
the first report from a B200 says what chaining is worth. Each kernel runs in its own process (a fault, a
crash or a hang past --timeout costs that kernel alone and is reported with the case it was
running; --in-process runs them all here). It prints a progress line per kernel and case, one
table, and writes a JSON report to attach to a bug report. Exit 0: everything passed; 1: a kernel failed or disagreed; 2: no GPU, or bad
arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch

# the leaderboard file's code: nvfp4_group_gemm.core is what submission.py bundles, byte for byte
# (tests/test_library_layout.py), and the module the library's sm_100 backend shares
from nvfp4_group_gemm import core as submission

HERE = Path(__file__).resolve().parent
TIMED_INPUT_SETS = 15  # the leaderboard's loop: 15 input sets per timed repeat


def _fail_usage(message: str) -> int:
    print(f"eval.py selfcheck: {message}", file=sys.stderr)
    return 2


KERNEL_NAMES = ("persistent_t128", "persistent_t256", "per_tile", "scaled_mm",  # sm_100
                "swap_ab", "in_gemm_decode", "exact_decode",  # sm_90
                "custom_kernel",  # the automatic choice, with its self-check and fallback
                "moe",  # the MoE entry (sm_90; sm_100 with NVFP4_MOE_SM100=1): its chained-call pattern
                "moe_w4a16")  # the MoE entry with bf16 activations (sm_90): the same pattern


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


class UsageError(Exception):
    pass


def parse_args(argv):
    parser = _OneLineParser(prog="eval.py selfcheck", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--json", default="selfcheck.json", help="report path (default selfcheck.json)")
    parser.add_argument("--random", type=int, default=30, help="random group sets (default 30, at least 30 for a report)")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats per kernel and benchmark (default 20)")
    parser.add_argument("--kernels", default=None, help="comma-separated kernel names to run (default all)")
    parser.add_argument("--seed", type=int, default=2026,
                        help="seed of the random group sets (default 2026): the same seed, the same sets")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds each kernel may take in its own process before it counts as hung (default 900)")
    parser.add_argument("--in-process", action="store_true",
                        help="run every kernel in this process (a fault or a hang then stops the whole check)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one kernel, for the parent
    args = parser.parse_args(argv)
    if args.random < 0 or args.repeats < 1 or args.timeout <= 0:
        raise UsageError("--random must be >= 0, --repeats >= 1 and --timeout > 0")
    if args.kernels is not None:
        unknown = sorted(set(args.kernels.split(",")) - set(KERNEL_NAMES))
        if unknown:
            raise UsageError(f"--kernels: unknown {', '.join(unknown)}; allowed: {', '.join(KERNEL_NAMES)}")
    return args


def machine() -> dict:
    from importlib import metadata

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        dsl = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        dsl = None
    return {
        "device": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
        "torch": torch.__version__, "cuda": torch.version.cuda, "dsl": dsl, "python": platform.python_version(),
    }


def random_group_set(rng: random.Random, n_multiple: int, device="cuda"):
    """G 1..8, M 0..512, N a multiple of `n_multiple` up to 1024, K 256..2048; every fp4 byte;
    scales any finite e4m3 byte 0x00..0x46 (zero, subnormals, normals up to 3.5)."""
    from reference import create_reordered_scale_factor_tensor

    torch.manual_seed(rng.randrange(1 << 31))
    abc, sfs, sfs_reordered, sizes = [], [], [], []
    for _ in range(rng.randint(1, 8)):
        m = rng.choice([0, 1, rng.randint(1, 512), rng.randint(1, 512)])
        n = n_multiple * rng.randint(1, 1024 // n_multiple)
        k = 256 * rng.randint(1, 8)
        a = torch.randint(0, 256, (m, k // 2, 1), dtype=torch.uint8, device=device)
        b = torch.randint(0, 256, (n, k // 2, 1), dtype=torch.uint8, device=device)
        sfa = torch.randint(0, 0x47, (m, k // 16, 1), dtype=torch.uint8).view(torch.float8_e4m3fn)
        sfb = torch.randint(0, 0x47, (n, k // 16, 1), dtype=torch.uint8).view(torch.float8_e4m3fn)
        c = torch.full((m, n, 1), float("nan"), dtype=torch.float16, device=device)
        abc.append((a.view(torch.float4_e2m1fn_x2), b.view(torch.float4_e2m1fn_x2), c))
        sfs.append((sfa.to(device), sfb.to(device)))
        sfs_reordered.append((create_reordered_scale_factor_tensor(1, m, k, sfa, device=device),
                              create_reordered_scale_factor_tensor(1, n, k, sfb, device=device)))
        sizes.append((m, n, k, 1))
    if all(m == 0 for m, *_ in sizes):
        return random_group_set(rng, n_multiple, device)
    return abc, sfs, sfs_reordered, sizes


def cases(args, capability) -> list[tuple[str, str, object]]:
    """(kind, label, input set or its generator arguments) of every case."""
    # case_files, not eval.py: eval.py imports this module (one way)
    from case_files import read_test_cases

    found = []
    for kind, file in (("test", "tests.txt"), ("benchmark", "benchmarks.txt")):
        for index, case in enumerate(read_test_cases(str(HERE / "tests" / "cases" / file))):
            found.append((kind, f"{kind} {index}", case.args))
    rng = random.Random(args.seed)
    n_multiple = 128 if capability[0] == 9 else 8  # sm_90: N % 128 == 0; sm_100 takes any multiple of 8
    for index in range(args.random):
        found.append(("random", f"random {index}", random_group_set(rng, n_multiple)))
    return found


def runtime_module(capability):
    """The runtime selfcheck drives on a GPU of this compute capability: the leaderboard file's
    on sm_100 (10.x; nvfp4_group_gemm.core, which submission.py bundles, holds the B200 kernels), the library's
    (nvfp4_group_gemm.runtime, its Hopper kernels) on sm_90. Plain imports, so that the
    project's import graph (tests/test_imports.py) sees them."""
    if capability[0] == 10:
        return submission
    import nvfp4_group_gemm.runtime

    return nvfp4_group_gemm.runtime


def runtime_of(backend):
    """The module a backend belongs to: submission's sm100 backend, else the library's."""
    return runtime_module((10, 0) if backend.name == "sm100" else (9, 0))


def binding_of(runtime, data):
    """The binding `runtime`'s custom_kernel keeps for `data` (None: none)."""
    return runtime.binding_of(runtime.input_key(data))


def kernels_for(backend, sizes) -> list:
    """Every kernel the automatic choice can pick for these sizes, forced one by one."""
    if backend.name == "sm100":
        runtime = runtime_of(backend)
        names = ["per_tile", "scaled_mm"]
        if runtime.persistent_can_implement(sizes) is None:
            names = ["persistent_t128", "persistent_t256", *names]
        return [runtime.SM100_CHOICES[name] for name in names]
    return backend.kernel_chain(sizes)


def run_forced(backend, choice, data):
    """One launch of `choice` on `data` (no fallback, no self-check): (the c list, the launch
    to run again, None for a host computation). The leaderboard file's binding launches on the
    default stream; the library's directly on torch's current stream."""
    runtime = runtime_of(backend)
    sizes = runtime.validate_inputs(data)
    device = data[0][0][0].device
    plan = runtime.Plan(backend, sizes, device, choice, [choice])
    outputs = [c for _, _, c in data[0]]
    if choice.host:
        return submission.HOST_COMPUTATIONS[choice.name](data, outputs), None
    binding = runtime.Binding(plan, runtime.pointers_of(data))
    if runtime is submission:
        launch = binding.launch
    else:
        binding.mode = runtime.LaunchMode.DIRECT
        stream = runtime.current_stream()

        def launch():
            binding.run(stream)

    launch()
    return outputs, launch


def check(data, outputs) -> dict:
    from reference import exact_mismatches

    counts = exact_mismatches(data, outputs)
    mismatches = sum(c[0] for c in counts)
    first = next(((g, flat) for g, (n, _e, flat) in enumerate(counts) if n), None)
    return {"mismatches": mismatches, "elements": sum(c[1] for c in counts), "first": first}


def time_kernel(run_one, count: int, repeats: int) -> float:
    """Mean µs per call of run_one(0 .. count - 1): per repeat, the L2 flushed, then the
    input sets run back to back between two CUDA events (the leaderboard's method)."""
    from utils import clear_l2_cache_large

    for index in range(count):  # first runs: compile, bind, record the graph
        run_one(index)
        run_one(index)
    durations = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        clear_l2_cache_large()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for index in range(count):
            run_one(index)
        end.record()
        torch.cuda.synchronize()
        durations.append(start.elapsed_time(end) * 1000 / count)
    return sum(durations) / len(durations)


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as error:
        return _fail_usage(str(error))
    except SystemExit as exit_:  # --help
        return 2 if exit_.code else 0
    if not torch.cuda.is_available():
        return _fail_usage("needs a CUDA GPU (sm_100 B200 or sm_90 H100/H200); none is visible here")
    report_path = Path(args.json)
    try:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        with open(report_path, "a"):
            pass
    except OSError as error:
        return _fail_usage(f"--json {args.json}: cannot write there ({error.strerror or error})")

    capability = torch.cuda.get_device_capability()
    if capability[0] != 10 and capability != (9, 0):
        return _fail_usage(f"this GPU is sm_{capability[0]}{capability[1]}; the kernels run on sm_100 (submission.py) "
                           "and sm_90 (nvfp4_group_gemm)")
    if not (args.in_process or args.child):
        return run_isolated(args, capability, report_path)
    return run_in_process(args, capability, report_path)


def kernel_names(capability) -> list[str]:
    """The kernels selfcheck runs on this GPU, each in its own process by default."""
    from nvfp4_group_gemm import switches

    chain = KERNEL_NAMES[:4] if capability[0] == 10 else KERNEL_NAMES[4:7]
    moe = ["moe", "moe_w4a16"] if capability[0] == 9 else ["moe"] if switches.CURRENT.moe_sm100 else []
    return [*chain, "custom_kernel", *moe]


def child_command(args, name: str, child_json: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", "--kernels", name, "--json", str(child_json),
            "--random", str(args.random), "--repeats", str(args.repeats), "--seed", str(args.seed)]


def run_isolated(args, capability, report_path: Path) -> int:
    """Each kernel in its own process, one after another, its progress lines passed through:
    a fault that poisons one process's context, a crash or a hang (past --timeout) costs that
    kernel alone, and the report says which case it was running."""
    import queue
    import subprocess
    import tempfile
    import threading

    wanted = kernel_names(capability) if args.kernels is None else [
        name for name in kernel_names(capability) if name in args.kernels.split(",")]
    info = machine()
    print(f"selfcheck on {info['device']} (sm_{capability[0]}{capability[1]}, {info['sms']} SMs), torch {info['torch']}, "
          f"DSL {info['dsl']}; each kernel in its own process", flush=True)
    rows, timings, demoted = [], [], {}
    with tempfile.TemporaryDirectory() as folder:
        for name in wanted:
            child_json = Path(folder) / f"{name}.json"
            process = subprocess.Popen(child_command(args, name, child_json), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
            lines: queue.Queue = queue.Queue()

            def pump(stream=process.stdout, lines=lines):
                for line in stream:
                    lines.put(line.rstrip("\n"))
                lines.put(None)

            threading.Thread(target=pump, daemon=True).start()
            last, status, deadline = "", None, time.monotonic() + args.timeout
            while True:
                try:
                    line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
                except queue.Empty:
                    process.kill()
                    status = "HANG"
                    break
                if line is None:
                    break
                print(line, flush=True)
                last = line
            process.wait()
            if status is None and process.returncode not in (0, 1):
                status = "CRASH"
            if status is None and child_json.is_file():
                child = json.loads(child_json.read_text())
                rows += child["rows"]
                timings += child["timings"]
                demoted.update(child["demoted"])
                continue
            case = last.split("...")[0].strip() if last.rstrip().endswith("...") else last.strip()
            why = (f"not done after {args.timeout:g} s (killed); last line: {case!r}" if status == "HANG"
                   else f"the process ended with code {process.returncode}; last line: {last.strip()!r}")
            print(f"  {name:<16} {status or 'CRASH'}: {why}", flush=True)
            rows.append({"case": case, "kind": "process", "kernel": name, "status": status or "CRASH", "error": why})
    return _finish(rows, timings, demoted, info, report_path, self_check=None)


def _finish(rows, timings, demoted, info, report_path: Path, self_check, quiet: bool = False) -> int:
    report = {"machine": info, "rows": rows, "timings": timings, "demoted": demoted, "self_check": self_check}
    report_path.write_text(json.dumps(report, indent=1, default=str))
    failed = [row for row in rows if row["status"] != "pass"]
    if not quiet:
        print(format_table(rows, timings))
        if demoted:
            print("custom_kernel demoted: " + "; ".join(demoted.values()))
        print(f"{len(rows) - len(failed)} passed, {len(failed)} failed; report: {report_path} "
              "(attach it to a bug report, with the output above)")
    return 1 if failed else 0


def run_in_process(args, capability, report_path: Path) -> int:
    """Every wanted kernel in this process (what each child of run_isolated runs), with the
    runtime of this GPU's architecture (runtime_module)."""
    from reference import generate_input

    runtime = runtime_module(capability)
    backend = runtime.select_backend(torch.cuda.current_device())
    wanted = None if args.kernels is None else set(args.kernels.split(","))
    info = machine()
    if not args.child:
        print(f"selfcheck on {info['device']} (sm_{capability[0]}{capability[1]}, {info['sms']} SMs), "
              f"torch {info['torch']}, DSL {info['dsl']}, backend {backend.name}", flush=True)

    rows, timings = [], []
    for kind, label, source in cases(args, capability):
        data = generate_input(**source) if isinstance(source, dict) else source
        sizes = [tuple(s) for s in data[3]]
        for choice in [*kernels_for(backend, sizes), None]:
            name = "custom_kernel" if choice is None else choice.name
            if wanted is not None and name not in wanted:
                continue
            # before the run: the last line names the kernel and case that hang (overwritten by
            # the result on a terminal)
            print(f"  {label:<12} {name:<16} ...", end="\r" if sys.stdout.isatty() else "\n", flush=True)
            row = {"case": label, "kind": kind, "kernel": name, "sizes": sizes}
            if choice is not None and choice.config is not None:
                row["config"] = str(choice.config)
            stderr = io.StringIO()
            try:
                for _, _, c in data[0]:
                    c.fill_(float("nan"))
                with contextlib.redirect_stderr(stderr):
                    if choice is None:
                        outputs = runtime.custom_kernel(data)
                        binding = binding_of(runtime, data)
                        row["ran"] = binding.plan.choice.name if binding is not None else None
                    else:
                        outputs, _ = run_forced(backend, choice, data)
                    torch.cuda.synchronize()
                row.update(check(data, outputs))
                row["status"] = "pass" if row["mismatches"] == 0 else "MISMATCH"
            except Exception as error:  # noqa: BLE001 - every failure is a row of the report
                row.update(status="ERROR", error=one_line(error))
            if stderr.getvalue():
                row["stderr"] = stderr.getvalue().splitlines()
            rows.append(row)
            detail = row.get("error") or (f"{row['mismatches']} of {row['elements']} differ, first {row['first']}"
                                          if row["status"] == "MISMATCH" else row.get("ran", ""))
            print(f"  {label:<12} {name:<16} {row['status']:<8} {detail}", flush=True)
            if kind == "benchmark" and row["status"] == "pass":
                for chain in chain_settings(backend, choice):
                    timings.append(_time_row(backend, choice, source, label, name, args.repeats, generate_input,
                                             chain))

    rows += pattern_rows(backend, capability, wanted)
    demoted = {str(key): why for key, why in submission.demotions().items()}
    return _finish(rows, timings, demoted, info, report_path, submission.SELF_CHECK, quiet=args.child)


def pattern_rows(backend, capability, wanted) -> list[dict]:
    """The chained-call patterns of every wanted kernel (chained and unchained where it
    chains), then the MoE entry's."""
    rows = []
    sizes = [tuple(s) for s in zip(*(PATTERN_SIZES[0][1][axis] for axis in "mnk"), [1] * PATTERN_SIZES[0][1]["g"])]
    for choice in [*kernels_for(backend, sizes), None]:
        name = "custom_kernel" if choice is None else choice.name
        if (wanted is not None and name not in wanted) or (choice is not None and choice.host):
            continue
        for chain in chain_settings(backend, choice):
            rows += chained_pattern_rows(backend, choice, name, chain)
    if "moe" in kernel_names(capability) and (wanted is None or "moe" in wanted):
        for chain in ((True, False) if capability[0] == 10 else (None,)):
            rows += moe_pattern_rows(chain)
    if "moe_w4a16" in kernel_names(capability) and (wanted is None or "moe_w4a16" in wanted):
        rows += moe_pattern_rows(None, w4a16=True)
    return rows


def chain_settings(backend, choice) -> tuple:
    """How a timed kernel's calls are launched: an sm_100 kernel of the leaderboard file
    chained (when SM100_CHAIN_CALLS is on) and then unchained; anything else as it is (None)."""
    if backend.name != "sm100" or choice is None or choice.host:
        return (None,)
    return (True, False) if submission.SM100_CHAIN_CALLS else (False,)


@contextlib.contextmanager
def chained_calls(chain):
    """submission.SM100_CHAIN_CALLS set to `chain` while the launches of one timing are built
    (their compile keys carry it: chained and plain builds are kept apart); None: unchanged."""
    if chain is None:
        yield
        return
    saved = submission.SM100_CHAIN_CALLS
    submission.SM100_CHAIN_CALLS = chain
    try:
        yield
    finally:
        submission.SM100_CHAIN_CALLS = saved


def _time_row(backend, choice, source, label, name, repeats, generate_input, chain=None) -> dict:
    runtime = runtime_of(backend)
    row = {"case": label, "kernel": name}
    if chain is not None:
        row["chained"] = chain
    try:
        inputs = []
        for index in range(TIMED_INPUT_SETS):
            args = dict(source)
            args["seed"] = args.get("seed", 0) + 42 * (index + 1)
            inputs.append(generate_input(**args))
        launches = [None] * len(inputs)

        def run_one(index):
            data = inputs[index]
            if choice is None:
                runtime.custom_kernel(data)
            elif choice.host:
                submission.HOST_COMPUTATIONS[choice.name](data, [c for _, _, c in data[0]])
            elif launches[index] is None:
                _, launches[index] = run_forced(backend, choice, data)
            else:
                launches[index]()

        with chained_calls(chain):  # the launches are built in the first runs
            row["us"] = round(time_kernel(run_one, len(inputs), repeats), 2)
    except Exception as error:  # noqa: BLE001
        row["error"] = one_line(error)
    how = "" if chain is None else " chained" if chain else " unchained"
    print(f"  {label:<12} {name:<16} {row.get('us', row.get('error'))} us{how}", flush=True)
    return row


# =============================================================================
# Chained calls, output by output
# =============================================================================
# Two size sets every kernel can run (sm_90 needs N % 128 == 0): official test 1 and benchmark 3
PATTERN_SIZES = (("test 1", {"m": (256, 72), "n": (512, 384), "k": (256, 256), "g": 2, "seed": 1111}),
                 ("benchmark 3", {"m": (128, 384), "n": (4096, 4096), "k": (1536, 1536), "g": 2, "seed": 1111}))
PATTERN_CALLS = 4


def synchronize() -> None:
    """The device's work done (the patterns' only synchronization; the CPU tests replace it)."""
    torch.cuda.synchronize()
# A MoE shape of the 32-token decode tiles' range and its routings, called one after another on
# one plan (each call its own offsets, c and status): valid, empty groups, invalid between valid
MOE_PATTERN_SHAPE = (256, 8, 512, 1024)
MOE_ROUTINGS = (
    ("valid", [0, 20, 64, 64, 100, 180, 200, 250, 256]),
    ("empty groups", [0, 0, 0, 90, 90, 90, 200, 200, 200]),
    ("decreasing", [0, 40, 30, 100, 120, 140, 160, 180, 200]),
    ("valid", [0, 1, 2, 3, 4, 5, 6, 7, 256]),
    ("past T", [0, 40, 80, 120, 160, 200, 240, 250, 300]),
    ("one group", [0, 0, 0, 0, 256, 256, 256, 256, 256]),
)


def _with_c(data, outputs):
    """`data` writing into `outputs` (one c per group) instead of its own c tensors."""
    abc = [(a, b, c) for (a, b, _), c in zip(data[0], outputs)]
    return abc, data[1], data[2], data[3]


def _call_patterns(source: dict):
    """The two patterns of a size set: (name, the input set of each call). "same c": every
    call new inputs into one c (bindings made first, then the GEMMs back to back); "alternating":
    new inputs alternating between two c's, each call bound anew (its tables and descriptors
    written between the GEMMs)."""
    from reference import generate_input

    sets = [generate_input(**dict(source, seed=source["seed"] + 17 * index)) for index in range(PATTERN_CALLS)]
    one_c = [c for _, _, c in sets[0][0]]
    two_c = [one_c, [c for _, _, c in sets[1][0]]]
    return (("same c", [_with_c(data, one_c) for data in sets]),
            ("alternating", [_with_c(data, two_c[index % 2]) for index, data in enumerate(sets)]))


def _runner(backend, choice, pattern: str):
    """How each call of a pattern runs: custom_kernel itself (choice None); a forced kernel's
    launch built before the timed calls ("same c") or bound at the call ("alternating")."""
    runtime = runtime_of(backend)
    built = {}

    def prepare(index, data):
        if choice is not None and pattern == "same c":
            _, built[index] = run_forced(backend, choice, data)

    def run(index, data):
        if choice is None:
            runtime.custom_kernel(data)
        elif index in built:
            built[index]()
        else:
            run_forced(backend, choice, data)

    return prepare, run


def chained_pattern_rows(backend, choice, name: str, chain) -> list[dict]:
    """Every pattern of PATTERN_SIZES for one kernel (`choice`, None: custom_kernel), its
    calls launched back to back: for each prefix of the calls, c filled with NaN, the prefix
    run with no synchronization between its calls, then the output of every c checked against
    the exact sum of the call that wrote it last. A wrong output names the kernel, the
    pattern, the call and whether the calls chained."""
    rows = []
    for label, source in PATTERN_SIZES:
        for pattern, calls in _call_patterns(source):
            prepare, run = _runner(backend, choice, pattern)
            row = {"case": f"{label} {pattern}", "kind": "pattern", "kernel": name, "calls": len(calls)}
            if chain is not None:
                row["chained"] = chain
            try:
                with chained_calls(chain):
                    for index, data in enumerate(calls):
                        prepare(index, data)
                    failures = []
                    for length in range(1, len(calls) + 1):
                        for data in calls:
                            for _, _, c in data[0]:
                                c.fill_(float("nan"))
                        synchronize()
                        for index in range(length):
                            run(index, calls[index])
                        synchronize()
                        last_writer = {id(data[0][0][2]): index for index, data in enumerate(calls[:length])}
                        for index in sorted(last_writer.values()):
                            result = check(calls[index], [c for _, _, c in calls[index][0]])
                            if result["mismatches"]:
                                failures.append(f"call {index + 1} of {length}: {result['mismatches']} of "
                                                f"{result['elements']} differ, first {result['first']}")
                row.update(status="MISMATCH" if failures else "pass", failures=failures)
            except Exception as error:  # noqa: BLE001 - every failure is a row of the report
                row.update(status="ERROR", error=one_line(error))
            rows.append(row)
            print(_pattern_line(row), flush=True)
    return rows


def _pattern_line(row) -> str:
    how = "" if "chained" not in row else " chained" if row["chained"] else " unchained"
    detail = row.get("error") or "; ".join(row.get("failures", [])[:3]) or f"{row['calls']} calls, every output exact"
    return f"  {row['case']:<24} {row['kernel'] + how:<28} {row['status']:<8} {detail}"


def moe_pattern_rows(chain, w4a16: bool = False, device: str = "cuda") -> list[dict]:
    """The MoE entry's calls back to back on one plan (MOE_ROUTINGS: each call its own offsets,
    c and status; empty groups and invalid offsets between valid ones), then each checked: a
    valid call's rows against the exact sum, every other row still NaN, status 0; an invalid
    call's c untouched and status 1. sm_100 (NVFP4_MOE_SM100=1) chained and unchained; `w4a16`:
    bf16 activations (sm_90). `device`: where the tensors live (the tests run the checker on a
    CPU with the entry replaced)."""
    import nvfp4_group_gemm
    from nvfp4_group_gemm import moe

    tokens, groups, n, k = MOE_PATTERN_SHAPE
    row = {"case": "moe routings" + (" (W4A16)" if w4a16 else ""), "kind": "pattern",
           "kernel": "moe_w4a16" if w4a16 else "moe", "calls": len(MOE_ROUTINGS)}
    if chain is not None:
        row["chained"] = chain
    try:
        with chained_calls(chain):
            nvfp4_group_gemm.reset_runtime()  # plans built under this chaining
            inputs = moe.random_moe_inputs(tokens, groups, n, k, sfa_layout=None if w4a16 else "plain",
                                           device=device, generator=torch.Generator().manual_seed(5))
            calls = []
            for _, offsets in MOE_ROUTINGS:
                calls.append(dict(inputs, offsets=torch.tensor(offsets, dtype=torch.int32, device=device),
                                  c=torch.full((tokens, n), float("nan"), dtype=torch.float16, device=device)))
            statuses = [torch.full((1,), 7, dtype=torch.int32, device=device) for _ in calls]
            nvfp4_group_gemm.moe_grouped_gemm(**calls[0], status=statuses[0])  # compiled, self-checked
            synchronize()
            for call in calls:
                call["c"].fill_(float("nan"))
            synchronize()
            for call, status in zip(calls, statuses):
                nvfp4_group_gemm.moe_grouped_gemm(**call, status=status)
            synchronize()
        failures = []
        for index, ((what, offsets), call, status) in enumerate(zip(MOE_ROUTINGS, calls, statuses)):
            valid = moe.offsets_error(offsets, tokens) is None
            if int(status.item()) != (0 if valid else 1):
                failures.append(f"call {index + 1} ({what}): status {int(status.item())}")
            if not valid:
                if not torch.isnan(call["c"]).all():
                    failures.append(f"call {index + 1} ({what}): c written with invalid offsets")
                continue
            bad = moe.compare_with_exact(*(call[name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")))[0]
            outside = torch.ones(tokens, dtype=torch.bool, device=device)
            outside[offsets[0]:offsets[-1]] = False
            if bad or not torch.isnan(call["c"][outside]).all():
                failures.append(f"call {index + 1} ({what}): {bad} outputs differ"
                                + ("" if torch.isnan(call["c"][outside]).all() else ", rows outside the groups written"))
        row.update(status="MISMATCH" if failures else "pass", failures=failures)
    except Exception as error:  # noqa: BLE001
        row.update(status="ERROR", error=one_line(error))
    print(_pattern_line(row), flush=True)
    return [row]


def format_table(rows, timings) -> str:
    """One line per kernel: cases passed / run, and its µs on each benchmark shape (an sm_100
    kernel's chained calls where it was timed both ways); then, for such a kernel, its
    unchained µs and what chaining saved per call."""
    kernels = list(dict.fromkeys(row["kernel"] for row in rows))
    benchmarks = sorted({t["case"] for t in timings}, key=lambda c: int(c.split()[-1]))
    head = f"{'kernel':<16} {'passed':>9}  " + "  ".join(f"{b:>12}" for b in benchmarks) + "  geomean"
    lines = [head, "-" * len(head)]

    def figures(us: dict) -> str:
        cells = [f"{us[b]:>12.2f}" if us.get(b) is not None else f"{'-':>12}" for b in benchmarks]
        values = [us[b] for b in benchmarks if us.get(b)]
        geomean = (math.exp(sum(map(math.log, values)) / len(values))
                   if len(values) == len(benchmarks) and values and min(values) > 0 else None)
        return "  ".join(cells) + (f"  {geomean:7.2f}" if geomean else "        -")

    for kernel in kernels:
        mine = [row for row in rows if row["kernel"] == kernel]
        passed = sum(row["status"] == "pass" for row in mine)
        us = {t["case"]: t.get("us") for t in timings if t["kernel"] == kernel and t.get("chained", True)}
        lines.append(f"{kernel:<16} {passed:>4} / {len(mine):<3} " + figures(us))
        plain = {t["case"]: t.get("us") for t in timings if t["kernel"] == kernel and t.get("chained") is False}
        if plain:
            lines.append(f"{'  unchained':<16} {'':>9}  " + figures(plain))
            saved = [f"{plain[b] - us[b]:>12.2f}" if plain.get(b) is not None and us.get(b) is not None
                     else f"{'-':>12}" for b in benchmarks]
            lines.append(f"{'  chaining saves':<16} {'':>9}  " + "  ".join(saved))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
