"""A loaded model with its tokenizer: look inside one text (``run``), embed many (``encode``),
continue a prompt (``generate``).

:class:`Model` wraps a network built from our layers (:class:`~selfattn.models.bert.Bert`, or a
:class:`~selfattn.models.gpt.Decoder`: :class:`~selfattn.models.gpt.GPT`,
:class:`~selfattn.models.llama.Llama`). :meth:`Model.run` runs one text on the fast path under
:func:`selfattn.record` and returns a :class:`Run`: tokens aligned to words, every layer's hidden
states, and attention weights and traces recomputed on demand for the layers and heads asked for.
"""

from __future__ import annotations

import reprlib
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar, TypeVar, overload

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import Progress
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from selfattn.attention import AttentionTrace, check_backend
from selfattn.errors import OutOfRange, SelfAttnError, is_integer
from selfattn.layers import AttentionModule
from selfattn.models.bert import Bert, EncoderOutput
from selfattn.models.gpt import Decoder, DecoderOutput, GPTConfig, out_of_range
from selfattn.models.llama import LlamaConfig
from selfattn.recording import Capture, Recording, in_range, record
from selfattn.text import Encoding, Span, Tokenizer, Word

_T = TypeVar("_T")
PROGRESS_MIN_BATCHES = 4  # progress=None shows a bar above this many batches on a terminal


@dataclass(frozen=True)
class ModelConfig:
    """What a viewer needs to know about a model, whatever its architecture."""

    kind: str  # "encoder" (BERT family) or "decoder" (GPT and Llama families)
    model_type: str  # config.json's model_type: "bert", "gpt2", "llama"...
    n_layers: int
    n_heads: int
    d_model: int
    max_positions: int
    vocab_size: int
    skipped: tuple[str, ...] = ()  # the checkpoint's task heads left out ("classifier.*")
    sliding_windows: tuple[int | None, ...] = ()  # per layer (None: full), () for none at all
    eos_token_ids: tuple[int, ...] = ()  # tokens that end a generation (decoders)

    @classmethod
    def for_decoder(cls, config: GPTConfig | LlamaConfig, model_type: str) -> ModelConfig:
        """The description of a :class:`GPT` (a GPT-2 checkpoint, or one trained here) or a
        :class:`Llama` (of any family it serves, or one trained here)."""
        if isinstance(config, GPTConfig):
            layers, heads, width = config.n_layer, config.n_head, config.n_embd
            positions, windows = config.block_size, ()
        else:
            layers, heads, width = config.n_layers, config.n_heads, config.d_model
            positions, windows = config.max_positions, config.sliding_windows
        return cls(
            kind="decoder",
            model_type=model_type,
            n_layers=layers,
            n_heads=heads,
            d_model=width,
            max_positions=positions,
            vocab_size=config.vocab_size,
            sliding_windows=windows,
        )


@dataclass(frozen=True)
class SentenceConfig:
    """How sentence-transformers turns this checkpoint's token vectors into one vector."""

    POOLINGS: ClassVar[tuple[str, ...]] = ("mean_tokens", "cls_token", "max_tokens")

    pooling: str = "mean_tokens"  # one of POOLINGS (names as in 1_Pooling/config.json)
    max_seq_length: int = 512  # longer texts are cut to this many tokens
    not_computed: tuple[str, ...] = ()  # modules of its pipeline that encode lacks (Dense)
    normalize: bool = False  # its pipeline ends with a Normalize step (unit length)
    lowercase: bool = False  # sentence_bert_config.json's do_lower_case: texts lowercased first


def set_backend(model: nn.Module, backend: str) -> None:
    """Set the attention backend of every attention module in ``model``."""
    check_backend(backend)
    for module in model.modules():
        if isinstance(module, AttentionModule):
            module.backend = backend


