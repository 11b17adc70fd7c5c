"""Layers against torch.nn.MultiheadAttention, positions, record(); tolerances inline."""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import math
from itertools import pairwise

import pytest
import torch
from torch import Tensor, nn

from selfattn import (
    KVCache,
    LearnedPositions,
    MultiHeadAttention,
    SelfAttention,
    SinusoidalPositions,
    TransformerBlock,
    attention,
    default_scale,
    record,
)
from selfattn.errors import SelfAttnError
from selfattn.layers import GatedFeedForward, GroupedQueryAttention, RMSNorm, RotaryPositions
from selfattn.models.gpt import GPT, GPTConfig
from selfattn.models.llama import Llama, LlamaConfig
from selfattn.recording import active_recordings
from test_attention import compile_whole


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("backend", ["explicit", "sdpa"])
def test_multihead_matches_torch_with_copied_weights(bias, backend):
    # float64, tolerance 1e-12 for outputs and head-averaged weights.
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(20, 4, bias=bias, batch_first=True).double().eval()
    ours = MultiHeadAttention.from_torch(reference).eval()
    ours.backend = backend
    x = torch.randn(3, 7, 20, dtype=torch.float64)
    blocked = torch.zeros(7, 7, dtype=torch.bool)
    blocked[:, 5] = True  # torch: True = may NOT attend; ours is the opposite

    expected, expected_weights = reference(x, x, x, attn_mask=blocked, average_attn_weights=True)
    with record(ours) as rec:
        output = ours(x, mask=~blocked)
    torch.testing.assert_close(output, expected, atol=1e-12, rtol=0)
    weights = torch.stack([rec[0].weights(batch=b).mean(0) for b in range(3)])
    torch.testing.assert_close(weights, expected_weights, atol=1e-12, rtol=0)


def test_multihead_cross_attention_matches_torch():
    torch.manual_seed(1)
    reference = nn.MultiheadAttention(12, 3, batch_first=True).double().eval()
    ours = MultiHeadAttention.from_torch(reference)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    context = torch.randn(2, 9, 12, dtype=torch.float64)
    expected, _ = reference(x, context, context)
    torch.testing.assert_close(ours(x, context), expected, atol=1e-12, rtol=0)


def test_from_torch_keeps_the_source_mode_and_device():
    # An eval-mode source with dropout: the copy is in eval mode too, so its outputs equal
    # torch's (float64, 1e-12) instead of dropping weights; a source on another device (meta
    # stands in for a GPU here) gives a copy there, not on the CPU.
    torch.manual_seed(2)
    reference = nn.MultiheadAttention(12, 3, dropout=0.5, batch_first=True).double().eval()
    ours = MultiHeadAttention.from_torch(reference)
    assert not ours.training and ours.dropout == 0.5
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    torch.testing.assert_close(ours(x), reference(x, x, x)[0], atol=1e-12, rtol=0)
    assert MultiHeadAttention.from_torch(reference.train()).training
    on_meta = MultiHeadAttention.from_torch(nn.MultiheadAttention(12, 3, device="meta"))
    assert {p.device.type for p in on_meta.parameters()} == {"meta"}


def test_from_torch_refuses_what_it_cannot_copy():
    with pytest.raises(ValueError, match="kdim"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, kdim=4, vdim=4))
    with pytest.raises(ValueError, match="add_bias_kv=True"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn=True"):  # it would change the outputs
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_zero_attn=True))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: MultiHeadAttention(8, 2, dropout=1.5),
            r"dropout must be a number in \[0, 1\), got 1.5",
        ),
        (lambda: MultiHeadAttention(8, 2, dropout=-0.1), r"dropout must be a number in \[0, 1\)"),
        (lambda: MultiHeadAttention(8, 2, similarity="cos"), "unknown similarity 'cos'.*cosine"),
        (lambda: SelfAttention(8, similarity="cos"), "unknown similarity 'cos'"),
        (lambda: MultiHeadAttention(10, 0), "n_heads must be a whole number >= 1, got 0"),
        (lambda: MultiHeadAttention(8, 2.0), "n_heads must be a whole number >= 1, got 2.0"),
        (lambda: MultiHeadAttention(10, 3), r"divisible by n_heads \(3\)"),
        (lambda: SelfAttention(8, d_k=0), "d_k must be a whole number >= 1, got 0"),
        (lambda: SelfAttention(8, d_v=-2), "d_v must be a whole number >= 1, got -2"),
        (lambda: SelfAttention(8.0), "d_model must be a whole number >= 1, got 8.0"),
        (lambda: TransformerBlock(8, 2, 16, norm_first=True, dropout=1.0), "dropout must be"),
        # These were taken (d_ff 0: a feed-forward of its bias alone; 0 positions) or failed
        # inside torch (a TypeError from nn.Linear or torch.zeros).
        (lambda: TransformerBlock(8, 2, 0, norm_first=True), "d_ff must be a whole number >= 1"),
        (lambda: GatedFeedForward(8, 32.0), "d_ff must be a whole number >= 1, got 32.0"),
        (lambda: SinusoidalPositions(10, 16.0), "d_model must be a whole number >= 1, got 16.0"),
        (lambda: SinusoidalPositions(0, 16), "max_len must be a whole number >= 1, got 0"),
        (lambda: LearnedPositions(-1, 16), "max_len must be a whole number >= 1, got -1"),
        # RMSNorm(0) was taken, RMSNorm(-1) torch's "negative dimension"; a str dropout "'<='
        # not supported between instances of 'float' and 'str'"
        (lambda: RMSNorm(0), "d_model must be a whole number >= 1, got 0"),
        (lambda: RMSNorm(-1), "d_model must be a whole number >= 1, got -1"),
        (lambda: RMSNorm(8, eps=-1e-6), "eps must be a finite number >= 0, got -1e-06"),
        (lambda: MultiHeadAttention(8, 2, dropout="0.1"), r"dropout must be a number .*'0\.1'"),
    ],
)
def test_bad_constructor_options_fail_at_construction(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_bad_calls_of_the_smaller_parts_get_one_line():
    """Each used to fail deep inside torch (shapes that cannot be multiplied, slice indices
    that must be integers, an AttributeError) or to give a number (default_scale("l2"))."""
    with pytest.raises(ValueError, match="x has last dim 6 but this layer has d_model=8"):
        GatedFeedForward(8, 16)(torch.randn(1, 3, 6))
    assert GatedFeedForward(8, 16)(torch.randn(8)).shape == (8,)  # one token's vector: taken
    with pytest.raises(
        TypeError, match=r"x must be a torch.Tensor of shape \(\.\.\., 6\), got list"
    ):
        RMSNorm(6)([1.0] * 6)  # an AttributeError
    with pytest.raises(ValueError, match=r"RMSNorm\(6\) got x of shape \(\)"):
        RMSNorm(6)(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"offset must be a whole number >= 0 .*got 1\.5"):
        LearnedPositions(10, 8)(torch.zeros(1, 3, 8), offset=1.5)
    with pytest.raises(ValueError, match=r"positions must give each of the 4 tokens .*\(1, 5\)"):
        RotaryPositions(8)(torch.randn(1, 4, 8), positions=torch.arange(5)[None])
    layer = GroupedQueryAttention(16, 4, 2)
    with pytest.raises(ValueError, match=r"positions must give each of the 3 tokens"):
        layer(torch.randn(2, 3, 16), positions=torch.arange(4).expand(2, 4))
    with pytest.raises(
        TypeError, match=r"from_torch takes a torch\.nn\.MultiheadAttention, got Linear"
    ):
        MultiHeadAttention.from_torch(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="unknown similarity 'l2'; choose 'dot' or 'cosine'"):
        default_scale("l2", 4)
    for width in (0, 2.0):
        with pytest.raises(ValueError, match=f"head_dim must be a whole number >= 1, got {width}"):
            default_scale("dot", width)


def test_a_layers_repr_shows_its_options():
    layer = MultiHeadAttention(8, 2, dropout=0.1, similarity="cosine")
    assert "n_heads=2, similarity='cosine', dropout=0.1, backend='auto'" in repr(layer)
    assert "similarity='dot', dropout=0.0, backend='auto'" in repr(SelfAttention(8))


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((4, 8), r"shape \(batch, length, d_model\), got \(4, 8\); add .* x\.unsqueeze\(0\)"),
        ((1, 2, 4, 8), r"got \(1, 2, 4, 8\); reshape it to \(batch, length, d_model\)"),
        ((1, 4, 6), "x has last dim 6 but this layer has d_model=8"),
    ],
)
def test_multihead_input_of_the_wrong_shape_gets_one_line(shape, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(8, 2)(torch.randn(shape))


def test_wrong_context_and_single_head_inputs_get_one_line():
    layer = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="context has last dim 4 but this layer has d_model=8"):
        layer(torch.randn(1, 3, 8), torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match=r"context must have shape .*context\.unsqueeze\(0\)"):
        layer(torch.randn(1, 3, 8), torch.randn(5, 8))
    single = SelfAttention(8)
    assert single(torch.randn(4, 8)).shape == (4, 8)  # one unbatched sequence is fine here
    with pytest.raises(ValueError, match="x has last dim 6 but this layer has d_model=8"):
        single(torch.randn(2, 4, 6))
    with pytest.raises(ValueError, match=r"\(\.\.\., length, d_model\), got \(8,\)"):
        single(torch.randn(8))


