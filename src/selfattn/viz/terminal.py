"""Attention in the terminal with rich: matrices as tables, weights as bars, maps as shades.

Every function takes plain data (token strings and a tensor, array or list of numbers) and
returns a rich renderable; print it with ``Console().print(...)``. Rows are queries, columns
are keys, everywhere.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import numpy as np
from rich.cells import cell_len, set_cell_size
from rich.color import Color
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.style import Style
from rich.table import Table
from rich.text import Text
from torch import Tensor

from selfattn.attention import default_scale
from selfattn.text import is_mark

ArrayLike = Tensor | np.ndarray | Sequence[float] | Sequence[Sequence[float]]

# Control characters (an escape sequence in a text could recolour, clear or retitle the
# terminal, or write to its clipboard) and bidi overrides (which reorder what follows them);
# the pages write out the same characters (view.js).
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
CONTROL_SIGNS = {"\n": "↵", "\t": "⇥"}


def printable(text: str, keep: str = "") -> str:
    """``text`` safe to print: each control character and bidi override written out (\\x1b,
    \\u202e), a line break as ↵ and a tab as ⇥, but those in ``keep`` as they are."""

    def sign(match: re.Match[str]) -> str:
        char = match[0]
        if char in keep:
            return char
        code = ord(char)
        return CONTROL_SIGNS.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")

    return CONTROL.sub(sign, text)


CAPTION = "rows: queries, columns: keys"
VECTORS_CAPTION = "rows: tokens, columns: dimensions"
BAR_WIDTH = 24
# Light to dark blue (matplotlib's "Blues" end points): weight 0 is the page, weight max is ink.
LOW_RGB = (247, 251, 255)
HIGH_RGB = (8, 48, 107)


def as_numpy(values: ArrayLike) -> np.ndarray:
    """Float64 numpy copy of a tensor, array or nested list (tensors are detached first)."""
    if isinstance(values, Tensor):
        return values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)


def matrix_table(
    matrix: ArrayLike,
    rows: Sequence[str],
    columns: Sequence[str],
    title: str,
    digits: int = 3,
    vectors: bool = False,
) -> Table:
    """A (rows x columns) matrix as a table: queries x keys, or tokens x dims if ``vectors``."""
    values = as_numpy(matrix)
    if values.shape != (len(rows), len(columns)):
        raise ValueError(
            f"matrix must have shape (rows, columns) = ({len(rows)}, {len(columns)}), "
            f"got {values.shape}"
        )
    table = Table(title=title, caption=VECTORS_CAPTION if vectors else CAPTION)
    table.add_column("token" if vectors else "query \\ key", style="bold")
    for name in columns:
        table.add_column(name, justify="right")
    for name, row in zip(rows, values.tolist(), strict=True):
        table.add_row(Text(name), *(f"{value:.{digits}f}" for value in row))
    return table


def bar(value: float, largest: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar of █ blocks (with ▏..▉ for the last fraction), scaled to ``largest``."""
    if largest <= 0 or value <= 0:
        return ""
    eighths = round(width * 8 * min(value / largest, 1.0))
    full, rest = divmod(eighths, 8)
    return "█" * full + (" ▏▎▍▌▋▊▉"[rest] if rest else "")


def weights_bars(tokens: Sequence[str], weights: ArrayLike, title: str) -> RowTable:
    """One query's attention row: per key token its weight and a bar; the total in the footer.

    The bars are scaled to the largest weight so that small rows stay readable; the footer's
    total (1.000 for an unmasked row) is the check that the softmax did its job.
    """
    row = _one_row(weights, len(tokens), "weights")
    caption = "one query row: how much each key is attended"
    return RowTable(tokens, {"weight": row}, title, caption)


class RowTable:
    """One query row as a table: per key its numbers (the last column: the weights, totalled
    in the footer) and a bar of its weight. The bars take the cells the console leaves,
    ``BAR_WIDTH`` at most, and are left out where fewer than ``MIN_BAR`` are free, so that a
    narrow terminal cuts no number."""

    MIN_BAR = 4

    def __init__(
        self, keys: Sequence[str], columns: dict[str, np.ndarray], title: str, caption: str
    ) -> None:
        self.keys, self.columns, self.title, self.caption = list(keys), columns, title, caption
        self.weights = list(columns.values())[-1]

    def table(self, bar_width: int) -> Table:
        """The table with bars ``bar_width`` cells long at most (0: no bar column)."""
        table = Table(title=self.title, caption=self.caption, show_footer=True)
        table.add_column("key", style="bold", footer="total")
        for name, values in self.columns.items():
            total = f"{values.sum():.3f}" if values is self.weights else ""
            table.add_column(name, justify="right", no_wrap=True, footer=total)
        if bar_width:
            table.add_column("", style="blue", no_wrap=True)
        largest = float(self.weights.max(initial=0.0))
        for i, key in enumerate(self.keys):
            numbers = [f"{values[i]:.3f}" for values in self.columns.values()]
            bars = [bar(self.weights[i], largest, bar_width)] if bar_width else []
            table.add_row(Text(key), *numbers, *bars)
        return table

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.table(BAR_WIDTH))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        unbounded = options.update_width(10_000)
        numbers_only = Measurement.get(console, unbounded, self.table(0)).maximum
        free = options.max_width - numbers_only - 3  # a column costs a border and padding
        yield self.table(min(BAR_WIDTH, free) if free >= self.MIN_BAR else 0)


