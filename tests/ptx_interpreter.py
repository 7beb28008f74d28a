"""A host interpreter of the straight-line PTX the sm_90a helpers emit (integer, prmt, lop3,
fp16/bf16/fp32 conversions, multiplies and adds, shared loads, comparisons into predicates and
guarded instructions), one thread at a time, or a warp in lockstep for butterfly shuffles: the
tests run the very text the kernel's inline assembly holds, on bytes they choose, and compare
the registers it leaves with an independent decode."""

import re

import numpy as np
import torch

MASK32 = 0xFFFFFFFF


def _bits_to_f32(bits: int) -> np.float32:
    return np.array([bits & MASK32], dtype=np.uint32).view(np.float32)[0]


def _f32_to_bits(value) -> int:
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


def _f16_bits_to_float(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def _float_to_f16_bits(value: float) -> int:
    return int(np.array([value], dtype=np.float16).view(np.uint16)[0])


def _bf16_bits_to_float(bits: int) -> float:
    """The value of a bf16 bit pattern (its 16 low bits): the upper half of an fp32."""
    return float(_bits_to_f32((bits & 0xFFFF) << 16))


def _float_to_bf16_bits(value: float) -> int:
    """Round to bf16, to nearest even (value exact in fp32: one rounding)."""
    return int(torch.tensor([value], dtype=torch.float32).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF


# mul.rn of two 16-bit lanes: (lane value, rounding to the lane's bits)
PAIRED_MULTIPLIES = {
    "mul.rn.f16x2": (_f16_bits_to_float, _float_to_f16_bits),
    "mul.rn.bf16x2": (_bf16_bits_to_float, _float_to_bf16_bits),
}


def e4m3_to_float(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float()[0])


def _prmt(a: int, b: int, selector: int) -> int:
    source = (a & MASK32) | ((b & MASK32) << 32)
    result = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (source >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        result |= byte << (8 * i)
    return result


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    result = 0
    for bit in range(32):
        index = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        result |= ((lut >> index) & 1) << bit
    return result


class Thread:
    """One thread's registers; `shared` maps byte addresses to bytes (reads of unset bytes fail)."""

    def __init__(self, operands: dict[int, int], shared: dict[int, int]):
        self.registers: dict[str, int] = {f"${i}": v for i, v in operands.items()}
        self.shared = shared

    def value(self, token: str) -> int:
        token = token.strip()
        if token in self.registers:
            return self.registers[token]
        if token.startswith("0f"):
            return int("0x" + token[2:], 0)  # PTX 0fXXXXXXXX: an fp32 bit pattern
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", token):
            return int(token, 0) & MASK32
        raise KeyError(f"register {token} read before it is written")

    def address(self, token: str) -> int:
        inside = token.strip()[1:-1]
        parts = [p.strip() for p in inside.split("+")]
        return sum(self.value(p) for p in parts)

    def load(self, address: int, size: int) -> int:
        return int.from_bytes(bytes(self.shared[address + i] for i in range(size)), "little")

    def run(self, text: str) -> None:
        for line in instructions(text):
            self.step(line)

    def step(self, line: str) -> None:
        """One instruction, its guard (@p, @!p) read first."""
        if line.startswith("@"):
            guard, _, line = line.partition(" ")
            negated = guard.startswith("@!")
            if bool(self.registers[guard.lstrip("@!")]) == negated:
                return
        opcode, _, rest = line.partition(" ")
        self.execute(opcode, rest.strip())

    def execute(self, opcode: str, rest: str) -> None:
        regs = self.registers
        if opcode.startswith("setp."):
            self.set_predicate(opcode, [a.strip() for a in rest.split(",")])
            return
        if opcode == "or.pred":
            d, a, b = (x.strip() for x in rest.split(","))
            regs[d] = int(bool(regs[a]) or bool(regs[b]))
            return
        if opcode.startswith("ld.shared"):
            destination, _, source = rest.partition(", [")
            address = self.address("[" + source)
            if destination.startswith("{"):
                names = [n.strip() for n in destination.strip("{} ").split(",")]
                for i, name in enumerate(names):
                    regs[name] = self.load(address + 4 * i, 4)
            else:
                size = {"u32": 4, "u16": 2, "u8": 1}[opcode.split(".")[-1]]
                regs[destination.strip()] = self.load(address, size)
            return
        if opcode == "mov.b32" and rest.startswith("{"):  # unpack 32 -> two 16
            names, _, source = rest.partition("},")
            low, high = [n.strip() for n in names.strip("{ ").split(",")]
            value = self.value(source)
            regs[low], regs[high] = value & 0xFFFF, value >> 16
            return
        if opcode == "mov.b32" and "{" in rest:  # pack two 16 -> 32: d, {low, high}
            d, _, names = rest.partition(",")
            low, high = [self.value(n.strip()) & 0xFFFF for n in names.strip(" {}").split(",")]
            regs[d.strip()] = low | (high << 16)
            return
        args = [a.strip() for a in rest.split(",")]
        d, sources = args[0], args[1:]
        v = [self.value(s) for s in sources]
        if opcode in ("mov.b32", "mov.f32"):
            regs[d] = v[0]
        elif opcode == "abs.f32":
            regs[d] = v[0] & 0x7FFFFFFF
        elif opcode in ("max.f32", "min.f32"):  # a NaN operand gives the other one (PTX's rule)
            a, b = float(_bits_to_f32(v[0])), float(_bits_to_f32(v[1]))
            if np.isnan(a) or np.isnan(b):
                regs[d] = v[1] if np.isnan(a) else v[0]
            else:
                regs[d] = _f32_to_bits(np.float32(max(a, b) if opcode == "max.f32" else min(a, b)))
        elif opcode == "div.rn.f32":
            with np.errstate(divide="ignore", invalid="ignore"):
                regs[d] = _f32_to_bits(np.float32(_bits_to_f32(v[0])) / np.float32(_bits_to_f32(v[1])))
        elif opcode == "add.u32":
            regs[d] = (v[0] + v[1]) & MASK32
        elif opcode in ("selp.b32", "selp.f32"):  # d = p ? a : b
            regs[d] = v[0] if regs[sources[2]] else v[1]
        elif opcode == "cvt.rn.satfinite.e4m3x2.f32":  # d (16 bits) = {e4m3(a) high, e4m3(b) low}
            high, low = (int(torch.tensor([float(_bits_to_f32(x))]).clamp(-448, 448).to(torch.float8_e4m3fn)
                             .view(torch.uint8)[0]) for x in v[:2])
            regs[d] = (high << 8) | low
        elif opcode == "cvt.u32.u16":
            regs[d] = v[0] & 0xFFFF
        elif opcode == "or.b32":
            regs[d] = v[0] | v[1]
        elif opcode == "shr.u32":
            regs[d] = (v[0] & MASK32) >> v[1]
        elif opcode == "and.b32":
            regs[d] = v[0] & v[1]
        elif opcode == "shr.b32":
            regs[d] = (v[0] & MASK32) >> v[1]
        elif opcode == "shl.b32":
            regs[d] = (v[0] << v[1]) & MASK32
        elif opcode == "mul.lo.u32":
            regs[d] = (v[0] * v[1]) & MASK32
        elif opcode == "prmt.b32":
            regs[d] = _prmt(v[0], v[1], v[2])
        elif opcode == "lop3.b32":
            regs[d] = _lop3(v[0], v[1], v[2], v[3])
        elif opcode == "cvt.rn.f16x2.e4m3x2":  # byte 0 -> low half, byte 1 -> high half
            low, high = (_float_to_f16_bits(e4m3_to_float((v[0] >> (8 * i)) & 0xFF)) for i in range(2))
            regs[d] = low | (high << 16)
        elif opcode == "cvt.f32.f16":
            regs[d] = _f32_to_bits(np.float32(_f16_bits_to_float(v[0])))
        elif opcode == "mul.rn.f32":
            regs[d] = _f32_to_bits(np.float32(_bits_to_f32(v[0]) * _bits_to_f32(v[1])))
        elif opcode == "add.rn.f32":
            regs[d] = _f32_to_bits(np.float32(_bits_to_f32(v[0]) + _bits_to_f32(v[1])))
        elif opcode == "cvt.rn.bf16x2.f32":  # d = {cvt(a) high, cvt(b) low}
            high, low = (_float_to_bf16_bits(float(_bits_to_f32(x))) for x in v[:2])
            regs[d] = low | (high << 16)
        elif opcode in PAIRED_MULTIPLIES:  # per 16-bit lane: the exact product, rounded once
            value_of, bits_of = PAIRED_MULTIPLIES[opcode]
            low, high = (bits_of(value_of(v[0] >> shift) * value_of(v[1] >> shift)) for shift in (0, 16))
            regs[d] = low | (high << 16)
        else:
            raise NotImplementedError(f"PTX opcode {opcode} ({rest})")


    def set_predicate(self, opcode: str, args: list[str]) -> None:
        """setp.<cmp>[.and].<type> p, a, b[, c]: p = (a cmp b) [and c]."""
        parts = opcode.split(".")
        compare, kind = parts[1], parts[-1]
        a, b = (self.value(x) for x in args[1:3])
        if kind == "f32":
            a, b = float(_bits_to_f32(a)), float(_bits_to_f32(b))
        elif kind.startswith("s"):
            a, b = (x - (1 << 32) if x >> 31 else x for x in (a & MASK32, b & MASK32))
        result = {"eq": a == b, "ne": a != b, "gt": a > b, "lt": a < b, "ge": a >= b, "le": a <= b}[compare]
        if len(parts) == 4:  # a boolean operation with a third predicate
            other = bool(self.registers[args[3]])
            result = {"and": result and other, "or": result or other}[parts[2]]
        self.registers[args[0]] = int(result)


def instructions(text: str) -> list[str]:
    """The instructions of an inline-asm text, one per item (braces and .reg lines left out)."""
    lines = []
    for raw in text.split("\n"):
        line = raw.strip().rstrip(";").strip()
        if line and line not in "{}" and not line.startswith(".reg"):
            lines.append(line)
    return lines


class Warp:
    """32 Threads run in lockstep, instruction by instruction, over one shared memory (`shared`,
    as Thread's): shfl.sync.bfly.b32 and shfl.sync.idx.b32 (full member mask; idx with its c
    operand's segment mask and clamp, PTX's rule) read every lane's source register before any
    lane writes."""

    def __init__(self, operands_by_lane: list[dict[int, int]], shared: dict[int, int] | None = None):
        shared = {} if shared is None else shared
        self.threads = [Thread(operands, shared) for operands in operands_by_lane]

    def run(self, text: str) -> None:
        for line in instructions(text):
            opcode, _, rest = line.partition(" ")
            if opcode in ("shfl.sync.bfly.b32", "shfl.sync.idx.b32"):
                d, a, b, c, mask = (x.strip() for x in rest.split(","))
                assert self.threads[0].value(mask) == MASK32, "a full member mask only"
                sources = [t.value(a) for t in self.threads]
                for lane, thread in enumerate(self.threads):
                    if opcode == "shfl.sync.bfly.b32":
                        thread.registers[d] = sources[lane ^ thread.value(b)]
                        continue
                    # PTX's shfl idx: the segment's lanes by c's mask, the source clamped within it
                    c_value = thread.value(c)
                    segment_mask, clamp = (c_value >> 8) & 0x1F, c_value & 0x1F
                    min_lane = lane & segment_mask
                    max_lane = min_lane | (clamp & ~segment_mask & 0x1F)
                    source = min_lane | (thread.value(b) & ~segment_mask & 0x1F)
                    thread.registers[d] = sources[source if source <= max_lane else lane]
            else:
                for thread in self.threads:
                    thread.step(line)


def bf16_lanes(register: int) -> tuple[float, float]:
    """The two bf16 values of a 32-bit register (low half first)."""
    return _bf16_bits_to_float(register), _bf16_bits_to_float(register >> 16)
