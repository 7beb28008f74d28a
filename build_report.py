"""Build every kernel of the submission for its target architecture and report its resources.

Needs no GPU: ``python build_report.py`` (or ``python eval.py compile``) compiles each kernel
with the CuTe DSL for its target (sm_100a for the kernels in ``submission.py``, sm_90a for
those in the ``nvfp4_group_gemm.hopper`` package when it exists), keeps the cubin and the PTX, and prints
per kernel: registers, spill bytes, stack, shared memory, threads, compile time and the
tensor-core MMA found in the generated code. Works with every DSL release the project checks
(4.3.5, the leaderboard runner's, and 4.8.1): nothing here reads DSL internals.

Backends expose their kernels through one hook:

    compile_targets() -> [(kernel_name, arch, compile_fn), ...]
    compile_fn(num_groups, options) -> compiled function   (options: cute.compile options)

Where the numbers come from:
  * registers, local frame and stack: the cubin's ``.nv.info`` attributes (EIATTR_REGCOUNT,
    EIATTR_FRAME_SIZE, EIATTR_MIN/MAX_STACK_SIZE) of the kernel symbol (pure-Python ELF
    reader, no CUDA binary needed);
  * spill bytes: spills live in the local frame, so a frame of 0 bytes proves 0 spill bytes;
    a non-zero frame is reported as an upper bound ("<=N");
  * static shared memory: the cubin's ``.nv.shared.<kernel>`` section;
  * dynamic shared memory: neither the cubin nor the PTX holds it (the PTX declares the
    buffer as ``.extern .shared ... []``, size 0, and the cubin has no attribute for it; both
    checked under 4.3.5 and 4.8.1). The launch sets it, so it is read from the compiled
    function's host code (its public ``ir_module``, lowered to the LLVM dialect): the
    constant stored into the ``dynamicSmemBytes`` field of the CUDA runtime's
    ``cudaLaunchConfig_t`` that the launch of that kernel passes to ``cudaLaunchKernelEx``.
    Each row names this source (``dynamic_smem_source``);
  * threads per CTA: the PTX entry's ``.reqntid`` (or ``.maxntid``);
  * MMA: the instruction names in the kernel's PTX entry (``tcgen05.mma ... block_scale`` on
    sm_100a, ``wgmma.mma_async`` on sm_90a).
  * chaining (kernels launched as programmatic dependents): the control flow of the kernel's
    PTX entry (``ptx_flow``), read on every path: its ``griddepcontrol.wait`` and
    ``griddepcontrol.launch_dependents`` instructions, how many triggers come before a wait,
    and how many global memory, descriptor and tensormap accesses are reachable without a
    wait (``grid_dependency``; 0 means every one waits for the kernel before).

How it builds: ``build_all`` runs the builds in a child Python process. There the DSL is told
(``CUTE_DSL_ARCH``) that the machine's GPU is one no target is built for, so every DSL release
compiles without loading the module onto a GPU (no GPU or libcuda needed) and returns the
compiled function; the file cache is off so each build writes its cubin and PTX. A target
that fails (an exception, no cubin, or the process dying) becomes a failed row with its
reason; the other targets still build, and the exit code is 1. The options name one folder
per target, the same for every G, so a target whose build takes no G (one compiled function
serves every G: the compile cache returns it) compiles once; its rows for the other group
counts repeat that build's figures (``=G1`` in the time column). While they run, ``main`` prints
one line per finished build on stderr (``build 3 of 16: sm100_gemm G=2 (sm_100a): 4.21 s``);
the table (stdout) fits in 120 columns: a row of figures per kernel, then its MMA
instructions and its kernel symbol on lines of their own.

Options: ``--groups 1,2,8`` (group counts to build), ``--modules submission,nvfp4_group_gemm.hopper,nvfp4_group_gemm.sm100,nvfp4_group_gemm.sm100_moe``
(backends), ``--dump-dir DIR`` (keep artifacts there), ``--json PATH`` (also write the rows
as JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
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

BACKEND_MODULES = ("submission", "nvfp4_group_gemm.hopper", "nvfp4_group_gemm.sm100", "nvfp4_group_gemm.sm100_moe")

# The GPU architecture the build process tells the DSL it runs on: one that no target is
# built for, so that the DSL compiles for the target without loading the result onto a GPU.
HOST_ARCH_FOR_BUILDS = "sm_80"

# .nv.info attribute ids (EIATTR_*) and formats (EIFMT_*)
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL = 0x04


def dsl_version() -> str | None:
    try:
        return package_version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        return None


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
# PTX reader
# =============================================================================
@dataclasses.dataclass
class PtxEntry:
    name: str
    text: str  # from ".entry" to the next entry or function
    threads: int | None  # .reqntid (or .maxntid) x * y * z


_PTX_FUNCTION_START = re.compile(r"^[ \t]*(?:\.(?:visible|weak|extern)\s+)*\.(entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)", re.MULTILINE)
_PTX_THREADS = re.compile(r"^[ \t]*\.(?:reqntid|maxntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", re.MULTILINE)


def read_ptx(text: str) -> tuple[str | None, dict[str, PtxEntry]]:
    """The PTX's ``.target`` and its kernel entries (name -> PtxEntry)."""
    target = re.search(r"^\.target\s+([\w]+)", text, re.MULTILINE)
    starts = list(_PTX_FUNCTION_START.finditer(text))
    entries = {}
    for index, match in enumerate(starts):
        if match.group(1) != "entry":
            continue
        end = starts[index + 1].start() if index + 1 < len(starts) else len(text)
        body = text[match.start() : end]
        threads = None
        found = _PTX_THREADS.search(body[: body.find("{")] if "{" in body else body)
        if found:
            threads = 1
            for dim in found.groups():
                threads *= int(dim) if dim else 1
        entries[match.group(2)] = PtxEntry(match.group(2), body, threads)
    return (target.group(1) if target else None), entries


