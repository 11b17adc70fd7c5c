"""The live explorer in headless chromium against a real `selfattn serve` (uvicorn, in a thread):
typed text, picked layer/head and clicked token give the API's numbers (1e-6), the compare and
similarity/scale views agree with their endpoints, the address reproduces a view, user text
stays text, no console errors, and every request goes to 127.0.0.1.
"""

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from urllib.parse import parse_qs, quote, urlencode, urlsplit

import httpx
import pytest

from conftest import WatchedPage, char_gpt, needs_chromium
from selfattn import server
from selfattn.explain import compare_texts, explain_text
from selfattn.models.loading import load
from selfattn.models.model import Model
from test_browser import LOW_CONTRAST, contrast, emulate, luminance
from test_decoders import gpt2_folder  # noqa: F401 (a fixture)

pytestmark = needs_chromium

BANK = "I went to the bank to deposit money."
RIVER = "We sat on the bank of the river and watched the water."
RIVER_TWICE = "We sat on the bank of the river and watched the river."
RATES = "The bank raised its rates."
XSS = "<img src=x onerror=alert(1)>"
# The page computes in float64 from the float32 q, k, v; the API's explain in float32. Weights
# and outputs agree to 1e-6 absolute; scores and scaled scores (|x| up to ~30 here, sums of
# float32 products) to 1e-6 relative to the row's largest magnitude.
TOL = 1e-6


@contextmanager
def serving(model: Model) -> Iterator[str]:
    """uvicorn serving the explorer of ``model`` on a free 127.0.0.1 port: its address."""
    import uvicorn

    sock = server.listen("127.0.0.1", 0)  # kept listening: no other process can take the port
    port = sock.getsockname()[1]
    app = server.create_app(model)
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uvicorn_server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    uvicorn_server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture(scope="module")
def minilm() -> Model:
    return load("minilm")


@pytest.fixture(scope="module")
def base_url(minilm):
    """The explorer of all-MiniLM-L6-v2 for this module."""
    with serving(minilm) as address:
        yield address


@pytest.fixture(scope="module")
def decoder_url():
    """The explorer of a small random character-level GPT: a decoder, its attention causal."""
    with serving(char_gpt("abcdefghijklmnopqrstuvwxyz .", block_size=64)) as address:
        yield address


class Watched(WatchedPage):
    """A page of the live explorer, served by the test's uvicorn."""

    def __init__(self, browser, base_url: str, address: str = "/"):
        super().__init__(browser)
        self.base = base_url
        self.open(address)

    def open(self, address: str) -> None:
        self.page.goto(self.base + address)
        self.page.wait_for_selector("body[data-ready='true']", timeout=30_000)

    def explore(self, text: str, word: str = "") -> None:
        """Type a text (and a word) into the Explore form and run it."""
        self.page.fill("#explore-text", text)
        if word:
            self.page.fill("#explore-word", word)
        self.page.click("#explore-run")

    def wait(self, target: str) -> None:
        self.page.wait_for_selector(f"{target}[data-ready='true']", timeout=30_000)

    def check_clean(self) -> None:
        assert self.errors == []
        assert self.requests and all(url.startswith(self.base + "/") for url in self.requests)


def api(base_url: str, path: str, body: dict) -> dict:
    response = httpx.post(base_url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, abs_tol=TOL)


def assert_steps_match(watched: Watched, expected: dict) -> None:
    """The step panel shows the API's scores, scaled scores, weights and output."""
    rows = sorted(watched.step_rows(), key=lambda r: r["key"])
    assert [r["key"] for r in rows] == list(range(len(expected["tokens"])))
    for name, key in (("score", "scores"), ("scaled", "scaled")):  # relative to the row (TOL)
        size = max(1.0, *(abs(x) for x in expected[key]))
        assert [row[name] for row in rows] == pytest.approx(expected[key], abs=TOL * size)
    assert [row["weight"] for row in rows] == pytest.approx(expected["weights"], abs=TOL)
    assert watched.output() == pytest.approx(expected["output"], abs=TOL)


def test_typed_text_layer_head_and_token_show_the_apis_numbers(browser, base_url):
    watched = Watched(browser, base_url)
    page = watched.page
    watched.explore(BANK, "bank")
    watched.wait("#app")
    chosen = api(base_url, "/api/explain", {"text": BANK, "word": "bank"})
    assert page.input_value("#layer") == str(chosen["layer"])
    assert page.input_value("#head") == str(chosen["head"])
    assert_steps_match(watched, chosen)

    page.select_option("#layer", "2")
    page.select_option("#head", "7")
    page.click(".token[data-index='7']")
    expected = api(base_url, "/api/explain", {"text": BANK, "index": 7, "layer": 2, "head": 7})
    assert_steps_match(watched, expected)
    assert page.text_content("#selection") == "layer 2 · head 7 · query 7 “deposit”"
    assert "layer=2&head=7&index=7" in page.url

    watched.open(page.url.removeprefix(base_url))  # the address reproduces the view
    watched.wait("#app")
    assert page.input_value("#layer") == "2" and page.input_value("#head") == "7"
    assert page.get_attribute(".token[data-index='7']", "class") == "token selected"
    assert_steps_match(watched, expected)
    watched.check_clean()


def test_a_shared_address_with_word_layer_and_head(browser, base_url):
    watched = Watched(browser, base_url, f"/?text={quote(BANK)}&layer=0&head=4&word=bank")
    watched.wait("#app")
    page = watched.page
    assert page.input_value("#explore-word") == "bank"
    assert page.text_content("#selection") == "layer 0 · head 4 · query 5 “bank”"
    expected = api(base_url, "/api/explain", {"text": BANK, "word": "bank", "layer": 0, "head": 4})
    assert_steps_match(watched, expected)

    page.select_option("#head", "mean")
    assert "head=mean" in page.url
    weights = page.eval_on_selector_all(
        "#steps tbody [data-weight]", "(cells) => cells.map((c) => +c.dataset.weight)"
    )
    mean = api(base_url, "/api/explain", {"text": BANK, "word": "bank", "layer": 0, "head": "mean"})
    assert weights == pytest.approx(mean["weights"], abs=TOL)

    page.click(".thumb[data-layer='5'][data-head='3']")  # the model view grid
    assert page.input_value("#layer") == "5" and page.input_value("#head") == "3"
    assert "layer=5&head=3&word=bank" in page.url
    watched.check_clean()


def test_compare_view_for_the_bank_sentences(browser, base_url):
    watched = Watched(browser, base_url)
    page = watched.page
    page.click("#tab-compare")
    page.fill(".sentence-row:nth-child(1) .compare-sentence", BANK)
    page.fill(".sentence-row:nth-child(2) .compare-sentence", RIVER_TWICE)
    page.fill("#compare-word", "bank")
    page.click("#compare-run")
    watched.wait("#compare-result")
    expected = api(base_url, "/api/compare", {"sentences": [BANK, RIVER_TWICE], "word": "bank"})
    cells = page.eval_on_selector_all(
        "#compare-table td[data-pair='0-1']", "(cells) => cells.map((c) => +c.dataset.value)"
    )
    assert cells == pytest.approx([layer["cosine"][0][1] for layer in expected["layers"]], abs=TOL)
    for i, attended in enumerate(expected["attended"]):
        chips = page.eval_on_selector_all(
            f"#compare-attended li[data-sentence='{i}'] .chip",
            "(chips) => chips.map((c) => "
            "[c.dataset.word, c.firstChild.textContent, +c.dataset.weight])",
        )
        assert chips == [
            [a["word"], a["label"], pytest.approx(a["weight"], abs=TOL)] for a in attended
        ]
    assert "8:river" in page.text_content("#compare-attended li[data-sentence='1']")  # twice in S2
    assert "deposit" in page.text_content("#compare-attended li[data-sentence='0']")

    watched.open(page.url.removeprefix(base_url))  # view=compare&s=...&s=...&word=bank
    watched.wait("#compare-result")
    assert page.is_visible("#compare-table") and not page.is_visible("#view-explore")
    watched.check_clean()


def compare_address(sentences: tuple[str, ...], word: str) -> str:
    return "/?view=compare&" + "&".join(f"s={quote(s)}" for s in sentences) + f"&word={word}"


def attends_to(page) -> list[str]:
    """Per sentence of the compare view, what follows its "attends to"."""
    return page.eval_on_selector_all(
        "#compare-attended .looks", "(rows) => rows.map((r) => r.textContent.split(': ')[1])"
    )


def test_compare_notes_what_its_lists_leave_out_as_the_command_line_does(browser, base_url):
    watched = Watched(browser, base_url, compare_address((BANK, RIVER), "bank"))
    watched.wait("#compare-result")
    page = watched.page
    assert "n:word" not in page.text_content("#compare-note")  # no word twice in a sentence
    assert "decoder" not in page.text_content("#compare-note")
    watched.open(compare_address((BANK, RIVER_TWICE), "bank"))
    watched.wait("#compare-result")
    assert "8:river" in attends_to(page)[1]
    assert "n:word = the word at token n, where a sentence has it" in page.text_content(
        "#compare-note"
    )
    assert page.locator("#compare-tokens-note").count() == 0  # one token: bank, lower-cased
    watched.check_clean()


