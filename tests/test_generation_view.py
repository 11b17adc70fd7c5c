"""Attention during generation: Model.generate_recorded, `selfattn generate --html/--json`, and
the page of one strip per new token.

Each recorded step is the query row of the cached forward pass that chose a new token; it must
equal that row of a second, independent forward pass over the whole final sequence (keys past
the query there at weight 0), every layer and head, to 1e-5 absolute in float32 (the two runs
differ only in how the cached and the full computation order their float sums). Past the
model's positions, each step equals the last row of a run over its own window. The page
carries float32 weights and is checked against Python's to 1e-6.
"""

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import selfattn
from conftest import OfflinePage, needs_chromium
from selfattn.cli import app
from selfattn.errors import OutOfRange
from selfattn.models.model import Generation, GenerationStep
from selfattn.recording import record
from selfattn.train import load_model, train_decoder
from selfattn.viz.generation import generation_page, generation_payload
from test_browser import contrast

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: fastest on one thread

TOL = 1e-5
PAGE_TOL = 1e-6
CORPUS = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" * 12
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A char GPT (tiny preset: 2 layers, 2 heads, block 16) trained 30 steps; its folder."""
    data = tmp_path_factory.mktemp("data") / "corpus.txt"
    data.write_text(CORPUS)
    out = tmp_path_factory.mktemp("run") / "out"
    train_decoder(data, out, preset="tiny", overrides={"max_iters": 30}, device="cpu")
    return out


@pytest.fixture(scope="module")
def char_model(trained):
    return load_model(trained)


@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory):
    """A random GPT-2 folder (3 layers, 5 heads, 48 positions, byte-level BPE), loaded."""
    transformers = pytest.importorskip("transformers")
    from test_models_random import byte_level_tokenizer

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=300, n_positions=48, n_embd=40, n_layer=3, n_head=5,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
    byte_level_tokenizer(folder / "tokenizer.json")
    return selfattn.load(folder)


def full_run_weights(model, ids: list[int]) -> list[torch.Tensor]:
    """Per layer, the (H, T, T) weights of one uncached forward pass over ``ids``."""
    with torch.no_grad(), record(model.network) as recording:
        model.network(torch.tensor([ids]))
    return [recording.layer(layer)[0].weights() for layer in range(recording.n_layers)]


@pytest.mark.parametrize(
    ("which", "prompt", "new"),
    [("char_model", "First Cit", 7), ("gpt2_model", "Self-attention", 20)],
)
def test_each_step_is_its_query_row_of_the_full_sequence_run(request, which, prompt, new):
    model = request.getfixturevalue(which)
    generation = model.generate_recorded(prompt, new, temperature=0.9, seed=3)
    assert generation.text == model.generate(prompt, new, temperature=0.9, seed=3)
    assert len(generation.steps) == new == len(generation.tokens) - generation.n_prompt
    assert len(generation.token_ids) <= model.config.max_positions  # no sliding here
    full = full_run_weights(model, generation.token_ids)
    for s, step in enumerate(generation.steps):
        query = generation.n_prompt + s - 1  # the token before the new one
        assert (step.query, step.start) == (query, 0)
        assert step.weights.shape == (model.config.n_layers, model.config.n_heads, query + 1)
        for layer, weights in enumerate(full):
            torch.testing.assert_close(
                step.weights[layer], weights[:, query, : query + 1], atol=TOL, rtol=0
            )
            assert torch.all(weights[:, query, query + 1 :] == 0)  # causal: nothing later
        sums = step.weights.sum(-1)
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=TOL, rtol=0)


def test_characters_split_into_bytes_are_named_by_them_as_in_the_prompt(gpt2_model):
    """A character whose bytes take several new tokens is named by it, part by part, as the
    prompt's are ("é[1/2]", "é[2/2]"), not "\ufffd"; bytes that make no character keep it."""
    generation = gpt2_model.generate_recorded("café 🙂 crème", 25, temperature=0.9, seed=3)
    assert generation.tokens[2:4] == ["é[1/2]", "é[2/2]"]
    new = generation.tokens[generation.n_prompt :]
    parts = [re.fullmatch(r" ?(.+)\[(\d+)/(\d+)\]", name) for name in new]
    named = {part[1] for part in parts if part}
    whole = {c for c in generation.text if ord(c) > 127 and c != "\ufffd"}
    assert whole and whole <= named  # every character the new bytes make (here Ћ and ϝ)
    assert "\ufffd" in generation.text and any("\ufffd" in name for name in new)


