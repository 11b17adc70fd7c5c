"""Randomly initialised Hugging Face GPT-NeoX (Pythia), Phi-3 and Gemma, saved as safetensors,
load onto the Llama family's network (:class:`selfattn.models.llama.Llama`) and run end to end.

Five small models (3 layers, initializer_range 0.2): GPT-NeoX as Pythia has it (hidden 64, 4
heads of 16, parallel residual, a quarter of each head rotated, biases, untied ``embed_out``);
GPT-NeoX sequential (half of each head rotated, no attention biases, tied head); Phi-3 (fused
``qkv_proj`` of 6 query and 2 key/value heads, fused ``gate_up_proj``, half of each head
rotated, a sliding window of 6); Gemma (1 + weight RMSNorms, embeddings times sqrt(48),
GeGLU with tanh gelu, head_dim 10 given in config.json, tied head). GPT-NeoX reads a byte-level
BPE (Pythia's kind), Phi-3 and Gemma a sentencepiece-style one, both built here.

Tolerances (float32): logits and every hidden state 1e-4 absolute; attention weights of every
layer and head (recomputed from the q and k recorded after RoPE) against Hugging Face's eager
``output_attentions`` 1e-5; 20 greedy tokens identical to Hugging Face ``generate(do_sample=
False)``, with and without our key/value cache. The name map is checked key by key and shape
by shape against each saved checkpoint.
"""

import re

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import selfattn
from selfattn.cli import app
from selfattn.errors import SelfAttnError
from selfattn.models.loading import ARCHITECTURES, llama_rules, neox_rules, phi3_rules
from test_models_llama import (
    assert_half_precision_like_hugging_face,
    metaspace_tokenizer,
    rewritten,
    skip_without_oracle,
)
from test_models_random import VOCAB, assert_map_fits, byte_level_tokenizer

transformers = pytest.importorskip("transformers")

SENTENCE = "I went to the bank to deposit money; café 日本."
PROMPT = "I went to the bank"
SIZES = dict(
    hidden_size=48,
    intermediate_size=71,
    num_hidden_layers=3,
    num_attention_heads=6,
    max_position_embeddings=64,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)
NEOX = dict(hidden_size=64, num_attention_heads=4, intermediate_size=100)  # head_dim 16
FAMILIES = {  # name -> (Hugging Face class, its config class, config settings, tokenizer)
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {**NEOX, "rotary_pct": 0.25}, "bytes"),
    "gpt_neox-sequential-tied": (
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        {
            **NEOX,
            "rotary_pct": 0.5,
            "rotary_emb_base": 500.0,
            "use_parallel_residual": False,
            "attention_bias": False,
            "tie_word_embeddings": True,
        },
        "bytes",
    ),
    "phi3": (
        "Phi3ForCausalLM",
        "Phi3Config",
        {
            "num_key_value_heads": 2,
            "sliding_window": 6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        },
        "metaspace",
    ),
    "gemma": (
        "GemmaForCausalLM",
        "GemmaConfig",
        {"num_key_value_heads": 2, "head_dim": 10},
        "metaspace",
    ),
}
RULES = {"gpt_neox": neox_rules, "phi3": phi3_rules, "gemma": llama_rules}


