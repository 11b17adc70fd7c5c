"""The Triton kernels (forward and backward) against the explicit path, under the interpreter.

TRITON_INTERPRET=1 is set (conftest.py) before triton is imported, so the same kernels that run
on a GPU run here on CPU float32 tensors (small shapes: the interpreter is slow).

Tolerance (flash-attention's rule): against the explicit path in float64, our error (max abs,
output and each gradient) is at most twice that of torch's own SDPA in the same dtype, plus an
absolute floor of ``ABS_FLOOR[dtype]`` (1e-6 in float32, 1e-4 in float16, 1e-3 in bfloat16)
for cases where
SDPA happens to be exact.
"""

import dataclasses
import importlib
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if os.environ["TRITON_INTERPRET"] != "1":
    pytest.skip("these tests run the kernels under TRITON_INTERPRET=1", allow_module_level=True)

from conftest import patch_triton_language_once
from selfattn.attention import BACKENDS, attention, choose_backend, make_call
from selfattn.kernels.chunked import LOG2E

patch_triton_language_once()

ABS_FLOOR = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def _inputs(t: int, s: int, d: int, dv: int | None = None, lead=(2, 3), seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, t, d, generator=generator, dtype=torch.float64)
    k = torch.randn(*lead, s, d, generator=generator, dtype=torch.float64)
    v = torch.randn(*lead, s, dv or d, generator=generator, dtype=torch.float64)
    grad = torch.randn(*lead, t, dv or d, generator=generator, dtype=torch.float64)
    return q, k, v, grad


def _run(backend: str, q, k, v, grad, dtype, **options):
    """Output and (dq, dk, dv) of one backend, inputs cast to ``dtype``."""
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = attention(*leaves, backend=backend, **options)
    grads = torch.autograd.grad(out, leaves, grad.to(dtype))
    return [out.detach(), *grads]


def assert_matches_reference(q, k, v, grad, dtype=torch.float32, **options):
    """Triton within twice SDPA's error of the float64 explicit path, output and gradients."""
    ours = _run("triton", q, k, v, grad, dtype, **options)
    assert_within_twice_sdpa(ours, q, k, v, grad, dtype, **options)


def assert_within_twice_sdpa(ours, q, k, v, grad, dtype, **options):
    """``ours`` (output, dq, dk, dv) within twice SDPA's error of the float64 explicit path."""
    reference = _run("explicit", q, k, v, grad, torch.float64, **options)
    baseline = _run("sdpa", q, k, v, grad, dtype, **options)
    for name, got, base, want in zip(
        ("output", "dq", "dk", "dv"), ours, baseline, reference, strict=True
    ):
        assert torch.isfinite(got).all(), f"{name} has NaN or inf"
        error = (got.double() - want).abs().max().item()
        base_error = (base.double() - want).abs().max().item()
        bound = 2 * base_error + ABS_FLOOR[dtype]
        assert error <= bound, f"{name}: error {error:.2e} > 2 × SDPA's {base_error:.2e} + floor"


LENGTHS = [(1, 1), (7, 7), (33, 33), (64, 64), (7, 33), (33, 7), (1, 64), (64, 1)]


@pytest.mark.parametrize("t, s", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_and_causal(t, s, causal):
    assert_matches_reference(*_inputs(t, s, 16), causal=causal)


# Under the interpreter the kernels tile 16 queries by 32 keys: these put the causal diagonal
# (key j seen by queries i >= j - (S - T)) one row or key off a tile's first or last.
CAUSAL_EDGES = [(2, 32), (18, 32), (34, 48), (50, 48)]


@pytest.mark.parametrize("t, s", CAUSAL_EDGES)
def test_causal_diagonal_at_a_tile_edge(t, s):
    """The key tiles a query block sees unmasked (``_key_range``), and the query tiles that
    see a key block whole (``_query_range``), are bounded by the diagonal: one past the
    bound and a masked key is read as seen, or a seen one stays masked. Output and
    gradients within twice SDPA's error of the float64 explicit path."""
    assert_matches_reference(*_inputs(t, s, 16), causal=True)


@pytest.mark.parametrize("d, dv", [(64, 64), (5, 5), (59, 59), (16, 24)])
def test_head_dims_padded_to_a_power_of_two(d, dv):
    assert_matches_reference(*_inputs(33, 64, d, dv), causal=True)


@pytest.mark.parametrize("scale", [1.0, 0.05, -0.3, 0.0])
def test_any_scale(scale):
    assert_matches_reference(*_inputs(33, 33, 16), scale=scale)


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask_broadcast_over_heads_and_queries(causal):
    lengths = torch.tensor([64, 40])
    mask = (torch.arange(64) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    assert_matches_reference(*_inputs(33, 64, 16), mask=mask, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_general_bool_mask(causal):
    mask = torch.rand(33, 64, generator=torch.Generator().manual_seed(1)) > 0.3  # (T, S)
    assert_matches_reference(*_inputs(33, 64, 16), mask=mask, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_float_mask_with_minus_infinity(causal):
    mask = torch.randn(2, 3, 33, 64, generator=torch.Generator().manual_seed(2))
    mask[..., ::5] = float("-inf")
    assert_matches_reference(*_inputs(33, 64, 16), mask=mask, causal=causal)


def test_float_mask_near_the_float_limits_is_a_bias_not_a_hole():
    # Just above finfo(float32).min, times log2(e), a bias must not become -inf, or a row
    # masked that way would be emptied where the explicit path makes it uniform; a key at
    # finfo.max takes its rows' weight (inf would make them NaN). finfo.min itself is Hugging
    # Face's "masked" and masks as -inf does: a row all at it gives 0, as on every backend.
    lowest = torch.finfo(torch.float32).min
    near_lowest = torch.nextafter(torch.tensor(lowest), torch.tensor(0.0)).item()
    mask = torch.zeros(2, 1, 1, 64)
    mask[0] = near_lowest
    mask[1, ..., 10:] = near_lowest
    mask[1, ..., 5] = torch.finfo(torch.float32).max
    assert_matches_reference(*_inputs(33, 64, 16), mask=mask)
    q, k, v = (x.float() for x in _inputs(33, 64, 16)[:3])
    empty = attention(q, k, v, mask=torch.full((1, 64), lowest), backend="triton")
    assert (empty == 0).all()


@pytest.mark.parametrize("value", [-1e39, -1e300])
def test_a_float64_mask_beyond_float32_masks_as_on_the_explicit_path(value):
    """The kernels add a float mask in float32, as the explicit path adds a float64 one to
    float32 scores: beyond float32's range it is -inf, so a row all at it is empty (output 0)
    and keys at it weigh 0, not clamped to a finite bias (uniform weights, masked keys
    attended). Within 1e-5 of the explicit path."""
    q, k, v = (x.float() for x in _inputs(5, 6, 16)[:3])
    mask = torch.zeros(5, 6, dtype=torch.float64)
    mask[1] = value  # an empty row
    mask[2, :3] = value  # half of a row masked
    expected = attention(q, k, v, mask=mask, backend="explicit")
    output = attention(q, k, v, mask=mask, backend="triton")
    assert (output[..., 1, :] == 0).all()
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)


def test_fully_masked_rows_give_zero_output_and_zero_gradients():
    q, k, v, grad = _inputs(33, 64, 16)
    mask = torch.ones(2, 3, 33, 64, dtype=torch.bool)
    mask[0, 1, 5] = False
    mask[1, :, 20:] = False
    out, dq, dk, dv = _run("triton", q, k, v, grad, torch.float32, mask=mask)
    assert (out[0, 1, 5] == 0).all() and (out[1, :, 20:] == 0).all()
    assert (dq[0, 1, 5] == 0).all() and (dq[1, :, 20:] == 0).all()
    assert all(torch.isfinite(x).all() for x in (out, dq, dk, dv))
    assert_matches_reference(q, k, v, grad, mask=mask)


def test_more_queries_than_keys_leaves_the_first_rows_empty():
    # Bottom-right causal with T=33, S=7: queries 0..25 see no key at all.
    out, dq, _, _ = _run("triton", *_inputs(33, 7, 16), torch.float32, causal=True)
    assert (out[..., :26, :] == 0).all() and (dq[..., :26, :] == 0).all()


def test_float_mask_row_of_minus_infinity_is_empty():
    q, k, v, grad = _inputs(7, 33, 16)
    mask = torch.zeros(7, 33)
    mask[3] = float("-inf")
    out, dq, _, _ = _run("triton", q, k, v, grad, torch.float32, mask=mask)
    assert (out[..., 3, :] == 0).all() and (dq[..., 3, :] == 0).all()
    assert torch.isfinite(dq).all()


def test_no_keys_at_all_gives_zeros():
    q, k, v, grad = _inputs(5, 0, 16)
    q[0, 0, 0, 0] = float("inf")  # as the explicit path, no NaN from a query with no keys
    out, dq, dk, dv = _run("triton", q, k, v, grad, torch.float32)
    assert out.shape == (2, 3, 5, 16) and (out == 0).all() and (dq == 0).all()
    assert dk.shape == k.shape and dv.shape == v.shape


def test_mask_offsets_past_two_to_the_31():
    """Mask rows 2³¹ / 8 elements apart, as in a (T, S) mask with T = S > 46,340: the offset
    of the last row overflows int32 (a wild read) unless it is computed in int64. Only the
    mask's rows are touched, so the 2 GiB it spans stay unallocated."""
    t, s = 9, 40
    row_stride = 2**31 // (t - 1)
    mask = torch.empty(row_stride * (t - 1) + s, dtype=torch.bool)
    mask = mask.as_strided((t, s), (row_stride, 1))
    mask.copy_(torch.rand(t, s, generator=torch.Generator().manual_seed(6)) > 0.3)
    assert_matches_reference(*_inputs(t, s, 16), mask=mask, causal=True)


def test_a_head_spanning_more_than_two_to_the_31_is_refused():
    """Within a head the kernels address rows in int32: query rows 2³¹ / 8 elements apart (a
    (B, T, H, D) projection of ~1M tokens at width 2,048 is as far) are refused, so auto takes
    another backend, rather than read wild. The 4 GiB spanned stay unallocated."""
    t, row_stride = 9, 2**31 // 8
    storage = torch.empty(row_stride * (t - 1) + 16, dtype=torch.float16)
    q = storage.as_strided((1, 1, t, 16), (0, 0, row_stride, 1))
    k = v = torch.zeros(1, 1, t, 16, dtype=torch.float16)
    reason = _why_not(q, k, v)
    assert "a head here spans 2,147,483,663 elements (more than 2³¹)" in reason
    with pytest.raises(ValueError, match="more than 2³¹"):
        attention(q, k, v, backend="triton")


def test_outputs_laid_out_like_the_inputs_count_in_the_span(monkeypatch):
    """The output and gradients are written laid out like the query, key and value (heads
    interleaved for a transposed projection), value-dim wide: their span counts too (a limit
    of 1,000 elements here stands in for 2³¹)."""
    from selfattn.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "MAX_HEAD_OFFSET", 1_000)
    assert _why_not(*(torch.randn(1, 2, 33, 16) for _ in range(3))) is None  # 527 each
    q, k, v = (torch.randn(1, 33, 2, 16).transpose(1, 2) for _ in range(3))  # rows 32 apart
    assert "spans 1,039 elements" in _why_not(q, k, v)
    q, k, v = torch.randn(1, 33, 16), torch.randn(1, 8, 16), torch.randn(1, 8, 40)
    assert "spans 1,319 elements" in _why_not(q, k, v)  # the output: 33 rows of 40


def test_a_head_spanning_exactly_the_limit_is_served(monkeypatch):
    """The int32 limit is the largest offset the kernels may address: a head whose farthest
    element is at exactly the limit (111 for 7 rows of 16, standing in for 2³¹ - 1) is served,
    one element less of limit refuses it."""
    from selfattn.kernels import triton_attention

    q = torch.randn(7, 16)
    assert triton_attention._largest_offset(q, 16) == 111
    monkeypatch.setattr(triton_attention, "MAX_HEAD_OFFSET", 111)
    assert _why_not(q, q, q) is None
    monkeypatch.setattr(triton_attention, "MAX_HEAD_OFFSET", 110)
    assert "index within a head in int32" in _why_not(q, q, q)


def test_a_gradient_spanning_more_than_the_limit_reaches_the_kernels_packed(monkeypatch):
    """The gradient autograd hands the backward may be laid out as the caller likes: one whose
    head spans past the int32 limit (1,000 elements here, standing in for 2³¹) is packed
    before the kernels read it, and the gradients stay right (within twice SDPA's error)."""
    from selfattn.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "MAX_HEAD_OFFSET", 1_000)
    seen = []  # the span of each gradient the kernels were given
    backward = triton_attention._backward

    def spying_backward(grad_out, *rest):
        seen.append(triton_attention._span(grad_out))
        return backward(grad_out, *rest)

    monkeypatch.setattr(triton_attention, "_backward", spying_backward)
    q, k, v, _ = _inputs(33, 33, 16, lead=(1, 2))
    grad = torch.randn(1, 2, 33, 64)[..., :16]  # rows 64 apart: 32 · 64 + 15 = 2,063
    assert_matches_reference(q, k, v, grad)
    assert seen and max(seen) <= 1_000, seen


def test_double_backward_is_refused():
    q, k, v = (x.float().requires_grad_() for x in _inputs(7, 9, 16)[:3])
    out = attention(q, k, v, backend="triton")
    with pytest.raises(RuntimeError, match="first derivatives only"):
        torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)


