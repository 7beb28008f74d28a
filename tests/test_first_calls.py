"""An input set's first call without a binding (CPU): the fast acceptor agrees with the full
rules; the tables a DirectLaunch reads hold the sizes, tile rows and pointers it needs; the
second call binds, later calls hit; under a capture only an input set that ran once eagerly
takes it, its tables in the capture arena."""

from __future__ import annotations

import ctypes
import dataclasses
import random
import struct

import pytest
import torch
from helpers import PacksItsPlanTiles, make_inputs, runtime_on_cpu

from nvfp4_group_gemm import core as submission
from nvfp4_group_gemm import launch, runtime, switches

TILE = 128


def _read(address: int, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    return struct.unpack(fmt, bytes((ctypes.c_char * size).from_address(address)))


class TableReadingLaunch:
    """A DirectLaunch stand-in that computes from what its tables say alone: the sizes, the
    tile rows and the pointers it reads at the addresses it is given (the tensors looked up by
    pointer), the exact decode into the c found there."""

    def __init__(self, backend, spec):
        self.backend, self.spec = backend, spec
        self.extra_bytes = 16 * spec.num_groups

    def write_extra(self, host, extra_offset):
        num_groups = self.spec.num_groups
        self.marker = [1000 + g for g in range(2 * num_groups)]
        struct.pack_into(f"<{2 * num_groups}q", host, extra_offset, *self.marker)
        return ["scratch"]

    def launch(self, tables, stream_handle):
        num_groups = self.spec.num_groups
        assert list(_read(tables.extra, f"<{2 * num_groups}q")) == self.marker  # the extra table reaches the launch
        sizes = _read(tables.sizes, f"<{4 * num_groups}i")
        rows = _read(tables.tiles, f"<{3 * self.spec.num_tiles}i")
        pointers = _read(tables.ptrs, f"<{5 * num_groups}q")
        for address in tables:
            assert address % 16 == 0  # the kernels assume 16-byte aligned tables
        by_pointer = self.backend.tensors
        problem_sizes = [tuple(sizes[4 * g: 4 * g + 4]) for g in range(num_groups)]
        for g, size in enumerate(problem_sizes):
            if size[0] == 0:
                continue  # no rows: its empty tensors share address 0
            a, b, c, sfa, sfb = (by_pointer[p] for p in pointers[5 * g: 5 * g + 5])
            submission.exact_decode_group_gemm(([(a, b, c)], None, [(sfa, sfb)], [size]), [c])
        self.backend.first_calls.append((problem_sizes, [tuple(rows[i: i + 3]) for i in range(0, len(rows), 3)],
                                         stream_handle))
        self.backend.last_tables = tables


class DirectBackend(PacksItsPlanTiles):
    """A backend whose bound launches and first calls both compute the exact result."""

    name = "direct"
    plan_key = ("direct",)
    oracle = submission.KernelChoice("direct", "exact_decode", host=True)

    def __init__(self):
        self.checked, self.prepared, self.bound_launches, self.first_calls = [], [], [], []
        self.tensors = {}

    def can_implement(self, problem_sizes):
        self.checked.append(problem_sizes)

    def kernel_chain(self, problem_sizes):
        return [submission.KernelChoice("direct", "direct", per_group_count=True), self.oracle]

    def compile(self, choice, num_groups):
        pass

    def plan_tiles(self, problem_sizes, choice=None):
        return submission.plan_tiles(problem_sizes, TILE, TILE)

    def prepare(self, spec):
        self.prepared.append(spec)
        return FakePlan()

    def write_descriptors(self, plan, pointers, ptrs):
        return None

    def direct_launch(self, spec):
        return TableReadingLaunch(self, spec)

    def launch_args(self, plan, binding, stream):
        def launch(*_args):
            self.bound_launches.append(binding)
            outputs = [c for _, _, c in self.current[0]]
            submission.exact_decode_group_gemm(self.current, outputs)

        return launch, ()


class FakePlan:
    nbytes = 0
    shared_scratch = False
    graph_launch = False

    def record_stream(self, stream):
        pass


@pytest.fixture
def direct_runtime(monkeypatch):
    backend = DirectBackend()
    validations = []
    runtime_on_cpu(monkeypatch, backend, validations)
    monkeypatch.setattr(submission, "SELF_CHECK", False)
    monkeypatch.setattr(runtime, "make_launcher", lambda fn, *args: lambda: fn(*args))

    def run(data):
        backend.current = data
        for t in submission.flatten((*data[0], *data[2])):
            if t.numel():
                backend.tensors[t.data_ptr()] = t
        return runtime.custom_kernel(data)

    return backend, run, validations


def _assert_exact(data):
    clone = ([(a, b, c.clone()) for a, b, c in data[0]], data[1], data[2], data[3])
    expected = submission.exact_decode_group_gemm(clone, [c for _, _, c in clone[0]])
    for (_, _, c), want in zip(data[0], expected):
        assert torch.equal(c, want)


SIZES = [(0, 128, 256, 1), (40, 384, 512, 1), (129, 256, 768, 1)]


def test_a_first_call_reads_its_sizes_tiles_and_pointers_from_the_ring(direct_runtime):
    backend, run, validations = direct_runtime
    data = make_inputs(SIZES)
    outputs = run(data)
    _assert_exact(data)
    assert outputs == [c for _, _, c in data[0]]
    (sizes, rows, _stream), = backend.first_calls
    assert sizes == SIZES and rows == submission.plan_tiles(SIZES, TILE, TILE)
    # nothing bound, no plan with device tables, no full rules
    assert backend.bound_launches == [] and backend.prepared == [] and validations == []
    assert submission.input_key(data) not in runtime.RUNTIME.bindings


def test_the_second_call_binds_and_later_calls_hit(direct_runtime):
    backend, run, _ = direct_runtime
    data = make_inputs(SIZES)
    for _ in range(4):
        for _, _, c in data[0]:
            c.zero_()
        run(data)
        _assert_exact(data)
    assert len(backend.first_calls) == 1 and len(backend.prepared) == 1
    assert len(backend.bound_launches) == 3 and len(set(map(id, backend.bound_launches))) == 1
    # the plan took the size plan's kernel and tile rows: the sizes were checked once
    assert backend.checked == [tuple(SIZES)]


def test_new_sizes_every_call_never_bind(direct_runtime):
    backend, run, _ = direct_runtime
    rng = random.Random(3)
    for _ in range(6):
        sizes = [(rng.randrange(0, 300), 256, 512, 1), (rng.randrange(1, 300), 128, 256, 1)]
        data = make_inputs(sizes)
        run(data)
        _assert_exact(data)
    assert len(backend.first_calls) == 6 and backend.bound_launches == [] and backend.prepared == []
    assert len(runtime.RUNTIME.bindings) == 0


def test_a_known_size_sets_first_calls_copy_only_their_pointers_and_bind_on_them(direct_runtime, monkeypatch):
    """From the second input set of a size set on, the sizes and tile rows come from the size
    plan's head, copied to the device once; each input set's pointers (and the launch's own
    table) go to a table of its own, which its binding takes at its second call: no pointer
    upload there."""
    backend, run, _ = direct_runtime
    uploads = []
    real_upload = launch.upload_int_tables

    def counting_upload(device, tables):
        uploads.append([code for code, _rows in tables])
        return real_upload(device, tables)

    monkeypatch.setattr(runtime, "upload_int_tables", counting_upload)
    first, second, third = make_inputs(SIZES), make_inputs(SIZES), make_inputs(SIZES)
    run(first)  # a new size set: every table in the ring, no device head
    _assert_exact(first)
    size_plan, = runtime.RUNTIME.size_plans.entries.values()
    ring = launch._TABLE_RINGS[None]
    assert size_plan.device_head is None and size_plan.launched
    assert backend.last_tables.sizes == ring.device_base + ring.offset - submission.align_up(size_plan.table_bytes, 128)
    assert runtime.RUNTIME.seen_once.get((submission.input_key(first), tuple(SIZES))) is True

    run(second)  # a known size set: the head to the device, the pointers to a table of their own
    _assert_exact(second)
    head = size_plan.device_head
    assert head is not None and bytes(head.value.numpy()) == size_plan.head
    assert backend.last_tables.sizes == head.value.data_ptr()
    assert backend.last_tables.tiles == head.value.data_ptr() + size_plan.tiles_offset
    table = runtime.RUNTIME.seen_once.get((submission.input_key(second), tuple(SIZES)))
    assert isinstance(table, launch.Written) and backend.last_tables.ptrs == table.value.data_ptr()
    assert list(_read(table.value.data_ptr(), f"<{5 * len(SIZES)}q")) == [
        p for group in submission.pointers_of(second) for p in group]

    offset_before = ring.offset
    run(third)  # the head is not copied again: the ring holds only the pointers and the launch's table
    _assert_exact(third)
    assert size_plan.device_head is head and backend.last_tables.sizes == head.value.data_ptr()
    assert ring.offset - offset_before == submission.align_up(size_plan.table_bytes - size_plan.ptrs_offset, 128)
    assert uploads == []  # no binding yet, no plan with device tables

    for _, _, c in second[0]:
        c.zero_()
    run(second)  # its second call binds, on its first call's table
    _assert_exact(second)
    binding = runtime.RUNTIME.bindings.get(submission.input_key(second))
    assert binding.table is table and binding.ptrs.data_ptr() == table.value.data_ptr()
    assert binding.ptrs.tolist() == [list(group) for group in submission.pointers_of(second)]
    assert uploads == [["i", "i"]]  # the plan's sizes and tile rows; no pointer table
    for _, _, c in second[0]:
        c.zero_()
    run(second)  # a hit
    _assert_exact(second)
    assert len(backend.first_calls) == 3 and len(backend.bound_launches) == 2


def test_ring_segments_wrap(direct_runtime, monkeypatch):
    """More first calls than a segment holds: the ring moves on, its offsets stay in bounds."""
    backend, run, _ = direct_runtime
    monkeypatch.setattr(launch.TableRing, "SEGMENT_BYTES", 1024)
    monkeypatch.setattr(launch.TableRing, "SEGMENTS", 2)
    for i in range(5):
        data = make_inputs([(40 + i, 128, 256, 1)])
        run(data)
        _assert_exact(data)
    ring = launch._TABLE_RINGS[None]
    assert len(backend.first_calls) == 5 and ring.offset <= 1024 and ring.segment in (0, 1)


def test_tables_larger_than_a_segment_bind_at_the_first_call(direct_runtime, monkeypatch):
    backend, run, _ = direct_runtime
    monkeypatch.setattr(launch.TableRing, "SEGMENT_BYTES", 64)
    data = make_inputs(SIZES)
    run(data)
    _assert_exact(data)
    assert backend.first_calls == [] and len(backend.bound_launches) == 1


def test_an_unchecked_kernel_runs_its_first_call_bound(direct_runtime, monkeypatch):
    """The first use of a compiled kernel is self-checked, which the binding path does."""
    backend, run, _ = direct_runtime
    monkeypatch.setattr(submission, "SELF_CHECK", True)
    data = make_inputs(SIZES)
    run(data)
    assert backend.first_calls == [] and len(backend.bound_launches) == 1
    key = submission.KernelChoice("direct", "direct", per_group_count=True).kernel_key(len(SIZES))
    assert key in submission.SELF_CHECKED
    other = make_inputs(SIZES)
    run(other)  # checked now: a first call without a binding
    _assert_exact(other)
    assert len(backend.first_calls) == 1


def test_a_failing_first_call_falls_back_to_the_binding_path(direct_runtime, monkeypatch):
    backend, run, _ = direct_runtime

    def failing(self, *args):
        raise RuntimeError("kernel launch failed: CUresult 1")

    monkeypatch.setattr(TableReadingLaunch, "launch", failing)
    data = make_inputs(SIZES)
    run(data)
    _assert_exact(data)
    assert len(backend.bound_launches) == 1


def test_switched_off_every_first_call_binds(direct_runtime, monkeypatch):
    backend, run, _ = direct_runtime
    monkeypatch.setattr(switches, "CURRENT", dataclasses.replace(switches.CURRENT, first_call_unbound=False))
    data = make_inputs(SIZES)
    run(data)
    assert backend.first_calls == [] and len(backend.bound_launches) == 1


def test_under_capture_an_input_set_seen_once_uses_the_arena(direct_runtime, monkeypatch):
    backend, run, _ = direct_runtime
    data = make_inputs(SIZES)
    run(data)  # eagerly, once: a first call
    arena = launch.CAPTURE_ARENAS[None]
    assert arena.offset == 0
    monkeypatch.setattr(runtime, "is_capturing", lambda: True)
    for _, _, c in data[0]:
        c.zero_()
    run(data)
    _assert_exact(data)
    assert len(backend.first_calls) == 2 and arena.offset > 0
    assert any(key[0] == "first call" for key in runtime.RUNTIME.captured.entries)
    # never seen eagerly: the clear error, nothing launched
    fresh = make_inputs(SIZES)
    with pytest.raises(RuntimeError, match="call custom_kernel once eagerly"):
        run(fresh)
    assert len(backend.first_calls) == 2


def test_a_full_arena_refuses_under_capture(direct_runtime, monkeypatch):
    backend, run, _ = direct_runtime
    data = make_inputs(SIZES)
    run(data)
    launch.CAPTURE_ARENAS[None].offset = launch.CaptureArena.BYTES  # full
    monkeypatch.setattr(runtime, "is_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="has not run outside a CUDA graph capture"):
        run(data)
    assert len(backend.first_calls) == 1


def test_a_demoted_kernel_leaves_the_size_plans(direct_runtime):
    backend, run, _ = direct_runtime
    data = make_inputs(SIZES)
    run(data)
    assert len(runtime.RUNTIME.size_plans) == 1
    choice = submission.KernelChoice("direct", "direct", per_group_count=True)
    submission.demote("direct", choice, [choice, backend.oracle], len(SIZES), "test")
    assert len(runtime.RUNTIME.size_plans) == 0
    other = make_inputs(SIZES)
    run(other)  # the oracle now: a host computation
    _assert_exact(other)
    assert len(backend.first_calls) == 1


# ----------------------------------------------------------------------------- the fast acceptor
def _mutations(data):
    """Input sets that differ from `data` in one field each."""
    abc, plain, scales, sizes = data
    (a, b, c), (sfa, sfb) = abc[0], scales[0]
    yield "c dtype", ([(a, b, c.float()), *abc[1:]], plain, scales, sizes)
    yield "a dtype", ([(a.view(torch.uint8), b, c), *abc[1:]], plain, scales, sizes)
    yield "sfa dtype", (abc, plain, [(sfa.view(torch.uint8), sfb), *scales[1:]], sizes)
    yield "c transposed", ([(a, b, torch.empty_strided(c.shape, (1, c.shape[0], c.numel()), dtype=c.dtype)),
                            *abc[1:]], plain, scales, sizes)
    yield "M", (abc, plain, scales, [(sizes[0][0] + 1, *sizes[0][1:]), *sizes[1:]])
    yield "K", (abc, plain, scales, [(sizes[0][0], sizes[0][1], sizes[0][2] + 256, 1), *sizes[1:]])
    yield "L", (abc, plain, scales, [(*sizes[0][:3], 2), *sizes[1:]])
    yield "bool M", (abc, plain, scales, [(True, *sizes[0][1:]), *sizes[1:]])
    yield "float N", (abc, plain, scales, [(sizes[0][0], float(sizes[0][1]), *sizes[0][2:]), *sizes[1:]])
    yield "short abc", ([(a, b), *abc[1:]], plain, scales, sizes)
    yield "G mismatch", (abc[:1], plain, scales, sizes)
    yield "plain not pairs", (abc, [(sfa,), *plain[1:]], scales, sizes)
    yield "not a tensor", ([(a, object(), c), *abc[1:]], plain, scales, sizes)


def test_the_fast_acceptor_never_accepts_what_the_full_rules_reject(monkeypatch):
    monkeypatch.setattr(submission, "_accepted_device", lambda device: True)
    rng = random.Random(7)
    for _ in range(5):
        sizes = [(rng.randrange(0, 300), rng.choice((128, 384)), rng.choice((256, 768)), 1) for _ in range(2)]
        data = make_inputs(sizes)
        key = submission.input_key(data)
        assert submission.accepted_problem_sizes(data, key) == tuple(sizes)
        for what, changed in _mutations(data):
            try:
                changed_key = submission.input_key(changed)
            except (AttributeError, TypeError):  # not a tensor: no key, custom_kernel goes to the full rules
                assert what == "not a tensor"
                continue
            accepted = submission.accepted_problem_sizes(changed, changed_key)
            try:
                verdict = submission.validate_inputs(changed)
            except (TypeError, ValueError) as error:
                assert accepted is None, (what, error)
                continue
            assert accepted in (None, verdict), what


def test_the_fast_acceptor_declines_misaligned_pointers_and_other_devices(monkeypatch):
    data = make_inputs(SIZES)
    key = submission.input_key(data)
    assert submission.accepted_problem_sizes(data, key) is None  # CPU tensors: not a CUDA device
    monkeypatch.setattr(submission, "_accepted_device", lambda device: True)
    assert submission.accepted_problem_sizes(data, key) == tuple(SIZES)
    assert submission.accepted_problem_sizes(data, (*key[:-1], key[-1] + 16)) is None


def test_pointers_of_the_key_are_pointers_of_the_tensors():
    key = tuple(range(1, 11))  # a0 b0 c0 a1 b1 c1, sfa0 sfb0 sfa1 sfb1
    assert submission.pointers_of_key(key, 2) == [(1, 2, 3, 7, 8), (4, 5, 6, 9, 10)]
    data = make_inputs(SIZES)
    assert submission.pointers_of_key(submission.input_key(data), len(SIZES)) == submission.pointers_of(data)


def test_out_of_memory_in_a_first_call_is_clear_and_caches_nothing(direct_runtime, monkeypatch):
    backend, run, _ = direct_runtime
    real_launch = TableReadingLaunch.launch

    def out_of_memory(self, *args):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(TableReadingLaunch, "launch", out_of_memory)
    data = make_inputs(SIZES)
    with pytest.raises(torch.OutOfMemoryError, match="activation scratch of a first call of sizes"):
        run(data)
    assert len(runtime.RUNTIME.seen_once) == 0 and len(runtime.RUNTIME.bindings) == 0
    monkeypatch.setattr(TableReadingLaunch, "launch", real_launch)
    run(data)  # memory back: a first call as if none had failed
    _assert_exact(data)
    assert len(backend.first_calls) == 1 and len(runtime.RUNTIME.bindings) == 0
