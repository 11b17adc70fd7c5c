"""The chunked backend against the explicit reference: outputs and gradients, every convention.

Tolerances (max absolute difference): float64 1e-10, float32 1e-5; bfloat16 and float16 at most
twice the error of torch's own fused kernel in that dtype against a float64 reference, plus
an absolute floor of 1e-3. Small block sizes make tiles that do not divide T or S.
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from selfattn.attention import attention, choose_backend, make_call
from selfattn.kernels import chunked_attention
from selfattn.kernels.chunked import LOG2E, _ChunkedAttention, finite_bias

SHAPES = [  # (T, S, D): primes, S != T both ways
    (7, 7, 5),
    (97, 97, 59),
    (13, 29, 5),
    (29, 13, 59),
]
BLOCKS = [(5, 6), (16, 64), (None, 1024)]  # (block_q, block_k); None = the default
# Every shape with every block size, except T = S = 97 in 5 x 6 tiles (slow, nothing new).
SHAPES_AND_BLOCKS = [
    (shape, blocks)
    for shape in SHAPES
    for blocks in BLOCKS
    if shape[0] * shape[1] < 5000 or blocks != (5, 6)
]


def _inputs(t: int, s: int, d: int, dtype: torch.dtype, lead=(2, 3), dv: int = 7, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(*lead, t, d), (*lead, s, d), (*lead, s, dv)]
    return [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]


def _masks(t: int, s: int, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(1)
    return {
        "none": None,
        "bool": torch.rand(2, 3, t, s, generator=generator) > 0.3,
        "bool-broadcast": torch.rand(3, 1, s, generator=generator) > 0.3,
        "float": torch.randn(2, 3, t, s, generator=generator, dtype=dtype),
        "float-broadcast": torch.randn(2, 1, t, 1, generator=generator, dtype=dtype),
        "key-padding": torch.arange(s) < s - 2,  # shape (S,)
    }


def _chunked(query, key, value, mask=None, causal=False, scale=None, blocks=(None, 1024)):
    """The kernel directly, with the explicit path's defaults, to choose the block sizes."""
    is_bool = mask is not None and mask.dtype == torch.bool
    return chunked_attention(
        query,
        key,
        value,
        allowed=mask if is_bool else None,
        bias=None if is_bool else mask,
        causal=causal,
        scale=query.shape[-1] ** -0.5 if scale is None else scale,
        block_q=blocks[0],
        block_k=blocks[1],
    )


def _outputs_and_grads(run, inputs, grad_output):
    inputs = [x.detach().requires_grad_() for x in inputs]
    output = run(*inputs)
    grads = torch.autograd.grad(output, inputs, grad_output)
    return [output.detach(), *grads]


@pytest.mark.parametrize(("shape", "blocks"), SHAPES_AND_BLOCKS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "mask_name", ["none", "bool", "bool-broadcast", "float", "float-broadcast", "key-padding"]
)
def test_matches_explicit_in_float64(shape, blocks, causal, mask_name):
    """Output and dq, dk, dv within 1e-10 of the explicit path (float64)."""
    t, s, d = shape
    query, key, value = _inputs(t, s, d, torch.float64)
    mask = _masks(t, s, torch.float64)[mask_name]
    grad_output = torch.randn(2, 3, t, 7, dtype=torch.float64)
    expected = _outputs_and_grads(
        lambda q, k, v: attention(q, k, v, mask=mask, causal=causal, backend="explicit"),
        [query, key, value],
        grad_output,
    )
    actual = _outputs_and_grads(
        lambda q, k, v: _chunked(q, k, v, mask, causal, blocks=blocks),
        [query, key, value],
        grad_output,
    )
    for name, got, want in zip(["output", "dq", "dk", "dv"], actual, expected, strict=True):
        assert not got.isnan().any(), name
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=name)


def _scores_by_tile(s: int, steps: list[float], dtype=torch.float64) -> torch.Tensor:
    """A float bias that adds ``steps[i]`` to every score in key tile i (tiles of 8 keys)."""
    per_key = torch.tensor(steps, dtype=dtype).repeat_interleave(8)[:s]
    return per_key.expand(7, s)


