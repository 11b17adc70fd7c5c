"""Randomly initialised Hugging Face BERT and GPT-2, saved as safetensors, load onto our layers.

Tolerances (float32): hidden states and logits 1e-4 absolute; greedy tokens identical to
Hugging Face ``generate(do_sample=False)`` for 20 steps, with and without our key/value cache,
and past the 48-position window to Hugging Face's argmax over the last 48 ids, step by step.
The name maps are checked key by key and shape by shape against both models' state dicts.
"""

import json

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import selfattn
from selfattn.models.bert import Bert, BertConfig
from selfattn.models.gpt import GPT, Decoder, GPTConfig
from selfattn.models.model import Model
from selfattn.models.name_maps import ARCHITECTURES, CONVERSIONS, bert_rules, gpt2_rules

transformers = pytest.importorskip("transformers")

CORPUS = [
    "Self-attention weighs every token against every other token.",
    "Queries, keys and values are linear maps of the same input.",
    "I went to the bank to deposit money; we sat on the river bank.",
    "Ciao gioco a giochi. Hello, world! Numbers 12345 and café crème.",
]
VOCAB = 300


def save_hf(model, folder):
    model.save_pretrained(folder)  # transformers >= 5 always writes model.safetensors
    assert (folder / "model.safetensors").is_file()
    return folder


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=97,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=71,
        max_position_embeddings=40,
        type_vocab_size=2,
        initializer_range=0.2,
    )
    hf = transformers.BertModel(config).eval()
    return save_hf(hf, tmp_path_factory.mktemp("bert")), hf


