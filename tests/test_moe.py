"""The MoE entry without a GPU: its validation (every host-visible rule, before any launch),
the scale layouts, the tiles the GPU derives from the offsets (emulated with the kernels' own
group_token_tiles), the scratch and grid bounds, the exact-decode reference and the torch op
traced by torch.compile(fullgraph=True) on CPU tensors."""

import dataclasses
import random

import pytest
import torch
from helpers import FP16_MAX, epilogue_of_sums, fp16_boundary_case

import nvfp4_group_gemm as gemm
from nvfp4_group_gemm import core, launch, moe, switches
from nvfp4_group_gemm.hopper import moe as hopper_moe
from nvfp4_group_gemm.hopper.config import CONFIGS as REGISTRY
from nvfp4_group_gemm.hopper.config import (
    SWAP_AB_CONFIG,
    SWAP_AB_ONE_ROUND_K128_CONFIG,
    SWAP_AB_SPLIT_K_CONFIG,
    SWAP_AB_T32_CONFIG,
    SWAP_AB_T32_K128_CONFIG,
    SWAP_AB_T32_SPLIT_K2_CONFIG,
    SWAP_AB_T32_SPLIT_K4_CONFIG,
    SWAP_AB_T64_CONFIG,
    SWAP_AB_T112_CONFIG,
    SWAP_AB_T192_CONFIG,
    SWAP_AB_VARIABLE_CONFIG,
    config_name,
)
from nvfp4_group_gemm.hopper.kernel import stage_scale_offset
from nvfp4_group_gemm.hopper.schedules import variable_token_split
from nvfp4_group_gemm.hopper.swap_ab import activation_scale_offset

CONFIGS = [SWAP_AB_CONFIG, SWAP_AB_ONE_ROUND_K128_CONFIG, SWAP_AB_SPLIT_K_CONFIG, SWAP_AB_T112_CONFIG,
           SWAP_AB_T192_CONFIG, SWAP_AB_VARIABLE_CONFIG, SWAP_AB_T32_CONFIG, SWAP_AB_T64_CONFIG]


def cpu_inputs(tokens=300, groups=4, n=256, k=512, **layouts):
    inputs = moe.random_moe_inputs(tokens, groups, n, k, device="cpu", generator=torch.Generator().manual_seed(3),
                                   **layouts)
    inputs["offsets"].copy_(torch.tensor([0, 10, 10, 200, 300][: groups + 1], dtype=torch.int32))
    return inputs


# -----------------------------------------------------------------------------
# Validation
# -----------------------------------------------------------------------------
def _bf16(inputs):
    """W4A16's a (bf16 [T, K]) and sfa (None) for inputs of cpu_inputs."""
    return {"a": torch.zeros(inputs["a"].shape[0], 2 * inputs["a"].shape[1], dtype=torch.bfloat16), "sfa": None}


def _replaced(inputs, **changes):
    out = dict(inputs)
    out.update(changes)
    return out


