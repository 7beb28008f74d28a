"""Expert parallelism across GPUs (nvfp4_group_gemm.expert_parallel) on torch.distributed: the
equality of every combine form with the one-process layer, then the layer's time, its
collectives' share and its scaling, on a DeepSeek-V3-sized MoE layer written as a ModelOpt NVFP4
export with the real tensor names.

    torchrun --nproc-per-node 8 bench/moe_ep.py                      # NCCL, one GPU per rank
    torchrun --nproc-per-node 2 bench/moe_ep.py --tiny --device cpu  # the same steps on gloo, tiny sizes

The layer: H 7168, I 2048, 256 routed experts, top-8, grouped sigmoid routing (n_group 8,
topk_group 4, routed_scaling_factor 2.5, a correction bias) and one shared expert (`--tiny`: H
256, I 256, 32 experts, the same routing). Rank 0 writes it once to `--export` (default: a
folder under the system's temporary directory; bench/moe_ffn.py's write_export: N(0, 0.02)
weights quantized by ModelOpt's formula, shards of 32 experts, 6.4 GB at full size; a complete
folder is kept and reused), the ranks wait, and each reads its experts only
(ExpertParallelMoe.from_pretrained). W4A16 (bf16 activations), the default; --activations nvfp4:
W4A4.

1. Check (--check-tokens per rank, 64): every combine form against the whole layer loaded on
   each rank (MoeFfn.from_pretrained, all the experts) on the same tokens. On CPUs (the exact
   decode) every value within one bf16 unit of the whole layer's; on GPUs the GEMMs' tile
   configs follow the rows per call, which differ between the two layers, so fp32 accumulation
   orders may differ: the relative difference within 2^-7. One line per form. On GPUs, for the
   forms without a host read (all_reduce, all_to_all_padded), a `graph` line: one call under
   torch.cuda.set_sync_debug_mode("error"), then one CUDA graph captured with the layer (NCCL
   collectives included) and replayed on new tokens, equal to eager bit for bit. Exit 1 on a
   failure (after the timings).
2. Times, per tokens per GPU T (--tokens, 1,16,128,1024,4096) and form (--combine, all three):
     all_reduce         every rank holds the N T tokens (the same on every rank) and their
                        output; the other forms: each rank its own T tokens
     layer              the layer's call, host-synchronized (the all-to-all form's host read
                        included), median of --repeats, the slowest rank's
     collective         the same call's collectives alone (recorded during a call, replayed with
                        the same sizes), and their share of the layer
     1/N experts        one GPU holding 1/N of the experts (this rank's) serving the same N T
                        tokens with no communication: the all-reduce form without its
                        all-reduce, the per-GPU work at perfect scaling
     scaling            1/N experts / layer (1.0: the collectives cost nothing)

Exit codes: 0 done; 1 a check failed; 2 cannot run (a bad option, no process group).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_ffn import write_export
from moe_layers import Layer

from nvfp4_group_gemm import expert_parallel
from nvfp4_group_gemm.moe_layer import MoeFfn

LAYER = 0  # the export's one MoE layer (moe_ffn.write_export)
SIZES = {  # every expert in the export; `local` is unused here (the ranks split them)
    "full": Layer("dsv3", 7168, 2048, 256, 256, 8),
    "tiny": Layer("dsv3_tiny", 256, 256, 32, 32, 8),
}


# -- timing ------------------------------------------------------------------------------------


class RecordingLayer(expert_parallel.ExpertParallelMoe):
    """The layer, its collectives recorded while `record` is a list: (kind, output, input,
    output splits, input splits) with tensors of the same shapes, to replay them alone."""

    record: list | None = None

    def all_reduce(self, tensor):
        if self.record is not None:
            self.record.append(("all_reduce", tensor.clone(), None, None, None))
        super().all_reduce(tensor)

    def all_to_all(self, output, input, output_splits, input_splits, async_op=False):
        if self.record is not None:
            self.record.append(("all_to_all", output.clone(), input.clone(), output_splits, input_splits))
        return super().all_to_all(output, input, output_splits, input_splits, async_op)


def replay(layer: expert_parallel.ExpertParallelMoe, recorded: list) -> None:
    for kind, output, input, output_splits, input_splits in recorded:
        if kind == "all_reduce":
            expert_parallel.ExpertParallelMoe.all_reduce(layer, output)
        else:
            expert_parallel.ExpertParallelMoe.all_to_all(layer, output, input, output_splits, input_splits)


def timed(function, device: torch.device, repeats: int) -> float:
    """Median seconds of `function()` over `repeats` calls after two warm-up calls, every rank
    starting together, each call host-synchronized; the slowest rank's median."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        function()
    samples = []
    for _ in range(repeats):
        sync()
        dist.barrier()
        start = time.perf_counter()
        function()
        sync()
        samples.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)  # NCCL: on the GPU
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


