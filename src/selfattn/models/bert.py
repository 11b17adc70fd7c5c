"""A BERT-family encoder built from our layers: embeddings, post-norm blocks, optional pooler.

Embeddings are word + learned position + token type, then layer norm (as in BERT). Each block
is :class:`selfattn.layers.TransformerBlock` with ``norm_first=False``: attention, add, norm,
feed-forward, add, norm. The pooler (tanh of a linear map of the first token, trained for
next-sentence prediction) exists only when the checkpoint carries its weights.

The same network serves BERT's relatives, through two options of :class:`BertConfig`:
``padding_idx`` numbers positions as RoBERTa (and XLM-RoBERTa) do, from ``padding_idx + 1``
over the tokens that are not padding (a padding token gets ``padding_idx``), so the table's
first ``padding_idx + 1`` rows are never a real token's; ``type_vocab_size=0`` drops the
token-type table, which DistilBERT does not have; ``relative_attention_buckets`` adds MPNet's
relative position bias (:class:`RelativePositionBias`): one learned number per head and bucket
of key-minus-query distance, shared by every layer and added to the scaled scores. It reaches
the attention core as a float mask (padded keys at -inf), so ``record`` keeps it with q, k, v
and the weights recomputed from a recording are the ones the model used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfattn.layers import ACTIVATIONS, LearnedPositions, TransformerBlock
from selfattn.models.fields import check_fields, check_positive

RELATIVE_BUCKETS = 32  # MPNet buckets distances into 32, whatever its config's table holds
RELATIVE_MAX_DISTANCE = 128  # distances beyond share the farthest bucket of their direction


@dataclass(frozen=True)
class BertConfig:
    """Sizes and options of an encoder; per-model constants (layer norm eps) live here."""

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    intermediate_size: int
    max_positions: int  # rows of the position table
    type_vocab_size: int = 2  # 0: no token types (DistilBERT)
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"
    pooler: bool = False
    padding_idx: int | None = None  # RoBERTa: positions count from padding_idx + 1
    relative_attention_buckets: int = 0  # MPNet: rows of the position bias table (0: none)

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        check_positive(self, "layer_norm_eps")
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"BertConfig.{name} must be positive, got {getattr(self, name)}")
        if self.max_positions < 1 or self.type_vocab_size < 0:
            raise ValueError(
                "BertConfig.max_positions must be positive and type_vocab_size not negative"
            )
        if self.padding_idx is not None and not 0 <= self.padding_idx < self.max_positions - 1:
            raise ValueError(
                f"BertConfig.padding_idx must lie in 0..{self.max_positions - 2} (the position "
                f"table has {self.max_positions} rows), got {self.padding_idx}"
            )
        if self.hidden_size % self.n_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; one of {list(ACTIVATIONS)}")
        if 0 < self.relative_attention_buckets < RELATIVE_BUCKETS:
            raise ValueError(
                f"BertConfig.relative_attention_buckets must be 0 (no position bias) or at "
                f"least {RELATIVE_BUCKETS}, got {self.relative_attention_buckets}"
            )

    @property
    def usable_positions(self) -> int:
        """The longest input: the table's rows, less the ``padding_idx + 1`` RoBERTa reserves."""
        return self.max_positions - (0 if self.padding_idx is None else self.padding_idx + 1)


@dataclass
class EncoderOutput:
    last_hidden_state: Tensor  # (B, T, D)
    hidden_states: tuple[Tensor, ...]  # embedding output, then each block's output
    pooler_output: Tensor | None  # (B, D) when the model has a pooler


class BertEmbeddings(nn.Module):
    """Token + position (+ token-type) vectors, summed and layer-normalised."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.padding_idx = config.padding_idx
        self.usable_positions = config.usable_positions
        self.token = nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = LearnedPositions(config.max_positions, config.hidden_size)
        self.token_type = (
            nn.Embedding(config.type_vocab_size, config.hidden_size)
            if config.type_vocab_size
            else None
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """input_ids (B, T) -> (B, T, D); token types default to 0 (one sentence)."""
        x = self.token(input_ids)
        if self.padding_idx is None:
            x = self.positions(x)
        else:
            x = x + self.positions.embedding(self.roberta_positions(input_ids))
        if self.token_type is not None:
            x = x + self.token_type(
                torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            )
        elif token_type_ids is not None:
            raise ValueError("this encoder has no token types; call it without token_type_ids")
        return self.norm(x)

    def roberta_positions(self, input_ids: Tensor) -> Tensor:
        """RoBERTa's position ids (B, T): ``padding_idx + 1, + 2, ...`` over the tokens that are
        not ``padding_idx``, ``padding_idx`` for those that are (as transformers numbers them)."""
        if input_ids.shape[1] > self.usable_positions:
            raise ValueError(
                f"sequence of {input_ids.shape[1]} tokens is longer than the model's "
                f"{self.usable_positions} positions; shorten the text"
            )
        real = input_ids.ne(self.padding_idx).long()
        return real.cumsum(dim=1) * real + self.padding_idx


def relative_buckets(length: int, device: torch.device | None = None) -> Tensor:
    """(T, T) long: the bucket of each (query i, key j) pair, as MPNet (after T5) buckets
    their distance: keys before the query in buckets 0..15, after it in 16..31; distances
    below 8 exactly, farther ones logarithmically up to ``RELATIVE_MAX_DISTANCE``."""
    position = torch.arange(length, device=device)
    before = position[:, None] - position[None, :]  # i - j: > 0 where the key comes first
    half = RELATIVE_BUCKETS // 2
    exact = half // 2
    distance = before.abs()
    log_distance = torch.log(distance.clamp(min=exact).float() / exact)  # 0 up to ``exact``
    far = exact + (log_distance / math.log(RELATIVE_MAX_DISTANCE / exact) * (half - exact)).long()
    bucket = torch.where(distance < exact, distance, far.clamp(max=half - 1))
    return bucket + before.lt(0).long() * half


class RelativePositionBias(nn.Module):
    """MPNet's relative position bias: a learned number per bucket (:func:`relative_buckets`)
    and head, added to the scaled scores of every layer."""

    def __init__(self, buckets: int, n_heads: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(buckets, n_heads)

    def forward(self, length: int) -> Tensor:
        """(1, H, T, T): the bias of key j for query i in each head."""
        buckets = relative_buckets(length, self.embedding.weight.device)
        return self.embedding(buckets).permute(2, 0, 1).unsqueeze(0)


class Bert(nn.Module):
    """Encoder: ``forward(input_ids, attention_mask, token_type_ids)`` -> every layer's states."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                config.hidden_size,
                config.n_heads,
                config.intermediate_size,
                norm_first=False,
                activation=config.activation,
                layer_norm_eps=config.layer_norm_eps,
            )
            for _ in range(config.n_layers)
        )
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if config.pooler else None
        self.position_bias = (
            RelativePositionBias(config.relative_attention_buckets, config.n_heads)
            if config.relative_attention_buckets
            else None
        )

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> EncoderOutput:
        """input_ids (B, T); attention_mask (B, T) with 1 for real tokens, 0 for padding."""
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, D)
        mask = None
        if attention_mask is not None:
            mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T): keys that exist
        if self.position_bias is not None:  # one float mask: the bias, -inf on padded keys
            bias = self.position_bias(input_ids.shape[1])  # (1, H, T, T)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        hidden_states = [x]
        for block in self.blocks:
            x = block(x, mask=mask)
            hidden_states.append(x)
        pooled = None if self.pooler is None else torch.tanh(self.pooler(x[:, 0]))
        return EncoderOutput(x, tuple(hidden_states), pooled)
