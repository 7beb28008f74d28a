"""Device helpers of the sm_90a kernel as inline PTX (cp.async, bulk copies and mbarriers,
DSMEM and global stores and loads, fences, atomics) and the exact e2m1 x e4m3 decode to fp16, with the K permutation it
applies to both operands."""

from __future__ import annotations

import cutlass
from cutlass import cute
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import dsl_user_op

from nvfp4_group_gemm import core, e2m1


def _inline_asm(result_type, operands, asm: str, constraints: str, *, loc=None, ip=None):
    """llvm.inline_asm as every helper here uses it: side effects kept, AT&T dialect."""
    return llvm.inline_asm(
        result_type,
        operands,
        asm,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def cp_async_16B(dst_smem: cutlass.Int32, src_gmem: cutlass.Int64, src_bytes: cutlass.Int32, *, loc=None, ip=None):
    """16-byte cp.async (L2 only); src_bytes == 0 zero-fills without reading global memory."""
    _inline_asm(
        None,
        [
            cutlass.Int32(dst_smem).ir_value(loc=loc, ip=ip),
            cutlass.Int64(src_gmem).ir_value(loc=loc, ip=ip),
            cutlass.Int32(src_bytes).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;",
        "r,l,r",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def mbarrier_init_shared(mbar_smem: cutlass.Int32, count: int, *, loc=None, ip=None):
    """mbarrier.init of the 8-byte barrier at shared address `mbar_smem` for `count` arrivals."""
    _inline_asm(
        None,
        [cutlass.Int32(mbar_smem).ir_value(loc=loc, ip=ip)],
        f"mbarrier.init.shared::cta.b64 [$0], {count};",
        "r,~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def fence_mbarrier_init(*, loc=None, ip=None):
    """fence.mbarrier_init: this thread's mbarrier.init become visible to the async proxy
    (the bulk copies that complete transactions on them); a CTA barrier follows."""
    _inline_asm(None, [], "fence.mbarrier_init.release.cluster;", "~{memory}", loc=loc, ip=ip)


@dsl_user_op
def bulk_copies_to_shared(pieces, num_bytes: int, mbar_smem: cutlass.Int32, *, loc=None, ip=None):
    """One thread: arrive on the mbarrier expecting the bytes of every piece, then copy each
    ((shared destination, global source) pairs, `num_bytes` each, a multiple of 16, addresses
    16-byte aligned) from global to shared by the bulk-copy engine, which completes them on
    that mbarrier."""
    operands = [cutlass.Int32(mbar_smem).ir_value(loc=loc, ip=ip)]
    lines = [f"mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], {num_bytes * len(pieces)};"]
    for i, (dst_smem, src_gmem) in enumerate(pieces):
        operands += [cutlass.Int32(dst_smem).ir_value(loc=loc, ip=ip), cutlass.Int64(src_gmem).ir_value(loc=loc, ip=ip)]
        lines.append(
            f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [${2 * i + 1}], [${2 * i + 2}], "
            f"{num_bytes}, [$0];"
        )
    _inline_asm(
        None,
        operands,
        "\n\t".join(lines),
        ",".join(["r"] + ["r", "l"] * len(pieces)) + ",~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def mbarrier_wait_parity(mbar_smem: cutlass.Int32, parity: cutlass.Int32, *, loc=None, ip=None):
    """Wait until the phase of parity `parity` of the mbarrier at `mbar_smem` has completed
    (its writes then visible to this thread and to its wgmma)."""
    _inline_asm(
        None,
        [cutlass.Int32(mbar_smem).ir_value(loc=loc, ip=ip), cutlass.Int32(parity).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .pred done;\n\tWAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;\n\t"
        "@!done bra WAIT;\n\t}",
        "r,r,~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def store_f32x4_to_rank(local_smem: cutlass.Int32, values, rank: cutlass.Int32, *, loc=None, ip=None):
    """Store 4 fp32 at shared address `local_smem` of CTA `rank` of this cluster (DSMEM):
    mapa translates this CTA's shared address into that CTA's window."""
    _inline_asm(
        None,
        [cutlass.Int32(local_smem).ir_value(loc=loc, ip=ip)]
        + [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in values]
        + [cutlass.Int32(rank).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 remote;\n\tmapa.shared::cluster.u32 remote, $0, $5;\n\t"
        "st.shared::cluster.v4.f32 [remote], {$1, $2, $3, $4};\n\t}",
        "r,f,f,f,f,r,~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def store_f16x2(address: cutlass.Int64, low: cutlass.Float32, high: cutlass.Float32, *, loc=None, ip=None):
    """Round two fp32 to fp16 and store them as one 32-bit word at global `address`
    (low at the lower address)."""
    _inline_asm(
        None,
        [
            cutlass.Int64(address).ir_value(loc=loc, ip=ip),
            cutlass.Float32(low).ir_value(loc=loc, ip=ip),
            cutlass.Float32(high).ir_value(loc=loc, ip=ip),
        ],
        "{\n\t.reg .b32 packed;\n\tcvt.rn.f16x2.f32 packed, $2, $1;\n\tst.global.b32 [$0], packed;\n\t}",
        "l,f,f,~{memory}",
        loc=loc,
        ip=ip,
    )


def _load_f32x4(instruction: str, address, address_constraint: str, loc, ip):
    """4 fp32 from one 16-byte load `instruction` (ld.shared / ld.global form) at `address`."""
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Float32.mlir_type] * 4),
        [address.ir_value(loc=loc, ip=ip)],
        f"{instruction} {{$0, $1, $2, $3}}, [$4];",
        f"=f,=f,=f,=f,{address_constraint},~{{memory}}",
        loc=loc,
        ip=ip,
    )
    return [
        cutlass.Float32(llvm.extractvalue(cutlass.Float32.mlir_type, result, [i], loc=loc, ip=ip))
        for i in range(4)
    ]


def _store(instruction: str, address, address_constraint: str, values, value_type, value_constraint: str, loc, ip):
    """One `instruction` (st.<space>[.v2 / .v4].<type>) of `values` (one, or a vector) at
    `address`: every store helper below."""
    targets = "$1" if len(values) == 1 else "{" + ", ".join(f"${i + 1}" for i in range(len(values))) + "}"
    _inline_asm(
        None,
        [address.ir_value(loc=loc, ip=ip)] + [value_type(v).ir_value(loc=loc, ip=ip) for v in values],
        f"{instruction} [$0], {targets};",
        ",".join([address_constraint] + [value_constraint] * len(values)) + ",~{memory}",
        loc=loc,
        ip=ip,
    )


def _atomic_add_u32(space: str, address, address_constraint: str, value, loc, ip) -> cutlass.Int32:
    """atom.<space>.add.u32 (relaxed): adds `value` at `address`, returns the previous value."""
    result = _inline_asm(
        cutlass.Int32.mlir_type,
        [address.ir_value(loc=loc, ip=ip), cutlass.Int32(value).ir_value(loc=loc, ip=ip)],
        f"atom.{space}.add.u32 $0, [$1], $2;",
        f"=r,{address_constraint},r,~{{memory}}",
        loc=loc,
        ip=ip,
    )
    return cutlass.Int32(result)


@dsl_user_op
def load_f32x4(smem: cutlass.Int32, *, loc=None, ip=None):
    """4 fp32 from shared address `smem` (one 16-byte load)."""
    return _load_f32x4("ld.shared.v4.f32", cutlass.Int32(smem), "r", loc, ip)


@dsl_user_op
def store_f32x4_global(address: cutlass.Int64, values, *, loc=None, ip=None):
    """Store 4 fp32 at global `address` (one 16-byte store)."""
    _store("st.global.v4.f32", cutlass.Int64(address), "l", values, cutlass.Float32, "f", loc, ip)


@dsl_user_op
def load_f32x4_global_l2(address: cutlass.Int64, *, loc=None, ip=None):
    """4 fp32 from global `address`, read at L2 (.cg: never a stale line of this SM's L1)."""
    return _load_f32x4("ld.global.cg.v4.f32", cutlass.Int64(address), "l", loc, ip)


@dsl_user_op
def opaque_i64(value: cutlass.Int64, *, loc=None, ip=None) -> cutlass.Int64:
    """`value`, through an asm statement the compiler cannot move: keeps an address computed
    from it where it is used (hoisted out of a loop, it would hold registers throughout)."""
    result = _inline_asm(
        cutlass.Int64.mlir_type,
        [cutlass.Int64(value).ir_value(loc=loc, ip=ip)],
        "mov.b64 $0, $1;",
        "=l,l",
        loc=loc,
        ip=ip,
    )
    return cutlass.Int64(result)


# the core's (the same fence of the sm_100a epilogue; its DSL-release switch kept once)
fence_proxy_async_shared_cta = core.fence_proxy_async_shared_cta


@dsl_user_op
def fence_acq_rel_gpu(*, loc=None, ip=None):
    """fence.acq_rel.gpu: orders this thread's global accesses before / after it, GPU-wide."""
    _inline_asm(None, [], "fence.acq_rel.gpu;", "~{memory}", loc=loc, ip=ip)


@dsl_user_op
def atomic_add_u32(address: cutlass.Int64, value: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Int32:
    """atom.global.add.u32 (relaxed, GPU scope): adds `value`, returns the previous value."""
    return _atomic_add_u32("global", cutlass.Int64(address), "l", value, loc, ip)


@dsl_user_op
def store_u32_global(address: cutlass.Int64, value: cutlass.Int32, *, loc=None, ip=None):
    _store("st.global.u32", cutlass.Int64(address), "l", [value], cutlass.Int32, "r", loc, ip)


@dsl_user_op
def store_u32_shared(smem: cutlass.Int32, value: cutlass.Int32, *, loc=None, ip=None):
    _store("st.shared.u32", cutlass.Int32(smem), "r", [value], cutlass.Int32, "r", loc, ip)


@dsl_user_op
def load_u32_shared(smem: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Int32:
    result = _inline_asm(
        cutlass.Int32.mlir_type,
        [cutlass.Int32(smem).ir_value(loc=loc, ip=ip)],
        "ld.shared.u32 $0, [$1];",
        "=r,r,~{memory}",
        loc=loc,
        ip=ip,
    )
    return cutlass.Int32(result)


# Decode of packed e2m1 into fp16 (v * 2^-14, exact), two elements per 32-bit register.
#
# A packed 32-bit word holds 8 codes: byte p has element 2p in its low nibble ("even") and
# element 2p+1 in its high nibble ("odd"). The fp16 bit pattern of v * 2^-14 is the code's
# sign at bit 15 and its 3 magnitude bits (e1 e0 m) at bits 11..9, every other bit zero
# (code 0.5 lands on the subnormal 2^-15, handled exactly by fp16 multiplies and by wgmma).
# With x = w & 0x0F0F0F0F (even codes) and o = w & 0xF0F0F0F0 (odd codes), each register
# takes two codes two bytes apart, shifted so that the sign lands on bit 15 and the
# magnitude on bits 11..9 of its 16-bit lane, and keeps only those bits:
#
#     register  lanes (elements)   = (a | b) & 0x8E008E00 with
#     e02       (0, 4)               a = x << 12, b = x << 9
#     e13       (2, 6)               a = x << 4,  b = x << 1
#     o02       (1, 5)               a = o << 8,  b = o << 5
#     o13       (3, 7)               a = o,       b = o >> 3
#
# (a and b never both have a bit at a kept position, and no other code reaches one). That
# is 7 integer-pipe instructions per 8 codes (2 masks, 1 right shift, 4 lop3; ptxas may put
# the left shifts on the multiply pipe) where placing each pair with prmt + shift + lop3 took
# 15: the decode's integer work bounds the kernel (EXPERIMENTS E54). Multiplying a register
# by its block's scale s (fp16x2) gives v * s * 2^-14, exact (>= 2^-24, the smallest fp16
# subnormal; wgmma takes fp16 subnormals exactly: the random tests with subnormal scales pass
# on the H200); the epilogue scales by 2^28 (both operands).
# Two multiplies (by 2^14, then by s: v * s, no rescale): slower (EXPERIMENTS E34).
#
# K permutation. A dot product is invariant under one permutation of K applied to both
# operands. Within each 16-element scale block (one k16 wgmma step, so that every product of
# a step keeps one scale pair: wgmma's fp32 accumulation of a step that mixes scale blocks
# loses low bits of small terms) element e takes logical column LOGICAL_COLUMN[e]:
#   * B in shared memory (swizzled K-major fp16 rows): block s fills chunk 2s with the e02,
#     e13 registers of its two words and chunk 2s+1 with their o02, o13 (CHUNK_REGISTERS);
#   * A in registers: wgmma's fragment gives lane (g, t) of a warp, per k16 step, registers
#     (row g, cols 2t, 2t+1), (g+8, 2t, 2t+1), (g, 2t+8, 2t+9), (g+8, 2t+8, 2t+9). The lane
#     builds one word per block from bytes p and p+2 (p = t % 2) of the 4-byte half t // 2 of
#     rows g and g+8, [g.p, g8.p, g.p+2, g8.p+2] (one prmt, a_word_selector): its e02 / o02
#     registers are row g's, e13 / o13 row g+8's, in the columns LOGICAL_COLUMN gives.
REGISTER_ELEMENTS = {"e02": (0, 4), "e13": (2, 6), "o02": (1, 5), "o13": (3, 7)}  # per lane
CHUNK_REGISTERS = (("e02", "e13"), ("o02", "o13"))  # chunk 2s, 2s+1: word 0's, then word 1's
FRAGMENT_REGISTERS = ("e02", "e13", "o02", "o13")  # register-A fragment order of a k16 step


def _chunk_logical_columns() -> tuple[int, ...]:
    """LOGICAL_COLUMN[e] for the 16 elements of a scale block, from the chunk layout."""
    column = {}
    for chunk, registers in enumerate(CHUNK_REGISTERS):
        for word in range(2):
            for slot, register in enumerate(registers):
                for lane, element in enumerate(REGISTER_ELEMENTS[register]):
                    column[8 * word + element] = 8 * chunk + 4 * word + 2 * slot + lane
    return tuple(column[e] for e in range(16))


LOGICAL_COLUMN = _chunk_logical_columns()


def a_word_selector(t: int) -> int:
    """prmt selector building lane t's word [g.p, g8.p, g.p+2, g8.p+2] (p = t % 2) from the
    4-byte halves of rows g (bytes 0-3) and g+8 (bytes 4-7)."""
    p = t % 2
    return ((6 + p) << 12) | ((2 + p) << 8) | ((4 + p) << 4) | p


def _place_word_ptx(word: str, destinations: dict) -> list[str]:
    """PTX placing the 8 codes of `word` into destinations["e02"] .. ["o13"] (v * 2^-14, see
    above); scratch registers x, o, a, b; the kept-bit mask in `lanes`."""
    return [
        f"and.b32 x, {word}, 0x0F0F0F0F;",
        f"and.b32 o, {word}, 0xF0F0F0F0;",
        "mul.lo.u32 a, x, 4096;",
        "mul.lo.u32 b, x, 512;",
        f"lop3.b32 {destinations['e02']}, a, b, lanes, 0xA8;",
        "mul.lo.u32 a, x, 16;",
        "mul.lo.u32 b, x, 2;",
        f"lop3.b32 {destinations['e13']}, a, b, lanes, 0xA8;",
        "mul.lo.u32 a, o, 256;",
        "mul.lo.u32 b, o, 32;",
        f"lop3.b32 {destinations['o02']}, a, b, lanes, 0xA8;",
        "shr.b32 b, o, 3;",
        f"lop3.b32 {destinations['o13']}, o, b, lanes, 0xA8;",
    ]


def _decode_blocks_asm(num_units: int, mode: str = "chunks", space: str = "shared") -> str:
    """PTX decoding `num_units` units. All loads are issued first and all stores last, so
    the units' integer work interleaves instead of waiting on each load.

    mode "chunks" (unit = one scale block of one row, into memory of `space`, "shared" or
    "global"): operands per unit u: $(4u) packed source (8 bytes), $(4u+1) scale byte,
    $(4u+2) / $(4u+3) the 16-byte destination chunks (CHUNK_REGISTERS).
    mode "registers" (unit = rows g and g+8 of a 64-wide k-tile, register-A mode): outputs
    $(16u + 4s + i) = FRAGMENT_REGISTERS[i] of k16 step s; inputs after the 16 * num_units
    outputs, per unit: row g packed + 4 (t // 2), row g+8 packed + 4 (t // 2), the
    a_word_selector, row g's 4 scale bytes, row g+8's (aligned).
    """
    registers = mode == "registers"
    first_input = 16 * num_units if registers else 0
    per_unit = 5 if registers else 4
    lines = [
        "{",
        ".reg .b32 x, o, a, b, lanes, sc;",
        ".reg .b16 slo, shi, plo, phi;",
        "mov.b32 lanes, 0x8E008E00;",
    ]
    for u in range(num_units):
        if registers:
            lines.append(f".reg .b32 g{u}_<4>, h{u}_<4>, w{u}, sg{u}, sh{u}, S{u}_<8>, P{u};")
            lines += [f".reg .b32 r{u}_{s}_<4>;" for s in range(4)]
        else:
            lines.append(f".reg .b32 w{u}_<2>, s{u}, S{u}, r{u}_0_<4>, r{u}_1_<4>;")
    for u in range(num_units):  # loads
        src = first_input + per_unit * u
        if registers:
            for s in range(4):
                lines.append(f"ld.shared.u32 g{u}_{s}, [${src} + {8 * s}];")
                lines.append(f"ld.shared.u32 h{u}_{s}, [${src + 1} + {8 * s}];")
            lines.append(f"ld.shared.u32 sg{u}, [${src + 3}];")
            lines.append(f"ld.shared.u32 sh{u}, [${src + 4}];")
        else:
            load = "ld.global.nc" if space == "global" else "ld.shared"
            lines.append(f"{load}.v2.b32 {{w{u}_0, w{u}_1}}, [${src}];")
            lines.append(f"{load}.u8 s{u}, [${src + 1}];")
    for u in range(num_units):  # scales: fp16x2 (s, s) per row and block
        if registers:
            for row, scales in enumerate((f"sg{u}", f"sh{u}")):
                lines.append("mov.b32 {slo, shi}, " + f"{scales};")
                for half, source in enumerate(("slo", "shi")):
                    # blocks 2 half and + 1 as one f16x2 (s, s'); each block's (s, s) read from
                    # its lane (the multiply's operand halves: no instruction of its own)
                    lines += [
                        f"cvt.rn.f16x2.e4m3x2 P{u}, {source};",
                        "mov.b32 {plo, phi}, " + f"P{u};",
                        f"mov.b32 S{u}_{4 * row + 2 * half}, {{plo, plo}};",
                        f"mov.b32 S{u}_{4 * row + 2 * half + 1}, {{phi, phi}};",
                    ]
        else:
            lines += [f"mul.lo.u32 sc, s{u}, 257;", "mov.b32 {slo, shi}, sc;", f"cvt.rn.f16x2.e4m3x2 S{u}, slo;"]
    for u in range(num_units):  # bit placement and scaling
        if registers:
            for s in range(4):
                lines.append(f"prmt.b32 w{u}, g{u}_{s}, h{u}_{s}, ${first_input + per_unit * u + 2};")
                destinations = {name: f"r{u}_{s}_{i}" for i, name in enumerate(FRAGMENT_REGISTERS)}
                lines += _place_word_ptx(f"w{u}", destinations)
                for name, reg in destinations.items():
                    row = 0 if name in ("e02", "o02") else 1  # word bytes 0, 2: row g; 1, 3: g+8
                    lines.append(f"mul.rn.f16x2 {reg}, {reg}, S{u}_{4 * row + s};")
        else:
            for word in range(2):
                destinations = {
                    name: f"r{u}_{chunk}_{2 * word + slot}"
                    for chunk, names in enumerate(CHUNK_REGISTERS)
                    for slot, name in enumerate(names)
                }
                lines += _place_word_ptx(f"w{u}_{word}", destinations)
                for reg in destinations.values():
                    lines.append(f"mul.rn.f16x2 {reg}, {reg}, S{u};")
    for u in range(num_units):  # stores / outputs
        if registers:
            lines += [f"mov.b32 ${16 * u + 4 * s + i}, r{u}_{s}_{i};" for s in range(4) for i in range(4)]
        else:
            for chunk in range(2):
                regs = ", ".join(f"r{u}_{chunk}_{i}" for i in range(4))
                lines.append(f"st.{space}.v4.b32 [${4 * u + 2 + chunk}], {{{regs}}};")
    lines.append("}")
    return "\n\t".join(lines)


@dsl_user_op
def decode_scale_blocks(addresses, *, loc=None, ip=None):
    """Decode scale blocks into shared memory; `addresses` lists (packed, scale, dst_lo,
    dst_hi) smem addresses per block: 16 packed e2m1 values times their e4m3 scale -> two
    16-byte fp16 chunks in the K permutation (CHUNK_REGISTERS)."""
    operands = [cutlass.Int32(x).ir_value(loc=loc, ip=ip) for block in addresses for x in block]
    _inline_asm(
        None,
        operands,
        _decode_blocks_asm(len(addresses), "chunks"),
        ",".join(["r"] * len(operands)) + ",~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def decode_scale_blocks_global(addresses, *, loc=None, ip=None):
    """decode_scale_blocks from and to global memory; `addresses` lists (packed, scale,
    dst_lo, dst_hi) global addresses per block (the packed bytes and scales read through
    the non-coherent path: the kernel never writes them)."""
    operands = [cutlass.Int64(x).ir_value(loc=loc, ip=ip) for block in addresses for x in block]
    _inline_asm(
        None,
        operands,
        _decode_blocks_asm(len(addresses), "chunks", space="global"),
        ",".join(["l"] * len(operands)) + ",~{memory}",
        loc=loc,
        ip=ip,
    )


def _pack_16x2(cvt: str, low, high, loc, ip) -> cutlass.Int32:
    """Two fp32 rounded to a 16-bit type by `cvt` (to nearest even; past the type's range +-inf,
    as a plain cast), packed: `low` in bits 0-15 (the lower address), `high` above."""
    result = _inline_asm(
        cutlass.Int32.mlir_type,
        [cutlass.Float32(high).ir_value(loc=loc, ip=ip), cutlass.Float32(low).ir_value(loc=loc, ip=ip)],
        f"{cvt} $0, $1, $2;",
        "=r,f,f",
        loc=loc,
        ip=ip,
    )
    return cutlass.Int32(result)


@dsl_user_op
def pack_f16x2(low: cutlass.Float32, high: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Int32:
    """Two fp32 rounded to fp16, packed: `low` in bits 0-15 (the lower address), `high` above."""
    return _pack_16x2("cvt.rn.f16x2.f32", low, high, loc, ip)


@dsl_user_op
def pack_bf16x2(low: cutlass.Float32, high: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Int32:
    """Two fp32 rounded to bf16, packed as pack_f16x2."""
    return _pack_16x2("cvt.rn.bf16x2.f32", low, high, loc, ip)


def pack_16x2(low, high, out_dtype: str):
    """pack_f16x2 or pack_bf16x2 by the output's dtype ("float16" or "bfloat16")."""
    return pack_bf16x2(low, high) if out_dtype == "bfloat16" else pack_f16x2(low, high)


@dsl_user_op
def load_f32_global(address: cutlass.Int64, *, loc=None, ip=None) -> cutlass.Float32:
    """One fp32 from global `address`."""
    result = _inline_asm(
        cutlass.Float32.mlir_type,
        [cutlass.Int64(address).ir_value(loc=loc, ip=ip)],
        "ld.global.f32 $0, [$1];",
        "=f,l",
        loc=loc,
        ip=ip,
    )
    return cutlass.Float32(result)


@dsl_user_op
def load_i64_global(address: cutlass.Int64, *, loc=None, ip=None) -> cutlass.Int64:
    """One int64 from global `address` (a row index of the MoE entry's a_rows / c_rows)."""
    result = _inline_asm(
        cutlass.Int64.mlir_type,
        [cutlass.Int64(address).ir_value(loc=loc, ip=ip)],
        "ld.global.s64 $0, [$1];",
        "=l,l",
        loc=loc,
        ip=ip,
    )
    return cutlass.Int64(result)


@dsl_user_op
def stmatrix_x4_trans(smem: cutlass.Int32, registers, *, loc=None, ip=None):
    """stmatrix .x4 .trans (warp-wide): register i of every lane holds its two fp16 of 8x8
    matrix i as an mma fragment (lane l: row l / 4, columns 2 (l % 4) and + 1); lane 8 i + r
    gives the shared address where matrix i's column r is stored, as 8 fp16 (16 bytes)."""
    _inline_asm(
        None,
        [cutlass.Int32(smem).ir_value(loc=loc, ip=ip)] + [cutlass.Int32(r).ir_value(loc=loc, ip=ip) for r in registers],
        "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r,~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def stmatrix_x2_trans(smem: cutlass.Int32, registers, *, loc=None, ip=None):
    """stmatrix .x2 .trans (warp-wide): stmatrix_x4_trans with two matrices; lanes 0 .. 15 give
    the addresses (lane 8 i + r: matrix i's column r)."""
    _inline_asm(
        None,
        [cutlass.Int32(smem).ir_value(loc=loc, ip=ip)] + [cutlass.Int32(r).ir_value(loc=loc, ip=ip) for r in registers],
        "stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [$0], {$1, $2};",
        "r,r,r,~{memory}",
        loc=loc,
        ip=ip,
    )


def round_16(value, out_dtype: str):
    """An fp32 value rounded to the output's 16-bit dtype (round to nearest even) and back: what
    a 16-bit tensor holds of it."""
    narrow = cutlass.BFloat16 if out_dtype == "bfloat16" else cutlass.Float16
    return cutlass.Float32(narrow(value))


def swiglu(gate, up):
    """silu(gate) x up in fp32, as torch computes it on fp32 tensors: gate / (1 + exp(-gate)),
    then times up (the exponential and the division to nearest: no fast-math)."""
    return gate / (cutlass.Float32(1.0) + cute.math.exp(-gate)) * up


@dsl_user_op
def copy_16B_shared_to_global(smem: cutlass.Int32, address: cutlass.Int64, *, loc=None, ip=None):
    """16 bytes from shared `smem` to global `address` (both 16-byte aligned)."""
    _inline_asm(
        None,
        [cutlass.Int32(smem).ir_value(loc=loc, ip=ip), cutlass.Int64(address).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 w<4>;\n\tld.shared.v4.b32 {w0, w1, w2, w3}, [$0];\n\t"
        "st.global.v4.b32 [$1], {w0, w1, w2, w3};\n\t}",
        "r,l,~{memory}",
        loc=loc,
        ip=ip,
    )


def _store_16(cvt: str, address, value, loc, ip) -> None:
    """Round one fp32 to a 16-bit type by `cvt` and store it at global `address`."""
    _inline_asm(
        None,
        [cutlass.Int64(address).ir_value(loc=loc, ip=ip), cutlass.Float32(value).ir_value(loc=loc, ip=ip)],
        f"{{\n\t.reg .b16 half;\n\t{cvt} half, $1;\n\tst.global.b16 [$0], half;\n\t}}",
        "l,f,~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def store_f16(address: cutlass.Int64, value: cutlass.Float32, *, loc=None, ip=None):
    """Round one fp32 to fp16 and store it at global `address`."""
    _store_16("cvt.rn.f16.f32", address, value, loc, ip)


@dsl_user_op
def store_bf16(address: cutlass.Int64, value: cutlass.Float32, *, loc=None, ip=None):
    """Round one fp32 to bf16 and store it at global `address`."""
    _store_16("cvt.rn.bf16.f32", address, value, loc, ip)


def store_16(address, value, out_dtype: str):
    """store_f16 or store_bf16 by the output's dtype ("float16" or "bfloat16")."""
    if out_dtype == "bfloat16":
        store_bf16(address, value)
    else:
        store_f16(address, value)


@dsl_user_op
def decode_scale_blocks_to_registers(units, *, loc=None, ip=None):
    """Decode a lane's share of row pairs (g, g+8) of a k-tile into registers; `units` lists
    (row g packed + 4 (t // 2), row g+8 packed + 4 (t // 2), a_word_selector(t), row g's
    scales, row g+8's) per row pair. Returns, per unit and k16 step, the 4 Int32 fragment
    registers (FRAGMENT_REGISTERS order)."""
    operands = [cutlass.Int32(x).ir_value(loc=loc, ip=ip) for unit in units for x in unit]
    num_outputs = 16 * len(units)
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Int32.mlir_type] * num_outputs),
        operands,
        _decode_blocks_asm(len(units), "registers"),
        ",".join(["=r"] * num_outputs + ["r"] * len(operands)) + ",~{memory}",
        loc=loc,
        ip=ip,
    )
    registers = [llvm.extractvalue(cutlass.Int32.mlir_type, result, [i], loc=loc, ip=ip) for i in range(num_outputs)]
    return [[registers[16 * u + 4 * s : 16 * u + 4 * s + 4] for s in range(4)] for u in range(len(units))]



# Decode of packed e2m1 into bf16 in natural K order (W4A16: the activations are read as they
# are, so the weights' fragment must hold K in order; the fp16 decode's K permutation above is
# applied to the activations by the fp4 path's pre-pass, which W4A16 does not have).
#
# Lane (g, t) of a warp holds, per k16 step (one 16-element scale block), registers
# R0 = (row g, cols 2t, 2t+1), R1 = (g+8, 2t, 2t+1), R2 = (g, 2t+8, 2t+9), R3 = (g+8, 2t+8, 2t+9):
# the two codes of packed byte t (R0, R1) and byte t+4 (R2, R3) of the block's 8 bytes. The lane
# loads rows g and g+8's 8 bytes (two words each) and builds W = [g.t, g8.t, g.t+4, g8.t+4] (three
# prmt, bf16_word_selector). With H = W >> 4, register p is Y = prmt(W, H, [p, 0, 4+p, 0]) =
# [byte p (low code in bits 0-3), 0, byte p >> 4 (high code in bits 16-19), 0] (the zero bytes:
# selector nibble 0xF replicates bit 7 of H's byte 3, which the shift cleared; the codes' other
# bits land outside the mask below, so W and H need no mask of their own), placed as bf16 in both
# 16-bit lanes at once: sign (code bit 3) to bit 15, magnitude (bits 2-0: e1 e0 m) to bits
# 8..6, (Y << 12 | Y << 6) & 0x81C081C0. That bf16 is v * 2^-126 exactly (code 0.5 is the bf16
# subnormal 2^-127). The multiply by the block's scale S = s * 2^118 (bf16, normal: s <= 448
# gives < 2^127) gives v * s * 2^-8, exact (at most 6 significant bits, within bf16's normal
# range for every e2m1 x e4m3 product but 0); the epilogue rescales by 2^8. The scales: e4m3x2
# -> f16x2 (exact) for two blocks at once, then each: fp32 (exact) -> times 2^118 (exact) -> bf16
# (exact: 4 significant bits) in both lanes.
# With paired_scales, two blocks' S at once: fp32 (exact) -> one bf16x2 pair (exact) -> times
# (2^118, 2^118) (exact), each block's S then read from its lane of the pair (the multiply's
# operand halves: no instruction of its own); fewer instructions, more registers (the builds
# that take it: hopper.moe.w4a16_paired_scales).
# With quad_scales, the four lanes of a quad (g, t = 0 .. 3: the same rows g and g+8) share the
# conversion: lane t converts one pair, blocks 2 (t % 2) and + 1 of row g (t < 2) or g+8, from
# its own two scale bytes (one 16-bit shared load), and four shfl.sync.idx within the quad give
# every lane the four pairs: per 64-wide k-tile one load, 5 conversions and 4 shuffles where
# each lane converted all four pairs (two loads, 20 conversions). The same S, bit for bit.
QUAD_SHUFFLE_CLAMP = 0x1C1F  # shfl.sync.idx's c: segments of 4 lanes (mask 0x1c), clamp 31
BF16_LANES = 0x81C081C0
BF16_DECODE_SCALE_EXPONENT = 118  # S = s * 2^118: the decoded weights are v * s * 2^-8
BF16_DECODE_SCALE_PAIR = 0x10001 * ((BF16_DECODE_SCALE_EXPONENT + 127) << 7)  # bf16x2 (2^118, 2^118)
BF16_PLACE_SELECTORS = tuple(0xF0F0 | (p << 0) | ((4 + p) << 8) for p in range(4))


def bf16_word_selector(t: int) -> int:
    """prmt selector taking byte t of its first operand (row g's word) and byte t of its second
    (row g+8's) into bytes 0 and 1: [g.t, g8.t, -, -] (bytes 2, 3 take byte 0: unused)."""
    return t | ((4 + t) << 4)


def _place_bf16_word_ptx(word: str, destinations: list[str]) -> list[str]:
    """PTX placing the 8 codes of `word` = [g.t, g8.t, g.t+4, g8.t+4] as bf16 v * 2^-126 into the
    four fragment registers `destinations` (R0 .. R3 above); scratch h, y, a, b; mask in `lanes`."""
    lines = [f"shr.b32 h, {word}, 4;"]
    for destination, selector in zip(destinations, BF16_PLACE_SELECTORS):
        # (Y x 4160) & lanes, one multiply in place of the two shifts (its two copies must not
        # overlap: W and H masked first): an 8-byte local frame in the 32-token build at its
        # 64-register bound (EXPERIMENTS E86)
        lines += [
            f"prmt.b32 y, {word}, h, {hex(selector)};",
            "shl.b32 a, y, 12;",
            "shl.b32 b, y, 6;",
            f"lop3.b32 {destination}, a, b, lanes, 0xA8;",
        ]
    return lines


def _place_fragment_word_ptx(word: str, destinations: list[str]) -> list[str]:
    """PTX placing a fragment-layout word's 8 codes (nvfp4_group_gemm.weight_layout: bytes R0 ..
    R3 with their bits moved) as bf16 v * 2^-126 into R0 .. R3: three shifted copies masked, and
    R3 from three more (11 integer instructions once ptxas folds the ands and ors into lop3s);
    scratch a, b; mask in `lanes`."""
    r0, r1, r2, r3 = destinations
    return [
        f"and.b32 {r0}, {word}, lanes;",
        f"shl.b32 a, {word}, 3;",
        f"and.b32 {r1}, a, lanes;",
        f"shl.b32 a, {word}, 6;",
        f"and.b32 {r2}, a, lanes;",
        f"shl.b32 a, {word}, 1;",
        "and.b32 a, a, 0x80008000;",
        f"shr.b32 b, {word}, 3;",
        "and.b32 b, b, 0x01800180;",
        "or.b32 a, a, b;",
        f"shr.b32 b, {word}, 7;",
        "and.b32 b, b, 0x00400040;",
        f"or.b32 {r3}, a, b;",
    ]


def quad_pair_offset(t: int) -> tuple[int, int]:
    """Lane t's pair of scale bytes under quad_scales, as (row, byte) offsets: row g (t < 2) or
    g+8, bytes 2 (t % 2) and + 1 of the row's 4 (blocks 2 (t % 2) and + 1 of the 64-wide k-tile)."""
    return 8 * (t // 2), 2 * (t % 2)


def _decode_bf16_registers_asm(num_units: int, paired_scales: bool = False, fragment: bool = False,
                               quad_scales: bool = False) -> str:
    """PTX of decode_bf16_rows_to_registers: outputs $(16u + 4s + i), register i (R0 .. R3) of
    k16 step s of unit u; inputs after the 16 * num_units outputs, per unit: row g's packed
    bytes of the 64-wide k-tile (32 bytes, 8-byte aligned), row g+8's, bf16_word_selector(t), row
    g's 4 scale bytes (4-byte aligned), row g+8's. All loads first, then the scales (paired_scales:
    two blocks' S in one bf16x2, above), then the codes (as _decode_blocks_asm). Each step's loads
    folded into its word at once, or each step done in turn: more spill at the 64-register bound
    (EXPERIMENTS E83); each pair of steps' scales converted before the first of them: more spill too.
    fragment: the weights in nvfp4_group_gemm.weight_layout's fragment layout; a unit's first
    input is then the lane's 16 bytes (one v4 load: a word per k16 step), its second and third
    unused, and each step's word placed by _place_fragment_word_ptx. quad_scales (every lane of
    the warp runs it: shuffles): a unit's fourth input is the lane's pair of scale bytes
    (quad_pair_offset), and it has no fifth; each lane converts that pair and the quad shares
    its four (above)."""
    first_input = 16 * num_units
    inputs_per_unit = 4 if quad_scales else 5
    lines = [
        "{",
        ".reg .b32 h, y, a, b, lanes, p, q, w;",
        ".reg .b16 slo, shi, f16a, f16b;",
        ".reg .f32 f;",
        f"mov.b32 lanes, {hex(BF16_LANES)};",
    ]
    if paired_scales or quad_scales:  # the pair's registers and constant only where the scales pair
        lines += [".reg .b32 scale_pair;", ".reg .b16 plo, phi;", ".reg .f32 fb;",
                  f"mov.b32 scale_pair, {hex(BF16_DECODE_SCALE_PAIR)};"]
    for u in range(num_units):
        pair = f", P{u}" if paired_scales or quad_scales else ""
        words = f"gl{u}_<4>" if fragment else f"gl{u}_<4>, gh{u}_<4>, hl{u}_<4>, hh{u}_<4>"
        scale_words = f"sq{u}" if quad_scales else f"sg{u}, sh{u}"  # the lane's pair: 16 bits
        lines.append(f".reg .b32 {words}, S{u}_<8>, F{u}{pair};")
        lines.append(f".reg .{'b16' if quad_scales else 'b32'} {scale_words};")
    for u in range(num_units):  # loads
        src = first_input + inputs_per_unit * u
        if fragment:  # the lane's word of each k16 step: gl{u}_0 .. gl{u}_3
            lines.append(f"ld.shared.v4.u32 {{gl{u}_0, gl{u}_1, gl{u}_2, gl{u}_3}}, [${src}];")
        for s in range(4 if not fragment else 0):
            lines.append(f"ld.shared.v2.u32 {{gl{u}_{s}, gh{u}_{s}}}, [${src} + {8 * s}];")
            lines.append(f"ld.shared.v2.u32 {{hl{u}_{s}, hh{u}_{s}}}, [${src + 1} + {8 * s}];")
        if quad_scales:
            lines.append(f"ld.shared.u16 sq{u}, [${src + 3}];")
        else:
            lines.append(f"ld.shared.u32 sg{u}, [${src + 3}];")
            lines.append(f"ld.shared.u32 sh{u}, [${src + 4}];")
    scale = hex(0x3F800000 + (BF16_DECODE_SCALE_EXPONENT << 23))  # 2^118 as fp32
    for u in range(num_units):  # scales: bf16x2 (S, S) of row r, block s -> S{u}_{4 r + s}
        if quad_scales:
            # the lane's pair: e4m3x2 -> f16x2 -> two fp32 -> one bf16x2 -> times (2^118, 2^118)
            lines += [
                f"cvt.rn.f16x2.e4m3x2 F{u}, sq{u};",
                "mov.b32 {f16a, f16b}, " + f"F{u};",
                "cvt.f32.f16 f, f16a;",
                "cvt.f32.f16 fb, f16b;",
                f"cvt.rn.bf16x2.f32 P{u}, fb, f;",
                f"mul.rn.bf16x2 P{u}, P{u}, scale_pair;",
            ]
            for j in range(4):  # lane j of the quad's pair: row j // 2, blocks 2 (j % 2) and + 1
                first = 4 * (j // 2) + 2 * (j % 2)
                lines += [
                    f"shfl.sync.idx.b32 q, P{u}, {j}, {hex(QUAD_SHUFFLE_CLAMP)}, 0xffffffff;",
                    "mov.b32 {plo, phi}, q;",
                    f"mov.b32 S{u}_{first}, {{plo, plo}};",
                    f"mov.b32 S{u}_{first + 1}, {{phi, phi}};",
                ]
            continue
        for row, scales in enumerate((f"sg{u}", f"sh{u}")):
            lines.append("mov.b32 {slo, shi}, " + f"{scales};")
            for half, source in enumerate(("slo", "shi")):
                # blocks 2 half and + 1: e4m3x2 -> f16x2 (exact), then each block's S (above)
                lines += [
                    f"cvt.rn.f16x2.e4m3x2 F{u}, {source};",
                    "mov.b32 {f16a, f16b}, " + f"F{u};",
                ]
                first = 4 * row + 2 * half
                if paired_scales:
                    lines += [
                        "cvt.f32.f16 f, f16a;",
                        "cvt.f32.f16 fb, f16b;",
                        f"cvt.rn.bf16x2.f32 P{u}, fb, f;",
                        f"mul.rn.bf16x2 P{u}, P{u}, scale_pair;",
                        "mov.b32 {plo, phi}, " + f"P{u};",
                        f"mov.b32 S{u}_{first}, {{plo, plo}};",
                        f"mov.b32 S{u}_{first + 1}, {{phi, phi}};",
                    ]
                    continue
                for part, f16 in enumerate(("f16a", "f16b")):
                    lines += [
                        f"cvt.f32.f16 f, {f16};",
                        f"mul.rn.f32 f, f, 0f{scale[2:].upper()};",
                        f"cvt.rn.bf16x2.f32 S{u}_{first + part}, f, f;",
                    ]
    for u in range(num_units):  # words, bit placement and scaling
        selector = f"${first_input + inputs_per_unit * u + 2}"
        for s in range(4):
            destinations = [f"${16 * u + 4 * s + i}" for i in range(4)]
            if fragment:
                lines += _place_fragment_word_ptx(f"gl{u}_{s}", destinations)
            else:
                lines += [
                    f"prmt.b32 p, gl{u}_{s}, hl{u}_{s}, {selector};",
                    f"prmt.b32 q, gh{u}_{s}, hh{u}_{s}, {selector};",
                    "prmt.b32 w, p, q, 0x5410;",
                ]
                lines += _place_bf16_word_ptx("w", destinations)
            for i, destination in enumerate(destinations):
                row = i % 2  # R0, R2: row g; R1, R3: row g+8
                lines.append(f"mul.rn.bf16x2 {destination}, {destination}, S{u}_{4 * row + s};")
    lines.append("}")
    return "\n\t".join(lines)


@dsl_user_op
def decode_bf16_rows_to_registers(units, paired_scales: bool = False, fragment: bool = False,
                                  quad_scales: bool = False, *, loc=None, ip=None):
    """Decode a lane's share of row pairs (g, g+8) of a 64-wide k-tile into bf16 fragment
    registers in natural K order; `units` lists (row g packed, row g+8 packed, bf16_word_selector(t),
    row g's scales, row g+8's) shared addresses per row pair; paired_scales: two blocks' S in
    one bf16x2 (_decode_bf16_registers_asm); fragment: the weights in the fragment layout, each
    unit's first address the lane's 16 bytes; quad_scales: each unit's scales the lane's one
    pair address (quad_pair_offset), the quad's lanes converting one pair each (every lane of
    the warp must run it). Returns, per unit and k16 step, the 4 Int32 fragment registers
    (R0 .. R3)."""
    operands = [cutlass.Int32(x).ir_value(loc=loc, ip=ip) for unit in units for x in unit]
    num_outputs = 16 * len(units)
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Int32.mlir_type] * num_outputs),
        operands,
        _decode_bf16_registers_asm(len(units), paired_scales, fragment, quad_scales),
        ",".join(["=r"] * num_outputs + ["r"] * len(operands)) + ",~{memory}",
        loc=loc,
        ip=ip,
    )
    registers = [llvm.extractvalue(cutlass.Int32.mlir_type, result, [i], loc=loc, ip=ip) for i in range(num_outputs)]
    return [[registers[16 * u + 4 * s : 16 * u + 4 * s + 4] for s in range(4)] for u in range(len(units))]


@dsl_user_op
def pack_16x8(registers, dtype=cutlass.Float16, *, loc=None, ip=None):
    """Four Int32 registers (two 16-bit values each) -> vector<8 x dtype> in register order."""
    vec_i32 = vector.from_elements(
        ir.VectorType.get([4], cutlass.Int32.mlir_type, loc=loc), list(registers), loc=loc, ip=ip
    )
    return llvm.bitcast(ir.VectorType.get([8], dtype.mlir_type, loc=loc), vec_i32, loc=loc, ip=ip)


@dsl_user_op
def cp_async_mbarrier_arrive_noinc(mbar_smem: cutlass.Int32, *, loc=None, ip=None):
    """cp.async.mbarrier.arrive.noinc: an arrival on the mbarrier at `mbar_smem` once every
    cp.async this thread issued before has landed (the barrier's count includes it: noinc)."""
    _inline_asm(
        None,
        [cutlass.Int32(mbar_smem).ir_value(loc=loc, ip=ip)],
        "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];",
        "r,~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def load_bf16x8_where(address: cutlass.Int64, expert: cutlass.Int64, bound: cutlass.Int64, *, loc=None, ip=None):
    """The 16 bytes (8 bf16) at global `address` as 4 words where expert < bound; zeros, and
    nothing read, otherwise (a row another GPU computes holds no value here)."""
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Int32.mlir_type] * 4),
        [cutlass.Int64(address).ir_value(loc=loc, ip=ip), cutlass.Int64(expert).ir_value(loc=loc, ip=ip),
         cutlass.Int64(bound).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .pred valid;\n\tsetp.lt.s64 valid, $5, $6;\n\t"
        "mov.b32 $0, 0;\n\tmov.b32 $1, 0;\n\tmov.b32 $2, 0;\n\tmov.b32 $3, 0;\n\t"
        "@valid ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];\n\t}",
        "=r,=r,=r,=r,l,l,l",
        loc=loc,
        ip=ip,
    )
    return [cutlass.Int32(llvm.extractvalue(cutlass.Int32.mlir_type, result, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def load_u32x4_global_nc(address: cutlass.Int64, *, loc=None, ip=None):
    """The 16 bytes at global `address` as 4 words, through the read-only path (data no thread
    of the grid writes)."""
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Int32.mlir_type] * 4),
        [cutlass.Int64(address).ir_value(loc=loc, ip=ip)],
        "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        loc=loc,
        ip=ip,
    )
    return [cutlass.Int32(llvm.extractvalue(cutlass.Int32.mlir_type, result, [i], loc=loc, ip=ip)) for i in range(4)]


def accumulate_f32x8_text() -> str:
    """accumulate_f32x8's PTX: $0 .. $7 the accumulators (in and out), $8 the weight, $9 .. $16
    the values."""
    lines = ["{", ".reg .f32 product;"]
    for e in range(8):
        lines += [f"mul.rn.f32 product, ${9 + e}, $8;", f"add.rn.f32 ${e}, ${e}, product;"]
    lines.append("}")
    return "\n\t".join(lines)


@dsl_user_op
def accumulate_f32x8(accumulators, values, weight: cutlass.Float32, *, loc=None, ip=None):
    """accumulators[e] + weight x values[e] in fp32: the product rounded, then the sum (torch's
    fp32 mul and add; in PTX so that no fused multiply-add replaces them)."""
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Float32.mlir_type] * 8),
        # $8 the weight, $9 .. $16 the values, then the accumulators' inputs, tied to $0 .. $7
        [cutlass.Float32(weight).ir_value(loc=loc, ip=ip)]
        + [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in values]
        + [cutlass.Float32(a).ir_value(loc=loc, ip=ip) for a in accumulators],
        accumulate_f32x8_text(),
        ",".join(["=f"] * 8) + "," + ",".join(["f"] * 9) + "," + ",".join(str(e) for e in range(8)),
        loc=loc,
        ip=ip,
    )
    return [cutlass.Float32(llvm.extractvalue(cutlass.Float32.mlir_type, result, [e], loc=loc, ip=ip))
            for e in range(8)]


@dsl_user_op
def store_u32x4_global(address: cutlass.Int64, words, *, loc=None, ip=None):
    """Store 4 32-bit words at global `address` (one 16-byte store)."""
    _store("st.global.v4.b32", cutlass.Int64(address), "l", words, cutlass.Int32, "r", loc, ip)


@dsl_user_op
def atomic_add_u32_shared(smem: cutlass.Int32, value: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Int32:
    """atom.shared.add.u32: adds `value` at shared `smem`, returns the previous value."""
    return _atomic_add_u32("shared", cutlass.Int32(smem), "r", value, loc, ip)


@dsl_user_op
def store_i64_global(address: cutlass.Int64, value: cutlass.Int64, *, loc=None, ip=None):
    _store("st.global.s64", cutlass.Int64(address), "l", [value], cutlass.Int64, "l", loc, ip)


@dsl_user_op
def load_f32_global_or_neg_inf(address: cutlass.Int64, valid: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Float32:
    """One fp32 from global `address` where valid != 0; -inf, and nothing read, otherwise."""
    result = _inline_asm(
        cutlass.Float32.mlir_type,
        [cutlass.Int64(address).ir_value(loc=loc, ip=ip), cutlass.Int32(valid).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .pred valid;\n\tsetp.ne.s32 valid, $2, 0;\n\tmov.f32 $0, 0fFF800000;\n\t"
        "@valid ld.global.f32 $0, [$1];\n\t}",
        "=f,l,r",
        loc=loc,
        ip=ip,
    )
    return cutlass.Float32(result)


def lane_best_text(count: int) -> str:
    """lane_best's PTX over `count` values: $0 the best value, $1 its slot; $2 the taken bits,
    $3 .. the values."""
    lines = ["{", ".reg .pred better, free;", ".reg .b32 bit;", "mov.f32 $0, 0fFF800000;", "mov.b32 $1, -1;"]
    for i in range(count):
        lines += [f"and.b32 bit, $2, {1 << i};", "setp.eq.u32 free, bit, 0;",
                  f"setp.gt.and.f32 better, ${3 + i}, $0, free;",
                  f"@better mov.f32 $0, ${3 + i};", f"@better mov.b32 $1, {i};"]
    lines.append("}")
    return "\n\t".join(lines)


@dsl_user_op
def lane_best(values, taken: cutlass.Int32, *, loc=None, ip=None):
    """(the largest of `values` whose bit i of `taken` is clear, its slot i): the first on a tie;
    (-inf, -1) where every value is taken or -inf."""
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Float32.mlir_type, cutlass.Int32.mlir_type]),
        [cutlass.Int32(taken).ir_value(loc=loc, ip=ip)] + [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in values],
        lane_best_text(len(values)),
        "=f,=r,r," + ",".join(["f"] * len(values)),
        loc=loc,
        ip=ip,
    )
    return (cutlass.Float32(llvm.extractvalue(cutlass.Float32.mlir_type, result, [0], loc=loc, ip=ip)),
            cutlass.Int32(llvm.extractvalue(cutlass.Int32.mlir_type, result, [1], loc=loc, ip=ip)))


def warp_best_text() -> str:
    """warp_best's PTX: $0, $1 the (value, index) in and out (tied to $2, $3)."""
    lines = ["{", ".reg .f32 other;", ".reg .b32 value_bits, other_bits, other_index;", ".reg .pred better, tie;"]
    for distance in (16, 8, 4, 2, 1):
        lines += ["mov.b32 value_bits, $0;",
                  f"shfl.sync.bfly.b32 other_bits, value_bits, {distance}, 31, -1;",
                  f"shfl.sync.bfly.b32 other_index, $1, {distance}, 31, -1;",
                  "mov.b32 other, other_bits;",
                  "setp.gt.f32 better, other, $0;",
                  "setp.eq.f32 tie, other, $0;",
                  "setp.lt.and.u32 tie, other_index, $1, tie;",
                  "or.pred better, better, tie;",
                  "@better mov.f32 $0, other;",
                  "@better mov.b32 $1, other_index;"]
    lines.append("}")
    return "\n\t".join(lines)


@dsl_user_op
def warp_best(value: cutlass.Float32, index: cutlass.Int32, *, loc=None, ip=None):
    """The warp's largest (value, index), the lowest index on a tie (unsigned), in every lane."""
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Float32.mlir_type, cutlass.Int32.mlir_type]),
        [cutlass.Float32(value).ir_value(loc=loc, ip=ip), cutlass.Int32(index).ir_value(loc=loc, ip=ip)],
        warp_best_text(),
        "=f,=r,0,1",
        loc=loc,
        ip=ip,
    )
    return (cutlass.Float32(llvm.extractvalue(cutlass.Float32.mlir_type, result, [0], loc=loc, ip=ip)),
            cutlass.Int32(llvm.extractvalue(cutlass.Int32.mlir_type, result, [1], loc=loc, ip=ip)))


def take_slot_text() -> str:
    """take_slot's PTX: $0 the bits out; $1 the bits in, $2 the lane, $3 the index."""
    return ("{\n\t.reg .pred mine;\n\t.reg .b32 owner, slot, bit;\n\tand.b32 owner, $3, 31;\n\t"
            "setp.eq.u32 mine, owner, $2;\n\tshr.u32 slot, $3, 5;\n\tshl.b32 bit, 1, slot;\n\t"
            "mov.b32 $0, $1;\n\t@mine or.b32 $0, $1, bit;\n\t}")


@dsl_user_op
def take_slot(taken: cutlass.Int32, lane: cutlass.Int32, index: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Int32:
    """`taken` with bit index / 32 set in the lane that holds element `index` (index % 32)."""
    result = _inline_asm(
        cutlass.Int32.mlir_type,
        [cutlass.Int32(taken).ir_value(loc=loc, ip=ip), cutlass.Int32(lane).ir_value(loc=loc, ip=ip),
         cutlass.Int32(index).ir_value(loc=loc, ip=ip)],
        take_slot_text(),
        "=r,r,r,r",
        loc=loc,
        ip=ip,
    )
    return cutlass.Int32(result)


def group_top_two_text(count: int) -> str:
    """group_top_two's PTX: $0, $1 the largest and second largest out; $2 .. the lane's `count`
    values. Each lane's two largest, then the warp's by a butterfly: the merge of two disjoint
    sets' (first, second) is (max(first, first'), max(second, second', min(first, first')))."""
    lines = ["{", ".reg .f32 other_first, other_second, low;", "mov.f32 $0, 0fFF800000;", "mov.f32 $1, 0fFF800000;"]
    for i in range(count):
        lines += [f"min.f32 low, $0, ${2 + i};", "max.f32 $1, $1, low;", f"max.f32 $0, $0, ${2 + i};"]
    for distance in (16, 8, 4, 2, 1):
        lines += [f"shfl.sync.bfly.b32 other_first, $0, {distance}, 31, -1;",
                  f"shfl.sync.bfly.b32 other_second, $1, {distance}, 31, -1;",
                  "min.f32 low, $0, other_first;", "max.f32 $1, $1, other_second;", "max.f32 $1, $1, low;",
                  "max.f32 $0, $0, other_first;"]
    lines.append("}")
    return "\n\t".join(lines)


@dsl_user_op
def group_top_two(values, *, loc=None, ip=None):
    """The warp's largest and second largest of every lane's `values` (a group of experts), in
    every lane; -inf where the group has fewer."""
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Float32.mlir_type] * 2),
        [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in values],
        group_top_two_text(len(values)),
        "=f,=f," + ",".join(["f"] * len(values)),
        loc=loc,
        ip=ip,
    )
    return tuple(cutlass.Float32(llvm.extractvalue(cutlass.Float32.mlir_type, result, [i], loc=loc, ip=ip))
                 for i in range(2))


def zero_unkept_text(count: int, per_group: int) -> str:
    """zero_unkept's PTX: $0 .. $(count - 1) the values out (tied to $(count + 1) ..); $count
    the kept groups' bits; value i belongs to group i // per_group."""
    lines = ["{", ".reg .b32 bit;", ".reg .pred drop;"]
    for i in range(count):
        lines += [f"and.b32 bit, ${count}, {1 << (i // per_group)};", "setp.eq.u32 drop, bit, 0;",
                  f"@drop mov.f32 ${i}, 0f00000000;"]
    lines.append("}")
    return "\n\t".join(lines)


@dsl_user_op
def zero_unkept(values, kept: cutlass.Int32, per_group: int, *, loc=None, ip=None) -> list:
    """`values` with those of groups whose bit in `kept` is clear set to 0.0 (value i: group
    i // per_group), as transformers' grouped routing masks the experts of groups it drops."""
    count = len(values)
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Float32.mlir_type] * count),
        [cutlass.Int32(kept).ir_value(loc=loc, ip=ip)] + [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in values],
        zero_unkept_text(count, per_group),
        ",".join(["=f"] * count) + ",r," + ",".join(str(i) for i in range(count)),
        loc=loc,
        ip=ip,
    )
    return [cutlass.Float32(llvm.extractvalue(cutlass.Float32.mlir_type, result, [i], loc=loc, ip=ip))
            for i in range(count)]


