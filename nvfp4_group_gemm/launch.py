"""Launch machinery for callers beyond the leaderboard: where each launch goes (the caller's
current stream, read at every call), tables staged in pinned memory and copied on that
stream (TableRing; CaptureArena under a caller's capture), launches with argument cells
(CellLauncher), a launch recorded once as a CUDA graph and replayed (GraphLaunch), and
buffers written on one stream that another reads (Written)."""

import contextlib
import ctypes
import struct
import typing
from collections.abc import Callable
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import torch
from cutlass import cute
from cutlass.cute.runtime import make_ptr

from nvfp4_group_gemm import core, switches

align_up = core.align_up
flatten = core.flatten
device_context = core.device_context
current_device_index = core.current_device_index
device_executor = core.device_executor
make_launcher = core.make_launcher
# One lock for both runtimes: compilation (the DSL's session state is not thread-safe), the
# caches' misses, the shared ring
RUNTIME_LOCK = core.RUNTIME_LOCK


class LaunchCell:
    """One argument of a compiled DSL function whose value is set before each launch: a
    ctypes value the function's packed arguments point at (the DSL's protocol for an
    argument already converted: ``__c_pointers__``)."""

    __slots__ = ("storage",)

    def __init__(self, ctype, storage=None):
        self.storage = ctype() if storage is None else storage

    def __c_pointers__(self):
        return [ctypes.addressof(self.storage)]


# What each kind of cell holds, and what the plain DSL call takes in its place
_CELL_TYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "stream": ctypes.c_void_p}
# Each cell of a launch in an 8-byte slot of one buffer (a pointer or a stream handle as "Q", an
# int32 as "i" and 4 pad bytes): one struct.pack_into sets every argument of a launch (12
# arguments: 1.2 µs against 1.8 for a ctypes assignment per cell, a CPU here; EXPERIMENTS E79)
_SLOT_FORMATS = {"ptr": "Q", "i32": "i4x", "stream": "Q"}


def cell_block(kinds: tuple[str, ...]) -> tuple[Any, list[LaunchCell], struct.Struct]:
    """The buffer of one launch's argument cells, the cells (views into it, in `kinds` order)
    and the format that packs their values into it."""
    buffer = (ctypes.c_uint64 * len(kinds))()
    cells = [LaunchCell(_CELL_TYPES[kind], _CELL_TYPES[kind].from_buffer(buffer, 8 * index))
             for index, kind in enumerate(kinds)]
    return buffer, cells, struct.Struct("=" + "".join(_SLOT_FORMATS[kind] for kind in kinds))


class CellLauncher:
    """``compiled(*args)`` with arguments given per launch, its execution arguments built once
    (one per compiled function and device): a call sets the cells and launches. `kinds` names
    each argument: "ptr" (a global address, as cute.Pointer of `dtypes[i]`), "i32", "stream"
    (a raw CUstream handle). The packed call is core.PreparedCall's (the one place that knows
    the DSL's internals); None there: the plain DSL call. Not thread-safe: the runtime calls it
    under its lock."""

    __slots__ = ("buffer", "cells", "dtypes", "kinds", "plain", "prepared", "run_prepared", "slots")

    def __init__(self, compiled, kinds: tuple[str, ...], dtypes: tuple):
        self.kinds, self.dtypes = kinds, dtypes
        self.buffer, self.cells, self.slots = cell_block(kinds)
        self.plain = compiled
        self.prepared = core.PreparedCall.prepare(compiled, *self.cells)
        self.run_prepared = None if self.prepared is None else self.prepared.launcher()

    def bound(self, values) -> Callable[[], None]:
        """A launch of `values` fixed now (a binding's): its own cells and packed arguments,
        built with ctypes alone (no DSL argument conversion)."""
        if self.prepared is None:
            args = [_plain_argument(kind, dtype, value) for kind, dtype, value in zip(self.kinds, self.dtypes, values)]
            return lambda: self.plain(*args)
        buffer, cells, slots = cell_block(self.kinds)
        slots.pack_into(buffer, 0, *values)
        launch = self.prepared.launcher(self.prepared.packed([ctypes.addressof(c.storage) for c in cells]))
        launch.cells = (buffer, cells)  # the packed arguments point into them
        return launch

    def __call__(self, *values) -> None:
        if self.prepared is None:
            self.plain(*(_plain_argument(kind, dtype, value)
                         for kind, dtype, value in zip(self.kinds, self.dtypes, values)))
            return
        self.slots.pack_into(self.buffer, 0, *values)
        self.run_prepared()


