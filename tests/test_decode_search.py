"""bench/decode_search.py's claim (docs/TUNING.md): with the weights packed for the fragment, 11
instructions place a word's 8 codes as 4 bf16 register pairs, where the checkpoint's layout takes
20; and each packing it prints does place every code bit, run on words as the GPU would."""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import decode_search

MASK32 = 0xFFFFFFFF


def apply(op, word: int) -> int:
    kind, arg = op
    if kind == "rot":
        return ((word >> arg) | (word << (32 - arg))) & MASK32
    if kind == "shr":
        return word >> arg
    if kind == "shl":
        return (word << arg) & MASK32
    return sum(((word >> (8 * source)) & 0xFF) << (8 * byte) for byte, source in enumerate(arg))  # prmt


def test_the_cheapest_packings_take_11_instructions_and_place_every_bit():
    best = decode_search.packings(limit=3)
    assert best and all(cost == 11 for cost, _ in best)
    mask = sum(1 << bit for bit in decode_search.BF16_PAIR_BITS)
    rng = random.Random(0)
    ops = decode_search.single_ops()
    for _, sequences in best:
        sources = [decode_search.source_bits(tuple(seq)) for seq in sequences]
        assert frozenset().union(*sources) == frozenset(range(32)) and sum(map(len, sources)) == 32
        for _ in range(50):
            word = rng.getrandbits(32)
            for seq in sequences:
                placed = word
                for op in reversed(seq):  # right to left
                    placed = apply(op, placed)
                placed &= mask
                # each output bit is the word's bit the search says it reads
                for out in decode_search.BF16_PAIR_BITS:
                    source = out
                    for op in seq:
                        source = ops[op](source)
                    assert (placed >> out) & 1 == (word >> source) & 1, (seq, out)


def test_no_packing_takes_two_instructions_a_pair():
    """A shift, rotate or permute and the mask for every pair (8 a word) covers no word: some pair
    needs a third instruction."""
    assert not [p for p in decode_search.packings(max_ops=1, limit=1)]


def test_triton_kernels_packing_places_every_code_of_every_fragment_byte():
    """fragment_pack then fragment_place gives each fragment byte's two codes as bf16 bits of
    value x 2^-126 (low code in the low half), every byte value in every place of the word, the
    other bytes random; and the four registers read disjoint bits that cover the word."""
    import torch

    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

    def bf16(bits: int) -> float:
        return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().item()

    rng = random.Random(1)
    for place in range(4):
        for byte in range(256):
            fragment = [rng.randrange(256) for _ in range(4)]
            fragment[place] = byte
            registers = decode_search.fragment_place(decode_search.fragment_pack(bytes(fragment)))
            for j, register in enumerate(registers):
                for half, code in enumerate((fragment[j] & 15, fragment[j] >> 4)):
                    bits = (register >> (16 * half)) & 0xFFFF
                    expected = (-1.0 if code & 8 else 1.0) * values[code & 7]
                    assert bf16(bits - 65536 if bits >= 32768 else bits) * 2.0**126 == expected, (place, byte, j)
    # the registers' source bits: one word bit each
    probes = [decode_search.fragment_place(1 << bit) for bit in range(32)]
    assert all(sum(r.bit_count() for r in registers) == 1 for registers in probes)
    assert decode_search.FRAGMENT_PLACE_INSTRUCTIONS == min(cost for cost, _ in decode_search.packings(limit=1))
