"""The self-attention core: ``attention(query, key, value)`` in the six steps of the guide.

The explicit path reads like the formula, with the guide's names::

    scores  = query @ keyᵀ                 step 2: similarity of every query with every key
    scaled  = scores * scale               step 3: scale = 1/sqrt(d_k) for dot products
    masked  = scaled, with what may not be attended set to -inf (or a float mask added)
    weights = softmax(masked) over keys    step 4: every row sums to 1 (0 if fully masked)
    output  = weights @ value              step 5: the weight-averaged sum of the values

Step 1 (tokens to embeddings plus positions) and step 6 (query, key and value made by the
learnable W_q, W_k, W_v) live in layers.py; ``selfattn demo`` prints all six on a small example.

Shapes: query ``(..., T, D)``, key ``(..., S, D)``, value ``(..., S, Dv)``; output
``(..., T, Dv)``. Rows are queries, columns are keys.

Conventions, the same on every backend:

- A boolean mask's ``True`` means "may attend" (as in torch SDPA); a float mask is added to the
  scaled scores, where -inf and its dtype's lowest value, ``torch.finfo(dtype).min`` (Hugging
  Face's "masked"), both mask. Masks broadcast to ``(..., T, S)``.
- ``causal=True`` aligns bottom-right: query i sees keys ``j <= i + (S - T)``, so the last query
  sees every key. With T == S this is the usual lower triangle. T=2, S=4 (x = may attend)::

        keys   0 1 2 3
      query 0  x x x .
      query 1  x x x x

  This is what decoding with a key/value cache needs: new queries come after the cached keys.
- A fully masked row gets weights 0 and output 0, never NaN, forward and backward.
- Half and bfloat16 inputs are computed in float32 and the output cast back.

Backends are a small registry (``BACKENDS``): ``explicit`` is the reference and the only one
that gives a trace; the others are checked against it. ``chunked`` (kernels/chunked.py) is
FlashAttention's online softmax in PyTorch ops: O(T·D) memory, never a ``(T, S)`` tensor;
``triton`` (kernels/triton_attention.py) is the same algorithm as a GPU kernel.
``backend="auto"`` (:func:`choose_backend`) takes explicit when a trace is asked for, Triton on
CUDA for the float16/bfloat16 calls it can compute, chunked when the weights would exceed
``MEMORY_BUDGET`` (2 GiB) and torch's kernel would be handed a ``(T, S)`` mask, otherwise
torch's fused kernel.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from selfattn.errors import SelfAttnError, is_integer
from selfattn.kernels.chunked import (
    REDUCED_PRECISION,
    at_least_2d,
    lowest_as_minus_inf,
    tiled_attention,
    unexpanded,
)

SIMILARITIES = ("dot", "cosine")
MEMORY_BUDGET = 2 * 2**30  # bytes of (..., T, S) weights above which auto avoids (T, S) tensors


@dataclass(frozen=True)
class AttentionTrace:
    """Every intermediate of one explicit attention call, named as in the guide.

    Rows are queries, columns are keys. ``query`` and ``key`` are what the similarity saw
    (L2-normalised for cosine). Every tensor but ``output`` is in the compute dtype (float32
    for float16/bfloat16 inputs); ``output`` is in the input dtype, as ``attention`` returns it.
    """

    query: Tensor  # (..., T, D) the queries (step 6: Q)
    key: Tensor  # (..., S, D) the keys (step 6: K)
    value: Tensor  # (..., S, Dv) the values (step 6: V)
    scores: Tensor  # (..., T, S) step 2: raw similarity, query @ keyᵀ (dot product or cosine)
    scaled: Tensor  # (..., T, S) step 3: scores * scale (default 1/sqrt(d_k) for dot)
    masked: Tensor  # (..., T, S) scaled with the mask applied (-inf where not allowed)
    weights: Tensor  # (..., T, S) step 4: softmax(masked) per row: sums to 1, 0 if fully masked
    output: Tensor  # (..., T, Dv) step 5: weights @ value (dropout_p > 0: dropped weights @ value)
    scale: float  # the factor of step 3
    similarity: str  # "dot" or "cosine"


@dataclass(frozen=True)
class AttentionCall:
    """One validated request, as every backend receives it."""

    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | None
    causal: bool
    similarity: str
    scale: float
    dropout_p: float

    @property
    def weights_bytes(self) -> int:
        """Bytes the full (..., T, S) weights would take in the compute dtype."""
        lead = math.prod(self.query.shape[:-2])
        itemsize = 4 if self.query.dtype in REDUCED_PRECISION else self.query.element_size()
        return lead * self.query.shape[-2] * self.key.shape[-2] * itemsize


def default_scale(similarity: str, head_dim: int) -> float:
    """1/sqrt(D) for dot products; sqrt(D) for cosine.

    The cosine of random D-dimensional vectors has standard deviation 1/sqrt(D), so multiplying
    by sqrt(D) gives cosine scores the same spread as scaled dot products of unit-variance
    vectors; with scale 1 the weights of a cosine head would be nearly uniform.
    """
    check_similarity(similarity)
    if not is_integer(head_dim, 1):
        raise ValueError(f"head_dim must be a whole number >= 1, got {head_dim!r}")
    return math.sqrt(head_dim) if similarity == "cosine" else 1.0 / math.sqrt(head_dim)


def check_similarity(similarity: object) -> None:
    """A one-line ValueError unless ``similarity`` is one of :data:`SIMILARITIES`."""
    if similarity not in SIMILARITIES:
        raise ValueError(f"unknown similarity {similarity!r}; choose 'dot' or 'cosine'")


def causal_mask(t: int, s: int, device: torch.device | str | None = None) -> Tensor:
    """Boolean (T, S) mask, True where query i may attend key j: j <= i + (S - T)."""
    rows = torch.arange(t, device=device).unsqueeze(-1)
    cols = torch.arange(s, device=device)
    return cols <= rows + (s - t)


def allowed_mask(call: AttentionCall) -> Tensor | None:
    """The boolean part of the call's masking (user bool mask and causal), or None."""
    allowed = None
    if call.mask is not None and call.mask.dtype == torch.bool:
        allowed = call.mask
    if call.causal:
        tri = causal_mask(call.query.shape[-2], call.key.shape[-2], call.query.device)
        allowed = tri if allowed is None else allowed & tri
    return allowed


