"""NVFP4 block-scaled grouped GEMM for Hopper (sm_90a), the nvfp4_group_gemm library's sm_90 backend.

Computes, for every group i with M_i > 0,

    C_i[M_i, N_i] (fp16) = (A_i * SFA_i) @ (B_i * SFB_i)^T

with A_i, B_i packed float4 e2m1 (low nibble first) and one float8 e4m3 scale per 16
elements along K, read from the "reordered" (cuBLAS 32x4x4 blocked) scale tensors.

Hopper has no FP4 tensor cores. Every e2m1 value (2 significant bits) times an e4m3 scale
(at most 4 significant bits, 2^-9 .. 448) is exactly representable in fp16 (11 bits, normal
from 2^-14 to 65504): |v * s| lies in [2^-10, 2688]. The kernels therefore decode both
operands into fp16 and run 16-bit wgmma with fp32 accumulation; the sums are the exact
block-scaled products, accumulated in fp32.

Two kernels (backend.SM90_KERNELS; NVFP4_SM90_KERNEL picks custom_kernel's):

swap_ab (the default; swap_ab.py). Two launches per call:

    pre-pass:  A (packed) x SFA --decode--> X (fp16, every group's M x K in swizzled k-tile
               slabs, plan scratch)
    GEMM:      B packed + SFB --cp.async--> weight stages (``weight_stages`` deep)
               X: a tile's rows of a k-tile --one bulk copy, mbarrier--> token stages
               B --decode--> register A fragments (one warpgroup per 64 weight rows)
               X stage --wgmma (tokens as N)--> fp32 --stmatrix .trans--> C rows in the free
               token stages --16-byte stores--> C[token, n] fp16 (split-K: 2-byte stores)

Each activation is decoded once per call (not once per weight tile) and M pads to the token
tile, not to 128-row wgmma blocks. Token tiles are 112, 128 or 192 tokens, or variable: each
group's M in near-equal tiles of 64, 128, 192 or 256 tokens (multiples of 64), the kernel
compiled with one main loop per size and each tile row naming its own. The config is chosen
per size set (schedules.choose_swap_ab_config): split-K over a 2-CTA cluster where the split
CTAs still fit one per SM, else whichever of 128-token, 192-token, variable and (where they
make one round) 112-token tiles swap_ab_time_model (a per-k-tile cost, tiles dispatched in
order to the SM that frees first) puts first; 128-token tiles that make one round run one CTA
per SM. Variable and one-round tiles are launched as the pre-pass's programmatic dependent
(their first weight copies overlap its end). Without split-K the main loop is unrolled by the
stage count, so that its stage indices and shared-memory addresses are constants; one round of
112- or 128-token tiles runs 128-wide k-tiles (two 64-wide halves per stage) where every K %
512 == 0 (schedules.with_wide_k_tiles). Those configs also chain the calls
(SwapAbConfig.chain_calls): the pre-pass is itself launched as the dependent of the kernel
before it (back to back, the previous call's GEMM, which triggers at its start), reads its
tables, then waits for that kernel before anything else; such calls are launched directly,
not replayed as graphs (NVFP4_SM90_CHAIN_CALLS=0: unchained, graph replay).

in_gemm_decode (kernel.py): no activation scratch. Per CTA one output tile (group, tile_m,
tile_n) of 128x128 or 128x256; A decoded into the register fragment, B into swizzled shared
memory, both inside the GEMM. Its config is chosen per size set by schedules.choose_config:
input sets with more tiles than CTA slots and long K run stream-K (stream_k_pays: one CTA per
slot, equal shares of all k-tiles, partial tiles summed through a global workspace); input
sets whose tiles fill the CTA slots badly otherwise run split-K over a 2-CTA cluster
(split_k_pays), with 128x256 tiles where N % 256 == 0 and those CTAs fit one wave
(wide_split_k_fits), else with 128x128 tiles; the rest run whole 128x128 tiles.

    global --cp.async--> raw stages (packed fp4 + scale bytes, ``raw_stages`` deep)
           --decode (all threads)--> B: fp16 stages in the swizzled K-major wgmma layout (2 deep)
                                     A: each warpgroup's own rows, straight into the register
                                        A fragment (K permuted per scale block identically
                                        for A and B, see ptx._decode_blocks_asm)
           --wgmma (one warpgroup per 64 rows)--> fp32 accumulators --> predicated fp16 stores

In both, the decode places two codes per register with 7 integer instructions per 8 codes
(see ptx._place_word_ptx), and no unit is saturated: the warps mostly wait on instruction
latencies (Nsight Compute: docs/EXPERIMENTS.md, E55 for in_gemm_decode, and for swap-AB
"Where the swap-AB time goes").

Why cp.async and not TMA for the packed operands: the per-group base pointers arrive at run
time in the pointer table, so TMA would need one descriptor per group written on the device
(an init kernel plus tensormap fences, as the sm_100 backend does). The packed operands are a
quarter of the decoded bytes, so plain 16-byte cp.async from the table's pointers costs few
issue slots, needs no descriptors, and zero-fills rows past M without reading them. The
swap-AB GEMM's fp16 token rows need no descriptor either: the pre-pass lays them out so that
a tile's rows of a k-tile are contiguous, and a plain bulk copy (cp.async.bulk) brings them.

Constraints (checked by the leaderboard file's validate_inputs and by ``can_implement`` here):
  * 1 <= G <= 64, L == 1
  * M >= 0 (groups with M == 0 get no tiles), N a multiple of 128, K a multiple of 256
  * a/b/c row-major with unit stride along K (a, b) or N (c); reordered scale tensors in the
    official permuted layout (a contiguous (rest_mn, rest_k, 32, 4, 4) buffer)

Modules: config (SwapAbConfig, HopperGemmConfig, the configs, can_implement), ptx (inline-PTX
helpers and the decode), swap_ab (Sm90DecodeActivations, Sm90SwapAbGemm, their compilation),
kernel (Sm90Nvfp4GroupedGemm, compile_gemm), schedules (the automatic choices, split-K,
stream-K), backend (Sm90Backend, make_backend, ActivationBuffer). Options measured are listed in
docs/EXPERIMENTS.md with their figures, each under an id (E1, E2, ...) that a one-line note at its
decision point here names: ``(EXPERIMENTS E19)``.

Standalone use of one config on an H200: ``nvfp4_group_gemm.run_with_backend(data, make_backend(config))``.
"""

