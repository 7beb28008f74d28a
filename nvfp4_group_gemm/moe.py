"""The MoE entry: one NVFP4 grouped GEMM over stacked tokens whose group boundaries stay on the
GPU.

    c = moe_grouped_gemm(a, sfa, b, sfb, offsets, c=None, status=None, alpha=None, a_rows=None, c_rows=None,
                         activation=None, b_layout=None)

a        [T, K]    bfloat16 (W4A16: sfa None), or [T, K/2] float4_e2m1fn_x2 (or uint8, with sfa),
                   the tokens of every group stacked (T is a capacity: rows past offsets[G] are
                   neither read nor written)
sfa      None with bf16 activations; else e4m3 scales of a, one per 16 elements: plain [T, K/16]
                   (what a quantizer writes), or blocked [ceil(T/128), K/64, 32, 4, 4] (cuBLAS's
                   128x4 atoms over the stacked rows; blocked_scales makes it from plain)
b        [G, N, K/2]  float4_e2m1fn_x2 (or uint8), the experts' weights
K        any positive multiple of 64 on sm_90 (1408, 2880: a checkpoint's expert intermediate
                   size as the down projection's K), a multiple of 256 on sm_100
sfb      e4m3 scales of b: blocked [G, N/128, K/64, 32, 4, 4] (the competition's reordered layout
                   per group; what prepare_weight_scales returns), or plain [G, N, K/16]
                   (converted on every call: one more copy kernel and a fresh binding)
offsets  [G + 1]  int32 on the GPU: group g is rows offsets[g] .. offsets[g + 1] of a and c
c        [T, N]   float16 or bfloat16, written in the groups' rows only (allocated bf16 when None)
status   [1]      int32 on the GPU, optional: 0 after a call with valid offsets, 1 otherwise
alpha    fp32 [G] or [G, 2] on the GPU, optional: each expert's global scale (checkpoint)
a_rows   [R]      int64 on the GPU, optional, bf16 activations only: grouped row r reads a's row
                  a_rows[r] (a [T_a, K], any T_a: a layer's tokens, read in place for its
                  expert-sorted pairs, no gathered copy); offsets then index the R grouped rows
c_rows   [R]      int64 on the GPU, optional, bf16 activations only: grouped row r is written to
                  c's row c_rows[r] (c [T_c, N], any T_c, given: the un-permute in the GEMM's
                  stores); distinct over the groups' rows. An index outside a (c) reads zeros
                  (writes nothing). On sm_90 the GEMM itself reads and writes through them.
b_layout None or "plain": b as exported; "fragment", bf16 activations only: b from
                  nvfp4_group_gemm.weight_layout.pack_fragment (the same bytes rearranged once at
                  load, so the W4A16 decode reads a lane's fragment with one load and places its
                  codes with fewer instructions; the exact decode unpacks it)

C[rows of g] = alpha[g] x (A[rows of g] * SFA) @ (B[g] * SFB[g])^T, exact products accumulated
in fp32, as custom_kernel computes per group; with bf16 activations (W4A16) A's rows are the
bf16 values themselves (each bf16 x e2m1 x e4m3 product is exact in fp32 too).

No call reads the offsets on the host: a call is two launches (the activation pre-pass, then the
GEMM; in W4A16 the GEMM alone, which reads a itself) whose grids depend only on (T, G, N, K). The GPU derives each CTA's group and tile from the
offsets, and CTAs with no tile do nothing. So nothing synchronizes, and one CUDA graph captured
with this call replays correctly for any offsets and values written into the same tensors.

Everything the host can see is validated before any launch (TypeError / ValueError naming the
field, the value and the rule; no output is touched). The offsets' values are the GPU's to check:
unless 0 <= offsets[0] <= offsets[1] <= ... <= offsets[G] <= T, both kernels skip all their
work, so c keeps its values, nothing outside c is written, and `status` (when given) reads 1.
The call does not raise on bad offsets (that would need a host read); check_status(status)
raises, at the cost of a synchronization.

Hopper (sm_90) runs it; the config (token tile, split-K, chaining) is chosen per (T, G, N, K)
(moe_config). Launches go on torch's current stream. Per (device, stream, T, G,
N, K, scale layout) a plan holds the compiled launches and the decoded-activation scratch; per
set of tensor addresses a binding holds the launches' arguments and the two launches recorded as
one CUDA graph, so a serving engine that calls with the same tensors pays a key and one graph
launch where the stream is idle, two direct chained launches behind queued work (MoeBinding).
"""

from __future__ import annotations

import dataclasses
import itertools

import cutlass
import torch

from nvfp4_group_gemm import core, switches

from . import launch
from .weight_layout import FRAGMENT, PLAIN, WEIGHT_LAYOUTS, unpack_fragment

SF_VEC_SIZE = 16
ATOM_ROWS = 128
ATOM_BLOCKS = 4
# Experts per call: DeepSeek-V3 has 256, Kimi K2 384, all local under tensor parallelism. The
# sm_90 kernels read the offsets 32 groups per warp round (G / 32 rounds, unrolled: the same
# registers at G = 512 as at 64, no spill); the sm_100a version takes the core's 64
MAX_GROUPS = 512
# Plans (compiled launches and scratch) kept, and the scratch bytes they may hold together
MAX_PLANS = 16
MAX_PLAN_BYTES = 4 << 30
# Bindings (launch arguments of one set of tensor addresses on one stream) kept, over all streams
MAX_BINDINGS = 256

_FP4_DTYPES = tuple(d for d in (getattr(torch, "float4_e2m1fn_x2", None), torch.uint8) if d is not None)
_SCALE_DTYPES = tuple(d for d in (torch.float8_e4m3fn, torch.uint8) if d is not None)
# c's dtypes: the output is rounded to c's (a new c is bf16, what servers run)
OUT_DTYPES = (torch.float16, torch.bfloat16)
# bf16's unit in the last place relative to the value (8 significant bits)
BF16_RELATIVE_ULP = 2.0**-7
# What K must be a multiple of (hopper.moe.MOE_K_MULTIPLE: one 64-wide k-tile; a K that is not a
# multiple of the config's k-tile times its unrolled stages runs its k_tail build); the sm_100a
# version takes K % 256 == 0 only (SM100_K_MULTIPLE)
K_MULTIPLE = 64
SM100_K_MULTIPLE = 256


