"""Host-side schedules of the sm_90a kernel: the automatic choice of a config per size set
(choose_config: stream-K, split-K with 128x128 or 128x256 tiles, or whole tiles), when
split-K pays, stream-K's plan of equal shares (plan_stream_k) and when it pays, and a
stream-K launch's device buffers."""

from __future__ import annotations

import functools
import heapq
import struct

import torch

from .. import launch
from .config import (
    CTAS_PER_SM,
    SM90_CONFIG,
    SPLIT_K_CONFIG,
    STREAM_K_CONFIG,
    SWAP_AB_CONFIG,
    SWAP_AB_ONE_ROUND_CONFIG,
    SWAP_AB_ONE_ROUND_K128_CONFIG,
    SWAP_AB_SPLIT_K_CONFIG,
    SWAP_AB_T32_CONFIG,
    SWAP_AB_T32_K128_CONFIG,
    SWAP_AB_T112_CONFIG,
    SWAP_AB_T112_K128_CONFIG,
    SWAP_AB_T192_CONFIG,
    SWAP_AB_VARIABLE_CONFIG,
    TILE_M,
    WIDE_SPLIT_K_CONFIG,
    HopperGemmConfig,
    SwapAbConfig,
)


def swap_ab_tiles(problem_sizes, config: SwapAbConfig = SWAP_AB_CONFIG) -> int:
    """Output tiles (tile_tokens x tile_weights) of a size set in the swap-AB kernel."""
    return sum(-(-m // config.tile_tokens) * -(-n // config.tile_weights) for m, n, _k, _l in problem_sizes)


# µs per k-tile (64 K) of one SM for a tile of t tokens: a fixed part (barrier, copies, the
# weight decode) and a part per token (wgmma N). An SM runs its tiles one after another (or two
# at a time at the same throughput).
# Fitted on the H200 to device times less the pre-pass (EXPERIMENTS E32).
SWAP_AB_K_TILE_FIXED_US = 0.21
SWAP_AB_K_TILE_US_PER_TOKEN = 0.17 / 64


def swap_ab_k_tile_us(tokens: int) -> float:
    """Modelled µs of one k-tile of a tile of `tokens` tokens on one SM."""
    return SWAP_AB_K_TILE_FIXED_US + SWAP_AB_K_TILE_US_PER_TOKEN * tokens


def swap_ab_tile_costs(problem_sizes, config: SwapAbConfig) -> list[float]:
    """Modelled µs of every output tile of a size set in `config`, in launch order."""
    if config.variable_tokens:
        return [
            problem_sizes[g][2] // config.tile_k * swap_ab_k_tile_us((token_class + 1) * TOKEN_CLASS_STEP)
            for g, _first, _weight_tile, token_class in variable_token_tiles(problem_sizes, config)
        ]
    return [
        k // config.tile_k * swap_ab_k_tile_us(config.tile_tokens)
        for m, n, k, _l in problem_sizes
        for _tile in range(-(-m // config.tile_tokens) * -(-n // config.tile_weights))
    ]


def swap_ab_cost_runs(problem_sizes, config: SwapAbConfig) -> list[tuple[float, int]]:
    """swap_ab_tile_costs as runs (cost, count) of equal consecutive costs, from the sizes
    alone (no tile list): per group for whole tiles; by class, longest first, for variable
    token tiles (variable_token_tiles' order, whose ties within a cost do not move a
    schedule). A new size set pays it once per candidate config on its call's path."""
    fixed_us, per_token_us = SWAP_AB_K_TILE_FIXED_US, SWAP_AB_K_TILE_US_PER_TOKEN
    tile_tokens, tile_k, tile_weights = config.tile_tokens, config.tile_k, config.tile_weights
    if not config.variable_tokens:
        tile_us = fixed_us + per_token_us * tile_tokens
        return [(k // tile_k * tile_us, -(-m // tile_tokens) * -(-n // tile_weights))
                for m, n, k, _l in problem_sizes if m]
    counts: dict[float, int] = {}
    for m, n, k, _l in problem_sizes:
        if m == 0:
            continue
        size, full, rest_tokens = variable_token_split(m, tile_tokens)
        weight_tiles = -(-n // tile_weights)
        k_tiles = k // tile_k
        if full:
            cost = k_tiles * (fixed_us + per_token_us * size)
            counts[cost] = counts.get(cost, 0) + full * weight_tiles
        if rest_tokens:
            cost = k_tiles * (fixed_us + per_token_us * rest_tokens)
            counts[cost] = counts.get(cost, 0) + weight_tiles
    return sorted(counts.items(), key=lambda run: -run[0])


def list_schedule_makespan(runs, num_sms: int) -> float:
    """The busiest SM's total when jobs, in order, each go to the SM that frees first, for
    jobs given as runs (cost, count): the same schedule as one heap step per job (equal jobs
    of a run go to the SMs free earliest, a block of SMs free at the same time at once), in
    steps per run rather than per job. Buckets [free time, SMs]."""
    buckets = [(0.0, num_sms)]
    heappush, heapreplace = heapq.heappush, heapq.heapreplace
    for cost, count in runs:
        while count:
            free_at, sms = buckets[0]
            if sms > count:
                # the rest of the block stays the earliest bucket: the root, in place
                buckets[0] = (free_at, sms - count)
                heappush(buckets, (free_at + cost, count))
                break
            heapreplace(buckets, (free_at + cost, sms))
            count -= sms
    return max(buckets)[0]


def swap_ab_time_model(problem_sizes, config: SwapAbConfig, num_sms: int) -> float:
    """Modelled GEMM µs of a size set in `config` (whole tiles): the tiles, in launch order,
    each to the SM that frees first (the hardware's in-order dispatch); the busiest SM's
    total. In steps per run of equal tiles (list_schedule_makespan): a new size set's plan
    pays it on every call of a MoE step."""
    return list_schedule_makespan(swap_ab_cost_runs(problem_sizes, config), num_sms)


# Variable token tiles: a group's M in ceil(M / 256) tiles of equal size rounded up to 64 tokens.
# Classes of 32 or 16 tokens (less padding, more main loops): slower (EXPERIMENTS E62).
TOKEN_CLASS_STEP = 64


def variable_token_tiles(problem_sizes, config: SwapAbConfig) -> list[tuple[int, int, int, int]]:
    """Tile rows (group, first token / 64, weight tile, token class) of a variable-token-tile
    config: each group's M in ceil(M / tile_tokens) tiles of equal size rounded up to a
    multiple of 64 (the last one smaller where M ends), class = tokens / 64 - 1. Longest
    modelled time (k-tiles x swap_ab_k_tile_us of the class) first, so that the hardware's
    in-order dispatch gives the longest tiles the first SMs (longest-first scheduling); then
    group, weight tile, first token.

    Sorted per (group, class) bucket, not per row: a new size set plans on the call's path
    (a MoE step), and its rows number hundreds (EXPERIMENTS E66)."""
    return [(g, first, w, token_class) for g, token_class, firsts, weight_tiles in variable_token_buckets(
        problem_sizes, config) for w in range(weight_tiles) for first in firsts]


def variable_token_split(m: int, tile_tokens: int) -> tuple[int, int, int]:
    """A group's M in variable token tiles: (tokens of a full tile, full tiles, tokens of the
    last, smaller tile or 0), every count a multiple of 64; ceil(M / tile_tokens) tiles of
    equal size, the last one smaller where M ends (rounded up to the others' class, it is
    one of them)."""
    step = TOKEN_CLASS_STEP
    per_tile = -(-m // -(-m // tile_tokens))
    size = -(-per_tile // step) * step
    full, rest = divmod(m, size)
    rest_tokens = -(-rest // step) * step
    if rest_tokens == size:
        return size, full + 1, 0
    return size, full, rest_tokens


def variable_token_buckets(problem_sizes, config: SwapAbConfig) -> list[tuple[int, int, range, int]]:
    """variable_token_tiles as buckets in its order: (group, token class, first tokens / 64
    of its tiles, weight tiles); the bucket's rows are (group, first, w, class) for each w,
    then each first. O(G): a new size set's first call packs them from cached blocks
    (packed_swap_ab_tiles)."""
    step = TOKEN_CLASS_STEP
    fixed_us, per_token_us = SWAP_AB_K_TILE_FIXED_US, SWAP_AB_K_TILE_US_PER_TOKEN
    tile_tokens, tile_k, tile_weights = config.tile_tokens, config.tile_k, config.tile_weights
    buckets = []  # (-cost, group, class, first tokens / step, weight tiles)
    for g, (m, n, k, _l) in enumerate(problem_sizes):
        if m == 0:
            continue
        size, full, rest_tokens = variable_token_split(m, tile_tokens)
        k_tiles = k // tile_k
        weight_tiles = -(-n // tile_weights)
        steps_per_tile = size // step
        if full:
            buckets.append((-k_tiles * (fixed_us + per_token_us * size), g, steps_per_tile - 1,
                            range(0, full * steps_per_tile, steps_per_tile), weight_tiles))
        if rest_tokens:
            buckets.append((-k_tiles * (fixed_us + per_token_us * rest_tokens), g, rest_tokens // step - 1,
                            range(full * steps_per_tile, full * steps_per_tile + 1), weight_tiles))
    # one group's buckets differ in class, hence in cost: (-cost, group) orders them all
    buckets.sort(key=lambda bucket: bucket[:2])
    return [bucket[1:] for bucket in buckets]


# Packed rows of one bucket (int32, little-endian), keyed by everything in them: a MoE step's
# groups take few distinct (group, M class, N) triples, so most of a new size set's rows are
# copies. A block is at most 4 token tiles x N / 128 weight tiles x 16 bytes (3.5 KB at
# N = 7168): 2048 of them, 7 MB at most.
@functools.lru_cache(maxsize=2048)
def _variable_token_block(group: int, token_class: int, firsts: range, weight_tiles: int) -> bytes:
    return struct.pack(f"<{4 * len(firsts) * weight_tiles}i",
                       *[v for w in range(weight_tiles) for first in firsts for v in (group, first, w, token_class)])


@functools.lru_cache(maxsize=2048)
def _whole_token_block(group: int, token_tiles: int, weight_tiles: int) -> bytes:
    return struct.pack(f"<{3 * token_tiles * weight_tiles}i",
                       *[v for tn in range(weight_tiles) for tm in range(token_tiles) for v in (group, tm, tn)])


def packed_swap_ab_tiles(problem_sizes, config: SwapAbConfig) -> bytes:
    """The swap-AB tile rows (Sm90Backend.plan_tiles' rows, in its order) packed as the
    kernel reads them (int32 rows of config.tile_row_width): joined from cached per-bucket
    blocks (a new size set's first call: EXPERIMENTS E71)."""
    if config.variable_tokens:
        return b"".join([_variable_token_block(*bucket) for bucket in variable_token_buckets(problem_sizes, config)])
    tile_tokens, tile_weights = config.tile_tokens, config.tile_weights
    return b"".join([_whole_token_block(g, -(-m // tile_tokens), -(-n // tile_weights))
                     for g, (m, n, _k, _l) in enumerate(problem_sizes) if m])


# The model picks the measured winner of these on every benchmark shape (EXPERIMENTS E32).
# 256-token tiles: slower on all four benchmark shapes (EXPERIMENTS E29).
SWAP_AB_CANDIDATES = (SWAP_AB_CONFIG, SWAP_AB_T192_CONFIG, SWAP_AB_VARIABLE_CONFIG)


def choose_swap_ab_config(problem_sizes, num_sms: int) -> SwapAbConfig:
    """The swap-AB config for a size set: split-K over 2 CTAs where the split CTAs still fit
    one per SM (2 x tiles <= SMs); else whichever of 128-token, 192-token, variable and, where
    they make one round, 112-token tiles (one CTA per SM, the dependent launch)
    swap_ab_time_model puts first (128 on a tie), 128-token tiles as one round of one CTA per
    SM, launched as the pre-pass's dependent, where they number no more than the SMs.
    112-token tiles win where M pads less in them (benchmark shape 2: 2 + 3 tiles of 112 for
    M = 192 and 320; EXPERIMENTS E12). One round of 112- or 128-token tiles runs 128-wide
    k-tiles where every K allows (with_wide_k_tiles: benchmark shapes 2 and 3)."""
    # Asked once per plan, by the chain's first link (its host cost: EXPERIMENTS E32, E60):
    # the tile counts are those of the candidates' cost runs
    runs = {SWAP_AB_CONFIG: swap_ab_cost_runs(problem_sizes, SWAP_AB_CONFIG)}
    tiles = sum([count for _cost, count in runs[SWAP_AB_CONFIG]])
    # Split-K only where the unsplit tiles leave most SMs idle: slower elsewhere (EXPERIMENTS E31).
    if 2 * tiles <= num_sms:
        return SWAP_AB_SPLIT_K_CONFIG
    candidates = SWAP_AB_CANDIDATES
    runs[SWAP_AB_T112_CONFIG] = swap_ab_cost_runs(problem_sizes, SWAP_AB_T112_CONFIG)
    if sum([count for _cost, count in runs[SWAP_AB_T112_CONFIG]]) <= num_sms:
        # a candidate only where its tiles make one round of one CTA per SM (EXPERIMENTS E12)
        candidates += (SWAP_AB_T112_CONFIG,)
    config = fastest_swap_ab_config(problem_sizes, candidates, num_sms, runs)
    if config == SWAP_AB_CONFIG and tiles <= num_sms:
        config = SWAP_AB_ONE_ROUND_CONFIG
    return with_wide_k_tiles(problem_sizes, config)


def fastest_swap_ab_config(problem_sizes, candidates, num_sms: int, known_runs=None) -> SwapAbConfig:
    """min(candidates, key=swap_ab_time_model), the first on a tie, without scheduling every
    candidate: a schedule's makespan is at least its total work over the SMs and at least
    its longest tile, so a candidate whose bound exceeds the best makespan so far cannot win
    (candidates taken by increasing bound; a new size set pays this on its call's path:
    EXPERIMENTS E67). known_runs: swap_ab_cost_runs already made, by config."""
    known_runs = known_runs or {}
    runs = [known_runs.get(config) or swap_ab_cost_runs(problem_sizes, config) for config in candidates]
    bounds = []
    for candidate_runs in runs:
        work = longest = 0.0
        for cost, count in candidate_runs:
            work += cost * count
            longest = max(longest, cost)
        bounds.append(max(work / num_sms, longest))
    best = None  # (makespan, candidate index)
    for index in sorted(range(len(candidates)), key=bounds.__getitem__):
        if best is not None and bounds[index] > best[0] * (1 + 1e-9):  # past rounding: cannot win or tie
            break
        makespan = list_schedule_makespan(runs[index], num_sms)
        if best is None or (makespan, index) < best:
            best = (makespan, index)
    return candidates[best[1]]


# One round of 112- or 128-token tiles with 128-wide k-tiles: faster (EXPERIMENTS E14).
# The time model's k-tile costs are those of 64-wide k-tiles: it chooses the tile shape, then
# this the k-tile width.
WIDE_K_TILE_CONFIGS = {
    SWAP_AB_T112_CONFIG: SWAP_AB_T112_K128_CONFIG,
    SWAP_AB_ONE_ROUND_CONFIG: SWAP_AB_ONE_ROUND_K128_CONFIG,
    SWAP_AB_T32_CONFIG: SWAP_AB_T32_K128_CONFIG,
}


def with_wide_k_tiles(problem_sizes, config: SwapAbConfig) -> SwapAbConfig:
    """`config` with 128-wide k-tiles where it has such a variant and every group's K is a
    multiple of what its unrolled main loop needs (512); else `config`."""
    wide = WIDE_K_TILE_CONFIGS.get(config)
    if wide is not None and all(k % wide.k_multiple == 0 for _m, _n, k, _l in problem_sizes):
        return wide
    return config


def tile_k_tiles(problem_sizes, tile_n: int) -> list[int]:
    """k-tiles of every TILE_M x tile_n output tile of a size set, in the tile table's order
    (group-major, as core.plan_tiles lays it out; groups with M = 0 have none)."""
    return [
        k // SM90_CONFIG.tile_k
        for m, n, k, _l in problem_sizes
        for _ in range(-(-m // TILE_M) * -(-n // tile_n))
    ]


def choose_config(problem_sizes, num_sms: int) -> HopperGemmConfig:
    """The config the default backend runs for a size set, from the sizes alone (the tile table
    is planned with the tile shape of the config chosen here), in this order:

      1. stream-K (128x128 tiles) where stream_k_pays;
      2. split-K where split_k_pays (128x128 tiles), with 128x256 tiles where
         wide_split_k_fits, else with 128x128 tiles;
      3. whole 128x128 tiles.

    On the four benchmark shapes on 132 SMs: stream-K, whole tiles, split-K with 128x256 tiles
    (shapes 2 and 3)."""
    k_tiles = tile_k_tiles(problem_sizes, SM90_CONFIG.tile_n)
    if stream_k_pays(k_tiles, num_sms):
        return STREAM_K_CONFIG
    if split_k_pays(len(k_tiles), num_sms):
        return WIDE_SPLIT_K_CONFIG if wide_split_k_fits(problem_sizes, num_sms) else SPLIT_K_CONFIG
    return SM90_CONFIG


# Split-K with 128x256 tiles: faster than 128x128 on shape 2, a tie on 3 (EXPERIMENTS E41).
def wide_split_k_fits(problem_sizes, num_sms: int) -> bool:
    """Whether split-K runs with 128x256 tiles: every N is a multiple of 256 (no partial
    tiles) and the split 128x256 CTAs (2 per tile) fit one wave of their CTA slots (one per
    SM). Where they do, the 128x128 split CTAs fit one wave too (twice the CTAs on twice the
    slots), and the wide tiles decode each A row once per 256 columns instead of per 128."""
    if any(n % 256 for _m, n, _k, _l in problem_sizes):
        return False
    num_tiles = len(tile_k_tiles(problem_sizes, WIDE_SPLIT_K_CONFIG.tile_n))
    return WIDE_SPLIT_K_CONFIG.split_k * num_tiles <= num_sms * WIDE_SPLIT_K_CONFIG.ctas_per_sm


# Tile order within the tile table (plan_tiles) does not move split-K (EXPERIMENTS E51).
def split_k_pays(num_tiles: int, num_sms: int, ctas_per_sm: int = CTAS_PER_SM) -> bool:
    """Whether split-K over 2 CTAs shortens an input set's schedule, in a wave model: whole
    tiles take ceil(T / slots) waves, half tiles ceil(2T / slots) waves half as long.

    Split when that is at most 0.8 of the unsplit time. On the benchmark shapes (352, 728,
    120, 128 tiles on 132 SMs) it picks split-K for shapes 0, 2 and 3 (1.5 vs 2, 0.5 vs 1,
    0.5 vs 1 waves) and not for shape 1 (3 vs 3). Split-K vs not: EXPERIMENTS E42."""
    slots = num_sms * ctas_per_sm
    whole_waves = -(-num_tiles // slots)
    half_waves = -(-2 * num_tiles // slots) / 2
    return half_waves <= 0.8 * whole_waves


# Shortest segment (k-tiles): a cut closer than this to a tile's first or last k-tile moves
# there, so that no worker pays a segment's fixed cost (below) for a sliver of work.
STREAM_K_MIN_SEGMENT = 4
# What a segment costs beyond its k-tiles, in k-tiles of one CTA: its pipeline fill, the
# tile lookup and the workspace round trip.
# Fitted on the H200 to the two benchmark shapes with more tiles than CTA slots (EXPERIMENTS E43).
STREAM_K_SEGMENT_COST = 3


def plan_stream_k(tile_k_tiles, max_workers: int, min_segment: int = STREAM_K_MIN_SEGMENT):
    """Cut the k-tiles of all tiles, in table order, into one contiguous share per worker, the
    shares as equal as cuts on even k-tiles allow (every k-tile costs the same, whatever rows a
    tile has: fastest so, EXPERIMENTS E43).

    Cuts fall on even k-tiles (the main loop runs k-tile pairs) and at least min_segment
    k-tiles from a tile's edges. Workers: max_workers, fewer when a share would be shorter
    than two minimal segments. Returns (work, segments, num_slots): worker w runs segments
    work[w] .. work[w + 1] - 1; a segment is (tile, first k-tile, k-tile count, part, parts,
    slot base), the parts of a tile numbered in k order; tiles of more than one part own
    workspace slots slot base .. + parts - 1 (num_slots in all)."""
    num_tiles = len(tile_k_tiles)
    total = sum(tile_k_tiles)
    num_workers = max(1, min(max_workers, total // (2 * min_segment)))
    cuts = [(0, 0)]
    tile, k_before = 0, 0  # k-tiles of the tiles before `tile`
    for w in range(1, num_workers):
        target = total * w / num_workers
        while tile < num_tiles and k_before + tile_k_tiles[tile] <= target:
            k_before += tile_k_tiles[tile]
            tile += 1
        if tile == num_tiles:
            cut = (num_tiles, 0)
        else:
            k_tiles = tile_k_tiles[tile]
            k = 2 * round((target - k_before) / 2)
            if k < min_segment:
                k = 0
            elif k_tiles - k < min_segment:
                k = k_tiles
            cut = (tile + 1, 0) if k >= k_tiles else (tile, k)
        cuts.append(max(cut, cuts[-1]))
    cuts.append((num_tiles, 0))

    worker_segments = []
    for w in range(num_workers):
        (t, k), end = cuts[w], cuts[w + 1]
        segments = []
        while (t, k) < end:
            stop = end[1] if t == end[0] else tile_k_tiles[t]
            segments.append((t, k, stop - k))
            t, k = t + 1, 0
        worker_segments.append(segments)

    parts = [0] * num_tiles
    for segments in worker_segments:
        for t, _, _ in segments:
            parts[t] += 1
    slot_base, num_slots = [0] * num_tiles, 0
    for t in range(num_tiles):
        if parts[t] > 1:
            slot_base[t] = num_slots
            num_slots += parts[t]
    work, rows, next_part = [0], [], [0] * num_tiles
    for segments in worker_segments:
        for t, k0, count in segments:
            rows.append((t, k0, count, next_part[t], parts[t], slot_base[t]))
            next_part[t] += 1
        work.append(len(rows))
    return work, rows, num_slots


@functools.lru_cache(maxsize=64)
def _cached_plan(tile_k_tiles: tuple, max_workers: int, min_segment: int):
    """plan_stream_k, once per tile set (stream_k_pays and StreamKPlan plan the same one)."""
    return plan_stream_k(tile_k_tiles, max_workers, min_segment)


def stream_k_pays(tile_k_tiles, num_sms: int, ctas_per_sm: int = CTAS_PER_SM) -> bool:
    """Whether stream-K beats the default's schedule (split-K where split_k_pays, else whole
    tiles) in a k-tile model: the default takes ceil(CTAs / slots) waves of its CTAs' k-tiles;
    stream-K, the longest share plus STREAM_K_SEGMENT_COST per segment of an average worker.
    Pick it at 0.95 of the default or less. Only input sets with more tiles than CTA slots
    qualify (fewer: split-K fills one wave; stream-K slower on both such benchmark shapes,
    EXPERIMENTS E43)."""
    slots = num_sms * ctas_per_sm
    num_tiles = len(tile_k_tiles)
    if num_tiles <= slots:
        return False
    longest = max(tile_k_tiles)
    if split_k_pays(num_tiles, num_sms, ctas_per_sm):
        default_cost = -(-2 * num_tiles // slots) * longest / 2
    else:
        default_cost = -(-num_tiles // slots) * longest
    work, segments, _ = _cached_plan(tuple(tile_k_tiles), slots, STREAM_K_MIN_SEGMENT)
    num_workers = len(work) - 1
    longest_share = max(
        sum(segments[i][2] for i in range(work[w], work[w + 1])) for w in range(num_workers)
    )
    stream_k_cost = longest_share + STREAM_K_SEGMENT_COST * len(segments) / num_workers
    return stream_k_cost <= 0.95 * default_cost


def tile_k_tiles_of(plan, config: HopperGemmConfig) -> list[int]:
    """k-tiles of every tile of the plan's tile rows (group first in each row)."""
    return [plan.problem_sizes[row[0]][2] // config.tile_k for row in plan.tile_rows]


class StreamKPlan:
    """A stream-K launch's device buffers for one plan (size set): `work` (int32: the
    num_workers + 1 offsets, then the segment rows), the fp32 workspace (one tile_m x tile_n
    slot per part of a shared tile) and one arrival counter per tile (zero between launches:
    the last part resets it). Every input set of the plan shares them; the runtime orders
    launches of the plan on different streams (Sm90Plan.shared_scratch)."""

    __slots__ = (
        "_host_staging", "_table", "counters", "num_slots", "num_workers", "segments", "work", "work_offsets",
        "workspace",
    )

    def __init__(self, plan, config: HopperGemmConfig, max_workers: int):
        tile_k_tiles = tile_k_tiles_of(plan, config)
        work_offsets, self.segments, self.num_slots = _cached_plan(
            tuple(tile_k_tiles), max_workers, STREAM_K_MIN_SEGMENT
        )
        self.work_offsets = list(work_offsets)
        self.num_workers = len(self.work_offsets) - 1

        flat = self.work_offsets + [v for row in self.segments for v in row]
        device = plan.device
        # one asynchronous copy, as for the runtime's tables (a pageable copy would wait for
        # the stream's earlier work: a miss would stall it)
        self._table, self._host_staging, (work,) = launch.upload_int_tables(device, [("i", [flat])])
        self.work = work.view(-1)
        self.workspace = torch.empty(
            max(self.num_slots, 1) * config.tile_m * config.tile_n, dtype=torch.float32, device=device
        )
        self.counters = torch.zeros(max(len(tile_k_tiles), 1), dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self._table, self.workspace, self.counters))

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for buffer in (self._table, self.workspace, self.counters):
            buffer.record_stream(stream)


