"""How few instructions could place a W4A16 lane's 8 e2m1 codes as bf16, if the weights were
packed for the fragment at load (docs/TUNING.md, the small-batch decode): a search, on the host.

The bf16 placement of a register pair (hopper/ptx.py) wants each code's sign at bit 15 (31) and
its magnitude bits e1 e0 m at bits 8..6 (24..22): the mask 0x81C081C0. A packed word holds the
lane's 8 codes of a block (4 register pairs) in bit positions of our choosing; each pair is then
some instruction sequence on the word, and the mask. The search takes sequences of at most two
of shl, shr, a rotate (shf.r.wrap of the word with itself) and a byte permute (prmt of the word),
then the mask, and finds the cheapest 4 of them whose source bits partition the word's 32 (each
code bit read once). Today's decode from the checkpoint's layout takes 20 instructions per word
(three prmt building it, a shift, then a prmt, two shifts and a lop3 per pair).

    python bench/decode_search.py

Prints the cheapest packings, each as its 4 sequences (applied right to left) and its total
instruction count.
"""

from __future__ import annotations

import functools
import itertools

BF16_PAIR_BITS = (6, 7, 8, 15, 22, 23, 24, 31)  # hopper.ptx.BF16_LANES' bits, low to high


@functools.cache
def single_ops() -> dict:
    """Each one-instruction operation on a 32-bit word as out_bit -> in_bit (None: a zero bit)."""
    ops = {}
    for d in range(1, 32):
        ops[("rot", d)] = lambda i, d=d: (i + d) % 32
        ops[("shr", d)] = lambda i, d=d: i + d if i + d < 32 else None
        ops[("shl", d)] = lambda i, d=d: i - d if i - d >= 0 else None
    for selector in itertools.product(range(4), repeat=4):
        if selector != (0, 1, 2, 3):
            ops[("prmt", selector)] = lambda i, s=selector: 8 * s[i // 8] + i % 8
    return ops


def source_bits(sequence: tuple) -> frozenset | None:
    """The word bits a sequence (operations applied right to left, then the mask) reads into the
    pair's 8 bits, or None where one would be a zero or read twice."""
    ops = single_ops()
    bits = []
    for out in BF16_PAIR_BITS:
        bit = out
        for op in sequence:
            bit = ops[op](bit)
            if bit is None:
                return None
        bits.append(bit)
    return frozenset(bits) if len(set(bits)) == 8 else None


def candidates(max_ops: int = 2) -> dict:
    """Source bit sets -> (instructions, the cheapest sequence): the mask alone counts one."""
    ops = list(single_ops())
    found = {}
    for length in range(max_ops + 1):
        for sequence in itertools.product(ops, repeat=length):
            if length == 2 and sequence[0][0] == sequence[1][0] == "prmt":
                continue  # two permutes are one
            bits = source_bits(sequence)
            if bits is not None and bits not in found:
                found[bits] = (length + 1, sequence)
    return found


def packings(max_ops: int = 2, limit: int = 5) -> list[tuple[int, list]]:
    """The cheapest ways to cover all 32 bits of a word with 4 register pairs' source bits."""
    sets = list(candidates(max_ops).items())
    by_bit = {}
    for index, (bits, _) in enumerate(sets):
        for bit in bits:
            by_bit.setdefault(bit, []).append(index)
    everything = frozenset(range(32))
    results = []

    def extend(used: frozenset, chosen: list) -> None:
        if len(chosen) == 4:
            if used == everything:
                results.append((sum(sets[i][1][0] for i in chosen), [sets[i][1][1] for i in chosen]))
            return
        for index in by_bit.get(min(everything - used), []):
            if not sets[index][0] & used:
                extend(used | sets[index][0], chosen + [index])

    extend(frozenset(), [])
    results.sort(key=lambda result: result[0])
    return results[:limit]


# triton_kernels' packing (v3.6.0 `tensor_details/layout_details/hopper_value.py`, `_pack_bits`
# and `_unpack_fp4_to_bf16_triton`), one instance the search's count allows: a word holds the 4
# bytes of a lane's fragment (R0 .. R3: rows g and g+8 at k-bytes t and t + 4, each byte's low
# code the first), byte j's two codes placed as byte 0's are, then shifted right by 3 j for j < 3;
# byte 3's bits fill the rest. Register j is (word << 3 j) & mask for j < 3, and three shifted and
# masked copies or-ed for j = 3: 11 integer instructions (the ors fold into lop3s)
FRAGMENT_MASK = 0x81C081C0


def _place_code(code: int) -> int:
    """A code's bf16 placement in one half: sign at bit 15, e1 e0 m at bits 8..6."""
    return ((code & 8) << 12) | ((code & 7) << 6)


def _place_fourth(code: int) -> int:
    """Byte 3's code in the bits the other three leave: sign 14, e1 e0 at 11..10, m at 13."""
    return ((code & 8) << 11) | ((code & 6) << 9) | ((code & 1) << 13)


def fragment_pack(fragment: bytes) -> int:
    """The packed word of a lane's 4 fragment bytes (R0 .. R3 order)."""
    word = 0
    for j, byte in enumerate(fragment):
        low, high = byte & 15, byte >> 4
        if j < 3:
            word |= ((_place_code(low) | _place_code(high) << 16) >> (3 * j))
        else:
            word |= _place_fourth(low) | _place_fourth(high) << 16
    return word


def fragment_place(word: int) -> list[int]:
    """The 4 bf16x2 registers of a packed word (each code's value x 2^-126 as bf16 bits), as the
    11 instructions compute them."""
    shifted = [word, (word << 3) & 0xFFFFFFFF, (word << 6) & 0xFFFFFFFF]
    registers = [value & FRAGMENT_MASK for value in shifted]
    registers.append((((word << 1) & 0xFFFFFFFF) & 0x80008000) | ((word >> 3) & 0x01800180)
                     | ((word >> 7) & 0x00400040))
    return registers


FRAGMENT_PLACE_INSTRUCTIONS = 11  # and; shl, and; shl, and; shl, shr, shr, 3 and, 2 or -> 6 lop3 + 5 shifts


def main() -> None:
    best = packings()
    print(f"packings found: {len(best)} shown; per word of 8 codes (the placement's mask included):")
    for cost, sequences in best:
        print(f"  {cost} instructions: " + "; ".join(" . ".join(f"{op}{arg}" for op, arg in seq) or "mask"
                                                     for seq in sequences))
    print(f"triton_kernels' Hopper packing (fragment_pack / fragment_place): {FRAGMENT_PLACE_INSTRUCTIONS} "
          "instructions a word, the search's count")


if __name__ == "__main__":
    main()
