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
    CAPTURE_ARENAS,
    STREAM_OBJECTS,
    CellArgs,
    CudaEvent,
    GraphLaunch,
    StreamRuntime,
    TableRing,
    Written,
    check_cuda,
    cuda_get_device,
    current_raw_stream,
    handle_of,
    is_capturing,
    make_launcher,
    records_graph,
    stream_for_current,
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
in_order = core.in_order
pointers_of = core.pointers_of
pointers_of_key = core.pointers_of_key
choose_kernel = core.choose_kernel
one_line = core.one_line
align_up = core.align_up
flatten = core.flatten
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


class Plan(core.Plan):
    """The core's plan (core.Plan: the chosen kernel, its chain, the sizes and tile tables,
    the backend's part), its tables written on the caller's stream (a Written: ordered before
    a launch on another stream), with the order of its launches on the scratch it shares
    (`scratch_event`, `scratch_stream`: _ordered_on_scratch)."""

    __slots__ = ("_host_staging", "scratch_event", "scratch_stream")

    def __init__(self, backend, problem_sizes, device, choice: KernelChoice | None = None, chain=None,
                 tile_rows: tuple | None = None):
        # Launches of this plan on different streams are ordered when they share scratch
        self.scratch_event = None
        self.scratch_stream = None
        super().__init__(backend, problem_sizes, device, choice, chain, tile_rows)

    def upload(self, tables):
        device_buf, self._host_staging, views = upload_int_tables(self.device, tables)
        return Written(device_buf, self.device), views, device_buf.numel()

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


class Binding(core.Binding):
    """The core's binding (core.Binding: the pointer table, the backend's per-pointer state),
    with its launch mode and the launch prepared for the stream it last ran on (None: a host
    computation, which custom_kernel runs on the input set itself). `table`: a Written, its
    own or the one its first call wrote (_launch_first_call)."""

    __slots__ = ("_host_staging", "graph", "launched", "mode", "stream")

    def upload(self, table: Written | None):
        if table is None:
            device_buf, self._host_staging, (ptrs,) = upload_int_tables(self.plan.device, [("q", self.pointers)])
            return Written(device_buf, self.plan.device), ptrs
        # the pointer table its first call copied to the device (_launch_first_call): these
        # pointers, int64 [G, 5] from its start; no copy on this call's stream
        self._host_staging = None
        num_groups = len(self.pointers)
        return table, table.value[: 8 * NUM_PTR_COLS * num_groups].view(torch.int64).view(num_groups, NUM_PTR_COLS)

    def prepare(self) -> None:
        """Its launch mode; the launch itself is prepared per stream (prepare_launch)."""
        plan = self.plan
        self.stream = None
        self.graph = None  # a GraphLaunch once recorded
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
        (LibraryRuntime.captured) since the caller's graph reads its tables at every replay."""
        plan = self.plan
        self.stream = stream
        if self.mode is LaunchMode.HOST:
            self.launch = None
            return
        if self.mode is LaunchMode.NOTHING:
            self.launch = no_launch
            return
        if is_capturing():
            self.launch = self._direct_launcher(stream)
            self.stream = None  # after the capture, the next call prepares its own launch again
            RUNTIME.retire(RUNTIME.captured.put((plan.problem_sizes, self.pointers), self))
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
        plan.scratch_event = CudaEvent()
    event = plan.scratch_event.event

    def ordered():
        previous = plan.scratch_stream
        if previous is not None and previous is not stream:
            if cuda.cuEventRecord(event, previous)[0] == cuda.CUresult.CUDA_SUCCESS:
                check_cuda(cuda.cuStreamWaitEvent(stream, event, 0)[0], "cuStreamWaitEvent")
            else:  # the previous stream is gone: wait for all work of the context
                check_cuda(cuda.cuCtxSynchronize()[0], "cuCtxSynchronize")
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
    if binding.mode is LaunchMode.FIRST_DIRECT:
        binding.mode = LaunchMode.DIRECT  # one launch: nothing to record (NOTHING stays: no tiles, no launch)
    with device_context(binding.plan.device):
        binding.run(stream_for_current())
    return outputs


