"""Where a swap-AB call's device time goes on Hopper: the whole call against its kernels alone.

For each benchmark shape and sm_90 config (default: the automatic choice), the harness's
timing (15 inputs, L2 flushed, events around 15 back-to-back calls queued behind a sleep
kernel, so device time only) of:

    call      custom_kernel's launch (pre-pass, then the GEMM; a recorded graph)
    pre-pass  the activation pre-pass alone
    GEMM      the GEMM alone (reading the activations the last pre-pass left)
    floor     one trivial kernel per call (a 1-element fill): the launch floor

    python bench/breakdown.py [--repeats 10] [--shapes 2,3] [--configs "auto,swap_ab_one_round"]

Exit codes: 0 done; 2 cannot run as asked (no sm_90 GPU, a bad option), one line on stderr.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peers import (
    BENCHMARKS,
    OneLineArgumentParser,
    benchmark_inputs,
    bind_checked,
    positive_int,
    shape_list,
    time_calls,
)

from reference import ref_kernel


def config_table():
    from nvfp4_group_gemm import hopper

    labels = ["swap_ab_one_round", "swap_ab_t112", "swap_ab_t112_k128", "swap_ab_one_round_k128", "swap_ab_variable",
              "swap_ab_t128", "swap_ab_variable:chain_calls=False", "swap_ab_t112:chain_calls=False",
              "swap_ab_one_round:chain_calls=False"]
    # the automatic choice, then registry names and variants (hopper.config_name)
    return {"auto": None, **{label: hopper.config_named(label) for label in labels}}


def breakdown(repeats, shapes, names):
    import cuda.bindings.driver as cuda

    from nvfp4_group_gemm import hopper
    from nvfp4_group_gemm.launch import make_launcher

    configs = config_table()
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    columns = ("call", "pre-pass", "GEMM", "floor")
    print(f"{'shape':<34} {'config':<16} " + " ".join(f"{c:>9}" for c in columns))
    for index in shapes:
        m, n, k = BENCHMARKS[index]
        inputs = benchmark_inputs(m, n, k)
        expected = [c.clone() for c in ref_kernel(inputs[0])]
        shape = f"G={len(m)} M={min(m)}..{max(m)} N={n[0]} K={k[0]}"
        for name in names:
            backend = hopper.make_backend(configs[name])
            states, message = bind_checked(inputs, expected, backend, stream)
            if states is None:
                print(f"{shape:<34} {name:<16} WRONG: {message[:160]}")
                continue
            # (pre-pass, GEMM) launchers of every input set
            launches = []
            for state in states:
                pairs = backend.launch_args(state.plan, state, stream)
                launches.append([make_launcher(compiled, *args) for compiled, args in pairs])
            floor_target = torch.zeros(1, device="cuda")
            figures = [
                time_calls(lambda state: state.run(stream), states, repeats, device_only=True)[0],
                time_calls(lambda pair: pair[0](), launches, repeats, device_only=True)[0],
                time_calls(lambda pair: pair[1](), launches, repeats, device_only=True)[0],
                time_calls(lambda _, target=floor_target: target.fill_(1.0), states, repeats, device_only=True)[0],
            ]
            print(f"{shape:<34} {name:<16} " + " ".join(f"{f:9.2f}" for f in figures), flush=True)


def main(argv=None):
    parser = OneLineArgumentParser(prog="breakdown.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--shapes", type=shape_list, default=list(range(len(BENCHMARKS))), metavar="I,J")
    parser.add_argument("--configs", default="auto", metavar="NAMES",
                        help="comma-separated swap-AB configs, e.g. 'auto,swap_ab_one_round' (nvfp4_group_gemm.hopper.CONFIGS names, or a name:field=value variant)")
    args = parser.parse_args(argv)
    names = [x.strip() for x in args.configs.split(",") if x.strip()]
    unknown = [name for name in names if name not in config_table()]
    if not names or unknown:
        problem = f"unknown {unknown}" if unknown else "no config named"
        print(f"breakdown.py: --configs {args.configs!r}: {problem}; known: {list(config_table())}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("breakdown.py times the sm_90 swap-AB kernels and needs an H100/H200", file=sys.stderr)
        return 2
    breakdown(args.repeats, args.shapes, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
