"""Text to tokens and back, and which tokens make up which word (through character offsets).

A checkpoint's ``tokenizer.json`` is read with Hugging Face ``tokenizers`` (word-piece for BERT,
byte-level BPE for GPT-2, Llama 3 and Qwen, sentencepiece-style BPE with "▁" for spaces and
byte fallback for Llama 2 and Mistral). Words are found in the text itself, the same way for every
tokenizer: runs of letters and digits with their combining marks (``don't`` and ``3.50`` stay
whole), single punctuation marks and single Chinese characters (as BERT splits them: ``银行``
is two words). A token belongs to the words its character span overlaps, so a word split
into pieces (``token`` + ``##izer``) maps to all of them.

Finding a word is whole-word, case-insensitive and "smart" about accents, as search tools
are: a query without accents matches with or without them (``cafe`` finds ``Café``), a query
with accents only that spelling (``café`` finds ``CAFÉ``, not ``cafe``). Both sides are
compared in canonical decomposition (NFD, so a precomposed ``é`` and ``e`` + U+0301 are the
same), with the nonspacing marks (category Mn) dropped for a query that has none. Only NFD,
not NFKD: a ligature (``ﬁ``), a superscript (``²``) or a full-width letter stays a character
of its own, since folding those would change more than accents (``m2`` would find ``m²``).
A straight apostrophe and a curly one are the same (``l'amico`` finds ``l’amico``), the words
of a phrase match across any spaces and line breaks, and a number is never found inside a
longer one (``1`` is not the start of ``1,000``).
"""

from __future__ import annotations

import functools
import re
import threading
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers import decoders

from selfattn.errors import Message, Options, SelfAttnError, SettingsError

# CJK ideographs, the ranges BERT's tokenizer splits into one word per character.
CJK = (
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
    "\U00020000-\U0002a6df\U0002a700-\U0002ceaf\U0002f800-\U0002fa1f"
)
LETTERS = rf"[^\W{CJK}]"  # a letter or digit that is not a CJK ideograph
APOSTROPHE = str.maketrans("’", "'")  # l'amico finds l’amico, and l’amico l'amico
LISTED_WORDS = 30  # a "not in the text" error names at most this many of its words
METASPACE = "\u2581"  # "▁": a space, in sentencepiece-style vocabularies
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # no UTF-8 text decodes to one
JOINERS = "\u200c\u200d"  # zero-width non-joiner and joiner: part of the character before
# Invisible format characters that may sit inside a word (BERT's normaliser drops them): the
# soft hyphen, zero-width space, non-joiner and joiner, direction marks, word joiner, BOM.
INVISIBLE = "\u00ad\u200b\u200c\u200d\u200e\u200f\u2060\ufeff"

Span = tuple[int, int]  # (start, end) character positions, end excluded


@dataclass(frozen=True)
class Word:
    """One word of the text: its characters and the tokens that overlap them."""

    text: str
    start: int
    end: int
    tokens: range  # indices into the encoding's tokens


