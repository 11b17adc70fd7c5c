"""Layers built on the core: the single head of the guide, multi-head attention, positions, blocks.

The rotary decoders' pieces (Llama family, GPT-NeoX, Phi-3, Gemma) live here too:
:class:`RotaryPositions` (RoPE, whole or partial), :class:`RMSNorm` (Gemma's 1 + weight too),
:class:`GatedFeedForward` (SwiGLU, GeGLU) and :class:`GroupedQueryAttention`, whose query heads
share fewer key/value heads.

Every attention module calls :func:`selfattn.attention` through :meth:`AttentionModule.attend`,
which also reports the call to an active :func:`selfattn.record` block (eager calls only: under
``torch.compile`` it does not look, so a layer compiles whole with ``fullgraph=True``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfattn.attention import as_4d, attention, check_similarity
from selfattn.errors import is_integer, is_real
from selfattn.kernels.chunked import at_least_2d
from selfattn.recording import active_recordings


class KVCache:
    """Keys and values of the tokens seen so far, for one attention layer while decoding.

    A step writes only its own tokens, in place, into storage that doubles when full, instead
    of copying the whole cache (torch.cat: 5% of a GPT's batched generation at 100 tokens,
    more the longer the context); the first step's tensors are kept as they are. ``key`` and
    ``value`` are views of the filled part, and nothing is ever written below ``len(cache)``,
    so what an earlier step returned (and a recording kept) never changes. While gradients
    flow it concatenates instead: an in-place write would invalidate the views that autograd
    saved for backward.
    """

    def __init__(self) -> None:
        self._key: Tensor | None = None  # (B, H, capacity, D)
        self._value: Tensor | None = None  # (B, H, capacity, Dv)
        self._length = 0
        self._layer: int | None = None  # id() of the layer that extends it: one cache, one layer

    def __len__(self) -> int:
        return self._length

    @property
    def key(self) -> Tensor | None:
        """The cached keys (B, H, S, D), None before the first step."""
        return None if self._key is None else self._key[..., : self._length, :]

    @property
    def value(self) -> Tensor | None:
        """The cached values (B, H, S, Dv), None before the first step."""
        return None if self._value is None else self._value[..., : self._length, :]

    def extend(
        self, key: Tensor, value: Tensor, layer: nn.Module | None = None
    ) -> tuple[Tensor, Tensor]:
        """Append the new tokens' keys and values; return all of them. ``layer``, the module
        that calls: a cache that another layer extended is refused (two layers sharing one
        would each read the other's keys, a wrong result and no error)."""
        if layer is not None:
            if self._layer is None:
                self._layer = id(layer)
            elif self._layer != id(layer):
                raise ValueError(
                    "this KVCache holds another layer's keys and values; give each attention "
                    "layer its own cache ([KVCache() for _ in layers])"
                )
        if self._key is not None and key.shape[:-2] != self._key.shape[:-2]:
            raise ValueError(
                f"this KVCache holds keys of leading dims {tuple(self._key.shape[:-2])} (batch, "
                f"heads), got {tuple(key.shape[:-2])}; use a new cache for another batch"
            )
        start, end = self._length, self._length + key.shape[-2]
        self._key = _written(self._key, key, start, end)
        self._value = _written(self._value, value, start, end)
        self._length = end
        return self._key[..., :end, :], self._value[..., :end, :]


def _written(storage: Tensor | None, new: Tensor, start: int, end: int) -> Tensor:
    """A cache's ``storage`` holding ``new`` at positions start .. end - 1 (those before it
    filled): ``new`` itself at first, a concatenation while gradients flow, else written in
    place, into storage of twice the size when full."""
    if storage is None:
        return new
    if torch.is_grad_enabled() and (new.requires_grad or storage.requires_grad):
        return torch.cat([storage[..., :start, :], new], dim=-2)
    # Storage made under torch.inference_mode() cannot be written outside it: a new one.
    locked = storage.is_inference() and not torch.is_inference_mode_enabled()
    if end > storage.shape[-2] or locked:
        grown = new.new_empty(*new.shape[:-2], max(end, 2 * storage.shape[-2]), new.shape[-1])
        grown[..., :start, :] = storage[..., :start, :]
        storage = grown
    storage[..., start:end, :] = new
    return storage


class AttentionModule(nn.Module):
    """Base of the attention layers: options shared by every call, and the recorded call."""

    def __init__(self, similarity: str = "dot", dropout: float = 0.0) -> None:
        super().__init__()
        check_similarity(similarity)
        if not is_real(dropout) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
        self.similarity = similarity
        self.dropout = dropout
        self.backend = "auto"

    def extra_repr(self) -> str:
        return f"similarity={self.similarity!r}, dropout={self.dropout}, backend={self.backend!r}"

    def attend(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool
    ) -> Tensor:
        """query (..., H, T, D), key and value (..., H, S, D) -> (..., H, T, Dv).

        Key and value may have fewer heads, Hkv dividing H (grouped-query attention): each
        run of G = H / Hkv query heads shares one, broadcast as a view, never copied. A
        recording holds each query head's own key and value, (B, H, S, D), as a reader
        expects them.
        """
        groups = query.shape[-3] // key.shape[-3] if query.dim() > 2 and key.dim() > 2 else 1
        grouped_query, grouped_mask = query, mask
        if groups > 1:
            grouped_query = query.unflatten(-3, (-1, groups))  # (..., Hkv, G, T, D)
            key, value = (_repeat_heads(x, groups) for x in (key, value))  # (..., Hkv, G, S, D)
            grouped_mask = _grouped_mask(mask, query.shape[-3], groups)
        output = attention(
            grouped_query,
            key,
            value,
            mask=grouped_mask,
            causal=causal,
            similarity=self.similarity,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
        )
        if groups > 1:
            output = output.flatten(-4, -3)  # (..., H, T, Dv)
        recordings = active_recordings()
        if recordings and groups > 1:
            key, value = key.flatten(-4, -3), value.flatten(-4, -3)  # (..., H, S, D)
        for recording in recordings:
            recording.add(
                self,
                query=as_4d(query),
                key=as_4d(key),
                value=as_4d(value),
                mask=_mask_as_4d(mask, query),
                causal=causal,
                similarity=self.similarity,
                scale=None,
                output=as_4d(output),
            )
        return output


def _repeat_heads(x: Tensor, groups: int) -> Tensor:
    """(..., Hkv, S, D) -> (..., Hkv, G, S, D): each key/value head once per query head of its
    group, a view (stride 0 along G)."""
    return x.unsqueeze(-3).expand(*x.shape[:-2], groups, *x.shape[-2:])


def _grouped_mask(mask: Tensor | None, heads: int, groups: int) -> Tensor | None:
    """A mask for (..., H, T, S) scores as the grouped call's (..., Hkv, G, T, S) needs it: a
    head axis of H split into (Hkv, G), one of 1 given a G axis of 1; (T, S) masks unchanged.

    A head axis of another size is refused, as broadcasting to H heads would refuse it: split
    into (Hkv, G) it could otherwise pass for a mask per head of a group (3 of 6 heads)."""
    if not isinstance(mask, Tensor) or mask.dim() < 3:
        return mask  # the core names what is wrong with a mask that is no tensor
    if mask.shape[-3] == 1:
        return mask.unsqueeze(-3)
    if mask.shape[-3] != heads:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} has {mask.shape[-3]} on its head axis (dim -3) "
            f"but this layer has {heads} query heads; give that axis size {heads} (one per "
            "query head) or 1 (the same for every head)"
        )
    return mask.unflatten(-3, (-1, groups))