class LibraryRuntime(StreamRuntime):
    """The per-size-set entry's runtime: the core's (one miss path, one eviction cascade, one
    drop, one reset) on callers' streams (launch.StreamRuntime), plus an input set's first call
    launched without a binding (`unbound_call`: size plans, staged tables), whose pointer table
    its binding then reads (`make_binding`), and plans made on their size plan's kernel
    (`make_plan`).

    Its caches beyond the core's: `size_plans` by (device, sizes, backend), what a first call
    needs, no device memory (dropped with the plans of a demoted kernel); `seen_once`: input
    sets (pointers and sizes) that ran once without a binding, their next call binds them;
    `captured`: bindings whose launch a caller's CUDA graph captured, kept beyond the
    bindings' bound since the graph reads their tables (and descriptors) at every replay."""

    plan_type = Plan
    binding_type = Binding

    def __init__(self):
        # A plan holds device memory (the stream-K workspace: 23 MB for benchmark shape 0): 32
        # plans and 1 GiB at most; a binding holds its pointer table
        super().__init__("library", max_bindings=64, max_plans=32, max_plan_bytes=1 << 30)
        self.size_plans = RuntimeCache(max_entries=256, max_bytes=16 << 20)
        self.seen_once = RuntimeCache(max_entries=1024)
        self.captured = RuntimeCache(max_entries=256)
        self.plan_caches.append(self.size_plans)
        self.caches += [self.seen_once, self.captured]

    def select_backend(self, device_index: int):
        return select_backend(device_index)

    def reset(self) -> None:
        """Its caches and backends, then the library's switches read again (a bad value raises
        once everything is reset: core.reset_runtime)."""
        super().reset()
        _BACKEND_BY_DEVICE.clear()
        switches.reload()

    def unbound_call(self, data, key: tuple, problem_sizes):
        if switches.CURRENT.first_call_unbound:
            outputs = _first_call(data, key, problem_sizes)
            if outputs is not None:
                return outputs
        if is_capturing():
            raise RuntimeError(
                "custom_kernel: this input set (these sizes and tensors) has not run outside a CUDA "
                "graph capture yet; call custom_kernel once eagerly with the same tensors before "
                "capturing (a first call plans, may compile, and writes tables, which a capture cannot)"
            )
        return None

    def make_plan(self, backend, problem_sizes, device: torch.device) -> Plan:
        size_plan = get_size_plan(backend, problem_sizes, device)
        return Plan(backend, problem_sizes, device, size_plan.choice, size_plan.chain, size_plan.tile_rows)

    def make_binding(self, plan: Plan, key: tuple, problem_sizes) -> Binding:
        table = self.seen_once.get((key, problem_sizes))
        return Binding(plan, pointers_of_key(key, len(problem_sizes)), table if isinstance(table, Written) else None)


_BACKEND_BY_DEVICE: dict = {}
RUNTIME = LibraryRuntime()


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