def normalize_for_similarity(
    call: AttentionCall, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """Query and key as the dot product sees them, in ``dtype`` (default: the inputs'):
    L2-normalised for cosine similarity, in float32 for half and bfloat16 inputs (there a
    zero vector's norm rounds to 0, giving NaN everywhere, and one past 65504 to inf)."""
    query, key = call.query, call.key
    if call.similarity == "cosine":
        wide = torch.float32 if query.dtype in REDUCED_PRECISION else query.dtype
        query, key = F.normalize(query.to(wide), dim=-1), F.normalize(key.to(wide), dim=-1)
    dtype = dtype or call.query.dtype
    return query.to(dtype), key.to(dtype)


def _explicit(call: AttentionCall) -> AttentionTrace:
    """The reference: the six steps, in order, every intermediate kept."""
    compute = torch.float32 if call.query.dtype in REDUCED_PRECISION else call.query.dtype
    query, key = normalize_for_similarity(call, compute)
    value = call.value.to(compute)

    scores = query @ key.transpose(-2, -1)  # (..., T, S)
    scaled = scores * call.scale

    masked = scaled
    if call.mask is not None and call.mask.dtype != torch.bool:
        masked = masked + lowest_as_minus_inf(call.mask).to(compute)
    allowed = allowed_mask(call)
    if allowed is not None:
        masked = masked.masked_fill(~allowed, float("-inf"))

    weights = safe_softmax(masked)
    attended = F.dropout(weights, call.dropout_p) if call.dropout_p > 0 else weights
    output = attended @ value  # (..., T, Dv)
    return AttentionTrace(
        query=query,
        key=key,
        value=value,
        scores=scores,
        scaled=scaled,
        masked=masked,
        weights=weights,
        output=output.to(call.query.dtype),
        scale=call.scale,
        similarity=call.similarity,
    )


def safe_softmax(masked: Tensor) -> Tensor:
    """Softmax over the last axis; a row that is all -inf gives zeros instead of NaN."""
    if masked.shape[-1] == 0:  # no keys at all: nothing to weigh
        return masked
    row_max = masked.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(masked - row_max)
    total = exp.sum(dim=-1, keepdim=True)
    return exp / torch.where(total > 0, total, torch.ones_like(total))


def _sdpa(call: AttentionCall) -> Tensor:
    """torch's fused kernel, differentiable twice (:class:`_HigherOrderThroughMath`) where
    autograd may ask it for a graph."""
    output = _fused(call)
    inputs = (call.query, call.key, call.value, call.mask)
    if (
        not torch.is_grad_enabled()
        or not any(x is not None and x.requires_grad for x in inputs)
        or call.dropout_p > 0  # the math kernel would draw other dropout
        or torch.compiler.is_compiling()  # a compiled graph has first derivatives only
        or torch._C._are_functorch_transforms_active()  # torch.func: first derivatives only
    ):
        return output
    settings = (call.causal, call.similarity, call.scale)
    return _HigherOrderThroughMath.apply(output, settings, *inputs)


class _HigherOrderThroughMath(torch.autograd.Function):
    """The fused kernel's output, passed through: a plain backward hands the gradient on to the
    fused kernel's own backward. That one cannot itself be differentiated, so a backward asked
    for a graph (``create_graph=True``: gradgradcheck, Hessians, gradient penalties) hands it
    nothing (so it does not run) and recomputes the call through torch's math kernel, which
    has derivatives of every order."""

    @staticmethod
    def forward(ctx, output: Tensor, settings: tuple[bool, str, float], *inputs: Tensor | None):
        ctx.settings = settings  # the tensors only as saved ones (freed, hooked as any)
        ctx.save_for_backward(*inputs)
        return output.clone()  # not a view: a caller may change it in place

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        by_input: list[Tensor | None] = [None] * len(ctx.needs_input_grad[2:])
        if not torch.is_grad_enabled():
            return (grad_output, None, *by_input)
        inputs = list(ctx.saved_tensors)
        wanted = [i for i, needs in enumerate(ctx.needs_input_grad[2:]) if needs]
        for i in wanted:  # a node of its own per argument: attention(x, x, x) sums three parts
            inputs[i] = inputs[i].view_as(inputs[i])
        with sdpa_kernel(SDPBackend.MATH):
            output = _fused(AttentionCall(*inputs, *ctx.settings, dropout_p=0.0))
        sources = [inputs[i] for i in wanted]
        grads = torch.autograd.grad(output, sources, grad_output, create_graph=True)
        for i, grad in zip(wanted, grads, strict=True):
            by_input[i] = grad
        return (None, None, *by_input)


def _sees_every_key(call: AttentionCall) -> bool:
    """A causal call of one query (a decoding step after the cache): it sees every key, so
    no triangle needs building."""
    return call.causal and call.query.shape[-2] == 1


# torch's compiler traces statically_known_true from 2.8 on; 2.4 to 2.7 skip it (a graph break).
_TRACES_KNOWN_TRUE = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 8)


