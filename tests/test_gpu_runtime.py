"""The shared host runtime on a real GPU: custom_kernel through its runtime cache.

Back-to-back calls whose pointer sets differ by a single tensor must each compute with their
own tensors: a stale table, descriptor or prepared launch argument (a cache keyed on too
little, or a staging buffer rewritten while its copy is pending) gives a wrong output here.
Runs on any GPU the submission supports (sm_100 or sm_90); skipped elsewhere.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from helpers import supported_gpu

from nvfp4_group_gemm import core as submission
from nvfp4_group_gemm import launch, runtime, switches
from reference import generate_input, match_outputs, ref_kernel

pytestmark = pytest.mark.skipif(not supported_gpu(), reason="needs an sm_100 or sm_90 GPU")

# N a multiple of 128 (the sm_90 kernel's constraint), M with residues, a group of M = 0
SIZES = {"m": (40, 129, 0), "n": (128, 384, 256), "k": (256, 512, 256), "g": 3}
FIELDS = ("a", "b", "c", "sfa", "sfb")


def _clone(data):
    abc, sfasfb, sfasfb_reordered, problem_sizes = data
    return (
        [tuple(t.clone() for t in group) for group in abc],
        [tuple(t.clone() for t in group) for group in sfasfb],
        [tuple(t.clone() for t in group) for group in sfasfb_reordered],
        list(problem_sizes),
    )


def _with_one_tensor_from(base, other, group: int, field: str):
    """`base` with one tensor of `group` taken from `other` (same sizes, other content).

    A scale swap takes both the reordered tensor (read by the kernel) and the plain one
    (read by the reference), so the expected result follows the swap.
    """
    abc = list(base[0])
    sfasfb = list(base[1])
    sfasfb_reordered = list(base[2])
    if field in ("a", "b", "c"):
        position = "abc".index(field)
        group_abc = list(abc[group])
        group_abc[position] = other[0][group][position]
        abc[group] = tuple(group_abc)
    else:
        position = ("sfa", "sfb").index(field)
        for tensors, source in ((sfasfb, other[1]), (sfasfb_reordered, other[2])):
            pair = list(tensors[group])
            pair[position] = source[group][position]
            tensors[group] = tuple(pair)
    return (abc, sfasfb, sfasfb_reordered, list(base[3]))


def _variants():
    base = generate_input(**SIZES, seed=1234)
    other = generate_input(**SIZES, seed=4321)
    variants = [base]
    for group in (0, 1):  # group 2 has M = 0: its tensors are never read
        for field in FIELDS:
            variants.append(_with_one_tensor_from(base, other, group, field))
    return variants


def _run_back_to_back(variants):
    """One custom_kernel call per variant with no synchronization in between; each result is
    snapshot on the same stream right after its call (later calls may write the same c)."""
    snapshots = []
    for data in variants:
        out = runtime.custom_kernel(data)
        snapshots.append([c.clone() for c in out])
    torch.cuda.synchronize()
    return snapshots


def test_back_to_back_calls_differing_by_one_tensor():
    variants = _variants()
    expected = [ref_kernel(_clone(data)) for data in variants]
    # First pass: every variant is a runtime-cache miss; second pass: every one a hit.
    for pass_name in ("miss", "hit"):
        snapshots = _run_back_to_back(variants)
        for index, (want, got) in enumerate(zip(expected, snapshots)):
            good, message = match_outputs(want, got)
            assert good, f"{pass_name} pass, variant {index}: {message}"


def test_variants_really_differ():
    """Guard for the test above: every swap changes the expected output or the output tensor."""
    variants = _variants()
    expected = [ref_kernel(_clone(data)) for data in variants]
    for index in range(1, len(variants)):
        field = FIELDS[(index - 1) % len(FIELDS)]
        group = (index - 1) // len(FIELDS)
        if field == "c":
            assert variants[index][0][group][2].data_ptr() != variants[0][0][group][2].data_ptr()
        else:
            assert not torch.equal(expected[index][group], expected[0][group]), (index, field)


def test_steady_state_is_one_launch_without_copies():
    """A hit launches the backend's kernels once each (one GEMM; on sm_90 with the default
    swap-AB kernel, the activation pre-pass and the GEMM) and makes no host-to-device copy
    (torch profiler count)."""
    data = generate_input(**SIZES, seed=99)
    runtime.custom_kernel(data)  # miss: tables, copies, compile
    runtime.custom_kernel(data)  # second call: records the graph
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runtime.custom_kernel(data)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = [e.name for e in kernels]
    assert not any("Memcpy" in name or "Memset" in name for name in names), names
    plan = _state_of(data).plan
    swap_ab = getattr(plan.backend_plan, "activations", None) is not None
    assert len(names) == (2 if swap_ab else 1), names
    if swap_ab:
        assert "DecodeActivations" in names[0] and "SwapAbGemm" in names[1], names


def _state_of(data):
    return runtime.RUNTIME.bindings.get(submission.input_key(data))


def _zero_outputs(data):
    for _, _, c in data[0]:
        c.zero_()


def test_hit_replays_the_recorded_graph_on_any_stream():
    """By default an input set's first call launches directly and its second records a CUDA
    graph, once; each replay computes (the outputs are zeroed before it), on torch's current
    stream and on another one."""
    data = generate_input(**SIZES, seed=77)
    expected = ref_kernel(_clone(data))
    runtime.custom_kernel(data)
    state = _state_of(data)
    assert state.mode is runtime.LaunchMode.FIRST_DIRECT and state.launched
    runtime.custom_kernel(data)
    assert isinstance(state.graph, launch.GraphLaunch)
    graph = state.graph
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            _zero_outputs(data)
            out = runtime.custom_kernel(data)
        stream.synchronize()
        good, message = match_outputs(expected, out)
        assert good, message
    assert state.graph is graph  # a stream change re-binds the replay, it does not re-record


def test_direct_launch_when_graphs_are_off(monkeypatch):
    monkeypatch.setattr(switches, "CURRENT", dataclasses.replace(switches.CURRENT, graph_launch=False))
    data = generate_input(**SIZES, seed=78)
    expected = ref_kernel(_clone(data))
    runtime.custom_kernel(data)
    assert _state_of(data).mode is runtime.LaunchMode.DIRECT
    _zero_outputs(data)
    good, message = match_outputs(expected, runtime.custom_kernel(data))
    assert good, message


def test_failed_capture_leaves_capture_mode_and_falls_back(monkeypatch):
    """A launch that raises while recorded ends the capture (the private stream is usable
    again), and custom_kernel then launches directly."""

    def failing_record(stream):
        def launch():
            raise RuntimeError("launch refused")

        return launch

    device = torch.device("cuda", torch.cuda.current_device())
    with pytest.raises(RuntimeError, match="launch refused"):
        launch.GraphLaunch(failing_record, device)
    capture_stream = launch._CAPTURE_STREAMS[device.index]
    result, status = launch.cuda.cuStreamIsCapturing(
        launch.cuda.CUstream(capture_stream.cuda_stream)
    )
    assert result == launch.cuda.CUresult.CUDA_SUCCESS
    assert status == launch.cuda.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    class RefusingGraphLaunch:
        def __init__(self, record, device):
            raise RuntimeError("no graphs here")

    monkeypatch.setattr(runtime, "GraphLaunch", RefusingGraphLaunch)
    data = generate_input(**SIZES, seed=79)
    expected = ref_kernel(_clone(data))
    runtime.custom_kernel(data)  # launched directly
    _zero_outputs(data)
    out = runtime.custom_kernel(data)  # the capture fails: launched directly again
    torch.cuda.synchronize()
    assert _state_of(data).mode is runtime.LaunchMode.DIRECT
    good, message = match_outputs(expected, out)
    assert good, message


def test_first_launch_of_a_fresh_process_is_recorded():
    """In a fresh process (the kernel's module not loaded yet) the first call launches
    directly and the second is recorded into a graph; both compute: run in a subprocess."""
    import subprocess

    script = (
        "import torch, submission\n"
        "from nvfp4_group_gemm import runtime\n"
        "from reference import generate_input, ref_kernel, match_outputs\n"
        f"data = generate_input(**{SIZES!r}, seed=80)\n"
        "expected = ref_kernel(data)\n"
        "first = [c.clone() for c in runtime.custom_kernel(data)]\n"
        "for _, _, c in data[0]: c.zero_()\n"
        "out = runtime.custom_kernel(data)\n"
        "torch.cuda.synchronize()\n"
        "assert match_outputs(expected, first)[0]\n"
        "state = runtime.RUNTIME.bindings.get(submission.input_key(data))\n"
        "print(type(state.graph).__name__, match_outputs(expected, out)[0])\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["GraphLaunch", "True"], done.stdout
