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


def main() -> None:
    best = packings()
    print(f"packings found: {len(best)} shown; per word of 8 codes (the placement's mask included):")
    for cost, sequences in best:
        print(f"  {cost} instructions: " + "; ".join(" . ".join(f"{op}{arg}" for op, arg in seq) or "mask"
                                                     for seq in sequences))


if __name__ == "__main__":
    main()
