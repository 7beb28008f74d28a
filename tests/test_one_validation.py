"""One validation for every path: each bad input below is refused by the GPU path's validation
(moe.check_moe_inputs, core.validate_inputs: on CPU tensors every rule but the device's is
checked first) and, with the same error, by every CPU path (the torch ops on CPU tensors, the
exact decode, moe_reference), before any work: no output, no status written. Bad offsets, which
the GPU flags in `status`, are flagged the same way on the CPU, or raise where no status is
given."""

import pickle

import pytest
import torch
from helpers import (
    INVALID_INPUTS,
    fp4_operand,
    make_inputs,
    replace_tensor,
    small_input,
    with_size,
)

import nvfp4_group_gemm as gemm
from nvfp4_group_gemm import core, moe, op, runtime


# -----------------------------------------------------------------------------
# The MoE entry
# -----------------------------------------------------------------------------
def moe_inputs(tokens=300, groups=4, n=256, k=512):
    inputs = moe.random_moe_inputs(tokens, groups, n, k, device="cpu", generator=torch.Generator().manual_seed(5))
    inputs["offsets"].copy_(torch.tensor([0, 10, 10, 200, 300][: groups + 1], dtype=torch.int32))
    return inputs


def _k300(i):
    """K = 300, each tensor's K from it (not a multiple of 64)."""
    tokens, groups, n = 300, 4, 256
    return dict(i, a=torch.zeros(tokens, 150, dtype=torch.uint8).view(i["a"].dtype),
                sfa=i["sfa"][:, :18].contiguous(), b=torch.zeros(groups, n, 150, dtype=torch.uint8).view(i["b"].dtype),
                sfb=torch.ones(groups, n, 18).to(torch.float8_e4m3fn))


# name -> (edit of moe_inputs(), error type, a fragment of the message)
BAD_MOE_INPUTS = {
    "fp32 c": (lambda i: dict(i, c=torch.zeros(300, 256)), TypeError, "c.dtype = torch.float32"),
    "K = 300": (_k300, ValueError, "K (2 x a.shape[1]) = 300: must be a positive multiple of 64"),
    "int64 offsets": (lambda i: dict(i, offsets=i["offsets"].long()), TypeError, "offsets.dtype = torch.int64"),
    "fp32 b": (lambda i: dict(i, b=i["b"].view(torch.uint8).float()), TypeError, "b.dtype = torch.float32"),
    "fp16 a": (lambda i: dict(i, a=torch.zeros(300, 512, dtype=torch.float16), sfa=None), TypeError,
               "a.dtype = torch.float16: 16-bit activations must be bfloat16"),
    "b's K": (lambda i: dict(i, b=i["b"][:, :, :128].contiguous()), ValueError, "b.shape[2] = 128"),
    "N": (lambda i: dict(i, b=i["b"][:, :200].contiguous()), ValueError, "N (b.shape[1]) = 200"),
    "sfa shape": (lambda i: dict(i, sfa=i["sfa"][:100]), ValueError, "sfa.shape = (100, 32): must be (300, 32)"),
    "sfb shape": (lambda i: dict(i, sfb=i["sfb"][:2]), ValueError, "sfb.shape = (2, 2, 8, 32, 4, 4)"),
    "offsets shape": (lambda i: dict(i, offsets=i["offsets"][:4]), ValueError, "offsets.shape = (4,): must be (5,)"),
    "c shape": (lambda i: dict(i, c=i["c"][:, :128]), ValueError, "c.shape = (300, 128): must be (300, 256)"),
    "c transposed": (lambda i: dict(i, c=i["c"].t().contiguous().t()), ValueError, "c.stride()"),
    "a strided": (lambda i: dict(i, a=i["a"].view(torch.uint8).repeat(1, 2)[:, ::2].view(i["a"].dtype)), ValueError,
                  "a.stride()"),
    "alpha dtype": (lambda i: dict(i, alpha=torch.ones(4, dtype=torch.float64)), TypeError,
                    "alpha.dtype = torch.float64"),
    "alpha shape": (lambda i: dict(i, alpha=torch.ones(5)), ValueError, "alpha.shape = (5,)"),
}

FIELDS = ("a", "sfa", "b", "sfb", "offsets", "c")


def _op(i, status):
    gemm.moe_grouped_gemm_op(*(i[name] for name in FIELDS), status, i.get("alpha"))


def _exact(i, status):
    moe.exact_moe_call(*(i[name] for name in FIELDS), status, i.get("alpha"))


def _reference(i, status):
    moe.moe_reference(*(i[name] for name in FIELDS), i.get("alpha"))


CPU_MOE_PATHS = {"op": _op, "op without status": lambda i, status: _op(i, None), "exact_moe_call": _exact,
                 "moe_reference": _reference}


def _raised(call) -> BaseException:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is the result
        return error
    raise AssertionError("accepted")


def _unchanged(before: dict, after: dict) -> bool:
    # bytes, so that NaN equals NaN
    return all(torch.equal(before[name].contiguous().view(torch.uint8), after[name].contiguous().view(torch.uint8))
               for name in before)


