"""Validation: every constraint of the input, checked before anything is launched.

``validate_inputs`` names the group, the field, the value and the rule of the first violation
(ValueError or TypeError); ``accepted_problem_sizes`` is its fast verdict for input sets in
the official layout, and ``checked_input`` the miss path's entry to both. ``input_key``: an
input set's cache key (its data pointers)."""

import functools
import itertools
import operator

import torch

from .config import BASE_ALIGN_BYTES, K_TILE, MAX_GROUPS, ceil_div, sf_vec_size

# =============================================================================
# Validation: every path calls this before any launch
# =============================================================================
_DTYPE_RULES = {
    "a": (torch.float4_e2m1fn_x2, "packed fp4 e2m1, two values per byte"),
    "b": (torch.float4_e2m1fn_x2, "packed fp4 e2m1, two values per byte"),
    "c": (torch.float16, "fp16 output"),
    "sfa_reordered": (torch.float8_e4m3fn, "one fp8 e4m3 scale per 16 K elements"),
    "sfb_reordered": (torch.float8_e4m3fn, "one fp8 e4m3 scale per 16 K elements"),
}


def _fail(group, field, value, rule, error=ValueError):
    prefix = "input" if group is None else f"group {group}"
    raise error(f"{prefix}: {field} = {value!r}; rule: {rule}")


