"""The MoE entry's sm_100a kernels (nvfp4_group_gemm.sm100_moe), checked without a B200.

  * A pure-Python emulation of the tables + repack kernel, step for step as its device code
    computes (two groups a lane, the vote, the shuffle-up scans, the rank sort, the binary
    searches): for random offsets (empty groups, one group holding every row, rows before
    offsets[0] and after offsets[G]) its tile rows are the leaderboard file's own
    plan_persistent_tiles rows and cover every (group, token, N tile) exactly once within the
    table's capacity; every repacked scale lands where the blocked formula puts it, inside
    the scratch, and each group's region equals moe.blocked_scales of its rows; bad offsets
    give count 0, status 1, every size 0 and no repack write.
  * The kernels compiled for sm_100a (cubin and PTX kept): resources, and from the PTX's
    control flow (build_report.ptx_flow) that every global access follows the wait, and that
    the GEMM's count load in each warp role comes after that role's griddepcontrol.wait.
  * The host side: the launch sequence's grids and buffers, the build report's targets, the
    leaderboard file's hook.
Nothing here runs a kernel (no B200).
"""

import dataclasses
import random
import re

import pytest

cutlass = pytest.importorskip("cutlass", reason="needs the CuTe DSL (nvidia-cutlass-dsl)")
sm100_moe = pytest.importorskip("nvfp4_group_gemm.sm100_moe", reason="needs the CuTe DSL")

import build_report
from build_report import ptx_flow, ptx_is_global
from nvfp4_group_gemm import core as submission

CONFIGS = submission.PERSISTENT_CONFIGS
K_TILE = 256


# ----------------------------------------------------------------------------- the emulation
def _shfl_up_inclusive_sum(values: list[int]) -> list[int]:
    """warp_inclusive_sum over 32 lanes: shfl.up with clamp 0 gives a lane below the offset its
    own value, which the lane then does not add."""
    values = list(values)
    for shift in range(5):
        offset = 1 << shift
        shuffled = [values[lane - offset] if lane >= offset else values[lane] for lane in range(32)]
        values = [values[lane] + shuffled[lane] if lane >= offset else values[lane] for lane in range(32)]
    return values


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def _last_at_most(sorted_values: list[int], num: int, value: int) -> int:
    """The kernels' binary search: the last position p < num with sorted_values[p] <= value
    (position 0 when none), in SEARCH_STEPS."""
    position = 0
    for step in sm100_moe.SEARCH_STEPS:
        probe = position + step
        if probe < num and sorted_values[probe] <= value:
            position = probe
    return position


