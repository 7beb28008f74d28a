"""The MoE layer on the entry (nvfp4_group_gemm.moe_layer) from ModelOpt-format tensors: on CPU
tensors (the op's exact decode) against an independent float64 layer written token by token;
on the H200 (tests/test_gpu_moe_layer.py) through the kernels and one CUDA graph."""

from pathlib import Path

import pytest
import torch
from test_checkpoint import layer_tensors

from nvfp4_group_gemm import checkpoint, core, moe_layer, pairs

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 4, 256, 128, 2


def make_layer(split_w13_scales=False, seed=5, activations="nvfp4", intermediate=INTERMEDIATE, swiglu_epilogue=True):
    tensors = layer_tensors(EXPERTS, HIDDEN, intermediate, split_w13_scales)
    # calibrated input scales that differ by expert: the layer quantizes with their largest
    tensors["layer.w13_input_scale"] = torch.tensor([2.0, 3.0, 2.5, 1.0]) / (6 * 448)
    tensors["layer.w2_input_scale"] = torch.tensor([0.5, 0.4, 0.6, 0.5]) / (6 * 448)
    router = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return tensors, moe_layer.MoeFfn(tensors, "layer.", router, TOP_K, activations,
                                     swiglu_epilogue=swiglu_epilogue), router


def dequantized(tensors, name):
    return checkpoint.dequantize_nvfp4(checkpoint.Nvfp4Tensor(
        tensors[f"layer.{name}_weight"], tensors[f"layer.{name}_weight_scale"],
        tensors[f"layer.{name}_weight_scale_2"])).double()


def reference_layer(tensors, router, x, scale13, scale2):
    """The same layer in float64, one token and one expert at a time, from the dequantized
    weights: the activations quantized the same way (their dequantized values multiply; scale
    None: W4A16, the bf16 rows themselves, SwiGLU's output rounded to bf16 as the layer does),
    each GEMM's float64 result rounded to bf16 where the entry rounds its output."""
    w13, w2 = dequantized(tensors, "w13"), dequantized(tensors, "w2")
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    probabilities = torch.softmax(x.float() @ router.float().T, dim=-1)
    for t in range(x.shape[0]):
        weights, experts = torch.topk(probabilities[t], TOP_K)
        weights = weights / weights.sum()
        for weight, e in zip(weights.tolist(), experts.tolist()):
            if scale13 is None:
                a_values = x[t:t + 1].double()
            else:
                a, sfa = moe_layer.quantize_activations(x[t:t + 1], scale13)
                a_values = core.decode_fp4(a.view(torch.uint8), sfa).double() * float(scale13)
            gate_up = (a_values @ w13[e].T).to(torch.bfloat16).float()
            hidden = torch.nn.functional.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]
            if scale2 is None:
                h_values = hidden.to(torch.bfloat16).double()
            else:
                h, sfh = moe_layer.quantize_activations(hidden, scale2)
                h_values = core.decode_fp4(h.view(torch.uint8), sfh).double() * float(scale2)
            down = (h_values @ w2[e].T).to(torch.bfloat16).double()
            out[t] += float(weight) * down[0].float().double()
    return out