def test_past_the_block_size_each_step_matches_its_window(char_model):
    block = char_model.config.max_positions  # 16
    generation = char_model.generate_recorded("First", 30, temperature=0.9, seed=5)
    ids = generation.token_ids
    slid = [step for step in generation.steps if step.start > 0]
    assert len(slid) == len(ids) - 1 - block  # every query at position >= block
    for step in generation.steps:
        assert step.start == max(0, step.query + 1 - block)
        window = full_run_weights(char_model, ids[step.start : step.query + 1])
        for layer, weights in enumerate(window):
            torch.testing.assert_close(step.weights[layer], weights[:, -1], atol=TOL, rtol=0)
    uncached = char_model.generate_recorded("First", 30, temperature=0.9, seed=5, use_cache=False)
    assert uncached.token_ids == ids
    for cached_step, plain_step in zip(generation.steps, uncached.steps, strict=True):
        torch.testing.assert_close(cached_step.weights, plain_step.weights, atol=TOL, rtol=0)


def test_weights_and_json_index_the_same_numbers(char_model):
    generation = char_model.generate_recorded("First", 6, temperature=0, seed=0)
    assert generation.weights(-1, 1, 0).shape == (generation.steps[-1].query + 1,)
    assert torch.equal(generation.weights(2, -1), generation.steps[2].weights[1])
    with pytest.raises(IndexError, match="head 2 out of range"):
        generation.weights(0, 0, 2)
    data = json.loads(json.dumps(generation.to_json()))
    assert data["tokens"][: data["n_prompt"]] == list("First")
    assert data["steps"][3]["weights"] == generation.steps[3].weights.tolist()


def test_payload_carries_every_step_in_order(char_model):
    generation = char_model.generate_recorded("First", 9, temperature=0.9, seed=1)
    payload = generation_payload(generation, layer=-1, head=1, step=4)
    assert payload["selection"] == {"layer": 1, "head": 1, "step": 4}
    assert payload["dtype"] == "float32"
    flat = np.frombuffer(base64.b64decode(payload["weights"]["data"]), "<f4")
    decoded = torch.from_numpy(flat.reshape(payload["weights"]["shape"]).copy())
    at = 0
    for s, step in enumerate(generation.steps):
        count = payload["queries"][s] - payload["starts"][s] + 1
        assert torch.equal(decoded[..., at : at + count], step.weights)
        at += count
    assert at == decoded.shape[-1]
    with pytest.raises(OutOfRange, match="step 9 out of range"):  # steps 0..8 only
        generation_payload(generation, step=9)
    # past the block size each step's keys start where its window does: 16 keys at most
    block = char_model.config.max_positions  # 16
    slid = generation_payload(char_model.generate_recorded("First", 30, temperature=0.9, seed=5))
    expected = [max(0, query + 1 - block) for query in slid["queries"]]
    assert slid["starts"] == expected and max(expected) > 0
    keys = sum(q - s + 1 for q, s in zip(slid["queries"], expected, strict=True))
    assert slid["weights"]["shape"][-1] == keys


def test_cli_writes_the_page_and_the_json(trained, char_model, tmp_path):
    page, data = tmp_path / "gen.html", tmp_path / "gen.json"
    args = ["generate", "--checkpoint", str(trained), "First", "--max-new-tokens", "12"]
    result = CliRunner().invoke(
        app, [*args, "--seed", "2", "--html", str(page), "--json", str(data)]
    )
    assert result.exit_code == 0, result.output
    generation = char_model.generate_recorded("First", 12, temperature=0.8, seed=2)
    assert result.stdout.startswith("First" + generation.text)
    assert f"wrote {page}" in result.output and f"wrote {data}" in result.output
    html = page.read_text(encoding="utf-8")
    assert 'id="selfattn-generation"' in html and "http://" not in html and "https://" not in html
    # without --layer and --head: the last of the 2 layers, the mean of the heads
    assert '"selection":{"layer":1,"head":"mean","step":0}' in html
    written = json.loads(data.read_text(encoding="utf-8"))
    assert written["text"] == generation.text and len(written["steps"]) == 12
    for mine, step in zip(written["steps"], generation.steps, strict=True):
        assert np.allclose(mine["weights"], step.weights.numpy(), atol=0, rtol=0)


