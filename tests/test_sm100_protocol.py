"""The persistent sm_100a kernel's tile list and pipeline protocol, checked on a CPU.

* The protocol: ``pipeline_model`` runs the warps of ``PersistentGemmSm100`` (TMA, MMA and
  four epilogue warps per CTA of every CTA pair) on the host's real tile list under seeded
  random schedules with arbitrarily delayed TMA and tensor-core completions, over random input
  sets, both token tiles and several SM counts: no deadlock, no phase aliasing, no buffer
  race, and every warp of a pair processes exactly the entries of that pair's slice.
* The tile lists: the persistent planner's and the per-tile planner's tiles cover every output
  element exactly once, the backend hands the kernel the list of the config it picks (or the
  per-tile list where the persistent kernel cannot run), in the order the schedule relies on.
* Negative checks: broken protocols (a stage count off by one, 4 consumer arrivals instead of
  8, a wrong start phase, a missing multicast, an early release, ...) and broken tile lists are
  reported.
"""

import dataclasses
import inspect
import random
import re
from bisect import bisect_left

import numpy as np
import pytest
from cutlass import pipeline
from pipeline_model import (
    K_TILE,
    LEADER,
    ClusterModel,
    MBarrier,
    Protocol,
    ProtocolError,
    cluster_tiles,
    kernel_rows,
    launch_clusters,
    simulate_launch,
)

from nvfp4_group_gemm import core as submission

TOKEN_TILES = (128, 256)
MMA_M = 256
PER_TILE = submission.mma_tiler_mnk[:2]
SM_COUNTS = (148, 4, 6, 16)
NUM_SETS = 304
NUM_CHUNKS = 8
# Tiles (at 128 tokens) of a set of at most 16 groups; sets over their size class's cap are
# drawn again (the model costs about 0.4 ms per tile). G, M and N still span their ranges.
MAX_TILES = 32
M_SPECIAL = (0, 1, 40, 56, 72, 200)


