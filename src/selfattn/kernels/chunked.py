"""Chunked attention: FlashAttention's online softmax, written with PyTorch ops over tiles.

The explicit path forms the whole ``(T, S)`` weights; this one never does. Queries are cut
into tiles of ``block_q`` rows and keys into tiles of ``block_k`` columns. For one query tile,
the key tiles are visited in order, keeping per query row a running maximum of the scaled
scores (``row_max``), a running sum of their exponentials (``row_sum``, relative to that
maximum) and an unnormalised output; when a later tile raises the maximum, what was summed so
far is rescaled by ``exp(old_max - new_max)``. After the last key tile the output is divided by
``row_sum``. The forward saves only the output and the log-sum-exp per row
(``lse = row_max + log(row_sum)``); the backward recomputes each tile of weights as
``exp(scaled - lse)`` and, with ``delta = rowsum(dO * O)``, gets ``dS = weights * (dO Vᵀ - delta)``,
then ``dQ = dS K * scale``, ``dK = dSᵀ Q * scale``, ``dV = weightsᵀ dO``.

The forward saves passes over each score tile: the shift comes out of the score product (keys
carry a column of ones, the query tile one of ``-shift``), and after a query block's first tile
the shift stays put unless a tile's sums grow too large (see ``tile_forward``).

Memory beyond inputs and outputs: one or two ``(N, block_q, block_k)`` score tiles, a copy of
the keys with their column of ones, the query tile's accumulators and per-row statistics,
and under a float mask a few temporaries the size of one tile of it, i.e. O(T·D), whatever
T and S are.

Block sizes: key tiles of ``BLOCK_K = 1024`` columns; query tiles of up to ``MAX_BLOCK_Q = 512``
rows, fewer when there are many heads, so that the score tile of all heads at once holds at
most ``TILE_ELEMENTS = 2**22`` (16 MiB in float32: 8 heads x 512 x 1024). Measured on the
2-core AVX-512 CPU this was tuned on (2 MiB of L2 per core), before the passes above were
saved: the cost per score element of a tile step (two products, max, subtract, exp, sum)
stays within 5% from 1 MiB tiles, which fit L2, to 16 MiB ones, while Python's cost per tile
(about 15 tensor ops) shrinks with fewer, larger tiles; key tiles of 1024 keep the inner
dimension of the ``weights @ value`` product long enough to run near the GEMM rate. Any
sizes are correct; tiles need not divide T or S.

Calls with a mask or causal take their exponentials in base 2 (``exp2`` of scores scaled by
log2(e), the log-sum-exp in base 2 too), the others in base e: on the CPU, torch's ``exp`` is
25% faster than ``exp2`` on ordinary arguments but 8x slower on -inf (every masked score) and
20-70x slower below -87. A tile whose weights land in float32's denormal range (scores 87-103
below the row's maximum, natural units) stays slow either way: ``exp2`` and the
weights-values product then take several times longer. Only sharply peaked rows get there.

Masks follow the explicit path: ``allowed`` is boolean (True = may attend), ``bias`` is added to
the scaled scores (its dtype's lowest value masking as -inf), both broadcast to
``(*lead, T, S)`` and are sliced per tile, never expanded (one given expanded, with stride-0
axes, is first narrowed back to its own size) nor copied whole: each tile of a float mask is
made ready (:func:`finite_bias`: lowest value to -inf, cast, clamped) as it is read, in the
forward and again in the backward.
``causal`` aligns bottom-right (query i sees keys ``j <= i + S - T``); key tiles entirely above
the diagonal are skipped, so causal attention costs about half. A row with nothing to attend
gets output 0 and zero gradients. Inputs in float16/bfloat16 are computed in float32.

The forward and the backward are two operators, ``torch.ops.selfattn.chunked_forward`` and
``chunked_backward``, which torch.compile calls whole (``fullgraph=True`` works) instead of
tracing their Python loops, unrolled per tile and broken at each branch on tensor values
(on torch 2.4, with static shapes only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from selfattn.errors import is_integer

REDUCED_PRECISION = (torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
BLOCK_K = 1024  # key columns per tile
MAX_BLOCK_Q = 512  # query rows per tile, fewer when there are many heads
TILE_ELEMENTS = 2**22  # a score tile of all heads at once: 16 MiB in float32


def chunked_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    allowed: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int = BLOCK_K,
) -> Tensor:
    """softmax(query keyᵀ * scale + bias, where allowed) value, one tile at a time.

    Args:
        query, key, value: ``(*lead, T, D)``, ``(*lead, S, D)``, ``(*lead, S, Dv)``.
        allowed: boolean, True = may attend, broadcastable to ``(*lead, T, S)``.
        bias: float, added to the scaled scores, broadcastable to ``(*lead, T, S)``;
            differentiable.
        causal: query i sees keys ``j <= i + S - T`` (bottom-right alignment).
        scale: multiplies the dot products; None: 1/sqrt(D), as :func:`selfattn.attention`.
        block_q, block_k: rows of queries and columns of keys per tile; by default
            ``block_q`` keeps a tile of all heads at ``TILE_ELEMENTS``, at most ``MAX_BLOCK_Q``.

    Returns:
        ``(*lead, T, Dv)`` in the dtype of the inputs.

    Raises:
        ValueError: in one line, for what :func:`selfattn.attention` refuses (shapes, dtypes,
            devices, a scale that is no finite number), an ``allowed`` that is not boolean or
            a ``bias`` that is not float, and block sizes below 1.
    """
    # Imported here: attention.py imports this module (as ring_attention does).
    from selfattn.attention import checked_mask, make_call

    scale = make_call(query, key, value, None, causal, "dot", scale, 0.0).scale
    for name, mask, kind in (("allowed", allowed, "boolean"), ("bias", bias, "floating-point")):
        if mask is not None:
            mask = checked_mask(mask, query, key, name)
            if not (mask.dtype == torch.bool if kind == "boolean" else mask.is_floating_point()):
                raise ValueError(f"{name} must be a {kind} tensor, got {mask.dtype}")
    if not is_integer(block_k, least=1) or not (block_q is None or is_integer(block_q, least=1)):
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    return tiled_attention(
        query, key, value, allowed=allowed, bias=bias, causal=causal, scale=scale,
        block_q=block_q, block_k=block_k,
    )  # fmt: skip


def tiled_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    allowed: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    scale: float,
    block_q: int | None = None,
    block_k: int = BLOCK_K,
) -> Tensor:
    """:func:`chunked_attention` on inputs already checked, as ``attention()``'s
    :func:`~selfattn.attention.make_call` checks them: its backend calls this, so that no call
    is checked twice."""
    lead, t, dv = query.shape[:-2], query.shape[-2], value.shape[-1]
    block_q = default_block_q(lead, block_k) if block_q is None else block_q
    compute = torch.float32 if query.dtype in REDUCED_PRECISION else query.dtype
    # (N, T, D), (N, S, D), (N, S, Dv) with N = prod(lead): one batched matmul per tile.
    flat = [x.to(compute).reshape(math.prod(lead), *x.shape[-2:]) for x in (query, key, value)]
    allowed, bias = (unexpanded(at_least_2d(mask)) for mask in (allowed, bias))
    output = _ChunkedAttention.apply(*flat, allowed, bias, lead, causal, scale, block_q, block_k)
    return output.reshape(*lead, t, dv).to(query.dtype)


def default_block_q(lead: tuple[int, ...], block_k: int) -> int:
    """Query rows per tile: a tile of every head at ``TILE_ELEMENTS``, 16 to ``MAX_BLOCK_Q``."""
    per_query = max(1, math.prod(lead)) * block_k  # a tile of every head (batch 0: none)
    return max(16, min(MAX_BLOCK_Q, TILE_ELEMENTS // per_query))


def at_least_2d(mask: Tensor | None) -> Tensor | None:
    """A mask of shape (S,) or () as (1, S) or (1, 1): a view whose last two dims are (T, S)."""
    if mask is None or mask.dim() >= 2:
        return mask
    return mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))


def unexpanded(mask: Tensor | None) -> Tensor | None:
    """The mask at its own size: each axis it is expanded along (stride 0) narrowed to 1.

    A view, equal to the mask once broadcast; the casts and clamps of ``finite_bias`` on an
    expanded (B, H, T, S) view would otherwise allocate all of it."""
    if mask is None:
        return None
    if all(step or size <= 1 for step, size in zip(mask.stride(), mask.shape, strict=True)):
        return mask  # nothing expanded: the mask itself, not a view of it
    return mask[tuple(slice(0, 1) if step == 0 else slice(None) for step in mask.stride())]


def _tile(mask: Tensor, rows: slice, cols: slice) -> Tensor:
    """The part of a broadcast mask that covers rows x cols (a size-1 axis stays whole)."""
    return mask[
        ...,
        rows if mask.shape[-2] > 1 else slice(None),
        cols if mask.shape[-1] > 1 else slice(None),
    ]


class Masks:
    """What may not be attended, applied to one tile of scores at a time, and the exponent
    base that suits it: 2 for a masked or causal call (``exp2`` is fast on -inf), else e."""

    def __init__(
        self, lead: torch.Size, allowed: Tensor | None, causal: bool, has_bias: bool
    ) -> None:
        self.lead = lead
        self.allowed = allowed
        self.causal = causal
        base_two = allowed is not None or causal or has_bias
        self.unit = LOG2E if base_two else 1.0  # scores are multiplied by it: log_base(e)
        self.exp_ = Tensor.exp2_ if base_two else Tensor.exp_
        self.log = Tensor.log2 if base_two else Tensor.log

    def key_tiles(self, rows: slice, t: int, s: int, block_k: int) -> list[tuple[slice, bool]]:
        """The key tiles the query rows can see, and whether each crosses the causal diagonal.

        With ``causal``, keys after the last visible one (``rows.stop - 1 + S - T``) are never
        computed: tiles entirely above the diagonal are skipped and the last one is cut short.
        """
        end = s
        if self.causal:
            end = max(0, min(s, rows.stop + s - t))
        tiles = []
        for start in range(0, end, block_k):
            cols = slice(start, min(start + block_k, end))
            crosses = self.causal and cols.stop - 1 > rows.start + s - t
            tiles.append((cols, crosses))
        return tiles

    def apply(
        self,
        scaled: Tensor,
        bias: Tensor | None,
        rows: slice,
        cols: slice,
        crosses_diagonal: bool,
        offset: int,
    ) -> None:
        """Add the bias tile (made ready by :func:`finite_bias` as it is read) and set what
        may not be attended to -inf, in place."""
        view = scaled.view(*self.lead, *scaled.shape[-2:])  # (*lead, bq, bk)
        if bias is not None:
            bias_tile = finite_bias(_tile(bias, rows, cols), scaled.dtype, self.unit)
            view.add_(bias_tile, alpha=self.unit)  # in the scores' base
        if self.allowed is not None:
            view.masked_fill_(_tile(self.allowed, rows, cols).logical_not(), -math.inf)
        if crosses_diagonal:
            query_pos = torch.arange(rows.start, rows.stop, device=scaled.device).unsqueeze(-1)
            key_pos = torch.arange(cols.start, cols.stop, device=scaled.device)
            scaled.masked_fill_(key_pos > query_pos + offset, -math.inf)


def lowest_as_minus_inf(bias: Tensor) -> Tensor:
    """A float mask with its dtype's lowest finite value, ``torch.finfo(dtype).min`` (how
    Hugging Face marks a masked key), made -inf, as every backend adds it: it masks as -inf
    does, so a query that sees no other key gets output 0, not the average of the values.
    Where a query sees any other key nothing changes: the stand-in's weight was already 0
    (bar a float16 mask's keys within 32 of it: e⁻³²). Gradients pass elsewhere; there they
    are 0, as a masked key's."""
    return bias.masked_fill(bias == torch.finfo(bias.dtype).min, -math.inf)


def finite_bias(bias: Tensor | None, compute: torch.dtype, unit: float) -> Tensor | None:
    """The bias for a backend that computes in ``compute`` and multiplies the bias by ``unit``.

    Its dtype's lowest value masks (:func:`lowest_as_minus_inf`). A wider bias is then cast to
    ``compute``, as the explicit path adds it (beyond its range: ±inf, a masked key). Finite
    values are then clamped to ±limit, half the largest number of ``compute`` over ``unit``,
    so that the arithmetic stays finite: a row of biases beyond it weighs its keys as the
    explicit path does, not emptied or NaN. ±inf stay; gradients pass unchanged (but for
    the lowest value's, 0 as a masked key's)."""
    if bias is None:
        return None
    bias = lowest_as_minus_inf(bias)
    if bias.dtype.itemsize > compute.itemsize:
        bias = bias.to(compute)
    limit = torch.finfo(compute).max / (2 * unit)
    if limit >= torch.finfo(bias.dtype).max:
        return bias  # its finite values already lie within ±limit
    clamped = bias.detach().clamp(-limit, limit)
    if torch.is_grad_enabled() and bias.requires_grad:
        clamped = clamped + (bias - bias.detach())  # adds exactly 0, carrying bias's gradient
    return torch.where(bias.isinf(), bias, clamped)


def _forward_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    allowed: Tensor | None,
    bias: Tensor | None,
    lead: Sequence[int],
    causal: bool,
    scale: float,
    block_q: int,
    block_k: int,
) -> tuple[Tensor, Tensor]:
    """Output (N, T, Dv) and lse (N, T, 1) of (N, T, D) inputs, masks at their own size."""
    masks = Masks(torch.Size(lead), allowed, causal, has_bias=bias is not None)
    return tile_forward(query, key, value, bias, masks, scale, block_q, block_k)


