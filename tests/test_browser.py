"""The HTML explorer in headless chromium: numbers agree with selfattn.attention, nothing is
fetched, no console errors, user text stays text, and a 512-token page draws.

Tolerance: 1e-6 absolute; the page computes in float64 from the float32 q, k, v that the
reference computes with in float32.
"""

import math
import re
import time
from pathlib import Path

import pytest
import torch

from conftest import OfflinePage, needs_chromium
from selfattn import attention
from selfattn.attention import default_scale
from selfattn.viz import html
from selfattn.viz.html import page_payload, render_page

pytestmark = needs_chromium

XSS = "<img src=x onerror=alert(1)>"
TOKENS = ["Ciao", "gioco", XSS, "a", "</script>", "giochi"]
L, H, T, D = 2, 3, 6, 4
TOL = 1e-6


def qkv(shape=(L, H, T, D), seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) for _ in range(3))


def write_page(
    tmp_path, similarity="dot", causal=False, tokens=TOKENS, scale=None, names=None, note=None,
    windows=(), bias=None, **selection,
) -> tuple[Path, tuple]:  # fmt: skip
    q, k, v = qkv(shape=(L, H, len(tokens), D))
    data = page_payload(
        tokens=tokens,
        query=q,
        key=k,
        value=v,
        scale=default_scale(similarity, D) if scale is None else scale,
        similarity=similarity,
        model_name="random q/k/v",
        text=" ".join(tokens),
        layer=selection.get("layer", 1),
        head=selection.get("head", 2),
        query_index=selection.get("query_index"),
        causal=causal,
        windows=windows,
        names=names,
        note=note,
        bias=bias,
    )
    path = tmp_path / f"page-{similarity}-{causal}.html"
    path.write_text(render_page(data), encoding="utf-8")
    return path, (q, k, v)


def reference(q, k, v, layer, head, similarity="dot", causal=False, mask=None):
    _, trace = attention(
        q[layer, head],
        k[layer, head],
        v[layer, head],
        mask=mask,
        similarity=similarity,
        causal=causal,
        backend="explicit",
        return_trace=True,
    )
    return trace


def step_headers(watched) -> list[str]:
    return watched.page.eval_on_selector_all(
        "#steps th", "(ths) => ths.map((th) => th.textContent)"
    )


def step_biases(watched) -> list[float]:
    """The "+ bias" column of the step panel, by key."""
    return watched.page.evaluate(
        """() => [...document.querySelectorAll('#steps tbody tr')]
            .sort((a, b) => a.dataset.key - b.dataset.key)
            .map((tr) => +tr.querySelector('[data-bias]').dataset.bias)"""
    )


def assert_row_matches(watched, trace, i):
    rows = sorted(watched.step_rows(), key=lambda r: r["key"])
    assert [r["key"] for r in rows] == list(range(trace.weights.shape[-1]))
    for j, row in enumerate(rows):
        assert math.isclose(float(row["score"]), trace.scores[i, j].item(), abs_tol=TOL)
        assert math.isclose(float(row["scaled"]), trace.scaled[i, j].item(), abs_tol=TOL)
        assert math.isclose(float(row["weight"]), trace.weights[i, j].item(), abs_tol=TOL)
    assert watched.output() == pytest.approx(trace.output[i].tolist(), abs=TOL)
    self_weight = watched.page.get_attribute("#self-weight", "data-value")
    assert math.isclose(float(self_weight), trace.weights[i, i].item(), abs_tol=TOL)


@pytest.mark.parametrize(
    ("similarity", "causal"), [("dot", False), ("cosine", False), ("dot", True)]
)
def test_clicking_a_token_shows_its_row_as_python_computes_it(
    browser, tmp_path, similarity, causal
):
    path, (q, k, v) = write_page(tmp_path, similarity, causal)
    watched = OfflinePage(browser, path)
    trace = reference(q, k, v, 1, 2, similarity, causal)
    for i in (0, 3, 5):
        watched.page.click(f".token[data-index='{i}']")
        assert watched.page.get_attribute(f".token[data-index='{i}']", "class") == "token selected"
        assert_row_matches(watched, trace, i)
    assert step_headers(watched) == ["key", "score", "scaled", "weight"]  # no bias, no column
    assert "bias" not in watched.page.text_content("#app")
    watched.check_clean()


