"""The leaderboard file's sm_100a kernels launched on the caller's stream: @cute.jit entries
that reuse the file's set-up (``per_tile_init_launch``, ``per_tile_gemm_launch``,
``PersistentGemmSm100.init_tensormaps_launch`` / ``gemm_launch``) and device code, and add
where the launch goes; the backend the library's runtime drives on a B200. The launch geometry
the file's helpers return carries its programmatic-dependent attribute
(``core.chained_launch``, switch ``NVFP4_SM100_CHAIN_CALLS``), so these launches chain
to the kernel before them on the caller's stream as the file's own do. Compiled for sm_100a
and checked on a CPU only, as the file's own entries."""

import cuda.bindings.driver as cuda
import cutlass
import torch
from cutlass import cute

from nvfp4_group_gemm import core

from .launch import Written, stream_for_current


@cute.jit
def per_tile_init_on_stream(
    ptr_of_ptrs: cute.Pointer,
    ptr_of_sizes: cute.Pointer,
    ptr_of_tensormaps: cute.Pointer,
    num_groups: cutlass.Int32,
    stream: cuda.CUstream,
):
    kernel, geometry = core.per_tile_init_launch(ptr_of_ptrs, ptr_of_sizes, ptr_of_tensormaps, num_groups)
    kernel.launch(**geometry, stream=stream)


@cute.jit
def per_tile_gemm_on_stream(
    ptr_of_ptrs: cute.Pointer,
    ptr_of_sizes: cute.Pointer,
    ptr_of_tiles: cute.Pointer,
    ptr_of_tensormaps: cute.Pointer,
    num_tiles: cutlass.Int32,
    num_groups: cutlass.Int32,
    stream: cuda.CUstream,
):
    kernel, geometry = core.per_tile_gemm_launch(
        ptr_of_ptrs, ptr_of_sizes, ptr_of_tiles, ptr_of_tensormaps, num_tiles, num_groups
    )
    kernel.launch(**geometry, stream=stream)


