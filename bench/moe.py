"""Device time of the MoE entry (stacked tokens, offsets on the GPU) on the four benchmark shapes,
beside the per-size-set path (custom_kernel, the competition's input) in the same run, and beside
the peers' figures of the same run where their JSON files are given.

Per shape: 15 input sets (the shape's M per group stacked into T = sum M rows, offsets = cumsum M
on the GPU; the competition's scales, as the harness's inputs), checked against the exact decode
first; then the harness's method (bench/peers.time_calls: L2 flush, one event pair around 15
back-to-back calls, elapsed / 15), mean and best µs over --repeats. The per-size-set path runs the
library's custom_kernel on the harness's own 15 input sets of the shape.

    python bench/moe.py [--repeats 30] [--shapes 0,1,2,3] [--json PATH]
    python bench/moe.py --layers ...      # real MoE layers' GEMMs: bench/moe_layers.py
    python bench/moe.py --layers --layers-only dsv2_lite --gemms down --tokens 1,16,128,1024
                                          # a 1408-K down GEMM (K % 256 != 0) beside torch._grouped_mm
        [--triton-json PATH]  # ../shared/peers/bench_triton_kernels_mxfp4.py --json, same run
        [--torch-json PATH]   # ../shared/peers/bench_torch_grouped_mm.py --json, same run

The W4A16 column: the same stacked shapes with bf16 activations (N(0, 1) x 4, the same weights
and offsets) through the entry's W4A16 GEMM (a bf16 [T, K], sfa None), checked within the fp32
bound of the exact product (moe.compare_with_exact), timed alike.

Prints a row per shape (µs) and the ratios MoE / per-size-set (goal <= 1.15), MoE / triton_kernels
(its better warp count, without the metadata rebuild) and MoE / torch._grouped_mm (goal < 1 for
both), and W4A16 / the fp4 entry and W4A16 / triton_kernels (both read bf16 activations). Exit codes: 0 done (whether or not the goals are met); 2 cannot run (no sm_90 GPU, a bad
option); 1 a wrong result.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import BENCHMARKS, NUM_INPUTS, benchmark_inputs, time_calls

GOAL_VS_PER_SIZE_SET = 1.15


def moe_inputs(ms, n, k, seed: int = 1111) -> list[dict]:
    """NUM_INPUTS stacked input sets of one benchmark shape (T = sum M, offsets = cumsum M)."""
    from nvfp4_group_gemm import moe

    offsets = [0]
    for m in ms:
        offsets.append(offsets[-1] + m)
    sets = []
    for index in range(NUM_INPUTS):
        generator = torch.Generator().manual_seed(seed + 42 * index)
        inputs = moe.random_moe_inputs(offsets[-1], len(ms), n, k, general_scales=False, generator=generator)
        inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
        sets.append(inputs)
    return sets


def w4a16_inputs(stacked: list[dict], seed: int = 2222) -> list[dict]:
    """The W4A16 twins of stacked input sets: bf16 activations [T, K] (N(0, 1) x 4), no sfa, the
    same weights and offsets, a NaN-filled fp16 c."""
    sets = []
    for index, inputs in enumerate(stacked):
        tokens, k = inputs["a"].shape[0], 2 * inputs["a"].shape[1]
        generator = torch.Generator(device="cuda").manual_seed(seed + index)
        a = (torch.randn(tokens, k, device="cuda", generator=generator) * 4).to(torch.bfloat16)
        sets.append(dict(inputs, a=a, sfa=None, c=torch.full_like(inputs["c"], float("nan"))))
    return sets


def peer_rows(path: str | None, kind: str) -> dict[int, float]:
    """Mean µs per shape index from a peer script's JSON (triton: the better of its warp counts,
    without "+meta"; torch: mean_us)."""
    if not path:
        return {}
    data = json.loads(Path(path).read_text())
    rows = {}
    if kind == "triton":
        for index, row in enumerate(data):
            means = [v["mean_us"] for name, v in row["variants"].items()
                     if name.startswith("tk mxfp4") and "+meta" not in name and "mean_us" in v]
            if means:
                rows[row.get("shape", index) if isinstance(row.get("shape"), int) else index] = min(means)
    else:
        for row in data["rows"]:
            rows[row["shape"]] = row["mean_us"]
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--layers" in argv:  # the real MoE layers' GEMMs (bench/moe_layers.py)
        import moe_layers

        return moe_layers.main([a for a in argv if a != "--layers"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--shapes", default="0,1,2,3")
    parser.add_argument("--json", default=None)
    parser.add_argument("--triton-json", default=None)
    parser.add_argument("--torch-json", default=None)
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("bench/moe.py needs an sm_90 (Hopper) GPU: the MoE entry runs there", file=sys.stderr)
        return 2
    import nvfp4_group_gemm as gemm
    from nvfp4_group_gemm import moe
    from nvfp4_group_gemm.hopper import config_name
    from reference import ref_kernel

    triton = peer_rows(args.triton_json, "triton")
    torch_mm = peer_rows(args.torch_json, "torch")
    shapes = [int(s) for s in args.shapes.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; µs, harness method, mean (best) "
          f"of {args.repeats} repeats x 15 calls")
    print(f"{'shape':<6}{'MoE entry':>18}{'per-size-set':>18}{'W4A16':>18}{'triton_kernels':>16}{'_grouped_mm':>13}"
          f"{'MoE/per-set':>13}{'MoE/triton':>12}{'MoE/torch':>11}{'W4A16/MoE':>11}{'W4A16/triton':>14}  config")
    rows, failed = [], False
    for index in shapes:
        ms, ns, ks = BENCHMARKS[index]
        n, k = ns[0], ks[0]
        stacked = moe_inputs(ms, n, k)
        first = stacked[0]
        gemm.moe_grouped_gemm(**first)
        expected = moe.moe_reference(first["a"], first["sfa"], first["b"], first["sfb"], first["offsets"])
        if not torch.equal(first["c"], expected):
            print(f"shape {index}: the MoE entry's result differs from the exact decode", file=sys.stderr)
            failed = True
        for inputs in stacked:  # a set's second call makes its binding (and records its graph): not timed
            gemm.moe_grouped_gemm(**inputs)
        moe_mean, moe_best = time_calls(lambda s: gemm.moe_grouped_gemm(**s), stacked, args.repeats)
        config = moe.moe_config(moe.check_moe_inputs(**first), torch.cuda.get_device_properties(0).multi_processor_count)
        w4a16 = w4a16_inputs(stacked)
        gemm.moe_grouped_gemm(**w4a16[0])
        mismatches, _, where, _, _ = moe.compare_with_exact(
            *(w4a16[0][name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")))
        if mismatches:
            print(f"shape {index}: the W4A16 result differs from the exact product beyond the fp32 bound ({mismatches}; "
                  f"first: {where})", file=sys.stderr)
            failed = True
        for inputs in w4a16:
            gemm.moe_grouped_gemm(**inputs)
        w4a16_mean, w4a16_best = time_calls(lambda s: gemm.moe_grouped_gemm(**s), w4a16, args.repeats)
        del stacked, first, expected, w4a16
        per_set = benchmark_inputs(ms, ns, ks)
        expected_sets = [c.clone() for c in ref_kernel(per_set[0])]
        outputs = gemm.custom_kernel(per_set[0])
        if not all(torch.equal(o, e) for o, e in zip(outputs, expected_sets)):
            print(f"shape {index}: the per-size-set path differs from the reference", file=sys.stderr)
            failed = True
        set_mean, set_best = time_calls(gemm.custom_kernel, per_set, args.repeats)
        del per_set, expected_sets, outputs
        torch.cuda.empty_cache()
        peer_t, peer_m = triton.get(index), torch_mm.get(index)
        row = {"shape": index, "moe_mean_us": moe_mean, "moe_best_us": moe_best, "per_size_set_mean_us": set_mean,
               "per_size_set_best_us": set_best, "w4a16_mean_us": w4a16_mean, "w4a16_best_us": w4a16_best,
               "triton_kernels_us": peer_t, "grouped_mm_us": peer_m,
               "config": config_name(config)}
        rows.append(row)

        def ratio(other, mean=moe_mean):
            return f"{mean / other:.3f}" if other else "-"

        print(f"{index:<6}{f'{moe_mean:.2f} ({moe_best:.2f})':>18}{f'{set_mean:.2f} ({set_best:.2f})':>18}"
              f"{f'{w4a16_mean:.2f} ({w4a16_best:.2f})':>18}"
              f"{(f'{peer_t:.1f}' if peer_t else '-'):>16}{(f'{peer_m:.1f}' if peer_m else '-'):>13}"
              f"{ratio(set_mean):>13}{ratio(peer_t):>12}{ratio(peer_m):>11}{ratio(moe_mean, w4a16_mean):>11}"
              f"{ratio(peer_t, w4a16_mean):>14}  {row['config']}", flush=True)
    if rows:
        geo = lambda key: math.exp(sum(math.log(r[key]) for r in rows) / len(rows))
        worst = max(r["moe_mean_us"] / r["per_size_set_mean_us"] for r in rows)
        print(f"geomean: MoE entry {geo('moe_mean_us'):.2f}, per-size-set {geo('per_size_set_mean_us'):.2f}, "
              f"W4A16 {geo('w4a16_mean_us'):.2f}; "
              f"worst MoE / per-size-set {worst:.3f} (goal <= {GOAL_VS_PER_SIZE_SET})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
