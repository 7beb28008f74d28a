"""Expert parallelism across processes (nvfp4_group_gemm.expert_parallel) on CPUs: 2 and 4
processes on gloo, each holding its experts of a real ModelOpt export
(/work/shared/checkpoints/..., read through export.load_moe_layer's expert range), checked on
every rank against the one-process layer of the same export on the same tokens (the op's exact
decode on CPU tensors), for the three combine forms, uneven expert counts per rank, a shared
expert, fewer tokens than ranks, and caller-given routings that send every pair to one rank.

Why the results are not always bitwise equal: each expert's rows go through the same GEMMs (the
exact decode computes each row apart from the others), so every routed contribution is the same
bf16 row; what differs is the order of the fp32 sum of a token's k weighted contributions (per
rank, then over the ranks, against all k at once). The two fp32 sums differ in their last bits
at most, so the results, each rounded to bf16 once, differ by at most one bf16 unit of the
result, plus an fp32 rounding scale (2^-20 of the tensor's largest value) where the sum cancels
to near zero. With bf16 partials each rank's part is rounded once more: a normwise bound."""

import json
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from test_export import CHECKPOINTS, needs_checkpoints

from nvfp4_group_gemm import expert_parallel

COMBINES = expert_parallel.COMBINES
SPAWN_TIMEOUT_S = 240


# ---------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------


def test_split_experts_is_contiguous_and_as_even_as_possible():
    assert expert_parallel.split_experts(16, 3) == [range(6), range(6, 11), range(11, 16)]
    assert expert_parallel.split_experts(256, 8) == [range(32 * r, 32 * (r + 1)) for r in range(8)]
    assert expert_parallel.split_experts(5, 5) == [range(r, r + 1) for r in range(5)]
    with pytest.raises(ValueError, match=r"4 experts over 5 ranks: need 1 <= ranks <= experts"):
        expert_parallel.split_experts(4, 5)


def test_expert_ranges_are_checked_against_the_group_and_the_layer():
    check = expert_parallel.check_expert_ranges
    assert check((range(1), range(1, 16)), 2, 16) == [range(1), range(1, 16)]
    with pytest.raises(ValueError, match=r"expert_ranges: 1 ranges for a process group of 2 ranks: need one range "
                                         r"per rank"):
        check([range(16)], 2, 16)
    with pytest.raises(ValueError, match=r"expert_ranges\[1\] = range\(9, 16\): must start at 8"):
        check([range(8), range(9, 16)], 2, 16)
    with pytest.raises(ValueError, match=r"expert_ranges\[0\] = range\(0, 0\): must be a non-empty range of step 1"):
        check([range(0), range(16)], 2, 16)
    with pytest.raises(ValueError, match=r"end at expert 12: the layer has 16 experts"):
        check([range(8), range(8, 12)], 2, 16)


def test_a_combine_form_and_a_partial_dtype_not_offered_are_refused():
    with pytest.raises(ValueError, match=r"combine = 'ring': must be one of \('all_reduce', 'all_to_all', "
                                         r"'all_to_all_padded'\)"):
        expert_parallel.ExpertParallelMoe(None, [], combine="ring")
    with pytest.raises(ValueError, match=r"partial_dtype = torch.float16: must be one of"):
        expert_parallel.ExpertParallelMoe(None, [], partial_dtype=torch.float16)


def test_a_packed_row_carries_the_token_its_experts_and_weights_bit_for_bit():
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(5, 48, generator=generator).to(torch.bfloat16)
    ids = torch.randint(0, 256, (5, 8), generator=generator)
    weights = torch.rand(5, 8, generator=generator)
    packed = expert_parallel.pack_rows(rows, ids, weights)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 2 * 48 + 8 * 8)
    back_rows, back_ids, back_weights = expert_parallel.unpack_rows(packed, 48, 8)
    assert torch.equal(back_rows, rows) and torch.equal(back_ids, ids.int()) and torch.equal(back_weights, weights)


# ---------------------------------------------------------------------------------------
# Spawned process groups: every rank against the one-process layer
# ---------------------------------------------------------------------------------------


