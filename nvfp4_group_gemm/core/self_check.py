"""The first-use self-check, its tolerance, and the host computations.

``first_use_check`` compares the first input set a compiled kernel runs with the backend's
oracle at the competition's tolerance, widened only by what fp32 accumulation may add
(``accumulation_bounds``); a disagreement demotes the kernel. The host computations
(``HOST_COMPUTATIONS``: torch._scaled_mm, the exact decode) are the chain's last links and the
oracles."""

import math

import torch

from .chain import SELF_CHECKED, c_of_group, context_usable, demote, one_line, report
from .config import SELF_CHECK, sf_vec_size

SELF_CHECK_RTOL = SELF_CHECK_ATOL = 1e-3  # the competition's tolerance


def count_mismatches(outputs, expected, rtol: float = SELF_CHECK_RTOL, atol: float = SELF_CHECK_ATOL,
                     bounds=None):
    """The competition's comparison (utils.verbose_allclose): |out - ref| > atol + rtol |ref|,
    widened per group by `bounds` (accumulation_bounds: None, or a None entry, adds nothing),
    NaN and +-inf where only one side has them. Returns (mismatches, elements, the first
    positions as (group, row, column), at most 3)."""
    mismatches, elements, first = 0, 0, []
    for g, (out, ref) in enumerate(zip(outputs, expected)):
        out32, ref32 = out.float(), ref.float()
        allowed = atol + rtol * ref32.abs()
        bound = None if bounds is None else bounds[g]
        if bound is not None:
            allowed = allowed + bound
        bad = (out32 - ref32).abs() > allowed
        bad |= torch.isnan(out32) ^ torch.isnan(ref32)
        one_infinite = (torch.isposinf(out32) ^ torch.isposinf(ref32)) | (torch.isneginf(out32) ^ torch.isneginf(ref32))
        bad |= one_infinite
        if bound is not None:
            # a sum within the bound of fp16's overflow threshold rounds to inf on one side only
            # when the other side's fp32 error pushes it across: that is no disagreement
            infinite = torch.isinf(out32)
            finite_side, infinite_side = torch.where(infinite, ref32, out32), torch.where(infinite, out32, ref32)
            bad &= ~(one_infinite & (finite_side.abs() + bound >= FP16_OVERFLOW)
                     & (torch.sign(finite_side) == torch.sign(infinite_side)))
        count = int(bad.sum())
        elements += bad.numel()
        if count and len(first) < 3:
            first += [(g, *map(int, index[:2])) for index in bad.nonzero()[: 3 - len(first)].tolist()]
        mismatches += count
    return mismatches, elements, first


# How many sides of the self-check's comparison add in fp32, by oracle: torch._scaled_mm
# accumulates in fp32 as the kernel does; the exact decode adds in float64 (exact here)
ORACLE_FP32_SIDES = {"scaled_mm": 2, "exact_decode": 1}
# The smallest magnitude fp16 rounds to infinity (65504 + half its last step)
FP16_OVERFLOW = 65520.0
# One fp32 addition's error relative to the partial sum it makes, per side: 2^-23 (twice the
# unit roundoff: a tensor core's accumulator may truncate instead of rounding to nearest)
FP32_ADD_ERROR = 2.0**-23


def _lowest_power_of_two(value: float) -> float:
    """The largest power of two that divides `value` (> 0, finite): every multiple of it."""
    mantissa, exponent = math.frexp(value)
    integer, exponent = int(mantissa * 2**53), exponent - 53
    while integer % 2 == 0:
        integer, exponent = integer // 2, exponent + 1
    return 2.0**exponent


# Per e4m3 code (sign cleared): the largest power of two its value is a multiple of; +inf for
# zero and NaN (they add no quantum to a product: a zero product is a multiple of anything)
_E4M3_QUANTUM: dict = {}


def _e4m3_quantum(device: torch.device) -> torch.Tensor:
    table = _E4M3_QUANTUM.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
        table = _E4M3_QUANTUM[device] = torch.tensor(
            [_lowest_power_of_two(v) if v > 0 and not math.isnan(v) else float("inf") for v in values], device=device)
    return table


