"""A whole MoE FFN layer loaded from a ModelOpt NVFP4 export directory
(nvfp4_group_gemm.export, MoeFfn.from_pretrained's path): load time and peak host memory, then
device time in W4A16 (bf16 activations, the default) and W4A4, beside the same layer with bf16
weights on `torch._grouped_mm`, each eager and as one CUDA graph replayed.

    python bench/moe_ffn.py [--tokens 1,16,128,1024,4096] [--layers qwen3,dsv3_ep8]
                            [--repeats 20] [--export-dir DIR] [--json PATH]

Layers (bench/moe_layers.py's), each written as an export directory with the real tensor names,
config.json and hf_quant_config.json, then loaded through open_export / load_moe_layer:
    qwen3      Qwen3-30B-A3B (Qwen3MoeForCausalLM): H 2048, I 768, softmax top-8 of 128 experts,
               renormalized; all local
    dsv3_ep8   DeepSeek-V3 (DeepseekV3ForCausalLM) with 8-way expert parallelism: H 7168, I 2048,
               256 experts in 8 groups, sigmoid scores with a correction bias, best 4 groups,
               top-8, x 2.5, one shared expert; rank 0's 32 experts loaded (experts 0..31: the
               pairs routed elsewhere add nothing here) and the shared expert

The weights are random bf16 (N(0, 0.02), one seed per expert) quantized by the format's formula
(checkpoint.quantize_nvfp4), written as safetensors shards of 32 experts with
model.safetensors.index.json (the DeepSeek-V3 export: 6.4 GB). --export-dir keeps them (a layer
whose folder is complete is not written again); without it they go to a temporary folder,
removed at the end. Load: wall time of load_moe_layer to the GPU and MoeFfn's set-up, and the
peak resident host memory above the resident set before it (VmHWM of /proc/self/status, reset
through /proc/self/clear_refs; Linux).

The bf16 layer uses the same bf16 weights (regenerated from the seeds), router, routing,
permutation, SwiGLU, un-permute and shared expert as MoeFfn's torch ops; only its two grouped
GEMMs differ (`torch._grouped_mm` over the sorted rows; the shared expert a plain matmul).
Activations N(0, 1) bf16, a new routing per input. Each result is checked against the bf16
layer (relative error printed: the quantization error, not asserted). Timing per (layer,
tokens, implementation): L2 flushed, CUDA events around one eager call, or around one replay of
a graph captured with the layer; mean of --repeats.

Exit codes: 0 done; 2 cannot run (no sm_90 GPU, a bad option).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_layers import LAYERS as GEMM_LAYERS
from moe_layers import Layer

FLUSH_BYTES = 256 << 20
LAYERS = {name: GEMM_LAYERS[name] for name in ("qwen3", "dsv3_ep8")}
ARCHITECTURES = {"qwen3": "qwen3_moe", "dsv3_ep8": "deepseek_v3"}
EXPERTS_PER_SHARD = 32
# a calibration of N(0, 1) activations: amax about 5
INPUT_SCALE = 5.0 / (6 * 448)
COMPLETE = "bench_export_complete"


def expert_weights(layer: Layer, expert: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate rows then up rows [2I, H], down [H, I]) bf16 of one expert (expert = layer.experts:
    the shared expert), N(0, 0.02) from the expert's own seed: the same on every call."""
    generator = torch.Generator(device=device).manual_seed(1000 + expert)
    w13 = torch.randn(2 * layer.intermediate, layer.hidden, generator=generator, device=device) * 0.02
    w2 = torch.randn(layer.hidden, layer.intermediate, generator=generator, device=device) * 0.02
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def export_config(layer: Layer, architecture: str) -> dict:
    """config.json of a one-layer model of `architecture` ("qwen3_moe" or "deepseek_v3") with the
    layer's sizes and routing (ModelOpt's quantization_config included)."""
    common = {"hidden_size": layer.hidden, "moe_intermediate_size": layer.intermediate, "num_hidden_layers": 1,
              "num_experts_per_tok": layer.top_k, "norm_topk_prob": True, "hidden_act": "silu",
              "quantization_config": {"quant_algo": "NVFP4", "quant_method": "modelopt",
                                      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float",
                                                                                "group_size": 16}}}}}
    if architecture == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": layer.experts,
                "decoder_sparse_step": 1, "mlp_only_layers": [], **common}
    n_group = min(8, layer.experts)
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "n_routed_experts": layer.experts, "n_shared_experts": 1, "n_group": n_group,
            "topk_group": max(1, n_group // 2), "routed_scaling_factor": 2.5, "first_k_dense_replace": 0,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", **common}


def projection_tensors(prefix: str, weight: torch.Tensor) -> dict:
    """ModelOpt's four tensors of one projection [N, K] (CPU)."""
    from nvfp4_group_gemm import checkpoint

    quantized = checkpoint.quantize_nvfp4(weight[None])
    return {prefix + "weight": quantized.weight[0].cpu(), prefix + "weight_scale": quantized.weight_scale[0].cpu(),
            prefix + "weight_scale_2": quantized.weight_scale_2[0].cpu(),
            prefix + "input_scale": torch.tensor(INPUT_SCALE)}


def write_export(layer: Layer, directory: Path, architecture: str, device) -> Path:
    """The layer as MoE layer 0 of an export directory (module docstring); reused when complete."""
    from safetensors.torch import save_file

    if (directory / COMPLETE).exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = export_config(layer, architecture)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                            "exclude_modules": ["lm_head", "model.layers.0.mlp.gate"]}}))
    prefix = "model.layers.0.mlp."
    names = ("gate_proj", "up_proj", "down_proj")
    generator = torch.Generator(device=device).manual_seed(1)
    tensors = {prefix + "gate.weight": (torch.randn(layer.experts, layer.hidden, generator=generator,
                                                    device=device) * 0.05).float().cpu()}
    if architecture == "deepseek_v3":
        tensors[prefix + "gate.e_score_correction_bias"] = (torch.randn(layer.experts, generator=generator,
                                                                        device=device) * 0.1).float().cpu()
        w13, w2 = expert_weights(layer, layer.experts, device)
        for name, weight in zip(names, (*w13.chunk(2), w2)):
            tensors |= projection_tensors(f"{prefix}shared_experts.{name}.", weight)
    weight_map = {}
    shards = -(-layer.experts // EXPERTS_PER_SHARD)
    for shard in range(shards):
        for e in range(shard * EXPERTS_PER_SHARD, min(layer.experts, (shard + 1) * EXPERTS_PER_SHARD)):
            w13, w2 = expert_weights(layer, e, device)
            for name, weight in zip(names, (*w13.chunk(2), w2)):
                tensors |= projection_tensors(f"{prefix}experts.{e}.{name}.", weight)
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, directory / file)
        weight_map |= dict.fromkeys(tensors, file)
        tensors = {}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / COMPLETE).write_text("")
    return directory


