"""Attention kernels beyond the explicit path: each computes what ``attention.py`` defines."""

from selfattn.kernels.chunked import chunked_attention

__all__ = ["chunked_attention"]