def scale_formula(scale: float, similarity: str, key_width: int) -> str | None:
    """Where the scale comes from when it is the default for the similarity: "1/√d_k = 1/√32"
    for dot products, "√d_k = √32" for cosine; None for any other scale."""
    if not math.isclose(scale, default_scale(similarity, key_width), rel_tol=1e-9):
        return None
    if similarity == "cosine":
        return f"√d_k = √{key_width}"
    return f"1/√d_k = 1/√{key_width}"


def written_scale(scale: float, similarity: str, key_width: int) -> str:
    """The scale with where it comes from: "1/√d_k = 1/√32 = 0.17678", or the number alone
    (five digits: the shown scores times it give the shown scaled scores)."""
    formula = scale_formula(scale, similarity, key_width)
    return f"{formula} = {scale:.5g}" if formula else f"{scale:.5g}"


def step_table(
    tokens: Sequence[str],
    scores: ArrayLike,
    scaled: ArrayLike,
    weights: ArrayLike,
    scale: str,
) -> RowTable:
    """The steps of one query row, per key: raw score, scaled score, weight and a bar.

    Reading across a row is the guide's recipe for one key: similarity, times the scale
    (as :func:`written_scale` writes it), then the softmax over the whole row.
    """
    n = len(tokens)
    columns = {
        "score": _one_row(scores, n, "scores"),
        "scaled": _one_row(scaled, n, "scaled"),
        "weight": _one_row(weights, n, "weights"),
    }
    caption = (
        f"scaled = score × scale, scale = {scale}\nweight = softmax(scaled) over the row\n"
        "(the total adds the weights before rounding)"
    )
    return RowTable(tokens, columns, "score → scaled → weight", caption)


def _one_row(values: ArrayLike, length: int, name: str) -> np.ndarray:
    row = as_numpy(values)
    if row.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},) (one per token), got {row.shape}")
    return row


def shade(fraction: float) -> Color:
    """The truecolor shade of a value in [0, 1] on the light-to-dark blue ramp."""
    fraction = min(max(fraction, 0.0), 1.0)
    rgb = (round(lo + (hi - lo) * fraction) for lo, hi in zip(LOW_RGB, HIGH_RGB, strict=True))
    return Color.from_rgb(*rgb)


