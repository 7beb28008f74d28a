"""Shared host runtime on CPU: tile tables, plans and bindings, staging-buffer ownership,
bounded caches, keys, validation tiers, and the hit/miss behaviour of custom_kernel with a
recording backend."""

import pytest
import torch
from helpers import PacksItsPlanTiles, make_inputs, runtime_on_cpu

from nvfp4_group_gemm import core as submission
from nvfp4_group_gemm import launch, runtime, sm100

TILE = 128


def test_tile_table_awkward_shapes():
    sizes = [(0, 128, 256, 1), (1, 128, 256, 1), (129, 384, 256, 1), (40, 384, 512, 1)]
    assert submission.plan_tiles(sizes, TILE, TILE) == [
        # group 0: M = 0, no tiles
        (1, 0, 0),
        (2, 0, 0), (2, 0, 1), (2, 0, 2),
        (2, 1, 0), (2, 1, 1), (2, 1, 2),
        (3, 0, 0), (3, 0, 1), (3, 0, 2),
    ]


@pytest.mark.parametrize(
    "sizes",
    [
        [(40, 128, 256, 1)],
        [(1, 384, 256, 1), (0, 128, 256, 1), (129, 128, 256, 1)],
        [(80, 4096, 7168, 1), (176, 4096, 7168, 1), (248, 4096, 7168, 1)],
        [(256, 200, 256, 1), (127, 129, 256, 1)],
    ],
)
def test_tile_table_covers_every_output_element_once(sizes):
    tiles = submission.plan_tiles(sizes, TILE, TILE)
    coverage = [torch.zeros((m, n), dtype=torch.int32) for m, n, _, _ in sizes]
    for g, tile_m, tile_n in tiles:
        coverage[g][tile_m * TILE : (tile_m + 1) * TILE, tile_n * TILE : (tile_n + 1) * TILE] += 1
    for g, cov in enumerate(coverage):
        assert cov.numel() == 0 or bool((cov == 1).all()), f"group {g} coverage {cov.unique()}"
    # No tile starts outside its group's C
    for g, tile_m, tile_n in tiles:
        assert tile_m * TILE < sizes[g][0] and tile_n * TILE < sizes[g][1]
    # Order: group-major, then tile_m, then tile_n (CTAs sharing an A tile are adjacent)
    assert tiles == sorted(tiles)


def _pointers(g, base):
    return [tuple(base + 1000 * i + j for j in range(5)) for i in range(g)]


class FakeBackendPlan:
    """What the runtime reads of a backend's plan."""

    nbytes = 0
    shared_scratch = False
    graph_launch = True

    def __init__(self, plan=None):
        self.plan = plan

    def record_stream(self, stream):
        pass


class TableBackend(PacksItsPlanTiles):
    """The least a plan needs of a backend: a one-link chain, its tiles and prepare."""

    name = "tables"
    plan_key = ("tables",)
    oracle = submission.KernelChoice("tables", "exact_decode", host=True)

    def kernel_chain(self, problem_sizes):
        return [submission.KernelChoice("tables", "tables")]

    def compile(self, choice, num_groups):
        pass

    def plan_tiles(self, problem_sizes, choice=None):
        return submission.plan_tiles(problem_sizes, TILE, TILE)

    def prepare(self, spec):
        return FakeBackendPlan(spec)

    def write_descriptors(self, plan, pointers, ptrs):
        return None

    def direct_launch(self, spec):
        return None


def test_plan_and_binding_tables_contents_and_alignment():
    sizes = [(0, 128, 256, 1), (40, 384, 512, 1), (129, 128, 768, 1)]
    pointers = _pointers(3, 1 << 40)
    plan = runtime.Plan(TableBackend(), sizes, "cpu")
    binding = runtime.Binding(plan, pointers)
    assert plan.num_groups == 3 and plan.problem_sizes == tuple(sizes)
    assert binding.ptrs.dtype == torch.int64 and binding.ptrs.tolist() == [list(p) for p in pointers]
    assert plan.sizes.dtype == torch.int32 and plan.sizes.tolist() == [list(s) for s in sizes]
    assert plan.tiles.dtype == torch.int32
    assert [tuple(t) for t in plan.tiles.tolist()] == submission.plan_tiles(sizes, TILE, TILE)
    assert plan.num_tiles == 3 + 2 == plan.tiles.shape[0]
    # The kernels address the tables through pointers assumed 16-byte aligned
    for table in (binding.ptrs, plan.sizes, plan.tiles):
        assert table.data_ptr() % 16 == 0
        assert table.is_contiguous()
    assert plan.nbytes == plan.tables.value.numel() > 0


