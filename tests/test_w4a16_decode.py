"""The W4A16 weight decode of the sm_90a kernels (hopper.ptx.decode_bf16_rows_to_registers),
run as the PTX text the kernel holds (tests/ptx_interpreter.py), lane by lane, against an
independent decode: every register of every k16 step is the natural-order fragment element
v * s * 2^-8, bit for bit, for every e2m1 code and a spread of e4m3 scales (subnormal, zero,
negative, the largest)."""

import numpy as np
import pytest
import torch
from ptx_interpreter import Thread, Warp, bf16_lanes, e4m3_to_float

from nvfp4_group_gemm.hopper import ptx

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
# e4m3 bytes: the smallest subnormal, a subnormal, the smallest normal, 1, 448 (the largest), 0,
# negative ones, and the competition's and a quantizer's usual range
SCALE_BYTES = [0x01, 0x05, 0x08, 0x38, 0x7E, 0x00, 0xB8, 0x81, 0x40, 0x50, 0x2A, 0x77]


def element(row_bytes: bytes, column: int) -> float:
    """Element `column` of a packed row (low nibble first)."""
    byte = row_bytes[column // 2]
    return E2M1[(byte >> (4 * (column % 2))) & 0xF]


def run_lane(t: int, rows: tuple[bytes, bytes], scales: tuple[bytes, bytes], paired_scales: bool = False):
    """Lane t's 16 output registers for rows (g, g+8) (32 packed bytes each: a 64-wide
    k-tile) and their 4 scale bytes each, with the scales converted one block or two at a time."""
    shared = {}
    bases = (0x100, 0x200, None, 0x300, 0x340)
    for base, data in ((bases[0], rows[0]), (bases[1], rows[1]), (bases[3], scales[0]), (bases[4], scales[1])):
        shared.update({base + i: b for i, b in enumerate(data)})
    operands = {16 + i: v for i, v in enumerate(
        (bases[0], bases[1], ptx.bf16_word_selector(t), bases[3], bases[4]))}
    thread = Thread(operands, shared)
    thread.run(ptx._decode_bf16_registers_asm(1, paired_scales))
    return [thread.registers[f"${i}"] for i in range(16)]


def expected_register(rows, scales, t: int, step: int, register: int) -> tuple[float, float]:
    """wgmma's A fragment: register i of lane (g, t) at k16 step s holds row g (i even) or g+8
    (i odd), columns 16 s + 2 t + 8 (i // 2) and + 1; value v * s * 2^-8."""
    row = register % 2
    column = 16 * step + 2 * t + 8 * (register // 2)
    scale = e4m3_to_float(scales[row][step])
    return tuple(float(np.float32(element(rows[row], c) * scale * 2.0**-8)) for c in (column, column + 1))


def assert_lane_registers(registers, rows, scales, t: int, where) -> None:
    """Lane t's 16 registers (rows g and g+8, their scale bytes) are expected_register's, bit for
    bit: every step and register, the sign of zero included; `where` names the lane in a failure."""
    for step in range(4):
        for i in range(4):
            got = bf16_lanes(registers[4 * step + i])
            want = expected_register(rows, scales, t, step, i)
            assert got == want, (where, step, i, got, want)
            assert [np.signbit(x) for x in got] == [np.signbit(x) for x in want], (where, step, i)


@pytest.mark.parametrize("paired_scales", [False, True], ids=["one_scale", "paired_scales"])
@pytest.mark.parametrize("seed", range(6))
def test_every_register_is_the_natural_order_element_times_its_scale(seed, paired_scales):
    rng = np.random.default_rng(seed)
    rows = tuple(bytes(rng.integers(0, 256, 32, dtype=np.uint8).tolist()) for _ in range(2))
    scales = tuple(bytes(rng.choice(SCALE_BYTES, 4).tolist()) for _ in range(2))
    for t in range(4):
        assert_lane_registers(run_lane(t, rows, scales, paired_scales), rows, scales, t, t)


@pytest.mark.parametrize("paired_scales", [False, True], ids=["one_scale", "paired_scales"])
def test_every_code_with_every_scale_is_exact(paired_scales):
    """All 256 byte values (both codes) under each scale: v * s * 2^-8 exactly, as bf16."""
    for scale_byte in SCALE_BYTES + [0x09, 0x30, 0x7D]:
        for start in range(0, 256, 32):
            row = bytes(range(start, start + 32))
            rows = (row, row[::-1])
            scales = (bytes([scale_byte] * 4), bytes([scale_byte] * 4))
            for t in range(4):
                assert_lane_registers(run_lane(t, rows, scales, paired_scales), rows, scales, t, (scale_byte, t))


def test_the_decoded_products_are_exact_in_bf16():
    """The premise of W4A16's exactness: every e2m1 x e4m3 product times 2^-8 is a bf16 (no
    rounding in the decode's multiply), and times a bf16 activation is exact in fp32."""
    scales = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    codes = torch.tensor(E2M1, dtype=torch.float64)
    products = (codes[:, None] * scales[None, :] * 2.0**-8).flatten()
    assert torch.equal(products.to(torch.bfloat16).double(), products)
    assert float(products.abs().max()) == 6 * 448 * 2.0**-8


@pytest.mark.parametrize("seed", range(3))
def test_the_interpreter_reads_the_fp16_decode_as_the_hardware_does(seed):
    """The interpreter checked on the fp16 register decode (`_decode_blocks_asm` "registers"),
    whose results the GPU tests have confirmed: lane (g, t)'s register i of step s holds the
    fragment's (row g or g+8, columns 2t + 8 (i // 2), + 1) in ptx's K permutation, i.e. the
    physical element whose LOGICAL_COLUMN is that column, times its scale and 2^-14."""
    inverse = {column: element for element, column in enumerate(ptx.LOGICAL_COLUMN)}
    rng = np.random.default_rng(100 + seed)
    rows = tuple(bytes(rng.integers(0, 256, 32, dtype=np.uint8).tolist()) for _ in range(2))
    scales = tuple(bytes(rng.choice(SCALE_BYTES, 4).tolist()) for _ in range(2))
    for t in range(4):
        shared = {}
        for base, data in ((0x100, rows[0]), (0x200, rows[1]), (0x300, scales[0]), (0x340, scales[1])):
            shared.update({base + i: b for i, b in enumerate(data)})
        half = 4 * (t // 2)
        operands = {16 + i: v for i, v in enumerate((0x100 + half, 0x200 + half, ptx.a_word_selector(t), 0x300, 0x340))}
        thread = Thread(operands, shared)
        thread.run(ptx._decode_blocks_asm(1, "registers"))
        for step in range(4):
            for i, name in enumerate(ptx.FRAGMENT_REGISTERS):
                row = 0 if name in ("e02", "o02") else 1
                register = thread.registers[f"${4 * step + i}"]
                got = [float(np.array([(register >> shift) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])
                       for shift in (0, 16)]
                pair = 2 * t + 8 * (i // 2)  # wgmma's columns of register i: row g for e02, o02
                want = [float(np.float16(element(rows[row][8 * step:8 * step + 8], inverse[column])
                                         * e4m3_to_float(scales[row][step]) * 2.0**-14))
                        for column in (pair, pair + 1)]
                assert got == want, (t, step, name, got, want)


def run_fragment_lane(g: int, t: int, block: bytes, scales: tuple[bytes, bytes], paired_scales: bool = False):
    """Lane (g, t)'s 16 output registers from a fragment-layout block (16 rows x 32 bytes as
    they sit in shared memory): its 16 bytes at 16 (4 g + t), rows g and g+8's scale bytes."""
    shared = {0x1000 + i: b for i, b in enumerate(block)}
    shared.update({0x300 + i: b for i, b in enumerate(scales[0])})
    shared.update({0x340 + i: b for i, b in enumerate(scales[1])})
    lane_bytes = 0x1000 + 16 * (4 * g + t)
    operands = {16 + i: v for i, v in enumerate((lane_bytes, lane_bytes, 0, 0x300, 0x340))}
    thread = Thread(operands, shared)
    thread.run(ptx._decode_bf16_registers_asm(1, paired_scales, fragment=True))
    return [thread.registers[f"${i}"] for i in range(16)]


@pytest.mark.parametrize("paired_scales", [False, True], ids=["one_scale", "paired_scales"])
@pytest.mark.parametrize("seed", range(3))
def test_the_fragment_layouts_decode_is_the_plain_decode_bit_for_bit(seed, paired_scales):
    """The fragment layout (nvfp4_group_gemm.weight_layout.pack_fragment) decoded by its PTX:
    every lane's every register is the plain rows' natural-order element times its scale and
    2^-8, bit for bit, for random blocks and every byte value in every lane's every place."""
    from nvfp4_group_gemm import weight_layout

    rng = np.random.default_rng(50 + seed)
    plain = torch.from_numpy(rng.integers(0, 256, (16, 32), dtype=np.uint8))
    if seed == 0:  # every byte value: byte 32 r + c is (r * 32 + c + 7) % 256 over the 512
        plain = (torch.arange(512).reshape(16, 32) * 1 + 7).remainder(256).to(torch.uint8)
    packed = weight_layout.pack_fragment(plain)
    block = bytes(packed.reshape(-1).tolist())
    for g in range(8):
        rows = (bytes(plain[g].tolist()), bytes(plain[g + 8].tolist()))
        scales = tuple(bytes(rng.choice(SCALE_BYTES, 4).tolist()) for _ in range(2))
        for t in range(4):
            assert_lane_registers(run_fragment_lane(g, t, block, scales, paired_scales), rows, scales, t, (g, t))


def test_the_fragment_layout_round_trips_and_checks_its_shape():
    from nvfp4_group_gemm import weight_layout

    b = torch.randint(0, 256, (3, 48, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    packed = weight_layout.pack_fragment(b)
    assert packed.shape == b.shape and packed.dtype == torch.uint8 and not torch.equal(packed, b)
    assert torch.equal(weight_layout.unpack_fragment(packed), b)
    # the blocks stay in place: a block's bytes change with its own block only
    other = b.clone()
    other[1, 16:32, 32:64] ^= 0x5A
    changed = (weight_layout.pack_fragment(other) != packed).nonzero()
    assert changed.numel() and bool((changed[:, 0] == 1).all() and (changed[:, 1] // 16 == 1).all()
                                    and (changed[:, 2] // 32 == 1).all())
    with pytest.raises(ValueError, match="multiple of 16"):
        weight_layout.pack_fragment(b[:, :40])
    with pytest.raises(TypeError, match="uint8"):
        weight_layout.pack_fragment(b.to(torch.int16))


def run_quad_warp(rows: list[bytes], scales: list[bytes], fragment_block: bytes | None = None):
    """Every lane's 16 output registers from the quad_scales decode, the 32 lanes in lockstep
    (its shuffles): rows 0 .. 15 of a 64-wide k-tile (32 packed bytes each, or fragment_block:
    the same rows in the fragment layout) and each row's 4 scale bytes; lane (g, t) reads rows g
    and g+8 and its own pair of scale bytes (ptx.quad_pair_offset)."""
    shared = {}
    packed = fragment_block if fragment_block is not None else b"".join(rows)
    shared.update({0x1000 + i: b for i, b in enumerate(packed)})
    shared.update({0x3000 + 4 * r + i: b for r, row_scales in enumerate(scales) for i, b in enumerate(row_scales)})
    operands_by_lane = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        row_offset, byte_offset = ptx.quad_pair_offset(t)
        pair_address = 0x3000 + 4 * (g + row_offset) + byte_offset
        if fragment_block is not None:
            inputs = (0x1000 + 16 * lane, 0x1000 + 16 * lane, 0, pair_address)
        else:
            inputs = (0x1000 + 32 * g, 0x1000 + 32 * (g + 8), ptx.bf16_word_selector(t), pair_address)
        operands_by_lane.append({16 + i: v for i, v in enumerate(inputs)})
    warp = Warp(operands_by_lane, shared)
    warp.run(ptx._decode_bf16_registers_asm(1, fragment=fragment_block is not None, quad_scales=True))
    return [[thread.registers[f"${i}"] for i in range(16)] for thread in warp.threads]


@pytest.mark.parametrize("layout", ["plain", "fragment"])
@pytest.mark.parametrize("seed", range(4))
def test_the_quads_shared_scales_decode_every_lane_bit_for_bit(seed, layout):
    """quad_scales: each lane converts one pair of its quad's scales and four shuffles share
    them; every lane's every register is still its natural-order element times its own row's
    block scale and 2^-8, bit for bit (sign of zero included), for every g and t, with the
    scales of rows g and g+8 different in every block (a pair taken from the wrong lane, row or
    half shows)."""
    from nvfp4_group_gemm import weight_layout

    rng = np.random.default_rng(70 + seed)
    plain = torch.from_numpy(rng.integers(0, 256, (16, 32), dtype=np.uint8))
    rows = [bytes(plain[r].tolist()) for r in range(16)]
    scale_choices = SCALE_BYTES + [0x09, 0x30, 0x7D, 0xFE]
    scales = [bytes(rng.choice(scale_choices, 4, replace=False).tolist()) for _ in range(16)]
    block = bytes(weight_layout.pack_fragment(plain).reshape(-1).tolist()) if layout == "fragment" else None
    registers_by_lane = run_quad_warp(rows, scales, block)
    for lane, registers in enumerate(registers_by_lane):
        g, t = lane // 4, lane % 4
        assert_lane_registers(registers, (rows[g], rows[g + 8]), (scales[g], scales[g + 8]), t, lane)


def test_the_quads_shared_scales_take_every_scale_byte_exactly():
    """Every e4m3 byte but NaN as a block scale under quad_scales, each row's four blocks
    different: every register v * s * 2^-8 exactly."""
    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    row = bytes(range(7, 7 + 32))
    rows = [row[r:] + row[:r] for r in range(16)]
    for start in range(0, len(finite), 64):
        chunk = finite[start:start + 64] + finite[:max(0, start + 64 - len(finite))]
        scales = [bytes(chunk[4 * r:4 * r + 4]) for r in range(16)]
        for lane, registers in enumerate(run_quad_warp(rows, scales)):
            g, t = lane // 4, lane % 4
            assert_lane_registers(registers, (rows[g], rows[g + 8]), (scales[g], scales[g + 8]), t, (start, lane))
