"""RoBERTa, XLM-RoBERTa and DistilBERT, and fine-tuned BERT-family checkpoints with their task
heads, load onto the one Bert network: randomly initialised Hugging Face models, saved by
``save_pretrained``.

Tolerances (float32), against Hugging Face's eager path on a padded batch, padding tokens
included (RoBERTa's positions are numbered as transformers numbers them): every layer's hidden
states 1e-4 absolute, every layer's and head's attention weights 1e-5 absolute, the pooler 1e-4.
``encode`` against sentence-transformers on the same folder: cosine >= 0.99999 per sentence.
The name maps are checked key by key and shape by shape against the state dicts.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn
from typer.testing import CliRunner

import selfattn
from conftest import randomise_norms
from selfattn.cli import app
from selfattn.errors import SelfAttnError
from selfattn.models.bert import Bert
from selfattn.models.hf_config import distilbert_config, roberta_config
from selfattn.models.loading import resolve, skipped_note
from selfattn.models.model import pool
from selfattn.models.name_maps import ARCHITECTURES, bert_rules, distilbert_rules
from selfattn.recording import record
from test_models_random import CORPUS, assert_map_fits

transformers = pytest.importorskip("transformers")

BPE_VOCAB = 300
BPE_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # RoBERTa's ids 0..4
SIZES = {"num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 71}


def roberta_like(config_class, max_positions: int) -> object:
    return config_class(
        vocab_size=BPE_VOCAB,
        hidden_size=48,
        max_position_embeddings=max_positions,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        initializer_range=0.2,
        attn_implementation="eager",
        **SIZES,
    )


def distilbert(**options) -> object:
    return transformers.DistilBertConfig(
        vocab_size=30522,  # MiniLM's word-piece vocabulary
        dim=48,
        n_layers=3,
        n_heads=4,
        hidden_dim=71,
        max_position_embeddings=40,
        initializer_range=0.2,
        attn_implementation="eager",
        **options,
    )


def bert() -> object:
    return transformers.BertConfig(
        vocab_size=97, hidden_size=48, max_position_embeddings=40, initializer_range=0.2,
        attn_implementation="eager", **SIZES,
    )  # fmt: skip


FAMILIES = {  # family -> (its config, its tokenizer: "bpe", "wordpiece" or None)
    "roberta": (lambda: roberta_like(transformers.RobertaConfig, 40), "bpe"),
    "xlm-roberta": (lambda: roberta_like(transformers.XLMRobertaConfig, 34), "bpe"),
    "distilbert": (distilbert, "wordpiece"),
    "bert": (bert, None),
}
# Each family's Hugging Face classes, and the heads loading skips from their checkpoints.
CHECKPOINTS = [
    ("roberta", "RobertaModel", ()),
    ("roberta", "RobertaForSequenceClassification", ("classifier.*",)),
    ("roberta", "RobertaForMaskedLM", ("lm_head.*",)),
    ("roberta", "RobertaForQuestionAnswering", ("qa_outputs.*",)),
    ("roberta", "RobertaForTokenClassification", ("classifier.*",)),
    ("xlm-roberta", "XLMRobertaModel", ()),
    ("xlm-roberta", "XLMRobertaForSequenceClassification", ("classifier.*",)),
    ("xlm-roberta", "XLMRobertaForMaskedLM", ("lm_head.*",)),
    ("distilbert", "DistilBertModel", ()),
    ("distilbert", "DistilBertForSequenceClassification", ("pre_classifier.*", "classifier.*")),
    (
        "distilbert",
        "DistilBertForMaskedLM",
        ("vocab_transform.*", "vocab_layer_norm.*", "vocab_projector.*"),
    ),
    ("distilbert", "DistilBertForQuestionAnswering", ("qa_outputs.*",)),
    ("distilbert", "DistilBertForTokenClassification", ("classifier.*",)),
    ("bert", "BertForSequenceClassification", ("classifier.*",)),
    ("bert", "BertForTokenClassification", ("classifier.*",)),
    ("bert", "BertForQuestionAnswering", ("qa_outputs.*",)),
    ("bert", "BertForMaskedLM", ("cls.*",)),
]


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    """A small byte-level BPE with RoBERTa's specials and post-processor (<s> ... </s>)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=BPE_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    assert [tokenizer.token_to_id(token) for token in BPE_SPECIALS] == [0, 1, 2, 3, 4]
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def add_tokenizer(folder, kind, bpe_tokenizer) -> None:
    """The family's tokenizer files, readable by us and by transformers' AutoTokenizer."""
    if kind == "bpe":
        shutil.copy(bpe_tokenizer, folder / "tokenizer.json")
        settings = dict(zip(("bos_token", "pad_token", "eos_token", "unk_token", "mask_token"),
                            BPE_SPECIALS, strict=True))  # fmt: skip
        settings["tokenizer_class"] = "PreTrainedTokenizerFast"
        (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    elif kind == "wordpiece":
        minilm, _ = resolve("minilm")
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
            shutil.copy(minilm / name, folder / name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, bpe_tokenizer):
    """Saved checkpoints by Hugging Face class name: (folder, the model in memory)."""
    cache = {}

    def save(family: str, class_name: str):
        if class_name not in cache:
            make_config, tokenizer = FAMILIES[family]
            torch.manual_seed(0)
            hf = getattr(transformers, class_name)(make_config()).eval()
            randomise_norms(hf)  # not all 1: a misplaced or swapped LayerNorm shows
            folder = tmp_path_factory.mktemp(class_name)
            hf.save_pretrained(folder)
            add_tokenizer(folder, tokenizer, bpe_tokenizer)
            cache[class_name] = folder, hf
        return cache[class_name]

    return save


def padded_batch(hf_config, length: int = 17) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of random ids (no special ids), the second padded with the pad id."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, hf_config.vocab_size, (3, length), generator=generator)
    mask = torch.ones(3, length, dtype=torch.long)
    mask[1, 11:] = 0
    input_ids[1, 11:] = hf_config.pad_token_id
    return input_ids, mask


def batch_attention(recording, batch_size: int) -> list[torch.Tensor]:
    """Each layer's weights (B, H, T, T), recomputed from the recorded q, k, v."""
    return [
        torch.stack([capture.weights(batch=b) for b in range(batch_size)]) for capture in recording
    ]


@pytest.mark.parametrize(("family", "class_name", "heads"), CHECKPOINTS)
def test_checkpoint_matches_hugging_face_in_a_padded_batch(saved, family, class_name, heads):
    folder, hf = saved(family, class_name)
    model = selfattn.load(folder)
    encoder = hf.base_model
    assert (model.config.kind, model.config.model_type) == ("encoder", family)
    assert model.config.skipped == heads
    input_ids, mask = padded_batch(hf.config)
    with torch.no_grad(), record(model.network) as recording:
        ours = model(input_ids, mask)
    with torch.no_grad():
        theirs = encoder(
            input_ids, attention_mask=mask, output_hidden_states=True, output_attentions=True
        )
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 4
    for mine, hf_state in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(mine, hf_state, atol=1e-4, rtol=0)
    attentions = batch_attention(recording, 3)
    for mine, hf_weights in zip(attentions, theirs.attentions, strict=True):
        torch.testing.assert_close(mine, hf_weights, atol=1e-5, rtol=0)
    has_pooler = getattr(theirs, "pooler_output", None) is not None
    assert (model.network.pooler is not None) == has_pooler
    if has_pooler:
        torch.testing.assert_close(ours.pooler_output, theirs.pooler_output, atol=1e-4, rtol=0)


def test_a_head_is_named_in_one_line_and_a_bare_model_has_no_note(saved):
    folder, _ = saved("distilbert", "DistilBertForSequenceClassification")
    note = skipped_note(selfattn.load(folder))
    assert note == (
        f"{folder.name}: left out the checkpoint's classification head (pre_classifier.*, "
        "classifier.*), not used here; run, attention and encode show the encoder under it"
    )
    assert skipped_note(selfattn.load(saved("roberta", "RobertaModel")[0])) is None


def test_roberta_run_aligns_byte_level_words_and_equals_hugging_face(saved):
    folder, hf = saved("roberta", "RobertaForSequenceClassification")
    model = selfattn.load(folder)
    run = model.run("I went to the bank, café!")
    assert run.tokens[0] == "<s>" and run.tokens[-1] == "</s>"
    assert run.word_ids[0] is None and run.word_ids[-1] is None
    assert [word.text for word in run.words] == ["I", "went", "to", "the", "bank", ",", "café", "!"]
    assert [run.tokens[i] for i in run.word_tokens("bank")] == [" bank"]
    assert "".join(run.tokens[i] for i in run.word_tokens("café")).startswith(" c")
    with torch.no_grad():
        theirs = hf.base_model(
            torch.tensor([run.token_ids]), output_hidden_states=True, output_attentions=True
        )
    torch.testing.assert_close(
        run.hidden_states, torch.cat(theirs.hidden_states), atol=1e-4, rtol=0
    )
    for layer, attention in enumerate(theirs.attentions):
        torch.testing.assert_close(run.attention(layer), attention[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(run.attention(layer, 2), attention[0, 2], atol=1e-5, rtol=0)


def test_distilbert_run_aligns_word_pieces(saved):
    folder, hf = saved("distilbert", "DistilBertModel")
    run = selfattn.load(folder).run("The tokenizer splits words.")
    assert run.tokens[0] == "[CLS]" and run.tokens[-1] == "[SEP]"
    assert [run.tokens[i] for i in run.word_tokens("tokenizer")] == ["token", "##izer"]
    with torch.no_grad():
        theirs = hf(torch.tensor([run.token_ids]), output_attentions=True)
    torch.testing.assert_close(run.attention(2), theirs.attentions[2][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("family", "class_name", "usable"), [
    ("roberta", "RobertaModel", 38), ("xlm-roberta", "XLMRobertaModel", 32),
])  # fmt: skip
def test_roberta_reads_its_positions_less_the_padding_offset(saved, family, class_name, usable):
    """max_position_embeddings 40 (34) with pad_token_id 1: 38 (32) tokens at most, as in
    Hugging Face, which fails one token later (its position 40 is past the table)."""
    folder, hf = saved(family, class_name)
    model = selfattn.load(folder)
    assert model.config.max_positions == usable
    longest = "bank"
    while model.tokenizer.count(longest) < usable:  # one token per " bank"
        longest += " bank"
    assert model.tokenizer.count(longest) == usable
    run = model.run(longest)
    with torch.no_grad():
        theirs = hf(torch.tensor([run.token_ids]), output_hidden_states=True)
    torch.testing.assert_close(
        run.hidden_states[-1], theirs.last_hidden_state[0], atol=1e-4, rtol=0
    )
    too_long = longest + " bank"
    assert model.tokenizer.count(too_long) == usable + 1
    with pytest.raises(
        SelfAttnError, match=rf"is {usable + 1} tokens but .* at most {usable};"
    ) as error:
        model.run(too_long)
    assert "\n" not in str(error.value)
    assert len(model.run(too_long, truncate=True).tokens) == usable
    with pytest.raises((IndexError, RuntimeError), match="out of"):  # past the table
        hf(torch.tensor([model.tokenizer.encode(too_long).ids]))
    with pytest.raises(ValueError, match=f"longer than the model's {usable} positions"):
        model(torch.full((1, usable + 1), 5))


def test_roberta_numbers_the_positions_of_a_left_padded_row_from_its_first_real_token(saved):
    """RoBERTa's position ids come from where the padding is (transformers'
    create_position_ids_from_input_ids), not from the column: in a row padded on the left the
    first real token is at padding_idx + 1. Every layer's hidden states of the real tokens
    within 1e-5 of Hugging Face's RobertaModel given the same ids and mask."""
    folder, hf = saved("roberta", "RobertaModel")
    model = selfattn.load(folder)
    input_ids, mask = padded_batch(hf.config)
    input_ids[1], mask[1] = input_ids[1].roll(6), mask[1].roll(6)  # 6 pads first
    assert mask[1, :6].eq(0).all() and mask[1, 6:].eq(1).all()
    with torch.no_grad():
        ours = model(input_ids, mask)
        theirs = hf(input_ids, attention_mask=mask, output_hidden_states=True)
    real = mask.bool()
    for mine, hf_state in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(mine[real], hf_state[real], atol=1e-5, rtol=0)


def test_bert_config_without_layer_norm_eps_takes_hugging_faces_default(saved, tmp_path):
    """A BERT config.json without layer_norm_eps means BertConfig's default, 1e-12: every
    LayerNorm's eps equal to it, and every layer's hidden states within 1e-4 of Hugging Face's
    model loaded from the same stripped folder (its defaults the oracle)."""
    folder, _ = saved("bert", "BertForMaskedLM")
    for path in folder.iterdir():
        shutil.copy(path, tmp_path / path.name)
    config = json.loads((folder / "config.json").read_text())
    del config["layer_norm_eps"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = selfattn.load(tmp_path)
    hf = transformers.BertForMaskedLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert hf.config.layer_norm_eps == 1e-12
    eps = {module.eps for module in model.network.modules() if isinstance(module, nn.LayerNorm)}
    assert eps == {1e-12}
    input_ids, mask = padded_batch(hf.config)
    with torch.no_grad():
        ours = model(input_ids, mask)
        theirs = hf.base_model(input_ids, attention_mask=mask, output_hidden_states=True)
    for mine, hf_state in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(mine, hf_state, atol=1e-4, rtol=0)


def test_max_pooling_fills_padding_with_the_lowest_value_not_zero():
    """sentence-transformers' max pooling: padding takes the dtype's lowest value, so rows of
    negative numbers keep their own maximum (a fill of 0 gave 0). Exact, by hand."""
    hidden = torch.full((1, 3, 2), -1.0)
    hidden[0, 2] = 5.0  # the padding token's vector, larger than the real ones
    pooled = pool(hidden, torch.tensor([[1, 1, 0]]), "max_tokens")
    assert torch.equal(pooled, torch.tensor([[-1.0, -1.0]]))


@pytest.mark.parametrize(("family", "class_name"), [
    ("roberta", "RobertaForSequenceClassification"), ("distilbert", "DistilBertForMaskedLM"),
])  # fmt: skip
def test_encode_equals_sentence_transformers(saved, tmp_path, family, class_name):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Pooling, Transformer
    folder, _ = saved(family, class_name)
    body = Transformer(str(folder), max_seq_length=32)
    pooling = Pooling(48, "mean")
    reference = sentence_transformers.SentenceTransformer(modules=[body, pooling], device="cpu")
    reference.save(str(tmp_path))
    assert (tmp_path / "modules.json").is_file() and (tmp_path / "1_Pooling").is_dir()
    texts = [*CORPUS, "The bank.", "Ciao gioco a giochi " * 10]  # the last one cut to 32
    try:
        theirs = reference.encode(texts, convert_to_tensor=True, normalize_embeddings=True)
    except TypeError as error:  # sentence-transformers 3.0 hands DistilBERT token_type_ids
        pytest.skip(f"this sentence-transformers cannot encode with {class_name}: {error}")
    model = selfattn.load(tmp_path)
    assert model.sentence.max_seq_length == 32
    ours = model.encode(texts, batch_size=3)
    assert F.cosine_similarity(ours, theirs).min() >= 0.99999


@pytest.mark.parametrize(("family", "class_name"), [
    ("roberta", "RobertaForSequenceClassification"), ("xlm-roberta", "XLMRobertaModel"),
    ("distilbert", "DistilBertForQuestionAnswering"),
])  # fmt: skip
def test_cli_explains_a_word(saved, family, class_name):
    """Explain runs on each family; a fine-tuned checkpoint's left-out head is one note on
    stderr, a bare encoder gets none."""
    folder, _ = saved(family, class_name)
    text = "I went to the bank to deposit money."
    result = CliRunner().invoke(app, ["explain", text, "--model", str(folder), "--word", "bank"])
    assert result.exit_code == 0, result.output
    assert "bank" in result.stdout and "deposit" in result.stdout
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    if class_name.endswith("Model"):
        assert notes == []
    else:
        assert len(notes) == 1 and "left out the checkpoint's" in notes[0], notes


def test_distilbert_refuses_token_types_in_one_line(saved):
    model = selfattn.load(saved("distilbert", "DistilBertModel")[0])
    input_ids = torch.tensor([[101, 2000, 102]])
    with pytest.raises(SelfAttnError, match=r"\(distilbert\) has no token types;") as error:
        model(input_ids, token_type_ids=torch.zeros_like(input_ids))
    assert "\n" not in str(error.value)


def test_distilbert_with_sinusoidal_positions_reads_the_stored_table(tmp_path):
    """sinusoidal_pos_embds: the fixed table is saved like a learned one and loads the same:
    sin and cos of the position with transformers 5 (4.37 re-initialises the table randomly
    before saving it, and computes with that)."""
    torch.manual_seed(0)
    hf = transformers.DistilBertModel(distilbert(sinusoidal_pos_embds=True)).eval()
    hf.save_pretrained(tmp_path)
    model = selfattn.load(tmp_path)
    table = model.network.embeddings.positions.embedding.weight
    assert torch.equal(table, hf.embeddings.position_embeddings.weight)
    if int(transformers.__version__.split(".")[0]) >= 5:
        torch.testing.assert_close(table[:, 0], torch.arange(40.0).sin())  # sin(position / 1)
        torch.testing.assert_close(table[:, 1], torch.arange(40.0).cos())
    input_ids, mask = padded_batch(hf.config)
    with torch.no_grad():
        ours = model(input_ids, mask).last_hidden_state
        theirs = hf(input_ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("class_name", ["RobertaModel", "XLMRobertaModel", "DistilBertModel"])
def test_name_maps_cover_both_state_dicts_with_matching_shapes(saved, class_name):
    family = {"RobertaModel": "roberta", "XLMRobertaModel": "xlm-roberta"}.get(
        class_name, "distilbert"
    )
    folder, hf = saved(family, class_name)
    raw = json.loads((folder / "config.json").read_text())
    if family == "distilbert":
        config = distilbert_config(raw)
        rules = distilbert_rules(config.n_layers)
    else:
        config = roberta_config(raw, pooler=True)
        rules = bert_rules(config.n_layers, pooler=True)
    architecture = ARCHITECTURES[family]
    theirs = {
        name: tensor
        for name, tensor in hf.state_dict().items()
        if not name.endswith(architecture.ignored_suffixes)
    }
    assert_map_fits(rules, theirs, dict(Bert(config).named_parameters()))
