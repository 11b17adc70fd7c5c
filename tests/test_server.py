"""The web explorer's API (FastAPI TestClient, the real default model): every endpoint, every
error as one line of detail, the same JSON as the command line, and the bounded worker pool.
"""

import asyncio
import dataclasses
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from conftest import Bound
from selfattn import server
from selfattn.cli import app as cli_app
from selfattn.errors import SelfAttnError
from selfattn.models.loading import load

BANK = "I went to the bank to deposit money."
RIVER = "We sat on the bank of the river and watched the water."
TWO_BANKS = "I sat on the bank, then walked to the bank."
NOT_JSON = "the request body is not valid JSON; send one JSON object"


@pytest.fixture(scope="module")
def model():
    return load("minilm")


@pytest.fixture(scope="module")
def client(model):
    with TestClient(server.create_app(model), base_url="http://127.0.0.1:8000") as client:
        yield client


@pytest.fixture
def cli(model, monkeypatch):
    """The command line, on the module's loaded model (loading it again gives the same)."""
    monkeypatch.setattr("selfattn.cli._load", lambda name, checkpoint: model)


def cli_json(*args: str) -> dict:
    result = CliRunner().invoke(cli_app, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ---------------------------------------------------------------------------------------------
# the same numbers as the command line


@pytest.mark.parametrize(
    ("body", "args"),
    [
        ({"word": "bank"}, ["--word", "bank"]),
        (
            {"word": "bank", "layer": 2, "head": 7, "similarity": "cosine", "scale": 1.0},
            [
                "--word",
                "bank",
                "--layer",
                "2",
                "--head",
                "7",
                "--similarity",
                "cosine",
                "--scale",
                "1.0",
            ],
        ),
        (
            {"index": 3, "head": "mean", "layer": 5, "words": True},
            ["--index", "3", "--head", "mean", "--layer", "5", "--words"],
        ),
        ({}, []),
    ],
)
def test_explain_equals_the_command_line(client, cli, body, args):
    response = client.post("/api/explain", json={"text": BANK} | body)
    assert response.status_code == 200
    printed = cli_json("explain", BANK, "--json", *args)
    # but for the options a message names: the page's fields, not the command line's flags
    page_choice = printed["choice"].replace("--layer/--head", "the Layer field or the Head field")
    assert response.json() == printed | {"choice": page_choice}


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({"text": BANK, "word": "bank"}, "the Layer field or the Head field"),
        ({"text": BANK, "word": "bank", "layer": 1}, "the Head field"),
        ({"text": BANK, "word": "bank", "head": 0}, "the Layer field"),
    ],
)
def test_how_the_head_was_chosen_names_the_pages_fields(client, body, fields):
    choice = client.post("/api/explain", json=body).json()["choice"]
    assert choice.endswith(f"; pick another with {fields}")


def test_a_phrases_note_names_the_pages_tokens_not_the_command_lines_index(client):
    body = {"text": "A well-known bank.", "word": "well-known", "layer": 0, "head": 0}
    note = client.post("/api/explain", json=body).json()["query"]["note"]
    assert note.endswith("explain shows one query token: a token clicked in Explore shows another")
    assert client.post("/api/view", json=body).json()["note"] == note


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            {"text": BANK, "occurrence": 1},
            "occurrence 1 counts the matches of a word, and no word is given: give the word too "
            "(the Word field) or leave the occurrence out",
        ),
        (
            {"text": BANK, "similarity": "dot"},
            "another similarity or scale is recomputed for one query of one head: give the word "
            "to explain or its token index (the Word field or a token clicked in Explore)",
        ),
        (
            {"text": TWO_BANKS, "word": "bank", "occurrence": 2},
            "there is no occurrence 2 of the word 'bank': it occurs 2 times in the text; the "
            "Occurrence field counts from 0 (0 = the first, -1 = the last)",
        ),
    ],
)
def test_errors_name_the_pages_fields_where_the_command_line_names_flags(client, body, error):
    assert detail(client.post("/api/explain", json=body), 400) == error


@pytest.mark.parametrize("occurrence", [0, 1])
def test_explain_occurrence_picks_that_word(client, model, occurrence):
    body = {"text": TWO_BANKS, "word": "bank", "occurrence": occurrence, "layer": 0, "head": 0}
    response = client.post("/api/explain", json=body)
    assert response.status_code == 200, response.text
    tokens = model.run(TWO_BANKS).tokens
    banks = [i for i, token in enumerate(tokens) if token == "bank"]
    assert len(banks) == 2
    query = response.json()["query"]
    assert (query["index"], query["token"]) == (banks[occurrence], "bank")


@pytest.mark.parametrize("occurrence", [0, -1])
def test_compare_equals_the_command_line(client, cli, occurrence):
    body = {"sentences": [BANK, TWO_BANKS], "word": "bank", "occurrence": occurrence}
    response = client.post("/api/compare", json=body)
    assert response.status_code == 200
    data = response.json()
    assert data == cli_json(
        "compare", BANK, TWO_BANKS, "--word", "bank", "--occurrence", str(occurrence), "--json"
    )
    assert data["model"] == "all-MiniLM-L6-v2"
    # layer 0: the same embedding but for the position
    assert len(data["layers"]) == 7 and data["layers"][0]["cosine"][0][1] > 0.95


def test_view_is_the_page_payload(client, model):
    from selfattn.explain import explain_text
    from selfattn.viz.report import page_data

    response = client.post("/api/view", json={"text": BANK, "word": "bank", "layer": 0, "head": 4})
    assert response.status_code == 200
    data = response.json()
    run, explanation = explain_text(model, BANK, word="bank", layer=0, head=4)
    assert data == json.loads(json.dumps(page_data(run, explanation)))
    assert data["selection"] == {"layer": 0, "head": 4, "query": 5}
    assert (data["layers"], data["heads"], data["length"]) == (6, 12, 11)


