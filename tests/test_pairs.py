"""The MoE layer's pair kernels (nvfp4_group_gemm.pairs, hopper/layer.py) on a CPU: the torch ops
each kernel is checked against, against plain loops; the combine's inline PTX (the bf16 unpack,
product and sum) run by the PTX interpreter against numpy's fp32; the kernels' sm_90a builds."""

import numpy as np
import pytest
import torch
from ptx_interpreter import Thread, Warp, _bits_to_f32, _f32_to_bits

from nvfp4_group_gemm import pairs
from nvfp4_group_gemm.hopper import layer, ptx


@pytest.mark.parametrize("pairs_count,num_experts,top_k", [(1, 1, 1), (40, 8, 2), (1024, 128, 8), (999, 512, 3)])
def test_the_torch_sort_groups_pairs_by_expert_stably(pairs_count, num_experts, top_k):
    generator = torch.Generator().manual_seed(pairs_count)
    # E marks another GPU's expert
    experts = torch.randint(0, num_experts + 1, (pairs_count,), generator=generator)
    order, a_rows, offsets = pairs.sort_pairs(experts, num_experts, top_k)
    expected_order = [p for e in range(num_experts + 1) for p in range(pairs_count) if experts[p] == e]
    assert order.tolist() == expected_order
    assert a_rows.tolist() == [p // top_k for p in expected_order]
    counts = torch.bincount(experts, minlength=num_experts + 1)
    assert offsets.tolist() == [0] + torch.cumsum(counts, 0)[:num_experts].tolist()
    assert offsets.dtype == torch.int32 and order.dtype == a_rows.dtype == torch.int64


def test_the_sort_refuses_what_its_kernel_cannot_read():
    with pytest.raises(TypeError, match=r"sort_pairs: experts torch.int32 \(4,\): must be int64 \[P\]"):
        pairs.sort_pairs(torch.zeros(4, dtype=torch.int32), 4, 1)
    with pytest.raises(ValueError, match="num_experts = 0: must be >= 1"):
        pairs.sort_pairs(torch.zeros(4, dtype=torch.int64), 0, 1)


@pytest.mark.parametrize("masked", [False, True], ids=["all_local", "masked"])
@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_torch_combine_is_the_weighted_sum_of_each_tokens_rows(masked, with_shared, out_dtype):
    tokens, top_k, hidden, num_experts = 5, 3, 16, 4
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(tokens * top_k, hidden, generator=generator).bfloat16()
    weights = torch.rand(tokens, top_k, generator=generator)
    experts = torch.randint(0, num_experts + 1, (tokens * top_k,), generator=generator) if masked else None
    if masked:
        rows[experts == num_experts] = float("nan")  # rows another GPU computes: never read
    shared = torch.randn(tokens, hidden, generator=generator).bfloat16() if with_shared else None
    out = pairs.combine_pairs(rows, weights, experts, num_experts, shared, out_dtype)
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            p = t * top_k + j
            if experts is None or experts[p] < num_experts:
                expected[t] += float(weights[t, j]) * rows[p].double()
        if shared is not None:
            expected[t] += shared[t].double()
    assert out.dtype == out_dtype and not out.isnan().any()
    # fp32 products and sums, rounded once to the output
    tolerance = 2**-8 if out_dtype == torch.bfloat16 else 2**-20
    assert torch.allclose(out.double(), expected, rtol=tolerance, atol=1e-6)


def test_the_combine_refuses_rows_that_are_not_the_pairs():
    with pytest.raises(TypeError, match=r"rows torch.float32 \(6, 8\): must be bf16 \[T k = 6, H\]"):
        pairs.combine_pairs(torch.zeros(6, 8), torch.ones(3, 2))
    with pytest.raises(TypeError, match=r"rows torch.bfloat16 \(5, 8\): must be bf16 \[T k = 6, H\]"):
        pairs.combine_pairs(torch.zeros(5, 8, dtype=torch.bfloat16), torch.ones(3, 2))


def test_the_combines_inline_ptx_is_numpys_fp32_mul_then_add():
    """The combine's two texts in turn, one thread: bf16x8_to_f32 (4 words to 8 fp32, exact),
    then accumulate_f32x8 (8 accumulators plus weight x value, each product rounded to fp32,
    then the sum rounded: no fused multiply-add), on values whose fused and unfused results
    differ."""
    rng = np.random.default_rng(3)
    for trial in range(50):
        values = torch.tensor(rng.normal(size=8) * 10.0 ** rng.integers(-3, 4), dtype=torch.float32).bfloat16()
        bits = values.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)
        words = [int(bits[2 * i]) | (int(bits[2 * i + 1]) << 16) for i in range(4)]
        unpack = Thread({8 + i: words[i] for i in range(4)}, {})
        unpack.run(ptx.bf16x8_to_f32_text())
        accumulators = rng.normal(size=8).astype(np.float32)
        weight = np.float32(rng.random())
        operands = {e: _f32_to_bits(accumulators[e]) for e in range(8)}
        operands[8] = _f32_to_bits(weight)
        operands.update({9 + e: unpack.registers[f"${e}"] for e in range(8)})
        thread = Thread(operands, {})
        thread.run(ptx.accumulate_f32x8_text())
        got = [_bits_to_f32(thread.registers[f"${e}"]) for e in range(8)]
        expected = [np.float32(accumulators[e] + np.float32(np.float32(values[e].float().item()) * weight))
                    for e in range(8)]
        assert [_f32_to_bits(g) for g in got] == [_f32_to_bits(x) for x in expected], trial


