"""The worked example prints its five steps (tolerance: exact closed form, 1e-12)."""

import math

import torch
from typer.testing import CliRunner

from selfattn.cli import app
from selfattn.examples import CIAO_EMBEDDINGS, ciao_trace


def test_ciao_steps_follow_the_formula():
    # Q = K = V = the embeddings. Their dot products, worked out by hand from the four vectors
    # Ciao (1,0,1,0), gioco (0,2,0,2), a (1,1,0,0), giochi (0,1,0,3):
    scores = torch.tensor(
        [[2, 0, 1, 0], [0, 8, 2, 8], [1, 2, 2, 1], [0, 8, 1, 10]], dtype=torch.float64
    )
    scaled = scores / math.sqrt(4)  # d_k = 4
    weights = torch.exp(scaled) / torch.exp(scaled).sum(-1, keepdim=True)
    trace = ciao_trace()
    torch.testing.assert_close(trace.scores, scores, atol=1e-12, rtol=0)
    torch.testing.assert_close(trace.weights, weights, atol=1e-12, rtol=0)
    torch.testing.assert_close(trace.output, weights @ CIAO_EMBEDDINGS, atol=1e-12, rtol=0)


def test_demo_command_prints_every_step():
    result = CliRunner().invoke(app, ["demo"])
    assert result.exit_code == 0, result.output
    for step in ("1. embeddings", "2. scores", "3. scaled", "4. weights", "5. output", "giochi"):
        assert step in result.output
