"""explain, compare and view on the real default model (all-MiniLM-L6-v2).

Tolerances: relations between the JSON's numbers (softmax, scaling, weighted sum) 1e-6
relative to float32 rounding (atol 1e-6, 1e-5 for the weighted sum); the recomputed head
against the model's own fast-path output 1e-5.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from rich.cells import cell_len
from typer.testing import CliRunner

from conftest import char_gpt
from selfattn import explain as explaining
from selfattn.attention import choose_backend, make_call
from selfattn.cli import app
from selfattn.errors import Message, Options, OutOfRange, SelfAttnError, message_of, worded
from selfattn.models.loading import load
from selfattn.text import is_mark
from selfattn.viz import figures, report
from selfattn.viz.report import page_data

MONEY = "I went to the bank to deposit money."
MONEY_2 = "She asked the bank for a loan to buy a house."
RIVER = "We sat on the bank of the river and watched the water."
TWO_BANKS = "I sat on the bank, then walked to the bank."
TWO_RIVERS = "We sat on the river bank and the river was high."  # river: tokens 5 and 9
UNKNOWN_BANK = "I love 🙂 and the bank"  # MiniLM reads the emoji as [UNK]
HINDI = "मैं बैंक गया"  # "I went to the bank"
LOAN_BANK = (
    "After the long meeting with the loan officer, she walked along the river to the old bank "
    "building where her grandfather had once deposited his first paycheck in nineteen fifty."
)  # layer 0, head 2 puts all of "bank"'s weight on "old", the token before it

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def explain_json(*args: str) -> dict:
    return cli_json("explain", *args)


def cli_json(command: str, *args: str) -> dict:
    result = invoke(command, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def model():
    return load("minilm")


@pytest.fixture(scope="module")
def money_run(model):
    return model.run(MONEY)


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
    shown = " ".join(result.stdout.split())
    assert "pass --word W or --index I to see one word's steps" in shown  # how to get them
    assert "(chosen: the words, on average, put the most weight here" in shown


def test_json_choice_is_the_reason_without_the_terminals_brackets(bank_json):
    assert bank_json["choice"].startswith("chosen: 'bank' puts the most weight here, ")
    assert bank_json["choice"].endswith("; pick another with --layer/--head")
    asked = explain_json(MONEY, "--word", "bank", "--layer", "0", "--head", "4")
    assert asked["choice"] == "as asked"


def test_json_names_each_token_as_the_lists_of_keys_do():
    # names runs parallel to tokens: a token that does not show its text is named by it.
    data = explain_json(UNKNOWN_BANK, "--word", "bank")
    unknown = data["tokens"].index("[UNK]")
    assert data["names"][unknown] == "'🙂' ([UNK])"
    assert data["names"][:unknown] + data["names"][unknown + 1 :] == (
        data["tokens"][:unknown] + data["tokens"][unknown + 1 :]
    )


def test_the_scale_says_where_it_comes_from():
    # The model's scale is the default 1/√d_k (MiniLM: d_k = 32); cosine's default is √d_k;
    # a scale the user gives is only a number.
    args = ("explain", MONEY, "--word", "bank", "--layer", "0", "--head", "4")
    cosine = " ".join(runner.invoke(app, [*args, "--similarity", "cosine"],
                                    env={"COLUMNS": "200"}).stdout.split())  # fmt: skip
    assert "scaled by 0.17678, which is 1/√d_k = 1/√32, softmax to weights" in cosine
    assert "scaled = score × scale, scale = 1/√d_k = 1/√32 = 0.17678" in cosine
    assert "model: dot, scale 1/√d_k = 1/√32 = 0.17678" in cosine
    assert "yours: cosine, scale √d_k = √32 = 5.6569" in cosine
    halved = " ".join(runner.invoke(app, [*args, "--scale", "0.5"],
                                    env={"COLUMNS": "200"}).stdout.split())  # fmt: skip
    assert "yours: dot, scale 0.5 " in halved


def test_the_output_line_shows_no_minus_zero_and_says_whose_output_it_is():
    # In layer 0, head 4, the output of "." (token 9) has -0.00039 in dimension 6, printed
    # "-0.000"; and the line did not say it is one head's part, before the output projection.
    args = ("explain", MONEY, "--index", "9", "--layer", "0", "--head", "4")
    shown = " ".join(runner.invoke(app, args, env={"COLUMNS": "200"}).stdout.split())
    dims = shown.split("dims [")[1].split(", …]")[0].split(", ")
    assert dims[6] == "+0.000" and "-0.000" not in dims
    assert "(this head's part, before the output projection joins the heads)" in shown


def test_the_output_line_says_the_weight_the_query_keeps_on_itself(money_run, hf_minilm):
    """ "it keeps N% of the weight on itself": the query's own key in its row (Hugging Face's
    eager weights, layer 0, head 4: 'bank' keeps 1.3%, its largest weight is 68%), to the
    printed 0.1% (tolerance 0.05% + 1e-5)."""
    args = ("explain", MONEY, "--word", "bank", "--layer", "0", "--head", "4")
    shown = " ".join(runner.invoke(app, args, env={"COLUMNS": "200"}).stdout.split())
    kept = float(re.search(r"it keeps ([\d.]+)% of the weight on itself", shown)[1])
    with torch.no_grad():
        theirs = hf_minilm(torch.tensor([money_run.token_ids]), output_attentions=True)
    bank = money_run.tokens.index("bank")
    own = float(theirs.attentions[0][0, 4, bank, bank])
    assert kept == pytest.approx(100 * own, abs=0.05 + 1e-3)


def test_the_step_table_labels_a_repeated_key_as_top_attended_does():
    # "the" and "bank" stand twice: each row says which one it is, as 10:the in the top list.
    result = runner.invoke(app, ["explain", TWO_BANKS, "--word", "bank"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    rows = [line.split("│") for line in lines if line.count("│") == 6]  # the step table's
    keys = [row[1].strip() for row in rows][:-1]  # the last row is the total
    assert keys == ["[CLS]", "i", "sat", "on", "4:the", "5:bank", ",", "then", "walked", "to",
                    "10:the", "11:bank", ".", "[SEP]"]  # fmt: skip
    top = next(line for line in lines if line.startswith("top attended: "))
    labels = [item.rsplit(" ", 1)[0] for item in top.removeprefix("top attended: ").split(", ")]
    assert set(labels) <= set(keys)


def test_the_word_table_labels_repeated_and_unknown_words_as_the_step_table_does():
    # No word here is split, so the word row (pieces merged) lists the keys of the step
    # table, with the same labels (6:the, '🙂' ([UNK]) by its text) and the same weights as
    # printed (3 decimals, exact).
    text = "I love 🙂 and the 🙂 pizza at the bank"
    args = ["explain", text, "--word", "pizza", "--words", "--layer", "0", "--head", "0"]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    step_rows, word_rows = [], []
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) in (3, 5) and cells[0] != "total":
            (step_rows if len(cells) == 5 else word_rows).append((cells[0], cells[-2]))
    assert [key for key, _ in step_rows][3:7] == [
        "3:'🙂' ([UNK])",
        "and",
        "5:the",
        "6:'🙂' ([UNK])",
    ]
    assert word_rows == step_rows


def test_the_figure_outlines_the_query_row_merged_or_not(model, monkeypatch, tmp_path):
    # "gioco" is token 5 (gi ##oco after gi ##och ##i a) and word 3 when pieces are merged.
    rows = []
    draw = figures.heatmap_figure  # imported by save_heatmap when it draws
    monkeypatch.setattr(figures, "heatmap_figure", lambda *a: rows.append(a[-1]) or draw(*a))
    for words in (False, True):
        _, e = explaining.explain_text(model, "giochi a gioco", word="gioco", words=words)
        report.save_heatmap(e, tmp_path / "map.png")
    assert rows == [5, 3]


@pytest.mark.filterwarnings("ignore::selfattn.viz.figures.MissingGlyphsWarning")  # 🙂: no font
def test_the_figure_names_unknown_keys_by_their_text(model, monkeypatch, tmp_path):
    # The terminal and the JSON name an unknown token by the text it stands for; the PNG/SVG
    # heatmap labelled it "[UNK]", so a text the vocabulary lacks drew a map of [UNK]s.
    labels = []
    draw = figures.heatmap_figure  # imported by save_heatmap when it draws
    monkeypatch.setattr(figures, "heatmap_figure", lambda *a: labels.append(a[1]) or draw(*a))
    for words in (False, True):
        _, e = explaining.explain_text(model, "I like 🙂 a lot", word="like", words=words)
        report.save_heatmap(e, tmp_path / "map.svg")
    assert [row[3] for row in labels] == ["'🙂' ([UNK])"] * 2


def test_the_figure_tells_a_repeated_token_apart_as_the_tables_do(model, monkeypatch, tmp_path):
    # The PNG/SVG labelled both "to"s of MONEY plain "to", where the tables say 3:to and 6:to;
    # merged into words, a word is labelled by its first token's index.
    labels = []
    draw = figures.heatmap_figure  # imported by save_heatmap when it draws
    monkeypatch.setattr(figures, "heatmap_figure", lambda *a: labels.append(a[1]) or draw(*a))
    for words in (False, True):
        _, e = explaining.explain_text(model, MONEY, word="bank", words=words)
        report.save_heatmap(e, tmp_path / "map.png")
    assert labels[0][:7] == ["[CLS]", "i", "went", "3:to", "the", "bank", "6:to"]
    assert labels[1] == labels[0]  # every word is one token here


def test_saved_heatmaps_do_not_pile_up_in_pyplot(model, tmp_path):
    # pyplot keeps every figure until it is closed: 25 saves in one process (a notebook, a
    # script) kept 25 figures and warned "More than 20 figures have been opened".
    import matplotlib.pyplot as plt

    _, e = explaining.explain_text(model, MONEY, word="bank")
    before = len(plt.get_fignums())
    for i in range(25):
        report.save_heatmap(e, tmp_path / f"map{i}.png")
    assert len(plt.get_fignums()) == before


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


@pytest.mark.parametrize("kind", ["random", "one-hot", "uniform"])
def test_entropy_bits_by_hand(kind):
    # -sum(w log2 w) summed here term by term in Python floats; 0 for one key, log2(S) for
    # S equal weights. Tolerance 1e-9 bits.
    s = 7
    if kind == "random":
        logits = torch.randn(s, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
        weights = torch.softmax(logits, -1)
        expected = -sum(w * math.log2(w) for w in weights.tolist())
    elif kind == "one-hot":
        weights, expected = torch.zeros(s, dtype=torch.float64), 0.0
        weights[3] = 1.0
    else:
        weights, expected = torch.full((s,), 1 / s, dtype=torch.float64), math.log2(s)
    assert explaining.entropy_bits(weights) == pytest.approx(expected, abs=1e-9)


def test_entropy_of_one_key_prints_as_zero_not_minus_zero():
    # All weight on one key: -(1 * log2 1) is -0.0, which the report printed as "-0.000".
    one_hot = torch.tensor([0.0, 1.0, 0.0])
    assert f"{explaining.entropy_bits(one_hot):.3f}" == "0.000"


def test_a_word_split_into_pieces_says_which_piece_is_explained():
    # MiniLM reads "unbelievably" as un ##bel ##ie ##va ##bly: the steps are one piece's row.
    result = invoke("explain", "That was unbelievably good.", "--word", "unbelievably",
                    "--layer", "0", "--head", "0")  # fmt: skip
    assert result.exit_code == 0, result.output
    shown = " ".join(result.stdout.split())
    assert "query 3 'un' (piece 1 of 5 of 'unbelievably'; --words merges them)" in shown
    merged = invoke("explain", "That was unbelievably good.", "--index", "5", "--words",
                    "--layer", "0", "--head", "0")  # fmt: skip
    shown = " ".join(merged.stdout.split())
    assert "query 5 '##ie' (piece 3 of 5 of 'unbelievably'; merged by word below)" in shown
    whole = " ".join(invoke("explain", MONEY, "--word", "bank", "--layer", "0", "--head", "4")
                     .stdout.split())  # fmt: skip
    assert "query 5 'bank': similarity" in whole
    data = explain_json("That was unbelievably good.", "--word", "unbelievably",
                        "--layer", "0", "--head", "0")  # fmt: skip
    assert data["query"]["note"] == "piece 1 of 5 of 'unbelievably'"
    assert "note" not in explain_json(MONEY, "--word", "bank", "--layer", "0")["query"]


ONE_TOKEN_SHOWN = "explain shows one query token: --index N shows another"


@pytest.mark.parametrize(
    ("text", "word", "query", "note"),
    [
        (
            "We sat on the river bank.",
            "river bank",
            "5 'river'",
            "first token of 'river bank', 2 words to the model at tokens 5..6",
        ),
        (
            "A well-known fact.",
            "well-known",
            "2 'well'",
            "first token of 'well-known', 3 words to the model at tokens 2..4",
        ),
        # MiniLM has no piece for 银: [UNK], named by its character
        (
            "我去银行存钱。",
            "银行",
            "3 '银' ([UNK])",
            "first token of '银行', 2 words to the model at tokens 3..4",
        ),
        (
            "That was unbelievably good.",
            "Unbelievably  good",
            "3 'un'",
            "first token of 'unbelievably good', 2 words to the model at tokens 3..8",
        ),
    ],
    ids=["phrase", "hyphenated", "two CJK words", "phrase of pieces"],
)
def test_a_word_the_model_reads_as_several_says_only_its_first_token_is_explained(
    text, word, query, note
):
    # --word finds the whole text, but explain shows one query token: the first. It says so
    # in the query line, in the JSON's query note and under the mean of heads' bars.
    args = (text, "--word", word, "--layer", "0")
    result = invoke("explain", *args, "--head", "0")
    assert result.exit_code == 0, result.output
    shown = " ".join(result.stdout.split())
    assert f"query {query} ({note}; {ONE_TOKEN_SHOWN}" in shown
    assert explain_json(*args)["query"]["note"].startswith(f"{note}; {ONE_TOKEN_SHOWN}")
    mean = " ".join(invoke("explain", *args, "--head", "mean").stdout.split())
    assert f"({note}; {ONE_TOKEN_SHOWN}" in mean


def test_top_keys_name_a_repeated_token_by_its_index():
    # "river" and "the" stand twice: their labels carry the token index; the rest stay plain.
    tokens = ["[CLS]", "the", "river", "bank", "the", "river", "[SEP]"]
    weights = torch.tensor([0.05, 0.2, 0.3, 0.05, 0.0, 0.25, 0.15])
    top = explaining.top_keys(tokens, weights, k=4)
    assert [key.label for key in top] == ["2:river", "5:river", "1:the", "[SEP]"]
    assert [key.index for key in top] == [2, 5, 1, 6]
    assert [key.weight for key in top] == pytest.approx([0.3, 0.25, 0.2, 0.15], abs=1e-7)


def test_top_attended_line_tells_repeated_words_apart():
    args = (TWO_RIVERS, "--word", "bank", "--layer", "0", "--head", "0")
    data = explain_json(*args)
    tokens, weights = data["tokens"], torch.tensor(data["weights"])
    assert tokens.count("river") == 2
    order = weights.argsort(descending=True)[:5].tolist()
    assert {5, 9} <= set(order)  # both rivers among the top five: the case to tell apart
    expected = ", ".join(
        f"{i}:{tokens[i]} {weights[i]:.2f}" if tokens.count(tokens[i]) > 1
        else f"{tokens[i]} {weights[i]:.2f}"
        for i in order
    )  # fmt: skip
    result = invoke("explain", *args)
    assert result.exit_code == 0, result.output
    assert f"top attended: {expected}" in " ".join(result.stdout.split())


def other_content_by_hand(run, rows: list[int]) -> torch.Tensor:
    """(L, H): the mean over ``rows`` of each head's weight on content tokens of other words
    (content_tokens gives which tokens carry meaning), from run.attention and run.word_ids."""
    words = {run.word_ids[i] for i in rows}
    keys = [i for i in explaining.content_tokens(run.tokens, run.word_ids)
            if run.word_ids[i] not in words]  # fmt: skip
    maps = torch.stack([run.attention(layer).double() for layer in range(run.n_layers)])
    return maps[:, :, rows][..., keys].sum(-1).mean(-1)  # (L, H)


@pytest.mark.parametrize("query", [["--word", "unbelievably"], ["--index", "5"]], ids=str)
def test_the_head_for_a_word_in_pieces_is_chosen_on_the_word_row(model, query):
    # "unbelievably" is un ##bel ##ie ##va ##bly (tokens 3..7); its row as a query is the mean
    # of its pieces' rows (as --words defines it), whichever piece --index names. The first
    # piece alone would pick another head (layer 2, head 8). Figures compared at 2 decimals.
    text = "That was unbelievably good."
    run = model.run(text)
    by_word = other_content_by_hand(run, [3, 4, 5, 6, 7])
    layer, head = divmod(int(by_word.argmax()), by_word.shape[1])
    by_first_piece = other_content_by_hand(run, [3])
    assert divmod(int(by_first_piece.argmax()), by_first_piece.shape[1]) != (layer, head)
    data = explain_json(text, *query)
    assert (data["layer"], data["head"]) == (layer, head)
    assert data["choice"].startswith(
        f"chosen: 'unbelievably' (the mean of its 5 pieces' rows) puts the most weight "
        f"here, {by_word.max():.2f}, on other content words"
    )


def fake_run(tokens, word_ids, query: int | list[int], rows: dict[tuple[int, int], list], **text):
    """A recorded run whose layer/head weights are given: ``rows[(layer, head)]`` is the row
    of the query token(s) (one row for all, or one per token); every other row is uniform.
    ``text``: the run's ``text`` and ``offsets``; by default the tokens spelled out."""
    n_layers = 1 + max(layer for layer, _ in rows)
    n_heads = 1 + max(head for _, head in rows)
    t = len(tokens)
    layers = []
    for layer in range(n_layers):
        weights = torch.full((n_heads, t, t), 1 / t)
        for head in range(n_heads):
            weights[head, query] = torch.tensor(rows[layer, head])
        layers.append([SimpleNamespace(weights=lambda weights=weights: weights)])
    captures = SimpleNamespace(n_layers=n_layers, layer=lambda index: layers[index])
    text = text or spelled(tokens, word_ids)
    return SimpleNamespace(tokens=tokens, word_ids=word_ids, captures=captures, **text)