from .backend import (
    SM90_KERNELS,
    ActivationBuffer,
    Sm90Backend,
    Sm90Plan,
    current_num_sms,
    default_chain_calls,
    default_kernel,
    make_backend,
)
from .config import (
    CONFIGS,
    CTAS_PER_SM,
    MAX_GROUPS,
    SEGMENT_FIELDS,
    SF_ATOM_BYTES,
    SF_ATOM_ROWS,
    SF_VEC_SIZE,
    SM90_CONFIG,
    SPLIT_K_CONFIG,
    STREAM_K_CONFIG,
    SWAP_AB_CONFIG,
    SWAP_AB_HALF_K,
    SWAP_AB_ONE_ROUND_CONFIG,
    SWAP_AB_ONE_ROUND_K128_CONFIG,
    SWAP_AB_SPLIT_K_CONFIG,
    SWAP_AB_T112_CONFIG,
    SWAP_AB_T112_K128_CONFIG,
    SWAP_AB_T192_CONFIG,
    SWAP_AB_VARIABLE_CONFIG,
    TILE_M,
    WIDE_SPLIT_K_CONFIG,
    HopperGemmConfig,
    SwapAbConfig,
    can_implement,
    config_name,
    config_named,
)
from .kernel import (
    Sm90Nvfp4GroupedGemm,
    compile_gemm,
    make_tiled_mma,
    stage_scale_offset,
)
from .kernel import compile_targets as in_gemm_decode_compile_targets
from .layer import layer_compile_targets
from .moe import (
    ACTIVATION_SCALE_LAYOUTS,
    Sm90MoeDecodeActivations,
    Sm90MoeSwapAbGemm,
    compile_moe_decode,
    compile_moe_gemm,
    max_moe_tiles,
    moe_compile_targets,
    slab_rows,
)
from .ptx import (
    CHUNK_REGISTERS,
    FRAGMENT_REGISTERS,
    LOGICAL_COLUMN,
    REGISTER_ELEMENTS,
    a_word_selector,
)
from .schedules import (
    STREAM_K_MIN_SEGMENT,
    STREAM_K_SEGMENT_COST,
    SWAP_AB_CANDIDATES,
    SWAP_AB_K_TILE_FIXED_US,
    SWAP_AB_K_TILE_US_PER_TOKEN,
    StreamKPlan,
    choose_config,
    choose_swap_ab_config,
    plan_stream_k,
    split_k_pays,
    stream_k_pays,
    swap_ab_k_tile_us,
    swap_ab_tile_costs,
    swap_ab_tiles,
    swap_ab_time_model,
    tile_k_tiles,
    tile_k_tiles_of,
    variable_token_tiles,
    wide_split_k_fits,
    with_wide_k_tiles,
)
from .swap_ab import (
    Sm90DecodeActivations,
    Sm90SwapAbGemm,
    compile_decode_activations,
    compile_swap_ab_gemm,
    swap_ab_compile_targets,
)