@pytest.mark.parametrize(
    "steps",
    [
        [0.0, 30.0, 60.0, 90.0, 200.0],  # each tile far above the last: lazy sums overflow
        [0.0, -200.0, -300.0, 50.0, 120.0],  # far below (weights underflow), then far above
        [-1e9, -1e9, 0.0, 100.0, 1e4],  # a huge jump, past float32's exp range
    ],
)
def test_lazy_shift_survives_scores_that_jump_between_tiles(steps):
    """Later tiles are exponentiated against the first tile's maximum; a tile whose sums
    overflow is redone. Output and gradients within 1e-10 of the explicit path (float64)."""
    query, key, value = _inputs(7, 40, 5, torch.float64)
    bias = _scores_by_tile(40, steps)
    grad_output = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    expected = _outputs_and_grads(
        lambda q, k, v: attention(q, k, v, mask=bias, backend="explicit"),
        [query, key, value],
        grad_output,
    )
    actual = _outputs_and_grads(
        lambda q, k, v: _chunked(q, k, v, bias, blocks=(3, 8)), [query, key, value], grad_output
    )
    for name, got, want in zip(["output", "dq", "dk", "dv"], actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=name)


@pytest.mark.parametrize("step", [40.0, 60.0, 80.0, 81.0, 86.0])
def test_lazy_shift_limit_keeps_float32_finite(step):
    """float32, key tiles alternating +0 and +step, values x1000. A tile at +step is taken
    lazily against the first tile's shift only while its row sums stay under ``LAZY_LIMIT``
    (2^64); at +86 (2^124 in the kernel's base 2, summed over 8 keys and times values ~1000)
    an unbounded lazy step overflows float32 and gives NaN, and at +80 and +81 so does a limit
    as loose as 2^120 (2^115 summed over 8 keys, times ~1000). Output within 1e-2 absolute
    (outputs of size ~1000, about 1e-5 relative; 5e-3 seen) of a float64 explicit reference."""
    query, key, value = _inputs(7, 40, 5, torch.float32)
    value = value * 1000
    bias = _scores_by_tile(40, [0.0, step, 0.0, step, 0.0], dtype=torch.float32)
    expected = attention(
        query.double(), key.double(), value.double(), mask=bias.double(), backend="explicit"
    )
    actual = _chunked(query, key, value, bias, blocks=(3, 8))
    assert actual.dtype == torch.float32 and torch.isfinite(actual).all()
    torch.testing.assert_close(actual.double(), expected, atol=1e-2, rtol=0)


