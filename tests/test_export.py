"""Real ModelOpt NVFP4 exports (../shared/checkpoints, or $NVFP4_CHECKPOINTS) through
nvfp4_group_gemm.export and MoeFfn.from_pretrained, on a CPU (the op's exact decode): the
layer's float64 decode against transformers' own MoE block (block_outputs.safetensors: the
loader and the routing exact up to fp32 router logits), W4A16 within 1 % of it, W4A4 reported;
expert ranges, shards, the entry for callers that route themselves; every loader failure on a
damaged copy; the host memory of loading one layer."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from nvfp4_group_gemm import export, moe_layer

safetensors_torch = pytest.importorskip("safetensors.torch", reason="the export reader needs safetensors")

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = Path(os.environ.get("NVFP4_CHECKPOINTS", REPO_ROOT.parent / "shared" / "checkpoints"))
# (architecture, MoE layers, routed experts, top-k) of each export (their README)
EXPORTS = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", [0, 1], 16, 4),
    "qwen3_moe_i192": ("Qwen3MoeForCausalLM", [0, 1], 16, 4),
    "mixtral": ("MixtralForCausalLM", [0, 1], 8, 2),
    "deepseek_v3": ("DeepseekV3ForCausalLM", [1], 16, 4),
}
INPUTS = 4  # layerL.x0 .. x3 (T = 1, 5, 64, 200)
W4A16_BOUND = 0.01
W4A4_BOUND = 0.40

needs_checkpoints = pytest.mark.skipif(not CHECKPOINTS.is_dir(),
                                       reason=f"no checkpoints folder {CHECKPOINTS} (set NVFP4_CHECKPOINTS)")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def block_outputs(name: str) -> dict:
    return safetensors_torch.load_file(CHECKPOINTS / name / "block_outputs.safetensors")


@needs_checkpoints
@pytest.mark.parametrize("name", list(EXPORTS))
def test_an_export_opens_with_its_architecture_layers_and_routing(name):
    architecture, layers, experts, top_k = EXPORTS[name]
    opened = export.open_export(CHECKPOINTS / name)
    assert (opened.architecture, opened.moe_layers, opened.num_experts) == (architecture, layers, experts)
    assert opened.routing.top_k == top_k and opened.routing.renormalize
    weights = opened.load_moe_layer(layers[-1], device="cpu")
    intermediate = opened.config["moe_intermediate_size" if "moe_intermediate_size" in opened.config
                                 else "intermediate_size"]
    assert weights.w13.b.shape == (experts, 2 * intermediate, 128) and weights.w2.b.shape == (experts, 256,
                                                                                                intermediate // 2)
    assert weights.router_weight.shape == (experts, 256) and weights.router_weight.dtype == torch.float32
    assert weights.first_expert == 0
    # ModelOpt quantizes gate and up with one weight_scale_2 per expert: one alpha per expert
    assert weights.w13.weight_scale_2.shape == (experts,)
    if name == "deepseek_v3":
        assert opened.routing.scoring == "sigmoid" and opened.routing.n_group == 4 and opened.routing.topk_group == 2
        assert opened.routing.routed_scaling_factor == 2.5
        assert weights.e_score_correction_bias.shape == (experts,)
        assert weights.shared["w13"].b.shape == (1, 512, 128) and weights.shared["w2"].b.shape == (1, 256, 128)
    else:
        assert opened.routing.scoring == "softmax" and weights.e_score_correction_bias is None
        assert weights.shared is None


@needs_checkpoints
@pytest.mark.parametrize("name", list(EXPORTS))
def test_the_float64_decode_is_transformers_moe_block(name):
    """The layer's float64 decode (its routing, the experts dequantized exactly, the shared
    expert) against transformers' own block of the architecture in float64: equal up to the
    router's fp32 logits and probabilities (relative 1e-7), so the loader and the routing choose
    and weigh exactly the experts transformers does."""
    outputs = block_outputs(name)
    for layer in EXPORTS[name][1]:
        ffn = moe_layer.MoeFfn.from_pretrained(CHECKPOINTS / name, layer, device="cpu")
        for i in range(INPUTS):
            reference = moe_layer.float64_reference(ffn, outputs[f"layer{layer}.x{i}"])
            assert relative_error(reference, outputs[f"layer{layer}.y{i}"]) < 1e-5, (name, layer, i)


@needs_checkpoints
@pytest.mark.parametrize("name", list(EXPORTS))
def test_the_layer_from_an_export_is_transformers_block_to_its_roundings(name, capsys):
    """W4A16 (bf16 activations) within 1 % (bf16 roundings: 0.3-0.5 %) of transformers' block
    on every MoE layer and input; W4A4 (NVFP4 activations) computed and reported, bounded loosely
    (the activations' quantization error, 15-25 % on these random inputs)."""
    outputs = block_outputs(name)
    lines = []
    for layer in EXPORTS[name][1]:
        errors = {}
        for activations in ("bf16", "nvfp4"):
            ffn = moe_layer.MoeFfn.from_pretrained(CHECKPOINTS / name, layer, device="cpu", activations=activations)
            errors[activations] = []
            for i in range(INPUTS):
                y = ffn(outputs[f"layer{layer}.x{i}"])
                assert y.dtype == torch.bfloat16
                errors[activations].append(relative_error(y, outputs[f"layer{layer}.y{i}"]))
        lines.append(f"  {name} layer {layer}: W4A16 {max(errors['bf16']):.4f}, W4A4 {max(errors['nvfp4']):.3f} "
                     f"(largest relative error of {INPUTS} inputs)")
        assert max(errors["bf16"]) < W4A16_BOUND, errors
        assert max(errors["nvfp4"]) < W4A4_BOUND, errors
    with capsys.disabled():
        print("\n" + "\n".join(lines))


@needs_checkpoints
def test_expert_ranges_load_a_ranks_experts_and_the_ranks_sum_to_the_layer():
    """DeepSeek-V3, two expert-parallel ranks (experts 0-7, 8-15): each loads its own experts
    (the same tensors as the whole layer's), routes over all 16, and adds the shared expert on
    the rank of expert 0 only: the two outputs summed (the all-reduce) are the whole layer's, up
    to each part's rounding to bf16."""
    path = CHECKPOINTS / "deepseek_v3"
    opened = export.open_export(path)
    whole = opened.load_moe_layer(1, device="cpu")
    part = opened.load_moe_layer(1, device="cpu", experts=range(8, 16))
    assert part.first_expert == 8 and part.w13.b.shape[0] == 8 and part.router_weight.shape == (16, 256)
    assert torch.equal(part.w13.b.view(torch.uint8), whole.w13.b.view(torch.uint8)[8:])
    assert torch.equal(part.w2.sfb.view(torch.uint8), whole.w2.sfb.view(torch.uint8)[8:])
    assert torch.equal(part.w13.weight_scale_2, whole.w13.weight_scale_2[8:])
    x = block_outputs("deepseek_v3")["layer1.x3"]
    ranks = [moe_layer.MoeFfn.from_pretrained(path, 1, device="cpu", experts=experts)
             for experts in (range(8), range(8, 16))]
    assert ranks[0].shared is not None and ranks[1].shared is None
    parts = [rank(x).float() for rank in ranks]
    out = moe_layer.MoeFfn.from_weights(whole)(x).float()
    unit = (parts[0].abs() + parts[1].abs() + out.abs()) * 2.0**-7
    assert bool(((parts[0] + parts[1] - out).abs() <= unit).all())
    with pytest.raises(ValueError, match=r"experts = range\(8, 17\): must be a range of step 1 within range\(0, 16\)"):
        opened.load_moe_layer(1, device="cpu", experts=range(8, 17))


@needs_checkpoints
def test_callers_that_route_themselves_get_the_same_layer():
    """experts_output(hidden_states, topk_ids, topk_weights): the routed experts alone for a
    caller's own routing (int32 or int64 ids); with the layer's routing it is the layer (Mixtral:
    no shared expert); a caller's other weights weigh the same expert outputs."""
    ffn = moe_layer.MoeFfn.from_pretrained(CHECKPOINTS / "mixtral", 0, device="cpu")
    x = block_outputs("mixtral")["layer0.x2"]
    topk_ids, topk_weights = ffn.route(x)
    assert topk_ids.shape == topk_weights.shape == (64, 2)
    assert torch.equal(ffn.experts_output(x, topk_ids.int(), topk_weights), ffn(x))
    # one expert each, weight 1: that expert's output; weight 0.5: half of it (exact in bf16)
    ids = torch.full((64, 1), 3)
    one = ffn.experts_output(x, ids, torch.ones(64, 1))
    assert torch.equal(ffn.experts_output(x, ids, torch.full((64, 1), 0.5)), (one.float() * 0.5).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"topk_ids.shape = \(64, 2\), topk_weights.shape = \(64, 1\): both must be"):
        ffn.experts_output(x, topk_ids, topk_weights[:, :1])
    with pytest.raises(TypeError, match=r"topk_ids.dtype = torch.float32: must be int32 or int64"):
        ffn.experts_output(x, topk_weights, topk_weights)


# -----------------------------------------------------------------------------
# Damaged copies: each failure names what is wrong and where
# -----------------------------------------------------------------------------
def damaged_copy(tmp_path: Path, name: str, edit_tensors=None, edit_config=None, edit_quant=None) -> Path:
    """A copy of export `name` in tmp_path with its tensors, config.json or hf_quant_config.json
    edited (each edit a function of the dict, in place)."""
    source = CHECKPOINTS / name
    target = Path(tempfile.mkdtemp(dir=tmp_path)) / name  # one test may damage several copies
    target.mkdir()
    for file in ("config.json", "hf_quant_config.json"):
        shutil.copyfile(source / file, target / file)
    tensors = safetensors_torch.load_file(source / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    safetensors_torch.save_file(tensors, target / "model.safetensors")
    for file, edit in (("config.json", edit_config), ("hf_quant_config.json", edit_quant)):
        if edit:
            data = json.loads((target / file).read_text())
            edit(data)
            (target / file).write_text(json.dumps(data))
    return target


@needs_checkpoints
def test_a_missing_tensor_is_named(tmp_path):
    missing = "model.layers.0.mlp.experts.3.up_proj.weight_scale"
    path = damaged_copy(tmp_path, "qwen3_moe", edit_tensors=lambda t: t.pop(missing))
    with pytest.raises(ValueError, match=rf"qwen3_moe: no tensor '{missing}'"):
        export.open_export(path).load_moe_layer(0, device="cpu")
    export.open_export(path).load_moe_layer(1, device="cpu")  # the other layer is whole


@needs_checkpoints
def test_a_wrong_dtype_or_shape_is_named(tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.5.w2.weight_scale"

    def to_float(tensors):
        tensors[name] = tensors[name].float()

    path = damaged_copy(tmp_path, "mixtral", edit_tensors=to_float)
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{name}': dtype float32, shape \[256, 16\]: "
                                         r"expected float8_e4m3fn \[256, 16\]"):
        export.open_export(path).load_moe_layer(1, device="cpu")
    router = "model.layers.1.mlp.gate.weight"

    def cut_router(tensors):
        tensors[router] = tensors[router][:15].contiguous()

    path = damaged_copy(tmp_path, "deepseek_v3", edit_tensors=cut_router)
    with pytest.raises(ValueError, match=rf"tensor '{router}': dtype float32, shape \[15, 256\]: expected float32 or "
                                         r"bfloat16 or float16 \[16, 256\]"):
        export.open_export(path).load_moe_layer(1, device="cpu")


@needs_checkpoints
def test_a_quantization_other_than_nvfp4_is_refused(tmp_path):
    def fp8(data):
        data["quantization"]["quant_algo"] = "FP8"

    path = damaged_copy(tmp_path, "qwen3_moe", edit_quant=fp8)
    with pytest.raises(ValueError, match=r"hf_quant_config.json: quant_algo = 'FP8', group_size = 16: expected "
                                         r"quant_algo 'NVFP4', group_size 16"):
        export.open_export(path)
    (path / "hf_quant_config.json").unlink()  # config.json's quantization_config then decides: NVFP4
    assert export.open_export(path).num_experts == 16

    def group_32(data):
        for group in data["quantization_config"]["config_groups"].values():
            group["weights"]["group_size"] = 32

    path = damaged_copy(tmp_path, "qwen3_moe", edit_config=group_32)
    with pytest.raises(ValueError, match=r"config.json quantization_config: quant_algo = 'NVFP4', group_size = 32"):
        export.open_export(path)
    (path / "hf_quant_config.json").unlink()
    data = json.loads((path / "config.json").read_text())
    del data["quantization_config"]
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"no hf_quant_config.json and no quantization_config in config.json"):
        export.open_export(path)


@needs_checkpoints
def test_an_expert_count_other_than_configs_or_a_layer_without_experts_is_named(tmp_path):
    def twelve(data):
        data["num_local_experts"] = 12

    path = damaged_copy(tmp_path, "qwen3_moe", edit_config=twelve)
    with pytest.raises(ValueError, match=r"layer 0 has experts 0..15 \(16\): config.json's num_local_experts = 12"):
        export.open_export(path).load_moe_layer(0, device="cpu")
    opened = export.open_export(CHECKPOINTS / "deepseek_v3")
    with pytest.raises(ValueError, match=r"layer 0 has no experts \(no model.layers.0.mlp.experts.\* or .*MoE "
                                         r"layers: \[1\]"):
        opened.load_moe_layer(0, device="cpu")


@needs_checkpoints
def test_a_sharded_export_loads_as_the_single_file(tmp_path):
    """model.safetensors.index.json over two shards (a layer's experts split across them)."""
    source = CHECKPOINTS / "qwen3_moe"
    target = tmp_path / "sharded"
    target.mkdir()
    for file in ("config.json", "hf_quant_config.json"):
        shutil.copyfile(source / file, target / file)
    tensors = safetensors_torch.load_file(source / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        safetensors_torch.save_file({n: tensors[n] for n in shard_names}, target / shard)
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = export.open_export(target).load_moe_layer(1, device="cpu")
    single = export.open_export(source).load_moe_layer(1, device="cpu")
    for field in ("w13", "w2"):
        assert torch.equal(getattr(sharded, field).b.view(torch.uint8), getattr(single, field).b.view(torch.uint8))
        assert torch.equal(getattr(sharded, field).sfb.view(torch.uint8), getattr(single, field).sfb.view(torch.uint8))
    assert torch.equal(sharded.router_weight, single.router_weight)
    (target / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: names shard model-00002-of-00002"):
        export.open_export(target)


# -----------------------------------------------------------------------------
# Host memory of loading one layer
# -----------------------------------------------------------------------------
MEMORY_PROBE = """
import sys
from nvfp4_group_gemm import export

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

opened = export.open_export(sys.argv[1])
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as handle:  # resets VmHWM, the peak resident set, to now
    handle.write("5")
weights = opened.load_moe_layer(2, device="cpu")
peak = status("VmHWM:") - before
layer_bytes = sum(t.numel() * t.element_size() for p in (weights.w13, weights.w2) for t in (p.b, p.sfb))
print(peak, layer_bytes)
"""


def write_synthetic_export(path: Path, layers=4, experts=32, hidden=1024, intermediate=512) -> int:
    """A Qwen3-MoE-named export of random codes and scales (no quantization needed to count
    bytes); returns the file's bytes."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(experts, hidden, generator=generator)
        for e in range(experts):
            for projection, (n, k) in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)),
                                       ("down_proj", (hidden, intermediate))):
                prefix = f"model.layers.{layer}.mlp.experts.{e}.{projection}."
                tensors[prefix + "weight"] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
                tensors[prefix + "weight_scale"] = torch.randint(0x30, 0x40, (n, k // 16), dtype=torch.uint8,
                                                                 generator=generator).view(torch.float8_e4m3fn)
                tensors[prefix + "weight_scale_2"] = torch.tensor(1e-3)
    safetensors_torch.save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": hidden, "moe_intermediate_size": intermediate,
        "num_experts": experts, "num_experts_per_tok": 8, "norm_topk_prob": True, "num_hidden_layers": layers}))
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    return (path / "model.safetensors").stat().st_size


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_loading_one_layer_holds_about_that_layers_bytes_on_the_host(tmp_path, capsys):
    """The peak resident set (VmHWM from /proc/self/status, reset through /proc/self/clear_refs
    just before, in a fresh interpreter) while one of four 27 MiB layers loads to the CPU: the
    layer's tensors themselves (1x), the file pages read through safetensors' mapping (1x), the
    blocked copy of the scales (0.1x) and one expert's tensor at a time: at most 2.5x the layer's
    bytes + 8 MiB, less than the file (four layers): nothing else is read or stacked on the host."""
    file_bytes = write_synthetic_export(tmp_path)
    done = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    peak, layer_bytes = (int(v) for v in done.stdout.split())
    with capsys.disabled():
        print(f"\n  host peak while loading one layer to the CPU: {peak / 2**20:.1f} MiB = {peak / layer_bytes:.2f} x "
              f"the layer's {layer_bytes / 2**20:.1f} MiB (file {file_bytes / 2**20:.0f} MiB)")
    assert peak <= 2.5 * layer_bytes + (8 << 20)
    assert peak < file_bytes


@needs_checkpoints
def test_the_example_runs_every_layer_of_an_export_within_its_bound(capsys):
    """examples/run_export.py on a CPU: one line per MoE layer, each error within W4A16's bound."""
    import run_export

    assert run_export.main([str(CHECKPOINTS / "deepseek_v3"), "--device", "cpu", "--tokens", "8", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:-1]]
    assert [int(row[0]) for row in rows] == [1] and all(float(row[2]) < W4A16_BOUND for row in rows), lines
    assert lines[-1].startswith("largest relative error") and lines[-1].endswith("(within 1%)")
    assert run_export.main([str(CHECKPOINTS / "mixtral"), "--device", "cpu", "--tokens", "0"]) == 2
