# GPU MODE nvfp4_group_gemm leaderboard file: the rooms of nvfp4_group_gemm/core/, bundled by
# `python -m nvfp4_group_gemm.bundle`. Edit those modules and bundle again; the tests fail
# while this file differs from the bundle.
"""NVFP4 block-scaled grouped GEMM for GPU MODE's ``nvfp4_group_gemm`` (NVIDIA B200, sm_100a).

For every group ``i`` this computes, in one launch for all groups,

    C_i[M_i, N_i] = (A_i * SFA_i) @ (B_i * SFB_i)^T        (fp32 accumulate, fp16 output)

where A_i / B_i hold packed float4 e2m1 values (two per byte, low nibble first) and SFA_i /
SFB_i hold one float8 e4m3 scale per 16 consecutive K elements, read from the "reordered"
scale tensors (cuBLAS 32x4x4 blocked layout).

Input (``task.input_t``): ``(abc, sfasfb, sfasfb_reordered, problem_sizes)`` with
``abc[i] = (a [M,K/2,1], b [N,K/2,1], c [M,N,1])``, ``sfasfb_reordered[i] =
(sfa [32,4,ceil(M/128),4,ceil(K/64),1], sfb [32,4,ceil(N/128),4,ceil(K/64),1])`` and
``problem_sizes[i] = (M, N, K, L)``. The kernel writes every ``c`` and returns them as a list.

Constraints (checked by ``validate_inputs`` before any launch; outputs stay untouched on error):
  * 1 <= G <= 64 groups
  * L == 1, K a positive multiple of 256 (the K tile), N >= 1, M >= 0 (M = 0 groups are skipped)
  * a/b: torch.float4_e2m1fn_x2, c: torch.float16, reordered scales: torch.float8_e4m3fn
  * a, b, c row-major with unit stride along K (a, b) or N (c); reordered scales with the
    official strides (a permuted view of a contiguous tensor); base addresses 32-byte aligned
  * every tensor on the same CUDA device

Kernel design (sm_100a), two kernels selected by ``SM100_KERNEL`` (below):
  * ``PersistentGemmSm100`` (default): swap-AB on a 2-CTA pair. The problem's B (N rows) is
    the MMA's A with MMA M = 256 (128 N rows per CTA), the tokens (problem M rows) are the
    MMA's N (128 or 256 per tile, ``choose_tokens_per_tile``), and C is written through its
    (N, M):(1, N) view by TMA stores. 192 threads, one CTA per SM: warps 0-3 epilogue, warp 4
    MMA (``tcgen05.mma.cta_group::2.kind::mxf4nvf4``, issued by the pair's leader), warp 5
    TMA; ``PipelineTmaUmma`` with as many stages as shared memory holds (7 / 5),
    ``PipelineUmmaAsync`` with two TMEM accumulators (128 tokens) so a tile's epilogue
    overlaps the next tile's mainloop; the tokens' scales are multicast to both CTAs. Static
    persistent schedule over a host-built tile list (``plan_persistent_tiles``: groups by
    descending M, then N slice, then token tile, so the clusters of a wave share B's N slice).
    Input sets with an N that is not a multiple of 8 (C's TMA row stride) use the per-tile
    kernel.
  * ``gemm_kernel`` (the per-tile fallback, the seed's structure): one CTA per 128x128 output
    tile; warp 0 drives TMA and the 1-CTA block-scaled MMA (2 stages); all 4 warps run the
    epilogue TMEM -> registers -> global (256-bit stores on full tiles when N % 16 == 0,
    predicated scalar stores elsewhere).
  * Descriptors: an init kernel (one CTA per group) writes every group's TMA descriptors into
    a device buffer once per pointer set (five per group for the persistent kernel: its A, B,
    SFA, SFB and C; four for the per-tile kernel, which does not need C's). A call whose
    pointers the runtime has seen launches only the GEMM; updating descriptors in the kernel
    instead would put a descriptor write and proxy fence on every CTA's path at every group
    change of every call. Each warp that uses a descriptor acquires it
    (``fence.proxy.tensormap::generic.acquire``) and prefetches it before its first use.
  * Chained calls (``SM100_CHAIN_CALLS``, on by default): every kernel is launched as the
    programmatic dependent of the kernel before it, waits (``griddepcontrol.wait``) before its
    first global access in every warp role and lets the next call launch once its CTAs hold
    their TMEM, so that a call's launch and set-up overlap the previous call's end.
  * Host side, two levels of state: a ``Plan`` per (device, problem sizes, backend) holds
    the tile rows, the device table of sizes and tiles and the backend's plan (compiled
    kernel, CTA pairs), shared by every input set of those sizes (bounded by count and
    bytes); a ``Binding`` per input set (its data pointers) holds the pointer table, the TMA
    descriptors and the prepared launch (bounded LRU). A hit is one launch; a new pointer set
    of known sizes pays the pointer checks, its pointer table and descriptors.
  * All GPU work is queued where the harness calls from and times: the DSL's launches are
    given nowhere else to go, and the tables are torch copies.
  * Each size set runs the first kernel of the chain that is not demoted (persistent ->
    per-tile -> torch._scaled_mm). A compile failure, a failed launch with the context
    usable, or a first-use self-check that disagrees with the oracle (at the competition's
    tolerance, widened only by what fp32 accumulation may add: ``accumulation_bounds``)
    demotes the kernel for the process, with one line on stderr; the call still returns a
    correct result (NVFP4_SELF_CHECK=0: no check).

This package is the library's core (``nvfp4_group_gemm.core``) and, bundled by ``python -m
nvfp4_group_gemm.bundle`` into ``submission.py``, the leaderboard submission: it stands alone
(torch, cutlass, ``task``, the standard library). Everything else a caller may need (Hopper
sm_90a kernels, callers' own queues of work, graph capture, threads, a torch op) is the rest
of the ``nvfp4_group_gemm`` package, which builds on this one; on a GPU other than sm_100
``custom_kernel`` says so in one line.

Its rooms, in dependency order (``ROOMS``: each imports only rooms before it, and the bundle
is their concatenation in this order, their imports of each other dropped):
  * ``config``: the NVFP4_* switches, the sm_100a constants, the compile cache;
  * ``validation``: ``validate_inputs`` and its fast path, ``input_key``;
  * ``device_helpers``, ``per_tile``, ``persistent``: the sm_100a kernels;
  * ``chain``: ``KernelChoice``, the demotions, ``choose_kernel``/``demote``;
  * ``launching``: prepared launches, device tables, ``RuntimeCache``, ``Plan``/``Binding``;
  * ``self_check``: the first-use self-check and the host computations (the oracles);
  * ``backend``: the builds, the kernel registry, ``Sm100Backend``;
  * ``runtime``: plans and bindings per input set, ``custom_kernel``, ``warmup``.
``nvfp4_group_gemm.core`` holds every name of every room (``core.X``, as in the one file), and
setting ``core.X`` sets X in every room that holds it: the one namespace the bundle has.

Status: both sm_100a kernels are compiled for sm_100a and checked from their cubin, SASS and
PTX, and the persistent kernel's pipeline protocol by a model (``tests/``); neither has run
on a B200.

Run: ``python eval.py test tests/cases/...`` (harness), ``python eval.py selfcheck`` (on a GPU:
every kernel of the chain checked and timed), or ``python eval.py compile`` (any machine, no
GPU: builds every kernel for its target and prints its resources).
"""

import collections
import collections.abc
import contextlib
import dataclasses
import functools
import itertools
import math
import operator
import os
import struct
import sys
import threading
import typing
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

import cutlass
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
import torch
from cutlass import cute, pipeline, utils
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cute.runtime import make_ptr
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

try:  # the leaderboard's runner and this repository have the task's task.py; an installed package has not
    from task import input_t, output_t
except ImportError:
    input_t = output_t = tuple


# =============================================================================
# nvfp4_group_gemm/core/config.py
# The leaderboard file's switches, the sm_100a constants, and the compile cache.
#
# Every NVFP4_* switch of the leaderboard file is read here, once, at import (``env_switch``).
# ``SM100_CHAIN_CALLS`` lives with the two readers that must see it change under
# ``chain_calls_as``: ``chained_launch`` (the traced launches) and ``compile_key`` (the cache
# key), so a build under one setting is never found under the other.
# =============================================================================
# The operands' major mode: cute.nvgpu.OperandMajorMode from DSL 4.4 on, where tcgen05's own is
# deprecated; DSL 4.3.5 (the competition's runner) has only tcgen05's.
OPERAND_MAJOR_MODE = getattr(cute.nvgpu, "OperandMajorMode", None) or tcgen05.OperandMajorMode


def env_switch(name: str, allowed: tuple[str, ...] | None, default: str) -> str:
    """The value of environment switch `name`, one of `allowed` (`default` when unset; any
    value where allowed is None: a name its reader checks); ValueError naming the allowed
    values otherwise. Every NVFP4_* switch is read through it."""
    value = os.environ.get(name, default)
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(allowed)}")
    return value


# =============================================================================
# Which sm_100a kernel runs
# =============================================================================
# "persistent": PersistentGemmSm100 (warp-specialized, 2-CTA block-scaled MMA, swap-AB,
#   static persistent schedule, TMA-store epilogue); input sets it cannot run (an N that is
#   not a multiple of 8) go to the per-tile kernel.
# "per_tile": the seed-structure kernel (one CTA per 128x128 tile, one warp issuing TMA and
#   MMA, 2 stages) for every input set: the known-good fallback.
# Both are compiled for sm_100a and checked on a CPU (SASS, PTX, a protocol model); neither has
# run here. If the default fails on a B200, set this to "per_tile" (or run with the
# environment variable NVFP4_SM100_KERNEL=per_tile).
SM100_KERNELS = ("persistent", "per_tile")
SM100_KERNEL = env_switch("NVFP4_SM100_KERNEL", SM100_KERNELS, "persistent")

# Calls chained by programmatic dependent launch (PDL). "1" (default): every sm_100a kernel
# (both GEMMs and their descriptor-init kernels) is launched as the programmatic dependent of
# the kernel before it (the DSL's use_pdl), so that a call's launch, CTA start, barrier init,
# TMEM allocation and pipeline set-up overlap the end of the kernel before it. Each kernel
# waits (griddepcontrol.wait) before its first global memory access and lets the next call
# launch (griddepcontrol.launch_dependents) once its CTAs hold what they need (the kernels
# say where). "0": plain launches. The device code is the same either way: both instructions
# do nothing in a grid launched without the attribute. Not measured on a B200 yet: `python
# eval.py selfcheck` times every sm_100 kernel both ways; bench/b200_model.py predicts it.
SM100_CHAIN_CALLS = env_switch("NVFP4_SM100_CHAIN_CALLS", ("0", "1"), "1") == "1"


@contextlib.contextmanager
def chain_calls_as(chained: bool | None):
    """SM100_CHAIN_CALLS set to `chained` (a link's KernelChoice.chained) while that link's
    kernels are compiled or looked up: the traced code reads it (chained_launch) and the compile
    keys carry it, so a chained and a plain build of one kernel are two entries. None:
    unchanged. Under RUNTIME_LOCK: no other thread sees the switch changed."""
    global SM100_CHAIN_CALLS
    if chained is None or chained == SM100_CHAIN_CALLS:
        yield
        return
    with RUNTIME_LOCK:
        saved = SM100_CHAIN_CALLS
        SM100_CHAIN_CALLS = chained
        try:
            yield
        finally:
            SM100_CHAIN_CALLS = saved


def chained_launch() -> dict:
    """The launch option of every sm_100a kernel (read when its entry is traced; the compile
    keys carry SM100_CHAIN_CALLS): the programmatic-dependent attribute where calls chain."""
    return {"use_pdl": SM100_CHAIN_CALLS}


# =============================================================================
# Constants
# =============================================================================
# K extent of one k-tile of every sm_100 kernel (and the K multiple validate_inputs asks for)
K_TILE = 256
SM100_ARCH = "sm_100a"

ab_dtype = cutlass.Float4E2M1FN
sf_dtype = cutlass.Float8E4M3FN
c_dtype = cutlass.Float16
# One float8 scale per 16 fp4 values along K
sf_vec_size = 16
# TMA descriptors are 128 bytes each
bytes_per_tensormap = 128

# The per-tile kernel's constants (its device code reads them at trace time)
# NVFP4 UMMA requires M-mode 128 for a single CTA (cta_group::1)
mma_tiler_mnk = (128, 128, K_TILE)
# K of one tcgen05.mma.kind::mxf4nvf4 instruction
mma_inst_shape_k = 64
threads_per_cta = 128
num_acc_stage = 1
# Two smem stages: 2 x 36 KiB (A 16 KiB + B 16 KiB + SFA 2 KiB + SFB 2 KiB)
num_ab_stage = 2
# A power of two, a multiple of 32 and <= 512
num_tmem_alloc_cols = 512
# Its descriptors: A, B, SFA, SFB
num_tensormaps = 4

# Columns of the per-group pointer table (Binding.ptrs)
PTR_A, PTR_B, PTR_C, PTR_SFA, PTR_SFB = range(5)
NUM_PTR_COLS = 5

MAX_GROUPS = 64
# fp16 elements in 32 bytes: the per-tile kernel's full-tile stores are 256-bit when N is a
# multiple of this
C_VECTOR_ELEMS = 16
# Every tensor is addressed as `ptr.align(32)` in the kernels (TMA needs 16 B at least).
BASE_ALIGN_BYTES = 32
# Devices the submission has a backend for: capability -> backend name
SUPPORTED_GPUS = "NVIDIA B200/GB200 (sm_100, compute capability 10.x)"


def ceil_div(a, b):
    return (a + b - 1) // b


# =============================================================================
# Host code (Python): compile caches, the sm_100 backend
# =============================================================================
def fake_ptr(dtype):
    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)


# Every build of every backend, by compile_key
_COMPILED: dict = {}
# Module switches the traced kernels read as they are built: their values join every key
TRACE_SWITCHES = ("SM100_CHAIN_CALLS",)


def compile_key(build: Callable[..., tuple], args: tuple, options: str | None) -> tuple:
    """What a compiled kernel depends on, derived from the call rather than typed at it: the
    build (module and qualified name), every argument the build takes, the DSL options, and the
    value of each module switch the traced code reads (TRACE_SWITCHES)."""
    switches = globals()
    return (build.__module__, build.__qualname__, args, options,
            tuple((name, switches[name]) for name in TRACE_SWITCHES))


def compile_once(build: Callable[..., tuple], *args, options: str | None = None, context=contextlib.nullcontext):
    """cute.compile of what build(*args) returns, (function, example arguments), once per
    compile_key(build, args, options), inside `context()`; the DSL's options passed only where
    given. A build is a module-level function: it sees only its arguments, all of them in the
    key (a lambda or a closure could bake in what the key does not hold, and is refused).
    Every build of every backend goes through here."""
    if build.__name__ == "<lambda>" or build.__closure__:
        raise TypeError(f"compile_once: build {build.__qualname__} must be a module-level function (what it closes "
                        "over would not be in the compile key)")
    key = compile_key(build, args, options)
    compiled = _COMPILED.get(key)
    if compiled is None:
        fn, example = build(*args)
        with context():
            compiled = _COMPILED[key] = cute.compile(fn, *example, **({"options": options} if options else {}))
    return compiled
FORCE_PLAIN_LAUNCH = env_switch("NVFP4_PLAIN_LAUNCH", ("0", "1"), "0") == "1"


# =============================================================================
# Fallback chain and self-check (both backends)
# =============================================================================
# Every backend names a chain of kernels per size set, best first (kernel_chain): on sm_100
# the persistent kernel, the per-tile kernel, torch._scaled_mm; on sm_90 the automatic
# choice, the in-GEMM-decode kernel, the exact decode. A kernel that fails to compile, fails
# its launch (with the context still usable) or disagrees with the oracle at its first use is
# demoted for the rest of the process: one line on stderr, and its plans run the next link.
# A hang cannot be caught in-process.
# NVFP4_SELF_CHECK=0: no first-use check (it costs one oracle computation and a comparison per
# compiled kernel, at its first input set).
SELF_CHECK = env_switch("NVFP4_SELF_CHECK", ("0", "1"), "1") == "1"
# One thread at a time through compilation (the DSL's session state is not thread-safe), the
# caches' misses and demotions; a hit takes no lock
RUNTIME_LOCK = threading.RLock()


# =============================================================================
# nvfp4_group_gemm/core/validation.py
# Validation: every constraint of the input, checked before anything is launched.
#
# ``validate_inputs`` names the group, the field, the value and the rule of the first violation
# (ValueError or TypeError); ``accepted_problem_sizes`` is its fast verdict for input sets in
# the official layout, and ``checked_input`` the miss path's entry to both. ``input_key``: an
# input set's cache key (its data pointers).
# =============================================================================
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


# =============================================================================
# nvfp4_group_gemm/core/device_helpers.py
# Device helpers of both sm_100a kernels: TMA descriptor addresses, the tensormap
# fences and prefetch, and the grid-dependency instructions of chained calls.
# =============================================================================
# =============================================================================
# Device code: tensormap initialization (one CTA per group)
# =============================================================================
def tensormap_desc_ptr(tensormap_manager, tensormaps: cute.Tensor, group_idx, slot: int):
    """Generic-address pointer to descriptor `slot` of `group_idx` in `tensormaps` [G, S, 16],
    as the TMA copies take it."""
    return tensormap_manager.get_tensormap_ptr(
        tensormap_manager.get_tensormap_ptr(tensormaps[(group_idx, slot, None)].iterator),
        cute.AddressSpace.generic,
    )


@dsl_user_op
def fence_proxy_async_shared_cta(*, loc=None, ip=None) -> None:
    """``fence.proxy.async.shared::cta``: this thread's generic-proxy shared-memory writes
    become visible to the async proxy (the TMA store that reads them).

    DSL compatibility: 4.3.5 (the runner's) takes the nvvm enums ``cute.arch.ProxyKind`` /
    ``cute.arch.SharedSpace``; 4.8.1 no longer exports them and takes string literals."""
    if hasattr(cute.arch, "ProxyKind"):  # DSL 4.3.5
        cute.arch.fence_proxy(
            cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta, loc=loc, ip=ip
        )
    else:  # DSL 4.8.1
        cute.arch.fence_proxy("async.shared", space="cta", loc=loc, ip=ip)


@dsl_user_op
def prefetch_tensormap(desc_ptr: cute.Pointer, *, loc=None, ip=None) -> None:
    """``prefetch.tensormap``: bring a TMA descriptor (generic address) into the descriptor
    cache before its first copy, instead of on that copy's path.

    DSL compatibility: 4.3.5 (the runner's) has ``nvvm.prefetch_tensormap``; 4.8.1 has no
    such op and takes ``nvvm.prefetch(..., tensormap=True)``."""
    if hasattr(nvvm, "prefetch_tensormap"):  # DSL 4.3.5
        nvvm.prefetch_tensormap(desc_ptr.llvm_ptr, loc=loc, ip=ip)
    else:  # DSL 4.8.1: the generic prefetch with the tensormap flag
        nvvm.prefetch(desc_ptr.llvm_ptr, tensormap=True, loc=loc, ip=ip)


def acquire_tensormap(desc_ptr: cute.Pointer) -> None:
    """Make a descriptor that another kernel wrote (the init kernel) safe for this thread's
    TMA: ``fence.proxy.tensormap::generic.acquire.gpu`` on its address, then
    ``prefetch.tensormap``. A buffer evicted from the descriptor cache and allocated again
    gets the same address with new contents; without the acquire a stale cached descriptor
    could load from, or store to, the old tensors. Issued by each warp that uses the
    descriptor, before its first use (an acquire orders only its own thread's accesses)."""
    cpasync.fence_tma_desc_acquire(desc_ptr)
    prefetch_tensormap(desc_ptr)


def wait_for_previous_grid() -> None:
    """``griddepcontrol.wait``: the kernels before this grid have completed and their memory
    writes are visible (returns at once in a grid launched without the PDL attribute). Every
    thread that touches global memory (loads, stores, descriptor acquires and prefetches, TMA)
    issues it first: only shared memory, barriers and TMEM may be set up before it."""
    cute.arch.griddepcontrol_wait()


def launch_dependents() -> None:
    """``griddepcontrol.launch_dependents``: the next call's grid may launch once every CTA of
    this one has issued it or exited (repeats in a CTA add nothing). Where each kernel issues
    it, and why there, is stated at the call."""
    cute.arch.griddepcontrol_launch_dependents()


def group_tensormap_gmem_ptrs(tensormap_manager, tensormaps: cute.Tensor, group_idx):
    """Global-memory pointers of the A, B, SFA, SFB descriptors of `group_idx` in
    `tensormaps` [G, 4, 16] (written by the init kernel, read by the GEMM kernel)."""
    return tuple(
        tensormap_manager.get_tensormap_ptr(tensormaps[(group_idx, slot, None)].iterator)
        for slot in range(num_tensormaps)
    )


