"""What a compiled sm_90a kernel bakes in (HopperGemmConfig), the configs the backend runs,
and the problems it accepts (can_implement). Plain Python: no DSL import."""

from __future__ import annotations

import dataclasses

MAX_GROUPS = 64
SF_VEC_SIZE = 16
# Reordered scale tensors: one 512-byte atom holds 128 rows x 4 scale blocks (64 elements of K)
SF_ATOM_ROWS = 128
SF_ATOM_BYTES = 512
# Stream-K segment row: (tile, first k-tile, k-tile count, part, parts of the tile, first
# workspace slot of the tile)
SEGMENT_FIELDS = 6
# Rows per tile: two warpgroups of 64 (one m64 wgmma each).
# 256-row tiles (four warpgroups, B's decode shared by twice the rows): slower (EXPERIMENTS E37).
TILE_M = 128
# CTAs of a 128x128-tile config one SM holds: at most 128 registers x 256 threads and 70.7 KB
# of shared memory each (tests/test_hopper.py checks the builds' registers)
CTAS_PER_SM = 2


@dataclasses.dataclass(frozen=True)
class HopperGemmConfig:
    """Everything baked into the compiled sm_90a kernel."""

    # 128 or 256 (whole 128-row scale atoms). 256 takes 239 registers: one CTA per SM
    # (ctas_per_sm); the automatic choice runs it with split-K only (schedules.choose_config).
    # 128x64 tiles (two CTAs per SM for the G = 2 shapes): slower (EXPERIMENTS E36).
    tile_n: int = 128
    tile_k: int = 64  # one 128-byte swizzle atom of fp16 per row; 4 scale blocks
    # cp.async prefetch depth of packed data (9 KB per stage).
    # 4 stages: faster than 3 or 6 (EXPERIMENTS E44).
    # A row's packed bytes of one k-tile are 32 (one sector), so a warp's 16-byte cp.async
    # spans 16 rows and costs 16 shared-memory wavefronts where 4 would carry its 512 bytes.
    # 2 k-tiles per raw stage (64 contiguous bytes per row): slower (EXPERIMENTS E49).
    raw_stages: int = 4
    # Warp specialization (decoding warpgroups, wgmma-only warpgroups): slower (EXPERIMENTS E33).
    # A is decoded straight into the wgmma A fragment (register A; see decode_a_registers).
    # A decoded into shared memory like B: slower (EXPERIMENTS E35).
    # CTAs sharing one output tile along K (a cluster of split_k CTAs along grid x): 1, or 2
    # (each CTA runs half the k-tiles; the fp32 partial sums meet through DSMEM, see
    # reduce_split_k). The default backend picks 2 per input set (split_k_pays).
    # Split-K on shape 2: more warps per scheduler, faster (EXPERIMENTS E42).
    split_k: int = 1
    # True: stream-K. The grid is CTAS_PER_SM CTAs per SM ("workers", all resident at once);
    # the host cuts the input set's k-tiles, all tiles in table order, into one contiguous
    # share of equal weighted cost per worker (plan_stream_k): a worker runs the tail of one
    # tile, whole tiles, the head of the next. The parts of a tile shared by workers meet in
    # a global fp32 workspace: each part stores its sums there, and the last part to arrive
    # (a per-tile counter) adds all parts in k order and stores the tile. Fixes what tile
    # counts that are not a multiple of the CTA slots leave idle (shape 2: 144 full and 96
    # half split-K CTAs on 264 slots). Needs split_k = 1.
    # Shape 2: slower than split-K, SMs run equal shares at unequal speeds (EXPERIMENTS E43).
    stream_k: bool = False
    arch: str = "sm_90a"

    @property
    def tile_m(self) -> int:
        """Rows per tile: TILE_M."""
        return TILE_M

    @property
    def ctas_per_sm(self) -> int:
        """CTAs of this config one SM holds (registers bound it): CTAS_PER_SM with 128-column
        tiles, 1 with 256 (239 registers x 256 threads)."""
        return CTAS_PER_SM if self.tile_n == 128 else 1

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
# Split-K with 128x256 tiles (one CTA per SM): what the default backend runs where split-K
# pays and these CTAs fit one wave (schedules.wide_split_k_fits).
WIDE_SPLIT_K_CONFIG = dataclasses.replace(SM90_CONFIG, tile_n=256, split_k=2)


