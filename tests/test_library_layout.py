"""The two parts, one way apart: submission.py (the leaderboard file) is the package's core
module bundled, byte for byte; importing it pulls in nothing of the library; the library
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
    assert "differs from nvfp4_group_gemm/core.py bundled" in capsys.readouterr().err
    assert bundle.main(["--out", str(stale)]) == 0 and stale.read_text(encoding="utf-8") == bundle.bundled_text()


def test_one_lock_for_every_runtime():
    """Compiles and shared state of every entry (the core's runtime, the library's per-size-set
    runtime and its launch machinery, the MoE entry) run under one lock: concurrent first
    compiles crash inside the DSL."""
    import threading

    from nvfp4_group_gemm import core, launch, moe, runtime

    locks = {id(module_lock) for module_lock in (core.RUNTIME_LOCK, runtime.RUNTIME_LOCK, launch.RUNTIME_LOCK, moe._LOCK)}
    assert len(locks) == 1 and isinstance(core.RUNTIME_LOCK, type(threading.RLock()))


def test_one_reset_forgets_the_moe_entry_too(monkeypatch):
    from nvfp4_group_gemm import moe, runtime

    resets = []
    monkeypatch.setattr(moe, "reset_moe", lambda: resets.append("moe"))
    runtime.reset_runtime()
    assert resets == ["moe"]
