"""Our type hints against a user's correct, typed code: mypy must accept it.

selfattn ships py.typed, so a user's type checker reads our hints. Code that runs must not be
flagged: ``attention(q, k, v)`` returns a Tensor (a tuple only with ``return_trace=True``),
``rec[0]`` a Capture, ``generate("a prompt")`` a str, a path may be a str. The script below is
only type-checked (mypy), never run. Errors inside selfattn itself are silenced
(``--follow-imports=silent``): this checks the public surface as a user meets it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

SRC = Path(__file__).resolve().parents[1] / "src"

USER_CODE = """
from pathlib import Path

import torch
from torch import Tensor

import selfattn
from selfattn import SelfAttention, attention, record
from selfattn.explain import compare, compare_texts, explain, explain_query, explain_text
from selfattn.recording import Capture
from selfattn.train import load_model, train_decoder
from selfattn.train.data import TextData

q = k = v = torch.randn(2, 4, 8, 16)
out: Tensor = attention(q, k, v, causal=True)
traced_out, trace = attention(q, k, v, return_trace=True)
weights: Tensor = trace.weights + traced_out.sum()

layer = SelfAttention(16)
with record(layer) as rec:
    layer(torch.randn(2, 8, 16))
first: Capture = rec[0]
some: list[Capture] = rec[0:2]
heads: int = rec[-1].n_heads + len(some) + first.weights().ndim

model = selfattn.load("minilm")
run = model.run("I went to the bank to deposit money")
explained = explain(run, model_name=model.name, query=1)
again, by_word = explain_text(model, "the river bank", word="bank", layer=0)
by_query = explain_query(run, "bank", model_name=model.name, head=0)
compared = compare([model.run("a bank"), model.run("the river bank")], "bank")
compared_texts = compare_texts(model, ["a bank", "the river bank"], "bank")

decoder = selfattn.load("a-gpt2-folder")
text: str = decoder.generate("Hello", 5).upper()
texts: list[str] = decoder.generate(["Hello", "Hi"], 5)
generation = decoder.generate_recorded("Hello", 3)

settings: dict[str, int] = {"max_iters": 10}
train_decoder("input.txt", "runs/tiny", preset="tiny", overrides=settings)
trained = load_model("runs/tiny")
data = TextData.from_file("input.txt", block_size=32)
folder: Path = Path("runs") / "tiny"
"""


def test_a_users_typed_code_passes_mypy(tmp_path):
    """Tolerance: none; mypy's exit status 0 and no error line about the script."""
    script = tmp_path / "user_code.py"
    script.write_text(USER_CODE)
    flags = ["--follow-imports=silent", "--ignore-missing-imports", "--no-error-summary"]
    result = subprocess.run(
        [sys.executable, "-m", "mypy", *flags, "--cache-dir", str(tmp_path / "cache"), str(script)],
        capture_output=True,
        text=True,
        env=os.environ | {"MYPYPATH": str(SRC)},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