def _mask_as_4d(mask: Tensor | None, query: Tensor) -> Tensor | None:
    """The mask as the recorded q and k need it: at least (T, S) (a (S,) or () mask gets its
    missing dims), with query's leading dims folded as :func:`as_4d` folds them, where it has
    any to fold: a query of more than 4 dims and a mask of more than 2."""
    mask = at_least_2d(mask)
    if mask is None or mask.dim() <= 2 or query.dim() <= 4:
        return mask
    return as_4d(mask.expand(*query.shape[:-2], *mask.shape[-2:]))


# What a layer takes: its shape in words, the least dims, and whether no more are allowed.
INPUT_SHAPES = {
    "batches": ("(batch, length, d_model)", 3, True),
    "sequences": ("(..., length, d_model)", 2, False),
    "vectors": ("(..., d_model)", 1, False),  # a feed-forward takes one token's as well
}


def _check_input(x: Tensor, weight: Tensor, *, takes: str, name: str = "x") -> None:
    """A one-line ValueError for an input the layer cannot take, before any matrix product.

    ``weight`` is the layer's first projection, ``(out, d_model)``: ``x`` needs its last dim,
    dtype (unless autocast is on) and device, and the shape of :data:`INPUT_SHAPES`[takes].
    """
    d_model = weight.shape[-1]
    shape, dims, exact = INPUT_SHAPES[takes]
    if not isinstance(x, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of shape {shape}, got {type(x).__name__}; "
            f"convert it with torch.as_tensor({name}, dtype={weight.dtype})"
        )
    if x.dim() < dims or (exact and x.dim() > dims):
        fix = (
            f"add the missing leading dim with {name}.unsqueeze(0)"
            if x.dim() == dims - 1
            else f"reshape it to {shape}"
        )
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}; {fix}")
    if x.shape[-1] != d_model:
        raise ValueError(
            f"{name} has last dim {x.shape[-1]} but this layer has d_model={d_model}; "
            f"pass {name} of shape {shape}"
        )
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        fix = f"{name}.to({weight.dtype})"
        fix += f" or layer.to({x.dtype})" if x.is_floating_point() else ""
        raise ValueError(
            f"{name} is {x.dtype} but this layer's weights are {weight.dtype}; convert: {fix}"
        )
    if x.device != weight.device:
        raise ValueError(
            f"{name} is on {x.device} but this layer is on {weight.device}; move one: "
            f"{name}.to('{weight.device}') or layer.to('{x.device}')"
        )


