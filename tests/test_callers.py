"""The runtime for real callers, on a CPU: a call inside a caller's CUDA graph capture (the
sm_100 path, its kernels faked), an allocation failure while building a plan or a binding,
the warm-up entry, and the torch op under torch.compile(fullgraph=True)."""

import helpers
import pytest
import torch
from helpers import assert_exact, expected, official_inputs

from nvfp4_group_gemm import core as submission
from nvfp4_group_gemm import launch, op, runtime, sm100

sm100_runtime = pytest.fixture(helpers.sm100_library_runtime)
SIZES = ((128, 256, 512, 1), (40, 256, 256, 1))


# ----------------------------------------------------------------------------- capture
def test_a_call_under_capture_records_into_the_callers_graph(sm100_runtime, monkeypatch):
    fakes, run = sm100_runtime
    data = official_inputs(SIZES)
    assert_exact(run(data), data)  # the eager call first: plans, compiles, writes the tables
    (binding,) = runtime.RUNTIME.bindings.entries.values()
    recorded, waits = [], []
    monkeypatch.setattr(runtime, "GraphLaunch", lambda *a, **k: recorded.append(a))
    monkeypatch.setattr(launch.Written, "order_before", lambda self, stream: waits.append(stream))
    monkeypatch.setattr(runtime, "is_capturing", lambda: True)
    for module in (runtime, launch, sm100):
        monkeypatch.setattr(module, "stream_for_current", lambda: "capture-stream")
    for c in (c for _, _, c in data[0]):
        c.zero_()
    # a full _CAPTURED: the capture's binding evicts an older entry (a binding and its graph),
    # which must outlive the capture (destroying a graph inside it invalidates the caller's)
    import gc
    import weakref

    class EvictedBinding:
        pass

    monkeypatch.setattr(runtime.RUNTIME, "captured", submission.RuntimeCache(max_entries=1))
    monkeypatch.setattr(launch, "RETIRED", [])
    monkeypatch.setattr(launch, "is_capturing", lambda: True)  # launch.retire asks it (both entries retire there)
    evicted = EvictedBinding()
    evicted_alive = weakref.ref(evicted)
    runtime.RUNTIME.captured.put("older capture", evicted)
    del evicted
    out = run(data)
    gc.collect()
    assert evicted_alive() is not None, "an entry evicted during the capture was destroyed inside it"
    # launched directly into the capturing stream: no graph of its own, no waits on events
    # recorded outside the capture, no self-check
    assert fakes.ran == ["persistent_gemm", "persistent_gemm"]
    assert recorded == [] and waits == []
    assert_exact(out, data)
    assert binding.stream is None  # after the capture, the next call prepares again
    assert runtime.RUNTIME.captured.get((binding.plan.problem_sizes, binding.pointers)) is binding
    # The caller's graph keeps the binding's tables alive beyond the LRU bound
    runtime.RUNTIME.bindings.clear()
    assert len(runtime.RUNTIME.captured) == 1
    # the next call outside a capture lets the evicted entry go
    monkeypatch.setattr(runtime, "is_capturing", lambda: False)
    monkeypatch.setattr(launch, "is_capturing", lambda: False)
    runtime.RUNTIME.bound_input_set(data, None)
    gc.collect()
    assert evicted_alive() is None and launch.RETIRED == []
    launch.retire([EvictedBinding()])  # outside a capture nothing is retired
    assert launch.RETIRED == []


def test_a_new_input_set_under_capture_is_one_clear_error(sm100_runtime, monkeypatch):
    _fakes, run = sm100_runtime
    monkeypatch.setattr(runtime, "is_capturing", lambda: True)
    data = official_inputs(SIZES)
    with pytest.raises(RuntimeError, match="call custom_kernel once eagerly with the same tensors before capturing"):
        run(data)
    assert len(runtime.RUNTIME.bindings) == 0 and len(runtime.RUNTIME.plans) == 0


