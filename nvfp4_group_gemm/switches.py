"""Every ``NVFP4_*`` environment switch of the library, read in this module and at one time: when
``nvfp4_group_gemm`` is imported, and again by ``reset_runtime()`` (a caller that changed the
environment calls it). A value outside a switch's allowed ones raises ValueError naming the
switch, the value and the allowed values (core.env_switch), at that time.

The leaderboard file's own switches (NVFP4_SM100_KERNEL, NVFP4_SM100_CHAIN_CALLS,
NVFP4_PLAIN_LAUNCH, NVFP4_SELF_CHECK) are read by nvfp4_group_gemm.core when it is imported,
since submission.py stands alone on the leaderboard's runner; `LEADERBOARD_SWITCHES` names
them, so that this module lists every switch there is.
"""

import dataclasses

from nvfp4_group_gemm import core

# name -> (allowed values, default, what it does): the library's switches
SWITCHES = {
    "NVFP4_GRAPH_LAUNCH": (("0", "1"), "1", ("1: a seen input set's launches replayed as a CUDA graph "
                                                  "(both entries); 0: launched directly")),
    "NVFP4_FIRST_CALL_UNBOUND": (("0", "1"), "1", ("1: an input set's first call launches through its "
                                                        "size plan, binding nothing; 0: every call binds")),
    "NVFP4_SM90_KERNEL": (("swap_ab", "in_gemm_decode"), "swap_ab", "the sm_90 backend's kernel"),
    "NVFP4_SM90_CHAIN_CALLS": (("0", "1"), "1", ("1: the sm_90 automatic choice chains calls by "
                                                      "programmatic dependent launch; 0: graph replay instead")),
    "NVFP4_MOE_CONFIG": (None, "", "a hopper config name the MoE entry runs for every shape (experiments)"),
    "NVFP4_MOE_SM100": (("0", "1"), "0", "1: the MoE entry runs its sm_100a kernels (never run on a B200 here)"),
    "NVFP4_PAIR_KERNELS": (("0", "1"), "1", ("1: MoeFfn's routing, pair sort and weighted sum as kernels "
                                                  "(nvfp4_group_gemm.pairs; MoeFfn.pair_kernels); 0: torch ops")),
}
# read by nvfp4_group_gemm.core (the leaderboard file) at its import
LEADERBOARD_SWITCHES = ("NVFP4_SM100_KERNEL", "NVFP4_SM100_CHAIN_CALLS", "NVFP4_PLAIN_LAUNCH", "NVFP4_SELF_CHECK")


@dataclasses.dataclass(frozen=True)
class Switches:
    graph_launch: bool  # NVFP4_GRAPH_LAUNCH
    first_call_unbound: bool  # NVFP4_FIRST_CALL_UNBOUND
    sm90_kernel: str  # NVFP4_SM90_KERNEL
    sm90_chain_calls: bool  # NVFP4_SM90_CHAIN_CALLS
    moe_config: str | None  # NVFP4_MOE_CONFIG (None: the entry's own choice)
    moe_sm100: bool  # NVFP4_MOE_SM100
    pair_kernels: bool  # NVFP4_PAIR_KERNELS (MoeFfn.pair_kernels' default)


def read() -> Switches:
    """The switches as the environment gives them now."""

    def value(name: str) -> str:
        allowed, default, _ = SWITCHES[name]
        return core.env_switch(name, allowed, default)

    return Switches(
        graph_launch=value("NVFP4_GRAPH_LAUNCH") == "1",
        first_call_unbound=value("NVFP4_FIRST_CALL_UNBOUND") == "1",
        sm90_kernel=value("NVFP4_SM90_KERNEL"),
        sm90_chain_calls=value("NVFP4_SM90_CHAIN_CALLS") == "1",
        moe_config=value("NVFP4_MOE_CONFIG") or None,
        moe_sm100=value("NVFP4_MOE_SM100") == "1",
        pair_kernels=value("NVFP4_PAIR_KERNELS") == "1",
    )


# What every reader of the library sees (switches.CURRENT.<field>): read at import
CURRENT = read()


def reload() -> Switches:
    """Read the environment again (reset_runtime's step); returns the new switches."""
    global CURRENT
    CURRENT = read()
    return CURRENT
