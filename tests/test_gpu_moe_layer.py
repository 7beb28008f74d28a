"""The MoE layer (nvfp4_group_gemm.moe_layer) on the H200: the entry's kernels against the same
layer on the CPU (the exact decode), eager and as one CUDA graph replayed for new routings; the
real ModelOpt exports (tests/test_export.py's) through MoeFfn.from_pretrained on the GPU."""

import pytest
import torch
from test_export import (
    CHECKPOINTS,
    EXPORTS,
    INPUTS,
    W4A16_BOUND,
    block_outputs,
    needs_checkpoints,
    relative_error,
)
from test_moe_layer import HIDDEN, make_layer

from nvfp4_group_gemm import moe, moe_layer

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


def entry_refuses_k(k: int) -> str | None:
    """The entry's own rule for K (check_moe_inputs, on CPU tensors: devices are checked last):
    its message where it refuses K, else None."""
    try:
        moe.check_moe_inputs(torch.zeros(1, k, dtype=torch.bfloat16), None,
                             torch.zeros(1, 128, k // 2, dtype=torch.uint8),
                             torch.zeros(1, 128, k // 16, dtype=torch.uint8), torch.zeros(2, dtype=torch.int32))
    except ValueError as error:
        if "K" in str(error).split(":")[1]:
            return str(error)
    return None


@pytest.mark.parametrize("intermediate", [128, 256], ids=["down_k128", "down_k256"])
@pytest.mark.parametrize("activations", ["bf16", "nvfp4"], ids=["w4a16", "w4a4"])
@pytest.mark.parametrize("split", [False, True], ids=["one_w13_scale", "gate_and_up_scales"])
def test_the_layer_on_the_gpu_matches_the_exact_layer_and_replays_as_one_graph(split, activations, intermediate):
    """The down GEMM's K is the intermediate size: 128 needs the entry's K % 64 support."""
    tensors, cpu_layer, router = make_layer(split, activations=activations, intermediate=intermediate)
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


@needs_checkpoints
@pytest.mark.parametrize("name", list(EXPORTS))
def test_every_export_runs_w4a16_on_the_gpu_within_one_percent(name):
    """from_pretrained(path, layer, device="cuda"): every MoE layer and input of the export
    within 1 % of transformers' float64 block (bf16 roundings: 0.3-0.5 %)."""
    outputs = block_outputs(name)
    for layer in EXPORTS[name][1]:
        ffn = moe_layer.MoeFfn.from_pretrained(CHECKPOINTS / name, layer, device="cuda")
        refused = entry_refuses_k(ffn.intermediate)
        if refused:
            pytest.skip(f"{name}: the down GEMM's K = {ffn.intermediate}: {refused}")
        assert ffn.w13.b.is_cuda and ffn.router_weight.is_cuda
        for i in range(INPUTS):
            y = ffn(outputs[f"layer{layer}.x{i}"].cuda())
            error = relative_error(y.cpu(), outputs[f"layer{layer}.y{i}"])
            assert error < W4A16_BOUND, (name, layer, i, error)


@needs_checkpoints
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("activations", ["bf16", "nvfp4"], ids=["w4a16", "w4a4"])
def test_an_export_layer_captured_once_replays_equal_to_eager(name, activations):
    """One CUDA graph of the whole layer (routing, DeepSeek-V3's grouped sigmoid and shared
    expert included) captured once and replayed over new inputs in the same tensor: each
    replay's output is the eager call's on that input, bit for bit (no host read anywhere)."""
    layer = EXPORTS[name][1][-1]
    ffn = moe_layer.MoeFfn.from_pretrained(CHECKPOINTS / name, layer, device="cuda", activations=activations)
    generator = torch.Generator().manual_seed(21)
    inputs = [torch.randn(TOKENS, ffn.hidden, generator=generator).to(torch.bfloat16).cuda() for _ in range(4)]
    static_x = inputs[0].clone()
    ffn(static_x)  # eager first: compiles, plans, binds
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ffn(static_x)
    for x in inputs[1:]:
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        eager = ffn(x)
        assert torch.equal(static_out, eager)
    # and routed by the caller: the same graph-safe entry, the same result
    topk_ids, topk_weights = ffn.route(inputs[1])
    routed = ffn.experts_output(inputs[1], topk_ids, topk_weights, out_dtype=torch.float32)
    if ffn.shared is not None:
        routed = routed + ffn.shared_expert(inputs[1]).float()
    assert torch.equal(routed.to(torch.bfloat16), ffn(inputs[1]))


@pytest.mark.parametrize("intermediate", [128, 768], ids=["i128", "i768"])
def test_the_fused_swiglu_layer_matches_the_exact_layer_and_replays(intermediate):
    """MoeFfn's swiglu_epilogue (W4A16's default): SwiGLU in the gate-and-up GEMM's epilogue, within 1 % of the
    CPU layer (the exact decode) and of the unfused GPU layer, eager and as one CUDA graph
    replayed for new routings."""
    tensors, cpu_layer, router = make_layer(True, activations="bf16", intermediate=intermediate)
    unfused = moe_layer.MoeFfn({name: value.cuda() for name, value in tensors.items()}, "layer.", router.cuda(),
                               cpu_layer.top_k, "bf16", swiglu_epilogue=False)
    fused = to_cuda(cpu_layer, tensors, router)
    assert fused.swiglu_epilogue and not unfused.swiglu_epilogue
    inputs = [torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
              for seed in range(4)]
    for x in inputs[:2]:
        y = fused(x.cuda())
        assert close(y, cpu_layer(x)) <= 1e-2 and close(y, unfused(x.cuda()).cpu()) <= 1e-2
    static_x = inputs[0].cuda()
    fused(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused(static_x)
    for x in inputs[1:]:
        static_x.copy_(x.cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert close(static_out, cpu_layer(x)) <= 1e-2