def test_rows_that_see_nothing_in_the_first_tiles_find_their_shift_later():
    """Rows whose first key tiles are all masked, then see scores near -500 (exp underflows
    against a shift of 0): the exact update keeps running until every row has seen a key."""
    query, key, value = _inputs(7, 40, 5, torch.float64)
    bias = _scores_by_tile(40, [-math.inf, -math.inf, -500.0, -480.0, -520.0])
    bias = bias.clone()
    bias[3:, 16:] = 0.0  # rows 3+ see ordinary scores from the third tile on
    expected = attention(query, key, value, mask=bias, backend="explicit")
    actual = _chunked(query, key, value, bias, blocks=(7, 8))
    torch.testing.assert_close(actual, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_explicit_in_float32(causal):
    """Output and gradients within 1e-5 of the explicit path (float32), several tiles each way."""
    query, key, value = _inputs(300, 200, 32, torch.float32, dv=32)
    mask = torch.rand(300, 200, generator=torch.Generator().manual_seed(2)) > 0.2
    grad_output = torch.randn(2, 3, 300, 32)
    expected = _outputs_and_grads(
        lambda q, k, v: attention(q, k, v, mask=mask, causal=causal, backend="explicit"),
        [query, key, value],
        grad_output,
    )
    actual = _outputs_and_grads(
        lambda q, k, v: _chunked(q, k, v, mask, causal, blocks=(64, 48)),
        [query, key, value],
        grad_output,
    )
    for name, got, want in zip(["output", "dq", "dk", "dv"], actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_no_worse_than_twice_sdpa(dtype):
    """bf16/fp16: error vs a float64 reference <= 2x torch SDPA's own error + 1e-3."""
    query, key, value = _inputs(200, 150, 64, dtype, dv=64)
    grad_output = torch.randn(2, 3, 200, 64, generator=torch.Generator().manual_seed(3))
    wide = [x.double() for x in (query, key, value)]
    reference = _outputs_and_grads(
        lambda q, k, v: attention(q, k, v, causal=True, backend="explicit"),
        wide,
        grad_output.double(),
    )
    errors = {}
    for backend in ("sdpa", "chunked"):
        results = _outputs_and_grads(
            lambda q, k, v, backend=backend: attention(q, k, v, causal=True, backend=backend),
            [query, key, value],
            grad_output.to(dtype),
        )
        assert results[0].dtype == dtype
        errors[backend] = [
            (got.double() - want).abs().max().item()
            for got, want in zip(results, reference, strict=True)
        ]
    for name, chunked_error, sdpa_error in zip(
        ["output", "dq", "dk", "dv"], errors["chunked"], errors["sdpa"], strict=True
    ):
        assert chunked_error <= 2 * sdpa_error + 1e-3, (name, chunked_error, sdpa_error)


def test_fully_masked_rows_give_zeros_and_zero_gradients():
    """Rows with nothing to attend (bool mask, -inf float mask, causal with T > S): exact 0."""
    t, s = 11, 6
    query, key, value = _inputs(t, s, 5, torch.float64)
    allowed = torch.rand(t, s, generator=torch.Generator().manual_seed(4)) > 0.3
    allowed[[0, 7]] = False
    bias = torch.zeros(t, s, dtype=torch.float64)
    bias[[2, 9]] = float("-inf")
    empty_rows = {"bool": [0, 7], "float": [2, 9], "causal": list(range(t - s))}
    cases = {"bool": (allowed, False), "float": (bias, False), "causal": (None, True)}
    for name, (mask, causal) in cases.items():
        grad_output = torch.randn(2, 3, t, 7, dtype=torch.float64)
        output, grad_query, _, _ = _outputs_and_grads(
            lambda q, k, v, mask=mask, causal=causal: _chunked(
                q, k, v, mask, causal, blocks=(3, 4)
            ),
            [query, key, value],
            grad_output,
        )
        assert not output.isnan().any() and not grad_query.isnan().any(), name
        rows = empty_rows[name]
        assert (output[..., rows, :] == 0).all(), name
        assert (grad_query[..., rows, :] == 0).all(), name
        expected = attention(query, key, value, mask=mask, causal=causal, backend="explicit")
        torch.testing.assert_close(output, expected, atol=1e-10, rtol=0, msg=name)


def test_rows_masked_by_the_lowest_value_give_zeros_and_zero_gradients():
    """finfo(float64).min, Hugging Face's "masked", is -inf as each tile (3 x 4) reads it: rows
    all at it get output 0 and query and bias gradients 0, finite; a row at it but for one key
    attends that key alone. Output and gradients (the bias's too) within 1e-10 of the explicit
    path (float64)."""
    t, s = 11, 6
    query, key, value = _inputs(t, s, 5, torch.float64)
    lowest = torch.finfo(torch.float64).min
    bias = torch.randn(t, s, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    bias[[1, 8]] = lowest
    bias[4, 1:] = lowest
    bias[::3, 2] = lowest
    grad_output = torch.randn(2, 3, t, 7, dtype=torch.float64)
    expected = _outputs_and_grads(
        lambda q, k, v, b: attention(q, k, v, mask=b, backend="explicit"),
        [query, key, value, bias],
        grad_output,
    )
    actual = _outputs_and_grads(
        lambda q, k, v, b: _chunked(q, k, v, b, blocks=(3, 4)),
        [query, key, value, bias],
        grad_output,
    )
    output, grad_query, _, _, grad_bias = actual
    assert all(torch.isfinite(result).all() for result in actual)
    assert (output[..., [1, 8], :] == 0).all() and (grad_query[..., [1, 8], :] == 0).all()
    assert (grad_bias[[1, 8]] == 0).all()
    torch.testing.assert_close(output[..., 4, :], value[..., 0, :], atol=1e-10, rtol=0)
    names = ["output", "dq", "dk", "dv", "dbias"]
    for name, got, want in zip(names, actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=name)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float64, torch.float16])
def test_a_float_mask_is_made_ready_tile_by_tile_never_copied_whole(mask_dtype):
    """A (T, S) float mask holding its dtype's lowest value (Hugging Face's masks) is made ready
    (lowest to -inf, cast, clamped: finite_bias) as each tile reads it. No op of the forward
    or backward allocates T·S bytes or more, as torch.profiler's memory records count them (a
    boolean (T, S) tensor; before, the forward copied the whole mask, 2-8 bytes per element,
    and more for its clamp). Output and gradients within 1e-5 of torch's SDPA given the mask
    with -inf for the lowest value (float32 inputs)."""
    t, s = 256, 192
    query, key, value = _inputs(t, s, 8, torch.float32, lead=(1, 1), dv=8)
    mask = torch.randn(t, s, generator=torch.Generator().manual_seed(9)).to(mask_dtype)
    lowest = torch.finfo(mask_dtype).min
    mask[:, 150:] = lowest  # padding
    mask[::7, 20:40] = lowest
    grad_output = torch.randn(1, 1, t, 8, generator=torch.Generator().manual_seed(10))
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as profile:
        actual = _outputs_and_grads(
            lambda q, k, v: _chunked(q, k, v, mask, blocks=(32, 64)),
            [query, key, value],
            grad_output,
        )
    largest = max(profile.events(), key=lambda event: event.self_cpu_memory_usage)
    assert largest.self_cpu_memory_usage < t * s, (largest.name, largest.self_cpu_memory_usage)
    reference_mask = mask.float().masked_fill(mask == lowest, -math.inf)
    expected = _outputs_and_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=reference_mask),
        [query, key, value],
        grad_output,
    )
    for name, got, want in zip(["output", "dq", "dk", "dv"], actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)


