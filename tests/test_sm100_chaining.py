"""Chained calls on sm_100a (issue 36), checked without a B200.

Every sm_100a kernel (the per-tile GEMM and its descriptor init, the persistent GEMM at 128
and 256 tokens per tile and its descriptor init) is compiled for sm_100a (cubin and PTX kept)
and its control flow read from the SASS (nvdisasm) and from the PTX (build_report's
sass_flow and ptx_flow), to show on every path, not only in text order:
  * the wait (griddepcontrol.wait; SASS ACQBULK) comes before every global memory,
    descriptor or tensormap access of the kernel: in each warp role of the persistent GEMM
    (the TMA warp's tile rows, descriptor acquires and prefetches and TMA loads, the MMA
    warp's tile rows, the epilogue's tile rows, C descriptor and TMA stores), in every warp
    of the per-tile GEMM (tile table, sizes, pointers, descriptors, TMA loads, C stores), in
    the init kernels (pointers, sizes, descriptor writes);
  * the trigger (griddepcontrol.launch_dependents; SASS PREEXIT) sits where the kernel's
    comments put it: in the GEMMs after the CTA's TMEM allocation (the barrier that hands
    its address on) and before the wait, in the persistent TMA warp and the init kernels
    right after the wait;
  * registers, spills and shared memory as before the chaining.
And on the host: every launch of both files' entries carries the DSL's PDL option exactly
when SM100_CHAIN_CALLS is on, the compile caches keep the two apart, and the switch is read
from NVFP4_SM100_CHAIN_CALLS.
"""

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import cutlass.cutlass_dsl.cutlass as dsl_cutlass
import pytest
from test_sm100_persistent import _compile_kept, _run_nvdisasm

import build_report
from build_report import Flow, ptx_flow, ptx_is_global, sass_flow, sass_is_global
from nvfp4_group_gemm import core as submission

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- builds
Kernel = collections.namedtuple("Kernel", "name compile waits triggers registers_before")

CONFIGS = submission.PERSISTENT_CONFIGS
# Registers before the chaining (commit 863378f, DSL 4.3.5); static shared memory was 1024
# bytes in each, the persistent GEMM's dynamic shared memory its config's smem_bytes
KERNELS = {
    "per_tile_init": Kernel("per_tile_init", lambda o: submission.compile_init_tensormaps(2, o), 1, 1, 31),
    "per_tile_gemm": Kernel("per_tile_gemm", lambda o: submission.compile_gemm(2, o), 1, 1, 193),
    "persistent_init": Kernel("persistent_init", lambda o: submission.compile_persistent_init(CONFIGS[128], o),
                              1, 1, 50),
    # one wait per warp role (TMA, MMA, epilogue); a trigger in the MMA and epilogue roles only,
    # after the TMEM allocation
    "persistent_gemm_t128": Kernel("persistent_gemm_t128",
                                   lambda o: submission.compile_persistent_gemm(CONFIGS[128], o), 3, 2, 58),
    "persistent_gemm_t256": Kernel("persistent_gemm_t256",
                                   lambda o: submission.compile_persistent_gemm(CONFIGS[256], o), 3, 2, 62),
}
PERSISTENT = ("persistent_gemm_t128", "persistent_gemm_t256")

Build = collections.namedtuple("Build", "kernel cubin ptx sass ptx_flow sass_flow")


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """name -> Build, each kernel compiled once for the module."""
    done = {}

    def get(name: str) -> Build:
        if name not in done:
            kernel = KERNELS[name]
            cubin, ptx = _compile_kept(kernel.compile, tmp_path_factory.mktemp(name))
            ptx_text, sass = ptx.read_text(errors="replace"), _run_nvdisasm(cubin)
            done[name] = Build(kernel, build_report.read_cubin(cubin.read_bytes()), ptx_text, sass,
                               ptx_flow(ptx_text), sass_flow(sass))
        return done[name]

    return get


def _where(flow: Flow, predicate) -> list[int]:
    return [i for i, op in enumerate(flow.ops) if predicate(op)]


def _sass_waits(flow):
    return _where(flow, lambda op: op.startswith("ACQBULK"))


def _sass_triggers(flow):
    return _where(flow, lambda op: op.startswith("PREEXIT"))


def _ptx_waits(flow):
    return _where(flow, lambda op: op == "griddepcontrol.wait")


def _ptx_triggers(flow):
    return _where(flow, lambda op: op == "griddepcontrol.launch_dependents")