def spelled(tokens: list[str], word_ids: list[int | None]) -> dict:
    """A text and offsets that the tokens spell, words apart ("bank ##s" -> "banks");
    special tokens (no word) at (0, 0)."""
    text, offsets = "", []
    for token, word in zip(tokens, word_ids, strict=True):
        piece = token.removeprefix("##")
        if word is not None and text and piece == token:
            text += " "
        offsets.append((0, 0) if word is None else (len(text), len(text) + len(piece)))
        text += "" if word is None else piece
    return {"text": text, "offsets": offsets}


def test_choose_head_counts_only_other_content_words():
    # The query "banks" (tokens 3, 4: "bank" "##s", both with the row given). Each decoy head
    # puts most weight on what the rule leaves out; head (1, 1) puts the most, 0.5, on other
    # content words.
    tokens = ["[CLS]", "the", "river", "bank", "##s", ",", "flood", "[SEP]"]
    word_ids = [None, 0, 1, 2, 2, 3, 4, None]
    run = fake_run(
        tokens,
        word_ids,
        query=[3, 4],
        rows={  #      CLS   the  river bank  ##s   ,   flood  SEP
            (0, 0): [0.0, 0.0, 0.1, 0.3, 0.5, 0.0, 0.1, 0.0],  # itself: 0.2 left
            (0, 1): [0.45, 0.0, 0.05, 0.0, 0.0, 0.0, 0.05, 0.45],  # special tokens: 0.1
            (1, 0): [0.0, 0.45, 0.05, 0.0, 0.0, 0.45, 0.05, 0.0],  # stop word, comma: 0.1
            (1, 1): [0.1, 0.1, 0.25, 0.1, 0.1, 0.1, 0.25, 0.0],  # river + flood: 0.5
        },
    )
    layer, head, choice = explaining.choose_head(run, query=3)
    assert (layer, head) == (1, 1)
    assert "'banks' (the mean of its 2 pieces' rows) puts" in choice and "0.50" in choice
    assert explaining.choose_head(run, query=3, layer=0)[:2] == (0, 0)  # 0.2 beats 0.1


