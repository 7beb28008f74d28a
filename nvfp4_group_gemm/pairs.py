"""The MoE layer's (token, expert) pairs around its GEMMs: grouped by expert before them, and each
token's k rows summed, weighted, after them. On CUDA tensors one kernel each (hopper/layer.py:
a one-CTA counting sort; one thread per 16 bytes of a token's output row), on CPU tensors the
same results from torch ops. Nothing reads a value on the host: both run inside a CUDA graph.

    order, a_rows, offsets = sort_pairs(experts, num_experts, top_k)
    out = combine_pairs(rows, weights, experts=None, num_experts=0, shared=None, out_dtype=torch.bfloat16)

Each kernel is checked against the torch ops at its first eager use per (device, kernel): a
kernel that disagrees is set aside for the process (one line on stderr) and the torch ops run
in its place, as the GEMMs' fallback chain does.
"""

from __future__ import annotations

import functools
import threading

import torch

from . import core, launch

# (the kernels' first-use checks and demotions are the core's: core.DEMOTED, core.SELF_CHECKED,
# keyed ("pairs", device index, kernel), cleared by reset_runtime, listed by core.demotions())
_LOCK = threading.Lock()  # a CellLauncher is not thread-safe


def _kernels_usable(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors) and torch.cuda.get_device_capability(tensors[0].device) >= (9, 0)


def sort_pairs_torch(experts: torch.Tensor, num_experts: int, top_k: int, bounds: torch.Tensor | None = None):
    """sort_pairs by torch ops: a stable sort (the pairs of an expert in pair order), then each
    expert's first place by searchsorted of `bounds` (0 .. E on the pairs' device; made here
    where None). Ids above E sort last as in sort_pairs; a negative id sorts first, before
    offsets[0]."""
    sorted_experts, order = torch.sort(experts, stable=True)
    if bounds is None:
        bounds = torch.arange(num_experts + 1, device=experts.device)
    offsets = torch.searchsorted(sorted_experts, bounds, out_int32=True)
    return order, order // top_k, offsets


def sort_pairs(experts: torch.Tensor, num_experts: int, top_k: int, bounds: torch.Tensor | None = None):
    """The pairs grouped by expert: (order int64 [P]: the pair at each sorted place; a_rows
    int64 [P]: its token, order // top_k; offsets int32 [E + 1]: expert e's pairs are places
    offsets[e] .. offsets[e + 1]), for experts int64 [P] (pair p = token p // top_k's
    (p % top_k)-th choice), E = num_experts local experts. An expert id outside [0, E) (another
    GPU's) sorts last, past offsets[E] (on a CPU a negative id sorts first: sort_pairs_torch).
    The order of an expert's pairs: pair order on a CPU,
    unspecified on a GPU (shared atomics), which no layer output depends on. `bounds`: 0 .. E
    on the pairs' device for the torch ops (sort_pairs_torch), made there where None."""
    if experts.dim() != 1 or experts.dtype != torch.int64:
        raise TypeError(f"sort_pairs: experts {experts.dtype} {tuple(experts.shape)}: must be int64 [P]")
    if not 1 <= num_experts:
        raise ValueError(f"sort_pairs: num_experts = {num_experts}: must be >= 1")
    pairs = experts.shape[0]
    key = ("sort", num_experts)
    if pairs == 0 or pairs >= 2**31 or not _kernels_usable(experts) or _demoted(experts.device, key):
        return sort_pairs_torch(experts, num_experts, top_k, bounds)
    experts = experts.contiguous()
    order = torch.empty(pairs, dtype=torch.int64, device=experts.device)
    a_rows = torch.empty_like(order)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=experts.device)
    from .hopper import layer

    _launch(functools.partial(layer.compile_sort_pairs, num_experts), layer.SORT_ARGS,
            (experts, order, a_rows, offsets), (pairs, top_k))
    result = order, a_rows, offsets
    if _first_use(experts.device, key):
        binned = torch.where((experts >= 0) & (experts < num_experts), experts, num_experts)
        expected = sort_pairs_torch(binned, num_experts, top_k)
        agrees = _sorted_alike(binned, (order, a_rows, offsets), expected, top_k)
        if not _settle(experts.device, key, agrees, "the pairs' sort"):
            return expected
    return result


