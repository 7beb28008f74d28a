"""The MoE layer's two small kernels around its GEMMs (nvfp4_group_gemm.pairs launches them):

    sort (Sm90MoeSortPairs): the T x k (token, expert) pairs grouped by expert in one CTA, a
        counting sort in shared memory: each expert's pair count (shared atomics), their
        exclusive prefix sum by one warp (the GEMMs' int32 offsets [E + 1]), then each pair's
        place in its expert's range (shared atomics: the pairs' order within an expert is
        unspecified, which no output depends on: a GEMM row's value does not depend on the row's
        place in its group). It writes the order (the pair at each sorted place) and a_rows (its
        token, order // k), both int64 as the entry's row maps. Expert ids outside [0, E) sort
        last, past offsets[E] (another GPU's experts). One launch where torch's stable sort and
        searchsorted are seven (two memsets, an arange, the radix sort, searchsorted, a division).
    combine (Sm90MoeCombine): out[t] = sum over j < k of weights[t k + j] x rows[t k + j] (+
        shared[t]), fp32 (each product rounded, then the sum in j order, as torch's mul and add),
        rounded once to bf16 (or kept fp32); a pair whose expert is not local (expert >= E, where
        masked) adds nothing and its row is not read. One thread per 8 columns of a token (one
        16-byte load per pair). One launch where the cast, the product, the sum over k and the
        rounding were four kernels and a [T, k, H] fp32 round trip through memory.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute

from nvfp4_group_gemm import core

from .moe import WARP, warp_inclusive_sum
from .ptx import (
    accumulate_f32x8,
    atomic_add_u32_shared,
    bf16x8_to_f32,
    group_top_two,
    lane_best,
    load_bf16x8_where,
    load_f32_global,
    load_f32_global_or_neg_inf,
    load_f32x4_global_l2,
    load_i64_global,
    load_u32_shared,
    load_u32x4_global_nc,
    pack_bf16x2,
    quantize_block,
    store_f32_global,
    store_f32x4_global,
    store_i64_global,
    store_u8_global,
    store_u32_global,
    store_u32_shared,
    store_u32x2_global,
    store_u32x4_global,
    take_slot,
    warp_best,
    zero_unkept,
)

SORT_THREADS = 1024
COMBINE_THREADS = 256
# columns of one combine thread: 16 bytes of a bf16 row
COMBINE_COLUMNS = 8
COMBINE_OUT_DTYPES = ("bfloat16", "float32")
# launch.CellLauncher's kinds and pointer dtypes of the two kernels' arguments (their __call__s)
SORT_ARGS = (("ptr",) * 4 + ("i32",) * 2 + ("stream",),
             (cutlass.Int64, cutlass.Int64, cutlass.Int64, cutlass.Int32, None, None, None))
ROUTE_SORT_ARGS = (("ptr",) * 8 + ("i32",) * 2 + ("stream",),
                   (cutlass.Float32, cutlass.Float32, cutlass.Int64, cutlass.Float32, cutlass.Int64, cutlass.Int64,
                    cutlass.Int64, cutlass.Int32, None, None, None))
QUANTIZE_ARGS = (("ptr",) * 5 + ("i32",) * 3 + ("stream",),
                 (cutlass.Uint8, cutlass.Int64, cutlass.Float32, cutlass.Uint8, cutlass.Uint8) + (None,) * 4)
COMBINE_ARGS = (("ptr",) * 5 + ("i32",) * 4 + ("stream",),
                (cutlass.BFloat16, cutlass.Float32, cutlass.Int64, cutlass.BFloat16, cutlass.Uint8) + (None,) * 5)


class Sm90MoeSortPairs:
    """The pairs' counting sort by expert (module docstring), E = num_experts local experts."""

    def __init__(self, num_experts: int, threads: int = SORT_THREADS):
        self.num_experts = num_experts
        self.bins = num_experts + 1  # bin E: the pairs of experts not local
        self.threads = threads

    @cute.jit
    def __call__(self, experts: cute.Pointer, order: cute.Pointer, a_rows: cute.Pointer, offsets: cute.Pointer,
                 pairs: cutlass.Int32, top_k: cutlass.Int32, stream: cuda.CUstream):
        fields = {"counts": cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.bins], 16]}
        self.shared_storage = cute.struct(type("SortStorage", (), {"__annotations__": fields}))
        self.kernel(experts, order, a_rows, offsets, pairs, top_k).launch(
            grid=(1, 1, 1), block=(self.threads, 1, 1), smem=self.shared_storage.size_in_bytes(), stream=stream)

    @cute.jit
    def expert_bin(self, experts: cute.Pointer, pair):
        """The pair's bin: its expert, E where the expert is not in [0, E)."""
        expert = load_i64_global(experts.toint() + cutlass.Int64(pair) * 8)
        bin_ = cutlass.Int32(self.num_experts)
        if (expert >= 0) & (expert < self.num_experts):
            bin_ = cutlass.Int32(expert)
        return bin_

    @cute.kernel
    def kernel(self, experts: cute.Pointer, order: cute.Pointer, a_rows: cute.Pointer, offsets: cute.Pointer,
               pairs: cutlass.Int32, top_k: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        counts = self.zeroed_counts(tidx)
        cute.arch.sync_threads()
        self.sort(tidx, counts, experts, order, a_rows, offsets, pairs, top_k)

    @cute.jit
    def zeroed_counts(self, tidx):
        """The shared address of the E + 1 bins' counts, zeroed (a barrier before their use)."""
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        counts = storage.counts.data_ptr().toint()
        for i in cutlass.range_constexpr((self.bins + self.threads - 1) // self.threads):
            b = tidx + self.threads * i
            if b < self.bins:
                store_u32_shared(counts + b * 4, cutlass.Int32(0))
        return counts

    @cute.jit
    def sort(self, tidx, counts, experts: cute.Pointer, order: cute.Pointer, a_rows: cute.Pointer,
             offsets: cute.Pointer, pairs, top_k):
        """The counting sort (module docstring) of the pairs' experts, every thread of the CTA."""
        for pair in cutlass.range(tidx, pairs, self.threads):
            atomic_add_u32_shared(counts + self.expert_bin(experts, pair) * 4, cutlass.Int32(1))
        cute.arch.sync_threads()
        # one warp: the exclusive prefix sum of the counts, 32 bins at a time; it becomes each
        # bin's first place (the offsets) and, in shared memory, the bin's next free place
        if tidx < WARP:
            lane = tidx
            running = cutlass.Int32(0)
            for c in cutlass.range_constexpr((self.bins + WARP - 1) // WARP):
                b = lane + WARP * c
                count = cutlass.Int32(0)
                if b < self.bins:
                    count = load_u32_shared(counts + b * 4)
                inclusive = warp_inclusive_sum(count, lane)
                if b < self.bins:
                    first = running + inclusive - count
                    store_u32_shared(counts + b * 4, first)
                    store_u32_global(offsets.toint() + cutlass.Int64(b) * 4, first)
                running = running + cute.arch.shuffle_sync(inclusive, WARP - 1)
        cute.arch.sync_threads()
        for pair in cutlass.range(tidx, pairs, self.threads):
            place = atomic_add_u32_shared(counts + self.expert_bin(experts, pair) * 4, cutlass.Int32(1))
            store_i64_global(order.toint() + cutlass.Int64(place) * 8, cutlass.Int64(pair))
            store_i64_global(a_rows.toint() + cutlass.Int64(place) * 8, cutlass.Int64(pair // top_k))


class Sm90MoeRouteSort(Sm90MoeSortPairs):
    """A router's choice and the pairs' sort in one CTA (module docstring): each warp takes
    tokens in turn, its lanes holding the router's E_r logits 32 apart; k rounds of the largest
    untaken score (a lane's own, then the warp's: the lowest expert on a tie) give the token's
    experts in descending order; their local ids (id - first_local; E where not local) feed the
    counting sort after a barrier. For decode-sized batches (pairs.ROUTE_MAX_TOKENS): a warp's
    rounds take about 40 instructions each.

    softmax (Qwen3-MoE, Mixtral): the rounds read the logits; the weights are the softmax of the
        k logits (renormalize) or of all E_r.
    sigmoid (DeepSeek-V3): the rounds read each expert's sigmoid plus its correction bias (where
        `bias`), those of all but the `topk_group` best of `n_group` groups set to 0 (a group's
        score: the sum of its two best; a group is whole slots, E_r / n_group a multiple of 32);
        the weights are the chosen experts' sigmoids over their sum plus 1e-20 (renormalize),
        times `scaling`. The sigmoid is 1 / (1 + exp(-x)) with libdevice's expf and an IEEE
        division, torch's own formula on the GPU (nvfp4_group_gemm.routing)."""

    def __init__(self, num_experts: int, router_experts: int, top_k: int, renormalize: bool,
                 scoring: str = "softmax", n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
                 bias: bool = False):
        # the grouped sigmoid's group scores and recomputed weights need more than the 64
        # registers a thread of 1024 has (40 bytes of local memory there): 512 threads
        super().__init__(num_experts, SORT_THREADS if scoring == "softmax" else SORT_THREADS // 2)
        self.router_experts, self.top_k, self.renormalize = router_experts, top_k, renormalize
        self.scoring, self.n_group, self.topk_group = scoring, n_group, topk_group
        self.scaling, self.bias = scaling, bias
        self.slots = (router_experts + WARP - 1) // WARP
        self.slots_per_group = self.slots // n_group

    @cute.jit
    def __call__(self, logits: cute.Pointer, bias: cute.Pointer, topk_ids: cute.Pointer,
                 topk_weights: cute.Pointer, experts: cute.Pointer, order: cute.Pointer, a_rows: cute.Pointer,
                 offsets: cute.Pointer, tokens: cutlass.Int32, first_local: cutlass.Int32, stream: cuda.CUstream):
        fields = {"counts": cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.bins], 16]}
        self.shared_storage = cute.struct(type("RouteStorage", (), {"__annotations__": fields}))
        self.kernel(logits, bias, topk_ids, topk_weights, experts, order, a_rows, offsets, tokens,
                    first_local).launch(grid=(1, 1, 1), block=(self.threads, 1, 1),
                                        smem=self.shared_storage.size_in_bytes(), stream=stream)

    @cute.jit
    def sigmoid(self, x: cutlass.Float32) -> cutlass.Float32:
        return cutlass.Float32(1.0) / (cutlass.Float32(1.0) + cute.math.exp(cutlass.Float32(0.0) - x))

    @cute.jit
    def sigmoid_choice(self, values, bias: cute.Pointer, lane):
        """Each slot's choice score: its sigmoid plus its bias (-inf past E_r), the groups not
        kept set to 0."""
        choice = []
        for i in cutlass.range_constexpr(self.slots):
            expert = lane + WARP * i
            if cutlass.const_expr(self.bias):
                offset = load_f32_global_or_neg_inf(bias.toint() + cutlass.Int64(expert) * 4,
                                                    cutlass.Int32(expert < self.router_experts))
            else:
                offset = cutlass.Float32(0.0)
                if expert >= self.router_experts:
                    offset = cutlass.Float32(float("-inf"))
            choice.append(self.sigmoid(values[i]) + offset)
        if cutlass.const_expr(self.n_group > 1):
            group_scores = []
            for g in cutlass.range_constexpr(self.n_group):
                first, second = group_top_two(choice[g * self.slots_per_group:(g + 1) * self.slots_per_group])
                group_scores.append(first + second)
            kept = cutlass.Int32(0)
            for _ in cutlass.range_constexpr(self.topk_group):
                _, group = lane_best(group_scores, kept)  # the same in every lane
                kept = kept | (cutlass.Int32(1) << group)
            choice = zero_unkept(choice, kept, self.slots_per_group)
        return choice

    @cute.kernel
    def kernel(self, logits: cute.Pointer, bias: cute.Pointer, topk_ids: cute.Pointer, topk_weights: cute.Pointer,
               experts: cute.Pointer, order: cute.Pointer, a_rows: cute.Pointer, offsets: cute.Pointer,
               tokens: cutlass.Int32, first_local: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        counts = self.zeroed_counts(tidx)
        warp = tidx // WARP
        lane = tidx % WARP
        for token in cutlass.range(warp, tokens, self.threads // WARP):
            row = logits.toint() + cutlass.Int64(token) * (self.router_experts * 4)
            values = [load_f32_global_or_neg_inf(row + (lane + WARP * i) * 4,
                                                 cutlass.Int32(lane + WARP * i < self.router_experts))
                      for i in range(self.slots)]
            scores = values
            if cutlass.const_expr(self.scoring == "sigmoid"):
                scores = self.sigmoid_choice(values, bias, lane)
            taken = cutlass.Int32(0)
            chosen = []
            for _ in cutlass.range_constexpr(self.top_k):
                value, slot = lane_best(scores, taken)
                value, index = warp_best(value, slot * WARP + lane)
                taken = take_slot(taken, lane, index)
                chosen.append((value, index))
            if cutlass.const_expr(self.scoring == "sigmoid"):
                # the chosen experts' sigmoids (without the bias), from their logits again
                weights = [self.sigmoid(load_f32_global(row + cutlass.Int64(index) * 4)) for _, index in chosen]
                if cutlass.const_expr(self.renormalize):
                    total = weights[0]
                    for w in weights[1:]:
                        total = total + w
                    total = total + cutlass.Float32(1e-20)
                    weights = [w / total for w in weights]
                weights = [w * cutlass.Float32(self.scaling) for w in weights]
            else:
                largest = chosen[0][0]  # the token's largest logit: every exponent <= 0
                exps = [cute.math.exp(value - largest) for value, _ in chosen]
                if cutlass.const_expr(self.renormalize):
                    # the softmax of the k logits: the k largest probabilities over their sum
                    total = exps[0]
                    for e in exps[1:]:
                        total = total + e
                else:  # the softmax over every expert: its denominator over the whole row
                    total = cute.math.exp(values[0] - largest)
                    for v in values[1:]:
                        total = total + cute.math.exp(v - largest)
                    total = cute.arch.warp_reduction(total, lambda a, b: a + b)
                weights = [e / total for e in exps]
            if lane == 0:
                for j in cutlass.range_constexpr(self.top_k):
                    pair = cutlass.Int64(token) * self.top_k + j
                    index = chosen[j][1]
                    store_i64_global(topk_ids.toint() + pair * 8, cutlass.Int64(index))
                    store_f32_global(topk_weights.toint() + pair * 4, weights[j])
                    local = index - first_local
                    bin_ = cutlass.Int32(self.num_experts)
                    if (local >= 0) & (local < self.num_experts):
                        bin_ = local
                    store_i64_global(experts.toint() + pair * 8, cutlass.Int64(bin_))
        cute.arch.sync_threads()  # every pair's expert written (global memory, this CTA)
        self.sort(tidx, counts, experts, order, a_rows, offsets, tokens * self.top_k, cutlass.Int32(self.top_k))


class Sm90MoeCombine:
    """The weighted sum of each token's k pair rows (module docstring): rows bf16 [T k, H] in
    pair order, weights fp32 [T k]; `masked`: experts int64 [T k] local ids (E: not local);
    `shared`: a bf16 [T, H] added before the rounding; out [T, H] of `out_dtype`."""

    def __init__(self, top_k: int, out_dtype: str, masked: bool, shared: bool):
        if out_dtype not in COMBINE_OUT_DTYPES:
            raise ValueError(f"out_dtype={out_dtype!r}: must be one of {', '.join(COMBINE_OUT_DTYPES)}")
        self.top_k, self.out_dtype, self.masked, self.shared = top_k, out_dtype, masked, shared

    @cute.jit
    def __call__(self, rows: cute.Pointer, weights: cute.Pointer, experts: cute.Pointer, shared: cute.Pointer,
                 out: cute.Pointer, tokens: cutlass.Int32, hidden: cutlass.Int32, num_experts: cutlass.Int32,
                 blocks: cutlass.Int32, stream: cuda.CUstream):
        self.kernel(rows, weights, experts, shared, out, tokens, hidden, num_experts).launch(
            grid=(blocks, 1, 1), block=(COMBINE_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, rows: cute.Pointer, weights: cute.Pointer, experts: cute.Pointer, shared: cute.Pointer,
               out: cute.Pointer, tokens: cutlass.Int32, hidden: cutlass.Int32, num_experts: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        chunks = hidden // COMBINE_COLUMNS
        item = bidx * COMBINE_THREADS + tidx
        token = item // chunks
        column = cutlass.Int64(item - token * chunks) * COMBINE_COLUMNS
        if token < tokens:
            # every load first (the k rows' 16 bytes in flight together), then the sums
            pairs = [cutlass.Int64(token) * self.top_k + j for j in range(self.top_k)]
            weights_k = [load_f32_global(weights.toint() + pair * 4) for pair in pairs]
            if cutlass.const_expr(self.masked):
                experts_k = [load_i64_global(experts.toint() + pair * 8) for pair in pairs]
                bound = cutlass.Int64(num_experts)
            addresses = [rows.toint() + (pair * hidden + column) * 2 for pair in pairs]
            if cutlass.const_expr(self.masked):
                words_k = [load_bf16x8_where(address, expert, bound) for address, expert in zip(addresses, experts_k)]
            else:
                words_k = [load_u32x4_global_nc(address) for address in addresses]
            if cutlass.const_expr(self.shared):
                words_k.append(load_u32x4_global_nc(shared.toint() + (cutlass.Int64(token) * hidden + column) * 2))
                weights_k.append(cutlass.Float32(1.0))
            accumulators = [cutlass.Float32(0.0)] * COMBINE_COLUMNS
            for words, weight in zip(words_k, weights_k):
                accumulators = accumulate_f32x8(accumulators, bf16x8_to_f32(words), weight)
            element = cutlass.Int64(token) * hidden + column
            if cutlass.const_expr(self.out_dtype == "bfloat16"):
                store_u32x4_global(out.toint() + element * 2,
                                   [pack_bf16x2(accumulators[2 * i], accumulators[2 * i + 1]) for i in range(4)])
            else:
                store_f32x4_global(out.toint() + element * 4, accumulators[:4])
                store_f32x4_global(out.toint() + element * 4 + 16, accumulators[4:])


QUANTIZE_THREADS = 256
QUANTIZE_IN_DTYPES = ("bfloat16", "float32")


class Sm90QuantizeRows:
    """Rows x [R, K] (bf16 or fp32; through a row map where `gather`: output row r quantizes
    x[rows[r]]) as NVFP4 under a global scale on the device: one thread per 16-element block,
    its values loaded in 16-byte pieces, then ptx.quantize_block (the format's formula as
    checkpoint.quantize_blocks computes it, bit for bit), 8 bytes of codes and one scale byte
    stored: a [R, K/2], plain scales [R, K/16]."""

    def __init__(self, in_dtype: str, gather: bool):
        if in_dtype not in QUANTIZE_IN_DTYPES:
            raise ValueError(f"in_dtype={in_dtype!r}: must be one of {', '.join(QUANTIZE_IN_DTYPES)}")
        self.in_dtype, self.gather = in_dtype, gather

    @cute.jit
    def __call__(self, x: cute.Pointer, rows: cute.Pointer, scale: cute.Pointer, a: cute.Pointer,
                 sfa: cute.Pointer, count: cutlass.Int32, k: cutlass.Int32, blocks: cutlass.Int32,
                 stream: cuda.CUstream):
        self.kernel(x, rows, scale, a, sfa, count, k).launch(
            grid=(blocks, 1, 1), block=(QUANTIZE_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Pointer, rows: cute.Pointer, scale: cute.Pointer, a: cute.Pointer,
               sfa: cute.Pointer, count: cutlass.Int32, k: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        blocks_per_row = k // 16
        item = bidx * QUANTIZE_THREADS + tidx
        row = item // blocks_per_row
        block = item - row * blocks_per_row
        if row < count:
            source = cutlass.Int64(row)
            if cutlass.const_expr(self.gather):
                source = load_i64_global(rows.toint() + cutlass.Int64(row) * 8)
            element = source * k + cutlass.Int64(block) * 16
            if cutlass.const_expr(self.in_dtype == "bfloat16"):
                address = x.toint() + element * 2
                values = bf16x8_to_f32(load_u32x4_global_nc(address)) + bf16x8_to_f32(
                    load_u32x4_global_nc(address + 16))
            else:
                address = x.toint() + element * 4
                values = [v for piece in range(4) for v in load_f32x4_global_l2(address + 16 * piece)]
            low, high, scale_byte = quantize_block(values, load_f32_global(scale.toint()))
            out = cutlass.Int64(row) * blocks_per_row + block
            store_u32x2_global(a.toint() + out * 8, low, high)
            store_u8_global(sfa.toint() + out, scale_byte)


fake_ptr = core.fake_ptr


def sort_pairs_build(num_experts: int) -> tuple:
    return Sm90MoeSortPairs(num_experts), (
        fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int32),
        cutlass.Int32(1), cutlass.Int32(1), cuda.CUstream(0))


def route_sort_build(num_experts: int, router_experts: int, top_k: int, renormalize: bool, scoring: str = "softmax",
                     n_group: int = 1, topk_group: int = 1, scaling: float = 1.0, bias: bool = False) -> tuple:
    return Sm90MoeRouteSort(num_experts, router_experts, top_k, renormalize, scoring, n_group, topk_group, scaling,
                            bias), (
        fake_ptr(cutlass.Float32), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Int64), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Int64),
        fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int64), fake_ptr(cutlass.Int32), cutlass.Int32(1), cutlass.Int32(0),
        cuda.CUstream(0))


def combine_build(top_k: int, out_dtype: str, masked: bool, shared: bool) -> tuple:
    return Sm90MoeCombine(top_k, out_dtype, masked, shared), (
        fake_ptr(cutlass.BFloat16), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Int64), fake_ptr(cutlass.BFloat16),
        fake_ptr(cutlass.Uint8), cutlass.Int32(1), cutlass.Int32(8), cutlass.Int32(1), cutlass.Int32(1),
        cuda.CUstream(0))


def compile_sort_pairs(num_experts: int, options: str | None = None):
    """Compile (cached: core.compile_key) the pairs' sort for num_experts local experts."""
    return core.compile_once(sort_pairs_build, num_experts, options=options)


def quantize_build(in_dtype: str, gather: bool) -> tuple:
    return Sm90QuantizeRows(in_dtype, gather), (
        fake_ptr(cutlass.Uint8), fake_ptr(cutlass.Int64), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Uint8),
        fake_ptr(cutlass.Uint8), cutlass.Int32(1), cutlass.Int32(16), cutlass.Int32(1), cuda.CUstream(0))


def compile_quantize(in_dtype: str = "bfloat16", gather: bool = False, options: str | None = None):
    """Compile (cached: core.compile_key) the rows' NVFP4 quantizer."""
    return core.compile_once(quantize_build, in_dtype, gather, options=options)


def compile_quantize_target(groups: int, options: str | None = None, in_dtype: str = "bfloat16",
                            gather: bool = False):
    """compile_quantize for a build report (G is not a quantizer's)."""
    return compile_quantize(in_dtype, gather, options=options)


def compile_route_sort(num_experts: int, router_experts: int, top_k: int, renormalize: bool,
                       scoring: str = "softmax", n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
                       bias: bool = False, options: str | None = None):
    """Compile (cached: core.compile_key) a router's choice (Sm90MoeRouteSort) and the pairs' sort."""
    return core.compile_once(route_sort_build, num_experts, router_experts, top_k, renormalize, scoring, n_group,
                             topk_group, scaling, bias, options=options)


def compile_route_sort_target(groups: int, options: str | None = None, renormalize: bool = True):
    """compile_route_sort for a build report: G local experts of a router's G, top-8."""
    return compile_route_sort(groups, groups, min(8, groups), renormalize, options=options)


def compile_route_sort_grouped_target(groups: int, options: str | None = None):
    """A DeepSeek-V3 router for a build report: 256 experts in 8 groups, the best 4, top-8, a
    correction bias, scaled by 2.5; G local experts."""
    return compile_route_sort(groups, 256, 8, True, "sigmoid", 8, 4, 2.5, True, options=options)


def compile_combine(top_k: int, out_dtype: str = "bfloat16", masked: bool = False, shared: bool = False,
                    options: str | None = None):
    """Compile (cached: core.compile_key) the weighted sum of k pair rows per token."""
    return core.compile_once(combine_build, top_k, out_dtype, masked, shared, options=options)


def compile_combine_target(groups: int, options: str | None = None, out_dtype: str = "bfloat16",
                           masked: bool = False, shared: bool = False):
    """compile_combine at k = 8 (a build report's compile(G, options): G is not a combine's)."""
    return compile_combine(8, out_dtype, masked, shared, options=options)


def layer_compile_targets():
    """The layer's kernels for the build report: (kernel name, arch, compile(G, options)); G is
    the sort's expert count."""
    return [
        ("sm90_moe_sort_pairs", "sm_90a", compile_sort_pairs),
        ("sm90_moe_route_sort", "sm_90a", compile_route_sort_target),
        ("sm90_moe_route_sort_softmax_all", "sm_90a", functools.partial(compile_route_sort_target, renormalize=False)),
        ("sm90_moe_route_sort_grouped_sigmoid", "sm_90a", compile_route_sort_grouped_target),
        ("sm90_moe_combine_bf16", "sm_90a", compile_combine_target),
        ("sm90_moe_quantize_gather_bf16", "sm_90a", functools.partial(compile_quantize_target, gather=True)),
        ("sm90_moe_quantize_f32", "sm_90a", functools.partial(compile_quantize_target, in_dtype="float32")),
        ("sm90_moe_combine_masked_shared_f32", "sm_90a",
         functools.partial(compile_combine_target, out_dtype="float32", masked=True, shared=True)),
    ]