def test_choose_head_does_not_count_an_unknown_token_as_a_content_word():
    # [UNK] stands for text the model has no piece for (here an emoji): it tells the model
    # nothing but "unknown". Head 0 puts 0.8 on it and 0.1 on "rain", head 1 0.3 on "rain".
    tokens = ["[CLS]", "love", "[UNK]", "rain", "[SEP]"]
    run = fake_run(
        tokens,
        [None, 0, 1, 2, None],
        query=1,
        rows={  #     CLS  love  UNK  rain  SEP
            (0, 0): [0.05, 0.0, 0.8, 0.1, 0.05],
            (0, 1): [0.35, 0.0, 0.0, 0.3, 0.35],
        },
        text="love 🙂 rain",
        offsets=[(0, 0), (0, 4), (5, 6), (7, 11), (0, 0)],
    )
    assert explaining.content_tokens(tokens, run.word_ids) == [1, 3]
    layer, head, choice = explaining.choose_head(run, query=1)
    assert (layer, head) == (0, 1) and "0.30" in choice
    # An unknown query is named by the text it stands for.
    assert "chosen: '🙂' ([UNK]) puts the most weight" in explaining.choose_head(run, 2)[2]


def test_a_special_token_typed_in_the_text_is_no_content_word(model):
    """A typed "[SEP]" or "[MASK]" is the model's special token (id 102, 103, as Hugging Face
    reads it), not a word: the head choice counted weight on it as weight on content words
    (0.12 of a chosen head's 0.71 on a typed [SEP]). It can still be explained by its text."""
    run = model.run("I went to the bank [SEP] to deposit money.")
    separator = run.tokens.index("[SEP]")
    assert run.word_ids[separator] is None
    assert separator not in explaining.content_tokens(run.tokens, run.word_ids)
    paris = "Paris is the [MASK] of France."
    masked, explained = explaining.explain_text(model, paris, word="[MASK]")
    assert masked.tokens[explained.query] == "[MASK]"


def test_function_words_are_not_content_words():
    """'because' and 'too' glue a sentence together; a head that weighs them is not one that
    links meanings ("it was too tired because ..." once chose a head for 'because')."""
    tokens = ["[CLS]", "it", "was", "too", "tired", "because", "of", "the", "street", "[SEP]"]
    word_ids = [None, 0, 1, 2, 3, 4, 5, 6, 7, None]
    assert explaining.content_tokens(tokens, word_ids) == [4, 8]


def test_a_capitalised_stop_word_is_no_content_word():
    """A cased model (GPT-2, Llama) reads "The" at the start of a sentence and "It" after a
    full stop as they are written: stop words in any case, so that a head weighing them is
    not chosen as one that links meanings."""
    tokens = ["The", " bank", " Was", " closed", ".", " It", " OPENS", " AT", " Nine"]
    word_ids = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert explaining.content_tokens(tokens, word_ids) == [1, 3, 6, 8]


def test_positional_heads_by_hand():
    """Heads where more than half of the words' tokens put their largest weight on the token
    just before, or more than half just after, counting only those with a word's token on
    that side (2..4 before, 1..3 after, of [CLS] 1 2 3 4 [SEP]). Only which key is largest
    counts, so the flags are exact (no tolerance)."""
    eye = torch.eye(6)
    before = eye.roll(-1, 1)  # row i on key i - 1: an exact previous-token head
    before[0] = eye[0]  # token 0 has none before it: on itself, as a decoder's query 0 is
    after = eye.roll(1, 1)  # row i on key i + 1: an exact next-token head
    mostly_before = 0.4 * before + 0.12 * (1 - before)  # 0.4 just before, 0.12 on the others
    on_one_key = eye[[3] * 6]  # every row on token 3: before query 4, after query 2, no more
    half_before = torch.cat([before[:3], eye[3:]])  # queries 1, 2 just before; 3, 4 on self
    weights = torch.stack([before, after, mostly_before, on_one_key, half_before])
    flags = explaining.positional_heads(weights, [None, 0, 1, 2, 3, None])
    assert flags.tolist() == [True, True, True, False, False]


def test_exactly_half_the_voters_on_the_token_before_is_no_positional_head():
    """Five words' tokens: of the 4 with a token before them, queries 1 and 2 put their
    largest weight on it and 3, 4 on themselves; none on the token after. Half is not more
    than half: no previous-token head (a count of at least half flagged it). Exact."""
    weights = torch.eye(5)
    weights[1], weights[2] = torch.eye(5)[0], torch.eye(5)[1]
    flags = explaining.positional_heads(weights[None], [0, 1, 2, 3, 4])
    assert flags.tolist() == [False]


def test_weight_parked_on_cls_or_sep_is_no_neighbour_habit():
    """In "money." a head where "money" weighs [CLS] most and "." itself is no previous-token
    head: it was counted as one (1 of 1 content words), and "money." passed over 71 of
    MiniLM's 72 heads. One where "." weighs "money" most is, though "money" parks on [CLS]."""
    word_ids = [None, 0, 1, None]  # [CLS] money . [SEP]
    parked = torch.tensor(
        [[1.0, 0, 0, 0], [0.6, 0.2, 0.1, 0.1], [0.1, 0.2, 0.6, 0.1], [0.0, 0, 0, 1]]
    )
    following = parked.clone()
    following[2] = torch.tensor([0.1, 0.6, 0.2, 0.1])
    flags = explaining.positional_heads(torch.stack([parked, following]), word_ids)
    assert flags.tolist() == [False, True]


def test_a_stop_word_is_judged_as_a_whole_word_not_by_its_pieces():
    # "##as" of "amazonas" read as the stop word "as", and "amazonas" lost a piece: its weight
    # was left out of the chosen head's measure (0.83 where 0.86 was right)
    tokens = ["[CLS]", "the", "amazon", "##as", "river", "as", "[SEP]"]
    word_ids = [None, 0, 1, 1, 2, 3, None]
    assert explaining.content_tokens(tokens, word_ids) == [2, 3, 4]


def test_choose_head_passes_over_positional_heads_unless_every_head_is():
    # Head 0 puts each content word's weight on the token just before it: for "bank", 1.0 on
    # "river". Head 1 puts 0.6 of "bank"'s weight on "river" and "flood", 0.4 on [CLS]; its
    # other content rows look at [CLS] (just before "river" only: 1 of 3).
    tokens = ["[CLS]", "river", "bank", "flood", "[SEP]"]
    word_ids = [None, 0, 1, 2, None]
    just_before = [[1.0, 0.0, 0.0, 0.0, 0.0],
                   [0.0, 1.0, 0.0, 0.0, 0.0],
                   [0.0, 0.0, 1.0, 0.0, 0.0]]  # fmt: skip
    on_content = [[1.0, 0.0, 0.0, 0.0, 0.0],
                  [0.4, 0.3, 0.0, 0.3, 0.0],
                  [1.0, 0.0, 0.0, 0.0, 0.0]]  # fmt: skip
    run = fake_run(tokens, word_ids, [1, 2, 3], {(0, 0): just_before, (0, 1): on_content})
    layer, head, choice = explaining.choose_head(run, query=2)
    assert (layer, head) == (0, 1)
    assert choice == (
        "chosen: 'bank' puts the most weight here, 0.60, on other content words, passing over "
        "1 head that mostly looks at the token just before or after (position, not meaning); "
        "pick another with --layer/--head"
    )
    assert explaining.choose_head(run, query=2, head=0)[:2] == (0, 0)  # a head given stays
    alone = fake_run(tokens, word_ids, [1, 2, 3], {(0, 0): just_before})  # all positional
    layer, head, choice = explaining.choose_head(alone, query=2)
    assert (layer, head) == (0, 0) and "1.00" in choice and "passing over" not in choice


