"""NVIDIA ModelOpt's NVFP4 format for a MoE layer's experts: a reference quantizer written from
the format's formula, its exact dequantization, and the loading of a layer's tensors into the
MoE entry's operands.

The format (what vLLM, SGLang, TensorRT-LLM and FlashInfer read), for E experts of hidden size
H and intermediate size I, per projection (`w13`: gate and up fused, N = 2I, K = H; `w2`: down,
N = H, K = I):

    <p>_weight          uint8 [E, N, K/2]   two e2m1 values per byte, the first element of K in
                                            the low nibble (as this package's float4_e2m1fn_x2)
    <p>_weight_scale    e4m3  [E, N, K/16]  one scale per 16 consecutive elements of K
    <p>_weight_scale_2  fp32  [E] (or [E, 2] for w13: gate and up quantized apart)
    <p>_input_scale     fp32  [E] (a calibrated bound of the activations: amax / (6 x 448));
                                            only W4A4 reads it (absent: W4A16 only)

Quantization of one expert's weight w (one tensor: one weight_scale_2):
    weight_scale_2 = amax(|w|) / (6 x 448)
    block scale    = e4m3(amax(|w| over the 16-block) / 6 / weight_scale_2)      (at most 448)
    value          = e2m1(w / (block scale x weight_scale_2)), round to nearest even, saturating
so w ~ value x block scale x weight_scale_2. A GEMM of activations quantized the same way with
input_scale multiplies its fp32 accumulator by alpha = input_scale x weight_scale_2 (per expert).

The MoE entry applies alpha: moe_grouped_gemm(..., alpha=...) multiplies each expert's fp32 sums
by it before rounding to c's dtype (the raw sums of a real layer reach 1e7: past fp16's range
without it). With bf16 activations (W4A16) the sums carry the weights' global scale alone:
alpha = projection.w4a16_alpha (weight_scale_2); with NVFP4 activations quantized with
input_scale (W4A4), alpha = projection.alpha (input_scale x weight_scale_2).
nvfp4_group_gemm.moe_layer builds a whole MoE FFN on it, either way.
"""

from __future__ import annotations

import dataclasses

import torch

from nvfp4_group_gemm import core, e2m1

from .moe import prepare_weight_scales

E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16
# Round to nearest, ties to the even code: the midpoints a tie stays below (counted where x > m)
# and those it rounds up from (x >= m), nvfp4_group_gemm.e2m1's
_TIE_DOWN, _TIE_UP = e2m1.TIE_DOWN, e2m1.TIE_UP


# The two midpoint sets as tensors, per device: made once, since a copy from the host cannot be
# captured in a CUDA graph (MoeFfn makes its device's when it is built)
_MIDPOINT_TENSORS = core.RuntimeCache(max_entries=16)


def midpoint_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(_TIE_DOWN, _TIE_UP) as float32 tensors on `device`, made on its first use."""
    key = str(torch.device(device))
    tensors = _MIDPOINT_TENSORS.get(key)
    if tensors is None:
        tensors = tuple(torch.tensor(points, dtype=torch.float32, device=device) for points in (_TIE_DOWN, _TIE_UP))
        _MIDPOINT_TENSORS.put(key, tensors)
    return tensors


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 code (uint8 0..15, bit 3 the sign) of each element of x: round to nearest,
    ties to even, saturating at +-6 (NaN: code 0 with its sign). Two bucketize calls count the
    midpoints below |x| (a search each, where a comparison per midpoint was 21 kernels)."""
    magnitude = x.abs().float().nan_to_num(nan=0.0)
    tie_down, tie_up = midpoint_tensors(x.device)
    code = torch.bucketize(magnitude, tie_down, right=False) + torch.bucketize(magnitude, tie_up, right=True)
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] uint8, the first element of each pair in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


@dataclasses.dataclass
class Nvfp4Tensor:
    """One projection's experts in ModelOpt's NVFP4 format."""

    weight: torch.Tensor  # uint8 [E, N, K/2]
    weight_scale: torch.Tensor  # float8_e4m3fn [E, N, K/16]
    weight_scale_2: torch.Tensor  # float32 [E]


def quantize_nvfp4(weight: torch.Tensor) -> Nvfp4Tensor:
    """Quantize [E, N, K] weights (any float dtype; K a multiple of 16) the ModelOpt way, one
    weight_scale_2 per expert: the reference quantizer of the format's formula."""
    if weight.dim() != 3 or weight.shape[-1] % BLOCK:
        raise ValueError(f"quantize_nvfp4: weight.shape = {tuple(weight.shape)}: expected [E, N, K], K a multiple of 16")
    w = weight.float()
    amax = w.abs().amax(dim=(1, 2))
    # an all-zero expert: any positive scale gives zero codes and zero block scales
    scale_2 = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
    codes, block_scale = quantize_blocks(w, scale_2[:, None, None])
    return Nvfp4Tensor(codes, block_scale, scale_2)


