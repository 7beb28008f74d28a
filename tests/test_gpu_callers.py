"""The runtime for real callers on a GPU the submission supports (the H200 here): custom_kernel
inside a caller's CUDA graph, from two threads at once, and through the torch op under
torch.compile(fullgraph=True)."""

import threading

import pytest
import torch
from helpers import supported_gpu

import submission
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


@pytest.mark.parametrize("chain_calls", [True, False], ids=["chained", "unchained"])
def test_custom_kernel_inside_a_callers_cuda_graph(chain_calls, monkeypatch):
    if torch.cuda.get_device_capability()[0] == 9:
        import nvfp4_hopper

        backend = nvfp4_hopper.make_backend(chain_calls=chain_calls)
        monkeypatch.setitem(submission._BACKEND_BY_DEVICE, torch.cuda.current_device(), backend)
    elif not chain_calls:
        pytest.skip("sm_100 calls are not chained")
    data = generate_input(**SIZES, seed=21)
    submission.custom_kernel(data)  # one eager call of these tensors first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        submission.custom_kernel(data)
    for seed in (22, 23):
        other = generate_input(**SIZES, seed=seed)
        _write_values(data, other)
        for _, _, c in data[0]:
            c.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = _expected(other)
        assert all(torch.equal(c, w) for (_, _, c), w in zip(data[0], want)), seed
    # eager calls after the capture: still exact
    out = submission.custom_kernel(data)
    torch.cuda.synchronize()
    assert all(torch.equal(c, w) for c, w in zip(out, want))


def test_an_unseen_input_set_under_capture_is_one_clear_error():
    data = generate_input(**SIZES, seed=31)
    graph = torch.cuda.CUDAGraph()
    with (pytest.raises(RuntimeError, match="call custom_kernel once eagerly with the same tensors"),
          torch.cuda.graph(graph)):
        submission.custom_kernel(data)
    # the process is fine afterwards
    out = submission.custom_kernel(data)
    torch.cuda.synchronize()
    assert all(torch.equal(c, w) for c, w in zip(out, _expected(data)))


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
                    out = submission.custom_kernel(data)
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
        out = submission.grouped_gemm(data)
        return [c.float() * 2 for c in out]

    compiled = torch.compile(step, fullgraph=True)
    got = compiled(data)
    torch.cuda.synchronize()
    assert all(torch.equal(g, w.float() * 2) for g, w in zip(got, want))
