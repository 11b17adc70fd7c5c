"""The worked example: its numbers, its six steps and its layout.

Tolerances: the trace against the closed form, 1e-12; printed numbers against numpy, half a
unit in their last printed digit (they are rounded to 3 decimals).
"""

import math

import numpy as np
import pytest
import torch
from rich.cells import cell_len
from typer.testing import CliRunner

from selfattn.cli import app
from selfattn.examples import CIAO_EMBEDDINGS, ciao_trace
from selfattn.viz.terminal import matrix_table

# Ciao (1,0,1,0), gioco (0,2,0,2), a (1,1,0,0), giochi (0,1,0,3), as the guide's example sets them.
HAND_EMBEDDINGS = np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 0, 0], [0, 1, 0, 3]], float)
STEP_HEADINGS = (
    "1. embeddings",
    "2. scores",
    "3. scaled",
    "4. weights",
    "5. output",
    "6. Query, Key, Value",
)


def hand_steps() -> dict[str, np.ndarray]:
    """Steps 2-5 in numpy, independent of the library: Q = K = V = the embeddings."""
    scores = HAND_EMBEDDINGS @ HAND_EMBEDDINGS.T
    scaled = scores / math.sqrt(4)  # d_k = 4
    exp = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    weights = exp / exp.sum(axis=1, keepdims=True)
    return {
        "scores": scores,
        "scaled": scaled,
        "weights": weights,
        "output": weights @ HAND_EMBEDDINGS,
    }


def demo_output() -> str:
    result = CliRunner().invoke(app, ["demo"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def printed_tables(output: str) -> list[np.ndarray]:
    """Every table of the demo as numbers, in print order (rows of the form │ name │ 1.0 │ ...)."""
    tables, rows = [], []
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip("│ ").split("│")]
        if line.startswith("│") and len(cells) > 1:
            rows.append([float(cell) for cell in cells[1:]])
        elif rows:
            tables.append(np.array(rows))
            rows = []
    return tables


def test_ciao_steps_follow_the_formula():
    # Q = K = V = the embeddings. Their dot products, worked out by hand from the four vectors:
    scores = torch.tensor(
        [[2, 0, 1, 0], [0, 8, 2, 8], [1, 2, 2, 1], [0, 8, 1, 10]], dtype=torch.float64
    )
    scaled = scores / math.sqrt(4)  # d_k = 4
    weights = torch.exp(scaled) / torch.exp(scaled).sum(-1, keepdim=True)
    trace = ciao_trace()
    torch.testing.assert_close(trace.scores, scores, atol=1e-12, rtol=0)
    torch.testing.assert_close(trace.weights, weights, atol=1e-12, rtol=0)
    torch.testing.assert_close(trace.output, weights @ CIAO_EMBEDDINGS, atol=1e-12, rtol=0)


def test_demo_prints_the_six_steps_of_the_guide_in_order():
    output = demo_output()
    positions = [output.find(heading) for heading in STEP_HEADINGS]
    assert -1 not in positions, dict(zip(STEP_HEADINGS, positions, strict=True))
    assert positions == sorted(positions)


def test_every_printed_number_matches_a_hand_computation():
    embeddings, scores, scaled, weights, output = printed_tables(demo_output())
    hand = hand_steps()
    np.testing.assert_allclose(embeddings, HAND_EMBEDDINGS, atol=0.05)
    for name, printed in zip(hand, (scores, scaled, weights, output), strict=True):
        np.testing.assert_allclose(printed, hand[name], atol=5e-4, err_msg=name)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=4 * 5e-4)


def test_each_step_says_what_it_means_with_its_numbers():
    text = " ".join(demo_output().split())  # words as read, whatever the line wrapping
    hand = hand_steps()
    giochi = 3
    unscaled = np.exp(hand["scores"][giochi]) / np.exp(hand["scores"][giochi]).sum()
    meanings = [
        "position information",  # step 1: what a real model adds
        'Row "giochi": 10 with "giochi", 8 with "gioco", 1 with "a", 0 with "Ciao"',  # step 2
        "√d_k = √4 = 2",  # step 3: why and by how much
        f"keep {unscaled[giochi]:.2f} of its attention for itself after step 4, "
        f"with it {hand['weights'][giochi, giochi]:.2f}",
        "how much the query (row) takes from the key (column)",  # step 4
        'Row "giochi": 0.72 from "giochi", 0.27 from "gioco", 0.01 from "a", 0.00 from "Ciao"',
        '"giochi" (0, 1, 0, 3) becomes (0.01, 1.26, 0.00, 2.70)',  # step 5
        "Q = X W_q, K = X W_k, V = X W_v",  # step 6
        "Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V",
    ]
    missing = [meaning for meaning in meanings if meaning not in text]
    assert not missing


def test_demo_fits_80_columns_and_has_no_colour_codes_in_a_pipe():
    output = demo_output()
    assert "\x1b[" not in output
    assert "…" not in output  # no cell cut short
    assert max(cell_len(line.rstrip()) for line in output.splitlines()) <= 80
    assert output.count("rows: queries, columns: keys") == 3  # scores, scaled, weights


def test_matrix_table_takes_plain_lists_and_checks_the_shape():
    table = matrix_table([[0.25, 0.75], [1.0, 0.0]], ["a", "b"], ["a", "b"], "weights")
    assert [list(column.cells) for column in table.columns[1:]] == [
        ["0.250", "1.000"],
        ["0.750", "0.000"],
    ]
    with pytest.raises(ValueError, match=r"shape \(rows, columns\) = \(2, 3\)"):
        matrix_table(np.zeros((2, 2)), ["a", "b"], ["a", "b", "c"], "weights")