class Heatmap:
    """A (T, S) matrix as background-coloured cells with row and column labels.

    Cell width adapts to the console: two characters or more while they fit, one beyond
    (64 keys fit a 120-column terminal). Up to ``VERTICAL_LABELS`` columns the key tokens are
    written vertically above their cells; beyond that the columns carry their index and a
    legend below maps indices to tokens. Where even one character per key does not fit, the
    map shows the keys that do, around column ``focus`` (the query's, if given), and says
    which; ``more`` says where to see them all. A line wider than the console would wrap
    into a second one and scramble every row after it.
    """

    VERTICAL_LABELS = 40
    LABEL_CHARS = 10  # longest row label / vertical column label before truncation
    BLOCKS = " ░▒▓█"  # the same ramp where there is no colour (a pipe, a log, NO_COLOR)

    def __init__(
        self,
        rows: Sequence[str],
        columns: Sequence[str],
        matrix: ArrayLike,
        title: str,
        focus: int | None = None,
        more: str = "a wider terminal shows them all",
    ) -> None:
        self.matrix = as_numpy(matrix)
        if self.matrix.shape != (len(rows), len(columns)):
            raise ValueError(
                f"matrix must have shape (rows, columns) = ({len(rows)}, {len(columns)}), "
                f"got {self.matrix.shape}"
            )
        self.rows = [_clip(token, self.LABEL_CHARS) for token in rows]
        self.columns = list(columns)
        self.same_tokens = list(rows) == self.columns
        self.title = title
        self.focus, self.more = focus, more
        self.low = min(0.0, float(self.matrix.min(initial=0.0)))
        self.high = float(self.matrix.max(initial=0.0))

    def _label_width(self) -> int:
        index_width = len(str(len(self.rows) - 1))
        return index_width + 1 + max((cell_len(label) for label in self.rows), default=0)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        minimum = self._label_width() + 1 + min(1, len(self.columns))
        return Measurement(minimum, max(minimum, self._label_width() + 1 + 3 * len(self.columns)))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        label_width = self._label_width()
        free = options.max_width - label_width - 1
        keys = self._keys_shown(max(free, 1))
        cell = max(1, min(3, free // max(len(keys), 1)))
        grid_width = label_width + 1 + cell * len(keys)
        yield _centred(self.title, grid_width, "bold")
        yield from self._column_header(label_width, cell, keys)
        index_width = len(str(len(self.rows) - 1))
        coloured = console.color_system is not None and not console.no_color  # NO_COLOR
        for i, (label, values) in enumerate(zip(self.rows, self.matrix, strict=True)):
            line = Text(f"{i:>{index_width}} {set_cell_size(label, label_width - index_width)}")
            for value in values[keys.start : keys.stop]:
                line.append(*self._cell(value, cell, coloured))
            yield line
        yield from self._legend(label_width, grid_width, coloured, keys)

    def _keys_shown(self, fit: int) -> range:
        """Every key where ``fit`` cells hold them, else the ``fit`` keys around ``focus``."""
        n = len(self.columns)
        if n <= fit:
            return range(n)
        centre = 0 if self.focus is None else min(max(self.focus, 0), n - 1)
        start = min(max(centre - fit // 2, 0), n - fit)
        return range(start, start + fit)

    def _fraction(self, value: float) -> float:
        span = self.high - self.low
        return (value - self.low) / span if span > 0 else 0.0

    def _cell(self, value: float, width: int, coloured: bool) -> tuple[str, Style | None]:
        """A cell as a shaded background, or as a block character where colour is off."""
        fraction = self._fraction(value)
        if coloured:
            return " " * width, Style(bgcolor=shade(fraction))
        block = self.BLOCKS[round(min(max(fraction, 0.0), 1.0) * (len(self.BLOCKS) - 1))]
        return block * width, None

    def _column_header(self, label_width: int, cell: int, keys: range) -> Iterable[Text]:
        """Key labels written downwards (few keys) or key indices written downwards (many), a
        character and its combining marks on one line."""
        if len(self.columns) <= self.VERTICAL_LABELS:
            clipped = [_clip(self.columns[j], self.LABEL_CHARS) for j in keys]
        else:
            clipped = [str(j) for j in keys]
        labels = [_clusters(label) for label in clipped]
        height = max((len(label) for label in labels), default=0)
        for depth in range(height):
            line = Text(" " * (label_width + 1))
            for label in labels:
                char = label[depth] if depth < len(label) else " "
                line.append(_fit(char, cell), style="bold")
            yield line

    def _legend(
        self, label_width: int, grid_width: int, coloured: bool, keys: range
    ) -> Iterable[Text]:
        ramp = Text(" " * (label_width + 1))
        ramp.append(f"{self.low:.3g} ")
        for step in range(16):
            value = self.low + (self.high - self.low) * step / 15
            ramp.append(*self._cell(value, 1, coloured))
        ramp.append(f" {self.high:.3g}")
        yield ramp
        yield _centred(CAPTION, grid_width, "italic")
        if len(keys) < len(self.columns):
            around = "" if self.focus is None else f", around key {self.focus}"
            yield Text(
                f"keys {keys.start}..{keys.stop - 1} of {len(self.columns)} shown, as many as "
                f"the terminal's width holds{around}; {self.more}",
                style="bold",
            )
        if len(self.columns) > self.VERTICAL_LABELS and self.same_tokens:
            yield Text("columns: key j is the token of row j", style="dim")
        elif len(self.columns) > self.VERTICAL_LABELS:
            listed = ", ".join(f"{j} {_clip(self.columns[j], 12)}" for j in keys)
            yield Text(f"keys: {listed}", style="dim")


def heatmap(
    tokens_rows: Sequence[str],
    tokens_cols: Sequence[str],
    matrix: ArrayLike,
    title: str,
    focus: int | None = None,
    more: str = "a wider terminal shows them all",
) -> Heatmap:
    """A (T, S) attention map as a terminal heatmap: darker is more weight.

    Shades run from the smaller of 0 and the matrix minimum (light) to the maximum (dark), so
    weights and raw scores both read right. Needs a truecolor terminal for the shades; labels,
    caption and legend print everywhere. Keys that do not fit the terminal's width are left
    out around key ``focus``, and a line says so and, in ``more``, where to see them all.
    """
    return Heatmap(tokens_rows, tokens_cols, matrix, title, focus, more)


def _centred(text: str, width: int, style: str) -> Text:
    """``text`` centred over the first ``width`` cells (the grid, not the whole terminal);
    from the left edge when it is wider."""
    line = Text(" " * max(0, (width - cell_len(text)) // 2))
    line.append(text, style=style)
    return line


def _clip(token: str, width: int) -> str:
    """A token shortened to ``width`` terminal cells (… marks the cut), control characters
    shown; a wide character (CJK) takes two cells."""
    token = token.replace("\n", "⏎").replace("\t", "⇥")
    return token if cell_len(token) <= width else set_cell_size(token, width - 1).rstrip() + "…"


def _clusters(text: str) -> list[str]:
    """The characters of ``text``, each with the combining marks that follow it: "बैंक" is
    ["बैं", "क"], as a terminal draws them."""
    found: list[str] = []
    for char in text:
        if found and is_mark(char):
            found[-1] += char
        else:
            found.append(char)
    return found


def _fit(char: str, cells: int) -> str:
    """One character (with its marks) padded to ``cells`` terminal cells; "·" for a wide one
    that cannot fit."""
    return set_cell_size(char if cell_len(char) <= cells else "·", cells)