def _forward_fake(
    query: Tensor, key: Tensor, value: Tensor, *masks_and_config: object
) -> tuple[Tensor, Tensor]:
    """Output and lse of ``chunked_forward``'s shapes, for torch.compile's tracing."""
    n, t, _ = query.shape
    return query.new_empty(n, t, value.shape[-1]), query.new_empty(n, t, 1)


def _backward_op(
    grad_output: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    allowed: Tensor | None,
    bias: Tensor | None,
    output: Tensor,
    lse: Tensor,
    lead: Sequence[int],
    causal: bool,
    scale: float,
    block_q: int,
    block_k: int,
    bias_grad: bool,
) -> list[Tensor]:
    """[dQ, dK, dV], and dBias (in the bias's dtype and shape) when ``bias_grad``."""
    masks = Masks(torch.Size(lead), allowed, causal, has_bias=bias is not None)
    grads = tile_backward(
        grad_output, query, key, value, bias, output, lse, masks, scale, block_q, block_k, bias_grad
    )
    return [grad for grad in grads if grad is not None]


def _backward_fake(
    grad_output: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    allowed: Tensor | None,
    bias: Tensor | None,
    *config_and_bias_grad: object,
) -> list[Tensor]:
    """Gradients of ``chunked_backward``'s shapes and strides, for torch.compile's tracing."""
    grads = [torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)]
    return [*grads, torch.empty_like(bias)] if config_and_bias_grad[-1] else grads


