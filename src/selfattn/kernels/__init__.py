"""Attention kernels beyond the explicit path: each computes what ``attention.py`` defines."""

from selfattn.kernels.chunked import chunked_attention
from selfattn.kernels.ring import ring_attention

__all__ = ["chunked_attention", "ring_attention"]
