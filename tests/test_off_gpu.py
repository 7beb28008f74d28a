"""Off-GPU (torch sees no CUDA device), every public function of the package either does its
CPU work (the references, scale layouts, resets, the CPU kernels of the torch ops) or fails
with one line of ours: a ValueError/TypeError/RuntimeError raised in the package, its message
one line naming the entry or the group. A public name without a case here fails the test."""

import pytest
import torch
from helpers import small_input

import nvfp4_group_gemm as gemm
from nvfp4_group_gemm import moe

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour where torch sees no CUDA")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def moe_inputs():
    return moe.random_moe_inputs(64, 4, 256, 256, device="cpu", generator=torch.Generator().manual_seed(3))


def op_arguments(data):
    abc, sfasfb, reordered, sizes = data
    return ([a for a, _, _ in abc], [b for _, b, _ in abc], [c for _, _, c in abc], [s for s, _ in sfasfb],
            [s for _, s in sfasfb], [s for s, _ in reordered], [s for _, s in reordered],
            [int(v) for size in sizes for v in size])


def moe_op_call():
    inputs = moe_inputs()
    gemm.moe_grouped_gemm_op(*(inputs[name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")), None)
    return inputs


# name -> (call, expected: "works" or the message's start)
CASES = {
    "custom_kernel": (lambda: gemm.custom_kernel(small_input()), "group 0: a.device = 'cpu'"),
    "bind_input_set": (lambda: gemm.bind_input_set(small_input(), None), "group 0: a.device = 'cpu'"),
    "run_with_backend": (lambda: gemm.run_with_backend(small_input(), None), "group 0: a.device = 'cpu'"),
    "select_backend": (lambda: gemm.select_backend(0), "select_backend: needs a CUDA GPU"),
    "warmup": (lambda: gemm.warmup(256, 256, 2), "warmup: needs a CUDA GPU"),
    "moe_grouped_gemm": (lambda: gemm.moe_grouped_gemm(**moe_inputs()), "moe_grouped_gemm: a.device = cpu"),
    "check_moe_inputs": (lambda: gemm.check_moe_inputs(**moe_inputs()), "moe_grouped_gemm: a.device = cpu"),
    "grouped_gemm": (lambda: gemm.grouped_gemm(small_input()), "works"),  # the CPU kernel: the reference
    "grouped_gemm_op": (lambda: gemm.grouped_gemm_op(*op_arguments(small_input())), "works"),
    "moe_grouped_gemm_op": (moe_op_call, "works"),
    "moe_reference": (lambda: gemm.moe_reference(*(moe_inputs()[name] for name in ("a", "sfa", "b", "sfb", "offsets"))),
                      "works"),
    "blocked_scales": (lambda: gemm.blocked_scales(moe_inputs()["sfa"]), "works"),
    "prepare_weight_scales": (lambda: gemm.prepare_weight_scales(torch.ones(4, 256, 16).to(torch.float8_e4m3fn)),
                              "works"),
    "check_status": (lambda: gemm.check_status(torch.zeros(1, dtype=torch.int32)), "works"),
    "swiglu_weights": (lambda: gemm.swiglu_weights(moe_inputs()["b"], moe_inputs()["sfb"]), "works"),
    "reset_runtime": (gemm.reset_runtime, "works"),
}


def test_every_public_name_has_a_case():
    assert set(CASES) == set(gemm.__all__) - {"__version__"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_off_gpu_each_public_function_works_or_fails_in_one_line_of_ours(name, no_cuda):
    call, expected = CASES[name]
    if expected == "works":
        call()
        return
    with pytest.raises((ValueError, TypeError, RuntimeError)) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(expected), message
    assert "nvfp4_group_gemm" in caught.traceback[-1].path.parts, caught.traceback[-1].path  # raised by us
