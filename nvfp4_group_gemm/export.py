"""A NVIDIA ModelOpt NVFP4 export directory (the unified Hugging Face format vLLM, SGLang and
TensorRT-LLM load), read one MoE layer at a time.

    export = open_export(path)                # config.json, hf_quant_config.json, the tensor names
    export.architecture, export.moe_layers, export.num_experts
    weights = export.load_moe_layer(layer, device="cuda", experts=range(0, 32))

The directory holds `config.json`, `hf_quant_config.json` (or `config.json`'s
`quantization_config`: quant_algo NVFP4, group_size 16) and `model.safetensors` (or shards
listed by `model.safetensors.index.json`). Per MoE layer L, expert E, projection P:

    model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.P     (Qwen3-MoE, DeepSeek-V3)
    model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.P           (Mixtral: gate, up, down)
    P: weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 fp32 scalar,
       input_scale fp32 scalar (optional: W4A16 only without it)

and the router `...mlp.gate.weight` / `...block_sparse_moe.gate.weight` [E, H] (unquantized),
DeepSeek-V3's `...mlp.gate.e_score_correction_bias` [E] and shared expert
`...mlp.shared_experts.{gate_proj,up_proj,down_proj}.P` (NVFP4 as the routed ones).

Loading reads each tensor lazily (safetensors.safe_open: the header, then one tensor at a time)
into the layer's stacked tensors, allocated once on the requested device: gate rows then up rows
as the fused w13 weight (N = 2 I), down as w2, converted by checkpoint.load_projection (blocked
scales, alpha). The host holds one expert's tensor at a time beyond the file's mapped pages;
`experts` selects a range of the experts (an expert-parallel rank's). Every failure is a
ValueError naming the file or tensor, what it holds and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from . import checkpoint
from .routing import Routing

QUANT_ALGO = "NVFP4"
GROUP_SIZE = checkpoint.BLOCK
# (the MLP module's name, the gate, up and down projections' names) of each naming family
FAMILIES = (("mlp", ("gate_proj", "up_proj", "down_proj")), ("block_sparse_moe", ("w1", "w3", "w2")))
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.")
# config.json's name for the routed experts' count, by family of configs
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


@dataclasses.dataclass
class MoeLayerWeights:
    """One MoE layer of an export, on one device: the selected experts as the entry's operands,
    the router over all experts, and how the layer routes."""

    layer: int
    w13: checkpoint.MoeProjection  # gate rows then up rows, [E_sel, 2I, H/2]
    w2: checkpoint.MoeProjection  # down, [E_sel, H, I/2]
    router_weight: torch.Tensor  # fp32 [E_all, H]
    e_score_correction_bias: torch.Tensor | None  # fp32 [E_all] (DeepSeek-V3), else None
    shared: dict[str, checkpoint.MoeProjection] | None  # {"w13", "w2"} of the shared expert(s), one group
    first_expert: int  # w13/w2's group g is expert first_expert + g
    routing: Routing

    @property
    def num_experts(self) -> int:
        """Every routed expert of the layer (the router's rows)."""
        return self.router_weight.shape[0]


def _fail(where: str, what: str) -> ValueError:
    return ValueError(f"{where}: {what}")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise _fail(str(path), f"not JSON ({error})") from None


def check_quantization(directory: Path, config: dict) -> None:
    """hf_quant_config.json's `quantization` and config.json's `quantization_config` (each where
    present, one at least): quant_algo NVFP4, group size 16."""
    found = []
    hf_quant = directory / "hf_quant_config.json"
    if hf_quant.exists():
        section = _read_json(hf_quant).get("quantization", {})
        found.append((str(hf_quant), section.get("quant_algo"), section.get("group_size")))
    if "quantization_config" in config:
        section = config["quantization_config"]
        sizes = {group.get("weights", {}).get("group_size")
                 for group in section.get("config_groups", {}).values()} or {section.get("group_size")}
        group_size = sizes.pop() if len(sizes) == 1 else sorted(sizes, key=str)
        found.append((f"{directory / 'config.json'} quantization_config", section.get("quant_algo"), group_size))
    if not found:
        raise _fail(str(directory), "no hf_quant_config.json and no quantization_config in config.json: not a "
                    "ModelOpt export (expected quant_algo NVFP4, group_size 16)")
    for where, algo, group_size in found:
        if algo != QUANT_ALGO or group_size != GROUP_SIZE:
            raise _fail(where, f"quant_algo = {algo!r}, group_size = {group_size!r}: expected quant_algo "
                        f"{QUANT_ALGO!r}, group_size {GROUP_SIZE} (ModelOpt NVFP4)")


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Every tensor's name -> the safetensors file holding it (headers only: nothing is read)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise _fail(str(index), "no weight_map (tensor name -> shard file)")
        files = {name: directory / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.exists():
                raise _fail(str(index), f"names shard {shard.name}, which is missing")
        return files
    single = directory / "model.safetensors"
    if not single.exists():
        raise _fail(str(directory), "no model.safetensors and no model.safetensors.index.json")
    with safe_open(single, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


class Export:
    """An opened export directory (module docstring): its config, the names of its tensors, and
    load_moe_layer."""

    def __init__(self, path):
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.exists():
            raise _fail(str(self.path), "no config.json")
        self.config = _read_json(config_path)
        check_quantization(self.path, self.config)
        self.architecture = (self.config.get("architectures") or ["(none)"])[0]
        self.routing = Routing.from_config(self.config)
        count_key = next((key for key in EXPERT_COUNT_KEYS if self.config.get(key)), None)
        if count_key is None:
            raise _fail(str(config_path), f"no expert count (one of {', '.join(EXPERT_COUNT_KEYS)})")
        self.num_experts = int(self.config[count_key])
        self._count_key = count_key
        self.hidden = int(self.config["hidden_size"])
        self.intermediate = int(self.config.get("moe_intermediate_size") or self.config["intermediate_size"])
        self._files = _tensor_files(self.path)
        experts_by_layer: dict[int, set] = {}
        self._family: dict[int, str] = {}
        for name in self._files:
            match = _EXPERT_NAME.match(name)
            if match:
                layer = int(match.group(1))
                experts_by_layer.setdefault(layer, set()).add(int(match.group(3)))
                self._family[layer] = match.group(2)
        self._experts_by_layer = experts_by_layer
        self.moe_layers = sorted(experts_by_layer)

    def __repr__(self):
        return (f"Export({str(self.path)!r}: {self.architecture}, MoE layers {self.moe_layers}, "
                f"{self.num_experts} experts, {self.routing})")

    def load_moe_layer(self, layer: int, device="cuda", experts: range | None = None) -> MoeLayerWeights:
        """MoE layer `layer`'s experts (all, or the range `experts`: an expert-parallel rank's),
        router, correction bias and shared expert on `device`, read lazily (module docstring)."""
        from safetensors import safe_open

        if layer not in self._experts_by_layer:
            raise _fail(str(self.path), f"layer {layer} has no experts (no model.layers.{layer}.mlp.experts.* or "
                        f"model.layers.{layer}.block_sparse_moe.experts.* tensors); MoE layers: {self.moe_layers}")
        found = sorted(self._experts_by_layer[layer])
        if found != list(range(self.num_experts)):
            raise _fail(str(self.path), f"layer {layer} has experts {_span(found)} ({len(found)}): config.json's "
                        f"{self._count_key} = {self.num_experts} says experts 0..{self.num_experts - 1}")
        experts = range(self.num_experts) if experts is None else experts
        if not isinstance(experts, range) or experts.step != 1 or not 0 <= experts.start < experts.stop <= self.num_experts:
            raise ValueError(f"load_moe_layer: experts = {experts!r}: must be a range of step 1 within "
                             f"range(0, {self.num_experts})")
        device = torch.device(device)
        family = self._family[layer]
        prefix = f"model.layers.{layer}.{family}."
        handles = {}
        try:
            reader = _Reader(self.path, self._files, handles, safe_open)
            names = dict(FAMILIES)[family]
            expert_prefixes = [f"{prefix}experts.{e}." for e in experts]
            w13, w2 = _load_experts(reader, expert_prefixes, names, self.hidden, self.intermediate, device)
            router = reader.tensor(f"{prefix}gate.weight", (torch.float32, torch.bfloat16, torch.float16),
                                   (self.num_experts, self.hidden)).to(device=device, dtype=torch.float32)
            bias_name = f"{prefix}gate.e_score_correction_bias"
            bias = None
            if bias_name in self._files:
                bias = reader.tensor(bias_name, (torch.float32, torch.bfloat16), (self.num_experts,)).to(
                    device=device, dtype=torch.float32)
            elif self.routing.scoring == "sigmoid":
                raise _fail(str(self.path), f"no tensor {bias_name!r} ({self.architecture} routes with it)")
            shared = None
            if f"{prefix}shared_experts.{names[0]}.weight" in self._files:
                shared_i = self.intermediate * int(self.config.get("n_shared_experts") or 1)
                shared_w13, shared_w2 = _load_experts(reader, [f"{prefix}shared_experts."], names, self.hidden,
                                                      shared_i, device)
                shared = {"w13": shared_w13, "w2": shared_w2}
        finally:
            handles.clear()
        return MoeLayerWeights(layer, w13, w2, router, bias, shared, experts.start, self.routing)


def _span(indices: list[int]) -> str:
    return f"{indices[0]}..{indices[-1]}" if indices == list(range(indices[0], indices[-1] + 1)) else str(indices)


class _Reader:
    """One tensor at a time from the export's files, each opened once per layer load; checks
    the dtype and shape of what it reads."""

    def __init__(self, directory: Path, files: dict, handles: dict, safe_open):
        self.directory, self.files, self.handles, self.safe_open = directory, files, handles, safe_open

    def has(self, name: str) -> bool:
        return name in self.files

    def tensor(self, name: str, dtypes: tuple, shape: tuple) -> torch.Tensor:
        if name not in self.files:
            raise _fail(str(self.directory), f"no tensor {name!r}")
        path = self.files[name]
        if path not in self.handles:
            self.handles[path] = self.safe_open(path, framework="pt")
        value = self.handles[path].get_tensor(name)
        if value.dtype not in dtypes or tuple(value.shape) not in (shape, tuple(s for s in shape if s != 1)):
            expected = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise _fail(str(path), f"tensor {name!r}: dtype {str(value.dtype).removeprefix('torch.')}, shape "
                        f"{list(value.shape)}: expected {expected} {list(shape)}")
        return value


def _load_experts(reader: _Reader, expert_prefixes: list[str], names: tuple, hidden: int, intermediate: int,
                  device: torch.device) -> tuple[checkpoint.MoeProjection, checkpoint.MoeProjection]:
    """(w13, w2) of the experts under `expert_prefixes` (gate, up, down projections `names`),
    each expert's tensors copied into tensors allocated once on `device`."""
    experts = len(expert_prefixes)
    projections = {}
    for fused, parts, n, k in (("w13", names[:2], intermediate, hidden), ("w2", names[2:], hidden, intermediate)):
        if k % GROUP_SIZE or k % 2:
            raise _fail(str(reader.directory), f"{fused}: K = {k} must be a multiple of {GROUP_SIZE}")
        rows = n * len(parts)
        weight = torch.empty(experts, rows, k // 2, dtype=torch.uint8, device=device)
        scale = torch.empty(experts, rows, k // GROUP_SIZE, dtype=torch.float8_e4m3fn, device=device)
        scale_2 = torch.empty(experts, len(parts), dtype=torch.float32)
        input_scale = torch.empty(experts, len(parts), dtype=torch.float32)
        has_input_scale = True
        for e, expert in enumerate(expert_prefixes):
            for j, part in enumerate(parts):
                name = f"{expert}{part}."
                rows_of_part = slice(j * n, (j + 1) * n)
                weight[e, rows_of_part] = reader.tensor(name + "weight", (torch.uint8,), (n, k // 2))
                scale[e, rows_of_part] = reader.tensor(name + "weight_scale", (torch.float8_e4m3fn,),
                                                       (n, k // GROUP_SIZE))
                scale_2[e, j] = reader.tensor(name + "weight_scale_2", (torch.float32,), (1,)).reshape(())
                if reader.has(name + "input_scale"):
                    input_scale[e, j] = reader.tensor(name + "input_scale", (torch.float32,), (1,)).reshape(())
                else:
                    has_input_scale = False
        tensors = {f"{fused}_weight": weight, f"{fused}_weight_scale": scale,
                   # [E, 2] where gate and up differ, [E] where equal (load_projection's choice)
                   f"{fused}_weight_scale_2": scale_2.to(device)}
        if has_input_scale:
            # gate and up quantize the same activations: one scale, their largest (vLLM's choice)
            tensors[f"{fused}_input_scale"] = input_scale.amax(dim=1).to(device)
        projections[fused] = checkpoint.load_projection(tensors, fused)
        del weight, scale, tensors
    return projections["w13"], projections["w2"]


def open_export(path) -> Export:
    """The export directory at `path`, opened: config and quantization checked, tensor names
    read (module docstring)."""
    return Export(path)
