"""The MoE layer's pair kernels (hopper/layer.py through nvfp4_group_gemm.pairs) on the GPU:
against the torch ops on random routings (experts of other GPUs, ids out of range, pair counts
past one CTA's threads), rows of other GPUs' pairs full of NaN (never read), the shared expert
and both output dtypes; replayed in a CUDA graph for new routings; the layer with them against
the layer without."""

import pytest
import torch

from nvfp4_group_gemm import core, pairs
from nvfp4_group_gemm.routing import Routing

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs an sm_90 or later GPU")


def check_sort(experts: torch.Tensor, num_experts: int, top_k: int) -> None:
    order, a_rows, offsets = pairs.sort_pairs(experts, num_experts, top_k)
    binned = torch.where((experts >= 0) & (experts < num_experts), experts, num_experts)
    expected_order, _, expected_offsets = pairs.sort_pairs_torch(binned, num_experts, top_k)
    assert torch.equal(offsets, expected_offsets)
    assert torch.equal(order.sort().values, torch.arange(experts.shape[0], device=experts.device))
    # place by place the same experts as the stable sort's: each pair within its expert's range
    assert torch.equal(binned[order], binned[expected_order])
    assert torch.equal(a_rows, order // top_k)


@pytest.mark.parametrize("pairs_count,num_experts,top_k",
                         [(1, 1, 1), (8, 128, 8), (128, 128, 8), (1000, 8, 2), (32768, 128, 8), (70001, 512, 7)])
def test_the_sort_kernel_groups_pairs_as_the_torch_ops(pairs_count, num_experts, top_k):
    generator = torch.Generator(device="cuda").manual_seed(pairs_count)
    # E and beyond, and negative ids: experts of other GPUs, sorted last
    experts = torch.randint(-2, num_experts + 3, (pairs_count,), device="cuda", generator=generator)
    check_sort(experts, num_experts, top_k)
    assert ("pairs", experts.device.index, "sort", num_experts) not in core.DEMOTED


def test_the_sort_kernel_takes_every_pair_to_one_expert():
    check_sort(torch.full((4096,), 3, device="cuda"), 8, 8)
    check_sort(torch.full((4096,), 8, device="cuda"), 8, 8)  # every pair another GPU's


def reference_combine(rows, weights, experts, num_experts, shared):
    tokens, top_k = weights.shape
    terms = rows.double().view(tokens, top_k, -1) * weights.double()[..., None]
    if experts is not None:
        terms = torch.where((experts < num_experts).view(tokens, top_k, 1), terms, 0.0)
    out = terms.sum(dim=1)
    return out if shared is None else out + shared.double()


@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 8, 2048), (3, 2, 4096), (16, 8, 7168), (257, 6, 8),
                                                 (4096, 8, 2048)])
@pytest.mark.parametrize("masked", [False, True], ids=["all_local", "masked"])
@pytest.mark.parametrize("with_shared,out_dtype", [(False, torch.bfloat16), (True, torch.float32),
                                                   (True, torch.bfloat16)], ids=["bf16", "shared_fp32", "shared_bf16"])
def test_the_combine_kernel_is_the_weighted_sum(tokens, top_k, hidden, masked, with_shared, out_dtype):
    generator = torch.Generator(device="cuda").manual_seed(tokens * hidden + top_k)
    num_experts = 16
    rows = torch.randn(tokens * top_k, hidden, device="cuda", generator=generator).bfloat16()
    weights = torch.rand(tokens, top_k, device="cuda", generator=generator)
    experts = (torch.randint(0, num_experts + 1, (tokens * top_k,), device="cuda", generator=generator)
               if masked else None)
    if masked:  # another GPU's rows hold anything: never read, never summed
        rows[experts == num_experts] = float("nan")
    shared = torch.randn(tokens, hidden, device="cuda", generator=generator).bfloat16() if with_shared else None
    out = pairs.combine_pairs(rows, weights, experts, num_experts, shared, out_dtype)
    torch_ops = pairs.combine_pairs_torch(rows, weights, experts, num_experts, shared, out_dtype)
    expected = reference_combine(rows, weights, experts, num_experts, shared)
    assert out.dtype == out_dtype and not out.isnan().any()
    # an fp32 sum of k + 1 rounded terms, in any order, lies within (k + 2) units of 2^-24 of the
    # sum of the terms' magnitudes of the exact sum (not of the sum itself: terms cancel); then
    # bf16's one rounding, within half a unit (2^-8 of the value); the torch ops' sum (another
    # order) within twice both
    magnitude = reference_combine(rows.abs(), weights.abs(), experts, num_experts,
                                  None if shared is None else shared.abs())
    sums = (top_k + 2) * 2**-24 * magnitude
    rounding = 2**-8 * (expected.abs() + sums) if out_dtype == torch.bfloat16 else 0.0
    assert ((out.double() - expected).abs() <= sums + rounding).all()
    assert ((out.double() - torch_ops.double()).abs() <= 2 * (sums + rounding)).all()
    assert not any(key[0] == "pairs" for key in core.DEMOTED)


