"""Side-by-side timing on Hopper: this submission vs per-group cuBLAS bf16 on pre-dequantized
weights (the obvious alternative a Hopper user has; dequantization is not timed).

The alternative does what custom_kernel must do: per group, a bf16 matmul of the operands
dequantized ahead of time, and the result written into that group's fp16 ``c``:

    c[:, :, 0].copy_(torch.mm(a_bf16, b_bf16.t()))

which is what a user writes when cuBLAS has no fp16-output bf16 GEMM behind ``torch.mm``
(``out=`` must have the inputs' dtype): one GEMM into a fresh bf16 tensor, then one
conversion kernel into ``c``. bf16 holds every e2m1 x e4m3 product exactly (6 significant
bits at most), so the operands carry no error; only the bf16 result rounding differs.

Method (the harness's): 15 inputs per shape (seed + 42 each); per repeat an L2 flush, then one
CUDA event pair around 15 back-to-back calls over the 15 inputs; time = elapsed / 15. Prints
mean and best µs of each, their ratio, TFLOP/s on the real (unpadded) work, and the fraction
of the bf16 dense roofline (790 TFLOP/s, measured on the H200).

    python bench/peers.py [--repeats 30] [--json PATH] [--plot PATH]
    python bench/peers.py --configs ["swap_ab_t128,auto"]        # sm_90 configs, device time
    python bench/peers.py --shapes 2,3 ...                    # a subset of the four shapes

--json writes the rows, --plot a PNG (needs matplotlib: pip install -e '.[plot]'): per shape,
ours beside cuBLAS and the bf16 roofline time. Progress goes to stderr, one line per shape.
Exit codes: 0 done; 2 cannot run as asked (no CUDA GPU the submission supports, --configs
off sm_90, matplotlib missing for --plot, a bad option), as one line on stderr.
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference import decode_scaled, generate_input
from utils import clear_l2_cache_large

BF16_ROOFLINE_TFLOPS = 790.0
NUM_INPUTS = 15
BENCHMARKS = [
    ((80, 176, 128, 72, 64, 248, 96, 160), (4096,) * 8, (7168,) * 8),
    ((40, 76, 168, 72, 164, 148, 196, 160), (7168,) * 8, (2048,) * 8),
    ((192, 320), (3072, 3072), (4096, 4096)),
    ((128, 384), (4096, 4096), (1536, 1536)),
]


def flush_l2() -> None:
    """The harness's L2 flush (utils.clear_l2_cache_large: randn over 62.5 GiB) where the GPU has
    room for it beside the benchmark's tensors; else randn over a quarter of the free memory (an
    80 GB H100 has no room for the harness's): any size far above L2 flushes it."""
    try:
        clear_l2_cache_large()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        free_bytes, _ = torch.cuda.mem_get_info()
        dummy = torch.empty(free_bytes // 16, dtype=torch.float32, device="cuda").normal_()
        del dummy


def time_calls(fn, inputs, repeats, device_only=False):
    """Harness method: flush L2, events around len(inputs) back-to-back calls, divide.

    device_only: a sleep kernel queued first lets the host enqueue every call before the
    start event fires, so the events bracket device time only (no host overhead)."""
    for data in inputs:  # warm-up: compile, caches
        fn(data)
    torch.cuda.synchronize()
    durations_us = []
    for _ in range(repeats):
        flush_l2()
        if device_only:
            torch.cuda._sleep(20_000_000)  # ~10 ms: far longer than enqueueing 15 calls
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for data in inputs:
            fn(data)
        end.record()
        torch.cuda.synchronize()
        durations_us.append(start.elapsed_time(end) * 1e3 / len(inputs))
    return statistics.mean(durations_us), min(durations_us)


def benchmark_inputs(m, n, k):
    """The harness's NUM_INPUTS input sets of one benchmark shape (seed 1111 + 42 each)."""
    inputs, seed = [], 1111
    for _ in range(NUM_INPUTS):
        seed += 42
        inputs.append(generate_input(m, n, k, len(m), seed))
    return inputs


def bind_checked(inputs, expected, backend, stream):
    """Every input set bound to `backend`; the first launched once (outputs reset to NaN
    first) and checked against `expected`. (the bindings, None) or (None, the mismatch)."""
    from nvfp4_group_gemm import bind_input_set
    from reference import match_outputs

    states = [bind_input_set(data, backend) for data in inputs]
    for _, _, c in inputs[0][0]:
        c.fill_(float("nan"))
    states[0].run(stream)
    torch.cuda.synchronize()
    ok, message = match_outputs(expected, [c for _, _, c in inputs[0][0]])
    return (states, None) if ok else (None, message)


def compare_configs(repeats, names=None, shapes=None):
    """Device time of the sm_90 kernel configurations the default backend chooses from, and
    of its choice ("auto"), on the benchmark shapes (each checked first); `names`: a subset
    of the columns; `shapes`: indices into BENCHMARKS (default all). Options measured and
    removed: docs/EXPERIMENTS.md."""
    import cuda.bindings.driver as cuda

    from nvfp4_group_gemm import hopper
    from reference import ref_kernel

    # column -> (config, kernel): a config runs as given; None runs the automatic choice of
    # `kernel` (None: the default backend's kernel, what custom_kernel runs)
    # every registered config, a few variants (named by hopper.config_name), and the two
    # automatic choices
    variants = [
        "swap_ab_t192:tile_tokens=256", "swap_ab_t128:weight_stages=3", "swap_ab_variable:weight_stages=3",
        "swap_ab_variable:weight_stages=8", "swap_ab_one_round:chain_calls=False",
        "swap_ab_variable:chain_calls=False", "swap_ab_t112:chain_calls=False",
    ]
    configs = {name: (config, None) for name, config in hopper.CONFIGS.items()}
    configs.update({label: (hopper.config_named(label), None) for label in variants})
    configs["in_gemm_decode auto"] = (None, "in_gemm_decode")
    configs["auto"] = (None, None)
    if names:
        unknown = set(names) - set(configs)
        if unknown:
            print(f"unknown config(s) {sorted(unknown)}; known: {list(configs)}", file=sys.stderr)
            raise SystemExit(2)
        configs = {name: configs[name] for name in names}
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    print(f"{'shape':<34} " + " ".join(f"{name:>13}" for name in configs))
    for m, n, k in (BENCHMARKS[i] for i in (range(len(BENCHMARKS)) if shapes is None else shapes)):
        inputs = benchmark_inputs(m, n, k)
        expected = [c.clone() for c in ref_kernel(inputs[0])]
        cells = []
        for config, kernel in configs.values():
            states, message = bind_checked(inputs, expected, hopper.make_backend(config, kernel), stream)
            if states is None:
                cells.append("WRONG")
                print(f"  {config}: {message[:200]}")
                continue
            mean, _best = time_calls(
                lambda state: state.run(stream), states, repeats, device_only=True
            )
            cells.append(f"{mean:.1f}")
        shape = f"G={len(m)} M={min(m)}..{max(m)} N={n[0]} K={k[0]}"
        print(f"{shape:<34} " + " ".join(f"{cell:>13}" for cell in cells))


def dequantized_inputs(data):
    """Per group: bf16 A [M, K], bf16 B [N, K] (dequantized here, untimed) and the group's
    fp16 output c [M, N, 1] from the same input set."""
    groups = []
    for (a, b, c), (sfa, sfb) in zip(data[0], data[1]):
        a_bf16 = decode_scaled(a[:, :, 0], sfa[:, :, 0]).to(torch.bfloat16)
        b_bf16 = decode_scaled(b[:, :, 0], sfb[:, :, 0]).to(torch.bfloat16)
        groups.append((a_bf16, b_bf16, c))
    return groups


def cublas_bf16(groups):
    """The alternative, timed: per group a bf16 GEMM, its result converted into c (fp16)."""
    for a_bf16, b_bf16, c in groups:
        c[:, :, 0].copy_(torch.mm(a_bf16, b_bf16.t()))
    return [c for _, _, c in groups]


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse failing as eval.py does: one line on stderr, exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


positive_int.__name__ = "positive integer"  # argparse names the type in its message


def shape_list(text: str) -> list[int]:
    """Comma-separated benchmark shape indices (0..3), each once, in the order given."""
    indices = [int(part) for part in text.split(",")]
    if not indices or len(set(indices)) != len(indices) or not all(0 <= i < len(BENCHMARKS) for i in indices):
        raise ValueError(text)
    return indices


shape_list.__name__ = f"shape list (distinct indices 0..{len(BENCHMARKS) - 1}, e.g. 2,3)"


def check_machine(configs: bool) -> str | None:
    """None when this machine can run the comparison, else why not (one line)."""
    if not torch.cuda.is_available():
        return f"peers.py needs a CUDA GPU, and torch {torch.__version__} sees none"
    major, minor = torch.cuda.get_device_capability()
    gpu = f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})"
    if configs and (major, minor) != (9, 0):
        return f"--configs compares sm_90 kernel configurations; this GPU is {gpu}"
    if not (major == 10 or (major, minor) == (9, 0)):
        return f"peers.py times the nvfp4_group_gemm library, which needs a B200 or an H100/H200; this GPU is {gpu}"
    return None


