"""The per-tile sm_100a kernel (the known-good fallback): one CTA per 128x128 output tile.

Device code (``init_tensormaps_kernel``: every group's TMA descriptors, one CTA per group;
``gemm_kernel``: warp 0 drives TMA and the 1-CTA block-scaled MMA, all 4 warps run the
epilogue), then the host side (``@cute.jit`` entries ``init_tensormaps_jit``, ``gemm_jit``,
and the launch helpers the library's entries share: ``per_tile_init_launch``,
``per_tile_gemm_launch``)."""

import cutlass
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import cute, pipeline, utils
from cutlass.cute.nvgpu import cpasync, tcgen05

from .config import (
    C_VECTOR_ELEMS,
    NUM_PTR_COLS,
    PTR_A,
    PTR_B,
    PTR_C,
    PTR_SFA,
    PTR_SFB,
    ab_dtype,
    bytes_per_tensormap,
    c_dtype,
    chained_launch,
    mma_inst_shape_k,
    mma_tiler_mnk,
    num_ab_stage,
    num_acc_stage,
    num_tensormaps,
    num_tmem_alloc_cols,
    sf_dtype,
    sf_vec_size,
    threads_per_cta,
)
from .device_helpers import (
    acquire_tensormap,
    group_tensormap_gmem_ptrs,
    launch_dependents,
    wait_for_previous_grid,
)


@cute.kernel
def init_tensormaps_kernel(
    tma_atom_a: cute.CopyAtom,
    tma_atom_b: cute.CopyAtom,
    tma_atom_sfa: cute.CopyAtom,
    tma_atom_sfb: cute.CopyAtom,
    tensor_of_ptrs: cute.Tensor,  # [G, 5] int64: a, b, c, sfa, sfb
    tensor_of_problem_sizes: cute.Tensor,  # [G, 4] int32: m, n, k, l
    tensormaps: cute.Tensor,  # [G, 4, 16] int64: descriptors of a, b, sfa, sfb
):
    """Write the A/B/SFA/SFB TMA descriptors of group `blockIdx.z` into `tensormaps`."""
    warp_idx = cute.arch.warp_idx()
    warp_idx = cute.arch.make_warp_uniform(warp_idx)
    _, _, group_idx = cute.arch.block_idx()

    # Chained calls (SM100_CHAIN_CALLS): the sizes and pointers are read, and the descriptors
    # written (a buffer the previous GEMM may still read), after the previous kernel is done.
    # The GEMM after this kernel may launch at once: it holds nothing this kernel needs (no
    # TMEM here, a few KB of shared memory) and reads the descriptors only after its own wait.
    wait_for_previous_grid()
    launch_dependents()

    m = tensor_of_problem_sizes[group_idx, 0]
    n = tensor_of_problem_sizes[group_idx, 1]
    k = tensor_of_problem_sizes[group_idx, 2]
    l = cutlass.Int32(1)

    size_tensormap_in_i64 = num_tensormaps * bytes_per_tensormap // 8

    # Deviation from the seed: the descriptor staging buffer is aligned to 128 B (the seed's
    # plain MemRange[Int64] is only 8-byte aligned, which DSL releases from 4.6 on reject;
    # a TMA descriptor must sit on a 64 B boundary anyway).
    @cute.struct
    class SharedStorage:
        tensormap_buffer: cute.struct.Align[
            cute.struct.MemRange[cutlass.Int64, size_tensormap_in_i64], 128
        ]

    smem = utils.SmemAllocator()
    storage = smem.allocate(SharedStorage)

    tensormap_smem_ptr = storage.tensormap_buffer.data_ptr()
    tensormap_a_smem_ptr = tensormap_smem_ptr
    tensormap_b_smem_ptr = tensormap_a_smem_ptr + bytes_per_tensormap // 8
    tensormap_sfa_smem_ptr = tensormap_b_smem_ptr + bytes_per_tensormap // 8
    tensormap_sfb_smem_ptr = tensormap_sfa_smem_ptr + bytes_per_tensormap // 8

    #
    # Destination of the descriptors in global memory
    #
    tensormap_manager = utils.TensorMapManager(utils.TensorMapUpdateMode.SMEM, 128)
    (
        tensormap_a_gmem_ptr,
        tensormap_b_gmem_ptr,
        tensormap_sfa_gmem_ptr,
        tensormap_sfb_gmem_ptr,
    ) = group_tensormap_gmem_ptrs(tensormap_manager, tensormaps, group_idx)

    #
    # The group's real tensors
    #
    mA_mkl_iter = cute.make_ptr(
        ab_dtype, tensor_of_ptrs[group_idx, PTR_A], cute.AddressSpace.gmem
    ).align(32)
    mB_nkl_iter = cute.make_ptr(
        ab_dtype, tensor_of_ptrs[group_idx, PTR_B], cute.AddressSpace.gmem
    ).align(32)
    sfa_mkl_iter = cute.make_ptr(
        sf_dtype, tensor_of_ptrs[group_idx, PTR_SFA], cute.AddressSpace.gmem
    ).align(32)
    sfb_nkl_iter = cute.make_ptr(
        sf_dtype, tensor_of_ptrs[group_idx, PTR_SFB], cute.AddressSpace.gmem
    ).align(32)
    # (M, K, L) and (N, K, L), K-major, in fp4 elements
    mA_mkl_layout = cute.make_layout(
        (m, k, l),
        stride=(cute.assume(k, 32), 1, cute.assume(m * k, 32)),
    )
    mB_nkl_layout = cute.make_layout(
        (n, k, l),
        stride=(cute.assume(k, 32), 1, cute.assume(n * k, 32)),
    )

    # Scale factors layout (cuBLAS block-scaling-factors layout):
    # https://docs.nvidia.com/cuda/cublas/index.html?highlight=fp4#d-block-scaling-factors-layout
    atom_shape = ((32, 4), (sf_vec_size, 4))
    atom_stride = ((16, 4), (0, 1))
    sfa_layout = cute.tile_to_shape(
        cute.make_layout(atom_shape, stride=atom_stride),
        mA_mkl_layout.shape,
        (2, 1, 3),
    )
    sfb_layout = cute.tile_to_shape(
        cute.make_layout(atom_shape, stride=atom_stride),
        mB_nkl_layout.shape,
        (2, 1, 3),
    )
    real_tensor_a = cute.make_tensor(mA_mkl_iter, mA_mkl_layout)
    real_tensor_b = cute.make_tensor(mB_nkl_iter, mB_nkl_layout)
    real_tensor_sfa = cute.make_tensor(sfa_mkl_iter, sfa_layout)
    real_tensor_sfb = cute.make_tensor(sfb_nkl_iter, sfb_layout)

    #
    # Warp 0 builds the descriptors in smem and publishes them to global memory
    #
    if warp_idx == 0:
        tensormap_manager.init_tensormap_from_atom(tma_atom_a, tensormap_a_smem_ptr, 0)
        tensormap_manager.init_tensormap_from_atom(tma_atom_b, tensormap_b_smem_ptr, 0)
        tensormap_manager.init_tensormap_from_atom(tma_atom_sfa, tensormap_sfa_smem_ptr, 0)
        tensormap_manager.init_tensormap_from_atom(tma_atom_sfb, tensormap_sfb_smem_ptr, 0)

        tensormap_manager.update_tensormap(
            (real_tensor_a, real_tensor_b, real_tensor_sfa, real_tensor_sfb),
            (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb),
            (
                tensormap_a_gmem_ptr,
                tensormap_b_gmem_ptr,
                tensormap_sfa_gmem_ptr,
                tensormap_sfb_gmem_ptr,
            ),
            0,  # tma warp id
            (
                tensormap_a_smem_ptr,
                tensormap_b_smem_ptr,
                tensormap_sfa_smem_ptr,
                tensormap_sfb_smem_ptr,
            ),
        )
        # No acquire here: it would order only this thread's own later accesses. The
        # release above publishes the descriptors; the GEMM's TMA warp acquires them.

    cute.arch.barrier()


