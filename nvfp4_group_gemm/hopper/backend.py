"""The backend protocol implementation submission.py's host runtime drives on sm_90 GPUs."""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Sequence

import cuda.bindings.driver as cuda
import cutlass
import torch

from nvfp4_group_gemm import core

from .. import launch
from .config import (
    CTAS_PER_SM,
    SM90_CONFIG,
    SPLIT_K_CONFIG,
    STREAM_K_CONFIG,
    SWAP_AB_HALF_K,
    SWAP_AB_ONE_ROUND_CONFIG,
    SWAP_AB_SPLIT_K_CONFIG,
    SWAP_AB_T112_CONFIG,
    WIDE_SPLIT_K_CONFIG,
    HopperGemmConfig,
    SwapAbConfig,
    can_implement,
    config_name,
)
from .kernel import compile_gemm
from .schedules import (
    SWAP_AB_CANDIDATES,
    StreamKPlan,
    choose_config,
    choose_swap_ab_config,
    packed_swap_ab_tiles,
    variable_token_tiles,
    with_wide_k_tiles,
)
from .swap_ab import (
    DECODE_THREADS,
    activation_blocks,
    compile_decode_activations,
    compile_swap_ab_gemm,
    padded_token_rows,
)

_NUM_SMS: dict = {}


def current_num_sms() -> int:
    """SM count of torch's current CUDA device when it is an sm_90 GPU (the runtime plans a
    size set inside its device's context); 132 (H100/H200 SXM) otherwise: no CUDA device, or
    one this backend does not run on (tables planned in the CPU tests, on any machine)."""
    if not torch.cuda.is_available():
        return 132
    index = torch.cuda.current_device()
    if index not in _NUM_SMS:
        properties = torch.cuda.get_device_properties(index)
        hopper = (properties.major, properties.minor) == (9, 0)
        _NUM_SMS[index] = properties.multi_processor_count if hopper else 132
    return _NUM_SMS[index]