def test_a_text_without_other_content_words_shows_the_first_head_as_it_says():
    # One content word: every head puts 0 on other content words, so all tie and the reason
    # says "the first is shown". Head 0 puts "bank"'s largest weight on [CLS], the token just
    # before it (positional), head 1 on itself: passing head 0 over would show head 1 and
    # claim a positional head would have won. Exact: only argmaxes count.
    tokens, word_ids = ["[CLS]", "bank", "[SEP]"], [None, 0, None]
    rows = {(0, 0): [0.6, 0.3, 0.1], (0, 1): [0.2, 0.7, 0.1]}
    layer, head, choice = explaining.choose_head(fake_run(tokens, word_ids, 1, rows), query=1)
    assert (layer, head) == (0, 0) and "passing over" not in choice
    assert "no head puts any weight on other content words" in choice
    data = explain_json("Bank", "--word", "bank")  # the same on MiniLM
    assert (data["layer"], data["head"]) == (0, 0) and "passing over" not in data["choice"]


def nearest_shares_by_hand(run) -> torch.Tensor:
    """(L, H, 2): among the words' tokens with a word's token just before them (0), or just
    after them (1), the share whose largest weight is on it, from run.attention."""
    maps = torch.stack([run.attention(layer) for layer in range(run.n_layers)])
    shares = []
    for step in (-1, 1):
        voters = [
            i
            for i in range(len(run.tokens))
            if 0 <= i + step < len(run.tokens)
            and run.word_ids[i] is not None
            and run.word_ids[i + step] is not None
        ]
        largest = maps[:, :, voters].argmax(-1)  # (L, H, Q): key index of each row's largest
        shares.append((largest == torch.tensor(voters) + step).double().mean(-1))
    return torch.stack(shares, -1)


def test_a_head_that_follows_position_is_passed_over(model):
    """Layer 0, head 2 of MiniLM puts every content word's largest weight (for "bank" here, all
    of it, on "old") on the token just before: it says where a word stands, not what it
    means. The choice passes over such heads and says how many."""
    run = model.run(LOAN_BANK)
    bank = run.token_index("bank")
    shares = nearest_shares_by_hand(run)
    positional = (shares > 0.5).any(-1)  # (L, H)
    on_content = other_content_by_hand(run, [bank])
    assert shares[0, 2, 0] == 1.0 and divmod(int(on_content.argmax()), 12) == (0, 2)
    data = explain_json(LOAN_BANK, "--word", "bank")
    assert not positional[data["layer"], data["head"]]
    not_positional = on_content.masked_fill(positional, -1.0)
    assert (data["layer"], data["head"]) == divmod(int(not_positional.argmax()), 12)
    assert (
        f"here, {not_positional.max():.2f}, on other content words, passing over "
        f"{int(positional.sum())} heads that mostly look at the token just before or after "
        "(position, not meaning); pick another with --layer/--head"
    ) in data["choice"]


def test_an_unknown_token_is_named_by_the_text_it_stands_for():
    # MiniLM reads the emoji as [UNK]; "hello🙂" (no space) is one [UNK] for both words.
    result = invoke("explain", "I love it 🙂 so much", "--word", "🙂")
    assert result.exit_code == 0, result.output
    shown = " ".join(result.stdout.split())
    assert "query 4 '🙂' ([UNK]): similarity" in shown
    assert "(chosen: '🙂' ([UNK]) puts the most weight here" in shown
    assert "4:[UNK]" in shown  # the tokens are still the model's
    both = " ".join(invoke("explain", "hello🙂 there", "--word", "hello🙂").stdout.split())
    assert "query 1 'hello🙂' ([UNK]): similarity" in both
    merged = invoke("explain", "I love it 🙂 so much", "--word", "🙂", "--head", "mean", "--words")
    assert "'🙂' ([UNK]), layer" in merged.stdout  # the titles of the bars too
    assert "'🙂' ([UNK]) by word (pieces merged: keys summed)" in " ".join(merged.stdout.split())
    giochi = invoke("explain", "Ciao gioco a giochi", "--word", "giochi", "--words")
    assert (
        "'giochi' by word (pieces merged: keys summed; its row the mean of its 3 pieces' rows)"
        in (" ".join(giochi.stdout.split()))
    )


def test_the_top_lists_name_an_unknown_key_by_the_text_it_stands_for(model):
    # The emoji is [UNK] (token 3): explain's top line, the page's lists and compare's lines and
    # JSON label name it '🙂' ([UNK]), as the query line names an unknown query. A weight
    # shown with 2 decimals is the JSON's, rounded.
    args = (UNKNOWN_BANK, "--word", "bank", "--layer", "0", "--head", "0")
    data = explain_json(*args)
    assert data["tokens"][3] == "[UNK]" and 3 in torch.tensor(data["weights"]).topk(5).indices
    shown = " ".join(invoke("explain", *args).stdout.split())
    top = re.search(r"top attended: (.*?) output =", shown).group(1)
    assert f"'🙂' ([UNK]) {data['weights'][3]:.2f}" in top and " [UNK]" not in top
    run, explanation = explaining.explain_text(model, UNKNOWN_BANK, word="bank")
    assert page_data(run, explanation)["names"][3] == "'🙂' ([UNK])"
    sentences = (UNKNOWN_BANK, "the 🙂 bank")
    compared = cli_json("compare", *sentences, "--word", "bank")
    unknown = [entry for entry in compared["attended"][0] if entry["index"] == 3]
    assert [entry["label"] for entry in unknown] == ["'🙂' ([UNK])"]
    shown = " ".join(invoke("compare", *sentences, "--word", "bank").stdout.split())
    assert f"'🙂' ([UNK]) {unknown[0]['weight']:.2f}" in shown


def test_a_long_unknown_word_is_named_by_its_first_characters():
    """A word past the vocabulary's 100 characters per word is one [UNK]: the lists named it
    by all 160 characters, widening the steps' key column to ~72 cells."""
    long_word = "supercalifragilistic" * 8
    text = f"the {long_word} bank"
    data = explain_json(text, "--word", "bank", "--layer", "0", "--head", "0")
    assert data["tokens"][2] == "[UNK]"
    shown = invoke("explain", text, "--word", "bank", "--layer", "0", "--head", "0").stdout
    assert f"'{long_word[:23]}…' ([UNK])" in shown and long_word[:30] not in shown
    assert max(map(len, shown.splitlines())) <= 120


def test_a_word_whose_marks_the_tokenizer_drops_is_named_by_its_text():
    # MiniLM drops the vowel sign ै and the nasal sign ं (marks of category Mn) of बैंक and
    # reads ब ##क, "बक" (another word): prose names the word and its pieces by the text, as it
    # names [UNK], and keeps what the model read in parentheses.
    args = ("explain", HINDI, "--word", "बैंक")
    shown = " ".join(invoke(*args, "--layer", "0", "--head", "0").stdout.split())
    assert "query 2 'बैं' (ब) (piece 1 of 2 of 'बैंक' (बक); --words merges them)" in shown
    assert "tokens 0:[CLS] 1:म 2:ब 3:##क" in shown  # the tokens are still the model's
    chosen = " ".join(invoke(*args).stdout.split())
    assert "(chosen: 'बैंक' (बक) (the mean of its 2 pieces' rows) puts" in chosen


def test_the_header_never_cuts_a_combining_mark_from_its_character():
    # 280 characters without a space: the header shows their start, cut before a character
    # and its marks (at the 160th character it would cut ि from क, "क्योंकि" = क ् य ो ं क ि).
    text = "क्योंकि" * 40
    result = runner.invoke(app, ["explain", text, "--layer", "0", "--head", "0"],
                           env={"COLUMNS": "1000"})  # fmt: skip
    assert result.exit_code == 0, result.output
    start = re.search(r"text (\S+) … \(280 characters", result.stdout).group(1)
    assert text.startswith(start) and not is_mark(text[len(start)])


def test_the_notebook_page_says_when_a_word_is_read_as_several(model):
    # run.html(word=...) opens on the word's first token and says so, as the terminal and the
    # JSON's query.note do; a word of one token has no note.
    run = model.run("We sat on the river bank.")
    payload = notebook_payload(run.html(word="river bank", layer=0, head=0))
    note = explain_json(run.text, "--word", "river bank", "--layer", "0")["query"]["note"]
    assert payload["note"] == note and note.startswith("first token of 'river bank'")
    assert payload["selection"]["query"] == 5
    assert notebook_payload(run.html(word="bank"))["note"] is None


def notebook_payload(page: str) -> dict:
    """The payload of the page inside a notebook view's iframe."""
    source = html.unescape(re.search(r'srcdoc="(.*?)"', page, re.S).group(1))
    data = re.search(r'<script type="application/json" id="selfattn-payload">(.*?)</script>',
                     source, re.S).group(1)  # fmt: skip
    return json.loads(data)


@pytest.mark.parametrize("query", [2, 3], ids=["first piece", "second piece"])
def test_choose_head_measures_a_word_in_pieces_on_the_mean_of_its_rows(query):
    # "banks" = "bank" (token 2) + "##s" (token 3). Head 0: 0.9 on river + flood from the
    # first piece, 0.1 from the second, 0.5 for the word; head 1: 0.6 from both pieces. The
    # word's row (the mean, as --words defines it) makes head 1 the choice, from either piece.
    tokens = ["[CLS]", "river", "bank", "##s", "flood", "[SEP]"]
    run = fake_run(
        tokens,
        [None, 0, 1, 1, 2, None],
        query=[2, 3],
        rows={  #       CLS  river bank  ##s  flood  SEP
            (0, 0): [[0.05, 0.45, 0.0, 0.0, 0.45, 0.05],  # first piece: 0.9
                     [0.45, 0.05, 0.0, 0.0, 0.05, 0.45]],  # second piece: 0.1
            (0, 1): [0.2, 0.3, 0.0, 0.0, 0.3, 0.2],  # both pieces: 0.6
        },
    )  # fmt: skip
    layer, head, choice = explaining.choose_head(run, query=query)
    assert (layer, head) == (0, 1)
    assert (
        "chosen: 'banks' (the mean of its 2 pieces' rows) puts the most weight here, 0.60,"
        in choice
    )


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


