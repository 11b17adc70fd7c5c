"""Figures render headless and save as PNG or SVG by suffix."""

import logging
import warnings

import PIL.Image
import pytest
import torch
from matplotlib import font_manager
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from selfattn.viz import figures
from selfattn.viz.figures import PIN, heatmap_figure, save_figure

TOKENS = ["Ciao", "gioco", "a", "giochi"]
WEIGHTS = torch.softmax(torch.arange(16.0).reshape(4, 4) / 5, dim=-1)


@pytest.fixture(autouse=True)
def closed_figures():
    """Each test's figures are closed after it (pyplot keeps them all until then)."""
    yield
    figures.plt.close("all")


def figure_texts(fig) -> list[str]:
    return [text.get_text() for text in fig.findobj(lambda artist: hasattr(artist, "get_text"))]


def test_heatmap_figure_names_axes_tokens_and_convention():
    fig = heatmap_figure(WEIGHTS, TOKENS, TOKENS, "layer 1, head 2")
    texts = figure_texts(fig)
    for expected in ("layer 1, head 2", "keys (columns)", "queries (rows)", "giochi", "weight"):
        assert expected in texts
    assert "rows: queries, columns: keys" in texts
    assert len(fig.axes) == 2  # the map and its colour bar


def test_heatmap_figure_puts_queries_on_the_rows_and_keys_on_the_columns():
    """A map of 2 queries over 4 keys: the y axis is named for the queries and labelled with
    them, the x axis for the keys; cell (i, j) is query i's weight on key j, as given."""
    weights = WEIGHTS[2:]  # (2 queries, 4 keys)
    fig = heatmap_figure(weights, ["q0", "q1"], TOKENS, "2 x 4")
    ax = fig.axes[0]
    assert (ax.get_ylabel(), ax.get_xlabel()) == ("queries (rows)", "keys (columns)")
    assert [label.get_text() for label in ax.get_yticklabels()] == ["q0", "q1"]
    assert [label.get_text() for label in ax.get_xticklabels()] == TOKENS
    (image,) = ax.get_images()
    assert image.get_array().shape == (2, 4)
    assert (image.get_array() == weights.numpy()).all()


def test_heatmap_figure_outlines_the_query_row_as_the_page_does():
    fig = heatmap_figure(WEIGHTS, TOKENS, TOKENS, "gioco", query_row=1)
    (outline,) = [patch for patch in fig.axes[0].patches if isinstance(patch, Rectangle)]
    assert outline.get_xy() == (-0.5, 0.5)  # around row 1, whose cells span 0.5..1.5
    assert (outline.get_width(), outline.get_height()) == (4, 1)  # every key
    assert not outline.get_fill() and outline.get_edgecolor() == to_rgba(PIN)
    assert not heatmap_figure(WEIGHTS, TOKENS, TOKENS, "no query").axes[0].patches


def test_heatmap_figure_refuses_mismatched_labels():
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        heatmap_figure(WEIGHTS, TOKENS[:3], TOKENS, "x")


@pytest.mark.parametrize("query_row", [4, 99, -1, True])
def test_heatmap_figure_refuses_a_query_row_outside_the_map(query_row):
    # 99 outlined a rectangle at y = 98.5, off the map, and -1 one at y = -1.5
    with pytest.raises(ValueError, match=rf"query_row {query_row!r} is out of range: rows 0\.\.3"):
        heatmap_figure(WEIGHTS, TOKENS, TOKENS, "x", query_row=query_row)


def test_save_png_and_svg(tmp_path):
    fig = heatmap_figure(WEIGHTS, TOKENS, TOKENS, "x")
    png = save_figure(fig, tmp_path / "map.png")
    svg = save_figure(fig, tmp_path / "map.SVG")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in svg.read_text()
    with PIL.Image.open(png) as image:  # 200 dpi, as the docs say (paper-ready)
        assert [round(dpi) for dpi in image.info["dpi"]] == [200, 200]