def _draw_m(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.35:
        return rng.choice(M_SPECIAL)
    if r < 0.7:
        m = rng.randrange(2, 300)
        return m if m % 16 else m + rng.randrange(1, 16)  # not a multiple of 16
    if r < 0.9:
        return 16 * rng.randrange(1, 33)
    return rng.randrange(1, 700)


def _draw_n(rng: random.Random, top: float) -> int:
    """A multiple of 8 in [8, min(8192, 2 ** top)], log-uniform."""
    return min(8192, max(8, round(2 ** rng.uniform(3, top) / 8) * 8))


def _count_tiles(sizes, tokens: int = 128) -> int:
    return sum(-(-m // tokens) * -(-n // MMA_M) for m, n, _k, _l in sizes)


def _draw_set(rng: random.Random) -> list[tuple[int, int, int, int]]:
    # Many groups come with narrow N (one or two N tiles each), few groups with any N
    r = rng.random()
    g, top, cap = (64, 8, 90) if r < 0.1 else (rng.randrange(17, 64), 8.5, 60) if r < 0.3 else (
        rng.randrange(1, 17), 13, MAX_TILES)
    while True:
        k = K_TILE * rng.randrange(1, 9)
        sizes = []
        for _ in range(g):
            if rng.random() < 0.3:
                k = K_TILE * rng.randrange(1, 9)  # most groups share K, some do not
            sizes.append((_draw_m(rng), _draw_n(rng, top), k, 1))
        if rng.random() < 0.03:
            sizes = [(0, n, k, l_) for _m, n, k, l_ in sizes]  # nothing to compute
        if _count_tiles(sizes) <= cap:
            return sizes


def random_sets(count: int = NUM_SETS, seed: int = 2026) -> list[tuple[list, int]]:
    """(problem sizes, SM count) of `count` seeded random input sets: G 1-64, M from a mix of
    0, 1, 40, 56, 72, 200, non-multiples of 16 and others up to 700, N multiples of 8 in
    [8, 8192], K in 256..2048."""
    rng = random.Random(seed)
    return [(_draw_set(rng), SM_COUNTS[i % len(SM_COUNTS)]) for i in range(count)]


RANDOM_SETS = random_sets()


def test_random_sets_span_the_ranges():
    sizes = [p for s, _ in RANDOM_SETS for p in s]
    ms = {m for m, _, _, _ in sizes}
    assert {0, 1, 40, 56, 72, 200} <= ms and sum(m % 16 != 0 for m in ms) > 100 and max(ms) > 600
    assert {len(s) for s, _ in RANDOM_SETS} >= {1, 64} and max(n for _, n, _, _ in sizes) > 4096
    assert {k for _, _, k, _ in sizes} == set(range(256, 2049, 256))
    assert all(n % 8 == 0 and 8 <= n <= 8192 for _, n, _, _ in sizes)
    # Some sets have no tile at all (every M = 0): the host launches nothing
    assert any(all(m == 0 for m, _, _, _ in s) for s, _ in RANDOM_SETS)
    # Pairs with many tiles (few SMs)
    per_pair = [-(-len(tiles) // launch_clusters(len(tiles), n)) for s, n in RANDOM_SETS for t in TOKEN_TILES
                if (tiles := submission.plan_persistent_tiles(s, t))]
    assert max(per_pair) >= 40 and sum(p >= 10 for p in per_pair) > 50
    # The rule picks each token tile somewhere
    assert {submission.choose_tokens_per_tile(s, n) for s, n in RANDOM_SETS} == set(TOKEN_TILES)


# =============================================================================
# Check 4: the pipeline protocol on the real tile list
# =============================================================================
def _check_launch(protocol: Protocol, rows, num_sms: int, seed: int, stats: dict) -> None:
    results = simulate_launch(protocol, rows, num_sms, seed)
    num_clusters = launch_clusters(len(rows), num_sms)
    assert len(results) == num_clusters
    processed = np.zeros(len(rows), dtype=np.int64)
    for c, result in enumerate(results):
        expected = rows[c::num_clusters]
        entries = list(range(c, len(rows), num_clusters))
        k_tiles = sum(row[3] for row in expected)
        assert expected, "every launched cluster has a tile"
        for agent, walked in result.tiles.items():
            assert walked == entries, f"{agent} of cluster {c}"
        for agent in ("cta0.tma", "cta1.tma", "cta0.mma", "cta1.mma"):
            assert result.k_tiles[agent] == k_tiles, f"{agent} of cluster {c}"
        # The one barrier left mid-phase: the leader's ab_full armed by the TMA tail's acquire
        assert len(result.leftover) == 1 and result.leftover[0].startswith("cta0.ab_full")
        processed[entries] += 1
        stats["max_tiles"] = max(stats["max_tiles"], len(entries))
        stats["full_pipeline"] += result.max_stages_ahead == protocol.num_ab_stage
        stats["wraps"] += k_tiles > 2 * protocol.num_ab_stage
    assert (processed == 1).all(), "every entry is processed by exactly one cluster"
    stats["launches"] += 1


@pytest.mark.parametrize("chunk", range(NUM_CHUNKS))
def test_protocol_model_on_random_sets(chunk):
    """No deadlock, aliasing or race, and equal per-role tile counts, for the rule's token
    tile and the other one, on every cluster of every launch."""
    protocols = {t: Protocol.from_config(submission.PERSISTENT_CONFIGS[t]) for t in TOKEN_TILES}
    stats = {"launches": 0, "max_tiles": 0, "full_pipeline": 0, "wraps": 0}
    per_chunk = -(-len(RANDOM_SETS) // NUM_CHUNKS)
    for index in range(chunk * per_chunk, min((chunk + 1) * per_chunk, len(RANDOM_SETS))):
        sizes, num_sms = RANDOM_SETS[index]
        rule = submission.choose_tokens_per_tile(sizes, num_sms)
        for tokens in (rule, *(t for t in TOKEN_TILES if t != rule)):
            rows = kernel_rows(sizes, submission.plan_persistent_tiles(sizes, tokens))
            try:
                _check_launch(protocols[tokens], rows, num_sms, index, stats)
            except ProtocolError as error:
                raise AssertionError(f"set {index} ({num_sms} SMs, {tokens} tokens): {sizes}") from error
    # The sweep reaches what the protocol is about: many tiles per pair, a full pipeline
    # and stage phases wrapped many times
    assert stats["launches"] > 60 and stats["max_tiles"] >= 12
    assert stats["full_pipeline"] > 50 and stats["wraps"] > 40


def test_protocol_model_on_benchmark_shapes():
    """The leaderboard's shapes (K trimmed to 2048 to keep it short): the rule's token tile on
    a B200's 148 SMs, every cluster."""
    shapes = [
        ([80, 176, 128, 72, 64, 248, 96, 160], 4096),
        ([40, 76, 168, 72, 164, 148, 196, 160], 7168),
        ([192, 320], 3072),
        ([128, 384], 4096),
    ]
    stats = {"launches": 0, "max_tiles": 0, "full_pipeline": 0, "wraps": 0}
    for seed, (ms, n) in enumerate(shapes):
        sizes = [(m, n, 2048, 1) for m in ms]
        tokens = submission.choose_tokens_per_tile(sizes)
        rows = kernel_rows(sizes, submission.plan_persistent_tiles(sizes, tokens))
        _check_launch(Protocol.from_config(submission.PERSISTENT_CONFIGS[tokens]), rows, 148, seed, stats)
    assert stats["launches"] == len(shapes)


def test_protocol_matches_the_configs():
    """The model's stage bytes, stages and epilogue subtiles are the configs'."""
    for tokens in TOKEN_TILES:
        config = submission.PERSISTENT_CONFIGS[tokens]
        protocol = Protocol.from_config(config)
        assert protocol.stage_bytes == config.ab_stage_bytes == submission.persistent_stage_bytes(tokens)
        assert protocol.expect_tx == 2 * config.ab_stage_bytes
        assert (protocol.num_ab_stage, protocol.num_acc_stage) == (config.num_ab_stage, config.num_acc_stage)
        assert protocol.epilogue_subtiles == tokens // 32
    assert [Protocol.from_config(submission.PERSISTENT_CONFIGS[t]).num_ab_stage for t in TOKEN_TILES] == [7, 5]


def _code(obj) -> str:
    """Source without comments and whitespace."""
    return "".join(re.sub(r"#[^\n]*", "", inspect.getsource(obj)).split())


# What the model takes from the kernel, as the kernel's code states it (whitespace removed)
KERNEL_PROTOCOL = [
    # warps walk rows cluster_idx, + num_clusters, ...; the even CTA of a pair leads
    "mma_tile_coord_v=bidx%2", "is_leader_cta=mma_tile_coord_v==0", "cluster_idx=bidx//2",
    "num_clusters=grid_dim_x//2", "tile_idx=cluster_idx",
    # each role walks the count _tile_count gives after its wait (the launch argument here; the
    # MoE subclass's count from device memory)
    "tma_num_tiles=self._tile_count(tensor_of_tiles,num_tiles)",
    "mma_num_tiles=self._tile_count(tensor_of_tiles,num_tiles)",
    "epi_num_tiles=self._tile_count(tensor_of_tiles,num_tiles)",
    "tile_idx=self._next_tile(tensor_of_tiles,tile_row,tile_idx,tma_num_tiles,num_clusters)",
    "tile_idx=self._next_tile(tensor_of_tiles,tile_row,tile_idx,mma_num_tiles,num_clusters)",
    "tile_idx=self._next_tile(tensor_of_tiles,tile_row,tile_idx,epi_num_tiles,num_clusters)",
    # ab_full: one arrival plus both CTAs' bytes; ab_empty: one arrival (1 + 1 - 1 multicast
    # CTAs of a (2, 1) cluster), the MMA warp's commit to both CTAs
    ("producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),consumer_group=pipeline.CooperativeGroup("
     "pipeline.Agent.Thread,self.num_mcast_ctas_a+self.num_mcast_ctas_b-1),tx_count=self.num_tma_load_bytes"),
    # acc_empty: one arrival per epilogue warp of both CTAs
    "consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,len(self.epilog_warp_id)*2)",
    "ab_pipeline.producer_acquire(ab_producer_state,peek_ab_empty_status)",
    "ab_pipeline.consumer_wait(ab_consumer_state,peek_ab_full_status)",
    "ab_pipeline.consumer_release(ab_consumer_state)",
    "ifis_leader_cta:acc_pipeline.producer_acquire(acc_producer_state)",
    "ifis_leader_cta:acc_pipeline.producer_commit(acc_producer_state)",
    "acc_pipeline.consumer_wait(acc_consumer_state)",
    # the release: once per warp, after the last subtile's TMEM load
    "ifsubtile_idx==subtile_cnt-1:",
    "withcute.arch.elect_one():acc_pipeline.consumer_release(acc_consumer_state)",
    "self.epilog_sync_barrier.arrive_and_wait()ifwarp_idx==self.epilog_warp_id[0]:",
    "c_pipeline.producer_commit()c_pipeline.producer_acquire()self.epilog_sync_barrier.arrive_and_wait()",
    "ab_pipeline.producer_tail(ab_producer_state)", "acc_pipeline.producer_tail(acc_producer_state)",
    # TMEM: each CTA's first epilogue warp arrives (32 threads) at its peer, waits for its own
    "cute.arch.mbarrier_init(tmem_dealloc_mbar_ptr,32)",
    "cute.arch.mbarrier_arrive(tmem_dealloc_mbar_ptr,cta_rank_in_cluster^1)",
    "cute.arch.mbarrier_wait(tmem_dealloc_mbar_ptr,0)",
]
# What the model takes from the DSL's pipelines
DSL_PROTOCOL = [
    # producers start at phase 1, consumers at 0
    (pipeline.make_pipeline_state, "Int32(0,loc=loc,ip=ip),Int32(1,loc=loc,ip=ip),)elif"),
    # only the leader arms ab_full, after the (skippable) wait on ab_empty
    (pipeline.PipelineTmaUmma.producer_acquire,
     ("lambda:self.sync_object_empty.wait(state.index,state.phase),)if_generate(self.is_leader_cta,"
      "lambda:self.sync_object_full.arrive(state.index,self.producer_mask),)")),
    # tails: num_stages - 1 advances, then one acquire (the accumulator's on the leader only)
    (pipeline.PipelineAsync.producer_tail, "foriinrange(self.num_stages-1):state.advance()self.producer_acquire(state)"),
    (pipeline.PipelineUmmaAsync.producer_tail,
     "ifis_leader_cta:foriincutlass.range_constexpr(self.num_stages-1):state.advance()self.producer_acquire(state)"),
]


def test_model_assumptions_are_the_kernels():
    """The protocol the model runs is the kernel's: if one of these lines changes, the model
    (pipeline_model.py) has to follow it."""
    kernel = submission.PersistentGemmSm100(submission.PERSISTENT_CONFIGS[128])
    assert (kernel.epilog_warp_id, kernel.mma_warp_id, kernel.tma_warp_id) == ((0, 1, 2, 3), 4, 5)
    assert kernel.cluster_shape_mn == (2, 1)
    code = _code(submission.PersistentGemmSm100.kernel)
    assert [line for line in KERNEL_PROTOCOL if line not in code] == []
    assert [line for fn, line in DSL_PROTOCOL if line not in _code(fn)] == []
    # the one tile walk every role takes
    assert "tile_idx+=num_clusters" in _code(submission.PersistentGemmSm100._next_tile)
    assert code.count("self._next_tile(") == 3 and code.count("self._first_tile(") == 3


def test_mbarrier_follows_ptx():
    """Parity waits, transaction bytes landing before the arrival, and the reports."""
    barrier = MBarrier("b", 0, 1, [])
    assert barrier.parity_passes(1) and not barrier.parity_passes(0)  # producer / consumer start
    barrier.complete_tx(100)  # the peer's bytes before the leader's arrive.expect_tx
    assert barrier.tx == -100 and barrier.completed == 0
    barrier.arrive(1, 300)
    assert barrier.completed == 0 and barrier.pending == 0 and barrier.tx == 200
    barrier.complete_tx(200)
    assert barrier.completed == 1 and barrier.pending == 1 and barrier.parity_passes(0)
    with pytest.raises(ProtocolError, match="overflow"):
        MBarrier("c", 0, 2, []).arrive(3)
    watched = MBarrier("d", 0, 1, [])
    watched.observed["waiter"] = 0
    watched.arrive()
    with pytest.raises(ProtocolError, match="aliasing: d completed phase 1 before waiter observed phase 0"):
        watched.arrive()


# Negative checks: one workload with many k-tiles per pair (both clusters wrap every stage
# several times), one broken rule at a time
NEGATIVE_SIZES = [(200, 512, 2048, 1), (72, 256, 2048, 1), (1, 1024, 256, 1), (300, 256, 1024, 1)]
NEGATIVE_SEEDS = range(12)


def _negative_tiles(tokens: int) -> list[tuple[int, int]]:
    rows = kernel_rows(NEGATIVE_SIZES, submission.plan_persistent_tiles(NEGATIVE_SIZES, tokens))
    return cluster_tiles(rows, launch_clusters(len(rows), 2), 0)  # one pair takes every row


def _outcomes(protocol: Protocol, tokens: int) -> list[str]:
    """Per seed: 'ok' or the kind of ProtocolError."""
    outcomes = []
    for seed in NEGATIVE_SEEDS:
        try:
            ClusterModel(protocol, _negative_tiles(tokens), seed).run()
            outcomes.append("ok")
        except ProtocolError as error:
            outcomes.append(error.kind)
    return outcomes


def test_negative_workload_exercises_the_protocol():
    for tokens in TOKEN_TILES:
        protocol = Protocol.from_config(submission.PERSISTENT_CONFIGS[tokens])
        tiles = _negative_tiles(tokens)
        assert len(tiles) >= 4 and sum(k for _, k in tiles) > 3 * protocol.num_ab_stage
        assert _outcomes(protocol, tokens) == ["ok"] * len(NEGATIVE_SEEDS)


def _broken(tokens: int, **change) -> Protocol:
    return dataclasses.replace(Protocol.from_config(submission.PERSISTENT_CONFIGS[tokens]), **change)


S128 = submission.PERSISTENT_CONFIGS[128].num_ab_stage
S256 = submission.PERSISTENT_CONFIGS[256].num_ab_stage
S256_BYTES = submission.PERSISTENT_CONFIGS[256].ab_stage_bytes

# (what is broken, tokens per tile, the change, the reports allowed): every seed must report
BROKEN_PROTOCOLS = [
    ("4 epilogue arrivals release an accumulator instead of 8", 128, {"acc_empty_count": 4}, {"aliasing", "race"}),
    ("4 epilogue arrivals release the one accumulator", 256, {"acc_empty_count": 4}, {"aliasing", "race"}),
    ("acc_empty expects 16 arrivals", 128, {"acc_empty_count": 16}, {"deadlock"}),
    ("ab_empty expects 2 arrivals", 256, {"ab_empty_count": 2}, {"deadlock"}),
    ("TMA warps wrap at one stage less", 128, {"tma_stages": S128 - 1}, {"deadlock", "race", "aliasing"}),
    ("MMA warp wraps at one stage less", 256, {"mma_stages": S256 - 1}, {"deadlock", "race", "aliasing"}),
    ("TMA warps wrap at one stage more", 128, {"tma_stages": S128 + 1}, {"overflow"}),
    ("TMA producer starts at phase 0", 128, {"ab_producer_phase": 0}, {"deadlock"}),
    ("MMA consumer starts at phase 1", 256, {"ab_consumer_phase": 1}, {"aliasing", "deadlock"}),
    ("accumulator producer starts at phase 0", 128, {"acc_producer_phase": 0}, {"deadlock"}),
    ("epilogue consumer starts at phase 1", 128, {"acc_consumer_phase": 1}, {"aliasing", "race", "deadlock"}),
    ("stage release not multicast to the peer", 128, {"ab_release_ctas": (LEADER,)}, {"deadlock"}),
    ("accumulator commit not multicast to the peer", 256, {"acc_full_ctas": (LEADER,)}, {"deadlock"}),
    ("peer TMA warp refills stages without waiting", 128, {"peer_tma_waits_empty": False}, {"race", "deadlock"}),
    ("epilogue releases the accumulator before reading it", 128, {"acc_release_subtile": 0}, {"race"}),
    ("ab_full expects one CTA's bytes", 256, {"ab_full_expect_tx": S256_BYTES}, {"race", "deadlock"}),
    ("TMEM dealloc barrier counts 64", 256, {"tmem_dealloc_count": 64}, {"deadlock"}),
]


@pytest.mark.parametrize("what, tokens, change, kinds", BROKEN_PROTOCOLS, ids=[c[0] for c in BROKEN_PROTOCOLS])
def test_broken_protocol_is_reported(what, tokens, change, kinds):
    outcomes = _outcomes(_broken(tokens, **change), tokens)
    assert set(outcomes) <= kinds, f"{what}: {outcomes}"


# =============================================================================
# Check 5: the tile lists cover every output element exactly once
# =============================================================================
def coverage_problems(problem_sizes, tiles, rows: int, cols: int, row_field: int, col_field: int) -> list[str]:
    """Problems of a tile list whose entry (g, ...) covers problem rows [i * rows, +rows) and
    columns [j * cols, +cols) of group g (i = entry[row_field], j = entry[col_field]), clipped
    to M x N: elements covered zero or several times, tiles outside the problem.

    Exact and cheap for any size: the rows and columns are cut at every tile edge, and every
    cell of that grid is either inside a tile or not; the counts live per cell."""
    problems = []
    by_group: dict[int, list] = {g: [] for g in range(len(problem_sizes))}
    for entry in tiles:
        by_group[entry[0]].append((entry[row_field], entry[col_field]))
    for g, (m, n, _k, _l) in enumerate(problem_sizes):
        rects = []
        for i, j in by_group[g]:
            r0, c0 = i * rows, j * cols
            if i < 0 or j < 0 or r0 >= m or c0 >= n:
                problems.append(f"group {g}: tile ({i}, {j}) outside {m} x {n}")
                continue
            rects.append((r0, min(r0 + rows, m), c0, min(c0 + cols, n)))
        if m == 0:
            continue
        row_cuts = sorted({0, m, *(r for r0, r1, _, _ in rects for r in (r0, r1))})
        col_cuts = sorted({0, n, *(c for _, _, c0, c1 in rects for c in (c0, c1))})
        counts = np.zeros((len(row_cuts) - 1, len(col_cuts) - 1), dtype=np.int64)
        for r0, r1, c0, c1 in rects:
            counts[bisect_left(row_cuts, r0):bisect_left(row_cuts, r1),
                   bisect_left(col_cuts, c0):bisect_left(col_cuts, c1)] += 1
        if not (counts == 1).all():
            holes = int((counts == 0).sum())
            overlaps = int((counts > 1).sum())
            problems.append(f"group {g} ({m} x {n}): {holes} uncovered cells, {overlaps} covered twice or more")
    return problems


def literal_coverage(problem_sizes, tiles, rows, cols, row_field, col_field) -> list[np.ndarray]:
    """Per group, how often each output element is covered (element by element)."""
    counts = [np.zeros((m, n), dtype=np.int64) for m, n, _k, _l in problem_sizes]
    for entry in tiles:
        i, j = entry[row_field], entry[col_field]
        counts[entry[0]][i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] += 1
    return counts


def persistent_problems(sizes, tiles, tokens):
    # (g, N tile, token tile): token rows of M by the token tile, N by the MMA's 256
    return coverage_problems(sizes, tiles, tokens, MMA_M, row_field=2, col_field=1)


def per_tile_problems(sizes, tiles):
    return coverage_problems(sizes, tiles, PER_TILE[0], PER_TILE[1], row_field=1, col_field=2)


def order_problems(sizes, tiles) -> list[str]:
    """The persistent list's order: groups by descending M (ties by index), a group's entries
    contiguous, by N tile then token tile, so a group's N slices are contiguous."""
    problems = []
    groups = [g for index, (g, _, _) in enumerate(tiles) if index == 0 or tiles[index - 1][0] != g]
    if len(groups) != len(set(groups)):
        problems.append("a group's entries are not contiguous")
    keys = [(-sizes[g][0], g) for g in groups]
    if keys != sorted(keys):
        problems.append("groups not in descending M")
    for g in dict.fromkeys(groups):
        own = [(nt, mt) for gg, nt, mt in tiles if gg == g]
        if own != sorted(own):
            problems.append(f"group {g}: N tiles not contiguous")
    return problems


@pytest.mark.parametrize("chunk", range(2))
def test_tile_lists_cover_every_output_element_once(chunk):
    for index in range(chunk, len(RANDOM_SETS), 2):
        sizes, num_sms = RANDOM_SETS[index]
        for tokens in TOKEN_TILES:
            tiles = submission.plan_persistent_tiles(sizes, tokens)
            assert persistent_problems(sizes, tiles, tokens) == [], (index, tokens, sizes)
            assert order_problems(sizes, tiles) == [], (index, tokens, sizes)
            assert not [t for t in tiles if sizes[t[0]][0] == 0], "M = 0 groups have no tiles"
        per_tile = submission.plan_tiles(sizes, *PER_TILE)
        assert per_tile_problems(sizes, per_tile) == [], (index, sizes)
        assert not [t for t in per_tile if sizes[t[0]][0] == 0]
        backend = submission.Sm100Backend("persistent", num_sms=num_sms)
        rule = submission.choose_tokens_per_tile(sizes, num_sms)
        assert backend.kernel_chain(sizes)[0].config is submission.PERSISTENT_CONFIGS[rule]
        # The kernel's rows: the planner's entries with their group's k-tile count
        assert backend.plan_tiles(sizes) == kernel_rows(sizes, submission.plan_persistent_tiles(sizes, rule, MMA_M))


def test_fallback_sets_get_the_per_tile_list():
    """Sets with an N that is not a multiple of 8 (in a group with rows) run the per-tile
    kernel: the backend's list is the per-tile planner's, and it covers every element once."""
    rng = random.Random(7)
    checked = 0
    for sizes, num_sms in RANDOM_SETS[:120]:
        sizes = list(sizes)
        g = rng.randrange(len(sizes))
        m, n, k, l_ = sizes[g]
        m = m or 1 + rng.randrange(300)  # the group needs rows for its N to matter
        n = n + rng.randrange(1, 8) if n < 8192 else n - rng.randrange(1, 8)  # not a multiple of 8
        sizes[g] = (m, n, k, l_)
        assert submission.persistent_can_implement(sizes) is not None
        backend = submission.Sm100Backend("persistent", num_sms=num_sms)
        # the per-tile kernel chained, then unchained (SM100_CHAIN_CALLS, the default), then scaled_mm
        assert [c.name for c in backend.kernel_chain(sizes)] == ["per_tile", "per_tile", "scaled_mm"]
        tiles = backend.plan_tiles(sizes)
        assert tiles == submission.plan_tiles(sizes, *PER_TILE)
        assert submission.Sm100Backend("per_tile", num_sms=num_sms).plan_tiles(sizes) == tiles
        assert per_tile_problems(sizes, tiles) == [], sizes
        checked += 1
    assert checked == 120


def test_coverage_check_agrees_with_an_element_count():
    """The cut-grid count gives the same verdict as counting every element, and it reports
    holes, overlaps and tiles outside the problem."""
    rng = random.Random(11)
    for _ in range(60):
        sizes = [(rng.choice((0, 1, 40, 130, 257)), 8 * rng.randrange(1, 80), 256, 1)
                 for _ in range(rng.randrange(1, 5))]
        for tokens in TOKEN_TILES:
            good = submission.plan_persistent_tiles(sizes, tokens)
            variants = [good]
            if good:
                drop = list(good)
                del drop[rng.randrange(len(drop))]
                dup = [*good, good[rng.randrange(len(good))]]
                variants += [drop, dup]
            for tiles in variants:
                counts = literal_coverage(sizes, tiles, tokens, MMA_M, 2, 1)
                exact = all((c == 1).all() for c in counts)
                assert (persistent_problems(sizes, tiles, tokens) == []) == exact
    sizes = [(129, 300, 256, 1)]
    assert persistent_problems(sizes, [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (0, 1, 2)], 128) == [
        "group 0: tile (2, 1) outside 129 x 300"
    ]


def _floor_planner(sizes, tokens):
    """A planner that forgets the last partial token tile."""
    order = sorted(range(len(sizes)), key=lambda g: (-sizes[g][0], g))
    return [(g, nt, mt) for g in order for nt in range(-(-sizes[g][1] // MMA_M)) for mt in range(sizes[g][0] // tokens)]


def _group_order_planner(sizes, tokens):
    """The right tiles in group-index order."""
    tiles = submission.plan_persistent_tiles(sizes, tokens)
    return sorted(tiles)


def _interleaved_planner(sizes, tokens):
    """The right tiles with a group's N slices split (token tile before N tile)."""
    tiles = submission.plan_persistent_tiles(sizes, tokens)
    order = sorted(range(len(sizes)), key=lambda g: (-sizes[g][0], g))
    return sorted(tiles, key=lambda t: (order.index(t[0]), t[2], t[1]))


def test_broken_tile_lists_are_reported():
    sizes = [(129, 300, 256, 1), (40, 520, 512, 1), (0, 64, 256, 1), (300, 8, 256, 1), (257, 1000, 256, 1)]
    tiles = submission.plan_persistent_tiles(sizes, 128)
    assert persistent_problems(sizes, tiles, 128) == [] and order_problems(sizes, tiles) == []
    assert persistent_problems(sizes, tiles[:-1], 128)
    assert persistent_problems(sizes, [*tiles, tiles[0]], 128)
    assert persistent_problems(sizes, _floor_planner(sizes, 128), 128)
    # The 256-token list read as 128-token tiles leaves holes
    assert persistent_problems(sizes, submission.plan_persistent_tiles(sizes, 256), 128)
    assert persistent_problems(sizes, [*tiles, (2, 0, 0)], 128) == ["group 2: tile (0, 0) outside 0 x 64"]
    # The right tiles in another order
    assert persistent_problems(sizes, _group_order_planner(sizes, 128), 128) == []
    assert order_problems(sizes, _group_order_planner(sizes, 128)) == ["groups not in descending M"]
    assert order_problems(sizes, _interleaved_planner(sizes, 128)) == [
        "group 4: N tiles not contiguous", "group 0: N tiles not contiguous"
    ]
    # Per-tile lists: the per-tile planner read with swapped fields leaves holes
    per_tile = submission.plan_tiles(sizes, *PER_TILE)
    assert per_tile_problems(sizes, per_tile) == []
    assert per_tile_problems(sizes, [(g, j, i) for g, i, j in per_tile])