@pytest.mark.parametrize("options", [("--similarity", "dot"), ("--scale", repr(1 / math.sqrt(32)))])
def test_the_models_own_similarity_and_scale_recompute_the_same_weights(options):
    # dot and 1/sqrt(32) are MiniLM's own: the recomputed weights equal the model's (1e-6,
    # float32 rounding) and the verdict says so, not "flatter" or "sharper".
    data = explain_json(MONEY, "--word", "bank", "--layer", "0", "--head", "4", *options)
    own, alternative = data["weights"], data["alternative"]["weights"]
    torch.testing.assert_close(torch.tensor(alternative), torch.tensor(own), atol=1e-6, rtol=0)
    result = invoke("explain", MONEY, "--word", "bank", "--layer", "0", "--head", "4", *options)
    entropy = f"{data['entropy_bits']:.3f}"
    assert re.search(rf"entropy \(bits\) +│ +{entropy} │ +{entropy} \(the same\)", result.output)


def test_head_mean():
    data = explain_json(MONEY, "--word", "bank", "--layer", "5", "--head", "mean")
    assert data["head"] == "mean" and data["scores"] is None
    assert sum(data["weights"]) == pytest.approx(1.0, abs=1e-6)


def test_head_mean_is_the_mean_of_hugging_faces_heads(money_run, hf_minilm):
    """--head mean shows the layer's heads averaged, not one of them: its map and the query's
    row against the mean of Hugging Face's eager weights for that layer, 1e-5."""
    data = explain_json(MONEY, "--word", "bank", "--layer", "5", "--head", "mean")
    with torch.no_grad():
        theirs = hf_minilm(torch.tensor([money_run.token_ids]), output_attentions=True)
    mean = theirs.attentions[5][0].double().mean(0)  # (T, T)
    torch.testing.assert_close(
        torch.tensor(data["attention"], dtype=torch.float64), mean, atol=1e-5, rtol=0
    )
    bank = data["query"]["index"]
    torch.testing.assert_close(
        torch.tensor(data["weights"], dtype=torch.float64), mean[bank], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("head", ["mean", "2"])
def test_a_chosen_layer_quotes_the_figure_of_the_map_shown(money_run, head):
    """With --head given and no --layer, the layer is chosen for that head (or the mean of
    heads), and the figure quoted is that map's weight on other content words (2 decimals)."""
    data = explain_json(MONEY, "--word", "bank", "--head", head)
    bank = data["query"]["index"]
    others = [i for i in explaining.content_tokens(money_run.tokens, money_run.word_ids)
              if money_run.word_ids[i] != money_run.word_ids[bank]]  # fmt: skip
    maps = torch.stack([money_run.attention(layer).double() for layer in range(6)])  # (L,H,T,T)
    maps = maps.mean(1) if head == "mean" else maps[:, int(head)]
    on_content = maps[:, bank, others].sum(-1)  # (L,)
    assert data["layer"] == int(on_content.argmax())
    assert f"most weight here, {on_content.max():.2f}," in data["choice"]
    assert data["choice"].endswith("pick another with --layer")


def test_the_header_shows_a_text_of_headline_chars_whole_and_cuts_one_longer():
    """HEADLINE_CHARS (160) characters are the most the header shows whole; one more is cut
    at its last space and said with its length."""
    words = "abcd " * 40  # 200 characters
    whole = SimpleNamespace(text=words[: report.HEADLINE_CHARS], tokens=["t"] * 32)
    assert report._headline(whole) == whole.text
    longer = SimpleNamespace(text=words[: report.HEADLINE_CHARS + 1], tokens=["t"] * 33)
    kept = " ".join(["abcd"] * 32)  # the first 160 characters, to their last space
    assert report._headline(longer) == f"{kept} … (161 characters, 33 tokens)"


def test_truncate_runs_the_first_tokens_and_says_where_it_cut():
    text = "the river bank " * 200  # 600 words: over MiniLM's 512 positions
    data = explain_json(text, "--word", "bank", "--truncate")
    assert len(data["tokens"]) == 512
    assert text.startswith(data["text"]) and data["text"].endswith("bank")
    assert len(data["text"]) < len(text.rstrip())  # the JSON holds the text the model read

    result = invoke("explain", text, "--word", "bank", "--truncate")
    assert result.exit_code == 0, result.output
    assert f"({len(data['text']):,} characters, 512 tokens)" in result.stdout
    note = " ".join(result.stderr.split())
    assert f"its first {len(data['text']):,} of {len(text):,} characters" in note

    compared = invoke("compare", text, MONEY, "--word", "bank", "--truncate", "--json")
    assert compared.exit_code == 0, compared.output


@pytest.mark.parametrize("text", ["नमस्ते", "bank\u200b", "a b \u0301"])
def test_a_text_ending_in_characters_that_make_no_token_is_neither_cut_nor_altered(
    model, text, tmp_path
):
    # MiniLM reads नमस्ते as न ##म ##स ##त: no token covers the final vowel sign े (nor a
    # zero-width space, nor a lone accent). That said "the text was cut (--truncate)" without
    # --truncate, and the header and the JSON showed नमस्त.
    assert model.run(text).read_text == text
    result = invoke("explain", text, "--index", "1", "--json")
    assert result.exit_code == 0, result.output
    assert "note" not in result.stderr
    assert json.loads(result.stdout)["text"] == text
    page = tmp_path / "page.html"
    viewed = invoke("view", text, "-o", str(page))
    assert viewed.exit_code == 0, viewed.output
    assert "note" not in viewed.stderr


def test_the_header_shows_the_final_vowel_sign_the_tokenizer_drops():
    result = invoke("explain", "नमस्ते", "--index", "1")
    assert result.exit_code == 0, result.output
    assert re.search(r"text नमस्ते\s", result.stdout)


def test_a_cut_after_a_character_with_dropped_marks_keeps_its_marks():
    # [CLS] a b, then न ##म ##स ##त per word: the 512th token is the [SEP] after 127 words,
    # the last of them read to its vowel sign (which no token covers), not to त.
    text = "a b " + "नमस्ते " * 200
    read = "a b " + "नमस्ते " * 126 + "नमस्ते"
    result = invoke("explain", text, "--index", "1", "--truncate", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["text"] == read
    note = " ".join(result.stderr.split())
    assert f"its first {len(read):,} of {len(text):,} characters" in note


NOT_UTF8 = "bank \udcff"  # how Python's argv holds the bytes b"bank \xff" (surrogateescape)
NOT_UTF8_ERROR = "the text is not valid UTF-8 (byte 0xff at character 5); re-encode it as UTF-8"


def test_a_text_that_is_not_utf8_is_one_line_naming_the_byte(model, tmp_path):
    # It said "characters not in the model's vocabulary: ' \udcff'", though MiniLM has [UNK].
    commands = [
        ("explain", NOT_UTF8, "--word", "bank"),
        ("compare", NOT_UTF8, MONEY, "--word", "bank"),
        ("view", NOT_UTF8, "-o", str(tmp_path / "page.html")),
    ]
    for args in commands:
        result = invoke(*args)
        assert result.exit_code == 1, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
        assert NOT_UTF8_ERROR in lines[0] and "vocabulary" not in lines[0]
        assert "Traceback" not in result.output
    with pytest.raises(SelfAttnError) as error:
        model.run(NOT_UTF8)
    assert str(error.value) == NOT_UTF8_ERROR
    with pytest.raises(SelfAttnError, match=r"texts\[1\] is not valid UTF-8 \(a lone surrogate"):
        model.encode([MONEY, "\ud83d bank"])


def test_a_map_wider_than_the_terminal_keeps_one_line_per_row_around_the_query(monkeypatch):
    # 512 keys in 80 columns wrapped every row of the map into seven lines of noise before.
    monkeypatch.setenv("COLUMNS", "80")
    text = "the river bank " * 170  # 512 tokens
    result = invoke("explain", text, "--word", "bank", "--occurrence", "-1")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    query = int(re.search(r"query (\d+) 'bank'", result.stdout)[1])
    first = next(i for i, line in enumerate(lines) if re.match(r"\s*0 \[CLS\] ", line))
    assert re.match(r"511 \[SEP\] ", lines[first + 511])  # no row wrapped onto a second line
    assert "attention, layer" in lines[first - 4]  # the title, then 3 lines of key indices
    said = " ".join(result.stdout.split())
    shown = re.search(r"keys (\d+)\.\.(\d+) of 512 shown", said)
    assert int(shown[1]) <= query <= int(shown[2])
    assert f"around key {query}; a wider terminal, --png, --svg or --html shows them all" in said


def test_help_lists_flags_without_a_type_and_paragraphs_on_one_line():
    import typer

    commands = typer.main.get_command(app).commands
    for name, command in commands.items():
        for paragraph in command.help.split("\n\n"):
            assert "\n" not in paragraph, name  # typer would print the docstring's line breaks
    shown = " ".join(invoke("explain", "--help").stdout.split())
    for flag in ("--json", "--words", "--truncate", "--help"):
        assert f"{flag} <bool>" not in shown and flag in shown
    top = " ".join(invoke("--help").stdout.split())
    assert "--help <bool>" not in top and "--help" in top


@pytest.mark.parametrize(("command", "argument"), [("explain", "TEXT"), ("view", "TEXT"),
                                                    ("compare", "SENTENCE")])  # fmt: skip
def test_usage_names_the_argument_as_the_help_text_does(command, argument):
    # The help says "one word of TEXT"; the usage line used to show "{text}". Typer's own
    # click (typer 0.26 on) braces it, click itself (older typer) does not.
    usage = invoke(command, "--help").stdout
    braced, bare = f"[OPTIONS] {{{argument}}}", f"[OPTIONS] {argument}"
    assert (braced in usage or bare in usage) and argument.lower() + "}" not in usage


def test_figures_and_page(tmp_path):
    png, svg, html = tmp_path / "bank.png", tmp_path / "bank.svg", tmp_path / "bank.html"
    result = invoke("explain", MONEY, "--word", "bank", "--png", str(png), "--svg", str(svg),
                    "--html", str(html))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in svg.read_text()
    page = html.read_text()
    assert "selfattn-payload" in page and "http://" not in page and "https://" not in page
    said = " ".join(result.stderr.split())  # what was written, and how to open the page
    assert (
        f"wrote {png} wrote {svg} wrote {html} (open it in a browser; it needs no network)" in said
    )


def test_page_of_the_mean_of_heads_opens_on_the_mean(tmp_path):
    # explain --head mean --html: the page used to open on head 0.
    page = tmp_path / "mean.html"
    result = invoke("explain", MONEY, "--word", "bank", "--layer", "2", "--head", "mean",
                    "--html", str(page))  # fmt: skip
    assert result.exit_code == 0, result.output
    text = page.read_text(encoding="utf-8")
    data = json.loads(text.split('id="selfattn-payload">')[1].split("</script>")[0])
    assert data["selection"] == {"layer": 2, "head": "mean", "query": 5}


def test_view_escapes_user_text(tmp_path):
    out = tmp_path / "page.html"
    xss = "<img src=x onerror=alert(1)> is text"
    result = invoke("view", xss, "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "<img src=x" not in out.read_text()
    assert f"wrote {out} (open it in a browser; it needs no network)" in " ".join(
        result.stderr.split()
    )


def attended_by_hand(run, word: str, top: int = 3, occurrence: int = 0):
    """The words ``word`` weighs most in the last layer's mean of heads: as a key, a word's
    weight is the sum over its pieces; as a query, the mean over its pieces' rows. The word
    itself and special tokens are left out. Built from run.attention and run.word_ids only."""
    weights = run.attention(run.n_layers - 1).mean(0)  # (T, T)
    pieces = list(run.word_tokens(word, occurrence))
    row = weights[pieces].mean(0)
    words: dict[int, list[int]] = {}
    for token, word_id in enumerate(run.word_ids):
        if word_id is not None:
            words.setdefault(word_id, []).append(token)
    ranked = [
        ("".join(run.tokens[i].removeprefix("##") for i in tokens), row[tokens].sum().item())
        for tokens in words.values()
        if tokens != pieces
    ]
    return sorted(ranked, key=lambda entry: -entry[1])[:top]


def test_compare_bank_across_sentences(model):
    result = invoke("compare", MONEY, MONEY_2, RIVER, "--word", "bank", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == model.name  # which model's vectors, as explain --json says
    assert len(data["layers"]) == 7  # embedding output + 6 layers
    last = torch.tensor(data["layers"][-1]["cosine"])
    torch.testing.assert_close(last.diagonal(), torch.ones(3, dtype=last.dtype), atol=1e-6, rtol=0)
    assert last[0, 1] > last[0, 2]  # two money banks are closer than money and river
    attended = [[entry["word"] for entry in row] for row in data["attended"]]
    assert {"deposit", "money"} & set(attended[0])
    # The attended words: the last attention layer (5 of 0..5), recomputed here (1e-6).
    assert data["attended_layer"] == model.run(MONEY).n_layers - 1 == 5
    for sentence, row in zip([MONEY, MONEY_2, RIVER], data["attended"], strict=True):
        expected = attended_by_hand(model.run(sentence), "bank")
        assert [entry["word"] for entry in row] == [word for word, _ in expected]
        weights = torch.tensor([entry["weight"] for entry in row])
        torch.testing.assert_close(
            weights, torch.tensor([weight for _, weight in expected]), atol=1e-6, rtol=0
        )
    assert data["tokens"] == [["bank"]] * 3 and data["tokens_note"] is None  # one token id
    text = invoke("compare", MONEY, RIVER, "--word", "bank").output
    assert "S1 vs S2" in text and "attends to" in text
    assert "read as other tokens" not in text


def test_compare_from_python_refuses_one_text_or_one_sentence(model):
    for sentences, got in ((MONEY, "got one str"), ([MONEY], "got 1")):
        with pytest.raises(SelfAttnError, match=f"at least two sentences to compare, {got}$"):
            explaining.compare_texts(model, sentences, "bank")


def test_an_explanation_prints_as_one_short_line(model):
    _, explanation = explaining.explain_text(model, MONEY, word="bank")
    shown = repr(explanation)
    assert shown.startswith("Explanation('all-MiniLM-L6-v2', layer=0, head=4, query=5 'bank'")
    assert "\n" not in shown and "tensor" not in shown and len(shown) < 250


def test_compare_names_the_attention_read_in_both_numberings():
    # The table counts hidden states (0 = embeddings .. 6); "attends to" reads attention
    # layer 5, the last block's, which explain calls --layer 5 and whose output is layer 6.
    result = invoke("compare", MONEY, RIVER, "--word", "bank")
    assert result.exit_code == 0, result.output
    shown = " ".join(result.stdout.split())
    assert (
        "(attends to: attention layer 5 (explain --layer 5), mean of heads, this 'bank' itself and "
        "the special tokens left out (so the weights sum to less than 1); its block's output "
        "is layer 6 in the table)" in shown
    )
    rows = re.findall(r"^│\s+(\d+) │", result.stdout, re.MULTILINE)
    assert rows == [str(layer) for layer in range(7)]  # the table's rows: layers 0..6


@pytest.mark.parametrize("occurrence", [0, 1, -1])
def test_compare_follows_the_occurrence_asked(model, occurrence):
    # TWO_BANKS has "bank" twice; each sentence's vector is the chosen occurrence's (cosine
    # recomputed here from run.word_vector, 1e-6), and so is what it attends to.
    sentences = [TWO_BANKS, "The bank was closed, so we sat by the bank of the river."]
    data = json.loads(invoke("compare", *sentences, "--word", "bank", "--occurrence",
                             str(occurrence), "--json").stdout)  # fmt: skip
    assert data["occurrence"] == occurrence
    runs = [model.run(sentence) for sentence in sentences]
    for layer, entry in enumerate(data["layers"]):
        a, b = (run.word_vector("bank", layer, occurrence).double() for run in runs)
        cosine = torch.nn.functional.cosine_similarity(a, b, dim=0)
        assert entry["cosine"][0][1] == pytest.approx(cosine.item(), abs=1e-6)
    for run, row in zip(runs, data["attended"], strict=True):
        expected = attended_by_hand(run, "bank", occurrence=occurrence)
        assert [entry["word"] for entry in row] == [word for word, _ in expected]


def test_compare_tells_a_repeated_attended_word_apart():
    # In the first sentence the last "bank" weighs the first "bank" (token 5): a word the
    # sentence holds twice is listed with its token index, in the terminal and the JSON.
    sentences = ["I went to the bank to deposit money at the bank.", RIVER]
    args = ("compare", *sentences, "--word", "bank", "--occurrence", "-1")
    data = json.loads(invoke(*args, "--json").stdout)
    first = {entry["word"]: entry for entry in data["attended"][0]}
    assert first["bank"]["index"] == 5
    assert first["deposit"]["index"] == 7
    shown = " ".join(invoke(*args).stdout.split())
    assert f"5:bank {first['bank']['weight']:.2f}" in shown
    assert f"deposit {first['deposit']['weight']:.2f}" in shown and "7:deposit" not in shown
    assert "n:word = the word at token n" in shown


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
        (["explain", MONEY, "--png", "bank.pdf"], "does not end in .png"),
        (["explain", MONEY, "--model", "no-such-model"], "no-such-model"),
        (["explain", "word " * 600], "at most 512"),
        (["compare", MONEY, "--word", "bank"], "at least two sentences"),
        (["compare", MONEY, RIVER, "--word", "money"], "money"),
        (["compare", MONEY, "banks", "--word", "bank"], "sentence 2 ('banks')"),
        (["compare", MONEY, "", "--word", "bank"], "sentence 2 (''): the text is empty"),
        (["compare", MONEY, RIVER, "--word", "bank", "--occurrence", "1"], "sentence 1 ("),
        (["compare", MONEY, RIVER, "--word", "  "], "Error: the word to find is empty"),
        (["explain", MONEY, "--word", "bank", "--scale", "nan"], "--scale must be a finite"),
        (["explain", MONEY, "--word", "bank", "--scale", "-inf"], "--scale must be a finite"),
        (["explain", MONEY, "--word", "bank", "--scale", "1e308"], "overflow"),
        (["explain", MONEY, "--scale", "2"], "one query of one head"),
        (["explain", MONEY, "--occurrence", "2"], "no word is given"),
        (
            ["explain", MONEY, "--word", "bank", "--head", "mean", "--scale", "2"],
            "instead of 'mean'",
        ),
        (["explain", MONEY, "--png", "/no/such/folder/bank.png"], "does not exist"),
        (["explain", MONEY, "--html", "."], "is a folder"),
        (["explain", MONEY, "--html", "/etc/passwd/x/b.html"], "/etc/passwd is a file, not a"),
        (["explain", MONEY, "--svg", "/proc/bank.svg"], "cannot write /proc/bank.svg"),
        (["view", MONEY, "-o", "/no/such/folder/bank.html"], "does not exist"),
        # usage mistakes, found by typer before the command runs ("root": the test runner's name);
        # a pair: typer's own click's wording (typer 0.26 on), then click 8.3's (older typer)
        (
            ["explain", MONEY, "--bogus"],
            (
                "No such option: --bogus. See `root explain --help`.",
                "No such option '--bogus'. See `root explain --help`.",
            ),
        ),
        (
            ["explain", MONEY, "--wrd", "bank"],
            ("(Possible options: --word, --words)", "(Did you mean one of: '--word', '--words'?)"),
        ),
        (["explain", MONEY, "--scale", "abc"], "Invalid value for '--scale'"),
        (["explain"], "Missing argument 'TEXT'"),
        (["compare", MONEY, RIVER], "Missing option '--word'"),
        (["explian", MONEY], "Did you mean 'explain'? See `root --help`."),
        (["generate", "--max-new-tokens", "-1", "x"], "'--max-new-tokens'"),
    ],
)
def test_user_errors_are_one_line(args, message):
    result = invoke(*args)
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
    assert any(said in lines[0] for said in ([message] if isinstance(message, str) else message))
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "status"),
    [
        # 2: the command line is wrong whatever the text, model and files (a usage error)
        (["explain", MONEY, "--bogus"], 2),
        (["explain", MONEY, "--layer", "-1"], 2),
        (["explain", MONEY, "--word", "bank", "--head", "-1"], 2),  # not the last head
        (["explain", MONEY, "--word", ""], 2),
        (["explain", MONEY, "--scale", "2"], 2),
        (["explain", MONEY, "--occurrence", "2"], 2),
        (["explain", MONEY, "--word", "bank", "--head", "mean", "--scale", "2"], 2),
        (["compare", MONEY, RIVER, "--word", " "], 2),
        (["train", "--data", "x.txt", "--out", "run", "--preset", "huge"], 2),
        (["train", "--data", "x.txt", "--out", "run", "--lr", "nan"], 2),
        (["train", "--data", "x.txt", "--out", "run", "--device", "gpu"], 2),
        # 1: a problem met in the work: the text, the model, a file
        (["explain", MONEY, "--word", "river"], 1),
        (["explain", MONEY, "--layer", "9"], 1),
        (["explain", MONEY, "--word", "bank", "--head", "12"], 1),
        (["explain", "word " * 600], 1),
        (["train", "--data", "missing.txt", "--out", "run"], 1),
    ],
)
def test_the_exit_status_says_whether_the_command_line_or_the_work_went_wrong(
    args, status, tmp_path, monkeypatch
):
    """As README's "Exit status" says: 2 for a usage error, 1 for a problem in the work; an
    unknown preset or a NaN learning rate was 1, an unknown option 2."""
    monkeypatch.chdir(tmp_path)
    result = invoke(*args)
    assert result.exit_code == status, result.output
    assert result.stderr.startswith("Error: ") and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"query": 99}, r"^token index 99 is out of range: tokens 0\.\.10$"),
        ({"query": -1, "layer": 0, "head": 0}, "token index -1 is out of range"),
        ({"query": True}, "token index True is out of range"),
        ({"layer": 0, "head": True}, r"head True is out of range.*0\.\.11, or 'mean'"),
        ({"layer": 6}, r"^layer 6 is out of range: this model has layers 0\.\.5$"),
    ],
)
def test_explain_refuses_a_query_layer_or_head_that_is_no_token_or_head(
    money_run, options, message
):
    """explain() itself, as explain_text() did: an empty StopIteration or torch's IndexError
    for a query past the tokens, and True taken as token or head 1. Each is one OutOfRange,
    which ``except ValueError`` and ``except IndexError`` both catch (a layer was a
    ValueError, a token an IndexError)."""
    with pytest.raises(OutOfRange, match=message) as raised:
        explaining.explain(money_run, model_name="minilm", **options)
    assert isinstance(raised.value, IndexError) and isinstance(raised.value, SelfAttnError)


