"""The host runtime's parts both runtimes share: prepared launches, device tables, caches.

``PreparedCall``/``make_launcher`` (the only place that reaches into DSL internals), tile rows
(``plan_tiles``, ``PackedTiles``), the packing and upload of int tables, ``RuntimeCache`` (bounded
by count and bytes), the ``Backend`` protocol, ``PlanSpec``, ``Plan``, ``Binding``, and the
device helpers of the host (``device_context``, ``current_device_index``)."""

import collections
import collections.abc
import contextlib
import dataclasses
import struct
import typing
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

import torch

from .chain import KernelChoice
from .config import FORCE_PLAIN_LAUNCH, ceil_div
from .validation import data_address, flatten

# =============================================================================
# Shared host runtime (both backends)
# =============================================================================
# The only place that reaches into DSL internals (PreparedCall, device_executor): the packed argument array is built once and
# the entry point called directly, one C call instead of the DSL's argument conversion on
# every call (EXPERIMENTS E56). Checked against the pinned DSL version; anything else falls
# back to the plain call.
# NVFP4_PLAIN_LAUNCH=1 forces the plain call (to compare, or to rule the fast path out).
PREPARED_LAUNCH_DSL_VERSION = "4.3.5"


def _installed_dsl_version() -> str | None:
    try:
        return package_version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        return None


DSL_VERSION = _installed_dsl_version()


def device_executor(compiled):
    """compiled.to(None) once per device: the executor (its module loaded in the device's
    context) is the same for every input set of that kernel, so a new binding builds only its
    argument pack. Kept on the compiled function itself, per device index."""
    executors = compiled.__dict__.setdefault("_nvfp4_executors", {})
    device = current_device_index()
    executor = executors.get(device)
    if executor is None:
        executor = executors[device] = compiled.to(None)
    return executor


class PreparedCall:
    """``compiled`` called through its packed argument array: the one place that knows the
    DSL's internals (the execution arguments, the executor, the packed-argument builder, the C
    entry point). `prepare` returns None where the fast path does not apply (another DSL
    release, NVFP4_PLAIN_LAUNCH=1, or any change in those internals): the caller makes the
    plain call. `packed(addresses)` builds the packed array of other argument storage of the
    same layout (a binding's own cells); `launcher(packed)` the one-C-call launch of it."""

    __slots__ = ("capi_func", "cuda_result", "executor", "keepalive", "packed_args")

    @classmethod
    def prepare(cls, compiled, *args) -> "PreparedCall | None":
        if DSL_VERSION != PREPARED_LAUNCH_DSL_VERSION or FORCE_PLAIN_LAUNCH:
            return None
        try:
            prepared = cls()
            exe_args, adapted_args = compiled.generate_execution_args(*args)
            prepared.executor = device_executor(compiled)
            prepared.packed_args = prepared.executor._get_invoke_packed_args(list(exe_args))
            prepared.capi_func = prepared.executor.jit_module.capi_func
            prepared.cuda_result = prepared.executor.cuda_result
        except Exception:  # noqa: BLE001 - any change in DSL internals selects the plain call
            return None
        prepared.keepalive = (compiled, args, exe_args, adapted_args)
        return prepared

    def packed(self, addresses: list):
        """The packed argument array of argument storage at `addresses` (one per argument)."""
        return self.executor._get_invoke_packed_args(addresses)

    def launcher(self, packed_args=None) -> Callable[[], None]:
        """One C call of the entry point with `packed_args` (the prepared ones when None)."""
        capi_func, cuda_result = self.capi_func, self.cuda_result
        packed_args = self.packed_args if packed_args is None else packed_args

        def launch():
            capi_func(packed_args)
            if cuda_result is not None and cuda_result.value != 0:
                raise RuntimeError(f"kernel launch failed: CUresult {cuda_result.value}")

        launch.keepalive = (self, packed_args)
        return launch


def make_launcher(compiled, *args) -> Callable[[], None]:
    """Return a no-argument callable that runs ``compiled(*args)``.

    ``args`` must be DSL objects (cute Pointers, cutlass.Int32, ...) that stay
    alive as long as the launcher: the packed arguments point into them.
    """
    prepared = PreparedCall.prepare(compiled, *args)
    return (lambda: compiled(*args)) if prepared is None else prepared.launcher()


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


