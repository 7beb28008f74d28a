"""The sm_100 backend: the builds of every kernel, the kernel registry, ``Sm100Backend``.

Builds (module-level functions, keyed by ``compile_key``) and their ``compile_*`` entries,
``compile_targets`` (what ``python eval.py compile`` builds), the persistent kernel's tile
plan and token-tile rule, ``SM100_CHOICES`` (every kernel the automatic choice can pick), and
``Sm100Backend``: the chain per size set, plans, descriptors and prepared launches."""

import dataclasses
from collections.abc import Callable
from typing import Any

import cutlass
import torch
from cutlass import cute, utils
from cutlass.cute.runtime import make_ptr

from .chain import KernelChoice, one_line, report
from .config import (
    K_TILE,
    PTR_A,
    PTR_B,
    PTR_C,
    PTR_SFA,
    PTR_SFB,
    SM100_ARCH,
    SM100_CHAIN_CALLS,
    SM100_KERNEL,
    SM100_KERNELS,
    bytes_per_tensormap,
    ceil_div,
    chain_calls_as,
    compile_once,
    fake_ptr,
    mma_tiler_mnk,
    num_tensormaps,
)
from .launching import (
    Binding,
    PackedTiles,
    Plan,
    PlanSpec,
    RuntimeCache,
    make_launcher,
    plan_tiles,
)
from .per_tile import gemm_jit, init_tensormaps_jit
from .persistent import (
    PERSISTENT_CONFIGS,
    PERSISTENT_NUM_TENSORMAPS,
    PersistentGemmConfig,
    PersistentGemmSm100,
    persistent_stage_bytes,
)


def per_tile_init_build(num_groups: int) -> tuple:
    return init_tensormaps_jit, (fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Int64),
                                 cutlass.Int32(num_groups))


def per_tile_gemm_build(num_groups: int) -> tuple:
    return gemm_jit, (fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Int64),
                      cutlass.Int32(1), cutlass.Int32(num_groups))


def compile_init_tensormaps(num_groups: int, options: str | None = None):
    """The per-tile kernel's descriptor init (its constants are the module's)."""
    return compile_once(per_tile_init_build, num_groups, options=options)


def compile_gemm(num_groups: int, options: str | None = None):
    """The per-tile GEMM (its constants are the module's)."""
    return compile_once(per_tile_gemm_build, num_groups, options=options)


def compile_targets() -> list[tuple[str, str, Callable[[int, str | None], Any]]]:
    """Kernels of this backend for the build report: (kernel name, arch, compile(G, options))."""
    targets = [
        ("sm100_init_tensormaps", SM100_ARCH, compile_init_tensormaps),
        ("sm100_gemm", SM100_ARCH, compile_gemm),
    ]
    for tokens, config in PERSISTENT_CONFIGS.items():
        # One build serves every G (G is a runtime value there); the report lists it per G
        targets += [
            (f"sm100_persistent_init_t{tokens}", config.arch,
             lambda g, options, config=config: compile_persistent_init(config, options)),
            (f"sm100_persistent_gemm_t{tokens}", config.arch,
             lambda g, options, config=config: compile_persistent_gemm(config, options)),
        ]
    return targets


def gmem_ptr(dtype, tensor: torch.Tensor):
    return make_ptr(dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)


def plan_persistent_tiles(problem_sizes, tokens_per_tile: int, mma_m: int = 256) -> list[tuple[int, int, int]]:
    """Tile list of the persistent kernel: (group, MMA m tile, MMA n tile) per entry.

    A tile covers `mma_m` rows of the problem's N and `tokens_per_tile` rows of its M (swap-AB).
    Order: groups by descending M (ties by group index), then N tile, then token tile fastest.
    Cluster c runs entries c, c + num_clusters, ..., so the clusters of one wave hold
    consecutive entries: they share a group's N slice of B, the operand that dominates the
    bytes, which is then read from DRAM once and from L2 by the others.
    """
    order = sorted(range(len(problem_sizes)), key=lambda g: (-problem_sizes[g][0], g))
    tiles = []
    for g in order:
        m, n, _k, _l = problem_sizes[g]
        for n_tile in range(ceil_div(n, mma_m)):
            for m_tile in range(ceil_div(m, tokens_per_tile)):  # none when M == 0
                tiles.append((g, n_tile, m_tile))
    return tiles