def random_bias(shape) -> torch.Tensor:
    """A float bias to add to the scaled scores, large enough to move the weights."""
    return 3 * torch.randn(*shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("per_layer", [False, True])
def test_a_bias_is_added_to_the_scaled_scores_of_each_head_and_the_mean(
    browser, tmp_path, per_layer
):
    """A bias (MPNet's position bias: one (H, T, T) for every layer, or one per layer), with
    a causal mask: each head's row is attention() with the bias as its float mask, the step
    panel shows it in a "+ bias" column, and the mean of heads averages the biased heads."""
    added = random_bias((L, H, T, T) if per_layer else (H, T, T))
    path, (q, k, v) = write_page(tmp_path, causal=True, bias=added)
    watched = OfflinePage(browser, path)
    assert step_headers(watched) == ["key", "score", "scaled", "+ bias", "weight"]
    for layer, head in ((1, 2), (0, 1)):
        watched.page.select_option("#layer", str(layer))
        watched.page.select_option("#head", str(head))
        layer_bias = added[layer] if per_layer else added
        trace = reference(q, k, v, layer, head, causal=True, mask=layer_bias[head])
        for i in (0, 3, 5):
            watched.page.click(f".token[data-index='{i}']")
            assert_row_matches(watched, trace, i)
            assert step_biases(watched) == pytest.approx(layer_bias[head, i].tolist(), abs=TOL)
    watched.page.select_option("#head", "mean")
    layer_bias = added[0] if per_layer else added
    mean = reference(q, k, v, 0, slice(None), causal=True, mask=layer_bias).weights.mean(0)
    rows = sorted(watched.step_rows(), key=lambda row: row["key"])
    assert [row["weight"] for row in rows] == pytest.approx(mean[5].tolist(), abs=TOL)
    watched.check_clean()


def test_top_keys_name_a_repeated_token_by_its_index(browser, tmp_path):
    tokens = ["the", "cat", "sat", "the", "mat", "."]
    path, _ = write_page(tmp_path, tokens=tokens)
    watched = OfflinePage(browser, path)
    watched.page.click(".token[data-index='1']")
    shown = watched.page.eval_on_selector_all(
        ".top-keys li", "(items) => items.map((li) => [+li.dataset.key, li.firstChild.textContent])"
    )
    assert sorted(key for key, _ in shown) == list(range(T))  # every key of 6 listed
    for key, name in shown:
        assert name == (f"{key}:the" if tokens[key] == "the" else tokens[key])
    watched.check_clean()


def test_the_lists_of_keys_name_each_key_as_the_payload_names_it(browser, tmp_path):
    # Two unknown tokens, named by the texts they stand for (as Python's lists and the command
    # line's table of steps name them): two names, so neither needs its token index.
    tokens = ["i", "love", "[UNK]", "and", "[UNK]", "bank"]
    names = ["i", "love", "'🙂' ([UNK])", "and", "'🍕' ([UNK])", "bank"]
    path, _ = write_page(tmp_path, tokens=tokens, names=names)
    watched = OfflinePage(browser, path)
    watched.page.click(".token[data-index='5']")
    shown = watched.page.eval_on_selector_all(
        ".top-keys li", "(items) => items.map((li) => [+li.dataset.key, li.firstChild.textContent])"
    )
    assert sorted(shown) == [[key, name] for key, name in enumerate(names)]
    steps = watched.page.eval_on_selector_all(
        "#steps td.key", "(cells) => cells.map((c) => c.textContent)"
    )
    assert steps == [f"{key} {name}" for key, name in enumerate(names)]
    assert watched.page.text_content(".token[data-index='2']") == "[UNK]"  # tokens stay as read
    watched.check_clean()


def test_the_note_on_the_first_query_shows_while_it_is_the_query(browser, tmp_path):
    note = "first token of 'river bank', 2 words to the model at tokens 3..4"
    path, _ = write_page(tmp_path, query_index=3, note=note)
    watched = OfflinePage(browser, path)
    assert watched.page.is_visible("#query-note")
    assert watched.page.text_content("#query-note") == note
    watched.page.click(".token[data-index='1']")
    assert watched.page.is_hidden("#query-note")  # the note is about token 3, not this one
    watched.page.click(".token[data-index='3']")
    assert watched.page.is_visible("#query-note")
    plain, _ = write_page(tmp_path, query_index=3)  # the same file, now without a note
    assert OfflinePage(browser, plain).page.is_hidden("#query-note")  # no note, no line
    watched.check_clean()


def test_the_maps_labels_are_cut_between_letters_not_inside_one(browser, tmp_path):
    """A label of more than 10 letters is cut to 9 and "…": a letter keeps its combining mark
    and an emoji stays whole (two UTF-16 units), where cutting 9 units split them."""
    marked, emoji = "abcdefghe\u0301xyz", "12345678🙂🙂🙂"
    path, _ = write_page(tmp_path, tokens=[*TOKENS, marked, emoji])
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.add_init_script(
        """window.drawn = [];
        const fillText = CanvasRenderingContext2D.prototype.fillText;
        CanvasRenderingContext2D.prototype.fillText = function (text, ...rest) {
            window.drawn.push(String(text));
            return fillText.call(this, text, ...rest);
        };"""
    )
    page.goto(path.as_uri())
    page.wait_for_selector("#app[data-ready='true']", timeout=30_000)
    drawn = page.evaluate("() => window.drawn")
    assert "abcdefghe\u0301…" in drawn and "12345678🙂…" in drawn, drawn
    page.close()


def test_layer_and_head_selectors_update_the_step_panel(browser, tmp_path):
    path, (q, k, v) = write_page(tmp_path, query_index=4)
    watched = OfflinePage(browser, path)
    assert_row_matches(watched, reference(q, k, v, 1, 2), 4)
    watched.page.select_option("#layer", "0")
    watched.page.select_option("#head", "1")
    assert_row_matches(watched, reference(q, k, v, 0, 1), 4)
    assert "layer=0&head=1&query=4" in watched.page.url

    watched.page.select_option("#head", "mean")
    mean = torch.stack([reference(q, k, v, 0, h).weights[4] for h in range(H)]).mean(0)
    weights = [float(r["weight"]) for r in sorted(watched.step_rows(), key=lambda r: r["key"])]
    assert weights == pytest.approx(mean.tolist(), abs=TOL)

    watched.page.click(".thumb[data-layer='1'][data-head='0']")
    assert watched.page.input_value("#layer") == "1" and watched.page.input_value("#head") == "0"
    assert_row_matches(watched, reference(q, k, v, 1, 0), 4)
    watched.check_clean()


def test_url_hash_chooses_the_first_selection(browser, tmp_path):
    path, (q, k, v) = write_page(tmp_path)
    watched = OfflinePage(browser, path, "#layer=0&head=1&query=2")
    assert watched.page.input_value("#layer") == "0" and watched.page.input_value("#head") == "1"
    assert_row_matches(watched, reference(q, k, v, 0, 1), 2)
    watched.check_clean()


@pytest.mark.parametrize(
    ("fragment", "shown", "notice"),
    [
        (
            "#layer=9&head=x",
            ("1", "0"),
            "The address's layer=9 and head=x are not on this page (layers 0..1, heads 0..2 or "
            "mean): showing layer 1, head 0.",
        ),
        (
            "#layer=0&head=mean&query=abc",
            ("0", "mean"),
            "The address's query=abc is not on this page (tokens 0..5): showing query 0.",
        ),
        ("#layer=0&head=mean&query=5", ("0", "mean"), None),
    ],
)
def test_a_hash_the_page_cannot_show_is_said_in_one_line(
    browser, tmp_path, fragment, shown, notice
):
    path, _ = write_page(tmp_path)
    watched = OfflinePage(browser, path, fragment)
    page = watched.page
    assert (page.input_value("#layer"), page.input_value("#head")) == shown
    said = page.text_content("#hash-notice") if page.is_visible("#hash-notice") else None
    assert said == notice
    page.evaluate("location.hash = '#layer=0&head=7'")  # typed into the address bar
    page.wait_for_function("() => location.hash.includes('head=2')")
    assert page.text_content("#hash-notice") == (
        "The address's head=7 is not on this page (heads 0..2 or mean): showing head 2."
    )
    page.select_option("#layer", "1")  # the address holds what is shown again
    assert not page.is_visible("#hash-notice")
    watched.check_clean()


def test_control_characters_and_bidi_overrides_are_written_out_as_the_terminal_does(
    browser, tmp_path
):
    # U+202E turned "bank gnp.exe money" into "bank yenom exe.png" in the text line; a C1
    # character and ESC showed as nothing. Tokens and text now write them out (\u202e,
    # \x9b), as the command line prints them; line breaks in the text stay line breaks.
    tokens = ["bank", "\u202egnp.exe", "\x1b[41m", "\x9b", "money\n"]
    path, _ = write_page(tmp_path, tokens=tokens)
    watched = OfflinePage(browser, path)
    page = watched.page
    shown = page.eval_on_selector_all(
        ".token[data-index]", "(els) => els.map((e) => e.textContent)"
    )
    assert shown == ["bank", "\\u202egnp.exe", "\\x1b[41m", "\\x9b", "money↵"]
    assert page.text_content("#text") == "bank \\u202egnp.exe \\x1b[41m \\x9b money\n"
    watched.check_clean()


def test_user_text_shows_as_text(browser, tmp_path):
    path, _ = write_page(tmp_path)
    watched = OfflinePage(browser, path)
    page = watched.page
    assert page.locator("img").count() == 0
    assert page.text_content(".token[data-index='2']") == XSS
    assert page.text_content(".token[data-index='4']") == "</script>"
    assert page.text_content("#text") == " ".join(TOKENS)
    page.hover(".token[data-index='2']")
    assert XSS in page.text_content("#row-summary")
    page.screenshot(path=tmp_path / "page.png", full_page=True)
    watched.check_clean()


def test_a_512_token_page_loads_and_draws(browser, tmp_path):
    n = 512
    q, k, v = qkv(shape=(2, 4, n, 16), seed=1)
    data = page_payload(
        tokens=[f"tok{i}" for i in range(n)],
        query=q,
        key=k,
        value=v,
        scale=0.25,
        similarity="dot",
        model_name="long",
        text="long text",
        layer=1,
        head=3,
        query_index=300,
    )
    path = tmp_path / "long.html"
    path.write_text(render_page(data), encoding="utf-8")
    start = time.perf_counter()
    watched = OfflinePage(browser, path)
    assert time.perf_counter() - start < 20
    colours = watched.page.evaluate(
        """() => {
            const canvas = document.getElementById('heatmap');
            const ctx = canvas.getContext('2d');
            const { data } = ctx.getImageData(0, 0, canvas.width, canvas.height);
            const seen = new Set();
            for (let p = 0; p < data.length; p += 4 * 97) {
                seen.add(data[p] * 65536 + data[p + 1] * 256 + data[p + 2]);
            }
            return { width: canvas.width, colours: seen.size };
        }"""
    )
    assert colours["width"] >= 3 * n and colours["colours"] > 10
    assert watched.page.locator(".token").count() == n
    assert watched.page.locator("#steps tbody tr").count() == n
    assert watched.page.get_attribute("#leftover", "data-mass") is not None  # top-k + the rest
    watched.check_clean()


def test_float16_payloads_decode_to_the_same_numbers(browser, tmp_path, monkeypatch):
    monkeypatch.setattr(html, "FLOAT32_LIMIT_BYTES", 0)
    path, (q, k, v) = write_page(tmp_path, query_index=1)
    watched = OfflinePage(browser, path)
    halves = [x.half().float() for x in (q, k, v)]  # what float16 on the wire carries exactly
    assert_row_matches(watched, reference(*halves, 1, 2), 1)
    assert "came as float16" in watched.page.text_content("#step-note")  # not Python's digits
    watched.check_clean()


def test_a_float16_bias_decodes_to_the_same_numbers(browser, tmp_path, monkeypatch):
    monkeypatch.setattr(html, "FLOAT32_LIMIT_BYTES", 0)
    added = random_bias((H, T, T))
    path, (q, k, v) = write_page(tmp_path, query_index=1, bias=added)
    watched = OfflinePage(browser, path)
    halves = [x.half().float() for x in (q, k, v, added)]  # what float16 on the wire carries
    assert_row_matches(watched, reference(*halves[:3], 1, 2, mask=halves[3][2]), 1)
    assert step_biases(watched) == halves[3][2, 1].tolist()
    assert "q, k, v and the bias came as float16" in watched.page.text_content("#step-note")
    watched.check_clean()


def test_a_tiny_scale_reads_as_itself_not_as_zero(browser, tmp_path):
    path, _ = write_page(tmp_path, scale=1e-30)
    watched = OfflinePage(browser, path)
    assert "scale 1.000e-30" in watched.page.text_content(".meta")
    assert "score × 1.000e-30" in watched.page.text_content("#step-note")
    assert "came as float16" not in watched.page.text_content("#step-note")
    # the list of steps too (it said "score × 0.000", and 0.1768 where the rest say 0.17678)
    assert "score × 1.000e-30 so no single score swamps" in watched.page.text_content("body")
    watched.check_clean()


def test_a_narrow_window_does_not_scroll_sideways(browser, tmp_path):
    path, _ = write_page(tmp_path)
    watched = OfflinePage(browser, path)
    watched.page.set_viewport_size({"width": 400, "height": 800})
    watched.page.reload()  # laid out narrow from the start, as on a phone
    watched.page.wait_for_selector("#app[data-ready='true']", timeout=30_000)
    assert watched.page.evaluate("document.documentElement.scrollWidth") <= 400
    watched.check_clean()


@pytest.mark.parametrize("biased", [False, True])
def test_a_phone_shows_the_step_tables_weights_whole(browser, tmp_path, biased):
    """At 375 px the step table was wider than its box, its weight column (the answer) cut
    at "0.08", with no sign that the table scrolled sideways; MPNet's "+ bias" column made it
    so again."""
    tokens = ["[CLS]", "i", "went", "to", "the", "bank", "to", "deposit", "money", ".", "[SEP]"]
    bias = random_bias((H, len(tokens), len(tokens))) if biased else None
    path, _ = write_page(tmp_path, tokens=tokens, bias=bias)
    watched = OfflinePage(browser, path)
    watched.page.set_viewport_size({"width": 375, "height": 800})
    cut = watched.page.evaluate(
        """() => {
            const box = document.querySelector('.steps-scroll').getBoundingClientRect();
            return [...document.querySelectorAll('#steps th, #steps td')]
                .filter((cell) => cell.getBoundingClientRect().right > box.right + 0.5)
                .map((cell) => cell.textContent);
        }"""
    )
    assert cut == []
    watched.check_clean()


INKED_TOKENS = """(query) => {
    const canvas = document.getElementById('lines');
    const box = canvas.getBoundingClientRect();
    const ink = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
    const inked = (x, y) => ink[4 * (y * canvas.width + x) + 3] > 0;
    const keys = [...document.querySelectorAll('.top-keys li')].map((li) => +li.dataset.key);
    return [...document.querySelectorAll('.token')].filter((token, j) => {
        if (j === query || keys.includes(j)) return false;
        const r = token.getBoundingClientRect();
        for (let y = Math.ceil(r.top - box.top); y < r.bottom - box.top; y++) {
            for (let x = Math.ceil(r.left - box.left); x < r.right - box.left; x++) {
                if (inked(x, y)) return true;
            }
        }
        return false;
    }).map((token) => token.textContent);
}"""


def test_the_strips_lines_cross_no_token_of_a_wrapped_text(browser, tmp_path):
    """The curves ran from the query's top to each key's, over any line of tokens between
    them, and high arcs on one line over the line above: lines crossed the text. Only the
    query and its keys may have ink of the lines on them."""
    path, _ = write_page(tmp_path, tokens=[f"word{i}" for i in range(90)])
    watched = OfflinePage(browser, path)
    page = watched.page
    lines = "(tokens) => new Set(tokens.map((t) => t.getBoundingClientRect().top)).size"
    assert page.eval_on_selector_all(".token", lines) >= 3  # wrapped
    for query in (30, 50, 70):  # keys on its line, on others, and itself
        page.click(f".token[data-index='{query}']")
        assert page.evaluate(INKED_TOKENS, query) == []
    watched.check_clean()


MAP_FITS_ITS_BOX = """() => {
    const box = document.querySelector('.map-scroll').getBoundingClientRect();
    const map = document.getElementById('heatmap').getBoundingClientRect();
    return map.width > 0 && map.right <= box.right;
}"""


@pytest.mark.parametrize(("n", "narrow"), [(11, 375), (23, 375), (101, 600)])
def test_the_whole_map_fits_its_box_wide_and_narrow(browser, tmp_path, n, narrow):
    """The map's cells took 640 px whatever the window, and its label margins more: its last
    keys were cut off behind a scroll bar, even at 1400 px. It fits its box, and fits it
    again when the window narrows (at a phone's 375 px, 3 px cells fit some 80 tokens);
    a click on its last cell then picks that row."""
    path, _ = write_page(tmp_path, tokens=[f"tok{i}" for i in range(n)])
    watched = OfflinePage(browser, path)
    page = watched.page
    assert page.evaluate(MAP_FITS_ITS_BOX)
    page.set_viewport_size({"width": narrow, "height": 800})
    page.wait_for_function(MAP_FITS_ITS_BOX, timeout=5_000)
    side = page.evaluate("document.getElementById('heatmap').getBoundingClientRect().height")
    page.click("#heatmap", position={"x": side - 2, "y": side - 2})  # the cells end at its foot
    assert page.get_attribute(".token.selected", "data-index") == str(n - 1)
    watched.check_clean()


def focused(page) -> str:
    """What has the keyboard focus: a token's index, the map, a thumbnail's layer/head, or an
    element's id, class or tag."""
    return page.evaluate(
        """() => {
            const e = document.activeElement;
            if (e.matches('.token')) return 'token ' + e.dataset.index;
            if (e.matches('.thumb')) return `thumb ${e.dataset.layer}/${e.dataset.head}`;
            return e.id || e.className || e.tagName;
        }"""
    )


def test_keyboard_alone_reaches_and_moves_tokens_map_and_model_view(browser, tmp_path):
    tokens = [f"w{i}" for i in range(40)]
    path, (q, k, v) = write_page(tmp_path, tokens=tokens, query_index=3)
    watched = OfflinePage(browser, path)
    page = watched.page
    stops = []
    for _ in range(8):  # the 40 tokens are one Tab stop, not 40: the map comes right after
        page.keyboard.press("Tab")
        stops.append(focused(page))
    # the text and the step table's box scroll: Tab reaches them, to scroll them by keyboard
    assert stops == [
        "text", "layer", "head", "shade-by", "token 3", "heatmap", "sort-weight", "steps-scroll"
    ]  # fmt: skip

    page.focus(".token[data-index='3']")
    for key, query in (("ArrowRight", 4), ("End", 39), ("Home", 0), ("ArrowLeft", 0)):
        page.keyboard.press(key)
        assert focused(page) == f"token {query}"  # focus follows the selection
        assert page.get_attribute(f".token[data-index='{query}']", "aria-selected") == "true"
    page.locator(".token[data-index='7']").focus()
    scrolled = page.evaluate("scrollY")
    page.keyboard.press(" ")  # picks the token; the page does not scroll down
    assert page.evaluate("scrollY") == scrolled and focused(page) == "token 7"
    assert_row_matches(watched, reference(q, k, v, 1, 2), 7)

    page.focus("#heatmap")
    page.keyboard.press("ArrowDown")
    assert focused(page) == "heatmap" and page.get_attribute(".token.selected", "data-index") == "8"

    page.focus(".thumb[aria-checked='true']")  # the chosen head is the model view's Tab stop
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowUp")
    assert focused(page) == "thumb 0/1"
    assert page.input_value("#layer") == "0" and page.input_value("#head") == "1"
    assert_row_matches(watched, reference(q, k, v, 0, 1), 8)
    assert page.locator(".thumb[tabindex='0']").count() == 1
    watched.check_clean()


def test_screen_readers_get_names_roles_and_the_maps_text(browser, tmp_path):
    path, (q, k, v) = write_page(tmp_path, query_index=1)
    watched = OfflinePage(browser, path)
    page = watched.page
    row = reference(q, k, v, 1, 2).weights[1]
    best = int(row.argmax())
    # The map was an image that wanted the arrow keys, which a screen reader keeps for its own
    # reading: a slider over the rows gets them, and says the chosen row as its value.
    assert page.get_attribute("#heatmap", "role") == "slider"
    assert "6 queries (rows) × 6 keys (columns)" in page.get_attribute("#heatmap", "aria-label")
    slider = ("aria-valuemin", "aria-valuemax", "aria-valuenow")
    assert [page.get_attribute("#heatmap", name) for name in slider] == ["0", str(T - 1), "1"]
    value = page.get_attribute("#heatmap", "aria-valuetext")
    assert value == f"Row 1 “gioco”: most weight, {row[best]:.4f}, on key {best} “{TOKENS[best]}”."
    page.focus("#heatmap")
    page.keyboard.press("ArrowDown")
    assert page.get_attribute("#heatmap", "aria-valuenow") == "2"
    assert page.get_attribute("#heatmap", "aria-valuetext").startswith("Row 2 “<img")
    assert page.get_attribute(".flow", "role") == "listbox"
    assert page.locator(".token[role='option']").count() == T
    assert (
        page.get_attribute(".thumb[data-layer='0'][data-head='2']", "aria-label")
        == "layer 0, head 2"
    )
    assert page.get_attribute("#selection", "aria-live") == "polite"
    watched.check_clean()


def test_the_map_and_the_model_view_say_rows_are_queries_and_columns_keys(browser, tmp_path):
    path, _ = write_page(tmp_path)
    watched = OfflinePage(browser, path)
    hints = watched.page.evaluate(
        """() => ['#heatmap', '#model-grid'].map((id) =>
            document.querySelector(id).closest('.card').querySelector('.hint').textContent)"""
    )
    assert all("rows: queries, columns: keys" in hint for hint in hints), hints
    watched.check_clean()


def test_a_decoders_masked_keys_look_masked_and_say_so(browser, tmp_path):
    path, _ = write_page(tmp_path, causal=True, query_index=2)
    watched = OfflinePage(browser, path)
    page = watched.page
    tags = page.eval_on_selector_all(
        "#steps tbody tr", "(rows) => rows.map((tr) => tr.lastChild.textContent)"
    )
    assert tags == ["", "", "", "masked", "masked", "masked"]  # keys 3..5 follow query 2
    masked_tokens = page.eval_on_selector_all(
        ".token.masked", "(els) => els.map((e) => +e.dataset.index)"
    )
    assert masked_tokens == [3, 4, 5]
    assert "keys after each query are masked" in page.get_attribute("#heatmap", "aria-label")
    # the model view's top-right corner (query 0, last key) is masked grey, not weight-0 blue
    corner = page.evaluate(
        """() => [...document.querySelector('.thumb').getContext('2d')
                  .getImageData(document.querySelector('.thumb').width - 1, 0, 1, 1).data]"""
    )
    assert corner[:3] == [212, 208, 203]  # view.css's --masked
    watched.check_clean()


def test_keys_before_a_sliding_window_are_masked_and_say_so(browser, tmp_path):
    """Layer 1 has a window of 3 (a query sees itself and the 2 keys before it), layer 0 none:
    the page's weights are Python's under that mask, and the keys before the window look
    masked (grey map cells and thumbnail corner, tags, counts) and are named as such."""
    path, (q, k, v) = write_page(tmp_path, causal=True, windows=[None, 3], query_index=5)
    watched = OfflinePage(browser, path)
    page = watched.page
    allowed = torch.arange(T) > torch.arange(T)[:, None] - 3  # key j > query i - 3
    trace = reference(q, k, v, 1, 2, causal=True, mask=allowed)
    for i in (1, 3, 5):
        page.click(f".token[data-index='{i}']")
        assert_row_matches(watched, trace, i)
    tags = page.eval_on_selector_all(
        "#steps tbody tr .tag", "(tags) => tags.map((e) => [+e.closest('tr').dataset.key, e.title])"
    )
    titles = page.eval_on_selector_all(
        ".token.masked", "(els) => els.map((e) => [+e.dataset.index, e.title])"
    )
    window_title = "masked: key {} is outside the sliding window of query 5 (keys 3..5)"
    assert tags == titles == [[j, window_title.format(j)] for j in range(3)]  # before 3..5
    assert "3 keys masked" in page.text_content("#leftover")
    label = page.get_attribute("#heatmap", "aria-label")
    assert "keys after each query and keys before each query's sliding window of 3" in label
    note = page.text_content("#step-note")  # query 5, the last: it has no keys after it
    assert "keys before the query's sliding window of 3" in note and "keys after" not in note
    page.click(".token[data-index='1']")  # keys 0..1: none before its window
    note = page.text_content("#step-note")
    assert "keys after the query are masked" in note and "sliding window" not in note
    page.click(".token[data-index='5']")
    cells = page.evaluate(
        """([T, cell, margin]) => {
            const map = document.getElementById('heatmap');
            const dpr = map.width / map.getBoundingClientRect().width;
            const at = (n) => Math.floor((margin + (n + 0.5) * cell) * dpr);
            const pixel = (i, j) => [...map.getContext('2d').getImageData(at(j), at(i), 1, 1).data];
            return [...Array(T).keys()].map((i) => [...Array(T).keys()].map((j) => pixel(i, j)));
        }""",
        [T, 44, 84],
    )
    grey = [212, 208, 203]  # view.css's --masked
    for i in range(T):
        for j in range(T):
            assert (cells[i][j][:3] == grey) == (j > i or j <= i - 3), (i, j)
    corners = page.evaluate(
        """() => [0, 1].map((layer) => {
            const thumb = document.querySelector(`.thumb[data-layer='${layer}']`);
            return [...thumb.getContext('2d').getImageData(0, thumb.height - 1, 1, 1).data];
        })"""
    )  # the last query's first key: outside layer 1's window only
    assert corners[1][:3] == grey and corners[0][:3] != grey
    page.select_option("#layer", "0")  # no window: every earlier key is attended again
    assert page.eval_on_selector_all(".token.masked", "(els) => els.length") == 0
    assert_row_matches(watched, reference(q, k, v, 0, 2, causal=True), 5)
    watched.check_clean()


def test_the_row_summary_counts_masked_keys_apart_from_weights_that_underflow(browser, tmp_path):
    """A scale of 1000 sends some encoder weights to exactly 0: they are not masked keys."""
    path, _ = write_page(tmp_path, scale=1000.0, query_index=2)
    watched = OfflinePage(browser, path)
    page = watched.page
    zero = sum(float(row["weight"]) == 0 for row in watched.step_rows())
    assert zero > 0  # else the scale did not do its job
    leftover = page.text_content("#leftover")
    assert "masked" not in leftover and f"{zero} key" in leftover and "at weight 0" in leftover
    causal, _ = write_page(tmp_path, causal=True, query_index=2)
    assert "3 keys masked" in OfflinePage(browser, causal).page.text_content("#leftover")


def test_print_shows_every_token_and_step_unscrolled(browser, tmp_path):
    path, _ = write_page(tmp_path, tokens=[f"token{i}" for i in range(150)])
    watched = OfflinePage(browser, path)
    watched.page.emulate_media(media="print")
    clipped = watched.page.evaluate(
        """() => ['.flow', '.map-scroll', '.steps-scroll'].filter((s) => {
            const e = document.querySelector(s);
            return e.scrollHeight > e.clientHeight + 1 || e.scrollWidth > e.clientWidth + 1;
        })"""
    )
    assert clipped == []
    watched.check_clean()


def test_right_to_left_text_reads_right_to_left(browser, tmp_path):
    tokens = ["[CLS]", "שלום", "עולם", ".", "[SEP]", "x"]
    path, _ = write_page(tmp_path, tokens=tokens)
    text = "שלום עולם."
    path.write_text(path.read_text(encoding="utf-8").replace(" ".join(tokens), text, 1))
    watched = OfflinePage(browser, path)
    # the full stop ends the sentence at its left, as a Hebrew reader expects
    left_of = watched.page.evaluate(
        """(text) => {
            const node = document.getElementById('text').firstChild;
            const box = (start, end) => {
                const range = document.createRange();
                range.setStart(node, start);
                range.setEnd(node, end);
                return range.getBoundingClientRect();
            };
            return box(text.length - 1, text.length).right <= box(0, 4).left;
        }""",
        text,
    )
    assert left_of
    watched.check_clean()


# Every element's own text and the colour it is drawn on (its grounds composited from the page
# down), for each below 4.5:1 (WCAG 2 AA): what it is, the ratio, and the two colours.
LOW_CONTRAST = """() => {
    const parse = (s) => {
        const p = s.match(/rgba?\\(([^)]+)\\)/)[1].split(/[ ,/]+/).map(Number);
        return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
    };
    const over = (top, under) =>
        top.slice(0, 3).map((c, i) => c * top[3] + under[i] * (1 - top[3]));
    const lum = (c) => {
        const f = (x) => ((x /= 255) <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4);
        return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]);
    };
    const low = [];
    for (const el of document.querySelectorAll('body *')) {
        const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
        const shown = el.checkVisibility({opacityProperty: true, visibilityProperty: true});
        if (!own || !shown) continue;
        if (el.closest('[aria-busy="true"], :disabled, .visually-hidden')) continue;
        let ground = [255, 255, 255];
        const chain = [];
        for (let e = el; e; e = e.parentElement) chain.unshift(e);
        for (const e of chain) ground = over(parse(getComputedStyle(e).backgroundColor), ground);
        const ink = over(parse(getComputedStyle(el).color), ground);
        const [a, b] = [lum(ink), lum(ground)].sort((x, y) => y - x);
        const ratio = (a + 0.05) / (b + 0.05);
        if (ratio < 4.5) {
            low.push({what: el.id || el.className || el.tagName, text: el.textContent.slice(0, 30),
                      ratio: +ratio.toFixed(2), ink: ink.map(Math.round),
                      ground: ground.map(Math.round)});
        }
    }
    return low;
}"""
# The page's ground and text colours, and the heatmap canvas's corner (its ground).
GROUNDS = """() => {
    const colour = (s) => s.match(/\\d+/g).slice(0, 3).map(Number);
    const card = document.querySelector('.card');
    const map = document.getElementById('heatmap');
    return {page: colour(getComputedStyle(document.body).backgroundColor),
            text: colour(getComputedStyle(document.body).color),
            card: colour(getComputedStyle(card).backgroundColor),
            map: [...map.getContext('2d').getImageData(1, 1, 1, 1).data].slice(0, 3)};
}"""


def emulate(page, **media) -> None:
    """Playwright's emulate_media, then a frame: the page hears media changes as it renders.
    With reduced motion unless asked otherwise: a token's background eases over 0.1 s, so a
    colour read two frames after a change of scheme could be a blend of both (seen as 1.8:1
    in CI on a busy machine, the dark test of the chosen token's outline)."""
    page.emulate_media(**{"reduced_motion": "reduce", **media})
    page.evaluate(
        "() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))"
    )


def luminance(rgb) -> float:
    def linear(c):
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a, b) -> float:
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_every_text_reads_at_4_5_to_1_in_light_and_in_dark(browser, tmp_path, scheme):
    path, _ = write_page(tmp_path, causal=True, query_index=2)
    watched = OfflinePage(browser, path)
    page = watched.page
    emulate(page, color_scheme=scheme)
    grounds = page.evaluate(GROUNDS)
    assert contrast(grounds["text"], grounds["page"]) >= 4.5
    assert grounds["map"] == grounds["card"]  # the map's canvas follows the scheme too
    dark = luminance(grounds["page"]) < 0.05 and luminance(grounds["card"]) < 0.05
    assert dark == (scheme == "dark")
    for head in ("2", "mean"):  # each row shades the tokens its own way: their text stays legible
        page.select_option("#head", head)
        for i in range(T):
            page.hover(f".token[data-index='{i}']")
            assert page.evaluate(LOW_CONTRAST) == [], (head, i)
    page.hover("#heatmap", position={"x": 84 + 44 * 1.5, "y": 84 + 44 * 3.5})  # the tip
    assert page.is_visible("#map-tip") and page.evaluate(LOW_CONTRAST) == []
    page.focus(".token.selected")
    ring = page.eval_on_selector(
        ".token.selected", "(e) => getComputedStyle(e).boxShadow.match(/rgb\\([^)]+\\)/g)"
    )
    outer = [int(c) for c in re.findall(r"\d+", ring[-1])]
    assert contrast(outer, grounds["card"]) >= 3  # the focus ring shows on the card
    watched.check_clean()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_maps_cells_its_legend_and_masked_keys_share_one_colour_scale(
    browser, tmp_path, scheme
):
    path, (q, k, v) = write_page(tmp_path, causal=True)
    watched = OfflinePage(browser, path)
    page = watched.page
    emulate(page, color_scheme=scheme)
    weights = reference(q, k, v, 1, 2, causal=True).weights
    drawn = page.evaluate(
        """([T, cell, margin]) => {
            const pixels = (canvas, x, y, w) =>
                [...canvas.getContext('2d').getImageData(x, y, w, 1).data];
            const legend = pixels(document.getElementById('legend-bar'), 0, 0, 256);
            const map = document.getElementById('heatmap');
            const dpr = map.width / map.getBoundingClientRect().width;
            const cells = [];
            for (let i = 0; i < T; i++) {
                cells.push([]);
                for (let j = 0; j < T; j++) {
                    const at = (n) => Math.floor((margin + (n + 0.5) * cell) * dpr);
                    cells[i].push(pixels(map, at(j), at(i), 1).slice(0, 3));
                }
            }
            const swatch = getComputedStyle(document.querySelector('.legend-masked .swatch'));
            return {legend: [...Array(256).keys()].map((n) => legend.slice(4 * n, 4 * n + 3)),
                    cells, masked: swatch.backgroundColor.match(/\\d+/g).map(Number),
                    largest: document.getElementById('legend-largest').textContent};
        }""",
        [T, 44, 84],
    )
    legend, masked = drawn["legend"], drawn["masked"]
    largest = weights.max().item()
    assert drawn["largest"] == f"{largest:.3f}"
    for i in range(T):
        for j in range(T):
            if j > i:  # a key after the query: masked, in the legend's masked colour
                assert drawn["cells"][i][j] == masked, (i, j)
            else:  # the legend's colour for its weight (one step either way: float32 vs 64)
                n = round(weights[i, j].item() / largest * 255)
                assert drawn["cells"][i][j] in legend[max(0, n - 1) : n + 2], (i, j)
    # weight 0 recedes into the page: light on light, dark on dark
    zero_first = luminance(legend[0]) > luminance(legend[255])
    assert zero_first == (scheme == "light")
    steps = [luminance(c) for c in legend]
    assert steps == sorted(steps, reverse=zero_first)  # one direction: values stay ordered
    # masked looks like no weight at all: far from every colour of the scale
    assert min(max(abs(a - b) for a, b in zip(masked, c, strict=True)) for c in legend) >= 30
    watched.check_clean()


