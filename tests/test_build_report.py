"""build_report.py without the DSL: its readers (cubin, PTX, compiled host code) on small
inputs of the forms the DSL produces, and its handling of targets that fail.

The end-to-end builds with the DSL are in test_compile.py (sm_100a) and test_hopper.py
(sm_90a); here stand-in backends write a cubin, a PTX and return host code, raise, or kill
the build process, so every path of the report runs in a fraction of a second per build.
"""

import json
import re
import struct
import textwrap
import time
from pathlib import Path

import pytest

import build_report

LAUNCH_CONFIG = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


# ---------------------------------------------------------------------------------------
# Inputs in the DSL's forms
# ---------------------------------------------------------------------------------------
def make_cubin(kernel: str, registers: int, frame: int, static_smem: int, sm: int = 100) -> bytes:
    """A minimal CUDA cubin: ELF64 with the kernel's .text, .nv.shared and .nv.info
    attributes (REGCOUNT, FRAME_SIZE, MIN_STACK_SIZE) the way ptxas writes them."""
    names = ["", ".shstrtab", ".strtab", ".symtab", ".nv.info", f".text.{kernel}", f".nv.shared.{kernel}"]
    shstrtab = b"\0".join(n.encode() for n in names) + b"\0"
    name_offsets = [shstrtab.index(n.encode() + b"\0") if n else 0 for n in names]
    strtab = b"\0" + kernel.encode() + b"\0"
    symtab = bytes(24) + struct.pack("<IBBHQQ", 1, 0x12, 0, 5, 0, 16)  # symbol 1: the kernel

    def attr(attribute: int, value: int) -> bytes:
        return struct.pack("<BBHII", 0x04, attribute, 8, 1, value)

    nv_info = attr(0x2F, registers) + attr(0x11, frame) + attr(0x12, 0)
    text = bytes(16)
    # (type, content or NOBITS size, link)
    sections = [(0, b"", 0), (3, shstrtab, 0), (3, strtab, 0), (2, symtab, 2), (0x70000000, nv_info, 3),
                (1, text, 0), (8, static_smem, 0)]
    body, offsets, offset = b"", [], 64
    for _type, content, _link in sections:
        offsets.append(offset)
        if isinstance(content, bytes):
            body += content
            offset += len(content)
    headers = b""
    for index, (sh_type, content, link) in enumerate(sections):
        size = len(content) if isinstance(content, bytes) else content
        entsize = 24 if sh_type == 2 else 0
        headers += struct.pack("<IIQQQQIIQQ", name_offsets[index], sh_type, 0, 0, offsets[index], size, link, 0, 1, entsize)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0x33, 8]) + bytes(7)
    header = ident + struct.pack(
        "<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, 64 + len(body), sm << 8, 64, 0, 0, 64, len(sections), 1
    )
    return header + body + headers


def make_ptx(kernel: str, threads=(128, 1, 1), body: str = "") -> str:
    return textwrap.dedent(f"""\
        .version 8.8
        .target sm_100a
        .address_size 64
        .extern .shared .align 1024 .b8 __dynamic_shmem__0[];

        .visible .entry {kernel}(
        \t.param .align 8 .b8 {kernel}_param_0[16]
        )
        .reqntid {threads[0]}, {threads[1]}, {threads[2]}
        {{
        {body}
        \tret;
        }}
        """)