def test_view_says_why_it_chose_the_layer_and_head_it_chose(client, model):
    """Explore opened on the head the server chose (layer 0, head 4 for "bank") without a word
    on why; the payload now carries explain's choice, naming Explore's menus."""
    from selfattn.explain import explain_text

    data = client.post("/api/view", json={"text": BANK, "word": "bank"}).json()
    _, explanation = explain_text(model, BANK, word="bank")
    assert data["selection"] == {"layer": 0, "head": 4, "query": 5}
    assert data["choice"] == (
        str(explanation.choice).removesuffix("--layer/--head") + "the layer menu or the head menu"
    )
    assert data["choice"].startswith("chosen: 'bank' puts the most weight here, 0.71")
    layer_only = client.post("/api/view", json={"text": BANK, "word": "bank", "layer": 1})
    assert layer_only.json()["choice"].endswith("; pick another with the head menu")
    asked = {"text": BANK, "word": "bank", "layer": 1, "head": 2}
    assert "choice" not in client.post("/api/view", json=asked).json()


def test_models_describes_the_loaded_model(client):
    data = client.get("/api/models").json()
    assert data["models"] == [
        {
            "name": "all-MiniLM-L6-v2",
            "kind": "encoder",
            "layers": 6,
            "heads": 12,
            "max_positions": 512,
        },
    ]
    assert data["limits"] == {
        "max_chars": server.MAX_CHARS,
        "max_sentences": 4,
        "max_new_tokens": server.MAX_NEW_TOKENS,
    }


# ---------------------------------------------------------------------------------------------
# the page: served from the package, strict policy, nothing from a CDN


def test_page_and_assets_come_from_the_package_under_a_strict_policy(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "unsafe-inline" not in policy and "http" not in policy
    assert "http" not in page.text.replace("http-equiv", "")  # no absolute URL: nothing remote
    for name in ("view.js", "view.css", "serve.js", "serve.css", "generation.js", "generation.css"):
        assert f"/static/{name}" in page.text
        assert client.get(f"/static/{name}").status_code == 200
    assert client.get("/static/..%2Fserver.py").status_code == 404
    assert client.get("/static/nothing.js").status_code == 404


@pytest.mark.parametrize("path", ["/", "/static/serve.js", "/api/models"])
def test_head_answers_as_get_does_without_a_body(client, path):
    got, head = client.get(path), client.head(path)
    assert head.status_code == 200, head.text
    assert head.content == b""
    for name in ("content-type", "content-length", "content-security-policy"):
        assert head.headers[name] == got.headers[name]


def test_openapi_is_served_and_the_cdn_docs_are_not(client):
    schema = client.get("/openapi.json").json()
    paths = {"/api/explain", "/api/view", "/api/compare", "/api/models", "/api/generate"}
    assert paths <= set(schema["paths"])
    assert client.get("/docs").status_code == 404
    assert client.get("/redoc").status_code == 404


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1", "[::1]:8000", "LOCALHOST"])
def test_local_host_names_are_answered(client, host):
    assert client.get("/api/models", headers={"host": host}).status_code == 200


@pytest.mark.parametrize(
    "host", ["attacker.example", "attacker.example:8000", "localhost.attacker.example", "[::2]"]
)
def test_other_host_names_are_refused_in_one_line(client, host):
    message = detail(client.get("/api/models", headers={"host": host}), 400)
    assert message.startswith(f"the Host {host!r} is not this machine; open http://127.0.0.1:")


def test_a_server_for_the_network_answers_any_host(model):
    app = server.create_app(model, allowed_hosts=("*",))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        response = client.get("/api/models", headers={"host": "my-machine.lan:8000"})
    assert response.status_code == 200


# ---------------------------------------------------------------------------------------------
# errors: a status and one line of detail


def detail(response, status: int) -> str:
    assert response.status_code == status, response.text
    message = response.json()["detail"]
    assert isinstance(message, str) and "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"text": ""}, 400, "empty"),
        ({"text": "   "}, 400, "empty"),
        ({"text": "\u200b"}, 400, "reads nothing in the text"),
        ({"text": BANK, "word": "river"}, 400, "river"),
        ({"text": BANK, "layer": 6}, 400, "layer 6 is out of range"),
        ({"text": BANK, "layer": -1}, 400, "layer -1 is out of range"),
        ({"text": BANK, "head": 12}, 400, "head 12 is out of range"),
        ({"text": BANK, "index": 11}, 400, "token index 11 is out of range"),
        ({"text": BANK, "word": "bank", "index": 1}, 400, "either a word or a token index"),
        ({"text": TWO_BANKS, "word": "bank", "occurrence": 2}, 400, "occurrence 2 of the word"),
        ({"text": BANK, "layer": "1"}, 422, "the Layer field: Input should be a valid integer"),
        ({"text": BANK, "layer": 1.5}, 422, "the Layer field: Input should be a valid integer"),
        ({"text": BANK, "head": "all"}, 422, "the Head field: give a head number (0 = first) or"),
        ({"text": BANK, "head": 1.5}, 422, "the Head field: give a head number (0 = first) or"),
        ({"text": BANK, "similarity": "euclid"}, 422, "the Similarity field: Input should be"),
        ({"text": BANK, "scale": "big"}, 422, "the Scale field: Input should be a valid number"),
        ({"text": BANK, "words": "yes"}, 422, "words: Input should be a valid boolean"),
        ({"text": 42}, 422, "the Text field: Input should be a valid string"),
        ({"word": "bank"}, 422, "the Text field: Field required"),
        ({"text": BANK, "colour": "red"}, 422, "colour: Extra inputs are not permitted"),
        ({"text": BANK, "model": "/etc/passwd"}, 422, "model: Extra inputs are not permitted"),
        ({"text": BANK, "checkpoint": "../../x"}, 422, "checkpoint: Extra inputs"),
        ({"text": BANK, "word": "b" * 2001}, 422, "the Word field: String should have at most"),
        ({"text": BANK, "odd\nname": 1}, 422, "odd\\nname: Extra inputs are not permitted"),
        ({"text": "x" * (server.MAX_CHARS + 1)}, 413, "2,001 characters; the explorer takes"),
        ({"text": "! " * 600}, 413, "602 tokens; all-MiniLM-L6-v2 takes at most 512: shorten it"),
    ],
)
def test_explain_errors(client, body, status, words):
    assert words in detail(client.post("/api/explain", json=body), status)


