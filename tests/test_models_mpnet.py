"""MPNet (all-mpnet-base-v2's architecture) on the one Bert network, with its relative position
bias: randomly initialised Hugging Face models (initializer_range 0.2), saved by
``save_pretrained``.

Tolerances (float32), against Hugging Face's eager path on a padded batch, padding tokens
included: every layer's hidden states 1e-4 absolute, every layer's and head's attention
weights (recomputed from the recorded q, k, v and position bias) 1e-5 absolute, the pooler
1e-4. The relative position buckets equal transformers' exactly, for distances up to 299.
``encode`` against sentence-transformers on the same folder: cosine >= 0.99999 per sentence.
The offline page carries the bias as its (H, 32) table, float32, from which chromium builds
the model's bias exactly at every distance up to 511 either way; its weights, recomputed in
chromium in float64, equal ``run.attention`` to 1e-6 absolute.
The name map is checked key by key and shape by shape against the state dict.
"""

import base64
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import selfattn
from conftest import OfflinePage, randomise_norms
from selfattn.cli import app
from selfattn.errors import SelfAttnError
from selfattn.explain import explain_text
from selfattn.models.bert import Bert, relative_buckets
from selfattn.models.hf_config import mpnet_config
from selfattn.models.name_maps import ARCHITECTURES, mpnet_rules
from selfattn.recording import record
from selfattn.viz import html, report
from selfattn.viz.html import render_page
from test_browser import step_biases
from test_generation_view import in_chromium
from test_models_encoders import (  # noqa: F401 (bpe_tokenizer: a fixture)
    BPE_VOCAB,
    SIZES,
    add_tokenizer,
    batch_attention,
    bpe_tokenizer,
    padded_batch,
)
from test_models_random import CORPUS, assert_map_fits

transformers = pytest.importorskip("transformers")

MAX_POSITIONS = 40  # 38 tokens: positions count from padding id 1 + 1
CHECKPOINTS = [
    ("MPNetModel", ()),
    ("MPNetForMaskedLM", ("lm_head.*",)),
    ("MPNetForSequenceClassification", ("classifier.*",)),
]
TEXT = "I went to the bank to deposit money."


def mpnet_config_hf(**options) -> object:
    return transformers.MPNetConfig(
        vocab_size=BPE_VOCAB,
        hidden_size=48,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.2,
        attn_implementation="eager",
        **SIZES | options,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory, bpe_tokenizer):  # noqa: F811 (the imported fixture)
    """Saved checkpoints by Hugging Face class name: (folder, the model in memory)."""
    cache = {}

    def save(class_name: str):
        if class_name not in cache:
            torch.manual_seed(0)
            hf = getattr(transformers, class_name)(mpnet_config_hf()).eval()
            randomise_norms(hf)  # not all 1: a swapped or misplaced LayerNorm shows
            folder = tmp_path_factory.mktemp(class_name)
            hf.save_pretrained(folder)
            add_tokenizer(folder, "bpe", bpe_tokenizer)
            cache[class_name] = folder, hf
        return cache[class_name]

    return save


def test_relative_buckets_equal_transformers():
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    position = torch.arange(300)
    distance = position[None, :] - position[:, None]  # key minus query, as transformers has it
    theirs = MPNetEncoder.relative_position_bucket(distance)
    torch.testing.assert_close(relative_buckets(300), theirs, atol=0, rtol=0)


@pytest.mark.parametrize(("class_name", "heads"), CHECKPOINTS)
def test_checkpoint_matches_hugging_face_in_a_padded_batch(saved, class_name, heads):
    folder, hf = saved(class_name)
    model = selfattn.load(folder)
    assert (model.config.kind, model.config.model_type) == ("encoder", "mpnet")
    assert model.config.skipped == heads
    input_ids, mask = padded_batch(hf.config)
    with torch.no_grad(), record(model.network) as recording:
        ours = model(input_ids, mask)
    with torch.no_grad():
        theirs = hf.base_model(
            input_ids, attention_mask=mask, output_hidden_states=True, output_attentions=True
        )
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 4
    for mine, hf_state in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(mine, hf_state, atol=1e-4, rtol=0)
    for mine, hf_weights in zip(batch_attention(recording, 3), theirs.attentions, strict=True):
        torch.testing.assert_close(mine, hf_weights, atol=1e-5, rtol=0)
    has_pooler = theirs.pooler_output is not None
    assert (model.network.pooler is not None) == has_pooler
    if has_pooler:
        torch.testing.assert_close(ours.pooler_output, theirs.pooler_output, atol=1e-4, rtol=0)