@pytest.mark.parametrize(
    ("given", "message"),
    [({"word": 3}, "word= takes the word as a str, got 3"), ({"index": "bank"}, "got 'bank'")],
)
def test_a_word_and_an_index_given_the_wrong_way_round_are_refused(model, given, message):
    # word=3 explained token 3, and index="bank" the word "bank": lenient, but a mix-up unseen
    with pytest.raises(TypeError, match=message):
        explaining.explain_text(model, MONEY, **given)


@pytest.mark.parametrize("occurrence", [0, 1, -1])
def test_occurrence_picks_that_word(model, occurrence):
    run, explanation = explaining.explain_text(
        model, TWO_BANKS, word="bank", occurrence=occurrence, layer=0, head=0
    )
    banks = [i for i, token in enumerate(run.tokens) if token == "bank"]
    assert len(banks) == 2
    assert explanation.query == banks[occurrence]
    torch.testing.assert_close(  # float32, both recomputed by the explicit path: 1e-6
        explanation.weights, run.attention(0, 0)[banks[occurrence]], atol=1e-6, rtol=0
    )


def test_an_occurrence_past_the_last_is_a_clear_error(model):
    with pytest.raises(SelfAttnError) as e:
        explaining.explain_text(model, TWO_BANKS, word="bank", occurrence=2)
    assert str(e.value) == (
        "there is no occurrence 2 of the word 'bank': it occurs 2 times in the text; "
        "--occurrence (occurrence= in Python) counts from 0 (0 = the first, -1 = the last)"
    )