def test_a_text_of_exactly_the_models_positions_is_taken(client, model):
    """The token limit is inclusive, as the character limit is: 510 "!" and [CLS], [SEP] are
    MiniLM's 512 positions, explained; one "!" more is 513 tokens, refused (413)."""
    fits = "! " * 510
    assert model.tokenizer.count(fits) == model.config.max_positions == 512
    response = client.post("/api/explain", json={"text": fits, "index": 1, "layer": 0, "head": 0})
    assert response.status_code == 200, response.text
    assert len(response.json()["tokens"]) == 512
    over = client.post("/api/explain", json={"text": fits + "!", "index": 1})
    assert "513 tokens; all-MiniLM-L6-v2 takes at most 512: shorten it" in detail(over, 413)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"{not json", NOT_JSON),
        (b'{"text": "\xff\xfe"}', NOT_JSON),  # not UTF-8
        (b'{"x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", NOT_JSON),  # too deep to parse
        (b"", "the request body must be a JSON object"),
        (b"null", "the request body must be a JSON object"),
        (json.dumps([BANK]).encode(), "the request body must be a JSON object"),
        (b"42", "the request body must be a JSON object"),
    ],
)
def test_body_must_be_a_json_object(client, content, words):
    response = client.post(
        "/api/explain", content=content, headers={"content-type": "application/json"}
    )
    assert detail(response, 422).startswith(words)


@pytest.mark.parametrize("head", ["all", 1.5])
def test_a_head_neither_a_number_nor_mean_is_said_once(client, head):
    """Pydantic refuses such a head twice (not an int, not 'mean'); both are the one plain
    sentence, said once."""
    message = detail(client.post("/api/explain", json={"text": BANK, "head": head}), 422)
    assert message == "the Head field: give a head number (0 = first) or 'mean'"


@pytest.mark.parametrize(
    "media", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_body_must_be_sent_as_json(client, media):
    headers = {"content-type": media} if media else {}
    response = client.post("/api/explain", content=json.dumps({"text": BANK}), headers=headers)
    message = detail(response, 415)  # a cross-site form cannot post JSON
    assert message.endswith("send JSON with Content-Type: application/json")


@pytest.mark.parametrize(
    "media",
    ["application/json; charset=utf-8", "Application/JSON", "APPLICATION/JSON; charset=UTF-8"],
)
def test_json_with_a_charset_is_taken(client, media):
    """Media types are case-insensitive (RFC 9110, 8.3.1): any spelling of JSON is taken."""
    headers = {"content-type": media}
    response = client.post("/api/explain", content=json.dumps({"text": BANK}), headers=headers)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("method", "path", "status", "words"),
    [
        ("GET", "/nope", 404, "nothing at /nope; the page is / and the API is GET /api/models"),
        ("POST", "/api/nope", 404, "POST /api/explain, POST /api/generate"),
        ("GET", "/api/explain", 405, "GET is not allowed on /api/explain; use POST"),
        ("OPTIONS", "/api/view", 405, "OPTIONS is not allowed on /api/view; use POST"),
        ("POST", "/api/models", 405, "POST is not allowed on /api/models; use GET"),
        ("DELETE", "/", 405, "DELETE is not allowed on /; use GET or HEAD"),
        ("GET", "/static/nothing.js", 404, "no file 'nothing.js'; the page's files are"),
    ],
)
def test_wrong_paths_and_methods_say_what_there_is(client, method, path, status, words):
    body = {"json": {"text": BANK}} if method == "POST" else {}
    assert words in detail(client.request(method, path, **body), status)


def test_bodies_must_declare_a_bounded_size(client):
    big = json.dumps({"text": BANK, "word": "b" * server.MAX_BODY})
    assert "at most" in detail(client.post("/api/explain", content=big), 413)
    chunked = client.post("/api/explain", content=iter([json.dumps({"text": BANK}).encode()]))
    assert "Content-Length" in detail(chunked, 411)
    # the limit is inclusive: JSON padded with spaces to exactly MAX_BODY bytes is explained
    small = json.dumps({"text": BANK, "word": "bank", "layer": 0, "head": 0})
    exact = (small + " " * (server.MAX_BODY - len(small))).encode()
    headers = {"Content-Type": "application/json"}
    assert len(exact) == server.MAX_BODY == 262_144
    taken = client.post("/api/explain", content=exact, headers=headers)
    assert taken.status_code == 200, taken.text
    over = client.post("/api/explain", content=exact + b" ", headers=headers)
    assert "the body is 262,145 bytes; the explorer takes at most 262,144" in detail(over, 413)


@pytest.mark.parametrize(
    "request_model", [server.ExplainRequest, server.CompareRequest, server.GenerateRequest]
)
def test_every_field_the_page_sends_has_the_pages_name(request_model):
    """One table names the fields for the 422s and the options for the 400s; `words` is the
    API's only (the page never sends it)."""
    assert set(request_model.model_fields) - {"words"} <= set(server.PAGE_NAMES)


def test_non_finite_scale_is_refused(client):
    body = json.dumps({"text": BANK, "word": "bank"})[:-1] + ', "scale": NaN}'
    response = client.post(
        "/api/explain", content=body, headers={"content-type": "application/json"}
    )
    assert detail(response, 422) == "the Scale field: Input should be a finite number"


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"sentences": [BANK], "word": "bank"}, 422, "give 2 to 4 sentences to compare"),
        ({"sentences": [BANK] * 5, "word": "bank"}, 422, "give 2 to 4 sentences to compare"),
        ({"sentences": [BANK, "No such word here."], "word": "bank"}, 400, "bank"),
        ({"sentences": [BANK, "\u200b"], "word": "bank"}, 400, "): all-MiniLM-L6-v2 reads nothing"),
        ({"sentences": [TWO_BANKS, BANK], "word": "bank", "occurrence": 1}, 400, "sentence 2"),
        ({"sentences": [BANK, RIVER]}, 422, "the Word field: Field required"),
        ({"sentences": BANK, "word": "bank"}, 422, "the sentences: Input should be a valid list"),
        ({"sentences": [BANK, 42], "word": "bank"}, 422, "sentence 2: Input should be a valid str"),
        ({"sentences": [BANK, "y" * 2001], "word": "bank"}, 413, "sentence 2 is 2,001 characters"),
        ({"sentences": [BANK, "! " * 600], "word": "bank"}, 413, "sentence 2 is 602 tokens"),
        ({"sentences": [BANK, RIVER], "word": "bank", "model": "gpt2"}, 422, "model"),
        ({"sentences": [BANK, RIVER], "word": "b" * 2001}, 422, "the Word field: String should"),
    ],
)
def test_compare_errors(client, body, status, words):
    assert words in detail(client.post("/api/compare", json=body), status)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"text": ""}, 400),
        ({"text": BANK, "head": 99}, 400),
        ({"text": BANK, "scale": 1}, 422),
        ({"text": "x" * 3000}, 413),
    ],
)
def test_view_errors(client, body, status):
    detail(client.post("/api/view", json=body), status)


