"""Tokens line up with the words of the text through character offsets (exact comparisons)."""

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from selfattn.errors import SelfAttnError
from selfattn.models.loading import resolve
from selfattn.text import Tokenizer, align_words


@pytest.fixture(scope="module")
def wordpiece():
    folder, _ = resolve("minilm")
    return Tokenizer.from_file(folder / "tokenizer.json")


def test_words_keep_contractions_and_numbers_whole(wordpiece):
    encoding = wordpiece.encode("Don't pay $3.50 for the river-bank's café!")
    assert [w.text for w in encoding.words] == [
        "Don't", "pay", "$", "3.50", "for", "the", "river", "-", "bank's", "café", "!",
    ]  # fmt: skip
    dont = encoding.words[0]
    assert [encoding.tokens[i] for i in dont.tokens] == ["don", "'", "t"]
    assert all(encoding.word_ids[i] == 0 for i in dont.tokens)
    assert encoding.word_ids[0] is None and encoding.word_ids[-1] is None  # [CLS], [SEP]


def test_every_non_special_token_belongs_to_a_word(wordpiece):
    encoding = wordpiece.encode("日本語 and emoji 🙂, tabs\tand ∑ symbols")
    for token, (word_id, offset) in enumerate(
        zip(encoding.word_ids, encoding.offsets, strict=True)
    ):
        if offset == (0, 0):
            continue
        word = encoding.words[word_id]
        assert token in word.tokens
        assert word.start <= offset[0] < word.end


def test_find_matches_whole_words_case_insensitively(wordpiece):
    text = "Banking at the BANK, then the bank of the river."
    encoding = wordpiece.encode(text)
    second = text.index("bank")
    assert encoding.find("bank") == (15, 19)
    assert encoding.find("Bank", occurrence=1) == (second, second + 4)
    assert encoding.find("bank", occurrence=-1) == (second, second + 4)
    assert encoding.find("the river") == (text.index("the river"), len(text) - 1)
    assert [encoding.tokens[i] for i in encoding.select("bank")] == ["bank"]
    with pytest.raises(SelfAttnError, match="occurs 2 time"):
        encoding.find("bank", occurrence=2)
    with pytest.raises(SelfAttnError, match=r"not in the text; the words are: Banking, at, the"):
        encoding.find("money")
    with pytest.raises(SelfAttnError, match="empty"):
        encoding.find("  ")
    numbered = wordpiece.encode(" ".join(f"w{i}" for i in range(40)) + " w0")
    with pytest.raises(SelfAttnError) as error:  # a long text: 30 of its words, then a count
        numbered.find("money")
    listed = ", ".join(f"w{i}" for i in range(30))
    assert str(error.value).endswith(f"the words are: {listed}, … and 10 more")
    exactly = wordpiece.encode(" ".join(f"w{i}" for i in range(30)))  # all 30: no count
    with pytest.raises(SelfAttnError) as error:
        exactly.find("money")
    assert str(error.value).endswith(f"the words are: {listed}")


def test_every_occurrence_counts_from_both_ends(wordpiece):
    """Occurrences 0..n-1 and -n..-1 are the n matches in text order (as Python indexes a
    list): -n is the first, not an error; exact spans, found by hand with str.index."""
    text = "the bank, a bank, the bank"
    encoding = wordpiece.encode(text)
    starts = [text.index("bank"), text.index("bank", 5), text.rindex("bank")]
    spans = [(start, start + 4) for start in starts]
    assert [encoding.find("bank", n) for n in range(3)] == spans
    assert [encoding.find("bank", n) for n in range(-3, 0)] == spans
    for outside in (3, -4):
        with pytest.raises(SelfAttnError, match=f"no occurrence {outside} .* occurs 3 times"):
            encoding.find("bank", outside)


