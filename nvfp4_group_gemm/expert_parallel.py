"""Expert parallelism across processes (torch.distributed): one MoE layer's experts split over the
ranks of a process group, every token routed over all the experts, the ranks' work combined.

    layer = ExpertParallelMoe.from_pretrained(path, layer, group=None, device="cuda",
                                              combine="all_to_all")   # reads this rank's experts only
    y = layer(x)                                  # x [T, H] bf16 -> y [T, H] bf16
    y = layer.experts_output(x, topk_ids, topk_weights)   # a caller that routes itself

Each rank holds the experts of its range (`expert_ranges[rank]`, contiguous; uneven counts are
fine: split_experts(16, 3) = 0..5, 6..10, 11..15) as a MoeFfn (nvfp4_group_gemm.moe_layer): its
router scores all E experts, its `experts_output` computes this rank's experts' pairs and adds
nothing for the others. This module only moves rows and sums; routing and the GEMMs are
MoeFfn's.

Combine forms (`combine`):

    all_reduce          every rank holds every token (the same x on every rank, e.g. after
                        tensor-parallel attention): each computes its experts' part of every
                        token's output, in fp32, and one all-reduce sums the parts. No host read:
                        graph-capturable where the backend's all-reduce is (NCCL).
    all_to_all          dispatch / combine (what large expert-parallel servers run): each rank
                        holds its own tokens (any count per rank); a token goes once to each rank
                        that owns one of its k experts (its row, its k global expert ids and
                        weights packed into one byte row), that rank returns the token's weighted
                        sum over its own experts, and the token's rank adds the returned rows.
                        One host read per call: all_to_all_single with uneven splits takes the
                        split sizes as host integers (NCCL needs them at launch), so the per-peer
                        counts (exchanged on the device first) are copied to the host once. Not
                        graph-capturable.
    all_to_all_padded   the same dispatch / combine at a fixed capacity: every rank sends each
                        peer all its T rows (T the same on every rank: a caller with fewer tokens
                        pads), so the splits are equal and known without a host read
                        (graph-capturable on NCCL). The cost is bandwidth: T rows to every peer,
                        where all_to_all sends a token only to the ranks it routes to (on
                        average T (1 - (1 - 1/N)^k) rows per peer: 0.66 T at N = 8, k = 8; 0.12 T
                        at N = 64). Rows routed nowhere on a peer cost it no GEMM work (they sort
                        past its offsets[E]).

The parts are summed in `partial_dtype`: fp32 (the default) keeps the one-process layer's single
rounding to bf16 at the end, so the result differs from it only by the order of the fp32 sum
over the k contributions (per rank, then over the ranks): at most one bf16 unit where the two
fp32 sums straddle a rounding boundary. bf16 halves the bytes moved (what servers send) and
rounds each rank's part once more. Every form sums in a fixed order (the all-to-all forms add
the peers' rows in rank order), so a call is repeatable bit for bit.

The shared expert (DeepSeek-V3) is computed once per token: in the all-to-all forms by each rank
for its own tokens (overlapping the dispatch), in the all-reduce form by one rank per token,
the tokens split in contiguous chunks over the ranks (rank r: chunk r of ceil(T / N)), added to
that rank's part before the all-reduce.

W4A4 (`activations="nvfp4"`): the one-process layer quantizes each projection's input with the
largest calibrated input scale over all the experts; from_pretrained takes that maximum over the
ranks (one all-reduce at load) so every rank quantizes as the whole layer does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .moe_layer import MoeFfn

COMBINES = ("all_reduce", "all_to_all", "all_to_all_padded")
PARTIAL_DTYPES = (torch.float32, torch.bfloat16)


def split_experts(num_experts: int, ranks: int) -> list[range]:
    """Contiguous expert ranges, one per rank, as even as possible (the first num_experts % ranks
    ranks hold one more): split_experts(16, 3) = [range(0, 6), range(6, 11), range(11, 16)]."""
    if ranks < 1 or num_experts < ranks:
        raise ValueError(f"split_experts: {num_experts} experts over {ranks} ranks: need 1 <= ranks <= experts "
                         "(every rank holds at least one expert)")
    base, extra = divmod(num_experts, ranks)
    bounds = [0]
    for rank in range(ranks):
        bounds.append(bounds[-1] + base + (rank < extra))
    return [range(start, stop) for start, stop in itertools.pairwise(bounds)]


def check_expert_ranges(expert_ranges: Sequence[range], world_size: int, num_experts: int) -> list[range]:
    """The ranges as a list, or a ValueError naming the rule broken: one range per rank of the
    group, each of step 1 and non-empty, together 0 .. num_experts - 1 in rank order."""
    ranges = list(expert_ranges)
    if len(ranges) != world_size:
        raise ValueError(f"expert_ranges: {len(ranges)} ranges for a process group of {world_size} ranks: need one "
                         "range per rank")
    expected_start = 0
    for rank, experts in enumerate(ranges):
        if not isinstance(experts, range) or experts.step != 1 or len(experts) == 0:
            raise ValueError(f"expert_ranges[{rank}] = {experts!r}: must be a non-empty range of step 1")
        if experts.start != expected_start:
            raise ValueError(f"expert_ranges[{rank}] = {experts!r}: must start at {expected_start} (the ranges tile "
                             f"the {num_experts} experts in rank order)")
        expected_start = experts.stop
    if expected_start != num_experts:
        raise ValueError(f"expert_ranges: end at expert {expected_start}: the layer has {num_experts} experts (the "
                         "ranges must cover every one)")
    return ranges


def pack_rows(rows: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """One byte row per token, [T, 2 H + 8 k] uint8: its bf16 row, its k expert ids (int32) and
    weights (fp32), so that one collective moves all three."""
    return torch.cat([rows.to(torch.bfloat16).contiguous().view(torch.uint8),
                      topk_ids.to(torch.int32).contiguous().view(torch.uint8),
                      topk_weights.to(torch.float32).contiguous().view(torch.uint8)], dim=1)


def unpack_rows(packed: torch.Tensor, hidden: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_rows' inverse: (rows bf16 [R, H], topk_ids int32 [R, k], topk_weights fp32 [R, k])."""
    ids_end = 2 * hidden + 4 * top_k
    return (packed[:, :2 * hidden].contiguous().view(torch.bfloat16),
            packed[:, 2 * hidden:ids_end].contiguous().view(torch.int32),
            packed[:, ids_end:].contiguous().view(torch.float32))