def quantize_blocks(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's block step for x [..., K] (K a multiple of 16) under a global scale (one
    value, or one per leading index, broadcast against x's block amaxes [..., K/16]): block
    scale = e4m3(block amax / 6 / global scale), value = e2m1(x / (block scale x global scale)).
    Returns (packed codes uint8 [..., K/2], block scales float8_e4m3fn [..., K/16]). Torch ops
    only: no host read."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    block_scale = (blocks.abs().amax(dim=-1) / E2M1_MAX / global_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denominator = (block_scale.float() * global_scale)[..., None]
    scaled = torch.where(denominator > 0, blocks / denominator, torch.zeros_like(blocks))
    return pack_e2m1(e2m1_codes(scaled.reshape(x.shape))), block_scale


def dequantize_nvfp4(tensor: Nvfp4Tensor) -> torch.Tensor:
    """[E, N, K] float32: value x block scale x weight_scale_2 (weight_scale_2 [E], or [E, 2]
    over the two halves of N); the value x block scale decode is the core's exact one."""
    experts, n, half_k = tensor.weight.shape
    scaled = core.decode_fp4(tensor.weight.reshape(experts * n, half_k),
                             tensor.weight_scale.reshape(experts * n, -1)).reshape(experts, n, 2 * half_k)
    scale_2 = tensor.weight_scale_2.float()
    if scale_2.dim() == 2:  # gate and up halves of a fused w13, each its own scale
        scale_2 = scale_2.repeat_interleave(n // 2, dim=1)[:, :, None]
    else:
        scale_2 = scale_2[:, None, None]
    return scaled * scale_2


def input_scale_of(activations: torch.Tensor) -> torch.Tensor:
    """The activations' global scale as ModelOpt calibrates it: amax / (6 x 448)."""
    return activations.abs().amax().float() / (E2M1_MAX * E4M3_MAX)


@dataclasses.dataclass
class MoeProjection:
    """What the MoE entry takes for one projection of a layer's experts, and its global scale."""

    b: torch.Tensor  # float4_e2m1fn_x2 [E, N, K/2]
    sfb: torch.Tensor  # float8_e4m3fn, blocked [E, N/128, K/64, 32, 4, 4] (prepare_weight_scales)
    alpha: torch.Tensor | None  # float32 [E] or [E, 2]: input_scale x weight_scale_2 (W4A4; None: no input_scale)
    weight_scale_2: torch.Tensor  # float32 [E] or [E, 2]
    input_scale: torch.Tensor | None  # float32 [E]
    # b's and sfb's row order: "stacked" (a fused gate-and-up's gate rows, then its up rows, as
    # exported) or "swiglu" (interleaved by 8 for the SwiGLU epilogue: moe.swiglu_weights)
    row_order: str = "stacked"
    # b's layout: "plain" (as exported) or "fragment" (W4A16's weights packed for the decode's
    # fragment at load: nvfp4_group_gemm.weight_layout; the entry's b_layout)
    b_layout: str = "plain"

    @property
    def plain_b(self) -> torch.Tensor:
        """b as exported (unpacked where it is held in the fragment layout)."""
        if self.b_layout == "plain":
            return self.b
        from .weight_layout import unpack_fragment

        return unpack_fragment(self.b)

    def packed_for_fragment(self) -> MoeProjection:
        """This projection with b packed for the W4A16 decode's fragment (weight_layout.pack_fragment;
        the scales, alpha and row order unchanged): a copy of b, itself where it is packed already."""
        if self.b_layout == "fragment":
            return self
        from .weight_layout import pack_fragment

        return dataclasses.replace(self, b=pack_fragment(self.b), b_layout="fragment")

    @property
    def w4a16_alpha(self) -> torch.Tensor:
        """alpha of bf16 activations (W4A16): weight_scale_2, [E] or [E, 2], contiguous fp32."""
        return self.weight_scale_2.float().contiguous()

    def in_swiglu_order(self) -> MoeProjection:
        """This fused gate-and-up projection with b's and sfb's rows in the SwiGLU epilogue's
        order (moe.swiglu_weights; alpha and the scales unchanged: [E, 2] stays (gate, up)); a
        copy of b and sfb, itself where it is in that order already."""
        if self.row_order == "swiglu":
            return self
        from .moe import swiglu_weights

        b, sfb = swiglu_weights(self.plain_b, self.sfb)
        swiglu = dataclasses.replace(self, b=b, sfb=sfb, row_order="swiglu", b_layout="plain")
        return swiglu.packed_for_fragment() if self.b_layout == "fragment" else swiglu


def load_projection(tensors: dict, name: str) -> MoeProjection:
    """`<name>_weight`, `<name>_weight_scale`, `<name>_weight_scale_2` and `<name>_input_scale`
    of a ModelOpt MoE layer (a dict of tensors) as the entry's b, blocked sfb (converted once)
    and alpha. A ValueError names a missing or malformed tensor; `<name>_input_scale` may be
    absent (a checkpoint for W4A16 only: alpha and input_scale None)."""
    fields = {}
    for suffix in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
        key = f"{name}_{suffix}"
        if key not in tensors and suffix != "input_scale":
            raise ValueError(f"load_projection: no tensor {key!r} (ModelOpt NVFP4 names: {name}_weight, "
                             f"{name}_weight_scale, {name}_weight_scale_2, {name}_input_scale)")
        fields[suffix] = tensors.get(key)
    weight, scale = fields["weight"], fields["weight_scale"]
    if weight.dtype not in (torch.uint8, torch.float4_e2m1fn_x2) or weight.dim() != 3:
        raise ValueError(f"load_projection: {name}_weight: dtype {weight.dtype}, shape {tuple(weight.shape)}: "
                         "expected uint8 [E, N, K/2]")
    experts, n, half_k = weight.shape
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (experts, n, half_k * 2 // BLOCK):
        raise ValueError(f"load_projection: {name}_weight_scale: dtype {scale.dtype}, shape {tuple(scale.shape)}: "
                         f"expected float8_e4m3fn [{experts}, {n}, {half_k * 2 // BLOCK}]")
    scale_2 = fields["weight_scale_2"].float().reshape(experts, -1)
    if scale_2.shape[1] not in (1, 2):
        raise ValueError(f"load_projection: {name}_weight_scale_2: shape {tuple(fields['weight_scale_2'].shape)}: "
                         f"expected [{experts}] or [{experts}, 2]")
    scale_2 = scale_2[:, 0] if scale_2.shape[1] == 1 or bool((scale_2[:, 0] == scale_2[:, 1]).all()) else scale_2
    input_scale = alpha = None
    if fields["input_scale"] is not None:
        input_scale = fields["input_scale"].float().reshape(-1)
        input_scale = input_scale.expand(experts) if input_scale.numel() == 1 else input_scale
        if input_scale.numel() != experts:
            raise ValueError(f"load_projection: {name}_input_scale: {input_scale.numel()} values: expected 1 or "
                             f"{experts}")
        alpha = (input_scale[:, None] * scale_2 if scale_2.dim() == 2 else input_scale * scale_2).contiguous()
    return MoeProjection(weight.view(torch.float4_e2m1fn_x2), prepare_weight_scales(scale), alpha, scale_2,
                         input_scale)


def dequantize_projection(projection: MoeProjection, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A loaded projection's weights [E, N, K] in `dtype` (float64: exact): e2m1 x e4m3 (the
    core's decode of the plain scales, read back from the blocked ones) x weight_scale_2; rows
    stacked (gate, then up) whatever the projection's row order."""
    from .moe import plain_scales_of_blocked

    experts, n, half_k = projection.b.shape
    codes = projection.plain_b.view(torch.uint8)
    scaled = torch.stack([core.decode_fp4(codes[g], plain_scales_of_blocked(projection.sfb[g], n, 2 * half_k))
                          for g in range(experts)]).to(dtype)
    if projection.row_order == "swiglu":  # back to gate rows, then up rows
        from .hopper.moe import swiglu_row_order

        stacked = torch.empty_like(scaled)
        stacked[:, swiglu_row_order(n)] = scaled
        scaled = stacked
    scale_2 = projection.weight_scale_2.to(dtype)
    if scale_2.dim() == 2:  # gate and up halves of a fused w13, each its own scale
        return scaled * scale_2.repeat_interleave(n // 2, dim=1)[:, :, None]
    return scaled * scale_2[:, None, None]


def load_moe_layer(tensors: dict, prefix: str = "") -> dict[str, MoeProjection]:
    """A ModelOpt NVFP4 MoE layer's tensors (names `<prefix>w13_weight`, ...) as the entry's
    operands: {"w13": gate-and-up, "w2": down}."""
    return {name: load_projection({key[len(prefix):]: value for key, value in tensors.items()
                                   if key.startswith(prefix)}, name) for name in ("w13", "w2")}