# =============================================================================
# Device code: block-scaled GEMM, one CTA per output tile
# =============================================================================
@cute.kernel
def gemm_kernel(
    tiled_mma: cute.TiledMma,
    tma_atom_a: cute.CopyAtom,
    mA_mkl: cute.Tensor,  # coordinate proxy; the real tensor is in the descriptor
    tma_atom_b: cute.CopyAtom,
    mB_nkl: cute.Tensor,
    tma_atom_sfa: cute.CopyAtom,
    mSFA_mkl: cute.Tensor,
    tma_atom_sfb: cute.CopyAtom,
    mSFB_nkl: cute.Tensor,
    tensor_of_ptrs: cute.Tensor,  # [G, 5] int64: a, b, c, sfa, sfb
    tensormaps: cute.Tensor,  # [G, 4, 16] int64, written by init_tensormaps_kernel
    tensor_of_problem_sizes: cute.Tensor,  # [G, 4] int32
    tensor_of_tiles: cute.Tensor,  # [T, 3] int32: (group, tile_m, tile_n)
    a_smem_layout_staged: cute.ComposedLayout,
    b_smem_layout_staged: cute.ComposedLayout,
    sfa_smem_layout_staged: cute.Layout,
    sfb_smem_layout_staged: cute.Layout,
    num_tma_load_bytes: cutlass.Constexpr[int],
):
    """Compute one 128x128 tile of C for the (group, tile_m, tile_n) of this CTA."""
    warp_idx = cute.arch.warp_idx()
    warp_idx = cute.arch.make_warp_uniform(warp_idx)
    tidx, _, _ = cute.arch.thread_idx()

    #
    # Shared storage
    #
    @cute.struct
    class SharedStorage:
        ab_mbar_ptr: cute.struct.MemRange[cutlass.Int64, num_ab_stage * 2]
        acc_mbar_ptr: cute.struct.MemRange[cutlass.Int64, num_acc_stage * 2]
        tmem_holding_buf: cutlass.Int32

    smem = utils.SmemAllocator()
    storage = smem.allocate(SharedStorage)

    # (MMA, MMA_M, MMA_K, STAGE)
    sA = smem.allocate_tensor(
        element_type=ab_dtype,
        layout=a_smem_layout_staged.outer,
        byte_alignment=128,
        swizzle=a_smem_layout_staged.inner,
    )
    # (MMA, MMA_N, MMA_K, STAGE)
    sB = smem.allocate_tensor(
        element_type=ab_dtype,
        layout=b_smem_layout_staged.outer,
        byte_alignment=128,
        swizzle=b_smem_layout_staged.inner,
    )
    # (MMA, MMA_M, MMA_K, STAGE)
    sSFA = smem.allocate_tensor(
        element_type=sf_dtype,
        layout=sfa_smem_layout_staged,
        byte_alignment=128,
    )
    # (MMA, MMA_N, MMA_K, STAGE)
    sSFB = smem.allocate_tensor(
        element_type=sf_dtype,
        layout=sfb_smem_layout_staged,
        byte_alignment=128,
    )

    #
    # Pipelines: TMA -> UMMA (A/B/SF stages), UMMA -> epilogue (accumulator)
    #
    ab_pipeline_producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
    ab_pipeline_consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
    ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
        barrier_storage=storage.ab_mbar_ptr.data_ptr(),
        num_stages=num_ab_stage,
        producer_group=ab_pipeline_producer_group,
        consumer_group=ab_pipeline_consumer_group,
        tx_count=num_tma_load_bytes,
    ).make_participants()
    acc_producer, acc_consumer = pipeline.PipelineUmmaAsync.create(
        barrier_storage=storage.acc_mbar_ptr.data_ptr(),
        num_stages=num_acc_stage,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, threads_per_cta),
    ).make_participants()

    #
    # MMA fragments
    #
    # (MMA, MMA_M, MMA_K, STAGE)
    tCrA = tiled_mma.make_fragment_A(sA)
    # (MMA, MMA_N, MMA_K, STAGE)
    tCrB = tiled_mma.make_fragment_B(sB)
    # (MMA, MMA_M, MMA_N)
    acc_shape = tiled_mma.partition_shape_C(mma_tiler_mnk[:2])
    tCtAcc_fake = tiled_mma.make_fragment_C(acc_shape)

    #
    # Allocate TMEM
    #
    tmem_alloc_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=threads_per_cta)
    tmem = utils.TmemAllocator(storage.tmem_holding_buf, barrier_for_retrieve=tmem_alloc_barrier)
    tmem.allocate(num_tmem_alloc_cols)
    tmem.wait_for_alloc()

    acc_tmem_ptr = tmem.retrieve_ptr(cutlass.Float32)
    # (MMA, MMA_M, MMA_N)
    tCtAcc = cute.make_tensor(acc_tmem_ptr, tCtAcc_fake.layout)

    #
    # SFA/SFB TMEM tensors, placed after the accumulator columns
    #
    sfa_tmem_ptr = cute.recast_ptr(
        acc_tmem_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc),
        dtype=sf_dtype,
    )
    # (MMA, MMA_M, MMA_K)
    tCtSFA_layout = blockscaled_utils.make_tmem_layout_sfa(
        tiled_mma,
        mma_tiler_mnk,
        sf_vec_size,
        cute.slice_(sfa_smem_layout_staged, (None, None, None, 0)),
    )
    tCtSFA = cute.make_tensor(sfa_tmem_ptr, tCtSFA_layout)
    sfb_tmem_ptr = cute.recast_ptr(
        acc_tmem_ptr
        + tcgen05.find_tmem_tensor_col_offset(tCtAcc)
        + tcgen05.find_tmem_tensor_col_offset(tCtSFA),
        dtype=sf_dtype,
    )
    # (MMA, MMA_N, MMA_K)
    tCtSFB_layout = blockscaled_utils.make_tmem_layout_sfb(
        tiled_mma,
        mma_tiler_mnk,
        sf_vec_size,
        cute.slice_(sfb_smem_layout_staged, (None, None, None, 0)),
    )
    tCtSFB = cute.make_tensor(sfb_tmem_ptr, tCtSFB_layout)

    #
    # S2T copy for SFs (smem -> TMEM)
    #
    copy_atom_s2t = cute.make_copy_atom(
        tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE),
        sf_dtype,
    )
    # (MMA, MMA_MN, MMA_K, STAGE)
    tCsSFA_compact = cute.filter_zeros(sSFA)
    # (MMA, MMA_MN, MMA_K)
    tCtSFA_compact = cute.filter_zeros(tCtSFA)
    tiled_copy_s2t_sfa = tcgen05.make_s2t_copy(copy_atom_s2t, tCtSFA_compact)
    thr_copy_s2t_sfa = tiled_copy_s2t_sfa.get_slice(0)
    # ((ATOM_V, REST_V), Rest_Tiler, MMA_MN, MMA_K, STAGE)
    tCsSFA_compact_s2t_ = thr_copy_s2t_sfa.partition_S(tCsSFA_compact)
    tCsSFA_compact_s2t = tcgen05.get_s2t_smem_desc_tensor(
        tiled_copy_s2t_sfa, tCsSFA_compact_s2t_
    )
    # ((ATOM_V, REST_V), Rest_Tiler, MMA_MN, MMA_K)
    tCtSFA_compact_s2t = thr_copy_s2t_sfa.partition_D(tCtSFA_compact)

    tCsSFB_compact = cute.filter_zeros(sSFB)
    tCtSFB_compact = cute.filter_zeros(tCtSFB)
    tiled_copy_s2t_sfb = tcgen05.make_s2t_copy(copy_atom_s2t, tCtSFB_compact)
    thr_copy_s2t_sfb = tiled_copy_s2t_sfb.get_slice(0)
    tCsSFB_compact_s2t_ = thr_copy_s2t_sfb.partition_S(tCsSFB_compact)
    tCsSFB_compact_s2t = tcgen05.get_s2t_smem_desc_tensor(
        tiled_copy_s2t_sfb, tCsSFB_compact_s2t_
    )
    tCtSFB_compact_s2t = thr_copy_s2t_sfb.partition_D(tCtSFB_compact)

    #
    # Chained calls (SM100_CHAIN_CALLS): everything above touches only this CTA's shared
    # memory, barriers and TMEM, so it overlaps the previous kernel. Once this CTA holds its
    # TMEM, the next call's grid may launch: a dependent CTA can sit beside this one (this
    # kernel fits two CTAs per SM) and allocates TMEM before its wait, so a trigger before
    # this CTA's allocation could let it take the 512 columns this CTA still waits for, then
    # wait for this grid to finish: a deadlock. The trigger takes effect once every CTA of
    # the grid has issued it (or exited): with the last wave resident and holding its TMEM.
    #
    launch_dependents()
    # Every global access follows the wait, by every thread: the tile table, the sizes and
    # pointers, the descriptors (warp 0's acquire), A/B/scales (TMA) and C (all warps' stores;
    # a caller may hand the same c to consecutive calls).
    wait_for_previous_grid()

    #
    # This CTA's tile, from the tile table
    #
    bidx, _, _ = cute.arch.block_idx()
    group_idx = tensor_of_tiles[bidx, 0]
    coord_x = tensor_of_tiles[bidx, 1]
    coord_y = tensor_of_tiles[bidx, 2]

    m = tensor_of_problem_sizes[group_idx, 0]
    n = tensor_of_problem_sizes[group_idx, 1]
    k = tensor_of_problem_sizes[group_idx, 2]

    #
    # C of this group, (M, N, L) row-major
    #
    mC_mnl_iter = cute.make_ptr(
        c_dtype, tensor_of_ptrs[group_idx, PTR_C], cute.AddressSpace.gmem
    ).align(32)
    # No divisibility promise on the row stride here: validate_inputs accepts any N >= 1. The
    # full-tile store below states it only where N keeps it.
    mC_mnl_layout = cute.make_layout((m, n, 1), stride=(n, 1, m * n))
    mC_mnl = cute.make_tensor(mC_mnl_iter, mC_mnl_layout)
    # (bM, bN)
    gC_mnl = cute.local_tile(
        mC_mnl, cute.slice_(mma_tiler_mnk, (None, None, 0)), (coord_x, coord_y, 0)
    )

    #
    # Proxy tiles
    #
    # (bM, bK, RestM, RestK, RestL)
    gA_mkl = cute.local_tile(
        mA_mkl, cute.slice_(mma_tiler_mnk, (None, 0, None)), (None, None, None)
    )
    # (bN, bK, RestN, RestK, RestL)
    gB_nkl = cute.local_tile(
        mB_nkl, cute.slice_(mma_tiler_mnk, (0, None, None)), (None, None, None)
    )
    # (bM, bK, RestM, RestK, RestL)
    gSFA_mkl = cute.local_tile(
        mSFA_mkl, cute.slice_(mma_tiler_mnk, (None, 0, None)), (None, None, None)
    )
    # (bN, bK, RestN, RestK, RestL)
    gSFB_nkl = cute.local_tile(
        mSFB_nkl, cute.slice_(mma_tiler_mnk, (0, None, None)), (None, None, None)
    )
    thr_mma = tiled_mma.get_slice(tidx)
    # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
    tCgA = thr_mma.partition_A(gA_mkl)
    # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
    tCgB = thr_mma.partition_B(gB_nkl)
    # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
    tCgSFA = thr_mma.partition_A(gSFA_mkl)
    # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
    tCgSFB = thr_mma.partition_B(gSFB_nkl)
    # (MMA, MMA_M, MMA_N)
    tCgC = thr_mma.partition_C(gC_mnl)

    #
    # Prebuilt descriptors of this group
    #
    tensormap_manager = utils.TensorMapManager(utils.TensorMapUpdateMode.SMEM, 128)
    (
        tensormap_a_gmem_ptr,
        tensormap_b_gmem_ptr,
        tensormap_sfa_gmem_ptr,
        tensormap_sfb_gmem_ptr,
    ) = group_tensormap_gmem_ptrs(tensormap_manager, tensormaps, group_idx)
    tma_desc_a = tensormap_manager.get_tensormap_ptr(
        tensormap_a_gmem_ptr, cute.AddressSpace.generic
    )
    tma_desc_b = tensormap_manager.get_tensormap_ptr(
        tensormap_b_gmem_ptr, cute.AddressSpace.generic
    )
    tma_desc_sfa = tensormap_manager.get_tensormap_ptr(
        tensormap_sfa_gmem_ptr, cute.AddressSpace.generic
    )
    tma_desc_sfb = tensormap_manager.get_tensormap_ptr(
        tensormap_sfb_gmem_ptr, cute.AddressSpace.generic
    )

    #
    # TMA partitions
    #
    # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestM, RestK, RestL)
    tAsA, tAgA = cpasync.tma_partition(
        tma_atom_a,
        0,
        cute.make_layout(1),
        cute.group_modes(sA, 0, 3),
        cute.group_modes(tCgA, 0, 3),
    )
    # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestN, RestK, RestL)
    tBsB, tBgB = cpasync.tma_partition(
        tma_atom_b,
        0,
        cute.make_layout(1),
        cute.group_modes(sB, 0, 3),
        cute.group_modes(tCgB, 0, 3),
    )
    # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestM, RestK, RestL)
    tAsSFA, tAgSFA = cpasync.tma_partition(
        tma_atom_sfa,
        0,
        cute.make_layout(1),
        cute.group_modes(sSFA, 0, 3),
        cute.group_modes(tCgSFA, 0, 3),
    )
    tAsSFA = cute.filter_zeros(tAsSFA)
    tAgSFA = cute.filter_zeros(tAgSFA)
    # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestN, RestK, RestL)
    tBsSFB, tBgSFB = cpasync.tma_partition(
        tma_atom_sfb,
        0,
        cute.make_layout(1),
        cute.group_modes(sSFB, 0, 3),
        cute.group_modes(tCgSFB, 0, 3),
    )
    tBsSFB = cute.filter_zeros(tBsSFB)
    tBgSFB = cute.filter_zeros(tBgSFB)

    # K tiles. validate_inputs guarantees K % 256 == 0, so this division is exact (the seed
    # truncated K silently here).
    k_tile_cnt = k // cutlass.Int32(mma_tiler_mnk[2])

    # Fix tile coords so that later we index only by k_tile
    # ((atom_v, rest_v), RestK)
    tAgA = tAgA[(None, coord_x, None, 0)]
    tBgB = tBgB[(None, coord_y, None, 0)]
    tAgSFA = tAgSFA[(None, coord_x, None, 0)]
    tBgSFB = tBgSFB[(None, coord_y, None, 0)]

    #
    # Mainloop (warp 0): num_ab_stage-deep TMA prefetch, SF smem -> TMEM, block-scaled UMMA
    #
    if warp_idx == 0:
        # Descriptors written by the init kernel: acquired and fetched before the first copy
        for tma_desc in (tma_desc_a, tma_desc_b, tma_desc_sfa, tma_desc_sfb):
            acquire_tensormap(tma_desc)
        acc_empty = acc_producer.acquire_and_advance()
        tiled_mma.set(tcgen05.Field.ACCUMULATE, False)

        # Prologue: issue the first num_ab_stage K tiles
        for pre_k in range(num_ab_stage):
            if pre_k < k_tile_cnt:
                ab_empty = ab_producer.acquire_and_advance()
                stage = ab_empty.index
                cute.copy(tma_atom_a, tAgA[(None, pre_k)], tAsA[(None, stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_a)
                cute.copy(tma_atom_b, tBgB[(None, pre_k)], tBsB[(None, stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_b)
                cute.copy(tma_atom_sfa, tAgSFA[(None, pre_k)], tAsSFA[(None, stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_sfa)
                cute.copy(tma_atom_sfb, tBgSFB[(None, pre_k)], tBsSFB[(None, stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_sfb)

        # Steady state
        for k_tile in range(k_tile_cnt):
            ab_full = ab_consumer.wait_and_advance()
            stage = ab_full.index

            # SFs of this stage: smem -> TMEM
            s2t_stage_coord = (None, None, None, None, stage)
            cute.copy(tiled_copy_s2t_sfa, tCsSFA_compact_s2t[s2t_stage_coord], tCtSFA_compact_s2t)
            cute.copy(tiled_copy_s2t_sfb, tCsSFB_compact_s2t[s2t_stage_coord], tCtSFB_compact_s2t)

            # tCtAcc += tCrA * tCtSFA * tCrB * tCtSFB
            num_kblocks = cute.size(tCrA, mode=[2])
            for kblock_idx in cutlass.range(num_kblocks, unroll_full=True):
                kblock_coord = (None, None, kblock_idx, stage)
                sf_kblock_coord = (None, None, kblock_idx)

                tiled_mma.set(tcgen05.Field.SFA, tCtSFA[sf_kblock_coord].iterator)
                tiled_mma.set(tcgen05.Field.SFB, tCtSFB[sf_kblock_coord].iterator)

                cute.gemm(
                    tiled_mma,
                    tCtAcc,
                    tCrA[kblock_coord],
                    tCrB[kblock_coord],
                    tCtAcc,
                )
                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)

            ab_full.release()

            # Refill: issue K tile (k_tile + num_ab_stage)
            next_k = k_tile + cutlass.Int32(num_ab_stage)
            if next_k < k_tile_cnt:
                ab_empty = ab_producer.acquire_and_advance()
                refill_stage = ab_empty.index
                cute.copy(tma_atom_a, tAgA[(None, next_k)], tAsA[(None, refill_stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_a)
                cute.copy(tma_atom_b, tBgB[(None, next_k)], tBsB[(None, refill_stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_b)
                cute.copy(tma_atom_sfa, tAgSFA[(None, next_k)], tAsSFA[(None, refill_stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_sfa)
                cute.copy(tma_atom_sfb, tBgSFB[(None, next_k)], tBsSFB[(None, refill_stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_sfb)

        acc_empty.commit()

    #
    # Epilogue (all warps): TMEM -> registers -> global, predicated on the M/N residues
    #
    op = tcgen05.Ld32x32bOp(tcgen05.Repetition.x128, tcgen05.Pack.NONE)
    copy_atom_t2r = cute.make_copy_atom(op, cutlass.Float32)
    tiled_copy_t2r = tcgen05.make_tmem_copy(copy_atom_t2r, tCtAcc[None, 0, 0])
    thr_copy_t2r = tiled_copy_t2r.get_slice(tidx)

    # (TmemCpy, NumTmemCpy)
    tDtAcc = thr_copy_t2r.partition_S(tCtAcc[None, 0, 0])
    # (TmemCpy, NumTmemCpy)
    tDgC = thr_copy_t2r.partition_D(tCgC[None, 0, 0])

    tDrAcc = cute.make_rmem_tensor(tDgC.shape, cutlass.Float32)
    tDrC = cute.make_rmem_tensor(tDgC.shape, c_dtype)

    tmem.relinquish_alloc_permit()
    acc_full = acc_consumer.wait_and_advance()

    cute.copy(tiled_copy_t2r, tDtAcc, tDrAcc)
    tDrC.store(tDrAcc.load().to(c_dtype))

    simt_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), c_dtype, num_bits_per_copy=16)
    thread_layout = cute.make_layout((1, threads_per_cta), stride=(threads_per_cta, 1))
    value_layout = cute.make_layout((1, 1))
    tiled_copy_r2g = cute.make_tiled_copy_tv(simt_atom, thread_layout, value_layout)
    thr_copy_r2g = tiled_copy_r2g.get_slice(tidx)
    cC = cute.make_identity_tensor(gC_mnl.shape)
    # ((atom_v, rest_v), NumGmemCpy)
    tDcC = thr_copy_r2g.partition_D(cC)

    # The same C tile with its rows stated to start on 32-byte boundaries: each thread's 128
    # contiguous fp16 then go out as 256-bit stores (the seed's STG.E.ENL2.256). Used only
    # where N % C_VECTOR_ELEMS == 0 makes the statement true.
    mC_aligned = cute.make_tensor(
        mC_mnl_iter,
        cute.make_layout(
            (m, n, 1), stride=(cute.assume(n, C_VECTOR_ELEMS), 1, cute.assume(m * n, C_VECTOR_ELEMS))
        ),
    )
    gC_aligned = cute.local_tile(
        mC_aligned, cute.slice_(mma_tiler_mnk, (None, None, 0)), (coord_x, coord_y, 0)
    )
    tDgC_aligned = thr_copy_t2r.partition_D(thr_mma.partition_C(gC_aligned)[None, 0, 0])

    residue_m = mC_mnl.shape[0] - cutlass.Int32(coord_x) * cutlass.Int32(mma_tiler_mnk[0])
    residue_n = mC_mnl.shape[1] - cutlass.Int32(coord_y) * cutlass.Int32(mma_tiler_mnk[1])

    # Full tiles (most of them) store without predicates
    if residue_m >= cutlass.Int32(mma_tiler_mnk[0]) and residue_n >= cutlass.Int32(mma_tiler_mnk[1]):
        if n % C_VECTOR_ELEMS == 0:
            cute.copy(simt_atom, cute.flatten(tDrC), cute.flatten(tDgC_aligned))
        else:
            cute.copy(simt_atom, cute.flatten(tDrC), cute.flatten(tDgC))
    else:
        tDpC = cute.make_rmem_tensor(tDrC.shape, cutlass.Boolean)
        for i in range(cute.size(tDrC.shape)):
            # tDcC is (n, m) ordered: compare against (residue_n, residue_m)
            tDpC[i] = cute.elem_less(tDcC[i], (residue_n, residue_m))
        cute.copy(simt_atom, cute.flatten(tDrC), cute.flatten(tDgC), pred=cute.flatten(tDpC))

    acc_full.release()
    cute.arch.barrier()
    tmem.free(acc_tmem_ptr)


# =============================================================================
# Host code (JIT): TMA atoms, smem layouts, launches
# =============================================================================
def _make_mma_and_atoms():
    """Tiled MMA, staged smem layouts and TMA atoms shared by both JIT wrappers.

    The atoms are built from fake (64, 64) tensors at a null address: their shapes, strides
    and addresses are replaced by the per-group descriptors at run time.
    """
    min_shape = (cutlass.Int32(64), cutlass.Int32(64), cutlass.Int32(1))

    def fake_operand():
        return cute.make_tensor(
            cute.make_ptr(ab_dtype, 0, cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout(
                (min_shape[0], cute.assume(min_shape[1], 32), min_shape[2]),
                stride=(
                    cute.assume(min_shape[1], 32),
                    1,
                    cute.assume(min_shape[0] * min_shape[1], 32),
                ),
            ),
        )

    initial_a = fake_operand()
    initial_b = fake_operand()
    # ((Atom_M, Rest_M), (Atom_K, Rest_K), RestL)
    sfa_layout = blockscaled_utils.tile_atom_to_shape_SF(initial_a.shape, sf_vec_size)
    sfb_layout = blockscaled_utils.tile_atom_to_shape_SF(initial_b.shape, sf_vec_size)
    initial_sfa = cute.make_tensor(
        cute.make_ptr(sf_dtype, 0, cute.AddressSpace.gmem, assumed_align=16), sfa_layout
    )
    initial_sfb = cute.make_tensor(
        cute.make_ptr(sf_dtype, 0, cute.AddressSpace.gmem, assumed_align=16), sfb_layout
    )

    mma_op = tcgen05.MmaMXF4NVF4Op(
        sf_dtype,
        (mma_tiler_mnk[0], mma_tiler_mnk[1], mma_inst_shape_k),
        tcgen05.CtaGroup.ONE,
        tcgen05.OperandSource.SMEM,
    )
    tiled_mma = cute.make_tiled_mma(mma_op)
    cluster_layout_vmnk = cute.tiled_divide(
        cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,)
    )

    a_smem_layout_staged = sm100_utils.make_smem_layout_a(
        tiled_mma, mma_tiler_mnk, ab_dtype, num_ab_stage
    )
    b_smem_layout_staged = sm100_utils.make_smem_layout_b(
        tiled_mma, mma_tiler_mnk, ab_dtype, num_ab_stage
    )
    sfa_smem_layout_staged = blockscaled_utils.make_smem_layout_sfa(
        tiled_mma, mma_tiler_mnk, sf_vec_size, num_ab_stage
    )
    sfb_smem_layout_staged = blockscaled_utils.make_smem_layout_sfb(
        tiled_mma, mma_tiler_mnk, sf_vec_size, num_ab_stage
    )
    a_smem_layout = cute.slice_(a_smem_layout_staged, (None, None, None, 0))
    b_smem_layout = cute.slice_(b_smem_layout_staged, (None, None, None, 0))
    sfa_smem_layout = cute.slice_(sfa_smem_layout_staged, (None, None, None, 0))
    sfb_smem_layout = cute.slice_(sfb_smem_layout_staged, (None, None, None, 0))

    tma_atom_a, tma_tensor_a = cute.nvgpu.make_tiled_tma_atom_A(
        cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE),
        initial_a, a_smem_layout,
        mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape,
    )
    tma_atom_b, tma_tensor_b = cute.nvgpu.make_tiled_tma_atom_B(
        cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE),
        initial_b, b_smem_layout,
        mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape,
    )
    tma_atom_sfa, tma_tensor_sfa = cute.nvgpu.make_tiled_tma_atom_A(
        cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE),
        initial_sfa, sfa_smem_layout,
        mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape,
        internal_type=cutlass.Int16,
    )
    tma_atom_sfb, tma_tensor_sfb = cute.nvgpu.make_tiled_tma_atom_B(
        cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE),
        initial_sfb, sfb_smem_layout,
        mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape,
        internal_type=cutlass.Int16,
    )

    atom_thr_size = cute.size(tiled_mma.thr_id.shape)
    num_tma_load_bytes = (
        cute.size_in_bytes(ab_dtype, a_smem_layout)
        + cute.size_in_bytes(ab_dtype, b_smem_layout)
        + cute.size_in_bytes(sf_dtype, sfa_smem_layout)
        + cute.size_in_bytes(sf_dtype, sfb_smem_layout)
    ) * atom_thr_size

    return {
        "tiled_mma": tiled_mma,
        "atoms": (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb),
        "proxies": (tma_tensor_a, tma_tensor_b, tma_tensor_sfa, tma_tensor_sfb),
        "smem_layouts": (
            a_smem_layout_staged,
            b_smem_layout_staged,
            sfa_smem_layout_staged,
            sfb_smem_layout_staged,
        ),
        "num_tma_load_bytes": num_tma_load_bytes,
    }


def tensormap_table(ptr_of_tensormaps, num_groups, num_slots):
    """[G, num_slots, 16] int64: the 128-byte TMA descriptors of every group."""
    return cute.make_tensor(
        ptr_of_tensormaps,
        cute.make_layout((num_groups, num_slots, 16), stride=(num_slots * 16, 16, 1)),
    )


def tensors_of_group(ptr_of_ptrs, ptr_of_sizes, num_groups):
    tensor_of_ptrs = cute.make_tensor(
        ptr_of_ptrs, cute.make_layout((num_groups, NUM_PTR_COLS), stride=(NUM_PTR_COLS, 1))
    )
    tensor_of_problem_sizes = cute.make_tensor(
        ptr_of_sizes, cute.make_layout((num_groups, 4), stride=(4, 1))
    )
    return tensor_of_ptrs, tensor_of_problem_sizes


def per_tile_init_launch(ptr_of_ptrs, ptr_of_sizes, ptr_of_tensormaps, num_groups):
    """The per-tile kernel's descriptor init, traced inside a @cute.jit entry: (the kernel to
    launch, its launch geometry). The entry below launches it as the harness calls; the
    library's entries reuse it and add where the launch goes."""
    tensor_of_ptrs, tensor_of_problem_sizes = tensors_of_group(ptr_of_ptrs, ptr_of_sizes, num_groups)
    tensormaps = cute.make_tensor(
        ptr_of_tensormaps,
        cute.make_layout((num_groups, num_tensormaps, 16), stride=(num_tensormaps * 16, 16, 1)),
    )
    setup = _make_mma_and_atoms()
    kernel = init_tensormaps_kernel(
        *setup["atoms"],
        tensor_of_ptrs,
        tensor_of_problem_sizes,
        tensormaps,
    )
    return kernel, {"grid": (1, 1, num_groups), "block": [threads_per_cta, 1, 1], "cluster": (1, 1, 1),
                    **chained_launch()}


@cute.jit
def init_tensormaps_jit(
    ptr_of_ptrs: cute.Pointer,
    ptr_of_sizes: cute.Pointer,
    ptr_of_tensormaps: cute.Pointer,
    num_groups: cutlass.Int32,
):
    kernel, geometry = per_tile_init_launch(ptr_of_ptrs, ptr_of_sizes, ptr_of_tensormaps, num_groups)
    kernel.launch(**geometry)


def per_tile_gemm_launch(ptr_of_ptrs, ptr_of_sizes, ptr_of_tiles, ptr_of_tensormaps, num_tiles, num_groups):
    """The per-tile GEMM, traced inside a @cute.jit entry: (the kernel to launch, its launch
    geometry), as per_tile_init_launch."""
    tensor_of_ptrs, tensor_of_problem_sizes = tensors_of_group(ptr_of_ptrs, ptr_of_sizes, num_groups)
    tensormaps = cute.make_tensor(
        ptr_of_tensormaps,
        cute.make_layout((num_groups, num_tensormaps, 16), stride=(num_tensormaps * 16, 16, 1)),
    )
    tensor_of_tiles = cute.make_tensor(
        ptr_of_tiles, cute.make_layout((num_tiles, 3), stride=(3, 1))
    )
    setup = _make_mma_and_atoms()
    tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb = setup["atoms"]
    tma_tensor_a, tma_tensor_b, tma_tensor_sfa, tma_tensor_sfb = setup["proxies"]
    kernel = gemm_kernel(
        setup["tiled_mma"],
        tma_atom_a, tma_tensor_a,
        tma_atom_b, tma_tensor_b,
        tma_atom_sfa, tma_tensor_sfa,
        tma_atom_sfb, tma_tensor_sfb,
        tensor_of_ptrs,
        tensormaps,
        tensor_of_problem_sizes,
        tensor_of_tiles,
        *setup["smem_layouts"],
        setup["num_tma_load_bytes"],
    )
    # Deviation from the seed: tiles run along grid x (up to 2^31 - 1 CTAs) instead of grid z
    # (at most 65535), so no tile count the tables allow can overflow the grid.
    return kernel, {"grid": (num_tiles, 1, 1), "block": [threads_per_cta, 1, 1], "cluster": (1, 1, 1),
                    **chained_launch()}


@cute.jit
def gemm_jit(
    ptr_of_ptrs: cute.Pointer,
    ptr_of_sizes: cute.Pointer,
    ptr_of_tiles: cute.Pointer,
    ptr_of_tensormaps: cute.Pointer,
    num_tiles: cutlass.Int32,
    num_groups: cutlass.Int32,
):
    kernel, geometry = per_tile_gemm_launch(
        ptr_of_ptrs, ptr_of_sizes, ptr_of_tiles, ptr_of_tensormaps, num_tiles, num_groups
    )
    kernel.launch(**geometry)