@pytest.mark.parametrize(
    ("build", "call", "message"),
    [
        (
            lambda: MultiHeadAttention(8, 2),
            lambda layer: layer(torch.randn(1, 3, 8).double()),
            r"x is torch\.float64 but this layer's weights are torch\.float32; convert: "
            r"x\.to\(torch\.float32\) or layer\.to\(torch\.float64\)",
        ),
        (
            lambda: MultiHeadAttention(8, 2),
            lambda layer: layer(torch.ones(1, 3, 8).long()),
            r"x is torch\.int64 but .*; convert: x\.to\(torch\.float32\)$",
        ),
        (
            lambda: MultiHeadAttention(8, 2),
            lambda layer: layer(torch.randn(1, 3, 8), torch.randn(1, 5, 8).half()),
            r"context is torch\.float16 but this layer's weights are torch\.float32",
        ),
        (
            lambda: MultiHeadAttention(8, 2),
            lambda layer: layer(torch.randn(2, 3, 8), torch.randn(3, 5, 8)),
            "context has batch size 3 but x has 2; pass one context sequence per sequence of x",
        ),
        (
            lambda: SelfAttention(8).double(),
            lambda layer: layer(torch.randn(3, 8)),
            r"x is torch\.float32 but this layer's weights are torch\.float64",
        ),
        (
            lambda: TransformerBlock(8, 2, 16, norm_first=True),
            lambda layer: layer(torch.randn(1, 3, 8).double()),
            r"x is torch\.float64 but this layer's weights are torch\.float32",
        ),
    ],
    ids=["x-float64", "x-int64", "context-float16", "context-batch", "single-head", "block"],
)
def test_input_of_another_dtype_or_batch_gets_one_line(build, call, message):
    # Before: torch's "mat1 and mat2 must have the same dtype" (or LayerNorm's, or a view error)
    # from inside the layer.
    with pytest.raises(ValueError, match=message) as error:
        call(build())
    assert "\n" not in str(error.value)


def test_input_of_another_dtype_is_taken_under_autocast():
    layer = MultiHeadAttention(8, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(1, 3, 8).bfloat16()).dtype == torch.bfloat16


