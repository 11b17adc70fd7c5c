"""The worked example prints its five steps (tolerance: exact closed form, 1e-12)."""

import math

import torch
from typer.testing import CliRunner

from selfattn.cli import app
from selfattn.examples import ciao_trace


def test_ciao_weights_follow_the_formula():
    trace = ciao_trace()
    scaled = trace.scores / math.sqrt(4)
    expected = torch.exp(scaled) / torch.exp(scaled).sum(-1, keepdim=True)
    torch.testing.assert_close(trace.weights, expected, atol=1e-12, rtol=0)


def test_demo_command_prints_every_step():
    result = CliRunner().invoke(app, ["demo"])
    assert result.exit_code == 0, result.output
    for step in ("1. embeddings", "2. scores", "3. scaled", "4. weights", "5. output", "giochi"):
        assert step in result.output
