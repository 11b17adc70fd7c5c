"""`selfattn serve`: the attention explorer as a local web app (FastAPI), one model shared.

The model is loaded once, at start-up, and handed to :func:`create_app`; the web chooses
nothing on disk. Every endpoint calls the same code as the command line: ``/api/explain``
returns ``explain_text(...)[1].to_json()`` exactly as ``selfattn explain --json`` prints it,
``/api/compare`` what ``selfattn compare --json`` prints, ``/api/view`` the payload of the
offline page (:func:`selfattn.viz.report.page_data`), which the live page renders with the
same script, and ``/api/generate`` (a decoder only) the payload of ``selfattn generate
--html``'s page (:func:`selfattn.viz.generation.generation_payload`) and the continuation.
Only the wording of options differs: where a message (an error, how the head was chosen, a
note) names options to change, the page's form fields are named ("the Word field"), not the
command line's flags (see :class:`selfattn.errors.Message`).

Safety, because a browser tab is an untrusted client:

- Bound to 127.0.0.1 by default, and only ``Host: 127.0.0.1``/``localhost``/``[::1]`` is
  answered then, so a web page cannot reach the API through DNS rebinding.
- Bodies are JSON objects (``Content-Type: application/json``, else 415) with typed, known
  fields only (unknown fields are refused) and of a declared size under ``MAX_BODY`` (411/413,
  before they are read); texts are limited in characters (413) and a generation in new tokens
  (413) before a request is admitted, and texts in the model's positions (413) on its worker,
  before its run; a prompt is not (its generation's window slides past them, as `selfattn
  generate` does).
- Model runs happen on a small thread pool under ``torch.inference_mode()``; at most
  ``workers + queue`` requests are admitted, the rest get 503 "busy" at once, so a burst
  waits in a bounded queue instead of piling up memory. The event loop never waits for a run,
  or every request would wait with it, refusals too: it reads, checks and admits requests;
  tokenizing (even to count tokens: it takes the tokenizer's lock, which a run holds while it
  tokenizes) happens on the workers, and so does making the answer's JSON, in pieces (one
  ``json.dumps`` of megabytes holds the GIL, which the loop needs). A request whose client
  leaves before its run starts is dropped and frees its place in the queue.
- Every error is one line of ``detail``: user mistakes (``ValueError``, among them
  ``SelfAttnError`` and its ``OutOfRange``) are 400 with their message (options named as the
  page names them), anything else is a generic 500 whose traceback goes to the server's log only.
- The page is served from the package with a strict Content-Security-Policy: scripts and
  styles from this server only, requests to this server only, nothing from the network.
  FastAPI's ``/docs`` page loads its assets from a CDN, so it is switched off;
  ``/openapi.json`` describes the API.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import re
import signal
import socket
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from importlib.resources import files
from typing import Annotated, Any, ClassVar, Literal

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from uvicorn.server import HANDLED_SIGNALS

from selfattn import explain as explaining
from selfattn.errors import Message, Options, SelfAttnError, message_of, worded
from selfattn.models.gpt import MAX_SAMPLING_SEED
from selfattn.models.model import Model
from selfattn.recording import in_range
from selfattn.viz import report
from selfattn.viz.generation import generation_payload, opening_view

MAX_CHARS = 2_000  # per text; the model's positions limit tokens as well
MAX_SENTENCES = 4
MAX_NEW_TOKENS = 200  # per generation: its page holds every step's weights, layer and head
MAX_BODY = 256 * 2**10  # bytes: 4 texts at the limit, every character \u-escaped, fit
WORKERS = 2  # model runs at once (the CPU has few cores; more only queue inside torch)
QUEUE = 8  # requests admitted beyond the running ones; the next get 503
Receive = Callable[[], Awaitable[dict]]  # an ASGI receive
OCCURRENCE = "Which occurrence of word (0 = first, -1 = last)."
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")  # names in a Host header (IPv6 in brackets)
HOST_HEADER = re.compile(r"(?P<name>\[[0-9a-f:.]+\]|[^:\[\]]+)(?::\d+)?", re.IGNORECASE)
API = (
    "GET /api/models",
    "POST /api/view",
    "POST /api/compare",
    "POST /api/explain",
    "POST /api/generate",
)
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
STATIC = {  # the only files served: name -> media type
    "serve.html": "text/html; charset=utf-8",
    "serve.js": "text/javascript; charset=utf-8",
    "serve.css": "text/css; charset=utf-8",
    "view.js": "text/javascript; charset=utf-8",
    "view.css": "text/css; charset=utf-8",
    "generation.js": "text/javascript; charset=utf-8",
    "generation.css": "text/css; charset=utf-8",
}


# ---------------------------------------------------------------------------------------------
# Requests: JSON objects with known, typed fields only


class StrictBody(BaseModel):
    """Strict JSON: no "1" for 1, no unknown fields (no way to name a file or model)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # whether its texts must fit in the model's positions (else 413 on the worker)
    within_positions: ClassVar[bool] = True