def test_cli_refuses_a_page_of_no_new_tokens(trained, tmp_path):
    args = ["generate", "--checkpoint", str(trained), "First", "--max-new-tokens", "0"]
    result = CliRunner().invoke(app, [*args, "--html", str(tmp_path / "p.html")])
    assert result.exit_code == 2
    assert "--max-new-tokens 1 or more" in result.output
    assert not (tmp_path / "p.html").exists()


def test_cli_refuses_one_file_for_both_the_page_and_the_json(trained, tmp_path):
    args = ["generate", "--checkpoint", str(trained), "First", "--max-new-tokens", "3"]
    both = ["--html", str(tmp_path / "gen.out"), "--json", str(tmp_path / "." / "gen.out")]
    result = CliRunner().invoke(app, [*args, *both])
    assert result.exit_code == 2
    assert result.output.count("Error:") == 1 and "give each its own file" in result.output
    assert not (tmp_path / "gen.out").exists()


def test_cli_opens_the_page_on_the_layer_and_head_asked_for(trained, tmp_path):
    page = tmp_path / "gen.html"
    args = ["generate", "--checkpoint", str(trained), "First", "--max-new-tokens", "3"]
    result = CliRunner().invoke(app, [*args, "--html", str(page), "--layer", "0", "--head", "1"])
    assert result.exit_code == 0, result.output
    assert '"selection":{"layer":0,"head":1,"step":0}' in page.read_text(encoding="utf-8")
    for bad, message in [
        (["--layer", "2"], "layer 2 out of range: the model has layers 0..1\n"),
        (["--head", "2"], "head 2 out of range: each layer has heads 0..1\n"),  # not "or -2..-1"
        (["--head", "first"], "--head must be a head number or 'mean'"),
    ]:
        result = CliRunner().invoke(app, [*args, "--html", str(tmp_path / "bad.html"), *bad])
        assert result.exit_code != 0 and result.output.count("Error:") == 1
        assert message in result.output and "First" not in result.stdout  # before generating
    result = CliRunner().invoke(app, [*args, "--head", "0"])
    assert result.exit_code == 2 and "add --html FILE" in result.output


# ---------- the page in chromium ----------


@pytest.fixture(scope="module")
def gpt2_page(gpt2_model, tmp_path_factory):
    """A page of 10 new tokens from the random GPT-2 (peaked heads), and its generation."""
    generation = gpt2_model.generate_recorded("Self-attention <b>", 10, temperature=0.9, seed=4)
    path = tmp_path_factory.mktemp("page") / "generation.html"
    path.write_text(generation_page(generation, layer=2, head="mean"), encoding="utf-8")
    return path, generation


def in_chromium(test):
    """The marks of a browser test (skipped without Debian's chromium)."""
    for mark in needs_chromium:
        test = mark(test)
    return test


class Watched(OfflinePage):
    """The generation page, with readers for its top keys and strips."""

    def top_keys(self) -> dict[int, float]:
        return dict(
            self.page.eval_on_selector_all(
                "#top-keys li",
                "(items) => items.map((li) => [+li.dataset.key, +li.dataset.weight])",
            )
        )

    def strips_image(self) -> str:
        return self.page.eval_on_selector("#strips", "(canvas) => canvas.toDataURL()")


def assert_top_keys_are(watched, expected: torch.Tensor, start: int = 0):
    shown = watched.top_keys()
    assert shown, "no top keys listed"
    best = sorted(range(len(expected)), key=lambda j: -expected[j])[: len(shown)]
    assert sorted(shown) == sorted(start + j for j in best)
    for key, weight in shown.items():
        assert math.isclose(weight, expected[key - start].item(), abs_tol=PAGE_TOL)


@in_chromium
def test_page_shows_one_strip_per_new_token_and_names_its_axes(browser, gpt2_page):
    path, generation = gpt2_page
    watched = Watched(browser, path)
    page = watched.page
    assert page.get_attribute("#strips", "data-rows") == str(len(generation.steps))
    assert page.locator(".token.generated").count() == len(generation.steps)
    assert page.locator(".token.prompt").count() == generation.n_prompt
    assert page.text_content("#axes") == "rows: queries (the new tokens), columns: keys"
    hint = page.text_content("#strips-hint")
    assert "Rows are queries" in hint and "Columns are keys" in hint
    assert "rows: queries" in page.get_attribute("#strips", "aria-label")
    assert page.locator("#flow b").count() == 0  # the prompt's "<b>" stays text
    assert_top_keys_are(watched, generation.weights(0, 2).mean(0))
    watched.check_clean()


