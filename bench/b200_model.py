"""B200 timing MODEL of the two sm_100a kernels: predicted µs per benchmark shape, not a measurement.

No B200 ran anything here. The model prices each kernel from its structure (bytes, tiles,
waves, per-CTA streams, pipeline depth) plus a fixed per-launch cost, with three constants
fitted to the published per-version B200 times of the fastest public entry and its error
printed beside every published point, fitted or held out.

    T = T0 + max(bytes / BW_DRAM, critical CTA stream)

- bytes: A + B + both scale tensors (padded to 128 rows) + C of the input set.
- one k-tile (K = 256) of a CTA takes t_k = max(s / BW_SM, t_mma, (L + s / BW_SM + t_mma) / d):
  s stage bytes, t_mma its MMA time, d stages in flight. A stage is refilled only after the
  MMA that reads it completes, so a load round trip is L + s/BW_SM + t_mma and d of them overlap;
  deep pipelines stream at BW_SM, the per-tile kernel's two stages leave it latency-bound.
- per-tile kernel (one CTA per 128x128 tile, one CTA per SM, non-persistent): waves of 148
  tiles; a wave costs W (CTA start, pipeline fill, drain) + its slowest tile, epilogue exposed.
- persistent kernels: a CTA's tiles back to back; with two TMEM accumulators only the last
  tile's epilogue is exposed, with one every tile's. Epilogue = C bytes of the tile / BW_SM.

Fitted: T0, BW_SM, W, least squares on relative error over v6b shapes 2-3 (persistent, little
DRAM traffic) and v1c shapes 0-3 (per-tile); held out: v6b shapes 0-1 (DRAM-bound) and v5,
v5e, v5g, v6, v6c. T0 is that entry's fixed cost (launch, prologue, first load, last epilogue);
the predictions assume ours pays the same. Fixed: BW_DRAM and the MMA rate (measured, below);
L (assumed: no published kernel has a shallow pipeline to fit it to, so the per-tile prediction
is also printed at both ends of LOAD_LATENCY_RANGE_US).

Chained calls (submission.SM100_CHAIN_CALLS, on by default; `NVFP4_SM100_CHAIN_CALLS=0` turns
it off): each sm_100a kernel is launched as the programmatic dependent of the kernel before it
and waits before its first global access, so a call's launch, CTA start, barrier init, TMEM
allocation and pipeline set-up run under the previous call's tail. The published entry that
T0 is fitted to launches plainly (submission_v6b.py: `<<<grid, block, smem>>>`), so T0 is the
unchained fixed cost. What of it overlaps is an ASSUMPTION, anchored on the one measurement we
have: on the H200 the same 15-call timing of the sm_90 kernels ran 1.07 to 1.49 µs per call
faster chained than unchained (H200_CHAINED_US, H200_PLAIN_US: per-call means over the 15 calls,
the first of which has no call of ours before it). The model takes their mean, 1.27 µs, off T0
on every shape (never more than T0) and prints the chained prediction beside the plain one, with
the range from the smallest to the largest H200 saving.

Sources (stored commit aee9cda6b6444f774ce5eaee1ec1a5c84acaa521 of gau-nernst/gpu-mode-kernels):
- per-version, per-shape times and the speed of light: nvidia/nvfp4_group_gemm/README.md,
  "Benchmark results" (https://github.com/gau-nernst/gpu-mode-kernels/blob/main/nvidia/nvfp4_group_gemm/README.md)
- BW_DRAM 5914.80 GB/s, nvfp4 5797.05 TFLOP/s: nvidia/README.md, "Realistic SOL measurements"
- structure of the published versions: nvidia/nvfp4_group_gemm/submission_v1c.py (128x128x256
  tiles, grid = tiles, stages = 227 KiB / stage) and submission_v6b.py (CTA pairs, swap-AB,
  grid (N/128, min(148 // (N/128), token tiles)), 2 accumulators, BLOCK_M 256 on shape 1)

    python bench/b200_model.py [--json PATH]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE = "gau-nernst/gpu-mode-kernels@aee9cda nvidia/nvfp4_group_gemm/README.md"

# ---- fixed figures (not fitted) ----
NUM_SMS = 148
DRAM_BYTES_PER_US = 5914.80e3  # 5914.80 GB/s (nvidia/README.md)
MMA_FLOP_PER_US_PER_SM = 5797.05e6 / NUM_SMS  # 5797.05 TFLOP/s nvfp4 (nvidia/README.md)
LOAD_LATENCY_US = 0.7  # assumed round trip of one TMA stage under load
LOAD_LATENCY_RANGE_US = (0.4, 1.0)
K_TILE = 256
SOL_US = (18.833, 10.667, 2.406, 1.525)  # the competition's speed of light, shapes 0-3
# Chained calls: the H200's per-call µs (the 15-call timing) of the sm_90 kernels with and
# without programmatic dependent launch, benchmark shapes 0-3 (measured, docs/TUNING.md)
H200_CHAINED_US = (121.15, 71.19, 29.73, 14.91)
H200_PLAIN_US = (122.25, 72.68, 30.80, 16.33)


@dataclass(frozen=True)
class Kernel:
    """Structure of one kernel: what the model prices."""

    name: str
    schedule: str  # "grid": one CTA per tile; "list": pair c runs c, c+74, ...; "columns": v5/v6
    tokens: int  # problem M rows per tile (the per-tile kernel: 128)
    stages: int  # loads in flight per CTA
    stage_bytes: int  # per CTA per k-tile
    acc_stages: int = 1  # 2: a tile's epilogue overlaps the next tile's mainloop


def persistent(name, schedule, tokens, stages):
    stage = 128 * 128 + tokens // 2 * 128 + 128 * 16 + max(tokens, 128) * 16
    return Kernel(name, schedule, tokens, stages, stage, 2 if tokens == 128 else 1)


# ---- our two sm_100a kernels ----
# per-tile (seed structure): A 16 KiB + B 16 KiB + SFA 2 KiB + SFB 2 KiB a stage, 2 stages, one
# warp issuing TMA and MMA: it refills a stage once the MMA reading it completes, the other
# stage's load already in flight, so two loads overlap and the MMA sits in the round trip.
PER_TILE = Kernel("per-tile", "grid", 128, stages=2, stage_bytes=36 * 1024)
# persistent: 74 CTA pairs, swap-AB (128 N rows per CTA x T tokens), stages as many as fit
# beside two C stages (28 KiB a stage at T=128, 38 KiB at T=256)
PERSISTENT = {128: persistent("persistent T=128", "list", 128, 7),
              256: persistent("persistent T=256", "list", 256, 5)}

# ---- published versions: (kernel per shape, B200 µs per shape); stages per their host code ----
V1C = Kernel("v1c", "grid", 128, stages=6, stage_bytes=36 * 1024)
COL128, COL256 = persistent("col", "columns", 128, 8), persistent("col", "columns", 256, 5)
PUBLISHED = {
    "v1c": ((V1C,) * 4, (37.70, 31.10, 10.50, 8.41)),
    "v5": ((COL128,) * 4, (29.0, 20.8, 10.3, 8.4)),  # v5e's fixed-cost cuts not yet in
    "v5e": ((COL128,) * 4, (28.4, 20.6, 8.71, 6.54)),
    "v5g": ((COL128,) * 4, (28.5, 20.3, 8.51, 6.49)),
    "v6": ((COL128, COL256, COL128, COL128), (27.9, 19.7, 8.5, 6.43)),
    "v6b": ((COL128, COL256, COL128, COL128), (27.9, 19.4, 8.48, 6.43)),
    "v6c": ((COL128, COL256, COL128, COL128), (28.7, 18.8, 8.53, 6.55)),
}
FIT_POINTS = (("v6b", 2), ("v6b", 3), ("v1c", 0), ("v1c", 1), ("v1c", 2), ("v1c", 3))


def ceil_div(a, b):
    return -(-a // b)


def load_shapes(path=REPO_ROOT / "tests" / "cases" / "benchmarks.txt"):
    """[(M list, N list, K list)] from the benchmark case file."""
    shapes = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            f = {k.strip(): ast.literal_eval(v.strip()) for k, v in
                 (part.split(":") for part in line.split(";"))}
            shapes.append((tuple(f["m"]), tuple(f["n"]), tuple(f["k"])))
    return shapes


def input_bytes(shape):
    """A + B + SFA + SFB (128-row padded) + C bytes of one input set."""
    return sum(m * k // 2 + n * k // 2 + (ceil_div(m, 128) + ceil_div(n, 128)) * 128 * k // 16
               + m * n * 2 for m, n, k in zip(*shape))


@cache
def plan(kernel, shape):
    """Per CTA pair (per wave, for "grid"), its tiles as (k-tiles, C bytes a CTA writes)."""
    ms, ns, ks = shape
    if kernel.schedule == "grid":
        tiles = [(ceil_div(k, K_TILE), min(128, m - r * 128) * min(128, n - c * 128) * 2)
                 for m, n, k in zip(*shape)
                 for r in range(ceil_div(m, 128)) for c in range(ceil_div(n, 128))]
        return [tiles[i:i + NUM_SMS] for i in range(0, len(tiles), NUM_SMS)]  # waves
    order = sorted(range(len(ms)), key=lambda g: (-ms[g], g))  # groups by descending M
    t = kernel.tokens

    def tile(g, j):
        return ceil_div(ks[g], K_TILE), 128 * min(t, ms[g] - j * t) * 2

    if kernel.schedule == "list":  # groups, N tile, token tile; pair c runs c, c+74, ...
        tiles = [tile(g, j) for g in order for _ in range(ceil_div(ns[g], 256))
                 for j in range(ceil_div(ms[g], t))]
        return [tiles[c::NUM_SMS // 2] for c in range(NUM_SMS // 2)]
    # "columns" (published v5/v6): a pair keeps one N slice, strides over the token tiles
    tiles = [tile(g, j) for g in order for j in range(ceil_div(ms[g], t))]
    rows = min(NUM_SMS // (ns[0] // 128), len(tiles))
    return [tiles[y::rows] for y in range(rows)]


def k_tile_us(kernel, bw_sm, latency):
    mma = 2 * 128 * kernel.tokens * K_TILE / MMA_FLOP_PER_US_PER_SM
    load = kernel.stage_bytes / bw_sm
    return max(load, mma, (latency + load + mma) / kernel.stages)


def predict(kernel, shape, t0, bw_sm, wave_us, latency=LOAD_LATENCY_US):
    """Model µs and its parts for one kernel on one shape."""
    tk = k_tile_us(kernel, bw_sm, latency)
    groups = plan(kernel, shape)
    if kernel.schedule == "grid":  # waves back to back, epilogue exposed
        stream = sum(wave_us + max(kt * tk + c / bw_sm for kt, c in w) for w in groups)
        k_tiles = sum(max(kt for kt, _ in w) for w in groups)  # of the busiest SM
    else:
        def cta(tiles):
            exposed = tiles if kernel.acc_stages == 1 else tiles[-1:]
            return sum(kt for kt, _ in tiles) * tk + sum(c for _, c in exposed) / bw_sm
        stream = max(cta(tiles) for tiles in groups if tiles)
        k_tiles = max(sum(kt for kt, _ in g) for g in groups)
    dram = input_bytes(shape) / DRAM_BYTES_PER_US
    return {"us": t0 + max(dram, stream), "dram_us": dram, "stream_us": stream, "k_tile_us": tk,
            "bound": "DRAM" if dram >= stream else "CTA stream", "groups": len(groups),
            "tiles_max": max(len(g) for g in groups), "stream_bytes_max": k_tiles * kernel.stage_bytes}


def chained_saving_us():
    """(assumed B200 saving per chained call, its low end, its high end): the mean, smallest
    and largest per-call saving chaining gave on the H200."""
    savings = [plain - chained for plain, chained in zip(H200_PLAIN_US, H200_CHAINED_US)]
    return sum(savings) / len(savings), min(savings), max(savings)


def chained(us, t0, saving):
    """A plain prediction `us` (which includes T0) with the chained calls' overlap taken off:
    the saving, at most all of T0."""
    return us - min(saving, t0)


def geomean(values):
    values = list(values)
    product = 1.0
    for v in values:
        product *= v
    return product ** (1 / len(values))


def fit(shapes):
    """(T0, BW_SM, W) minimizing the squared relative error on FIT_POINTS (grid, then refine)."""
    pts = [(PUBLISHED[v][0][i], shapes[i], PUBLISHED[v][1][i]) for v, i in FIT_POINTS]

    def solve(bw, w):  # T0 enters additively: closed form for the relative least squares
        rest = [predict(k, s, 0.0, bw, w)["us"] for k, s, _ in pts]
        t0 = sum((1 - r / p) / p for r, (_, _, p) in zip(rest, pts)) / sum(1 / p**2 for *_, p in pts)
        return sum(((t0 + r) / p - 1) ** 2 for r, (_, _, p) in zip(rest, pts)), t0

    best = min((solve(bw * 1e3, w / 10), bw * 1e3, w / 10)
               for bw in range(40, 301, 4) for w in range(0, 51, 2))
    for step_bw, step_w in ((1e3, 0.02), (0.1e3, 0.002)):
        _, bw0, w0 = best
        best = min([best] + [(solve(bw0 + i * step_bw, max(0.0, w0 + j * step_w)),
                              bw0 + i * step_bw, max(0.0, w0 + j * step_w))
                             for i in range(-5, 6) for j in range(-5, 6)])
    (cost, t0), bw, w = best
    return {"T0_us": t0, "BW_SM_bytes_per_us": bw, "W_us": w, "cost": cost}


def chosen_tokens(shape):
    """The submission's per-set choice of tokens per tile, when it can be imported."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        from submission import choose_tokens_per_tile

        return choose_tokens_per_tile([(m, n, k, 1) for m, n, k in zip(*shape)])
    except Exception:  # noqa: BLE001 - any import or call failure: the pick is left unmarked
        return None