# ----------------------------------------------------------------------------- the flow reader
def test_flow_reader_on_a_small_listing():
    """The reader itself: a branch around the wait is a path without it, scoped PTX labels
    resolve in their own block, exit and an unconditional branch end a path."""
    ptx = """.visible .entry k(
    )
    {
    @%p1 bra $L__BB0_2;
    griddepcontrol.wait;
    $L__BB0_2:
    ld.global.u32 %r1, [%rd1];
    {
    LAB_WAIT:
    @P1 bra.uni DONE;
    bra.uni LAB_WAIT;
    DONE:
    }
    ld.shared.u32 %r2, [%r3];
    stmatrix.sync.aligned.m8n8.x4.trans.b16 [%r4], {%r5, %r6, %r7, %r8};
    ret;
    }"""
    flow = ptx_flow(ptx)
    assert [ptx_is_global(op) for op in flow.ops] == [False, False, True, False, False, False, False, False]
    (load,) = _where(flow, ptx_is_global)
    assert not flow.always_after([load], _ptx_waits(flow))  # the branch skips the wait
    guarded = ptx_flow(ptx.replace("@%p1 bra $L__BB0_2;", ""))
    assert guarded.always_after(_where(guarded, ptx_is_global), _ptx_waits(guarded))
    sass = """
        /*0000*/                   BRA.U !UP0, `(.L_x_1) ;
        /*0010*/                   ACQBULK ;
.L_x_1:
        /*0020*/                   LDG.E R0, desc[UR4][R2.64] ;
        /*0030*/                   EXIT ;
        /*0040*/                   STG.E desc[UR4][R2.64], R0 ;
"""
    flow = sass_flow(sass)
    assert [sass_is_global(op) for op in flow.ops] == [False, False, True, False, True]
    assert not flow.always_after([2], _sass_waits(flow))
    assert 4 not in flow.reach(lambda i: False)  # after an unpredicated EXIT
    assert sass_flow(sass.replace("BRA.U !UP0", "@P0 BRA")).successors[0] == [2, 1]
    assert sass_is_global("CCTL.E.C.LDCU.IV.DEEP [UR4]") and not sass_is_global("CCTL.IVALL")


# ----------------------------------------------------------------------------- waits
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_global_access_follows_the_wait(builds, name):
    """SASS and PTX: the kernel's wait count, and no global, descriptor or tensormap access
    reachable from the entry on a path without a wait."""
    build = builds(name)
    kernel = build.kernel
    flow = build.sass_flow
    waits, accesses = _sass_waits(flow), _where(flow, sass_is_global)
    assert len(waits) == kernel.waits and accesses
    early = sorted(set(accesses) & flow.reach(lambda i: i in set(waits)))
    assert not early, [flow.ops[i] for i in early]
    flow = build.ptx_flow
    waits, accesses = _ptx_waits(flow), _where(flow, ptx_is_global)
    assert len(waits) == kernel.waits and accesses
    early = sorted(set(accesses) & flow.reach(lambda i: i in set(waits)))
    assert not early, [flow.ops[i] for i in early]


def _guarded_by(flow: Flow, waits, accesses) -> dict[int, set[str]]:
    """Per wait: the opcodes of the accesses that become reachable when only that wait is
    passable (the accesses it alone guards: its warp role's)."""
    guarded = {}
    for wait in waits:
        others = set(waits) - {wait}
        reached = flow.reach(lambda i, others=others: i in others)
        guarded[wait] = {flow.ops[i].split()[0] for i in set(accesses) & reached}
    return guarded