@in_chromium
def test_layer_and_head_choice_change_the_strips(browser, gpt2_page):
    path, generation = gpt2_page
    watched = Watched(browser, path)
    page = watched.page
    page.click(".token.generated[data-step='6']")
    mean_image = watched.strips_image()
    page.select_option("#layer", "0")
    page.select_option("#head", "3")
    assert watched.strips_image() != mean_image
    assert_top_keys_are(watched, generation.weights(6, 0, 3))
    page.select_option("#head", "mean")
    assert_top_keys_are(watched, generation.weights(6, 0).mean(0))
    watched.check_clean()


@in_chromium
def test_strips_answer_hover_and_keys(browser, gpt2_page):
    path, generation = gpt2_page
    watched = Watched(browser, path)
    page = watched.page
    box = page.locator("#strips").bounding_box()
    # the geometry of generation.js: strips start 84 px down (key labels), 22 px each here
    page.mouse.move(box["x"] + 150, box["y"] + 84 + 3 * 22 + 11)
    assert page.text_content("#detail").startswith("preview: new token")
    assert page.is_visible("#strip-tip") and "strip 3" in page.text_content("#strip-tip")
    assert_top_keys_are(watched, generation.weights(3, 2).mean(0))
    page.mouse.move(0, 0)
    page.focus("#strips")
    page.keyboard.press("End")
    last = len(generation.steps) - 1
    assert f"new token {generation.n_prompt + last} " in page.text_content("#selection")
    page.keyboard.press("ArrowUp")
    assert_top_keys_are(watched, generation.weights(last - 1, 2).mean(0))
    watched.check_clean()


@in_chromium
def test_keys_move_the_strip_with_nothing_focused(browser, gpt2_page):
    # As the page's hint and the explorer's page have it: the arrow keys did nothing until a
    # strip or a token had the focus. With nothing focused ← and → move the step (as in
    # Explore) and the keys that scroll still scroll (a first version took ↑, ↓, Home and End
    # too, so End changed a step below the fold instead of going there). Not in a form's field.
    path, generation = gpt2_page
    watched = Watched(browser, path)
    page = watched.page
    steps = len(generation.steps)

    def new_token(s: int) -> bool:
        return f"new token {generation.n_prompt + s} " in page.text_content("#selection")

    assert page.evaluate("document.activeElement === document.body")
    page.keyboard.press("End")
    page.keyboard.press("ArrowRight")
    assert new_token(steps - 1 if steps == 1 else 1)
    page.keyboard.press("ArrowLeft")
    assert new_token(0)
    assert_top_keys_are(watched, generation.weights(0, 2).mean(0))
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Home")
    assert new_token(0)
    page.focus("#head")
    page.keyboard.press("ArrowRight")  # the select's own key
    assert new_token(0)
    watched.check_clean()


@in_chromium
def test_page_follows_dark_mode(browser, gpt2_page):
    path, _ = gpt2_page
    grounds, images = {}, {}
    for scheme in ("light", "dark"):
        watched = Watched(browser, path, color_scheme=scheme)
        grounds[scheme] = watched.page.evaluate(
            "() => getComputedStyle(document.body).backgroundColor"
        )
        images[scheme] = watched.strips_image()
        watched.check_clean()
    assert grounds["light"] != grounds["dark"]
    assert images["light"] != images["dark"]  # the canvas is drawn in the scheme's colours


def handmade_generation(tokens: list[str], n_prompt: int, window: int | None = None) -> Generation:
    """A generation of ``tokens`` (one layer, one head) with made-up weights, for the page;
    with a sliding ``window``, the keys before it at weight 0 (masked)."""
    generator = torch.Generator().manual_seed(0)
    steps = []
    for query in range(n_prompt - 1, len(tokens) - 1):
        scores = torch.randn(1, 1, query + 1, generator=generator)
        if window is not None:
            scores[..., : max(0, query - window + 1)] = float("-inf")
        steps.append(GenerationStep(query, 0, torch.softmax(scores, -1)))
    return Generation(
        prompt="".join(tokens[:n_prompt]),
        text="".join(tokens[n_prompt:]),
        tokens=tokens,
        token_ids=list(range(len(tokens))),
        n_prompt=n_prompt,
        steps=steps,
        n_layers=1,
        n_heads=1,
    )


