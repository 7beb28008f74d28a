"""Tests of the sm_90a backend (nvfp4_hopper.py).

CPU: the decode bit arithmetic, the scale and swizzle addressing, shape checks, and an
sm_90a build. CUDA on an sm_90 GPU: the kernel against the exact decode reference.
"""

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nvfp4_hopper as hopper
from reference import (
    E2M1_VALUES,
    create_reordered_scale_factor_tensor,
    decoded_group_gemm,
    generate_input,
    match_outputs,
)

FINITE_E4M3 = [b for b in range(256) if b & 0x7F != 0x7F]  # 0x7F / 0xFF are NaN


def _e4m3_reference(byte: int) -> float:
    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()


# ---------------------------------------------------------------------------------------
# CPU: decode arithmetic
# ---------------------------------------------------------------------------------------
def test_e4m3_host_decode_matches_torch():
    for byte in FINITE_E4M3:
        assert hopper._e4m3_value(byte) == _e4m3_reference(byte), hex(byte)


def test_placed_bits_are_value_times_2_pow_minus_14():
    # every nibble in every position: words with 8 equal nibbles, plus mixed words
    words = [int(f"{c:x}" * 8, 16) for c in range(16)] + [0x76543210, 0xFEDCBA98, 0x1F2E3D4C]
    for word in words:
        placed, _ = hopper.emulate_decode_word(word, 0x38)
        expected = [E2M1_VALUES[(word >> (4 * i)) & 0xF] * 2.0**-14 for i in range(8)]
        assert placed.astype(np.float64).tolist() == expected, hex(word)
        signs = [(word >> (4 * i + 3)) & 1 for i in range(8)]
        assert [int(np.signbit(x)) for x in placed] == signs, hex(word)


@pytest.mark.parametrize("scale_byte", FINITE_E4M3)
def test_decode_is_exact_for_every_code_and_finite_scale(scale_byte):
    scale = _e4m3_reference(scale_byte)
    word = 0x76543210  # codes 0..7 (+0 .. +6)
    for sign_word in (word, word | 0x88888888):
        _, scaled = hopper.emulate_decode_word(sign_word, scale_byte)
        expected = [E2M1_VALUES[(sign_word >> (4 * i)) & 0xF] * scale for i in range(8)]
        assert scaled.astype(np.float64).tolist() == expected