def test_compare_notes_a_word_read_as_other_tokens(browser, gpt2_folder):  # noqa: F811
    """A small random GPT-2 with a byte-level tokenizer: "Bank" and " bank" are other tokens."""
    sentences = ("Bank of the river", "I went to the bank")
    with serving(load(gpt2_folder)) as address:
        watched = Watched(browser, address, compare_address(sentences, "bank"))
        watched.wait("#compare-result")
        expected = api(address, "/api/compare", {"sentences": list(sentences), "word": "bank"})
        assert expected["tokens_note"].startswith("'bank' is read as other tokens")
        assert watched.page.text_content("#compare-tokens-note") == expected["tokens_note"]
        watched.check_clean()


def test_compare_on_a_decoder_says_what_the_word_cannot_see(browser, decoder_url):
    watched = Watched(browser, decoder_url, compare_address(("bank first", "the bank"), "bank"))
    watched.wait("#compare-result")
    page = watched.page
    expected = api(
        decoder_url, "/api/compare", {"sentences": ["bank first", "the bank"], "word": "bank"}
    )
    assert expected["attended"][0] == []  # nothing before the first word of S1
    assert attends_to(page) == [
        "no word before it",
        f"the {expected['attended'][1][0]['weight']:.2f}",
    ]
    assert "a decoder: the word's vectors and attention see only the text up to it" in (
        page.text_content("#compare-note")
    )
    watched.check_clean()


def test_compare_numbers_its_sentences_as_the_form_does(browser, base_url):
    watched = Watched(browser, base_url)
    page = watched.page
    page.click("#tab-compare")
    page.click("#compare-add")
    page.fill(".sentence-row:nth-child(2) .compare-sentence", "  ")  # left blank
    page.fill(".sentence-row:nth-child(3) .compare-sentence", RATES)
    page.fill("#compare-word", "bank")
    page.click("#compare-run")
    watched.wait("#compare-result")
    form = page.eval_on_selector_all(".compare-sentence", "(inputs) => inputs.map((i) => i.value)")
    result = page.eval_on_selector_all(
        "#compare-attended .sentence", "(spans) => spans.map((s) => s.textContent)"
    )
    assert form == result == [BANK, RATES]  # the blank row went
    assert page.text_content("#compare-table thead") == "layerS1 vs S2"
    watched.check_clean()


def test_similarity_and_scale_on_a_decoder_names_the_keys_it_may_not_attend(browser, decoder_url):
    """A decoder's keys after the query were listed at 0.000 like keys the model weighed; each
    is now a masked row, "masked" in both columns, its title saying why. The numbers behind
    them are still the API's (data attributes), 0 for the masked keys."""
    text = "the bank is by the river"
    address = f"/?view=ablation&text={quote(text)}&word=bank&layer=1&head=0&scale=1"
    watched = Watched(browser, decoder_url, address)
    watched.wait("#ablation-result")
    page = watched.page
    body = {"text": text, "word": "bank", "layer": 1, "head": 0, "scale": 1}
    expected = api(decoder_url, "/api/explain", body)
    masked = expected["masked_keys"]
    assert masked == list(range(expected["query"]["index"] + 1, len(expected["tokens"])))
    rows = page.eval_on_selector_all(
        "#ablation-table tbody tr",
        "(rows) => rows.map((r) => [+r.dataset.key, r.classList.contains('masked'), r.title,"
        " [...r.querySelectorAll('td.num')].map((c) => c.textContent)])",
    )
    for key, is_masked, title, numbers in rows:
        assert is_masked == (key in masked)
        if is_masked:
            assert numbers == ["masked", "masked"]
            assert title.startswith(f"masked: query {expected['query']['index']} may not attend")
        else:
            assert "masked" not in numbers and title == ""
    model = page.eval_on_selector_all(
        "#ablation-table [data-model]", "(cells) => cells.map((c) => +c.dataset.model)"
    )
    assert model == pytest.approx(expected["weights"], abs=TOL)
    watched.check_clean()


def run_similarity_and_scale(page, text: str, word: str, occurrence: str | None = None) -> None:
    """Fill the Similarity & scale form (layer 1, head 3, dot, scale 1; the occurrence through
    its label, as a screen reader finds it) and run it."""
    page.click("#tab-ablation")
    page.fill("#ablation-text", text)
    page.fill("#ablation-word", word)
    if occurrence is not None:
        field = page.locator("#view-ablation").get_by_label("Occurrence (0 = first, -1 = last)")
        field.fill(occurrence)
    page.select_option("#ablation-layer", "1")
    page.select_option("#ablation-head", "3")
    page.select_option("#ablation-similarity", "dot")
    page.fill("#ablation-scale", "1")
    page.click("#ablation-run")


def test_similarity_and_scale_view_shows_both_weights_and_entropies(browser, base_url):
    watched = Watched(browser, base_url)
    page = watched.page
    run_similarity_and_scale(page, BANK, "bank")
    watched.wait("#ablation-result")
    body = {"text": BANK, "word": "bank", "layer": 1, "head": 3, "similarity": "dot", "scale": 1}
    expected = api(base_url, "/api/explain", body)
    model, recomputed = (
        page.eval_on_selector_all(
            f"#ablation-table [data-{name}]", f"(cells) => cells.map((c) => +c.dataset.{name})"
        )
        for name in ("model", "recomputed")
    )
    assert model == pytest.approx(expected["weights"], abs=TOL)
    assert recomputed == pytest.approx(expected["alternative"]["weights"], abs=TOL)
    for name, value in (("model", expected), ("recomputed", expected["alternative"])):
        shown = float(page.get_attribute(f"#ablation-entropy-{name}", "data-value"))
        assert close(shown, value["entropy_bits"])
    assert "sharper" in page.text_content("#ablation-verdict")  # no scaling: sharper weights
    assert "similarity=dot" in page.url and "scale=1" in page.url
    watched.check_clean()


def test_similarity_and_scale_on_a_phone_shows_both_weights_whole(browser, base_url):
    """At 400 px the table was 423 px wide in a 312 px box: the recomputed weights, the
    view's answer, were past the fold of a sideways scroll."""
    watched = Watched(browser, base_url, f"/?view=ablation&text={quote(BANK)}&word=bank")
    watched.page.set_viewport_size({"width": 400, "height": 800})
    watched.wait("#ablation-result")
    cut = watched.page.evaluate(
        """() => {
            const box = document.querySelector('#ablation-result .steps-scroll');
            const right = box.getBoundingClientRect().right;
            return [...box.querySelectorAll('th, td')]
                .filter((cell) => cell.getBoundingClientRect().right > right + 0.5)
                .map((cell) => cell.textContent);
        }"""
    )
    assert cut == []
    watched.check_clean()


def test_similarity_and_scale_names_unknown_tokens_as_the_command_line_does(browser, base_url):
    text = "I love 🙂 and the bank"
    watched = Watched(browser, base_url, f"/?view=ablation&text={quote(text)}&word=%F0%9F%99%82")
    watched.wait("#ablation-result")
    expected = api(base_url, "/api/explain", {"text": text, "word": "🙂", "similarity": "cosine"})
    keys = watched.page.eval_on_selector_all(
        "#ablation-table td.key", "(cells) => cells.map((c) => c.textContent)"
    )
    assert keys == [f"{j} {name}" for j, name in enumerate(expected["names"])]
    assert "3 '🙂' ([UNK])" in keys
    assert watched.page.text_content("#ablation-result h2").startswith("query 3 '🙂' ([UNK]) ·")
    watched.check_clean()


def test_explore_names_an_unknown_token_as_its_lists_of_keys_do(browser, base_url):
    """Explore's selection line (and step title, row summary, map tip and text alternative)
    named the emoji query "[UNK]" while its lists of keys said '🙂' ([UNK])."""
    text = "I love 🙂 and the bank"
    watched = Watched(browser, base_url, f"/?text={quote(text)}&word=%F0%9F%99%82&layer=2&head=0")
    watched.wait("#app")
    page = watched.page
    unknown = "3 '🙂' ([UNK])"
    assert page.text_content("#steps tr[data-key='3'] .key") == unknown  # the list of keys
    assert page.text_content("#selection") == f"layer 2 · head 0 · query {unknown}"
    assert page.text_content("#step-title") == f"query {unknown}"
    assert page.text_content("#row-summary .summary-head") == f"query {unknown} looks at"
    assert f"Row {unknown}: most weight" in page.get_attribute("#heatmap", "aria-valuetext")
    page.eval_on_selector("#heatmap", "(e) => e.scrollIntoView()")
    box = page.eval_on_selector("#heatmap", "(e) => e.getBoundingClientRect().toJSON()")
    cell = 44  # 8 tokens: 44 px cells after an 84 px margin
    page.mouse.move(box["x"] + 84 + cell * 3 + 22, box["y"] + 84 + cell * 3 + 22)
    assert page.text_content("#map-tip").startswith(f"query {unknown} → key {unknown}: ")
    watched.check_clean()


@pytest.mark.parametrize(
    ("text", "word"),
    [("Tokenization is hard.", "tokenization"), ("She sat on the river bank.", "river bank")],
)
def test_similarity_and_scale_view_says_which_part_of_the_word_is_the_query(
    browser, base_url, text, word
):
    watched = Watched(browser, base_url, f"/?view=ablation&text={quote(text)}&word={quote(word)}")
    watched.wait("#ablation-result")
    expected = api(base_url, "/api/explain", {"text": text, "word": word, "similarity": "cosine"})
    assert watched.page.text_content("#ablation-note") == expected["query"]["note"]
    watched.check_clean()