def test_name_map_covers_the_state_dict_with_matching_shapes(saved):
    folder, hf = saved("MPNetModel")
    config = mpnet_config(json.loads((folder / "config.json").read_text()), pooler=True)
    assert config.type_vocab_size == 0 and config.relative_attention_buckets == 32
    theirs = {
        name: tensor
        for name, tensor in hf.state_dict().items()
        if not name.endswith(ARCHITECTURES["mpnet"].ignored_suffixes)
    }
    assert "encoder.relative_attention_bias.weight" in theirs
    assert_map_fits(
        mpnet_rules(config.n_layers, pooler=True), theirs, dict(Bert(config).named_parameters())
    )


def test_run_and_explain_recompute_the_weights_with_the_bias(saved):
    """run.attention equals Hugging Face's weights; explain's steps carry the bias, and its
    weights are softmax(scaled + bias), not softmax(scaled)."""
    folder, hf = saved("MPNetForMaskedLM")
    model = selfattn.load(folder)
    run, e = explain_text(model, TEXT, word="bank", layer=1, head=2)
    with torch.no_grad():
        theirs = hf.base_model(torch.tensor([run.token_ids]), output_attentions=True)
    for layer, attention in enumerate(theirs.attentions):
        torch.testing.assert_close(run.attention(layer), attention[0], atol=1e-5, rtol=0)
    bias = model.network.position_bias(len(run.tokens))[0, 2, e.query]
    torch.testing.assert_close(e.steps.bias, bias)
    torch.testing.assert_close(e.steps.weights, torch.softmax(e.steps.scaled + bias, -1))
    assert not torch.allclose(e.steps.weights, torch.softmax(e.steps.scaled, -1), atol=1e-3)
    torch.testing.assert_close(e.steps.weights, theirs.attentions[1][0, 2, e.query])
    result = e.to_json()
    torch.testing.assert_close(torch.tensor(result["bias"]), bias)


def test_encode_equals_sentence_transformers(saved, tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Pooling, Transformer
    folder, _ = saved("MPNetModel")
    body = Transformer(str(folder), max_seq_length=32)
    reference = sentence_transformers.SentenceTransformer(
        modules=[body, Pooling(48, "mean")], device="cpu"
    )
    reference.save(str(tmp_path))
    assert (tmp_path / "modules.json").is_file() and (tmp_path / "1_Pooling").is_dir()
    texts = [*CORPUS, "The bank.", "Ciao gioco a giochi " * 10]  # the last one cut to 32
    theirs = reference.encode(texts, convert_to_tensor=True, normalize_embeddings=True)
    model = selfattn.load(tmp_path)
    assert model.config.model_type == "mpnet" and model.sentence.max_seq_length == 32
    ours = model.encode(texts, batch_size=3)
    assert F.cosine_similarity(ours, theirs).min() >= 0.99999


def test_reads_its_positions_less_the_padding_offset(saved):
    """max_position_embeddings 40, padding id 1: 38 tokens at most, as in Hugging Face, which
    fails one token later (its position 40 is past the table)."""
    folder, hf = saved("MPNetModel")
    model = selfattn.load(folder)
    usable = MAX_POSITIONS - 2
    assert model.config.max_positions == usable
    longest = "bank"
    while model.tokenizer.count(longest) < usable:  # one token per " bank"
        longest += " bank"
    run = model.run(longest)
    assert len(run.tokens) == usable
    with torch.no_grad():
        theirs = hf(torch.tensor([run.token_ids]), output_hidden_states=True)
    torch.testing.assert_close(
        run.hidden_states[-1], theirs.last_hidden_state[0], atol=1e-4, rtol=0
    )
    too_long = longest + " bank"
    with pytest.raises(
        SelfAttnError, match=rf"is {usable + 1} tokens but .* at most {usable};"
    ) as error:
        model.run(too_long)
    assert "\n" not in str(error.value)
    with pytest.raises((IndexError, RuntimeError), match="out of"):  # past the table
        hf(torch.tensor([model.tokenizer.encode(too_long).ids]))


def test_too_few_buckets_are_refused_in_one_line(tmp_path):
    torch.manual_seed(0)
    transformers.MPNetModel(mpnet_config_hf()).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"relative_attention_num_buckets": 16}))
    with pytest.raises(
        SelfAttnError, match=r"^unsupported relative_attention_num_buckets 16 in config.json;"
    ) as error:
        selfattn.load(tmp_path)
    assert "\n" not in str(error.value)


def test_cli_explains_a_word_with_the_bias_column(saved):
    folder, _ = saved("MPNetForSequenceClassification")
    args = ["explain", TEXT, "--model", str(folder), "--word", "bank"]
    result = CliRunner().invoke(app, [*args, "--layer", "0", "--head", "1"])
    assert result.exit_code == 0, result.output
    assert "bank" in result.stdout and "deposit" in result.stdout
    assert "plus the position bias" in result.stdout and "+ bias" in result.stdout
    assert "softmax(scaled + bias)" in result.stdout
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "classification head (classifier.*)" in notes[0], notes
    as_json = CliRunner().invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    result = json.loads(as_json.stdout)
    weights = torch.softmax(torch.tensor(result["scaled"]) + torch.tensor(result["bias"]), -1)
    torch.testing.assert_close(weights, torch.tensor(result["weights"]))