class SizePlan:
    """What an input set's first call of one size set needs, without device memory: the
    kernel chosen (and compiled) as a plan's, its tile rows (`tile_rows`, the
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
    size_plan = RUNTIME.size_plans.get(key)
    if size_plan is None:
        size_plan = SizePlan(backend, problem_sizes, device)
        RUNTIME.retire(RUNTIME.size_plans.put(key, size_plan))
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
        staged = CAPTURE_ARENAS[device.index]
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
    capturing = is_capturing()
    if capturing and (seen_key not in RUNTIME.seen_once or device.index not in CAPTURE_ARENAS):
        return None
    with RUNTIME_LOCK, device_context(device):
        backend = select_backend(device.index)
        size_plan = get_size_plan(backend, problem_sizes, device)
        direct = size_plan.direct
        if (direct is None or (core.SELF_CHECK and size_plan.kernel_key not in SELF_CHECKED)
                or size_plan.table_bytes > TableRing.SEGMENT_BYTES):
            return None
        if not capturing and seen_key in RUNTIME.seen_once:
            return None  # its second call: bind it (the hit path from now on)
        stream = stream_for_current()
        try:
            launched = _launch_first_call(size_plan, key, stream, handle_of(stream), device, capturing)
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
            RUNTIME.retire(RUNTIME.captured.put(("first call", seen_key), (size_plan, keepalive)))
        else:
            # its second call binds on this table where there is one (LibraryRuntime.make_binding)
            RUNTIME.seen_once.put(seen_key, True if table is None else table)
    return list(map(c_of_group, data[0]))


def custom_kernel(data: input_t) -> output_t:
    """Compute every group's C into its `c` tensor and return [c_0, ..., c_{G-1}]."""
    binding, key = RUNTIME.bindings.get_input_set(data)
    first_use = binding is None
    if first_use:
        binding = RUNTIME.bound_input_set(data, key)
        if type(binding) is list:  # a first call, launched without a binding
            return binding
    if current_raw_stream is not None:
        stream = STREAM_OBJECTS.get(current_raw_stream(cuda_get_device()))
        if stream is None:
            stream = stream_for_current()
    else:
        stream = stream_for_current()
    if stream is not binding.stream:
        with RUNTIME_LOCK:
            binding.prepare_launch(stream)
    launch = binding.launch
    if launch is None:  # a host computation (the chain's last link)
        return HOST_COMPUTATIONS[binding.plan.choice.name](data, list(map(c_of_group, data[0])))
    try:
        launch()
    except Exception as error:  # noqa: BLE001 - a failed launch moves its kernel down the chain
        RUNTIME.after_failed_launch(binding.plan, error)
        return custom_kernel(data)
    if first_use and binding.plan.kernel_key not in SELF_CHECKED:
        return RUNTIME.first_use_check(data, binding.plan)
    return list(map(c_of_group, data[0]))



c_of_group = operator.itemgetter(2)
no_launch = core.no_launch


# -----------------------------------------------------------------------------
# For tools (selfcheck.py, bench/host_overhead.py): the runtime's state through functions, its
# caches' names private
# -----------------------------------------------------------------------------
def binding_of(key: tuple) -> Binding | None:
    """The binding of the input set of input_key `key` (its plan's choice: the kernel its
    calls run), touched as most recently used; None before its second call (a first call
    binds nothing), or after an eviction or a demotion dropped it."""
    return RUNTIME.bindings.get(key)


def current_stream() -> cuda.CUstream:
    """torch's current stream as the cuda.CUstream a launch takes (Binding.run), one object
    per handle, made once: what custom_kernel looks up at every call."""
    return stream_for_current()


def forget_size_plans() -> None:
    """Forget every size plan, so that the next call of each size set chooses its kernel and
    packs its tables again (a benchmark timing new-size calls); compiled kernels stay."""
    with RUNTIME_LOCK:
        RUNTIME.size_plans.clear()


def launch_first_call(size_plan: SizePlan, key: tuple, device: torch.device) -> None:
    """Launch the input set of input_key `key` as custom_kernel launches its first call (no
    binding), for `size_plan` (get_size_plan of its sizes), on torch's current stream, outside
    a capture: its tables written to staging memory, copied, and the kernels launched. A tool's
    timing of that phase; the launch's scratch is kept until the stream has used it."""
    stream = stream_for_current()
    _launch_first_call(size_plan, key, stream, handle_of(stream), device, False)
SUPPORTED_GPUS = "NVIDIA B200/GB200 (sm_100, compute capability 10.x) and H100/H200 (sm_90, 9.0)"


# The one reset: every runtime of the process (this one's, the MoE entry's, the leaderboard file's
# core's), each input set, plan, size plan, backend, demotion and self-check result (compiled
# kernels stay), and the library's switches read again (LibraryRuntime.reset): the process as
# before its first call, for tests and for a caller that changed a switch. Replay no graph
# captured before.
reset_runtime = core.reset_runtime


def warmup(n: int, k: int, groups: int, device=None) -> list[str]:
    """Compile every kernel the automatic choice can pick for `groups` groups of N = n and
    K = k, whatever their M, on `device` (the current CUDA device when None), so that no later
    call of that family compiles: a serving engine calls it once per (G, N, K) at start-up.
    Returns the kernels compiled (a compile failure demotes the kernel, as in a call)."""
    core.check_family(n, k, groups)
    device = (torch.device("cuda", cuda_query("warmup", torch.cuda.current_device)) if device is None
              else torch.device(device))
    return core.compile_family(select_backend(device.index), device, n, k, groups)