def test_upload_int_tables_rows_of_any_width():
    buffer, host, (wide, narrow, empty) = launch.upload_int_tables(
        "cpu", [("q", [(1, 2, 3, 4, 5)]), ("i", [(7, 8, 9, 10), (11, 12, 13, 14)]), ("i", [])]
    )
    assert wide.tolist() == [[1, 2, 3, 4, 5]] and narrow.tolist() == [[7, 8, 9, 10], [11, 12, 13, 14]]
    assert empty.shape == (0, 1)
    assert narrow.data_ptr() - buffer.data_ptr() == 128  # each table on a 128-byte boundary
    assert host.data_ptr() != buffer.data_ptr()


def test_staging_buffer_is_owned_per_input_set():
    # 15 back-to-back input sets with different pointers (as the leaderboard makes) on one
    # plan: each gets its own staging buffer, so no pending copy can ever read another set's
    # pointers, and all share the plan's tables.
    sizes = [(40, 384, 512, 1), (129, 128, 768, 1)]
    plan = runtime.Plan(TableBackend(), sizes, "cpu")
    built = [runtime.Binding(plan, _pointers(2, (i + 1) << 36)) for i in range(15)]
    assert len({b._host_staging.data_ptr() for b in built}) == 15
    for i, binding in enumerate(built):
        assert binding.ptrs.tolist() == [list(p) for p in _pointers(2, (i + 1) << 36)]
        staged = binding._host_staging[: 2 * 5 * 8].view(torch.int64).view(2, 5)
        assert staged.tolist() == binding.ptrs.tolist()
        assert binding.ptrs.data_ptr() != binding._host_staging.data_ptr()
        assert binding.plan is plan


def test_lru_bounds_and_order():
    cache = submission.RuntimeCache(max_entries=4)
    for i in range(4):
        cache.put(("k", i), i)
    assert cache.get(("k", 0)) == 0  # 0 becomes most recent
    cache.put(("k", 4), 4)  # evicts the least recent: 1
    assert len(cache) == 4
    assert ("k", 1) not in cache
    assert [cache.get(("k", i)) for i in (0, 2, 3, 4)] == [0, 2, 3, 4]
    for i in range(5, 20):
        cache.put(("k", i), i)
    assert len(cache) == 4 and ("k", 19) in cache and ("k", 15) not in cache
    assert runtime.RUNTIME.bindings.max_entries == 64
    assert runtime.RUNTIME.plans.max_entries == 32 and runtime.RUNTIME.plans.max_bytes == 1 << 30


def test_lru_bounded_in_bytes():
    class Entry:
        def __init__(self, nbytes):
            self.nbytes = nbytes

    cache = submission.RuntimeCache(max_entries=10, max_bytes=100)
    assert cache.put("a", Entry(40)) == [] and cache.put("b", Entry(40)) == []
    evicted = cache.put("c", Entry(40))  # 120 > 100: the least recent goes
    assert [e.nbytes for e in evicted] == [40] and "a" not in cache and cache.nbytes == 80
    cache.put("b", Entry(10))  # replacing an entry updates the byte count
    assert cache.nbytes == 50
    # One entry larger than the bound still stays (the newest is never evicted)
    cache.put("huge", Entry(500))
    assert list(cache.entries) == ["huge"] and cache.nbytes == 500


def test_input_key_contents():
    data = make_inputs([(40, 384, 512, 1), (129, 128, 768, 1)])
    key = submission.input_key(data)
    # Same tensors in fresh containers: same key
    same = ([tuple(t) for t in data[0]], list(data[1]), [tuple(t) for t in data[2]], list(data[3]))
    assert submission.input_key(same) == key
    # Every single pointer is part of the key
    for group in range(2):
        for slot in range(3):
            abc = [list(t) for t in data[0]]
            abc[group][slot] = abc[group][slot].clone()
            changed = ([tuple(t) for t in abc], data[1], data[2], data[3])
            assert submission.input_key(changed) != key, (group, slot)
        for slot in range(2):
            reordered = [list(t) for t in data[2]]
            reordered[group][slot] = reordered[group][slot].clone()
            changed = (data[0], data[1], [tuple(t) for t in reordered], data[3])
            assert submission.input_key(changed) != key, (group, "sf", slot)
    assert len(key) == 2 * 5  # every pointer, nothing else hashed