# -- the steps ---------------------------------------------------------------------------------


def tokens_for(form: str, tokens: int, world: int, rank: int, hidden: int, device, seed: int) -> torch.Tensor:
    """All-reduce form: the same N T tokens on every rank; the other forms: this rank's T."""
    generator = torch.Generator().manual_seed(seed if form == "all_reduce" else seed * 1000 + rank)
    rows = world * tokens if form == "all_reduce" else tokens
    return torch.randn(rows, hidden, generator=generator).to(device=device, dtype=torch.bfloat16)


def check(path: Path, layers: dict, args, device, world: int, rank: int, hidden: int) -> bool:
    whole = MoeFfn.from_pretrained(path, LAYER, device=device, activations=args.activations)
    passed = True
    for form, layer in layers.items():
        x = tokens_for(form, args.check_tokens, world, rank, hidden, device, seed=11)
        out, ref = layer(x).float(), whole(x).float()
        diff = (out - ref).abs()
        unit = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
        relative = float(diff.norm() / ref.norm())
        if device.type == "cpu":
            ok = bool((diff <= unit + 2.0**-20 * float(ref.abs().max())).all())
            rule = "every value within one bf16 unit"
        else:
            ok = relative <= 2.0**-7
            rule = "relative difference <= 2^-7"
        verdict = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(verdict)
        summary = torch.tensor([float(diff.max()), relative], dtype=torch.float64, device=device)
        dist.all_reduce(summary, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"check {form:18s} {'ok' if int(verdict) == 0 else 'FAIL'}: {world} ranks, {args.check_tokens} tokens "
                  f"per rank, max |diff| {float(summary[0]):.3g}, relative {float(summary[1]):.3g} "
                  f"({rule}; the whole layer on every rank)", flush=True)
        passed &= int(verdict) == 0
        if device.type == "cuda" and form != "all_to_all":  # the forms without a host read
            passed &= check_graph_safety(layer, form, x, device, world, rank, hidden)
    del whole
    return passed


def check_graph_safety(layer, form: str, x: torch.Tensor, device, world: int, rank: int, hidden: int) -> bool:
    """GPUs, the forms without a host read: one call under torch.cuda.set_sync_debug_mode("error")
    (any host synchronization raises), then one CUDA graph captured with the layer and replayed on
    new tokens, against an eager call on them (the same kernels and sizes: bit for bit)."""
    failures = []
    try:
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        layer(x)
    except RuntimeError as error:
        failures.append(f"a host synchronization ({str(error).splitlines()[0][:120]})")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    try:
        static_x = x.clone()
        layer(static_x)  # eager first on the tensor to capture (tests/test_gpu_moe_layer.py's recipe)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        fresh = tokens_for(form, x.shape[0] // (world if form == "all_reduce" else 1), world, rank, hidden, device,
                           seed=12)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize(device)
        if not torch.equal(static_y, layer(fresh)):
            failures.append("the replay differs from eager")
    except RuntimeError as error:
        failures.append(f"capture failed ({str(error).splitlines()[0][:120]})")
    verdict = torch.tensor([len(failures)], device=device)
    dist.all_reduce(verdict)
    if rank == 0:
        print(f"graph {form:18s} {'ok' if int(verdict) == 0 else 'FAIL'}: no host synchronization, one CUDA graph "
              f"replayed on new tokens equal to eager{'' if not failures else ' (rank 0: ' + '; '.join(failures) + ')'}",
              flush=True)
    return int(verdict) == 0


def one_gpu(local: MoeFfn, x, topk_ids, topk_weights, shared_chunk: range) -> torch.Tensor:
    """The all-reduce form's work on one rank without its all-reduce: this rank's experts over
    every token, the shared expert over its chunk."""
    part = local.experts_output(x, topk_ids, topk_weights, out_dtype=torch.float32)
    if local.shared is not None and len(shared_chunk):
        part[shared_chunk.start:shared_chunk.stop] += local.shared_expert(
            x[shared_chunk.start:shared_chunk.stop]).float()
    return part


