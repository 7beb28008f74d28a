"""ModelOpt's NVFP4 format (nvfp4_group_gemm.checkpoint): the reference quantizer's rounding
(nearest, ties to even, saturating), its packing against the package's own e2m1 decode, the
format's scales, and a MoE layer's tensors loaded as the entry's operands with alpha = input
scale x weight_scale_2 (raw sums x alpha = the dequantized GEMM)."""

import pytest
import torch

from nvfp4_group_gemm import checkpoint, core, e2m1, moe


def test_e2m1_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 1e9, -0.3, -2.6, 0.0, 0.7, -6.0])
    expected = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.5, -3.0, 0.0, 0.5, -6.0])
    packed = checkpoint.pack_e2m1(checkpoint.e2m1_codes(x))[None]
    values = core.decode_fp4(packed, torch.ones(1, 1))[0]
    assert torch.equal(values, expected), values


def test_packing_is_low_nibble_first():
    codes = torch.tensor([[3, 12] * 8], dtype=torch.uint8)  # 1.5 then -2.0
    packed = checkpoint.pack_e2m1(codes)
    assert packed[0, 0].item() == 3 | (12 << 4)
    assert core.decode_fp4(packed, torch.ones(1, 1))[0, :2].tolist() == [1.5, -2.0]


def test_the_quantizer_follows_the_formula():
    weight = torch.randn(3, 128, 256, generator=torch.Generator().manual_seed(2)) * 0.02
    weight[1] *= 10  # another expert, another scale
    quantized = checkpoint.quantize_nvfp4(weight)
    amax = weight.abs().amax(dim=(1, 2))
    assert torch.equal(quantized.weight_scale_2, amax / (6 * 448))
    block_amax = weight.reshape(3, 128, 16, 16).abs().amax(-1)
    expected_scale = (block_amax / 6 / quantized.weight_scale_2[:, None, None]).to(torch.float8_e4m3fn)
    assert torch.equal(quantized.weight_scale.float(), expected_scale.float())
    assert quantized.weight_scale.float().max() <= 448
    error = (checkpoint.dequantize_nvfp4(quantized) - weight).abs().reshape(3, 128, 16, 16).amax(-1)
    # one e2m1 step (at most 2 at the top of the grid, where the values are 4 to 6) of a block
    # scale that is amax / 6 within e4m3's rounding: at most about a fifth of the block's amax
    assert bool((error <= 0.2 * block_amax + 1e-12).all()), (error / block_amax).max()
    assert checkpoint.dequantize_nvfp4(checkpoint.quantize_nvfp4(torch.zeros(1, 16, 32))).abs().max() == 0


def layer_tensors(experts=4, hidden=256, intermediate=128, split_w13_scales=False):
    generator = torch.Generator().manual_seed(3)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator) * 0.02
    w2 = torch.randn(experts, hidden, intermediate, generator=generator) * 0.02
    tensors = {}
    for name, weight in (("w13", w13), ("w2", w2)):
        quantized = checkpoint.quantize_nvfp4(weight)
        scale_2 = quantized.weight_scale_2
        if name == "w13" and split_w13_scales:
            # gate and up quantized apart, as ModelOpt does: two scales per expert
            gate = checkpoint.quantize_nvfp4(weight[:, :intermediate])
            up = checkpoint.quantize_nvfp4(weight[:, intermediate:])
            quantized = checkpoint.Nvfp4Tensor(torch.cat([gate.weight, up.weight], 1),
                                               torch.cat([gate.weight_scale, up.weight_scale], 1),
                                               torch.stack([gate.weight_scale_2, up.weight_scale_2], 1))
            scale_2 = quantized.weight_scale_2
        tensors |= {f"layer.{name}_weight": quantized.weight, f"layer.{name}_weight_scale": quantized.weight_scale,
                    f"layer.{name}_weight_scale_2": scale_2,
                    f"layer.{name}_input_scale": torch.full((experts,), 0.5 / (6 * 448))}
    return tensors