def _plain_argument(kind: str, dtype, value):
    if kind == "ptr":
        return make_ptr(dtype, value, cute.AddressSpace.gmem, assumed_align=16)
    if kind == "i32":
        return cutlass.Int32(value)
    return cuda.CUstream(value)


class CellArgs(typing.NamedTuple):
    """One launch of a backend's launch_args as raw values (CellLauncher's kinds and
    dtypes): a binding's prepared launch is then built with ctypes alone."""

    compiled: Any
    kinds: tuple
    dtypes: tuple
    values: tuple

    def launcher(self) -> Callable[[], None]:
        return cell_launcher(self.compiled, self.kinds, self.dtypes).bound(self.values)


def cell_launcher(compiled, kinds: tuple[str, ...], dtypes: tuple) -> CellLauncher:
    """The CellLauncher of `compiled` on the current device (kept on the compiled function,
    as its executors are)."""
    launchers = compiled.__dict__.setdefault("_nvfp4_cell_launchers", {})
    device = current_device_index()
    launcher = launchers.get(device)
    if launcher is None:
        launcher = launchers[device] = CellLauncher(compiled, kinds, dtypes)
    return launcher



class PinnedHostBuffer:
    """Pinned host memory (the source of an asynchronous cuMemcpyHtoDAsync): `host` is the
    buffer as Python writes it, `base` its address. On a CPU device (the tests) a plain
    buffer, read by the host-side stand-ins at its own address."""

    __slots__ = ("_storage", "base", "host", "pinned", "size")

    def __init__(self, device: torch.device, size: int):
        self.size, self.pinned = size, False
        if device.type == "cuda":
            with device_context(device):
                result, base = cuda.cuMemHostAlloc(size, cuda.CU_MEMHOSTALLOC_PORTABLE)
                check_cuda(result, "cuMemHostAlloc")
                self.base, self.pinned = int(base), True
            self.host = memoryview((ctypes.c_char * size).from_address(self.base)).cast("B")
        else:
            self._storage = storage = (ctypes.c_char * (size + 128))()
            pad = -ctypes.addressof(storage) % 128  # aligned as a pinned allocation is
            self.host = memoryview(storage).cast("B")[pad: pad + size]
            self.base = ctypes.addressof(storage) + pad

    def __del__(self):
        if getattr(self, "pinned", False):
            try:
                cuda.cuMemFreeHost(self.base)
            except Exception:  # noqa: BLE001, S110 - interpreter shutdown: the driver may be gone
                pass


class StagedTables:
    """Pinned host memory the host writes tables into (`buffer`, a PinnedHostBuffer) and its
    device mirror of the same size, which the kernels read: upload copies a written range on
    a stream (one cuMemcpyHtoDAsync). Kernels that read their tables in place from mapped host
    memory ran slower by the PCIe reads of every CTA (EXPERIMENTS E70). On a CPU device (the
    tests) no mirror: the device addresses are the host buffer's own."""

    __slots__ = ("buffer", "device_base", "mirror")

    def __init__(self, device: torch.device, size: int):
        self.buffer = PinnedHostBuffer(device, size)
        self.mirror = None
        self.device_base = self.buffer.base
        if device.type == "cuda":
            self.mirror = torch.empty(size, dtype=torch.uint8, device=device)
            self.device_base = self.mirror.data_ptr()

    def upload(self, offset: int, nbytes: int, stream) -> None:
        """Copy bytes offset .. offset + nbytes to the mirror on `stream` (a cuda.CUstream)."""
        if self.mirror is not None:
            check_cuda(cuda.cuMemcpyHtoDAsync(self.device_base + offset, self.buffer.base + offset, nbytes,
                                               stream)[0], "cuMemcpyHtoDAsync")

    def copy_to(self, offset: int, nbytes: int, destination: torch.Tensor, stream) -> None:
        """Copy bytes offset .. offset + nbytes to the start of `destination` (a tensor of at
        least nbytes on the staging's device) on `stream`; on a CPU device, at once."""
        if self.mirror is not None:
            check_cuda(cuda.cuMemcpyHtoDAsync(destination.data_ptr(), self.buffer.base + offset, nbytes,
                                               stream)[0], "cuMemcpyHtoDAsync")
        else:
            ctypes.memmove(destination.data_ptr(), self.buffer.base + offset, nbytes)


