"""The MoE entry on an H100/H200: random routings (empty groups, one group holding every row,
T larger than the rows used) against the exact decode, with general e4m3 scales and both scale
layouts; one CUDA graph replayed over 50 routings; bad offsets write nothing and flag; the torch
op under torch.compile(fullgraph=True)."""

import os
import random

import pytest
import torch
from helpers import epilogue_of_sums, fp16_boundary_case, per_group_data

import nvfp4_group_gemm as gemm
from nvfp4_group_gemm import core, moe, switches
from reference import exact_mismatches

# sm_90 runs the entry; sm_100 only with NVFP4_MOE_SM100=1 (its kernels are compiled for
# sm_100a and never ran here: this file is their first check on a B200)
SM100 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and (torch.cuda.get_device_capability() == (9, 0) or
                                        (SM100 and os.environ.get("NVFP4_MOE_SM100") == "1"))),
    reason="needs an sm_90 (Hopper) GPU, or an sm_100 one with NVFP4_MOE_SM100=1",
)
# activation scale layouts the entry takes there (sm_100: plain only)
SFA_LAYOUTS = ("plain",) if SM100 else ("plain", "blocked")

# (T, G, N, K): the four benchmark shapes stacked, and smaller families of other configs
FAMILIES = [
    (1024, 8, 4096, 7168),   # variable token tiles
    (1024, 8, 7168, 2048),   # variable token tiles
    (512, 2, 3072, 4096),    # one round of 128-token tiles, 128-wide k-tiles
    (512, 2, 4096, 1536),    # variable token tiles cut at 128 or 256 tokens (the routing decides)
    (300, 4, 256, 512),      # split-K (few tiles)
    (2000, 16, 512, 1024),   # variable token tiles, many groups
    (64, 64, 256, 768),      # 32-token tiles (decode: a row or so per group), warp lookup over 64 groups
    (96, 32, 512, 1024),     # 32-token tiles with 128-wide k-tiles
    (2048, 40, 256, 512),    # 64-token tiles, 40 groups (two rounds of the warp lookup)
    (256, 512, 256, 512),    # 512 experts (16 rounds of the warp lookup), decode-like: half of them empty
    (4096, 128, 512, 1024),  # 128 experts, prefill
]


def check_call(inputs, offsets, tag):
    """Every group's rows within the fp32 bound of the exact sum; every other row still NaN."""
    data, outputs = per_group_data(inputs, offsets)
    counts = exact_mismatches(data, outputs)
    assert sum(count for count, _, _ in counts) == 0, (tag, offsets, counts)
    c = inputs["c"]
    outside = torch.ones(c.shape[0], dtype=torch.bool, device=c.device)
    outside[offsets[0]:offsets[-1]] = False
    assert torch.isnan(c[outside]).all(), (tag, offsets, "rows outside the groups were written")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: "T{}_G{}_N{}_K{}".format(*f))
def test_random_routings_match_the_exact_decode(family):
    tokens, groups, n, k = family
    rng = random.Random(hash(family) & 0xFFFF)
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for layouts in (("plain", "blocked"), (SFA_LAYOUTS[-1], "plain")):
        inputs = moe.random_moe_inputs(tokens, groups, n, k, sfa_layout=layouts[0], sfb_layout=layouts[1],
                                       generator=generator)
        status = torch.full((1,), 7, dtype=torch.int32, device="cuda")
        for trial in range(4):  # a first call, the binding's (its graph recorded), two more
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            inputs["c"].fill_(float("nan"))
            out = gemm.moe_grouped_gemm(**inputs, status=status)
            assert out is inputs["c"]
            torch.cuda.synchronize()
            assert int(status.item()) == 0
            check_call(inputs, offsets, (family, layouts, trial))


def test_competition_scales_are_bitwise_the_exact_sum():
    """With the competition's scales every fp32 partial sum is exact: the outputs are the exact
    sums rounded to fp16, bit for bit, whatever the routing."""
    rng = random.Random(7)
    for tokens, groups, n, k in FAMILIES[:4]:
        inputs = moe.random_moe_inputs(tokens, groups, n, k, general_scales=False)
        offsets = moe.random_routing(tokens, groups, rng, fill=1.0)
        inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
        gemm.moe_grouped_gemm(**inputs)
        expected = moe.moe_reference(inputs["a"], inputs["sfa"], inputs["b"], inputs["sfb"], inputs["offsets"])
        lo, hi = offsets[0], offsets[-1]
        assert torch.equal(inputs["c"][lo:hi], expected[lo:hi]), (tokens, groups, n, k, offsets)


@pytest.mark.parametrize("family", FAMILIES[:4] + FAMILIES[6:],
                         ids=["variable_N4096", "variable_N7168", "one_round_k128", "variable_cut_at_128_or_256",
                              "t32_G64", "t32_k128_G32", "t64_G40", "t32_G512", "t64_G128"])
def test_one_graph_replays_every_routing(family):
    """Captured once; 50 routings (empty groups, one group holding all T, partial fills) and new
    activations written into the same tensors; each replay against the exact decode."""
    replay_every_routing(family)


# Configs the choice may not reach at these sizes, forced (NVFP4_MOE_CONFIG) on small decode
# families: split-K over 2 and 4 ranks of 32-token tiles (3 and 4 k-tiles per rank)
FORCED = [("swap_ab_t32_split_k2", (8, 16, 512, 512)), ("swap_ab_t32_split_k4", (40, 64, 256, 768)),
          ("swap_ab_t32_split_k4", (64, 8, 512, 1024))]


@pytest.mark.parametrize("label,family", FORCED, ids=[f"{label}_G{family[1]}" for label, family in FORCED])
def test_forced_configs_match_the_exact_decode_and_replay(label, family, monkeypatch):
    if SM100:
        pytest.skip("sm_90 configs")
    monkeypatch.setenv("NVFP4_MOE_CONFIG", label)
    gemm.reset_runtime()  # the switches are read again
    try:
        tokens, groups, n, k = family
        rng = random.Random(11)
        inputs = moe.random_moe_inputs(tokens, groups, n, k)
        status = torch.full((1,), 7, dtype=torch.int32, device="cuda")
        for trial in range(3):
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            inputs["c"].fill_(float("nan"))
            gemm.moe_grouped_gemm(**inputs, status=status)
            torch.cuda.synchronize()
            assert int(status.item()) == 0
            check_call(inputs, offsets, (label, family, trial))
        replay_every_routing(family)
    finally:
        monkeypatch.delenv("NVFP4_MOE_CONFIG")
        gemm.reset_runtime()


