"""One W4A16 MoE GEMM at a layer's small-batch shape, for a profiler: a Qwen3-30B-A3B-sized
gate-and-up (G 128, N 1536, K 2048) at 16 tokens routed top-8 (128 rows over the experts), called
three times (compile and self-check, then warm calls); under ncu, skip the first two.

    ncu --kernel-name regex:W4A16 --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python bench/moe_small_batch.py
    python bench/moe_small_batch.py --tokens 1 --n 2048 --k 768        # the down GEMM at one token
"""

from __future__ import annotations

import argparse

import torch

import nvfp4_group_gemm as gemm
from nvfp4_group_gemm import moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    rows = args.tokens * args.top_k
    inputs = moe.random_moe_inputs(rows, args.experts, args.n, args.k, sfa_layout=None,
                                   generator=torch.Generator().manual_seed(1))
    # each token's top-k distinct experts, as a router picks them
    experts = torch.stack([torch.randperm(args.experts, generator=torch.Generator().manual_seed(t))[:args.top_k]
                           for t in range(args.tokens)]).flatten()
    offsets = torch.zeros(args.experts + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.bincount(experts, minlength=args.experts), 0)
    inputs["offsets"].copy_(offsets)
    inputs["c"] = inputs["c"].bfloat16()
    alpha = torch.ones(args.experts, 2, device="cuda")
    for _ in range(args.calls):
        gemm.moe_grouped_gemm(**inputs, alpha=alpha)
    torch.cuda.synchronize()
    print(f"{args.calls} calls: T = {rows} rows over {int((offsets[1:] > offsets[:-1]).sum())} of {args.experts} "
          f"experts, N = {args.n}, K = {args.k}, W4A16")


if __name__ == "__main__":
    main()