def test_single_head_takes_a_mask_per_sequence():
    # A mask (B, T, T) in x's terms, as for the formula by hand (True = may attend; float64,
    # 1e-12); before, the layer's own head axis met the mask's batch axis: a RuntimeError,
    # or a silently wrong shape when the batch was 1. Recorded weights match too, also for a
    # 4-D x with a 4-D mask.
    torch.manual_seed(8)
    layer = SelfAttention(6, d_k=4).double()
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    mask = torch.rand(2, 3, 5, 5) > 0.4
    mask[..., 0] = True
    q, k, v = x @ layer.W_q.weight.T, x @ layer.W_k.weight.T, x @ layer.W_v.weight.T
    scaled = (q @ k.transpose(-2, -1) / math.sqrt(4)).masked_fill(~mask, -math.inf)
    weights = torch.softmax(scaled, dim=-1)
    torch.testing.assert_close(layer(x[0], mask=mask[0]), (weights @ v)[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(
        layer(x[:1, 0], mask=mask[:1, 0]), (weights @ v)[:1, 0], atol=1e-12, rtol=0
    )
    with record(layer) as rec:
        torch.testing.assert_close(layer(x, mask=mask), weights @ v, atol=1e-12, rtol=0)
    torch.testing.assert_close(rec[0].weights(head=0, batch=4), weights[1, 1], atol=1e-12, rtol=0)


def test_recorded_weights_of_a_mask_shared_along_a_leading_dim():
    # x (A, B, T, d) with a mask (B, T, T), the same for every A: the run was right, but the
    # recorded mask kept (B, 1, T, T) against q folded to (A·B, 1, T, d), and reading the
    # weights raised a RuntimeError (expand). Now every folded item a·B + b has mask[b]
    # (float64, 1e-12 against the formula).
    torch.manual_seed(9)
    layer = SelfAttention(6, d_k=4).double()
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    mask = torch.rand(3, 5, 5) > 0.4
    mask[..., 0] = True
    q, k = x @ layer.W_q.weight.T, x @ layer.W_k.weight.T
    scaled = (q @ k.transpose(-2, -1) / math.sqrt(4)).masked_fill(~mask, -math.inf)
    weights = torch.softmax(scaled, dim=-1).flatten(0, 1)  # (A·B, T, T)
    with record(layer) as rec:
        layer(x, mask=mask)
    for item in range(6):
        recorded = rec[0].weights(head=0, batch=item)
        torch.testing.assert_close(recorded, weights[item], atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape", [(7,), ()])
def test_recorded_weights_of_every_head_with_a_mask_of_one_dim_or_none(shape):
    # attention takes masks of shape (S,) and (), broadcast to (B, H, T, S). Before: reading
    # every head's weights (head=None) of such a call raised "mask of shape (1, 4, 7) does not
    # broadcast". Now they equal torch.nn.MultiheadAttention's per-head weights, same weights
    # copied (float64, 1e-12).
    torch.manual_seed(11)
    reference = nn.MultiheadAttention(20, 4, batch_first=True).double().eval()
    ours = MultiHeadAttention.from_torch(reference)
    x = torch.randn(2, 7, 20, dtype=torch.float64)
    allowed = torch.tensor([True, False, True, True, False, True, True]).reshape(shape or (7,))
    mask = allowed if shape else torch.tensor(True)
    blocked = ~mask.expand(7, 7)  # torch: True = may NOT attend
    _, expected = reference(x, x, x, attn_mask=blocked, average_attn_weights=False)
    with record(ours) as rec:
        ours(x, mask=mask)
    for batch in range(2):
        torch.testing.assert_close(rec[0].weights(batch=batch), expected[batch], atol=1e-12, rtol=0)


def test_single_head_is_the_formula_of_the_guide():
    # Q = X W_q, K = X W_k, V = X W_v; softmax(Q Kᵀ / sqrt(d_k)) V; tolerance 1e-12.
    torch.manual_seed(2)
    layer = SelfAttention(6, d_k=4).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    q, k, v = x @ layer.W_q.weight.T, x @ layer.W_k.weight.T, x @ layer.W_v.weight.T
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(4), dim=-1)
    torch.testing.assert_close(layer(x), weights @ v, atol=1e-12, rtol=0)
    assert layer(x).shape == x.shape
    assert all(p.bias is None for p in (layer.W_q, layer.W_k, layer.W_v))


@pytest.mark.parametrize(
    "options",
    [
        {"d_k": 3, "d_v": 2},  # an output map W_o brings d_v back to d_model
        {"bias": True},
        {"similarity": "cosine"},
        {"d_k": 3, "d_v": 4, "bias": True, "similarity": "cosine"},
    ],
    ids=str,
)
def test_single_head_options_follow_the_formula(options):
    # By hand from the layer's own weights: Q = X W_qᵀ + b_q (K, V alike); cosine normalises
    # Q and K and scales by sqrt(d_k), dot scales by 1/sqrt(d_k); out = softmax(Q Kᵀ s) V,
    # then W_o (with b_o) when d_v != d_model. float64, tolerance 1e-12.
    torch.manual_seed(6)
    layer = SelfAttention(6, **options).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)

    def linear(proj, x):
        return x @ proj.weight.T + (0 if proj.bias is None else proj.bias)

    q, k, v = (linear(proj, x) for proj in (layer.W_q, layer.W_k, layer.W_v))
    d_k = options.get("d_k", 6)
    if options.get("similarity") == "cosine":
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        scale = math.sqrt(d_k)
    else:
        scale = 1 / math.sqrt(d_k)
    expected = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v
    assert (layer.W_o is None) == (options.get("d_v", 6) == 6)
    if layer.W_o is not None:
        expected = linear(layer.W_o, expected)
    output = layer(x)
    assert output.shape == x.shape
    torch.testing.assert_close(output, expected, atol=1e-12, rtol=0)
    has_bias = options.get("bias", False)
    assert all((proj.bias is not None) == has_bias for proj in (layer.W_q, layer.W_v))


def test_single_head_is_trainable_by_backpropagation():
    torch.manual_seed(3)
    layer = SelfAttention(4)
    x = torch.randn(8, 4)
    target = torch.randn(8, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = (layer(x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_sinusoidal_positions_follow_the_paper():
    # PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...); float32 tolerance 1e-6.
    positions = SinusoidalPositions(50, 8)
    x = torch.zeros(1, 10, 8)
    table = positions(x, offset=3)[0]
    for p in range(10):
        for i in range(4):
            angle = (p + 3) / 10000 ** (2 * i / 8)
            assert abs(table[p, 2 * i].item() - math.sin(angle)) < 1e-6
            assert abs(table[p, 2 * i + 1].item() - math.cos(angle)) < 1e-6


def test_odd_model_size_and_too_long_input():
    assert SinusoidalPositions(10, 7).table.shape == (10, 7)
    with pytest.raises(ValueError, match="longer than the model's 10 positions"):
        LearnedPositions(10, 4)(torch.zeros(1, 11, 4))


@pytest.mark.parametrize("positions", [SinusoidalPositions(10, 8), LearnedPositions(10, 8)])
def test_positions_refuse_a_negative_or_too_large_offset(positions):
    x = torch.zeros(1, 3, 8)
    for offset in (-2, -5):
        with pytest.raises(ValueError, match=f"offset must be a whole number >= 0 .*got {offset}"):
            positions(x, offset=offset)
    with pytest.raises(ValueError, match="sequence of 11 tokens is longer than the model's 10"):
        positions(x, offset=8)
    assert torch.equal(positions(x, offset=7), positions(torch.zeros(1, 10, 8))[:, 7:])


def test_positions_break_permutation_symmetry():
    torch.manual_seed(4)
    layer = SelfAttention(8).double()
    positions = SinusoidalPositions(16, 8).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    perm = torch.tensor([1, 0, 2, 3, 4, 5])
    without = layer(x)
    torch.testing.assert_close(layer(x[perm]), without[perm], atol=1e-12, rtol=0)
    with_positions = layer(positions(x))
    assert not torch.allclose(layer(positions(x[perm])), with_positions[perm], atol=1e-6)


def test_record_leaves_outputs_unchanged_and_recomputes_exact_weights():
    # Outputs bit-identical with and without recording; recomputed weights and outputs match
    # the explicit path to 1e-12 (float64).
    torch.manual_seed(5)
    blocks = nn.ModuleList(
        TransformerBlock(16, 4, 32, norm_first=norm_first) for norm_first in (True, False)
    ).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)

    def run(x):
        for block in blocks:
            x = block(x, causal=True)
        return x

    plain = run(x)
    with record(blocks) as rec:
        recorded = run(x)
    assert torch.equal(plain, recorded)
    assert [capture.layer for capture in rec] == [0, 1]
    assert rec[1].name == "1.attention"
    capture = rec[1]
    trace = capture.trace(head=2, batch=1)
    _, expected = attention(
        capture.query[1, 2],
        capture.key[1, 2],
        capture.value[1, 2],
        causal=True,
        backend="explicit",
        return_trace=True,
    )
    torch.testing.assert_close(trace.weights, expected.weights, atol=1e-12, rtol=0)
    torch.testing.assert_close(trace.output, capture.output[1, 2], atol=1e-12, rtol=0)
    assert trace.weights.shape == (9, 9)
    assert capture.weights().shape == (4, 9, 9)


def test_a_capture_retraced_with_another_similarity_takes_that_similaritys_scale():
    """trace(similarity="cosine") on a call the model made with an explicit scale (0.5, as a
    model's query_pre_attn_scalar gives one) is the experiment "had the model used cosine":
    cosine's default scale √d_k, not the dot product's 0.5 (explain's --similarity cosine
    without --scale); without either, the call's own. Weights equal attention(similarity=
    "cosine", scale=None) to 1e-6, and softmax by hand to 1e-6."""
    torch.manual_seed(7)
    layer = MultiHeadAttention(8, 2)
    with record(layer) as rec:
        layer(torch.randn(1, 5, 8))
    capture = dataclasses.replace(rec[0], scale=0.5)
    trace = capture.trace(similarity="cosine")
    _, expected = attention(
        capture.query[0],
        capture.key[0],
        capture.value[0],
        similarity="cosine",
        scale=None,
        backend="explicit",
        return_trace=True,
    )
    torch.testing.assert_close(trace.weights, expected.weights, atol=1e-6, rtol=0)
    assert trace.scale == pytest.approx(math.sqrt(4), rel=1e-12)  # d_k = 8 / 2 heads
    q, k = capture.query[0, 0], capture.key[0, 0]
    own = capture.trace(0)
    assert own.scale == 0.5
    torch.testing.assert_close(own.weights, torch.softmax(q @ k.T * 0.5, -1), atol=1e-6, rtol=0)


def test_a_recording_moves_whole_to_another_device():
    """Recording.to moves every capture's q, k, v, mask and output, names, layers, shapes and
    dtypes kept: Model.run hands a run's recording to the CPU whatever the model's device.
    "meta" stands in for a second device on this CPU machine."""
    torch.manual_seed(6)
    layer = MultiHeadAttention(8, 2).double()
    with record(layer) as rec:
        layer(torch.randn(1, 5, 8, dtype=torch.float64), mask=torch.rand(5, 5) > 0.3)
    moved = rec.to("meta")
    assert [(c.name, c.layer) for c in moved] == [(c.name, c.layer) for c in rec]
    for name in ("query", "key", "value", "mask", "output"):
        before, after = getattr(rec[0], name), getattr(moved[0], name)
        assert after.device.type == "meta" and before.device.type == "cpu"
        assert (after.shape, after.dtype) == (before.shape, before.dtype)


def test_a_recordings_layer_out_of_range_is_a_clear_error():
    layer = MultiHeadAttention(8, 2)
    with record(layer) as rec:
        layer(torch.randn(1, 5, 8))
    assert rec.layer(-1) == rec.layer(0) == [rec[0]]
    with pytest.raises(IndexError, match=r"layer 9 out of range: this recording has attention"):
        rec.layer(9)  # it answered [], for the caller's [0] to fail on


def test_record_does_not_force_the_slow_path(monkeypatch):
    attention_module = importlib.import_module("selfattn.attention")
    used = []
    original = attention_module.BACKENDS["sdpa"]
    monkeypatch.setitem(
        attention_module.BACKENDS,
        "sdpa",
        attention_module.Backend("sdpa", lambda call: used.append(1) or original.run(call)),
    )
    layer = MultiHeadAttention(8, 2)
    with record(layer):
        layer(torch.randn(1, 4, 8))
    assert used == [1]


def _layer_and_run(kind):
    """A float64 layer in training mode (dropout 0, so both runs compute the same) and a
    function that runs it (or its compiled twin) on fixed inputs."""
    torch.manual_seed(8)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    if kind == "multihead":
        padding = torch.ones(2, 1, 1, 6, dtype=torch.bool)
        padding[1] = False  # the second sequence is all padding: every row fully masked
        return MultiHeadAttention(16, 4).double().train(), lambda layer: layer(x, mask=padding)
    if kind == "block":
        block = TransformerBlock(16, 4, 32, norm_first=True).double().train()
        return block, lambda layer: layer(x, causal=True)
    ids = torch.randint(0, 11, (2, 8))
    if kind == "llama":
        sizes = {"d_model": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 4}
        llama = Llama(LlamaConfig(11, **sizes, d_ff=24, max_positions=8))
        positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 1, 2, 3, 4, 5]])
        return llama.double().train(), lambda model: model(ids, ids, position_ids=positions).loss
    gpt = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16))
    return gpt.double().train(), lambda model: model(ids, ids).loss