# ---------------------------------------------------------------------------------------
# CPU: addressing
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mn,k", [(40, 256), (128, 512), (200, 768), (384, 1536)])
def test_scale_offsets_match_the_reordered_layout(mn, k):
    gen = torch.Generator().manual_seed(mn * 7 + k)
    sf_bytes = torch.randint(0, 0x7F, (mn, k // 16, 1), dtype=torch.uint8, generator=gen)
    sf = sf_bytes.view(torch.float8_e4m3fn)
    reordered = create_reordered_scale_factor_tensor(1, mn, k, sf, device="cpu")
    # the kernel reads the memory of the permuted view as a flat byte buffer
    storage = reordered.permute(5, 2, 4, 0, 1, 3).contiguous().view(torch.uint8).flatten()
    assert reordered.permute(5, 2, 4, 0, 1, 3).is_contiguous()
    rest_k = k // 64
    for row in range(mn):
        for j in range(k // 16):
            offset = hopper.scale_byte_offset(row, j % 4, j // 4, rest_k)
            assert storage[offset].item() == sf_bytes[row, j, 0].item(), (row, j)


def test_swizzle_is_a_permutation_of_16_byte_chunks_per_8_rows():
    offsets = {hopper.swizzled_chunk_offset(r, c) for r in range(8) for c in range(8)}
    assert offsets == {16 * i for i in range(64)}
    # row r, chunk c lands in the chunk slot c ^ (r % 8) of its 128-byte row
    assert hopper.swizzled_chunk_offset(9, 2) == 9 * 128 + (2 ^ 1) * 16


def test_k_permutation_is_the_same_bijection_for_a_fragments_and_b_stores():
    """Register-A mode: lane t's fragment registers (A) and the reordered chunk stores (B)
    give every packed element of a 64-wide k-tile the same logical column, once, and each
    k16 step reads one scale block (exactness: one scale pair per step)."""
    a_logical = {}
    for t in range(4):  # lane % 4 takes packed bytes 2t, 2t+1 of every block
        for step in range(4):
            for h in range(2):  # registers 0/1 (h = 0): cols 2t, 2t+1; 2/3: 2t+8, 2t+9
                for j in range(2):
                    physical = 16 * step + 4 * t + 2 * h + j
                    a_logical[physical] = 16 * step + 8 * h + 2 * t + j
    b_logical = {}
    for blk in range(4):
        # the asm's "k_permuted" stores: first chunk {r0, r2, r4, r6}, second {r1, r3, r5, r7}
        asm = hopper._decode_blocks_asm(1, True, "k_permuted")
        stores = [line for line in asm.splitlines() if "st.shared.v4" in line]
        for chunk_in_block, line in enumerate(stores):
            regs = line.split("{")[1].split("}")[0].replace(" ", "").split(",")
            for word, reg in enumerate(regs):
                pair = int(reg.split("_")[1])
                for j in range(2):
                    logical = 8 * (2 * blk + chunk_in_block) + 2 * word + j
                    b_logical[16 * blk + 2 * pair + j] = logical
    assert sorted(a_logical.values()) == list(range(64))
    assert b_logical == a_logical
    for physical, logical in a_logical.items():
        assert physical // 16 == logical // 16  # same scale block as the k16 step


def test_can_implement_names_group_field_and_rule():
    hopper.can_implement([(40, 128, 256, 1), (0, 4096, 7168, 1)])
    with pytest.raises(ValueError, match=r"group 1: K = 320.*multiple of 256"):
        hopper.can_implement([(40, 128, 256, 1), (40, 128, 320, 1)])
    with pytest.raises(ValueError, match=r"group 0: N = 200.*multiple of 128"):
        hopper.can_implement([(40, 200, 256, 1)])
    with pytest.raises(ValueError, match=r"G = 65"):
        hopper.can_implement([(1, 128, 256, 1)] * 65)


@pytest.mark.parametrize("config", [
    hopper.SM90_CONFIG,
    hopper.HopperGemmConfig(a_in_registers=False),
    hopper.HopperGemmConfig(a_in_registers=True, a_register_buffers=2),
])
def test_compiles_for_sm90a_on_any_machine(config):
    compiled = hopper.compile_gemm(3, options="--gpu-arch sm_90a", config=config)
    assert compiled is not None
    names = [name for name, arch, _ in hopper.compile_targets() if arch == "sm_90a"]
    assert names == ["sm90_nvfp4_gemm"]


# ---------------------------------------------------------------------------------------
# CUDA (sm_90): kernel vs the exact reference
# ---------------------------------------------------------------------------------------
def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 (Hopper) GPU")


def _random_group_set(seed: int, general_scales: bool):
    """Random groups: G 1..16, M 0..512, N in 128..1024, K in 256..2048; full-range fp4
    codes; scales 1/2 (competition) or any finite e4m3 up to 3.75 (exactness check)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    g = rng.randint(1, 16)
    abc, sfs, sfs_reordered, sizes = [], [], [], []
    for _ in range(g):
        m = rng.choice([0, 1, rng.randint(1, 512), rng.randint(1, 512)])
        n = 128 * rng.randint(1, 8)
        k = 256 * rng.randint(1, 8)
        a = torch.randint(0, 256, (m, k // 2, 1), dtype=torch.uint8, device="cuda")
        b = torch.randint(0, 256, (n, k // 2, 1), dtype=torch.uint8, device="cuda")
        if general_scales:
            # e4m3 bytes 0x00..0x46: zero, subnormals, normals up to 3.5
            sfa = torch.randint(0, 0x47, (m, k // 16, 1), dtype=torch.uint8)
            sfb = torch.randint(0, 0x47, (n, k // 16, 1), dtype=torch.uint8)
        else:
            sfa = torch.randint(1, 3, (m, k // 16, 1), dtype=torch.int8).to(torch.float8_e4m3fn).view(torch.uint8)
            sfb = torch.randint(1, 3, (n, k // 16, 1), dtype=torch.int8).to(torch.float8_e4m3fn).view(torch.uint8)
        sfa = sfa.view(torch.float8_e4m3fn)
        sfb = sfb.view(torch.float8_e4m3fn)
        c = torch.full((m, n, 1), float("nan"), dtype=torch.float16, device="cuda")
        abc.append((a.view(torch.float4_e2m1fn_x2), b.view(torch.float4_e2m1fn_x2), c))
        sfs.append((sfa, sfb))
        sfs_reordered.append((
            create_reordered_scale_factor_tensor(1, m, k, sfa, device="cuda"),
            create_reordered_scale_factor_tensor(1, n, k, sfb, device="cuda"),
        ))
        sizes.append((m, n, k, 1))
    return abc, sfs, sfs_reordered, sizes


def _exact_reference(data):
    abc, sfs, _, _ = data
    out = []
    for (a, b, _c), (sfa, sfb) in zip(abc, sfs):
        res = decoded_group_gemm(a[:, :, 0], b[:, :, 0], sfa[:, :, 0], sfb[:, :, 0],
                                 accumulate_dtype=torch.float64)
        out.append(res.to(torch.float16).unsqueeze(-1))
    return out


CONFIG_CASES = (
    [("default", seed) for seed in range(60)]
    + [("smem_a", seed) for seed in range(300, 324)]
    + [("registers_a_2buf", seed) for seed in range(400, 424)]
    + [("two_multiplies", seed) for seed in range(100, 108)]
    + [("tile_n_256", seed) for seed in range(200, 208)]
)
CONFIGS = {
    "default": hopper.SM90_CONFIG,
    "smem_a": hopper.HopperGemmConfig(a_in_registers=False),
    "registers_a_2buf": hopper.HopperGemmConfig(a_in_registers=True, a_register_buffers=2),
    "two_multiplies": hopper.HopperGemmConfig(single_multiply=False, a_in_registers=False),
    "tile_n_256": hopper.HopperGemmConfig(tile_n=256, a_in_registers=False),
}


@requires_sm90
@pytest.mark.parametrize("config_name,seed", CONFIG_CASES)
def test_random_group_sets_match_exact_reference(config_name, seed):
    data = _random_group_set(seed, general_scales=seed % 3 == 2)
    out = hopper.run_grouped(data, config=CONFIGS[config_name])
    torch.cuda.synchronize()
    for i, c in enumerate(out):
        assert not torch.isnan(c).any(), f"group {i}: unwritten (NaN) outputs, sizes {data[3][i]}"
    ok, message = match_outputs(_exact_reference(data), out)
    assert ok, f"seed {seed} sizes {data[3]}: {message}"


@requires_sm90
@pytest.mark.parametrize("case", ["bench0", "bench1", "bench2", "bench3"])
def test_benchmark_shapes_match_exact_reference(case):
    shapes = {
        "bench0": ([80, 176, 128, 72, 64, 248, 96, 160], [4096] * 8, [7168] * 8),
        "bench1": ([40, 76, 168, 72, 164, 148, 196, 160], [7168] * 8, [2048] * 8),
        "bench2": ([192, 320], [3072] * 2, [4096] * 2),
        "bench3": ([128, 384], [4096] * 2, [1536] * 2),
    }
    m, n, k = shapes[case]
    data = generate_input(tuple(m), tuple(n), tuple(k), len(m), seed=1111)
    for _, _, c in data[0]:
        c.fill_(float("nan"))
    out = hopper.run_grouped(data)
    torch.cuda.synchronize()
    ok, message = match_outputs(_exact_reference(data), out)
    assert ok, message
