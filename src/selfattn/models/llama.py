"""The rotary decoders (Llama, Mistral, Qwen2, Qwen3, GPT-NeoX/Pythia, Phi-3, Gemma) on one network.

Token embedding without positions; pre-norm blocks of :class:`~selfattn.layers.RMSNorm`,
:class:`~selfattn.layers.GroupedQueryAttention` (rotary positions on q and k, query heads
sharing key/value heads) and :class:`~selfattn.layers.GatedFeedForward` (SwiGLU); a final
RMSNorm and an output head, tied to the embedding or not. Mistral's (and Qwen's, where
enabled) sliding window is a mask: a query sees itself and the ``sliding_window - 1`` tokens
before it. Generation is :class:`~selfattn.models.gpt.Decoder`'s, shared with GPT. The same
network trains from scratch (``selfattn train --arch llama``), with GPT's dropout placement
(``dropout`` 0, as every loaded checkpoint has it, changes nothing).

The other families are switches of :class:`LlamaConfig`: GPT-NeoX (Pythia) has LayerNorms
with biases, an ungated MLP, a partial rotation (``rotary_dim``) and, unless its config says
otherwise, a parallel residual (x + attention(norm1(x)) + mlp(norm2(x))); Gemma's norms scale
by 1 + weight and its embeddings are multiplied by sqrt(d_model). Phi-3 differs only in its
checkpoint's fused tensors, which loading splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfattn.errors import SelfAttnError, is_integer
from selfattn.layers import (
    ACTIVATIONS,
    FeedForward,
    GatedFeedForward,
    GroupedQueryAttention,
    KVCache,
    RMSNorm,
    RopeScaling,
    RotaryPositions,
)
from selfattn.models.fields import check_fields, check_positive
from selfattn.models.gpt import Decoder, DecoderOutput, check_position_ids


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes and options of a Llama-family decoder; validated on creation."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_positions: int
    norm_eps: float = 1e-6
    norm: str = "rms"  # "rms"; "rms_unit_offset": Gemma's 1 + weight; "layer": NeoX's LayerNorm
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rotary_dim: int | None = None  # dims of each head that turn (NeoX: a quarter); None: all
    activation: str = "silu"
    qkv_bias: bool = False  # Qwen2: True
    out_bias: bool = False
    mlp_bias: bool = False
    gated: bool = True  # False: NeoX's up, activation, down
    parallel_residual: bool = False  # NeoX: attention and MLP both read the block's input
    qk_norm: bool = False  # Qwen3: RMSNorm of each query and key head
    embedding_scale: float | None = None  # Gemma: sqrt(d_model), in the model's dtype
    tie_word_embeddings: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer (None: full), () for none at all
    dropout: float = 0.0  # training only (0 in every loaded checkpoint): nanoGPT's placement

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        check_positive(self, "norm_eps", "rope_theta")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; one of {list(ACTIVATIONS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.norm not in NORMS:
            raise ValueError(f"unknown norm {self.norm!r}; one of {list(NORMS)}")
        if self.sliding_windows and len(self.sliding_windows) != self.n_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries, one per layer of "
                f"{self.n_layers}"
            )
        for window in self.sliding_windows:
            if window is not None and not (is_integer(window) and window >= 1):
                raise ValueError(
                    f"LlamaConfig.sliding_windows must hold null or integers of at least 1 "
                    f"(a query sees itself and window - 1 tokens before it), got {window!r}"
                )


NORMS = {
    "rms": lambda size, eps: RMSNorm(size, eps),
    "rms_unit_offset": lambda size, eps: RMSNorm(size, eps, unit_offset=True),  # Gemma
    "layer": lambda size, eps: nn.LayerNorm(size, eps),  # GPT-NeoX: mean removed, a bias
}


def llama_hidden_size(d_model: int, multiple_of: int = 32) -> int:
    """The SwiGLU hidden size by Llama's rule: 2/3 of 4·d_model (the three matrices then hold
    as many weights as a 4·d_model MLP's two), rounded up to a multiple of ``multiple_of``
    (Llama's is 256, for its far wider models; 128 wide gives 352, 384 wide 1024)."""
    return -(-int(8 * d_model / 3) // multiple_of) * multiple_of


class LlamaBlock(nn.Module):
    """x + attention(norm1(x)), then + feed_forward(norm2(x)); no biases unless configured.

    With ``parallel_residual`` (GPT-NeoX) both read the block's input:
    x + attention(norm1(x)) + feed_forward(norm2(x)). ``dropout`` (training only) acts on the
    attention weights and on what each branch adds to the residual stream, as in GPT.
    """

    def __init__(self, config: LlamaConfig, rotary: RotaryPositions) -> None:
        super().__init__()
        self.parallel_residual = config.parallel_residual
        self.norm1 = NORMS[config.norm](config.d_model, config.norm_eps)
        self.attention = GroupedQueryAttention(
            config.d_model,
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
            rotary=rotary,
            qkv_bias=config.qkv_bias,
            out_bias=config.out_bias,
            qk_norm_eps=config.norm_eps if config.qk_norm else None,
            dropout=config.dropout,
        )
        self.norm2 = NORMS[config.norm](config.d_model, config.norm_eps)
        mlp = GatedFeedForward if config.gated else FeedForward
        self.feed_forward = mlp(config.d_model, config.d_ff, config.activation, config.mlp_bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None,
        cache: KVCache | None,
        angles: tuple[Tensor, Tensor],
    ) -> Tensor:
        """x: (B, T, D) -> (B, T, D), causal; ``mask`` broadcasts to (B, H, T, S); ``angles``
        turn the tokens' q and k (see :meth:`GroupedQueryAttention.angles`)."""
        attended = self.attention(self.norm1(x), mask=mask, causal=True, cache=cache, angles=angles)
        attended = self.dropout(attended)
        if self.parallel_residual:
            return x + attended + self.dropout(self.feed_forward(self.norm2(x)))
        x = x + attended
        return x + self.dropout(self.feed_forward(self.norm2(x)))


class Llama(Decoder):
    """Decoder of the Llama family; ``forward(input_ids, targets)`` gives logits and loss.

    Construction leaves torch's default initialisation: loading builds the network empty on
    the meta device and fills every parameter from the checkpoint. A network to train from
    scratch is given GPT-2's initialisation by :meth:`reset_parameters` (as ``selfattn train
    --arch llama`` does); :class:`~selfattn.models.gpt.GPT` calls it on construction.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        rotary = RotaryPositions(
            config.head_dim, config.rope_theta, config.rope_scaling, config.rotary_dim
        )
        self.blocks = nn.ModuleList(LlamaBlock(config, rotary) for _ in range(config.n_layers))
        self.final_norm = NORMS[config.norm](config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    @property
    def max_positions(self) -> int:
        return self.config.max_positions

    def forward(
        self,
        input_ids: Tensor,
        targets: Tensor | None = None,
        *,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        caches: list[KVCache] | None = None,
        logits_to_keep: int = 0,
    ) -> DecoderOutput:
        """input_ids (B, T); attention_mask (B, S) with 1 for real tokens; position_ids (B, T),
        by default those after the cached tokens (Hugging Face's); caches per block; the
        logits of the last ``logits_to_keep`` tokens only (0: all), as generation needs."""
        offset = len(caches[0]) if caches else 0
        length = offset + input_ids.shape[1]
        if length > self.max_positions:
            raise SelfAttnError(
                f"sequence of {length} tokens is longer than the model's {self.max_positions} "
                "positions (max_position_embeddings); shorten the text"
            )
        x = self.token_embedding(input_ids)  # (B, T, D)
        if self.config.embedding_scale is not None:  # rounded to the dtype first, as Gemma's
            x = x * torch.tensor(self.config.embedding_scale).to(x.dtype)
        x = self.dropout(x)
        padding = None
        if attention_mask is not None:
            padding = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, S): keys that exist
        windows = self.config.sliding_windows or (None,) * len(self.blocks)
        masks = {
            window: _combined(padding, window_mask(window, input_ids.shape[1], length, x.device))
            for window in set(windows)
        }
        block_masks = [masks[window] for window in windows]
        if position_ids is not None:  # rotary: any whole number is a position
            check_position_ids(position_ids, input_ids, None)
        # Every block shares one RotaryPositions: its angles are computed once, for all.
        angles = self.blocks[0].attention.angles(input_ids.shape[1], offset, position_ids, x.device)
        return self.decode(x, block_masks, caches, targets, logits_to_keep, angles=angles)


def window_mask(
    window: int | None, t: int, s: int, device: torch.device | str | None = None
) -> Tensor | None:
    """(T, S) True where key j lies within ``window`` of query i (j > i - window, queries
    aligned bottom-right, as causal masking aligns them); None when no key is that far.
    The offline page (:mod:`selfattn.viz.html`) masks its thumbnails with it too."""
    if window is None or s <= window:
        return None
    queries = torch.arange(s - t, s, device=device).unsqueeze(-1)  # (T, 1) positions
    return torch.arange(s, device=device) > queries - window  # (T, S)


def _combined(padding: Tensor | None, window: Tensor | None) -> Tensor | None:
    """Both masks (True = may attend), or the one given."""
    if padding is None or window is None:
        return window if padding is None else padding
    return padding & window  # (B, 1, T, S)