def _case(name, model, layer, combine, block, tokens, ranges=None, routing=None, partial="fp32",
          activations="bf16") -> dict:
    return {"name": name, "model": model, "layer": layer, "combine": combine, "block": block, "tokens": tokens,
            "ranges": ranges, "routing": routing, "partial": partial, "activations": activations}


def _cases(world: int) -> list[dict]:
    """What each rank computes, as plain data: an export, its MoE layer, the combine form, tokens
    (a block input of block_outputs.safetensors and each rank's row count), the expert ranges
    (None: split_experts), the routing (None: the layer's router; R: a caller's routing that
    sends every pair to rank R's experts), the partials' dtype and the activations (W4A16, or
    W4A4: nvfp4)."""
    cases = []
    if world == 2:
        for combine in COMBINES:
            cases += [
                _case(f"qwen3_moe even {combine}", "qwen3_moe", 0, combine, 3, [120, 80]),
                _case(f"qwen3_moe 5+11 experts {combine}", "qwen3_moe", 1, combine, 2, [40, 24],
                      ranges=[[0, 5], [5, 16]]),
                _case(f"deepseek_v3 shared expert {combine}", "deepseek_v3", 1, combine, 3, [100, 60]),
                _case(f"deepseek_v3 one token {combine}", "deepseek_v3", 1, combine, 0, [1, 0]),
            ]
            cases += [_case(f"mixtral every pair to rank {only} {combine}", "mixtral", 0, combine, 2, [32, 20],
                            routing=only) for only in (0, 1)]
        cases += [
            _case("deepseek_v3 bf16 partials all_to_all", "deepseek_v3", 1, "all_to_all", 3, [100, 60], partial="bf16"),
            _case("qwen3_moe bf16 partials all_reduce", "qwen3_moe", 1, "all_reduce", 3, [100, 100], partial="bf16"),
            _case("qwen3_moe W4A4 all_to_all", "qwen3_moe", 1, "all_to_all", 2, [40, 24], activations="nvfp4"),
            _case("deepseek_v3 W4A4 all_reduce", "deepseek_v3", 1, "all_reduce", 2, [40, 24], activations="nvfp4"),
        ]
    else:
        uneven = [[0, 1], [1, 8], [8, 11], [11, 16]]  # 1, 7, 3 and 5 experts
        for combine in COMBINES:
            cases += [
                _case(f"deepseek_v3 1+7+3+5 experts {combine}", "deepseek_v3", 1, combine, 3, [64, 0, 50, 30],
                      ranges=uneven),
                _case(f"qwen3_moe two tokens over four ranks {combine}", "qwen3_moe", 1, combine, 1, [2, 1, 2, 1]),
                _case(f"deepseek_v3 every pair to rank 3 {combine}", "deepseek_v3", 1, combine, 2, [20, 16, 10, 12],
                      ranges=uneven, routing=3),
            ]
    for case in cases:
        if case["combine"] == "all_to_all_padded":  # one capacity for every rank
            case["tokens"] = [max(case["tokens"])] * world
    return cases


