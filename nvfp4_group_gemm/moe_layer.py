"""A MoE feed-forward layer on the MoE entry, from a ModelOpt NVFP4 export or its tensors.

    layer = MoeFfn.from_pretrained(path, layer_index, device="cuda")   # an export directory (W4A16)
    layer = MoeFfn(tensors, prefix, router_weight, top_k)              # or tensors given by hand
    y = layer(x)                                                       # x [T, H] bf16 -> y [T, H] bf16
    y = layer.experts_output(x, topk_ids, topk_weights)                # a caller's own routing

One call: router logits (fp32), the architecture's routing (nvfp4_group_gemm.routing; by hand:
softmax, top-k, the weights renormalized over the k experts); the
T x k (token, expert) pairs sorted by expert on the GPU (a stable argsort) and the group offsets
from their counts (scatter_add, cumsum: no host read); the gate-and-up GEMM of the sorted rows
(the entry with the checkpoint's per-expert alpha, bf16 output), SwiGLU (silu(gate) x up in
fp32), the down GEMM, and the weighted sum of each token's k rows (in fp32, rounded to bf16). In
W4A16 the gate-and-up GEMM reads the token rows of the sorted pairs in place and the down GEMM
writes each pair's row in pair order (the entry's a_rows and c_rows): no gathered copy, no
separate un-permute; and SwiGLU runs in the gate-and-up GEMM's epilogue (`swiglu_epilogue`, w13
held in that epilogue's row order). Nothing reads a value on the
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

from . import checkpoint, pairs, switches
from .op import moe_grouped_gemm_op
from .routing import Routing, route
from .weight_layout import FRAGMENT, PLAIN, WEIGHT_LAYOUTS


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (K a multiple of 16) as NVFP4 with a given global scale, the ModelOpt formula:
    block scale = e4m3(block amax / 6 / input_scale), value = e2m1(x / (block scale x
    input_scale)), round to nearest even, saturating. Returns (a float4_e2m1fn_x2 [R, K/2], plain
    scales float8_e4m3fn [R, K/16]; checkpoint.quantize_blocks). On a GPU one kernel
    (pairs.quantize_rows, the same bits); no host read."""
    return pairs.quantize_rows(x, input_scale)


ACTIVATIONS = ("bf16", "nvfp4")