# The kernels as operators (see the module's docstring), registered with a Library rather than
# torch.library.custom_op: about 15 us a call on this CPU, where custom_op's autograd wrapper
# added 0.1-0.2 ms to a forward and backward. _ChunkedAttention is their autograd formula, which
# torch.compile traces through (torch 2.4 and later, static shapes there: its SymFloat scale
# under dynamic=True fails). Defined once per process: a reload (Jupyter's autoreload) or a
# second copy of this file keeps the first Library, whose handles torch.ops has cached.
def _define_operators() -> torch.library.Library:
    """The Library that defines the two operators, with their kernels and shape functions."""
    library = torch.library.Library("selfattn", "FRAGMENT")
    library.define(
        "chunked_forward(Tensor query, Tensor key, Tensor value, Tensor? allowed, Tensor? bias, "
        "SymInt[] lead, bool causal, float scale, SymInt block_q, SymInt block_k) "
        "-> (Tensor, Tensor)"
    )
    library.define(
        "chunked_backward(Tensor grad_output, Tensor query, Tensor key, Tensor value, "
        "Tensor? allowed, Tensor? bias, Tensor output, Tensor lse, SymInt[] lead, bool causal, "
        "float scale, SymInt block_q, SymInt block_k, bool bias_grad) -> Tensor[]"
    )
    library.impl("chunked_forward", _forward_op, "CompositeExplicitAutograd")
    library.impl("chunked_backward", _backward_op, "CompositeExplicitAutograd")
    torch.library.register_fake("selfattn::chunked_forward", _forward_fake, lib=library)
    torch.library.register_fake("selfattn::chunked_backward", _backward_fake, lib=library)
    return library


