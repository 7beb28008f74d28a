"""No false demotion on real data (an H100/H200): every kernel of the sm_90 chain, forced, runs
random group sets with general e4m3 scales (G up to 32, M 1-1000, K up to 7168, every e2m1
code, scales 2^-6 .. 2^2 x 1.875 as a real checkpoint has, its sums within fp16) with the first-use self-check on for every
set; none is demoted, and every output lies within the fp32 accumulation bound of the exact
sum. NVFP4_WIDE_SETS sets the number of group sets per kernel (default 100)."""

import os
import random

import pytest
import torch

from nvfp4_group_gemm import core as submission
from nvfp4_group_gemm import runtime
from reference import create_reordered_scale_factor_tensor, exact_mismatches

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 (Hopper) GPU",
)

SETS = int(os.environ.get("NVFP4_WIDE_SETS", "100"))
GROUP_COUNTS = (1, 2, 8, 16, 32)  # each G compiles its kernels once: a few values cover 1..32
# e4m3 bytes of 2^-6 (exponent field 1) up to 2^2 x 1.875 (exponent field 9): at K = 7168 the
# sums stay within fp16 (larger scales overflow most outputs to inf on both sides, which checks
# nothing)
SCALE_BYTES = (0x08, 0x50)


def wide_group_set(rng: random.Random, device="cuda"):
    torch.manual_seed(rng.randrange(1 << 31))
    abc, plain, reordered, sizes = [], [], [], []
    for _ in range(rng.choice(GROUP_COUNTS)):
        m, n, k = rng.randint(1, 1000), 128 * rng.randint(1, 8), 256 * rng.randint(1, 28)
        a = torch.randint(0, 256, (m, k // 2, 1), dtype=torch.uint8, device=device)
        b = torch.randint(0, 256, (n, k // 2, 1), dtype=torch.uint8, device=device)
        sfa = torch.randint(*SCALE_BYTES, (m, k // 16, 1), dtype=torch.uint8).view(torch.float8_e4m3fn)
        sfb = torch.randint(*SCALE_BYTES, (n, k // 16, 1), dtype=torch.uint8).view(torch.float8_e4m3fn)
        c = torch.full((m, n, 1), float("nan"), dtype=torch.float16, device=device)
        abc.append((a.view(torch.float4_e2m1fn_x2), b.view(torch.float4_e2m1fn_x2), c))
        plain.append((sfa.to(device), sfb.to(device)))
        reordered.append((create_reordered_scale_factor_tensor(1, m, k, sfa, device=device),
                          create_reordered_scale_factor_tensor(1, n, k, sfb, device=device)))
        sizes.append((m, n, k, 1))
    return abc, plain, reordered, sizes


def forced(link: int):
    """The sm_90 backend whose chains start at their `link`-th kernel."""
    from nvfp4_group_gemm import hopper

    class Forced(hopper.backend.Sm90Backend):
        def kernel_chain(self, problem_sizes):
            return list(super().kernel_chain(problem_sizes))[link:]

    return Forced()


@pytest.mark.parametrize("link", [0, 1], ids=["automatic_choice", "in_gemm_decode"])
def test_no_false_demotion_on_general_scales(link, monkeypatch, capsys):
    backend = forced(link)
    monkeypatch.setattr(runtime, "_BACKEND_BY_DEVICE", {torch.cuda.current_device(): backend})
    monkeypatch.setattr(submission, "SELF_CHECK", True)
    rng = random.Random(2024 + link)
    kernels, bounded = set(), 0
    for index in range(SETS):
        data = wide_group_set(rng)
        submission.SELF_CHECKED.clear()  # every set's first call is checked
        outputs = runtime.custom_kernel(data)
        torch.cuda.synchronize()
        kernels.add(runtime.RUNTIME.bindings.get(runtime.input_key(data)).plan.choice.describe())
        assert submission.DEMOTED == {}, (index, data[3], capsys.readouterr().err)
        counts = exact_mismatches(data, outputs)
        assert sum(c[0] for c in counts) == 0, (index, data[3], counts)
        bounded += sum(bound is not None for bound in submission.accumulation_bounds(data, 1))
    with capsys.disabled():
        print(f"\n{SETS} wide-scale group sets, self-check on every set, 0 demotions, every output within "
              f"the fp32 bound of the exact sum; {bounded} groups needed the bound; kernels: {sorted(kernels)}")