Text = Annotated[str, Field(description=f"The text to run (at most {MAX_CHARS} characters).")]
Layer = Annotated[int | None, Field(description="Layer (0 = first); none: the most telling.")]
Head = Annotated[
    int | Literal["mean"] | None,
    Field(description="Head number or 'mean' (the layer's heads averaged); none: chosen."),
]


class Selection(StrictBody):
    """A text and, optionally, what to look at in it (as `selfattn explain` takes them)."""

    text: Text
    word: str | None = Field(
        None, max_length=MAX_CHARS, description="The word to explain as a query."
    )
    index: int | None = Field(None, description="The token index to explain instead of word.")
    occurrence: int = Field(0, description=OCCURRENCE)
    layer: Layer = None
    head: Head = None

    def texts(self) -> dict[str, str]:
        """The texts to run, by their name in a message."""
        return {"the text": self.text}


class ExplainRequest(Selection):
    """`selfattn explain --json`'s options."""

    similarity: Literal["dot", "cosine"] | None = Field(
        None, description="Recompute the head with this similarity, next to the model's."
    )
    scale: float | None = Field(
        None, allow_inf_nan=False, description="Recompute the head with this scale (1 = none)."
    )
    words: bool = Field(False, description="Also merge word pieces: keys summed, queries mean.")


class CompareRequest(StrictBody):
    """`selfattn compare --json`'s arguments."""

    sentences: list[str] = Field(min_length=2, max_length=MAX_SENTENCES)
    word: str = Field(max_length=MAX_CHARS, description="The word to follow across the sentences.")
    occurrence: int = Field(0, description=OCCURRENCE + " In every sentence.")

    def texts(self) -> dict[str, str]:
        """The texts to run, by their name in a message."""
        return {f"sentence {number}": text for number, text in enumerate(self.sentences, 1)}


class GenerateRequest(StrictBody):
    """`selfattn generate --html`'s options: the sampling, and what its page opens on."""

    # a prompt longer than the model's positions is taken, as by `selfattn generate`: the window
    # slides (Model.generate_recorded records each step's keys from GenerationStep.start)
    within_positions: ClassVar[bool] = False

    prompt: str = Field(description=f"The text to continue (at most {MAX_CHARS} characters).")
    max_new_tokens: int = Field(
        50, ge=1, description=f"Tokens to generate (at most {MAX_NEW_TOKENS})."
    )
    temperature: float = Field(
        0.8, ge=0, allow_inf_nan=False, description="Sampling temperature; 0 is greedy."
    )
    top_k: int | None = Field(None, ge=1, description="Sample among the k likeliest only.")
    seed: int | None = Field(
        None,
        ge=0,
        le=MAX_SAMPLING_SEED,
        description="Seed for repeatable sampling; none: anew each run.",
    )
    layer: int = Field(-1, description="The layer shown first (negative counts from the end).")
    head: int | Literal["mean"] = Field("mean", description="The head shown first, or 'mean'.")
    step: int = Field(
        0,
        description="The new token shown first (0 = the first generated); past an end-of-text "
        "token that ended the generation early, the last.",
    )

    def texts(self) -> dict[str, str]:
        """The texts to run, by their name in a message."""
        return {"the prompt": self.prompt}