if not hasattr(torch.ops.selfattn, "chunked_forward"):
    _LIBRARY = _define_operators()


class _ChunkedAttention(torch.autograd.Function):
    """Forward saves (query, key, value, allowed, bias, output, lse); backward recomputes the
    weights.

    The backward is not itself differentiable (it writes tiles in place): asking it for a graph
    raises (:func:`refuse_double_backward`) instead of silently dropping second-order terms.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        allowed: Tensor | None,
        bias: Tensor | None,
        *config: object,  # lead, causal, scale, block_q, block_k
    ) -> Tensor:
        output, lse = torch.ops.selfattn.chunked_forward.default(
            query, key, value, allowed, bias, *config
        )
        ctx.save_for_backward(query, key, value, allowed, bias, output, lse)
        ctx.config = config
        return output

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor
    ) -> tuple[Tensor | None, ...]:
        query, key, value, allowed, bias, output, lse = ctx.saved_tensors
        refuse_double_backward("chunked", grad_output, query, key, value, bias)
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        grads = torch.ops.selfattn.chunked_backward.default(
            grad_output, query, key, value, allowed, bias, output, lse, *ctx.config, bias_grad
        )
        return (*grads[:3], None, grads[3] if bias_grad else None, *[None] * len(ctx.config))


def refuse_double_backward(
    backend: str, *tensors: Tensor | None, instead: str = "backend='explicit' or 'sdpa'"
) -> None:
    """Raise when autograd records a fused backward (``create_graph=True``) through a tensor
    that needs gradients: its gradients are computed outside autograd, so returning them would
    silently drop the second-order terms. ``instead`` names what differentiates twice."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        raise RuntimeError(
            f"backend {backend!r} has first derivatives only (its backward cannot be "
            "differentiated: no create_graph=True, gradgradcheck or Hessians through it); use "
            f"{instead} for higher derivatives"
        )