def test_the_layer_runs_its_pair_ops_or_the_torch_ones_alike():
    """On a CPU both settings of MoeFfn.pair_kernels run the same torch ops: the same bits."""
    from test_moe_layer import HIDDEN, make_layer

    _, layer, _ = make_layer()
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    with_kernels = layer(x)
    layer.pair_kernels = False
    assert torch.equal(layer(x), with_kernels)


def test_the_pair_kernels_build_for_sm_90a(sm90_builds):
    """The layer's kernels (the sort, the routings, the combine's masked, shared, fp32 build, the
    quantizer) compile for sm_90a: one CTA of 1024 threads for the sort and the softmax routing,
    512 for the grouped sigmoid, shared memory for the E + 1 counts; 256 threads for the
    combine; no local memory."""
    for name, _, _ in layer.layer_compile_targets():
        for groups in (1, 8):
            report = sm90_builds[(name, groups)]
            assert report.error is None, (name, groups, report.error)
            # one CTA's registers fit the SM's 64 K, and nothing spills to local memory
            assert report.registers and report.registers * report.threads <= 65536, (name, report.registers)
            assert report.spill_bytes_max == 0 and report.frame_bytes == 0, (name, report.frame_bytes)


def route_in_the_interpreter(logits: np.ndarray, top_k: int) -> list[int]:
    """The routing kernel's choice for one token, its PTX run in the interpreter: each lane's
    values 32 apart (-inf past E), k rounds of lane_best, warp_best and take_slot."""
    experts = logits.shape[0]
    slots = (experts + 31) // 32
    values = [[_f32_to_bits(np.float32(logits[lane + 32 * i])) if lane + 32 * i < experts else 0xFF800000
               for i in range(slots)] for lane in range(32)]
    taken = [0] * 32
    chosen = []
    for _ in range(top_k):
        best = []
        for lane in range(32):
            thread = Thread({2: taken[lane], **{3 + i: values[lane][i] for i in range(slots)}}, {})
            thread.run(ptx.lane_best_text(slots))
            index = (thread.registers["$1"] * 32 + lane) & 0xFFFFFFFF
            best.append({0: thread.registers["$0"], 1: index})
        warp = Warp(best)
        warp.run(ptx.warp_best_text())
        winners = {(t.registers["$0"], t.registers["$1"]) for t in warp.threads}
        assert len(winners) == 1  # every lane holds the warp's winner
        (_, index), = winners
        chosen.append(index)
        for lane in range(32):
            thread = Thread({1: taken[lane], 2: lane, 3: index}, {})
            thread.run(ptx.take_slot_text())
            taken[lane] = thread.registers["$0"]
    return chosen


