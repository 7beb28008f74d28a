"""NVFP4 block-scaled grouped GEMM for GPU MODE's ``nvfp4_group_gemm`` (NVIDIA B200, sm_100a).

For every group ``i`` this computes, in one launch for all groups,

    C_i[M_i, N_i] = (A_i * SFA_i) @ (B_i * SFB_i)^T        (fp32 accumulate, fp16 output)

where A_i / B_i hold packed float4 e2m1 values (two per byte, low nibble first) and SFA_i /
SFB_i hold one float8 e4m3 scale per 16 consecutive K elements, read from the "reordered"
scale tensors (cuBLAS 32x4x4 blocked layout).

Input (``task.input_t``): ``(abc, sfasfb, sfasfb_reordered, problem_sizes)`` with
``abc[i] = (a [M,K/2,1], b [N,K/2,1], c [M,N,1])``, ``sfasfb_reordered[i] =
(sfa [32,4,ceil(M/128),4,ceil(K/64),1], sfb [32,4,ceil(N/128),4,ceil(K/64),1])`` and
``problem_sizes[i] = (M, N, K, L)``. The kernel writes every ``c`` and returns them as a list.

Constraints (checked by ``validate_inputs`` before any launch; outputs stay untouched on error):
  * 1 <= G <= 64 groups
  * L == 1, K a positive multiple of 256 (the K tile), N >= 1, M >= 0 (M = 0 groups are skipped)
  * a/b: torch.float4_e2m1fn_x2, c: torch.float16, reordered scales: torch.float8_e4m3fn
  * a, b, c row-major with unit stride along K (a, b) or N (c); reordered scales with the
    official strides (a permuted view of a contiguous tensor); base addresses 32-byte aligned
  * every tensor on the same CUDA device

Kernel design (sm_100a):
  * ``init_tensormaps_kernel``: one CTA per group writes the TMA descriptors of A, B, SFA, SFB
    of its group into a device buffer. It runs once per input set (pointers + sizes).
  * ``gemm_kernel``: one CTA per 128x128 output tile; a tile table maps each CTA to
    (group, tile_m, tile_n). Warp 0 drives TMA loads through the prebuilt descriptors and the
    block-scaled ``tcgen05`` MMA (``MmaMXF4NVF4Op``, 128x128x64 instructions, 256-deep K tile,
    2-stage smem pipeline, fp32 accumulator in TMEM); all 4 warps run the epilogue
    TMEM -> registers -> global, predicated on the M and N residues.
  * Host side: validated inputs become ``GroupTables`` (pointers, sizes, tiles) kept, together
    with descriptors and prepared launch arguments, in a bounded LRU keyed on every data
    pointer (a hit also compares the problem sizes); a cache hit is one kernel launch.
  * On Hopper (sm_90) the same host runtime drives the backend from ``nvfp4_hopper.py``.

Status: compiled for sm_100a (``python eval.py compile``); not run here (no B200 available).

Run: ``python eval.py test tests/cases/...`` (harness) or ``python eval.py compile`` (any
machine, no GPU: builds every kernel for its target and prints its resources).
"""

import collections
import contextlib
import dataclasses
import itertools
import operator
import os
import struct
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
import torch
from cutlass import cute, pipeline, utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cute.runtime import make_ptr

from task import input_t, output_t


