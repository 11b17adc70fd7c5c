"""Decoders (GPT family) through explain, compare and their reports: the causal mask shown.

A query of a decoder sees keys 0..itself: later keys get weight exactly 0, and every view
says they are masked instead of listing them as keys weighed and found unimportant. Two
small random decoders, built here without downloads: a GPT-2 folder with a byte-level BPE,
and a character-level GPT as `selfattn train` makes them. Tolerance: rows sum to 1 within 1e-6.
"""

import html
import json

import pytest
import torch
from fastapi.testclient import TestClient
from rich.console import Console
from typer.testing import CliRunner

import selfattn
from conftest import char_gpt
from selfattn import explain as explaining
from selfattn import server
from selfattn.cli import app
from selfattn.models.gpt import GPT, GPTConfig
from selfattn.models.model import Model, ModelConfig, _token_strings
from selfattn.text import Tokenizer
from selfattn.train.data import CharTokenizer
from selfattn.viz import report
from selfattn.viz.generation import generation_page
from test_models_llama import mistral, vocab_size  # noqa: F401 (fixtures)
from test_models_random import VOCAB, byte_level_tokenizer

transformers = pytest.importorskip("transformers")

SENTENCE = "the bank is here"


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=48, n_embd=32, n_layer=2, n_head=2,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    byte_level_tokenizer(folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def gpt2(gpt2_folder):
    return selfattn.load(gpt2_folder)


@pytest.fixture(scope="module")
def char_model():
    return char_gpt("abcdefghijklmnopqrstuvwxyz \n", block_size=32)


def test_compare_notes_a_word_read_as_other_tokens(gpt2):
    """GPT-2 reads "Bank" at the start and " bank" after a space as other tokens: their
    vectors differ from layer 0 on (0.12 apart on real GPT-2), which compare did not say; its
    layer 0 note still called them "the same word, only the position differs"."""
    sentences = ["Bank of the river", "I went to the bank"]
    c = explaining.compare_texts(gpt2, sentences, "bank")
    runs = [gpt2.run(sentence) for sentence in sentences]
    assert c.tokens == [[run.tokens[i] for i in run.word_tokens("bank")] for run in runs]
    assert c.tokens[1] == [" bank"] and c.tokens[0] != c.tokens[1]
    shown = ", ".join(
        f"S{n} {' + '.join(repr(t) for t in tokens)}" for n, tokens in enumerate(c.tokens, 1)
    )
    assert (
        c.to_json()["tokens_note"]
        == c.tokens_note
        == (
            f"'bank' is read as other tokens in some sentences ({shown}): its vectors differ from "
            "layer 0 on, before any context"
        )
    )
    console = Console(record=True, width=200)
    report.print_comparison(console, c, "gpt2")
    assert c.tokens_note in console.export_text()
    alike = explaining.compare_texts(gpt2, ["the bank of the river", "I went to the bank"], "bank")
    assert (alike.tokens, alike.tokens_note) == ([[" bank"], [" bank"]], None)


def test_explanation_names_the_keys_after_a_decoder_query_as_masked(gpt2):
    run, e = explaining.explain_text(gpt2, SENTENCE, word="bank", layer=1, head=0)
    query, length = e.query, len(run.tokens)
    assert 0 < query < length - 1
    data = e.to_json()
    assert data["causal"] is True
    assert data["masked_keys"] == list(range(query + 1, length))
    assert all(data["weights"][key] == 0 for key in data["masked_keys"])
    seen = list(range(query + 1))  # as the README says: softmax over the keys not masked
    torch.testing.assert_close(  # float64 of float32 numbers: 1e-6
        torch.tensor(data["weights"])[seen], torch.tensor(data["scaled"])[seen].softmax(-1),
        atol=1e-6, rtol=0,
    )  # fmt: skip
    assert e.masked.tolist() == torch.ones(length, length, dtype=torch.bool).triu(1).tolist()
    torch.testing.assert_close(
        e.attention.sum(-1), torch.ones(length), atol=1e-6, rtol=0, check_dtype=False
    )


def test_terminal_explain_shows_masked_keys_as_minus_infinity_and_says_why(gpt2):
    _, e = explaining.explain_text(gpt2, SENTENCE, word="bank", layer=1, head=0)
    console = Console(record=True, width=200, color_system=None)
    report.print_explanation(console, e)
    text = console.export_text()
    assert text.count("-inf │") == len(e.masked_keys)  # the scaled column of the table
    assert f"masked: keys {e.query + 1}..{len(e.tokens) - 1}, after the query" in text
    assert "causal: each query sees keys up to itself" in text


def test_top_attended_never_lists_keys_of_weight_zero():
    attended = explaining.top_keys(["a", "b", "c", "d"], torch.tensor([0.25, 0.75, 0.0, 0.0]))
    assert [(key.name, key.weight) for key in attended] == [("b", 0.75), ("a", 0.25)]


def test_compare_on_a_decoder_lists_only_words_before_the_word(gpt2):
    sentences = ["bank is where I went", "the old bank of the river"]
    comparison = explaining.compare_texts(gpt2, sentences, "bank")
    first, second = comparison.attended
    assert first == []  # the first word of a decoder's text sees no other word
    assert {key.name for key in second} == {"the", "old"}
    assert comparison.to_json()["causal"] is True
    console = Console(record=True, width=200, color_system=None)
    report.print_comparison(console, comparison, gpt2.name)
    text = console.export_text()
    assert "attends to: no word before it" in text
    assert "see only the text up to it" in text


def test_merged_words_keep_whitespace_tokens_visible(char_model):
    _, e = explaining.explain_text(char_model, "the bank\nis", word="bank", head=0, words=True)
    words = e.to_json()["words"]
    assert words == ["the", " ", "bank", "\n", "is"]
    labels, merged = report._labels(e)
    assert labels == ["the", "␣", "bank", "↵", "is"]
    torch.testing.assert_close(
        merged.sum(-1), torch.ones(len(words)), atol=1e-6, rtol=0, check_dtype=False
    )
    assert json.dumps(e.to_json())  # plain JSON: no -inf anywhere


def test_encode_on_a_decoder_names_the_fix(gpt2):
    with pytest.raises(selfattn.errors.SelfAttnError) as error:
        gpt2.encode(["no sentence embeddings from a decoder"])
    message = str(error.value)
    assert "\n" not in message
    assert "'minilm'" in message and "run(text).word_vector(word)" in message


def test_a_prompt_that_is_no_text_gets_one_line(gpt2):
    """Before: TypeError "sequence item 0: expected str instance, int found" from inside the
    tokenizer. generate takes a list of prompts now; generate_recorded records one."""
    error = selfattn.errors.SelfAttnError
    with pytest.raises(
        error, match=r"^generate takes a str or a list of str, got list holding int"
    ):
        gpt2.generate([5, 6, 7], 3)
    with pytest.raises(error, match=r"^the prompt must be a str, got int"):
        gpt2.generate_recorded(5, 3)
    with pytest.raises(error, match=r"^generate_recorded records one prompt \(a str\), got a list"):
        gpt2.generate_recorded(["the bank", "a river"], 3)


def test_a_grouped_decoder_takes_an_empty_batch(mistral):  # noqa: F811
    """Before: "cannot reshape tensor of 0 elements into shape [0, 3, -1, 8]" in its
    GroupedQueryAttention; GPT-2 already gave empty logits."""
    model = mistral.model
    assert model(torch.zeros(0, 3, dtype=torch.long)).logits.shape == (
        0,
        3,
        model.config.vocab_size,
    )


def test_generate_continues_with_a_gpt2_folder_as_the_library_does(gpt2_folder, gpt2):
    """`selfattn generate --model FOLDER` prints the prompt and what Model.generate writes
    (exact: greedy, and sampling with a seed)."""
    for options in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 5, "seed": 2}):
        flags = [part for name, value in options.items()
                 for part in (f"--{name.replace('_', '-')}", str(value))]  # fmt: skip
        args = ["generate", "--model", str(gpt2_folder), "the bank", "--max-new-tokens", "8"]
        result = CliRunner().invoke(app, [*args, *flags])
        assert result.exit_code == 0, result.output
        assert result.stdout == "the bank" + gpt2.generate("the bank", 8, **options) + "\n"


