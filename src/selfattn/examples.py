"""The guide's worked example: attention over "Ciao gioco a giochi" with small fixed vectors.

:func:`ciao_steps` gives the six steps of DESIGN.md in order, each with what it means for a
learner and the matrix it produces; ``selfattn demo`` prints them. Every number in the text is
read from the trace, so the words and the tables cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from selfattn.attention import AttentionTrace, attention

CIAO_TOKENS = ("Ciao", "gioco", "a", "giochi")
CIAO_MEANING = "Hi, I play games"

# Four-dimensional embeddings chosen by hand: "gioco" (I play) and "giochi" (games) share
# most of their direction, "Ciao" (hi) and "a" (to) point elsewhere.
CIAO_EMBEDDINGS = torch.tensor(
    [
        [1.0, 0.0, 1.0, 0.0],  # Ciao
        [0.0, 2.0, 0.0, 2.0],  # gioco
        [1.0, 1.0, 0.0, 0.0],  # a
        [0.0, 1.0, 0.0, 3.0],  # giochi
    ],
    dtype=torch.float64,
)
CIAO_DIMS = tuple(f"d{i}" for i in range(CIAO_EMBEDDINGS.shape[-1]))
FOCUS_TOKEN = "giochi"  # the query row the explanations read out


@dataclass(frozen=True)
class DemoStep:
    """One step of the worked example: a heading, what it means, and its matrix (if any).

    ``columns`` names the matrix's columns: key tokens, or embedding dimensions when
    ``vectors`` (rows are then tokens' vectors, not queries against keys).
    """

    heading: str
    meaning: str
    formula: str = ""
    matrix: Tensor | None = None
    columns: tuple[str, ...] = ()
    vectors: bool = False
    digits: int = 3


def ciao_trace() -> AttentionTrace:
    """Steps 2–5 with Q = K = V = the embeddings (no learned weights yet)."""
    x = CIAO_EMBEDDINGS
    _, trace = attention(x, x, x, backend="explicit", return_trace=True)
    return trace


def ciao_steps() -> list[DemoStep]:
    """The six steps of the guide on "Ciao gioco a giochi", in order."""
    trace = ciao_trace()
    focus = CIAO_TOKENS.index(FOCUS_TOKEN)
    return [
        _embedding_step(trace),
        _score_step(trace, focus),
        _scaling_step(trace, focus),
        _weight_step(trace, focus),
        _output_step(trace, focus),
        _query_key_value_step(),
    ]


def _embedding_step(trace: AttentionTrace) -> DemoStep:
    size = trace.query.shape[-1]
    return DemoStep(
        heading="1. embeddings: text becomes tokens, each token a vector",
        meaning=(
            f"Each word is one token, and each token a fixed-size embedding vector of {size} "
            'numbers, picked by hand here: "gioco" (I play) and "giochi" (games) point nearly '
            "the same way. A real model also gives each token position information (BERT and "
            "GPT-2 add a position vector to it, rotary models such as Llama rotate its query and "
            "key); this example leaves it out, so the order of the words changes nothing below."
        ),
        formula="embeddings X",
        matrix=trace.query,
        columns=CIAO_DIMS,
        vectors=True,
        digits=1,
    )


def _score_step(trace: AttentionTrace, focus: int) -> DemoStep:
    row = trace.scores[focus].tolist()
    return DemoStep(
        heading="2. scores: the similarity of every pair of tokens",
        meaning=(
            "The dot product of two token vectors is large when they point the same way, and "
            "grows with their lengths. Row i holds token i (the query, a row of Q) against every "
            "token (the keys, rows of K); here Q = K = X, the embeddings (step 6 makes them "
            f"differ). {_per_key(row, '{:g}', 'with')}. Cosine similarity, which leaves the "
            "lengths out, is an alternative to experiment with (similarity='cosine'; on a real "
            "model, selfattn explain --similarity cosine)."
        ),
        formula="scores = Q Kᵀ",
        matrix=trace.scores,
        columns=CIAO_TOKENS,
    )


def _scaling_step(trace: AttentionTrace, focus: int) -> DemoStep:
    d_k = trace.key.shape[-1]
    divisor = 1 / trace.scale
    unscaled_self = torch.softmax(trace.scores[focus], dim=-1)[focus]
    return DemoStep(
        heading="3. scaled: divide by √d_k",
        meaning=(
            f"The scores are divided by √d_k = √{d_k} = {divisor:g} (d_k: the size of the "
            "query and key vectors), so that one large dot product does not swamp the rest: "
            f'without it "{FOCUS_TOKEN}" would keep {unscaled_self:.2f} of its attention for '
            f"itself after step 4, with it {trace.weights[focus, focus]:.2f}."
        ),
        formula=f"scaled = scores / {divisor:g}",
        matrix=trace.scaled,
        columns=CIAO_TOKENS,
    )


def _weight_step(trace: AttentionTrace, focus: int) -> DemoStep:
    row = trace.weights[focus].tolist()
    return DemoStep(
        heading="4. weights: softmax over each row",
        meaning=(
            "Softmax turns each row into attention weights between 0 and 1 that sum to 1. A "
            "weight says how much the query (row) takes from the key (column). "
            f"{_per_key(row, '{:.2f}', 'from')}."
        ),
        formula="weights = softmax(scaled), each row sums to 1",
        matrix=trace.weights,
        columns=CIAO_TOKENS,
    )


def _output_step(trace: AttentionTrace, focus: int) -> DemoStep:
    before = _vector(trace.value[focus], "{:g}")
    after = _vector(trace.output[focus], "{:.2f}")
    return DemoStep(
        heading="5. output: context injected into each token",
        meaning=(
            "Each output vector is the weight-averaged sum of the value vectors (here the "
            f"embeddings), the same size ({trace.output.shape[-1]}) as the input. A token keeps "
            f'much of its own information: "{FOCUS_TOKEN}" {before} becomes {after}, now '
            f'holding some of "{_strongest_other(trace, focus)}".'
        ),
        formula="output = weights @ V",
        matrix=trace.output,
        columns=CIAO_DIMS,
        vectors=True,
    )


def _query_key_value_step() -> DemoStep:
    return DemoStep(
        heading="6. Query, Key, Value: three roles, made learnable",
        meaning=(
            "Above, the same embeddings X played all three roles: Q = K = V = X. A trained "
            "layer gives each role its own learnable matrix, Q = X W_q, K = X W_k, V = X W_v "
            "(linear layers without activation; many models, MiniLM among them, add a bias), "
            "learned by back-propagation; "
            "selfattn.SelfAttention(d_model) holds them. In one line:\n"
            "    Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V"
        ),
    )


def _per_key(row: list[float], number: str, word: str) -> str:
    """'Row "giochi": 10 with "giochi", 8 with "gioco", ...': the focus row, largest first."""
    pairs = sorted(zip(row, CIAO_TOKENS, strict=True), key=lambda pair: -pair[0])
    parts = [f'{number.format(value)} {word} "{token}"' for value, token in pairs]
    return f'Row "{FOCUS_TOKEN}": ' + ", ".join(parts)


def _vector(values: Tensor, number: str) -> str:
    return "(" + ", ".join(number.format(value) for value in values.tolist()) + ")"


def _strongest_other(trace: AttentionTrace, focus: int) -> str:
    """The key, other than the query itself, that the focus row weighs most."""
    others = trace.weights[focus].clone()
    others[focus] = -1.0
    return CIAO_TOKENS[int(others.argmax())]
