"""The leaderboard file's switches, the sm_100a constants, and the compile cache.

Every NVFP4_* switch of the leaderboard file is read here, once, at import (``env_switch``).
``SM100_CHAIN_CALLS`` lives with the two readers that must see it change under
``chain_calls_as``: ``chained_launch`` (the traced launches) and ``compile_key`` (the cache
key), so a build under one setting is never found under the other."""

import contextlib
import os
import threading
from collections.abc import Callable

import cutlass
from cutlass import cute
from cutlass.cute.nvgpu import tcgen05
from cutlass.cute.runtime import make_ptr

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