def accumulation_bounds(data, fp32_sides: int) -> list[torch.Tensor | None]:
    """Per group, how far a correct kernel that accumulates in fp32 may lie from the oracle
    beyond the competition's tolerance, computed on the GPU from the inputs: None where every
    fp32 partial sum is exact, else [M, N, 1] float32
    fp32_sides * FP32_ADD_ERROR * (K/16 + 1) * sum_k |a_k b_k|.

    The tensor cores add each 16-element k-block's products (exact: e2m1 x e2m1 x e4m3 x e4m3
    has at most 10 significant bits) into the fp32 accumulator: K/16 additions and the block's
    own sum, each off by at most FP32_ADD_ERROR of a partial sum, and no partial sum exceeds
    sum_k |a_k b_k| (the decode of A and B with their sign bits cleared, multiplied).

    Exactness: e2m1 values are multiples of 1/2, so every product of a group is a multiple of
    q = 1/4 * (the largest power of two dividing every nonzero sfa) * (the same of sfb), and so
    is every partial sum; below 2^24 q (checked per output against sum_k |a_k b_k|) they are
    all exact in fp32 in any order, and the group's bound is None. The competition's data
    (scales 1 or 2, |e2m1| <= 1.5) gives q = 1/4 and sums far below 2^22: the check there is
    exactly the competition's own."""
    abc, _, sfasfb_reordered, _ = data
    bounds = []
    for (a, b, _c), (sfa, sfb) in zip(abc, sfasfb_reordered):
        m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
        if m == 0:
            bounds.append(None)
            continue
        bound = group_accumulation_bound(a[:, :, 0], b[:, :, 0], plain_scales(sfa, m, k).reshape(m, -1),
                                         plain_scales(sfb, n, k).reshape(n, -1), fp32_sides)
        bounds.append(None if bound is None else bound.unsqueeze(-1))
    return bounds