def test_all_keys_masked_gives_zero_key_and_value_gradients():
    """Nothing may be attended anywhere: output 0 and every gradient 0, no NaN."""
    query, key, value = _inputs(9, 8, 5, torch.float64)
    mask = torch.zeros(9, 8, dtype=torch.bool)
    results = _outputs_and_grads(
        lambda q, k, v: _chunked(q, k, v, mask, blocks=(4, 3)),
        [query, key, value],
        torch.ones(2, 3, 9, 7, dtype=torch.float64),
    )
    for result in results:
        assert (result == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("value", [-1e39, -1e300])
def test_a_float64_mask_beyond_the_compute_range_masks_as_on_the_explicit_path(dtype, value):
    """A float64 mask on float32 (or float16, computed in float32) inputs is added in float32,
    as the explicit path adds it: values beyond its range are -inf, so a row all at them is
    empty (output 0) and keys at them get weight 0. They used to be clamped to a finite bias,
    and at -1e300 cancelled to 0: the masked keys were attended. Tolerance: 1e-6 (float32),
    1e-3 (float16) against the explicit path."""
    query, key, value_ = _inputs(5, 6, 4, dtype)
    mask = torch.zeros(5, 6, dtype=torch.float64)
    mask[1] = value  # an empty row
    mask[2, :3] = value  # half of a row masked
    expected = attention(query, key, value_, mask=mask, backend="explicit")
    output = attention(query, key, value_, mask=mask, backend="chunked")
    assert (output[..., 1, :] == 0).all()
    atol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(output.float(), expected.float(), atol=atol, rtol=0)


def test_an_expanded_mask_is_tiled_at_its_own_size(monkeypatch):
    """A (B, 1, 1, S) padding bias given expanded to (B, H, T, S) (stride 0) reaches the tiles
    at its own size: finite_bias's casts and clamps used to allocate all of it, 1.7 GiB of
    temporaries for a 512 MiB view at T = S = 4,096 with 8 heads (where auto takes chunked to
    avoid (T, S) tensors). Output and gradients, the padding bias's too, within 1e-10 of the
    explicit path (float64 inputs)."""
    stored = []  # bytes of the bias the tiles read
    apply = _ChunkedAttention.apply

    def recording(*args):
        stored.append(args[4].untyped_storage().nbytes())
        return apply(*args)

    monkeypatch.setattr(_ChunkedAttention, "apply", recording)
    query, key, value = _inputs(13, 29, 5, torch.float64)
    padding = torch.randn(
        2, 1, 1, 29, generator=torch.Generator().manual_seed(7), dtype=torch.float64
    )
    padding[1, ..., 20:] = float("-inf")
    grad_output = torch.randn(2, 3, 13, 7, dtype=torch.float64)
    results = {
        backend: _outputs_and_grads(
            lambda q, k, v, b, backend=backend: attention(
                q, k, v, mask=b.expand(2, 3, 13, 29), causal=True, backend=backend
            ),
            [query, key, value, padding],
            grad_output,
        )
        for backend in ("explicit", "chunked")
    }
    assert stored == [padding.untyped_storage().nbytes()]  # B · S elements, not B · H · T · S
    for got, want in zip(results["chunked"], results["explicit"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_finite_bias_clamps_values_far_beyond_the_limit_and_passes_gradients():
    """In float64, -1e300 clamped to a limit of ~9e37 is that limit (it was bias + (clamp -
    bias) = 0: cancelled); ±inf and values within the limit stay; every gradient is 1. A float64
    bias for a float32 backend is cast first: beyond float32's range it is -inf. Exact."""
    bias = torch.tensor([-1e300, 1e300, -1e39, 5.0, -math.inf], dtype=torch.float64)
    bias.requires_grad_()
    unit = 1e270
    limit = torch.finfo(torch.float64).max / (2 * unit)
    clamped = finite_bias(bias, torch.float64, unit)
    expected = torch.tensor([-limit, limit, -limit, 5.0, -math.inf], dtype=torch.float64)
    assert torch.equal(clamped.detach(), expected)
    clamped.sum().backward()
    assert torch.equal(bias.grad, torch.ones_like(bias))
    cast = finite_bias(bias.detach(), torch.float32, 1.0)
    assert cast.dtype == torch.float32
    assert torch.equal(cast, torch.tensor([-math.inf, math.inf, -math.inf, 5.0, -math.inf]))


@pytest.mark.parametrize(
    ("dtype", "compute"),
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_finite_bias_makes_the_lowest_value_of_its_dtype_minus_infinity(dtype, compute):
    """Hugging Face's finfo(dtype).min masks: as the chunked tiles and the Triton kernels get
    it (in base 2, float32 for a half-precision bias), it is -inf, whatever the bias's dtype
    (a float16 one was passed on as it came); the value next above it is a bias, finite;
    -inf and 5 stay. Exact."""
    lowest = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    above = torch.nextafter(lowest, torch.zeros_like(lowest))
    bias = torch.tensor([lowest.item(), above.item(), -math.inf, 5.0], dtype=dtype)
    ready = finite_bias(bias, compute, LOG2E)
    assert ready[[0, 2]].tolist() == [-math.inf, -math.inf]
    assert ready[1].isfinite() and ready[3] == 5


@pytest.mark.parametrize("similarity", ["dot", "cosine"])
@pytest.mark.parametrize("scale", [None, 1.0, 3.7])
def test_similarity_and_scale_through_attention(similarity, scale):
    """attention(backend='chunked') == explicit within 1e-10 for cosine and any scale."""
    query, key, value = _inputs(33, 40, 16, torch.float64)
    grad_output = torch.randn(2, 3, 33, 7, dtype=torch.float64)
    results = {
        backend: _outputs_and_grads(
            lambda q, k, v, backend=backend: attention(
                q, k, v, similarity=similarity, scale=scale, causal=True, backend=backend
            ),
            [query, key, value],
            grad_output,
        )
        for backend in ("explicit", "chunked")
    }
    for got, want in zip(results["chunked"], results["explicit"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_gradcheck_in_float64():
    """torch.autograd.gradcheck (finite differences, default float64 tolerances), incl. the bias."""
    query, key, value = (x.requires_grad_() for x in _inputs(6, 7, 3, torch.float64, lead=(2,)))
    bias = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    allowed = torch.rand(2, 6, 7, generator=torch.Generator().manual_seed(5)) > 0.3

    def run(q, k, v, b):
        return chunked_attention(
            q, k, v, allowed=allowed, bias=b, causal=True, scale=0.7, block_q=4, block_k=3
        )

    assert torch.autograd.gradcheck(run, (query, key, value, bias))


def test_double_backward_is_refused_by_name():
    """gradgradcheck (and any create_graph=True backward) names the backend and the way out
    (it used to fail inside the backward with bmm()'s out=... error)."""
    query, key, value = (x.requires_grad_() for x in _inputs(5, 6, 3, torch.float64, lead=(2,)))

    def run(q, k, v):
        return attention(q, k, v, causal=True, backend="chunked")

    with pytest.raises(RuntimeError, match=r"'chunked' has first derivatives only.*'explicit'"):
        torch.autograd.gradgradcheck(run, (query, key, value))
    output = run(query, key, value)  # grad_output needs no grad here, query does
    with pytest.raises(RuntimeError, match="'chunked' has first derivatives only"):
        torch.autograd.grad(output.sum(), query, create_graph=True)


def test_compiles_whole_with_fullgraph_and_matches_eager():
    """torch.compile(fullgraph=True) of attention(backend='chunked') with a causal float mask
    (its dtype's lowest value, a fully masked row) whose gradient is asked too: before, the
    kernel's Python branches on tensor values (``bool(seen.all())``, an ``.item()``) broke
    the graph, so fullgraph=True raised. Backend aot_eager (dynamo, then AOTAutograd's traced
    backward, no C++ build), as in test_attention.py; the kernels are two operators the graph
    calls whole. Float64 output and gradients equal eager's within 1e-12 (the same kernels
    run), the fully masked row 0."""
    query, key, value = _inputs(13, 29, 5, torch.float64)
    mask = torch.randn(13, 29, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    mask[:, 20:] = torch.finfo(torch.float64).min
    mask[2] = torch.finfo(torch.float64).min
    grad_output = torch.randn(2, 3, 13, 7, dtype=torch.float64)

    def run(q, k, v, b):
        return attention(q, k, v, mask=b, causal=True, backend="chunked")

    torch._dynamo.reset()  # an empty cache: no recompile limit reached by other tests' graphs
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    results = [
        _outputs_and_grads(fn, [query, key, value, mask], grad_output) for fn in (run, compiled)
    ]
    for name, eager, graph in zip(["output", "dq", "dk", "dv", "dmask"], *results, strict=True):
        torch.testing.assert_close(graph, eager, atol=1e-12, rtol=0, msg=name)
    assert (results[1][0][..., 2, :] == 0).all()


@pytest.mark.parametrize("bias_grad", [False, True])
def test_operators_pass_torch_library_opcheck(bias_grad):
    """torch.library.opcheck on selfattn::chunked_forward and chunked_backward (boolean and
    float masks, causal, 4 x 3 tiles): their schemas, their fake kernels (what torch.compile
    traces with) giving the real kernels' shapes, strides and dtypes, and AOT dispatch."""
    query, key, value = (x.reshape(6, *x.shape[2:]) for x in _inputs(7, 9, 5, torch.float64))
    allowed = torch.rand(3, 7, 9, generator=torch.Generator().manual_seed(12)) > 0.3
    bias = torch.randn(2, 1, 7, 9, dtype=torch.float64)
    bias[..., :2] = torch.finfo(torch.float64).min
    config = ([2, 3], True, 0.4, 4, 3)
    forward_args = (query, key, value, allowed, bias, *config)
    torch.library.opcheck(torch.ops.selfattn.chunked_forward.default, forward_args)
    output, lse = torch.ops.selfattn.chunked_forward.default(*forward_args)
    grad_output = torch.randn_like(output)
    backward_args = (grad_output, *forward_args[:5], output, lse, *config, bias_grad)
    torch.library.opcheck(torch.ops.selfattn.chunked_backward.default, backward_args)


@pytest.mark.parametrize("blocks", [(None, 0), (None, -3), (0, 4), (-2, 4)])
def test_block_sizes_that_are_not_positive_are_refused(blocks):
    """A key tile of 0 with the default query tile raised ZeroDivisionError (and -3 blamed a
    block_q of 16 the caller never gave): the sizes given are checked first."""
    query, key, value = _inputs(5, 6, 3, torch.float32)
    with pytest.raises(ValueError, match=rf"positive, got block_q={blocks[0]}, block_k="):
        _chunked(query, key, value, blocks=blocks)


def test_dropout_is_refused():
    query, key, value = _inputs(4, 4, 3, torch.float32)
    with pytest.raises(ValueError, match="'chunked' has no dropout"):
        attention(query, key, value, dropout_p=0.1, backend="chunked")


def test_auto_picks_chunked_above_the_budget_for_masked_calls(monkeypatch):
    """auto: explicit for a trace; chunked for masked/bottom-right calls above the budget."""
    query, key, value = _inputs(8, 12, 4, torch.float32)
    mask = torch.ones(8, 12, dtype=torch.bool)

    def chosen(mask=None, causal=False, dropout_p=0.0, return_trace=False):
        call = make_call(query, key, value, mask, causal, "dot", None, dropout_p)
        return choose_backend(call, return_trace).name

    assert chosen(mask) == "sdpa"
    monkeypatch.setattr(sys.modules["selfattn.attention"], "MEMORY_BUDGET", 100)
    assert chosen(mask) == "chunked"
    assert chosen(causal=True) == "chunked"  # T != S: sdpa would get a (T, S) mask
    assert chosen() == "sdpa"  # no mask: torch's kernel is O(T) memory and faster
    assert chosen(mask, dropout_p=0.1) == "sdpa"
    assert chosen(mask, return_trace=True) == "explicit"
    output = attention(query, key, value, mask=mask)  # chunked; float32, 1e-5 as above
    expected = attention(query, key, value, backend="explicit")
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)
    query = query[..., -1:, :]  # one decoding step sees every key: sdpa gets no mask
    assert chosen(causal=True) == "sdpa"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weights_bytes_count_float32_weights_for_half_inputs(dtype):
    """The budget check sizes the weights in the dtype they are computed in: float32 for half
    and bfloat16 inputs, 4 bytes each, not the inputs' 2 (which would keep calls twice the
    budget on sdpa). Exact: 2 x 8 x 1024 x 1024 weights x 4 bytes."""
    query, key, value = (torch.zeros(2, 8, 1024, 64, dtype=dtype) for _ in range(3))
    call = make_call(query, key, value, None, False, "dot", None, 0.0)
    assert call.weights_bytes == 2 * 8 * 1024 * 1024 * 4


MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, torch
    from selfattn.kernels import chunked_attention

    torch.set_num_threads(1)  # memory does not depend on it; one thread is steadier on a busy CPU
    t = 24576  # explicit weights (1, 1, T, T) float32: 2.25 GiB, its trace ~4x that
    query, key, value = (torch.randn(1, 1, t, 16, requires_grad=True) for _ in range(3))
    with open("/proc/self/statm") as statm:  # resident now, in pages
        before = int(statm.read().split()[1]) * resource.getpagesize()
    output = chunked_attention(query, key, value, causal=True, scale=0.25)
    output.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    print(peak // 2**20)
    """
)


def test_memory_stays_linear_where_the_weights_would_need_gigabytes():
    """Forward + backward at T=24,576 (weights would be 2.25 GiB) adds under 512 MiB of RSS.

    The kernel's own buffers are a few MiB; the rest is the allocator and thread pools, which
    vary with the machine (200-270 MiB seen), hence the margin: still 4.5x under the weights.
    """
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, check=True
    )
    extra_mib = int(result.stdout.strip())
    assert extra_mib < 512, f"chunked attention grew the process by {extra_mib} MiB"


RELOAD_SCRIPT = """
import importlib, importlib.util, torch
import selfattn.kernels.chunked as chunked
q = torch.randn(2, 3, 40, 8, dtype=torch.float64, requires_grad=True)
expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.3)
importlib.reload(chunked)  # as Jupyter's autoreload does
spec = importlib.util.spec_from_file_location("chunked_copy", chunked.__file__)
spec.loader.exec_module(importlib.util.module_from_spec(spec))  # a second copy of the file
for module in (chunked, importlib.import_module("selfattn.kernels.chunked")):
    output = module.chunked_attention(q, q, q, scale=0.3, block_q=16, block_k=16)
    assert torch.allclose(output, expected, atol=1e-10), "output"
    output.sum().backward()
print("ok")
"""


def test_the_operators_survive_a_reload_and_a_second_copy_of_the_module():
    """The operators are defined once per process: a reload and a second copy of the file
    keep them (torch 2.4 answered a reloaded forward with the backward's schema, and a copy
    raised "registered multiple times"); outputs still equal SDPA's within 1e-10 (float64)."""
    result = subprocess.run(
        [sys.executable, "-c", RELOAD_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_benchmark_reports_a_case_killed_without_stderr_as_failed(monkeypatch):
    """benchmarks/attention.py: a case killed silently (out of memory: SIGKILL, no stderr) is a
    failed cell naming the exit code (it used to raise IndexError and end the whole run)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "attention.py"
    spec = importlib.util.spec_from_file_location("benchmark_attention", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    killed = subprocess.CompletedProcess([], returncode=-9, stdout="", stderr="")
    monkeypatch.setattr(benchmark.subprocess, "run", lambda *args, **kwargs: killed)
    result = benchmark.measure("chunked", 512, False, False, 1, "random")
    assert result == {"error": "exit code -9 (Killed)"}
    assert benchmark.describe(result, 512, False, False)[0] == "failed: exit code -9 (Killed)"


Q, K, V = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 5)


@pytest.mark.parametrize(
    ("inputs", "options", "message"),
    [
        ((Q, K[..., :4], V), {}, "query and key must have the same last dim, got 8 and 4"),
        ((Q[0], K, V), {}, "must have the same leading dims"),
        ((Q.double(), K, V), {}, "must share a dtype"),
        ((Q, K, V), {"scale": math.nan}, "scale must be a finite number"),
        ((Q, K, V), {"bias": torch.ones(7, 9, dtype=torch.bool)}, "bias must be a floating-point"),
        ((Q, K, V), {"allowed": torch.ones(7, 9)}, "allowed must be a boolean tensor"),
        ((Q, K, V), {"allowed": torch.ones(7, 8, dtype=torch.bool)}, "allowed of shape (7, 8)"),
        ((Q, K, V), {"block_k": 2.5}, "block sizes must be positive"),
    ],
)
def test_the_public_kernel_refuses_what_attention_refuses_in_one_line(inputs, options, message):
    """chunked_attention is exported (selfattn.kernels): it checked only its block sizes, so a
    wrong shape was torch's bmm error, a bool bias a TypeError from torch.finfo, and float64
    queries with float32 keys were taken."""
    with pytest.raises(ValueError, match=re.escape(message)):
        chunked_attention(*inputs, **options)


def test_the_public_kernel_takes_attentions_default_scale():
    # tolerance: float32 rounding of one (7, 9) softmax, 1e-6
    expected = F.scaled_dot_product_attention(Q, K, V)
    torch.testing.assert_close(chunked_attention(Q, K, V, block_k=4), expected, atol=1e-6, rtol=0)