# sm_100 SMs a B200 has; the host reads the real count from the device when it has one
B200_NUM_SMS = 148


# Per-SM rates of the token-tile rule: the TMA load rate of a CTA, fitted by bench/b200_model.py to the
# published B200 times of the fastest public entry (122.7 KB/µs per SM), and the nvfp4 MMA rate
# that entry measured (5797 TFLOP/s over 148 SMs). A model's constants, not measurements here.
SM100_LOAD_BYTES_PER_US = 122_700
SM100_MMA_FLOP_PER_US = 5797.05e6 / 148


def persistent_k_tile_us(tokens_per_tile: int) -> float:
    """Modelled µs of one k-tile of a CTA of the pair: its stage's bytes at the per-SM load
    rate or its MMAs (128 N rows x tokens x 256 K), whichever is longer."""
    load_us = persistent_stage_bytes(tokens_per_tile) / SM100_LOAD_BYTES_PER_US
    mma_us = 2 * 128 * tokens_per_tile * K_TILE / SM100_MMA_FLOP_PER_US
    return max(load_us, mma_us)


def choose_tokens_per_tile(problem_sizes, num_sms: int = B200_NUM_SMS) -> int:
    """Tokens per tile (MMA N) of the persistent kernel for this input set.

    The DSL's 2-CTA block-scaled MMA takes N = 16..256 in steps of 16; the kernel compiles 128
    and 256, the two sizes NVIDIA's grouped block-scaled example runs with cta_group::2 (the
    tokens' scales are loaded as whole 128-row atoms, so other sizes waste them or need
    column offsets into TMEM). Rule: the size whose busiest CTA pair finishes first, its
    tiles' k-tiles at persistent_k_tile_us each; 128 on a tie. A k-tile of 256 tokens is
    MMA-bound (0.43 µs against 0.23 for 128), so 256 pays only where it removes tiles from
    the busiest pair: large M without a partial last wave. 128 also keeps two accumulators,
    so its epilogues overlap the next tile's mainloop.
    """
    num_clusters = max(num_sms // 2, 1)
    best = None
    for tokens_per_tile in (128, 256):
        tiles = plan_persistent_tiles(problem_sizes, tokens_per_tile)
        k_tiles_per_pair = [0] * num_clusters
        for index, (g, _n_tile, _m_tile) in enumerate(tiles):
            k_tiles_per_pair[index % num_clusters] += problem_sizes[g][2] // K_TILE
        cost = max(k_tiles_per_pair) * persistent_k_tile_us(tokens_per_tile)
        if best is None or cost < best[0]:
            best = (cost, tokens_per_tile)
    return best[1]


persistent_can_implement = PersistentGemmSm100.can_implement


def persistent_init_build(config: PersistentGemmConfig) -> tuple:
    return PersistentGemmSm100(config).init_tensormaps, (fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int32),
                                                         fake_ptr(cutlass.Int64), cutlass.Int32(1))


def persistent_gemm_build(config: PersistentGemmConfig) -> tuple:
    return PersistentGemmSm100(config), (fake_ptr(cutlass.Int32), fake_ptr(cutlass.Int64),
                                         cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1))


def compile_persistent_init(config: PersistentGemmConfig, options: str | None = None):
    """The persistent kernel's descriptor init for `config` (G is a runtime value)."""
    return compile_once(persistent_init_build, config, options=options)