# TMA descriptor fences and prefetches in a kernel's PTX: the writer releases each descriptor it
# wrote; a consumer acquires each descriptor another kernel wrote before its first use, then
# prefetches it
_TENSORMAP_OPS = {
    "acquire": re.compile(r"fence\.proxy\.tensormap::generic\.acquire"),
    "release": re.compile(r"tensormap\.cp_fenceproxy[\w.:]*\.release"),
    "prefetch": re.compile(r"prefetch\.tensormap"),
}


def tensormap_fences(ptx_text: str) -> dict[str, int]:
    """Counts of descriptor acquires, releases and prefetches in `ptx_text`."""
    return {name: len(pattern.findall(ptx_text)) for name, pattern in _TENSORMAP_OPS.items()}


def mma_instructions(ptx_text: str, arch: str) -> list[str]:
    pattern = MMA_PATTERNS.get(arch)
    return sorted(set(pattern.findall(ptx_text))) if pattern else []


# =============================================================================
# Chained calls: griddepcontrol.wait and launch_dependents against global accesses
# =============================================================================
# Control flow of one kernel's PTX or SASS, to show where its griddepcontrol.wait and
# griddepcontrol.launch_dependents sit against its global memory accesses on every path (not
# only in text order): each instruction's successors (fallthrough, branch targets, call
# targets); paths end at exit, ret and trap.
@dataclasses.dataclass
class Flow:
    ops: list[str]  # each instruction as written, its predicate removed
    successors: list[list[int]]

    def reach(self, stop) -> set[int]:
        """Instructions reachable from the entry without passing one for which `stop(index)`
        is true (those are reached, and the path ends there)."""
        seen, todo = {0}, [0]
        while todo:
            index = todo.pop()
            if stop(index):
                continue
            for nxt in self.successors[index]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    def always_after(self, targets, blockers) -> bool:
        """Every path from the entry to each of `targets` passes one of `blockers`."""
        blockers = set(blockers)
        return not (set(targets) & self.reach(lambda i: i in blockers))


def _flow(instructions, labels) -> Flow:
    """instructions: (op, predicated, targets, kind) with kind 'branch' (targets, fallthrough
    if predicated), 'call' (targets and fallthrough), 'end' (no successor unless predicated)
    or None; labels: name -> index of the instruction that follows it."""
    successors = []
    for index, (_op, predicated, targets, kind) in enumerate(instructions):
        nxt = [labels[t] for t in targets if t in labels] if kind in ("branch", "call") else []
        if (kind not in ("branch", "end") or predicated) and index + 1 < len(instructions):
            nxt.append(index + 1)
        successors.append(nxt)
    return Flow([op for op, *_ in instructions], successors)


_PTX_PREDICATE = re.compile(r"^@!?%?\w+\s+")


def ptx_flow(ptx_text: str) -> Flow:
    """The control flow of the first .entry of `ptx_text`. Inline-asm blocks ({ ... }) have
    labels of their own (the mbarrier wait loops all say LAB_WAIT): a label resolves in the
    innermost block that defines it."""
    start = ptx_text.find(".entry")
    body = ptx_text[ptx_text.index("{", ptx_text.index(")", start)) + 1:] if start >= 0 else ""
    instructions, labels, scopes, next_scope, pending = [], {}, [0], 1, []
    defined: dict[int, set] = {0: set()}
    for raw in body.splitlines():
        line = re.sub(r"//.*", "", raw).strip()
        if not line:
            continue
        if line == "{":
            scopes.append(next_scope)
            defined[next_scope] = set()
            next_scope += 1
            continue
        if line == "}":
            if len(scopes) == 1:
                break  # the end of the entry
            scopes.pop()
            continue
        label = re.fullmatch(r"([$\w.]+):", line)
        if label:
            name = (scopes[-1], label.group(1))
            defined[scopes[-1]].add(label.group(1))
            pending.append(name)
            continue
        if line.startswith(".") or not line.endswith(";"):
            continue  # directives, declarations
        for name in pending:
            labels[name] = len(instructions)
        pending = []
        predicated = bool(_PTX_PREDICATE.match(line))
        op = _PTX_PREDICATE.sub("", line).rstrip(";").strip()
        opcode = op.split()[0]
        kind, targets = None, []
        if opcode.split(".")[0] == "bra":
            kind, targets = "branch", [(tuple(scopes), op.split()[-1].rstrip(";"))]
        elif opcode.split(".")[0] in ("ret", "exit", "trap"):
            kind = "end"
        instructions.append((op, predicated, targets, kind))
    # resolve each branch target in the innermost enclosing block that defines it
    resolved = []
    for op, predicated, targets, kind in instructions:
        names = []
        for chain, name in targets:
            scope = next((s for s in reversed(chain) if name in defined.get(s, ())), 0)
            names.append((scope, name))
        resolved.append((op, predicated, names, kind))
    return _flow(resolved, labels)