def can_implement(problem_sizes) -> None:
    """Raise ValueError naming group, field, value and rule if a problem is unsupported: what
    no config runs (every config takes N % 128 == 0, partial 128x256 tiles included)."""
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



# K of one decoded activation slab and of one half of a swap-AB k-tile
SWAP_AB_HALF_K = 64


@dataclasses.dataclass(frozen=True)
class SwapAbConfig:
    """Everything baked into the compiled swap-AB sm_90a kernel (swap_ab.Sm90SwapAbGemm): the
    weights (problem B, N rows) are wgmma's register A operand, decoded straight into
    fragments, one warpgroup per 64 weight rows; the tokens (problem A, M rows) are wgmma's
    N, read as fp16 rows that a pre-pass decoded once per call."""

    # Tokens per tile (wgmma N): a multiple of 16 up to 256. Accumulators take
    # tile_tokens / 2 registers per thread. The automatic choice runs 112, 128, 192 and variable
    # tiles (tile_tokens 256, below).
    # Fixed 64 (3 CTAs per SM) and 256 (one): slower on every shape (EXPERIMENTS E27, E29).
    tile_tokens: int = 128
    # Token stages (a k-tile's fp16 token rows, one bulk copy each, completing on the stage's
    # mbarrier); the token rows are copied stages - 2 k-tiles ahead (the stage of k-tile k - 1
    # may still be read by its wgmma when k-tile k + stages - 2 is issued).
    # 5 stages (with the cp.async token copies of then): slower (EXPERIMENTS E28).
    stages: int = 4
    # CTAs sharing one output tile along K (a cluster along grid x), as HopperGemmConfig
    split_k: int = 1
    # One register A fragment: the decode of k-tile k waits for wgmma k - 1.
    # Two (the decode of k + 1 beside wgmma k): no faster, twice (EXPERIMENTS E26, E4).
    # Weight stages (packed rows and scale atom of a k-tile, cp.async), apart from the token
    # stages: a weight stage is free once decoded, so the weights are copied weight_stages - 1
    # k-tiles ahead.
    # 3 ahead: faster than 2 with variable token tiles; 7: no faster (EXPERIMENTS E3).
    weight_stages: int = 4
    # Programmatic dependent launch after the pre-pass: the GEMM's CTAs start, and copy their
    # first weight stages, while the pre-pass finishes (griddepcontrol.wait before the first
    # token rows). With ctas_per_sm = 1 the launch asks for more than half an SM's shared
    # memory, so that the early CTAs spread one per SM.
    # With two CTAs per SM allowed, some SMs took two tiles, others none: slower (EXPERIMENTS E5, E6).
    pdl: bool = False
    # CTAs per SM the build is held to (ptxas's register bound: 65536 / (256 x this))
    ctas_per_sm: int = 2
    # Variable token tiles: each tile row carries its token count class (64, 128, 192 or 256
    # tokens, tile_tokens = 256), the kernel one main loop per class (wgmma N = the class)
    variable_tokens: bool = False
    # Calls chained by programmatic dependent launch: the pre-pass is launched as the dependent
    # of whatever kernel precedes it in the stream, and the GEMM lets its dependents start at
    # once, so that the next call's pre-pass is launched, and reads its tables, while this
    # GEMM finishes (griddepcontrol.wait before it reads anything else). The calls are launched
    # directly, not replayed as CUDA graphs: a graph launch waits for all earlier work.
    chain_calls: bool = False
    # 64-wide halves of K per k-tile (tile_k = 64 x k_halves): each half's weights a stage
    # part laid out as a 64-wide k-tile's, its token rows one bulk copy from its own slab. 2
    # halves the k-tiles, and with them the per-k-tile work that is not decode or wgmma
    # (barrier, copy issue, waits, wgmma fence and commit); needs K % (128 x stages) == 0 for
    # the unrolled main loop (SwapAbConfig.k_multiple)
    k_halves: int = 1
    # K any multiple of the k-tile (the MoE entry's K % 64 == 0, hopper.moe.moe_k_config): the
    # main loop not unrolled (stage indices at run time: any k-tile count), and split-K ranks
    # of uneven shares (the first (k-tiles % split_k) ranks one k-tile more; a rank may have
    # none). False: the kernels of K % k_multiple == 0, unchanged
    k_tail: bool = False
    arch: str = "sm_90a"

    # Weight rows per tile (wgmma M): two warpgroups of 64.
    # 256 rows (four warpgroups, one CTA per SM): slower (EXPERIMENTS E25).
    tile_weights = TILE_M

    @property
    def tile_k(self) -> int:
        """K per k-tile: 64 (one 128-byte swizzle row of fp16, 4 scale blocks) per half."""
        return SWAP_AB_HALF_K * self.k_halves

    @property
    def k_multiple(self) -> int:
        """What every group's K must be a multiple of: the k-tile times the stage count where
        the main loop is unrolled by it (256 with one half, 512 with two), times the split-K
        ranks (each rank's k-tiles a multiple of the stages); with k_tail, the k-tile."""
        if self.k_tail:
            return self.tile_k
        return max(256, self.tile_k * (self.stages * self.split_k if self.unrolled_main_loop else 1))

    @property
    def num_threads(self) -> int:
        return 128 * (self.tile_weights // 64)

    @property
    def weight_half_bytes(self) -> int:
        """Packed weight rows of one 64-wide half (32 bytes each) and their 512-byte scale atom."""
        return self.tile_weights * (SWAP_AB_HALF_K // 2) + SF_ATOM_BYTES

    @property
    def weight_stage_bytes(self) -> int:
        """The k-tile's halves, one after the other."""
        return self.k_halves * self.weight_half_bytes

    @property
    def unrolled_main_loop(self) -> bool:
        """The main loop unrolled by the stage count, so that every stage index is a constant:
        where weight and token stages are as many and the tile's k-tile count is a multiple of
        them (K % 256 == 0 gives a multiple of 4 k-tiles, K % (256 x split_k) a rank's; not
        with k_tail). Split-K unrolled on the 32-token configs, the MoE entry's decode configs,
        where a rank's k-tile took 16-25 % fewer instructions so (EXPERIMENTS E96); the
        per-size-set path's split-K config stays as measured."""
        return ((self.split_k == 1 or self.tile_tokens == 32) and self.stages == self.weight_stages
                and 4 % self.stages == 0 and not self.k_tail)

    @property
    def weights_ahead(self) -> int:
        """k-tiles the weight copies run ahead of the decode (a weight stage is free once
        decoded)."""
        return self.weight_stages - 1

    @property
    def tokens_ahead(self) -> int:
        """k-tiles the token copies run ahead of the wgmma (the stage of k-tile k - 1 may
        still be read by its wgmma when k-tile k + tokens_ahead is issued)."""
        return self.stages - 2

    @property
    def token_stage_bytes(self) -> int:
        """fp16 token rows of one k-tile (128 bytes each: one swizzle row)."""
        return self.tile_tokens * self.tile_k * 2

    def check(self) -> None:
        if self.tile_tokens % 16 or not 32 <= self.tile_tokens <= 256:
            raise ValueError(f"tile_tokens={self.tile_tokens}: must be a multiple of 16 in 32..256")
        if self.variable_tokens and (self.tile_tokens != 256 or self.split_k != 1 or self.ctas_per_sm != 1):
            raise ValueError("variable_tokens needs tile_tokens=256, split_k=1, ctas_per_sm=1")
        if self.stages < 3:
            raise ValueError(f"stages={self.stages}: must be >= 3")
        if self.weight_stages < 2:
            raise ValueError(f"weight_stages={self.weight_stages}: must be >= 2")
        if self.split_k not in (1, 2, 4):
            # K % 256 == 0 gives a multiple of 4 64-wide k-tiles
            raise ValueError(f"split_k={self.split_k}: must be 1, 2 or 4")
        if self.ctas_per_sm not in (1, 2, 3, 4):
            raise ValueError(f"ctas_per_sm={self.ctas_per_sm}: must be 1, 2, 3 or 4")
        if self.k_halves not in (1, 2):
            raise ValueError(f"k_halves={self.k_halves}: must be 1 or 2")
        if self.k_halves != 1 and (self.split_k != 1 or self.variable_tokens):
            raise ValueError("k_halves=2 needs split_k=1 and fixed token tiles")
        if self.chain_calls and not self.pdl:
            raise ValueError("chain_calls needs pdl (the GEMM launched as the pre-pass's dependent)")

    @property
    def tile_row_width(self) -> int:
        """int32 fields per tile row: (group, token tile, weight tile), plus the token class
        with variable token tiles (the token field then counts 64-token steps)."""
        return 4 if self.variable_tokens else 3

    @property
    def reduction_bytes(self) -> int:
        """Split-K: shared memory a summing rank receives (the fp32 sums of its one warpgroup
        from each of the split_k - 1 other ranks)."""
        return (self.split_k - 1) * 64 * self.tile_tokens * 4

    def launch_smem_bytes(self, storage_bytes: int) -> int:
        """Dynamic shared memory the GEMM launch asks for: its storage, or with pdl and one CTA
        per SM more than half of an SM's 228 KB."""
        if self.pdl and self.ctas_per_sm == 1:
            return max(storage_bytes, 115 * 1024)
        return storage_bytes

    @property
    def smem_bytes(self) -> int:
        """The stages and their token copies' mbarriers (8 bytes each), in a struct whose size
        is a multiple of its 1024-byte alignment (the token stages' swizzle atoms)."""
        stages_and_barriers = (
            self.weight_stages * self.weight_stage_bytes + self.stages * (self.token_stage_bytes + 8)
        )
        return -(-stages_and_barriers // 1024) * 1024


SWAP_AB_CONFIG = SwapAbConfig()
# Split-K over a 2-CTA cluster: what the default backend runs where the whole tiles would leave
# most SMs idle (schedules.choose_swap_ab_config), so at most one CTA per SM: built without the
# 2-CTA register bound (which spilled 16 bytes)
SWAP_AB_SPLIT_K_CONFIG = SwapAbConfig(split_k=2, ctas_per_sm=1)
# 192 tokens per tile (96 accumulator registers per thread: one CTA per SM): each weight decode
# serves 1.5x the tokens; what the default backend runs where its tile count makes up for the
# lost second CTA per SM (schedules.choose_swap_ab_config)
SWAP_AB_T192_CONFIG = SwapAbConfig(tile_tokens=192, ctas_per_sm=1)
# Variable token tiles (64, 128, 192 or 256 tokens per tile, each group's M in near-equal tiles;
# one CTA per SM): M pads least, and the larger tiles do the most work per weight decode; what
# the default backend runs where the time model puts it first (benchmark shapes 0 and 1)
SWAP_AB_VARIABLE_CONFIG = SwapAbConfig(tile_tokens=256, ctas_per_sm=1, variable_tokens=True, pdl=True,
                                       chain_calls=True)
# 128-token tiles where they are one round (no more tiles than SMs): one CTA per SM, launched as
# the pre-pass's programmatic dependent.
# 2 CTAs per SM with that launch: some SMs two tiles, others none: slower (EXPERIMENTS E5, E6).
SWAP_AB_ONE_ROUND_CONFIG = SwapAbConfig(ctas_per_sm=1, pdl=True, chain_calls=True)
# 112 tokens per tile, one round of one CTA per SM: where M in 112-token tiles pads less than in
# 128-token tiles and the tiles still number no more than the SMs (benchmark shape 2: M = 192 and
# 320 in 2 + 3 tiles of 112 instead of 2 + 3 of 128)
SWAP_AB_T112_CONFIG = SwapAbConfig(tile_tokens=112, ctas_per_sm=1, pdl=True, chain_calls=True)
# 32 and 64 tokens per tile, launched as the pre-pass's dependent: the MoE entry's tiles where
# groups hold few rows (decode): wgmma N and the token stages sized to them, and as many CTAs per
# SM as their registers allow (61 and 77 unbounded), for more weight bytes in flight per SM
SWAP_AB_T32_CONFIG = SwapAbConfig(tile_tokens=32, ctas_per_sm=4, pdl=True, chain_calls=True)
SWAP_AB_T64_CONFIG = SwapAbConfig(tile_tokens=64, ctas_per_sm=3, pdl=True, chain_calls=True)
# The 112-token and one-round 128-token configs with 128-wide k-tiles (two 64-wide halves)
SWAP_AB_T112_K128_CONFIG = dataclasses.replace(SWAP_AB_T112_CONFIG, k_halves=2)
SWAP_AB_ONE_ROUND_K128_CONFIG = dataclasses.replace(SWAP_AB_ONE_ROUND_CONFIG, k_halves=2)
# The 32-token config with 128-wide k-tiles (twice the weight bytes in flight per stage; its
# 75 registers hold it to three CTAs per SM)
SWAP_AB_T32_K128_CONFIG = dataclasses.replace(SWAP_AB_T32_CONFIG, k_halves=2, ctas_per_sm=3)
# The 32-token config split along K over a cluster of 2 or 4 CTAs: where a decode step's tiles
# would fill at most a quarter or a half of the CTA slots, 2 or 4 times the CTAs each stream a
# share of K, for more weight bytes in flight per SM
SWAP_AB_T32_SPLIT_K2_CONFIG = dataclasses.replace(SWAP_AB_T32_CONFIG, split_k=2)
SWAP_AB_T32_SPLIT_K4_CONFIG = dataclasses.replace(SWAP_AB_T32_CONFIG, split_k=4)


# The registry: every named config of the sm_90 backend. Build targets (sm90_<name>), bench
# columns, test ids and docs take their names from here; a variant is named by its nearest
# registered config and the fields that differ (config_name, config_named).
CONFIGS = {
    "in_gemm_decode": SM90_CONFIG,
    "in_gemm_decode_split_k": SPLIT_K_CONFIG,
    "in_gemm_decode_stream_k": STREAM_K_CONFIG,
    "in_gemm_decode_n256_split_k": WIDE_SPLIT_K_CONFIG,
    "swap_ab_t128": SWAP_AB_CONFIG,
    "swap_ab_split_k": SWAP_AB_SPLIT_K_CONFIG,
    "swap_ab_t192": SWAP_AB_T192_CONFIG,
    "swap_ab_variable": SWAP_AB_VARIABLE_CONFIG,
    "swap_ab_one_round": SWAP_AB_ONE_ROUND_CONFIG,
    "swap_ab_t112": SWAP_AB_T112_CONFIG,
    "swap_ab_t112_k128": SWAP_AB_T112_K128_CONFIG,
    "swap_ab_one_round_k128": SWAP_AB_ONE_ROUND_K128_CONFIG,
    "swap_ab_t32": SWAP_AB_T32_CONFIG,
    "swap_ab_t64": SWAP_AB_T64_CONFIG,
    "swap_ab_t32_k128": SWAP_AB_T32_K128_CONFIG,
    "swap_ab_t32_split_k2": SWAP_AB_T32_SPLIT_K2_CONFIG,
    "swap_ab_t32_split_k4": SWAP_AB_T32_SPLIT_K4_CONFIG,
}


def _differing_fields(base, config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(base, f.name)}


def config_name(config) -> str:
    """The registry name of `config`; for a variant, its nearest registered config of the same
    kind and the fields that differ: "swap_ab_t112:chain_calls=False" (":" before each field)."""
    for name, registered in CONFIGS.items():
        if registered == config:
            return name
    same_kind = [(name, _differing_fields(registered, config)) for name, registered in CONFIGS.items()
                 if type(registered) is type(config)]
    name, fields = min(same_kind, key=lambda item: len(item[1]))
    return name + "".join(f":{field}={value}" for field, value in fields.items())


def config_named(label: str):
    """The config a label names: a registry name, then optionally ":field=value" per field
    (ints and True / False); ValueError naming the registry otherwise."""
    name, _, overrides = label.partition(":")
    if name not in CONFIGS:
        raise ValueError(f"config {label!r}: {name!r} is not one of {', '.join(CONFIGS)}")
    changes = {}
    for item in filter(None, overrides.split(":")):
        field, _, value = item.partition("=")
        if field not in {f.name for f in dataclasses.fields(CONFIGS[name])}:
            raise ValueError(f"config {label!r}: {name} has no field {field!r}")
        changes[field] = {"True": True, "False": False}.get(value) if value in ("True", "False") else int(value)
    return dataclasses.replace(CONFIGS[name], **changes)