def test_print_is_light_in_dark_mode(browser, tmp_path):
    path, _ = write_page(tmp_path)
    watched = OfflinePage(browser, path)
    page = watched.page
    emulate(page, color_scheme="dark")
    dark = page.evaluate(GROUNDS)
    assert luminance(dark["card"]) < 0.05 and dark["map"] == dark["card"]
    emulate(page, media="print")  # print preview's media
    printed = page.evaluate(GROUNDS)
    assert printed["card"] == [255, 255, 255] and printed["map"] == [255, 255, 255]
    emulate(page, media="screen")
    assert page.evaluate(GROUNDS) == dark
    page.evaluate("() => dispatchEvent(new Event('beforeprint'))")  # as window.print() does
    assert page.evaluate(GROUNDS)["map"] == [255, 255, 255]
    page.evaluate("() => dispatchEvent(new Event('afterprint'))")
    assert page.evaluate(GROUNDS) == dark
    watched.check_clean()


def test_a_zoom_redraws_the_map_sharp_at_the_new_pixel_ratio(browser, tmp_path):
    path, _ = write_page(tmp_path)
    watched = OfflinePage(browser, path)
    page = watched.page
    cdp = page.context.new_cdp_session(page)
    sharp = """(ratio) => devicePixelRatio === ratio && ['heatmap', 'lines'].every((id) => {
        const canvas = document.getElementById(id);  // backing pixels per CSS pixel
        return Math.abs(canvas.width / canvas.getBoundingClientRect().width - ratio) < 0.01;
    })"""
    assert page.evaluate(sharp, 1)
    for ratio, width in ((2, 1300), (3, 1200), (1.5, 1400)):  # a zoom: ratio and CSS width change
        cdp.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": 1000, "deviceScaleFactor": ratio, "mobile": False},
        )
        page.wait_for_function(sharp, arg=ratio, timeout=5_000)
    watched.check_clean()