def host_function(name: str, launches) -> str:
    """A host function in the lowered form of the DSL's launches: a cudaLaunchConfig_t whose
    dynamicSmemBytes (field 2) is stored from a constant, then cudaLaunchKernelEx with the
    kernel handle loaded from its global. `launches`: (kernel, smem bytes or None)."""
    lines = [f"  llvm.func @{name}(%arg0: !llvm.ptr, %arg1: i64) -> i32 {{",
             "    %0 = llvm.mlir.constant(1 : i32) : i32"]
    for i, (kernel, smem) in enumerate(launches):
        if smem is None:
            value = "%arg1"  # a size known only at run time
        else:
            lines.append(f"    %c{i} = llvm.mlir.constant({smem} : i32) : i32")
            lines.append(f"    %s{i} = llvm.sext %c{i} : i32 to i64")
            value = f"%s{i}"
        lines += [
            f"    %cfg{i} = llvm.alloca %0 x {LAUNCH_CONFIG} : (i32) -> !llvm.ptr",
            f"    %f{i} = llvm.getelementptr %cfg{i}[0, 1, 0] : (!llvm.ptr) -> !llvm.ptr, {LAUNCH_CONFIG}",
            f"    llvm.store %0, %f{i} : i32, !llvm.ptr",
            f"    %g{i} = llvm.getelementptr %cfg{i}[0, 2] : (!llvm.ptr) -> !llvm.ptr, {LAUNCH_CONFIG}",
            f"    llvm.store {value}, %g{i} : i64, !llvm.ptr",
            f"    %k{i} = llvm.mlir.addressof @kernels_{kernel} : !llvm.ptr",
            f"    %h{i} = llvm.load %k{i} : !llvm.ptr -> !llvm.ptr",
            f"    %r{i} = llvm.call @_cudaLaunchKernelEx(%cfg{i}, %h{i}, %arg0) : (!llvm.ptr, !llvm.ptr, !llvm.ptr) -> i32",
        ]
    lines += ["    llvm.return %0 : i32", "  }"]
    return "\n".join(lines)


def host_module(*functions: str) -> str:
    return "\n".join([
        "module attributes {gpu.container_module} {",
        "  llvm.func @_cudaLaunchKernelEx(!llvm.ptr, !llvm.ptr, !llvm.ptr) -> i32",
        *functions,
        "}",
    ])


# ---------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------
def test_read_cubin_of_a_minimal_cubin():
    cubin = build_report.read_cubin(make_cubin("kernel_a", registers=142, frame=0, static_smem=1024))
    assert cubin.sm_version == 100
    (function,) = cubin.functions.values()
    assert (function.name, function.registers, function.frame_bytes) == ("kernel_a", 142, 0)
    assert (function.min_stack_bytes, function.static_smem_bytes) == (0, 1024)


def test_read_ptx_entries_threads_and_mma():
    ptx = make_ptx("kernel_a", threads=(192, 1, 1),
                   body="tcgen05.mma.cta_group::2.kind::mxf4nvf4.block_scale.block16 [%r1], %rd1;")
    ptx += make_ptx("kernel_b", threads=(32, 2, 1)).split(".address_size 64", 1)[1]
    target, entries = build_report.read_ptx(ptx)
    assert target == "sm_100a"
    assert {name: e.threads for name, e in entries.items()} == {"kernel_a": 192, "kernel_b": 64}
    assert build_report.mma_instructions(entries["kernel_a"].text, "sm_100a") == [
        "tcgen05.mma.cta_group::2.kind::mxf4nvf4.block_scale.block16"
    ]
    assert build_report.mma_instructions(entries["kernel_b"].text, "sm_100a") == []


def test_host_launches_read_the_launch_config():
    ir = host_module(host_function("run", [("kernel_init_0", 640), ("kernel_gemm_0", 226304)]))
    launches = build_report.host_launches(ir)
    assert [(l.kernel_symbol, l.dynamic_smem_bytes) for l in launches] == [
        ("kernels_kernel_init_0", 640), ("kernels_kernel_gemm_0", 226304)
    ]
    assert build_report.launch_smem_by_kernel(launches, ["kernel_gemm_0", "kernel_init_0"]) == {
        "kernel_init_0": 640, "kernel_gemm_0": 226304
    }


def test_host_launches_scoped_per_function_and_runtime_sizes():
    # SSA names repeat across functions; a size computed at run time is not a figure
    ir = host_module(host_function("first", [("kernel_a", 512)]), host_function("second", [("kernel_b", None)]))
    launches = build_report.host_launches(ir)
    assert [(l.kernel_symbol, l.dynamic_smem_bytes) for l in launches] == [
        ("kernels_kernel_a", 512), ("kernels_kernel_b", None)
    ]
    assert build_report.launch_smem_by_kernel(launches, ["kernel_a", "kernel_b"]) == {
        "kernel_a": 512, "kernel_b": None
    }


