"""Views of attention: terminal (rich), figures (matplotlib), self-contained HTML pages.

Viewers take tensors and token strings, never models.
"""
