"""Generation for many prompts at once: ``model.generate([prompt, ...])`` and the networks'
``generate(input_ids, n, attention_mask=...)`` with rows padded on the left.

Random decoders built here without downloads: GPT-2 (48 positions), every rotary family of
test_models_llama (Mistral's and Phi-3's windows of 6 included), and a character-level GPT
and Llama as `selfattn train` builds them. Tolerances (float32): a left-padded forward's
logits at the real tokens against Hugging Face's (``position_ids`` from the mask, as its
generate makes them) 1e-4 absolute; greedy tokens identical to each prompt generated alone
and to Hugging Face ``generate(do_sample=False)`` on the same left-padded batch, at prompts
where the chosen token's logit leads the next by more than 5e-4 at every step (5 times the
1e-4 agreement, so no argmax is a tie).
"""

import json
import shutil

import pytest
import torch

import selfattn
from selfattn.errors import SelfAttnError
from selfattn.layers import RotaryPositions
from selfattn.models.gpt import GPT, GPTConfig
from selfattn.models.llama import Llama, LlamaConfig
from selfattn.models.model import Model, ModelConfig
from selfattn.text import Tokenizer
from selfattn.train.data import CharTokenizer
from test_models_llama import FAMILIES, Saved, saved_family, vocab_size  # noqa: F401 (fixture)
from test_models_random import gpt2_folder  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "I went to the bank to deposit money",
    "Self",
    "Queries, keys and values are linear maps",
]
MARGIN = 5e-4  # the least lead of a greedy step's chosen logit over the next one


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows padded with 0 on the left, and the mask (1 for the rows' own tokens)."""
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    return ids, torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])


def hf_left_padded_greedy(hf: torch.nn.Module, rows: list[list[int]], n: int) -> torch.Tensor:
    """Hugging Face's ``generate(do_sample=False)`` of the left-padded batch, ``n`` tokens per
    row, never stopping early; asserts that no step's argmax is within MARGIN of a tie."""
    ids, mask = left_padded(rows)
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
            output_scores=True,  # the logits of greedy steps (output_logits: transformers 4.38+)
            return_dict_in_generate=True,
        )
    top = torch.stack(out.scores).topk(2).values  # (n, B, 2)
    assert (top[..., 0] - top[..., 1]).min() > MARGIN
    return out.sequences


def prompt_ids(model: Model, prompts: list[str]) -> list[list[int]]:
    return [model.tokenizer.encode(prompt).ids for prompt in prompts]


def continuation(model: Model, prompt: list[int], new: list[int]) -> str:
    """The text of ``new`` after ``prompt``'s, as Model.generate gives it."""
    return model.tokenizer.decode(prompt + new)[len(model.tokenizer.decode(prompt)) :]


def test_rotary_positions_per_row_are_each_rows_own_offset():
    """A left-padded row's rotation is the one its tokens get alone from their first
    position on: exactly (the same float32 angles)."""
    rope = RotaryPositions(8, rotary_dim=4)
    x = torch.randn(2, 3, 5, 8)  # (B, H, T, D)
    positions = torch.tensor([[0, 0, 0, 1, 2], [7, 8, 9, 10, 11]])
    turned = rope(x, positions=positions[:, None])  # (B, 1, T): every head alike
    assert torch.equal(turned[0, :, 2:], rope(x[0, :, 2:]))
    assert torch.equal(turned[1], rope(x[1], offset=7))


@pytest.fixture(scope="module", params=["gpt2", *FAMILIES])
def decoder(request, gpt2_folder, tmp_path_factory, vocab_size) -> Saved:  # noqa: F811
    """GPT-2 and each rotary family in turn: its folder, Hugging Face's model and ours."""
    if request.param == "gpt2":
        folder, hf = gpt2_folder
        return Saved(folder, hf, selfattn.load(folder))
    return saved_family(request.param, tmp_path_factory.getbasetemp(), vocab_size)


