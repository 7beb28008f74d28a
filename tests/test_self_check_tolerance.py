"""The first-use self-check on real data: its tolerance widens by what fp32 accumulation may add
(submission.accumulation_bounds) and by nothing where every fp32 partial sum is exact (the
competition's data), still catches real defects (one wrong element, a k-block off by one,
swapped scales), and reads a fault as the kernel's. On CPU tensors through the leaderboard
file's runtime with stand-in kernels (helpers.sm100_runtime; the oracle is the exact decode)."""

import helpers
import pytest
import torch
from helpers import official_inputs

from nvfp4_group_gemm import core as submission
from reference import create_reordered_scale_factor_tensor

sm100_runtime = pytest.fixture(helpers.sm100_runtime)

K_BLOCK = 16  # elements per scale


def with_reordered_from_plain(data):
    """`data` with its reordered scales made anew from its plain ones (the kernels and the
    oracles read the reordered, the reference the plain)."""
    reordered = [
        tuple(create_reordered_scale_factor_tensor(1, plain.shape[0], 16 * plain.shape[1], plain, device="cpu")
              for plain in pair)
        for pair in data[1]
    ]
    return data[0], data[1], reordered, data[3]


def wide_scale_inputs(sizes, seed=0, max_exponent=2):
    """Official-layout inputs with every e2m1 code and e4m3 scales from 2^-6 to 2^max_exponent,
    as a real checkpoint has (the generator draws scales 1 or 2 and e2m1 of magnitude <= 1.5);
    2^2 keeps K = 2048 sums within fp16."""
    data = official_inputs(sizes, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for (a, b, _c), (sfa, sfb) in zip(data[0], data[1]):
        for packed in (a, b):
            raw = packed.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
        for plain in (sfa, sfb):
            exponents = torch.randint(-6, max_exponent + 1, plain.shape, generator=generator).float()
            mantissas = 1 + torch.randint(0, 8, plain.shape, generator=generator).float() / 8
            plain.copy_((mantissas * 2**exponents).to(torch.float8_e4m3fn))
    return with_reordered_from_plain(data)


def cancelling_inputs(m=16, n=16, k=7168):
    """One group whose exact outputs are small sums of large partial sums that cancel: A is
    +6 over the first half of K and -6 over the second, B is +6 with scales 448, A's scales 16
    but for ten k-blocks in each half (1.125 x 2^-6): the exact sum is 0; a float32
    accumulation's partial sums reach 9 x 10^8, where float32 steps by 64, and a small block
    adds 4536."""
    data = official_inputs([(m, n, k, 1)])
    (a, b, _c), (sfa, sfb) = data[0][0], data[1][0]
    a.view(torch.uint8)[:, : k // 4] = 0x77
    a.view(torch.uint8)[:, k // 4:] = 0xFF
    b.view(torch.uint8)[:] = 0x77
    blocks = k // K_BLOCK
    scales = torch.full((m, blocks), 16.0)
    scales[:, 10:20] = scales[:, blocks // 2 + 10: blocks // 2 + 20] = 1.125 * 2**-6
    sfa[:, :, 0] = scales.to(torch.float8_e4m3fn)
    sfb[:, :, 0] = torch.full((n, blocks), 448.0).to(torch.float8_e4m3fn)
    return with_reordered_from_plain(data)


def exact(data):
    return submission.exact_decode_group_gemm(data, [torch.empty_like(c) for _, _, c in data[0]])


def assert_exact(outputs, data):
    """Equal to the exact sum rounded to fp16 (the sm_90 oracle; the reference adds in fp32)."""
    for got, want in zip(outputs, exact(data)):
        assert torch.equal(got, want)


def _blocks(data, g):
    """Group g's decoded A and B in float64, [rows, K/16, 16] each."""
    (a, b, _c), (sfa, sfb) = data[0][g], data[2][g]
    m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
    a_values = submission.decode_fp4(a[:, :, 0], submission.plain_scales(sfa, m, k)).double()
    b_values = submission.decode_fp4(b[:, :, 0], submission.plain_scales(sfb, n, k)).double()
    return a_values.view(m, k // K_BLOCK, K_BLOCK), b_values.view(n, k // K_BLOCK, K_BLOCK)


def fp32_accumulating_kernel(data, outputs):
    """A correct kernel as a tensor core adds: each k-block's products summed (exact), added
    one block after the other into a float32 accumulator, last block first (another order
    than the oracle's)."""
    for g, out in enumerate(outputs):
        a_blocks, b_blocks = _blocks(data, g)
        accumulator = torch.zeros(a_blocks.shape[0], b_blocks.shape[0], dtype=torch.float32)
        for block in reversed(range(a_blocks.shape[1])):
            accumulator += (a_blocks[:, block] @ b_blocks[:, block].T).float()
        out[:, :, 0] = accumulator.half()
    return outputs


def k_block_off_by_one_kernel(data, outputs):
    """A kernel that reads k-block 1 where it should read k-block 0 (of A only)."""
    for g, out in enumerate(outputs):
        a_blocks, b_blocks = _blocks(data, g)
        a_blocks = a_blocks.clone()
        a_blocks[:, 0] = a_blocks[:, 1]
        out[:, :, 0] = torch.einsum("mkj,nkj->mn", a_blocks, b_blocks).half()
    return outputs


def swapped_scales_kernel(data, outputs):
    """A kernel whose A scales of k-blocks 2i and 2i + 1 are swapped (a layout slip)."""
    for g, out in enumerate(outputs):
        (a, b, _c), (sfa, sfb) = data[0][g], data[2][g]
        m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
        scales = submission.plain_scales(sfa, m, k).contiguous().view(torch.uint8)
        scales = scales.view(m, -1, 2).flip(-1).reshape(m, -1).view(torch.float8_e4m3fn)
        a_values = submission.decode_fp4(a[:, :, 0], scales).double()
        b_values = submission.decode_fp4(b[:, :, 0], submission.plain_scales(sfb, n, k)).double()
        out[:, :, 0] = (a_values @ b_values.T).half()
    return outputs


WIDE_SIZES = [(64, 64, 2048, 1), (40, 48, 1024, 1)]


def test_the_competitions_data_adds_nothing_to_the_tolerance():
    """Scales 1 or 2 and e2m1 of magnitude <= 1.5: every product a multiple of 1/4, every
    partial sum below 2^22, so fp32 adds exactly: the bound is None for every group."""
    data = official_inputs([(80, 4096, 7168, 1), (248, 256, 7168, 1)])
    assert submission.accumulation_bounds(data, 2) == [None, None]


@pytest.mark.parametrize("make", [cancelling_inputs, lambda: wide_scale_inputs(WIDE_SIZES)],
                         ids=["cancelling", "general"])
def test_general_scales_bound_the_fp32_error(make):
    data = make()
    bounds = submission.accumulation_bounds(data, 1)
    expected = exact(data)
    kernel = fp32_accumulating_kernel(data, [torch.empty_like(c) for _, _, c in data[0]])
    assert submission.count_mismatches(kernel, expected, bounds=bounds)[0] == 0
    for got, want, bound in zip(kernel, expected, bounds):
        assert bound is not None and bound.shape == got.shape
        error = (got.double() - want.double()).abs()
        assert bool((error <= 1e-3 + 1e-3 * want.double().abs() + bound.double()).all())


def test_the_competitions_tolerance_alone_calls_a_correct_fp32_kernel_wrong():
    """Where partial sums cancel, a correct fp32 accumulation misses the exact sum by far more
    than 1e-3: the old check demoted such kernels; the bound keeps them."""
    data = cancelling_inputs()
    kernel = fp32_accumulating_kernel(data, [torch.empty_like(c) for _, _, c in data[0]])
    assert submission.count_mismatches(kernel, exact(data))[0] > 0
    assert submission.count_mismatches(kernel, exact(data), bounds=submission.accumulation_bounds(data, 1))[0] == 0


def test_a_correct_fp32_kernel_on_general_scales_is_not_demoted(sm100_runtime, capsys):
    fakes, run = sm100_runtime
    fakes.compute["persistent_gemm"] = fp32_accumulating_kernel
    data = cancelling_inputs()
    run(data)
    assert capsys.readouterr().err == ""
    assert submission.DEMOTED == {} and len(submission.SELF_CHECKED) == 1


@pytest.mark.parametrize("defect", [k_block_off_by_one_kernel, swapped_scales_kernel],
                         ids=["k_block_off_by_one", "swapped_scales"])
@pytest.mark.parametrize("scales", ["competition", "general"])
def test_real_defects_are_demoted(sm100_runtime, capsys, defect, scales):
    fakes, run = sm100_runtime
    fakes.compute["persistent_gemm"] = defect
    sizes = [(64, 64, 1024, 1), (40, 48, 2048, 1)]
    data = official_inputs(sizes) if scales == "competition" else wide_scale_inputs(sizes)
    assert_exact(run(data), data)  # the oracle's result returned
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "persistent_t128" in line and "self-check:" in line and "beyond the tolerance and fp32" in line
    assert "next: per_tile" in line


def test_one_wrong_element_is_still_demoted_on_general_scales(sm100_runtime, capsys):
    fakes, run = sm100_runtime
    fakes.wrong.add("persistent_gemm")
    data = wide_scale_inputs([(64, 64, 512, 1)])
    data[0][0][0].view(torch.uint8).zero_()  # A = 0: the exact outputs are 0, the bound is 0
    run(data)
    assert "self-check: 1 of 4096 outputs differ" in capsys.readouterr().err


def test_a_poisoned_context_raises_the_kernels_fault_not_the_oracles(sm100_runtime, monkeypatch):
    _fakes, run = sm100_runtime

    def faulting_oracle(data, outputs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(submission.HOST_COMPUTATIONS, "exact_decode", faulting_oracle)
    monkeypatch.setattr(submission, "context_usable", lambda device: False)
    with pytest.raises(RuntimeError, match=r"sm100 kernel persistent_t128 \(.*\), G = 1: the GPU context faulted "
                                           r"after this kernel ran.*illegal memory access"):
        run(official_inputs([(40, 128, 256, 1)]))
    assert submission.SELF_CHECKED == set()


def test_a_kernel_is_checked_only_once_its_oracle_ran(sm100_runtime, monkeypatch, capsys):
    fakes, run = sm100_runtime
    real_oracle = submission.HOST_COMPUTATIONS["exact_decode"]
    calls = []

    def oracle_failing_once(data, outputs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("oracle cannot run this one")
        return real_oracle(data, outputs)

    monkeypatch.setitem(submission.HOST_COMPUTATIONS, "exact_decode", oracle_failing_once)
    run(official_inputs([(40, 128, 256, 1)]))  # the context is usable: skipped, not checked
    assert "self-check skipped, its oracle exact_decode failed" in capsys.readouterr().err
    assert submission.SELF_CHECKED == set()
    fakes.wrong.add("persistent_gemm")
    data = official_inputs([(40, 128, 256, 1)], seed=8)
    assert_exact(run(data), data)  # the next new input set is checked: the defect is found
    assert len(calls) == 2 and "self-check: 1 of" in capsys.readouterr().err


def _plain_from_blocked(flat: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    rest_rows, rest_k = -(-rows // 128), -(-(k // 16) // 4)
    reordered = flat.view(1, rest_rows, rest_k, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)
    return submission.plain_scales(reordered, rows, k)


@pytest.mark.parametrize("n", [72, 200, 16, 128])
def test_the_scaled_mm_oracle_runs_every_n_the_file_accepts(monkeypatch, n):
    """cuBLAS's scaled_mm takes N in multiples of 16 only: the oracle pads B with zero rows and
    slices its columns off (a stand-in scaled_mm here: the exact decode, refusing other N)."""
    def fake_scaled_mm(a, b_t, scale_a, scale_b, bias=None, out_dtype=None):
        rows_b, k = b_t.shape[1], 2 * b_t.shape[0]
        assert rows_b % 16 == 0, "cuBLAS: N must be a multiple of 16"
        a_values = submission.decode_fp4(a, _plain_from_blocked(scale_a, a.shape[0], k))
        b_values = submission.decode_fp4(b_t.T, _plain_from_blocked(scale_b, rows_b, k))
        return (a_values.double() @ b_values.double().T).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    data = official_inputs([(40, n, 512, 1), (8, 24, 256, 1)])
    outputs = submission.scaled_mm_group_gemm(data, [torch.empty_like(c) for _, _, c in data[0]])
    assert_exact(outputs, data)


def test_an_inf_on_one_side_within_the_bound_of_fp16_overflow_is_no_mismatch():
    """A sum near fp16's overflow threshold (65520) rounds to inf where the fp32 error pushes it
    across: within the bound that is no disagreement; beyond it, or of the other sign, it is."""
    ref = torch.tensor([[[65500.0], [65500.0], [100.0], [-65500.0]]], dtype=torch.float16)
    out = torch.tensor([[[float("inf")], [float("-inf")], [float("inf")], [float("-inf")]]], dtype=torch.float16)
    bound = torch.full((1, 4, 1), 64.0)
    assert submission.count_mismatches([out], [ref], bounds=[bound])[0] == 2  # the wrong sign, and 100
    assert submission.count_mismatches([out], [ref])[0] == 4  # without a bound: the competition's rule
