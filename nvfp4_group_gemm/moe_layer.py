"""A MoE feed-forward layer on the MoE entry, from a ModelOpt NVFP4 checkpoint's tensors.

    layer = MoeFfn(tensors, prefix, router_weight, top_k)     # once, at load (W4A16)
    y = layer(x)                                              # x [T, H] bf16 -> y [T, H] bf16

One call: router logits (fp32), softmax, top-k, the weights renormalized over the k experts; the
T x k (token, expert) pairs sorted by expert on the GPU (a stable argsort) and the group offsets
from their counts (scatter_add, cumsum: no host read); the gate-and-up GEMM of the sorted rows
(the entry with the checkpoint's per-expert alpha, bf16 output), SwiGLU (silu(gate) x up in
fp32), the down GEMM, and the weighted sum of each token's k rows (in fp32, rounded to bf16). Nothing reads a value on the
host, so after one eager call the whole layer can be captured once as a CUDA graph and replayed
for any routing (the offsets, the permutation and the weights are tensors the graph recomputes).

Activations (`activations`): "bf16" (W4A16, the default: what Hopper servers run for NVFP4
checkpoints) gives each GEMM its bf16 rows as they are, with alpha = each expert's
weight_scale_2, and rounds SwiGLU's output to bf16 for the down GEMM; no activation quantizer,
no input_scale. "nvfp4" (the entry's fp4 path, W4A4) quantizes each GEMM's input on the GPU with
the projection's calibrated input scale (the largest over the experts, as servers quantize one
token once for all its experts), alpha = that scale x each expert's weight_scale_2.

The GEMMs go through torch.ops.nvfp4_group_gemm.moe_grouped_gemm: on CUDA tensors the entry,
on CPU tensors the exact decode (which reads the offsets on the host), so the layer also runs,
and is tested, on a CPU.
"""

from __future__ import annotations

import torch