def tile_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: Tensor | None,
    masks: Masks,
    scale: float,
    block_q: int,
    block_k: int,
) -> tuple[Tensor, Tensor]:
    """Output (N, T, Dv) and log-sum-exp (N, T, 1) in ``masks``' base, +inf for empty rows.

    Keys carry a column of ones and the query tile a column holding ``-shift``, so the scores
    come out of the product already shifted, one pass over each score tile saved. The shift
    is each row's maximum from the block's first tile (``_RowState.exact_step``); later tiles
    are exponentiated against it unchanged (``lazy_step``), their weights allowed to exceed
    1, unless a tile's row sums pass ``LAZY_LIMIT``: that tile is redone the exact way.
    """
    n, t, _ = query.shape
    s, dv = key.shape[1], value.shape[-1]
    key_and_one = torch.cat([key, key.new_ones(n, s, 1)], dim=-1).transpose(1, 2)  # (N, D+1, S)
    output = query.new_empty(n, t, dv)
    lse = query.new_empty(n, t, 1)
    tile_buffer = query.new_empty(n * min(block_q, t) * min(block_k, s))
    for start in range(0, t, block_q):
        rows = slice(start, min(start + block_q, t))
        state = _RowState(query[:, rows] * (scale * masks.unit), dv, masks, bias)
        for cols, crosses in masks.key_tiles(rows, t, s, block_k):
            scaled = _buffer_view(tile_buffer, (n, state.rows, cols.stop - cols.start))
            tile = (key_and_one, rows, cols, crosses, s - t, scaled)
            state.shifted_scores(*tile)
            if state.all_seen:
                if state.lazy_step(scaled, value[:, cols]):
                    continue
                state.shifted_scores(*tile)  # the lazy step spent them: again, for the exact one
            state.exact_step(scaled, value[:, cols])
        output[:, rows], lse[:, rows] = state.result()
    return output, lse