def test_same_buffers_with_other_sizes_miss(recording_runtime):
    """Problem sizes are compared on every hit: the same pointers with other sizes are
    checked and bound to the plan of those sizes."""
    backend, validations = recording_runtime
    data = make_inputs([(64, 384, 512, 1), (129, 128, 768, 1)])
    runtime.custom_kernel(data)
    # Group 0 read as M = 40: the same tensors are too big for it, so validation must fail
    # before any launch (nothing cached for these sizes is reused).
    smaller = (data[0], data[1], data[2], [(40, 384, 512, 1), (129, 128, 768, 1)])
    with pytest.raises(ValueError, match="group 0: a.shape"):
        runtime.custom_kernel(smaller)
    # the valid set passed the fast acceptor; the bad one went to the full rules
    assert len(validations) == 1 and len(backend.launches) == 1
    runtime.custom_kernel(data)
    assert len(validations) == 1 and len(backend.launches) == 2
    # Views with the same base pointers and valid smaller shapes: validated, own tables
    (a0, b0, c0), group1 = data[0]
    views = ([(a0[:40], b0, c0[:40]), group1], data[1], data[2], smaller[3])
    assert submission.input_key(views) == submission.input_key(data)
    runtime.custom_kernel(views)
    # their L-mode strides are the 64-row tensors' (extent 1: unused): the full rules accept them
    assert len(validations) == 2 and len(backend.prepared) == 2
    assert backend.launches[-1][0].problem_sizes[0] == (40, 384, 512, 1)
    # Back to the first sizes: their plan is known (no new plan); the pointers are bound to
    # that plan again
    runtime.custom_kernel(data)
    assert len(validations) == 2 and len(backend.prepared) == 2
    assert backend.launches[-1][0].problem_sizes[0] == (64, 384, 512, 1)


class RecordingBackend(PacksItsPlanTiles):
    """Backend protocol stand-in that records what the runtime asks of it."""

    name = "recording"
    plan_key = ("recording",)
    oracle = submission.KernelChoice("recording", "exact_decode", host=True)
    tile_m = 128
    tile_n = 128

    def __init__(self):
        self.checked, self.prepared, self.bound, self.args, self.launches = [], [], [], [], []

    def can_implement(self, problem_sizes):
        self.checked.append(problem_sizes)

    def kernel_chain(self, problem_sizes):
        return [submission.KernelChoice("recording", "recording", per_group_count=True), self.oracle]

    def compile(self, choice, num_groups):
        pass

    def plan_tiles(self, problem_sizes, choice=None):
        return submission.plan_tiles(problem_sizes, self.tile_m, self.tile_n)

    def prepare(self, spec):
        self.prepared.append(spec)
        return FakeBackendPlan(spec)

    def write_descriptors(self, plan, pointers, ptrs):
        self.bound.append(pointers)
        return {"descriptors of": pointers}

    def direct_launch(self, spec):
        return None

    def launch_args(self, plan, binding, stream):
        self.args.append(stream)
        return (lambda *args: self.launches.append((plan, binding, stream))), (plan, binding, stream)


@pytest.fixture
def recording_runtime(monkeypatch):
    """custom_kernel on CPU tensors with a recording backend; validation counted, and its
    CUDA-device rule the only one waived (in the full rules and the pointer checks)."""
    backend = RecordingBackend()
    calls = []
    runtime_on_cpu(monkeypatch, backend, calls)
    monkeypatch.setattr(submission, "SELF_CHECK", False)  # the fakes write nothing to check
    monkeypatch.setattr(runtime, "make_launcher", lambda fn, *args: lambda: fn(*args))
    return backend, calls


def test_the_tools_read_bindings_streams_and_size_plans_through_functions(recording_runtime):
    data = make_inputs([(40, 384, 512, 1)])
    key = runtime.input_key(data)
    assert runtime.binding_of(key) is None
    runtime.custom_kernel(data)
    binding = runtime.binding_of(key)
    assert binding is not None and binding.plan.problem_sizes == ((40, 384, 512, 1),)
    assert runtime.current_stream() == "stream-0"  # runtime_on_cpu's stand-in for torch's current stream
    assert len(runtime.RUNTIME.size_plans) == 1
    runtime.forget_size_plans()
    assert len(runtime.RUNTIME.size_plans) == 0 and runtime.binding_of(key) is binding  # size plans alone