def test_save_refuses_other_suffixes(tmp_path):
    fig = heatmap_figure(WEIGHTS, TOKENS, TOKENS, "x")
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        save_figure(fig, tmp_path / "map.pdf")
    assert not (tmp_path / "map.pdf").exists()


def saved_with_warnings(fig, path) -> list[str]:
    """The messages of every warning that saving ``fig`` as ``path`` gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ResourceWarning)  # other tests' objects collected now
        save_figure(fig, path)
    return [str(warning.message) for warning in caught]


@pytest.fixture
def only_dejavu(monkeypatch):
    """Only DejaVu Sans installed, as on a bare Debian: no font has Chinese characters."""
    dejavu = [font for font in font_manager.fontManager.ttflist if font.name == "DejaVu Sans"]
    monkeypatch.setattr(font_manager.fontManager, "ttflist", dejavu)


def drawn_with_warnings(tokens, title) -> tuple[Figure, list[str]]:
    """A heatmap of ``tokens`` and the messages of the warnings drawing it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ResourceWarning)  # other tests' objects collected now
        fig = heatmap_figure(torch.eye(len(tokens)), tokens, tokens, title)
    return fig, [str(warning.message) for warning in caught]


def test_characters_no_font_has_are_their_code_points(tmp_path, only_dejavu, caplog):
    """Labels and title: 🙂 and 我喜欢 (not in DejaVu Sans) are U+ code points, one stand-in
    per character, named in one warning with the packages that draw them, instead of boxes
    and one matplotlib warning per glyph; what DejaVu Sans has (accents, Greek, the space
    sign) stays. Saving warns and logs nothing: no glyph is missing."""
    tokens = ["[CLS]", "🙂", "a🙂b", "我喜欢", "Café", "Ωμέγα", "␣", "[SEP]"]
    shown = ["[CLS]", "U+1F642", "aU+1F642b", "U+6211 U+559C U+6B22", *tokens[4:]]
    fig, (message,) = drawn_with_warnings(tokens, "我 🙂")
    assert message == (
        "no installed font has 喜 (U+559C) 我 (U+6211) 欢 (U+6B22) 🙂 (U+1F642): the figure "
        "shows their code points; install fonts that have them (Debian, Ubuntu: apt install "
        "fonts-noto-cjk fonts-symbola)"
    )
    axes = fig.axes[0]
    assert [label.get_text() for label in axes.get_yticklabels()] == shown
    assert [label.get_text() for label in axes.get_xticklabels()] == shown
    assert axes.get_title() == "U+6211 U+1F642"
    for name in ("emoji.png", "emoji.svg"):
        assert saved_with_warnings(fig, tmp_path / name) == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_no_package_is_named_when_its_fonts_are_installed(only_dejavu, monkeypatch):
    monkeypatch.setitem(figures.FONT_PACKAGES, "fonts-noto-cjk", "DejaVu Sans")  # "installed"
    _, messages = drawn_with_warnings(["我"], "one token")
    assert messages == ["no installed font has 我 (U+6211): the figure shows their code points"]


def test_the_note_names_only_characters_of_the_labels_drawn(only_dejavu):
    """Past 64 tokens every n-th is labelled: a 🙂 among the others is not drawn, and the
    note said it was; it names what the figure shows only."""
    tokens = ["x", "🙂", *["y"] * 128]
    fig, messages = drawn_with_warnings(tokens, "long")
    shown = [label.get_text() for label in fig.axes[0].get_yticklabels()]
    assert len(shown) < len(tokens) and "U+1F642" not in shown and messages == []
    _, messages = drawn_with_warnings(["🙂", *["y"] * 129], "long")  # token 0 is labelled
    assert [message.split(":")[0] for message in messages] == ["no installed font has 🙂 (U+1F642)"]