def test_both_kernels_replay_in_a_cuda_graph_for_new_routings():
    tokens, top_k, hidden, num_experts = 64, 8, 1024, 32
    experts = torch.randint(0, num_experts, (tokens * top_k,), device="cuda")
    rows = torch.randn(tokens * top_k, hidden, device="cuda").bfloat16()
    weights = torch.rand(tokens, top_k, device="cuda")
    pairs.sort_pairs(experts, num_experts, top_k)  # first eager uses: compile and check
    pairs.combine_pairs(rows, weights)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        order, a_rows, offsets = pairs.sort_pairs(experts, num_experts, top_k)
        permuted = rows[order]  # stands for the GEMMs: depends on the sort
        unsorted = torch.empty_like(permuted)
        unsorted[order] = permuted
        out = pairs.combine_pairs(unsorted, weights)
    for seed in range(3):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        experts.copy_(torch.randint(0, num_experts, (tokens * top_k,), device="cuda", generator=generator))
        rows.copy_(torch.randn(tokens * top_k, hidden, device="cuda", generator=generator).bfloat16())
        weights.copy_(torch.rand(tokens, top_k, device="cuda", generator=generator))
        graph.replay()
        torch.cuda.synchronize()
        _, _, expected_offsets = pairs.sort_pairs_torch(experts, num_experts, top_k)
        assert torch.equal(offsets, expected_offsets), seed
        assert torch.equal(experts[order].sort().values, experts.sort().values) and torch.equal(a_rows, order // top_k)
        expected = reference_combine(rows, weights, None, num_experts, None)
        assert ((out.double() - expected).abs() <= 2**-7 * expected.abs() + 1e-6).all(), seed


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"], ids=["w4a16", "w4a4"])
def test_the_layer_with_pair_kernels_is_the_layer_without(activations):
    """MoeFfn on the GPU with its pair kernels and with the torch ops: each GEMM row the same
    bits (the order within an expert does not change a row), the weighted sums within one bf16
    unit."""
    from test_gpu_moe_layer import to_cuda
    from test_moe_layer import HIDDEN, make_layer

    tensors, cpu_layer, router = make_layer(activations=activations)
    layer = to_cuda(cpu_layer, tensors, router)
    x = torch.randn(48, HIDDEN, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4)).bfloat16()
    with_kernels = layer(x)
    layer.pair_kernels = False
    without = layer(x)
    assert ((with_kernels.double() - without.double()).abs() <= 2**-7 * without.double().abs() + 1e-6).all()


@pytest.mark.parametrize("tokens", [1, 48])
def test_the_layer_with_fragment_weights_is_the_plain_layer_bit_for_bit(tokens):
    """MoeFfn(weight_layout="fragment") on the GPU: the W4A16 GEMMs read the weights packed for
    the fragment, and the layer's output is the plain layout's bit for bit (the same bf16 weights
    decoded, the same sums); nothing demoted."""
    from test_moe_layer import HIDDEN, TOP_K, make_layer

    from nvfp4_group_gemm import moe_layer

    tensors, _, router = make_layer(activations="bf16")
    cuda_tensors = {name: value.cuda() for name, value in tensors.items()}
    plain = moe_layer.MoeFfn(cuda_tensors, "layer.", router.cuda(), TOP_K, "bf16")
    fragment = moe_layer.MoeFfn(cuda_tensors, "layer.", router.cuda(), TOP_K, "bf16", weight_layout="fragment")
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9)).bfloat16()
    assert torch.equal(fragment(x), plain(x))
    assert not core.demotions(), core.demotions()


@pytest.mark.parametrize("tokens,router_experts,top_k", [(1, 128, 8), (16, 128, 8), (256, 128, 8), (5, 8, 2),
                                                         (64, 512, 8), (3, 1024, 4)])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax_all"])
