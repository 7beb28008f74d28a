"""Shared pytest set-up: the runtime's caches reset around every test, one summary line that
says how many tests were skipped for lack of a GPU (the CPU suite skips every test that needs
a Hopper or Blackwell GPU, with a reason), the run's temporary files under the repository
(build/pytest-tmp/run-PID, removed when the run ends) instead of the machine's shared
/tmp/pytest-of-USER, and the sm_90a builds of every kernel, made once for the run
(sm90_builds)."""

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

# A skip reason that names one of these is a missing-GPU skip.
GPU_REASON = re.compile(r"\b(GPU|CUDA|sm_\d+)", re.IGNORECASE)


def _stale_runs(folder: Path) -> list[Path]:
    """The run-PID folders of runs that are no longer alive (killed before their clean-up)."""
    stale = []
    for run in folder.glob("run-*"):
        try:
            os.kill(int(run.name.removeprefix("run-")), 0)
        except ValueError:
            continue  # not one of ours
        except ProcessLookupError:
            stale.append(run)
        except PermissionError:
            pass  # alive, another user's
    return stale


@pytest.hookimpl(tryfirst=True)  # before pytest's tmpdir plugin reads --basetemp
def pytest_configure(config):
    """Unless --basetemp is given: this run's tmp_path folders in build/pytest-tmp/run-PID
    under the rootdir (build/ is ignored by git), one folder per run so that runs at the same
    time do not clear each other's, removed at the end of the run (with any a killed run
    left)."""
    if hasattr(config, "workerinput"):
        # a pytest-xdist worker (-n N): one intra-op thread for torch (and the processes it
        # starts), unless told otherwise; N workers of torch's default, a thread per core, wait
        # spinning for each other's cores and slow its CPU computations several times
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        return
    if config.option.basetemp is not None:
        return
    folder = Path(config.rootpath) / "build" / "pytest-tmp"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in _stale_runs(folder):
        shutil.rmtree(stale, ignore_errors=True)
    run = folder / f"run-{os.getpid()}"
    config.option.basetemp = str(run)
    config.add_cleanup(lambda: shutil.rmtree(run, ignore_errors=True))


def _reset_runtime() -> None:
    # Only a submission some test already imported: a test that never imports it does not pay
    # for the import (a fresh import has empty caches anyway).
    for name in ("nvfp4_group_gemm.runtime", "submission"):
        reset = getattr(sys.modules.get(name), "reset_runtime", None)
        if reset is not None:
            reset()


@pytest.fixture(autouse=True)
def fresh_runtime():
    """Every test starts and ends with the runtime as a fresh process has it
    (`submission.reset_runtime()`: no input set, plan, signature, backend, demotion or
    self-check result of another test; compiled kernels kept). A test that installs its own
    backend or cache (monkeypatch) gets the originals back, emptied, after it."""
    _reset_runtime()
    yield
    _reset_runtime()


# The group counts every sm_90a kernel is built for (tests/test_hopper.py, tests/test_swap_ab.py)
SM90_GROUP_COUNTS = (1, 2, 8)


@pytest.fixture(scope="session")
def sm90_builds(tmp_path_factory):
    """Every kernel of nvfp4_group_gemm.hopper built for sm_90a at each of SM90_GROUP_COUNTS
    (build_report's build process, cubin and PTX kept), once for the whole run: (target, G) ->
    KernelReport. The builds are most of the suite's time; each test file that reads them
    shares these."""
    import build_report

    dump_root = tmp_path_factory.mktemp("sm90_build")
    reports = build_report.build_all(SM90_GROUP_COUNTS, dump_root, modules=("nvfp4_group_gemm.hopper",))
    return {(r.target, r.num_groups): r for r in reports}


# The test files that read sm90_builds, found by their text: the scheduler below runs in
# pytest-xdist's controller, which collects no test
SM90_BUILD_FILES = frozenset(path.name for path in Path(__file__).parent.glob("test_*.py")
                             if "sm90_builds" in path.read_text())


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, where it is installed
def pytest_xdist_make_scheduler(config, log):
    """`-n 2 --dist loadfile`: each test file runs whole in one worker, so that its
    module-scoped builds are made once, and the files that read sm90_builds (SM90_BUILD_FILES)
    run in one worker too, so that those builds are made once (xdist hands out the largest group
    first: that one). Other --dist modes are xdist's own. (xdist's loadgroup, the same with
    marks, no longer groups under pytest 9.2: its nodeid suffix is ignored.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "sm90_builds" if Path(path).name in SM90_BUILD_FILES else path

    return ByFile(config, log)


def skip_reason(report) -> str:
    """The reason text of a skipped test's report ("Skipped: " removed)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def gpu_skip_summary(reasons: list[str]) -> str | None:
    """One line for the skipped tests' reasons: how many lack a GPU, by reason, and the
    others; None when nothing was skipped."""
    if not reasons:
        return None
    counts: dict[str, int] = {}
    for reason in reasons:
        counts[reason] = counts.get(reason, 0) + 1
    gpu = {reason: n for reason, n in counts.items() if GPU_REASON.search(reason)}
    other = {reason: n for reason, n in counts.items() if reason not in gpu}
    by_count = sorted(gpu.items(), key=lambda item: (-item[1], item[0]))
    line = f"{sum(gpu.values())} tests skipped for lack of a GPU"
    if by_count:
        line += " (" + ", ".join(f"{n}: {reason}" for reason, n in by_count) + ")"
    if other:
        line += "; " + ", ".join(f"{n} skipped otherwise: {reason}" for reason, n in
                                 sorted(other.items(), key=lambda item: (-item[1], item[0])))
    return line


def pytest_terminal_summary(terminalreporter):
    line = gpu_skip_summary([skip_reason(r) for r in terminalreporter.stats.get("skipped", [])])
    if line:
        terminalreporter.write_line(line)