def check_output(option: str, value: str | None) -> str | None:
    if value is not None and not Path(value).resolve().parent.is_dir():
        return f"{option} {value}: the folder {Path(value).resolve().parent} does not exist"
    return None


def plot_rows(rows, path, device: str) -> None:
    """Per shape: ours and cuBLAS (mean µs per call) beside the bf16 roofline time."""
    from eval import write_plot

    shapes = []
    for row in rows:
        label = f"{row['shape']}".replace(" N=", "\nN=")
        label += f"\nours / cuBLAS {row['ours_us'] / row['cublas_us']:.2f}"
        shapes.append((label, {
            "ours (nvfp4_group_gemm)": row["ours_us"],
            "cuBLAS bf16, pre-dequantized": row["cublas_us"],
            f"bf16 roofline ({BF16_ROOFLINE_TFLOPS:.0f} TFLOP/s)": row["roofline_us"],
        }))
    write_plot(path, f"peers on {device}: µs per call, the leaderboard's timing", shapes)


def main(argv=None):
    parser = OneLineArgumentParser(prog="peers.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=30)
    parser.add_argument("--configs", nargs="?", const="", default=None, metavar="NAMES",
                        help="compare sm_90 kernel configurations (device time only); "
                        "optional comma-separated subset, e.g. 'swap_ab_t128,auto' (nvfp4_group_gemm.hopper.CONFIGS names)")
    parser.add_argument("--shapes", type=shape_list, default=list(range(len(BENCHMARKS))), metavar="I,J",
                        help="benchmark shapes to run, by index (default: all four)")
    parser.add_argument("--json", dest="json_path", help="write the rows here")
    parser.add_argument("--plot", dest="plot_path",
                        help="draw the rows into this PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    problem = check_output("--json", args.json_path) or check_output("--plot", args.plot_path)
    if problem is None and args.configs is not None and (args.json_path or args.plot_path):
        problem = "--json and --plot apply to the comparison with cuBLAS, not to --configs"
    if problem is None and args.plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            problem = ("--plot needs matplotlib, which is not installed: "
                       "pip install -e '.[plot]' (or pip install matplotlib)")
    problem = problem or check_machine(args.configs is not None)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.configs is not None:
        compare_configs(args.repeats, [x.strip() for x in args.configs.split(",") if x.strip()], args.shapes)
        return 0

    from nvfp4_group_gemm import custom_kernel

    name = torch.cuda.get_device_name()
    print(f"device: {name}  torch {torch.__version__}")
    rows = []
    for index in args.shapes:
        m, n, k = BENCHMARKS[index]
        g = len(m)
        inputs = benchmark_inputs(m, n, k)
        ours_mean, ours_best = time_calls(custom_kernel, inputs, args.repeats)
        ours_device, _ = time_calls(custom_kernel, inputs, args.repeats, device_only=True)
        dequant = [dequantized_inputs(data) for data in inputs]
        del inputs
        torch.cuda.synchronize()
        cublas_mean, cublas_best = time_calls(cublas_bf16, dequant, args.repeats)
        cublas_device, _ = time_calls(cublas_bf16, dequant, args.repeats, device_only=True)
        del dequant
        flops = sum(2 * mi * ni * ki for mi, ni, ki in zip(m, n, k))
        shape = f"G={g} M={min(m)}..{max(m)} N={n[0]} K={k[0]}"
        rows.append({
            "shape": shape, "m": m, "n": n, "k": k, "g": g, "flops": flops,
            "ours_us": ours_mean, "ours_best_us": ours_best, "ours_device_us": ours_device,
            "cublas_us": cublas_mean, "cublas_best_us": cublas_best,
            "cublas_device_us": cublas_device,
            "roofline_us": flops / (BF16_ROOFLINE_TFLOPS * 1e12) * 1e6,
        })
        print(f"peers: shape {index + 1} of {len(BENCHMARKS)} ({shape}): ours {ours_mean:.1f} µs, "
              f"cuBLAS {cublas_mean:.1f} µs", file=sys.stderr, flush=True)

    header = (
        f"{'shape':<34} {'ours µs':>9} {'best':>8} {'cuBLAS µs':>10} {'best':>8} "
        f"{'ours/cuBLAS':>11} {'TFLOP/s':>8} {'%bf16 roof':>10} {'dev: ours':>9} {'cuBLAS':>7}"
    )
    print(header)
    ratios = []
    for row in rows:
        om, cm = row["ours_us"], row["cublas_us"]
        tflops = row["flops"] / (om * 1e-6) / 1e12
        ratios.append(om / cm)
        print(
            f"{row['shape']:<34} {om:9.1f} {row['ours_best_us']:8.1f} {cm:10.1f} "
            f"{row['cublas_best_us']:8.1f} {om / cm:11.2f} {tflops:8.1f} "
            f"{100 * tflops / BF16_ROOFLINE_TFLOPS:9.1f}% {row['ours_device_us']:9.1f} "
            f"{row['cublas_device_us']:7.1f}"
        )
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"geomean ours/cuBLAS: {geomean:.2f}  (< 1: ours faster)")
    if args.json_path:
        report = {"device": name, "torch": torch.__version__, "repeats": args.repeats,
                  "rows": rows, "geomean_ours_over_cublas": geomean}
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json_path}", file=sys.stderr)
    if args.plot_path:
        plot_rows(rows, args.plot_path, name)
        print(f"plot written to {args.plot_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