def emulate_tables(offsets: list[int], tokens: int, n: int, k: int, tokens_per_tile: int, capacity=None):
    """What the tables + repack kernel writes for these offsets, as its device code computes it.
    Pointers are byte offsets from each operand's base; repack maps (row, scale block) to the
    scratch byte it is written to. `capacity`: a table smaller than max_moe_tiles (a broken
    bound, to see what the kernel does then)."""
    groups = len(offsets) - 1
    max_tiles = sm100_moe.max_moe_tiles(tokens, groups, n, tokens_per_tile) if capacity is None else capacity
    # warp 0: lane l holds groups 2l and 2l + 1
    lanes = []
    for lane in range(32):
        g0, g1 = 2 * lane, 2 * lane + 1
        has0, has1 = g0 < groups, g1 < groups
        lo0 = offsets[g0] if has0 else 0
        hi0 = offsets[g0 + 1] if has0 else 0
        hi1 = offsets[g1 + 1] if has1 else hi0
        lanes.append((g0, g1, has0, has1, lo0, hi0, hi1))
    first, last = offsets[0], offsets[groups]
    bad = any(hi0 < lo0 or hi1 < hi0 or first < 0 or last > tokens for _, _, _, _, lo0, hi0, hi1 in lanes)
    m = {}
    low = {}
    pairs = []
    for g0, g1, has0, has1, lo0, hi0, hi1 in lanes:
        m0, m1 = (0, 0) if bad else (hi0 - lo0, hi1 - hi0)
        pairs.append((_round_up(m0, 128), _round_up(m0, 128) + _round_up(m1, 128)))
        if has0:
            m[g0], low[g0] = m0, lo0
        if has1:
            m[g1], low[g1] = m1, hi0
    inclusive = _shfl_up_inclusive_sum([pair for _, pair in pairs])
    padded = {}
    for lane, (padded0, pair) in enumerate(pairs):
        for g, value in ((2 * lane, inclusive[lane] - pair), (2 * lane + 1, inclusive[lane] - pair + padded0)):
            if g < groups:
                padded[g] = value
    # CTA 0: ranks, sorted first tiles, count
    n_tiles = sm100_moe.mma_m_tiles(n)
    tiles_of = {g: -(-m[g] // tokens_per_tile) * n_tiles for g in range(groups)}
    rank = {g: sum(1 for o in range(groups) if m[o] > m[g] or (m[o] == m[g] and o < g)) for g in range(groups)}
    assert sorted(rank.values()) == list(range(groups)), "ranks are a permutation"
    sorted_group = [None] * groups
    for g, r in rank.items():
        sorted_group[r] = g
    sorted_tiles = [tiles_of[g] for g in sorted_group] + [0] * (64 - groups)
    pair_sums = [sorted_tiles[2 * lane] + sorted_tiles[2 * lane + 1] for lane in range(32)]
    inclusive = _shfl_up_inclusive_sum(pair_sums)
    sorted_first = []
    for lane in range(32):
        sorted_first += [inclusive[lane] - pair_sums[lane], inclusive[lane] - pair_sums[lane] + sorted_tiles[2 * lane]]
    dropped = inclusive[31] > max_tiles
    count = min(inclusive[31], max_tiles)
    ptrs, sizes = {}, {}
    for g in range(groups):
        ptrs[g] = {
            "a": low[g] * (k // 2),
            "b": g * n * (k // 2),
            "c": low[g] * n * 2,
            "sfa": padded[g] * (k // 16),
            "sfb": g * n * (k // 16),
        }
        sizes[g] = (m[g], n, k, 1)
    rows = []
    for tile in range(count):
        position = _last_at_most(sorted_first, groups, tile)
        group = sorted_group[position]
        local = tile - sorted_first[position]
        token_tiles = -(-m[group] // tokens_per_tile)
        rows.append((group, local // token_tiles, local % token_tiles, k // K_TILE))
    # CTAs >= 1: one 16-byte unit of a plain row per thread
    repack = {}
    units_per_row = k // 256
    threads = sm100_moe.moe_repack_ctas(tokens, k) * sm100_moe.TABLES_THREADS
    for unit in range(threads):
        row, unit_in_row = divmod(unit, units_per_row)
        if bad or not offsets[0] <= row < offsets[groups]:
            continue
        group = _last_at_most(offsets, groups, row)
        padded_row = padded[group] + row - offsets[group]
        in_atom = (padded_row % 32) * 4 + (padded_row % 128) // 32
        band_atom = padded_row // 128 * (k // 64) + unit_in_row * 4
        for i in range(4):
            word = (band_atom + i) * 128 + in_atom
            for byte in range(4):
                repack[(row, 16 * unit_in_row + 4 * i + byte)] = 4 * word + byte
    return {
        "bad": bad, "count": count, "rows": rows, "ptrs": ptrs, "sizes": sizes, "padded": padded,
        "repack": repack, "max_tiles": max_tiles, "status": 1 if bad else 2 if dropped else 0,
    }


def random_offsets(rng: random.Random, tokens: int, groups: int, kind: str) -> list[int]:
    """offsets of `groups` groups within `tokens` rows: "random" (empty groups likely, rows
    before the first and after the last group), "one" (one group holds every row), "empty"
    (no rows at all), "full" (every row in some group)."""
    if kind == "one":
        owner = rng.randrange(groups)
        return [0] * (owner + 1) + [tokens] * (groups - owner)
    if kind == "empty":
        start = rng.randrange(tokens + 1)
        return [start] * (groups + 1)
    cuts = sorted(rng.randrange(tokens + 1) for _ in range(groups + 1))
    if kind == "full":
        cuts[0], cuts[-1] = 0, tokens
    return cuts


CASES = [
    # (T, G, N, K)
    (1, 1, 128, 256),
    (40, 8, 4096, 7168),
    (300, 3, 384, 512),
    (512, 2, 7168, 2048),
    (1000, 64, 256, 256),
    (4096, 17, 2304, 1536),
]


@pytest.mark.parametrize("tokens_per_tile", sorted(CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}_G{}_N{}_K{}".format(*c))
def test_tile_rows_are_plan_persistent_tiles_and_cover_every_output_once(case, tokens_per_tile):
    tokens, groups, n, k = case
    rng = random.Random(hash((case, tokens_per_tile)) & 0xFFFF)
    for kind in ("random", "random", "random", "one", "empty", "full"):
        offsets = random_offsets(rng, tokens, groups, kind)
        out = emulate_tables(offsets, tokens, n, k, tokens_per_tile)
        sizes = [(offsets[g + 1] - offsets[g], n, k, 1) for g in range(groups)]
        expected = [(g, n_tile, m_tile, k // K_TILE)
                    for g, n_tile, m_tile in submission.plan_persistent_tiles(sizes, tokens_per_tile)]
        where = f"{case=}, {tokens_per_tile=}, {kind=}, {offsets=}"
        assert not out["bad"] and out["status"] == 0, where
        assert out["rows"] == expected, where
        assert out["count"] == len(expected) <= out["max_tiles"], where
        assert out["sizes"] == {g: size for g, size in enumerate(sizes)}, where
        # every (group, token, 128-row N block) exactly once
        covered = {}
        for group, n_tile, m_tile, _k_tiles in out["rows"]:
            for token in range(m_tile * tokens_per_tile, min((m_tile + 1) * tokens_per_tile, sizes[group][0])):
                for n_block in range(2 * n_tile, min(2 * n_tile + 2, n // 128)):
                    key = (group, token, n_block)
                    covered[key] = covered.get(key, 0) + 1
        wanted = {(g, t, b) for g in range(groups) for t in range(sizes[g][0]) for b in range(n // 128)}
        assert set(covered) == wanted and set(covered.values()) <= {1}, where
        # operand pointers: the group's rows of a and c, its weights and their scales
        for g in range(groups):
            assert out["ptrs"][g]["a"] == offsets[g] * k // 2 and out["ptrs"][g]["c"] == offsets[g] * n * 2, where
            assert out["ptrs"][g]["b"] == g * n * k // 2 and out["ptrs"][g]["sfb"] == g * n * k // 16, where


def test_the_capacity_is_reached_by_some_offsets():
    """max_moe_tiles is tight: every group one row past a multiple of the tile."""
    tokens, n, k, t = 8 * 129, 512, 256, 128
    offsets = list(range(0, tokens + 1, 129))
    out = emulate_tables(offsets, tokens, n, k, t)
    assert out["count"] == out["max_tiles"] == 8 * 2 * 2


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}_G{}_N{}_K{}".format(*c))
def test_repacked_scales_follow_the_blocked_formula_inside_the_scratch(case):
    tokens, groups, n, k = case
    rng = random.Random(sum(case))
    capacity = sm100_moe.moe_scale_scratch_rows(tokens, groups) * (k // 16)
    for kind in ("random", "one", "full"):
        offsets = random_offsets(rng, tokens, groups, kind)
        out = emulate_tables(offsets, tokens, n, k, 128)
        where = f"{case=}, {kind=}, {offsets=}"
        # every scale of every group row once, nothing else
        wanted = {(row, block) for row in range(offsets[0], offsets[groups]) for block in range(k // 16)}
        assert set(out["repack"]) == wanted, where
        for (row, block), byte in out["repack"].items():
            g = max(g for g in range(groups) if offsets[g] <= row < offsets[g + 1])
            assert byte == out["ptrs"][g]["sfa"] + sm100_moe.blocked_scale_offset(row - offsets[g], block, k), where
        assert len(set(out["repack"].values())) == len(out["repack"]), where
        # each group's region (its padded rows) inside the scratch, 2048-byte aligned, disjoint
        regions = sorted((out["ptrs"][g]["sfa"], _round_up(offsets[g + 1] - offsets[g], 128) * k // 16)
                         for g in range(groups))
        for (start, size), (next_start, _) in zip(regions, regions[1:] + [(capacity, 0)]):
            assert start % 2048 == 0 and start + size <= next_start <= capacity, where


def test_repacked_regions_equal_blocked_scales_of_each_groups_rows():
    """Against the project's own layout function: group g's region of the scratch is
    moe.blocked_scales of sfa's rows offsets[g] .. offsets[g + 1] (padding rows zero on both
    sides: the kernel leaves them as they were, zero here)."""
    torch = pytest.importorskip("torch")
    from nvfp4_group_gemm import moe

    tokens, groups, k = 700, 5, 512
    offsets = [3, 3, 200, 201, 650, 690]
    plain = torch.randint(0, 256, (tokens, k // 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = emulate_tables(offsets, tokens, 128, k, 128)
    scratch = torch.zeros(sm100_moe.moe_scale_scratch_rows(tokens, groups) * (k // 16), dtype=torch.uint8)
    rows, blocks = zip(*out["repack"])
    scratch[torch.tensor(list(out["repack"].values()))] = plain[torch.tensor(rows), torch.tensor(blocks)]
    for g in range(groups):
        m = offsets[g + 1] - offsets[g]
        if m == 0:
            continue
        expected = moe.blocked_scales(plain[offsets[g]:offsets[g + 1]]).reshape(-1)
        start = out["ptrs"][g]["sfa"]
        assert torch.equal(scratch[start:start + expected.numel()], expected), f"group {g}"


@pytest.mark.parametrize("offsets, why", [
    ([0, 5, 4, 9], "decreasing"),
    ([-1, 5, 6, 9], "negative first"),
    ([0, 5, 6, 11], "last past T"),
    ([3, 2, 2, 2], "first past the second"),
])
def test_bad_offsets_write_no_tile_no_size_no_scale_and_status_1(offsets, why):
    out = emulate_tables(offsets, 10, 256, 256, 128)
    assert out["bad"] and out["status"] == 1, why
    assert out["count"] == 0 and out["rows"] == [] and out["repack"] == {}, why
    assert all(size[0] == 0 for size in out["sizes"].values()), why  # the init kernel skips M = 0


def test_a_table_too_small_for_the_tiles_says_so_in_the_status():
    """The kernel clamps the tile count to the table's capacity (never writing past it) and sets
    status 2: tiles were dropped, which check_status reports."""
    offsets = [0, 100, 300, 300, 512]
    full = emulate_tables(offsets, 512, 512, 256, 128)
    assert full["status"] == 0 and full["count"] > 3
    short = emulate_tables(offsets, 512, 512, 256, 128, capacity=3)
    assert short["status"] == 2 and short["count"] == 3 and short["rows"] == full["rows"][:3]
    import torch

    from nvfp4_group_gemm import moe

    with pytest.raises(ValueError, match=r"status 2, sm_100 version\): some of c was not computed"):
        moe.check_status(torch.tensor([2], dtype=torch.int32))


def test_the_scan_helper_is_an_inclusive_prefix_sum():
    rng = random.Random(3)
    for _ in range(20):
        values = [rng.randrange(0, 1000) for _ in range(32)]
        expected = [sum(values[:lane + 1]) for lane in range(32)]
        assert _shfl_up_inclusive_sum(values) == expected


def test_the_binary_search_finds_the_last_entry_at_most_the_value():
    rng = random.Random(4)
    for _ in range(200):
        num = rng.randrange(1, 65)
        values = sorted(rng.randrange(0, 50) for _ in range(num)) + [10**6] * (64 - num)
        value = rng.randrange(values[0], 60)
        expected = max(p for p in range(num) if values[p] <= value)
        assert _last_at_most(values, num, value) == expected


# ----------------------------------------------------------------------------- host side
def test_the_launch_sequence_has_fixed_grids_and_states_it_never_ran():
    launches = sm100_moe.sm100_moe_launches(1000, 8, 4096, 7168, resident_clusters=70)
    config = launches.config
    t = config.tokens_per_tile
    assert launches.max_tiles == (1000 + 8 * (t - 1)) // t * 16
    assert launches.num_clusters == min(70, launches.max_tiles)
    names = [launch.name for launch in launches.sequence()]
    assert names == ["sm100_moe_tables", "sm100_persistent_init", "sm100_moe_gemm"]
    tables, init, gemm = launches.sequence()
    assert tables.grid == (1 + -(-(1000 * 7168 // 16 // 16) // 256), 1, 1)
    assert init.grid == (1, 1, 8) and gemm.grid == (2 * launches.num_clusters, 1, 1) and gemm.cluster == (2, 1, 1)
    shapes = launches.buffer_shapes()
    assert shapes["tiles"] == ("int32", (launches.max_tiles + 1, 4))
    assert shapes["sfa_blocked"] == ("uint8", (sm100_moe.moe_scale_scratch_rows(1000, 8), 7168 // 16))
    assert "compiled for sm_100a only" in sm100_moe.Sm100MoeLaunches.__doc__.lower()
    assert sm100_moe.Sm100MoeLaunches(1, 1, 128, 256, resident_clusters=74).num_clusters == 1
    with pytest.raises(ValueError, match="G = 65"):
        sm100_moe.sm100_moe_launches(100, 65, 128, 256)
    with pytest.raises(ValueError, match="N = 100"):
        sm100_moe.sm100_moe_launches(100, 2, 100, 256)


def test_the_build_report_lists_the_moe_kernels():
    """The tables kernel and the GEMM of each token tile; the descriptor init is the library's
    own build (nvfp4_group_gemm.sm100), which the build report lists already."""
    assert "nvfp4_group_gemm.sm100_moe" in build_report.BACKEND_MODULES
    names = [name for name, _arch, _fn in sm100_moe.compile_targets()]
    assert names == [f"sm100_moe_{kernel}_t{tokens}" for tokens in submission.PERSISTENT_CONFIGS
                     for kernel in ("tables", "gemm")] + [
        "sm100_moe_tables_t128_halves", "sm100_moe_init_t128_bf16", "sm100_moe_gemm_t128_halves_bf16"]


def test_the_leaderboard_hook_returns_the_argument_and_the_file_names_no_stream():
    from nvfp4_group_gemm import bundle

    kernel = submission.PersistentGemmSm100(CONFIGS[128])
    assert kernel._tile_count(None, 7) == 7
    assert "stream" not in bundle.bundled_text().lower()


# ----------------------------------------------------------------------------- builds
@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    from test_sm100_persistent import _compile_kept

    done = {}

    def get(name: str):
        """name: <kind>_t<tokens>[_halves][_bf16] (alpha [G, 2]; bf16 C)."""
        if name not in done:
            kind, rest = name.split("_t", 1)
            tokens, *variant = rest.split("_")
            compile_fn = {"tables": sm100_moe.compile_moe_tables, "init": sm100_moe.compile_persistent_init,
                          "gemm": sm100_moe.compile_moe_gemm}[kind]
            config = CONFIGS[int(tokens)]
            if "bf16" in variant:
                config = dataclasses.replace(config, out_dtype="bfloat16")
            extra = {"alpha": "halves"} if "halves" in variant else {}
            cubin, ptx = _compile_kept(lambda options: compile_fn(config, options, **extra),
                                       tmp_path_factory.mktemp(name))
            text = ptx.read_text(errors="replace")
            done[name] = (build_report.read_cubin(cubin.read_bytes()), text, ptx_flow(text))
        return done[name]

    return get


def _ops(flow, predicate):
    return [i for i, op in enumerate(flow.ops) if predicate(op)]


@pytest.mark.parametrize("tokens", sorted(CONFIGS))
def test_tables_kernel_builds_and_reads_nothing_before_its_wait(builds, tokens):
    cubin, ptx, flow = builds(f"tables_t{tokens}")
    (function,) = cubin.functions.values()
    assert cubin.sm_version == 100 and function.frame_bytes == 0 and 0 < function.registers <= 64
    waits = _ops(flow, lambda op: op == "griddepcontrol.wait")
    triggers = _ops(flow, lambda op: op == "griddepcontrol.launch_dependents")
    accesses = _ops(flow, ptx_is_global)
    assert len(waits) == 1 and len(triggers) == 1 and accesses
    assert flow.always_after(accesses, waits)
    assert flow.always_after(triggers, waits)
    # one vote over the offsets' checks, shuffle-up scans, one 16-byte load per repack thread,
    # the tile rows as 16-byte stores, the repacked words 512 bytes apart
    assert ptx.count("vote.sync.any.pred") == 1
    assert ptx.count("shfl.sync.up.b32") >= 10
    assert ptx.count("ld.global.v4.u32") == 1
    assert "st.global.v4.u32" in ptx
    assert re.search(r"st\.global\.u32\s+\[%rd\d+\+1536\]", ptx)
    assert "tcgen05" not in ptx


@pytest.mark.parametrize("tokens", sorted(CONFIGS))
def test_gemm_loads_its_count_after_each_roles_wait(builds, tokens):
    """Each warp role's count (the one scalar 32-bit global load the base kernel does not have:
    its tile rows are 16-byte loads) is reachable only through a griddepcontrol.wait, and sits
    right after one in text order."""
    cubin, ptx, flow = builds(f"gemm_t{tokens}")
    function = next(f for name, f in cubin.functions.items() if "kernel" in name)
    assert function.frame_bytes == 0 and 0 < function.registers <= 255
    waits = _ops(flow, lambda op: op == "griddepcontrol.wait")
    count_loads = _ops(flow, lambda op: op.startswith("ld.global.u32"))
    assert len(waits) == 3 and len(count_loads) == 3
    assert flow.always_after(count_loads, waits)
    assert flow.always_after(_ops(flow, ptx_is_global), waits)
    for load in count_loads:
        previous_wait = max(w for w in waits if w < load)
        between = flow.ops[previous_wait + 1:load]
        assert not any(ptx_is_global(op) for op in between), between
    # the tile rows' loads are bounded by the count: no row load before a count load
    row_loads = _ops(flow, lambda op: op.startswith("ld.global.v4"))
    assert row_loads and flow.always_after(row_loads, count_loads)
    assert ptx.count("tcgen05.mma.cta_group::2.kind::mxf4nvf4.block_scale.scale_vec::4X") >= 1


def test_init_entry_is_the_files_descriptor_init(builds):
    """The MoE call's init launch runs the leaderboard file's init_tensormaps_kernel: five
    descriptors patched and released per group, after its wait."""
    cubin, ptx, flow = builds("init_t128")
    assert "init_tensormaps_kernel" in next(iter(cubin.functions))
    assert ptx.count("tensormap.replace.tile.global_address") == submission.PERSISTENT_NUM_TENSORMAPS
    waits = _ops(flow, lambda op: op == "griddepcontrol.wait")
    assert len(waits) == 1 and flow.always_after(_ops(flow, ptx_is_global), waits)


# ----------------------------------------------------------------------------- alpha and bf16
def test_the_launch_sequence_with_alpha_keeps_its_scales_after_the_tile_rows():
    launches = sm100_moe.sm100_moe_launches(1000, 8, 4096, 7168, resident_clusters=70, alpha="halves",
                                            out_dtype="bfloat16")
    assert launches.config.out_dtype == "bfloat16" and launches.config.tokens_per_tile in (128, 256)
    assert launches.buffer_shapes()["tiles"] == ("int32", (launches.max_tiles + 1 + sm100_moe.alpha_tail_rows(8), 4))
    assert sm100_moe.alpha_tail_rows(8) == 5  # 1 + 16 words
    with pytest.raises(ValueError, match="N = 768: must be a multiple of 512 with alpha"):
        sm100_moe.sm100_moe_launches(100, 2, 768, 256, alpha="halves")


def test_tables_kernel_with_alpha_copies_the_scales_after_its_wait(builds):
    """The scaled tables kernel: everything the plain one does, and the experts' fp32 scales
    loaded and stored after its one wait (the GEMM reads them after its own)."""
    _, base, _ = builds("tables_t128")
    cubin, ptx, flow = builds("tables_t128_halves")
    assert cubin.sm_version == 100
    waits = _ops(flow, lambda op: op == "griddepcontrol.wait")
    scale_loads = _ops(flow, lambda op: op.startswith("ld.global.f32"))
    assert len(waits) == 1 and scale_loads and flow.always_after(scale_loads, waits)
    assert "ld.global.f32" not in base and ptx.count("st.global.f32") >= 1 and "st.global.f32" not in base


def test_gemm_with_alpha_and_bf16_scales_each_tile_after_the_epilogues_wait(builds):
    """The scaled bf16 GEMM: one scalar fp32 load (the tile's scale, its half of N chosen on the
    GPU), reachable only through a wait; the epilogue multiplies every accumulator element by it
    and converts to bf16 where the fp16 kernel converts to fp16, one for one."""
    _, base, _ = builds("gemm_t128")
    cubin, ptx, flow = builds("gemm_t128_halves_bf16")
    function = next(f for name, f in cubin.functions.items() if "kernel" in name)
    assert function.frame_bytes == 0 and 0 < function.registers <= 255
    waits = _ops(flow, lambda op: op == "griddepcontrol.wait")
    scale_loads = _ops(flow, lambda op: op.startswith("ld.global.f32"))
    assert len(scale_loads) == 1 and flow.always_after(scale_loads, waits)
    assert ptx.count("cvt.rn.bf16x2.f32") == base.count("cvt.rn.f16x2.f32") > 0
    assert "cvt.rn.f16x2.f32" not in ptx and "bf16" not in base
    assert ptx.count("mul.f32") >= 2 * ptx.count("cvt.rn.bf16x2.f32") and "mul.f32" not in base
    assert flow.always_after(_ops(flow, ptx_is_global), waits)
