"""The runtime for callers beyond the leaderboard, on the leaderboard file's core.

``custom_kernel`` here takes the same input as the leaderboard file's and adds what real
callers need: launches on the caller's current stream (read at every call), ordering when
tables written on one stream are read on another, CUDA-graph capture by the caller and graph
replay of a bound input set's launch, threads on their own streams, an input set's first call
launched without a binding from staged tables (a MoE step's sizes are new at every call), and
the Hopper (sm_90a) backend. Validation, the fallback chain, its demotions and self-check,
the caches' type and the host computations are the leaderboard file's (``submission``), so
the H200 runs them as a B200 does.
"""

import enum
import operator
import struct
import typing
from collections.abc import Callable

import cuda.bindings.driver as cuda
import torch

from nvfp4_group_gemm import core, switches

from .launch import (
    _CAPTURE_ARENAS,
    _STREAM_OBJECTS,
    RETIRED,
    CellArgs,
    GraphLaunch,
    TableRing,
    Written,
    _capturing,
    _check_cuda,
    _CudaEvent,
    _current_raw_stream,
    _stream_for_current,
    _stream_handle,
    cuda_get_device,
    make_launcher,
    records_graph,
    release_retired,
    retire,
    table_ring,
    upload_int_tables,
)

KernelChoice = core.KernelChoice
PackedTiles = core.PackedTiles
PlanSpec = core.PlanSpec
RuntimeCache = core.RuntimeCache
NUM_PTR_COLS = core.NUM_PTR_COLS
HOST_COMPUTATIONS = core.HOST_COMPUTATIONS
input_key = core.input_key
cached_binding = core.cached_binding
in_order = core.in_order
pointers_of = core.pointers_of
pointers_of_key = core.pointers_of_key
checked_problem_sizes = core.checked_problem_sizes
checked_input = core.checked_input
choose_kernel = core.choose_kernel
demote = core.demote
one_line = core.one_line
align_up = core.align_up
flatten = core.flatten
data_address = core.data_address
device_context = core.device_context
RUNTIME_LOCK = core.RUNTIME_LOCK
SELF_CHECKED = core.SELF_CHECKED
input_t = core.input_t
output_t = core.output_t


def validate_inputs(data, *, require_cuda: bool = True):
    """The leaderboard file's rules (looked up at each call: the CPU tests waive one).
    `require_cuda` False: the CPU path's rules (the torch op on CPU tensors), every rule but
    "a CUDA device": the same errors, and every tensor on group 0's a's device."""
    return core.validate_inputs(data, require_cuda=require_cuda)


# An input set's first call launches without a binding where its backend can (its tables
# staged and copied with the launch, no binding or plan built: a MoE step's sizes and
# activations are new at every call); its second call binds it.
# switches.CURRENT.first_call_unbound (NVFP4_FIRST_CALL_UNBOUND=0 binds every input set at its
# first call, EXPERIMENTS E64).