# Batches the fused routing takes: one CTA's warps route the tokens in turn (about 40
# instructions per round of k per token), so past a few tokens per warp torch.topk's grid is
# faster; the sort alone (sort_pairs) takes any batch
ROUTE_MAX_TOKENS = 256
# a lane holds the router's logits 32 apart, one bit each in a 32-bit mask
ROUTE_MAX_EXPERTS = 32 * 32


def route_and_sort_usable(x: torch.Tensor, routing, router_experts: int) -> bool:
    """Whether route_and_sort takes this batch and routing: on a GPU, at most ROUTE_MAX_TOKENS
    tokens and ROUTE_MAX_EXPERTS experts, k of them; a softmax router, or a sigmoid one whose
    expert groups (n_group > 1) are whole slots of 32 experts (DeepSeek-V3: 8 groups of 32)."""
    if not (x.is_cuda and 0 < x.shape[0] <= ROUTE_MAX_TOKENS and routing.top_k <= router_experts <= ROUTE_MAX_EXPERTS):
        return False
    if routing.scoring == "sigmoid" and routing.n_group > 1:
        per_group, rest = divmod(router_experts, routing.n_group)
        if rest or per_group % 32:
            return False
    return _kernels_usable(x)


def route_and_sort_torch(logits: torch.Tensor, routing, first_local: int, num_experts: int,
                         e_score_correction_bias: torch.Tensor | None = None):
    """route_and_sort by torch ops (nvfp4_group_gemm.routing.route, then sort_pairs_torch)."""
    from .routing import route

    ids, weights = route(logits, routing, e_score_correction_bias)
    local = ids.reshape(-1) - first_local
    experts = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    return (ids, weights, experts, *sort_pairs_torch(experts, num_experts, routing.top_k))


def route_and_sort(logits: torch.Tensor, routing, first_local: int, num_experts: int,
                   e_score_correction_bias: torch.Tensor | None = None):
    """A router's choice (nvfp4_group_gemm.routing: softmax, or DeepSeek-V3's grouped sigmoid
    with its correction bias) and the pairs' sort in one kernel (hopper/layer.py,
    Sm90MoeRouteSort), for logits fp32 [T, E_r] (route_and_sort_usable): (topk_ids int64
    [T, k], the k in descending order of the score the choice reads, the lowest expert first on
    a tie; topk_weights fp32 [T, k], as routing.route weighs them; the pairs' local experts int64
    [T k] (id - first_local, num_experts where not local); then sort_pairs' order, a_rows and
    offsets)."""
    tokens, router_experts = logits.shape
    top_k = routing.top_k
    bias = None
    if routing.scoring == "sigmoid" and e_score_correction_bias is not None:
        bias = e_score_correction_bias.float().contiguous()
        if bias.shape != (router_experts,) or bias.device != logits.device:
            raise ValueError(f"route_and_sort: e_score_correction_bias {tuple(bias.shape)} on {bias.device}: must be "
                             f"[{router_experts}] on {logits.device}")
    build = (routing.scoring, routing.n_group, routing.topk_group, float(routing.routed_scaling_factor),
             bias is not None) if routing.scoring == "sigmoid" else ("softmax",)
    key = ("route", num_experts, router_experts, top_k, routing.renormalize, *build)
    if _demoted(logits.device, key):
        return route_and_sort_torch(logits, routing, first_local, num_experts, e_score_correction_bias)
    logits = logits.float().contiguous()
    device = logits.device
    topk_ids = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    topk_weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    experts = torch.empty(tokens * top_k, dtype=torch.int64, device=device)
    order = torch.empty_like(experts)
    a_rows = torch.empty_like(experts)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    from .hopper import layer

    compile_fn = functools.partial(layer.compile_route_sort, num_experts, router_experts, top_k, routing.renormalize,
                                   *build)
    _launch(compile_fn, layer.ROUTE_SORT_ARGS,
            (logits, logits if bias is None else bias, topk_ids, topk_weights, experts, order, a_rows, offsets),
            (tokens, first_local))
    result = topk_ids, topk_weights, experts, order, a_rows, offsets
    if _first_use(device, key):
        expected = route_and_sort_torch(logits, routing, first_local, num_experts, bias)
        # the same experts per token (as sets: torch's come in no order), weights within a few
        # fp32 units (another exponential, another sum order), then a sort of the kernel's pairs
        chosen = torch.sort(topk_ids, dim=1)
        expected_chosen = torch.sort(expected[0], dim=1)
        agrees = (torch.equal(chosen.values, expected_chosen.values)
                  and torch.allclose(topk_weights.gather(1, chosen.indices),
                                     expected[1].gather(1, expected_chosen.indices), rtol=1e-5, atol=1e-7)
                  and torch.equal(experts.sort().values, expected[2].sort().values)
                  and _sorted_alike(experts, (order, a_rows, offsets),
                                    sort_pairs_torch(experts, num_experts, top_k), top_k))
        if not _settle(device, key, agrees, "the routing"):
            return expected
    return result