RIVERS = "The river bank was wet, so the river rose."  # "river" twice, as in RIVER_TWICE


def test_compare_follows_the_occurrence_typed_and_kept_in_the_address(browser, base_url, minilm):
    sentences = [RIVER_TWICE, RIVERS]
    watched = Watched(browser, base_url)
    page = watched.page
    page.click("#tab-compare")
    for row, sentence in enumerate(sentences, 1):
        page.fill(f".sentence-row:nth-child({row}) .compare-sentence", sentence)
    page.fill("#compare-word", "river")
    page.keyboard.press("Tab")  # the next field, named by its label
    focused = page.get_by_role("spinbutton", name="Occurrence (0 = first, -1 = last)")
    assert focused.evaluate("(e) => e === document.activeElement")
    page.keyboard.type("1")
    page.keyboard.press("Enter")
    watched.wait("#compare-result")
    assert "occurrence=1" in page.url
    # the library's numbers for the second "river" of each sentence, to 1e-6 (TOL)
    expected = compare_texts(minilm, sentences, "river", occurrence=1).to_json()
    first = compare_texts(minilm, sentences, "river").to_json()
    cosines = [layer["cosine"][0][1] for layer in expected["layers"]]
    assert cosines[1:] != pytest.approx([layer["cosine"][0][1] for layer in first["layers"]][1:])

    def shown() -> tuple[list[float], list[list]]:
        cells = page.eval_on_selector_all(
            "#compare-table td[data-pair='0-1']", "(cells) => cells.map((c) => +c.dataset.value)"
        )
        chips = page.eval_on_selector_all(
            "#compare-attended .chip",
            "(chips) => chips.map((c) => [c.dataset.word, +c.dataset.weight])",
        )
        return cells, chips

    chips = [
        [a["word"], pytest.approx(a["weight"], abs=TOL)]
        for row in expected["attended"]
        for a in row
    ]
    assert shown() == (pytest.approx(cosines, abs=TOL), chips)
    assert page.text_content("#compare-result h2") == "“river” (occurrence 1) across 2 sentences"

    watched.open(page.url.removeprefix(base_url))  # reloaded: the same occurrence and numbers
    watched.wait("#compare-result")
    assert page.input_value("#compare-occurrence") == "1"
    assert shown() == (pytest.approx(cosines, abs=TOL), chips)
    watched.check_clean()


def test_explore_follows_the_occurrence_typed_and_kept_in_the_address(browser, base_url, minilm):
    _, second = explain_text(minilm, RIVER_TWICE, word="river", occurrence=1)
    expected = second.to_json()  # the library's steps for the second "river" (12), to TOL
    assert expected["query"]["index"] == 12
    watched = Watched(browser, base_url)
    page = watched.page
    page.fill("#explore-text", RIVER_TWICE)
    page.fill("#explore-word", "river")
    page.keyboard.press("Tab")  # the next field, named by its label
    focused = page.locator("#view-explore").get_by_role(
        "spinbutton", name="Occurrence (0 = first, -1 = last)"
    )
    assert focused.evaluate("(e) => e === document.activeElement")
    page.keyboard.type("1")
    page.keyboard.press("Enter")
    watched.wait("#app")
    assert page.url.endswith("word=river&occurrence=1")  # layer and head: chosen again
    assert "layer=" not in page.url
    assert page.text_content("#selection").endswith("query 12 “river”")
    assert_steps_match(watched, expected)

    watched.open(page.url.removeprefix(base_url))  # reloaded: the same occurrence and numbers
    watched.wait("#app")
    assert page.input_value("#explore-occurrence") == "1"
    assert_steps_match(watched, expected)

    page.click(".token[data-index='8']")  # the first "river": a token, no longer the word's match
    assert page.url.endswith(f"layer={expected['layer']}&head={expected['head']}&index=8")
    assert page.input_value("#explore-word") == page.input_value("#explore-occurrence") == ""
    page.click(".token[data-index='12']")  # the word's match again: as chosen, as it opened
    assert page.url.endswith("word=river&occurrence=1") and "layer=" not in page.url
    assert page.input_value("#explore-occurrence") == "1"
    watched.check_clean()


def ablation_weights(page) -> dict:
    """The Similarity & scale view's query, weights and entropies, as its data-* hold them."""
    return page.evaluate(
        """() => {
            const numbers = (name) => [...document.querySelectorAll(`#ablation-table td`)]
                .filter((c) => name in c.dataset).map((c) => +c.dataset[name]);
            const entropy = (name) => +document.querySelector(`#ablation-entropy-${name}`)
                .dataset.value;
            return {query: +document.querySelector('#ablation-table tr.self').dataset.key,
                    model: numbers('model'), recomputed: numbers('recomputed'),
                    entropies: [entropy('model'), entropy('recomputed')]};
        }"""
    )


def test_similarity_and_scale_follows_the_occurrence_through_back_and_forward(
    browser, base_url, minilm
):
    options = {"layer": 1, "head": 3, "similarity": "dot", "scale": 1.0}
    expected = {}  # occurrence -> what the library gives, to 1e-6 (TOL)
    for occurrence in (1, 0):
        _, explanation = explain_text(
            minilm, RIVER_TWICE, word="river", occurrence=occurrence, **options
        )
        data = explanation.to_json()
        expected[occurrence] = {
            "query": data["query"]["index"],
            "model": pytest.approx(data["weights"], abs=TOL),
            "recomputed": pytest.approx(data["alternative"]["weights"], abs=TOL),
            "entropies": pytest.approx(
                [data["entropy_bits"], data["alternative"]["entropy_bits"]], abs=TOL
            ),
        }
    assert expected[1]["query"] == 12 and expected[0]["query"] == 8

    watched = Watched(browser, base_url)
    page = watched.page
    run_similarity_and_scale(page, RIVER_TWICE, "river", occurrence="1")
    watched.wait("#ablation-result")
    assert "occurrence=1" in page.url
    assert ablation_weights(page) == expected[1]
    page.fill("#ablation-occurrence", "0")
    page.click("#ablation-run")
    watched.wait("#ablation-result")
    assert ablation_weights(page) == expected[0]

    for move, occurrence in (("back", 1), ("forward", 0)):
        getattr(page, f"go_{move}")()
        page.wait_for_function("(n) => location.search.includes(`occurrence=${n}`)", arg=occurrence)
        on_screen(page)
        assert page.input_value("#ablation-occurrence") == str(occurrence)
        assert ablation_weights(page) == expected[occurrence]
    watched.check_clean()


def ablation_outcome(page) -> dict:
    """Once its run is over: the view's result state, its error and its form's choices."""
    page.wait_for_function("() => !document.querySelector('[aria-busy]')", timeout=30_000)
    return page.evaluate(
        """() => ({ready: document.getElementById('ablation-result').dataset.ready ?? null,
                   error: document.getElementById('error').hidden ? null
                          : document.getElementById('error').textContent,
                   picked: ['layer', 'head', 'similarity', 'scale'].map(
                       (name) => document.getElementById(`ablation-${name}`).value)})"""
    )


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ("&word=bank&layer=9", "layer 9 is out of range: this model has layers 0..5"),
        ("&word=bank&layer=abc", "the Layer field: Input should be a valid integer"),
        (
            "&word=bank&head=mean",
            "another similarity or scale is recomputed for one query of one head: give a head "
            "number instead of 'mean' (or no head, to have one chosen)",
        ),
        ("&word=bank&similarity=euclid", "the Similarity field: Input should be 'dot' or 'cosine'"),
        ("&word=bank&scale=abc", "the Scale field: Input should be a valid number"),
        ("&word=bank&scale=1e999", "the Scale field: Input should be a valid number"),
        (
            "&layer=1",
            "give a word: Similarity & scale recomputes the weights of one word as the query",
        ),
    ],
)
def test_similarity_and_scale_refuses_a_bad_address_in_one_line(browser, base_url, given, error):
    address = f"/?view=ablation&text={quote(BANK)}{given}"
    watched = Watched(browser, base_url, address)
    page = watched.page
    outcome = ablation_outcome(page)
    assert (outcome["ready"], outcome["error"]) == ("error", error)  # nothing else ran instead
    assert page.eval_on_selector("#ablation-result", "(e) => e.childElementCount") == 0
    assert page.url == base_url + address


def test_compare_from_an_address_with_one_sentence_says_how_many_it_takes(browser, base_url):
    # It showed S1 and an empty S2, and no result nor error: the address's one sentence is the
    # server's one line, as the form's is.
    address = compare_address(("a bank",), "bank")
    watched = Watched(browser, base_url, address)
    page = watched.page
    page.wait_for_selector("#compare-result[data-ready='error']", state="attached", timeout=30_000)
    assert page.text_content("#error") == "give 2 to 4 sentences to compare"
    assert page.eval_on_selector("#compare-result", "(e) => e.childElementCount") == 0
    assert page.url == base_url + address


def test_compare_from_an_address_without_a_word_says_it_needs_one(browser, base_url):
    address = compare_address((BANK, RIVER), "")
    watched = Watched(browser, base_url, address)
    page = watched.page
    page.wait_for_function(
        "() => document.getElementById('compare-result').dataset.ready === 'error'",
        timeout=30_000,
    )
    assert page.text_content("#error") == (
        "give a word: Compare follows one word across the sentences"
    )
    assert page.url == base_url + address