@pytest.mark.parametrize("kind", ["multihead", "block", "gpt", "llama"])
def test_layers_compile_whole_and_match_eager(kind):
    """torch.compile(fullgraph=True) (aot_eager, see compile_whole) on MultiHeadAttention with
    a fully padded sequence, a causal TransformerBlock, and a GPT's and a Llama's training
    forward with its loss (before: a graph break where attend read record()'s context
    variable; the Llama's rotary angles computed once per forward, with per-row positions):
    float64 outputs and parameter gradients equal eager's within 1e-12, with no NaN."""
    layer, run = _layer_and_run(kind)
    results = []
    for model in (layer, compile_whole(layer)):
        output = run(model)
        results.append((output, *torch.autograd.grad(output.sum(), list(layer.parameters()))))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-12, rtol=0)
        assert not compiled.isnan().any()


def test_cached_decoding_compiles_whole_and_matches_eager():
    """Steps of 3, 1, 2 and 1 tokens through a KVCache under torch.compile(fullgraph=True):
    the recompiled step saw S as a symbol, and torch's is_causal refused the SymBool of T == S
    ("TypeError when making fake tensor call"). float64, 1e-12 against eager's steps."""
    torch.manual_seed(3)
    layer = GroupedQueryAttention(16, 4, 2).double()  # its attend is MultiHeadAttention's
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    compiled = compile_whole(lambda x, cache: layer(x, causal=True, cache=cache))
    caches = KVCache(), KVCache()
    for start, stop in pairwise([0, 3, 4, 6, 7]):
        eager = layer(x[:, start:stop], causal=True, cache=caches[0])
        torch.testing.assert_close(compiled(x[:, start:stop], caches[1]), eager, atol=1e-12, rtol=0)