def _check_cache(cache: object) -> None:
    """A one-line TypeError for a ``cache=`` that is not a :class:`KVCache`."""
    if cache is not None and not isinstance(cache, KVCache):
        raise TypeError(
            f"cache must be a selfattn.KVCache (one per layer, KVCache() to start), got "
            f"{type(cache).__name__}"
        )


def _check_sizes(**sizes: object) -> None:
    """One line for a layer size that is not a whole number of at least 1 (2.0 included: it
    would fail later, deep inside a reshape)."""
    for name, size in sizes.items():
        if not is_integer(size, 1):
            raise ValueError(f"{name} must be a whole number >= 1, got {size!r}")


class SelfAttention(AttentionModule):
    """The single head of the guide: Q = X W_q, K = X W_k, V = X W_v, then attention.

    Linear maps without bias and without activation. The output has the input's size: d_v
    defaults to d_model; if another d_v is asked for, an output map W_o brings it back.
    """

    def __init__(
        self,
        d_model: int,
        d_k: int | None = None,
        d_v: int | None = None,
        bias: bool = False,
        similarity: str = "dot",
    ) -> None:
        super().__init__(similarity)
        d_k = d_model if d_k is None else d_k
        d_v = d_model if d_v is None else d_v
        _check_sizes(d_model=d_model, d_k=d_k, d_v=d_v)
        self.d_model = d_model
        self.W_q = nn.Linear(d_model, d_k, bias=bias)
        self.W_k = nn.Linear(d_model, d_k, bias=bias)
        self.W_v = nn.Linear(d_model, d_v, bias=bias)
        self.W_o = nn.Linear(d_v, d_model, bias=bias) if d_v != d_model else None

    def forward(self, x: Tensor, *, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """x: (..., T, d_model) -> (..., T, d_model); ``mask`` broadcasts to (..., T, T)."""
        _check_input(x, self.W_q.weight, takes="sequences")
        query = self.W_q(x).unsqueeze(-3)  # (..., 1, T, d_k): one head
        key = self.W_k(x).unsqueeze(-3)
        value = self.W_v(x).unsqueeze(-3)
        if isinstance(mask, Tensor) and mask.dim() > 2:
            mask = mask.unsqueeze(-3)  # (..., 1, T, T): the head axis, as for query
        output = self.attend(query, key, value, mask, causal).squeeze(-3)  # (..., T, d_v)
        return output if self.W_o is None else self.W_o(output)


class MultiHeadAttention(AttentionModule):
    """n_heads heads of size d_model / n_heads side by side, then the output map W_o."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        bias: bool = True,
        dropout: float = 0.0,
        similarity: str = "dot",
    ) -> None:
        super().__init__(similarity, dropout)
        _check_sizes(d_model=d_model, n_heads=n_heads)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model = d_model
        self.n_heads = n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=bias)
        self.W_k = nn.Linear(d_model, d_model, bias=bias)
        self.W_v = nn.Linear(d_model, d_model, bias=bias)
        self.W_o = nn.Linear(d_model, d_model, bias=bias)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, {super().extra_repr()}"

    def split_heads(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)  # (B, H, T, hd)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
    ) -> Tensor:
        """x: (B, T, D) queries; keys and values from ``context`` (default x): (B, S, D).

        ``mask`` broadcasts to (B, H, T, S), True = may attend. With a ``cache`` the new keys
        and values are appended to the cached ones and causal alignment is bottom-right.
        """
        _check_input(x, self.W_q.weight, takes="batches")
        _check_cache(cache)
        if context is not None:
            _check_input(context, self.W_k.weight, takes="batches", name="context")
            if context.shape[0] != x.shape[0]:
                raise ValueError(
                    f"context has batch size {context.shape[0]} but x has {x.shape[0]}; "
                    "pass one context sequence per sequence of x"
                )
        context = x if context is None else context
        query = self.split_heads(self.W_q(x))  # (B, H, T, hd)
        key = self.split_heads(self.W_k(context))  # (B, H, S, hd)
        value = self.split_heads(self.W_v(context))  # (B, H, S, hd)
        if cache is not None:
            key, value = cache.extend(key, value, self)
        output = self.attend(query, key, value, mask, causal)  # (B, H, T, hd)
        b, h, t, hd = output.shape
        return self.W_o(output.transpose(1, 2).reshape(b, t, h * hd))  # (B, T, D)

    @classmethod
    def from_torch(cls, source: nn.MultiheadAttention) -> MultiHeadAttention:
        """The same layer with the weights of a ``torch.nn.MultiheadAttention``.

        The copy has the source's device, dtype and train/eval mode. Mind the mask polarity:
        torch's boolean ``attn_mask`` marks what may *not* be attended; ours marks what may.
        Ours takes ``(B, T, D)`` inputs whatever the source's ``batch_first``.
        """
        if not isinstance(source, nn.MultiheadAttention):
            raise TypeError(
                f"from_torch takes a torch.nn.MultiheadAttention, got {type(source).__name__}"
            )
        if not source._qkv_same_embed_dim:
            raise ValueError("from_torch needs kdim == vdim == embed_dim (one packed in_proj)")
        if source.bias_k is not None:
            raise ValueError("from_torch does not support add_bias_kv=True")
        if source.add_zero_attn:
            raise ValueError("from_torch does not support add_zero_attn=True")
        bias = source.in_proj_bias is not None
        layer = cls(source.embed_dim, source.num_heads, bias=bias, dropout=source.dropout)
        layer.to(source.in_proj_weight.device, source.in_proj_weight.dtype)
        d = source.embed_dim
        with torch.no_grad():
            for i, proj in enumerate((layer.W_q, layer.W_k, layer.W_v)):
                proj.weight.copy_(source.in_proj_weight[i * d : (i + 1) * d])
                if bias:
                    proj.bias.copy_(source.in_proj_bias[i * d : (i + 1) * d])
            layer.W_o.weight.copy_(source.out_proj.weight)
            if bias:
                layer.W_o.bias.copy_(source.out_proj.bias)
        return layer.train(source.training)


class GroupedQueryAttention(AttentionModule):
    """The attention of the Llama family: rotary positions, query heads sharing key/value heads.

    ``n_heads`` query heads of size ``head_dim`` (default d_model / n_heads) and ``n_kv_heads``
    key/value heads (default n_heads: plain multi-head attention; 1: multi-query), each shared
    by n_heads / n_kv_heads query heads. ``rotary`` rotates q and k by their positions (after
    Qwen3's per-head RMSNorm, with ``qk_norm_eps``) before the key is cached: a cache holds
    rotated keys, and the next tokens' positions start after them.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        rotary: RotaryPositions | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm_eps: float | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__("dot", dropout)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        _check_sizes(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads)
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
            head_dim = d_model // n_heads
        _check_sizes(head_dim=head_dim)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.W_q = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.W_k = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.W_v = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.W_o = nn.Linear(n_heads * head_dim, d_model, bias=out_bias)
        self.q_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps)
        self.k_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps)
        if rotary is not None and rotary.head_dim != head_dim:
            raise ValueError(
                f"rotary turns heads of {rotary.head_dim} dims but this layer's heads have "
                f"head_dim={head_dim}; pass RotaryPositions({head_dim}) (rotary_dim=... to turn "
                "only part of each head)"
            )
        self.rotary = RotaryPositions(head_dim) if rotary is None else rotary

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
            f"{super().extra_repr()}"
        )

    def angles(
        self,
        length: int,
        offset: int = 0,
        positions: Tensor | None = None,
        device: torch.device | None = None,
    ) -> tuple[Tensor, Tensor]:
        """cos and sin of the rotation of ``length`` tokens at positions offset ..
        offset+T-1, or at ``positions`` (B, T), shaped for (B, H, T, hd) heads: the same for
        every layer that shares this one's ``rotary``."""
        if positions is not None:
            positions = positions.unsqueeze(-2)  # (B, 1, T): the same for every head
        return self.rotary.angles(length, offset, positions, device)

    def split_heads(self, x: Tensor) -> Tensor:
        b, t, width = x.shape  # heads spelled out: view(..., -1, ...) fails on 0 elements
        return x.view(b, t, width // self.head_dim, self.head_dim).transpose(1, 2)  # (B, h, T, hd)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        angles: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x: (B, T, D) -> (B, T, D); its tokens sit at positions len(cache) .. len(cache)+T-1,
        or at ``positions`` (B, T) where given (a left-padded batch's rows start at 0 after
        their padding); ``angles``, what :meth:`angles` gives for them, spares computing them
        again in every layer.

        ``mask`` broadcasts to (B, H, T, S), True = may attend.
        """
        _check_input(x, self.W_q.weight, takes="batches")
        _check_cache(cache)
        query = self.split_heads(self.W_q(x))  # (B, H, T, hd)
        key = self.split_heads(self.W_k(x))  # (B, Hkv, T, hd)
        value = self.split_heads(self.W_v(x))  # (B, Hkv, T, hd)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        if angles is None:
            angles = self.angles(
                x.shape[1], 0 if cache is None else len(cache), positions, x.device
            )
        query, key = self.rotary.turn(query, *angles), self.rotary.turn(key, *angles)
        if cache is not None:
            key, value = cache.extend(key, value, self)  # (B, Hkv, S, hd)
        output = self.attend(query, key, value, mask, causal)  # (B, H, T, hd)
        b, h, t, hd = output.shape
        return self.W_o(output.transpose(1, 2).reshape(b, t, h * hd))  # (B, T, D)


class SinusoidalPositions(nn.Module):
    """The fixed positions of "Attention Is All You Need": sin on even dims, cos on odd dims.

    PE[p, 2i] = sin(p / 10000^(2i/d)),  PE[p, 2i+1] = cos(p / 10000^(2i/d)).
    """

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        _check_sizes(max_len=max_len, d_model=d_model)
        self.max_len = max_len
        position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
        freq = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float64) * -math.log(10000.0) / d_model
        )
        table = torch.zeros(max_len, d_model, dtype=torch.float64)
        table[:, 0::2] = torch.sin(position * freq)
        table[:, 1::2] = torch.cos(position * freq)[:, : d_model // 2]
        self.register_buffer("table", table.float(), persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """x: (..., T, d_model) -> x plus the encodings of positions offset .. offset+T-1."""
        return x + _positions(self.table, x, offset, self.max_len).to(x.dtype)


class LearnedPositions(nn.Module):
    """One trained vector per position (BERT, GPT-2)."""

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        _check_sizes(max_len=max_len, d_model=d_model)
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, d_model)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """``x`` ``(..., length, d_model)`` plus the vectors of positions ``offset``,
        ``offset + 1``, … (``offset``: the tokens before, cached)."""
        return x + _positions(self.embedding.weight, x, offset, self.max_len)


def _positions(table: Tensor, x: Tensor, offset: int, max_len: int) -> Tensor:
    """The rows of ``table`` for x's tokens, after one-line checks of x and ``offset``."""
    width = table.shape[-1]
    if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[-1] != width:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(
            f"x must have shape (..., length, {width}) for these {width}-dim positions, got "
            f"{got}; give the positions the embeddings' width"
        )
    length = x.shape[-2]
    if not is_integer(offset, 0):
        raise ValueError(
            f"offset must be a whole number >= 0 (the position of the first token), got "
            f"{offset!r}; pass the number of tokens that come before x"
        )
    if offset + length > max_len:
        raise ValueError(
            f"sequence of {offset + length} tokens is longer than the model's {max_len} "
            "positions; shorten the text"
        )
    return table[offset : offset + length]


@dataclass(frozen=True)
class RopeScaling:
    """How a RoPE variant slows the rotation for contexts longer than it was trained on.

    ``"linear"`` divides every frequency by ``factor``; ``"llama3"`` (Llama 3.1) divides only
    those whose wavelength exceeds original_max_positions / low_freq_factor, keeps those
    below original_max_positions / high_freq_factor, and blends the ones between.
    """

    KINDS: ClassVar[tuple[str, ...]] = ("linear", "llama3")

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"unknown RoPE scaling {self.kind!r}; choose one of {self.KINDS}")

    def apply(self, frequencies: Tensor) -> Tensor:
        if self.kind == "linear":
            return frequencies / self.factor
        wavelength = 2 * math.pi / frequencies
        low_wavelength = self.original_max_positions / self.low_freq_factor
        high_wavelength = self.original_max_positions / self.high_freq_factor
        slowed = torch.where(wavelength > low_wavelength, frequencies / self.factor, frequencies)
        smooth = (self.original_max_positions / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * slowed / self.factor + smooth * slowed
        between = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
        return torch.where(between, blended, slowed)


class RotaryPositions(nn.Module):
    """Rotary position embeddings (RoPE, Su et al. 2021), in Hugging Face's rotate-half layout.

    Dims i and i + R/2 of a query or key at position p turn together by the angle p * f_i,
    f_i = theta^(-2i/R): a query at p and a key at p' then score by p - p' only. R, the
    ``rotary_dim``, is the head's size unless only a part turns (GPT-NeoX and Pythia turn the
    first quarter, ``rotary_pct``): dims from R on pass through unchanged. The angles are
    computed on the fly in float32, as Llama's reference computes them (no table to allocate
    for long contexts, none to lose precision when the model is cast to float16): by
    :meth:`angles`, once per forward for a network whose layers share this module, then
    applied to each layer's q and k by :meth:`turn`.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        scaling: RopeScaling | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        _check_sizes(head_dim=head_dim, rotary_dim=rotary_dim)
        if rotary_dim > head_dim:
            raise ValueError(f"rotary_dim ({rotary_dim}) cannot exceed head_dim ({head_dim})")
        if rotary_dim % 2:
            name = "head_dim" if rotary_dim == head_dim else "rotary_dim"
            raise ValueError(f"RoPE turns pairs of dims: {name} must be even, got {rotary_dim}")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.theta, self.scaling = theta, scaling

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta}, "
            f"scaling={self.scaling}"
        )

    def frequencies(self, device: torch.device | None = None) -> Tensor:
        """f_i for i < R/2, float32 (R/2,)."""
        exponents = torch.arange(0, self.rotary_dim, 2, device=device).float() / self.rotary_dim
        frequencies = 1.0 / self.theta**exponents
        return frequencies if self.scaling is None else self.scaling.apply(frequencies)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """x (..., T, D) rotated as the tokens at positions offset .. offset+T-1, or at
        ``positions`` (..., T), broadcast against x's leading dims: each row of a left-padded
        batch numbers its own tokens from 0."""
        if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[-1] != self.head_dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"x must have shape (..., length, {self.head_dim}) for these rotary positions "
                f"(head_dim={self.head_dim}), got {got}; rotate one head's queries or keys"
            )
        return self.turn(x, *self.angles(x.shape[-2], offset, positions, x.device))

    def angles(
        self,
        length: int,
        offset: int = 0,
        positions: Tensor | None = None,
        device: torch.device | None = None,
    ) -> tuple[Tensor, Tensor]:
        """cos and sin, float32 (..., T, R), of the angles of ``length`` tokens at positions
        offset .. offset+T-1, or at ``positions`` (..., T): what :meth:`turn` takes. A network
        whose layers share this module computes them once per forward, for every layer's q
        and k."""
        if positions is None:
            positions = torch.arange(offset, offset + length, device=device)
        elif positions.shape[-1] != length:
            raise ValueError(
                f"positions must give each of the {length} tokens its position, (..., {length}), "
                f"got shape {tuple(positions.shape)}"
            )
        frequencies = self.frequencies(positions.device)
        angles = positions.float().unsqueeze(-1) * frequencies  # (..., T, R/2)
        angles = torch.cat([angles, angles], dim=-1)  # (..., T, R): dims i and i + R/2 share one
        return angles.cos(), angles.sin()

    def turn(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (..., T, D) turned by the angles whose ``cos`` and ``sin`` :meth:`angles` gave."""
        turning, passing = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        first, second = turning.chunk(2, dim=-1)
        half_turned = torch.cat([-second, first], dim=-1)  # each pair (a, b) -> (-b, a)
        turned = turning * cos.to(x.dtype) + half_turned * sin.to(x.dtype)
        return turned if passing.shape[-1] == 0 else torch.cat([turned, passing], dim=-1)


ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),  # exact, erf-based (BERT)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's gelu_new
    "relu": F.relu,
    "silu": F.silu,  # the Llama family's gate
}


