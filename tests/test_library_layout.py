"""The two parts, one way apart: submission.py (the leaderboard file) is the package's core
(the rooms of nvfp4_group_gemm/core/) bundled; importing it pulls in nothing of the library; the library
imports its own core (nvfp4_group_gemm.core) whatever a harness put under the name
`submission`. Each import case in a fresh interpreter (module state is process-wide)."""

import subprocess
import sys
from pathlib import Path

import pytest

from nvfp4_group_gemm import bundle

REPO_ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "the leaderboard file alone": (
        "import sys, submission\n"
        "assert not any(name.startswith('nvfp4_group_gemm') for name in sys.modules), sorted(sys.modules)\n"
    ),
    "the library on its core": (
        "import sys, nvfp4_group_gemm.runtime as rt, nvfp4_group_gemm.core as core\n"
        "assert rt.core is core and 'submission' not in sys.modules, sorted(sys.modules)\n"
        "assert rt.validate_inputs.__module__ == 'nvfp4_group_gemm.runtime'\n"
    ),
    "a harness's own submission module": (
        "import sys, types\n"
        "sys.modules['submission'] = types.ModuleType('submission')  # the entry file, mid-import\n"
        "import nvfp4_group_gemm.moe as moe, nvfp4_group_gemm.core as core\n"
        "assert moe.core is core and hasattr(core, 'PersistentGemmSm100')\n"
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_imports_one_way(name):
    done = subprocess.run([sys.executable, "-c", CASES[name]], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_leaderboard_file_is_the_bundle_of_the_core():
    """submission.py is rebuilt by `python -m nvfp4_group_gemm.bundle`; an edit of the core
    that was not bundled fails here (and --check exits 1)."""
    assert (REPO_ROOT / "submission.py").read_text(encoding="utf-8") == bundle.bundled_text(), (
        "submission.py is stale: run `python -m nvfp4_group_gemm.bundle`")
    assert bundle.main(["--check", "--out", str(REPO_ROOT / "submission.py")]) == 0


def test_a_stale_bundle_is_reported(tmp_path, capsys):
    stale = tmp_path / "submission.py"
    stale.write_text(bundle.bundled_text() + "# an edit by hand\n", encoding="utf-8")
    assert bundle.main(["--check", "--out", str(stale)]) == 1
    assert "differs from nvfp4_group_gemm/core/ bundled" in capsys.readouterr().err
    assert bundle.main(["--out", str(stale)]) == 0 and stale.read_text(encoding="utf-8") == bundle.bundled_text()


def test_the_core_is_rooms_under_1500_lines_bundled_in_dependency_order():
    """nvfp4_group_gemm/core/ is its rooms (ROOMS, the bundle's order), each under 1,500 lines,
    each importing only rooms before it; core.X holds every room's names."""
    import ast

    from nvfp4_group_gemm import core

    names = [room.__name__.rpartition(".")[2] for room in core.ROOMS]
    assert names == bundle.rooms()
    assert sorted(names) == sorted(p.stem for p in (PACKAGE / "core").glob("*.py") if p.stem != "__init__")
    for index, name in enumerate(names):
        text = (PACKAGE / "core" / f"{name}.py").read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 1500, name
        imported = {node.module for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom) and node.level}
        assert imported <= set(names[:index]), (name, imported - set(names[:index]))
        room = core.ROOMS[index]
        assert all(getattr(core, n) is v for n, v in vars(room).items() if not n.startswith("__") and n not in core.LIVE_NAMES)


def test_setting_a_core_name_sets_it_in_every_room(monkeypatch):
    """core.X = v reaches every room that holds X, as in the one file (tests and selfcheck.py
    set core.SM100_CHAIN_CALLS, core.SELF_CHECK, ...); SM100_CHAIN_CALLS, rebound by
    chain_calls_as while it runs, is read from its room."""
    from nvfp4_group_gemm import core

    monkeypatch.setattr(core, "SELF_CHECK", not core.SELF_CHECK)
    assert core.config.SELF_CHECK is core.self_check.SELF_CHECK is core.SELF_CHECK
    chained = core.SM100_CHAIN_CALLS
    monkeypatch.setattr(core, "SM100_CHAIN_CALLS", not chained)
    assert core.config.SM100_CHAIN_CALLS is core.backend.SM100_CHAIN_CALLS is (not chained)
    assert core.chained_launch() == {"use_pdl": not chained}
    with core.chain_calls_as(chained):
        assert core.SM100_CHAIN_CALLS is chained and core.chained_launch() == {"use_pdl": chained}
    assert core.SM100_CHAIN_CALLS is (not chained)
    monkeypatch.undo()
    assert core.SM100_CHAIN_CALLS is chained and core.backend.SM100_CHAIN_CALLS is chained


def test_one_lock_for_every_runtime():
    """Compiles and shared state of every entry (the core's runtime, the library's per-size-set
    runtime and its launch machinery, the MoE entry) run under one lock: concurrent first
    compiles crash inside the DSL."""
    import threading

    from nvfp4_group_gemm import core, launch, moe, runtime

    locks = {id(module_lock) for module_lock in (core.RUNTIME_LOCK, runtime.RUNTIME_LOCK, launch.RUNTIME_LOCK, moe._LOCK)}
    assert len(locks) == 1 and isinstance(core.RUNTIME_LOCK, type(threading.RLock()))


def test_one_reset_forgets_every_runtime(monkeypatch):
    """reset_runtime resets every runtime of the process (core.RUNTIMES: the leaderboard file's
    core's, the per-size-set entry's, the MoE entry's), each through Runtime.reset."""
    from nvfp4_group_gemm import core, moe, runtime

    assert {id(r) for r in core.RUNTIMES} >= {id(core.RUNTIME), id(runtime.RUNTIME), id(moe.RUNTIME)}
    for entry in (core.RUNTIME, runtime.RUNTIME, moe.RUNTIME):
        entry.bindings.put("a key", "a binding")
        entry.plans.put("a key", "a plan")
    moe._LAYOUTS.put("a layout", "a shape")
    runtime.RUNTIME.size_plans.put("a key", "a size plan")
    runtime.reset_runtime()
    assert all(len(cache) == 0 for entry in (core.RUNTIME, runtime.RUNTIME, moe.RUNTIME)
               for cache in (entry.bindings, entry.plans))
    assert len(moe._LAYOUTS) == 0 and len(runtime.RUNTIME.size_plans) == 0


PACKAGE = REPO_ROOT / "nvfp4_group_gemm"


def _package_sources():
    return {path.relative_to(REPO_ROOT).as_posix(): path.read_text(encoding="utf-8")
            for path in sorted(PACKAGE.rglob("*.py"))}


def test_one_place_knows_the_dsls_internals():
    """The prepared (packed-argument) launch is core.PreparedCall's: make_launcher (the core's
    bindings) and launch.CellLauncher (the library's argument cells) both build on it, and no
    other module names the DSL internals it uses."""
    import re

    internals = re.compile(r"generate_execution_args|_get_invoke_packed_args|capi_func|jit_module|cuda_result")
    users = sorted(path for path, text in _package_sources().items() if internals.search(text))
    assert users == ["nvfp4_group_gemm/core/launching.py"], users
    from nvfp4_group_gemm import core, launch

    assert "PreparedCall.prepare" in (PACKAGE / "launch.py").read_text() and core.make_launcher.__module__ == core.launching.__name__
    assert launch.make_launcher is core.make_launcher


def test_every_switch_is_read_in_one_module():
    """nvfp4_group_gemm.switches reads the library's NVFP4_* switches (at import and at
    reset_runtime); the core reads the leaderboard file's own at its import; no other module
    reads the environment or calls env_switch."""
    import re

    from nvfp4_group_gemm import switches

    readers = sorted(path for path, text in _package_sources().items()
                     if re.search(r"os\.environ|env_switch\(|getenv\(", text))
    assert readers == ["nvfp4_group_gemm/core/config.py", "nvfp4_group_gemm/switches.py"], readers
    core_text = (PACKAGE / "core" / "config.py").read_text()
    read_by_core = sorted(set(re.findall(r'env_switch\("(NVFP4_\w+)"', core_text)))
    assert read_by_core == sorted(switches.LEADERBOARD_SWITCHES)
    assert set(switches.SWITCHES).isdisjoint(read_by_core)


def test_the_switches_are_read_again_by_reset_runtime(monkeypatch):
    from nvfp4_group_gemm import runtime, switches

    monkeypatch.setenv("NVFP4_GRAPH_LAUNCH", "0")
    monkeypatch.setenv("NVFP4_MOE_CONFIG", "swap_ab_t64")
    assert switches.CURRENT.graph_launch  # read at import: the environment's change is not seen yet
    runtime.reset_runtime()
    assert not switches.CURRENT.graph_launch and switches.CURRENT.moe_config == "swap_ab_t64"
    monkeypatch.setenv("NVFP4_GRAPH_LAUNCH", "maybe")
    from nvfp4_group_gemm import moe

    moe.RUNTIME.plans.put("a key", "a plan")  # a runtime after the one whose reset raises
    with pytest.raises(ValueError, match=r"NVFP4_GRAPH_LAUNCH='maybe': must be one of 0, 1"):
        runtime.reset_runtime()
    assert len(moe.RUNTIME.plans) == 0  # every runtime reset all the same, the error raised after
    monkeypatch.delenv("NVFP4_GRAPH_LAUNCH")
    monkeypatch.delenv("NVFP4_MOE_CONFIG")
    runtime.reset_runtime()
    assert switches.CURRENT == switches.read() and switches.CURRENT.graph_launch


def test_one_graph_policy(monkeypatch):
    """Both entries' bindings record a CUDA graph only outside a caller's capture, with graphs
    on and their plan allowing it (launch.records_graph)."""
    import dataclasses

    from nvfp4_group_gemm import launch, switches

    for capturing, graphs, allowed in [(c, g, a) for c in (False, True) for g in (False, True) for a in (False, True)]:
        monkeypatch.setattr(launch, "is_capturing", lambda capturing=capturing: capturing)
        monkeypatch.setattr(switches, "CURRENT", dataclasses.replace(switches.CURRENT, graph_launch=graphs))
        assert launch.records_graph(allowed) == (graphs and allowed and not capturing)
    for module in ("runtime.py", "moe.py"):
        assert "records_graph(" in (PACKAGE / module).read_text(), module


def test_every_bounded_cache_is_a_runtime_cache():
    """The caches of both entries are core.RuntimeCache (bounded by count, and bytes where
    entries say theirs); no hand-written eviction is left."""
    import ast

    for path, text in _package_sources().items():
        assert "OrderedDict()" not in text or path == "nvfp4_group_gemm/core/launching.py", path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
                source = ast.get_source_segment(text, node) or ""
                assert not (source.startswith("if len(") and ("pop(next(iter(" in source or ".clear()" in source)), (
                    path, source[:120])
    from nvfp4_group_gemm import core, launch, moe, runtime

    for module, names in ((moe, ("_LAYOUTS", "_CAPABILITY")),
                          (moe.RUNTIME, ("plans", "bindings")),
                          (runtime.RUNTIME, ("bindings", "plans", "size_plans", "seen_once", "captured")),
                          (launch, ("STREAM_OBJECTS",))):
        for name in names:
            assert isinstance(getattr(module, name), core.RuntimeCache), (module, name)




def test_the_tools_read_the_package_through_public_names():
    """selfcheck.py and bench/host_overhead.py call the runtime's functions (binding_of,
    current_stream, forget_size_plans, launch_first_call), not its private caches and helpers:
    no `name._private` read of a module but torch's."""
    import ast

    root = Path(__file__).resolve().parents[1]
    reads = set()
    for path in ("selfcheck.py", "bench/host_overhead.py"):
        text = (root / path).read_text()
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (ast.get_source_segment(text, node) or "").startswith("torch.")):
                reads.add((path, ast.get_source_segment(text, node)))
    assert reads == set()