def test_the_maps_box_scrolls_to_the_chosen_row(browser, tmp_path):
    n = 300  # 3 px cells: 936 px of map in a 760 px box
    path, _ = write_page(tmp_path, tokens=[f"t{i}" for i in range(n)])
    watched = OfflinePage(browser, path)
    page = watched.page
    row_in_box = """(i) => {
        const box = document.querySelector('.map-scroll').getBoundingClientRect();
        const map = document.getElementById('heatmap').getBoundingClientRect();
        const top = map.top + 36 + 3 * i;
        return top >= box.top && top + 3 <= box.bottom;
    }"""
    page.focus("#heatmap")
    page.keyboard.press("End")
    assert page.get_attribute(".token.selected", "data-index") == str(n - 1)
    assert page.evaluate(row_in_box, n - 1)
    page.click(".token[data-index='2']")  # a token chosen in the strip: its row comes back
    assert page.evaluate(row_in_box, 2)
    watched.check_clean()


def test_shift_and_the_side_arrows_scroll_a_wide_map_and_keep_its_row(browser, tmp_path):
    """A map wider than its box (300 tokens: 3 px cells, more than the box's width) could not
    be scrolled sideways by keyboard: ← and → move the row. Shift+← and Shift+→ scroll the
    box a screenful and leave the row as it was."""
    n = 300
    path, _ = write_page(tmp_path, tokens=[f"t{i}" for i in range(n)], query_index=5)
    watched = OfflinePage(browser, path)
    page = watched.page
    box = page.locator(".map-scroll")
    assert box.evaluate("(b) => b.scrollWidth > b.clientWidth")  # wider than its box
    page.focus("#heatmap")
    page.keyboard.press("Shift+ArrowRight")
    assert box.evaluate("(b) => b.scrollLeft") > 0
    assert page.get_attribute(".token.selected", "data-index") == "5"  # the row stays
    page.keyboard.press("Shift+ArrowLeft")
    assert box.evaluate("(b) => b.scrollLeft") == 0
    page.keyboard.press("ArrowRight")  # without Shift: the next row, as before
    assert page.get_attribute(".token.selected", "data-index") == "6"
    watched.check_clean()