def saved_family(name: str, tmp_path_factory) -> tuple:
    """(folder, Hugging Face model on its eager attention, our model) of family ``name``."""
    model_class, config_class, settings, tokenizer = FAMILIES[name]
    skip_without_oracle(config_class, settings)
    folder = tmp_path_factory.mktemp(name)
    if tokenizer == "bytes":
        byte_level_tokenizer(folder / "tokenizer.json")
        vocab_size = VOCAB
    else:
        vocab_size = metaspace_tokenizer(folder / "tokenizer.json")
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SIZES, **settings, "vocab_size": vocab_size})
    getattr(transformers, model_class)(config).save_pretrained(folder)
    hf = getattr(transformers, model_class).from_pretrained(folder, attn_implementation="eager")
    return folder, hf.eval(), selfattn.load(folder)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(folder, Hugging Face model, our model) of each family in turn."""
    return saved_family(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """(folder, Hugging Face model, our model) of the Pythia-like GPT-NeoX."""
    return saved_family("gpt_neox", tmp_path_factory)


def test_logits_and_every_hidden_state_match_hugging_face(family):
    _, hf, model = family
    assert model.config.kind == "decoder"
    assert model.config.n_layers == 3
    assert model.config.n_heads == hf.config.num_attention_heads
    input_ids = torch.randint(
        0, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        ours = model(input_ids)
        theirs = hf(input_ids, output_hidden_states=True)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-4, rtol=0)
    # Hugging Face's last hidden state comes after the final norm; ours before it.
    for mine, hf_state in zip(ours.hidden_states[:-1], theirs.hidden_states[:-1], strict=True):
        torch.testing.assert_close(mine, hf_state, atol=1e-4, rtol=0)
    final = model.network.final_norm(ours.hidden_states[-1])
    torch.testing.assert_close(final, theirs.hidden_states[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_errs_at_most_twice_as_much_as_hugging_face(family, dtype):
    assert_half_precision_like_hugging_face(*family, dtype)


def test_run_attention_equals_hugging_face_eager_attentions(family):
    """The weights explain shows, recomputed from the q and k recorded after (partial) RoPE,
    equal Hugging Face's eager attentions for every layer and head; Phi-3's window of 6 on a
    longer text included."""
    _, hf, model = family
    run = model.run(SENTENCE)
    assert len(run.tokens) > 6
    with torch.no_grad():
        theirs = hf(torch.tensor([run.token_ids]), output_attentions=True)
    for layer, attention in enumerate(theirs.attentions):
        torch.testing.assert_close(run.attention(layer), attention[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(run.logits, theirs.logits[0], atol=1e-4, rtol=0)
    window = getattr(hf.config, "sliding_window", None)
    if window:  # the last query sees only the window's last keys
        assert run.sliding_windows == (window,) * 3
        assert torch.all(run.attention(0)[:, -1, :-window] == 0)
        assert torch.all(run.attention(0)[:, -1, -window:] > 0)


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_tokens_equal_hugging_face(family, use_cache):
    """20 greedy tokens after the prompt: the cached steps rotate each new query and key at
    its own position (and slide past Phi-3's window)."""
    _, hf, model = family
    prompt_ids = torch.tensor([model.tokenizer.encode(PROMPT).ids])
    with torch.no_grad():
        theirs = hf.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=False,
            max_new_tokens=20,
            min_new_tokens=20,
            pad_token_id=0,
        )
    ours = model.network.generate(prompt_ids, 20, temperature=0.0, use_cache=use_cache)
    assert ours.tolist() == theirs.tolist()
    text = model.generate(PROMPT, 20, temperature=0.0, use_cache=use_cache)
    assert text == model.tokenizer.decode(theirs[0].tolist())[len(PROMPT) :]


def test_name_map_covers_the_checkpoint_with_matching_shapes(family):
    """Every tensor saved (prefix stripped; a tied head, saved or not, left to the embedding)
    fills its parameters, and every parameter is filled once, shape by shape."""
    folder, hf, model = family
    architecture = ARCHITECTURES[hf.config.model_type]
    saved = load_file(folder / "model.safetensors")
    theirs = {name.removeprefix(architecture.prefix): tensor for name, tensor in saved.items()}
    if hf.config.tie_word_embeddings:
        theirs.pop("embed_out.weight" if "embed_in.weight" in theirs else "lm_head.weight", None)
    ours = dict(model.network.named_parameters())
    assert_map_fits(RULES[hf.config.model_type](model.network), theirs, ours)


def test_neox_fused_query_key_value_splits_head_by_head(neox):
    """GPT-NeoX's query_key_value rows run (head, q/k/v, dim): head 1's key is rows 48..63."""
    _, hf, model = neox
    fused = hf.gpt_neox.layers[2].attention.query_key_value
    attention = model.network.blocks[2].attention
    rows = slice(1 * 3 * 16 + 16, 1 * 3 * 16 + 32)  # head 1, then its q, then its k
    torch.testing.assert_close(attention.W_k.weight[16:32], fused.weight[rows], atol=0, rtol=0)
    torch.testing.assert_close(attention.W_k.bias[16:32], fused.bias[rows], atol=0, rtol=0)
    assert attention.rotary.rotary_dim == 4 and attention.rotary.head_dim == 16