class TableRing(StagedTables):
    """The tables of launches that have no binding (an input set's first call): written by the
    host into pinned memory right before the launch, copied to the device mirror on the
    launch's stream (StagedTables).

    A ring of SEGMENTS segments: leaving a segment records an event on every stream that
    launched from it; entering it again waits for those events (the copies and launches of
    that segment ran long before, unless the host runs that far ahead of the GPU)."""

    SEGMENTS = 8
    SEGMENT_BYTES = 1 << 17

    __slots__ = ("events", "offset", "segment", "streams")

    def __init__(self, device: torch.device):
        super().__init__(device, self.SEGMENTS * self.SEGMENT_BYTES)
        self.events: list[list] = [[] for _ in range(self.SEGMENTS)]
        self.streams: list = []
        self.segment = self.offset = 0

    def take(self, nbytes: int, stream) -> int:
        """Offset of `nbytes` (at most SEGMENT_BYTES) for a launch on `stream` (a cuda.CUstream;
        anything else has no events: the CPU tests)."""
        nbytes = align_up(nbytes, 128)
        if nbytes > self.SEGMENT_BYTES:
            raise ValueError(f"TableRing.take: {nbytes} bytes; a segment holds {self.SEGMENT_BYTES}")
        if self.offset + nbytes > self.SEGMENT_BYTES:
            self._next_segment()
        if stream not in self.streams:
            self.streams.append(stream)
        offset = self.segment * self.SEGMENT_BYTES + self.offset
        self.offset += nbytes
        return offset

    def _next_segment(self) -> None:
        left = self.events[self.segment]
        for stream in self.streams:
            if isinstance(stream, cuda.CUstream):
                event = CudaEvent()
                if cuda.cuEventRecord(event.event, stream)[0] == cuda.CUresult.CUDA_SUCCESS:
                    left.append(event)
                else:  # the stream is gone (a caller's external stream): wait for all work
                    check_cuda(cuda.cuCtxSynchronize()[0], "cuCtxSynchronize")
        self.streams = []
        self.segment = (self.segment + 1) % self.SEGMENTS
        self.offset = 0
        for event in self.events[self.segment]:
            check_cuda(cuda.cuEventSynchronize(event.event)[0], "cuEventSynchronize")
        self.events[self.segment] = []


class CaptureArena(StagedTables):
    """Tables that a caller's CUDA graph reads at every replay (a first call captured): carved
    once from StagedTables allocated before any capture, never reused; the capture records
    their copy to the mirror, which every replay repeats. A capture cannot allocate pinned
    memory, so an exhausted arena refuses (the caller then runs the input set eagerly once
    more, which binds it)."""

    BYTES = 1 << 20

    __slots__ = ("offset",)

    def __init__(self, device: torch.device):
        super().__init__(device, self.BYTES)
        self.offset = 0

    def take(self, nbytes: int) -> int | None:
        nbytes = align_up(nbytes, 128)
        if self.offset + nbytes > self.BYTES:
            return None
        offset, self.offset = self.offset, self.offset + nbytes
        return offset


# A prepared launch recorded once per input set as a CUDA graph and replayed with
# cuGraphLaunch: a third of the prepared DSL call's CPU (EXPERIMENTS E57). The graph holds the
# kernel's parameters by value; nothing of the DSL is touched beyond the call it records.
# NVFP4_GRAPH_LAUNCH=0 launches the prepared calls directly instead, in both runtimes (the
# per-size-set path's and the MoE entry's; to compare, or to rule graphs out). The one graph
# policy of both: records_graph.


def records_graph(allowed: bool = True) -> bool:
    """The one graph policy of both entries: a binding (an input set's second call) records its
    launches as a CUDA graph, replayed by its later calls, at its first launch outside a
    caller's capture (inside one, its launches go straight into the caller's graph), where
    graphs are on (switches.CURRENT.graph_launch) and its plan allows (`allowed`: not the sm_90
    calls chained by programmatic dependent launch, which launch directly). True: record now."""
    return allowed and switches.CURRENT.graph_launch and not is_capturing()