def test_boxes_that_scroll_are_named_regions_the_keyboard_scrolls(browser, tmp_path):
    """The text over the tokens (4.6 lines at most) and the step table's box scroll, but were
    neither focusable nor named (axe: scrollable-region-focusable): a keyboard could not scroll
    them, a screen reader not name them."""
    path, _ = write_page(tmp_path, tokens=[f"word{i}" for i in range(200)])
    watched = OfflinePage(browser, path)
    page = watched.page
    for name, selector in (("text", "#text"), ("Step by step", ".steps-scroll")):
        region = page.get_by_role("region", name=name, exact=True)
        assert region.count() == 1 and region.evaluate(f"(e) => e.matches('{selector}')")
        assert region.evaluate("(e) => e.scrollHeight > e.clientHeight")  # it scrolls
        region.focus()
        page.keyboard.press("PageDown")
        page.wait_for_function("(s) => document.querySelector(s).scrollTop > 0", arg=selector)
    watched.check_clean()


def test_the_step_table_is_named_by_its_title_and_has_no_empty_header(browser, tmp_path):
    path, _ = write_page(tmp_path, query_index=1)
    watched = OfflinePage(browser, path)
    page = watched.page
    table = page.get_by_role("table", name="Step by step query 1 “gioco”", exact=True)
    assert table.count() == 1 and table.get_attribute("id") == "steps"
    # the column over the bars was an empty header, read out as a nameless column
    headers = page.eval_on_selector_all("#steps th", "(ths) => ths.map((th) => th.textContent)")
    assert headers == ["key", "score", "scaled", "weight"]
    assert page.eval_on_selector("#steps thead .bar-cell", "(e) => e.ariaHidden") == "true"
    watched.check_clean()