def test_hit_is_one_launch_and_no_validation(recording_runtime):
    backend, validations = recording_runtime
    data = make_inputs([(40, 384, 512, 1), (129, 128, 768, 1)])
    outputs = [runtime.custom_kernel(data) for _ in range(5)]
    assert validations == []  # the official layout: the fast acceptor's, no full rules
    assert len(backend.checked) == 1 and len(backend.prepared) == 1 and len(backend.bound) == 1
    # Launch arguments prepared once: a plan whose launch cannot be recorded (CPU tensors)
    # launches directly from its first call on (LaunchMode.DIRECT)
    assert backend.args == ["stream-0"]
    assert len(backend.launches) == 5 and all(s == "stream-0" for _, _, s in backend.launches)
    assert all(p.spec is backend.prepared[0] for p, _, _ in backend.launches)
    for out in outputs:
        assert len(out) == 2 and out[0] is data[0][0][2] and out[1] is data[0][1][2]


def test_new_pointers_of_known_sizes_share_the_plan_and_skip_the_full_rules(recording_runtime):
    backend, validations = recording_runtime
    data = make_inputs([(40, 384, 512, 1), (129, 128, 768, 1)])
    runtime.custom_kernel(data)
    new_c = data[0][1][2].clone()
    changed = ([data[0][0], (data[0][1][0], data[0][1][1], new_c)], data[1], data[2], data[3])
    result = runtime.custom_kernel(changed)
    assert result[1] is new_c
    # Known sizes: no full rules (the fast acceptor), no second plan, a second binding
    assert validations == [] and len(backend.prepared) == 1 and len(backend.checked) == 1
    assert len(backend.bound) == 2
    first, second = runtime.RUNTIME.bindings.entries.values()  # least recently used first
    assert first.plan is second.plan
    assert first.ptrs[1, submission.PTR_C].item() == data[0][1][2].data_ptr()
    assert second.ptrs[1, submission.PTR_C].item() == new_c.data_ptr()
    assert first._host_staging.data_ptr() != second._host_staging.data_ptr()
    # Back to the first input set: a hit on the first binding
    runtime.custom_kernel(data)
    assert backend.launches[-1][1] is first and len(backend.bound) == 2


def test_a_new_dtype_or_layout_runs_the_full_rules(recording_runtime):
    _backend, validations = recording_runtime
    data = make_inputs([(40, 384, 512, 1)])
    runtime.custom_kernel(data)
    (a, b, c), = data[0]
    wrong_dtype = ([(a, b, c.to(torch.float32))], data[1], data[2], data[3])
    with pytest.raises(TypeError, match=r"group 0: c.dtype = torch.float32"):
        runtime.custom_kernel(wrong_dtype)
    transposed = torch.empty_strided(c.shape, (1, c.shape[0], c.numel()), dtype=c.dtype)
    with pytest.raises(ValueError, match=r"group 0: c.stride\(\)"):
        runtime.custom_kernel(([(a, b, transposed)], data[1], data[2], data[3]))
    assert len(validations) == 2  # the two bad sets, not the good one


def test_what_the_fast_acceptor_declines_runs_the_full_rules(recording_runtime, monkeypatch):
    """A device the fast acceptor does not take, or a valid layout only in the full rules'
    looser form (a stride on a mode of extent 1), gets validate_inputs' verdict."""
    _backend, validations = recording_runtime
    data = make_inputs([(40, 384, 512, 1)])
    runtime.custom_kernel(data)
    assert validations == []
    monkeypatch.setattr(submission, "_accepted_device", lambda device: False)
    moved = make_inputs([(40, 384, 512, 1)])
    runtime.custom_kernel(moved)  # the full rules pass (device waived): bound
    assert len(validations) == 1
    monkeypatch.setattr(submission, "_accepted_device", lambda device: True)
    (a, b, c), = moved[0]
    odd = torch.empty_strided(c.shape, (c.shape[1], 1, 7), dtype=c.dtype)  # L = 1: its stride is never used
    runtime.custom_kernel(([(a, b, odd)], moved[1], moved[2], moved[3]))
    assert len(validations) == 2


def test_binding_records_its_graph_on_the_second_call(recording_runtime, monkeypatch):
    backend, _ = recording_runtime
    captured = []

    class FakeGraph:
        def __init__(self, record, device):
            captured.append(record)

        def launcher(self, stream):
            return lambda: backend.launches.append(("graph", None, stream))

    monkeypatch.setattr(runtime, "GraphLaunch", FakeGraph)
    monkeypatch.setattr(runtime, "_can_record", lambda plan: True)  # CPU tensors here
    data = make_inputs([(40, 384, 512, 1)])
    runtime.custom_kernel(data)
    binding = runtime.RUNTIME.bindings.get(submission.input_key(data))
    assert captured == [] and binding.mode is runtime.LaunchMode.FIRST_DIRECT and binding.launched
    for _ in range(3):
        runtime.custom_kernel(data)
    assert len(captured) == 1 and binding.mode is runtime.LaunchMode.GRAPH
    assert [entry[0] == "graph" for entry in backend.launches] == [False, True, True, True]