@pytest.mark.parametrize("name", PERSISTENT)
def test_each_persistent_role_waits_before_its_first_global_access(builds, name):
    """The persistent GEMM's three waits, one per warp role, told apart by what each alone
    guards (SASS): the TMA warp's tile rows, descriptor acquires and prefetches and TMA loads;
    the epilogue's tile rows, C descriptor and TMA stores; the MMA warp's tile rows only.
    Together they guard every access."""
    persistent = builds(name)
    flow = persistent.sass_flow
    waits, accesses = _sass_waits(flow), _where(flow, sass_is_global)
    guarded = _guarded_by(flow, waits, accesses)
    roles = {}
    for ops in guarded.values():
        bases = {op.split(".")[0] for op in ops}
        role = "tma" if "UTMALDG" in bases else "epilogue" if "UTMASTG" in bases else "mma"
        roles[role] = bases
    assert set(roles) == {"tma", "mma", "epilogue"}, guarded
    assert roles["tma"] == {"LDG", "CCTL", "UTMACCTL", "UTMALDG"}
    assert roles["epilogue"] == {"LDG", "CCTL", "UTMACCTL", "UTMASTG"}
    assert roles["mma"] == {"LDG"}
    covered = set().union(*(
        set(accesses) & flow.reach(lambda i, others=set(waits) - {w}: i in others) for w in waits))
    assert covered == set(accesses)
    # PTX: the same three, told apart by their tensor copies (loads into shared::cluster,
    # stores from shared::cta)
    flow = persistent.ptx_flow
    waits, accesses = _ptx_waits(flow), _where(flow, ptx_is_global)
    kinds = []
    for ops in _guarded_by(flow, waits, accesses).values():
        tensor = {op for op in ops if op.startswith("cp.async.bulk.tensor")}
        kinds.append("tma" if any(".shared::cluster.global" in op for op in tensor)
                     else "epilogue" if any(".global.shared::cta" in op for op in tensor) else "mma")
        assert any(op.startswith("ld.global") for op in ops)  # each role reads its tile rows
    assert sorted(kinds) == ["epilogue", "mma", "tma"]


# ----------------------------------------------------------------------------- triggers
def _sass_barrier(flow, barrier_id: int, threads: int):
    return _where(flow, lambda op: re.fullmatch(rf"BAR\.SYNC(?:\.DEFER_BLOCKING)? 0x{barrier_id:x}, 0x{threads:x}", op))


def _ptx_barrier(flow, barrier_id: int, threads: int):
    return _where(flow, lambda op: re.fullmatch(rf"(?:bar|barrier)\.sync(?:\.aligned)?\s+{barrier_id},\s*{threads}", op))


@pytest.mark.parametrize("name", ["per_tile_init", "persistent_init"])
def test_init_kernels_trigger_after_their_wait(builds, name):
    """The init kernels: the GEMM after them may launch once they are past their wait (it
    takes nothing they need and reads the descriptors after its own wait)."""
    build = builds(name)
    for flow, waits, triggers in ((build.sass_flow, _sass_waits, _sass_triggers),
                                  (build.ptx_flow, _ptx_waits, _ptx_triggers)):
        assert len(triggers(flow)) == 1
        assert flow.always_after(triggers(flow), waits(flow))


def test_per_tile_gemm_triggers_with_its_tmem_and_before_its_wait(builds):
    """The per-tile GEMM: every thread triggers after the barrier that hands the TMEM
    address on (the CTA holds its 512 columns: a dependent CTA beside it cannot take them)
    and waits after the trigger."""
    build = builds("per_tile_gemm")
    threads = submission.threads_per_cta
    for flow, waits, triggers, barrier in (
        (build.sass_flow, _sass_waits, _sass_triggers, _sass_barrier),
        (build.ptx_flow, _ptx_waits, _ptx_triggers, _ptx_barrier),
    ):
        (tmem_handoff,) = barrier(flow, 1, threads)
        assert len(triggers(flow)) == 1
        assert flow.always_after(triggers(flow), [tmem_handoff])
        assert flow.always_after(waits(flow), triggers(flow))
    assert build.ptx.index("tcgen05.alloc") < build.ptx.index("griddepcontrol.launch_dependents")


@pytest.mark.parametrize("name", PERSISTENT)
def test_persistent_gemm_triggers_only_once_its_tmem_is_allocated(builds, name):
    """The first launch_dependents of any thread counts for the whole CTA (PTX ISA), so every
    trigger of the persistent GEMM is reachable only after the TMEM allocation barrier (id 2,
    the MMA and epilogue warps' 160 threads): the MMA and epilogue warps trigger after it and
    before their waits; the TMA warp does not trigger. Whatever the shared-memory footprint
    lets share an SM, a dependent never launches before this CTA holds its TMEM."""
    persistent = builds(name)
    kernel = submission.PersistentGemmSm100(CONFIGS[128])
    threads = 32 * (1 + len(kernel.epilog_warp_id))
    for flow, waits, triggers, barrier in (
        (persistent.sass_flow, _sass_waits, _sass_triggers, _sass_barrier),
        (persistent.ptx_flow, _ptx_waits, _ptx_triggers, _ptx_barrier),
    ):
        handoffs, all_waits = barrier(flow, 2, threads), waits(flow)
        assert len(handoffs) == 2  # the MMA warp's and the epilogue warps'
        trigger_list = triggers(flow)
        assert len(trigger_list) == 2
        assert all(flow.always_after([t], handoffs) for t in trigger_list)  # no trigger before the TMEM
        # the MMA and epilogue waits come after their trigger; the TMA warp's wait after none
        assert sum(flow.always_after([w], trigger_list) for w in all_waits) == 2


