"""Reference for the NVFP4 block-scaled grouped GEMM task: input generator, oracle, checker.

Group i computes C_i[M, N] = (A_i * SFA_i) @ (B_i * SFB_i)^T, where A_i/B_i hold packed
float4 e2m1 values (low nibble = first element along K), SFA_i/SFB_i hold one float8 e4m3fn
scale per 16 consecutive K elements, and C_i is float16.

- `generate_input` follows the competition's generator call for call, so on CUDA it produces
  bit-identical tensors for the same arguments; it also runs on the CPU.
- `ref_kernel` uses the competition's `torch._scaled_mm` path on sm_100+ and an exact decode
  path everywhere else (Hopper, CPU), where `_scaled_mm` has no float4 support.
- `ref_kernel` validates its input first (`validate_reference_inputs`, the submission's
  message format: `group {g}: {field} = {value!r}; rule: {rule}`) and writes no output
  before every group has passed.
- `check_implementation` keeps the competition's semantics (rtol = atol = 1e-3).
"""

import operator

import torch

from task import input_t, output_t
from utils import verbose_allclose

# One float8 scale per this many consecutive elements along K.
sf_vec_size = 16
RTOL = 1e-03
ATOL = 1e-03

# e2m1 code -> value. Bit 3 is the sign, bits 2..1 the exponent, bit 0 the mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def ceil_div(a, b):
    return (a + b - 1) // b


def to_blocked(input_matrix):
    """The competition's conversion of a plain [rows, cols] scale matrix to cuBLAS's blocked
    layout (rows padded to 128 and cols to 4 with zeros), flattened."""
    rows, cols = input_matrix.shape
    n_row_blocks = ceil_div(rows, 128)
    n_col_blocks = ceil_div(cols, 4)
    padded_rows = n_row_blocks * 128
    padded_cols = n_col_blocks * 4
    if padded_rows != rows or padded_cols != cols:
        padded = torch.nn.functional.pad(
            input_matrix,
            (0, padded_cols - cols, 0, padded_rows - rows),
            mode="constant",
            value=0,
        )
    else:
        padded = input_matrix
    blocks = padded.view(n_row_blocks, 128, n_col_blocks, 4).permute(0, 2, 1, 3)
    rearranged = blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16)
    return rearranged.flatten()


# ---------------------------------------------------------------------------------------
# Input generation (same RNG calls, in the same order, on the same devices as the
# competition's generator; `device` replaces its hard-coded "cuda")
# ---------------------------------------------------------------------------------------


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def create_reordered_scale_factor_tensor(l, mn, k, ref_f8_tensor, device="cuda"):
    """Scale tensor of shape (32, 4, rest_mn, 4, rest_k, l) in the blocked layout.

    Memory is a contiguous (l, rest_mn, rest_k, 32, 4, 4) tensor seen through a permute.
    Padding rows (mn..128*rest_mn) keep random values 1 or 2, as in the competition.
    """
    sf_k = ceil_div(k, sf_vec_size)
    atom_m = (32, 4)
    atom_k = 4
    mma_shape = (
        l,
        ceil_div(mn, atom_m[0] * atom_m[1]),
        ceil_div(sf_k, atom_k),
        atom_m[0],
        atom_m[1],
        atom_k,
    )
    mma_permute_order = (3, 4, 1, 5, 2, 0)
    rand_int_tensor = torch.randint(1, 3, mma_shape, dtype=torch.int8, device=device)
    reordered_f8_tensor = rand_int_tensor.to(dtype=torch.float8_e4m3fn)
    reordered_f8_tensor = reordered_f8_tensor.permute(*mma_permute_order)

    ref_f8_tensor = ref_f8_tensor.to(device)
    i_idx = torch.arange(mn, device=device)
    j_idx = torch.arange(sf_k, device=device)
    b_idx = torch.arange(l, device=device)
    i_grid, j_grid, b_grid = torch.meshgrid(i_idx, j_idx, b_idx, indexing="ij")
    mm = i_grid // (atom_m[0] * atom_m[1])
    mm32 = i_grid % atom_m[0]
    mm4 = (i_grid % 128) // atom_m[0]
    kk = j_grid // atom_k
    kk4 = j_grid % atom_k
    reordered_f8_tensor[mm32, mm4, mm, kk4, kk, b_grid] = ref_f8_tensor[i_grid, j_grid, b_grid]
    return reordered_f8_tensor


