"""CPU tests of the swap-AB sm_90a kernels (nvfp4_group_gemm.hopper.swap_ab): the pre-pass's addressing
against the reordered scale layout and the GEMM's swizzled stages, the automatic choice, the
tile table, the activation scratch, the launches a binding makes, and the sm_90a builds.
The kernels' numerics run on an H200 in tests/test_hopper.py (configs swap_ab*, auto)."""

import dataclasses
import random
import struct
from pathlib import Path

import pytest
import torch
from helpers import BENCHMARK_SIZES

import build_report
from nvfp4_group_gemm import core as submission
from nvfp4_group_gemm import hopper, launch, runtime, switches
from nvfp4_group_gemm.hopper import swap_ab
from reference import create_reordered_scale_factor_tensor


@pytest.mark.parametrize("m,k", [(40, 256), (128, 512), (200, 768), (384, 1536)])
def test_activation_scale_offsets_match_the_reordered_layout(m, k):
    """Every (row, block) scale the pre-pass reads is the one the reordered tensor holds."""
    torch.manual_seed(m + k)
    scales = torch.randint(0, 256, (m, k // 16, 1), dtype=torch.uint8)
    reordered = create_reordered_scale_factor_tensor(1, m, k, scales.view(torch.float8_e4m3fn), device="cpu")
    # the pre-pass reads the memory of the permuted view as a flat byte buffer
    assert reordered.permute(5, 2, 4, 0, 1, 3).is_contiguous()
    flat = reordered.permute(5, 2, 4, 0, 1, 3).contiguous().view(torch.uint8).flatten()
    for row in range(m):
        for block in range(k // 16):
            offset = swap_ab.activation_scale_offset(row, block, k)
            assert flat[offset] == scales[row, block, 0], (row, block)


@pytest.mark.parametrize("config", [hopper.SWAP_AB_CONFIG, hopper.SWAP_AB_T112_CONFIG, hopper.SWAP_AB_T192_CONFIG,
                                    hopper.SWAP_AB_VARIABLE_CONFIG])
@pytest.mark.parametrize("m,k", [(40, 256), (200, 1536)])
def test_pre_pass_rows_land_where_the_b_stage_decode_put_them(config, m, k):
    """The pre-pass writes block b of row r as chunks 2 (b % 4) and + 1 of its k-tile's
    128-byte image, swizzled, in the group's k-tile slab; the GEMM copies a tile's rows of a
    k-tile as one run from its first token's image into the stage. Composed, for every tile
    of the config, every block lands where the decode of the two-sided kernel wrote its B rows
    (chunk 2 blk ^ swz, 2 blk + 1 ^ swz of the tile's row r): the K permutation both operands
    share is unchanged, and the run stays inside the slab."""
    padded = swap_ab.padded_token_rows(m, config)
    slab = padded * 128
    tiles = hopper.make_backend(config).plan_tiles([(m, 128, k, 1)])
    step = 64 if config.variable_tokens else config.tile_tokens
    for tile in tiles:
        token0 = tile[1] * step
        tokens = (tile[3] + 1) * 64 if config.variable_tokens else config.tile_tokens
        # tiles start on 8-row swizzle atoms (multiples of 16 tokens), inside the slab
        assert token0 % 8 == 0 and token0 + tokens <= padded
        for row in range(token0, min(m, token0 + tokens)):
            for block in range(k // 16):
                k_tile, blk = divmod(block, 4)
                run_start = k_tile * slab + token0 * 128  # the GEMM's copy source of this k-tile
                for half, offset in enumerate(swap_ab.activation_chunk_offsets(row, block, slab)):
                    in_stage = offset - run_start
                    assert 0 <= in_stage < tokens * 128
                    tile_row = row - token0
                    assert in_stage == tile_row * 128 + ((2 * blk + half) ^ (tile_row % 8)) * 16
                    assert in_stage == swap_ab.token_stage_chunk_offset(tile_row, 2 * blk + half)


def test_padded_token_rows_reach_the_last_tile():
    assert swap_ab.padded_token_rows(40, hopper.SWAP_AB_CONFIG) == 128
    assert swap_ab.padded_token_rows(200, hopper.SWAP_AB_T192_CONFIG) == 384
    assert swap_ab.padded_token_rows(200, hopper.SWAP_AB_T112_CONFIG) == 224
    assert swap_ab.padded_token_rows(200, hopper.SWAP_AB_VARIABLE_CONFIG) == 256
    assert swap_ab.padded_token_rows(0, hopper.SWAP_AB_CONFIG) == 0


def test_token_stage_chunks_are_a_permutation_per_8_rows():
    offsets = sorted(swap_ab.token_stage_chunk_offset(r, c) for r in range(8) for c in range(8))
    assert offsets == list(range(0, 1024, 16))


@pytest.mark.parametrize("shape,config", [
    (0, hopper.SWAP_AB_VARIABLE_CONFIG), (1, hopper.SWAP_AB_VARIABLE_CONFIG), (2, hopper.SWAP_AB_T112_K128_CONFIG),
    (3, hopper.SWAP_AB_ONE_ROUND_K128_CONFIG),
])
def test_automatic_choice_on_the_benchmark_shapes(shape, config):
    """No split-K on any benchmark shape (352, 728, 120, 128 128-token tiles: at least one per
    SM of 132 already); variable token tiles on shapes 0 and 1, where M pads least in them
    (shape 0's M = 64..248 in one tile each); one round of one CTA per SM, launched as the
    pre-pass's programmatic dependent, on shapes 2 and 3: 112-token tiles on shape 2 (M = 192
    and 320 in 2 + 3 tiles, 560 tokens, where 128-token tiles pad to 640), 128-token tiles on
    shape 3 (M = 128 and 384 fill them; 112-token tiles would be 192, two rounds); both with
    128-wide k-tiles (K = 4096 and 1536, multiples of 512)."""
    sizes = BENCHMARK_SIZES[shape]
    assert hopper.swap_ab_tiles(sizes) == (352, 728, 120, 128)[shape]
    assert hopper.swap_ab_tiles(sizes, hopper.SWAP_AB_T192_CONFIG) == (288, 504, 72, 96)[shape]
    assert hopper.swap_ab_tiles(sizes, hopper.SWAP_AB_T112_CONFIG) == (416, 728, 120, 192)[shape]
    assert hopper.choose_swap_ab_config(sizes, 132) == config


def test_time_model_of_whole_tile_rounds():
    """Equal tiles: rounds of one tile per SM, each the tile's k-tiles at the per-k-tile cost
    of its size; the per-k-tile costs are the fitted 0.55 (128 tokens) and 0.72 (192)."""
    model = hopper.swap_ab_time_model
    assert hopper.swap_ab_k_tile_us(128) == pytest.approx(0.55)
    assert hopper.swap_ab_k_tile_us(192) == pytest.approx(0.72)
    assert model(BENCHMARK_SIZES[1], hopper.SWAP_AB_T192_CONFIG, 132) == pytest.approx(4 * 32 * 0.72)
    assert model(BENCHMARK_SIZES[1], hopper.SWAP_AB_CONFIG, 132) == pytest.approx(6 * 32 * 0.55)
    # 8 tiles of 8 k-tiles on 4 SMs: two rounds
    assert model([(128, 128 * 8, 512, 1)], hopper.SWAP_AB_CONFIG, 4) == pytest.approx(2 * 8 * 0.55)


def test_time_model_dispatches_each_tile_to_the_sm_that_frees_first():
    """Tiles of unequal length: in launch order, each to the least loaded SM. One 256-token
    group (4 tiles of 28 k-tiles) and one 64-token group (4 tiles of 28): on 4 SMs each SM
    takes one of each; on 2 SMs the long ones pair up first."""
    sizes = [(256, 512, 1792, 1), (64, 512, 1792, 1)]
    config = hopper.SWAP_AB_VARIABLE_CONFIG
    long_tile, short_tile = 28 * hopper.swap_ab_k_tile_us(256), 28 * hopper.swap_ab_k_tile_us(64)
    assert hopper.swap_ab_tile_costs(sizes, config) == pytest.approx([long_tile] * 4 + [short_tile] * 4)
    assert hopper.swap_ab_time_model(sizes, config, 4) == pytest.approx(long_tile + short_tile)
    assert hopper.swap_ab_time_model(sizes, config, 2) == pytest.approx(2 * long_tile + 2 * short_tile)
    assert hopper.swap_ab_time_model(sizes, config, 8) == pytest.approx(long_tile)


def test_choice_takes_the_fastest_modelled_candidate():
    """Variable tiles where M = 256 would pad to 384 in 192-token tiles and split in two
    128-token tiles; 128-token tiles where they form one round of every SM and larger ones
    would only lengthen it."""
    many_256 = [(256, 4096, 2048, 1)] * 8  # 512 tiles of 128 tokens, 512 of 192 (padded), 256 of 256
    assert hopper.choose_swap_ab_config(many_256, 132) == hopper.SWAP_AB_VARIABLE_CONFIG
    one_round = [(128, 128 * 130, 2048, 1)]  # 130 128-token tiles (variable: the same 130; a tie)
    assert hopper.choose_swap_ab_config(one_round, 132) == hopper.SWAP_AB_ONE_ROUND_K128_CONFIG
    # more 128-token tiles than SMs: two CTAs per SM, no dependent launch
    two_rounds = [(128, 128 * 140, 2048, 1)]
    assert hopper.choose_swap_ab_config(two_rounds, 132) == hopper.SWAP_AB_CONFIG
    for sizes, expected in ((many_256, hopper.SWAP_AB_VARIABLE_CONFIG), (one_round, hopper.SWAP_AB_CONFIG)):
        times = {c: hopper.swap_ab_time_model(sizes, c, 132) for c in hopper.SWAP_AB_CANDIDATES}
        assert times[expected] == min(times.values())


def test_wide_k_tiles_only_where_every_k_allows_them():
    """One round of 112- or 128-token tiles runs 128-wide k-tiles where every group's K is a
    multiple of 512 (the unrolled loop's 4 stages of 128), the 64-wide ones otherwise; no
    other config has a wide variant."""
    shape_2 = BENCHMARK_SIZES[2]
    assert hopper.choose_swap_ab_config(shape_2, 132) == hopper.SWAP_AB_T112_K128_CONFIG
    k_768 = [(192, 3072, 4096, 1), (320, 3072, 768, 1)]
    assert hopper.choose_swap_ab_config(k_768, 132) == hopper.SWAP_AB_T112_CONFIG
    one_round_k_1280 = [(128, 128 * 130, 1280, 1)]
    assert hopper.choose_swap_ab_config(one_round_k_1280, 132) == hopper.SWAP_AB_ONE_ROUND_CONFIG
    assert hopper.with_wide_k_tiles(shape_2, hopper.SWAP_AB_VARIABLE_CONFIG) == hopper.SWAP_AB_VARIABLE_CONFIG
    wide = hopper.SWAP_AB_T112_K128_CONFIG
    assert (wide.tile_k, wide.k_multiple, hopper.SWAP_AB_T112_CONFIG.k_multiple) == (128, 512, 256)
    assert wide == dataclasses.replace(hopper.SWAP_AB_T112_CONFIG, k_halves=2) and wide.chain_calls
    # an explicit wide config rejects a K it cannot run, naming group, value and rule
    backend = hopper.make_backend(wide)
    with pytest.raises(ValueError, match=r"group 1: K = 768; .*128-wide k-tiles needs K % 512 == 0"):
        backend.can_implement(k_768)
    backend.can_implement(shape_2)


def test_wide_k_tile_stages():
    """A 128-wide k-tile's weight stage is two 64-wide halves, each laid out as a 64-wide
    k-tile's (packed rows, then their scale atom); its token stage the tile's rows of both
    halves (256 bytes per token)."""
    wide = hopper.SWAP_AB_ONE_ROUND_K128_CONFIG
    assert wide.weight_half_bytes == 128 * 32 + 512 and wide.weight_stage_bytes == 2 * wide.weight_half_bytes
    assert wide.token_stage_bytes == 128 * 256
    assert wide.smem_bytes == 4 * (2 * 4608 + 32768) + 1024
    # slabs stay 64 wide: the activation buffer is the 64-wide config's
    sizes = BENCHMARK_SIZES[3]
    narrow = hopper.ActivationBuffer(sizes, "cpu", hopper.SWAP_AB_ONE_ROUND_CONFIG)
    assert hopper.ActivationBuffer(sizes, "cpu", wide).addresses[:, 1].tolist() == narrow.addresses[:, 1].tolist()


def test_split_k_where_split_ctas_fit_one_per_sm():
    one_group = [(40, 4096, 7168, 1)]  # 32 tiles
    assert hopper.choose_swap_ab_config(one_group, 132) == hopper.SWAP_AB_SPLIT_K_CONFIG
    assert hopper.choose_swap_ab_config([(40, 4096 * 2, 256, 1), (1, 128 * 2, 256, 1)], 132).split_k == 2  # 66
    assert hopper.choose_swap_ab_config([(40, 128 * 67, 256, 1)], 132).split_k == 1  # 67 tiles
    assert hopper.choose_swap_ab_config(one_group, 60).split_k == 1  # 64 split CTAs > 60 SMs


def test_config_check_rejects_unsupported_values():
    hopper.SwapAbConfig(tile_tokens=256, ctas_per_sm=1).check()
    hopper.SwapAbConfig(tile_tokens=112, ctas_per_sm=1).check()
    for bad in ({"tile_tokens": 40}, {"tile_tokens": 16}, {"tile_tokens": 288}, {"stages": 2}, {"split_k": 3},
                {"ctas_per_sm": 5}, {"weight_stages": 1},
                {"variable_tokens": True}, {"tile_tokens": 256, "variable_tokens": True, "split_k": 2},
                {"k_halves": 3}, {"k_halves": 2, "split_k": 2, "ctas_per_sm": 1},
                {"k_halves": 2, "tile_tokens": 256, "variable_tokens": True, "ctas_per_sm": 1}):
        with pytest.raises(ValueError):
            hopper.SwapAbConfig(**bad).check()


def test_stage_and_reduction_sizes():
    config = hopper.SWAP_AB_CONFIG
    assert config.weight_stage_bytes == 128 * 32 + 512
    assert config.token_stage_bytes == 128 * 128
    # 4 weight stages, 4 token stages and their 4 mbarriers, rounded up to the 1024-byte
    # struct alignment
    assert config.smem_bytes == 4 * (4608 + 16384) + 1024
    assert dataclasses.replace(config, weight_stages=8).smem_bytes == 8 * 4608 + 4 * 16384 + 1024
    assert dataclasses.replace(config, weight_stages=3).smem_bytes == 3 * 4608 + 4 * 16384 + 1024 - 512
    # a summing rank receives one warpgroup's 64 x 128 fp32 sums, into its token stages
    assert hopper.SWAP_AB_SPLIT_K_CONFIG.reduction_bytes == 64 * 128 * 4 <= 4 * config.token_stage_bytes


@pytest.mark.parametrize("seed", range(20))
def test_tile_table_covers_every_output_once_token_tiles_innermost(seed):
    rng = random.Random(seed)
    sizes = tuple((rng.choice([0, 1, rng.randint(1, 700)]), 128 * rng.randint(1, 6), 256, 1)
                  for _ in range(rng.randint(1, 6)))
    backend = hopper.make_backend(hopper.SWAP_AB_CONFIG)
    tiles = backend.plan_tiles(sizes)
    assert backend.tile_shape(sizes) == (128, 128)
    covered = {}
    for g, token_tile, weight_tile in tiles:
        m, n, _k, _l = sizes[g]
        for t in range(token_tile * 128, min(m, token_tile * 128 + 128)):
            for w in range(weight_tile * 128, min(n, weight_tile * 128 + 128)):
                covered[(g, t, w)] = covered.get((g, t, w), 0) + 1
    assert set(covered.values()) <= {1}
    assert len(covered) == sum(m * n for m, n, _k, _l in sizes)
    # the token tiles of one weight tile are adjacent (they share its reads in L2)
    assert tiles == sorted(tiles, key=lambda row: (row[0], row[2], row[1]))


@pytest.mark.parametrize("seed", range(20))
def test_variable_token_tiles_cover_every_output_once_longest_first(seed):
    rng = random.Random(seed)
    sizes = tuple((rng.choice([0, 1, 64, 65, 256, 257, rng.randint(1, 900)]), 128 * rng.randint(1, 4), 256 * rng.randint(1, 8), 1)
                  for _ in range(rng.randint(1, 6)))
    config = hopper.SWAP_AB_VARIABLE_CONFIG
    tiles = hopper.make_backend(config).plan_tiles(sizes)
    assert tiles == hopper.variable_token_tiles(sizes, config)
    covered = {}
    for g, first_step, weight_tile, token_class in tiles:
        m, n, _k, _l = sizes[g]
        first, tokens = first_step * 64, (token_class + 1) * 64
        assert 0 <= token_class <= 3 and first < m
        assert tokens - 64 < min(tokens, m - first) <= tokens  # the smallest class that holds them
        for t in range(first, min(m, first + tokens)):
            for w in range(weight_tile * 128, min(n, weight_tile * 128 + 128)):
                covered[(g, t, w)] = covered.get((g, t, w), 0) + 1
    assert set(covered.values()) <= {1}
    assert len(covered) == sum(m * n for m, n, _k, _l in sizes)
    # longest modelled tile first: k-tiles x the per-k-tile cost of its size
    costs = hopper.swap_ab_tile_costs(sizes, config)
    assert costs == sorted(costs, reverse=True)
    assert costs == [sizes[g][2] // 64 * hopper.swap_ab_k_tile_us((c + 1) * 64) for g, _f, _w, c in tiles]


def test_variable_token_tiles_of_the_benchmark_shapes():
    """Equal tiles per group, rounded up to 64 tokens: shape 0's M = 248 is one 256-token tile,
    shape 2's M = 320 two of 192 and 128, shape 3's M = 384 two of 192."""
    def classes(shape):
        tiles = hopper.variable_token_tiles(BENCHMARK_SIZES[shape], hopper.SWAP_AB_VARIABLE_CONFIG)
        per_group = {}
        for g, _first, weight_tile, token_class in tiles:
            if weight_tile == 0:
                per_group.setdefault(g, []).append((token_class + 1) * 64)
        return [sorted(per_group[g], reverse=True) for g in sorted(per_group)]
    assert classes(0) == [[128], [192], [128], [128], [64], [256], [128], [192]]
    assert classes(2) == [[192], [192, 128]]
    assert classes(3) == [[128], [192, 192]]


def test_activation_buffer_holds_every_group_back_to_back():
    """Per group K / 64 slabs of its padded token rows (128, 0, 384 with 128-token tiles) x 128
    bytes; the table holds (address, slab bytes) per group."""
    sizes = ((40, 128, 512, 1), (0, 128, 256, 1), (300, 256, 1024, 1))
    buffer = hopper.ActivationBuffer(sizes, "cpu", hopper.SWAP_AB_CONFIG)
    base = buffer.buffer.data_ptr()
    first = 128 * 512 * 2
    assert buffer.addresses.tolist() == [[base, 128 * 128], [base + first, 0], [base + first, 384 * 128]]
    assert buffer.buffer.numel() == first + 384 * 1024 * 2
    assert buffer.nbytes == buffer.buffer.numel() + 128  # its table: 3 x 16 bytes, on 128
    # the pre-pass grid: one thread per scale block of the largest group
    assert buffer.blocks_x == 300 * 1024 // 16 // swap_ab.DECODE_THREADS


def test_binding_launches_the_pre_pass_then_the_gemm(monkeypatch):
    """A swap-AB input set launches two kernels in order, on one plan's scratch: the pre-pass
    over every group (grid x from the largest group) and the GEMM over the tile table."""
    launched = []

    class FakeCellLauncher:
        def __init__(self, kernel, kinds, dtypes):
            self.kernel, self.kinds = kernel, kinds

        def bound(self, values):
            assert len(values) == len(self.kinds)
            return lambda: launched.append((self.kernel, values))

    class FakeStream:
        def __int__(self):
            return 7

    monkeypatch.setattr(hopper.backend, "compile_swap_ab_gemm", lambda g, config: ("gemm", g, config))
    monkeypatch.setattr(hopper.backend, "compile_decode_activations",
                        lambda g, chained=False: ("pre-pass", g, chained))
    monkeypatch.setattr(launch, "cell_launcher", FakeCellLauncher)
    sizes = tuple(BENCHMARK_SIZES[3])
    abc = [(torch.zeros((m, k // 2, 1), dtype=torch.uint8), torch.zeros((n, k // 2, 1), dtype=torch.uint8),
            torch.zeros((m, n, 1), dtype=torch.float16)) for m, n, k, _l in sizes]
    sfs = [(torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)) for _ in sizes]
    plan = runtime.Plan(hopper.make_backend(), sizes, "cpu")
    binding = runtime.Binding(plan, submission.pointers_of((abc, None, sfs, sizes)))
    assert plan.backend_plan.shared_scratch and plan.backend_plan.config == hopper.SWAP_AB_ONE_ROUND_K128_CONFIG
    assert plan.nbytes >= (128 + 384) * 1536 * 2
    binding.run(FakeStream())
    (first, first_args), (second, second_args) = launched
    assert first_args[0] == second_args[0] == binding.ptrs.data_ptr() and first_args[-1] == second_args[-1] == 7
    assert second_args[2] == plan.tiles.data_ptr() and first_args[2] == second_args[4]
    assert first == ("pre-pass", 2, True) and second == ("gemm", 2, hopper.SWAP_AB_ONE_ROUND_K128_CONFIG)
    # chained calls: launched directly (a graph launch would wait for the kernel before it)
    assert not plan.backend_plan.graph_launch and not runtime._can_record(plan)
    assert int(first_args[3]) == 384 * 1536 // 16 // swap_ab.DECODE_THREADS
    assert int(second_args[3]) == plan.num_tiles == 128


def test_chained_calls_by_environment(monkeypatch):
    """NVFP4_SM90_CHAIN_CALLS: unset or 1, the automatic choice chains the calls where it
    picks a config that does (benchmark shape 2: 112-token tiles) and launches them directly;
    0, the same config without chaining, replayed as a CUDA graph; anything else is refused by
    name. Configs given explicitly run as given."""
    monkeypatch.setattr(hopper.backend, "compile_swap_ab_gemm", lambda g, config: ("gemm", g, config))
    monkeypatch.setattr(hopper.backend, "compile_decode_activations", lambda g, chained=False: ("pre-pass", g))
    sizes = tuple(BENCHMARK_SIZES[2])
    monkeypatch.delenv("NVFP4_SM90_CHAIN_CALLS", raising=False)
    switches.reload()  # the switches are read at import and by reset_runtime (nvfp4_group_gemm.switches)
    chained = hopper.make_backend()
    chosen = hopper.SWAP_AB_T112_K128_CONFIG
    assert chained.config_for(sizes) == chosen and chosen.chain_calls
    assert not runtime.Plan(chained, sizes, "cpu").backend_plan.graph_launch
    monkeypatch.setenv("NVFP4_SM90_CHAIN_CALLS", "0")
    switches.reload()
    unchained = hopper.make_backend()
    assert unchained.config_for(sizes) == dataclasses.replace(chosen, chain_calls=False)
    assert runtime.Plan(unchained, sizes, "cpu").backend_plan.graph_launch
    assert unchained.plan_key != chained.plan_key
    assert hopper.make_backend(hopper.SWAP_AB_T112_CONFIG).config_for(sizes).chain_calls
    monkeypatch.setenv("NVFP4_SM90_CHAIN_CALLS", "yes")
    with pytest.raises(ValueError, match="NVFP4_SM90_CHAIN_CALLS='yes': must be one of 0, 1"):
        switches.reload()


def test_kernel_selection_by_environment(monkeypatch):
    monkeypatch.delenv("NVFP4_SM90_KERNEL", raising=False)
    switches.reload()
    assert hopper.make_backend().kernel == "swap_ab"
    monkeypatch.setenv("NVFP4_SM90_KERNEL", "in_gemm_decode")
    switches.reload()
    backend = hopper.make_backend()
    assert backend.kernel == "in_gemm_decode"
    assert backend.config_for(BENCHMARK_SIZES[0]) == hopper.choose_config(BENCHMARK_SIZES[0], 132)
    monkeypatch.setenv("NVFP4_SM90_KERNEL", "fastest")
    with pytest.raises(ValueError, match="NVFP4_SM90_KERNEL='fastest': must be one of swap_ab, in_gemm_decode"):
        switches.reload()


@pytest.fixture
def swap_ab_builds(sm90_builds):
    """The swap-AB GEMMs and their pre-pass among the run's sm_90a builds (tests/conftest.py)."""
    return {key: r for key, r in sm90_builds.items() if "swap_ab" in r.target or "decode_act" in r.target}


@pytest.mark.parametrize("num_groups", [1, 8])
@pytest.mark.parametrize("target,config,mma", [
    ("sm90_swap_ab_t128", hopper.SWAP_AB_CONFIG, "m64n128k16"),
    ("sm90_swap_ab_split_k", hopper.SWAP_AB_SPLIT_K_CONFIG, "m64n128k16"),
    ("sm90_swap_ab_one_round", hopper.SWAP_AB_ONE_ROUND_CONFIG, "m64n128k16"),
    ("sm90_swap_ab_t112", hopper.SWAP_AB_T112_CONFIG, "m64n112k16"),
    ("sm90_swap_ab_t112_k128", hopper.SWAP_AB_T112_K128_CONFIG, "m64n112k16"),
    ("sm90_swap_ab_one_round_k128", hopper.SWAP_AB_ONE_ROUND_K128_CONFIG, "m64n128k16"),
    ("sm90_swap_ab_t192", hopper.SWAP_AB_T192_CONFIG, "m64n192k16"),
    ("sm90_swap_ab_variable", hopper.SWAP_AB_VARIABLE_CONFIG, "m64n128k16"),
])
def test_swap_ab_gemm_builds_within_limits(swap_ab_builds, target, config, mma, num_groups):
    report = swap_ab_builds[(target, num_groups)]
    assert report.arch == "sm_90a" and report.sm_version == 90
    # ctas_per_sm CTAs of 256 threads share the 65,536-register file
    assert 0 < report.registers * config.num_threads * config.ctas_per_sm <= 65536
    assert report.frame_bytes == 0 and report.spill_bytes_max == 0, "local memory: spills possible"
    if config.variable_tokens:  # one main loop per token class
        assert sorted(report.mma) == sorted(
            f"wgmma.mma_async.sync.aligned.m64n{t}k16.f32.f16.f16" for t in (64, 128, 192, 256))
    else:
        assert report.mma == [f"wgmma.mma_async.sync.aligned.{mma}.f32.f16.f16"]
    # the launch asks for its storage, or with the dependent launch at one CTA per SM for more
    # than half an SM (115 KB), so that the early CTAs spread one per SM
    assert report.dynamic_smem_bytes == config.launch_smem_bytes(config.smem_bytes)
    assert (report.dynamic_smem_bytes > config.smem_bytes) == (config.pdl and config.ctas_per_sm == 1
                                                               and config.smem_bytes < 115 * 1024)
    assert build_report.problems(report) == []
    ptx = Path(report.ptx_path).read_text(errors="replace")
    # the token rows arrive decoded: the GEMM stores nothing into its own shared memory (only
    # split-K's partial sums into the other rank's)
    assert "cp.async.cg.shared.global" in ptx
    assert "st.shared." not in ptx.replace("st.shared::cluster.", "")
    assert ("st.shared::cluster.v4.f32" in ptx) == (config.split_k == 2)
    # the token rows: bulk copies completing on mbarriers, one per stage, waited on by parity;
    # the only async-proxy writes are the bulk copies, so no proxy fence is left
    main_loops = len(report.mma)
    assert ptx.count("mbarrier.init.shared::cta.b64") == config.stages * main_loops
    bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    # (128-wide k-tiles: one copy per 64-wide half, both on the stage's one arrival)
    arrivals = ptx.count("mbarrier.arrive.expect_tx.shared::cta.b64")
    assert ptx.count(bulk) == config.k_halves * arrivals and arrivals >= 2 * main_loops
    # one wait per k-tile step in the loop: the loop unrolled by the stage count where the
    # stage indices can be constants
    steps = config.stages if config.unrolled_main_loop else 1
    assert config.unrolled_main_loop == (config.split_k == 1 or config.tile_tokens == 32)
    assert ptx.count("mbarrier.try_wait.parity.shared::cta.b64") == main_loops * steps
    assert "fence.proxy.async" not in ptx
    # the epilogue: without split-K through the token stages (stmatrix .trans of fp16 pairs,
    # then 16-byte global stores of C rows: one stmatrix .x4 per 16 tokens of each main
    # loop's tile); split-K's summing rank stores its sums 2 bytes at a time
    classes = range(64, 257, 64) if config.variable_tokens else (config.tile_tokens,)
    epilogue = ptx.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16")
    assert epilogue == (0 if config.split_k > 1 else sum(tokens // 16 for tokens in classes))
    assert ("st.global.v4.b32" in ptx) == (config.split_k == 1)
    assert ("st.global.b16" in ptx) == (config.split_k > 1)
    # launched as the pre-pass's dependent: one wait per main loop, before its first token rows
    assert ptx.count("griddepcontrol.wait") == (main_loops if config.pdl else 0)
    # chained calls: the next call's pre-pass may be launched as soon as this grid starts
    assert ptx.count("griddepcontrol.launch_dependents") == int(config.chain_calls)


@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("num_groups", [1, 8])
def test_pre_pass_builds_without_local_memory(swap_ab_builds, num_groups, chained):
    report = swap_ab_builds[("sm90_decode_activations" + ("_chained" if chained else ""), num_groups)]
    assert report.frame_bytes == 0 and report.spill_bytes_max == 0
    ptx = Path(report.ptx_path).read_text(errors="replace")
    assert "ld.global.nc.v2.b32" in ptx and "st.global.v4.b32" in ptx and "shared" not in ptx.split(".entry")[1]
    # its dependent GEMM may start once the pre-pass has its tables (and, chained, has waited
    # for the kernel before it): the GEMM waits again before reading the token rows
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    body = ptx.split(".entry")[1]
    if chained:
        # the tables first (sizes: m, k; pointers: a, sfa; activation table: address, slab
        # bytes), then the wait, then every activation read
        assert body.count("griddepcontrol.wait") == 1
        before, after = body.split("griddepcontrol.wait")
        assert "griddepcontrol.launch_dependents" in after
        # (ptxas's vector loads: the size row, the two pointers, the activation table row)
        assert before.count("ld.global.") >= 3 and "ld.global.nc" not in before
        assert "ld.global.nc.v2.b32" in after and "ld.global." not in after.replace("ld.global.nc", "")
    else:
        assert "griddepcontrol.wait" not in body


@pytest.mark.parametrize("seed", range(10))
def test_packed_tiles_are_the_tile_rows_as_the_kernel_reads_them(seed):
    """A first call copies pack_tiles' bytes into its tables: the rows of plan_tiles, int32
    little-endian, for every swap-AB config (joined from cached blocks) and in_gemm_decode."""
    rng = random.Random(seed)
    sizes = tuple((rng.choice([0, 1, 64, 65, 256, 257, rng.randint(1, 1200)]), 128 * rng.randint(1, 56),
                   256 * rng.randint(1, 8), 1) for _ in range(rng.randint(1, 9)))
    backend = hopper.make_backend()
    for config in (hopper.SWAP_AB_CONFIG, hopper.SWAP_AB_T192_CONFIG, hopper.SWAP_AB_VARIABLE_CONFIG,
                   hopper.SWAP_AB_T112_CONFIG, hopper.SWAP_AB_SPLIT_K_CONFIG, hopper.SM90_CONFIG):
        kind = "swap_ab" if isinstance(config, hopper.SwapAbConfig) else "in_gemm_decode"
        choice = submission.KernelChoice("sm90", kind, config)
        rows = backend.plan_tiles(sizes, choice)
        for _ in range(2):  # the second time from the block caches
            packed = backend.pack_tiles(sizes, choice)
            assert packed.data == struct.pack(f"<{len(rows) * packed.width}i", *[v for row in rows for v in row])
            assert len(packed) == len(rows) and list(packed) == rows and packed[-1:] == rows[-1:]