def test_cosine_similarity_through_the_dispatcher():
    assert_matches_reference(*_inputs(33, 33, 16), similarity="cosine", causal=True)


@pytest.mark.parametrize("lead", [(), (2,), (2, 1, 3)])
def test_any_leading_dims(lead):
    mask = torch.rand(*lead, 1, 33, generator=torch.Generator().manual_seed(3)) > 0.2
    assert_matches_reference(*_inputs(7, 33, 16, lead=lead), mask=mask)


@pytest.mark.parametrize(
    "mask_shape, stored",
    [((2, 1, 1, 1, 64), 6 * 64), ((3, 1, 33, 64), 6 * 33 * 64), ((2, 3, 4, 1, 64), 24 * 64)],
    ids=["key-padding", "per-group", "per-head"],
)
def test_a_mask_over_five_dim_inputs_is_copied_at_its_own_size_only(mask_shape, stored):
    """Merging the outer leading dims of (2, 3, 4) heads into one may copy the mask, but only
    at its own size in the heads, queries and keys: a key-padding mask takes 2 · 3 · 64 bytes,
    not the 2 · 3 · 4 · 33 · 64 of a full one, and a per-head one is not copied. Results within
    twice SDPA's error."""
    from selfattn.kernels.triton_attention import _kernel_mask

    lead = (2, 3, 4)
    mask = torch.rand(*mask_shape, generator=torch.Generator().manual_seed(8)) > 0.3
    view, inner, _ = _kernel_mask(mask, torch.Size(lead), 33, 64, torch.device("cpu"))
    assert view.shape == (6, 4, 33, 64) and inner == 4
    assert view.untyped_storage().nbytes() == stored
    assert_matches_reference(*_inputs(33, 64, 16, lead=lead), mask=mask)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_an_expanded_mask_reaches_the_kernels_at_its_own_size(dtype):
    """A (B, 1, 1, S) padding mask given expanded to (B, H, T, S) is read at its own size
    (B · S elements, broadcast at stride 0): a float one used to be copied in full by the
    clamp to float32's range. Results within twice SDPA's error."""
    from selfattn.kernels.triton_attention import _kernel_mask

    padding = torch.randn(2, 1, 1, 64, generator=torch.Generator().manual_seed(10)).to(dtype)
    padding[1, ..., 40:] = False if dtype == torch.bool else float("-inf")
    mask = padding.expand(2, 3, 33, 64)
    view, _, _ = _kernel_mask(mask, torch.Size((2, 3)), 33, 64, torch.device("cpu"))
    assert view.untyped_storage().nbytes() == padding.untyped_storage().nbytes()
    assert_matches_reference(*_inputs(33, 64, 16), mask=mask, causal=True)


def count_launches(monkeypatch) -> list[int]:
    """The heads (outer · inner) of each forward and backward kernel launch, as they happen."""
    from selfattn.kernels import triton_attention

    launched = []
    for name in ("_forward", "_backward"):
        launch = getattr(triton_attention, name)

        def counted(*args, _launch=launch, **kwargs):
            query = args[1] if _launch is triton_attention._backward else args[0]
            launched.append(query.shape[0] * query.shape[1])
            return _launch(*args, **kwargs)

        monkeypatch.setattr(triton_attention, name, counted)
    return launched


@pytest.mark.parametrize("lead", [(5, 2), (9,)], ids=["batch-by-heads", "heads-over-the-cap"])
def test_more_heads_than_a_grid_axis_takes_go_in_several_launches(monkeypatch, lead):
    """CUDA caps the grid axis that holds the heads at 65,535 (a cap of 4 here): more heads go
    in several launches of at most that many, and the result is the same (same tolerance);
    a last dim over the cap is read with one head per outer row."""
    from selfattn.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "MAX_GRID_HEADS", 4)
    launched = count_launches(monkeypatch)
    mask = torch.rand(*lead, 1, 33, generator=torch.Generator().manual_seed(5)) > 0.3
    assert_matches_reference(*_inputs(7, 33, 16, lead=lead), mask=mask, causal=True)
    assert max(launched) <= 4
    assert sum(launched) == 2 * torch.Size(lead).numel()  # every head, forward and backward


def test_heads_exactly_at_the_grid_cap_go_in_one_launch_unsliced(monkeypatch):
    """At exactly the cap (2 outer rows of 2 heads, a cap of 4) the tensors go to one launch
    as they are, neither sliced (a slice's backward hands back contiguous gradients) nor
    joined again by torch.cat: the launch sees the very tensors, and its result is returned."""
    from selfattn.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "MAX_GRID_HEADS", 4)
    tensors = [torch.randn(2, 2, 5, 8) for _ in range(3)]
    launched, result = [], torch.zeros(2, 2, 5, 8)

    def launch(*pieces):
        launched.append(pieces)
        return result

    assert triton_attention._in_launches(launch, 2, *tensors, None) is result
    assert len(launched) == 1
    assert all(got is given for got, given in zip(launched[0], [*tensors, None], strict=True))


def test_kernels_launch_with_the_inputs_gpu_as_the_current_one(monkeypatch):
    """Triton launches on the current GPU: tensors on cuda:1 while cuda:0 was current sent a
    kernel to read another GPU's memory. Every launch now runs under the inputs' device
    (seen through a stand-in for torch.cuda.device: this machine has no GPU)."""
    from selfattn.kernels import triton_attention

    current = []

    @contextmanager
    def device(which):
        current.append(which)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)

    class OnSecondGpu:  # what _in_launches reads of a tensor
        shape, is_cuda, device = (2, 3), True, torch.device("cuda", 1)

    launch = lambda *tensors: list(current)  # noqa: E731
    assert triton_attention._in_launches(launch, 3, OnSecondGpu()) == [torch.device("cuda", 1)]
    assert current == []
    assert triton_attention._in_launches(launch, 3, torch.zeros(2, 3)) == []  # CPU: no guard