def test_plan_eviction_drops_its_bindings(recording_runtime, monkeypatch):
    backend, _ = recording_runtime
    monkeypatch.setattr(runtime.RUNTIME, "plans", submission.RuntimeCache(max_entries=2))
    sets = [make_inputs([(40 + 8 * i, 128, 256, 1)]) for i in range(3)]
    for data in sets:
        runtime.custom_kernel(data)
    # The first size set's plan went, and the binding that held it with it
    assert len(runtime.RUNTIME.plans) == 2 and len(runtime.RUNTIME.bindings) == 2
    assert submission.input_key(sets[0]) not in runtime.RUNTIME.bindings
    runtime.custom_kernel(sets[0])  # planned and bound again
    assert len(backend.prepared) == 4


def test_lru_evicts_the_oldest_input_set(recording_runtime, monkeypatch):
    backend, validations = recording_runtime
    monkeypatch.setattr(runtime.RUNTIME, "bindings", submission.RuntimeCache(max_entries=3))
    sets = [make_inputs([(40, 128, 256, 1)]) for _ in range(4)]
    for data in sets:
        runtime.custom_kernel(data)
    assert len(runtime.RUNTIME.bindings) == 3 and validations == [] and len(backend.prepared) == 1
    runtime.custom_kernel(sets[3])  # still cached
    assert len(backend.bound) == 4
    runtime.custom_kernel(sets[0])  # evicted: bound again on the same plan
    assert len(backend.bound) == 5 and len(backend.prepared) == 1


def test_malformed_input_on_the_fast_path_reaches_validation(recording_runtime):
    _, validations = recording_runtime
    data = make_inputs([(40, 128, 256, 1)])
    with pytest.raises(TypeError, match="4-tuple"):
        runtime.custom_kernel(data[:3])
    with pytest.raises(TypeError, match=r"group 0: abc\[g\]"):
        runtime.custom_kernel(([data[0][0][:2]], data[1], data[2], data[3]))
    assert len(validations) == 2


def test_make_launcher_falls_back_to_the_plain_call():
    calls = []

    class PlainCompiled:
        def __call__(self, *args):
            calls.append(args)

    launch = submission.make_launcher(PlainCompiled(), 1, 2)
    launch()
    launch()
    assert calls == [(1, 2), (1, 2)]


@pytest.fixture(params=["per_tile", "persistent"])
def sm100_backend_on_cpu(request, monkeypatch):
    """The library's Sm100StreamBackend (each kernel choice) with its compiled kernels replaced
    by recorders (no GPU here)."""
    init_calls, gemm_calls = [], []

    def fake_init(ptrs, sizes, tensormaps, num_groups, stream):
        init_calls.append(int(num_groups))

    def fake_gemm(*args):
        gemm_calls.append(args)

    monkeypatch.setattr(sm100, "compile_per_tile_init", lambda num_groups: fake_init)
    monkeypatch.setattr(sm100, "compile_per_tile_gemm", lambda num_groups: fake_gemm)
    monkeypatch.setattr(sm100, "compile_persistent_init", lambda config: fake_init)
    monkeypatch.setattr(sm100, "compile_persistent_gemm", lambda config: fake_gemm)
    for module in (runtime, launch, sm100):
        monkeypatch.setattr(module, "stream_for_current", lambda: "stream")
    monkeypatch.setattr(runtime, "make_launcher", lambda fn, *args: lambda: fn(*args))
    return sm100.Sm100StreamBackend(request.param), init_calls, gemm_calls


def _bind_with(backend, pointers, sizes=((40, 384, 512, 1), (129, 128, 768, 1))):
    return runtime.Binding(runtime.Plan(backend, list(sizes), "cpu"), pointers)