def replay_every_routing(family):
    tokens, groups, n, k = family
    rng = random.Random(50)
    inputs = moe.random_moe_inputs(tokens, groups, n, k)
    inputs["offsets"].copy_(torch.tensor(moe.random_routing(tokens, groups, rng), dtype=torch.int32))
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemm.moe_grouped_gemm(**inputs, status=status)  # warm: compile, plan, binding
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm.moe_grouped_gemm(**inputs, status=status)
    routings = [[0] * groups + [tokens], [0] + [tokens] * groups]  # all rows in the last, the first group
    routings += [moe.random_routing(tokens, groups, rng) for _ in range(48)]
    fresh = moe.random_moe_inputs(tokens, groups, n, k)
    for index, offsets in enumerate(routings):
        inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
        inputs["a"].view(torch.uint8).copy_(torch.roll(fresh["a"].view(torch.uint8), shifts=index, dims=0))
        inputs["c"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert int(status.item()) == 0
        check_call(inputs, offsets, ("replay", index))


def test_a_binding_replays_its_graph_when_idle_and_launches_directly_otherwise():
    """Same tensors on one stream: the second call makes the binding (its two kernels recorded
    as a CUDA graph). On an idle stream a call replays the graph; behind queued work it launches
    the two kernels directly (chained); both exact on new routings and bit for bit the same. A
    caller's capture on that same stream takes the direct launches into its own graph, marks the
    plan captured, and replays exact."""
    tokens, groups, n, k = 512, 2, 4096, 1536
    rng = random.Random(3)
    inputs = moe.random_moe_inputs(tokens, groups, n, k)
    inputs["offsets"].copy_(torch.tensor(moe.random_routing(tokens, groups, rng), dtype=torch.int32))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # a first call, then the binding's
            gemm.moe_grouped_gemm(**inputs)
        key = moe._binding_key(*(inputs[name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")), None)
        binding = moe.RUNTIME.bindings.get(((stream.cuda_stream, torch.cuda.current_device()), key))
        assert (binding.replay is not None) == switches.CURRENT.graph_launch
        replays = []
        if binding.replay is not None:
            recorded = binding.replay
            binding.replay = lambda: (replays.append(True), recorded())
        for trial in range(3):
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            inputs["c"].fill_(float("nan"))
            stream.synchronize()
            gemm.moe_grouped_gemm(**inputs)  # an idle stream: the graph
            stream.synchronize()
            assert len(replays) == (trial + 1 if switches.CURRENT.graph_launch else 0)
            check_call(inputs, offsets, ("idle", trial))
            replayed = inputs["c"].clone()
            inputs["c"].fill_(float("nan"))
            torch.cuda._sleep(2_000_000)  # work queued for a millisecond or so
            gemm.moe_grouped_gemm(**inputs)  # behind it: the direct launches
            stream.synchronize()
            assert len(replays) == (trial + 1 if switches.CURRENT.graph_launch else 0)
            assert torch.equal(inputs["c"].nan_to_num(0.5), replayed.nan_to_num(0.5)), ("queued", trial)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gemm.moe_grouped_gemm(**inputs)
    assert binding.plan.captured
    for trial in range(3):
        offsets = moe.random_routing(tokens, groups, rng)
        inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
        inputs["c"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_call(inputs, offsets, ("captured", trial))


BAD_OFFSETS = {
    "decreasing": lambda t, g: [0, 100, 50] + [100] * (g - 2),
    "negative_first": lambda t, g: [-16] + [10 * (i + 1) for i in range(g)],
    "past_T": lambda t, g: [0] * g + [t + 1],
}


@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
def test_bad_offsets_write_nothing_and_flag(case):
    tokens, groups, n, k = 300, 4, 256, 512
    inputs = moe.random_moe_inputs(tokens, groups, n, k)
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    inputs["offsets"].copy_(torch.tensor(BAD_OFFSETS[case](tokens, groups), dtype=torch.int32))
    sentinel = torch.randn(tokens, n, device="cuda").half()
    inputs["c"].copy_(sentinel)
    gemm.moe_grouped_gemm(**inputs, status=status)
    torch.cuda.synchronize()
    assert int(status.item()) == 1
    assert torch.equal(inputs["c"], sentinel), "c changed under bad offsets"
    with pytest.raises(ValueError, match="offsets were invalid"):
        gemm.check_status(status)
    # the same tensors with good offsets: computed, status back to 0
    offsets = [0, 10, 10, 200, 300]
    inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
    gemm.moe_grouped_gemm(**inputs, status=status)
    torch.cuda.synchronize()
    assert int(status.item()) == 0
    gemm.check_status(status)
    data, outputs = per_group_data(inputs, offsets)
    assert sum(count for count, _, _ in exact_mismatches(data, outputs)) == 0


def test_the_torch_op_under_torch_compile():
    tokens, groups, n, k = 512, 2, 4096, 1536
    inputs = moe.random_moe_inputs(tokens, groups, n, k)
    offsets = [0, 128, 512]
    inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))

    status = torch.full((1,), 7, dtype=torch.int32, device=inputs["a"].device)

    def layer(a, sfa, b, sfb, offsets, c):
        gemm.moe_grouped_gemm_op(a, sfa, b, sfb, offsets, c, status)
        return c.float().relu()

    compiled = torch.compile(layer, fullgraph=True)
    out = compiled(**inputs)
    assert int(status.item()) == 0
    data, outputs = per_group_data(inputs, offsets)
    assert sum(count for count, _, _ in exact_mismatches(data, outputs)) == 0
    assert torch.equal(out, inputs["c"].float().relu())


def test_the_per_size_set_path_gives_the_same_values():
    """custom_kernel on the same groups (the per-size-set path) and the MoE entry agree bit for
    bit on the competition's scales."""
    from reference import create_reordered_scale_factor_tensor

    tokens, groups, n, k = 1024, 8, 4096, 7168
    ms = [80, 176, 128, 72, 64, 248, 96, 160]
    inputs = moe.random_moe_inputs(tokens, groups, n, k, general_scales=False, sfb_layout="plain")
    offsets = [0]
    for m in ms:
        offsets.append(offsets[-1] + m)
    inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
    data, _ = per_group_data(inputs, offsets)
    abc, plain, _, sizes = data
    reordered = [(create_reordered_scale_factor_tensor(1, m, k, sfa.cpu(), device="cuda"),
                  create_reordered_scale_factor_tensor(1, n, k, sfb.cpu(), device="cuda"))
                 for (sfa, sfb), (m, _, _, _) in zip(plain, sizes)]
    per_group_c = [torch.empty(m, n, 1, dtype=torch.float16, device="cuda") for m in ms]
    abc = [(a, b, c) for (a, b, _), c in zip(abc, per_group_c)]
    gemm.custom_kernel((abc, plain, reordered, sizes))
    gemm.moe_grouped_gemm(**inputs)
    torch.cuda.synchronize()
    assert torch.equal(torch.cat([c[:, :, 0] for c in per_group_c]), inputs["c"][: offsets[-1]])


def test_no_call_synchronizes():
    """torch's sync debug mode raises on any synchronizing call: none in a first call, a
    binding's call, a hit, a call on fresh tensors, or a call with plain weight scales."""
    tokens, groups, n, k = 512, 2, 4096, 1536
    inputs = moe.random_moe_inputs(tokens, groups, n, k)
    plain = moe.random_moe_inputs(tokens, groups, n, k, sfb_layout="plain")
    gemm.moe_grouped_gemm(**inputs)  # compile and plan outside the check (compilation may sync)
    torch.cuda.synchronize()
    fresh = {name: (t if name in ("b", "sfb") else t.clone()) for name, t in inputs.items()}
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            gemm.moe_grouped_gemm(**inputs)
        gemm.moe_grouped_gemm(**fresh)
        gemm.moe_grouped_gemm(**plain)
        gemm.moe_grouped_gemm(**plain)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


def _corrupt_first_link(monkeypatch, family, corrupt):
    """MoePlan wrapped so that the plans of the chain's first link for `family` run `corrupt(c)`
    after their GEMM (or raise from it): a wrong or failing kernel, for the chain to handle."""
    real_init = moe.MoePlan.__init__

    def init(self, shape, device, config, num_sms, choice=None, chain=None):
        real_init(self, shape, device, config, num_sms, choice, chain)
        if chain is not None and choice is chain[0]:
            gemm_launch = self.gemm

            def wrong(*values):
                gemm_launch(*values)
                corrupt()

            self.gemm = wrong

    monkeypatch.setattr(moe.MoePlan, "__init__", init)


@pytest.mark.parametrize("failure", ["wrong output", "launch error"])
def test_a_wrong_or_failing_kernel_moves_down_the_chain(monkeypatch, capfd, failure):
    """The first call of a compiled MoE kernel is self-checked against the exact decode: a wrong
    output demotes it (that call returns the exact result), and so does a launch that raises with
    the context still usable; the next calls run the next link (variable token tiles), exact."""
    if SM100:
        pytest.skip("the sm_90 chain")
    tokens, groups, n, k = family = (64, 64, 256, 768)
    rng = random.Random(5)
    inputs = moe.random_moe_inputs(tokens, groups, n, k)

    def corrupt():
        if failure == "launch error":
            raise RuntimeError("kernel launch failed: CUresult 1 (injected)")
        inputs["c"][0].fill_(1.0)

    _corrupt_first_link(monkeypatch, family, corrupt)
    shape = moe.MoeShape(tokens, groups, n, k, "plain", "blocked")
    chain = moe.moe_chain(shape, torch.cuda.get_device_properties(0).multi_processor_count,
                          switches.CURRENT.sm90_chain_calls, None)
    for trial in range(3):
        offsets = [0, *sorted(rng.randint(1, tokens) for _ in range(groups - 1)), tokens]  # row 0 in a group
        inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
        inputs["c"].fill_(float("nan"))
        gemm.moe_grouped_gemm(**inputs)
        torch.cuda.synchronize()
        check_call(inputs, offsets, (failure, trial))
    assert core.is_demoted(chain[0].kernel_key(groups)) and not core.is_demoted(chain[1].kernel_key(groups))
    (plan,) = moe.RUNTIME.plans.entries.values()
    assert plan.choice == chain[1]
    why = "self-check" if failure == "wrong output" else "launch failed"
    assert f"{chain[0].name}" in capfd.readouterr().err and why in core.demotions()[chain[0].kernel_key(groups)]


# Real checkpoints: per-expert scales and bf16 output, on the configs of decode and prefill
SCALED = [("swap_ab_t32", (8, 64, 512, 1024)), ("swap_ab_t32_split_k4", (2, 16, 512, 4096)),
          ("swap_ab_t64", (512, 16, 512, 1024)), ("swap_ab_variable", (1024, 8, 1024, 1024)),
          ("swap_ab_split_k", (300, 4, 256, 512))]


@pytest.mark.parametrize("label,family", SCALED, ids=[label for label, _ in SCALED])
@pytest.mark.parametrize("alpha_shape", ["expert", "halves"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_alpha_and_bf16_output_match_the_exact_decode(label, family, alpha_shape, dtype, monkeypatch):
    """c = alpha x the exact products' sum, rounded to c's dtype, within the fp32 bound scaled by
    alpha (and one bf16 unit): alpha [G] and [G, 2] (a fused gate-and-up weight), over routings
    that change; every row outside the groups untouched. Large alphas overflow to inf as a plain
    cast does."""
    if SM100:
        pytest.skip("sm_90 epilogues (the sm_100a MoE kernels write fp16 without alpha)")
    monkeypatch.setenv("NVFP4_MOE_CONFIG", label)
    gemm.reset_runtime()
    try:
        tokens, groups, n, k = family
        rng = random.Random(17)
        inputs = moe.random_moe_inputs(tokens, groups, n, k)
        inputs["c"] = torch.full((tokens, n), float("nan"), dtype=dtype, device="cuda")
        shape = (groups,) if alpha_shape == "expert" else (groups, 2)
        alpha = (torch.rand(shape, generator=torch.Generator().manual_seed(3)) * 4 + 2.0**-6).cuda()
        for trial in range(3):
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            inputs["c"].fill_(float("nan"))
            gemm.moe_grouped_gemm(**inputs, alpha=alpha)
            torch.cuda.synchronize()
            mismatches, _, first, _, _ = moe.compare_with_exact(
                *(inputs[name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")), alpha)
            assert mismatches == 0, (label, alpha_shape, dtype, trial, first)
            outside = torch.ones(tokens, dtype=torch.bool, device="cuda")
            outside[offsets[0]:offsets[-1]] = False
            assert torch.isnan(inputs["c"][outside]).all()
        if dtype == torch.bfloat16:
            return  # bf16's range is fp32's: no alpha below 2^100 (alpha x 2^28 finite) takes these sums past it
        # overflow: an alpha far past fp16's range gives inf, as the exact decode's rounding does,
        # wherever fp32 accumulation cannot decide it (fp16_boundary: the boundary bit for bit)
        alpha.fill_(1e9)
        inputs["c"].fill_(0.0)
        gemm.moe_grouped_gemm(**inputs, alpha=alpha)
        torch.cuda.synchronize()
        assert_overflow_as_the_exact_decode(inputs, alpha, offsets)
    finally:
        monkeypatch.delenv("NVFP4_MOE_CONFIG")
        gemm.reset_runtime()


def assert_overflow_as_the_exact_decode(inputs, alpha, offsets):
    """c's infs are the exact decode's (alpha x the float64 sum past 65520) on every output whose
    fp32 accumulation error (core.group_accumulation_bound, times alpha) cannot take it across
    65520: with general scales and alpha = 1e9 a sum within about 1e-4 of 65520 / alpha may round
    either way in fp32 (the accumulation error, not the epilogue's order: the old check compared
    every output and failed on such a sum, swap_ab_t64 halves fp16 on the H200)."""
    a, sfa, b, sfb = (inputs[name] for name in ("a", "sfa", "b", "sfb"))
    k = 2 * a.shape[1]
    exact = moe.moe_reference(a, sfa, b, sfb, inputs["offsets"], c=torch.zeros(inputs["c"].shape, dtype=torch.float64,
                              device=a.device), alpha=alpha)
    sfa_plain = sfa if sfa.dim() == 2 else moe.plain_scales_of_blocked(sfa, a.shape[0], k)
    scales = moe.alpha_columns(alpha, b.shape[1]).double().abs()
    decided = 0
    for g in range(b.shape[0]):
        lo, hi = offsets[g], offsets[g + 1]
        if hi <= lo:
            continue
        sfb_g = sfb[g] if sfb.dim() == 3 else moe.plain_scales_of_blocked(sfb[g], b.shape[1], k)
        bound = core.group_accumulation_bound(a[lo:hi], b[g], sfa_plain[lo:hi], sfb_g, 1)
        bound = 0.0 if bound is None else bound.double() * scales[g]
        magnitude = exact[lo:hi].abs()
        sure_inf = magnitude - bound > 65520 + 1
        sure_finite = magnitude + bound < 65520 - 1
        inf = torch.isinf(inputs["c"][lo:hi])
        assert torch.equal(inf[sure_inf | sure_finite], sure_inf[sure_inf | sure_finite]), g
        decided += int((sure_inf | sure_finite).sum())
    assert decided > 0


def test_without_alpha_the_output_is_bit_for_bit_as_before():
    """alpha absent: the kernels of before (no scale load, no multiply beyond the exact rescale):
    c equals the call with alpha = 1 everywhere, bit for bit, and the exact decode's rounding."""
    if SM100:
        pytest.skip("sm_90")
    tokens, groups, n, k = 256, 8, 512, 1024
    inputs = moe.random_moe_inputs(tokens, groups, n, k, general_scales=False)
    offsets = moe.random_routing(tokens, groups, random.Random(2))
    inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
    plain = gemm.moe_grouped_gemm(**inputs).clone()
    ones = gemm.moe_grouped_gemm(**dict(inputs, c=torch.empty_like(inputs["c"])), alpha=torch.ones(groups).cuda())
    torch.cuda.synchronize()
    assert torch.equal(plain.view(torch.int16)[offsets[0]:offsets[-1]], ones.view(torch.int16)[offsets[0]:offsets[-1]])
    check_call(dict(inputs, c=plain), offsets, "no alpha")


# -----------------------------------------------------------------------------
# W4A16: bf16 activations read by the GEMM (hopper.moe.Sm90MoeW4A16Gemm)
# -----------------------------------------------------------------------------
# every config the choice may run, forced, with a family that gives it several tiles
W4A16 = [("swap_ab_t32", (64, 64, 256, 768)), ("swap_ab_t32_k128", (96, 32, 512, 1024)),
         ("swap_ab_t32_split_k2", (8, 16, 512, 2048)), ("swap_ab_t32_split_k4", (40, 64, 256, 4096)),
         ("swap_ab_t64", (2048, 40, 256, 512)), ("swap_ab_split_k", (300, 4, 256, 512)),
         ("swap_ab_one_round", (512, 2, 3072, 1024)), ("swap_ab_one_round_k128", (512, 2, 1024, 4096)),
         ("swap_ab_variable", (2000, 16, 512, 1024)), ("swap_ab_variable", (256, 512, 256, 512))]


@pytest.mark.parametrize("label,family", W4A16, ids=[f"{label}_G{family[1]}" for label, family in W4A16])
def test_w4a16_matches_the_exact_product_of_the_bf16_rows(label, family, monkeypatch):
    """bf16 activations, alpha [G] then [G, 2], fp16 then bf16 output, routings that change
    (empty groups, rows past offsets[G]): every group's rows within the fp32 bound of alpha x
    the exact float64 product (moe.compare_with_exact: W4A16's bound, one bf16 unit), every
    other row untouched; status 0; then one CUDA graph replayed over new routings."""
    if SM100:
        pytest.skip("W4A16 runs on sm_90 only")
    monkeypatch.setenv("NVFP4_MOE_CONFIG", label)
    gemm.reset_runtime()
    try:
        tokens, groups, n, k = family
        rng = random.Random(23)
        inputs = moe.random_moe_inputs(tokens, groups, n, k, sfa_layout=None,
                                       generator=torch.Generator().manual_seed(11))
        status = torch.full((1,), 7, dtype=torch.int32, device="cuda")
        for trial, (alpha_shape, dtype) in enumerate((("expert", torch.float16), ("halves", torch.bfloat16),
                                                      (None, torch.bfloat16))):
            inputs["c"] = torch.full((tokens, n), float("nan"), dtype=dtype, device="cuda")
            alpha = None if alpha_shape is None else (torch.rand(
                (groups,) if alpha_shape == "expert" else (groups, 2), generator=torch.Generator().manual_seed(trial))
                * 4 + 2.0**-6).cuda()
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            gemm.moe_grouped_gemm(**inputs, status=status, alpha=alpha)
            torch.cuda.synchronize()
            assert int(status.item()) == 0
            mismatches, _, first, _, _ = moe.compare_with_exact(
                *(inputs[name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")), alpha)
            assert mismatches == 0, (label, trial, first)
            outside = torch.ones(tokens, dtype=torch.bool, device="cuda")
            outside[offsets[0]:offsets[-1]] = False
            assert torch.isnan(inputs["c"][outside]).all()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemm.moe_grouped_gemm(**inputs, status=status)
        for trial in range(4):
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            inputs["c"].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            mismatches, _, first, _, _ = moe.compare_with_exact(
                *(inputs[name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")))
            assert mismatches == 0, (label, "replay", trial, first)
    finally:
        monkeypatch.delenv("NVFP4_MOE_CONFIG")
        gemm.reset_runtime()


def test_w4a16_of_exactly_decodable_activations_is_the_fp4_paths_result_bit_for_bit():
    """Activations that are e2m1 x e4m3 values (the fp4 path's, decoded: exact in bf16) with the
    competition's scales: every partial sum exact in fp32, so W4A16 and the fp4 path give the
    same bits."""
    tokens, groups, n, k = 512, 2, 3072, 4096
    inputs = moe.random_moe_inputs(tokens, groups, n, k, general_scales=False)
    inputs["offsets"].copy_(torch.tensor([0, 128, 512], dtype=torch.int32))
    fp4_out = gemm.moe_grouped_gemm(**inputs).clone()
    decoded = core.decode_fp4(inputs["a"], inputs["sfa"]).to(torch.bfloat16)
    w4a16 = dict(inputs, a=decoded, sfa=None, c=torch.full_like(inputs["c"], float("nan")))
    w4a16_out = gemm.moe_grouped_gemm(**w4a16)
    torch.cuda.synchronize()
    assert torch.equal(w4a16_out, fp4_out)


def test_w4a16_bad_offsets_write_nothing_and_flag():
    tokens, groups, n, k = 300, 4, 256, 512
    inputs = moe.random_moe_inputs(tokens, groups, n, k, sfa_layout=None)
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    for case in sorted(BAD_OFFSETS):
        inputs["offsets"].copy_(torch.tensor(BAD_OFFSETS[case](tokens, groups), dtype=torch.int32))
        sentinel = torch.randn(tokens, n, device="cuda").half()
        inputs["c"].copy_(sentinel)
        gemm.moe_grouped_gemm(**inputs, status=status)
        torch.cuda.synchronize()
        assert int(status.item()) == 1, case
        assert torch.equal(inputs["c"], sentinel), case


# the row maps (a_rows, c_rows) on configs of both epilogues (staged stores; split-K's per-element
# stores) and a K that runs a k_tail build; (forced config or None for the choice, (T_a, R, G, N, K))
ROW_MAPS = [("swap_ab_t32", (24, 64, 64, 256, 768)), ("swap_ab_t32_split_k4", (13, 40, 64, 256, 4096)),
            ("swap_ab_variable", (700, 2000, 16, 512, 1024)), (None, (16, 128, 64, 2048, 1408)),
            (None, (3, 24, 8, 1536, 2048))]


def _row_maps(tokens, rows, generator):
    """a_rows: each grouped row a random token of T_a (two of them outside a: read as zeros);
    c_rows: a permutation of c's R + 4 rows' first R (one outside c: written nowhere)."""
    a_rows = torch.randint(0, tokens, (rows,), generator=generator)
    a_rows[1], a_rows[rows // 2] = -3, tokens
    c_rows = torch.randperm(rows + 4, generator=generator)[:rows]
    c_rows[rows - 1] = rows + 9
    return a_rows.cuda(), c_rows.cuda()


def _check_row_maps(x, inputs, offsets, a_rows, c_rows, alpha, c, tag):
    """c's rows through c_rows against the exact product of a's rows through a_rows (zeros where
    outside a) within the W4A16 bound; c's other rows (and a row whose c_rows index lies outside)
    still NaN."""
    rows = a_rows.shape[0]
    bounds = offsets
    exact = moe.moe_reference(moe.gather_rows(x, a_rows), None, inputs["b"], inputs["sfb"], inputs["offsets"],
                              torch.zeros(rows, c.shape[1], dtype=c.dtype, device="cuda"), alpha)
    inside = moe.rows_inside(c_rows, c.shape[0])
    grouped = exact.clone()
    grouped[inside] = c[c_rows[inside]]
    grouped_rows = torch.zeros(rows, dtype=torch.bool, device="cuda")
    grouped_rows[bounds[0]:bounds[-1]] = True
    mismatches, _, first, _, _ = moe.compare_with_exact(moe.gather_rows(x, a_rows), None, inputs["b"], inputs["sfb"],
                                                        inputs["offsets"], grouped, alpha)
    assert mismatches == 0, (tag, first)
    written = torch.zeros(c.shape[0], dtype=torch.bool, device="cuda")
    written[c_rows[inside & grouped_rows]] = True
    assert torch.isnan(c[~written]).all(), (tag, "rows no grouped row names were written")


def _random_alpha(groups: int, alpha_shape: str, seed: int) -> torch.Tensor:
    """A checkpoint's alpha on the GPU: one per expert ("expert") or per half of N ("halves"),
    in [2^-6, 4 + 2^-6)."""
    return (torch.rand((groups, 2) if alpha_shape == "halves" else (groups,),
                       generator=torch.Generator().manual_seed(seed)) * 4 + 2.0**-6).cuda()


@pytest.mark.parametrize("label,family", ROW_MAPS, ids=[f"{label or 'chosen'}_R{f[1]}_K{f[4]}" for label, f in ROW_MAPS])
def test_w4a16_row_maps_match_the_exact_decode_and_replay(label, family, monkeypatch):
    """a_rows and c_rows (the gather in the GEMM's token loads, the un-permute in its stores):
    random maps with indices outside a and c, random routings over the R grouped rows (rows past
    offsets[G] neither read nor written), alpha [G, 2] then [G]: c's rows through c_rows within
    the W4A16 bound of the exact product of a's rows through a_rows, every other row of c
    untouched, status 0; then one CUDA graph replayed over new routings and new maps."""
    if SM100:
        pytest.skip("W4A16 runs on sm_90 only")
    _forced(monkeypatch, label)
    try:
        tokens, rows, groups, n, k = family
        rng, generator = random.Random(31), torch.Generator().manual_seed(17)
        inputs = moe.random_moe_inputs(rows, groups, n, k, sfa_layout=None, generator=generator)
        x = (torch.randn(tokens, k, generator=generator) * 4).bfloat16().cuda()
        c = torch.full((rows + 4, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        status = torch.full((1,), 7, dtype=torch.int32, device="cuda")
        a_rows, c_rows = _row_maps(tokens, rows, generator)
        call = {"b": inputs["b"], "sfb": inputs["sfb"], "offsets": inputs["offsets"], "c": c, "status": status,
                "a_rows": a_rows, "c_rows": c_rows}
        for trial, alpha_shape in enumerate(("halves", "expert")):
            alpha = _random_alpha(groups, alpha_shape, trial)
            offsets = moe.random_routing(rows, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            c.fill_(float("nan"))
            gemm.moe_grouped_gemm(x, None, **call, alpha=alpha)
            torch.cuda.synchronize()
            assert int(status.item()) == 0
            _check_row_maps(x, inputs, offsets, a_rows, c_rows, alpha, c, (label, trial))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemm.moe_grouped_gemm(x, None, **call, alpha=alpha)
        for trial in range(3):
            offsets = moe.random_routing(rows, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            new_a, new_c = _row_maps(tokens, rows, generator)
            a_rows.copy_(new_a)
            c_rows.copy_(new_c)
            c.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            _check_row_maps(x, inputs, offsets, a_rows, c_rows, alpha, c, (label, "replay", trial))
    finally:
        monkeypatch.delenv("NVFP4_MOE_CONFIG", raising=False)
        gemm.reset_runtime()


def test_w4a16_row_maps_with_bad_offsets_write_nothing_and_flag():
    tokens, rows, groups, n, k = 50, 300, 4, 256, 512
    inputs = moe.random_moe_inputs(rows, groups, n, k, sfa_layout=None)
    x = torch.randn(tokens, k, device="cuda").bfloat16()
    a_rows = torch.randint(0, tokens, (rows,), device="cuda")
    c_rows = torch.randperm(rows, device="cuda")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    for case in sorted(BAD_OFFSETS):
        inputs["offsets"].copy_(torch.tensor(BAD_OFFSETS[case](rows, groups), dtype=torch.int32))
        sentinel = torch.randn(rows, n, device="cuda").bfloat16()
        c = sentinel.clone()
        gemm.moe_grouped_gemm(x, None, inputs["b"], inputs["sfb"], inputs["offsets"], c, status=status,
                              a_rows=a_rows, c_rows=c_rows)
        torch.cuda.synchronize()
        assert int(status.item()) == 1, case
        assert torch.equal(c, sentinel), case


# SwiGLU in the epilogue (activation="swiglu"): both epilogues (staged; split-K's per-element
# stores), a k_tail build, both activation paths; (path, forced config or None, (T, G, N, K))
SWIGLU = [("w4a16", "swap_ab_t32", (64, 64, 256, 768)), ("w4a16", "swap_ab_t32_split_k4", (40, 64, 256, 4096)),
          ("w4a16", "swap_ab_split_k", (300, 4, 256, 512)), ("w4a16", "swap_ab_one_round", (512, 2, 3072, 1024)),
          ("w4a16", "swap_ab_variable", (2000, 16, 512, 1024)),
          ("w4a16", None, (16, 64, 1536, 1408)), ("fp4", "swap_ab_t32_split_k4", (40, 64, 256, 4096)),
          ("fp4", "swap_ab_variable", (2000, 16, 512, 1024))]


@pytest.mark.parametrize("path,label,family", SWIGLU,
                         ids=[f"{path}_{label or 'chosen'}_T{f[0]}_K{f[3]}" for path, label, f in SWIGLU])
def test_swiglu_epilogue_matches_the_exact_decode_and_replays(path, label, family, monkeypatch):
    """activation="swiglu" over a weight in swiglu_weights' order: c [T, N / 2] within the SwiGLU
    bound (moe.swiglu_bound) of silu(gate) x up of the exact decode's gate and up, alpha [G, 2]
    (the gate's, the up's) then [G], rows outside the groups untouched; then one CUDA graph
    replayed over new routings; and the values agree with the unfused GEMM's outputs put
    through torch's SwiGLU (the same roundings, silu's exponential aside)."""
    if SM100:
        pytest.skip("the SwiGLU epilogue is sm_90's")
    _forced(monkeypatch, label)
    try:
        tokens, groups, n, k = family
        rng = random.Random(41)
        inputs = moe.random_moe_inputs(tokens, groups, n, k, sfa_layout=None if path == "w4a16" else "plain",
                                       generator=torch.Generator().manual_seed(43))
        b, sfb = moe.swiglu_weights(inputs["b"], inputs["sfb"])
        c = torch.full((tokens, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
        status = torch.full((1,), 7, dtype=torch.int32, device="cuda")
        call = (inputs["a"], inputs["sfa"], b, sfb, inputs["offsets"], c)
        for trial, alpha_shape in enumerate(("halves", "expert")):
            alpha = _random_alpha(groups, alpha_shape, trial)
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            c.fill_(float("nan"))
            gemm.moe_grouped_gemm(*call, status=status, alpha=alpha, activation="swiglu")
            torch.cuda.synchronize()
            assert int(status.item()) == 0
            mismatches, _, first, _, _ = moe.compare_with_exact(*call, alpha, "swiglu")
            assert mismatches == 0, (label, trial, first)
            outside = torch.ones(tokens, dtype=torch.bool, device="cuda")
            outside[offsets[0]:offsets[-1]] = False
            assert torch.isnan(c[outside]).all()
            unfused = gemm.moe_grouped_gemm(inputs["a"], inputs["sfa"], inputs["b"], inputs["sfb"], inputs["offsets"],
                                            torch.full((tokens, n), float("nan"), dtype=torch.bfloat16,
                                                       device="cuda"), alpha=alpha)
            rows = slice(offsets[0], offsets[-1])
            torch_swiglu = (torch.nn.functional.silu(unfused[rows, : n // 2].float())
                            * unfused[rows, n // 2:].float()).bfloat16()
            differ = (c[rows] != torch_swiglu).float().mean()
            assert differ < 0.01, (label, trial, float(differ))  # silu's exponential: a rare last-bit difference
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemm.moe_grouped_gemm(*call, status=status, alpha=alpha, activation="swiglu")
        for trial in range(3):
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            c.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            mismatches, _, first, _, _ = moe.compare_with_exact(*call, alpha, "swiglu")
            assert mismatches == 0, (label, "replay", trial, first)
    finally:
        monkeypatch.delenv("NVFP4_MOE_CONFIG", raising=False)
        gemm.reset_runtime()


# -----------------------------------------------------------------------------
# K any multiple of 64 (k_tail builds: hopper.moe.moe_k_config) and fp16's overflow boundary
# -----------------------------------------------------------------------------
# (forced config or None for the choice, (T, G, N, K)): every config the choice may run, at K =
# 64, 192, 1408, 2880 (a runtime k-tile count; split-K shares uneven, some ranks with none;
# 128-wide k-tiles narrowed to 64 where K % 128 != 0), and K % 256 == 0 beside them
K_TAIL = [
    ("swap_ab_t32", (64, 64, 256, 64)),
    ("swap_ab_t32_k128", (96, 32, 512, 192)),       # K % 128 != 0: 64-wide k-tiles
    ("swap_ab_t32_k128", (96, 32, 512, 1408)),      # 11 128-wide k-tiles
    ("swap_ab_t32_split_k2", (8, 16, 512, 2880)),   # 45 k-tiles over 2 ranks
    ("swap_ab_t32_split_k4", (40, 64, 256, 1408)),  # 22 over 4
    ("swap_ab_t32_split_k4", (8, 8, 256, 192)),     # 3 over 4: a rank without k-tiles
    ("swap_ab_t64", (2048, 40, 256, 1408)),
    ("swap_ab_split_k", (300, 4, 256, 64)),         # 1 over 2
    ("swap_ab_one_round", (512, 2, 3072, 2880)),
    ("swap_ab_one_round_k128", (512, 2, 1024, 1408)),
    ("swap_ab_variable", (2000, 16, 512, 192)),
    ("swap_ab_variable", (1024, 8, 2048, 1408)),
    (None, (1, 64, 2048, 1408)),     # a 1408-K layer's down GEMM at 1, 16, 128, 1024 tokens: the choice
    (None, (16, 64, 2048, 1408)),
    (None, (128, 64, 2048, 1408)),
    (None, (1024, 64, 2048, 1408)),
    (None, (256, 8, 512, 2880)),
    (None, (512, 16, 512, 1024)),    # K % 256 == 0: the kernels of before
]


def _forced(monkeypatch, label):
    if label is None:
        monkeypatch.delenv("NVFP4_MOE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("NVFP4_MOE_CONFIG", label)
    gemm.reset_runtime()


@pytest.mark.parametrize("path", ["fp4", "w4a16"])
@pytest.mark.parametrize("label,family", K_TAIL, ids=[f"{label or 'chosen'}_T{f[0]}_K{f[3]}" for label, f in K_TAIL])
def test_k_any_multiple_of_64_matches_the_exact_decode_and_replays(label, family, path, monkeypatch):
    """Random routings against the exact decode (moe.compare_with_exact: the fp32 bound, alpha
    [G] with fp16 c, [G, 2] with bf16 c, none), status 0, rows outside the groups untouched; the
    plan's config the k_tail build exactly where K is not a multiple of its k_multiple; then
    one CUDA graph replayed over new routings."""
    if SM100:
        pytest.skip("sm_90 configs (sm_100 takes K % 256 == 0)")
    _forced(monkeypatch, label)
    try:
        tokens, groups, n, k = family
        rng = random.Random(k + tokens)
        inputs = moe.random_moe_inputs(tokens, groups, n, k, sfa_layout=None if path == "w4a16" else "plain",
                                       generator=torch.Generator().manual_seed(k))
        status = torch.full((1,), 7, dtype=torch.int32, device="cuda")
        for trial, (alpha_shape, dtype) in enumerate((("expert", torch.float16), ("halves", torch.bfloat16),
                                                      (None, torch.float16))):
            inputs["c"] = torch.full((tokens, n), float("nan"), dtype=dtype, device="cuda")
            alpha = None if alpha_shape is None else (torch.rand(
                (groups,) if alpha_shape == "expert" else (groups, 2), generator=torch.Generator().manual_seed(trial))
                * 4 + 2.0**-6).cuda()
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            gemm.moe_grouped_gemm(**inputs, status=status, alpha=alpha)
            torch.cuda.synchronize()
            assert int(status.item()) == 0
            mismatches, _, first, _, _ = moe.compare_with_exact(
                *(inputs[name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")), alpha)
            assert mismatches == 0, (label, family, path, trial, first)
            outside = torch.ones(tokens, dtype=torch.bool, device="cuda")
            outside[offsets[0]:offsets[-1]] = False
            assert torch.isnan(inputs["c"][outside]).all()
        plans = list(moe.RUNTIME.plans.entries.values())
        assert plans and all(plan.config.k_tail == (k % hopper_k_multiple(plan.config) != 0) for plan in plans)
        assert all(not core.is_demoted(plan.kernel_key) for plan in plans)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemm.moe_grouped_gemm(**inputs, status=status)
        for trial in range(4):
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            inputs["c"].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert int(status.item()) == 0
            mismatches, _, first, _, _ = moe.compare_with_exact(
                *(inputs[name] for name in ("a", "sfa", "b", "sfb", "offsets", "c")))
            assert mismatches == 0, (label, family, path, "replay", trial, first)
    finally:
        monkeypatch.delenv("NVFP4_MOE_CONFIG", raising=False)
        gemm.reset_runtime()


def hopper_k_multiple(config):
    """K's multiple of the kernels of before for `config` (k_tail's own is its k-tile)."""
    import dataclasses

    return dataclasses.replace(config, k_tail=False).k_multiple


# every config the choice may run (NVFP4_MOE_CONFIG), at K = 1408 (k_tail) and 1024
BOUNDARY_CONFIGS = ["swap_ab_t32", "swap_ab_t32_k128", "swap_ab_t32_split_k2", "swap_ab_t32_split_k4", "swap_ab_t64",
                    "swap_ab_split_k", "swap_ab_one_round", "swap_ab_one_round_k128", "swap_ab_variable"]


@pytest.mark.parametrize("k", [1408, 1024])
@pytest.mark.parametrize("path", ["fp4", "w4a16"])
@pytest.mark.parametrize("label", BOUNDARY_CONFIGS)
def test_fp16_boundary_bit_for_bit_as_the_exact_decode(label, path, k, monkeypatch):
    """Sums exact in fp32 (helpers.fp16_boundary_case: two products per output, one in K's last
    k-tile) times alphas that put alpha x s at 65504, 65519.996, 65520, past it, and at a
    double-rounding case: c is the exact decode's bit for bit (the same infs), in fp16 with
    alpha [G] and [G, 2] and in bf16, for every config."""
    if SM100:
        pytest.skip("sm_90 epilogues")
    _forced(monkeypatch, label)
    try:
        tokens, groups = 64, 8
        for alpha_mode, dtype in (("expert", torch.float16), ("halves", torch.float16), ("halves", torch.bfloat16)):
            inputs, alpha, sums, _ = fp16_boundary_case(tokens, groups, k, w4a16=path == "w4a16",
                                                        alpha_mode=alpha_mode, device="cuda")
            c = torch.full((tokens, 256), float("nan"), dtype=dtype, device="cuda")
            gemm.moe_grouped_gemm(**inputs, c=c, alpha=alpha)
            expected = moe.moe_reference(**inputs, c=torch.zeros_like(c), alpha=alpha)
            formula = epilogue_of_sums(sums.cuda(), moe.alpha_columns(alpha, 256).repeat_interleave(
                tokens // groups, dim=0), dtype)
            torch.cuda.synchronize()
            assert torch.equal(expected.view(torch.int16), formula.view(torch.int16))
            differ = (c.view(torch.int16) != expected.view(torch.int16)).nonzero()
            assert differ.numel() == 0, (label, path, k, alpha_mode, dtype, differ[:4].tolist())
            # not the self-check's exact result in place of a demoted kernel's
            assert not any(core.is_demoted(plan.kernel_key) for plan in moe.RUNTIME.plans.entries.values()), core.demotions()
    finally:
        monkeypatch.delenv("NVFP4_MOE_CONFIG", raising=False)
        gemm.reset_runtime()


# -----------------------------------------------------------------------------
# W4A16 with the weights packed for the fragment (b_layout="fragment", nvfp4_group_gemm.weight_layout)
# -----------------------------------------------------------------------------
FRAGMENT = [(label, family) for label, family in W4A16 if label in
            ("swap_ab_t32", "swap_ab_t32_k128", "swap_ab_t32_split_k4", "swap_ab_t64", "swap_ab_variable")]


@pytest.mark.parametrize("label,family", FRAGMENT, ids=[f"{label}_G{family[1]}" for label, family in FRAGMENT])
def test_the_fragment_layout_gives_the_plain_layouts_bits(label, family, monkeypatch):
    """The same weights packed for the fragment (pack_fragment) and read with
    b_layout="fragment": c bit for bit as from the plain weights (the decode places the same
    bf16 values; the same k-loop and epilogue), for plain rows, for mapped rows with SwiGLU in
    the epilogue, and for scattered rows; within the exact product's bound; and a CUDA graph
    replayed over new routings."""
    from nvfp4_group_gemm.weight_layout import pack_fragment

    if SM100:
        pytest.skip("W4A16 runs on sm_90 only")
    _forced(monkeypatch, label)
    try:
        tokens, groups, n, k = family
        rng, generator = random.Random(41), torch.Generator().manual_seed(19)
        inputs = moe.random_moe_inputs(tokens, groups, n, k, sfa_layout=None, generator=generator)
        packed = pack_fragment(inputs["b"])
        alpha = _random_alpha(groups, "halves", 1)
        a_rows = torch.randint(0, tokens, (tokens,), generator=generator).cuda()
        c_rows = torch.randperm(tokens, generator=generator).cuda()
        cases = [("plain rows", {}, n), ("swiglu, gathered", {"a_rows": a_rows, "activation": "swiglu"}, n // 2),
                 ("scattered", {"c_rows": c_rows}, n)]
        for tag, extra, columns in cases:
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            results = []
            for b, layout in ((inputs["b"], None), (packed, "fragment")):
                c = torch.full((tokens, columns), float("nan"), dtype=torch.bfloat16, device="cuda")
                gemm.moe_grouped_gemm(inputs["a"], None, b, inputs["sfb"], inputs["offsets"], c, alpha=alpha,
                                      b_layout=layout, **extra)
                results.append(c)
            torch.cuda.synchronize()
            assert torch.equal(results[0].nan_to_num(7.0), results[1].nan_to_num(7.0)), (label, tag)
            if not extra:
                mismatches, _, first, _, _ = moe.compare_with_exact(inputs["a"], None, inputs["b"], inputs["sfb"],
                                                                    inputs["offsets"], results[1], alpha)
                assert mismatches == 0, (label, first)
        c = torch.full((tokens, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemm.moe_grouped_gemm(inputs["a"], None, packed, inputs["sfb"], inputs["offsets"], c, alpha=alpha,
                                  b_layout="fragment")
        for trial in range(3):
            offsets = moe.random_routing(tokens, groups, rng)
            inputs["offsets"].copy_(torch.tensor(offsets, dtype=torch.int32))
            c.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            mismatches, _, first, _, _ = moe.compare_with_exact(inputs["a"], None, inputs["b"], inputs["sfb"],
                                                                inputs["offsets"], c, alpha)
            assert mismatches == 0, (label, "replay", trial, first)
        assert not core.demotions(), core.demotions()
    finally:
        monkeypatch.delenv("NVFP4_MOE_CONFIG", raising=False)
        gemm.reset_runtime()