def test_left_padded_forward_equals_hugging_faces_with_positions_from_the_mask(decoder):
    """At each row's own tokens, 1e-4 (and 1e-5 from the prompt alone); the padding's
    logits are nobody's business."""
    _, hf, model = decoder
    rows = prompt_ids(model, PROMPTS)
    ids, mask = left_padded(rows)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = model.network(ids, attention_mask=mask, position_ids=positions).logits
        theirs = hf(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-4, rtol=0)
    for i, row in enumerate(rows):
        with torch.no_grad():
            alone = model.network(torch.tensor([row])).logits[0]
        torch.testing.assert_close(ours[i][real[i]], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("use_cache", [True, False])
def test_batch_greedy_equals_each_prompt_alone_and_hugging_face(decoder, use_cache):
    """20 tokens (Mistral and Phi-3 past their windows of 6): model.generate(prompts) is each
    prompt generated alone, and the network's tokens on the left-padded batch are Hugging
    Face's, padding included."""
    _, hf, model = decoder
    rows = prompt_ids(model, PROMPTS)
    assert len({len(row) for row in rows}) == len(rows)  # every row padded differently
    theirs = hf_left_padded_greedy(hf, rows, 20)
    ids, mask = left_padded(rows)
    options = {"temperature": 0.0, "use_cache": use_cache}
    assert model.network.generate(ids, 20, attention_mask=mask, **options).tolist() == (
        theirs.tolist()
    )
    texts = model.generate(PROMPTS, 20, **options)
    assert texts == [model.generate(prompt, 20, **options) for prompt in PROMPTS]
    new = theirs[:, ids.shape[1] :].tolist()
    assert texts == [continuation(model, *pair) for pair in zip(rows, new, strict=True)]


@pytest.mark.parametrize("decoder", ["gpt2", "mistral", "gpt_neox"], indirect=True)
def test_the_window_slides_for_a_batch_as_for_each_prompt_alone(decoder):
    """70 tokens after prompts of 2 to 29 tokens: GPT-2's 48 positions and the rotary
    families' 64 (Mistral with its window of 6 too) are outgrown by the longest row first;
    every row still equals its prompt alone (whose sliding GPT-2 test_models_random checks
    against Hugging Face), with and without the cache."""
    model = decoder.model
    longest = max(map(len, prompt_ids(model, PROMPTS)))
    assert longest + 70 > model.config.max_positions + 10  # the window really slides
    for use_cache in (True, False):
        options = {"temperature": 0.0, "use_cache": use_cache}
        alone = [model.generate(prompt, 70, **options) for prompt in PROMPTS]
        assert model.generate(PROMPTS, 70, **options) == alone


@pytest.mark.parametrize("decoder", ["gpt2", "llama-tied-mha-llama3", "llama"], indirect=True)
def test_a_batch_recorded_whole_keeps_every_steps_attention_as_hugging_faces(decoder):
    """One record() around 16 cached steps of the left-padded batch: read after the last
    step, each step's captures give each row's last query row as Hugging Face's eager
    ``output_attentions`` of that step, 1e-5 (padding weighed 0 by both). The captured keys
    and values of multi-head layers (GPT-2's, the tied Llama's) are views of the caches'
    storage, which later steps write into: an earlier step's must not have changed."""
    folder, _, model = decoder
    ids, mask = left_padded(prompt_ids(model, PROMPTS))
    with selfattn.record(model.network) as recording:
        ours = model.network.generate(ids, 16, attention_mask=mask, temperature=0.0)
    hf = type(decoder.hf).from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                             min_new_tokens=16, pad_token_id=0, output_attentions=True,
                             return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(ours, theirs.sequences)
    assert len(recording) == 16 * model.config.n_layers
    for layer in range(model.config.n_layers):
        for capture, step in zip(recording.layer(layer), theirs.attentions, strict=True):
            for row in range(len(PROMPTS)):
                torch.testing.assert_close(
                    capture.weights(batch=row)[:, -1], step[layer][row, :, -1], atol=1e-5, rtol=0
                )


def end_tokens(free: list[list[int]]) -> set[int]:
    """From each row r of a free run, the first token at step 2 + 3r or later that the row
    has not written before (none where it only repeats itself)."""
    ends = set()
    for r, row in enumerate(free):
        ends |= {next((t for k, t in enumerate(row) if k >= 2 + 3 * r and t not in row[:k]), -1)}
    return ends - {-1}


def test_each_row_ends_at_its_own_end_of_text_token_as_hugging_faces(decoder, tmp_path):
    """End-of-text ids (generation_config.json's list) chosen from each row's free run of 20
    tokens: each row's text ends at its first of them (what the prompt alone gives), the
    steps stop when the last row ends (or run all 20 where one never does), and Hugging
    Face's generate ends each row there too, padding the rows ended with its pad id."""
    folder, hf, model = decoder
    rows = prompt_ids(model, PROMPTS)
    ids, mask = left_padded(rows)
    free = model.network.generate(ids, 20, attention_mask=mask, temperature=0.0)
    free = free[:, ids.shape[1] :].tolist()
    ends = end_tokens(free)
    lengths = [next((i + 1 for i, t in enumerate(row) if t in ends), 20) for row in free]
    assert len(set(lengths)) > 1  # the rows end at different steps
    ending = shutil.copytree(folder, tmp_path / "ending")
    (ending / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(ends)}))
    ours = selfattn.load(ending)
    forwards = []
    ours.network.register_forward_hook(lambda *_: forwards.append(1))
    texts = ours.generate(PROMPTS, 20, temperature=0.0)
    assert len(forwards) == max(lengths)
    expected = [continuation(ours, row, new[:length])
                for row, new, length in zip(rows, free, lengths, strict=True)]  # fmt: skip
    assert texts == expected
    assert texts == [ours.generate(prompt, 20, temperature=0.0) for prompt in PROMPTS]
    hf_ending = type(hf).from_pretrained(ending, attn_implementation="eager").eval()  # as hf
    with torch.no_grad():
        theirs = hf_ending.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                    pad_token_id=0)  # fmt: skip
    assert theirs.shape[1] == ids.shape[1] + max(lengths)
    for new, length, their_row in zip(free, lengths, theirs.tolist(), strict=True):
        assert their_row[ids.shape[1] :] == new[:length] + [0] * (max(lengths) - length)