def compile_targets():
    """Kernels of this backend for the build report: (kernel name, arch, compile(G, options)),
    the swap-AB kernels first."""
    return (swap_ab_compile_targets() + moe_compile_targets() + layer_compile_targets()
            + in_gemm_decode_compile_targets())


__all__ = [
    "ACTIVATION_SCALE_LAYOUTS",
    "CHUNK_REGISTERS",
    "CONFIGS",
    "CTAS_PER_SM",
    "FRAGMENT_REGISTERS",
    "LOGICAL_COLUMN",
    "MAX_GROUPS",
    "REGISTER_ELEMENTS",
    "SEGMENT_FIELDS",
    "SF_ATOM_BYTES",
    "SF_ATOM_ROWS",
    "SF_VEC_SIZE",
    "SM90_CONFIG",
    "SM90_KERNELS",
    "SPLIT_K_CONFIG",
    "STREAM_K_CONFIG",
    "STREAM_K_MIN_SEGMENT",
    "STREAM_K_SEGMENT_COST",
    "SWAP_AB_CANDIDATES",
    "SWAP_AB_CONFIG",
    "SWAP_AB_HALF_K",
    "SWAP_AB_K_TILE_FIXED_US",
    "SWAP_AB_K_TILE_US_PER_TOKEN",
    "SWAP_AB_ONE_ROUND_CONFIG",
    "SWAP_AB_ONE_ROUND_K128_CONFIG",
    "SWAP_AB_SPLIT_K_CONFIG",
    "SWAP_AB_T112_CONFIG",
    "SWAP_AB_T112_K128_CONFIG",
    "SWAP_AB_T192_CONFIG",
    "SWAP_AB_VARIABLE_CONFIG",
    "TILE_M",
    "WIDE_SPLIT_K_CONFIG",
    "ActivationBuffer",
    "HopperGemmConfig",
    "Sm90Backend",
    "Sm90DecodeActivations",
    "Sm90MoeDecodeActivations",
    "Sm90MoeSwapAbGemm",
    "Sm90Nvfp4GroupedGemm",
    "Sm90Plan",
    "Sm90SwapAbGemm",
    "StreamKPlan",
    "SwapAbConfig",
    "a_word_selector",
    "can_implement",
    "choose_config",
    "choose_swap_ab_config",
    "compile_decode_activations",
    "compile_gemm",
    "compile_moe_decode",
    "compile_moe_gemm",
    "compile_swap_ab_gemm",
    "compile_targets",
    "config_name",
    "config_named",
    "current_num_sms",
    "default_chain_calls",
    "default_kernel",
    "make_backend",
    "make_tiled_mma",
    "max_moe_tiles",
    "moe_compile_targets",
    "plan_stream_k",
    "slab_rows",
    "split_k_pays",
    "stage_scale_offset",
    "stream_k_pays",
    "swap_ab_k_tile_us",
    "swap_ab_tile_costs",
    "swap_ab_tiles",
    "swap_ab_time_model",
    "tile_k_tiles",
    "tile_k_tiles_of",
    "variable_token_tiles",
    "wide_split_k_fits",
    "with_wide_k_tiles",
]
