"""reference.py on the CPU: decoding, scale layouts, generator contract, oracle, checker."""

import math

import pytest
import torch
from helpers import INVALID_INPUTS, small_input

from reference import (
    check_implementation,
    decode_e2m1,
    decoded_group_gemm,
    generate_input,
    match_outputs,
    ref_kernel,
    to_blocked,
)


def e2m1_value(code: int) -> float:
    """e2m1 by its definition: 1 sign, 2 exponent (bias 1), 1 mantissa bit; exponent 0 is
    subnormal (0 or 0.5)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent = (code >> 1) & 0b11
    mantissa = code & 0b1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * 2.0 ** (exponent - 1) * (1.0 + mantissa / 2)


def e4m3_value(byte: int) -> float:
    """float8 e4m3fn by its definition: bias 7, exponent 0 subnormal, S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * 2.0**-6 * mantissa / 8
    return sign * 2.0 ** (exponent - 7) * (1.0 + mantissa / 8)


def independent_group_gemm(a, b, sfa, sfb) -> torch.Tensor:
    """float64 GEMM from the raw bytes, decoded element by element from the definitions."""
    e2m1 = torch.tensor([e2m1_value(code) for code in range(16)], dtype=torch.float64)
    e4m3 = torch.tensor([e4m3_value(byte) for byte in range(256)], dtype=torch.float64)

    def operand(packed, scales):
        packed_bytes = packed[:, :, 0].view(torch.uint8).long()
        rows = packed_bytes.shape[0]
        values = torch.empty(rows, packed_bytes.shape[1] * 2, dtype=torch.float64)
        values[:, 0::2] = e2m1[packed_bytes & 0xF]
        values[:, 1::2] = e2m1[packed_bytes >> 4]
        scale = e4m3[scales[:, :, 0].view(torch.uint8).long()]
        return values * torch.kron(scale, torch.ones(1, 16, dtype=torch.float64))

    return operand(a, sfa) @ operand(b, sfb).T