def _one_rank_routing(tokens: int, top_k: int, experts: range, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts of `experts` per token, random weights: a caller's routing that sends
    every pair to one rank."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(len(experts), generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator) + 0.1
    return (ids + experts.start).reshape(tokens, top_k), weights / weights.sum(-1, keepdim=True)


def _compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    out, ref = out.float(), ref.float()
    diff = (out - ref).abs()
    magnitude = ref.abs()
    unit = torch.where(magnitude > 0, torch.exp2(torch.floor(torch.log2(magnitude)) - 7), torch.zeros_like(ref))
    scale = float(magnitude.max()) if ref.numel() else 0.0
    return {"max_abs": float(diff.max()) if ref.numel() else 0.0, "max_ref": scale,
            "within_unit": bool((diff <= unit + 2.0**-20 * scale).all()),
            "differing": int((diff > 0).sum()), "numel": ref.numel(),
            "rel_norm": float(diff.norm() / ref.norm()) if ref.numel() and float(ref.norm()) > 0 else 0.0}


def _worker(rank: int, world: int, init_method: str, result_dir: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from nvfp4_group_gemm.moe_layer import MoeFfn

    torch.set_num_threads(1)  # the ranks share CI's cores
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results = []
    whole_layers, blocks = {}, {}
    for case in _cases(world):
        path = CHECKPOINTS / case["model"]
        key = (case["model"], case["layer"], case["activations"])
        if key not in whole_layers:
            whole_layers[key] = MoeFfn.from_pretrained(path, case["layer"], device="cpu",
                                                       activations=case["activations"])
            blocks[case["model"]] = load_file(path / "block_outputs.safetensors")
        whole = whole_layers[key]
        ranges = None if case["ranges"] is None else [range(*bounds) for bounds in case["ranges"]]
        partial = torch.bfloat16 if case["partial"] == "bf16" else torch.float32
        layer = expert_parallel.ExpertParallelMoe.from_pretrained(path, case["layer"], device="cpu",
                                                                  combine=case["combine"], expert_ranges=ranges,
                                                                  partial_dtype=partial,
                                                                  activations=case["activations"])
        x_all = blocks[case["model"]][f"layer{case['layer']}.x{case['block']}"]
        if case["combine"] == "all_reduce":  # every rank holds every token
            x = x_all[:sum(case["tokens"])]
        else:  # each rank its own tokens
            first = sum(case["tokens"][:rank])
            x = x_all[(first + torch.arange(case["tokens"][rank])) % x_all.shape[0]]
        if x.shape[0] == 0:  # a rank without tokens of its own still serves its experts
            out, ref = layer(x), x.clone()
        elif case["routing"] is None:
            out, ref = layer(x), whole(x)
        else:
            ids, weights = _one_rank_routing(x.shape[0], whole.top_k, layer.expert_ranges[case["routing"]],
                                             seed=len(results) + (0 if case["combine"] == "all_reduce" else rank))
            out, ref = layer.experts_output(x, ids, weights), whole.experts_output(x, ids, weights)
        result = {"case": case["name"], "rank": rank, "tokens": x.shape[0], "local_experts": layer.local.experts,
                  "shared": layer.local.shared is not None, "partial": str(partial), **_compare(out, ref)}
        if case["activations"] == "nvfp4":  # the activation scales: this rank's experts' largest, and the one used
            result["own_scales"] = [float(layer.local.w13.input_scale.max()), float(layer.local.w2.input_scale.max())]
            result["scales"] = [float(layer.local.scale13), float(layer.local.scale2)]
            result["whole_scales"] = [float(whole.scale13), float(whole.scale2)]
        results.append(result)
        if case["activations"] == "nvfp4" and world == 2:
            # rank-dependent scales (the exports hold one input scale for every expert): the largest wins
            layer.local.scale13 = torch.tensor(0.001 * (rank + 1))
            layer.local.scale2 = torch.tensor(0.01 * (2 - rank))
            expert_parallel.share_input_scales(layer.local)
            results.append({"case": "share_input_scales", "scales": [float(layer.local.scale13),
                                                                      float(layer.local.scale2)],
                            "alpha_is_scale_x_weight_scale_2": bool(torch.equal(
                                layer.local.alpha13, (layer.local.scale13 * layer.local.w13.weight_scale_2).float()))})
    if world == 2:
        x = blocks["qwen3_moe"]["layer1.x2"][rank * 20:rank * 20 + 20]
        for combine in COMBINES:
            layer = expert_parallel.ExpertParallelMoe.from_pretrained(CHECKPOINTS / "qwen3_moe", 1, device="cpu",
                                                                      combine=combine)
            results.append({"case": f"host reads {combine}", "reads": _host_reads(lambda layer=layer: layer(x))})
    # a local layer whose experts are not its rank's range
    try:
        expert_parallel.ExpertParallelMoe(layer.local, [range(5), range(5, 16)])
        results.append({"case": "local layer off its range", "error": None})
    except ValueError as error:
        results.append({"case": "local layer off its range", "error": str(error)})
    # a process group whose size disagrees with the expert split
    try:
        expert_parallel.ExpertParallelMoe.from_pretrained(CHECKPOINTS / "qwen3_moe", 0, device="cpu",
                                                          expert_ranges=[range(16)])
        results.append({"case": "ranges of another group size", "error": None})
    except ValueError as error:
        results.append({"case": "ranges of another group size", "error": str(error)})
    dist.destroy_process_group()
    (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(results))


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


def _host_reads(function) -> list[str]:
    """The tensor-to-host conversions (HOST_READS) that expert_parallel.py's own code makes
    while `function` runs (the exact decode's read of the offsets, the CPU op's, is MoeFfn's)."""
    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name, original):
        def read(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename == expert_parallel.__file__:
                reads.append(name)
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        function()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return reads


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _warm_up() -> None:
    """One tiny MoE layer call: the imports and set-up of the op's first call, done once here,
    before the fork (torch.distributed and safetensors too)."""
    import torch.distributed
    from safetensors.torch import load_file  # noqa: F401

    from nvfp4_group_gemm.moe_layer import MoeFfn

    MoeFfn.from_pretrained(CHECKPOINTS / "mixtral", 0, device="cpu")(torch.zeros(1, 256, dtype=torch.bfloat16))


def _spawn(world: int, tmp_path: Path) -> list[dict]:
    """Runs _worker on `world` processes (tcp://127.0.0.1 on a free port), killed past the
    timeout (a rank waiting forever in a collective); every rank's results."""
    import torch.multiprocessing as mp

    _warm_up()
    # forked from this warmed-up process: the ranks skip importing torch and the library again
    # and the op's first-call set-up (about 5 s of CPU each, most of this test's time on CI)
    context = mp.start_processes(_worker, args=(world, f"tcp://127.0.0.1:{_free_port()}", str(tmp_path)),
                                 nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} ranks still running after {SPAWN_TIMEOUT_S} s")
    return [result for rank in range(world) for result in json.loads((tmp_path / f"rank{rank}.json").read_text())]


@pytest.fixture(scope="module", params=[2, 4], ids=["2_ranks", "4_ranks"])
def ranks(request, tmp_path_factory):
    return request.param, _spawn(request.param, tmp_path_factory.mktemp(f"ep{request.param}"))


@needs_checkpoints
def test_every_rank_equals_the_one_process_layer(ranks, capsys):
    """fp32 partials: every rank's bf16 output within one bf16 unit of the one-process layer's
    (module docstring); most are bitwise equal (printed)."""
    world, results = ranks
    checked = [r for r in results if "max_abs" in r and r["partial"] == "torch.float32"]
    assert len(checked) == world * len(COMBINES) * (6 if world == 2 else 3) + (2 * world if world == 2 else 0)
    for r in checked:
        assert r["within_unit"], r
        assert r["differing"] <= max(1, r["numel"] // 100), r
    with capsys.disabled():
        worst = max(checked, key=lambda r: r["max_abs"])
        print(f"\n  {world} ranks, fp32 partials: {len(checked)} outputs, "
              f"{sum(r['differing'] for r in checked)} of {sum(r['numel'] for r in checked)} values differ from the "
              f"one-process layer; max |diff| {worst['max_abs']:.3g} ({worst['case']}, rank {worst['rank']})")


@needs_checkpoints
def test_each_combine_form_covers_the_awkward_cases(ranks):
    """The cases ran as meant: uneven expert counts, a rank with no token of its own, the shared
    expert, fewer tokens than ranks, every pair on one rank (routings equal to the whole
    layer's: checked above)."""
    world, results = ranks
    by_case = {(r["case"], r["rank"]): r for r in results if "max_abs" in r}
    if world == 2:
        assert by_case[("qwen3_moe 5+11 experts all_to_all", 0)]["local_experts"] == 5
        assert by_case[("qwen3_moe 5+11 experts all_to_all", 1)]["local_experts"] == 11
        assert by_case[("deepseek_v3 shared expert all_reduce", 1)]["shared"]
        assert [by_case[("deepseek_v3 one token all_reduce", r)]["tokens"] for r in range(2)] == [1, 1]
        assert [by_case[("deepseek_v3 one token all_to_all", r)]["tokens"] for r in range(2)] == [1, 0]
    else:
        assert [by_case[("deepseek_v3 1+7+3+5 experts all_to_all", r)]["local_experts"] for r in range(4)] == [1, 7, 3, 5]
        assert by_case[("deepseek_v3 1+7+3+5 experts all_to_all", 1)]["tokens"] == 0
        assert by_case[("deepseek_v3 1+7+3+5 experts all_to_all_padded", 1)]["tokens"] == 64


@needs_checkpoints
def test_bf16_partials_are_within_their_extra_rounding(ranks, capsys):
    """bf16 partials (what servers send): each rank's part rounded to bf16 once more, so a
    normwise bound: within 2^-8 of the one-process layer, every value within (N + 1) bf16 units
    of the output's largest value."""
    world, results = ranks
    checked = [r for r in results if "max_abs" in r and r["partial"] == "torch.bfloat16"]
    assert len(checked) == (2 * world if world == 2 else 0)
    for r in checked:
        assert r["rel_norm"] <= 2.0**-8, r
        assert r["max_abs"] <= (world + 1) * 2.0**-8 * r["max_ref"], r
    if checked:
        with capsys.disabled():
            print(f"\n  {world} ranks, bf16 partials: relative difference up to "
                  f"{max(r['rel_norm'] for r in checked):.2g}, max |diff| {max(r['max_abs'] for r in checked):.3g} "
                  f"(largest output {max(r['max_ref'] for r in checked):.3g})")


@needs_checkpoints
def test_a_group_that_disagrees_with_the_expert_split_is_refused(ranks):
    world, results = ranks
    errors = [r["error"] for r in results if r["case"] == "ranges of another group size"]
    assert errors == [f"expert_ranges: 1 ranges for a process group of {world} ranks: need one range per rank"] * world


@needs_checkpoints
def test_w4a4_ranks_quantize_with_the_whole_layers_input_scales(ranks):
    """W4A4: every rank quantizes with the whole layer's input scales (the largest over all the
    experts: from_pretrained's all-reduce of each rank's largest), so the outputs are equal as in
    W4A16 (checked with the others above). ModelOpt's exports hold one input scale for every
    expert, so there the sharing changes nothing; with rank-dependent scales the largest over
    the ranks is taken and alpha recomputed with it."""
    world, results = ranks
    checked = [r for r in results if "whole_scales" in r]
    assert len(checked) == (2 * world if world == 2 else 0)
    for r in checked:
        assert r["scales"] == r["whole_scales"] == r["own_scales"] and r["within_unit"], r
    shared = [r for r in results if r["case"] == "share_input_scales"]
    assert len(shared) == (2 * world if world == 2 else 0)
    for r in shared:
        assert r["scales"] == [pytest.approx(0.002), pytest.approx(0.02)] and r["alpha_is_scale_x_weight_scale_2"], r


@needs_checkpoints
def test_only_the_all_to_all_form_reads_the_host(ranks):
    """The one host read of the forward is the all-to-all form's split sizes (one tolist of the
    per-peer counts); the all-reduce and padded forms make none (graph-capturable)."""
    world, results = ranks
    reads = {(r["case"], tuple(r["reads"])) for r in results if r["case"].startswith("host reads")}
    assert reads == ({("host reads all_reduce", ()), ("host reads all_to_all", ("tolist",)),
                      ("host reads all_to_all_padded", ())} if world == 2 else set()), reads


@needs_checkpoints
def test_a_local_layer_off_its_ranks_range_is_refused(ranks):
    world, results = ranks
    errors = [r["error"] for r in results if r["case"] == "local layer off its range"]
    if world == 2:  # the last layer built: qwen3_moe's, split 0..7 and 8..15
        assert errors == [
            "ExpertParallelMoe: the local layer holds experts 0..7: expert_ranges[0] = range(0, 5) says 0..4",
            "ExpertParallelMoe: the local layer holds experts 8..15: expert_ranges[1] = range(5, 16) says 5..15",
        ]
    else:  # 4 ranks: expert_ranges of 2 ranges
        assert errors == ["expert_ranges: 2 ranges for a process group of 4 ranks: need one range per rank"] * 4
