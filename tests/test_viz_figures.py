"""Figures render headless and save as PNG or SVG by suffix."""

import pytest
import torch
from matplotlib.colors import to_rgba
from matplotlib.patches import Rectangle

from selfattn.viz.figures import PIN, heatmap_figure, save_figure, weights_figure

TOKENS = ["Ciao", "gioco", "a", "giochi"]
WEIGHTS = torch.softmax(torch.arange(16.0).reshape(4, 4) / 5, dim=-1)


def figure_texts(fig) -> list[str]:
    return [text.get_text() for text in fig.findobj(lambda artist: hasattr(artist, "get_text"))]


def test_heatmap_figure_names_axes_tokens_and_convention():
    fig = heatmap_figure(WEIGHTS, TOKENS, TOKENS, "layer 1, head 2")
    texts = figure_texts(fig)
    for expected in ("layer 1, head 2", "keys (columns)", "queries (rows)", "giochi", "weight"):
        assert expected in texts
    assert "rows: queries, columns: keys" in texts
    assert len(fig.axes) == 2  # the map and its colour bar


def test_heatmap_figure_outlines_the_query_row_as_the_page_does():
    fig = heatmap_figure(WEIGHTS, TOKENS, TOKENS, "gioco", query_row=1)
    (outline,) = [patch for patch in fig.axes[0].patches if isinstance(patch, Rectangle)]
    assert outline.get_xy() == (-0.5, 0.5)  # around row 1, whose cells span 0.5..1.5
    assert (outline.get_width(), outline.get_height()) == (4, 1)  # every key
    assert not outline.get_fill() and outline.get_edgecolor() == to_rgba(PIN)
    assert not heatmap_figure(WEIGHTS, TOKENS, TOKENS, "no query").axes[0].patches


def test_heatmap_figure_refuses_mismatched_labels():
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        heatmap_figure(WEIGHTS, TOKENS[:3], TOKENS, "x")


def test_save_png_and_svg(tmp_path):
    fig = heatmap_figure(WEIGHTS, TOKENS, TOKENS, "x")
    png = save_figure(fig, tmp_path / "map.png")
    svg = save_figure(fig, tmp_path / "map.SVG")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in svg.read_text()


def test_save_refuses_other_suffixes(tmp_path):
    fig = weights_figure(TOKENS, WEIGHTS[1], "gioco")
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        save_figure(fig, tmp_path / "map.pdf")
    assert not (tmp_path / "map.pdf").exists()


def test_weights_figure_has_one_bar_per_key():
    fig = weights_figure(TOKENS, WEIGHTS[1], "gioco")
    assert len(fig.axes[0].patches) == 4
    assert "gioco" in figure_texts(fig)
