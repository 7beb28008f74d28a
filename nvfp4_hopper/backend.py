"""The backend protocol implementation submission.py's host runtime drives on sm_90 GPUs."""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import torch
from cutlass import cute
from cutlass.cute.runtime import make_ptr

from .config import CTAS_PER_SM, SM90_CONFIG, HopperGemmConfig, can_implement
from .kernel import compile_gemm
from .schedules import StreamKPlan, split_k_pays, stream_k_pays, tile_k_tiles_of


def _gmem_ptr(dtype, tensor: torch.Tensor):
    return make_ptr(dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)


_NUM_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    """SM count of `device`; 132 (H100/H200 SXM) for a CPU device (tables built in tests)."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
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

    auto_schedule: per size set, stream-K where stream_k_pays, else split-K over a 2-CTA
    cluster where split_k_pays, else whole tiles; otherwise `config` runs every input set as
    given."""

    name = "sm90"

    def __init__(self, config: HopperGemmConfig = SM90_CONFIG, auto_schedule: bool = False):
        config.check()
        self.config = config
        self.auto_schedule = auto_schedule and config.split_k == 1 and not config.stream_k
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n

    @property
    def plan_key(self):
        """What, besides the device and the sizes, a plan of this backend depends on."""
        return (self.name, self.config, self.auto_schedule)

    def config_for(self, plan) -> HopperGemmConfig:
        """The config this size set runs (same tile shape: one tile table serves all)."""
        if not self.auto_schedule:
            return self.config
        num_sms = _num_sms(plan.device)
        if stream_k_pays(tile_k_tiles_of(plan, self.config), num_sms):
            return dataclasses.replace(self.config, stream_k=True)
        if split_k_pays(plan.num_tiles, num_sms):
            return dataclasses.replace(self.config, split_k=2)
        return self.config

    def compile(self, num_groups: int, config: HopperGemmConfig | None = None):
        return compile_gemm(num_groups, config=config or self.config)

    def can_implement(self, problem_sizes) -> None:
        can_implement(problem_sizes, self.config)

    def tile_shape(self, problem_sizes) -> tuple[int, int]:
        return self.tile_m, self.tile_n

    def prepare(self, plan) -> Sm90Plan:
        """Pick the size set's config, compile its kernel (cached) for its group count and,
        for stream-K, plan the workers' shares and allocate their buffers."""
        config = self.config_for(plan)
        self.compile(plan.num_groups, config)
        stream_k = None
        if config.stream_k and plan.num_tiles > 0:
            stream_k = StreamKPlan(plan, config, _num_sms(plan.device) * CTAS_PER_SM)
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
    """The backend custom_kernel uses (config None: SM90_CONFIG, split-K where split_k_pays),
    or one running `config` as given for every input set."""
    if config is None:
        return Sm90Backend(SM90_CONFIG, auto_schedule=True)
    return Sm90Backend(config)
