"""Terminal views print their labels and numbers (rich, recorded at 120 columns)."""

import math
from itertools import combinations

import pytest
import torch
from rich.cells import cell_len
from rich.console import Console

from selfattn import attention
from selfattn.explain import Attended, Comparison, Explanation
from selfattn.viz.report import print_comparison, print_explanation
from selfattn.viz.terminal import (
    bar,
    heatmap,
    printable,
    step_table,
    weights_bars,
    written_scale,
)

TOKENS = ["[CLS]", "i", "went", "to", "the", "bank", "[unused1]", "money", "[SEP]"]


def render(renderable, color: bool = False) -> str:
    console = Console(record=True, width=120, color_system="truecolor" if color else None)
    console.print(renderable)
    return console.export_text()


def trace(n: int, seed: int = 0):
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return attention(x, x, x, backend="explicit", return_trace=True)[1]


def test_weights_bars_shows_every_key_its_weight_and_the_total():
    weights = torch.tensor([0.1, 0.2, 0.05, 0.05, 0.1, 0.4, 0.0, 0.08, 0.02])
    text = render(weights_bars(TOKENS, weights, "bank attends to"))
    assert "bank attends to" in text
    for token in TOKENS:
        assert token in text  # markup-like tokens such as [unused1] print as text
    assert "0.400" in text and "0.080" in text
    assert "total" in text and "1.000" in text
    assert "█" * 24 in text  # the largest weight fills the bar


def test_bar_scales_to_the_largest_value_with_eighth_blocks():
    assert bar(1.0, 1.0, width=4) == "████"
    assert bar(0.5, 1.0, width=4) == "██"
    assert bar(1 / 8, 1.0, width=4) == "▌"  # half a character
    assert bar(0.0, 1.0) == ""


def test_bar_rounds_to_the_nearest_eighth():
    """The bar's length is rounded to the nearest eighth of a character, not cut down: 0.99 of
    one character is a full block (7.92 eighths), 0.07 of one a first eighth (0.56), and
    0.7 of ten exactly seven blocks."""
    assert bar(0.7, 1.0, 10) == "█" * 7
    assert bar(0.99, 1.0, 1) == "█"
    assert bar(0.07, 1.0, 1) == "▏"


def test_step_table_lists_score_scaled_and_weight_per_key():
    tr = trace(len(TOKENS))
    scale = written_scale(tr.scale, tr.similarity, 8)
    text = render(step_table(TOKENS, tr.scores[5], tr.scaled[5], tr.weights[5], scale))
    assert "score" in text and "scaled" in text and "weight" in text
    for j in range(len(TOKENS)):
        for value in (tr.scores[5, j], tr.scaled[5, j], tr.weights[5, j]):
            assert f"{value.item():.3f}" in text
    assert "1.000" in text
    assert "scaled = score × scale, scale = 1/√d_k = 1/√8 = 0.35355" in text
    assert "(the total adds the weights before rounding)" in text  # 0.999 or 1.001 otherwise


@pytest.mark.parametrize("width", [40, 60, 200])
def test_row_tables_print_every_key_and_number_whole_in_any_width(width):
    # The bars take what the numbers leave, 24 cells at most, or none where fewer than 4
    # are left: at 40 and 60 columns they used to squeeze keys and numbers out of the table.
    tr = trace(len(TOKENS))
    scale = written_scale(tr.scale, tr.similarity, 8)
    steps = (tr.scores[5], tr.scaled[5], tr.weights[5])
    for table, numbers in (
        (step_table(TOKENS, *steps, scale), steps),
        (weights_bars(TOKENS, tr.weights[5], "x"), steps[2:]),
    ):
        console = Console(record=True, width=width, color_system=None)
        console.print(table)
        lines = console.export_text().splitlines()
        assert max(cell_len(line) for line in lines) <= width
        rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines]
        for token, *values in zip(TOKENS, *numbers, strict=True):
            printed = [token, *(f"{float(value):.3f}" for value in values)]
            assert printed in [row[: len(printed)] for row in rows]
        bars = [row[-1] for row in rows if len(row) == len(numbers) + 2]
        table_width = max(cell_len(line) for line in lines if "│" in line)
        assert not bars or max(map(cell_len, bars)) == 24 or table_width == width


