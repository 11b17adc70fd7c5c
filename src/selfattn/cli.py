"""The ``selfattn`` command line."""

from __future__ import annotations

import typer
from rich.console import Console

from selfattn.examples import CIAO_TOKENS, ciao_trace
from selfattn.viz.terminal import matrix_table

app = typer.Typer(
    help="Self-attention, step by step: explain it on real models, view it, run it, train it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()


@app.callback()
def _root() -> None:
    """Self-attention, step by step: explain it on real models, view it, run it, train it."""


@app.command()
def demo() -> None:
    """The guide's worked example: "Ciao gioco a giochi" with small fixed vectors, step by step."""
    trace = ciao_trace()
    tokens = list(CIAO_TOKENS)
    console.print('[bold]Self-attention on "Ciao gioco a giochi"[/] (Q = K = V = the embeddings)\n')
    console.print(
        matrix_table(
            trace.query, tokens, ["d0", "d1", "d2", "d3"], "1. embeddings", 1, vectors=True
        )
    )
    console.print(matrix_table(trace.scores, tokens, tokens, "2. scores = Q Kᵀ (dot products)"))
    console.print(
        matrix_table(
            trace.scaled, tokens, tokens, f"3. scaled = scores × {trace.scale:.3f} (1/√d_k)"
        )
    )
    console.print(
        matrix_table(trace.weights, tokens, tokens, "4. weights = softmax(scaled), rows sum to 1")
    )
    console.print(
        matrix_table(
            trace.output, tokens, ["d0", "d1", "d2", "d3"], "5. output = weights @ V", vectors=True
        )
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