def pool(hidden: Tensor, mask: Tensor, pooling: str) -> Tensor:
    """One vector per sequence from token vectors (B, T, D) and the padding mask (B, T)."""
    if pooling == "cls_token":
        return hidden[:, 0]
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    if pooling == "max_tokens":
        return hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def _check_ids(name: str, ids: Tensor, limit: int, device: torch.device) -> None:
    """A one-line error unless ``ids`` is an integer tensor (batch, length) of values < limit,
    on the model's ``device`` (the values unread inside a ``torch.compile`` graph)."""
    if not isinstance(ids, Tensor):
        raise SelfAttnError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 2:
        fix = "reshape it to (batch, length)"
        fix = f"add the batch dim with {name}.unsqueeze(0)" if ids.dim() == 1 else fix
        raise SelfAttnError(
            f"{name} must have shape (batch, length), got {tuple(ids.shape)}; {fix}"
        )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise SelfAttnError(f"{name} must hold integers (token ids), got {ids.dtype}; use .long()")
    if ids.device != device:
        raise SelfAttnError(
            f"{name} is on {ids.device} but the model is on {device}; move it: "
            f"{name}.to(model.device)"
        )
    if outside := out_of_range(ids, limit):
        low, high = outside
        raise SelfAttnError(
            f"{name} must lie in 0..{limit - 1}, got values from {low} to {high}; "
            "use the model's own tokenizer"
        )


def _check_like_ids(name: str, tensor: Tensor, input_ids: Tensor) -> None:
    """A one-line error unless ``tensor`` is a tensor of input_ids' shape (batch, length)."""
    if not isinstance(tensor, Tensor) or tensor.shape != input_ids.shape:
        got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
        raise SelfAttnError(
            f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {got}"
        )
    if tensor.device != input_ids.device:
        raise SelfAttnError(
            f"{name} is on {tensor.device} but input_ids are on {input_ids.device}; move it: "
            f"{name}.to(input_ids.device)"
        )


@dataclass(frozen=True, repr=False, eq=False)  # tensors: compared by identity
class Run:
    """One text through the model: tokens, words, hidden states and the recorded attention.

    Layers of :meth:`attention` and :meth:`trace` count attention layers, ``0 .. n_layers-1``;
    layers of :attr:`hidden_states` and :meth:`word_vector` count states, ``0`` being the
    embeddings and ``n_layers`` the last block's output. Negative indices count from the end.
    """

    encoding: Encoding
    hidden_states: Tensor  # (L+1, T, D): embeddings, then each block's output
    captures: Recording  # q, k, v of every attention layer, recorded on the fast path
    logits: Tensor | None  # (T, vocab) next-token scores, decoders only
    model_name: str = "model"
    sliding_windows: tuple[int | None, ...] = ()  # per layer, as ModelConfig's (Mistral's)

    def __repr__(self) -> str:
        return (
            f"Run({self.model_name!r}, {reprlib.repr(self.text)}: {len(self.tokens)} tokens, "
            f"{self.n_layers} layers x {self.n_heads} heads)"
        )

    @property
    def text(self) -> str:
        """The text as given."""
        return self.encoding.text

    @property
    def read_text(self) -> str:
        """The part of :attr:`text` the model read: all of it, unless ``truncate`` dropped
        tokens (characters that make no token, a final vowel sign, are still the text's)."""
        return self.encoding.read_text

    @property
    def tokens(self) -> list[str]:
        """The tokens as read: "##ing" for a word piece, " bank" for byte-level BPE."""
        return self.encoding.tokens

    @property
    def token_ids(self) -> list[int]:
        """Each token's id in the model's vocabulary."""
        return self.encoding.ids

    @property
    def offsets(self) -> list[Span]:
        """Each token's characters in :attr:`text`, (start, end); empty for special tokens
        and for a space the tokenizer added alone."""
        return self.encoding.offsets

    @property
    def word_ids(self) -> list[int | None]:
        """Each token's index in :attr:`words`; None for special tokens."""
        return self.encoding.word_ids

    @property
    def words(self) -> list[Word]:
        """The words of the text that have at least one token."""
        return self.encoding.words

    @property
    def n_layers(self) -> int:
        """How many attention layers (blocks) the model has."""
        return self.hidden_states.shape[0] - 1

    @property
    def n_heads(self) -> int:
        """How many heads each attention layer has."""
        return self.captures[0].n_heads

    def trace(self, layer: int, head: int | None = None) -> AttentionTrace:
        """Every intermediate of one head (``(T, T)`` weights) or all heads (``(H, T, T)``)."""
        layer = in_range(layer, self.n_layers, "layer", "this model has attention layers")
        return self.captures.layer(layer)[0].trace(head)

    def attention(self, layer: int, head: int | None = None) -> Tensor:
        """Attention weights of one head ``(T, T)``, or of all heads ``(H, T, T)``."""
        return self.trace(layer, head).weights

    def word_tokens(self, word_or_span: str | Span, occurrence: int = 0) -> range:
        """Token indices of a word (whole word, case-insensitive) or a character span."""
        return self.encoding.select(word_or_span, occurrence)

    def token_index(self, word: str, occurrence: int = 0) -> int:
        """Index of the first token of ``word`` (its ``occurrence``-th match)."""
        return self.word_tokens(word, occurrence).start

    def word_vector(self, word_or_span: str | Span, layer: int = -1, occurrence: int = 0) -> Tensor:
        """Mean hidden state ``(D,)`` of the word's tokens at ``layer`` (default: the last)."""
        if not -self.n_layers - 1 <= layer <= self.n_layers:
            raise OutOfRange(
                f"layer {layer} out of range: hidden states are 0 (embeddings)..{self.n_layers}"
            )
        tokens = self.word_tokens(word_or_span, occurrence)
        return self.hidden_states[layer, tokens.start : tokens.stop].mean(dim=0)

    def _repr_html_(self) -> str:
        """The interactive explorer page, for notebooks (in a sandboxed iframe)."""
        return self.html()

    def html(
        self, word: str | None = None, layer: int | None = None, head: int | None = None
    ) -> str:
        """The explorer page as notebook HTML, opened on ``word`` and ``layer``/``head``."""
        # The views sit above the models (they take plain data); imported on demand.
        from selfattn.explain import explain_query
        from selfattn.viz.report import notebook_html

        explanation = explain_query(self, word, model_name=self.model_name, layer=layer, head=head)
        return notebook_html(self, explanation)

    def show(
        self, word: str | None = None, layer: int | None = None, head: int | None = None
    ) -> None:
        """Display the explorer in a notebook; elsewhere, open it in the web browser."""
        page = self.html(word, layer, head)
        if not _in_notebook():
            _open_in_browser(page)
            return
        from IPython.display import display

        display({"text/html": page}, raw=True)