@pytest.mark.parametrize(
    ("given", "error"),
    [
        # Explore's layer and head are menus (its "chosen: ..." line names them so): it said
        # "the Layer field", a field of Similarity & scale
        ("layer=abc", "the layer menu: Input should be a valid integer"),
        ("head=x", "the head menu: give a head number (0 = first) or 'mean'"),
        ("index=-1", "token index -1 is out of range: tokens 0..10"),
        ("word=bank&index=3", "give either a word or a token index, not both"),  # not index dropped
        (
            "occurrence=1",  # named as the page names it, not as the command line does
            "occurrence 1 counts the matches of a word, and no word is given: give the word too "
            "(the Word field) or leave the occurrence out",
        ),
    ],
)
def test_explore_refuses_a_bad_address_in_one_line_as_well(browser, base_url, given, error):
    watched = Watched(browser, base_url, f"/?text={quote(BANK)}&{given}")
    page = watched.page
    page.wait_for_function("() => !document.querySelector('[aria-busy]')", timeout=30_000)
    assert page.get_attribute("#app", "data-ready") == "error"  # not the chosen head instead
    assert page.text_content("#error") == error


def test_back_to_a_bad_address_shows_no_choice_that_did_not_apply(browser, base_url):
    bad = f"/?view=ablation&text={quote(BANK)}&word=bank&layer=9&head=mean&scale=abc"
    watched = Watched(browser, base_url, bad)
    page = watched.page
    refused = ablation_outcome(page)
    assert refused == {
        "ready": "error",
        "error": "the Scale field: Input should be a valid number",
        "picked": ["", "", "cosine", ""],  # the selects blank: they offer no layer 9 nor 'mean'
    }
    page.select_option("#ablation-layer", "1")
    page.select_option("#ablation-head", "3")
    page.fill("#ablation-scale", "2")
    page.click("#ablation-run")
    watched.wait("#ablation-result")
    assert ablation_outcome(page)["picked"] == ["1", "3", "cosine", "2"]
    page.go_back()
    page.wait_for_function("() => location.search.includes('layer=9')")
    assert ablation_outcome(page) == refused
    assert page.eval_on_selector("#ablation-layer", "(e) => e.selectedIndex") == -1


def test_user_text_shows_as_text(browser, base_url):
    watched = Watched(browser, base_url)
    page = watched.page
    watched.explore(f"{XSS} bank </script>")
    watched.wait("#app")
    assert page.text_content("#text") == f"{XSS} bank </script>"
    tokens = page.eval_on_selector_all(".token", "(els) => els.map((e) => e.textContent)")
    assert tokens[:3] == ["[CLS]", "<", "im"] and "</" not in tokens  # the tokenizer's pieces

    page.click("#tab-compare")
    page.fill(".sentence-row:nth-child(1) .compare-sentence", f"{XSS} the bank")
    page.fill(".sentence-row:nth-child(2) .compare-sentence", BANK)
    page.fill("#compare-word", "bank")
    page.click("#compare-run")
    watched.wait("#compare-result")
    assert XSS in page.text_content("#compare-attended li[data-sentence='0'] .sentence")
    assert page.locator("img").count() == 0
    watched.check_clean()


def test_errors_show_the_servers_one_line(browser, base_url):
    watched = Watched(browser, base_url)
    page = watched.page
    watched.explore(BANK, "river")
    page.wait_for_selector("#app[data-ready='error']", state="attached")
    assert page.is_visible("#error") and "river" in page.text_content("#error")
    page.fill("#explore-word", "")
    page.click("#explore-run")
    watched.wait("#app")
    assert not page.is_visible("#error")
    # the failed request is the only console message: the browser's own "400" line
    assert len(watched.errors) == 1 and "400" in watched.errors[0]
    assert all(url.startswith(base_url + "/") for url in watched.requests)


CAT = "The cat sat on the mat."
ON_SCREEN = """() => {
    const $ = (selector) => document.querySelector(selector);
    const view = ['explore', 'compare', 'ablation'].find((v) => !$(`#view-${v}`).hidden);
    const inputs = [...document.querySelectorAll(`#${view}-form :is(input, textarea, select)`)];
    const heading = {explore: '#selection', compare: '#compare-result h2',
                     ablation: '#ablation-result h2'};
    return {view, address: location.search, inputs: inputs.map((e) => e.value),
            result: $(heading[view])?.textContent ?? null};
}"""


def on_screen(page) -> dict:
    """The open view, its address and inputs, and its result's heading, once no request is on."""
    page.wait_for_function("() => !document.querySelector('[aria-busy]')", timeout=30_000)
    return page.evaluate(ON_SCREEN)


def test_back_and_forward_show_each_step_again(browser, base_url):
    watched = Watched(browser, base_url)
    page = watched.page
    watched.explore(CAT, "cat")
    steps = [on_screen(page)]
    page.click("#tab-compare")
    steps.append(on_screen(page))
    page.fill("#compare-word", "bank")
    page.click("#compare-run")
    steps.append(on_screen(page))
    page.click("#tab-ablation")
    steps.append(on_screen(page))
    page.fill("#ablation-text", CAT)
    page.fill("#ablation-word", "cat")
    page.click("#ablation-run")
    steps.append(on_screen(page))
    assert [s["view"] for s in steps] == ["explore", "compare", "compare", "ablation", "ablation"]
    assert [s["result"] is None for s in steps] == [False, True, False, True, False]

    for move, step in [("back", 3), ("back", 2), ("back", 1), ("forward", 2), ("forward", 3)]:
        getattr(page, f"go_{move}")()
        page.wait_for_function("(at) => location.search === at", arg=steps[step]["address"])
        assert on_screen(page) == steps[step], (move, step)
    page.click("#tab-explore")  # the explore view kept its result: its tab shows it again
    assert on_screen(page) == steps[0]
    watched.check_clean()


def test_a_failed_request_clears_the_old_result_and_a_tab_clears_the_error(browser, base_url):
    watched = Watched(browser, base_url, f"/?text={quote(BANK)}")
    watched.wait("#app")
    page = watched.page
    forms = [
        ("explore", "#app", lambda: None),
        ("compare", "#compare-result", lambda: None),  # the bank sentences
        ("ablation", "#ablation-result", lambda: page.fill("#ablation-text", BANK)),
    ]
    for view, result, prepare in forms:
        page.click(f"#tab-{view}")
        assert not page.is_visible("#error")  # the last view's error stays with it
        prepare()
        page.fill(f"#{view}-word", "bank")
        page.click(f"#{view}-run")
        watched.wait(result)
        page.fill(f"#{view}-word", "river")
        page.click(f"#{view}-run")
        page.wait_for_selector(f"{result}[data-ready='error']", state="attached")
        assert "river" in page.text_content("#error")
        assert page.eval_on_selector(result, "(e) => e.childElementCount") == 0, view
    page.click("#tab-explore")
    page.keyboard.press("ArrowRight")  # the cleared explorer's keys went with it
    assert "index=" not in page.url


def test_arrow_keys_on_another_view_leave_the_explorer_as_it_was(browser, base_url):
    watched = Watched(browser, base_url, f"/?text={quote(BANK)}&word=bank")
    watched.wait("#app")
    page = watched.page
    before = on_screen(page)
    page.click("#tab-compare")
    page.click("#view-compare .hint")  # the focus on the page, not on a field
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    page.click("#tab-explore")
    assert on_screen(page) == before  # the same query, word and address
    watched.check_clean()


def lines_fit_the_strip(page) -> bool:
    """Once the next frame is drawn: whether the canvas of lines covers the token strip (1 px)."""
    page.evaluate("() => new Promise((done) => requestAnimationFrame(() => setTimeout(done)))")
    return page.evaluate(
        """() => {
            const strip = document.getElementById('strip').getBoundingClientRect();
            const lines = document.getElementById('lines').getBoundingClientRect();
            return strip.width > 0 && Math.abs(lines.width - strip.width) <= 1
                && Math.abs(lines.height - strip.height) <= 1;
        }"""
    )


def explore_answered_behind_compare(watched: Watched, word: str, text: str = BANK) -> None:
    """Explore ``text`` for ``word``, its request answered only once the Compare view is open."""
    page = watched.page
    held = []
    page.route("**/api/view", lambda route: held.append(route))
    watched.explore(text, word)
    for _ in range(600):
        if held:
            break
        page.wait_for_timeout(50)
    page.click("#tab-compare")
    held[0].continue_()


def query_in_view(page) -> bool:
    """Whether the chosen query's token shows inside the token strip's scroll box."""
    return page.evaluate(
        """() => {
            const box = document.querySelector('#app .flow').getBoundingClientRect();
            const token = document.querySelector('#app .token.selected').getBoundingClientRect();
            return token.top >= box.top && token.bottom <= box.bottom;
        }"""
    )


LONG = " ".join([RIVER] * 30) + " Then it rained."  # 396 tokens: many lines of tokens