def test_a_missing_word_is_not_called_a_missing_occurrence():
    # No occurrence was asked for: the word is simply not there, and the words that are listed.
    short = "I went to the bank"
    missing = invoke("explain", short, "--word", "banks")
    assert missing.exit_code == 1
    listed = "the word 'banks' is not in the text; the words are: I, went, to, the, bank"
    assert missing.stderr == f"Error: {listed}\n"  # one line, no "occurrence 0"
    once = invoke("explain", short, "--word", "bank", "--occurrence", "1")
    assert "it occurs 1 time in the text; --occurrence (occurrence= in Python) counts from 0 " in (
        once.stderr
    )
    compared = invoke("compare", MONEY, short, "--word", "banks")
    assert compared.stderr.startswith(f"Error: sentence 1 ({MONEY!r}): {listed}, deposit")


NO_QUERY = "give the query's token index (query=)"
NO_HEAD = "give a head number instead of 'mean' (or no head, to have one chosen)"


@pytest.mark.parametrize(
    ("options", "missing"),
    [
        ({"layer": 0, "head": 4, "scale": 1.0}, NO_QUERY),
        ({"layer": 0, "head": 4, "similarity": "cosine"}, NO_QUERY),
        ({"scale": 1.0}, NO_QUERY),  # a head left out is chosen: only the query is missing
        ({"query": 5, "layer": 0, "head": "mean", "scale": 1.0}, NO_HEAD),
        ({"query": 5, "head": "mean", "similarity": "cosine"}, NO_HEAD),
        ({"head": "mean", "scale": 1.0}, NO_QUERY + " and a head number instead of 'mean'"),
    ],
    ids=str,
)
def test_another_similarity_or_scale_names_what_is_missing(money_run, options, missing):
    with pytest.raises(ValueError, match="for one query of one head") as error:
        explaining.explain(money_run, model_name="minilm", **options)
    message = str(error.value)
    assert "\n" not in message and missing in message
    if missing == NO_QUERY:
        assert "head" not in message.split(": ", 1)[1]  # nothing asked of the head


@pytest.mark.parametrize("options", [{"scale": 1.0}, {"similarity": "cosine", "head": 2}], ids=str)
def test_explain_text_names_the_query_options_of_the_command_line_then_python(model, options):
    # explain_text is what the CLI and the server call: its errors fit both, the flags first.
    with pytest.raises(ValueError, match="for one query of one head") as error:
        explaining.explain_text(model, MONEY, **options)
    message = str(error.value)
    assert "\n" not in message
    assert message.endswith("(--word or --index; word= or index= in Python)")
    result = invoke("explain", MONEY, *(f"--{key}={value}" for key, value in options.items()))
    assert result.exit_code != 0 and "(--word or --index; word= or index=" in result.stderr


@pytest.mark.parametrize(
    ("options", "occurrence"),
    [({}, 5), ({}, -1), ({"index": 3}, 1), ({}, 10**23)],
    ids=str,
)
def test_an_occurrence_without_a_word_is_refused(model, options, occurrence):
    # occurrence counts the matches of a word: without one it meant nothing and was ignored.
    with pytest.raises(ValueError, match="no word is given") as error:
        explaining.explain_text(model, MONEY, occurrence=occurrence, **options)
    message = str(error.value)
    assert "\n" not in message and "give the word too (--word; word= in Python)" in message
    assert f"occurrence {occurrence} " in message
    explaining.explain_text(model, MONEY, index=3, occurrence=0, layer=0, head=0)  # the default


@pytest.mark.parametrize("scale", [1e308, -1e308])
def test_a_scale_that_overflows_the_scaled_scores_is_refused(money_run, scale):
    with pytest.raises(ValueError, match="overflow") as error:
        explaining.explain(money_run, model_name="minilm", query=5, layer=0, head=4, scale=scale)
    assert "\n" not in str(error.value)
    # 1e30 keeps the float32 scaled scores finite: allowed, and the weights still sum to 1.
    finite = explaining.explain(
        money_run, model_name="minilm", query=5, layer=0, head=4, scale=1e30
    )
    assert torch.isfinite(finite.alternative.scaled).all()
    assert finite.alternative.weights.sum().item() == pytest.approx(1.0, abs=1e-6)


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


