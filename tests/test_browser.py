"""The HTML explorer in headless chromium: numbers agree with selfattn.attention, nothing is
fetched, no console errors, user text stays text, and a 512-token page draws.

Tolerance: 1e-6 absolute; the page computes in float64 from the float32 q, k, v that the
reference computes with in float32.
"""

import math
import time
from pathlib import Path

import pytest
import torch

from conftest import WatchedPage, needs_chromium
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
    tmp_path, similarity="dot", causal=False, tokens=TOKENS, **selection
) -> tuple[Path, tuple]:
    q, k, v = qkv()
    data = page_payload(
        tokens=tokens,
        query=q,
        key=k,
        value=v,
        scale=default_scale(similarity, D),
        similarity=similarity,
        model_name="random q/k/v",
        text=" ".join(tokens),
        layer=selection.get("layer", 1),
        head=selection.get("head", 2),
        query_index=selection.get("query_index"),
        causal=causal,
    )
    path = tmp_path / f"page-{similarity}-{causal}.html"
    path.write_text(render_page(data), encoding="utf-8")
    return path, (q, k, v)


class Watched(WatchedPage):
    """The offline page, opened from its file."""

    def __init__(self, browser, path: Path, fragment: str = ""):
        super().__init__(browser)
        self.url = path.as_uri()
        self.page.goto(self.url + fragment)
        self.page.wait_for_selector("#app[data-ready='true']", timeout=30_000)

    def check_clean(self):
        assert self.errors == []
        assert [url for url in self.requests if url != self.url] == []


def reference(q, k, v, layer, head, similarity="dot", causal=False):
    _, trace = attention(
        q[layer, head],
        k[layer, head],
        v[layer, head],
        similarity=similarity,
        causal=causal,
        backend="explicit",
        return_trace=True,
    )
    return trace


def assert_row_matches(watched, trace, i):
    rows = sorted(watched.step_rows(), key=lambda r: r["key"])
    assert [r["key"] for r in rows] == list(range(T))
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
    watched = Watched(browser, path)
    trace = reference(q, k, v, 1, 2, similarity, causal)
    for i in (0, 3, 5):
        watched.page.click(f".token[data-index='{i}']")
        assert watched.page.get_attribute(f".token[data-index='{i}']", "class") == "token selected"
        assert_row_matches(watched, trace, i)
    watched.check_clean()


def test_top_keys_name_a_repeated_token_by_its_index(browser, tmp_path):
    tokens = ["the", "cat", "sat", "the", "mat", "."]
    path, _ = write_page(tmp_path, tokens=tokens)
    watched = Watched(browser, path)
    watched.page.click(".token[data-index='1']")
    shown = watched.page.eval_on_selector_all(
        ".top-keys li", "(items) => items.map((li) => [+li.dataset.key, li.firstChild.textContent])"
    )
    assert sorted(key for key, _ in shown) == list(range(T))  # every key of 6 listed
    for key, name in shown:
        assert name == (f"{key}:the" if tokens[key] == "the" else tokens[key])
    watched.check_clean()


def test_layer_and_head_selectors_update_the_step_panel(browser, tmp_path):
    path, (q, k, v) = write_page(tmp_path, query_index=4)
    watched = Watched(browser, path)
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
    watched = Watched(browser, path, "#layer=0&head=1&query=2")
    assert watched.page.input_value("#layer") == "0" and watched.page.input_value("#head") == "1"
    assert_row_matches(watched, reference(q, k, v, 0, 1), 2)
    watched.check_clean()


def test_user_text_shows_as_text(browser, tmp_path):
    path, _ = write_page(tmp_path)
    watched = Watched(browser, path)
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
    watched = Watched(browser, path)
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
    watched = Watched(browser, path)
    halves = [x.half().float() for x in (q, k, v)]  # what float16 on the wire carries exactly
    assert_row_matches(watched, reference(*halves, 1, 2), 1)
    watched.check_clean()


def test_a_narrow_window_does_not_scroll_sideways(browser, tmp_path):
    path, _ = write_page(tmp_path)
    watched = Watched(browser, path)
    watched.page.set_viewport_size({"width": 400, "height": 800})
    watched.page.reload()  # laid out narrow from the start, as on a phone
    watched.page.wait_for_selector("#app[data-ready='true']", timeout=30_000)
    assert watched.page.evaluate("document.documentElement.scrollWidth") <= 400
    watched.check_clean()