def _known_equal(t: int, s: int) -> bool:
    """Whether T == S is known: always in eager calls; compiled with dynamic sizes only where
    the symbols prove it (one query after a cache: S is a symbol, and torch's is_causal takes
    no SymBool; the mask is built instead). The import waits for a compiled call: 0.35 s that
    every ``import selfattn`` would pay. torch before 2.8 cannot trace statically_known_true
    (fullgraph=True failed), nor tell a symbol from an int: compiled, it builds the mask."""
    if not torch.compiler.is_compiling():
        return t == s
    if not _TRACES_KNOWN_TRUE:
        return False
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(t == s)


def _fused(call: AttentionCall) -> Tensor:
    """torch's fused kernel, with our conventions (bottom-right causal, 0 for masked rows).

    Inputs go in as 4-D views (no copies) and masks as given (broadcast, never expanded),
    so torch can take its fused paths.
    """
    query, key = normalize_for_similarity(call)
    value = call.value
    t, s = query.shape[-2], key.shape[-2]
    lead = query.shape[:-2]
    query, key, value = (as_4d(x) for x in (query, key, value))
    bias = None
    if call.mask is not None and call.mask.dtype != torch.bool:
        if _overflows(call.mask, query.dtype):  # e.g. -1e5 in float16: run in float32
            query, key, value = (x.float() for x in (query, key, value))
        bias = call.mask.to(query.dtype)

    is_causal = call.causal and _known_equal(t, s) and call.mask is None
    causal_free = _sees_every_key(call)
    allowed = None
    if call.causal and not is_causal and not causal_free:
        allowed = allowed_mask(call)
    elif call.mask is not None and call.mask.dtype == torch.bool:
        allowed = call.mask

    # Rows with nothing to attend: give them a harmless row, then zero their output.
    empty_rows = None
    if allowed is not None:
        empty_rows = ~allowed.any(dim=-1, keepdim=True)
        allowed = allowed | empty_rows
    if bias is not None:  # -inf or finfo.min (lowest_as_minus_inf) in the mask's own dtype
        hidden = call.mask <= torch.finfo(call.mask.dtype).min
        blocked = hidden if allowed is None else hidden | ~allowed
        bias_empty = blocked.all(dim=-1, keepdim=True)
        bias = torch.where(bias_empty, torch.zeros_like(bias), bias)
        empty_rows = bias_empty if empty_rows is None else empty_rows | bias_empty
    attn_mask = _combine(allowed, bias)
    if attn_mask is not None and len(lead) > 2:
        attn_mask = as_4d(attn_mask.expand(*lead, t, s))

    output = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=call.dropout_p,
        is_causal=is_causal,
        scale=call.scale,
    )
    output = output.reshape(*lead, t, value.shape[-1]).to(call.query.dtype)
    # Padding masks never have empty rows, so eager skips the fill; a compiled graph cannot
    # branch on tensor data and always fills.
    if empty_rows is not None and (torch.compiler.is_compiling() or bool(empty_rows.any())):
        output = output.masked_fill(empty_rows, 0.0)
    return output