def activation_slabs(problem_sizes, config: SwapAbConfig) -> tuple[list[int], list[int], int]:
    """Where each group's decoded activations go in one scratch buffer: (byte offset per
    group, slab bytes per group (padded_token_rows x 128), total bytes, at least 16)."""
    offsets, slabs, total = [], [], 0
    for m, _n, k, _l in problem_sizes:
        slab = padded_token_rows(m, config) * SWAP_AB_HALF_K * 2
        offsets.append(total)
        slabs.append(slab)
        total += slab * (k // SWAP_AB_HALF_K)
    return offsets, slabs, max(total, 16)


class ActivationBuffer:
    """The swap-AB pre-pass's output for one plan (size set, config): every group's decoded
    fp16 activations in k-tile slabs (K / 64 slabs of padded_token_rows x 128 bytes, one
    buffer) and the device table of (address, slab bytes) per group, which the pre-pass and
    the GEMM read. Every input set of the plan shares it; the runtime orders launches of the
    plan on different streams (Sm90Plan.shared_scratch)."""

    __slots__ = ("_host_staging", "_table", "addresses", "blocks_x", "buffer")

    def __init__(self, problem_sizes, device, config: SwapAbConfig):
        offsets, slabs, total = activation_slabs(problem_sizes, config)
        self.buffer = torch.empty(total, dtype=torch.uint8, device=device)

        base = self.buffer.data_ptr()
        table = [(base + offset, slab) for offset, slab in zip(offsets, slabs)]
        self._table, self._host_staging, (self.addresses,) = launch.upload_int_tables(device, [("q", table)])
        self.blocks_x = max(1, -(-activation_blocks(problem_sizes) // DECODE_THREADS))

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() + self._table.numel()

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.buffer.record_stream(stream)
        self._table.record_stream(stream)


# The kernels' arguments as CellLauncher kinds and pointer dtypes: the pre-pass (ptrs, sizes,
# activation table, blocks_x, stream), the swap-AB GEMM (ptrs, sizes, tiles, num_tiles,
# activation table, stream), the in-GEMM-decode GEMM (ptrs, sizes, tiles, num_tiles, work,
# num_workers, workspace, counters, stream)
PREPASS_ARGS = (("ptr", "ptr", "ptr", "i32", "stream"), (cutlass.Int64, cutlass.Int32, cutlass.Int64, None, None))
SWAP_AB_GEMM_ARGS = (("ptr", "ptr", "ptr", "i32", "ptr", "stream"),
                     (cutlass.Int64, cutlass.Int32, cutlass.Int32, None, cutlass.Int64, None))
IN_GEMM_DECODE_ARGS = (("ptr", "ptr", "ptr", "i32", "ptr", "i32", "ptr", "ptr", "stream"),
                       (cutlass.Int64, cutlass.Int32, cutlass.Int32, None, cutlass.Int32, None, cutlass.Float32,
                        cutlass.Int32, None))


class DirectLaunch:
    """The swap-AB kernels of one size set launched for an input set that has no binding (its
    first call): the runtime's tables copied to the device from its staging memory
    (runtime.DirectTables), the activations decoded into scratch allocated per call from
    torch's caching allocator on the launch stream (reused only by that stream's later
    work), their address table written after the runtime's tables (`extra_bytes`)."""

    __slots__ = ("acts_format", "blocks_x", "device", "extra_bytes", "gemm", "num_tiles", "offsets", "prepass",
                 "scratch_bytes", "slabs")

    def __init__(self, spec, config: SwapAbConfig):

        num_groups = spec.num_groups
        self.device = spec.device
        self.offsets, self.slabs, self.scratch_bytes = activation_slabs(spec.problem_sizes, config)
        self.extra_bytes = 16 * num_groups
        self.acts_format = f"<{2 * num_groups}q"
        self.num_tiles = spec.num_tiles
        self.blocks_x = max(1, -(-activation_blocks(spec.problem_sizes) // DECODE_THREADS))
        self.prepass = launch.cell_launcher(
            compile_decode_activations(num_groups, chained=config.chain_calls), *PREPASS_ARGS)
        self.gemm = launch.cell_launcher(compile_swap_ab_gemm(num_groups, config=config), *SWAP_AB_GEMM_ARGS)

    def write_extra(self, host, acts_offset: int) -> torch.Tensor:
        """Allocate the scratch (on torch's current stream, the launch's) and write its
        activation table at `acts_offset` of `host`; returns the scratch (the caller keeps it
        alive only under a capture)."""
        scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=self.device)
        base = scratch.data_ptr()
        struct.pack_into(self.acts_format, host, acts_offset,
                         *[v for offset, slab in zip(self.offsets, self.slabs) for v in (base + offset, slab)])
        return scratch

    def launch(self, tables, stream_handle: int) -> None:
        """The pre-pass, then the GEMM, on the stream of `stream_handle`."""
        self.prepass(tables.ptrs, tables.sizes, tables.extra, self.blocks_x, stream_handle)
        self.gemm(tables.ptrs, tables.sizes, tables.tiles, self.num_tiles, tables.extra, stream_handle)


class Sm90Plan:
    """The sm_90 backend's part of a plan: the kernel config its size set runs and its scratch
    (every input set of the plan shares it): the StreamKPlan for stream-K, the
    ActivationBuffer for swap-AB."""

    __slots__ = ("activations", "config", "stream_k")

    def __init__(self, config, stream_k: StreamKPlan | None = None, activations: ActivationBuffer | None = None):
        self.config = config
        self.stream_k = stream_k
        self.activations = activations

    def _scratch(self):
        return [s for s in (self.stream_k, self.activations) if s is not None]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._scratch())

    @property
    def shared_scratch(self) -> bool:
        return bool(self._scratch())

    @property
    def graph_launch(self) -> bool:
        """Whether the runtime may replay this plan's launches as CUDA graphs: not with
        chain_calls, whose pre-pass starts while the kernel before it finishes (a graph launch
        waits for all earlier work)."""
        return not getattr(self.config, "chain_calls", False)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for scratch in self._scratch():
            scratch.record_stream(stream)


# The sm_90 kernels: "swap_ab" (swap_ab.py: an activation pre-pass, then the weights decoded
# into wgmma's register A with the tokens as N) and "in_gemm_decode" (kernel.py: both operands
# decoded inside the GEMM, no scratch beyond stream-K's). The default is swap_ab; H200 device
# µs, benchmark shapes 0-3, one bench/peers.py --configs run: 175.5 / 107.0 / 42.7 / 21.5 vs
# in_gemm_decode's own automatic choice 185.0 / 116.0 / 43.8 / 24.2 (swap_ab has become faster
# since: docs/EXPERIMENTS.md). in_gemm_decode needs no activation scratch (M padded to the
# token tiles x K x 2 bytes). NVFP4_SM90_KERNEL picks the default backend's kernel.
SM90_KERNELS = ("swap_ab", "in_gemm_decode")


def default_kernel() -> str:
    """NVFP4_SM90_KERNEL (swap_ab when unset), as nvfp4_group_gemm.switches read it."""
    from nvfp4_group_gemm import switches

    return switches.CURRENT.sm90_kernel


def default_chain_calls() -> bool:
    """NVFP4_SM90_CHAIN_CALLS: "1" (when unset) lets the automatic choice chain the calls
    (SwapAbConfig.chain_calls: the least device time, each call launched directly); "0"
    replays each input set's launches as a CUDA graph instead (about a third of the CPU per
    call, the pre-pass no longer overlapping the kernel before it); nvfp4_group_gemm.switches
    reads it."""
    from nvfp4_group_gemm import switches

    return switches.CURRENT.sm90_chain_calls


class Sm90Backend:
    """Backend protocol implementation for Hopper (sm_90a), driven by submission.py's host
    runtime: no descriptors (the kernels read the pointer table), so a plan is the config its
    size set runs and its scratch (swap-AB's decoded activations, stream-K's workspace).

    config None (custom_kernel's backend): per size set the config of `kernel` picked from
    the sizes: swap_ab, schedules.choose_swap_ab_config (split-K where tiles are few);
    in_gemm_decode, schedules.choose_config (stream-K, split-K with 128x128 or 128x256 tiles,
    or whole tiles). tile_shape, plan_tiles and prepare ask the same question, so the tile
    table is planned with the tile shape of the kernel that runs it. Otherwise `config` (a
    SwapAbConfig or a HopperGemmConfig) runs every input set."""

    name = "sm90"

    @property
    def oracle(self):
        """The exact decode: the self-check's oracle and every chain's last link."""
        return _choice("exact_decode", host=True)

    def __init__(self, config: HopperGemmConfig | SwapAbConfig | None = None, kernel: str = "swap_ab",
                 chain_calls: bool = True):
        if config is not None:
            config.check()
        if kernel not in SM90_KERNELS:
            raise ValueError(f"kernel={kernel!r}: must be one of {', '.join(SM90_KERNELS)}")
        self.config = config
        self.kernel = kernel
        self.chain_calls = chain_calls

    @property
    def plan_key(self):
        """What, besides the device and the sizes, a plan of this backend depends on."""
        return (self.name, self.config, self.kernel, self.chain_calls)

    def config_for(self, problem_sizes) -> HopperGemmConfig | SwapAbConfig:
        """The config a size set runs (the automatic choice without chain_calls where the
        backend was made with chain_calls=False)."""
        if self.config is not None:
            return self.config
        if self.kernel == "swap_ab":
            config = choose_swap_ab_config(problem_sizes, current_num_sms())
            if config.chain_calls and not self.chain_calls:
                config = dataclasses.replace(config, chain_calls=False)
            return config
        return choose_config(problem_sizes, current_num_sms())

    def kernel_chain(self, problem_sizes) -> Sequence:
        """The kernels that can run these sizes, best first (core.KernelChoice): the
        automatic choice (swap_ab unless NVFP4_SM90_KERNEL=in_gemm_decode), the in-GEMM-decode
        kernel, the exact decode. A backend made with a config runs that config alone."""
        if self.config is not None:
            return [_choice(config_kind(self.config), self.config)]

        links = []
        if self.kernel == "swap_ab":
            links.append(lambda: _choice("swap_ab", self.config_for(problem_sizes)))
        # the in-GEMM-decode config (a stream-K plan's cost) is chosen only if that link is reached
        links += [lambda: _choice("in_gemm_decode", choose_config(problem_sizes, current_num_sms())),
                  lambda: self.oracle]
        return core.KernelChain(links)

    def compile(self, choice, num_groups: int) -> None:
        """Compile (cached) the kernels of `choice` (a core.KernelChoice)."""
        if not choice.host:
            _compiled_gemm(choice.config, num_groups)

    def write_descriptors(self, plan, pointers, ptrs) -> None:
        """No descriptors: the kernels read the pointer table."""
        return

    def family_choices(self, groups: int, n: int, k: int) -> list:
        """Every kernel the automatic choice can pick for `groups` groups of this N and K,
        whatever their M (core.warmup compiles them): every swap-AB config
        choose_swap_ab_config can return (with 128-wide k-tiles where K % 512 == 0, unchained
        where the backend does not chain), or every config choose_config can return."""
        if self.config is not None:
            return [_choice(config_kind(self.config), self.config)]
        sizes = [(128, n, k, 1)] * groups
        if self.kernel == "swap_ab":
            configs = [with_wide_k_tiles(sizes, config) for config in
                       (SWAP_AB_SPLIT_K_CONFIG, *SWAP_AB_CANDIDATES, SWAP_AB_T112_CONFIG, SWAP_AB_ONE_ROUND_CONFIG)]
            if not self.chain_calls:
                configs = [dataclasses.replace(c, chain_calls=False) if c.chain_calls else c for c in configs]
            return [_choice("swap_ab", config) for config in dict.fromkeys(configs)]
        configs = [SM90_CONFIG, SPLIT_K_CONFIG, STREAM_K_CONFIG]
        if n % 256 == 0:
            configs.append(WIDE_SPLIT_K_CONFIG)
        return [_choice("in_gemm_decode", config) for config in configs]

    def prepare_device(self, device) -> None:
        """What a first plan would otherwise ask the driver: the SM count."""
        current_num_sms()

    def can_implement(self, problem_sizes) -> None:
        """can_implement, then what an explicit config needs of K (SwapAbConfig.k_multiple: one
        with 128-wide k-tiles takes K % 512 == 0 only; the automatic choice picks those only
        where every K allows)."""
        can_implement(problem_sizes)
        config = self.config
        if not isinstance(config, SwapAbConfig):
            return
        multiple = config.k_multiple
        for g, (_m, _n, k, _l) in enumerate(problem_sizes):
            if k % multiple:
                raise ValueError(
                    f"group {g}: K = {k}; the sm_90 config with {config.tile_k}-wide k-tiles needs K % {multiple} == 0"
                )

    def tile_shape(self, problem_sizes, choice=None) -> tuple[int, int]:
        """(rows along M, columns along N) of an output tile of `choice`'s config (the
        chain's first when None)."""
        config = self._config_of(problem_sizes, choice)
        if isinstance(config, SwapAbConfig):
            return config.tile_tokens, config.tile_weights
        return config.tile_m, config.tile_n

    def _config_of(self, problem_sizes, choice):
        return self.kernel_chain(problem_sizes)[0].config if choice is None else choice.config

    def plan_tiles(self, problem_sizes, choice=None) -> list[tuple[int, int, int]]:
        """(group, M tile, N tile) of every output tile; groups with M = 0 have none. Group
        first; then, for swap-AB, the N (weight) tile, so that the token tiles of one weight
        tile run side by side and share its reads in L2; otherwise the M tile, so that the
        tiles of one A tile do."""
        config = self._config_of(problem_sizes, choice)
        if isinstance(config, SwapAbConfig) and config.variable_tokens:
            return variable_token_tiles(problem_sizes, config)
        tile_m, tile_n = self.tile_shape(problem_sizes, choice)
        swap_ab = isinstance(config, SwapAbConfig)
        tiles = []
        for g, (m, n, _k, _l) in enumerate(problem_sizes):
            m_tiles, n_tiles = range(-(-m // tile_m)), range(-(-n // tile_n))
            if swap_ab:
                tiles += [(g, tm, tn) for tn in n_tiles for tm in m_tiles]
            else:
                tiles += [(g, tm, tn) for tm in m_tiles for tn in n_tiles]
        return tiles

    def pack_tiles(self, problem_sizes, choice):
        """plan_tiles(problem_sizes, choice) as core.PackedTiles: for swap-AB joined from
        cached per-bucket blocks (schedules.packed_swap_ab_tiles: a MoE step plans new sizes
        on every call)."""

        config = choice.config
        if isinstance(config, SwapAbConfig):
            return core.PackedTiles(packed_swap_ab_tiles(problem_sizes, config), config.tile_row_width)
        return core.PackedTiles.of(self.plan_tiles(problem_sizes, choice))

    def prepare(self, spec) -> Sm90Plan:
        """Compile (cached) the spec's kernel (core.PlanSpec: its choice, sizes, device and
        tile rows) and, for stream-K, plan the workers' shares and allocate their buffers."""
        config = spec.choice.config
        self.compile(spec.choice, spec.num_groups)
        if isinstance(config, SwapAbConfig):
            return Sm90Plan(config, activations=ActivationBuffer(spec.problem_sizes, spec.device, config))
        stream_k = None
        if config.stream_k and spec.num_tiles > 0:
            stream_k = StreamKPlan(spec, config, current_num_sms() * CTAS_PER_SM)
        return Sm90Plan(config, stream_k)

    def direct_launch(self, spec) -> DirectLaunch | None:
        """The DirectLaunch of a spec running a swap-AB config (compiled by then); None for the
        in-GEMM-decode kernel (its stream-K scratch is per plan)."""
        config = spec.choice.config
        if not isinstance(config, SwapAbConfig):
            return None
        return DirectLaunch(spec, config)

    def launcher(self, plan, binding):
        """The prepared launch of a bound input set on the legacy default stream (handle 0),
        as the leaderboard file's runtime launches (core.Backend): that runtime drives
        this backend as it drives its own, so an H100/H200 runs it (tests/test_gpu_leaderboard_runtime.py)."""
        launches = self.launch_args(plan, binding, cuda.CUstream(0))
        return core.in_order([entry.launcher() for entry in (launches if isinstance(launches, list) else [launches])])

    def launch_args(self, plan, binding, stream: cuda.CUstream):
        """The launches of this input set on `stream` as launch.CellArgs: for swap-AB the
        pre-pass, then the GEMM; the in-GEMM-decode GEMM alone."""

        backend_plan = plan.backend_plan
        activations = backend_plan.activations
        handle = int(stream)
        ptrs, sizes, tiles = binding.ptrs.data_ptr(), plan.sizes.data_ptr(), plan.tiles.data_ptr()
        if activations is not None:
            addresses = activations.addresses.data_ptr()
            return [
                launch.CellArgs(compile_decode_activations(plan.num_groups, chained=backend_plan.config.chain_calls),
                                    *PREPASS_ARGS, (ptrs, sizes, addresses, activations.blocks_x, handle)),
                launch.CellArgs(compile_swap_ab_gemm(plan.num_groups, config=backend_plan.config),
                                    *SWAP_AB_GEMM_ARGS, (ptrs, sizes, tiles, plan.num_tiles, addresses, handle)),
            ]
        stream_k = backend_plan.stream_k
        if stream_k is None:
            # not read by the kernel: any valid pointers
            work, num_workers, workspace, counters = tiles, 0, sizes, sizes
        else:
            work, num_workers = stream_k.work.data_ptr(), stream_k.num_workers
            workspace, counters = stream_k.workspace.data_ptr(), stream_k.counters.data_ptr()
        return launch.CellArgs(_compiled_gemm(backend_plan.config, plan.num_groups), *IN_GEMM_DECODE_ARGS,
                                   (ptrs, sizes, tiles, plan.num_tiles, work, num_workers, workspace, counters, handle))


def _compiled_gemm(config, num_groups: int):
    """The GEMM of `config` for `num_groups` groups, compiled once (cached by its compiler);
    for swap-AB, its activation pre-pass too."""
    if isinstance(config, SwapAbConfig):
        compile_decode_activations(num_groups, chained=config.chain_calls)
        return compile_swap_ab_gemm(num_groups, config=config)
    return compile_gemm(num_groups, config=config)


def config_kind(config) -> str:
    """The kernel a config runs: swap_ab (SwapAbConfig) or in_gemm_decode (HopperGemmConfig)."""
    return "swap_ab" if isinstance(config, SwapAbConfig) else "in_gemm_decode"


# One KernelChoice per (name, config): a new size set's chain is built on its call's path, and
# naming a config (config_name) compares it with every registered one.
@functools.lru_cache(maxsize=256)
def _choice(name: str, config=None, host: bool = False):
    """A link of a chain: core.KernelChoice (the runtime's type; imported here, at plan
    time, since submission imports this package only on its first sm_90 use)."""

    return core.KernelChoice("sm90", name, config, per_group_count=not host, host=host,
                                   label=None if config is None else config_name(config))


def make_backend(config: HopperGemmConfig | SwapAbConfig | None = None, kernel: str | None = None,
                 chain_calls: bool | None = None) -> Sm90Backend:
    """The backend custom_kernel uses (config None: the automatic choice per size set of
    `kernel`, default_kernel() when None, its calls chained unless chain_calls is False,
    default_chain_calls() when None), or one running `config` as given for every input
    set."""
    return Sm90Backend(config, default_kernel() if kernel is None else kernel,
                       default_chain_calls() if chain_calls is None else chain_calls)
