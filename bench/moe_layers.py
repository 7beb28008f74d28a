"""Device time of the MoE entry on the GEMMs of real MoE layers, beside bf16 `torch._grouped_mm`
and (where importable) Triton's `triton_kernels` bf16 x MXFP4 `matmul_ogs`, in the same run.

Layers (gate-up: N = 2 I, K = H; down: N = H, K = I):
    qwen3_64   Qwen3-30B-A3B-like, H 2048, I 768, top-8 of 64 experts (the form of the tables so far)
    qwen3      Qwen3-30B-A3B: H 2048, I 768, top-8 of 128 experts
    dsv3_tp    DeepSeek-V3 under tensor parallelism: H 7168, I 2048 / 8 = 256, top-8 of 256, every
               expert local
    dsv3_ep8   DeepSeek-V3 with 8-way expert parallelism: H 7168, I 2048, top-8 of 256, experts
               0..31 local (the rows routed to them are the GEMM's T)
    mixtral    Mixtral-like, H 4096, I 14336, top-2 of 8
    dsv2_lite  DeepSeek-V2-Lite: H 2048, I 1408 (the down GEMM's K not a multiple of 256, as GLM-4.5's
               and Qwen1.5-MoE-A2.7B's), top-6 of 64; its down GEMM at the issue's token counts:
               --layers-only dsv2_lite --gemms down --tokens 1,16,128,1024
at 1, 8, 64, 512 and 4096 tokens; routing = top-k of random N(0, 1) router logits, and one
skewed routing per layer (--skewed-tokens: logits + 2.5 on a quarter of the experts).

Per cell (layer, GEMM, tokens): random NVFP4 a / b (general e4m3 scales) stacked by expert, the
offsets on the GPU; the entry's result is checked against the exact decode where the fp64 work is
small (--check-flops); each peer reads bf16 [T, K] activations and bf16 (torch) or MXFP4
(triton_kernels) weights of the same shape. Timing, per implementation: L2 flushed (a 256 MB
write), a sleep kernel queued so the host is ahead (device time only: triton_kernels' host cost
would otherwise dominate), CUDA events around one call; median of --repeats. Printed: µs of the
entry's fp4 path (`entry`) and W4A16 path (bf16 activations, the same weights, alpha per expert,
bf16 out), the W4A16 path with the weights packed for the fragment (`W4A16fr`: b_layout="fragment",
nvfp4_group_gemm.weight_layout; checked against the exact product too), the ratio entry / torch._grouped_mm (goal), both paths over triton_kernels, the active
weight MB and the effective weight bandwidth (the bytes of the experts that got a row, fp4 +
e4m3 scales for the entry's two paths, bf16 for torch, over the time).

    python bench/moe.py --layers [--repeats 15] [--tokens 1,8,64,512,4096] [--layers-only qwen3_64]
                                 [--json PATH] [--no-triton]

Exit codes: 0 done (goals met or not); 1 a wrong result; 2 cannot run (no sm_90 GPU, bad option).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers.per_group_data

# The goals: every cell at or below bf16; at 1 and 8 tokens at most 0.4x bf16
GOAL_DECODE_TOKENS = (1, 8)
GOAL_DECODE_RATIO = 0.4
FLUSH_BYTES = 256 << 20
SLEEP_CYCLES = 2_000_000  # ~1 ms: far longer than enqueueing one call


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    hidden: int
    intermediate: int
    experts: int  # routed experts in total
    local: int  # experts on this GPU (0 .. local - 1)
    top_k: int

    def gemms(self):
        """(name, N, K) of the layer's two grouped GEMMs."""
        return (("gate_up", 2 * self.intermediate, self.hidden), ("down", self.hidden, self.intermediate))