@pytest.mark.parametrize("width", [320, 375])
def test_a_phone_shows_each_key_of_the_step_table_whole(browser, tmp_path, width):
    """At 320 px the step table cut its keys to 7 em with an ellipsis ("7 depos…"): they wrap."""
    tokens = ["[CLS]", "i", "went", "to", "the", "bank", "to", "deposit", "money", ".", "[SEP]"]
    path, _ = write_page(tmp_path, tokens=[*tokens[:7], "depositories", *tokens[8:]])
    watched = OfflinePage(browser, path)
    page = watched.page
    page.set_viewport_size({"width": width, "height": 800})
    cut = page.eval_on_selector_all(
        "#steps td.key",
        "(cells) => cells.filter((c) => c.scrollWidth > c.clientWidth).map((c) => c.textContent)",
    )
    assert cut == []
    watched.check_clean()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_chosen_token_head_and_row_stand_out_at_3_to_1(browser, tmp_path, scheme):
    """The pin's light orange (#f59e0b) was 2.2:1 on the white page (WCAG 1.4.11 asks 3:1):
    the chosen token's and head's outlines and the map's chosen row. The row's line now runs
    between two lines of the ground's colour, so it stands out on cells of any colour."""
    path, _ = write_page(tmp_path, query_index=2)
    watched = OfflinePage(browser, path)
    page = watched.page
    emulate(page, color_scheme=scheme)
    colour = "(e) => getComputedStyle(e).outlineColor.match(/\\d+/g).slice(0, 3).map(Number)"
    card = page.evaluate(GROUNDS)["card"]
    chosen = page.eval_on_selector(".token.selected", colour)
    ground = page.eval_on_selector(
        ".token.selected", "(e) => getComputedStyle(e).backgroundColor.match(/\\d+/g).map(Number)"
    )
    assert contrast(chosen, card) >= 3 and contrast(chosen, ground[:3]) >= 3
    assert contrast(page.eval_on_selector(".thumb.selected", colour), card) >= 3
    # the map's chosen row: 44 px cells from 84 px; its top edge, pixel by pixel upwards
    edge = page.evaluate(
        """(top) => {
            const map = document.getElementById('heatmap');
            const dpr = map.width / map.getBoundingClientRect().width;
            const px = (y) => [...map.getContext('2d').getImageData(
                Math.floor(150 * dpr), Math.floor(y * dpr), 1, 1).data].slice(0, 3);
            return [px(top - 0.5), px(top - 1.5), px(top - 2.5), px(top - 3.5)];
        }""",
        84 + 44 * 2,
    )
    assert edge == [card, chosen, chosen, card]  # ground, pin, pin, ground
    watched.check_clean()