class PackedTiles(collections.abc.Sequence):
    """A kernel's tile rows as it reads them: `data` holds int32 rows of `width`
    (little-endian), `count` of them; as a sequence, the rows as tuples. A size set's first
    call copies `data` into its tables as is (a MoE step: hundreds of rows per call)."""

    __slots__ = ("count", "data", "width")

    def __init__(self, data: bytes, width: int):
        self.data, self.width = data, width
        self.count = len(data) // (4 * width)

    @classmethod
    def of(cls, rows) -> "PackedTiles":
        """Rows (tuples of equal length) packed."""
        width = len(rows[0]) if rows else 1
        return cls(struct.pack(f"<{width * len(rows)}i", *flatten(rows)), width)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.count))]
        if not -self.count <= index < self.count:
            raise IndexError(index)
        return struct.unpack_from(f"<{self.width}i", self.data, 4 * self.width * (index % self.count))

    def __iter__(self):
        return struct.iter_unpack(f"<{self.width}i", self.data)


def align_up(x, a):
    return (x + a - 1) // a * a



def table_layout(tables) -> tuple[list[tuple[int, str, int, int, int]], int]:
    """Where each of `tables` ((struct code, rows of equal length)) lies in one buffer, each on
    a 128-byte boundary: ([(offset, code, rows, width, itemsize)], the buffer's bytes)."""
    layout, offset = [], 0
    for code, rows in tables:
        width = len(rows[0]) if rows else 1
        itemsize = struct.calcsize(code)
        layout.append((offset, code, len(rows), width, itemsize))
        offset = align_up(offset + max(len(rows), 1) * width * itemsize, 128)
    return layout, offset


def in_order(launchers: list[Callable[[], None]]) -> Callable[[], None]:
    """One launch that runs `launchers` in order (a pre-pass, then the GEMM); the one itself
    where there is one."""
    if len(launchers) == 1:
        return launchers[0]

    def launch_in_order():
        for launcher in launchers:
            launcher()

    launch_in_order.keepalive = launchers
    return launch_in_order