def bench(layers: dict, args, device, world: int, rank: int, hidden: int) -> list[dict]:
    rows = []
    local = next(iter(layers.values())).local
    if rank == 0:
        print(f"\n{world} ranks, {local.experts} experts on rank 0 of {local.router_weight.shape[0]}, "
              f"{'W4A16' if local.scale13 is None else 'W4A4'}, median of {args.repeats}, the slowest rank",
              flush=True)
        print(f"{'T/GPU':>6s} {'form':18s} {'layer us':>10s} {'collective us':>14s} {'share':>6s} "
              f"{'1/N experts us':>15s} {'scaling':>8s}", flush=True)
    for tokens in args.tokens:
        # one GPU with 1/N of the experts, the same N T tokens, no communication
        xg = tokens_for("all_reduce", tokens, world, rank, hidden, device, seed=tokens)
        ids, weights = local.route(xg)
        chunk = next(iter(layers.values())).shared_chunk(xg.shape[0])

        baseline = timed(lambda xg=xg, ids=ids, weights=weights, chunk=chunk: one_gpu(local, xg, ids, weights, chunk),
                         device, args.repeats)
        for form, layer in layers.items():
            x = tokens_for(form, tokens, world, rank, hidden, device, seed=tokens)
            layer_s = timed(lambda layer=layer, x=x: layer(x), device, args.repeats)
            layer.record = []
            layer(x)
            recorded, layer.record = layer.record, None
            collective_s = timed(lambda layer=layer, recorded=recorded: replay(layer, recorded), device, args.repeats)
            row = {"tokens_per_gpu": tokens, "form": form, "ranks": world, "layer_us": layer_s * 1e6,
                   "collective_us": collective_s * 1e6, "share": collective_s / layer_s,
                   "one_gpu_1_over_n_us": baseline * 1e6, "scaling": baseline / layer_s}
            rows.append(row)
            if rank == 0:
                print(f"{tokens:6d} {form:18s} {row['layer_us']:10.1f} {row['collective_us']:14.1f} "
                      f"{row['share']:6.0%} {row['one_gpu_1_over_n_us']:15.1f} {row['scaling']:8.2f}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="H 256, I 256, 32 experts (the same routing)")
    parser.add_argument("--export", type=Path, help="the export folder (written by rank 0 when it has no config.json)")
    parser.add_argument("--tokens", default="1,16,128,1024,4096", help="tokens per GPU, comma-separated")
    parser.add_argument("--combine", default=",".join(expert_parallel.COMBINES))
    parser.add_argument("--activations", choices=("bf16", "nvfp4"), default="bf16", help="W4A16 (bf16) or W4A4")
    parser.add_argument("--check-tokens", type=int, default=64)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path, help="rank 0 writes every row there")
    args = parser.parse_args(argv)
    try:
        args.tokens = [int(value) for value in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens {args.tokens!r}: comma-separated integers")
    args.combine = args.combine.split(",")
    unknown = [form for form in args.combine if form not in expert_parallel.COMBINES]
    if unknown:
        parser.error(f"--combine: {unknown}: each one of {expert_parallel.COMBINES}")
    if "RANK" not in os.environ:
        print("moe_ep: no process group (RANK unset): run it under torchrun --nproc-per-node N", file=sys.stderr)
        return 2
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    layer = SIZES["tiny" if args.tiny else "full"]
    hidden = layer.hidden
    path = args.export or Path(tempfile.gettempdir()) / f"nvfp4_moe_ep_{layer.name}"
    if rank == 0:  # once: moe_ffn.write_export keeps a complete folder
        started = time.perf_counter()
        write_export(layer, path, "deepseek_v3", device)
        print(f"export at {path} ({time.perf_counter() - started:.1f} s)", flush=True)
    dist.barrier()
    # this rank's experts read once; one layer object per form over them
    first = RecordingLayer.from_pretrained(path, LAYER, device=device, combine=args.combine[0],
                                           activations=args.activations)
    layers = {form: RecordingLayer(first.local, first.expert_ranges, combine=form) for form in args.combine}
    passed = True if args.no_check else check(path, layers, args, device, world, rank, hidden)
    rows = bench(layers, args, device, world, rank, hidden)
    if rank == 0 and args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    dist.barrier()  # no rank tears its group down while a peer still talks to it (gloo aborts then)
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