def group_accumulation_bound(a, b, sfa, sfb, fp32_sides: int):
    """accumulation_bounds of one group from its codes (a [M, K/2], b [N, K/2]) and plain scales
    (sfa [M, K/16], sfb [N, K/16]): None where every fp32 partial sum is exact, else [M, N]."""
    k = 2 * a.shape[1]
    # |scales| and |values|: the sign bits of the scale (0x80) and of both codes (0x88) cleared
    abs_sfa = sfa.view(torch.uint8) & 0x7F
    abs_sfb = sfb.view(torch.uint8) & 0x7F
    quantum_table = _e4m3_quantum(a.device)
    quantum = 0.25 * quantum_table[abs_sfa.int()].min() * quantum_table[abs_sfb.int()].min()
    abs_a = decode_fp4(a.view(torch.uint8) & 0x77, abs_sfa.view(torch.float8_e4m3fn))
    abs_b = decode_fp4(b.view(torch.uint8) & 0x77, abs_sfb.view(torch.float8_e4m3fn))
    # fp32 products of exact decodes: the sum is off by at most K 2^-24 of itself; 1 % covers it
    abs_sum = (abs_a @ abs_b.transpose(0, 1)) * 1.01
    if bool((abs_sum < 2.0**24 * quantum).all()):
        return None  # every partial sum exact in fp32: nothing to add
    return fp32_sides * FP32_ADD_ERROR * (k // 16 + 1) * abs_sum


def first_use_check(data, plan) -> list[torch.Tensor]:
    """The first input set a compiled kernel runs (`plan`'s) is also computed by the
    backend's oracle (torch._scaled_mm on sm_100, the exact decode on sm_90) and compared at
    the competition's tolerance, widened only by what fp32 accumulation may add
    (accumulation_bounds: nothing on the competition's data). A disagreement demotes the
    kernel and returns the oracle's result. The kernel counts as checked once its oracle ran.
    A fault that poisoned the context (an illegal address in the kernel first surfaces at the
    oracle's first CUDA call) raises naming the kernel. Skipped with NVFP4_SELF_CHECK=0."""
    outputs = list(map(c_of_group, data[0]))
    oracle = plan.backend.oracle
    if not SELF_CHECK or plan.choice.host:
        return outputs
    what = f"{plan.backend.name} kernel {plan.choice.describe()}, G = {plan.num_groups}"
    try:
        expected = HOST_COMPUTATIONS[oracle.name](data, [torch.empty_like(c) for c in outputs])
        bounds = accumulation_bounds(data, ORACLE_FP32_SIDES.get(oracle.name, 2))
        mismatches, elements, first = count_mismatches(outputs, expected, bounds=bounds)
    except Exception as error:  # the kernel's fault, or an oracle that cannot run
        if not context_usable(plan.device):
            raise RuntimeError(f"{what}: the GPU context faulted after this kernel ran, before its self-check "
                               f"could read its output; the kernel is the suspect ({one_line(error)})") from error
        report(f"{what}: self-check skipped, its oracle {oracle.name} failed ({one_line(error)}); "
               "checked again at the next new input set")
        return outputs
    SELF_CHECKED.add(plan.kernel_key)
    if mismatches:
        for c, ref in zip(outputs, expected):
            c.copy_(ref)
        where = ", ".join(f"group {g} [{i}, {j}]" for g, i, j in first)
        demote(plan.backend.name, plan.choice, plan.chain, plan.num_groups,
               f"self-check: {mismatches} of {elements} outputs differ from {oracle.name} beyond the tolerance "
               f"and fp32 accumulation (first: {where}); this call returns {oracle.name}'s result")
    return outputs


# ----------------------------------------------------------------------------- host computations
def flat_blocked_scales(reordered: torch.Tensor) -> torch.Tensor:
    """The flat cuBLAS blocked scale buffer behind an official reordered scale tensor (a
    (l, rest, rest_k, 32, 4, 4) contiguous tensor seen through a permute): a view."""
    return reordered.permute(5, 2, 4, 0, 1, 3).reshape(-1)


def plain_scales(reordered: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """[rows, K / 16] scales read back from an official reordered scale tensor (L = 1)."""
    # (rest, rest_k, 32, 4, 4) -> (rest, 4, 32, rest_k, 4): row = rest*128 + 32*i4 + i32
    blocks = reordered.permute(5, 2, 4, 0, 1, 3)[0].permute(0, 3, 2, 1, 4)
    return blocks.reshape(blocks.shape[0] * 128, blocks.shape[3] * 4)[:rows, : k // sf_vec_size]


def scaled_mm_group_gemm(data, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """torch._scaled_mm per group with the reordered (blocked) scales: the competition
    reference's own computation on sm_100."""
    abc, _, sfasfb_reordered, _ = data
    for (a, b, _c), (sfa, sfb), out in zip(abc, sfasfb_reordered, outputs):
        if a.shape[0] == 0:
            continue
        n = b.shape[0]
        b_rows = b[:, :, 0]
        if n % 16:
            # cuBLAS takes N in multiples of 16: zero rows added (their scales exist already:
            # the blocked layout covers N rounded up to 128), their columns sliced off
            b_rows = torch.cat([b_rows, b_rows.new_zeros(16 - n % 16, b_rows.shape[1])])
        out[:, :, 0] = torch._scaled_mm(
            a[:, :, 0], b_rows.transpose(0, 1), flat_blocked_scales(sfa), flat_blocked_scales(sfb),
            bias=None, out_dtype=torch.float16,
        )[:, :n]
    return outputs


# reference.py has the same decode; the leaderboard's runner brings its own reference.py, so
# this file keeps its own
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BYTE_VALUES: dict = {}


def decode_fp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[R, K/2] packed e2m1 (low nibble first) times [R, K/16] e4m3 scales -> [R, K] float32,
    exactly (2 + 4 significant bits)."""
    lut = _BYTE_VALUES.get(packed.device)
    if lut is None:
        values = torch.tensor(_E2M1_VALUES, dtype=torch.float32)
        codes = torch.arange(256)
        lut = _BYTE_VALUES[packed.device] = torch.stack([values[codes & 15], values[codes >> 4]], 1).to(packed.device)
    rows, half_k = packed.shape
    decoded = lut[packed.view(torch.uint8).int()].reshape(rows, 2 * half_k)
    return decoded * scales.float().repeat_interleave(sf_vec_size, dim=1)


def exact_decode_group_gemm(data, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per group: decode A and B with their scales (exact in float32: 2 + 4 significant
    bits), multiply with float64 accumulation (the exact sum for any e4m3 scales, so that the
    self-check's oracle differs from a correct kernel only by the kernel's own fp32
    accumulation), round to fp16. The sm_90 oracle and last link; runs on any device (float64
    is as fast as float32 on an H100/H200)."""
    abc, _, sfasfb_reordered, _ = data
    for (a, b, _c), (sfa, sfb), out in zip(abc, sfasfb_reordered, outputs):
        m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
        if m == 0:
            continue
        a_values = decode_fp4(a[:, :, 0], plain_scales(sfa, m, k)).double()
        b_values = decode_fp4(b[:, :, 0], plain_scales(sfb, n, k)).double()
        out[:, :, 0] = (a_values @ b_values.transpose(0, 1)).to(torch.float16)
    return outputs


# Host computations by registry name: each writes `outputs` and returns them
HOST_COMPUTATIONS = {"scaled_mm": scaled_mm_group_gemm, "exact_decode": exact_decode_group_gemm}