@pytest.mark.parametrize("split", [False, True], ids=["one_w13_scale", "gate_and_up_scales"])
def test_a_layer_loads_as_the_entrys_operands_and_raw_sums_times_alpha_are_the_gemm(split):
    tensors = layer_tensors(split_w13_scales=split)
    layer = checkpoint.load_moe_layer(tensors, prefix="layer.")
    w13 = layer["w13"]
    assert w13.b.dtype == torch.float4_e2m1fn_x2 and w13.b.shape == (4, 256, 128)
    assert torch.equal(w13.sfb.view(torch.uint8),
                       moe.prepare_weight_scales(tensors["layer.w13_weight_scale"]).view(torch.uint8))
    assert w13.alpha.shape == ((4, 2) if split else (4,)) and layer["w2"].alpha.shape == (4,)
    # activations quantized with the layer's input scale: the raw sum over the e2m1 x e4m3
    # values, times alpha, is the GEMM of the dequantized operands
    x = torch.randn(1, 8, 256, generator=torch.Generator().manual_seed(4))
    xq = checkpoint.quantize_nvfp4(x)
    xq.weight_scale_2 = tensors["layer.w13_input_scale"][:1].float()  # the calibrated scale
    raw_x = core.decode_fp4(xq.weight[0], xq.weight_scale[0])
    raw_b = core.decode_fp4(w13.b.view(torch.uint8).reshape(4 * 256, 128),
                            tensors["layer.w13_weight_scale"].reshape(4 * 256, 16)).reshape(4, 256, 256)
    raw = torch.einsum("tk,enk->etn", raw_x.double(), raw_b.double())
    alpha = w13.alpha.double().repeat_interleave(128, dim=1)[:, None, :] if split else w13.alpha.double()[:, None, None]
    dequantized = checkpoint.dequantize_nvfp4(checkpoint.Nvfp4Tensor(
        tensors["layer.w13_weight"], tensors["layer.w13_weight_scale"], tensors["layer.w13_weight_scale_2"]))
    expected = torch.einsum("tk,enk->etn", raw_x.double() * xq.weight_scale_2.double(), dequantized.double())
    # the dequantized weights are float32 (value x block scale x weight_scale_2, one rounding)
    torch.testing.assert_close(raw * alpha, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def test_a_missing_or_malformed_tensor_is_named():
    tensors = layer_tensors()
    del tensors["layer.w2_weight_scale_2"]
    with pytest.raises(ValueError, match=r"no tensor 'w2_weight_scale_2'"):
        checkpoint.load_moe_layer(tensors, prefix="layer.")
    # no input scale: a checkpoint for W4A16 only (alpha None, w4a16_alpha the weight scales)
    tensors = layer_tensors()
    del tensors["layer.w2_input_scale"]
    w2 = checkpoint.load_moe_layer(tensors, prefix="layer.")["w2"]
    assert w2.alpha is None and w2.input_scale is None
    assert torch.equal(w2.w4a16_alpha, tensors["layer.w2_weight_scale_2"].float())
    tensors = layer_tensors()
    tensors["layer.w13_weight_scale"] = tensors["layer.w13_weight_scale"][:, :, :8]
    with pytest.raises(ValueError, match=r"w13_weight_scale: dtype torch.float8_e4m3fn, shape \(4, 256, 8\)"):
        checkpoint.load_moe_layer(tensors, prefix="layer.")


def test_e2m1_codes_count_the_midpoints_below_each_value():
    """e2m1_codes (two searches) gives every code the per-midpoint comparisons give: over a
    strided sweep of all float32 bit patterns (subnormals, infinities, NaNs of both signs), the
    midpoints and their float neighbours, both signs."""
    def compared_one_by_one(x):
        magnitude = x.abs().float()
        code = torch.zeros_like(magnitude, dtype=torch.uint8)
        for midpoint, tie_up in e2m1.MIDPOINTS:
            code += (magnitude >= midpoint if tie_up else magnitude > midpoint).to(torch.uint8)
        return code | (torch.signbit(x).to(torch.uint8) << 3)

    sweep = (torch.arange(0, 2**32, 4099, dtype=torch.int64) - 2**31).to(torch.int32).view(torch.float32)
    points = torch.tensor([m for m, _ in e2m1.MIDPOINTS] + [0.0, 0.5, 6.0, 7.0, float("inf")])
    near = torch.cat([points, torch.nextafter(points, torch.full_like(points, float("inf"))),
                      torch.nextafter(points, torch.zeros_like(points))])
    x = torch.cat([sweep, near, -near])
    assert torch.equal(checkpoint.e2m1_codes(x), compared_one_by_one(x))
    assert checkpoint.e2m1_codes(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])).tolist() == [
        0, 2, 2, 4, 4, 6, 6, 14]  # ties to the even code
