"""The attention core against torch SDPA, closed forms, gradcheck and properties.

Tolerances (absolute, unless stated): float64 1e-12, float32 1e-5; float16/bfloat16 no worse
than twice SDPA's own error against a float64 reference (plus 1e-6 for rounding at zero).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from selfattn import AttentionTrace, attention
from selfattn.attention import BACKENDS, causal_mask

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
EXACT_BACKENDS = ("explicit", "sdpa", "auto")

# (batch dims, T, S, D, Dv): prime sizes so a swapped axis fails loudly.
SHAPES = [
    ((), 1, 1, 1, 1),
    ((2,), 7, 7, 5, 3),
    ((2, 3), 7, 11, 5, 13),
    ((1, 2), 97, 97, 59, 59),
    ((3,), 13, 5, 16, 7),
    ((2, 2, 2), 4, 6, 8, 8),
]


def qkv(lead, t, s, d, dv, dtype=torch.float64, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(*lead, n, m, generator=gen, dtype=torch.float64).to(dtype)
        for n, m in ((t, d), (s, d), (s, dv))
    ]
    return [x.requires_grad_(grad) for x in tensors]


def sdpa(q, k, v, mask=None, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_sdpa_without_mask(backend, dtype, shape):
    q, k, v = qkv(*shape, dtype=dtype)
    expected = sdpa(q, k, v)
    torch.testing.assert_close(
        attention(q, k, v, backend=backend), expected, atol=TOL[dtype], rtol=0
    )


def random_masks(lead, t, s, seed=1):
    """Boolean and float masks: full shape and broadcast over batch/heads."""
    gen = torch.Generator().manual_seed(seed)
    full_bool = torch.rand(*lead, t, s, generator=gen) > 0.3
    full_bool[..., 0] = True  # no fully masked rows here; those are tested below
    row_bool = torch.rand(t, s, generator=gen) > 0.3
    row_bool[:, -1] = True
    float_mask = torch.randn(*lead, t, s, generator=gen, dtype=torch.float64)
    key_padding = torch.ones(*lead[:1], *([1] * max(len(lead) - 1, 0)), 1, s, dtype=torch.bool)
    key_padding[..., -1] = s == 1  # mask the last key (unless it is the only one)
    return {
        "bool": full_bool,
        "bool-broadcast": row_bool,
        "float": float_mask,
        "float-broadcast": float_mask[(0,) * len(lead)] if lead else float_mask,
        "key-padding": key_padding,
    }


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_matches_sdpa_with_masks(backend, dtype, shape):
    lead, t, s = shape[:3]
    q, k, v = qkv(*shape, dtype=dtype)
    for name, mask in random_masks(lead, t, s).items():
        mask = mask if mask.dtype == torch.bool else mask.to(dtype)
        got = attention(q, k, v, mask=mask, backend=backend)
        torch.testing.assert_close(got, sdpa(q, k, v, mask), atol=TOL[dtype], rtol=0, msg=name)


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_gradients_match_sdpa(backend):
    shape = ((2, 3), 7, 11, 5, 13)
    mask = random_masks(shape[0], 7, 11)["float"]
    ours = qkv(*shape, grad=True)
    ref = qkv(*shape, grad=True)
    attention(*ours, mask=mask, backend=backend).pow(2).sum().backward()
    sdpa(*ref, mask).pow(2).sum().backward()
    for mine, theirs in zip(ours, ref, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_causal_equal_lengths_matches_sdpa(backend):
    q, k, v = qkv((2, 3), 9, 9, 5, 5)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(
        attention(q, k, v, causal=True, backend=backend), expected, atol=1e-12, rtol=0
    )


def test_causal_mask_is_bottom_right_by_hand():
    # T=2 queries after 2 cached keys: query 0 sees keys 0..2, query 1 sees all four.
    expected = torch.tensor([[True, True, True, False], [True, True, True, True]])
    assert torch.equal(causal_mask(2, 4), expected)
    # T > S: the first T-S queries see nothing.
    assert torch.equal(
        causal_mask(3, 2), torch.tensor([[False, False], [True, False], [True, True]])
    )


@pytest.mark.parametrize("backend", [*EXACT_BACKENDS, "chunked"])
@pytest.mark.parametrize("t,s", [(1, 5), (2, 5), (3, 8), (8, 8), (8, 3)])
def test_causal_bottom_right_against_hand_built_mask(backend, t, s):
    q, k, v = qkv((2,), t, s, 4, 4)
    allowed = torch.tensor([[j <= i + (s - t) for j in range(s)] for i in range(t)])
    expected = attention(q, k, v, mask=allowed, backend="explicit")
    got = attention(q, k, v, causal=True, backend=backend)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    if t > s:  # rows with no key at all give 0
        assert torch.all(got[..., : t - s, :] == 0)


@pytest.mark.parametrize("backend", ["explicit", "sdpa"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zero_without_nan(backend, kind):
    q, k, v = qkv((2, 2), 5, 6, 4, 3, grad=True)
    allowed = torch.ones(5, 6, dtype=torch.bool)
    allowed[1] = False
    allowed[3, :4] = False
    mask = (
        allowed
        if kind == "bool"
        else torch.zeros(5, 6, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    )
    output = attention(q, k, v, mask=mask, backend=backend)
    assert not output.isnan().any()
    assert torch.all(output[..., 1, :] == 0)
    output.sum().backward()
    for tensor in (q, k, v):
        assert not tensor.grad.isnan().any()
    assert torch.all(q.grad[..., 1, :] == 0)
    _, trace = attention(q, k, v, mask=mask, backend="explicit", return_trace=True)
    assert torch.all(trace.weights[..., 1, :] == 0)
    torch.testing.assert_close(
        trace.weights[..., 3, :].sum(-1), torch.ones(2, 2, dtype=torch.float64), atol=1e-12, rtol=0
    )


def compile_whole(fn):
    """``fn`` under ``torch.compile(fullgraph=True)``: any graph break is an error.

    Backend "aot_eager": dynamo's graph and AOTAutograd's traced backward, run by the eager
    kernels, so the forward and the gradients are traced in seconds on the CPU, with no
    Inductor C++ build; a graph break fails the same way whichever backend runs the graph.
    """
    torch._dynamo.reset()  # an empty cache: attention()'s variants stay below the recompile limit
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize(("causal", "similarity"), [(False, "dot"), (True, "cosine")])
def test_compiles_whole_with_masks_and_matches_eager(backend, kind, causal, similarity):
    """fullgraph=True with a mask and a fully masked row (before: a graph break at the
    ``bool(empty_rows.any())`` of the sdpa path); float64 outputs and gradients equal eager's
    within 1e-12, and the fully masked row is 0, its gradient too, with no NaN anywhere."""
    q, k, v = qkv((2, 2), 5, 6, 4, 3, grad=True)
    allowed = torch.rand(5, 6, generator=torch.Generator().manual_seed(5)) > 0.3
    allowed[:, -1] = True
    allowed[1] = False  # query 1: nothing to attend
    mask = (
        allowed if kind == "bool" else torch.zeros(5, 6).double().masked_fill(~allowed, -math.inf)
    )
    upstream = torch.randn(2, 2, 5, 3, generator=torch.Generator().manual_seed(6)).double()

    def run(q, k, v, mask):
        return attention(q, k, v, mask=mask, causal=causal, similarity=similarity, backend=backend)

    results = []
    for fn in (run, compile_whole(run)):
        output = fn(q, k, v, mask)
        results.append((output, *torch.autograd.grad(output, (q, k, v), upstream)))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-12, rtol=0)
        assert not compiled.isnan().any()
    output, q_grad, _, _ = results[1]
    assert torch.all(output[..., 1, :] == 0) and torch.all(q_grad[..., 1, :] == 0)


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_no_worse_than_twice_sdpa(backend, dtype):
    q64, k64, v64 = qkv((2, 4), 33, 47, 64, 64, seed=3)
    mask = torch.rand(33, 47, generator=torch.Generator().manual_seed(4)) > 0.2
    mask[:, 0] = True
    reference = sdpa(q64, k64, v64, mask)
    q, k, v = (x.to(dtype) for x in (q64, k64, v64))
    ours = attention(q, k, v, mask=mask, backend=backend)
    assert ours.dtype == dtype
    our_error = (ours.double() - reference).abs().max()
    sdpa_error = (sdpa(q, k, v, mask).double() - reference).abs().max()
    assert our_error <= 2 * sdpa_error + 1e-6, (our_error, sdpa_error)


@pytest.mark.parametrize("backend", [*EXACT_BACKENDS, "chunked"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_cosine_of_zero_and_long_vectors_within_twice_sdpa(backend, dtype):
    # Cosine normalised in the inputs' dtype: in float16 a zero key's norm rounded to 0 (NaN
    # in every row) and a norm past 65504 to inf (that row's scores all 0: uniform weights).
    # Normalised in float32 now; error at most twice SDPA's on the same inputs, normalised
    # in float32 and cast, against float64 (+ 1e-6).
    q64, k64, v64 = qkv((2,), 9, 11, 64, 64, seed=5)
    k64[:, 3] = 0
    q64[:, 2] *= 1e4  # entries up to about 4e4, a norm near 1e5
    k64[:, 5] *= 1e4
    unit = (F.normalize(q64, dim=-1), F.normalize(k64, dim=-1))
    reference = sdpa(*unit, v64, scale=8.0)
    q, k, v = (x.to(dtype) for x in (q64, k64, v64))
    ours = attention(q, k, v, similarity="cosine", scale=8.0, backend=backend)
    their_inputs = (*(x.float().to(dtype) for x in unit), v)
    sdpa_error = (sdpa(*their_inputs, scale=8.0).double() - reference).abs().max()
    our_error = (ours.double() - reference).abs().max()
    assert our_error <= 2 * sdpa_error + 1e-6, (our_error, sdpa_error)


def test_reduced_precision_gradients_no_worse_than_twice_sdpa():
    dtype = torch.bfloat16
    shape = ((2, 2), 17, 23, 32, 32)
    reference = qkv(*shape, grad=True)
    sdpa(*reference).pow(2).sum().backward()
    ours = [x.detach().to(dtype).requires_grad_() for x in reference]
    theirs = [x.detach().to(dtype).requires_grad_() for x in reference]
    attention(*ours, backend="explicit").float().pow(2).sum().backward()
    sdpa(*theirs).float().pow(2).sum().backward()
    for mine, other, exact in zip(ours, theirs, reference, strict=True):
        our_error = (mine.grad.double() - exact.grad).abs().max()
        sdpa_error = (other.grad.double() - exact.grad).abs().max()
        assert our_error <= 2 * sdpa_error + 1e-6


def test_worked_by_hand_two_keys():
    # scores [0, 1] with scale 1 -> weights [1, e] / (1 + e); output the weighted sum of values.
    query = torch.tensor([[1.0]], dtype=torch.float64)
    key = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    value = torch.tensor([[10.0, 0.0], [0.0, 10.0]], dtype=torch.float64)
    output, trace = attention(query, key, value, scale=1.0, backend="explicit", return_trace=True)
    e = math.e
    expected_weights = torch.tensor([[1 / (1 + e), e / (1 + e)]], dtype=torch.float64)
    torch.testing.assert_close(trace.weights, expected_weights, atol=1e-15, rtol=0)
    torch.testing.assert_close(output, 10 * expected_weights, atol=1e-14, rtol=0)
    assert trace.scale == 1.0 and trace.similarity == "dot"


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = qkv((), 3, 4, 16, 2)
    _, trace = attention(q, k, v, backend="explicit", return_trace=True)
    assert trace.scale == 0.25
    torch.testing.assert_close(trace.scaled, trace.scores / 4, atol=1e-15, rtol=0)


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_cosine_similarity_against_normalised_sdpa(backend):
    q, k, v = qkv((2, 3), 7, 9, 5, 4)
    expected = sdpa(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, scale=math.sqrt(5))
    got = attention(q, k, v, similarity="cosine", backend=backend)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    _, trace = attention(q, k, v, similarity="cosine", return_trace=True)
    assert trace.scale == math.sqrt(5)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True},
        {"similarity": "cosine"},
        {"scale": 0.7},
        {"mask": "bool"},
        {"mask": "float"},
        {"mask": "fully-masked-row"},
    ],
)
def test_gradcheck_explicit(options):
    q, k, v = qkv((2,), 4, 5, 3, 2, grad=True)
    options = dict(options)
    mask = options.pop("mask", None)
    if mask == "bool":
        options["mask"] = torch.tensor([[True, False, True, True, False]] * 4)
    elif mask == "float":
        options["mask"] = torch.randn(4, 5, dtype=torch.float64)
    elif mask == "fully-masked-row":
        allowed = torch.ones(4, 5, dtype=torch.bool)
        allowed[2] = False
        options["mask"] = allowed

    def run(q, k, v):
        return attention(q, k, v, backend="explicit", **options)

    assert torch.autograd.gradcheck(run, (q, k, v), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True},  # T != S: bottom-right, through a (T, S) mask
        {"similarity": "cosine", "scale": 0.7},
        {"mask": "bool"},
        {"mask": "float"},  # its gradient too
        {"mask": "fully-masked-row"},
    ],
)
def test_second_derivatives_of_torch_kernel(options):
    """gradgradcheck (float64 finite differences, atol 1e-8; fast mode: random directions)
    through torch's fused
    kernel: its backward has no derivative of its own (torch 2.13 on CPU: "derivative for
    aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented"), so a
    backward asked for a graph recomputes through the math kernel."""
    q, k, v = qkv((), 3, 4, 8, 8, grad=True)  # value dim = head dim: torch takes its fused kernel
    options = dict(options)
    kind = options.pop("mask", None)
    inputs = [q, k, v]
    if kind == "bool":
        options["mask"] = torch.tensor([[True, False, True, False]] * 3)
    elif kind == "float":  # an input, differentiated: run takes it
        inputs.append(torch.randn(3, 4, dtype=torch.float64, requires_grad=True))
    elif kind == "fully-masked-row":
        allowed = torch.ones(3, 4, dtype=torch.bool)
        allowed[1] = False
        options["mask"] = allowed

    def run(q, k, v, *float_mask):
        mask = float_mask[0] if float_mask else options.get("mask")
        others = {key: value for key, value in options.items() if key != "mask"}
        return attention(q, k, v, mask=mask, backend="sdpa", **others)

    assert torch.autograd.gradcheck(run, tuple(inputs), eps=1e-6, atol=1e-8, fast_mode=True)
    assert torch.autograd.gradgradcheck(run, tuple(inputs), eps=1e-6, atol=1e-8, fast_mode=True)


def test_gradient_penalty_through_a_layer_equals_the_explicit_one():
    """A gradient penalty (the norm of d output / d input, itself differentiated) through
    MultiHeadAttention on the default backend equals the reference's, within 1e-12 (float64)."""
    from selfattn import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    penalties = {}
    for backend in ("auto", "explicit"):
        layer.backend = backend
        inputs = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(layer(inputs).square().sum(), inputs, create_graph=True)
        layer.zero_grad()
        grad.square().sum().backward()
        penalties[backend] = [p.grad.clone() for p in layer.parameters()]
    for got, want in zip(penalties["auto"], penalties["explicit"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_torch_kernel_backward_twice_with_retained_graph_and_once_without():
    """retain_graph=True lets a second backward run (the same gradients, exactly); without it
    a second backward is torch's usual error, as for any graph already freed."""
    q, k, v = qkv((2,), 6, 6, 4, 4, grad=True)
    output = attention(q, k, v, causal=True, backend="sdpa")
    first = torch.autograd.grad(output.sum(), q, retain_graph=True)[0]
    second = torch.autograd.grad(output.sum(), q)[0]
    assert torch.equal(first, second)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(output.sum(), q)


def test_second_derivatives_when_one_tensor_is_query_key_and_value():
    """attention(x, x, x) and attention(x, x, v): a gradient taken with create_graph=True is
    the explicit path's within 1e-12 (float64), and so is its own gradient. The first version
    gave each argument the whole gradient of x, 3x (2x) the true one."""
    x = torch.randn(1, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    v = torch.randn(1, 4, 8, dtype=torch.float64)
    results = {}
    for backend in ("sdpa", "explicit"):
        inputs = [x.clone().requires_grad_(), v.clone().requires_grad_()]
        (grad,) = torch.autograd.grad(
            attention(inputs[0], inputs[0], inputs[0], backend=backend).square().sum()
            + attention(inputs[0], inputs[0], inputs[1], backend=backend).sum(),
            inputs[0],
            create_graph=True,
        )
        grad.square().sum().backward()
        results[backend] = (grad.detach(), inputs[0].grad, inputs[1].grad)
    for got, want in zip(results["sdpa"], results["explicit"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_torch_kernel_output_may_change_in_place_and_keeps_nothing_after_backward():
    """The output may be changed in place (a view made by an autograd.Function may not be:
    the first version refused ``out += 1``), and after backward nothing holds the query: a
    context that kept the call kept q, k and v of every layer until the graph was dropped."""
    import weakref

    leaf = torch.randn(2, 2, 6, 8, requires_grad=True)
    query = leaf * 1.0
    alive = weakref.ref(query)
    output = attention(query, leaf, leaf, causal=True, backend="sdpa")
    del query
    output += 1
    output.sum().backward()
    assert alive() is None
    expected = torch.autograd.grad(
        attention(leaf, leaf, leaf, causal=True, backend="explicit").sum(), leaf
    )[0]
    torch.testing.assert_close(leaf.grad, expected, atol=1e-5, rtol=0)


sizes = st.integers(min_value=1, max_value=9)


@settings(max_examples=40, deadline=None)
@given(t=sizes, s=sizes, d=sizes, dv=sizes, seed=st.integers(0, 10_000))
def test_property_rows_sum_to_one_and_shapes(t, s, d, dv, seed):
    q, k, v = qkv((2,), t, s, d, dv, seed=seed)
    output, trace = attention(q, k, v, return_trace=True)
    assert output.shape == (2, t, dv)
    assert trace.weights.shape == (2, t, s)
    torch.testing.assert_close(
        trace.weights.sum(-1), torch.ones(2, t, dtype=torch.float64), atol=1e-12, rtol=0
    )
    assert torch.all((trace.weights >= 0) & (trace.weights <= 1))


@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(2, 9),
    d=sizes,
    seed=st.integers(0, 10_000),
    backend=st.sampled_from(EXACT_BACKENDS),
)
def test_property_permuting_tokens_permutes_outputs(t, d, seed, backend):
    # Without positions, self-attention is permutation-equivariant (tolerance 1e-12, float64).
    (x,) = qkv((), t, t, d, d, seed=seed)[:1]
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(seed))
    output = attention(x, x, x, backend=backend)
    permuted = attention(x[perm], x[perm], x[perm], backend=backend)
    torch.testing.assert_close(permuted, output[perm], atol=1e-12, rtol=0)


@settings(max_examples=30, deadline=None)
@given(t=sizes, s=sizes, d=sizes, seed=st.integers(0, 10_000), big=st.floats(1e-3, 1e3))
def test_property_cosine_scores_lie_in_unit_interval(t, s, d, seed, big):
    q, k, v = qkv((), t, s, d, 2, seed=seed)
    _, trace = attention(q * big, k, v, similarity="cosine", return_trace=True)
    assert trace.scores.abs().max() <= 1 + 1e-12


def test_trace_from_a_fused_backend_is_a_clear_error():
    q, k, v = qkv((), 3, 3, 2, 2)
    with pytest.raises(ValueError, match="cannot return a trace"):
        attention(q, k, v, backend="sdpa", return_trace=True)


@pytest.mark.parametrize(
    "args,match",
    [
        ({"k": (3, 5)}, "same last dim"),
        ({"v": (4, 2)}, "same length"),
        ({"backend": "nope"}, "unknown attention backend"),
        ({"backend": ["sdpa"]}, "unknown attention backend"),
        ({"similarity": "euclid"}, "unknown similarity"),
        ({"causal": "no"}, "causal must be True or False, got 'no'"),
        ({"causal": torch.tensor(False)}, "causal must be True or False"),
        ({"mask": torch.ones(5, 5, dtype=torch.bool)}, "does not broadcast.*that size or 1"),
        ({"q": (2, 3, 4), "k": (1, 3, 4), "v": (1, 3, 2)}, "same leading.*repeat_interleave"),
        ({"mask": torch.ones(3, 3, dtype=torch.long)}, "boolean"),
        ({"dtype_k": torch.float32}, "share a dtype"),
        ({"dropout_p": 1.5}, "dropout_p"),
        ({"dropout_p": "0.1"}, "dropout_p must be a finite number, got '0.1'"),
        ({"dropout_p": None}, "dropout_p must be a finite number, got None"),
        ({"q": (3, 0), "k": (3, 0)}, "head dim of 0"),
        ({"as_list": True}, "must be a torch.Tensor, got list"),
        ({"mask": [[True] * 3] * 3}, "mask must be a torch.Tensor"),
        ({"scale": "0.5"}, "scale must be a finite number"),
        ({"scale": True}, "scale must be a finite number, got True"),  # was read as 1.0
        ({"dropout_p": True}, "dropout_p must be a finite number, got True"),  # said "got 1.0"
        ({"scale": torch.ones(2)}, "scale must be a finite number"),
    ],
)
def test_bad_input_is_a_one_line_error(args, match):
    q = torch.randn(*args.pop("q", (3, 4)), dtype=torch.float64)
    k = torch.randn(*args.pop("k", (3, 4)), dtype=args.pop("dtype_k", torch.float64))
    v = torch.randn(*args.pop("v", (3, 2)), dtype=torch.float64)
    if args.pop("as_list", False):
        q = q.tolist()
    with pytest.raises(ValueError, match=match) as error:
        attention(q, k, v, **args)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("scale", [0.5, np.float32(0.5), torch.tensor(0.5)])
def test_scale_is_any_one_number(scale):
    q, k, v = qkv((2,), 3, 4, 5, 2)
    torch.testing.assert_close(  # float64, the same computation: 1e-12
        attention(q, k, v, scale=scale), attention(q, k, v, scale=0.5), atol=1e-12, rtol=0
    )


def test_a_scale_that_needs_a_gradient_is_refused_not_silently_detached():
    """A learnable scale (a tensor requiring grad) got no gradient: it was read as a float.
    Refused with one line naming the way to learn it; under no_grad it is just a number
    (float64, 1e-12)."""
    q, k, v = qkv((2,), 3, 4, 5, 2)
    learned = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"requires grad.*multiply the query by it") as error:
        attention(q, k, v, scale=learned)
    assert "\n" not in str(error.value)
    with torch.no_grad():
        output = attention(q, k, v, scale=learned)
    torch.testing.assert_close(output, attention(q, k, v, scale=0.5), atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", [*EXACT_BACKENDS, "chunked"])
@pytest.mark.parametrize("value", [-1e5, 7e4, -3e38])
def test_float16_with_a_float32_mask_beyond_its_range(backend, value):
    """A float32 mask whose values overflow float16 (-3e38: near finfo.min, a bias still) is
    computed in float32, as on the explicit path: no inf - inf, no rows lost. Tolerance: twice
    the explicit path's own float16 error against float64, plus 1e-3."""
    q, k, v = qkv((2, 3), 4, 6, 8, 8)
    mask = torch.zeros(2, 1, 4, 6)
    mask[0, 0, 1] = value  # a whole row at the value: its softmax is that of the scores
    mask[1, 0, :, 2] = value  # one key out (or, at 7e4, one key everything)
    reference = attention(q, k, v, mask=mask.double(), backend="explicit")
    half = [x.half() for x in (q, k, v)]
    own = attention(*half, mask=mask, backend="explicit").double()
    output = attention(*half, mask=mask, backend=backend)
    assert output.dtype == torch.float16 and torch.isfinite(output).all()
    bound = 2 * (own - reference).abs().max() + 1e-3
    assert (output.double() - reference).abs().max() <= bound


def test_float16_with_a_float32_mask_compiles_whole_in_float32():
    """Eager sdpa asks whether a wider float mask overflows float16 (a bool of tensor data, a
    graph break before); compiled, it always runs such a call in float32: the float32 result
    cast to float16, within float16's rounding near 1 (1e-3)."""
    half = qkv((2, 3), 4, 6, 8, 8, dtype=torch.float16)
    mask = torch.randn(2, 1, 4, 6, generator=torch.Generator().manual_seed(7))
    expected = attention(*(x.float() for x in half), mask=mask, backend="sdpa").half()
    compiled = compile_whole(lambda q, k, v, mask: attention(q, k, v, mask=mask, backend="sdpa"))
    output = compiled(*half, mask)
    assert output.dtype == torch.float16
    torch.testing.assert_close(output, expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_biases_at_the_float_limits_as_on_the_explicit_path(dtype):
    """A finite bias next above finfo.min (which masks) or at finfo.max times log2(e) must
    not overflow: a row all at the former is a plain softmax of equal biases, not an empty
    row, and a key at finfo.max takes all of its row's weight, not NaN. Tolerance: TOL."""
    q, k, v = qkv((2, 1), 4, 5, 8, 8, dtype=dtype)
    mask = torch.zeros(2, 1, 1, 5, dtype=dtype)
    lowest = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    mask[0] = torch.nextafter(lowest, torch.zeros_like(lowest))
    mask[1, ..., 3] = torch.finfo(dtype).max
    expected = attention(q, k, v, mask=mask, backend="explicit")
    torch.testing.assert_close(  # TOL[dtype] absolute
        attention(q, k, v, mask=mask, backend="chunked"), expected, atol=TOL[dtype], rtol=0
    )
    assert expected[0].abs().sum() > 0  # the row is not emptied


def _reference_with_keys_allowed(q, k, v, bias, allowed):
    """Float64 softmax(q kᵀ / sqrt(D) + bias) v over the allowed keys only, by hand; a row
    with none gets weights 0."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias.masked_fill(~allowed, 0)
    empty = ~allowed.any(-1, keepdim=True)
    filled = scores.masked_fill(~allowed, -math.inf).masked_fill(empty, 0.0)
    return torch.softmax(filled, -1).masked_fill(~allowed, 0.0) @ v


@pytest.mark.parametrize("backend", ["explicit", "sdpa", "chunked", "auto"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_a_mask_at_its_dtypes_lowest_value_masks_like_minus_infinity(backend, dtype, causal):
    """Hugging Face's masks: finfo(mask dtype).min where a key is masked, in a (B, 1, T, S)
    float mask of random biases, also under causal (a left-padded decoder: early queries see
    padding only). Keys at it weigh 0, and queries that see no other key (all of query 1's
    in batch 0; with causal, query 0 of batch 1's) get output 0 and zero gradients, as with
    -inf: not an average of the values. Output and q, k, v gradients (float64 inputs) within
    1e-12 of a by-hand float64 softmax over the other keys."""
    q, k, v = qkv((2, 3), 5, 7, 4, 3, grad=True)
    generator = torch.Generator().manual_seed(9)
    bias = (3 * torch.randn(2, 1, 5, 7, generator=generator, dtype=torch.float64)).to(dtype)
    masked = torch.rand(2, 1, 5, 7, generator=generator) < 0.3
    masked[0, :, 1] = True
    masked[1, ..., :3] = True  # the keys causal query 0 sees (bottom-right: j <= 2)
    mask = bias.masked_fill(masked, torch.finfo(dtype).min)
    allowed = ~masked & (torch.ones(5, 7).tril(2).bool() if causal else True)
    upstream = torch.randn(2, 3, 5, 3, generator=generator, dtype=torch.float64)
    reference = _reference_with_keys_allowed(q, k, v, bias.double(), allowed)
    expected = [reference, *torch.autograd.grad(reference, (q, k, v), upstream)]
    output = attention(q, k, v, mask=mask, causal=causal, backend=backend)
    got = [output, *torch.autograd.grad(output, (q, k, v), upstream)]
    for what, actual, want in zip(["output", "dq", "dk", "dv"], got, expected, strict=True):
        torch.testing.assert_close(actual, want, atol=1e-12, rtol=0, msg=what)
    empty = ~allowed.any(-1).expand(2, 3, 5)
    assert empty[0, :, 1].all() and empty[1, :, 0].all() == causal
    assert got[0][empty].eq(0).all() and got[1][empty].eq(0).all()


def test_chunked_takes_a_float16_mask_at_its_own_limits():
    """A float16 model's padding mask holds finfo(float16).min: clamping it to the float32
    range must not overflow float16 (it raised). Tolerance: 1e-3 against the explicit path."""
    q, k, v = (x.half() for x in qkv((2, 1), 4, 5, 8, 8))
    mask = torch.zeros(2, 1, 1, 5, dtype=torch.float16)
    mask[0, ..., 1:] = torch.finfo(torch.float16).min
    mask[1, ..., 3] = torch.finfo(torch.float16).max
    expected = attention(q, k, v, mask=mask, backend="explicit").float()
    actual = attention(q, k, v, mask=mask, backend="chunked").float()
    torch.testing.assert_close(actual, expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
def test_non_finite_scale_is_a_one_line_error(backend, scale):
    # Refused before any backend runs (triton included, installed or not): NaN weights otherwise.
    q, k, v = qkv((2,), 3, 4, 5, 2)
    with pytest.raises(ValueError, match="scale must be a finite number") as error:
        attention(q, k, v, scale=scale, backend=backend)
    assert "\n" not in str(error.value)


DROPOUT_BACKENDS = ("explicit", "sdpa")


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_zeroes_weights_and_rescales_the_kept_ones(backend):
    # value = identity, so each output row is its query's weights after dropout: every entry
    # is either 0 or weight / (1 - p) (float64, 1e-12), and a fixed seed gives the same draw.
    p = 0.5
    q, k, _ = qkv((2, 3), 6, 8, 4, 1)
    eye = torch.eye(8, dtype=torch.float64).expand(2, 3, 8, 8)
    weights = attention(q, k, eye, backend="explicit")  # no dropout: the weights themselves
    torch.manual_seed(0)
    dropped = attention(q, k, eye, dropout_p=p, backend=backend)
    torch.manual_seed(0)
    assert torch.equal(attention(q, k, eye, dropout_p=p, backend=backend), dropped)
    kept = dropped != 0
    assert 0.3 < kept.double().mean() < 0.7  # 288 Bernoulli(0.5) draws
    torch.testing.assert_close(dropped[kept], weights[kept] / (1 - p), atol=1e-12, rtol=0)
    q, k, v = qkv((2, 3), 6, 8, 4, 5)
    torch.manual_seed(0)
    output = attention(q, k, v, dropout_p=p, backend=backend)
    assert (output - attention(q, k, v, backend=backend)).abs().max() > 0.1


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_averages_to_the_output_without_it(backend):
    # Dropout keeps each weight with probability 1 - p and divides it by 1 - p, so it is
    # unbiased: the mean of N independent draws is within 5 standard errors of the output
    # without dropout, a standard error being sqrt(p / (1 - p) * sum_j (w_j v_j)^2 / N).
    p, n = 0.3, 20_000
    q, k, v = qkv((), 4, 6, 3, 2)
    expected, trace = attention(q, k, v, backend="explicit", return_trace=True)
    torch.manual_seed(1)
    draws = attention(*(x.expand(n, *x.shape) for x in (q, k, v)), dropout_p=p, backend=backend)
    spread = (trace.weights.unsqueeze(-1) * v.unsqueeze(-3)).pow(2).sum(-2)  # (T, Dv)
    standard_error = (p / (1 - p) * spread / n).sqrt()
    error = (draws.mean(0) - expected).abs()
    assert torch.all(error <= 5 * standard_error), (error / standard_error).max()


@pytest.mark.parametrize("backend", ["explicit", "sdpa", "chunked", "auto"])
def test_an_empty_batch_gives_an_empty_output(backend):
    q, k, v = qkv((0, 2), 3, 4, 5, 6, grad=True)
    output = attention(q, k, v, backend=backend, mask=torch.ones(3, 4, dtype=torch.bool))
    assert output.shape == (0, 2, 3, 6)
    output.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("backend", ["explicit", "sdpa", "chunked", "auto"])
def test_no_keys_at_all_gives_zeros(backend):
    # S = 0: every row is fully masked, so output and gradients are exactly 0.
    q, k, v = qkv((2,), 3, 0, 4, 5, grad=True)
    output = attention(q, k, v, backend=backend)
    assert output.shape == (2, 3, 5) and torch.all(output == 0)
    output.sum().backward()
    assert torch.all(q.grad == 0)


@pytest.mark.parametrize("lead", [(), (3,), (2, 3), (2, 2, 3)])
def test_sdpa_takes_any_leading_dims_and_broadcast_masks(lead):
    # float64, 1e-12 against the explicit path; masks as (T, S), per batch, and per head.
    q, k, v = qkv(lead, 5, 6, 4, 3)
    masks = [torch.rand(5, 6) > 0.3]
    if lead:
        masks.append(torch.rand(*lead[:1], *([1] * (len(lead) - 1)), 5, 6) > 0.3)
        masks.append(torch.rand(*lead, 1, 6) > 0.3)
    for mask in masks:
        expected = attention(q, k, v, mask=mask, backend="explicit")
        torch.testing.assert_close(
            attention(q, k, v, mask=mask, backend="sdpa"), expected, atol=1e-12, rtol=0
        )
    expected = attention(q, k, v, causal=True, backend="explicit")
    torch.testing.assert_close(
        attention(q, k, v, causal=True, backend="sdpa"), expected, atol=1e-12, rtol=0
    )


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", [(6,), ()])
def test_masks_of_one_dim_or_none_broadcast_like_the_reference(backend, kind, shape):
    """A key-padding mask given as (S,), or a single value, as the explicit path reads it
    (float64, 1e-12); torch's kernel needs the mask's (T, S) dims, so attention() adds them."""
    q, k, v = qkv((2, 3), 5, 6, 4, 3)
    mask = torch.rand(shape) > 0.3 if kind == "bool" else torch.randn(shape, dtype=q.dtype)
    if kind == "bool" and shape == ():
        mask = torch.tensor(True)
    expected = attention(q, k, v, mask=mask, causal=False, backend="explicit")
    actual = attention(q, k, v, mask=mask, backend=backend)
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", ["explicit", "sdpa", "chunked", "auto"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_mask_cannot_enlarge_the_batch(backend, kind):
    """A mask with more batch items than the inputs (3 against 1) would broadcast the output to
    3 items on the explicit path and crash the others: one line, on every backend."""
    q, k, v = qkv((1,), 5, 6, 4, 3)
    mask = torch.ones(3, 5, 6, dtype=torch.bool if kind == "bool" else q.dtype)
    with pytest.raises(ValueError, match=r"mask of shape \(3, 5, 6\) does not broadcast") as error:
        attention(q, k, v, mask=mask, backend=backend)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("backend", ["explicit", "sdpa", "chunked", "auto"])
@pytest.mark.parametrize(("t", "s"), [(0, 4), (3, 0)])
def test_no_queries_or_keys_with_three_leading_dims(backend, t, s):
    # Before: torch's kernel, fed (B, H, T, D) views, could not infer B for 5-D inputs with
    # T or S = 0 ("cannot reshape tensor of 0 elements"); now it gives what the others give:
    # an empty output, or exactly 0 where there are no keys.
    q, k, v = qkv((2, 2, 3), t, s, 4, 5, grad=True)
    mask = torch.ones(2, 1, 1, t, s, dtype=torch.bool)
    output = attention(q, k, v, mask=mask, causal=True, backend=backend)
    assert output.shape == (2, 2, 3, t, 5) and torch.all(output == 0)
    output.sum().backward()
    assert torch.all(q.grad == 0)


def test_trace_fields_are_the_ones_the_readme_lists():
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    line = next(line for line in readme.splitlines() if "also return an `AttentionTrace`" in line)
    listed = re.findall(r"`(\w+)`", line.split("(", 1)[1].split(")", 1)[0])
    assert sorted(listed) == sorted(field.name for field in dataclasses.fields(AttentionTrace))


def test_readme_six_steps_example_holds_by_hand():
    # The README's first example, checked in numpy: scores = x xᵀ, scaled = scores / sqrt(8),
    # weights = row softmax (rows sum to 1), output = weights @ x; float32, 1e-5.
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    output, trace = attention(x, x, x, return_trace=True)
    a = x.double().numpy()
    scores = a @ a.T
    scaled = scores / math.sqrt(8)
    exp = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    weights = exp / exp.sum(axis=1, keepdims=True)
    for name, expected in (("scores", scores), ("scaled", scaled), ("weights", weights)):
        np.testing.assert_allclose(getattr(trace, name).numpy(), expected, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(output.numpy(), weights @ a, atol=1e-5)
    assert trace.scores.shape == (4, 4) and output.shape == (4, 8)
    np.testing.assert_allclose(trace.weights.sum(-1).numpy(), 1.0, atol=1e-6)


def test_trace_holds_what_the_similarity_saw_in_the_compute_dtype():
    # As AttentionTrace's docstring says: cosine traces keep the L2-normalised query and key;
    # half inputs are computed (and traced) in float32, the output cast back.
    q, k, v = qkv((), 3, 5, 4, 2)
    _, trace = attention(q, k, v, similarity="cosine", backend="explicit", return_trace=True)
    torch.testing.assert_close(trace.query.norm(dim=-1), torch.ones(3, dtype=q.dtype))
    torch.testing.assert_close(trace.key.norm(dim=-1), torch.ones(5, dtype=q.dtype))
    half = [x.half() for x in (q, k, v)]
    output, trace = attention(*half, backend="explicit", return_trace=True)
    assert trace.weights.dtype == trace.scores.dtype == torch.float32
    assert output.dtype == trace.output.dtype == torch.float16


@pytest.mark.parametrize("backend", ["explicit", "sdpa", "chunked"])
def test_an_expanded_mask_of_the_wrong_size_is_refused_as_its_copy_is(backend):
    # A mask expanded to batch 3 for batch-2 scores was narrowed back to batch 1 before its
    # shape was checked, so it was taken while its contiguous copy (and torch's sdpa) refused
    # it: whether a wrong mask passed hung on its memory layout.
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    expanded = torch.ones(1, 4, 6, dtype=torch.bool).expand(3, 4, 6)
    for mask in (expanded, expanded.contiguous()):
        with pytest.raises(ValueError, match=r"mask of shape \(3, 4, 6\) does not broadcast"):
            attention(q, k, v, mask=mask, backend=backend)


def test_an_expanded_mask_reaches_sdpa_at_its_own_size(monkeypatch):
    # A key-padding mask expanded to (B, H, T, S) by the caller (stride 0 on H and T) used to
    # be filled at its full size before torch's kernel (isneginf, zeros_like, where): 32x the
    # mask's own bytes here. Now it is narrowed back to (B, 1, 1, S) first; the result equals
    # that of the unexpanded mask (float64, 1e-12).
    torch.manual_seed(5)
    b, h, t, s = 2, 4, 8, 8
    q, k, v = (torch.randn(b, h, n, 16, dtype=torch.float64) for n in (t, s, s))
    padding = torch.zeros(b, 1, 1, s, dtype=torch.float64)
    padding[0, ..., -3:] = -math.inf
    handed: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        handed.append(attn_mask.untyped_storage().nbytes())
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    output = attention(q, k, v, mask=padding.expand(b, h, t, s), backend="sdpa")
    monkeypatch.undo()
    expected = attention(q, k, v, mask=padding, backend="explicit")
    torch.testing.assert_close(output, expected, atol=1e-12, rtol=0)
    assert handed == [padding.untyped_storage().nbytes()]