def _overflows(mask: Tensor, dtype: torch.dtype) -> bool:
    """Whether a float mask has finite values beyond ``dtype``'s range (inf once cast), but
    for its dtype's lowest, which masks as -inf does (:func:`lowest_as_minus_inf`).

    While torch.compile traces, whether it could: a graph cannot branch on tensor data, so a
    compiled call with a wider mask always runs in float32 (as accurate, never less).
    """
    if mask.dtype.itemsize <= dtype.itemsize or not dtype.is_floating_point:
        return False
    if torch.compiler.is_compiling():
        return True
    finite = mask.masked_fill(~torch.isfinite(mask) | (mask <= torch.finfo(mask.dtype).min), 0)
    return bool(finite.abs().amax() > torch.finfo(dtype).max) if finite.numel() else False


def as_4d(x: Tensor) -> Tensor:
    """(..., N, D) as (B, H, N, D): missing axes added, extra leading axes folded into B."""
    if x.dim() > 4:  # B counted, not -1: reshape cannot infer it when N or D is 0
        return x.reshape(math.prod(x.shape[:-3]), *x.shape[-3:])
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def _combine(allowed: Tensor | None, bias: Tensor | None) -> Tensor | None:
    if allowed is None or bias is None:
        return allowed if bias is None else bias
    return bias.masked_fill(~allowed, float("-inf"))