@dataclass(frozen=True, repr=False, eq=False)  # tensors: compared by identity
class GenerationStep:
    """One step of a generation: the forward pass that chose one new token.

    Its query is the last token it read (the new token's predecessor); its keys are the
    tokens ``start .. query`` (``start`` is 0 unless the context outgrew the model's positions
    and the window slid).
    """

    query: int  # position of the query in Generation.tokens
    start: int  # position of the first key
    weights: Tensor  # (L, H, S): each layer and head's weights over keys start..query

    def __repr__(self) -> str:
        return f"GenerationStep(query={self.query}, keys {self.start}..{self.query})"


@dataclass(frozen=True, repr=False, eq=False)  # tensors: compared by identity
class Generation:
    """A prompt, its continuation, and per new token the attention that chose it.

    ``steps[s]`` chose ``tokens[n_prompt + s]``; its weights are the query row of that
    step's forward pass, recomputed with the explicit path from the q and k recorded while
    the cached generation ran. In a layer with a sliding window (``sliding_windows``) the
    keys before it are masked: weight 0.
    """

    prompt: str
    text: str  # the continuation, as Model.generate returns it
    tokens: list[str]  # the prompt's tokens, then one per new token
    token_ids: list[int]
    n_prompt: int  # how many of the tokens are the prompt's
    steps: list[GenerationStep]
    n_layers: int
    n_heads: int
    model_name: str = "model"
    sliding_windows: tuple[int | None, ...] = ()  # per layer (None: full), () for none at all

    def __repr__(self) -> str:
        return (
            f"Generation({self.model_name!r}, {reprlib.repr(self.prompt)} + "
            f"{reprlib.repr(self.text)}: {len(self.steps)} steps)"
        )

    def weights(self, step: int, layer: int, head: int | None = None) -> Tensor:
        """A step's weights over its keys: one head ``(S,)``, or every head ``(H, S)``.

        Negative indices count from the end."""
        chosen = self.steps[in_range(step, len(self.steps), "step", "this generation has steps")]
        layer = in_range(layer, self.n_layers, "layer", "this model has attention layers")
        if head is None:
            return chosen.weights[layer]
        return chosen.weights[layer, in_range(head, self.n_heads, "head", "each layer has heads")]

    def to_json(self) -> dict:
        """Every number as plain JSON; per step its keys and weights ``[layer][head][key]``.

        ``sliding_windows`` gives each layer's window (null: none): in a layer with window
        ``w`` a step's keys before ``query - w + 1`` are masked, their weights 0.
        """
        return {
            "model": self.model_name,
            "prompt": self.prompt,
            "text": self.text,
            "tokens": self.tokens,
            "token_ids": self.token_ids,
            "n_prompt": self.n_prompt,
            "layers": self.n_layers,
            "heads": self.n_heads,
            "sliding_windows": list(self.sliding_windows or (None,) * self.n_layers),
            "steps": [
                {"query": step.query, "start": step.start, "weights": step.weights.tolist()}
                for step in self.steps
            ],
        }