def test_a_long_texts_strip_scrolls_to_the_query(browser, base_url):
    """The token strip of a long text (a scroll box) stayed at its start when the query was
    further down: the word's last occurrence from the address, a row picked on the map, an
    answer drawn behind another view. It scrolls to show the query, as the map shows its row."""
    watched = Watched(browser, base_url, f"/?text={quote(LONG)}&word=river&occurrence=-1")
    watched.wait("#app")
    page = watched.page
    assert page.text_content("#selection").endswith("query 385 “river”")
    assert query_in_view(page)
    page.focus("#heatmap")
    page.keyboard.press("Home")  # the map's keys move the query (the focus stays on the map)
    assert page.text_content("#selection").endswith("query 0 “[CLS]”") and query_in_view(page)
    page.keyboard.press("End")
    assert query_in_view(page)

    explore_answered_behind_compare(watched, "rained", LONG)
    page.wait_for_selector("#app[data-ready='true']", state="attached")  # drawn while hidden
    page.click("#tab-explore")
    assert page.text_content("#selection").endswith("query 393 “rained”")
    page.evaluate("() => new Promise((done) => requestAnimationFrame(() => setTimeout(done)))")
    assert query_in_view(page)
    watched.check_clean()


def test_the_lines_follow_the_tokens_drawn_or_resized_behind_another_view(browser, base_url):
    watched = Watched(browser, base_url)
    page = watched.page
    explore_answered_behind_compare(watched, "bank")
    page.wait_for_selector("#app[data-ready='true']", state="attached")  # drawn while hidden
    page.click("#tab-explore")
    assert lines_fit_the_strip(page)
    page.click("#tab-compare")
    page.set_viewport_size({"width": 900, "height": 800})  # the window resized while hidden
    page.click("#tab-explore")
    assert lines_fit_the_strip(page)
    watched.check_clean()


def test_an_error_that_comes_back_while_another_view_is_open_shows_on_return(browser, base_url):
    watched = Watched(browser, base_url)
    page = watched.page
    explore_answered_behind_compare(watched, "river")  # the server answers 400: no "river"
    page.wait_for_selector("#app[data-ready='error']", state="attached")
    assert not page.is_visible("#error")  # not the compare view's error
    page.click("#tab-explore")
    assert page.is_visible("#error") and "river" in page.text_content("#error")
    page.click("#tab-compare")
    assert not page.is_visible("#error")
    page.click("#tab-explore")
    page.unroute("**/api/view")
    page.fill("#explore-word", "")
    page.click("#explore-run")
    watched.wait("#app")
    assert not page.is_visible("#error")
    assert len(watched.errors) == 1 and "400" in watched.errors[0]


def test_a_server_that_does_not_answer_is_said_so(browser, base_url):
    watched = Watched(browser, base_url)
    page = watched.page
    page.route("**/api/view", lambda route: route.abort())  # as when the server has stopped
    watched.explore(BANK)
    page.wait_for_selector("#app[data-ready='error']", state="attached")
    assert page.text_content("#error") == (
        "cannot reach the explorer's server: is `selfattn serve` still running?"
    )


def test_a_run_that_takes_a_while_says_so_on_screen_in_its_own_view(browser, base_url):
    """A slow or stalled server showed nothing: the click on Explore left the page as it was
    (the running line was for screen readers only). Now a line says the view runs, counts
    the seconds after a while, follows its view through the tabs and goes with the answer."""
    watched = Watched(browser, base_url)
    page = watched.page
    held = []
    page.route("**/api/view", lambda route: held.append(route))  # no answer yet
    watched.explore(BANK)
    page.wait_for_selector("#progress", state="visible", timeout=5_000)
    assert page.text_content("#progress") == "Explore: running the model…"
    page.wait_for_function(
        "() => / [2-9] s$/.test(document.getElementById('progress').textContent)", timeout=6_000
    )
    page.click("#tab-compare")  # the run belongs to Explore
    assert not page.is_visible("#progress")
    page.click("#tab-explore")
    assert page.is_visible("#progress")
    assert page.text_content("#progress").startswith("Explore: running the model… ")
    held[0].continue_()
    watched.wait("#app")
    assert not page.is_visible("#progress")
    page.unroute("**/api/view")
    watched.explore(RIVER)  # a quick run: its result, no line flashing by
    watched.wait("#app")
    assert not page.is_visible("#progress")
    watched.check_clean()


def test_the_old_result_takes_no_clicks_while_a_new_run_is_in_flight(browser, base_url):
    """A click on the old, dimmed result during a run wrote its layer, head and token into
    the new run's address (and emptied the Word field): a reload then showed another error.
    The old result is inert until the answer comes."""
    watched = Watched(browser, base_url)
    page = watched.page
    watched.explore(BANK, "bank")
    watched.wait("#app")
    held = []
    page.route("**/api/view", lambda route: held.append(route))
    watched.explore(RIVER, "river")
    page.wait_for_function("() => document.getElementById('app').inert")
    address = page.url
    page.click(".token[data-index='7']", force=True)  # as a user's click: it reaches nothing
    assert page.url == address and page.input_value("#explore-word") == "river"
    page.wait_for_function("() => document.querySelectorAll('.token').length > 0")
    held[0].continue_()
    watched.wait("#app")
    assert not page.evaluate("document.getElementById('app').inert")
    page.unroute("**/api/view")
    watched.check_clean()


def test_explore_says_why_it_opened_on_the_head_it_chose(browser, base_url):
    """A word without a layer and head opened on layer 0, head 4 without a word on why (the
    command line says "chosen: ..."); the reason shows while that layer and head are on."""
    watched = Watched(browser, base_url)
    page = watched.page
    watched.explore(BANK, "bank")
    watched.wait("#app")
    expected = api(base_url, "/api/view", {"text": BANK, "word": "bank"})["choice"]
    assert page.is_visible("#choice") and page.text_content("#choice") == expected
    assert expected.startswith("chosen: 'bank' puts the most weight here")
    # The address leaves the chosen layer and head out: reloaded or shared, it chooses them
    # again and says why (it wrote layer=0&head=4, and a reload lost the reason).
    assert "layer=" not in page.url and "head=" not in page.url
    page.reload()
    page.wait_for_selector("#app[data-ready='true']", timeout=30_000)
    assert page.is_visible("#choice") and page.text_content("#choice") == expected
    page.select_option("#head", "5")
    assert not page.is_visible("#choice")
    assert "layer=0&head=5" in page.url  # the user's choice: in the address
    page.select_option("#head", "4")
    assert page.is_visible("#choice")
    watched.open(f"/?text={quote(BANK)}&word=bank&layer=0&head=4")  # as asked: no reason
    watched.wait("#app")
    assert not page.is_visible("#choice")
    watched.check_clean()


def test_a_space_token_is_shown_as_the_command_line_shows_it(browser, decoder_url):
    """A character model's space token was blank in Explore (the strip, the step table, the
    list of keys, the selection) and in Similarity & scale: a key without a name. It is "␣",
    as `selfattn explain` and the Generate view show it."""
    text = "the bank"  # token 3: " "
    watched = Watched(browser, decoder_url, f"/?text={quote(text)}&word=bank&layer=1&head=0")
    watched.wait("#app")
    page = watched.page
    assert page.text_content(".token[data-index='3']") == "␣"
    assert page.text_content("#steps tr[data-key='3'] bdi [aria-hidden='true']") == "␣"  # shown
    assert page.text_content("#steps tr[data-key='3'] bdi .visually-hidden") == "space"  # read
    assert page.text_content("#top-keys li[data-key='3'] .tok") == "␣"
    page.click(".token[data-index='3']")
    assert page.text_content("#selection") == "layer 1 · head 0 · query 3 “␣”"
    watched.open(f"/?view=ablation&text={quote(text)}&word=bank&layer=1&head=0&scale=1")
    watched.wait("#ablation-result")
    assert page.text_content("#ablation-table tr[data-key='3'] .key") == "3 ␣"
    watched.check_clean()


def test_similarity_and_scale_shows_a_tiny_scale_as_given(browser, base_url):
    """A scale of 1e-30 read "scale 0.0000" (Explore writes 1.000e-30)."""
    address = f"/?view=ablation&text={quote(BANK)}&word=bank&scale=1e-30"
    watched = Watched(browser, base_url, address)
    watched.wait("#ablation-result")
    line = watched.page.eval_on_selector(
        "#ablation-entropy-recomputed", "(e) => e.parentElement.textContent"
    )
    assert line.startswith("recomputed: cosine, scale 1.000e-30 · entropy "), line
    watched.check_clean()


@pytest.mark.parametrize("width", [400, 320])  # 320: the narrowest phones (WCAG's reflow)
def test_a_narrow_window_does_not_scroll_sideways(browser, base_url, width):
    watched = Watched(browser, base_url)
    page = watched.page
    page.set_viewport_size({"width": width, "height": 800})
    four = (BANK, RIVER, RATES, "She sat on the river bank.")
    sentences = "&".join(f"s={quote(s)}" for s in four)
    addresses = [
        ("#app", f"/?text={quote(BANK)}&word=bank"),
        ("#compare-result", f"/?view=compare&{sentences}&word=bank"),
        ("#ablation-result", f"/?view=ablation&text={quote(BANK)}&word=bank&scale=1"),
    ]
    for result, address in addresses:
        watched.open(address)
        watched.wait(result)
        assert page.evaluate("document.documentElement.scrollWidth") <= width, address
    bars = page.eval_on_selector_all(
        ".bar-track",
        "(bars) => bars.filter((b) => b.getClientRects().length).map((b) => b.clientWidth)",
    )
    assert all(bar >= 40 for bar in bars)  # shown whole or not at all (a phone shows the numbers)
    watched.check_clean()