def _triton(call: AttentionCall) -> Tensor:
    """The fused Triton kernels (forward and backward); triton is imported only here."""
    from selfattn.kernels.triton_attention import triton_attention

    query, key = normalize_for_similarity(call)
    return triton_attention(
        query, key, call.value, mask=call.mask, causal=call.causal, scale=call.scale
    )


# The oldest Triton that compiles the kernels (tensor descriptors, autotune's do_bench), and
# the oldest whose CPU interpreter runs them; checked with benchmarks/triton_sm90.py and the
# interpreter tests (3.3 lacks tl.make_tensor_descriptor; 3.6's interpreter fails on the loops).
TRITON_MIN = (3, 4)
TRITON_MIN_INTERPRETER = (3, 7)


def _triton_too_old(interpreting: bool) -> str | None:
    """Why the installed triton is too old for the kernels (importing only triton), or None."""
    import triton

    found = re.match(r"(\d+)\.(\d+)", triton.__version__)
    needed = TRITON_MIN_INTERPRETER if interpreting else TRITON_MIN
    if found is None or tuple(map(int, found.groups())) >= needed:
        return None
    wanted = ".".join(map(str, needed))
    where = "its CPU interpreter runs the kernels from" if interpreting else "the kernels need"
    return (
        f"backend 'triton': {where} triton {wanted}, found {triton.__version__}; "
        f"pip install -U 'triton>={wanted}' (torch pins its triton: upgrade torch with it)"
    )


def triton_why_not(call: AttentionCall, instead: str | None = None) -> str | None:
    """Why the Triton kernels cannot compute this call exactly as the reference, or None;
    ``instead`` names the caller's other backends in the reasons (default: attention's)."""
    if importlib.util.find_spec("triton") is None:
        return "backend 'triton' needs the triton package: pip install 'selfattn[gpu]'"
    if call.dropout_p > 0:
        return "backend 'triton' has no dropout; use backend='explicit' or 'sdpa' for dropout_p > 0"
    if not call.query.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            f"backend 'triton' runs on CUDA tensors, got {call.query.device} (on CPU it runs "
            "only under Triton's interpreter: set TRITON_INTERPRET=1 before importing triton)"
        )
    try:
        too_old = _triton_too_old(interpreting=os.environ.get("TRITON_INTERPRET") == "1")
        if too_old is not None:
            return too_old
        from selfattn.kernels.triton_attention import unsupported_reason
    except ImportError as error:  # installed, but broken or built for another torch
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else "ImportError"
        return (
            f"backend 'triton' cannot import triton ({first_line}); reinstall it: "
            "pip install --force-reinstall 'selfattn[gpu]'"
        )
    others = {} if instead is None else {"instead": instead}
    reason = unsupported_reason(call.query, call.key, call.value, call.mask, **others)
    return None if reason is None else f"backend 'triton': {reason}"


def _chunked(call: AttentionCall) -> Tensor:
    """The tiled kernel; masks are passed as given and sliced per tile, never expanded."""
    query, key = normalize_for_similarity(call)
    is_bool = call.mask is not None and call.mask.dtype == torch.bool
    return tiled_attention(
        query,
        key,
        call.value,
        allowed=call.mask if is_bool else None,
        bias=None if is_bool else call.mask,
        causal=call.causal,
        scale=call.scale,
    )


def _chunked_why_not(call: AttentionCall) -> str | None:
    """Why the chunked kernel cannot compute this call exactly as the reference, or None."""
    if call.dropout_p > 0:
        return (
            "backend 'chunked' has no dropout; use backend='explicit' or 'sdpa' for dropout_p > 0"
        )
    return None


@dataclass(frozen=True)
class Backend:
    """An attention implementation and the calls it can compute exactly as the reference."""

    name: str
    run: Callable[[AttentionCall], Tensor]
    why_not: Callable[[AttentionCall], str | None] = lambda call: None


BACKENDS: dict[str, Backend] = {
    "explicit": Backend("explicit", lambda call: _explicit(call).output),
    "sdpa": Backend("sdpa", _sdpa),
    "chunked": Backend("chunked", _chunked, _chunked_why_not),
    "triton": Backend("triton", _triton, triton_why_not),
}