def test_bert_shows_no_bias():
    """A model without a position bias: no "+ bias" column, no "bias" in its JSON, a page
    payload with bias null and its thumbnails run.attention as before."""
    run, e = explain_text(selfattn.load("minilm"), TEXT, word="bank")
    assert e.steps.bias is None and "bias" not in e.to_json()
    data = report.page_data(run, e)
    assert data["model"] == e.model and data["bias"] is None and data["dtype"] == "float32"
    assert_thumbnails_are_run_attention(run, data)


def thumbnails(data: dict) -> np.ndarray:
    """The payload's thumbnails, (L, H, n, n) uint8."""
    n = data["thumbnails"]["size"]
    grid = np.frombuffer(base64.b64decode(data["thumbnails"]["data"]), dtype=np.uint8)
    return grid.reshape(data["layers"], data["heads"], n, n)


def assert_thumbnails_are_run_attention(run, data: dict) -> None:
    """T <= 48, one cell per weight: each head's run.attention scaled to 255, within one step."""
    grid = thumbnails(data)
    assert grid.shape[-1] == len(run.tokens)
    for layer in range(data["layers"]):
        weights = run.attention(layer)  # (H, T, T)
        peak = weights.amax(dim=(-2, -1), keepdim=True)
        np.testing.assert_allclose(grid[layer], (weights / peak * 255).round().numpy(), atol=1)


def mpnet_page(saved) -> tuple:
    """(run, page payload) of TEXT on the bare MPNet, opened on layer 1, head 2, "bank"."""
    folder, _ = saved("MPNetModel")
    run, e = explain_text(selfattn.load(folder), TEXT, word="bank", layer=1, head=2)
    return run, report.page_data(run, e)


def test_the_page_carries_the_bias_as_its_table_and_its_thumbnails_add_it(saved):
    """Every layer adds the same (1, H, T, T) tensor: the payload carries its (H, 32) table,
    float32, exactly the model's numbers for the buckets these T tokens reach (0 for the
    others), and looked up with transformers' bucket function it is the recorded mask,
    exactly; the thumbnails are run.attention's weights (bias included), far from the
    weights without it."""
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    run, data = mpnet_page(saved)
    n = len(run.tokens)
    mask = run.captures[0].mask
    assert all(capture.mask.data_ptr() == mask.data_ptr() for capture in run.captures)
    assert data["dtype"] == "float32" and data["bias"]["table"]["shape"] == [4, 32]
    assert (data["bias"]["buckets"], data["bias"]["max_distance"]) == (32, 128)
    table = np.frombuffer(base64.b64decode(data["bias"]["table"]["data"]), dtype="<f4")
    table = torch.from_numpy(table.reshape(4, 32).copy())
    position = torch.arange(n)
    buckets = MPNetEncoder.relative_position_bucket(position[None, :] - position[:, None])
    torch.testing.assert_close(table[:, buckets], mask[0], atol=0, rtol=0)
    reached = torch.zeros(32, dtype=torch.bool).index_fill(0, buckets.flatten(), True)
    model_table = selfattn.load(saved("MPNetModel")[0]).network.position_bias.embedding.weight.T
    torch.testing.assert_close(table, model_table.detach() * reached, atol=0, rtol=0)
    assert_thumbnails_are_run_attention(run, data)
    unbiased = torch.stack([replace(c, mask=None).weights() for c in run.captures])
    peak = unbiased.amax(dim=(-2, -1), keepdim=True)
    assert np.abs(thumbnails(data) - (unbiased / peak * 255).round().numpy()).max() > 20


def test_page_bias_is_stored_per_layer_only_where_layers_differ(saved):
    """An equal copy still travels once; a layer with another bias, or none (zeros), makes
    it (L, H, T, T)."""
    run, _ = mpnet_page(saved)
    calls = list(run.captures)
    mask = calls[0].mask
    copied = [calls[0], replace(calls[1], mask=mask.clone()), calls[2]]
    torch.testing.assert_close(report.page_bias(copied), mask[0], atol=0, rtol=0)
    differ = [calls[0], replace(calls[1], mask=mask + 1), replace(calls[2], mask=None)]
    expected = torch.stack([mask[0], mask[0] + 1, torch.zeros_like(mask[0])])
    torch.testing.assert_close(report.page_bias(differ), expected, atol=0, rtol=0)
    assert report.page_bias([replace(call, mask=None) for call in calls]) is None