# =============================================================================
# Configuration
# =============================================================================
@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Python-time configuration of the sm_100a kernels (everything here is baked into the code)."""

    # NVFP4 UMMA requires M-mode 128 for a single CTA (cta_group::1)
    mma_tiler_mnk: tuple[int, int, int] = (128, 128, 256)
    # K of one tcgen05.mma.kind::mxf4nvf4 instruction
    mma_inst_shape_k: int = 64
    # One float8 scale per 16 fp4 values along K
    sf_vec_size: int = 16
    threads_per_cta: int = 128
    num_acc_stage: int = 1
    # Two smem stages: 2 x 36 KiB (A 16 KiB + B 16 KiB + SFA 2 KiB + SFB 2 KiB). More stages
    # are a later change together with a smaller TMEM/SMEM footprint.
    num_ab_stage: int = 2
    # Must be a power of two, a multiple of 32 and <= 512
    num_tmem_alloc_cols: int = 512
    # TMA descriptors: A, B, SFA, SFB, 128 bytes each
    num_tensormaps: int = 4
    bytes_per_tensormap: int = 128
    arch: str = "sm_100a"


SM100_CONFIG = GemmConfig()

ab_dtype = cutlass.Float4E2M1FN
sf_dtype = cutlass.Float8E4M3FN
c_dtype = cutlass.Float16

# Kernel-side aliases of the configuration (the kernels below read these at trace time)
mma_tiler_mnk = SM100_CONFIG.mma_tiler_mnk
mma_inst_shape_k = SM100_CONFIG.mma_inst_shape_k
sf_vec_size = SM100_CONFIG.sf_vec_size
threads_per_cta = SM100_CONFIG.threads_per_cta
num_acc_stage = SM100_CONFIG.num_acc_stage
num_ab_stage = SM100_CONFIG.num_ab_stage
num_tmem_alloc_cols = SM100_CONFIG.num_tmem_alloc_cols
num_tensormaps = SM100_CONFIG.num_tensormaps
bytes_per_tensormap = SM100_CONFIG.bytes_per_tensormap

# Columns of the per-group pointer table (GroupTables.ptrs)
PTR_A, PTR_B, PTR_C, PTR_SFA, PTR_SFB = range(5)
NUM_PTR_COLS = 5

MAX_GROUPS = 64
# Every tensor is addressed as `ptr.align(32)` in the kernels (TMA needs 16 B at least).
BASE_ALIGN_BYTES = 32
# Devices the submission has a backend for: capability -> backend name
SUPPORTED_GPUS = "NVIDIA B200/GB200 (sm_100, compute capability 10.x) and H100/H200 (sm_90, 9.0)"


def ceil_div(a, b):
    return (a + b - 1) // b


# =============================================================================
# Validation: every path calls this before any launch
# =============================================================================
_DTYPE_RULES = {
    "a": (torch.float4_e2m1fn_x2, "packed fp4 e2m1, two values per byte"),
    "b": (torch.float4_e2m1fn_x2, "packed fp4 e2m1, two values per byte"),
    "c": (torch.float16, "fp16 output"),
    "sfa_reordered": (torch.float8_e4m3fn, "one fp8 e4m3 scale per 16 K elements"),
    "sfb_reordered": (torch.float8_e4m3fn, "one fp8 e4m3 scale per 16 K elements"),
}


def _fail(group, field, value, rule, error=ValueError):
    prefix = "input" if group is None else f"group {group}"
    raise error(f"{prefix}: {field} = {value!r}; rule: {rule}")


def reordered_scale_shape(mn: int, k: int) -> tuple[int, ...]:
    """Shape of an official reordered scale tensor for L = 1: (32, 4, rest_mn, 4, rest_k, 1)."""
    return (32, 4, ceil_div(mn, 128), 4, ceil_div(k // sf_vec_size, 4), 1)


def reordered_scale_strides(mn: int, k: int) -> tuple[int, ...]:
    """Strides of the official reordered scale tensor: a (l, rest_mn, rest_k, 32, 4, 4)
    contiguous tensor permuted by (3, 4, 1, 5, 2, 0)."""
    rest_mn = ceil_div(mn, 128)
    rest_k = ceil_div(k // sf_vec_size, 4)
    return (16, 4, rest_k * 512, 1, 512, rest_mn * rest_k * 512)


def _check_layout(group, field, tensor, shape, strides, rule):
    if tuple(tensor.shape) != tuple(shape):
        _fail(group, f"{field}.shape", tuple(tensor.shape), f"expected {tuple(shape)} ({rule})")
    # Strides of size-1 modes never address memory: only modes with extent > 1 are checked
    for dim, (extent, got, want) in enumerate(zip(tensor.shape, tensor.stride(), strides)):
        if extent > 1 and got != want:
            _fail(
                group,
                f"{field}.stride()",
                tuple(tensor.stride()),
                f"mode {dim} must have stride {want} ({rule}); pass a tensor with the "
                "official layout (e.g. .contiguous() for a/b/c)",
            )
    if tensor.numel() > 0 and tensor.data_ptr() % BASE_ALIGN_BYTES != 0:
        _fail(
            group,
            f"{field}.data_ptr() % {BASE_ALIGN_BYTES}",
            tensor.data_ptr() % BASE_ALIGN_BYTES,
            f"base address must be {BASE_ALIGN_BYTES}-byte aligned (TMA / vector access)",
        )


def _check_problem_size(g, problem_size):
    if not isinstance(problem_size, (tuple, list)) or len(problem_size) != 4:
        _fail(g, "problem_sizes[g]", problem_size, "expected a 4-tuple (M, N, K, L)", TypeError)
    for name, value in zip("MNKL", problem_size):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            _fail(g, f"problem_sizes[g].{name}", value, "expected an integer", TypeError)
    m, n, k, l = (operator.index(v) for v in problem_size)
    if l != 1:
        _fail(g, "L", l, "L must be 1 (one batch per group)")
    if k <= 0 or k % mma_tiler_mnk[2] != 0:
        _fail(g, "K", k, f"K must be a positive multiple of {mma_tiler_mnk[2]} (the K tile)")
    if n <= 0:
        _fail(g, "N", n, "N must be >= 1")
    if m < 0:
        _fail(g, "M", m, "M must be >= 0")
    return (m, n, k, l)


def validate_inputs(data) -> tuple[tuple[int, int, int, int], ...]:
    """Check everything the kernels rely on; return the problem sizes as int 4-tuples.

    Raises ValueError / TypeError naming the group, the field, the value and the rule. Nothing
    is launched and no output is written before this returns.
    """
    if not isinstance(data, (tuple, list)) or len(data) != 4:
        _fail(
            None,
            "len(data)" if isinstance(data, (tuple, list)) else "type(data)",
            len(data) if isinstance(data, (tuple, list)) else type(data).__name__,
            "expected the 4-tuple (abc, sfasfb, sfasfb_reordered, problem_sizes)",
            TypeError,
        )
    abc, sfasfb, sfasfb_reordered, problem_sizes = data
    for name, value in (
        ("abc", abc),
        ("sfasfb", sfasfb),
        ("sfasfb_reordered", sfasfb_reordered),
        ("problem_sizes", problem_sizes),
    ):
        if not isinstance(value, (tuple, list)):
            _fail(None, f"type({name})", type(value).__name__, "expected a list", TypeError)
    num_groups = len(problem_sizes)
    if not 1 <= num_groups <= MAX_GROUPS:
        _fail(None, "len(problem_sizes)", num_groups, f"expected 1 <= G <= {MAX_GROUPS}")
    for name, value in (("abc", abc), ("sfasfb", sfasfb), ("sfasfb_reordered", sfasfb_reordered)):
        if len(value) != num_groups:
            _fail(None, f"len({name})", len(value), f"expected G = len(problem_sizes) = {num_groups}")

    # Order: problem sizes, then structure/dtypes/layouts of every group, devices last
    sizes = [_check_problem_size(g, problem_sizes[g]) for g in range(num_groups)]
    group_tensors = []
    for g, (m, n, k, _l) in enumerate(sizes):
        if not isinstance(abc[g], (tuple, list)) or len(abc[g]) != 3:
            _fail(g, "abc[g]", type(abc[g]).__name__, "expected a 3-tuple (a, b, c)", TypeError)
        if not isinstance(sfasfb[g], (tuple, list)) or len(sfasfb[g]) != 2:
            _fail(g, "sfasfb[g]", type(sfasfb[g]).__name__, "expected a 2-tuple (sfa, sfb)", TypeError)
        if not isinstance(sfasfb_reordered[g], (tuple, list)) or len(sfasfb_reordered[g]) != 2:
            _fail(
                g,
                "sfasfb_reordered[g]",
                type(sfasfb_reordered[g]).__name__,
                "expected a 2-tuple (sfa_reordered, sfb_reordered)",
                TypeError,
            )
        tensors = {
            "a": abc[g][0],
            "b": abc[g][1],
            "c": abc[g][2],
            "sfa_reordered": sfasfb_reordered[g][0],
            "sfb_reordered": sfasfb_reordered[g][1],
        }
        for field, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                _fail(g, f"type({field})", type(tensor).__name__, "expected a torch.Tensor", TypeError)
            want_dtype, why = _DTYPE_RULES[field]
            if tensor.dtype != want_dtype:
                _fail(g, f"{field}.dtype", tensor.dtype, f"expected {want_dtype} ({why})", TypeError)

        row_major = "row-major, unit stride along the last dimension"
        _check_layout(g, "a", tensors["a"], (m, k // 2, 1), (k // 2, 1, m * k // 2), row_major)
        _check_layout(g, "b", tensors["b"], (n, k // 2, 1), (k // 2, 1, n * k // 2), row_major)
        _check_layout(g, "c", tensors["c"], (m, n, 1), (n, 1, m * n), row_major)
        official = "official reordered scale layout (32, 4, rest, 4, rest_k, 1)"
        _check_layout(
            g, "sfa_reordered", tensors["sfa_reordered"],
            reordered_scale_shape(m, k), reordered_scale_strides(m, k), official,
        )
        _check_layout(
            g, "sfb_reordered", tensors["sfb_reordered"],
            reordered_scale_shape(n, k), reordered_scale_strides(n, k), official,
        )
        group_tensors.append(tensors)

    device = None
    for g, tensors in enumerate(group_tensors):
        for field, tensor in tensors.items():
            if tensor.device.type != "cuda":
                _fail(
                    g,
                    f"{field}.device",
                    str(tensor.device),
                    "every tensor must be on a CUDA device (the kernel reads device memory)",
                )
            if device is None:
                device = tensor.device
            elif tensor.device != device:
                _fail(g, f"{field}.device", str(tensor.device), f"expected {device} like group 0's a")
    return tuple(sizes)


# =============================================================================
# Device code: tensormap initialization (one CTA per group)
# =============================================================================
def group_tensormap_gmem_ptrs(tensormap_manager, tensormaps: cute.Tensor, group_idx):
    """Global-memory pointers of the A, B, SFA, SFB descriptors of `group_idx` in
    `tensormaps` [G, 4, 16] (written by the init kernel, read by the GEMM kernel)."""
    return tuple(
        tensormap_manager.get_tensormap_ptr(tensormaps[(group_idx, slot, None)].iterator)
        for slot in range(num_tensormaps)
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

        tensormap_manager.fence_tensormap_update(tensormap_a_gmem_ptr)
        tensormap_manager.fence_tensormap_update(tensormap_b_gmem_ptr)
        tensormap_manager.fence_tensormap_update(tensormap_sfa_gmem_ptr)
        tensormap_manager.fence_tensormap_update(tensormap_sfb_gmem_ptr)

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
    # Deviation from the seed: no `cute.assume(n, 32)` on the row stride. validate_inputs
    # accepts any N >= 1 and the epilogue predicates N residues; a divisibility promise that
    # N does not keep would let the compiler fold the address arithmetic wrongly.
    mC_mnl_layout = cute.make_layout((m, n, 1), stride=(n, 1, m * n))
    mC_mnl = cute.make_tensor(mC_mnl_iter, mC_mnl_layout)
    # (bM, bN)
    gC_mnl = cute.local_tile(
        mC_mnl, cute.slice_(mma_tiler_mnk, (None, None, 0)), (coord_x, coord_y, 0)
    )

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

    residue_m = mC_mnl.shape[0] - cutlass.Int32(coord_x) * cutlass.Int32(mma_tiler_mnk[0])
    residue_n = mC_mnl.shape[1] - cutlass.Int32(coord_y) * cutlass.Int32(mma_tiler_mnk[1])

    # Full tiles (most of them) store without predicates
    if residue_m >= cutlass.Int32(mma_tiler_mnk[0]) and residue_n >= cutlass.Int32(mma_tiler_mnk[1]):
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


def _group_tensors(ptr_of_ptrs, ptr_of_sizes, num_groups):
    tensor_of_ptrs = cute.make_tensor(
        ptr_of_ptrs, cute.make_layout((num_groups, NUM_PTR_COLS), stride=(NUM_PTR_COLS, 1))
    )
    tensor_of_problem_sizes = cute.make_tensor(
        ptr_of_sizes, cute.make_layout((num_groups, 4), stride=(4, 1))
    )
    return tensor_of_ptrs, tensor_of_problem_sizes


@cute.jit
def init_tensormaps_jit(
    ptr_of_ptrs: cute.Pointer,
    ptr_of_sizes: cute.Pointer,
    ptr_of_tensormaps: cute.Pointer,
    num_groups: cutlass.Int32,
    stream: cuda.CUstream,
):
    tensor_of_ptrs, tensor_of_problem_sizes = _group_tensors(ptr_of_ptrs, ptr_of_sizes, num_groups)
    tensormaps = cute.make_tensor(
        ptr_of_tensormaps,
        cute.make_layout((num_groups, num_tensormaps, 16), stride=(num_tensormaps * 16, 16, 1)),
    )
    setup = _make_mma_and_atoms()
    init_tensormaps_kernel(
        *setup["atoms"],
        tensor_of_ptrs,
        tensor_of_problem_sizes,
        tensormaps,
    ).launch(
        grid=(1, 1, num_groups),
        block=[threads_per_cta, 1, 1],
        cluster=(1, 1, 1),
        stream=stream,
    )


@cute.jit
def gemm_jit(
    ptr_of_ptrs: cute.Pointer,
    ptr_of_sizes: cute.Pointer,
    ptr_of_tiles: cute.Pointer,
    ptr_of_tensormaps: cute.Pointer,
    num_tiles: cutlass.Int32,
    num_groups: cutlass.Int32,
    stream: cuda.CUstream,
):
    tensor_of_ptrs, tensor_of_problem_sizes = _group_tensors(ptr_of_ptrs, ptr_of_sizes, num_groups)
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
    gemm_kernel(
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
    ).launch(
        # Deviation from the seed: tiles run along grid x (up to 2^31 - 1 CTAs) instead of
        # grid z (at most 65535), so no tile count the tables allow can overflow the grid.
        grid=(num_tiles, 1, 1),
        block=[threads_per_cta, 1, 1],
        cluster=(1, 1, 1),
        stream=stream,
    )


# =============================================================================
# Host code (Python): compile caches, prepared launches, the sm_100 backend
# =============================================================================
def _fake_ptr(dtype):
    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)


# Compile caches: the key is everything baked into the code (G, config, target arch).
_compiled_init_cache: dict = {}
_compiled_gemm_cache: dict = {}


def compile_init_tensormaps(num_groups: int, options: str | None = None, config=SM100_CONFIG):
    key = (num_groups, config, options)
    if key not in _compiled_init_cache:
        compiled = cute.compile(
            init_tensormaps_jit,
            _fake_ptr(cutlass.Int64),
            _fake_ptr(cutlass.Int32),
            _fake_ptr(cutlass.Int64),
            cutlass.Int32(num_groups),
            cuda.CUstream(0),
            **({"options": options} if options else {}),
        )
        _compiled_init_cache[key] = compiled
    return _compiled_init_cache[key]


def compile_gemm(num_groups: int, options: str | None = None, config=SM100_CONFIG):
    key = (num_groups, config, options)
    if key not in _compiled_gemm_cache:
        compiled = cute.compile(
            gemm_jit,
            _fake_ptr(cutlass.Int64),
            _fake_ptr(cutlass.Int32),
            _fake_ptr(cutlass.Int32),
            _fake_ptr(cutlass.Int64),
            cutlass.Int32(1),
            cutlass.Int32(num_groups),
            cuda.CUstream(0),
            **({"options": options} if options else {}),
        )
        _compiled_gemm_cache[key] = compiled
    return _compiled_gemm_cache[key]


def compile_targets() -> list[tuple[str, str, Callable[[int, str | None], Any]]]:
    """Kernels of this backend for the build report: (kernel name, arch, compile(G, options))."""
    return [
        ("sm100_init_tensormaps", SM100_CONFIG.arch, compile_init_tensormaps),
        ("sm100_gemm", SM100_CONFIG.arch, compile_gemm),
    ]


# The only place that reaches into DSL internals. A compiled-function call converts its
# arguments on every call (30-65 us of CPU for 5 pointers + 2 ints with DSL 4.3.5); building
# the packed argument array once and calling the entry point directly costs one C call.
# Checked against the pinned DSL version; anything else falls back to the plain call.
# NVFP4_PLAIN_LAUNCH=1 forces the plain call (to compare, or to rule the fast path out).
_PREPARED_LAUNCH_DSL_VERSION = "4.3.5"
_FORCE_PLAIN_LAUNCH = os.environ.get("NVFP4_PLAIN_LAUNCH", "0") not in ("", "0")


def _installed_dsl_version() -> str | None:
    try:
        return package_version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        return None


_DSL_VERSION = _installed_dsl_version()


def make_launcher(compiled, *args) -> Callable[[], None]:
    """Return a no-argument callable that runs ``compiled(*args)``.

    ``args`` must be DSL objects (cute Pointers, cutlass.Int32, cuda.CUstream) that stay
    alive as long as the launcher: the packed arguments point into them.
    """
    if _DSL_VERSION == _PREPARED_LAUNCH_DSL_VERSION and not _FORCE_PLAIN_LAUNCH:
        try:
            exe_args, adapted_args = compiled.generate_execution_args(*args)
            executor = compiled.to(None)
            packed_args = executor._get_invoke_packed_args(list(exe_args))
            capi_func = executor.jit_module.capi_func
            cuda_result = executor.cuda_result
        except Exception:  # noqa: BLE001 - any change in DSL internals selects the plain call
            return lambda: compiled(*args)
        keepalive = (compiled, args, exe_args, adapted_args, executor)

        def launch():
            capi_func(packed_args)
            if cuda_result is not None and cuda_result.value != 0:
                raise RuntimeError(f"kernel launch failed: CUresult {cuda_result.value}")

        launch.keepalive = keepalive
        return launch
    return lambda: compiled(*args)


# A prepared launch recorded once per input set as a CUDA graph and replayed with
# cuGraphLaunch: 1.8 µs of CPU per call on the H200 host, against 4.6-6.1 µs for the prepared
# DSL call (whose host code builds the launch config and launches through the runtime on every
# call) and 7.2-9.0 µs for a bare torch launch (medians of two rounds of one run). The graph
# holds the kernel's parameters by value; nothing of the DSL is touched beyond the call it
# records.
# NVFP4_GRAPH_LAUNCH=0 launches the prepared call directly (to compare, or to rule graphs out).
_GRAPH_LAUNCH = os.environ.get("NVFP4_GRAPH_LAUNCH", "1") not in ("", "0")
_CAPTURE_STREAMS: dict = {}


def _check_cuda(result, what: str) -> None:
    if result != cuda.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {result!r}")


class GraphLaunch:
    """One launch recorded as an executable CUDA graph; replayable on any stream.

    A replay is ordered after earlier work on its stream and after earlier replays of the
    same graph (CUDA's rule for cuGraphLaunch). Destroying it while a replay is pending is
    safe: the driver frees the graph when that replay completes.
    """

    __slots__ = ("graph_exec",)

    def __init__(self, record: Callable[[cuda.CUstream], Callable[[], None]], device: torch.device):
        """Capture what `record(stream)()` launches on a private stream of `device`."""
        self.graph_exec = None
        with torch.cuda.device(device):
            capture_stream = _CAPTURE_STREAMS.get(device.index)
            if capture_stream is None:
                capture_stream = _CAPTURE_STREAMS[device.index] = torch.cuda.Stream(device)
            stream = cuda.CUstream(capture_stream.cuda_stream)
            launch = record(stream)
            # Thread-local: CUDA calls of other threads are not captured and not disturbed
            mode = cuda.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            _check_cuda(cuda.cuStreamBeginCapture(stream, mode)[0], "cuStreamBeginCapture")
            try:
                launch()
            finally:
                # Always leave capture mode, also when the launch raised
                result, graph = cuda.cuStreamEndCapture(stream)
            _check_cuda(result, "cuStreamEndCapture")
            try:
                result, graph_exec = cuda.cuGraphInstantiate(graph, 0)
                _check_cuda(result, "cuGraphInstantiate")
            finally:
                cuda.cuGraphDestroy(graph)  # the executable graph does not need it
        self.graph_exec = graph_exec

    def launcher(self, stream: cuda.CUstream) -> Callable[[], None]:
        graph_launch = cuda.cuGraphLaunch
        graph_exec = self.graph_exec

        def launch():
            result = graph_launch(graph_exec, stream)[0]
            if result:  # CUresult is an IntEnum, CUDA_SUCCESS == 0
                raise RuntimeError(f"cuGraphLaunch failed: {result!r}")

        launch.keepalive = self
        return launch

    def __del__(self):
        if self.graph_exec is not None:
            try:
                cuda.cuGraphExecDestroy(self.graph_exec)
            except Exception:  # noqa: BLE001, S110 - interpreter shutdown: the driver may be gone
                pass


def _gmem_ptr(dtype, tensor: torch.Tensor):
    return make_ptr(dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)


class Sm100LaunchState:
    """What a launch of one input set on sm_100 reads: its tables and TMA descriptors."""

    __slots__ = ("tables", "tensormaps")

    def __init__(self, tables, tensormaps):
        self.tables = tables
        self.tensormaps = tensormaps

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        # The tensormaps may have been written on another stream (a miss on stream S1, now
        # launched on S2): keep their memory alive for S2's work after an eviction.
        self.tensormaps.record_stream(stream)


class Sm100Backend:
    """Backend protocol implementation for B200 (sm_100a)."""

    name = "sm100"
    tile_m = SM100_CONFIG.mma_tiler_mnk[0]
    tile_n = SM100_CONFIG.mma_tiler_mnk[1]

    def __init__(self):
        # Descriptors depend on the A/B/SFA/SFB pointers and the sizes, not on C: input sets
        # that differ only in C share them, and the init kernel runs only when an A/B/SF
        # pointer (or a size) changed. Bounded like the runtime cache.
        self._descriptors = RuntimeCache(max_entries=64)

    def compile(self, num_groups: int):
        return compile_init_tensormaps(num_groups), compile_gemm(num_groups)

    def prepare(self, tables: "GroupTables") -> Sm100LaunchState:
        """TMA descriptors of every group: reused, or built by the init kernel on the
        current stream."""
        descriptor_key = (
            str(tables.device),
            tables.problem_sizes,
            tuple((p[PTR_A], p[PTR_B], p[PTR_SFA], p[PTR_SFB]) for p in tables.pointers),
        )
        tensormaps = self._descriptors.get(descriptor_key)
        if tensormaps is None:
            init_fn, _ = self.compile(tables.num_groups)
            tensormaps = torch.empty(
                (tables.num_groups, num_tensormaps, bytes_per_tensormap // 8),
                dtype=torch.int64,
                device=tables.device,
            )
            init_fn(
                _gmem_ptr(cutlass.Int64, tables.ptrs),
                _gmem_ptr(cutlass.Int32, tables.sizes),
                _gmem_ptr(cutlass.Int64, tensormaps),
                cutlass.Int32(tables.num_groups),
                _stream_for_current(),
            )
            self._descriptors.put(descriptor_key, tensormaps)
        return Sm100LaunchState(tables, tensormaps)

    def can_implement(self, problem_sizes) -> None:
        """validate_inputs states every sm_100 constraint; nothing more to check here."""

    def tile_shape(self, problem_sizes) -> tuple[int, int]:
        """(tile_m, tile_n) of the tile table: the one MMA tile of the sm_100 kernel."""
        return self.tile_m, self.tile_n

    def launcher(self, state: Sm100LaunchState, stream: cuda.CUstream) -> Callable[[], None]:
        """The GEMM launch of this input set on `stream`, its arguments prepared once."""
        tables = state.tables
        if tables.num_tiles == 0:
            return _no_launch  # every group has M = 0 (a 0-CTA grid is invalid)
        _, gemm_fn = self.compile(tables.num_groups)
        return make_launcher(
            gemm_fn,
            _gmem_ptr(cutlass.Int64, tables.ptrs),
            _gmem_ptr(cutlass.Int32, tables.sizes),
            _gmem_ptr(cutlass.Int32, tables.tiles),
            _gmem_ptr(cutlass.Int64, state.tensormaps),
            cutlass.Int32(tables.num_tiles),
            cutlass.Int32(tables.num_groups),
            stream,
        )


def _no_launch() -> None:
    pass


# =============================================================================
# Shared host runtime (both backends)
# =============================================================================
def plan_tiles(problem_sizes, tile_m: int, tile_n: int) -> list[tuple[int, int, int]]:
    """(group, tile_m, tile_n) of every output tile; groups with M = 0 have none.

    Order: group-major, then tile_m, then tile_n fastest, so CTAs that share an A tile
    (same group and tile_m) are launched next to each other and hit it in L2.
    """
    tiles = []
    for g, (m, n, _k, _l) in enumerate(problem_sizes):
        for tile_row in range(ceil_div(m, tile_m)):
            for tile_col in range(ceil_div(n, tile_n)):
                tiles.append((g, tile_row, tile_col))
    return tiles


def _align_up(x, a):
    return (x + a - 1) // a * a


class GroupTables:
    """Device tables of one input set (see ARCH section 4).

    ptrs  int64 [G, 5]: data_ptr of a, b, c, sfa_reordered, sfb_reordered per group
    sizes int32 [G, 4]: (M, N, K, L) per group
    tiles int32 [T, 3]: (group, tile_m, tile_n), order of plan_tiles
    """

    __slots__ = (
        "_device_buf", "device", "host_staging", "num_groups", "num_tiles", "pointers",
        "problem_sizes", "ptrs", "sizes", "tiles",
    )

    def __init__(self, device, problem_sizes, pointers, num_tiles, ptrs, sizes, tiles, host_staging, device_buf):
        self.device = device
        # Host copies (tuples) of what the device tables hold
        self.problem_sizes = problem_sizes
        self.pointers = pointers
        self.num_groups = len(problem_sizes)
        self.num_tiles = num_tiles
        self.ptrs = ptrs
        self.sizes = sizes
        self.tiles = tiles
        # The host staging buffer belongs to this object and is never written again after the
        # copy below was issued: a later input set gets its own buffer, so a pending
        # non_blocking copy can never see another call's pointers. When this object dies, torch's
        # pinned-memory allocator only reuses the block after the copies that read it finished.
        self.host_staging = host_staging
        self._device_buf = device_buf

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Tell torch's allocator the tables are read on `stream` (memory freed on eviction
        is then not reused before that stream's work finished)."""
        self._device_buf.record_stream(stream)


def build_group_tables(problem_sizes, pointers, tile_m: int, tile_n: int, device) -> GroupTables:
    """Build GroupTables on `device` from validated sizes and per-group pointer 5-tuples.

    One freshly allocated (pinned, for CUDA) host buffer holds all three tables; one
    non_blocking copy on torch's current stream moves it to the device.
    """
    device = torch.device(device)
    num_groups = len(problem_sizes)
    tiles = plan_tiles(problem_sizes, tile_m, tile_n)
    num_tiles = len(tiles)
    # Byte offsets, each table 128-byte aligned
    ptrs_bytes = num_groups * NUM_PTR_COLS * 8
    sizes_off = _align_up(ptrs_bytes, 128)
    tiles_off = _align_up(sizes_off + num_groups * 4 * 4, 128)
    total = _align_up(tiles_off + max(num_tiles, 1) * 3 * 4, 128)

    # Packed in Python and handed to torch as one buffer: one torch op per table cost about
    # twice the CPU on a cache miss (144 -> 69 µs for G = 8, benchmark shape 0, on a CPU here).
    staging = bytearray(total)
    flatten = itertools.chain.from_iterable
    struct.pack_into(f"<{num_groups * NUM_PTR_COLS}q", staging, 0, *flatten(pointers))
    struct.pack_into(f"<{num_groups * 4}i", staging, sizes_off, *flatten(problem_sizes))
    struct.pack_into(f"<{num_tiles * 3}i", staging, tiles_off, *flatten(tiles))
    host = torch.frombuffer(staging, dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()  # a fresh pinned block, owned by these tables
    dev = torch.empty(total, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    return GroupTables(
        device=device,
        problem_sizes=tuple(tuple(int(v) for v in p) for p in problem_sizes),
        pointers=tuple(tuple(int(v) for v in p) for p in pointers),
        num_tiles=num_tiles,
        ptrs=dev[:ptrs_bytes].view(torch.int64).view(num_groups, NUM_PTR_COLS),
        sizes=dev[sizes_off : sizes_off + num_groups * 16].view(torch.int32).view(num_groups, 4),
        tiles=dev[tiles_off : tiles_off + num_tiles * 12].view(torch.int32).view(num_tiles, 3),
        host_staging=host,
        device_buf=dev,
    )


class RuntimeCache:
    """Bounded LRU of prepared input sets (tables, descriptors, prepared launch).

    ``entries`` (least recently used first) is public so that custom_kernel's hit path can
    look up and touch an entry with two C calls, without a Python frame for get()."""

    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self.entries: collections.OrderedDict[tuple, Any] = collections.OrderedDict()

    def get(self, key):
        state = self.entries.get(key)
        if state is not None:
            self.entries.move_to_end(key)
        return state

    def put(self, key, state):
        self.entries[key] = state
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def __len__(self):
        return len(self.entries)

    def __contains__(self, key):
        return key in self.entries

    def clear(self):
        self.entries.clear()


# const_data_ptr: the same address as data_ptr, without the mutable-data bookkeeping (12%
# less per call on a CPU: the key reads 5G pointers on every call)
_data_ptr = getattr(torch.Tensor, "const_data_ptr", torch.Tensor.data_ptr)
_flatten = itertools.chain.from_iterable


def input_key(data) -> tuple:
    """Cache key of an input set: the data pointers of every a, b, c (group by group), then
    of every reordered sfa, sfb.

    Built from the raw input on every call, so it holds only what must be hashed:
      * the device is implied: under CUDA's unified virtual addressing a device pointer
        identifies its allocation process-wide (and the backend follows the device);
      * the problem sizes are not hashed: a hit compares them with the state's validated
        sizes (hashing 4G more ints per call cost more than the comparison).
    With G = 8 the 40 data_ptr() calls are most of its cost. Raises on malformed input.
    """
    abc, _, sfasfb_reordered, _ = data
    return (*map(_data_ptr, _flatten(abc)), *map(_data_ptr, _flatten(sfasfb_reordered)))


class RuntimeState:
    """Everything one input set needs on a hit: its tables, the backend's launch state, and
    the launch prepared for the stream it last ran on."""

    __slots__ = ("backend", "graph", "launch", "launch_state", "stream", "tables")

    def __init__(self, backend, tables, launch_state):
        self.backend = backend
        self.tables = tables
        self.launch_state = launch_state
        self.stream = None
        self.launch = None
        # GraphLaunch of this input set's launch; None: not captured yet; False: launched
        # directly (graphs off, nothing to launch, or the capture failed)
        self.graph = None

    def bind(self, stream: cuda.CUstream) -> None:
        """Prepare the launch for `stream` (torch's current stream)."""
        tables = self.tables
        if self.graph is None:
            self.graph = False
            if _GRAPH_LAUNCH and tables.device.type == "cuda" and tables.num_tiles > 0:
                try:
                    self.graph = GraphLaunch(
                        lambda s: self.backend.launcher(self.launch_state, s), tables.device
                    )
                except Exception:  # noqa: BLE001 - the direct launch reports any real error
                    self.graph = False
        if self.graph:
            self.launch = self.graph.launcher(stream)
        else:
            self.launch = self.backend.launcher(self.launch_state, stream)
        self.stream = stream
        if tables.device.type == "cuda":
            # Tables (and descriptors) written on another stream (a miss on S1, now launched
            # on S2): keep their memory alive for S2's work after an eviction.
            torch_stream = torch.cuda.current_stream(tables.device)
            tables.record_stream(torch_stream)
            self.launch_state.record_stream(torch_stream)

    def run(self, stream: cuda.CUstream) -> None:
        if stream is not self.stream:
            self.bind(stream)
        self.launch()


def build_state(data, problem_sizes, backend) -> RuntimeState:
    """Tables and launch state of a validated input set for `backend` (every backend, and every
    caller: custom_kernel, the Hopper module's standalone entry, the benchmarks)."""
    backend.can_implement(problem_sizes)
    abc, _, sfasfb_reordered, _ = data
    device = abc[0][0].device
    pointers = [
        (a.data_ptr(), b.data_ptr(), c.data_ptr(), sfa.data_ptr(), sfb.data_ptr())
        for (a, b, c), (sfa, sfb) in zip(abc, sfasfb_reordered)
    ]
    with torch.cuda.device(device.index) if device.type == "cuda" else contextlib.nullcontext():
        tile_m, tile_n = backend.tile_shape(problem_sizes)
        tables = build_group_tables(problem_sizes, pointers, tile_m, tile_n, device)
        launch_state = backend.prepare(tables)
    return RuntimeState(backend, tables, launch_state)


_RUNTIME_CACHE = RuntimeCache(max_entries=64)
_BACKEND_BY_DEVICE: dict = {}


def _make_sm90_backend():
    try:
        import nvfp4_hopper  # Hopper only: imported on first sm_90 use
    except Exception as exc:  # noqa: BLE001 - any import failure gets the same clear message
        raise RuntimeError(
            "This GPU is sm_90 (Hopper); its backend lives in nvfp4_hopper.py, which could not "
            f"be imported ({type(exc).__name__}: {exc}). Put nvfp4_hopper.py next to "
            "submission.py, or run on a B200 (sm_100)."
        ) from None
    if not hasattr(nvfp4_hopper, "make_backend"):
        raise RuntimeError("nvfp4_hopper.py has no make_backend(); the sm_90 backend is missing")
    return nvfp4_hopper.make_backend()


def select_backend(device_index: int):
    backend = _BACKEND_BY_DEVICE.get(device_index)
    if backend is None:
        capability = torch.cuda.get_device_capability(device_index)
        if capability[0] == 10:
            backend = Sm100Backend()
        elif capability == (9, 0):
            backend = _make_sm90_backend()
        else:
            name = torch.cuda.get_device_name(device_index)
            raise RuntimeError(
                f"GPU {device_index} ({name}) has compute capability {capability[0]}.{capability[1]}; "
                f"this submission supports {SUPPORTED_GPUS}."
            )
        _BACKEND_BY_DEVICE[device_index] = backend
    return backend


def _validated_state(data) -> RuntimeState:
    """The validating path: validate_inputs, then the cached state of this input set or a
    new one."""
    problem_sizes = validate_inputs(data)
    key = input_key(data)
    state = _RUNTIME_CACHE.get(key)
    if state is None or state.tables.problem_sizes != problem_sizes:
        state = build_state(data, problem_sizes, select_backend(data[0][0][0].device.index))
        _RUNTIME_CACHE.put(key, state)
    return state


def custom_kernel(data: input_t) -> output_t:
    """Compute every group's C into its `c` tensor and return [c_0, ..., c_{G-1}]."""
    # Hit: every pointer and the problem sizes equal those of an input set that passed
    # validate_inputs. A hit does NOT re-check dtypes, strides or the plain sfa/sfb tensors:
    # a tensor replaced by one with the same address and problem size but another dtype or
    # layout would be read as the validated one.
    # (input_key, RuntimeCache.get, _stream_for_current and RuntimeState.run are inlined
    # below: every Python frame saved is CPU time the leaderboard's 15-call loop times)
    try:
        # input_key(data), inlined
        key = (*map(_data_ptr, _flatten(data[0])), *map(_data_ptr, _flatten(data[2])))
        entries = _RUNTIME_CACHE.entries
        state = entries.get(key)
        if state is not None:
            entries.move_to_end(key)
            if tuple(data[3]) != state.tables.problem_sizes:
                state = None  # same buffers, other sizes: validate and rebuild
    except Exception:  # noqa: BLE001 - malformed input of any kind goes to full validation
        state = None
    if state is None:
        state = _validated_state(data)
    if _current_raw_stream is not None:
        stream = _STREAM_OBJECTS.get(_current_raw_stream(_cuda_get_device()))
    else:
        stream = None
    if stream is None:
        stream = _stream_for_current()
    if stream is not state.stream:
        state.bind(stream)
    state.launch()
    return list(map(_c_of_group, data[0]))


_c_of_group = operator.itemgetter(2)


# One cuda.CUstream object per raw stream handle, so backends can compare streams by identity
_STREAM_OBJECTS: dict = {}
# torch.cuda.current_stream() builds a Stream object on every call; the raw handle of the
# current stream is one C call (the same private accessor Triton's launcher uses).
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)
if _cuda_get_device is None:
    _current_raw_stream = None  # both or neither: the public path otherwise


def _current_stream_handle() -> int:
    if _current_raw_stream is not None:
        # torch.cuda.current_device() without its lazy-init check (CUDA is initialized
        # before any stream is asked for: validation reads the device first)
        return _current_raw_stream(_cuda_get_device())
    return torch.cuda.current_stream().cuda_stream


def _stream_for_current() -> cuda.CUstream:
    handle = _current_stream_handle()
    stream = _STREAM_OBJECTS.get(handle)
    if stream is None:
        if len(_STREAM_OBJECTS) >= 64:
            _STREAM_OBJECTS.clear()
        stream = _STREAM_OBJECTS[handle] = cuda.CUstream(handle)
    return stream