def check_backend(name: str) -> None:
    """A one-line error (a ValueError) unless ``name`` is ``"auto"`` or a registered backend."""
    if not isinstance(name, str) or (name != "auto" and name not in BACKENDS):
        names = ", ".join(["auto", *BACKENDS])
        raise SelfAttnError(f"unknown attention backend {name!r}; choose one of: {names}")


def choose_backend(call: AttentionCall, return_trace: bool = False) -> Backend:
    """What ``backend="auto"`` runs.

    Explicit when a trace is asked for; on CUDA the Triton kernels for float16/bfloat16 calls
    they can compute (float32 runs exact products there, slower than torch's); otherwise
    torch's fused kernel, except for large masked calls, which go to chunked.

    Chunked is chosen when the call has no dropout, its weights would exceed ``MEMORY_BUDGET``
    and it has a mask or is causal with T != S (but for one query, which sees every key).
    Measured on a 2-core CPU with torch 2.13: torch's fused kernel never forms the weights
    (float32, float64, bfloat16; with or without a mask; dropout aside) and runs 1.2-1.6x
    faster than chunked (docs/benchmarks.md), but ``_sdpa``
    hands it a full ``(T, S)`` mask (the bottom-right causal triangle, the user mask combined
    with it, the fully-masked-row fix) which it converts to float: 1.3 GiB measured at
    T = 16,384 (causal, S = T + 64), ~20 GiB at 65,536. Chunked slices the mask as given.
    """
    if return_trace:
        return BACKENDS["explicit"]
    half = call.query.dtype in REDUCED_PRECISION
    if call.query.is_cuda and half and BACKENDS["triton"].why_not(call) is None:
        return BACKENDS["triton"]
    t, s = call.query.shape[-2], call.key.shape[-2]
    triangle = call.causal and t != s and not _sees_every_key(call)
    sdpa_needs_full_mask = call.mask is not None or triangle
    if sdpa_needs_full_mask and call.dropout_p == 0 and call.weights_bytes > MEMORY_BUDGET:
        return BACKENDS["chunked"]
    return BACKENDS["sdpa"]


@overload  # the output alone
def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    similarity: str = "dot",
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_trace: Literal[False] = False,
) -> Tensor: ...


@overload  # the output and its trace: the explicit path's intermediates
def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    similarity: str = "dot",
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_trace: Literal[True],
) -> tuple[Tensor, AttentionTrace]: ...


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    similarity: str = "dot",
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_trace: bool = False,
) -> Tensor | tuple[Tensor, AttentionTrace]:
    """softmax(similarity(Q, K) * scale + mask) @ V; see the module docstring for conventions.

    Args:
        query, key, value: ``(..., T, D)``, ``(..., S, D)``, ``(..., S, Dv)``, same leading dims.
        mask: boolean (True = may attend) or float (added to scaled scores; -inf and
            ``torch.finfo(mask.dtype).min`` mask), broadcastable to ``(..., T, S)``.
        causal: query i sees keys up to ``i + (S - T)`` (bottom-right alignment).
        similarity: ``"dot"`` or ``"cosine"`` (query and key L2-normalised first).
        scale: multiplies the scores; None means :func:`default_scale`; 1.0 means no scaling.
        dropout_p: dropout on the weights (applied whenever > 0, as in torch SDPA).
        backend: a name in ``BACKENDS`` or ``"auto"`` (the fastest that computes the same thing).
        return_trace: also return the :class:`AttentionTrace` (explicit backend only).
    """
    call = make_call(query, key, value, mask, causal, similarity, scale, dropout_p)
    if backend == "auto":
        chosen = choose_backend(call, return_trace)
    else:
        check_backend(backend)
        chosen = BACKENDS[backend]
    if return_trace:
        if chosen.name != "explicit":
            raise ValueError(
                f"backend {chosen.name!r} cannot return a trace (it never forms the weights); "
                "use backend='explicit' or 'auto'"
            )
        trace = _explicit(call)
        return trace.output, trace
    reason = chosen.why_not(call)
    if reason is not None:
        raise ValueError(reason)
    return chosen.run(call)


