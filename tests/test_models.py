"""The real all-MiniLM-L6-v2 on our attention equals Hugging Face and sentence-transformers.

Tolerances (float32 throughout): hidden states 1e-4 absolute, attention weights 1e-5 absolute,
pooler output 1e-5, sentence embeddings cosine >= 0.99999 to sentence-transformers'.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import selfattn
from selfattn.errors import SelfAttnError
from selfattn.models.loading import resolve

SENTENCES = [
    "I went to the bank to deposit money.",
    "We sat on the bank of the river and watched the water.",
    "Ciao gioco a giochi",
    "Hello, world!!!",
    "What?! No way... really?",
    "The café’s crème brûlée costs €7.50 — a bargain.",
    "Naïve coöperation in São Paulo, Zürich and Kraków.",
    "日本語のテキストも大丈夫ですか？",
    "Привет, как дела?",
    "¿Dónde está la biblioteca? ¡Aquí!",
    "Pi is 3.14159, e is 2.71828 and 1e-12 is small.",
    "Call 555-0199 before 9:30am on 2024-03-15.",
    "Emoji 🙂 and symbols ∑ ∫ √ ≠ ≈ ∞",
    "x",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "   leading and trailing spaces   ",
    "Tabs\tand\nnewlines\r\nin text",
    "URLs like https://example.com/path?q=1&r=2 and e-mail a.b@c.de",
    "don't won't can't shouldn't y'all",
    "HTML <b>bold</b> &amp; entities &lt;tag&gt;",
    "C++ and C# and F# are languages; so is Python 3.12.",
    "The quick brown fox jumps over the lazy dog.",
    "Attention is all you need.",
    "Self-attention weighs every token against every other token.",
    "Queries, keys and values are linear maps of the same input.",
    "UPPER CASE and lower case and MiXeD cAsE",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "$$$ %%% ^^^ *** ((( ))) [[[ ]]] {{{ }}}",
    "A sentence with a number 1234567890 in the middle.",
    "Words words words words words words words words words words words.",
    " ".join(["The river bank flooded after the storm."] * 55),  # ~490 tokens
]
TEXTS_FOR_ENCODE = [*SENTENCES[:-1], " ".join(["long"] * 400)]  # the last is cut at 256 tokens
MONEY_1 = "I went to the bank to deposit money."
MONEY_2 = "The bank approved my loan and kept my savings safe."
RIVER = "We sat on the bank of the river and watched the water."


@pytest.fixture(scope="module")
def minilm():
    return selfattn.load("minilm")


def padded_batch(minilm, texts):
    encodings = [minilm.tokenizer.encode(text) for text in texts]
    length = max(len(e.ids) for e in encodings)
    input_ids = torch.zeros(len(texts), length, dtype=torch.long)
    mask = torch.zeros(len(texts), length, dtype=torch.long)
    for row, encoding in enumerate(encodings):
        input_ids[row, : len(encoding.ids)] = torch.tensor(encoding.ids)
        mask[row, : len(encoding.ids)] = 1
    return input_ids, mask


def test_aliases_resolve_to_the_installed_checkpoint():
    folders = {
        resolve(name)[0]
        for name in ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
    }
    assert len(folders) == 1
    assert (folders.pop() / "model.safetensors").is_file()


def test_a_hugging_face_cache_entry_loads_under_its_repository_name(tmp_path):
    """The hub's cache keeps a model in models--org--name/snapshots/<commit>/: the entry was
    refused (config.json missing) and its snapshot was named by the commit hash."""
    folder, _ = resolve("minilm")
    entry = tmp_path / "models--sentence-transformers--all-MiniLM-L6-v2"
    snapshot = entry / "snapshots" / "c9745ed1d9f207416be6d2e6f8de32d1f16199bf"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (snapshot / name).symlink_to(folder / name)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(snapshot.name)
    for path in (entry, snapshot):
        assert resolve(path) == (snapshot, "sentence-transformers/all-MiniLM-L6-v2")
    assert selfattn.load(entry).name == "sentence-transformers/all-MiniLM-L6-v2"
    (entry / "refs" / "main").write_text(snapshot.name + "\n")  # as a hand-written ref ends
    assert resolve(entry) == (snapshot, "sentence-transformers/all-MiniLM-L6-v2")


def test_config_describes_the_model(minilm):
    assert minilm.name == "all-MiniLM-L6-v2"
    assert (minilm.config.n_layers, minilm.config.n_heads, minilm.config.d_model) == (6, 12, 384)
    assert (minilm.config.max_positions, minilm.config.kind) == (512, "encoder")
    assert minilm.network.pooler is not None  # MiniLM's checkpoint carries a pooler
    assert minilm.sentence.pooling == "mean_tokens"
    assert minilm.sentence.max_seq_length == 256


@pytest.mark.parametrize("start", range(0, len(SENTENCES), 8))
def test_every_layer_and_head_matches_hugging_face(minilm, hf_minilm, start):
    """Batches with padding; the last batch holds the ~490-token sentence.

    Compared at real tokens only: what a padding position holds is meaningless (no real token
    attends to it) and drifts between implementations.
    """
    texts = SENTENCES[start : start + 8]
    input_ids, mask = padded_batch(minilm, texts)
    real = mask.bool()
    with torch.no_grad(), selfattn.record(minilm) as recording:
        ours = minilm(input_ids, mask)
        theirs = hf_minilm(
            input_ids, attention_mask=mask, output_hidden_states=True, output_attentions=True
        )
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 7
    for mine, hf in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(mine[real], hf[real], atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.pooler_output, theirs.pooler_output, atol=1e-5, rtol=0)
    for layer, hf_weights in enumerate(theirs.attentions):  # (B, H, T, T)
        capture = recording.layer(layer)[0]
        for row in range(len(texts)):
            length = int(mask[row].sum())
            torch.testing.assert_close(
                capture.weights(batch=row)[:, :length],
                hf_weights[row, :, :length],
                atol=1e-5,
                rtol=0,
            )


def test_run_matches_hugging_face_on_one_text(minilm, hf_minilm):
    run = minilm.run(SENTENCES[5])
    with torch.no_grad():
        theirs = hf_minilm(
            torch.tensor([run.token_ids]), output_hidden_states=True, output_attentions=True
        )
    torch.testing.assert_close(
        run.hidden_states, torch.cat(theirs.hidden_states), atol=1e-4, rtol=0
    )
    for layer in range(6):
        torch.testing.assert_close(
            run.attention(layer), theirs.attentions[layer][0], atol=1e-5, rtol=0
        )


def test_encode_matches_sentence_transformers(minilm):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    folder, _ = resolve("minilm")
    reference = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    theirs = reference.encode(TEXTS_FOR_ENCODE, convert_to_tensor=True, batch_size=8)
    ours = minilm.encode(TEXTS_FOR_ENCODE, batch_size=8)
    assert ours.shape == (len(TEXTS_FOR_ENCODE), 384)
    assert F.cosine_similarity(ours, theirs).min() >= 0.99999
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(ours)), atol=1e-5, rtol=0)
    raw = minilm.encode(TEXTS_FOR_ENCODE[:3], normalize=False)
    assert raw.norm(dim=-1).min() > 1.5  # not unit length: the Normalize step is skipped


def test_encode_a_folder_saved_by_this_sentence_transformers(tmp_path):
    """sentence-transformers 6 saves the pooling as "pooling_mode": "mean" and the 256-token
    limit in tokenizer_config.json only. Such a folder used to be refused ("enables pooling
    modes []"); now encode equals that library's embeddings of it (cosine >= 0.99999), a
    text cut at 256 tokens included."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    folder, _ = resolve("minilm")
    sentence_transformers.SentenceTransformer(str(folder), device="cpu").save(str(tmp_path))
    reference = sentence_transformers.SentenceTransformer(str(tmp_path), device="cpu")
    texts = TEXTS_FOR_ENCODE[-4:]
    theirs = reference.encode(texts, convert_to_tensor=True)
    ours = selfattn.load(tmp_path).encode(texts)
    assert F.cosine_similarity(ours, theirs).min() >= 0.99999


def test_encode_normalises_only_where_the_pipeline_does(tmp_path):
    """A pipeline without a Normalize step (the dot-product models' kind) gives its pooled
    vectors as they are: encode scaled them to unit length all the same (5.2 apart from
    sentence-transformers' here, whose norms were 7.3); it now equals that library's (1e-5)."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from sentence_transformers.models import Pooling, Transformer

    folder, _ = resolve("minilm")
    modules = [Transformer(str(folder)), Pooling(384, "cls")]
    reference = sentence_transformers.SentenceTransformer(modules=modules, device="cpu")
    reference.save(str(tmp_path))
    theirs = reference.encode(SENTENCES[:3], convert_to_tensor=True)
    model = selfattn.load(tmp_path)
    assert not model.sentence.normalize and selfattn.load("minilm").sentence.normalize
    torch.testing.assert_close(model.encode(SENTENCES[:3]), theirs, atol=1e-5, rtol=0)
    unit = model.encode(SENTENCES[:3], normalize=True)
    torch.testing.assert_close(unit, F.normalize(theirs, dim=-1), atol=1e-5, rtol=0)


def test_the_older_layout_with_its_transformer_in_a_subfolder(tmp_path):
    """Older sentence-transformers folders keep the transformer in 0_Transformer/ beside
    1_Pooling/: the folder was refused ("config.json is missing"), and its subfolder loaded
    with mean pooling whatever 1_Pooling said (cosine 0.41 to sentence-transformers' CLS
    embeddings). Both now follow modules.json: equal to that library's encode (1e-5)."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    folder, _ = resolve("minilm")
    body = tmp_path / "0_Transformer"
    body.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (body / name).symlink_to(folder / name)
    (body / "sentence_bert_config.json").write_text('{"max_seq_length": 128}')
    (tmp_path / "1_Pooling").mkdir()
    # mean said off, as sentence-transformers writes it: its 3.0 takes an unsaid mean as on
    pooling = {
        "word_embedding_dimension": 384,
        "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False,
    }
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    kinds = [
        ("0_Transformer", "Transformer"),
        ("1_Pooling", "Pooling"),
        ("2_Normalize", "Normalize"),
    ]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    reference = sentence_transformers.SentenceTransformer(str(tmp_path), device="cpu")
    theirs = reference.encode(SENTENCES[:3], convert_to_tensor=True)
    for path in (tmp_path, body):
        model = selfattn.load(path)
        assert model.sentence.pooling == "cls_token" and model.sentence.max_seq_length == 128
        torch.testing.assert_close(model.encode(SENTENCES[:3]), theirs, atol=1e-5, rtol=0)


def test_encode_lowercases_where_sentence_transformers_does(tmp_path):
    """A cased tokenizer with sentence_bert_config.json's do_lower_case: sentence-transformers
    lowercases the texts first; encode did not ("I" and "Bank" became [UNK] here, 0.17 off)."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    folder, _ = resolve("minilm")
    for name in ("config.json", "model.safetensors", "modules.json"):
        (tmp_path / name).symlink_to(folder / name)
    (tmp_path / "1_Pooling").symlink_to(folder / "1_Pooling")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["normalizer"]["lowercase"] = False  # a cased vocabulary's reading
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    settings = {"max_seq_length": 256, "do_lower_case": True}
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps(settings))
    texts = ["I went to the Bank", "BANK OF THE RIVER"]
    theirs = sentence_transformers.SentenceTransformer(str(tmp_path), device="cpu").encode(
        texts, convert_to_tensor=True
    )
    model = selfattn.load(tmp_path)
    assert model.sentence.lowercase and model.tokenizer.encode("Bank").tokens[1] == "[UNK]"
    torch.testing.assert_close(model.encode(texts), theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("modules", [[1, 2], [{"path": ""}], [{"type": None}]])
def test_a_modules_json_entry_without_a_type_is_one_line(tmp_path, modules):
    """modules.json holding numbers, or a module without a type, was an AttributeError
    traceback (or "pipeline has None")."""
    folder, _ = resolve("minilm")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(folder / name)
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(SelfAttnError, match=r"modules\.json: each module must be an object wi"):
        selfattn.load(tmp_path)


def test_encode_refuses_a_pipeline_with_a_module_it_does_not_compute(tmp_path):
    """MiniLM with a Dense layer after pooling, saved by sentence-transformers (the layout of
    LaBSE and others): its embeddings are not the pooled vectors (cosine < 0.99 here). encode
    used to return the pooled vectors as if they were; now it refuses, naming the module,
    while run still works on the same folder."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    folder, _ = resolve("minilm")
    torch.manual_seed(0)
    reference = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    reference.append(sentence_transformers.models.Dense(384, 384))
    reference.save(str(tmp_path))
    model = selfattn.load(tmp_path)
    pooled = selfattn.load("minilm").encode(SENTENCES[:3])
    theirs = reference.encode(SENTENCES[:3], convert_to_tensor=True)
    assert F.cosine_similarity(pooled, theirs).max() < 0.99
    with pytest.raises(
        SelfAttnError, match=r"pipeline has Dense, which encode does not compute"
    ) as error:
        model.encode(SENTENCES[:3])
    assert "\n" not in str(error.value)
    assert model.run(MONEY_1).tokens[5] == "bank"


def test_encode_is_independent_of_batching_and_order(minilm):
    """Tolerance 1e-5: only padding differs between the batchings."""
    texts = SENTENCES[:12]
    one_batch = minilm.encode(texts, batch_size=32)
    small_batches = minilm.encode(texts[::-1], batch_size=3).flip(0)
    torch.testing.assert_close(one_batch, small_batches, atol=1e-5, rtol=0)
    assert minilm.encode("one text").shape == (1, 384)


def test_encode_progress_bar_goes_to_stderr(minilm, capsys):
    texts = SENTENCES[:6]
    with_bar = minilm.encode(texts, batch_size=2, progress=True)
    torch.testing.assert_close(with_bar, minilm.encode(texts, progress=False), atol=1e-5, rtol=0)
    assert capsys.readouterr().out == ""


def test_bank_in_two_money_sentences_is_closer_than_in_a_river_sentence(minilm):
    money_1, money_2, river = (minilm.run(text) for text in (MONEY_1, MONEY_2, RIVER))
    bank_1, bank_2, bank_river = (run.word_vector("bank") for run in (money_1, money_2, river))
    money_pair = F.cosine_similarity(bank_1, bank_2, dim=0)
    mixed_pair = F.cosine_similarity(bank_1, bank_river, dim=0)
    assert money_pair > mixed_pair + 0.05


def test_a_last_layer_head_weighs_deposit_and_money_for_bank(minilm):
    run = minilm.run(MONEY_1)
    bank = run.token_index("bank")
    content = [i for i, word in enumerate(run.word_ids) if word is not None and i != bank]
    top_words_per_head = []
    for head in range(run.n_heads):
        trace = run.trace(-1, head)
        ones = torch.ones(len(run.tokens))
        torch.testing.assert_close(trace.weights.sum(-1), ones, atol=1e-6, rtol=0)  # float32
        torch.testing.assert_close(trace.weights, run.attention(-1, head), atol=0, rtol=0)
        row = trace.weights[bank, content]
        top_words_per_head.append({run.tokens[content[i]] for i in row.topk(2).indices})
    assert {"deposit", "money"} in top_words_per_head


def test_run_gives_tokens_words_and_states(minilm):
    run = minilm.run("The river-bank's tokenizer, café!")
    assert run.tokens[0] == "[CLS]" and run.tokens[-1] == "[SEP]"
    assert run.word_ids[0] is None and run.word_ids[-1] is None
    assert [word.text for word in run.words] == [
        "The",
        "river",
        "-",
        "bank's",
        "tokenizer",
        ",",
        "café",
        "!",
    ]
    tokenizer_pieces = run.word_tokens("tokenizer")
    assert [run.tokens[i] for i in tokenizer_pieces] == ["token", "##izer"]
    assert run.text[slice(*run.offsets[run.token_index("CAFÉ")])] == "café"
    assert run.hidden_states.shape == (7, len(run.tokens), 384)
    assert run.attention(0).shape == (12, len(run.tokens), len(run.tokens))
    trace = run.trace(2)
    assert trace.query.shape == (12, len(run.tokens), 32)
    expected = run.hidden_states[3, tokenizer_pieces.start : tokenizer_pieces.stop].mean(0)
    torch.testing.assert_close(  # float32 mean of two pieces' states, 1e-6
        run.word_vector("tokenizer", layer=3), expected, atol=1e-6, rtol=0
    )
    span = run.word_tokens((4, 9))  # "river" by characters
    assert [run.tokens[i] for i in span] == ["river"]
    assert len(run.captures) == 6


def test_run_refuses_what_it_cannot_do(minilm):
    run = minilm.run(MONEY_1)
    with pytest.raises(IndexError, match=r"layers 0\.\.5"):
        run.attention(6)
    with pytest.raises(IndexError, match=r"heads 0\.\.11"):
        run.attention(0, 12)
    with pytest.raises(IndexError, match=r"0 \(embeddings\)\.\.6"):
        run.word_vector("bank", layer=7)
    with pytest.raises(IndexError, match=r"0 \(embeddings\)\.\.6"):  # one before -7
        run.word_vector("bank", layer=-8)
    # Both ends of the range are taken: -7 counts back to the embeddings (hidden state 0), 6
    # is the last block's output ("bank" is one token: its vector is its state, exactly).
    bank = run.token_index("bank")
    assert torch.equal(run.word_vector("bank", layer=-7), run.hidden_states[0, bank])
    assert torch.equal(run.word_vector("bank", layer=6), run.hidden_states[6, bank])
    with pytest.raises(SelfAttnError, match="the words are: I, went, to, the, bank"):
        run.word_vector("river")
    with pytest.raises(SelfAttnError, match="occurs 1 time"):
        run.token_index("bank", occurrence=1)
    with pytest.raises(SelfAttnError, match="empty"):
        minilm.run("   \n")
    for invisible in ("\u0000", "\u200b\u200b", "\x07 \u200b"):  # the tokenizer drops them all
        with pytest.raises(SelfAttnError, match="reads nothing in the text"):
            minilm.run(invisible)
    with pytest.raises(SelfAttnError, match="truncate=True"):
        minilm.run("word " * 600)
    with pytest.raises(SelfAttnError, match=r"one text \(a str\), got list; .*model.encode"):
        minilm.run([MONEY_1, RIVER])
    with pytest.raises(TypeError, match=r"None for every head .*; got 'mean'"):
        run.attention(0, "mean")
    with pytest.raises(SelfAttnError, match="decoder"):
        minilm.generate("hello")
    with pytest.raises(SelfAttnError, match="batch_size must be a whole number >= 1, got 0"):
        minilm.encode(["hello"], batch_size=0)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"dtype": "int8"}, "dtype must be a floating-point torch dtype"),
        ({"dtype": torch.int64}, "dtype must be a floating-point torch dtype"),
        ({"device": "tpu9"}, "unknown device 'tpu9'"),
        pytest.param(
            {"device": "cuda"}, "sees no CUDA GPU", marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="a GPU is there: cuda is a valid device"
            ),
        ),
    ],
)  # fmt: skip
def test_load_refuses_a_dtype_or_device_it_cannot_use(options, message):
    with pytest.raises(SelfAttnError, match=message) as error:
        selfattn.load("minilm", **options)
    assert "\n" not in str(error.value)