class MoeFfn:
    """A MoE FFN (module docstring) over ModelOpt NVFP4 experts `<prefix>w13_*` (gate rows, then
    up rows: N = 2 I) and `<prefix>w2_*` (N = H), with a router `router_weight` [E, H] and
    `top_k` experts per token; `activations` "bf16" (W4A16) or "nvfp4" (W4A4).

    From an export directory: MoeFfn.from_pretrained(path, layer) (nvfp4_group_gemm.export),
    routing as the architecture routes (nvfp4_group_gemm.routing), DeepSeek-V3's shared expert
    added to every token. `routing` (default: softmax, top-k, renormalized),
    `e_score_correction_bias` and `shared` ({"w13", "w2"} projections of one group) are the
    same settings for tensors given by hand.

    Expert parallelism: the router scores every expert (router_weight [E_all, H]) and `tensors`
    hold the E local ones, experts first_local .. first_local + E - 1 of them; the pairs routed
    elsewhere sort after the local groups (rows past offsets[E]: neither read nor written by the
    entry) and add nothing here, so the layer returns this GPU's part of the output, which an
    all-reduce over the expert-parallel GPUs sums. E_all = E (the default): every expert local."""

    def __init__(self, tensors: dict, prefix: str, router_weight: torch.Tensor, top_k: int,
                 activations: str = "bf16", first_local: int = 0, *, routing: Routing | None = None,
                 e_score_correction_bias: torch.Tensor | None = None,
                 shared: dict[str, checkpoint.MoeProjection] | None = None, swiglu_epilogue: bool = True,
                 weight_layout: str = "plain"):
        layer = checkpoint.load_moe_layer(tensors, prefix)
        routing = Routing("softmax", top_k, renormalize=True) if routing is None else routing
        if routing.top_k != top_k:
            raise ValueError(f"MoeFfn: top_k = {top_k}: routing.top_k = {routing.top_k} differs")
        self._build(layer["w13"], layer["w2"], router_weight, routing, activations, first_local,
                    e_score_correction_bias, shared, swiglu_epilogue, weight_layout)

    @classmethod
    def from_weights(cls, weights, activations: str = "bf16", with_shared: bool | None = None,
                     swiglu_epilogue: bool = True, weight_layout: str = "plain") -> MoeFfn:
        """The layer of an export's MoeLayerWeights (export.Export.load_moe_layer). The shared
        expert is added where `with_shared` (default: where the weights' experts start at 0, so
        that an all-reduce over expert-parallel ranks adds it once)."""
        with_shared = weights.first_expert == 0 if with_shared is None else with_shared
        layer = cls.__new__(cls)
        layer._build(weights.w13, weights.w2, weights.router_weight, weights.routing, activations,
                     weights.first_expert, weights.e_score_correction_bias, weights.shared if with_shared else None,
                     swiglu_epilogue, weight_layout)
        return layer

    @classmethod
    def from_pretrained(cls, path, layer: int, device="cuda", activations: str = "bf16",
                        experts: range | None = None, swiglu_epilogue: bool = True,
                        weight_layout: str = "plain") -> MoeFfn:
        """MoE layer `layer` of the ModelOpt NVFP4 export directory `path` on `device`: its
        experts (all, or the range `experts`), router and routing, shared expert (MoeFfn.from_weights)."""
        from .export import open_export

        return cls.from_weights(open_export(path).load_moe_layer(layer, device=device, experts=experts), activations,
                                swiglu_epilogue=swiglu_epilogue, weight_layout=weight_layout)

    def _build(self, w13, w2, router_weight, routing, activations, first_local, e_score_correction_bias, shared,
               swiglu_epilogue=True, weight_layout="plain"):
        if activations not in ACTIVATIONS:
            raise ValueError(f"MoeFfn: activations = {activations!r}: must be one of {ACTIVATIONS}")
        if weight_layout not in WEIGHT_LAYOUTS or (weight_layout == FRAGMENT and activations != "bf16"):
            raise ValueError(f"MoeFfn: weight_layout = {weight_layout!r}: must be one of {WEIGHT_LAYOUTS}, "
                             f"\"{FRAGMENT}\" with bf16 activations only (W4A16's decode)")
        self.activations = activations
        # W4A16 runs SwiGLU in the gate-and-up GEMM's epilogue (swiglu_epilogue, the default):
        # w13 is held in that epilogue's row order, one copy (dequantize_projection reads either)
        self.w13 = w13.in_swiglu_order() if activations == "bf16" and swiglu_epilogue else w13
        self.w2 = w2
        if shared is not None and self.w13.row_order == "swiglu":
            # the shared expert's gate-and-up too: its SwiGLU in the epilogue, not four small ops
            # (its N = 2 I is whole 128-row weight tiles: I, its down GEMM's K, is a multiple of 64)
            shared = {**shared, "w13": shared["w13"].in_swiglu_order()}
        # weight_layout="fragment": the weights packed once for the W4A16 decode's fragment
        # (nvfp4_group_gemm.weight_layout; one copy; dequantize_projection reads either)
        if weight_layout == FRAGMENT:
            self.w13, self.w2 = self.w13.packed_for_fragment(), self.w2.packed_for_fragment()
            if shared is not None:
                shared = {name: projection.packed_for_fragment() for name, projection in shared.items()}
        self.router_weight = router_weight.float()
        self.routing = routing
        self.top_k = routing.top_k
        self.e_score_correction_bias = None if e_score_correction_bias is None else e_score_correction_bias.float()
        self.experts, self.intermediate = self.w13.b.shape[0], self.w13.b.shape[1] // 2
        self.hidden = self.w2.b.shape[1]
        self.first_local = first_local
        if not 0 <= first_local <= router_weight.shape[0] - self.experts:
            raise ValueError(f"MoeFfn: first_local = {first_local}: the {self.experts} local experts must lie within "
                             f"the router's {router_weight.shape[0]}")
        # every expert local (no expert parallelism): the ids need no mapping and no pair is masked
        self.all_local = first_local == 0 and self.experts == router_weight.shape[0]
        # 0 .. E, where sort_by_expert's torch ops look up each expert's first pair
        self.expert_bounds = torch.arange(self.experts + 1, device=router_weight.device)
        # the routing, the pairs' sort and weighted sum as kernels on a GPU (nvfp4_group_gemm.pairs);
        # False: torch ops (the same values; the bench's comparison). Default: NVFP4_PAIR_KERNELS
        self.pair_kernels = switches.CURRENT.pair_kernels
        if activations == "nvfp4":  # the quantizer's constants on the device, before any capture
            checkpoint.midpoint_tensors(router_weight.device)
        # one activation scale per projection (the experts' largest), alpha recomputed with it
        self.scale13, self.alpha13 = self._scale_and_alpha(self.w13)
        self.scale2, self.alpha2 = self._scale_and_alpha(self.w2)
        self.shared = shared
        if shared is not None:
            self.shared_scale13, self.shared_alpha13 = self._scale_and_alpha(shared["w13"])
            self.shared_scale2, self.shared_alpha2 = self._scale_and_alpha(shared["w2"])

    def _scale_and_alpha(self, projection: checkpoint.MoeProjection) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the activations' global scale, None in W4A16; the GEMM's alpha [G] or [G, 2])."""
        if self.activations == "bf16":
            return None, projection.w4a16_alpha
        if projection.input_scale is None:
            raise ValueError("MoeFfn: activations = 'nvfp4' needs each projection's <p>_input_scale (the checkpoint "
                             "has none: use activations = 'bf16', W4A16)")
        scale = projection.input_scale.max()
        return scale, (scale * projection.weight_scale_2).float().contiguous()

    @property
    def swiglu_epilogue(self) -> bool:
        """Whether the gate-and-up GEMM runs SwiGLU in its epilogue (the entry's
        activation="swiglu": its output I wide, bf16, no [T k, 2 I] round trip and none of SwiGLU's
        four small ops): W4A16's default, w13 held in the epilogue's row order. The values are
        the unfused layer's up to silu's fp32 exponential (bit for bit on a CPU). The W4A4 layer
        quantizes SwiGLU's fp32 output for the down GEMM, so it runs SwiGLU unfused."""
        return self.w13.row_order == "swiglu"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids int64 [T, k], topk_weights fp32 [T, k]) of x [T, H]: the router's fp32
        logits through the layer's routing (nvfp4_group_gemm.routing)."""
        return route(x.float() @ self.router_weight.T, self.routing, self.e_score_correction_bias)

    def local_experts(self, experts: torch.Tensor) -> torch.Tensor:
        """Each pair's local expert, E (one past the last) for a pair routed to another GPU's
        (the ids as they are where every expert is local: no kernel)."""
        if self.all_local:
            return experts
        local = experts - self.first_local
        return torch.where((local >= 0) & (local < self.experts), local, self.experts)

    def sort_by_expert(self, experts: torch.Tensor, top_k: int):
        """(the pairs in expert order: their index into the T k pairs, their tokens, the int32
        offsets [E + 1]) on the pairs' device, with no host read; `experts` local
        (local_experts: E, another GPU's, sorts last, past offsets[E]). pairs.sort_pairs: one
        kernel on a GPU (pair_kernels), else a stable sort and searchsorted."""
        if self.pair_kernels:
            return pairs.sort_pairs(experts, self.experts, top_k, self.expert_bounds)
        return pairs.sort_pairs_torch(experts, self.experts, top_k, self.expert_bounds)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16 -> y [T, H] bf16: routing, the routed experts, the shared expert. The
        router's choice (softmax, or DeepSeek-V3's grouped sigmoid) and the pairs' sort run as one
        kernel where pairs.route_and_sort takes the batch (pair_kernels, a GPU, decode-sized T)."""
        shared = None if self.shared is None else self.shared_expert(x)
        if self.pair_kernels and pairs.route_and_sort_usable(x, self.routing, self.router_weight.shape[0]):
            logits = x.float() @ self.router_weight.T
            topk_ids, topk_weights, experts, *sorted_pairs = pairs.route_and_sort(
                logits, self.routing, self.first_local, self.experts, self.e_score_correction_bias)
            return self._experts_output(x, topk_ids, topk_weights, shared, torch.bfloat16,
                                        (experts, *sorted_pairs))
        topk_ids, topk_weights = self.route(x)
        return self._experts_output(x, topk_ids, topk_weights, shared, torch.bfloat16)

    def experts_output(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The routed experts' weighted sum for a caller that routes itself (vLLM's
        `fused_experts` convention): hidden_states [T, H] bf16, each token's experts topk_ids
        [T, k] (int32 or int64, global expert ids: the local ones first_local .. count) and
        their weights topk_weights [T, k]; no shared expert. Torch ops and the entry only: no
        host read, graph-safe."""
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden:
            raise ValueError(f"MoeFfn: hidden_states.shape = {tuple(hidden_states.shape)}: must be [T, {self.hidden}]")
        tokens = hidden_states.shape[0]
        if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(f"MoeFfn: topk_ids.shape = {tuple(topk_ids.shape)}, topk_weights.shape = "
                             f"{tuple(topk_weights.shape)}: both must be [T, k] with T = {tokens}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"MoeFfn: topk_ids.dtype = {topk_ids.dtype}: must be int32 or int64")
        return self._experts_output(hidden_states, topk_ids, topk_weights, None, out_dtype)

    def _experts_output(self, hidden_states, topk_ids, topk_weights, shared, out_dtype, sorted_pairs=None
                        ) -> torch.Tensor:
        """experts_output, plus `shared` (bf16 [T, H] or None) added before the one rounding;
        `sorted_pairs`: (the pairs' local experts, order, tokens, offsets) where the routing
        made them already."""
        top_k = topk_ids.shape[1]
        if sorted_pairs is None:
            experts = self.local_experts(topk_ids.reshape(-1).long())
            order, token_rows, offsets = self.sort_by_expert(experts, top_k)
        else:
            experts, order, token_rows, offsets = sorted_pairs
        projections = (self.w13, self.w2, (self.scale13, self.alpha13), (self.scale2, self.alpha2), offsets)
        if self.activations == "bf16":
            # the gate-and-up GEMM reads the sorted pairs' token rows in place (a_rows) and the
            # down GEMM writes row p of pair p (c_rows): no gathered or permuted copy
            unsorted = self.ffn(hidden_states, *projections, a_rows=token_rows, c_rows=order)
        else:  # the fp4 path quantizes the sorted pairs' token rows (gathered as it quantizes); then the un-permute
            down = self.ffn(hidden_states, *projections, a_rows=token_rows)
            unsorted = torch.empty_like(down)
            unsorted[order] = down  # row p: pair p = (token p // k, its (p % k)-th expert)
        # the rows of pairs on other GPUs' experts were not written: they add nothing here
        masked = None if self.all_local else experts
        combine = pairs.combine_pairs if self.pair_kernels else pairs.combine_pairs_torch
        return combine(unsorted, topk_weights, masked, self.experts, shared, out_dtype)

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert of every token, bf16 [T, H] (one group: offsets [0, T] made on
        the device, one_group_offsets)."""
        offsets = one_group_offsets(x.shape[0], x.device)
        return self.ffn(x, self.shared["w13"], self.shared["w2"], (self.shared_scale13, self.shared_alpha13),
                        (self.shared_scale2, self.shared_alpha2), offsets)

    def ffn(self, rows, w13, w2, scale_alpha13, scale_alpha2, offsets, a_rows=None, c_rows=None) -> torch.Tensor:
        """Gate-and-up GEMM, SwiGLU (fp32), down GEMM over rows grouped by `offsets`, bf16; W4A16
        only: the first GEMM's rows read through `a_rows`, the second's written through `c_rows`
        (the entry's row maps)."""
        intermediate = w13.b.shape[1] // 2
        kernels = self.pair_kernels
        if w13.row_order == "swiglu":  # SwiGLU in the GEMM's epilogue (swiglu_epilogue)
            hidden = self.gemm(rows, w13, *scale_alpha13, offsets, a_rows=a_rows, kernels=kernels)
            return self.gemm(hidden, w2, *scale_alpha2, offsets, c_rows=c_rows, kernels=kernels)
        gate_up = self.gemm(rows, w13, *scale_alpha13, offsets, a_rows=a_rows, kernels=kernels)
        # up promoted to fp32 inside the product (exact, as .float() is): one kernel fewer
        hidden = torch.nn.functional.silu(gate_up[:, :intermediate].float()) * gate_up[:, intermediate:]
        if scale_alpha2[0] is None:  # W4A16: the down GEMM reads bf16 rows
            hidden = hidden.to(torch.bfloat16)
        return self.gemm(hidden, w2, *scale_alpha2, offsets, c_rows=c_rows, kernels=kernels)

    @staticmethod
    def gemm(rows: torch.Tensor, projection: checkpoint.MoeProjection, scale: torch.Tensor | None,
             alpha: torch.Tensor, offsets: torch.Tensor, status: torch.Tensor | None = None, *,
             a_rows: torch.Tensor | None = None, c_rows: torch.Tensor | None = None,
             kernels: bool = False) -> torch.Tensor:
        """One grouped GEMM of the layer, bf16 output: `rows` as they are (bf16, W4A16: scale
        None), or quantized with `scale`; grouped row r reads rows[a_rows[r]] (W4A16: the GEMM's
        row map; W4A4: the rows gathered as they are quantized), and its output goes to row
        c_rows[r] (W4A16; an output of c_rows' length), where given; a projection in the SwiGLU
        epilogue's row order gives silu(gate) x up, N / 2 wide. `kernels`: the quantization as
        one kernel on a GPU (pairs.quantize_rows), else torch ops."""
        grouped = rows.shape[0] if a_rows is None else a_rows.shape[0]
        if scale is None:
            a, sfa = rows.to(torch.bfloat16).contiguous(), None
            if a.data_ptr() % 16:  # a view into a larger batch (a rank's tokens): the entry reads aligned rows
                a = a.clone()
        else:
            quantize = pairs.quantize_rows if kernels else pairs.quantize_rows_torch
            a, sfa = quantize(rows, scale, a_rows)
            a_rows = None  # the quantized rows are the grouped rows
        swiglu = projection.row_order == "swiglu"
        columns = projection.b.shape[1] // 2 if swiglu else projection.b.shape[1]
        c = torch.empty(grouped, columns, dtype=torch.bfloat16, device=rows.device)
        moe_grouped_gemm_op(a, sfa, projection.b, projection.sfb, offsets, c, status, alpha, a_rows, c_rows,
                            "swiglu" if swiglu else None,
                            None if projection.b_layout == PLAIN else projection.b_layout)
        return c


def one_group_offsets(rows: int, device: torch.device) -> torch.Tensor:
    """int32 [0, rows] on `device`, the offsets of one group of all the rows, as one op (a
    stepped arange; a kernel on a GPU, where arange then a product were two), no host copy
    (graph-safe)."""
    if rows == 0:
        return torch.zeros(2, dtype=torch.int32, device=device)
    return torch.arange(0, 2 * rows, rows, dtype=torch.int32, device=device)


def float64_reference(layer: MoeFfn, x: torch.Tensor) -> torch.Tensor:
    """What `layer` computes before its roundings, float64 [T, H]: its routing of x (layer.route),
    each routed pair through its expert dequantized exactly (checkpoint.dequantize_projection)
    with SwiGLU, weighted and summed, plus the shared expert; the pairs routed to other ranks'
    experts add nothing. A reference (it loops over the experts): tests and examples."""
    topk_ids, topk_weights = layer.route(x)
    x64 = x.double()
    out = torch.zeros(x.shape[0], layer.hidden, dtype=torch.float64, device=x.device)

    def expert_ffn(rows, w13, w2):
        gate, up = (rows @ w13.T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w2.T

    w13, w2 = checkpoint.dequantize_projection(layer.w13), checkpoint.dequantize_projection(layer.w2)
    local = layer.local_experts(topk_ids.long())
    for e in range(layer.experts):
        tokens, slots = torch.nonzero(local == e, as_tuple=True)
        if tokens.numel():
            weights = topk_weights[tokens, slots].double()[:, None]
            out.index_add_(0, tokens, weights * expert_ffn(x64[tokens], w13[e], w2[e]))
    if layer.shared is not None:
        out += expert_ffn(x64, checkpoint.dequantize_projection(layer.shared["w13"])[0],
                          checkpoint.dequantize_projection(layer.shared["w2"])[0])
    return out