@dataclass(frozen=True)
class Encoding:
    """A text as the model sees it, with the alignment between words and tokens."""

    text: str
    ids: list[int]
    tokens: list[str]  # readable pieces: "##ing" for word-piece, " bank" for BPE (also "▁bank")
    offsets: list[Span]  # each token's characters in ``text``; empty for special tokens, (0, 0),
    # and for a space the tokenizer added alone ("▁" before "日"): no word's
    words: list[Word]  # the words that have at least one token (all, unless truncated)
    word_ids: list[int | None]  # index into ``words`` of each token; None for special tokens
    read_end: int | None = None  # where truncation cut the text; None: it was read whole

    @property
    def read_text(self) -> str:
        """The part of :attr:`text` the model read: all of it, unless truncation dropped
        tokens (characters that make no token, a final vowel sign or a zero-width space, are
        no reason to call a text cut)."""
        return self.text if self.read_end is None else self.text[: self.read_end]

    def find(self, word: str, occurrence: int = 0) -> Span:
        """Character span of a whole-word, case-insensitive match of ``word`` (or a phrase)."""
        check_word(word)
        matches = self._matches(word)
        if not matches:
            distinct = list(dict.fromkeys(w.text for w in self.words))
            listed = ", ".join(distinct[:LISTED_WORDS])
            if len(distinct) > LISTED_WORDS:
                listed += f", … and {len(distinct) - LISTED_WORDS} more"
            raise SelfAttnError(f"the word {word!r} is not in the text; the words are: {listed}")
        if not -len(matches) <= occurrence < len(matches):
            count = f"{len(matches)} time" + ("s" if len(matches) > 1 else "")
            raise SelfAttnError(
                Message(
                    f"there is no occurrence {occurrence} of the word {word!r}: it occurs "
                    f"{count} in the text; ",
                    Options("--occurrence (occurrence= in Python)", ("occurrence",)),
                    " counts from 0 (0 = the first, -1 = the last)",
                )
            )
        return matches[occurrence]

    def tokens_in(self, span: Span) -> range:
        """The tokens whose characters overlap ``span``; an error if none do."""
        start, end = span
        hits = [i for i, (s, e) in enumerate(self.offsets) if s < end and e > start]
        if not hits:
            raise SelfAttnError(
                f"no token covers characters {start}..{end} of a {len(self.text)}-character "
                "text (outside it, only spaces, or cut off by truncation); choose another span"
            )
        return range(hits[0], hits[-1] + 1)

    def select(self, word_or_span: str | Span, occurrence: int = 0) -> range:
        """Tokens of a word (whole-word match, case-insensitive) or of a character span."""
        if isinstance(word_or_span, str):
            span = self.find(word_or_span, occurrence)
            self._check_read(word_or_span, occurrence, span)
            return self.tokens_in(span)
        return self.tokens_in(word_or_span)

    def _matches(self, word: str) -> list[Span]:
        """Spans of every whole-word, case-insensitive match (CJK characters are words), in
        characters of ``text``; a query without accents also matches accented spellings, a
        straight apostrophe a curly one (and back), the words of a phrase any spaces."""
        query = word.strip()
        strip = not any(unicodedata.category(ch) == "Mn" for ch in decomposed(query)[0])
        folded_query = decomposed(query, strip)[0].translate(APOSTROPHE)
        if not folded_query.strip():
            raise SelfAttnError(
                f"the word {word!r} is only invisible characters (a zero-width space, a soft "
                "hyphen); choose a visible word of the text"
            )
        folded, owner = decomposed(self.text, strip)
        folded = folded.translate(APOSTROPHE)  # the same length: owner still holds
        # Not a part of a word, nor of a number (the 1 of 1,000); any spaces between words.
        body = r"\s+".join(re.escape(part) for part in folded_query.split())
        digits_before = r"(?<!\d[.,])" if folded_query[0].isdigit() else ""
        digits_after = r"(?![.,]\d)" if folded_query[-1].isdigit() else ""
        # A query that starts (ends) with a mark, "." or "🙂", is a word of its own there
        # whatever precedes (follows) it: "money." holds the word "."; but not a mark inside
        # a word or number (the "'" of "don't", the "." of "3.50"), by the text's own words.
        letter_first = re.match(LETTERS, folded_query[0]) is not None
        letter_last = re.match(LETTERS, folded_query[-1]) is not None
        before_word = rf"(?<!{LETTERS})" if letter_first else ""
        after_word = rf"(?!{LETTERS})" if letter_last else ""
        pattern = rf"{before_word}{digits_before}{body}{after_word}{digits_after}"
        if not (letter_first and letter_last):
            words = [match.span() for match in word_pattern().finditer(self.text)]
            starts, ends = {start for start, _ in words}, {end for _, end in words}
        spans = []
        for match in re.finditer(pattern, folded, re.IGNORECASE):
            start, end = match.span()
            before = start > 0 and (owner[start - 1] == owner[start] or is_mark(folded[start - 1]))
            after = end < len(folded) and (owner[end - 1] == owner[end] or is_mark(folded[end]))
            if before or after:
                continue  # it would cut a character, or a letter from its marks
            # The end takes in the marks dropped after the match (those of "e" + U+0301).
            span = (owner[start], owner[end] if end < len(folded) else len(self.text))
            if not letter_first and span[0] not in starts:
                continue  # a mark inside a word: the "'" of "don't"
            if not letter_last and span[1] not in ends:
                continue
            spans.append(span)
        return spans

    def _check_read(self, word: str, occurrence: int, span: Span) -> None:
        """An error naming the occurrences the model read, for one that truncation cut off."""
        read_end = self.read_end
        if read_end is None or span[0] < read_end:
            return
        matches = self._matches(word)
        read = sum(start < read_end for start, _ in matches)
        fix = (
            f"which hold its occurrences 0..{read - 1} of {len(matches)}; pick one of those"
            if read
            else "where it does not occur; put it earlier in the text"
        )
        raise SelfAttnError(
            f"occurrence {occurrence} of the word {word!r} is at character {span[0]:,}, past "
            f"the first {read_end:,} characters that the model read (the text was truncated), "
            f"{fix}"
        )


