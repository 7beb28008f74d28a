"""submission.make_launcher: the prepared launch (packed DSL arguments, one C call) runs only
under the DSL release it was written for; under any other release, or when the DSL's
internals it uses are missing, the launcher takes the public call path, and the kernel's entry
point receives the same arguments either way.

A stand-in for the compiled function models both paths the way the DSL runs them: the
public ``compiled(*args)`` converts the arguments, packs them and calls the entry point; the
prepared path does the conversion and packing once and calls the entry point itself.
"""

import ctypes
import importlib.metadata
from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import pytest
from cutlass import cute
from cutlass.cute.runtime import make_ptr

from nvfp4_group_gemm import core as submission
from nvfp4_group_gemm import launch


class RecordingCompiled:
    """A compiled function whose entry point records the packed arguments it receives."""

    def __init__(self):
        self.entry_calls = []  # packed argument lists, as the entry point received them
        self.public_calls = []  # argument tuples of compiled(*args)
        self.conversions = 0  # generate_execution_args calls
        executor = SimpleNamespace(
            jit_module=SimpleNamespace(capi_func=self.entry_calls.append),
            cuda_result=None,
            _get_invoke_packed_args=lambda exe_args: [("packed", arg) for arg in exe_args],
        )
        self.executor = executor

    def generate_execution_args(self, *args):
        self.conversions += 1
        return [("converted", arg) for arg in args], list(args)

    def to(self, device):
        assert device is None
        return self.executor

    def __call__(self, *args):
        self.public_calls.append(args)
        exe_args, _adapted = self.generate_execution_args(*args)
        self.executor.jit_module.capi_func(self.executor._get_invoke_packed_args(list(exe_args)))


class PublicOnlyCompiled(RecordingCompiled):
    """A release whose compiled function lacks the internals the prepared path uses."""

    to = None


@pytest.fixture
def launch_args():
    return (
        make_ptr(cutlass.Int64, 1 << 32, cute.AddressSpace.gmem, assumed_align=16),
        make_ptr(cutlass.Int32, 2 << 32, cute.AddressSpace.gmem, assumed_align=16),
        cutlass.Int32(3),
        cutlass.Int32(8),
        cuda.CUstream(0),
    )


@pytest.fixture
def pinned_release(monkeypatch):
    monkeypatch.setattr(submission, "DSL_VERSION", submission.PREPARED_LAUNCH_DSL_VERSION)
    monkeypatch.setattr(submission, "FORCE_PLAIN_LAUNCH", False)


def _packed(args):
    return [("packed", ("converted", arg)) for arg in args]


def test_the_installed_release_is_the_one_checked():
    assert submission.DSL_VERSION == importlib.metadata.version("nvidia-cutlass-dsl")
    assert submission.PREPARED_LAUNCH_DSL_VERSION == "4.3.5"  # the leaderboard runner's


def test_pinned_release_takes_the_prepared_path(pinned_release, launch_args):
    compiled = RecordingCompiled()
    launch = submission.make_launcher(compiled, *launch_args)
    assert compiled.conversions == 1  # converted and packed once, when the launcher is made
    launch()
    launch()
    assert compiled.public_calls == []
    assert compiled.conversions == 1
    assert compiled.entry_calls == [_packed(launch_args)] * 2


@pytest.mark.parametrize("release", ["4.8.1", "4.3.4", "4.4.0", None])
def test_any_other_release_takes_the_public_path_with_the_same_arguments(monkeypatch, launch_args, release):
    monkeypatch.setattr(submission, "FORCE_PLAIN_LAUNCH", False)
    monkeypatch.setattr(submission, "DSL_VERSION", submission.PREPARED_LAUNCH_DSL_VERSION)
    prepared = RecordingCompiled()
    submission.make_launcher(prepared, *launch_args)()

    monkeypatch.setattr(submission, "DSL_VERSION", release)
    public = RecordingCompiled()
    launch = submission.make_launcher(public, *launch_args)
    assert public.conversions == 0  # nothing of the DSL's internals touched
    launch()
    launch()
    assert public.public_calls == [launch_args] * 2
    # The kernel's entry point receives what the prepared path gives it
    assert public.entry_calls == [prepared.entry_calls[0]] * 2 == [_packed(launch_args)] * 2