# Global memory, descriptor and tensormap accesses in PTX: loads, stores and atomics that are
# global or generic, bulk and tensor copies from or to global memory, descriptor acquires and
# prefetches, descriptor copies to global memory
_PTX_GLOBAL = re.compile(
    r"^(?:(?:ld|st|atom|red)(?=\.)(?![\w.]*\.(?:shared|param|local|const)\b)[\w.:]*"
    r"|cp\.async\.bulk\.tensor|cp\.async\.bulk\.(?:[\w:]+\.)?global|cp\.reduce\.async\.bulk"
    r"|cp\.async\.(?:ca|cg)\.shared[\w:]*\.global|prefetch\.|fence\.proxy\.tensormap"
    r"|tensormap\.cp_fenceproxy)"
)


def ptx_is_global(op: str) -> bool:
    return bool(_PTX_GLOBAL.match(op))


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*(.*?)\s*;")
_SASS_LABEL = re.compile(r"^([.$][\w$.]*):\s*$")


def sass_flow(sass_text: str) -> Flow:
    """The control flow of the kernel in nvdisasm's listing (its first .text section, with
    the subroutines that follow it)."""
    instructions, labels, pending = [], {}, []
    for line in sass_text.splitlines():
        label = _SASS_LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
            continue
        m = _SASS_LINE.match(line)
        if not m:
            continue
        for name in pending:
            labels[name] = len(instructions)
        pending = []
        _address, predicate, opcode, operands = m.groups()
        base = opcode.split(".")[0]
        targets = re.findall(r"`\(([^)]*)\)", operands)
        kind = None
        if base in ("BRA", "JMP"):
            # BRA.U UP0, `(...)` and BRA.U !UP1, ... are conditional on a uniform predicate
            kind = "branch"
            predicate = predicate or re.match(r"!?U?P\d", operands)
        elif base == "CALL":
            kind = "call"
        elif base in ("EXIT", "RET", "BPT") and (base != "BPT" or "TRAP" in opcode):
            kind, targets = "end", []
        elif base in ("BRX", "JMX"):
            raise ValueError(f"indirect branch in the SASS: {line.strip()}")
        instructions.append((f"{opcode} {operands}".strip(), bool(predicate), targets, kind))
    return _flow(instructions, labels)


# Global memory, descriptor and tensormap accesses in SASS
_SASS_GLOBAL = {"LDG", "STG", "ATOMG", "REDG", "RED", "LD", "ST", "ATOM", "LDGSTS", "UTMALDG", "UTMASTG",
                "UTMAPF", "UTMACCTL", "UTMAREDG", "UBLKCP", "UBLKRED", "UBLKPF", "SULD", "SUST", "SURED",
                "SUATOM"}


def sass_is_global(op: str) -> bool:
    base = op.split(".")[0].split()[0]
    # CCTL at an address: a descriptor's cached copies invalidated (its acquire); CCTL.IVALL
    # (the cluster barrier's L1 invalidation) touches no address
    return base in _SASS_GLOBAL or (base == "CCTL" and "[" in op)


def grid_dependency(ptx_text: str) -> dict[str, int] | None:
    """Where a kernel's programmatic-dependent-launch instructions sit, read on every path of
    its PTX entry's control flow (ptx_flow): its waits and triggers, how many of the triggers
    come before a wait (reachable without one), its global memory, descriptor and tensormap
    accesses and how many of those are reachable without passing a wait (0: every one waits
    for the kernel before). None for a kernel with neither instruction."""
    flow = ptx_flow(ptx_text)
    waits = [i for i, op in enumerate(flow.ops) if op == "griddepcontrol.wait"]
    triggers = [i for i, op in enumerate(flow.ops) if op == "griddepcontrol.launch_dependents"]
    if not waits and not triggers:
        return None
    accesses = [i for i, op in enumerate(flow.ops) if ptx_is_global(op)]
    before_wait = flow.reach(lambda i: i in set(waits))
    return {"waits": len(waits), "triggers": len(triggers),
            "triggers_before_wait": len(set(triggers) & before_wait),
            "accesses": len(accesses), "accesses_before_wait": len(set(accesses) & before_wait)}


# =============================================================================
# Dynamic shared memory: the launch's, from the compiled host code
# =============================================================================
# The CUDA runtime's cudaLaunchConfig_t as an LLVM struct: dim3 gridDim, dim3 blockDim,
# size_t dynamicSmemBytes (field 2), cudaStream_t stream, cudaLaunchAttribute *attrs,
# unsigned numAttrs.
_LAUNCH_CONFIG_STRUCT = r"!llvm\.struct<\(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32\)>"
_SSA = r"%[\w.$-]+"
_HOST_FUNC_START = re.compile(r"^\s*llvm\.func\s+@", re.MULTILINE)
_CONSTANT = re.compile(rf"^\s*({_SSA}) = llvm\.mlir\.constant\((-?\d+) : i(?:32|64)\)", re.MULTILINE)
_CAST = re.compile(rf"^\s*({_SSA}) = llvm\.(?:sext|zext|trunc|bitcast) ({_SSA}) :", re.MULTILINE)
_SMEM_FIELD = re.compile(
    rf"^\s*({_SSA}) = llvm\.getelementptr (?:inbounds )?{_SSA}\[0, 2\] : .*{_LAUNCH_CONFIG_STRUCT}\s*$",
    re.MULTILINE,
)
_STORE = re.compile(rf"^\s*llvm\.store ({_SSA}), ({_SSA}) :", re.MULTILINE)
_LOAD = re.compile(rf"^\s*({_SSA}) = llvm\.load ({_SSA}) ", re.MULTILINE)
_ADDRESS_OF = re.compile(rf'^\s*({_SSA}) = llvm\.mlir\.addressof @"?([\w$.]+)"?', re.MULTILINE)
_LAUNCH_EX = re.compile(rf"^\s*(?:{_SSA} = )?llvm\.call @_?cudaLaunchKernelEx\(({_SSA}), ({_SSA}), ", re.MULTILINE)
# cudaLaunchKernel(func, gridDim xyz, blockDim xyz, args, sharedMem, stream), scalarized
_LAUNCH = re.compile(
    rf"^\s*(?:{_SSA} = )?llvm\.call @_?cudaLaunchKernel\(({_SSA}),(?: {_SSA},){{7}} ({_SSA}), {_SSA}\)",
    re.MULTILINE,
)


