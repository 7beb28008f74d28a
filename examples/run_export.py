"""Run every MoE layer of a ModelOpt NVFP4 export directory on random tokens, each checked
against its float64 decode (the experts dequantized exactly, the same routing), with the time
per layer.

    python examples/run_export.py PATH [--device cuda|cpu] [--activations bf16|nvfp4]
                                       [--tokens 64] [--repeats 10]

On a GPU the layer runs through the MoE entry (Hopper), timed with CUDA events (mean of
--repeats eager calls after a first one that compiles); on a CPU through the exact decode
(torch.ops.nvfp4_group_gemm.moe_grouped_gemm on CPU tensors), timed by the clock. Printed per
layer: its load time, the relative error (norm of the difference / norm of the float64 decode)
and the time of one call.

Exit codes: 0 every layer within its bound (W4A16: 1 %, bf16 roundings; W4A4: 40 %, the
activations' quantization); 1 a layer beyond it; 2 a bad option.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvfp4_group_gemm.export import open_export
from nvfp4_group_gemm.moe_layer import MoeFfn, float64_reference

BOUNDS = {"bf16": 0.01, "nvfp4": 0.40}


def time_call_us(layer: MoeFfn, x: torch.Tensor, repeats: int) -> float:
    """Mean µs of one eager call (after a first call: compiles, plans, binds)."""
    layer(x)
    if x.is_cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            layer(x)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / repeats
    begin = time.perf_counter()
    for _ in range(repeats):
        layer(x)
    return (time.perf_counter() - begin) * 1e6 / repeats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a ModelOpt NVFP4 export directory (config.json, model.safetensors, ...)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--activations", default="bf16", choices=tuple(BOUNDS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        print(f"run_export.py: --tokens = {args.tokens}, --repeats = {args.repeats}: both must be >= 1",
              file=sys.stderr)
        return 2
    export = open_export(args.path)
    print(f"{export.path}: {export.architecture}, MoE layers {export.moe_layers}, {export.num_experts} experts, "
          f"{export.routing}; {args.device}, activations {args.activations}, {args.tokens} tokens")
    print(f"{'layer':>5}{'load s':>8}{'rel. error':>12}{'µs / call':>11}")
    worst = 0.0
    generator = torch.Generator().manual_seed(0)
    for index in export.moe_layers:
        begin = time.perf_counter()
        layer = MoeFfn.from_pretrained(args.path, index, device=args.device, activations=args.activations)
        load_s = time.perf_counter() - begin
        x = torch.randn(args.tokens, layer.hidden, generator=generator).to(torch.bfloat16).to(args.device)
        reference = float64_reference(layer, x)
        error = float((layer(x).double() - reference).norm() / reference.norm())
        worst = max(worst, error)
        print(f"{index:>5}{load_s:>8.2f}{error:>12.4f}{time_call_us(layer, x, args.repeats):>11.1f}", flush=True)
    bound = BOUNDS[args.activations]
    print(f"largest relative error {worst:.4f} ({'within' if worst <= bound else 'BEYOND'} {bound:.0%})")
    return 0 if worst <= bound else 1


if __name__ == "__main__":
    raise SystemExit(main())
