"""explain, compare and view on the real default model (all-MiniLM-L6-v2).

Tolerances: relations between the JSON's numbers (softmax, scaling, weighted sum) 1e-6
relative to float32 rounding (atol 1e-6, 1e-5 for the weighted sum); the recomputed head
against the model's own fast-path output 1e-5.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from selfattn import explain as explaining
from selfattn.attention import choose_backend, make_call
from selfattn.cli import app
from selfattn.models.loading import load

MONEY = "I went to the bank to deposit money."
MONEY_2 = "She asked the bank for a loan to buy a house."
RIVER = "We sat on the bank of the river and watched the water."

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def explain_json(*args: str) -> dict:
    result = invoke("explain", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def model():
    return load("minilm")


@pytest.fixture(scope="module")
def bank_json() -> dict:
    return explain_json(MONEY, "--word", "bank")


def test_json_has_every_step_and_they_agree(bank_json):
    data = bank_json
    for key in ("model", "layer", "head", "tokens", "query", "similarity", "scale", "scores",
                "scaled", "weights", "values", "output", "attention"):  # fmt: skip
        assert key in data
    assert data["query"]["token"] == "bank"
    scores, scaled = torch.tensor(data["scores"]), torch.tensor(data["scaled"])
    weights, values = torch.tensor(data["weights"]), torch.tensor(data["values"])
    torch.testing.assert_close(scaled, scores * data["scale"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(weights, torch.softmax(scaled, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(data["output"]), weights @ values, atol=1e-5, rtol=0)
    attention = torch.tensor(data["attention"])
    torch.testing.assert_close(attention.sum(-1), torch.ones(len(data["tokens"]),
                               dtype=attention.dtype), atol=1e-6, rtol=0)  # fmt: skip
    torch.testing.assert_close(attention[data["query"]["index"]], weights, atol=0, rtol=0)
    assert data["scale"] == pytest.approx(1 / math.sqrt(len(data["values"][0])))


def test_default_head_shows_what_bank_weighs(bank_json):
    weights = bank_json["weights"]
    top = bank_json["tokens"][max(range(len(weights)), key=weights.__getitem__)]
    assert top in {"deposit", "money"}
    assert "chosen" in bank_json["choice"]


def test_recomputed_heads_equal_the_fast_path(model):
    run = model.run(MONEY)
    capture = run.captures.layer(0)[0]
    call = make_call(capture.query, capture.key, capture.value, None, False, "dot", None, 0.0)
    assert choose_backend(call).name != "explicit"  # the model itself ran on a fused path
    for layer in range(run.captures.n_layers):
        capture = run.captures.layer(layer)[0]
        for head in range(capture.n_heads):
            recomputed = capture.trace(head).output
            torch.testing.assert_close(recomputed, capture.output[0, head], atol=1e-5, rtol=0)
    explanation = explaining.explain(run, model_name=model.name, query=5, layer=3, head=7)
    torch.testing.assert_close(
        explanation.steps.output, explanation.recorded_output, atol=1e-5, rtol=0
    )


def test_terminal_report_shows_the_steps():
    result = invoke("explain", MONEY, "--word", "bank", "--layer", "0", "--head", "4")
    assert result.exit_code == 0, result.output
    for text in ("score → scaled → weight", "top attended", "deposit", "output", "norm",
                 "rows: queries, columns: keys", "layer 0, head 4"):  # fmt: skip
        assert text in result.output


def test_heatmap_alone_without_a_word():
    result = invoke("explain", "Ciao gioco a giochi")
    assert result.exit_code == 0, result.output
    assert "rows: queries, columns: keys" in result.output
    assert "score → scaled" not in result.output


def test_words_merge_pieces():
    # "tokenization" splits into pieces; as a key a word's weight is the sum of its pieces.
    data = explain_json("tokenization is fun", "--word", "fun", "--words", "--layer", "2",
                        "--head", "1")  # fmt: skip
    assert "tokenization" in data["words"]
    assert len(data["words"]) < len(data["tokens"])
    word_weights = torch.tensor(data["word_weights"])
    assert word_weights.sum().item() == pytest.approx(1.0, abs=1e-6)
    attention = torch.tensor(data["attention"])
    pieces = [i for i, t in enumerate(data["tokens"]) if t in ("token", "##ization")]
    merged = attention[data["query"]["index"], pieces].sum()
    assert word_weights[data["words"].index("tokenization")].item() == pytest.approx(
        merged.item(), abs=1e-6
    )


def test_merge_rule_by_hand():
    weights = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7], [0.3, 0.3, 0.4]])
    merged = explaining.merge_words(weights, [[0], [1, 2]])
    expected = torch.tensor([[0.5, 0.5], [0.2, 0.8]])  # keys summed, queries averaged
    torch.testing.assert_close(merged, expected, atol=1e-7, rtol=0)


def test_scale_and_similarity_experiments_say_sharper_or_flatter():
    no_scaling = explain_json(MONEY, "--word", "bank", "--layer", "0", "--head", "4",
                              "--scale", "1")  # fmt: skip
    alternative = no_scaling["alternative"]
    assert alternative["scale"] == 1.0
    assert alternative["entropy_bits"] < no_scaling["entropy_bits"]  # no 1/sqrt(d_k): sharper
    torch.testing.assert_close(
        torch.tensor(alternative["scaled"]), torch.tensor(no_scaling["scores"]), atol=1e-6, rtol=0
    )
    cosine = explain_json(MONEY, "--word", "bank", "--similarity", "cosine")["alternative"]
    assert max(abs(s) for s in cosine["scores"]) <= 1 + 1e-6
    assert sum(cosine["weights"]) == pytest.approx(1.0, abs=1e-6)
    result = invoke("explain", MONEY, "--word", "bank", "--scale", "1")
    assert "entropy" in result.output and "sharper" in result.output


def test_head_mean():
    data = explain_json(MONEY, "--word", "bank", "--layer", "5", "--head", "mean")
    assert data["head"] == "mean" and data["scores"] is None
    assert sum(data["weights"]) == pytest.approx(1.0, abs=1e-6)


def test_figures_and_page(tmp_path):
    png, svg, html = tmp_path / "bank.png", tmp_path / "bank.svg", tmp_path / "bank.html"
    result = invoke("explain", MONEY, "--word", "bank", "--png", str(png), "--svg", str(svg),
                    "--html", str(html))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in svg.read_text()
    page = html.read_text()
    assert "selfattn-payload" in page and "http://" not in page and "https://" not in page


def test_view_escapes_user_text(tmp_path):
    out = tmp_path / "page.html"
    xss = "<img src=x onerror=alert(1)> is text"
    result = invoke("view", xss, "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "<img src=x" not in out.read_text()


def test_compare_bank_across_sentences():
    result = invoke("compare", MONEY, MONEY_2, RIVER, "--word", "bank", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert len(data["layers"]) == 7  # embedding output + 6 layers
    last = torch.tensor(data["layers"][-1]["cosine"])
    torch.testing.assert_close(last.diagonal(), torch.ones(3, dtype=last.dtype), atol=1e-6, rtol=0)
    assert last[0, 1] > last[0, 2]  # two money banks are closer than money and river
    attended = [[entry["word"] for entry in row] for row in data["attended"]]
    assert {"deposit", "money"} & set(attended[0])
    text = invoke("compare", MONEY, RIVER, "--word", "bank").output
    assert "S1 vs S2" in text and "attends to" in text


@pytest.mark.parametrize(
    "args,message",
    [
        (["explain", ""], "empty"),
        (["explain", MONEY, "--word", "river"], "the words are: I, went"),
        (["explain", MONEY, "--layer", "9"], "layers 0..5"),
        (["explain", MONEY, "--word", "bank", "--head", "12"], "heads 0..11"),
        (["explain", MONEY, "--head", "first"], "head number or 'mean'"),
        (["explain", MONEY, "--word", "bank", "--index", "2"], "either --word or --index"),
        (["explain", MONEY, "--index", "99"], "tokens 0..10"),
        (["explain", MONEY, "--similarity", "euclid"], "'dot' or 'cosine'"),
        (["explain", MONEY, "--png", "bank.pdf"], "ending in .png"),
        (["explain", MONEY, "--model", "no-such-model"], "no-such-model"),
        (["explain", "word " * 600], "at most 512"),
        (["compare", MONEY, "--word", "bank"], "at least two sentences"),
        (["compare", MONEY, RIVER, "--word", "money"], "money"),
    ],
)
def test_user_errors_are_one_line(args, message):
    result = invoke(*args)
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.output


def test_notebook_view_is_the_same_page_in_a_sandboxed_iframe(model):
    run = model.run("<b>bold</b> bank")
    page = run._repr_html_()
    assert page.startswith("<iframe srcdoc=") and 'sandbox="allow-scripts"' in page
    assert "<b>" not in page and "&lt;script" in page  # the whole page travels escaped
    focused = run.html(word="bank", layer=0, head=4)
    assert "selfattn-payload" in focused


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A tiny character-level GPT trained for a few steps (``selfattn train --preset tiny``)."""
    folder = tmp_path_factory.mktemp("trained")
    data = folder / "data.txt"
    data.write_text("To be, or not to be, that is the question.\n" * 8, encoding="utf-8")
    out = folder / "run"
    result = invoke("train", "--data", str(data), "--out", str(out), "--preset", "tiny",
                    "--max-iters", "10")  # fmt: skip
    assert result.exit_code == 0, result.output
    return str(out)


def test_explain_a_trained_checkpoint(trained):
    # A decoder: bottom-right causal, so a query never weighs later characters (exactly 0).
    data = explain_json("To be or not", "--checkpoint", trained, "--index", "5")
    attention = torch.tensor(data["attention"])
    assert torch.all(attention.triu(diagonal=1) == 0)
    torch.testing.assert_close(attention.sum(-1), torch.ones(12, dtype=attention.dtype),
                               atol=1e-6, rtol=0)  # fmt: skip
    weights, values = torch.tensor(data["weights"]), torch.tensor(data["values"])
    torch.testing.assert_close(torch.tensor(data["output"]), weights @ values, atol=1e-5, rtol=0)
    shown = invoke("explain", "To be", "--checkpoint", trained, "--index", "2").output
    assert "␣" in shown  # whitespace tokens are made visible


def test_checkpoint_errors_are_one_line(trained, tmp_path):
    for args, message in [
        (["explain", "To be Z", "--checkpoint", trained], "'Z'"),
        (["explain", "To be", "--checkpoint", str(tmp_path / "none")], "does not exist"),
    ]:
        result = invoke(*args)
        lines = result.stderr.strip().splitlines()
        assert result.exit_code != 0 and len(lines) == 1 and message in lines[0], result.stderr
