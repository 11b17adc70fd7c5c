"""Attention as figures for papers and slides (matplotlib, no display needed).

The Agg backend is selected before pyplot is imported, so figures render on machines without
a display (servers, CI). Rows are queries, columns are keys, and every heatmap says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # after use("Agg"): no display needed
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from selfattn.viz.terminal import CAPTION, ArrayLike, as_numpy

FORMATS = (".png", ".svg")
CMAP = "Blues"
PIN = "#f59e0b"  # the query row's outline, the colour the HTML page pins a query with
MAX_TICK_LABELS = 64  # beyond this, every n-th token is labelled


def heatmap_figure(
    weights: ArrayLike,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str,
    query_row: int | None = None,
) -> Figure:
    """A (T, S) attention map with a colour bar, token tick labels and the axes named.

    Square cells, column labels rotated so that long tokens do not overlap, and the legend
    "rows: queries, columns: keys" under the plot, so the figure reads on its own in a paper.
    ``query_row``, if given, is outlined as the HTML page outlines the chosen query.
    """
    matrix = as_numpy(weights)
    if matrix.shape != (len(row_labels), len(col_labels)):
        raise ValueError(
            f"weights must have shape (rows, columns) = ({len(row_labels)}, {len(col_labels)}), "
            f"got {matrix.shape}"
        )
    rows, cols = matrix.shape
    side = min(max(3.0, 0.32 * max(rows, cols)), 12.0)
    fig, ax = plt.subplots(figsize=(side + 1.8, side + 1.2), layout="constrained")
    image = ax.imshow(matrix, cmap=CMAP, vmin=min(0.0, float(matrix.min())), aspect="equal")
    fig.colorbar(image, ax=ax, shrink=0.8, label="weight")
    _tick_labels(ax.set_xticks, col_labels, rotation=60, ha="right", rotation_mode="anchor")
    _tick_labels(ax.set_yticks, row_labels)
    ax.set_xlabel("keys (columns)")
    ax.set_ylabel("queries (rows)")
    ax.set_title(title)
    if query_row is not None:
        corner = (-0.5, query_row - 0.5)  # cells are centred on whole numbers
        ax.add_patch(Rectangle(corner, cols, 1, fill=False, edgecolor=PIN, lw=2, clip_on=False))
    fig.supxlabel(CAPTION, fontsize="small", style="italic")
    return fig


def weights_figure(tokens: Sequence[str], weights: ArrayLike, title: str) -> Figure:
    """One query's attention row as a bar chart: one bar per key token, weights on the y axis."""
    row = as_numpy(weights)
    if row.shape != (len(tokens),):
        raise ValueError(
            f"weights must have shape ({len(tokens)},) (one per token), got {row.shape}"
        )
    width = min(max(4.0, 0.35 * len(tokens)), 16.0)
    fig, ax = plt.subplots(figsize=(width, 3.2), layout="constrained")
    ax.bar(range(len(tokens)), row, color=plt.get_cmap(CMAP)(0.75))
    _tick_labels(ax.set_xticks, tokens, rotation=60, ha="right", rotation_mode="anchor")
    ax.set_xlabel("keys")
    ax.set_ylabel("weight")
    ax.set_ylim(0, max(1e-9, float(row.max(initial=0.0))) * 1.1)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(title)
    return fig


def _tick_labels(set_ticks, labels: Sequence[str], **text) -> None:
    """Label every token, or every n-th one when there are too many to read."""
    step = max(1, -(-len(labels) // MAX_TICK_LABELS))
    positions = list(range(0, len(labels), step))
    set_ticks(positions, [labels[i] for i in positions], fontsize="small", **text)


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write the figure as PNG (200 dpi) or SVG, chosen by the file's suffix; returns the path."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot save a figure as {path.name!r}: use a .png or .svg file name")
    fig.savefig(path, dpi=200 if suffix == ".png" else None, bbox_inches="tight")
    return path