def test_descriptors_rebuilt_only_when_a_pointer_they_hold_changes(sm100_backend_on_cpu):
    backend, init_calls, _ = sm100_backend_on_cpu
    persistent = backend.kernel == "persistent"
    num_slots = 5 if persistent else 4
    base = _pointers(2, 1 << 40)
    first = _bind_with(backend, base)
    assert init_calls == [2] and tuple(first.bound.value.shape) == (2, num_slots, 16)
    assert (first.plan.backend_plan.config is not None) == persistent

    # Only C of group 1 differs: the per-tile kernel's descriptors do not hold C (no init
    # kernel); the persistent kernel stores C by TMA, so its descriptors are rebuilt
    only_c = [base[0], base[1][:2] + (base[1][2] + 4096,) + base[1][3:]]
    second = _bind_with(backend, only_c)
    assert (second.bound is first.bound) != persistent
    assert len(init_calls) == (2 if persistent else 1)
    calls = len(init_calls)

    # Any A/B/SFA/SFB pointer differs: new descriptors
    for column in (submission.PTR_A, submission.PTR_B, submission.PTR_SFA, submission.PTR_SFB):
        changed = [base[0], tuple(v + 4096 if j == column else v for j, v in enumerate(base[1]))]
        assert _bind_with(backend, changed).bound is not first.bound, column
    assert len(init_calls) == calls + 4

    # The same pointers again: the cached descriptors
    assert _bind_with(backend, base).bound is first.bound
    # Same pointers, other sizes: new descriptors
    _bind_with(backend, base, sizes=((40, 384, 512, 1), (128, 128, 768, 1)))
    assert len(init_calls) == calls + 5


def test_no_launch_when_every_group_is_empty(sm100_backend_on_cpu):
    backend, _, gemm_calls = sm100_backend_on_cpu
    binding = _bind_with(backend, _pointers(2, 1 << 40), sizes=((0, 128, 256, 1), (0, 256, 256, 1)))
    assert binding.plan.num_tiles == 0
    binding.run("stream")
    assert gemm_calls == []


def test_persistent_launch_arguments(monkeypatch):
    """The persistent GEMM gets the tile table, the descriptors, G, the tile count and
    min(tiles, SMs / 2) clusters."""
    monkeypatch.setattr(sm100, "compile_persistent_init", lambda config: lambda *a: None)
    monkeypatch.setattr(sm100, "compile_persistent_gemm", lambda config: ("gemm", config))
    for module in (runtime, launch, sm100):
        monkeypatch.setattr(module, "stream_for_current", lambda: "stream")
    sizes = [(40, 384, 512, 1), (129, 128, 768, 1)]
    for num_sms, clusters in ((148, 4), (4, 2)):
        backend = sm100.Sm100StreamBackend("persistent", num_sms=num_sms)
        binding = _bind_with(backend, _pointers(2, 1 << 40), sizes=sizes)
        (fn, config), args = backend.launch_args(binding.plan, binding, "stream")
        assert fn == "gemm" and config.tokens_per_tile == 128
        # tiles: group 1 (M = 129) first: 1 N tile x 2 token tiles (3 k-tiles), then group 0:
        # 2 N tiles x 1 token tile (2 k-tiles)
        assert binding.plan.tiles.tolist() == [[1, 0, 0, 3], [1, 0, 1, 3], [0, 0, 0, 2], [0, 1, 0, 2]]
        assert [int(a) for a in args[2:5]] == [2, 4, clusters] and args[5] == "stream"


def test_list_problem_sizes_share_one_binding(recording_runtime):
    """problem_sizes as lists of lists never equal the plan's tuples: every call takes the
    checking path, which accepts them (the fast acceptor takes lists) and finds the one
    cached binding (no rebuild, one launch per call)."""
    backend, validations = recording_runtime
    data = make_inputs([(40, 384, 512, 1), (129, 128, 768, 1)])
    as_lists = (data[0], data[1], data[2], [list(p) for p in data[3]])
    for _ in range(3):
        runtime.custom_kernel(as_lists)
    assert validations == [] and len(backend.prepared) == 1 and len(backend.bound) == 1
    assert len(backend.launches) == 3
    runtime.custom_kernel(data)  # the official tuple form hits the same binding
    assert validations == [] and len(backend.bound) == 1 and len(backend.launches) == 4


def test_stream_change_prepares_the_launch_again(recording_runtime, monkeypatch):
    backend, _ = recording_runtime
    data = make_inputs([(40, 384, 512, 1)])
    runtime.custom_kernel(data)
    for module in (runtime, launch, sm100):
        monkeypatch.setattr(module, "stream_for_current", lambda: "stream-1")
    runtime.custom_kernel(data)
    runtime.custom_kernel(data)
    assert backend.args == ["stream-0", "stream-1"]
    assert [s for _, _, s in backend.launches] == ["stream-0", "stream-1", "stream-1"]