def test_load_takes_a_dtype_by_name():
    model = selfattn.load("minilm", dtype="bfloat16")
    assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}


def test_a_run_and_its_recording_print_as_short_lines(minilm):
    run = minilm.run(MONEY_1)
    assert repr(run) == (
        "Run('all-MiniLM-L6-v2', 'I went to th...eposit money.': 11 tokens, 6 layers x 12 heads)"
    )
    assert repr(run.captures) == "Recording(6 calls of 6 attention layers)"
    assert repr(run.captures[0]) == (
        "Capture('blocks.0.attention', layer=0, query=(1, 12, 11, 32), key=(1, 12, 11, 32), "
        "value=(1, 12, 11, 32), mask=None, causal=False, similarity='dot')"
    )


def test_negative_head_counts_from_the_end(minilm):
    run = minilm.run(MONEY_1)
    assert run.attention(0, -1).shape == (len(run.tokens), len(run.tokens))
    assert torch.equal(run.attention(0, -1), run.attention(0, run.n_heads - 1))
    assert torch.equal(run.attention(-1, -12), run.attention(5, 0))
    with pytest.raises(IndexError, match=r"heads 0\.\.11"):
        run.attention(0, -13)


def test_run_truncates_when_asked(minilm):
    run = minilm.run("word " * 600, truncate=True)
    assert len(run.tokens) == 512
    assert run.tokens[-1] == "[SEP]"
    assert len(run.words) == 510