@pytest.mark.parametrize("width", [1400, 400])
def test_the_map_tip_shows_whole_inside_the_window(browser, base_url, width):
    from io import BytesIO

    from PIL import Image

    watched = Watched(browser, base_url)
    page = watched.page
    page.set_viewport_size({"width": width, "height": 800})
    watched.open(f"/?text={quote(BANK)}&word=bank")
    watched.wait("#app")
    page.eval_on_selector("#heatmap", "(e) => e.scrollIntoView()")
    # 11 tokens: their cells after an 84 px margin, the whole map in its box; hover the last key
    drawn = page.eval_on_selector("#heatmap", "(e) => e.getBoundingClientRect().toJSON()")
    cell = (drawn["height"] - 84) / 11
    page.mouse.move(drawn["x"] + 84 + cell * 10.5, drawn["y"] + 84 + cell * 2.5)
    assert page.text_content("#map-tip").startswith("query 2 “went” → key 10 ")
    tip = page.eval_on_selector("#map-tip", "(e) => e.getBoundingClientRect().toJSON()")
    assert tip["left"] >= 0 and tip["right"] <= width and tip["top"] >= 0 and tip["bottom"] <= 800
    # drawn whole: the tip's dark ground at its right edge, not clipped by the scroll box
    shot = page.screenshot(clip={"x": tip["right"] - 4, "y": tip["top"] + tip["height"] / 2,
                                 "width": 1, "height": 1})  # fmt: skip
    assert Image.open(BytesIO(shot)).convert("RGB").getpixel((0, 0)) == (15, 23, 42)
    watched.check_clean()


def test_more_sentences_than_the_limit_are_said_to_be_left_out(browser, base_url):
    five = (BANK, RIVER, RATES, "She sat on the river bank.", CAT)
    sentences = "&".join(f"s={quote(s)}" for s in five)
    watched = Watched(browser, base_url, f"/?view=compare&{sentences}&word=bank")
    watched.wait("#compare-result")
    page = watched.page
    assert page.text_content("#compare-notice") == (
        "The explorer compares at most 4 sentences: 1 more left out."
    )
    assert page.locator(".compare-sentence").count() == 4
    assert page.locator("#compare-attended li").count() == 4
    # the address keeps what is shown (it kept all five: a reload said "1 more left out" again)
    query = parse_qs(urlsplit(page.url).query)
    assert (query["s"], query["word"], query["view"]) == (list(five[:4]), ["bank"], ["compare"])
    page.reload()
    page.wait_for_selector("body[data-ready='true']", timeout=30_000)
    watched.wait("#compare-result")
    assert not page.is_visible("#compare-notice")
    assert page.locator("#compare-attended li").count() == 4
    page.click("#compare-bank")
    assert not page.is_visible("#compare-notice")
    # an empty s= takes no place: four sentences besides it all run, none said left out
    blank = "&".join(f"s={quote(s)}" for s in ("", *five[:4]))
    page.goto(f"{base_url}/?view=compare&{blank}&word=bank")
    page.wait_for_selector("body[data-ready='true']", timeout=30_000)
    watched.wait("#compare-result")
    assert not page.is_visible("#compare-notice")
    assert page.locator("#compare-attended li").count() == 4
    watched.check_clean()


def test_wording_of_equal_entropies_sentence_counts_and_the_text_limit(browser, base_url):
    same = f"/?view=ablation&text={quote(BANK)}&word=bank&similarity=dot"  # the model's own way
    watched = Watched(browser, base_url, same)
    watched.wait("#ablation-result")
    page = watched.page
    verdict = page.text_content("#ablation-verdict")
    assert verdict == "recomputed weights are as spread as the model's"

    page.click("#tab-explore")
    page.fill("#explore-text", "x" * (server.MAX_CHARS + 500))  # cut at the limit, and said so
    assert len(page.input_value("#explore-text")) == server.MAX_CHARS
    assert page.text_content("#explore-text-limit").startswith("2,000 characters at most")
    page.fill("#explore-text", BANK)
    assert not page.is_visible("#explore-text-limit")

    page.click("#tab-compare")
    page.fill(".sentence-row:nth-child(2) .compare-sentence", "")
    page.fill("#compare-word", "bank")
    page.click("#compare-run")
    page.wait_for_selector("#compare-result[data-ready='error']", state="attached")
    assert page.text_content("#error") == "give 2 to 4 sentences to compare"


def test_each_sentence_to_compare_is_held_to_the_text_limit_and_says_so(browser, base_url):
    watched = Watched(browser, base_url, "/?view=compare")
    page = watched.page
    page.click("#compare-add")
    limit = server.MAX_CHARS
    for n in (2, 3):  # a sentence added too
        sentence = f".sentence-row:nth-child({n}) .compare-sentence"
        page.fill(sentence, "x" * (limit + 500))
        assert len(page.input_value(sentence)) == limit
        assert page.text_content("#compare-sentences-limit") == (
            "2,000 characters at most: the rest of a longer text is left out."
        )
        assert page.get_attribute(sentence, "aria-describedby") == "compare-sentences-limit"
        page.fill(sentence, BANK)
        assert not page.is_visible("#compare-sentences-limit")
    watched.check_clean()


def test_the_text_limit_is_said_when_a_text_was_cut_only(browser, base_url):
    """The notice shows when an edit was cut at the limit (filled, typed or pasted), until the
    next edit; never for a text that fits, one of exactly the limit included."""
    watched = Watched(browser, base_url)
    page = watched.page
    limit = server.MAX_CHARS

    def edit(action) -> tuple[int, bool]:
        action()
        return len(page.input_value("#explore-text")), page.is_visible("#explore-text-limit")

    def fill(n: int):
        return edit(lambda: page.fill("#explore-text", "x" * n))

    assert fill(limit - 1) == (limit - 1, False)
    assert fill(limit) == (limit, False)
    assert fill(limit + 1) == (limit, True)
    assert page.text_content("#explore-text-limit") == (
        "2,000 characters at most: the rest of a longer text is left out."
    )
    assert fill(limit) == (limit, False)  # this edit fits
    assert edit(lambda: page.keyboard.type("y")) == (limit, True)  # typed at the limit
    assert edit(lambda: page.keyboard.press("Backspace")) == (limit - 1, False)

    def paste(text: str, into: int):
        fill(into)
        page.evaluate("(text) => navigator.clipboard.writeText(text)", text)
        return edit(lambda: page.keyboard.press("Control+V"))

    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    assert paste("line\r\n" * 2, limit - 10) == (limit, False)  # a line break counts one
    assert paste("line\r\n" * 2 + "!", limit - 10) == (limit, True)
    watched.check_clean()


def test_the_title_names_the_view_shown_and_the_model(browser, base_url, decoder_url):
    """The window's title follows the tabs, Back and Forward, whichever view ran last."""
    watched = Watched(browser, base_url, f"/?text={quote(BANK)}&word=bank")
    watched.wait("#app")
    page = watched.page
    titled = "{} · all-MiniLM-L6-v2 · selfattn web explorer".format
    assert page.title() == titled("Explore")
    page.click("#tab-compare")
    assert page.title() == titled("Compare a word")
    page.click("#compare-run")
    watched.wait("#compare-result")
    page.click("#tab-ablation")
    assert page.title() == titled("Similarity & scale")
    page.go_back()
    page.wait_for_function("() => !document.querySelector('[aria-busy]')")
    assert page.title() == titled("Compare a word")
    page.click("#tab-explore")
    page.click("#explore-run")
    watched.wait("#app")
    assert page.title() == titled("Explore")
    watched.check_clean()

    decoder = httpx.get(decoder_url + "/api/models").json()["models"][0]["name"]
    watched = Watched(browser, decoder_url, generate_address(prompt=PROMPT, n=3, seed=1))
    watched.wait("#generate-result")
    assert watched.page.title() == f"Generate · {decoder} · selfattn web explorer"
    watched.check_clean()


def test_entropies_the_same_as_shown_are_as_spread_whatever_the_rounding_noise(browser, base_url):
    # the model's own similarity, and its scale 1/sqrt(32) to 7 digits: entropies 3e-7 apart
    same = f"/?view=ablation&text={quote(BANK)}&word=bank&similarity=dot&scale=0.1767767"
    watched = Watched(browser, base_url, same)
    watched.wait("#ablation-result")
    page = watched.page
    entropies = [f"#ablation-entropy-{whose}" for whose in ("model", "recomputed")]
    assert len({page.get_attribute(shown, "data-value") for shown in entropies}) == 2
    assert len({page.text_content(shown) for shown in entropies}) == 1
    verdict = page.text_content("#ablation-verdict")
    assert verdict == "recomputed weights are as spread as the model's"  # as the terminal says
    watched.check_clean()


def test_similarity_and_scale_says_to_pick_another_head_with_its_fields(browser, base_url):
    watched = Watched(browser, base_url, f"/?view=ablation&text={quote(BANK)}&word=bank")
    watched.wait("#ablation-result")
    choice = watched.page.text_content("#ablation-result .hint")
    assert choice.startswith("chosen: ")
    assert choice.endswith("; pick another with the Layer field or the Head field")