@dsl_user_op
def store_f32_global(address: cutlass.Int64, value: cutlass.Float32, *, loc=None, ip=None):
    _store("st.global.f32", cutlass.Int64(address), "l", [value], cutlass.Float32, "f", loc, ip)


def quantize_block_text(tie_down, tie_up) -> str:
    """quantize_block's PTX: $0, $1 the 16 e2m1 codes (element e in bits 4 (e % 8) of word
    e // 8), $2 the block's e4m3 scale byte; $3 .. $18 the 16 fp32 values, $19 the global scale.
    The format's formula as checkpoint.quantize_blocks computes it in fp32: block scale =
    e4m3(min(amax / 6 / global, 448)) (each division to nearest), denominator = that scale x
    global, value = x / denominator (0 where the denominator is 0), code = the midpoints below
    |value| (tie_down: strictly, tie_up: at or below: round to nearest even, saturating), the
    sign bit of value at bit 3. A NaN value codes as 0 with its sign; a NaN amax is ignored
    (max.f32), where torch's would make the scale NaN."""
    def f32(value: float) -> str:
        import struct

        return "0f" + struct.pack(">f", value).hex().upper()

    lines = ["{", ".reg .f32 amax, t, scale, q, v;", ".reg .b32 bits, code, s, c, w0, w1;",
             ".reg .b16 pair;", ".reg .b16 h_lo, h_hi;", ".reg .b32 halves;", ".reg .pred positive, p;",
             "abs.f32 amax, $3;"]
    for e in range(1, 16):
        lines += [f"abs.f32 t, ${3 + e};", "max.f32 amax, amax, t;"]
    lines += [f"div.rn.f32 scale, amax, {f32(6.0)};", "div.rn.f32 scale, scale, $19;",
              f"min.f32 scale, scale, {f32(448.0)};",
              "cvt.rn.satfinite.e4m3x2.f32 pair, scale, scale;",
              "cvt.u32.u16 bits, pair;", "and.b32 $2, bits, 255;",
              "cvt.rn.f16x2.e4m3x2 halves, pair;", "mov.b32 {h_lo, h_hi}, halves;", "cvt.f32.f16 scale, h_lo;",
              "mul.rn.f32 scale, scale, $19;", f"setp.gt.f32 positive, scale, {f32(0.0)};",
              "mov.b32 w0, 0;", "mov.b32 w1, 0;"]
    for e in range(16):
        lines += [f"div.rn.f32 q, ${3 + e}, scale;", f"selp.f32 q, q, {f32(0.0)}, positive;", "abs.f32 v, q;",
                  "mov.b32 code, 0;"]
        for midpoint in tie_down:
            lines += [f"setp.gt.f32 p, v, {f32(midpoint)};", "selp.b32 c, 1, 0, p;", "add.u32 code, code, c;"]
        for midpoint in tie_up:
            lines += [f"setp.ge.f32 p, v, {f32(midpoint)};", "selp.b32 c, 1, 0, p;", "add.u32 code, code, c;"]
        lines += ["mov.b32 s, q;", "shr.u32 s, s, 31;", "shl.b32 s, s, 3;", "or.b32 code, code, s;",
                  f"shl.b32 code, code, {4 * (e % 8)};", f"or.b32 w{e // 8}, w{e // 8}, code;"]
    lines += ["mov.b32 $0, w0;", "mov.b32 $1, w1;", "}"]
    return "\n\t".join(lines)