def test_unexpected_errors_are_a_generic_500(model, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret /home/path\nTraceback (most recent call last)")

    monkeypatch.setattr(server.explaining, "explain_text", broken)
    app = server.create_app(model)
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        message = detail(client.post("/api/explain", json={"text": BANK}), 500)
    assert message == "internal error; the server's log has the details"


def test_a_user_error_of_several_lines_is_its_first_line(model, monkeypatch):
    """A 400's detail is the error's first line (what went wrong), not its last."""

    def refused(*args, **kwargs):
        raise ValueError("the layer is wrong; pick another\n  (details for Python callers)")

    monkeypatch.setattr(server.explaining, "explain_text", refused)
    with TestClient(server.create_app(model), base_url="http://127.0.0.1") as client:
        message = detail(client.post("/api/explain", json={"text": BANK}), 400)
    assert message == "the layer is wrong; pick another"


# ---------------------------------------------------------------------------------------------
# Generate: a decoder's continuation and the attention that chose each new token

CORPUS = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak.\n\n" * 12
PROMPT = "First "


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A char GPT (tiny preset: 2 layers, 2 heads, block 16) trained 30 steps, as `selfattn
    serve --checkpoint` loads it."""
    from selfattn.train import load_model, train_decoder

    data = tmp_path_factory.mktemp("data") / "corpus.txt"
    data.write_text(CORPUS)
    out = tmp_path_factory.mktemp("run") / "out"
    train_decoder(data, out, preset="tiny", overrides={"max_iters": 30}, device="cpu")
    return load_model(out)


@pytest.fixture(scope="module")
def decoder_client(decoder):
    with TestClient(server.create_app(decoder), base_url="http://127.0.0.1:8000") as client:
        yield client


@pytest.mark.parametrize(
    ("body", "sampling", "view"),
    [
        ({"seed": 3}, {"max_new_tokens": 50, "temperature": 0.8, "seed": 3}, {}),  # the CLI's
        (
            {"max_new_tokens": 12, "temperature": 1.3, "top_k": 5, "seed": 7},
            {"max_new_tokens": 12, "temperature": 1.3, "top_k": 5, "seed": 7},
            {},
        ),
        (
            {"max_new_tokens": 20, "temperature": 0, "layer": 0, "head": 1, "step": 19},
            {"max_new_tokens": 20, "temperature": 0},
            {"layer": 0, "head": 1, "step": 19},
        ),
    ],
)
def test_generate_is_the_generation_pages_payload_and_its_text(
    decoder_client, decoder, body, sampling, view
):
    from selfattn.viz.generation import generation_payload

    response = decoder_client.post("/api/generate", json={"prompt": PROMPT} | body)
    assert response.status_code == 200, response.text
    generation = decoder.generate_recorded(PROMPT, **sampling)
    expected = generation_payload(generation, **view) | {"text": generation.text}
    assert response.json() == json.loads(json.dumps(expected))
    assert len(response.json()["queries"]) == sampling["max_new_tokens"]


def test_generate_past_an_early_end_opens_on_the_last_token(decoder_client, decoder, monkeypatch):
    """A step within max_new_tokens but past an end-of-text token that stopped the generation
    early opens on the last new token; it was a 400, after the whole generation had run."""
    full = decoder.generate_recorded

    def ends_after_three(prompt, new_tokens, **sampling):
        generation = full(prompt, new_tokens, **sampling)
        return dataclasses.replace(generation, steps=generation.steps[:3])

    monkeypatch.setattr(decoder, "generate_recorded", ends_after_three)
    body = {"prompt": PROMPT, "max_new_tokens": 10, "temperature": 0, "step": 7}
    response = decoder_client.post("/api/generate", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["queries"]) == 3
    assert response.json()["selection"]["step"] == 2


def test_generate_with_a_seed_gives_the_same_text_again(decoder_client):
    body = {"prompt": PROMPT, "max_new_tokens": 30, "temperature": 1.5, "seed": 11}
    texts = [decoder_client.post("/api/generate", json=body).json()["text"] for _ in range(2)]
    other = decoder_client.post("/api/generate", json=body | {"seed": 12}).json()["text"]
    assert texts[0] == texts[1] != other


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"prompt": ""}, 400, "the prompt is empty"),
        ({"prompt": "Quiz"}, 400, "characters not in the model's vocabulary: 'Q'"),
        ({"prompt": PROMPT, "max_new_tokens": 201}, 413, "201 new tokens asked for; the explorer"),
        ({"prompt": PROMPT, "max_new_tokens": 10**6}, 413, "generates at most 200 a run"),
        ({"prompt": "a" * 2001}, 413, "the prompt is 2,001 characters; the explorer takes"),
        ({"prompt": PROMPT, "max_new_tokens": 0}, 422, "the New tokens field: Input should be gr"),
        ({"prompt": PROMPT, "max_new_tokens": "9"}, 422, "the New tokens field: Input should be a"),
        ({"prompt": PROMPT, "temperature": -1}, 422, "the Temperature field: Input should be"),
        ({"prompt": PROMPT, "top_k": 0}, 422, "the Top-k field: Input should be greater than or"),
        ({"prompt": PROMPT, "seed": -1}, 422, "the Seed field: Input should be greater than or"),
        ({"prompt": PROMPT, "seed": 2**32}, 422, "the Seed field: Input should be less than or"),
        ({"prompt": PROMPT, "layer": 2}, 400, "layer 2 out of range"),
        ({"prompt": PROMPT, "head": 2}, 400, "head 2 out of range"),
        # Generate's layer and head are the menus over its map, as Explore's (it said "field")
        ({"prompt": PROMPT, "head": "all"}, 422, "the head menu: give a head number (0 = first)"),
        ({"prompt": PROMPT, "layer": "x"}, 422, "the layer menu: Input should be a valid integer"),
        ({"prompt": PROMPT, "step": 1.5}, 422, "a new token clicked in Generate: Input should be"),
        ({"prompt": PROMPT, "max_new_tokens": 5, "step": 5}, 400, "step 5 out of range"),
        ({"prompt": 42}, 422, "the Prompt field: Input should be a valid string"),
        ({"max_new_tokens": 5}, 422, "the Prompt field: Field required"),
        ({"prompt": PROMPT, "model": "gpt2"}, 422, "model: Extra inputs are not permitted"),
        # a field of another request is named as sent, not as that request's page field
        ({"prompt": PROMPT, "text": "x"}, 422, "text: Extra inputs are not permitted"),
    ],
)
def test_generate_errors(decoder_client, body, status, words):
    assert words in detail(decoder_client.post("/api/generate", json=body), status)


def test_generate_takes_a_prompt_longer_than_the_models_positions(decoder_client, decoder):
    """As `selfattn generate` does: the window slides past the positions, and each step's
    recorded attention starts where its window does."""
    prompt = "First Citizen: Before we proceed"  # 32 characters: the model has 16 positions
    assert decoder.tokenizer.count(prompt) > decoder.config.max_positions == 16
    body = {"prompt": prompt, "max_new_tokens": 5, "seed": 1}
    response = decoder_client.post("/api/generate", json=body)
    assert response.status_code == 200, response.text
    from selfattn.viz.generation import generation_payload

    generation = decoder.generate_recorded(prompt, 5, temperature=0.8, seed=1)
    expected = generation_payload(generation) | {"text": generation.text}
    assert response.json() == json.loads(json.dumps(expected))
    assert response.json()["starts"] == [16, 17, 18, 19, 20]  # step s: the last 16 of 32 + s keys
    long = {"prompt": "a" * (server.MAX_CHARS + 1), "max_new_tokens": 5}
    assert "2,001 characters" in detail(decoder_client.post("/api/generate", json=long), 413)


def test_a_prompt_and_a_generation_of_exactly_the_limits_are_taken(decoder_client):
    """The limits are inclusive: a prompt of exactly MAX_CHARS characters asking for exactly
    MAX_NEW_TOKENS new tokens is generated (200, every step's weights), not refused as 413."""
    body = {"prompt": "a" * server.MAX_CHARS, "max_new_tokens": server.MAX_NEW_TOKENS, "seed": 1}
    response = decoder_client.post("/api/generate", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["queries"]) == server.MAX_NEW_TOKENS


def test_generate_needs_a_decoder(client):
    message = detail(client.post("/api/generate", json={"prompt": BANK}), 400)
    assert message.startswith(
        "Generate needs a decoder (GPT or Llama family); all-MiniLM-L6-v2 is an"
    )


def test_models_states_the_generation_limit_and_the_decoder(decoder_client):
    data = decoder_client.get("/api/models").json()
    assert data["models"][0]["kind"] == "decoder"
    assert data["limits"]["max_new_tokens"] == server.MAX_NEW_TOKENS == 200


def test_generate_runs_on_a_worker_in_inference_mode(decoder, monkeypatch):
    import torch

    seen = []

    def spy(*args, **options):
        seen.append((threading.current_thread().name, torch.is_inference_mode_enabled()))
        return original(*args, **options)

    original = decoder.generate_recorded
    monkeypatch.setattr(decoder, "generate_recorded", spy)
    with TestClient(server.create_app(decoder), base_url="http://127.0.0.1") as client:
        response = client.post("/api/generate", json={"prompt": PROMPT, "max_new_tokens": 3})
    assert response.status_code == 200, response.text
    [(thread, inference)] = seen
    assert thread.startswith("selfattn-worker") and inference


def test_generate_waits_in_the_bounded_queue(decoder, monkeypatch):
    monkeypatch.setattr(server.Pool, "run", _always_busy)
    with TestClient(server.create_app(decoder), base_url="http://127.0.0.1") as client:
        response = client.post("/api/generate", json={"prompt": PROMPT})
    assert detail(response, 503) == "the explorer is busy; retry in a moment"


# ---------------------------------------------------------------------------------------------
# the pool: model runs on workers under inference mode, a full queue answers 503 at once


def test_runs_happen_on_workers_in_inference_mode():
    import torch

    async def main():
        pool = server.Pool(workers=2, queue=0)
        seen = await pool.run(
            lambda: (threading.current_thread().name, torch.is_inference_mode_enabled())
        )
        pool.close()
        return seen

    name, inference = asyncio.run(main())
    assert name.startswith("selfattn-worker") and inference


def test_a_full_queue_answers_busy_and_frees_its_slots():
    """A third run with one worker busy and one run queued is refused at once: admitted, it
    would wait behind the held worker, so a 5 s bound turns that into a failure, not a hang."""
    release = threading.Event()

    async def main():
        pool = server.Pool(workers=1, queue=1)
        waiting = [asyncio.ensure_future(pool.run(release.wait)) for _ in range(2)]
        await asyncio.sleep(0.05)
        try:
            with pytest.raises(server.Busy):
                await asyncio.wait_for(pool.run(lambda: None), 5)
        finally:
            release.set()
        await asyncio.gather(*waiting)
        assert pool.admitted == 0
        assert await pool.run(lambda: 7) == 7
        pool.close()

    asyncio.run(main())


def test_a_run_refused_by_a_closed_pool_frees_its_slot():
    """A run that a shut-down pool refuses (a request racing the server's stop) gives its slot
    back: each such run used to keep one for ever, until every request was answered busy."""

    async def main():
        pool = server.Pool(workers=1, queue=0)
        pool.close()
        with pytest.raises(RuntimeError, match="shutdown"):
            await pool.run(lambda: None)
        return pool.admitted

    assert asyncio.run(main()) == 0


def test_busy_is_a_503_with_retry_after(model, monkeypatch):
    app = server.create_app(model, workers=1, queue=0)
    monkeypatch.setattr(server.Pool, "run", _always_busy)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        response = client.post("/api/explain", json={"text": BANK})
    assert detail(response, 503) == "the explorer is busy; retry in a moment"
    assert response.headers["retry-after"] == "1"


async def _always_busy(self, function, *args, **options):
    raise server.Busy


def _post(port: int, text: str) -> socket.socket:
    """A raw POST /api/view to 127.0.0.1:port, its connection left open for the answer."""
    body = json.dumps({"text": text}).encode()
    connection = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        "POST /api/view HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    connection.sendall(head.encode() + body)
    return connection


def _status(connection: socket.socket) -> int:
    """The status of the answer on ``connection`` (read to its end), which it closes."""
    with connection:
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def _wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {seconds} s")
        time.sleep(0.02)


@contextmanager
def _serving(app) -> Iterator[int]:
    """A real uvicorn serving ``app`` (in a thread) on a free 127.0.0.1 port: the port."""
    sock = server.listen("127.0.0.1", 0)
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        _wait_for(lambda: uvicorn_server.started, 20, "uvicorn did not start")
        yield sock.getsockname()[1]
    finally:
        uvicorn_server.should_exit = True
        thread.join(20)
        sock.close()


@pytest.mark.timeout(60)
def test_requests_whose_client_left_before_their_run_are_dropped(model, monkeypatch):
    """A real uvicorn, one worker held busy: two queued requests whose clients hang up give
    their places back at once (not after the worker got to them) and never run; a run that
    started finishes."""
    ran, started, release = [], threading.Event(), threading.Event()

    def view(_model, body):
        ran.append(body.text)
        started.set()
        release.wait(30)
        return server.as_json({"text": body.text})

    admitted, released = [], []
    run, free = server.Pool.run, server.Pool._release

    async def counted_run(self, *args, **options):
        admitted.append(args[-1].text)  # the body
        return await run(self, *args, **options)

    def counted_release(self, future):
        released.append(future)
        free(self, future)

    monkeypatch.setattr(server, "_view", view)
    monkeypatch.setattr(server.Pool, "run", counted_run)
    monkeypatch.setattr(server.Pool, "_release", counted_release)
    with _serving(server.create_app(model, workers=1, queue=2)) as port:
        try:
            first = _post(port, "first")
            assert started.wait(20), "the first run did not start"
            leaving = [_post(port, f"left {i}") for i in range(2)]
            _wait_for(lambda: len(admitted) == 3, 10, "the queued requests were not admitted")
            for connection in leaving:
                connection.close()
            # their places come back while the worker is still busy with the first
            _wait_for(lambda: len(released) == 2, 5, "abandoned requests kept their places")
            assert all(future.cancelled() for future in released)
            after = _post(port, "after")  # admitted, not 503: the queue has room again
            _wait_for(lambda: len(admitted) == 4, 10, "the next request was not admitted")
            release.set()
            assert (_status(first), _status(after)) == (200, 200)
        finally:
            release.set()
    assert ran == ["first", "after"]  # the requests whose client left never ran


class StalledTokenizer:
    """A tokenizer's backend whose tokenizing on a worker waits for ``release``: a run held
    while it holds the tokenizer's lock, as one can be behind the GIL on a busy machine."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.tokenizing, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    def encode_batch(self, texts: list[str]) -> list:
        if threading.current_thread().name.startswith("selfattn-worker"):
            self.tokenizing.set()
            self.release.wait(60)
        return self.backend.encode_batch(texts)


@pytest.mark.timeout(90)
def test_a_full_queue_is_refused_at_once_while_a_run_holds_the_tokenizer(model, monkeypatch):
    """A real uvicorn, one worker, no queue: while the run is held in its tokenizing, the next
    request is refused (503) before the run is let go: the event loop never waits for the
    tokenizer's lock (tokens are counted on the worker, after admission)."""
    stalled = StalledTokenizer(model.tokenizer.backend)
    monkeypatch.setattr(model.tokenizer, "backend", stalled)
    with _serving(server.create_app(model, workers=1, queue=0)) as port:
        try:
            held = _post(port, BANK)
            assert stalled.tokenizing.wait(30), "the run did not start"
            refused = _post(port, RIVER)
            try:  # within the connection's 30 s, the run still held
                assert _status(refused) == 503
            except TimeoutError:
                pytest.fail("the refusal waited for the run holding the tokenizer")
        finally:
            stalled.release.set()
        assert _status(held) == 200


@pytest.mark.timeout(60)
def test_serialising_a_large_answer_lets_the_event_loop_run():
    """A worker's answer is made into JSON row by row, so the event loop (here the main
    thread) takes turns meanwhile, as it must to refuse a request at once: one json.dumps of
    it held the GIL throughout. The text is json.dumps's exactly."""
    rows = [[i + j / 7 for j in range(500)] for i in range(2000)]  # ~0.4 s of json.dumps
    payload = {"tokens": ["a", "b"], "attention": rows, "steps": [{"weights": rows[:3]}]}
    answer, done = [], threading.Event()

    def serialise():
        answer.append(server.as_json(payload).body)
        done.set()

    turns = 0
    worker = threading.Thread(target=serialise)
    worker.start()
    while not done.is_set():
        time.sleep(0.001)  # gives up the GIL; taking it back waits for the worker to let go
        turns += 1
    worker.join()
    assert turns >= 10
    assert answer == [json.dumps(payload).encode()]


@pytest.mark.parametrize(
    "value",
    [
        {"a": [[1, 2.5], [float("nan"), -0.0]], "b": [], "c": [{"d": None, "e": [True]}]},
        {1: [[1]], "é\n": "\u2028"},  # a key json.dumps would turn into a string; escapes
        [[], [1]],
        ([(1, 2)], "x"),
        "text",
    ],
)
def test_json_text_is_json_dumps(value):
    assert server.json_text(value) == json.dumps(value)


# ---------------------------------------------------------------------------------------------
# the command


def test_serve_warns_when_listening_beyond_this_machine(cli, monkeypatch):
    served = {}
    monkeypatch.setattr(server, "listen", Bound)
    monkeypatch.setattr(server, "serve", lambda model, host, sock: served.update(at=sock))
    result = CliRunner().invoke(cli_app, ["serve", "--host", "0.0.0.0", "--port", "8123"])
    assert result.exit_code == 0, result.output
    assert served == {"at": ("0.0.0.0", 8123)}
    assert "reachable from the network" in result.stderr

    result = CliRunner().invoke(cli_app, ["serve"])
    assert served == {"at": ("127.0.0.1", 8000)}
    assert "network" not in result.stderr
    assert "on http://127.0.0.1:8000/ " in result.stdout

    result = CliRunner().invoke(cli_app, ["serve", "--host", "::1"])  # IPv6: in brackets
    assert served == {"at": ("::1", 8000)}
    assert "network" not in result.stderr and "on http://[::1]:8000/ " in result.stdout


def test_serve_takes_a_trained_checkpoint(monkeypatch, tmp_path):
    monkeypatch.setattr(server, "listen", Bound)
    monkeypatch.setattr(server, "serve", lambda *args: pytest.fail("served without a model"))
    result = CliRunner().invoke(cli_app, ["serve", "--checkpoint", str(tmp_path / "nowhere")])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: checkpoint directory {tmp_path / 'nowhere'} does")


def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(monkeypatch):
    monkeypatch.setattr(server, "serve", lambda *args: pytest.fail("served on a taken port"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli_app, ["serve", "--port", str(port), "--model", "nowhere"])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"Error: cannot listen on 127.0.0.1:{port}: Address already in use; pick another --port"
    )  # the missing model was never reached


def test_serve_on_an_address_it_cannot_listen_on_is_one_line_without_a_warning():
    result = CliRunner().invoke(cli_app, ["serve", "--host", "host.invalid", "--model", "nowhere"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: cannot listen on host.invalid: ")
    assert result.stderr.strip().endswith("; check --host")
    assert "warning" not in result.stderr  # it listens nowhere, on the network or not


def test_listen_binds_or_says_why():
    with server.listen("127.0.0.1", 0) as sock:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
        # it listens already: a client that read the start line connects (uvicorn accepts later)
        socket.create_connection((host, port), timeout=5).close()
    with pytest.raises(SelfAttnError, match="check --host"):
        server.listen("host.invalid", 0)


def test_serve_refuses_a_missing_model_in_one_line():
    result = CliRunner().invoke(cli_app, ["serve", "--model", "/no/such/folder"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "no folder" in result.stderr


# ---------------------------------------------------------------------------------------------
# Ctrl+C on a real `selfattn serve`: one line, no traceback, exit status 130

LONG = " ".join(["the bank"] * 220)  # about 440 tokens: a second or more on a CPU


@pytest.fixture
def started(tmp_path, bench):
    """``start()``: `selfattn serve --port 0` in a subprocess, once it answers; its output goes
    to files (read after it exits), and it is killed if a test leaves it running.

    The port is the free one it prints (none picked here and bound again there, which another
    process could take in between). It listens from that line on, so one request waits for its
    answer: a request given up on (a timeout while the model loads, then another try) would
    still be run once uvicorn starts, and a Ctrl+C meanwhile would find it in flight."""
    processes = []

    def start() -> tuple[subprocess.Popen, str]:
        out, err = (open(tmp_path / name, "w+") for name in ("stdout", "stderr"))  # noqa: SIM115
        process = subprocess.Popen(
            [sys.executable, "-m", "selfattn", "serve", "--port", "0"],
            stdout=out, stderr=err, env=os.environ | {"HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        process.out, process.err = out, err
        processes.append(process)
        deadline = time.monotonic() + 90
        while not (started := bench.START_LINE.match((tmp_path / "stdout").read_text())):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait(10)
                pytest.fail(f"selfattn serve did not start: {_output(process)}")
            time.sleep(0.1)
        base = started[1]
        left = max(deadline - time.monotonic(), 1.0)
        assert httpx.get(f"{base}/api/models", timeout=left).status_code == 200
        return process, base

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        process.out.close()
        process.err.close()


def _output(process: subprocess.Popen) -> tuple[str, str]:
    """(stdout, stderr) of a finished server."""
    process.out.seek(0)
    process.err.seek(0)
    return process.out.read(), process.err.read()


def _in_flight(base: str) -> tuple[list[threading.Thread], list]:
    """As many slow requests as the server admits (its workers and queue), sent at once from
    threads, once the server has read them all; their answers (a status, or the name of the
    client's error) are appended to the list as they come. No request has a timeout of its
    own: the test's bounds them.

    Read means sent, then taken from the server's receive queue: a connection whose request
    is not written yet looks the same from the server's side, and a Ctrl+C then would stop the
    server before that request reached it (the client's ReadError)."""
    answers, clients = [], []  # clients: the local port of each connection, once connected
    sent = [threading.Event() for _ in range(server.WORKERS + server.QUEUE)]

    def send(done: threading.Event) -> None:
        def trace(event: str, info: dict) -> None:  # httpcore's steps, in the sending thread
            if event == "connection.connect_tcp.complete":
                clients.append(info["return_value"].get_extra_info("socket").getsockname()[1])
            elif event == "http11.send_request_body.complete":
                done.set()

        try:
            with httpx.Client(timeout=None) as client:
                response = client.post(
                    f"{base}/api/view", json={"text": LONG}, extensions={"trace": trace}
                )
            answers.append(response.status_code)
        except httpx.HTTPError as error:
            answers.append(type(error).__name__)
        finally:
            done.set()  # a request that failed before it was sent: its answer says so

    threads = [threading.Thread(target=send, args=(done,)) for done in sent]
    for thread in threads:
        thread.start()
    port = int(base.rpartition(":")[2])
    deadline = time.monotonic() + 30
    while not all(done.is_set() for done in sent) or _unread(port, clients):
        if time.monotonic() > deadline:
            pytest.fail(f"the server did not read the slow requests; answers so far: {answers}")
        time.sleep(0.02)
    return threads, answers


def _unread(port: int, clients: list[int]) -> int:
    """How many of the connections from ``clients`` (local ports) to the server on
    127.0.0.1:port have something the server has not read (from /proc/net/tcp: the server's
    side of each, state ESTABLISHED, receive queue empty, counts as read)."""
    read = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        _, local, remote, state, queues, *_ = line.split()
        if local == f"0100007F:{port:04X}" and state == "01" and queues.endswith(":00000000"):
            read.add(int(remote.rpartition(":")[2], 16))
    return len(set(clients) - read)


needs_proc = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="reads the server's connections in /proc"
)


def _interrupted_in_flight(started, again: bool) -> tuple[int, list, str, str]:
    """Start the server, send requests that stay in flight, then Ctrl+C (twice, 0.3 s apart,
    if ``again``) and wait for exit status 130: how many requests were sent, their answers,
    the server's stdout and stderr."""
    process, base = started()
    threads, answers = _in_flight(base)
    process.send_signal(signal.SIGINT)
    if again:
        time.sleep(0.3)
        process.send_signal(signal.SIGINT)
    assert process.wait(120) == 130
    for thread in threads:
        thread.join(30)
    return len(threads), answers, *_output(process)


IN_FLIGHT = re.compile(r"stopping: finishing (\d+) requests? in flight; Ctrl\+C again cancels them")


@needs_proc
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_second_ctrl_c_cancels_the_requests_in_one_line(started):
    sent, answers, stdout, stderr = _interrupted_in_flight(started, again=True)
    lines = stderr.strip().splitlines()
    assert len(lines) == 2, stderr  # no traceback, no uvicorn log
    first, second = lines
    assert IN_FLIGHT.fullmatch(first), stderr
    cancelled = int(re.fullmatch(r"stopped; (\d+) requests? cancelled", second)[1])
    assert cancelled > 0
    assert " 500 " not in stdout
    # the requests cancelled see their connection close (no 500 is sent), the others finished
    assert (
        sorted(answers, key=str) == [200] * (sent - cancelled) + ["RemoteProtocolError"] * cancelled
    )


@needs_proc
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_lets_the_requests_in_flight_finish(started):
    sent, answers, stdout, stderr = _interrupted_in_flight(started, again=False)
    assert answers == [200] * sent
    assert IN_FLIGHT.fullmatch(stderr.strip()), stderr
    assert stdout.count('"POST /api/view HTTP/1.1" 200') == sent


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_on_an_idle_server_stops_it_silently(started):
    process, _ = started()
    process.send_signal(signal.SIGINT)
    assert process.wait(30) == 130
    assert _output(process)[1] == ""


@pytest.mark.parametrize(
    ("count", "words"),
    [(0, "0 requests"), (1, "1 request"), (2, "2 requests"), (11, "11 requests")],
)
def test_stop_lines_count_requests_in_english(count, words):
    """ "stopped; 0 requests cancelled" (a second Ctrl+C that found none), not "0 request"."""
    assert server.count_requests(count) == words


@pytest.mark.timeout(60)
def test_a_stop_counts_the_requests_not_answered_yet(monkeypatch):
    """A request whose whole answer went out may still have its task running (the app
    returning) when Ctrl+C comes: its client has the answer, and the stop leaves it out of
    the requests in flight. One whose answer is partly sent counts."""
    lines, running, release = [], threading.Event(), threading.Event()
    monkeypatch.setattr(server, "say", lines.append)

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        answered = scope["path"] == "/answered"
        await send({"type": "http.response.body", "body": b"first", "more_body": not answered})
        running.set()
        while not release.is_set():  # the app runs on after (or while) answering
            await asyncio.sleep(0.01)
        if not answered:
            await send({"type": "http.response.body", "body": b" last"})

    sock = server.listen("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    cancellable = server.Cancellable(app)
    uvicorn_server = server.Server(
        uvicorn.Config(cancellable, lifespan="off", log_level="warning"), cancellable
    )
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]})
    thread.start()
    pending = []
    client = threading.Thread(target=lambda: pending.append(httpx.get(f"{base}/pending").text))
    try:
        _wait_for(lambda: uvicorn_server.started, 20, "uvicorn did not start")
        client.start()
        _wait_for(running.is_set, 20, "the request did not start")
        assert httpx.get(f"{base}/answered", timeout=20).text == "first"
        uvicorn_server.handle_exit(signal.SIGINT, None)  # what Ctrl+C calls
        _wait_for(lambda: lines, 20, "the server did not stop")
    finally:
        release.set()
        client.join(20)
        uvicorn_server.should_exit = True
        thread.join(20)
        sock.close()
    assert lines == ["stopping: finishing 1 request in flight; Ctrl+C again cancels them"]
    assert pending == ["first last"]  # and it finished


# ---------------------------------------------------------------------------------------------
# under load: the benchmark's own client, bounded


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).parents[1] / "benchmarks" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    module = sys.modules["serve_load"] = importlib.util.module_from_spec(spec)  # for dataclasses
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_retries_busy_answers_as_the_page_does(bench):
    answers = iter([503, 503, 200])

    def reply(_request):
        return httpx.Response(next(answers), headers={"retry-after": "0"}, json={})

    async def main():
        result = bench.Result(1, 1, 0.0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as http:
            response = await bench.post(http, "http://127.0.0.1/api/view", {}, result)
        return response.status_code, result.busy

    assert asyncio.run(main()) == (200, 2)


def test_the_benchmark_reports_a_burst_where_every_request_failed(bench):
    result = bench.Result(5, 1, 1.0, errors=bench.Counter({"503 /api/view": 5}))
    assert "0.0 answered/s**; errors: 503 /api/view: 5" in bench.table(result)


def test_the_benchmark_reports_bursts_by_when_sent_and_answer(bench, model):
    assert model.tokenizer.count(bench.LONG) == 464  # as the table says
    result = bench.Result(1, 1, 1.0, latencies={"view": [0.1]})
    result.bursts = {("view", "later", 503): [0.01, 0.03], ("view", "at once", 200): [2.0]}
    assert bench.table(result).endswith(
        "\n| view | at once | 200 | 1 | 2000 | 2000 | 2000 | 2000 |"
        "\n| view | later | 503 | 2 | 20 | 28 | 30 | 30 |"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_burst_of_requests_has_no_errors_and_steady_memory(bench):
    result = bench.measure(requests=40, clients=4, timeout=60.0, at_once=0)
    assert result.errors == {}, result.errors
    assert result.rss_after - result.rss_before < 200 * 2**20


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bursts_of_long_requests_are_answered_or_refused_without_errors(bench):
    result = bench.measure(requests=5, clients=1, timeout=150.0, at_once=12, rounds=1)
    assert result.errors == {}, result.errors
    for label, _, _ in bench.LONG_CALLS:  # every request of a burst answered: run or refused
        answered = [len(result.bursts.get((label, "at once", status), [])) for status in (200, 503)]
        assert sum(answered) == 12, result.bursts
