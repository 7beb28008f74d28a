"""NVFP4 block-scaled grouped GEMM for every caller beyond the leaderboard.

``core`` holds the sm_100a kernels and the host core every entry shares (validation, the
fallback chain and its self-check, the caches, the prepared launches); bundled, it is the B200
leaderboard file ``submission.py`` (``python -m nvfp4_group_gemm.bundle``), which imports
nothing else of this package. The rest of the package builds on it with what real callers
need:

* ``custom_kernel(data)``: the same input and result as the leaderboard file's, launched on the
  caller's current stream, on a B200 (the file's sm_100a kernels, ``sm100``) or an H100/H200
  (the Hopper kernels, ``hopper``); callers' CUDA-graph capture, threads on their own streams,
  graph replay of a bound input set, first calls launched from staged tables (``runtime``);
* ``warmup(n, k, groups)``: compile a (G, N, K) family before serving;
* ``grouped_gemm(data)`` / ``grouped_gemm_op``: the torch op ``torch.ops.nvfp4_group_gemm.grouped_gemm``
  (``torch.compile(fullgraph=True)`` traces it);
* ``moe_grouped_gemm(a, sfa, b, sfb, offsets, c)`` / ``moe_grouped_gemm_op``: a MoE layer's
  entry, stacked tokens with int32 group offsets on the GPU, no host read of the sizes, one CUDA
  graph for every routing (``moe``; Hopper);
* ``examples/library_submission.py``: this package's entry as a harness submission.
"""

__version__ = "0.2.0"

from .moe import (
    blocked_scales,
    check_moe_inputs,
    check_status,
    moe_grouped_gemm,
    moe_reference,
    prepare_weight_scales,
    swiglu_weights,
)
from .op import grouped_gemm, grouped_gemm_op, moe_grouped_gemm_op
from .runtime import (
    bind_input_set,
    custom_kernel,
    reset_runtime,
    run_with_backend,
    select_backend,
    warmup,
)

__all__ = [
    "__version__",
    "bind_input_set",
    "blocked_scales",
    "check_moe_inputs",
    "check_status",
    "custom_kernel",
    "grouped_gemm",
    "grouped_gemm_op",
    "moe_grouped_gemm",
    "moe_grouped_gemm_op",
    "moe_reference",
    "prepare_weight_scales",
    "reset_runtime",
    "run_with_backend",
    "select_backend",
    "swiglu_weights",
    "warmup",
]
