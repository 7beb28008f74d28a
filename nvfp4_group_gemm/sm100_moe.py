"""The MoE entry's sm_100a kernels: the leaderboard file's persistent GEMM (PersistentGemmSm100)
over stacked tokens whose group boundaries arrive as an int32 offsets tensor on the GPU.

    a       [T, K/2]     fp4 e2m1, the tokens of every group stacked
    sfa     [T, K/16]    e4m3, a's plain scales (one per 16 elements of a row)
    b       [G, N, K/2]  fp4 e2m1, the experts' weights
    sfb     [G, N/128, K/64, 32, 4, 4]  e4m3, b's blocked scales (the competition's layout per group)
    offsets [G + 1]      int32 on the GPU: group g is rows offsets[g] .. offsets[g + 1] of a and c
    c       [T, N]       fp16, written in the groups' rows only
    status  [1]          int32: 0 after a call with valid offsets, 1 otherwise; 2 where the
                         tiles would outnumber the table's capacity (a broken bound: the tiles
                         past it are not computed)

A call is three launches whose grids depend only on (T, G, N, K), never on the offsets (the
host never reads them):

    tables + repack (Sm100MoeTables): 1 + moe_repack_ctas(T, K) CTAs. Every CTA reads and checks
        the offsets (warp 0, two groups a lane). CTA 0 writes what the leaderboard file's host
        writes per size set: the pointer table [G, 5], the sizes [G, 4] = (M_g, N, K, 1), the
        persistent tile table in plan_persistent_tiles' format and order (groups by descending
        M, ties by index, then N tile, then token tile) and the tile count after the table's
        max_tiles rows. The other CTAs copy sfa into per-group blocked atoms (below).
    descriptor init (the file's init_tensormaps_kernel, unchanged): one CTA per group, five
        TMA descriptors of every group with M_g > 0 from the pointer and size tables.
    GEMM (PersistentMoeGemmSm100: PersistentGemmSm100 with the tile count loaded from device
        memory after each role's griddepcontrol.wait): min(resident clusters, max_tiles) CTA
        pairs over the table's first `count` rows.

Activation scales: the GEMM's descriptor of a group's token scales expects 128-row atoms that
start at the group's first row (tile_atom_to_shape_SF), but group g's rows start at offsets[g],
rarely a multiple of 128. So the repack CTAs copy each row of sfa into a scratch of per-group
blocked atoms: group g's rows start at padded row P_g = sum over g' < g of round_up(M_g', 128)
(every group's first row on an atom boundary), so the scratch holds moe_scale_scratch_rows(T, G)
rows of K/16 bytes, and group g's SFA pointer is the scratch + P_g K/16 bytes. Within a
128-row band of K/64 atoms of 512 bytes, scale block j of padded row r sits at byte
(r % 32) * 16 + ((r % 128) // 32) * 4 + j % 4 of atom j // 4. The padding rows of a group's
last atom are not written: they scale token columns past M_g, which the MMA keeps apart (a
column's products use only its own row's scales) and the TMA store of C clips.

Offsets are checked on the GPU: unless 0 <= offsets[0] <= ... <= offsets[G] <= T, every group's
size is 0 (the init kernel writes no descriptor), the tile count is 0 (the GEMM runs no tile),
the repack writes nothing, and status[0] is 1 (0 otherwise).

Chaining: with core.SM100_CHAIN_CALLS (the file's switch) every launch is the
programmatic dependent of the one before. The tables kernel waits (griddepcontrol.wait) before
it reads the offsets or writes anything (the previous call's GEMM reads the same tables); the
init kernel waits for it, and the GEMM waits for the init kernel, which cannot complete before
the tables kernel did: so each GEMM role's count and tile rows are read after both.

Constraints (the MoE entry's validation states them): 1 <= G <= 64, K a positive multiple of
256, N a positive multiple of 128, every base address 16-byte aligned.

Status: compiled for sm_100a only (built and read on a CPU); nothing here has run on a B200.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute, utils

from nvfp4_group_gemm import core

from .sm100 import PersistentGemmOnStream, compile_persistent_init

SF_VEC_SIZE = 16
ATOM_ROWS = 128
ATOM_BYTES = 512
# K elements of one atom column (4 scale blocks)
ATOM_K = 64
MAX_GROUPS = core.MAX_GROUPS
TILE_ROW = core.PERSISTENT_TILE_ROW
# Threads of every CTA of the tables kernel
TABLES_THREADS = 256
# Scale bytes one repack thread moves: one 16-byte load of a plain row (4 atom columns)
REPACK_UNIT_BYTES = 16
# Binary-search steps over at most MAX_GROUPS sorted entries (positions 0 .. 63)
SEARCH_STEPS = (32, 16, 8, 4, 2, 1)


# =============================================================================
# Host arithmetic (Python ints): buffer sizes and grids from (T, G, N, K)
# =============================================================================
def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def mma_m_tiles(n: int, mma_m: int = 256) -> int:
    """N tiles of the persistent GEMM (its MMA M over the CTA pair)."""
    return _ceil_div(n, mma_m)


def max_moe_tiles(tokens: int, groups: int, n: int, tokens_per_tile: int, mma_m: int = 256) -> int:
    """The most tiles any offsets of T = tokens rows in `groups` groups make: sum over groups of
    ceil(M_g / t) <= (T + min(G, T) (t - 1)) / t token tiles (only groups with rows have tiles),
    times the N tiles. At least 1 (the table and the grid are never empty)."""
    t = tokens_per_tile
    token_tiles = (tokens + min(groups, tokens) * (t - 1)) // t
    return max(1, token_tiles * mma_m_tiles(n, mma_m))


def moe_scale_scratch_rows(tokens: int, groups: int) -> int:
    """Rows of the repacked scales: every group with rows padded to 128 (sum round_up(M_g, 128)
    <= T + 127 min(G, T)), a multiple of 128."""
    return _ceil_div(tokens + (ATOM_ROWS - 1) * min(groups, tokens), ATOM_ROWS) * ATOM_ROWS


def moe_repack_ctas(tokens: int, k: int) -> int:
    """CTAs of the tables kernel that repack: one thread per 16 scale bytes of sfa [T, K/16]."""
    units = tokens * (k // SF_VEC_SIZE) // REPACK_UNIT_BYTES
    return _ceil_div(units, TABLES_THREADS)


def tiles_buffer_elems(max_tiles: int) -> int:
    """int32 elements of the tile buffer: max_tiles rows, then one row whose first element is the
    tile count (a whole row keeps every row 16-byte aligned)."""
    return (max_tiles + 1) * TILE_ROW


def blocked_scale_offset(row: int, block: int, k: int) -> int:
    """Byte of scale `block` of `row` in a blocked region that starts at row 0 (128-row bands
    of K/64 atoms of 512 bytes), the layout tile_atom_to_shape_SF describes."""
    atom = (row // ATOM_ROWS) * (k // ATOM_K) + block // 4
    return atom * ATOM_BYTES + (row % 32) * 16 + ((row % ATOM_ROWS) // 32) * 4 + block % 4


# =============================================================================
# Device helpers
# =============================================================================
@cute.jit
def warp_inclusive_sum(value: cutlass.Int32, lane: cutlass.Int32) -> cutlass.Int32:
    """Inclusive prefix sum over the 32 lanes of a warp (five shuffles up). shfl.up with clamp 0
    returns a lane's own value where lane < offset: those lanes add nothing."""
    for shift in cutlass.range_constexpr(5):
        offset = 1 << shift
        other = cute.arch.shuffle_sync_up(value, offset, mask_and_clamp=0)
        if lane >= offset:
            value = value + other
    return value