@pytest.mark.parametrize("experts,top_k", [(8, 2), (128, 8), (160, 6), (512, 8), (1024, 4)])
def test_the_routing_kernels_ptx_picks_the_k_largest_lowest_expert_first_on_a_tie(experts, top_k):
    rng = np.random.default_rng(experts + top_k)
    for trial in range(4):
        logits = rng.normal(size=experts).astype(np.float32)
        if trial % 2:  # ties: a few values repeated, among them the largest
            logits[rng.choice(experts, size=min(6, experts), replace=False)] = logits.max()
        # descending value, then ascending expert: the kernel's order
        expected = sorted(range(experts), key=lambda e: (-float(logits[e]), e))[:top_k]
        assert route_in_the_interpreter(logits, top_k) == expected, trial


def grouped_choice_in_the_interpreter(choice: np.ndarray, n_group: int, topk_group: int) -> np.ndarray:
    """The grouped sigmoid routing's masking (Sm90MoeRouteSort.sigmoid_choice after the
    sigmoid and the bias) run in the interpreter for one token: each group's two best by
    group_top_two (every lane must agree), topk_group rounds of lane_best over the group scores,
    then zero_unkept; the choice scores back in expert order."""
    experts = choice.shape[0]
    slots = experts // 32
    per_group = slots // n_group
    bits = [[_f32_to_bits(np.float32(choice[lane + 32 * i])) for i in range(slots)] for lane in range(32)]
    group_scores = []
    for g in range(n_group):
        warp = Warp([{2 + j: bits[lane][g * per_group + j] for j in range(per_group)} for lane in range(32)])
        warp.run(ptx.group_top_two_text(per_group))
        results = {(t.registers["$0"], t.registers["$1"]) for t in warp.threads}
        assert len(results) == 1  # every lane holds the group's two best
        (first, second), = results
        group_scores.append(_f32_to_bits(np.float32(_bits_to_f32(first)) + np.float32(_bits_to_f32(second))))
    kept = 0
    for _ in range(topk_group):
        thread = Thread({2: kept, **{3 + g: group_scores[g] for g in range(n_group)}}, {})
        thread.run(ptx.lane_best_text(n_group))
        kept |= 1 << thread.registers["$1"]
    out = np.empty(experts, dtype=np.float32)
    for lane in range(32):
        thread = Thread({slots: kept, **{i: bits[lane][i] for i in range(slots)}}, {})
        thread.run(ptx.zero_unkept_text(slots, per_group))
        for i in range(slots):
            out[lane + 32 * i] = _bits_to_f32(thread.registers[f"${i}"])
    return out


@pytest.mark.parametrize("experts,n_group,topk_group", [(256, 8, 4), (256, 4, 2), (512, 8, 3), (64, 2, 1),
                                                        (128, 1, 1)])
def test_the_grouped_routings_ptx_masks_the_groups_torch_masks(experts, n_group, topk_group):
    """The kernel's group scores (sum of each group's two best, a group's duplicates counted
    twice), its choice of groups and its masking, against nvfp4_group_gemm.routing.route's torch
    ops on the same biased sigmoid scores: the same scores kept, the others 0.0, bit for bit; and
    the k chosen by route from those scores are the k largest of ours."""
    from nvfp4_group_gemm.routing import Routing, route

    rng = np.random.default_rng(experts + n_group)
    for trial in range(4):
        logits = rng.normal(size=experts).astype(np.float32)
        bias = (rng.normal(size=experts) * 0.1).astype(np.float32)
        if trial == 1:  # a group's best value twice: its score counts it twice (torch's topk(2))
            logits[5] = logits[3] = logits.max() + 1
        scores = torch.sigmoid(torch.from_numpy(logits)).numpy()
        choice = (scores + bias).astype(np.float32)
        got = grouped_choice_in_the_interpreter(choice, n_group, topk_group)
        # the torch routing's masking, step by step as routing.route does it
        grouped = torch.from_numpy(choice).view(1, n_group, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores).scatter_(1, best, 1.0)[:, :, None].expand_as(grouped).reshape(1, -1)
        expected = torch.from_numpy(choice).view(1, -1).masked_fill(mask == 0, 0.0).numpy()[0]
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), trial
        routing = Routing("sigmoid", 8, True, n_group=n_group, topk_group=topk_group)
        ids, _ = route(torch.from_numpy(logits)[None], routing, torch.from_numpy(bias))
        assert sorted(ids[0].tolist()) == sorted(np.argsort(-got, kind="stable")[:8].tolist()), trial


