"""Device time of a whole MoE FFN layer (nvfp4_group_gemm.moe_layer.MoeFfn) built from
ModelOpt-format NVFP4 tensors, in W4A16 (bf16 activations, the default) and W4A4, beside the
same layer with bf16 weights on `torch._grouped_mm`, each eager and as one CUDA graph replayed,
with the bytes its expert weights take.

    python bench/moe_ffn.py [--tokens 1,16,128,1024,4096] [--layers qwen3,dsv3_ep8]
                            [--repeats 20] [--json PATH]

Layers (bench/moe_layers.py's):
    qwen3      Qwen3-30B-A3B: H 2048, I 768, top-8 of 128 experts, all local
    dsv3_ep8   DeepSeek-V3 with 8-way expert parallelism: H 7168, I 2048, top-8 of 256 experts,
               32 local (experts 0..31; the pairs routed elsewhere add nothing here: MoeFfn's
               first_local)

The weights are random bf16 (N(0, 0.02)) quantized by the format's formula
(checkpoint.quantize_nvfp4); the bf16 layer uses those bf16 weights, its router, routing,
permutation, SwiGLU and un-permute the same torch ops as MoeFfn's (only its two GEMMs differ:
`torch._grouped_mm` over the sorted rows). Activations N(0, 1) bf16, a new routing per input.
Each result is checked against the bf16 layer (relative error printed: the quantization error,
not asserted). Timing per (layer, tokens, implementation): L2 flushed, CUDA events around one
eager call, or around one replay of a graph captured with the layer; mean of --repeats.

Exit codes: 0 done; 2 cannot run (no sm_90 GPU, a bad option).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_layers import LAYERS as GEMM_LAYERS
from moe_layers import Layer

FLUSH_BYTES = 256 << 20
LAYERS = {name: GEMM_LAYERS[name] for name in ("qwen3", "dsv3_ep8")}


def checkpoint_tensors(layer: Layer, device, seed: int = 0) -> tuple[dict, dict]:
    """(ModelOpt-format tensors of the local experts, under "layer.", the bf16 weights they
    quantize: {"w13": [E, 2I, H], "w2": [E, H, I]})."""
    from nvfp4_group_gemm import checkpoint

    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {
        "w13": (torch.randn(layer.local, 2 * layer.intermediate, layer.hidden, generator=generator, device=device)
                * 0.02).to(torch.bfloat16),
        "w2": (torch.randn(layer.local, layer.hidden, layer.intermediate, generator=generator, device=device)
               * 0.02).to(torch.bfloat16),
    }
    tensors = {}
    for name, weight in weights.items():
        quantized = checkpoint.quantize_nvfp4(weight)
        tensors |= {f"layer.{name}_weight": quantized.weight, f"layer.{name}_weight_scale": quantized.weight_scale,
                    f"layer.{name}_weight_scale_2": quantized.weight_scale_2,
                    # a calibration of N(0, 1) activations: amax about 5
                    f"layer.{name}_input_scale": torch.full((layer.local,), 5.0 / (6 * 448), device=device)}
    return tensors, weights


class Bf16Ffn:
    """The same layer with bf16 weights: MoeFfn's routing, permutation and un-permute (borrowed
    from `moe_ffn`), its two GEMMs on torch._grouped_mm."""

    def __init__(self, moe_ffn, weights: dict):
        self.layer = moe_ffn
        self.w13_t = weights["w13"].transpose(-2, -1)  # [E, H, 2I]: _grouped_mm's (K, N) per group
        self.w2_t = weights["w2"].transpose(-2, -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        tokens = x.shape[0]
        topk_ids, weights = layer.route(x)
        experts = layer.local_experts(topk_ids.reshape(-1))
        order, offsets = layer.sort_by_expert(experts)
        rows = x[order // layer.top_k]
        gate_up = torch._grouped_mm(rows, self.w13_t, offs=offsets[1:])
        gate, up = gate_up[:, :layer.intermediate].float(), gate_up[:, layer.intermediate:].float()
        hidden = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
        down = torch._grouped_mm(hidden, self.w2_t, offs=offsets[1:])
        unsorted = torch.empty_like(down)
        unsorted[order] = down
        unsorted = torch.where((experts < layer.experts)[:, None], unsorted.float(), 0.0)
        return (unsorted.view(tokens, layer.top_k, layer.hidden) * weights[..., None]).sum(dim=1).to(torch.bfloat16)


def weight_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def time_us(fn, inputs: list[torch.Tensor], static_x: torch.Tensor, flush: torch.Tensor, graph) -> float:
    """Mean device µs of one call (eager: fn(x); graph: its replay with x copied into static_x
    before the timed region), the L2 flushed before each."""
    times = []
    for x in inputs:
        if graph is not None:
            static_x.copy_(x)
        flush.add_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is None:
            fn(x)
        else:
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sum(times) / len(times)


def run_layer(layer: Layer, tokens_list: list[int], repeats: int, flush: torch.Tensor) -> list[dict]:
    from nvfp4_group_gemm import moe_layer

    tensors, weights = checkpoint_tensors(layer, "cuda")
    router = torch.randn(layer.experts, layer.hidden, device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(1)) * 0.05
    implementations = {
        "W4A16": moe_layer.MoeFfn(tensors, "layer.", router, layer.top_k, "bf16"),
        "W4A4": moe_layer.MoeFfn(tensors, "layer.", router, layer.top_k, "nvfp4"),
    }
    implementations["bf16"] = Bf16Ffn(implementations["W4A16"], weights)
    memory = {"W4A16": weight_bytes({k: v for k, v in tensors.items() if "input_scale" not in k}),
              "bf16": weight_bytes(weights)}
    memory["W4A4"] = memory["W4A16"]
    rows = []
    for tokens in tokens_list:
        generator = torch.Generator(device="cuda").manual_seed(tokens)
        inputs = [torch.randn(tokens, layer.hidden, device="cuda", generator=generator).to(torch.bfloat16)
                  for _ in range(repeats)]
        reference = implementations["bf16"](inputs[0]).float()
        cell = {"layer": layer.name, "tokens": tokens}
        for name, fn in implementations.items():
            out = fn(inputs[0]).float()
            error = float((out - reference).norm() / reference.norm().clamp_min(1e-30))
            eager = time_us(fn, inputs, None, flush, None)
            static_x = inputs[0].clone()
            fn(static_x)  # eager first: compiles, plans, binds
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn(static_x)
            replay = time_us(fn, inputs, static_x, flush, graph)
            del graph
            cell[name] = {"eager_us": eager, "graph_us": replay, "error_vs_bf16": error,
                          "weight_bytes": memory[name]}
        rows.append(cell)
        print_cell(cell, flush=True)
    return rows


def print_cell(cell: dict, flush: bool = False) -> None:
    bf16 = cell["bf16"]
    parts = [f"{cell['layer']:<10}{cell['tokens']:>6}"]
    for name in ("W4A16", "W4A4", "bf16"):
        row = cell[name]
        parts.append(f"{row['eager_us']:>9.1f}{row['graph_us']:>9.1f}")
    for name in ("W4A16", "W4A4"):
        parts.append(f"{cell[name]['graph_us'] / bf16['graph_us']:>8.2f}")
    parts.append(f"{cell['W4A16']['error_vs_bf16']:>8.3f}{cell['W4A4']['error_vs_bf16']:>8.3f}")
    print("".join(parts), flush=flush)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,128,1024,4096")
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"a subset of {', '.join(LAYERS)}")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = args.layers.split(",")
    unknown = [name for name in names if name not in LAYERS]
    if unknown:
        print(f"bench/moe_ffn.py: unknown layers {unknown}: choose from {', '.join(LAYERS)}", file=sys.stderr)
        return 2
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("bench/moe_ffn.py needs an sm_90 (Hopper) GPU: the MoE entry runs there", file=sys.stderr)
        return 2
    tokens_list = [int(t) for t in args.tokens.split(",")]
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; µs per layer call, mean of "
          f"{args.repeats} (L2 flushed), eager and graph replay")
    print(f"{'layer':<10}{'tokens':>6}{'W4A16 eager':>12}{'graph':>6}{'W4A4 eager':>12}{'graph':>6}"
          f"{'bf16 eager':>12}{'graph':>6}{'W4A16/bf16':>11}{'W4A4/bf16':>10}{'err W4A16':>10}{'W4A4':>6}")
    rows = []
    for name in names:
        layer = LAYERS[name]
        rows += run_layer(layer, tokens_list, args.repeats, flush)
        torch.cuda.empty_cache()
    for name in names:
        cell = next(r for r in rows if r["layer"] == name)
        print(f"{name}: expert weights {cell['W4A16']['weight_bytes'] / 2**30:.2f} GiB NVFP4 (codes, e4m3 scales, "
              f"fp32 scales), {cell['bf16']['weight_bytes'] / 2**30:.2f} GiB bf16")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
