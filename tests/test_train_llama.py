"""Training a Llama from scratch (`selfattn train --arch llama`): the network is Hugging Face's
Llama, it learns, its checkpoints load back and resume exactly, refusals, the commands (DDP:
tests/test_train.py runs its two-process test for both architectures).

Tolerances (float32): logits against Hugging Face's ``LlamaForCausalLM`` built from the same
config with the trained weights copied in, 1e-5 absolute (the same function; only the order
of float sums differs); save → load, and resume against a straight run, bit-exact (same ops,
same generator states on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from selfattn import server
from selfattn.cli import app
from selfattn.errors import SelfAttnError
from selfattn.models.llama import Llama, LlamaConfig, llama_hidden_size
from selfattn.models.name_maps import llama_rules
from selfattn.train import (
    TextData,
    get_preset,
    load_checkpoint,
    load_model,
    train_decoder,
)
from selfattn.train.run import new_network
from test_train import _error_line

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: fastest on one thread

LLAMA = {"arch": "llama", "n_head": 4, "n_kv_head": 2}  # tiny: 2 layers, 32 wide; heads of 8


@pytest.fixture(scope="module")
def llama_run(corpus, tmp_path_factory):
    """A tiny Llama (4 query heads sharing 2 key/value heads) trained 30 steps, and its --out."""
    out = tmp_path_factory.mktemp("run") / "out"
    run = train_decoder(
        corpus, out, preset="tiny", overrides={**LLAMA, "max_iters": 30}, device="cpu"
    )
    return run, out


def _batch(corpus: Path, block_size: int) -> torch.Tensor:
    """Two held-out windows of ``block_size`` characters, (2, block_size)."""
    data = TextData.from_file(corpus, block_size)
    return torch.stack([data.val[:block_size], data.val[-block_size:]])


def test_the_recipe_is_llamas(llama_run):
    """RMSNorm (eps 1e-5), RoPE theta 10000, SwiGLU of Llama's size rule, no biases, untied
    head."""
    run, _ = llama_run
    config = run.config.model
    assert isinstance(run.model, Llama) and isinstance(config, LlamaConfig)
    assert (config.norm, config.rope_theta, config.activation, config.gated) == (
        "rms", 10000.0, "silu", True,
    )  # fmt: skip
    assert config.norm_eps == 1e-5  # Llama 2's and Llama 3's rms_norm_eps
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (4, 2, 8)
    assert config.d_ff == llama_hidden_size(32) == 96  # 8/3 · 32 = 85.3, up to a multiple of 32
    assert [llama_hidden_size(d) for d in (128, 384, 4096)] == [352, 1024, 10944]
    assert not (config.qkv_bias or config.out_bias or config.mlp_bias or config.tie_word_embeddings)
    assert config.max_positions == run.config.train.block_size == 16


def test_the_initialisation_is_gpt2s_with_norms_at_one():
    """N(0, 0.02) everywhere, the residual output maps N(0, 0.02/sqrt(2·layers)), norms 1."""
    torch.manual_seed(0)
    preset = get_preset("shakespeare-char-cpu").override(arch="llama")
    network = new_network(preset.model_config(vocab_size=65))
    with torch.no_grad():  # a trained network's norms: reset_parameters puts them back at 1
        for name, parameter in network.named_parameters():
            parameter.fill_(3.0) if "norm" in name else None
    network.reset_parameters()
    residual = 0.02 / (2 * 4) ** 0.5
    for name, parameter in network.named_parameters():
        if "norm" in name:
            assert torch.equal(parameter, torch.ones_like(parameter)), name
            continue
        expected = residual if name.endswith(("W_o.weight", "down.weight")) else 0.02
        assert parameter.mean().abs() < 0.1 * expected, name
        assert abs(parameter.std().item() / expected - 1) < 0.1, name


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_new_networks_biases_start_at_zero(arch):
    """With bias=True (Python only) every bias of a network to train from scratch is 0, the
    linear maps' (torch's default draws them from U(-1/sqrt(in), 1/sqrt(in))) and the norms'
    alike, as GPT-2's initialisation (nanoGPT's) sets them."""
    torch.manual_seed(0)
    preset = get_preset("tiny").override(arch=arch, bias=True)
    network = new_network(preset.model_config(vocab_size=20))
    linear = [m for m in network.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
    assert len(linear) >= 2 * 4  # 2 blocks, each with q, k, v and the output map at least
    biases = {name: p for name, p in network.named_parameters() if name.endswith("bias")}
    assert all(any(m.bias is p for p in biases.values()) for m in linear)
    for name, bias in biases.items():
        assert torch.count_nonzero(bias) == 0, name


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_bias_false_leaves_no_bias_in_any_layer_or_norm(arch):
    """The presets' bias=False (nanoGPT's shakespeare_char) means no bias parameter at all:
    not in the linear maps, nor in GPT's LayerNorms, the final one included."""
    preset = get_preset("tiny").override(arch=arch)
    assert preset.bias is False
    network = new_network(preset.model_config(vocab_size=20))
    assert [name for name, _ in network.named_parameters() if "bias" in name] == []


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_presets_mlp_is_nanogpts_exact_gelu_or_llamas_swiglu(arch):
    """Without an activation given, GPT's MLP is nanoGPT's, down(GELU(up(x))) with the exact,
    erf-based GELU (not GPT-2's tanh approximation), and Llama's down(SiLU(gate(x)) · up(x)):
    each block's output equal to that formula written with torch's functions, exactly."""
    torch.manual_seed(0)
    network = new_network(get_preset("tiny").override(arch=arch).model_config(vocab_size=20))
    x = torch.randn(2, 5, 32) * 3  # wide enough for the tanh approximation to differ
    for block in network.blocks:
        mlp = block.feed_forward
        with torch.no_grad():
            if arch == "gpt":
                expected = mlp.down(torch.nn.functional.gelu(mlp.up(x), approximate="none"))
            else:
                expected = mlp.down(torch.nn.functional.silu(mlp.gate(x)) * mlp.up(x))
            torch.testing.assert_close(mlp(x), expected, atol=0, rtol=0)


