"""Attention as figures for papers and slides (matplotlib, no display needed).

The Agg backend is selected before pyplot is imported, so figures render on machines without
a display (servers, CI). Rows are queries, columns are keys, and every heatmap says so.

Tokens in any script: the user's font comes first, then whichever of :data:`FALLBACK_FONTS`
are installed (matplotlib falls back through the list glyph by glyph). A heatmap writes the
characters that none of them has as their code points (🙂 as U+1F642), not as boxes, and says
so in one :class:`MissingGlyphsWarning` naming the package that would draw them. SVG text is
written as outlines (``svg.fonttype`` "path"), so the figure looks the same without those
fonts on the reader's machine; SVG and PNG files are byte-for-byte reproducible (no date,
fixed ids).
"""

from __future__ import annotations

import contextlib
import itertools
import unicodedata
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # after use("Agg"): no display needed
from matplotlib import font_manager
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from selfattn.errors import OutOfRange, is_integer
from selfattn.text import is_mark
from selfattn.viz.terminal import CAPTION, ArrayLike, as_numpy

FORMATS = (".png", ".svg")
CMAP = "Blues"
PIN = "#f59e0b"  # the query row's outline, the colour the HTML page pins a query with
MAX_TICK_LABELS = 64  # beyond this, every n-th token is labelled, with its index
LABEL_CHARS = 16  # a longer token is cut ("…"), so that one long label does not shrink the map

# Tried in this order after the user's font for glyphs it lacks; those not installed are left
# out. Colour emoji fonts (Noto Color Emoji, Apple Color Emoji) are bitmaps matplotlib cannot draw.
FALLBACK_FONTS = (
    "Noto Sans CJK SC", "Noto Sans CJK JP", "WenQuanYi Zen Hei", "Droid Sans Fallback",
    "Noto Sans Devanagari", "Noto Sans Bengali", "Noto Sans Tamil", "Noto Sans Telugu",
    "Noto Sans Thai", "Noto Sans Arabic", "Noto Sans Hebrew", "Noto Sans Georgian",
    "Noto Sans Armenian", "Noto Sans Ethiopic", "Noto Sans Symbols", "Noto Sans Symbols2",
    "Symbola",  # Debian and Ubuntu, above; macOS and Windows, below
    "PingFang SC", "Hiragino Sans", "Apple SD Gothic Neo", "Kohinoor Devanagari",
    "Microsoft YaHei", "Yu Gothic", "Malgun Gothic", "Nirmala UI", "Segoe UI Symbol",
)  # fmt: skip
# Debian packages to suggest for missing glyphs, each with a family it installs.
FONT_PACKAGES = {
    "fonts-noto-cjk": "Noto Sans CJK JP",
    "fonts-noto-core": "Noto Sans Devanagari",
    "fonts-symbola": "Symbola",  # emoji up to Unicode 9, in black and white
}