@in_chromium
def test_the_pages_weights_add_the_bias_and_its_steps_show_it(saved, browser, tmp_path):
    """In chromium, the page's weights of "bank" in layer 1, head 2 and for the mean of heads
    equal run.attention's to 1e-6 (float64 from the float32 q, k, bias); the step panel has
    a "+ bias" column of the recorded bias, exactly, and says weight = softmax(scaled + bias)."""
    run, data = mpnet_page(saved)
    path = tmp_path / "mpnet.html"
    path.write_text(render_page(data), encoding="utf-8")
    watched = OfflinePage(browser, path)
    query = data["selection"]["query"]
    headers = watched.page.eval_on_selector_all(
        "#steps th", "(ths) => ths.map((th) => th.textContent)"
    )
    assert headers == ["key", "score", "scaled", "+ bias", "weight"]  # the bars' column: no header
    assert "+ bias" in watched.page.text_content("ol.steps")
    assert "softmax(scaled + bias)" in watched.page.text_content("#step-note")
    rows = sorted(watched.step_rows(), key=lambda row: row["key"])
    expected = run.attention(1, 2)[query]
    assert [row["weight"] for row in rows] == pytest.approx(expected.tolist(), abs=1e-6)
    assert step_biases(watched) == run.captures[1].mask[0, 2, query].tolist()
    watched.page.select_option("#head", "mean")
    rows = sorted(watched.step_rows(), key=lambda row: row["key"])
    expected = run.attention(1).mean(0)[query]
    assert [row["weight"] for row in rows] == pytest.approx(expected.tolist(), abs=1e-6)
    watched.check_clean()


@pytest.mark.parametrize("command", ["explain", "view"])
def test_explain_html_and_view_write_the_page_with_the_bias(saved, tmp_path, command):
    folder, _ = saved("MPNetModel")
    page = tmp_path / "bank.html"
    options = ["--word", "bank", "--html"] if command == "explain" else ["-o"]
    result = CliRunner().invoke(app, [command, TEXT, "--model", str(folder), *options, str(page)])
    assert result.exit_code == 0, result.output
    assert '"bias":{"buckets":32,"max_distance":128,"table":{"shape":[4,32],' in page.read_text(
        encoding="utf-8"
    )


@in_chromium
def test_a_512_token_page_adds_the_models_bias_at_every_distance(
    browser,
    bpe_tokenizer,  # noqa: F811 (the imported fixture)
    tmp_path,
):
    """The page computes MPNet's bias from its table and its own bucket function: for query 0
    (keys 0..511 after it) and query 511 (keys 511..0 before it), so every relative position
    up to 511 either way, the step panel's "+ bias" is the Hugging Face model's table looked
    up with transformers' relative_position_bucket, exactly (float32 numbers, read as
    float64); the weights equal run.attention's to 1e-6."""
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    torch.manual_seed(0)
    config = mpnet_config_hf()
    config.max_position_embeddings = 514  # all-mpnet-base-v2's: 512 tokens
    hf = transformers.MPNetModel(config).eval()
    hf.save_pretrained(tmp_path / "mpnet")
    add_tokenizer(tmp_path / "mpnet", "bpe", bpe_tokenizer)
    run, e = explain_text(selfattn.load(tmp_path / "mpnet"), TEXT * 100, truncate=True)
    assert len(run.tokens) == 512
    path = tmp_path / "mpnet.html"
    path.write_text(render_page(report.page_data(run, e)), encoding="utf-8")
    table = hf.encoder.relative_attention_bias.weight.detach()  # (32, H)
    position = torch.arange(512)
    buckets = MPNetEncoder.relative_position_bucket(position[None, :] - position[:, None])
    for query in (0, 511):
        watched = OfflinePage(browser, path, f"#layer=1&head=2&query={query}")
        assert step_biases(watched) == table[buckets[query], 2].tolist()
        rows = sorted(watched.step_rows(), key=lambda row: row["key"])
        expected = run.attention(1, 2)[query]
        assert [row["weight"] for row in rows] == pytest.approx(expected.tolist(), abs=1e-6)
        watched.check_clean()


@in_chromium
def test_a_float16_page_keeps_the_bias_exact(saved, browser, tmp_path, monkeypatch):
    """q, k and v as float16 (a long text's page) leave MPNet's table float32: the "+ bias"
    column is still the recorded bias, exactly, and the note names only q, k and v."""
    monkeypatch.setattr(html, "FLOAT32_LIMIT_BYTES", 0)
    run, data = mpnet_page(saved)
    assert data["dtype"] == "float16"
    path = tmp_path / "mpnet.html"
    path.write_text(render_page(data), encoding="utf-8")
    watched = OfflinePage(browser, path)
    query = data["selection"]["query"]
    assert step_biases(watched) == run.captures[1].mask[0, 2, query].tolist()
    assert "q, k and v came as float16" in watched.page.text_content("#step-note")
    watched.check_clean()