def test_record_sees_eager_calls_only_and_refuses_a_compiled_model():
    """A compiled graph runs no Python: inside record() it runs whole (fullgraph=True) and
    reports nothing, while the same layer run eagerly is recorded. A compiled model handed to
    record() (torch.compile(layer) or layer.compile()) is a one-line error, not an empty
    recording."""
    layer = MultiHeadAttention(8, 2)
    compiled = compile_whole(layer)
    x = torch.randn(1, 4, 8)
    with record() as rec:
        assert torch.equal(compiled(x), layer(x))
    assert len(rec) == 1
    with record() as empty:
        compiled(x)
    # Reading it said "list index out of range", or a range "0..-1 (or -0..-1)".
    for read in (lambda: empty[0], lambda: empty.layer(0)):
        with pytest.raises(IndexError, match=r"holds no attention calls; .* record the eager"):
            read()
    with pytest.raises(TypeError, match="call must be an integer; got 'x'"):  # empty or not
        empty["x"]
    with pytest.raises(IndexError, match=r"call 5 out of range: this recording has calls 0\.\.0"):
        rec[5]
    assert rec[-1] is rec.captures[0] and rec[:1] == rec.captures
    in_place = MultiHeadAttention(8, 2)
    in_place.compile(fullgraph=True, backend="aot_eager")
    for model in (compiled, nn.Sequential(in_place)):
        message = r"record\(\) cannot see inside the compiled MultiHeadAttention.*: a torch"
        with pytest.raises(SelfAttnError, match=message), record(model):
            pass


def _attention_layer(kind, dropout):
    torch.manual_seed(7)
    if kind == "multihead":
        return MultiHeadAttention(8, 2, dropout=dropout).double()
    return TransformerBlock(8, 2, 16, norm_first=kind == "block-pre-norm", dropout=dropout).double()


@pytest.mark.parametrize("kind", ["multihead", "block-pre-norm", "block-post-norm"])
def test_attention_dropout_only_in_train_mode(kind):
    # .train(): the attention module's output on its own input differs from its output without
    # dropout (weights dropped, the rest scaled by 1/(1-p)); .eval(): the whole layer is
    # bit-identical to the same weights with dropout 0.
    layer = _attention_layer(kind, dropout=0.5)
    twin = _attention_layer(kind, dropout=0.0)
    twin.load_state_dict(layer.state_dict())
    attention_module = layer if kind == "multihead" else layer.attention
    assert attention_module.dropout == 0.5
    calls = []
    attention_module.register_forward_hook(
        lambda module, args, output: calls.append((args, output))
    )
    x = torch.randn(2, 5, 8, dtype=torch.float64)

    torch.manual_seed(0)
    layer.train()(x)
    ((inputs, trained),) = calls
    attention_module.eval()
    without_dropout = attention_module(*inputs)
    assert (trained - without_dropout).abs().max() > 0.1

    layer.eval()
    assert torch.equal(layer(x), twin.eval()(x))
    torch.manual_seed(0)
    assert torch.equal(twin.train()(x), twin.eval()(x))  # dropout 0: train mode changes nothing


def test_record_takes_an_empty_sequence():
    # Before: recording a length-0 input failed ("cannot reshape tensor of 0 elements").
    layer = MultiHeadAttention(8, 2)
    with record(layer) as rec:
        assert layer(torch.randn(2, 0, 8)).shape == (2, 0, 8)
    assert rec[0].weights(batch=1).shape == (2, 0, 0)


def test_nested_records_each_get_every_call_inside_them():
    """An inner record() (or a model.run inside the user's block) kept the calls from the
    outer one, which recorded nothing. Each block now gets every call made inside it, named
    by its own models, the same tensors (views, no copies)."""
    torch.manual_seed(0)
    model = nn.Sequential(MultiHeadAttention(8, 2), MultiHeadAttention(8, 2))
    x = torch.randn(1, 4, 8)
    with record(model) as outer:
        model[0](x)
        with record() as inner:
            model(x)
        model[1](x)
    assert [c.name for c in outer] == ["0", "0", "1", "1"]
    assert [c.name for c in inner] == ["MultiHeadAttention", "MultiHeadAttention"]
    for mine, theirs in zip(inner, outer[1:3], strict=True):
        assert mine.query.data_ptr() == theirs.query.data_ptr()
        torch.testing.assert_close(mine.weights(), theirs.weights(), atol=0, rtol=0)
    assert outer.n_layers == 2 and inner.n_layers == 2


def test_records_ended_out_of_order_or_in_another_context_leave_none_active():
    """Two generators that each hold a record() block, stepped in turn: the second block to
    end put back the first's recording, which then captured every call of the process for
    ever. A block ended in another context (a thread pool stepping the generator) raised a
    ValueError (a ContextVar token made elsewhere)."""
    layer = MultiHeadAttention(8, 2)
    x = torch.randn(1, 4, 8)

    def stream():
        with record(layer) as recording:
            layer(x)
            yield recording
            layer(x)

    first, second = stream(), stream()
    recordings = [next(first), next(second)]
    for generator in (first, second):  # first ends first
        assert next(generator, None) is None
    assert active_recordings() == ()
    layer(x)
    assert [len(recording) for recording in recordings] == [3, 3]
    third = stream()  # each step in a copy of this context, as a thread pool steps it
    contextvars.copy_context().run(next, third)
    assert contextvars.copy_context().run(next, third, None) is None
    layer(x)
    assert active_recordings() == () and [len(recording) for recording in recordings] == [3, 3]


def test_head_out_of_range_names_the_range():
    layer = MultiHeadAttention(8, 2)
    with record(layer) as rec:
        layer(torch.randn(1, 4, 8))
    with pytest.raises(IndexError, match=r"heads 0\.\.1"):
        rec[0].weights(head=5)