LAZY_LIMIT = 2.0**64  # largest row sum of one tile's weights taken without a new shift


class _RowState:
    """The online softmax of one query block: its shift, unnormalised output and row sums."""

    def __init__(self, query_tile: Tensor, dv: int, masks: Masks, bias: Tensor | None) -> None:
        n, self.rows, d = query_tile.shape
        self.masks, self.bias = masks, bias
        self.exp_, self.log = masks.exp_, masks.log  # in the scores' base
        self.query_and_shift = torch.cat([query_tile, query_tile.new_zeros(n, self.rows, 1)], -1)
        self.neg_shift = query_tile.new_zeros(n, self.rows, 1)
        # The column the keys' ones multiply holds -shift, or stays 0 under a float bias: its
        # shift is subtracted after the bias is added, rounding as the explicit path does (a
        # shift near a bias of -1e9 would otherwise cancel it inexactly in float32).
        self.shift_column = self.query_and_shift[..., d:] if bias is None else None
        self.acc = query_tile.new_zeros(n, self.rows, dv)  # unnormalised output
        self.row_sum = query_tile.new_zeros(n, self.rows, 1)
        self.seen = torch.zeros(n, self.rows, 1, dtype=torch.bool, device=query_tile.device)
        self.all_seen = False

    def shifted_scores(
        self, key_and_one: Tensor, rows: slice, cols: slice, crosses: bool, offset: int, out: Tensor
    ) -> Tensor:
        """One tile of (q·k·scale + bias)·unit - shift, masked, into ``out`` (see ``Masks``)."""
        torch.bmm(self.query_and_shift, key_and_one[:, :, cols], out=out)
        self.masks.apply(out, self.bias, rows, cols, crosses, offset)
        if self.shift_column is None:
            out.add_(self.neg_shift)
        return out

    def exact_step(self, shifted: Tensor, value: Tensor) -> None:
        """The textbook update: the new shift is each row's running maximum."""
        shift = -self.neg_shift
        tile_max = shifted.amax(dim=-1, keepdim=True) + shift
        new_shift = torch.where(self.seen, torch.maximum(shift, tile_max), tile_max)
        # A row that has seen only -inf so far keeps shift 0, so that exp gives 0, not NaN.
        new_shift = new_shift.nan_to_num_(neginf=0.0)
        weights = self.exp_(shifted.sub_(new_shift - shift))
        correction = self.exp_(shift - new_shift).masked_fill_(~self.seen, 0.0)
        self.acc.mul_(correction).baddbmm_(weights, value)
        self.row_sum.mul_(correction).add_(weights.sum(dim=-1, keepdim=True))
        self.neg_shift.copy_(-new_shift)
        if self.shift_column is not None:
            self.shift_column.copy_(self.neg_shift)
        self.seen |= tile_max > -math.inf
        self.all_seen = bool(self.seen.all())

    def lazy_step(self, shifted: Tensor, value: Tensor) -> bool:
        """Add one tile against the current shift; False (nothing added) if its sums overflow."""
        weights = self.exp_(shifted)
        sums = weights.sum(dim=-1, keepdim=True)
        if not sums.max() <= LAZY_LIMIT:  # inf or NaN fail too
            return False
        self.acc.baddbmm_(weights, value)
        self.row_sum += sums
        return True

    def result(self) -> tuple[Tensor, Tensor]:
        """Normalised output (N, bq, Dv) and log-sum-exp (N, bq, 1), +inf if empty."""
        empty = self.row_sum == 0
        output = self.acc / self.row_sum.masked_fill(empty, 1.0)
        lse = (self.log(self.row_sum) - self.neg_shift).masked_fill_(empty, math.inf)
        return output, lse


