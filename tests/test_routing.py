"""Each architecture's routing (nvfp4_group_gemm.routing) on hand-made logits: the choice, the
weights and config.json's fields; transformers' own blocks on real exports: tests/test_export.py."""

import pytest
import torch

from nvfp4_group_gemm.routing import Routing, route


def by_expert(ids, weights):
    """Each token's k (expert, weight) pairs in expert order (route gives them in no order)."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def test_softmax_routing_renormalizes_only_where_asked():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    ids, weights = by_expert(*route(logits, Routing("softmax", 2, renormalize=False)))
    probabilities = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]] and torch.allclose(weights[0], probabilities[[1, 2]])
    ids, weights = by_expert(*route(logits, Routing("softmax", 2, renormalize=True)))
    # Mixtral's order (top-k of the logits, softmax over the k) gives the same weights
    assert ids.tolist() == [[1, 2]] and torch.allclose(weights[0], torch.softmax(logits[0, [1, 2]], -1))


def test_deepseek_routing_chooses_within_the_best_groups_and_weighs_unbiased_scores():
    """8 experts in 4 groups of 2, best 2 groups, top-3. A group's score is the sum of its two
    best biased scores: expert 0 has the best single score, its group (0.96) loses to groups 3
    (1.3) and 1 (1.2), so it is not chosen. The bias moves the choice, not the weights (the
    unbiased sigmoid scores, renormalized, x 2.5)."""
    routing = Routing("sigmoid", 3, renormalize=True, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    scores = torch.tensor([[0.95, 0.01, 0.62, 0.58, 0.5, 0.45, 0.7, 0.6]])
    ids, weights = route(scores.logit(), routing)
    assert sorted(ids[0].tolist()) == [2, 6, 7]
    assert torch.allclose(weights[0], scores[0, ids[0]] / scores[0, ids[0]].sum() * 2.5)
    # group 1 weak (0.6): unbiased, groups 3 (1.3) and 0 (0.96) over 2 (0.95) -> experts 0, 6, 7;
    # a bias of 0.1 on expert 5 lifts group 2 to 1.05 -> experts 6, 7 and 5 (0.55 biased, over 4)
    scores = torch.tensor([[0.95, 0.01, 0.3, 0.3, 0.5, 0.45, 0.7, 0.6]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    assert sorted(route(scores.logit(), routing)[0][0].tolist()) == [0, 6, 7]
    ids, weights = route(scores.logit(), routing, bias)
    assert sorted(ids[0].tolist()) == [5, 6, 7]
    assert torch.allclose(weights[0], scores[0, ids[0]] / scores[0, ids[0]].sum() * 2.5)
    _, unnormalized = route(scores.logit(), Routing("sigmoid", 3, renormalize=False, n_group=4, topk_group=2), bias)
    assert torch.allclose(unnormalized[0], scores[0, ids[0]])


def test_the_routing_of_a_config_and_its_refusals():
    qwen = Routing.from_config({"architectures": ["Qwen3MoeForCausalLM"], "num_experts_per_tok": 8,
                                "norm_topk_prob": False})
    assert qwen == Routing("softmax", 8, renormalize=False)
    mixtral = Routing.from_config({"architectures": ["MixtralForCausalLM"], "num_experts_per_tok": 2})
    assert mixtral == Routing("softmax", 2, renormalize=True)
    deepseek = Routing.from_config({"architectures": ["DeepseekV3ForCausalLM"], "num_experts_per_tok": 8,
                                    "norm_topk_prob": True, "n_group": 8, "topk_group": 4,
                                    "routed_scaling_factor": 2.5})
    assert deepseek == Routing("sigmoid", 8, True, 8, 4, 2.5)
    with pytest.raises(ValueError, match=r"architectures = \['LlamaForCausalLM'\]: no known MoE routing"):
        Routing.from_config({"architectures": ["LlamaForCausalLM"], "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match=r"topk_group = 5: must be in 1..n_group = 4"):
        Routing("sigmoid", 2, True, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match=r"10 experts do not split into n_group = 4 groups"):
        route(torch.zeros(1, 10), Routing("sigmoid", 2, True, n_group=4, topk_group=2))


def test_renormalized_softmax_routing_is_the_softmax_of_the_top_logits_in_two_ops(monkeypatch):
    """Renormalized softmax top-k (Qwen3-MoE with norm_topk_prob, Mixtral): the softmax of the k
    largest logits, the same experts and, within fp32 rounding, the same weights as the k
    largest probabilities over their sum (transformers' form); two kernels, top-k and softmax."""
    from test_moe_layer import _kernel_ops

    routing = Routing("softmax", 8, renormalize=True)
    logits = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 3
    ids, weights = by_expert(*route(logits, routing))
    probabilities = torch.softmax(logits, dim=-1)
    want_ids, want_weights = by_expert(*torch.topk(probabilities, 8, dim=-1)[::-1])
    assert torch.equal(ids, want_ids)
    assert torch.allclose(weights, want_weights / want_weights.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    assert _kernel_ops(lambda: route(logits, routing)) == ["aten.topk.default", "aten._softmax.default"]
    # sorted=False: the k come in no order of score (torch's sort of the k results is one kernel more)
    sorts = []
    original = torch.topk

    def recording(*args, **kwargs):
        sorts.append(kwargs.get("sorted", True))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "topk", recording)
    route(logits, routing)
    route(logits, Routing("softmax", 8, renormalize=False))
    assert sorts == [False, False]