def upload_int_tables(device, tables) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Copy integer tables to `device` in one buffer: (the buffer, a [rows, width] view of each).

    `tables`: (struct code "q" or "i", rows of equal length), each starting on a 128-byte
    boundary. Packed in Python and copied as one buffer (half the CPU of one torch op per
    table: EXPERIMENTS E58), from pinned memory, so that the copy is queued with the launches
    that read it. On a CPU device (the tests) the host buffer itself.
    """
    device = torch.device(device)
    layout, offset = table_layout(tables)
    staging = bytearray(offset)
    for (start, code, count, width, _), (_, rows) in zip(layout, tables):
        struct.pack_into(f"<{count * width}{code}", staging, start, *flatten(rows))
    buffer = torch.frombuffer(staging, dtype=torch.uint8)
    if device.type == "cuda":
        # torch's pinned allocator keeps the block until the copy has run
        buffer = buffer.pin_memory().to(device, non_blocking=True)
    dtypes = {"q": torch.int64, "i": torch.int32}
    views = [
        buffer[start : start + count * width * itemsize].view(dtypes[code]).view(count, width)
        for start, code, count, width, itemsize in layout
    ]
    return buffer, views

class RuntimeCache:
    """Bounded LRU (count, and bytes where entries have `nbytes`); its entries are read and
    written by its methods only (``entries``: least recently used first)."""

    def __init__(self, max_entries: int = 64, max_bytes: int | None = None, pinned: Callable | None = None):
        """`pinned(entry)` True: the entry is never evicted (a plan a caller's CUDA graph reads),
        even past the bounds; a reset clears it."""
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.pinned = pinned
        self.nbytes = 0
        self.entries: collections.OrderedDict[tuple, Any] = collections.OrderedDict()

    def get(self, key):
        state = self.entries.get(key)
        if state is not None:
            self.entries.move_to_end(key)
        return state

    def get_input_set(self, data) -> tuple[Any, tuple | None]:
        """The hit path's lookup in a cache of input sets (by input_key): (the entry of this
        input set, touched, or None; its input_key, or None for malformed input, which full
        validation then names). The entry's `plan.problem_sizes` must equal the input set's:
        same buffers with other sizes are a miss.

        Hit: every pointer and the problem sizes equal those of an input set that passed
        validation. A hit does NOT re-check dtypes, strides or the plain sfa/sfb tensors: a
        tensor replaced by one with the same address and problem size but another dtype or
        layout would be read as the validated one. (input_key and get inlined: every Python
        frame saved is CPU time of every call.)"""
        try:
            key = (*map(data_address, flatten(data[0])), *map(data_address, flatten(data[2])))
            entry = self.entries.get(key)
            if entry is not None:
                self.entries.move_to_end(key)
                if tuple(data[3]) != entry.plan.problem_sizes:
                    entry = None  # same buffers, other sizes: check and bind again
        except Exception:  # noqa: BLE001 - malformed input of any kind goes to full validation
            return None, None
        return entry, key

    def put(self, key, state) -> list:
        """Insert `state`; return the entries evicted to stay within the bounds."""
        old = self.entries.pop(key, None)
        if old is not None:
            self.nbytes -= getattr(old, "nbytes", 0)
        self.entries[key] = state
        self.nbytes += getattr(state, "nbytes", 0)
        evicted = []
        while len(self.entries) > 1 and (
            len(self.entries) > self.max_entries
            or (self.max_bytes is not None and self.nbytes > self.max_bytes)
        ):
            if self.pinned is None:
                _, entry = self.entries.popitem(last=False)
            else:  # the least recently used entry that is neither pinned nor the one just put
                victim = next((k for k, e in self.entries.items() if k != key and not self.pinned(e)), None)
                if victim is None:
                    break
                entry = self.entries.pop(victim)
            self.nbytes -= getattr(entry, "nbytes", 0)
            evicted.append(entry)
        return evicted

    def drop(self, predicate: Callable) -> list:
        """Remove every entry whose value `predicate` selects (the byte count follows); return
        them, least recently used first."""
        dropped = [key for key, entry in self.entries.items() if predicate(entry)]
        removed = [self.entries.pop(key) for key in dropped]
        self.nbytes -= sum(getattr(entry, "nbytes", 0) for entry in removed)
        return removed

    def __len__(self):
        return len(self.entries)

    def __contains__(self, key):
        return key in self.entries

    def clear(self):
        self.entries.clear()
        self.nbytes = 0



@typing.runtime_checkable
class Backend(typing.Protocol):
    """A device family's kernels, as a runtime drives them: Sm100Backend here (the library
    beside this file has its own runtime and backends, and builds on these)."""

    name: str
    plan_key: tuple  # what a plan depends on besides the device and the sizes
    oracle: KernelChoice  # the self-check's reference computation (a host computation)

    def can_implement(self, problem_sizes) -> None:
        """Raise ValueError (group, field, value, rule) for sizes it cannot run at all."""

    def kernel_chain(self, problem_sizes) -> collections.abc.Sequence[KernelChoice]:
        """The kernels that can run these sizes, best first; the last is a host computation."""

    def family_choices(self, groups: int, n: int, k: int) -> list[KernelChoice]:
        """Every first link the automatic choice can pick for this (G, N, K), any M."""

    def prepare_device(self, device: torch.device) -> None:
        """Ask the driver now what a first plan on `device` would ask it."""

    def compile(self, choice: KernelChoice, num_groups: int) -> None:
        """Compile (cached) the kernels of `choice`; raise what the compiler raised."""

    def plan_tiles(self, problem_sizes, choice: KernelChoice | None = None) -> list[tuple[int, ...]]:
        """The tile rows of `choice` (its table, in launch order)."""

    def prepare(self, spec: "PlanSpec"):
        """Its part of a plan for spec.choice (compiled by then); `nbytes`: the device bytes it
        holds beyond the runtime's tables."""

    def write_descriptors(self, plan: "Plan", pointers: tuple, ptrs: torch.Tensor):
        """Per-pointer device state of an input set (TMA descriptors): `pointers` per group
        (a, b, c, sfa, sfb), `ptrs` their device table."""

    def launcher(self, plan: "Plan", binding: "Binding") -> Callable[[], None]:
        """The prepared launch of a bound input set."""


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """What a backend's prepare() is given: everything a plan is before its backend part,
    complete (the kernel chosen, its tile rows)."""

    choice: KernelChoice
    problem_sizes: tuple[tuple[int, int, int, int], ...]
    device: torch.device
    tile_rows: tuple[tuple[int, ...], ...]

    @property
    def num_groups(self) -> int:
        return len(self.problem_sizes)

    @property
    def num_tiles(self) -> int:
        return len(self.tile_rows)


