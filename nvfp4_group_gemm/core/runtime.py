"""The leaderboard file's runtime: plans, bindings, ``custom_kernel``.

``Runtime``: the one plan-and-binding machine (caches, eviction, drop on demotion, reset, the
miss path), which the library's entries extend; this file's instance of it, ``RUNTIME``: input
sets (bindings) by data pointers, plans by (device, sizes, backend); the hit path is one
prepared launch. Also ``reset_runtime`` (every runtime of the process) and ``warmup``."""

import torch

from .backend import RESIDENT_CLUSTERS, Sm100Backend
from .chain import (
    DEMOTED,
    DEMOTION_LISTENERS,
    SELF_CHECKED,
    c_of_group,
    choose_kernel,
    context_usable,
    demote,
    one_line,
)
from .config import K_TILE, MAX_GROUPS, RUNTIME_LOCK, SM100_KERNEL, SUPPORTED_GPUS
from .launching import Binding, Plan, RuntimeCache, device_context
from .self_check import HOST_COMPUTATIONS, first_use_check
from .validation import checked_input, pointers_of_key

try:  # the leaderboard's runner and this repository have the task's task.py; an installed package has not
    from task import input_t, output_t
except ImportError:
    input_t = output_t = tuple


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