@dsl_user_op
def quantize_block(values, global_scale: cutlass.Float32, *, loc=None, ip=None):
    """(code word 0, code word 1, scale byte) of one 16-element block (quantize_block_text)."""
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Int32.mlir_type] * 3),
        [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in values]
        + [cutlass.Float32(global_scale).ir_value(loc=loc, ip=ip)],
        quantize_block_text(e2m1.TIE_DOWN, e2m1.TIE_UP),
        "=r,=r,=r," + ",".join(["f"] * 17),
        loc=loc,
        ip=ip,
    )
    return [cutlass.Int32(llvm.extractvalue(cutlass.Int32.mlir_type, result, [i], loc=loc, ip=ip)) for i in range(3)]


def bf16x8_to_f32_text() -> str:
    """bf16x8_to_f32's PTX: $0 .. $7 the fp32 values of the 8 bf16 in words $8 .. $11."""
    lines = ["{"]
    for e in range(8):
        word = f"${8 + e // 2}"
        lines.append(f"shl.b32 ${e}, {word}, 16;" if e % 2 == 0 else f"and.b32 ${e}, {word}, 0xffff0000;")
    lines.append("}")
    return "\n\t".join(lines)


@dsl_user_op
def bf16x8_to_f32(words, *, loc=None, ip=None):
    """The 8 bf16 of 4 words (element 0 in word 0's low half) as fp32 (exact)."""
    result = _inline_asm(
        llvm.StructType.get_literal([cutlass.Float32.mlir_type] * 8),
        [cutlass.Int32(w).ir_value(loc=loc, ip=ip) for w in words],
        bf16x8_to_f32_text(),
        ",".join(["=f"] * 8) + ",r,r,r,r",
        loc=loc,
        ip=ip,
    )
    return [cutlass.Float32(llvm.extractvalue(cutlass.Float32.mlir_type, result, [e], loc=loc, ip=ip))
            for e in range(8)]


@dsl_user_op
def store_u32x2_global(address: cutlass.Int64, low: cutlass.Int32, high: cutlass.Int32, *, loc=None, ip=None):
    _store("st.global.v2.b32", cutlass.Int64(address), "l", [low, high], cutlass.Int32, "r", loc, ip)


@dsl_user_op
def store_u8_global(address: cutlass.Int64, value: cutlass.Int32, *, loc=None, ip=None):
    _store("st.global.u8", cutlass.Int64(address), "l", [value], cutlass.Int32, "r", loc, ip)