@typing.runtime_checkable
class BackendPlan(typing.Protocol):
    """What a backend's prepare(spec) returns: the runtime reads these and nothing else."""

    nbytes: int  # device bytes it holds beyond the runtime's tables (the plan cache's bound)
    shared_scratch: bool  # its input sets share scratch: launches on two streams are ordered
    graph_launch: bool  # its launches may be recorded as a CUDA graph and replayed

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Its buffers are read on `stream` (freed memory is not reused before that work)."""


class DirectLaunch(typing.Protocol):
    """A backend's launch of one size set for an input set without a binding (its first
    call): the runtime writes its tables (DirectTables) into staging memory, write_extra the
    backend's `extra_bytes` after them, the runtime copies them all to the device, then
    launch() launches on the stream."""

    extra_bytes: int

    def write_extra(self, host: memoryview, extra_offset: int):
        """Write the backend's table at `extra_offset` of `host`; returns what must stay alive
        while the launch may run (again, under a capture): its scratch."""

    def launch(self, tables: "DirectTables", stream_handle: int) -> None:
        """Launch on the stream of `stream_handle`, reading the tables at their device addresses."""


@typing.runtime_checkable
class Backend(core.Backend, typing.Protocol):
    """A device family's kernels as this runtime drives them: the leaderboard file's protocol
    (chain, tiles, plans, descriptors, a launch on the default stream), and where launches go:
    nvfp4_group_gemm.sm100.Sm100StreamBackend on a B200, nvfp4_group_gemm.hopper.Sm90Backend
    on Hopper."""

    def pack_tiles(self, problem_sizes, choice: KernelChoice) -> "PackedTiles":
        """plan_tiles(problem_sizes, choice) as PackedTiles (a size set's first call copies them)."""

    def prepare(self, spec: "PlanSpec") -> BackendPlan:
        """Its part of a plan, for spec.choice (compiled by then), as this runtime reads it."""

    def write_descriptors(self, plan: "Plan", pointers: tuple, ptrs: torch.Tensor) -> "Written | None":
        """The input set's TMA descriptors as a Written (ordered for other streams), or None."""

    def direct_launch(self, spec: "PlanSpec") -> "DirectLaunch | None":
        """What launches an input set of the spec without a binding (its first call), or None."""

    def launch_args(self, plan: "Plan", binding: "Binding", stream: cuda.CUstream):
        """(compiled, its arguments), or a list of them launched in order, for `stream`."""


class Plan:
    """What every input set of one size set shares on one device and backend.

    choice: the kernel of the backend's chain that runs these sizes (decided, and compiled,
    before anything else is built: the tile rows are that kernel's); chain: the whole chain,
    for a demotion to name the next link. sizes int32 [G, 4]: (M, N, K, L) per group; tiles
    int32 [T, W]: the kernel's tile rows (none for a host computation). backend_plan: what
    the backend's prepare(spec) made of them (the kernel config, a schedule and its scratch);
    None for a host computation. nbytes: device bytes held."""

    __slots__ = (
        "_host_staging", "backend", "backend_plan", "chain", "choice", "device", "kernel_key", "nbytes",
        "num_groups", "num_tiles", "problem_sizes", "scratch_event", "scratch_stream", "sizes", "spec", "tables",
        "tile_rows", "tiles",
    )

    def __init__(self, backend, problem_sizes, device, choice: KernelChoice | None = None, chain=None,
                 tile_rows: tuple | None = None):
        self.backend = backend
        self.device = torch.device(device)
        self.problem_sizes = tuple(tuple(int(v) for v in p) for p in problem_sizes)
        self.num_groups = len(self.problem_sizes)
        if choice is None:  # a backend of one's choosing (bind_input_set): its first kernel
            chain = backend.kernel_chain(self.problem_sizes)
            choice = chain[0]
        self.choice = choice
        self.chain = chain if chain is not None else (choice,)
        self.kernel_key = choice.kernel_key(self.num_groups)
        if tile_rows is None:
            tile_rows = () if choice.host else tuple(backend.plan_tiles(self.problem_sizes, choice))
        self.tile_rows = tile_rows
        self.num_tiles = len(self.tile_rows)
        self.spec = PlanSpec(choice, self.problem_sizes, self.device, self.tile_rows)
        device_buf, self._host_staging, (self.sizes, self.tiles) = upload_int_tables(
            self.device, [("i", self.problem_sizes), ("i", self.tile_rows)]
        )
        self.tables = Written(device_buf, self.device)
        # Launches of this plan on different streams are ordered when they share scratch
        self.scratch_event = None
        self.scratch_stream = None
        self.backend_plan = None if choice.host else backend.prepare(self.spec)
        self.nbytes = device_buf.numel() + (0 if self.backend_plan is None else self.backend_plan.nbytes)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Tell torch's allocator the plan's buffers are read on `stream` (memory freed on
        eviction is then not reused before that stream's work finished)."""
        self.tables.value.record_stream(stream)
        if self.backend_plan is not None:
            self.backend_plan.record_stream(stream)


class LaunchMode(enum.Enum):
    """How a binding's calls launch (Binding.mode)."""

    HOST = "host computation"  # the chain's last link: custom_kernel computes it with torch ops
    NOTHING = "nothing to launch"  # every group has M = 0 (a 0-CTA grid is invalid)
    FIRST_DIRECT = "direct, then recorded"  # the first call launches directly, the second records
    GRAPH = "graph replay"  # the recorded CUDA graph (Binding.graph), on any stream
    DIRECT = "direct"  # every call: graphs off, a plan that does not allow them, or a failed record


class Binding:
    """One input set (its data pointers) bound to its plan: the pointer table the kernel
    reads (ptrs int64 [G, 5]: a, b, c, sfa_reordered, sfb_reordered), the backend's
    per-pointer state (`bound`: the sm_100 TMA descriptors, a Written, or None), its launch
    mode, and the launch prepared for the stream it last ran on (None: a host computation,
    which custom_kernel runs on the input set itself)."""

    __slots__ = (
        "_host_staging", "bound", "graph", "launch", "launched", "mode", "plan", "pointers", "ptrs", "stream",
        "table",
    )

    def __init__(self, plan: Plan, pointers, table: Written | None = None):
        self.plan = plan
        self.pointers = tuple(tuple(int(v) for v in p) for p in pointers)
        if table is None:
            device_buf, self._host_staging, (self.ptrs,) = upload_int_tables(plan.device, [("q", self.pointers)])
            self.table = Written(device_buf, plan.device)
        else:
            # the pointer table its first call copied to the device (_launch_first_call): these
            # pointers, int64 [G, 5] from its start; no copy on this call's stream
            self._host_staging, self.table = None, table
            num_groups = len(self.pointers)
            self.ptrs = table.value[: 8 * NUM_PTR_COLS * num_groups].view(torch.int64).view(num_groups, NUM_PTR_COLS)
        self.bound = None if plan.choice.host else plan.backend.write_descriptors(plan, self.pointers, self.ptrs)
        self.stream = None
        self.launch = None
        self.graph: GraphLaunch | None = None
        self.launched = False  # a direct launch has run (FIRST_DIRECT records at the next call)
        if plan.choice.host:
            self.mode = LaunchMode.HOST
        elif plan.num_tiles == 0:
            self.mode = LaunchMode.NOTHING
        elif switches.CURRENT.graph_launch and _can_record(plan):  # launch.records_graph's policy
            self.mode = LaunchMode.FIRST_DIRECT
        else:
            self.mode = LaunchMode.DIRECT

    def _direct_launcher(self, stream: cuda.CUstream) -> Callable[[], None]:
        launches = self.plan.backend.launch_args(self.plan, self, stream)
        if not isinstance(launches, list):  # one launch
            launches = [launches]
        # each a CellArgs, or a (compiled, DSL arguments) pair; several run in order (a
        # pre-pass, then the GEMM)
        return in_order([entry.launcher() if isinstance(entry, CellArgs) else make_launcher(entry[0], *entry[1])
                         for entry in launches])

    def prepare_launch(self, stream: cuda.CUstream) -> None:
        """Prepare the launch for `stream` (torch's current stream).

        The first call of an input set launches directly; its second call records the launch
        as a CUDA graph and later calls replay it (EXPERIMENTS E57). An input set seen once
        never pays a capture.
        On a stream other than the one that wrote the tables or descriptors, the stream first
        waits for that writing.

        Inside a caller's CUDA graph capture the launch goes straight into the caller's graph:
        no graph of our own, no waits on events recorded outside the capture (the writing
        happened in an eager call before it, and torch.cuda.graph synchronizes first), no
        scratch ordering across streams; the binding is kept alive beyond the LRU bound
        (_CAPTURED) since the caller's graph reads its tables at every replay."""
        plan = self.plan
        self.stream = stream
        if self.mode is LaunchMode.HOST:
            self.launch = None
            return
        if self.mode is LaunchMode.NOTHING:
            self.launch = no_launch
            return
        if _capturing():
            self.launch = self._direct_launcher(stream)
            self.stream = None  # after the capture, the next call prepares its own launch again
            _retire(_CAPTURED.put((plan.problem_sizes, self.pointers), self))
            return
        for written in (plan.tables, self.table, self.bound):
            if isinstance(written, Written):
                written.order_before(stream)
        if self.mode is LaunchMode.FIRST_DIRECT and self.launched and records_graph():
            try:
                self.graph = GraphLaunch(self._direct_launcher, plan.device)
                self.mode = LaunchMode.GRAPH
            except Exception:  # noqa: BLE001 - the direct launch reports any real error
                self.mode = LaunchMode.DIRECT
        if self.mode is LaunchMode.GRAPH:
            launch = self.graph.launcher(stream)
        elif self.mode is LaunchMode.FIRST_DIRECT:
            direct = self._direct_launcher(stream)

            def launch():
                direct()
                self.launched = True
                self.stream = None  # the next call prepares again: it records the graph

        else:
            launch = self._direct_launcher(stream)
        if plan.device.type == "cuda" and plan.backend_plan.shared_scratch:
            launch = _ordered_on_scratch(plan, stream, launch)
        self.launch = launch
        if plan.device.type == "cuda":
            # Tables (and descriptors) written on another stream (a miss on S1, now launched
            # on S2): keep their memory alive for S2's work after an eviction.
            torch_stream = torch.cuda.current_stream(plan.device)
            self.table.value.record_stream(torch_stream)
            plan.record_stream(torch_stream)
            if isinstance(self.bound, Written):
                self.bound.value.record_stream(torch_stream)

    def run(self, stream: cuda.CUstream) -> None:
        if stream is not self.stream:
            self.prepare_launch(stream)
        self.launch()


def _can_record(plan: Plan) -> bool:
    """A CUDA device, something to launch, and a backend plan that allows graph replay (not
    the sm_90 swap-AB calls chained by programmatic dependent launch)."""
    return plan.device.type == "cuda" and plan.num_tiles > 0 and plan.backend_plan.graph_launch



def _ordered_on_scratch(plan: Plan, stream: cuda.CUstream, launch: Callable[[], None]) -> Callable[[], None]:
    """`launch` ordered after the plan's previous launch when that went to another stream:
    the input sets of a plan share its scratch (the stream-K workspace and counters).

    Only a change of stream costs anything: an event recorded then on the previous stream
    covers everything queued there, the plan's last launch included, and the new stream
    waits for it. Launches on one stream are ordered by the stream itself."""
    if plan.scratch_event is None:
        plan.scratch_event = _CudaEvent()
    event = plan.scratch_event.event

    def ordered():
        previous = plan.scratch_stream
        if previous is not None and previous is not stream:
            if cuda.cuEventRecord(event, previous)[0] == cuda.CUresult.CUDA_SUCCESS:
                _check_cuda(cuda.cuStreamWaitEvent(stream, event, 0)[0], "cuStreamWaitEvent")
            else:  # the previous stream is gone: wait for all work of the context
                _check_cuda(cuda.cuCtxSynchronize()[0], "cuCtxSynchronize")
        launch()
        plan.scratch_stream = stream

    return ordered


def bind_input_set(data, backend, kernel: str | None = None) -> Binding:
    """Validate one input set and bind it to a new plan for `backend`, outside every cache and
    without fallback (a test or benchmark entry for a backend of one's choosing): the
    chain's first kernel, or the one named `kernel`. binding.run(stream) launches it
    (directly on its first run, as a recorded graph from its second on); a host
    computation's binding has no launch (run_with_backend runs it)."""
    problem_sizes = validate_inputs(data)
    backend.can_implement(problem_sizes)
    device = data[0][0][0].device
    chain = backend.kernel_chain(problem_sizes)
    if kernel is not None:
        names = [choice.name for choice in chain]
        if kernel not in names:
            raise ValueError(f"kernel {kernel!r}: these sizes' chain on {backend.name} is {names}")
        chain = chain[names.index(kernel):]
    with device_context(device):
        return Binding(Plan(backend, problem_sizes, device, chain[0], chain), pointers_of(data))


def run_with_backend(data, backend, kernel: str | None = None) -> list[torch.Tensor]:
    """bind_input_set, then one direct launch on torch's current stream; the c list."""
    binding = bind_input_set(data, backend, kernel)
    outputs = [c for _, _, c in data[0]]
    if binding.plan.choice.host:
        return HOST_COMPUTATIONS[binding.plan.choice.name](data, outputs)
    binding.mode = LaunchMode.DIRECT  # one launch: nothing to record
    with device_context(binding.plan.device):
        binding.run(_stream_for_current())
    return outputs


# Input sets (bindings) by data pointers, plans by (device, sizes, backend). A plan holds device
# memory (the stream-K workspace: 23 MB for benchmark shape 0): 32 plans and 1 GiB at most; a binding holds its pointer table, so an evicted plan's bindings
# go with it.
_BINDINGS = RuntimeCache(max_entries=64)
# Bindings whose launch a caller's CUDA graph captured: kept beyond _BINDINGS' bound, since the
# graph reads their tables (and descriptors) at every replay
_CAPTURED = RuntimeCache(max_entries=256)
# What the caches evict during a caller's capture: launch.retire (one place for both entries)
_retire = retire
_PLANS = RuntimeCache(max_entries=32, max_bytes=1 << 30)
# Size plans by (device, sizes, backend): what an input set's first call needs, no device memory
_SIZE_PLANS = RuntimeCache(max_entries=256, max_bytes=16 << 20)
# Input sets (pointers and sizes) that ran once without a binding: their next call binds them
_SEEN_ONCE = RuntimeCache(max_entries=1024)
_BACKEND_BY_DEVICE: dict = {}


def cuda_query(entry: str, query, *args):
    """query(*args), a torch.cuda query; where torch sees no CUDA GPU, one line of ours in place
    of torch's error (a CPU build's AssertionError, a driver's RuntimeError)."""
    try:
        return query(*args)
    except (AssertionError, RuntimeError):
        if torch.cuda.is_available():
            raise
        raise RuntimeError(f"{entry}: needs a CUDA GPU (B200 sm_100 or H100/H200 sm_90); torch {torch.__version__} "
                           "sees none") from None


def select_backend(device_index: int):
    """The backend of GPU `device_index` (made once): the leaderboard file's sm_100a kernels
    launched on the caller's stream on a B200, the Hopper kernels on an H100/H200."""
    backend = _BACKEND_BY_DEVICE.get(device_index)
    if backend is None:
        capability = cuda_query("select_backend", torch.cuda.get_device_capability, device_index)
        if capability[0] == 10:
            from .sm100 import Sm100StreamBackend

            num_sms = torch.cuda.get_device_properties(device_index).multi_processor_count
            backend = Sm100StreamBackend(core.SM100_KERNEL, num_sms)
        elif capability == (9, 0):
            from .hopper import make_backend

            backend = make_backend()
        else:
            name = torch.cuda.get_device_name(device_index)
            raise RuntimeError(
                f"GPU {device_index} ({name}) has compute capability {capability[0]}.{capability[1]}; "
                f"nvfp4_group_gemm supports {SUPPORTED_GPUS}."
            )
        _BACKEND_BY_DEVICE[device_index] = backend
    return backend


def _drop_bindings(predicate) -> None:
    """Remove the bindings whose plan `predicate` selects (they would keep its memory alive;
    retired instead while a capture runs)."""
    _retire(_BINDINGS.drop(lambda binding: predicate(binding.plan)))


def _drop_plans(predicate) -> None:
    """Remove the plans that `predicate` selects, and their bindings."""
    _PLANS.drop(predicate)
    _SIZE_PLANS.drop(predicate)
    _drop_bindings(predicate)


def get_plan(backend, problem_sizes, device: torch.device) -> Plan:
    """The cached plan of these sizes on `device` for `backend`, or a new one on their size
    plan's kernel (the first of the backend's chain that is not demoted and compiles)."""
    key = (str(device), problem_sizes, backend.plan_key)
    plan = _PLANS.get(key)
    if plan is None:
        with RUNTIME_LOCK:
            size_plan = get_size_plan(backend, problem_sizes, device)
            plan = Plan(backend, problem_sizes, device, size_plan.choice, size_plan.chain, size_plan.tile_rows)
        evicted = _PLANS.put(key, plan)
        if evicted:
            _retire(evicted)
            _drop_bindings(lambda bound_plan: any(bound_plan is gone for gone in evicted))
    return plan


class SizePlan:
    """What an input set's first call of one size set needs, without device memory: the
    kernel chosen (and compiled) as get_plan chooses it, its tile rows (`tile_rows`, the
    backend's PackedTiles) packed after the sizes as the kernels read them (`head`: sizes
    int32 [G, 4] then tiles int32 [T, W], each on 16 bytes), where the pointer table (int64
    [G, 5]) and the backend's own table follow, and the backend's DirectLaunch (None: the
    backend runs bound input sets only). `device_head`: the head copied to the device (a
    Written) once a second input set of these sizes runs (_launch_first_call); `launched`:
    whether one has."""

    __slots__ = (
        "chain", "choice", "device_head", "direct", "extra_offset", "head", "kernel_key", "launched", "nbytes",
        "num_groups", "num_tiles", "problem_sizes", "ptr_format", "ptrs_offset", "table_bytes", "tile_rows",
        "tiles_offset",
    )

    def __init__(self, backend, problem_sizes, device: torch.device):
        backend.can_implement(problem_sizes)
        self.chain = backend.kernel_chain(problem_sizes)
        self.num_groups = len(problem_sizes)
        self.choice = choose_kernel(backend, self.chain, self.num_groups)
        self.kernel_key = self.choice.kernel_key(self.num_groups)
        self.problem_sizes = problem_sizes
        self.tile_rows = tile_rows = (PackedTiles(b"", 1) if self.choice.host
                                      else backend.pack_tiles(problem_sizes, self.choice))
        self.num_tiles = len(tile_rows)
        self.direct = None
        if not self.choice.host and self.num_tiles:
            self.direct = backend.direct_launch(PlanSpec(self.choice, problem_sizes, device, tile_rows))
        self.tiles_offset = align_up(16 * self.num_groups, 16)
        self.ptrs_offset = align_up(self.tiles_offset + len(tile_rows.data), 16)
        sizes = struct.pack(f"<{4 * self.num_groups}i", *flatten(problem_sizes))
        self.head = b"".join((sizes, bytes(self.tiles_offset - len(sizes)), tile_rows.data,
                              bytes(self.ptrs_offset - self.tiles_offset - len(tile_rows.data))))
        self.extra_offset = align_up(self.ptrs_offset + 8 * NUM_PTR_COLS * self.num_groups, 16)
        self.table_bytes = self.extra_offset + (0 if self.direct is None else self.direct.extra_bytes)
        self.ptr_format = f"<{NUM_PTR_COLS * self.num_groups}q"
        self.device_head, self.launched = None, False
        # the head, about as much in tile_rows, and the head's device copy once made
        self.nbytes = 3 * len(self.head)


def get_size_plan(backend, problem_sizes, device: torch.device) -> SizePlan:
    """The cached SizePlan of these sizes on `device` for `backend` (made under the lock)."""
    key = (str(device), problem_sizes, backend.plan_key)
    size_plan = _SIZE_PLANS.get(key)
    if size_plan is None:
        size_plan = SizePlan(backend, problem_sizes, device)
        _retire(_SIZE_PLANS.put(key, size_plan))
    return size_plan


class DirectTables(typing.NamedTuple):
    """Device addresses of a first call's tables (TableRing or CaptureArena)."""

    sizes: int
    tiles: int
    ptrs: int
    extra: int


def _launch_first_call(size_plan: SizePlan, key: tuple, stream, stream_handle: int, device: torch.device,
                       captured: bool):
    """Write the tables of an input set's first call into staging memory, copy them to the
    device on `stream` and launch the size plan's DirectLaunch there. Returns (what the launch
    keeps alive (the scratch), this input set's pointer table on the device (a Written) or
    None), or None when a capture's arena is full.

    The first input set of a size set (every call of a MoE step) copies all its tables (the
    size plan's head, its pointers, the DirectLaunch's own table) in one copy to the ring's
    mirror. From the second on, the head is on the device (copied once), and the input set's
    pointers and DirectLaunch table go to a table of its own, which its binding reads at its
    second call: a copy of a few hundred bytes, which the driver queues with the launches,
    where the head's kilobytes went through a copy engine, and no copy at that second call
    (EXPERIMENTS E74). Under a capture, all of them to the capture's arena, in one copy."""
    if captured:
        staged = _CAPTURE_ARENAS[device.index]
        offset = staged.take(size_plan.table_bytes)
        if offset is None:
            return None
    else:
        staged = table_ring(device)
        if size_plan.launched and size_plan.device_head is None:
            head = torch.empty(len(size_plan.head), dtype=torch.uint8, device=device)
            head_offset = staged.take(len(size_plan.head), stream)
            staged.buffer.host[head_offset: head_offset + len(size_plan.head)] = size_plan.head
            staged.copy_to(head_offset, len(size_plan.head), head, stream)
            size_plan.device_head = Written.on_stream(head, stream)
        size_plan.launched = True
        head = size_plan.device_head
        if head is not None:
            return _launch_on_device_head(size_plan, head, key, staged, stream, stream_handle, device)
        offset = staged.take(size_plan.table_bytes, stream)
    host = staged.buffer.host
    host[offset: offset + len(size_plan.head)] = size_plan.head
    struct.pack_into(size_plan.ptr_format, host, offset + size_plan.ptrs_offset,
                     *flatten(pointers_of_key(key, size_plan.num_groups)))
    keepalive = size_plan.direct.write_extra(host, offset + size_plan.extra_offset)
    staged.upload(offset, size_plan.table_bytes, stream)
    base = staged.device_base + offset
    tables = DirectTables(base, base + size_plan.tiles_offset, base + size_plan.ptrs_offset,
                          base + size_plan.extra_offset)
    size_plan.direct.launch(tables, stream_handle)
    return (keepalive if keepalive is not None else ()), None


def _launch_on_device_head(size_plan: SizePlan, head: Written, key: tuple, ring: TableRing, stream,
                           stream_handle: int, device: torch.device):
    """_launch_first_call of a known size set: the sizes and tile rows from the size plan's
    device head; this input set's pointers and the DirectLaunch's table staged in the ring and
    copied to a table of their own (pointers first, as a Binding reads them)."""
    if stream is not head.stream and device.type == "cuda":
        head.order_before(stream)  # written on another stream: wait for it, keep it for this one
        head.value.record_stream(torch.cuda.current_stream(device))
    extra_at = size_plan.extra_offset - size_plan.ptrs_offset
    nbytes = size_plan.table_bytes - size_plan.ptrs_offset
    table = torch.empty(nbytes, dtype=torch.uint8, device=device)
    offset = ring.take(nbytes, stream)
    host = ring.buffer.host
    struct.pack_into(size_plan.ptr_format, host, offset, *flatten(pointers_of_key(key, size_plan.num_groups)))
    keepalive = size_plan.direct.write_extra(host, offset + extra_at)
    ring.copy_to(offset, nbytes, table, stream)
    head_base, base = head.value.data_ptr(), table.data_ptr()
    size_plan.direct.launch(DirectTables(head_base, head_base + size_plan.tiles_offset, base, base + extra_at),
                            stream_handle)
    return (keepalive if keepalive is not None else ()), Written.on_stream(table, stream)


def _first_call(data, key: tuple, problem_sizes) -> list[torch.Tensor] | None:
    """An input set's first call, without a binding, where its size plan has a DirectLaunch
    whose kernel passed its self-check (or the check is off): the outputs, or None when the
    call takes the binding path (then nothing was launched). Under a caller's capture only an
    input set that ran once eagerly (its tables then go to the capture's arena)."""
    device = data[0][0][0].device
    seen_key = (key, problem_sizes)
    capturing = _capturing()
    if capturing and (seen_key not in _SEEN_ONCE or device.index not in _CAPTURE_ARENAS):
        return None
    with RUNTIME_LOCK, device_context(device):
        backend = select_backend(device.index)
        size_plan = get_size_plan(backend, problem_sizes, device)
        direct = size_plan.direct
        if (direct is None or (core.SELF_CHECK and size_plan.kernel_key not in SELF_CHECKED)
                or size_plan.table_bytes > TableRing.SEGMENT_BYTES):
            return None
        if not capturing and seen_key in _SEEN_ONCE:
            return None  # its second call: bind it (the hit path from now on)
        stream = _stream_for_current()
        try:
            launched = _launch_first_call(size_plan, key, stream, _stream_handle(stream), device, capturing)
        except torch.OutOfMemoryError as error:
            raise torch.OutOfMemoryError(
                f"custom_kernel: out of GPU memory for the activation scratch of a first call of sizes "
                f"{list(problem_sizes)}; nothing was launched or cached ({one_line(error)})"
            ) from error
        except Exception:  # the binding path launches again and handles the failure
            if capturing:
                raise
            return None
        if launched is None:
            return None
        keepalive, table = launched
        if capturing:
            _retire(_CAPTURED.put(("first call", seen_key), (size_plan, keepalive)))
        else:
            # its second call binds on this table where there is one (_bound_input_set)
            _SEEN_ONCE.put(seen_key, True if table is None else table)
    return list(map(_c_of_group, data[0]))


def _new_binding(backend, problem_sizes, device, key: tuple, table: Written | None = None) -> Binding:
    """A binding on the plan of these sizes (on `table`, its first call's pointer table, where
    given). Writing its descriptors launches the chosen kernel's init kernel: a failure there
    that leaves the context usable demotes that kernel, and the binding is made on the next
    link's plan."""
    while True:
        plan = get_plan(backend, problem_sizes, device)
        try:
            return Binding(plan, pointers_of_key(key, len(problem_sizes)), table)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            if plan.choice.host or not context_usable(plan.device):
                raise
            demote(backend.name, plan.choice, plan.chain, plan.num_groups,
                   f"descriptor init failed ({one_line(error)})")


def _bound_input_set(data, key: tuple | None) -> "Binding | list[torch.Tensor]":
    """The validating path for an input set of input_key `key` (None: not computed, the input
    may be malformed): checked sizes, then the cached binding of these pointers, the outputs
    of a first call launched without a binding (_first_call), or a new binding on the plan of
    these sizes. One thread at a time (compilation and the caches)."""
    key, problem_sizes = checked_input(data, key)
    with RUNTIME_LOCK:
        release_retired()
        binding = _BINDINGS.get(key)
        if binding is None or binding.plan.problem_sizes != problem_sizes:
            if switches.CURRENT.first_call_unbound:
                outputs = _first_call(data, key, problem_sizes)
                if outputs is not None:
                    return outputs
            if _capturing():
                raise RuntimeError(
                    "custom_kernel: this input set (these sizes and tensors) has not run outside a CUDA "
                    "graph capture yet; call custom_kernel once eagerly with the same tensors before "
                    "capturing (a first call plans, may compile, and writes tables, which a capture cannot)"
                )
            device = data[0][0][0].device
            table = _SEEN_ONCE.entries.get((key, problem_sizes))
            try:
                with device_context(device):
                    binding = _new_binding(select_backend(device.index), problem_sizes, device, key,
                                           table if isinstance(table, Written) else None)
            except torch.OutOfMemoryError as error:
                raise torch.OutOfMemoryError(
                    f"custom_kernel: out of GPU memory while building the plan or binding of sizes "
                    f"{list(problem_sizes)}; nothing was cached, a later call builds it again "
                    f"({one_line(error)})"
                ) from error
            _BINDINGS.put(key, binding)
    return binding


def custom_kernel(data: input_t) -> output_t:
    """Compute every group's C into its `c` tensor and return [c_0, ..., c_{G-1}]."""
    binding, key = cached_binding(_BINDINGS.entries, data)
    first_use = binding is None
    if first_use:
        binding = _bound_input_set(data, key)
        if type(binding) is list:  # a first call, launched without a binding
            return binding
    if _current_raw_stream is not None:
        stream = _STREAM_OBJECTS.entries.get(_current_raw_stream(cuda_get_device()))
    else:
        stream = None
    if stream is None:
        stream = _stream_for_current()
    if stream is not binding.stream:
        with RUNTIME_LOCK:
            binding.prepare_launch(stream)
    launch = binding.launch
    if launch is None:  # a host computation (the chain's last link)
        return HOST_COMPUTATIONS[binding.plan.choice.name](data, list(map(_c_of_group, data[0])))
    try:
        launch()
    except Exception as error:  # noqa: BLE001 - a failed launch moves its kernel down the chain
        return _after_failed_launch(data, binding, error)
    if first_use and binding.plan.kernel_key not in SELF_CHECKED:
        return first_use_check(data, binding)
    return list(map(_c_of_group, data[0]))



_c_of_group = operator.itemgetter(2)
no_launch = core.no_launch


# -----------------------------------------------------------------------------
# For tools (selfcheck.py, bench/host_overhead.py): the runtime's state through functions, its
# caches' names private
# -----------------------------------------------------------------------------
def binding_of(key: tuple) -> Binding | None:
    """The binding of the input set of input_key `key` (its plan's choice: the kernel its
    calls run), touched as most recently used; None before its second call (a first call
    binds nothing), or after an eviction or a demotion dropped it."""
    return _BINDINGS.get(key)


def current_stream() -> cuda.CUstream:
    """torch's current stream as the cuda.CUstream a launch takes (Binding.run), one object
    per handle, made once: what custom_kernel looks up at every call."""
    return _stream_for_current()


def forget_size_plans() -> None:
    """Forget every size plan, so that the next call of each size set chooses its kernel and
    packs its tables again (a benchmark timing new-size calls); compiled kernels stay."""
    with RUNTIME_LOCK:
        _SIZE_PLANS.clear()


def launch_first_call(size_plan: SizePlan, key: tuple, device: torch.device) -> None:
    """Launch the input set of input_key `key` as custom_kernel launches its first call (no
    binding), for `size_plan` (get_size_plan of its sizes), on torch's current stream, outside
    a capture: its tables written to staging memory, copied, and the kernels launched. A tool's
    timing of that phase; the launch's scratch is kept until the stream has used it."""
    stream = _stream_for_current()
    _launch_first_call(size_plan, key, stream, _stream_handle(stream), device, False)
SUPPORTED_GPUS = "NVIDIA B200/GB200 (sm_100, compute capability 10.x) and H100/H200 (sm_90, 9.0)"


def context_usable(device: torch.device) -> bool:
    """After a failed launch: can the context still run work? Never under a capture (it
    cannot synchronize; the caller sees the error)."""
    return not _capturing() and core.context_usable(device)


def _after_failed_launch(data, binding: Binding, error: Exception) -> list[torch.Tensor]:
    """A launch raised: demote its kernel and compute the call again on the next link, if
    the context is still usable; re-raise otherwise."""
    plan = binding.plan
    if not context_usable(plan.device):
        raise error
    demote(plan.backend.name, plan.choice, plan.chain, plan.num_groups, f"launch failed ({one_line(error)})")
    return custom_kernel(data)


def first_use_check(data, binding: Binding) -> list[torch.Tensor]:
    """The leaderboard file's first-use check of the binding's kernel; skipped under a
    caller's graph capture (it synchronizes)."""
    if _capturing():
        return list(map(_c_of_group, data[0]))
    return core.first_use_check(data, binding.plan)


def _forget_plans_of(kernel_key: tuple) -> None:
    """A demotion (of this runtime or the leaderboard file's): drop the plans that run the
    kernel and their bindings (their size sets plan again on their next call)."""
    _drop_plans(lambda plan: plan.kernel_key == kernel_key)


core.DEMOTION_LISTENERS.append(_forget_plans_of)


def reset_runtime() -> None:
    """Forget every input set (bound or run once), plan, size plan, backend, demotion and
    self-check result of every runtime, the MoE entry's plans and bindings included
    (moe.reset_moe; compiled kernels stay): the process as it was before its first call, for
    tests and for a caller that changed an environment switch (the library's switches are read
    again: nvfp4_group_gemm.switches). Replay no graph captured before."""
    from . import moe  # imported here: the MoE entry imports nothing of this module

    with RUNTIME_LOCK:
        for cache in (_BINDINGS, _PLANS, _SIZE_PLANS, _SEEN_ONCE, _CAPTURED):
            cache.clear()
        RETIRED.clear()
        _BACKEND_BY_DEVICE.clear()
        core.reset_runtime()
        moe.reset_moe()
        switches.reload()  # last: a bad value raises with everything else already reset


def warmup(n: int, k: int, groups: int, device=None) -> list[str]:
    """Compile every kernel the automatic choice can pick for `groups` groups of N = n and
    K = k, whatever their M, on `device` (the current CUDA device when None), so that no later
    call of that family compiles: a serving engine calls it once per (G, N, K) at start-up.
    Returns the kernels compiled (a compile failure demotes the kernel, as in a call)."""
    core.check_family(n, k, groups)
    device = (torch.device("cuda", cuda_query("warmup", torch.cuda.current_device)) if device is None
              else torch.device(device))
    return core.compile_family(select_backend(device.index), device, n, k, groups)