def test_a_word_without_accents_finds_it_with_them():
    # "cafe" finds "Café" (token 5, read "cafe" by MiniLM), in explain and in compare.
    data = explain_json("Il caffè del Café", "--word", "cafe", "--layer", "0", "--head", "0")
    assert data["query"] == {"index": 5, "token": "cafe"}  # one word, one token: no note
    result = invoke("compare", "Il caffè del Café", "Un CAFÉ, per favore", "--word", "cafe")
    assert result.exit_code == 0, result.output
    missing = invoke("explain", "Il caffè del Café", "--word", "caffé")
    assert "the words are: Il, caffè, del, Café" in missing.stderr


def test_compare_reads_a_phrase_on_all_its_tokens(model):
    # The vector of "river bank" is the mean over its tokens; so is the row of what it attends
    # to (last layer, mean of heads, keys summed by word, 1e-6), and neither of its own
    # words is listed, while the other "river" of the first sentence is (by token index).
    sentences = [TWO_RIVERS, "The river bank was muddy."]
    data = cli_json("compare", *sentences, "--word", "river bank")
    for sentence, row in zip(sentences, data["attended"], strict=True):
        run = model.run(sentence)
        pieces = list(run.word_tokens("river bank"))
        assert [run.tokens[i] for i in pieces] == ["river", "bank"]
        weights = run.attention(run.n_layers - 1).mean(0)[pieces].mean(0)
        others = {}
        for token, word_id in enumerate(run.word_ids):
            if word_id is not None and token not in pieces:
                others.setdefault(word_id, []).append(token)
        expected = sorted(((tokens[0], weights[tokens].sum().item()) for tokens in
                           others.values()), key=lambda entry: -entry[1])[:3]  # fmt: skip
        assert [entry["index"] for entry in row] == [index for index, _ in expected]
        assert [entry["weight"] for entry in row] == pytest.approx(
            [weight for _, weight in expected], abs=1e-6
        )
    assert 9 in [entry["index"] for entry in data["attended"][0]]  # the other river


def test_compare_cosines_never_exceed_one():
    # Two unit vectors' dot product in float64 rounds to 1.0000000000000002 for a word and
    # itself; a cosine is clamped to [-1, 1].
    data = cli_json("compare", "I don't like it", "You don't say", "--word", "don't")
    cosines = torch.tensor([entry["cosine"] for entry in data["layers"]], dtype=torch.float64)
    assert cosines.abs().max().item() <= 1.0
    assert cosines.diagonal(dim1=1, dim2=2).min().item() == pytest.approx(1.0, abs=1e-12)


def test_an_error_about_a_long_compared_sentence_quotes_its_start():
    long = "bank " + "word " * 600
    result = invoke("compare", long, RIVER, "--word", "bank")
    assert result.exit_code != 0
    line = result.stderr.strip()
    assert line.startswith("Error: sentence 1 ('bank word word") and "…'): the text is" in line
    assert len(line) < 250, line


def page_naming(options: tuple[str, ...]) -> str:
    return " or ".join(f"the {name.title()} field" for name in options)


def test_a_message_names_options_as_the_command_line_does_and_another_front_end_its_way():
    message = Message("give the word too (", Options("--word; word= in Python", ("word",)), ")")
    assert message == "give the word too (--word; word= in Python)"  # str: the command line's
    assert str(SelfAttnError(message)) == message
    assert message.worded(page_naming) == "give the word too (the Word field)"
    joined = Message.joined("; ", [message, "a plain note"])
    assert joined.worded(page_naming) == "give the word too (the Word field); a plain note"
    assert worded("a plain message", page_naming) == "a plain message"
    assert message_of(ValueError(message)) is message
    assert message_of(ValueError("plain", 2)) == "('plain', 2)"


def test_an_error_about_a_compared_sentence_keeps_the_options_it_names():
    refusal = Message("pick ", Options("--occurrence", ("occurrence",)), " again")

    class Refusing:
        name = "refusing"

        def run(self, text: str, truncate: bool = False):
            raise SelfAttnError(refusal)

    with pytest.raises(SelfAttnError) as caught:
        explaining.compare_texts(Refusing(), ["a bank", "the bank"], "bank")
    message = message_of(caught.value)
    assert message == "sentence 1 ('a bank'): pick --occurrence again"
    assert message.worded(page_naming) == "sentence 1 ('a bank'): pick the Occurrence field again"


def test_a_warning_while_writing_a_figure_is_one_note(tmp_path, monkeypatch):
    # A figure whose characters no font has warns (MissingGlyphsWarning, tested in
    # test_viz_figures.py). Python printed its warning block to the terminal (location line,
    # message, source line); the command now prints one note naming the file.
    import warnings

    def save(explanation, path):
        note = "no installed font has 🙂 (U+1F642): the figure shows their code points"
        warnings.warn(note, stacklevel=2)
        path.write_bytes(b"")

    monkeypatch.setattr(report, "save_heatmap", save)
    png = tmp_path / "smile.png"
    result = invoke("explain", "I like 🙂 a lot", "--word", "like", "--png", str(png))
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert (
        "note: smile.png: no installed font has 🙂 (U+1F642): the figure shows their code points"
        in lines
    )
    assert not any("Warning" in line or "warnings.warn" in line for line in lines), lines


def test_the_terminal_report_does_not_import_matplotlib():
    # matplotlib takes about 0.3 s to import: explain pays it only for --png or --svg.
    import subprocess
    import sys

    code = "import sys, selfattn.viz.report; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


def test_options_the_files_do_not_show_are_said(tmp_path, monkeypatch):
    """--similarity, --scale and --words changed the printed steps while the page (and for
    the first two the PNG) showed the model's own dot products, token by token, with only
    "wrote bank.html" said."""
    monkeypatch.chdir(tmp_path)
    args = ("explain", MONEY, "--word", "bank", "--similarity", "cosine", "--scale", "1")
    result = invoke(*args, "--html", "bank.html", "--png", "bank.png")
    assert result.exit_code == 0, result.output
    assert (
        "note: --similarity and --scale recompute the steps printed here, not bank.html, "
        "bank.png: they show the model's own weights" in " ".join(result.stderr.split())
    )
    result = invoke("explain", MONEY, "--word", "bank", "--words", "--html", "bank.html")
    assert "note: --words merges word pieces here and in pictures, not in bank.html" in (
        " ".join(result.stderr.split())
    )
    assert "note:" not in invoke("explain", MONEY, "--word", "bank", "--html", "b.html").stderr
    result = invoke("explain", MONEY, "--word", "bank", "--scale", "1", "--png", "bank.png")
    assert "note: --scale recomputes the steps printed here, not bank.png" in (
        " ".join(result.stderr.split())
    )


def test_the_pages_vectors_and_scale_give_hugging_faces_weights(money_run, hf_minilm):
    """The page recomputes every weight from its q, k and scale: softmax(q kᵀ × scale) of its
    payload (float32 on the wire) against Hugging Face's eager weights, every layer and head,
    1e-5; the scale is 1/√d_k = 1/√32, whatever the text's length."""
    payload = page_data(money_run, explaining.explain(money_run, model_name="minilm"))
    assert payload["dtype"] == "float32"
    assert payload["scale"] == pytest.approx(1 / math.sqrt(32), rel=1e-12)

    def decoded(name: str) -> torch.Tensor:
        data = bytearray(base64.b64decode(payload[name]["data"]))
        return torch.frombuffer(data, dtype=torch.float32).reshape(payload[name]["shape"])

    q, k = decoded("query").double(), decoded("key").double()  # (L, H, T, d)
    weights = torch.softmax(q @ k.transpose(-1, -2) * payload["scale"], -1)
    with torch.no_grad():
        theirs = hf_minilm(torch.tensor([money_run.token_ids]), output_attentions=True)
    expected = torch.cat(theirs.attentions).double()  # (L, H, T, T)
    torch.testing.assert_close(weights, expected, atol=1e-5, rtol=0)


def test_an_offline_page_says_why_it_opened_where_it_did(model, tmp_path):
    """explain --html and view chose a layer and head without saying why (only the live
    explorer did), and view opened on query 0, [CLS]; now the page carries explain's reason,
    naming its menus, and opens on the first content word."""
    run, chosen = explaining.explain_text(model, MONEY, word="bank")
    data = page_data(run, chosen)
    assert data["choice"] == (
        str(chosen.choice).removesuffix("--layer/--head") + "the layer menu or the head menu"
    )
    run, asked = explaining.explain_text(model, MONEY, word="bank", layer=0, head=4)
    assert "choice" not in page_data(run, asked)
    run = model.run(MONEY)
    data = page_data(run, explaining.explain(run, model_name=model.name))
    assert data["selection"]["query"] == run.tokens.index("went")  # "i" is a stop word
    assert data["choice"].startswith("chosen: the words, on average, put the most weight")


def test_a_decoders_page_opens_on_its_last_content_word():
    """A causal model's first word can attend only to itself (a row of 1.0 beside masked
    keys): the page opened there; it opens on the last content word, which sees the text."""
    text = "the river bank"
    model = char_gpt("abcdefghijklmnopqrstuvwxyz ", block_size=32)
    run = model.run(text)
    data = page_data(run, explaining.explain(run, model_name=model.name))
    assert data["selection"]["query"] == len(text) - 1  # the "k" of "bank"