# =============================================================================
# Scale layouts
# =============================================================================
def blocked_scales(plain: torch.Tensor) -> torch.Tensor:
    """Plain scales [R, K/16] (or [G, R, K/16]) in cuBLAS's blocked layout,
    [ceil(R/128), K/64, 32, 4, 4] (or [G, R/128, K/64, 32, 4, 4]): atom (i, j) holds rows
    128 i .. + 128 and blocks 4 j .. + 4, row 32 r4 + r32 and block b4 at [r32, r4, b4]. Rows
    past R are zero. A new tensor."""
    if plain.dim() not in (2, 3):
        raise ValueError(f"blocked_scales: plain scales are [R, K/16] or [G, R, K/16], got shape {tuple(plain.shape)}")
    batched = plain.dim() == 3
    source = plain if batched else plain.unsqueeze(0)
    groups, rows, blocks = source.shape
    if blocks % ATOM_BLOCKS:
        raise ValueError(f"blocked_scales: K/16 = {blocks} must be a multiple of {ATOM_BLOCKS} (K % 64 == 0)")
    padded_rows = -(-rows // ATOM_ROWS) * ATOM_ROWS
    if padded_rows != rows:
        source = torch.nn.functional.pad(source.view(torch.uint8), (0, 0, 0, padded_rows - rows)).view(plain.dtype)
    blocked = (source.reshape(groups, padded_rows // ATOM_ROWS, 4, 32, blocks // ATOM_BLOCKS, ATOM_BLOCKS)
               .permute(0, 1, 4, 3, 2, 5).contiguous())
    return blocked if batched else blocked[0]


def _blocked_view(plain: torch.Tensor) -> torch.Tensor:
    """The [G, N/128, K/64, 32, 4, 4] view of plain [G, N, K/16] scales with N % 128 == 0 (no copy)."""
    groups, rows, blocks = plain.shape
    return plain.view(groups, rows // ATOM_ROWS, 4, 32, blocks // ATOM_BLOCKS, ATOM_BLOCKS).permute(0, 1, 4, 3, 2, 5)


def prepare_weight_scales(sfb_plain: torch.Tensor) -> torch.Tensor:
    """The experts' plain scales [G, N, K/16] in the layout every call reads without a copy
    ([G, N/128, K/64, 32, 4, 4]); weights change rarely, so a server converts them once."""
    return blocked_scales(sfb_plain)


def swiglu_weights(b: torch.Tensor, sfb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused gate-and-up weight (b [G, N = 2 I, K/2], gate rows then up rows; sfb blocked or
    plain) with its rows in the SwiGLU epilogue's order (hopper.moe.swiglu_row_order: 8 gate
    rows, then their 8 up rows): what activation="swiglu" takes. Returns (b, sfb), sfb in its
    layout; a copy (the weights change rarely: a server converts them once)."""
    from .hopper.moe import swiglu_row_order

    n = b.shape[1]
    order = torch.tensor(swiglu_row_order(n), device=b.device)
    fp4 = b.dtype
    reordered = b.view(torch.uint8)[:, order].contiguous().view(fp4)
    if sfb.dim() == 3:
        return reordered, sfb[:, order].contiguous()
    k = b.shape[2] * 2
    plain = torch.stack([plain_scales_of_blocked(sfb[g], n, k) for g in range(sfb.shape[0])])
    return reordered, blocked_scales(plain[:, order].contiguous())


def swiglu_columns(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) columns [rows, N / 2] of outputs [rows, N] of a SwiGLU weight (swiglu_weights'
    row order), each in intermediate order."""
    from .hopper.moe import swiglu_row_order

    n = values.shape[1]
    order = torch.tensor(swiglu_row_order(n), device=values.device)
    gate_positions = torch.nonzero(order < n // 2).flatten()
    up_positions = torch.nonzero(order >= n // 2).flatten()
    return values[:, gate_positions], values[:, up_positions]


# =============================================================================
# Validation (host-visible fields only)
# =============================================================================
def _fail(kind, field: str, value, rule: str):
    raise kind(f"moe_grouped_gemm: {field} = {value}: {rule}")


def _check_tensor(field: str, tensor, dtypes) -> None:
    if not isinstance(tensor, torch.Tensor):
        _fail(TypeError, field, type(tensor).__name__, "must be a torch.Tensor")
    if tensor.dtype not in dtypes:
        _fail(TypeError, f"{field}.dtype", tensor.dtype, f"must be one of {', '.join(str(d) for d in dtypes)}")


def _check_device(field: str, tensor, device, require_cuda: bool = True) -> None:
    if require_cuda and tensor.device.type != "cuda":
        _fail(ValueError, f"{field}.device", tensor.device, "must be a CUDA device")
    if tensor.device != device:
        _fail(ValueError, f"{field}.device", tensor.device, f"must be a's device, {device}")


def _check_shape(field: str, tensor, shape: tuple, rule: str) -> None:
    if tuple(tensor.shape) != shape:
        _fail(ValueError, f"{field}.shape", tuple(tensor.shape), f"must be {shape} ({rule})")


def _check_contiguous(field: str, tensor, align: int = 16) -> None:
    if not tensor.is_contiguous():
        _fail(ValueError, f"{field}.stride()", tensor.stride(), "must be contiguous (row-major, no gaps)")
    if tensor.data_ptr() % align:
        _fail(ValueError, f"{field}.data_ptr()", hex(tensor.data_ptr()), f"must be {align}-byte aligned")


class MoeShape(tuple):
    """(tokens T (the grouped rows), groups G, N, K, activation scale layout ("plain", "blocked";
    None: bf16 activations, W4A16), weight scale layout, alpha mode (None, "expert": [G],
    "halves": [G, 2]), c's dtype ("float16", "bfloat16"), the rows mapped (None, or (a's rows
    where a_rows maps them, else None; c's rows where c_rows does, else None)), the epilogue's
    activation (None, "swiglu"), the weights' layout ("plain", or "fragment": W4A16's weights
    packed for the fragment, nvfp4_group_gemm.weight_layout))."""

    __slots__ = ()

    def __new__(cls, tokens, groups, n, k, sfa_layout, sfb_layout, alpha=None, out_dtype="float16", rows=None,
                activation=None, b_layout="plain"):
        return super().__new__(cls, (tokens, groups, n, k, sfa_layout, sfb_layout, alpha, out_dtype, rows,
                                     activation, b_layout))

    tokens = property(lambda self: self[0])
    groups = property(lambda self: self[1])
    n = property(lambda self: self[2])
    k = property(lambda self: self[3])
    sfa_layout = property(lambda self: self[4])
    sfb_layout = property(lambda self: self[5])
    alpha = property(lambda self: self[6])
    out_dtype = property(lambda self: self[7])
    rows = property(lambda self: self[8])
    activation = property(lambda self: self[9])
    b_layout = property(lambda self: self[10])
    w4a16 = property(lambda self: self[4] is None)

    def kernel_rows(self):
        """The rows the GEMM maps (hopper.moe.MoeRows)."""
        from .hopper.moe import MoeRows

        rows = self.rows or (None, None)
        return MoeRows(gather=rows[0] is not None, scatter=rows[1] is not None)

    def activations(self) -> str:
        """What the activations are, in words (the chain's labels)."""
        swiglu = ", SwiGLU" if self.activation == "swiglu" else ""
        if not self.w4a16:
            return f"{self.sfa_layout} activation scales{swiglu}"
        rows = self.kernel_rows()
        mapped = " and ".join(name for name, on in (("gathered", rows.gather), ("scattered", rows.scatter)) if on)
        fragment = ", weights packed for the fragment" if self.b_layout == FRAGMENT else ""
        return "bf16 activations (W4A16)" + (f", rows {mapped}" if mapped else "") + swiglu + fragment

    def epilogue(self):
        """The GEMM's epilogue (hopper.moe.MoeEpilogue) of this shape."""
        from .hopper.moe import MoeEpilogue

        return MoeEpilogue(self.alpha, self.out_dtype, self.activation)


def check_moe_inputs(a, sfa, b, sfb, offsets, c=None, status=None, alpha=None, *, a_rows=None, c_rows=None,
                     activation=None, b_layout=None, require_cuda: bool = True) -> MoeShape:
    """Validate everything the host can see (types, dtypes, devices, shapes, strides,
    alignment, G, N, K), before any launch; returns the problem's MoeShape. Raises TypeError
    or ValueError naming the field, its value and the rule. `require_cuda` False: the CPU
    path's rules (the op on CPU tensors, the exact decode, moe_reference), every rule but
    "a CUDA device" (all tensors still on a's device)."""
    w4a16 = isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16
    if isinstance(a, torch.Tensor) and a.dtype == torch.float16:
        _fail(TypeError, "a.dtype", a.dtype, "16-bit activations must be bfloat16 [T, K] (W4A16, no activation "
              "scales): a.to(torch.bfloat16); or NVFP4 (float4_e2m1fn_x2 [T, K/2] with their scales: "
              "nvfp4_group_gemm.moe_layer.quantize_activations)")
    if w4a16:
        if sfa is not None:
            _fail(ValueError, "sfa", f"a {type(sfa).__name__}", "must be None with bf16 activations (W4A16 takes "
                  "no activation scales)")
    else:
        _check_tensor("a", a, _FP4_DTYPES)
        _check_tensor("sfa", sfa, _SCALE_DTYPES)
    _check_tensor("b", b, _FP4_DTYPES)
    _check_tensor("sfb", sfb, _SCALE_DTYPES)
    _check_tensor("offsets", offsets, (torch.int32,))
    mapped = _check_row_maps(a, a_rows, c_rows)
    if a.dim() != 2:
        _fail(ValueError, "a.shape", tuple(a.shape), f"must be [T, {'K' if w4a16 else 'K/2'}] (the stacked tokens)")
    if b.dim() != 3:
        _fail(ValueError, "b.shape", tuple(b.shape), "must be [G, N, K/2] (the experts' weights)")
    a_tokens, a_columns = a.shape
    tokens = a_tokens if mapped is None else mapped
    groups, n, b_half_k = b.shape
    k = a_columns if w4a16 else 2 * a_columns
    half_k = k // 2
    k_field = "K (a.shape[1])" if w4a16 else "K (2 x a.shape[1])"
    if a_tokens < 1:
        _fail(ValueError, "T (a.shape[0])", a_tokens, "must be >= 1")
    if not 1 <= groups <= MAX_GROUPS:
        _fail(ValueError, "G (b.shape[0])", groups, f"must be in 1..{MAX_GROUPS}")
    if k % K_MULTIPLE or k <= 0:
        _fail(ValueError, k_field, k, f"must be a positive multiple of {K_MULTIPLE} (the 64-wide k-tile: four "
              "16-element scale blocks, one atom of the blocked scales along K; NVFP4's own rule, K % 16 == 0, "
              "is not enough here)")
    if b_half_k != half_k:
        _fail(ValueError, "b.shape[2]", b_half_k, f"must be K/2 = {half_k}, K from a.shape[1]")
    if n % 128 or n == 0:
        _fail(ValueError, "N (b.shape[1])", n, "must be a positive multiple of 128 (the weight tile)")
    from .hopper.moe import ACTIVATIONS

    if activation not in ACTIVATIONS:
        _fail(ValueError, "activation", repr(activation), f"must be one of {ACTIVATIONS} (\"swiglu\": b's rows in "
              "swiglu_weights' order, c [rows, N / 2])")
    c_columns = n // 2 if activation == "swiglu" else n
    _check_contiguous("a", a)
    _check_contiguous("b", b)
    blocks = k // SF_VEC_SIZE
    if w4a16:
        sfa_layout = None
    elif sfa.dim() == 2:
        sfa_layout = "plain"
        _check_shape("sfa", sfa, (tokens, blocks), "plain activation scales [T, K/16]")
    elif sfa.dim() == 5:
        sfa_layout = "blocked"
        _check_shape("sfa", sfa, (-(-tokens // ATOM_ROWS), k // 64, 32, 4, 4),
                     "blocked activation scales [ceil(T/128), K/64, 32, 4, 4]")
    else:
        _fail(ValueError, "sfa.shape", tuple(sfa.shape), "must be [T, K/16] (plain) or [ceil(T/128), K/64, 32, 4, 4]")
    if not w4a16:
        _check_contiguous("sfa", sfa, 1 if sfa_layout == "plain" else 16)
    if sfb.dim() == 3:
        sfb_layout = "plain"
        _check_shape("sfb", sfb, (groups, n, blocks), "plain weight scales [G, N, K/16]")
        _check_contiguous("sfb", sfb, 1)
    elif sfb.dim() == 6:
        sfb_layout = "blocked"
        _check_shape("sfb", sfb, (groups, n // ATOM_ROWS, k // 64, 32, 4, 4),
                     "blocked weight scales [G, N/128, K/64, 32, 4, 4]")
        _check_contiguous("sfb", sfb)
    else:
        _fail(ValueError, "sfb.shape", tuple(sfb.shape), "must be [G, N/128, K/64, 32, 4, 4] (blocked) or [G, N, K/16]")
    _check_shape("offsets", offsets, (groups + 1,), "int32 [G + 1], G = b.shape[0]")
    _check_contiguous("offsets", offsets, 4)
    out_dtype = "float16"
    if c is not None:
        _check_tensor("c", c, OUT_DTYPES)
        columns = "N / 2 (SwiGLU)" if activation == "swiglu" else "N"
        if c_rows is None:
            _check_shape("c", c, (tokens, c_columns), f"fp16 or bf16 [T, {columns}]" if a_rows is None else
                         f"fp16 or bf16 [R, {columns}] (R = a_rows.shape[0], the grouped rows)")
        else:
            if c.dim() != 2 or c.shape[0] < 1 or c.shape[1] != c_columns:
                _fail(ValueError, "c.shape", tuple(c.shape), f"must be [T_c, {c_columns}], T_c >= 1 (fp16 or bf16 "
                      f"[T_c, {columns}]: c_rows index its rows)")
        _check_contiguous("c", c)
        out_dtype = str(c.dtype).removeprefix("torch.")
    elif c_rows is not None:
        _fail(ValueError, "c", None, "must be given with c_rows (c_rows index its rows: [T_c, N])")
    alpha_mode = None
    if alpha is not None:
        _check_tensor("alpha", alpha, (torch.float32,))
        if tuple(alpha.shape) == (groups,):
            alpha_mode = "expert"
        elif tuple(alpha.shape) == (groups, 2):
            alpha_mode = "halves"
            if n % (2 * 128) and activation is None:
                _fail(ValueError, "N (b.shape[1])", n, "must be a multiple of 256 with alpha [G, 2] (each half of N, "
                      "the gate and the up rows of a fused weight, a multiple of the 128-row weight tile)")
        else:
            _fail(ValueError, "alpha.shape", tuple(alpha.shape), f"must be [G] = [{groups}] (one fp32 scale per "
                  f"expert) or [G, 2] = [{groups}, 2] (one per half of N)")
        _check_contiguous("alpha", alpha, 4)
    if status is not None:
        _check_tensor("status", status, (torch.int32,))
        if status.numel() < 1:
            _fail(ValueError, "status.numel()", status.numel(), "must be >= 1 (int32 on the GPU)")
    # devices last: every other rule can be checked (and tested) on any device
    for field, tensor in (("a", a), ("b", b), ("sfa", sfa), ("sfb", sfb), ("offsets", offsets), ("c", c),
                          ("status", status), ("alpha", alpha), ("a_rows", a_rows), ("c_rows", c_rows)):
        if tensor is not None:
            _check_device(field, tensor, a.device, require_cuda)
    layout = PLAIN if b_layout is None else b_layout
    if layout not in WEIGHT_LAYOUTS:
        _fail(ValueError, "b_layout", repr(b_layout), f"must be None or one of {WEIGHT_LAYOUTS} (\"fragment\": b "
              "from nvfp4_group_gemm.weight_layout.pack_fragment)")
    if layout == FRAGMENT and not w4a16:
        _fail(ValueError, "b_layout", repr(b_layout), "\"fragment\" takes bf16 activations (W4A16): the fp4 path's "
              "decode reads the weights as exported")
    rows = None if mapped is None else (None if a_rows is None else a_tokens,
                                        None if c_rows is None else c.shape[0])
    return MoeShape(tokens, groups, n, k, sfa_layout, sfb_layout, alpha_mode, out_dtype, rows, activation, layout)


def _check_row_maps(a, a_rows, c_rows) -> int | None:
    """The rules of a_rows and c_rows (int64 [R], R >= 1, the same R for both; bf16 activations
    only); returns R, or None where neither is given."""
    if a_rows is None and c_rows is None:
        return None
    if not (isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16):
        field = "a_rows" if a_rows is not None else "c_rows"
        _fail(ValueError, field, "given", f"takes bf16 activations (W4A16; a.dtype = "
              f"{getattr(a, 'dtype', type(a).__name__)}): the fp4 path's rows are gathered and scattered by the caller")
    count = None
    for field, rows in (("a_rows", a_rows), ("c_rows", c_rows)):
        if rows is None:
            continue
        _check_tensor(field, rows, (torch.int64,))
        if rows.dim() != 1 or rows.shape[0] < 1:
            _fail(ValueError, f"{field}.shape", tuple(rows.shape), "must be [R], R >= 1 (one index per grouped row)")
        if count is not None and rows.shape[0] != count:
            _fail(ValueError, "c_rows.shape", tuple(rows.shape), f"must be [R] = [{count}], a_rows' length")
        count = rows.shape[0]
        _check_contiguous(field, rows, 8)
    return count


# The offsets' rule: the GPU checks it (a call with bad offsets writes nothing and sets status
# 1); the CPU path reads the offsets on the host and checks it before any work (check_offsets)
OFFSETS_RULE = "0 <= offsets[0] <= offsets[1] <= ... <= offsets[G] <= T"
# Offsets printed whole up to this many values (G = 512 would make a 3000-character line)
MAX_PRINTED_OFFSETS = 17


def offsets_error(bounds: list[int], tokens: int) -> str | None:
    """What breaks OFFSETS_RULE in the host copy `bounds` of offsets [G + 1] (T = `tokens`), in
    words, or None where they follow it."""
    if bounds[0] < 0:
        return f"offsets[0] = {bounds[0]} < 0"
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if hi < lo:
            return f"offsets[{g + 1}] = {hi} < offsets[{g}] = {lo}"
    if bounds[-1] > tokens:
        return f"offsets[{len(bounds) - 1}] = {bounds[-1]} > T = {tokens}"
    return None


def check_offsets(offsets: torch.Tensor, tokens: int) -> list[int]:
    """The offsets as host integers (a read: a sync on the GPU), or a ValueError naming
    offsets, their value and OFFSETS_RULE: what the CPU path checks before any work, where the
    GPU path flags bad offsets in `status` (check_status). `tokens`: T, a.shape[0]."""
    bounds = [int(v) for v in offsets.cpu().tolist()]
    broken = offsets_error(bounds, tokens)
    if broken is not None:
        shown = bounds if len(bounds) <= MAX_PRINTED_OFFSETS else f"[{len(bounds)} values]"
        _fail(ValueError, "offsets", shown, f"{broken}; the rule is {OFFSETS_RULE} (T = a.shape[0] = {tokens})")
    return bounds


def check_status(status: torch.Tensor) -> None:
    """Raise ValueError if the call that wrote `status` had bad offsets (reads it: a sync)."""
    value = int(status.reshape(-1)[0].item())
    if value == 2:
        raise ValueError("moe_grouped_gemm: the offsets made more tiles than the table holds (status 2, sm_100 "
                         "version): some of c was not computed; report the offsets, T, G and N")
    if value != 0:
        raise ValueError(f"moe_grouped_gemm: offsets were invalid on the GPU (status 1): the rule is {OFFSETS_RULE}; "
                         "nothing was written")


# =============================================================================
# Plans and bindings
# =============================================================================
class MoePlan:
    """What one (device, stream, MoeShape, config) needs beyond the tensors: the config, the
    compiled launchers, the decoded-activation scratch and the status word of calls given none
    (captured: a CUDA graph was captured with it, so it is never evicted: RUNTIME pins it)."""

    __slots__ = (
        "blocks_x",
        "captured",
        "chain",
        "checked",
        "choice",
        "config",
        "decode",
        "fill_ctas",
        "gemm",
        "groups",
        "kernel_key",
        "max_tiles",
        "nbytes",
        "scratch",
        "scratch_address",
        "slab_bytes",
        "status",
        "status_address",
    )

    def __init__(self, shape: MoeShape, device: torch.device, config, num_sms: int, choice=None, chain=None):
        from .hopper import moe as hopper_moe

        self.config = config = hopper_moe.w4a16_config(config) if shape.w4a16 else config
        # its link of the entry's chain (moe_chain): what a demotion and the self-check read
        self.choice, self.chain, self.groups = choice, chain, shape.groups
        self.kernel_key = None if choice is None else choice.kernel_key(shape.groups)
        self.checked = False  # its kernel's first-use self-check done (this plan's or another's)
        # the decoded activations (none in W4A16: the GEMM reads a)
        rows = 0 if shape.w4a16 else hopper_moe.slab_rows(shape.tokens, shape.groups, config)
        self.slab_bytes = rows * 128
        self.scratch = torch.empty(self.slab_bytes * (shape.k // 64), dtype=torch.uint8, device=device)
        # written every call (by the pre-pass, or the W4A16 GEMM's first CTA)
        self.status = torch.empty(1, dtype=torch.int32, device=device)
        self.scratch_address, self.status_address = self.scratch.data_ptr(), self.status.data_ptr()
        self.captured = False
        self.nbytes = self.scratch.numel() + 4
        self.fill_ctas = num_sms  # one round of one CTA per SM (variable tiles' cap, moe_token_cap)
        self.max_tiles = hopper_moe.max_moe_tiles(shape.tokens, shape.groups, shape.n, config, self.fill_ctas)
        self.blocks_x = -(-(shape.tokens * (shape.k // SF_VEC_SIZE)) // hopper_moe.DECODE_THREADS)
        decode, gemm = compile_moe_kernels(shape, config)
        if shape.w4a16:
            self.decode = None
            self.gemm = launch.cell_launcher(gemm, *(W4A16_GEMM_ARGS if shape.rows is None else W4A16_ROWS_GEMM_ARGS))
            return
        self.decode = launch.cell_launcher(decode, *DECODE_ARGS)
        self.gemm = launch.cell_launcher(gemm, *(GEMM_ARGS if shape.alpha is None else SCALED_GEMM_ARGS))


def compile_moe_kernels(shape: MoeShape, config) -> tuple:
    """(the pre-pass, the GEMM) of `config` for this shape, compiled (cached: core.compile_key);
    no pre-pass in W4A16 (w4a16_config applied)."""
    from .hopper import moe as hopper_moe

    if shape.w4a16:
        config = hopper_moe.w4a16_config(config)
        return None, hopper_moe.compile_moe_w4a16_gemm(shape.groups, config=config, epilogue=shape.epilogue(),
                                                       rows=shape.kernel_rows(), weight_layout=shape.b_layout)
    decode = hopper_moe.compile_moe_decode(shape.groups, scale_layout=shape.sfa_layout, chained=config.chain_calls)
    return decode, hopper_moe.compile_moe_gemm(shape.groups, config=config, epilogue=shape.epilogue())


# CellLauncher kinds and pointer dtypes of the two kernels' arguments (hopper/moe.py's __call__s)
DECODE_ARGS = (("ptr", "ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "stream"),
               (cutlass.Uint8, cutlass.Uint8, cutlass.Int32, cutlass.Uint8, cutlass.Int32, None, None, None, None,
                None))
GEMM_ARGS = (("ptr", "ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "i32", "i32", "stream"),
             (cutlass.Uint8, cutlass.Uint8, cutlass.Uint8, cutlass.Uint8, cutlass.Int32, None, None, None, None, None,
              None, None))
# with per-expert scales (hopper.moe.Sm90MoeScaledGemm): alpha's pointer after the offsets
SCALED_GEMM_ARGS = (("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "i32", "i32", "stream"),
                    (cutlass.Uint8, cutlass.Uint8, cutlass.Uint8, cutlass.Uint8, cutlass.Int32, cutlass.Float32, None,
                     None, None, None, None, None, None))


# W4A16 (hopper.moe.Sm90MoeW4A16Gemm): one launch, a read as it is, alpha's pointer (0 where none)
# and status's after the offsets
W4A16_GEMM_ARGS = (("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "i32", "stream"),
                   (cutlass.Uint8, cutlass.Uint8, cutlass.Uint8, cutlass.Uint8, cutlass.Int32, cutlass.Float32,
                    cutlass.Int32, None, None, None, None, None, None))
# its rows mapped (hopper.moe.Sm90MoeW4A16RowsGemm): a_rows' and c_rows' pointers after status's
# (0 where not mapped), a's and c's row counts after the sizes
W4A16_ROWS_GEMM_ARGS = (("ptr",) * 9 + ("i32",) * 7 + ("stream",),
                        (cutlass.Uint8, cutlass.Uint8, cutlass.Uint8, cutlass.Uint8, cutlass.Int32, cutlass.Float32,
                         cutlass.Int32, cutlass.Int64, cutlass.Int64) + (None,) * 8)


def _launch_values(plan: MoePlan, shape: MoeShape, key, stream_handle: int, sfb_address: int | None = None):
    """The kernels' argument values (DECODE_ARGS, GEMM_ARGS order; the pre-pass's None in W4A16,
    W4A16_GEMM_ARGS) from the addresses of a binding key; `sfb_address`: the blocked copy of
    plain weight scales."""
    tokens, _groups, n, k = shape[:4]
    a, sfa, b, sfb, offsets, c, status, alpha, a_rows, c_rows = key[:10]
    if status is None:
        status = plan.status_address
    if sfb_address is not None:
        sfb = sfb_address
    if shape.w4a16:
        if shape.rows is not None:
            a_count, c_count = shape.rows
            return None, (a, b, sfb, c, offsets, alpha or 0, status, a_rows or 0, c_rows or 0, tokens, n, k,
                          plan.max_tiles, plan.fill_ctas, a_count or 0, c_count or 0, stream_handle)
        return None, (a, b, sfb, c, offsets, alpha or 0, status, tokens, n, k, plan.max_tiles, plan.fill_ctas,
                      stream_handle)
    scratch = plan.scratch_address
    decode = (a, sfa, offsets, scratch, status, tokens, k, plan.slab_bytes, plan.blocks_x, stream_handle)
    sizes = (tokens, n, k, plan.slab_bytes, plan.max_tiles, plan.fill_ctas, stream_handle)
    gemm = (scratch, b, sfb, c, offsets, *sizes) if alpha is None else (scratch, b, sfb, c, offsets, alpha, *sizes)
    return decode, gemm


class MoeBinding:
    """The launches of one set of tensor addresses on one stream: arguments fixed once (their own
    argument cells), and under the graph policy of both entries (launch.records_graph) the same
    two launches recorded as one CUDA graph at its first launch outside a caller's capture. A call
    runs `launch()` (plain weight scales: their conversion first):

    * the stream idle (cuStreamQuery): the graph replayed, one cuGraphLaunch, a third of the two
      prepared DSL calls' CPU; there is no earlier kernel for the pre-pass to overlap;
    * work queued on the stream: the two direct launches, the pre-pass chained under the kernel
      before it (a graph launch waits for all earlier work: 1.6-2.7 µs more device time per
      call on the benchmark shapes); the host is ahead, so its CPU is hidden;
    * inside a caller's capture: the two direct launches into the caller's graph, and the plan
      is marked captured.

    EXPERIMENTS E79 has the figures of the three ways."""

    __slots__ = ("direct", "graph", "keepalive", "plan", "plan_key", "record", "replay", "sfb_blocked", "sfb_plain",
                 "stream")

    def __init__(self, plan_key, plan: MoePlan, shape: MoeShape, key, tensors, stream_handle: int):
        self.plan_key, self.plan = plan_key, plan
        self.sfb_plain = self.sfb_blocked = None
        sfb_address = None
        if shape.sfb_layout == "plain":
            self.sfb_plain = tensors[3]
            self.sfb_blocked = blocked_scales(self.sfb_plain)
            sfb_address = self.sfb_blocked.data_ptr()
        self.keepalive = tensors  # (a, sfa, b, sfb, offsets, c, status, alpha, a_rows, c_rows): the addresses launched
        decode, gemm = _launch_values(plan, shape, key, stream_handle, sfb_address)
        self.direct = (plan.gemm.bound(gemm),) if decode is None else (plan.decode.bound(decode), plan.gemm.bound(gemm))
        self.graph = self.replay = self.record = None
        self.stream = launch.cuda.CUstream(stream_handle)
        if switches.CURRENT.graph_launch:

            def record(capture_stream):
                decode, gemm = _launch_values(plan, shape, key, int(capture_stream), sfb_address)
                launches = [plan.gemm.bound(gemm)]
                return core.in_order(launches if decode is None else [plan.decode.bound(decode), *launches])

            self.record = record
            if launch.records_graph():
                self._record()

    def _record(self) -> None:
        record, self.record = self.record, None
        try:
            self.graph = launch.GraphLaunch(record, self.keepalive[0].device)
            self.replay = self.graph.launcher(self.stream)
        except Exception:  # noqa: BLE001 - the direct launches run (and report any real error)
            self.graph = self.replay = None

    def launch(self) -> None:
        if self.sfb_plain is not None:
            self.sfb_blocked.copy_(_blocked_view(self.sfb_plain))
        if launch.current_stream_capturing():
            self.plan.captured = True  # the caller's graph reads the plan's scratch at every replay
        else:
            if self.record is not None:  # bound during a caller's capture: record at its first launch outside
                self._record()
            if self.replay is not None and not _stream_query(self.stream)[0]:  # CUDA_SUCCESS: nothing queued
                self.replay()
                return
        for run in self.direct:
            run()


_stream_query = launch.cuda.cuStreamQuery


class _SeenOnce:
    """A key's first call launches through the plan's shared argument cells and leaves this
    marker among the bindings (no plan of its own); its second call builds the binding (fresh
    tensors every call bind nothing)."""

    __slots__ = ()
    plan = None


_SEEN_ONCE = _SeenOnce()


# The entry's runtime (the core's, on callers' streams: launch.StreamRuntime). Plans by (device,
# stream, MoeShape, the switches its config follows): the least recently used go first past
# MAX_PLANS or MAX_PLAN_BYTES, never one a CUDA graph was captured with (its replays use the
# plan's scratch: those stay until reset_runtime). Bindings by ((stream, device), binding key),
# MAX_BINDINGS over all streams; the bindings of an evicted plan go with it. Its other caches,
# _CAPABILITY and _LAYOUTS, are cleared with it.
RUNTIME = launch.StreamRuntime("moe", max_bindings=MAX_BINDINGS, max_plans=MAX_PLANS, max_plan_bytes=MAX_PLAN_BYTES,
                               pinned=lambda plan: plan.captured)
# The one lock of every runtime of the package: compiles and shared state, so that a MoE
# compile and a per-size-set compile on two threads never run at once (concurrent first
# compiles crash inside the DSL)
_LOCK = core.RUNTIME_LOCK


# Split-K of 32-token tiles at decode: each rank keeps at least this many 64-wide k-tiles (the
# cluster's reduction costs about what a short main loop saves: Qwen-like down, K = 768, one
# token: 10.8 µs unsplit, 13.7 in two, 17.3 in four; EXPERIMENTS E82)
MIN_K_TILES_PER_RANK = 16


def t32_split_k(tokens: int, groups: int, n: int, k: int, num_sms: int) -> int:
    """Ranks (4, 2 or 1) to split K over for 32-token tiles: where the tiles of every routing
    number at most half the SMs (one row or so on a few experts: DeepSeek-V3's 32 local experts
    or Mixtral at one token), the most ranks that leave each MIN_K_TILES_PER_RANK k-tiles, so
    that 2 or 4 times the CTAs (at most two per SM) stream the experts' weights."""
    from .hopper import moe as hopper_moe
    from .hopper.config import SWAP_AB_HALF_K, SWAP_AB_T32_CONFIG

    if 2 * hopper_moe.max_moe_tiles(tokens, groups, n, SWAP_AB_T32_CONFIG) > num_sms:
        return 1
    for split in (4, 2):
        if k // (SWAP_AB_HALF_K * split) >= MIN_K_TILES_PER_RANK:
            return split
    return 1


def moe_config(shape: MoeShape, num_sms: int, chain_calls: bool | None = None, forced: str | None = "env"):
    """The swap-AB config of a MoE shape, from (T, G, N, K) alone (the host never sees the
    routing): where the groups that can hold a row hold at most 32 rows each on average and
    their 32-token tiles number at most half the SMs, those tiles split along K over 4 or 2
    ranks (t32_split_k); else split-K where its CTAs fit one per SM for every routing
    (2 x max_moe_tiles <= SMs); else, where the groups that can hold a row hold at most 32 or 64 rows each on average
    (T / min(G, T): decode, many experts), 32-token tiles (128-wide k-tiles where their tiles fit
    one round and K % 512 == 0) or 64-token tiles (32-token ones where b is packed for
    the fragment); else one round of 128-token tiles where every
    routing fits one round (with 128-wide k-tiles where K % 512 == 0); else variable tiles,
    which the GPU cuts at 128 or 256 tokens from the routing (hopper.moe.moe_token_cap). The per-size-set path's choice for equal groups
    of T / G, or the choice most frequent over sampled routings, picked 128-, 112- or 192-token
    tiles that cost 1.21-1.68x the per-size-set path's device time on benchmark routings
    (EXPERIMENTS E77). Calls chained unless chain_calls is False (NVFP4_SM90_CHAIN_CALLS).
    NVFP4_MOE_CONFIG=<name> (hopper.config_named: "swap_ab_variable", ...) runs that config for
    every shape instead (experiments); `forced` gives that name (None: the choice) in place of
    the environment's."""
    import dataclasses

    from .hopper import moe as hopper_moe
    from .hopper.backend import default_chain_calls
    from .hopper.config import (
        SWAP_AB_ONE_ROUND_CONFIG,
        SWAP_AB_SPLIT_K_CONFIG,
        SWAP_AB_T32_CONFIG,
        SWAP_AB_T32_K128_CONFIG,
        SWAP_AB_T32_SPLIT_K2_CONFIG,
        SWAP_AB_T32_SPLIT_K4_CONFIG,
        SWAP_AB_T64_CONFIG,
        SWAP_AB_VARIABLE_CONFIG,
    )
    from .hopper.schedules import with_wide_k_tiles

    if forced == "env":
        forced = switches.CURRENT.moe_config  # a config name: config_named checks it
    if forced:
        from .hopper.config import config_named

        return hopper_moe.moe_k_config(config_named(forced), shape.k)
    tokens, groups, n, k = shape[:4]
    # rows per group where every group that can hold a row holds as many (the routing's mean)
    rows_per_group = tokens / min(groups, tokens)
    decode_split = t32_split_k(tokens, groups, n, k, num_sms) if rows_per_group <= SWAP_AB_T32_CONFIG.tile_tokens else 1
    if decode_split > 1:
        config = {2: SWAP_AB_T32_SPLIT_K2_CONFIG, 4: SWAP_AB_T32_SPLIT_K4_CONFIG}[decode_split]
    elif 2 * hopper_moe.max_moe_tiles(tokens, groups, n, SWAP_AB_SPLIT_K_CONFIG) <= num_sms:
        config = SWAP_AB_SPLIT_K_CONFIG
    elif rows_per_group <= SWAP_AB_T32_CONFIG.tile_tokens:
        # 128-wide k-tiles (twice the bytes in flight per CTA, 3 CTAs per SM instead of 4) where
        # every routing's tiles fit one round of them: qwen3_64 gate-up, one token 15.8 against
        # 18.3 µs; eight tokens (768 tiles) 45.0 against 42.0 (EXPERIMENTS E80)
        config = SWAP_AB_T32_CONFIG
        if hopper_moe.max_moe_tiles(tokens, groups, n, config) <= SWAP_AB_T32_K128_CONFIG.ctas_per_sm * num_sms:
            config = with_wide_k_tiles([(tokens, n, k, 1)], config)
    elif rows_per_group <= SWAP_AB_T64_CONFIG.tile_tokens:
        # with b packed for the fragment, or W4A16's SwiGLU epilogue without row maps (a
        # layer's shared expert), two 32-token tiles: their 64-token builds took an 8-byte local
        # frame (80 registers; the fragment's with rows scattered under DSL 4.8.1, EXPERIMENTS E92;
        # the unmapped SwiGLU one under DSL 4.3.5, read in its main loop, E98)
        t64_spills = shape.b_layout == FRAGMENT or (shape.w4a16 and shape.activation == "swiglu" and shape.rows is None)
        config = SWAP_AB_T32_CONFIG if t64_spills else SWAP_AB_T64_CONFIG
    elif hopper_moe.max_moe_tiles(tokens, groups, n, SWAP_AB_ONE_ROUND_CONFIG) <= num_sms:
        config = with_wide_k_tiles([(tokens, n, k, 1)], SWAP_AB_ONE_ROUND_CONFIG)
    else:
        config = SWAP_AB_VARIABLE_CONFIG
    chain = default_chain_calls() if chain_calls is None else chain_calls
    if config.chain_calls and not chain:
        config = dataclasses.replace(config, chain_calls=False)
    return hopper_moe.moe_k_config(config, k)


def _switches() -> tuple:
    """The two switches a plan's config follows (NVFP4_MOE_CONFIG, NVFP4_SM90_CHAIN_CALLS), as
    nvfp4_group_gemm.switches read them (at import and at reset_runtime)."""
    return switches.CURRENT.moe_config, switches.CURRENT.sm90_chain_calls


# =============================================================================
# The fallback chain and its first-use self-check, as every entry has
# =============================================================================
MOE_BACKEND = "moe_sm90"


def moe_chain(shape: MoeShape, num_sms: int, chain_calls: bool, forced: str | None) -> list:
    """The entry's chain for a shape (core.KernelChoice links): the config moe_config picks, then
    variable token tiles (the config every routing runs), then the exact decode (moe_reference:
    it reads the offsets on the host, so it runs only outside a capture)."""
    from .hopper.config import SWAP_AB_VARIABLE_CONFIG, config_name
    from .hopper.moe import moe_k_config, w4a16_config

    first = moe_config(shape, num_sms, chain_calls, forced)
    configs = [first]
    variable = SWAP_AB_VARIABLE_CONFIG
    if variable.chain_calls and not chain_calls:
        variable = dataclasses.replace(variable, chain_calls=False)
    variable = moe_k_config(variable, shape.k)
    if not forced and variable != first:
        configs.append(variable)
    if shape.w4a16:  # no pre-pass: unchained
        configs = [w4a16_config(config) for config in configs]
    links = [core.KernelChoice(MOE_BACKEND, config_name(config),
                               (config, shape.sfa_layout, shape.epilogue(), shape.kernel_rows(), shape.b_layout),
                               per_group_count=True, label=f"{shape.activations()}, {shape.epilogue()}")
             for config in configs]
    return [*links, core.KernelChoice(MOE_BACKEND, "exact_decode", host=True)]


class MoeKernels:
    """The MoE chain's links as core.choose_kernel compiles them (a compile failure demotes
    its link): the sm_90 kernels of a link's config for one shape; the exact decode compiles
    nothing."""

    name = MOE_BACKEND

    def __init__(self, shape: MoeShape):
        self.shape = shape

    def compile(self, choice, num_groups: int) -> None:
        if not choice.host:
            compile_moe_kernels(self.shape, choice.config[0])


def _plan_for(key, shape: MoeShape, device: torch.device) -> MoePlan | None:
    """The plan of `key` (made on a miss, its config the chain's first link that is not demoted
    and compiles: core.choose_kernel); None: every kernel of the chain is demoted, the exact
    decode computes the call."""
    plan = RUNTIME.plans.get(key)
    if plan is not None:
        return plan
    from .hopper.backend import current_num_sms

    with core.device_context(device):
        num_sms = current_num_sms()
        forced, chain_calls = key[-2:]
        chain = moe_chain(shape, num_sms, chain_calls, forced)
        choice = core.choose_kernel(MoeKernels(shape), chain, shape.groups)
        if choice.host:
            return None
        plan = MoePlan(shape, device, choice.config[0], num_sms, choice, chain)
    RUNTIME.put_plan(key, plan)
    return plan


# Compute capabilities by device index, asked once per device
_CAPABILITY = core.RuntimeCache(max_entries=64)
RUNTIME.caches.append(_CAPABILITY)


def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability, asked once per device."""
    capability = _CAPABILITY.get(device.index)
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
        _CAPABILITY.put(device.index, capability)
    return capability


def _self_check(plan: MoePlan, a, sfa, b, sfb, offsets, c, status, alpha=None, maps=(None, None, None)) -> None:
    """The first call of a compiled MoE kernel (outside a capture, NVFP4_SELF_CHECK on) is also
    computed by the exact decode and compared at the competition's tolerance widened by what fp32
    accumulation may add (core.group_accumulation_bound), row group by row group. A disagreement
    demotes the kernel (the next call runs the next link) and writes the exact result into c. It
    synchronizes once per compiled kernel and process; a call with bad offsets (status non-zero),
    or rows mapped (`maps`: a_rows, c_rows, then the activation) outside a or c, is not
    checked (nothing to compare)."""
    written = plan.status if status is None else status
    if int(written.reshape(-1)[0].item()) != 0:
        return
    a_rows, c_rows, activation = maps
    if any(rows is not None and not bool(rows_inside(rows, count).all())
           for rows, count in ((a_rows, a.shape[0]), (c_rows, c.shape[0]))):
        return
    grouped_a = a if a_rows is None else a[a_rows]
    grouped_c = c if c_rows is None else c[c_rows]  # a copy: written back below where it differs
    mismatches, elements, first, outputs, references = compare_with_exact(grouped_a, sfa, b, sfb, offsets, grouped_c,
                                                                          alpha, activation)
    core.SELF_CHECKED.add(plan.kernel_key)
    plan.checked = True
    if mismatches:
        for out, ref in zip(outputs, references):
            out.copy_(ref)
        if c_rows is not None:
            bounds = offsets.cpu().tolist()
            scatter_rows(c, c_rows, grouped_c, bounds[0], bounds[-1])
        where = ", ".join(f"expert {g} row {row} column {column}" for g, row, column in first)
        core.demote(MOE_BACKEND, plan.choice, plan.chain, plan.groups,
                    f"self-check: {mismatches} of {elements} outputs differ from the exact decode beyond the "
                    f"tolerance and fp32 accumulation (first: {where}); this call returns the exact result")


def compare_with_exact(a, sfa, b, sfb, offsets, c, alpha=None, activation=None):
    """c's rows of every group against the exact decode (times alpha), at the competition's
    tolerance widened by what fp32 accumulation may add (core.group_accumulation_bound, scaled
    by alpha) and, for bf16 output, by one bf16 unit in the last place (the kernel rounds the
    fp32 product, the reference the exact one; fp16's unit is within the tolerance). Returns
    SwiGLU (activation="swiglu"): the bound of silu(gate) x up where gate and up may differ by
    their own bound plus one unit of c's dtype (swiglu_bound). Returns
    (mismatches, elements, the first as (expert, row, column), the groups' rows of c, the
    same rows of the exact result). Reads the offsets on the host."""
    w4a16 = sfa is None
    k = a.shape[1] if w4a16 else 2 * a.shape[1]
    bounds_list = [int(v) for v in offsets.cpu().tolist()]
    sfa_plain = None if w4a16 else sfa if sfa.dim() == 2 else plain_scales_of_blocked(sfa, a.shape[0], k)
    sfb_plain = sfb if sfb.dim() == 3 else torch.stack([plain_scales_of_blocked(sfb[g], b.shape[1], k)
                                                         for g in range(b.shape[0])])
    expected = moe_reference(a, sfa, b, sfb, offsets, torch.empty_like(c), alpha, activation=activation)
    scales = None if alpha is None else alpha_columns(alpha, b.shape[1], activation).float().abs()
    if activation == "swiglu":  # the sums before SwiGLU, exact (float64), times alpha
        sums = group_products(a, sfa, b, sfb, bounds_list, torch.zeros(c.shape[0], b.shape[1], dtype=torch.float64,
                                                                        device=c.device),
                              None if alpha is None else alpha_columns(alpha, b.shape[1], activation).double())
    outputs, references, bounds, rows = [], [], [], []
    for g in range(b.shape[0]):
        lo, hi = bounds_list[g], bounds_list[g + 1]
        if hi <= lo:
            continue
        outputs.append(c[lo:hi])
        references.append(expected[lo:hi])
        if w4a16:
            bound = w4a16_accumulation_bound(a[lo:hi], b[g], sfb_plain[g])
        else:
            bound = core.group_accumulation_bound(a[lo:hi], b[g], sfa_plain[lo:hi], sfb_plain[g], 1)
        if bound is not None and scales is not None:
            bound = bound * scales[g]  # the sum's error, scaled as the sum (alpha's own rounding: the tolerance)
        if activation == "swiglu":
            bounds.append(swiglu_bound(sums[lo:hi], bound, expected[lo:hi], c.dtype))
            rows.append((g, lo))
            continue
        if c.dtype == torch.bfloat16:
            ulp = expected[lo:hi].float().abs() * BF16_RELATIVE_ULP
            bound = ulp if bound is None else bound + ulp
        bounds.append(bound)
        rows.append((g, lo))
    mismatches, elements, first = core.count_mismatches(outputs, references, bounds=bounds)
    first = [(rows[i][0], rows[i][1] + r, j) for i, r, j in first]
    return mismatches, elements, first, outputs, references


def swiglu_bound(sums: torch.Tensor, sum_bound: torch.Tensor | None, expected: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """How far a kernel's silu(gate) x up may lie from the exact one (expected) when its gate
    and up (sums [rows, N], exact, in the SwiGLU order) may each differ by their accumulation
    bound (sum_bound, or none) plus one unit of c's dtype (the two roundings on either side of
    a boundary): |silu'| <= 1.1 times gate's difference times |up|, plus |silu(gate)| times
    up's, their product, and one unit of the result (its own rounding); [rows, N / 2]."""
    unit = BF16_RELATIVE_ULP if dtype == torch.bfloat16 else 2.0**-10
    gate, up = swiglu_columns(sums)
    gate_bound, up_bound = (torch.zeros_like(gate), torch.zeros_like(up)) if sum_bound is None else swiglu_columns(
        sum_bound.double())
    gate_bound = gate_bound + gate.abs() * unit
    up_bound = up_bound + up.abs() * unit
    silu = torch.nn.functional.silu(gate)
    return (1.1 * gate_bound * up.abs() + silu.abs() * up_bound + gate_bound * up_bound
            + expected.double().abs() * unit).float()


def w4a16_accumulation_bound(a, b, sfb):
    """What fp32 accumulation may add to one group's exact W4A16 sums (a bf16 [M, K], b its
    codes [N, K/2], sfb plain [N, K/16]): every bf16 x decoded-weight product is exact in fp32
    (8 x 6 significant bits), so only the additions round, each by at most 2^-23 of the partial
    sum, about K / 16 + 1 roundings deep in wgmma's k16 steps; [M, N], 1 % over the sum of |a||b|."""
    k = a.shape[1]
    abs_b = core.decode_fp4(b.view(torch.uint8) & 0x77, (sfb.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn))
    abs_sum = (a.float().abs().double() @ abs_b.double().T) * 1.01
    return core.FP32_ADD_ERROR * (k // 16 + 1) * abs_sum


def exact_moe_call(a, sfa, b, sfb, offsets, c, status=None, alpha=None, a_rows=None, c_rows=None,
                   activation=None, b_layout=None) -> None:
    """The exact decode as the entry's kernels behave, on any device: the entry's rules
    (check_moe_inputs, the CUDA device excepted) before any work; then valid offsets: every
    group's rows written (moe_reference; through c_rows where given) and status 0; bad offsets:
    nothing written and status 1, or, without a status to flag them in, check_offsets'
    ValueError. Reads the offsets on the host: the op's CPU implementation."""
    shape = check_moe_inputs(a, sfa, b, sfb, offsets, c, status, alpha, a_rows=a_rows, c_rows=c_rows,
                             activation=activation, b_layout=b_layout, require_cuda=False)
    b = plain_weights(b, shape)
    if not _exact_decode(a, sfa, b, sfb, offsets, c, status, alpha, (a_rows, c_rows, activation)) and status is None:
        check_offsets(offsets, shape.tokens)  # raises, naming what breaks the rule


def _exact_decode(a, sfa, b, sfb, offsets, c, status, alpha, maps=(None, None, None)) -> bool:
    """On validated inputs: what the kernels do (valid offsets: c's groups written, status 0;
    bad ones: nothing written, status 1); whether the offsets were valid."""
    bounds = [int(v) for v in offsets.cpu().tolist()]
    grouped_rows = next((r.shape[0] for r in maps[:2] if r is not None), a.shape[0])
    valid = offsets_error(bounds, grouped_rows) is None
    if valid:
        _reference_rows(a, sfa, b, sfb, bounds, c, alpha, maps)
    if status is not None:
        status.fill_(0 if valid else 1)
    return valid


def plain_weights(b: torch.Tensor, shape: MoeShape) -> torch.Tensor:
    """b as exported: unpacked where the call's b_layout is "fragment" (what the exact decode reads)."""
    if shape.b_layout == FRAGMENT:
        return unpack_fragment(b)
    return b


def _exact_call(a, sfa, b, sfb, offsets, c, status, shape: MoeShape, alpha=None, maps=(None, None, None)) -> None:
    """The chain's last link, on inputs the entry validated: the exact decode as the kernels
    behave (bad offsets without a status: nothing written, nothing raised, as a kernel
    launch), refused under a caller's capture (it reads the offsets on the host)."""
    if launch.is_capturing():
        raise RuntimeError(f"moe_grouped_gemm: every MoE kernel for T = {shape.tokens}, G = {shape.groups}, "
                           f"N = {shape.n}, K = {shape.k} is demoted in this process (the lines above say why), and "
                           "its last link, the exact decode, reads the offsets on the host: it cannot run under a "
                           "CUDA graph capture")
    _exact_decode(a, sfa, b, sfb, offsets, c, status, alpha, maps)


data_address = core.data_address


def _binding_key(a, sfa, b, sfb, offsets, c, status, alpha=None, a_rows=None, c_rows=None, activation=None,
                 b_layout=None):
    """Everything a binding's arguments and validation depend on: the ten addresses (status's,
    alpha's, a_rows' and c_rows' None where none is given), then the layout (shapes, strides
    and dtypes, the epilogue's activation; _checked_shape's key). The device follows from the
    addresses: one virtual address space."""
    layout = (a.shape, a.stride(), a.dtype, None if sfa is None else (sfa.shape, sfa.stride(), sfa.dtype),
              b.shape, b.stride(), b.dtype,
              sfb.shape, sfb.stride(), sfb.dtype, offsets.shape, offsets.stride(), offsets.dtype, c.shape, c.stride(),
              c.dtype, None if status is None else (status.shape, status.dtype),
              None if alpha is None else (alpha.shape, alpha.stride(), alpha.dtype),
              None if a_rows is None else (a_rows.shape, a_rows.stride(), a_rows.dtype),
              None if c_rows is None else (c_rows.shape, c_rows.stride(), c_rows.dtype), activation, b_layout)
    return (data_address(a), 0 if sfa is None else data_address(sfa), data_address(b), data_address(sfb),
            data_address(offsets), data_address(c),
            None if status is None else data_address(status), None if alpha is None else data_address(alpha),
            None if a_rows is None else data_address(a_rows), None if c_rows is None else data_address(c_rows), layout)



def moe_grouped_gemm(a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor, offsets: torch.Tensor,
                     c: torch.Tensor | None = None, *, status: torch.Tensor | None = None,
                     alpha: torch.Tensor | None = None, a_rows: torch.Tensor | None = None,
                     c_rows: torch.Tensor | None = None, activation: str | None = None,
                     b_layout: str | None = None) -> torch.Tensor:
    """C rows of group g = alpha[g] x (A rows of g x SFA) @ (B[g] x SFB[g])^T for the groups the
    GPU's `offsets` give, rounded to c's dtype (fp16 or bf16; a new c is bf16), the rows read
    through a_rows and written through c_rows where given, silu(gate) x up of a SwiGLU weight's
    outputs with activation="swiglu" (c [rows, N / 2]), b packed for the fragment with
    b_layout="fragment" (W4A16: nvfp4_group_gemm.weight_layout); returns c (module docstring:
    layouts, alpha, row maps, SwiGLU, validation, bad offsets)."""
    if (c is None and c_rows is None and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dim() == 2 and b.dim() == 3):
        rows = a.shape[0] if not isinstance(a_rows, torch.Tensor) else a_rows.shape[0]
        columns = b.shape[1] // 2 if activation == "swiglu" else b.shape[1]
        c = torch.empty((rows, columns), dtype=torch.bfloat16, device=a.device)
    try:
        key = _binding_key(a, sfa, b, sfb, offsets, c, status, alpha, a_rows, c_rows, activation, b_layout)
    except AttributeError:  # not tensors: the validation names the field
        check_moe_inputs(a, sfa, b, sfb, offsets, c, status, alpha, a_rows=a_rows, c_rows=c_rows,
                         activation=activation, b_layout=b_layout)
        raise
    entry = where = None
    if a.is_cuda:  # CUDA is initialized: the hit path (the binding, touched: least recently used go first)
        where = (launch.current_stream_handle(), core.current_device_index())
        entry = RUNTIME.bindings.get((where, key))
    if entry is None or entry is _SEEN_ONCE:
        _launch_miss(a, sfa, b, sfb, offsets, c, status, key, bind=entry is _SEEN_ONCE, where=where, alpha=alpha,
                     a_rows=a_rows, c_rows=c_rows, activation=activation, b_layout=b_layout)
    else:
        entry.launch()
    return c


# Validated layouts (a key's last element) -> (their MoeShape, the alignment mask of each
# address). A call on new tensors of a validated layout checks only what differs: its
# addresses' alignment and its tensors' devices.
MAX_LAYOUTS = 64
_LAYOUTS = core.RuntimeCache(max_entries=MAX_LAYOUTS)
RUNTIME.caches.append(_LAYOUTS)


def _checked_shape(key, a, sfa, b, sfb, offsets, c, status, alpha=None, a_rows=None, c_rows=None,
                   activation=None, b_layout=None) -> MoeShape:
    """check_moe_inputs, short where the layout (`key[-1]`) was validated before: then the
    addresses' alignment and the devices alone."""
    known = _LAYOUTS.get(key[-1])  # touched: a layout in use stays cached
    if known is not None:
        shape, masks = known
        device = a.get_device()
        if (device >= 0 and not (key[0] & masks[0] or key[1] & masks[1] or key[2] & masks[2] or key[3] & masks[3]
                                 or key[4] & masks[4] or key[5] & masks[5])
                and (sfa is None or sfa.get_device() == device) and b.get_device() == device
                and sfb.get_device() == device
                and offsets.get_device() == device and c.get_device() == device
                and (status is None or status.get_device() == device)
                and (alpha is None or (alpha.get_device() == device and not key[7] & 3))
                and (a_rows is None or (a_rows.get_device() == device and not key[8] & 7))
                and (c_rows is None or (c_rows.get_device() == device and not key[9] & 7))):
            return shape
    shape = check_moe_inputs(a, sfa, b, sfb, offsets, c, status, alpha, a_rows=a_rows, c_rows=c_rows,
                             activation=activation, b_layout=b_layout)
    # 16-byte addresses for the TMA-read operands and c, 4 for offsets; plain scales any byte
    _LAYOUTS.put(key[-1], (shape, (15, 0 if shape.sfa_layout == "plain" else 15, 15,
                                   0 if shape.sfb_layout == "plain" else 15, 3, 15)))
    return shape


def _launch_miss(a, sfa, b, sfb, offsets, c, status, key, bind: bool, where: tuple | None = None,
                 alpha=None, a_rows=None, c_rows=None, activation=None, b_layout=None) -> None:
    """A call whose key has no binding: validate, find (or make) the plan, then launch through
    the plan's shared cells (`bind` False: the key's first call) or build the key's binding and
    launch it (its second call). `where`: (torch's current stream handle, current device) where
    the caller read them."""
    shape = _checked_shape(key, a, sfa, b, sfb, offsets, c, status, alpha, a_rows, c_rows, activation, b_layout)
    maps = (a_rows, c_rows, activation)  # what the exact decode and the self-check apply beyond the tensors
    device = a.device
    stream_handle, current_device = where or (launch.current_stream_handle(), core.current_device_index())
    if device.index != current_device:
        raise ValueError(f"moe_grouped_gemm: a.device = {device}: must be torch's current CUDA device "
                         f"(cuda:{current_device}); use `with torch.cuda.device({device.index})`")
    capability = _capability(device)
    if capability[0] == 10:
        _launch_sm100(shape, a, sfa, b, sfb, offsets, c, status, key, stream_handle, alpha)
        return
    if capability[0] != 9:
        raise ValueError(f"moe_grouped_gemm: {torch.cuda.get_device_name(device)} is sm_{capability[0]}{capability[1]}: "
                         "the MoE entry runs on Hopper (sm_90) GPUs, and on sm_100 with NVFP4_MOE_SM100=1")
    with _LOCK:
        # the config follows from the shape and the two switches (moe_config)
        plan_key = (device.index, stream_handle, shape, *_switches())
        capturing = launch.is_capturing()
        RUNTIME.before_miss()
        plan = _plan_for(plan_key, shape, device)
        if plan is None:  # every kernel of the chain demoted
            _exact_call(a, sfa, plain_weights(b, shape), sfb, offsets, c, status, shape, alpha, maps)
            return
        if capturing:
            plan.captured = True
        check = not (capturing or plan.checked or not core.SELF_CHECK)
        if check and plan.kernel_key in core.SELF_CHECKED:
            plan.checked, check = True, False
        binding_key = ((stream_handle, device.index), key)
        try:
            if bind and not check:
                binding = MoeBinding(plan_key, plan, shape, key, (a, sfa, b, sfb, offsets, c, status, alpha, a_rows,
                                                                  c_rows), stream_handle)
                RUNTIME.put_binding(binding_key, binding)
                binding.launch()
                return
            sfb_address = None
            if shape.sfb_layout == "plain":
                sfb_blocked = blocked_scales(sfb)  # a fresh copy on this stream (the allocator keeps it for the launch)
                sfb_address = sfb_blocked.data_ptr()
            decode, gemm = _launch_values(plan, shape, key, stream_handle, sfb_address)
            if decode is not None:
                plan.decode(*decode)
            plan.gemm(*gemm)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # a failed launch: the next link, where the context can still run work
            if not RUNTIME.context_usable(device):
                raise
            core.demote(MOE_BACKEND, plan.choice, plan.chain, plan.groups, f"launch failed ({core.one_line(error)})")
            _launch_miss(a, sfa, b, sfb, offsets, c, status, key, bind=False, where=where, alpha=alpha,
                         a_rows=a_rows, c_rows=c_rows, activation=activation, b_layout=b_layout)
            return
        if check:
            _self_check(plan, a, sfa, plain_weights(b, shape), sfb, offsets, c, status, alpha, maps)
        RUNTIME.put_binding(binding_key, _SEEN_ONCE)


class Sm100MoeBinding:
    """A call's launches on sm_100 (nvfp4_group_gemm.sm100_moe.Sm100MoeLaunches: the tables and
    scale-repack kernel, the leaderboard file's descriptor init, the persistent GEMM reading its
    tile count on the GPU) for one set of tensors: plain DSL calls on the stream."""

    __slots__ = ("args", "buffers", "launches", "plan", "sfb_plain", "stream")

    def __init__(self, plan, launches, buffers, args, sfb_plain, stream_handle: int):
        import cuda.bindings.driver as cuda_driver

        self.plan, self.launches, self.buffers, self.args = plan, launches, buffers, args
        self.sfb_plain = sfb_plain
        self.stream = cuda_driver.CUstream(stream_handle)

    def launch(self) -> None:
        a, sfa, b, sfb, offsets, c, alpha = self.args
        if self.sfb_plain is not None:
            sfb.copy_(_blocked_view(self.sfb_plain))
        self.launches.launch(a, sfa, b, sfb, offsets, c, self.buffers, self.stream, alpha)


def _launch_sm100(shape: MoeShape, a, sfa, b, sfb, offsets, c, status, key, stream_handle: int, alpha=None) -> None:
    """The sm_100a version of the entry (compiled for sm_100a; never run here, no B200): only
    with NVFP4_MOE_SM100=1 (ValueError otherwise, naming the switch), plain activation scales.
    Its chain: the sm_100a kernels, then the exact decode; the same first-use self-check."""
    if not switches.CURRENT.moe_sm100:
        raise ValueError(
            "moe_grouped_gemm: the sm_100a MoE kernels (nvfp4_group_gemm.sm100_moe) are compiled for sm_100a "
            "but have never run on a B200: set NVFP4_MOE_SM100=1 (then call reset_runtime(), or set it before "
            "the import) to use them, and check them first with "
            "`NVFP4_MOE_SM100=1 python -m pytest tests/test_gpu_moe.py`")
    if shape.w4a16:
        _fail(TypeError, "a.dtype", a.dtype, "bf16 activations (W4A16) run on sm_90 only; on sm_100 the MoE entry "
              "takes NVFP4 activations (the fp4 path: nvfp4_group_gemm.moe_layer.quantize_activations)")
    if shape.sfa_layout != "plain":
        _fail(ValueError, "sfa.shape", tuple(sfa.shape), "on sm_100 the MoE entry takes plain activation scales "
              "[T, K/16] (it repacks them per group on the GPU)")
    if shape.k % SM100_K_MULTIPLE:
        _fail(ValueError, "K (2 x a.shape[1])", shape.k, f"must be a multiple of {SM100_K_MULTIPLE} on sm_100 (the "
              "sm_100a kernels' 256-wide k-tile; sm_90 takes any multiple of 64)")
    if shape.groups > core.MAX_GROUPS:
        _fail(ValueError, "G (b.shape[0])", shape.groups, f"must be in 1..{core.MAX_GROUPS} on sm_100 (sm_90 takes "
              f"up to {MAX_GROUPS})")
    if shape.alpha == "halves" and shape.n % 512:
        _fail(ValueError, "N (b.shape[1])", shape.n, "must be a multiple of 512 with alpha [G, 2] on sm_100 (each "
              "half of N a whole number of 256-row MMA tiles)")
    from . import sm100_moe

    device = a.device
    chain = [core.KernelChoice(SM100_MOE_BACKEND, "sm100_moe", shape.epilogue(), per_group_count=True),
             core.KernelChoice(SM100_MOE_BACKEND, "exact_decode", host=True)]
    with _LOCK:
        capturing = launch.is_capturing()
        RUNTIME.before_miss()
        plan_key = (device.index, stream_handle, shape, "sm100")
        plan = RUNTIME.plans.get(plan_key)
        if plan is None and not core.is_demoted(chain[0].kernel_key(shape.groups)):
            try:
                launches = sm100_moe.sm100_moe_launches(
                    shape.tokens, shape.groups, shape.n, shape.k,
                    resident_clusters=core.resident_clusters(device), num_sms=torch.cuda.get_device_properties(
                        device).multi_processor_count, alpha=shape.alpha, out_dtype=shape.out_dtype)
                launches.compile()
                plan = Sm100MoePlan(launches, launches.allocate(device), chain, shape.groups)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # noqa: BLE001 - a compile failure moves down the chain
                core.demote(SM100_MOE_BACKEND, chain[0], chain, shape.groups, f"compile failed ({core.one_line(error)})")
            else:
                RUNTIME.put_plan(plan_key, plan)
        if plan is None:
            _exact_call(a, sfa, b, sfb, offsets, c, status, shape, alpha)
            return
        if capturing:
            plan.captured = True
        sfb_plain = None
        if shape.sfb_layout == "plain":
            sfb_plain, sfb = sfb, blocked_scales(sfb)
        buffers = dict(plan.buffers)
        if status is not None:
            buffers["status"] = status
        binding = Sm100MoeBinding(plan, plan.launches, buffers, (a, sfa, b, sfb, offsets, c, alpha), sfb_plain,
                                  stream_handle)
        check = not capturing and core.SELF_CHECK and plan.kernel_key not in core.SELF_CHECKED
        if not check:
            RUNTIME.put_binding(((stream_handle, device.index), key), binding)
        try:
            binding.launch()
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # a failed launch: the exact decode, where the context can still run work
            if not RUNTIME.context_usable(device):
                raise
            core.demote(SM100_MOE_BACKEND, chain[0], chain, shape.groups, f"launch failed ({core.one_line(error)})")
            _exact_call(a, sfa, b, sfb, offsets, c, status, shape, alpha)
            return
        if check:
            _self_check(plan, a, sfa, b, sfb, offsets, c, buffers["status"], alpha)


SM100_MOE_BACKEND = "moe_sm100"


class Sm100MoePlan:
    """What one (device, stream, MoeShape) needs on sm_100: the launch sequence and its buffers,
    and its link of the chain (`choice`, `chain`, `groups`: what a demotion and the self-check
    read)."""

    __slots__ = ("buffers", "captured", "chain", "checked", "choice", "groups", "kernel_key", "launches", "nbytes",
                 "status")

    def __init__(self, launches, buffers: dict, chain: list, groups: int):
        self.launches, self.buffers, self.captured = launches, buffers, False
        self.chain, self.choice, self.groups = chain, chain[0], groups
        self.kernel_key, self.checked = chain[0].kernel_key(groups), False
        self.status = buffers.get("status")
        self.nbytes = sum(t.numel() * t.element_size() for t in buffers.values())


# =============================================================================
# The exact decode: the oracle of the tests, the op's CPU implementation
# =============================================================================
def moe_reference(a, sfa, b, sfb, offsets, c=None, alpha=None, *, a_rows=None, c_rows=None,
                  activation=None) -> torch.Tensor:
    """The exact result (float64 accumulation, times alpha[g] (or alpha[g, half of N]) where
    given, rounded to c's dtype in the epilogue's order: epilogue_rounding; fp16 when c is None)
    into c's rows of each group, on any device; reads the offsets on the host. Scales in either
    layout; K any multiple of 64. The entry's rules first (check_moe_inputs, the CUDA device
    excepted; c may also be float64, an oracle's exact values), then the offsets' (check_offsets):
    a ValueError or TypeError before any work. Rows mapped (a_rows, c_rows) and SwiGLU
    (activation) as the entry applies them."""
    oracle_c = c is not None and isinstance(c, torch.Tensor) and c.dtype == torch.float64
    shape = check_moe_inputs(a, sfa, b, sfb, offsets, c.half() if oracle_c else c, None, alpha, a_rows=a_rows,
                             c_rows=c_rows, activation=activation, require_cuda=False)
    bounds = check_offsets(offsets, shape.tokens)
    if c is None:
        columns = shape.n // 2 if activation == "swiglu" else shape.n
        c = torch.zeros((shape.tokens, columns), dtype=torch.float16, device=a.device)
    return _reference_rows(a, sfa, b, sfb, bounds, c, alpha, (a_rows, c_rows, activation))


def rows_inside(rows: torch.Tensor, count: int) -> torch.Tensor:
    """Which indices of `rows` lie in 0 .. count - 1 (a boolean tensor, no host read)."""
    return (rows >= 0) & (rows < count)


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x's rows `rows` ([R, ...]), zeros where an index lies outside x (what the W4A16 GEMM's
    a_rows read)."""
    inside = rows_inside(rows, x.shape[0])
    picked = x[torch.where(inside, rows, 0)]
    return torch.where(inside.view(-1, *([1] * (x.dim() - 1))), picked, torch.zeros((), dtype=x.dtype,
                                                                                    device=x.device))


def scatter_rows(target: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, lo: int, hi: int) -> None:
    """target[rows[r]] = values[r] for r in lo .. hi - 1 whose index lies inside target (what the
    W4A16 GEMM's c_rows write); reads the indices on the host."""
    picked = torch.arange(lo, hi, device=rows.device)
    picked = picked[rows_inside(rows[lo:hi], target.shape[0])]
    target[rows[picked]] = values[picked]


def _reference_rows(a, sfa, b, sfb, bounds: list[int], c, alpha=None, maps=(None, None, None)) -> torch.Tensor:
    """moe_reference's computation on validated inputs and valid host offsets `bounds`; rows
    mapped by `maps` (a_rows, c_rows) and its activation (maps[2]) as the entry applies them."""
    a_rows, c_rows, activation = maps
    if a_rows is not None:
        a = gather_rows(a, a_rows)
    if c_rows is not None:
        target, c = c, torch.zeros((c_rows.shape[0], c.shape[1]), dtype=c.dtype, device=c.device)
        _reference_rows(a, sfa, b, sfb, bounds, c, alpha, (None, None, activation))
        scatter_rows(target, c_rows, c, bounds[0], bounds[-1])
        return target
    scales = None if alpha is None else alpha_columns(alpha, b.shape[1], activation).double()
    if activation == "swiglu":  # the gate-and-up outputs as c's dtype holds them, then SwiGLU in fp32
        outputs = torch.zeros((c.shape[0], b.shape[1]), dtype=c.dtype, device=c.device)
        group_products(a, sfa, b, sfb, bounds, outputs, scales)
        gate, up = swiglu_columns(outputs[bounds[0]:bounds[-1]])
        if c.dtype == torch.float64:  # an oracle's exact values
            c[bounds[0]:bounds[-1]] = torch.nn.functional.silu(gate) * up
        else:
            c[bounds[0]:bounds[-1]] = (torch.nn.functional.silu(gate.float()) * up.float()).to(c.dtype)
        return c
    return group_products(a, sfa, b, sfb, bounds, c, scales)


def group_products(a, sfa, b, sfb, bounds: list[int], c, scales: torch.Tensor | None) -> torch.Tensor:
    """Each group's exact products times its column scales ([G, N] float64, or None), rounded as
    the epilogue rounds (epilogue_rounding) into c's rows of the group; returns c."""
    tokens, a_columns = a.shape
    groups, n, _ = b.shape
    w4a16 = sfa is None  # bf16 activations
    k = a_columns if w4a16 else 2 * a_columns
    sfa_plain = None if w4a16 else sfa if sfa.dim() == 2 else plain_scales_of_blocked(sfa, tokens, k)
    sfb_plain = sfb if sfb.dim() == 3 else torch.stack([plain_scales_of_blocked(sfb[g], n, k) for g in range(groups)])
    for g in range(groups):
        lo, hi = bounds[g], bounds[g + 1]
        if hi <= lo:
            continue
        a_values = a[lo:hi].double() if w4a16 else core.decode_fp4(a[lo:hi], sfa_plain[lo:hi]).double()
        b_values = core.decode_fp4(b[g], sfb_plain[g]).double()
        c[lo:hi] = epilogue_rounding(a_values @ b_values.T, None if scales is None else scales[g], c.dtype)
    return c


def epilogue_rounding(sums: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The exact sums (float64) as the kernels' epilogue rounds its fp32 sums: rounded to fp32
    (what the fp32 accumulators hold where every partial sum is exact), times alpha (`scales`,
    one per column, or None) in one fp32 rounding (the kernel's one multiply by alpha x 2^28 or
    2^8, a power-of-two product: exact), then fp32 -> c's dtype, round to nearest even (cvt.rn,
    inf past the range: 65520 and up in fp16). In float64 the fp32 sum times an fp32 alpha is
    exact (48 significant bits), so .float() is the kernel's one fp32 rounding; a float64 ->
    fp16 cast straight from the unrounded product could round differently at fp16's overflow
    boundary (65519.998 is 65504 in one rounding, inf through fp32). A float64 c (an oracle's)
    takes the exact product unrounded."""
    if dtype == torch.float64:
        return sums if scales is None else sums * scales.double()
    values = sums.float()
    if scales is not None:
        values = (values.double() * scales.double()).float()
    return values.to(dtype)


def alpha_columns(alpha: torch.Tensor, n: int, activation: str | None = None) -> torch.Tensor:
    """alpha [G] or [G, 2] as the scale of each output column, [G, N] (a [G, 2] alpha: its first
    value on the first half of N, its second on the second; with SwiGLU's interleaved rows, on
    the gate rows and on the up rows)."""
    if alpha.dim() == 1:
        return alpha[:, None].expand(alpha.shape[0], n)
    if activation == "swiglu":
        from .hopper.moe import swiglu_row_order

        up = torch.tensor(swiglu_row_order(n), device=alpha.device) >= n // 2
        return torch.where(up, alpha[:, 1:2], alpha[:, 0:1])
    return alpha.repeat_interleave(n // 2, dim=1)


def plain_scales_of_blocked(blocked: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """blocked_scales' inverse: [ceil(R/128), K/64, 32, 4, 4] -> [R, K/16]."""
    atoms = blocked.shape[0]
    plain = blocked.permute(0, 3, 2, 1, 4).reshape(atoms * ATOM_ROWS, k // SF_VEC_SIZE)
    return plain[:rows]


# =============================================================================
# Random inputs (tests, benchmarks, trying the entry)
# =============================================================================
# e4m3 bytes: the competition's scales (1.0 and 2.0), and general ones from 2^-6 up to
# 2^2 x 1.875 (a checkpoint's range whose sums stay within fp16 at K = 7168)
COMPETITION_SCALE_BYTES = (0x38, 0x40)
GENERAL_SCALE_BYTES = (0x08, 0x50)


def random_moe_inputs(tokens: int, groups: int, n: int, k: int, *, general_scales: bool = True,
                      sfa_layout: str | None = "plain", sfb_layout: str = "blocked", device="cuda",
                      generator: torch.Generator | None = None) -> dict:
    """Random a, sfa, b, sfb (every e2m1 code; scales general or the competition's 1.0 and
    2.0), zero offsets [G + 1] int32 and c [T, N] fp16 filled with NaN, on `device`.
    sfa_layout None: W4A16, a bf16 [T, K] (normal, standard deviation 4: every bf16 exponent a
    layer's activations reach, and subnormal-free sums of thousands of terms) and sfa None."""

    def scales(shape):
        if general_scales:
            low, high = GENERAL_SCALE_BYTES
            raw = torch.randint(low, high, shape, dtype=torch.uint8, generator=generator)
        else:
            picks = torch.randint(0, 2, shape, dtype=torch.uint8, generator=generator)
            raw = torch.where(picks == 0, COMPETITION_SCALE_BYTES[0], COMPETITION_SCALE_BYTES[1]).to(torch.uint8)
        return raw.view(torch.float8_e4m3fn)

    fp4 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
    a = torch.randint(0, 256, (tokens, k // 2), dtype=torch.uint8, generator=generator)
    b = torch.randint(0, 256, (groups, n, k // 2), dtype=torch.uint8, generator=generator)
    sfa = scales((tokens, k // SF_VEC_SIZE))
    sfb = scales((groups, n, k // SF_VEC_SIZE))
    if sfa_layout == "blocked":
        sfa = blocked_scales(sfa)
    if sfb_layout == "blocked":
        sfb = blocked_scales(sfb)
    if sfa_layout is None:  # W4A16
        a, sfa = (torch.randn(tokens, k, generator=generator) * 4).to(torch.bfloat16), None
    else:
        a = a.view(fp4)
    return {
        "a": a.to(device), "sfa": None if sfa is None else sfa.to(device), "b": b.view(fp4).to(device),
        "sfb": sfb.to(device),
        "offsets": torch.zeros(groups + 1, dtype=torch.int32, device=device),
        "c": torch.full((tokens, n), float("nan"), dtype=torch.float16, device=device),
    }


def random_routing(tokens: int, groups: int, rng, *, fill: float | None = None) -> list[int]:
    """Offsets [G + 1] of a random routing of at most `tokens` rows (a fraction `fill` of them,
    random when None): some groups empty, sometimes one group holding every row."""
    used = tokens if fill is None and rng.random() < 0.3 else int(tokens * (rng.random() if fill is None else fill))
    choice = rng.random()
    if choice < 0.15:
        sizes = [0] * groups
        sizes[rng.randrange(groups)] = used
    else:
        weights = [0.0 if rng.random() < 0.2 else rng.random() for _ in range(groups)]
        total = sum(weights) or 1.0
        sizes = [int(used * w / total) for w in weights]
        sizes[max(range(groups), key=lambda g: weights[g])] += used - sum(sizes)
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets
