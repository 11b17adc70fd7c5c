"""selfattn: self-attention, from the first dot product to a real transformer."""

from selfattn.attention import BACKENDS, AttentionTrace, attention, default_scale
from selfattn.layers import (
    KVCache,
    LearnedPositions,
    MultiHeadAttention,
    SelfAttention,
    SinusoidalPositions,
    TransformerBlock,
)
from selfattn.recording import Capture, Recording, record

__all__ = [
    "BACKENDS",
    "AttentionTrace",
    "Capture",
    "KVCache",
    "LearnedPositions",
    "MultiHeadAttention",
    "Recording",
    "SelfAttention",
    "SinusoidalPositions",
    "TransformerBlock",
    "attention",
    "default_scale",
    "record",
]