def test_host_launches_plain_cuda_launch_kernel():
    ir = host_module(textwrap.dedent("""\
          llvm.func @run(%arg0: !llvm.ptr, %arg1: !llvm.ptr) -> i32 {
            %0 = llvm.mlir.constant(1 : i32) : i32
            %1 = llvm.mlir.constant(70656 : i64) : i64
            %2 = llvm.mlir.addressof @kernels_kernel_c : !llvm.ptr
            %3 = llvm.load %2 : !llvm.ptr -> !llvm.ptr
            %4 = llvm.call @_cudaLaunchKernel(%3, %0, %0, %0, %0, %0, %0, %arg0, %1, %arg1) : (!llvm.ptr, i32, i32, i32, i32, i32, i32, !llvm.ptr, i64, !llvm.ptr) -> i32
            llvm.return %4 : i32
          }"""))
    (launch,) = build_report.host_launches(ir)
    assert (launch.kernel_symbol, launch.dynamic_smem_bytes) == ("kernels_kernel_c", 70656)


def test_one_launch_of_one_kernel_belong_together():
    launches = [build_report.HostLaunch(kernel_symbol=None, dynamic_smem_bytes=4096)]
    assert build_report.launch_smem_by_kernel(launches, ["kernel_x"]) == {"kernel_x": 4096}


# ---------------------------------------------------------------------------------------
# Building: one target in this process
# ---------------------------------------------------------------------------------------
class Compiled:
    def __init__(self, ir_module):
        self.ir_module = ir_module


def writing_compile(kernel="kernel_k_0", registers=96, frame=0, smem=73856, raise_after=None, host=True):
    """A compile_fn that writes a cubin and PTX where the options say, like cute.compile."""

    def compile_fn(num_groups, options):
        words = options.split()
        dump_dir = Path(words[words.index("--dump-dir") + 1])
        (dump_dir / "k.sm_100a.cubin").write_bytes(make_cubin(kernel, registers, frame, 1024))
        (dump_dir / "k.sm_100a.ptx").write_text(
            make_ptx(kernel, body="tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X [%r1];")
        )
        if raise_after is not None:
            raise raise_after
        return Compiled(host_module(host_function("host", [(kernel, smem)])) if host else None)

    return compile_fn


def test_build_kernel_reads_every_figure(tmp_path):
    (report,) = build_report.build_kernel("t", "sm_100a", writing_compile(), 2, tmp_path)
    assert not report.failed and report.error is None
    assert (report.kernel, report.sm_version, report.registers, report.spill_bytes_max) == ("kernel_k_0", 100, 96, 0)
    assert (report.static_smem_bytes, report.dynamic_smem_bytes, report.smem_bytes) == (1024, 73856, 74880)
    assert report.dynamic_smem_source == "launch config in the compiled host code"
    assert report.threads == 128 and report.ptx_target == "sm_100a"
    assert report.mma == ["tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X"]
    assert build_report.problems(report) == []


def test_build_kernel_exception_before_the_cubin_is_a_failed_row(tmp_path):
    def compile_fn(num_groups, options):
        raise AttributeError("module 'cutlass.cute.arch' has no attribute 'ProxyKind'")

    (report,) = build_report.build_kernel("sm90_x", "sm_90a", compile_fn, 1, tmp_path)
    assert report.failed and report.registers is None and report.cubin_path is None
    assert report.error == (
        "no cubin was produced: AttributeError: module 'cutlass.cute.arch' has no attribute 'ProxyKind'"
    )
    assert build_report.problems(report) == [f"build failed: {report.error}"]


def test_build_kernel_without_host_code_says_why_smem_is_unknown(tmp_path):
    (raised,) = build_report.build_kernel(
        "t", "sm_100a", writing_compile(raise_after=RuntimeError("no libcuda")), 1, tmp_path / "a"
    )
    assert not raised.failed and raised.registers == 96 and raised.dynamic_smem_bytes is None
    assert raised.dynamic_smem_source.startswith("unavailable: the compile raised after writing the cubin")
    assert any("shared memory unknown" in p for p in build_report.problems(raised))

    (runtime_size,) = build_report.build_kernel("t", "sm_100a", writing_compile(smem=None), 1, tmp_path / "b")
    assert runtime_size.dynamic_smem_bytes is None
    assert "no launch of this kernel with a constant" in runtime_size.dynamic_smem_source