BAD_INPUTS = {
    "a_not_a_tensor": (lambda i: _replaced(i, a=[1, 2]), TypeError, r"a = list: must be a torch.Tensor"),
    "a_dtype": (lambda i: _replaced(i, a=i["a"].view(torch.uint8).to(torch.int16)), TypeError, r"a\.dtype"),
    "a_fp16": (lambda i: _replaced(i, a=torch.zeros(300, 512, dtype=torch.float16), sfa=None), TypeError,
               r"a\.dtype = torch\.float16: 16-bit activations must be bfloat16 \[T, K\] \(W4A16"),
    "w4a16_with_sfa": (lambda i: _replaced(i, a=torch.zeros(300, 512, dtype=torch.bfloat16)), ValueError,
                       r"sfa = a Tensor: must be None with bf16 activations \(W4A16 takes no activation scales\)"),
    "w4a16_k": (lambda i: _replaced(i, a=torch.zeros(300, 48, dtype=torch.bfloat16), sfa=None), ValueError,
                r"K \(a\.shape\[1\]\) = 48: must be a positive multiple of 64 \(the 64-wide k-tile"),
    "w4a16_b_k": (lambda i: _replaced(i, a=torch.zeros(300, 1024, dtype=torch.bfloat16), sfa=None), ValueError,
                  r"b\.shape\[2\] = 256: must be K/2 = 512, K from a\.shape\[1\]"),
    "w4a16_rank": (lambda i: _replaced(i, a=torch.zeros(300, 512, 1, dtype=torch.bfloat16), sfa=None), ValueError,
                   r"a\.shape = \(300, 512, 1\): must be \[T, K\]"),
    "b_dtype": (lambda i: _replaced(i, b=i["b"].view(torch.uint8).float()), TypeError, r"b\.dtype"),
    "sfa_dtype": (lambda i: _replaced(i, sfa=i["sfa"].view(torch.uint8).half()), TypeError, r"sfa\.dtype"),
    "offsets_dtype": (lambda i: _replaced(i, offsets=i["offsets"].long()), TypeError, r"offsets\.dtype .*int32"),
    "c_dtype": (lambda i: _replaced(i, c=i["c"].float()), TypeError, r"c\.dtype .*float16"),
    "alpha_dtype": (lambda i: _replaced(i, alpha=torch.ones(4, dtype=torch.float64)), TypeError,
                    r"alpha\.dtype = torch\.float64: must be one of torch\.float32"),
    "alpha_shape": (lambda i: _replaced(i, alpha=torch.ones(5)), ValueError,
                    r"alpha\.shape = \(5,\): must be \[G\] = \[4\] .* or \[G, 2\] = \[4, 2\]"),
    "alpha_halves_n": (lambda i: _replaced(i, alpha=torch.ones(4, 2), b=i["b"][:, :128].contiguous(),
                                           sfb=i["sfb"][:, :1].contiguous(), c=i["c"][:, :128].contiguous()),
                       ValueError, r"N \(b\.shape\[1\]\) = 128: must be a multiple of 256 with alpha \[G, 2\]"),
    "alpha_strided": (lambda i: _replaced(i, alpha=torch.ones(8)[::2]), ValueError, r"alpha\.stride\(\)"),
    "a_rank": (lambda i: _replaced(i, a=i["a"].unsqueeze(-1)), ValueError, r"a\.shape .*\[T, K/2\]"),
    "k_multiple": (lambda i: _replaced(i, a=i["a"][:, :24].contiguous(), sfa=i["sfa"][:, :3].contiguous(),
                                       b=i["b"][:, :, :24].contiguous(), sfb=i["sfb"][:, :, :3].contiguous()),
                   ValueError, r"K \(2 x a\.shape\[1\]\) = 48: must be a positive multiple of 64 .*K % 16 == 0"),
    "b_k": (lambda i: _replaced(i, b=i["b"][:, :, :128].contiguous()), ValueError, r"b\.shape\[2\] = 128"),
    "n_multiple": (lambda i: _replaced(i, b=i["b"][:, :200].contiguous(), sfb=i["sfb"][:, :200].contiguous()),
                   ValueError, r"N \(b\.shape\[1\]\) = 200: must be a positive multiple of 128"),
    "too_many_groups": (lambda i: _replaced(i, b=i["b"][:1].expand(513, -1, -1).contiguous()), ValueError,
                        r"G \(b\.shape\[0\]\) = 513: must be in 1\.\.512"),
    "a_strided": (lambda i: _replaced(i, a=i["a"].view(torch.uint8).repeat(1, 2)[:, ::2].view(i["a"].dtype)),
                  ValueError, r"a\.stride\(\) .* must be contiguous"),
    "sfa_shape": (lambda i: _replaced(i, sfa=i["sfa"][:100]), ValueError, r"sfa\.shape = \(100, 32\): must be \(300, 32\)"),
    "sfa_rank": (lambda i: _replaced(i, sfa=i["sfa"].unsqueeze(0)), ValueError, r"sfa\.shape"),
    "sfb_shape": (lambda i: _replaced(i, sfb=i["sfb"][:2]), ValueError, r"sfb\.shape"),
    "offsets_shape": (lambda i: _replaced(i, offsets=i["offsets"][:4]), ValueError,
                      r"offsets\.shape = \(4,\): must be \(5,\)"),
    "c_shape": (lambda i: _replaced(i, c=i["c"][:, :128]), ValueError, r"c\.shape = \(300, 128\): must be \(300, 256\)"),
    "c_transposed": (lambda i: _replaced(i, c=i["c"].t().contiguous().t()), ValueError, r"c\.stride\(\)"),
    "device": (lambda i: i, ValueError, r"a\.device = cpu: must be a CUDA device"),
    # the row maps (a_rows, c_rows): int64 [R], bf16 activations only, c [R, N] or, with c_rows, [T_c, N] given
    "rows_fp4": (lambda i: _replaced(i, a_rows=torch.arange(300)), ValueError,
                 r"a_rows = given: takes bf16 activations \(W4A16; a\.dtype = torch\.float4_e2m1fn_x2\)"),
    "a_rows_dtype": (lambda i: _replaced(i, **_bf16(i), a_rows=torch.arange(300, dtype=torch.int32)), TypeError,
                     r"a_rows\.dtype = torch\.int32: must be one of torch\.int64"),
    "a_rows_shape": (lambda i: _replaced(i, **_bf16(i), a_rows=torch.arange(300).view(3, 100)), ValueError,
                     r"a_rows\.shape = \(3, 100\): must be \[R\], R >= 1"),
    "a_rows_strided": (lambda i: _replaced(i, **_bf16(i), a_rows=torch.arange(600)[::2]), ValueError,
                       r"a_rows\.stride\(\)"),
    "c_rows_length": (lambda i: _replaced(i, **_bf16(i), a_rows=torch.arange(300), c_rows=torch.arange(299)),
                      ValueError, r"c_rows\.shape = \(299,\): must be \[R\] = \[300\], a_rows' length"),
    "c_rows_without_c": (lambda i: _replaced(i, **_bf16(i), c=None, c_rows=torch.arange(300)), ValueError,
                         r"c = None: must be given with c_rows"),
    "c_rows_c_n": (lambda i: _replaced(i, **_bf16(i), c=i["c"][:, :128].contiguous(), c_rows=torch.arange(300)),
                   ValueError, r"c\.shape = \(300, 128\): must be \[T_c, 256\]"),
    "a_rows_c_rows": (lambda i: _replaced(i, **_bf16(i), a_rows=torch.arange(100)), ValueError,
                      r"c\.shape = \(300, 256\): must be \(100, 256\) \(fp16 or bf16 \[R, N\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_naming_the_field_before_any_launch(case):
    make, kind, pattern = BAD_INPUTS[case]
    original = cpu_inputs()
    before = original["c"].clone()
    with pytest.raises(kind, match=pattern):
        gemm.moe_grouped_gemm(**make(original))
    assert torch.equal(original["c"].view(torch.int16), before.view(torch.int16))


def test_both_scale_layouts_pass_every_host_rule():
    for sfa_layout in ("plain", "blocked"):
        for sfb_layout in ("plain", "blocked"):
            inputs = cpu_inputs(sfa_layout=sfa_layout, sfb_layout=sfb_layout)
            with pytest.raises(ValueError, match="a.device = cpu"):  # only the device rule is left
                moe.check_moe_inputs(**inputs)


# -----------------------------------------------------------------------------
# Scale layouts
# -----------------------------------------------------------------------------
def test_blocked_scales_put_every_scale_where_the_kernels_read_it():
    rows, k = 300, 1024
    plain = torch.randint(0, 256, (rows, k // 16), dtype=torch.uint8)
    blocked = moe.blocked_scales(plain).flatten()
    for row in range(0, rows, 7):
        for block in range(0, k // 16, 3):
            assert blocked[activation_scale_offset(row, block, k)] == plain[row, block]
    # per group of a [G, N, K/16] stack: the atoms of stage_scale_offset, group after group
    weights = torch.randint(0, 256, (3, 256, k // 16), dtype=torch.uint8)
    stacked = moe.blocked_scales(weights)
    assert stacked.shape == (3, 2, k // 64, 32, 4, 4)
    flat = stacked.reshape(3, -1)
    for g in range(3):
        for row in (0, 31, 32, 127, 128, 255):
            for block in (0, 3, 4, 63):
                atom = (row // 128) * (k // 64) + block // 4
                offset = atom * 512 + stage_scale_offset(row % 128, block % 4)
                assert flat[g, offset] == weights[g, row, block]
    assert torch.equal(moe.plain_scales_of_blocked(moe.blocked_scales(plain), rows, k), plain)


# -----------------------------------------------------------------------------
# The tiles the GPU derives from the offsets (the kernels' own arithmetic, on Python ints)
# -----------------------------------------------------------------------------
def emulated_tiles(offsets, tokens, n, config, fill_ctas=132):
    """Sm90MoeSwapAbGemm.kernel's tile derivation for every CTA of the grid, on Python ints:
    (group, token0, tokens of the tile, weight tile, first X row) or None (no work)."""
    groups = len(offsets) - 1
    weight_tiles = n // config.tile_weights
    variable = config.variable_tokens
    rows = [offsets[g + 1] - offsets[g] for g in range(groups)]
    pads = [hopper_moe.group_x_row(offsets[g], g) for g in range(groups)]
    cap = hopper_moe.moe_token_cap(rows, weight_tiles, fill_ctas) if variable else config.tile_tokens
    runs = []  # (group, tiles of the run, tokens per tile, first token of the run) in CTA order
    for g, m in enumerate(rows):
        count, size = hopper_moe.group_token_tiles(m, cap, variable)
        if count:
            runs.append((g, count, size, 0))
    out = []
    for g, count, size, base in runs:
        m = rows[g]
        for local in range(count * weight_tiles):
            weight_tile, token_tile = divmod(local, count)
            token0 = base + token_tile * size
            tokens_here = min(size, -(-(m - token0) // 64) * 64) if variable else size
            out.append((g, token0, tokens_here, weight_tile, pads[g]))
    grid = hopper_moe.max_moe_tiles(tokens, groups, n, config, fill_ctas)
    assert len(out) <= grid, (offsets, len(out), grid)
    return out + [None] * (grid - len(out))


@pytest.mark.parametrize("config", CONFIGS, ids=config_name)
def test_every_output_element_has_exactly_one_tile_within_the_grid_and_the_scratch(config):
    rng = random.Random(11)
    for trial in range(200):
        groups = rng.choice([1, 2, 3, 8, 16, 64])
        tokens = rng.randint(1, 3000)
        n = rng.choice([128, 512, 4096])
        offsets = moe.random_routing(tokens, groups, rng)
        tiles = emulated_tiles(offsets, tokens, n, config)  # the grid: max_moe_tiles CTAs
        covered = {}
        rows = hopper_moe.slab_rows(tokens, groups, config)
        for tile in filter(None, tiles):
            g, token0, count, weight_tile, first_row = tile
            assert token0 % 16 == 0 and first_row % hopper_moe.GROUP_ROW_ALIGN == 0
            assert count % 16 == 0 and count <= config.tile_tokens
            # the GEMM's token copies read `count` rows from here: inside the scratch
            assert first_row + token0 + config.tile_tokens <= rows
            m = offsets[g + 1] - offsets[g]
            for token in range(token0, min(token0 + count, m)):
                key = (g, token, weight_tile)
                assert key not in covered, (trial, offsets, key)
                covered[key] = tile
        expected = {(g, t, w) for g in range(groups) for t in range(offsets[g + 1] - offsets[g])
                    for w in range(n // config.tile_weights)}
        assert set(covered) == expected, (trial, offsets)


def test_the_grid_counts_only_the_groups_that_can_hold_a_row():
    """T = 8 rows fill at most 8 of 64 groups: 8 token tiles per weight tile, not 64."""
    assert hopper_moe.max_moe_tiles(8, 64, 2048, SWAP_AB_T32_CONFIG) == 8 * 16
    assert hopper_moe.max_moe_tiles(8, 64, 2048, SWAP_AB_VARIABLE_CONFIG, fill_ctas=132) == 132
    tiles = [t for t in emulated_tiles([0, *range(1, 9)] + [8] * 56, 8, 2048, SWAP_AB_T32_CONFIG) if t]
    assert len(tiles) == 8 * 16
    for g in range(64):  # the X rows of every group clear of the next group's
        for first, m in ((0, 0), (5, 11), (16, 16), (1000, 33)):
            assert hopper_moe.group_x_row(first, g) % hopper_moe.GROUP_ROW_ALIGN == 0
            assert hopper_moe.group_x_row(first, g) + m < hopper_moe.group_x_row(first + m, g + 1)


def test_variable_tiles_are_cut_at_128_where_the_routing_fits_one_round():
    """Benchmark shape 3's routing (128 + 384 tokens, N = 4096: 4 x 32 tiles of 128) fits 132
    SMs; 200 + 312 (5 x 32) and shape 0's routing do not."""
    assert hopper_moe.moe_token_cap([128, 384], 32, 132) == 128
    assert hopper_moe.moe_token_cap([200, 312], 32, 132) == 256
    assert hopper_moe.moe_token_cap([80, 176, 128, 72, 64, 248, 96, 160], 32, 132) == 256
    tiles = [t for t in emulated_tiles([0, 128, 512], 512, 4096, SWAP_AB_VARIABLE_CONFIG) if t]
    assert len(tiles) == 128 and {t[2] for t in tiles} == {128}


def test_variable_tiles_split_a_group_as_the_per_size_set_path():
    for m in [1, 63, 64, 65, 200, 256, 257, 300, 511, 512, 513, 1000, 1024, 3000]:
        count, size = hopper_moe.group_token_tiles(m, 256, True)
        full_size, full, rest = variable_token_split(m, 256)
        assert size == full_size and count == full + (rest > 0), m
    assert hopper_moe.group_token_tiles(0, 256, True)[0] == 0
    assert hopper_moe.group_token_tiles(0, 128, False)[0] == 0


# -----------------------------------------------------------------------------
# Reference and op
# -----------------------------------------------------------------------------
def test_the_reference_computes_each_group_from_its_rows_only():
    inputs = cpu_inputs(sfa_layout="blocked", sfb_layout="plain")
    c = moe.moe_reference(inputs["a"], inputs["sfa"], inputs["b"], inputs["sfb"], inputs["offsets"], inputs["c"])
    assert torch.isnan(c[300:]).all() and not torch.isnan(c[:300]).any()
    sfa = moe.plain_scales_of_blocked(inputs["sfa"], 300, 512)
    from nvfp4_group_gemm import core as submission

    a = submission.decode_fp4(inputs["a"][200:300], sfa[200:300]).double()
    b = submission.decode_fp4(inputs["b"][3], inputs["sfb"][3]).double()
    assert torch.equal(c[200:300], (a @ b.T).half())


def test_the_torch_op_traces_with_fullgraph_and_mutates_c():
    inputs = cpu_inputs()
    expected = moe.moe_reference(inputs["a"], inputs["sfa"], inputs["b"], inputs["sfb"], inputs["offsets"])

    status = torch.full((1,), 7, dtype=torch.int32, device=inputs["a"].device)

    def layer(a, sfa, b, sfb, offsets, c):
        gemm.moe_grouped_gemm_op(a, sfa, b, sfb, offsets, c, status)
        return c.float().relu()

    out = torch.compile(layer, fullgraph=True, backend="eager")(**inputs)
    assert int(status.item()) == 0
    assert torch.equal(inputs["c"], expected)
    assert torch.equal(out, expected.float().relu())


def test_the_torch_op_schema_fake_and_its_direct_kernels():
    """The op as torch.library defines it (nvfp4_group_gemm.op: the schema custom_op inferred,
    a fake, the CPU and CUDA kernels registered on their keys with no Python wrapper between
    the dispatcher and them): its fake and AOT dispatch as opcheck tests them, with and without
    the optional arguments, and the CPU kernel is the entry's function itself."""
    from nvfp4_group_gemm import op

    assert op.moe_grouped_gemm_op._schema == torch._C.parse_schema("nvfp4_group_gemm::" + op.MOE_GROUPED_GEMM_SCHEMA)
    inputs = cpu_inputs(tokens=64, groups=2, n=128, k=256)
    inputs["offsets"].copy_(torch.tensor([0, 20, 64], dtype=torch.int32))
    status = torch.zeros(1, dtype=torch.int32)
    args = (inputs["a"], inputs["sfa"], inputs["b"], inputs["sfb"], inputs["offsets"], inputs["c"], status)
    alpha = torch.ones(2, dtype=torch.float32)
    for kwargs in ({}, {"alpha": alpha}):
        torch.library.opcheck(op.moe_grouped_gemm_op, args, kwargs,
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))  # no fp4 copy_ for test_schema
    kernels = {key: torch._C._dispatch_has_kernel_for_dispatch_key("nvfp4_group_gemm::moe_grouped_gemm", key)
               for key in ("CPU", "CUDA", "Meta", "AutogradCPU")}
    assert kernels == {"CPU": True, "CUDA": True, "Meta": True, "AutogradCPU": False}
    c = torch.zeros_like(inputs["c"])
    op.moe_grouped_gemm_op(*args[:5], c, status)
    assert torch.equal(c, moe.moe_reference(*args[:5]))


def test_the_config_is_chosen_from_t_g_n_k_alone(monkeypatch):
    """Split-K, one round of 128-token tiles, or variable tiles, by what fits one round for
    every routing of T tokens."""
    from nvfp4_group_gemm.hopper.config import (
        SWAP_AB_ONE_ROUND_CONFIG,
        SWAP_AB_SPLIT_K_CONFIG,
    )

    monkeypatch.delenv("NVFP4_MOE_CONFIG", raising=False)

    def chosen(tokens, groups, n, k, chain=True):
        return moe.moe_config(moe.MoeShape(tokens, groups, n, k, "plain", "blocked"), 132, chain_calls=chain)

    assert chosen(1024, 8, 4096, 7168) == SWAP_AB_VARIABLE_CONFIG  # benchmark shapes 0, 1
    assert chosen(1024, 8, 7168, 2048) == SWAP_AB_VARIABLE_CONFIG
    assert chosen(512, 2, 3072, 4096) == SWAP_AB_ONE_ROUND_K128_CONFIG  # 5 x 24 tiles at most
    assert chosen(512, 2, 4096, 1536) == SWAP_AB_VARIABLE_CONFIG  # 5 x 32 > 132: cut on the GPU
    assert chosen(512, 2, 3072, 4352) == SWAP_AB_ONE_ROUND_CONFIG  # K % 512 != 0
    assert chosen(100, 2, 1024, 1024) == SWAP_AB_SPLIT_K_CONFIG  # 3 x 8 tiles, twice: 48 CTAs
    assert not chosen(512, 2, 4096, 1536, chain=False).chain_calls
    # decode steps of many experts: a row or so per group holding one
    assert chosen(8, 64, 2048, 768) == SWAP_AB_T32_CONFIG  # K % 512 != 0
    assert chosen(8, 64, 1536, 2048) == SWAP_AB_T32_K128_CONFIG  # 8 x 12 tiles: one round of 3 per SM
    assert chosen(64, 64, 1536, 2048) == SWAP_AB_T32_CONFIG  # 64 x 12 tiles: more than one round
    assert chosen(4096, 64, 2048, 768) == SWAP_AB_T64_CONFIG  # 64 rows per group
    # not where its build takes local memory: W4A16's SwiGLU epilogue without row maps (a shared
    # expert's), weights packed for the fragment; with the rows gathered it is the 64-token one
    w4a16 = {"sfa_layout": None, "sfb_layout": "blocked", "alpha": "halves", "out_dtype": "bfloat16",
             "activation": "swiglu"}
    assert moe.moe_config(moe.MoeShape(4096, 64, 2048, 768, **w4a16), 132) == SWAP_AB_T32_CONFIG
    assert moe.moe_config(moe.MoeShape(4096, 64, 2048, 768, **w4a16, rows=(4096, None)), 132) == SWAP_AB_T64_CONFIG
    assert moe.moe_config(moe.MoeShape(4096, 64, 2048, 768, None, "blocked", b_layout="fragment"), 132
                          ) == SWAP_AB_T32_CONFIG
    # a row or two on a few experts: 32-token tiles split along K where they number at most
    # half the SMs, into as many ranks as leave each at least 16 k-tiles
    assert chosen(1, 32, 4096, 7168) == SWAP_AB_T32_SPLIT_K4_CONFIG  # 32 tiles, 28 k-tiles per rank
    assert chosen(1, 32, 7168, 2048) == SWAP_AB_T32_SPLIT_K2_CONFIG  # 56 tiles; 4 ranks: 8 k-tiles each
    assert chosen(2, 8, 4096, 14336) == SWAP_AB_T32_SPLIT_K4_CONFIG  # 2 experts x 32 tiles
    assert chosen(1, 32, 4096, 1024) == SWAP_AB_SPLIT_K_CONFIG  # 8 k-tiles per rank of 2: t128 split-K
    assert chosen(8, 64, 1536, 2048) == SWAP_AB_T32_K128_CONFIG  # 96 tiles: more than half the SMs
    assert [moe.t32_split_k(1, 32, 4096, k, 132) for k in (1024, 2048, 4096)] == [1, 2, 4]
    assert moe.t32_split_k(3, 32, 4096, 7168, 132) == 1  # 96 tiles > 66
    monkeypatch.setenv("NVFP4_MOE_CONFIG", "swap_ab_t128")
    switches.reload()
    assert chosen(1024, 8, 4096, 7168) == SWAP_AB_CONFIG


def test_the_sm100_version_is_behind_an_explicit_switch(monkeypatch):
    """On sm_100 the entry runs the sm_100a MoE kernels (compiled, never run here) only with
    NVFP4_MOE_SM100=1; otherwise one ValueError naming the switch and the check to run."""
    monkeypatch.delenv("NVFP4_MOE_SM100", raising=False)
    inputs = cpu_inputs()
    shape = moe.MoeShape(300, 4, 256, 512, "plain", "blocked")
    with pytest.raises(ValueError, match=r"NVFP4_MOE_SM100=1 .*tests/test_gpu_moe\.py"):
        moe._launch_sm100(shape, *(inputs[name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")), None, (), 0)
    monkeypatch.setenv("NVFP4_MOE_SM100", "yes")  # read by nvfp4_group_gemm.switches as every NVFP4_* switch
    with pytest.raises(ValueError, match=r"NVFP4_MOE_SM100='yes': must be one of 0, 1"):
        switches.reload()
    monkeypatch.setenv("NVFP4_MOE_SM100", "1")
    switches.reload()
    blocked = moe.MoeShape(300, 4, 256, 512, "blocked", "blocked")
    with pytest.raises(ValueError, match=r"plain activation scales"):
        moe._launch_sm100(blocked, *(inputs[name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")), None, (), 0)


def test_new_tensors_of_a_validated_layout_are_checked_for_what_differs(monkeypatch):
    """The miss path's short check (a layout validated before): the addresses' alignment and
    the devices; a misaligned address falls back to the full check and its message."""
    monkeypatch.setattr(moe, "_check_device", lambda *args: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(moe, "_LAYOUTS", core.RuntimeCache(max_entries=moe.MAX_LAYOUTS))  # read by name at each call
    inputs = cpu_inputs()
    names = ("a", "sfa", "b", "sfb", "offsets", "c")

    def checked(tensors):
        key = moe._binding_key(*(tensors[name] for name in names), None)
        return moe._checked_shape(key, *(tensors[name] for name in names), None)

    shape = checked(inputs)
    assert shape == moe.MoeShape(300, 4, 256, 512, "plain", "blocked") and len(moe._LAYOUTS) == 1
    buffer = torch.empty(inputs["a"].numel() + 8, dtype=torch.uint8)
    misaligned = dict(inputs, a=buffer[8:].view(inputs["a"].shape).view(inputs["a"].dtype))
    assert misaligned["a"].data_ptr() % 16 == 8
    with pytest.raises(ValueError, match=r"a\.data_ptr\(\) = 0x[0-9a-f]+: must be 16-byte aligned"):
        checked(misaligned)


def test_bindings_dropped_inside_a_capture_are_kept_to_the_next_call_outside_one(monkeypatch):
    """An evicted plan's bindings hold CUDA graphs, whose destruction inside a caller's capture
    (global mode) would invalidate that capture: dropped there, they are retired (launch.retire,
    the one place both entries retire to), and dropped for good outside a capture. A plan a
    capture used is pinned: never evicted."""
    import types

    monkeypatch.setattr(moe.RUNTIME, "plans", core.RuntimeCache(max_entries=moe.MAX_PLANS, pinned=lambda p: p.captured))
    monkeypatch.setattr(moe.RUNTIME, "bindings", core.RuntimeCache(max_entries=moe.MAX_BINDINGS))
    monkeypatch.setattr(launch, "RETIRED", [])
    for capturing in (True, False):
        monkeypatch.setattr(launch, "is_capturing", lambda capturing=capturing: capturing)
        moe.RUNTIME.plans.clear()
        moe.RUNTIME.bindings.clear()
        plans = [types.SimpleNamespace(captured=index == 0, nbytes=0) for index in range(moe.MAX_PLANS + 1)]
        for index, plan in enumerate(plans[:-1]):
            moe.RUNTIME.plans.put(index, plan)
        oldest, kept = types.SimpleNamespace(plan=plans[1]), types.SimpleNamespace(plan=plans[2])
        for key, binding in (("oldest", oldest), ("kept", kept), ("seen", moe._SEEN_ONCE)):
            moe.RUNTIME.bindings.put(((0, 0), key), binding)
        moe.RUNTIME.put_plan(moe.MAX_PLANS, plans[-1])
        assert 0 in moe.RUNTIME.plans and 1 not in moe.RUNTIME.plans and len(moe.RUNTIME.plans) == moe.MAX_PLANS  # 0 pinned
        assert dict(moe.RUNTIME.bindings.entries) == {((0, 0), "kept"): kept, ((0, 0), "seen"): moe._SEEN_ONCE}
        assert launch.RETIRED == ([plans[1], oldest] if capturing else [])
        launch.RETIRED.clear()




# -----------------------------------------------------------------------------
# The fallback chain and its first-use self-check
# -----------------------------------------------------------------------------
def test_the_chain_runs_the_choice_then_variable_tiles_then_the_exact_decode():
    shape = moe.MoeShape(8, 64, 1536, 2048, "plain", "blocked")  # decode: 32-token tiles
    chain = moe.moe_chain(shape, 132, chain_calls=True, forced=None)
    assert [c.name for c in chain] == ["swap_ab_t32_k128", "swap_ab_variable", "exact_decode"]
    assert chain[0].config[0] == moe.moe_config(shape, 132, True, None) and chain[-1].host
    assert chain[0].kernel_key(64) != chain[1].kernel_key(64)  # demoted one by one
    unchained = moe.moe_chain(shape, 132, chain_calls=False, forced=None)
    assert not any(c.config[0].chain_calls for c in unchained[:-1])
    variable = moe.MoeShape(1024, 8, 4096, 7168, "plain", "blocked")  # the choice is already variable tiles
    assert [c.name for c in moe.moe_chain(variable, 132, True, None)] == ["swap_ab_variable", "exact_decode"]
    forced = moe.moe_chain(shape, 132, True, "swap_ab_t128")  # a forced config: it, then the exact decode
    assert [c.name for c in forced] == ["swap_ab_t128", "exact_decode"]


class FakePlan:
    """What _self_check reads of a plan: its status word, its link and chain, its group count."""

    def __init__(self, chain, groups):
        self.status = torch.zeros(1, dtype=torch.int32)
        self.chain, self.choice, self.groups = chain, chain[0], groups
        self.kernel_key, self.checked = chain[0].kernel_key(groups), False


def test_a_self_check_that_agrees_marks_the_kernel_checked():
    inputs = cpu_inputs()
    expected = moe.moe_reference(**{name: inputs[name] for name in ("a", "sfa", "b", "sfb", "offsets")})
    inputs["c"].copy_(expected)
    shape = moe.MoeShape(300, 4, 256, 512, "plain", "blocked")
    plan = FakePlan(moe.moe_chain(shape, 132, True, None), 4)
    moe._self_check(plan, *(inputs[n] for n in ("a", "sfa", "b", "sfb", "offsets", "c")), None)
    assert plan.checked and plan.kernel_key in core.SELF_CHECKED and not core.is_demoted(plan.kernel_key)


def test_a_self_check_that_disagrees_demotes_the_kernel_and_returns_the_exact_result(capsys):
    inputs = cpu_inputs()
    names = ("a", "sfa", "b", "sfb", "offsets")
    expected = moe.moe_reference(**{name: inputs[name] for name in names})
    inputs["c"].copy_(expected)
    inputs["c"][150, 7] += 64  # one wrong output, in expert 2's rows (10 .. 200)
    shape = moe.MoeShape(300, 4, 256, 512, "plain", "blocked")
    chain = moe.moe_chain(shape, 132, True, None)
    plan = FakePlan(chain, 4)
    moe._self_check(plan, *(inputs[n] for n in ("a", "sfa", "b", "sfb", "offsets", "c")), None)
    assert core.is_demoted(chain[0].kernel_key(4)) and not core.is_demoted(chain[1].kernel_key(4))
    assert torch.equal(inputs["c"][:300].nan_to_num(9), expected[:300].nan_to_num(9))
    line = capsys.readouterr().err
    assert "1 of" in line and "expert 2 row 150 column 7" in line and f"next: {chain[1].name}" in line
    import types

    compiled = []  # the next call: the first link of the chain not demoted, compiled
    backend = types.SimpleNamespace(name=moe.MOE_BACKEND, compile=lambda choice, groups: compiled.append(choice))
    assert core.choose_kernel(backend, chain, 4) is chain[1] and compiled == [chain[1]]


def test_bad_offsets_are_not_self_checked():
    inputs = cpu_inputs()
    shape = moe.MoeShape(300, 4, 256, 512, "plain", "blocked")
    plan = FakePlan(moe.moe_chain(shape, 132, True, None), 4)
    status = torch.ones(1, dtype=torch.int32)  # the pre-pass flagged the offsets
    moe._self_check(plan, *(inputs[n] for n in ("a", "sfa", "b", "sfb", "offsets", "c")), status)
    assert not plan.checked and not core.is_demoted(plan.kernel_key) and torch.isnan(inputs["c"]).all()


def test_a_demotion_drops_the_plans_of_that_kernel_and_their_bindings():
    import types

    shape = moe.MoeShape(300, 4, 256, 512, "plain", "blocked")
    chain = moe.moe_chain(shape, 132, True, None)
    doomed, other = FakePlan(chain, 4), FakePlan(chain[1:], 4)
    for plan in (doomed, other):
        plan.captured, plan.nbytes = False, 100
        moe.RUNTIME.plans.put(("key", plan.choice.name), plan)
    moe.RUNTIME.bindings.put(((0, 0), "doomed"), types.SimpleNamespace(plan=doomed))
    moe.RUNTIME.bindings.put(((0, 0), "other"), types.SimpleNamespace(plan=other))
    core.demote(moe.MOE_BACKEND, chain[0], chain, 4, "a test")
    assert list(moe.RUNTIME.plans.entries) == [("key", chain[1].name)]
    assert list(moe.RUNTIME.bindings.entries) == [((0, 0), "other")]
    assert moe.RUNTIME.plans.nbytes == 100  # the byte count follows the dropped plan


def test_a_demotion_of_the_sm100_kernel_drops_its_plans_bindings_and_their_bytes():
    """The sm_100 MoE kernel is demoted like the sm_90 ones: its plans go (and the plan cache's
    byte count with them), so no binding of it launches again."""
    import types

    shape = moe.MoeShape(300, 4, 256, 512, "plain", "blocked")
    chain = [core.KernelChoice(moe.SM100_MOE_BACKEND, "sm100_moe", shape.epilogue(), per_group_count=True),
             core.KernelChoice(moe.SM100_MOE_BACKEND, "exact_decode", host=True)]
    doomed = moe.Sm100MoePlan(types.SimpleNamespace(), {"scratch": torch.zeros(256, dtype=torch.uint8)}, chain, 4)
    other = FakePlan(moe.moe_chain(shape, 132, True, None), 4)
    other.captured, other.nbytes = False, 1000
    moe.RUNTIME.plans.put("doomed", doomed)
    moe.RUNTIME.plans.put("other", other)
    assert moe.RUNTIME.plans.nbytes == 1256
    moe.RUNTIME.bindings.put(((0, 0), "doomed"), types.SimpleNamespace(plan=doomed))
    moe.RUNTIME.bindings.put(((0, 0), "other"), types.SimpleNamespace(plan=other))
    core.demote(moe.SM100_MOE_BACKEND, chain[0], chain, 4, "a test")
    assert list(moe.RUNTIME.plans.entries) == ["other"] and list(moe.RUNTIME.bindings.entries) == [((0, 0), "other")]
    assert moe.RUNTIME.plans.nbytes == 1000


def test_the_hit_path_keeps_bindings_least_recently_used_first(monkeypatch):
    """A hit touches its binding: with MAX_BINDINGS bindings cached, the next new one evicts the
    binding used longest ago, not the first one made."""
    import types

    inputs = cpu_inputs()
    names = ("a", "sfa", "b", "sfb", "offsets", "c")
    monkeypatch.setattr(launch, "current_stream_handle", lambda: 0)
    monkeypatch.setattr(core, "current_device_index", lambda: 0)
    monkeypatch.setattr(moe.RUNTIME, "bindings", core.RuntimeCache(max_entries=2))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda tensor: True))  # CPU tensors stand in for CUDA ones
    launches = []
    first = types.SimpleNamespace(launch=lambda: launches.append("first"))
    key = ((0, 0), moe._binding_key(*(inputs[n] for n in names), None))
    moe.RUNTIME.bindings.put(key, first)
    moe.RUNTIME.bindings.put("second", types.SimpleNamespace(launch=None))
    moe.moe_grouped_gemm(*(inputs[n] for n in names))  # a hit on the first binding made
    assert launches == ["first"]
    assert moe.RUNTIME.bindings.put("third", types.SimpleNamespace()) and list(moe.RUNTIME.bindings.entries) == [
        key, "third"]


def test_the_exact_link_writes_valid_calls_and_flags_bad_offsets(monkeypatch):
    inputs = cpu_inputs()
    names = ("a", "sfa", "b", "sfb", "offsets", "c")
    shape = moe.MoeShape(300, 4, 256, 512, "plain", "blocked")
    status = torch.full((1,), 7, dtype=torch.int32)
    moe._exact_call(*(inputs[n] for n in names), status, shape)
    expected = moe.moe_reference(**{n: inputs[n] for n in names[:5]})
    assert int(status) == 0 and torch.equal(inputs["c"], expected)
    inputs["offsets"].copy_(torch.tensor([0, 10, 5, 200, 300], dtype=torch.int32))  # decreasing
    inputs["c"].fill_(float("nan"))
    moe._exact_call(*(inputs[n] for n in names), status, shape)
    assert int(status) == 1 and torch.isnan(inputs["c"]).all()
    monkeypatch.setattr(launch, "is_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot run under a CUDA graph capture"):
        moe._exact_call(*(inputs[n] for n in names), status, shape)


# -----------------------------------------------------------------------------
# Real checkpoints: per-expert scales (alpha) and bf16 output
# -----------------------------------------------------------------------------
def test_alpha_and_cs_dtype_make_the_shape_and_its_epilogue(monkeypatch):
    monkeypatch.setattr(moe, "_check_device", lambda *args: None)  # CPU tensors stand in for CUDA ones
    inputs = cpu_inputs()
    assert moe.check_moe_inputs(**inputs) == moe.MoeShape(300, 4, 256, 512, "plain", "blocked", None, "float16")
    bf16 = dict(inputs, c=inputs["c"].bfloat16())
    shape = moe.check_moe_inputs(**bf16, alpha=torch.ones(4))
    assert (shape.alpha, shape.out_dtype) == ("expert", "bfloat16")
    assert shape.epilogue() == hopper_moe.MoeEpilogue("expert", "bfloat16")
    assert moe.check_moe_inputs(**inputs, alpha=torch.ones(4, 2)).alpha == "halves"
    # a kernel per epilogue: demoted and self-checked one by one
    links = [moe.moe_chain(s, 132, True, None)[0] for s in (moe.check_moe_inputs(**inputs), shape)]
    assert links[0].kernel_key(4) != links[1].kernel_key(4)


def test_a_new_c_is_bf16(monkeypatch):
    seen = []
    monkeypatch.setattr(moe, "_launch_miss", lambda *args, **kwargs: seen.append(args[5]))
    inputs = cpu_inputs()
    del inputs["c"]
    out = gemm.moe_grouped_gemm(**inputs)
    assert out.dtype == torch.bfloat16 and out.shape == (300, 256) and seen == [out]


@pytest.mark.parametrize("halves", [False, True])
def test_the_reference_scales_each_expert_and_rounds_to_cs_dtype(halves):
    inputs = cpu_inputs()
    names = ("a", "sfa", "b", "sfb", "offsets")
    alpha = torch.tensor([[0.5, 3.0], [2.0**-10, 7.0], [1.25, 0.0], [100.0, -2.0]])
    if not halves:
        alpha = alpha[:, 0].contiguous()
    unscaled = moe.moe_reference(**{n: inputs[n] for n in names}, c=torch.zeros(300, 256, dtype=torch.float64))
    for dtype in (torch.float16, torch.bfloat16):
        out = moe.moe_reference(**{n: inputs[n] for n in names}, c=torch.zeros(300, 256, dtype=dtype), alpha=alpha)
        for g, (lo, hi) in enumerate(([0, 10], [10, 10], [10, 200], [200, 300])):
            scale = alpha[g].repeat_interleave(128) if halves else alpha[g]
            # the epilogue's order: the sum in fp32, one fp32 multiply by alpha, then c's dtype
            fp32_product = (unscaled[lo:hi].float().double() * scale.double()).float()
            assert torch.equal(out[lo:hi], fp32_product.to(dtype)), (dtype, g)


def test_past_the_output_types_range_the_result_is_inf_as_a_plain_cast():
    inputs = cpu_inputs()
    names = ("a", "sfa", "b", "sfb", "offsets")
    exact = moe.moe_reference(**{n: inputs[n] for n in names}, c=torch.zeros(300, 256, dtype=torch.float64))
    alpha = torch.full((4,), 1e4)
    out = moe.moe_reference(**{n: inputs[n] for n in names}, c=torch.zeros(300, 256, dtype=torch.float16), alpha=alpha)
    big = (exact * 1e4).abs() > 65520  # past fp16's largest finite value and its rounding margin
    assert big.any() and torch.isinf(out[big]).all() and torch.equal(torch.sign(out[big]), torch.sign(exact[big]).half())


def test_the_op_on_cpu_tensors_takes_alpha_and_bf16():
    inputs = cpu_inputs()
    alpha = torch.tensor([1.0, 2.0, 0.5, 4.0])
    c = torch.full((300, 256), float("nan"), dtype=torch.bfloat16)
    status = torch.full((1,), 7, dtype=torch.int32)
    gemm.moe_grouped_gemm_op(inputs["a"], inputs["sfa"], inputs["b"], inputs["sfb"], inputs["offsets"], c, status,
                             alpha)
    expected = moe.moe_reference(**{n: inputs[n] for n in ("a", "sfa", "b", "sfb", "offsets")},
                                 c=torch.zeros(300, 256, dtype=torch.bfloat16), alpha=alpha)
    assert int(status) == 0 and torch.equal(c, expected)


def test_the_self_check_scales_its_bound_and_allows_one_bf16_unit():
    """With alpha and bf16 output the check compares against the exact product times alpha,
    its fp32 bound scaled by alpha, plus one bf16 unit in the last place: a kernel one unit off
    (the fp32 product's rounding to bf16) passes; one 4 units off is demoted."""
    inputs = cpu_inputs()
    names = ("a", "sfa", "b", "sfb", "offsets")
    alpha = torch.tensor([1.0, 2.0, 0.5, 3.0])
    expected = moe.moe_reference(**{n: inputs[n] for n in names}, c=torch.zeros(300, 256, dtype=torch.bfloat16),
                                 alpha=alpha)
    shape = moe.MoeShape(300, 4, 256, 512, "plain", "blocked", "expert", "bfloat16")
    for units, demoted in ((1, False), (4, True)):
        core.reset_runtime()
        c = expected.clone()
        value = c[150, 7].float()
        c[150, 7] = (value + units * value.abs() * 2.0**-8).bfloat16()  # about `units` bf16 units off
        assert c[150, 7] != expected[150, 7]
        plan = FakePlan(moe.moe_chain(shape, 132, True, None), 4)
        moe._self_check(plan, *(inputs[n] for n in names), c, None, alpha)
        assert core.is_demoted(plan.kernel_key) == demoted, units


def test_the_sm100_version_states_its_own_limits(monkeypatch):
    """On sm_100 (NVFP4_MOE_SM100=1): at most the core's 64 experts, and alpha [G, 2] with N a
    multiple of 512 (each half of N whole 256-row MMA tiles); one ValueError each, before any
    launch."""
    monkeypatch.setattr(switches, "CURRENT", dataclasses.replace(switches.CURRENT, moe_sm100=True))
    inputs = cpu_inputs()
    tensors = [inputs[name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")]
    many = moe.MoeShape(300, 128, 256, 512, "plain", "blocked")
    with pytest.raises(ValueError, match=r"G \(b\.shape\[0\]\) = 128: must be in 1\.\.64 on sm_100"):
        moe._launch_sm100(many, *tensors, None, (), 0)
    halves = moe.MoeShape(300, 4, 256, 512, "plain", "blocked", "halves", "bfloat16")
    with pytest.raises(ValueError, match=r"N \(b\.shape\[1\]\) = 256: must be a multiple of 512 with alpha \[G, 2\]"):
        moe._launch_sm100(halves, *tensors, None, (), 0, torch.ones(4, 2))


# -----------------------------------------------------------------------------
# W4A16: bf16 activations, read by the GEMM, no activation scales
# -----------------------------------------------------------------------------
def w4a16_inputs(tokens=300, groups=4, n=256, k=512):
    inputs = cpu_inputs(tokens, groups, n, k)
    generator = torch.Generator().manual_seed(5)
    inputs["a"] = (torch.randn(tokens, k, generator=generator) * 4).bfloat16()
    inputs["sfa"] = None
    inputs["c"] = inputs["c"].bfloat16()
    return inputs


def test_bf16_activations_make_a_w4a16_shape_and_unchained_links(monkeypatch):
    monkeypatch.setattr(moe, "_check_device", lambda *args: None)
    inputs = w4a16_inputs()
    shape = moe.check_moe_inputs(**inputs, alpha=torch.ones(4, 2))
    assert shape == moe.MoeShape(300, 4, 256, 512, None, "blocked", "halves", "bfloat16") and shape.w4a16
    assert not moe.check_moe_inputs(**cpu_inputs()).w4a16
    for chain_calls in (True, False):
        chain = moe.moe_chain(shape, 132, chain_calls, None)
        assert chain[-1].host and all(not (c.config[0].pdl or c.config[0].chain_calls) for c in chain[:-1])
        assert "bf16 activations (W4A16)" in chain[0].label
    # the fp4 path's link of the same sizes is another kernel (demoted and self-checked on its own)
    fp4 = moe.MoeShape(300, 4, 256, 512, "plain", "blocked", "halves", "bfloat16")
    assert moe.moe_chain(fp4, 132, True, None)[0].kernel_key(4) != moe.moe_chain(shape, 132, True, None)[0].kernel_key(4)
    # the GEMM refuses a chained config (it has no pre-pass to chain to)
    with pytest.raises(ValueError, match="no pre-pass to chain to"):
        hopper_moe.Sm90MoeW4A16Gemm(dataclasses.replace(SWAP_AB_T32_CONFIG, pdl=True), 4)


def test_the_w4a16_reference_is_the_float64_product_of_the_bf16_rows_and_the_decoded_weights():
    inputs = w4a16_inputs()
    names = ("a", "sfa", "b", "sfb", "offsets")
    alpha = torch.tensor([0.5, 3.0, 2.0**-6, 7.0])
    out = moe.moe_reference(**{n: inputs[n] for n in names}, c=torch.zeros(300, 256, dtype=torch.float64),
                            alpha=alpha)
    sfb_plain = torch.stack([moe.plain_scales_of_blocked(inputs["sfb"][g], 256, 512) for g in range(4)])
    for g, (lo, hi) in enumerate(([0, 10], [10, 10], [10, 200], [200, 300])):
        weights = core.decode_fp4(inputs["b"][g], sfb_plain[g]).double()
        expected = inputs["a"][lo:hi].double() @ weights.T * float(alpha[g])
        assert torch.equal(out[lo:hi], expected), g
    # and it is what the fp4 path gives for activations that are exact e2m1 x e4m3 values
    fp4 = cpu_inputs()
    sfa = fp4["sfa"] if fp4["sfa"].dim() == 2 else moe.plain_scales_of_blocked(fp4["sfa"], 300, 512)
    decoded = core.decode_fp4(fp4["a"], sfa).bfloat16()  # exact: e2m1 x e4m3 has at most 6 significant bits
    assert torch.equal(decoded.double(), core.decode_fp4(fp4["a"], sfa).double())
    both = [moe.moe_reference(a, s, fp4["b"], fp4["sfb"], fp4["offsets"], c=torch.zeros(300, 256, dtype=torch.float64))
            for a, s in ((fp4["a"], fp4["sfa"]), (decoded, None))]
    assert torch.equal(both[0], both[1])


def test_the_op_on_cpu_tensors_takes_bf16_activations():
    inputs = w4a16_inputs()
    alpha = torch.tensor([1.0, 2.0, 0.5, 4.0])
    c = torch.full((300, 256), float("nan"), dtype=torch.bfloat16)
    status = torch.full((1,), 7, dtype=torch.int32)
    gemm.moe_grouped_gemm_op(inputs["a"], None, inputs["b"], inputs["sfb"], inputs["offsets"], c, status, alpha)
    expected = moe.moe_reference(inputs["a"], None, inputs["b"], inputs["sfb"], inputs["offsets"],
                                 c=torch.zeros(300, 256, dtype=torch.bfloat16), alpha=alpha)
    assert int(status) == 0 and torch.equal(c, expected)


def test_the_w4a16_self_check_bounds_fp32_accumulation_and_catches_a_wrong_output(capsys):
    """The W4A16 check: the exact product within fp32 accumulation's bound (every bf16 x weight
    product exact, only the additions round) plus one bf16 unit; a kernel that decoded one
    weight wrong is demoted."""
    inputs = w4a16_inputs()
    names = ("a", "sfa", "b", "sfb", "offsets")
    expected = moe.moe_reference(**{n: inputs[n] for n in names}, c=torch.zeros(300, 256, dtype=torch.bfloat16))
    shape = moe.MoeShape(300, 4, 256, 512, None, "blocked", None, "bfloat16")
    plan = FakePlan(moe.moe_chain(shape, 132, True, None), 4)
    moe._self_check(plan, *(inputs[n] for n in names), expected.clone(), None)
    assert plan.checked and not core.is_demoted(plan.kernel_key)
    core.reset_runtime()
    wrong = expected.clone()
    wrong[150, 7] = wrong[150, 7] * 1.5 + 1
    plan = FakePlan(moe.moe_chain(shape, 132, True, None), 4)
    moe._self_check(plan, *(inputs[n] for n in names), wrong, None)
    assert core.is_demoted(plan.kernel_key) and "expert 2 row 150 column 7" in capsys.readouterr().err
    bound = moe.w4a16_accumulation_bound(inputs["a"][10:200], inputs["b"][2], moe.plain_scales_of_blocked(
        inputs["sfb"][2], 256, 512))
    assert bound.shape == (190, 256) and bool((bound > 0).all()) and float(bound.max()) < 1e-2 * float(
        expected[10:200].float().abs().max())


def test_the_sm100_version_refuses_bf16_activations_naming_the_fp4_path(monkeypatch):
    monkeypatch.setattr(switches, "CURRENT", dataclasses.replace(switches.CURRENT, moe_sm100=True))
    inputs = w4a16_inputs()
    shape = moe.MoeShape(300, 4, 256, 512, None, "blocked", None, "bfloat16")
    with pytest.raises(TypeError, match=r"bf16 activations \(W4A16\) run on sm_90 only; .*\(the fp4 path"):
        moe._launch_sm100(shape, *(inputs[n] for n in ("a", "sfa", "b", "sfb", "offsets", "c")), None, (), 0)


# -----------------------------------------------------------------------------
# K any multiple of 64 (the down projection's K: an expert's intermediate size, 1408, 2880)
# -----------------------------------------------------------------------------
K_NOT_256 = (64, 192, 1408, 2880)
# every swap-AB config of the registry (the choice's and NVFP4_MOE_CONFIG's)
CONFIGS_BY_NAME = {name: config for name, config in REGISTRY.items() if name.startswith("swap_ab")}


@pytest.mark.parametrize("k", K_NOT_256)
def test_k_a_multiple_of_64_passes_every_host_rule(k):
    """K % 64 == 0 is the rule (K = 48 is refused naming it: BAD_INPUTS' k_multiple, w4a16_k)."""
    for sfa_layout in ("plain", "blocked", None):
        inputs = moe.random_moe_inputs(300, 4, 256, k, sfa_layout=sfa_layout, device="cpu",
                                       generator=torch.Generator().manual_seed(k))
        with pytest.raises(ValueError, match="a.device = cpu"):  # only the device rule is left
            moe.check_moe_inputs(**inputs)


@pytest.mark.parametrize("k", K_NOT_256)
def test_the_exact_decode_and_the_blocked_scales_at_k_not_a_multiple_of_256(k):
    """prepare_weight_scales / blocked_scales at K/64 atoms along K (not a multiple of 4): the
    inverse gives the plain scales back, the pre-pass's byte offset of every activation scale
    is where blocked_scales put it, and the exact decode gives the same result from either
    layout, equal to the float64 product of the decoded rows (and within the bound, 0
    mismatches, against itself through compare_with_exact)."""
    tokens, groups, n = 200, 3, 256
    generator = torch.Generator().manual_seed(k)
    plain = moe.random_moe_inputs(tokens, groups, n, k, sfb_layout="plain", device="cpu", generator=generator)
    sfb_blocked = moe.prepare_weight_scales(plain["sfb"])
    assert sfb_blocked.shape == (groups, n // 128, k // 64, 32, 4, 4)
    for g in range(groups):
        assert torch.equal(moe.plain_scales_of_blocked(sfb_blocked[g], n, k).view(torch.uint8),
                           plain["sfb"][g].view(torch.uint8))
    sfa_blocked = moe.blocked_scales(plain["sfa"])
    assert sfa_blocked.shape == (-(-tokens // 128), k // 64, 32, 4, 4)
    flat = sfa_blocked.view(torch.uint8).reshape(-1)
    for row in (0, 1, 127, 128, tokens - 1):
        for block in range(k // 16):
            assert flat[activation_scale_offset(row, block, k)] == plain["sfa"].view(torch.uint8)[row, block]
    offsets = [0, 50, 50, 170]
    plain["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
    names = ("a", "sfa", "b", "sfb", "offsets")
    from_plain = moe.moe_reference(**{x: plain[x] for x in names}, c=torch.zeros(tokens, n, dtype=torch.float64))
    from_blocked = moe.moe_reference(plain["a"], sfa_blocked, plain["b"], sfb_blocked, plain["offsets"],
                                     c=torch.zeros(tokens, n, dtype=torch.float64))
    assert torch.equal(from_plain, from_blocked)
    for g in range(groups):
        lo, hi = offsets[g], offsets[g + 1]
        expected = (core.decode_fp4(plain["a"][lo:hi], plain["sfa"][lo:hi]).double()
                    @ core.decode_fp4(plain["b"][g], plain["sfb"][g]).double().T)
        assert torch.equal(from_plain[lo:hi], expected)
    c = moe.moe_reference(**{x: plain[x] for x in names}, c=torch.zeros(tokens, n, dtype=torch.float16))
    assert moe.compare_with_exact(plain["a"], sfa_blocked, plain["b"], sfb_blocked, plain["offsets"], c)[0] == 0


@pytest.mark.parametrize("k", (*K_NOT_256, 256, 1024, 7168))
def test_the_config_follows_k(k):
    """moe_k_config: K a multiple of the config's k_multiple keeps the config (the kernels of
    before); else the k_tail build, with 64-wide k-tiles where K % 128 != 0. Over every
    config the choice or NVFP4_MOE_CONFIG can run, the k-tile shares the kernel computes (rank
    r of s: r (t // s) + min(r, t % s) on) cover K's k-tiles once, each rank's in order."""
    for name, registered in CONFIGS_BY_NAME.items():
        for config in (registered, hopper_moe.w4a16_config(registered)):
            fitted = hopper_moe.moe_k_config(config, k)
            assert k % fitted.tile_k == 0
            if k % config.k_multiple == 0:
                assert fitted is config, name
                continue
            assert fitted.k_tail and not fitted.unrolled_main_loop, name
            assert fitted.k_halves == (config.k_halves if k % config.tile_k == 0 else 1), name
            assert (fitted.tile_tokens, fitted.split_k, fitted.variable_tokens, fitted.pdl, fitted.chain_calls) == (
                config.tile_tokens, config.split_k, config.variable_tokens, config.pdl, config.chain_calls), name
            assert (fitted.split_k, fitted.ctas_per_sm) != (4, 4), name  # k_tail_config: 3 CTAs there
            total, split = k // fitted.tile_k, fitted.split_k
            share = total // split
            covered = []
            for rank in range(split):
                begin = rank * share + min(rank, total - share * split)
                count = (rank + 1) * share + min(rank + 1, total - share * split) - begin
                covered += range(begin, begin + count)
            assert covered == list(range(total)), (name, k)
    shape = moe.MoeShape(8, 128, 4096, k, "plain", "blocked")
    for choice in moe.moe_chain(shape, 132, True, None)[:-1]:
        config = choice.config[0]
        assert config.k_tail == (k % 256 != 0), (k, choice.name)
        assert ("k_tail=True" in choice.name) == config.k_tail


@pytest.mark.parametrize("w4a16", [False, True], ids=["fp4", "w4a16"])
@pytest.mark.parametrize("alpha_mode", ["expert", "halves"])
@pytest.mark.parametrize("k", [64, 1408, 1024])
def test_the_exact_decode_rounds_at_fp16s_boundary_as_the_kernels_epilogue(w4a16, alpha_mode, k):
    """Sums exact in fp32 times alphas that land alpha x s at 65504, 65519.996, 65520 (a tie,
    rounded to even: inf), past it, and at a double-rounding case (an exact product within
    2^-9 below 65520: inf through fp32, as the kernel's fp32 multiply then cvt.rn rounds it):
    the exact decode's c is bit for bit the kernel's epilogue formula (epilogue_of_sums; its
    PTX: tests/test_hopper.py), in fp16 and bf16."""
    inputs, alpha, sums, products = fp16_boundary_case(64, 8, k, w4a16=w4a16, alpha_mode=alpha_mode)
    columns = moe.alpha_columns(alpha, 256).repeat_interleave(8, dim=0)
    for dtype in (torch.float16, torch.bfloat16):
        out = moe.moe_reference(**inputs, c=torch.zeros(64, 256, dtype=dtype), alpha=alpha)
        assert torch.equal(out.view(torch.int16), epilogue_of_sums(sums, columns, dtype).view(torch.int16))
    out = moe.moe_reference(**inputs, c=torch.zeros(64, 256, dtype=torch.float16), alpha=alpha)
    magnitude = products.abs()
    assert (out[magnitude == FP16_MAX].abs() == FP16_MAX).all() and (magnitude == FP16_MAX).any()
    below = (magnitude > 65519.99) & (magnitude < 65520)  # 65519.996 (an fp32 value) and the double-rounding case
    assert (out[below & (magnitude.float() < 65520)].abs() == FP16_MAX).all()
    assert torch.isinf(out[below & (magnitude.float() == 65520)]).all() and (below & (magnitude.float() == 65520)).any()
    assert torch.isinf(out[magnitude >= 65520]).all() and not torch.isinf(out[magnitude.float() < 65520]).any()


# -----------------------------------------------------------------------------
# Row maps (a_rows, c_rows): the W4A16 GEMM reads and writes the rows they name
# -----------------------------------------------------------------------------
def _row_map_case(seed, tokens=7, top_k=3, groups=4, n=256, k=512):
    """A layer's routing of `tokens` tokens to `top_k` of `groups` experts: x [T, K] bf16, the
    pairs' expert-sorted order, offsets, a_rows = order // k (the pairs' tokens), c_rows = order."""
    generator = torch.Generator().manual_seed(seed)
    inputs = w4a16_inputs(tokens * top_k, groups, n, k)
    x = (torch.randn(tokens, k, generator=generator) * 4).bfloat16()
    experts = torch.randint(0, groups, (tokens * top_k,), generator=generator)
    _, order = torch.sort(experts, stable=True)
    offsets = torch.zeros(groups + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.bincount(experts, minlength=groups), 0)
    return x, inputs["b"], inputs["sfb"], offsets, order // top_k, order


@pytest.mark.parametrize("seed", range(4))
def test_row_maps_read_and_write_the_rows_they_name(seed):
    """The exact decode with a_rows and c_rows (the op's CPU implementation, and what the GPU
    kernel is checked against) is the gathered rows' product un-permuted: row r of the groups
    read from a[a_rows[r]] and written to c[c_rows[r]]; an index outside a reads zeros, one
    outside c writes nothing, and c's other rows are untouched."""
    x, b, sfb, offsets, a_rows, c_rows = _row_map_case(seed)
    rows = a_rows.shape[0]
    alpha = torch.rand(4, generator=torch.Generator().manual_seed(seed)) + 0.5
    grouped = moe.moe_reference(x[a_rows], None, b, sfb, offsets, torch.zeros(rows, 256, dtype=torch.bfloat16),
                                alpha)
    c = torch.full((rows + 2, 256), float("nan"), dtype=torch.bfloat16)
    status = torch.full((1,), 7, dtype=torch.int32)
    gemm.moe_grouped_gemm_op(x, None, b, sfb, offsets, c, status, alpha, a_rows, c_rows)
    assert int(status) == 0
    assert torch.equal(c[c_rows], grouped) and torch.isnan(c[rows:]).all()
    # the gather alone: c in group order
    gathered = torch.full((rows, 256), float("nan"), dtype=torch.bfloat16)
    gemm.moe_grouped_gemm_op(x, None, b, sfb, offsets, gathered, status, alpha, a_rows, None)
    assert torch.equal(gathered, grouped)
    # indices outside: row 0 reads zeros (a_rows -1), row 1 is written nowhere (c_rows past c)
    a_outside, c_outside = a_rows.clone(), c_rows.clone()
    a_outside[0], c_outside[1] = -1, rows + 2
    zeroed = x[a_rows].clone()
    zeroed[0] = 0
    expected = moe.moe_reference(zeroed, None, b, sfb, offsets, torch.zeros(rows, 256, dtype=torch.bfloat16), alpha)
    c.fill_(float("nan"))
    gemm.moe_grouped_gemm_op(x, None, b, sfb, offsets, c, status, alpha, a_outside, c_outside)
    written = torch.ones(rows, dtype=torch.bool)
    written[1] = False
    assert torch.equal(c[c_rows[written]], expected[written]) and int(expected[0].abs().sum()) == 0
    assert torch.isnan(c[c_rows[1]]).all() and torch.isnan(c[rows:]).all()
    # bad offsets (past the R grouped rows): nothing written, status 1
    c.fill_(float("nan"))
    bad = offsets.clone()
    bad[-1] = rows + 1
    gemm.moe_grouped_gemm_op(x, None, b, sfb, bad, c, status, alpha, a_rows, c_rows)
    assert int(status) == 1 and torch.isnan(c).all()


def test_row_maps_make_their_own_kernel_and_label(monkeypatch):
    """a_rows and c_rows are part of the shape (the rows of a and c they index), so of the plan
    and the kernel: a mapped call's link is another kernel than the unmapped one (demoted and
    self-checked on its own), built as Sm90MoeW4A16RowsGemm with the maps it has."""
    monkeypatch.setattr(moe, "_check_device", lambda *args: None)
    x, b, sfb, offsets, a_rows, c_rows = _row_map_case(0)
    rows = a_rows.shape[0]
    c = torch.empty(rows + 2, 256, dtype=torch.bfloat16)
    both = moe.check_moe_inputs(x, None, b, sfb, offsets, c, a_rows=a_rows, c_rows=c_rows)
    assert both == moe.MoeShape(rows, 4, 256, 512, None, "blocked", None, "bfloat16", (7, rows + 2))
    gather = moe.check_moe_inputs(x, None, b, sfb, offsets, c[:rows], a_rows=a_rows)
    assert gather.rows == (7, None) and gather.kernel_rows() == hopper_moe.MoeRows(gather=True)
    plain = moe.check_moe_inputs(x[a_rows], None, b, sfb, offsets, c[:rows])
    assert plain.rows is None and not plain.kernel_rows().any
    links = [moe.moe_chain(shape, 132, False, None)[0] for shape in (both, gather, plain)]
    assert len({link.kernel_key(4) for link in links}) == 3
    assert links[0].label.startswith("bf16 activations (W4A16), rows gathered and scattered")
    unchained = hopper_moe.w4a16_config(SWAP_AB_T32_CONFIG)
    built = [hopper_moe.moe_w4a16_build(4, unchained, rows=shape.kernel_rows())[0] for shape in (both, plain)]
    assert type(built[0]) is hopper_moe.Sm90MoeW4A16RowsGemm and built[0].rows == both.kernel_rows()
    assert type(built[1]) is hopper_moe.Sm90MoeW4A16Gemm and not built[1].rows.any
    with pytest.raises(ValueError, match="maps no rows"):
        hopper_moe.Sm90MoeW4A16RowsGemm(unchained, 4, rows=hopper_moe.MoeRows())
    # the launch arguments: the index arrays' addresses after status's, the row counts after the sizes
    plan = type("Plan", (), {"status_address": 99, "max_tiles": 5, "fill_ctas": 132})()
    key = moe._binding_key(x, None, b, sfb, offsets, c, None, None, a_rows, c_rows)
    _, values = moe._launch_values(plan, both, key, 0)
    assert len(values) == len(moe.W4A16_ROWS_GEMM_ARGS[0])
    assert values[6:9] == (99, a_rows.data_ptr(), c_rows.data_ptr()) and values[-3:] == (7, rows + 2, 0)


def test_the_self_check_compares_through_the_row_maps(capsys):
    """The first-use check of a mapped kernel compares c's rows through c_rows with the exact
    decode of a's rows through a_rows; a wrong row demotes it and the exact rows are written
    where c_rows put them. A call with an index outside a or c is not checked."""
    x, b, sfb, offsets, a_rows, c_rows = _row_map_case(1)
    rows = a_rows.shape[0]
    c = torch.full((rows, 256), float("nan"), dtype=torch.bfloat16)
    moe.exact_moe_call(x, None, b, sfb, offsets, c, None, None, a_rows, c_rows)
    shape = moe.check_moe_inputs(x, None, b, sfb, offsets, c, a_rows=a_rows, c_rows=c_rows, require_cuda=False)
    plan = FakePlan(moe.moe_chain(shape, 132, False, None), 4)
    moe._self_check(plan, x, None, b, sfb, offsets, c.clone(), None, None, (a_rows, c_rows, None))
    assert plan.checked and not core.is_demoted(plan.kernel_key)
    core.reset_runtime()
    outside = c_rows.clone()
    outside[0] = -1
    plan = FakePlan(moe.moe_chain(shape, 132, False, None), 4)
    moe._self_check(plan, x, None, b, sfb, offsets, c.clone(), None, None, (a_rows, outside, None))
    assert not plan.checked
    wrong = c.clone()
    target = int(c_rows[5])
    wrong[target, 3] = wrong[target, 3] * 2 + 1
    moe._self_check(plan, x, None, b, sfb, offsets, wrong, None, None, (a_rows, c_rows, None))
    assert core.is_demoted(plan.kernel_key) and torch.equal(wrong, c)
    assert "column 3" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# SwiGLU in the epilogue (activation="swiglu")
# -----------------------------------------------------------------------------
def test_the_swiglu_row_order_interleaves_gate_and_up_rows_by_eight():
    order = hopper_moe.swiglu_row_order(256)
    assert sorted(order) == list(range(256))
    assert order[:16] == [*range(8), *range(128, 136)] and order[16:24] == list(range(8, 16))
    # a lane's accumulators of tile rows 16 w + g and 16 w + g + 8 are a column's gate and up
    for p in range(0, 256, 16):
        for g in range(8):
            assert order[p + g + 8] == order[p + g] + 128
    with pytest.raises(ValueError, match="multiple of 128"):
        hopper_moe.swiglu_row_order(192)


@pytest.mark.parametrize("sfb_layout", ["blocked", "plain"])
@pytest.mark.parametrize("alpha_shape", [None, "expert", "halves"])
def test_the_swiglu_reference_is_torchs_swiglu_of_the_unfused_outputs(sfb_layout, alpha_shape):
    """The exact decode with activation="swiglu" over swiglu_weights' weight: silu(gate) x up (fp32,
    rounded to c's dtype) of the unfused GEMM's gate and up outputs (rounded to c's dtype), bit
    for bit; alpha [G, 2] scales the gate rows by its first value and the up rows by its second;
    through the op on CPU tensors, and with c_rows."""
    inputs = w4a16_inputs()
    sfb = inputs["sfb"] if sfb_layout == "blocked" else torch.stack(
        [moe.plain_scales_of_blocked(inputs["sfb"][g], 256, 512) for g in range(4)])
    alpha = {None: None, "expert": torch.tensor([0.5, 2.0, 1.0, 3.0]),
             "halves": torch.tensor([[0.5, 2.0], [1.0, 0.25], [4.0, 1.0], [1.0, 1.0]])}[alpha_shape]
    names = ("a", "sfa", "b")
    unfused = moe.moe_reference(**{n: inputs[n] for n in names}, sfb=sfb, offsets=inputs["offsets"],
                                c=torch.zeros(300, 256, dtype=torch.bfloat16), alpha=alpha)
    expected = (torch.nn.functional.silu(unfused[:, :128].float()) * unfused[:, 128:].float()).bfloat16()
    b, swiglu_sfb = moe.swiglu_weights(inputs["b"], sfb)
    assert swiglu_sfb.shape == sfb.shape
    c = torch.full((300, 128), float("nan"), dtype=torch.bfloat16)
    status = torch.full((1,), 7, dtype=torch.int32)
    gemm.moe_grouped_gemm_op(inputs["a"], None, b, swiglu_sfb, inputs["offsets"], c, status, alpha, None, None,
                             "swiglu")
    assert int(status) == 0 and torch.equal(c, expected)
    c_rows = torch.randperm(300, generator=torch.Generator().manual_seed(2))
    scattered = torch.full((300, 128), float("nan"), dtype=torch.bfloat16)
    gemm.moe_grouped_gemm_op(inputs["a"], None, b, swiglu_sfb, inputs["offsets"], scattered, status, alpha, None,
                             c_rows, "swiglu")
    assert torch.equal(scattered[c_rows], expected)


def test_swiglu_makes_its_own_kernel_and_its_bound_catches_a_wrong_value(monkeypatch, capsys):
    """activation="swiglu" is part of the shape and the epilogue (another kernel, demoted and
    self-checked on its own); c must be [T, N / 2]; an unknown activation is refused; the
    self-check passes the exact result and demotes a kernel whose output is 5 % off."""
    monkeypatch.setattr(moe, "_check_device", lambda *args: None)
    inputs = w4a16_inputs()
    b, sfb = moe.swiglu_weights(inputs["b"], inputs["sfb"])
    c = torch.zeros(300, 128, dtype=torch.bfloat16)
    tensors = (inputs["a"], None, b, sfb, inputs["offsets"])
    shape = moe.check_moe_inputs(*tensors, c, alpha=torch.ones(4, 2), activation="swiglu")
    assert shape.activation == "swiglu" and shape.epilogue() == hopper_moe.MoeEpilogue("halves", "bfloat16", "swiglu")
    plain = moe.check_moe_inputs(*tensors, torch.zeros(300, 256, dtype=torch.bfloat16), alpha=torch.ones(4, 2))
    links = [moe.moe_chain(s, 132, False, None)[0] for s in (shape, plain)]
    assert links[0].kernel_key(4) != links[1].kernel_key(4) and "(W4A16), SwiGLU" in links[0].label
    with pytest.raises(ValueError, match=r"c\.shape = \(300, 256\): must be \(300, 128\) \(fp16 or bf16 \[T, N / 2"):
        moe.check_moe_inputs(*tensors, torch.zeros(300, 256, dtype=torch.bfloat16), activation="swiglu")
    with pytest.raises(ValueError, match=r"activation = 'gelu': must be one of \(None, 'swiglu'\)"):
        moe.check_moe_inputs(*tensors, c, activation="gelu")
    before = c.clone()
    with pytest.raises(ValueError, match="activation = 'gelu'"):
        gemm.moe_grouped_gemm(*tensors, c, activation="gelu")
    assert torch.equal(c, before)
    monkeypatch.undo()
    exact = moe.moe_reference(*tensors, c=torch.zeros(300, 128, dtype=torch.bfloat16), activation="swiglu")
    plan = FakePlan(moe.moe_chain(shape, 132, False, None), 4)
    moe._self_check(plan, *tensors, exact.clone(), None, None, (None, None, "swiglu"))
    assert plan.checked and not core.is_demoted(plan.kernel_key)
    core.reset_runtime()
    wrong = exact.clone()
    wrong[150, 7] = wrong[150, 7] * 1.05
    plan = FakePlan(moe.moe_chain(shape, 132, False, None), 4)
    moe._self_check(plan, *tensors, wrong, None, None, (None, None, "swiglu"))
    assert core.is_demoted(plan.kernel_key) and torch.equal(wrong, exact)
    assert "expert 2 row 150 column 7" in capsys.readouterr().err


def test_the_fragment_layout_through_the_cpu_op_and_its_rules():
    """b_layout="fragment" on the op's CPU path (the exact decode unpacks first): the plain
    layout's bits for the packed weights; the plain weights read as packed give other values;
    the fp4 path and unknown layouts refused before any work, naming b_layout."""
    from nvfp4_group_gemm import op, weight_layout

    tokens, groups, n, k = 24, 3, 128, 256
    inputs = moe.random_moe_inputs(tokens, groups, n, k, general_scales=False, device="cpu",
                                   generator=torch.Generator().manual_seed(5))
    a = (torch.randn(tokens, k, generator=torch.Generator().manual_seed(6)) * 2).bfloat16()
    offsets = torch.tensor([0, 5, 5, tokens], dtype=torch.int32)
    status = torch.zeros(1, dtype=torch.int32)
    plain, packed, misread = (torch.full((tokens, n), float("nan"), dtype=torch.bfloat16) for _ in range(3))
    op.moe_grouped_gemm_op(a, None, inputs["b"], inputs["sfb"], offsets, plain, status)
    fragment_b = weight_layout.pack_fragment(inputs["b"])
    op.moe_grouped_gemm_op(a, None, fragment_b, inputs["sfb"], offsets, packed, status, b_layout="fragment")
    op.moe_grouped_gemm_op(a, None, inputs["b"], inputs["sfb"], offsets, misread, status, b_layout="fragment")
    assert torch.equal(plain, packed) and not torch.isnan(plain).any()
    assert not torch.equal(plain, misread)
    with pytest.raises(ValueError, match="b_layout.*bf16 activations"):
        moe.check_moe_inputs(inputs["a"], inputs["sfa"], inputs["b"], inputs["sfb"], offsets, b_layout="fragment",
                             require_cuda=False)
    before = packed.clone()
    with pytest.raises(ValueError, match="b_layout = 'packed'"):
        op.moe_grouped_gemm_op(a, None, fragment_b, inputs["sfb"], offsets, packed, status, b_layout="packed")
    assert torch.equal(packed, before)


def test_fragment_weights_take_32_token_tiles_where_the_choice_takes_64():
    """A W4A16 shape of 33-64 rows per expert: 64-token tiles with plain weights, 32-token ones
    with b packed for the fragment (its 64-token build spilled under DSL 4.8.1); the fragment
    layout in the chain's links (their compile keys differ from the plain layout's)."""
    plain = moe.MoeShape(48 * 8, 8, 4096, 2048, None, "blocked", "expert", "bfloat16")
    fragment = moe.MoeShape(*plain[:10], "fragment")
    from nvfp4_group_gemm.hopper import config_name

    assert config_name(moe.moe_config(plain, 132, False, None)).startswith("swap_ab_t64")
    assert config_name(moe.moe_config(fragment, 132, False, None)).startswith("swap_ab_t32")
    small = moe.MoeShape(8, 8, 4096, 2048, None, "blocked", "expert", "bfloat16")
    assert moe.moe_config(small, 132, False, None) == moe.moe_config(moe.MoeShape(*small[:10], "fragment"), 132,
                                                                     False, None)
    links = moe.moe_chain(fragment, 132, chain_calls=False, forced=None)
    assert all(link.config[-1] == "fragment" for link in links[:-1])
    assert links[0].kernel_key(8) != moe.moe_chain(plain, 132, chain_calls=False, forced=None)[0].kernel_key(8)
