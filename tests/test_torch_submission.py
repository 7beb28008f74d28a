"""examples/torch_submission.py on the CPU: it computes what the reference computes, and it
checks its input first with the reference's rules and messages (and those of the reordered
scales it reads), writing nothing on a bad input."""

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import INVALID_INPUTS, replace_tensor, small_input

from reference import generate_input, match_outputs, ref_kernel

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_submission.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("torch_submission_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _outputs(data):
    return [c for _, _, c in data[0]]


def test_matches_the_reference_with_an_empty_group(example):
    args = ((0, 40, 129), (64, 128, 256), (256, 512, 768), 3)
    expected = ref_kernel(generate_input(*args, seed=41, device="cpu"))
    data = generate_input(*args, seed=41, device="cpu")
    out = example.custom_kernel(data)
    assert all(o is c for o, c in zip(out, _outputs(data)))  # written in place
    assert out[0].shape == (0, 64, 1)
    assert match_outputs(expected, out) == (True, "")


def _assert_rejected(example, data, error, message):
    before = [c.clone() for c in _outputs(data)] if isinstance(data, tuple) and len(data) == 4 else []
    with pytest.raises(error) as info:
        example.custom_kernel(data)
    assert str(info.value) == message
    for old, new in zip(before, _outputs(data)):
        assert torch.equal(old, new), "an output was written before the error"


@pytest.mark.parametrize("name", list(INVALID_INPUTS))
def test_rejects_what_the_reference_rejects_with_its_message(example, name):
    mutate, error, message = INVALID_INPUTS[name]
    _assert_rejected(example, mutate(small_input()), error, message)


REORDERED = {
    "sfa_reordered dtype": (
        lambda d: replace_tensor(d, 1, "sfa_reordered", d[2][1][0].view(torch.uint8)), TypeError,
        ("group 1: sfa_reordered.dtype = torch.uint8; rule: expected torch.float8_e4m3fn "
         "(one fp8 e4m3 scale per 16 K elements)")),
    "sfb_reordered of another K": (
        lambda d: replace_tensor(d, 1, "sfb_reordered", d[2][0][1]), ValueError,
        ("group 1: sfb_reordered.shape = (32, 4, 1, 4, 4, 1); rule: expected (32, 4, 1, 4, 8, 1) "
         "(sfb_reordered is [32, 4, ceil(N/128), 4, ceil(K/64), L])")),
    "sfa_reordered not a tensor": (
        lambda d: replace_tensor(d, 0, "sfa_reordered", None), TypeError,
        "group 0: type(sfa_reordered) = 'NoneType'; rule: expected a torch.Tensor"),
    "sfb_reordered on another device": (
        lambda d: replace_tensor(d, 0, "sfb_reordered", d[2][0][1].to("meta")), ValueError,
        "group 0: sfb_reordered.device = 'meta'; rule: expected cpu like a"),
    "one reordered scale": (
        lambda d: (d[0], d[1], [d[2][0], d[2][1][:1]], d[3]), TypeError,
        "group 1: sfasfb_reordered[g] = 'tuple'; rule: expected a 2-tuple (sfa_reordered, sfb_reordered)"),
}


@pytest.mark.parametrize("name", list(REORDERED))
def test_checks_the_reordered_scales_it_reads(example, name):
    mutate, error, message = REORDERED[name]
    _assert_rejected(example, mutate(small_input()), error, message)