def _recorded_steps(
    network: nn.Module, steps: Iterator[Tensor]
) -> Iterator[tuple[Tensor, GenerationStep]]:
    """Run ``steps`` of one prompt (one forward pass each, see Decoder.generate_steps), each
    under its own recording; give each step's new token id (1,) and its query's attention."""
    while True:
        with record(network) as recording:
            ids = next(steps, None)
        if ids is None:
            return
        yield ids[:, -1], _last_query_step(recording, query=ids.shape[1] - 2)


def _last_query_step(recording: Recording, query: int) -> GenerationStep:
    """The last query row of each layer's call in one forward pass's recording, recomputed
    for that query alone (a single query sees every key under bottom-right causal masking)."""
    weights = torch.stack([_last_query(capture).weights()[:, 0] for capture in recording])
    weights = weights.cpu()  # (L, H, S)
    return GenerationStep(query=query, start=query + 1 - weights.shape[-1], weights=weights)


def _last_query(capture: Capture) -> Capture:
    """The call as if only its last query had been asked: (B, H, 1, D) against every key."""
    mask = None if capture.mask is None else capture.mask[..., -1:, :]
    return replace(capture, query=capture.query[..., -1:, :], mask=mask)


MAX_CHARACTER_BYTES = 4  # UTF-8: so at most 4 byte-level tokens share one character