from . import checkpoint
from .op import moe_grouped_gemm_op


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (K a multiple of 16) as NVFP4 with a given global scale, the ModelOpt formula:
    block scale = e4m3(block amax / 6 / input_scale), value = e2m1(x / (block scale x
    input_scale)), round to nearest even, saturating. Returns (a float4_e2m1fn_x2 [R, K/2], plain
    scales float8_e4m3fn [R, K/16]; checkpoint.quantize_blocks). Torch ops only: no host read."""
    codes, block_scale = checkpoint.quantize_blocks(x, input_scale.float().reshape(()))
    return codes.view(torch.float4_e2m1fn_x2), block_scale


ACTIVATIONS = ("bf16", "nvfp4")


class MoeFfn:
    """A MoE FFN (module docstring) over ModelOpt NVFP4 experts `<prefix>w13_*` (gate rows, then
    up rows: N = 2 I) and `<prefix>w2_*` (N = H), with a router `router_weight` [E, H] and
    `top_k` experts per token; `activations` "bf16" (W4A16) or "nvfp4" (W4A4).

    Expert parallelism: the router scores every expert (router_weight [E_all, H]) and `tensors`
    hold the E local ones, experts first_local .. first_local + E - 1 of them; the pairs routed
    elsewhere sort after the local groups (rows past offsets[E]: neither read nor written by the
    entry) and add nothing here, so the layer returns this GPU's part of the output, which an
    all-reduce over the expert-parallel GPUs sums. E_all = E (the default): every expert local."""

    def __init__(self, tensors: dict, prefix: str, router_weight: torch.Tensor, top_k: int,
                 activations: str = "bf16", first_local: int = 0):
        if activations not in ACTIVATIONS:
            raise ValueError(f"MoeFfn: activations = {activations!r}: must be one of {ACTIVATIONS}")
        self.activations = activations
        layer = checkpoint.load_moe_layer(tensors, prefix)
        self.w13, self.w2 = layer["w13"], layer["w2"]
        self.router_weight = router_weight.float()
        self.top_k = top_k
        self.experts, self.intermediate = self.w13.b.shape[0], self.w13.b.shape[1] // 2
        self.hidden = self.w2.b.shape[1]
        self.first_local = first_local
        if not 0 <= first_local <= router_weight.shape[0] - self.experts:
            raise ValueError(f"MoeFfn: first_local = {first_local}: the {self.experts} local experts must lie within "
                             f"the router's {router_weight.shape[0]}")
        # one activation scale per projection (the experts' largest), alpha recomputed with it
        self.scale13, self.alpha13 = self._scale_and_alpha(self.w13)
        self.scale2, self.alpha2 = self._scale_and_alpha(self.w2)

    def _scale_and_alpha(self, projection: checkpoint.MoeProjection) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the activations' global scale, None in W4A16; the GEMM's alpha [G] or [G, 2])."""
        if self.activations == "bf16":
            return None, projection.w4a16_alpha
        if projection.input_scale is None:
            raise ValueError("MoeFfn: activations = 'nvfp4' needs each projection's <p>_input_scale (the checkpoint "
                             "has none: use activations = 'bf16', W4A16)")
        scale = projection.input_scale.max()
        return scale, (scale * projection.weight_scale_2).float().contiguous()

    def route(self, x: torch.Tensor):
        """(each (token, expert) pair's expert [T k], its weight [T, k]): softmax over the router's
        logits, top-k, renormalized."""
        probabilities = torch.softmax(x.float() @ self.router_weight.T, dim=-1)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        return experts.reshape(-1), weights / weights.sum(dim=-1, keepdim=True)

    def local_experts(self, experts: torch.Tensor) -> torch.Tensor:
        """Each pair's local expert, E (one past the last) for a pair routed to another GPU's."""
        local = experts - self.first_local
        return torch.where((local >= 0) & (local < self.experts), local, self.experts)

    def sort_by_expert(self, experts: torch.Tensor):
        """(the pairs in expert order: their index into the T k pairs, the int32 offsets [E + 1])
        on the pairs' device, with no host read; `experts` local (local_experts: E, another GPU's,
        sorts last, past offsets[E])."""
        order = torch.argsort(experts, stable=True)
        counts = torch.zeros(self.experts + 1, dtype=torch.int64, device=experts.device)
        counts.scatter_add_(0, experts, torch.ones_like(experts))
        offsets = torch.zeros(self.experts + 1, dtype=torch.int32, device=experts.device)
        offsets[1:] = torch.cumsum(counts[:self.experts], 0)
        return order, offsets

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        experts, weights = self.route(x)
        experts = self.local_experts(experts)
        order, offsets = self.sort_by_expert(experts)
        rows = x[order // self.top_k]  # the sorted pairs' tokens, [T k, H]
        status = torch.zeros(1, dtype=torch.int32, device=x.device)
        gate_up = self.gemm(rows, self.w13, self.scale13, self.alpha13, offsets, status)
        gate, up = gate_up[:, :self.intermediate].float(), gate_up[:, self.intermediate:].float()
        hidden = torch.nn.functional.silu(gate) * up
        if self.scale2 is None:  # W4A16: the down GEMM reads bf16 rows
            hidden = hidden.to(torch.bfloat16)
        down = self.gemm(hidden, self.w2, self.scale2, self.alpha2, offsets, status)
        unsorted = torch.empty_like(down)
        unsorted[order] = down  # row p: pair p = (token p // k, its (p % k)-th expert)
        # the rows of pairs on other GPUs' experts were not written: they add nothing here
        unsorted = torch.where((experts < self.experts)[:, None], unsorted.float(), 0.0)
        weighted = unsorted.view(tokens, self.top_k, self.hidden) * weights[..., None]
        return weighted.sum(dim=1).to(torch.bfloat16)

    @staticmethod
    def gemm(rows: torch.Tensor, projection: checkpoint.MoeProjection, scale: torch.Tensor | None,
             alpha: torch.Tensor, offsets: torch.Tensor, status: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM of the layer, bf16 output: `rows` as they are (bf16, W4A16: scale
        None), or quantized with `scale`."""
        if scale is None:
            a, sfa = rows.to(torch.bfloat16).contiguous(), None
        else:
            a, sfa = quantize_activations(rows, scale)
        c = torch.empty(rows.shape[0], projection.b.shape[1], dtype=torch.bfloat16, device=rows.device)
        moe_grouped_gemm_op(a, sfa, projection.b, projection.sfb, offsets, c, status, alpha)
        return c
