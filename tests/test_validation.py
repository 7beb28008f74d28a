"""validate_inputs / custom_kernel input checks (CPU only, nothing is launched).

Every bad input must raise a ValueError/TypeError that names the group, the field, the value
and the rule, before any launch, with the output tensors left untouched.
"""

import pickle
import sys
import types

import pytest
import torch
from helpers import fp4_operand, make_inputs, reordered_scales, replace_tensor

from nvfp4_group_gemm import core as submission
from nvfp4_group_gemm import runtime

SIZES = [(128, 256, 512, 1), (40, 384, 256, 1), (129, 128, 768, 1)]


def _outputs(data):
    return [abc[2] for abc in data[0]]


def _expect_error(data, error, *fragments):
    """Run custom_kernel; check the error type, that every fragment is in the message, that
    the error survives pickling, and that no c tensor changed."""
    before = [c.clone() for c in _outputs(data)] if isinstance(data, tuple) and len(data) == 4 else []
    with pytest.raises(error) as info:
        submission.custom_kernel(data)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    clone = pickle.loads(pickle.dumps(info.value))
    assert type(clone) is type(info.value) and str(clone) == message
    for old, new in zip(before, _outputs(data)):
        assert torch.equal(old, new), "an output was written before the error"
    return message


def test_valid_layout_passes_all_but_the_device_rule():
    # Everything matches the official layout; only the device is wrong (CPU)
    data = make_inputs(SIZES)
    message = _expect_error(data, ValueError, "group 0", "a.device", "'cpu'", "CUDA device")
    assert "shape" not in message and "stride" not in message and "dtype" not in message


def test_validate_inputs_rejects_cpu_directly():
    with pytest.raises(ValueError, match=r"group 0: a\.device = 'cpu'; rule: every tensor must be on a CUDA device"):
        submission.validate_inputs(make_inputs(SIZES))


@pytest.mark.parametrize(
    ("mutate", "error", "fragments"),
    [
        (lambda d: d[:3], TypeError, ["input", "len(data)", "3", "4-tuple"]),
        (lambda d: (d[0][:2], d[1], d[2], d[3]), ValueError, ["len(abc)", "2", "G = len(problem_sizes) = 3"]),
        (lambda d: (d[0], d[1], d[2][:1], d[3]), ValueError, ["len(sfasfb_reordered)", "1", "= 3"]),
        (lambda d: (d[0], d[1][:2], d[2], d[3]), ValueError, ["len(sfasfb)", "2", "= 3"]),
        (lambda d: ([], [], [], []), ValueError, ["len(problem_sizes)", "0", "1 <= G <= 64"]),
        (lambda d: (d[0], d[1], d[2], d[3][:2] + [(129, 128, 768)]), TypeError, ["group 2", "(129, 128, 768)", "4-tuple"]),
        (lambda d: (d[0], d[1], d[2], d[3][:1] + [(40, 384, 256, 2)] + d[3][2:]), ValueError, ["group 1", "L = 2", "L must be 1"]),
        (lambda d: (d[0], d[1], d[2], d[3][:2] + [(129, 128, 640, 1)]), ValueError, ["group 2", "K = 640", "multiple of 256"]),
        (lambda d: (d[0], d[1], d[2], d[3][:2] + [(129, 0, 768, 1)]), ValueError, ["group 2", "N = 0", "N must be >= 1"]),
        (lambda d: (d[0], d[1], d[2], [(128, 256, 512.0, 1)] + d[3][1:]), TypeError, ["group 0", "problem_sizes[g].K", "512.0", "integer"]),
    ],
    ids=["arity", "len-abc", "len-reordered", "len-sfasfb", "zero-groups", "size-arity", "L", "K", "N", "float-K"],
)
def test_structure_and_problem_size_rules(mutate, error, fragments):
    _expect_error(mutate(make_inputs(SIZES)), error, *fragments)


def test_k_not_multiple_of_256_is_rejected_not_truncated():
    # K = 384 tensors, consistent with each other: the kernel's K loop would drop the last 128
    sizes = [(128, 128, 384, 1)]
    data = make_inputs([(128, 128, 512, 1)])
    data = (data[0], data[1], data[2], sizes)
    _expect_error(data, ValueError, "group 0", "K = 384", "positive multiple of 256")


def test_too_many_groups():
    data = make_inputs([(0, 128, 256, 1)] * 65)
    _expect_error(data, ValueError, "len(problem_sizes)", "65", "1 <= G <= 64")


