"""NVFP4 block-scaled grouped GEMM for Hopper (sm_90a), a backend of submission.py.

Computes, for every group i with M_i > 0,

    C_i[M_i, N_i] (fp16) = (A_i * SFA_i) @ (B_i * SFB_i)^T

with A_i, B_i packed float4 e2m1 (low nibble first) and one float8 e4m3 scale per 16
elements along K, read from the "reordered" (cuBLAS 32x4x4 blocked) scale tensors.

Hopper has no FP4 tensor cores. Every e2m1 value (2 significant bits) times an e4m3 scale
(at most 4 significant bits, 2^-9 .. 448) is exactly representable in fp16 (11 bits, normal
from 2^-14 to 65504): |v * s| lies in [2^-10, 2688]. The kernel therefore decodes each
operand into fp16 in shared memory and runs 16-bit wgmma with fp32 accumulation; the sums
are the exact block-scaled products, accumulated in fp32.

Per CTA: one output tile (group, tile_m, tile_n) of the shared tile table; 128x128 tiles.
Input sets with more tiles than CTA slots and long K run stream-K instead (stream_k_pays: one
CTA per slot, equal shares of all k-tiles, partial tiles summed through a global workspace);
input sets whose tiles fill the CTA slots badly otherwise run split-K over a 2-CTA cluster
(split_k_pays); 128x256 tiles are an option, measured slower (tile_n).

    global --cp.async--> raw stages (packed fp4 + scale bytes, ``raw_stages`` deep)
           --decode (all threads)--> B: fp16 stages in the swizzled K-major wgmma layout (2 deep)
                                     A: each warpgroup's own rows, straight into the register
                                        A fragment (K permuted per scale
                                        block identically for A and B, see _decode_blocks_asm)
           --wgmma (one warpgroup per 64 rows)--> fp32 accumulators --> predicated fp16 stores

The decode of k-tile k+1 runs on the CUDA cores while the wgmma of k-tile k runs on the
tensor cores (wgmma is asynchronous; ``wait_group(1)`` keeps one in flight). The decode's
instructions are most of the kernel's (Nsight Compute, benchmark shape 0 on the H200: integer
and multiply pipes 44% busy each, tensor pipe 41%, issue slots 55%), so the decode places two
codes per register with 7 integer instructions per 8 codes (see _place_word_ptx). No unit is
saturated, though: the warps mostly wait on instruction latencies (the figures and the
options tried are at the main loop's barrier).

Why cp.async and not TMA: the per-group base pointers arrive at run time in the pointer
table, so TMA would need one descriptor per group written on the device (an init kernel
plus tensormap fences, as the sm_100 backend does). The packed operands are a quarter of
the decoded bytes, so plain 16-byte cp.async from the table's pointers costs few issue
slots, needs no descriptors, and zero-fills rows past M without reading them.

Constraints (checked by submission.validate_inputs and by ``can_implement`` here):
  * 1 <= G <= 64, L == 1
  * M >= 0 (groups with M == 0 get no tiles), N a multiple of 128, K a multiple of 256
  * a/b/c row-major with unit stride along K (a, b) or N (c); reordered scale tensors in the
    official permuted layout (a contiguous (rest_mn, rest_k, 32, 4, 4) buffer)

Standalone use of one config on an H200: ``submission.run_with_backend(data, make_backend(config))``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import cute, utils
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cute.runtime import make_ptr
from cutlass.cutlass_dsl import dsl_user_op

MAX_GROUPS = 64
SF_VEC_SIZE = 16
# Reordered scale tensors: one 512-byte atom holds 128 rows x 4 scale blocks (64 elements of K)
SF_ATOM_ROWS = 128
SF_ATOM_BYTES = 512
# Stream-K segment row: (tile, first k-tile, k-tile count, part, parts of the tile, first
# workspace slot of the tile)
SEGMENT_FIELDS = 6
# Rows per tile: two warpgroups of 64 (one m64 wgmma each). 256-row tiles (four warpgroups,
# one CTA per SM, B's decode shared by twice the rows): slower, removed; docs/EXPERIMENTS.md.
TILE_M = 128


@dataclasses.dataclass(frozen=True)
class HopperGemmConfig:
    """Everything baked into the compiled sm_90a kernel."""

    # 128 or 256 (whole 128-row scale atoms). 128x64 tiles (half an atom per B tile, two CTAs
    # per SM for the G = 2 shapes): slower, removed; docs/EXPERIMENTS.md.
    # H200 device µs, shapes 0-3, 128 vs 256 (register A, 239 registers, 1 CTA/SM):
    # 206.7/129.2/54.4/28.7 vs 239.7/133.3/85.0/38.4; 256 with split_k = 2:
    # 206.1/164.4/55.8/31.1.
    tile_n: int = 128
    tile_k: int = 64  # one 128-byte swizzle atom of fp16 per row; 4 scale blocks
    # cp.async prefetch depth of packed data (9 KB per stage). H200 device µs, shapes 0-3:
    # 3 stages 221.1/135.0/58.9/30.5, 4 stages 207.0/129.1/54.5/28.7, 6 stages
    # 215.0/132.9/57.5/29.5.
    # A row's packed bytes of one k-tile are 32 (one sector), so a warp's 16-byte cp.async
    # spans 16 rows and costs 16 shared-memory wavefronts where 4 would carry its 512 bytes
    # (Nsight Compute, shape 2 split-K: 3.9x the ideal, most of the kernel's excess
    # wavefronts). Tried and removed (commit ef8e037): 2 k-tiles per raw stage (64 contiguous
    # bytes per row). Exact, but slower: H200 device µs, shapes 0-3, split-K where the
    # default picks it, 3 stages of 2: 219.7/138.2/49.5/24.6, 2 stages of 2:
    # 211.4/134.8/47.6/24.0, vs 199.1/117.6/47.1/23.3 (4 k-tiles per stage: 152 registers).
    raw_stages: int = 4
    # Warp specialization (warpgroups that decode into mbarrier-handed stages, others that
    # only run wgmma): slower, removed; docs/EXPERIMENTS.md.
    # A is decoded straight into the wgmma A fragment (register A; see decode_a_registers).
    # A decoded into shared memory like B (wgmma reading both from there): slower, removed;
    # docs/EXPERIMENTS.md.
    # CTAs sharing one output tile along K (a cluster of split_k CTAs along grid x): 1, or 2
    # (each CTA runs half the k-tiles; the fp32 partial sums meet through DSMEM, see
    # reduce_split_k). The default backend picks 2 per input set (split_k_pays). On shape 2
    # (120 tiles, one CTA per SM unsplit) Nsight Compute at 1.8 GHz: 53.1 vs 48.7 µs, 1.99 vs
    # 3.48 warps per scheduler, issue slots 46% vs 50% busy.
    split_k: int = 1
    # True: stream-K. The grid is CTAS_PER_SM CTAs per SM ("workers", all resident at once);
    # the host cuts the input set's k-tiles, all tiles in table order, into one contiguous
    # share of equal weighted cost per worker (plan_stream_k): a worker runs the tail of one
    # tile, whole tiles, the head of the next. The parts of a tile shared by workers meet in
    # a global fp32 workspace: each part stores its sums there, and the last part to arrive
    # (a per-tile counter) adds all parts in k order and stores the tile. Fixes what tile
    # counts that are not a multiple of the CTA slots leave idle (shape 2: 144 full and 96
    # half split-K CTAs on 264 slots). Needs register A and split_k = 1. On shape 2 it is
    # slower than split-K (53.6 vs 47.1 µs): the split-K partition run through this kernel
    # took 47.6 µs with each part storing its own sums (no workspace, wrong sums) and 49.6
    # with the workspace; balanced shares without the workspace, 48.8. Nsight Compute, SM
    # active cycles min/avg/max: split-K 49.1K/69.5K/79.9K, balanced shares 67.4K/74.0K/84.8K:
    # SMs run equal shares at speeds up to 25% apart, so the longest SM barely moves, while
    # segment changes add 6% cycles.
    stream_k: bool = False
    arch: str = "sm_90a"

    @property
    def tile_m(self) -> int:
        """Rows per tile: TILE_M."""
        return TILE_M

    @property
    def mma_stages(self) -> int:
        """Decoded fp16 stages: 2 (decode k+1 while wgmma reads k)."""
        return 2

    @property
    def num_warpgroups(self) -> int:
        """MMA warpgroups: one per 64 rows of the tile."""
        return self.tile_m // 64

    @property
    def num_threads(self) -> int:
        """Threads per CTA: every warpgroup copies, decodes and runs wgmma."""
        return 128 * self.num_warpgroups

    @property
    def sfa_atoms(self) -> int:
        """512-byte scale atoms per raw stage for A (one per 128 rows)."""
        return -(-self.tile_m // SF_ATOM_ROWS)

    @property
    def sfb_atoms(self) -> int:
        """512-byte scale atoms per raw stage for B (one per 128 rows)."""
        return -(-self.tile_n // SF_ATOM_ROWS)

    @property
    def raw_stage_bytes(self) -> int:
        # packed rows (tile_k / 2 bytes each) + the A and B scale atoms
        rows = self.tile_m + self.tile_n
        return rows * (self.tile_k // 2) + (self.sfa_atoms + self.sfb_atoms) * SF_ATOM_BYTES

    def check(self) -> None:
        if self.tile_n not in (128, 256):
            raise ValueError(f"tile_n={self.tile_n}: must be 128 or 256")
        if self.tile_k != 64:
            raise ValueError(f"tile_k={self.tile_k}: only 64 (one scale atom along K) is implemented")
        if self.raw_stages < 2:
            raise ValueError(f"raw_stages={self.raw_stages}: must be >= 2")
        if self.split_k not in (1, 2):
            # K % 256 == 0 gives a multiple of 4 k-tiles: 2 halves of an even count each
            raise ValueError(f"split_k={self.split_k}: must be 1 or 2")
        if self.stream_k and self.split_k != 1:
            raise ValueError("stream_k needs split_k = 1")

    @property
    def reduction_bytes(self) -> int:
        """Shared memory one summing rank of a split-K cluster receives: the other rank's fp32
        accumulators of the rows it stores (its share of the tile's rows)."""
        if self.split_k == 1:
            return 0
        return self.tile_m // self.split_k * self.tile_n * 4


SM90_CONFIG = HopperGemmConfig()
# Split-K over a 2-CTA cluster: twice the CTAs, each with half the k-tiles (what the default
# backend runs where split_k_pays).
SPLIT_K_CONFIG = dataclasses.replace(SM90_CONFIG, split_k=2)
# Stream-K: one share of equal weighted cost per CTA slot (see stream_k, plan_stream_k).
STREAM_K_CONFIG = dataclasses.replace(SM90_CONFIG, stream_k=True)


def can_implement(problem_sizes, config: HopperGemmConfig = SM90_CONFIG) -> None:
    """Raise ValueError naming group, field, value and rule if a problem is unsupported."""
    if not 1 <= len(problem_sizes) <= MAX_GROUPS:
        raise ValueError(f"G = {len(problem_sizes)}: the sm_90 kernel supports 1 <= G <= {MAX_GROUPS}")
    for g, (m, n, k, l) in enumerate(problem_sizes):
        if l != 1:
            raise ValueError(f"group {g}: L = {l}; the sm_90 kernel supports L == 1 only")
        if m < 0:
            raise ValueError(f"group {g}: M = {m}; M must be >= 0")
        if n <= 0 or n % SF_ATOM_ROWS != 0:
            raise ValueError(f"group {g}: N = {n}; N must be a positive multiple of 128")
        if k <= 0 or k % 256 != 0:
            raise ValueError(f"group {g}: K = {k}; K must be a positive multiple of 256")


# =============================================================================
# Device helpers (inline PTX)
# =============================================================================
def _inline_asm(result_type, operands, asm: str, constraints: str, *, loc=None, ip=None):
    """llvm.inline_asm as every helper here uses it: side effects kept, AT&T dialect."""
    return llvm.inline_asm(
        result_type,
        operands,
        asm,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def cp_async_16B(dst_smem: cutlass.Int32, src_gmem: cutlass.Int64, src_bytes: cutlass.Int32, *, loc=None, ip=None):
    """16-byte cp.async (L2 only); src_bytes == 0 zero-fills without reading global memory."""
    _inline_asm(
        None,
        [
            cutlass.Int32(dst_smem).ir_value(loc=loc, ip=ip),
            cutlass.Int64(src_gmem).ir_value(loc=loc, ip=ip),
            cutlass.Int32(src_bytes).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;",
        "r,l,r",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def store_f32x4_to_rank(local_smem: cutlass.Int32, values, rank: cutlass.Int32, *, loc=None, ip=None):
    """Store 4 fp32 at shared address `local_smem` of CTA `rank` of this cluster (DSMEM):
    mapa translates this CTA's shared address into that CTA's window."""
    _inline_asm(
        None,
        [cutlass.Int32(local_smem).ir_value(loc=loc, ip=ip)]
        + [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in values]
        + [cutlass.Int32(rank).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 remote;\n\tmapa.shared::cluster.u32 remote, $0, $5;\n\t"
        "st.shared::cluster.v4.f32 [remote], {$1, $2, $3, $4};\n\t}",
        "r,f,f,f,f,r,~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def store_f16x2(address: cutlass.Int64, low: cutlass.Float32, high: cutlass.Float32, *, loc=None, ip=None):
    """Round two fp32 to fp16 and store them as one 32-bit word at global `address`
    (low at the lower address)."""
    _inline_asm(
        None,
        [
            cutlass.Int64(address).ir_value(loc=loc, ip=ip),
            cutlass.Float32(low).ir_value(loc=loc, ip=ip),
            cutlass.Float32(high).ir_value(loc=loc, ip=ip),
        ],
        "{\n\t.reg .b32 packed;\n\tcvt.rn.f16x2.f32 packed, $2, $1;\n\tst.global.b32 [$0], packed;\n\t}",
        "l,f,f,~{memory}",
        loc=loc,
        ip=ip,
    )


def _load_f32x4(instruction: str, address, address_constraint: str, loc, ip):
    """4 fp32 from one 16-byte load `instruction` (ld.shared / ld.global form) at `address`."""
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Float32.mlir_type] * 4),
        [address.ir_value(loc=loc, ip=ip)],
        f"{instruction} {{$0, $1, $2, $3}}, [$4];",
        f"=f,=f,=f,=f,{address_constraint},~{{memory}}",
        loc=loc,
        ip=ip,
    )
    return [
        cutlass.Float32(llvm.extractvalue(cutlass.Float32.mlir_type, result, [i], loc=loc, ip=ip))
        for i in range(4)
    ]


@dsl_user_op
def load_f32x4(smem: cutlass.Int32, *, loc=None, ip=None):
    """4 fp32 from shared address `smem` (one 16-byte load)."""
    return _load_f32x4("ld.shared.v4.f32", cutlass.Int32(smem), "r", loc, ip)


@dsl_user_op
def store_f32x4_global(address: cutlass.Int64, values, *, loc=None, ip=None):
    """Store 4 fp32 at global `address` (one 16-byte store)."""
    _inline_asm(
        None,
        [cutlass.Int64(address).ir_value(loc=loc, ip=ip)]
        + [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in values],
        "st.global.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,f,f,f,f,~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def load_f32x4_global_l2(address: cutlass.Int64, *, loc=None, ip=None):
    """4 fp32 from global `address`, read at L2 (.cg: never a stale line of this SM's L1)."""
    return _load_f32x4("ld.global.cg.v4.f32", cutlass.Int64(address), "l", loc, ip)


@dsl_user_op
def opaque_i64(value: cutlass.Int64, *, loc=None, ip=None) -> cutlass.Int64:
    """`value`, through an asm statement the compiler cannot move: keeps an address computed
    from it where it is used (hoisted out of a loop, it would hold registers throughout)."""
    result = _inline_asm(
        cutlass.Int64.mlir_type,
        [cutlass.Int64(value).ir_value(loc=loc, ip=ip)],
        "mov.b64 $0, $1;",
        "=l,l",
        loc=loc,
        ip=ip,
    )
    return cutlass.Int64(result)


@dsl_user_op
def fence_proxy_async_shared_cta(*, loc=None, ip=None):
    """fence.proxy.async.shared::cta: this thread's generic-proxy shared-memory writes become
    visible to the async proxy (wgmma operand reads).

    DSL compatibility: 4.3.5 (the runner's) takes the nvvm enums ``cute.arch.ProxyKind`` /
    ``cute.arch.SharedSpace``; 4.8.1 no longer exports them and takes string literals."""
    if hasattr(cute.arch, "ProxyKind"):  # DSL 4.3.5
        cute.arch.fence_proxy(
            cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta, loc=loc, ip=ip
        )
    else:  # DSL 4.8.1
        cute.arch.fence_proxy("async.shared", space="cta", loc=loc, ip=ip)


@dsl_user_op
def fence_acq_rel_gpu(*, loc=None, ip=None):
    """fence.acq_rel.gpu: orders this thread's global accesses before / after it, GPU-wide."""
    _inline_asm(None, [], "fence.acq_rel.gpu;", "~{memory}", loc=loc, ip=ip)


@dsl_user_op
def atomic_add_u32(address: cutlass.Int64, value: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Int32:
    """atom.global.add.u32 (relaxed, GPU scope): adds `value`, returns the previous value."""
    result = _inline_asm(
        cutlass.Int32.mlir_type,
        [cutlass.Int64(address).ir_value(loc=loc, ip=ip), cutlass.Int32(value).ir_value(loc=loc, ip=ip)],
        "atom.global.add.u32 $0, [$1], $2;",
        "=r,l,r,~{memory}",
        loc=loc,
        ip=ip,
    )
    return cutlass.Int32(result)


@dsl_user_op
def store_u32_global(address: cutlass.Int64, value: cutlass.Int32, *, loc=None, ip=None):
    _inline_asm(
        None,
        [cutlass.Int64(address).ir_value(loc=loc, ip=ip), cutlass.Int32(value).ir_value(loc=loc, ip=ip)],
        "st.global.u32 [$0], $1;",
        "l,r,~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def store_u32_shared(smem: cutlass.Int32, value: cutlass.Int32, *, loc=None, ip=None):
    _inline_asm(
        None,
        [cutlass.Int32(smem).ir_value(loc=loc, ip=ip), cutlass.Int32(value).ir_value(loc=loc, ip=ip)],
        "st.shared.u32 [$0], $1;",
        "r,r,~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def load_u32_shared(smem: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Int32:
    result = _inline_asm(
        cutlass.Int32.mlir_type,
        [cutlass.Int32(smem).ir_value(loc=loc, ip=ip)],
        "ld.shared.u32 $0, [$1];",
        "=r,r,~{memory}",
        loc=loc,
        ip=ip,
    )
    return cutlass.Int32(result)


# Decode of packed e2m1 into fp16 (v * 2^-14, exact), two elements per 32-bit register.
#
# A packed 32-bit word holds 8 codes: byte p has element 2p in its low nibble ("even") and
# element 2p+1 in its high nibble ("odd"). The fp16 bit pattern of v * 2^-14 is the code's
# sign at bit 15 and its 3 magnitude bits (e1 e0 m) at bits 11..9, every other bit zero
# (code 0.5 lands on the subnormal 2^-15, handled exactly by fp16 multiplies and by wgmma).
# With x = w & 0x0F0F0F0F (even codes) and o = w & 0xF0F0F0F0 (odd codes), each register
# takes two codes two bytes apart, shifted so that the sign lands on bit 15 and the
# magnitude on bits 11..9 of its 16-bit lane, and keeps only those bits:
#
#     register  lanes (elements)   = (a | b) & 0x8E008E00 with
#     e02       (0, 4)               a = x << 12, b = x << 9
#     e13       (2, 6)               a = x << 4,  b = x << 1
#     o02       (1, 5)               a = o << 8,  b = o << 5
#     o13       (3, 7)               a = o,       b = o >> 3
#
# (a and b never both have a bit at a kept position, and no other code reaches one). That
# is 7 integer-pipe instructions per 8 codes (2 masks, 1 right shift, 4 lop3; ptxas may put
# the left shifts on the multiply pipe) where placing each pair with prmt + shift + lop3 took
# 15: the decode's integer work bounds the kernel (on the H200, skipping the B decode made
# it 23% faster). Multiplying a register by its block's scale s (fp16x2) gives v * s * 2^-14,
# exact (>= 2^-24, the smallest fp16 subnormal; wgmma takes fp16 subnormals exactly: the
# random tests with subnormal scales pass on the H200); the epilogue scales by 2^28 (both
# operands). Two multiplies (by 2^14, then by s: v * s, no rescale) were slower, removed;
# docs/EXPERIMENTS.md.
#
# K permutation. A dot product is invariant under one permutation of K applied to both
# operands. Within each 16-element scale block (one k16 wgmma step, so that every product of
# a step keeps one scale pair: wgmma's fp32 accumulation of a step that mixes scale blocks
# loses low bits of small terms) element e takes logical column LOGICAL_COLUMN[e]:
#   * B in shared memory (swizzled K-major fp16 rows): block s fills chunk 2s with the e02,
#     e13 registers of its two words and chunk 2s+1 with their o02, o13 (CHUNK_REGISTERS);
#   * A in registers: wgmma's fragment gives lane (g, t) of a warp, per k16 step, registers
#     (row g, cols 2t, 2t+1), (g+8, 2t, 2t+1), (g, 2t+8, 2t+9), (g+8, 2t+8, 2t+9). The lane
#     builds one word per block from bytes p and p+2 (p = t % 2) of the 4-byte half t // 2 of
#     rows g and g+8, [g.p, g8.p, g.p+2, g8.p+2] (one prmt, a_word_selector): its e02 / o02
#     registers are row g's, e13 / o13 row g+8's, in the columns LOGICAL_COLUMN gives.
REGISTER_ELEMENTS = {"e02": (0, 4), "e13": (2, 6), "o02": (1, 5), "o13": (3, 7)}  # per lane
CHUNK_REGISTERS = (("e02", "e13"), ("o02", "o13"))  # chunk 2s, 2s+1: word 0's, then word 1's
FRAGMENT_REGISTERS = ("e02", "e13", "o02", "o13")  # register-A fragment order of a k16 step


def _chunk_logical_columns() -> tuple[int, ...]:
    """LOGICAL_COLUMN[e] for the 16 elements of a scale block, from the chunk layout."""
    column = {}
    for chunk, registers in enumerate(CHUNK_REGISTERS):
        for word in range(2):
            for slot, register in enumerate(registers):
                for lane, element in enumerate(REGISTER_ELEMENTS[register]):
                    column[8 * word + element] = 8 * chunk + 4 * word + 2 * slot + lane
    return tuple(column[e] for e in range(16))


LOGICAL_COLUMN = _chunk_logical_columns()


def a_word_selector(t: int) -> int:
    """prmt selector building lane t's word [g.p, g8.p, g.p+2, g8.p+2] (p = t % 2) from the
    4-byte halves of rows g (bytes 0-3) and g+8 (bytes 4-7)."""
    p = t % 2
    return ((6 + p) << 12) | ((2 + p) << 8) | ((4 + p) << 4) | p


def _place_word_ptx(word: str, destinations: dict) -> list[str]:
    """PTX placing the 8 codes of `word` into destinations["e02"] .. ["o13"] (v * 2^-14, see
    above); scratch registers x, o, a, b; the kept-bit mask in `lanes`."""
    return [
        f"and.b32 x, {word}, 0x0F0F0F0F;",
        f"and.b32 o, {word}, 0xF0F0F0F0;",
        "mul.lo.u32 a, x, 4096;",
        "mul.lo.u32 b, x, 512;",
        f"lop3.b32 {destinations['e02']}, a, b, lanes, 0xA8;",
        "mul.lo.u32 a, x, 16;",
        "mul.lo.u32 b, x, 2;",
        f"lop3.b32 {destinations['e13']}, a, b, lanes, 0xA8;",
        "mul.lo.u32 a, o, 256;",
        "mul.lo.u32 b, o, 32;",
        f"lop3.b32 {destinations['o02']}, a, b, lanes, 0xA8;",
        "shr.b32 b, o, 3;",
        f"lop3.b32 {destinations['o13']}, o, b, lanes, 0xA8;",
    ]


def _decode_blocks_asm(num_units: int, mode: str = "chunks") -> str:
    """PTX decoding `num_units` units. All loads are issued first and all stores last, so
    the units' integer work interleaves instead of waiting on each load.

    mode "chunks" (unit = one scale block of one row, into shared memory): operands per
    unit u: $(4u) packed source (8 bytes), $(4u+1) scale byte, $(4u+2) / $(4u+3) the
    16-byte destination chunks (CHUNK_REGISTERS).
    mode "registers" (unit = rows g and g+8 of a 64-wide k-tile, register-A mode): outputs
    $(16u + 4s + i) = FRAGMENT_REGISTERS[i] of k16 step s; inputs after the 16 * num_units
    outputs, per unit: row g packed + 4 (t // 2), row g+8 packed + 4 (t // 2), the
    a_word_selector, row g's 4 scale bytes, row g+8's (aligned).
    """
    registers = mode == "registers"
    first_input = 16 * num_units if registers else 0
    per_unit = 5 if registers else 4
    lines = [
        "{",
        ".reg .b32 x, o, a, b, lanes, sc;",
        ".reg .b16 slo, shi;",
        "mov.b32 lanes, 0x8E008E00;",
    ]
    for u in range(num_units):
        if registers:
            lines.append(f".reg .b32 g{u}_<4>, h{u}_<4>, w{u}, sg{u}, sh{u}, S{u}_<8>;")
            lines += [f".reg .b32 r{u}_{s}_<4>;" for s in range(4)]
        else:
            lines.append(f".reg .b32 w{u}_<2>, s{u}, S{u}, r{u}_0_<4>, r{u}_1_<4>;")
    for u in range(num_units):  # loads
        src = first_input + per_unit * u
        if registers:
            for s in range(4):
                lines.append(f"ld.shared.u32 g{u}_{s}, [${src} + {8 * s}];")
                lines.append(f"ld.shared.u32 h{u}_{s}, [${src + 1} + {8 * s}];")
            lines.append(f"ld.shared.u32 sg{u}, [${src + 3}];")
            lines.append(f"ld.shared.u32 sh{u}, [${src + 4}];")
        else:
            lines.append(f"ld.shared.v2.b32 {{w{u}_0, w{u}_1}}, [${src}];")
            lines.append(f"ld.shared.u8 s{u}, [${src + 1}];")
    for u in range(num_units):  # scales: fp16x2 (s, s) per row and block
        if registers:
            for row, scales in enumerate((f"sg{u}", f"sh{u}")):
                for half, selector in ((0, "0x1100"), (1, "0x3322")):
                    lines += [
                        f"prmt.b32 sc, {scales}, 0, {selector};",
                        "mov.b32 {slo, shi}, sc;",
                        f"cvt.rn.f16x2.e4m3x2 S{u}_{4 * row + 2 * half}, slo;",
                        f"cvt.rn.f16x2.e4m3x2 S{u}_{4 * row + 2 * half + 1}, shi;",
                    ]
        else:
            lines += [f"mul.lo.u32 sc, s{u}, 257;", "mov.b32 {slo, shi}, sc;", f"cvt.rn.f16x2.e4m3x2 S{u}, slo;"]
    for u in range(num_units):  # bit placement and scaling
        if registers:
            for s in range(4):
                lines.append(f"prmt.b32 w{u}, g{u}_{s}, h{u}_{s}, ${first_input + per_unit * u + 2};")
                destinations = {name: f"r{u}_{s}_{i}" for i, name in enumerate(FRAGMENT_REGISTERS)}
                lines += _place_word_ptx(f"w{u}", destinations)
                for name, reg in destinations.items():
                    row = 0 if name in ("e02", "o02") else 1  # word bytes 0, 2: row g; 1, 3: g+8
                    lines.append(f"mul.rn.f16x2 {reg}, {reg}, S{u}_{4 * row + s};")
        else:
            for word in range(2):
                destinations = {
                    name: f"r{u}_{chunk}_{2 * word + slot}"
                    for chunk, names in enumerate(CHUNK_REGISTERS)
                    for slot, name in enumerate(names)
                }
                lines += _place_word_ptx(f"w{u}_{word}", destinations)
                for reg in destinations.values():
                    lines.append(f"mul.rn.f16x2 {reg}, {reg}, S{u};")
    for u in range(num_units):  # stores / outputs
        if registers:
            lines += [f"mov.b32 ${16 * u + 4 * s + i}, r{u}_{s}_{i};" for s in range(4) for i in range(4)]
        else:
            for chunk in range(2):
                regs = ", ".join(f"r{u}_{chunk}_{i}" for i in range(4))
                lines.append(f"st.shared.v4.b32 [${4 * u + 2 + chunk}], {{{regs}}};")
    lines.append("}")
    return "\n\t".join(lines)


@dsl_user_op
def decode_scale_blocks(addresses, *, loc=None, ip=None):
    """Decode scale blocks into shared memory; `addresses` lists (packed, scale, dst_lo,
    dst_hi) smem addresses per block: 16 packed e2m1 values times their e4m3 scale -> two
    16-byte fp16 chunks in the K permutation (CHUNK_REGISTERS)."""
    operands = [cutlass.Int32(x).ir_value(loc=loc, ip=ip) for block in addresses for x in block]
    _inline_asm(
        None,
        operands,
        _decode_blocks_asm(len(addresses), "chunks"),
        ",".join(["r"] * len(operands)) + ",~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def decode_scale_blocks_to_registers(units, *, loc=None, ip=None):
    """Decode a lane's share of row pairs (g, g+8) of a k-tile into registers; `units` lists
    (row g packed + 4 (t // 2), row g+8 packed + 4 (t // 2), a_word_selector(t), row g's
    scales, row g+8's) per row pair. Returns, per unit and k16 step, the 4 Int32 fragment
    registers (FRAGMENT_REGISTERS order)."""
    operands = [cutlass.Int32(x).ir_value(loc=loc, ip=ip) for unit in units for x in unit]
    num_outputs = 16 * len(units)
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Int32.mlir_type] * num_outputs),
        operands,
        _decode_blocks_asm(len(units), "registers"),
        ",".join(["=r"] * num_outputs + ["r"] * len(operands)) + ",~{memory}",
        loc=loc,
        ip=ip,
    )
    registers = [llvm.extractvalue(cutlass.Int32.mlir_type, result, [i], loc=loc, ip=ip) for i in range(num_outputs)]
    return [[registers[16 * u + 4 * s : 16 * u + 4 * s + 4] for s in range(4)] for u in range(len(units))]


@dsl_user_op
def pack_f16x8(registers, *, loc=None, ip=None):
    """Four Int32 registers (fp16x2 each) -> vector<8 x f16> in register order."""
    vec_i32 = vector.from_elements(
        ir.VectorType.get([4], cutlass.Int32.mlir_type, loc=loc), list(registers), loc=loc, ip=ip
    )
    return llvm.bitcast(ir.VectorType.get([8], cutlass.Float16.mlir_type, loc=loc), vec_i32, loc=loc, ip=ip)


# Host mirrors of the device arithmetic (tests compare them with independent decodes)
def emulate_word_registers(word: int) -> dict:
    """Mirror of _place_word_ptx: register name -> its 32-bit pattern (two fp16 lanes)."""
    mask32 = 0xFFFFFFFF
    x = word & 0x0F0F0F0F
    o = word & 0xF0F0F0F0
    lanes = 0x8E008E00
    pairs = {
        "e02": ((x * 4096) & mask32, (x * 512) & mask32),
        "e13": ((x * 16) & mask32, (x * 2) & mask32),
        "o02": ((o * 256) & mask32, (o * 32) & mask32),
        "o13": (o, o >> 3),
    }
    return {name: (a | b) & lanes for name, (a, b) in pairs.items()}


def emulate_decode_word(word: int, scale_byte: int):
    """Mirror of the decode of one packed word: 8 e2m1 codes -> 8 float16 (numpy), put back
    in element order through REGISTER_ELEMENTS.

    Returns (placed, scaled): the fp16 values after the bit placement (v * 2^-14) and after
    the multiply by the block's scale (v * s * 2^-14), in element order.
    """
    import numpy as np

    placed = np.zeros(8, dtype=np.float16)
    for name, bits in emulate_word_registers(word).items():
        lanes = np.array([bits & 0xFFFF, bits >> 16], dtype=np.uint16).view(np.float16)
        for lane, element in enumerate(REGISTER_ELEMENTS[name]):
            placed[element] = lanes[lane]
    scale = np.float16(_e4m3_value(scale_byte))
    return placed, (placed * scale).astype(np.float16)


def _e4m3_value(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def scale_byte_offset(row: int, block: int, k_tile: int, rest_k: int) -> int:
    """Byte offset in a reordered scale tensor of (row, 16-element block of k-tile k_tile),
    computed as the kernel does: 512-byte atom of (row // 128, k_tile), then the in-atom
    offset used by decode_stage."""
    atom = (row // SF_ATOM_ROWS) * rest_k + k_tile
    return atom * SF_ATOM_BYTES + (row % 32) * 16 + ((row % SF_ATOM_ROWS) // 32) * 4 + block


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


def tile_scale_byte_offset(tile_start: int, row: int, block: int, k_tile: int, rest_k: int) -> int:
    """Byte offset in a reordered scale tensor of the scale the kernel reads for row `row` of
    the tile starting at row `tile_start` (a multiple of 128), 16-element block `block` of
    k-tile `k_tile`: load_raw_stage copies atom (tile_start // 128 + slot, k_tile) into atom
    slot `slot` of the stage, decode_stage reads stage_scale_offset."""
    in_stage = stage_scale_offset(row, block)
    slot, in_atom = divmod(in_stage, SF_ATOM_BYTES)
    return ((tile_start // SF_ATOM_ROWS + slot) * rest_k + k_tile) * SF_ATOM_BYTES + in_atom


def swizzled_chunk_offset(row: int, chunk: int) -> int:
    """Byte offset of 16-byte chunk `chunk` of fp16 row `row` in the 128-byte-swizzled tile."""
    return row * 128 + ((chunk ^ (row % 8)) * 16)


# =============================================================================
# Kernel
# =============================================================================
def make_tiled_mma(config: HopperGemmConfig):
    """The kernel's fp16 wgmma (fp32 accumulators): one warpgroup per 64 rows, A from
    registers, B from shared memory, both K-major."""
    return sm90_utils.make_trivial_tiled_mma(
        cutlass.Float16,
        cutlass.Float16,
        cute.nvgpu.warpgroup.OperandMajorMode.K,
        cute.nvgpu.warpgroup.OperandMajorMode.K,
        cutlass.Float32,
        (config.tile_m // 64, 1, 1),
        tiler_mn=(64, config.tile_n),
        a_source=cute.nvgpu.warpgroup.OperandSource.RMEM,
    )


class Sm90Nvfp4GroupedGemm:
    """Grouped NVFP4 GEMM on sm_90a: cp.async -> decode to fp16 (B into shared memory, A into
    registers) -> wgmma."""

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
        """Register-A mode: lane (g, t) of warp w in warpgroup v decodes its share of rows
        64 v + 16 w + g and + 8 (4-byte half t // 2 of every scale block, the bytes
        a_word_selector(t) picks) into the wgmma A fragment (K permutation above)."""
        raw_stage_base = raw_base + raw_stage * self.raw_stage_bytes
        lane = tidx % 32
        row = (tidx // 32) * 16 + lane // 4
        t = lane % 4
        half_offset = (t // 2) * 4
        # a_word_selector(t) depends on t % 2 only, by one step per byte selector
        selector = a_word_selector(0) + (a_word_selector(1) - a_word_selector(0)) * (t % 2)
        rows = (row, row + 8)
        unit = (
            *(raw_stage_base + r * self.raw_row_bytes + half_offset for r in rows),
            selector,
            *(stage_scale_offset(r, 0, base=raw_stage_base + self.raw_sfa_offset) for r in rows),
        )
        steps = decode_scale_blocks_to_registers([unit])[0]
        # k16 step s: registers (row g, cols 2t..) (row g+8, 2t..) (g, 2t+8..) (g+8, 2t+8..)
        for step in cutlass.range_constexpr(self.tile_k // 16):
            step_frag = a_frag[(None, 0, step)]
            values = pack_f16x8(steps[step])
            step_frag.store(cute.TensorSSA(values, step_frag.shape, cutlass.Float16))

    def summing_rank(self, warp_group_idx):
        """Split-K: the cluster rank that sums and stores the rows of warpgroup
        `warp_group_idx` (plain Python: traced inline), so that the two epilogues run in
        parallel. Rank 0 summing and storing the whole tile: slower, removed;
        docs/EXPERIMENTS.md."""
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
        halve the epilogue's conversions, predicates and stores (the epilogue was 12% of shape
        2's warp stall samples with one 16-bit store per value)."""
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

    @cute.jit
    def reduce_split_k(self, tidx, warp_group_idx, reduction_base, accumulators):
        """Split-K: the other rank's accumulators of a warpgroup's rows are added into those
        of the summing rank (summing_rank). Each thread's fragment goes to the summing rank's
        shared memory in fragment order (its thread tidx has the same fragment layout), 16
        bytes per store, consecutive threads on consecutive 16 bytes."""
        num_vectors = cute.size(accumulators) // 4
        k_rank = cute.arch.block_idx_in_cluster()
        summing_rank = self.summing_rank(warp_group_idx)
        # one rank receives from the warpgroups it sums: warpgroup w uses slot w // split_k
        # of the buffer, its 128 threads side by side
        slot_thread = (warp_group_idx // self.config.split_k) * 128 * num_vectors + tidx % 128
        # every thread of the cluster is past its main loop: the receiving buffers are free
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if k_rank != summing_rank:
            for j in cutlass.range_constexpr(num_vectors):
                store_f32x4_to_rank(
                    reduction_base + (j * 128 + slot_thread) * 16,
                    [accumulators[4 * j + e] for e in range(4)],
                    summing_rank,
                )
        # release (the senders' stores) / acquire (the summing rank's loads)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if k_rank == summing_rank:
            for j in cutlass.range_constexpr(num_vectors):
                partial = load_f32x4(reduction_base + (j * 128 + slot_thread) * 16)
                for e in cutlass.range_constexpr(4):
                    accumulators[4 * j + e] = accumulators[4 * j + e] + partial[e]

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
                self.reduce_split_k(tidx, warp_group_idx, head_base, accumulators)

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
                # Tried and removed: each warp copying exactly what its lanes decode (4-byte
                # cp.async for the scales), a warp sync here instead and 3 fp16 B stages.
                # Exact, but slower: H200 device µs, shapes 0-3, 215.9/121.9/55.8/26.3 vs
                # 208.1/118.0/52.7/25.2 (split-K: 209.2/137.2/48.9/24.8 vs
                # 199.3/131.1/46.8/23.8).
                # Also tried and removed (commit ea7d79a), exact on the H200 but no faster:
                # one barrier per k-tile (wgmma k issued right after it, then the decode
                # of k + 1; the wait for wgmma k before the A decode frees the B stage):
                # 205.9/117.7/52.6/25.5 unsplit, 202.4/132.6/47.6/23.9 split-K, vs
                # 207.2/117.9/53.0/24.8 and 199.7/131.4/46.7/23.9; on top, one wgmma
                # commit group per k16 step with the A decode of step s waiting only for
                # step s: 210.6/122.5/53.6/25.2 unsplit. Nsight Compute (shape 2 split-K)
                # finds no saturated unit: issue slots 43%, ALU 34%, L1/shared 60%, 3.4
                # warps per scheduler of which 1.0 eligible; warp stalls spread over
                # fixed-latency dependencies 19%, barrier 11%, math pipe 10%, shared and
                # global scoreboards 9% each.
                cute.arch.sync_threads()
                raw_stage = k_tile % self.raw_stages
                self.decode_stage(tidx, raw_base, raw_stage, sB_base, mma_stage)
                # ptxas emits this as MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S (9% of shape 2's
                # stall samples in Nsight Compute); issuing the prefetch after it instead of
                # first measured slower on the H200: 217.8/131.2/59.3/29.4 vs
                # 207.5/129.2/54.6/28.1 µs device time, shapes 0-3.
                fence_proxy_async_shared_cta()
                # the one A fragment is still read by wgmma k_tile - 1. Two A fragments (decode
                # k + 1 while wgmma k reads the other): slower, removed; docs/EXPERIMENTS.md.
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
def _fake_ptr(dtype):
    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)


_compiled_cache: dict = {}
# Shared memory per SM of sm_90 GPUs (228 KB), for the compile below on a machine without one
SM90_SMEM_PER_SM = 233472


@contextlib.contextmanager
def _smem_per_sm_known_without_gpu():
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


def compile_gemm(num_groups: int, options: str | None = None, config: HopperGemmConfig = SM90_CONFIG):
    """Compile (cached) the sm_90a kernel; the key is everything baked in."""
    key = (num_groups, config, options)
    if key not in _compiled_cache:
        kernel = Sm90Nvfp4GroupedGemm(config, num_groups)
        with _smem_per_sm_known_without_gpu():
            _compiled_cache[key] = cute.compile(
                kernel,
                _fake_ptr(cutlass.Int64),
                _fake_ptr(cutlass.Int32),
                _fake_ptr(cutlass.Int32),
                cutlass.Int32(1),
                _fake_ptr(cutlass.Int32),
                cutlass.Int32(1),
                _fake_ptr(cutlass.Float32),
                _fake_ptr(cutlass.Int32),
                cuda.CUstream(0),
                **({"options": options} if options else {}),
            )
    return _compiled_cache[key]


def _compile_split_k(num_groups: int, options: str | None = None):
    return compile_gemm(num_groups, options, config=SPLIT_K_CONFIG)


def _compile_stream_k(num_groups: int, options: str | None = None):
    return compile_gemm(num_groups, options, config=STREAM_K_CONFIG)


def compile_targets() -> list[tuple[str, str, Callable[[int, str | None], Any]]]:
    """Kernels of this backend for the build report: (kernel name, arch, compile(G, options)):
    the default config, split-K over 2 CTAs and stream-K."""
    return [
        ("sm90_nvfp4_gemm", SM90_CONFIG.arch, compile_gemm),
        ("sm90_nvfp4_gemm_splitk2", SPLIT_K_CONFIG.arch, _compile_split_k),
        ("sm90_nvfp4_gemm_streamk", STREAM_K_CONFIG.arch, _compile_stream_k),
    ]


# =============================================================================
# Backend protocol (driven by submission.py's shared host runtime)
# =============================================================================
def _gmem_ptr(dtype, tensor: torch.Tensor):
    return make_ptr(dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)


# CTAs of the default config one SM holds: 127 registers x 256 threads and 70.7 KB of
# shared memory each (tests/test_hopper.py asserts <= 128 registers)
CTAS_PER_SM = 2
_NUM_SMS: dict = {}


# Tile order within the tile table (plan_tiles) does not move split-K: H200 device µs, shape 2
# / 3, full tiles first 46.3 / 23.4, half tiles first 46.3 / 23.5, alternating 46.2 / 23.4,
# vs 46.8 / 23.3 in plan_tiles' order.
def split_k_pays(num_tiles: int, num_sms: int, ctas_per_sm: int = CTAS_PER_SM) -> bool:
    """Whether split-K over 2 CTAs shortens an input set's schedule, in a wave model: whole
    tiles take ceil(T / slots) waves, half tiles ceil(2T / slots) waves half as long.

    Split when that is at most 0.8 of the unsplit time. On the benchmark shapes (352, 728,
    120, 128 tiles on 132 SMs) it picks split-K for shapes 0, 2 and 3 (1.5 vs 2, 0.5 vs 1,
    0.5 vs 1 waves) and not for shape 1 (3 vs 3). H200 device µs, shapes 0-3, split-K vs
    not: 201.7/136.3/48.8/24.2 vs 207.2/117.8/53.0/24.9 (bench/peers.py --configs)."""
    slots = num_sms * ctas_per_sm
    whole_waves = -(-num_tiles // slots)
    half_waves = -(-2 * num_tiles // slots) / 2
    return half_waves <= 0.8 * whole_waves


def _num_sms(device: torch.device) -> int:
    """SM count of `device`; 132 (H100/H200 SXM) for a CPU device (tables built in tests)."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


# =============================================================================
# Stream-K planning (host)
# =============================================================================
# Shortest segment (k-tiles): a cut closer than this to a tile's first or last k-tile moves
# there, so that no worker pays a segment's fixed cost (below) for a sliver of work.
STREAM_K_MIN_SEGMENT = 4
# What a segment costs beyond its k-tiles, in k-tiles of one CTA: its pipeline fill, the
# tile lookup and the workspace round trip. Fitted on the H200 to the two benchmark shapes
# with more tiles than CTA slots: stream-K vs the default, device µs, 184.7 vs 199.4 (shape
# 0: shares of 150 k-tiles, 2.0 segments per worker, against 3 waves of 56) and 128.9 vs
# 115.5 (shape 1: 92 k-tiles, 3.5 segments, against 3 waves of 32).
STREAM_K_SEGMENT_COST = 3


def plan_stream_k(tile_k_tiles, max_workers: int, min_segment: int = STREAM_K_MIN_SEGMENT):
    """Cut the k-tiles of all tiles, in table order, into one contiguous share per worker, the
    shares as equal as cuts on even k-tiles allow (every k-tile costs the same: the planned
    shares measured fastest that way, whatever rows a tile has).

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
    qualify (fewer: split-K fills one wave, and stream-K measured slower on both such
    benchmark shapes)."""
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
        "_host_staging", "counters", "num_slots", "num_workers", "segments", "work", "work_offsets",
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
        # a pinned staging copy owned by the plan and one non_blocking copy, as for the tables
        # (a pageable copy would wait for the stream's earlier work: a miss would stall it)
        host = torch.tensor(flat, dtype=torch.int32)
        if device.type == "cuda":
            host = host.pin_memory()
        self._host_staging = host
        self.work = torch.empty_like(host, device=device)
        self.work.copy_(host, non_blocking=True)
        self.workspace = torch.empty(
            max(self.num_slots, 1) * config.tile_m * config.tile_n, dtype=torch.float32, device=device
        )
        self.counters = torch.zeros(max(len(tile_k_tiles), 1), dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.work, self.workspace, self.counters))

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for buffer in (self.work, self.workspace, self.counters):
            buffer.record_stream(stream)


class Sm90Plan:
    """The sm_90 backend's part of a plan: the kernel config its size set runs and, for
    stream-K, the StreamKPlan (whose scratch every input set of the plan shares)."""

    __slots__ = ("config", "stream_k")

    def __init__(self, config: HopperGemmConfig, stream_k: StreamKPlan | None = None):
        self.config = config
        self.stream_k = stream_k

    @property
    def nbytes(self) -> int:
        return self.stream_k.nbytes if self.stream_k is not None else 0

    @property
    def shared_scratch(self) -> bool:
        return self.stream_k is not None

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        if self.stream_k is not None and self.stream_k.work.device.type == "cuda":
            self.stream_k.record_stream(stream)


class Sm90Backend:
    """Backend protocol implementation for Hopper (sm_90a), driven by submission.py's host
    runtime: no descriptors (the kernel reads the pointer table), so a plan is the config its
    size set runs and, for stream-K, its schedule and scratch.

    auto_schedule: per size set, stream-K where stream_k_pays, else split-K over a 2-CTA
    cluster where split_k_pays, else whole tiles; otherwise `config` runs every input set as
    given."""

    name = "sm90"

    def __init__(self, config: HopperGemmConfig = SM90_CONFIG, auto_schedule: bool = False):
        config.check()
        self.config = config
        self.auto_schedule = auto_schedule and config.split_k == 1 and not config.stream_k
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n

    @property
    def plan_key(self):
        """What, besides the device and the sizes, a plan of this backend depends on."""
        return (self.name, self.config, self.auto_schedule)

    def config_for(self, plan) -> HopperGemmConfig:
        """The config this size set runs (same tile shape: one tile table serves all)."""
        if not self.auto_schedule:
            return self.config
        num_sms = _num_sms(plan.device)
        if stream_k_pays(tile_k_tiles_of(plan, self.config), num_sms):
            return dataclasses.replace(self.config, stream_k=True)
        if split_k_pays(plan.num_tiles, num_sms):
            return dataclasses.replace(self.config, split_k=2)
        return self.config

    def compile(self, num_groups: int, config: HopperGemmConfig | None = None):
        return compile_gemm(num_groups, config=config or self.config)

    def can_implement(self, problem_sizes) -> None:
        can_implement(problem_sizes, self.config)

    def tile_shape(self, problem_sizes) -> tuple[int, int]:
        return self.tile_m, self.tile_n

    def prepare(self, plan) -> Sm90Plan:
        """Pick the size set's config, compile its kernel (cached) for its group count and,
        for stream-K, plan the workers' shares and allocate their buffers."""
        config = self.config_for(plan)
        self.compile(plan.num_groups, config)
        stream_k = None
        if config.stream_k and plan.num_tiles > 0:
            stream_k = StreamKPlan(plan, config, _num_sms(plan.device) * CTAS_PER_SM)
        return Sm90Plan(config, stream_k)

    def launch_args(self, plan, binding, stream: cuda.CUstream):
        """(compiled GEMM, its arguments) for this input set on `stream`."""
        backend_plan = plan.backend_plan
        stream_k = backend_plan.stream_k
        if stream_k is None:
            # not read by the kernel: any valid pointers
            work, num_workers = plan.tiles, 0
            workspace, counters = plan.sizes, plan.sizes
        else:
            work, num_workers = stream_k.work, stream_k.num_workers
            workspace, counters = stream_k.workspace, stream_k.counters
        return self.compile(plan.num_groups, backend_plan.config), (
            _gmem_ptr(cutlass.Int64, binding.ptrs),
            _gmem_ptr(cutlass.Int32, plan.sizes),
            _gmem_ptr(cutlass.Int32, plan.tiles),
            cutlass.Int32(plan.num_tiles),
            _gmem_ptr(cutlass.Int32, work),
            cutlass.Int32(num_workers),
            _gmem_ptr(cutlass.Float32, workspace),
            _gmem_ptr(cutlass.Int32, counters),
            stream,
        )


def make_backend(config: HopperGemmConfig | None = None) -> Sm90Backend:
    """The backend custom_kernel uses (config None: SM90_CONFIG, split-K where split_k_pays),
    or one running `config` as given for every input set."""
    if config is None:
        return Sm90Backend(SM90_CONFIG, auto_schedule=True)
    return Sm90Backend(config)
