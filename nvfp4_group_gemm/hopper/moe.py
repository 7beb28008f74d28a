"""The sm_90a kernels of the MoE entry (nvfp4_group_gemm.moe): stacked activations whose group
boundaries arrive as an int32 offsets tensor on the GPU, read by the kernels themselves.

A call is two launches whose grids depend only on (T, G, N, K), never on the offsets:

    pre-pass (Sm90MoeDecodeActivations): one thread per 16-element block of each of the T rows;
        it finds its row's group by a binary search of the offsets, and decodes the row (a x sfa,
        plain [T, K/16] or blocked scales) into that group's slab rows of X;
    GEMM (Sm90MoeSwapAbGemm, the swap-AB GEMM of swap_ab.py): a grid of max_moe_tiles(T, G, N)
        tiles (per split-K rank); each CTA derives its (group, token tile, weight tile) from the
        offsets, every warp alike: its lanes read the groups 32 at a time and a warp prefix sum
        of their tile counts finds the group of the CTA's tile (locate_tile); CTAs past the
        offsets' tile count run nothing. Variable token tiles are cut at 128 or 256 tokens,
        whichever the offsets make fit (moe_token_cap).
        A loop over the groups per thread (two global loads per group): 17 µs per CTA at G = 64,
        136 µs for a one-token layer (EXPERIMENTS E80).

W4A16 (Sm90MoeW4A16Gemm): bf16 activations a[T, K] are read by the GEMM itself, its token rows
copied straight from a's rows of the group (no pre-pass, no X); the weights decode into bf16 in
natural K order; CTA 0 checks the offsets and writes status.

Group g holds rows offsets[g] .. offsets[g + 1] of a and c. In X, its rows start at
P_g = 16 (ceil(offsets[g] / 16) + g) (group_x_row: token tiles must start on a 16-row boundary
for the slabs' swizzle; P_g + M_g <= P_(g+1) for any g), a function of offsets[g] alone, so
neither kernel sums over the groups before g; X holds 16 (ceil(T / 16) + G) rows plus one
token tile of reads past the last group. The tiles run group first, then weight tile, then
token tile, as the per-size-set tables. At most min(G, T) groups hold a row, which bounds
the grid (max_moe_tiles).

Offsets are checked on the GPU by both kernels alike, every warp reading them lane-strided
(read_groups): 0 <= offsets[0] <= ... <= offsets[G] <= T. Offsets that break it make every CTA
of both kernels skip its work (c is left as it was, nothing is written outside c) and the pre-pass writes 1 into `status[0]` (0 otherwise),
which the caller reads when it chooses to synchronize."""

from __future__ import annotations

import dataclasses
import functools

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute

from nvfp4_group_gemm import core
from nvfp4_group_gemm.weight_layout import FRAGMENT, WEIGHT_LAYOUTS

from .config import SF_VEC_SIZE, SWAP_AB_HALF_K, SwapAbConfig
from .kernel import decode_rows_to_fragment, smem_per_sm_known_without_gpu
from .ptx import (
    cp_async_16B,
    cp_async_mbarrier_arrive_noinc,
    decode_scale_blocks_global,
    fence_proxy_async_shared_cta,
    load_f32_global,
    load_i64_global,
)
from .schedules import TOKEN_CLASS_STEP
from .swap_ab import (
    DECODE_THREADS,
    Sm90SwapAbGemm,
    activation_chunk_offsets,
    activation_scale_offset,
    fake_ptr,
    token_stage_chunk_offset,
)

# Rows of a group's padded slab start on multiples of this (the slab swizzle repeats every 8
# rows; token tiles start on multiples of 16)
GROUP_ROW_ALIGN = 16
# Activation scale layouts the pre-pass reads: plain [T, K/16] e4m3 (what a quantizer writes),
# or blocked (cuBLAS's 128x4 atoms over the stacked rows, [ceil(T/128), K/64, 32, 4, 4])
ACTIVATION_SCALE_LAYOUTS = ("plain", "blocked")