def test_backend_constraint_rejects_before_any_launch(recording_runtime):
    """A backend's own rule (e.g. sm_90's N multiple of 128) is checked on the validating
    path, before tables are built or anything is launched."""
    backend, _ = recording_runtime

    def only_n_multiple_of_256(problem_sizes):
        for g, (_m, n, _k, _l) in enumerate(problem_sizes):
            if n % 256:
                raise ValueError(f"group {g}: N = {n}; N must be a positive multiple of 256")

    backend.can_implement = only_n_multiple_of_256
    data = make_inputs([(40, 256, 512, 1), (129, 384, 768, 1)])
    before = data[0][1][2].clone()
    with pytest.raises(ValueError, match="group 1: N = 384"):
        runtime.custom_kernel(data)
    assert backend.prepared == [] and backend.launches == []
    assert torch.equal(data[0][1][2], before)


def test_hit_path_keys_and_touches_the_lru_like_the_cache_api(recording_runtime, monkeypatch):
    """custom_kernel inlines input_key and RuntimeCache.get: same key, and a hit makes its
    entry the most recent (the next eviction takes another one)."""
    monkeypatch.setattr(runtime.RUNTIME, "bindings", submission.RuntimeCache(max_entries=3))
    sets = [make_inputs([(40, 128, 256, 1)]) for _ in range(4)]
    for data in sets[:3]:
        runtime.custom_kernel(data)
    assert [submission.input_key(d) in runtime.RUNTIME.bindings for d in sets[:3]] == [True] * 3
    runtime.custom_kernel(sets[0])  # hit: sets[0] becomes the most recent
    runtime.custom_kernel(sets[3])  # evicts the least recent: sets[1]
    assert submission.input_key(sets[0]) in runtime.RUNTIME.bindings
    assert submission.input_key(sets[1]) not in runtime.RUNTIME.bindings


BENCHMARK_SETS = [
    ([80, 176, 128, 72, 64, 248, 96, 160], 4096, 7168),
    ([40, 76, 168, 72, 164, 148, 196, 160], 7168, 2048),
    ([192, 320], 3072, 4096),
    ([128, 384], 4096, 1536),
]