def write_page(generation: Generation, folder, **selection) -> Path:
    path = folder / "generation.html"
    path.write_text(generation_page(generation, **selection), encoding="utf-8")
    return path


def test_payload_carries_the_sliding_windows_it_is_given():
    generation = handmade_generation(list("abcdefgh"), 3, window=3)
    assert generation_payload(generation)["windows"] is None
    assert generation_payload(generation, windows=[3])["windows"] == [3]
    for windows in ([3, None], [0]):
        with pytest.raises(ValueError, match=r"one sliding window \(a positive int, or None\)"):
            generation_payload(generation, windows=windows)


@in_chromium
def test_keys_before_a_sliding_window_are_masked_and_say_so(browser, tmp_path):
    """Keys before a layer's sliding window (Mistral's) were drawn and listed as keys of
    weight 0, weighed and found unimportant; they are grey and named as masked, as on the
    offline page of one text, and the count of other keys leaves them out."""
    tokens = list("abcdefgh")
    generation = handmade_generation(tokens, 3, window=3)
    path = tmp_path / "generation.html"
    path.write_text(generation_page(generation, windows=[3], layer=0, head=0), encoding="utf-8")
    watched = Watched(browser, path)
    page = watched.page
    page.click(".token.generated[data-step='4']")  # query 6 sees keys 4..6
    titles = page.eval_on_selector_all(
        "#flow .token.masked",
        "(els) => els.map((e) => [[...e.parentNode.children].indexOf(e), e.title])",
    )
    window_title = "masked: key {} is outside the sliding window of query 6 (keys 4..6)"
    assert titles == [[j, window_title.format(j)] for j in range(4)]
    leftover = page.text_content("#leftover")
    assert "keys 0..3 masked, before the layer's sliding window of 3 tokens" in leftover
    assert re.match(r"(every key shown|\+ [0-9.]+ on [12] other keys?) · keys 0\.\.3", leftover)
    assert "before the layer's sliding window (masked)" in page.text_content("#strip-legend")
    assert "sliding window" in page.text_content("#strips-hint")
    cells = page.evaluate(
        """([steps, columns]) => {
            const map = document.getElementById('strips');
            const dpr = map.width / map.getBoundingClientRect().width;
            // the geometry of generation.js for 7 columns: cells 24 wide, strips 22 high
            const px = (x, y) => map.getContext('2d').getImageData(x * dpr, y * dpr, 1, 1).data;
            const at = (j, s) => [...px(112 + (j + 0.5) * 24, 84 + (s + 0.5) * 22)].slice(0, 3);
            const keys = [...Array(columns).keys()];
            return [...Array(steps).keys()].map((s) => keys.map((j) => at(j, s)));
        }""",
        [len(generation.steps), len(tokens) - 1],
    )
    grey = [212, 208, 203]  # view.css's --masked
    for s, step in enumerate(generation.steps):
        first = step.query - 2
        assert [cells[s][j] == grey for j in range(step.query + 1)] == [
            j < first for j in range(step.query + 1)
        ], s
    watched.check_clean()


@in_chromium
def test_white_space_and_control_tokens_are_visible(browser, tmp_path):
    tokens = ["a", " ", "\x06", "b", "\n", "  ", "\x7f", " c"]
    watched = Watched(browser, write_page(handmade_generation(tokens, 3), tmp_path))
    page = watched.page
    shown = page.eval_on_selector_all("#flow .token", "(els) => els.map((el) => el.textContent)")
    assert shown == ["a", "␣", "\\x06", "b", "↵", "␣␣", "\\x7f", " c"]
    page.click(".token.generated[data-step='2']")
    assert page.text_content("#selection").endswith("new token 5 “␣␣”")
    assert "“\\x06”" in page.text_content("#detail")
    watched.check_clean()