def quantize_rows_torch(x: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None = None):
    """quantize_rows by torch ops (checkpoint.quantize_blocks of the gathered rows)."""
    from . import checkpoint

    if rows is not None:
        x = x[rows]
    codes, block_scale = checkpoint.quantize_blocks(x, scale.float().reshape(()))
    return codes.view(torch.float4_e2m1fn_x2), block_scale


def quantize_rows(x: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None = None):
    """Rows of x [N, K] (bf16 or fp32, K a multiple of 16), or x[rows] (rows int64 [R]), as
    NVFP4 under the global scale `scale` (one fp32 on the device): (a float4_e2m1fn_x2 [R, K/2],
    plain scales float8_e4m3fn [R, K/16]), ModelOpt's formula bit for bit as
    checkpoint.quantize_blocks computes it (hopper/layer.py, Sm90QuantizeRows: one thread per
    16-element block, no gathered copy). A block holding a NaN: torch's scale is NaN, the
    kernel's ignores it (max.f32)."""
    count, k = (x.shape[0] if rows is None else rows.shape[0]), x.shape[1]
    in_dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(x.dtype)
    key = ("quantize", in_dtype, rows is not None)
    tensors = [t for t in (x, scale, rows) if t is not None]
    if (in_dtype is None or k % 16 or count == 0 or count * (k // 16) >= 2**31 or not _kernels_usable(*tensors)
            or _demoted(x.device, key) or x.data_ptr() % 16):
        return quantize_rows_torch(x, scale, rows)
    x = x.contiguous()
    scale = scale.float().reshape(1).contiguous()
    rows = None if rows is None else rows.to(torch.int64).contiguous()
    a = torch.empty(count, k // 2, dtype=torch.uint8, device=x.device)
    sfa = torch.empty(count, k // 16, dtype=torch.uint8, device=x.device)
    from .hopper import layer

    blocks = -(-count * (k // 16) // layer.QUANTIZE_THREADS)
    _launch(functools.partial(layer.compile_quantize, in_dtype, rows is not None), layer.QUANTIZE_ARGS,
            (x, rows if rows is not None else scale, scale, a, sfa), (count, k, blocks))
    result = a.view(torch.float4_e2m1fn_x2), sfa.view(torch.float8_e4m3fn)
    if _first_use(x.device, key):
        expected = quantize_rows_torch(x, scale, rows)
        agrees = (torch.equal(a, expected[0].view(torch.uint8))
                  and torch.equal(sfa, expected[1].view(torch.uint8)))
        if not _settle(x.device, key, agrees, "the rows' NVFP4 quantization"):
            return expected
    return result


def combine_pairs_torch(rows: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor | None = None,
                        num_experts: int = 0, shared: torch.Tensor | None = None,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """combine_pairs by torch ops."""
    tokens, top_k = weights.shape
    if experts is not None:  # the rows of pairs on other GPUs' experts were not written: they add nothing
        rows = torch.where((experts < num_experts)[:, None], rows, 0.0)
    # the bf16 rows promoted to fp32 inside the product (exact, as a cast is)
    out = (rows.view(tokens, top_k, -1) * weights.float()[..., None]).sum(dim=1)
    if shared is not None:
        out = out + shared.float()
    return out.to(out_dtype)


def combine_pairs(rows: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor | None = None,
                  num_experts: int = 0, shared: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """out [T, H] = sum over j < k of weights[t, j] x rows[t k + j] (+ shared[t]) in fp32,
    rounded once to out_dtype (bf16 or fp32): rows bf16 [T k, H] in pair order, weights [T, k];
    where `experts` (int64 [T k], local ids) is given, a pair whose expert is not in [0,
    num_experts) adds nothing (its row is not read); shared: bf16 [T, H] or None."""
    tokens, top_k = weights.shape
    hidden = rows.shape[1]
    if rows.dtype != torch.bfloat16 or rows.shape[0] != tokens * top_k:
        raise TypeError(f"combine_pairs: rows {rows.dtype} {tuple(rows.shape)}: must be bf16 [T k = {tokens * top_k}, H]")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"combine_pairs: out_dtype = {out_dtype}: must be torch.bfloat16 or torch.float32")
    tensors = [t for t in (rows, weights, experts, shared) if t is not None]
    key = ("combine", top_k, out_dtype, experts is not None, shared is not None)
    if (tokens == 0 or hidden % 8 or tokens * hidden >= 2**31 or top_k > 32 or not _kernels_usable(*tensors)
            or _demoted(rows.device, key)
            or any(t.data_ptr() % 16 for t in (rows, shared) if t is not None)):
        return combine_pairs_torch(rows, weights, experts, num_experts, shared, out_dtype)
    rows = rows.contiguous()
    weights = weights.float().contiguous()
    if experts is not None:
        experts = experts.to(torch.int64).contiguous()
    if shared is not None:
        shared = shared.to(torch.bfloat16).contiguous()
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=rows.device)
    from .hopper import layer

    compile_fn = functools.partial(layer.compile_combine, top_k, "bfloat16" if out_dtype == torch.bfloat16 else "float32",
                                 experts is not None, shared is not None)
    blocks = -(-tokens * (hidden // layer.COMBINE_COLUMNS) // layer.COMBINE_THREADS)
    _launch(compile_fn, layer.COMBINE_ARGS, (rows, weights, experts if experts is not None else weights,
                                     shared if shared is not None else rows, out),
            (tokens, hidden, num_experts, blocks))
    if _first_use(rows.device, key):
        expected = combine_pairs_torch(rows, weights, experts, num_experts, shared, out_dtype)
        # fp32 sums of the same products in another order: a few units in the last place
        agrees = bool(torch.allclose(out.float(), expected.float(), rtol=2e-2 if out_dtype == torch.bfloat16 else 1e-5,
                                     atol=1e-6))
        if not _settle(rows.device, key, agrees, "the pairs' weighted sum"):
            return expected
    return out


def _sorted_alike(binned: torch.Tensor, got, expected, top_k: int) -> bool:
    """Whether a sort of the pairs whose bins are `binned` (got: order, a_rows, offsets) matches
    the stable one (expected) where the order within a bin is free: the same offsets, a
    permutation of the pairs whose bins, place by place, are the stable sort's (so each pair
    sits in its bin's range), their tokens."""
    order, a_rows, offsets = got
    return (torch.equal(offsets, expected[2])
            and torch.equal(order.sort().values, torch.arange(order.shape[0], device=order.device))
            and torch.equal(binned[order], binned[expected[0]]) and torch.equal(a_rows, order // top_k))


def _launch(compile_fn, args, tensors, sizes) -> None:
    """Compile (once: the DSL's compilation is not thread-safe, so under the runtime's lock) and
    launch on the tensors' device, on its current stream."""
    kinds, dtypes = args
    with torch.cuda.device(tensors[0].device):
        with core.RUNTIME_LOCK:
            compiled = compile_fn()
        with _LOCK:
            launch.cell_launcher(compiled, kinds, dtypes)(*(t.data_ptr() for t in tensors), *sizes,
                                                          launch.current_stream_handle())


def _kernel_key(device: torch.device, key) -> tuple:
    return ("pairs", device.index, *key)


def _demoted(device: torch.device, key) -> bool:
    return _kernel_key(device, key) in core.DEMOTED


def _first_use(device: torch.device, key) -> bool:
    """Whether this is the kernel's first use on the device outside a graph capture (where the
    check's comparison cannot run): the caller checks it then."""
    return (core.SELF_CHECK and _kernel_key(device, key) not in core.SELF_CHECKED
            and not launch.current_stream_capturing())


def _settle(device: torch.device, key, agrees: bool, what: str) -> bool:
    """Record a first-use check's outcome; a kernel that disagreed is demoted (one line)."""
    kernel_key = _kernel_key(device, key)
    with core.RUNTIME_LOCK:
        core.SELF_CHECKED.add(kernel_key)
        if not agrees:
            core.DEMOTED[kernel_key] = f"{what} disagreed with the torch ops at its first use"
    if not agrees:
        core.report(f"{what} kernel {kernel_key}: disagreed with the torch ops at its first use; "
                    "demoted for this process, next: the torch ops")
    return agrees