class MissingGlyphsWarning(UserWarning):
    """A heatmap shows characters as their code points: no installed font has them."""


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
    ``query_row``, if given, is outlined as the HTML page outlines the chosen query. Characters
    no installed font has are written as their code points in the labels and title (U+1F642),
    and named in one :class:`MissingGlyphsWarning`.
    """
    matrix = as_numpy(weights)
    if matrix.shape != (len(row_labels), len(col_labels)):
        raise ValueError(
            f"weights must have shape (rows, columns) = ({len(row_labels)}, {len(col_labels)}), "
            f"got {matrix.shape}"
        )
    if query_row is not None and not (is_integer(query_row) and 0 <= query_row < len(row_labels)):
        raise OutOfRange(
            f"query_row {query_row!r} is out of range: rows 0..{len(row_labels) - 1}, or None"
        )
    missing: set[str] = set()

    def shown(text: str) -> str:  # only the labels drawn: every n-th token of a long text
        missing.update(character for character in text if ord(character) not in drawn)
        return _drawable(text, drawn)

    with plt.rc_context(_style()):
        drawn = _drawn_code_points()
        fig = _heatmap(matrix, row_labels, col_labels, shown(title), query_row, shown)
    if missing:
        warnings.warn(_missing_glyphs_note(missing), MissingGlyphsWarning, stacklevel=2)
    return fig


def _heatmap(
    matrix,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str,
    query_row: int | None,
    shown: Callable[[str], str],
) -> Figure:
    rows, cols = matrix.shape
    side = min(max(3.0, 0.32 * max(rows, cols)), 12.0)
    fig, ax = plt.subplots(figsize=(side + 1.8, side + 1.2), layout="constrained")
    image = ax.imshow(matrix, cmap=CMAP, vmin=min(0.0, float(matrix.min())), aspect="equal")
    fig.colorbar(image, ax=ax, shrink=0.8, label="weight")
    first = query_row or 0  # thinned labels are counted from the query, which keeps its own
    _tick_labels(
        ax.set_xticks, col_labels, first, shown, rotation=60, ha="right", rotation_mode="anchor"
    )
    _tick_labels(ax.set_yticks, row_labels, first, shown)
    ax.set_xlabel("keys (columns)")
    ax.set_ylabel("queries (rows)")
    ax.set_title(title)
    if query_row is not None:
        corner = (-0.5, query_row - 0.5)  # cells are centred on whole numbers
        ax.add_patch(Rectangle(corner, cols, 1, fill=False, edgecolor=PIN, lw=2, clip_on=False))
    fig.supxlabel(CAPTION, fontsize="small", style="italic")
    return fig


def _tick_labels(
    set_ticks, labels: Sequence[str], first: int, shown: Callable[[str], str], **text
) -> None:
    """Label every token, or when there are too many to read every n-th one, counted from
    ``first`` both ways and each with its index ("12 bank"); each label clipped, then as
    ``shown`` writes it."""
    step = max(1, -(-len(labels) // MAX_TICK_LABELS))
    positions = list(range(first % step, len(labels), step))
    texts = [_clipped(labels[i]) for i in positions]
    if step > 1:
        texts = [f"{i} {clipped}" for i, clipped in zip(positions, texts, strict=True)]
    set_ticks(positions, [shown(label) for label in texts], fontsize="small", **text)


def _clipped(label: str) -> str:
    """``label`` cut to ``LABEL_CHARS`` characters, "…" the last, where it is longer; cut before
    a character whose combining marks would be cut from it."""
    if len(label) <= LABEL_CHARS:
        return label
    end = LABEL_CHARS - 1
    while end > 0 and is_mark(label[end]):
        end -= 1
    return label[:end] + "…"


def _style() -> dict:
    """rcParams for every figure: fallback fonts, tokens as plain text, reproducible SVG."""
    installed = _installed_families()
    fallbacks = [family for family in FALLBACK_FONTS if family in installed]
    return {
        "font.family": [*plt.rcParams["font.family"], *fallbacks],
        "text.parse_math": False,  # a token "$x$" is text, and "$$" no mathtext error
        "svg.fonttype": "path",  # outlines: the fallback fonts need not be on the reader's side
        "svg.hashsalt": "selfattn",  # the same ids in every file, not random ones
    }


def _drawn_code_points() -> frozenset[int]:
    """The characters the current ``font.family`` list draws, each family as matplotlib finds
    it (its default font when none is installed), and the line break, which it lays out."""
    paths = []
    for family in plt.rcParams["font.family"]:
        with contextlib.suppress(ValueError):  # not installed: matplotlib skips it too
            paths.append(
                font_manager.findfont(
                    font_manager.FontProperties(family=[family]), fallback_to_default=False
                )
            )
    charmaps = (
        font_manager.get_font(path).get_charmap()
        for path in paths or [font_manager.findfont(font_manager.FontProperties())]
    )
    return frozenset({ord("\n")}.union(*charmaps))


def _drawable(text: str, drawn: frozenset[int]) -> str:
    """``text`` with each character outside ``drawn`` as its code point, a run of them
    space-separated: "a🙂🙂" as "aU+1F642 U+1F642"."""
    return "".join(
        "".join(run) if has else " ".join(f"U+{ord(character):04X}" for character in run)
        for has, run in itertools.groupby(text, lambda character: ord(character) in drawn)
    )


def _installed_families() -> set[str]:
    return {font.name for font in font_manager.fontManager.ttflist}


def save_figure(fig: Figure, path: str | Path, *, close: bool = False) -> Path:
    """Write the figure as PNG (200 dpi) or SVG, chosen by the file's suffix; returns the path.

    ``close`` frees the figure once written (pyplot keeps every figure until it is closed).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot save a figure as {path.name!r}: use a .png or .svg file name")
    options = {"dpi": 200} if suffix == ".png" else {"metadata": {"Date": None}}
    try:
        with plt.rc_context(_style()):
            fig.savefig(path, bbox_inches="tight", **options)
    finally:
        if close:
            plt.close(fig)
    return path


def _missing_glyphs_note(missing: set[str]) -> str:
    """One line: the characters shown as code points, and the packages to install, if any
    would draw them."""
    installed = _installed_families()
    packages = {_font_package(character) for character in missing}
    to_install = sorted(package for package in packages if FONT_PACKAGES[package] not in installed)
    named = " ".join(f"{c} (U+{ord(c):04X})" for c in sorted(missing))
    note = f"no installed font has {named}: the figure shows their code points"
    if not to_install:
        return note
    return (
        f"{note}; install fonts that have them (Debian, Ubuntu: apt install {' '.join(to_install)})"
    )


def _font_package(character: str) -> str:
    """The Debian package whose fonts draw ``character``."""
    name = unicodedata.name(character, "")
    if any(script in name for script in ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "IDEOGRAPH")):
        return "fonts-noto-cjk"
    return "fonts-symbola" if unicodedata.category(character) == "So" else "fonts-noto-core"