def test_limits_are_checked(tmp_path):
    (report,) = build_report.build_kernel(
        "t", "sm_100a", writing_compile(registers=255, frame=16, smem=240_000), 1, tmp_path
    )
    found = build_report.problems(report)
    assert found == ["local frame 16 B (possible spills)", "shared memory 241024 B > 232448 B"]


# ---------------------------------------------------------------------------------------
# Building: every target, in the build process
# ---------------------------------------------------------------------------------------
FAKE_BACKEND = '''
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
CUBIN = (HERE / "k.cubin").read_bytes()
PTX = (HERE / "k.ptx").read_text()
HOST = (HERE / "host.mlir").read_text()


class Compiled:
    ir_module = HOST


def _good(num_groups, options):
    words = options.split()
    dump_dir = Path(words[words.index("--dump-dir") + 1])
    (dump_dir / "k.sm_100a.cubin").write_bytes(CUBIN)
    (dump_dir / "k.sm_100a.ptx").write_text(PTX)
    return Compiled()


def _raises(num_groups, options):
    raise AttributeError("module 'cutlass.cute.arch' has no attribute 'ProxyKind'")


def _dies(num_groups, options):
    os._exit(3)  # as a crash in native code ends the process


def compile_targets():
    return [
        ("good", "sm_100a", _good),
        ("raises", "sm_90a", _raises),
        ("dies", "sm_100a", _dies),
        ("after", "sm_100a", _good),
    ]
'''


@pytest.fixture
def fake_backends(tmp_path):
    (tmp_path / "k.cubin").write_bytes(make_cubin("kernel_k_0", 64, 0, 1024))
    (tmp_path / "k.ptx").write_text(make_ptx("kernel_k_0", threads=(192, 1, 1)))
    (tmp_path / "host.mlir").write_text(host_module(host_function("host", [("kernel_k_0", 2048)])))
    (tmp_path / "report_fake_backend.py").write_text(FAKE_BACKEND)
    (tmp_path / "report_broken_backend.py").write_text("raise ImportError('half-written backend')\n")
    return tmp_path


def test_build_all_failed_targets_are_rows_and_the_rest_build(fake_backends, tmp_path_factory):
    reports = build_report.build_all(
        (1, 2), tmp_path_factory.mktemp("dump"), modules=("report_broken_backend", "report_fake_backend"),
        paths=(fake_backends,),
    )
    rows = [(r.target, r.num_groups, r.failed) for r in reports]
    assert rows == [
        ("report_broken_backend", 0, True),
        ("good", 1, False), ("good", 2, False),
        ("raises", 1, True), ("raises", 2, True),
        ("dies", 1, True), ("dies", 2, True),
        ("after", 1, False), ("after", 2, False),
    ]
    by_target = {(r.target, r.num_groups): r for r in reports}
    assert "ImportError: half-written backend" in by_target[("report_broken_backend", 0)].error
    assert "AttributeError" in by_target[("raises", 1)].error and "ProxyKind" in by_target[("raises", 1)].error
    assert by_target[("dies", 2)].error.startswith("the build process died (exit status 3)")
    after = by_target[("after", 2)]
    assert (after.registers, after.dynamic_smem_bytes, after.smem_bytes, after.threads) == (64, 2048, 3072, 192)
    assert Path(after.cubin_path).parent.name == "report_fake_backend.after.G2"