def test_e2m1_decode_all_codes_both_nibbles():
    for low in range(16):
        for high in (0, 7, 9, 15, low):
            packed = torch.tensor([[low | (high << 4)]], dtype=torch.uint8)
            decoded = decode_e2m1(packed.view(torch.float4_e2m1fn_x2))
            assert decoded.tolist() == [[e2m1_value(low), e2m1_value(high)]]
    # Code 8 is -0.0 (sign kept), code 0 is +0.0.
    zeros = decode_e2m1(torch.tensor([[0x08]], dtype=torch.uint8))
    assert torch.signbit(zeros[0, 0]) and not torch.signbit(zeros[0, 1])
    assert [e2m1_value(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e4m3_helper_agrees_with_torch():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    from_torch = codes.view(torch.float8_e4m3fn).to(torch.float64)
    expected = torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float64)
    assert torch.equal(torch.isnan(from_torch), torch.isnan(expected))
    finite = ~torch.isnan(expected)
    assert torch.equal(from_torch[finite], expected[finite])


@pytest.mark.parametrize("m,k", [(40, 256), (129, 512), (200, 1024), (1, 256)])
def test_reordered_scales_match_to_blocked(m, k):
    data = generate_input((m,), (72,), (k,), 1, seed=7, device="cpu")
    (sfa, _), (sfa_r, _) = data[1][0], data[2][0]
    rest_m, rest_k = -(-m // 128), k // 64
    assert sfa_r.shape == (32, 4, rest_m, 4, rest_k, 1)
    # Memory is a contiguous (l, rest_m, rest_k, 32, 4, 4) tensor seen through the permute.
    contiguous = sfa_r.permute(5, 2, 4, 0, 1, 3)
    assert contiguous.is_contiguous()
    flat = contiguous.reshape(-1).view(torch.uint8)
    blocked = to_blocked(sfa[:, :, 0]).view(torch.uint8)
    assert flat.numel() == blocked.numel() == rest_m * rest_k * 512

    rows = torch.arange(m).unsqueeze(1)
    cols = torch.arange(k // 16).unsqueeze(0)
    offset = (((rows // 128) * rest_k + cols // 4) * 32 + rows % 32) * 16 \
        + ((rows % 128) // 32) * 4 + cols % 4
    plain = sfa[:, :, 0].view(torch.uint8)
    assert torch.equal(flat[offset], plain)
    assert torch.equal(blocked[offset], plain)
    # The same element through the 6-D index of the reordered tensor.
    six_d = sfa_r[rows % 32, (rows % 128) // 32, rows // 128, cols % 4, cols // 4, 0]
    assert torch.equal(six_d.view(torch.uint8), plain)
    # Rows past M: to_blocked pads with zeros, the generator leaves its random 1s and 2s.
    padding = torch.ones(flat.numel(), dtype=torch.bool)
    padding[offset.reshape(-1)] = False
    assert bool((blocked[padding] == 0).all())
    assert set(flat[padding].view(torch.float8_e4m3fn).float().unique().tolist()) <= {1.0, 2.0}


def test_generate_input_contract_on_cpu():
    m, n, k = (40, 129), (64, 256), (256, 512)
    abc, sf, sf_r, sizes = generate_input(m, n, k, 2, seed=1111, device="cpu")
    assert sizes == [(40, 64, 256, 1), (129, 256, 512, 1)]
    for (a, b, c), (sfa, sfb), (sfa_r, sfb_r), (mi, ni, ki, _) in zip(abc, sf, sf_r, sizes):
        assert a.dtype == b.dtype == torch.float4_e2m1fn_x2
        assert a.shape == (mi, ki // 2, 1) and a.stride() == (ki // 2, 1, mi * ki // 2)
        assert b.shape == (ni, ki // 2, 1)
        assert c.dtype == torch.float16 and c.shape == (mi, ni, 1)
        assert c.stride() == (ni, 1, mi * ni)
        assert sfa.dtype == sfb.dtype == sfa_r.dtype == sfb_r.dtype == torch.float8_e4m3fn
        assert sfa.shape == (mi, ki // 16, 1) and sfb.shape == (ni, ki // 16, 1)
        assert sfb_r.shape == (32, 4, -(-ni // 128), 4, ki // 64, 1)
        assert set(sfa.float().unique().tolist()) == {1.0, 2.0}
        # Nibbles keep sign and the two low bits only: bit 2 of each nibble is clear.
        assert int((a.view(torch.uint8) & 0b0100_0100).count_nonzero()) == 0
        assert int((a.view(torch.uint8) & 0b1011_1011).count_nonzero()) > 0
    again = generate_input(m, n, k, 2, seed=1111, device="cpu")
    other = generate_input(m, n, k, 2, seed=1112, device="cpu")
    a0 = abc[0][0].view(torch.uint8)
    assert torch.equal(a0, again[0][0][0].view(torch.uint8))
    assert not torch.equal(a0, other[0][0][0].view(torch.uint8))


GOOD_ARGS = {"m": (40, 0), "n": (64, 128), "k": (256, 512), "g": 2, "seed": 1111}

G_RULE = "g is an integer, 1 <= g <= 64 (the number of groups)"
K_RULE = "K is a positive multiple of 256 (the task's contract)"
SEED_RULE = "seed is an integer in 0..2**64-1 (the range of torch.manual_seed)"


def _length_rule(name):
    return f"{name} holds g = 2 values, one per group"


def _type_rule(name):
    return f"{name} is a tuple or list of g integers, one per group"


# argument edits -> (field = value, rule) of the ValueError generate_input raises before it seeds
BAD_GENERATOR_ARGS = {
    "m shorter than g": ({"m": (40,)}, "len(m) = 1", _length_rule("m")),
    "n longer than g": ({"n": (64, 128, 256)}, "len(n) = 3", _length_rule("n")),
    "k shorter than g": ({"k": [256]}, "len(k) = 1", _length_rule("k")),
    "k not a sequence": ({"k": 256}, "type(k) = 'int'", _type_rule("k")),
    "m as a string": ({"m": "40"}, "type(m) = 'str'", _type_rule("m")),
    "g = 0": ({"g": 0, "m": (), "n": (), "k": ()}, "g = 0", G_RULE),
    "g = 65": ({"g": 65}, "g = 65", G_RULE),
    "g a float": ({"g": 2.0}, "g = 2.0", G_RULE),
    "g a bool": ({"g": True}, "g = True", G_RULE),
    "M < 0": ({"m": (40, -1)}, "m[1] = -1", "M is an integer >= 0"),
    "M a float": ({"m": (40.0, 0)}, "m[0] = 40.0", "M is an integer >= 0"),
    "N = 0": ({"n": (0, 128)}, "n[0] = 0", "N is an integer >= 1"),
    "K = 100": ({"k": (256, 100)}, "k[1] = 100", K_RULE),
    "K = 384": ({"k": (384, 512)}, "k[0] = 384", K_RULE),
    "K = 0": ({"k": (256, 0)}, "k[1] = 0", K_RULE),
    "K = -256": ({"k": (-256, 512)}, "k[0] = -256", K_RULE),
    "seed = -1": ({"seed": -1}, "seed = -1", SEED_RULE),
    "seed = 2**64": ({"seed": 2**64}, f"seed = {2**64}", SEED_RULE),
    "seed a string": ({"seed": "1111"}, "seed = '1111'", SEED_RULE),
}


@pytest.mark.parametrize("name", list(BAD_GENERATOR_ARGS))
def test_generate_input_rejects_arguments_outside_the_contract(name):
    edits, field_value, rule = BAD_GENERATOR_ARGS[name]
    torch.manual_seed(5)
    expected_draw = torch.rand(4)
    torch.manual_seed(5)
    with pytest.raises(ValueError) as info:
        generate_input(**{**GOOD_ARGS, **edits}, device="cpu")
    assert str(info.value) == f"generate_input: {field_value}; rule: {rule}"
    assert torch.equal(torch.rand(4), expected_draw), "the RNG was seeded or drawn before the error"


def test_generate_input_accepts_the_contracts_edges():
    # M = 0, lists, numpy-style integers (__index__), g = 64, the largest seed
    data = generate_input([0, 1], [1, 8], [256, 7168], 2, seed=2**64 - 1, device="cpu")
    assert data[3] == [(0, 1, 256, 1), (1, 8, 7168, 1)]
    assert data[0][0][2].shape == (0, 1, 1)
    data = generate_input((8,) * 64, (64,) * 64, (256,) * 64, 64, seed=0, device="cpu")
    assert len(data[3]) == 64
    index = type("Index", (), {"__index__": lambda self: 256})()
    assert generate_input((8,), (64,), (index,), 1, seed=3, device="cpu")[3] == [(8, 64, 256, 1)]
    for sizes in generate_input(**GOOD_ARGS, device="cpu")[3]:
        assert all(type(v) is int for v in sizes)


def test_ref_kernel_matches_independent_float64():
    m, n, k = (1, 40, 72, 129), (64, 200, 128, 72), (256, 256, 512, 256)
    data = generate_input(m, n, k, 4, seed=3, device="cpu")
    c_tensors = [c for _, _, c in data[0]]
    expected = [
        independent_group_gemm(a, b, sfa, sfb)
        for (a, b, _), (sfa, sfb) in zip(data[0], data[1])
    ]
    outputs = ref_kernel(data)
    for out, c, exp, mi, ni in zip(outputs, c_tensors, expected, m, n):
        assert out is c  # written in place, as the competition's reference does
        assert out.shape == (mi, ni, 1)
        assert torch.equal(out[:, :, 0], exp.to(torch.float16))
        assert exp.abs().max() > 4  # not a degenerate all-zero case


def test_float32_accumulation_is_exact_for_competition_data_at_k_7168():
    data = generate_input((16,), (512,), (7168,), 1, seed=11, device="cpu")
    (a, b, _), (sfa, sfb) = data[0][0], data[1][0]
    args = (a[:, :, 0], b[:, :, 0], sfa[:, :, 0], sfb[:, :, 0])
    assert torch.equal(decoded_group_gemm(*args).double(),
                       decoded_group_gemm(*args, accumulate_dtype=torch.float64))
    # Worst magnitude: every element ±1.5 with scale 2 (|product| = 9, |sum| = 64512).
    packed = torch.full((4, 3584), 0x3B, dtype=torch.uint8)  # low 1.5, high -1.5
    packed[1] = 0x33  # +1.5, +1.5
    twos = torch.full((4, 448), 2.0).to(torch.float8_e4m3fn)
    full = decoded_group_gemm(packed, packed, twos, twos)
    assert full[1, 1].item() == 9 * 7168 and full[0, 1].item() == 0.0


def test_float32_accumulation_error_for_arbitrary_scales_is_within_the_standard_bound():
    # Arbitrary finite e4m3 scales are outside the competition's data: float32 then rounds.
    generator = torch.Generator().manual_seed(5)
    k = 7168
    packed = torch.randint(0, 256, (8, k // 2), dtype=torch.uint8, generator=generator)
    scale_bytes = torch.randint(0, 0x7E, (8, k // 16), dtype=torch.uint8, generator=generator)
    scales = scale_bytes.view(torch.float8_e4m3fn)
    fp32 = decoded_group_gemm(packed, packed, scales, scales).double()
    fp64 = decoded_group_gemm(packed, packed, scales, scales, accumulate_dtype=torch.float64)
    from reference import decode_scaled

    values = decode_scaled(packed, scales).double()
    magnitude = values.abs() @ values.abs().T
    bound = k * 2.0**-24 * magnitude  # gamma_K for recursive float32 summation
    assert bool(((fp32 - fp64).abs() <= bound).all())


def test_check_implementation_accepts_exact_and_reports_mismatches():
    data = generate_input((40, 72), (64, 128), (256, 256), 2, seed=21, device="cpu")
    good = [c.clone() for c in ref_kernel(generate_input((40, 72), (64, 128), (256, 256), 2,
                                                          seed=21, device="cpu"))]
    ok, message = check_implementation(data, good)
    assert ok and message == ""

    bad = [c.clone() for c in good]
    bad[1][3, 5, 0] += 1.0
    bad[1][7, 9, 0] = float("nan")
    ok, message = match_outputs(good, bad)
    assert not ok
    assert message.startswith("mismatch found! custom implementation doesn't match reference: 1")
    assert "Number of mismatched elements: 2" in message
    assert "ERROR AT (3, 5, 0)" in message and "ERROR AT (7, 9, 0)" in message

    # Tolerance is atol + rtol * |expected| = 0.101 at expected = 100.
    expected = [c.clone() for c in good]
    expected[0][0, 0, 0] = 100.0
    near = [c.clone() for c in expected]
    near[0][0, 0, 0] = 100.0625  # |diff| = 0.0625: inside
    assert match_outputs(expected, near) == (True, "")
    far = [c.clone() for c in expected]
    far[0][0, 0, 0] = 100.25  # |diff| = 0.25: outside
    assert not match_outputs(expected, far)[0]

    ok, message = match_outputs(good, good[:1])
    assert not ok and "output length mismatch: got 1, expected 2" in message


# ---------------------------------------------------------------------------------------
# Input validation: the submission's rules and messages, checked before anything is written
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(INVALID_INPUTS))
def test_ref_kernel_rejects_invalid_input_before_writing(name):
    mutate, error, message = INVALID_INPUTS[name]
    data = small_input()
    before = [c.clone() for _, _, c in data[0]]
    bad = mutate(data)
    with pytest.raises(error) as info:
        ref_kernel(bad)
    assert str(info.value) == message
    for old, (_, _, new) in zip(before, data[0]):
        assert torch.equal(old, new), "an output was written before the error"


def test_ref_kernel_accepts_any_strides_and_an_empty_group():
    data = generate_input((0, 40), (64, 128), (256, 256), 2, seed=32, device="cpu")
    expected = [c.clone() for c in ref_kernel(generate_input((0, 40), (64, 128), (256, 256), 2,
                                                             seed=32, device="cpu"))]
    # A column-major copy of group 1's c (same values, other strides) is written in place.
    a, b, c = data[0][1]
    c_col = c.transpose(0, 1).contiguous().transpose(0, 1)
    data[0][1] = (a, b, c_col)
    outputs = ref_kernel(data)
    assert outputs[0].shape == (0, 64, 1) and outputs[1] is c_col
    assert torch.equal(outputs[1], expected[1])


SHARED_RULES = ["L = 2", "lists disagree", "more problem sizes", "no group", "3-tuple", "N = 0",
                "M < 0", "M as a float", "c dtype", "a not a tensor"]


@pytest.mark.parametrize("name", SHARED_RULES)
def test_reference_and_submission_say_the_same(name):
    submission = pytest.importorskip("submission", reason="needs the CuTe DSL")
    mutate, error, _ = INVALID_INPUTS[name]
    bad = mutate(small_input())
    with pytest.raises(error) as from_reference:
        ref_kernel(bad)
    with pytest.raises(error) as from_submission:
        submission.validate_inputs(bad)
    assert str(from_reference.value) == str(from_submission.value)