@pytest.mark.parametrize("shard", [None, (32, 64)], ids=["all_local", "shard"])
def test_the_routing_kernel_chooses_and_weighs_as_torch(tokens, router_experts, top_k, renormalize, shard):
    """route_and_sort against nvfp4_group_gemm.routing's softmax choice and the torch sort: the
    same k experts per token, the same weights within a few fp32 units, the pairs sorted by
    local expert (a shard's experts first_local .. + E; the others past offsets[E])."""
    if shard is not None and shard[0] + shard[1] > router_experts:
        pytest.skip("the shard lies past the router's experts")
    first_local, num_experts = shard or (0, router_experts)
    generator = torch.Generator(device="cuda").manual_seed(tokens + router_experts)
    logits = torch.randn(tokens, router_experts, device="cuda", generator=generator) * 3
    routing = Routing("softmax", top_k, renormalize)
    ids, weights, experts, order, a_rows, offsets = pairs.route_and_sort(logits, routing, first_local, num_experts)
    e_ids, e_weights, e_experts, _, _, e_offsets = pairs.route_and_sort_torch(logits, routing, first_local,
                                                                              num_experts)
    chosen, expected = torch.sort(ids, dim=1), torch.sort(e_ids, dim=1)
    assert torch.equal(chosen.values, expected.values)
    assert torch.allclose(weights.gather(1, chosen.indices), e_weights.gather(1, expected.indices), rtol=1e-5,
                          atol=1e-7)
    # descending logits within each token
    picked = logits.gather(1, ids)
    assert bool((picked[:, 1:] <= picked[:, :-1]).all())
    assert torch.equal(experts.view(tokens, top_k).sort(dim=1).values,
                       e_experts.view(tokens, top_k).sort(dim=1).values)
    assert torch.equal(offsets, e_offsets)
    assert bool((experts[order][1:] >= experts[order][:-1]).all()) and torch.equal(a_rows, order // top_k)
    assert torch.equal(order.sort().values, torch.arange(tokens * top_k, device="cuda"))
    assert not any(key[0] == "pairs" for key in core.DEMOTED)


def test_the_routing_kernel_replays_in_a_cuda_graph():
    tokens, router_experts, top_k = 8, 128, 8
    logits = torch.randn(tokens, router_experts, device="cuda")
    routing = Routing("softmax", top_k, True)
    pairs.route_and_sort(logits, routing, 0, router_experts)  # compile and check
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights, _, order, _, offsets = pairs.route_and_sort(logits, routing, 0, router_experts)
    for seed in range(3):
        logits.copy_(torch.randn(tokens, router_experts, device="cuda",
                                 generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        e_ids, e_weights, _, _, _, e_offsets = pairs.route_and_sort_torch(logits, routing, 0, router_experts)
        chosen, expected = torch.sort(ids, dim=1), torch.sort(e_ids, dim=1)
        assert torch.equal(chosen.values, expected.values), seed
        assert torch.allclose(weights.gather(1, chosen.indices), e_weights.gather(1, expected.indices), rtol=1e-5)
        assert torch.equal(offsets, e_offsets) and torch.equal(order.sort().values, torch.arange(tokens * top_k,
                                                                                                 device="cuda"))


@pytest.mark.parametrize("tokens", [1, 16, 256])
@pytest.mark.parametrize("router_experts,n_group,topk_group,top_k,bias,renormalize,scaling", [
    (256, 8, 4, 8, True, True, 2.5),  # DeepSeek-V3
    (64, 1, 1, 6, True, True, 1.0),  # one group: no masking
    (150, 1, 1, 6, False, False, 16.0),  # no bias, no renormalization, E_r not a multiple of 32
    (512, 4, 2, 8, True, True, 1.0),  # groups of 128: four slots each
])
@pytest.mark.parametrize("shard", [None, (32, 32)], ids=["all_local", "shard"])
def test_the_grouped_sigmoid_routing_kernel_chooses_and_weighs_as_torch(tokens, router_experts, n_group, topk_group,
                                                                        top_k, bias, renormalize, scaling, shard):
    """route_and_sort with a sigmoid router against nvfp4_group_gemm.routing.route: the same k
    experts per token (its sigmoid is torch's formula, its group scores and masking torch's), the
    weights within a few fp32 units (another sum order), the pairs sorted by local expert; in
    descending order of the biased score the choice reads."""
    first_local, num_experts = shard or (0, router_experts)
    generator = torch.Generator(device="cuda").manual_seed(tokens + router_experts)
    logits = torch.randn(tokens, router_experts, device="cuda", generator=generator) * 2
    correction = (torch.randn(router_experts, device="cuda", generator=generator) * 0.05) if bias else None
    routing = Routing("sigmoid", top_k, renormalize, n_group=n_group, topk_group=topk_group,
                      routed_scaling_factor=scaling)
    x = torch.empty(tokens, 8, device="cuda")
    assert pairs.route_and_sort_usable(x, routing, router_experts)
    ids, weights, experts, order, a_rows, offsets = pairs.route_and_sort(logits, routing, first_local, num_experts,
                                                                         correction)
    e_ids, e_weights, e_experts, _, _, e_offsets = pairs.route_and_sort_torch(logits, routing, first_local,
                                                                              num_experts, correction)
    chosen, expected = torch.sort(ids, dim=1), torch.sort(e_ids, dim=1)
    assert torch.equal(chosen.values, expected.values)
    assert torch.allclose(weights.gather(1, chosen.indices), e_weights.gather(1, expected.indices), rtol=1e-5,
                          atol=1e-7)
    biased = torch.sigmoid(logits) + (0 if correction is None else correction)
    picked = biased.gather(1, ids)
    assert bool((picked[:, 1:] <= picked[:, :-1]).all())
    assert torch.equal(offsets, e_offsets)
    assert torch.equal(experts.view(tokens, top_k).sort(dim=1).values,
                       e_experts.view(tokens, top_k).sort(dim=1).values)
    assert bool((experts[order][1:] >= experts[order][:-1]).all()) and torch.equal(a_rows, order // top_k)
    assert not any(key[0] == "pairs" for key in core.DEMOTED)


def test_the_routing_kernel_refuses_groups_that_are_not_whole_slots():
    """DeepSeek-V2's 160 experts in 8 groups (20 each) route by torch ops: the kernel's groups
    are whole slots of 32."""
    x = torch.empty(4, 8, device="cuda")
    assert not pairs.route_and_sort_usable(x, Routing("sigmoid", 6, True, n_group=8, topk_group=3), 160)
    assert pairs.route_and_sort_usable(x, Routing("sigmoid", 8, True, n_group=8, topk_group=4), 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered"])
@pytest.mark.parametrize("count,k", [(1, 2048), (48, 768), (4096, 2048)])
def test_the_quantize_kernel_is_the_torch_quantizer_bit_for_bit(dtype, gather, count, k):
    """pairs.quantize_rows against checkpoint.quantize_blocks (pairs.quantize_rows_torch): the
    same codes and scale bytes, rows read through a map or in place, a global scale on the device;
    rows of zeros, of huge and of tiny values included."""
    generator = torch.Generator(device="cuda").manual_seed(count + k)
    source = (torch.randn(max(count, 8), k, device="cuda", generator=generator) * 3).to(dtype)
    source[0] = 0.0
    source[1 % source.shape[0]] = 1e30  # the block scale saturates at 448
    source[2 % source.shape[0]] *= 1e-20
    rows = torch.randint(0, source.shape[0], (count,), device="cuda", generator=generator) if gather else None
    x = source if gather else source[:count]
    scale = torch.tensor(5.0 / (6 * 448), device="cuda")
    a, sfa = pairs.quantize_rows(x, scale, rows)
    expected_a, expected_sfa = pairs.quantize_rows_torch(x, scale, rows)
    assert a.dtype == torch.float4_e2m1fn_x2 and sfa.dtype == torch.float8_e4m3fn
    assert torch.equal(a.view(torch.uint8), expected_a.view(torch.uint8))
    assert torch.equal(sfa.view(torch.uint8), expected_sfa.view(torch.uint8))
    assert not any(key[0] == "pairs" for key in core.DEMOTED)


def test_the_quantize_kernel_replays_in_a_cuda_graph():
    x = torch.randn(64, 1024, device="cuda").bfloat16()
    rows = torch.randint(0, 64, (128,), device="cuda")
    scale = torch.tensor(0.01, device="cuda")
    pairs.quantize_rows(x, scale, rows)  # compile and check
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, sfa = pairs.quantize_rows(x, scale, rows)
    for seed in range(3):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(64, 1024, device="cuda", generator=generator))
        rows.copy_(torch.randint(0, 64, (128,), device="cuda", generator=generator))
        scale.fill_(0.01 * (seed + 1))
        graph.replay()
        torch.cuda.synchronize()
        expected_a, expected_sfa = pairs.quantize_rows_torch(x, scale, rows)
        assert torch.equal(a.view(torch.uint8), expected_a.view(torch.uint8)), seed
        assert torch.equal(sfa.view(torch.uint8), expected_sfa.view(torch.uint8)), seed
