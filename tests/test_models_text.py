"""Tokens line up with the words of the text through character offsets (exact comparisons)."""

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
    with pytest.raises(SelfAttnError, match=r"not in the text\); the words are: Banking, at, the"):
        encoding.find("money")
    with pytest.raises(SelfAttnError, match="empty"):
        encoding.find("  ")


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


def test_align_words_without_tokens_for_a_word():
    words, word_ids = align_words("ab cd", [(0, 2)])
    assert [(w.text, w.tokens) for w in words] == [("ab", range(0, 1))]
    assert word_ids == [0]


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