@pytest.mark.parametrize("in_context_var", [True, False])
@pytest.mark.parametrize("users", [False, True])
def test_an_allocator_is_set_for_tensor_descriptors_unless_the_user_set_one(
    monkeypatch, in_context_var, users
):
    """TMA loads need an allocator at launch. Triton keeps it in a ContextVar, earlier
    releases in a plain variable, where reading it with .get() raised AttributeError."""
    from contextvars import ContextVar

    from triton.runtime import _allocation

    from selfattn.kernels import triton_attention

    held = (lambda size, alignment, stream: None) if users else _allocation.NullAllocator()
    if in_context_var:
        held = ContextVar("allocator", default=held)
    monkeypatch.setattr(_allocation, "_allocator", held)
    chosen = []
    monkeypatch.setattr(triton_attention.triton, "set_allocator", chosen.append)
    triton_attention._ensure_allocator()
    assert chosen == ([] if users else [triton_attention._device_scratch])


def test_non_contiguous_inputs():
    # (B, T, H, D) transposed to (B, H, T, D), as a layer that splits heads produces.
    generator = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(2, n, 3, 16, generator=generator, dtype=torch.float64).transpose(1, 2)
        for n in (7, 33, 33)
    )
    grad = torch.randn(2, 3, 7, 16, generator=generator, dtype=torch.float64)
    assert not q.float().is_contiguous()
    assert_matches_reference(q, k, v, grad, causal=True)


def test_transposed_heads_reach_the_kernels_without_a_copy(monkeypatch):
    """A (B, H, T, D) view of a (B, T, H, D) projection goes to the kernels where it lies (an
    outer and an inner stride per tensor), not copied to contiguous first; the output and the
    gradients come back in the same layout, so the caller's transposes back are views too."""
    from selfattn.kernels import triton_attention

    seen = []
    apply = triton_attention._FusedAttention.apply

    def recording(*args):
        seen.extend(x.data_ptr() for x in args[:3])
        return apply(*args)

    monkeypatch.setattr(triton_attention._FusedAttention, "apply", recording)
    q, k, v = (torch.randn(2, n, 3, 16, requires_grad=True).transpose(1, 2) for n in (7, 33, 33))
    out = attention(q, k, v, backend="triton")
    assert seen == [x.data_ptr() for x in (q, k, v)]
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all(x.transpose(1, 2).is_contiguous() for x in (out, *grads))
    torch.testing.assert_close(out, attention(q, k, v, backend="sdpa"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize(
    "t, s, d, causal",
    [(33, 33, 16, False), (7, 40, 16, True), (40, 7, 16, True), (128, 128, 16, False),
     (128, 128, 16, True), (33, 64, 24, True), (33, 16, 16, False)],
)  # fmt: skip
def test_tensor_descriptor_loads(monkeypatch, t, s, d, causal, tma):
    """The forward kernel with TMA loads forced on (or off): zero-filled edges past T, S and
    the head dim, one key tile or many, causal rows that see only masked tiles."""
    from selfattn.kernels import triton_attention

    forced = triton_attention._config(16, 32, 4, 1, USE_TMA=tma, LAZY=True, A_FROM_REGISTERS=tma)
    monkeypatch.setattr(triton_attention._forward_kernel, "configs", [forced])
    assert_matches_reference(*_inputs(t, s, d), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("growth", [0.0, 0.05, 0.5, 1.0])
def test_lazy_rescaling_when_row_maxima_grow(monkeypatch, lazy, growth, causal):
    """Unmasked tiles with a stale shift (LAZY) or the exact one, on keys whose scores grow
    along the sequence: not at all, by less than the 2⁸ limit over a tile, or far past it
    (the shift must move on later tiles), against the explicit path. Causal, the masked
    diagonal tiles then take over a stale shift from the unmasked ones."""
    from selfattn.kernels import triton_attention

    forced = triton_attention._config(16, 32, 4, 1, USE_TMA=False, LAZY=lazy, A_FROM_REGISTERS=lazy)
    monkeypatch.setattr(triton_attention._forward_kernel, "configs", [forced])
    q, k, v, grad = _inputs(16, 128, 16)
    k = k * (1 + growth * torch.arange(128, dtype=torch.float64))[:, None]
    q = q.abs()  # every row's scores grow with the key index
    k = k.abs()
    assert_matches_reference(q, k, v, grad, causal=causal)


def test_tma_tuning_is_not_reused_for_a_layout_without_tma(monkeypatch):
    """The forward's tuning result is kept per layout class: a TMA tiling picked for aligned
    rows must not be reused for keys the copy engine cannot read (here with a column stride),
    which the kernel refuses at compile time."""
    from selfattn.kernels import triton_attention

    kernel = triton_attention._forward_kernel
    tiling = (16, 32, 4, 1)
    configs = [triton_attention._config(*tiling, USE_TMA=tma, LAZY=True, A_FROM_REGISTERS=False)
               for tma in (True, False)]  # fmt: skip
    timings = iter(range(1, 100))  # a fake timer: the first candidate, TMA, wins
    monkeypatch.setattr(kernel, "configs", configs)
    monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(kernel, "do_bench", lambda fn, quantiles: next(timings))
    q, k, v, grad = _inputs(7, 33, 16)
    assert_matches_reference(q, k, v, grad)
    assert kernel.best_config.kwargs["USE_TMA"]
    k_by_columns = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert_matches_reference(q, k_by_columns, v, grad)
    assert not kernel.best_config.kwargs["USE_TMA"]


def test_each_gpu_tunes_for_itself(monkeypatch):
    """The kernels' tuning results are kept per GPU: a tiling picked on one GPU may not fit
    another's shared memory, and the fastest differs. Two GPUs seen through a stand-in for
    the index the launches pass (this machine has none): the second is timed anew, and the
    first's choice then comes back from the cache, untimed."""
    from selfattn.kernels import triton_attention

    gpu = {"index": 0}
    tuning_args = triton_attention._tuning_args
    on_gpu = lambda query, key: (*tuning_args(query, key)[:2], gpu["index"])  # noqa: E731
    monkeypatch.setattr(triton_attention, "_tuning_args", on_gpu)
    tilings = [(16, 32, 4, 1), (32, 16, 4, 1)]
    kernels = {"forward": triton_attention._forward_kernel, "dq": triton_attention._dq_kernel}
    for kernel in kernels.values():
        switches = {"USE_TMA": False, "LAZY": True, "A_FROM_REGISTERS": False}
        configs = [triton_attention._config(*tiling, **switches) for tiling in tilings]
        monkeypatch.setattr(kernel, "configs", configs)
        monkeypatch.setattr(kernel, "cache", {})
    fake_ms = iter([1, 2, 1, 2, 2, 1, 2, 1])  # forward then dQ: GPU 0 the first, GPU 1 the second
    timed = []
    for kernel in kernels.values():
        monkeypatch.setattr(
            kernel, "do_bench", lambda fn, quantiles: timed.append(1) or next(fake_ms)
        )
    monkeypatch.setattr(triton_attention, "backward_plan", "split")
    q, k, v, grad = _inputs(7, 33, 16)
    picked = {}
    for index in (0, 1, 0):
        gpu["index"] = index
        assert_matches_reference(q, k, v, grad)
        picked[index] = [kernel.best_config.kwargs["BLOCK_M"] for kernel in kernels.values()]
    assert picked == {0: [16, 16], 1: [32, 32]}
    assert len(timed) == 8  # two candidates, two kernels, two GPUs; none for the third call
    assert all(len(kernel.cache) == 2 for kernel in kernels.values())

    class OnSecondGpu:  # what _tuning_args reads of a tensor
        shape, is_cuda, device = (2, 5000, 16), True, torch.device("cuda", 1)

    assert tuning_args(OnSecondGpu(), q) == (16384, 1024, 1)
    assert tuning_args(q, q) == (1024, 1024, -1)  # the interpreter's CPU tensors


def test_tensor_descriptors_only_for_layouts_the_copy_engine_takes():
    from selfattn.kernels.triton_attention import _tma_ok

    rows = torch.randn(3, 33, 16)
    assert _tma_ok(rows, rows)
    assert not _tma_ok(rows, rows.transpose(1, 2))  # last stride is not 1
    assert not _tma_ok(torch.randn(3, 33, 5))  # 20-byte rows are not 16-byte aligned
    assert not _tma_ok(torch.randn(3 * 33 * 16 + 1)[1:].view(3, 33, 16))  # misaligned start
    assert not _tma_ok(rows, torch.randn(3, 1, 16).expand(3, 33, 16))  # rows overlap (stride 0)
    assert _tma_ok(torch.randn(1, 33, 16).expand(3, 33, 16))  # heads may share their rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("plan", ["split", "atomic"])
def test_half_precision_within_twice_sdpa_error(monkeypatch, plan, dtype):
    """bfloat16 too: the interpreter multiplies bfloat16 tiles as integers unless widened."""
    from selfattn.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "backward_plan", plan)
    assert_matches_reference(*_inputs(33, 64, 16), dtype=dtype, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_cosine_of_zero_and_long_vectors(dtype):
    """A zero key, and norms past float16's 65504: NaN everywhere and uniform weights while
    cosine normalised in the inputs' dtype (test_attention.py has the other backends)."""
    q, k, v, _ = _inputs(9, 11, 16)
    k[..., 3, :] = 0
    q[..., 2, :] *= 1e4
    k[..., 5, :] *= 1e4
    reference = attention(q, k, v, similarity="cosine", backend="explicit")
    ours, baseline = (
        attention(*(x.to(dtype) for x in (q, k, v)), similarity="cosine", backend=backend)
        for backend in ("triton", "sdpa")
    )
    error, base_error = ((x.double() - reference).abs().max() for x in (ours, baseline))
    assert error <= 2 * base_error + ABS_FLOOR[dtype], (error, base_error)


def test_bfloat16_output_rounds_to_nearest_as_on_a_gpu():
    """Equal scores (query 0) over three keys: the output is the values' float32 mean, rounded
    to nearest even, bit for bit (the interpreter's own cast would truncate)."""
    _, k, v, _ = (x.bfloat16() for x in _inputs(1, 3, 16, lead=(4,)))
    q = torch.zeros(4, 1, 16, dtype=torch.bfloat16)
    out = attention(q, k, v, backend="triton")
    assert torch.equal(out, (v.float().sum(-2, keepdim=True) / 3).bfloat16())


def test_half_precision_float_mask_with_its_own_minimum():
    # A float16 model's padding mask holds finfo(float16).min; clamping it to float32's range
    # must not overflow float16.
    mask = torch.zeros(2, 1, 1, 64, dtype=torch.float16)
    mask[1, ..., 40:] = torch.finfo(torch.float16).min
    mask[0, ..., ::7] = float("-inf")
    assert_matches_reference(*_inputs(33, 64, 16), dtype=torch.float16, mask=mask)


def _why_not(q=None, k=None, v=None, mask=None, dropout_p=0.0) -> str | None:
    q, k, v = (torch.randn(7, 16) if x is None else x for x in (q, k, v))
    call = make_call(q, k, v, mask, False, "dot", None, dropout_p)
    return BACKENDS["triton"].why_not(call)


@pytest.mark.parametrize(
    "version, interpreting, needed",
    [("3.0.0", False, "3.4"), ("3.3.1", False, "3.4"), ("3.4.0", False, None),
     ("3.6.0", True, "3.7"), ("3.7.1", True, None), ("3.10.0+git1a2b", True, None)],
)  # fmt: skip
def test_a_triton_too_old_is_a_reason_naming_the_version_needed(
    monkeypatch, version, interpreting, needed
):
    """torch 2.4 pins triton 3.0, whose autotune has no do_bench: the kernels' module would
    raise a TypeError on import. The reason names the version found and the one needed."""
    import triton

    attention_module = importlib.import_module("selfattn.attention")
    monkeypatch.setattr(triton, "__version__", version)
    reason = attention_module._triton_too_old(interpreting)
    if needed is None:
        assert reason is None
    else:
        assert f"triton {needed}, found {version}" in reason
        assert f"pip install -U 'triton>={needed}'" in reason
    if interpreting:  # what the dispatcher says, and so what backend="triton" raises
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert _why_not() == reason


def test_a_triton_that_fails_to_import_is_a_reason_not_a_traceback(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "selfattn.kernels.triton_attention", None)  # import fails
    reason = _why_not()
    assert reason.startswith("backend 'triton' cannot import triton (") and "reinstall" in reason
    q = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"cannot import triton \("):
        attention(q, q, q, backend="triton")


def test_why_not_explains_each_refusal(monkeypatch):
    assert _why_not() is None
    assert "dropout" in _why_not(dropout_p=0.1)
    wide = torch.randn(7, 512)
    assert "up to 256" in _why_not(wide, wide, wide)
    double = torch.randn(7, 16, dtype=torch.float64)
    assert "float64" in _why_not(double, double, double)
    assert "gradients for a float mask" in _why_not(mask=torch.zeros(7, 7, requires_grad=True))
    for refused in (_why_not(wide, wide, wide), _why_not(double, double, double)):
        assert "use backend='sdpa', 'chunked' or 'explicit'" in refused  # the way out

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    message = _why_not()
    assert "CUDA" in message and "TRITON_INTERPRET=1" in message
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: None)
    assert "pip install" in _why_not()


SM_86, SM_80 = 101_376, 166_912  # bytes of shared memory a block may take on those GPUs


@pytest.mark.parametrize("budget", [SM_86, SM_80, 200 * 1024])
@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.bfloat16, 256), (torch.float32, 128)],
)
def test_the_pruner_keeps_tilings_within_the_gpus_shared_memory(budget, dtype, head_dim):
    """With no tiling of its own that fit (head dim 256, or float32 at 128 on an A100), a
    kernel kept its smallest anyway, and the launch failed for want of shared memory. Now
    every kernel keeps at least one tiling, each within the GPU's budget by the estimate
    (compiled, benchmarks/triton_sm90.py --capability 86 --head-dims 256 --kept-only shows
    them within it), its own tilings if any fits, else the smaller ones, never a mix: at
    head dims up to 128 in bfloat16 on Hopper, the tilings timed on the H200 are kept."""
    from selfattn.kernels import triton_attention as kernels

    offered = {
        "forward": kernels._forward_configs(False),
        "dk/dv": kernels._dkdv_configs(False),
        "dq": kernels._dq_configs(False),
    }
    q = torch.empty(0, dtype=dtype)
    for name, configs in offered.items():
        prune = kernels.AUTOTUNED[name].early_config_prune
        kept = prune(configs, {"Q": q}, budget, BLOCK_D=head_dim, BLOCK_DV=head_dim, TMA_OK=True)
        sizes = [kernels.shared_bytes(name, c, dtype.itemsize, 2 * head_dim) for c in kept]
        assert kept and max(sizes) <= budget, (name, sizes)
        own = [config for config in kept if any(config is mine for mine in configs)]
        assert own in ([], kept), name
        if budget == 200 * 1024 and dtype == torch.bfloat16 and head_dim <= 128:
            assert own, name