def test_dropout_acts_where_the_gpts_does():
    """In training, dropout drops the embeddings, the attention weights and what each
    branch adds to the residual stream (GPT's places): with p = 0.5, one embedding, and per
    block the attention weights and the two branches; in eval mode none, so the output is
    the p = 0 network's exactly."""
    preset = get_preset("tiny").override(**LLAMA, dropout=0.5)
    torch.manual_seed(0)
    network = new_network(preset.model_config(vocab_size=20))
    plain = new_network(preset.override(dropout=0.0).model_config(vocab_size=20))
    plain.load_state_dict(network.state_dict())
    inputs = torch.randint(0, 20, (2, 9))
    dropped = []
    for module in network.modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_hook(lambda m, i, o: dropped.append(torch.equal(i[0], o)))
    network.eval()
    torch.testing.assert_close(network(inputs).logits, plain.eval()(inputs).logits, atol=0, rtol=0)
    assert dropped and all(dropped)  # eval: identity everywhere
    dropped.clear()
    network.train()
    network(inputs)
    assert dropped.count(False) == 1 + 2 * preset.n_layer  # each dropout changed its input
    attentions = [block.attention for block in network.blocks]
    assert [attention.dropout for attention in attentions] == [0.5] * preset.n_layer


def test_logits_equal_hugging_faces_llama_with_the_same_weights(llama_run, corpus):
    transformers = pytest.importorskip("transformers")
    run, _ = llama_run
    config = run.config.model
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_positions,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        hidden_act=config.activation,
        tie_word_embeddings=False,
    )
    theirs = transformers.LlamaForCausalLM(hf_config).eval()
    targets = dict(theirs.named_parameters())
    ours = dict(run.model.named_parameters())
    rules = llama_rules(run.model)
    with torch.no_grad():
        for rule in rules:
            name = rule.source if rule.source.startswith("lm_head") else f"model.{rule.source}"
            targets.pop(name).copy_(ours[rule.targets[0]])
    assert not targets, f"left at Hugging Face's random init: {list(targets)}"

    ids = _batch(corpus, config.max_positions)
    with torch.no_grad():
        expected = theirs(ids).logits
        actual = run.model(ids).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_save_and_load_give_the_same_model_bit_for_bit(llama_run, corpus):
    run, out = llama_run
    model, _, config, state = load_checkpoint(out)
    assert config == run.config and state.step == 30
    assert json.loads(next(out.glob("step-*/config.json")).read_text())["model_type"] == "llama"
    ids = _batch(corpus, 16)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, run.model(ids).logits)
    viewed = load_model(out)  # what explain, generate and serve read
    assert (viewed.config.model_type, viewed.config.n_heads) == ("llama", 4)
    with torch.no_grad():
        assert torch.equal(viewed.network(ids).logits, run.model(ids).logits)