def make_call(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    causal: bool,
    similarity: str,
    scale: float | None,
    dropout_p: float,
) -> AttentionCall:
    """Check shapes, dtypes and options once, with one-line errors, and resolve the scale."""
    if not isinstance(causal, bool):  # "no" or a tensor would read as True
        raise ValueError(f"causal must be True or False, got {causal!r}")
    check_similarity(similarity)
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise ValueError(
                f"{name} must be a torch.Tensor, got {type(tensor).__name__}; "
                "convert it with torch.as_tensor"
            )
        if tensor.dim() < 2:
            raise ValueError(
                f"{name} must have shape (..., length, dim), got {tuple(tensor.shape)}"
            )
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}; cast them with .to(dtype)"
        )
    if not query.device == key.device == value.device:
        raise ValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device}, "
            f"{value.device}; move them with .to(device)"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same last dim, got {query.shape[-1]} and {key.shape[-1]}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length, got {key.shape[-2]} and {value.shape[-2]}"
        )
    if not query.shape[:-2] == key.shape[:-2] == value.shape[:-2]:
        raise ValueError(
            "query, key and value must have the same leading dims, got "
            f"{tuple(query.shape[:-2])}, {tuple(key.shape[:-2])}, {tuple(value.shape[:-2])}; "
            "expand the smaller ones (fewer key/value heads: repeat_interleave them over dim -3)"
        )
    if query.shape[-1] == 0:
        raise ValueError("query and key have a head dim of 0; attention needs at least 1")
    if mask is not None:
        mask = checked_mask(mask, query, key)
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise ValueError(f"mask must be boolean (True = may attend) or float, got {mask.dtype}")
    dropout_p = _number("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    scale = default_scale(similarity, query.shape[-1]) if scale is None else _finite(scale)
    return AttentionCall(query, key, value, mask, causal, similarity, scale, dropout_p)


def checked_mask(mask: object, query: Tensor, key: Tensor, name: str = "mask") -> Tensor:
    """``mask`` if it broadcasts to the scores ``(..., T, S)``: at its own size (an expanded
    view narrowed back, so no backend's cast or fill allocates all of it), on the query's
    device (one made on the CPU serves a GPU call as it is), at least 2-D (every backend may
    index its (T, S) dims)."""
    if not isinstance(mask, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    target = (*query.shape[:-2], query.shape[-2], key.shape[-2])
    if mask.dim() > len(target):
        raise ValueError(f"{name} has more dims ({mask.dim()}) than the scores ({len(target)})")
    if not _broadcasts_to(mask.shape, target):
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to (..., T, S) = {target}; "
            "give each axis, counted from the right, that size or 1 (a padding mask (B, S) "
            f"for (B, H, T, S) scores: {name}[:, None, None, :])"
        )
    return at_least_2d(unexpanded(mask).to(query.device))


def _broadcasts_to(shape: torch.Size, target: tuple[int, ...]) -> bool:
    """Whether ``shape`` expands to ``target`` (a mask may not enlarge the scores' lead dims)."""
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _finite(scale: object) -> float:
    """``scale`` as a float (a Python, NumPy or one-element torch number), if finite.

    A tensor that needs a gradient is refused: as a float its gradient would be silently lost.
    """
    if isinstance(scale, Tensor) and scale.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "scale is a tensor that requires grad, but attention takes a number (its gradient "
            "would be lost); to learn a scale, multiply the query by it and pass scale=1.0 "
            "(for cosine, L2-normalise query and key yourself and pass similarity='dot')"
        )
    return _number("scale", scale)


def _number(name: str, value: object) -> float:
    """``value`` as a float (a Python, NumPy or one-element torch number), if finite."""
    try:
        number = math.nan if isinstance(value, (str, bool)) else float(value)
    except (TypeError, ValueError, RuntimeError):
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number