@pytest.mark.parametrize(
    ("scale", "similarity", "written"),
    [
        (1 / math.sqrt(32), "dot", "1/√d_k = 1/√32 = 0.17678"),  # the default: where it is from
        (math.sqrt(32), "cosine", "√d_k = √32 = 5.6569"),
        (1 / math.sqrt(32), "cosine", "0.17678"),  # dot's default is no default for cosine
        (1.0, "dot", "1"),  # a scale the user gave: the number alone
        (0.5, "dot", "0.5"),
        # Near a default is no default: 1/√32 = 0.1767767 rounded by the user, or 1% off it,
        # is the user's number, not "1/√d_k" (only float rounding, 1e-9 relative, is the same).
        (0.1768, "dot", "0.1768"),
        (0.177, "dot", "0.177"),
        (5.66, "cosine", "5.66"),
    ],
)
def test_written_scale_says_where_a_default_scale_comes_from(scale, similarity, written):
    assert written_scale(scale, similarity, 32) == written


def test_row_views_refuse_a_row_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"shape \(9,\)"):
        weights_bars(TOKENS, torch.ones(4) / 4, "x")


def test_heatmap_labels_rows_and_columns_and_captions_the_axes():
    tr = trace(len(TOKENS))
    text = render(heatmap(TOKENS, TOKENS, tr.weights, "layer 0, head 0"))
    assert "layer 0, head 0" in text
    assert "rows: queries, columns: keys" in text
    assert "5 bank" in text  # row label: index and token


def test_heatmap_centres_its_title_and_caption_on_the_grid_not_the_terminal():
    # In a 200-column terminal a 12-key grid is 41 columns wide: its title and caption sit
    # over it, not 80 columns to the right; a title wider than the grid starts at its left.
    tokens = list("abcdefghijkl")
    console = Console(record=True, width=200, color_system=None)
    console.print(heatmap(tokens, tokens, torch.eye(12), "attention, layer 0"))
    console.print(heatmap(tokens[:2], tokens[:2], torch.eye(2), "a title wider than the map"))
    lines = console.export_text().splitlines()
    last_row = next(line for line in lines if line.startswith("11 l"))  # ends on its diagonal
    grid_width = len(last_row.rstrip())
    assert grid_width == 41

    def centre(text: str) -> float:
        line = next(line for line in lines if text in line)
        return line.index(text) + len(text) / 2

    assert abs(centre("attention, layer 0") - grid_width / 2) <= 1
    assert abs(centre("rows: queries, columns: keys") - grid_width / 2) <= 1
    assert next(line for line in lines if "wider than" in line).startswith("a title")


def test_heatmap_paints_cells_in_truecolor_shades():
    tr = trace(4)
    console = Console(record=True, width=120, color_system="truecolor", force_terminal=True)
    console.print(heatmap(["a", "b", "c", "d"], ["a", "b", "c", "d"], tr.weights, "x"))
    styled = console.export_text(styles=True)
    assert "48;2;" in styled  # 24-bit background colours


def test_heatmap_paints_more_weight_darker():
    """Weight 0 is the page's light blue (247, 251, 255), the largest weight the dark ink
    (8, 48, 107): in row 0 of [[1, 0], [0, 1]] the dark cell comes first. Exact colours."""
    console = Console(record=True, width=120, color_system="truecolor", force_terminal=True)
    console.print(heatmap(["a", "b"], ["a", "b"], [[1.0, 0.0], [0.0, 1.0]], "x"))
    row = next(line for line in console.export_text(styles=True).splitlines() if "0 a" in line)
    dark, light = "48;2;8;48;107m", "48;2;247;251;255m"
    assert dark in row and light in row and row.index(dark) < row.index(light)


def test_heatmap_of_64_tokens_fits_120_columns_with_index_labels():
    tokens = [f"token_with_a_long_name_{i}" for i in range(64)]
    tr = trace(64)
    text = render(heatmap(tokens, tokens, tr.weights, "64 tokens"))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120
    assert sum(1 for line in lines if line.lstrip().startswith(("63 ", "0 "))) >= 2
    assert "token_wit…" in text  # long tokens truncated
    assert "columns: key j is the token of row j" in text


