"""The sm_90a kernel (Sm90Nvfp4GroupedGemm) and its compilation (compile_gemm, and
compile_targets for build_report)."""

from __future__ import annotations

import contextlib
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
    CTAS_PER_SM,
    SEGMENT_FIELDS,
    SF_ATOM_BYTES,
    SF_ATOM_ROWS,
    SF_VEC_SIZE,
    SM90_CONFIG,
    HopperGemmConfig,
)
from .ptx import (
    a_word_selector,
    atomic_add_u32,
    bf16_word_selector,
    cp_async_16B,
    decode_bf16_rows_to_registers,
    decode_scale_blocks,
    decode_scale_blocks_to_registers,
    fence_acq_rel_gpu,
    fence_proxy_async_shared_cta,
    load_f32x4,
    load_f32x4_global_l2,
    load_u32_shared,
    opaque_i64,
    pack_16x8,
    quad_pair_offset,
    store_f16x2,
    store_f32x4_global,
    store_f32x4_to_rank,
    store_u32_global,
    store_u32_shared,
)


def stage_scale_offset(row, block, base=0):
    """base + offset, from the operand's first atom in a raw stage, of the scale the decode
    reads (the kernel calls this with device integers, tests with Python ints) for row `row`
    of the tile (tiles start on a 128-row atom): the in-atom offset of row row % 128 of atom
    slot row // 128."""
    return (
        base
        + (row // SF_ATOM_ROWS) * SF_ATOM_BYTES
        + (row % 32) * 16
        + ((row % SF_ATOM_ROWS) // 32) * 4
        + block
    )


@cute.jit
def decode_rows_to_fragment(tidx, packed_base, row_bytes, scales_base, a_frag, tile_k: cutlass.Constexpr,
                            parts: cutlass.Constexpr = 1, part_bytes: cutlass.Constexpr = 0,
                            dtype: cutlass.Constexpr = cutlass.Float16, paired_scales: cutlass.Constexpr = False,
                            fragment: cutlass.Constexpr = False, quad_scales: cutlass.Constexpr = False):
    """Register-A mode: lane (g, t) of warp w in warpgroup v decodes its share of rows
    64 v + 16 w + g and + 8 of a stage (packed rows of row_bytes from packed_base, their scale
    atoms from scales_base) into the wgmma A fragment. fp16: in ptx's K permutation, from the
    4-byte half t // 2 of every scale block (the bytes a_word_selector(t) picks); bf16 (W4A16):
    in natural K order, from the whole 8 bytes (the bytes bf16_word_selector(t) picks; paired_scales:
    decode_bf16_rows_to_registers'). `parts`
    stages of tile_k (64) each, part_bytes apart, fill the fragment's k16 steps in order (one
    decode, every load first). fragment (bf16 only): the weights in
    nvfp4_group_gemm.weight_layout's fragment layout, the lane's 16 bytes of its warp's 16-row
    block at 16 x lane."""
    lane = tidx % 32
    row = (tidx // 32) * 16 + lane // 4
    t = lane % 4
    if cutlass.const_expr(dtype == cutlass.Float16):
        half_offset = (t // 2) * 4
        # a_word_selector(t) depends on t % 2 only, by one step per byte selector
        selector = a_word_selector(0) + (a_word_selector(1) - a_word_selector(0)) * (t % 2)
        decode = decode_scale_blocks_to_registers
    else:
        half_offset = 0
        # bf16_word_selector(t) is linear in t
        selector = bf16_word_selector(0) + (bf16_word_selector(1) - bf16_word_selector(0)) * t
        decode = decode_bf16_rows_to_registers
    rows = (row, row + 8)
    # (row, byte offset) of the scale words read: rows g and g+8's, or with quad_scales the
    # lane's pair of bytes (ptx.quad_pair_offset(t))
    scale_words = ((row, 0), (row + 8, 0))
    if cutlass.const_expr(quad_scales):
        row_offset, byte_offset = quad_pair_offset(t)
        scale_words = ((row + row_offset, byte_offset),)
    if cutlass.const_expr(fragment):
        # the warp's block of 16 rows (row_bytes each), the lane's 16 bytes in it
        lane_bytes = (tidx // 32) * 16 * row_bytes + lane * 16
        units = [
            (
                packed_base + part * part_bytes + lane_bytes,
                packed_base + part * part_bytes + lane_bytes,
                0,
                *(stage_scale_offset(r, 0, base=scales_base + part * part_bytes) + offset
                  for r, offset in scale_words),
            )
            for part in range(parts)
        ]
    else:
        units = [
            (
                *(packed_base + part * part_bytes + r * row_bytes + half_offset for r in rows),
                selector,
                *(stage_scale_offset(r, 0, base=scales_base + part * part_bytes) + offset
                  for r, offset in scale_words),
            )
            for part in range(parts)
        ]
    if cutlass.const_expr(dtype == cutlass.Float16):
        steps_of_parts = decode(units)
    else:
        steps_of_parts = decode(units, paired_scales, fragment, quad_scales)
    # k16 step s: registers (row g, cols 2t..) (row g+8, 2t..) (g, 2t+8..) (g+8, 2t+8..)
    for part in cutlass.range_constexpr(parts):
        for step in cutlass.range_constexpr(tile_k // 16):
            step_frag = a_frag[(None, 0, part * (tile_k // 16) + step)]
            step_frag.store(cute.TensorSSA(pack_16x8(steps_of_parts[part][step], dtype), step_frag.shape, dtype))


@cute.jit
def reduce_split_k_partials(tidx, warp_group_idx, reduction_base, accumulators, split_k: cutlass.Constexpr):
    """Split-K over a cluster of split_k CTAs: the rows of warpgroup w are summed and stored
    by rank w % split_k (so the epilogues run in parallel); the other ranks add theirs into
    its accumulators. Each thread's fragment goes to the summing rank's shared memory at
    reduction_base in fragment order (its thread tidx has the same fragment layout), 16 bytes
    per store, consecutive threads on consecutive 16 bytes; each sender has its own slot, and
    the summing rank adds the slots in a fixed order (the same sums on every call)."""
    num_vectors = cute.size(accumulators) // 4
    k_rank = cute.arch.block_idx_in_cluster()
    summing_rank = warp_group_idx % split_k
    senders = split_k - 1
    # slots of warpgroup w's rows, in 16-byte units: split_k - 1 per warpgroup a rank sums (the
    # w // split_k-th of them), one per sender, 128 threads side by side
    first_slot = (warp_group_idx // split_k) * senders * 128 * num_vectors + tidx % 128
    # every thread of the cluster is past its main loop: the receiving buffers are free
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    if k_rank != summing_rank:
        sender_slot = first_slot
        if cutlass.const_expr(senders > 1):
            # the ranks after the summing one (cyclically) are senders 0, 1, ...
            sender_slot = first_slot + (k_rank - summing_rank - 1 + split_k) % split_k * 128 * num_vectors
        for j in cutlass.range_constexpr(num_vectors):
            store_f32x4_to_rank(
                reduction_base + (j * 128 + sender_slot) * 16,
                [accumulators[4 * j + e] for e in range(4)],
                summing_rank,
            )
    # release (the senders' stores) / acquire (the summing rank's loads)
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    if k_rank == summing_rank:
        for sender in cutlass.range_constexpr(senders):
            for j in cutlass.range_constexpr(num_vectors):
                partial = load_f32x4(reduction_base + (j * 128 + first_slot + sender * 128 * num_vectors) * 16)
                for e in cutlass.range_constexpr(4):
                    accumulators[4 * j + e] = accumulators[4 * j + e] + partial[e]


# The operands' major mode: cute.nvgpu.OperandMajorMode from DSL 4.4 on, where warpgroup's own
# is deprecated; DSL 4.3.5 (the competition's runner) has only warpgroup's
OPERAND_MAJOR_MODE = getattr(cute.nvgpu, "OperandMajorMode", None) or cute.nvgpu.warpgroup.OperandMajorMode


def make_tiled_mma(config: HopperGemmConfig):
    """The kernel's fp16 wgmma (fp32 accumulators): one warpgroup per 64 rows, A from
    registers, B from shared memory, both K-major."""
    return sm90_utils.make_trivial_tiled_mma(
        cutlass.Float16,
        cutlass.Float16,
        OPERAND_MAJOR_MODE.K,
        OPERAND_MAJOR_MODE.K,
        cutlass.Float32,
        (config.tile_m // 64, 1, 1),
        tiler_mn=(64, config.tile_n),
        a_source=cute.nvgpu.warpgroup.OperandSource.RMEM,
    )


class Sm90Nvfp4GroupedGemm:
    """Grouped NVFP4 GEMM on sm_90a: cp.async -> decode to fp16 (B into shared memory, A into
    registers) -> wgmma."""

    # The DSL names the compiled kernel and host function after str(self), which begins with
    # the class's module and name: the package's public name keeps every symbol (and so every
    # cubin) as it was when the kernel lived in one module, nvfp4_group_gemm.hopper.py.
    __module__ = "nvfp4_group_gemm.hopper"

    def __init__(self, config: HopperGemmConfig, num_groups: int):
        config.check()
        self.config = config
        self.num_groups = num_groups
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.tile_k = config.tile_k
        self.num_threads = config.num_threads
        self.raw_stages = config.raw_stages
        self.mma_stages = config.mma_stages
        self.raw_stage_bytes = config.raw_stage_bytes
        # byte offsets inside one raw stage
        self.raw_row_bytes = config.tile_k // 2
        self.raw_b_offset = config.tile_m * self.raw_row_bytes
        self.raw_sfa_offset = (config.tile_m + config.tile_n) * self.raw_row_bytes
        self.raw_sfb_offset = self.raw_sfa_offset + config.sfa_atoms * SF_ATOM_BYTES
        # decoded fp16 row: tile_k * 2 bytes = one 128-byte swizzle row
        self.dec_row_bytes = config.tile_k * 2
        self.blocks_per_row = config.tile_k // SF_VEC_SIZE

    @cute.jit
    def __call__(
        self,
        ptrs: cute.Pointer,
        sizes: cute.Pointer,
        tiles: cute.Pointer,
        num_tiles: cutlass.Int32,
        work: cute.Pointer,
        num_workers: cutlass.Int32,
        workspace: cute.Pointer,
        counters: cute.Pointer,
        stream: cuda.CUstream,
    ):
        """work, num_workers, workspace, counters: the stream-K plan (StreamKPlan); unused
        (any value) unless config.stream_k."""
        mma_tiler_mnk = (self.tile_m, self.tile_n, self.tile_k)
        tiled_mma = make_tiled_mma(self.config)
        b_smem_layout_staged = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.ROW_MAJOR, mma_tiler_mnk, cutlass.Float16, self.mma_stages
        )

        @cute.struct
        class SharedStorage:
            # 1 KB ahead of the B stages (decoded A lives in registers): the stream-K arrival
            # word, and the start of the split-K receive region
            head: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, 512], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float16, cute.cosize(b_smem_layout_staged)], 1024
            ]
            raw: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, self.raw_stage_bytes * self.raw_stages], 128
            ]

        self.shared_storage = SharedStorage

        mPtrs = cute.make_tensor(ptrs, cute.make_layout((self.num_groups, 5), stride=(5, 1)))
        mSizes = cute.make_tensor(sizes, cute.make_layout((self.num_groups, 4), stride=(4, 1)))
        mTiles = cute.make_tensor(tiles, cute.make_layout((num_tiles, 3), stride=(3, 1)))
        # stream-K: worker w runs segments [mWork[w], mWork[w + 1]) of the segment rows that
        # follow the num_workers + 1 offsets (at most num_workers + num_tiles - 1 rows: every
        # cut between two workers splits at most one tile)
        mWork = cute.make_tensor(work, cute.make_layout(num_workers + 1))
        mSegments = cute.make_tensor(
            work + (num_workers + 1),
            cute.make_layout((num_workers + num_tiles, SEGMENT_FIELDS), stride=(SEGMENT_FIELDS, 1)),
        )

        split = self.config.split_k
        if cutlass.const_expr(split > 1):
            # a summing rank receives the other rank's sums from the start of its head .. raw
            # region (head is the struct's first member, the members are laid out in order),
            # free after its main loop: 64 x tile_n fp32, the size of the two fp16 B stages
            assert self.config.reduction_bytes <= SharedStorage.size_in_bytes()
        kernel = self.kernel(
            tiled_mma, mPtrs, mSizes, mTiles, mWork, mSegments, workspace, counters,
            b_smem_layout_staged,
        )
        kernel.launch(
            grid=(num_workers if cutlass.const_expr(self.config.stream_k) else num_tiles * split, 1, 1),
            block=(self.num_threads, 1, 1),
            cluster=(split, 1, 1) if split > 1 else None,
            # stream-K's segment loop costs registers: unbounded, ptxas takes 169 (one CTA per
            # SM); asking for 2 CTAs per SM holds it at 128 (CPU build)
            min_blocks_per_mp=CTAS_PER_SM if cutlass.const_expr(self.config.stream_k) else 0,
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
        )

    # -------------------------------------------------------------------------
    # Producer: one k-tile of packed data and scales into raw stage `stage`
    # -------------------------------------------------------------------------
    @cute.jit
    def load_raw_stage(
        self, tidx, raw_base, stage, k_tile, a_addr, b_addr, sfa_addr, sfb_addr,
        m, n, m0, n0, row_bytes, rest_k,
    ):
        stage_base = raw_base + stage * self.raw_stage_bytes
        k_byte = k_tile * self.raw_row_bytes
        chunks_per_row = self.raw_row_bytes // 16
        # A rows (zero-filled past M)
        for i in cutlass.range_constexpr(self.tile_m * chunks_per_row // self.num_threads):
            chunk = tidx + i * self.num_threads
            row = chunk // chunks_per_row
            part = chunk % chunks_per_row
            valid = (m0 + row) < m
            src_row = (m0 + row) if valid else 0
            src = a_addr + cutlass.Int64(src_row) * row_bytes + k_byte + part * 16
            cp_async_16B(stage_base + row * self.raw_row_bytes + part * 16, src, 16 if valid else 0)
        # B rows (zero-filled past N)
        for i in cutlass.range_constexpr(self.tile_n * chunks_per_row // self.num_threads):
            chunk = tidx + i * self.num_threads
            self.load_b_chunk(chunk, stage_base, k_byte, b_addr, n, n0, row_bytes)
        # Scale atoms: 512 contiguous bytes per 128 rows and k-tile
        sf_chunks_a = self.config.sfa_atoms * (SF_ATOM_BYTES // 16)
        sf_chunks_b = self.config.sfb_atoms * (SF_ATOM_BYTES // 16)
        if tidx < sf_chunks_a:
            atom = tidx // (SF_ATOM_BYTES // 16)
            part = tidx % (SF_ATOM_BYTES // 16)
            atom_row = m0 // SF_ATOM_ROWS + atom
            valid = atom_row * SF_ATOM_ROWS < m
            src = sfa_addr + (cutlass.Int64(atom_row if valid else 0) * rest_k + k_tile) * SF_ATOM_BYTES + part * 16
            cp_async_16B(
                stage_base + self.raw_sfa_offset + atom * SF_ATOM_BYTES + part * 16, src, 16 if valid else 0
            )
        if tidx >= sf_chunks_a and tidx < sf_chunks_a + sf_chunks_b:
            local = tidx - sf_chunks_a
            atom = local // (SF_ATOM_BYTES // 16)
            part = local % (SF_ATOM_BYTES // 16)
            atom_row = n0 // SF_ATOM_ROWS + atom
            valid = atom_row * SF_ATOM_ROWS < n
            src = sfb_addr + (cutlass.Int64(atom_row if valid else 0) * rest_k + k_tile) * SF_ATOM_BYTES + part * 16
            cp_async_16B(
                stage_base + self.raw_sfb_offset + atom * SF_ATOM_BYTES + part * 16, src, 16 if valid else 0
            )

    @cute.jit
    def prefetch(self, tidx, raw_base, next_tile, k_tile_cnt, a_addr, b_addr, sfa_addr, sfb_addr,
                 m, n, m0, n0, row_bytes, rest_k):
        """cp.async of k-tile next_tile into its raw stage (when it exists), as one commit
        group: every k-tile commits exactly one group, empty past the last k-tile."""
        if next_tile < k_tile_cnt:
            self.load_raw_stage(
                tidx, raw_base, next_tile % self.raw_stages, next_tile,
                a_addr, b_addr, sfa_addr, sfb_addr, m, n, m0, n0, row_bytes, rest_k,
            )
        cute.arch.cp_async_commit_group()

    @cute.jit
    def load_b_chunk(self, chunk, stage_base, k_byte, b_addr, n, n0, row_bytes):
        """16 bytes of packed B row n0 + chunk // chunks_per_row (zero-filled past N)."""
        chunks_per_row = self.raw_row_bytes // 16
        row = chunk // chunks_per_row
        part = chunk % chunks_per_row
        valid = (n0 + row) < n
        src_row = (n0 + row) if valid else 0
        src = b_addr + cutlass.Int64(src_row) * row_bytes + k_byte + part * 16
        cp_async_16B(
            stage_base + self.raw_b_offset + row * self.raw_row_bytes + part * 16,
            src,
            16 if valid else 0,
        )

    # -------------------------------------------------------------------------
    # Decode: raw stage -> fp16 stage (swizzled K-major, 128-byte rows)
    # -------------------------------------------------------------------------
    @cute.jit
    def decode_stage(self, tidx, raw_base, raw_stage, sB_base, mma_stage):
        """Decode B of one raw stage into fp16 stage `mma_stage` (A goes into registers:
        decode_a_registers)."""
        raw_stage_base = raw_base + raw_stage * self.raw_stage_bytes
        blocks = []
        for i in cutlass.range_constexpr(self.tile_n * self.blocks_per_row // self.num_threads):
            item = tidx + i * self.num_threads
            row = item // self.blocks_per_row
            blk = item % self.blocks_per_row
            src = raw_stage_base + self.raw_b_offset + row * self.raw_row_bytes + blk * (SF_VEC_SIZE // 2)
            # reordered scale atom: ((row % 32) * 16 + ((row % 128) // 32) * 4 + block) bytes
            scale = stage_scale_offset(row, blk, base=raw_stage_base + self.raw_sfb_offset)
            # 128-byte swizzle: 16-byte chunk index XOR (row % 8) inside each 1024-byte atom
            row_base = sB_base + (mma_stage * self.tile_n + row) * self.dec_row_bytes
            swz = row % 8
            dst_lo = row_base + ((2 * blk) ^ swz) * 16
            dst_hi = row_base + ((2 * blk + 1) ^ swz) * 16
            blocks.append((src, scale, dst_lo, dst_hi))
        decode_scale_blocks(blocks)

    @cute.jit
    def decode_a_registers(self, tidx, raw_base, raw_stage, a_frag):
        """Register-A mode: A's rows of the raw stage into the wgmma A fragment
        (decode_rows_to_fragment)."""
        raw_stage_base = raw_base + raw_stage * self.raw_stage_bytes
        decode_rows_to_fragment(
            tidx, raw_stage_base, self.raw_row_bytes, raw_stage_base + self.raw_sfa_offset, a_frag, self.tile_k
        )

    def summing_rank(self, warp_group_idx):
        """Split-K: the cluster rank that sums and stores the rows of warpgroup
        `warp_group_idx` (plain Python: traced inline), so that the two epilogues run in
        parallel. Rank 0 summing and storing the whole tile: slower (EXPERIMENTS E38)."""
        return warp_group_idx % self.config.split_k

    def mma_k_tile(self, tiled_mma, accumulators, a_frag, tCrB, b_stage, num_k_blocks):
        """The wgmma of one k-tile as one commit group (plain Python: traced inline): A from
        the register fragment `a_frag`, B from shared-memory stage b_stage."""
        cute.nvgpu.warpgroup.fence()
        for k_block in range(num_k_blocks):
            a_operand = a_frag[(None, None, k_block)]
            cute.gemm(tiled_mma, accumulators, a_operand, tCrB[(None, None, k_block, b_stage)], accumulators)
        cute.nvgpu.warpgroup.commit_group()

    def tile_of(self, tile_idx, mPtrs, mSizes, mTiles):
        """(tile_row, tile_col, m, n, k, a, b, c, sfa, sfb addresses) of tile `tile_idx` of
        the tile table (plain Python: loads only, no device branch)."""
        group = mTiles[tile_idx, 0]
        return (
            mTiles[tile_idx, 1], mTiles[tile_idx, 2],
            mSizes[group, 0], mSizes[group, 1], mSizes[group, 2],
            mPtrs[group, 0], mPtrs[group, 1], mPtrs[group, 2], mPtrs[group, 3], mPtrs[group, 4],
        )

    @cute.jit
    def store_tile(self, tiled_mma, tidx, accumulators, c_addr, m, n, tile_row, tile_col, stores_rows):
        """Epilogue: fp32 -> fp16, stores predicated on the M and N residues (when
        `stores_rows`: this thread's warpgroup has rows in the group and holds their sums).

        wgmma's fp32 fragment holds, per row and 8-column block, columns 2t and 2t + 1 as
        consecutive values (value mode (2, 2, N/8): column pair, row + 8, block): one 32-bit
        store per pair; N is even, so a pair is all in or all out of the matrix. Paired stores
        halve the epilogue's conversions, predicates and stores (EXPERIMENTS E45)."""
        cC = cute.local_tile(
            cute.make_identity_tensor((m, n)), (self.tile_m, self.tile_n), (tile_row, tile_col)
        )
        tCcC = tiled_mma.get_slice(tidx).partition_C(cC)
        # both operands carry 2^-14 (the decode's one multiply): exact rescale
        acc_scale = cutlass.Float32(2.0**28)
        if stores_rows:
            for i in cutlass.range_constexpr(cute.size(accumulators) // 2):
                coord = tCcC[2 * i]
                if coord[0] < m and coord[1] < n:
                    store_f16x2(
                        c_addr + (cutlass.Int64(coord[0]) * n + coord[1]) * 2,
                        accumulators[2 * i] * acc_scale,
                        accumulators[2 * i + 1] * acc_scale,
                    )

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        mPtrs: cute.Tensor,
        mSizes: cute.Tensor,
        mTiles: cute.Tensor,
        mWork: cute.Tensor,
        mSegments: cute.Tensor,
        workspace: cute.Pointer,
        counters: cute.Pointer,
        b_smem_layout_staged: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_group_idx = cute.arch.make_warp_uniform(tidx // 128)

        #
        # Shared memory
        #
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        head_base = storage.head.data_ptr().toint()
        sB_base = storage.sB.data_ptr().toint()
        raw_base = storage.raw.data_ptr().toint()

        #
        # MMA fragments: warpgroup w owns rows [64 w, 64 w + 64) of the tile
        #
        warp_group_thread_layout = cute.make_layout(self.tile_m // 64, stride=128)
        thr_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx))
        tCsB = thr_mma.partition_B(sB)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        a_frag_shape = tiled_mma.partition_shape_A((self.tile_m, self.tile_k))
        a_frag = cute.make_rmem_tensor(a_frag_shape, cutlass.Float16)
        gC_shape_probe = cute.make_identity_tensor((self.tile_m, self.tile_n))
        acc_shape = thr_mma.partition_C(gC_shape_probe).shape
        accumulators = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        smem_bases = (sB_base, raw_base)

        if cutlass.const_expr(self.config.stream_k):
            # the head's first word carries the arrival count
            arrival_smem = head_base
            workspace_addr = workspace.toint()
            counters_addr = counters.toint()
            for segment in cutlass.range(mWork[bidx], mWork[bidx + 1], unroll=1):
                seg_tile = mSegments[segment, 0]
                self.mma_segment(
                    tiled_mma, tidx, warp_group_idx, mPtrs, mSizes, mTiles, smem_bases,
                    a_frag, tCrB, accumulators,
                    seg_tile, mSegments[segment, 1], mSegments[segment, 2],
                )
                (tile_row, tile_col, m, n, _k, _a, _b, c_addr, _sfa, _sfb) = self.tile_of(
                    seg_tile, mPtrs, mSizes, mTiles
                )
                stores_rows = (tile_row * self.tile_m + warp_group_idx * 64) < m
                num_parts = mSegments[segment, 4]
                if num_parts == 1:
                    self.store_tile(tiled_mma, tidx, accumulators, c_addr, m, n, tile_row, tile_col, stores_rows)
                else:
                    self.stream_k_fixup(
                        tiled_mma, tidx, accumulators, arrival_smem,
                        workspace_addr, counters_addr + cutlass.Int64(seg_tile) * 4,
                        mSegments[segment, 5], mSegments[segment, 3], num_parts,
                        c_addr, m, n, tile_row, tile_col, stores_rows,
                    )
        else:
            # split_k > 1: the split_k consecutive CTAs of a cluster (grid x) share one tile;
            # rank r (cluster shape (split_k, 1, 1)) runs its k-tiles r * cnt .. (r + 1) * cnt
            split = self.config.split_k
            tile_idx = bidx // split
            (tile_row, tile_col, m, n, k, _a, _b, c_addr, _sfa, _sfb) = self.tile_of(
                tile_idx, mPtrs, mSizes, mTiles
            )
            k_tile_cnt = k // (self.tile_k * split)
            self.mma_segment(
                tiled_mma, tidx, warp_group_idx, mPtrs, mSizes, mTiles, smem_bases,
                a_frag, tCrB, accumulators,
                tile_idx, (bidx % split) * k_tile_cnt, k_tile_cnt,
            )
            if cutlass.const_expr(split > 1):
                reduce_split_k_partials(tidx, warp_group_idx, head_base, accumulators, split)

            # (split_k > 1: only the summing rank of this warpgroup's rows holds their sum)
            stores_rows = (tile_row * self.tile_m + warp_group_idx * 64) < m
            if cutlass.const_expr(split > 1):
                stores_rows = stores_rows and (
                    cute.arch.block_idx_in_cluster() == self.summing_rank(warp_group_idx)
                )
            self.store_tile(tiled_mma, tidx, accumulators, c_addr, m, n, tile_row, tile_col, stores_rows)

    @cute.jit
    def mma_segment(
        self, tiled_mma, tidx, warp_group_idx, mPtrs, mSizes, mTiles, smem_bases,
        a_frag, tCrB, accumulators, tile_idx, k_tile_begin, k_tile_cnt,
    ):
        """accumulators = the sums of tile `tile_idx` over its k-tiles [k_tile_begin,
        k_tile_begin + k_tile_cnt) (an even count): copy, decode and wgmma of each k-tile,
        pipelined; every copy and wgmma of the segment has completed on return."""
        sB_base, raw_base = smem_bases
        (tile_row, tile_col, m, n, k, a_addr, b_addr, _c, sfa_addr, sfb_addr) = self.tile_of(
            tile_idx, mPtrs, mSizes, mTiles
        )
        m0 = tile_row * self.tile_m
        n0 = tile_col * self.tile_n
        row_bytes = k // 2
        rest_k = k // (SF_VEC_SIZE * 4)
        # the segment's first k-tile moves into the base addresses: the loop runs from 0
        a_addr = a_addr + cutlass.Int64(k_tile_begin) * self.raw_row_bytes
        b_addr = b_addr + cutlass.Int64(k_tile_begin) * self.raw_row_bytes
        sfa_addr = sfa_addr + cutlass.Int64(k_tile_begin) * SF_ATOM_BYTES
        sfb_addr = sfb_addr + cutlass.Int64(k_tile_begin) * SF_ATOM_BYTES
        accumulators.fill(0.0)
        # Rows of this warpgroup that exist in the group: skip its wgmma when there are none
        warp_group_has_rows = (m0 + warp_group_idx * 64) < m

        #
        # Prologue: prefetch raw_stages - 1 k-tiles
        #
        for s in cutlass.range_constexpr(self.raw_stages - 1):
            if s < k_tile_cnt:
                self.load_raw_stage(
                    tidx, raw_base, s, s, a_addr, b_addr, sfa_addr, sfb_addr,
                    m, n, m0, n0, row_bytes, rest_k,
                )
            cute.arch.cp_async_commit_group()

        #
        # Main loop
        #
        num_k_blocks = cute.size(a_frag, mode=[2])
        # unrolled by the 2 fp16 stages so that the stage is static
        # (k_tile_cnt is even: K % 256 == 0, stream-K cuts at even k-tiles)
        for k_pair in cutlass.range(k_tile_cnt // 2, unroll=1):
            for mma_stage in cutlass.range_constexpr(2):
                k_tile = 2 * k_pair + mma_stage
                next_tile = k_tile + self.raw_stages - 1
                self.prefetch(tidx, raw_base, next_tile, k_tile_cnt, a_addr, b_addr,
                              sfa_addr, sfb_addr, m, n, m0, n0, row_bytes, rest_k)
                cute.arch.cp_async_wait_group(self.raw_stages - 1)
                # raw k_tile visible to all; every warpgroup has retired wgmma k_tile - 2.
                # Warp-local copies, a warp sync here and 3 B stages: slower (EXPERIMENTS E46).
                # One barrier per k-tile, wgmma k right after it: no faster (EXPERIMENTS E47).
                # On top of that, a wgmma commit group per k16 step: slower (EXPERIMENTS E48).
                # No unit is saturated here: the warps wait on latencies (EXPERIMENTS E55).
                cute.arch.sync_threads()
                raw_stage = k_tile % self.raw_stages
                self.decode_stage(tidx, raw_base, raw_stage, sB_base, mma_stage)
                # ptxas emits this as MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S (EXPERIMENTS E55).
                # The prefetch issued after this fence instead of first: slower (EXPERIMENTS E50).
                fence_proxy_async_shared_cta()
                # the one A fragment is still read by wgmma k_tile - 1.
                # Two A fragments (decode k + 1 beside wgmma k): slower (EXPERIMENTS E39).
                cute.nvgpu.warpgroup.wait_group(0)
                self.decode_a_registers(tidx, raw_base, raw_stage, a_frag)
                cute.arch.sync_threads()
                if warp_group_has_rows:
                    self.mma_k_tile(tiled_mma, accumulators, a_frag, tCrB, mma_stage, num_k_blocks)
                    cute.nvgpu.warpgroup.wait_group(1)

        cute.nvgpu.warpgroup.wait_group(0)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def stream_k_fixup(
        self, tiled_mma, tidx, accumulators, arrival_smem, workspace_addr, counter_addr,
        slot_base, part, num_parts, c_addr, m, n, tile_row, tile_col, stores_rows,
    ):
        """Stream-K, a tile shared by num_parts workers: store this part's sums into workspace
        slot slot_base + part; the last part to arrive adds slots slot_base .. + num_parts - 1
        in that order (the same sum whichever worker is last), stores the tile and resets the
        tile's counter to 0 for the next launch.

        Slot layout: vector j (4 fp32) of thread t at ((j * num_threads) + t) * 16 bytes, so a
        warp's stores and loads are 512 contiguous bytes."""
        tile_bytes = self.tile_m * self.tile_n * 4
        num_vectors = cute.size(accumulators) // 4
        # computed here, not hoisted out of the segment loop (a hoisted per-thread address
        # spilled 16 bytes)
        workspace_addr = opaque_i64(workspace_addr)
        own_slot = workspace_addr + cutlass.Int64(slot_base + part) * tile_bytes + tidx * 16
        for j in cutlass.range_constexpr(num_vectors):
            store_f32x4_global(
                own_slot + j * self.num_threads * 16, [accumulators[4 * j + e] for e in range(4)]
            )
        # release: every thread's stores are ordered before thread 0's arrival
        fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            store_u32_shared(arrival_smem, atomic_add_u32(counter_addr, 1))
        cute.arch.sync_threads()
        arrived_before = load_u32_shared(arrival_smem)
        if arrived_before == num_parts - 1:
            # acquire: the other parts' stores (released before their arrivals) are visible
            fence_acq_rel_gpu()
            accumulators.fill(0.0)
            for slot in cutlass.range(slot_base, slot_base + num_parts, unroll=1):
                src = workspace_addr + cutlass.Int64(slot) * tile_bytes + tidx * 16
                for j in cutlass.range_constexpr(num_vectors):
                    partial = load_f32x4_global_l2(src + j * self.num_threads * 16)
                    for e in cutlass.range_constexpr(4):
                        accumulators[4 * j + e] = accumulators[4 * j + e] + partial[e]
            self.store_tile(tiled_mma, tidx, accumulators, c_addr, m, n, tile_row, tile_col, stores_rows)
            if tidx == 0:
                store_u32_global(counter_addr, 0)


# =============================================================================
# Compilation
# =============================================================================
fake_ptr = core.fake_ptr


# Shared memory per SM of sm_90 GPUs (228 KB), for the compile below on a machine without one
SM90_SMEM_PER_SM = 233472


@contextlib.contextmanager
def smem_per_sm_known_without_gpu():
    """A launch with min_blocks_per_mp > 1 makes DSL 4.3.5 read the device's shared memory per
    SM while tracing (for a shared-memory carveout hint), which fails where there is no GPU.
    There, answer with the sm_90 value; with a GPU, the real query runs."""
    from cutlass.cutlass_dsl import cutlass as dsl_cutlass

    helpers = dsl_cutlass.cuda_helpers
    query = helpers.get_device_attribute
    smem_attribute = cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR

    def get_device_attribute(attribute, device_id=0):
        try:
            return query(attribute, device_id)
        except Exception:
            if attribute == smem_attribute:
                return SM90_SMEM_PER_SM
            raise

    helpers.get_device_attribute = get_device_attribute
    try:
        yield
    finally:
        helpers.get_device_attribute = query


def gemm_build(num_groups: int, config: HopperGemmConfig) -> tuple:
    return Sm90Nvfp4GroupedGemm(config, num_groups), (
        fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Int32), cutlass.Int32(1),
        fake_ptr(cutlass.Int32), cutlass.Int32(1), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Int32),
        cuda.CUstream(0),
    )


def compile_gemm(num_groups: int, options: str | None = None, config: HopperGemmConfig = SM90_CONFIG):
    """Compile (cached on G, the config and the options: core.compile_key) the sm_90a kernel."""
    return core.compile_once(gemm_build, num_groups, config, options=options, context=smem_per_sm_known_without_gpu)


def compile_targets() -> list[tuple[str, str, Callable[[int, str | None], Any]]]:
    """Kernels of this backend for the build report: (sm90_<registry name>, arch,
    compile(G, options)): every in-GEMM-decode config of the registry (config.CONFIGS), which
    are those the default backend picks: whole 128x128 tiles, split-K over 2 CTAs with 128x128
    and with 128x256 tiles, stream-K."""
    return [
        (f"sm90_{name}", config.arch, functools.partial(compile_gemm, config=config))
        for name, config in CONFIGS.items() if isinstance(config, HopperGemmConfig)
    ]


