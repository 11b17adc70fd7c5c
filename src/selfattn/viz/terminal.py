"""Attention in the terminal with rich: matrices as tables, weights as bars."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from torch import Tensor


def matrix_table(
    matrix: Tensor,
    rows: Sequence[str],
    columns: Sequence[str],
    title: str,
    digits: int = 3,
    vectors: bool = False,
) -> Table:
    """A (rows x columns) matrix as a table: queries x keys, or tokens x dims if ``vectors``."""
    caption = None if vectors else "rows: queries, columns: keys"
    table = Table(title=title, caption=caption, show_lines=False)
    table.add_column("token" if vectors else "query \\ key", style="bold")
    for name in columns:
        table.add_column(name, justify="right")
    for name, values in zip(rows, matrix.tolist(), strict=True):
        table.add_row(name, *(f"{value:.{digits}f}" for value in values))
    return table
