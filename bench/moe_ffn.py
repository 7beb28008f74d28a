"""A whole MoE FFN layer loaded from a ModelOpt NVFP4 export directory
(nvfp4_group_gemm.export, MoeFfn.from_pretrained's path): load time and peak host memory, then
device time in W4A16 (bf16 activations, the default) and W4A4, beside the same layer with bf16
weights on `torch._grouped_mm` and beside triton_kernels' whole MoE layer (bf16 x MXFP4), each
eager and as one CUDA graph replayed, with the layer's memory floor.

    python bench/moe_ffn.py [--tokens 1,4,16,64,256,1024,4096] [--layers qwen3,dsv3_ep8,mixtral]
                            [--repeats 20] [--export-dir DIR] [--json PATH] [--no-triton]
    python bench/moe_ffn.py --profile [--tokens 1,16] [--profile-calls 5] [--json PATH]

Layers (bench/moe_layers.py's), each written as an export directory with the real tensor names,
config.json and hf_quant_config.json, then loaded through open_export / load_moe_layer:
    qwen3      Qwen3-30B-A3B (Qwen3MoeForCausalLM): H 2048, I 768, softmax top-8 of 128 experts,
               renormalized; all local
    dsv3_ep8   DeepSeek-V3 (DeepseekV3ForCausalLM) with 8-way expert parallelism: H 7168, I 2048,
               256 experts in 8 groups, sigmoid scores with a correction bias, best 4 groups,
               top-8, x 2.5, one shared expert; rank 0's 32 experts loaded (experts 0..31: the
               pairs routed elsewhere add nothing here) and the shared expert
    mixtral    Mixtral-8x7B (MixtralForCausalLM, block_sparse_moe.experts.E.w1/w3/w2): H 4096,
               I 14336, softmax top-2 of 8 experts (renormalized); all local

The weights are random bf16 (N(0, 0.02), one seed per expert) quantized by the format's formula
(checkpoint.quantize_nvfp4), written as safetensors shards of 32 experts with
model.safetensors.index.json (the DeepSeek-V3 export: 6.4 GB, Mixtral 0.8 GB). --export-dir keeps
them (a layer whose folder is complete is not written again); without it they go to a temporary
folder, removed at the end. Load: wall time of load_moe_layer to the GPU and MoeFfn's set-up, and
the peak resident host memory above the resident set before it (VmHWM of /proc/self/status, reset
through /proc/self/clear_refs; Linux).

Columns, per layer and token count (one row):
    W4A16         MoeFfn, bf16 activations, SwiGLU unfused (swiglu_epilogue=False), the pairs'
                  sort and weighted sum as torch ops (pair_kernels=False)
    W4A16s        the same with SwiGLU in the gate-and-up GEMM's epilogue
    W4A16k        MoeFfn W4A16 as it runs by default: SwiGLU in the epilogue and the pairs' sort
                  and weighted sum one kernel each (nvfp4_group_gemm.pairs)
    W4A16fr       W4A16k with its weights packed for the fragment (weight_layout="fragment":
                  nvfp4_group_gemm.weight_layout, triton_kernels' Hopper layout for NVFP4)
    W4A4          MoeFfn with NVFP4 activations (activations="nvfp4"), as it runs by default
    bf16          the same bf16 weights (regenerated from the seeds), router, routing,
                  permutation, SwiGLU, un-permute and shared expert as MoeFfn's torch ops; only its
                  two grouped GEMMs differ (`torch._grouped_mm` over the sorted rows; the shared
                  expert a plain matmul)
    triton        triton_kernels' whole layer (TritonFfn below; Triton 3.6's triton_kernels, from
                  .peers/triton_kernels_src, ../shared/peers/triton_kernels_src or installed;
                  without it the column is skipped and the reason printed)
    floor         the layer's memory floor: the NVFP4 bytes (e2m1 codes, e4m3 block scales, fp32
                  global scales) of the experts this call reads / the GPU's HBM bandwidth
                  (hbm_bytes_per_s: 4.8 TB/s on an H200, 3.35 on an H100 SXM).
                  The experts read: the distinct local experts the call's routing hits, plus
                  the shared expert (DeepSeek-V3); router, activations and outputs not counted.
                  Mean over the inputs (each input routes anew), as the times are.
    ratios        ours / floor and ours / triton, on graph replay (device time; eager adds the
                  host's launches)
Activations N(0, 1) bf16, a new routing per input. Each result is checked against the bf16 layer
(relative error printed: the quantization error, not asserted). Timing per (layer, tokens,
implementation): L2 flushed, CUDA events around one eager call, or around one replay of a graph
captured with the layer; mean of --repeats. The eager column times each input's first call
(new activation addresses: the MoE entry's first call of each, its binding made at the second);
the JSON's eager_repeat_us times the same inputs again (a caller whose activations come back at
the same addresses: the bindings made, each a graph replay where the stream is idle).

triton_kernels' layer (what bench_mlp.py and bench/distributed.py's single-GPU `routing` run in
triton_kernels v3.6.0, on one GPU):
    routing   the router's fp32 logits (the same torch GEMM as every column: the expert choice is
              the same, so the outputs compare), then `topk(logits, k, apply_softmax=True)` (its
              fused top-k + softmax over the k: Qwen3's and Mixtral's renormalized softmax), its
              bitmatrix metadata (`mask_metadata`: per-expert counts, dispatch / combine
              indices) and `make_ragged_tensor_metadata`; gammas = the k weights in expert
              order. DeepSeek-V3's grouped sigmoid with its correction bias is not in
              triton_kernels: that layer routes with the same torch ops as MoeFfn
              (nvfp4_group_gemm.routing) and hands the chosen experts to `topk(weights, k,
              apply_softmax=False, y_indx=ids)`, which builds the same metadata from them.
              Expert parallelism (dsv3_ep8): `remap_ragged_tensor_metadata` onto the 32 local
              experts (triton_kernels' ep_sharding path), so the GEMMs skip the other experts'
              row blocks; the pairs routed elsewhere are masked out of the final reduce
              (scatter src index -1) and RoutingData.expected_tokens_per_expt is set to the
              layer's T k / 256 (its tile-size heuristic would otherwise see T k / 32).
    GEMM 1    `matmul_ogs(x, w1, b1, routing, gather_indx=..., fused_activation=SwiGLU)`:
              the rows gathered by expert, gate-and-up with SwiGLU in the epilogue, bf16 out
    GEMM 2    `matmul_ogs(h, w2, None, routing, scatter_indx=..., gammas=...)`: down, each row
              times its routing weight in the epilogue, scattered to (token, slot) rows, then
              its reduce kernel sums each token's k rows (fp32) into bf16 [T, H]
    shared    (DeepSeek-V3) the same two GEMMs dense (w [1, K, N], no routing), added in fp32
    weights   the same bf16 weights quantized by triton_kernels' `downcast_to_mxfp` to MXFP4
              (e2m1, one e8m0 scale per 32 along K: 17/32 byte per weight against NVFP4's 9/16),
              in the Hopper layouts (HopperMXValueLayout, HopperMXScaleLayout with 4 warps up to
              512 tokens, else 8: bench_mlp.py's rule), as bench/moe.py --layers and
              ../shared/peers/bench_triton_kernels_mxfp4.py run them
Where its SwiGLU differs from SiLU(gate) x up (triton_kernels/swiglu_details/_swiglu.py,
`_swiglu_fn` and `compute_swiglu`, the gpt-oss form), and what this layer does about it:
    1. interleaved columns: the fused activation reads GEMM 1's N = 2I columns as pairs, column
       2j the gate and 2j + 1 the up (reshape to [M, I, 2], split); ModelOpt / Hugging Face
       weights are gate rows then up rows. Here: w1's rows are interleaved once at load.
    2. alpha: s = g * sigmoid(alpha * g); SiLU is alpha = 1 (gpt-oss: 1.702). Here: alpha 1.0.
    3. limit: g clamped above at `limit`, up clamped to [-limit, limit] (gpt-oss: 7.0). Here:
       limit = +inf, so both clamps are no-ops (the float-limit code path triton_kernels tests;
       three fp32 min/max per output element remain).
    4. the +1: the result is s * (up + 1) (`tl.fma(s, linear, s)`). Here: GEMM 1's bias (added
       in fp32 before the activation, acc + bias) is 0 on gate columns and -1 on up columns, so
       the result is s * ((up - 1) + 1) = SiLU(gate) * up, with one more fp32 rounding of up.
    Rounding is then as ours: fp32 in the epilogue, rounded to bf16 for the down GEMM.
Other differences that stay: MXFP4 (coarser scales: a larger quantization error, printed) against
NVFP4; the routing weights applied in GEMM 2's epilogue before each pair's row is rounded to bf16
(ours: the k bf16 rows weighted and summed in fp32).

--profile: per layer, token count (default 1 and 16) and implementation, --profile-calls eager
calls under torch.profiler (CPU and CUDA activities), each behind a sleep kernel (the marker that
splits the calls, and the host ahead) and the L2 flush; printed: every device activity of a
layer call in order (kernels, memcpys, memsets) with its device µs (mean over the calls), their
sum, and the span from the first start to the last end. The kernels of a graph replay are the
same.

Exit codes: 0 done; 2 cannot run (no sm_90 GPU, a bad option).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_layers import LAYERS as GEMM_LAYERS
from moe_layers import Layer

FLUSH_BYTES = 256 << 20
LAYERS = {name: GEMM_LAYERS[name] for name in ("qwen3", "dsv3_ep8", "mixtral")}
ARCHITECTURES = {"qwen3": "qwen3_moe", "dsv3_ep8": "deepseek_v3", "mixtral": "mixtral"}
DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
PROFILE_TOKENS = (1, 16)
IMPLEMENTATIONS = ("W4A16", "W4A16s", "W4A16k", "W4A16fr", "W4A4", "bf16", "triton")
EXPERTS_PER_SHARD = 32
# a calibration of N(0, 1) activations: amax about 5
INPUT_SCALE = 5.0 / (6 * 448)
COMPLETE = "bench_export_complete"
HBM_BYTES_PER_S = 4.8e12  # the H200's HBM3e
# HBM bandwidth by device name (NVIDIA's datasheets); another GPU: the H200's, said in the header
HBM_BYTES_PER_S_BY_DEVICE = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 NVL": 3.9e12}


def hbm_bytes_per_s(device_name: str) -> float:
    """The HBM bandwidth the floor divides by, for a device named `device_name`."""
    for name, value in HBM_BYTES_PER_S_BY_DEVICE.items():
        if name in device_name:
            return value
    return HBM_BYTES_PER_S
# triton_kernels' SwiGLU as SiLU(gate) x up (module docstring): alpha 1, no clamp, -1 on up
SWIGLU_ALPHA = 1.0
SWIGLU_LIMIT = float("inf")
PROFILE_SLEEP_CYCLES = 20_000_000  # ~10 ms: the host enqueues a whole eager call behind it
# (the module's family of names, its gate, up and down projections) per architecture
FAMILY = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
          "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
          "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


# -- the export ---------------------------------------------------------------------------------


def expert_weights(layer: Layer, expert: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate rows then up rows [2I, H], down [H, I]) bf16 of one expert (expert = layer.experts:
    the shared expert), N(0, 0.02) from the expert's own seed: the same on every call."""
    generator = torch.Generator(device=device).manual_seed(1000 + expert)
    w13 = torch.randn(2 * layer.intermediate, layer.hidden, generator=generator, device=device) * 0.02
    w2 = torch.randn(layer.hidden, layer.intermediate, generator=generator, device=device) * 0.02
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def export_config(layer: Layer, architecture: str) -> dict:
    """config.json of a one-layer model of `architecture` ("qwen3_moe", "deepseek_v3" or
    "mixtral") with the layer's sizes and routing (ModelOpt's quantization_config included)."""
    common = {"hidden_size": layer.hidden, "num_hidden_layers": 1, "num_experts_per_tok": layer.top_k,
              "hidden_act": "silu",
              "quantization_config": {"quant_algo": "NVFP4", "quant_method": "modelopt",
                                      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float",
                                                                                "group_size": 16}}}}}
    if architecture == "mixtral":  # Mixtral's experts are its MLPs: intermediate_size, num_local_experts
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": layer.experts, "intermediate_size": layer.intermediate, **common}
    common |= {"moe_intermediate_size": layer.intermediate, "norm_topk_prob": True}
    if architecture == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": layer.experts,
                "decoder_sparse_step": 1, "mlp_only_layers": [], **common}
    n_group = min(8, layer.experts)
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "n_routed_experts": layer.experts, "n_shared_experts": 1, "n_group": n_group,
            "topk_group": max(1, n_group // 2), "routed_scaling_factor": 2.5, "first_k_dense_replace": 0,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", **common}


def projection_tensors(prefix: str, weight: torch.Tensor) -> dict:
    """ModelOpt's four tensors of one projection [N, K] (CPU)."""
    from nvfp4_group_gemm import checkpoint

    quantized = checkpoint.quantize_nvfp4(weight[None])
    return {prefix + "weight": quantized.weight[0].cpu(), prefix + "weight_scale": quantized.weight_scale[0].cpu(),
            prefix + "weight_scale_2": quantized.weight_scale_2[0].cpu(),
            prefix + "input_scale": torch.tensor(INPUT_SCALE)}


def write_export(layer: Layer, directory: Path, architecture: str, device) -> Path:
    """The layer as MoE layer 0 of an export directory (module docstring); reused when complete."""
    from safetensors.torch import save_file

    if (directory / COMPLETE).exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = export_config(layer, architecture)
    module, names = FAMILY[architecture]
    prefix = f"model.layers.0.{module}."
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                            "exclude_modules": ["lm_head", prefix + "gate"]}}))
    generator = torch.Generator(device=device).manual_seed(1)
    tensors = {prefix + "gate.weight": (torch.randn(layer.experts, layer.hidden, generator=generator,
                                                    device=device) * 0.05).float().cpu()}
    if architecture == "deepseek_v3":
        tensors[prefix + "gate.e_score_correction_bias"] = (torch.randn(layer.experts, generator=generator,
                                                                        device=device) * 0.1).float().cpu()
        w13, w2 = expert_weights(layer, layer.experts, device)
        for name, weight in zip(names, (*w13.chunk(2), w2)):
            tensors |= projection_tensors(f"{prefix}shared_experts.{name}.", weight)
    weight_map = {}
    shards = -(-layer.experts // EXPERTS_PER_SHARD)
    for shard in range(shards):
        for e in range(shard * EXPERTS_PER_SHARD, min(layer.experts, (shard + 1) * EXPERTS_PER_SHARD)):
            w13, w2 = expert_weights(layer, e, device)
            for name, weight in zip(names, (*w13.chunk(2), w2)):
                tensors |= projection_tensors(f"{prefix}experts.{e}.{name}.", weight)
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, directory / file)
        weight_map |= dict.fromkeys(tensors, file)
        tensors = {}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / COMPLETE).write_text("")
    return directory