def group_x_row(first_row, group):
    """P_g, the first row of group g in X (device or Python integers): 16 (ceil(offsets[g] / 16)
    + g). A multiple of GROUP_ROW_ALIGN, and P_g + M_g < P_(g+1) for any M_g = offsets[g + 1] -
    offsets[g] >= 0, from offsets[g] alone (no sum over the groups before g)."""
    return ((first_row + GROUP_ROW_ALIGN - 1) // GROUP_ROW_ALIGN + group) * GROUP_ROW_ALIGN


def slab_rows(tokens: int, groups: int, config: SwapAbConfig) -> int:
    """Rows of each k-tile slab of X for T = tokens: up to P_G = group_x_row(T, G), plus one
    token tile read past the last group's rows."""
    return group_x_row(tokens, groups) + -(-config.tile_tokens // GROUP_ROW_ALIGN) * GROUP_ROW_ALIGN


def max_moe_tiles(tokens: int, groups: int, n: int, config: SwapAbConfig, fill_ctas: int = 0) -> int:
    """The most (group, token tile, weight tile) tiles any offsets of T = tokens rows in `groups`
    groups make, the GEMM's grid. At most h = min(G, T) groups hold a row, so sum ceil(M_g / t)
    <= (T + h (t - 1)) / t token tiles of t = tile_tokens, times N / tile_weights. Variable
    tiles cut a group into ceil(M / cap) tiles (cap 256: at most T / 256 + h per weight tile),
    or with cap 128 where those number no more than `fill_ctas` (moe_token_cap)."""
    weight_tiles = n // config.tile_weights
    holding = min(groups, tokens)
    if config.variable_tokens:
        return max(1, (tokens // config.tile_tokens + holding) * weight_tiles, fill_ctas)
    t = config.tile_tokens
    return max(1, (tokens + holding * (t - 1)) // t * weight_tiles)


# Variable token tiles of the MoE GEMM: a group is cut into at most ceil(M / 128) tiles (of 64
# or 128 tokens) where those tiles, over all groups and weight tiles, fit the CTAs of one round
# (fill_ctas: one per SM); else into ceil(M / 256) (64 to 256 tokens), as the per-size-set
# path's variable tiles. Decided on the GPU from the offsets: benchmark shape 3's routing
# (128 + 384 tokens) fits one round of 128-token tiles, most routings of 512 tokens in two
# groups do not.
SMALL_TOKEN_CAP = 128


# Lanes of a warp: the kernels read the offsets 32 groups at a time
WARP = 32


@cute.jit
def read_groups(mOffsets: cute.Tensor, num_groups: cutlass.Constexpr, lane, tokens):
    """The groups lane, lane + 32, ... of this lane: (bad, their first rows, their row counts;
    0 past G). `bad`, the same in every lane (one vote): the offsets break 0 <= offsets[0] <=
    ... <= offsets[G] <= T."""
    bad = (mOffsets[0] < 0) | (mOffsets[num_groups] > tokens)
    firsts, rows = [], []
    for j in cutlass.range_constexpr((num_groups + WARP - 1) // WARP):
        g = lane + WARP * j
        first = cutlass.Int32(0)
        m_g = cutlass.Int32(0)
        if g < num_groups:
            first = mOffsets[g]
            m_g = mOffsets[g + 1] - first
        bad = bad | (m_g < 0)
        firsts.append(first)
        rows.append(m_g)
    return cute.arch.vote_any_sync(bad), firsts, rows


@cute.jit
def warp_inclusive_sum(value, lane):
    """The sum of `value` over lanes 0 .. lane (Kogge-Stone, five shuffles). shfl.up's clamp
    operand is 0 (the lowest source lane): the DSL's default, 31, would make every lane below
    31 read its own value."""
    for d in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(value, 1 << d, mask_and_clamp=0)
        if lane >= (1 << d):
            value = value + other
    return value


def first_lane(ballot):
    """The lowest set bit's index of a nonzero ballot."""
    return cute.arch.popc((ballot & (cutlass.Int32(0) - ballot)) - 1)


def moe_token_cap(group_rows, weight_tiles: int, fill_ctas: int, tile_tokens: int = 256) -> int:
    """The variable-tile cap of these group sizes (Python ints; the kernel computes the same
    on the GPU): SMALL_TOKEN_CAP if sum ceil(M / 128) x weight tiles <= fill_ctas, else 256."""
    tiles = sum(-(-m // SMALL_TOKEN_CAP) for m in group_rows) * weight_tiles
    return SMALL_TOKEN_CAP if tiles <= fill_ctas else tile_tokens


def _at_least_one(x):
    return max(x, 1) if isinstance(x, int) else cutlass.max(x, cutlass.Int32(1))


def group_token_tiles(m, tile_tokens: int, variable: bool):
    """(token tiles, tokens per tile but the last) of a group of m >= 0 rows (device or Python
    integers): tiles of tile_tokens, or with variable tiles ceil(m / cap) tiles of equal size
    rounded up to 64, cap = tile_tokens (schedules.variable_token_split at 256; m = 0: no tiles)."""
    if variable:
        per_group = _at_least_one((m + tile_tokens - 1) // tile_tokens)
        per_tile = (m + per_group - 1) // per_group
        size = _at_least_one((per_tile + TOKEN_CLASS_STEP - 1) // TOKEN_CLASS_STEP) * TOKEN_CLASS_STEP
        return (m + size - 1) // size, size
    return (m + tile_tokens - 1) // tile_tokens, tile_tokens


# What the MoE GEMM's epilogue applies to the fp32 sums before rounding, and the output's dtype
ALPHA_MODES = (None, "expert", "halves")
OUT_DTYPES = ("float16", "bfloat16")
# MoeEpilogue.activation: none, or SwiGLU over interleaved gate-and-up rows (swiglu_row_order)
ACTIVATIONS = (None, "swiglu")
# the rows of a SwiGLU weight interleaved in blocks of 2 x this: a lane's accumulators of weight
# rows g and g + 8 of each 16 (wgmma's fragment) are a column's gate and up
SWIGLU_INTERLEAVE = 8


def swiglu_row_order(n: int) -> list[int]:
    """The row order of a fused gate-and-up weight [N = 2 I, ...] (gate rows 0 .. I - 1, then up
    rows) for the SwiGLU epilogue: row p of the interleaved weight is row order[p] of the fused
    one, 8 gate rows then their 8 up rows (p = 16 b + s: gate row 8 b + s for s < 8, else up
    row I + 8 b + s - 8). N a multiple of 128 (the weight tile: 64 intermediate columns)."""
    if n % 128:
        raise ValueError(f"N = {n}: a SwiGLU weight's N must be a multiple of 128 (the weight tile)")
    half, block = n // 2, SWIGLU_INTERLEAVE
    return [(p // (2 * block)) * block + p % block + (half if p % (2 * block) >= block else 0) for p in range(n)]


@dataclasses.dataclass(frozen=True)
class MoeEpilogue:
    """The MoE GEMM's epilogue: `alpha` None (no scale: the kernel of before, bit for bit),
    "expert" (one fp32 scale per expert, alpha [G]: the checkpoint's input_scale x
    weight_scale_2) or "halves" (alpha [G, 2], one per half of N: a fused gate-and-up weight
    whose two halves carry their own weight_scale_2), multiplied into the fp32 sums before
    they are rounded; `out_dtype` "float16" or "bfloat16" (c's dtype); `activation` None, or
    "swiglu": the weight rows interleaved by 8 (swiglu_row_order: gate rows, then their up
    rows), each gate and up output rounded to out_dtype as the GEMM's would be, then silu(gate)
    x up in fp32, rounded again: c [rows, N / 2] (with alpha "halves": the gate's scale, the up's)."""

    alpha: str | None = None
    out_dtype: str = "float16"
    activation: str | None = None

    def __post_init__(self):
        if self.alpha not in ALPHA_MODES or self.out_dtype not in OUT_DTYPES or self.activation not in ACTIVATIONS:
            raise ValueError(f"MoeEpilogue({self.alpha!r}, {self.out_dtype!r}, {self.activation!r}): alpha one of "
                             f"{ALPHA_MODES}, out_dtype one of {OUT_DTYPES}, activation one of {ACTIVATIONS}")


@dataclasses.dataclass(frozen=True)
class MoeRows:
    """Where the MoE GEMM's grouped rows come from and go to (int64 indices on the GPU, one per
    grouped row r): `gather`, row r reads a's row a_rows[r] (the token rows of sorted pairs, no
    gathered copy); `scatter`, its output goes to c's row c_rows[r] (the un-permute). An index
    outside a's (c's) rows reads zeros (writes nothing). Neither (the default): row r of a and c,
    the kernels of before. W4A16 GEMMs only (Sm90MoeW4A16RowsGemm)."""

    gather: bool = False
    scatter: bool = False

    @property
    def any(self) -> bool:
        return self.gather or self.scatter


class StackedOperands:
    """A MoE tile's group operands for Sm90SwapAbGemm.run_tile (swap_ab.TableOperands' interface):
    values derived on the GPU from the offsets, the same whatever the group argument; `alpha_addr`
    the address of the group's epilogue scales (None: none); `gather` and `scatter` the group's
    row indices where the GEMM has them (MoeRows)."""

    def __init__(self, m, n, k, b_addr, sfb_addr, c_addr, x_addr, slab_bytes, alpha_addr=None, gather=None,
                 scatter=None):
        self.sizes = (m, n, k)
        self.addresses = {1: b_addr, 2: c_addr, 4: sfb_addr}  # swap_ab's _PTR_B, _PTR_C, _PTR_SFB
        self.acts = (x_addr, slab_bytes)
        self.alpha_addr = alpha_addr
        # MoeRows: (the group's first a_rows address, a's row count) / (its first c_rows
        # address, c's base address, c's row count), or None: rows of a and c in group order
        self.gather, self.scatter = gather, scatter

    def size(self, group, field):
        return self.sizes[field]

    def address(self, group, column):
        return self.addresses[column]

    def activations(self, group, field):
        return self.acts[field]


class Sm90MoeDecodeActivations:
    """Pre-pass of the MoE entry: the fp16 decode of every row of a[T, K/2] inside a group into
    that group's padded rows of X (slab layout of swap_ab.activation_chunk_offsets)."""

    def __init__(self, num_groups: int, scale_layout: str = "plain", chained: bool = False):
        if scale_layout not in ACTIVATION_SCALE_LAYOUTS:
            raise ValueError(f"scale_layout={scale_layout!r}: must be one of {', '.join(ACTIVATION_SCALE_LAYOUTS)}")
        self.num_groups = num_groups
        self.scale_layout = scale_layout
        self.chained = chained

    @cute.jit
    def __call__(
        self, a: cute.Pointer, sfa: cute.Pointer, offsets: cute.Pointer, acts: cute.Pointer, status: cute.Pointer,
        tokens: cutlass.Int32, k: cutlass.Int32, slab_bytes: cutlass.Int32, blocks_x: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        mOffsets = cute.make_tensor(offsets, cute.make_layout(self.num_groups + 1))
        mStatus = cute.make_tensor(status, cute.make_layout(1))
        self.kernel(a, sfa, mOffsets, acts, mStatus, tokens, k, slab_bytes).launch(
            grid=(blocks_x, 1, 1), block=(DECODE_THREADS, 1, 1), use_pdl=self.chained, stream=stream,
        )

    @cute.kernel
    def kernel(self, a: cute.Pointer, sfa: cute.Pointer, mOffsets: cute.Tensor, acts: cute.Pointer,
               mStatus: cute.Tensor, tokens: cutlass.Int32, k: cutlass.Int32, slab_bytes: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.chained):
            # launched as the previous kernel's programmatic dependent: the offsets and the
            # activations may be its output, so nothing is read before this
            cute.arch.griddepcontrol_wait()
        # the GEMM (this grid's programmatic dependent) reads the offsets before its own wait:
        # everything before this grid is complete by now
        cute.arch.griddepcontrol_launch_dependents()
        blocks_per_row = k // SF_VEC_SIZE
        item = bidx * DECODE_THREADS + tidx
        row = item // blocks_per_row
        block = item - row * blocks_per_row
        lane = tidx % WARP
        bad, _, _ = read_groups(mOffsets, self.num_groups, lane, tokens)
        if bidx == 0 and tidx == 0:
            if bad:
                mStatus[0] = cutlass.Int32(1)
            else:
                mStatus[0] = cutlass.Int32(0)
        if not bad and row >= mOffsets[0] and row < mOffsets[self.num_groups]:
            # the row's group g: the last one with offsets[g] <= row (binary search; groups
            # emptied in between share their offset with the next); X row = row + P_g - offsets[g].
            # A loop over every group per thread: 186 µs at T = 32768, G = 64 (EXPERIMENTS E80).
            lo = cutlass.Int32(0)
            hi = cutlass.Int32(self.num_groups)
            for _ in cutlass.range_constexpr((self.num_groups - 1).bit_length()):
                mid = (lo + hi) // 2
                if mOffsets[mid] <= row:
                    lo = mid
                else:
                    hi = mid
            first = mOffsets[lo]
            shift = group_x_row(first, lo) - first
            src = a.toint() + cutlass.Int64(row) * (k // 2) + block * (SF_VEC_SIZE // 2)
            if cutlass.const_expr(self.scale_layout == "plain"):
                scale = sfa.toint() + cutlass.Int64(row) * blocks_per_row + block
            else:
                scale = sfa.toint() + activation_scale_offset(cutlass.Int64(row), block, k)
            dst_lo, dst_hi = activation_chunk_offsets(cutlass.Int64(row + shift), block, slab_bytes)
            acts_base = acts.toint()
            decode_scale_blocks_global([(src, scale, acts_base + dst_lo, acts_base + dst_hi)])


class Sm90MoeSwapAbGemm(Sm90SwapAbGemm):
    """The swap-AB GEMM over stacked tokens: Sm90SwapAbGemm's tile (run_tile) with its group,
    tokens and weight tile derived from the offsets on the GPU (group first, then weight tile,
    then token tile), weights b[G, N, K/2] and their blocked scales [G, N/128, K/64, 512 bytes], output rows
    offsets[g] .. offsets[g + 1] of c[T, N] in the epilogue's dtype (MoeEpilogue; its alpha is
    Sm90MoeScaledGemm's)."""

    def __init__(self, config: SwapAbConfig, num_groups: int, epilogue: MoeEpilogue = MoeEpilogue()):
        super().__init__(config, num_groups)
        self.epilogue = epilogue
        self.out_dtype = epilogue.out_dtype
        self.rows = MoeRows()  # a's and c's rows in group order (Sm90MoeW4A16RowsGemm maps them)
        self.swiglu = epilogue.activation == "swiglu"

    @cute.jit
    def __call__(
        self, acts: cute.Pointer, b: cute.Pointer, sfb: cute.Pointer, c: cute.Pointer, offsets: cute.Pointer,
        tokens: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, slab_bytes: cutlass.Int32,
        max_tiles: cutlass.Int32, fill_ctas: cutlass.Int32, stream: cuda.CUstream,
    ):
        self.define_shared_storage()
        mOffsets = cute.make_tensor(offsets, cute.make_layout(self.num_groups + 1))
        self.kernel(acts, b, sfb, c, mOffsets, tokens, n, k, slab_bytes, fill_ctas).launch(
            grid=(max_tiles * self.config.split_k, 1, 1), stream=stream, **self.launch_attributes())

    @cute.jit
    def locate_tile(self, mOffsets: cute.Tensor, tidx, tile_idx, weight_tiles, tokens, fill_ctas):
        """This CTA's tile among every group's (token tiles x weight tiles), group first, the
        same in every warp: the lanes read the groups lane, lane + 32, ... (one load pair per
        32 groups), the variable tiles' cap is one warp sum (moe_token_cap), and per round of
        32 groups a warp prefix sum of the tile counts, one ballot, and shuffles from the lane
        whose group holds the tile. Returns (found, group, local tile, M, first row, token
        tiles, tile size, bad); found is false for a CTA past the tile count or bad offsets
        (bad: the offsets break the rule, the same in every lane)."""
        # Up to 4 groups every thread walking them in turn instead: no faster (EXPERIMENTS E81).
        lane = tidx % WARP
        rounds = (self.num_groups + WARP - 1) // WARP
        bad, firsts, rows = read_groups(mOffsets, self.num_groups, lane, tokens)
        cap = self.tile_t
        if cutlass.const_expr(self.config.variable_tokens):
            small = cutlass.Int32(0)
            for j in cutlass.range_constexpr(rounds):
                small = small + (rows[j] + SMALL_TOKEN_CAP - 1) // SMALL_TOKEN_CAP
            small = cute.arch.warp_reduction_sum(small)
            cap = cutlass.Int32(self.tile_t)
            if small * weight_tiles <= fill_ctas:
                cap = cutlass.Int32(SMALL_TOKEN_CAP)
        found = cutlass.Int32(0)
        group = cutlass.Int32(0)
        local = cutlass.Int32(0)
        m = cutlass.Int32(0)
        row0 = cutlass.Int32(0)
        token_tiles = cutlass.Int32(1)
        tile_size = cutlass.Int32(self.tile_t)
        before = cutlass.Int32(0)  # tiles of the rounds before
        for j in cutlass.range_constexpr(rounds):
            tiles_g, size_g = group_token_tiles(rows[j], cap, self.config.variable_tokens)
            count = tiles_g * weight_tiles
            inclusive = warp_inclusive_sum(count, lane) + before
            hit = cute.arch.vote_ballot_sync(tile_idx < inclusive)
            if found == 0 and hit != 0:
                src = first_lane(hit)
                found = cutlass.Int32(1)
                group = src + WARP * j
                local = tile_idx - cute.arch.shuffle_sync(inclusive - count, src)
                m = cute.arch.shuffle_sync(rows[j], src)
                row0 = cute.arch.shuffle_sync(firsts[j], src)
                token_tiles = cute.arch.shuffle_sync(tiles_g, src)
                tile_size = cute.arch.shuffle_sync(size_g, src)
            before = cute.arch.shuffle_sync(inclusive, WARP - 1)
        if bad:
            found = cutlass.Int32(0)
        return found, group, local, m, row0, token_tiles, tile_size, bad

    @cute.kernel
    def kernel(self, acts: cute.Pointer, b: cute.Pointer, sfb: cute.Pointer, c: cute.Pointer,
               mOffsets: cute.Tensor, tokens: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
               slab_bytes: cutlass.Int32, fill_ctas: cutlass.Int32):
        self.moe_tile(acts, b, sfb, c, mOffsets, tokens, n, k, slab_bytes, fill_ctas, None)

    @cute.jit
    def moe_tile(self, acts: cute.Pointer, b: cute.Pointer, sfb: cute.Pointer, c: cute.Pointer,
                 mOffsets: cute.Tensor, tokens: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                 slab_bytes: cutlass.Int32, fill_ctas: cutlass.Int32, alpha, mStatus=None, row_maps=None):
        """A CTA's tile, whatever the kernel's arguments: `alpha` None, or the epilogue scales'
        pointer (Sm90MoeScaledGemm); `mStatus` None, or the status word CTA 0 writes from the
        offsets' check (the W4A16 GEMM, which has no pre-pass to write it); `row_maps` None, or
        (a_rows, c_rows, a's rows, c's rows) of a GEMM with MoeRows (Sm90MoeW4A16RowsGemm)."""
        if cutlass.const_expr(self.config.chain_calls):
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        sX_ptr, w_base, mbar_base, a_frag, accumulators_by_class = self.cta_resources()
        classes = self.token_classes()
        variable = self.config.variable_tokens
        tile_idx = bidx // self.config.split_k
        weight_tiles = n // self.tile_w
        # Variable tiles longest first (the per-size-set path's order), per token class over
        # every group at each CTA's start: slower (EXPERIMENTS E78).
        found, group, local, m, row0, token_tiles, tile_size, bad = self.locate_tile(
            mOffsets, tidx, tile_idx, weight_tiles, tokens, fill_ctas)
        if cutlass.const_expr(mStatus is not None):  # noqa: SIM102 - a trace-time branch around a device one
            if bidx == 0 and tidx == 0:
                if bad:
                    mStatus[0] = cutlass.Int32(1)
                else:
                    mStatus[0] = cutlass.Int32(0)
        pad0 = group_x_row(row0, group)

        if found != 0:
            weight_tile = local // token_tiles
            token0 = (local - weight_tile * token_tiles) * tile_size
            operands = StackedOperands(
                m, n, k,
                b.toint() + cutlass.Int64(group) * (cutlass.Int64(n) * (k // 2)),
                sfb.toint() + cutlass.Int64(group) * (cutlass.Int64(n) * (k // SF_VEC_SIZE)),
                c.toint() + cutlass.Int64(row0) * (n // 2 if cutlass.const_expr(self.swiglu) else n) * 2,
                self.group_tokens_address(acts, row0, pad0, slab_bytes),
                slab_bytes,
                None if cutlass.const_expr(alpha is None) else alpha.toint() + cutlass.Int64(group) * (
                    4 * (2 if cutlass.const_expr(self.epilogue.alpha == "halves") else 1)),
            )
            if cutlass.const_expr(row_maps is not None):
                a_rows, c_rows, a_row_count, c_row_count = row_maps
                if cutlass.const_expr(self.rows.gather):
                    operands.gather = (a_rows.toint() + cutlass.Int64(row0) * 8, a_row_count)
                if cutlass.const_expr(self.rows.scatter):
                    operands.scatter = (c_rows.toint() + cutlass.Int64(row0) * 8, c.toint(), c_row_count)
            if cutlass.const_expr(variable):
                # the tile's tokens: tile_size, or what is left of the group's rows for its
                # last tile, rounded up to 64; one main loop per count
                left = (m - token0 + TOKEN_CLASS_STEP - 1) // TOKEN_CLASS_STEP * TOKEN_CLASS_STEP
                token_class = cutlass.min(tile_size, left) // TOKEN_CLASS_STEP - 1
                for class_index, tile_t in enumerate(classes):
                    if token_class == class_index:
                        self.run_tile(tile_t, tidx, bidx, sX_ptr, w_base, mbar_base, operands, group, token0,
                                      weight_tile, a_frag, accumulators_by_class[tile_t])
            else:
                self.run_tile(self.tile_t, tidx, bidx, sX_ptr, w_base, mbar_base, operands, group, token0,
                              weight_tile, a_frag, accumulators_by_class[self.tile_t])


    def group_tokens_address(self, acts, row0, pad0, slab_bytes):
        """The address of the group's first token row in the token source: its padded row pad0
        (group_x_row) of the pre-pass's slabs (plain Python: traced inline)."""
        return acts.toint() + cutlass.Int64(pad0) * (SWAP_AB_HALF_K * 2)

    def epilogue_scale(self, operands, group, n0, n):
        """decode_rescale (the decode's exact rescale, 2^28) times the tile's alpha where the epilogue has one:
        alpha[g], or alpha[g, 0] for the first half of N and alpha[g, 1] for the second (a
        power-of-two product: exact, so the sums are rounded once, sum x alpha, as a plain
        fp32 multiply of the exact accumulator would)."""
        rescale = cutlass.Float32(self.decode_rescale)
        if cutlass.const_expr(self.swiglu):  # (the gate's, the up's): alpha[g] both, or alpha[g, 0], alpha[g, 1]
            if cutlass.const_expr(operands.alpha_addr is None):
                return rescale, rescale
            gate = load_f32_global(operands.alpha_addr) * rescale
            if cutlass.const_expr(self.epilogue.alpha == "halves"):
                return gate, load_f32_global(operands.alpha_addr + cutlass.Int64(4)) * rescale
            return gate, gate
        if cutlass.const_expr(operands.alpha_addr is None):
            return rescale
        address = operands.alpha_addr
        if cutlass.const_expr(self.epilogue.alpha == "halves"):
            address = address + cutlass.Int64(4) * (n0 >= n // 2)
        return load_f32_global(address) * rescale


class Sm90MoeScaledGemm(Sm90MoeSwapAbGemm):
    """Sm90MoeSwapAbGemm with per-expert scales on the fp32 sums (MoeEpilogue.alpha): one more
    argument, `alpha` (fp32, [G] or [G, 2]), read in the epilogue, after the main loop (so after
    the grid-dependency wait of chained calls)."""

    @cute.jit
    def __call__(
        self, acts: cute.Pointer, b: cute.Pointer, sfb: cute.Pointer, c: cute.Pointer, offsets: cute.Pointer,
        alpha: cute.Pointer, tokens: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, slab_bytes: cutlass.Int32,
        max_tiles: cutlass.Int32, fill_ctas: cutlass.Int32, stream: cuda.CUstream,
    ):
        self.define_shared_storage()
        mOffsets = cute.make_tensor(offsets, cute.make_layout(self.num_groups + 1))
        self.kernel(acts, b, sfb, c, mOffsets, alpha, tokens, n, k, slab_bytes, fill_ctas).launch(
            grid=(max_tiles * self.config.split_k, 1, 1), stream=stream, **self.launch_attributes())

    @cute.kernel
    def kernel(self, acts: cute.Pointer, b: cute.Pointer, sfb: cute.Pointer, c: cute.Pointer,
               mOffsets: cute.Tensor, alpha: cute.Pointer, tokens: cutlass.Int32, n: cutlass.Int32,
               k: cutlass.Int32, slab_bytes: cutlass.Int32, fill_ctas: cutlass.Int32):
        self.moe_tile(acts, b, sfb, c, mOffsets, tokens, n, k, slab_bytes, fill_ctas, alpha)


# Rows of a k-tile's token copies a thread gathers (the W4A16 GEMM with rows read through
# a_rows) up to which each row's a_rows entry is read once per tile, the row held in a
# register: 32-token tiles one row, 64-token tiles two; more (variable tiles: up to 8) are
# read at every k-tile
MAX_GATHERED_ROWS = 2


class Sm90MoeW4A16Gemm(Sm90MoeSwapAbGemm):
    """W4A16: the MoE GEMM with bf16 activations a[T, K] read by the GEMM itself (no pre-pass, no
    activation scales) and the weights decoded exactly into bf16 in natural K order
    (hopper.ptx's bf16 decode): bf16 wgmma, fp32 sums times 2^8 (the decode's exact rescale)
    and alpha where the epilogue has one, rounded to the output's dtype.

    The token rows of a k-tile come by every thread's 16-byte cp.async straight from a's rows
    offsets[g] + token0 .. (zero-filled past the group's rows, placed in wgmma's 128-byte swizzle:
    swap_ab.token_stage_chunk_offset), each thread arriving on the stage's mbarrier once its copies
    land (cp.async.mbarrier.arrive.noinc; the barrier counts every thread); the waiting threads
    fence the generic-proxy writes before wgmma reads them (tokens_landed). With no pre-pass, CTA
    0 checks the offsets and writes `status` (0 or 1), and the calls are not chained (the
    config's pdl and chain_calls are off: w4a16_config)."""

    operand_dtype = cutlass.BFloat16
    decode_rescale = 2.0**8  # the bf16 decode's v * s * 2^-8 on the weights alone
    # each thread's token arrival covers every cp.async it issued before: issued after the
    # step's weight copies, a token stage would also wait for weights needed a k-tile later
    tokens_before_weights = True

    def __init__(self, config: SwapAbConfig, num_groups: int, epilogue: MoeEpilogue = MoeEpilogue(),
                 weight_layout: str = "plain"):
        if config.pdl or config.chain_calls:
            raise ValueError(f"{config}: the W4A16 GEMM has no pre-pass to chain to (w4a16_config turns pdl and "
                             "chain_calls off)")
        if weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout = {weight_layout!r}: must be one of {WEIGHT_LAYOUTS}")
        super().__init__(config, num_groups, epilogue)
        # the weights as exported, or packed for the fragment at load (nvfp4_group_gemm.weight_layout)
        self.weight_layout = weight_layout

    @cute.jit
    def __call__(
        self, a: cute.Pointer, b: cute.Pointer, sfb: cute.Pointer, c: cute.Pointer, offsets: cute.Pointer,
        alpha: cute.Pointer, status: cute.Pointer, tokens: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
        max_tiles: cutlass.Int32, fill_ctas: cutlass.Int32, stream: cuda.CUstream,
    ):
        """alpha: read only where the epilogue has one (any address otherwise)."""
        self.define_shared_storage()
        mOffsets = cute.make_tensor(offsets, cute.make_layout(self.num_groups + 1))
        mStatus = cute.make_tensor(status, cute.make_layout(1))
        self.kernel(a, b, sfb, c, mOffsets, alpha, mStatus, tokens, n, k, fill_ctas).launch(
            grid=(max_tiles * self.config.split_k, 1, 1), stream=stream, **self.launch_attributes())

    @cute.kernel
    def kernel(self, a: cute.Pointer, b: cute.Pointer, sfb: cute.Pointer, c: cute.Pointer, mOffsets: cute.Tensor,
               alpha: cute.Pointer, mStatus: cute.Tensor, tokens: cutlass.Int32, n: cutlass.Int32,
               k: cutlass.Int32, fill_ctas: cutlass.Int32):
        # the row pitch of a (bf16 [T, K]) is what the tile's token source takes as slab_bytes;
        # CTA 0 writes status (the fp4 path's pre-pass does): every CTA skips its tile on bad
        # offsets (locate_tile), CTA 0 says so
        self.moe_tile(a, b, sfb, c, mOffsets, tokens, n, k, k * 2, fill_ctas,
                      None if cutlass.const_expr(self.epilogue.alpha is None) else alpha, mStatus)

    def group_tokens_address(self, acts, row0, pad0, slab_bytes):
        """The group's first row of a: row offsets[g] (slab_bytes: a's row pitch); a's first
        where the rows are gathered (MoeRows.gather: every row through a_rows)."""
        if cutlass.const_expr(self.rows.gather):
            return acts.toint()
        return acts.toint() + cutlass.Int64(row0) * slab_bytes

    def token_source(self, operands, group, half_begin, token0, m, slab_bytes, tile_t, tidx):
        """(the tile's first row of a at the rank's first half, (a's row pitch, the group's rows
        from token0 on)); gathered (MoeRows.gather): (a's first row at that half, (the pitch, the
        rows, then per row of the thread's copies (gathered_row_keys) a's row and whether it is
        read: the tile's a_rows read once here, not at every k-tile), or
        where a thread copies more than MAX_GATHERED_ROWS rows (the tile's first a_rows address,
        a's row count), read by load_tokens at every k-tile)."""
        row_bytes = slab_bytes
        if cutlass.const_expr(operands.gather is not None):
            a_rows_addr, a_row_count = operands.gather
            x_addr = operands.activations(group, 0) + half_begin * self.x_row_bytes
            first_row = a_rows_addr + cutlass.Int64(token0) * 8
            if cutlass.const_expr(len(self.gathered_row_keys(tile_t)[1]) <= MAX_GATHERED_ROWS):
                sources = self.gathered_row_sources(tile_t, tidx, first_row, a_row_count, m - token0)
                return x_addr, (row_bytes, m - token0, sources)
            return x_addr, (row_bytes, m - token0, first_row, a_row_count)
        x_addr = operands.activations(group, 0) + cutlass.Int64(token0) * row_bytes + half_begin * self.x_row_bytes
        return x_addr, (row_bytes, m - token0)

    def gathered_row_keys(self, tile_t: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the key of each of a thread's 16-byte copies of a k-tile, the distinct keys): copy i
        reads row ((tidx + key) % chunks_per_half) // 8 with key = i x threads % chunks_per_half
        (load_tokens' chunk order), so copies of one key read one row."""
        chunks_per_half = tile_t * (self.x_row_bytes // 16)
        chunks = chunks_per_half * self.k_halves
        keys = tuple(i * self.num_threads % chunks_per_half
                     for i in range((chunks + self.num_threads - 1) // self.num_threads))
        return keys, tuple(dict.fromkeys(keys))

    @cute.jit
    def gathered_row_sources(self, tile_t: cutlass.Constexpr, tidx, first_row, a_row_count, rows_left):
        """Per distinct key of gathered_row_keys, (a's row, Int32; whether it is read): the
        tile's row r = ((tidx + key) % chunks_per_half) // 8 is a's row a_rows[token0 + r] where
        r < rows_left and that index is inside 0 .. a's rows - 1, else no row (its copies
        zero-fill)."""
        chunks_per_half = tile_t * (self.x_row_bytes // 16)
        distinct_keys = self.gathered_row_keys(tile_t)[1]
        sources = []
        for key in cutlass.range_constexpr(len(distinct_keys)):
            row = (tidx + distinct_keys[key]) % chunks_per_half // 8
            listed = row < rows_left
            index = load_i64_global(first_row + cutlass.Int64(row if listed else 0) * 8)
            # one unsigned compare: a negative index is outside too
            inside = cutlass.Uint64(index) < cutlass.Uint64(a_row_count)
            valid = inside if listed else listed
            # a's row (its count is an Int32 argument): one register a row, held through the tile
            sources.append(cutlass.Int32(index if valid else cutlass.Int64(0)))
            sources.append(valid)
        return tuple(sources)

    @cute.jit
    def load_tokens(self, tile_t: cutlass.Constexpr, tidx, x_base, mbar_base, stage, k_tile, x_addr, slab_bytes):
        """The tile's bf16 token rows of k-tile k_tile from a (x_addr, slab_bytes = (row pitch,
        rows left): token_source), 16 bytes per cp.async, consecutive threads along a row; rows
        past the group's zero-filled; then this thread's arrival on the stage's mbarrier.
        Gathered (token_source's further values): row r is a's row a_rows[token0 + r], zero-filled
        where that index is outside 0 .. a's rows - 1: each row read by token_source once per
        tile, or where a thread copies more rows, a_rows read here."""
        row_bytes, rows_left = slab_bytes[0], slab_bytes[1]
        half_bytes = tile_t * self.x_row_bytes
        stage_base = x_base + stage * (half_bytes * self.k_halves)
        chunks_per_half = tile_t * (self.x_row_bytes // 16)
        chunks = chunks_per_half * self.k_halves
        for i in cutlass.range_constexpr((chunks + self.num_threads - 1) // self.num_threads):
            chunk = tidx + i * self.num_threads
            if cutlass.const_expr(len(slab_bytes) == 3):  # copy i's row: picked while tracing
                keys, distinct_keys = self.gathered_row_keys(tile_t)
                source = distinct_keys.index(keys[i])
                source_row, row_read = slab_bytes[2][2 * source], slab_bytes[2][2 * source + 1]
            if cutlass.const_expr(chunks % self.num_threads == 0) or chunk < chunks:
                h = chunk // chunks_per_half
                row = (chunk % chunks_per_half) // 8
                part = chunk % 8
                k_offset = (k_tile * self.k_halves + h) * self.x_row_bytes + part * 16
                if cutlass.const_expr(len(slab_bytes) == 3):  # gathered, each row read once per tile
                    cp_async_16B(stage_base + h * half_bytes + token_stage_chunk_offset(row, part),
                                 x_addr + cutlass.Int64(source_row) * row_bytes + k_offset, 16 if row_read else 0)
                else:
                    valid = row < rows_left
                    src_row = row if valid else 0
                    if cutlass.const_expr(len(slab_bytes) == 4):
                        a_rows_addr, a_row_count = slab_bytes[2], slab_bytes[3]
                        index = load_i64_global(a_rows_addr + cutlass.Int64(src_row) * 8)
                        # one unsigned compare: a negative index is outside too
                        inside = cutlass.Uint64(index) < cutlass.Uint64(a_row_count)
                        valid = inside if valid else valid
                        src_row = index if valid else cutlass.Int64(0)
                    src = x_addr + cutlass.Int64(src_row) * row_bytes + k_offset
                    cp_async_16B(stage_base + h * half_bytes + token_stage_chunk_offset(row, part), src,
                                 16 if valid else 0)
        cp_async_mbarrier_arrive_noinc(mbar_base + stage * 8)

    def token_arrivals(self) -> int:
        """Every thread arrives on a token stage's mbarrier (load_tokens)."""
        return self.num_threads

    def tokens_landed(self):
        """The token rows came by cp.async, the generic proxy: fenced before wgmma reads them
        through the async proxy."""
        fence_proxy_async_shared_cta()

    @cute.jit
    def decode_weights(self, tidx, w_base, stage, a_frag):
        """The stage's weight rows into the bf16 fragment in natural K order
        (kernel.decode_rows_to_fragment)."""
        w_stage = w_base + stage * self.config.weight_stage_bytes
        decode_rows_to_fragment(tidx, w_stage, self.w_row_bytes, w_stage + self.w_sf_offset, a_frag, SWAP_AB_HALF_K,
                                self.k_halves, self.config.weight_half_bytes, cutlass.BFloat16,
                                w4a16_paired_scales(self.config), self.weight_layout == FRAGMENT,
                                w4a16_quad_scales(self.config, self.weight_layout))



class Sm90MoeW4A16RowsGemm(Sm90MoeW4A16Gemm):
    """The W4A16 MoE GEMM with its rows mapped (MoeRows): grouped row r reads a's row a_rows[r]
    (`rows.gather`: the token rows of expert-sorted pairs read in place, no gathered copy) and
    writes c's row c_rows[r] (`rows.scatter`: the un-permute in the epilogue's stores); four more
    arguments, the two int64 index arrays (an unused one any address) and a's and c's row
    counts. Every other step is Sm90MoeW4A16Gemm's."""

    def __init__(self, config: SwapAbConfig, num_groups: int, epilogue: MoeEpilogue = MoeEpilogue(),
                 rows: MoeRows = MoeRows(gather=True), weight_layout: str = "plain"):
        if not rows.any:
            raise ValueError(f"{rows}: maps no rows (Sm90MoeW4A16Gemm is that GEMM)")
        super().__init__(config, num_groups, epilogue, weight_layout)
        self.rows = rows

    @cute.jit
    def __call__(
        self, a: cute.Pointer, b: cute.Pointer, sfb: cute.Pointer, c: cute.Pointer, offsets: cute.Pointer,
        alpha: cute.Pointer, status: cute.Pointer, a_rows: cute.Pointer, c_rows: cute.Pointer,
        tokens: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, max_tiles: cutlass.Int32,
        fill_ctas: cutlass.Int32, a_row_count: cutlass.Int32, c_row_count: cutlass.Int32, stream: cuda.CUstream,
    ):
        """tokens: the grouped rows (a_rows' and c_rows' length); a_row_count, c_row_count: a's and
        c's rows."""
        self.define_shared_storage()
        mOffsets = cute.make_tensor(offsets, cute.make_layout(self.num_groups + 1))
        mStatus = cute.make_tensor(status, cute.make_layout(1))
        self.kernel(a, b, sfb, c, mOffsets, alpha, mStatus, a_rows, c_rows, tokens, n, k, fill_ctas, a_row_count,
                    c_row_count).launch(grid=(max_tiles * self.config.split_k, 1, 1), stream=stream,
                                        **self.launch_attributes())

    @cute.kernel
    def kernel(self, a: cute.Pointer, b: cute.Pointer, sfb: cute.Pointer, c: cute.Pointer, mOffsets: cute.Tensor,
               alpha: cute.Pointer, mStatus: cute.Tensor, a_rows: cute.Pointer, c_rows: cute.Pointer,
               tokens: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, fill_ctas: cutlass.Int32,
               a_row_count: cutlass.Int32, c_row_count: cutlass.Int32):
        self.moe_tile(a, b, sfb, c, mOffsets, tokens, n, k, k * 2, fill_ctas,
                      None if cutlass.const_expr(self.epilogue.alpha is None) else alpha, mStatus,
                      (a_rows, c_rows, cutlass.Int64(a_row_count), cutlass.Int64(c_row_count)))

# What the MoE entry's K must be a multiple of on sm_90: one 64-wide k-tile half (4 scale blocks,
# one 512-byte scale atom of the blocked layouts along K)
MOE_K_MULTIPLE = SWAP_AB_HALF_K


def moe_k_config(config: SwapAbConfig, k: int) -> SwapAbConfig:
    """`config` for K = k (a multiple of MOE_K_MULTIPLE): itself where K is a multiple of its
    k_multiple (the kernels of before, PTX unchanged); else 64-wide k-tiles where K % 128 != 0
    (the registered config of which it is the 128-wide variant, schedules.WIDE_K_TILE_CONFIGS),
    and k_tail (the main loop's k-tile count and split-K's shares at run time)."""
    if k % config.k_multiple == 0:
        return config
    if k % config.tile_k:
        from .schedules import WIDE_K_TILE_CONFIGS

        calls = {"pdl": config.pdl, "chain_calls": config.chain_calls}  # w4a16_config's, or unchained
        narrow = [base for base, wide in WIDE_K_TILE_CONFIGS.items() if dataclasses.replace(wide, **calls) == config]
        config = dataclasses.replace(narrow[0] if narrow else config, k_halves=1, **calls)
        if k % config.k_multiple == 0:
            return config
    return k_tail_config(config)


def k_tail_config(config: SwapAbConfig) -> SwapAbConfig:
    """`config`'s k_tail build (the main loop's k-tile count and split-K's shares at run time).
    A build at the 64 registers that 4 CTAs of 256 threads leave (the 32-token 4-way split-K
    one) holds 3 CTAs per SM there: its shares' arithmetic spilled 16 B under DSL 4.8.1."""
    tail = dataclasses.replace(config, k_tail=True)
    if config.split_k == 4 and config.ctas_per_sm == 4:
        tail = dataclasses.replace(tail, ctas_per_sm=3)
    return tail


def w4a16_paired_scales(config: SwapAbConfig) -> bool:
    """Whether the W4A16 decode converts two blocks' scales as one bf16x2 (ptx.decode_bf16_rows_to_registers):
    where the build has the registers for it, 128-wide k-tiles or at most 2 CTAs per SM. The
    builds of 64-wide k-tiles at 3 and 4 CTAs per SM (the 32-token ones, split-K or not, and the
    64-token one) took an 8- to 16-byte local frame with it (EXPERIMENTS E89)."""
    return config.k_halves == 2 or config.ctas_per_sm <= 2


def w4a16_quad_scales(config: SwapAbConfig, weight_layout: str) -> bool:
    """Whether the W4A16 decode shares each quad's scale conversion (ptx.decode_bf16_rows_to_registers'
    quad_scales: a pair a lane, four shuffles a unit, where every lane converted every pair):
    on weights packed for the fragment, but for 128-wide k-tiles at 3 CTAs per SM. Elsewhere
    it took local memory (EXPERIMENTS E95): the plain layout's builds at their 64- and
    80-register bounds 8-16 bytes read in the main loop, the 128-wide fragment builds under
    DSL 4.8.1 a value held across it."""
    # Each half decoded, then its wgmma (the halves' temporaries apart): more local memory (EXPERIMENTS E97).
    return weight_layout == FRAGMENT and not (config.k_halves == 2 and config.ctas_per_sm >= 3)


def w4a16_config(config: SwapAbConfig) -> SwapAbConfig:
    """`config` for the W4A16 GEMM: unchained (no pre-pass to overlap or wait for)."""
    if config.pdl or config.chain_calls:
        return dataclasses.replace(config, pdl=False, chain_calls=False)
    return config


def moe_w4a16_build(num_groups: int, config: SwapAbConfig, epilogue: MoeEpilogue = MoeEpilogue(),
                    rows: MoeRows = MoeRows(), weight_layout: str = "plain") -> tuple:
    operands = (fake_ptr(cutlass.Uint8), fake_ptr(cutlass.Uint8), fake_ptr(cutlass.Uint8), fake_ptr(cutlass.Uint8),
                fake_ptr(cutlass.Int32), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Int32))
    sizes = (cutlass.Int32(1), cutlass.Int32(128), cutlass.Int32(256), cutlass.Int32(1), cutlass.Int32(132))
    if not rows.any:
        return Sm90MoeW4A16Gemm(config, num_groups, epilogue, weight_layout), (*operands, *sizes, cuda.CUstream(0))
    return Sm90MoeW4A16RowsGemm(config, num_groups, epilogue, rows, weight_layout), (
        *operands, fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int64), *sizes, cutlass.Int32(1), cutlass.Int32(1),
        cuda.CUstream(0))


def compile_moe_w4a16_gemm(num_groups: int, options: str | None = None, config: SwapAbConfig | None = None,
                           epilogue: MoeEpilogue = MoeEpilogue(), rows: MoeRows = MoeRows(),
                           weight_layout: str = "plain"):
    """Compile (cached: core.compile_key) the W4A16 MoE GEMM of `config` (w4a16_config applied),
    `epilogue`, `rows` (MoeRows: none mapped, the default, or Sm90MoeW4A16RowsGemm's) and the
    weights' layout ("plain", or "fragment": nvfp4_group_gemm.weight_layout) for num_groups groups."""
    from .config import SWAP_AB_CONFIG

    config = w4a16_config(SWAP_AB_CONFIG if config is None else config)
    return core.compile_once(moe_w4a16_build, num_groups, config, epilogue, rows, weight_layout, options=options,
                             context=smem_per_sm_known_without_gpu)


def moe_gemm_build(num_groups: int, config: SwapAbConfig, epilogue: MoeEpilogue = MoeEpilogue()) -> tuple:
    sizes = (cutlass.Int32(1), cutlass.Int32(128), cutlass.Int32(256), cutlass.Int32(1), cutlass.Int32(1),
             cutlass.Int32(132), cuda.CUstream(0))
    operands = (fake_ptr(cutlass.Uint8), fake_ptr(cutlass.Uint8), fake_ptr(cutlass.Uint8), fake_ptr(cutlass.Uint8),
                fake_ptr(cutlass.Int32))
    if epilogue.alpha is None:
        return Sm90MoeSwapAbGemm(config, num_groups, epilogue), (*operands, *sizes)
    return Sm90MoeScaledGemm(config, num_groups, epilogue), (*operands, fake_ptr(cutlass.Float32), *sizes)


def moe_decode_build(num_groups: int, scale_layout: str, chained: bool) -> tuple:
    return Sm90MoeDecodeActivations(num_groups, scale_layout, chained), (
        fake_ptr(cutlass.Uint8), fake_ptr(cutlass.Uint8), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Uint8),
        fake_ptr(cutlass.Int32), cutlass.Int32(1), cutlass.Int32(256), cutlass.Int32(1), cutlass.Int32(1),
        cuda.CUstream(0),
    )


def compile_moe_gemm(num_groups: int, options: str | None = None, config: SwapAbConfig | None = None,
                     epilogue: MoeEpilogue = MoeEpilogue()):
    """Compile (cached: core.compile_key) the MoE GEMM of `config` and `epilogue` for num_groups
    groups."""
    from .config import SWAP_AB_CONFIG

    config = SWAP_AB_CONFIG if config is None else config
    return core.compile_once(moe_gemm_build, num_groups, config, epilogue, options=options,
                             context=smem_per_sm_known_without_gpu)


def compile_moe_decode(num_groups: int, options: str | None = None, scale_layout: str = "plain",
                       chained: bool = False):
    """Compile (cached: core.compile_key) the MoE pre-pass for num_groups groups reading
    `scale_layout` scales."""
    return core.compile_once(moe_decode_build, num_groups, scale_layout, chained, options=options)


def moe_compile_targets():
    """The MoE kernels for the build report: (kernel name, arch, compile(G, options))."""
    from .config import (
        SWAP_AB_ONE_ROUND_CONFIG,
        SWAP_AB_ONE_ROUND_K128_CONFIG,
        SWAP_AB_SPLIT_K_CONFIG,
        SWAP_AB_T32_CONFIG,
        SWAP_AB_T32_K128_CONFIG,
        SWAP_AB_T32_SPLIT_K2_CONFIG,
        SWAP_AB_T32_SPLIT_K4_CONFIG,
        SWAP_AB_T64_CONFIG,
        SWAP_AB_VARIABLE_CONFIG,
    )

    gemms = {"split_k": SWAP_AB_SPLIT_K_CONFIG, "one_round": SWAP_AB_ONE_ROUND_CONFIG,
             "one_round_k128": SWAP_AB_ONE_ROUND_K128_CONFIG, "variable": SWAP_AB_VARIABLE_CONFIG,
             "t32": SWAP_AB_T32_CONFIG, "t32_k128": SWAP_AB_T32_K128_CONFIG, "t64": SWAP_AB_T64_CONFIG,
             "t32_split_k2": SWAP_AB_T32_SPLIT_K2_CONFIG, "t32_split_k4": SWAP_AB_T32_SPLIT_K4_CONFIG}
    return [
        ("sm90_moe_decode_plain", "sm_90a", functools.partial(compile_moe_decode, scale_layout="plain")),
        ("sm90_moe_decode_blocked", "sm_90a", functools.partial(compile_moe_decode, scale_layout="blocked")),
        ("sm90_moe_decode_chained", "sm_90a", functools.partial(compile_moe_decode, chained=True)),
    ] + [(f"sm90_moe_gemm_{name}", "sm_90a", functools.partial(compile_moe_gemm, config=config))
         for name, config in gemms.items()] + [
        # the epilogues of real checkpoints: a scale per expert (or per half of a fused gate-and-up
        # weight) and bf16 output, on the decode and the variable-tile configs
        (f"sm90_moe_gemm_{name}_{label}", "sm_90a",
         functools.partial(compile_moe_gemm, config=gemms[name], epilogue=epilogue))
        for name in ("t32", "t32_split_k4", "variable")
        for label, epilogue in (("alpha_bf16", MoeEpilogue("expert", "bfloat16")),
                                ("halves_f16", MoeEpilogue("halves", "float16")))] + [
        # W4A16 (bf16 activations read by the GEMM): every config the choice may run, with a
        # checkpoint's epilogue, and the fused gate-and-up's on the decode and variable configs
        (f"sm90_moe_w4a16_{name}", "sm_90a",
         functools.partial(compile_moe_w4a16_gemm, config=config, epilogue=MoeEpilogue("expert", "bfloat16")))
        for name, config in gemms.items()] + [
        (f"sm90_moe_w4a16_{name}_halves", "sm_90a",
         functools.partial(compile_moe_w4a16_gemm, config=gemms[name], epilogue=MoeEpilogue("halves", "bfloat16")))
        for name in ("t32", "variable")] + [
        # K not a multiple of the config's k_multiple (moe_k_config: 1408, 2880, ...): the k_tail
        # builds of every config the choice may run (the 128-wide ones where K % 128 == 0, else
        # their 64-wide configs'), fp4 activations and W4A16, a checkpoint's epilogue
        (f"sm90_moe_{path}_{name}_k_tail", "sm_90a",
         functools.partial(compile_fn, config=k_tail_config(config),
                           epilogue=MoeEpilogue("expert", "bfloat16")))
        for path, compile_fn in (("gemm", compile_moe_gemm), ("w4a16", compile_moe_w4a16_gemm))
        for name, config in gemms.items()] + [
        # SwiGLU in the epilogue (MoeFfn's gate-and-up GEMM, its rows gathered; the fp4 path's too)
        (f"sm90_moe_{path}_{name}_swiglu", "sm_90a",
         functools.partial(compile_fn, config=gemms[name], epilogue=MoeEpilogue("halves", "bfloat16", "swiglu"),
                           **rows))
        for path, compile_fn, rows in (("w4a16", compile_moe_w4a16_gemm, {"rows": MoeRows(gather=True)}),
                                       ("gemm", compile_moe_gemm, {}))
        for name in ("t32_split_k4", "variable")] + [
        # rows mapped (MoeFfn's W4A16 layer): the gate-and-up GEMM gathers token rows, the down
        # GEMM scatters to pair order; on the decode (split-K: store_tile's scatter) and the
        # variable configs
        (f"sm90_moe_w4a16_{name}_{label}", "sm_90a",
         functools.partial(compile_moe_w4a16_gemm, config=gemms[name], epilogue=epilogue, rows=rows))
        for name in ("t32_split_k4", "variable")
        for label, epilogue, rows in (("gather_halves", MoeEpilogue("halves", "bfloat16"), MoeRows(gather=True)),
                                      ("scatter", MoeEpilogue("expert", "bfloat16"), MoeRows(scatter=True)))] + [
        # the weights packed for the fragment (weight_layout="fragment"): the configs the choice
        # runs them on (not t64: moe_config), as MoeFfn's two GEMMs run them
        (f"sm90_moe_w4a16_{name}_{label}_fragment", "sm_90a",
         functools.partial(compile_moe_w4a16_gemm, config=gemms[name], epilogue=epilogue, rows=rows,
                           weight_layout="fragment"))
        for name in ("t32", "t32_k128", "t32_split_k2", "t32_split_k4", "variable")
        for label, epilogue, rows in (("swiglu", MoeEpilogue("halves", "bfloat16", "swiglu"), MoeRows(gather=True)),
                                      ("scatter", MoeEpilogue("expert", "bfloat16"), MoeRows(scatter=True)))]