def test_white_space_tokens_are_named_in_words_for_screen_readers(browser, tmp_path):
    """A space shows as "␣" and a line break as "↵", which a screen reader reads as "open box"
    or "downwards arrow with corner leftwards": such a token is named in words."""
    tokens = [" ", "\n", "\t", "word", "  ", "a\nb", "\x06"]
    path, _ = write_page(tmp_path, tokens=tokens)
    watched = OfflinePage(browser, path)
    page = watched.page
    names = page.eval_on_selector_all(".token", "(els) => els.map((e) => e.ariaLabel)")
    assert names == [
        "space", "line break", "tab", None, "space space", "a line break b",
        "control character \\x06",
    ]  # fmt: skip
    assert page.get_by_role("option", name="line break", exact=True).text_content() == "↵"
    said = page.eval_on_selector_all(
        "#steps tbody tr",
        """(rows) => rows.map((tr) => [+tr.dataset.key,
            tr.querySelector('.key [aria-hidden="true"]')?.textContent ?? null,
            tr.querySelector('.key .visually-hidden')?.textContent ?? null])""",
    )  # the step table's keys: the marks hidden from screen readers, the words read instead
    assert sorted(said) == [
        [0, "␣", "space"], [1, "↵", "line break"], [2, "⇥", "tab"], [3, None, None],
        [4, "␣␣", "space space"], [5, "a↵b", "a line break b"],
        [6, "\\x06", "control character \\x06"],
    ]  # fmt: skip
    watched.check_clean()


def test_forced_colours_keep_the_focus_ring_and_the_weights_shading(browser, tmp_path):
    """Windows High Contrast drops box shadows and backgrounds: the focused token's ring (a
    box shadow) vanished, and the tokens' shading by weight with it. The ring is an outline
    in the system's highlight colour, and the tokens painted by weight keep their colours."""
    path, _ = write_page(tmp_path, query_index=1)
    watched = OfflinePage(browser, path)
    page = watched.page
    page.emulate_media(forced_colors="active")
    page.focus(".token.selected")
    ring = page.eval_on_selector(
        ".token.selected",
        "(e) => { const s = getComputedStyle(e); return [s.outlineStyle, s.outlineWidth]; }",
    )
    assert ring == ["solid", "3px"]
    painted = page.eval_on_selector_all(
        ".token.painted",
        "(els) => els.map((e) => [e.style.backgroundColor, getComputedStyle(e).backgroundColor])",
    )
    assert len(painted) == T - 1  # every token but the query
    assert all(given == computed for given, computed in painted), painted
    watched.check_clean()