def test_adding_and_removing_sentences_by_keyboard_keeps_the_focus_on_the_sentences(
    browser, base_url
):
    """Enter on "+ sentence" left the focus on the button (and, once it turned off at the limit,
    on nothing); Enter on a sentence's "×" removed the button with the focus in it: a keyboard
    user was sent back to the page's start. The focus goes to the sentence added, or to the
    one that takes the removed one's place."""
    watched = Watched(browser, base_url, "/?view=compare")
    page = watched.page
    focused = "() => document.activeElement.getAttribute('aria-label')"
    page.focus("#compare-add")
    page.keyboard.press("Enter")
    assert page.evaluate(focused) == "sentence 3"
    page.keyboard.type(RATES)
    page.focus("#compare-add")
    page.keyboard.press("Enter")
    assert page.evaluate(focused) == "sentence 4" and page.is_disabled("#compare-add")
    page.focus(".sentence-row:nth-child(2) .remove")
    page.keyboard.press("Enter")
    assert page.evaluate(focused) == "sentence 2"
    assert page.input_value(".sentence-row:nth-child(2) .compare-sentence") == RATES
    page.focus(".sentence-row:nth-child(3) .remove")  # the last: the one before it
    page.keyboard.press("Enter")
    assert page.evaluate(focused) == "sentence 2"
    assert page.locator(".compare-sentence").count() == 2
    watched.check_clean()


def test_a_sentence_can_be_removed_only_while_more_than_two_are_left(browser, base_url):
    watched = Watched(browser, base_url, "/?view=compare")
    page = watched.page
    removes = page.locator(".sentence-row .remove")

    def removable() -> list[tuple[bool, str]]:
        return [(removes.nth(i).is_enabled(), removes.nth(i).get_attribute("title"))
                for i in range(removes.count())]  # fmt: skip

    two_left = (False, "Compare needs at least two sentences")
    assert removable() == [two_left] * 2
    page.click("#compare-add")
    assert removable() == [(True, f"remove sentence {n}") for n in (1, 2, 3)]
    page.click(".sentence-row:nth-child(1) .remove")
    assert removable() == [two_left] * 2
    watched.check_clean()


def test_screen_readers_hear_each_result_and_name_each_sentence(browser, base_url):
    watched = Watched(browser, base_url)
    page = watched.page
    watched.explore(BANK)
    watched.wait("#app")
    assert page.text_content("[role='status']#status") == "Explore: the result is below."

    page.click("#tab-compare")
    page.click("#compare-add")
    page.click(".sentence-row:nth-child(1) .remove")  # the others move up: so do their names
    names = page.eval_on_selector_all(
        ".sentence-row",
        """(rows) => rows.map((row) => [row.querySelector('input').getAttribute('aria-label'),
                                        row.querySelector('.remove').getAttribute('aria-label')])""",
    )
    assert names == [["sentence 1", "remove sentence 1"], ["sentence 2", "remove sentence 2"]]
    watched.check_clean()


def test_right_to_left_text_is_typed_and_shown_right_to_left(browser, base_url):
    arabic = "ذهبت إلى bank اليوم."  # Arabic first, so read right to left
    watched = Watched(
        browser, base_url, f"/?view=compare&s={quote(arabic)}&s={quote(RIVER)}&word=bank"
    )
    watched.wait("#compare-result")
    page = watched.page
    directions = page.evaluate(
        """() => [document.querySelector('.compare-sentence'),
                  document.querySelector('#compare-attended .sentence')]
                 .map((e) => getComputedStyle(e).direction)"""
    )
    assert directions == ["rtl", "rtl"]
    page.click("#tab-explore")
    page.fill("#explore-text", arabic)
    assert page.eval_on_selector("#explore-text", "(e) => getComputedStyle(e).direction") == "rtl"
    watched.check_clean()


def test_the_page_has_a_main_landmark_and_a_heading_for_each_view(browser, decoder_url):
    """The live page had no <main> and no heading for the page nor for its views: a screen
    reader's lists of landmarks and headings were empty of them."""
    watched = Watched(browser, decoder_url)
    page = watched.page
    assert page.locator("main").count() == 1
    assert page.eval_on_selector_all("h1", "(hs) => hs.map((h) => h.textContent)") == [
        "selfattn · web explorer"
    ]
    for view, title in (
        ("explore", "Explore a text"), ("compare", "Compare a word"),
        ("ablation", "Similarity & scale"), ("generate", "Generate"),
    ):  # fmt: skip
        page.click(f"#tab-{view}")
        section = page.get_by_role("region", name=title, exact=True)
        assert section.get_attribute("id") == f"view-{view}"
        assert section.evaluate("(e) => e.parentElement.tagName") == "MAIN"
        assert page.get_by_role("heading", name=title, exact=True).count() == 1
    # A rendered view's headings sit below its section's: its model's name was a second h1.
    page.click("#tab-explore")
    watched.explore(PROMPT)
    watched.wait("#app")
    page.click("#tab-generate")
    page.fill("#generate-prompt", PROMPT)
    page.click("#generate-run")
    watched.wait("#generate-result")
    for view in ("explore", "generate"):
        levels = page.eval_on_selector_all(
            f"#view-{view} :is(h1, h2, h3, h4, h5, h6)", "(hs) => hs.map((h) => +h.tagName[1])"
        )
        assert levels[:2] == [2, 3] and min(levels) == 2 and max(levels) == 5, levels
        assert all(b - a <= 1 for a, b in pairwise(levels)), levels  # no level skipped
        size = "(h) => getComputedStyle(h).fontSize"  # styled as on a page of its own
        assert page.eval_on_selector(f"#view-{view} .depth-0", size) == "26px"
        assert page.eval_on_selector(f"#view-{view} .depth-1", size) == "17px"
    watched.check_clean()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_open_tab_is_marked_by_more_than_its_colour(browser, base_url, scheme):
    """The open view's tab differed from the others by its colours only (WCAG 1.4.1): it has
    a bar along its top, in the accent's colour, at 3:1 on the page."""
    watched = Watched(browser, base_url)
    page = watched.page
    emulate(page, color_scheme=scheme)
    page.click("#tab-compare")
    bars = page.eval_on_selector_all(
        ".tab:not([hidden])", "(tabs) => tabs.map((t) => getComputedStyle(t).boxShadow)"
    )
    assert bars[0] == bars[2] == "none" and bars[1].endswith("inset")
    bar = [int(c) for c in bars[1][4 : bars[1].index(")")].split(",")]
    ground = page.eval_on_selector("#tab-compare", "(e) => getComputedStyle(e).backgroundColor")
    assert contrast(bar, [int(c) for c in ground[4:-1].split(",")]) >= 3
    watched.check_clean()


def test_similarity_and_scale_names_its_table_and_lets_the_keyboard_scroll_it(browser, base_url):
    """Its table's box scrolled but was neither focusable nor named, and the columns over
    the bars were empty headers."""
    watched = Watched(browser, base_url, f"/?view=ablation&text={quote(BANK)}&word=bank")
    watched.wait("#ablation-result")
    page = watched.page
    title = page.text_content("#ablation-title")
    box = page.get_by_role("region", name=title, exact=True)
    assert box.get_attribute("tabindex") == "0" and box.locator("#ablation-table").count() == 1
    assert page.get_by_role("table", name=title, exact=True).count() == 1
    headers = page.eval_on_selector_all(
        "#ablation-table th", "(ths) => ths.map((t) => t.textContent)"
    )
    assert headers == ["key", "model", "recomputed"]
    compare = Watched(
        browser, base_url, f"/?view=compare&s={quote(BANK)}&s={quote(RIVER)}&word=bank"
    )
    compare.wait("#compare-result")
    name = "cosine similarity of its vectors, layer by layer"
    assert compare.page.get_by_role("region", name=name, exact=True).locator("table").count() == 1
    watched.check_clean()
    compare.check_clean()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_every_view_reads_at_4_5_to_1_in_light_and_in_dark(browser, base_url, scheme):
    watched = Watched(browser, base_url)
    page = watched.page
    emulate(page, color_scheme=scheme)
    ground = page.eval_on_selector("body", "(e) => getComputedStyle(e).backgroundColor")
    dark = luminance([int(c) for c in ground[4:-1].split(",")]) < 0.05
    assert dark == (scheme == "dark")
    four = "&".join(f"s={quote(s)}" for s in (BANK, RIVER, RATES, "A bank."))
    for result, address in [
        ("#app", f"/?text={quote(BANK)}&word=bank"),
        ("#compare-result", f"/?view=compare&{four}&word=bank"),
        ("#ablation-result", f"/?view=ablation&text={quote(BANK)}&word=bank&scale=1"),
    ]:
        watched.open(address)
        watched.wait(result)
        assert page.evaluate(LOW_CONTRAST) == [], address
    page.fill("#ablation-word", "river")  # an error, and the notice of a text cut at the limit
    page.click("#ablation-run")
    page.wait_for_selector("#ablation-result[data-ready='error']", state="attached")
    page.fill("#ablation-text", "x" * (server.MAX_CHARS + 1))
    assert page.is_visible("#error") and page.is_visible("#ablation-text-limit")
    assert page.evaluate(LOW_CONTRAST) == []


# ---------------------------------------------------------------------------------------------
# Generate: a decoder's continuation, one strip per new token (generation.js)

PROMPT = "the bank "  # in char_gpt's alphabet


def generate_address(**fields: str | int) -> str:
    """The Generate view's address, as the page writes it."""
    return "/?" + urlencode({"view": "generate"} | fields)


