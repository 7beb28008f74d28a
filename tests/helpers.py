"""Input builders and shapes shared by several test files (import them from here, never from
another test file): CPU tensors laid out like reference.generate_input's, edits of one tensor
or one problem size of an input, the invalid inputs every checker must reject with the
reference's message, and the competition's benchmark problem sizes."""

import torch

from reference import generate_input

# The competition's four benchmark shapes: per group (M, N, K, L).
BENCHMARK_SIZES = {
    0: list(zip([80, 176, 128, 72, 64, 248, 96, 160], [4096] * 8, [7168] * 8, [1] * 8)),
    1: list(zip([40, 76, 168, 72, 164, 148, 196, 160], [7168] * 8, [2048] * 8, [1] * 8)),
    2: list(zip([192, 320], [3072] * 2, [4096] * 2, [1] * 2)),
    3: list(zip([128, 384], [4096] * 2, [1536] * 2, [1] * 2)),
}


def fp4_operand(rows, k):
    """[rows, K/2, 1] float4_e2m1fn_x2, values in {0, ±0.5, ±1, ±1.5} (as the generator's)."""
    raw = torch.randint(0, 256, (1, rows, k // 2), dtype=torch.uint8) & 0b1011_1011
    return raw.permute(1, 2, 0).view(torch.float4_e2m1fn_x2)


def reordered_scales(mn, k):
    """[32, 4, ceil(mn/128), 4, ceil(K/64), 1] float8_e4m3fn scales (1 or 2), the blocked
    layout seen through the generator's permute."""
    rest_mn = (mn + 127) // 128
    rest_k = (k // 16 + 3) // 4
    base = torch.randint(1, 3, (1, rest_mn, rest_k, 32, 4, 4), dtype=torch.int8).to(torch.float8_e4m3fn)
    return base.permute(3, 4, 1, 5, 2, 0)


def make_inputs(problem_sizes):
    """CPU tensors laid out exactly like the official generator's (reference.generate_input)
    for the given (M, N, K, L) sizes; any sizes (the bad ones too), no seed."""
    abc, sfasfb, sfasfb_reordered = [], [], []
    for m, n, k, _l in problem_sizes:
        c = torch.randn((1, m, n), dtype=torch.float16).permute(1, 2, 0)
        abc.append((fp4_operand(m, k), fp4_operand(n, k), c))
        sfa = torch.randint(1, 3, (1, m, k // 16), dtype=torch.int8).to(torch.float8_e4m3fn).permute(1, 2, 0)
        sfb = torch.randint(1, 3, (1, n, k // 16), dtype=torch.int8).to(torch.float8_e4m3fn).permute(1, 2, 0)
        sfasfb.append((sfa, sfb))
        sfasfb_reordered.append((reordered_scales(m, k), reordered_scales(n, k)))
    return (abc, sfasfb, sfasfb_reordered, [tuple(p) for p in problem_sizes])


def small_input():
    """Two CPU groups from the reference generator: (40, 64, 256) and (72, 128, 512)."""
    return generate_input((40, 72), (64, 128), (256, 512), 2, seed=31, device="cpu")


TENSOR_FIELDS = ("a", "b", "c", "sfa", "sfb", "sfa_reordered", "sfb_reordered")


def replace_tensor(data, group, field, tensor):
    """A copy of input `data` (its lists rebuilt, the tensors shared) with `field` of `group`
    (one of TENSOR_FIELDS) replaced by `tensor`."""
    abc, sfasfb, reordered = ([list(x) for x in data[i]] for i in range(3))
    where = {"a": (abc, 0), "b": (abc, 1), "c": (abc, 2), "sfa": (sfasfb, 0), "sfb": (sfasfb, 1),
             "sfa_reordered": (reordered, 0), "sfb_reordered": (reordered, 1)}
    lists, index = where[field]
    lists[group][index] = tensor
    return ([tuple(x) for x in abc], [tuple(x) for x in sfasfb], [tuple(x) for x in reordered],
            list(data[3]))


def with_size(data, group, size):
    """A copy of input `data` whose problem size of `group` is `size` (the tensors shared)."""
    sizes = list(data[3])
    sizes[group] = size
    return (data[0], data[1], data[2], sizes)


# name -> (edit of small_input(), error, the reference's exact message)
INVALID_INPUTS = {
    "L = 2": (lambda d: with_size(d, 1, (72, 128, 512, 2)), ValueError,
              "group 1: L = 2; rule: L must be 1 (one batch per group)"),
    "lists disagree": (lambda d: (d[0][:1], d[1], d[2], d[3]), ValueError,
                       "input: len(abc) = 1; rule: expected G = len(problem_sizes) = 2"),
    "more problem sizes": (lambda d: (d[0], d[1], d[2], d[3] + [(8, 64, 256, 1)]), ValueError,
                           "input: len(abc) = 2; rule: expected G = len(problem_sizes) = 3"),
    "no group": (lambda d: ([], [], [], []), ValueError,
                 "input: len(problem_sizes) = 0; rule: expected 1 <= G <= 64"),
    "3-tuple": (lambda d: (d[0], d[1], d[3]), TypeError,
                ("input: len(data) = 3; rule: expected the 4-tuple (abc, sfasfb, "
                "sfasfb_reordered, problem_sizes)")),
    "K not a multiple of 256": (lambda d: with_size(d, 1, (72, 128, 384, 1)), ValueError,
                                ("group 1: K = 384; rule: K must be a positive multiple of 256 "
                                "(the task's contract)")),
    "N = 0": (lambda d: with_size(d, 1, (72, 0, 512, 1)), ValueError,
              "group 1: N = 0; rule: N must be >= 1"),
    "M < 0": (lambda d: with_size(d, 1, (-1, 128, 512, 1)), ValueError,
              "group 1: M = -1; rule: M must be >= 0"),
    "M as a float": (lambda d: with_size(d, 1, (72.0, 128, 512, 1)), TypeError,
                     "group 1: problem_sizes[g].M = 72.0; rule: expected an integer"),
    "sizes disagree with a": (lambda d: with_size(d, 1, (73, 128, 512, 1)), ValueError,
                              ("group 1: a.shape = (72, 256, 1); rule: expected (73, 256, 1) "
                              "(a is [M, K/2, L])")),
    "sfb shape": (lambda d: replace_tensor(d, 1, "sfb", d[1][1][1][:64]), ValueError,
                  ("group 1: sfb.shape = (64, 32, 1); rule: expected (128, 32, 1) "
                  "(sfb is [N, K/16, L])")),
    "c dtype": (lambda d: replace_tensor(d, 1, "c", d[0][1][2].float()), TypeError,
                "group 1: c.dtype = torch.float32; rule: expected torch.float16 (fp16 output)"),
    "a not a tensor": (lambda d: replace_tensor(d, 1, "a", [1, 2]), TypeError,
                       "group 1: type(a) = 'list'; rule: expected a torch.Tensor"),
    "b on another device": (lambda d: replace_tensor(d, 1, "b", d[0][1][1].to("meta")), ValueError,
                            "group 1: b.device = 'meta'; rule: expected cpu like group 0's a"),
}
