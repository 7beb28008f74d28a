"""bench/moe_ffn.py without a GPU.

On small expert-parallel layers of the three architectures it writes (Qwen3-MoE, DeepSeek-V3,
Mixtral): the export (real tensor names, shards, config.json) loads through open_export with one
rank's experts, the W4A16 and W4A4 layers (the op's exact decode on a CPU) land within the
quantization error of the bf16 twin (MoeFfn's routing with torch._grouped_mm GEMMs, the shared
expert a plain matmul), tokens routed only elsewhere get nothing (or the shared expert alone), and
the NVFP4 weights take about 0.28 of the bf16 bytes.

Then the pieces the GPU run rests on: the layers' real sizes and routings, the floor (bytes of
the experts read, by hand), the options, the triton_kernels column's absence (its reason
printed), the preparation that turns triton_kernels' SwiGLU into SiLU(gate) x up, the expert
parallel slice map, and the profile's split of device activities into layer calls."""

import json
import sys

import moe_ffn
import pytest
import torch

from nvfp4_group_gemm import export, moe_layer
from nvfp4_group_gemm.routing import Routing

pytest.importorskip("safetensors", reason="the bench writes safetensors exports")

# 40 experts: two shards of 32 and 8; rank 0 holds experts 0..9
SMALL = moe_ffn.Layer("small", hidden=256, intermediate=128, experts=40, local=10, top_k=2)
# one SMALL expert's NVFP4 bytes, by hand: gate-up N 256, K 256: codes 256 x 128, e4m3 scales
# 256 x 16, fp32 global scales 2 (gate and up quantized apart); down N 256, K 128: 256 x 64,
# 256 x 8, one fp32 scale
SMALL_EXPERT_BYTES = 256 * 128 + 256 * 16 + 2 * 4 + 256 * 64 + 256 * 8 + 4
EXPERT_NAMES = {"qwen3_moe": "mlp.experts.39.down_proj", "deepseek_v3": "mlp.experts.39.down_proj",
                "mixtral": "block_sparse_moe.experts.39.w2"}


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "mixtral"])
def small_export(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, moe_ffn.write_export(SMALL, directory, request.param, "cpu")


def test_the_bench_export_is_a_sharded_modelopt_export_with_its_architectures_routing(small_export):
    architecture, directory = small_export
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    name = f"model.layers.0.{EXPERT_NAMES[architecture]}.weight_scale_2"
    assert index[name] == "model-00002-of-00002.safetensors"
    opened = export.open_export(directory)
    assert opened.moe_layers == [0] and opened.num_experts == SMALL.experts
    assert (opened.hidden, opened.intermediate) == (SMALL.hidden, SMALL.intermediate)
    assert opened.routing.scoring == ("sigmoid" if architecture == "deepseek_v3" else "softmax")
    if architecture == "deepseek_v3":
        assert (opened.routing.n_group, opened.routing.topk_group, opened.routing.routed_scaling_factor) == (8, 4, 2.5)
    if architecture == "mixtral":
        assert opened.architecture == "MixtralForCausalLM" and opened.routing.renormalize
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
    # the floor's bytes: one routed expert's, and the shared expert's (the same sizes here)
    routed, shared = moe_ffn.expert_bytes(layer)
    assert routed == SMALL_EXPERT_BYTES
    assert shared == (SMALL_EXPERT_BYTES if architecture == "deepseek_v3" else 0)
    assert nvfp4_bytes == SMALL.local * routed + shared


# -- the layers' sizes ----------------------------------------------------------------------------


def test_the_bench_layers_have_the_real_models_sizes_and_routings():
    sizes = {name: (layer.hidden, layer.intermediate, layer.experts, layer.local, layer.top_k)
             for name, layer in moe_ffn.LAYERS.items()}
    assert sizes == {"qwen3": (2048, 768, 128, 128, 8),  # Qwen3-30B-A3B
                     "dsv3_ep8": (7168, 2048, 256, 32, 8),  # DeepSeek-V3, rank 0 of 8-way expert parallelism
                     "mixtral": (4096, 14336, 8, 8, 2)}  # Mixtral-8x7B
    routings = {name: Routing.from_config(moe_ffn.export_config(layer, moe_ffn.ARCHITECTURES[name]))
                for name, layer in moe_ffn.LAYERS.items()}
    assert routings == {"qwen3": Routing("softmax", 8, renormalize=True),
                        "dsv3_ep8": Routing("sigmoid", 8, renormalize=True, n_group=8, topk_group=4,
                                            routed_scaling_factor=2.5),
                        "mixtral": Routing("softmax", 2, renormalize=True)}
    mixtral = moe_ffn.export_config(moe_ffn.LAYERS["mixtral"], "mixtral")
    assert (mixtral["num_local_experts"], mixtral["intermediate_size"], mixtral["hidden_size"]) == (8, 14336, 4096)
    assert "moe_intermediate_size" not in mixtral  # Mixtral's experts are its MLPs


# -- the floor ------------------------------------------------------------------------------------


def test_the_floor_is_the_read_experts_nvfp4_bytes_at_4_8_tb_per_s():
    # Mixtral-8x7B at one token: top-2, two experts of 3 x 4096 x 14336 weights at 9/16 byte
    # (e2m1 codes and one e4m3 scale per 16) plus 3 fp32 global scales: 2 x 99,090,444 bytes
    mixtral_expert = 3 * 4096 * 14336 * 9 // 16 + 3 * 4
    assert mixtral_expert == 99_090_444
    assert moe_ffn.floor_us(2, mixtral_expert) == pytest.approx(198_180_888 / 4.8e12 * 1e6)
    assert moe_ffn.floor_us(2, mixtral_expert) == pytest.approx(41.28768, abs=1e-5)
    # DeepSeek-V3 (EP8) at one token whose 8 experts include one local: one routed expert and the shared one
    dsv3_expert = 3 * 7168 * 2048 * 9 // 16 + 3 * 4
    assert moe_ffn.floor_us(1, dsv3_expert, dsv3_expert) == pytest.approx(49_545_240 / 4.8e12 * 1e6)
    assert moe_ffn.floor_us(1, dsv3_expert, dsv3_expert) == pytest.approx(10.321925, abs=1e-5)
    assert moe_ffn.floor_us(0.5, 1000, 0, bytes_per_s=1e9) == pytest.approx(0.5)


def test_the_active_experts_are_the_distinct_local_experts_a_routing_hits():
    # experts 0..9 local (rank 0 of 4 over 40): 0 (twice), 5 (twice), 3 are; 39, 12, 10 are not
    ids = torch.tensor([[0, 5], [5, 39], [12, 3], [0, 10]])
    assert moe_ffn.active_experts(ids, 0, 10) == 3
    assert moe_ffn.active_experts(ids, 10, 10) == 2  # rank 1: 12, 10
    assert moe_ffn.active_experts(ids, 30, 10) == 1  # rank 3: 39
    assert moe_ffn.active_experts(torch.tensor([[7, 7]]), 0, 8) == 1


# -- options and the triton_kernels column --------------------------------------------------------


def test_the_options_default_to_every_layer_at_seven_token_counts_and_the_profile_to_1_and_16():
    args = moe_ffn.parse_options([])
    assert args.layers == ["qwen3", "dsv3_ep8", "mixtral"]
    assert args.tokens == [1, 4, 16, 64, 256, 1024, 4096]
    assert (args.profile, args.no_triton, args.repeats, args.export_dir, args.json) == (False, False, 20, None, None)
    args = moe_ffn.parse_options(["--profile"])
    assert args.profile and args.tokens == [1, 16] and args.profile_calls == 5
    args = moe_ffn.parse_options(["--profile", "--tokens", "1,16", "--layers", "mixtral", "--no-triton"])
    assert (args.tokens, args.layers, args.no_triton) == ([1, 16], ["mixtral"], True)
    args = moe_ffn.parse_options(["--tokens", "4096", "--layers", "dsv3_ep8,qwen3", "--repeats", "5"])
    assert (args.tokens, args.layers, args.repeats) == ([4096], ["dsv3_ep8", "qwen3"], 5)


def test_bad_options_fail_before_the_gpu_is_looked_for(capsys):
    with pytest.raises(ValueError, match="unknown layers"):
        moe_ffn.parse_options(["--layers", "qwen3,llama"])
    assert moe_ffn.main(["--layers", "llama"]) == 2
    assert "unknown layers ['llama']: choose from qwen3, dsv3_ep8, mixtral" in capsys.readouterr().err
    assert moe_ffn.main(["--repeats", "0"]) == 2
    for tokens in ("0", "1,x"):
        with pytest.raises(SystemExit) as exit_info:
            moe_ffn.parse_options(["--tokens", tokens])
        assert exit_info.value.code == 2
        assert "invalid token list" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_hopper_gpu_the_bench_refuses_with_its_reason(capsys):
    assert moe_ffn.main(["--tokens", "1"]) == 2
    assert "needs an sm_90 (Hopper) GPU" in capsys.readouterr().err


def test_without_triton_the_triton_kernels_column_is_skipped_with_its_reason(monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the source folder it may add goes again
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    for name in [name for name in sys.modules if name == "triton_kernels" or name.startswith("triton_kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    names, reason = moe_ffn.load_triton_kernels()
    assert names is None and reason.startswith("cannot import triton_kernels (")
    assert "triton" in reason.removeprefix("cannot import triton_kernels")
    assert moe_ffn.triton_peer(False) == (None, reason)
    assert capsys.readouterr().out == f"triton_kernels: column skipped: {reason}\n"
    assert moe_ffn.triton_peer(True) == (None, "--no-triton")
    assert capsys.readouterr().out == "triton_kernels: column skipped: --no-triton\n"


# -- triton_kernels' SwiGLU as SiLU(gate) x up ----------------------------------------------------


def test_gate_and_up_rows_are_interleaved_and_the_bias_is_minus_one_on_up():
    w13 = torch.arange(2 * 3 * 2 * 4, dtype=torch.float32).reshape(2, 6, 4)  # 2 experts, I = 3, K = 4
    interleaved = moe_ffn.interleave_gate_up(w13)
    assert interleaved.shape == w13.shape
    for expert in range(2):
        for j in range(3):
            assert torch.equal(interleaved[expert, 2 * j], w13[expert, j])  # gate row j
            assert torch.equal(interleaved[expert, 2 * j + 1], w13[expert, 3 + j])  # up row j
    assert torch.equal(moe_ffn.interleave_gate_up(w13[0]), interleaved[0])  # the shared expert's [2I, K]
    bias = moe_ffn.swiglu_bias(2, 3, "cpu")
    assert bias.dtype == torch.float32
    assert bias.tolist() == [[0.0, -1.0, 0.0, -1.0, 0.0, -1.0]] * 2


def test_triton_kernels_swiglu_on_the_prepared_weights_is_silu_gate_times_up():
    generator = torch.Generator().manual_seed(3)
    w13 = torch.randn(2 * 64, 96, generator=generator) * 0.3  # gate rows then up rows, I = 64, K = 96
    x = torch.randn(16, 96, generator=generator) * 2
    gate, up = (x @ w13.T).chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    # GEMM 1 on interleaved rows with the bias, then triton_kernels' activation as the bench sets it
    acc = x @ moe_ffn.interleave_gate_up(w13).T + moe_ffn.swiglu_bias(1, 64, "cpu")[0]
    got = moe_ffn.triton_swiglu(acc, moe_ffn.SWIGLU_ALPHA, moe_ffn.SWIGLU_LIMIT)
    assert (moe_ffn.SWIGLU_ALPHA, moe_ffn.SWIGLU_LIMIT) == (1.0, float("inf"))
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
    assert float(expected.abs().max()) > 7  # some values past gpt-oss's clamp
    # without the preparation (gpt-oss's alpha 1.702 and limit 7, gate and up stacked, no bias)
    # the same weights give another function
    stacked = moe_ffn.triton_swiglu(x @ w13.T, 1.702, 7.0)
    assert float((stacked - expected).norm() / expected.norm()) > 0.5
    # each difference alone: the + 1, alpha, the clamp
    interleaved = x @ moe_ffn.interleave_gate_up(w13).T
    for result in (moe_ffn.triton_swiglu(interleaved, 1.0, float("inf")),
                   moe_ffn.triton_swiglu(acc, 1.702, float("inf")),
                   moe_ffn.triton_swiglu(acc, 1.0, 7.0)):
        assert float((result - expected).abs().max()) > 1e-2


def test_the_expert_parallel_slice_map_keeps_the_local_experts_in_order():
    assert moe_ffn.local_slice_map(256, 0, 32).tolist() == list(range(32)) + [-1] * 224
    assert moe_ffn.local_slice_map(256, 32, 32).tolist() == [-1] * 32 + list(range(32)) + [-1] * 192
    assert moe_ffn.local_slice_map(8, 0, 8).tolist() == list(range(8))
    assert moe_ffn.local_slice_map(8, 0, 8).dtype == torch.int32


# -- the profile ----------------------------------------------------------------------------------


def test_a_profile_splits_into_calls_at_the_marker_and_drops_the_flush():
    # (name, start µs, duration µs) by start: each call is the sleep, the flush, then its own work
    activities = [("spin_kernel", 0.0, 9000.0), ("add_flush", 9000.0, 150.0),
                  ("route", 9200.0, 4.0), ("gemm", 9210.0, 20.0), ("Memset (Device)", 9232.0, 1.0),
                  ("gemm", 9240.0, 10.0),
                  ("spin_kernel", 9300.0, 9000.0), ("add_flush", 18300.0, 150.0),
                  ("route", 18500.0, 6.0), ("gemm", 18510.0, 22.0), ("Memset (Device)", 18533.0, 1.0),
                  ("gemm", 18540.0, 12.0)]
    calls = moe_ffn.split_calls(activities)
    assert [[name for name, _, _ in call] for call in calls] == [["route", "gemm", "Memset (Device)", "gemm"]] * 2
    summary = moe_ffn.summarize_calls(calls)
    assert summary["same_sequence"] and summary["calls"] == 2
    assert [(k["name"], k["us"]) for k in summary["kernels"]] == [("route", 5.0), ("gemm", 21.0),
                                                                   ("Memset (Device)", 1.0), ("gemm", 11.0)]
    assert summary["sum_us"] == pytest.approx(38.0)  # (35 + 41) / 2
    assert summary["span_us"] == pytest.approx(51.0)  # (50 + 52) / 2
    # calls whose sequences differ: per name, with launches per call
    calls[1].append(("reduce", 18560.0, 3.0))
    summary = moe_ffn.summarize_calls(calls)
    assert not summary["same_sequence"]
    assert {k["name"]: (k["us"], k["launches"]) for k in summary["kernels"]} == {
        "route": (5.0, 1.0), "gemm": (32.0, 2.0), "Memset (Device)": (1.0, 1.0), "reduce": (1.5, 0.5)}
    with pytest.raises(ValueError, match="no device activity"):
        moe_ffn.split_calls([])


def test_the_floor_divides_by_the_gpus_own_bandwidth():
    assert moe_ffn.hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert moe_ffn.hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert moe_ffn.hbm_bytes_per_s("some other GPU") == moe_ffn.HBM_BYTES_PER_S