def test_backend_reaches_every_attention_module():
    model = selfattn.load("minilm", backend="explicit")
    backends = {m.backend for m in model.modules() if isinstance(m, selfattn.MultiHeadAttention)}
    assert backends == {"explicit"}
    with pytest.raises(SelfAttnError, match="unknown attention backend 'nope'"):
        model.set_backend("nope")


SHOW_IN_A_BROWSER = """
import webbrowser
import selfattn
webbrowser.open = lambda url: print(url)
selfattn.load("minilm").run("Un caf\\u00e9, tr\\u00e8s bien \\u65e5\\u672c").show(word="caf\\u00e9")
"""


def test_show_writes_the_page_in_utf8_whatever_the_locale(tmp_path):
    """Without IPython, show() opens the page from a file: UTF-8 even in an ASCII locale."""
    env = {**os.environ, "LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0",
           "PYTHONCOERCECLOCALE": "0", "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)}  # fmt: skip
    shown = subprocess.run(
        [sys.executable, "-c", SHOW_IN_A_BROWSER],
        env=env, capture_output=True, text=True, encoding="utf-8", timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    page = Path(shown.stdout.strip().removeprefix("file://")).read_text(encoding="utf-8")
    assert page.startswith("<iframe srcdoc=") and "日" in page


def fake_ipython(monkeypatch, kernel: bool) -> list:
    """IPython as a Jupyter kernel (a shell with a kernel) or a plain script has it (no
    shell); returns what ``display`` receives."""
    shown = []
    shell = SimpleNamespace(kernel=object()) if kernel else None
    ipython = ModuleType("IPython")
    ipython.get_ipython = lambda: shell
    display = ModuleType("IPython.display")
    display.HTML = lambda page: page
    display.display = lambda *objects, **options: shown.append((objects, options))
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    return shown


@pytest.mark.parametrize("kernel", [True, False])
def test_show_displays_in_a_notebook_and_opens_a_browser_elsewhere(
    minilm, monkeypatch, tmp_path, kernel
):
    """IPython installed is not a notebook: a script's display() would only print
    "<IPython.core.display.HTML object>"."""
    shown = fake_ipython(monkeypatch, kernel)
    opened = []
    monkeypatch.setattr("webbrowser.open", opened.append)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    run = minilm.run(MONEY_1)
    run.show(word="bank")
    if kernel:  # the raw HTML: IPython's HTML() warns about an <iframe>
        assert shown == [(({"text/html": run.html(word="bank")},), {"raw": True})]
        assert opened == []
    else:
        assert shown == [] and len(opened) == 1 and opened[0].startswith("file://")


def test_loading_and_running_a_model_imports_no_compiler():
    """Building the network on the meta device ran nn.Embedding's random init, whose meta
    version imports torch._dynamo: 1 to 2 s of every load, for numbers the checkpoint then
    replaced. The fills are skipped; loading and running the default model import neither
    torch._dynamo nor matplotlib."""
    code = (
        "import sys, selfattn; selfattn.load().run('I went to the bank'); "
        "print([name for name in ('torch._dynamo', 'matplotlib') if name in sys.modules])"
    )
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.stdout.strip() == "[]", result.stderr


def test_token_inputs_on_another_device_or_without_tokens_get_one_line(minilm):
    """Before: ids on the CPU for a model elsewhere ran on (a meta model silently gave meta
    outputs; a GPU one fails deep in an index_select), and a (1, 0) batch failed with
    "index 0 is out of bounds for dimension 1 with size 0" in the pooler."""
    ids = torch.tensor([minilm.tokenizer.encode(MONEY_1).ids])
    with pytest.raises(SelfAttnError, match=r"input_ids have no tokens \(shape \(1, 0\)\); "):
        minilm(ids[:, :0])
    assert minilm(ids[:0]).last_hidden_state.shape == (0, ids.shape[1], 384)  # an empty batch
    with pytest.raises(SelfAttnError, match=r"attention_mask is on meta but input_ids are on cpu"):
        minilm(ids, torch.ones_like(ids, device="meta"))
    away = selfattn.load("minilm", device="meta")
    with pytest.raises(SelfAttnError, match=r"input_ids is on cpu but the model is on meta; "):
        away(ids)


def test_a_whole_model_compiles_with_fullgraph_and_runs_after_compile():
    """Before: torch.compile(model, fullgraph=True) failed on the token ids' range check (a
    data-dependent int()), and after model.compile() run() recorded nothing and failed with
    "list index out of range". Compiled outputs equal eager ones within 1e-5; run() after
    compile() runs eager and gives the uncompiled model's weights exactly."""
    model = selfattn.load("minilm")
    ids = torch.tensor([model.tokenizer.encode(MONEY_1).ids])
    with torch.no_grad():
        expected = model(ids).last_hidden_state
        compiled = torch.compile(model, fullgraph=True, backend="eager")(ids).last_hidden_state
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=0)
    before = model.run(MONEY_1).attention(5, 7)
    model.compile(backend="eager")
    assert torch.equal(model.run(MONEY_1).attention(5, 7), before)


def test_encode_refuses_what_is_not_text_in_one_line(minilm):
    """Before: TypeError "'int' object is not iterable", the tokenizer's "TextEncodeInput must
    be Union[...]" and "'float' object cannot be interpreted as an integer"."""
    for texts, got in [
        (7, "int"),
        ([1, 2], "list holding int"),
        (["a", None], "list holding NoneType"),
    ]:
        with pytest.raises(SelfAttnError, match=f"encode takes a str or a list of str, got {got}"):
            minilm.encode(texts)
    with pytest.raises(SelfAttnError, match=r"batch_size must be a whole number >= 1, got 2\.5"):
        minilm.encode(["hello"], batch_size=2.5)
    assert minilm.encode(("a", "b")).shape == (2, 384)  # any iterable of str will do


def test_show_says_where_the_page_is_when_no_browser_opens(minilm, monkeypatch, tmp_path, capsys):
    """Before: with no browser (a server, a container) show() wrote a file and said nothing."""
    monkeypatch.setattr("webbrowser.open", lambda url: False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    minilm.run(MONEY_1).show()
    note = capsys.readouterr().err
    assert (
        note.startswith("note: no web browser to open here; the page is ") and note.count("\n") == 1
    )
    (page,) = tmp_path.glob("*.html")
    assert str(page) in note


def test_runs_and_recordings_compare_by_identity(minilm):
    """Before: `capture in captures`, `rec == other` and `runs.index(run)` on two runs of one
    text raised torch's "Boolean value of Tensor with more than one value is ambiguous"
    (dataclass equality compared their tensors), and a Recording was unhashable."""
    first, second = minilm.run(MONEY_1), minilm.run(MONEY_1)
    assert [first, second].index(second) == 1 and first != second
    assert second.captures[0] not in list(first.captures) and first.captures != second.captures
    assert len({first, second, first.captures, second.captures}) == 4


def test_a_loaded_model_deep_copies_and_pickles():
    """copy.deepcopy and pickle of a loaded model failed on its tokenizer's lock ("cannot
    pickle '_thread.lock' object"); each copy now runs as the original does, exactly."""
    import copy
    import pickle

    model = selfattn.load()
    expected = model.run("I went to the bank").hidden_states[-1]
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert copied.tokenizer._lock is not model.tokenizer._lock
        torch.testing.assert_close(
            copied.run("I went to the bank").hidden_states[-1], expected, atol=0, rtol=0
        )
