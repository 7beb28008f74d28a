"""The MoE layer (nvfp4_group_gemm.moe_layer) on the H200: the entry's kernels against the same
layer on the CPU (the exact decode), eager and as one CUDA graph replayed for new routings."""

import pytest
import torch
from test_moe_layer import HIDDEN, make_layer

from nvfp4_group_gemm import moe_layer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs an sm_90 (Hopper) GPU")

TOKENS = 64


def to_cuda(layer: moe_layer.MoeFfn, tensors, router) -> moe_layer.MoeFfn:
    return moe_layer.MoeFfn({name: value.cuda() for name, value in tensors.items()}, "layer.", router.cuda(),
                            layer.top_k, layer.activations)


def close(got, want):
    """Within 1 % of the CPU layer's norm: each GEMM's output is within one bf16 unit of the exact
    one, and such a unit can move an activation of the down GEMM across an e2m1 rounding
    boundary (one quantization step of that element)."""
    return float((got.float().cpu() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"], ids=["w4a16", "w4a4"])
@pytest.mark.parametrize("split", [False, True], ids=["one_w13_scale", "gate_and_up_scales"])
def test_the_layer_on_the_gpu_matches_the_exact_layer_and_replays_as_one_graph(split, activations):
    tensors, cpu_layer, router = make_layer(split, activations=activations)
    layer = to_cuda(cpu_layer, tensors, router)
    inputs = [torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
              for seed in range(4)]
    for x in inputs[:2]:
        assert close(layer(x.cuda()), cpu_layer(x)) <= 1e-2
    static_x = inputs[0].cuda()
    layer(static_x)  # eager first: compiles, plans, binds
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    for x in inputs[1:]:  # new activations, so a new routing, in the same tensor
        static_x.copy_(x.cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert close(static_out, cpu_layer(x)) <= 1e-2
