"""The backend protocol implementation submission.py's host runtime drives on sm_90 GPUs."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import torch
from cutlass import cute
from cutlass.cute.runtime import make_ptr

from .config import CTAS_PER_SM, HopperGemmConfig, can_implement
from .kernel import compile_gemm
from .schedules import StreamKPlan, choose_config


def _gmem_ptr(dtype, tensor: torch.Tensor):
    return make_ptr(dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)


_NUM_SMS: dict = {}


def current_num_sms() -> int:
    """SM count of torch's current CUDA device when it is an sm_90 GPU (the runtime plans a
    size set inside its device's context); 132 (H100/H200 SXM) otherwise: no CUDA device, or
    one this backend does not run on (tables planned in the CPU tests, on any machine)."""
    if not torch.cuda.is_available():
        return 132
    index = torch.cuda.current_device()
    if index not in _NUM_SMS:
        properties = torch.cuda.get_device_properties(index)
        hopper = (properties.major, properties.minor) == (9, 0)
        _NUM_SMS[index] = properties.multi_processor_count if hopper else 132
    return _NUM_SMS[index]


class Sm90Plan:
    """The sm_90 backend's part of a plan: the kernel config its size set runs and, for
    stream-K, the StreamKPlan (whose scratch every input set of the plan shares)."""

    __slots__ = ("config", "stream_k")

    def __init__(self, config: HopperGemmConfig, stream_k: StreamKPlan | None = None):
        self.config = config
        self.stream_k = stream_k

    @property
    def nbytes(self) -> int:
        return self.stream_k.nbytes if self.stream_k is not None else 0

    @property
    def shared_scratch(self) -> bool:
        return self.stream_k is not None

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        if self.stream_k is not None and self.stream_k.work.device.type == "cuda":
            self.stream_k.record_stream(stream)


class Sm90Backend:
    """Backend protocol implementation for Hopper (sm_90a), driven by submission.py's host
    runtime: no descriptors (the kernel reads the pointer table), so a plan is the config its
    size set runs and, for stream-K, its schedule and scratch.

    config None (custom_kernel's backend): per size set the config schedules.choose_config
    picks from the sizes (stream-K, split-K with 128x128 or 128x256 tiles, or whole tiles);
    tile_shape and prepare ask the same question, so the tile table is planned with the
    tile shape of the kernel that runs it. Otherwise `config` runs every input set."""

    name = "sm90"

    def __init__(self, config: HopperGemmConfig | None = None):
        if config is not None:
            config.check()
        self.config = config

    @property
    def plan_key(self):
        """What, besides the device and the sizes, a plan of this backend depends on."""
        return (self.name, self.config)

    def config_for(self, problem_sizes) -> HopperGemmConfig:
        """The config a size set runs."""
        if self.config is not None:
            return self.config
        return choose_config(problem_sizes, current_num_sms())

    def compile(self, num_groups: int, config: HopperGemmConfig):
        return compile_gemm(num_groups, config=config)

    def can_implement(self, problem_sizes) -> None:
        can_implement(problem_sizes)

    def tile_shape(self, problem_sizes) -> tuple[int, int]:
        config = self.config_for(problem_sizes)
        return config.tile_m, config.tile_n

    def prepare(self, plan) -> Sm90Plan:
        """Pick the size set's config, compile its kernel (cached) for its group count and,
        for stream-K, plan the workers' shares and allocate their buffers."""
        config = self.config_for(plan.problem_sizes)
        self.compile(plan.num_groups, config)
        stream_k = None
        if config.stream_k and plan.num_tiles > 0:
            stream_k = StreamKPlan(plan, config, current_num_sms() * CTAS_PER_SM)
        return Sm90Plan(config, stream_k)

    def launch_args(self, plan, binding, stream: cuda.CUstream):
        """(compiled GEMM, its arguments) for this input set on `stream`."""
        backend_plan = plan.backend_plan
        stream_k = backend_plan.stream_k
        if stream_k is None:
            # not read by the kernel: any valid pointers
            work, num_workers = plan.tiles, 0
            workspace, counters = plan.sizes, plan.sizes
        else:
            work, num_workers = stream_k.work, stream_k.num_workers
            workspace, counters = stream_k.workspace, stream_k.counters
        return self.compile(plan.num_groups, backend_plan.config), (
            _gmem_ptr(cutlass.Int64, binding.ptrs),
            _gmem_ptr(cutlass.Int32, plan.sizes),
            _gmem_ptr(cutlass.Int32, plan.tiles),
            cutlass.Int32(plan.num_tiles),
            _gmem_ptr(cutlass.Int32, work),
            cutlass.Int32(num_workers),
            _gmem_ptr(cutlass.Float32, workspace),
            _gmem_ptr(cutlass.Int32, counters),
            stream,
        )


def make_backend(config: HopperGemmConfig | None = None) -> Sm90Backend:
    """The backend custom_kernel uses (config None: the automatic choice per size set), or one
    running `config` as given for every input set."""
    return Sm90Backend(config)
