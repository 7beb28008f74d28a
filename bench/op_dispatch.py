"""Host µs of one call of the MoE entry's torch op schema, by how the op is registered, with a
kernel that does nothing (the dispatcher's cost alone; no GPU needed):

    direct      the Python function, called as it is
    custom_op   torch.library.custom_op(mutates_args=("c", "status")) with its fake
    library     torch.library.Library.define of the same schema, the function on the CPU key
                and a fake: how nvfp4_group_gemm.op registers its two ops

Each is called as MoeFfn calls the op (12 arguments: tensors, None, a string), `--calls` times
after a warm-up, best of `--repeats`.

    python bench/op_dispatch.py [--calls 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvfp4_group_gemm import op


def kernel(a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor, offsets: torch.Tensor,
           c: torch.Tensor, status: torch.Tensor, alpha: torch.Tensor | None = None,
           a_rows: torch.Tensor | None = None, c_rows: torch.Tensor | None = None,
           activation: str | None = None, b_layout: str | None = None) -> None:
    """Does nothing: what is timed is the way to it."""


def registered() -> dict:
    """The three ways to the kernel, by name (two ops in a namespace of this bench's own)."""
    custom = torch.library.custom_op("nvfp4_op_dispatch_bench::custom", mutates_args=("c", "status"))(kernel)
    custom.register_fake(lambda *args: None)
    library = torch.library.Library("nvfp4_op_dispatch_bench", "FRAGMENT")
    name = "library"
    library.define(name + op.MOE_GROUPED_GEMM_SCHEMA[op.MOE_GROUPED_GEMM_SCHEMA.index("("):])
    library.impl(name, kernel, "CPU")
    torch.library.register_fake(f"nvfp4_op_dispatch_bench::{name}", lambda *args, **kwargs: None, lib=library)
    return {"direct": kernel, "custom_op": custom, "library": torch.ops.nvfp4_op_dispatch_bench.library.default,
            "_keep": library}


def time_us(fn, args, calls: int, repeats: int) -> float:
    for _ in range(calls // 10):
        fn(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args(argv)
    ways = registered()
    tensors = [torch.zeros(4) for _ in range(9)]
    args = (tensors[0], None, *tensors[1:], "swiglu", None)
    print(f"torch {torch.__version__}: host µs a call (best of {options.repeats} x {options.calls})")
    for name in ("direct", "custom_op", "library"):
        print(f"{name:<10}{time_us(ways[name], args, options.calls, options.repeats):>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
