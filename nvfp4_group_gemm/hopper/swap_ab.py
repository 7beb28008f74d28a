"""The swap-AB sm_90a kernels: a pre-pass that decodes every group's activations once per call
(Sm90DecodeActivations), and the GEMM that reads them (Sm90SwapAbGemm), with their
compilation.

The GEMM computes C^T: the weights (problem B, N rows) are wgmma's A operand, decoded from
their packed bytes straight into register fragments, one warpgroup per 64 weight rows; the
tokens (problem A, M rows) are wgmma's N operand, so a tile holds any multiple of 16 tokens
and M pads to that, not to 64-row wgmma blocks. The token rows arrive already decoded (fp16,
the K permutation of ptx.CHUNK_REGISTERS) from the pre-pass, so each activation is decoded
once per call instead of once per weight tile. The pre-pass writes them as k-tile slabs
already in the swizzled K-major layout wgmma reads (activation_chunk_offsets), so a tile's
token rows of one k-tile are one contiguous run that one thread brings in with one bulk copy,
completing on the stage's mbarrier: no decode stores, no per-thread token copies, no proxy
fence.

    pre-pass:  A (packed) x SFA --decode--> X (fp16, k-tile slabs, L2-resident)
    GEMM:      B packed + SFB --cp.async--> weight stages (``weight_stages`` deep)
               X: a tile's rows of a k-tile --bulk copy--> token stages (``stages`` deep)
               B --decode--> register A fragments; X stage --wgmma (B from smem)--> fp32
               --stmatrix .trans--> C rows in the free token stages --16-byte stores-->
               C[token, n] fp16 (split-K: 2-byte stores of the summing rank's sums)

A k-tile is 64 or 128 wide (SwapAbConfig.k_halves): a 128-wide one is two 64-wide halves,
each copied and laid out as a 64-wide k-tile's (the activation slabs stay 64 wide).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import cute, utils

from nvfp4_group_gemm import core

from .config import (
    CONFIGS,
    SF_ATOM_BYTES,
    SF_ATOM_ROWS,
    SF_VEC_SIZE,
    SWAP_AB_CONFIG,
    SWAP_AB_HALF_K,
    SwapAbConfig,
)
from .kernel import (
    OPERAND_MAJOR_MODE,
    decode_rows_to_fragment,
    reduce_split_k_partials,
    smem_per_sm_known_without_gpu,
    stage_scale_offset,
)
from .ptx import (
    bulk_copies_to_shared,
    copy_16B_shared_to_global,
    cp_async_16B,
    decode_scale_blocks_global,
    fence_mbarrier_init,
    load_i64_global,
    mbarrier_init_shared,
    mbarrier_wait_parity,
    pack_16x2,
    round_16,
    stmatrix_x2_trans,
    stmatrix_x4_trans,
    store_16,
    swiglu,
)
from .schedules import TOKEN_CLASS_STEP

# Pointer table columns (submission's Binding.ptrs): a, b, c, sfa_reordered, sfb_reordered
_PTR_A, _PTR_B, _PTR_C, _PTR_SFA, _PTR_SFB = range(5)
# Threads of a pre-pass CTA; each decodes one 16-element scale block of one row
DECODE_THREADS = 256



def activation_blocks(problem_sizes) -> int:
    """Scale blocks (16 elements) of the largest group's activations: the pre-pass grid's x
    extent is this over DECODE_THREADS (each group is one grid row)."""
    return max((m * k // SF_VEC_SIZE for m, _n, k, _l in problem_sizes), default=0)


def activation_scale_offset(row, block, k):
    """Byte offset, in a reordered scale tensor of K = k, of the scale of 16-element block
    `block` of row `row` (the kernel calls this with device integers, tests with Python ints):
    atom (row // 128, block // 4) of 512 bytes, then the in-atom offset of stage_scale_offset."""
    rest_k = k // (SF_VEC_SIZE * 4)
    atom = (row // SF_ATOM_ROWS) * rest_k + block // 4
    return atom * SF_ATOM_BYTES + stage_scale_offset(row % SF_ATOM_ROWS, block % 4)


def padded_token_rows(m: int, config: SwapAbConfig) -> int:
    """Token rows of a group's decoded activations per k-tile: M rounded up to where its last
    tile ends (a multiple of the token tile, or of 64 with variable tiles). The GEMM copies
    whole tiles; the rows past M are never written, and their columns never stored."""
    step = TOKEN_CLASS_STEP if config.variable_tokens else config.tile_tokens
    return -(-m // step) * step


def token_stage_chunk_offset(row, chunk):
    """Byte offset, in a token stage, of 16-byte chunk `chunk` (0..7) of a k-tile's row image
    of the tile's token row `row`: wgmma's 128-byte swizzle (chunk XOR row % 8 inside
    1024-byte atoms of 8 rows)."""
    return row * 128 + (chunk ^ (row % 8)) * 16


def activation_chunk_offsets(row, block, slab_bytes):
    """Byte offsets, in a group's decoded activations, of the two 16-byte chunks the pre-pass
    writes for 16-element block `block` of row `row`. The activations are k-tile slabs of
    `slab_bytes` (padded_token_rows x 128 bytes), each the 128-byte row images of one k-tile
    in row order, each placed as in a token stage (token_stage_chunk_offset): block b fills
    chunks 2 (b % 4) and + 1 of its k-tile's image. A tile's rows of one k-tile are then one
    contiguous run that the GEMM copies as is (token tiles start at multiples of 16, so the
    swizzle's row % 8 is the same in the slab and in the stage)."""
    k_tile, blk = block // 4, block % 4
    slab = k_tile * slab_bytes
    return slab + token_stage_chunk_offset(row, 2 * blk), slab + token_stage_chunk_offset(row, 2 * blk + 1)


class Sm90DecodeActivations:
    """Pre-pass: the fp16 decode (v * s * 2^-14, ptx's K permutation) of every activation row
    of every group, into group g's k-tile slabs (activation_chunk_offsets) at acts[g, 0], of
    acts[g, 1] bytes each."""

    def __init__(self, num_groups: int, chained: bool = False):
        self.num_groups = num_groups
        self.chained = chained

    @cute.jit
    def __call__(
        self, ptrs: cute.Pointer, sizes: cute.Pointer, acts: cute.Pointer, blocks_x: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        mPtrs = cute.make_tensor(ptrs, cute.make_layout((self.num_groups, 5), stride=(5, 1)))
        mSizes = cute.make_tensor(sizes, cute.make_layout((self.num_groups, 4), stride=(4, 1)))
        mActs = cute.make_tensor(acts, cute.make_layout((self.num_groups, 2), stride=(2, 1)))
        self.kernel(mPtrs, mSizes, mActs).launch(
            grid=(blocks_x, self.num_groups, 1), block=(DECODE_THREADS, 1, 1), use_pdl=self.chained,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mPtrs: cute.Tensor, mSizes: cute.Tensor, mActs: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, group, _ = cute.arch.block_idx()
        # the plan's and the input set's own tables (written by copies before any launch
        # reading them), read before the wait so that only the activation reads follow it
        m = mSizes[group, 0]
        k = mSizes[group, 2]
        a_base = mPtrs[group, _PTR_A]
        sfa_base = mPtrs[group, _PTR_SFA]
        acts_base = mActs[group, 0]
        slab_bytes = mActs[group, 1]
        if cutlass.const_expr(self.chained):
            # launched as the previous kernel's programmatic dependent (SwapAbConfig.chain_calls):
            # everything before it in the stream is complete past here, the activations included.
            # L2 prefetches of the activations before the wait: no faster (EXPERIMENTS E23).
            cute.arch.griddepcontrol_wait()
        # a GEMM launched as this grid's programmatic dependent may start now: it reads what
        # this grid writes only after its griddepcontrol.wait, and what came before this grid
        # (weights) only once this point is passed (no effect on other launches).
        # Triggering before the wait instead: no faster (EXPERIMENTS E17).
        cute.arch.griddepcontrol_launch_dependents()
        # one 16-element block per thread.
        # A k-tile of a row per thread (8 stores of 16 bytes): slower (EXPERIMENTS E20).
        # Two blocks per thread, 256 apart, half the CTAs: slower (EXPERIMENTS E18).
        blocks_per_row = k // SF_VEC_SIZE
        item = bidx * DECODE_THREADS + tidx
        if item < m * blocks_per_row:
            row = item // blocks_per_row
            block = item - row * blocks_per_row
            src = a_base + cutlass.Int64(row) * (k // 2) + block * (SF_VEC_SIZE // 2)
            scale = sfa_base + activation_scale_offset(cutlass.Int64(row), block, k)
            dst_lo, dst_hi = activation_chunk_offsets(cutlass.Int64(row), block, slab_bytes)
            decode_scale_blocks_global([(src, scale, acts_base + dst_lo, acts_base + dst_hi)])


class TableOperands:
    """Where the GEMM's tile finds its group's operands: the per-size-set tables (pointers,
    sizes, activation slabs), read at the points of use. The MoE GEMM (moe.py) passes its own,
    derived on the GPU from the group offsets."""

    def __init__(self, mPtrs, mSizes, mActs):
        self.mPtrs, self.mSizes, self.mActs = mPtrs, mSizes, mActs

    def size(self, group, field):
        """M, N or K (field 0, 1, 2) of the group."""
        return self.mSizes[group, field]

    def address(self, group, column):
        """The group's global address of pointer-table column `column` (_PTR_B, _PTR_C, ...)."""
        return self.mPtrs[group, column]

    def activations(self, group, field):
        """The group's decoded activations: their address (field 0) or slab bytes (field 1)."""
        return self.mActs[group, field]


def make_swap_ab_tiled_mma(config: SwapAbConfig, tile_t: int, dtype=cutlass.Float16):
    """fp16 (or bf16: W4A16) wgmma (fp32 accumulators): one warpgroup per 64 weight rows,
    weights from registers, tokens from shared memory, both K-major; N = tile_t."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype,
        dtype,
        OPERAND_MAJOR_MODE.K,
        OPERAND_MAJOR_MODE.K,
        cutlass.Float32,
        (config.tile_weights // 64, 1, 1),
        tiler_mn=(64, tile_t),
        a_source=cute.nvgpu.warpgroup.OperandSource.RMEM,
    )


class Sm90SwapAbGemm:
    """Grouped NVFP4 GEMM on sm_90a, swap-AB: one CTA per (group, weight tile, token tile) of
    the tile table (per split-K rank): weight stages by cp.async -> weight decode into
    registers; token stages by bulk copy -> wgmma with the token rows from shared memory ->
    transposed fp16 stores."""

    # the output's dtype (a subclass's epilogue may write bfloat16)
    out_dtype = "float16"
    # wgmma's operand type: the decoded weights' and the token rows' (bf16 in W4A16)
    operand_dtype = cutlass.Float16
    # the exact rescale of the decoded operands: both carry 2^-14 (hopper.ptx's fp16 decode)
    decode_rescale = 2.0**28
    # a k-tile's token copies issued before its step's weight copies (prologue and main loop): a
    # token stage that completes with every earlier copy of the thread (cp.async arrivals) then
    # waits for no weights issued after it
    tokens_before_weights = False
    # SwiGLU in the epilogue (the MoE entry's gate-and-up GEMM: Sm90MoeSwapAbGemm's epilogue)
    swiglu = False

    def __init__(self, config: SwapAbConfig, num_groups: int):
        config.check()
        self.config = config
        self.num_groups = num_groups
        self.tile_w = config.tile_weights
        self.tile_t = config.tile_tokens
        self.tile_k = config.tile_k
        self.num_threads = config.num_threads
        self.stages = config.stages
        self.k_halves = config.k_halves
        self.w_row_bytes = SWAP_AB_HALF_K // 2  # packed weight bytes of a row per half k-tile
        self.x_row_bytes = SWAP_AB_HALF_K * 2  # fp16 token bytes of a row per half (slab row)
        self.w_sf_offset = self.tile_w * self.w_row_bytes  # scale atom after the half's packed rows

    @cute.jit
    def __call__(
        self,
        ptrs: cute.Pointer,
        sizes: cute.Pointer,
        tiles: cute.Pointer,
        num_tiles: cutlass.Int32,
        acts: cute.Pointer,
        stream: cuda.CUstream,
    ):
        self.define_shared_storage()
        mPtrs = cute.make_tensor(ptrs, cute.make_layout((self.num_groups, 5), stride=(5, 1)))
        mSizes = cute.make_tensor(sizes, cute.make_layout((self.num_groups, 4), stride=(4, 1)))
        width = self.config.tile_row_width
        mTiles = cute.make_tensor(tiles, cute.make_layout((num_tiles, width), stride=(width, 1)))
        mActs = cute.make_tensor(acts, cute.make_layout((self.num_groups, 2), stride=(2, 1)))
        self.kernel(mPtrs, mSizes, mTiles, mActs).launch(grid=(num_tiles * self.config.split_k, 1, 1),
                                                         stream=stream, **self.launch_attributes())

    def define_shared_storage(self):
        """The CTA's shared memory (token stages, weight stages, the token mbarriers) as
        self.shared_storage (trace time, in __call__)."""
        x_smem_layout_staged = self.token_smem_layout(self.tile_t)

        # built from evaluated annotations (this module's annotations are strings)
        fields = {
            "sX": cute.struct.Align[cute.struct.MemRange[self.operand_dtype, cute.cosize(x_smem_layout_staged)],
                                    1024],
            "raw_w": cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, self.config.weight_stage_bytes * self.config.weight_stages], 128
            ],
            # per stage, the mbarrier its token bulk copy completes on
            "token_full": cute.struct.Align[cute.struct.MemRange[cutlass.Int64, self.stages], 8],
        }
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        if cutlass.const_expr(self.config.split_k > 1):
            # a summing rank receives the other ranks' sums at the start of sX and on into the
            # weight stages that follow it, all free after its main loop (and clear of the mbarriers)
            assert self.config.reduction_bytes <= (cute.cosize(x_smem_layout_staged) * 2
                                                   + self.config.weight_stage_bytes * self.config.weight_stages)

    def launch_attributes(self) -> dict:
        """The launch's block, cluster, occupancy bound, shared memory and PDL (the grid is the caller's)."""
        split = self.config.split_k
        return {
            "block": (self.num_threads, 1, 1),
            "cluster": (split, 1, 1) if split > 1 else None,
            "min_blocks_per_mp": self.config.ctas_per_sm,
            "smem": self.config.launch_smem_bytes(self.shared_storage.size_in_bytes()),
            "use_pdl": self.config.pdl,
        }

    def token_classes(self) -> tuple[int, ...]:
        """Token counts the kernel has a main loop for."""
        if self.config.variable_tokens:
            return tuple(range(TOKEN_CLASS_STEP, self.tile_t + 1, TOKEN_CLASS_STEP))
        return (self.tile_t,)

    def token_smem_layout(self, tile_t: int):
        """Staged K-major swizzled layout of tile_t fp16 token rows per k-tile."""
        return sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.ROW_MAJOR, (self.tile_w, tile_t, self.tile_k), self.operand_dtype, self.stages
        )

    # -------------------------------------------------------------------------
    # Copies: one k-tile of weights, their scales and fp16 token rows into stage `stage`
    # -------------------------------------------------------------------------
    @cute.jit
    def load_weights(self, tidx, w_base, stage, k_tile, b_addr, sfb_addr, n0, b_row_bytes, rest_k):
        for h in cutlass.range_constexpr(self.k_halves):
            # each 64-wide half: packed rows, then their scale atom (weight_half_bytes)
            w_half = w_base + stage * self.config.weight_stage_bytes + h * self.config.weight_half_bytes
            half_k_tile = k_tile * self.k_halves + h
            # packed weight rows: 32 bytes (two 16-byte chunks) per row
            for i in cutlass.range_constexpr(self.tile_w * 2 // self.num_threads):
                chunk = tidx + i * self.num_threads
                row = chunk // 2
                part = chunk % 2
                src = b_addr + cutlass.Int64(n0 + row) * b_row_bytes + half_k_tile * self.w_row_bytes + part * 16
                # Chunks swapped where row % 8 >= 4 (16 banks per load): no faster (EXPERIMENTS E19).
                cp_async_16B(w_half + row * self.w_row_bytes + part * 16, src, 16)
            # the weights' scale atom: 512 contiguous bytes per 128 rows and half k-tile
            if tidx < SF_ATOM_BYTES // 16:
                src = (sfb_addr + (cutlass.Int64(n0 // SF_ATOM_ROWS) * rest_k + half_k_tile) * SF_ATOM_BYTES
                       + tidx * 16)
                cp_async_16B(w_half + self.w_sf_offset + tidx * 16, src, 16)

    @cute.jit
    def load_tokens(self, tile_t: cutlass.Constexpr, tidx, x_base, mbar_base, stage, k_tile, x_addr, slab_bytes):
        """The tile's token rows of k-tile k_tile into token stage `stage`, completing on its
        mbarrier (x_addr, slab_bytes: token_source's)."""
        # the tile's fp16 token rows of this k-tile: per 64-wide half one contiguous run of its
        # group's slab, already swizzled by the pre-pass, into the stage's half (the K-major
        # swizzled stage holds the tile's rows of each half in turn); bulk copies by one
        # thread, completing on the stage's mbarrier.
        # Bulk copies instead of every thread's 16-byte cp.async: faster (EXPERIMENTS E2).
        # Multicast of each half to a 2-CTA cluster of two weight tiles: slower (EXPERIMENTS E10).
        if tidx == 0:
            half_bytes = tile_t * self.x_row_bytes
            stage_base = x_base + stage * (half_bytes * self.k_halves)
            pieces = [
                (stage_base + h * half_bytes, x_addr + cutlass.Int64(k_tile * self.k_halves + h) * slab_bytes)
                for h in range(self.k_halves)
            ]
            bulk_copies_to_shared(pieces, half_bytes, mbar_base + stage * 8)

    @cute.jit
    def decode_weights(self, tidx, w_base, stage, a_frag):
        """The stage's weight rows into the wgmma A fragment (decode_rows_to_fragment: lane
        (g, t) of warp w in warpgroup v decodes rows 64 v + 16 w + g and + 8)."""
        w_stage = w_base + stage * self.config.weight_stage_bytes
        decode_rows_to_fragment(tidx, w_stage, self.w_row_bytes, w_stage + self.w_sf_offset, a_frag, SWAP_AB_HALF_K,
                                self.k_halves, self.config.weight_half_bytes)

    def mma_k_tile(self, tiled_mma, accumulators, a_frag, tCrB, stage):
        """The wgmma of one k-tile as one commit group (plain Python: traced inline)."""
        cute.nvgpu.warpgroup.fence()
        for k_block in range(self.tile_k // 16):
            cute.gemm(tiled_mma, accumulators, a_frag[(None, None, k_block)], tCrB[(None, None, k_block, stage)],
                      accumulators)
        cute.nvgpu.warpgroup.commit_group()

    def cta_resources(self):
        """The CTA's shared memory (token stages' pointer, weight stages' and mbarriers'
        addresses) and register fragments, allocated in the kernel's entry block (allocated
        inside a class's branch they went to local memory): the A fragment, and per token
        class its accumulators (only one class's are live in a CTA). Plain Python: traced inline."""
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sX_ptr = storage.sX.data_ptr()
        w_base = storage.raw_w.data_ptr().toint()
        mbar_base = storage.token_full.data_ptr().toint()
        a_frag = cute.make_rmem_tensor(
            make_swap_ab_tiled_mma(self.config, self.tile_t, self.operand_dtype).partition_shape_A(
                (self.tile_w, self.tile_k)),
            self.operand_dtype,
        )
        accumulators_by_class = {}
        for tile_t in self.token_classes():
            thr = make_swap_ab_tiled_mma(self.config, tile_t, self.operand_dtype).get_slice(0)
            acc_shape = thr.partition_C(cute.make_identity_tensor((self.tile_w, tile_t))).shape
            accumulators_by_class[tile_t] = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        return sX_ptr, w_base, mbar_base, a_frag, accumulators_by_class

    @cute.kernel
    def kernel(self, mPtrs: cute.Tensor, mSizes: cute.Tensor, mTiles: cute.Tensor, mActs: cute.Tensor):
        if cutlass.const_expr(self.config.chain_calls):
            # the next call's pre-pass may start now: it reads its tables, then waits for this
            # grid to complete before it reads or writes anything this grid uses
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        sX_ptr, w_base, mbar_base, a_frag, accumulators_by_class = self.cta_resources()
        classes = self.token_classes()

        # tile row: (group, first token / 64, weight tile, token class) with variable token
        # tiles, (group, token tile, weight tile) otherwise; split-K rank r of a cluster runs
        # k-tiles r * cnt .. (r + 1) * cnt
        tile_idx = bidx // self.config.split_k
        operands = TableOperands(mPtrs, mSizes, mActs)
        group = mTiles[tile_idx, 0]
        weight_tile = mTiles[tile_idx, 2]
        if cutlass.const_expr(self.config.variable_tokens):
            token0 = mTiles[tile_idx, 1] * TOKEN_CLASS_STEP
            token_class = mTiles[tile_idx, 3]
            # one main loop per class, each with its own wgmma N (classes: TOKEN_CLASS_STEP,
            # 2 x, ..., tile_tokens); the CTA runs the one of its tile
            for class_index, tile_t in enumerate(classes):
                if token_class == class_index:
                    self.run_tile(tile_t, tidx, bidx, sX_ptr, w_base, mbar_base, operands, group, token0,
                                  weight_tile, a_frag, accumulators_by_class[tile_t])
        else:
            token0 = mTiles[tile_idx, 1] * self.tile_t
            self.run_tile(self.tile_t, tidx, bidx, sX_ptr, w_base, mbar_base, operands, group, token0,
                          weight_tile, a_frag, accumulators_by_class[self.tile_t])

    @cute.jit
    def k_tile_step(
        self, tile_t: cutlass.Constexpr, tiled_mma, tidx, w_base, x_base, mbar_base, k_tile, k_tile_cnt, b_addr,
        sfb_addr, x_addr, slab_bytes, n0, b_row_bytes, rest_k, a_frag, tCrB, accumulators, w_stage, x_stage,
        w_stage_next, x_stage_next, x_parity,
    ):
        """One main-loop k-tile: the copies of a later k-tile, the decode of this one's weights
        into `a_frag`, its wgmma. The stages (this k-tile's weight and token stages, those of
        the k-tiles copied now, the token stage's parity) come from the caller: constants in
        the unrolled loop."""
        weights_ahead, tokens_ahead = self.config.weights_ahead, self.config.tokens_ahead
        # k-tile k_tile's weights landed (this thread's copies), then every thread's. Every
        # thread has decoded k-tile k_tile - 1, so its weight stage, the one the copies below
        # overwrite, is free; every warpgroup has retired wgmma k_tile - 2 (before its decode of
        # k_tile - 1), so the token stage the bulk copy below overwrites is free.
        cute.arch.cp_async_wait_group(weights_ahead - 1)
        # Without it (weight stages per warp, token stages freed by the last warp): slower (EXPERIMENTS E8).
        cute.arch.sync_threads()
        if cutlass.const_expr(self.tokens_before_weights):  # noqa: SIM102 - a trace-time branch around a device one
            if k_tile + tokens_ahead < k_tile_cnt:
                self.load_tokens(tile_t, tidx, x_base, mbar_base, x_stage_next, k_tile + tokens_ahead, x_addr,
                                 slab_bytes)
        next_weights = k_tile + weights_ahead
        # Weights straight to registers (no stage) saves at most the no-copy ceiling (EXPERIMENTS E75).
        if next_weights < k_tile_cnt:
            self.load_weights(tidx, w_base, w_stage_next, next_weights, b_addr, sfb_addr, n0, b_row_bytes, rest_k)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(not self.tokens_before_weights):
            next_tokens = k_tile + tokens_ahead
            if next_tokens < k_tile_cnt:
                self.load_tokens(tile_t, tidx, x_base, mbar_base, x_stage_next, next_tokens, x_addr, slab_bytes)
        cute.nvgpu.warpgroup.wait_group(0)  # wgmma k_tile - 1 still reads a_frag
        self.decode_weights(tidx, w_base, w_stage, a_frag)
        # the token rows of k-tile k_tile (its stage's (k_tile // stages)-th copy)
        mbarrier_wait_parity(mbar_base + x_stage * 8, x_parity)
        self.tokens_landed()
        self.mma_k_tile(tiled_mma, accumulators, a_frag, tCrB, x_stage)

    @cute.jit
    def run_tile(
        self, tile_t: cutlass.Constexpr, tidx, bidx, sX_ptr, w_base, mbar_base, operands, group, token0,
        weight_tile, a_frag, accumulators,
    ):
        """The output tile of weight rows weight_tile * 128 .. + 128 and tokens token0 ..
        token0 + tile_t of `group` (this split-K rank's k-tiles): copies, decode, wgmma with
        N = tile_t, epilogue (its scale: epilogue_scale)."""
        warp_group_idx = cute.arch.make_warp_uniform(tidx // 128)
        tiled_mma = make_swap_ab_tiled_mma(self.config, tile_t, self.operand_dtype)
        x_smem_layout_staged = self.token_smem_layout(tile_t)
        sX = cute.make_tensor(
            cute.recast_ptr(sX_ptr, x_smem_layout_staged.inner, dtype=self.operand_dtype), x_smem_layout_staged.outer
        )
        x_base = sX_ptr.toint()

        # the stages' mbarriers, token_arrivals() each (the copying thread's expect_tx)
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages):
                mbarrier_init_shared(mbar_base + s * 8, self.token_arrivals())
            fence_mbarrier_init()
        cute.arch.sync_threads()

        warp_group_thread_layout = cute.make_layout(self.tile_w // 64, stride=128)
        thr_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
        accumulators.fill(0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

        split = self.config.split_k
        m = operands.size(group, 0)
        n = operands.size(group, 1)
        k = operands.size(group, 2)
        n0 = weight_tile * self.tile_w
        if cutlass.const_expr(self.config.k_tail):
            # any k-tile count (K % tile_k == 0): rank r runs k-tiles begin(r) .. begin(r + 1),
            # begin(r) = r (total // split) + min(r, total % split) (none where total < split)
            k_tiles = k // self.tile_k
            share = k_tiles // split
            rank = bidx % split
            k_tile_begin = rank * share + cutlass.min(rank, k_tiles - share * split)
            k_tile_cnt = (rank + 1) * share + cutlass.min(rank + 1, k_tiles - share * split) - k_tile_begin
        else:
            k_tile_cnt = k // (self.tile_k * split)
            k_tile_begin = (bidx % split) * k_tile_cnt
        b_row_bytes = k // 2
        rest_k = k // (SF_VEC_SIZE * 4)
        slab_bytes = operands.activations(group, 1)
        # the rank's first k-tile moves into the base addresses: its loop runs from 0
        half_begin = k_tile_begin * self.k_halves  # the rank's first 64-wide half
        b_addr = operands.address(group, _PTR_B) + cutlass.Int64(half_begin) * self.w_row_bytes
        sfb_addr = operands.address(group, _PTR_SFB) + cutlass.Int64(half_begin) * SF_ATOM_BYTES
        x_addr, slab_bytes = self.token_source(operands, group, half_begin, token0, m, slab_bytes, tile_t, tidx)

        # Prologue: weights of k-tiles 0 .. weight_stages - 2 (one commit group each), token
        # rows of k-tiles 0 .. stages - 3
        weights_ahead, tokens_ahead = self.config.weights_ahead, self.config.tokens_ahead
        if cutlass.const_expr(self.tokens_before_weights):
            for s in cutlass.range_constexpr(tokens_ahead):
                if s < k_tile_cnt:
                    self.load_tokens(tile_t, tidx, x_base, mbar_base, s, s, x_addr, slab_bytes)
        for s in cutlass.range_constexpr(weights_ahead):
            if s < k_tile_cnt:
                self.load_weights(tidx, w_base, s, s, b_addr, sfb_addr, n0, b_row_bytes, rest_k)
            cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.config.pdl):
            # launched as the pre-pass's dependent: its token rows are complete past here.
            # The CTAs decoding the activations themselves, through counters: slower (EXPERIMENTS E21).
            # An L2 prefetch of all the tile's weights before this: slower (EXPERIMENTS E22).
            # Waiting per slab on the pre-pass's counters instead: slower (EXPERIMENTS E16).
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(not self.tokens_before_weights):
            for s in cutlass.range_constexpr(tokens_ahead):
                if s < k_tile_cnt:
                    self.load_tokens(tile_t, tidx, x_base, mbar_base, s, s, x_addr, slab_bytes)

        # Main loop, one A fragment.
        # Two (the decode of k-tile k + 1 beside wgmma k): no faster (EXPERIMENTS E4, E26).
        # Warpgroups taking turns at wgmma (one decodes while the other's runs): slower (EXPERIMENTS E24).
        # A second warpgroup pair in the CTA on half the k-tiles: no faster (EXPERIMENTS E9).
        step_args = (tile_t, tiled_mma, tidx, w_base, x_base, mbar_base)
        tile_args = (b_addr, sfb_addr, x_addr, slab_bytes, n0, b_row_bytes, rest_k, a_frag, tCrB, accumulators)
        weight_stages = self.config.weight_stages
        if cutlass.const_expr(self.config.unrolled_main_loop):
            # unrolled by the stage count (k_tile_cnt is a multiple of it): every stage index
            # and shared address is a constant, the token parity one value per round
            for k_round in cutlass.range(0, k_tile_cnt, self.stages, unroll=1):
                x_parity = (k_round // self.stages) % 2
                for u in cutlass.range_constexpr(self.stages):
                    self.k_tile_step(*step_args, k_round + u, k_tile_cnt, *tile_args, u, u,
                                     (u + weights_ahead) % weight_stages, (u + tokens_ahead) % self.stages, x_parity)
        else:
            for k_tile in cutlass.range(k_tile_cnt, unroll=1):
                self.k_tile_step(*step_args, k_tile, k_tile_cnt, *tile_args, k_tile % weight_stages,
                                 k_tile % self.stages, (k_tile + weights_ahead) % weight_stages,
                                 (k_tile + tokens_ahead) % self.stages, (k_tile // self.stages) % 2)

        cute.nvgpu.warpgroup.wait_group(0)
        cute.arch.cp_async_wait_group(0)

        c_addr = operands.address(group, _PTR_C)
        acc_scale = self.epilogue_scale(operands, group, n0, n)
        if cutlass.const_expr(split > 1):
            # the summing rank of this warpgroup's rows holds their sums
            reduce_split_k_partials(tidx, warp_group_idx, x_base, accumulators, split)
            if cute.arch.block_idx_in_cluster() == warp_group_idx % split:
                self.store_tile(tile_t, tiled_mma, tidx, accumulators, c_addr, m, n, token0, n0, acc_scale,
                                getattr(operands, "scatter", None))
        else:
            self.store_tile_staged(tile_t, tidx, accumulators, x_base, c_addr, m, n, token0, n0, acc_scale,
                                   getattr(operands, "scatter", None))

    def epilogue_scale(self, operands, group, n0, n):
        """What the fp32 sums are multiplied by before rounding: decode_rescale, the exact
        rescale of the decoded operands (a subclass multiplies in a per-group scale). Read
        after the main loop: after the grid-dependency wait of chained calls."""
        return cutlass.Float32(self.decode_rescale)

    def token_source(self, operands, group, half_begin, token0, m, slab_bytes, tile_t, tidx):
        """(x_addr, slab_bytes) of load_tokens for the tile of tokens token0 .. of `group`
        from the rank's first 64-wide half `half_begin` on (plain Python: traced inline, once
        per tile; tile_t and tidx for a subclass whose rows are per thread): the tile's first
        row of that half's slab of decoded activations, and the slab's bytes."""
        return operands.activations(group, 0) + cutlass.Int64(half_begin) * slab_bytes + token0 * self.x_row_bytes, \
            slab_bytes

    def token_arrivals(self) -> int:
        """Arrivals that complete a token stage's mbarrier: the one bulk-copying thread's."""
        return 1

    def tokens_landed(self):
        """After the wait on a token stage's mbarrier, before its wgmma: nothing (the bulk
        copies write through the async proxy that wgmma reads through)."""

    @cute.jit
    def store_tile_staged(self, tile_t: cutlass.Constexpr, tidx, accumulators, stage_base, c_addr, m, n, token0, n0,
                          acc_scale, scatter=None):
        """Epilogue through shared memory: the fp32 sums, times `acc_scale` (epilogue_scale) and
        rounded to the output's dtype (out_dtype: fp16 or bf16), stored
        transposed into the token stages (free once every warpgroup's last wgmma retired) as
        the tile's C rows, one per token (tile_w fp16, padded by 16 bytes so that stmatrix's 8
        rows of a matrix fall in 8 different 16-byte bank groups), then copied out 16 bytes per
        thread and store, coalesced, predicated on M (N is a multiple of the weight tile).

        Accumulator i of lane (g, t) of warp w is C^T[16 w + g + 8 r][8 j + 2 t + c] with
        i = 4 j + 2 r + c (wgmma's fragment): the pair c = 0, 1 of (j, r) is one stmatrix
        register of 8x8 matrix (j, r), whose column (token 8 j + col) .trans stores as 8
        weight rows.

        `scatter` None: token row r of the tile goes to c_addr's row token0 + r. Else (the MoE
        entry's c_rows: its group's first index, c's base address, c's row count): to c's row
        c_rows[token0 + r], none where that index is outside 0 .. rows - 1.

        SwiGLU (self.swiglu: store_swiglu_staged): half the columns, silu(gate) x up."""
        if cutlass.const_expr(self.swiglu):
            self.store_swiglu_staged(tile_t, tidx, accumulators, stage_base, c_addr, m, n, token0, n0, acc_scale,
                                     scatter)
            return
        pitch = self.tile_w * 2 + 16
        lane = tidx % 32
        warp = tidx // 32
        # lane 8 q + col gives the address of column col of matrix q = (j = 2 jj + q // 2,
        # r = q % 2) of register group jj
        lane_offset = ((lane // 16) * 8 + lane % 8) * pitch + (warp * 16 + ((lane // 8) % 2) * 8) * 2
        cute.arch.sync_threads()  # every warpgroup's wgmma is done reading the token stages
        for jj in cutlass.range_constexpr(tile_t // 16):
            registers = []
            for q in cutlass.range_constexpr(4):
                i = 4 * (2 * jj + q // 2) + 2 * (q % 2)
                registers.append(pack_16x2(accumulators[i] * acc_scale, accumulators[i + 1] * acc_scale,
                                           self.out_dtype))
            stmatrix_x4_trans(stage_base + jj * 16 * pitch + lane_offset, registers)
        cute.arch.sync_threads()
        self.copy_out_staged(tile_t, tidx, stage_base, pitch, self.tile_w, c_addr, m, n, token0, n0, scatter)

    @cute.jit
    def copy_out_staged(self, tile_t: cutlass.Constexpr, tidx, stage_base, pitch, columns: cutlass.Constexpr, c_addr,
                        m, row_width, token0, column0, scatter):
        """The staged tile's token rows (`columns` 16-bit values each, `pitch` bytes apart in
        shared memory) to c's rows of `row_width` columns from column `column0`, 16 bytes per
        thread and store, predicated on M; `scatter` as store_tile_staged's."""
        chunks_per_token = columns * 2 // 16
        chunks = tile_t * chunks_per_token
        for i in cutlass.range_constexpr((chunks + self.num_threads - 1) // self.num_threads):
            chunk = tidx + i * self.num_threads
            token = chunk // chunks_per_token
            part = chunk % chunks_per_token
            if cutlass.const_expr(chunks % self.num_threads == 0) or chunk < chunks:  # noqa: SIM102
                if token0 + token < m:
                    if cutlass.const_expr(scatter is None):
                        copy_16B_shared_to_global(
                            stage_base + token * pitch + part * 16,
                            c_addr + (cutlass.Int64(token0 + token) * row_width + column0 + part * 8) * 2,
                        )
                    else:
                        c_rows_addr, c_base, c_row_count = scatter
                        row = load_i64_global(c_rows_addr + cutlass.Int64(token0 + token) * 8)
                        if cutlass.Uint64(row) < cutlass.Uint64(c_row_count):  # unsigned: a negative row is outside
                            copy_16B_shared_to_global(stage_base + token * pitch + part * 16,
                                                      c_base + (row * row_width + column0 + part * 8) * 2)

    @cute.jit
    def store_swiglu_staged(self, tile_t: cutlass.Constexpr, tidx, accumulators, stage_base, c_addr, m, n, token0,
                            n0, acc_scale, scatter=None):
        """store_tile_staged's SwiGLU form: the weight rows of a tile interleaved by 8 (rows 16 w ..
        16 w + 7 the gate rows of intermediate columns n0 / 2 + 8 w .., rows 16 w + 8 .. their up
        rows: swiglu_row_order), so lane (g, t) holds a column's gate (accumulator 4 j + c, r = 0)
        and up (4 j + 2 + c, r = 1) for the same token. Each is scaled (acc_scale: the gate's and
        the up's) and rounded to the output's dtype, as a gate-and-up output would be; then
        silu(gate) x up in fp32 (hopper.ptx.swiglu), rounded again: the tile's n0 / 2 ..
        n0 / 2 + tile_w / 2 - 1 columns of c [rows, N / 2], staged and copied out as there."""
        gate_scale, up_scale = acc_scale
        columns = self.tile_w // 2
        pitch = columns * 2 + 16
        lane = tidx % 32
        warp = tidx // 32
        # lane 8 q + col (q = 0, 1) gives the address of column col of matrix q = (j = 2 jj + q, r = 0)
        lane_offset = (((lane // 8) % 2) * 8 + lane % 8) * pitch + warp * 8 * 2
        cute.arch.sync_threads()  # every warpgroup's wgmma is done reading the token stages
        for jj in cutlass.range_constexpr(tile_t // 16):
            registers = []
            for q in cutlass.range_constexpr(2):
                i = 4 * (2 * jj + q)
                values = [swiglu(round_16(accumulators[i + c] * gate_scale, self.out_dtype),
                                 round_16(accumulators[i + 2 + c] * up_scale, self.out_dtype)) for c in range(2)]
                registers.append(pack_16x2(values[0], values[1], self.out_dtype))
            stmatrix_x2_trans(stage_base + jj * 16 * pitch + lane_offset, registers)
        cute.arch.sync_threads()
        self.copy_out_staged(tile_t, tidx, stage_base, pitch, columns, c_addr, m, n // 2, token0, n0 // 2, scatter)

    @cute.jit
    def store_tile(self, tile_t: cutlass.Constexpr, tiled_mma, tidx, accumulators, c_addr, m, n, token0, n0,
                   acc_scale, scatter=None):
        """Split-K's epilogue (its summing rank's token stages hold the partial sums): the fp32
        sums of (weight row, token) times `acc_scale` -> C[token, weight row] (out_dtype), one
        2-byte store each, predicated on M (N is a multiple of the weight tile). Without
        split-K, slower than store_tile_staged (EXPERIMENTS E15)."""
        tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.tile_w, tile_t)))
        if cutlass.const_expr(self.swiglu):
            self.store_swiglu(tCcC, accumulators, c_addr, m, n, token0, n0, acc_scale, scatter)
            return
        # Predicated stores instead of the branch: within the spread (EXPERIMENTS E11).
        for i in cutlass.range_constexpr(cute.size(accumulators)):
            coord = tCcC[i]
            token = token0 + coord[1]
            if token < m:
                if cutlass.const_expr(scatter is None):
                    store_16(c_addr + (cutlass.Int64(token) * n + n0 + coord[0]) * 2, accumulators[i] * acc_scale,
                             self.out_dtype)
                else:  # store_tile_staged's scatter
                    c_rows_addr, c_base, c_row_count = scatter
                    row = load_i64_global(c_rows_addr + cutlass.Int64(token) * 8)
                    if cutlass.Uint64(row) < cutlass.Uint64(c_row_count):
                        store_16(c_base + (row * n + n0 + coord[0]) * 2, accumulators[i] * acc_scale, self.out_dtype)

    @cute.jit
    def store_swiglu(self, tCcC, accumulators, c_addr, m, n, token0, n0, acc_scale, scatter=None):
        """store_tile's SwiGLU form (store_swiglu_staged's values): each gate accumulator (r = 0,
        weight row 16 w + g of the tile) with its up (r = 1, two further) -> column n0 / 2 + 8 w
        + g of c [rows, N / 2]."""
        gate_scale, up_scale = acc_scale
        n_out = n // 2
        for i in cutlass.range_constexpr(cute.size(accumulators)):
            if cutlass.const_expr(i % 4 < 2):  # r = 0: a gate row; its up row is accumulator i + 2
                coord = tCcC[i]
                token = token0 + coord[1]
                column = n0 // 2 + coord[0] // 16 * 8 + coord[0] % 8
                if token < m:
                    value = swiglu(round_16(accumulators[i] * gate_scale, self.out_dtype),
                                   round_16(accumulators[i + 2] * up_scale, self.out_dtype))
                    if cutlass.const_expr(scatter is None):
                        store_16(c_addr + (cutlass.Int64(token) * n_out + column) * 2, value, self.out_dtype)
                    else:
                        c_rows_addr, c_base, c_row_count = scatter
                        row = load_i64_global(c_rows_addr + cutlass.Int64(token) * 8)
                        if cutlass.Uint64(row) < cutlass.Uint64(c_row_count):
                            store_16(c_base + (row * n_out + column) * 2, value, self.out_dtype)


# =============================================================================
# Compilation
# =============================================================================
fake_ptr = core.fake_ptr


def swap_ab_gemm_build(num_groups: int, config: SwapAbConfig) -> tuple:
    return Sm90SwapAbGemm(config, num_groups), (
        fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Int32), cutlass.Int32(1),
        fake_ptr(cutlass.Int64), cuda.CUstream(0),
    )


def decode_activations_build(num_groups: int, chained: bool) -> tuple:
    return Sm90DecodeActivations(num_groups, chained), (
        fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Int64), cutlass.Int32(1), cuda.CUstream(0))


def compile_swap_ab_gemm(num_groups: int, options: str | None = None, config: SwapAbConfig = SWAP_AB_CONFIG):
    """Compile (cached: core.compile_key) the swap-AB GEMM."""
    return core.compile_once(swap_ab_gemm_build, num_groups, config, options=options,
                             context=smem_per_sm_known_without_gpu)


def compile_decode_activations(num_groups: int, options: str | None = None, chained: bool = False):
    """Compile (cached: core.compile_key) the activation pre-pass for num_groups groups
    (chained: launched as the previous kernel's programmatic dependent, SwapAbConfig.chain_calls)."""
    return core.compile_once(decode_activations_build, num_groups, chained, options=options)


# The GEMM builds of the build report: every config the automatic choice runs
_GEMM_BUILDS = tuple((f"sm90_{name}", config) for name, config in CONFIGS.items() if isinstance(config, SwapAbConfig))


def swap_ab_compile_targets() -> list[tuple[str, str, Callable[[int, str | None], Any]]]:
    """The swap-AB kernels for the build report: (kernel name, arch, compile(G, options)): the
    pre-pass, plain and chained, and every GEMM config the automatic choice runs."""
    return [
        ("sm90_decode_activations", SWAP_AB_CONFIG.arch, compile_decode_activations),
        ("sm90_decode_activations_chained", SWAP_AB_CONFIG.arch, functools.partial(compile_decode_activations,
                                                                                    chained=True)),
    ] + [(name, config.arch, functools.partial(compile_swap_ab_gemm, config=config)) for name, config in _GEMM_BUILDS]