@pytest.mark.parametrize("case", sorted(BAD_MOE_INPUTS))
@pytest.mark.parametrize("path", sorted(CPU_MOE_PATHS))
def test_every_cpu_path_refuses_a_bad_moe_input_with_the_gpu_paths_error(case, path):
    edit, kind, fragment = BAD_MOE_INPUTS[case]
    inputs = edit(moe_inputs())
    gpu_error = _raised(lambda: moe.check_moe_inputs(**inputs))  # the GPU path's validation
    assert type(gpu_error) is kind and fragment in str(gpu_error) and "\n" not in str(gpu_error)
    assert "must be a CUDA device" not in str(gpu_error)
    status = torch.full((1,), 7, dtype=torch.int32)
    before = {"status": status.clone(), **{n: t.clone() for n, t in inputs.items() if n in ("c",)
                                          and t.device.type == "cpu"}}
    error = _raised(lambda: CPU_MOE_PATHS[path](inputs, status))
    assert type(error) is kind and str(error) == str(gpu_error)
    assert _unchanged(before, {"status": status, "c": inputs["c"]}), "written before the error"
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is kind and str(clone) == str(error)


def test_the_cpu_paths_keep_the_rule_of_one_device():
    inputs = moe_inputs()
    inputs["b"] = inputs["b"].to("meta")
    for path in ("exact_moe_call", "moe_reference"):
        with pytest.raises(ValueError, match=r"^moe_grouped_gemm: b\.device = meta: must be a's device, cpu$"):
            CPU_MOE_PATHS[path](inputs, None)


def test_a_uint8_b_is_taken_by_every_path_as_the_gpu_path_takes_it():
    """uint8 weights are an alias of float4_e2m1fn_x2 on the GPU path (check_moe_inputs): the
    CPU paths compute the same result with either."""
    inputs = moe_inputs()
    as_uint8 = dict(inputs, b=inputs["b"].view(torch.uint8))
    assert moe.check_moe_inputs(**inputs, require_cuda=False) == moe.check_moe_inputs(**as_uint8, require_cuda=False)
    expected = moe.moe_reference(*(inputs[name] for name in FIELDS[:5]))
    assert torch.equal(moe.moe_reference(*(as_uint8[name] for name in FIELDS[:5])), expected)
    status = torch.full((1,), 7, dtype=torch.int32)
    _op(as_uint8, status)
    assert int(status) == 0 and torch.equal(as_uint8["c"], expected)


