"""W4A16's weights packed for the fragment: the e2m1 codes of b [G, N, K/2] (uint8, low code
first) rearranged once, at load, so that the sm_90 W4A16 GEMM's decode reads each lane's
register-A fragments of four k16 steps with one 16-byte shared load and places each step's 8
codes as bf16 with 11 integer instructions, where the plain layout takes two 8-byte loads per
row and 20 (docs/TUNING.md, "triton_kernels' Hopper layout is that packing"). The same bytes and
the same scales; only their places change.

    packed = pack_fragment(b)      # b_layout="fragment" in moe_grouped_gemm (W4A16 only)
    b = unpack_fragment(packed)    # what the exact decode reads

Layout. Each block of 16 rows (a warp's rows of wgmma's m64 tile) x 32 bytes (64 K: one half
k-tile) stays in place and is rearranged inside: lane l = 4 g + t of the warp owns bytes
16 l .. 16 l + 15 of the block (row l // 2, bytes 16 (l % 2) ..), 4 bytes per k16 step s in
the fragment's register order, R0 = row g at k-byte 8 s + t, R1 = row g + 8 at the same, R2 =
row g at 8 s + t + 4, R3 = row g + 8 at the same. Inside each such word the bits move (as
triton_kernels' `_pack_bits`): byte j < 3's two codes are placed as bf16 halves (sign at bit 15,
e1 e0 m at bits 8..6 of each half, the low code in the low half) and shifted right by 3 j;
byte 3's codes fill the bits left (sign 14, m 13, e1 e0 11..10). Register j of the word is then
(w << 3 j) & 0x81C081C0 for j < 3, and ((w << 1) & 0x80008000) | ((w >> 3) & 0x01800180) |
((w >> 7) & 0x00400040) for j = 3: each code's value x 2^-126 as bf16 (hopper/ptx.py, the
plain decode's placement, the same bits).
"""

from __future__ import annotations

import torch

PLAIN = "plain"
FRAGMENT = "fragment"
WEIGHT_LAYOUTS = (PLAIN, FRAGMENT)
BLOCK_ROWS = 16  # a warp's rows of the m64 tile
BLOCK_BYTES = 32  # a row's bytes of a 64-wide half k-tile
PLACE_MASK = 0x81C081C0