def reference_point(kernel, shape_index):
    """The published version whose structure on this shape is closest to `kernel`."""
    if kernel.schedule == "grid":
        return "v1c"
    for v in ("v6b", "v5e"):
        if PUBLISHED[v][0][shape_index].tokens == kernel.tokens:
            return v
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write constants, predictions and fit points here")
    args = ap.parse_args(argv)
    shapes = load_shapes()
    c = fit(shapes)
    t0, bw, w = c["T0_us"], c["BW_SM_bytes_per_us"], c["W_us"]
    saving, saving_lo, saving_hi = chained_saving_us()
    out = {"constants": c, "source": SOURCE, "predictions": [], "published": [],
           "chaining": {"saving_us": saving, "saving_range_us": [saving_lo, saving_hi],
                        "h200_chained_us": list(H200_CHAINED_US), "h200_plain_us": list(H200_PLAIN_US),
                        "assumption": "the B200 saves per chained call what the H200 saved (mean of 4 shapes), "
                                      "taken off T0"}}
    errors = {}
    for v, (kernels, times) in PUBLISHED.items():
        for i, (k, p) in enumerate(zip(kernels, times)):
            m = predict(k, shapes[i], t0, bw, w)["us"]
            errors[v, i] = m / p - 1
            out["published"].append({"version": v, "shape": i, "published_us": p, "model_us": m,
                                     "error": m / p - 1, "fitted": (v, i) in FIT_POINTS})

    print("B200 MODEL, not a measurement: predicted µs from kernel structure; no B200 ran this.")
    print(f"fitted: T0 = {t0:.2f} us, BW_SM = {bw / 1e3:.1f} GB/s per SM, W = {w:.2f} us per wave"
          f"  |  fixed: BW_DRAM {DRAM_BYTES_PER_US / 1e6:.3f} TB/s, MMA "
          f"{MMA_FLOP_PER_US_PER_SM * NUM_SMS / 1e6:.0f} TFLOP/s, L {LOAD_LATENCY_US} us (assumed)")
    print(f"published points: {SOURCE}")
    print(f"chained calls (ASSUMED overlap): T0 {t0:.2f} -> {t0 - min(saving, t0):.2f} us a call, the H200's "
          f"measured saving {saving:.2f} us (range {saving_lo:.2f}-{saving_hi:.2f}) taken off T0")
    for i, shape in enumerate(shapes):
        nbytes = input_bytes(shape)
        print(f"\nshape {i}: G={len(shape[0])} N={shape[1][0]} K={shape[2][0]} M={list(shape[0])}"
              f"  bytes {nbytes / 1e6:.2f} MB = {nbytes / DRAM_BYTES_PER_US:.2f} us at BW_DRAM"
              f"  SOL {SOL_US[i]} us")
        print(f"  {'kernel':<18}{'tiles':>6}{'waves|tiles/pair':>17}{'stream/SM':>11}"
              f"{'k-tile us':>10}  {'bound':<11}{'MODEL us':>9}{'L range':>12}{'chained':>9}"
              f"  published ref error")
        pick = chosen_tokens(shape)
        for k in (PER_TILE, PERSISTENT[128], PERSISTENT[256]):
            r = predict(k, shape, t0, bw, w)
            lo, hi = (predict(k, shape, t0, bw, w, lat)["us"] for lat in LOAD_LATENCY_RANGE_US)
            span = f"{lo:.1f}-{hi:.1f}" if hi - lo >= 0.05 else "-"
            count = (f"{r['groups']} wave" + "s" * (r["groups"] > 1) if k.schedule == "grid"
                     else f"{r['tiles_max']}/pair")
            tiles = sum(len(g) for g in plan(k, shape))
            chosen = pick == k.tokens and k.schedule == "list"
            ref = reference_point(k, i)
            ref_text = (f"{ref} {errors[ref, i]:+.1%} ({'fit' if (ref, i) in FIT_POINTS else 'held out'})"
                        if ref else "none published")
            chained_us = chained(r["us"], t0, saving)
            print(f"  {k.name + ('*' if chosen else ''):<18}{tiles:>6}{count:>17}"
                  f"{r['stream_bytes_max'] / 1e6:>9.2f}MB{r['k_tile_us']:>10.2f}  {r['bound']:<11}"
                  f"{r['us']:>9.1f}{span:>12}{chained_us:>9.1f}  {ref_text}")
            out["predictions"].append({"shape": i, "kernel": k.name, "tiles": tiles, "chosen": chosen,
                                       "bytes": nbytes, "sol_us": SOL_US[i], "reference": ref,
                                       "latency_range_us": [lo, hi], "chained_us": chained_us,
                                       "chained_range_us": [chained(r["us"], t0, saving_hi),
                                                            chained(r["us"], t0, saving_lo)], **r})
    print("\n* = submission.choose_tokens_per_tile's pick" if any(
        p["chosen"] for p in out["predictions"]) else "\n(submission.choose_tokens_per_tile not importable)")
    picks = [p for p in out["predictions"] if p["chosen"]]
    published = geomean(PUBLISHED["v6b"][1])
    if len(picks) == len(shapes):
        plain_g, chained_g = geomean(p["us"] for p in picks), geomean(p["chained_us"] for p in picks)
        lo_g, hi_g = (geomean(p["chained_range_us"][j] for p in picks) for j in (0, 1))
        out["geomean"] = {"plain_us": plain_g, "chained_us": chained_g, "chained_range_us": [lo_g, hi_g],
                          "published_v6b_us": published}
        print(f"geomean of the picks, MODEL: {plain_g:.2f} us unchained, {chained_g:.2f} us chained "
              f"({lo_g:.2f}-{hi_g:.2f}); the fastest public entry (v6b) published {published:.2f} us")

    print("\nfit: published B200 us, MODEL us, error = model / published - 1; F = fitted point")
    print(f"{'version':<8}" + "".join(f"{'shape ' + str(i):>24}" for i in range(len(shapes))))
    for v, (_, times) in PUBLISHED.items():
        cells = "".join((f"{times[i]:.2f} {times[i] * (1 + errors[v, i]):.2f} {errors[v, i]:+.1%}"
                         + ("F" if (v, i) in FIT_POINTS else " ")).rjust(24) for i in range(len(times)))
        print(f"{v:<8}{cells}")
    held = [abs(e) for (v, i), e in errors.items() if (v, i) not in FIT_POINTS and v != "v5"]
    print(f"max |error|: fitted {max(abs(errors[p]) for p in FIT_POINTS):.1%}, held out (v5e-v6c) "
          f"{max(held):.1%}, v5 {max(abs(errors['v5', i]) for i in range(4)):.1%} (v5 predates "
          "v5e's fixed-cost cuts, which one T0 cannot carry)")
    print("structures: v1c per-tile 128x128, 6 stages; v5/v5e/v5g CTA pairs, swap-AB, T=128, "
          "8 stages; v6/v6b/v6c the same with T=256 (5 stages) on shape 1")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
