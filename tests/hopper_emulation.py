"""Host mirrors of the sm_90a kernel's arithmetic (nvfp4_group_gemm.hopper), for the tests: the decode's
bit placement and scaling, and the scale and swizzle addressing. The tests compare them with
independent decodes (reference.py, torch's e4m3) and layouts (the reordered scale tensors).
"""

import numpy as np

from nvfp4_group_gemm.hopper import (
    REGISTER_ELEMENTS,
    SF_ATOM_BYTES,
    SF_ATOM_ROWS,
    stage_scale_offset,
)


def emulate_word_registers(word: int) -> dict:
    """Mirror of nvfp4_group_gemm.hopper.ptx._place_word_ptx: register name -> its 32-bit pattern (two fp16 lanes)."""
    mask32 = 0xFFFFFFFF
    x = word & 0x0F0F0F0F
    o = word & 0xF0F0F0F0
    lanes = 0x8E008E00
    pairs = {
        "e02": ((x * 4096) & mask32, (x * 512) & mask32),
        "e13": ((x * 16) & mask32, (x * 2) & mask32),
        "o02": ((o * 256) & mask32, (o * 32) & mask32),
        "o13": (o, o >> 3),
    }
    return {name: (a | b) & lanes for name, (a, b) in pairs.items()}


def emulate_decode_word(word: int, scale_byte: int):
    """Mirror of the decode of one packed word: 8 e2m1 codes -> 8 float16 (numpy), put back
    in element order through REGISTER_ELEMENTS.

    Returns (placed, scaled): the fp16 values after the bit placement (v * 2^-14) and after
    the multiply by the block's scale (v * s * 2^-14), in element order.
    """
    placed = np.zeros(8, dtype=np.float16)
    for name, bits in emulate_word_registers(word).items():
        lanes = np.array([bits & 0xFFFF, bits >> 16], dtype=np.uint16).view(np.float16)
        for lane, element in enumerate(REGISTER_ELEMENTS[name]):
            placed[element] = lanes[lane]
    scale = np.float16(e4m3_value(scale_byte))
    return placed, (placed * scale).astype(np.float16)


def e4m3_value(byte: int) -> float:
    """The value of an e4m3 (fn) byte, decoded by hand (0x7F and 0xFF, NaN, excluded)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def scale_byte_offset(row: int, block: int, k_tile: int, rest_k: int) -> int:
    """Byte offset in a reordered scale tensor of (row, 16-element block of k-tile k_tile),
    computed as the kernel does: 512-byte atom of (row // 128, k_tile), then the in-atom
    offset used by decode_stage."""
    atom = (row // SF_ATOM_ROWS) * rest_k + k_tile
    return atom * SF_ATOM_BYTES + (row % 32) * 16 + ((row % SF_ATOM_ROWS) // 32) * 4 + block


def tile_scale_byte_offset(tile_start: int, row: int, block: int, k_tile: int, rest_k: int) -> int:
    """Byte offset in a reordered scale tensor of the scale the kernel reads for row `row` of
    the tile starting at row `tile_start` (a multiple of 128), 16-element block `block` of
    k-tile `k_tile`: load_raw_stage copies atom (tile_start // 128 + slot, k_tile) into atom
    slot `slot` of the stage, decode_stage reads stage_scale_offset."""
    in_stage = stage_scale_offset(row, block)
    slot, in_atom = divmod(in_stage, SF_ATOM_BYTES)
    return ((tile_start // SF_ATOM_ROWS + slot) * rest_k + k_tile) * SF_ATOM_BYTES + in_atom


def swizzled_chunk_offset(row: int, chunk: int) -> int:
    """Byte offset of 16-byte chunk `chunk` of fp16 row `row` in the 128-byte-swizzled tile."""
    return row * 128 + ((chunk ^ (row % 8)) * 16)