@pytest.mark.parametrize(
    ("word", "occurrence", "message"),
    [
        ("banks", 0, "the word 'banks' is not in the text; the words are: I, went, to, the, bank"),
        ("banks", 3, "the word 'banks' is not in the text; the words are: I, went, to, the, bank"),
        ("bank", 1, "there is no occurrence 1 of the word 'bank': it occurs 1 time in the text"),
        ("to", -3, "there is no occurrence -3 of the word 'to': it occurs 2 times in the text"),
    ],
)
def test_a_word_not_found_says_whether_the_word_or_the_occurrence_is_missing(
    wordpiece, word, occurrence, message
):
    # A word that is not there is not "occurrence 0" missing; an occurrence past the last
    # says how many there are and how the flag (then the argument) counts.
    with pytest.raises(SelfAttnError) as error:
        wordpiece.encode("I went to the bank to").find(word, occurrence)
    counts = "; --occurrence (occurrence= in Python) counts from 0 (0 = the first, -1 = the last)"
    assert str(error.value) == (message if word == "banks" else message + counts)


def test_character_spans_select_overlapping_tokens(wordpiece):
    encoding = wordpiece.encode("tokenizer test")
    assert [encoding.tokens[i] for i in encoding.tokens_in((2, 6))] == ["token", "##izer"]
    assert [encoding.tokens[i] for i in encoding.tokens_in((3, 12))] == ["token", "##izer", "test"]
    with pytest.raises(SelfAttnError, match=r"no token covers characters 9\.\.10"):
        encoding.tokens_in((9, 10))  # the space


def test_truncation_keeps_special_tokens_and_drops_cut_words(wordpiece):
    text = "one two three four five"
    encoding = wordpiece.encode(text, max_length=4)
    assert encoding.tokens == ["[CLS]", "one", "two", "[SEP]"]
    assert [w.text for w in encoding.words] == ["one", "two"]
    assert wordpiece.count(text) == 7
    assert wordpiece.encode_ids([text, "one"], max_length=4) == [
        encoding.ids,
        wordpiece.encode("one").ids,
    ]
    assert wordpiece.decode(encoding.ids) == "one two"


class _SlowBackend:
    """A tokenizer whose encodes take a while: another thread runs in the meantime."""

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def encode_batch(self, texts):
        encoded = self.backend.encode_batch(texts)
        time.sleep(0.3)
        return encoded


def test_a_truncated_encode_does_not_cut_another_threads_text():
    """Truncation is the backend's state: while one thread encodes with max_length, another
    encoding without it still gets all its tokens (the explorer serves from several threads;
    tokenizers 0.22 raised "Already borrowed" there)."""
    folder, _ = resolve("minilm")
    tokenizer = Tokenizer(_SlowBackend(Tokenizer.from_file(folder / "tokenizer.json").backend))
    text = "one two three four five"
    with ThreadPoolExecutor(2) as pool:
        cut = pool.submit(tokenizer.encode, text, 4)
        time.sleep(0.1)
        whole = pool.submit(tokenizer.encode, text)
        assert len(cut.result().tokens) == 4
        assert len(whole.result().tokens) == 7


def test_align_words_without_tokens_for_a_word():
    words, word_ids = align_words("ab cd", [(0, 2)])
    assert [(w.text, w.tokens) for w in words] == [("ab", range(0, 1))]
    assert word_ids == [0]