def tile_backward(
    grad_output: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: Tensor | None,
    output: Tensor,
    lse: Tensor,
    masks: Masks,
    scale: float,
    block_q: int,
    block_k: int,
    want_bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of query, key, value (and bias), recomputing each weights tile from lse."""
    n, t, _ = query.shape
    s = key.shape[1]
    grad_output = grad_output.contiguous()
    delta = (grad_output * output).sum(dim=-1, keepdim=True)  # (N, T, 1): rowsum(dO * O)
    key_t, value_t = key.transpose(1, 2), value.transpose(1, 2)
    grad_query = torch.empty_like(query)
    grad_key = torch.zeros_like(key)
    grad_value = torch.zeros_like(value)
    grad_bias = torch.zeros_like(bias, dtype=query.dtype) if want_bias_grad else None
    tile_size = n * min(block_q, t) * min(block_k, s)
    weights_buffer, grad_scores_buffer = query.new_empty(tile_size), query.new_empty(tile_size)
    # dK and dV tiles are computed here, then added to their (strided) rows of grad_key/value.
    key_tile_buffer = query.new_empty(n * min(block_k, s) * max(key.shape[-1], value.shape[-1]))
    for start in range(0, t, block_q):
        rows = slice(start, min(start + block_q, t))
        query_tile = query[:, rows] * (scale * masks.unit)  # in the forward's base
        grad_output_tile = grad_output[:, rows]
        bq = query_tile.shape[1]
        grad_query_tile = query.new_zeros(query_tile.shape)
        for cols, crosses in masks.key_tiles(rows, t, s, block_k):
            bk = cols.stop - cols.start
            weights = _buffer_view(weights_buffer, (n, bq, bk))
            torch.bmm(query_tile, key_t[:, :, cols], out=weights)
            masks.apply(weights, bias, rows, cols, crosses, s - t)
            masks.exp_(weights.sub_(lse[:, rows]))
            grad_value_tile = _buffer_view(key_tile_buffer, (n, bk, value.shape[-1]))
            torch.bmm(weights.transpose(1, 2), grad_output_tile, out=grad_value_tile)
            grad_value[:, cols] += grad_value_tile
            # dS = weights * (dO Vᵀ - delta): the gradient of the masked, scaled scores.
            grad_scores = _buffer_view(grad_scores_buffer, (n, bq, bk))
            torch.bmm(grad_output_tile, value_t[:, :, cols], out=grad_scores)
            grad_scores.sub_(delta[:, rows]).mul_(weights)
            grad_query_tile.baddbmm_(grad_scores, key[:, cols])
            grad_key_tile = _buffer_view(key_tile_buffer, (n, bk, key.shape[-1]))
            torch.bmm(grad_scores.transpose(1, 2), query_tile, out=grad_key_tile)
            grad_key[:, cols].add_(grad_key_tile, alpha=1 / masks.unit)  # dSᵀ Q · scale
            if grad_bias is not None:
                bias_tile = _tile(grad_bias, rows, cols)
                per_lead = grad_scores.view(*masks.lead, bq, bk)
                bias_tile += per_lead.sum_to_size(bias_tile.shape)
        grad_query[:, rows] = grad_query_tile.mul_(scale)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_query, grad_key, grad_value, grad_bias


def _buffer_view(buffer: Tensor, shape: tuple[int, int, int]) -> Tensor:
    """A contiguous tensor of ``shape`` on the front of a preallocated flat buffer."""
    return buffer[: math.prod(shape)].view(shape)