def strips_shown(page) -> dict:
    """The Generate view's text, strips, selection and top keys, once no request is on."""
    page.wait_for_function("() => !document.querySelector('[aria-busy]')", timeout=30_000)
    return page.evaluate(
        """() => {
            const result = document.getElementById('generate-result');
            const text = (selector) => result.querySelector(selector)?.textContent ?? null;
            return {
                ready: result.dataset.ready, text: text('#generate-text'),
                rows: result.querySelector('#generate-strips')?.dataset.rows ?? null,
                generated: result.querySelectorAll('.token.generated').length,
                selection: text('#generate-selection'),
                top: [...result.querySelectorAll('#generate-top-keys li')]
                    .map((li) => li.dataset.key),
            };
        }"""
    )


def test_the_generate_tab_shows_for_a_decoder_only(browser, base_url, decoder_url):
    for address, decoder in ((base_url, False), (decoder_url, True)):
        watched = Watched(browser, address)
        assert watched.page.is_visible("#tab-generate") == decoder
        watched.check_clean()


def test_generate_shows_one_strip_per_new_token_and_the_address_gives_it_again(
    browser, decoder_url
):
    watched = Watched(browser, decoder_url)
    page = watched.page
    page.click("#tab-generate")
    page.fill("#generate-prompt", PROMPT)
    page.fill("#generate-n", "12")
    page.fill("#generate-temperature", "0.9")
    page.fill("#generate-seed", "5")
    page.click("#generate-run")
    watched.wait("#generate-result")
    body = {"prompt": PROMPT, "max_new_tokens": 12, "temperature": 0.9, "seed": 5}
    expected = api(decoder_url, "/api/generate", body)
    shown = strips_shown(page)
    assert (shown["rows"], shown["generated"]) == ("12", 12)
    assert shown["text"] == PROMPT + expected["text"]
    result = page.locator("#generate-result")
    axes = result.locator("#generate-axes").text_content()
    assert axes == "rows: queries (the new tokens), columns: keys"
    hint = result.locator("#generate-strips-hint").text_content()
    assert "Rows are queries" in hint and "Columns are keys" in hint
    repeat = result.locator("#generate-repeat").text_content()
    assert repeat == "Seed 5: reloading this address gives the same text."

    result.locator(".token.generated[data-step='4']").click()
    result.locator("#generate-head").select_option("0")
    address = generate_address(
        prompt=PROMPT, n=12, temperature=0.9, seed=5, layer=1, head=0, step=4
    )
    assert page.url == decoder_url + address
    chosen = strips_shown(page)
    assert chosen["selection"].startswith("layer 1 · head 0 · new token 13 ")
    page.reload()
    watched.wait("#generate-result")
    assert strips_shown(page) == chosen  # the same text, strip, head and top keys
    assert page.input_value("#generate-seed") == "5" and page.url == decoder_url + address
    watched.check_clean()


def test_generate_says_its_text_and_every_weight_of_the_chosen_strip(browser, decoder_url):
    """The text as text in a named region the keyboard reaches (the reload note under it), and
    the chosen strip's every key and weight in a table, as on `generate --html`'s page."""
    watched = Watched(browser, decoder_url, generate_address(prompt=PROMPT, n=5, seed=1))
    watched.wait("#generate-result")
    page = watched.page
    expected = api(decoder_url, "/api/generate", {"prompt": PROMPT, "max_new_tokens": 5, "seed": 1})
    text = page.get_by_role("region", name="Generated text", exact=True)
    assert text.text_content() == PROMPT + expected["text"]
    assert text.get_attribute("tabindex") == "0" and text.get_attribute("id") == "generate-text"
    card = "(e) => e.closest('.card').querySelector('#generate-repeat') !== null"
    assert text.evaluate(card)
    page.click(".token.generated[data-step='2']")
    query = expected["queries"][2]
    weights = page.eval_on_selector_all(
        "#generate-steps tbody tr [data-weight]", "(cells) => cells.map((c) => +c.dataset.weight)"
    )
    assert len(weights) == query + 1 and math.isclose(sum(weights), 1, abs_tol=1e-5)
    watched.check_clean()


@pytest.mark.parametrize(
    ("sampling", "note"),
    [
        ({}, "No seed: reloading this address samples anew, another text. Give a seed to keep"),
        ({"temperature": 0}, "Temperature 0 (greedy): reloading this address gives the same"),
    ],
)
def test_generate_says_whether_a_reload_gives_the_same_text(browser, decoder_url, sampling, note):
    watched = Watched(browser, decoder_url, generate_address(prompt=PROMPT, n=3, **sampling))
    watched.wait("#generate-result")
    assert watched.page.text_content("#generate-repeat").startswith(note)
    watched.check_clean()


def test_back_and_forward_show_each_generation_again(browser, decoder_url):
    watched = Watched(browser, decoder_url, generate_address(prompt=PROMPT, n=4, seed=1))
    page = watched.page
    watched.wait("#generate-result")
    first = strips_shown(page)
    page.fill("#generate-n", "6")
    page.click("#generate-run")
    page.wait_for_function("() => document.querySelectorAll('.token.generated').length === 6")
    second = strips_shown(page)
    page.go_back()
    page.wait_for_function("() => document.querySelectorAll('.token.generated').length === 4")
    assert strips_shown(page) == first and page.input_value("#generate-n") == "4"
    page.go_forward()
    page.wait_for_function("() => document.querySelectorAll('.token.generated').length === 6")
    assert strips_shown(page) == second
    watched.check_clean()


def test_explore_and_generate_results_on_one_page_have_no_id_twice(browser, decoder_url):
    """Both views draw a layer select, a selection line, a legend...: each under its own id."""
    watched = Watched(browser, decoder_url)
    page = watched.page
    watched.explore(PROMPT)
    watched.wait("#app")
    page.click("#tab-generate")
    page.fill("#generate-prompt", PROMPT)
    page.fill("#generate-n", "4")
    page.click("#generate-run")
    watched.wait("#generate-result")
    ids = page.evaluate("() => [...document.querySelectorAll('[id]')].map((el) => el.id)")
    assert sorted({name for name in ids if ids.count(name) > 1}) == []
    assert page.eval_on_selector("#app", "(app) => app.contains(document.getElementById('layer'))")
    generated = page.locator("#generate-result")
    assert generated.locator("#generate-layer").count() == 1
    assert generated.locator("#generate-strips").count() == 1
    watched.check_clean()


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ({"n": 500}, "500 new tokens asked for; the explorer generates at most 200 a run: ask for"),
        ({"prompt": "THE"}, "characters not in the model's vocabulary: 'EHT'; use only"),
        ({"seed": "x"}, "the Seed field: Input should be a valid integer"),
        ({"layer": 2}, "layer 2 out of range: the model has layers 0..1 (or -2..-1)"),
    ],
)
def test_generate_refuses_a_bad_address_in_one_line(browser, decoder_url, given, error):
    watched = Watched(browser, decoder_url, generate_address(**({"prompt": PROMPT} | given)))
    page = watched.page
    assert strips_shown(page)["ready"] == "error"  # nothing else ran instead
    assert page.text_content("#error").startswith(error)
    assert page.eval_on_selector("#generate-result", "(e) => e.childElementCount") == 0


def open_tab(page) -> tuple[str, list[str]]:
    """The one view on screen, and the tabs highlighted (each a visible tab)."""
    shown = page.eval_on_selector_all(".view:not([hidden])", "(views) => views.map((v) => v.id)")
    assert len(shown) == 1
    active = page.eval_on_selector_all(
        ".tab.active", "(tabs) => tabs.filter((t) => !t.hidden).map((t) => t.id)"
    )
    return shown[0], active


@pytest.mark.parametrize("address", [generate_address(prompt=BANK), generate_address()])
def test_generate_on_an_encoder_shows_explore_and_says_it_needs_a_decoder(
    browser, base_url, address
):
    """The Generate view showed under no highlighted tab (its tab hidden for an encoder): the
    page shows Explore under its tab, and the server's line on why Generate is not there."""
    watched = Watched(browser, base_url, address)
    page = watched.page
    page.wait_for_selector("#error", state="visible")
    assert page.text_content("#error").startswith("Generate needs a decoder (GPT or Llama family);")
    assert open_tab(page) == ("view-explore", ["tab-explore"])
    assert page.get_attribute("#tab-explore", "aria-pressed") == "true"
    page.click("#tab-compare")  # the line went with the view it was said in
    assert not page.is_visible("#error")
    assert len(watched.errors) == 1 and "400" in watched.errors[0]  # the refusal


@pytest.mark.parametrize("view", ["constructor", "__proto__", "toString", "nope"])
def test_an_address_naming_no_view_shows_explore_under_its_tab(browser, base_url, view):
    """?view=constructor showed no view at all (the name of an Object property, not a view's),
    ?view=__proto__ left the page on an error of its script: both show Explore, as other names."""
    watched = Watched(browser, base_url, f"/?view={view}&text={quote(BANK)}")
    watched.wait("#app")
    assert open_tab(watched.page) == ("view-explore", ["tab-explore"])
    watched.check_clean()


@pytest.mark.parametrize(("scheme", "width"), [("light", 1400), ("dark", 1400), ("light", 320)])
def test_the_generate_view_reads_at_4_5_to_1_and_fits_the_window(
    browser, decoder_url, scheme, width
):
    watched = Watched(browser, decoder_url)
    page = watched.page
    emulate(page, color_scheme=scheme)
    page.set_viewport_size({"width": width, "height": 800})
    watched.open(generate_address(prompt=PROMPT, n=40))
    watched.wait("#generate-result")
    assert page.evaluate(LOW_CONTRAST) == []
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    watched.check_clean()