def test_a_token_over_two_words_belongs_to_the_first():
    """A word-level vocabulary with the token "日本", over two words (each CJK character is a
    word): that token's word id is the first word's, 0, not the second's, and both words
    list it; "語" after the space is word 2. Exact, by hand."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    backend = tokenizers.Tokenizer(models.WordLevel({"日本": 0, "語": 1, "<unk>": 2}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    encoding = Tokenizer(backend).encode("日本 語")
    assert encoding.tokens == ["日本", "語"]
    assert [(w.text, w.tokens) for w in encoding.words] == [
        ("日", range(0, 1)), ("本", range(0, 1)), ("語", range(1, 2)),
    ]  # fmt: skip
    assert encoding.word_ids == [0, 2]


def test_chinese_characters_are_words_as_bert_splits_them(wordpiece):
    text = "我爱银行 and the bank"
    encoding = wordpiece.encode(text)
    assert [w.text for w in encoding.words] == ["我", "爱", "银", "行", "and", "the", "bank"]
    assert encoding.find("银行") == (2, 4)  # a phrase of two one-character words
    assert encoding.find("我") == (0, 1)
    assert encoding.find("bank") == (text.index("bank"), len(text))


def test_an_occurrence_cut_off_by_truncation_names_the_ones_read(wordpiece):
    encoding = wordpiece.encode("bank one bank two three bank", max_length=5)
    assert encoding.tokens == ["[CLS]", "bank", "one", "bank", "[SEP]"]
    assert list(encoding.select("bank", occurrence=1)) == [3]
    with pytest.raises(SelfAttnError, match=r"occurrence -1 of the word 'bank' is at character "
                       r"24, past the first 13 .* occurrences 0\.\.1 of 3") as error:  # fmt: skip
        encoding.select("bank", occurrence=-1)
    assert "span" not in str(error.value)
    with pytest.raises(SelfAttnError, match="does not occur; put it earlier"):
        encoding.select("three")
    # an occurrence that starts right where the read part ends ("-" read, "bank" not) is
    # not one of those read: 2 of 3, by the offsets
    touching = wordpiece.encode("bank bank-bank", max_length=5)
    assert touching.tokens == ["[CLS]", "bank", "bank", "-", "[SEP]"]
    assert touching.read_end == 10 == "bank bank-bank".rindex("bank")
    with pytest.raises(SelfAttnError, match=r"character 10, past .* occurrences 0\.\.1 of 3"):
        touching.select("bank", occurrence=2)


def test_a_query_without_accents_finds_the_word_with_them(wordpiece):
    # "Smart" folding: no accent in the query, any accent in the text; an accent in the query,
    # that spelling only (any case). MiniLM itself drops accents: caffè is "caf" "##fe".
    text = "Il caffè del Café, poi un cafe e un CAFÉ."
    encoding = wordpiece.encode(text)
    cafe, accented = text.index("Café"), text.index("CAFÉ")
    assert encoding.find("cafe") == (cafe, cafe + 4)
    assert encoding.find("CAFE", occurrence=-1) == (accented, accented + 4)
    assert encoding.find("café", occurrence=1) == (accented, accented + 4)
    with pytest.raises(SelfAttnError, match="occurs 2 time"):
        encoding.find("café", occurrence=2)  # not the plain "cafe"
    assert [encoding.tokens[i] for i in encoding.select("caffe")] == ["caf", "##fe"]
    assert encoding.select("caffè") == encoding.select("CAFFE")
    with pytest.raises(SelfAttnError, match=r"is not in the text; the words are: Il, caffè, del"):
        encoding.find("caffé")  # another accent is another word
    perche = wordpiece.encode("È perché")
    assert [perche.tokens[i] for i in perche.select("perche")] == ["perch", "##e"]


def test_folding_keeps_offsets_exact_where_nfd_changes_lengths(wordpiece):
    # Characters that NFD makes longer (ǘ and ệ: three each, 한: three jamo) before the
    # words found, and a text already decomposed (e + U+0301): every span is the word's own
    # characters in the text as given. Only NFD: the ligature ﬁ is not "fi".
    decomposed_cafe = "Cafe\u0301"
    text = f"Lǘ bank, Việt bank, 한국 bank, {decomposed_cafe} bank ﬁne"
    encoding = wordpiece.encode(text)
    banks = [m.start() for m in re.finditer("bank", text)]
    assert [encoding.find("bank", n) for n in range(4)] == [(b, b + 4) for b in banks]
    found = {"viet": "Việt", "VIỆT": "Việt", "lu": "Lǘ", "한국": "한국", "ﬁne": "ﬁne",
             "cafe": decomposed_cafe, "café": decomposed_cafe}  # fmt: skip
    for query, word in found.items():
        start, end = encoding.find(query)
        assert text[start:end] == word, query
    assert [encoding.tokens[i] for i in encoding.select("cafe")] == ["cafe"]
    with pytest.raises(SelfAttnError, match="not in the text"):
        encoding.find("fine")
    with pytest.raises(SelfAttnError, match="not in the text"):
        encoding.find("한")  # a syllable is not a word's first jamo


def test_a_letter_with_two_marks_matches_in_any_canonical_spelling(wordpiece):
    """ệ typed precomposed, as ê + U+0323, or as e + U+0323 + U+0302 is one letter (NFC
    equal): each was decomposed alone, leaving its marks in another order, and "Việt" was
    "not in the text; the words are: ..., Việt, ..." beside a word that looked the same."""
    spellings = ["Vi\u1ec7t", "Vi\u00ea\u0323t", "Vie\u0323\u0302t", "Vie\u0302\u0323t"]
    for text_spelling in spellings:
        text = f"Tôi yêu {text_spelling} Nam"
        encoding = wordpiece.encode(text)
        for query in spellings:
            start, end = encoding.find(query)
            assert text[start:end] == text_spelling, (text_spelling, query)


@pytest.mark.parametrize(
    ("text", "word", "typed"),
    [
        ("کتاب\u200cها را دیدم", "کتاب\u200cها", "کتابها"),  # Persian's non-joiner
        ("a soft\u00adhyphen here", "soft\u00adhyphen", "softhyphen"),
        ("zero\u200bwidth space", "zero\u200bwidth", "zerowidth"),
    ],
)
def test_an_invisible_character_inside_a_word_keeps_it_one_word(wordpiece, text, word, typed):
    """The model's normaliser drops these characters and reads one word, as Hugging Face's
    word_ids say; selfattn made two ("soft", "##hyphen"), so --words averaged half a word
    and "softhyphen", as the terminal shows it, was not in the text."""
    encoding = wordpiece.encode(text)
    start = text.index(word)
    assert [w.text for w in encoding.words][0 if start == 0 else 1] == word
    assert encoding.find(word) == encoding.find(typed) == (start, start + len(word))
    word_ids = {encoding.word_ids[i] for i in encoding.select(typed)}
    assert len(word_ids) == 1
    with pytest.raises(SelfAttnError, match="only invisible characters"):
        encoding.find("\u200b")


@pytest.mark.parametrize(
    ("text", "word"),
    [
        ("It weighs 3.5kg today", "3.5kg"),
        ("family 👩\u200d👩\u200d👧 here", "👩\u200d👩\u200d👧"),
        ("tag #\ufe0f\u20e3 here", "#\ufe0f\u20e3"),
    ],
)
def test_the_words_a_missing_word_error_lists_are_those_find_takes(wordpiece, text, word):
    """A number with its unit, an emoji sequence and a keycap are one word each: the error
    listed "3.5" and "kg" (and --word kg was refused), a bare zero-width joiner, a lone
    keycap mark."""
    encoding = wordpiece.encode(text)
    with pytest.raises(SelfAttnError, match="not in the text") as error:
        encoding.find("x")
    listed = str(error.value).split("the words are: ")[1].split(", ")
    assert word in listed
    for each in listed:
        assert text[slice(*encoding.find(each))] == each


def test_accent_folding_counts_the_same_occurrences_past_truncation(wordpiece):
    encoding = wordpiece.encode("Café one cafe two three CAFÉ", max_length=5)
    assert encoding.tokens == ["[CLS]", "cafe", "one", "cafe", "[SEP]"]
    with pytest.raises(SelfAttnError, match=r"occurrence 2 of the word 'cafe' is at character "
                       r"24, past the first 13 .* occurrences 0\.\.1 of 3"):  # fmt: skip
        encoding.select("cafe", occurrence=2)
    with pytest.raises(SelfAttnError, match=r"'café' .* occurrences 0\.\.0 of 2"):
        encoding.select("café", occurrence=-1)


def test_a_word_keeps_its_combining_marks(wordpiece):
    # Devanagari's vowel signs and a decomposed accent are marks, not \w to Python's re: a
    # word runs through them, and a match may not start or end between a letter and its mark.
    hindi = "मुझे हिंदी भाषा पसंद है"
    encoding = wordpiece.encode(hindi)
    assert [w.text for w in encoding.words] == ["मुझे", "हिंदी", "भाषा", "पसंद", "है"]
    assert list(encoding.select("भाषा")) == [6, 7, 8, 9]
    with pytest.raises(SelfAttnError, match="not in the text"):
        encoding.find("षा")  # the end of भाषा, after the vowel sign ा
    text = "Il caffe\u0300 e\u0300 buono"
    assert [w.text for w in wordpiece.encode(text).words] == [
        "Il", "caffe\u0300", "e\u0300", "buono",
    ]  # fmt: skip


def test_a_number_is_not_found_inside_a_longer_number(wordpiece):
    # "1,000" and "3.50" are words of their own: "1" is the lone 1, "50" is in no word.
    text = "I saw 1,000 birds at 3.50 each and 1 cat, then 2. Not 1.5 or 0,1 of them."
    encoding = wordpiece.encode(text)
    lone = text.index(" 1 ") + 1
    assert encoding.find("1") == (lone, lone + 1)
    with pytest.raises(SelfAttnError, match="occurs 1 time"):
        encoding.find("1", occurrence=1)
    assert encoding.find("2") == (text.index("2."), text.index("2.") + 1)  # a full stop
    assert encoding.find("1,000") == (6, 11)
    assert encoding.find("3.50") == (text.index("3.50"), text.index("3.50") + 4)
    for part in ("50", "000", "5", "0"):
        with pytest.raises(SelfAttnError, match="not in the text"):
            encoding.find(part)


def test_the_words_of_a_phrase_match_across_any_spaces(wordpiece):
    text = "the river\nbank, the river  bank, the riverbank"
    encoding = wordpiece.encode(text)
    assert encoding.find("river bank") == (4, 14)
    assert encoding.find("River Bank", occurrence=-1) == (20, 31)
    with pytest.raises(SelfAttnError, match="occurs 2 time"):
        encoding.find("river bank", occurrence=2)


def test_straight_and_curly_apostrophes_find_each_other(wordpiece):
    text = "l’amico e l'amica; don't"
    encoding = wordpiece.encode(text)
    assert encoding.find("l'amico") == (0, 7)
    assert encoding.find("L’AMICA") == (10, 17)
    assert encoding.find("don’t") == (19, 24)


def test_a_punctuation_mark_or_symbol_is_found_after_a_word_but_not_inside_one(wordpiece):
    text = "I went to the bank to deposit money. Don't pay $3.50, ok? Hi🙂"
    encoding = wordpiece.encode(text)
    assert encoding.find(".") == (text.index("."), text.index(".") + 1)  # after "money"
    assert encoding.find("?") == (text.index("?"), text.index("?") + 1)
    assert encoding.find("🙂") == (len(text) - 1, len(text))
    assert encoding.find("ok?") == (text.index("ok?"), text.index("ok?") + 3)
    assert [encoding.tokens[i] for i in encoding.select(",")] == [","]
    with pytest.raises(SelfAttnError, match="occurs 1 time"):
        encoding.find(".", occurrence=1)  # the "." of 3.50 is part of the number
    with pytest.raises(SelfAttnError, match="not in the text"):
        encoding.find("'")  # the apostrophe of "Don't" is part of the word


@pytest.mark.parametrize("text", ["नमस्ते", "bank\u200b", "a b \u0301", "bank\u200b\u200b"])
def test_characters_that_make_no_token_at_the_end_are_not_a_cut(wordpiece, text):
    # MiniLM reads नमस्ते as न ##म ##स ##त: no token covers the final vowel sign े, nor a
    # trailing zero-width space or lone accent. Nothing was dropped: the text was read whole.
    for max_length in (None, 512):
        encoding = wordpiece.encode(text, max_length=max_length)
        assert encoding.read_end is None
        assert encoding.read_text == text


def test_a_cut_keeps_the_marks_of_its_last_token_and_stops_at_the_first_dropped_one(wordpiece):
    # The tokenizer leaves the final accent of "de" + U+0301 and the vowel sign े out of
    # every span: the text read ends after them, not before, and before the spaces after them.
    cases = [
        ("ab\u0301c\u0301 de\u0301 fg", 4, "ab\u0301c\u0301 de\u0301"),
        ("one two\u0301\u200b three", 4, "one two\u0301"),  # a zero-width space is no mark
        ("a b " + "नमस्ते " * 3, 8, "a b नमस्ते"),  # [CLS] a b न ##म ##स ##त [SEP]
        ("one two three", 4, "one two"),
    ]
    for text, max_length, read in cases:
        encoding = wordpiece.encode(text, max_length=max_length)
        assert (encoding.read_end, encoding.read_text) == (len(read), read), text
    exact = "one two"  # as many tokens as allowed: nothing dropped
    assert wordpiece.encode(exact, max_length=wordpiece.count(exact)).read_end is None


def test_a_cut_leaves_out_a_mark_that_a_dropped_token_reads(tmp_path):
    # Byte-level BPE reads a combining mark in tokens of its own: when those were dropped,
    # the model did not read the mark, and the text read ends before it.
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    backend.train_from_iterator(["one two three"] * 4, trainer)
    tokenizer = Tokenizer(backend)
    text = "one e\u0301\u0301 three"  # one, Ġ, e, then two bytes per accent, Ġthree
    assert tokenizer.encode(text, max_length=3).read_text == "one e"
    assert tokenizer.encode(text, max_length=5).read_text == "one e\u0301"
    assert tokenizer.encode(text).read_text == text


def test_a_text_that_is_not_utf8_is_refused_naming_the_byte(wordpiece):
    # Bytes of the command line that are not UTF-8 reach Python as lone surrogates (0xff is
    # U+DCFF); the tokenizer cannot take them, and it is no matter of the vocabulary.
    fix = "; re-encode it as UTF-8"
    for call in (wordpiece.encode, wordpiece.count, lambda text: wordpiece.encode_ids([text])):
        with pytest.raises(SelfAttnError) as error:
            call("bank \udcff")
        assert str(error.value) == f"the text is not valid UTF-8 (byte 0xff at character 5){fix}"
    with pytest.raises(SelfAttnError) as error:
        wordpiece.encode_ids(["bank", "x\ud800 bank"], max_length=8)
    assert str(error.value) == (
        f"texts[1] is not valid UTF-8 (a lone surrogate U+D800 at character 1){fix}"
    )


@pytest.mark.parametrize("sentencepiece", [False, True])
def test_an_id_the_tokenizer_lacks_is_named_by_its_number(sentencepiece):
    """id_to_token gives None for an id past the vocabulary: piece and token name it "[id N]"
    (a word-level tokenizer returned None, a sentencepiece one raised a TypeError)."""
    import tokenizers
    from tokenizers import decoders, models

    space = "\u2581" if sentencepiece else ""
    backend = tokenizers.Tokenizer(models.WordLevel({f"{space}a": 0, "<unk>": 1}, "<unk>"))
    if sentencepiece:
        backend.decoder = decoders.Metaspace()
    tokenizer = Tokenizer(backend)
    assert tokenizer.metaspace is sentencepiece
    assert tokenizer.piece(5) == tokenizer.token(5) == "[id 5]"
    assert tokenizer.piece(0) == (" a" if sentencepiece else "a")