def quantize_in_the_interpreter(block: np.ndarray, global_scale: float) -> tuple[bytes, int]:
    from nvfp4_group_gemm import e2m1

    operands = {3 + e: _f32_to_bits(np.float32(block[e])) for e in range(16)}
    operands[19] = _f32_to_bits(np.float32(global_scale))
    thread = Thread(operands, {})
    thread.run(ptx.quantize_block_text(e2m1.TIE_DOWN, e2m1.TIE_UP))
    words = thread.registers["$0"] | (thread.registers["$1"] << 32)
    return words.to_bytes(8, "little"), thread.registers["$2"]


def test_the_quantizers_ptx_is_the_formats_formula_bit_for_bit():
    """quantize_block's text, one 16-element block at a time, against checkpoint.quantize_blocks
    (the torch quantizer MoeFfn's W4A4 layer runs): the packed codes and the e4m3 scale byte,
    on random blocks over six decades and global scales, every midpoint (ties to even), zeros and
    negative zeros, a block whose scale underflows to 0 and one that saturates at 448."""
    from nvfp4_group_gemm import checkpoint

    rng = np.random.default_rng(11)
    blocks, scales = [], []
    for _ in range(60):
        blocks.append((rng.normal(size=16) * 10.0 ** rng.integers(-3, 4)).astype(np.float32))
        scales.append(float(np.float32(10.0 ** rng.uniform(-4, 1))))
    midpoints = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=np.float32)
    blocks.append(np.concatenate([midpoints, -midpoints]))  # amax 6, global 1: scale 1, values = midpoints
    scales.append(1.0)
    blocks.append(np.array([0.0, -0.0] * 8, dtype=np.float32))
    scales.append(0.01)
    blocks.append(np.full(16, 1e-30, dtype=np.float32))  # the block scale rounds to 0: every code 0
    scales.append(1.0)
    blocks.append(np.linspace(-1e6, 1e6, 16, dtype=np.float32))  # the block scale saturates at 448
    scales.append(1e-3)
    for block, scale in zip(blocks, scales):
        codes, block_scale = checkpoint.quantize_blocks(torch.from_numpy(block)[None], torch.tensor(scale))
        got_codes, got_scale = quantize_in_the_interpreter(block, scale)
        assert got_codes == bytes(codes[0].tolist()), (block, scale)
        assert got_scale == int(block_scale.view(torch.uint8)[0, 0]), (block, scale)


def test_the_first_use_check_takes_any_order_within_an_expert_and_nothing_else():
    """pairs._sorted_alike (the sort kernels' first-use check): a sort whose pairs of one expert
    come in another order agrees with the stable sort; one pair in the wrong expert's range, or
    a token that is not the pair's, does not."""
    generator = torch.Generator().manual_seed(4)
    experts = torch.randint(0, 9, (64,), generator=generator)  # 8 local experts and E
    expected = pairs.sort_pairs_torch(experts, 8, 4)
    order = expected[0].clone()
    offsets = torch.cat([expected[2].long(), torch.tensor([64])])
    for e in range(9):  # each expert's pairs reversed
        order[offsets[e]:offsets[e + 1]] = order[offsets[e]:offsets[e + 1]].flip(0)
    assert pairs._sorted_alike(experts, (order, order // 4, expected[2]), expected, 4)
    swapped = order.clone()
    first, last = int(offsets[0]), int(offsets[8])  # a pair of expert 0 and one of E change places
    swapped[[first, last]] = swapped[[last, first]]
    assert not pairs._sorted_alike(experts, (swapped, swapped // 4, expected[2]), expected, 4)
    assert not pairs._sorted_alike(experts, (order, order // 2, expected[2]), expected, 4)