@pytest.mark.parametrize("models", [[], ["--checkpoint", "runs/x", "--model", "folder"]])
def test_generate_takes_exactly_one_model(models):
    result = CliRunner().invoke(app, ["generate", *models, "hello"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "Error: give one model to continue with: --checkpoint DIR (trained by `selfattn "
        "train`) or --model FOLDER (a GPT-2, GPT-NeoX, Llama, Mistral, Qwen, Phi-3 or Gemma one)"
    )


def test_characters_split_into_bytes_are_named_by_their_part(gpt2):
    """Byte-level BPE splits é into two tokens and 日 into three; each decodes alone to "�"."""
    run = gpt2.run("un café 日本")
    split = [token for token in run.tokens if "[" in token]
    assert split == ["é[1/2]", "é[2/2]", "日[1/3]", "日[2/3]", "日[3/3]", "本[1/3]", "本[2/3]",
                     "本[3/3]"]  # fmt: skip
    assert "�" not in "".join(run.tokens)
    _, e = explaining.explain_text(gpt2, "un café 日本", word="café", head=0, words=True)
    assert e.to_json()["words"] == ["un", "café", " ", "日", "本"]
    assert e.query_word[0] == "café"


@pytest.mark.parametrize("text", ["x🙂", "café 日本🙂", "a🙂 日"])
def test_generated_tokens_name_split_characters_as_a_prompts_tokens_are(gpt2, text):
    """New tokens are named from their bytes (generate_recorded's tokens), a prompt's from
    their character offsets (Encoding.tokens): both name a character's parts alike, a 4-byte
    emoji's four and a character whose bytes end the ids too."""
    ids = gpt2.tokenizer.encode(text).ids
    named = _token_strings(gpt2.tokenizer, ids)
    assert named == gpt2.run(text).tokens
    assert [token for token in named if "🙂" in token] == [
        "🙂[1/4]",
        "🙂[2/4]",
        "🙂[3/4]",
        "🙂[4/4]",
    ]


def test_a_first_word_of_a_decoder_is_said_to_have_no_content_word_in_reach(char_model):
    """The word's pieces see only themselves and what comes before: every head scores 0."""
    _, e = explaining.explain_text(char_model, "bank is", word="bank")
    assert (e.layer, e.head) == (0, 0)
    assert e.choice.startswith("chosen: no head puts any weight on other content words")
    _, later = explaining.explain_text(char_model, "river bank", word="bank")
    assert "puts the most weight here" in later.choice
    # "is" is a stop word as a whole: its letters (an "s") were content tokens one by one
    _, after_a_stop_word = explaining.explain_text(char_model, "is bank", word="bank")
    assert after_a_stop_word.choice.startswith("chosen: no head puts any weight on other content")


def test_generation_pages_of_mistral_carry_its_sliding_windows(mistral, tmp_path):  # noqa: F811
    """The explorer's Generate view and `generate --html` get Mistral's window of 6 per layer,
    so that their strips mask the keys before it instead of showing them at weight 0 as keys
    weighed and found unimportant (the page itself: test_generation_view)."""
    folder, _, model = mistral
    prompt = "I went to the bank to deposit money"  # 9 tokens: past the window
    with TestClient(server.create_app(model), base_url="http://127.0.0.1:8000") as client:
        body = {"prompt": prompt, "max_new_tokens": 3, "temperature": 0}
        assert client.post("/api/generate", json=body).json()["windows"] == [6, 6, 6]
    page = tmp_path / "generation.html"
    args = ["generate", "--model", str(folder), prompt, "--max-new-tokens", "3"]
    result = CliRunner().invoke(app, [*args, "--temperature", "0", "--html", str(page)])
    assert result.exit_code == 0, result.output
    assert '"windows":[6,6,6]' in page.read_text(encoding="utf-8")


def test_terminal_heatmap_names_the_keys_before_mistrals_window(mistral, gpt2):  # noqa: F811
    """The heatmap's note said only the later keys were masked; Mistral's lower corner (keys
    before each query's window of 6) is empty too, and named, a GPT-2's is not."""
    texts = []
    for model in (mistral[2], gpt2):
        _, e = explaining.explain_text(model, "I went to the bank to deposit money.", head=0)
        console = Console(record=True, width=200, color_system=None)
        report.print_explanation(console, e)
        texts.append(console.export_text())
    window = "later ones masked, and those before its sliding window"
    assert window in texts[0] and window not in texts[1]
    assert "later ones masked" in texts[1]


def test_another_scale_keeps_mistrals_window(mistral):  # noqa: F811
    """The recomputed head (Similarity & scale, --scale) masks the keys before the window as
    the model does: scale 0 spreads the weight evenly over the 6 keys in it, none before."""
    _, e = explaining.explain_text(mistral[2], SENTENCE * 3, index=9, layer=1, head=2, scale=0.0)
    keys = torch.arange(len(e.tokens))
    expected = ((keys > 3) & (keys <= 9)).double() / 6  # the query and the 5 keys before it
    torch.testing.assert_close(e.alternative.weights, expected, check_dtype=False)
    assert e.alternative.entropy == pytest.approx(torch.log2(torch.tensor(6.0)).item())


def test_a_prompt_with_ids_past_the_models_table_is_one_line():
    """A tokenizer larger than the model's table (a tokenizer.json not the checkpoint's) gave
    a bare IndexError ("index out of range in self") from generate; run already said what."""
    chars = CharTokenizer.from_text("abc ")
    config = GPTConfig(vocab_size=chars.vocab_size - 2, block_size=8, n_layer=1, n_head=1, n_embd=8)
    info = ModelConfig.for_decoder(config, "gpt")
    model = Model(GPT(config), info, name="small", tokenizer=Tokenizer(chars.to_hf())).eval()
    message = r"the prompt's token ids must lie in 0\.\.1, got values from 1 to 3; use the model"
    for generate in (model.generate, model.generate_recorded, lambda p: model.generate([p])):
        with pytest.raises(selfattn.errors.SelfAttnError, match=message):
            generate("abc")


def test_an_id_past_the_tokenizers_vocabulary_is_shown_by_its_number():
    """A model whose table is padded past its tokenizer's vocabulary (Phi-3's 32,064 rows for
    32,011 tokens, Qwen2's likewise) can sample an id the tokenizer lacks. Its token reads
    "[id N]"; it used to be None, which no view can show (a sentencepiece tokenizer raised a
    TypeError instead). The text leaves it out, as Hugging Face's decode does."""
    torch.manual_seed(0)
    chars = CharTokenizer.from_text("abc ")
    config = GPTConfig(
        vocab_size=chars.vocab_size + 60, block_size=32, n_layer=1, n_head=1, n_embd=8
    )
    info = ModelConfig.for_decoder(config, "gpt")
    model = Model(GPT(config), info, name="padded", tokenizer=Tokenizer(chars.to_hf())).eval()
    generation = model.generate_recorded("abc", 10, seed=1)
    new_ids = generation.token_ids[generation.n_prompt :]
    new_tokens = generation.tokens[generation.n_prompt :]
    assert any(i >= chars.vocab_size for i in new_ids)  # seed 1 samples some: the case tested
    for token_id, token in zip(new_ids, new_tokens, strict=True):
        expected = f"[id {token_id}]" if token_id >= chars.vocab_size else chars.decode([token_id])
        assert token == expected
    known = [i for i in new_ids if i < chars.vocab_size]
    assert generation.text == chars.decode(known)
    assert json.loads(json.dumps(generation.to_json()))["tokens"] == generation.tokens
    assert html.escape(f"[id {max(new_ids)}]") in generation_page(generation)


def test_run_and_generate_take_no_dropout_and_put_each_modules_mode_back():
    """A network in train mode with dropout 0.5 (one block left in eval mode): run, generate
    and generate_recorded compute as in eval mode (the run's states equal eval's exactly, a
    seed gives the same text), and every module is in its own mode again afterwards."""
    torch.manual_seed(0)
    chars = CharTokenizer.from_text("abcdefgh ")
    config = GPTConfig(chars.vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.5)
    info = ModelConfig.for_decoder(config, "gpt")
    model = Model(GPT(config), info, name="char", tokenizer=Tokenizer(chars.to_hf())).eval()
    states, text = model.run("abc ba").hidden_states, model.generate("abc", 8, seed=1)
    model.train()
    model.network.blocks[0].eval()
    modes = [module.training for module in model.modules()]
    assert True in modes and False in modes
    assert torch.equal(model.run("abc ba").hidden_states, states)
    assert model.generate("abc", 8, seed=1) == text
    assert model.generate_recorded("abc", 8, seed=1).text == text
    assert [module.training for module in model.modules()] == modes