@pytest.mark.parametrize(
    "no_colour",
    [
        {"color_system": None},  # a pipe or a log
        {"color_system": "truecolor", "force_terminal": True, "no_color": True},  # NO_COLOR=1
    ],
)
def test_heatmap_without_colour_draws_block_characters(no_colour):
    # Without colour the ramp turns into characters, full block = the maximum: NO_COLOR in a
    # terminal too, where rich drops the background colours that would draw the cells.
    console = Console(record=True, width=120, **no_colour)
    console.print(heatmap(["a", "b"], ["a", "b"], [[1.0, 0.0], [0.25, 0.75]], "map"))
    text = console.export_text()
    assert "█" in text and "░" in text and "rows: queries, columns: keys" in text


def test_heatmap_shades_run_from_weight_0_to_the_largest_rounded_to_the_nearest_block():
    """Weight 0 is the page, the largest weight the full block, whatever the smallest weight
    is (0.3 is no blank cell); in between the nearest of the five blocks: 0.3 / 0.7 x 4 =
    1.71 -> ▒, 0.6 / 0.7 x 4 = 3.43 -> ▓, 0.4 / 0.7 x 4 = 2.29 -> ▒. Exact: no tolerance."""
    console = Console(record=True, width=120, color_system=None)
    console.print(heatmap(["a", "b"], ["a", "b"], [[0.3, 0.7], [0.6, 0.4]], "map"))
    lines = console.export_text().splitlines()
    assert lines[2] == "0 a ▒▒▒███"
    assert lines[3] == "1 b ▓▓▓▒▒▒"
    assert lines[4].split() == ["0", "░░░░▒▒▒▒▓▓▓▓██", "0.7"]  # the legend: 0 to the largest


def test_heatmap_lines_up_wide_cjk_labels():
    # A CJK character takes two terminal cells: labels are padded by cells, not characters,
    # so every header and row line has the same width and a key sits above its column.
    tokens = ["[CLS]", "我", "行", "bank", "银行银行银行银行"]
    eye = torch.eye(len(tokens)).tolist()
    lines = render(heatmap(tokens, tokens, eye, "map")).splitlines()
    grid = lines[1 : 1 + 5 + len(tokens)]  # 5 header lines ("[CLS]"), then a line per row
    assert {cell_len(line.rstrip("\n")) for line in grid} == {cell_len(grid[-1])}
    assert "银行银行…" in grid[-1]  # clipped to 10 cells, not 10 characters
    bank_column = cell_len(grid[0][: grid[0].index("b")])  # in cells, after two wide labels
    assert grid[5 + 3][bank_column : bank_column + 3] == "███"  # row "bank", key "bank"


def test_heatmap_writes_a_key_label_down_with_each_character_and_its_marks():
    # The column labels run downwards a character a line; a vowel sign (ै, ं, ा) stays on its
    # letter's line instead of standing alone on a line of its own.
    text = render(heatmap(["a", "b"], ["बैंक", "गया"], torch.eye(2), "t"))
    header = [line.split() for line in text.splitlines()[1:3]]
    assert header == [["बैं", "ग"], ["क", "या"]]
    assert "a ███" in text.splitlines()[3]  # the rows follow right after those two lines


@pytest.mark.parametrize(("sentences", "width"), [(3, 80), (5, 80), (5, 200)])
def test_comparison_prints_every_similarity_whole(sentences, width):
    """Layers as rows while the pairs fit the terminal, else pairs as rows: never a cut cell."""
    similarity = torch.rand(7, sentences, sentences, generator=torch.Generator().manual_seed(1))
    texts = [f"sentence {i} with the word" for i in range(sentences)]
    attended = [[Attended("with", 0.5, 3, repeated=False)] for _ in texts]
    console = Console(record=True, width=width, color_system=None)
    print_comparison(console, Comparison("word", texts, similarity, attended, 5), "model")
    text = console.export_text()
    assert "…" not in text
    pairs = list(combinations(range(sentences), 2))
    for layer in range(7):
        for a, b in pairs:
            assert f"{float(similarity[layer, a, b]):.3f}" in text
    layers_as_rows = len(pairs) * 11 + 9 <= width  # each pair column about 11 wide
    assert ("S1 vs S2 │" in text) != layers_as_rows  # a pair as a row's label
    lines = [line.strip() for line in text.splitlines()]  # the title whole, not wrapped
    assert "'word' across sentences (model): cosine similarity of its vectors" in lines
    assert "attends to: with 0.50" in lines  # on its own line, under its sentence