# =============================================================================
# nvfp4_group_gemm/core/per_tile.py
# The per-tile sm_100a kernel (the known-good fallback): one CTA per 128x128 output tile.
#
# Device code (``init_tensormaps_kernel``: every group's TMA descriptors, one CTA per group;
# ``gemm_kernel``: warp 0 drives TMA and the 1-CTA block-scaled MMA, all 4 warps run the
# epilogue), then the host side (``@cute.jit`` entries ``init_tensormaps_jit``, ``gemm_jit``,
# and the launch helpers the library's entries share: ``per_tile_init_launch``,
# ``per_tile_gemm_launch``).
# =============================================================================
@cute.kernel
def init_tensormaps_kernel(
    tma_atom_a: cute.CopyAtom,
    tma_atom_b: cute.CopyAtom,
    tma_atom_sfa: cute.CopyAtom,
    tma_atom_sfb: cute.CopyAtom,
    tensor_of_ptrs: cute.Tensor,  # [G, 5] int64: a, b, c, sfa, sfb
    tensor_of_problem_sizes: cute.Tensor,  # [G, 4] int32: m, n, k, l
    tensormaps: cute.Tensor,  # [G, 4, 16] int64: descriptors of a, b, sfa, sfb
):
    """Write the A/B/SFA/SFB TMA descriptors of group `blockIdx.z` into `tensormaps`."""
    warp_idx = cute.arch.warp_idx()
    warp_idx = cute.arch.make_warp_uniform(warp_idx)
    _, _, group_idx = cute.arch.block_idx()

    # Chained calls (SM100_CHAIN_CALLS): the sizes and pointers are read, and the descriptors
    # written (a buffer the previous GEMM may still read), after the previous kernel is done.
    # The GEMM after this kernel may launch at once: it holds nothing this kernel needs (no
    # TMEM here, a few KB of shared memory) and reads the descriptors only after its own wait.
    wait_for_previous_grid()
    launch_dependents()

    m = tensor_of_problem_sizes[group_idx, 0]
    n = tensor_of_problem_sizes[group_idx, 1]
    k = tensor_of_problem_sizes[group_idx, 2]
    l = cutlass.Int32(1)

    size_tensormap_in_i64 = num_tensormaps * bytes_per_tensormap // 8

    # Deviation from the seed: the descriptor staging buffer is aligned to 128 B (the seed's
    # plain MemRange[Int64] is only 8-byte aligned, which DSL releases from 4.6 on reject;
    # a TMA descriptor must sit on a 64 B boundary anyway).
    @cute.struct
    class SharedStorage:
        tensormap_buffer: cute.struct.Align[
            cute.struct.MemRange[cutlass.Int64, size_tensormap_in_i64], 128
        ]

    smem = utils.SmemAllocator()
    storage = smem.allocate(SharedStorage)

    tensormap_smem_ptr = storage.tensormap_buffer.data_ptr()
    tensormap_a_smem_ptr = tensormap_smem_ptr
    tensormap_b_smem_ptr = tensormap_a_smem_ptr + bytes_per_tensormap // 8
    tensormap_sfa_smem_ptr = tensormap_b_smem_ptr + bytes_per_tensormap // 8
    tensormap_sfb_smem_ptr = tensormap_sfa_smem_ptr + bytes_per_tensormap // 8

    #
    # Destination of the descriptors in global memory
    #
    tensormap_manager = utils.TensorMapManager(utils.TensorMapUpdateMode.SMEM, 128)
    (
        tensormap_a_gmem_ptr,
        tensormap_b_gmem_ptr,
        tensormap_sfa_gmem_ptr,
        tensormap_sfb_gmem_ptr,
    ) = group_tensormap_gmem_ptrs(tensormap_manager, tensormaps, group_idx)

    #
    # The group's real tensors
    #
    mA_mkl_iter = cute.make_ptr(
        ab_dtype, tensor_of_ptrs[group_idx, PTR_A], cute.AddressSpace.gmem
    ).align(32)
    mB_nkl_iter = cute.make_ptr(
        ab_dtype, tensor_of_ptrs[group_idx, PTR_B], cute.AddressSpace.gmem
    ).align(32)
    sfa_mkl_iter = cute.make_ptr(
        sf_dtype, tensor_of_ptrs[group_idx, PTR_SFA], cute.AddressSpace.gmem
    ).align(32)
    sfb_nkl_iter = cute.make_ptr(
        sf_dtype, tensor_of_ptrs[group_idx, PTR_SFB], cute.AddressSpace.gmem
    ).align(32)
    # (M, K, L) and (N, K, L), K-major, in fp4 elements
    mA_mkl_layout = cute.make_layout(
        (m, k, l),
        stride=(cute.assume(k, 32), 1, cute.assume(m * k, 32)),
    )
    mB_nkl_layout = cute.make_layout(
        (n, k, l),
        stride=(cute.assume(k, 32), 1, cute.assume(n * k, 32)),
    )

    # Scale factors layout (cuBLAS block-scaling-factors layout):
    # https://docs.nvidia.com/cuda/cublas/index.html?highlight=fp4#d-block-scaling-factors-layout
    atom_shape = ((32, 4), (sf_vec_size, 4))
    atom_stride = ((16, 4), (0, 1))
    sfa_layout = cute.tile_to_shape(
        cute.make_layout(atom_shape, stride=atom_stride),
        mA_mkl_layout.shape,
        (2, 1, 3),
    )
    sfb_layout = cute.tile_to_shape(
        cute.make_layout(atom_shape, stride=atom_stride),
        mB_nkl_layout.shape,
        (2, 1, 3),
    )
    real_tensor_a = cute.make_tensor(mA_mkl_iter, mA_mkl_layout)
    real_tensor_b = cute.make_tensor(mB_nkl_iter, mB_nkl_layout)
    real_tensor_sfa = cute.make_tensor(sfa_mkl_iter, sfa_layout)
    real_tensor_sfb = cute.make_tensor(sfb_nkl_iter, sfb_layout)

    #
    # Warp 0 builds the descriptors in smem and publishes them to global memory
    #
    if warp_idx == 0:
        tensormap_manager.init_tensormap_from_atom(tma_atom_a, tensormap_a_smem_ptr, 0)
        tensormap_manager.init_tensormap_from_atom(tma_atom_b, tensormap_b_smem_ptr, 0)
        tensormap_manager.init_tensormap_from_atom(tma_atom_sfa, tensormap_sfa_smem_ptr, 0)
        tensormap_manager.init_tensormap_from_atom(tma_atom_sfb, tensormap_sfb_smem_ptr, 0)

        tensormap_manager.update_tensormap(
            (real_tensor_a, real_tensor_b, real_tensor_sfa, real_tensor_sfb),
            (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb),
            (
                tensormap_a_gmem_ptr,
                tensormap_b_gmem_ptr,
                tensormap_sfa_gmem_ptr,
                tensormap_sfb_gmem_ptr,
            ),
            0,  # tma warp id
            (
                tensormap_a_smem_ptr,
                tensormap_b_smem_ptr,
                tensormap_sfa_smem_ptr,
                tensormap_sfb_smem_ptr,
            ),
        )
        # No acquire here: it would order only this thread's own later accesses. The
        # release above publishes the descriptors; the GEMM's TMA warp acquires them.

    cute.arch.barrier()


