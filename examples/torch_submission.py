"""Pure-PyTorch submission: exact decode of the packed operands, float32 GEMM per group.

Runs wherever torch runs (CPU, Hopper, Blackwell); a correctness baseline and the slow end of
the benchmark table, not a fast kernel. Reads the reordered (blocked) scale tensors, as a
real kernel does, so it also exercises that layout:
    python eval.py test --submission examples/torch_submission.py
    python eval.py benchmark --submission examples/torch_submission.py

Its input is checked before anything is computed or written, with the reference's rules
(`reference.validate_reference_inputs`) and, for the reordered scales it reads, their dtype,
shape and device: a bad input raises ValueError / TypeError naming the group, the field, the
value and the rule, and leaves every output untouched.
"""

import torch

from reference import validate_reference_inputs
from task import input_t, output_t

SF_VEC_SIZE = 16
# e2m1 code -> value (bit 3 sign, bits 2..1 exponent, bit 0 mantissa).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_byte_luts: dict[torch.device, torch.Tensor] = {}


def byte_lut(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: packed byte -> (low-nibble value, high-nibble value)."""
    if device not in _byte_luts:
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        codes = torch.arange(256)
        _byte_luts[device] = torch.stack([values[codes & 0xF], values[codes >> 4]], 1).to(device)
    return _byte_luts[device]


def unblock_scales(scales_reordered: torch.Tensor, rows: int) -> torch.Tensor:
    """[32, 4, rest_mn, 4, rest_k, 1] blocked scales -> plain [rows, 4 * rest_k] float32.

    Element (r, j) sits at [r % 32, (r % 128) // 32, r // 128, j % 4, j // 4, 0].
    """
    _, _, rest_mn, _, rest_k, _ = scales_reordered.shape
    plain = scales_reordered[..., 0].permute(2, 1, 0, 4, 3)  # (rest_mn, 4, 32, rest_k, 4)
    plain = plain.reshape(rest_mn * 128, rest_k * 4)
    return plain[:rows].to(torch.float32)


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[R, K/2] packed e2m1 and [R, K/16] scales -> [R, K] float32 (exact products)."""
    packed_bytes = packed.view(torch.uint8)
    rows, half_k = packed_bytes.shape
    values = byte_lut(packed_bytes.device)[packed_bytes.int()].reshape(rows, 2 * half_k)
    return values * scales.repeat_interleave(SF_VEC_SIZE, dim=1)


def _fail(group, field, value, rule, error=ValueError):
    raise error(f"group {group}: {field} = {value!r}; rule: {rule}")


def validate_inputs(data) -> list[tuple[int, int, int, int]]:
    """The reference's checks (`validate_reference_inputs`), then those of the reordered
    scales: 2-tuples of float8_e4m3fn [32, 4, ceil(MN/128), 4, ceil(K/64), 1] tensors on a's
    device. Returns the problem sizes as int 4-tuples."""
    sizes = validate_reference_inputs(data)
    abc_tensors, _, sfasfb_reordered_tensors, _ = data
    for g, ((m, n, k, l), abc, pair) in enumerate(zip(sizes, abc_tensors, sfasfb_reordered_tensors)):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            _fail(g, "sfasfb_reordered[g]", type(pair).__name__,
                  "expected a 2-tuple (sfa_reordered, sfb_reordered)", TypeError)
        device = abc[0].device
        for field, tensor, rows, named in (("sfa_reordered", pair[0], m, "M"),
                                           ("sfb_reordered", pair[1], n, "N")):
            if not isinstance(tensor, torch.Tensor):
                _fail(g, f"type({field})", type(tensor).__name__, "expected a torch.Tensor", TypeError)
            if tensor.dtype != torch.float8_e4m3fn:
                _fail(g, f"{field}.dtype", tensor.dtype,
                      "expected torch.float8_e4m3fn (one fp8 e4m3 scale per 16 K elements)", TypeError)
            shape = (32, 4, -(-rows // 128), 4, -(-k // (4 * SF_VEC_SIZE)), l)
            if tuple(tensor.shape) != shape:
                _fail(g, f"{field}.shape", tuple(tensor.shape),
                      f"expected {shape} ({field} is [32, 4, ceil({named}/128), 4, ceil(K/64), L])")
            if tensor.device != device:
                _fail(g, f"{field}.device", str(tensor.device), f"expected {device} like a")
    return sizes


def custom_kernel(data: input_t) -> output_t:
    problem_sizes = validate_inputs(data)
    abc_tensors, _, sfasfb_reordered_tensors, _ = data
    outputs = []
    for (a, b, c), (sfa_r, sfb_r), (m, n, _k, _l) in zip(
        abc_tensors, sfasfb_reordered_tensors, problem_sizes
    ):
        a_values = dequantize(a[:, :, 0], unblock_scales(sfa_r, m))
        b_values = dequantize(b[:, :, 0], unblock_scales(sfb_r, n))
        c[:, :, 0] = (a_values @ b_values.T).to(torch.float16)
        outputs.append(c)
    return outputs
