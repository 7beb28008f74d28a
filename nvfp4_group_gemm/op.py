"""custom_kernel as the torch op ``torch.ops.nvfp4_group_gemm.grouped_gemm``."""


import operator

import torch

from nvfp4_group_gemm import core

from .moe import exact_moe_call, moe_grouped_gemm
from .runtime import custom_kernel, validate_inputs

input_t = core.input_t
output_t = core.output_t
exact_decode_group_gemm = core.exact_decode_group_gemm


# Registered with torch.library so that torch.compile(fullgraph=True) traces a function that
# calls it without a graph break: it mutates the c tensors and returns nothing, its fake
# implementation does nothing (the outputs exist already). On CUDA tensors it is
# custom_kernel; on CPU tensors (tracing, tests) the exact decode, after the same validation
# (every rule but the CUDA device's: a bad input raises custom_kernel's error, c untouched).
def _op_input_set(a, b, c, sfa, sfb, sfa_reordered, sfb_reordered, problem_sizes):
    groups = len(a)
    return (
        list(zip(a, b, c)), list(zip(sfa, sfb)), list(zip(sfa_reordered, sfb_reordered)),
        [tuple(problem_sizes[4 * g : 4 * g + 4]) for g in range(groups)],
    )


def _grouped_gemm_cuda(a: list[torch.Tensor], b: list[torch.Tensor], c: list[torch.Tensor],
                       sfa: list[torch.Tensor], sfb: list[torch.Tensor], sfa_reordered: list[torch.Tensor],
                       sfb_reordered: list[torch.Tensor], problem_sizes: list[int]) -> None:
    custom_kernel(_op_input_set(a, b, c, sfa, sfb, sfa_reordered, sfb_reordered, problem_sizes))


def _grouped_gemm_cpu(a, b, c, sfa, sfb, sfa_reordered, sfb_reordered, problem_sizes) -> None:
    data = _op_input_set(a, b, c, sfa, sfb, sfa_reordered, sfb_reordered, problem_sizes)
    validate_inputs(data, require_cuda=False)
    exact_decode_group_gemm(data, list(c))


# Each op is defined by its schema on one torch.library.Library, its Python kernels registered
# on the CUDA and CPU keys and its fake beside them: the dispatcher calls the kernel directly.
# torch.library.custom_op's wrapper (its autograd and view handling in Python) cost 87-117 µs a
# call where this costs 4-7 (a CPU, torch 2.13: bench/op_dispatch.py, EXPERIMENTS E94): a MoE
# layer calls the op four times. The schemas are the ones custom_op inferred from the kernels' signatures.
_LIBRARY = torch.library.Library("nvfp4_group_gemm", "FRAGMENT")  # kept: its registrations live with it
GROUPED_GEMM_SCHEMA = ("grouped_gemm(Tensor[] a, Tensor[] b, Tensor(a2!)[] c, Tensor[] sfa, Tensor[] sfb, "
                       "Tensor[] sfa_reordered, Tensor[] sfb_reordered, SymInt[] problem_sizes) -> ()")
MOE_GROUPED_GEMM_SCHEMA = ("moe_grouped_gemm(Tensor a, Tensor? sfa, Tensor b, Tensor sfb, Tensor offsets, "
                           "Tensor(a5!) c, Tensor(a6!) status, Tensor? alpha=None, Tensor? a_rows=None, "
                           "Tensor? c_rows=None, str? activation=None, str? b_layout=None) -> ()")


def _define_op(schema: str, cuda_kernel, cpu_kernel):
    """torch.ops.nvfp4_group_gemm.<name>.default of `schema`, once per process (a second import
    of this file under another module name finds it defined)."""
    name = schema.split("(", 1)[0]
    try:
        _LIBRARY.define(schema)
    except RuntimeError:  # defined by an earlier import of this file
        return getattr(torch.ops.nvfp4_group_gemm, name).default
    _LIBRARY.impl(name, cuda_kernel, "CUDA")
    _LIBRARY.impl(name, cpu_kernel, "CPU")
    torch.library.register_fake(f"nvfp4_group_gemm::{name}", lambda *args, **kwargs: None, lib=_LIBRARY)
    return getattr(torch.ops.nvfp4_group_gemm, name).default


grouped_gemm_op = _define_op(GROUPED_GEMM_SCHEMA, _grouped_gemm_cuda, _grouped_gemm_cpu)


def grouped_gemm(data: input_t) -> output_t:
    """custom_kernel through the torch op (the same input and result): what a
    torch.compile'd model calls."""
    try:
        abc, sfasfb, sfasfb_reordered, problem_sizes = data
        # operator.index, not int: a float size is custom_kernel's TypeError, not truncated
        sizes = [operator.index(v) for size in problem_sizes for v in size]
        if len(problem_sizes) != len(abc) or len(sizes) != 4 * len(abc):
            raise ValueError("the flat sizes would be read at the wrong places")  # validation names the field
        grouped_gemm_op(
            [a for a, _, _ in abc], [b for _, b, _ in abc], [c for _, _, c in abc],
            [sfa for sfa, _ in sfasfb], [sfb for _, sfb in sfasfb],
            [sfa for sfa, _ in sfasfb_reordered], [sfb for _, sfb in sfasfb_reordered], sizes,
        )
    except Exception:
        # malformed input fails in the unpacking or in torch's parsing of the op's arguments:
        # custom_kernel's validation names the field (the device rule aside: the op's kernels
        # check it); any other error is the op's own
        validate_inputs(data, require_cuda=False)
        raise
    return [c for _, _, c in abc]


# The MoE entry as torch.ops.nvfp4_group_gemm.moe_grouped_gemm(a, sfa, b, sfb, offsets, c,
# status, alpha=None, a_rows=None, c_rows=None, activation=None, b_layout=None) (sfa None: bf16 activations,
# W4A16; the row maps and SwiGLU of moe.py's docstring): mutates c and the status word (int32 [1]: 0, or 1 for bad offsets),
# returns nothing; the fake implementation does nothing; on CPU tensors the exact decode
# (moe.exact_moe_call: the entry's validation, then it reads the offsets on the host, as only a
# reference may, and flags bad ones in status as the GPU does). status is
# required: a mutated optional argument left out fails torch 2.11's fake-tensor tracing.
def _moe_cuda(a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor, offsets: torch.Tensor,
              c: torch.Tensor, status: torch.Tensor, alpha: torch.Tensor | None = None,
              a_rows: torch.Tensor | None = None, c_rows: torch.Tensor | None = None,
              activation: str | None = None, b_layout: str | None = None) -> None:
    moe_grouped_gemm(a, sfa, b, sfb, offsets, c, status=status, alpha=alpha, a_rows=a_rows, c_rows=c_rows,
                     activation=activation, b_layout=b_layout)


def _moe_cpu(a, sfa, b, sfb, offsets, c, status, alpha=None, a_rows=None, c_rows=None, activation=None,
             b_layout=None) -> None:
    exact_moe_call(a, sfa, b, sfb, offsets, c, status, alpha, a_rows, c_rows, activation, b_layout)


moe_grouped_gemm_op = _define_op(MOE_GROUPED_GEMM_SCHEMA, _moe_cuda, _moe_cpu)