@dataclasses.dataclass
class HostLaunch:
    kernel_symbol: str | None  # the host global that holds the kernel handle
    dynamic_smem_bytes: int | None  # None: not a compile-time constant


def _function_launches(function: str) -> list[HostLaunch]:
    """The launches of one host function (SSA names are unique within a function)."""
    constants = {m.group(1): int(m.group(2)) for m in _CONSTANT.finditer(function)}
    casts = {m.group(1): m.group(2) for m in _CAST.finditer(function)}
    loads = {m.group(1): m.group(2) for m in _LOAD.finditer(function)}
    addresses = {m.group(1): m.group(2) for m in _ADDRESS_OF.finditer(function)}
    smem_fields = {m.group(1) for m in _SMEM_FIELD.finditer(function)}

    def constant(value: str) -> int | None:
        for _ in range(8):  # through integer casts to the constant
            if value in constants:
                return constants[value]
            if value not in casts:
                return None
            value = casts[value]
        return None

    def kernel_symbol(handle: str) -> str | None:
        return addresses.get(loads.get(handle, handle))

    events = [(m.start(), "smem", m) for m in _STORE.finditer(function) if m.group(2) in smem_fields]
    events += [(m.start(), "launch_ex", m) for m in _LAUNCH_EX.finditer(function)]
    events += [(m.start(), "launch", m) for m in _LAUNCH.finditer(function)]
    launches = []
    smem: int | None = None  # the launch config filled last before a cudaLaunchKernelEx
    for _, kind, match in sorted(events, key=lambda event: event[0]):
        if kind == "smem":
            smem = constant(match.group(1))
        elif kind == "launch_ex":
            launches.append(HostLaunch(kernel_symbol(match.group(2)), smem))
        else:
            launches.append(HostLaunch(kernel_symbol(match.group(1)), constant(match.group(2))))
    return launches


def host_launches(host_ir: str) -> list[HostLaunch]:
    """Kernel launches in a compiled module's host code (LLVM dialect), in program order,
    with the dynamic shared memory each passes to the CUDA runtime."""
    starts = [m.start() for m in _HOST_FUNC_START.finditer(host_ir)] + [len(host_ir)]
    launches = []
    for begin, end in itertools.pairwise(starts):
        launches += _function_launches(host_ir[begin:end])
    return launches


def launch_smem_by_kernel(launches: list[HostLaunch], kernels: list[str]) -> dict[str, int | None]:
    """Dynamic shared memory per kernel (cubin function name) from its launches; a kernel
    launched more than once gets the largest. Host symbols end with the kernel's name; with
    one launch and one kernel the two belong together."""
    found: dict[str, int | None] = {}
    for launch in launches:
        matches = [k for k in kernels if launch.kernel_symbol and launch.kernel_symbol.endswith(k)]
        if not matches and len(launches) == 1 and len(kernels) == 1:
            matches = kernels
        for kernel in matches[:1]:
            previous = found.get(kernel, 0)
            found[kernel] = (
                None if launch.dynamic_smem_bytes is None or previous is None
                else max(previous, launch.dynamic_smem_bytes)
            )
    return found


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
    kernel: str | None
    sm_version: int | None
    registers: int | None
    frame_bytes: int | None
    spill_bytes_max: int | None  # 0 proves no spill; otherwise an upper bound
    stack_bytes: int | None
    static_smem_bytes: int | None
    dynamic_smem_bytes: int | None
    smem_bytes: int | None
    smem_limit_bytes: int | None
    compile_s: float
    mma: list[str]
    ptx_target: str | None
    cubin_path: str | None
    ptx_path: str | None
    threads: int | None = None
    tensormap: dict | None = None  # tensormap_fences of its PTX entry
    grid_dependency: dict | None = None  # grid_dependency of its PTX entry (chained calls)
    dynamic_smem_source: str | None = None  # where dynamic_smem_bytes comes from, or why not
    error: str | None = None  # set on a failed build: why; every figure is None then
    # set on a target whose build takes no G: the group count it was built for, this row that
    # build's figures again (the compile returned the same compiled function)
    same_build_as_groups: int | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