@in_chromium
def test_the_text_follows_the_strip_chosen_far_down(browser, tmp_path):
    tokens = [f"w{i} " for i in range(400)]
    watched = Watched(browser, write_page(handmade_generation(tokens, 2), tmp_path))
    page = watched.page
    in_text_box = """(step) => {
        const box = document.querySelector('#flow').getBoundingClientRect();
        const el = document.querySelector(`.token.generated[data-step='${step}']`);
        const token = el.getBoundingClientRect();
        return box.top <= token.top && token.bottom <= box.bottom;
    }"""
    flow = page.locator("#flow")
    assert flow.evaluate("(box) => box.scrollHeight > box.clientHeight")  # the text scrolls
    page.focus("#strips")
    page.keyboard.press("End")
    assert page.evaluate(in_text_box, 397)
    page.keyboard.press("Home")
    assert page.evaluate(in_text_box, 0)
    watched.check_clean()


@in_chromium
def test_the_address_keeps_the_selection(browser, gpt2_page):
    path, generation = gpt2_page
    watched = Watched(browser, path, fragment="#layer=0&head=3&step=4")
    page = watched.page
    assert page.text_content("#selection").startswith("layer 0 · head 3 · new token")
    assert_top_keys_are(watched, generation.weights(4, 0, 3))
    page.focus("#strips")
    page.keyboard.press("ArrowDown")
    page.select_option("#head", "mean")
    assert page.evaluate("location.hash") == "#layer=0&head=mean&step=5"
    page.evaluate("location.hash = '#layer=1&head=2&step=7'")
    page.wait_for_function("document.querySelector('#selection').textContent.includes('head 2')")
    assert_top_keys_are(watched, generation.weights(7, 1, 2))
    watched.check_clean()


@in_chromium
def test_an_address_the_page_cannot_show_is_said_in_one_line(browser, gpt2_page):
    # The explorer names a bad address's values in one notice; the generation page moved them
    # into range silently. Now it says so too, and the notice goes once something is chosen.
    path, generation = gpt2_page
    steps = len(generation.steps)
    watched = Watched(browser, path, fragment="#layer=9&head=x&step=99")
    page = watched.page
    notice = page.text_content("#hash-notice")
    assert notice == (
        f"The address's layer=9 and head=x and step=99 are not on this page "
        f"(layers 0..{generation.n_layers - 1}, heads 0..{generation.n_heads - 1} or mean, "
        f"steps 0..{steps - 1}): showing layer {generation.n_layers - 1}, head 0, step {steps - 1}."
    )
    page.select_option("#head", "mean")
    assert page.is_hidden("#hash-notice")
    page.evaluate("location.hash = '#layer=0&head=1&step=2'")
    page.wait_for_function("document.querySelector('#selection').textContent.includes('head 1')")
    assert page.is_hidden("#hash-notice")
    watched.check_clean()


@in_chromium
def test_screen_readers_get_the_text_and_every_weight_of_the_chosen_strip(browser, gpt2_page):
    """The prompt's tokens sat in the list of generated tokens (a listbox holds options only:
    screen readers skipped them), the generated text was there only as options of a token
    each, and a step's weights beyond its top keys only in tooltips and on the canvas. The
    page says prompt and continuation as text, hides the prompt's tokens from the listbox,
    and lists every key of the chosen strip with its weight in a table."""
    path, generation = gpt2_page
    watched = Watched(browser, path)
    page = watched.page
    text = page.get_by_role("region", name="Generated text", exact=True)
    assert text.text_content() == generation.prompt + generation.text
    assert text.locator("b").text_content() == generation.text
    not_options = page.eval_on_selector_all(
        "#flow > :not([role='option'])", "(els) => els.map((e) => e.ariaHidden)"
    )
    assert not_options == ["true"] * generation.n_prompt
    page.click(".token.generated[data-step='6']")
    query = generation.n_prompt + 6 - 1
    rows = watched.step_rows()
    assert [row["key"] for row in rows] == list(range(query + 1))  # every key, not the top 6
    expected = generation.weights(6, 2).mean(0)
    assert [row["weight"] for row in rows] == pytest.approx(expected.tolist(), abs=PAGE_TOL)
    table = page.get_by_role("table", name=re.compile(r"^The chosen strip's weights strip 6: "))
    assert table.get_attribute("id") == "steps"
    page.hover(".token.generated[data-step='2']")  # a preview: the table keeps the chosen strip
    assert len(watched.step_rows()) == query + 1
    assert page.get_attribute("#detail", "aria-live") is None  # previews are not read out
    assert page.get_attribute("#selection", "aria-live") == "polite"  # the choice is
    watched.check_clean()