BAD_OFFSETS = {
    "decreasing": ([0, 10, 5, 200, 300], "offsets[2] = 5 < offsets[1] = 10"),
    "past T": ([0, 10, 10, 200, 301], "offsets[4] = 301 > T = 300"),
    "negative start": ([-1, 10, 10, 200, 300], "offsets[0] = -1 < 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
def test_bad_offsets_are_flagged_in_status_as_the_gpu_flags_them_or_raise_without_one(case):
    values, broken = BAD_OFFSETS[case]
    inputs = moe_inputs()
    inputs["offsets"].copy_(torch.tensor(values, dtype=torch.int32))
    moe.check_moe_inputs(**inputs, require_cuda=False)  # the host's rules hold: the GPU checks the values
    message = (f"moe_grouped_gemm: offsets = {values}: {broken}; the rule is {moe.OFFSETS_RULE} "
               "(T = a.shape[0] = 300)")
    for path in ("op", "exact_moe_call"):  # with a status: status 1, c as the kernels leave it
        status = torch.full((1,), 7, dtype=torch.int32)
        CPU_MOE_PATHS[path](inputs, status)
        assert int(status) == 1 and torch.isnan(inputs["c"]).all(), path
        with pytest.raises(ValueError, match="offsets were invalid on the GPU") as info:
            moe.check_status(status)
        assert moe.OFFSETS_RULE in str(info.value)
    for path in ("op without status", "exact_moe_call", "moe_reference"):  # no status: the error
        error = _raised(lambda path=path: CPU_MOE_PATHS[path](inputs, None))
        assert type(error) is ValueError and str(error) == message, path
        assert torch.isnan(inputs["c"]).all(), path


def test_long_offsets_are_named_by_count_in_one_line():
    inputs = moe.random_moe_inputs(64, 40, 128, 64, device="cpu", generator=torch.Generator().manual_seed(1))
    inputs["offsets"][-1] = 65
    with pytest.raises(ValueError) as info:
        moe.moe_reference(*(inputs[name] for name in FIELDS[:5]))
    assert str(info.value).startswith("moe_grouped_gemm: offsets = [41 values]: offsets[40] = 65 > T = 64; ")


def test_the_reference_takes_a_float64_c_as_an_oracle_and_checks_its_shape():
    inputs = moe_inputs()
    exact = moe.moe_reference(*(inputs[name] for name in FIELDS[:5]), torch.zeros(300, 256, dtype=torch.float64))
    assert exact.dtype == torch.float64
    with pytest.raises(ValueError, match=r"c\.shape = \(300, 128\): must be \(300, 256\)"):
        moe.moe_reference(*(inputs[name] for name in FIELDS[:5]), torch.zeros(300, 128, dtype=torch.float64))


# -----------------------------------------------------------------------------
# The per-size-set entry (custom_kernel) and its torch op
# -----------------------------------------------------------------------------
# name -> edit of small_input(): the reference's invalid inputs (helpers.INVALID_INPUTS, each
# with the reference's own message) and what a new user tried on a CPU
# (but for a plain sfb, which custom_kernel does not read, and a tensor on another device than
# CUDA, the device rule's: test_the_cpu_paths_keep_the_rule_of_one_device_per_input_set)
BAD_INPUT_SETS = {name: edit for name, (edit, _, _) in INVALID_INPUTS.items()
                  if name not in ("sfb shape", "b on another device")}
BAD_INPUT_SETS |= {
    "fp32 c of group 0": lambda d: replace_tensor(d, 0, "c", d[0][0][2].float()),
    "uint8 b": lambda d: replace_tensor(d, 0, "b", d[0][0][1].view(torch.uint8)),
    "K = 320": lambda d: make_inputs([(40, 64, 320, 1)]),
    "a's rows": lambda d: replace_tensor(d, 1, "a", fp4_operand(73, 512)),
    "c's columns": lambda d: replace_tensor(d, 1, "c", torch.zeros(72, 127, 1, dtype=torch.float16)),
    "a 3-tuple size": lambda d: (d[0], d[1], d[2], [d[3][0], (72, 128, 512)]),
    "a float size": lambda d: with_size(d, 0, (40, 64, 256.0, 1)),
}


def _grouped_gemm_op(data):
    abc, _, reordered, sizes = data
    op.grouped_gemm_op([a for a, _, _ in abc], [b for _, b, _ in abc], [c for _, _, c in abc],
                       [s for s, _ in data[1]], [s for _, s in data[1]], [s for s, _ in reordered],
                       [s for _, s in reordered], [int(v) for size in sizes for v in size])


CPU_SET_PATHS = {"grouped_gemm": op.grouped_gemm, "grouped_gemm_op": _grouped_gemm_op,
                 "validate_inputs(require_cuda=False)": lambda d: runtime.validate_inputs(d, require_cuda=False)}
# the torch op proper takes lists of tensors and flat sizes: malformed lists fail in torch's
# argument parsing, and a float size is an int by then (grouped_gemm's own validation sees it)
NOT_FOR_THE_OP = {"3-tuple", "lists disagree", "more problem sizes", "no group", "a not a tensor", "a 3-tuple size",
                  "a float size", "M as a float"}


@pytest.mark.parametrize(("path", "case"), [(path, case) for path in sorted(CPU_SET_PATHS) for case in sorted(BAD_INPUT_SETS)
                                            if not (path == "grouped_gemm_op" and case in NOT_FOR_THE_OP)])
def test_every_cpu_path_refuses_a_bad_input_set_with_custom_kernels_error(path, case):
    data = BAD_INPUT_SETS[case](small_input())
    gpu_error = _raised(lambda: core.validate_inputs(data))  # the GPU path's validation
    assert _raised(lambda: runtime.custom_kernel(data)).args == gpu_error.args  # and its entry
    assert "must be on a CUDA device" not in str(gpu_error) and "\n" not in str(gpu_error)
    outputs = [group[2] for group in data[0]] if isinstance(data, tuple) and len(data) == 4 else []
    before = [c.clone() for c in outputs if isinstance(c, torch.Tensor) and c.device.type == "cpu"]
    error = _raised(lambda: CPU_SET_PATHS[path](data))
    assert type(error) is type(gpu_error) and str(error) == str(gpu_error)
    assert all(torch.equal(old, new) for old, new in zip(before, outputs)), "an output was written before the error"


def test_the_cpu_op_computes_what_it_accepts_and_only_the_device_rule_differs():
    data = small_input()
    with pytest.raises(ValueError, match=r"group 0: a\.device = 'cpu'; rule: every tensor must be on a CUDA device"):
        runtime.validate_inputs(data)
    assert runtime.validate_inputs(data, require_cuda=False) == tuple(tuple(size) for size in data[3])
    expected = [c.clone() for c in core.exact_decode_group_gemm(data, [c.clone() for _, _, c in data[0]])]
    outputs = op.grouped_gemm(data)
    assert all(torch.equal(c, want) for c, want in zip(outputs, expected))


def test_the_cpu_paths_keep_the_rule_of_one_device_per_input_set():
    edit, kind, message = INVALID_INPUTS["b on another device"]  # the reference's message
    # (the op itself dispatches an input set holding a meta tensor to its fake: no computation)
    with pytest.raises(kind) as info:
        runtime.validate_inputs(edit(small_input()), require_cuda=False)
    assert str(info.value) == message
