"""Build every kernel of the submission for its target architecture and report its resources.

Needs no GPU: ``python build_report.py`` (or ``python eval.py compile``) compiles each kernel
with the CuTe DSL for its target (sm_100a for the kernels in ``submission.py``, sm_90a for
those in ``nvfp4_hopper.py`` when that module exists), keeps the cubin and the PTX, and prints
per kernel: registers, spill bytes, stack, shared memory, compile time and the tensor-core MMA
found in the generated code.

Backends expose their kernels through one hook:

    compile_targets() -> [(kernel_name, arch, compile_fn), ...]
    compile_fn(num_groups, options) -> compiled function   (options: cute.compile options)

On a machine without a GPU the DSL writes the cubin and then fails to load it (no libcuda);
that failure is expected and ignored once the cubin exists.

Where the numbers come from (pure-Python ELF reader, no CUDA binary needed):
  * registers, local frame and stack: the cubin's ``.nv.info`` attributes (EIATTR_REGCOUNT,
    EIATTR_FRAME_SIZE, EIATTR_MIN/MAX_STACK_SIZE) of the kernel symbol;
  * spill bytes: spills live in the local frame, so a frame of 0 bytes proves 0 spill bytes;
    a non-zero frame is reported as an upper bound ("<=N");
  * shared memory: static (the cubin's ``.nv.shared.<kernel>`` section) plus dynamic (the
    launch's dynamic shared memory, which the DSL decides at trace time and which therefore is
    not in the cubin: recorded while compiling);
  * MMA: the instruction names matched in the PTX (``tcgen05.mma ... block_scale`` on sm_100a,
    ``wgmma.mma_async`` on sm_90a).

Options: ``--groups 1,2,8`` (group counts to build), ``--dump-dir DIR`` (keep artifacts there),
``--json PATH`` (also write the rows as JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import re
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent

# Per-block shared memory a kernel may opt into (static + dynamic), CUDA C Programming Guide,
# "Technical Specifications per Compute Capability": 227 KB for compute capability 9.0 and 10.0.
MAX_SMEM_PER_BLOCK_OPTIN = {"sm_90a": 232_448, "sm_100a": 232_448}
MAX_REGISTERS_PER_THREAD = 255

# Tensor-core MMA instructions per target, as they appear in the PTX
MMA_PATTERNS = {
    "sm_100a": re.compile(r"tcgen05\.mma\.[\w.:]*block_scale[\w.:]*"),
    "sm_90a": re.compile(r"wgmma\.mma_async[\w.:]*"),
}

BACKEND_MODULES = ("submission", "nvfp4_hopper")

# .nv.info attribute ids (EIATTR_*) and formats (EIFMT_*)
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL = 0x04


# =============================================================================
# Cubin (ELF) reader
# =============================================================================
@dataclasses.dataclass
class CubinFunction:
    name: str
    registers: int | None = None
    frame_bytes: int | None = None
    min_stack_bytes: int | None = None
    max_stack_bytes: int | None = None
    static_smem_bytes: int = 0


@dataclasses.dataclass
class Cubin:
    sm_version: int
    functions: dict[str, CubinFunction]


def read_cubin(data: bytes) -> Cubin:
    """Parse a CUDA cubin (64-bit little-endian ELF) into per-kernel resources."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    e_flags = struct.unpack_from("<I", data, 0x30)[0]
    e_shoff = struct.unpack_from("<Q", data, 0x28)[0]
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    sections = []
    for i in range(e_shnum):
        name_off, sh_type, _flags, _addr, offset, size, link, info, _align, entsize = (
            struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize)
        )
        sections.append((name_off, sh_type, offset, size, link, info, entsize))

    def cstring(offset: int) -> str:
        return data[offset : data.index(b"\0", offset)].decode()

    shstr_offset = sections[e_shstrndx][2]
    names = [cstring(shstr_offset + s[0]) for s in sections]

    # Symbol table: index -> name (the .nv.info attributes refer to symbols by index)
    symbols: dict[int, str] = {}
    for name, (_, sh_type, offset, size, link, _info, entsize) in zip(names, sections):
        if name == ".symtab" and sh_type == 2:
            strtab_offset = sections[link][2]
            for index in range(size // (entsize or 24)):
                st_name = struct.unpack_from("<I", data, offset + index * (entsize or 24))[0]
                symbols[index] = cstring(strtab_offset + st_name)

    functions = {}
    for name in names:
        if name.startswith(".text."):
            kernel = name[len(".text.") :]
            functions[kernel] = CubinFunction(kernel)
    for name, (_, _sh_type, _offset, size, *_rest) in zip(names, sections):
        if name.startswith(".nv.shared.") and name[len(".nv.shared.") :] in functions:
            functions[name[len(".nv.shared.") :]].static_smem_bytes = size

    field_by_attr = {
        EIATTR_REGCOUNT: "registers",
        EIATTR_FRAME_SIZE: "frame_bytes",
        EIATTR_MIN_STACK_SIZE: "min_stack_bytes",
        EIATTR_MAX_STACK_SIZE: "max_stack_bytes",
    }
    for name, (_, _sh_type, offset, size, *_rest) in zip(names, sections):
        if name != ".nv.info":
            continue
        # Entries: u8 format, u8 attribute, u16 value-or-size (+ payload for EIFMT_SVAL)
        pos, end = offset, offset + size
        while pos + 4 <= end:
            fmt, attr, value = struct.unpack_from("<BBH", data, pos)
            pos += 4
            if fmt != EIFMT_SVAL:
                continue
            payload = data[pos : pos + value]
            pos += value
            if attr in field_by_attr and len(payload) == 8:
                symbol_index, attr_value = struct.unpack("<II", payload)
                function = functions.get(symbols.get(symbol_index, ""))
                if function is not None:
                    setattr(function, field_by_attr[attr], attr_value)
    # Where e_flags holds the SM version depends on the CUDA ELF ABI version (e_ident[8]):
    # v8 (sm_100a here) in bits 8..15 (0x64 = sm_100), v7 (sm_90a here) in bits 0..7 (0x5a).
    abi_version = data[8]
    sm_version = (e_flags >> 8) & 0xFF if abi_version >= 8 else e_flags & 0xFF
    return Cubin(sm_version=sm_version, functions=functions)


# =============================================================================
# Dynamic shared memory, recorded while the DSL traces each launch
# =============================================================================
@contextlib.contextmanager
def record_dynamic_smem():
    """Collect the dynamic shared memory (bytes) of every kernel launch traced inside."""
    recorded: list[int] = []
    try:
        from cutlass.cutlass_dsl.cutlass import CutlassBaseDSL
    except ImportError:
        yield recorded
        return
    original = CutlassBaseDSL._get_smem_usage

    def recording(self):
        usage = original(self)
        if isinstance(usage, int):
            recorded.append(usage)
        return usage

    CutlassBaseDSL._get_smem_usage = recording
    try:
        yield recorded
    finally:
        CutlassBaseDSL._get_smem_usage = original


@contextlib.contextmanager
def captured_native_stderr():
    """Hold back what native code writes to fd 2 (the DSL's loader complains about the
    missing libcuda on machines without a GPU); the text is yielded for error reports."""
    text: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text.append(sink.read().decode(errors="replace"))


# =============================================================================
# Building
# =============================================================================
@dataclasses.dataclass
class KernelReport:
    target: str
    arch: str
    num_groups: int
    kernel: str
    sm_version: int
    registers: int | None
    frame_bytes: int | None
    spill_bytes_max: int | None  # 0 proves no spill; otherwise an upper bound
    stack_bytes: int | None
    static_smem_bytes: int
    dynamic_smem_bytes: int | None
    smem_bytes: int | None
    smem_limit_bytes: int | None
    compile_s: float
    mma: list[str]
    ptx_target: str | None
    cubin_path: str
    ptx_path: str | None


class BuildError(RuntimeError):
    pass


def collect_targets(modules=BACKEND_MODULES):
    """(module name, kernel name, arch, compile_fn) of every backend that exposes the hook."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    targets = []
    for module_name in modules:
        if module_name != "submission" and not (REPO_ROOT / f"{module_name}.py").exists():
            continue
        module = importlib.import_module(module_name)
        hook = getattr(module, "compile_targets", None)
        if hook is None:
            continue
        for kernel_name, arch, compile_fn in hook():
            targets.append((module_name, kernel_name, arch, compile_fn))
    return targets


def build_kernel(kernel_name: str, arch: str, compile_fn, num_groups: int, dump_dir: Path):
    """Compile one kernel for `arch`, keep its cubin/PTX in dump_dir, return its KernelReports."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(dump_dir.glob("*.cubin")) + list(dump_dir.glob("*.ptx")):
        stale.unlink()
    options = f"--keep-cubin --keep-ptx --dump-dir {dump_dir} --gpu-arch {arch}"
    load_error = None
    start = time.perf_counter()
    with record_dynamic_smem() as dynamic_smem, captured_native_stderr() as native_stderr:
        try:
            compile_fn(num_groups, options)
        except Exception as exc:  # noqa: BLE001 - judged below by whether the cubin exists
            load_error = exc
    compile_s = time.perf_counter() - start

    cubins = sorted(dump_dir.glob("*.cubin"))
    if not cubins:
        raise BuildError(
            f"{kernel_name} (G={num_groups}, {arch}): no cubin was produced"
            + (f": {type(load_error).__name__}: {load_error}" if load_error else "")
            + (f"\n{native_stderr[0]}" if native_stderr and native_stderr[0] else "")
        )
    # The cubin exists: a later exception is the JIT/load step (no libcuda here), expected.
    ptx_paths = sorted(dump_dir.glob("*.ptx"))
    ptx_text = ptx_paths[0].read_bytes().decode(errors="replace") if ptx_paths else ""
    ptx_target_match = re.search(r"^\.target\s+(\S+)", ptx_text, re.MULTILINE)
    mma_pattern = MMA_PATTERNS.get(arch)
    mma = sorted(set(mma_pattern.findall(ptx_text))) if mma_pattern else []

    cubin = read_cubin(cubins[0].read_bytes())
    reports = []
    for index, function in enumerate(cubin.functions.values()):
        dynamic = dynamic_smem[index] if index < len(dynamic_smem) else None
        stack = function.max_stack_bytes if function.max_stack_bytes is not None else function.min_stack_bytes
        reports.append(
            KernelReport(
                target=kernel_name,
                arch=arch,
                num_groups=num_groups,
                kernel=function.name,
                sm_version=cubin.sm_version,
                registers=function.registers,
                frame_bytes=function.frame_bytes,
                spill_bytes_max=function.frame_bytes,
                stack_bytes=stack,
                static_smem_bytes=function.static_smem_bytes,
                dynamic_smem_bytes=dynamic,
                smem_bytes=None if dynamic is None else function.static_smem_bytes + dynamic,
                smem_limit_bytes=MAX_SMEM_PER_BLOCK_OPTIN.get(arch),
                compile_s=compile_s,
                mma=mma,
                ptx_target=ptx_target_match.group(1) if ptx_target_match else None,
                cubin_path=str(cubins[0]),
                ptx_path=str(ptx_paths[0]) if ptx_paths else None,
            )
        )
    return reports


def build_all(num_groups_list, dump_root: Path, modules=BACKEND_MODULES) -> list[KernelReport]:
    reports = []
    for module_name, kernel_name, arch, compile_fn in collect_targets(modules):
        for num_groups in num_groups_list:
            dump_dir = dump_root / f"{module_name}.{kernel_name}.G{num_groups}"
            reports += build_kernel(kernel_name, arch, compile_fn, num_groups, dump_dir)
    return reports


def problems(report: KernelReport) -> list[str]:
    """Reasons a built kernel is not acceptable (empty when fine)."""
    found = []
    if report.registers is None or report.registers > MAX_REGISTERS_PER_THREAD:
        found.append(f"registers {report.registers}")
    if report.spill_bytes_max != 0:
        found.append(f"local frame {report.frame_bytes} B (possible spills)")
    if report.smem_bytes is None or (
        report.smem_limit_bytes is not None and report.smem_bytes > report.smem_limit_bytes
    ):
        found.append(f"shared memory {report.smem_bytes} B > {report.smem_limit_bytes} B")
    return found


# =============================================================================
# Report
# =============================================================================
def _short(name: str, width: int = 28) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def format_table(reports: list[KernelReport]) -> str:
    header = (
        f"{'target':<22} {'G':>2} {'arch':<8} {'regs':>4} {'spill':>6} {'stack':>5} "
        f"{'smem B':>7} {'(static+dyn)':>14} {'compile s':>9}  mma / kernel"
    )
    lines = [header, "-" * len(header)]
    for r in reports:
        spill = "0" if r.spill_bytes_max == 0 else f"<={r.spill_bytes_max}"
        smem = "?" if r.smem_bytes is None else str(r.smem_bytes)
        split = f"({r.static_smem_bytes}+{r.dynamic_smem_bytes})"
        mma = ", ".join(r.mma) if r.mma else "no MMA"
        lines.append(
            f"{r.target:<22} {r.num_groups:>2} {r.arch:<8} {r.registers!s:>4} {spill:>6} "
            f"{r.stack_bytes!s:>5} {smem:>7} {split:>14} {r.compile_s:>9.2f}  {mma}"
        )
        lines.append(f"{'':<22}    kernel {_short(r.kernel, 90)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build_report",
        description="Compile every kernel for its target architecture (no GPU needed) and "
        "print registers, spills, stack, shared memory and compile time from the cubin.",
    )
    parser.add_argument("--groups", default="1,2,8", help="group counts to build (default 1,2,8)")
    parser.add_argument("--dump-dir", default=None, help="keep cubins/PTX here (default: temp)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    num_groups_list = [int(x) for x in args.groups.split(",") if x.strip()]

    with contextlib.ExitStack() as stack:
        if args.dump_dir:
            dump_root = Path(args.dump_dir)
        else:
            dump_root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nvfp4_build_")))
        try:
            reports = build_all(num_groups_list, dump_root)
        except BuildError as exc:
            print(f"build failed: {exc}", file=sys.stderr)
            return 1
        print(format_table(reports))
        bad = [(r, problems(r)) for r in reports if problems(r)]
        for r, found in bad:
            print(f"NOT OK {r.target} G={r.num_groups}: {'; '.join(found)}")
        print(
            f"{len(reports)} kernel builds; limits: <= {MAX_REGISTERS_PER_THREAD} registers, "
            "0 spill bytes, shared memory <= "
            + ", ".join(f"{a}: {v} B" for a, v in MAX_SMEM_PER_BLOCK_OPTIN.items())
            + ". Compiled only: nothing here was run on a GPU."
        )
        if args.json:
            Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in reports], indent=2))
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