class ExpertParallelMoe:
    """A MoE layer whose experts are split over a process group's ranks (module docstring).

    `local` is this rank's MoeFfn: the experts `expert_ranges[rank]` (local.first_local their
    first), the router over every expert, and the shared expert if the layer has one (each rank
    holds it; the forms decide which rank computes it for which token). `group` None: the
    default process group."""

    def __init__(self, local: MoeFfn, expert_ranges: Sequence[range], group=None, combine: str = "all_to_all",
                 partial_dtype: torch.dtype = torch.float32):
        if combine not in COMBINES:
            raise ValueError(f"ExpertParallelMoe: combine = {combine!r}: must be one of {COMBINES}")
        if partial_dtype not in PARTIAL_DTYPES:
            raise ValueError(f"ExpertParallelMoe: partial_dtype = {partial_dtype}: must be one of {PARTIAL_DTYPES}")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_experts = local.router_weight.shape[0]
        self.expert_ranges = check_expert_ranges(expert_ranges, self.world_size, self.num_experts)
        mine = self.expert_ranges[self.rank]
        if local.first_local != mine.start or local.experts != len(mine):
            raise ValueError(f"ExpertParallelMoe: the local layer holds experts {local.first_local}.."
                             f"{local.first_local + local.experts - 1}: expert_ranges[{self.rank}] = {mine!r} says "
                             f"{mine.start}..{mine.stop - 1}")
        self.local = local
        self.combine = combine
        self.partial_dtype = partial_dtype
        self.hidden, self.top_k = local.hidden, local.top_k
        device = local.router_weight.device
        # each expert's rank, on the device: the dispatch's destination of each pair
        sizes = torch.tensor([len(experts) for experts in self.expert_ranges], device=device)
        self.owner_of_expert = torch.repeat_interleave(torch.arange(self.world_size, device=device), sizes)

    @classmethod
    def from_pretrained(cls, path, layer: int, group=None, device="cuda", activations: str = "bf16",
                        combine: str = "all_to_all", expert_ranges: Sequence[range] | None = None,
                        partial_dtype: torch.dtype = torch.float32) -> ExpertParallelMoe:
        """MoE layer `layer` of the ModelOpt NVFP4 export at `path`, this rank's experts only
        (`expert_ranges[rank]`; default split_experts over the group) read onto `device`."""
        from .export import open_export

        export = open_export(path)
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if expert_ranges is None:
            expert_ranges = split_experts(export.num_experts, world_size)
        ranges = check_expert_ranges(expert_ranges, world_size, export.num_experts)
        weights = export.load_moe_layer(layer, device=device, experts=ranges[rank])
        # every rank holds the shared expert: the combine form decides who computes it
        local = MoeFfn.from_weights(weights, activations, with_shared=True)
        if activations == "nvfp4":
            share_input_scales(local, group)
        return cls(local, ranges, group, combine, partial_dtype)

    # -- the forward --------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16 -> y [T, H] bf16: routing (MoeFfn.route, over every expert), the routed
        experts on their ranks, the shared expert once per token."""
        topk_ids, topk_weights = self.local.route(x)
        return self._forward(x, topk_ids, topk_weights, with_shared=self.local.shared is not None)

    def experts_output(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum (no shared expert) for a caller that routes itself:
        hidden_states [T, H] bf16, topk_ids [T, k] global expert ids, topk_weights [T, k]; bf16."""
        return self._forward(hidden_states, topk_ids, topk_weights, with_shared=False)

    def _forward(self, x, topk_ids, topk_weights, with_shared: bool) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"ExpertParallelMoe: hidden_states.shape = {tuple(x.shape)}: must be [T, {self.hidden}]")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(f"ExpertParallelMoe: topk_ids.shape = {tuple(topk_ids.shape)}, topk_weights.shape = "
                             f"{tuple(topk_weights.shape)}: both must be [T, k] with T = {x.shape[0]}")
        if self.combine == "all_reduce":
            if x.shape[0] == 0:  # every rank holds the same (no) tokens: nothing to sum
                return x.new_empty(0, self.hidden, dtype=torch.bfloat16)
            out = self._all_reduce_form(x, topk_ids, topk_weights, with_shared)
        else:
            out = self._dispatch_form(x, topk_ids, topk_weights, with_shared)
        return out.to(torch.bfloat16)

    def _all_reduce_form(self, x, topk_ids, topk_weights, with_shared) -> torch.Tensor:
        part = self.local.experts_output(x, topk_ids, topk_weights, out_dtype=torch.float32)
        if with_shared:
            chunk = self.shared_chunk(x.shape[0])
            if len(chunk):  # fewer tokens than ranks: some ranks have none
                part[chunk.start:chunk.stop] += self.local.shared_expert(x[chunk.start:chunk.stop]).float()
        part = part.to(self.partial_dtype)
        self.all_reduce(part)
        return part.float()

    def shared_chunk(self, tokens: int) -> range:
        """The tokens whose shared expert this rank computes in the all-reduce form: chunk `rank`
        of ceil(T / N) (T is a shape: no host read)."""
        size = math.ceil(tokens / self.world_size)
        return range(min(self.rank * size, tokens), min((self.rank + 1) * size, tokens))

    def _dispatch_form(self, x, topk_ids, topk_weights, with_shared) -> torch.Tensor:
        tokens, world = x.shape[0], self.world_size
        packed = pack_rows(x, topk_ids, topk_weights)
        if self.combine == "all_to_all_padded":
            # every peer gets every row: equal splits, no host read
            send = packed.repeat(world, 1)
            send_counts = receive_counts = None
            token_of_row = None
        else:
            send, token_of_row, send_counts, receive_counts = self._compact_dispatch(packed, topk_ids)
        received = packed.new_empty(world * tokens if receive_counts is None else sum(receive_counts),
                                    packed.shape[1])
        dispatch = self.all_to_all(received, send, receive_counts, send_counts, async_op=True)
        # the shared expert of this rank's own tokens, while the dispatch is in flight
        shared = self.local.shared_expert(x).float() if with_shared and tokens else None
        dispatch.wait()
        rows, ids, weights = unpack_rows(received, self.hidden, topk_ids.shape[1])
        if rows.shape[0]:
            part = self.local.experts_output(rows, ids, weights, out_dtype=self.partial_dtype)
        else:  # no token routes here (the all-to-all form's counts are on the host)
            part = rows.new_empty(0, self.hidden, dtype=self.partial_dtype)
        returned = part.new_empty(send.shape[0], self.hidden)
        self.all_to_all(returned, part, send_counts, receive_counts).wait()
        if token_of_row is None:  # each peer's block is this rank's T tokens, in order
            out = returned.view(world, tokens, self.hidden).float().sum(dim=0)
        else:
            out = torch.zeros(tokens, self.hidden, dtype=torch.float32, device=x.device)
            # one peer's rows at a time, in rank order: a token is at most once in each, so the
            # sum's order is fixed (one index_add_ of all rows would follow the GPU's atomics)
            for peer_rows, peer_tokens in zip(returned.split(send_counts), token_of_row.split(send_counts)):
                out.index_add_(0, peer_tokens, peer_rows.float())
        return out if shared is None else out + shared

    def _compact_dispatch(self, packed, topk_ids):
        """(the rows to send, grouped by destination rank, each token once per rank its experts
        are on; each sent row's token; send and receive counts per peer as host ints). The one
        host read of the all-to-all form: the counts, after they are exchanged on the device."""
        tokens, world = packed.shape[0], self.world_size
        owner = self.owner_of_expert[topk_ids.long()]  # [T, k]
        goes_to = torch.zeros(tokens, world, dtype=torch.bool, device=packed.device)
        goes_to.scatter_(1, owner, True)
        send_counts = goes_to.sum(dim=0)
        receive_counts = torch.empty_like(send_counts)
        self.all_to_all(receive_counts, send_counts, None, None).wait()
        # the (destination, token) pairs to send, first, in destination-then-token order
        flat = goes_to.T.reshape(-1)
        position = torch.arange(world * tokens, device=packed.device)
        order = torch.argsort(torch.where(flat, position, world * tokens), stable=True)
        counts = torch.stack([send_counts, receive_counts]).tolist()  # the host read (module docstring)
        send_counts, receive_counts = counts
        token_of_row = order[:sum(send_counts)] % tokens
        return packed[token_of_row], token_of_row, send_counts, receive_counts

    # -- the collectives (one place, so that a benchmark can time or record them) ---------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None,
                   input_splits: list[int] | None, async_op: bool = False):
        """all_to_all_single; returns a handle to wait on (a finished one when not async_op)."""
        work = dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group,
                                      async_op=async_op)
        return work if async_op else _Done()


class _Done:
    def wait(self) -> None:
        pass


def share_input_scales(local: MoeFfn, group=None) -> None:
    """W4A4: each projection's activation scale the largest over every rank's experts, as the
    one-process layer's (the largest over all experts), and alpha recomputed with it (MoeFfn's
    formula: scale x weight_scale_2). One all-reduce per projection, at load."""
    for scale_name, alpha_name, projection in (("scale13", "alpha13", local.w13), ("scale2", "alpha2", local.w2)):
        scale = getattr(local, scale_name).clone().float().reshape(1)
        dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=group)
        setattr(local, scale_name, scale.reshape(()))
        setattr(local, alpha_name, (scale.reshape(()) * projection.weight_scale_2).float().contiguous())