def reordered_scale_shape(mn: int, k: int) -> tuple[int, ...]:
    """Shape of an official reordered scale tensor for L = 1: (32, 4, rest_mn, 4, rest_k, 1)."""
    return (32, 4, ceil_div(mn, 128), 4, ceil_div(k // sf_vec_size, 4), 1)


def reordered_scale_strides(mn: int, k: int) -> tuple[int, ...]:
    """Strides of the official reordered scale tensor: a (l, rest_mn, rest_k, 32, 4, 4)
    contiguous tensor permuted by (3, 4, 1, 5, 2, 0)."""
    rest_mn = ceil_div(mn, 128)
    rest_k = ceil_div(k // sf_vec_size, 4)
    return (16, 4, rest_k * 512, 1, 512, rest_mn * rest_k * 512)


def _check_layout(group, field, tensor, shape, strides, rule):
    if tuple(tensor.shape) != tuple(shape):
        _fail(group, f"{field}.shape", tuple(tensor.shape), f"expected {tuple(shape)} ({rule})")
    # Strides of size-1 modes never address memory: only modes with extent > 1 are checked
    for dim, (extent, got, want) in enumerate(zip(tensor.shape, tensor.stride(), strides)):
        if extent > 1 and got != want:
            _fail(
                group,
                f"{field}.stride()",
                tuple(tensor.stride()),
                f"mode {dim} must have stride {want} ({rule}); pass a tensor with the "
                "official layout (e.g. .contiguous() for a/b/c)",
            )
    if tensor.numel() > 0 and tensor.data_ptr() % BASE_ALIGN_BYTES != 0:
        _fail(
            group,
            f"{field}.data_ptr() % {BASE_ALIGN_BYTES}",
            tensor.data_ptr() % BASE_ALIGN_BYTES,
            f"base address must be {BASE_ALIGN_BYTES}-byte aligned (TMA / vector access)",
        )


def _check_problem_size(g, problem_size):
    if not isinstance(problem_size, (tuple, list)) or len(problem_size) != 4:
        _fail(g, "problem_sizes[g]", problem_size, "expected a 4-tuple (M, N, K, L)", TypeError)
    for name, value in zip("MNKL", problem_size):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            _fail(g, f"problem_sizes[g].{name}", value, "expected an integer", TypeError)
    m, n, k, l = (operator.index(v) for v in problem_size)
    if l != 1:
        _fail(g, "L", l, "L must be 1 (one batch per group)")
    if k <= 0 or k % K_TILE != 0:
        _fail(g, "K", k, f"K must be a positive multiple of {K_TILE} (the K tile)")
    if n <= 0:
        _fail(g, "N", n, "N must be >= 1")
    if m < 0:
        _fail(g, "M", m, "M must be >= 0")
    return (m, n, k, l)


def validate_inputs(data, *, require_cuda: bool = True) -> tuple[tuple[int, int, int, int], ...]:
    """Check everything the kernels rely on; return the problem sizes as int 4-tuples.

    Raises ValueError / TypeError naming the group, the field, the value and the rule. Nothing
    is launched and no output is written before this returns. `require_cuda` False: every
    rule but "a CUDA device" (the library's exact decode on CPU tensors).
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
            _fail(None, f"len({name})", len(value), f"expected G = len(problem_sizes) = {num_groups}")

    # Order: problem sizes, then structure/dtypes/layouts of every group, devices last
    sizes = [_check_problem_size(g, problem_sizes[g]) for g in range(num_groups)]
    group_tensors = []
    for g, (m, n, k, _l) in enumerate(sizes):
        if not isinstance(abc[g], (tuple, list)) or len(abc[g]) != 3:
            _fail(g, "abc[g]", type(abc[g]).__name__, "expected a 3-tuple (a, b, c)", TypeError)
        if not isinstance(sfasfb[g], (tuple, list)) or len(sfasfb[g]) != 2:
            _fail(g, "sfasfb[g]", type(sfasfb[g]).__name__, "expected a 2-tuple (sfa, sfb)", TypeError)
        if not isinstance(sfasfb_reordered[g], (tuple, list)) or len(sfasfb_reordered[g]) != 2:
            _fail(
                g,
                "sfasfb_reordered[g]",
                type(sfasfb_reordered[g]).__name__,
                "expected a 2-tuple (sfa_reordered, sfb_reordered)",
                TypeError,
            )
        tensors = {
            "a": abc[g][0],
            "b": abc[g][1],
            "c": abc[g][2],
            "sfa_reordered": sfasfb_reordered[g][0],
            "sfb_reordered": sfasfb_reordered[g][1],
        }
        for field, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                _fail(g, f"type({field})", type(tensor).__name__, "expected a torch.Tensor", TypeError)
            want_dtype, why = _DTYPE_RULES[field]
            if tensor.dtype != want_dtype:
                _fail(g, f"{field}.dtype", tensor.dtype, f"expected {want_dtype} ({why})", TypeError)

        row_major = "row-major, unit stride along the last dimension"
        _check_layout(g, "a", tensors["a"], (m, k // 2, 1), (k // 2, 1, m * k // 2), row_major)
        _check_layout(g, "b", tensors["b"], (n, k // 2, 1), (k // 2, 1, n * k // 2), row_major)
        _check_layout(g, "c", tensors["c"], (m, n, 1), (n, 1, m * n), row_major)
        official = "official reordered scale layout (32, 4, rest, 4, rest_k, 1)"
        _check_layout(
            g, "sfa_reordered", tensors["sfa_reordered"],
            reordered_scale_shape(m, k), reordered_scale_strides(m, k), official,
        )
        _check_layout(
            g, "sfb_reordered", tensors["sfb_reordered"],
            reordered_scale_shape(n, k), reordered_scale_strides(n, k), official,
        )
        group_tensors.append(tensors)

    device = None
    for g, tensors in enumerate(group_tensors):
        for field, tensor in tensors.items():
            if require_cuda and tensor.device.type != "cuda":
                _fail(
                    g,
                    f"{field}.device",
                    str(tensor.device),
                    "every tensor must be on a CUDA device (the kernel reads device memory)",
                )
            if device is None:
                device = tensor.device
            elif tensor.device != device:
                _fail(g, f"{field}.device", str(tensor.device), f"expected {device} like group 0's a")
    return tuple(sizes)


# const_data_ptr: the same address as data_ptr, without the mutable-data bookkeeping (the key
# reads 5G pointers on every call; EXPERIMENTS E59)
data_address = getattr(torch.Tensor, "const_data_ptr", torch.Tensor.data_ptr)
flatten = itertools.chain.from_iterable


def input_key(data) -> tuple:
    """Cache key of an input set: the data pointers of every a, b, c (group by group), then
    of every reordered sfa, sfb.

    Built from the raw input on every call, so it holds only what must be hashed:
      * the device is implied: under CUDA's unified virtual addressing a device pointer
        identifies its allocation process-wide (and the backend follows the device);
      * the problem sizes are not hashed: a hit compares them with the plan's validated
        sizes (hashing 4G more ints per call cost more than the comparison).
    With G = 8 the 40 data_ptr() calls are most of its cost. Raises on malformed input.
    """
    abc, _, sfasfb_reordered, _ = data
    return (*map(data_address, flatten(abc)), *map(data_address, flatten(sfasfb_reordered)))


@functools.lru_cache(maxsize=4096)
def _scale_layout(mn: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) of the official reordered scale tensor of mn rows and K (pure)."""
    return reordered_scale_shape(mn, k), reordered_scale_strides(mn, k)


def _accepted_device(device: torch.device) -> bool:
    return device.type == "cuda"


_SEQUENCE_TYPES = (tuple, list)


def _loose_layout(tensor: torch.Tensor, shape: tuple, strides: tuple) -> bool:
    """_check_layout's rule without its errors: the shape, and the strides of modes of extent
    above 1."""
    return tensor.shape == shape and all(
        extent <= 1 or got == want for extent, got, want in zip(shape, tensor.stride(), strides))


def accepted_problem_sizes(data, key: tuple) -> tuple[tuple[int, int, int, int], ...] | None:
    """validate_inputs' verdict where every rule holds in its strictest form, at a fraction of
    its cost (a MoE step validates new sizes on every call): the sizes when the structure is
    right, every dtype, shape and stride is exactly the official layout's (also on modes of
    extent 1), every tensor is on group 0's CUDA device and every pointer of `key`
    (input_key) is 32-byte aligned; None otherwise, and the full rules decide (with their
    error, or accepting what is valid only in their looser form). EXPERIMENTS E65."""
    try:
        abc, sfasfb, reordered, problem_sizes = data
        num_groups = len(problem_sizes)
        if (not 1 <= num_groups <= MAX_GROUPS or not isinstance(problem_sizes, _SEQUENCE_TYPES)
                or not isinstance(abc, _SEQUENCE_TYPES) or not isinstance(sfasfb, _SEQUENCE_TYPES)
                or not isinstance(reordered, _SEQUENCE_TYPES)
                or len(abc) != num_groups or len(sfasfb) != num_groups or len(reordered) != num_groups):
            return None
        device = abc[0][0].device
        if not _accepted_device(device) or any(pointer & (BASE_ALIGN_BYTES - 1) for pointer in key):
            return None
        index = abc[0][0].get_device()
        fp4, e4m3 = torch.float4_e2m1fn_x2, torch.float8_e4m3fn
        sizes = []
        for size, group, plain, scales in zip(problem_sizes, abc, sfasfb, reordered):
            if (not isinstance(size, _SEQUENCE_TYPES) or not isinstance(group, _SEQUENCE_TYPES)
                    or not isinstance(plain, _SEQUENCE_TYPES) or not isinstance(scales, _SEQUENCE_TYPES)
                    or len(plain) != 2):
                return None
            m, n, k, l = size
            a, b, c = group
            sfa, sfb = scales
            if (type(m) is not int or type(n) is not int or type(k) is not int or type(l) is not int
                    or l != 1 or k <= 0 or k % K_TILE or n <= 0 or m < 0):
                return None
            half_k = k // 2
            sfa_shape, sfa_strides = _scale_layout(m, k)
            sfb_shape, sfb_strides = _scale_layout(n, k)
            if m == 0:  # no rows: a, c and sfa have strides of their own on the empty modes
                a_strides, c_strides, sfa_strides = a.stride(), c.stride(), sfa.stride()
                if not (_loose_layout(a, (0, half_k, 1), (half_k, 1, 0))
                        and _loose_layout(c, (0, n, 1), (n, 1, 0))
                        and _loose_layout(sfa, sfa_shape, _scale_layout(0, k)[1])):
                    return None
            else:
                a_strides, c_strides = (half_k, 1, m * half_k), (n, 1, m * n)
            # a, b, c, sfa and sfb are tensors: `key` holds their data pointers
            if not (
                a.dtype == fp4 and a.shape == (m, half_k, 1) and a.stride() == a_strides
                and b.dtype == fp4 and b.shape == (n, half_k, 1) and b.stride() == (half_k, 1, n * half_k)
                and c.dtype == torch.float16 and c.shape == (m, n, 1) and c.stride() == c_strides
                and sfa.dtype == e4m3 and sfa.shape == sfa_shape and sfa.stride() == sfa_strides
                and sfb.dtype == e4m3 and sfb.shape == sfb_shape and sfb.stride() == sfb_strides
                and a.get_device() == index and b.get_device() == index and c.get_device() == index
                and sfa.get_device() == index and sfb.get_device() == index
            ):
                return None
            sizes.append((m, n, k, 1))
    except Exception:  # noqa: BLE001 - malformed input: the full rules name what is wrong
        return None
    return tuple(sizes)


def checked_problem_sizes(data, key: tuple) -> tuple[tuple[int, int, int, int], ...]:
    """validate_inputs' result for an input set of input_key `key`: accepted_problem_sizes
    where it accepts, else the full rules (which raise their errors)."""
    problem_sizes = accepted_problem_sizes(data, key)
    return validate_inputs(data) if problem_sizes is None else problem_sizes


def checked_input(data, key: tuple | None) -> tuple[tuple, tuple[tuple[int, int, int, int], ...]]:
    """(input_key, the validated sizes) of an input set whose key the hit path computed, or
    could not (None: malformed input, which validate_inputs then names)."""
    if key is None:
        try:
            key = input_key(data)
        except Exception:
            validate_inputs(data)  # names what is wrong
            raise
    return key, checked_problem_sizes(data, key)


def pointers_of_key(key: tuple, num_groups: int) -> list[tuple[int, int, int, int, int]]:
    """pointers_of from input_key's pointers (a, b, c of every group, then sfa, sfb of every
    group), without reading the tensors again: per group (a, b, c, sfa, sfb)."""
    abc, scales = key[: 3 * num_groups], key[3 * num_groups:]
    return [(*abc[3 * g: 3 * g + 3], *scales[2 * g: 2 * g + 2]) for g in range(num_groups)]