@pytest.mark.parametrize("name", PERSISTENT)
def test_persistent_gemm_gives_up_its_tmem_permit_at_allocation_and_frees_after_its_last_read(builds, name):
    """TMEM in the persistent GEMM (issue: given back at the very end before): the allocating
    warp relinquishes the allocation permit right after its one allocation, before any tile
    (every path to the first accumulator read passes it); the deallocation follows every
    accumulator read (the two are under the same warp condition, which the flow reader does not
    correlate: their order is read from the listing)."""
    flow = builds(name).ptx_flow
    alloc = _where(flow, lambda op: op.startswith("tcgen05.alloc"))
    relinquish = _where(flow, lambda op: op.startswith("tcgen05.relinquish_alloc_permit"))
    dealloc = _where(flow, lambda op: op.startswith("tcgen05.dealloc"))
    reads = _where(flow, lambda op: op.startswith("tcgen05.ld"))
    assert len(alloc) == len(relinquish) == len(dealloc) == 1 and reads
    assert relinquish[0] == min(i for i in range(alloc[0] + 1, len(flow.ops)) if flow.ops[i].startswith("tcgen05"))
    assert flow.always_after(relinquish, alloc)
    assert all(relinquish[0] < read < dealloc[0] for read in reads)


# ----------------------------------------------------------------------------- resources
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_resources_as_before(builds, name):
    build = builds(name)
    kernel = build.kernel
    (function,) = [f for name, f in build.cubin.functions.items() if "kernel" in name]
    assert function.frame_bytes == 0, "local memory: spills"
    assert function.static_smem_bytes == 1024
    assert function.registers <= kernel.registers_before


# ----------------------------------------------------------------------------- launches
def _launch_options(monkeypatch, compile_fn, chain: bool, tmp_path) -> list[dict]:
    """The keyword arguments of every kernel launch traced by compile_fn(options), with
    SM100_CHAIN_CALLS = chain."""
    monkeypatch.setattr(submission, "SM100_CHAIN_CALLS", chain)
    launches = []
    original = dsl_cutlass.KernelLauncher.launch

    def recording(self, *args, **kwargs):
        launches.append(dict(kwargs))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(dsl_cutlass.KernelLauncher, "launch", recording)
    _compile_kept(compile_fn, tmp_path)
    return launches


LAUNCH_ENTRIES = {
    "per_tile_init": lambda o: submission.compile_init_tensormaps(3, o),
    "per_tile_gemm": lambda o: submission.compile_gemm(3, o),
    "persistent_init": lambda o: submission.compile_persistent_init(CONFIGS[256], o),
    "persistent_gemm": lambda o: submission.compile_persistent_gemm(CONFIGS[256], o),
}


@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("entry", sorted(LAUNCH_ENTRIES))
def test_leaderboard_launches_carry_the_pdl_option(monkeypatch, tmp_path, entry, chain):
    (launch,) = _launch_options(monkeypatch, LAUNCH_ENTRIES[entry], chain, tmp_path)
    assert launch["use_pdl"] is chain
    assert "stream" not in launch  # the leaderboard file launches where the harness calls


@pytest.mark.parametrize("entry", ["per_tile_init", "per_tile_gemm", "persistent_init", "persistent_gemm"])
def test_library_launches_carry_the_pdl_option(monkeypatch, tmp_path, entry):
    from nvfp4_group_gemm import sm100

    compile_fn = {
        "per_tile_init": lambda o: sm100.compile_per_tile_init(3, o),
        "per_tile_gemm": lambda o: sm100.compile_per_tile_gemm(3, o),
        "persistent_init": lambda o: sm100.compile_persistent_init(CONFIGS[128], o),
        "persistent_gemm": lambda o: sm100.compile_persistent_gemm(CONFIGS[128], o),
    }[entry]
    (launch,) = _launch_options(monkeypatch, compile_fn, True, tmp_path)
    assert launch["use_pdl"] is True and "stream" in launch


