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
from selfattn.models.loading import load
from selfattn.models.model import Generation, GenerationStep, Model, Run
from selfattn.recording import Capture, Recording, record

__all__ = [
    "BACKENDS",
    "AttentionTrace",
    "Capture",
    "Generation",
    "GenerationStep",
    "KVCache",
    "LearnedPositions",
    "Model",
    "MultiHeadAttention",
    "Recording",
    "Run",
    "SelfAttention",
    "SinusoidalPositions",
    "TransformerBlock",
    "attention",
    "default_scale",
    "load",
    "record",
]