def test_negative_head_and_batch_count_from_the_end():
    torch.manual_seed(6)
    layer = MultiHeadAttention(8, 2).eval()
    with record(layer) as rec:
        layer(torch.randn(3, 4, 8), mask=torch.rand(3, 1, 4, 4) > 0.3)
    capture = rec[0]
    assert torch.equal(capture.weights(head=-1, batch=-1), capture.weights(head=1, batch=2))
    assert torch.equal(capture.weights(head=-2, batch=-3), capture.weights(head=0, batch=0))
    assert torch.equal(capture.weights(batch=-2), capture.weights(batch=1))
    assert torch.equal(capture.trace(-1, -1).output, capture.trace(1, 2).output)
    for batch in (3, -4):
        with pytest.raises(IndexError, match=rf"batch {batch} out of range: .* items 0\.\.2"):
            capture.weights(head=0, batch=batch)
    with pytest.raises(IndexError, match=r"head -3 out of range: .* heads 0\.\.1"):
        capture.weights(head=-3)


def test_a_cache_equals_the_uncached_layer_and_refuses_another_batch():
    # Causal attention over 5 tokens fed as 3 then 2 through a KVCache equals one call over
    # all 5 (float64, 1e-12). A cache reused for another batch size used to fail in torch.cat
    # ("Sizes of tensors must match"); it is now one line naming the cache and the fix.
    torch.manual_seed(9)
    layer = MultiHeadAttention(16, 4).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    cache = KVCache()
    parts = [layer(x[:, :3], causal=True, cache=cache), layer(x[:, 3:], causal=True, cache=cache)]
    torch.testing.assert_close(torch.cat(parts, 1), layer(x, causal=True), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match=r"holds keys of leading dims \(2, 4\).*got \(3, 4\)"):
        layer(torch.randn(3, 1, 16, dtype=torch.float64), causal=True, cache=cache)


@pytest.mark.parametrize("kind", ["multi-head", "grouped"])
def test_one_cache_for_two_layers_is_refused(kind):
    # Two blocks sharing one cache ran, each reading the other's keys: len(cache) 8 after 4
    # tokens and outputs 0.66 off the uncached run, with no error.
    torch.manual_seed(0)
    if kind == "multi-head":
        first, second = MultiHeadAttention(16, 4), MultiHeadAttention(16, 4)
    else:
        first, second = GroupedQueryAttention(16, 4, 2), GroupedQueryAttention(16, 4, 2)
    x = torch.randn(1, 3, 16)
    cache = KVCache()
    first(x, causal=True, cache=cache)
    first(x[:, :1], causal=True, cache=cache)  # the same layer goes on
    with pytest.raises(ValueError, match=r"holds another layer's keys and values; give each "):
        second(x, causal=True, cache=cache)
    assert len(cache) == 4


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_caches_earlier_keys_and_values_never_change_as_it_grows(dtype):
    """Steps of 3, 1, 1, 2, 1, 5, 1 and 0 tokens (the storage doubles three times, each step
    between writes in place): each returned key and value, read after the last step, still
    equals exactly the concatenation of the steps so far (torch.cat, the old cache), as does
    ``cache.key``/``.value``; the tensors of the first step are never written into; dtype
    and ``len`` follow the steps, with values wider than keys (7 and 5). The count of
    storages shows that the steps between doublings write into one."""
    torch.manual_seed(21)
    keys = [torch.randn(2, 2, n, 5).to(dtype) for n in (3, 1, 1, 2, 1, 5, 1, 0)]
    values = [torch.randn(2, 2, n, 7).to(dtype) for n in (3, 1, 1, 2, 1, 5, 1, 0)]
    first = keys[0].clone(), values[0].clone()
    cache = KVCache()
    assert len(cache) == 0 and cache.key is None and cache.value is None
    returned, storages = [], set()
    with torch.no_grad():
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            returned.append(cache.extend(key, value))
            storages.add(returned[-1][0].untyped_storage().data_ptr())
            assert len(cache) == sum(k.shape[-2] for k in keys[: i + 1])
    for i, (key, value) in enumerate(returned):
        assert key.dtype == value.dtype == dtype
        assert torch.equal(key, torch.cat(keys[: i + 1], dim=-2))
        assert torch.equal(value, torch.cat(values[: i + 1], dim=-2))
    assert torch.equal(cache.key, returned[-1][0]) and torch.equal(cache.value, returned[-1][1])
    assert torch.equal(keys[0], first[0]) and torch.equal(values[0], first[1])
    assert len(storages) == 4  # the first step's tensor, then 6, 12 and 24 positions


def test_a_cache_filled_under_inference_mode_extends_outside_it():
    """Storage made under torch.inference_mode() cannot be written in place outside it
    ("Inplace update to inference tensor"): the cache moves to a new one there, as torch.cat
    did; the keys and values equal the concatenation exactly."""
    keys = [torch.randn(1, 2, n, 4) for n in (3, 1, 1)]
    cache = KVCache()
    with torch.inference_mode():
        for key in keys[:2]:
            cache.extend(key, key)
    with torch.no_grad():
        key, value = cache.extend(keys[2], keys[2])
    assert torch.equal(key, torch.cat(keys, dim=-2)) and torch.equal(value, key)
    assert not key.is_inference()


def test_gradients_through_a_cache_of_many_steps_equal_the_uncached_layers():
    """Under autograd the cache concatenates (an in-place write would invalidate what the
    earlier steps saved for backward: "modified by an inplace operation"): 7 tokens fed as 2,
    1, 1, 3 to a rotary, grouped layer give the output and the gradients of the input and of
    every weight of one uncached call, float64 1e-12."""
    torch.manual_seed(22)
    layer = GroupedQueryAttention(12, 6, n_kv_heads=2, head_dim=4).double()
    x = torch.randn(2, 7, 12, dtype=torch.float64, requires_grad=True)
    cache = KVCache()
    parts = [layer(part, causal=True, cache=cache) for part in x.split([2, 1, 1, 3], dim=1)]
    cached = torch.cat(parts, dim=1)
    whole = layer(x, causal=True)
    torch.testing.assert_close(cached, whole, atol=1e-12, rtol=0)
    inputs = [x, *layer.parameters()]
    for ours, expected in zip(
        torch.autograd.grad(cached.square().sum(), inputs),
        torch.autograd.grad(whole.square().sum(), inputs),
        strict=True,
    ):
        torch.testing.assert_close(ours, expected, atol=1e-12, rtol=0)


# The Llama family's layers: RoPE, grouped-query attention, RMSNorm, SwiGLU.