def failed_report(kernel_name: str, arch: str, num_groups: int, reason: str, compile_s: float = 0.0) -> KernelReport:
    return KernelReport(
        target=kernel_name, arch=arch, num_groups=num_groups, kernel=None, sm_version=None,
        registers=None, frame_bytes=None, spill_bytes_max=None, stack_bytes=None,
        static_smem_bytes=None, dynamic_smem_bytes=None, smem_bytes=None,
        smem_limit_bytes=MAX_SMEM_PER_BLOCK_OPTIN.get(arch), compile_s=compile_s, mma=[],
        ptx_target=None, cubin_path=None, ptx_path=None, error=reason,
    )


def _exception_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    cause = getattr(exc, "cause", None) or exc.__cause__
    if cause is not None and str(cause) not in text:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text


def build_kernel(kernel_name: str, arch: str, compile_fn, num_groups: int, dump_dir: Path, *,
                 compile_dir: Path | None = None, built: dict | None = None) -> list[KernelReport]:
    """Compile one target for `arch`, keep its cubin/PTX in dump_dir, return one KernelReport
    per kernel in its cubin, or one failed KernelReport saying why it did not build.

    `compile_dir` (default dump_dir): the folder the DSL's options name, where the artifacts
    are written before they move to dump_dir; one per target, so that the options, and with
    them the compile key, are the same for every G. `built` (the caller's, kept across calls):
    the reports of every compiled function so far, by id. A compile that returns one of them
    is that build again (the compile cache of a target whose build takes no G): its reports
    for this G, marked same_build_as_groups, their artifacts where that build left them.

    Runs in this process: dynamic shared memory is known when the compile returns the
    compiled function (``build_all`` arranges that on every machine; here, DSL 4.3.5 on a
    machine without a GPU raises at the load for a target of the architecture it assumes)."""
    compile_dir = dump_dir if compile_dir is None else compile_dir
    for folder in {dump_dir, compile_dir}:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in list(folder.glob("*.cubin")) + list(folder.glob("*.ptx")):
            stale.unlink()
    options = f"--keep-cubin --keep-ptx --dump-dir {compile_dir} --gpu-arch {arch}"
    compiled, error = None, None
    start = time.perf_counter()
    with captured_native_stderr() as native_stderr:
        try:
            compiled = compile_fn(num_groups, options)
        except Exception as exc:  # noqa: BLE001 - judged below by whether the cubin exists
            error = exc
    compile_s = time.perf_counter() - start
    stderr_text = native_stderr[0].strip() if native_stderr else ""

    earlier = built.get(id(compiled)) if built is not None and compiled is not None else None
    if earlier is not None and earlier[0] is compiled and error is None:
        return [dataclasses.replace(report, num_groups=num_groups, compile_s=compile_s,
                                    same_build_as_groups=report.num_groups) for report in earlier[1]]
    if compile_dir != dump_dir:
        for artifact in list(compile_dir.glob("*.cubin")) + list(compile_dir.glob("*.ptx")):
            artifact.rename(dump_dir / artifact.name)
    cubins = sorted(dump_dir.glob("*.cubin"))
    if not cubins:
        reason = "no cubin was produced"
        if error is not None:
            reason += f": {_exception_text(error)}"
        if stderr_text:
            reason += f"\n{stderr_text[-2000:]}"
        return [failed_report(kernel_name, arch, num_groups, reason, compile_s)]
    try:
        cubin = read_cubin(cubins[0].read_bytes())
    except (ValueError, struct.error) as exc:
        return [failed_report(kernel_name, arch, num_groups, f"unreadable cubin {cubins[0].name}: {exc}", compile_s)]
    ptx_paths = sorted(dump_dir.glob("*.ptx"))
    ptx_text = ptx_paths[0].read_bytes().decode(errors="replace") if ptx_paths else ""
    ptx_target, entries = read_ptx(ptx_text)

    # Dynamic shared memory: from the launches in the compiled function's host code
    kernels = list(cubin.functions)
    host_ir = getattr(compiled, "ir_module", None) if compiled is not None else None
    smem_by_kernel: dict[str, int | None] = {}
    if host_ir is not None:
        smem_by_kernel = launch_smem_by_kernel(host_launches(str(host_ir)), kernels)
        source = "launch config in the compiled host code"
    elif error is not None:
        source = f"unavailable: the compile raised after writing the cubin ({_exception_text(error)[:300]})"
    else:
        source = "unavailable: the compiled function has no host code (ir_module)"

    reports = []
    for function in cubin.functions.values():
        entry = entries.get(function.name)
        dynamic = smem_by_kernel.get(function.name)
        row_source = source
        if host_ir is not None and dynamic is None:
            row_source = (
                "unavailable: no launch of this kernel with a constant dynamic shared memory "
                "size in the compiled host code"
            )
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
                mma=mma_instructions(entry.text if entry else ptx_text, arch),
                ptx_target=ptx_target,
                cubin_path=str(cubins[0]),
                ptx_path=str(ptx_paths[0]) if ptx_paths else None,
                threads=entry.threads if entry else None,
                tensormap=tensormap_fences(entry.text if entry else ptx_text),
                grid_dependency=grid_dependency(entry.text if entry else ptx_text),
                dynamic_smem_source=row_source,
            )
        )
    if built is not None and compiled is not None and error is None:
        built[id(compiled)] = (compiled, reports)
    return reports


def _import_backend(module_name: str):
    """The backend module, or None when an optional one (any but submission) is absent."""
    if module_name != "submission" and importlib.util.find_spec(module_name) is None:
        return None
    return importlib.import_module(module_name)