# What a cache evicts while a caller's graph capture runs (bindings, plans, with the CUDA graphs
# of their replays and the scratch they read): kept until the next call outside a capture, since
# destroying a graph (cuGraphExecDestroy) inside a capture of the global mode, torch.cuda.graph's
# default, would invalidate the caller's capture. Both entries retire here.
RETIRED: list = []


def retire(evicted) -> None:
    """Keep `evicted` (what a cache evicted) alive while a capture runs."""
    if evicted and is_capturing():
        RETIRED.extend(evicted)


def release_retired() -> None:
    """Outside a capture: let go of what captures retired."""
    if RETIRED and not is_capturing():
        RETIRED.clear()


class StreamRuntime(core.Runtime):
    """The core's runtime (core.Runtime) where launches go to callers' streams, under their
    graph captures: what a cache evicts or drops while a capture runs is retired (`retire`), a
    miss first lets go of what captures retired, a failed launch under a capture is the
    caller's to see (the context cannot be synchronized then), and the first-use check (it
    synchronizes) waits for a call outside a capture. The library's two entries (the
    per-size-set runtime, the MoE entry) are instances of it."""

    def retire(self, entries) -> None:
        retire(entries)

    def before_miss(self) -> None:
        release_retired()

    def context_usable(self, device: torch.device) -> bool:
        return not is_capturing() and core.context_usable(device)

    def first_use_check(self, data, plan) -> list[torch.Tensor]:
        if is_capturing():
            return [c for _, _, c in data[0]]
        return core.first_use_check(data, plan)

    def reset(self) -> None:
        super().reset()
        RETIRED.clear()


def check_cuda(result, what: str) -> None:
    if result != cuda.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {result!r}")


# a private stream per device, on which GraphLaunch records
_CAPTURE_STREAMS: dict = {}


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
            check_cuda(cuda.cuStreamBeginCapture(stream, mode)[0], "cuStreamBeginCapture")
            try:
                launch()
            finally:
                # Always leave capture mode, also when the launch raised
                result, graph = cuda.cuStreamEndCapture(stream)
            check_cuda(result, "cuStreamEndCapture")
            try:
                result, graph_exec = cuda.cuGraphInstantiate(graph, 0)
                check_cuda(result, "cuGraphInstantiate")
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


