"""What self-attention did to one word: text -> model run with recording -> Explanation.

The model runs on its fast path under :func:`selfattn.record`; the explained head is then
recomputed from the captured query, key and value with the explicit path, so every number
shown (scores, scaled, weights, output) is a step of the same computation the model ran.

Choosing what to show, when the user does not say: the layer and head where the query word
puts the most weight on *other content words* — not itself, not special tokens
(``[CLS]``, ``[SEP]``), not punctuation, not a short list of English stop words, not an
unknown token (``[UNK]``: the model reads only "some unknown text" there); a stop word or
punctuation is judged as a whole word, never by one of its pieces. Without a query word, the
same measure averaged over every content token. Heads that follow position, not meaning
(most of the words' tokens put their largest weight on the token just before, or just after,
when that token belongs to a word too: weight on [CLS] or [SEP] is no neighbour habit) are
passed over unless every head does (then the best of them is shown); if no head weighs other
content words (a one-word text), the first head is shown.

An unknown token is named by the characters it stands for, ``'🙂' ([UNK])``, and so is one
whose combining marks the tokenizer dropped (MiniLM reads बैंक as ``ब ##क``: ``'बैंक' (बक)``),
in prose and in the lists of attended keys. A ``word`` that
the model reads as several words (a phrase, ``well-known``, ``银行``) is explained on its
first token, and :attr:`Explanation.phrase_note` says so.

Masked keys (a decoder's causal mask: query i sees keys 0..i only; a sliding window of w,
Mistral's: keys i-w+1..i only) get weight exactly 0;
:attr:`Explanation.masked` says which they are, so that no view mistakes them for keys the
model weighed and found unimportant.

A model that adds a bias to the scaled scores before the softmax (MPNet's relative position
bias, recorded as a float mask: :func:`adds_bias`) has it in :attr:`Steps.bias`; its weights
are softmax(scaled + bias), and every view says so.

Merging word pieces (``words=True``): a word's weight as a key is the **sum** over its pieces
(so rows still sum to 1); a word's row as a query is the **mean** over its pieces' rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from selfattn.attention import AttentionTrace
from selfattn.errors import (
    Message,
    Options,
    OutOfRange,
    SelfAttnError,
    SettingsError,
    is_integer,
    message_of,
    parts_of,
)
from selfattn.recording import Capture, Recording
from selfattn.text import check_word, is_mark, join_pieces

STOPWORDS = frozenset(
    "a an the to of and or but in on at by for with from into as is are was were be been it "
    "its this that these those i we you he she they me my our your his her their there here "
    "not no do does did has have had will would can could should so if then than "
    "am being him them us because too very just also when while where what which who whom "
    "how why all any each some such only about after before over under up out off again".split()
)
UNKNOWN_TOKENS = frozenset({"[UNK]", "<unk>"})  # what a tokenizer reads text it has no piece for
HEAD_MEAN = "mean"
AS_ASKED = "as asked"  # Explanation.choice when the layer and head were both given
SHOWN_STANDS_FOR = 24  # characters of the text an unknown token stands for, in lists
SHOWN_SENTENCE = 60  # characters of a compared sentence that an error about it quotes


class RecordedRun(Protocol):
    """What explaining needs from a model run (``selfattn.models.model.Run`` provides it);
    read-only properties, so that a frozen dataclass meets them."""

    @property
    def text(self) -> str: ...
    @property
    def read_text(self) -> str: ...  # the part of ``text`` the model read (``truncate``)
    @property
    def tokens(self) -> list[str]: ...
    @property
    def word_ids(self) -> list[int | None]: ...
    @property
    def offsets(self) -> list[tuple[int, int]]: ...  # each token's span; empty if special
    @property
    def captures(self) -> Recording: ...
    @property
    def sliding_windows(self) -> tuple[int | None, ...]: ...  # per layer; () for none

    def token_index(self, word: str, occurrence: int = 0) -> int: ...

    def word_tokens(self, word: str, occurrence: int = 0) -> range: ...


class TextModel(Protocol):
    """A model that runs a text with recording (``selfattn.models.model.Model``)."""

    name: str

    def run(self, text: str, truncate: bool = False) -> VectorRun: ...


@dataclass(frozen=True)
class Steps:
    """One query row of one head, step by step; every number from the recorded q, k, v."""

    scores: Tensor  # (S,) similarity of the query with every key
    scaled: Tensor  # (S,) scores * scale
    weights: Tensor  # (S,) softmax(scaled), or softmax(scaled + bias) with a bias: sums to 1
    values: Tensor  # (S, Dv) the value vectors of the keys
    output: Tensor  # (Dv,) weights @ values
    scale: float
    similarity: str
    key_width: int  # d_k: the width of the query and key vectors
    bias: Tensor | None = None  # (S,) added to scaled before the softmax (MPNet); None: none

    @property
    def entropy(self) -> float:
        """Entropy of the weights in bits: 0 = all on one key, log2(S) = spread evenly."""
        return entropy_bits(self.weights)


@dataclass(frozen=True)
class Phrase:
    """Text asked for as ``word`` that the model reads as several words."""

    text: str
    tokens: list[int]
    words: int  # how many words the model reads in it


@dataclass(frozen=True, repr=False)
class Explanation:
    """One layer and head of a run, explained (for one query token, when given): what
    ``selfattn explain`` shows and ``to_json()`` gives. ``attention`` is the (T, T) map,
    ``steps`` the query's row step by step."""

    model: str
    text: str
    tokens: list[str]
    layer: int
    head: int | None  # None: the mean of the layer's heads
    choice: str  # how layer and head were chosen: "as asked", or "chosen: ..." and why
    query: int | None  # token index of the explained word
    attention: Tensor  # (T, T) weights of that layer/head; rows queries, columns keys
    steps: Steps | None  # the query row in one head (None without a query or for the mean)
    recorded_output: Tensor | None  # (Dv,) the same output as the model's fast path computed it
    alternative: Steps | None  # the same head with another similarity or scale
    groups: list[tuple[str, list[int]]] | None  # words and their tokens, when merged
    query_word: tuple[str, list[int]] | None  # the query's word and its tokens (its pieces)
    causal: bool  # a decoder: each query sees only the keys up to itself
    masked: Tensor  # (T, S) bool: True where the query may not attend the key (weight 0)
    query_phrase: Phrase | None = None  # the word asked for, when the model reads several
    # token -> the text it stands for, where the token does not show it (see hidden_texts)
    hidden: dict[int, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        head = HEAD_MEAN if self.head is None else self.head
        query = None if self.query is None else f"{self.query} {self.tokens[self.query]!r}"
        return (
            f"Explanation({self.model!r}, layer={self.layer}, head={head!r}, query={query}, "
            f"{len(self.tokens)} tokens; {self.choice})"
        )

    @property
    def query_note(self) -> str | None:
        """What the query token is of the text asked for, when only a part of it: the first
        token of a phrase, or one piece of a word."""
        notes = [note for note in (self.phrase_note, self.piece_note) if note is not None]
        return Message.joined("; ", notes) if notes else None

    @property
    def phrase_note(self) -> str | None:
        """Why the query is one token of the text asked for, when that text is several words."""
        phrase = self.query_phrase
        if phrase is None:
            return None
        return Message(
            f"first token of '{phrase.text}', {phrase.words} words to the model at tokens "
            f"{phrase.tokens[0]}..{phrase.tokens[-1]}; explain shows one query token: ",
            Options("--index N", ("index",)),
            " shows another",
        )

    @property
    def piece_note(self) -> str | None:
        """Which piece of its word the query token is, when the tokenizer split the word."""
        if self.query_word is None or len(self.query_word[1]) == 1:
            return None
        word, members = self.query_word
        return (
            f"piece {members.index(self.query) + 1} of {len(members)} of {self.name(word, members)}"
        )

    def name(self, text: str, tokens: list[int]) -> str:
        """A token or word as quoted in prose: 'bank', or '🙂' ([UNK]) by the text it stands
        for where its tokens do not show it (see :func:`hidden_texts`)."""
        return quoted(text, tokens, self.tokens, self.hidden)

    @property
    def key_names(self) -> list[str]:
        """Each token as the lists of attended keys name it (see :func:`listed_names`)."""
        groups = [(token, [i]) for i, token in enumerate(self.tokens)]
        return listed_names(groups, self.tokens, self.hidden)

    @property
    def word_names(self) -> list[str] | None:
        """Each merged word as the lists of attended keys name it; None unless merged."""
        return None if self.groups is None else listed_names(self.groups, self.tokens, self.hidden)

    @property
    def masked_keys(self) -> list[int]:
        """The keys the query may not attend (in a decoder, those after it and those before
        its sliding window); [] without a query."""
        return [] if self.query is None else self.masked[self.query].nonzero()[:, 0].tolist()

    @property
    def weights(self) -> Tensor | None:
        """The query's row of weights (head mean included)."""
        return None if self.query is None else self.attention[self.query]

    def _query_json(self) -> dict | None:
        """The query's index and token, with a ``note`` when it is only a part of the word
        asked for: the first token of a phrase, or one piece of a word."""
        if self.query is None:
            return None
        query: dict = {"index": self.query, "token": self.tokens[self.query]}
        if self.query_note is not None:
            query["note"] = self.query_note
        return query

    def to_json(self) -> dict:
        """One JSON object: ``weights`` = softmax(``scaled``) over the keys not in
        ``masked_keys`` (weight 0 there; their ``scaled`` is the number before masking: JSON has
        no -inf), ``output`` = weights @ values; with a position bias (MPNet) also ``bias``, and
        ``weights`` = softmax(scaled + bias)."""
        steps = self.steps
        result = {
            "model": self.model,
            "text": self.text,
            "layer": self.layer,
            "head": HEAD_MEAN if self.head is None else self.head,
            "choice": self.choice,
            "tokens": self.tokens,
            "names": self.key_names,
            "query": self._query_json(),
            "similarity": steps.similarity if steps else None,
            "scale": steps.scale if steps else None,
            "scores": _list(steps.scores) if steps else None,
            "scaled": _list(steps.scaled) if steps else None,
            "weights": _list(self.weights) if self.weights is not None else None,
            "values": _list(steps.values) if steps else None,
            "output": _list(steps.output) if steps else None,
            "entropy_bits": steps.entropy if steps else None,
            "attention": _list(self.attention),
            "causal": self.causal,
            "masked_keys": None if self.query is None else self.masked_keys,
        }
        if steps is not None and steps.bias is not None:
            result["bias"] = _list(steps.bias)
        if self.alternative is not None:
            alt = self.alternative
            result["alternative"] = {
                "similarity": alt.similarity,
                "scale": alt.scale,
                "scores": _list(alt.scores),
                "scaled": _list(alt.scaled),
                "weights": _list(alt.weights),
                "output": _list(alt.output),
                "entropy_bits": alt.entropy,
            }
        if self.groups is not None:
            merged = merge_words(self.attention, [tokens for _, tokens in self.groups])
            result["words"] = [word for word, _ in self.groups]
            result["word_attention"] = _list(merged)
            if self.query is not None:
                row = next(i for i, (_, tokens) in enumerate(self.groups) if self.query in tokens)
                result["word_weights"] = _list(merged[row])
        return result


def _list(tensor: Tensor) -> list:
    return tensor.detach().double().tolist()


def entropy_bits(weights: Tensor) -> float:
    positive = weights[weights > 0].double()
    return max(0.0, float(-(positive * positive.log2()).sum()))  # never -0.0 or -1e-17


def explain(
    run: RecordedRun,
    *,
    model_name: str,
    query: int | None = None,
    layer: int | None = None,
    head: int | str | None = None,
    similarity: str | None = None,
    scale: float | None = None,
    words: bool = False,
) -> Explanation:
    """Explain one layer/head of a recorded run, for one query token if given.

    ``layer``/``head`` None: chosen by the rule in the module docstring; ``head="mean"``:
    the mean of the layer's heads. ``similarity``/``scale``: recompute the explained head
    with another similarity or scale, next to the model's own.
    """
    captures = run.captures
    n_layers = captures.n_layers
    if layer is not None and not 0 <= layer < n_layers:
        raise OutOfRange(f"layer {layer} is out of range: this model has layers 0..{n_layers - 1}")
    head_index = None if head == HEAD_MEAN else head
    if head_index is not None:
        n_heads = captures[0].n_heads
        if not is_integer(head_index) or not 0 <= head_index < n_heads:
            raise OutOfRange(
                f"head {head!r} is out of range: this model has heads 0..{n_heads - 1}, or 'mean'"
            )
    if query is not None and not (is_integer(query) and 0 <= query < len(run.tokens)):
        raise OutOfRange(f"token index {query!r} is out of range: tokens 0..{len(run.tokens) - 1}")
    if similarity is not None or scale is not None:
        _check_experiment(query is not None, head, "the query's token index (query=)")
    choice = AS_ASKED
    if layer is None or head is None:
        layer, head_index, choice = choose_head(run, query, layer, head)
    capture = captures.layer(layer)[0]
    biased = adds_bias(capture)
    trace = capture.trace()  # every head: (H, T, T)
    all_weights = trace.weights
    attention_map = all_weights.mean(0) if head_index is None else all_weights[head_index]

    steps = recorded = alternative = None
    if query is not None and head_index is not None:
        steps = query_steps(capture.trace(head_index), query, biased)
        recorded = capture.output[0, head_index, query]
        if similarity is not None or scale is not None:
            alternative = query_steps(
                capture.trace(head_index, similarity=similarity, scale=scale), query, biased
            )
            if not torch.isfinite(alternative.scaled).all():
                overflow = f"scale {alternative.scale:g} makes the scaled scores overflow"
                raise ValueError(f"{overflow}; give a smaller scale")
    return Explanation(
        model=model_name,
        text=run.read_text,
        tokens=list(run.tokens),
        layer=layer,
        head=head_index,
        choice=choice,
        query=query,
        attention=attention_map,
        steps=steps,
        recorded_output=recorded,
        alternative=alternative,
        groups=word_groups(run.tokens, run.word_ids) if words else None,
        query_word=None if query is None else word_of(run.tokens, run.word_ids, query),
        causal=capture.causal,
        masked=never_attended(trace),
        hidden=hidden_texts(run),
    )


def never_attended(trace: AttentionTrace) -> Tensor:
    """(T, S) bool: the (query, key) pairs that the mask hides in every head (weight 0)."""
    hidden = torch.isneginf(trace.masked)
    return hidden.all(0) if hidden.dim() == 3 else hidden


QUERY_OPTIONS = Message(
    "the word to explain or its token index (",
    Options("--word or --index; word= or index= in Python", ("word", "index")),
    ")",
)


def _check_experiment(has_query: bool, head: int | str | None, query_options: str) -> None:
    """Refuse another similarity or scale without one query of one head, naming what is
    missing (a head left out is chosen, so only 'mean' is in the way) and how to give it."""
    missing = []
    if not has_query:
        missing.append(query_options)
    if head == HEAD_MEAN:
        missing.append("a head number instead of 'mean' (or no head, to have one chosen)")
    if missing:
        raise SettingsError(
            Message(
                "another similarity or scale is recomputed for one query of one head: give ",
                *Message.joined(" and ", missing).parts,
            )
        )


def explain_text(
    model: TextModel,
    text: str,
    *,
    word: str | None = None,
    index: int | None = None,
    occurrence: int = 0,
    truncate: bool = False,
    **options: Any,
) -> tuple[RecordedRun, Explanation]:
    """Run ``text`` through ``model`` and explain the query given by ``word`` or ``index``.

    ``options`` are those of :func:`explain` (layer, head, similarity, scale, words). This is
    what ``selfattn explain`` and the web explorer's ``/api/explain`` both call.
    """
    if word is not None and index is not None:
        raise SettingsError("give either a word or a token index, not both")
    if word is not None and not isinstance(word, str):
        raise TypeError(f"word= takes the word as a str, got {word!r}; a token's number is index=")
    if index is not None and (isinstance(index, bool | str) or not hasattr(index, "__index__")):
        raise TypeError(f"index= takes a token's number, got {index!r}; a word goes in word=")
    if word is None and occurrence != 0:
        raise SettingsError(
            Message(
                f"occurrence {occurrence} counts the matches of a word, and no word is given: "
                "give the word too (",
                Options("--word; word= in Python", ("word",)),
                ") or leave the occurrence out",
            )
        )
    if options.get("similarity") is not None or options.get("scale") is not None:
        _check_experiment(word is not None or index is not None, options.get("head"), QUERY_OPTIONS)
    run = model.run(text, truncate=truncate)
    query = word if word is not None else index
    return run, explain_query(run, query, model_name=model.name, occurrence=occurrence, **options)


def explain_query(
    run: RecordedRun,
    query: str | int | None,
    *,
    model_name: str,
    occurrence: int = 0,
    **options: Any,
) -> Explanation:
    """:func:`explain` for a query given as a word (its first token, the ``occurrence``-th
    match; :attr:`Explanation.phrase_note` says when the model reads several words in it) or
    as a token index. ``options`` are those of :func:`explain`."""
    phrase = None
    if isinstance(query, str):
        tokens = run.word_tokens(query, occurrence)
        query, phrase = tokens.start, phrase_of(run, tokens)
    explanation = explain(run, model_name=model_name, query=query, **options)
    return replace(explanation, query_phrase=phrase)


def phrase_of(run: RecordedRun, tokens: range) -> Phrase | None:
    """The text of ``tokens`` as a :class:`Phrase` when the model reads several words in it;
    None for one word (whole, or in pieces)."""
    words = len({run.word_ids[i] for i in tokens} - {None})
    if words < 2:
        return None
    start, end = run.offsets[tokens.start][0], run.offsets[tokens.stop - 1][1]
    return Phrase(" ".join(run.text[start:end].split()), list(tokens), words)


def hidden_texts(run: RecordedRun) -> dict[int, str]:
    """The characters of the text that a token stands for where the token does not show them,
    by token index: an unknown token (``[UNK]``), or one whose combining marks the tokenizer
    dropped (MiniLM reads बैं as ``ब``; its offsets cover ``ब`` only, no token the marks)."""
    covered = {at for start, end in run.offsets for at in range(start, end)}
    hidden = {}
    for i, (start, end) in enumerate(run.offsets):
        if start == end:  # a special token or an added space
            continue
        while end < len(run.text) and end not in covered and is_mark(run.text[end]):
            end += 1
        text = run.text[start:end]
        if run.tokens[i] in UNKNOWN_TOKENS or _marks(text) != _marks(run.tokens[i]):
            hidden[i] = text
    return hidden


def _marks(text: str) -> list[str]:
    return [char for char in text if is_mark(char)]


def quoted(name: str, members: list[int], tokens: list[str], hidden: dict[int, str]) -> str:
    """A token or word (``name``, made of the tokens ``members``) as quoted in prose: 'bank';
    one that does not show its text, by that text: '🙂' ([UNK]), 'बैंक' (बक)."""
    return _by_text(name, members, tokens, hidden) or f"'{name}'"


def listed_names(
    groups: list[tuple[str, list[int]]], tokens: list[str], hidden: dict[int, str]
) -> list[str]:
    """Each key (a token or word, with its tokens) as the lists of attended keys name it: as
    written, bank; one that does not show its text as prose quotes it, '🙂' ([UNK])."""
    return [_by_text(name, members, tokens, hidden) or name for name, members in groups]


def _by_text(
    name: str, members: list[int], tokens: list[str], hidden: dict[int, str]
) -> str | None:
    """'🙂' ([UNK]): a token or word by the text it stands for, where some of its tokens do
    not show theirs; None where they all do."""
    if not any(i in hidden for i in members):
        return None
    stands_for = "".join(hidden.get(i, tokens[i].removeprefix("##")) for i in members).strip()
    if len(stands_for) > SHOWN_STANDS_FOR:  # a word too long for the vocabulary: [UNK]
        end = SHOWN_STANDS_FOR - 1
        while end < len(stands_for) and is_mark(stands_for[end]):
            end += 1  # a character keeps its marks
        stands_for = stands_for[:end] + "…"
    return f"'{stands_for}' ({name})"


def adds_bias(capture: Capture) -> bool:
    """Whether the call added a float mask to its scaled scores (MPNet's position bias)."""
    return capture.mask is not None and capture.mask.is_floating_point()


def query_steps(trace: AttentionTrace, query: int, biased: bool = False) -> Steps:
    """Row ``query`` of a one-head trace; ``biased``: with the bias its call added (see
    :func:`adds_bias`), -inf where a key is masked."""
    return Steps(
        scores=trace.scores[query],
        scaled=trace.scaled[query],
        weights=trace.weights[query],
        values=trace.value,
        output=trace.output[query],
        scale=trace.scale,
        similarity=trace.similarity,
        key_width=trace.key.shape[-1],
        bias=trace.masked[query] - trace.scaled[query] if biased else None,
    )


def content_tokens(tokens: list[str], word_ids: list[int | None]) -> list[int]:
    """Tokens that carry meaning: those of words that are neither punctuation nor a stop word,
    judged on the whole word ("amazonas" is one, though its piece "##as" reads as "as"); never
    a special or unknown ([UNK]) token."""
    return [
        i
        for name, pieces in word_groups(tokens, word_ids)
        if word_ids[pieces[0]] is not None
        and any(ch.isalnum() for ch in name)
        and name.strip().lstrip("#").lower() not in STOPWORDS
        for i in pieces
        if tokens[i] not in UNKNOWN_TOKENS
    ]


def choose_head(
    run: RecordedRun, query: int | None, layer: int | None = None, head: int | str | None = None
) -> tuple[int, int | None, str]:
    """The (layer, head) where the query's word (or each content token) weighs other content
    words most, with the reason to show; a given ``layer`` or ``head`` (a number, or "mean":
    the mean of heads, head None) stays as given and the rest is chosen.

    A word split into pieces is measured on its row as ``words=True`` defines it: the mean
    of its pieces' rows. A chosen head passes over the positional heads of this text (see
    :func:`positional_heads`), unless every head in reach is one or none weighs other content
    words (all tie at 0: the first is shown); the reason says so where one would have won.
    """
    content = content_tokens(run.tokens, run.word_ids)
    queries, who = _measured_rows(run, query, content)
    word = torch.tensor([-1 if w is None else w for w in run.word_ids])
    other_content = torch.zeros(len(run.tokens), len(run.tokens), dtype=torch.bool)
    other_content[:, content] = True
    other_content &= word[:, None] != word[None, :]  # (T, T): key k is another content word
    other_content = other_content[queries]  # (Q, T)
    layers = [layer] if layer is not None else range(run.captures.n_layers)
    scores, positional = [], []
    for index in layers:
        weights = run.captures.layer(index)[0].weights()  # (H, T, T)
        if head == HEAD_MEAN:
            weights = weights.mean(0, keepdim=True)
        elif head is not None:
            weights = weights[head : head + 1]
        scores.append((weights[:, queries] * other_content).sum(-1).mean(-1))  # (H,) or (1,)
        if head is None:  # a head given is not passed over
            positional.append(positional_heads(weights, run.word_ids))
    by_layer = torch.stack(scores)  # (layers, heads)
    passed_over = (
        torch.stack(positional) if positional else torch.zeros_like(by_layer, dtype=torch.bool)
    )
    # No other head to choose, or none weighs content words: all tie at 0, the first is shown.
    if passed_over.all() or not (by_layer > 0).any():
        passed_over = torch.zeros_like(passed_over)
    best = int(by_layer.masked_fill(passed_over, -1.0).argmax())
    row, column = divmod(best, by_layer.shape[1])
    score = by_layer[row, column].item()
    moved = best != int(by_layer.argmax())  # a positional head would have won
    left_out = tuple(name for name, given in (("layer", layer), ("head", head)) if given is None)
    if score > 0:
        reason = f"{who} the most weight here, {score:.2f}, on other content words"
    else:
        reason = (
            "no head puts any weight on other content words, as none is in reach (the text "
            "has no other, or, in a decoder, none comes before), so the first is shown"
        )
    note = _passed_over_note(int(passed_over.sum())) if moved else ""
    flags = Options("/".join(f"--{name}" for name in left_out), left_out)
    choice = Message(f"chosen: {reason}{note}; pick another with ", flags)
    chosen = column if head is None else head
    return layers[row], None if chosen == HEAD_MEAN else chosen, choice


def positional_heads(weights: Tensor, word_ids: list[int | None]) -> Tensor:
    """(H,) bool, from (H, T, S) weights: the heads where more than half of the text's tokens
    put their largest weight on the token just before them, or more than half on the token
    just after (a previous- or next-token head: it follows position, not meaning).

    Only tokens of words vote, and only those with a word's token on that side: the first
    word's weight on [CLS] (the last one's on [SEP]) is where heads park what they do not
    use, not a habit of looking next door."""
    of_a_word = [word is not None for word in word_ids]
    flags = torch.zeros(weights.shape[0], dtype=torch.bool)
    for step in (-1, 1):
        voters = [
            i
            for i, voting in enumerate(of_a_word)
            if voting and 0 <= i + step < len(of_a_word) and of_a_word[i + step]
        ]
        if voters:
            neighbours = torch.tensor(voters) + step
            flags |= (weights[:, voters].argmax(-1) == neighbours).sum(-1) * 2 > len(voters)
    return flags


def _passed_over_note(count: int) -> str:
    """The reason's words for the positional heads the choice passed over ("" for none)."""
    if count == 0:
        return ""
    heads = "1 head that mostly looks" if count == 1 else f"{count} heads that mostly look"
    return f", passing over {heads} at the token just before or after (position, not meaning)"


def _measured_rows(
    run: RecordedRun, query: int | None, content: list[int]
) -> tuple[list[int], str]:
    """The query rows :func:`choose_head` averages, and who they are for its reason: the
    query's word (all its pieces), or without a query every content token."""
    if query is None:
        return content or list(range(len(run.tokens))), "the words, on average, put"
    name, pieces = word_of(run.tokens, run.word_ids, query)
    named = quoted(name, pieces, run.tokens, hidden_texts(run))
    if len(pieces) == 1:
        return pieces, f"{named} puts"
    return pieces, f"{named} (the mean of its {len(pieces)} pieces' rows) puts"


def word_groups(tokens: list[str], word_ids: list[int | None]) -> list[tuple[str, list[int]]]:
    """Each word with its tokens, in order. Tokens of no word (special tokens; whitespace in
    character-level and byte-level models) stay groups of their own, named as they are."""
    groups: list[tuple[bool, list[int]]] = []  # (is a word, its tokens)
    seen: dict[int, int] = {}
    for i, word in enumerate(word_ids):
        if word is None:
            groups.append((False, [i]))
        elif word in seen:
            groups[seen[word]][1].append(i)
        else:
            seen[word] = len(groups)
            groups.append((True, [i]))
    return [
        (join_pieces([tokens[i] for i in members]) if is_word else tokens[members[0]], members)
        for is_word, members in groups
    ]


def word_of(tokens: list[str], word_ids: list[int | None], token: int) -> tuple[str, list[int]]:
    """The word that ``token`` belongs to, and all its tokens (its pieces)."""
    return next(group for group in word_groups(tokens, word_ids) if token in group[1])


def merge_words(weights: Tensor, groups: list[list[int]]) -> Tensor:
    """(T, T) weights -> (W, W): keys summed over a word's pieces, queries averaged."""
    membership = word_membership(weights, groups)
    counts = membership.sum(0)
    return (membership.T @ weights @ membership) / counts[:, None]


def word_membership(weights: Tensor, groups: list[list[int]]) -> Tensor:
    """(T, W), in the dtype of ``weights``: 1 where token t is a piece of word w; ``row @`` it
    sums a row's keys over each word's pieces."""
    membership = torch.zeros(weights.shape[-1], len(groups), dtype=weights.dtype)
    for word, members in enumerate(groups):
        membership[members, word] = 1.0
    return membership


@dataclass(frozen=True)
class Attended:
    """One key (a token, or a merged word) of a query's row, with the weight it gets."""

    name: str
    weight: float
    index: int  # its token index (a word's: its first token's)
    repeated: bool  # the text has another key of the same name

    @property
    def label(self) -> str:
        """The name as listed (see :func:`key_label`)."""
        return key_label(self.name, self.index, self.repeated)


def key_label(name: str, index: int, repeated: bool) -> str:
    """A key as listed: "9:river" (token index first) where the name alone is ambiguous."""
    return f"{index}:{name}" if repeated else name


def key_labels(names: list[str], indices: list[int] | None = None) -> list[str]:
    """Every key of a row as listed: each name, with its token index (``indices``; by default
    its place in the row) where another has the name too."""
    indices = list(range(len(names))) if indices is None else indices
    return [
        key_label(name, i, names.count(name) > 1) for name, i in zip(names, indices, strict=True)
    ]


def top_keys(tokens: list[str], weights: Tensor, k: int = 5) -> list[Attended]:
    """The k most weighted keys of one row, most weighted first; keys of weight 0 (masked, as
    the keys after the query in a decoder) are never listed."""
    values, indices = weights.topk(min(k, int((weights > 0).sum())))
    return [
        Attended(tokens[i], weight, i, tokens.count(tokens[i]) > 1)
        for i, weight in zip(indices.tolist(), values.tolist(), strict=True)
    ]


def stacked_qkv(run: RecordedRun) -> tuple[Tensor, Tensor, Tensor]:
    """Query, key and value of every layer and head of a one-text run: each (L, H, T, d)."""
    first_calls = [run.captures.layer(index)[0] for index in range(run.captures.n_layers)]
    return tuple(  # type: ignore[return-value]
        torch.stack([getattr(capture, name)[0] for capture in first_calls])
        for name in ("query", "key", "value")
    )


@dataclass(frozen=True)
class Comparison:
    """One word across sentences: its vectors' cosine similarity, layer by layer."""

    word: str
    sentences: list[str]
    similarity: Tensor  # (L+1, N, N); layer 0 is the embedding output
    attended: list[list[Attended]]  # per sentence: the words it weighs most
    attended_layer: int  # the attention layer read (0-based, as explain's --layer)
    occurrence: int = 0  # which occurrence of the word in each sentence (-1: the last)
    causal: bool = False  # a decoder: the word's vectors depend only on the text up to it
    tokens: list[list[str]] = field(default_factory=list)  # per sentence: the word's tokens
    same_tokens: bool = True  # every sentence reads the word as the same token ids

    @property
    def tokens_note(self) -> str | None:
        """Where sentences read the word as other tokens ("Bank" and " bank" are two for
        GPT-2): its vectors differ from layer 0 on, before any context; None where all agree."""
        if self.same_tokens:
            return None
        readings = ", ".join(
            f"S{number} {' + '.join(repr(token) for token in tokens)}"
            for number, tokens in enumerate(self.tokens, 1)
        )
        return (
            f"'{self.word}' is read as other tokens in some sentences ({readings}): its vectors "
            "differ from layer 0 on, before any context"
        )

    def to_json(self) -> dict:
        return {
            "word": self.word,
            "occurrence": self.occurrence,
            "sentences": self.sentences,
            "tokens": self.tokens,
            "tokens_note": self.tokens_note,
            "layers": [
                {"layer": layer, "cosine": _list(matrix)}
                for layer, matrix in enumerate(self.similarity)
            ],
            "attended_layer": self.attended_layer,
            "causal": self.causal,
            "attended": [
                [
                    {"word": a.name, "label": a.label, "weight": a.weight, "index": a.index}
                    for a in row
                ]
                for row in self.attended
            ],
        }


class VectorRun(RecordedRun, Protocol):
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def hidden_states(self) -> Tensor: ...

    def word_vector(self, word: str, layer: int = -1, occurrence: int = 0) -> Tensor: ...

    def word_tokens(self, word: str, occurrence: int = 0) -> range: ...


@contextmanager
def _naming_sentence(number: int, text: str) -> Iterator[None]:
    """An error about one of the compared sentences says which: "sentence 2 ('banks'): ...";
    a long sentence by its first words, so that the error stays one readable line."""
    try:
        yield
    except SelfAttnError as error:
        shown = text if len(text) <= SHOWN_SENTENCE else text[: SHOWN_SENTENCE - 1] + "…"
        raise SelfAttnError(
            Message(f"sentence {number} ({shown!r}): ", *parts_of(message_of(error)))
        ) from None


def compare_texts(
    model: TextModel,
    sentences: list[str],
    word: str,
    *,
    occurrence: int = 0,
    truncate: bool = False,
) -> Comparison:
    """Run each sentence through ``model`` and compare ``word`` across them (:func:`compare`).

    This is what the explorer calls; an error names the sentence it is about.
    """
    runs = run_sentences(model, sentences, word, truncate=truncate)
    return compare(runs, word, occurrence=occurrence)


def run_sentences(
    model: TextModel, sentences: list[str], word: str, *, truncate: bool = False
) -> list[VectorRun]:
    """Each sentence run through ``model``, once the request is one :func:`compare` can take
    (two sentences or more, a word); ``selfattn compare`` calls it, then :func:`compare`, so
    that it can say which sentences ``truncate`` cut."""
    if isinstance(sentences, str) or len(sentences) < 2:
        got = "one str" if isinstance(sentences, str) else str(len(sentences))
        raise SelfAttnError(f"give a list of at least two sentences to compare, got {got}")
    check_word(word)  # about no sentence in particular
    runs = []
    for number, sentence in enumerate(sentences, 1):
        with _naming_sentence(number, sentence):
            runs.append(model.run(sentence, truncate=truncate))
    return runs


def compare(runs: Sequence[VectorRun], word: str, top: int = 3, occurrence: int = 0) -> Comparison:
    """Cosine similarity of ``word``'s contextual vector between every pair of runs.

    ``occurrence`` picks the word in each run (0 = first, -1 = last). What the word attends
    to is read in the last attention layer, mean of heads, merged to words, leaving out
    special tokens and the word itself.
    """
    n_layers = runs[0].hidden_states.shape[0]
    vectors = []
    for number, run in enumerate(runs, 1):
        with _naming_sentence(number, run.text):
            layers = [run.word_vector(word, layer, occurrence) for layer in range(n_layers)]
        vectors.append(torch.stack(layers))
    vectors = torch.stack(vectors)  # (N, L+1, D)
    unit = torch.nn.functional.normalize(vectors.double(), dim=-1)
    # Clamped: rounding may give 1.0000000000000002, not a cosine.
    similarity = torch.einsum("ald,bld->lab", unit, unit).clamp(-1.0, 1.0)  # (L+1, N, N)
    last = n_layers - 2
    spans = list(zip(runs, [run.word_tokens(word, occurrence) for run in runs], strict=True))
    attended = [attended_words(run, span, last, top) for run, span in spans]
    texts = [run.read_text for run in runs]  # as explain shows its text: what the model read
    causal = runs[0].captures[0].causal
    tokens = [[run.tokens[i] for i in span] for run, span in spans]
    same = len({tuple(run.token_ids[i] for i in span) for run, span in spans}) == 1
    return Comparison(word, texts, similarity, attended, last, occurrence, causal, tokens, same)


def attended_words(run: RecordedRun, pieces: range, layer: int, top: int) -> list[Attended]:
    """The words that the word made of ``pieces`` weighs most (mean of heads, merged); words
    it may not attend (after it, in a decoder) are left out. Its row is the mean of its
    tokens' rows (a word's, as ``merge_words`` defines it; a phrase's, over all its words), and
    no word it touches is listed."""
    groups = word_groups(run.tokens, run.word_ids)
    names = listed_names(groups, run.tokens, hidden_texts(run))
    trace = run.captures.layer(layer)[0].trace()
    membership = word_membership(trace.weights, [members for _, members in groups])
    row = trace.weights.mean(0)[list(pieces)].mean(0) @ membership  # (W,) keys summed
    seen = ~never_attended(trace)[list(pieces)].all(0)  # (T,) keys some piece may attend
    own = {j for j, (_, members) in enumerate(groups) if set(members) & set(pieces)}
    ranked = [
        Attended(names[j], float(row[j]), groups[j][1][0], names.count(names[j]) > 1)
        for j in row.argsort(descending=True).tolist()
        if j not in own and run.word_ids[groups[j][1][0]] is not None and seen[groups[j][1]].any()
    ]
    return ranked[:top]