@in_chromium
def test_the_strips_are_a_slider_that_a_wide_map_scrolls_sideways_on(browser, gpt2_page):
    """The strips were an image that wanted the arrow keys (a screen reader keeps them): a
    slider over the strips gets them; at 320 px the strips are wider than their box, and
    Shift+← → scroll it, the strip chosen staying."""
    path, generation = gpt2_page
    watched = Watched(browser, path)
    page = watched.page
    page.set_viewport_size({"width": 320, "height": 700})
    assert page.get_attribute("#strips", "role") == "slider"
    slider = ("aria-valuemin", "aria-valuemax", "aria-valuenow")
    steps = len(generation.steps)
    assert [page.get_attribute("#strips", name) for name in slider] == ["0", str(steps - 1), "0"]
    page.focus("#strips")
    page.keyboard.press("ArrowDown")
    assert page.get_attribute("#strips", "aria-valuenow") == "1"
    assert page.get_attribute("#strips", "aria-valuetext").startswith("Strip 1, which chose ")
    box = page.locator("#strips").locator("..")
    assert box.evaluate("(b) => b.scrollWidth > b.clientWidth")
    page.keyboard.press("Shift+ArrowRight")
    assert box.evaluate("(b) => b.scrollLeft") > 0
    assert page.get_attribute("#strips", "aria-valuenow") == "1"
    watched.check_clean()


@in_chromium
@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_tokens_not_yet_written_read_at_4_5_to_1_and_say_so_without_colour(
    browser, gpt2_page, scheme
):
    """Tokens after the step shown were faded to 45 % opacity: 2.9:1 on the light page,
    3.6:1 on the dark. They are in the muted ink (4.5:1) with a dotted underline."""
    path, _ = gpt2_page
    watched = Watched(browser, path, color_scheme=scheme)
    page = watched.page
    page.click(".token.generated[data-step='0']")
    pending = page.eval_on_selector_all(
        ".token.pending",
        """(els) => els.map((e) => {
            const s = getComputedStyle(e);
            const rgb = (c) => c.match(/\\d+/g).slice(0, 3).map(Number);
            const card = getComputedStyle(e.closest('.card')).backgroundColor;
            return [s.opacity, s.textDecorationStyle, rgb(s.color), rgb(card)];
        })""",
    )
    assert pending, "no token after the first step"
    for opacity, decoration, ink, ground in pending:
        assert (opacity, decoration) == ("1", "dotted")
        assert contrast(ink, ground) >= 4.5
    watched.check_clean()


@in_chromium
def test_white_space_tokens_are_named_in_words(browser, tmp_path):
    tokens = ["a", " ", "b", "\n", "  ", "c"]
    watched = Watched(browser, write_page(handmade_generation(tokens, 2), tmp_path))
    names = watched.page.eval_on_selector_all(
        ".token.generated", "(els) => els.map((e) => e.ariaLabel)"
    )
    assert names == [None, "line break", "space space", None]  # "b", "↵", "␣␣", "c"
    said = watched.page.eval_on_selector_all(
        "#steps tbody tr",
        """(rows) => rows.map((tr) => [+tr.dataset.key,
            tr.querySelector('.key .visually-hidden')?.textContent ?? null])""",
    )  # the chosen strip's table: keys with marks are read in words
    spoken = {" ": "space", "\n": "line break", "  ": "space space"}
    assert said and all(words == spoken.get(tokens[key]) for key, words in said), said
    watched.check_clean()


@in_chromium
def test_forced_colours_show_the_focused_token_ring(browser, gpt2_page):
    """In Windows High Contrast the focus ring (a box shadow) vanished: it is an outline in the
    system's highlight colour, on a generated token as on the explorer's, the query's too."""
    path, _ = gpt2_page
    watched = Watched(browser, path)
    page = watched.page
    page.emulate_media(forced_colors="active")
    ring = "(e) => { const s = getComputedStyle(e); return [s.outlineStyle, s.outlineWidth]; }"
    page.click(".token.generated[data-step='3']")
    page.keyboard.press("ArrowLeft")  # step 2: its query is step 1's token
    page.mouse.move(0, 0)  # no preview of the step under the pointer
    for selector in (".token.generated.selected", ".token.generated[data-step='1']"):
        page.focus(selector)
        assert page.eval_on_selector(selector, ring) == ["solid", "3px"], selector
    assert page.eval_on_selector(
        ".token.generated[data-step='1']", "(e) => e.classList.contains('query')"
    )
    watched.check_clean()