def _token_strings(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each id as its token: " bank" for byte-level BPE (and for "▁bank"), and a part of a
    character split across tokens named as the prompt's are ("é[1/2]", "é[2/2]"); bytes that
    make no character stay "\ufffd"."""
    if not (tokenizer.byte_level or tokenizer.metaspace):
        return [tokenizer.token(i) for i in ids]
    pieces = [tokenizer.piece(i) for i in ids]
    start = 0
    while start < len(ids):
        end = _character_end(tokenizer, ids, pieces, start)
        if end > start + 1:
            joined = tokenizer.backend.decode(ids[start:end], skip_special_tokens=False)
            lead = " " if pieces[start].startswith(" ") else ""
            count = end - start
            for part in range(count):
                pieces[start + part] = f"{joined.strip()}[{part + 1}/{count}]"
            pieces[start] = lead + pieces[start]
        start = end
    return pieces


def _character_end(tokenizer: Tokenizer, ids: list[int], pieces: list[str], start: int) -> int:
    """Where the tokens from ``start`` that share a character split into bytes end: the
    fewest that decode together to whole characters; ``start + 1`` for a whole token, or
    bytes that no following token completes."""
    if "\ufffd" not in pieces[start]:
        return start + 1
    for end in range(start + 2, min(start + MAX_CHARACTER_BYTES, len(ids)) + 1):
        joined = tokenizer.backend.decode(ids[start:end], skip_special_tokens=False)
        if "\ufffd" not in joined:
            return end
    return start + 1


@contextmanager
def evaluating(network: nn.Module) -> Iterator[None]:
    """``network`` in eval mode inside, each module's mode put back after: a run, an
    embedding or a generation has no dropout even after ``.train()``, so what a recording
    recomputes is what the model did, and a seed gives the same text every time."""
    modes = [(module, module.training) for module in network.modules()]
    network.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def left_padded(rows: list[Tensor]) -> Tensor:
    """The 1-D ``rows`` as one (B, T) tensor, each padded with 0 on its left (pad_sequence's
    ``padding_side`` needs torch 2.5; flipping twice does it on any)."""
    return pad_sequence([row.flip(0) for row in rows], batch_first=True).flip(1)


IDS_INSTEAD = {  # what to call with token ids instead of texts
    "encode": "call the model on them",
    "generate": "model.network.generate(input_ids, n)",
}


def _texts(texts: object, method: str = "encode") -> list[str]:
    """``texts`` (any iterable of str) as a list; a one-line error, naming ``method``, for
    anything else."""
    try:
        listed = list(texts)
    except TypeError:
        listed, got = None, type(texts).__name__
    wrong = [] if listed is None else [text for text in listed if not isinstance(text, str)]
    if wrong:
        got = f"{type(texts).__name__} holding {type(wrong[0]).__name__}"
    if listed is None or wrong:
        raise SelfAttnError(
            f"{method} takes a str or a list of str, got {got}; pass the texts themselves "
            f"(token ids: {IDS_INSTEAD[method]})"
        )
    return listed


def _in_notebook() -> bool:
    """Whether this runs in an IPython kernel (Jupyter, VS Code, Colab), which shows HTML;
    a script or a terminal IPython only prints what it is given to display."""
    ipython = sys.modules.get("IPython")  # a kernel has always imported it
    shell = None if ipython is None else ipython.get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def _open_in_browser(page: str) -> None:
    """Write ``page`` to a temporary file and open it in the web browser; where none opens
    (a server, a container), say on stderr where the page is."""
    import tempfile
    import webbrowser

    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".html", delete=False) as file:
        file.write(page)
    try:
        opened = webbrowser.open(f"file://{file.name}")
    except webbrowser.Error:
        opened = False
    if not opened:
        print(
            f"note: no web browser to open here; the page is {file.name} (open it in one, "
            "or save it with run.html())",
            file=sys.stderr,
        )


class Model(nn.Module):
    """A pretrained network and its tokenizer; call it like the network, or use the helpers."""

    def __init__(
        self,
        network: Bert | Decoder,
        config: ModelConfig,
        *,
        name: str,
        tokenizer: Tokenizer | None = None,
        sentence: SentenceConfig | None = None,
    ) -> None:
        super().__init__()
        self.network = network
        self.config = config
        self.name = name
        self.tokenizer = tokenizer
        self.sentence = sentence

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> EncoderOutput | DecoderOutput:
        """input_ids (B, T); attention_mask (B, T), 1 for real tokens; token types (encoders).

        Encoders give ``last_hidden_state`` and ``hidden_states``; decoders ``logits`` and
        ``hidden_states`` (the last before the final layer norm).
        """
        self._check_inputs(input_ids, attention_mask, token_type_ids)
        if self.config.kind == "decoder":
            return self.network(input_ids, attention_mask=attention_mask)
        return self.network(input_ids, attention_mask, token_type_ids)

    def _check_inputs(
        self, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor | None
    ) -> None:
        """One-line errors for token inputs the network cannot take, before any lookup."""
        if self.config.kind == "decoder" and token_type_ids is not None:
            raise SelfAttnError("token_type_ids are for encoders; a decoder takes none")
        if token_type_ids is not None and not self.network.config.type_vocab_size:
            raise SelfAttnError(
                f"{self.name} ({self.config.model_type}) has no token types; call it without "
                "token_type_ids"
            )
        _check_ids("input_ids", input_ids, self.config.vocab_size, self.device)
        if input_ids.shape[1] == 0:
            raise SelfAttnError(
                f"input_ids have no tokens (shape {tuple(input_ids.shape)}); pass at least one "
                "token per sequence"
            )
        if attention_mask is not None:
            _check_like_ids("attention_mask", attention_mask, input_ids)
        if token_type_ids is not None:
            _check_like_ids("token_type_ids", token_type_ids, input_ids)
            types = self.network.config.type_vocab_size
            _check_ids("token_type_ids", token_type_ids, types, input_ids.device)

    def set_backend(self, backend: str) -> None:
        """Run every attention module on ``backend`` (``"auto"``, ``"sdpa"``, ``"explicit"``...)."""
        set_backend(self, backend)

    def run(self, text: str, truncate: bool = False) -> Run:
        """Run one text, recording every attention call, for looking inside.

        Text longer than the model's positions is an error unless ``truncate=True``, which
        keeps the first tokens (special tokens kept).
        """
        tokenizer = self._require_tokenizer()
        if not isinstance(text, str):
            raise SelfAttnError(
                f"run takes one text (a str), got {type(text).__name__}; run each text on its "
                "own, or embed many with model.encode(texts)"
            )
        if not text.strip():
            raise SelfAttnError("the text is empty; pass a sentence to run")
        limit = self.config.max_positions
        if not truncate and (count := tokenizer.count(text)) > limit:
            raise SelfAttnError(
                f"the text is {count} tokens but {self.name} takes at most {limit}; "
                "shorten it or pass --truncate (truncate=True in Python)"
            )
        encoding = tokenizer.encode(text, max_length=limit if truncate else None)
        if all(word is None for word in encoding.word_ids):
            raise SelfAttnError(
                f"{self.name} reads nothing in the text (only control or invisible characters); "
                "pass a sentence to run"
            )
        input_ids = torch.tensor([encoding.ids], device=self.device)
        with torch.no_grad(), evaluating(self.network), record(self.network) as recording:
            # forward, not self(...): after model.compile() the call would run its graph,
            # which records nothing; one text runs eager (compiled blocks are refused).
            output = self.forward(input_ids)
        hidden_states = torch.stack(output.hidden_states).squeeze(1)  # (L+1, T, D)
        logits = output.logits[0].cpu() if isinstance(output, DecoderOutput) else None
        # A run is read on the CPU, whatever the model's device: what explains it builds its
        # small index tensors there, and pages and JSON want its numbers there anyway.
        return Run(
            encoding,
            hidden_states.cpu(),
            recording.to("cpu"),
            logits,
            self.name,
            self.config.sliding_windows,
        )

    def encode(
        self,
        texts: Sequence[str],
        batch_size: int = 32,
        normalize: bool | None = None,
        progress: bool | None = None,
    ) -> Tensor:
        """Sentence embeddings ``(N, D)``, as sentence-transformers computes them.

        Pooling and the truncation length come from the checkpoint's sentence-transformers
        files (mean pooling, 256 tokens for MiniLM); ``normalize`` scales each to unit length,
        by default where the pipeline in ``modules.json`` ends with a Normalize step (MiniLM's
        does; a dot-product model's and a folder without ``modules.json`` do not). Texts are
        sorted by length and each batch is padded only to its longest. A single string counts
        as one text.
        """
        if self.config.kind != "encoder" or self.sentence is None:
            raise SelfAttnError(
                f"encode needs an encoder (BERT family, e.g. 'minilm'); {self.name} is a decoder: "
                "load an encoder, or take a word's vector with model.run(text).word_vector(word)"
            )
        if self.sentence.not_computed:
            raise SelfAttnError(
                f"{self.name}'s sentence-transformers pipeline has "
                f"{', '.join(self.sentence.not_computed)}, which encode does not compute "
                "(its embeddings would differ); use sentence-transformers for them"
            )
        if not is_integer(batch_size, 1):
            raise SelfAttnError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
        texts = [texts] if isinstance(texts, str) else _texts(texts)
        if self.sentence.lowercase:
            texts = [text.lower() for text in texts]
        tokenizer = self._require_tokenizer()
        ids = tokenizer.encode_ids(texts, max_length=self.sentence.max_seq_length)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        if progress is None:
            progress = len(batches) > PROGRESS_MIN_BATCHES and sys.stderr.isatty()
        embeddings = torch.empty(len(ids), self.config.d_model, dtype=self.dtype)
        with (
            torch.inference_mode(),
            evaluating(self.network),
            Progress(console=Console(stderr=True), disable=not progress, transient=True) as bar,
        ):
            task = bar.add_task("encoding", total=len(texts))
            for batch in batches:
                embeddings[batch] = self._embed([ids[i] for i in batch]).cpu()
                bar.advance(task, len(batch))
        normalize = self.sentence.normalize if normalize is None else normalize
        return F.normalize(embeddings, dim=-1) if normalize else embeddings

    def _embed(self, batch_ids: list[list[int]]) -> Tensor:
        """Pooled vectors (B, D) of one batch of token ids, padded to the batch's longest."""
        rows = [torch.tensor(row) for row in batch_ids]
        input_ids = pad_sequence(rows, batch_first=True).to(self.device)  # (B, T)
        lengths = torch.tensor([len(row) for row in batch_ids], device=self.device)
        mask = torch.arange(input_ids.shape[1], device=self.device) < lengths[:, None]  # (B, T)
        padded = bool((lengths < input_ids.shape[1]).any())
        hidden = self(input_ids, mask if padded else None).last_hidden_state
        return pool(hidden, mask, self.sentence.pooling)

    @overload
    def generate(  # type: ignore[overload-overlap]  # a str is also a Sequence[str]
        self,
        prompt: str,
        max_new_tokens: int = ...,
        *,
        temperature: float = ...,
        top_k: int | None = ...,
        seed: int | None = ...,
        use_cache: bool = ...,
    ) -> str: ...
    @overload
    def generate(
        self,
        prompt: Sequence[str],
        max_new_tokens: int = ...,
        *,
        temperature: float = ...,
        top_k: int | None = ...,
        seed: int | None = ...,
        use_cache: bool = ...,
    ) -> list[str]: ...
    def generate(
        self,
        prompt: str | Sequence[str],
        max_new_tokens: int = 50,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        use_cache: bool = True,
    ) -> str | list[str]:
        """The text a decoder writes after ``prompt`` (the continuation only), or a list of
        them for a list of prompts; temperature 0 is greedy, 1 samples the model's own
        distribution (the command line and the explorer default to nanoGPT's 0.8, so pass
        ``temperature=0.8`` to get their text for a seed); ``seed`` makes sampling
        repeatable. A text ends early at the model's end-of-text token
        (``config.eos_token_ids``), as Hugging Face's generate ends it.

        Many prompts run as one batch, one forward pass per step: padded on the left, each
        row reading only its own tokens numbered from 0, so a greedy row is what that prompt
        alone gives. The steps stop once every row has ended.
        """
        prompts = [prompt] if isinstance(prompt, str) else _texts(prompt, "generate")
        if not prompts:
            raise SelfAttnError("generate got an empty list of prompts; pass at least one text")
        prompt_ids = [
            self._prompt_encoding(text, i, len(prompts)).ids for i, text in enumerate(prompts)
        ]
        rows = [torch.tensor(ids) for ids in prompt_ids]
        input_ids, real = (
            left_padded(padded).to(self.device)
            for padded in (rows, [torch.ones_like(row, dtype=torch.bool) for row in rows])
        )  # (B, T): ids padded with 0 on the left, True where a prompt's tokens are
        steps = self.network.generate_steps(
            input_ids,
            max_new_tokens,
            attention_mask=real,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            use_cache=use_cache,
        )
        with evaluating(self.network):
            new_ids, _ = self._until_end(((ids[:, -1], None) for ids in steps), len(prompts))
        texts = [self._continuation(p, p + n) for p, n in zip(prompt_ids, new_ids, strict=True)]
        return texts[0] if isinstance(prompt, str) else texts

    def generate_recorded(
        self,
        prompt: str,
        max_new_tokens: int = 50,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        use_cache: bool = True,
    ) -> Generation:
        """:meth:`generate` of one prompt, keeping per new token the attention that chose it.

        Same arguments, same continuation (the same seed gives the same tokens). Each step's
        q, k and v are recorded while the cached generation runs; the step's query row is
        recomputed from them with the explicit path for every layer and head, and the rest
        of the recording is dropped. Past the model's positions the window slides: a step's
        keys then start after the prompt's first tokens (``GenerationStep.start``).
        """
        if isinstance(prompt, (list, tuple)):
            raise SelfAttnError(
                f"generate_recorded records one prompt (a str), got a {type(prompt).__name__}; "
                "record each on its own (model.generate(prompts) continues many, unrecorded)"
            )
        encoding = self._prompt_encoding(prompt)
        new_steps = self.network.generate_steps(
            torch.tensor([encoding.ids], device=self.device),
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            use_cache=use_cache,
        )
        with evaluating(self.network):
            (new_ids,), steps = self._until_end(_recorded_steps(self.network, new_steps), 1)
        return Generation(
            prompt=prompt,
            text=self._continuation(encoding.ids, encoding.ids + new_ids),
            tokens=encoding.tokens + _token_strings(self.tokenizer, new_ids),
            token_ids=encoding.ids + new_ids,
            n_prompt=len(encoding.ids),
            steps=steps,
            n_layers=self.config.n_layers,
            n_heads=self.config.n_heads,
            model_name=self.name,
            sliding_windows=self.config.sliding_windows,
        )

    def _until_end(
        self, steps: Iterator[tuple[Tensor, _T]], rows: int
    ) -> tuple[list[list[int]], list[_T]]:
        """Each of ``rows`` rows' new token ids, up to and including its first token that ends
        the text (one of ``config.eos_token_ids``, where Hugging Face's generate ends that
        row), from (new ids (rows,), step) pairs, and the steps taken; once every row has
        ended, the steps after are never run."""
        new_ids: list[list[int]] = [[] for _ in range(rows)]
        taken = []
        ends = self.config.eos_token_ids
        for column, step in steps:
            taken.append(step)
            for row, new_id in zip(new_ids, column.tolist(), strict=True):
                if not row or row[-1] not in ends:
                    row.append(new_id)
            if all(row[-1] in ends for row in new_ids):
                break
        return new_ids, taken

    def _prompt_encoding(self, prompt: str, index: int = 0, count: int = 1) -> Encoding:
        """The prompt's tokens (prompt ``index`` of ``count``); one line for an encoder, or a
        prompt with no tokens."""
        if self.config.kind != "decoder":
            raise SelfAttnError(
                f"generate needs a decoder (GPT or Llama family); {self.name} is an encoder"
            )
        if not isinstance(prompt, str):
            raise SelfAttnError(
                f"the prompt must be a str, got {type(prompt).__name__}; pass the text to "
                "continue (token ids: model.network.generate(input_ids, n))"
            )
        encoding = self._require_tokenizer().encode(prompt)
        if not encoding.ids:
            which = "the prompt" if count == 1 else f"prompt {index} (of {count}, from 0)"
            raise SelfAttnError(f"{which} is empty; pass some text to continue")
        ids = torch.tensor([encoding.ids])  # a tokenizer larger than the embedding table
        _check_ids("the prompt's token ids", ids, self.config.vocab_size, ids.device)
        return encoding

    def _continuation(self, prompt_ids: list[int], ids: list[int]) -> str:
        """The text of ``ids`` after the prompt's: the whole text decoded less the prompt's,
        so that a first token's space (sentencepiece's "▁bank") stays; the new tokens alone
        where the prompt's text is no prefix of it: a byte-fallback decoder gives a run of
        byte tokens that is not UTF-8 as one "\ufffd" per byte, prompt bytes included ("日"
        then the byte 0xAC decoded as four)."""
        prompt, whole = self.tokenizer.decode(prompt_ids), self.tokenizer.decode(ids)
        if whole.startswith(prompt):
            return whole[len(prompt) :]
        return self.tokenizer.decode(ids[len(prompt_ids) :])

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise SelfAttnError(
                f"{self.name} has no tokenizer.json; add the checkpoint's tokenizer to its folder "
                "(from vocab.txt, or vocab.json and merges.txt, transformers writes one: "
                "AutoTokenizer.from_pretrained(folder).save_pretrained(folder)) or call the "
                "model on token ids"
            )
        return self.tokenizer