# ----------------------------------------------------------------------------- faults
@pytest.mark.parametrize("failing_table", [0, 1], ids=["plan", "binding"])
def test_an_allocation_failure_caches_nothing_half_built(sm100_runtime, monkeypatch, failing_table):
    """The first upload_int_tables call builds the plan's tables, the second the binding's."""
    _fakes, run = sm100_runtime
    real = launch.upload_int_tables
    calls = []

    def failing(device, tables):
        calls.append(1)
        if len(calls) == failing_table + 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real(device, tables)

    monkeypatch.setattr(runtime, "upload_int_tables", failing)
    data = official_inputs(SIZES)
    before = [c.clone() for _, _, c in data[0]]
    with pytest.raises(torch.OutOfMemoryError, match=r"custom_kernel: out of GPU memory while building the plan "
                                                     r"or binding of sizes \[\(128, 256, 512, 1\), \(40, 256, 256, 1\)\]"):
        run(data)
    assert all(torch.equal(c, b) for (_, _, c), b in zip(data[0], before)), "outputs untouched"
    assert len(runtime.RUNTIME.bindings) == 0
    # a plan is cached only whole: with its tables when the binding's failed, not at all otherwise
    assert len(runtime.RUNTIME.plans) == failing_table
    assert all(plan.backend_plan is not None for plan in runtime.RUNTIME.plans.entries.values())
    # memory back: the next call works
    monkeypatch.setattr(runtime, "upload_int_tables", real)
    assert_exact(run(data), data)


# ----------------------------------------------------------------------------- warm-up
def test_warmup_compiles_every_kernel_of_the_family_so_no_call_compiles(sm100_runtime, monkeypatch):
    fakes, run = sm100_runtime
    backend = runtime._BACKEND_BY_DEVICE[None]
    monkeypatch.setattr(runtime, "select_backend", lambda index: backend)
    monkeypatch.setattr(submission, "resident_clusters", lambda device, cluster_size=2: None)
    compiled = runtime.warmup(256, 512, 2, device="cpu")
    assert [name.split(" ")[0] for name in compiled] == ["persistent_t128", "persistent_t256"]
    assert sorted(set(fakes.compiled)) == ["persistent_gemm", "persistent_init"]
    warmed = {choice.kernel_key(2) for choice in backend.family_choices(2, 256, 512)}
    # Steps of the family with new M every call: each runs a kernel warmup built (the compile
    # caches are keyed on what a choice's kernel_key holds), so none compiles
    ran = set()
    for seed, ms in enumerate([(128, 40), (300, 8), (4, 1000), (256, 256), (1, 1)]):
        data = official_inputs(((ms[0], 256, 512, 1), (ms[1], 256, 512, 1)), seed=seed)
        assert_exact(run(data), data)
        ran |= {plan.kernel_key for plan in runtime.RUNTIME.plans.entries.values()}
    assert ran and ran <= warmed


def test_warmup_checks_its_arguments():
    with pytest.raises(ValueError, match=r"warmup: k = 100; rule: an int, a positive multiple of 256"):
        runtime.warmup(4096, 100, 8)
    with pytest.raises(ValueError, match=r"warmup: groups = 65; rule: an int, 1 <= groups <= 64"):
        runtime.warmup(4096, 256, 65)
    with pytest.raises(TypeError, match=r"warmup: n = 4096.0; rule: an int >= 1"):
        runtime.warmup(4096.0, 256, 8)


# ----------------------------------------------------------------------------- the torch op
def test_the_op_traces_without_a_graph_break_and_matches():
    data = official_inputs(((40, 256, 512, 1), (0, 128, 256, 1), (129, 384, 256, 1)), seed=3)
    want = expected(data)

    def step(data):
        out = op.grouped_gemm(data)
        return [c.float().sum() for c in out]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    sums = compiled(data)
    assert [float(s) for s in sums] == [float(w.float().sum()) for w in want]
    assert all(torch.equal(c, w) for (_, _, c), w in zip(data[0], want))


def test_the_op_schema_and_fake():
    data = official_inputs(((40, 256, 512, 1), (129, 384, 256, 1)), seed=4)
    abc, sfs, sfs_r, sizes = data
    args = ([a for a, _, _ in abc], [b for _, b, _ in abc], [c for _, _, c in abc], [s for s, _ in sfs],
            [s for _, s in sfs], [s for s, _ in sfs_r], [s for _, s in sfs_r], [v for s in sizes for v in s])
    torch.library.opcheck(op.grouped_gemm_op, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))  # no fp4 copy_ for test_schema