def missing_token(token_id: int) -> str:
    """How a token id the tokenizer lacks is shown: "[id N]"."""
    return f"[id {token_id}]"


class Tokenizer:
    """A checkpoint's ``tokenizer.json``; never pads, truncates only when asked."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self.backend = backend
        # The truncation setting lives in the backend, shared by every thread (the explorer
        # serves from several): set, encode and reset happen under this lock.
        self._lock = threading.Lock()
        self.backend.no_truncation()
        self.backend.no_padding()
        self.byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        # Sentencepiece-style: "▁" stands for a space, "<0xE6>" for a byte (Llama 2, Mistral).
        self.metaspace = backend.decoder is not None and METASPACE in decoder_json(backend)
        # special tokens but the unknown one, which stands for text ("[UNK]" for "🙂")
        unknown = getattr(backend.model, "unk_token", None)
        added = backend.get_added_tokens_decoder().items()
        self.special_ids = frozenset(
            token_id for token_id, token in added if token.special and token.content != unknown
        )

    def __getstate__(self) -> dict:
        """Everything but the lock (a lock cannot be pickled): copy.deepcopy and pickle of
        a model work, each copy with a lock of its own."""
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as error:  # tokenizers raises a bare Exception for bad files
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise SelfAttnError(
                f"cannot read the tokenizer {path}: {first_line}; replace it with the "
                "checkpoint's original tokenizer.json"
            ) from None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def count(self, text: str) -> int:
        """How many tokens ``text`` becomes, special tokens included."""
        return len(self._encode_batch([text], None)[0])

    def encode(self, text: str, max_length: int | None = None) -> Encoding:
        """Tokens of ``text`` (special tokens added), cut to ``max_length`` if given."""
        encoded = self._encode_batch([text], max_length)[0]
        offsets = [
            (0, 0) if special else span
            for span, special in zip(encoded.offsets, encoded.special_tokens_mask, strict=True)
        ]
        if self.byte_level or self.metaspace:
            pieces = [self.piece(i) for i in encoded.ids]
            if self.metaspace:
                pieces, offsets = without_added_spaces(pieces, offsets, text)
            pieces = readable_byte_pieces(pieces, offsets, text)
        else:
            pieces = list(encoded.tokens)
        words, word_ids = align_words(text, offsets)
        # a special token typed in the text ("[MASK]") is the model's, as the ones it adds:
        # found by its characters, but no word's token
        word_ids = [
            None if i in self.special_ids else word
            for i, word in zip(encoded.ids, word_ids, strict=True)
        ]
        cut = cut_end(text, offsets, encoded.overflowing) if encoded.overflowing else None
        return Encoding(text, list(encoded.ids), pieces, offsets, words, word_ids, cut)

    def token(self, token_id: int) -> str:
        """The vocabulary's string for ``token_id`` ("Ġbank", "▁bank", "##ing"); "[id N]" for
        an id the tokenizer lacks, which a model whose table is padded past the tokenizer's
        vocabulary (as Phi-3's and Qwen2's are) can sample."""
        token = self.backend.id_to_token(token_id)
        return missing_token(token_id) if token is None else token

    def piece(self, token_id: int) -> str:
        """One token as read: " bank" for byte-level BPE and for "▁bank" alike; a byte that is
        only part of a character (byte-level, or sentencepiece's "<0xE6>") is "\ufffd"; an id
        the tokenizer lacks is "[id N]" (:meth:`token`)."""
        token = self.backend.id_to_token(token_id)
        if token is None:
            return missing_token(token_id)
        if self.byte_level:
            return self.backend.decode([token_id], skip_special_tokens=False)
        if self.metaspace and (byte := BYTE_TOKEN.fullmatch(token)):
            return chr(int(byte[1], 16)) if int(byte[1], 16) < 0x80 else "\ufffd"
        return token.replace(METASPACE, " ") if self.metaspace else token

    def encode_ids(self, texts: list[str], max_length: int | None = None) -> list[list[int]]:
        """Token ids of many texts at once (the library's parallel path), each cut if asked."""
        return [encoded.ids for encoded in self._encode_batch(texts, max_length)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def _encode_batch(self, texts: list[str], max_length: int | None) -> list:
        """Every text's encoding, cut to ``max_length`` if given: the one place that every text
        goes through before it is tokenized (so it checks them)."""
        for number, text in enumerate(texts):
            check_encodable(text, number if len(texts) > 1 else None)
        with self._lock:
            if max_length is not None:
                self.backend.enable_truncation(max_length)
            try:
                return self.backend.encode_batch(texts)
            except Exception as error:  # e.g. a character-level vocabulary without [UNK]
                unknown = {ch for text in texts for ch in text} - self._known_characters()
                if unknown:
                    raise SelfAttnError(
                        f"characters not in the model's vocabulary: "
                        f"{quoted_characters(unknown)}; use only characters the model was "
                        "trained on"
                    ) from None
                raise SelfAttnError(f"the tokenizer cannot encode the text: {error}") from None
            finally:
                self.backend.no_truncation()

    def _known_characters(self) -> set[str]:
        return {token for token in self.backend.get_vocab() if len(token) == 1}


def check_encodable(text: str, number: int | None = None) -> None:
    """One line for a text with a lone surrogate, which no tokenizer takes: undecodable bytes
    of the command line (Python keeps byte 0xff as U+DCFF), or a str built so in Python."""
    if not isinstance(text, str):
        return  # the tokenizer names what it takes
    found = LONE_SURROGATE.search(text)
    if found is None:
        return
    code = ord(found.group())
    what = (
        f"byte 0x{code - 0xDC00:02x}"
        if 0xDC80 <= code <= 0xDCFF
        else f"a lone surrogate U+{code:04X}"
    )
    name = "the text" if number is None else f"texts[{number}]"
    raise SelfAttnError(
        f"{name} is not valid UTF-8 ({what} at character {found.start():,}); re-encode it as UTF-8"
    )


def cut_end(text: str, kept: list[Span], overflowing: list) -> int:
    """Where the part of ``text`` that truncation kept ends: after the last kept token, with
    the combining marks and joiners that follow it up to the first dropped token (a tokenizer
    may leave a final vowel sign or accent out of every token's span, as MiniLM does)."""
    end = max(stop for _, stop in kept)
    dropped = [
        start
        for part in overflowing
        for (start, stop), special in zip(part.offsets, part.special_tokens_mask, strict=True)
        if not special and start < stop
    ]
    limit = min(dropped, default=len(text))
    while end < limit and (is_mark(text[end]) or text[end] in JOINERS):
        end += 1
    return end


def check_word(word: str) -> None:
    """One line for a word to find that is empty or only spaces."""
    if not word.strip():
        raise SettingsError("the word to find is empty; pass a word of the text")


def decoder_json(backend: tokenizers.Tokenizer) -> str:
    """The tokenizer's decoder as its JSON (a Sequence's parts are not attributes)."""
    return backend.decoder.__getstate__().decode("utf-8")


def without_added_spaces(
    pieces: list[str], offsets: list[Span], text: str
) -> tuple[list[str], list[Span]]:
    """Pieces and offsets without a leading space the text does not have there: the "▁" a
    sentencepiece tokenizer puts before the first word reads "I", not " I". A token that is
    that space alone (before a character it has no merge with, "日") stays " ", never "", and
    its span, which the tokenizer gives as the character's, is made empty: it is no part of
    the word (``explain --word 日`` explained the space)."""
    kept_pieces, kept_offsets = [], []
    for piece, (start, end) in zip(pieces, offsets, strict=True):
        if piece.startswith(" ") and start < end and not text[start].isspace():
            if len(piece) > 1:
                piece = piece[1:]
            else:
                end = start
        kept_pieces.append(piece)
        kept_offsets.append((start, end))
    return kept_pieces, kept_offsets


def readable_byte_pieces(pieces: list[str], offsets: list[Span], text: str) -> list[str]:
    """Byte-level pieces with each part of a character split across tokens (é is two bytes,
    日 three) named by that character and which part it is: "é[1/2]", "é[2/2]", not "�"."""
    readable = list(pieces)
    for i, piece in enumerate(pieces):
        if "\ufffd" not in piece:
            continue
        sharing = [  # the character's byte tokens, not a "▁" that shares its span
            j for j, span in enumerate(offsets) if span == offsets[i] and "\ufffd" in pieces[j]
        ]
        characters = text[slice(*offsets[i])].strip() or piece
        part = f"[{sharing.index(i) + 1}/{len(sharing)}]" if len(sharing) > 1 else ""
        readable[i] = (" " if piece.startswith(" ") else "") + characters + part
    return readable


BYTE_PART = re.compile(r"\[(\d+)/\d+\]$")  # "é[2/2]": the second of the two tokens of é


def join_pieces(pieces: list[str]) -> str:
    """A word from its tokens' readable pieces: word-piece continuations ("##ing") and the
    parts of a character split into bytes ("é[1/2]", "é[2/2]") joined into one."""
    word = ""
    for i, piece in enumerate(pieces):
        piece = piece.strip() if i == 0 else piece.removeprefix("##").strip()
        part = BYTE_PART.search(piece)
        if part is not None:
            piece = piece[: part.start()] if part[1] == "1" else ""
        word += piece
    return word


def decomposed(text: str, strip_marks: bool = False) -> tuple[str, list[int]]:
    """``text`` in NFD, without nonspacing marks if ``strip_marks`` (``Café`` -> ``Cafe``)
    nor :data:`INVISIBLE` characters, and for each character of the result the index of the
    character of ``text`` it comes from (a precomposed ``é`` gives two, ``한`` three, a mark
    alone none).

    Each character is decomposed alone, to know its owner; then, as NFD of the whole text
    does, each run of marks is put in canonical order (``ệ`` and ``ê`` + U+0323 both end
    U+0323 U+0302)."""
    if text.isascii():
        return text, list(range(len(text)))
    pieces = [
        (c, i)
        for i, ch in enumerate(text)
        for c in unicodedata.normalize("NFD", ch)
        if not (strip_marks and unicodedata.category(c) == "Mn") and c not in INVISIBLE
    ]
    ordered: list[tuple[str, int]] = []
    marks: list[tuple[str, int]] = []  # the run of marks since the last base character
    for piece in [*pieces, ("", -1)]:  # the end flushes the last run
        if piece[0] and unicodedata.combining(piece[0]):
            marks.append(piece)
            continue
        ordered += sorted(marks, key=lambda mark: unicodedata.combining(mark[0]))  # stable
        marks = []
        ordered.append(piece)
    return "".join(c for c, _ in ordered), [i for _, i in ordered[:-1]]


def is_mark(ch: str) -> bool:
    """A combining mark (Unicode category M): an accent, a vowel sign."""
    return unicodedata.category(ch)[0] == "M"


def quoted_characters(chars: Iterable[str], shown: int = 20) -> str:
    """Characters, sorted, the first ``shown`` of them quoted: "'XYZ' and 3 more"."""
    ordered = sorted(set(chars))
    more = f" and {len(ordered) - shown} more" if len(ordered) > shown else ""
    return f"{''.join(ordered[:shown])!r}{more}"


@functools.cache
def word_pattern() -> re.Pattern[str]:
    """Runs of letters and digits with their combining marks (the accent of a decomposed
    ``e`` + U+0301, Devanagari's vowel signs: not ``\\w`` to ``re``) and the invisible
    characters between them (Persian's zero-width non-joiner, a soft hyphen), numbers with
    what follows them ("3.5kg"), one CJK character, one symbol with its marks and the symbols
    joined to it (an emoji sequence). Built on first use: listing the marks takes 50 ms."""
    marks = "".join(f"{chr(first)}-{chr(last)}" for first, last in _mark_ranges())
    letters = rf"{LETTERS}(?:[{INVISIBLE}]*(?:{LETTERS}|[{marks}]))*"
    number = rf"\d+(?:[.,]\d+)+(?:{LETTERS}|[{marks}])*"
    symbol = rf"[^\w\s][{marks}]*(?:\u200d[^\w\s][{marks}]*)*"
    return re.compile(rf"{number}|[{CJK}]|{letters}(?:['’]{letters})*|{symbol}")


def _mark_ranges() -> list[tuple[int, int]]:
    """(first, last) code points of each run of combining marks (Unicode category M)."""
    ranges: list[tuple[int, int]] = []
    for code in (*range(0x20000), *range(0xE0100, 0xE01F0)):  # marks stop there
        if unicodedata.category(chr(code))[0] != "M":
            continue
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1] = (ranges[-1][0], code)
        else:
            ranges.append((code, code))
    return ranges


def align_words(text: str, offsets: list[Span]) -> tuple[list[Word], list[int | None]]:
    """The words of ``text`` that some token overlaps, and each token's (first) word."""
    words: list[Word] = []
    word_ids: list[int | None] = [None] * len(offsets)
    for match in word_pattern().finditer(text):
        start, end = match.span()
        hits = [i for i, (s, e) in enumerate(offsets) if s < end and e > start]
        if not hits:
            continue
        for i in hits:
            if word_ids[i] is None:
                word_ids[i] = len(words)
        words.append(Word(match.group(), start, end, range(hits[0], hits[-1] + 1)))
    return words, word_ids
