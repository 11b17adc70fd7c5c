"""A BERT-family encoder built from our layers: embeddings, post-norm blocks, optional pooler.

Embeddings are word + learned position + token type, then layer norm (as in BERT). Each block
is :class:`selfattn.layers.TransformerBlock` with ``norm_first=False``: attention, add, norm,
feed-forward, add, norm. The pooler (tanh of a linear map of the first token, trained for
next-sentence prediction) exists only when the checkpoint carries its weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfattn.layers import ACTIVATIONS, LearnedPositions, TransformerBlock


@dataclass(frozen=True)
class BertConfig:
    """Sizes and options of an encoder; per-model constants (layer norm eps) live here."""

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"
    pooler: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"BertConfig.{name} must be positive, got {getattr(self, name)}")
        if self.max_positions < 1 or self.type_vocab_size < 1:
            raise ValueError("BertConfig.max_positions and type_vocab_size must be positive")
        if self.hidden_size % self.n_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; one of {list(ACTIVATIONS)}")


@dataclass
class EncoderOutput:
    last_hidden_state: Tensor  # (B, T, D)
    hidden_states: tuple[Tensor, ...]  # embedding output, then each block's output
    pooler_output: Tensor | None  # (B, D) when the model has a pooler


class BertEmbeddings(nn.Module):
    """Token + position + token-type vectors, summed and layer-normalised."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = LearnedPositions(config.max_positions, config.hidden_size)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """input_ids (B, T) -> (B, T, D); token types default to 0 (one sentence)."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.positions(self.token(input_ids)) + self.token_type(token_type_ids)
        return self.norm(x)


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
        hidden_states = [x]
        for block in self.blocks:
            x = block(x, mask=mask)
            hidden_states.append(x)
        pooled = None if self.pooler is None else torch.tanh(self.pooler(x[:, 0]))
        return EncoderOutput(x, tuple(hidden_states), pooled)