LAYERS = {
    "qwen3_64": Layer("qwen3_64", 2048, 768, 64, 64, 8),
    "dsv3_ep8": Layer("dsv3_ep8", 7168, 2048, 256, 32, 8),
    "mixtral": Layer("mixtral", 4096, 14336, 8, 8, 2),
    "qwen3": Layer("qwen3", 2048, 768, 128, 128, 8),
    "dsv3_tp": Layer("dsv3_tp", 7168, 256, 256, 256, 8),
    # K not a multiple of 256: the down GEMM's K = I = 1408 (64-wide k-tiles, the k_tail builds)
    "dsv2_lite": Layer("dsv2_lite", 2048, 1408, 64, 64, 6),
}


def route(layer: Layer, tokens: int, seed: int, skewed: bool = False) -> list[int]:
    """Rows per local expert of `tokens` tokens: top-k of random router logits (skewed: +2.5 on
    the first quarter of the experts)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, layer.experts, generator=generator)
    if skewed:
        logits[:, : max(1, layer.experts // 4)] += 2.5
    chosen = logits.topk(layer.top_k, dim=1).indices.flatten()
    counts = torch.bincount(chosen, minlength=layer.experts)[: layer.local]
    return [int(v) for v in counts]


def flush_l2(buffer: torch.Tensor) -> None:
    buffer.add_(1)


def device_us(fn, repeats: int, flush: torch.Tensor) -> float:
    """Median device µs of one call: L2 flushed, the host ahead behind a sleep kernel, events
    around the call alone."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        flush_l2(flush)
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def entry_inputs(rows: list[int], n: int, k: int, device="cuda") -> dict:
    """Random NVFP4 inputs of the entry (every e2m1 code, general e4m3 scales), generated on the GPU."""
    from nvfp4_group_gemm import moe

    groups, tokens = len(rows), max(1, sum(rows))
    fp4 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
    low, high = moe.GENERAL_SCALE_BYTES

    def bytes_(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, device=device)

    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + r)
    return {
        "a": bytes_(tokens, k // 2).view(fp4),
        "sfa": bytes_(tokens, k // 16, lo=low, hi=high).view(torch.float8_e4m3fn),
        "b": bytes_(groups, n, k // 2).view(fp4),
        "sfb": moe.blocked_scales(bytes_(groups, n, k // 16, lo=low, hi=high).view(torch.float8_e4m3fn)),
        "offsets": torch.tensor(offsets, dtype=torch.int32, device=device),
        "c": torch.empty((tokens, n), dtype=torch.float16, device=device),
    }


def w4a16_inputs(inputs: dict) -> dict:
    """The W4A16 twin of entry inputs: bf16 activations [T, K] (N(0, 1)), no sfa, the same
    weights and offsets, alpha per expert (0.5 .. 1.5), a bf16 c."""
    tokens, k = inputs["a"].shape[0], 2 * inputs["a"].shape[1]
    groups = inputs["b"].shape[0]
    return dict(inputs, a=torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16), sfa=None,
                c=torch.empty(inputs["c"].shape, dtype=torch.bfloat16, device="cuda"),
                alpha=torch.rand(groups, device="cuda") + 0.5)


def within_fp32_bound(inputs: dict, rows: list[int]) -> bool:
    """Every group's rows of c within the fp32 accumulation bound of the exact sum
    (reference.exact_mismatches: general e4m3 scales make fp32 sums round)."""
    from helpers import per_group_data  # tests/helpers.py

    from reference import exact_mismatches

    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + r)
    data, outputs = per_group_data(inputs, offsets)
    return sum(count for count, _, _ in exact_mismatches(data, outputs)) == 0


def triton_runner(rows: list[int], n: int, k: int):
    """A callable running triton_kernels' matmul_ogs (bf16 x MXFP4, ragged) on these rows, or None
    where triton_kernels does not import (../shared/peers/triton_kernels_src, copied beside the
    checkout as .peers/, or installed)."""
    source = Path(__file__).resolve().parents[1] / ".peers" / "triton_kernels_src"
    if source.is_dir() and str(source) not in sys.path:
        sys.path.insert(0, str(source))
    try:
        from triton_kernels.matmul_ogs import PrecisionConfig, RoutingData, matmul_ogs
        from triton_kernels.numerics_details.mxfp import downcast_to_mxfp
        from triton_kernels.tensor import (
            FP4,
            convert_layout,
            make_ragged_tensor_metadata,
            wrap_torch_tensor,
        )
        from triton_kernels.tensor_details import layout
    except Exception:  # noqa: BLE001 - the peer is optional
        return None
    groups, tokens = len(rows), max(1, sum(rows))
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(groups, k, n, device="cuda", dtype=torch.bfloat16)  # [G, K, N]: K along axis 1
    w_q, w_scale = downcast_to_mxfp(w, torch.uint8, axis=1)
    del w
    num_warps = 4 if tokens <= 512 else 8  # triton_kernels' bench_mlp rule
    value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
    scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=num_warps)
    w_val = convert_layout(wrap_torch_tensor(w_q, dtype=FP4), value_layout, **value_opts)
    w_sc = convert_layout(wrap_torch_tensor(w_scale), scale_layout, **scale_opts)
    sizes = torch.tensor(rows, device="cuda", dtype=torch.int32)
    meta = make_ragged_tensor_metadata(sizes, tokens)
    routing = RoutingData(None, meta.slice_sizes, groups, 1, meta)
    y = torch.empty((tokens, n), device="cuda", dtype=torch.float16)
    precision = PrecisionConfig(weight_scale=w_sc, out_dtype=torch.float16)
    return lambda: matmul_ogs(x, w_val, None, routing, precision_config=precision, y=y)


def run_cell(layer: Layer, gemm: str, n: int, k: int, tokens: int, rows: list[int], args, flush) -> dict:
    import nvfp4_group_gemm as lib
    from nvfp4_group_gemm import moe
    from nvfp4_group_gemm.weight_layout import pack_fragment

    active = sum(1 for r in rows if r)
    total = max(1, sum(rows))
    cell = {"layer": layer.name, "gemm": gemm, "tokens": tokens, "rows": sum(rows), "G": len(rows), "N": n, "K": k,
            "active_experts": active}
    inputs = entry_inputs(rows, n, k)
    config = moe.moe_config(moe.check_moe_inputs(**inputs), torch.cuda.get_device_properties(0).multi_processor_count)
    from nvfp4_group_gemm.hopper import config_name

    cell["config"] = config_name(config)
    lib.moe_grouped_gemm(**inputs)
    if total * n * k <= args.check_flops:
        cell["exact"] = within_fp32_bound(inputs, rows)
    lib.moe_grouped_gemm(**inputs)  # the binding
    cell["entry_us"] = device_us(lambda: lib.moe_grouped_gemm(**inputs), args.repeats, flush)
    # the W4A16 path: the same weights and offsets, bf16 activations read by the GEMM, a
    # checkpoint's epilogue (alpha per expert, bf16 out)
    w4a16 = w4a16_inputs(inputs)
    lib.moe_grouped_gemm(**w4a16)
    if total * n * k <= args.check_flops:
        cell["w4a16_exact"] = moe.compare_with_exact(**w4a16)[0] == 0
    cell["w4a16_us"] = device_us(lambda: lib.moe_grouped_gemm(**w4a16), args.repeats, flush)
    # the same W4A16 call with the weights packed for the fragment (b_layout="fragment")
    fragment = dict(w4a16, b=pack_fragment(w4a16["b"]), b_layout="fragment")
    lib.moe_grouped_gemm(**fragment)
    if total * n * k <= args.check_flops:
        cell["fragment_exact"] = moe.compare_with_exact(**w4a16)[0] == 0  # its c, the plain weights' product
    cell["w4a16_fragment_us"] = device_us(lambda: lib.moe_grouped_gemm(**fragment), args.repeats, flush)
    for label in filter(None, args.configs.split(",")):  # forced configs (NVFP4_MOE_CONFIG), same inputs
        os.environ["NVFP4_MOE_CONFIG"] = label
        lib.reset_runtime()  # reads the switches again (nvfp4_group_gemm.switches)
        for path, path_inputs in (("", inputs), ("w4a16 ", w4a16)):
            try:
                lib.moe_grouped_gemm(**path_inputs)
                if total * n * k <= args.check_flops:
                    cell.setdefault("configs_exact", {})[path + label] = (
                        within_fp32_bound(inputs, rows) if not path else moe.compare_with_exact(**path_inputs)[0] == 0)
                cell.setdefault("configs_us", {})[path + label] = device_us(
                    lambda path_inputs=path_inputs: lib.moe_grouped_gemm(**path_inputs), args.repeats, flush)
            except Exception as error:  # noqa: BLE001 - a config that cannot run this cell
                cell.setdefault("configs_us", {})[path + label] = f"{type(error).__name__}: {error}"[:120]
        del os.environ["NVFP4_MOE_CONFIG"]
        lib.reset_runtime()
    x = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(rows), n, k, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor(rows, device="cuda").cumsum(0).to(torch.int32)
    cell["grouped_mm_us"] = device_us(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends), args.repeats,
                                      flush)
    if not args.no_triton:
        runner = triton_runner(rows, n, k)
        if runner is not None:
            cell["triton_us"] = device_us(runner, args.repeats, flush)
    torch.cuda.empty_cache()
    fp4_bytes = active * (n * k // 2 + n * k // 16)
    cell["weight_mb"] = fp4_bytes / 1e6
    cell["entry_weight_tbps"] = fp4_bytes / (cell["entry_us"] * 1e-6) / 1e12
    cell["w4a16_weight_tbps"] = fp4_bytes / (cell["w4a16_us"] * 1e-6) / 1e12
    cell["w4a16_fragment_weight_tbps"] = fp4_bytes / (cell["w4a16_fragment_us"] * 1e-6) / 1e12
    cell["grouped_mm_weight_tbps"] = active * n * k * 2 / (cell["grouped_mm_us"] * 1e-6) / 1e12
    cell["ratio"] = cell["entry_us"] / cell["grouped_mm_us"]
    return cell


def goal_of(cell) -> tuple[float, str]:
    """(the ratio goal, its reason) of a cell."""
    if cell["tokens"] in GOAL_DECODE_TOKENS and not cell.get("skewed"):
        return GOAL_DECODE_RATIO, "decode"
    return 1.0, "bf16"


def print_row(cell) -> None:
    goal, _ = goal_of(cell)
    met = "ok" if cell["ratio"] <= goal else "MISS"
    triton = f"{cell['triton_us']:.1f}" if "triton_us" in cell else "-"
    over_triton = (f"{cell['entry_us'] / cell['triton_us']:>6.2f}{cell['w4a16_us'] / cell['triton_us']:>6.2f}"
                   if "triton_us" in cell else f"{'-':>6}{'-':>6}")
    exact = {True: "exact", False: "WRONG", None: "-"}[cell.get("exact")]
    exact += {True: "", False: "/W4A16 WRONG", None: ""}[cell.get("w4a16_exact")]
    exact += {True: "", False: "/fragment WRONG", None: ""}[cell.get("fragment_exact")]
    routing = "skew" if cell.get("skewed") else "topk"
    print(f"{cell['layer']:<9}{cell['gemm']:<8}{routing:<5}{cell['tokens']:>6}{cell['rows']:>7}{cell['active_experts']:>5}"
          f"{cell['entry_us']:>9.1f}{cell['w4a16_us']:>9.1f}{cell['w4a16_fragment_us']:>9.1f}{cell['grouped_mm_us']:>9.1f}"
          f"{triton:>9}{cell['ratio']:>7.2f}"
          f"{goal:>5.1f} {met:<5}{over_triton}{cell['weight_mb']:>7.0f}{cell['entry_weight_tbps']:>7.2f}"
          f"{cell['w4a16_weight_tbps']:>7.2f}{cell['grouped_mm_weight_tbps']:>7.2f}  {exact:<6}{cell['config']}"
          + "".join(f" | {label} {value:.1f}" if isinstance(value, float) else f" | {label} {value}"
                    + {True: "", False: " WRONG", None: ""}[cell.get("configs_exact", {}).get(label)]
                    for label, value in cell.get("configs_us", {}).items()), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tokens", default="1,8,64,512,4096")
    parser.add_argument("--skewed-tokens", default="512", help="token counts also run with a skewed routing")
    parser.add_argument("--layers-only", default=",".join(LAYERS), help=f"a subset of {', '.join(LAYERS)}")
    parser.add_argument("--gemms", default="gate_up,down")
    parser.add_argument("--check-flops", type=float, default=2e10,
                        help="check the entry against the exact decode where rows x N x K is at most this")
    parser.add_argument("--no-triton", action="store_true", help="skip triton_kernels")
    parser.add_argument("--configs", default="", help="configs also timed, forced (hopper.config_named labels)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true",
                        help="only run the entry three times per cell, untimed (for ncu or nsys)")
    args = parser.parse_args(argv)
    try:
        layers = [LAYERS[name] for name in args.layers_only.split(",")]
        token_counts = [int(t) for t in args.tokens.split(",")]
        skewed = [int(t) for t in args.skewed_tokens.split(",") if t]
    except (KeyError, ValueError) as error:
        print(f"moe_layers: bad option: {error}", file=sys.stderr)
        return 2
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("moe_layers: needs an sm_90 (Hopper) GPU: the MoE entry runs there", file=sys.stderr)
        return 2
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; device µs of one call (L2 flushed, "
          f"host ahead), median of {args.repeats}; TB/s = active experts' weight bytes / time")
    print(f"{'layer':<9}{'gemm':<8}{'rout':<5}{'tokens':>6}{'rows':>7}{'exp':>5}{'entry':>9}{'W4A16':>9}{'W4A16fr':>9}"
          f"{'bf16mm':>9}"
          f"{'triton':>9}{'ratio':>7}{'goal':>5} {'':<5}{'/tk fp4':>7}{'W4A16':>6}{'MB':>7}{'TB/s':>7}{'W4A16':>7}"
          f"{'bf16':>7}  check config")
    cells, wrong = [], False
    for layer in layers:
        for gemm, n, k in layer.gemms():
            if gemm not in args.gemms.split(","):
                continue
            runs = [(t, False) for t in token_counts] + [(t, True) for t in skewed]
            for tokens, skew in runs:
                rows = route(layer, tokens, seed=tokens * 7 + (1 if skew else 0), skewed=skew)
                if sum(rows) == 0:  # no row on this GPU's experts: give expert 0 one
                    rows[0] = 1
                if args.profile:
                    import nvfp4_group_gemm as lib

                    inputs = entry_inputs(rows, n, k)
                    for _ in range(3):
                        lib.moe_grouped_gemm(**inputs)
                    torch.cuda.synchronize()
                    print(f"{layer.name} {gemm} {tokens} tokens: {sum(rows)} rows", flush=True)
                    continue
                cell = run_cell(layer, gemm, n, k, tokens, rows, args, flush)
                cell["skewed"] = skew
                wrong |= cell.get("exact") is False or False in cell.get("configs_exact", {}).values()
                cells.append(cell)
                print_row(cell)
                if args.json:  # after every cell: a run cut short keeps what it measured
                    Path(args.json).write_text(json.dumps(cells, indent=1))
    misses = [c for c in cells if c["ratio"] > goal_of(c)[0]]
    print(f"cells: {len(cells)}, goal met: {len(cells) - len(misses)}, missed: {len(misses)}"
          + ("" if not misses else " (" + ", ".join(f"{c['layer']}/{c['gemm']}/{c['tokens']}" for c in misses) + ")"))
    if args.json:
        Path(args.json).write_text(json.dumps(cells, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
