"""bench/moe_ffn.py's layers without a GPU: the synthetic checkpoint, the bf16 twin layer (MoeFfn's
routing with torch._grouped_mm GEMMs) and the weights' bytes, on a small expert-parallel layer:
the W4A16 and W4A4 layers (the op's exact decode on a CPU) land within the quantization error of
the bf16 layer, and the NVFP4 weights take about 0.28 of the bf16 bytes."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import moe_ffn

from nvfp4_group_gemm import moe_layer

SMALL = moe_ffn.Layer("small", hidden=256, intermediate=128, experts=8, local=4, top_k=2)


@pytest.mark.parametrize("activations", ["bf16", "nvfp4"])
def test_the_bench_layers_agree_with_the_bf16_layer_within_the_quantization_error(activations, capsys):
    tensors, weights = moe_ffn.checkpoint_tensors(SMALL, "cpu")
    router = torch.randn(SMALL.experts, SMALL.hidden, generator=torch.Generator().manual_seed(1)) * 0.05
    layer = moe_layer.MoeFfn(tensors, "layer.", router, SMALL.top_k, activations)
    bf16 = moe_ffn.Bf16Ffn(layer, weights)
    x = torch.randn(32, SMALL.hidden, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    reference, out = bf16(x).float(), layer(x).float()
    assert reference.shape == out.shape == (32, SMALL.hidden)
    error = float((out - reference).norm() / reference.norm())
    with capsys.disabled():
        print(f"\n  bench layer ({activations} activations) against its bf16 twin: relative error {error:.3f}")
    assert 0 < error < 0.35
    # tokens whose experts are all elsewhere get nothing from this GPU, in both layers
    experts = layer.local_experts(layer.route(x)[0]).view(32, SMALL.top_k)
    remote = (experts == SMALL.local).all(dim=1)
    assert remote.any() and not remote.all()
    assert torch.equal(out[remote], torch.zeros_like(out[remote]))
    assert torch.equal(reference[remote], torch.zeros_like(reference[remote]))
    codes_and_scales = moe_ffn.weight_bytes({k: v for k, v in tensors.items() if "input_scale" not in k})
    assert 0.28 <= codes_and_scales / moe_ffn.weight_bytes(weights) <= 0.29
