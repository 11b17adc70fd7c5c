"""selfattn: self-attention, from the first dot product to a real transformer."""

from selfattn.attention import BACKENDS, AttentionTrace, attention, default_scale
from selfattn.layers import (
    GatedFeedForward,
    GroupedQueryAttention,
    KVCache,
    LearnedPositions,
    MultiHeadAttention,
    RMSNorm,
    RotaryPositions,
    SelfAttention,
    SinusoidalPositions,
    TransformerBlock,
)
from selfattn.models.loading import load
from selfattn.models.model import Generation, GenerationStep, Model, Run
from selfattn.recording import Capture, Recording, record

__all__ = [
    "BACKENDS",
    "AttentionTrace",
    "Capture",
    "GatedFeedForward",
    "Generation",
    "GenerationStep",
    "GroupedQueryAttention",
    "KVCache",
    "LearnedPositions",
    "Model",
    "MultiHeadAttention",
    "RMSNorm",
    "Recording",
    "RotaryPositions",
    "Run",
    "SelfAttention",
    "SinusoidalPositions",
    "TransformerBlock",
    "attention",
    "default_scale",
    "load",
    "record",
]