def byte_level_tokenizer(path):
    """A small byte-level BPE, built here (GPT-2's kind of tokenizer, no downloads)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(path))


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=48,
        n_embd=40,
        n_layer=3,
        n_head=5,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    folder = save_hf(hf, tmp_path_factory.mktemp("gpt2"))
    byte_level_tokenizer(folder / "tokenizer.json")
    return folder, hf


def assert_logits_and_states_match(
    model: Model, hf: torch.nn.Module, input_ids: torch.Tensor
) -> None:
    """Our decoder's logits and every hidden state equal Hugging Face's, 1e-4 absolute."""
    with torch.no_grad():
        ours = model(input_ids)
        theirs = hf(input_ids, output_hidden_states=True)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-4, rtol=0)
    # Hugging Face's last hidden state comes after the final norm; ours before it.
    for mine, hf_state in zip(ours.hidden_states[:-1], theirs.hidden_states[:-1], strict=True):
        torch.testing.assert_close(mine, hf_state, atol=1e-4, rtol=0)
    final = model.network.final_norm(ours.hidden_states[-1])
    torch.testing.assert_close(final, theirs.hidden_states[-1], atol=1e-4, rtol=0)


def hf_greedy(hf: torch.nn.Module, prompt_ids: torch.Tensor, n: int) -> torch.Tensor:
    """The prompt and ``n`` tokens after it from Hugging Face's ``generate(do_sample=False)``,
    never stopping early."""
    with torch.no_grad():
        return hf.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )


def test_random_bert_with_token_types_matches(bert_folder):
    folder, hf = bert_folder
    model = selfattn.load(folder)
    assert model.config.kind == "encoder" and model.tokenizer is None
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 97, (3, 17), generator=generator)
    token_types = (torch.arange(17) >= 9).long().expand(3, 17)  # sentence A then sentence B
    mask = torch.ones(3, 17, dtype=torch.long)
    mask[1, 12:] = 0
    real = mask.bool()
    with torch.no_grad():
        ours = model(input_ids, mask, token_types)
        theirs = hf(
            input_ids, attention_mask=mask, token_type_ids=token_types, output_hidden_states=True
        )
    for mine, hf_state in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(mine[real], hf_state[real], atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.pooler_output, theirs.pooler_output, atol=1e-4, rtol=0)


def test_bert_with_legacy_layer_norm_names_matches(bert_folder, tmp_path):
    """Checkpoints converted from TensorFlow, bert-base-uncased among them, name their layer
    norms LayerNorm.gamma and LayerNorm.beta (and their body bert.*); transformers renames
    them to weight and bias on loading. They used to be refused ("lacks 14 tensor(s)"); now
    they load, hidden states 1e-4 absolute from the Hugging Face model with those weights."""
    folder, hf = bert_folder
    old_names = {"LayerNorm.weight": "LayerNorm.gamma", "LayerNorm.bias": "LayerNorm.beta"}
    legacy = {}
    for name, tensor in hf.state_dict().items():
        for new, old in old_names.items():
            name = name.replace(new, old)
        legacy[f"bert.{name}"] = tensor.contiguous()
    assert sum(name.endswith("LayerNorm.gamma") for name in legacy) == 7  # embeddings + 2 x 3
    save_file(legacy, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    input_ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = selfattn.load(tmp_path)(input_ids)
        theirs = hf(input_ids, output_hidden_states=True)
    for mine, hf_state in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(mine, hf_state, atol=1e-4, rtol=0)


def test_random_gpt2_logits_and_states_match(gpt2_folder):
    folder, hf = gpt2_folder
    model = selfattn.load(folder)
    assert (model.config.kind, model.config.n_layers, model.config.n_heads) == ("decoder", 3, 5)
    input_ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(2))
    assert_logits_and_states_match(model, hf, input_ids)  # 1e-4


def test_gpt2_loss_leaves_out_targets_of_minus_one_as_hugging_face_leaves_out_minus_100(
    gpt2_folder,
):
    """forward(ids, targets) is the mean cross-entropy over the targets that are not -1
    (nanoGPT's ignore_index): the same number as Hugging Face's loss with the same positions
    labelled -100 (its labels are the ids, shifted inside), 1e-5 absolute."""
    folder, hf = gpt2_folder
    model = selfattn.load(folder)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -1)], dim=1)  # the next token
    targets[0, 3] = targets[1, 7] = -1
    labels = ids.clone()
    labels[0, 4] = labels[1, 8] = -100  # the label of the prediction at 3 and 7
    with torch.no_grad():
        ours = model.network(ids, targets).loss
        theirs = hf(ids, labels=labels).loss
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_gpt2_config_without_its_activation_takes_hugging_face_default(gpt2_folder, tmp_path):
    """A GPT-2 config.json without activation_function means gelu_new (GPT2Config's default);
    it used to mean exact gelu: logits 1e-3 off. Now 1e-4 absolute, as for the full config."""
    folder, hf = gpt2_folder
    assert hf.config.activation_function == "gelu_new"
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    del config["activation_function"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    input_ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = selfattn.load(tmp_path)(input_ids).logits
        theirs = hf(input_ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("use_cache", [True, False])
def test_random_gpt2_greedy_tokens_equal_hugging_face(gpt2_folder, use_cache):
    folder, hf = gpt2_folder
    model = selfattn.load(folder)
    prompt = "Self-attention weighs the bank"
    prompt_ids = torch.tensor([model.tokenizer.encode(prompt).ids])
    theirs = hf_greedy(hf, prompt_ids, 20)
    ours = model.network.generate(prompt_ids, 20, temperature=0.0, use_cache=use_cache)
    assert ours.tolist() == theirs.tolist()
    text = model.generate(prompt, 20, temperature=0.0, use_cache=use_cache)
    assert text == model.tokenizer.decode(theirs[0, prompt_ids.shape[1] :].tolist())


def test_random_gpt2_greedy_past_the_window_equals_hugging_face_on_the_last_block(gpt2_folder):
    """60 greedy steps from a 15-token prompt, so the 48-position window slides 27 times:
    with and without our cache, the ids equal Hugging Face's argmax over the logits of the
    last 48 ids, step by step. (Its top two logits differ by > 1e-3 at every step, far above
    the 1e-4 agreement of the logits, so the argmax is unambiguous.)"""
    folder, hf = gpt2_folder
    model = selfattn.load(folder)
    window = hf.config.n_positions
    prompt_ids = torch.tensor([model.tokenizer.encode("Self-attention weighs the bank").ids])
    expected = prompt_ids
    with torch.no_grad():
        for _ in range(60):
            logits = hf(expected[:, -window:]).logits[:, -1]
            top = logits.topk(2).values
            assert (top[:, 0] - top[:, 1]).min() > 1e-3
            expected = torch.cat([expected, logits.argmax(-1, keepdim=True)], dim=1)
    assert expected.shape[1] - window > 20  # the run really slides
    assert len(set(expected[0, window:].tolist())) > 1  # after sliding, not one token repeated
    for use_cache in (True, False):
        ours = model.network.generate(prompt_ids, 60, temperature=0.0, use_cache=use_cache)
        assert ours.tolist() == expected.tolist(), use_cache


def test_a_decoder_reports_its_positions_or_cannot_be_made(gpt2_folder):
    """GPT reports its block size; a Decoder without max_positions, which raised
    NotImplementedError when generation asked for it, cannot be made."""
    model = selfattn.load(gpt2_folder[0])
    assert model.network.max_positions == model.config.max_positions == 48

    class Positionless(Decoder):
        def forward(self, input_ids: torch.Tensor) -> None:
            """Never run."""

    with pytest.raises(TypeError, match=r"abstract .*max_positions"):
        Positionless()


def test_generate_sampling_is_repeatable_with_a_seed(gpt2_folder):
    model = selfattn.load(gpt2_folder[0])
    first = model.generate("Hello", 15, temperature=1.0, top_k=20, seed=7)
    assert first == model.generate("Hello", 15, temperature=1.0, top_k=20, seed=7)
    with pytest.raises(selfattn.errors.SelfAttnError, match="decoder"):
        model.encode(["no sentence embeddings from a decoder"])
    with pytest.raises(selfattn.errors.SelfAttnError, match="prompt is empty"):
        model.generate("")


def test_gpt2_run_records_causal_attention(gpt2_folder):
    model = selfattn.load(gpt2_folder[0])
    run = model.run("Hello, world! The bank.")
    assert "".join(run.tokens) == "Hello, world! The bank."  # byte-level pieces, readable
    assert "".join(run.tokens[i] for i in run.word_tokens("bank")) == " bank"
    weights = run.attention(1)  # (H, T, T)
    assert torch.all(weights.triu(diagonal=1) == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5, len(run.tokens)))
    assert run.logits.shape == (len(run.tokens), VOCAB)
    assert run.hidden_states.shape == (4, len(run.tokens), 40)


def test_gpt2_run_attention_equals_hugging_face_eager_attentions(gpt2_folder):
    """What explain shows of a decoder (Run.attention, recomputed from the recorded q and k),
    its logits and states equal Hugging Face's eager path within 1e-5: causal rows included."""
    folder, _ = gpt2_folder
    model = selfattn.load(folder)
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    run = model.run("I went to the bank.\nCafé crème, 12345!")
    with torch.no_grad():
        theirs = hf(
            torch.tensor([run.token_ids]), output_attentions=True, output_hidden_states=True
        )
    for layer, attention in enumerate(theirs.attentions):
        torch.testing.assert_close(run.attention(layer), attention[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(run.logits, theirs.logits[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(run.hidden_states[1], theirs.hidden_states[1][0], atol=1e-4, rtol=0)


def test_bert_name_map_covers_both_state_dicts_with_matching_shapes(bert_folder):
    _, hf = bert_folder
    ours = Bert(BertConfig(97, 48, 3, 4, 71, 40, pooler=True))
    architecture = ARCHITECTURES["bert"]
    theirs = {
        name: tensor
        for name, tensor in hf.state_dict().items()
        if not name.endswith(architecture.ignored_suffixes)
    }
    assert_map_fits(bert_rules(3, pooler=True), theirs, dict(ours.named_parameters()))


def test_gpt2_name_map_covers_both_state_dicts_with_matching_shapes(gpt2_folder):
    _, hf = gpt2_folder
    ours = GPT(GPTConfig(vocab_size=VOCAB, block_size=48, n_layer=3, n_head=5, n_embd=40))
    architecture = ARCHITECTURES["gpt2"]
    theirs = {
        name.removeprefix(architecture.prefix): tensor
        for name, tensor in hf.state_dict().items()
        if not name.endswith(architecture.ignored_suffixes) and name not in architecture.tied
    }
    assert_map_fits(gpt2_rules(3), theirs, dict(ours.named_parameters()))


def assert_map_fits(rules, theirs, ours):
    assert sorted(rule.source for rule in rules) == sorted(theirs)
    targets = [target for rule in rules for target in rule.targets]
    assert sorted(targets) == sorted(ours)  # every parameter filled exactly once
    for rule in rules:
        conversion = CONVERSIONS[rule.kind]
        target_shapes = [tuple(ours[target].shape) for target in rule.targets]
        assert conversion.source_shape(target_shapes) == tuple(theirs[rule.source].shape)
        converted = conversion.convert(theirs[rule.source])
        assert [tuple(t.shape) for t in converted] == target_shapes