def test_a_fallback_font_draws_what_the_first_font_lacks(tmp_path, monkeypatch):
    # U+231A WATCH: not in DejaVu Sans, in STIXGeneral (which matplotlib ships): drawn as is.
    monkeypatch.setattr(figures, "FALLBACK_FONTS", ("STIXGeneral",))
    fig, messages = drawn_with_warnings(["⌚", "time"], "⌚")
    assert messages == []
    assert [label.get_text() for label in fig.axes[0].get_yticklabels()] == ["⌚", "time"]
    assert saved_with_warnings(fig, tmp_path / "watch.svg") == []


def test_dollar_signs_in_tokens_are_text_not_mathtext(tmp_path):
    tokens = ["$$", "$x^2$", "a_b"]  # GPT-2 has a "$$" token; mathtext fails to parse it
    fig = heatmap_figure(torch.eye(3), tokens, tokens, "$x$")
    save_figure(fig, tmp_path / "dollars.png")
    assert [label.get_text() for label in fig.axes[0].get_yticklabels()] == tokens


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_the_same_figure_gives_the_same_bytes(tmp_path, suffix):
    paths = [tmp_path / f"{name}{suffix}" for name in ("first", "second")]
    for path in paths:
        save_figure(heatmap_figure(WEIGHTS, TOKENS, TOKENS, "x", query_row=1), path)
    first, second = (path.read_bytes() for path in paths)
    assert first == second  # an SVG carries no date, and its ids are not random


def test_thinned_labels_keep_the_query_rows_label():
    tokens = [f"t{i}" for i in range(130)]  # over MAX_TICK_LABELS: every 3rd token labelled
    fig = heatmap_figure(torch.eye(130), tokens, tokens, "long", query_row=52)
    rows = [label.get_text() for label in fig.axes[0].get_yticklabels()]
    assert rows[:3] == ["1 t1", "4 t4", "7 t7"] and "52 t52" in rows  # spaced through the query
    assert len(rows) <= figures.MAX_TICK_LABELS


def test_thinned_labels_say_which_token_each_is():
    """Every 2nd of 101 tokens labelled, as bare words, read as a sentence with words
    missing, and "the" twice could be either; the index says which token a label is."""
    tokens = ["the", ","] * 50 + ["tides"]
    fig = heatmap_figure(torch.eye(101), tokens, tokens, "long")
    axes = fig.axes[0]
    for labels in (axes.get_yticklabels(), axes.get_xticklabels()):
        assert [label.get_text() for label in labels][:3] == ["0 the", "2 the", "4 the"]


def map_width(tokens) -> float:
    """The drawn width of a heatmap of ``tokens``, in pixels."""
    fig = heatmap_figure(torch.eye(len(tokens)), tokens, tokens, "x")
    fig.canvas.draw()  # constrained layout places the map as it draws
    return fig.axes[0].get_window_extent().width


def test_a_long_word_is_clipped_and_does_not_shrink_the_map():
    """A 45-letter word was drawn whole on both axes, and the layout shrank the 3x3 map to
    a sixth of the figure to make room; it is cut as the terminal and the page cut it."""
    word = "Pneumonoultramicroscopicsilicovolcanoconiosis"
    fig = heatmap_figure(torch.eye(3), ["[CLS]", word, "[SEP]"], ["[CLS]", word, "[SEP]"], "x")
    axes = fig.axes[0]
    for labels in (axes.get_yticklabels(), axes.get_xticklabels()):
        assert labels[1].get_text() == word[: figures.LABEL_CHARS - 1] + "…"
    assert map_width(["[CLS]", word, "[SEP]"]) > 2 / 3 * map_width(["[CLS]", "lung", "[SEP]"])


def test_a_clipped_label_keeps_each_letter_with_its_marks():
    long_word = "a" * 14 + "e\u0301t"  # the cut falls between "e" and its accent
    fig = heatmap_figure(torch.eye(1), [long_word], [long_word], "x")
    assert fig.axes[0].get_yticklabels()[0].get_text() == "a" * 14 + "…"