def test_main_lists_failed_rows_and_exits_1(fake_backends, monkeypatch, capsys, tmp_path_factory):
    monkeypatch.setenv("PYTHONPATH", str(fake_backends))
    json_path = tmp_path_factory.mktemp("out") / "rows.json"
    code = build_report.main(["--modules", "report_fake_backend", "--groups", "1", "--json", str(json_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "raises                    1 sm_90a   FAILED: no cubin was produced: AttributeError" in out
    assert "dies                      1 sm_100a  FAILED: the build process died (exit status 3)" in out
    assert "2 kernel builds, 2 failed" in out
    assert out.splitlines()[0].startswith("nvidia-cutlass-dsl ")
    rows = json.loads(json_path.read_text())
    assert [(r["target"], r["error"] is None) for r in rows] == [
        ("good", True), ("raises", False), ("dies", False), ("after", True)
    ]


def test_main_prints_a_line_per_build_on_stderr(fake_backends, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(fake_backends))
    assert build_report.main(["--modules", "report_fake_backend", "--groups", "1"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0] == "4 builds to run (report_fake_backend; group counts 1)"
    assert re.fullmatch(r"build 1 of 4: good G=1 \(sm_100a\): \d+\.\d\d s", lines[1]), lines[1]
    assert lines[2].startswith("build 2 of 4: raises G=1 (sm_90a): FAILED: no cubin was produced: "
                               "AttributeError: module 'cutlass.cute.arch' has no")
    assert max(len(line) for line in lines) <= 120
    assert lines[3] == "build 3 of 4: dies G=1 (sm_100a): FAILED: the build process died (exit status 3)"
    assert re.fullmatch(r"build 4 of 4: after G=1 \(sm_100a\): \d+\.\d\d s", lines[4]), lines[4]
    assert len(lines) == 5 and "build 1 of 4" not in captured.out  # the table stays on stdout


SLOW_BACKEND = """
import time
from report_fake_backend import _good

def _slow(num_groups, options):
    time.sleep(1.5)
    return _good(num_groups, options)

def compile_targets():
    return [("first", "sm_100a", _good), ("slow", "sm_100a", _slow)]
"""


def test_build_all_reports_each_build_as_it_finishes(fake_backends, tmp_path_factory):
    (fake_backends / "report_slow_backend.py").write_text(SLOW_BACKEND)
    heard = []
    reports = build_report.build_all((1,), tmp_path_factory.mktemp("dump"), modules=("report_slow_backend",),
                                     paths=(fake_backends,),
                                     progress=lambda line: heard.append((time.monotonic(), line)))
    finished = time.monotonic()
    assert [r.target for r in reports] == ["first", "slow"] and not any(r.failed for r in reports)
    assert [line.split(":")[0] for _, line in heard] == [
        "2 builds to run (report_slow_backend; group counts 1)", "build 1 of 2", "build 2 of 2"]
    assert heard[1][0] < finished - 1.0  # the first build's line came while the slow one ran


SHARED_BACKEND = """
from report_fake_backend import _good

_COMPILED = {}


def _takes_no_g(num_groups, options):  # as core.compile_once's cache: one build per key, G not in it
    if options not in _COMPILED:
        _COMPILED[options] = _good(num_groups, options)
    return _COMPILED[options]


def compile_targets():
    return [("no_g", "sm_100a", _takes_no_g), ("per_g", "sm_100a", _good)]
"""


def test_a_build_that_takes_no_g_is_built_once_and_reported_per_g(fake_backends, tmp_path_factory):
    (fake_backends / "report_shared_backend.py").write_text(SHARED_BACKEND)
    heard = []
    reports = build_report.build_all((1, 2, 8), tmp_path_factory.mktemp("dump"), modules=("report_shared_backend",),
                                     paths=(fake_backends,), progress=heard.append)
    rows = {(r.target, r.num_groups): r for r in reports}
    assert len(reports) == 6 and not any(r.failed for r in reports)
    # the same options for every G of a target: the compile cache answers G = 2 and 8
    assert [rows[("no_g", g)].same_build_as_groups for g in (1, 2, 8)] == [None, 1, 1]
    assert [rows[("per_g", g)].same_build_as_groups for g in (1, 2, 8)] == [None, None, None]
    assert rows[("no_g", 8)].cubin_path == rows[("no_g", 1)].cubin_path
    assert Path(rows[("per_g", 8)].cubin_path).parent.name == "report_shared_backend.per_g.G8"
    assert len({rows[("per_g", g)].cubin_path for g in (1, 2, 8)}) == 3
    for g in (1, 2, 8):  # each row its own build's artifacts, still there
        assert Path(rows[("per_g", g)].cubin_path).is_file() and Path(rows[("per_g", g)].ptx_path).is_file()
    assert (rows[("no_g", 2)].registers, rows[("no_g", 2)].smem_bytes) == (rows[("no_g", 1)].registers,
                                                                            rows[("no_g", 1)].smem_bytes)
    assert heard[2] == "build 2 of 6: no_g G=2 (sm_100a): the G=1 build (its build takes no G)"
    # the table: the build's time on its row, `=G1` on the rows that repeat it
    times = [line.split()[-1] for line in build_report.format_table(reports).splitlines() if line.startswith("no_g ")]
    assert re.fullmatch(r"\d+\.\d\d", times[0]) and times[1:] == ["=G1", "=G1"], times


def test_the_table_fits_in_120_columns():
    good = build_report.KernelReport(
        target="sm90_swap_ab_gemm_one_round_k128_with_a_much_longer_name_than_any", arch="sm_90a",
        num_groups=64, kernel="kernel_cutlass_" + "x" * 300, sm_version=90, registers=168, frame_bytes=0,
        spill_bytes_max=0, stack_bytes=0, static_smem_bytes=1024, dynamic_smem_bytes=230_000,
        smem_bytes=231_024, smem_limit_bytes=232_448, compile_s=123.45,
        mma=[f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16" for n in (8, 16, 64, 128, 256)],
        ptx_target="sm_90a", cubin_path=None, ptx_path=None, threads=384,
    )
    failed = build_report.failed_report("sm100_persistent_gemm_t256", "sm_100a", 8,
                                        "no cubin was produced: " + "E" * 300 + "\n" + "line 2 " * 40)
    table = build_report.format_table([good, failed])
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= 120, table
    assert lines[2].startswith("sm90_swap_ab_gemm_one_round_k128_with... 64 sm_90a    168      0")
    mma = " ".join(line.strip() for line in lines if line.startswith(("    mma: ", "        ")))
    assert all(instruction in mma for instruction in good.mma)  # wrapped, none cut
    assert any(line.startswith("    kernel: kernel_cutlass_xxx") and line.endswith("...") for line in lines)
    assert any(line.startswith("sm100_persistent_gemm_t256                8 sm_100a  FAILED: no cubin was produced: EEE")
               for line in lines)
    assert "    line 2 line 2" in table


def test_main_exits_0_when_every_target_builds_within_limits(fake_backends, monkeypatch, capsys):
    (fake_backends / "report_good_backend.py").write_text(
        FAKE_BACKEND.replace('("raises", "sm_90a", _raises),', "").replace('("dies", "sm_100a", _dies),', "")
    )
    monkeypatch.setenv("PYTHONPATH", str(fake_backends))
    assert build_report.main(["--modules", "report_good_backend", "--groups", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "4 kernel builds, 0 failed" in out
    assert "dynamic shared memory: launch config in the compiled host code" in out


def test_build_all_relative_dump_dir_is_the_callers(fake_backends, monkeypatch, tmp_path_factory):
    # The build process runs in the repository root; a relative dump dir is the caller's
    caller_dir = tmp_path_factory.mktemp("caller")
    monkeypatch.chdir(caller_dir)
    reports = build_report.build_all((1,), Path("dumps"), modules=("report_fake_backend",), paths=(fake_backends,))
    good = [r for r in reports if not r.failed]
    assert good and all(Path(r.cubin_path).is_relative_to(caller_dir / "dumps") for r in good)


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--groups", "0,x"], "--groups: '0,x': expected comma-separated group counts in 1..64"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        build_report.main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_tensormap_fences_are_counted_per_kernel():
    ptx = ("tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [%rd1], [%r1], 128;\n"
           "fence.proxy.tensormap::generic.acquire.gpu [%rd2], 128;\nprefetch.tensormap [%rd2];\n"
           "fence.proxy.tensormap::generic.acquire.gpu [%rd3], 128;\nprefetch.tensormap [%rd3];\n")
    assert build_report.tensormap_fences(ptx) == {"acquire": 2, "release": 1, "prefetch": 2}
    assert build_report.tensormap_fences("mov.u32 %r1, 0;") == {"acquire": 0, "release": 0, "prefetch": 0}
