"""bench/moe_ffn.py's layers without a GPU, on small expert-parallel layers of both
architectures: the export it writes (real tensor names, shards, config.json) loads through
open_export with one rank's experts, the W4A16 and W4A4 layers (the op's exact decode on a CPU)
land within the quantization error of the bf16 twin (MoeFfn's routing with torch._grouped_mm
GEMMs, the shared expert a plain matmul), tokens routed only elsewhere get nothing (or the shared
expert alone), and the NVFP4 weights take about 0.28 of the bf16 bytes."""

import json

import moe_ffn
import pytest
import torch

from nvfp4_group_gemm import export, moe_layer

pytest.importorskip("safetensors", reason="the bench writes safetensors exports")

# 40 experts: two shards of 32 and 8; rank 0 holds experts 0..9
SMALL = moe_ffn.Layer("small", hidden=256, intermediate=128, experts=40, local=10, top_k=2)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def small_export(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, moe_ffn.write_export(SMALL, directory, request.param, "cpu")


def test_the_bench_export_is_a_sharded_modelopt_export_with_its_architectures_routing(small_export):
    architecture, directory = small_export
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert index["model.layers.0.mlp.experts.39.down_proj.weight_scale_2"] == "model-00002-of-00002.safetensors"
    opened = export.open_export(directory)
    assert opened.moe_layers == [0] and opened.num_experts == SMALL.experts
    assert opened.routing.scoring == ("sigmoid" if architecture == "deepseek_v3" else "softmax")
    if architecture == "deepseek_v3":
        assert (opened.routing.n_group, opened.routing.topk_group, opened.routing.routed_scaling_factor) == (8, 4, 2.5)
    assert moe_ffn.write_export(SMALL, directory, architecture, "cpu") == directory  # complete: reused


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"])
def test_the_bench_layers_agree_with_the_bf16_layer_within_the_quantization_error(small_export, activations, capsys):
    architecture, directory = small_export
    weights, seconds, peak = moe_ffn.load_layer(directory, SMALL, "cpu")
    assert weights.w13.b.shape[0] == SMALL.local and weights.router_weight.shape[0] == SMALL.experts
    assert seconds > 0 and (peak is None or peak > 0)
    layer = moe_layer.MoeFfn.from_weights(weights, activations)
    assert (layer.shared is not None) == (architecture == "deepseek_v3")
    bf16_weights = moe_ffn.bf16_weights(SMALL, layer, "cpu")
    bf16 = moe_ffn.Bf16Ffn(layer, bf16_weights)
    x = torch.randn(32, SMALL.hidden, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    reference, out = bf16(x).float(), layer(x).float()
    assert reference.shape == out.shape == (32, SMALL.hidden)
    error = float((out - reference).norm() / reference.norm())
    with capsys.disabled():
        print(f"\n  bench {architecture} layer ({activations} activations) against its bf16 twin: relative error "
              f"{error:.3f}")
    assert 0 < error < 0.35
    # tokens whose experts are all elsewhere get nothing from the routed experts here, in both layers
    experts = layer.local_experts(layer.route(x)[0])
    remote = (experts == SMALL.local).all(dim=1)
    assert remote.any() and not remote.all()
    expected = torch.zeros_like(out[remote]) if layer.shared is None else layer.shared_expert(x)[remote].float()
    assert torch.equal(out[remote], expected)
    if layer.shared is None:
        assert torch.equal(reference[remote], torch.zeros_like(reference[remote]))
    nvfp4_bytes = moe_ffn.layer_weight_bytes(layer)
    bf16_bytes = moe_ffn.weight_bytes([bf16_weights["w13"], bf16_weights["w2"], *(bf16_weights["shared"] or ())])
    assert 0.28 <= nvfp4_bytes / bf16_bytes <= 0.29