class FeedForward(nn.Module):
    """Position-wise two-layer network: d_model -> d_ff -> d_model."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown activation {activation!r}; choose one of {list(ACTIVATIONS)}"
            )
        _check_sizes(d_model=d_model, d_ff=d_ff)
        self.activation = activation
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        _check_input(x, self.up.weight, takes="vectors")
        return self.down(ACTIVATIONS[self.activation](self.up(x)))


class GatedFeedForward(FeedForward):
    """SwiGLU (Shazeer 2020): down(activation(gate(x)) * up(x)), d_model -> d_ff -> d_model."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "silu", bias: bool = False):
        super().__init__(d_model, d_ff, activation, bias)
        self.gate = nn.Linear(d_model, d_ff, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """``(..., d_model)`` -> ``(..., d_model)``, each token on its own."""
        _check_input(x, self.up.weight, takes="vectors")
        return self.down(ACTIVATIONS[self.activation](self.gate(x)) * self.up(x))


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * weight: no mean subtracted, no bias (Llama's norm).

    Computed in float32 (float64 stays float64) and cast back before the weight, as Hugging
    Face's Llama does, so half-precision runs round as theirs do. ``unit_offset`` is Gemma's
    form: the weight is stored as its difference from 1 (starting at 0), x̂ * (1 + weight),
    multiplied before the cast back, as Hugging Face's Gemma does.
    """

    def __init__(self, d_model: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        _check_sizes(d_model=d_model)
        if not is_real(eps) or not 0 <= eps < math.inf:
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.empty(d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity scale: weight 1 (0 in the unit-offset form)."""
        nn.init.constant_(self.weight, 0.0 if self.unit_offset else 1.0)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, unit_offset={self.unit_offset}"

    def forward(self, x: Tensor) -> Tensor:
        """``x`` of shape ``(..., d_model)`` normalised over its last dim, in its dtype."""
        width = self.weight.shape[0]
        if not isinstance(x, Tensor):
            raise TypeError(
                f"x must be a torch.Tensor of shape (..., {width}), got {type(x).__name__}; "
                "convert it with torch.as_tensor(x)"
            )
        if x.shape[-1:] != (width,):
            raise ValueError(
                f"RMSNorm({width}) got x of shape {tuple(x.shape)}; it normalises the last dim, "
                f"which must be {width}"
            )
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.to(normed.dtype))).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class TransformerBlock(nn.Module):
    """Attention and feed-forward, each with a residual connection and layer norm.

    ``norm_first=True`` normalises before each sub-layer (GPT-2); False after the residual
    sum (BERT, the original transformer).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        norm_first: bool,
        activation: str = "gelu",
        bias: bool = True,
        dropout: float = 0.0,
        layer_norm_eps: float = 1e-5,
        similarity: str = "dot",
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.attention = MultiHeadAttention(d_model, n_heads, bias, dropout, similarity)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.feed_forward = FeedForward(d_model, d_ff, activation, bias)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
    ) -> Tensor:
        """x: (B, T, d_model) -> (B, T, d_model); ``mask`` broadcasts to (B, H, T, S)."""
        _check_input(x, self.attention.W_q.weight, takes="batches")
        if self.norm_first:
            x = x + self.dropout(
                self.attention(self.norm1(x), mask=mask, causal=causal, cache=cache)
            )
            return x + self.dropout(self.feed_forward(self.norm2(x)))
        x = self.norm1(x + self.dropout(self.attention(x, mask=mask, causal=causal, cache=cache)))
        return self.norm2(x + self.dropout(self.feed_forward(x)))