# =============================================================================
# Device code: block-scaled GEMM, one CTA per output tile
# =============================================================================
@cute.kernel
def gemm_kernel(
    tiled_mma: cute.TiledMma,
    tma_atom_a: cute.CopyAtom,
    mA_mkl: cute.Tensor,  # coordinate proxy; the real tensor is in the descriptor
    tma_atom_b: cute.CopyAtom,
    mB_nkl: cute.Tensor,
    tma_atom_sfa: cute.CopyAtom,
    mSFA_mkl: cute.Tensor,
    tma_atom_sfb: cute.CopyAtom,
    mSFB_nkl: cute.Tensor,
    tensor_of_ptrs: cute.Tensor,  # [G, 5] int64: a, b, c, sfa, sfb
    tensormaps: cute.Tensor,  # [G, 4, 16] int64, written by init_tensormaps_kernel
    tensor_of_problem_sizes: cute.Tensor,  # [G, 4] int32
    tensor_of_tiles: cute.Tensor,  # [T, 3] int32: (group, tile_m, tile_n)
    a_smem_layout_staged: cute.ComposedLayout,
    b_smem_layout_staged: cute.ComposedLayout,
    sfa_smem_layout_staged: cute.Layout,
    sfb_smem_layout_staged: cute.Layout,
    num_tma_load_bytes: cutlass.Constexpr[int],
):
    """Compute one 128x128 tile of C for the (group, tile_m, tile_n) of this CTA."""
    warp_idx = cute.arch.warp_idx()
    warp_idx = cute.arch.make_warp_uniform(warp_idx)
    tidx, _, _ = cute.arch.thread_idx()

    #
    # Shared storage
    #
    @cute.struct
    class SharedStorage:
        ab_mbar_ptr: cute.struct.MemRange[cutlass.Int64, num_ab_stage * 2]
        acc_mbar_ptr: cute.struct.MemRange[cutlass.Int64, num_acc_stage * 2]
        tmem_holding_buf: cutlass.Int32

    smem = utils.SmemAllocator()
    storage = smem.allocate(SharedStorage)

    # (MMA, MMA_M, MMA_K, STAGE)
    sA = smem.allocate_tensor(
        element_type=ab_dtype,
        layout=a_smem_layout_staged.outer,
        byte_alignment=128,
        swizzle=a_smem_layout_staged.inner,
    )
    # (MMA, MMA_N, MMA_K, STAGE)
    sB = smem.allocate_tensor(
        element_type=ab_dtype,
        layout=b_smem_layout_staged.outer,
        byte_alignment=128,
        swizzle=b_smem_layout_staged.inner,
    )
    # (MMA, MMA_M, MMA_K, STAGE)
    sSFA = smem.allocate_tensor(
        element_type=sf_dtype,
        layout=sfa_smem_layout_staged,
        byte_alignment=128,
    )
    # (MMA, MMA_N, MMA_K, STAGE)
    sSFB = smem.allocate_tensor(
        element_type=sf_dtype,
        layout=sfb_smem_layout_staged,
        byte_alignment=128,
    )

    #
    # Pipelines: TMA -> UMMA (A/B/SF stages), UMMA -> epilogue (accumulator)
    #
    ab_pipeline_producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
    ab_pipeline_consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
    ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
        barrier_storage=storage.ab_mbar_ptr.data_ptr(),
        num_stages=num_ab_stage,
        producer_group=ab_pipeline_producer_group,
        consumer_group=ab_pipeline_consumer_group,
        tx_count=num_tma_load_bytes,
    ).make_participants()
    acc_producer, acc_consumer = pipeline.PipelineUmmaAsync.create(
        barrier_storage=storage.acc_mbar_ptr.data_ptr(),
        num_stages=num_acc_stage,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, threads_per_cta),
    ).make_participants()

    #
    # MMA fragments
    #
    # (MMA, MMA_M, MMA_K, STAGE)
    tCrA = tiled_mma.make_fragment_A(sA)
    # (MMA, MMA_N, MMA_K, STAGE)
    tCrB = tiled_mma.make_fragment_B(sB)
    # (MMA, MMA_M, MMA_N)
    acc_shape = tiled_mma.partition_shape_C(mma_tiler_mnk[:2])
    tCtAcc_fake = tiled_mma.make_fragment_C(acc_shape)

    #
    # Allocate TMEM
    #
    tmem_alloc_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=threads_per_cta)
    tmem = utils.TmemAllocator(storage.tmem_holding_buf, barrier_for_retrieve=tmem_alloc_barrier)
    tmem.allocate(num_tmem_alloc_cols)
    tmem.wait_for_alloc()

    acc_tmem_ptr = tmem.retrieve_ptr(cutlass.Float32)
    # (MMA, MMA_M, MMA_N)
    tCtAcc = cute.make_tensor(acc_tmem_ptr, tCtAcc_fake.layout)

    #
    # SFA/SFB TMEM tensors, placed after the accumulator columns
    #
    sfa_tmem_ptr = cute.recast_ptr(
        acc_tmem_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc),
        dtype=sf_dtype,
    )
    # (MMA, MMA_M, MMA_K)
    tCtSFA_layout = blockscaled_utils.make_tmem_layout_sfa(
        tiled_mma,
        mma_tiler_mnk,
        sf_vec_size,
        cute.slice_(sfa_smem_layout_staged, (None, None, None, 0)),
    )
    tCtSFA = cute.make_tensor(sfa_tmem_ptr, tCtSFA_layout)
    sfb_tmem_ptr = cute.recast_ptr(
        acc_tmem_ptr
        + tcgen05.find_tmem_tensor_col_offset(tCtAcc)
        + tcgen05.find_tmem_tensor_col_offset(tCtSFA),
        dtype=sf_dtype,
    )
    # (MMA, MMA_N, MMA_K)
    tCtSFB_layout = blockscaled_utils.make_tmem_layout_sfb(
        tiled_mma,
        mma_tiler_mnk,
        sf_vec_size,
        cute.slice_(sfb_smem_layout_staged, (None, None, None, 0)),
    )
    tCtSFB = cute.make_tensor(sfb_tmem_ptr, tCtSFB_layout)

    #
    # S2T copy for SFs (smem -> TMEM)
    #
    copy_atom_s2t = cute.make_copy_atom(
        tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE),
        sf_dtype,
    )
    # (MMA, MMA_MN, MMA_K, STAGE)
    tCsSFA_compact = cute.filter_zeros(sSFA)
    # (MMA, MMA_MN, MMA_K)
    tCtSFA_compact = cute.filter_zeros(tCtSFA)
    tiled_copy_s2t_sfa = tcgen05.make_s2t_copy(copy_atom_s2t, tCtSFA_compact)
    thr_copy_s2t_sfa = tiled_copy_s2t_sfa.get_slice(0)
    # ((ATOM_V, REST_V), Rest_Tiler, MMA_MN, MMA_K, STAGE)
    tCsSFA_compact_s2t_ = thr_copy_s2t_sfa.partition_S(tCsSFA_compact)
    tCsSFA_compact_s2t = tcgen05.get_s2t_smem_desc_tensor(
        tiled_copy_s2t_sfa, tCsSFA_compact_s2t_
    )
    # ((ATOM_V, REST_V), Rest_Tiler, MMA_MN, MMA_K)
    tCtSFA_compact_s2t = thr_copy_s2t_sfa.partition_D(tCtSFA_compact)

    tCsSFB_compact = cute.filter_zeros(sSFB)
    tCtSFB_compact = cute.filter_zeros(tCtSFB)
    tiled_copy_s2t_sfb = tcgen05.make_s2t_copy(copy_atom_s2t, tCtSFB_compact)
    thr_copy_s2t_sfb = tiled_copy_s2t_sfb.get_slice(0)
    tCsSFB_compact_s2t_ = thr_copy_s2t_sfb.partition_S(tCsSFB_compact)
    tCsSFB_compact_s2t = tcgen05.get_s2t_smem_desc_tensor(
        tiled_copy_s2t_sfb, tCsSFB_compact_s2t_
    )
    tCtSFB_compact_s2t = thr_copy_s2t_sfb.partition_D(tCtSFB_compact)

    #
    # Chained calls (SM100_CHAIN_CALLS): everything above touches only this CTA's shared
    # memory, barriers and TMEM, so it overlaps the previous kernel. Once this CTA holds its
    # TMEM, the next call's grid may launch: a dependent CTA can sit beside this one (this
    # kernel fits two CTAs per SM) and allocates TMEM before its wait, so a trigger before
    # this CTA's allocation could let it take the 512 columns this CTA still waits for, then
    # wait for this grid to finish: a deadlock. The trigger takes effect once every CTA of
    # the grid has issued it (or exited): with the last wave resident and holding its TMEM.
    #
    launch_dependents()
    # Every global access follows the wait, by every thread: the tile table, the sizes and
    # pointers, the descriptors (warp 0's acquire), A/B/scales (TMA) and C (all warps' stores;
    # a caller may hand the same c to consecutive calls).
    wait_for_previous_grid()

    #
    # This CTA's tile, from the tile table
    #
    bidx, _, _ = cute.arch.block_idx()
    group_idx = tensor_of_tiles[bidx, 0]
    coord_x = tensor_of_tiles[bidx, 1]
    coord_y = tensor_of_tiles[bidx, 2]

    m = tensor_of_problem_sizes[group_idx, 0]
    n = tensor_of_problem_sizes[group_idx, 1]
    k = tensor_of_problem_sizes[group_idx, 2]

    #
    # C of this group, (M, N, L) row-major
    #
    mC_mnl_iter = cute.make_ptr(
        c_dtype, tensor_of_ptrs[group_idx, PTR_C], cute.AddressSpace.gmem
    ).align(32)
    # No divisibility promise on the row stride here: validate_inputs accepts any N >= 1. The
    # full-tile store below states it only where N keeps it.
    mC_mnl_layout = cute.make_layout((m, n, 1), stride=(n, 1, m * n))
    mC_mnl = cute.make_tensor(mC_mnl_iter, mC_mnl_layout)
    # (bM, bN)
    gC_mnl = cute.local_tile(
        mC_mnl, cute.slice_(mma_tiler_mnk, (None, None, 0)), (coord_x, coord_y, 0)
    )

    #
    # Proxy tiles
    #
    # (bM, bK, RestM, RestK, RestL)
    gA_mkl = cute.local_tile(
        mA_mkl, cute.slice_(mma_tiler_mnk, (None, 0, None)), (None, None, None)
    )
    # (bN, bK, RestN, RestK, RestL)
    gB_nkl = cute.local_tile(
        mB_nkl, cute.slice_(mma_tiler_mnk, (0, None, None)), (None, None, None)
    )
    # (bM, bK, RestM, RestK, RestL)
    gSFA_mkl = cute.local_tile(
        mSFA_mkl, cute.slice_(mma_tiler_mnk, (None, 0, None)), (None, None, None)
    )
    # (bN, bK, RestN, RestK, RestL)
    gSFB_nkl = cute.local_tile(
        mSFB_nkl, cute.slice_(mma_tiler_mnk, (0, None, None)), (None, None, None)
    )
    thr_mma = tiled_mma.get_slice(tidx)
    # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
    tCgA = thr_mma.partition_A(gA_mkl)
    # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
    tCgB = thr_mma.partition_B(gB_nkl)
    # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
    tCgSFA = thr_mma.partition_A(gSFA_mkl)
    # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
    tCgSFB = thr_mma.partition_B(gSFB_nkl)
    # (MMA, MMA_M, MMA_N)
    tCgC = thr_mma.partition_C(gC_mnl)

    #
    # Prebuilt descriptors of this group
    #
    tensormap_manager = utils.TensorMapManager(utils.TensorMapUpdateMode.SMEM, 128)
    (
        tensormap_a_gmem_ptr,
        tensormap_b_gmem_ptr,
        tensormap_sfa_gmem_ptr,
        tensormap_sfb_gmem_ptr,
    ) = group_tensormap_gmem_ptrs(tensormap_manager, tensormaps, group_idx)
    tma_desc_a = tensormap_manager.get_tensormap_ptr(
        tensormap_a_gmem_ptr, cute.AddressSpace.generic
    )
    tma_desc_b = tensormap_manager.get_tensormap_ptr(
        tensormap_b_gmem_ptr, cute.AddressSpace.generic
    )
    tma_desc_sfa = tensormap_manager.get_tensormap_ptr(
        tensormap_sfa_gmem_ptr, cute.AddressSpace.generic
    )
    tma_desc_sfb = tensormap_manager.get_tensormap_ptr(
        tensormap_sfb_gmem_ptr, cute.AddressSpace.generic
    )

    #
    # TMA partitions
    #
    # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestM, RestK, RestL)
    tAsA, tAgA = cpasync.tma_partition(
        tma_atom_a,
        0,
        cute.make_layout(1),
        cute.group_modes(sA, 0, 3),
        cute.group_modes(tCgA, 0, 3),
    )
    # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestN, RestK, RestL)
    tBsB, tBgB = cpasync.tma_partition(
        tma_atom_b,
        0,
        cute.make_layout(1),
        cute.group_modes(sB, 0, 3),
        cute.group_modes(tCgB, 0, 3),
    )
    # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestM, RestK, RestL)
    tAsSFA, tAgSFA = cpasync.tma_partition(
        tma_atom_sfa,
        0,
        cute.make_layout(1),
        cute.group_modes(sSFA, 0, 3),
        cute.group_modes(tCgSFA, 0, 3),
    )
    tAsSFA = cute.filter_zeros(tAsSFA)
    tAgSFA = cute.filter_zeros(tAgSFA)
    # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestN, RestK, RestL)
    tBsSFB, tBgSFB = cpasync.tma_partition(
        tma_atom_sfb,
        0,
        cute.make_layout(1),
        cute.group_modes(sSFB, 0, 3),
        cute.group_modes(tCgSFB, 0, 3),
    )
    tBsSFB = cute.filter_zeros(tBsSFB)
    tBgSFB = cute.filter_zeros(tBgSFB)

    # K tiles. validate_inputs guarantees K % 256 == 0, so this division is exact (the seed
    # truncated K silently here).
    k_tile_cnt = k // cutlass.Int32(mma_tiler_mnk[2])

    # Fix tile coords so that later we index only by k_tile
    # ((atom_v, rest_v), RestK)
    tAgA = tAgA[(None, coord_x, None, 0)]
    tBgB = tBgB[(None, coord_y, None, 0)]
    tAgSFA = tAgSFA[(None, coord_x, None, 0)]
    tBgSFB = tBgSFB[(None, coord_y, None, 0)]

    #
    # Mainloop (warp 0): num_ab_stage-deep TMA prefetch, SF smem -> TMEM, block-scaled UMMA
    #
    if warp_idx == 0:
        # Descriptors written by the init kernel: acquired and fetched before the first copy
        for tma_desc in (tma_desc_a, tma_desc_b, tma_desc_sfa, tma_desc_sfb):
            acquire_tensormap(tma_desc)
        acc_empty = acc_producer.acquire_and_advance()
        tiled_mma.set(tcgen05.Field.ACCUMULATE, False)

        # Prologue: issue the first num_ab_stage K tiles
        for pre_k in range(num_ab_stage):
            if pre_k < k_tile_cnt:
                ab_empty = ab_producer.acquire_and_advance()
                stage = ab_empty.index
                cute.copy(tma_atom_a, tAgA[(None, pre_k)], tAsA[(None, stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_a)
                cute.copy(tma_atom_b, tBgB[(None, pre_k)], tBsB[(None, stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_b)
                cute.copy(tma_atom_sfa, tAgSFA[(None, pre_k)], tAsSFA[(None, stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_sfa)
                cute.copy(tma_atom_sfb, tBgSFB[(None, pre_k)], tBsSFB[(None, stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_sfb)

        # Steady state
        for k_tile in range(k_tile_cnt):
            ab_full = ab_consumer.wait_and_advance()
            stage = ab_full.index

            # SFs of this stage: smem -> TMEM
            s2t_stage_coord = (None, None, None, None, stage)
            cute.copy(tiled_copy_s2t_sfa, tCsSFA_compact_s2t[s2t_stage_coord], tCtSFA_compact_s2t)
            cute.copy(tiled_copy_s2t_sfb, tCsSFB_compact_s2t[s2t_stage_coord], tCtSFB_compact_s2t)

            # tCtAcc += tCrA * tCtSFA * tCrB * tCtSFB
            num_kblocks = cute.size(tCrA, mode=[2])
            for kblock_idx in cutlass.range(num_kblocks, unroll_full=True):
                kblock_coord = (None, None, kblock_idx, stage)
                sf_kblock_coord = (None, None, kblock_idx)

                tiled_mma.set(tcgen05.Field.SFA, tCtSFA[sf_kblock_coord].iterator)
                tiled_mma.set(tcgen05.Field.SFB, tCtSFB[sf_kblock_coord].iterator)

                cute.gemm(
                    tiled_mma,
                    tCtAcc,
                    tCrA[kblock_coord],
                    tCrB[kblock_coord],
                    tCtAcc,
                )
                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)

            ab_full.release()

            # Refill: issue K tile (k_tile + num_ab_stage)
            next_k = k_tile + cutlass.Int32(num_ab_stage)
            if next_k < k_tile_cnt:
                ab_empty = ab_producer.acquire_and_advance()
                refill_stage = ab_empty.index
                cute.copy(tma_atom_a, tAgA[(None, next_k)], tAsA[(None, refill_stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_a)
                cute.copy(tma_atom_b, tBgB[(None, next_k)], tBsB[(None, refill_stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_b)
                cute.copy(tma_atom_sfa, tAgSFA[(None, next_k)], tAsSFA[(None, refill_stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_sfa)
                cute.copy(tma_atom_sfb, tBgSFB[(None, next_k)], tBsSFB[(None, refill_stage)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=tma_desc_sfb)

        acc_empty.commit()

    #
    # Epilogue (all warps): TMEM -> registers -> global, predicated on the M/N residues
    #
    op = tcgen05.Ld32x32bOp(tcgen05.Repetition.x128, tcgen05.Pack.NONE)
    copy_atom_t2r = cute.make_copy_atom(op, cutlass.Float32)
    tiled_copy_t2r = tcgen05.make_tmem_copy(copy_atom_t2r, tCtAcc[None, 0, 0])
    thr_copy_t2r = tiled_copy_t2r.get_slice(tidx)

    # (TmemCpy, NumTmemCpy)
    tDtAcc = thr_copy_t2r.partition_S(tCtAcc[None, 0, 0])
    # (TmemCpy, NumTmemCpy)
    tDgC = thr_copy_t2r.partition_D(tCgC[None, 0, 0])

    tDrAcc = cute.make_rmem_tensor(tDgC.shape, cutlass.Float32)
    tDrC = cute.make_rmem_tensor(tDgC.shape, c_dtype)

    tmem.relinquish_alloc_permit()
    acc_full = acc_consumer.wait_and_advance()

    cute.copy(tiled_copy_t2r, tDtAcc, tDrAcc)
    tDrC.store(tDrAcc.load().to(c_dtype))

    simt_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), c_dtype, num_bits_per_copy=16)
    thread_layout = cute.make_layout((1, threads_per_cta), stride=(threads_per_cta, 1))
    value_layout = cute.make_layout((1, 1))
    tiled_copy_r2g = cute.make_tiled_copy_tv(simt_atom, thread_layout, value_layout)
    thr_copy_r2g = tiled_copy_r2g.get_slice(tidx)
    cC = cute.make_identity_tensor(gC_mnl.shape)
    # ((atom_v, rest_v), NumGmemCpy)
    tDcC = thr_copy_r2g.partition_D(cC)

    # The same C tile with its rows stated to start on 32-byte boundaries: each thread's 128
    # contiguous fp16 then go out as 256-bit stores (the seed's STG.E.ENL2.256). Used only
    # where N % C_VECTOR_ELEMS == 0 makes the statement true.
    mC_aligned = cute.make_tensor(
        mC_mnl_iter,
        cute.make_layout(
            (m, n, 1), stride=(cute.assume(n, C_VECTOR_ELEMS), 1, cute.assume(m * n, C_VECTOR_ELEMS))
        ),
    )
    gC_aligned = cute.local_tile(
        mC_aligned, cute.slice_(mma_tiler_mnk, (None, None, 0)), (coord_x, coord_y, 0)
    )
    tDgC_aligned = thr_copy_t2r.partition_D(thr_mma.partition_C(gC_aligned)[None, 0, 0])

    residue_m = mC_mnl.shape[0] - cutlass.Int32(coord_x) * cutlass.Int32(mma_tiler_mnk[0])
    residue_n = mC_mnl.shape[1] - cutlass.Int32(coord_y) * cutlass.Int32(mma_tiler_mnk[1])

    # Full tiles (most of them) store without predicates
    if residue_m >= cutlass.Int32(mma_tiler_mnk[0]) and residue_n >= cutlass.Int32(mma_tiler_mnk[1]):
        if n % C_VECTOR_ELEMS == 0:
            cute.copy(simt_atom, cute.flatten(tDrC), cute.flatten(tDgC_aligned))
        else:
            cute.copy(simt_atom, cute.flatten(tDrC), cute.flatten(tDgC))
    else:
        tDpC = cute.make_rmem_tensor(tDrC.shape, cutlass.Boolean)
        for i in range(cute.size(tDrC.shape)):
            # tDcC is (n, m) ordered: compare against (residue_n, residue_m)
            tDpC[i] = cute.elem_less(tDcC[i], (residue_n, residue_m))
        cute.copy(simt_atom, cute.flatten(tDrC), cute.flatten(tDgC), pred=cute.flatten(tDpC))

    acc_full.release()
    cute.arch.barrier()
    tmem.free(acc_tmem_ptr)


# =============================================================================
# Host code (JIT): TMA atoms, smem layouts, launches
# =============================================================================
def _make_mma_and_atoms():
    """Tiled MMA, staged smem layouts and TMA atoms shared by both JIT wrappers.

    The atoms are built from fake (64, 64) tensors at a null address: their shapes, strides
    and addresses are replaced by the per-group descriptors at run time.
    """
    min_shape = (cutlass.Int32(64), cutlass.Int32(64), cutlass.Int32(1))

    def fake_operand():
        return cute.make_tensor(
            cute.make_ptr(ab_dtype, 0, cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout(
                (min_shape[0], cute.assume(min_shape[1], 32), min_shape[2]),
                stride=(
                    cute.assume(min_shape[1], 32),
                    1,
                    cute.assume(min_shape[0] * min_shape[1], 32),
                ),
            ),
        )

    initial_a = fake_operand()
    initial_b = fake_operand()
    # ((Atom_M, Rest_M), (Atom_K, Rest_K), RestL)
    sfa_layout = blockscaled_utils.tile_atom_to_shape_SF(initial_a.shape, sf_vec_size)
    sfb_layout = blockscaled_utils.tile_atom_to_shape_SF(initial_b.shape, sf_vec_size)
    initial_sfa = cute.make_tensor(
        cute.make_ptr(sf_dtype, 0, cute.AddressSpace.gmem, assumed_align=16), sfa_layout
    )
    initial_sfb = cute.make_tensor(
        cute.make_ptr(sf_dtype, 0, cute.AddressSpace.gmem, assumed_align=16), sfb_layout
    )

    mma_op = tcgen05.MmaMXF4NVF4Op(
        sf_dtype,
        (mma_tiler_mnk[0], mma_tiler_mnk[1], mma_inst_shape_k),
        tcgen05.CtaGroup.ONE,
        tcgen05.OperandSource.SMEM,
    )
    tiled_mma = cute.make_tiled_mma(mma_op)
    cluster_layout_vmnk = cute.tiled_divide(
        cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,)
    )

    a_smem_layout_staged = sm100_utils.make_smem_layout_a(
        tiled_mma, mma_tiler_mnk, ab_dtype, num_ab_stage
    )
    b_smem_layout_staged = sm100_utils.make_smem_layout_b(
        tiled_mma, mma_tiler_mnk, ab_dtype, num_ab_stage
    )
    sfa_smem_layout_staged = blockscaled_utils.make_smem_layout_sfa(
        tiled_mma, mma_tiler_mnk, sf_vec_size, num_ab_stage
    )
    sfb_smem_layout_staged = blockscaled_utils.make_smem_layout_sfb(
        tiled_mma, mma_tiler_mnk, sf_vec_size, num_ab_stage
    )
    a_smem_layout = cute.slice_(a_smem_layout_staged, (None, None, None, 0))
    b_smem_layout = cute.slice_(b_smem_layout_staged, (None, None, None, 0))
    sfa_smem_layout = cute.slice_(sfa_smem_layout_staged, (None, None, None, 0))
    sfb_smem_layout = cute.slice_(sfb_smem_layout_staged, (None, None, None, 0))

    tma_atom_a, tma_tensor_a = cute.nvgpu.make_tiled_tma_atom_A(
        cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE),
        initial_a, a_smem_layout,
        mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape,
    )
    tma_atom_b, tma_tensor_b = cute.nvgpu.make_tiled_tma_atom_B(
        cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE),
        initial_b, b_smem_layout,
        mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape,
    )
    tma_atom_sfa, tma_tensor_sfa = cute.nvgpu.make_tiled_tma_atom_A(
        cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE),
        initial_sfa, sfa_smem_layout,
        mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape,
        internal_type=cutlass.Int16,
    )
    tma_atom_sfb, tma_tensor_sfb = cute.nvgpu.make_tiled_tma_atom_B(
        cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE),
        initial_sfb, sfb_smem_layout,
        mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape,
        internal_type=cutlass.Int16,
    )

    atom_thr_size = cute.size(tiled_mma.thr_id.shape)
    num_tma_load_bytes = (
        cute.size_in_bytes(ab_dtype, a_smem_layout)
        + cute.size_in_bytes(ab_dtype, b_smem_layout)
        + cute.size_in_bytes(sf_dtype, sfa_smem_layout)
        + cute.size_in_bytes(sf_dtype, sfb_smem_layout)
    ) * atom_thr_size

    return {
        "tiled_mma": tiled_mma,
        "atoms": (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb),
        "proxies": (tma_tensor_a, tma_tensor_b, tma_tensor_sfa, tma_tensor_sfb),
        "smem_layouts": (
            a_smem_layout_staged,
            b_smem_layout_staged,
            sfa_smem_layout_staged,
            sfb_smem_layout_staged,
        ),
        "num_tma_load_bytes": num_tma_load_bytes,
    }


def tensormap_table(ptr_of_tensormaps, num_groups, num_slots):
    """[G, num_slots, 16] int64: the 128-byte TMA descriptors of every group."""
    return cute.make_tensor(
        ptr_of_tensormaps,
        cute.make_layout((num_groups, num_slots, 16), stride=(num_slots * 16, 16, 1)),
    )


def tensors_of_group(ptr_of_ptrs, ptr_of_sizes, num_groups):
    tensor_of_ptrs = cute.make_tensor(
        ptr_of_ptrs, cute.make_layout((num_groups, NUM_PTR_COLS), stride=(NUM_PTR_COLS, 1))
    )
    tensor_of_problem_sizes = cute.make_tensor(
        ptr_of_sizes, cute.make_layout((num_groups, 4), stride=(4, 1))
    )
    return tensor_of_ptrs, tensor_of_problem_sizes


def per_tile_init_launch(ptr_of_ptrs, ptr_of_sizes, ptr_of_tensormaps, num_groups):
    """The per-tile kernel's descriptor init, traced inside a @cute.jit entry: (the kernel to
    launch, its launch geometry). The entry below launches it as the harness calls; the
    library's entries reuse it and add where the launch goes."""
    tensor_of_ptrs, tensor_of_problem_sizes = tensors_of_group(ptr_of_ptrs, ptr_of_sizes, num_groups)
    tensormaps = cute.make_tensor(
        ptr_of_tensormaps,
        cute.make_layout((num_groups, num_tensormaps, 16), stride=(num_tensormaps * 16, 16, 1)),
    )
    setup = _make_mma_and_atoms()
    kernel = init_tensormaps_kernel(
        *setup["atoms"],
        tensor_of_ptrs,
        tensor_of_problem_sizes,
        tensormaps,
    )
    return kernel, {"grid": (1, 1, num_groups), "block": [threads_per_cta, 1, 1], "cluster": (1, 1, 1),
                    **chained_launch()}


@cute.jit
def init_tensormaps_jit(
    ptr_of_ptrs: cute.Pointer,
    ptr_of_sizes: cute.Pointer,
    ptr_of_tensormaps: cute.Pointer,
    num_groups: cutlass.Int32,
):
    kernel, geometry = per_tile_init_launch(ptr_of_ptrs, ptr_of_sizes, ptr_of_tensormaps, num_groups)
    kernel.launch(**geometry)


def per_tile_gemm_launch(ptr_of_ptrs, ptr_of_sizes, ptr_of_tiles, ptr_of_tensormaps, num_tiles, num_groups):
    """The per-tile GEMM, traced inside a @cute.jit entry: (the kernel to launch, its launch
    geometry), as per_tile_init_launch."""
    tensor_of_ptrs, tensor_of_problem_sizes = tensors_of_group(ptr_of_ptrs, ptr_of_sizes, num_groups)
    tensormaps = cute.make_tensor(
        ptr_of_tensormaps,
        cute.make_layout((num_groups, num_tensormaps, 16), stride=(num_tensormaps * 16, 16, 1)),
    )
    tensor_of_tiles = cute.make_tensor(
        ptr_of_tiles, cute.make_layout((num_tiles, 3), stride=(3, 1))
    )
    setup = _make_mma_and_atoms()
    tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb = setup["atoms"]
    tma_tensor_a, tma_tensor_b, tma_tensor_sfa, tma_tensor_sfb = setup["proxies"]
    kernel = gemm_kernel(
        setup["tiled_mma"],
        tma_atom_a, tma_tensor_a,
        tma_atom_b, tma_tensor_b,
        tma_atom_sfa, tma_tensor_sfa,
        tma_atom_sfb, tma_tensor_sfb,
        tensor_of_ptrs,
        tensormaps,
        tensor_of_problem_sizes,
        tensor_of_tiles,
        *setup["smem_layouts"],
        setup["num_tma_load_bytes"],
    )
    # Deviation from the seed: tiles run along grid x (up to 2^31 - 1 CTAs) instead of grid z
    # (at most 65535), so no tile count the tables allow can overflow the grid.
    return kernel, {"grid": (num_tiles, 1, 1), "block": [threads_per_cta, 1, 1], "cluster": (1, 1, 1),
                    **chained_launch()}


@cute.jit
def gemm_jit(
    ptr_of_ptrs: cute.Pointer,
    ptr_of_sizes: cute.Pointer,
    ptr_of_tiles: cute.Pointer,
    ptr_of_tensormaps: cute.Pointer,
    num_tiles: cutlass.Int32,
    num_groups: cutlass.Int32,
):
    kernel, geometry = per_tile_gemm_launch(
        ptr_of_ptrs, ptr_of_sizes, ptr_of_tiles, ptr_of_tensormaps, num_tiles, num_groups
    )
    kernel.launch(**geometry)


# =============================================================================
# nvfp4_group_gemm/core/persistent.py
# The persistent sm_100a kernel: warp-specialized, 2-CTA block-scaled MMA, swap-AB.
#
# ``PersistentGemmConfig`` (what is baked into a build), ``PersistentGemmSm100`` (its
# ``can_implement``, the host set-up of its launches, the descriptor-init and GEMM kernels),
# and the shared-memory budget of one pipeline stage (``persistent_stage_bytes``).
# =============================================================================
# =============================================================================
# sm_100a persistent kernel: warp-specialized, 2-CTA block-scaled MMA, swap-AB
# =============================================================================
# Swap-AB: the problem's B (N rows, the large weight operand) is the MMA's A operand with
# MMA M = 256 over a CTA pair (128 N rows per CTA); the problem's A (M tokens, as few as 40)
# is the MMA's B operand with MMA N = tokens_per_tile, so small M wastes MMA N columns
# (16-granular) instead of 128-row MMA M tiles. The MMA computes C^T, which is C read through
# its M-major view (N, M):(1, N). In the kernel below "A", "B", "SFA", "SFB", "M" and "N"
# are the MMA's; the host tables keep the problem's names.
@dataclasses.dataclass(frozen=True)
class PersistentGemmConfig:
    """Python-time configuration of the persistent sm_100a kernel (baked into its code)."""

    # MMA N: tokens (problem M rows) per tile. 128 or 256 (NVIDIA's grouped block-scaled
    # example supports exactly these with cta_group::2); picked per input set by
    # choose_tokens_per_tile.
    tokens_per_tile: int = 128
    # MMA M over the CTA pair: problem N rows per tile (128 per CTA)
    mma_m: int = 256
    # Shared memory per CTA the stage count is computed against (sm_100 opt-in limit)
    smem_capacity_bytes: int = 232_448
    arch: str = "sm_100a"
    # C's dtype: "float16" (the competition's) or "bfloat16"; the C stages' bytes are the same
    out_dtype: str = "float16"

    @property
    def num_acc_stage(self) -> int:
        # Two fp32 accumulators of 128 columns fit TMEM's 512 columns with the scale
        # columns; two of 256 do not.
        return 2 if self.tokens_per_tile == 128 else 1

    # Bytes kept for mbarriers and the TMEM address before the 1024-byte aligned buffers
    reserved_smem_bytes: int = 1024
    # One C subtile in shared memory: the epilogue tile (128 N rows x 32 tokens) in fp16
    c_stage_bytes: int = 128 * 32 * 2

    @property
    def ab_stage_bytes(self) -> int:
        return persistent_stage_bytes(self.tokens_per_tile)

    @property
    def num_ab_stage(self) -> int:
        """As many A/B/SFA/SFB stages as fit beside two C stages."""
        budget = self.smem_capacity_bytes - self.reserved_smem_bytes - 2 * self.c_stage_bytes
        return budget // self.ab_stage_bytes

    @property
    def num_c_stage(self) -> int:
        """C stages: what the A/B stages leave over."""
        budget = self.smem_capacity_bytes - self.reserved_smem_bytes
        return (budget - self.num_ab_stage * self.ab_stage_bytes) // self.c_stage_bytes

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA (every buffer is a multiple of 1024 bytes)."""
        return (
            self.reserved_smem_bytes
            + self.num_ab_stage * self.ab_stage_bytes
            + self.num_c_stage * self.c_stage_bytes
        )

    def check(self) -> None:
        if self.tokens_per_tile not in (128, 256):
            raise ValueError(f"tokens_per_tile = {self.tokens_per_tile}; rule: 128 or 256")
        if self.mma_m != 256:
            raise ValueError(f"mma_m = {self.mma_m}; rule: 256 (cta_group::2 over a CTA pair)")
        if self.out_dtype not in ("float16", "bfloat16"):
            raise ValueError(f"out_dtype = {self.out_dtype!r}; rule: float16 or bfloat16")


PERSISTENT_CONFIGS = {t: PersistentGemmConfig(tokens_per_tile=t) for t in (128, 256)}
# A tile-table row of the persistent kernel: group, MMA m tile (256 problem-N rows), MMA n tile
# (tokens_per_tile problem-M rows), k-tiles: 16 bytes, one vector load
PERSISTENT_TILE_ROW = 4
# Descriptor slots of one group, in MMA roles: A = problem B, B = problem A,
# SFA = problem SFB, SFB = problem SFA, C = problem C through its (N, M) view
PERSISTENT_NUM_TENSORMAPS = 5


class PersistentGemmSm100:
    """Grouped NVFP4 GEMM over a host-built tile list, one CTA pair per tile at a time.

    Warp roles (192 threads, one CTA per SM): warps 0-3 epilogue (warp 0 allocates TMEM),
    warp 4 MMA (the pair's leader CTA issues ``tcgen05.mma.cta_group::2``), warp 5 TMA.
    ``PipelineTmaUmma`` carries A/B/SFA/SFB stages from the TMA warp to the MMA warp (as many
    stages as shared memory holds); ``PipelineUmmaAsync`` carries TMEM accumulators from the
    MMA warp to the epilogue (two for 128 tokens per tile, so tile t's epilogue overlaps tile
    t+1's mainloop); ``PipelineTmaStore`` drains C subtiles through shared memory.

    Schedule: cluster c runs tiles c, c + num_clusters, ... of the tile table
    (``plan_persistent_tiles``); both CTAs of a pair read the same entries. Every TMA
    descriptor comes prebuilt from global memory (``init_tensormaps``), five per group.
    """

    def __init__(self, config: PersistentGemmConfig):
        config.check()
        self.config = config
        self.acc_dtype = cutlass.Float32
        # C's dtype: fp16 (the competition's), or bf16 where the config says (the MoE entry)
        self.c_dtype = cutlass.BFloat16 if config.out_dtype == "bfloat16" else c_dtype
        self.sf_vec_size = sf_vec_size
        self.cluster_shape_mn = (2, 1)
        self.cta_group = tcgen05.CtaGroup.TWO
        self.mma_inst_shape_mn = (config.mma_m, config.tokens_per_tile)
        # SFB (the tokens' scales) is loaded for a full 128-row scale atom per CTA
        self.mma_inst_shape_mn_sfb = (
            config.mma_m // 2,
            cute.round_up(config.tokens_per_tile, 128),
        )
        self.num_acc_stage = config.num_acc_stage
        self.epilog_warp_id = (0, 1, 2, 3)
        self.mma_warp_id = 4
        self.tma_warp_id = 5
        self.threads_per_cta = 32 * len((*self.epilog_warp_id, self.mma_warp_id, self.tma_warp_id))
        self.epilog_sync_barrier = pipeline.NamedBarrier(
            barrier_id=1, num_threads=32 * len(self.epilog_warp_id)
        )
        self.tmem_alloc_barrier = pipeline.NamedBarrier(
            barrier_id=2, num_threads=32 * len((self.mma_warp_id, *self.epilog_warp_id))
        )
        self.num_tmem_alloc_cols = 512
        self.c_layout = utils.LayoutEnum.COL_MAJOR  # C^T: the MMA's M (problem N) is contiguous

    @staticmethod
    def can_implement(problem_sizes) -> str | None:
        """None if this kernel runs the input set, else the rule it breaks.

        C is stored by TMA through its (N, M) view, whose row stride (N fp16) must be a
        multiple of 16 bytes; a group with M = 0 has no tiles and no stores. validate_inputs
        has checked everything else (K % 256, L, G, alignment), and any tile shape of
        PERSISTENT_CONFIGS covers any M and N.
        """
        for g, (m, n, _k, _l) in enumerate(problem_sizes):
            if m > 0 and n % 8 != 0:
                return f"group {g}: N = {n}; the persistent kernel's TMA store of C needs N % 8 == 0"
        return None

    # ------------------------------------------------------------------ Python time
    def _setup_attributes(self):
        """MMA, tile shapes, stage counts and shared-memory layouts (trace time)."""
        self.tiled_mma = self._make_tiled_mma(self.cta_group, self.mma_inst_shape_mn)
        self.tiled_mma_sfb = self._make_tiled_mma(tcgen05.CtaGroup.ONE, self.mma_inst_shape_mn_sfb)
        mma_inst_shape_k = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        mma_inst_tile_k = 4  # 4 x 64 = 256 K elements per stage (the K tile)
        self.mma_tiler = (*self.mma_inst_shape_mn, mma_inst_shape_k * mma_inst_tile_k)
        self.mma_tiler_sfb = (*self.mma_inst_shape_mn_sfb, mma_inst_shape_k * mma_inst_tile_k)
        self.cta_tile_shape_mnk = (
            self.mma_tiler[0] // cute.size(self.tiled_mma.thr_id.shape),
            self.mma_tiler[1],
            self.mma_tiler[2],
        )
        self.cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (self.tiled_mma.thr_id.shape,)
        )
        self.cluster_layout_sfb_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (self.tiled_mma_sfb.thr_id.shape,)
        )
        self.num_mcast_ctas_a = cute.size(self.cluster_layout_vmnk.shape[2])
        self.num_mcast_ctas_b = cute.size(self.cluster_layout_vmnk.shape[1])
        self.epi_tile = sm100_utils.compute_epilogue_tile_shape(
            self.cta_tile_shape_mnk, True, self.c_layout, self.c_dtype
        )
        self.num_ab_stage, self.num_c_stage = self._compute_stages()
        self.a_smem_layout_staged = sm100_utils.make_smem_layout_a(
            self.tiled_mma, self.mma_tiler, ab_dtype, self.num_ab_stage
        )
        self.b_smem_layout_staged = sm100_utils.make_smem_layout_b(
            self.tiled_mma, self.mma_tiler, ab_dtype, self.num_ab_stage
        )
        self.sfa_smem_layout_staged = blockscaled_utils.make_smem_layout_sfa(
            self.tiled_mma, self.mma_tiler, self.sf_vec_size, self.num_ab_stage
        )
        self.sfb_smem_layout_staged = blockscaled_utils.make_smem_layout_sfb(
            self.tiled_mma, self.mma_tiler, self.sf_vec_size, self.num_ab_stage
        )
        self.c_smem_layout_staged = sm100_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.num_c_stage
        )

    def _make_tiled_mma(self, cta_group, mma_inst_shape_mn):
        return sm100_utils.make_blockscaled_trivial_tiled_mma(
            ab_dtype,
            OPERAND_MAJOR_MODE.K,
            OPERAND_MAJOR_MODE.K,
            sf_dtype,
            self.sf_vec_size,
            cta_group,
            mma_inst_shape_mn,
        )

    def _stage_bytes(self):
        """(bytes of one A/B/SFA/SFB stage, bytes of one C subtile stage) per CTA."""
        one = 1
        ab = (
            cute.size_in_bytes(ab_dtype, sm100_utils.make_smem_layout_a(self.tiled_mma, self.mma_tiler, ab_dtype, one))
            + cute.size_in_bytes(ab_dtype, sm100_utils.make_smem_layout_b(self.tiled_mma, self.mma_tiler, ab_dtype, one))
            + cute.size_in_bytes(sf_dtype, blockscaled_utils.make_smem_layout_sfa(
                self.tiled_mma, self.mma_tiler, self.sf_vec_size, one))
            + cute.size_in_bytes(sf_dtype, blockscaled_utils.make_smem_layout_sfb(
                self.tiled_mma, self.mma_tiler, self.sf_vec_size, one))
        )
        c = cute.size_in_bytes(self.c_dtype, sm100_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, one))
        return ab, c

    def _compute_stages(self):
        """As many A/B stages as fit beside two C stages; C takes what is left over."""
        ab_stage_bytes, c_stage_bytes = self._stage_bytes()
        budget = self.config.smem_capacity_bytes - self.config.reserved_smem_bytes
        num_ab_stage = (budget - 2 * c_stage_bytes) // ab_stage_bytes
        num_c_stage = (budget - num_ab_stage * ab_stage_bytes) // c_stage_bytes
        return num_ab_stage, num_c_stage

    # ------------------------------------------------------------------ host (JIT)
    def _make_atoms(self):
        """TMA atoms from placeholder tensors (dynamic 64 x 64 shapes at address 0): shapes,
        strides and addresses come from the per-group descriptors at run time."""
        dyn = cutlass.Int32(64)
        k_major = (dyn, cute.assume(dyn, 32), cutlass.Int32(1))

        def operand():
            return cute.make_tensor(
                cute.make_ptr(ab_dtype, 0, cute.AddressSpace.gmem, assumed_align=16),
                cute.make_layout(k_major, stride=(cute.assume(dyn, 32), 1, cute.assume(dyn * dyn, 32))),
            )

        def scales(operand_tensor):
            layout = blockscaled_utils.tile_atom_to_shape_SF(operand_tensor.shape, self.sf_vec_size)
            return cute.make_tensor(
                cute.make_ptr(sf_dtype, 0, cute.AddressSpace.gmem, assumed_align=16), layout
            )

        initial_a, initial_b = operand(), operand()
        initial_sfa, initial_sfb = scales(initial_a), scales(initial_b)
        # C^T: (M, N, L) of the MMA with the M mode contiguous
        initial_c = cute.make_tensor(
            cute.make_ptr(self.c_dtype, 0, cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout(
                (dyn, dyn, cutlass.Int32(1)),
                stride=(1, cute.assume(dyn, 8), cute.assume(dyn * dyn, 8)),
            ),
        )
        tiled_mma = self.tiled_mma
        a_op = sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_shape_mn, tiled_mma.thr_id)
        b_op = sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_shape_mn, tiled_mma.thr_id)
        sfb_op = sm100_utils.cluster_shape_to_tma_atom_SFB(self.cluster_shape_mn, tiled_mma.thr_id)
        a_smem_layout = cute.slice_(self.a_smem_layout_staged, (None, None, None, 0))
        b_smem_layout = cute.slice_(self.b_smem_layout_staged, (None, None, None, 0))
        sfa_smem_layout = cute.slice_(self.sfa_smem_layout_staged, (None, None, None, 0))
        sfb_smem_layout = cute.slice_(self.sfb_smem_layout_staged, (None, None, None, 0))
        tma_atom_a, tma_tensor_a = cute.nvgpu.make_tiled_tma_atom_A(
            a_op, initial_a, a_smem_layout, self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape
        )
        tma_atom_b, tma_tensor_b = cute.nvgpu.make_tiled_tma_atom_B(
            b_op, initial_b, b_smem_layout, self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape
        )
        tma_atom_sfa, tma_tensor_sfa = cute.nvgpu.make_tiled_tma_atom_A(
            a_op, initial_sfa, sfa_smem_layout, self.mma_tiler, tiled_mma,
            self.cluster_layout_vmnk.shape, internal_type=cutlass.Int16,
        )
        tma_atom_sfb, tma_tensor_sfb = cute.nvgpu.make_tiled_tma_atom_B(
            sfb_op, initial_sfb, sfb_smem_layout, self.mma_tiler_sfb, self.tiled_mma_sfb,
            self.cluster_layout_sfb_vmnk.shape, internal_type=cutlass.Int16,
        )
        epi_smem_layout = cute.slice_(self.c_smem_layout_staged, (None, None, 0))
        tma_atom_c, tma_tensor_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), initial_c, epi_smem_layout, self.epi_tile
        )
        # Bytes one stage lands in the pair's leader barrier: every CTA's A, B, SFA, SFB
        self.num_tma_load_bytes = (
            cute.size_in_bytes(ab_dtype, a_smem_layout)
            + cute.size_in_bytes(ab_dtype, b_smem_layout)
            + cute.size_in_bytes(sf_dtype, sfa_smem_layout)
            + cute.size_in_bytes(sf_dtype, sfb_smem_layout)
        ) * cute.size(tiled_mma.thr_id.shape)
        atoms = (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb, tma_atom_c)
        proxies = (tma_tensor_a, tma_tensor_b, tma_tensor_sfa, tma_tensor_sfb, tma_tensor_c)
        return atoms, proxies

    def init_tensormaps_launch(self, ptr_of_ptrs, ptr_of_sizes, ptr_of_tensormaps, num_groups):
        """The descriptor init of every group (one CTA per group), traced inside a @cute.jit
        entry: (the kernel to launch, its launch geometry)."""
        self._setup_attributes()
        atoms, _ = self._make_atoms()
        tensor_of_ptrs, tensor_of_problem_sizes = tensors_of_group(ptr_of_ptrs, ptr_of_sizes, num_groups)
        tensormaps = tensormap_table(ptr_of_tensormaps, num_groups, PERSISTENT_NUM_TENSORMAPS)
        kernel = self.init_tensormaps_kernel(*atoms, tensor_of_ptrs, tensor_of_problem_sizes, tensormaps)
        return kernel, {"grid": (1, 1, num_groups), "block": [32, 1, 1], "cluster": (1, 1, 1), **chained_launch()}

    @cute.jit
    def init_tensormaps(
        self,
        ptr_of_ptrs: cute.Pointer,
        ptr_of_sizes: cute.Pointer,
        ptr_of_tensormaps: cute.Pointer,
        num_groups: cutlass.Int32,
    ):
        """Write the five descriptors of every group (one CTA per group)."""
        kernel, geometry = self.init_tensormaps_launch(ptr_of_ptrs, ptr_of_sizes, ptr_of_tensormaps, num_groups)
        kernel.launch(**geometry)

    @cute.kernel
    def init_tensormaps_kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        tma_atom_b: cute.CopyAtom,
        tma_atom_sfa: cute.CopyAtom,
        tma_atom_sfb: cute.CopyAtom,
        tma_atom_c: cute.CopyAtom,
        tensor_of_ptrs: cute.Tensor,  # [G, 5] int64: problem a, b, c, sfa, sfb
        tensor_of_problem_sizes: cute.Tensor,  # [G, 4] int32: problem m, n, k, l
        tensormaps: cute.Tensor,  # [G, 5, 16] int64: MMA a, b, sfa, sfb, c
    ):
        _, _, group_idx = cute.arch.block_idx()
        # Chained calls: as the per-tile kernel's init (init_tensormaps_kernel)
        wait_for_previous_grid()
        launch_dependents()
        m = tensor_of_problem_sizes[group_idx, 0]
        n = tensor_of_problem_sizes[group_idx, 1]
        k = tensor_of_problem_sizes[group_idx, 2]
        one = cutlass.Int32(1)

        @cute.struct
        class SharedStorage:
            tensormap_buffer: cute.struct.Align[
                cute.struct.MemRange[cutlass.Int64, PERSISTENT_NUM_TENSORMAPS * bytes_per_tensormap // 8],
                128,
            ]

        storage = utils.SmemAllocator().allocate(SharedStorage)
        smem_ptrs = tuple(
            storage.tensormap_buffer.data_ptr() + slot * (bytes_per_tensormap // 8)
            for slot in range(PERSISTENT_NUM_TENSORMAPS)
        )
        tensormap_manager = utils.TensorMapManager(utils.TensorMapUpdateMode.SMEM, bytes_per_tensormap)
        gmem_ptrs = tuple(
            tensormap_manager.get_tensormap_ptr(tensormaps[(group_idx, slot, None)].iterator)
            for slot in range(PERSISTENT_NUM_TENSORMAPS)
        )

        def gmem(dtype, column):
            return cute.make_ptr(dtype, tensor_of_ptrs[group_idx, column], cute.AddressSpace.gmem).align(32)

        def k_major(rows):
            return cute.make_layout((rows, k, one), stride=(cute.assume(k, 32), 1, cute.assume(rows * k, 32)))

        # Swap-AB: the MMA's A is the problem's B (N x K), its B the problem's A (M x K)
        mma_a = cute.make_tensor(gmem(ab_dtype, PTR_B), k_major(n))
        mma_b = cute.make_tensor(gmem(ab_dtype, PTR_A), k_major(m))
        mma_sfa = cute.make_tensor(
            gmem(sf_dtype, PTR_SFB), blockscaled_utils.tile_atom_to_shape_SF((n, k, one), self.sf_vec_size)
        )
        mma_sfb = cute.make_tensor(
            gmem(sf_dtype, PTR_SFA), blockscaled_utils.tile_atom_to_shape_SF((m, k, one), self.sf_vec_size)
        )
        # C^T (N, M, 1):(1, N, M * N); can_implement guarantees N % 8 == 0 (16-byte strides)
        mma_c = cute.make_tensor(
            gmem(self.c_dtype, PTR_C),
            cute.make_layout((n, m, one), stride=(1, cute.assume(n, 8), cute.assume(m * n, 8))),
        )
        atoms = (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb, tma_atom_c)
        # A group with M = 0 has no tiles: its slots are never read, and its sizes (N need not
        # be a multiple of 8 there) would not make valid descriptors
        if m > 0:
            for atom, smem_ptr in zip(atoms, smem_ptrs):
                tensormap_manager.init_tensormap_from_atom(atom, smem_ptr, 0)
            # Released to the tensormap proxy by update_tensormap; the GEMM's consuming warps
            # acquire them (an acquire here would order only this thread's accesses)
            tensormap_manager.update_tensormap(
                (mma_a, mma_b, mma_sfa, mma_sfb, mma_c), atoms, gmem_ptrs, 0, smem_ptrs
            )

    @cute.jit
    def __call__(
        self,
        ptr_of_tiles: cute.Pointer,
        ptr_of_tensormaps: cute.Pointer,
        num_groups: cutlass.Int32,
        num_tiles: cutlass.Int32,
        num_clusters: cutlass.Int32,
    ):
        """Launch ``num_clusters`` CTA pairs over the ``num_tiles`` entries of the tile table."""
        kernel, geometry = self.gemm_launch(ptr_of_tiles, ptr_of_tensormaps, num_groups, num_tiles, num_clusters)
        kernel.launch(**geometry)

    def gemm_launch(self, ptr_of_tiles, ptr_of_tensormaps, num_groups, num_tiles, num_clusters):
        """The GEMM over ``num_clusters`` CTA pairs, traced inside a @cute.jit entry: (the
        kernel to launch, its launch geometry)."""
        self._setup_attributes()
        atoms, proxies = self._make_atoms()
        tensor_of_tiles = cute.make_tensor(
            ptr_of_tiles, cute.make_layout((num_tiles, PERSISTENT_TILE_ROW), stride=(PERSISTENT_TILE_ROW, 1))
        )
        tensormaps = tensormap_table(ptr_of_tensormaps, num_groups, PERSISTENT_NUM_TENSORMAPS)

        @cute.struct
        class SharedStorage:
            ab_full_mbar_ptr: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage]
            ab_empty_mbar_ptr: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage]
            acc_full_mbar_ptr: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage]
            acc_empty_mbar_ptr: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage]
            tmem_dealloc_mbar_ptr: cutlass.Int64
            tmem_holding_buf: cutlass.Int32
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.c_smem_layout_staged.outer)], 1024
            ]
            sA: cute.struct.Align[
                cute.struct.MemRange[ab_dtype, cute.cosize(self.a_smem_layout_staged.outer)], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[ab_dtype, cute.cosize(self.b_smem_layout_staged.outer)], 1024
            ]
            sSFA: cute.struct.Align[
                cute.struct.MemRange[sf_dtype, cute.cosize(self.sfa_smem_layout_staged)], 128
            ]
            sSFB: cute.struct.Align[
                cute.struct.MemRange[sf_dtype, cute.cosize(self.sfb_smem_layout_staged)], 128
            ]

        self.shared_storage = SharedStorage
        kernel = self.kernel(
            self.tiled_mma,
            self.tiled_mma_sfb,
            *atoms,
            *proxies,
            self.cluster_layout_vmnk,
            self.cluster_layout_sfb_vmnk,
            self.a_smem_layout_staged,
            self.b_smem_layout_staged,
            self.sfa_smem_layout_staged,
            self.sfb_smem_layout_staged,
            self.c_smem_layout_staged,
            self.epi_tile,
            tensor_of_tiles,
            tensormaps,
            num_tiles,
        )
        return kernel, {
            "grid": (2 * num_clusters, 1, 1),
            "block": [self.threads_per_cta, 1, 1],
            "cluster": (*self.cluster_shape_mn, 1),
            "smem": self.shared_storage.size_in_bytes(),
            "min_blocks_per_mp": 1,
            **chained_launch(),
        }

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tiled_mma_sfb: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        tma_atom_b: cute.CopyAtom,
        tma_atom_sfa: cute.CopyAtom,
        tma_atom_sfb: cute.CopyAtom,
        tma_atom_c: cute.CopyAtom,
        mA_mkl: cute.Tensor,  # coordinate proxies; the real tensors are in the descriptors
        mB_nkl: cute.Tensor,
        mSFA_mkl: cute.Tensor,
        mSFB_nkl: cute.Tensor,
        mC_mnl: cute.Tensor,
        cluster_layout_vmnk: cute.Layout,
        cluster_layout_sfb_vmnk: cute.Layout,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        sfa_smem_layout_staged: cute.Layout,
        sfb_smem_layout_staged: cute.Layout,
        c_smem_layout_staged: cute.ComposedLayout,
        epi_tile: cute.Tile,
        tensor_of_tiles: cute.Tensor,  # [T, 4] int32: group, MMA m tile, MMA n tile, k-tiles
        tensormaps: cute.Tensor,  # [G, 5, 16] int64
        num_tiles: cutlass.Int32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid_dim_x, _, _ = cute.arch.grid_dim()
        mma_tile_coord_v = bidx % 2
        is_leader_cta = mma_tile_coord_v == 0
        cta_rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        block_in_cluster_coord_vmnk = cluster_layout_vmnk.get_flat_coord(cta_rank_in_cluster)
        block_in_cluster_coord_sfb_vmnk = cluster_layout_sfb_vmnk.get_flat_coord(cta_rank_in_cluster)
        # Both CTAs of a pair walk the same tiles: cluster c takes c, c + num_clusters, ...
        cluster_idx = bidx // 2
        num_clusters = grid_dim_x // 2

        #
        # Shared storage, pipelines
        #
        storage = utils.SmemAllocator().allocate(self.shared_storage)
        ab_pipeline = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full_mbar_ptr.data_ptr(),
            num_stages=self.num_ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_mcast_ctas_a + self.num_mcast_ctas_b - 1
            ),
            tx_count=self.num_tma_load_bytes,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,  # one cluster barrier for every mbarrier init: pipeline_init_*
        )
        # Every epilogue warp of both CTAs releases the leader's accumulator
        acc_pipeline = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full_mbar_ptr.data_ptr(),
            num_stages=self.num_acc_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, len(self.epilog_warp_id) * 2),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        tmem_dealloc_mbar_ptr = storage.tmem_dealloc_mbar_ptr
        tmem_holding_buf = storage.tmem_holding_buf
        if warp_idx == self.tma_warp_id:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(tmem_dealloc_mbar_ptr, 32)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        # (EPI_TILE_M, EPI_TILE_N, STAGE)
        sC = storage.sC.get_tensor(c_smem_layout_staged.outer, swizzle=c_smem_layout_staged.inner)
        # (MMA, MMA_M, MMA_K, STAGE)
        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        # (MMA, MMA_N, MMA_K, STAGE)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        # (MMA, MMA_M, MMA_K, STAGE)
        sSFA = storage.sSFA.get_tensor(sfa_smem_layout_staged)
        # (MMA, MMA_N, MMA_K, STAGE)
        sSFB = storage.sSFB.get_tensor(sfb_smem_layout_staged)

        # Multicast masks: A and SFA stay in their CTA (mode 2 has one CTA), B is split over
        # the pair by the 2-CTA TMA, SFB (the tokens' scales) goes to both CTAs
        a_full_mcast_mask = cpasync.create_tma_multicast_mask(
            cluster_layout_vmnk, block_in_cluster_coord_vmnk, mcast_mode=2
        )
        b_full_mcast_mask = cpasync.create_tma_multicast_mask(
            cluster_layout_vmnk, block_in_cluster_coord_vmnk, mcast_mode=1
        )
        sfb_full_mcast_mask = cpasync.create_tma_multicast_mask(
            cluster_layout_sfb_vmnk, block_in_cluster_coord_sfb_vmnk, mcast_mode=1
        )

        #
        # Global tile partitions (coordinates only)
        #
        # (bM, bK, RestM, RestK, RestL)
        gA_mkl = cute.local_tile(mA_mkl, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        # (bN, bK, RestN, RestK, RestL)
        gB_nkl = cute.local_tile(mB_nkl, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        # (bM, bK, RestM, RestK, RestL)
        gSFA_mkl = cute.local_tile(mSFA_mkl, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        # (bN, bK, RestN, RestK, RestL)
        gSFB_nkl = cute.local_tile(mSFB_nkl, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        # (bM, bN, RestM, RestN, RestL)
        gC_mnl = cute.local_tile(mC_mnl, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None))
        thr_mma = tiled_mma.get_slice(mma_tile_coord_v)
        thr_mma_sfb = tiled_mma_sfb.get_slice(mma_tile_coord_v)
        # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
        tCgA = thr_mma.partition_A(gA_mkl)
        # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
        tCgB = thr_mma.partition_B(gB_nkl)
        # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
        tCgSFA = thr_mma.partition_A(gSFA_mkl)
        # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
        tCgSFB = thr_mma_sfb.partition_B(gSFB_nkl)
        # (MMA, MMA_M, MMA_N, RestM, RestN, RestL)
        tCgC = thr_mma.partition_C(gC_mnl)

        #
        # TMA partitions
        #
        a_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape)
        # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestM, RestK, RestL)
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, block_in_cluster_coord_vmnk[2], a_cta_layout,
            cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3),
        )
        b_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape)
        # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestN, RestK, RestL)
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, block_in_cluster_coord_vmnk[1], b_cta_layout,
            cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3),
        )
        # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestM, RestK, RestL)
        tAsSFA, tAgSFA = cpasync.tma_partition(
            tma_atom_sfa, block_in_cluster_coord_vmnk[2], a_cta_layout,
            cute.group_modes(sSFA, 0, 3), cute.group_modes(tCgSFA, 0, 3),
        )
        tAsSFA = cute.filter_zeros(tAsSFA)
        tAgSFA = cute.filter_zeros(tAgSFA)
        sfb_cta_layout = cute.make_layout(cute.slice_(cluster_layout_sfb_vmnk, (0, None, 0, 0)).shape)
        # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestN, RestK, RestL)
        tBsSFB, tBgSFB = cpasync.tma_partition(
            tma_atom_sfb, block_in_cluster_coord_sfb_vmnk[1], sfb_cta_layout,
            cute.group_modes(sSFB, 0, 3), cute.group_modes(tCgSFB, 0, 3),
        )
        tBsSFB = cute.filter_zeros(tBsSFB)
        tBgSFB = cute.filter_zeros(tBgSFB)

        #
        # MMA fragments
        #
        # (MMA, MMA_M, MMA_K, STAGE)
        tCrA = tiled_mma.make_fragment_A(sA)
        # (MMA, MMA_N, MMA_K, STAGE)
        tCrB = tiled_mma.make_fragment_B(sB)
        # (MMA, MMA_M, MMA_N, STAGE)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))

        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        tensormap_manager = utils.TensorMapManager(utils.TensorMapUpdateMode.SMEM, bytes_per_tensormap)

        #
        # TMA warp: A/B/SFA/SFB stages of every k-tile of every tile of this pair
        #
        if warp_idx == self.tma_warp_id:
            ab_producer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_ab_stage)
            tile_idx = cluster_idx
            # Chained calls (SM100_CHAIN_CALLS): the tile table, the descriptors (the first
            # tile's acquire and prefetch) and A/B/SFA/SFB come after the previous kernel.
            # No trigger here: the first launch_dependents of any thread counts for the whole
            # CTA (PTX ISA), so this warp's, right after its wait, would let a dependent launch
            # before the CTA holds its TMEM; the MMA and epilogue warps trigger after the
            # allocation barrier, whatever the shared-memory footprint lets share the SM.
            wait_for_previous_grid()
            tma_num_tiles = self._tile_count(tensor_of_tiles, num_tiles)
            tile_row = self._first_tile(tensor_of_tiles, cluster_idx, tma_num_tiles)
            # The first tile's A, B, SFA, SFB descriptors (written by the init kernel):
            # acquired and fetched before the pipeline's first wait
            if tile_idx < tma_num_tiles:
                for slot in cutlass.range_constexpr(4):
                    acquire_tensormap(tensormap_desc_ptr(tensormap_manager, tensormaps, tile_row[0], slot))
            while tile_idx < tma_num_tiles:
                group_idx, mma_tile_m, mma_tile_n, k_tile_cnt = tile_row[0], tile_row[1], tile_row[2], tile_row[3]
                # The next tile's row, one 16-byte load a whole tile ahead of its use
                tile_idx = self._next_tile(tensor_of_tiles, tile_row, tile_idx, tma_num_tiles, num_clusters)
                desc_a = tensormap_desc_ptr(tensormap_manager, tensormaps, group_idx, 0)
                desc_b = tensormap_desc_ptr(tensormap_manager, tensormaps, group_idx, 1)
                desc_sfa = tensormap_desc_ptr(tensormap_manager, tensormaps, group_idx, 2)
                desc_sfb = tensormap_desc_ptr(tensormap_manager, tensormaps, group_idx, 3)
                # ((atom_v, rest_v), RestK)
                tAgA_slice = tAgA[(None, mma_tile_m, None, 0)]
                tBgB_slice = tBgB[(None, mma_tile_n, None, 0)]
                tAgSFA_slice = tAgSFA[(None, mma_tile_m, None, 0)]
                tBgSFB_slice = tBgSFB[(None, mma_tile_n, None, 0)]

                ab_producer_state.reset_count()
                peek_ab_empty_status = cutlass.Boolean(1)
                if ab_producer_state.count < k_tile_cnt:
                    peek_ab_empty_status = ab_pipeline.producer_try_acquire(ab_producer_state)
                for k_tile in cutlass.range(0, k_tile_cnt, 1, unroll=1):
                    ab_pipeline.producer_acquire(ab_producer_state, peek_ab_empty_status)
                    full_barrier = ab_pipeline.producer_get_barrier(ab_producer_state)
                    k_coord = ab_producer_state.count
                    stage = ab_producer_state.index
                    cute.copy(tma_atom_a, tAgA_slice[(None, k_coord)], tAsA[(None, stage)],
                              tma_bar_ptr=full_barrier, mcast_mask=a_full_mcast_mask, tma_desc_ptr=desc_a)
                    cute.copy(tma_atom_b, tBgB_slice[(None, k_coord)], tBsB[(None, stage)],
                              tma_bar_ptr=full_barrier, mcast_mask=b_full_mcast_mask, tma_desc_ptr=desc_b)
                    cute.copy(tma_atom_sfa, tAgSFA_slice[(None, k_coord)], tAsSFA[(None, stage)],
                              tma_bar_ptr=full_barrier, mcast_mask=a_full_mcast_mask, tma_desc_ptr=desc_sfa)
                    cute.copy(tma_atom_sfb, tBgSFB_slice[(None, k_coord)], tBsSFB[(None, stage)],
                              tma_bar_ptr=full_barrier, mcast_mask=sfb_full_mcast_mask, tma_desc_ptr=desc_sfb)
                    ab_producer_state.advance()
                    peek_ab_empty_status = cutlass.Boolean(1)
                    if ab_producer_state.count < k_tile_cnt:
                        peek_ab_empty_status = ab_pipeline.producer_try_acquire(ab_producer_state)
                if tile_idx < tma_num_tiles and tile_row[0] != group_idx:
                    # A group change (a pair's groups never repeat: the tile list is
                    # group-major): acquire and fetch the next group's descriptors while this
                    # tile's last stages are still in flight
                    for slot in cutlass.range_constexpr(4):
                        acquire_tensormap(tensormap_desc_ptr(tensormap_manager, tensormaps, tile_row[0], slot))
            ab_pipeline.producer_tail(ab_producer_state)

        #
        # MMA warp: the leader CTA issues the pair's MMAs into one of the TMEM accumulators
        #
        if warp_idx == self.mma_warp_id:
            self.tmem_alloc_barrier.arrive_and_wait()
            # Chained calls: the next call may launch once this CTA holds its TMEM (as the
            # epilogue warps, below); its CTAs take an SM only once this CTA leaves it
            launch_dependents()
            acc_tmem_ptr = cute.arch.retrieve_tmem_ptr(
                self.acc_dtype, alignment=16, ptr_to_buffer_holding_addr=tmem_holding_buf
            )
            # (MMA, MMA_M, MMA_N, STAGE)
            tCtAcc_base = cute.make_tensor(acc_tmem_ptr, tCtAcc_fake.layout)
            tCtSFA, tCtSFB = self._scale_tmem_tensors(
                tiled_mma, acc_tmem_ptr, tCtAcc_base, sfa_smem_layout_staged, sfb_smem_layout_staged
            )
            tiled_copy_s2t_sfa, tCsSFA_compact_s2t, tCtSFA_compact_s2t = self._s2t_copy_and_partition(sSFA, tCtSFA)
            tiled_copy_s2t_sfb, tCsSFB_compact_s2t, tCtSFB_compact_s2t = self._s2t_copy_and_partition(sSFB, tCtSFB)

            ab_consumer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_ab_stage)
            acc_producer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_acc_stage)
            tile_idx = cluster_idx
            # the tile table after the previous kernel (this warp's only global access)
            wait_for_previous_grid()
            mma_num_tiles = self._tile_count(tensor_of_tiles, num_tiles)
            tile_row = self._first_tile(tensor_of_tiles, cluster_idx, mma_num_tiles)
            while tile_idx < mma_num_tiles:
                k_tile_cnt = tile_row[3]
                tile_idx = self._next_tile(tensor_of_tiles, tile_row, tile_idx, mma_num_tiles, num_clusters)
                # (MMA, MMA_M, MMA_N)
                tCtAcc = tCtAcc_base[(None, None, None, acc_producer_state.index)]

                ab_consumer_state.reset_count()
                peek_ab_full_status = cutlass.Boolean(1)
                if ab_consumer_state.count < k_tile_cnt and is_leader_cta:
                    peek_ab_full_status = ab_pipeline.consumer_try_wait(ab_consumer_state)
                if is_leader_cta:
                    acc_pipeline.producer_acquire(acc_producer_state)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for k_tile in cutlass.range(0, k_tile_cnt, 1, unroll=1):
                    if is_leader_cta:
                        ab_pipeline.consumer_wait(ab_consumer_state, peek_ab_full_status)
                        s2t_stage_coord = (None, None, None, None, ab_consumer_state.index)
                        cute.copy(tiled_copy_s2t_sfa, tCsSFA_compact_s2t[s2t_stage_coord], tCtSFA_compact_s2t)
                        cute.copy(tiled_copy_s2t_sfb, tCsSFB_compact_s2t[s2t_stage_coord], tCtSFB_compact_s2t)
                        # tCtAcc += tCrA * tCtSFA * tCrB * tCtSFB
                        num_kblocks = cute.size(tCrA, mode=[2])
                        for kblock_idx in cutlass.range(num_kblocks, unroll_full=True):
                            kblock_coord = (None, None, kblock_idx, ab_consumer_state.index)
                            sf_kblock_coord = (None, None, kblock_idx)
                            tiled_mma.set(tcgen05.Field.SFA, tCtSFA[sf_kblock_coord].iterator)
                            tiled_mma.set(tcgen05.Field.SFB, tCtSFB[sf_kblock_coord].iterator)
                            cute.gemm(tiled_mma, tCtAcc, tCrA[kblock_coord], tCrB[kblock_coord], tCtAcc)
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                        ab_pipeline.consumer_release(ab_consumer_state)
                    ab_consumer_state.advance()
                    peek_ab_full_status = cutlass.Boolean(1)
                    if ab_consumer_state.count < k_tile_cnt and is_leader_cta:
                        peek_ab_full_status = ab_pipeline.consumer_try_wait(ab_consumer_state)
                if is_leader_cta:
                    acc_pipeline.producer_commit(acc_producer_state)
                acc_producer_state.advance()
            acc_pipeline.producer_tail(acc_producer_state)

        #
        # Epilogue warps: TMEM -> registers -> fp16 -> shared memory -> TMA store
        #
        if warp_idx < self.mma_warp_id:
            if warp_idx == self.epilog_warp_id[0]:
                cute.arch.alloc_tmem(self.num_tmem_alloc_cols, tmem_holding_buf, is_two_cta=True)
                # This CTA allocates once: it gives up the right to allocate at once (CUTLASS
                # does after its mainloop), so that a CTA waiting to allocate on this SM is not
                # held back by a permit this one will never use
                cute.arch.relinquish_tmem_alloc_permit(is_two_cta=True)
            self.tmem_alloc_barrier.arrive_and_wait()
            # Chained calls: the next call's grid may launch now, with this CTA's TMEM
            # allocated. With 222 KB of shared memory per CTA, a next GEMM CTA fits on an SM
            # only once this one leaves it: it cannot take an SM, shared memory or TMEM this
            # grid still needs, and on each SM this grid frees it starts its set-up at once
            # instead of after this grid's end and a launch. (Only the small init kernels fit
            # beside this CTA; they allocate no TMEM and wait before anything else.)
            launch_dependents()
            acc_tmem_ptr = cute.arch.retrieve_tmem_ptr(
                self.acc_dtype, alignment=16, ptr_to_buffer_holding_addr=tmem_holding_buf
            )
            # (MMA, MMA_M, MMA_N, STAGE)
            tCtAcc_base = cute.make_tensor(acc_tmem_ptr, tCtAcc_fake.layout)
            tiled_copy_t2r, tTR_tAcc_base, tTR_rAcc = self._epilog_tmem_copy_and_partition(
                tidx, tCtAcc_base, tCgC, epi_tile
            )
            tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
            copy_atom_r2s = sm100_utils.get_smem_store_op(self.c_layout, self.c_dtype, self.acc_dtype, tiled_copy_t2r)
            tiled_copy_r2s = cute.make_tiled_copy_D(copy_atom_r2s, tiled_copy_t2r)
            thr_copy_r2s = tiled_copy_r2s.get_slice(tidx)
            # (R2S, R2S_M, R2S_N, PIPE_D)
            tRS_sC = thr_copy_r2s.partition_D(sC)
            # (R2S, R2S_M, R2S_N)
            tRS_rC = tiled_copy_r2s.retile(tTR_rC)
            # (EPI_TILE_M, EPI_TILE_N, EPI_M, EPI_N, RestM, RestN, RestL)
            gC_epi = cute.flat_divide(tCgC[((None, None), 0, 0, None, None, None)], epi_tile)
            # ((ATOM_V, REST_V), EPI_M, EPI_N), ((ATOM_V, REST_V), EPI_M, EPI_N, RestM, RestN, RestL)
            bSG_sC, bSG_gC_partitioned = cpasync.tma_partition(
                tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), cute.group_modes(gC_epi, 0, 2)
            )
            c_pipeline = pipeline.PipelineTmaStore.create(
                num_stages=self.num_c_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(self.epilog_warp_id)),
            )
            acc_consumer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_acc_stage)
            num_subtiles_done = cutlass.Int32(0)
            tile_idx = cluster_idx
            # the tile table, C's descriptor and C itself after the previous kernel (a caller
            # may hand the same c to consecutive calls)
            wait_for_previous_grid()
            epi_num_tiles = self._tile_count(tensor_of_tiles, num_tiles)
            tile_row = self._first_tile(tensor_of_tiles, cluster_idx, epi_num_tiles)
            if warp_idx == self.epilog_warp_id[0]:  # noqa: SIM102 - two dynamic conditions, traced as two ifs
                # The one warp that stores C: the first tile's C descriptor, acquired and
                # fetched before the first accumulator wait
                if tile_idx < epi_num_tiles:
                    acquire_tensormap(tensormap_desc_ptr(tensormap_manager, tensormaps, tile_row[0], 4))
            while tile_idx < epi_num_tiles:
                group_idx, mma_tile_m, mma_tile_n = tile_row[0], tile_row[1], tile_row[2]
                tile_scale = self._epilogue_scale(tensor_of_tiles, num_tiles, group_idx, mma_tile_m)
                tile_idx = self._next_tile(tensor_of_tiles, tile_row, tile_idx, epi_num_tiles, num_clusters)
                desc_c = tensormap_desc_ptr(tensormap_manager, tensormaps, group_idx, 4)
                # ((ATOM_V, REST_V), EPI_M * EPI_N)
                bSG_gC = cute.group_modes(bSG_gC_partitioned[(None, None, None, mma_tile_m, mma_tile_n, 0)], 1, 3)
                # (T2R, T2R_M, T2R_N, EPI_M * EPI_N)
                tTR_tAcc = tTR_tAcc_base[(None, None, None, None, None, acc_consumer_state.index)]
                tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
                acc_pipeline.consumer_wait(acc_consumer_state)
                subtile_cnt = cute.size(tTR_tAcc.shape, mode=[3])
                for subtile_idx in cutlass.range_constexpr(subtile_cnt):
                    cute.copy(tiled_copy_t2r, tTR_tAcc[(None, None, None, subtile_idx)], tTR_rAcc)
                    if subtile_idx == subtile_cnt - 1:
                        # The whole accumulator is in registers: hand it back to the MMA warp
                        # before converting and storing the last subtile
                        cute.arch.fence_view_async_tmem_load()
                        with cute.arch.elect_one():
                            acc_pipeline.consumer_release(acc_consumer_state)
                    acc_vector = tiled_copy_r2s.retile(tTR_rAcc).load()
                    if cutlass.const_expr(tile_scale is not None):
                        acc_vector = acc_vector * tile_scale
                    tRS_rC.store(acc_vector.to(self.c_dtype))
                    c_buffer = (num_subtiles_done + subtile_idx) % self.num_c_stage
                    cute.copy(tiled_copy_r2s, tRS_rC, tRS_sC[(None, None, None, c_buffer)])
                    # Shared-memory writes visible to the TMA unit before the store is issued
                    fence_proxy_async_shared_cta()
                    self.epilog_sync_barrier.arrive_and_wait()
                    if warp_idx == self.epilog_warp_id[0]:
                        cute.copy(tma_atom_c, bSG_sC[(None, c_buffer)], bSG_gC[(None, subtile_idx)],
                                  tma_desc_ptr=desc_c)
                        c_pipeline.producer_commit()
                        c_pipeline.producer_acquire()
                    self.epilog_sync_barrier.arrive_and_wait()
                acc_consumer_state.advance()
                num_subtiles_done += subtile_cnt
                if warp_idx == self.epilog_warp_id[0] and tile_idx < epi_num_tiles and tile_row[0] != group_idx:
                    acquire_tensormap(tensormap_desc_ptr(tensormap_manager, tensormaps, tile_row[0], 4))

            #
            # Free TMEM once both CTAs of the pair are done with it: after the last tile's
            # accumulator reads, before its C stores drain (producer_tail). Freed any earlier it
            # would help no one: no other GEMM CTA fits beside this one's shared memory
            #
            self.epilog_sync_barrier.arrive_and_wait()
            if warp_idx == self.epilog_warp_id[0]:
                cute.arch.mbarrier_arrive(tmem_dealloc_mbar_ptr, cta_rank_in_cluster ^ 1)
                cute.arch.mbarrier_wait(tmem_dealloc_mbar_ptr, 0)
                cute.arch.dealloc_tmem(acc_tmem_ptr, self.num_tmem_alloc_cols, is_two_cta=True)
            c_pipeline.producer_tail()

    # ------------------------------------------------------------------ device helpers
    def _epilogue_scale(self, tensor_of_tiles: cute.Tensor, num_tiles, group_idx, mma_tile_m):
        """What the epilogue multiplies a tile's fp32 sums by before rounding them to C's
        dtype: nothing here (None: no multiply is traced). The MoE entry's subclass reads its
        per-expert scales (read after the epilogue's grid-dependency wait)."""

    # The static persistent tile walk of every role: a pair runs tiles cluster_idx,
    # cluster_idx + num_clusters, ... of the tile table
    def _tile_count(self, tensor_of_tiles: cute.Tensor, num_tiles):
        """The tiles every role walks, read after the role's wait: here the kernel argument
        (the host built the table). A subclass whose table another kernel writes on the GPU
        (nvfp4_group_gemm.sm100_moe) loads the count that kernel stored; num_tiles is then
        the table's capacity. Emits no code here."""
        return num_tiles

    @cute.jit
    def _first_tile(self, tensor_of_tiles: cute.Tensor, cluster_idx, num_tiles):
        """The pair's first tile row, in registers. The host launches no more pairs than tiles;
        a pair past them all the same (the kernel does not rely on the host for it) reads no
        row, keeps zeros, walks its loops zero times and tears down as every pair does."""
        tile_row = cute.make_rmem_tensor(cute.make_layout(PERSISTENT_TILE_ROW), cutlass.Int32)
        for i in cutlass.range_constexpr(PERSISTENT_TILE_ROW):
            tile_row[i] = cutlass.Int32(0)
        if cluster_idx < num_tiles:
            cute.autovec_copy(tensor_of_tiles[(cluster_idx, None)], tile_row)
        return tile_row

    @cute.jit
    def _next_tile(self, tensor_of_tiles: cute.Tensor, tile_row: cute.Tensor, tile_idx, num_tiles, num_clusters):
        """The pair's next tile index; its row (one 16-byte load) into tile_row when there is
        one, a whole tile ahead of its use."""
        tile_idx += num_clusters
        if tile_idx < num_tiles:
            cute.autovec_copy(tensor_of_tiles[(tile_idx, None)], tile_row)
        return tile_idx

    def _scale_tmem_tensors(
        self, tiled_mma, acc_tmem_ptr, tCtAcc_base, sfa_smem_layout_staged, sfb_smem_layout_staged
    ):
        """SFA and SFB in TMEM, placed after the accumulator columns."""
        sfa_tmem_ptr = cute.recast_ptr(
            acc_tmem_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc_base), dtype=sf_dtype
        )
        # (MMA, MMA_M, MMA_K)
        tCtSFA = cute.make_tensor(
            sfa_tmem_ptr,
            blockscaled_utils.make_tmem_layout_sfa(
                tiled_mma, self.mma_tiler, self.sf_vec_size,
                cute.slice_(sfa_smem_layout_staged, (None, None, None, 0)),
            ),
        )
        sfb_tmem_ptr = cute.recast_ptr(
            acc_tmem_ptr
            + tcgen05.find_tmem_tensor_col_offset(tCtAcc_base)
            + tcgen05.find_tmem_tensor_col_offset(tCtSFA),
            dtype=sf_dtype,
        )
        # (MMA, MMA_N, MMA_K)
        tCtSFB = cute.make_tensor(
            sfb_tmem_ptr,
            blockscaled_utils.make_tmem_layout_sfb(
                tiled_mma, self.mma_tiler, self.sf_vec_size,
                cute.slice_(sfb_smem_layout_staged, (None, None, None, 0)),
            ),
        )
        return tCtSFA, tCtSFB

    def _s2t_copy_and_partition(self, sSF, tSF):
        """Scale copies shared memory -> TMEM (``tcgen05.cp``, issued by the leader CTA)."""
        # (MMA, MMA_MN, MMA_K, STAGE)
        tCsSF_compact = cute.filter_zeros(sSF)
        # (MMA, MMA_MN, MMA_K)
        tCtSF_compact = cute.filter_zeros(tSF)
        copy_atom_s2t = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(self.cta_group), sf_dtype)
        tiled_copy_s2t = tcgen05.make_s2t_copy(copy_atom_s2t, tCtSF_compact)
        thr_copy_s2t = tiled_copy_s2t.get_slice(0)
        # ((ATOM_V, REST_V), Rest_Tiler, MMA_MN, MMA_K, STAGE)
        tCsSF_compact_s2t = tcgen05.get_s2t_smem_desc_tensor(
            tiled_copy_s2t, thr_copy_s2t.partition_S(tCsSF_compact)
        )
        # ((ATOM_V, REST_V), Rest_Tiler, MMA_MN, MMA_K)
        tCtSF_compact_s2t = thr_copy_s2t.partition_D(tCtSF_compact)
        return tiled_copy_s2t, tCsSF_compact_s2t, tCtSF_compact_s2t

    def _epilog_tmem_copy_and_partition(self, tidx, tAcc, tCgC, epi_tile):
        """TMEM -> register copy of one epilogue subtile, partitioned for thread `tidx`."""
        copy_atom_t2r = sm100_utils.get_tmem_load_op(
            self.cta_tile_shape_mnk, self.c_layout, self.c_dtype, self.acc_dtype, epi_tile, True
        )
        # (EPI_TILE_M, EPI_TILE_N, EPI_M, EPI_N, STAGE)
        tAcc_epi = cute.flat_divide(tAcc[((None, None), 0, 0, None)], epi_tile)
        tiled_copy_t2r = tcgen05.make_tmem_copy(copy_atom_t2r, tAcc_epi[(None, None, 0, 0, 0)])
        thr_copy_t2r = tiled_copy_t2r.get_slice(tidx)
        # (T2R, T2R_M, T2R_N, EPI_M, EPI_N, STAGE)
        tTR_tAcc = thr_copy_t2r.partition_S(tAcc_epi)
        # (EPI_TILE_M, EPI_TILE_N, EPI_M, EPI_N, RestM, RestN, RestL)
        gC_mnl_epi = cute.flat_divide(tCgC[((None, None), 0, 0, None, None, None)], epi_tile)
        # (T2R, T2R_M, T2R_N, EPI_M, EPI_N, RestM, RestN, RestL)
        tTR_gC = thr_copy_t2r.partition_D(gC_mnl_epi)
        # (T2R, T2R_M, T2R_N)
        tTR_rAcc = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0, 0, 0, 0, 0)].shape, self.acc_dtype)
        return tiled_copy_t2r, tTR_tAcc, tTR_rAcc


def persistent_stage_bytes(tokens_per_tile: int) -> int:
    """Bytes one k-tile stage brings into each CTA of the pair (the kernel's
    num_tma_load_bytes / 2): 128 N rows of the problem's B, half the token rows of its A,
    both scale tiles (the tokens' scales whole, multicast), K tile 256 = 128 bytes a row."""
    k_bytes = K_TILE // 2
    sf_bytes_per_row = K_TILE // sf_vec_size
    return (
        128 * k_bytes
        + tokens_per_tile // 2 * k_bytes
        + 128 * sf_bytes_per_row
        + max(tokens_per_tile, 128) * sf_bytes_per_row
    )


# =============================================================================
# nvfp4_group_gemm/core/chain.py
# The fallback chain: its links and the process's demotions.
#
# ``KernelChoice`` (one link: a named kernel config), ``KernelChain`` (links made on first
# access), the demotion state shared by every runtime of the process (``DEMOTED``,
# ``SELF_CHECKED``, ``DEMOTION_LISTENERS``), the one lock (``RUNTIME_LOCK`` lives in config),
# ``choose_kernel`` and ``demote``.
# =============================================================================
@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """One named kernel config of a backend: a link of its fallback chain.

    `name` is the registry name (SM100_CHOICES, the library's sm_90 ones); `config` what is baked into
    the compiled code; `per_group_count`: compiled once per G (its identity includes G);
    `host`: computed by torch ops (the chain's last link, also the self-check's oracle);
    `chained`: an sm_100 link built with its calls chained by programmatic dependent launch
    (True) or plain (False), whatever SM100_CHAIN_CALLS says (chain_calls_as); None: as
    SM100_CHAIN_CALLS says when it is built (the registry's links, a host computation)."""

    backend: str
    name: str
    config: Any = None
    per_group_count: bool = False
    host: bool = False
    label: str | None = dataclasses.field(default=None, compare=False)  # the config's registry name
    chained: bool | None = None

    def kernel_key(self, num_groups: int) -> tuple:
        """The identity of the compiled kernel: what a demotion and a self-check are keyed on."""
        key = (self.backend, self.name, self.config, num_groups if self.per_group_count else None)
        return key if self.chained is None else (*key, "chained" if self.chained else "unchained")

    def title(self) -> str:
        """The name, and whether its calls chain where the link says."""
        return self.name if self.chained is None else f"{self.name} {'chained' if self.chained else 'unchained'}"

    def describe(self) -> str:
        if self.config is None:
            return self.title()
        return f"{self.title()} ({self.label or self.config})"


class KernelChain(collections.abc.Sequence):
    """A backend's chain for one size set, each link made on first access: choosing a
    fallback link's config can cost more than the first link's, and a call with new sizes
    (a MoE step) should pay only for the link it runs."""

    __slots__ = ("_links", "_makers")

    def __init__(self, makers: list[Callable[[], KernelChoice]]):
        self._makers = makers
        self._links: list[KernelChoice | None] = [None] * len(makers)

    def __len__(self) -> int:
        return len(self._makers)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        link = self._links[index]
        if link is None:
            link = self._links[index] = self._makers[index]()
        return link


c_of_group = operator.itemgetter(2)

# kernel_key -> why it was demoted; kernel keys whose first use agreed with the oracle. Shared
# by every runtime in the process (the library's too): a kernel found wrong is wrong for all.
DEMOTED: dict[tuple, str] = {}
SELF_CHECKED: set[tuple] = set()
# What a demotion calls: each runtime registers the dropping of its plans that run the demoted
# kernel (each called with the demoted kernel_key): this file's runtime first, at its import,
# then the library's
DEMOTION_LISTENERS: list[Callable[[tuple], None]] = []


def report(line: str) -> None:
    """One line on stderr, prefixed with the project's name."""
    print(f"nvfp4_group_gemm: {line}", file=sys.stderr, flush=True)


def is_demoted(kernel_key: tuple) -> bool:
    """Whether a compiled kernel (KernelChoice.kernel_key) was demoted in this process."""
    return kernel_key in DEMOTED


def demotions() -> dict[tuple, str]:
    """Every demotion of this process: kernel key -> why (a copy)."""
    return dict(DEMOTED)


def _next_usable(chain, num_groups: int, after: KernelChoice) -> str:
    later = list(chain)
    names = [c.title() for c in later[later.index(after) + 1:] if c.kernel_key(num_groups) not in DEMOTED]
    return names[0] if names else "nothing (the next call raises)"


def demote(backend_name: str, choice: KernelChoice, chain, num_groups: int, why: str) -> None:
    """Move `choice`'s compiled kernel down its chain for the rest of the process: record
    why, drop the plans that run it (their size sets plan again on their next call), and
    say so in one line."""
    key = choice.kernel_key(num_groups)
    with RUNTIME_LOCK:
        DEMOTED[key] = why
        for listener in DEMOTION_LISTENERS:
            listener(key)
    report(f"{backend_name} kernel {choice.describe()}, G = {num_groups}: {why}; "
           f"demoted for this process, next: {_next_usable(chain, num_groups, choice)}")


def choose_kernel(backend, chain, num_groups: int) -> KernelChoice:
    """The first link of `chain` that is not demoted and compiles; a compile failure
    demotes its link."""
    for choice in chain:
        if choice.kernel_key(num_groups) in DEMOTED:
            continue
        try:
            backend.compile(choice, num_groups)
        except Exception as error:  # noqa: BLE001 - any compile failure moves down the chain
            demote(backend.name, choice, chain, num_groups, f"compile failed ({one_line(error)})")
            continue
        return choice
    raise RuntimeError(f"no kernel of the {backend.name} chain {[c.name for c in chain]} is left: "
                       + "; ".join(f"{c.name}: {DEMOTED.get(c.kernel_key(num_groups))}" for c in chain))


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


def context_usable(device: torch.device) -> bool:
    """After a failed launch: can the context still run work (a synchronous launch error),
    or did a fault poison it (then nothing in-process can recover)?"""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - a sticky error: the context is gone
        return False
    return True


# =============================================================================
# nvfp4_group_gemm/core/launching.py
# The host runtime's parts both runtimes share: prepared launches, device tables, caches.
#
# ``PreparedCall``/``make_launcher`` (the only place that reaches into DSL internals), tile rows
# (``plan_tiles``, ``PackedTiles``), the packing and upload of int tables, ``RuntimeCache`` (bounded
# by count and bytes), the ``Backend`` protocol, ``PlanSpec``, ``Plan``, ``Binding``, and the
# device helpers of the host (``device_context``, ``current_device_index``).
# =============================================================================
# =============================================================================
# Shared host runtime (both backends)
# =============================================================================
# The only place that reaches into DSL internals (PreparedCall, device_executor): the packed argument array is built once and
# the entry point called directly, one C call instead of the DSL's argument conversion on
# every call (EXPERIMENTS E56). Checked against the pinned DSL version; anything else falls
# back to the plain call.
# NVFP4_PLAIN_LAUNCH=1 forces the plain call (to compare, or to rule the fast path out).
PREPARED_LAUNCH_DSL_VERSION = "4.3.5"


def _installed_dsl_version() -> str | None:
    try:
        return package_version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        return None


DSL_VERSION = _installed_dsl_version()


def device_executor(compiled):
    """compiled.to(None) once per device: the executor (its module loaded in the device's
    context) is the same for every input set of that kernel, so a new binding builds only its
    argument pack. Kept on the compiled function itself, per device index."""
    executors = compiled.__dict__.setdefault("_nvfp4_executors", {})
    device = current_device_index()
    executor = executors.get(device)
    if executor is None:
        executor = executors[device] = compiled.to(None)
    return executor


class PreparedCall:
    """``compiled`` called through its packed argument array: the one place that knows the
    DSL's internals (the execution arguments, the executor, the packed-argument builder, the C
    entry point). `prepare` returns None where the fast path does not apply (another DSL
    release, NVFP4_PLAIN_LAUNCH=1, or any change in those internals): the caller makes the
    plain call. `packed(addresses)` builds the packed array of other argument storage of the
    same layout (a binding's own cells); `launcher(packed)` the one-C-call launch of it."""

    __slots__ = ("capi_func", "cuda_result", "executor", "keepalive", "packed_args")

    @classmethod
    def prepare(cls, compiled, *args) -> "PreparedCall | None":
        if DSL_VERSION != PREPARED_LAUNCH_DSL_VERSION or FORCE_PLAIN_LAUNCH:
            return None
        try:
            prepared = cls()
            exe_args, adapted_args = compiled.generate_execution_args(*args)
            prepared.executor = device_executor(compiled)
            prepared.packed_args = prepared.executor._get_invoke_packed_args(list(exe_args))
            prepared.capi_func = prepared.executor.jit_module.capi_func
            prepared.cuda_result = prepared.executor.cuda_result
        except Exception:  # noqa: BLE001 - any change in DSL internals selects the plain call
            return None
        prepared.keepalive = (compiled, args, exe_args, adapted_args)
        return prepared

    def packed(self, addresses: list):
        """The packed argument array of argument storage at `addresses` (one per argument)."""
        return self.executor._get_invoke_packed_args(addresses)

    def launcher(self, packed_args=None) -> Callable[[], None]:
        """One C call of the entry point with `packed_args` (the prepared ones when None)."""
        capi_func, cuda_result = self.capi_func, self.cuda_result
        packed_args = self.packed_args if packed_args is None else packed_args

        def launch():
            capi_func(packed_args)
            if cuda_result is not None and cuda_result.value != 0:
                raise RuntimeError(f"kernel launch failed: CUresult {cuda_result.value}")

        launch.keepalive = (self, packed_args)
        return launch


def make_launcher(compiled, *args) -> Callable[[], None]:
    """Return a no-argument callable that runs ``compiled(*args)``.

    ``args`` must be DSL objects (cute Pointers, cutlass.Int32, ...) that stay
    alive as long as the launcher: the packed arguments point into them.
    """
    prepared = PreparedCall.prepare(compiled, *args)
    return (lambda: compiled(*args)) if prepared is None else prepared.launcher()


def plan_tiles(problem_sizes, tile_m: int, tile_n: int) -> list[tuple[int, int, int]]:
    """(group, tile_m, tile_n) of every output tile; groups with M = 0 have none.

    Order: group-major, then tile_m, then tile_n fastest, so CTAs that share an A tile
    (same group and tile_m) are launched next to each other and hit it in L2.
    """
    tiles = []
    for g, (m, n, _k, _l) in enumerate(problem_sizes):
        for tile_row in range(ceil_div(m, tile_m)):
            for tile_col in range(ceil_div(n, tile_n)):
                tiles.append((g, tile_row, tile_col))
    return tiles


class PackedTiles(collections.abc.Sequence):
    """A kernel's tile rows as it reads them: `data` holds int32 rows of `width`
    (little-endian), `count` of them; as a sequence, the rows as tuples. A size set's first
    call copies `data` into its tables as is (a MoE step: hundreds of rows per call)."""

    __slots__ = ("count", "data", "width")

    def __init__(self, data: bytes, width: int):
        self.data, self.width = data, width
        self.count = len(data) // (4 * width)

    @classmethod
    def of(cls, rows) -> "PackedTiles":
        """Rows (tuples of equal length) packed."""
        width = len(rows[0]) if rows else 1
        return cls(struct.pack(f"<{width * len(rows)}i", *flatten(rows)), width)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.count))]
        if not -self.count <= index < self.count:
            raise IndexError(index)
        return struct.unpack_from(f"<{self.width}i", self.data, 4 * self.width * (index % self.count))

    def __iter__(self):
        return struct.iter_unpack(f"<{self.width}i", self.data)


def align_up(x, a):
    return (x + a - 1) // a * a



def table_layout(tables) -> tuple[list[tuple[int, str, int, int, int]], int]:
    """Where each of `tables` ((struct code, rows of equal length)) lies in one buffer, each on
    a 128-byte boundary: ([(offset, code, rows, width, itemsize)], the buffer's bytes)."""
    layout, offset = [], 0
    for code, rows in tables:
        width = len(rows[0]) if rows else 1
        itemsize = struct.calcsize(code)
        layout.append((offset, code, len(rows), width, itemsize))
        offset = align_up(offset + max(len(rows), 1) * width * itemsize, 128)
    return layout, offset


def in_order(launchers: list[Callable[[], None]]) -> Callable[[], None]:
    """One launch that runs `launchers` in order (a pre-pass, then the GEMM); the one itself
    where there is one."""
    if len(launchers) == 1:
        return launchers[0]

    def launch_in_order():
        for launcher in launchers:
            launcher()

    launch_in_order.keepalive = launchers
    return launch_in_order


def upload_int_tables(device, tables) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Copy integer tables to `device` in one buffer: (the buffer, a [rows, width] view of each).

    `tables`: (struct code "q" or "i", rows of equal length), each starting on a 128-byte
    boundary. Packed in Python and copied as one buffer (half the CPU of one torch op per
    table: EXPERIMENTS E58), from pinned memory, so that the copy is queued with the launches
    that read it. On a CPU device (the tests) the host buffer itself.
    """
    device = torch.device(device)
    layout, offset = table_layout(tables)
    staging = bytearray(offset)
    for (start, code, count, width, _), (_, rows) in zip(layout, tables):
        struct.pack_into(f"<{count * width}{code}", staging, start, *flatten(rows))
    buffer = torch.frombuffer(staging, dtype=torch.uint8)
    if device.type == "cuda":
        # torch's pinned allocator keeps the block until the copy has run
        buffer = buffer.pin_memory().to(device, non_blocking=True)
    dtypes = {"q": torch.int64, "i": torch.int32}
    views = [
        buffer[start : start + count * width * itemsize].view(dtypes[code]).view(count, width)
        for start, code, count, width, itemsize in layout
    ]
    return buffer, views

class RuntimeCache:
    """Bounded LRU (count, and bytes where entries have `nbytes`); its entries are read and
    written by its methods only (``entries``: least recently used first)."""

    def __init__(self, max_entries: int = 64, max_bytes: int | None = None, pinned: Callable | None = None):
        """`pinned(entry)` True: the entry is never evicted (a plan a caller's CUDA graph reads),
        even past the bounds; a reset clears it."""
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.pinned = pinned
        self.nbytes = 0
        self.entries: collections.OrderedDict[tuple, Any] = collections.OrderedDict()

    def get(self, key):
        state = self.entries.get(key)
        if state is not None:
            self.entries.move_to_end(key)
        return state

    def get_input_set(self, data) -> tuple[Any, tuple | None]:
        """The hit path's lookup in a cache of input sets (by input_key): (the entry of this
        input set, touched, or None; its input_key, or None for malformed input, which full
        validation then names). The entry's `plan.problem_sizes` must equal the input set's:
        same buffers with other sizes are a miss.

        Hit: every pointer and the problem sizes equal those of an input set that passed
        validation. A hit does NOT re-check dtypes, strides or the plain sfa/sfb tensors: a
        tensor replaced by one with the same address and problem size but another dtype or
        layout would be read as the validated one. (input_key and get inlined: every Python
        frame saved is CPU time of every call.)"""
        try:
            key = (*map(data_address, flatten(data[0])), *map(data_address, flatten(data[2])))
            entry = self.entries.get(key)
            if entry is not None:
                self.entries.move_to_end(key)
                if tuple(data[3]) != entry.plan.problem_sizes:
                    entry = None  # same buffers, other sizes: check and bind again
        except Exception:  # noqa: BLE001 - malformed input of any kind goes to full validation
            return None, None
        return entry, key

    def put(self, key, state) -> list:
        """Insert `state`; return the entries evicted to stay within the bounds."""
        old = self.entries.pop(key, None)
        if old is not None:
            self.nbytes -= getattr(old, "nbytes", 0)
        self.entries[key] = state
        self.nbytes += getattr(state, "nbytes", 0)
        evicted = []
        while len(self.entries) > 1 and (
            len(self.entries) > self.max_entries
            or (self.max_bytes is not None and self.nbytes > self.max_bytes)
        ):
            if self.pinned is None:
                _, entry = self.entries.popitem(last=False)
            else:  # the least recently used entry that is neither pinned nor the one just put
                victim = next((k for k, e in self.entries.items() if k != key and not self.pinned(e)), None)
                if victim is None:
                    break
                entry = self.entries.pop(victim)
            self.nbytes -= getattr(entry, "nbytes", 0)
            evicted.append(entry)
        return evicted

    def drop(self, predicate: Callable) -> list:
        """Remove every entry whose value `predicate` selects (the byte count follows); return
        them, least recently used first."""
        dropped = [key for key, entry in self.entries.items() if predicate(entry)]
        removed = [self.entries.pop(key) for key in dropped]
        self.nbytes -= sum(getattr(entry, "nbytes", 0) for entry in removed)
        return removed

    def __len__(self):
        return len(self.entries)

    def __contains__(self, key):
        return key in self.entries

    def clear(self):
        self.entries.clear()
        self.nbytes = 0



@typing.runtime_checkable
class Backend(typing.Protocol):
    """A device family's kernels, as a runtime drives them: Sm100Backend here (the library
    beside this file has its own runtime and backends, and builds on these)."""

    name: str
    plan_key: tuple  # what a plan depends on besides the device and the sizes
    oracle: KernelChoice  # the self-check's reference computation (a host computation)

    def can_implement(self, problem_sizes) -> None:
        """Raise ValueError (group, field, value, rule) for sizes it cannot run at all."""

    def kernel_chain(self, problem_sizes) -> collections.abc.Sequence[KernelChoice]:
        """The kernels that can run these sizes, best first; the last is a host computation."""

    def family_choices(self, groups: int, n: int, k: int) -> list[KernelChoice]:
        """Every first link the automatic choice can pick for this (G, N, K), any M."""

    def prepare_device(self, device: torch.device) -> None:
        """Ask the driver now what a first plan on `device` would ask it."""

    def compile(self, choice: KernelChoice, num_groups: int) -> None:
        """Compile (cached) the kernels of `choice`; raise what the compiler raised."""

    def plan_tiles(self, problem_sizes, choice: KernelChoice | None = None) -> list[tuple[int, ...]]:
        """The tile rows of `choice` (its table, in launch order)."""

    def prepare(self, spec: "PlanSpec"):
        """Its part of a plan for spec.choice (compiled by then); `nbytes`: the device bytes it
        holds beyond the runtime's tables."""

    def write_descriptors(self, plan: "Plan", pointers: tuple, ptrs: torch.Tensor):
        """Per-pointer device state of an input set (TMA descriptors): `pointers` per group
        (a, b, c, sfa, sfb), `ptrs` their device table."""

    def launcher(self, plan: "Plan", binding: "Binding") -> Callable[[], None]:
        """The prepared launch of a bound input set."""


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """What a backend's prepare() is given: everything a plan is before its backend part,
    complete (the kernel chosen, its tile rows)."""

    choice: KernelChoice
    problem_sizes: tuple[tuple[int, int, int, int], ...]
    device: torch.device
    tile_rows: tuple[tuple[int, ...], ...]

    @property
    def num_groups(self) -> int:
        return len(self.problem_sizes)

    @property
    def num_tiles(self) -> int:
        return len(self.tile_rows)


class Plan:
    """What every input set of one size set shares on one device and backend.

    choice: the kernel of the backend's chain that runs these sizes (chosen, and compiled,
    before anything else is built: the tile rows are that kernel's); chain: the whole chain,
    for a demotion to name the next link. sizes int32 [G, 4]: (M, N, K, L) per group; tiles
    int32 [T, W]: the kernel's tile rows (none for a host computation; `tile_rows` given: a
    size plan's). backend_plan: what the backend's prepare(spec) made of them; None for a host
    computation. nbytes: device bytes held. The library's plan (nvfp4_group_gemm.runtime)
    extends this one at one seam, `upload`: where its tables are written."""

    __slots__ = (
        "backend", "backend_plan", "chain", "choice", "device", "kernel_key", "nbytes", "num_groups", "num_tiles",
        "problem_sizes", "sizes", "spec", "tables", "tile_rows", "tiles",
    )

    def __init__(self, backend, problem_sizes, device, choice: KernelChoice | None = None, chain=None,
                 tile_rows: tuple | None = None):
        self.backend = backend
        self.device = torch.device(device)
        self.problem_sizes = tuple(tuple(int(v) for v in p) for p in problem_sizes)
        self.num_groups = len(self.problem_sizes)
        if choice is None:  # a backend of one's choosing: its first kernel
            chain = backend.kernel_chain(self.problem_sizes)
            choice = chain[0]
        self.choice = choice
        self.chain = chain if chain is not None else (choice,)
        self.kernel_key = choice.kernel_key(self.num_groups)
        if tile_rows is None:
            tile_rows = () if choice.host else tuple(backend.plan_tiles(self.problem_sizes, choice))
        self.tile_rows = tile_rows
        self.num_tiles = len(self.tile_rows)
        self.spec = PlanSpec(choice, self.problem_sizes, self.device, self.tile_rows)
        self.tables, (self.sizes, self.tiles), table_bytes = self.upload(
            [("i", self.problem_sizes), ("i", self.tile_rows)])
        self.backend_plan = None if choice.host else backend.prepare(self.spec)
        self.nbytes = table_bytes + (0 if self.backend_plan is None else self.backend_plan.nbytes)

    def upload(self, tables) -> tuple[Any, list[torch.Tensor], int]:
        """(what holds `tables` on the plan's device, a view of each, its bytes): one buffer,
        copied in the order of the launches."""
        buffer, views = upload_int_tables(self.device, tables)
        return buffer, views, buffer.numel()


class Binding:
    """One input set (its data pointers) bound to its plan: the pointer table the kernel
    reads (ptrs int64 [G, 5]: a, b, c, sfa_reordered, sfb_reordered), the backend's
    per-pointer state (`bound`: the sm_100 TMA descriptors) and the prepared launch (None: a
    host computation, which custom_kernel runs on the input set itself). The library's binding
    extends this one at two seams: `upload` (a pointer table its first call wrote) and
    `prepare` (where and how its launches go)."""

    __slots__ = ("bound", "launch", "plan", "pointers", "ptrs", "table")

    def __init__(self, plan: Plan, pointers, table=None):
        self.plan = plan
        self.pointers = tuple(tuple(int(v) for v in p) for p in pointers)
        self.table, self.ptrs = self.upload(table)
        self.bound = None if plan.choice.host else plan.backend.write_descriptors(plan, self.pointers, self.ptrs)
        self.launch = self.prepare()

    def upload(self, table) -> tuple[Any, torch.Tensor]:
        """(what holds the pointer table on the device, its int64 [G, 5] view)."""
        buffer, (ptrs,) = upload_int_tables(self.plan.device, [("q", self.pointers)])
        return buffer, ptrs

    def prepare(self) -> Callable[[], None] | None:
        """The prepared launch; None for a host computation; no_launch where every group has
        M = 0 (a 0-CTA grid is invalid)."""
        if self.plan.choice.host:
            return None
        return self.plan.backend.launcher(self.plan, self) if self.plan.num_tiles else no_launch


def no_launch() -> None:
    pass

def pointers_of(data) -> list[tuple[int, int, int, int, int]]:
    abc, _, sfasfb_reordered, _ = data
    return [
        (a.data_ptr(), b.data_ptr(), c.data_ptr(), sfa.data_ptr(), sfb.data_ptr())
        for (a, b, c), (sfa, sfb) in zip(abc, sfasfb_reordered)
    ]


_NO_CONTEXT = contextlib.nullcontext()


def device_context(device: torch.device):
    """`device` made torch's current device for a block (nothing to do where it already is:
    the common case, which a new-size call otherwise pays in Python)."""
    if device.type != "cuda" or current_device_index() == device.index:
        return _NO_CONTEXT
    return torch.cuda.device(device.index)


def current_device_index() -> int | None:
    """torch's current CUDA device; None before CUDA is initialized (the CPU tests). One C
    call, without torch.cuda.current_device()'s lazy-init checks."""
    if not torch.cuda.is_initialized():
        return None
    return cuda_get_device() if cuda_get_device is not None else torch.cuda.current_device()
cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)


# =============================================================================
# nvfp4_group_gemm/core/self_check.py
# The first-use self-check, its tolerance, and the host computations.
#
# ``first_use_check`` compares the first input set a compiled kernel runs with the backend's
# oracle at the competition's tolerance, widened only by what fp32 accumulation may add
# (``accumulation_bounds``); a disagreement demotes the kernel. The host computations
# (``HOST_COMPUTATIONS``: torch._scaled_mm, the exact decode) are the chain's last links and the
# oracles.
# =============================================================================
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


# =============================================================================
# nvfp4_group_gemm/core/backend.py
# The sm_100 backend: the builds of every kernel, the kernel registry, ``Sm100Backend``.
#
# Builds (module-level functions, keyed by ``compile_key``) and their ``compile_*`` entries,
# ``compile_targets`` (what ``python eval.py compile`` builds), the persistent kernel's tile
# plan and token-tile rule, ``SM100_CHOICES`` (every kernel the automatic choice can pick), and
# ``Sm100Backend``: the chain per size set, plans, descriptors and prepared launches.
# =============================================================================
def per_tile_init_build(num_groups: int) -> tuple:
    return init_tensormaps_jit, (fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Int64),
                                 cutlass.Int32(num_groups))