def test_pinned_release_without_the_internals_falls_back_to_the_public_path(pinned_release, launch_args):
    compiled = PublicOnlyCompiled()
    launch = submission.make_launcher(compiled, *launch_args)
    launch()
    assert compiled.public_calls == [launch_args]
    assert compiled.entry_calls == [_packed(launch_args)]


def test_plain_launch_forced_takes_the_public_path(pinned_release, monkeypatch, launch_args):
    monkeypatch.setattr(submission, "FORCE_PLAIN_LAUNCH", True)
    compiled = RecordingCompiled()
    submission.make_launcher(compiled, *launch_args)()
    assert compiled.public_calls == [launch_args] and compiled.conversions == 1


def test_prepared_launch_reports_a_failed_launch(pinned_release, launch_args):
    compiled = RecordingCompiled()
    compiled.executor.cuda_result = SimpleNamespace(value=700)  # CUDA_ERROR_ILLEGAL_ADDRESS
    launch = submission.make_launcher(compiled, *launch_args)
    with pytest.raises(RuntimeError, match="CUresult 700"):
        launch()


# ----------------------------------------------------------------------------- CellLauncher
class CellReadingCompiled(RecordingCompiled):
    """A compiled function whose conversion takes each argument's C pointer as the DSL's
    short-cut does, and whose entry point reads the values behind the packed pointers."""

    KINDS = ("ptr", "ptr", "i32", "stream")
    DTYPES = (cutlass.Int64, cutlass.Int32, None, None)
    CTYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p)

    def __init__(self):
        super().__init__()
        self.executor._get_invoke_packed_args = list
        self.executor.jit_module.capi_func = lambda packed: self.entry_calls.append(
            tuple(t.from_address(address).value or 0 for t, address in zip(self.CTYPES, packed)))

    def generate_execution_args(self, *args):
        self.conversions += 1
        return [arg.__c_pointers__()[0] for arg in args], []

    def __call__(self, *args):  # the public path: DSL objects, converted by the DSL itself
        self.conversions += 1
        self.public_calls.append(args)


def test_cell_launcher_converts_once_and_reads_each_calls_values(pinned_release):
    compiled = CellReadingCompiled()
    launcher = launch.CellLauncher(compiled, compiled.KINDS, compiled.DTYPES)
    launcher(1 << 32, 2 << 32, 7, 0)
    launcher(3 << 32, 4 << 32, 9, 5)
    assert compiled.entry_calls == [(1 << 32, 2 << 32, 7, 0), (3 << 32, 4 << 32, 9, 5)]
    assert compiled.conversions == 1 and compiled.public_calls == []


def test_a_bound_cell_launch_keeps_its_own_values(pinned_release):
    compiled = CellReadingCompiled()
    launcher = launch.CellLauncher(compiled, compiled.KINDS, compiled.DTYPES)
    bound = launcher.bound((16, 32, 3, 0))
    launcher(48, 64, 4, 0)  # the shared cells change; the bound launch's do not
    bound()
    assert compiled.entry_calls == [(48, 64, 4, 0), (16, 32, 3, 0)]
    assert compiled.conversions == 1


@pytest.mark.parametrize("release", ["4.2.0", "4.4.0", None])
def test_cell_launcher_under_any_other_release_takes_the_public_path(monkeypatch, release):
    monkeypatch.setattr(submission, "DSL_VERSION", release)
    compiled = CellReadingCompiled()
    launcher = launch.CellLauncher(compiled, compiled.KINDS, compiled.DTYPES)
    launcher(1 << 32, 2 << 32, 7, 0)
    launcher.bound((3 << 32, 4 << 32, 9, 0))()
    assert compiled.conversions == 2 and len(compiled.public_calls) == 2
    for args, (a, b, n) in zip(compiled.public_calls, [(1 << 32, 2 << 32, 7), (3 << 32, 4 << 32, 9)]):
        assert [type(x).__name__ for x in args[:2]] == [type(make_ptr(cutlass.Int64, 16, cute.AddressSpace.gmem,
                                                                     assumed_align=16)).__name__] * 2
        assert int(args[0]._pointer) == a and int(args[1]._pointer) == b
        assert args[2].value == n and isinstance(args[3], cuda.CUstream)