def _busiest_pair_us(sizes, tokens, num_sms=148):
    """Independent restatement of the rule's cost: the busiest pair's k-tiles times a k-tile's
    modelled µs (stage bytes at 122.7 KB/µs, or 128 x tokens x 256 MACs at 5797 TFLOP/s / 148)."""
    per_pair = [0] * (num_sms // 2)
    for index, (g, _, _) in enumerate(submission.plan_persistent_tiles(sizes, tokens)):
        per_pair[index % len(per_pair)] += sizes[g][2] // 256
    stage = 128 * 128 + tokens // 2 * 128 + 128 * 16 + tokens * 16
    k_tile_us = max(stage / 122_700, 2 * 128 * tokens * 256 / (5797.05e6 / 148))
    return max(per_pair) * k_tile_us


@pytest.mark.parametrize("ms, n, k", BENCHMARK_SETS)
def test_token_tile_rule_picks_the_pair_that_finishes_first(ms, n, k):
    sizes = [(m, n, k, 1) for m in ms]
    costs = {t: _busiest_pair_us(sizes, t) for t in (128, 256)}
    expected = 256 if costs[256] < costs[128] else 128
    assert submission.choose_tokens_per_tile(sizes) == expected


def test_token_tile_rule_on_known_sets():
    # Benchmark shapes: 256 tokens would take a tile off the busiest pair of shapes 0 and 1
    # (3 -> 2, 5 -> 4 tiles) but each k-tile is MMA-bound and 1.8x longer
    assert [submission.choose_tokens_per_tile([(m, n, k, 1) for m in ms]) for ms, n, k in BENCHMARK_SETS] == [
        128, 128, 128, 128
    ]
    # Large M, full waves: 1024 tiles of 128 tokens are 14 per pair, 512 of 256 are 7
    assert submission.choose_tokens_per_tile([(2048, 4096, 4096, 1)] * 4) == 256
    # One tile either way: the shorter k-tile wins
    assert submission.choose_tokens_per_tile([(40, 256, 256, 1)]) == 128


def test_launches_sharing_scratch_wait_only_when_the_stream_changes(monkeypatch):
    """The ordering of a plan's launches across streams records an event on the previous
    stream and makes the new one wait, only at a change of stream; a previous stream that is
    gone (the record fails) makes it wait for the whole context."""
    calls = []
    fake = launch.cuda
    monkeypatch.setattr(fake, "cuEventCreate", lambda flags: (fake.CUresult.CUDA_SUCCESS, "event"))
    monkeypatch.setattr(fake, "cuEventDestroy", lambda event: calls.append(("destroy", event)))

    def record(event, stream):
        calls.append(("record", stream))
        ok = stream != "gone"
        return (fake.CUresult.CUDA_SUCCESS if ok else fake.CUresult.CUDA_ERROR_INVALID_HANDLE,)

    monkeypatch.setattr(fake, "cuEventRecord", record)
    monkeypatch.setattr(fake, "cuStreamWaitEvent", lambda s, e, f: (calls.append(("wait", s)) or (fake.CUresult.CUDA_SUCCESS,)))
    monkeypatch.setattr(fake, "cuCtxSynchronize", lambda: (calls.append(("sync",)) or (fake.CUresult.CUDA_SUCCESS,)))

    class FakePlan:
        scratch_event = None
        scratch_stream = None

    plan = FakePlan()
    launches = {s: runtime._ordered_on_scratch(plan, s, lambda s=s: calls.append(("launch", s))) for s in ("s1", "s2")}
    for stream in ("s1", "s1", "s2", "s2", "s1"):
        launches[stream]()
    assert calls == [
        ("launch", "s1"), ("launch", "s1"),
        ("record", "s1"), ("wait", "s2"), ("launch", "s2"), ("launch", "s2"),
        ("record", "s2"), ("wait", "s1"), ("launch", "s1"),
    ]
    calls.clear()
    plan.scratch_stream = "gone"
    launches["s2"]()
    assert calls == [("record", "gone"), ("sync",), ("launch", "s2")]


def test_both_backends_and_their_plans_meet_the_protocols(monkeypatch):
    from nvfp4_group_gemm import hopper

    monkeypatch.setattr(hopper.backend, "current_num_sms", lambda: 132)
    for backend in (submission.Sm100Backend("persistent"), submission.Sm100Backend("per_tile")):
        assert isinstance(backend, submission.Backend), backend  # the leaderboard file's runtime
    for backend in (sm100.Sm100StreamBackend("persistent"), sm100.Sm100StreamBackend("per_tile"),
                    hopper.make_backend(), hopper.make_backend(kernel="in_gemm_decode")):
        assert isinstance(backend, runtime.Backend), backend
        assert isinstance(backend.oracle, submission.KernelChoice) and backend.oracle.host
        chain = backend.kernel_chain([(128, 256, 512, 1)])
        assert chain[-1].host and all(not c.host for c in list(chain)[:-1])
    assert isinstance(sm100.Sm100StreamPlan(submission.Sm100Plan(None, 1)), runtime.BackendPlan)
    assert isinstance(hopper.backend.Sm90Plan(hopper.SWAP_AB_CONFIG), runtime.BackendPlan)


def test_the_library_sm100_init_waits_for_tables_written_on_another_stream(sm100_backend_on_cpu, monkeypatch):
    """A plan made on one stream, an input set bound on another: the descriptor init kernel
    (which reads the plan's sizes) waits for the plan's table writing first."""
    backend, init_calls, _ = sm100_backend_on_cpu
    waits = []
    plan = runtime.Plan(backend, [(40, 384, 512, 1), (129, 128, 768, 1)], "cpu")
    plan.tables.stream, plan.tables.event = "stream-P", type("Event", (), {"event": "event-P"})()
    monkeypatch.setattr(launch.cuda, "cuStreamWaitEvent",
                        lambda stream, event, flags: waits.append((stream, event)) or (0,))
    monkeypatch.setattr(launch, "check_cuda", lambda result, what: None)
    runtime.Binding(plan, _pointers(2, 1 << 40))
    assert init_calls == [2] and waits == [("stream", "event-P")]


def test_run_with_backend_launches_nothing_when_every_group_is_empty(monkeypatch):
    """Every M = 0: no tile, so nothing to launch (a grid of 0 CTAs is an invalid launch,
    CUresult 9 on an H100); run_with_backend leaves the binding's NOTHING mode alone."""
    runtime_on_cpu(monkeypatch, None)

    class NeverLaunches(TableBackend):
        def can_implement(self, problem_sizes):
            pass

        def launch_args(self, plan, binding, stream):
            raise AssertionError("launched a grid of 0 CTAs")

    data = make_inputs([(0, 128, 256, 1), (0, 256, 512, 1)])
    before = [c.clone() for _, _, c in data[0]]
    outputs = runtime.run_with_backend(data, NeverLaunches())
    assert [c.shape for c in outputs] == [(0, 128, 1), (0, 256, 1)]
    assert all(torch.equal(c, old) for c, old in zip(outputs, before))