def compile_persistent_gemm(config: PersistentGemmConfig, options: str | None = None):
    """The persistent GEMM for `config`; G, the tile count and the cluster count are runtime
    values, so one build serves every input set of that config."""
    return compile_once(persistent_gemm_build, config, options=options)


# The sm_100 registry: every kernel the automatic choice can pick, by name
SM100_CHOICES = {
    **{f"persistent_t{tokens}": KernelChoice("sm100", f"persistent_t{tokens}", config)
       for tokens, config in PERSISTENT_CONFIGS.items()},
    "per_tile": KernelChoice("sm100", "per_tile", per_group_count=True),
    # what the competition's reference runs on a B200: always correct there, only slow
    "scaled_mm": KernelChoice("sm100", "scaled_mm", host=True),
}


class Sm100Plan:
    """The sm_100 backend's part of a plan: which kernel runs these sizes (config None: the
    per-tile kernel), over how many CTA pairs, and whether its calls chain (its link's
    KernelChoice.chained: its kernels are looked up under chain_calls_as of it)."""

    __slots__ = ("chained", "config", "num_clusters")
    nbytes = 0  # no device buffers beyond the runtime's tables

    def __init__(self, config, num_clusters, chained: bool | None = None):
        self.config = config
        self.num_clusters = num_clusters
        self.chained = chained


def resident_clusters(device: torch.device, cluster_size: int = 2) -> int | None:
    """How many clusters of `cluster_size` CTAs can be resident at once on `device` (the
    examples' HardwareInfo().get_max_active_clusters); None off a GPU. More would run as a
    second persistent wave. Asked once per device."""
    if device.type != "cuda":
        return None
    key = (device.index, cluster_size)
    if key not in RESIDENT_CLUSTERS:
        try:
            RESIDENT_CLUSTERS[key] = int(utils.HardwareInfo(device.index).get_max_active_clusters(cluster_size))
        except Exception as error:  # noqa: BLE001 - a failed query must not fail the call
            report(f"the resident {cluster_size}-CTA cluster query failed ({one_line(error)}); "
                   "the persistent kernel runs one cluster per two SMs")
            RESIDENT_CLUSTERS[key] = None
    return RESIDENT_CLUSTERS[key]


RESIDENT_CLUSTERS: dict = {}