def test_rope_makes_query_key_scores_depend_only_on_the_position_difference():
    """q at p and k at p' score q·k by p - p' alone: shifting both by s changes nothing
    (1e-5: the angles are float32, as Llama's reference computes them, whatever the input's
    dtype), while the same pair at another distance scores differently."""
    torch.manual_seed(11)
    rope = RotaryPositions(head_dim=8, theta=10000.0)
    query, key = torch.randn(2, 1, 8, dtype=torch.float64)

    def score(p: int, p_key: int) -> Tensor:
        return (rope(query, p) * rope(key, p_key)).sum()

    for p, p_key in [(0, 0), (5, 2), (3, 9), (40, 1)]:
        for shift in (1, 7, 100):
            shifted = score(p + shift, p_key + shift)
            torch.testing.assert_close(shifted, score(p, p_key), atol=1e-5, rtol=0)
    assert not torch.isclose(score(5, 2), score(5, 3))
    torch.testing.assert_close(rope(query, 0), query)  # position 0: no turn at all


def test_rope_turns_pairs_of_dims_half_a_head_apart_keeping_their_length():
    rope = RotaryPositions(head_dim=6)
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    turned = rope(x, offset=4)
    pairs = (x[..., :3] ** 2 + x[..., 3:] ** 2, turned[..., :3] ** 2 + turned[..., 3:] ** 2)
    torch.testing.assert_close(*pairs)  # each pair (i, i + D/2) keeps its length
    with pytest.raises(ValueError, match="head_dim must be even, got 5"):
        RotaryPositions(5)


def test_grouped_query_attention_shares_each_key_value_head_with_its_group():
    """6 query heads over 2 key/value heads: the layer equals itself with each key/value head
    copied into its 3 query heads (plain multi-head attention, n_kv_heads=6), float64 1e-12,
    on every CPU backend; the recording holds per-query-head keys, heads 0-2 sharing one."""
    torch.manual_seed(12)
    grouped = GroupedQueryAttention(12, 6, n_kv_heads=2, head_dim=4, qkv_bias=True).double()
    plain = GroupedQueryAttention(12, 6, n_kv_heads=6, head_dim=4, qkv_bias=True).double()
    with torch.no_grad():
        for name in ("W_k", "W_v"):
            source, target = getattr(grouped, name), getattr(plain, name)
            target.weight.copy_(source.weight.view(2, 1, 4, 12).expand(2, 3, 4, 12).reshape(24, 12))
            target.bias.copy_(source.bias.view(2, 1, 4).expand(2, 3, 4).reshape(24))
        for name in ("W_q", "W_o"):
            getattr(plain, name).load_state_dict(getattr(grouped, name).state_dict())
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    padding = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    padding[1, ..., 5:] = False
    expected = plain(x, mask=padding, causal=True)
    for backend in ("explicit", "sdpa", "chunked"):
        grouped.backend = backend
        torch.testing.assert_close(
            grouped(x, mask=padding, causal=True), expected, atol=1e-12, rtol=0
        )
    with record(grouped) as rec:
        grouped(x, causal=True)
    key = rec[0].key  # (B, H, S, D): the key each query head used
    assert key.shape == (2, 6, 7, 4)
    assert torch.equal(key[:, 0], key[:, 2]) and torch.equal(key[:, 3], key[:, 5])
    assert not torch.equal(key[:, 2], key[:, 3])


def test_grouped_query_attention_with_rope_passes_gradcheck():
    """float64 gradcheck (eps 1e-6, atol 1e-8) of the rotary, grouped layer, causal, through
    a cache of 2 tokens (the new tokens' positions start after them)."""
    torch.manual_seed(13)
    layer = GroupedQueryAttention(8, 4, n_kv_heads=2, head_dim=4, qk_norm_eps=1e-6).double()
    past = torch.randn(1, 2, 8, dtype=torch.float64)
    x = torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True)

    def run(x: Tensor) -> Tensor:
        cache = KVCache()
        layer(past, causal=True, cache=cache)
        return layer(x, causal=True, cache=cache)

    assert torch.autograd.gradcheck(run, (x,), eps=1e-6, atol=1e-8)


def test_grouped_query_attention_refuses_heads_that_do_not_group():
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be divisible by n_kv_heads \(4\)"):
        GroupedQueryAttention(12, 6, n_kv_heads=4)
    with pytest.raises(ValueError, match=r"d_model \(10\) must be divisible by n_heads \(3\)"):
        GroupedQueryAttention(10, 3)


def test_grouped_query_attention_takes_an_empty_batch_or_sequence():
    """Before: "cannot reshape tensor of 0 elements into shape [0, 7, -1, 4]" (the head split
    asked view() for -1 heads of nothing); an empty batch or sequence gives an empty output,
    as MultiHeadAttention's does."""
    layer = GroupedQueryAttention(12, 6, n_kv_heads=2, head_dim=4)
    assert layer(torch.randn(0, 7, 12), causal=True).shape == (0, 7, 12)
    assert layer(torch.randn(2, 0, 12), causal=True, cache=KVCache()).shape == (2, 0, 12)


def test_grouped_query_attention_masks_per_query_head_or_refuses_another_head_count():
    """A mask's head axis is 1 or one per query head (6), each head getting its own rows
    (float64, 1e-12 to SDPA over the key/value heads repeated); 2 or 3 on that axis is
    refused in one line, as broadcasting to 6 heads refuses it. Before: 3 passed silently
    as a mask per head of each group (heads 0 and 3 shared one), 2 failed in unflatten."""
    torch.manual_seed(14)
    layer = GroupedQueryAttention(12, 6, n_kv_heads=2, head_dim=4).double()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    mask = torch.rand(2, 6, 5, 5) > 0.4
    mask[..., 0] = True
    query = layer.rotary(layer.split_heads(layer.W_q(x)))
    key = layer.rotary(layer.split_heads(layer.W_k(x))).repeat_interleave(3, dim=1)
    value = layer.split_heads(layer.W_v(x)).repeat_interleave(3, dim=1)
    heads = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    expected = layer.W_o(heads.transpose(1, 2).reshape(2, 5, 24))
    torch.testing.assert_close(layer(x, mask=mask), expected, atol=1e-12, rtol=0)
    for count in (3, 2):
        with pytest.raises(ValueError, match=rf"has {count} on its head axis .* 6 query heads; "):
            layer(x, mask=mask[:, :count])