def host_status(key: str) -> int | None:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM), None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def load_layer(directory: Path, layer: Layer, device) -> tuple[object, float, int | None]:
    """(the export's MoE layer 0, its local experts 0..layer.local - 1 on `device`; wall seconds
    of the load; peak resident host bytes above the resident set before it, None off Linux)."""
    from nvfp4_group_gemm.export import open_export

    before = host_status("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from now on
    except OSError:
        before = None
    begin = time.perf_counter()
    weights = open_export(directory).load_moe_layer(0, device=device, experts=range(layer.local))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    peak = host_status("VmHWM")
    return weights, seconds, None if before is None or peak is None else peak - before


# -- the bf16 layer -----------------------------------------------------------------------------


class Bf16Ffn:
    """The same layer with bf16 weights: MoeFfn's routing, permutation, un-permute and shared
    expert (borrowed from `moe_ffn`), its two grouped GEMMs on torch._grouped_mm."""

    def __init__(self, moe_ffn, weights: dict):
        self.layer = moe_ffn
        self.w13_t = weights["w13"].transpose(-2, -1)  # [E, H, 2I]: _grouped_mm's (K, N) per group
        self.w2_t = weights["w2"].transpose(-2, -1)
        self.shared = weights.get("shared")  # (w13 [2I, H], w2 [H, I]) or None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        tokens = x.shape[0]
        topk_ids, weights = layer.route(x)
        experts = layer.local_experts(topk_ids.reshape(-1))
        order, token_rows, offsets = layer.sort_by_expert(experts, layer.top_k)
        rows = x[token_rows]
        gate_up = torch._grouped_mm(rows, self.w13_t, offs=offsets[1:])
        gate, up = gate_up[:, :layer.intermediate].float(), gate_up[:, layer.intermediate:].float()
        hidden = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
        down = torch._grouped_mm(hidden, self.w2_t, offs=offsets[1:])
        unsorted = torch.empty_like(down)
        unsorted[order] = down
        unsorted = torch.where((experts < layer.experts)[:, None], unsorted.float(), 0.0)
        out = (unsorted.view(tokens, layer.top_k, layer.hidden) * weights[..., None]).sum(dim=1)
        if self.shared is not None:
            gate, up = (x @ self.shared[0].T).float().chunk(2, dim=-1)
            out = out + (((torch.nn.functional.silu(gate) * up).to(torch.bfloat16)) @ self.shared[1].T).float()
        return out.to(torch.bfloat16)


def bf16_weights(layer: Layer, moe_ffn, device) -> dict:
    """The bf16 weights the export quantized, of the local experts (and the shared expert where
    the layer adds one): {"w13": [E, 2I, H], "w2": [E, H, I], "shared": (w13, w2) or None}."""
    pairs = [expert_weights(layer, e, device) for e in range(layer.local)]
    return {"w13": torch.stack([w13 for w13, _ in pairs]), "w2": torch.stack([w2 for _, w2 in pairs]),
            "shared": expert_weights(layer, layer.experts, device) if moe_ffn.shared is not None else None}


# -- bytes and the floor ------------------------------------------------------------------------


def projection_bytes(projection) -> int:
    """Bytes of one checkpoint.MoeProjection as the entry reads them: e2m1 codes, blocked e4m3
    scales, fp32 global scales (weight_scale_2: [E] or [E, 2])."""
    return sum(t.numel() * t.element_size() for t in (projection.b, projection.sfb, projection.weight_scale_2))


def layer_weight_bytes(moe_ffn) -> int:
    """The NVFP4 weights' bytes (codes, e4m3 scales, fp32 scales) of the local and shared experts."""
    projections = [moe_ffn.w13, moe_ffn.w2] + ([] if moe_ffn.shared is None else list(moe_ffn.shared.values()))
    return sum(projection_bytes(p) for p in projections)


def expert_bytes(moe_ffn) -> tuple[int, int]:
    """(the NVFP4 bytes of one routed expert, of the shared expert: 0 without one)."""
    routed = (projection_bytes(moe_ffn.w13) + projection_bytes(moe_ffn.w2)) // moe_ffn.experts
    shared = 0 if moe_ffn.shared is None else sum(projection_bytes(p) for p in moe_ffn.shared.values())
    return routed, shared


def active_experts(topk_ids: torch.Tensor, first_local: int, local: int) -> int:
    """How many distinct local experts (first_local .. first_local + local - 1) a routing hits."""
    ids = torch.unique(topk_ids.reshape(-1))
    return int(((ids >= first_local) & (ids < first_local + local)).sum())


def floor_us(active: float, routed_bytes: int, shared_bytes: int = 0, bytes_per_s: float = HBM_BYTES_PER_S) -> float:
    """The memory floor of one call, µs: the bytes of `active` routed experts and the shared
    expert read once at `bytes_per_s`."""
    return (active * routed_bytes + shared_bytes) / bytes_per_s * 1e6


def weight_bytes(tensors) -> int:
    """Bytes of a list of tensors, or of a dict's values."""
    tensors = tensors.values() if isinstance(tensors, dict) else tensors
    return sum(t.numel() * t.element_size() for t in tensors)


# -- triton_kernels' layer ----------------------------------------------------------------------


def triton_sources() -> list[Path]:
    """Where triton_kernels' source may be: copied beside the checkout (.peers/, what the device
    machine gets), or ../shared/peers beside the repository."""
    return [ROOT / ".peers" / "triton_kernels_src", ROOT.parent / "shared" / "peers" / "triton_kernels_src"]


def load_triton_kernels() -> tuple[types.SimpleNamespace | None, str]:
    """(the triton_kernels names this layer uses, where they came from) or (None, why not): the
    first of triton_sources() that exists goes on sys.path, else an installed triton_kernels."""
    source = next((path for path in triton_sources() if path.is_dir()), None)
    if source is not None and str(source) not in sys.path:
        sys.path.insert(0, str(source))
    try:
        import triton
        import triton_kernels
        from triton_kernels.matmul_ogs import (
            FnSpecs,
            FusedActivation,
            GatherIndx,
            PrecisionConfig,
            RoutingData,
            ScatterIndx,
            matmul_ogs,
        )
        from triton_kernels.numerics_details.mxfp import downcast_to_mxfp
        from triton_kernels.swiglu import swiglu_fn
        from triton_kernels.tensor import (
            FP4,
            convert_layout,
            make_ragged_tensor_metadata,
            remap_ragged_tensor_metadata,
            wrap_torch_tensor,
        )
        from triton_kernels.tensor_details import layout
        from triton_kernels.topk import topk
    except Exception as error:  # noqa: BLE001 - the peer is optional: any failure to import says why
        return None, f"cannot import triton_kernels ({type(error).__name__}: {error})"
    origin = Path(triton_kernels.__file__).resolve().parent
    commit = origin.parent / "COMMIT"
    where = f"triton {triton.__version__}, triton_kernels from {origin}" + (
        f" ({commit.read_text().strip()})" if commit.exists() else "")
    names = types.SimpleNamespace(
        FnSpecs=FnSpecs, FusedActivation=FusedActivation, GatherIndx=GatherIndx, PrecisionConfig=PrecisionConfig,
        RoutingData=RoutingData, ScatterIndx=ScatterIndx, matmul_ogs=matmul_ogs, downcast_to_mxfp=downcast_to_mxfp,
        swiglu_fn=swiglu_fn, FP4=FP4, convert_layout=convert_layout,
        make_ragged_tensor_metadata=make_ragged_tensor_metadata,
        remap_ragged_tensor_metadata=remap_ragged_tensor_metadata, wrap_torch_tensor=wrap_torch_tensor,
        layout=layout, topk=topk)
    return names, where


def triton_peer(disabled: bool) -> tuple[types.SimpleNamespace | None, str]:
    """(triton_kernels' names or None, where they came from or why not), the line printed."""
    tk, where = (None, "--no-triton") if disabled else load_triton_kernels()
    print(f"triton_kernels: {where}" if tk is not None else f"triton_kernels: column skipped: {where}", flush=True)
    return tk, where


def interleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """[..., 2I, K] gate rows then up rows -> rows gate_0, up_0, gate_1, up_1, ... (triton_kernels'
    fused SwiGLU reads GEMM 1's output columns as (gate, up) pairs)."""
    gate, up = w13.chunk(2, dim=-2)
    return torch.stack((gate, up), dim=-2).flatten(-3, -2)


def swiglu_bias(experts: int, intermediate: int, device) -> torch.Tensor:
    """GEMM 1's fp32 bias [E, 2I] on interleaved columns: 0 on gate columns, -1 on up columns
    (cancels the + 1 of triton_kernels' s * (up + 1))."""
    bias = torch.zeros(experts, intermediate, 2, dtype=torch.float32, device=device)
    bias[..., 1] = -1.0
    return bias.flatten(-2)


def triton_swiglu(acc: torch.Tensor, alpha: float, limit: float | None) -> torch.Tensor:
    """triton_kernels' fused SwiGLU on GEMM 1's fp32 output (bias added) [M, 2I] -> [M, I], as
    `_swiglu_fn` / `compute_swiglu` (triton_kernels/swiglu_details/_swiglu.py, v3.6.0) compute
    it: pairs of columns (gate, up); gate clamped above at limit, up to [-limit, limit];
    s = gate * sigmoid(alpha * gate); s * up + s. Torch ops: what the test checks the weights'
    preparation against."""
    pairs = acc.float().reshape(*acc.shape[:-1], acc.shape[-1] // 2, 2)
    gate, up = pairs[..., 0], pairs[..., 1]
    if limit is not None:
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
    s = gate / (1 + torch.exp(-alpha * gate))
    return s * up + s


def local_slice_map(experts: int, first_local: int, local: int, device="cpu") -> torch.Tensor:
    """remap_ragged_tensor_metadata's slice map: int32 [E_all], expert g -> its local index
    g - first_local where it is local, else -1."""
    ids = torch.arange(experts, dtype=torch.int32, device=device)
    return torch.where((ids >= first_local) & (ids < first_local + local), ids - first_local, -1).to(torch.int32)


class TritonFfn:
    """triton_kernels' whole MoE layer on the bf16 weights of `weights` quantized to MXFP4, with
    MoeFfn `moe_ffn`'s router, routing and expert split (module docstring)."""

    def __init__(self, tk: types.SimpleNamespace, moe_ffn, weights: dict):
        self.tk = tk
        self.layer = moe_ffn
        device = weights["w13"].device
        experts, intermediate = moe_ffn.experts, moe_ffn.intermediate
        self.w1 = self.mxfp4(interleave_gate_up(weights["w13"]))
        self.w2 = self.mxfp4(weights["w2"])
        self.b1 = swiglu_bias(experts, intermediate, device)
        self.activation = tk.FusedActivation(tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                                             (SWIGLU_ALPHA, SWIGLU_LIMIT))
        self.all_experts = moe_ffn.router_weight.shape[0]
        self.slice_map = None
        if experts < self.all_experts:  # expert parallelism: this GPU's experts only
            self.slice_map = local_slice_map(self.all_experts, moe_ffn.first_local, experts, device)
        self.shared = None
        if weights.get("shared") is not None:
            w13, w2 = weights["shared"]
            self.shared = (self.mxfp4(interleave_gate_up(w13)[None]), self.mxfp4(w2[None]),
                           swiglu_bias(1, w2.shape[1], device))

    def mxfp4(self, weight: torch.Tensor) -> tuple:
        """bf16 [G, N, K] -> (MXFP4 values in the Hopper layout as w [G, K, N], {num_warps: scales
        in the Hopper scale layout of 4 and of 8 warps})."""
        tk = self.tk
        codes, scales = tk.downcast_to_mxfp(weight.transpose(-2, -1), torch.uint8, axis=1)
        value_layout, value_options = tk.layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        values = tk.convert_layout(tk.wrap_torch_tensor(codes, dtype=tk.FP4), value_layout, **value_options)
        by_warps = {}
        for warps in (4, 8):
            scale_layout, scale_options = tk.layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1,
                                                                                               num_warps=warps)
            by_warps[warps] = tk.convert_layout(tk.wrap_torch_tensor(scales), scale_layout, **scale_options)
        return values, by_warps

    def precision(self, weight: tuple, tokens: int):
        warps = 4 if tokens <= 512 else 8  # bench_mlp.py's rule
        return self.tk.PrecisionConfig(weight_scale=weight[1][warps], out_dtype=torch.bfloat16)

    def weight_bytes(self) -> int:
        """The MXFP4 bytes (codes and e8m0 scales; one scale layout) of the local and shared experts."""
        weights = [self.w1, self.w2] + ([] if self.shared is None else list(self.shared[:2]))
        return sum(t.storage.data.numel() * t.storage.data.element_size() for values, scales in weights
                   for t in (values, scales[4]))

    def route(self, x: torch.Tensor):
        """triton_kernels' routing of x: (its top-k SparseMatrix, RoutingData, GatherIndx, ScatterIndx)."""
        tk, layer = self.tk, self.layer
        tokens, k = x.shape[0], layer.top_k
        logits = x.float() @ layer.router_weight.T
        if layer.routing.scoring == "softmax":
            sparse = tk.topk(logits, k, apply_softmax=True)
        else:  # DeepSeek-V3's grouped sigmoid (not in triton_kernels): its choice into triton's metadata
            from nvfp4_group_gemm.routing import route

            ids, weights = route(logits, layer.routing, layer.e_score_correction_bias)
            dense = torch.zeros_like(logits).scatter_(1, ids, weights)
            sparse = tk.topk(dense, k, apply_softmax=False, y_indx=ids.to(torch.int16))
        dispatch = sparse.mask_metadata.row_sorted_indx  # (token, slot) pair -> its row in expert order
        combine = sparse.mask_metadata.col_sorted_indx  # row in expert order -> its pair
        ragged = tk.make_ragged_tensor_metadata(sparse.mask_metadata.col_sum, tokens * k)
        scatter_source, expected = dispatch, None
        if self.slice_map is not None:
            ragged = tk.remap_ragged_tensor_metadata(ragged, self.slice_map)
            first = layer.first_local
            ids = sparse.indx.reshape(-1)
            local = (ids >= first) & (ids < first + layer.experts)
            scatter_source = torch.where(local, dispatch, -1)  # pairs routed elsewhere: out of the reduce
            expected = max(1, tokens * k // self.all_experts)
        gammas = sparse.vals.reshape(-1)[combine]
        routing = tk.RoutingData(gammas, ragged.slice_sizes, layer.experts, k, ragged,
                                 expected_tokens_per_expt=expected)
        return sparse, routing, tk.GatherIndx(combine, dispatch), tk.ScatterIndx(scatter_source, combine)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tk = self.tk
        tokens = x.shape[0]
        _, routing, gather, scatter = self.route(x)
        hidden = tk.matmul_ogs(x, self.w1[0], self.b1, routing, gather_indx=gather,
                               precision_config=self.precision(self.w1, tokens), fused_activation=self.activation)
        out = tk.matmul_ogs(hidden, self.w2[0], None, routing, scatter_indx=scatter,
                            precision_config=self.precision(self.w2, tokens), gammas=routing.gate_scal)
        if self.shared is not None:
            w1, w2, b1 = self.shared
            hidden = tk.matmul_ogs(x, w1[0], b1, precision_config=self.precision(w1, tokens),
                                   fused_activation=self.activation)
            shared = tk.matmul_ogs(hidden, w2[0], None, precision_config=self.precision(w2, tokens))
            out = (out.float() + shared.float()).to(torch.bfloat16)
        return out


# -- timing -------------------------------------------------------------------------------------


def time_us(fn, inputs: list[torch.Tensor], static_x: torch.Tensor, flush: torch.Tensor, graph) -> float:
    """Mean device µs of one call (eager: fn(x); graph: its replay with x copied into static_x
    before the timed region), the L2 flushed before each."""
    times = []
    for x in inputs:
        if graph is not None:
            static_x.copy_(x)
        flush.add_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is None:
            fn(x)
        else:
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sum(times) / len(times)


def time_implementation(fn, inputs: list[torch.Tensor], reference: torch.Tensor, flush: torch.Tensor) -> dict:
    """{error_vs_bf16, eager_us, graph_us} of one implementation on the inputs; a failure (eager,
    or the graph's capture) is recorded as its message."""
    row = {}
    try:
        out = fn(inputs[0]).float()  # compiles, plans, binds
        row["error_vs_bf16"] = float((out - reference).norm() / reference.norm().clamp_min(1e-30))
        row["eager_us"] = time_us(fn, inputs, None, flush, None)
        time_us(fn, inputs, None, flush, None)  # each input's second call: the entry's bindings made
        row["eager_repeat_us"] = time_us(fn, inputs, None, flush, None)
    except Exception as error:  # noqa: BLE001 - a column that fails is reported, the run goes on
        row["error"] = f"eager: {type(error).__name__}: {error}"[:300]
        settle()
        return row
    try:
        static_x = inputs[0].clone()
        fn(static_x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(static_x)
        row["graph_us"] = time_us(fn, inputs, static_x, flush, graph)
        del graph
    except Exception as error:  # noqa: BLE001
        row["error"] = f"graph: {type(error).__name__}: {error}"[:300]
        settle()
    return row


def settle() -> None:
    """After a failed call: wait for the device, reporting (not raising) an error it left."""
    try:
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001
        print(f"    (synchronize after the failure: {type(error).__name__}: {error})"[:300], flush=True)


def build_layer(layer: Layer, directory: Path, tk) -> tuple[dict, dict]:
    """(the implementations by column name, the load record) of one layer's export."""
    from nvfp4_group_gemm import moe_layer

    weights, load_s, peak = load_layer(directory, layer, "cuda")
    implementations = {"W4A16": moe_layer.MoeFfn.from_weights(weights, "bf16", swiglu_epilogue=False),
                       "W4A16s": moe_layer.MoeFfn.from_weights(weights, "bf16"),
                       "W4A16k": moe_layer.MoeFfn.from_weights(weights, "bf16"),
                       "W4A16fr": moe_layer.MoeFfn.from_weights(weights, "bf16", weight_layout="fragment"),
                       "W4A4": moe_layer.MoeFfn.from_weights(weights, "nvfp4")}
    for name in ("W4A16", "W4A16s"):  # the torch ops around the GEMMs, as before the pair kernels
        implementations[name].pair_kernels = False
    bf16 = bf16_weights(layer, implementations["W4A16"], "cuda")
    implementations["bf16"] = Bf16Ffn(implementations["W4A16"], bf16)
    memory = {"W4A16": layer_weight_bytes(implementations["W4A16"]),
              "bf16": weight_bytes([bf16["w13"], bf16["w2"], *(bf16["shared"] or ())])}
    memory["W4A4"] = memory["W4A16"]
    # the same bytes: w13's rows in the epilogue's order, the fragment's bytes in its order
    memory["W4A16s"] = memory["W4A16k"] = memory["W4A16fr"] = memory["W4A16"]
    load = {"layer": layer.name, "load_s": load_s, "host_peak_bytes": peak, "weight_bytes": memory}
    if tk is not None:
        try:
            implementations["triton"] = TritonFfn(tk, implementations["W4A16"], bf16)
            memory["triton"] = implementations["triton"].weight_bytes()
        except Exception as error:  # noqa: BLE001 - the peer's set-up failing leaves ours to run
            load["triton_error"] = f"{type(error).__name__}: {error}"[:300]
            print(f"{layer.name}: triton_kernels layer not built: {load['triton_error']}", flush=True)
    return implementations, load


def layer_inputs(layer: Layer, tokens: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    return [torch.randn(tokens, layer.hidden, device="cuda", generator=generator).to(torch.bfloat16)
            for _ in range(count)]


def run_layer(layer: Layer, directory: Path, tokens_list: list[int], repeats: int, flush: torch.Tensor, tk,
              on_cell=None, skip: tuple = ()) -> dict:
    implementations, load = build_layer(layer, directory, tk)
    print_load(load)
    ours = implementations["W4A16"]
    routed_bytes, shared_bytes = expert_bytes(ours)
    print_header()
    rows = []
    for tokens in tokens_list:
        inputs = layer_inputs(layer, tokens, repeats)
        active = [active_experts(ours.route(x)[0], ours.first_local, ours.experts) for x in inputs]
        mean_active = sum(active) / len(active)
        cell = {"layer": layer.name, "tokens": tokens, "active_experts": mean_active,
                "floor_us": sum(floor_us(a, routed_bytes, shared_bytes, hbm_bytes_per_s(torch.cuda.get_device_name()))
                                for a in active) / len(active)}
        reference = implementations["bf16"](inputs[0]).float()
        for name, fn in implementations.items():
            if name not in skip:  # --skip: a column left out (printed "-")
                cell[name] = time_implementation(fn, inputs, reference, flush)
        rows.append(cell)
        print_cell(cell)
        if on_cell is not None:
            on_cell(load, rows)
    return {"load": load, "routed_expert_bytes": routed_bytes, "shared_expert_bytes": shared_bytes, "cells": rows}


def print_load(load: dict) -> None:
    peak = "n/a" if load["host_peak_bytes"] is None else f"{load['host_peak_bytes'] / 2**20:.0f} MiB"
    memory = load["weight_bytes"]
    triton = f", {memory['triton'] / 2**30:.2f} GiB MXFP4 (triton_kernels)" if "triton" in memory else ""
    print(f"{load['layer']}: loaded in {load['load_s']:.2f} s, host peak {peak}; expert weights "
          f"{memory['W4A16'] / 2**30:.2f} GiB NVFP4 (codes, e4m3 scales, fp32 scales), "
          f"{memory['bf16'] / 2**30:.2f} GiB bf16{triton}", flush=True)


def print_header() -> None:
    print("per row: experts read (mean), floor µs | eager, graph µs of W4A16 (unfused), W4A16s (SwiGLU fused), "
          "W4A16k (and the pair kernels: the default), W4A16fr (and fragment-packed weights), W4A4, bf16, triton_kernels | W4A16k and W4A4 over the floor | "
          "over triton | relative error vs bf16 of W4A16k, W4A4, triton", flush=True)
    print(f"{'layer':<9}{'tokens':>6}{'exp':>6}{'floor':>8} |{'W4A16':>8}{'graph':>9} |{'W4A16s':>8}{'graph':>9} |"
          f"{'W4A16k':>8}{'graph':>9} |{'W4A16fr':>8}{'graph':>9} |"
          f"{'W4A4':>8}{'graph':>9} |"
          f"{'bf16':>8}{'graph':>9} |{'triton':>8}{'graph':>9} |{'/floor 16':>10}{'4':>6} |{'/triton 16':>11}"
          f"{'4':>6} |{'err 16':>7}{'4':>7}{'tk':>7}", flush=True)


def print_cell(cell: dict) -> None:
    def us(name, key):
        value = cell.get(name, {}).get(key)
        return f"{value:>8.1f}" if value is not None else f"{'-':>8}"

    def ratio(top, bottom):
        return f"{top / bottom:.2f}" if top and bottom else "-"

    parts = [f"{cell['layer']:<9}{cell['tokens']:>6}{cell['active_experts']:>6.1f}{cell['floor_us']:>8.1f} |"]
    for name in IMPLEMENTATIONS:
        parts.append(f"{us(name, 'eager_us')} {us(name, 'graph_us')} |")
    graph = {name: cell.get(name, {}).get("graph_us") for name in IMPLEMENTATIONS}
    parts.append(f"{ratio(graph['W4A16k'], cell['floor_us']):>10}{ratio(graph['W4A4'], cell['floor_us']):>6} |")
    parts.append(f"{ratio(graph['W4A16k'], graph['triton']):>11}{ratio(graph['W4A4'], graph['triton']):>6} |")
    errors = [cell.get(name, {}).get("error_vs_bf16") for name in ("W4A16k", "W4A4", "triton")]
    parts.append("".join(f"{e:>7.3f}" if e is not None else f"{'-':>7}" for e in errors))
    print("".join(parts), flush=True)
    again = [f"{name} {cell[name]['eager_repeat_us']:.1f}" for name in IMPLEMENTATIONS
             if cell.get(name, {}).get("eager_repeat_us") is not None]
    if again:
        print(f"    eager, the same inputs again: {', '.join(again)}", flush=True)
    for name in IMPLEMENTATIONS:
        if "error" in cell.get(name, {}):
            print(f"    {name} FAILED: {cell[name]['error']}", flush=True)


# -- the profile --------------------------------------------------------------------------------


def device_activities(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every device activity torch.profiler recorded, by start."""
    activities = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        activities.append((event.name, event.time_range.start, event.time_range.end - event.time_range.start))
    return sorted(activities, key=lambda a: a[1])


def split_calls(activities: list[tuple[str, float, float]]) -> list[list[tuple[str, float, float]]]:
    """The layer calls of a profiled run whose activities (by start) are, per call, a marker kernel
    (the run's first activity: the sleep), the L2 flush (the activity after each marker), then
    the call's own activities up to the next marker."""
    if not activities:
        raise ValueError("split_calls: no device activity recorded (is the profiler seeing CUDA?)")
    marker = activities[0][0]
    calls, after_marker = [], False
    for activity in activities:
        if activity[0] == marker:
            calls.append([])
            after_marker = True
        elif after_marker:  # the flush
            after_marker = False
        else:
            calls[-1].append(activity)
    return calls


def summarize_calls(calls: list[list[tuple[str, float, float]]]) -> dict:
    """Per layer call: its activities in order with their mean device µs where every call ran the
    same sequence (else per name: mean µs and launches per call), the mean sum and the mean span."""
    count = len(calls)
    sequences = {tuple(name for name, _, _ in call) for call in calls}
    if len(sequences) == 1:
        kernels = [{"name": name, "us": sum(call[i][2] for call in calls) / count, "launches": 1}
                   for i, name in enumerate(next(iter(sequences)))]
    else:
        by_name: dict[str, list[float]] = {}
        for call in calls:
            for name, _, duration in call:
                by_name.setdefault(name, []).append(duration)
        kernels = [{"name": name, "us": sum(durations) / count, "launches": len(durations) / count}
                   for name, durations in by_name.items()]
    spans = [max(s + d for _, s, d in call) - min(s for _, s, _ in call) for call in calls if call]
    return {"calls": count, "same_sequence": len(sequences) == 1, "kernels": kernels,
            "sum_us": sum(sum(d for _, _, d in call) for call in calls) / count,
            "span_us": sum(spans) / len(spans) if spans else 0.0}


def profile_calls(fn, inputs: list[torch.Tensor], flush: torch.Tensor) -> dict:
    """summarize_calls of len(inputs) eager calls of fn under torch.profiler (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    fn(inputs[0])  # compiles, plans, binds
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x in inputs:
            torch.cuda._sleep(PROFILE_SLEEP_CYCLES)
            flush.add_(1)
            fn(x)
        torch.cuda.synchronize()
    return summarize_calls(split_calls(device_activities(prof)))


def print_profile(layer: str, tokens: int, name: str, summary: dict) -> None:
    order = "in order" if summary["same_sequence"] else "by name (the calls' sequences differ)"
    print(f"== {layer}, {tokens} tokens, {name}: {len(summary['kernels'])} device activities per call {order}; "
          f"sum {summary['sum_us']:.1f} µs, span {summary['span_us']:.1f} µs (mean of {summary['calls']} calls)",
          flush=True)
    for kernel in summary["kernels"]:
        launches = "" if kernel["launches"] == 1 else f" x{kernel['launches']:.2f}"
        text = kernel["name"] if len(kernel["name"]) <= 120 else kernel["name"][:117] + "..."
        print(f"  {kernel['us']:>9.1f}  {text}{launches}", flush=True)


def profile_layer(layer: Layer, directory: Path, tokens_list: list[int], calls: int, flush: torch.Tensor,
                  tk) -> list[dict]:
    implementations, load = build_layer(layer, directory, tk)
    print_load(load)
    results = []
    for tokens in tokens_list:
        inputs = layer_inputs(layer, tokens, calls)
        for name, fn in implementations.items():
            try:
                summary = profile_calls(fn, inputs, flush)
            except Exception as error:  # noqa: BLE001 - report and go on
                settle()
                print(f"== {layer.name}, {tokens} tokens, {name}: FAILED: {type(error).__name__}: {error}"[:400],
                      flush=True)
                results.append({"layer": layer.name, "tokens": tokens, "implementation": name,
                                "error": f"{type(error).__name__}: {error}"[:300]})
                continue
            print_profile(layer.name, tokens, name, summary)
            results.append({"layer": layer.name, "tokens": tokens, "implementation": name, **summary})
    return results


# -- main ---------------------------------------------------------------------------------------


def token_list(text: str) -> list[int]:
    """Comma-separated positive token counts."""
    counts = [int(part) for part in text.split(",")]
    if not counts or min(counts) < 1:
        raise ValueError(text)
    return counts


token_list.__name__ = "token list (positive integers, e.g. 1,16)"  # argparse names the type in its message


def parse_options(argv=None) -> argparse.Namespace:
    """The options (module docstring); `layers` and `tokens` as lists. A bad option: ValueError
    (a layer this bench does not have) or argparse's SystemExit(2)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=token_list, default=None,
                        help=f"token counts (default {','.join(map(str, DEFAULT_TOKENS))}; --profile: "
                        f"{','.join(map(str, PROFILE_TOKENS))})")
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"a subset of {', '.join(LAYERS)}")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--export-dir", default=None, help="where the exports are written and kept (default: a "
                        "temporary folder, removed at the end)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-triton", action="store_true", help="skip triton_kernels' layer")
    parser.add_argument("--skip", type=lambda v: [x for x in v.split(",") if x], default=[],
                        help=f"columns not timed (of {', '.join(IMPLEMENTATIONS)}; bf16 is the error reference)")
    parser.add_argument("--profile", action="store_true", help="every device activity of a layer call, with its "
                        "µs (torch.profiler), instead of the timing table")
    parser.add_argument("--profile-calls", type=int, default=5, help="calls profiled per layer, token count and "
                        "implementation")
    args = parser.parse_args(argv)
    args.layers = args.layers.split(",")
    unknown = [name for name in args.layers if name not in LAYERS]
    if unknown:
        raise ValueError(f"unknown layers {unknown}: choose from {', '.join(LAYERS)}")
    if set(args.skip) - set(IMPLEMENTATIONS):
        raise ValueError(f"--skip {','.join(args.skip)}: choose from {', '.join(IMPLEMENTATIONS)}")
    if args.tokens is None:
        args.tokens = list(PROFILE_TOKENS if args.profile else DEFAULT_TOKENS)
    if args.repeats < 1 or args.profile_calls < 1:
        raise ValueError(f"--repeats {args.repeats}, --profile-calls {args.profile_calls}: must be >= 1")
    return args


def main(argv=None) -> int:
    try:
        args = parse_options(argv)
    except ValueError as error:
        print(f"bench/moe_ffn.py: {error}", file=sys.stderr)
        return 2
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("bench/moe_ffn.py needs an sm_90 (Hopper) GPU: the MoE entry runs there", file=sys.stderr)
        return 2
    begin_run = time.perf_counter()
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    root = Path(args.export_dir) if args.export_dir else Path(tempfile.mkdtemp(prefix="moe_ffn_exports_"))
    what = (f"device activities of {args.profile_calls} eager calls (torch.profiler)" if args.profile else
            f"µs per layer call, mean of {args.repeats} (L2 flushed), eager and graph replay; floor = the read "
            f"experts' NVFP4 bytes / {hbm_bytes_per_s(torch.cuda.get_device_name()) / 1e12:.2f} TB/s; ratios on graph replay")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; exports in {root}; {what}", flush=True)
    tk, where = triton_peer(args.no_triton)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton_kernels": where if tk is not None else f"skipped: {where}",
              "hbm_bytes_per_s": hbm_bytes_per_s(torch.cuda.get_device_name()), "repeats": args.repeats, "layers": [], "profile": []}

    def save(*_):
        if args.json:  # after every cell: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(report, indent=1))

    try:
        for name in args.layers:
            layer = LAYERS[name]
            begin = time.perf_counter()
            directory = write_export(layer, root / name, ARCHITECTURES[name], "cuda")
            print(f"{name}: export {directory} ready in {time.perf_counter() - begin:.1f} s", flush=True)
            begin = time.perf_counter()
            if args.profile:
                report["profile"] += profile_layer(layer, directory, args.tokens, args.profile_calls, flush, tk)
            else:
                result = {"load": None, "cells": []}
                report["layers"].append(result)

                def on_cell(load, rows, result=result):
                    result.update(load=load, cells=rows)
                    save()

                result.update(run_layer(layer, directory, args.tokens, args.repeats, flush, tk, on_cell,
                                        tuple(args.skip)))
            save()
            print(f"{name}: {time.perf_counter() - begin:.1f} s", flush=True)
            torch.cuda.empty_cache()
    finally:
        if not args.export_dir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"done in {time.perf_counter() - begin_run:.1f} s", flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
