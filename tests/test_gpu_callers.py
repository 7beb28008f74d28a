"""The runtime for real callers on a GPU the submission supports (the H200 here): custom_kernel
inside a caller's CUDA graph, from two threads at once, and through the torch op under
torch.compile(fullgraph=True)."""

import threading

import pytest
import torch
from helpers import supported_gpu

from nvfp4_group_gemm import core as submission
from nvfp4_group_gemm import op, runtime, switches
from reference import generate_input, ref_kernel

pytestmark = pytest.mark.skipif(not supported_gpu(), reason="needs an sm_100 or sm_90 GPU")

SIZES = {"m": (40, 129, 0, 200), "n": (128, 384, 256, 256), "k": (256, 512, 256, 768), "g": 4}


def _expected(data):
    clone = ([(a, b, c.clone()) for a, b, c in data[0]], data[1], data[2], data[3])
    return [c.clone() for c in ref_kernel(clone)]


def _write_values(into, source):
    """Copy every input tensor of `source` into `into`'s tensors (same sizes): new values in
    the same buffers."""
    for group_into, group_source in zip(into[0], source[0]):
        for t, s in zip(group_into[:2], group_source[:2]):
            t.view(torch.uint8).copy_(s.view(torch.uint8))
    for field in (1, 2):
        for group_into, group_source in zip(into[field], source[field]):
            for t, s in zip(group_into, group_source):
                t.view(torch.uint8).copy_(s.view(torch.uint8))


def _replays_are_exact(graph, data, seeds):
    """Per seed: new values into `data`'s tensors, NaN into its c, one replay, every c exact.
    Returns the last seed's expected outputs."""
    for seed in seeds:
        other = generate_input(**SIZES, seed=seed)
        _write_values(data, other)
        for _, _, c in data[0]:
            c.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = _expected(other)
        assert all(torch.equal(c, w) for (_, _, c), w in zip(data[0], want)), seed
    return want


@pytest.mark.parametrize("chain_calls", [True, False], ids=["chained", "unchained"])
def test_custom_kernel_inside_a_callers_cuda_graph(chain_calls, monkeypatch):
    if torch.cuda.get_device_capability()[0] == 9:
        from nvfp4_group_gemm import hopper

        backend = hopper.make_backend(chain_calls=chain_calls)
        monkeypatch.setitem(runtime._BACKEND_BY_DEVICE, torch.cuda.current_device(), backend)
    elif not chain_calls:
        pytest.skip("sm_100 calls are not chained")
    data = generate_input(**SIZES, seed=21)
    runtime.custom_kernel(data)  # one eager call of these tensors first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runtime.custom_kernel(data)
    want = _replays_are_exact(graph, data, (22, 23))
    # eager calls after the capture: still exact
    out = runtime.custom_kernel(data)
    torch.cuda.synchronize()
    assert all(torch.equal(c, w) for c, w in zip(out, want))


def test_an_unseen_input_set_under_capture_is_one_clear_error():
    data = generate_input(**SIZES, seed=31)
    graph = torch.cuda.CUDAGraph()
    with (pytest.raises(RuntimeError, match="call custom_kernel once eagerly with the same tensors"),
          torch.cuda.graph(graph)):
        runtime.custom_kernel(data)
    # the process is fine afterwards
    out = runtime.custom_kernel(data)
    torch.cuda.synchronize()
    assert all(torch.equal(c, w) for c, w in zip(out, _expected(data)))


def _unbound_first_calls() -> bool:
    """Whether this GPU's backend launches an input set's first call without a binding (sm_90
    swap-AB; every sm_100 launch needs its descriptors bound)."""
    return torch.cuda.get_device_capability()[0] == 9 and switches.CURRENT.first_call_unbound


def test_a_first_call_captured_reads_its_tables_from_the_arena():
    """An input set run once eagerly as a first call (no binding: its kernel was checked on
    other tensors of the same sizes) is captured with its tables in the capture arena; the
    replays after new values are exact."""
    # the kernel's self-check, on tensors kept alive: freed, their blocks would come back as
    # the next input set's, whose call would then hit this one's binding (same pointers)
    checked = generate_input(**SIZES, seed=50)
    runtime.custom_kernel(checked)
    data = generate_input(**SIZES, seed=51)
    runtime.custom_kernel(data)
    torch.cuda.synchronize()
    assert (submission.input_key(data) not in runtime.RUNTIME.bindings) == _unbound_first_calls()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runtime.custom_kernel(data)
    if _unbound_first_calls():
        assert any(key[0] == "first call" for key in runtime.RUNTIME.captured.entries)
    _replays_are_exact(graph, data, (52, 53))


def test_moe_steps_with_new_sizes_every_call_are_exact():
    """New per-group M at every call (an empty group among them), new activations, the same
    weights: each call exact, none bound (first calls) where the backend allows."""
    import random

    rng = random.Random(8)
    groups, n, k = 4, 512, 1024
    runtime.warmup(n, k, groups)
    weights = generate_input(m=(1,) * groups, n=(n,) * groups, k=(k,) * groups, g=groups, seed=60)
    for step in range(6):
        ms = [rng.randrange(1, 300) for _ in range(groups)]
        ms[step % groups] = 0 if step % 3 == 0 else ms[step % groups]
        data = generate_input(m=tuple(ms), n=(n,) * groups, k=(k,) * groups, g=groups, seed=61 + step)
        data = ([(a, wb, c) for (a, _b, c), (_a, wb, _c) in zip(data[0], weights[0])],
                [(sfa, wsfb) for (sfa, _s), (_sa, wsfb) in zip(data[1], weights[1])],
                [(sfa, wsfb) for (sfa, _s), (_sa, wsfb) in zip(data[2], weights[2])], data[3])
        out = runtime.custom_kernel(data)
        torch.cuda.synchronize()
        assert all(torch.equal(o, w) for o, w in zip(out, _expected(data))), (step, ms)
        if step and _unbound_first_calls():
            # the first step's kernel was self-checked through a binding; later sizes may pick
            # a kernel not checked yet (bound once), never more than one binding per kernel
            assert len(runtime.RUNTIME.bindings) <= len(submission.SELF_CHECKED)


def test_two_threads_each_on_its_own_stream_compiling_at_once():
    # group counts no other test compiles: both threads' first calls compile at the same time
    families = [{"m": (72,) * 5, "n": (256,) * 5, "k": (512,) * 5, "g": 5},
                {"m": (33,) * 7, "n": (384,) * 7, "k": (768,) * 7, "g": 7}]
    inputs = [generate_input(**family, seed=40 + i) for i, family in enumerate(families)]
    expected = [_expected(data) for data in inputs]
    errors, wrong = [], []
    start = threading.Barrier(2)

    def work(index):
        stream = torch.cuda.Stream()
        data = inputs[index]
        try:
            start.wait()
            with torch.cuda.stream(stream):
                for call in range(200):
                    out = runtime.custom_kernel(data)
                    if call in (0, 1, 2, 199):
                        stream.synchronize()
                        if not all(torch.equal(o, w) for o, w in zip(out, expected[index])):
                            wrong.append((index, call))
            stream.synchronize()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append((index, repr(error)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and wrong == []


def test_the_torch_op_under_torch_compile_matches_eager():
    data = generate_input(**SIZES, seed=51)
    want = _expected(data)

    def step(data):
        out = op.grouped_gemm(data)
        return [c.float() * 2 for c in out]

    compiled = torch.compile(step, fullgraph=True)
    got = compiled(data)
    torch.cuda.synchronize()
    assert all(torch.equal(g, w.float() * 2) for g, w in zip(got, want))