Body = Selection | CompareRequest | GenerateRequest
Run = Callable[[Model, Any], Response]  # a model run for one request (its body): its answer


# ---------------------------------------------------------------------------------------------
# Limits and the worker pool


class TooLarge(Exception):
    """A request beyond the explorer's size limits (413)."""


class Busy(Exception):
    """Every worker and queue slot is taken (503)."""


class Abandoned(Exception):
    """The client left before its model run started: the run is dropped (nobody reads it)."""


async def _client_leaves(receive: Receive) -> bool:
    """Whether the client went away: once the body is read, the next ASGI message is
    ``http.disconnect``, sent when the connection closes (or once the response is sent)."""
    return (await receive())["type"] == "http.disconnect"


class Pool:
    """A few threads for model runs, and a bound on the requests admitted to wait for them."""

    def __init__(self, workers: int, queue: int) -> None:
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="selfattn-worker")
        self.capacity = workers + queue
        self.admitted = 0
        self.lock = threading.Lock()

    async def run(
        self, function: Callable[..., Any], *args: Any, receive: Receive | None = None
    ) -> Any:
        """``function(*args)`` on a worker under inference mode; Busy when the queue is full.

        ``receive``: the request's ASGI receive, to hear its client leave; a run that has not
        started then is dropped (Abandoned) and frees its slot at once. A run already started
        finishes, its answer unread (a thread cannot be stopped midway).
        """
        with self.lock:
            if self.admitted >= self.capacity:
                raise Busy
            self.admitted += 1
        try:
            future = self.executor.submit(_inference, function, *args)
        except BaseException:  # the pool is shut down: no run, so no slot held
            self._release(None)
            raise
        future.add_done_callback(self._release)  # when it ran, failed or was cancelled
        result = asyncio.wrap_future(future)
        if receive is None:
            return await result
        leaving = asyncio.ensure_future(_client_leaves(receive))
        try:
            done, _ = await asyncio.wait((result, leaving), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the request was cancelled: so is its run, if waiting
            future.cancel()
            raise
        finally:
            leaving.cancel()
        if leaving in done and not leaving.exception() and leaving.result() and future.cancel():
            raise Abandoned
        return await result

    def _release(self, _future: object) -> None:
        with self.lock:
            self.admitted -= 1

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


@asynccontextmanager
async def _closing(pool: Pool) -> AsyncIterator[None]:
    yield
    pool.close()


def _inference(function: Callable[..., Any], *args: Any) -> Any:
    with torch.inference_mode():
        return function(*args)


def check_length(body: Body) -> None:
    """413 for a text over the character limit: on the event loop, before admission."""
    for name, text in body.texts().items():
        if len(text) > MAX_CHARS:
            raise TooLarge(
                f"{name} is {len(text):,} characters; the explorer takes at most {MAX_CHARS:,}: "
                "shorten it"
            )


def check_tokens(model: Model, body: Body) -> None:
    """413 for a text over the model's positions: on the worker, before the run (counting
    tokenizes, under the tokenizer's lock that runs hold while they tokenize). A prompt to
    generate from is not counted: its window slides past the positions."""
    if model.tokenizer is None or not body.within_positions:
        return
    limit = model.config.max_positions
    for name, text in body.texts().items():
        if (count := model.tokenizer.count(text)) > limit:
            raise TooLarge(
                f"{name} is {count:,} tokens; {model.name} takes at most {limit:,}: shorten it"
            )


def check_generation(model: Model, body: GenerateRequest) -> None:
    """400 for an encoder, or a layer, head or step the page would not have; 413 for a
    generation over the limit: before admission."""
    if model.config.kind != "decoder":
        raise SelfAttnError(
            f"Generate needs a decoder (GPT or Llama family); {model.name} is an encoder: serve "
            "a model trained by `selfattn train` (--checkpoint) or a GPT-2, GPT-NeoX, Llama, "
            "Mistral, Qwen, Phi-3 or Gemma folder (--model)"
        )
    if body.max_new_tokens > MAX_NEW_TOKENS:
        raise TooLarge(
            f"{body.max_new_tokens:,} new tokens asked for; the explorer generates at most "
            f"{MAX_NEW_TOKENS} a run: ask for fewer"
        )
    opening_view(model.config.n_layers, model.config.n_heads, body.layer, body.head)
    in_range(body.step, body.max_new_tokens, "step", "the generation has steps")


def error_reply(status: int, detail: str, **headers: str) -> JSONResponse:
    """The explorer's every error: a status and one line of ``detail`` (a line break in what
    the client sent, such as a field's name, is shown as ``\\n``)."""
    one_line = "\\n".join(detail.splitlines())
    return JSONResponse({"detail": one_line}, status_code=status, headers=headers or None)


def _refuse_host(request: Request, allowed: tuple[str, ...]) -> JSONResponse | None:
    """400 for a Host header naming another machine (DNS rebinding), before anything else."""
    if "*" in allowed:
        return None
    header = request.headers.get("host", "")
    match = HOST_HEADER.fullmatch(header)
    if match and match["name"].lower() in allowed:
        return None
    names = ", ".join(f"http://{name}:<port>/" for name in allowed)
    return error_reply(400, f"the Host {header!r} is not this machine; open {names}")


def _refuse_body(request: Request) -> JSONResponse | None:
    """411/413/415 for a POST body of unknown size, over MAX_BODY or not JSON, before it is read."""
    if request.method != "POST":
        return None
    length = request.headers.get("content-length", "")
    if not length.isdigit():
        return error_reply(411, "send the body with a Content-Length")
    if int(length) > MAX_BODY:
        return error_reply(
            413, f"the body is {int(length):,} bytes; the explorer takes at most {MAX_BODY:,}"
        )
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        return error_reply(
            415, f"the body is {media or 'untyped'}; send JSON with Content-Type: application/json"
        )
    return None


def as_json(data: dict) -> Response:
    """Serialise on the worker (large payloads) as the command line prints them, options named
    as the page names them."""
    return Response(json_text(for_the_page(data)), media_type="application/json")


def json_text(value: Any) -> str:
    """``json.dumps(value)``, the same text, made row by row: one ``json.dumps`` holds the GIL
    throughout (0.1-0.25 s for the 5 MB of a 464-token explain), stopping the event loop and
    its refusals; between rows the GIL changes hands (Python's switch interval: 5 ms)."""
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        items = (f"{json.dumps(key)}: {json_text(item)}" for key, item in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list | tuple) and value and isinstance(value[0], list | tuple | dict):
        return "[" + ", ".join(json_text(item) for item in value) + "]"
    return json.dumps(value)


# The page's names for the request fields (and the options messages name, by the same names):
# its form fields, Explore's tokens and Generate's new tokens. The one table for every message,
# the 400s' options (errors.Message.worded) and the 422s' fields (_validation_detail), but for
# the layer and head of Explore's and Generate's requests, their menus (MENU_NAMES).
PAGE_NAMES = {
    "text": "the Text field",
    "word": "the Word field",
    "occurrence": "the Occurrence field",
    "layer": "the Layer field",
    "head": "the Head field",
    "index": "a token clicked in Explore",
    "similarity": "the Similarity field",
    "scale": "the Scale field",
    "sentences": "the sentences",
    "prompt": "the Prompt field",
    "max_new_tokens": "the New tokens field",
    "temperature": "the Temperature field",
    "top_k": "the Top-k field",
    "seed": "the Seed field",
    "step": "a new token clicked in Generate",
}


def page_naming(options: tuple[str, ...]) -> str:
    """Options as the page names them: "the Layer field or the Head field" (an option it has
    no name for by its API field: an unknown field, or ``words``, which the page never sends)."""
    return " or ".join(PAGE_NAMES.get(name, name) for name in options)


def for_the_page(value: Any) -> Any:
    """``value`` with each message in it worded for the page (:func:`page_naming`); messages
    sit in objects, so lists (of numbers, tokens) are left as they are."""
    if isinstance(value, dict):
        return {key: for_the_page(item) for key, item in value.items()}
    return worded(value, page_naming) if isinstance(value, str) else value


# ---------------------------------------------------------------------------------------------
# The app


def create_app(
    model: Model,
    *,
    workers: int = WORKERS,
    queue: int = QUEUE,
    allowed_hosts: tuple[str, ...] = LOCAL_HOSTS,
) -> FastAPI:
    """The explorer for one loaded ``Model`` (shared by every request; never reloaded).

    ``allowed_hosts``: the Host headers answered (``("*",)`` when served to the network).
    """
    pool = Pool(workers, queue)
    app = FastAPI(
        title="selfattn explorer",
        summary="Self-attention of a real model on your text, step by step.",
        version="1",
        docs_url=None,  # FastAPI's docs pages load from a CDN; /openapi.json stays
        redoc_url=None,
        lifespan=lambda _app: _closing(pool),
    )
    _add_error_handlers(app)
    static = {name: (files("selfattn.viz") / "static" / name).read_bytes() for name in STATIC}

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """Refuse other hosts and bodies of unknown size, too large or not JSON; every answer
        gets the security headers."""
        refused = _refuse_host(request, allowed_hosts) or _refuse_body(request)
        response = refused if refused is not None else await call_next(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Cache-Control"] = "no-store"
        return response

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def index() -> Response:
        return Response(static["serve.html"], media_type=STATIC["serve.html"])

    @app.api_route("/static/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in STATIC:
            return error_reply(404, f"no file {name!r}; the page's files are {', '.join(STATIC)}")
        return Response(static[name], media_type=STATIC[name])

    @app.get("/api/models")
    def models() -> dict:
        """The model loaded at start-up, and the limits of the explorer."""
        config = model.config
        return {
            "models": [
                {
                    "name": model.name,
                    "kind": config.kind,
                    "layers": config.n_layers,
                    "heads": config.n_heads,
                    "max_positions": config.max_positions,
                }
            ],
            "limits": {
                "max_chars": MAX_CHARS,
                "max_sentences": MAX_SENTENCES,
                "max_new_tokens": MAX_NEW_TOKENS,
            },
        }

    # HEAD as well, out of the schema (one operation per route there)
    app.add_api_route("/api/models", models, methods=["HEAD"], include_in_schema=False)

    async def run(function: Run, body: Body, request: Request) -> Response:
        """``function(model, body)`` on a worker, once admitted (else 503 at once); a text over
        the character limit is refused before (413), one over the model's positions on the
        worker (413; not a prompt to generate from)."""
        check_length(body)
        return await pool.run(_fitted, function, model, body, receive=request.receive)

    @app.post("/api/explain")
    async def explain(body: ExplainRequest, request: Request) -> Response:
        """What `selfattn explain --json` prints for the same options: every step's numbers.

        ``weights`` = softmax(``scaled``), ``output`` = weights @ ``values``; with
        ``similarity``/``scale``, ``alternative`` holds the head recomputed that way.
        """
        return await run(_explain, body, request)

    @app.post("/api/view")
    async def view(body: Selection, request: Request) -> Response:
        """The live page's payload: q, k, v of every layer and head (see selfattn.viz.html)."""
        return await run(_view, body, request)

    @app.post("/api/compare")
    async def compare(body: CompareRequest, request: Request) -> Response:
        """What `selfattn compare --json` prints: the word's cosine similarity, layer by layer."""
        return await run(_compare, body, request)

    @app.post("/api/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        """A decoder's continuation of the prompt, and per new token the attention that chose
        it: the payload of `selfattn generate --html`'s page, plus ``text`` (the continuation)."""
        check_generation(model, body)
        return await run(_generate, body, request)

    return app


def _fitted(function: Run, model: Model, body: Body) -> Response:
    """``function(model, body)`` once the body's texts fit the model's positions (413; a
    prompt to generate from need not)."""
    check_tokens(model, body)
    return function(model, body)


def _explain(model: Model, body: ExplainRequest) -> Response:
    options = body.model_dump(exclude={"text", "word", "index", "occurrence"})
    _, explanation = explaining.explain_text(
        model, body.text, word=body.word, index=body.index, occurrence=body.occurrence, **options
    )
    return as_json(explanation.to_json())


# Explore's and Generate's names for the layer and head: the menus over their map, not
# Similarity & scale's fields; their requests' messages (the 400s, the 422s) name them so.
MENU_NAMES = report.MENU_NAMES
MENU_PATHS = ("/api/view", "/api/generate")


def menu_naming(options: tuple[str, ...]) -> str:
    """Options as Explore and Generate name them: "the layer menu or the head menu"."""
    return " or ".join(MENU_NAMES.get(name, PAGE_NAMES.get(name, name)) for name in options)


def naming_for(request: Request) -> Callable[[tuple[str, ...]], str]:
    """How the view that sends ``request`` names the request's fields."""
    return menu_naming if request.url.path in MENU_PATHS else page_naming


def _view(model: Model, body: Selection) -> Response:
    run, explanation = explaining.explain_text(
        model, body.text, word=body.word, index=body.index, occurrence=body.occurrence,
        layer=body.layer, head=body.head,
    )  # fmt: skip
    return as_json(report.page_data(run, explanation))


def _compare(model: Model, body: CompareRequest) -> Response:
    comparison = explaining.compare_texts(
        model, body.sentences, body.word, occurrence=body.occurrence
    )
    return as_json(comparison.to_json() | {"model": model.name})


def _generate(model: Model, body: GenerateRequest) -> Response:
    sampling = body.model_dump(include={"temperature", "top_k", "seed"})
    generation = model.generate_recorded(body.prompt, body.max_new_tokens, **sampling)
    step = min(body.step, len(generation.steps) - 1)  # checked against max_new_tokens before
    payload = generation_payload(
        generation, windows=model.config.sliding_windows, layer=body.layer, head=body.head,
        step=step,
    )  # fmt: skip
    return as_json(payload)


# ---------------------------------------------------------------------------------------------
# Errors: one line of detail, never a traceback


def _one_line(error: BaseException | str) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


NOT_JSON = "the request body is not valid JSON; send one JSON object, in UTF-8"
FIELDS = "its fields are in /openapi.json"
HEAD_CHOICE = Message(Options("head", ("head",)), ": give a head number (0 = first) or 'mean'")
SENTENCE_COUNT = f"give 2 to {MAX_SENTENCES} sentences to compare"
# (field, Pydantic's error type) -> what to send instead, where Pydantic's message is unclear
PLAIN_DETAILS: dict[tuple[str, str], str] = {
    ("sentences", "too_short"): SENTENCE_COUNT,
    ("sentences", "too_long"): SENTENCE_COUNT,
    ("head.int", "int_type"): HEAD_CHOICE,
    ("head.literal['mean']", "literal_error"): HEAD_CHOICE,
    # an empty body (and, with older FastAPI, a body of null)
    ("", "missing"): f"the request body must be a JSON object ({FIELDS})",
    ("", "model_attributes_type"): f"the request body must be a JSON object ({FIELDS})",
}
FASTAPI_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's 400 for undecodable JSON


def _validation_detail(
    error: RequestValidationError, naming: Callable[[tuple[str, ...]], str] = page_naming
) -> str:
    """Pydantic's error list as one line, each field named as the page names it (as the 400s
    name options; ``naming``, :func:`naming_for` the request): 'the Layer field: Input should
    be a valid integer'."""
    parts = []
    for item in error.errors():
        if item["type"] == "json_invalid":
            return NOT_JSON
        path = [part for part in item["loc"] if part != "body"]
        where = ".".join(str(part) for part in path)
        plain = PLAIN_DETAILS.get((where, item["type"]))
        if item["type"] == "extra_forbidden":  # not a field of this request: named as sent
            parts.append(f"{where}: {item['msg']}")
            continue
        parts.append(worded(plain or _field_message(path, item["msg"]), naming))
    return "; ".join(dict.fromkeys(parts)) or "invalid request"


def _field_message(path: list[str | int], message: str) -> str:
    """Pydantic's message about the field at ``path`` (none: the body), its field an option
    (worded as the page names it); one of the sentences as the 413s name it, "sentence 2"."""
    if not path:
        return message
    if path[0] == "sentences" and len(path) == 2 and isinstance(path[1], int):
        return f"sentence {path[1] + 1}: {message}"
    where = ".".join(str(part) for part in path)
    return Message(Options(where, (str(path[0]),)), f": {message}")


def _http_detail(request: Request, error: HTTPException) -> tuple[int, str]:
    """Starlette's and FastAPI's own errors (no such path or method, undecodable body): the
    status, and what to do instead."""
    path = request.url.path
    if error.status_code == 404:
        return 404, f"nothing at {path}; the page is / and the API is {', '.join(API)}"
    if error.status_code == 405:
        allowed = " or ".join(sorted(error.headers["Allow"].split(", ")))
        return 405, f"{request.method} is not allowed on {path}; use {allowed}"
    if error.detail == FASTAPI_PARSE_ERROR:
        return 422, NOT_JSON  # as for any other body that is not JSON
    return error.status_code, _one_line(error.detail)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return error_reply(*_http_detail(request, error), **(error.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_reply(422, _validation_detail(error, naming_for(request)))

    @app.exception_handler(TooLarge)
    async def too_large(_request: Request, error: TooLarge) -> JSONResponse:
        return error_reply(413, _one_line(error))

    @app.exception_handler(Abandoned)
    async def abandoned(_request: Request, _error: Abandoned) -> JSONResponse:
        # never delivered (the connection is closed) nor logged: uvicorn drops it
        return error_reply(499, "the client left before its run started; it was dropped")

    @app.exception_handler(Busy)
    async def busy(_request: Request, _error: Busy) -> JSONResponse:
        return error_reply(503, "the explorer is busy; retry in a moment", **{"Retry-After": "1"})

    async def user_error(request: Request, error: Exception) -> JSONResponse:
        return error_reply(400, _one_line(worded(message_of(error), naming_for(request))))

    app.add_exception_handler(ValueError, user_error)

    @app.exception_handler(Exception)
    async def internal(_request: Request, _error: Exception) -> JSONResponse:
        # Starlette re-raises the error after this reply, so the server's log has the traceback.
        return error_reply(500, "internal error; the server's log has the details")


# ---------------------------------------------------------------------------------------------
# Running it


def is_local(host: str) -> bool:
    """Whether binding ``host`` keeps the explorer on this machine."""
    return host in LOCAL_HOSTS or host == "::1"


def url(host: str, port: int) -> str:
    """The page's address on ``host:port`` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` for :func:`serve`: a port in use (or an address this
    machine does not have) is then a one-line error before the model loads. Port 0 is a free
    one, chosen by the system (``sock.getsockname()[1]``). Connections wait in its backlog
    until uvicorn accepts them: the address can be opened as soon as it is printed."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as error:
        raise SelfAttnError(f"cannot listen on {host}: {error.strerror}; check --host") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)  # uvicorn's backlog
    except OSError as error:
        sock.close()
        fix = "pick another --port" if error.errno == errno.EADDRINUSE else "check --host"
        raise SelfAttnError(f"cannot listen on {host}:{port}: {error.strerror}; {fix}") from None
    return sock


def serve(model: Model, host: str, sock: socket.socket) -> int:
    """Serve the explorer with uvicorn on ``sock`` (from :func:`listen` on ``host``) until a
    signal stops it; the exit status: 128 + that signal (130 for Ctrl+C), else 0.

    Ctrl+C lets the requests in flight finish (saying so in one line when there are any); a
    second Ctrl+C cancels them: their connections close, one line counts them, no traceback.
    The log is the access log (one line a request) and warnings: uvicorn's start-up and
    shutdown steps are left out.
    """
    hosts = LOCAL_HOSTS if is_local(host) else ("*",)
    app = Cancellable(create_app(model, allowed_hosts=hosts))
    server = Server(uvicorn.Config(app, log_level="info"), app)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    server.run(sockets=[sock])
    return 128 + server.signal if server.signal else 0


def say(line: str) -> None:
    """One line for the person running the server (stderr, as uvicorn's log)."""
    print(line, file=sys.stderr, flush=True)


def count_requests(count: int) -> str:
    return f"{count} request" + ("" if count == 1 else "s")


class Cancellable:
    """The app as uvicorn runs it: once ``cancelling``, a request cancelled ends quietly (its
    connection is already closed) instead of as a 500 and a traceback in uvicorn's log.

    It also notes the requests whose whole answer is sent (their uvicorn task, in
    ``answered``): the client has it, though the task may run on a little (the app returning),
    and a Ctrl+C then finds no request in flight."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self.cancelling = False
        self.answered: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]):
        task = asyncio.current_task()  # uvicorn's, one a request

        async def sending(message: dict) -> None:
            await send(message)  # uvicorn writes the last of the body before it returns
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.answered.add(task)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if not self.cancelling:
                raise

    def in_flight(self, tasks: set[asyncio.Task]) -> list[asyncio.Task]:
        """Those of uvicorn's ``tasks`` (one a request) not done whose answer is not all sent."""
        return [task for task in tasks if not task.done() and task not in self.answered]


class Server(uvicorn.Server):
    """uvicorn's server with a quiet Ctrl+C: the first lets the requests in flight finish, a
    second cancels them; either way no traceback, and no signal raised again on the way out
    (:func:`serve` returns the exit status instead)."""

    def __init__(self, config: uvicorn.Config, app: Cancellable) -> None:
        super().__init__(config)
        self.app = app
        self.signal = 0  # the first signal received

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.signal = self.signal or sig
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if in_flight := self.app.in_flight(self.server_state.tasks):
            again = "; Ctrl+C again cancels them" if self.signal == signal.SIGINT else ""
            say(f"stopping: finishing {count_requests(len(in_flight))} in flight{again}")
        graceful = asyncio.ensure_future(super().shutdown(sockets))
        while not graceful.done() and not self.force_exit:
            await asyncio.sleep(0.1)
        if self.force_exit:
            cancelled = await self.cancel_requests()
            await graceful  # uvicorn then leaves the app's shutdown out: run it here
            if not getattr(self.lifespan, "shutdown_event", asyncio.Event()).is_set():
                await self.lifespan.shutdown()
            say(f"stopped; {count_requests(cancelled)} cancelled")
        await graceful

    async def cancel_requests(self) -> int:
        """Close every connection, then cancel the requests in flight: how many there were (those
        answered already, their task still running, are cancelled too, not counted)."""
        tasks = [task for task in self.server_state.tasks if not task.done()]
        in_flight = len(self.app.in_flight(self.server_state.tasks))
        self.app.cancelling = True
        for connection in list(self.server_state.connections):
            connection.transport.abort()  # the client sees the connection close
        await asyncio.sleep(0)  # uvicorn marks each request disconnected: no 500 is sent
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return in_flight
