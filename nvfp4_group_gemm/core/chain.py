"""The fallback chain: its links and the process's demotions.

``KernelChoice`` (one link: a named kernel config), ``KernelChain`` (links made on first
access), the demotion state shared by every runtime of the process (``DEMOTED``,
``SELF_CHECKED``, ``DEMOTION_LISTENERS``), the one lock (``RUNTIME_LOCK`` lives in config),
``choose_kernel`` and ``demote``."""

import collections
import collections.abc
import dataclasses
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch

from .config import RUNTIME_LOCK


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