def collect_targets(modules=BACKEND_MODULES):
    """(module name, kernel name, arch, compile_fn) of every backend that exposes the hook."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    targets = []
    for module_name in modules:
        module = _import_backend(module_name)
        hook = getattr(module, "compile_targets", None)
        if hook is None:
            continue
        for kernel_name, arch, compile_fn in hook():
            targets.append((module_name, kernel_name, arch, compile_fn))
    return targets


# ---- the build process --------------------------------------------------------------
def _run_builds(spec: dict) -> None:
    """Body of the build process: builds what `spec` says, one JSON line per result."""
    for path in reversed(spec.get("paths", [])):
        sys.path.insert(0, path)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    dump_root = Path(spec["dump_root"])
    skip = spec["skip"]
    with open(spec["results"], "a", encoding="utf-8") as results:

        def emit(record: dict) -> None:
            results.write(json.dumps(record) + "\n")
            results.flush()

        builds = []
        for module_name in spec["modules"]:
            try:
                module = _import_backend(module_name)
                listed = list(module.compile_targets()) if hasattr(module, "compile_targets") else []
            except Exception as exc:  # noqa: BLE001 - a backend that does not import is a failed row
                if skip == 0:
                    row = failed_report(module_name, "?", 0, f"the backend did not import: {_exception_text(exc)}")
                    emit({"index": None, "reports": [dataclasses.asdict(row)]})
                continue
            for kernel_name, arch, compile_fn in listed:
                for num_groups in spec["groups"]:
                    builds.append((module_name, kernel_name, arch, compile_fn, num_groups))
        emit({"plan": [[m, k, a, g] for m, k, a, _fn, g in builds]})
        built: dict = {}  # build_kernel's: every compiled function of this process, by id
        for index, (module_name, kernel_name, arch, compile_fn, num_groups) in enumerate(builds):
            if index < skip:
                continue
            dump_dir = dump_root / f"{module_name}.{kernel_name}.G{num_groups}"
            try:
                reports = build_kernel(kernel_name, arch, compile_fn, num_groups, dump_dir,
                                       compile_dir=dump_root / f"{module_name}.{kernel_name}", built=built)
            except Exception as exc:  # noqa: BLE001 - reading the artifacts failed: a failed row
                reports = [failed_report(kernel_name, arch, num_groups, _exception_text(exc))]
            emit({"index": index, "reports": [dataclasses.asdict(r) for r in reports]})


def _build_process_env() -> dict:
    env = dict(os.environ)
    env["CUTE_DSL_ARCH"] = HOST_ARCH_FOR_BUILDS
    env["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"
    return env


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _first_line(text: str | None, width: int) -> str:
    """A failure's first line for a one-line progress message: whole when it fits, else cut
    at a word boundary with a marker (the table has it whole)."""
    lines = (text or "").strip().splitlines()
    return _cut_at_word(lines[0] if lines else "", width)


def progress_line(position: int, total: int, reports: list[KernelReport]) -> str:
    """One line per finished build: `build 3 of 16: sm100_gemm G=2 (sm_100a): 4.21 s`, or
    its failure's first line; at most TABLE_WIDTH columns."""
    first = reports[0]
    head = f"build {position} of {total}: {first.target} G={first.num_groups} ({first.arch}): "
    failed = [r for r in reports if r.failed]
    if failed:
        return head + "FAILED: " + _first_line(failed[0].error, max(20, TABLE_WIDTH - len(head) - 8))
    kernels = f", {len(reports)} kernels" if len(reports) > 1 else ""
    if first.same_build_as_groups is not None:
        return _cut_at_word(f"{head}the G={first.same_build_as_groups} build (its build takes no G){kernels}",
                            TABLE_WIDTH)
    return _cut_at_word(f"{head}{first.compile_s:.2f} s{kernels}", TABLE_WIDTH)


