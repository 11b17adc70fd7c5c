"""The guide's worked example: attention over "Ciao gioco a giochi" with small fixed vectors."""

from __future__ import annotations

import torch

from selfattn.attention import AttentionTrace, attention

CIAO_TOKENS = ("Ciao", "gioco", "a", "giochi")

# Four-dimensional embeddings chosen by hand: "gioco" (I play) and "giochi" (games) share
# most of their direction, "Ciao" (hi) and "a" (to) point elsewhere.
CIAO_EMBEDDINGS = torch.tensor(
    [
        [1.0, 0.0, 1.0, 0.0],  # Ciao
        [0.0, 2.0, 0.0, 2.0],  # gioco
        [1.0, 1.0, 0.0, 0.0],  # a
        [0.0, 1.0, 0.0, 3.0],  # giochi
    ],
    dtype=torch.float64,
)


def ciao_trace() -> AttentionTrace:
    """Steps 2–5 with Q = K = V = the embeddings (no learned weights yet)."""
    x = CIAO_EMBEDDINGS
    _, trace = attention(x, x, x, backend="explicit", return_trace=True)
    return trace