def _round_up_rows(m):
    return (m + ATOM_ROWS - 1) // ATOM_ROWS * ATOM_ROWS


# =============================================================================
# The tables + repack kernel
# =============================================================================
class Sm100MoeTables:
    """One launch of 1 + moe_repack_ctas(T, K) CTAs of TABLES_THREADS threads.

    Every CTA: warp 0 reads offsets[0 .. G] (two groups a lane), checks them with one vote and
    computes each group's padded first row P_g with one warp scan, into shared memory.
    CTA 0 then writes the GEMM's tables (class docstring of the module); CTAs >= 1 repack the
    scales, one 16-byte unit of a plain row per thread. `config` (the GEMM's) fixes the token
    tile; G, T, N, K and the table capacity are run-time values."""

    def __init__(self, config: core.PersistentGemmConfig, alpha: str | None = None):
        config.check()
        self.config = config
        self.alpha = alpha  # None; "expert" or "halves": Sm100MoeScaledTables

    @cute.jit
    def __call__(
        self,
        a: cute.Pointer,  # Uint8: the stacked tokens [T, K/2]
        b: cute.Pointer,  # Uint8: the weights [G, N, K/2]
        c: cute.Pointer,  # Uint8: the output [T, N] fp16
        sfa: cute.Pointer,  # Int32: plain token scales [T, K/16], read as K/64 words a row
        sfb: cute.Pointer,  # Uint8: blocked weight scales [G, N/128, K/64, 512 bytes]
        sfa_blocked: cute.Pointer,  # Int32: the repacked scales, moe_scale_scratch_rows(T, G) rows
        offsets: cute.Pointer,  # Int32 [G + 1]
        ptrs: cute.Pointer,  # Int64 [G, 5] out
        sizes: cute.Pointer,  # Int32 [G, 4] out
        tiles: cute.Pointer,  # Int32 [max_tiles + 1, 4] out: rows, then the count
        status: cute.Pointer,  # Int32 [1] out
        tokens: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        num_groups: cutlass.Int32,
        max_tiles: cutlass.Int32,
        repack_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        kernel, geometry = self.tables_launch(
            a, b, c, sfa, sfb, sfa_blocked, offsets, ptrs, sizes, tiles, status,
            tokens, n, k, num_groups, max_tiles, repack_ctas,
        )
        kernel.launch(**geometry, stream=stream)

    def tables_launch(self, a, b, c, sfa, sfb, sfa_blocked, offsets, ptrs, sizes, tiles, status,
                      tokens, n, k, num_groups, max_tiles, repack_ctas, alpha=None):
        """The kernel and its launch geometry, traced inside a @cute.jit entry."""
        mOffsets = cute.make_tensor(offsets, cute.make_layout(num_groups + 1))
        mPtrs = cute.make_tensor(
            ptrs, cute.make_layout((num_groups, core.NUM_PTR_COLS), stride=(core.NUM_PTR_COLS, 1))
        )
        mSizes = cute.make_tensor(sizes, cute.make_layout((num_groups, 4), stride=(4, 1)))
        mTiles = cute.make_tensor(tiles, cute.make_layout((max_tiles + 1, TILE_ROW), stride=(TILE_ROW, 1)))
        mStatus = cute.make_tensor(status, cute.make_layout(1))
        # (T, K/256, 4) words: a plain row is K/64 words, 16-byte units of 4 words
        row_words = cute.assume(k // ATOM_K, 4)
        mSFA = cute.make_tensor(
            sfa, cute.make_layout((tokens, k // (ATOM_K * 4), 4), stride=(row_words, 4, 1))
        )
        kernel = self.kernel(
            a, b, c, sfb, sfa_blocked, mOffsets, mPtrs, mSizes, mTiles, mStatus, mSFA,
            tokens, n, k, num_groups, max_tiles, *(() if alpha is None else (alpha,)),
        )
        return kernel, {"grid": (1 + repack_ctas, 1, 1), "block": [TABLES_THREADS, 1, 1], "cluster": (1, 1, 1),
                        **core.chained_launch()}

    @cute.kernel
    def kernel(
        self,
        a: cute.Pointer,
        b: cute.Pointer,
        c: cute.Pointer,
        sfb: cute.Pointer,
        sfa_blocked: cute.Pointer,
        mOffsets: cute.Tensor,  # [G + 1] int32
        mPtrs: cute.Tensor,  # [G, 5] int64: problem a, b, c, sfa, sfb
        mSizes: cute.Tensor,  # [G, 4] int32: m, n, k, l
        mTiles: cute.Tensor,  # [max_tiles + 1, 4] int32
        mStatus: cute.Tensor,  # [1] int32
        mSFA: cute.Tensor,  # (T, K/256, 4) int32 words of the plain scales
        tokens: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        num_groups: cutlass.Int32,
        max_tiles: cutlass.Int32,
    ):
        self.tables_body(a, b, c, sfb, sfa_blocked, mOffsets, mPtrs, mSizes, mTiles, mStatus, mSFA, tokens, n, k,
                         num_groups, max_tiles, None)

    @cute.jit
    def tables_body(self, a, b, c, sfb, sfa_blocked, mOffsets, mPtrs, mSizes, mTiles, mStatus, mSFA, tokens, n, k,
                    num_groups, max_tiles, alpha):
        """The kernel's work, whatever its arguments: `alpha` None, or the experts' fp32 scales
        (Sm100MoeScaledTables), which CTA 0 copies after the tile rows (alpha_tail)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        @cute.struct
        class SharedStorage:
            offsets: cute.struct.MemRange[cutlass.Int32, MAX_GROUPS + 1]
            padded_first_row: cute.struct.MemRange[cutlass.Int32, MAX_GROUPS]
            rows: cute.struct.MemRange[cutlass.Int32, MAX_GROUPS]  # M_g, 0 for every g if bad
            sorted_group: cute.struct.MemRange[cutlass.Int32, MAX_GROUPS]
            sorted_tiles: cute.struct.MemRange[cutlass.Int32, MAX_GROUPS]
            sorted_first_tile: cute.struct.MemRange[cutlass.Int32, MAX_GROUPS]
            flags: cute.struct.MemRange[cutlass.Int32, 2]  # bad, tile count

        storage = utils.SmemAllocator().allocate(SharedStorage)
        sOffsets = storage.offsets.get_tensor(cute.make_layout(MAX_GROUPS + 1))
        sPadded = storage.padded_first_row.get_tensor(cute.make_layout(MAX_GROUPS))
        sRows = storage.rows.get_tensor(cute.make_layout(MAX_GROUPS))
        sSortedGroup = storage.sorted_group.get_tensor(cute.make_layout(MAX_GROUPS))
        sSortedTiles = storage.sorted_tiles.get_tensor(cute.make_layout(MAX_GROUPS))
        sSortedFirst = storage.sorted_first_tile.get_tensor(cute.make_layout(MAX_GROUPS))
        sFlags = storage.flags.get_tensor(cute.make_layout(2))

        # Chained calls: the offsets may be the previous kernel's output, and the previous
        # call's GEMM reads the tables and scales this grid rewrites: nothing before the wait.
        # The init kernel (this grid's dependent) waits for this grid's end before its reads.
        core.wait_for_previous_grid()
        core.launch_dependents()

        #
        # Warp 0 of every CTA: the offsets, their check, each group's padded first row
        #
        if warp_idx == 0:
            g0 = 2 * lane
            g1 = g0 + 1
            has0 = g0 < num_groups
            has1 = g1 < num_groups
            lo0 = cutlass.Int32(0)
            hi0 = cutlass.Int32(0)
            if has0:
                lo0 = mOffsets[g0]
                hi0 = mOffsets[g0 + 1]
            hi1 = hi0
            if has1:
                hi1 = mOffsets[g1 + 1]
            first = mOffsets[0]
            last = mOffsets[num_groups]
            bad = cute.arch.vote_any_sync((hi0 < lo0) | (hi1 < hi0) | (first < 0) | (last > tokens))
            m0 = hi0 - lo0
            m1 = hi1 - hi0
            if bad:
                m0 = cutlass.Int32(0)
                m1 = cutlass.Int32(0)
            padded0 = _round_up_rows(m0)
            padded_pair = padded0 + _round_up_rows(m1)
            p0 = warp_inclusive_sum(padded_pair, lane) - padded_pair
            p1 = p0 + padded0
            if has0:
                sOffsets[g0] = lo0
                sPadded[g0] = p0
                sRows[g0] = m0
            if has1:
                sOffsets[g1] = hi0
                sPadded[g1] = p1
                sRows[g1] = m1
            if lane == 0:
                sOffsets[num_groups] = last
                sFlags[0] = cutlass.Int32(0)
                if bad:
                    sFlags[0] = cutlass.Int32(1)
            cute.arch.sync_warp()

            if bidx == 0:
                self._write_group_tables(
                    a, b, c, sfb, sfa_blocked, mPtrs, mSizes, mTiles, mStatus, sRows, sSortedGroup,
                    sSortedTiles, sSortedFirst, sFlags, lane, g0, g1, has0, has1, lo0, hi0, m0, m1, p0, p1,
                    bad, n, k, num_groups, max_tiles,
                )
        cute.arch.sync_threads()

        if bidx == 0:
            self._write_tile_rows(mTiles, sRows, sSortedGroup, sSortedFirst, sFlags, tidx, n, k, num_groups)
            if cutlass.const_expr(alpha is not None):
                self._write_alpha_tail(mTiles, alpha, tidx, n, num_groups, max_tiles)
        else:
            self._repack_scales(sfa_blocked, mSFA, sOffsets, sPadded, sFlags, tidx, bidx, k, num_groups)

    @cute.jit
    def _write_alpha_tail(self, mTiles, alpha, tidx, n, num_groups, max_tiles):
        """CTA 0: after the count row, word 0 the first MMA m tile of N's second half (N / 2 /
        mma_m; N itself, past every tile, for one scale per expert), then two fp32 scales per
        expert (alpha[g], twice; or alpha[g, 0], alpha[g, 1]) for the GEMM's epilogue."""
        tail = mTiles.iterator + (max_tiles + 1) * TILE_ROW
        if tidx == 0:
            half = n
            if cutlass.const_expr(self.alpha == "halves"):
                half = n // 2 // self.config.mma_m
            cute.make_tensor(tail, cute.make_layout(1))[0] = half
        sAlpha = cute.make_tensor(cute.recast_ptr(tail + 1, dtype=cutlass.Float32), cute.make_layout(2 * MAX_GROUPS))
        mAlpha = cute.make_tensor(alpha, cute.make_layout(2 * MAX_GROUPS))
        for i in cutlass.range(tidx, 2 * num_groups, TABLES_THREADS):
            source = i
            if cutlass.const_expr(self.alpha == "expert"):
                source = i // 2
            sAlpha[i] = mAlpha[source]

    @cute.jit
    def _write_group_tables(
        self, a, b, c, sfb, sfa_blocked, mPtrs, mSizes, mTiles, mStatus, sRows, sSortedGroup, sSortedTiles,
        sSortedFirst, sFlags, lane, g0, g1, has0, has1, lo0, hi0, m0, m1, p0, p1, bad, n, k, num_groups,
        max_tiles,
    ):
        """CTA 0, warp 0: the pointer and size tables, the groups in plan_persistent_tiles' order
        (rank by descending M, ties by index) with their first tiles, the count and the status."""
        t = self.config.tokens_per_tile
        n_tiles = (n + self.config.mma_m - 1) // self.config.mma_m
        tiles0 = (m0 + t - 1) // t * n_tiles
        tiles1 = (m1 + t - 1) // t * n_tiles
        # Rank of each of the lane's groups: groups with more rows, or as many and a lower index
        rank0 = cutlass.Int32(0)
        rank1 = cutlass.Int32(0)
        for other in cutlass.range(num_groups, unroll=1):
            m_other = sRows[other]
            if (m_other > m0) | ((m_other == m0) & (other < g0)):
                rank0 = rank0 + 1
            if (m_other > m1) | ((m_other == m1) & (other < g1)):
                rank1 = rank1 + 1
        if has0:
            sSortedGroup[rank0] = g0
            sSortedTiles[rank0] = tiles0
        if has1:
            sSortedGroup[rank1] = g1
            sSortedTiles[rank1] = tiles1
        cute.arch.sync_warp()
        # First tile of sorted positions 2 lane, 2 lane + 1: one warp scan over the pairs
        sorted0 = cutlass.Int32(0)
        sorted1 = cutlass.Int32(0)
        if has0:
            sorted0 = sSortedTiles[g0]
        if has1:
            sorted1 = sSortedTiles[g1]
        pair = sorted0 + sorted1
        inclusive = warp_inclusive_sum(pair, lane)
        if has0:
            sSortedFirst[g0] = inclusive - pair
        if has1:
            sSortedFirst[g1] = inclusive - pair + sorted0
        count = cute.arch.shuffle_sync(inclusive, 31)
        # max_tiles bounds every offsets' count (max_moe_tiles); the clamp keeps a wrong capacity
        # from writing past the table, and the status says tiles were dropped (2)
        dropped = count > max_tiles
        count = cutlass.min(count, max_tiles)

        # Pointers and sizes of the lane's groups (a group with M = 0 gets no descriptors)
        half_k = k // 2
        scale_row_bytes = k // SF_VEC_SIZE
        for which in cutlass.range_constexpr(2):
            g, has, lo, m, padded = (g0, has0, lo0, m0, p0) if which == 0 else (g1, has1, hi0, m1, p1)
            if has:
                g64 = cutlass.Int64(g)
                mPtrs[g, core.PTR_A] = a.toint() + cutlass.Int64(lo) * half_k
                mPtrs[g, core.PTR_B] = b.toint() + g64 * (cutlass.Int64(n) * half_k)
                mPtrs[g, core.PTR_C] = c.toint() + cutlass.Int64(lo) * (n * 2)
                mPtrs[g, core.PTR_SFA] = sfa_blocked.toint() + cutlass.Int64(padded) * scale_row_bytes
                mPtrs[g, core.PTR_SFB] = sfb.toint() + g64 * (cutlass.Int64(n) * scale_row_bytes)
                mSizes[g, 0] = m
                mSizes[g, 1] = n
                mSizes[g, 2] = k
                mSizes[g, 3] = cutlass.Int32(1)
        if lane == 0:
            sFlags[1] = count
            mTiles[max_tiles, 0] = count
            mStatus[0] = cutlass.Int32(0)
            if dropped:
                mStatus[0] = cutlass.Int32(2)
            if bad:
                mStatus[0] = cutlass.Int32(1)

    @cute.jit
    def _write_tile_rows(self, mTiles, sRows, sSortedGroup, sSortedFirst, sFlags, tidx, n, k, num_groups):
        """CTA 0, every thread: tile rows (group, N tile, token tile, k-tiles), one 16-byte store
        each. A tile's sorted position is the last one whose first tile is <= the tile (groups
        with tiles come first in the order, with strictly increasing first tiles)."""
        t = self.config.tokens_per_tile
        count = sFlags[1]
        k_tiles = k // core.K_TILE
        tile_row = cute.make_rmem_tensor(cute.make_layout(TILE_ROW), cutlass.Int32)
        for tile in cutlass.range(tidx, count, TABLES_THREADS, unroll=1):
            position = cutlass.Int32(0)
            for step in cutlass.range_constexpr(len(SEARCH_STEPS)):
                probe = position + SEARCH_STEPS[step]
                # probe <= 63: the read stays in the array even past num_groups
                if (probe < num_groups) & (sSortedFirst[probe] <= tile):
                    position = probe
            group = sSortedGroup[position]
            local = tile - sSortedFirst[position]
            token_tiles = (sRows[group] + t - 1) // t
            n_tile = local // token_tiles
            tile_row[0] = group
            tile_row[1] = n_tile
            tile_row[2] = local - n_tile * token_tiles
            tile_row[3] = k_tiles
            cute.autovec_copy(tile_row, mTiles[(tile, None)])

    @cute.jit
    def _repack_scales(self, sfa_blocked, mSFA, sOffsets, sPadded, sFlags, tidx, bidx, k, num_groups):
        """CTAs >= 1: 16 bytes of one plain row (scale blocks 16 u .. 16 u + 15, atom columns
        4 u .. 4 u + 3) into the row's group's blocked atoms, four 4-byte stores 512 bytes apart."""
        units_per_row = k // (ATOM_K * 4)
        unit = (bidx - 1) * TABLES_THREADS + tidx
        row = unit // units_per_row
        unit_in_row = unit - row * units_per_row
        if (sFlags[0] == 0) & (row >= sOffsets[0]) & (row < sOffsets[num_groups]):
            # the row's group: the last g with offsets[g] <= row
            group = cutlass.Int32(0)
            for step in cutlass.range_constexpr(len(SEARCH_STEPS)):
                probe = group + SEARCH_STEPS[step]
                if (probe < num_groups) & (sOffsets[probe] <= row):
                    group = probe
            padded_row = sPadded[group] + row - sOffsets[group]
            words = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Int32)
            cute.autovec_copy(mSFA[(row, unit_in_row, None)], words)
            atoms_per_band = k // ATOM_K
            # word offset inside an atom: (row % 32) * 16 + ((row % 128) // 32) * 4 bytes
            in_atom = (padded_row % 32) * 4 + (padded_row % ATOM_ROWS) // 32
            band_atom = padded_row // ATOM_ROWS * atoms_per_band + unit_in_row * 4
            for i in cutlass.range_constexpr(4):
                word = (band_atom + i) * (ATOM_BYTES // 4) + in_atom
                cute.make_tensor(sfa_blocked + word, cute.make_layout(1))[0] = words[i]


class Sm100MoeScaledTables(Sm100MoeTables):
    """Sm100MoeTables with the experts' fp32 scales (`alpha`, [G] or [G, 2]) as one more
    argument, copied after the tile rows for the GEMM's epilogue (alpha_tail)."""

    @cute.jit
    def __call__(self, a: cute.Pointer, b: cute.Pointer, c: cute.Pointer, sfa: cute.Pointer, sfb: cute.Pointer,
                 sfa_blocked: cute.Pointer, offsets: cute.Pointer, ptrs: cute.Pointer, sizes: cute.Pointer,
                 tiles: cute.Pointer, status: cute.Pointer, alpha: cute.Pointer, tokens: cutlass.Int32,
                 n: cutlass.Int32, k: cutlass.Int32, num_groups: cutlass.Int32, max_tiles: cutlass.Int32,
                 repack_ctas: cutlass.Int32, stream: cuda.CUstream):
        kernel, geometry = self.tables_launch(
            a, b, c, sfa, sfb, sfa_blocked, offsets, ptrs, sizes, tiles, status,
            tokens, n, k, num_groups, max_tiles, repack_ctas, alpha,
        )
        kernel.launch(**geometry, stream=stream)

    @cute.kernel
    def kernel(self, a: cute.Pointer, b: cute.Pointer, c: cute.Pointer, sfb: cute.Pointer, sfa_blocked: cute.Pointer,
               mOffsets: cute.Tensor, mPtrs: cute.Tensor, mSizes: cute.Tensor, mTiles: cute.Tensor,
               mStatus: cute.Tensor, mSFA: cute.Tensor, tokens: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
               num_groups: cutlass.Int32, max_tiles: cutlass.Int32, alpha: cute.Pointer):
        self.tables_body(a, b, c, sfb, sfa_blocked, mOffsets, mPtrs, mSizes, mTiles, mStatus, mSFA, tokens, n, k,
                         num_groups, max_tiles, alpha)


def alpha_tail_rows(groups: int) -> int:
    """Tile-table rows after the count row that hold the epilogue's scales: one int32 (the
    second half's first MMA m tile) and two fp32 per expert."""
    return -(-(1 + 2 * groups) // TILE_ROW)


# =============================================================================
# The GEMM with its tile count in device memory
# =============================================================================
class PersistentMoeGemmSm100(PersistentGemmOnStream):
    """The library's stream-taking PersistentGemmSm100 over a tile table that the tables kernel
    writes on the GPU: the host passes the table's capacity (max_tiles) as num_tiles, and each
    warp role loads the count stored after the capacity's rows, after its griddepcontrol.wait
    (the tables are this call's output), clamped to the capacity. Its descriptor init is the
    library's (nvfp4_group_gemm.sm100.compile_persistent_init): the same device code."""

    def __init__(self, config: core.PersistentGemmConfig, alpha: str | None = None):
        super().__init__(config)
        self.alpha = alpha  # None, "expert" or "halves": the tables kernel's alpha_tail

    @cute.jit
    def _tile_count(self, tensor_of_tiles: cute.Tensor, num_tiles):
        count_ptr = tensor_of_tiles.iterator + num_tiles * TILE_ROW
        count = cute.make_tensor(count_ptr, cute.make_layout(1))[0]
        return cutlass.min(count, num_tiles)

    def _epilogue_scale(self, tensor_of_tiles: cute.Tensor, num_tiles, group_idx, mma_tile_m):
        """With alpha: the tile's expert scale from the tables kernel's alpha_tail (its second
        one where the tile lies in N's second half), read in the epilogue after its wait."""
        if cutlass.const_expr(self.alpha is None):
            return None
        tail = tensor_of_tiles.iterator + (num_tiles + 1) * TILE_ROW
        half = cute.make_tensor(tail, cute.make_layout(1))[0]
        scales = cute.make_tensor(cute.recast_ptr(tail + 1, dtype=cutlass.Float32), cute.make_layout(2 * MAX_GROUPS))
        return scales[2 * group_idx + cutlass.Int32(mma_tile_m >= half)]


# =============================================================================
# Builds (compiled for sm_100a; the keys carry what is baked into the code)
# =============================================================================
def _fake(dtype):
    return core.fake_ptr(dtype)


# Pointer dtypes of the tables entry's arguments (a caller's make_ptr must use the same)
TABLES_POINTER_DTYPES = (
    cutlass.Uint8, cutlass.Uint8, cutlass.Uint8, cutlass.Int32, cutlass.Uint8, cutlass.Int32,
    cutlass.Int32, cutlass.Int64, cutlass.Int32, cutlass.Int32, cutlass.Int32,
)


def moe_tables_build(config: core.PersistentGemmConfig, alpha: str | None = None) -> tuple:
    sizes = (cutlass.Int32(128), cutlass.Int32(256), cutlass.Int32(256), cutlass.Int32(1), cutlass.Int32(1),
             cutlass.Int32(1), cuda.CUstream(0))
    pointers = tuple(_fake(dtype) for dtype in TABLES_POINTER_DTYPES)
    if alpha is None:
        return Sm100MoeTables(config), (*pointers, *sizes)
    return Sm100MoeScaledTables(config, alpha), (*pointers, _fake(cutlass.Float32), *sizes)


def moe_gemm_build(config: core.PersistentGemmConfig, alpha: str | None = None) -> tuple:
    return PersistentMoeGemmSm100(config, alpha), (_fake(cutlass.Int32), _fake(cutlass.Int64), cutlass.Int32(1),
                                                   cutlass.Int32(1), cutlass.Int32(1), cuda.CUstream(0))


def compile_moe_tables(config: core.PersistentGemmConfig, options: str | None = None, alpha: str | None = None):
    """The tables + repack kernel for `config`'s token tile (T, G, N, K, the capacity and the
    repack grid are run-time values); with `alpha` ("expert", "halves") it copies the experts'
    scales after the tile rows."""
    return core.compile_once(moe_tables_build, config, alpha, options=options)


def compile_moe_gemm(config: core.PersistentGemmConfig, options: str | None = None, alpha: str | None = None):
    """The persistent GEMM reading its tile count from device memory, for `config` (its
    out_dtype: C's), with the experts' scales in its epilogue where `alpha` says."""
    return core.compile_once(moe_gemm_build, config, alpha, options=options)


def compile_targets():
    """This module's kernels for the build report: (kernel name, arch, compile(G, options)); one
    build serves every G."""
    targets = []
    for tokens, config in core.PERSISTENT_CONFIGS.items():
        targets += [
            (f"sm100_moe_tables_t{tokens}", config.arch,
             lambda g, options, config=config: compile_moe_tables(config, options)),
            (f"sm100_moe_gemm_t{tokens}", config.arch,
             lambda g, options, config=config: compile_moe_gemm(config, options)),
        ]
    # the real-checkpoint epilogue: a scale per expert (or per half of N) and bf16 output
    bf16 = dataclasses.replace(core.PERSISTENT_CONFIGS[128], out_dtype="bfloat16")
    targets += [
        ("sm100_moe_tables_t128_halves", bf16.arch, lambda g, options: compile_moe_tables(bf16, options, "halves")),
        ("sm100_moe_init_t128_bf16", bf16.arch, lambda g, options: compile_persistent_init(bf16, options)),
        ("sm100_moe_gemm_t128_halves_bf16", bf16.arch, lambda g, options: compile_moe_gemm(bf16, options, "halves")),
    ]
    return targets


# =============================================================================
# One call's launches (host side)
# =============================================================================
@dataclasses.dataclass(frozen=True)
class Sm100MoeLaunch:
    """One launch of a MoE call: what runs, over which grid, and what it reads and writes."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    cluster: tuple[int, int, int]
    does: str


class Sm100MoeLaunches:
    """The launch sequence of one MoE call on sm_100 for (T, G, N, K), every grid fixed by those
    alone: the tables + repack kernel, the leaderboard file's descriptor init (unchanged), the
    persistent GEMM with its tile count in device memory.

    Compiled for sm_100a only: the kernels are built and read on a CPU; this sequence has never
    run (there is no B200 here), so `launch` is untested. The token tile is chosen from (T, G, N,
    K) as for G groups of ceil(T / G) tokens (choose_tokens_per_tile): the host never sees the
    routing. CTA pairs: min(resident 2-CTA clusters, or SMs / 2 without a device, max_tiles)."""

    def __init__(self, tokens: int, groups: int, n: int, k: int, *, config=None,
                 resident_clusters: int | None = None, num_sms: int = core.B200_NUM_SMS, alpha: str | None = None,
                 out_dtype: str = "float16"):
        if not 1 <= groups <= MAX_GROUPS:
            raise ValueError(f"G = {groups}: must be in 1..{MAX_GROUPS} (the tables kernel's warp holds 64 groups)")
        if k <= 0 or k % core.K_TILE:
            raise ValueError(f"K = {k}: must be a positive multiple of {core.K_TILE}")
        if n <= 0 or n % ATOM_ROWS:
            raise ValueError(f"N = {n}: must be a positive multiple of {ATOM_ROWS} (the weights' scale atoms)")
        if tokens < 1:
            raise ValueError(f"T = {tokens}: must be >= 1")
        if alpha == "halves" and n % (2 * core.PersistentGemmConfig.mma_m):
            raise ValueError(f"N = {n}: must be a multiple of {2 * core.PersistentGemmConfig.mma_m} with alpha [G, 2] "
                             "(each half of N a whole number of 256-row MMA tiles)")
        self.tokens, self.groups, self.n, self.k = tokens, groups, n, k
        self.alpha = alpha
        if config is None:
            even = [(_ceil_div(tokens, groups), n, k, 1)] * groups
            config = core.PERSISTENT_CONFIGS[core.choose_tokens_per_tile(even, num_sms)]
        self.config = dataclasses.replace(config, out_dtype=out_dtype)
        self.max_tiles = max_moe_tiles(tokens, groups, n, config.tokens_per_tile, config.mma_m)
        self.repack_ctas = moe_repack_ctas(tokens, k)
        self.scratch_rows = moe_scale_scratch_rows(tokens, groups)
        clusters = resident_clusters if resident_clusters is not None else max(num_sms // 2, 1)
        self.num_clusters = max(1, min(clusters, self.max_tiles))

    def sequence(self) -> list[Sm100MoeLaunch]:
        """The three launches in order (each the programmatic dependent of the one before where
        core.SM100_CHAIN_CALLS)."""
        gemm = core.PersistentGemmSm100
        return [
            Sm100MoeLaunch(
                "sm100_moe_tables", (1 + self.repack_ctas, 1, 1), (TABLES_THREADS, 1, 1), (1, 1, 1),
                "reads offsets; CTA 0 writes ptrs [G,5], sizes [G,4], the tile rows and count, status; "
                "CTAs >= 1 repack sfa into per-group blocked atoms",
            ),
            Sm100MoeLaunch(
                "sm100_persistent_init", (1, 1, self.groups), (32, 1, 1), (1, 1, 1),
                "the file's init_tensormaps_kernel: five TMA descriptors per group with M_g > 0",
            ),
            Sm100MoeLaunch(
                "sm100_moe_gemm", (2 * self.num_clusters, 1, 1), (192, 1, 1), (2, 1, 1),
                f"{gemm.__name__} over the first `count` of {self.max_tiles} table rows, "
                f"{self.config.tokens_per_tile} tokens per tile",
            ),
        ]

    def buffer_shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Device buffers one call needs besides its operands: name -> (dtype, shape)."""
        return {
            "ptrs": ("int64", (self.groups, core.NUM_PTR_COLS)),
            "sizes": ("int32", (self.groups, 4)),
            "tiles": ("int32", (self.max_tiles + 1 + (0 if self.alpha is None else alpha_tail_rows(self.groups)),
                                TILE_ROW)),
            "tensormaps": ("int64", (self.groups, core.PERSISTENT_NUM_TENSORMAPS, 16)),
            "sfa_blocked": ("uint8", (self.scratch_rows, self.k // SF_VEC_SIZE)),
            "status": ("int32", (1,)),
        }

    def allocate(self, device) -> dict:
        """The buffers of buffer_shapes on `device` (torch tensors)."""
        import torch

        return {name: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                for name, (dtype, shape) in self.buffer_shapes().items()}

    def compile(self) -> tuple:
        """The three compiled entries (cached): tables, descriptor init, GEMM."""
        return (compile_moe_tables(self.config, alpha=self.alpha), compile_persistent_init(self.config),
                compile_moe_gemm(self.config, alpha=self.alpha))

    def launch(self, a, sfa, b, sfb, offsets, c, buffers: dict, stream: cuda.CUstream, alpha=None) -> None:
        """Queue the three launches on `stream` (torch tensors: a [T, K/2], sfa plain [T, K/16],
        b [G, N, K/2], sfb blocked, offsets [G + 1] int32, c [T, N] of the config's out_dtype,
        alpha fp32 [G] or [G, 2] where the sequence has one; `buffers` from allocate). Compiled
        for sm_100a only, never run: untested."""
        tables, init, gemm = self.compile()

        def ptr(dtype, tensor):
            return core.gmem_ptr(dtype, tensor)

        scales = () if self.alpha is None else (ptr(cutlass.Float32, alpha),)
        tables(
            *(ptr(dtype, tensor) for dtype, tensor in zip(TABLES_POINTER_DTYPES, (
                a, b, c, sfa, sfb, buffers["sfa_blocked"], offsets, buffers["ptrs"], buffers["sizes"],
                buffers["tiles"], buffers["status"],
            ), strict=True)),
            *scales, self.tokens, self.n, self.k, self.groups, self.max_tiles, self.repack_ctas, stream,
        )
        init(ptr(cutlass.Int64, buffers["ptrs"]), ptr(cutlass.Int32, buffers["sizes"]),
             ptr(cutlass.Int64, buffers["tensormaps"]), self.groups, stream)
        gemm(ptr(cutlass.Int32, buffers["tiles"]), ptr(cutlass.Int64, buffers["tensormaps"]),
             self.groups, self.max_tiles, self.num_clusters, stream)


def sm100_moe_launches(tokens: int, groups: int, n: int, k: int, **kwargs) -> Sm100MoeLaunches:
    """The launch sequence of a MoE call of (T, G, N, K) on sm_100 (Sm100MoeLaunches; compiled
    for sm_100a only, never run)."""
    return Sm100MoeLaunches(tokens, groups, n, k, **kwargs)