def test_neox_queries_turn_only_their_first_quarter(neox):
    """The recorded query past the rotated dims (12 of 16) is the projection itself: position
    does not touch it."""
    _, _, model = neox
    run = model.run(SENTENCE)
    block = model.network.blocks[0]
    with torch.no_grad():
        embedded = model(torch.tensor([run.token_ids])).hidden_states[0]  # (1, T, D)
        projected = block.attention.W_q(block.norm1(embedded))  # (1, T, H * hd)
    heads = projected[0].view(len(run.tokens), 4, 16).transpose(0, 1)  # (H, T, hd)
    query = torch.stack([run.trace(0, head).query for head in range(4)])
    torch.testing.assert_close(query[..., 4:], heads[..., 4:], atol=1e-6, rtol=0)
    assert not torch.allclose(query[:, 1:, :4], heads[:, 1:, :4], atol=1e-3)


def test_generate_recorded_rows_equal_a_full_run(family):
    """What `generate --html` shows: each step's weights (recorded during the cached
    generation) equal the rows of one full run, 1e-5."""
    _, _, model = family
    generation = model.generate_recorded(PROMPT, 8, temperature=0.0)
    assert generation.text == model.generate(PROMPT, 8, temperature=0.0)
    ids = torch.tensor([generation.token_ids[:-1]])
    with torch.no_grad(), selfattn.record(model.network) as recording:
        model(ids)
    for step in generation.steps:
        full = torch.stack([capture.weights()[:, step.query] for capture in recording])
        torch.testing.assert_close(step.weights, full[..., : step.query + 1], atol=1e-5, rtol=0)


def test_cli_explains_and_continues_each_folder(family, tmp_path):
    """`selfattn explain TEXT --model DIR` and `selfattn generate --model DIR PROMPT` (with
    --html) run on these families as on Llama; generate prints what Model.generate writes."""
    folder, _, model = family
    result = CliRunner().invoke(
        app, ["explain", SENTENCE, "--model", str(folder), "--word", "bank"]
    )
    assert result.exit_code == 0, result.output
    assert "causal: each query sees keys up to itself" in result.stdout
    page = tmp_path / "generation.html"
    args = ["generate", "--model", str(folder), PROMPT, "--max-new-tokens", "6"]
    result = CliRunner().invoke(app, [*args, "--temperature", "0", "--html", str(page)])
    assert result.exit_code == 0, result.output
    assert result.stdout == PROMPT + model.generate(PROMPT, 6, temperature=0.0) + "\n"
    assert page.stat().st_size > 0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The saved folder of a family by name, made once, for the refusals (each test edits its
    own copy)."""
    made = {}

    def folder(name: str):
        if name not in made:
            made[name] = saved_family(name, tmp_path_factory)[0]
        return made[name]

    return folder


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        (
            "gemma",
            {"model_type": "gemma2"},
            "unsupported model_type 'gemma2' in ",
        ),
        (
            "gemma",
            {"use_bidirectional_attention": True},
            "unsupported use_bidirectional_attention true in config.json",
        ),
        (
            "phi3",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}},
            "unsupported RoPE type 'longrope' (rope_parameters in config.json)",
        ),
        (
            "gpt_neox",
            {"rope_parameters": None, "rotary_pct": 0.1},
            "unsupported partial_rotary_factor 0.1 in config.json: it turns 1 of 16 dims per "
            "head; RoPE needs an even number, at least 2",
        ),
        (
            "gemma",
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "unsupported partial_rotary_factor 0.5 in config.json; gemma turns every dim of a "
            "head (1.0)",
        ),
    ],
)
def test_what_does_not_fit_is_refused_in_one_line(folders, tmp_path, name, config, message):
    folder = rewritten(folders(name), tmp_path, config)
    with pytest.raises(SelfAttnError, match=re.escape(message)) as error:
        selfattn.load(folder)
    assert "\n" not in str(error.value)
    if config.get("model_type") == "gemma2":
        assert "soft-caps attention scores" in str(error.value)


def test_older_neox_configs_read_rotary_pct_and_rotary_emb_base(neox, tmp_path):
    """Pythia's config.json from before transformers 5 has top-level rotary_pct and
    rotary_emb_base and no rope_parameters: the same model loads from it."""
    folder, _, model = neox
    assert model.network.blocks[0].attention.rotary.rotary_dim == 4
    older = {"rope_parameters": None, "rotary_pct": 0.25, "rotary_emb_base": 10000}
    reloaded = selfattn.load(rewritten(folder, tmp_path, older))
    assert reloaded.network.blocks[0].attention.rotary.rotary_dim == 4
    ids = torch.tensor([[5, 9, 2, 77]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)
