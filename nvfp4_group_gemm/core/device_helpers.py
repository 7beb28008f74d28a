"""Device helpers of both sm_100a kernels: TMA descriptor addresses, the tensormap
fences and prefetch, and the grid-dependency instructions of chained calls."""

from cutlass import cute
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

from .config import num_tensormaps


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