@pytest.mark.parametrize("width", [34, 40])
def test_comparison_too_wide_either_way_keeps_the_narrower_table_whole(width):
    """Three pairs fit 40 columns neither way: layers as rows, the narrower, wrap the pair
    names ("S1 vs" over "S2"), and no number is cut (pairs as rows cut all of them)."""
    similarity = torch.rand(7, 3, 3, generator=torch.Generator().manual_seed(1))
    texts = [f"sentence {i}" for i in range(3)]
    attended = [[Attended("with", 0.5, 3, repeated=False)] for _ in texts]
    console = Console(record=True, width=width, color_system=None)
    print_comparison(console, Comparison("word", texts, similarity, attended, 5), "model")
    text = console.export_text()
    assert "…" not in text and max(cell_len(line) for line in text.splitlines()) <= width
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines()]
    for layer in range(7):
        cosines = [f"{float(similarity[layer, a, b]):.3f}" for a, b in combinations(range(3), 2)]
        assert [str(layer), *cosines] in rows


def compared(attended: list[list[Attended]], occurrence: int = 0) -> str:
    similarity = torch.ones(7, 2, 2)
    texts = ["the bank by the bank", "a river bank"]
    comparison = Comparison("bank", texts, similarity, attended, 5, occurrence)
    console = Console(record=True, width=200, color_system=None)
    print_comparison(console, comparison, "model")
    return " ".join(console.export_text().split())


def test_comparison_lists_a_repeated_word_with_its_token_index():
    repeated = [
        [Attended("bank", 0.25, 5, repeated=True), Attended("the", 0.15, 1, repeated=True)],
        [Attended("river", 0.5, 2, repeated=False)],
    ]
    text = compared(repeated)
    assert "attends to: 5:bank 0.25, 1:the 0.15" in text
    assert "attends to: river 0.50" in text
    assert "n:word = the word at token n" in text
    plain = compared([[Attended("river", 0.5, 2, repeated=False)]] * 2)
    assert "n:word" not in plain and "attends to: river 0.50" in plain


def test_comparison_says_what_attends_to_leaves_out():
    # The word itself and the special tokens are not listed: the weights shown sum to less.
    text = compared([[Attended("river", 0.5, 2, repeated=False)]] * 2)
    left_out = (
        "this 'bank' itself and the special tokens left out (so the weights sum to less than 1)"
    )
    assert left_out in text


def test_comparison_says_which_occurrence_it_follows():
    attended = [[Attended("river", 0.5, 2, repeated=False)]] * 2
    assert "'bank' (--occurrence -1) across sentences" in compared(attended, occurrence=-1)
    assert "'bank' across sentences" in compared(attended)


def test_heatmap_wider_than_the_terminal_shows_the_keys_around_the_focus_and_says_so():
    # 300 keys cannot take a cell each in 80 columns: every line wrapped into four before,
    # scrambling the rows. Now each row is one line, with the keys around the query.
    tokens = [f"t{i}" for i in range(300)]
    weights = torch.eye(300)
    console = Console(record=True, width=80, color_system=None)
    console.print(heatmap(tokens, tokens, weights, "300 tokens", focus=250, more="--png too"))
    lines = console.export_text().splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    assert sum(1 for line in lines if line.lstrip().startswith(("0 t0 ", "299 t299"))) == 2
    note = next(line for line in lines if "of 300 shown" in line)
    start, stop = map(int, note.split()[1].split(".."))
    assert start <= 250 <= stop and stop - start + 1 == 80 - len("299 t299") - 1
    assert start == 250 - (stop - start + 1) // 2  # the query's key in the middle, not at an edge
    assert "around key 250" in " ".join(" ".join(lines).split())
    row = next(line for line in lines if line.startswith("250 t250"))
    assert row[len("250 t250 ") + 250 - start] == "█"  # the diagonal cell, in its column
    assert "--png too" in " ".join(lines)
    # A map that fits says nothing of the kind.
    assert "shown" not in render(heatmap(tokens[:20], tokens[:20], torch.eye(20), "fits"))