def test_sampling_a_batch_is_repeatable_with_a_seed(gpt2_folder):  # noqa: F811
    """The same seed, the same texts; a list of one prompt is that prompt's str call."""
    model = selfattn.load(gpt2_folder[0])
    options = {"temperature": 1.0, "top_k": 20, "seed": 7}
    first = model.generate(PROMPTS, 15, **options)
    assert first == model.generate(PROMPTS, 15, **options)
    assert first != model.generate(PROMPTS, 15, **(options | {"seed": 8}))
    assert model.generate(PROMPTS[:1], 15, **options) == [model.generate(PROMPTS[0], 15, **options)]


def test_a_str_gives_a_str_and_a_list_or_tuple_a_list(gpt2_folder):  # noqa: F811
    model = selfattn.load(gpt2_folder[0])
    text = model.generate(PROMPTS[1], 4, temperature=0.0)
    assert isinstance(text, str)
    assert model.generate((PROMPTS[1],), 4, temperature=0.0) == [text]
    assert model.generate(PROMPTS, 0) == ["", "", ""]


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([], "generate got an empty list of prompts; pass at least one text"),
        (["the bank", ""], "prompt 1 (of 2, from 0) is empty; pass some text to continue"),
        (["the bank", 3], "generate takes a str or a list of str, got list holding int"),
    ],
)
def test_what_generate_cannot_continue_is_refused_in_one_line(gpt2_folder, prompts, message):  # noqa: F811
    with pytest.raises(SelfAttnError) as error:
        selfattn.load(gpt2_folder[0]).generate(prompts, 3)
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (
            [[1, 1, 0], [1, 1, 1]],
            "attention_mask must pad on the left: 0s, then 1s to each row's end (Hugging "
            "Face's padding_side='left'); pad the prompts on the left",
        ),
        ([[0, 0, 0], [1, 1, 1]], "attention_mask must pad on the left"),
        ([[1, 1], [1, 1]], "attention_mask must have input_ids' shape (2, 3), got (2, 2)"),
    ],
)
def test_a_network_refuses_a_mask_that_does_not_pad_on_the_left(gpt2_folder, mask, message):  # noqa: F811
    network = selfattn.load(gpt2_folder[0]).network
    with pytest.raises(SelfAttnError) as error:
        network.generate(torch.ones(2, 3, dtype=torch.long), 2, attention_mask=torch.tensor(mask))
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"position_ids": torch.tensor([[45, 46, 47, 48]])}, r"must lie in 0\.\.47 .*got 45\.\.48"),
        ({"position_ids": torch.tensor([[-1, 0, 1, 2]])}, r"must lie in 0\.\.47"),
        ({"position_ids": torch.tensor([[0, 1]])}, r"input_ids' shape \(1, 4\), got \(1, 2\)"),
        ({"position_ids": torch.tensor([[0.0, 1, 2, 3]])}, "must hold integers"),
        ({"logits_to_keep": -1}, r"logits_to_keep must be an int >= 0 \(0: all\), got -1"),
        ({"logits_to_keep": 1, "targets": torch.zeros(1, 4, dtype=torch.long)}, "not both"),
    ],
)
def test_a_networks_generation_arguments_are_checked(gpt2_folder, options, message):  # noqa: F811
    """position_ids past GPT-2's table were torch's IndexError, and logits_to_keep=-1 kept
    all but the first token's logits: each is one line (48 positions in this folder)."""
    network = selfattn.load(gpt2_folder[0]).network
    assert network.max_positions == 48
    with pytest.raises(ValueError, match=message):
        network(torch.ones(1, 4, dtype=torch.long), **options)


def trained(network: GPT | Llama, chars: CharTokenizer) -> Model:
    """A model as `selfattn train` leaves it, its weights N(0, 0.3) so that greedy steps are
    far from ties (training's N(0, 0.02) leaves the logits all but equal)."""
    with torch.no_grad():
        for parameter in network.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.3)
    info = ModelConfig.for_decoder(network.config, type(network).__name__.lower())
    return Model(network, info, name="trained", tokenizer=Tokenizer(chars.to_hf())).eval()


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_trained_checkpoints_batch_equals_each_prompt_alone(arch):
    """Character models of 24 positions, 30 tokens after prompts of 1 to 17 characters: the
    window slides too."""
    torch.manual_seed(0)
    chars = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ,.\n")
    if arch == "gpt":
        network = GPT(GPTConfig(chars.vocab_size, block_size=24, n_layer=2, n_head=2, n_embd=16))
    else:
        sizes = {"d_model": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 4}
        network = Llama(LlamaConfig(chars.vocab_size, **sizes, d_ff=44, max_positions=24))
    model = trained(network, chars)
    prompts = ["the bank is", "a", "we sat on the river"]
    for use_cache in (True, False):
        alone = [model.generate(prompt, 30, temperature=0.0, use_cache=use_cache)
                 for prompt in prompts]  # fmt: skip
        assert model.generate(prompts, 30, temperature=0.0, use_cache=use_cache) == alone