def test_compile_keys_keep_chained_and_plain_builds_apart(monkeypatch):
    from nvfp4_group_gemm import sm100

    keys = []
    monkeypatch.setattr(submission, "compile_once", lambda build, *args, options=None, context=None: keys.append(
        submission.compile_key(build, args, options)))
    compilers = [
        lambda: submission.compile_init_tensormaps(2), lambda: submission.compile_gemm(2),
        lambda: submission.compile_persistent_init(CONFIGS[128]), lambda: submission.compile_persistent_gemm(CONFIGS[128]),
        lambda: sm100.compile_per_tile_init(2), lambda: sm100.compile_per_tile_gemm(2),
        lambda: sm100.compile_persistent_init(CONFIGS[128]), lambda: sm100.compile_persistent_gemm(CONFIGS[128]),
    ]
    for chain in (True, False):
        monkeypatch.setattr(submission, "SM100_CHAIN_CALLS", chain)
        for compile_fn in compilers:
            compile_fn()
    chained, plain = keys[:len(compilers)], keys[len(compilers):]
    assert len(set(chained)) == len(compilers) and not set(chained) & set(plain)
    assert all(key[-1] == (("SM100_CHAIN_CALLS", True),) for key in chained)
    assert all(key[-1] == (("SM100_CHAIN_CALLS", False),) for key in plain)


def _switch_value(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NVFP4_SM100_CHAIN_CALLS"}
    if value is not None:
        env["NVFP4_SM100_CHAIN_CALLS"] = value
    return subprocess.run([sys.executable, "-c", "import submission; print(submission.SM100_CHAIN_CALLS)"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)


def test_switch_is_read_from_the_environment():
    assert _switch_value(None).stdout.split() == ["True"]  # chained by default
    assert _switch_value("0").stdout.split() == ["False"]
    bad = _switch_value("off")
    assert bad.returncode != 0 and "NVFP4_SM100_CHAIN_CALLS='off': must be one of 0, 1" in bad.stderr


# ----------------------------------------------------------------------------- build_report
# triggers reachable before a wait: the GEMMs' MMA/epilogue (persistent) or all threads
# (per-tile) trigger ahead of their wait, the init kernels and the persistent TMA warp after it
TRIGGERS_BEFORE_WAIT = {"per_tile_init": 0, "per_tile_gemm": 1, "persistent_init": 0,
                        "persistent_gemm_t128": 2, "persistent_gemm_t256": 2}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_build_report_reads_the_waits_and_triggers(builds, name):
    build = builds(name)
    kernel = build.kernel
    _target, entries = build_report.read_ptx(build.ptx)
    (entry,) = entries.values()
    found = build_report.grid_dependency(entry.text)
    assert found == {"waits": kernel.waits, "triggers": kernel.triggers,
                     "triggers_before_wait": TRIGGERS_BEFORE_WAIT[name],
                     "accesses": found["accesses"], "accesses_before_wait": 0}
    assert found["accesses"] == len(_where(build.ptx_flow, ptx_is_global)) > 0
    assert build_report.chaining_line(found) == (
        f"chaining: {kernel.waits} wait, {kernel.triggers} launch_dependents ({TRIGGERS_BEFORE_WAIT[name]} before "
        f"a wait); 0 of {found['accesses']} global accesses reachable without a wait")


def test_build_report_prints_the_chaining_line():
    report = build_report.KernelReport(
        target="sm100_persistent_gemm_t128", arch="sm_100a", num_groups=8, kernel="kernel_x", sm_version=100,
        registers=58, frame_bytes=0, spill_bytes_max=0, stack_bytes=0, static_smem_bytes=1024,
        dynamic_smem_bytes=226_304, smem_bytes=227_328, smem_limit_bytes=232_448, compile_s=1.0,
        mma=[], ptx_target="sm_100a", cubin_path=None, ptx_path=None, threads=192,
        grid_dependency={"waits": 3, "triggers": 3, "triggers_before_wait": 2, "accesses": 57,
                         "accesses_before_wait": 0},
    )
    lines = build_report.format_table([report]).splitlines()
    assert ("    chaining: 3 wait, 3 launch_dependents (2 before a wait); 0 of 57 global accesses "
            "reachable without a wait") in lines
    assert max(map(len, lines)) <= build_report.TABLE_WIDTH
    plain = build_report.format_table([build_report.dataclasses.replace(report, grid_dependency=None)])
    assert "chaining:" not in plain
    assert build_report.grid_dependency(".visible .entry k()\n{\nld.global.u32 %r1, [%rd1];\nret;\n}") is None