def test_resume_gives_the_same_losses_as_straight_training(corpus, tmp_path):
    """20 steps + resume to 40 == 40 straight steps, with dropout: every loss and weight
    bit-exact (the dropout masks come from the saved generator too)."""
    settings = {**LLAMA, "dropout": 0.1}
    straight = train_decoder(
        corpus, tmp_path / "a", preset="tiny", overrides={**settings, "max_iters": 40}
    )
    first = train_decoder(
        corpus, tmp_path / "b", preset="tiny", overrides={**settings, "max_iters": 20}
    )
    second = train_decoder(corpus, tmp_path / "b", overrides={"max_iters": 40}, resume=True)
    assert second.result.start_step == 20 and isinstance(second.model, Llama)
    assert first.result.losses + second.result.losses == straight.result.losses
    for (name, a), b in zip(
        straight.model.state_dict().items(), second.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_the_command_trains_a_llama_that_generates_and_explains(corpus, tmp_path):
    """`train --arch llama`, 40 steps: the held-out loss drops by at least 1 nat from
    ~ln(vocab); `generate --checkpoint` continues a prompt as the loaded model does;
    `explain --checkpoint` runs."""
    out = tmp_path / "out"
    args = ["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny"]
    result = CliRunner().invoke(app, [*args, "--arch", "llama", "--max-iters", "40"])
    assert result.exit_code == 0, result.output
    history = load_checkpoint(out)[3].history
    assert history[-1]["step"] == 40 and history[-1]["val"] < history[0]["val"] - 1.0, history

    sampling = ["--max-new-tokens", "30", "--temperature", "0.8", "--seed", "3"]
    result = CliRunner().invoke(app, ["generate", "--checkpoint", str(out), "First", *sampling])
    assert result.exit_code == 0, result.output
    expected = load_model(out).generate("First", 30, temperature=0.8, seed=3)
    assert result.stdout == "First" + expected + "\n"
    result = CliRunner().invoke(app, ["explain", "--checkpoint", str(out), "Speak, speak."])
    assert result.exit_code == 0, result.output


def test_serve_takes_a_llama_checkpoint(llama_run, monkeypatch):
    """`serve --checkpoint` loads the Llama; its explorer generates what the model does."""
    _, out = llama_run
    served = []

    def serve(network, host, sock):
        sock.close()
        served.append(network)
        return 0

    monkeypatch.setattr(server, "serve", serve)
    result = CliRunner().invoke(app, ["serve", "--checkpoint", str(out), "--port", "0"])
    assert result.exit_code == 0, result.output
    (network,) = served
    body = {"prompt": "First ", "max_new_tokens": 10, "temperature": 0}
    with TestClient(server.create_app(network), base_url="http://127.0.0.1:8000") as client:
        response = client.post("/api/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["text"] == network.generate("First ", 10, temperature=0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--arch", "llama", "--n-kv-head", "3"],
         "--n-kv-head 3 (n_kv_head= in Python) must divide --n-head 2 (n_head= in Python)"),
        (["--arch", "llama", "--n-kv-head", "0"], "choose one of 1, 2"),
        (["--n-kv-head", "1"], "is for --arch llama"),
        (["--arch", "mamba"], "--arch mamba (arch= in Python) is not an architecture; choose gpt"),
        (["--arch", "llama", "--n-embd", "34"],
         "--n-embd 34 (n_embd= in Python) must be a multiple of 2 × --n-head 2 (n_head= in "
         "Python): each head is n_embd / n_head wide, and RoPE turns pairs of its dims; choose "
         "--n-embd 36 or a --n-head whose double divides it"),  # 36: the multiple of 4 above
    ],
)  # fmt: skip
def test_settings_a_llama_cannot_take_are_one_line(corpus, tmp_path, flags, message):
    out = tmp_path / "out"
    line = _error_line(["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny",
                        *flags])  # fmt: skip
    assert message in line, line
    assert not out.exists()


def test_a_resume_as_the_other_architecture_is_refused(llama_run, corpus, tmp_path):
    """Either way round, from the command line and from Python, naming the checkpoint's."""
    _, out = llama_run
    base = ["train", "--data", str(corpus), "--resume", "--max-iters", "40"]
    line = _error_line([*base, "--out", str(out), "--arch", "gpt"])
    assert f"the checkpoint in {out} is a llama model and this run a gpt one" in line, line
    assert "resume with --arch llama" in line
    line = _error_line([*base, "--out", str(out), "--preset", "tiny"])  # tiny is a GPT preset
    assert "is a llama model and this run a gpt one" in line, line

    gpt = tmp_path / "gpt"
    train_decoder(corpus, gpt, preset="tiny", overrides={"max_iters": 2}, device="cpu")
    with pytest.raises(SelfAttnError) as error:
        train_decoder(corpus, gpt, overrides={"arch": "llama", "max_iters": 4}, resume=True)
    assert "is a gpt model and this run a llama one" in str(error.value)
    assert "\n" not in str(error.value)
    line = _error_line([*base, "--out", str(out), "--n-kv-head", "1"])  # same arch, other shape
    assert "another configuration (--n-kv-head 2 vs 1: checkpoint vs this run)" in line, line
    line = _error_line([*base, "--out", str(out), "--block-size", "32", "--n-embd", "64"])
    assert "configuration (--n-embd 32 vs 64, --block-size 16 vs 32: checkpoint" in line, line


def test_a_size_no_flag_sets_is_named_by_its_field(llama_run):
    """A derived size that differs alone (d_ff, which a rule computes from --n-embd) is named
    by its field; it used to give an empty list, "configuration (: checkpoint vs this run)"."""
    from selfattn.train.run import _check_same_model

    _, out = llama_run
    saved = load_checkpoint(out)[2].model
    wider = dataclasses.replace(saved, d_ff=saved.d_ff + 32)
    with pytest.raises(SelfAttnError, match=rf"configuration \(d_ff {saved.d_ff} vs"):
        _check_same_model(out, saved, wider)


def test_an_unknown_model_type_in_a_checkpoint_names_its_config(llama_run, tmp_path):
    _, out = llama_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    config = copy / (copy / "LATEST").read_text().strip() / "config.json"  # (the previous too)
    config.write_text(config.read_text().replace('"model_type": "llama"', '"model_type": "rwkv"'))
    with pytest.raises(SelfAttnError) as error:
        load_model(copy)
    assert "config.json: model_type 'rwkv' is neither 'gpt' nor 'llama'" in str(error.value)