def per_tile_gemm_build(num_groups: int) -> tuple:
    return gemm_jit, (fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Int64),
                      cutlass.Int32(1), cutlass.Int32(num_groups))


def compile_init_tensormaps(num_groups: int, options: str | None = None):
    """The per-tile kernel's descriptor init (its constants are the module's)."""
    return compile_once(per_tile_init_build, num_groups, options=options)


def compile_gemm(num_groups: int, options: str | None = None):
    """The per-tile GEMM (its constants are the module's)."""
    return compile_once(per_tile_gemm_build, num_groups, options=options)


def compile_targets() -> list[tuple[str, str, Callable[[int, str | None], Any]]]:
    """Kernels of this backend for the build report: (kernel name, arch, compile(G, options))."""
    targets = [
        ("sm100_init_tensormaps", SM100_ARCH, compile_init_tensormaps),
        ("sm100_gemm", SM100_ARCH, compile_gemm),
    ]
    for tokens, config in PERSISTENT_CONFIGS.items():
        # One build serves every G (G is a runtime value there); the report lists it per G
        targets += [
            (f"sm100_persistent_init_t{tokens}", config.arch,
             lambda g, options, config=config: compile_persistent_init(config, options)),
            (f"sm100_persistent_gemm_t{tokens}", config.arch,
             lambda g, options, config=config: compile_persistent_gemm(config, options)),
        ]
    return targets


