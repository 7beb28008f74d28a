"""The swap-AB time model in runs of equal tiles is the per-tile list schedule, exactly: the
same float makespan as one heap step per tile, on random size sets of every candidate."""

import heapq
import random

import pytest

from nvfp4_group_gemm import hopper
from nvfp4_group_gemm.hopper import schedules


def per_tile_makespan(problem_sizes, config, num_sms):
    loads = [0.0] * num_sms
    for cost in hopper.swap_ab_tile_costs(problem_sizes, config):
        heapq.heappush(loads, heapq.heappop(loads) + cost)
    return max(loads)


CONFIGS = (*hopper.SWAP_AB_CANDIDATES, hopper.SWAP_AB_T112_CONFIG, hopper.SWAP_AB_ONE_ROUND_CONFIG)


@pytest.mark.parametrize("seed", range(4))
def test_runs_give_the_per_tile_schedule_exactly(seed):
    rng = random.Random(seed)
    for _ in range(200):
        sizes = [(rng.choice([0, 1, rng.randint(1, 1100)]), 128 * rng.randint(1, 56), 256 * rng.randint(1, 28), 1)
                 for _ in range(rng.randint(1, 16))]
        num_sms = rng.choice([1, 7, 114, 132, 200])
        for config in CONFIGS:
            assert hopper.swap_ab_time_model(sizes, config, num_sms) == per_tile_makespan(sizes, config, num_sms)


def test_runs_count_every_tile():
    sizes = [(300, 1024, 512, 1), (0, 512, 256, 1), (40, 256, 768, 1)]
    for config in CONFIGS:
        runs = schedules.swap_ab_cost_runs(sizes, config)
        assert sum(count for _, count in runs) == len(hopper.swap_ab_tile_costs(sizes, config))
        assert sorted(c for c, n in runs for _ in range(n)) == sorted(hopper.swap_ab_tile_costs(sizes, config))


def test_the_chain_makes_its_fallback_links_only_when_reached(monkeypatch):
    backend = hopper.make_backend()
    monkeypatch.setattr(hopper.backend, "current_num_sms", lambda: 132)
    asked = []
    monkeypatch.setattr(hopper.backend, "choose_config", lambda sizes, sms: asked.append(sizes) or hopper.SM90_CONFIG)
    sizes = ((40, 4096, 7168, 1), (88, 4096, 7168, 1))
    chain = backend.kernel_chain(sizes)
    assert chain[0].name == "swap_ab" and asked == []
    assert [c.name for c in chain] == ["swap_ab", "in_gemm_decode", "exact_decode"] and len(asked) == 1


def test_fastest_swap_ab_config_is_the_time_models_minimum():
    """The bounded search picks what min() over every candidate's modelled time picks (the
    first on a tie), on random size sets and SM counts."""
    rng = random.Random(11)
    with_t112 = (*hopper.SWAP_AB_CANDIDATES, hopper.SWAP_AB_T112_CONFIG)
    for _ in range(1500):
        sizes = [(rng.choice((0, rng.randint(1, 1100), rng.randint(1, 300))),
                  rng.choice((128, 256, 1024, 4096, 7168)), rng.choice((256, 512, 2048, 7168)), 1)
                 for _ in range(rng.randint(1, 10))]
        sms = rng.choice((132, 114, 78))
        for candidates in (hopper.SWAP_AB_CANDIDATES, with_t112):
            want = min(candidates, key=lambda config: schedules.swap_ab_time_model(sizes, config, sms))
            assert schedules.fastest_swap_ab_config(sizes, candidates, sms) == want, (sizes, sms)
