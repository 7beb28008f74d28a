"""Tests of the sm_90a backend (the nvfp4_group_gemm.hopper package).

CPU: the decode bit arithmetic and the scale and swizzle addressing (through the host mirrors
in hopper_emulation.py), shape checks, the schedules and the automatic choice, and sm_90a
builds. CUDA on an sm_90 GPU: the kernel against the exact decode reference.
"""

import contextlib
import dataclasses
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import BENCHMARK_SIZES
from hopper_emulation import (
    e4m3_value,
    emulate_decode_word,
    emulate_word_registers,
    scale_byte_offset,
    swizzled_chunk_offset,
    tile_scale_byte_offset,
)

import build_report
from nvfp4_group_gemm import core as submission
from nvfp4_group_gemm import hopper, launch, runtime
from reference import (
    E2M1_VALUES,
    create_reordered_scale_factor_tensor,
    decode_scaled,
    decoded_group_gemm,
    exact_group_gemm,
    fp32_accumulation_bound,
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
        assert e4m3_value(byte) == _e4m3_reference(byte), hex(byte)


def test_placed_bits_are_value_times_2_pow_minus_14():
    # every nibble in every position: words with 8 equal nibbles, plus mixed words
    words = [int(f"{c:x}" * 8, 16) for c in range(16)] + [0x76543210, 0xFEDCBA98, 0x1F2E3D4C]
    for word in words:
        placed, _ = emulate_decode_word(word, 0x38)
        expected = [E2M1_VALUES[(word >> (4 * i)) & 0xF] * 2.0**-14 for i in range(8)]
        assert placed.astype(np.float64).tolist() == expected, hex(word)
        signs = [(word >> (4 * i + 3)) & 1 for i in range(8)]
        assert [int(np.signbit(x)) for x in placed] == signs, hex(word)


@pytest.mark.parametrize("scale_byte", FINITE_E4M3)
def test_decode_is_exact_for_every_code_and_finite_scale(scale_byte):
    scale = _e4m3_reference(scale_byte)
    word = 0x76543210  # codes 0..7 (+0 .. +6)
    for sign_word in (word, word | 0x88888888):
        _, scaled = emulate_decode_word(sign_word, scale_byte)
        # v * s * 2^-14 (the epilogue's 2^28 restores both operands' 2^-14)
        expected = [E2M1_VALUES[(sign_word >> (4 * i)) & 0xF] * scale * 2.0**-14 for i in range(8)]
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
            offset = scale_byte_offset(row, j % 4, j // 4, rest_k)
            assert storage[offset].item() == sf_bytes[row, j, 0].item(), (row, j)


@pytest.mark.parametrize("tile_rows", [128, 256])
@pytest.mark.parametrize("mn,k", [(64, 256), (192, 512), (320, 768), (384, 256)])
def test_tile_scale_offsets_match_the_reordered_layout(tile_rows, mn, k):
    """The scale each tile row reads (load_raw_stage's atoms + decode_stage's in-atom offset)."""
    gen = torch.Generator().manual_seed(mn * 11 + k + tile_rows)
    sf_bytes = torch.randint(0, 0x7F, (mn, k // 16, 1), dtype=torch.uint8, generator=gen)
    reordered = create_reordered_scale_factor_tensor(1, mn, k, sf_bytes.view(torch.float8_e4m3fn), device="cpu")
    storage = reordered.permute(5, 2, 4, 0, 1, 3).contiguous().view(torch.uint8).flatten()
    rest_k = k // 64
    checked = 0
    for tile_start in range(0, mn, tile_rows):
        for row in range(min(tile_rows, mn - tile_start)):
            for j in range(k // 16):
                offset = tile_scale_byte_offset(tile_start, row, j % 4, j // 4, rest_k)
                # inside the atoms load_raw_stage copied for this tile and k-tile
                first_atom = (tile_start // 128) * rest_k + j // 4
                slot = row // 128
                assert (first_atom + slot * rest_k) * 512 <= offset < (first_atom + slot * rest_k + 1) * 512
                assert storage[offset].item() == sf_bytes[tile_start + row, j, 0].item(), (tile_start, row, j)
                checked += 1
    assert checked == mn * (k // 16)


@pytest.mark.parametrize("config", [hopper.SM90_CONFIG, hopper.HopperGemmConfig(tile_n=256)])
def test_emulated_b_stage_decodes_to_the_reference(config):
    """One raw stage of B as load_raw_stage fills it (packed rows at the kernel's raw_b_offset,
    whole scale atoms at its raw_sfb_offset), decoded block by block with decode_stage's scale
    offsets and the decode's bit arithmetic: every B tile of every k-tile equals the
    reference dequantization (N = 384: tile_n = 256 gets a partial tile)."""
    n, k = 384, 512
    rest_k = k // 64
    gen = torch.Generator().manual_seed(config.tile_n)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    sf_bytes = torch.randint(0, 0x47, (n, k // 16, 1), dtype=torch.uint8, generator=gen)
    reordered = create_reordered_scale_factor_tensor(1, n, k, sf_bytes.view(torch.float8_e4m3fn), device="cpu")
    sf_storage = reordered.permute(5, 2, 4, 0, 1, 3).contiguous().view(torch.uint8).flatten().numpy()
    expected = decode_scaled(packed.view(torch.float4_e2m1fn_x2), sf_bytes[:, :, 0].view(torch.float8_e4m3fn))
    kernel = hopper.Sm90Nvfp4GroupedGemm(config, 1)
    row_bytes = kernel.raw_row_bytes
    for n0 in range(0, n, config.tile_n):
        for k_tile in range(rest_k):
            stage = np.zeros(config.raw_stage_bytes, dtype=np.uint8)
            rows = min(config.tile_n, n - n0)  # rows past N stay zero (zero-filled copies)
            b_rows = packed[n0 : n0 + rows, k_tile * row_bytes : (k_tile + 1) * row_bytes]
            stage[kernel.raw_b_offset : kernel.raw_b_offset + rows * row_bytes] = b_rows.flatten().numpy()
            for atom in range(-(-rows // 128)):
                src = ((n0 // 128 + atom) * rest_k + k_tile) * 512
                dst = kernel.raw_sfb_offset + atom * 512
                stage[dst : dst + 512] = sf_storage[src : src + 512]
            assert kernel.raw_sfb_offset + config.sfb_atoms * 512 <= config.raw_stage_bytes
            # logical (K-permuted) columns, as the chunk stores lay them out
            decoded = np.zeros((rows, config.tile_k), dtype=np.float64)
            for row in range(rows):
                for blk in range(4):
                    src = kernel.raw_b_offset + row * row_bytes + blk * 8
                    words = stage[src : src + 8].view("<u4")
                    scale = stage[kernel.raw_sfb_offset + hopper.stage_scale_offset(row, blk)]
                    chunks = _emulated_chunks([int(w) for w in words], int(scale))
                    decoded[row, 16 * blk : 16 * blk + 16] = chunks
            # back to element order: logical column LOGICAL_COLUMN[e] holds element e
            decoded = decoded.reshape(rows, 4, 16)[:, :, list(hopper.LOGICAL_COLUMN)].reshape(rows, 64)
            reference_tile = expected[n0 : n0 + config.tile_n, k_tile * 64 : (k_tile + 1) * 64].double().numpy()
            assert np.array_equal(decoded, reference_tile), (n0, k_tile)


def test_swizzle_is_a_permutation_of_16_byte_chunks_per_8_rows():
    offsets = {swizzled_chunk_offset(r, c) for r in range(8) for c in range(8)}
    assert offsets == {16 * i for i in range(64)}
    # row r, chunk c lands in the chunk slot c ^ (r % 8) of its 128-byte row
    assert swizzled_chunk_offset(9, 2) == 9 * 128 + (2 ^ 1) * 16


def _fp16_lanes(bits: int) -> list[float]:
    return np.array([bits & 0xFFFF, bits >> 16], dtype=np.uint16).view(np.float16).astype(np.float64).tolist()


def _emulated_chunks(words, scale_byte):
    """The 16 fp16 values (as float) of one block's two chunks, in store order, from the
    emulated registers of its two words (CHUNK_REGISTERS), times the scale."""
    scale = e4m3_value(scale_byte) * 2.0**14
    registers = [emulate_word_registers(w) for w in words]
    values = []
    for names in hopper.CHUNK_REGISTERS:
        for word in range(2):
            for name in names:
                values += [v * scale for v in _fp16_lanes(registers[word][name])]
    return values


def _prmt(a: int, b: int, selector: int) -> int:
    source = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(source[(selector >> (4 * i)) & 7] for i in range(4)), "little")


def test_logical_columns_are_a_permutation_of_each_scale_block():
    assert sorted(hopper.LOGICAL_COLUMN) == list(range(16))


@pytest.mark.parametrize("seed", range(4))
def test_a_fragments_and_b_chunks_agree_on_every_logical_column(seed):
    """Register-A mode: the fragment registers lane t builds (a_word_selector's prmt of rows g
    and g+8, then the bit placement) and the B chunk stores put the same element of a scale
    block in every logical column: the K permutation is one bijection for both operands."""
    rng = np.random.default_rng(seed)
    row_g, row_g8 = (rng.integers(0, 256, 8, dtype=np.uint8) for _ in range(2))
    elements = {}
    for name, row in (("g", row_g), ("g8", row_g8)):
        placed = []
        for w in range(2):
            placed += emulate_decode_word(int(row[4 * w : 4 * w + 4].view("<u4")[0]), 0x38)[0].tolist()
        elements[name] = placed  # element order
        # B: the chunk stores hold element e at logical column LOGICAL_COLUMN[e]
        stored = _emulated_chunks([int(row[0:4].view("<u4")[0]), int(row[4:8].view("<u4")[0])], 0x38)
        assert [stored[hopper.LOGICAL_COLUMN[e]] for e in range(16)] == [v * 2.0**14 for v in placed]
    # A: lane t's fragment registers of this block (k16 step)
    seen = set()
    for t in range(4):
        half = t // 2
        word = _prmt(
            int(row_g[4 * half : 4 * half + 4].view("<u4")[0]),
            int(row_g8[4 * half : 4 * half + 4].view("<u4")[0]),
            hopper.a_word_selector(t),
        )
        registers = emulate_word_registers(word)
        for index, name in enumerate(hopper.FRAGMENT_REGISTERS):
            row = "g" if index in (0, 2) else "g8"  # fragment: (g, ..), (g+8, ..), (g, ..), (g+8, ..)
            columns = (2 * t, 2 * t + 1) if index < 2 else (2 * t + 8, 2 * t + 9)
            for column, value in zip(columns, _fp16_lanes(registers[name])):
                element = hopper.LOGICAL_COLUMN.index(column)
                assert value == elements[row][element], (t, name, column)
                seen.add((row, column))
    assert len(seen) == 32  # every (row, column) of the step once


def test_a_word_selector_picks_bytes_p_and_p_plus_2_of_both_rows():
    assert [hex(hopper.a_word_selector(t)) for t in range(4)] == ["0x6240", "0x7351", "0x6240", "0x7351"]
    assert _prmt(0x03020100, 0x07060504, hopper.a_word_selector(1)) == 0x07030501


def _accumulator_layouts(config):
    """The wgmma's C thread-value layout and the per-thread accumulator shape, read while
    tracing (the load step after it needs a GPU and is allowed to fail here)."""
    from cutlass import cute

    captured = []

    @cute.jit
    def probe():
        tiled_mma = hopper.make_tiled_mma(config)
        captured.append(str(tiled_mma.tv_layout_C))
        captured.append(str(tiled_mma.partition_shape_C((config.tile_m, config.tile_n))))

    with contextlib.suppress(Exception):  # no driver here: only the traced layouts matter
        cute.compile(probe, options="--gpu-arch sm_90a")
    assert len(captured) == 2, "the probe was not traced"
    return captured


@pytest.mark.parametrize("config", [
    hopper.SM90_CONFIG, hopper.HopperGemmConfig(tile_n=256),
])
def test_accumulator_pairs_are_adjacent_columns(config):
    """The epilogue stores accumulators 2i and 2i+1 as one fp16x2 word at (row, col) and
    (row, col + 1): the C layout's first value mode is 2 columns (stride 64 = one column of
    the 64-row column-major atom), then row + 8, then the 8-column blocks."""
    tv_layout, fragment_shape = _accumulator_layouts(config)
    blocks = config.tile_n // 8
    assert tv_layout == f"((4,8,4),(2,2,{blocks})):((128,1,16),(64,8,512))"
    assert fragment_shape == f"((2, 2, {blocks}), 1, 1)"


def test_can_implement_names_group_field_and_rule():
    hopper.can_implement([(40, 128, 256, 1), (0, 4096, 7168, 1)])
    with pytest.raises(ValueError, match=r"group 1: K = 320.*multiple of 256"):
        hopper.can_implement([(40, 128, 256, 1), (40, 128, 320, 1)])
    with pytest.raises(ValueError, match=r"group 0: N = 200.*multiple of 128"):
        hopper.can_implement([(40, 200, 256, 1)])
    with pytest.raises(ValueError, match=r"G = 65"):
        hopper.can_implement([(1, 128, 256, 1)] * 65)


def test_config_check_rejects_unsupported_tiles():
    hopper.HopperGemmConfig(tile_n=256).check()
    for tile_n in (64, 96):
        with pytest.raises(ValueError, match=f"tile_n={tile_n}: must be 128 or 256"):
            hopper.HopperGemmConfig(tile_n=tile_n).check()


def test_raw_stage_layout():
    # packed rows of 32 bytes + one whole scale atom per 128 rows of A and of B
    assert (hopper.SM90_CONFIG.sfa_atoms, hopper.SM90_CONFIG.sfb_atoms) == (1, 1)
    assert hopper.SM90_CONFIG.raw_stage_bytes == 256 * 32 + 2 * 512
    assert hopper.HopperGemmConfig(tile_n=256).raw_stage_bytes == 384 * 32 + 3 * 512


@pytest.mark.parametrize("config", [
    hopper.SM90_CONFIG,
    hopper.SPLIT_K_CONFIG,
])
def test_compiles_for_sm90a_on_any_machine(config):
    compiled = hopper.compile_gemm(3, options="--gpu-arch sm_90a", config=config)
    assert compiled is not None


def test_compile_targets_list_what_the_backend_runs():
    targets = {name: arch for name, arch, _ in hopper.compile_targets()}
    # the two pre-passes, one build per registered config, named after it, and the MoE
    # entry's kernels (its three pre-passes, the GEMM of each config moe_config can return)
    assert targets == {
        "sm90_decode_activations": "sm_90a",
        "sm90_decode_activations_chained": "sm_90a",
        **{f"sm90_{name}": "sm_90a" for name in hopper.CONFIGS},
        **{f"sm90_moe_decode_{kind}": "sm_90a" for kind in ("plain", "blocked", "chained")},
        **{f"sm90_moe_gemm_{name}": "sm_90a" for name in ("split_k", "one_round", "one_round_k128", "variable", "t32",
                                                                  "t32_k128", "t64", "t32_split_k2",
                                                                  "t32_split_k4")},
        # the real-checkpoint epilogues (a scale per expert or per half of N, bf16 output)
        **{f"sm90_moe_gemm_{name}_{epilogue}": "sm_90a" for name in ("t32", "t32_split_k4", "variable")
           for epilogue in ("alpha_bf16", "halves_f16")},
        # W4A16 (bf16 activations): the GEMM of every config moe_config can return, and the
        # fused gate-and-up's epilogue on the decode and variable configs
        **{f"sm90_moe_w4a16_{name}": "sm_90a" for name in ("split_k", "one_round", "one_round_k128", "variable",
                                                            "t32", "t32_k128", "t64", "t32_split_k2", "t32_split_k4")},
        **{f"sm90_moe_w4a16_{name}_halves": "sm_90a" for name in ("t32", "variable")},
        # K any multiple of 64 (moe_k_config): the k_tail build of every config, both paths
        **{f"sm90_moe_{path}_{name}_k_tail": "sm_90a" for path in ("gemm", "w4a16")
           for name in ("split_k", "one_round", "one_round_k128", "variable", "t32", "t32_k128", "t64", "t32_split_k2",
                        "t32_split_k4")},
        # SwiGLU in the epilogue (both paths) and the row maps (W4A16), on the decode and variable configs
        **{f"sm90_moe_{path}_{name}_swiglu": "sm_90a" for path in ("gemm", "w4a16")
           for name in ("t32_split_k4", "variable")},
        **{f"sm90_moe_w4a16_{name}_{maps}": "sm_90a" for name in ("t32_split_k4", "variable")
           for maps in ("gather_halves", "scatter")},
        # W4A16 with b packed for the fragment: the configs the choice runs it on (no t64), MoeFfn's two GEMMs
        **{f"sm90_moe_w4a16_{name}_{maps}_fragment": "sm_90a"
           for name in ("t32", "t32_k128", "t32_split_k2", "t32_split_k4", "variable") for maps in ("swiglu", "scatter")},
        # the MoE layer's kernels around its GEMMs (hopper/layer.py)
        **{f"sm90_moe_{name}": "sm_90a" for name in ("sort_pairs", "route_sort", "route_sort_softmax_all",
                                                      "route_sort_grouped_sigmoid", "combine_bf16",
                                                      "quantize_gather_bf16", "quantize_f32",
                                                      "combine_masked_shared_f32")},
    }
    # every config the automatic choice can return is registered
    for groups, n, k in ((8, 4096, 7168), (2, 3072, 4096), (1, 128, 256)):
        for choice in hopper.make_backend().family_choices(groups, n, k):
            assert hopper.config_name(choice.config) in hopper.CONFIGS


SM90_SMEM_LIMIT = 232_448  # 227 KB opt-in per block, compute capability 9.0


# sm90_builds (tests/conftest.py): every kernel of the package built for sm_90a at G = 1, 2, 8,
# once for the run


def test_every_sm90_kernel_builds_within_limits_at_every_group_count(sm90_builds):
    """Every target of hopper.compile_targets() built for sm_90a at every group count: no failed
    build, an sm_90 cubin, and no problem (registers, local memory, shared memory)."""
    names = [name for name, _arch, _compile in hopper.compile_targets()]
    assert set(sm90_builds) == {(name, g) for name in names for g in (1, 2, 8)}
    for (target, num_groups), report in sm90_builds.items():
        assert not report.failed, f"{target} G={num_groups}: {report.error}"
        assert report.arch == "sm_90a" and report.sm_version == 90 and report.ptx_target == "sm_90a"
        assert build_report.problems(report) == [], (target, num_groups, build_report.problems(report))


@pytest.mark.parametrize("num_groups", [1, 2, 8])
@pytest.mark.parametrize("target,config,mma", [
    ("sm90_in_gemm_decode", hopper.SM90_CONFIG, "m64n128k16"),
    ("sm90_in_gemm_decode_split_k", hopper.SPLIT_K_CONFIG, "m64n128k16"),
    ("sm90_in_gemm_decode_stream_k", hopper.STREAM_K_CONFIG, "m64n128k16"),
    ("sm90_in_gemm_decode_n256_split_k", hopper.WIDE_SPLIT_K_CONFIG, "m64n256k16"),
])
def test_sm90_builds_within_limits(sm90_builds, target, config, mma, num_groups):
    report = sm90_builds[(target, num_groups)]
    assert report.arch == "sm_90a" and report.ptx_target == "sm_90a" and report.sm_version == 90
    # ctas_per_sm 256-thread CTAs share the 65,536-register file (128x128 tiles: two, at most
    # 128 registers; 128x256 tiles: one, and more than 128, so not two)
    assert 0 < report.registers * config.num_threads * config.ctas_per_sm <= 65536
    assert (report.registers > 128) == (config.ctas_per_sm == 1)
    assert report.frame_bytes == 0 and report.spill_bytes_max == 0, "local memory: spills possible"
    assert report.mma == [f"wgmma.mma_async.sync.aligned.{mma}.f32.f16.f16"]
    # shared memory = 1 KB head + 2 fp16 B stages + the raw stages
    b_stages = 2 * config.tile_n * config.tile_k * 2
    assert report.dynamic_smem_bytes == 1024 + b_stages + config.raw_stages * config.raw_stage_bytes
    assert report.smem_bytes <= SM90_SMEM_LIMIT
    assert build_report.problems(report) == []


@pytest.mark.parametrize("name", ["t32", "t32_split_k4", "variable"])
def test_moe_epilogues_scale_the_fp32_sums_once_after_the_main_loop_and_round_to_cs_dtype(sm90_builds, name):
    """The real-checkpoint epilogues of the MoE GEMM: one fp32 load of the tile's alpha, after
    the last wgmma (so after the grid-dependency wait of chained calls), times 2^28 (the
    decode's exact rescale) in one multiply; with bf16 output the epilogue's conversions are
    bf16 ones (as many as the fp16 kernel's epilogue has fp16 ones), with [G, 2] the half of N
    selects the scale. The kernel without alpha has no such load."""
    def ptx_of(target):
        return Path(sm90_builds[(target, 8)].ptx_path).read_text(errors="replace")

    base, scaled, halves = (ptx_of(f"sm90_moe_gemm_{name}{suffix}") for suffix in ("", "_alpha_bf16", "_halves_f16"))
    assert "ld.global.f32" not in base
    # one main loop and epilogue per token class (variable tiles: one per class)
    classes = len(hopper.moe.Sm90MoeSwapAbGemm(hopper.config_named(f"swap_ab_{name}"), 8).token_classes())
    for ptx in (scaled, halves):
        loads = [match.start() for match in re.finditer(r"ld\.global\.f32", ptx)]
        assert len(loads) == classes
        for start, end in zip([0, *loads], loads):  # each epilogue's load after its own main loop
            assert "wgmma.mma_async" in ptx[start:end]
        for register in re.findall(r"ld\.global\.f32 (%f\d+)", ptx):
            assert re.search(rf"mul\.f32\s+%f\d+, {register}, 0f4D800000;", ptx)  # alpha x 2^28
    # bf16 output: the epilogue's fp16 conversions become bf16 ones, one for one
    base_f16 = base.count("cvt.rn.f16x2.f32") + base.count("cvt.rn.f16.f32")
    scaled_f16 = scaled.count("cvt.rn.f16x2.f32") + scaled.count("cvt.rn.f16.f32")
    scaled_bf16 = scaled.count("cvt.rn.bf16x2.f32") + scaled.count("cvt.rn.bf16.f32")
    assert scaled_bf16 > 0 and base_f16 - scaled_f16 == scaled_bf16
    assert "bf16" not in halves and "bf16" not in base
    assert re.search(r"selp\.b64\s+%rd\d+, 0, 4, %p\d+;", halves) and not re.search(
        r"selp\.b64\s+%rd\d+, 0, 4, %p\d+;", scaled)


@pytest.mark.parametrize("num_groups", [1, 8])
def test_stream_k_kernel_meets_through_a_global_workspace(sm90_builds, num_groups):
    """Stream-K parts meet in global memory: 16-byte partial stores and L2 loads, GPU-scope
    fences around one atomic arrival per part; two CTAs per SM are requested from ptxas
    (.minnctapersm 2: the segment loop would otherwise take 169 registers, one CTA per SM).
    The default kernel has none of it."""
    ptx = Path(sm90_builds[("sm90_in_gemm_decode_stream_k", num_groups)].ptx_path).read_text(errors="replace")
    for instruction in ("st.global.v4.f32", "ld.global.cg.v4.f32", "fence.acq_rel.gpu", "atom.global.add.u32"):
        assert instruction in ptx, instruction
    assert ".minnctapersm 2" in ptx and ".reqntid 256, 1, 1" in ptx
    default_ptx = Path(sm90_builds[("sm90_in_gemm_decode", num_groups)].ptx_path).read_text(errors="replace")
    assert "atom.global" not in default_ptx and ".minnctapersm" not in default_ptx


@pytest.mark.parametrize("num_groups", [1, 8])
def test_split_k_kernel_reduces_through_the_cluster(sm90_builds, num_groups):
    """Partial sums reach the summing rank through distributed shared memory (mapa to a
    rank computed at run time), fenced by cluster barriers; the default kernel has neither."""
    split_ptx = Path(sm90_builds[("sm90_in_gemm_decode_split_k", num_groups)].ptx_path).read_text()
    assert "mapa.shared::cluster.u32" in split_ptx and "st.shared::cluster.v4.f32" in split_ptx
    assert "barrier.cluster.arrive" in split_ptx and "barrier.cluster.wait" in split_ptx
    default_ptx = Path(sm90_builds[("sm90_in_gemm_decode", num_groups)].ptx_path).read_text()
    assert "shared::cluster" not in default_ptx and "barrier.cluster" not in default_ptx


# ---------------------------------------------------------------------------------------
# CPU: tile shape of a backend, and the kernel each state launches
# ---------------------------------------------------------------------------------------
def test_split_k_pays_where_half_tiles_fill_the_slots_better():
    # the benchmark shapes' tile counts on 132 SMs x 2 CTAs: split for shapes 0, 2 and 3
    assert [hopper.split_k_pays(t, 132) for t in (352, 728, 120, 128)] == [True, False, True, True]
    assert hopper.split_k_pays(1, 132)  # 1 wave of a half tile vs 1 of a whole one
    assert not hopper.split_k_pays(264, 132)  # exactly one full wave: 2 half waves, no gain
    assert not hopper.split_k_pays(1000, 132)  # many waves: quantization no longer matters
    assert hopper.split_k_pays(120, 132, ctas_per_sm=1) is False  # 240 halves = 2 waves


def test_split_k_reduction_buffer_sizes():
    # each rank receives the other's sums of the 64 rows it stores: as many bytes as the two
    # fp16 B stages it receives them into (after the 1 KB head)
    for tile_n in (128, 256):
        config = hopper.HopperGemmConfig(tile_n=tile_n, split_k=2)
        assert config.reduction_bytes == 64 * tile_n * 4 == config.mma_stages * tile_n * config.tile_k * 2
    assert hopper.SM90_CONFIG.reduction_bytes == 0


# what the default backend runs on the four benchmark shapes (132 SMs), and their tile counts
AUTO_CHOICE = {
    0: (hopper.STREAM_K_CONFIG, 352),
    1: (hopper.SM90_CONFIG, 728),
    2: (hopper.WIDE_SPLIT_K_CONFIG, 60),
    3: (hopper.WIDE_SPLIT_K_CONFIG, 64),
}


@pytest.mark.parametrize("shape", [0, 1, 2, 3])
def test_automatic_choice_on_the_benchmark_shapes(shape):
    """Stream-K on shape 0, whole tiles on 1, split-K with 128x256 tiles on 2 and 3 (N % 256
    == 0, 60 and 64 wide tiles: 120 and 128 split CTAs on 132 SMs, one wave)."""
    sizes = BENCHMARK_SIZES[shape]
    config, num_tiles = AUTO_CHOICE[shape]
    assert hopper.choose_config(sizes, 132) == config
    assert len(hopper.tile_k_tiles(sizes, config.tile_n)) == num_tiles
    assert hopper.make_backend(kernel="in_gemm_decode").tile_shape(sizes) == (128, config.tile_n)
    assert hopper.wide_split_k_fits(sizes, 132) == (shape in (2, 3))


def test_wide_split_k_needs_n_multiple_of_256_and_one_wave():
    two_groups = [(192, 3072, 4096, 1), (320, 3072, 4096, 1)]  # shape 2: 60 wide tiles
    assert hopper.choose_config(two_groups, 132) == hopper.WIDE_SPLIT_K_CONFIG
    # one N an odd multiple of 128: split-K with 128x128 tiles
    odd_n = [(192, 3072, 4096, 1), (320, 3200, 4096, 1)]
    assert not hopper.wide_split_k_fits(odd_n, 132)
    assert hopper.choose_config(odd_n, 132) == hopper.SPLIT_K_CONFIG
    # 67 wide tiles = 134 split CTAs > 132 SMs (the 128x128 split: 268 CTAs on 264 slots)
    over = [(128, 256 * 67, 1024, 1)]
    assert not hopper.wide_split_k_fits(over, 132)
    assert hopper.wide_split_k_fits([(128, 256 * 66, 1024, 1)], 132)
    # fewer SMs, fewer wide tiles fit
    assert not hopper.wide_split_k_fits(two_groups, 114)  # 120 CTAs > 114


def test_tile_shape_is_the_shape_of_the_config_prepare_picks(sm90_backend_on_cpu):
    """The tile table is planned with tile_shape(sizes) before prepare(plan) picks the config:
    both decide from the sizes, for every backend."""
    rng = random.Random(7)
    size_sets = list(BENCHMARK_SIZES.values()) + [
        [(rng.randint(0, 600), 128 * rng.randint(1, 40), 256 * rng.randint(1, 30), 1)
         for _ in range(rng.randint(1, 12))]
        for _ in range(60)
    ]
    backends = [hopper.make_backend(kernel="in_gemm_decode"), hopper.make_backend(hopper.WIDE_SPLIT_K_CONFIG),
                hopper.make_backend(hopper.SPLIT_K_CONFIG)]
    picked = set()
    for sizes in size_sets:
        sizes = tuple(sizes)
        data = _cpu_input_set(sizes)
        for backend in backends:
            state = _bind(data, sizes, backend)
            config = state.plan.backend_plan.config
            assert backend.tile_shape(sizes) == (config.tile_m, config.tile_n)
            assert state.plan.num_tiles == len(hopper.tile_k_tiles(sizes, config.tile_n))
            if backend.config is None:
                picked.add(config)
    assert picked == {hopper.SM90_CONFIG, hopper.SPLIT_K_CONFIG, hopper.WIDE_SPLIT_K_CONFIG,
                      hopper.STREAM_K_CONFIG}


def _bind(data, sizes, backend):
    """A plan of `sizes` for `backend` and the input set `data` bound to it (on the device of
    data's first a), outside the runtime's caches."""
    device = data[0][0][0].device
    return runtime.Binding(runtime.Plan(backend, sizes, device), submission.pointers_of(data))


def _cpu_input_set(sizes):
    """Tensors with the official shapes on the CPU, their values never written (a binding reads
    only pointers)."""
    abc, sfs_reordered = [], []
    for m, n, k, _l in sizes:
        abc.append((
            torch.empty((m, k // 2, 1), dtype=torch.uint8),
            torch.empty((n, k // 2, 1), dtype=torch.uint8),
            torch.empty((m, n, 1), dtype=torch.float16),
        ))
        sfs_reordered.append((torch.empty(512 * max(1, -(-m // 128)) * k // 64, dtype=torch.uint8),
                              torch.empty(512 * (n // 128) * k // 64, dtype=torch.uint8)))
    return abc, None, sfs_reordered, sizes


@pytest.fixture
def sm90_backend_on_cpu(monkeypatch):
    """sm_90 backends with compile and launch recorded instead of run."""
    compiled, launched = [], []

    def fake_compile(num_groups, options=None, config=hopper.SM90_CONFIG):
        compiled.append((num_groups, config))
        return ("kernel", num_groups, config)

    class FakeCellLauncher:
        """What the binding's launch is built from: the GEMM's argument values (ptrs, sizes,
        tiles, num_tiles, work, num_workers, workspace, counters, stream)."""

        def __init__(self, kernel, kinds, dtypes):
            self.kernel = kernel

        def bound(self, values):
            launched.append((self.kernel, values[3], values[5]))
            return lambda: None

    monkeypatch.setattr(hopper.backend, "compile_gemm", fake_compile)
    monkeypatch.setattr(launch, "cell_launcher", FakeCellLauncher)
    return compiled, launched


class _Stream:
    """A stand-in for torch's current CUDA stream (its raw handle)."""

    def __int__(self):
        return 0


@pytest.mark.parametrize("shape,config,num_tiles", [
    (0, hopper.SM90_CONFIG, 352), (1, hopper.SM90_CONFIG, 728),
    (2, hopper.SM90_CONFIG, 120), (3, hopper.SM90_CONFIG, 128),
    (2, hopper.HopperGemmConfig(tile_n=256), 60), (3, hopper.HopperGemmConfig(tile_n=256), 64),
])
def test_state_launches_the_kernel_of_its_tile_table(sm90_backend_on_cpu, shape, config, num_tiles):
    compiled, launched = sm90_backend_on_cpu
    backend = hopper.make_backend(config)
    sizes = tuple(BENCHMARK_SIZES[shape])
    state = _bind(_cpu_input_set(sizes), sizes, backend)
    assert state.plan.num_tiles == num_tiles
    assert state.plan.tiles[:, 2].max().item() == sizes[0][1] // config.tile_n - 1
    assert state.plan.backend_plan.config == config
    assert compiled == [(len(sizes), config)]
    state.run(_Stream())
    assert launched == [(("kernel", len(sizes), config), num_tiles, 0)]


def test_default_backend_picks_a_schedule_per_input_set(sm90_backend_on_cpu):
    """make_backend() (custom_kernel's) runs the config choose_config picks, on a tile table of
    its tile shape; a backend made for an explicit config runs it for every input set."""
    compiled, launched = sm90_backend_on_cpu
    for shape, (picked, picked_tiles) in AUTO_CHOICE.items():
        sizes = tuple(BENCHMARK_SIZES[shape])
        whole_tiles = (352, 728, 120, 128)[shape]
        for backend, want, num_tiles in (
            (hopper.make_backend(kernel="in_gemm_decode"), picked, picked_tiles),
            (hopper.make_backend(hopper.SM90_CONFIG), hopper.SM90_CONFIG, whole_tiles),
        ):
            state = _bind(_cpu_input_set(sizes), sizes, backend)
            assert state.plan.num_tiles == num_tiles
            assert state.plan.tiles[:, 2].max().item() == sizes[0][1] // want.tile_n - 1
            assert state.plan.backend_plan.config == want
            assert compiled[-1] == (len(sizes), want)
            plan = state.plan.backend_plan.stream_k
            assert (plan is not None) == want.stream_k
            launched.clear()
            state.run(_Stream())
            workers = plan.num_workers if plan else 0
            assert launched == [(("kernel", len(sizes), want), state.plan.num_tiles, workers)]
    # shape 0 on 132 SMs: one worker per CTA slot, each tile's parts owning workspace slots
    sizes = tuple(BENCHMARK_SIZES[0])
    plan = _bind(_cpu_input_set(sizes), sizes, hopper.make_backend(kernel="in_gemm_decode")).plan.backend_plan.stream_k
    assert plan.num_workers == 264
    assert plan.workspace.numel() == plan.num_slots * 128 * 128
    assert plan.counters.tolist() == [0] * 352
    assert plan.work.tolist()[: plan.num_workers + 1] == plan.work_offsets


def _check_stream_k_plan(tile_k_tiles, max_workers, min_segment):
    work, segments, num_slots = hopper.plan_stream_k(tile_k_tiles, max_workers, min_segment)
    num_workers = len(work) - 1
    assert 1 <= num_workers <= max_workers
    assert work[0] == 0 and work[-1] == len(segments) and work == sorted(work)
    # every k-tile of every tile exactly once, in k order across the tile's parts
    covered = {t: [] for t in range(len(tile_k_tiles))}
    for tile, k0, count, part, parts, slot_base in segments:
        assert count >= 2 and count % 2 == 0 and k0 % 2 == 0
        covered[tile].append((part, k0, count, parts, slot_base))
    slots_seen = set()
    for tile, pieces in covered.items():
        pieces.sort()
        assert [p[0] for p in pieces] == list(range(len(pieces)))
        assert all(p[3] == len(pieces) for p in pieces)
        k = 0
        for _, k0, count, _, _ in pieces:
            assert k0 == k
            k += count
        assert k == tile_k_tiles[tile]
        if len(pieces) > 1:
            # cuts keep min_segment k-tiles from the tile's edges
            assert pieces[0][2] >= min_segment and pieces[-1][2] >= min_segment
            slots = set(range(pieces[0][4], pieces[0][4] + len(pieces)))
            assert not slots & slots_seen and max(slots) < num_slots
            slots_seen |= slots
    assert len(slots_seen) == num_slots
    # shares: as equal as cuts on even k-tiles at min_segment from the edges allow
    shares = [sum(segments[i][2] for i in range(work[w], work[w + 1])) for w in range(num_workers)]
    mean = sum(tile_k_tiles) / num_workers
    assert max(shares) <= mean + 2 * min_segment
    return work, segments, shares


@pytest.mark.parametrize("shape", [0, 1, 2, 3])
@pytest.mark.parametrize("min_segment", [2, 4])
def test_stream_k_plan_covers_every_k_tile_once_in_equal_shares(shape, min_segment):
    sizes = BENCHMARK_SIZES[shape]
    tiles = submission.plan_tiles(sizes, 128, 128)
    tile_k_tiles = [sizes[g][2] // 64 for g, _, _ in tiles]
    _work, _segments, shares = _check_stream_k_plan(tile_k_tiles, 264, min_segment)
    assert len(shares) == 264


@pytest.mark.parametrize("seed", range(20))
def test_stream_k_plan_of_random_tile_sets(seed):
    rng = random.Random(seed)
    tile_k_tiles = [4 * rng.randint(1, 40) for _ in range(rng.randint(1, 400))]
    _check_stream_k_plan(tile_k_tiles, rng.choice([1, 2, 8, 264]), rng.choice([2, 4, 8]))


def test_stream_k_plan_uses_fewer_workers_for_little_work():
    # 3 tiles of 4 k-tiles: 12 k-tiles make 1 share of at least 2 minimal segments (8)
    work, segments, num_slots = hopper.plan_stream_k([4, 4, 4], 264, 4)
    assert work == [0, 3] and num_slots == 0
    assert [row[:3] for row in segments] == [(0, 0, 4), (1, 0, 4), (2, 0, 4)]


def test_stream_k_pays_on_long_k_input_sets_with_more_tiles_than_slots():
    def k_tiles(shape):
        sizes = BENCHMARK_SIZES[shape]
        return [sizes[g][2] // 64 for g, _, _ in submission.plan_tiles(sizes, 128, 128)]

    assert [hopper.stream_k_pays(k_tiles(shape), 132) for shape in range(4)] == [True, False, False, False]
    assert not hopper.stream_k_pays([112] * 264, 132)  # one full wave: nothing to balance
    assert hopper.stream_k_pays([112] * 300, 132)  # 2 waves, the second nearly empty


def test_stream_k_config_needs_no_split():
    with pytest.raises(ValueError, match="stream_k needs split_k = 1"):
        dataclasses.replace(hopper.STREAM_K_CONFIG, split_k=2).check()


# ---------------------------------------------------------------------------------------
# CUDA (sm_90): kernel vs the exact reference
# ---------------------------------------------------------------------------------------
def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 (Hopper) GPU")


def _random_group_set(seed: int, general_scales: bool, k_step: int = 256):
    """Random groups: G 1..16, M 0..512, N in 128..1024, K in k_step..8 k_step (multiples of
    k_step); full-range fp4 codes; scales 1/2 (competition) or any finite e4m3 up to 3.75
    (exactness check)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    g = rng.randint(1, 16)
    abc, sfs, sfs_reordered, sizes = [], [], [], []
    for _ in range(g):
        m = rng.choice([0, 1, rng.randint(1, 512), rng.randint(1, 512)])
        n = 128 * rng.randint(1, 8)
        k = k_step * rng.randint(1, 8)
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


_exact_reference = exact_group_gemm
_fp32_accumulation_bound = fp32_accumulation_bound


def _match_exact_reference(data, out, general_scales: bool) -> tuple[bool, str]:
    """The official check (match_outputs: |out - ref| <= 1e-3 + 1e-3 |ref|, ref the exact sum
    rounded to fp16); with general scales an element may also differ by up to the fp32
    accumulation bound (_fp32_accumulation_bound)."""
    expected = _exact_reference(data)
    if not general_scales:
        return match_outputs(expected, out)
    for i, (got, ref, bound) in enumerate(zip(out, expected, _fp32_accumulation_bound(data))):
        error = (got.double() - ref.double()).abs()
        allowed = 1e-3 + 1e-3 * ref.double().abs() + bound.to(error.device)
        if not bool((error <= allowed).all()):
            worst = int((error - allowed).flatten().argmax())
            return False, (f"group {i}: {int((error > allowed).sum())} elements beyond the fp32 accumulation "
                           f"bound; worst at flat index {worst}: {got.flatten()[worst].item()} vs exact "
                           f"{ref.flatten()[worst].item()}, allowed {allowed.flatten()[worst].item():.3g}")
    return True, ""


def test_fp32_accumulation_bound_accepts_rounding_and_rejects_a_wrong_product():
    """The bound of the general-scale check: an fp32-accumulated result passes, as does one
    that differs from it by its measured size (a 1.3e-3 error on a 0.235 output of K = 1792);
    a result with one product of one element wrong does not."""
    rng = random.Random(7)
    m, n, k = 24, 128, 1792
    a = torch.randint(0, 256, (m, k // 2, 1), dtype=torch.uint8)
    b = torch.randint(0, 256, (n, k // 2, 1), dtype=torch.uint8)
    sfa = torch.randint(0, 0x47, (m, k // 16, 1), dtype=torch.uint8).view(torch.float8_e4m3fn)
    sfb = torch.randint(0, 0x47, (n, k // 16, 1), dtype=torch.uint8).view(torch.float8_e4m3fn)
    c = torch.zeros((m, n, 1), dtype=torch.float16)
    data = ([(a.view(torch.float4_e2m1fn_x2), b.view(torch.float4_e2m1fn_x2), c)], [(sfa, sfb)], None, [(m, n, k, 1)])
    fp32 = decoded_group_gemm(a[:, :, 0].view(torch.float4_e2m1fn_x2), b[:, :, 0].view(torch.float4_e2m1fn_x2),
                              sfa[:, :, 0], sfb[:, :, 0], accumulate_dtype=torch.float32)
    out = [fp32.to(torch.float16).unsqueeze(-1)]
    assert _match_exact_reference(data, out, general_scales=True)[0]
    bound = _fp32_accumulation_bound(data)[0]
    assert float(bound.min()) > 1.3e-3  # the measured fp32-accumulation error fits
    # one activation code wrong (its sign flipped, in a block scaled by at least 1): every
    # output of that row with a nonzero weight there is off by twice that product
    row = rng.randrange(m)
    block = next(blk for blk in range(k // 16) if sfa[row, blk, 0].view(torch.uint8) >= 0x38)
    byte = next(j for j in range(block * 8, block * 8 + 8) if a[row, j, 0] & 0x07)
    a_wrong = a.clone()
    a_wrong[row, byte, 0] ^= 0x08
    wrong = decoded_group_gemm(a_wrong[:, :, 0].view(torch.float4_e2m1fn_x2), b[:, :, 0].view(torch.float4_e2m1fn_x2),
                               sfa[:, :, 0], sfb[:, :, 0], accumulate_dtype=torch.float32)
    ok, message = _match_exact_reference(data, [wrong.to(torch.float16).unsqueeze(-1)], general_scales=True)
    assert not ok and message.startswith("group 0:"), message


CONFIG_CASES = (
    [("in_gemm_decode", seed) for seed in range(60)]
    + [("in_gemm_decode:tile_n=256", seed) for seed in range(200, 208)]
    + [("in_gemm_decode_split_k", seed) for seed in range(700, 740)]
    + [("auto", seed) for seed in range(1000, 1016)]
    + [("in_gemm_decode_stream_k", seed) for seed in range(1200, 1240)]
    + [("in_gemm_decode_n256_split_k", seed) for seed in range(1300, 1332)]
    + [("swap_ab_t128", seed) for seed in range(1400, 1440)]
    + [("swap_ab_split_k", seed) for seed in range(1500, 1530)]
    + [("swap_ab_t192", seed) for seed in range(1600, 1630)]
    + [("swap_ab_variable", seed) for seed in range(1800, 1840)]
    + [("swap_ab_one_round", seed) for seed in range(1900, 1930)]
    + [("swap_ab_t112", seed) for seed in range(2300, 2330)]
    + [("swap_ab_t112_k128", seed) for seed in range(2400, 2430)]
    + [("swap_ab_one_round_k128", seed) for seed in range(2500, 2530)]
)
# Test ids are registry names (nvfp4_group_gemm.hopper.CONFIGS) or name:field=value variants; "auto" is what
# custom_kernel runs: make_backend(), the config choose_swap_ab_config picks
CONFIGS = {label: None if label == "auto" else hopper.config_named(label)
           for label in dict.fromkeys(label for label, _ in CONFIG_CASES)}


@requires_sm90
@pytest.mark.parametrize("config_name,seed", CONFIG_CASES)
def test_random_group_sets_match_exact_reference(config_name, seed):
    config = CONFIGS[config_name]
    # (128-wide k-tiles: K multiples of 512, what their unrolled loop takes)
    k_step = 256 if config is None else getattr(config, "k_multiple", 256)
    data = _random_group_set(seed, general_scales=seed % 3 == 2, k_step=k_step)
    out = runtime.run_with_backend(data, hopper.make_backend(config))
    torch.cuda.synchronize()
    for i, c in enumerate(out):
        assert not torch.isnan(c).any(), f"group {i}: unwritten (NaN) outputs, sizes {data[3][i]}"
    ok, message = _match_exact_reference(data, out, general_scales=seed % 3 == 2)
    assert ok, f"seed {seed} sizes {data[3]}: {message}"


@requires_sm90
@pytest.mark.parametrize(
    "config_name",
    ["auto", *(name for name in hopper.CONFIGS)],
)
@pytest.mark.parametrize("case", ["bench0", "bench1", "bench2", "bench3"])
def test_benchmark_shapes_match_exact_reference(case, config_name):
    """The four official benchmark shapes in every config custom_kernel may pick."""
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
    out = runtime.run_with_backend(data, hopper.make_backend(CONFIGS[config_name]))
    torch.cuda.synchronize()
    ok, message = match_outputs(_exact_reference(data), out)
    assert ok, message


@requires_sm90
@pytest.mark.parametrize("case", [2, 1])
def test_stream_k_state_relaunches_exactly(case):
    """One stream-K state launched three times, outputs reset to NaN in between: every launch
    finds its arrival counters back at zero (the last part of each tile resets its own) and
    sums the same parts in the same order, so every launch is exact and bit-identical."""
    sizes = BENCHMARK_SIZES[case]
    m, n, k = (tuple(column) for column in list(zip(*sizes))[:3])
    data = generate_input(m, n, k, len(m), seed=2222)
    state = _bind(data, submission.validate_inputs(data), hopper.make_backend(hopper.STREAM_K_CONFIG))
    plan = state.plan.backend_plan.stream_k
    assert plan.num_slots > 0  # tiles are shared by workers: the workspace path runs
    expected = _exact_reference(data)
    results = []
    for _ in range(3):
        for _, _, c in data[0]:
            c.fill_(float("nan"))
        state.run(launch.stream_for_current())
        torch.cuda.synchronize()
        out = [c.clone() for _, _, c in data[0]]
        ok, message = match_outputs(expected, out)
        assert ok, message
        assert int(plan.counters.count_nonzero()) == 0
        results.append(out)
    for first, later in zip(results[0], results[2]):
        assert torch.equal(first, later)


@requires_sm90
@pytest.mark.parametrize("case", [1, 2, 3])
def test_chained_calls_back_to_back_exactly(case):
    """Chained calls (SwapAbConfig.chain_calls, what custom_kernel runs on the benchmark
    shapes): four input sets of one plan, each call's pre-pass launched while the call before
    it still runs, three rounds queued with no synchronization. Every pre-pass overwrites the
    plan's one activation buffer only after the GEMM before it completed, so every output is
    exact."""
    sizes = BENCHMARK_SIZES[case]
    m, n, k = (tuple(column) for column in list(zip(*sizes))[:3])
    sets = [generate_input(m, n, k, len(m), seed=seed) for seed in (7001, 7002, 7003, 7004)]
    expected = [_exact_reference(data) for data in sets]
    for data in sets:
        for _, _, c in data[0]:
            c.fill_(float("nan"))
    for _ in range(3):
        for data in sets:
            runtime.custom_kernel(data)
    torch.cuda.synchronize()
    plans = {runtime.RUNTIME.bindings.get(submission.input_key(data)).plan for data in sets}
    (plan,) = plans
    assert plan.backend_plan.config.chain_calls and not plan.backend_plan.graph_launch
    for index, (data, want) in enumerate(zip(sets, expected)):
        ok, message = match_outputs(want, [c for _, _, c in data[0]])
        assert ok, f"input set {index}: {message}"


@requires_sm90
@pytest.mark.parametrize("kernel", ["swap_ab", "in_gemm_decode"])
def test_input_sets_of_one_plan_alternate_streams_exactly(monkeypatch, kernel):
    """Two input sets of benchmark shape 0 share one plan and its scratch (swap-AB's decoded
    activations; in_gemm_decode's stream-K workspace and counters); launched alternately on
    two streams, each launch waits for the other stream's, so every output is exact. (The NaN
    fill runs on the default stream: the launch's stream waits for it, as a caller's must.)"""
    monkeypatch.setenv("NVFP4_SM90_KERNEL", kernel)
    runtime.reset_runtime()  # the switches are read again
    sizes = BENCHMARK_SIZES[0]
    m, n, k = (tuple(column) for column in list(zip(*sizes))[:3])
    sets = [generate_input(m, n, k, len(m), seed=seed) for seed in (3333, 4444)]
    expected = [_exact_reference(data) for data in sets]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for round_ in range(3):
        for index, data in enumerate(sets):
            for _, _, c in data[0]:
                c.fill_(float("nan"))
            stream = streams[(index + round_) % 2]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                runtime.custom_kernel(data)
        torch.cuda.synchronize()
        for data, want in zip(sets, expected):
            ok, message = match_outputs(want, [c for _, _, c in data[0]])
            assert ok, f"round {round_}: {message}"
    bindings = [runtime.RUNTIME.bindings.get(submission.input_key(data)) for data in sets]
    backend_plan = bindings[0].plan.backend_plan
    assert bindings[0].plan is bindings[1].plan and backend_plan.shared_scratch
    assert (backend_plan.stream_k is not None) == (kernel == "in_gemm_decode")
    assert (backend_plan.activations is not None) == (kernel == "swap_ab")


W4A16_TARGETS = [name for name, _arch, _compile in hopper.moe.moe_compile_targets() if "w4a16" in name]


@pytest.mark.parametrize("target", W4A16_TARGETS)
def test_w4a16_gemms_read_bf16_rows_and_fence_them_before_wgmma(sm90_builds, target):
    """The W4A16 GEMM (every config the choice may run): bf16 wgmma only; no bulk copies (no
    pre-pass slabs) and no grid-dependency control (unchained); its token rows by cp.async,
    each thread arriving on the stage's mbarrier (noinc); after every wait on a token stage a
    proxy fence comes before the next wgmma (the rows were written through the generic proxy);
    the weights scaled in bf16; the epilogue's alpha times 2^8, the bf16 decode's rescale; no
    local memory up to G = 8."""
    report = sm90_builds[(target, 8)]
    assert report.error is None and report.ptx_target == "sm_90a"
    assert report.frame_bytes == 0 and report.spill_bytes_max == 0
    assert report.mma and all(m.endswith(".f32.bf16.bf16") for m in report.mma), report.mma
    ptx = Path(report.ptx_path).read_text(errors="replace")
    assert "cp.async.bulk" not in ptx and "griddepcontrol" not in ptx
    assert "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in ptx and "mul.rn.bf16x2" in ptx
    waits = [m.start() for m in re.finditer(r"mbarrier\.try_wait\.parity", ptx)]
    assert waits
    for start in waits:
        fence, mma = ptx.find("fence.proxy.async", start), ptx.find("wgmma.mma_async", start)
        assert 0 <= fence < mma, f"{target}: a wgmma after a token wait without a proxy fence between"
    for register in re.findall(r"ld\.global\.f32 (%f\d+)", ptx):
        assert re.search(rf"mul\.f32\s+%f\d+, {register}, 0f43800000;", ptx)  # alpha x 2^8
    assert re.findall(r"ld\.global\.f32", ptx), "the checkpoint epilogue loads alpha"


FRAGMENT_TARGETS = [name for name in W4A16_TARGETS if name.endswith("_fragment")]


@pytest.mark.parametrize("target", FRAGMENT_TARGETS)
def test_fragment_builds_read_a_lanes_words_with_one_load_a_unit_and_permute_no_byte(sm90_builds, target):
    """The W4A16 GEMM on weights packed for the fragment (weight_layout="fragment"): each unit
    of the decode one 16-byte shared load (a v4 per 64-wide half k-tile), no 8-byte loads and no
    byte permute (the plain build of the same config takes two v2 loads a row and three prmt a
    word); no local memory up to G = 8."""
    assert len(FRAGMENT_TARGETS) == 10
    report = sm90_builds[(target, 8)]
    assert report.error is None and report.frame_bytes == 0 and report.spill_bytes_max == 0
    ptx = Path(report.ptx_path).read_text(errors="replace")
    config = hopper.config_named("swap_ab_" + target.removeprefix("sm90_moe_w4a16_").rsplit("_", 2)[0])
    loads = ptx.count("ld.shared.v4.u32")
    assert loads and loads % config.k_halves == 0  # a unit per half k-tile, each decode's units together
    assert "ld.shared.v2.u32" not in ptx and "prmt.b32" not in ptx


@pytest.mark.parametrize("target", FRAGMENT_TARGETS)
def test_fragment_builds_share_each_quads_scales_by_four_shuffles_a_unit(sm90_builds, target):
    """The fragment builds' scales where hopper.moe.w4a16_quad_scales takes them (every config
    the choice runs on fragment weights but 128-wide k-tiles at 3 CTAs per SM): per unit of the
    decode each lane loads its own pair of scale bytes (one 16-bit shared load) and four
    shfl.sync.idx within its quad (c = 0x1c1f: segments of 4 lanes) bring the quad's four
    pairs, no 32-bit scale word loaded; elsewhere, as the plain layout's builds, two 32-bit
    scale words a unit and no quad shuffle (EXPERIMENTS E95)."""
    report = sm90_builds[(target, 8)]
    ptx = Path(report.ptx_path).read_text(errors="replace")
    config = hopper.config_named("swap_ab_" + target.removeprefix("sm90_moe_w4a16_").rsplit("_", 2)[0])
    units = ptx.count("ld.shared.v4.u32")
    shuffles = ptx.count(f"{hex(hopper.ptx.QUAD_SHUFFLE_CLAMP)}, 0xffffffff;")
    assert units
    if hopper.moe.w4a16_quad_scales(config, "fragment"):
        assert ptx.count("ld.shared.u16") == units and shuffles == 4 * units
        assert "ld.shared.u32" not in ptx
    else:
        assert config.k_halves == 2 and config.ctas_per_sm == 3
        assert shuffles == 0 and "ld.shared.u16" not in ptx and ptx.count("ld.shared.u32") == 2 * units
    assert not hopper.moe.w4a16_quad_scales(config, "plain")


# the W4A16 builds with rows read through a_rows and fixed 32-token tiles: one row per thread
GATHERED_T32_TARGETS = [name for name in W4A16_TARGETS if name.startswith("sm90_moe_w4a16_t32")
                        and ("_swiglu" in name or "_gather" in name)]


@pytest.mark.parametrize("target", GATHERED_T32_TARGETS)
def test_gathered_32_token_builds_read_a_rows_once_a_tile(sm90_builds, target):
    """Rows read through a_rows (the layer's gate-and-up GEMM): with 32-token tiles each thread's
    copies of a k-tile read one token row, whose a_rows entry is read once per tile
    (Sm90MoeW4A16Gemm.token_source), not again at each k-tile of the unrolled main loop and
    its prologue; no local memory up to G = 8 (the row held in a register)."""
    assert len(GATHERED_T32_TARGETS) == 6
    report = sm90_builds[(target, 8)]
    assert report.error is None and report.frame_bytes == 0 and report.spill_bytes_max == 0
    ptx = Path(report.ptx_path).read_text(errors="replace")
    assert ptx.count("ld.global.s64") == 1


# the MoE entry's 32-token split-K builds, fp4 and W4A16, every epilogue, rows and weight layout
T32_SPLIT_K_TARGETS = [name for name, _arch, _compile in hopper.moe.moe_compile_targets() if "_t32_split_k" in name]


@pytest.mark.parametrize("target", T32_SPLIT_K_TARGETS)
def test_32_token_split_k_builds_unroll_their_main_loop_by_the_stages(sm90_builds, target):
    """The 32-token split-K configs unroll a rank's main loop by the stage count (every stage
    index a constant: one token-stage wait per k-tile step, the stages' steps in one loop body),
    K a multiple of 256 x the ranks (SwapAbConfig.k_multiple; moe_k_config runs the k_tail
    build, not unrolled, for any other K); no local memory up to G = 8 (EXPERIMENTS E96)."""
    assert len(T32_SPLIT_K_TARGETS) >= 14
    report = sm90_builds[(target, 8)]
    assert report.error is None and report.frame_bytes == 0 and report.spill_bytes_max == 0
    name = target.removeprefix("sm90_moe_").split("_", 1)[1]
    config = hopper.config_named("swap_ab_" + name[:len("t32_split_kN")])
    if name.endswith("_k_tail"):
        config = hopper.moe.k_tail_config(config)
    assert config.unrolled_main_loop == (not config.k_tail)
    assert config.k_multiple == (config.tile_k if config.k_tail else 256 * config.split_k)
    ptx = Path(report.ptx_path).read_text(errors="replace")
    steps = config.stages if config.unrolled_main_loop else 1
    assert ptx.count("mbarrier.try_wait.parity") == steps
    assert ptx.count("wgmma.mma_async") == steps * config.tile_k // 16


K_TAIL_TARGETS = [name for name, _arch, _compile in hopper.moe.moe_compile_targets() if name.endswith("_k_tail")]


@pytest.mark.parametrize("target", K_TAIL_TARGETS)
def test_k_tail_builds_have_no_local_memory_and_the_epilogue_of_the_others(sm90_builds, target):
    """The k_tail builds (K any multiple of 64: the k-tile count and split-K's shares at run time,
    the main loop not unrolled): within the CTAs-per-SM register bound, no local memory up to
    G = 8, one wgmma shape per token class as the kernels of K % 256 == 0; the epilogue of
    those kernels: alpha times the decode's exact rescale in one fp32 multiply, the sums times
    it, then a round-to-nearest conversion to c's dtype (cvt.rn, no .satfinite: inf past the
    range, as the exact decode's rounding; tests/test_moe.py pins that rounding at fp16's
    boundary)."""
    report = sm90_builds[(target, 8)]
    config = hopper.moe.k_tail_config(hopper.config_named("swap_ab_" + target.removesuffix("_k_tail").split("_", 3)[3]))
    assert report.error is None and report.ptx_target == "sm_90a"
    assert report.frame_bytes == 0 and report.spill_bytes_max == 0
    assert 0 < report.registers * config.num_threads * config.ctas_per_sm <= 65536
    w4a16 = "_w4a16_" in target
    assert report.mma and all(m.endswith(".f32.bf16.bf16" if w4a16 else ".f32.f16.f16") for m in report.mma)
    ptx = Path(report.ptx_path).read_text(errors="replace")
    rescale = "0f43800000" if w4a16 else "0f4D800000"  # 2^8, 2^28
    loads = re.findall(r"ld\.global\.f32 (%f\d+)", ptx)
    assert loads and all(re.search(rf"mul\.f32\s+%f\d+, {register}, {rescale};", ptx) for register in loads)
    assert "cvt.rn.bf16x2.f32" in ptx or "cvt.rn.bf16.f32" in ptx
    assert "satfinite" not in ptx and ".sat." not in ptx.replace("cvt.rni.sat", "")


ROW_MAP_TARGETS = [name for name in W4A16_TARGETS if name.endswith(("_gather_halves", "_scatter"))]


@pytest.mark.parametrize("target", ROW_MAP_TARGETS)
def test_row_map_builds_read_their_indices_where_they_map_rows(sm90_builds, target):
    """The W4A16 GEMM with row maps (hopper.moe.Sm90MoeW4A16RowsGemm): the gather build loads an
    int64 index before the token rows' cp.async and none in its stores, the scatter build the
    other way round, and the unmapped build of the same config none at all (its PTX is the
    kernel of before: bench/ptx_diff.py); the same stores and token copies as that build."""
    assert len(ROW_MAP_TARGETS) == 4
    report = sm90_builds[(target, 8)]
    assert report.error is None and report.frame_bytes == 0 and report.spill_bytes_max == 0
    config = target.removeprefix("sm90_moe_w4a16_").removesuffix("_gather_halves").removesuffix("_scatter")
    plain = sm90_builds[(f"sm90_moe_w4a16_{config}" + ("_halves" if config == "variable" and "gather" in target
                                                        else ""), 8)]
    ptx = Path(report.ptx_path).read_text(errors="replace")
    plain_ptx = Path(plain.ptx_path).read_text(errors="replace")
    assert "ld.global.s64" not in plain_ptx
    assert ptx.count("cp.async.cg") == plain_ptx.count("cp.async.cg")
    assert ptx.count("st.global") == plain_ptx.count("st.global")
    lines = ptx.splitlines()
    index_loads = [i for i, line in enumerate(lines) if "ld.global.s64" in line]
    assert index_loads
    # what each index load feeds: the next global access after it (a token copy or a c store)
    fed = set()
    for i in index_loads:
        following = next(line for line in lines[i + 1:] if "cp.async.cg" in line or "st.global" in line)
        fed.add("copy" if "cp.async.cg" in following else "store")
    assert fed == ({"copy"} if "gather" in target else {"store"}), (target, fed)


SWIGLU_TARGETS = [name for name, _arch, _compile in hopper.moe.moe_compile_targets() if name.endswith("_swiglu")]


@pytest.mark.parametrize("target", SWIGLU_TARGETS)
def test_swiglu_builds_store_half_the_columns_after_an_exact_silu(sm90_builds, target):
    """The SwiGLU epilogue (MoeEpilogue.activation): no local memory up to G = 8; silu's
    division to nearest (div.rn.f32, no approximate one) and an exponential; the gate and up
    values rounded to bf16 before it (cvt.rn); half the unfused build's stores: split-K's
    per-element stores (no stmatrix), the staged epilogue's stmatrix .x2 (one matrix per 8
    tokens of the 8 columns a warp keeps) where the unfused one has .x4."""
    assert len(SWIGLU_TARGETS) == 4
    report = sm90_builds[(target, 8)]
    assert report.error is None and report.frame_bytes == 0 and report.spill_bytes_max == 0
    path, config = target.removeprefix("sm90_moe_").removesuffix("_swiglu").split("_", 1)
    unfused = sm90_builds[(f"sm90_moe_{path}_{config}" + ("_halves" if path == "w4a16" and config == "variable"
                                                           else "_halves_f16" if path == "gemm" else ""), 8)]
    ptx = Path(report.ptx_path).read_text(errors="replace")
    unfused_ptx = Path(unfused.ptx_path).read_text(errors="replace")
    assert "div.rn.f32" in ptx and "div.approx" not in ptx and "ex2.approx" in ptx
    assert "cvt.rn.bf16.f32" in ptx and "div.rn.f32" not in unfused_ptx
    if "split_k" in config:
        stores = len(re.findall(r"st\.global\.(?:b16|u16)", ptx))
        assert stores and 2 * stores == len(re.findall(r"st\.global\.(?:b16|u16)", unfused_ptx))
        assert "stmatrix" not in ptx
    else:
        assert "stmatrix.sync.aligned.m8n8.x2.trans" in ptx and "stmatrix.sync.aligned.m8n8.x4" not in ptx
        assert ptx.count("stmatrix.sync.aligned.m8n8.x2.trans") == unfused_ptx.count("stmatrix.sync.aligned.m8n8.x4")