def test_the_pruner_drops_spilling_tilings_and_keeps_the_h200_winners_at_head_dim_128():
    """At bfloat16 head dim 128 on Hopper (200 KiB): 128-query blocks on 4 warps spill
    registers from head dim 128 on, so the forward pruner keeps none; the dk/dv kernel keeps
    its 64 query rows x 128 keys (streaming 3 stages of 64-row query tiles past 128 stationary
    key rows, (128 + 3 · 64) · 256 · 2 bytes, within budget), the tiling that won on an H200."""
    from selfattn.kernels import triton_attention as kernels

    q = {"Q": torch.empty(0, dtype=torch.bfloat16)}
    widths = dict(BLOCK_D=128, BLOCK_DV=128, TMA_OK=True)
    prune = kernels.AUTOTUNED["forward"].early_config_prune
    kept = prune(kernels._forward_configs(False), q, 200 * 1024, **widths)
    assert kept and not [c for c in kept if c.kwargs["BLOCK_M"] == 128 and c.num_warps == 4]

    winner = kernels._config(64, 128, 8, 3, A_FROM_REGISTERS=False)
    assert kernels.shared_bytes("dk/dv", winner, 2, 256) == (128 + 3 * 64) * 256 * 2
    prune = kernels.AUTOTUNED["dk/dv"].early_config_prune
    kept = prune(kernels._dkdv_configs(False), q, 200 * 1024, **widths)
    tilings = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in kept]
    assert (64, 128, 8) in tilings


def test_a_budget_of_exactly_the_need_is_enough(monkeypatch):
    """A tiling whose estimate equals the budget fits. Float32 at head dim 128 needs exactly
    64 KiB (32 x 32 tiles, one stage: 64 rows of 256 four-byte elements): a GPU offering
    65,536 bytes serves it, one byte less refuses it. And the pruner, at a budget of exactly
    the (64, 32, 4, 2) small tiling's estimate (bfloat16, head dims 256), keeps that tiling."""
    from selfattn.kernels import triton_attention as kernels

    wide = torch.randn(7, 128)
    monkeypatch.setattr(kernels, "shared_memory_budget", lambda tensor: 65_536)
    assert kernels._shared_memory_shortfall(wide, wide) is None
    assert _why_not(wide, wide, wide) is None
    monkeypatch.setattr(kernels, "shared_memory_budget", lambda tensor: 65_535)
    assert "need 64 KiB of shared memory" in _why_not(wide, wide, wide)

    prune = kernels.AUTOTUNED["forward"].early_config_prune
    q = {"Q": torch.empty(0, dtype=torch.bfloat16)}
    small = kernels.small_configs("forward")
    assert kernels.shared_bytes("forward", small[0], 2, 512) == 131_072
    kept = prune(small, q, 131_072, BLOCK_D=256, BLOCK_DV=256, TMA_OK=False)
    tilings = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
    assert (64, 32, 4, 2) in tilings