def gmem_ptr(dtype, tensor: torch.Tensor):
    return make_ptr(dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)


def plan_persistent_tiles(problem_sizes, tokens_per_tile: int, mma_m: int = 256) -> list[tuple[int, int, int]]:
    """Tile list of the persistent kernel: (group, MMA m tile, MMA n tile) per entry.

    A tile covers `mma_m` rows of the problem's N and `tokens_per_tile` rows of its M (swap-AB).
    Order: groups by descending M (ties by group index), then N tile, then token tile fastest.
    Cluster c runs entries c, c + num_clusters, ..., so the clusters of one wave hold
    consecutive entries: they share a group's N slice of B, the operand that dominates the
    bytes, which is then read from DRAM once and from L2 by the others.
    """
    order = sorted(range(len(problem_sizes)), key=lambda g: (-problem_sizes[g][0], g))
    tiles = []
    for g in order:
        m, n, _k, _l = problem_sizes[g]
        for n_tile in range(ceil_div(n, mma_m)):
            for m_tile in range(ceil_div(m, tokens_per_tile)):  # none when M == 0
                tiles.append((g, n_tile, m_tile))
    return tiles


# sm_100 SMs a B200 has; the host reads the real count from the device when it has one
B200_NUM_SMS = 148


# Per-SM rates of the token-tile rule: the TMA load rate of a CTA, fitted by bench/b200_model.py to the
# published B200 times of the fastest public entry (122.7 KB/µs per SM), and the nvfp4 MMA rate
# that entry measured (5797 TFLOP/s over 148 SMs). A model's constants, not measurements here.
SM100_LOAD_BYTES_PER_US = 122_700
SM100_MMA_FLOP_PER_US = 5797.05e6 / 148