def _follow(path: Path, offset: int) -> tuple[list[dict], int]:
    """The complete JSON lines of `path` from byte `offset` on, and the offset after them."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as results:
        results.seek(offset)
        data = results.read()
    complete = data[: data.rfind(b"\n") + 1]
    records = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
    return records, offset + len(complete)


def build_all(num_groups_list, dump_root: Path, modules=BACKEND_MODULES, paths=(),
              progress=None) -> list[KernelReport]:
    """Build every target of `modules` for every group count in a child process; one
    KernelReport per kernel built, or a failed one per target that did not build. `paths`:
    extra import paths for the backends. `progress(line)`, when given, gets one line as each
    build finishes (progress_line), and one when the builds are listed."""
    dump_root = Path(dump_root).resolve()  # the build process runs in the repository root
    dump_root.mkdir(parents=True, exist_ok=True)
    plan: list | None = None
    done: dict[int, list[KernelReport]] = {}
    extra: list[KernelReport] = []
    skip = 0

    def tell(line: str) -> None:
        if progress is not None:
            progress(line)

    def take(record: dict) -> None:
        nonlocal plan
        if "plan" in record:
            if plan is None:
                plan = record["plan"]
                tell(_cut_at_word(f"{len(plan)} build{'s' * (len(plan) != 1)} to run ({', '.join(modules)}; "
                                  f"group counts {', '.join(map(str, num_groups_list))})", TABLE_WIDTH))
        elif record["index"] is None:
            reports = [KernelReport(**r) for r in record["reports"]]
            extra.extend(reports)
            for report in reports:
                head = f"{report.target}: FAILED: "
                tell(head + _first_line(report.error, max(20, TABLE_WIDTH - len(head))))
        else:
            done[record["index"]] = [KernelReport(**r) for r in record["reports"]]
            tell(progress_line(record["index"] + 1, len(plan or ()), done[record["index"]]))

    while True:
        with tempfile.TemporaryDirectory(prefix="nvfp4_build_run_") as run_dir:
            results_path = Path(run_dir) / "results.jsonl"
            log_path = Path(run_dir) / "output.txt"
            spec = {
                "modules": list(modules), "groups": list(num_groups_list), "dump_root": str(dump_root),
                "results": str(results_path), "skip": skip, "paths": [str(Path(p).resolve()) for p in paths],
            }
            offset = 0
            with open(log_path, "w+b") as log:
                process = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--build-process", json.dumps(spec)],
                    cwd=REPO_ROOT, env=_build_process_env(), stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT,
                )
                try:
                    while process.poll() is None:
                        records, offset = _follow(results_path, offset)
                        for record in records:
                            take(record)
                        time.sleep(0.1)
                except BaseException:  # Ctrl-C: the build process goes with this one
                    process.kill()
                    process.wait()
                    raise
                records, offset = _follow(results_path, offset)
                for record in records:
                    take(record)
                log.seek(0)
                output = log.read().decode(errors="replace")
        how = f"exit status {process.returncode}" if process.returncode >= 0 else f"signal {-process.returncode}"
        if plan is None:
            extra.append(failed_report(
                ",".join(modules), "?", 0,
                f"the build process ended ({how}) before listing the targets\n{_tail(output)}",
            ))
            tell(_cut_at_word(f"build: FAILED: the build process ended ({how}) before listing the targets",
                              TABLE_WIDTH))
            break
        pending = [i for i in range(skip, len(plan)) if i not in done]
        if not pending:
            break
        # The process died during build `pending[0]`: that one fails, the rest go on
        _module_name, kernel_name, arch, num_groups = plan[pending[0]]
        done[pending[0]] = [failed_report(
            kernel_name, arch, num_groups, f"the build process died ({how})\n{_tail(output)}"
        )]
        tell(progress_line(pending[0] + 1, len(plan), done[pending[0]]))
        skip = pending[0] + 1
    reports = list(extra)
    for index in sorted(done):
        reports += done[index]
    return reports


def problems(report: KernelReport) -> list[str]:
    """Reasons a kernel is not acceptable (empty when fine)."""
    if report.failed:
        return [f"build failed: {report.error.splitlines()[0] if report.error else ''}"]
    found = []
    if report.registers is None or report.registers > MAX_REGISTERS_PER_THREAD:
        found.append(f"registers {report.registers}")
    if report.spill_bytes_max != 0:
        found.append(f"local frame {report.frame_bytes} B (possible spills)")
    if report.smem_bytes is None:
        found.append(f"shared memory unknown: dynamic shared memory {report.dynamic_smem_source}")
    elif report.smem_limit_bytes is not None and report.smem_bytes > report.smem_limit_bytes:
        found.append(f"shared memory {report.smem_bytes} B > {report.smem_limit_bytes} B")
    return found


# =============================================================================
# Report
# =============================================================================
def _short(name: str, width: int = 28) -> str:
    """A name (target, symbol) cut to `width` with `...`; messages go through _cut_at_word or
    _wrap, which never cut a word."""
    return name if len(name) <= width else name[: width - 3] + "..."


CUT_MARKER = " ..."  # after a whole word: the text goes on (the table has it whole)


def _cut_at_word(text: str, width: int) -> str:
    """`text` whole when it fits in `width`, else cut at the last space that leaves room for
    CUT_MARKER, and the marker appended (a single word longer than the line is cut where it
    must be, still marked)."""
    if len(text) <= width:
        return text
    room = max(width - len(CUT_MARKER), 1)
    cut = text.rfind(" ", 0, room + 1)
    return text[: cut if cut > 0 else room].rstrip() + CUT_MARKER


def _wrap(text: str, width: int, first_indent: int, indent: int) -> list[str]:
    """`text` in lines of at most `width` columns, broken between words, nothing left out:
    the first line has `first_indent` columns before it (the caller's), the others `indent`
    spaces."""
    lines = textwrap.wrap(text, width, initial_indent="\0" * first_indent,
                          subsequent_indent=" " * indent, break_on_hyphens=False) or [""]
    return [lines[0][first_indent:], *lines[1:]]


# The report's rows (table, progress) fit in this many columns
TABLE_WIDTH = 120
TARGET_WIDTH = (24, 40)  # the target column: at least, at most (longer names are cut)


def chaining_line(d: dict) -> str:
    """The `chaining:` line of a kernel with programmatic-dependent-launch instructions
    (global accesses: memory, descriptor and tensormap, as ptx_is_global)."""
    return (f"chaining: {d['waits']} wait, {d['triggers']} launch_dependents ({d['triggers_before_wait']} "
            f"before a wait); {d['accesses_before_wait']} of {d['accesses']} global accesses "
            "reachable without a wait")


def format_table(reports: list[KernelReport]) -> str:
    """One row of figures per kernel, then its `mma:` instructions (wrapped) and its
    `kernel:` symbol (cut to fit); a failed build: its reason's first lines. Every line
    <= TABLE_WIDTH."""
    width = min(max([TARGET_WIDTH[0]] + [len(r.target) for r in reports]), TARGET_WIDTH[1])
    header = (
        f"{'target':<{width}} {'G':>2} {'arch':<8} {'regs':>4} {'spill':>6} {'stack':>5} "
        f"{'smem B':>7} {'(static+dyn)':>14} {'thr':>4} {'compile s':>9}"
    )
    lines = [header, "-" * len(header)]
    indent = " " * 4
    for r in reports:
        target = _short(r.target, width)
        if r.failed:
            reason = r.error.strip().splitlines() if r.error else [""]
            head = f"{target:<{width}} {r.num_groups:>2} {r.arch:<8} FAILED: "
            # the reason whole, wrapped between words (never cut: it is what to fix)
            first, *rest = _wrap(reason[0], TABLE_WIDTH, len(head), len(indent) * 2)
            lines += [head + first, *rest]
            for line in reason[1:6]:
                first, *rest = _wrap(line, TABLE_WIDTH, len(indent), len(indent) * 2)
                lines += [indent + first, *rest]
            continue
        spill = "0" if r.spill_bytes_max == 0 else f"<={r.spill_bytes_max}"
        smem = "?" if r.smem_bytes is None else str(r.smem_bytes)
        dynamic = "?" if r.dynamic_smem_bytes is None else str(r.dynamic_smem_bytes)
        split = f"({r.static_smem_bytes}+{dynamic})"
        threads = "?" if r.threads is None else str(r.threads)
        # a target whose build takes no G: its one build's row again, `=G1` in place of a time
        seconds = f"{r.compile_s:.2f}" if r.same_build_as_groups is None else f"=G{r.same_build_as_groups}"
        lines.append(
            f"{target:<{width}} {r.num_groups:>2} {r.arch:<8} {r.registers!s:>4} {spill:>6} "
            f"{r.stack_bytes!s:>5} {smem:>7} {split:>14} {threads:>4} {seconds:>9}"
        )
        mma = ", ".join(r.mma) if r.mma else "none"
        lines += textwrap.wrap(mma, TABLE_WIDTH, initial_indent=f"{indent}mma: ",
                               subsequent_indent=indent * 2, break_on_hyphens=False)
        if r.tensormap and any(r.tensormap.values()):
            lines.append(f"{indent}descriptors: " + ", ".join(f"{n} {op}" for op, n in r.tensormap.items()))
        if r.grid_dependency:
            lines.append(f"{indent}{chaining_line(r.grid_dependency)}")
        lines.append(f"{indent}kernel: {_short(r.kernel or '', TABLE_WIDTH - len(indent) - 8)}")
    return "\n".join(lines)


class _OneLineArgumentParser(argparse.ArgumentParser):
    """argparse failing as eval.py does: one line on stderr, exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


def _group_counts(text: str) -> list[int]:
    counts = [x.strip() for x in text.split(",") if x.strip()]
    if not counts or not all(x.isdigit() and 1 <= int(x) <= 64 for x in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated group counts in 1..64")
    return [int(x) for x in counts]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--build-process"]:
        _run_builds(json.loads(argv[1]))
        return 0
    parser = _OneLineArgumentParser(
        prog="build_report",
        description="Compile every kernel for its target architecture (no GPU needed) and "
        "print registers, spills, stack, shared memory and compile time from the cubin.",
    )
    parser.add_argument("--groups", type=_group_counts, default="1,2,8",
                        help="group counts to build (default 1,2,8)")
    parser.add_argument("--modules", default=",".join(BACKEND_MODULES),
                        help=f"backend modules (default {','.join(BACKEND_MODULES)})")
    parser.add_argument("--dump-dir", default=None, help="keep cubins/PTX here (default: temp)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    num_groups_list = args.groups
    modules = tuple(m.strip() for m in args.modules.split(",") if m.strip())

    with contextlib.ExitStack() as stack:
        if args.dump_dir:
            dump_root = Path(args.dump_dir)
        else:
            dump_root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nvfp4_build_")))
        print(f"nvidia-cutlass-dsl {dsl_version()}, python {sys.version.split()[0]}", flush=True)
        reports = build_all(num_groups_list, dump_root, modules,
                            progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(format_table(reports))
        failed = [r for r in reports if r.failed]
        bad = [(r, problems(r)) for r in reports if not r.failed and problems(r)]
        for r, found in bad:
            print(f"NOT OK {r.target} G={r.num_groups}: {'; '.join(found)}")
        sources = sorted({r.dynamic_smem_source for r in reports if not r.failed and r.dynamic_smem_source})
        if sources:
            print("dynamic shared memory: " + "; ".join(sources))
        built = len(reports) - len(failed)
        repeated = len({(r.target, r.num_groups) for r in reports if r.same_build_as_groups is not None})
        arches_by_limit: dict[int, list[str]] = {}
        for arch, limit in MAX_SMEM_PER_BLOCK_OPTIN.items():
            arches_by_limit.setdefault(limit, []).append(arch)
        print(
            f"{built} kernel builds, {len(failed)} failed"
            + (f" ({repeated} of them another G's build again: those targets' builds take no G)" if repeated else "")
            + f"; limits: <= {MAX_REGISTERS_PER_THREAD} "
            "registers, 0 spill bytes, shared memory <= "
            + ", ".join(f"{v} B ({', '.join(a)})" for v, a in arches_by_limit.items())
            + ".\nCompiled only: nothing here was run on a GPU."
        )
        if args.json:
            Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in reports], indent=2))
        return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