def test_inputs_too_wide_for_the_gpus_shared_memory_are_refused(monkeypatch):
    """Float32 at head dim 256 on a GPU with 99 KiB per block: even the smallest tiling
    would not fit, so Triton is refused (auto takes another backend) in one line."""
    from selfattn.kernels import triton_attention as kernels

    monkeypatch.setattr(kernels, "shared_memory_budget", lambda tensor: SM_86)
    wide = torch.randn(7, 256)
    reason = _why_not(wide, wide, wide)
    assert reason.startswith("backend 'triton': the Triton kernels need 128 KiB of shared")
    assert "256 (value) in float32, and this GPU offers 99 KiB; use float16 or bfloat16" in reason
    assert _why_not(*(wide.bfloat16() for _ in range(3))) is None
    assert _why_not(*(wide[:, :128] for _ in range(3))) is None


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_a_float_mask_that_requires_grad_is_served_where_no_gradient_is_asked(grad_mode):
    """A learned float mask (a parameter) evaluated under no_grad or inference_mode needs no
    gradient: the kernels take it (it used to be refused, so auto left Triton at evaluation).
    Output within twice SDPA's error of the float64 explicit path. With grad mode on it is
    refused, naming the ways out."""
    q, k, v, _ = _inputs(33, 64, 16)
    bias = torch.randn(3, 33, 64, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    with grad_mode():
        expected = attention(q, k, v, mask=bias, causal=True, backend="explicit")
        q, k, v, learned = (x.float().requires_grad_() for x in (q, k, v, bias))
        output = attention(q, k, v, mask=learned, causal=True, backend="triton")
        baseline = attention(q, k, v, mask=learned, causal=True, backend="sdpa")
    error = (output.double() - expected).abs().max().item()
    base_error = (baseline.double() - expected).abs().max().item()
    assert error <= 2 * base_error + ABS_FLOOR[torch.float32]
    with pytest.raises(ValueError, match=r"gradients for a float mask; detach the mask"):
        attention(q, k, v, mask=learned, causal=True, backend="triton")


def test_refusals_raise_from_attention():
    q, k, v, _ = (x.float() for x in _inputs(7, 7, 16))
    with pytest.raises(ValueError, match="dropout"):
        attention(q, k, v, dropout_p=0.5, backend="triton")
    with pytest.raises(ValueError, match="cannot return a trace"):
        attention(q, k, v, backend="triton", return_trace=True)


def test_auto_keeps_sdpa_on_cpu():
    q, k, v, _ = (x.float() for x in _inputs(7, 7, 16))
    call = make_call(q, k, v, None, False, "dot", None, 0.0)
    assert choose_backend(call).name == "sdpa"


def test_importing_selfattn_does_not_import_triton():
    code = "import sys, selfattn, selfattn.attention; assert 'triton' not in sys.modules"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_kernels_compile_for_hopper_with_wgmma_and_no_spills():
    """benchmarks/triton_sm90.py, ahead of time for sm_90 (no GPU needed): the forward kernel
    at head dim 64 compiles in every configuration, uses wgmma (HGMMA), and does not spill."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_sm90.py"
    command = [sys.executable, str(script), "--kernels", "forward"]
    command += ["--head-dims", "64", "--causal", "no"]
    report = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    rows = [
        line.split(" | ") for line in report.stdout.splitlines() if line.startswith("| forward")
    ]
    assert rows, report.stdout
    for row in rows:
        assert "failed" not in row[3], row
        stack, hgmma = int(row[6]), int(row[8])
        assert stack == 0 and hgmma > 0, row


@pytest.mark.slow
def test_tilings_kept_at_head_dim_256_fit_a_gpu_with_99_kib_per_block():
    """benchmarks/triton_sm90.py --capability 86: what the pruner keeps at head dim 256 for
    an RTX 30-class GPU (sm_86, 99 KiB of shared memory per block), compiled by Triton for
    it, fits: the smallest forward it had kept took 104 KiB, and its launch failed."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_sm90.py"
    command = [sys.executable, str(script), "--kernels", "forward", "dk/dv", "dq"]
    command += ["--capability", "86", "--head-dims", "256", "--causal", "no", "--kept-only"]
    report = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert report.returncode == 0, report.stderr[-2000:]
    rows = [line.split(" | ") for line in report.stdout.splitlines() if line.startswith("| ")]
    kernels = {row[0].removeprefix("| ") for row in rows[1:]}
    assert kernels == {"forward", "dk/dv", "dk/dv + atomic dq", "dq"}, report.stdout
    for row in rows[1:]:
        assert "failed" not in row[3] and int(row[7]) <= SM_86 // 1024, row


def test_gluon_forward_compiles_for_hopper_with_the_softmax_under_pv():
    """The Gluon forward (hopper_forward), compiled ahead of time for sm_90 by
    benchmarks/triton_sm90.py: every tiling compiles at each head dim it is offered for,
    causal and not, for both input layouts, and in each loop over key tiles (one per
    warpgroup in the ping-pong kernel) at least three quarters of a tile's exp2 (BLOCK_N / 2
    per thread) issue while PV's wgmma still runs, which is what the kernel is for. ptxas
    decides that placement, so it is checked in the machine code, not assumed from the
    source: with Triton 3.6 (the GPU machine's) nearly all do (61 of 64 in one interleaved
    tiling); with 3.9, 27 of 32 in one tiling at D = 64. No spills, but for the ping-pong
    warpgroups' few words (24 to 48 bytes), the price of the register cap under which ptxas
    keeps that placement there."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from selfattn.kernels import hopper_forward

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_sm90.py"
    command = [sys.executable, str(script), "--kernels", "gluon forward"]
    command += ["--head-dims", "64", "128", "--causal", "both"]
    report = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    rows = [line.split(" | ") for line in report.stdout.splitlines()
            if line.startswith("| gluon forward")]  # fmt: skip
    offered = sum(len(config.head_dims) for config in hopper_forward.CONFIGS)
    assert len(rows) == offered * 2 * 2, report.stdout  # x causal or not x layouts
    for row in rows:
        assert "failed" not in row[3], row
        block_n = int(row[3].split("BLOCK_N=")[1].split()[0])
        warpgroups = 2 if "ping-pong" in row[3] else 1  # each runs its own loops
        loops = len(row[4].split(","))  # causal has a second loop, for the diagonal's tiles
        stack, hgmma, under = int(row[6]), int(row[8]), int(row[11].split("/")[0])
        assert stack <= (48 if warpgroups == 2 else 0) and hgmma > 0, row
        assert loops == (2 if row[2] == "True" else 1) * warpgroups, row
        assert under >= 0.75 * loops * block_n // 2, row


class _Launches:
    """Stands in for a Gluon kernel: records each launch's grid, arguments and options."""

    def __init__(self) -> None:
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **options: self.calls.append((grid, args, options))


def _head_blocks(descriptor, tensor, interleaved: bool):
    """Each (batch, head) block of ``tensor`` (B, H, N, D), read as the kernels address it in
    the descriptor's matrix: head ``b·H + h`` at rows from ``b·N`` (interleaved) or
    ``(b·H + h)·N`` and columns from ``h·D`` (interleaved) or 0."""
    b, h, n, d = tensor.shape
    matrix = descriptor.base
    assert matrix.data_ptr() == tensor.data_ptr()  # a view of the caller's storage, no copy
    assert list(matrix.shape) == descriptor.shape and list(matrix.stride()) == descriptor.strides
    for head in range(b * h):
        row = (head // h) * n if interleaved else head * n
        col = (head % h) * d if interleaved else 0
        yield tensor[head // h, head % h], matrix[row : row + n, col : col + d]


def _assert_addressed(descriptors, tensors, block_rows, interleaved: bool) -> None:
    """Each descriptor moves blocks of (rows, D) over its tensor's own memory, and each head
    of the tensor is exactly where the kernels address it (the same memory, not a copy)."""
    for descriptor, x, rows in zip(descriptors, tensors, block_rows, strict=True):
        assert descriptor.block_shape == [rows, x.shape[-1]]
        for block, addressed in _head_blocks(descriptor, x, interleaved):
            assert (block.data_ptr(), block.shape, block.stride()) == (
                addressed.data_ptr(), addressed.shape, addressed.stride()
            )  # fmt: skip


@pytest.mark.parametrize("interleaved", [False, True], ids=["heads", "interleaved"])
def test_gluon_launches_address_every_head_of_either_layout(monkeypatch, interleaved):
    """The Gluon kernels' host side on CPU tensors (no GPU needed up to the launch): grids,
    block shapes, and descriptors over the caller's storage whose matrix holds each head
    where the kernels look for it, for the contiguous and the (B, T, H, D) layouts; outputs
    and gradients laid out as their inputs."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from selfattn.kernels import hopper_backward, hopper_forward

    b, h, t, s, d = 2, 3, 256, 384, 128
    made = torch.Generator().manual_seed(5)

    def tensor(n):
        shape = (b, n, h, d) if interleaved else (b, h, n, d)
        x = torch.randn(*shape, generator=made).half()
        return x.transpose(1, 2) if interleaved else x

    q, k, v, grad_out = tensor(t), tensor(s), tensor(s), tensor(t)
    for config in hopper_forward.CONFIGS:
        launches = _Launches()
        kernel = "_pingpong_kernel" if config.pingpong else "_forward_kernel"
        monkeypatch.setattr(hopper_forward, kernel, launches)
        out, lse = hopper_forward.hopper_forward(q, k, v, False, 0.1, config)
        ((grid, args, options),) = launches.calls
        assert grid == (t // config.rows, b * h) and options["INTERLEAVED"] == interleaved
        assert out.stride() == q.stride() and lse.shape == (b * h, t)
        assert args[8] == (h if interleaved else 1)  # heads per row of the matrix
        m, n = config.block_m, config.block_n
        _assert_addressed(args[:4], (q, k, v, out), (m, n, n, m), interleaved)
    grad_key, grad_value = torch.empty_like(k), torch.empty_like(v)
    for config in hopper_backward.CONFIGS:
        launches = _Launches()
        monkeypatch.setattr(hopper_backward, "_backward_kernel", launches)
        lse, delta = torch.zeros(b * h, t), torch.zeros(b * h, t)
        grad_query = hopper_backward.hopper_backward(
            grad_out, q, k, v, lse, delta, grad_key, grad_value, False, 0.1, 0.14, config
        )
        ((grid, args, options),) = launches.calls
        assert grid == (s // config.block_n, b * h) and options["INTERLEAVED"] == interleaved
        assert grad_query.shape == (b * h, t, d) and grad_query.dtype == torch.float32
        tensors = (q, k, v, grad_out, grad_key, grad_value)
        m, n = config.block_m, config.block_n
        _assert_addressed(args[:6], tensors, (m, n, n, m, n, n), interleaved)


def test_gluon_backward_compiles_for_hopper():
    """The Gluon backward (hopper_backward), compiled ahead of time for sm_90 by
    benchmarks/triton_sm90.py at head dims 64 and 128, causal and not, both layouts: it uses
    wgmma and atomic adds (dQ), runs one loop over query tiles (two, causal: the diagonal's
    tiles first), and its exp2 issue while dPᵀ's wgmma still runs. Spills stay small: none
    at D = 64; at D = 128 Triton 3.9 spills up to 24 bytes and 3.6, the GPU machine's, 16
    (144 causal), a few local loads per iteration, where 64-query tiles spilled 248."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_sm90.py"
    command = [sys.executable, str(script), "--kernels", "gluon backward"]
    report = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    rows = [line.split(" | ") for line in report.stdout.splitlines()
            if line.startswith("| gluon backward")]  # fmt: skip
    from selfattn.kernels import hopper_backward

    tilings = len(hopper_backward.CONFIGS)
    assert len(rows) == tilings * 2 * 2 * 2, report.stdout  # x head dims, causal, layouts
    for row in rows:
        assert "failed" not in row[3], row
        loops = len(row[4].split(","))
        stack, hgmma, reductions = int(row[6]), int(row[8]), int(row[10])
        under, exp2 = (int(x) for x in row[11].split("/"))
        assert loops == (2 if row[2] == "True" else 1), row
        assert hgmma > 0 and reductions > 0 and under >= 0.75 * exp2, row
        assert stack <= (0 if row[1] == "64" else 160), row


@pytest.mark.parametrize("error", [1.0, 1.01], ids=["right", "wrong"])
def test_gluon_check_logic_with_the_triton_forward_standing_in(monkeypatch, capsys, error):
    """gpu_attention.py's check of the Gluon forward (the child process on the GPU) runs its
    own logic on CPU here, with the Triton forward standing in for the Gluon kernel. As it is,
    every case passes: the reference log-sum-exp (base 2, bottom-right causal) matches the
    Triton forward's, so a wrong reference cannot fail a right kernel. With its output off by
    1% from query row 20 on, the check fails and says which rows."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_attention
    from selfattn.kernels import hopper_forward, triton_attention

    def stand_in(query, key, value, causal, qk_scale, config=None):
        heads = [x.reshape(1, -1, *x.shape[-2:]) for x in (query, key, value)]
        scale = qk_scale / triton_attention.LOG2E
        inner, none = heads[0].shape[1], triton_attention.MASK_NONE
        out, lse = triton_attention._forward(*heads, None, inner, none, causal, scale)
        out = out.reshape(*query.shape[:-1], value.shape[-1]).clone()
        out[..., 20:, :] *= error
        return out, lse

    def candidates(query, key, value, mask, causal, scale):
        qk_scale = scale * triton_attention.LOG2E
        return {"stand-in": lambda: stand_in(query, key, value, causal, qk_scale)}

    monkeypatch.setattr(hopper_forward, "hopper_forward", stand_in)
    small = dataclasses.replace(hopper_forward.CONFIGS[0], head_dims=(16,))
    monkeypatch.setattr(hopper_forward, "CONFIGS", (small,))
    monkeypatch.setattr(triton_attention, "_gluon_forwards", candidates)
    monkeypatch.setattr(triton_attention, "forward_kernel", "triton")
    cases = [
        (1, 2, 32, 32, 16, False, torch.float32, "heads"),
        (1, 2, 16, 48, 16, True, torch.float32, "interleaved"),
    ]
    monkeypatch.setattr(gpu_attention, "HOPPER_CHECK_CASES", cases)
    status = gpu_attention.hopper_check_main(torch.device("cpu"), [0])  # the forward tiling
    report = capsys.readouterr().out
    if error == 1.0:
        assert status == 0, report
        assert report.count("| yes |") == 2 and gpu_attention.PASSED in report, report
    else:  # T = 32 has rows 20..31 off in both heads; T = 16 has none past 20
        assert status == 1 and gpu_attention.PASSED not in report, report
        assert "output: 24 of 64 query rows off; first at [20, 21" in report, report


@pytest.mark.parametrize("error", [1.0, 1.01], ids=["right", "wrong"])
def test_gluon_backward_check_logic_with_a_torch_stand_in(monkeypatch, capsys, error):
    """The same check of the Gluon backward, with the backward written out in torch standing
    in for the kernel (from the Triton forward's log-sum-exp and the preprocess kernel's Δ,
    as the kernel gets them): right, it passes, so the plan, the layouts and the reference
    agree; with dK 1% off from key row 20 on, it fails and names dK and the rows."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_attention
    from selfattn.kernels import hopper_backward, triton_attention

    def stand_in(grad_out, query, key, value, lse, delta, grad_key, grad_value, causal,
                 scale, qk_scale, config):  # fmt: skip
        q, k, v, do = (x.float() for x in (query, key, value, grad_out))
        t, s = q.shape[-2], k.shape[-2]
        scores = q @ k.transpose(-1, -2) * qk_scale
        if causal:
            hidden = torch.ones(t, s, dtype=torch.bool).triu(s - t + 1)
            scores = scores.masked_fill(hidden, float("-inf"))
        weights = torch.exp2(scores - lse.view(*q.shape[:-1], 1))
        grad_weights = do @ v.transpose(-1, -2)
        grad_scores = weights * (grad_weights - delta.view(*q.shape[:-1], 1))
        grad_key.copy_(scale * grad_scores.transpose(-1, -2) @ q)
        grad_key[..., 20:, :] *= error
        grad_value.copy_(weights.transpose(-1, -2) @ do)
        return (scale * grad_scores @ k).reshape(-1, t, q.shape[-1])

    monkeypatch.setattr(hopper_backward, "hopper_backward", stand_in)
    monkeypatch.setattr(hopper_backward, "applies", lambda *args: True)
    monkeypatch.setattr(hopper_backward, "CONFIGS", hopper_backward.CONFIGS[:1])
    module = {"hopper_backward": hopper_backward}
    monkeypatch.setattr(triton_attention, "_gluon_module", lambda name, x: module.get(name))
    monkeypatch.setattr(triton_attention, "forward_kernel", "triton")  # the check sets them
    monkeypatch.setattr(triton_attention, "backward_plan", "auto")
    cases = [
        (1, 2, 32, 32, 16, False, torch.float32, "heads"),
        (1, 2, 16, 48, 16, True, torch.float32, "interleaved"),
    ]
    monkeypatch.setattr(gpu_attention, "HOPPER_CHECK_CASES", cases)
    backward = gpu_attention.gluon_candidates().index(hopper_backward.CONFIGS[0].describe())
    status = gpu_attention.hopper_check_main(torch.device("cpu"), [backward])
    report = capsys.readouterr().out
    if error == 1.0:
        assert status == 0, report
        assert report.count("| yes |") == 2 and gpu_attention.PASSED in report, report
    else:  # S = 32 has key rows 20..31 off in both heads, S = 48 rows 20..47
        assert status == 1 and gpu_attention.PASSED not in report, report
        assert "dK: 24 of 64 key rows off; first at [20, 21" in report, report


def test_gluon_check_leaves_out_a_kernel_that_hangs_or_breaks_its_process(monkeypatch, capsys):
    """gpu_attention.py's parent side of the Gluon check, with a stand-in child: of three
    forward tilings and a backward one, the second falls silent, so its child is killed
    after the stall time, and the third ends its process (as a lost CUDA context does); a
    new child checks what follows each, and the timed run gets the first and the last."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_attention
    from selfattn.kernels import hopper_backward, hopper_forward, triton_attention

    configs, backward = hopper_forward.CONFIGS[:3], hopper_backward.CONFIGS[:1]
    names = [config.describe() for config in (*configs, *backward)]
    child = (
        "import sys, time\n"
        "names = sys.argv[1].split('|')\n"
        "for index in map(int, sys.argv[2:]):\n"
        f"    print('{gpu_attention.CHECKING}', index, ':', names[index], flush=True)\n"
        "    if index == 1:\n"
        "        time.sleep(60)\n"
        "    if index == 2:\n"
        "        sys.exit(3)\n"
        f"    print('{gpu_attention.PASSED}', names[index], flush=True)\n"
        f"print('{gpu_attention.CHECK_DONE}', flush=True)\n"
    )
    started = []

    def command(indices):
        started.append(list(indices))
        return [sys.executable, "-c", child, "|".join(names), *map(str, indices)]

    monkeypatch.setattr(gpu_attention, "check_command", command)
    monkeypatch.setattr(gpu_attention, "HOPPER_STALL_SECONDS", 3)
    monkeypatch.setattr(hopper_forward, "CONFIGS", configs)
    monkeypatch.setattr(hopper_backward, "CONFIGS", backward)
    monkeypatch.setattr(triton_attention, "forward_kernel", "triton")
    monkeypatch.setattr(triton_attention, "gluon_backward", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (9, 0))
    gpu_attention.check_hopper_kernels(
        gpu_attention.Setting(torch.device("cpu"), torch.float32, 64, 32)
    )
    report = capsys.readouterr().out
    assert started == [[0, 1, 2, 3], [2, 3], [3]], report
    timed = (hopper_forward.CONFIGS, hopper_backward.CONFIGS)
    assert timed == ((configs[0],), backward), report
    assert triton_attention.forward_kernel == "auto" and triton_attention.gluon_backward
    assert f"{names[1]}: silent for 3 s, killed (a hang)" in report, report
    assert f"{names[2]}: its process ended before the check did (exit 3)" in report, report


def test_gluon_check_fails_a_tiling_it_has_no_case_for(monkeypatch, capsys):
    """A tiling offered only for head dims that no check case has is not "passed" by
    skipping every case: it stays out of the timed run, and the report says why."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_attention
    from selfattn.kernels import hopper_forward, triton_attention

    unmatched = dataclasses.replace(hopper_forward.CONFIGS[0], head_dims=(32,))
    monkeypatch.setattr(hopper_forward, "CONFIGS", (unmatched,))
    monkeypatch.setattr(triton_attention, "forward_kernel", "triton")  # the check sets it
    cases = [(1, 2, 32, 32, 16, False, torch.float32, "heads")]
    monkeypatch.setattr(gpu_attention, "HOPPER_CHECK_CASES", cases)
    status = gpu_attention.hopper_check_main(torch.device("cpu"), [0])
    report = capsys.readouterr().out
    assert status == 1 and gpu_attention.PASSED not in report, report
    assert "no check case it runs for" in report, report


def test_forward_kernel_choice(monkeypatch):
    """forward_kernel: "triton" (the default) ignores the Gluon kernel; "gluon" takes its first
    tiling; "auto" times every candidate once per shape bucket (a fake timer here) and keeps
    the fastest; anything else is refused. On CPU no Gluon candidate is offered at all."""
    from selfattn.kernels import triton_attention

    fake_ms = {"triton": 2.0, "gluon a": 3.0, "gluon b": 1.0}
    timed = []
    kernels = {name: (lambda name=name: timed.append(name) or fake_ms[name]) for name in fake_ms}
    monkeypatch.setattr(triton_attention, "plan_timings", {})
    monkeypatch.setattr(triton_attention, "_quick_bench", lambda fn, quantiles: fn())
    assert triton_attention._forward_choice(("bucket",), kernels) == "triton"
    monkeypatch.setattr(triton_attention, "forward_kernel", "gluon")
    assert triton_attention._forward_choice(("bucket",), kernels) == "gluon a"
    assert triton_attention._forward_choice(("bucket",), {"triton": kernels["triton"]}) == "triton"
    monkeypatch.setattr(triton_attention, "forward_kernel", "auto")
    assert triton_attention._forward_choice(("bucket",), kernels) == "gluon b"
    assert triton_attention._forward_choice(("bucket",), kernels) == "gluon b"
    assert sorted(timed) == sorted(fake_ms)  # each timed once, then remembered
    fewer = {name: kernels[name] for name in ("triton", "gluon a")}  # e.g. another layout
    assert triton_attention._forward_choice(("bucket",), fewer) == "triton"  # timed anew
    monkeypatch.setattr(triton_attention, "forward_kernel", "fastest")
    with pytest.raises(ValueError, match="forward_kernel"):
        triton_attention._forward_choice(("bucket",), kernels)

    q, k, v, _ = _inputs(128, 128, 64, lead=(1,))
    assert triton_attention._gluon_forwards(q, k, v, None, False, 0.125) == {}
    monkeypatch.setattr(triton_attention, "forward_kernel", "auto")
    torch.testing.assert_close(  # auto on CPU: the Triton kernel, as before
        attention(q.float(), k.float(), v.float(), backend="triton"),
        attention(q.float(), k.float(), v.float(), backend="sdpa"),
        rtol=1e-5,
        atol=1e-5,
    )


ATOMIC_CASES = [
    dict(t=33, s=33, d=16, causal=False),
    dict(t=7, s=40, d=16, causal=True),
    dict(t=40, s=7, d=16, causal=True),
    dict(t=33, s=64, d=59, causal=True),
    dict(t=64, s=64, d=16, causal=False, mask="padding"),
    dict(t=33, s=64, d=16, causal=False, mask="rows"),
]


@pytest.mark.parametrize("case", ATOMIC_CASES, ids=lambda case: "-".join(map(str, case.values())))
def test_atomic_backward_plan(monkeypatch, case):
    """dQ added with atomics inside the dK/dV kernel: same tolerance as the split plan, on
    ragged, causal, padded-head and masked cases (a fully masked row gets dQ 0)."""
    from selfattn.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "backward_plan", "atomic")
    case = dict(case)
    kind = case.pop("mask", None)
    q, k, v, grad = _inputs(case["t"], case["s"], case["d"])
    mask = None
    if kind == "padding":
        mask = (torch.arange(case["s"]) < torch.tensor([64, 40])[:, None])[:, None, None, :]
    elif kind == "rows":
        mask = torch.rand(case["t"], case["s"], generator=torch.Generator().manual_seed(5)) > 0.3
        mask[4] = False
    assert_matches_reference(q, k, v, grad, mask=mask, causal=case["causal"])
    if kind == "rows":
        _, dq, _, _ = _run("triton", q, k, v, grad, torch.float32, mask=mask)
        assert (dq[..., 4, :] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("plan", ["split", "atomic"])
def test_rows_of_low_scores_beside_a_partial_key_block(monkeypatch, plan, dtype):
    """Every score far below 0 (about -144, or -16 in float16, where exp2(-lse) overflows),
    40 keys: the last key block is partial, and its keys past S, read as 0, scored 0 in the
    unmasked middle tiles; the atomic plan added their inf weights times zero keys, NaN, to
    dQ. The interpreter's autotuner never picks that plan, a GPU's may. Twice SDPA's error."""
    from selfattn.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "backward_plan", plan)
    q, k, v, grad = _inputs(40, 40, 16, lead=(1, 2))
    shift = 6.0 if dtype == torch.float32 else 2.0
    assert_matches_reference(0.1 * q - shift, 0.1 * k + shift, v, grad, dtype=dtype)


@pytest.mark.parametrize("plan", ["split", "atomic"])
@pytest.mark.parametrize("from_registers", [False, True])
def test_backward_kernels_with_either_operand_placement(monkeypatch, plan, from_registers):
    """The dK/dV and dQ kernels with their A_FROM_REGISTERS switch forced each way."""
    from selfattn.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "backward_plan", plan)
    for kernel in (triton_attention._dkdv_kernel, triton_attention._dq_kernel):
        forced = triton_attention._config(16, 32, 4, 1, A_FROM_REGISTERS=from_registers)
        monkeypatch.setattr(kernel, "configs", [forced])
    assert_matches_reference(*_inputs(33, 40, 24), causal=True)


def test_auto_plan_times_both_once_and_keeps_the_faster(monkeypatch):
    """On a GPU, "auto" times each plan on the first backward of a shape bucket (here a fake
    timer: atomic 1 ms, split 2 ms) and reuses that choice for the bucket."""
    from selfattn.kernels import triton_attention

    timed = []
    fake_ms = {"split": 2.0, "atomic": 1.0}
    monkeypatch.setattr(triton_attention, "INTERPRETING", False)
    monkeypatch.setattr(triton_attention, "plan_timings", {})
    monkeypatch.setattr(triton_attention, "_quick_bench", lambda fn, quantiles: fn())
    run = lambda plan: timed.append(plan) or fake_ms[plan]  # noqa: E731
    assert triton_attention._backward_plan(("bucket",), run) == "atomic"
    assert triton_attention._backward_plan(("bucket",), run) == "atomic"
    assert sorted(timed) == ["atomic", "split"]  # timed once each, then remembered
    assert triton_attention.plan_timings == {("bucket", "split", "atomic"): fake_ms}


def test_gluon_backward_plan_choice(monkeypatch):
    """The Gluon backward's tilings for Hopper join "auto" only where they apply and once
    ``gluon_backward`` is set (after gpu_attention.py has checked them on a GPU); forced,
    the first runs where they apply and "split" elsewhere; deterministic mode never runs
    them."""
    from selfattn.kernels import triton_attention

    fake_ms = {"split": 2.0, "atomic": 1.5, "gluon a": 1.2, "gluon b": 1.0}
    tilings = ("gluon a", "gluon b")
    monkeypatch.setattr(triton_attention, "INTERPRETING", False)
    monkeypatch.setattr(triton_attention, "plan_timings", {})
    monkeypatch.setattr(triton_attention, "_quick_bench", lambda fn, quantiles: fn())
    run = fake_ms.get
    choose = triton_attention._backward_plan
    assert choose(("bucket",), run, tilings) == "atomic"  # not checked yet
    monkeypatch.setattr(triton_attention, "gluon_backward", True)
    assert choose(("bucket",), run, ()) == "atomic"
    assert choose(("bucket",), run, tilings) == "gluon b"
    assert triton_attention.plan_timings[("bucket", "split", "atomic", *tilings)] == fake_ms
    monkeypatch.setattr(triton_attention, "backward_plan", "gluon")
    assert choose(("bucket",), run, tilings) == "gluon a"
    assert choose(("bucket",), run, ()) == "split"
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert choose(("bucket",), run, tilings) == "split"


def test_backward_plans_agree_and_deterministic_mode_takes_split(monkeypatch):
    from selfattn.kernels import triton_attention

    inputs = _inputs(33, 40, 16)
    grads = {}
    for plan in triton_attention.BACKWARD_PLANS:
        monkeypatch.setattr(triton_attention, "backward_plan", plan)
        grads[plan] = _run("triton", *inputs, torch.float32, causal=True)
    for split, atomic in zip(grads["split"], grads["atomic"], strict=True):
        torch.testing.assert_close(atomic, split, rtol=1e-5, atol=1e-6)

    chosen = []
    monkeypatch.setattr(triton_attention, "backward_plan", "atomic")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert triton_attention._backward_plan(("key",), chosen.append) == "split"
    monkeypatch.setattr(triton_attention, "backward_plan", "fastest")
    with pytest.raises(ValueError, match="backward_plan"):
        triton_attention._backward_plan(("key",), chosen.append)
    assert chosen == []  # nothing was run to decide


def test_gpu_benchmark_script_dry_run():
    """benchmarks/gpu_attention.py --interpret-smoke: the device script's own logic (launches
    recorded for precompiling, every configuration checked under both backward plans, then the
    tables, then ring attention's blocks) runs clean on the CPU, so a GPU session does not
    spend its time on a broken script."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_attention.py"
    report = subprocess.run([sys.executable, str(script), "--interpret-smoke"],
                            capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stdout[-2000:] + report.stderr[-2000:]
    # 2 timed and 2 correctness cases, each under 2 plans: 2 forwards, 2 dK/dV, 1 dQ
    assert "Precompiled 20 kernel launches" in report.stdout
    for table in ("forward", "dk/dv", "dq"):
        assert f"## Every {table} configuration" in report.stdout
    checks = [
        line for line in report.stdout.splitlines() if line.endswith(("| yes |", "| **NO** |"))
    ]
    assert any("| atomic |" in line for line in checks) and any(
        "| split |" in line for line in checks
    )
    assert checks and all(line.endswith("| yes |") for line in checks), report.stdout
    assert "## Throughput" in report.stdout and "## Layer layout" in report.stdout
    assert "## Ring attention's blocks" in report.stdout


# Ring attention's blocks: block_forward and block_backward. Tolerance in float32: 1e-5
# (absolute and relative) against the float64 explicit path and against chunked's tiles; in
# float16/bfloat16 the file's rule above (twice SDPA's error of the float64 path, plus a floor).

BLOCK_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _block_inputs(t: int, s: int, padded: bool, seed: int = 0):
    """(3, T, 16) queries, (3, S, 16) keys and values, dO, and a key mask (3, S) or None: with
    ``padded``, head 1 has no key in its first 24 and head 2 only its last key."""
    q, k, v, grad = _inputs(t, s, 16, lead=(3,), seed=seed)
    allowed = None
    if padded:
        allowed = torch.rand(3, s, generator=torch.Generator().manual_seed(seed)) > 0.3
        allowed[1, :24] = False
        allowed[2] = False
        allowed[2, -1] = True
    return q, k, v, grad, allowed


def _reference_lse(q, k, allowed, causal: bool, scale: float):
    """The base-2 log-sum-exp of the scaled, masked scores, +inf where a row sees no key."""
    scores = q @ k.transpose(-1, -2) * scale
    t, s = scores.shape[-2:]
    visible = torch.ones(t, s, dtype=torch.bool).tril(s - t) if causal else torch.tensor(True)
    if allowed is not None:
        visible = visible & allowed[:, None, :]
    lse = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), -1, keepdim=True)
    return (lse * LOG2E).masked_fill(lse == float("-inf"), float("inf"))


def _explicit_options(allowed, causal: bool, scale: float) -> dict:
    """``attention``'s options for the same call: the key mask as (N, 1, S)."""
    return dict(mask=None if allowed is None else allowed[:, None, :], causal=causal, scale=scale)


BLOCK_CASES = {  # T, S, causal, padded
    "plain": (33, 40, False, False),
    "causal-diagonal": (33, 33, True, False),
    "padded": (33, 24, False, True),  # head 1 sees no key at all
    "causal-padded": (24, 24, True, True),  # nor do head 2's rows before its one key
}


@pytest.mark.parametrize("case", BLOCK_CASES)
def test_block_forward_matches_chunked_tiles_and_the_reference(case):
    """Output (float32) and base-2 lse as chunked's tile_forward gives them with the same
    Masks (its unmasked calls are in base e: converted), and as the float64 explicit path; a
    row with no key gets output 0 and lse +inf."""
    from selfattn.kernels.chunked import Masks, tile_forward
    from selfattn.kernels.triton_attention import block_forward

    t, s, causal, padded = BLOCK_CASES[case]
    q, k, v, _, allowed = _block_inputs(t, s, padded)
    scale = 0.3
    out, lse = block_forward(
        q.float(), k.float(), v.float(), causal=causal, scale=scale, key_allowed=allowed
    )
    assert out.dtype == lse.dtype == torch.float32 and lse.shape == (3, t, 1)

    masks = Masks(torch.Size([3]), None if allowed is None else allowed[:, None, :], causal, False)
    tile_out, tile_lse = tile_forward(q.float(), k.float(), v.float(), None, masks, scale, 16, 16)
    torch.testing.assert_close(out, tile_out, **BLOCK_TOLERANCE)
    torch.testing.assert_close(lse, tile_lse * (LOG2E / masks.unit), **BLOCK_TOLERANCE)

    want = attention(q, k, v, backend="explicit", **_explicit_options(allowed, causal, scale))
    torch.testing.assert_close(out, want.float(), **BLOCK_TOLERANCE)
    want_lse = _reference_lse(q, k, allowed, causal, scale)
    torch.testing.assert_close(lse, want_lse.float(), **BLOCK_TOLERANCE)
    empty = want_lse == float("inf")
    assert empty.any() == padded
    assert (out * empty == 0).all() and not out.isnan().any()


def _merge(blocks):
    """The (output, lse) of blocks merged as ring attention merges them, in base 2: the lse
    by logaddexp2, the output weighted by each block's share of the softmax mass,
    sigmoid((block_lse - lse) · ln 2), 0 for a block with no visible key."""
    out, lse = torch.zeros_like(blocks[0][0]), torch.full_like(blocks[0][1], float("-inf"))
    for block_out, block_lse in blocks:
        block_lse = block_lse.masked_fill(block_lse == float("inf"), float("-inf"))  # no mass
        share = torch.sigmoid((block_lse - lse) / LOG2E).masked_fill(block_lse == float("-inf"), 0)
        out = out + (block_out - out) * share
        lse = torch.logaddexp2(lse, block_lse)
    return out, lse.masked_fill(lse == float("-inf"), float("inf"))


TWO_BLOCK_CASES = {  # causal, padded, scale
    "plain": (False, False, 0.3),
    "causal": (True, False, 0.3),
    "padded": (False, True, 0.3),
    "causal-padded": (True, True, 0.3),
    "negative-scale": (True, True, -0.3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", TWO_BLOCK_CASES)
def test_two_blocks_merged_by_lse_give_attention_over_all_keys(case, dtype):
    """33 queries against keys in two blocks, as a ring rank meets them: 24 earlier keys (all
    visible), then the diagonal block of its own 33 (causal within it, when causal). The
    blocks' outputs merged by lse (``_merge``) are attention over all 57 keys, bottom-right
    causal; block_backward with the merged output and lse gives each block's dK, dV and a
    share of dQ, which sum to its gradients. Float32 within BLOCK_TOLERANCE of the float64
    explicit path (output, lse, dQ, dK, dV); float16/bfloat16 within twice SDPA's error."""
    from selfattn.kernels.triton_attention import block_backward, block_forward

    causal, padded, scale = TWO_BLOCK_CASES[case]
    q, k, v, grad, allowed = _block_inputs(33, 57, padded)
    cut = [slice(0, 24), slice(24, 57)]
    blocks = [
        dict(
            key=k[:, cols].to(dtype),
            value=v[:, cols].to(dtype),
            causal=causal and cols.start > 0,
            scale=scale,
            key_allowed=None if allowed is None else allowed[:, cols],
        )
        for cols in cut
    ]
    out, lse = _merge([block_forward(q.to(dtype), **block) for block in blocks])
    grads = [
        block_backward(grad.float(), q.to(dtype), out=out, lse=lse, **block) for block in blocks
    ]
    dq = sum(grad_query for grad_query, _, _ in grads)
    dk, dv = (torch.cat([block_grads[i] for block_grads in grads], dim=1) for i in (1, 2))
    ours = [out, dq, dk, dv]
    assert all(x.dtype == torch.float32 and not x.isnan().any() for x in ours)

    options = _explicit_options(allowed, causal, scale)
    want_lse = _reference_lse(q, k, allowed, causal, scale)
    if dtype == torch.float32:
        reference = _run("explicit", q, k, v, grad, torch.float64, **options)
        for got, want in zip([lse, *ours], [want_lse, *reference], strict=True):
            torch.testing.assert_close(got, want.float(), **BLOCK_TOLERANCE)
    else:
        assert_within_twice_sdpa(ours, q, k, v, grad, dtype, **options)
        own = _reference_lse(*(x.to(dtype) for x in (q, k)), allowed, causal, scale)
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        error = (lse.double() - want_lse)[finite].abs().max()
        assert error <= 2 * (own.double() - want_lse)[finite].abs().max() + ABS_FLOOR[dtype]
    if padded:  # head 2's rows that see no key, in either block: no gradient
        empty = want_lse[2, :, 0] == float("inf")
        assert empty.any() == causal and (dq[2, empty] == 0).all()


def test_block_calls_over_the_grid_cap_go_in_several_launches(monkeypatch):
    """More heads (N) than a grid axis takes (a cap of 2 here): several launches of at most
    that many, the same results bit for bit."""
    from selfattn.kernels import triton_attention

    q, k, v, grad, allowed = (
        x.float() if x.is_floating_point() else x for x in _block_inputs(7, 33, padded=True)
    )
    options = dict(causal=True, scale=0.3, key_allowed=allowed)

    def both():
        out, lse = triton_attention.block_forward(q, k, v, **options)
        return out, lse, *triton_attention.block_backward(grad, q, k, v, out, lse, **options)

    whole = both()
    monkeypatch.setattr(triton_attention, "MAX_GRID_HEADS", 2)
    launched = count_launches(monkeypatch)
    for got, want in zip(both(), whole, strict=True):
        assert torch.equal(got, want)
    assert launched == [2, 1, 2, 1]


def _refused(dtype=torch.float32, d=16, key_allowed=None, value_dtype=None, lead=(3,)):
    """What block_forward and block_backward say about a call, checked to be one line each."""
    from selfattn.kernels.triton_attention import block_backward, block_forward

    q, k = torch.randn(*lead, 7, d, dtype=dtype), torch.randn(*lead, 9, d, dtype=dtype)
    v = torch.randn(*lead, 9, d, dtype=value_dtype or dtype)
    out, lse = torch.zeros(*lead, 7, d), torch.zeros(*lead, 7, 1)
    options = dict(causal=False, scale=0.25, key_allowed=key_allowed)
    messages = []
    for call in (
        lambda: block_forward(q, k, v, **options),
        lambda: block_backward(out, q, k, v, out, lse, **options),
    ):
        with pytest.raises(ValueError) as refusal:
            call()
        messages.append(str(refusal.value))
    assert messages[0] == messages[1] and "\n" not in messages[0]
    return messages[0]


def test_block_functions_refuse_what_the_kernels_cannot_do_in_one_line():
    assert "float16, bfloat16 or float32" in _refused(dtype=torch.float64)
    assert "head dims up to 256" in _refused(d=300)
    assert "share one dtype" in _refused(value_dtype=torch.float16)
    assert "(N, T, D)" in _refused(lead=(2, 3))
    assert "non-empty" in _refused(lead=(0,))
    assert "boolean" in _refused(key_allowed=torch.zeros(3, 9))
    assert "broadcastable" in _refused(key_allowed=torch.ones(2, 9, dtype=torch.bool))