def persistent_k_tile_us(tokens_per_tile: int) -> float:
    """Modelled µs of one k-tile of a CTA of the pair: its stage's bytes at the per-SM load
    rate or its MMAs (128 N rows x tokens x 256 K), whichever is longer."""
    load_us = persistent_stage_bytes(tokens_per_tile) / SM100_LOAD_BYTES_PER_US
    mma_us = 2 * 128 * tokens_per_tile * K_TILE / SM100_MMA_FLOP_PER_US
    return max(load_us, mma_us)


def choose_tokens_per_tile(problem_sizes, num_sms: int = B200_NUM_SMS) -> int:
    """Tokens per tile (MMA N) of the persistent kernel for this input set.

    The DSL's 2-CTA block-scaled MMA takes N = 16..256 in steps of 16; the kernel compiles 128
    and 256, the two sizes NVIDIA's grouped block-scaled example runs with cta_group::2 (the
    tokens' scales are loaded as whole 128-row atoms, so other sizes waste them or need
    column offsets into TMEM). Rule: the size whose busiest CTA pair finishes first, its
    tiles' k-tiles at persistent_k_tile_us each; 128 on a tie. A k-tile of 256 tokens is
    MMA-bound (0.43 µs against 0.23 for 128), so 256 pays only where it removes tiles from
    the busiest pair: large M without a partial last wave. 128 also keeps two accumulators,
    so its epilogues overlap the next tile's mainloop.
    """
    num_clusters = max(num_sms // 2, 1)
    best = None
    for tokens_per_tile in (128, 256):
        tiles = plan_persistent_tiles(problem_sizes, tokens_per_tile)
        k_tiles_per_pair = [0] * num_clusters
        for index, (g, _n_tile, _m_tile) in enumerate(tiles):
            k_tiles_per_pair[index % num_clusters] += problem_sizes[g][2] // K_TILE
        cost = max(k_tiles_per_pair) * persistent_k_tile_us(tokens_per_tile)
        if best is None or cost < best[0]:
            best = (cost, tokens_per_tile)
    return best[1]


persistent_can_implement = PersistentGemmSm100.can_implement


def persistent_init_build(config: PersistentGemmConfig) -> tuple:
    return PersistentGemmSm100(config).init_tensormaps, (fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int32),
                                                         fake_ptr(cutlass.Int64), cutlass.Int32(1))