@pytest.mark.parametrize(
    "groups", [None, [("[CLS]", [0]), ("love", [1]), ("[UNK]", [2]), ("rain", [3])]]
)
def test_explain_names_unknown_tokens_on_the_heatmap_as_the_step_table_does(groups):
    # MiniLM reads 🙂 as [UNK]: the heatmap labelled its row and column "[UNK]", which every
    # unknown character shares, while the lists of keys and the figure call it '🙂' ([UNK]).
    tokens = ["[CLS]", "love", "[UNK]", "rain"]
    e = Explanation(
        model="m", text="love 🙂 rain", tokens=tokens, layer=0, head=None, choice="as asked",
        query=None, attention=torch.full((4, 4), 0.25), steps=None, recorded_output=None,
        alternative=None, groups=groups, query_word=None, causal=False,
        masked=torch.zeros(4, 4, dtype=torch.bool), hidden={2: "🙂"},
    )  # fmt: skip
    console = Console(record=True, width=120, color_system=None)
    print_explanation(console, e)
    lines = console.export_text().splitlines()
    assert "2 '🙂' ([UN… ████████████" in lines  # its row, named as in the table, cut to 10 cells


# An OSC 52 clipboard write, a colour and a bidi override, as a copied text may hold them.
HOSTILE = "bank \x1b]52;c;cHduZWQ=\x07 \x1b[41mRED \u202egnp.exe money"
WRITTEN = "bank \\x1b]52;c;cHduZWQ=\\x07 \\x1b[41mRED \\u202egnp.exe money"


def test_printable_writes_out_control_characters_and_bidi_overrides():
    assert printable(HOSTILE) == WRITTEN
    assert printable("a\nb\tc\rd") == "a↵b⇥c\\x0dd"
    assert printable("a\nb\tc", keep="\n\t") == "a\nb\tc"
    assert printable("\x9b2J \u2066x\u2069 ок 🙂 \u200d") == "\\x9b2J \\u2066x\\u2069 ок 🙂 \u200d"


def test_no_control_character_of_a_text_reaches_the_terminal():
    # Text copied from elsewhere could recolour, clear or retitle the terminal, or write to
    # its clipboard: the header, a character model's tokens (here ESC and the override), the
    # keys, the map and a comparison's sentences write each such character out instead.
    tokens = ["b", "\x1b", "[", "2", "J", "\u202e"]
    e = Explanation(
        model="m", text=HOSTILE, tokens=tokens, layer=0, head=None, choice="as asked",
        query=1, attention=torch.full((6, 6), 1 / 6), steps=None, recorded_output=None,
        alternative=None, groups=None, query_word=None, causal=False,
        masked=torch.zeros(6, 6, dtype=torch.bool),
    )  # fmt: skip
    console = Console(record=True, width=200, color_system=None)
    print_explanation(console, e)
    explained = console.export_text()
    assert WRITTEN in explained and "1:\\x1b" in explained and "5:\\u202e" in explained
    texts = [HOSTILE, "a river bank"]
    attended = [[Attended("\x1b[2J", 0.5, 3, repeated=False)]] * 2
    comparison = Comparison("bank\x1b[0m", texts, torch.ones(7, 2, 2), attended, 5)
    console = Console(record=True, width=200, color_system=None)
    print_comparison(console, comparison, "m")
    compared = console.export_text()
    assert WRITTEN in compared and "attends to: \\x1b[2J 0.50" in compared
    assert "'bank\\x1b[0m' across sentences" in compared
    for printed in (explained, compared):
        assert not any(char in printed for char in "\x1b\x07\u202e"), printed
