"""What is particular to GPT-NeoX (Pythia), Phi-3 and Gemma on the Llama family's network
(:class:`selfattn.models.llama.Llama`): GPT-NeoX's fused query_key_value split head by head,
its partial rotation, its configs from before transformers 5, and what each family refuses.

The models are test_models_llama.py's (its :data:`~test_models_llama.FAMILIES`), built once a
session; every test that family runs on all of them (logits, states, attention, greedy tokens,
name map, recorded generation, CLI) is there. Tolerances: the split and the older config's
logits exact (0); the unrotated query dims 1e-6 absolute, the rotated ones off by more than 1e-3.
"""

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import selfattn
from selfattn.errors import SelfAttnError
from test_models_llama import (  # noqa: F401 (vocab_size: a fixture)
    SENTENCE,
    Saved,
    rewritten,
    saved_family,
    vocab_size,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def neox(tmp_path_factory, vocab_size) -> Saved:  # noqa: F811
    """The Pythia-like GPT-NeoX, saved and loaded."""
    return saved_family("gpt_neox", tmp_path_factory.getbasetemp(), vocab_size)


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


@pytest.fixture(scope="module")
def folders(tmp_path_factory, vocab_size) -> Callable[[str], Path]:  # noqa: F811
    """The saved folder of a family by name, for the refusals (each test edits its own copy)."""
    return lambda name: saved_family(name, tmp_path_factory.getbasetemp(), vocab_size).folder


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
        (  # loaded, though transformers' Phi-3 refuses it: no reference says what it computes
            "phi3",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "unsupported RoPE type 'linear' for phi3 (rope_parameters in config.json)",
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
        (  # transformers 5 computes SiLU here, 4 the GELU: they read different fields
            "gemma",
            {"hidden_act": "silu", "hidden_activation": "gelu_pytorch_tanh"},
            "config.json: hidden_activation 'gelu_pytorch_tanh' and hidden_act 'silu' name "
            "different activations (transformers 4 reads the first, 5 the second); make them agree",
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


@pytest.mark.parametrize(
    "given",
    [{"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"}, {"hidden_act": "gelu"}],
)
def test_gemmas_two_activation_fields_that_agree_load(folders, tmp_path, given):
    # Gemma's own config.json gives "gelu" (read as the tanh approximation) beside the named
    # one; the same weights give the same logits (exact) whichever the fields say
    model = selfattn.load(folders("gemma"))
    reloaded = selfattn.load(rewritten(folders("gemma"), tmp_path, given))
    ids = torch.tensor([[5, 9, 2, 77]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


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


def test_neox_config_without_rotary_pct_turns_a_quarter_as_hugging_face_does(neox, tmp_path):
    """A GPT-NeoX config.json with neither rope_parameters nor rotary_pct turns a quarter of
    each head (GPTNeoXConfig's default): rotary dim 16 // 4, and the logits within 1e-4 of
    Hugging Face's model loaded from the same stripped folder (its defaults the oracle)."""
    folder, _, _ = neox
    stripped = {"rope_parameters": None, "rotary_pct": None, "partial_rotary_factor": None}
    reloaded = selfattn.load(rewritten(folder, tmp_path, stripped))
    assert "rotary_pct" not in (tmp_path / "config.json").read_text()
    assert reloaded.network.blocks[0].attention.rotary.rotary_dim == 16 // 4
    hf = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ids = torch.tensor([[5, 9, 2, 77, 31, 8]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)


def test_gemmas_embedding_scale_is_rounded_to_the_dtype_first_as_hugging_faces(folders):
    """Gemma multiplies its embeddings by sqrt(hidden) rounded to the model's dtype first:
    in bfloat16, sqrt(48) = 6.9282 is 6.9375. The embedding output (hidden state 0) equals
    Hugging Face's bit for bit (0 tolerance: one rounding of the same product), and differs
    from the product by the unrounded scale (so the rounding is what is tested)."""
    folder = folders("gemma")
    model = selfattn.load(folder, dtype=torch.bfloat16)
    named = "dtype" if hasattr(transformers.PretrainedConfig(), "dtype") else "torch_dtype"
    hf = transformers.GemmaForCausalLM.from_pretrained(folder, **{named: torch.bfloat16})
    ids = torch.tensor([[5, 9, 2, 77, 31, 8, 120, 64]])
    with torch.no_grad():
        ours = model(ids).hidden_states[0]
        theirs = hf.eval()(ids, output_hidden_states=True).hidden_states[0]
        table = model.network.token_embedding.weight[ids]
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    assert torch.equal(ours, table * torch.tensor(48**0.5, dtype=torch.bfloat16))
    assert not torch.equal(ours, (table.float() * 48**0.5).to(torch.bfloat16))