def host_status(key: str) -> int | None:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM), None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def load_layer(directory: Path, layer: Layer, device) -> tuple[object, float, int | None]:
    """(the export's MoE layer 0, its local experts 0..layer.local - 1 on `device`; wall seconds
    of the load; peak resident host bytes above the resident set before it, None off Linux)."""
    from nvfp4_group_gemm.export import open_export

    before = host_status("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from now on
    except OSError:
        before = None
    begin = time.perf_counter()
    weights = open_export(directory).load_moe_layer(0, device=device, experts=range(layer.local))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    peak = host_status("VmHWM")
    return weights, seconds, None if before is None or peak is None else peak - before


class Bf16Ffn:
    """The same layer with bf16 weights: MoeFfn's routing, permutation, un-permute and shared
    expert (borrowed from `moe_ffn`), its two grouped GEMMs on torch._grouped_mm."""

    def __init__(self, moe_ffn, weights: dict):
        self.layer = moe_ffn
        self.w13_t = weights["w13"].transpose(-2, -1)  # [E, H, 2I]: _grouped_mm's (K, N) per group
        self.w2_t = weights["w2"].transpose(-2, -1)
        self.shared = weights.get("shared")  # (w13 [2I, H], w2 [H, I]) or None

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
        out = (unsorted.view(tokens, layer.top_k, layer.hidden) * weights[..., None]).sum(dim=1)
        if self.shared is not None:
            gate, up = (x @ self.shared[0].T).float().chunk(2, dim=-1)
            out = out + (((torch.nn.functional.silu(gate) * up).to(torch.bfloat16)) @ self.shared[1].T).float()
        return out.to(torch.bfloat16)


def bf16_weights(layer: Layer, moe_ffn, device) -> dict:
    """The bf16 weights the export quantized, of the local experts (and the shared expert where
    the layer adds one): {"w13": [E, 2I, H], "w2": [E, H, I], "shared": (w13, w2) or None}."""
    pairs = [expert_weights(layer, e, device) for e in range(layer.local)]
    return {"w13": torch.stack([w13 for w13, _ in pairs]), "w2": torch.stack([w2 for _, w2 in pairs]),
            "shared": expert_weights(layer, layer.experts, device) if moe_ffn.shared is not None else None}


def layer_weight_bytes(moe_ffn) -> int:
    """The NVFP4 weights' bytes (codes, e4m3 scales, fp32 scales) of the local and shared experts."""
    projections = [moe_ffn.w13, moe_ffn.w2] + ([] if moe_ffn.shared is None else list(moe_ffn.shared.values()))
    return sum(t.numel() * t.element_size() for p in projections for t in (p.b, p.sfb, p.weight_scale_2))


def weight_bytes(tensors) -> int:
    """Bytes of a list of tensors, or of a dict's values."""
    tensors = tensors.values() if isinstance(tensors, dict) else tensors
    return sum(t.numel() * t.element_size() for t in tensors)


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


def run_layer(layer: Layer, directory: Path, tokens_list: list[int], repeats: int, flush: torch.Tensor) -> dict:
    from nvfp4_group_gemm import moe_layer

    weights, load_s, peak = load_layer(directory, layer, "cuda")
    implementations = {"W4A16": moe_layer.MoeFfn.from_weights(weights, "bf16"),
                       "W4A4": moe_layer.MoeFfn.from_weights(weights, "nvfp4")}
    bf16 = bf16_weights(layer, implementations["W4A16"], "cuda")
    implementations["bf16"] = Bf16Ffn(implementations["W4A16"], bf16)
    memory = {"W4A16": layer_weight_bytes(implementations["W4A16"]),
              "bf16": weight_bytes([bf16["w13"], bf16["w2"], *(bf16["shared"] or ())])}
    memory["W4A4"] = memory["W4A16"]
    load = {"layer": layer.name, "load_s": load_s, "host_peak_bytes": peak, "weight_bytes": memory}
    print_load(load)
    print(f"{'layer':<10}{'tokens':>6}{'W4A16 eager':>12}{'graph':>6}{'W4A4 eager':>12}{'graph':>6}"
          f"{'bf16 eager':>12}{'graph':>6}{'W4A16/bf16':>11}{'W4A4/bf16':>10}{'err W4A16':>10}{'W4A4':>6}")
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
            cell[name] = {"eager_us": eager, "graph_us": replay, "error_vs_bf16": error}
        rows.append(cell)
        print_cell(cell, flush=True)
    return {"load": load, "cells": rows}


def print_load(load: dict) -> None:
    peak = "n/a" if load["host_peak_bytes"] is None else f"{load['host_peak_bytes'] / 2**20:.0f} MiB"
    print(f"{load['layer']}: loaded in {load['load_s']:.2f} s, host peak {peak}; expert weights "
          f"{load['weight_bytes']['W4A16'] / 2**30:.2f} GiB NVFP4 (codes, e4m3 scales, fp32 scales), "
          f"{load['weight_bytes']['bf16'] / 2**30:.2f} GiB bf16", flush=True)


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
    parser.add_argument("--export-dir", default=None, help="where the exports are written and kept (default: a "
                        "temporary folder, removed at the end)")
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
    root = Path(args.export_dir) if args.export_dir else Path(tempfile.mkdtemp(prefix="moe_ffn_exports_"))
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; exports in {root}; µs per layer call, "
          f"mean of {args.repeats} (L2 flushed), eager and graph replay")
    results = []
    try:
        for name in names:
            layer = LAYERS[name]
            begin = time.perf_counter()
            directory = write_export(layer, root / name, ARCHITECTURES[name], "cuda")
            print(f"{name}: export {directory} ready in {time.perf_counter() - begin:.1f} s", flush=True)
            results.append(run_layer(layer, directory, tokens_list, args.repeats, flush))
            torch.cuda.empty_cache()
    finally:
        if not args.export_dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