def _create_fp4_tensors(l, mn, k, device="cuda"):
    # All byte patterns below 255, then keep only the sign bit and the 2 low bits of each
    # nibble: values in {0, ±0.5, ±1, ±1.5}.
    ref_i8 = torch.randint(255, size=(l, mn, k // 2), dtype=torch.uint8, device=device)
    ref_i8 = ref_i8 & 0b1011_1011
    return ref_i8.permute(1, 2, 0).view(torch.float4_e2m1fn_x2)


# torch.manual_seed, which generate_input calls with its seed, takes 0..2**64-1.
SEED_LIMIT = 2**64


def _generator_fail(field, value, rule):
    raise ValueError(f"generate_input: {field} = {value!r}; rule: {rule}")


def _generator_int(field, value, rule) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        _generator_fail(field, value, rule)
    return operator.index(value)


def _check_generator_args(m, n, k, g, seed):
    """generate_input's arguments as plain ints: (m, n, k, g, seed); a ValueError naming the
    argument, its value and the rule for the first one that breaks the task's contract (the
    rules validate_reference_inputs applies to the sizes it generates)."""
    g_rule = f"g is an integer, 1 <= g <= {MAX_GROUPS} (the number of groups)"
    g = _generator_int("g", g, g_rule)
    if not 1 <= g <= MAX_GROUPS:
        _generator_fail("g", g, g_rule)
    columns = []
    for name, values, minimum, rule in (
        ("m", m, 0, "M is an integer >= 0"),
        ("n", n, 1, "N is an integer >= 1"),
        ("k", k, K_MULTIPLE, f"K is a positive multiple of {K_MULTIPLE} (the task's contract)"),
    ):
        if not isinstance(values, (tuple, list)):
            _generator_fail(f"type({name})", type(values).__name__,
                            f"{name} is a tuple or list of g integers, one per group")
        if len(values) != g:
            _generator_fail(f"len({name})", len(values),
                            f"{name} holds g = {g} values, one per group")
        column = []
        for group, value in enumerate(values):
            value = _generator_int(f"{name}[{group}]", value, rule)
            if value < minimum or (name == "k" and value % K_MULTIPLE != 0):
                _generator_fail(f"{name}[{group}]", value, rule)
            column.append(value)
        columns.append(column)
    seed_rule = "seed is an integer in 0..2**64-1 (the range of torch.manual_seed)"
    seed = _generator_int("seed", seed, seed_rule)
    if not 0 <= seed < SEED_LIMIT:
        _generator_fail("seed", seed, seed_rule)
    return (*columns, g, seed)


def generate_input(m: tuple, n: tuple, k: tuple, g: int, seed: int, device=None):
    """Inputs for one grouped problem, as the competition generates them.

    Returns (abc, sfasfb, sfasfb_reordered, problem_sizes), per group:
      a [M, K/2, 1], b [N, K/2, 1] float4_e2m1fn_x2;  c [M, N, 1] float16 (random);
      sfa [M, K/16, 1], sfb [N, K/16, 1] float8_e4m3fn, values 1 or 2, always on the CPU;
      sfa_reordered [32, 4, ceil(M/128), 4, K/64, 1], sfb_reordered likewise with N;
      problem size (M, N, K, 1).
    `device`: where a, b, c and the reordered scales live; default CUDA when available.
    The arguments are checked first, before the RNG is seeded: g an integer 1..64; m, n and
    k tuples or lists of g integers with M >= 0, N >= 1, K a positive multiple of 256; seed an
    integer in 0..2**64-1. A bad one raises ValueError
    `generate_input: {field} = {value!r}; rule: {rule}`.
    """
    m, n, k, g, seed = _check_generator_args(m, n, k, g, seed)
    device = torch.device(device) if device is not None else _default_device()
    torch.manual_seed(seed)

    abc_tensors = []
    sfasfb_tensors = []
    sfasfb_reordered_tensors = []
    problem_sizes = []
    l = 1  # the competition's name for the batch dimension (always 1)
    for group_idx in range(g):
        mi = m[group_idx]
        ni = n[group_idx]
        ki = k[group_idx]
        a_ref = _create_fp4_tensors(l, mi, ki, device)
        b_ref = _create_fp4_tensors(l, ni, ki, device)
        c_ref = torch.randn((l, mi, ni), dtype=torch.float16, device=device).permute(1, 2, 0)

        sf_k = ceil_div(ki, sf_vec_size)
        sfa_ref_cpu = torch.randint(
            1, 3, (l, mi, sf_k), dtype=torch.int8
        ).to(dtype=torch.float8_e4m3fn).permute(1, 2, 0)
        sfb_ref_cpu = torch.randint(
            1, 3, (l, ni, sf_k), dtype=torch.int8
        ).to(dtype=torch.float8_e4m3fn).permute(1, 2, 0)

        sfa_reordered = create_reordered_scale_factor_tensor(l, mi, ki, sfa_ref_cpu, device)
        sfb_reordered = create_reordered_scale_factor_tensor(l, ni, ki, sfb_ref_cpu, device)

        abc_tensors.append((a_ref, b_ref, c_ref))
        sfasfb_tensors.append((sfa_ref_cpu, sfb_ref_cpu))
        sfasfb_reordered_tensors.append((sfa_reordered, sfb_reordered))
        problem_sizes.append((mi, ni, ki, l))
    return (abc_tensors, sfasfb_tensors, sfasfb_reordered_tensors, problem_sizes)


# ---------------------------------------------------------------------------------------
# Exact decode path
# ---------------------------------------------------------------------------------------

_BYTE_LUT_CACHE: dict[torch.device, torch.Tensor] = {}


def _byte_lut(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: byte -> (value of low nibble, value of high nibble)."""
    lut = _BYTE_LUT_CACHE.get(device)
    if lut is None:
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        codes = torch.arange(256)
        lut = torch.stack([values[codes & 0xF], values[codes >> 4]], dim=1).to(device)
        _BYTE_LUT_CACHE[device] = lut
    return lut


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[R, K/2] float4_e2m1fn_x2 (or uint8) -> [R, K] float32; the low nibble is element 2j."""
    packed_bytes = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    rows, half_k = packed_bytes.shape
    return _byte_lut(packed_bytes.device)[packed_bytes.int()].reshape(rows, 2 * half_k)


def decode_scaled(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantize [R, K/2] packed e2m1 with [R, K/16] e4m3 scales -> [R, K] float32.

    Exact: e2m1 values have 2 significant bits and e4m3 values 4, so each product has at
    most 6 and is representable in float32 (and in TF32).
    """
    values = decode_e2m1(packed)
    scale_values = scales.to(device=values.device, dtype=torch.float32)
    return values * scale_values.repeat_interleave(sf_vec_size, dim=1)


def decoded_group_gemm(a: torch.Tensor, b: torch.Tensor, sfa: torch.Tensor, sfb: torch.Tensor,
                       accumulate_dtype=torch.float32) -> torch.Tensor:
    """One group, L = 1 slices: a [M, K/2], b [N, K/2], sfa [M, K/16], sfb [N, K/16] ->
    [M, N] in `accumulate_dtype` (not yet rounded to float16).

    With the competition's data (e2m1 in {0, ±0.5, ±1, ±1.5}, scales in {1, 2}) every
    product is a multiple of 1/4 with |product| <= 9, so every partial sum over K <= 7168
    is a multiple of 1/4 below 2^16, exactly representable in float32 (24-bit significand):
    float32 accumulation is then exact in any order. tests/test_reference.py checks this
    against float64 at K = 7168; for arbitrary e4m3 scales float32 is not exact.
    """
    a_values = decode_scaled(a, sfa).to(accumulate_dtype)
    b_values = decode_scaled(b, sfb).to(accumulate_dtype)
    return a_values @ b_values.transpose(0, 1)


def exact_group_gemm(data) -> list[torch.Tensor]:
    """Every group's C as the exact sum (float64 accumulation) rounded to fp16, [M, N, 1],
    from the plain scales: the oracle for general e4m3 scales, where float32 is not exact."""
    abc, sfs, _, _ = data
    return [
        decoded_group_gemm(a[:, :, 0], b[:, :, 0], sfa[:, :, 0], sfb[:, :, 0], accumulate_dtype=torch.float64)
        .to(torch.float16).unsqueeze(-1)
        for (a, b, _c), (sfa, sfb) in zip(abc, sfs)
    ]


def fp32_accumulation_bound(data) -> list[torch.Tensor]:
    """Per output, the rounding error that fp32 accumulation may add to the exact sum: the
    tensor cores add each 16-element k-slice's products into the fp32 accumulator, each of
    those K/16 additions (and the slice's own sum) off by at most 2^-23 of a partial sum, and
    every partial sum is at most sum_k |a_k b_k|. With the competition's scales every partial
    sum is exact in fp32 (decoded_group_gemm); with general e4m3 scales it is not."""
    abc, sfs, _, _ = data
    bounds = []
    for (a, b, _c), (sfa, sfb) in zip(abc, sfs):
        k = a.shape[1] * 2
        # |values|: the sign bits of both codes of a byte (0x88) and of the scale (0x80) cleared
        abs_a = (a[:, :, 0].view(torch.uint8) & 0x77).view(torch.float4_e2m1fn_x2)
        abs_b = (b[:, :, 0].view(torch.uint8) & 0x77).view(torch.float4_e2m1fn_x2)
        abs_sfa = (sfa[:, :, 0].view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
        abs_sfb = (sfb[:, :, 0].view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
        abs_sum = decoded_group_gemm(abs_a, abs_b, abs_sfa, abs_sfb, accumulate_dtype=torch.float64)
        bounds.append((k // 16 + 1) * 2.0**-23 * abs_sum.unsqueeze(-1))
    return bounds


def exact_mismatches(data, output) -> list[tuple[int, int, int]]:
    """Per group (mismatches, elements, first flat index or -1) against the exact sum at
    the competition's tolerance, widened by the fp32 accumulation bound; NaN anywhere counts."""
    counts = []
    for got, ref, bound in zip(output, exact_group_gemm(data), fp32_accumulation_bound(data)):
        error = (got.double() - ref.double()).abs()
        allowed = ATOL + RTOL * ref.double().abs() + bound.to(error.device)
        bad = ~(error <= allowed)  # NaN errors are mismatches
        bad |= torch.isinf(got) != torch.isinf(ref)
        flat = bad.flatten().nonzero()
        counts.append((int(bad.sum()), bad.numel(), int(flat[0]) if len(flat) else -1))
    return counts


def _uses_scaled_mm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def _scaled_mm_group(a_ref, b_ref, sfa_ref, sfb_ref):
    """The competition's sm_100 path for one L slice."""
    scale_a = to_blocked(sfa_ref)
    scale_b = to_blocked(sfb_ref)
    return torch._scaled_mm(
        a_ref.view(torch.float4_e2m1fn_x2),
        b_ref.transpose(0, 1).view(torch.float4_e2m1fn_x2),
        scale_a.cuda(),
        scale_b.cuda(),
        bias=None,
        out_dtype=torch.float16,
    )


# ---------------------------------------------------------------------------------------
# Input validation (the submission's rules and message format, where they apply to an
# oracle that also runs on the CPU and ignores strides)
# ---------------------------------------------------------------------------------------

MAX_GROUPS = 64
K_MULTIPLE = 256

_DTYPE_RULES = {
    "a": (torch.float4_e2m1fn_x2, "packed fp4 e2m1, two values per byte"),
    "b": (torch.float4_e2m1fn_x2, "packed fp4 e2m1, two values per byte"),
    "c": (torch.float16, "fp16 output"),
    "sfa": (torch.float8_e4m3fn, "one fp8 e4m3 scale per 16 K elements"),
    "sfb": (torch.float8_e4m3fn, "one fp8 e4m3 scale per 16 K elements"),
}


def _fail(group, field, value, rule, error=ValueError):
    prefix = "input" if group is None else f"group {group}"
    raise error(f"{prefix}: {field} = {value!r}; rule: {rule}")


def _check_problem_size(g, problem_size):
    if not isinstance(problem_size, (tuple, list)) or len(problem_size) != 4:
        _fail(g, "problem_sizes[g]", problem_size, "expected a 4-tuple (M, N, K, L)", TypeError)
    for name, value in zip("MNKL", problem_size):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            _fail(g, f"problem_sizes[g].{name}", value, "expected an integer", TypeError)
    m, n, k, l = (operator.index(v) for v in problem_size)
    if l != 1:
        _fail(g, "L", l, "L must be 1 (one batch per group)")
    if k <= 0 or k % K_MULTIPLE != 0:
        _fail(g, "K", k, f"K must be a positive multiple of {K_MULTIPLE} (the task's contract)")
    if n <= 0:
        _fail(g, "N", n, "N must be >= 1")
    if m < 0:
        _fail(g, "M", m, "M must be >= 0")
    return (m, n, k, l)


def validate_reference_inputs(data) -> list[tuple[int, int, int, int]]:
    """Check what `ref_kernel` reads; return the problem sizes as int 4-tuples.

    The submission's rules where they apply here: the 4-tuple, G lists of the same length
    (1 <= G <= 64), integer sizes with L = 1, K a positive multiple of 256, N >= 1, M >= 0,
    the dtypes, and shapes that match the sizes (a [M, K/2, 1], b [N, K/2, 1], c [M, N, 1],
    sfa [M, K/16, 1], sfb [N, K/16, 1]). Unlike the submission it accepts any strides and
    the CPU; a, b and c of every group must share one device (the plain scales, which the
    generator leaves on the CPU, may be anywhere). Raises ValueError / TypeError naming the
    group, the field, the value and the rule.
    """
    if not isinstance(data, (tuple, list)) or len(data) != 4:
        _fail(
            None,
            "len(data)" if isinstance(data, (tuple, list)) else "type(data)",
            len(data) if isinstance(data, (tuple, list)) else type(data).__name__,
            "expected the 4-tuple (abc, sfasfb, sfasfb_reordered, problem_sizes)",
            TypeError,
        )
    abc, sfasfb, sfasfb_reordered, problem_sizes = data
    for name, value in (
        ("abc", abc),
        ("sfasfb", sfasfb),
        ("sfasfb_reordered", sfasfb_reordered),
        ("problem_sizes", problem_sizes),
    ):
        if not isinstance(value, (tuple, list)):
            _fail(None, f"type({name})", type(value).__name__, "expected a list", TypeError)
    num_groups = len(problem_sizes)
    if not 1 <= num_groups <= MAX_GROUPS:
        _fail(None, "len(problem_sizes)", num_groups, f"expected 1 <= G <= {MAX_GROUPS}")
    for name, value in (("abc", abc), ("sfasfb", sfasfb), ("sfasfb_reordered", sfasfb_reordered)):
        if len(value) != num_groups:
            _fail(None, f"len({name})", len(value),
                  f"expected G = len(problem_sizes) = {num_groups}")

    sizes = [_check_problem_size(g, problem_sizes[g]) for g in range(num_groups)]
    device = None
    for g, (m, n, k, l) in enumerate(sizes):
        if not isinstance(abc[g], (tuple, list)) or len(abc[g]) != 3:
            _fail(g, "abc[g]", type(abc[g]).__name__, "expected a 3-tuple (a, b, c)", TypeError)
        if not isinstance(sfasfb[g], (tuple, list)) or len(sfasfb[g]) != 2:
            _fail(g, "sfasfb[g]", type(sfasfb[g]).__name__, "expected a 2-tuple (sfa, sfb)",
                  TypeError)
        tensors = {"a": abc[g][0], "b": abc[g][1], "c": abc[g][2],
                   "sfa": sfasfb[g][0], "sfb": sfasfb[g][1]}
        shapes = {
            "a": ((m, k // 2, l), "[M, K/2, L]"),
            "b": ((n, k // 2, l), "[N, K/2, L]"),
            "c": ((m, n, l), "[M, N, L]"),
            "sfa": ((m, k // sf_vec_size, l), "[M, K/16, L]"),
            "sfb": ((n, k // sf_vec_size, l), "[N, K/16, L]"),
        }
        for field, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                _fail(g, f"type({field})", type(tensor).__name__, "expected a torch.Tensor",
                      TypeError)
            want_dtype, why = _DTYPE_RULES[field]
            if tensor.dtype != want_dtype:
                _fail(g, f"{field}.dtype", tensor.dtype, f"expected {want_dtype} ({why})",
                      TypeError)
            shape, named = shapes[field]
            if tuple(tensor.shape) != shape:
                _fail(g, f"{field}.shape", tuple(tensor.shape),
                      f"expected {shape} ({field} is {named})")
        for field in ("a", "b", "c"):
            tensor = tensors[field]
            if device is None:
                device = tensor.device
            elif tensor.device != device:
                _fail(g, f"{field}.device", str(tensor.device),
                      f"expected {device} like group 0's a")
    return sizes


def ref_kernel(data: input_t) -> output_t:
    """Reference grouped GEMM: writes each C and returns the list of C tensors.

    The input is validated first (`validate_reference_inputs`): on a bad input nothing is
    written and a ValueError / TypeError names the group, the field, the value and the rule.
    """
    problem_sizes = validate_reference_inputs(data)
    abc_tensors, sfasfb_tensors, _, _ = data
    result_tensors = []
    with torch.no_grad():
        for (a_ref, b_ref, c_ref), (sfa_ref, sfb_ref), (_m, _n, _k, l) in zip(
            abc_tensors, sfasfb_tensors, problem_sizes, strict=True
        ):
            use_scaled_mm = _uses_scaled_mm(a_ref.device)
            for l_idx in range(l):
                if use_scaled_mm:
                    res = _scaled_mm_group(a_ref[:, :, l_idx], b_ref[:, :, l_idx],
                                           sfa_ref[:, :, l_idx], sfb_ref[:, :, l_idx])
                else:
                    res = decoded_group_gemm(a_ref[:, :, l_idx], b_ref[:, :, l_idx],
                                             sfa_ref[:, :, l_idx], sfb_ref[:, :, l_idx])
                c_ref[:, :, l_idx] = res.to(torch.float16)
            result_tensors.append(c_ref)
    return result_tensors


# ---------------------------------------------------------------------------------------
# Checking (the competition's match_reference semantics)
# ---------------------------------------------------------------------------------------


def match_outputs(expected: output_t, output: output_t) -> tuple[bool, str]:
    """Compare a submission's outputs with already computed reference outputs."""
    if len(output) != len(expected):
        return False, f"output length mismatch: got {len(output)}, expected {len(expected)}"
    for i, (output_i, expected_i) in enumerate(zip(output, expected)):
        if output_i.device != expected_i.device:
            output_i = output_i.to(expected_i.device)
        reasons = verbose_allclose(output_i, expected_i, rtol=RTOL, atol=ATOL)
        if len(reasons) > 0:
            return (
                False,
                f"mismatch found! custom implementation doesn't match reference: {i} {reasons}",
            )
    return True, ""


def check_implementation(data: input_t, output: output_t) -> tuple[bool, str]:
    """Run the reference on `data` (overwriting its C tensors) and compare with `output`."""
    expected = ref_kernel(data)
    return match_outputs(expected, output)