def upload_int_tables(device, tables) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Copy integer tables to `device` in one buffer: (device buffer, host staging, views).

    `tables`: (struct code "q" or "i", rows of equal length). Each table starts on a 128-byte
    boundary. On a CUDA device the rows are packed into the device's TableRing (pinned, so
    the one cuMemcpyHtoDAsync on torch's current stream is asynchronous; the ring reuses those
    bytes only after the copy's stream passed them) and the host staging is None: no pinned
    allocation per table (torch's pinned allocator went to cudaHostAlloc for most of them
    when tables were made back to back: EXPERIMENTS E68). Elsewhere (the CPU tests) a plain
    copy from a host buffer, which is returned.
    """
    device = torch.device(device)
    layout, offset = core.table_layout(tables)
    # Packed in Python and copied as one buffer: half the CPU of one torch op per table
    # (EXPERIMENTS E58)
    buffer = torch.empty(offset, dtype=torch.uint8, device=device)
    through_ring = device.type == "cuda" and offset <= TableRing.SEGMENT_BYTES
    # the ring is shared (bind_input_set runs outside custom_kernel's lock)
    with RUNTIME_LOCK if through_ring else contextlib.nullcontext():
        if through_ring:
            stream = stream_for_current()
            ring = table_ring(device)
            base = ring.take(offset, stream)
            staging = ring.buffer.host
        else:
            staging, base = bytearray(offset), 0
        for (start, code, count, width, _), (_, rows) in zip(layout, tables):
            struct.pack_into(f"<{count * width}{code}", staging, base + start, *flatten(rows))
        if through_ring:
            check_cuda(cuda.cuMemcpyHtoDAsync(buffer.data_ptr(), ring.buffer.base + base, offset, stream)[0],
                        "cuMemcpyHtoDAsync")
            host = None
        else:  # the CPU tests, or tables over a ring segment: a pinned staging block of their own
            host = torch.frombuffer(staging, dtype=torch.uint8)
            if device.type == "cuda":
                host = host.pin_memory()
            buffer.copy_(host, non_blocking=True)
    dtypes = {"q": torch.int64, "i": torch.int32}
    views = [
        buffer[start : start + count * width * itemsize].view(dtypes[code]).view(count, width)
        for start, code, count, width, itemsize in layout
    ]
    return buffer, host, views


class Written:
    """A device buffer written on torch's current stream (a table copy or the init kernel),
    with an event recorded right after the writing: a launch on another stream waits for it
    first (order_before)."""

    __slots__ = ("event", "stream", "value")

    def __init__(self, value, device: torch.device):
        self.value = value
        self.event = self.stream = None
        if device.type == "cuda":
            self.stream = stream_for_current()
            self.event = CudaEvent()
            check_cuda(cuda.cuEventRecord(self.event.event, self.stream)[0], "cuEventRecord")

    @classmethod
    def on_stream(cls, value, stream) -> "Written":
        """`value`, written by work just queued on `stream` (a cuda.CUstream; anything else,
        the CPU tests' stand-in, orders nothing), without an event yet: a first call's table
        is read on its own stream far more often than anywhere else, so the event is recorded
        only when another stream needs it (order_before), and then covers the writing too."""
        written = cls.__new__(cls)
        written.value, written.event = value, None
        written.stream = stream if isinstance(stream, cuda.CUstream) else None
        return written

    def order_before(self, stream: cuda.CUstream) -> None:
        """Make `stream`'s later work wait for the writing, unless it is the writing stream."""
        if self.stream is None or stream is self.stream:
            return
        if self.event is None:  # on_stream: recorded now, after the writing
            event = CudaEvent()
            if cuda.cuEventRecord(event.event, self.stream)[0] != cuda.CUresult.CUDA_SUCCESS:
                # the writing stream is gone (a caller's external stream): wait for all work
                check_cuda(cuda.cuCtxSynchronize()[0], "cuCtxSynchronize")
                self.stream = None
                return
            self.event = event
        check_cuda(cuda.cuStreamWaitEvent(stream, self.event.event, 0)[0], "cuStreamWaitEvent")


class CudaEvent:
    """A timing-free CUDA event, destroyed with its owner."""

    __slots__ = ("event",)

    def __init__(self):
        result, self.event = cuda.cuEventCreate(cuda.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        check_cuda(result, "cuEventCreate")

    def __del__(self):
        try:
            cuda.cuEventDestroy(self.event)
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: the driver may be gone
            pass


# Per device: the tables of first calls (TableRing) and of captured first calls (CaptureArena)
_TABLE_RINGS: dict = {}
CAPTURE_ARENAS: dict = {}


def table_ring(device: torch.device) -> TableRing:
    """The device's TableRing, made (with its CaptureArena) on first use."""
    ring = _TABLE_RINGS.get(device.index)
    if ring is None:
        ring = _TABLE_RINGS[device.index] = TableRing(device)
        CAPTURE_ARENAS[device.index] = CaptureArena(device)
    return ring


# One cuda.CUstream object per raw stream handle, so backends can compare streams by identity
# (the 64 most recent handles)
STREAM_OBJECTS = core.RuntimeCache(max_entries=64)
# torch.cuda.current_stream() builds a Stream object on every call; the raw handle of the
# current stream is one C call (the same private accessor Triton's launcher uses).
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
cuda_get_device = core.cuda_get_device
if cuda_get_device is None:
    current_raw_stream = None  # both or neither: the public path otherwise


def current_stream_handle() -> int:
    if current_raw_stream is not None:
        # torch.cuda.current_device() without its lazy-init check (CUDA is initialized
        # before any stream is asked for: validation reads the device first)
        return current_raw_stream(cuda_get_device())
    return torch.cuda.current_stream().cuda_stream


def stream_for_current() -> cuda.CUstream:
    """torch's current stream as a cuda.CUstream, one object per handle."""
    handle = current_stream_handle()
    stream = STREAM_OBJECTS.get(handle)
    if stream is None:
        stream = cuda.CUstream(handle)
        STREAM_OBJECTS.put(handle, stream)
    return stream


def handle_of(stream) -> int:
    """The raw handle of a cuda.CUstream (0 for the CPU tests' stand-in streams)."""
    return int(stream) if isinstance(stream, cuda.CUstream) else 0


def is_capturing() -> bool:
    """Whether torch's current stream is capturing (never before CUDA is initialized)."""
    return torch.cuda.is_initialized() and current_stream_capturing()


current_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