class Plan:
    """What every input set of one size set shares on one device and backend.

    choice: the kernel of the backend's chain that runs these sizes (chosen, and compiled,
    before anything else is built: the tile rows are that kernel's); chain: the whole chain,
    for a demotion to name the next link. sizes int32 [G, 4]: (M, N, K, L) per group; tiles
    int32 [T, W]: the kernel's tile rows (none for a host computation; `tile_rows` given: a
    size plan's). backend_plan: what the backend's prepare(spec) made of them; None for a host
    computation. nbytes: device bytes held. The library's plan (nvfp4_group_gemm.runtime)
    extends this one at one seam, `upload`: where its tables are written."""

    __slots__ = (
        "backend", "backend_plan", "chain", "choice", "device", "kernel_key", "nbytes", "num_groups", "num_tiles",
        "problem_sizes", "sizes", "spec", "tables", "tile_rows", "tiles",
    )

    def __init__(self, backend, problem_sizes, device, choice: KernelChoice | None = None, chain=None,
                 tile_rows: tuple | None = None):
        self.backend = backend
        self.device = torch.device(device)
        self.problem_sizes = tuple(tuple(int(v) for v in p) for p in problem_sizes)
        self.num_groups = len(self.problem_sizes)
        if choice is None:  # a backend of one's choosing: its first kernel
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
        self.tables, (self.sizes, self.tiles), table_bytes = self.upload(
            [("i", self.problem_sizes), ("i", self.tile_rows)])
        self.backend_plan = None if choice.host else backend.prepare(self.spec)
        self.nbytes = table_bytes + (0 if self.backend_plan is None else self.backend_plan.nbytes)

    def upload(self, tables) -> tuple[Any, list[torch.Tensor], int]:
        """(what holds `tables` on the plan's device, a view of each, its bytes): one buffer,
        copied in the order of the launches."""
        buffer, views = upload_int_tables(self.device, tables)
        return buffer, views, buffer.numel()


class Binding:
    """One input set (its data pointers) bound to its plan: the pointer table the kernel
    reads (ptrs int64 [G, 5]: a, b, c, sfa_reordered, sfb_reordered), the backend's
    per-pointer state (`bound`: the sm_100 TMA descriptors) and the prepared launch (None: a
    host computation, which custom_kernel runs on the input set itself). The library's binding
    extends this one at two seams: `upload` (a pointer table its first call wrote) and
    `prepare` (where and how its launches go)."""

    __slots__ = ("bound", "launch", "plan", "pointers", "ptrs", "table")

    def __init__(self, plan: Plan, pointers, table=None):
        self.plan = plan
        self.pointers = tuple(tuple(int(v) for v in p) for p in pointers)
        self.table, self.ptrs = self.upload(table)
        self.bound = None if plan.choice.host else plan.backend.write_descriptors(plan, self.pointers, self.ptrs)
        self.launch = self.prepare()

    def upload(self, table) -> tuple[Any, torch.Tensor]:
        """(what holds the pointer table on the device, its int64 [G, 5] view)."""
        buffer, (ptrs,) = upload_int_tables(self.plan.device, [("q", self.pointers)])
        return buffer, ptrs

    def prepare(self) -> Callable[[], None] | None:
        """The prepared launch; None for a host computation; no_launch where every group has
        M = 0 (a 0-CTA grid is invalid)."""
        if self.plan.choice.host:
            return None
        return self.plan.backend.launcher(self.plan, self) if self.plan.num_tiles else no_launch


def no_launch() -> None:
    pass

def pointers_of(data) -> list[tuple[int, int, int, int, int]]:
    abc, _, sfasfb_reordered, _ = data
    return [
        (a.data_ptr(), b.data_ptr(), c.data_ptr(), sfa.data_ptr(), sfb.data_ptr())
        for (a, b, c), (sfa, sfb) in zip(abc, sfasfb_reordered)
    ]


_NO_CONTEXT = contextlib.nullcontext()


def device_context(device: torch.device):
    """`device` made torch's current device for a block (nothing to do where it already is:
    the common case, which a new-size call otherwise pays in Python)."""
    if device.type != "cuda" or current_device_index() == device.index:
        return _NO_CONTEXT
    return torch.cuda.device(device.index)


def current_device_index() -> int | None:
    """torch's current CUDA device; None before CUDA is initialized (the CPU tests). One C
    call, without torch.cuda.current_device()'s lazy-init checks."""
    if not torch.cuda.is_initialized():
        return None
    return cuda_get_device() if cuda_get_device is not None else torch.cuda.current_device()
cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)
