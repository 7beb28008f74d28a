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


import sys
import types

from . import (
    backend,
    chain,
    config,
    device_helpers,
    launching,
    per_tile,
    persistent,
    runtime,
    self_check,
    validation,
)

# In dependency order: the order `python -m nvfp4_group_gemm.bundle` concatenates them in
ROOMS = (config, validation, device_helpers, per_tile, persistent, chain, launching, self_check, backend, runtime)
# Names a room rebinds while it runs (config.chain_calls_as: `global SM100_CHAIN_CALLS`): read
# from their room at each access (a property of the module's class), never copied here
LIVE_NAMES = frozenset({"SM100_CHAIN_CALLS"})


def _gather(namespace: dict) -> None:
    """Every global of every room into `namespace` (core.X): one object per name, since a
    room that imports a name holds the object of the room that defines it."""
    for room in ROOMS:
        for name, value in vars(room).items():
            if name.startswith("__") or name in LIVE_NAMES or any(value is r for r in ROOMS):
                continue
            if name in namespace and namespace[name] is not value:
                raise ImportError(f"nvfp4_group_gemm.core: {name!r} names two objects in its rooms")
            namespace[name] = value


def _read_live(name: str) -> property:
    return property(lambda _module: getattr(config, name))


class _OneNamespace(types.ModuleType):
    """core.X = value (a test's monkeypatch, a caller's switch) sets X in every room that holds
    it, as one assignment does in the bundled file; a name no room holds is set here alone."""

    SM100_CHAIN_CALLS = _read_live("SM100_CHAIN_CALLS")  # every name of LIVE_NAMES

    def __setattr__(self, name: str, value) -> None:
        if not name.startswith("__"):
            for room in ROOMS:
                if name in vars(room):
                    setattr(room, name, value)
            if name in LIVE_NAMES:
                return
        super().__setattr__(name, value)


_gather(globals())
sys.modules[__name__].__class__ = _OneNamespace