def persistent_gemm_build(config: PersistentGemmConfig) -> tuple:
    return PersistentGemmSm100(config), (fake_ptr(cutlass.Int32), fake_ptr(cutlass.Int64),
                                         cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1))


def compile_persistent_init(config: PersistentGemmConfig, options: str | None = None):
    """The persistent kernel's descriptor init for `config` (G is a runtime value)."""
    return compile_once(persistent_init_build, config, options=options)


def compile_persistent_gemm(config: PersistentGemmConfig, options: str | None = None):
    """The persistent GEMM for `config`; G, the tile count and the cluster count are runtime
    values, so one build serves every input set of that config."""
    return compile_once(persistent_gemm_build, config, options=options)


# The sm_100 registry: every kernel the automatic choice can pick, by name
SM100_CHOICES = {
    **{f"persistent_t{tokens}": KernelChoice("sm100", f"persistent_t{tokens}", config)
       for tokens, config in PERSISTENT_CONFIGS.items()},
    "per_tile": KernelChoice("sm100", "per_tile", per_group_count=True),
    # what the competition's reference runs on a B200: always correct there, only slow
    "scaled_mm": KernelChoice("sm100", "scaled_mm", host=True),
}


class Sm100Plan:
    """The sm_100 backend's part of a plan: which kernel runs these sizes (config None: the
    per-tile kernel), over how many CTA pairs, and whether its calls chain (its link's
    KernelChoice.chained: its kernels are looked up under chain_calls_as of it)."""

    __slots__ = ("chained", "config", "num_clusters")
    nbytes = 0  # no device buffers beyond the runtime's tables

    def __init__(self, config, num_clusters, chained: bool | None = None):
        self.config = config
        self.num_clusters = num_clusters
        self.chained = chained


def resident_clusters(device: torch.device, cluster_size: int = 2) -> int | None:
    """How many clusters of `cluster_size` CTAs can be resident at once on `device` (the
    examples' HardwareInfo().get_max_active_clusters); None off a GPU. More would run as a
    second persistent wave. Asked once per device."""
    if device.type != "cuda":
        return None
    key = (device.index, cluster_size)
    if key not in RESIDENT_CLUSTERS:
        try:
            RESIDENT_CLUSTERS[key] = int(utils.HardwareInfo(device.index).get_max_active_clusters(cluster_size))
        except Exception as error:  # noqa: BLE001 - a failed query must not fail the call
            report(f"the resident {cluster_size}-CTA cluster query failed ({one_line(error)}); "
                   "the persistent kernel runs one cluster per two SMs")
            RESIDENT_CLUSTERS[key] = None
    return RESIDENT_CLUSTERS[key]


RESIDENT_CLUSTERS: dict = {}


