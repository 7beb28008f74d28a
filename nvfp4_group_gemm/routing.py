"""A MoE router's choice of experts, as each architecture makes it, in torch ops only (no host
read: a CUDA graph captured with it replays for any input).

    routing = Routing.from_config(config)               # config.json as a dict
    topk_ids, topk_weights = route(logits, routing, e_score_correction_bias)

`logits` are the router's fp32 scores [T, E] (hidden states @ router_weight^T). What comes back
is vLLM's `fused_experts` convention: each token's k experts [T, k] (int64) and their weights
[T, k] (fp32), the k in no particular order.

    softmax   Qwen3-MoE, Mixtral: softmax over the E logits, the k largest probabilities;
              divided by their sum where `renormalize` (Qwen3-MoE's `norm_topk_prob`; Mixtral
              always, which equals its softmax over the top-k logits)
    sigmoid   DeepSeek-V3: sigmoid scores; the choice reads them plus `e_score_correction_bias`:
              the `topk_group` best of `n_group` expert groups (a group's score: the sum of its
              two best biased scores), then the k best biased scores within those groups (the
              others masked to 0, as transformers masks them); the weights are the chosen
              experts' unbiased scores, divided by their sum (+ 1e-20) where `renormalize`, times
              `routed_scaling_factor`
"""

from __future__ import annotations

import dataclasses

import torch

SCORINGS = ("softmax", "sigmoid")
# config.json's architectures -> the routing their MoE blocks run (transformers' own blocks:
# Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, DeepseekV3MoE)
ARCHITECTURE_SCORING = {
    "Qwen3MoeForCausalLM": "softmax",
    "MixtralForCausalLM": "softmax",
    "DeepseekV3ForCausalLM": "sigmoid",
}


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a MoE layer chooses and weighs each token's experts (module docstring)."""

    scoring: str  # "softmax" or "sigmoid"
    top_k: int
    renormalize: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"Routing: scoring = {self.scoring!r}: must be one of {SCORINGS}")
        if self.top_k < 1:
            raise ValueError(f"Routing: top_k = {self.top_k}: must be >= 1")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"Routing: topk_group = {self.topk_group}: must be in 1..n_group = {self.n_group}")

    @classmethod
    def from_config(cls, config: dict) -> Routing:
        """The routing of config.json's architecture (its `architectures[0]`), with its fields:
        `num_experts_per_tok`, `norm_topk_prob`, and DeepSeek-V3's `n_group`, `topk_group`,
        `routed_scaling_factor`."""
        architecture = (config.get("architectures") or [None])[0]
        scoring = ARCHITECTURE_SCORING.get(architecture)
        if scoring is None:
            raise ValueError(f"config.json: architectures = {config.get('architectures')}: no known MoE routing; "
                             f"known: {', '.join(ARCHITECTURE_SCORING)}")
        if "num_experts_per_tok" not in config:
            raise ValueError(f"config.json: {architecture} without num_experts_per_tok (the router's top-k)")
        top_k = int(config["num_experts_per_tok"])
        if architecture == "MixtralForCausalLM":
            return cls("softmax", top_k, renormalize=True)
        if scoring == "softmax":
            return cls("softmax", top_k, renormalize=bool(config.get("norm_topk_prob", False)))
        return cls("sigmoid", top_k, renormalize=bool(config.get("norm_topk_prob", True)),
                   n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
                   routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))


def route(logits: torch.Tensor, routing: Routing, e_score_correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int64 [T, k], topk_weights fp32 [T, k]) of the router's logits [T, E] (module
    docstring). Torch ops only."""
    logits = logits.float()
    if routing.scoring == "softmax":
        # the k experts in no particular order (sorted=False): the layer sorts the pairs by
        # expert anyway, and sorting them by score was one more kernel (3.8 µs at one token)
        if routing.renormalize:
            # the k largest probabilities over their sum is the softmax of the k largest logits
            # (the normalizer cancels): two kernels where softmax, top-k, sum and division are four
            top_logits, ids = torch.topk(logits, routing.top_k, dim=-1, sorted=False)
            return ids, torch.softmax(top_logits, dim=-1)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), routing.top_k, dim=-1, sorted=False)
        return ids, weights
    scores = torch.sigmoid(logits)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    tokens, experts = choice.shape
    if experts % routing.n_group:
        raise ValueError(f"route: {experts} experts do not split into n_group = {routing.n_group} groups")
    if routing.n_group > 1:
        grouped = choice.view(tokens, routing.n_group, experts // routing.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best_groups = torch.topk(group_scores, routing.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(tokens, experts)
        choice = choice.masked_fill(expert_mask == 0, 0.0)
    ids = torch.topk(choice, routing.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * routing.routed_scaling_factor