def test_activation_quantization_follows_the_formula():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    scale = torch.tensor(0.01)
    a, sfa = moe_layer.quantize_activations(x, scale)
    assert a.dtype == torch.float4_e2m1fn_x2 and a.shape == (8, 32) and sfa.shape == (8, 4)
    blocks = x.reshape(8, 4, 16)
    expected_scale = (blocks.abs().amax(-1) / 6 / 0.01).to(torch.float8_e4m3fn)
    assert torch.equal(sfa.view(torch.uint8), expected_scale.view(torch.uint8))
    decoded = core.decode_fp4(a.view(torch.uint8), sfa).reshape(8, 4, 16) * 0.01
    # within half an e2m1 step of the block (the largest step, 2 at magnitude 4..6, of its scale)
    assert bool(((decoded - blocks).abs() <= sfa.float()[..., None] * 0.01 * 1.0 + 1e-7).all())


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"], ids=["w4a16", "w4a4"])
@pytest.mark.parametrize("split", [False, True], ids=["one_w13_scale", "gate_and_up_scales"])
def test_the_layer_on_cpu_is_the_float64_layer_to_bf16_roundings(split, activations, capsys):
    """Routing, permutation with offsets computed by torch ops, both grouped GEMMs (the op's
    exact decode on a CPU), SwiGLU and the weighted un-permute, against the float64 layer
    computed token by token. Both round each GEMM's result to bf16 at the same place and quantize
    the same values, so the GEMM outputs are equal; what differs is the last step, the k
    weighted rows summed in fp32 and rounded to bf16 by the layer, in float64 by the reference:
    every output within one bf16 unit of the float64 result, at most 0.1 % of them not its
    rounding. The quantization error against the bf16 layer of the unquantized weights is
    printed, not asserted. W4A16 (bf16 activations): the same, SwiGLU's output rounded to bf16
    by both."""
    tensors, layer, router = make_layer(split, activations=activations)
    x = (torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (24, HIDDEN)
    expected = reference_layer(tensors, router, x, layer.scale13, layer.scale2)
    unit = expected.abs().float() * 2.0**-7  # one bf16 unit in the last place, at most
    assert bool(((out.float() - expected.float()).abs() <= unit).all())
    assert int((out != expected.to(torch.bfloat16)).sum()) <= out.numel() // 1000
    # the layer's alphas: each expert's weight_scale_2, times the largest input scale in W4A4
    weight_scale_2 = layer.w13.weight_scale_2.reshape(layer.alpha13.shape)
    if activations == "bf16":
        assert layer.scale13 is None and torch.equal(layer.alpha13, weight_scale_2.float())
    else:
        assert torch.allclose(layer.alpha13, layer.scale13 * weight_scale_2)
    # quantization error against the bf16 layer of the unquantized weights (printed, not asserted)
    generator = torch.Generator().manual_seed(3)
    w13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.02
    exact = torch.zeros(24, HIDDEN)
    probabilities = torch.softmax(x.float() @ router.T, dim=-1)
    weights, experts = torch.topk(probabilities, TOP_K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    for t in range(24):
        for j in range(TOP_K):
            e = int(experts[t, j])
            gu = x[t].float() @ w13[e].T
            exact[t] += weights[t, j] * (torch.nn.functional.silu(gu[:INTERMEDIATE]) * gu[INTERMEDIATE:]) @ w2[e].T
    error = (out.float() - exact).norm() / exact.norm()
    with capsys.disabled():
        what = "NVFP4 weights, bf16 activations (W4A16)" if activations == "bf16" else "NVFP4 weights and activations"
        print(f"\n  MoE layer, {what}, against bf16: relative error {error:.3f}")


def test_routing_and_offsets_need_no_host_read():
    _, layer, _ = make_layer()
    experts = torch.tensor([3, 1, 1, 0, 3, 3, 2, 1])
    order, token_rows, offsets = layer.sort_by_expert(experts, 2)
    assert offsets.tolist() == [0, 1, 4, 5, 8] and offsets.dtype == torch.int32
    assert experts[order].tolist() == [0, 1, 1, 1, 2, 3, 3, 3]
    assert order.tolist()[1:4] == [1, 2, 7]  # stable on a CPU: pairs of one expert in token order
    assert token_rows.tolist() == [p // 2 for p in order.tolist()]


def test_the_layer_names_its_activation_modes():
    tensors = layer_tensors(EXPERTS, HIDDEN, INTERMEDIATE, False)
    with pytest.raises(ValueError, match=r"activations = 'fp8': must be one of \('bf16', 'nvfp4'\)"):
        moe_layer.MoeFfn(tensors, "layer.", torch.randn(EXPERTS, HIDDEN), TOP_K, "fp8")
    assert moe_layer.MoeFfn(tensors, "layer.", torch.randn(EXPERTS, HIDDEN), TOP_K).activations == "bf16"


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"], ids=["w4a16", "w4a4"])
def test_expert_parallel_shards_sum_to_the_whole_layer(activations):
    """Two GPUs' worth of experts (0-1 and 2-3): each shard's layer routes over all four experts
    and computes its own experts' pairs only; the two outputs summed (the all-reduce) are the
    whole layer's, up to each shard's rounding to bf16 (one unit of each part)."""
    tensors, whole, router = make_layer(activations=activations)
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    parts = []
    for first in (0, 2):
        shard = {name: value[first:first + 2] if value.dim() and value.shape[0] == EXPERTS else value
                 for name, value in tensors.items()}
        layer = moe_layer.MoeFfn(shard, "layer.", router, TOP_K, activations, first_local=first)
        # the shard's input scales are its experts' (W4A4): the whole layer's largest for comparability
        layer.scale13, layer.alpha13 = whole.scale13, whole.alpha13[first:first + 2]
        layer.scale2, layer.alpha2 = whole.scale2, whole.alpha2[first:first + 2]
        parts.append(layer(x).float())
    out = whole(x).float()
    unit = (parts[0].abs() + parts[1].abs() + out.abs()) * 2.0**-7
    assert bool(((parts[0] + parts[1] - out).abs() <= unit).all())
    with pytest.raises(ValueError, match=r"first_local = 3: the 2 local experts must lie within the router's 4"):
        moe_layer.MoeFfn(shard, "layer.", router, TOP_K, activations, first_local=3)


def test_a_checkpoint_without_input_scales_runs_w4a16_only():
    tensors = {name: value for name, value in layer_tensors(EXPERTS, HIDDEN, INTERMEDIATE, True).items()
               if "input_scale" not in name}
    router = torch.randn(EXPERTS, HIDDEN)
    layer = moe_layer.MoeFfn(tensors, "layer.", router, TOP_K)
    assert layer.scale13 is None and layer.alpha13.shape == (EXPERTS, 2) and layer.w13.alpha is None
    x = torch.randn(8, HIDDEN).to(torch.bfloat16)
    assert torch.isfinite(layer(x).float()).all()
    with pytest.raises(ValueError, match=r"needs each projection's <p>_input_scale .* use activations = 'bf16'"):
        moe_layer.MoeFfn(tensors, "layer.", router, TOP_K, "nvfp4")


def _experts_output_step_by_step(layer, x, topk_ids, topk_weights):
    """experts_output as the layer computed it before its kernels were counted: every id mapped
    and masked, counts scattered and summed, gate and up cast to fp32 apart, a zero status."""
    tokens, top_k = topk_ids.shape
    local = topk_ids.reshape(-1).long() - layer.first_local
    experts = torch.where((local >= 0) & (local < layer.experts), local, layer.experts)
    order = torch.argsort(experts, stable=True)
    counts = torch.zeros(layer.experts + 1, dtype=torch.int64).scatter_add_(0, experts, torch.ones_like(experts))
    offsets = torch.zeros(layer.experts + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts[:layer.experts], 0)
    status = torch.zeros(1, dtype=torch.int32)
    rows = x[order // top_k]
    if layer.swiglu_epilogue:  # SwiGLU in the GEMM (test_the_swiglu_epilogue_layer_is_the_unfused_layer_...)
        hidden = layer.gemm(rows, layer.w13, layer.scale13, layer.alpha13, offsets, status)
    else:
        gate_up = layer.gemm(rows, layer.w13, layer.scale13, layer.alpha13, offsets, status)
        gate, up = gate_up[:, :layer.intermediate].float(), gate_up[:, layer.intermediate:].float()
        hidden = torch.nn.functional.silu(gate) * up
        if layer.scale2 is None:
            hidden = hidden.to(torch.bfloat16)
    down = layer.gemm(hidden, layer.w2, layer.scale2, layer.alpha2, offsets, status)
    unsorted = torch.empty_like(down)
    unsorted[order] = down
    unsorted = torch.where((experts < layer.experts)[:, None], unsorted.float(), 0.0)
    return (unsorted.view(tokens, top_k, layer.hidden) * topk_weights.float()[..., None]).sum(dim=1)


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"], ids=["w4a16", "w4a4"])
@pytest.mark.parametrize("first_local", [None, 0, 2], ids=["all_local", "shard0", "shard1"])
def test_fewer_kernels_compute_the_same_bits(activations, first_local):
    """experts_output with its kernels cut (no id mapping or masking where every expert is local,
    a sort and one search for the offsets, up promoted inside SwiGLU's product, the entry's own
    status word) gives the same bits as the step-by-step form, on random routings, whole and
    sharded (expert parallelism: pairs of the other shard's experts)."""
    tensors, layer, router = make_layer(activations=activations)
    if first_local is not None:
        shard = {name: value[first_local:first_local + 2] if value.dim() and value.shape[0] == EXPERTS else value
                 for name, value in tensors.items()}
        layer = moe_layer.MoeFfn(shard, "layer.", router, TOP_K, activations, first_local=first_local)
    assert layer.all_local == (first_local is None)
    generator = torch.Generator().manual_seed(11)
    for tokens in (1, 5, 24):
        x = torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16)
        topk_ids, topk_weights = layer.route(x)
        got = layer.experts_output(x, topk_ids, topk_weights, out_dtype=torch.float32)
        expected = _experts_output_step_by_step(layer, x, topk_ids, topk_weights)
        assert torch.equal(got, expected), (tokens, (got - expected).abs().max())


def test_offsets_leave_other_gpus_pairs_past_the_last_expert():
    """Pairs routed to another GPU's experts (local id E) sort last: offsets[E] counts the local
    pairs only."""
    _, layer, _ = make_layer()
    order, _, offsets = layer.sort_by_expert(torch.tensor([4, 1, 4, 0, 3]), 1)
    assert offsets.tolist() == [0, 1, 2, 2, 3] and order.tolist() == [3, 1, 4, 0, 2]


def _kernel_ops(fn) -> list[str]:
    """The aten ops `fn` dispatches that compute (each a kernel on a GPU): views, empties and
    aliases left out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    no_kernel = ("view", "slice", "select", "unsqueeze", "squeeze", "expand", "permute", "aten.t.", "transpose",
                 "alias", "empty", "detach", "as_strided", "lift_fresh")

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not any(part in str(func) for part in no_kernel):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        fn()
    return ops.ops


def test_the_w4a16_experts_output_is_two_gemms_and_nine_small_ops():
    """Where every expert is local, the unfused W4A16 routed experts are the two GEMMs and 9 small
    ops (the step-by-step form: 28): sort, search, token index, SwiGLU's cast, silu and product,
    its bf16 rounding, the weights' product (the rows promoted to fp32 inside it), the sum; the
    gather and the un-permute are the GEMMs' (a_rows, c_rows), and the rows they name are the
    pairs' (order // k, order)."""
    _, layer, _ = make_layer(activations="bf16", swiglu_epilogue=False)
    x = torch.randn(1, HIDDEN).to(torch.bfloat16)
    topk_ids, topk_weights = layer.route(x)
    ops = _kernel_ops(lambda: layer.experts_output(x, topk_ids, topk_weights, out_dtype=torch.float32))
    gemms = [op for op in ops if op.startswith("nvfp4_group_gemm.")]
    assert len(gemms) == 2 and len(ops) - len(gemms) == 9, ops
    assert not any("index" in op for op in ops), ops  # no gather, no index_put
    before = _kernel_ops(lambda: _experts_output_step_by_step(layer, x, topk_ids, topk_weights))
    assert len(before) - 2 == 28, before


def test_the_w4a4_experts_output_quantizes_in_25_ops_a_gemm():
    """W4A4: each GEMM's activations quantized in 25 ops (bf16 rows' cast, block amax and scale,
    the e2m1 codes by two searches, the packing; 24 for fp32 rows), 59 small ops around the two
    GEMMs in all."""
    _, layer, _ = make_layer(activations="nvfp4")
    x = torch.randn(1, HIDDEN).to(torch.bfloat16)
    topk_ids, topk_weights = layer.route(x)
    ops = _kernel_ops(lambda: layer.experts_output(x, topk_ids, topk_weights, out_dtype=torch.float32))
    gemms = [op for op in ops if op.startswith("nvfp4_group_gemm.")]
    assert len(gemms) == 2 and len(ops) - len(gemms) == 59, ops
    quantize = _kernel_ops(lambda: moe_layer.quantize_activations(x, layer.scale13))
    assert len(quantize) == 25 and sum("bucketize" in op for op in quantize) == 2, quantize


def test_the_swiglu_epilogue_layer_is_the_unfused_layer_bit_for_bit_on_a_cpu():
    """W4A16's default (swiglu_epilogue): the gate-and-up GEMM with SwiGLU in its epilogue
    (activation="swiglu" over w13 held in the epilogue's row order, one copy) gives, through the
    exact decode, the unfused layer's bits (the same roundings: gate and up to bf16, silu(gate)
    x up in fp32, bf16), with one and with two w13 scales; w13 dequantizes to the same stacked
    weights either way; its routed experts are the two GEMMs and 5 small ops; the W4A4 layer
    keeps SwiGLU unfused."""
    for split in (False, True):
        tensors, layer, router = make_layer(split, activations="bf16")
        unfused = moe_layer.MoeFfn(tensors, "layer.", router, TOP_K, "bf16", swiglu_epilogue=False)
        assert layer.swiglu_epilogue and not unfused.swiglu_epilogue and layer.w13.b.shape == unfused.w13.b.shape
        assert torch.equal(checkpoint.dequantize_projection(layer.w13), checkpoint.dequantize_projection(unfused.w13))
        x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        assert torch.equal(layer(x), unfused(x)), split
    topk_ids, topk_weights = layer.route(x)
    ops = _kernel_ops(lambda: layer.experts_output(x, topk_ids, topk_weights, out_dtype=torch.float32))
    gemms = [op for op in ops if op.startswith("nvfp4_group_gemm.")]
    assert len(gemms) == 2 and len(ops) - len(gemms) == 5, ops
    _, w4a4, _ = make_layer(activations="nvfp4")
    assert not w4a4.swiglu_epilogue


@pytest.mark.parametrize("swiglu_epilogue", [True, False], ids=["swiglu_epilogue", "unfused"])
def test_the_fragment_weight_layout_gives_the_plain_layers_bits(swiglu_epilogue):
    """weight_layout="fragment" (W4A16's weights packed once for the decode's fragment): the
    layer's output bit for bit as the plain layout's (on a CPU: the op's exact decode unpacks);
    the projections read back alike (dequantize_projection); refused for W4A4 and unknown
    layouts, naming the setting."""
    tensors, plain, router = make_layer(activations="bf16", swiglu_epilogue=swiglu_epilogue)
    fragment = moe_layer.MoeFfn(tensors, "layer.", router, TOP_K, "bf16", swiglu_epilogue=swiglu_epilogue,
                                weight_layout="fragment")
    assert fragment.w13.b_layout == fragment.w2.b_layout == "fragment"
    assert not torch.equal(fragment.w13.b.view(torch.uint8), plain.w13.b.view(torch.uint8))
    for name in ("w13", "w2"):
        assert torch.equal(checkpoint.dequantize_projection(getattr(fragment, name)),
                           checkpoint.dequantize_projection(getattr(plain, name)))
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert torch.equal(fragment(x), plain(x))
    for activations, layout in (("nvfp4", "fragment"), ("bf16", "packed")):
        with pytest.raises(ValueError, match="weight_layout"):
            moe_layer.MoeFfn(tensors, "layer.", router, TOP_K, activations, weight_layout=layout)


@pytest.mark.parametrize("rows", [0, 1, 7, 4096])
def test_the_shared_experts_offsets_are_one_op(rows):
    """The shared expert's one group, offsets [0, T] int32, made by one op (a kernel on a GPU:
    the layer's per-call small kernels count at one token), no host copy."""
    ops = _kernel_ops(lambda: moe_layer.one_group_offsets(rows, torch.device("cpu")))
    offsets = moe_layer.one_group_offsets(rows, torch.device("cpu"))
    assert len(ops) == 1, ops
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, rows]


def _with_shared_expert(swiglu_epilogue: bool, weight_layout: str = "plain"):
    """make_layer's W4A16 layer with expert 1's projections as a shared expert (one group)."""
    tensors, _, router = make_layer(activations="bf16")
    one = {name: tensors[f"layer.{name}"][1:2] for name in ("w13_weight", "w13_weight_scale", "w2_weight",
                                                            "w2_weight_scale")}
    one.update({name: tensors[f"layer.{name}"][1:2] for name in ("w13_weight_scale_2", "w2_weight_scale_2")})
    shared = checkpoint.load_moe_layer({f"s.{k}": v for k, v in one.items()}, "s.")
    return moe_layer.MoeFfn(tensors, "layer.", router, TOP_K, "bf16", shared=shared,
                            swiglu_epilogue=swiglu_epilogue, weight_layout=weight_layout)


@pytest.mark.parametrize("weight_layout", ["plain", "fragment"])
def test_the_shared_expert_runs_swiglu_in_its_gemms_epilogue_bit_for_bit(weight_layout):
    """W4A16 with swiglu_epilogue: the shared expert's gate-and-up held in the epilogue's row
    order too, so the shared expert is its two GEMMs and the offsets' one op (the unfused one
    adds SwiGLU's cast, silu, product and bf16 rounding: four kernels a call on a GPU), and the
    layer's output is the unfused layer's bit for bit on a CPU (the exact decode)."""
    fused, unfused = _with_shared_expert(True, weight_layout), _with_shared_expert(False, weight_layout)
    assert fused.shared["w13"].row_order == "swiglu" and unfused.shared["w13"].row_order == "stacked"
    assert torch.equal(checkpoint.dequantize_projection(fused.shared["w13"]),
                       checkpoint.dequantize_projection(unfused.shared["w13"]))
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    assert torch.equal(fused(x), unfused(x))
    for layer, small_ops in ((fused, 1), (unfused, 5)):
        ops = _kernel_ops(lambda layer=layer: layer.shared_expert(x))
        gemms = [op for op in ops if op.startswith("nvfp4_group_gemm.")]
        assert len(gemms) == 2 and len(ops) - len(gemms) == small_ops, ops


def test_a_deepseek_v3_exports_shared_expert_runs_swiglu_in_its_epilogue():
    """The real DeepSeek-V3 export (../shared/checkpoints): the W4A16 layer's shared expert in
    the SwiGLU epilogue's row order, the layer within bf16 rounding of transformers' block."""
    path = Path(__file__).resolve().parents[1].parent / "shared" / "checkpoints" / "deepseek_v3"
    if not path.exists():
        pytest.skip(f"no checkpoint at {path}")
    from safetensors.torch import load_file

    layer = moe_layer.MoeFfn.from_pretrained(path, 1, device="cpu")
    assert layer.shared is not None and layer.shared["w13"].row_order == "swiglu"
    outputs = load_file(str(path / "block_outputs.safetensors"))
    x, y = outputs["layer1.x1"], outputs["layer1.y1"]
    out = layer(x).double()
    assert float((out - y).norm() / y.norm()) < 0.01


def _gpu_path_kernels(layer, x, monkeypatch) -> tuple[list[str], list[str], int]:
    """(the torch ops one layer call dispatches on the GPU path, the pair kernels it launches,
    the GEMMs it calls), counted on a CPU: the pair kernels' launches and the GEMM op stubbed
    (each one kernel on a GPU), so that what remains is every other kernel of the call."""
    launched, gemms = [], []
    monkeypatch.setattr(pairs, "_kernels_usable", lambda *tensors: True)
    monkeypatch.setattr(pairs, "route_and_sort_usable", lambda *args: True)
    monkeypatch.setattr(pairs, "_first_use", lambda *args: False)
    monkeypatch.setattr(pairs, "_launch", lambda compile_fn, *args: launched.append(
        getattr(compile_fn, "func", compile_fn).__name__))
    monkeypatch.setattr(moe_layer, "moe_grouped_gemm_op", lambda *args: gemms.append(args[-2]))
    layer.pair_kernels = True
    ops = _kernel_ops(lambda: layer(x))
    return ops, launched, len(gemms)


@pytest.mark.parametrize("with_shared", [False, True])
def test_the_w4a16_layers_gpu_path_is_its_kernels_and_the_routers_product(with_shared, monkeypatch):
    """One W4A16 layer call on the GPU path (pair kernels, SwiGLU in the epilogue), at one
    token: the router's product (x to fp32, the matmul), route-and-sort, the two GEMMs with
    SwiGLU in the first, the weighted sum; with a shared expert its two GEMMs (SwiGLU fused) and
    its offsets' one op. Every other small kernel would cost about 2 µs a call in graph replay
    (docs/TUNING.md, the Qwen3 profile)."""
    layer = _with_shared_expert(True) if with_shared else make_layer(activations="bf16")[1]
    x = torch.randn(1, HIDDEN).to(torch.bfloat16)
    ops, launched, gemms = _gpu_path_kernels(layer, x, monkeypatch)
    expected = ["aten._to_copy.default", "aten.mm.default"]
    if with_shared:
        expected = ["aten.arange.start_step"] + expected
    assert ops == expected, ops
    assert launched == ["compile_route_sort", "compile_combine"], launched
    assert gemms == 4 if with_shared else gemms == 2