@pytest.mark.parametrize(
    ("group", "field", "make_bad", "error", "fragments"),
    [
        (1, "a", lambda m, n, k: torch.zeros((m, k // 2, 1), dtype=torch.uint8), TypeError,
         ["a.dtype", "torch.uint8", "float4_e2m1fn_x2"]),
        (2, "b", lambda m, n, k: torch.zeros((n, k // 2, 1), dtype=torch.float16), TypeError,
         ["b.dtype", "torch.float16", "float4_e2m1fn_x2"]),
        (0, "c", lambda m, n, k: torch.zeros((m, n, 1), dtype=torch.float32), TypeError,
         ["c.dtype", "torch.float32", "torch.float16"]),
        (1, "sfa_reordered", lambda m, n, k: reordered_scales(m, k).view(torch.uint8), TypeError,
         ["sfa_reordered.dtype", "torch.uint8", "float8_e4m3fn"]),
        (1, "a", lambda m, n, k: fp4_operand(m + 1, k), ValueError,
         ["a.shape", "(41, 128, 1)", "expected (40, 128, 1)"]),
        (2, "b", lambda m, n, k: fp4_operand(n, 2 * k), ValueError,
         ["b.shape", "(128, 768, 1)", "expected (128, 384, 1)"]),
        (0, "c", lambda m, n, k: torch.zeros((n, m, 1), dtype=torch.float16), ValueError,
         ["c.shape", "(256, 128, 1)", "expected (128, 256, 1)"]),
        (2, "sfb_reordered", lambda m, n, k: reordered_scales(n + 128, k), ValueError,
         ["sfb_reordered.shape", "(32, 4, 2, 4, 12, 1)", "expected (32, 4, 1, 4, 12, 1)"]),
        (0, "sfa_reordered", lambda m, n, k: reordered_scales(m, 2 * k), ValueError,
         ["sfa_reordered.shape", "(32, 4, 1, 4, 16, 1)", "expected (32, 4, 1, 4, 8, 1)"]),
        # Transposed storage: right shape, K not unit-stride
        (0, "a", lambda m, n, k: fp4_operand(m, k).permute(1, 0, 2).contiguous().permute(1, 0, 2), ValueError,
         ["a.stride()", "(1, 128, 1)", "mode 0 must have stride 256"]),
        # c as a column slice of a wider tensor: row stride is not N
        (1, "c", lambda m, n, k: torch.zeros((m, 2 * n, 1), dtype=torch.float16)[:, :n], ValueError,
         ["group 1", "c.stride()", "(768, 1, 1)", "mode 0 must have stride 384"]),
        # Reordered scales made contiguous in their permuted shape: not the official strides
        (2, "sfa_reordered", lambda m, n, k: reordered_scales(m, k).contiguous(), ValueError,
         ["sfa_reordered.stride()", "official reordered scale layout"]),
        # Misaligned base address: a view starting 16 bytes into a buffer
        (0, "a", lambda m, n, k: torch.zeros(m * k // 2 + 16, dtype=torch.uint8)[16:]
         .view(m, k // 2, 1).view(torch.float4_e2m1fn_x2), ValueError,
         ["a.data_ptr() % 32", "32-byte aligned"]),
    ],
    ids=["a-dtype", "b-dtype", "c-dtype", "sfa-dtype", "a-rows", "b-k", "c-swapped", "sfb-rest-n",
         "sfa-rest-k", "a-transposed", "c-row-stride", "sfa-contiguous", "a-misaligned"],
)
def test_tensor_rules(group, field, make_bad, error, fragments):
    data = make_inputs(SIZES)
    m, n, k, _ = SIZES[group]
    bad = make_bad(m, n, k)
    message = _expect_error(replace_tensor(data, group, field, bad), error, f"group {group}", *fragments)
    assert "rule:" in message


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_devices_must_match():
    data = make_inputs(SIZES)
    abc = [tuple(t.to("cuda:0") for t in group) for group in data[0]]
    reordered = [tuple(t.to("cuda:0") for t in group) for group in data[2]]
    abc[1] = (abc[1][0], abc[1][1].to("cuda:1"), abc[1][2])
    with pytest.raises(ValueError, match=r"group 1: b\.device = 'cuda:1'; rule: expected cuda:0"):
        submission.validate_inputs((abc, data[1], reordered, data[3]))


def test_empty_m_group_is_valid_up_to_the_device_rule():
    data = make_inputs([(0, 128, 256, 1), (40, 128, 256, 1)])
    _expect_error(data, ValueError, "group 0", "device", "CUDA")


def test_plain_scale_tensors_are_not_read():
    # The plain sfa/sfb tensors (CPU in the official generator) are only structure-checked
    data = make_inputs(SIZES)
    data = (data[0], [(None, None)] * 3, data[2], data[3])
    _expect_error(data, ValueError, "group 0", "a.device")


def test_unsupported_gpu_message(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    with pytest.raises(RuntimeError) as info:
        runtime.select_backend(0)
    message = str(info.value)
    assert "NVIDIA A100" in message and "8.0" in message
    assert "B200" in message and "sm_100" in message and "H100/H200" in message


@pytest.mark.parametrize("capability, name", [((9, 0), "NVIDIA H200"), ((8, 9), "NVIDIA L40S")])
def test_the_leaderboard_file_names_the_library_entry_off_sm100(monkeypatch, capability, name):
    """submission.py runs sm_100 only; elsewhere one line names the entry to use instead."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    with pytest.raises(RuntimeError) as info:
        submission.select_backend(0)
    message = str(info.value)
    assert "\n" not in message and name in message and f"sm_{capability[0]}{capability[1]}" in message
    assert "from nvfp4_group_gemm import custom_kernel" in message
    assert submission._BACKEND_BY_DEVICE == {}


def test_missing_hopper_backend_is_the_import_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setitem(sys.modules, "nvfp4_group_gemm.hopper", None)  # import -> ImportError
    with pytest.raises(ImportError):
        runtime.select_backend(0)
    assert runtime._BACKEND_BY_DEVICE == {}


def test_sm100_capability_selects_the_blackwell_backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (10, 0))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index=None: types.SimpleNamespace(multi_processor_count=148)
    )
    backend = submission.select_backend(3)
    assert type(backend) is submission.Sm100Backend
    assert backend.num_sms == 148 and backend.kernel == submission.SM100_KERNEL == "persistent"
    assert submission._BACKEND_BY_DEVICE[3] is backend
    # the library's runtime drives the same kernels, launched on the caller's stream
    from nvfp4_group_gemm.sm100 import Sm100StreamBackend

    library_backend = runtime.select_backend(3)
    assert isinstance(library_backend, Sm100StreamBackend) and isinstance(library_backend, submission.Sm100Backend)
    assert library_backend.num_sms == 148 and runtime._BACKEND_BY_DEVICE[3] is library_backend