class Sm100Backend:
    """The B200 (sm_100a) backend.

    `kernel`: "persistent" (chain: PersistentGemmSm100 where persistent_can_implement allows,
    then the per-tile kernel, then torch._scaled_mm) or "per_tile" (chain: the per-tile
    kernel, then torch._scaled_mm)."""

    name = "sm100"
    oracle = SM100_CHOICES["scaled_mm"]

    def __init__(self, kernel: str = SM100_KERNEL, num_sms: int = B200_NUM_SMS):
        if kernel not in SM100_KERNELS:
            raise ValueError(f"SM100_KERNEL = {kernel!r}; rule: one of {SM100_KERNELS}")
        self.kernel = kernel
        self.num_sms = num_sms
        # Descriptors depend on the pointers and sizes: the per-tile kernel's not on C (input
        # sets that differ only in C share them), the persistent kernel's on C too (C is
        # stored by TMA). The init kernel runs only when one of those changed.
        self._descriptors = RuntimeCache(max_entries=64)

    @property
    def plan_key(self):
        """What, besides the device and the sizes, a plan of this backend depends on."""
        return (self.name, self.kernel, self.num_sms)

    def kernel_chain(self, problem_sizes) -> list[KernelChoice]:
        """The kernels that can run these sizes, best first; the last always can. With calls
        chained (SM100_CHAIN_CALLS), each kernel twice: chained, then the same kernel plain, so
        that a failure of the chaining alone (a launch with the attribute that fails, a chained
        self-check that disagrees) costs the chaining, not the kernel."""
        kernels = []
        if self.kernel == "persistent" and persistent_can_implement(problem_sizes) is None:
            kernels.append(SM100_CHOICES[f"persistent_t{choose_tokens_per_tile(problem_sizes, self.num_sms)}"])
        kernels.append(SM100_CHOICES["per_tile"])
        if SM100_CHAIN_CALLS:
            kernels = [dataclasses.replace(kernel, chained=chained) for kernel in kernels for chained in (True, False)]
        return [*kernels, SM100_CHOICES["scaled_mm"]]

    def can_implement(self, problem_sizes) -> None:
        """validate_inputs states every sm_100 constraint; input sets the persistent kernel
        cannot run get a chain without it."""

    def family_choices(self, groups: int, n: int, k: int) -> list[KernelChoice]:
        """Every kernel the automatic choice can pick for `groups` groups of this N and K,
        whatever their M (warmup compiles them): both token tiles of the persistent kernel
        where it runs (N % 8 == 0), else the per-tile kernel."""
        sizes = [(128, n, k, 1)] * groups
        if self.kernel == "persistent" and persistent_can_implement(sizes) is None:
            return [SM100_CHOICES["persistent_t128"], SM100_CHOICES["persistent_t256"]]
        return [SM100_CHOICES["per_tile"]]

    def prepare_device(self, device: torch.device) -> None:
        """What a first plan on `device` would otherwise ask the driver: its resident clusters."""
        resident_clusters(device)

    def compile(self, choice: KernelChoice, num_groups: int) -> None:
        """Compile (cached) the kernels of `choice`; raises what the compiler raised."""
        with chain_calls_as(choice.chained):
            if choice.name == "per_tile":
                self.compile_per_tile_init(num_groups)
                self.compile_per_tile_gemm(num_groups)
            elif not choice.host:
                self.compile_persistent_init(choice.config)
                self.compile_persistent_gemm(choice.config)

    def plan_tiles(self, problem_sizes, choice: KernelChoice | None = None) -> list[tuple[int, ...]]:
        """Tile rows of `choice` (the chain's first when None): (group, tile_m, tile_n) of
        128x128 tiles for the per-tile kernel; (group, MMA m tile, MMA n tile, k-tiles) for
        the persistent kernel."""
        if choice is None:
            choice = self.kernel_chain(problem_sizes)[0]
        if choice.name == "per_tile":
            return plan_tiles(problem_sizes, mma_tiler_mnk[0], mma_tiler_mnk[1])
        config = choice.config
        k_tiles = [size[2] // K_TILE for size in problem_sizes]
        return [
            (g, n_tile, m_tile, k_tiles[g])
            for g, n_tile, m_tile in plan_persistent_tiles(problem_sizes, config.tokens_per_tile, config.mma_m)
        ]

    def pack_tiles(self, problem_sizes, choice: KernelChoice) -> "PackedTiles":
        """plan_tiles' rows packed (a size set's first call: this backend has no DirectLaunch,
        so only the binding path reads them)."""
        return PackedTiles.of(self.plan_tiles(problem_sizes, choice))

    def prepare(self, spec: "PlanSpec") -> Sm100Plan:
        """Compile (cached) the kernels of the spec's choice; CTA pairs: min(tiles, SMs / 2,
        the device's resident 2-CTA clusters)."""
        choice = spec.choice
        self.compile(choice, spec.num_groups)
        if choice.name == "per_tile":
            return Sm100Plan(None, 0, choice.chained)
        num_clusters = min(spec.num_tiles, max(self.num_sms // 2, 1))
        resident = resident_clusters(spec.device)
        if resident is not None:
            num_clusters = min(num_clusters, resident)
        return Sm100Plan(choice.config, max(num_clusters, 1), choice.chained)

    # The compiled functions this backend launches, looked up at each use (the CPU tests
    # replace the module's compilers); the library's backend of the same kernels returns entries
    # that also take where the launch goes.
    def compile_per_tile_init(self, num_groups: int):
        return compile_init_tensormaps(num_groups)

    def compile_per_tile_gemm(self, num_groups: int):
        return compile_gemm(num_groups)

    def compile_persistent_init(self, config: PersistentGemmConfig):
        return compile_persistent_init(config)

    def compile_persistent_gemm(self, config: PersistentGemmConfig):
        return compile_persistent_gemm(config)

    def descriptor_key(self, plan: "Plan", pointers: tuple) -> tuple:
        """What the descriptors of an input set depend on: the device, the kernel config, the
        sizes and the pointers they address."""
        config = plan.backend_plan.config
        slots = (PTR_A, PTR_B, PTR_SFA, PTR_SFB) if config is None else (PTR_A, PTR_B, PTR_C, PTR_SFA, PTR_SFB)
        return (str(plan.device), config, plan.problem_sizes, tuple(tuple(p[i] for i in slots) for p in pointers))

    def init_descriptors(self, plan: "Plan", ptrs: torch.Tensor, *launch_args) -> torch.Tensor:
        """A new descriptor buffer of every group of this input set, written by the config's
        init kernel (`launch_args` follow its other arguments: the library's entries take
        where the launch goes)."""
        config = plan.backend_plan.config
        with chain_calls_as(plan.backend_plan.chained):
            if config is None:
                init_fn, num_slots = self.compile_per_tile_init(plan.num_groups), num_tensormaps
            else:
                init_fn, num_slots = self.compile_persistent_init(config), PERSISTENT_NUM_TENSORMAPS
        tensormaps = torch.empty(
            (plan.num_groups, num_slots, bytes_per_tensormap // 8), dtype=torch.int64, device=plan.device
        )
        init_fn(
            gmem_ptr(cutlass.Int64, ptrs),
            gmem_ptr(cutlass.Int32, plan.sizes),
            gmem_ptr(cutlass.Int64, tensormaps),
            cutlass.Int32(plan.num_groups),
            *launch_args,
        )
        return tensormaps

    def write_descriptors(self, plan: "Plan", pointers: tuple, ptrs: torch.Tensor) -> torch.Tensor:
        """TMA descriptors of every group of this input set: reused, or written now by an init
        kernel."""
        key = self.descriptor_key(plan, pointers)
        tensormaps = self._descriptors.get(key)
        if tensormaps is None:
            tensormaps = self.init_descriptors(plan, ptrs)
            self._descriptors.put(key, tensormaps)
        return tensormaps

    def gemm_args(self, plan: "Plan", tensormaps: torch.Tensor, ptrs: torch.Tensor, *launch_args):
        """(compiled GEMM, its arguments) for this input set: its descriptors and pointer
        table, then `launch_args` (as init_descriptors)."""
        config = plan.backend_plan.config
        with chain_calls_as(plan.backend_plan.chained):
            gemm = self.compile_persistent_gemm(config) if config is not None else self.compile_per_tile_gemm(
                plan.num_groups)
        if config is not None:
            return gemm, (
                gmem_ptr(cutlass.Int32, plan.tiles),
                gmem_ptr(cutlass.Int64, tensormaps),
                cutlass.Int32(plan.num_groups),
                cutlass.Int32(plan.num_tiles),
                cutlass.Int32(plan.backend_plan.num_clusters),
                *launch_args,
            )
        return gemm, (
            gmem_ptr(cutlass.Int64, ptrs),
            gmem_ptr(cutlass.Int32, plan.sizes),
            gmem_ptr(cutlass.Int32, plan.tiles),
            gmem_ptr(cutlass.Int64, tensormaps),
            cutlass.Int32(plan.num_tiles),
            cutlass.Int32(plan.num_groups),
            *launch_args,
        )

    def launcher(self, plan: "Plan", binding: "Binding") -> Callable[[], None]:
        """The prepared launch of a bound input set (make_launcher: its arguments converted once)."""
        compiled, args = self.gemm_args(plan, binding.bound, binding.ptrs)
        return make_launcher(compiled, *args)


# =============================================================================
# nvfp4_group_gemm/core/runtime.py
# The leaderboard file's runtime: plans, bindings, ``custom_kernel``.
#
# ``Runtime``: the one plan-and-binding machine (caches, eviction, drop on demotion, reset, the
# miss path), which the library's entries extend; this file's instance of it, ``RUNTIME``: input
# sets (bindings) by data pointers, plans by (device, sizes, backend); the hit path is one
# prepared launch. Also ``reset_runtime`` (every runtime of the process) and ``warmup``.
# =============================================================================
# =============================================================================
# The runtime: plans, bindings, custom_kernel
# =============================================================================
# Every runtime of the process (this file's; the library adds its per-size-set and MoE
# entries'): a demotion drops the plans of each, reset_runtime resets each
RUNTIMES: list = []


class Runtime:
    """The one plan-and-binding machine every entry runs on.

    `plans`: by the entry's plan key, bounded by count and bytes (`pinned` plans are never
    evicted); `bindings`: by the entry's binding key, each with its `.plan` (None: a marker,
    such as an input set seen once); an evicted or dropped plan's bindings go with it.
    `plan_caches`: the entry's other caches whose values are dropped with the plans a predicate
    selects (size plans); `caches`: the rest, cleared by a reset. What the caches evict or drop
    is handed to `retire`.

    The per-size-set entry's miss path is here (`bound_input_set`: validate, plan on the
    first kernel of the chain that is not demoted and compiles, bind, demote and fall back);
    the entry's own hit path and first-use check around it. The library's runtimes extend it at
    its seams (`retire`, `before_miss`, `unbound_call`, `make_plan`, `make_binding`,
    `context_usable`, `first_use_check`, `select_backend`): where launches go (the callers'
    queues) and graph captures, which this file must not have."""

    plan_type = Plan
    binding_type = Binding

    def __init__(self, name: str, *, max_bindings: int = 64, max_plans: int = 32,
                 max_plan_bytes: int | None = 1 << 30, pinned=None):
        self.name = name
        self.bindings = RuntimeCache(max_entries=max_bindings)
        self.plans = RuntimeCache(max_entries=max_plans, max_bytes=max_plan_bytes, pinned=pinned)
        self.plan_caches: list[RuntimeCache] = []
        self.caches: list = []
        DEMOTION_LISTENERS.append(self.forget_kernel)
        RUNTIMES.append(self)

    # --- the caches: one eviction cascade, one drop, one reset --------------------------------
    def retire(self, entries) -> None:
        """What the caches evicted or dropped (here let go at once: launches on the one queue
        are ordered before any reuse of their memory)."""

    def put_plan(self, key, plan) -> None:
        """Cache `plan`; the plans evicted to stay within the bounds go with their bindings."""
        evicted = self.plans.put(key, plan)
        if evicted:
            self.retire(evicted)
            self.drop_bindings(lambda bound_plan: any(bound_plan is gone for gone in evicted))

    def put_binding(self, key, binding) -> None:
        self.retire(self.bindings.put(key, binding))

    def drop_bindings(self, predicate) -> None:
        """Remove the bindings whose plan `predicate` selects (markers without one stay)."""
        self.retire(self.bindings.drop(lambda binding: binding.plan is not None and predicate(binding.plan)))

    def drop_plans(self, predicate) -> None:
        """Remove the plans (and plan-like entries of `plan_caches`) that `predicate` selects,
        and their bindings; the byte counts follow (RuntimeCache.drop)."""
        self.retire(self.plans.drop(predicate))
        for cache in self.plan_caches:
            self.retire(cache.drop(predicate))
        self.drop_bindings(predicate)

    def forget_kernel(self, kernel_key: tuple) -> None:
        """A demotion (by any runtime of the process): drop the plans that run the kernel and
        their bindings (their sizes plan again on their next call, on the next link)."""
        self.drop_plans(lambda plan: plan.kernel_key == kernel_key)

    def reset(self) -> None:
        """Forget every plan and binding (compiled kernels stay)."""
        for cache in (self.bindings, self.plans, *self.plan_caches, *self.caches):
            cache.clear()

    # --- the seams ------------------------------------------------------------------------------
    def select_backend(self, device_index: int):
        return select_backend(device_index)

    def before_miss(self) -> None:
        """Under the lock, before a miss looks at the caches."""

    def unbound_call(self, data, key: tuple, problem_sizes):
        """A call of an input set without a binding: its outputs, or None (bind it)."""
        return

    def make_plan(self, backend, problem_sizes, device: torch.device) -> Plan:
        """A plan of these sizes on the first kernel of the chain that is not demoted and
        compiles (under the lock)."""
        backend.can_implement(problem_sizes)
        chain = backend.kernel_chain(problem_sizes)
        return self.plan_type(backend, problem_sizes, device, choose_kernel(backend, chain, len(problem_sizes)), chain)

    def make_binding(self, plan: Plan, key: tuple, problem_sizes) -> Binding:
        return self.binding_type(plan, pointers_of_key(key, len(problem_sizes)))

    def context_usable(self, device: torch.device) -> bool:
        return context_usable(device)

    def first_use_check(self, data, plan: Plan) -> list[torch.Tensor]:
        return first_use_check(data, plan)

    # --- the miss path --------------------------------------------------------------------------
    def plan(self, backend, problem_sizes, device: torch.device) -> Plan:
        """The cached plan of these sizes on `device` for `backend`, or a new one (make_plan)."""
        key = (str(device), problem_sizes, backend.plan_key)
        plan = self.plans.get(key)
        if plan is None:
            with RUNTIME_LOCK:
                plan = self.make_plan(backend, problem_sizes, device)
            self.put_plan(key, plan)
        return plan

    def new_binding(self, backend, problem_sizes, device, key: tuple) -> Binding:
        """A binding on the plan of these sizes. Writing its descriptors launches the chosen
        kernel's init kernel: a failure there that leaves the context usable demotes that
        kernel, and the binding is made on the next link's plan."""
        while True:
            plan = self.plan(backend, problem_sizes, device)
            try:
                return self.make_binding(plan, key, problem_sizes)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:
                if plan.choice.host or not self.context_usable(plan.device):
                    raise
                demote(backend.name, plan.choice, plan.chain, plan.num_groups,
                       f"descriptor init failed ({one_line(error)})")

    def bound_input_set(self, data, key: tuple | None):
        """The validating path for an input set of input_key `key` (None: not computed, the
        input may be malformed): checked sizes, then the cached binding of these pointers,
        the outputs of a call without a binding (unbound_call), or a new binding on the plan of
        these sizes. One thread at a time (compilation and the caches)."""
        key, problem_sizes = checked_input(data, key)
        with RUNTIME_LOCK:
            self.before_miss()
            binding = self.bindings.get(key)
            if binding is None or binding.plan.problem_sizes != problem_sizes:
                outputs = self.unbound_call(data, key, problem_sizes)
                if outputs is not None:
                    return outputs
                device = data[0][0][0].device
                try:
                    with device_context(device):
                        binding = self.new_binding(self.select_backend(device.index), problem_sizes, device, key)
                except torch.OutOfMemoryError as error:
                    raise torch.OutOfMemoryError(
                        f"custom_kernel: out of GPU memory while building the plan or binding of sizes "
                        f"{list(problem_sizes)}; nothing was cached, a later call builds it again "
                        f"({one_line(error)})"
                    ) from error
                self.put_binding(key, binding)
        return binding

    def after_failed_launch(self, plan: Plan, error: Exception) -> None:
        """A launch raised: demote its kernel (the caller computes the call again, on the next
        link) if the context is still usable; re-raise otherwise."""
        if not self.context_usable(plan.device):
            raise error
        demote(plan.backend.name, plan.choice, plan.chain, plan.num_groups, f"launch failed ({one_line(error)})")


# This file's runtime: input sets (bindings) by data pointers, plans by (device, sizes,
# backend): 32 plans and 1 GiB at most; a binding holds its pointer table and descriptors, and
# an evicted plan's bindings go with it.
RUNTIME = Runtime("submission")
_BACKEND_BY_DEVICE: dict = {}


def select_backend(device_index: int) -> Sm100Backend:
    """The sm_100 backend of GPU `device_index` (made once); on any other GPU a RuntimeError
    that names the entry to use there."""
    backend = _BACKEND_BY_DEVICE.get(device_index)
    if backend is None:
        major, minor = torch.cuda.get_device_capability(device_index)
        if major != 10:
            raise RuntimeError(
                f"GPU {device_index} ({torch.cuda.get_device_name(device_index)}) is sm_{major}{minor}; "
                f"submission.py runs {SUPPORTED_GPUS} only: elsewhere use the library beside it, "
                "`from nvfp4_group_gemm import custom_kernel` (examples/library_submission.py for a harness)"
            )
        num_sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        backend = _BACKEND_BY_DEVICE[device_index] = Sm100Backend(SM100_KERNEL, num_sms)
    return backend


def custom_kernel(data: input_t) -> output_t:
    """Compute every group's C into its `c` tensor and return [c_0, ..., c_{G-1}]."""
    binding, key = RUNTIME.bindings.get_input_set(data)
    first_use = binding is None
    if first_use:
        binding = RUNTIME.bound_input_set(data, key)
    launch = binding.launch
    if launch is None:  # a host computation (the chain's last link)
        return HOST_COMPUTATIONS[binding.plan.choice.name](data, list(map(c_of_group, data[0])))
    try:
        launch()
    except Exception as error:  # noqa: BLE001 - a failed launch moves its kernel down the chain
        RUNTIME.after_failed_launch(binding.plan, error)
        return custom_kernel(data)
    if first_use and binding.plan.kernel_key not in SELF_CHECKED:
        return first_use_check(data, binding.plan)
    return list(map(c_of_group, data[0]))


def binding_of(key: tuple):
    """The binding of the input set of input_key `key` (touched as most recently used); None
    before its first call, or after an eviction or a demotion dropped it. For tools
    (selfcheck): the bindings' cache stays the runtime's."""
    return RUNTIME.bindings.get(key)


def reset_runtime() -> None:
    """Forget every input set, plan, backend, demotion and self-check result of every runtime
    of the process (compiled kernels stay): the process as it was before its first call, for
    tests and for a caller that changed a switch (the library's runtime reads its switches again
    in its reset). Every runtime is reset; the first error one raised is raised after."""
    with RUNTIME_LOCK:
        _BACKEND_BY_DEVICE.clear()
        DEMOTED.clear()
        SELF_CHECKED.clear()
        RESIDENT_CLUSTERS.clear()
        first_error = None
        for runtime in RUNTIMES:
            try:
                runtime.reset()
            except Exception as error:  # noqa: BLE001 - the others are reset all the same
                first_error = first_error or error
        if first_error is not None:
            raise first_error


def check_family(n: int, k: int, groups: int) -> None:
    """warmup's argument rules: TypeError or ValueError naming the field, value and rule."""
    for field, value, valid, rule in (
        ("groups", groups, lambda v: 1 <= v <= MAX_GROUPS, f"an int, 1 <= groups <= {MAX_GROUPS}"),
        ("n", n, lambda v: v >= 1, "an int >= 1"),
        ("k", k, lambda v: v >= K_TILE and v % K_TILE == 0, f"an int, a positive multiple of {K_TILE}"),
    ):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"warmup: {field} = {value!r}; rule: {rule}")
        if not valid(value):
            raise ValueError(f"warmup: {field} = {value!r}; rule: {rule}")


def compile_family(backend, device: torch.device, n: int, k: int, groups: int) -> list[str]:
    """Compile every kernel `backend`'s automatic choice can pick for `groups` groups of N = n
    and K = k, whatever their M, on `device`; the kernels compiled (a compile failure demotes
    the kernel, as in a call)."""
    compiled = []
    with RUNTIME_LOCK, device_context(device):
        backend.prepare_device(device)
        # what follows a first link in this family's chains (its fallbacks), for the demotion line
        fallbacks = list(backend.kernel_chain([(128, n, k, 1)] * groups))[1:]
        for choice in backend.family_choices(groups, n, k):
            if choice.kernel_key(groups) in DEMOTED:
                continue
            try:
                backend.compile(choice, groups)
            except Exception as error:  # noqa: BLE001 - as in a call: the kernel moves down its chain
                demote(backend.name, choice, [choice, *fallbacks], groups, f"compile failed ({one_line(error)})")
                continue
            compiled.append(choice.describe())
    return compiled


def warmup(n: int, k: int, groups: int, device=None) -> list[str]:
    """Compile every kernel the automatic choice can pick for `groups` groups of N = n and
    K = k, whatever their M, on `device` (the current CUDA device when None), so that no later
    call of that family compiles: a serving engine calls it once per (G, N, K) at start-up.
    Returns the kernels compiled (a compile failure demotes the kernel, as in a call)."""
    check_family(n, k, groups)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return compile_family(select_backend(device.index), device, n, k, groups)