class Sm100Backend:
    """The B200 (sm_100a) backend.

    `kernel`: "persistent" (chain: PersistentGemmSm100 where persistent_can_implement allows,
    then the per-tile kernel, then torch._scaled_mm) or "per_tile" (chain: the per-tile
    kernel, then torch._scaled_mm)."""

    name = "sm100"
    oracle = SM100_CHOICES["scaled_mm"]

    def __init__(self, kernel: str = SM100_KERNEL, num_sms: int = B200_NUM_SMS):
        if kernel not in SM100_KERNELS:
            raise ValueError(f"SM100_KERNEL = {kernel!r}; rule: one of {SM100_KERNELS}")
        self.kernel = kernel
        self.num_sms = num_sms
        # Descriptors depend on the pointers and sizes: the per-tile kernel's not on C (input
        # sets that differ only in C share them), the persistent kernel's on C too (C is
        # stored by TMA). The init kernel runs only when one of those changed.
        self._descriptors = RuntimeCache(max_entries=64)

    @property
    def plan_key(self):
        """What, besides the device and the sizes, a plan of this backend depends on."""
        return (self.name, self.kernel, self.num_sms)

    def kernel_chain(self, problem_sizes) -> list[KernelChoice]:
        """The kernels that can run these sizes, best first; the last always can. With calls
        chained (SM100_CHAIN_CALLS), each kernel twice: chained, then the same kernel plain, so
        that a failure of the chaining alone (a launch with the attribute that fails, a chained
        self-check that disagrees) costs the chaining, not the kernel."""
        kernels = []
        if self.kernel == "persistent" and persistent_can_implement(problem_sizes) is None:
            kernels.append(SM100_CHOICES[f"persistent_t{choose_tokens_per_tile(problem_sizes, self.num_sms)}"])
        kernels.append(SM100_CHOICES["per_tile"])
        if SM100_CHAIN_CALLS:
            kernels = [dataclasses.replace(kernel, chained=chained) for kernel in kernels for chained in (True, False)]
        return [*kernels, SM100_CHOICES["scaled_mm"]]

    def can_implement(self, problem_sizes) -> None:
        """validate_inputs states every sm_100 constraint; input sets the persistent kernel
        cannot run get a chain without it."""

    def family_choices(self, groups: int, n: int, k: int) -> list[KernelChoice]:
        """Every kernel the automatic choice can pick for `groups` groups of this N and K,
        whatever their M (warmup compiles them): both token tiles of the persistent kernel
        where it runs (N % 8 == 0), else the per-tile kernel."""
        sizes = [(128, n, k, 1)] * groups
        if self.kernel == "persistent" and persistent_can_implement(sizes) is None:
            return [SM100_CHOICES["persistent_t128"], SM100_CHOICES["persistent_t256"]]
        return [SM100_CHOICES["per_tile"]]

    def prepare_device(self, device: torch.device) -> None:
        """What a first plan on `device` would otherwise ask the driver: its resident clusters."""
        resident_clusters(device)

    def compile(self, choice: KernelChoice, num_groups: int) -> None:
        """Compile (cached) the kernels of `choice`; raises what the compiler raised."""
        with chain_calls_as(choice.chained):
            if choice.name == "per_tile":
                self.compile_per_tile_init(num_groups)
                self.compile_per_tile_gemm(num_groups)
            elif not choice.host:
                self.compile_persistent_init(choice.config)
                self.compile_persistent_gemm(choice.config)

    def plan_tiles(self, problem_sizes, choice: KernelChoice | None = None) -> list[tuple[int, ...]]:
        """Tile rows of `choice` (the chain's first when None): (group, tile_m, tile_n) of
        128x128 tiles for the per-tile kernel; (group, MMA m tile, MMA n tile, k-tiles) for
        the persistent kernel."""
        if choice is None:
            choice = self.kernel_chain(problem_sizes)[0]
        if choice.name == "per_tile":
            return plan_tiles(problem_sizes, mma_tiler_mnk[0], mma_tiler_mnk[1])
        config = choice.config
        k_tiles = [size[2] // K_TILE for size in problem_sizes]
        return [
            (g, n_tile, m_tile, k_tiles[g])
            for g, n_tile, m_tile in plan_persistent_tiles(problem_sizes, config.tokens_per_tile, config.mma_m)
        ]

    def pack_tiles(self, problem_sizes, choice: KernelChoice) -> "PackedTiles":
        """plan_tiles' rows packed (a size set's first call: this backend has no DirectLaunch,
        so only the binding path reads them)."""
        return PackedTiles.of(self.plan_tiles(problem_sizes, choice))

    def prepare(self, spec: "PlanSpec") -> Sm100Plan:
        """Compile (cached) the kernels of the spec's choice; CTA pairs: min(tiles, SMs / 2,
        the device's resident 2-CTA clusters)."""
        choice = spec.choice
        self.compile(choice, spec.num_groups)
        if choice.name == "per_tile":
            return Sm100Plan(None, 0, choice.chained)
        num_clusters = min(spec.num_tiles, max(self.num_sms // 2, 1))
        resident = resident_clusters(spec.device)
        if resident is not None:
            num_clusters = min(num_clusters, resident)
        return Sm100Plan(choice.config, max(num_clusters, 1), choice.chained)

    # The compiled functions this backend launches, looked up at each use (the CPU tests
    # replace the module's compilers); the library's backend of the same kernels returns entries
    # that also take where the launch goes.
    def compile_per_tile_init(self, num_groups: int):
        return compile_init_tensormaps(num_groups)

    def compile_per_tile_gemm(self, num_groups: int):
        return compile_gemm(num_groups)

    def compile_persistent_init(self, config: PersistentGemmConfig):
        return compile_persistent_init(config)

    def compile_persistent_gemm(self, config: PersistentGemmConfig):
        return compile_persistent_gemm(config)

    def descriptor_key(self, plan: "Plan", pointers: tuple) -> tuple:
        """What the descriptors of an input set depend on: the device, the kernel config, the
        sizes and the pointers they address."""
        config = plan.backend_plan.config
        slots = (PTR_A, PTR_B, PTR_SFA, PTR_SFB) if config is None else (PTR_A, PTR_B, PTR_C, PTR_SFA, PTR_SFB)
        return (str(plan.device), config, plan.problem_sizes, tuple(tuple(p[i] for i in slots) for p in pointers))

    def init_descriptors(self, plan: "Plan", ptrs: torch.Tensor, *launch_args) -> torch.Tensor:
        """A new descriptor buffer of every group of this input set, written by the config's
        init kernel (`launch_args` follow its other arguments: the library's entries take
        where the launch goes)."""
        config = plan.backend_plan.config
        with chain_calls_as(plan.backend_plan.chained):
            if config is None:
                init_fn, num_slots = self.compile_per_tile_init(plan.num_groups), num_tensormaps
            else:
                init_fn, num_slots = self.compile_persistent_init(config), PERSISTENT_NUM_TENSORMAPS
        tensormaps = torch.empty(
            (plan.num_groups, num_slots, bytes_per_tensormap // 8), dtype=torch.int64, device=plan.device
        )
        init_fn(
            gmem_ptr(cutlass.Int64, ptrs),
            gmem_ptr(cutlass.Int32, plan.sizes),
            gmem_ptr(cutlass.Int64, tensormaps),
            cutlass.Int32(plan.num_groups),
            *launch_args,
        )
        return tensormaps

    def write_descriptors(self, plan: "Plan", pointers: tuple, ptrs: torch.Tensor) -> torch.Tensor:
        """TMA descriptors of every group of this input set: reused, or written now by an init
        kernel."""
        key = self.descriptor_key(plan, pointers)
        tensormaps = self._descriptors.get(key)
        if tensormaps is None:
            tensormaps = self.init_descriptors(plan, ptrs)
            self._descriptors.put(key, tensormaps)
        return tensormaps

    def gemm_args(self, plan: "Plan", tensormaps: torch.Tensor, ptrs: torch.Tensor, *launch_args):
        """(compiled GEMM, its arguments) for this input set: its descriptors and pointer
        table, then `launch_args` (as init_descriptors)."""
        config = plan.backend_plan.config
        with chain_calls_as(plan.backend_plan.chained):
            gemm = self.compile_persistent_gemm(config) if config is not None else self.compile_per_tile_gemm(
                plan.num_groups)
        if config is not None:
            return gemm, (
                gmem_ptr(cutlass.Int32, plan.tiles),
                gmem_ptr(cutlass.Int64, tensormaps),
                cutlass.Int32(plan.num_groups),
                cutlass.Int32(plan.num_tiles),
                cutlass.Int32(plan.backend_plan.num_clusters),
                *launch_args,
            )
        return gemm, (
            gmem_ptr(cutlass.Int64, ptrs),
            gmem_ptr(cutlass.Int32, plan.sizes),
            gmem_ptr(cutlass.Int32, plan.tiles),
            gmem_ptr(cutlass.Int64, tensormaps),
            cutlass.Int32(plan.num_tiles),
            cutlass.Int32(plan.num_groups),
            *launch_args,
        )

    def launcher(self, plan: "Plan", binding: "Binding") -> Callable[[], None]:
        """The prepared launch of a bound input set (make_launcher: its arguments converted once)."""
        compiled, args = self.gemm_args(plan, binding.bound, binding.ptrs)
        return make_launcher(compiled, *args)
