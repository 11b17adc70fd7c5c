"""selfattn: self-attention, from the first dot product to a real transformer."""

import importlib.metadata

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

try:
    __version__ = importlib.metadata.version("selfattn")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown"

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
    "__version__",
    "attention",
    "default_scale",
    "load",
    "record",
]