# packed e2m1 as the entry takes it: bytes, or torch's two-codes-a-byte type where it has one
PACKED_DTYPES = (torch.uint8,) + ((torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ())


def _check(b: torch.Tensor, what: str) -> None:
    if not isinstance(b, torch.Tensor) or b.dtype not in PACKED_DTYPES or b.dim() < 2:
        raise TypeError(f"{what}: b {getattr(b, 'dtype', type(b).__name__)} {tuple(getattr(b, 'shape', ()))}: must be "
                        "uint8 or float4_e2m1fn_x2 [..., N, K/2] (packed e2m1)")
    n, k_bytes = b.shape[-2:]
    if n % BLOCK_ROWS or k_bytes % BLOCK_BYTES:
        raise ValueError(f"{what}: b's [N, K/2] = [{n}, {k_bytes}]: N must be a multiple of {BLOCK_ROWS} and K of "
                         f"{2 * BLOCK_BYTES} (the fragment's blocks of {BLOCK_ROWS} rows x 64 K)")


def _plain_to_lanes(b: torch.Tensor) -> torch.Tensor:
    """A plain [..., N, K/2] -> [..., N/16, K/64, 512]: each block's bytes in lane order (lane,
    step, register), before the bit moves."""
    *lead, n, k_bytes = b.shape
    # rows r = 8 rh + g; a half's 32 bytes = 8 s + 4 kh + t
    x = b.reshape(*lead, n // 16, 2, 8, k_bytes // 32, 4, 2, 4)
    d = len(lead)
    # -> [..., block, half, g, t, s, kh, rh]: register j = 2 kh + rh
    x = x.permute(*range(d), d, d + 3, d + 2, d + 6, d + 4, d + 5, d + 1)
    return x.reshape(*lead, n // 16, k_bytes // 32, 512)


def _lanes_to_plain(x: torch.Tensor, n: int, k_bytes: int) -> torch.Tensor:
    """The inverse of _plain_to_lanes."""
    *lead, _, _, _ = x.shape
    d = len(lead)
    x = x.reshape(*lead, n // 16, k_bytes // 32, 8, 4, 4, 2, 2)  # block, half, g, t, s, kh, rh
    x = x.permute(*range(d), d, d + 6, d + 2, d + 1, d + 4, d + 5, d + 3)  # block, rh, g, half, s, kh, t
    return x.reshape(*lead, n, k_bytes)


def _per_matrix(convert, b: torch.Tensor) -> torch.Tensor:
    """`convert` applied to each [N, K/2] matrix of b (an expert) in turn, into one new tensor;
    copied as bytes (torch copies no float4 on some devices)."""
    source = b.view(torch.uint8)
    out = torch.empty_like(source)
    for index in range(source.shape[0]):
        out[index] = convert(source[index])
    return out.view(b.dtype)


def _place(code: torch.Tensor) -> torch.Tensor:
    return ((code & 8) << 12) | ((code & 7) << 6)


def _place_fourth(code: torch.Tensor) -> torch.Tensor:
    return ((code & 8) << 11) | ((code & 6) << 9) | ((code & 1) << 13)


def pack_fragment(b: torch.Tensor) -> torch.Tensor:
    """b [..., N, K/2] (packed e2m1) in the fragment layout (module docstring): a new tensor of
    the same shape, dtype and device. Packed one [N, K/2] matrix (an expert) at a time: the
    working copies (int64) are 8x one expert's bytes, not the layer's."""
    _check(b, "pack_fragment")
    if b.dim() > 2:
        return _per_matrix(pack_fragment, b)
    dtype, b = b.dtype, b.view(torch.uint8)
    n, k_bytes = b.shape[-2:]
    lanes = _plain_to_lanes(b).to(torch.int64)
    bytes_ = lanes.reshape(*lanes.shape[:-1], 128, 4)
    low, high = bytes_ & 15, bytes_ >> 4
    word = torch.zeros(bytes_.shape[:-1], dtype=torch.int64, device=b.device)
    for j in range(3):
        word |= (_place(low[..., j]) | (_place(high[..., j]) << 16)) >> (3 * j)
    word |= _place_fourth(low[..., 3]) | (_place_fourth(high[..., 3]) << 16)
    shifts = torch.arange(0, 32, 8, device=b.device)
    packed = ((word[..., None] >> shifts) & 0xFF).to(torch.uint8).reshape(lanes.shape)
    return _blocks_to_physical(packed, n, k_bytes).view(dtype)


def _codes(register: torch.Tensor) -> torch.Tensor:
    """The byte of a placed register: its low half's code low, its high half's high."""
    low = (((register >> 15) & 1) << 3) | ((register >> 6) & 7)
    high = (((register >> 31) & 1) << 3) | ((register >> 22) & 7)
    return low | (high << 4)


def unpack_fragment(b: torch.Tensor) -> torch.Tensor:
    """The plain b [..., N, K/2] of a fragment-layout one (the inverse of pack_fragment)."""
    _check(b, "unpack_fragment")
    if b.dim() > 2:
        return _per_matrix(unpack_fragment, b)
    dtype, b = b.dtype, b.view(torch.uint8)
    n, k_bytes = b.shape[-2:]
    lanes = _physical_to_blocks(b)
    shifts = torch.arange(0, 32, 8, device=b.device)
    word = (lanes.to(torch.int64).reshape(*lanes.shape[:-1], 128, 4) << shifts).sum(-1)
    registers = [(word << (3 * j)) & PLACE_MASK for j in range(3)]
    registers.append(((word << 1) & 0x80008000) | ((word >> 3) & 0x01800180) | ((word >> 7) & 0x00400040))
    bytes_ = torch.stack([_codes(r) for r in registers], dim=-1).to(torch.uint8)
    return _lanes_to_plain(bytes_.reshape(lanes.shape), n, k_bytes).contiguous().view(dtype)


def _physical_to_blocks(b: torch.Tensor) -> torch.Tensor:
    """A packed [..., N, K/2] as its blocks' 512 bytes each, in the order they sit: the block's
    16 rows of 32 bytes one after the other, so lane l's 16 bytes at 16 l (row l // 2)."""
    *lead, n, k_bytes = b.shape
    d = len(lead)
    x = b.reshape(*lead, n // 16, 16, k_bytes // 32, 32).permute(*range(d), d, d + 2, d + 1, d + 3)
    return x.reshape(*lead, n // 16, k_bytes // 32, 512)


def _blocks_to_physical(x: torch.Tensor, n: int, k_bytes: int) -> torch.Tensor:
    """The inverse of _physical_to_blocks."""
    *lead, _, _, _ = x.shape
    d = len(lead)
    x = x.reshape(*lead, n // 16, k_bytes // 32, 16, 32).permute(*range(d), d, d + 2, d + 1, d + 3)
    return x.reshape(*lead, n, k_bytes).contiguous()