class PersistentGemmOnStream(core.PersistentGemmSm100):
    """PersistentGemmSm100 whose entries take the stream to launch on."""

    @cute.jit
    def init_tensormaps(
        self,
        ptr_of_ptrs: cute.Pointer,
        ptr_of_sizes: cute.Pointer,
        ptr_of_tensormaps: cute.Pointer,
        num_groups: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        kernel, geometry = self.init_tensormaps_launch(ptr_of_ptrs, ptr_of_sizes, ptr_of_tensormaps, num_groups)
        kernel.launch(**geometry, stream=stream)

    @cute.jit
    def __call__(
        self,
        ptr_of_tiles: cute.Pointer,
        ptr_of_tensormaps: cute.Pointer,
        num_groups: cutlass.Int32,
        num_tiles: cutlass.Int32,
        num_clusters: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        kernel, geometry = self.gemm_launch(ptr_of_tiles, ptr_of_tensormaps, num_groups, num_tiles, num_clusters)
        kernel.launch(**geometry, stream=stream)


def _ptr(dtype):
    return core.fake_ptr(dtype)


def per_tile_init_build(num_groups: int) -> tuple:
    return per_tile_init_on_stream, (_ptr(cutlass.Int64), _ptr(cutlass.Int32), _ptr(cutlass.Int64),
                                     cutlass.Int32(num_groups), cuda.CUstream(0))


def per_tile_gemm_build(num_groups: int) -> tuple:
    return per_tile_gemm_on_stream, (_ptr(cutlass.Int64), _ptr(cutlass.Int32), _ptr(cutlass.Int32), _ptr(cutlass.Int64),
                                     cutlass.Int32(1), cutlass.Int32(num_groups), cuda.CUstream(0))


def persistent_init_build(config) -> tuple:
    return PersistentGemmOnStream(config).init_tensormaps, (
        _ptr(cutlass.Int64), _ptr(cutlass.Int32), _ptr(cutlass.Int64), cutlass.Int32(1), cuda.CUstream(0))


def persistent_gemm_build(config) -> tuple:
    return PersistentGemmOnStream(config), (_ptr(cutlass.Int32), _ptr(cutlass.Int64), cutlass.Int32(1),
                                            cutlass.Int32(1), cutlass.Int32(1), cuda.CUstream(0))


# Each build's key (core.compile_key) holds its argument and whether its launch chains to the
# kernel before it (core.SM100_CHAIN_CALLS, read when it is traced)
def compile_per_tile_init(num_groups: int, options: str | None = None):
    return core.compile_once(per_tile_init_build, num_groups, options=options)


def compile_per_tile_gemm(num_groups: int, options: str | None = None):
    return core.compile_once(per_tile_gemm_build, num_groups, options=options)


def compile_persistent_init(config, options: str | None = None):
    return core.compile_once(persistent_init_build, config, options=options)


def compile_persistent_gemm(config, options: str | None = None):
    return core.compile_once(persistent_gemm_build, config, options=options)


def compile_targets():
    """This module's kernels for the build report: (kernel name, arch, compile(G, options))."""
    targets = [
        ("sm100_init_tensormaps_on_stream", core.SM100_ARCH, compile_per_tile_init),
        ("sm100_gemm_on_stream", core.SM100_ARCH, compile_per_tile_gemm),
    ]
    for tokens, config in core.PERSISTENT_CONFIGS.items():
        targets += [
            (f"sm100_persistent_init_t{tokens}_on_stream", config.arch,
             lambda g, options, config=config: compile_persistent_init(config, options)),
            (f"sm100_persistent_gemm_t{tokens}_on_stream", config.arch,
             lambda g, options, config=config: compile_persistent_gemm(config, options)),
        ]
    return targets


class Sm100StreamPlan:
    """core.Sm100Plan as the library's runtime reads it: no scratch shared between input
    sets, graph replay allowed."""

    __slots__ = ("chained", "config", "num_clusters")
    nbytes = 0
    shared_scratch = False
    graph_launch = True

    def __init__(self, plan):
        self.config, self.num_clusters, self.chained = plan.config, plan.num_clusters, plan.chained

    def record_stream(self, stream) -> None:
        pass


class Sm100StreamBackend(core.Sm100Backend):
    """The leaderboard file's sm_100 backend (chain, tiles, descriptors) with launches on the
    caller's stream."""

    def compile_per_tile_init(self, num_groups: int):
        return compile_per_tile_init(num_groups)

    def compile_per_tile_gemm(self, num_groups: int):
        return compile_per_tile_gemm(num_groups)

    def compile_persistent_init(self, config):
        return compile_persistent_init(config)

    def compile_persistent_gemm(self, config):
        return compile_persistent_gemm(config)

    def prepare(self, spec) -> Sm100StreamPlan:
        return Sm100StreamPlan(super().prepare(spec))

    def write_descriptors(self, plan, pointers: tuple, ptrs: torch.Tensor) -> Written:
        """TMA descriptors of every group of this input set, a Written (the buffer, the event
        after its writing): reused, or written by an init kernel on the current stream."""
        key = self.descriptor_key(plan, pointers)
        written = self._descriptors.get(key)
        if written is None:
            stream = stream_for_current()
            # the init kernel reads the plan's sizes, which another stream may have written (a
            # plan made there): it waits for that writing, as the GEMM's launch does
            plan.tables.order_before(stream)
            if plan.device.type == "cuda":
                plan.tables.value.record_stream(torch.cuda.current_stream(plan.device))
            written = Written(self.init_descriptors(plan, ptrs, stream), plan.device)
            self._descriptors.put(key, written)
        return written

    def direct_launch(self, spec) -> None:
        """None: every sm_100 launch reads TMA descriptors, which an init kernel writes per
        input set (a binding)."""
        return

    def launch_args(self, plan, binding, stream: cuda.CUstream):
        """(compiled GEMM, its arguments) for this input set on `stream`."""
        return self.gemm_args(plan, binding.bound.value, binding.ptrs, stream)