def test_an_input_that_is_no_tensor_gets_one_line():
    """Before: AttributeError "'list' object has no attribute 'dim'" (and "'dict' object has no
    attribute 'extend'" for a cache that is no KVCache)."""
    rows = [[0.0] * 8] * 3
    for layer in (SelfAttention(8), MultiHeadAttention(8, 2), GroupedQueryAttention(8, 2)):
        with pytest.raises(TypeError, match=r"x must be a torch\.Tensor .*, got list; "):
            layer(rows)
    for layer in (MultiHeadAttention(8, 2), GroupedQueryAttention(8, 2)):
        with pytest.raises(TypeError, match=r"cache must be a selfattn\.KVCache .*, got dict"):
            layer(torch.randn(1, 3, 8), cache={})
    with pytest.raises(TypeError, match=r"record\(\) takes the models .*, got str"):
        record("encoder").__enter__()


@pytest.mark.parametrize("positions", [SinusoidalPositions(10, 8), LearnedPositions(10, 8)])
def test_positions_of_another_width_get_one_line(positions):
    """Before: torch's "The size of tensor a (6) must match the size of tensor b (8)"."""
    with pytest.raises(ValueError, match=r"shape \(\.\.\., length, 8\) .* got \(2, 5, 6\)"):
        positions(torch.randn(2, 5, 6))


def test_rotary_positions_of_another_head_size_are_refused():
    """Before: RotaryPositions(2) in a layer of 4-dim heads silently turned only their first
    two dims (partial RoPE nobody asked for), RotaryPositions(8) on 16-dim rows did the same,
    and RotaryPositions(8) on 4-dim heads failed with torch's "The size of tensor a (4) must
    match the size of tensor b (8)"."""
    with pytest.raises(ValueError, match=r"rotary turns heads of 2 dims .* head_dim=4; "):
        GroupedQueryAttention(16, 4, rotary=RotaryPositions(2))
    with pytest.raises(ValueError, match=r"rotary turns heads of 8 dims .* head_dim=4; "):
        GroupedQueryAttention(16, 4, rotary=RotaryPositions(8))
    for width in (16, 4):
        with pytest.raises(ValueError, match=rf"\(\.\.\., length, 8\) .*, got \(1, 3, {width}\)"):
            RotaryPositions(8)(torch.randn(1, 3, width))
    partial = GroupedQueryAttention(16, 4, rotary=RotaryPositions(4, rotary_dim=2))
    assert partial(torch.randn(1, 3, 16)).shape == (1, 3, 16)  # partial RoPE, as asked


def test_rms_norm_and_swiglu_by_hand():
    norm = RMSNorm(4, eps=0.0)
    torch.testing.assert_close(norm(torch.tensor([3.0, 4.0, 0.0, 0.0])), torch.tensor(
        [3.0, 4.0, 0.0, 0.0]) / 2.5)  # fmt: skip
    assert norm.half()(torch.ones(2, 4, dtype=torch.float16)).dtype == torch.float16
    mlp = GatedFeedForward(3, 5)
    x = torch.randn(2, 3)
    expected = mlp.down(torch.nn.functional.silu(mlp.gate(x)) * mlp.up(x))
    torch.testing.assert_close(mlp(x), expected)


def test_rms_norm_of_another_width_is_one_line():
    """RMSNorm(8) on 6-wide rows broadcast its weight and failed in torch's words."""
    with pytest.raises(ValueError, match=r"RMSNorm\(8\) got x of shape \(2, 6\); .* must be 8"):
        RMSNorm(8)(torch.randn(2, 6))


def test_rms_norm_in_bfloat16_equals_hugging_faces_llama_rms_norm_bit_for_bit():
    """In bfloat16 the weight multiplies the normalised rows after their cast to bfloat16, as
    Hugging Face's ``LlamaRMSNorm`` does (a cast after a float32 multiply rounds differently).
    Oracle: transformers' LlamaRMSNorm with the same weight (~N(1, 0.3)); equal exactly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(3)
    weight = (1 + 0.3 * torch.randn(64, generator=generator)).to(torch.bfloat16)
    x = torch.randn(4, 64, generator=generator).to(torch.bfloat16)
    ours, theirs = RMSNorm(64, eps=1e-6).to(torch.bfloat16), LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.to(torch.bfloat16).weight.copy_(weight)
    got, want = ours(x), theirs(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_partial_rope_passes_the_unturned_dims_and_scores_by_position_difference():
    """GPT-NeoX's partial RoPE (rotary_dim 4 of head_dim 10): dims 4.. pass through unchanged
    at every position; the turned dims keep their pairs' lengths and score q·k by the
    position difference alone (1e-5, float32 angles); the frequencies are those of a
    4-dim RoPE."""
    torch.manual_seed(14)
    rope = RotaryPositions(head_dim=10, rotary_dim=4)
    query, key = torch.randn(2, 3, 10, dtype=torch.float64)
    for offset in (0, 3, 50):
        assert torch.equal(rope(query, offset)[..., 4:], query[..., 4:])
    turned, unturned = rope(query, 7)[..., :4], query[..., :4]
    pairs = (
        turned[..., :2] ** 2 + turned[..., 2:] ** 2,
        unturned[..., :2] ** 2 + unturned[..., 2:] ** 2,
    )
    torch.testing.assert_close(*pairs)  # each pair (i, i + 2) keeps its length
    torch.testing.assert_close(rope.frequencies(), RotaryPositions(4).frequencies())

    def score(p: int, p_key: int) -> Tensor:
        return (rope(query[:1], p) * rope(key[:1], p_key)).sum()

    for p, p_key in [(0, 0), (5, 2), (3, 9)]:
        for shift in (1, 7, 100):
            shifted = score(p + shift, p_key + shift)
            torch.testing.assert_close(shifted, score(p, p_key), atol=1e-5, rtol=0)
    assert not torch.isclose(score(5, 2), score(5, 3))
    with pytest.raises(ValueError, match="rotary_dim must be even, got 3"):
        RotaryPositions(10, rotary_dim=3)
    with pytest.raises(ValueError, match=r"rotary_dim \(12\) cannot exceed head_dim \(10\)"):
        RotaryPositions(10, rotary_dim=12)


def test_gemma_rms_norm_scales_by_one_plus_its_weight():
    """Gemma's weights are offsets from 1 (a new layer's are 0: the plain norm); the product
    is taken in float32 before the cast back."""
    norm = RMSNorm(4, eps=0.0, unit_offset=True)
    x = torch.tensor([3.0, 4.0, 0.0, 0.0])
    torch.testing.assert_close(norm(x), x / 2.5)
    with torch.no_grad():
        norm.weight.fill_(0.5)
    torch.testing.assert_close(norm(x), x / 2.5 * 1.5)
    assert norm.half()(torch.ones(2, 4, dtype=torch.float16)).dtype == torch.float16
