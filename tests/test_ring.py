"""Ring attention against the explicit reference on the gathered sequence, and its errors.

The sequence is split over 2 or 3 spawned gloo ranks, in the contiguous or the zig-zag layout,
with or without a key-padding mask, on chunked's tiles or (``backend="triton"``) the fused
Triton blocks, run by Triton's interpreter (the spawned ranks set ``TRITON_INTERPRET=1`` before
anything imports triton); each rank's output and q/k/v gradient shards, put back together
(``ring.unshard``), are compared with ``attention(..., backend="explicit")`` on the whole
sequence with the whole mask. Tolerances (max absolute difference): float64 1e-10; the Triton
blocks in float32 (exact float32 products) 1e-5, absolute and relative, against float64;
float32, float16 and bfloat16 otherwise at most twice the error of torch's fused kernel (SDPA)
on the whole sequence in that dtype against a float64 reference, plus 1e-6 (float32) or 1e-3
(float16, bfloat16), as in test_chunked.py.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, patch_triton_language_once, spawn_ranks
from selfattn import attention
from selfattn.attention import TRITON_MIN_INTERPRETER
from selfattn.kernels import ring
from selfattn.kernels.ring import ring_attention
from selfattn.train import distributed


@dataclass(frozen=True)
class Case:
    """One ring call: each rank holds ``n`` tokens of ``(*lead, size·n, D)`` inputs, cut by
    ``layout``; ``mask``: none, or a boolean or float key-padding mask (see ``key_mask``)."""

    lead: tuple[int, ...] = (2, 3)
    n: int = 5
    d: int = 7
    dv: int = 4
    causal: bool = False
    similarity: str = "dot"
    scale: float | None = None
    dtype: torch.dtype = torch.float64
    layout: str = "contiguous"
    mask: str | None = None  # None, "bool", "float" or "lowest"
    backend: str = "auto"

    def inputs(self, size: int) -> list[torch.Tensor]:
        """Query, key, value and the output's gradient over the whole sequence (seeded)."""
        generator = torch.Generator().manual_seed(0)
        t = size * self.n
        shapes = [(*self.lead, t, self.d)] * 2 + [(*self.lead, t, self.dv)] * 2
        return [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]

    def key_mask(self, size: int) -> torch.Tensor | None:
        """The whole sequence's key mask, ``(B, 1, 1, T)`` (``(T,)`` without lead dims), seeded:
        keys dropped at random, and every key of the last rank, and key 0 (so causal query 0
        sees nothing); batch 1, if any, all padded (none of its queries sees a key). Boolean
        (True = may attend), or float: -inf where padded ("lowest": finfo(float64).min, as
        Hugging Face masks), random finite values elsewhere."""
        if self.mask is None:
            return None
        t = size * self.n
        shape = (self.lead[0], *[1] * (len(self.lead) - 1), 1, t) if self.lead else (t,)
        generator = torch.Generator().manual_seed(1)
        allowed = torch.rand(shape, generator=generator) > 0.3
        allowed[..., ring.positions(size - 1, size, t, layout=self.layout)] = False
        allowed[..., 0] = False
        if len(self.lead) and self.lead[0] > 1:
            allowed[1] = False
        if self.mask == "bool":
            return allowed
        bias = torch.randn(shape, generator=generator, dtype=torch.float64)
        padded = -math.inf if self.mask == "float" else torch.finfo(torch.float64).min
        return bias.masked_fill(~allowed, padded)


EXACT = {  # float64, compared within 1e-10
    "plain": Case(),
    "causal": Case(causal=True),
    "cosine": Case(similarity="cosine"),
    "cosine-causal": Case(similarity="cosine", causal=True),
    "scale-0.3-causal": Case(causal=True, scale=0.3),
    "no-lead": Case(lead=()),
    "one-lead": Case(lead=(3,), n=8, d=3, dv=9),
    "one-token-causal": Case(n=1, causal=True),
    "zigzag": Case(n=6, layout="zigzag"),
    "zigzag-causal": Case(n=6, layout="zigzag", causal=True),
    "zigzag-cosine-causal": Case(lead=(), n=4, layout="zigzag", similarity="cosine", causal=True),
    "zigzag-two-tokens-causal": Case(n=2, layout="zigzag", causal=True),
    "padding": Case(mask="bool"),
    "padding-causal": Case(mask="bool", causal=True),
    "padding-causal-no-lead": Case(lead=(), mask="bool", causal=True),
    "zigzag-padding": Case(n=6, layout="zigzag", mask="bool"),
    "zigzag-padding-causal": Case(n=6, layout="zigzag", mask="bool", causal=True),
    "float-mask-causal": Case(mask="float", causal=True),
    "zigzag-float-mask": Case(n=6, layout="zigzag", mask="float"),
    "lowest-mask-causal": Case(mask="lowest", causal=True),
    "zigzag-lowest-mask": Case(n=6, layout="zigzag", mask="lowest"),
}
REDUCED = {  # float32, float16 and bfloat16 against twice SDPA's error
    "float32": Case(n=64, d=32, dv=32, causal=True, dtype=torch.float32),
    "float16": Case(n=64, d=32, dv=32, causal=True, dtype=torch.float16),
    "bfloat16": Case(n=64, d=32, dv=32, causal=True, dtype=torch.bfloat16),
    "bfloat16-full": Case(n=64, d=32, dv=32, dtype=torch.bfloat16),
    "float32-zigzag-padding": Case(
        n=64, d=32, dv=32, causal=True, dtype=torch.float32, layout="zigzag", mask="bool"
    ),
}


def _interpreter_runs_the_kernels() -> bool:
    """Triton is installed, new enough for its interpreter to run our kernels (not imported:
    the spawned ranks must import it after setting TRITON_INTERPRET)."""
    if importlib.util.find_spec("triton") is None:
        return False
    found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("triton"))
    return found is not None and tuple(map(int, found.groups())) >= TRITON_MIN_INTERPRETER


HAS_TRITON = _interpreter_runs_the_kernels()
needs_triton = pytest.mark.skipif(
    not HAS_TRITON,
    reason=f"needs triton {'.'.join(map(str, TRITON_MIN_INTERPRETER))}+ (run by its interpreter)",
)
# The fused Triton blocks, tiny (the interpreter is slow): float32 within TRITON_TOLERANCE of
# float64 explicit; float16 and bfloat16 against twice SDPA's error, with REDUCED.
TRITON_FLOAT32 = {
    f"triton-{layout}-padding{'-causal' * causal}": Case(
        lead=(2, 2), n=16, d=16, dv=16, causal=causal, dtype=torch.float32, layout=layout,
        mask="bool", backend="triton",
    )
    for layout in ("contiguous", "zigzag")
    for causal in (False, True)
} | {
    "triton-zigzag-cosine-causal": Case(
        lead=(2,), n=16, d=16, dv=16, causal=True, similarity="cosine", dtype=torch.float32,
        layout="zigzag", backend="triton",
    ),
}  # fmt: skip
TRITON_REDUCED = {
    f"triton-{dtype}-zigzag-padding-causal": Case(
        lead=(2, 2), n=32, d=16, dv=16, causal=True, dtype=getattr(torch, dtype),
        layout="zigzag", mask="bool", backend="triton",
    )
    for dtype in ("float16", "bfloat16")
}  # fmt: skip
TRITON_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-3}
CASES = EXACT | REDUCED | (TRITON_FLOAT32 | TRITON_REDUCED if HAS_TRITON else {})


def _cases(size: int) -> dict[str, Case]:
    """The cases run on ``size`` ranks: the reduced-precision ones on 2 only."""
    if size == 2:
        return CASES
    return {name: case for name, case in CASES.items() if name not in REDUCED | TRITON_REDUCED}


def _join(rank: int, port: int, size: int) -> None:
    # Before anything imports triton (nothing has yet: the Triton blocks import it lazily), so
    # that backend="triton" runs on CPU tensors; "auto" still picks chunked for them.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRITON_INTERPRET="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)


def _logging(function, parts: list[tuple[int, int, bool]], query_at: int):
    """``function`` (chunked's tile_forward or the Triton block_forward; their backwards with
    query at ``query_at`` = 1 after the output's gradient), appending to ``parts`` the query
    rows, key columns and whether the causal diagonal crosses them, of each block part it
    computes (a tile's Masks say that, a Triton block's ``causal``)."""

    def logged(*args, **kwargs):
        query, key = args[query_at : query_at + 2]
        masks = next((arg for arg in args if isinstance(arg, ring.Masks)), None)
        parts.append(
            (query.shape[1], key.shape[1], kwargs["causal"] if masks is None else masks.causal)
        )
        return function(*args, **kwargs)

    return logged


def _holding(function, held: list[int], returned: list[weakref.ref]):
    """``function`` (a block kernel), appending to ``held``, at each call, how many of the
    tensors that the previous call of any of the kernels sharing ``returned`` returned are
    still alive."""

    def tracked(*args, **kwargs):
        held.append(sum(ref() is not None for ref in returned))
        result = function(*args, **kwargs)
        returned[:] = [weakref.ref(x) for x in result if isinstance(x, torch.Tensor)]
        return result

    return tracked


def _cases_worker(rank: int, port: int, size: int, out: Path) -> None:
    """Every case on this rank: its output and gradient shards, the block parts it attended
    to forward and backward on chunked's tiles and on the Triton blocks, and at each block,
    how many of the previous block's results were still held; saved to ``out/rank{rank}.pt``."""
    _join(rank, port, size)
    forwards, backwards, fused_forwards, fused_backwards, held = [], [], [], [], []
    returned = []
    ring.tile_forward = _holding(_logging(ring.tile_forward, forwards, query_at=0), held, returned)
    ring.tile_backward = _holding(
        _logging(ring.tile_backward, backwards, query_at=1), held, returned
    )
    if HAS_TRITON:
        from selfattn.kernels import triton_attention

        patch_triton_language_once()
        triton_attention.block_forward = _holding(
            _logging(triton_attention.block_forward, fused_forwards, query_at=0), held, returned
        )
        triton_attention.block_backward = _holding(
            _logging(triton_attention.block_backward, fused_backwards, query_at=1), held, returned
        )
    results = {}
    try:
        for name, case in _cases(size).items():
            query, key, value, grad_output = (
                ring.shard(x, rank, size, layout=case.layout).to(case.dtype)
                for x in case.inputs(size)
            )
            mask = case.key_mask(size)
            if mask is not None:
                mask = ring.shard(mask, rank, size, layout=case.layout, dim=-1)
            leaves = [x.requires_grad_() for x in (query, key, value)]
            for log in (forwards, backwards, fused_forwards, fused_backwards, held):
                log.clear()
            output = ring_attention(
                *leaves,
                causal=case.causal,
                similarity=case.similarity,
                scale=case.scale,
                mask=mask,
                layout=case.layout,
                backend=case.backend,
            )
            output.backward(grad_output)
            results[name] = {
                "tensors": [output.detach()] + [x.grad for x in leaves],
                "parts": (list(forwards), list(backwards)),
                "fused": (list(fused_forwards), list(fused_backwards)),
                "held": list(held),
            }
    finally:
        distributed.teardown()
    torch.save(results, out / f"rank{rank}.pt")


def _ring_results(size: int, out: Path) -> list[dict]:
    """Every rank's results for every case."""
    spawn_ranks(_cases_worker, size, size, out)
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(size)]


@pytest.fixture(scope="module")
def ring_ranks(tmp_path_factory):
    """``ring_ranks(size)``: every rank's results for every case (``_cases_worker``), the
    ranks spawned once per size."""

    @functools.cache
    def spawned(size: int) -> list[dict]:
        return _ring_results(size, tmp_path_factory.mktemp(f"ring{size}"))

    return spawned


@pytest.fixture(scope="module")
def ring_results(ring_ranks):
    """``ring_results(size)``: per case, output and q/k/v gradients gathered over the ranks
    (in sequence order), and each rank's block parts attended forward and backward (on
    chunked's tiles; with ``fused=True``, on the Triton blocks)."""

    def gathered(
        size: int, fused: bool = False
    ) -> dict[str, tuple[list[torch.Tensor], list[tuple[list, list]]]]:
        ranks = ring_ranks(size)
        return {
            name: (
                [
                    ring.unshard(
                        [r[name]["tensors"][i] for r in ranks], layout=case.layout
                    ).double()
                    for i in range(4)
                ],
                [r[name]["fused" if fused else "parts"] for r in ranks],
            )
            for name, case in _cases(size).items()
        }

    return functools.cache(gathered)


def _outputs_and_grads(case: Case, size: int, backend: str, dtype: torch.dtype):
    """Output and q/k/v gradients of ``attention`` on the whole sequence, in float64."""
    query, key, value, grad_output = (x.to(dtype) for x in case.inputs(size))
    leaves = [x.requires_grad_() for x in (query, key, value)]
    output = attention(
        *leaves,
        causal=case.causal,
        similarity=case.similarity,
        scale=case.scale,
        mask=case.key_mask(size),
        backend=backend,
    )
    output.backward(grad_output)
    return [x.double() for x in [output.detach()] + [x.grad for x in leaves]]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", list(EXACT))
def test_ring_matches_explicit_on_the_whole_sequence(ring_results, size, name):
    """float64: output, dq, dk, dv gathered over the ranks = explicit within 1e-10."""
    got, _ = ring_results(size)[name]
    want = _outputs_and_grads(EXACT[name], size, "explicit", torch.float64)
    for what, actual, expected in zip(["output", "dq", "dk", "dv"], got, want, strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-10, rtol=0, msg=what)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", [name for name, case in EXACT.items() if case.mask == "lowest"])
def test_a_mask_at_its_dtypes_lowest_value_masks_like_minus_infinity(ring_results, size, name):
    """Hugging Face's finfo.min on the padded keys: output, dq, dk, dv within 1e-10 of explicit
    attention with -inf there, the queries that see no key (batch 1's, causal query 0) at 0
    too; the blocks' log-sum-exps, of finfo.min's size, used to merge them into some average
    of the values."""
    got, _ = ring_results(size)[name]
    with_minus_inf = replace(EXACT[name], mask="float")
    want = _outputs_and_grads(with_minus_inf, size, "explicit", torch.float64)
    for what, actual, expected in zip(["output", "dq", "dk", "dv"], got, want, strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-10, rtol=0, msg=what)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=needs_triton) for name in TRITON_FLOAT32]
)
def test_triton_blocks_match_explicit_on_the_whole_sequence(ring_results, size, name):
    """backend="triton", float32 (exact float32 products), contiguous and zig-zag, causal or
    not, key padding with fully masked rows: output, dq, dk, dv gathered over the ranks =
    float64 explicit within TRITON_TOLERANCE."""
    got, _ = ring_results(size)[name]
    want = _outputs_and_grads(TRITON_FLOAT32[name], size, "explicit", torch.float64)
    for what, actual, expected in zip(["output", "dq", "dk", "dv"], got, want, strict=True):
        torch.testing.assert_close(actual, expected, **TRITON_TOLERANCE, msg=what)


@pytest.mark.parametrize(
    "name",
    [*REDUCED, *(pytest.param(name, marks=needs_triton) for name in TRITON_REDUCED)],
)
def test_reduced_precision_no_worse_than_twice_sdpa(ring_results, name):
    """float32, float16, bfloat16 on 2 ranks, on chunked's tiles, and float16 and bfloat16 on
    the Triton blocks: error vs float64 explicit <= 2x SDPA's + a floor."""
    case = CASES[name]
    got, _ = ring_results(2)[name]
    reference = _outputs_and_grads(case, 2, "explicit", torch.float64)
    sdpa = _outputs_and_grads(case, 2, "sdpa", case.dtype)
    for what, ring_out, sdpa_out, want in zip(
        ["output", "dq", "dk", "dv"], got, sdpa, reference, strict=True
    ):
        ring_error = (ring_out - want).abs().max().item()
        sdpa_error = (sdpa_out - want).abs().max().item()
        assert ring_error <= 2 * sdpa_error + FLOOR[case.dtype], (what, ring_error, sdpa_error)


def test_causal_skips_the_blocks_in_the_future(ring_results):
    """3 ranks, contiguous: causal, rank r attends to r + 1 key blocks (its own, under the
    causal triangle, and the earlier ones), forward and backward; not causal, to all 3."""
    n = EXACT["causal"].n
    _, causal_parts = ring_results(3)["causal"]
    _, full_parts = ring_results(3)["plain"]
    for rank, (forward, backward) in enumerate(causal_parts):
        assert forward == backward == [(n, n, True)] + [(n, n, False)] * rank
    assert full_parts == [([(n, n, False)] * 3,) * 2] * 3


def _work(parts: list[tuple[int, int, bool]]) -> float:
    """Score elements computed: rows x columns, half of it under the causal triangle."""
    return sum(rows * cols / (2 if diagonal else 1) for rows, cols, diagonal in parts)


@pytest.mark.parametrize("size", [2, 3])
def test_zigzag_gives_every_rank_the_same_causal_work(ring_results, size):
    """Causal zig-zag: every rank computes its own block under the causal triangle and half of
    every other rank's (all its queries against a rank before it's earlier chunk, its later
    chunk's queries against all of a rank after it), forward and backward: equal work, the
    same in total as the contiguous layout's, whose last rank does 2P-1 times the first's."""
    n = EXACT["zigzag-causal"].n
    _, zigzag_parts = ring_results(size)["zigzag-causal"]
    for rank, (forward, backward) in enumerate(zigzag_parts):
        earlier, later = [(n, n // 2, False)] * rank, [(n // 2, n, False)] * (size - 1 - rank)
        # In ring order: our own block, then ranks r-1, ..., 0, then P-1, ..., r+1.
        assert forward == backward == [(n, n, True), *earlier, *later]
    zigzag_work = [_work(forward) for forward, _ in zigzag_parts]
    assert zigzag_work == [n * n / 2 * size] * size
    _, contiguous_parts = ring_results(size)["causal"]  # n = 5 there: scale to n = 6
    contiguous_work = [
        _work(forward) * (n / EXACT["causal"].n) ** 2 for forward, _ in contiguous_parts
    ]
    assert contiguous_work[-1] == pytest.approx((2 * size - 1) * contiguous_work[0])
    assert sum(contiguous_work) == pytest.approx(sum(zigzag_work))


@needs_triton
@pytest.mark.parametrize("size", [2, 3])
def test_the_triton_backend_attends_every_part_on_the_fused_blocks(ring_results, size):
    """backend="triton", causal zig-zag: every part of the zig-zag schedule (as on chunked's
    tiles) goes to block_forward and block_backward, none to chunked's tiles; backend="auto"
    on CPU tensors, under the interpreter too, runs chunked's tiles only (every other case)."""
    n = TRITON_FLOAT32["triton-zigzag-padding-causal"].n
    _, fused_parts = ring_results(size, fused=True)["triton-zigzag-padding-causal"]
    _, tile_parts = ring_results(size)["triton-zigzag-padding-causal"]
    for rank, (forward, backward) in enumerate(fused_parts):
        earlier, later = [(n, n // 2, False)] * rank, [(n // 2, n, False)] * (size - 1 - rank)
        assert forward == backward == [(n, n, True), *earlier, *later]
    assert tile_parts == [([], [])] * size
    _, auto_fused_parts = ring_results(size, fused=True)["zigzag-padding-causal"]
    assert auto_fused_parts == [([], [])] * size


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(
    "name",
    [
        *(name for name, case in EXACT.items() if case.mask),
        *(
            pytest.param(name, marks=needs_triton)
            for name, case in TRITON_FLOAT32.items()
            if case.mask
        ),
    ],
)
def test_a_query_with_no_key_to_see_gets_zero_and_finite_gradients(ring_results, size, name):
    """Masked cases, on chunked's tiles and on the Triton blocks: the queries of batch 1
    (every key padded) and, with causal, query 0 (key 0 padded) see no key: output exactly 0
    there; no NaN or inf in any output or gradient (the last rank's keys are all padded, too)."""
    case = CASES[name]
    (output, *grads), _ = ring_results(size)[name]
    empty = torch.zeros(output.shape[:-1], dtype=torch.bool)
    if case.lead:
        empty[1] = True
    if case.causal:
        empty[..., 0] = True
    assert empty.any()
    assert output[empty].eq(0).all()
    assert all(x.isfinite().all() for x in [output, *grads])


@pytest.mark.parametrize("size", [2, 3])
def test_each_blocks_results_are_let_go_before_the_next_block(ring_ranks, size):
    """Every case, forward and backward, on chunked's tiles and on the Triton blocks: when a
    block kernel is called, none of the tensors the previous call returned (a block's output
    and lse, or its dQ, dK, dV, in float32) is still held; they would add to the memory of
    the block computed next."""
    for results in ring_ranks(size):
        for name, result in results.items():
            assert result["held"] and not any(result["held"]), (name, result["held"])


def _bad_shards_worker(rank: int, port: int, size: int, out: Path) -> None:
    """Calls that rank 1 alone gets wrong (its shards, its options, its layout, mask or
    backend, or no gradients recorded), and ones both get wrong (an odd zig-zag split,
    backend="triton" where it does not apply); every rank writes the error each one raised,
    then the result of good calls (the group still works): one without a mask, and one with
    a mask of one shape whose rank-1 copy is broadcast; and how many tensor and pickled
    (object) gathers each kind of call ran."""
    _join(rank, port, size)
    gathers = {"tensors": 0, "pickled": 0}

    def counted(function, kind: str):
        def gather(*args, **kwargs):
            gathers[kind] += 1
            return function(*args, **kwargs)

        return gather

    dist.all_gather = counted(dist.all_gather, "tensors")
    dist.all_gather_object = counted(dist.all_gather_object, "pickled")
    good = dict(lead=(2,), n=4, d=3)
    wrong_on_rank_1 = {
        "length": dict(n=5),
        "lead": dict(lead=(3,)),
        "dtype": dict(dtype=torch.float32),
        "similarity": dict(similarity="cos"),
        "causal": dict(causal=True),
        "scale": dict(scale=0.5),
        "cosine": dict(similarity="cosine"),
        "gradients": {},
        "layout": dict(layout="zigzag"),
        "mask": dict(mask="bool"),
        "backend": dict(dtype=torch.float32, backend="triton"),
    }
    on_rank_0 = {"backend": dict(dtype=torch.float32)}  # "auto" on CPU tensors: chunked
    wrong_on_both = {
        "zigzag-odd": dict(n=5, layout="zigzag"),
        "triton-float64": dict(backend="triton"),
        "triton-head-dim": dict(d=300, dtype=torch.float32, backend="triton"),
    }
    errors = {}
    try:
        for name, change in (wrong_on_rank_1 | wrong_on_both).items():
            mine = change if rank == 1 or name in wrong_on_both else on_rank_0.get(name, {})
            case = Case(**(good | mine))
            leaves = [x.to(case.dtype).requires_grad_() for x in case.inputs(1)[:3]]
            try:
                with torch.set_grad_enabled(not (name == "gradients" and rank == 1)):
                    ring_attention(
                        *leaves,
                        causal=case.causal,
                        similarity=case.similarity,
                        scale=case.scale,
                        mask=case.key_mask(1),
                        layout=case.layout,
                        backend=case.backend,
                    )
                errors[name] = "no error"
            except ValueError as error:
                errors[name] = str(error)
        errors["refused gathers"] = {"calls": len(wrong_on_rank_1 | wrong_on_both), **gathers}
        gathers.update(tensors=0, pickled=0)
        query, key, value, _ = Case(**good).inputs(1)
        errors["good"] = list(ring_attention(query, key, value).shape)
        # One mask shape on both ranks, rank 1's broadcast along the batch (stride 0).
        allowed = torch.ones(1, 1, 4, dtype=torch.bool)
        mask = allowed.expand(2, 1, 4) if rank == 1 else allowed.repeat(2, 1, 1)
        try:
            output = ring_attention(query, key, value, mask=mask)
            unmasked = ring_attention(query, key, value)  # every key allowed: the same
            errors["expanded-mask"] = torch.allclose(output, unmasked, atol=1e-12, rtol=0)
        except ValueError as error:
            errors["expanded-mask"] = str(error)
        errors["good gathers"] = dict(gathers)
    finally:
        distributed.teardown()
    (out / f"rank{rank}.json").write_text(json.dumps(errors))


def _options(
    causal=False,
    layout="contiguous",
    mask="None",
    similarity="dot",
    scale=1 / math.sqrt(3),
    backend="chunked",
    recording="recording",
):
    """A call's options as the error shows them (default scale of D = 3, dot)."""
    return (
        f"causal={causal}, layout={layout!r}, mask={mask}, similarity={similarity!r}, "
        f"scale={scale!r}, backend={backend!r}, {recording} gradients"
    )


def test_shards_or_options_that_differ_across_ranks_are_refused_on_every_rank(tmp_path):
    """2 ranks, rank 1 wrong: length, leading dims, dtype, an unknown similarity, causal, scale,
    similarity, gradients not recorded, layout, a mask where rank 0 has none, backend="triton"
    where rank 0's "auto" chose chunked (float32 on CPU): a one-line error on both ranks naming
    both (a rank that computed with other options would silently return another attention; one
    that records no gradients would leave the other's backward waiting; a mask on one rank only
    would travel to a rank that expects none); both with an odd zig-zag split, or
    backend="triton" in float64 or with head dims over 256: rank 0's error, with the fix
    (ring's chunked backend, not attention's sdpa or explicit), on both. None hangs, and the
    group still serves a good call, and one whose mask has the same shape on both ranks but is
    broadcast (stride 0) along the batch on rank 1 (not refused as another shape). Each call
    gathers one small tensor per rank; only refused ones then gather the reports pickled, for
    the errors (a pickled gather is two collectives more, and on NCCL several host syncs)."""
    spawn_ranks(_bad_shards_worker, 2, 2, tmp_path)
    errors = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    shard = "query ({lead}, 4, 3), key ({lead}, 4, 3), value ({lead}, 4, 4) in torch.float64"
    rank_0 = f"rank 0 holds {shard.format(lead=2)} on cpu"
    wrong = {
        "length": "query (2, 5, 3), key (2, 5, 3), value (2, 5, 4) in torch.float64 on cpu",
        "lead": f"{shard.format(lead=3)} on cpu",
        "dtype": f"{shard.format(lead=2).replace('float64', 'float32')} on cpu",
    }
    start = "ring_attention needs equal shards on every rank"
    fix = "split the sequence into equal parts (pad it at its end to a multiple of the world size)"
    for name, held in wrong.items():
        assert errors[0][name] == f"{start}: {rank_0}, rank 1 holds {held}; {fix}"
        assert errors[1][name] == f"{start}: rank 1 holds {held}, {rank_0}; {fix}"
    unknown = "ring_attention, rank 1: unknown similarity 'cos'; choose 'dot' or 'cosine'"
    assert errors[0]["similarity"] == errors[1]["similarity"] == unknown
    start = "ring_attention needs one call on every rank"
    fix = (
        "pass the same causal, layout, mask (or none), similarity, scale and backend on every "
        "rank ('auto' chooses on each: name one), and record gradients on all or none (their "
        "backwards run together)"
    )
    on_rank_1 = {
        "causal": _options(causal=True),
        "scale": _options(scale=0.5),
        "cosine": _options(similarity="cosine", scale=math.sqrt(3)),
        "gradients": _options(recording="not recording"),
        "layout": _options(layout="zigzag"),
        "mask": _options(mask="torch.bool (2, 1, 4)"),
    }
    if HAS_TRITON:
        on_rank_1["backend"] = _options(backend="triton")
    for name, options in on_rank_1.items():
        assert errors[0][name] == f"{start}: rank 0 has {_options()}, rank 1 has {options}; {fix}"
        assert errors[1][name] == f"{start}: rank 1 has {options}, rank 0 has {_options()}; {fix}"
    odd = (
        "ring_attention, rank 0: layout 'zigzag' needs an even number of tokens per rank, got 5; "
        "pad the sequence at its end to a multiple of 2 x 2 ranks = 4 and mask the padding "
        "(mask=...)"
    )
    assert errors[0]["zigzag-odd"] == errors[1]["zigzag-odd"] == odd
    if HAS_TRITON:  # the way out is ring's other backend, not attention's
        start = "ring_attention, rank 0: backend 'triton': the Triton kernels"
        refusals = {
            "triton-float64": f"{start} take float16, bfloat16 or float32, got torch.float64; "
            "cast the inputs to one of them, or use backend='chunked'",
            "triton-head-dim": f"{start} support head dims up to 256, got 300 (query/key) and 4 "
            "(value); use backend='chunked'",
        }
        for name, refusal in refusals.items():
            assert errors[0][name] == errors[1][name] == refusal
    assert errors[0]["good"] == errors[1]["good"] == [2, 4, 4]
    assert errors[0]["expanded-mask"] is errors[1]["expanded-mask"] is True
    for rank_errors in errors:
        refused = rank_errors["refused gathers"]
        assert refused["tensors"] == refused["pickled"] == refused["calls"] > 0
        assert rank_errors["good gathers"] == {"tensors": 3, "pickled": 0}  # 3 good calls


def _subgroup_worker(rank: int, port: int, size: int, out: Path) -> None:
    """Global ranks 1 and 2 attend in the group [1, 2], where they are ranks 0 and 1; rank 0,
    outside it, calls with it too. Each writes its output and gradient shards, or its error."""
    _join(rank, port, size)
    case = Case(causal=True)
    try:
        group = dist.new_group([1, 2])
        inputs = [ring.shard(x, max(rank - 1, 0), 2) for x in case.inputs(2)]
        leaves = [x.requires_grad_() for x in inputs[:3]]
        try:
            output = ring_attention(*leaves, causal=True, group=group)
            output.backward(inputs[3])
            result = [output.detach()] + [x.grad for x in leaves]
        except ValueError as error:
            result = str(error)
    finally:
        distributed.teardown()
    torch.save(result, out / f"rank{rank}.pt")


def test_a_subgroup_addresses_its_ranks_and_refuses_others(tmp_path):
    """3 ranks, group [1, 2]: its ranks' shards, put together, equal explicit attention on
    their 2-shard sequence within 1e-10 (their neighbours are found by global rank); rank 0,
    not in the group, gets a one-line error instead of an AttributeError."""
    spawn_ranks(_subgroup_worker, 3, 3, tmp_path)
    outside, *inside = [
        torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(3)
    ]
    assert outside == (
        "ring_attention: this process (global rank 0) is not in the group; call it only on "
        "the ranks given to torch.distributed.new_group"
    )
    want = _outputs_and_grads(Case(causal=True), 2, "explicit", torch.float64)
    for what, *shards, expected in zip(["output", "dq", "dk", "dv"], *inside, want, strict=True):
        torch.testing.assert_close(torch.cat(shards, -2), expected, atol=1e-10, rtol=0, msg=what)


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone (an in-memory store), left after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    distributed.teardown()


def test_one_rank_is_plain_attention(one_rank_group):
    """A ring of one: causal cosine attention, output and gradients within 1e-10."""
    case = Case(similarity="cosine", causal=True, n=9)
    query, key, value, grad_output = case.inputs(1)
    leaves = [x.clone().requires_grad_() for x in (query, key, value)]
    output = ring_attention(*leaves, similarity="cosine", causal=True)
    output.backward(grad_output)
    want = _outputs_and_grads(case, 1, "explicit", torch.float64)
    for actual, expected in zip([output] + [x.grad for x in leaves], want, strict=True):
        torch.testing.assert_close(actual.detach(), expected, atol=1e-10, rtol=0)


def test_large_scores_in_float32_keep_the_block_kernels_gradients(one_rank_group):
    """Scores up to ~7e3 (q, k scaled by 30, scale 1), causal, float32: the merged lse went
    from base 2 to e and back in float32, moving it by ~5e-4 and dV's error from 5.7e-6 to
    7.9e-4 (140x chunked's). It is float64 now: each gradient within 1.5x plus 1e-6 of what
    chunked attention alone gives against float64 explicit attention."""
    generator = torch.Generator().manual_seed(7)
    q, k, v, grad_output = (
        torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64) for _ in range(4)
    )
    q, k = q * 30, k * 30

    def errors(function, dtype):
        leaves = [x.to(dtype, copy=True).requires_grad_() for x in (q, k, v)]
        function(*leaves, causal=True, scale=1.0).backward(grad_output.to(dtype))
        return [x.grad.double() for x in leaves]

    want = errors(functools.partial(attention, backend="explicit"), torch.float64)
    ring = errors(ring_attention, torch.float32)
    chunked = errors(functools.partial(attention, backend="chunked"), torch.float32)
    for name, ours, theirs, exact in zip("qkv", ring, chunked, want, strict=True):
        ours_error, their_error = ((x - exact).abs().max().item() for x in (ours, theirs))
        assert ours_error <= 1.5 * their_error + 1e-6, (name, ours_error, their_error)


def test_keys_and_values_expanded_over_heads_are_taken(one_rank_group):
    """Grouped-query attention's keys and values, one head expanded (stride 0) to the query's
    four, with a key mask: output and gradients (the key's and value's summed over the
    heads they serve) within 1e-10 of explicit attention on the same views."""
    query, key, value, grad_output = Case(lead=(2, 4), n=9).inputs(1)
    allowed = torch.arange(9) < 7

    def run(backend: str) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in (query, key[:, :1], value[:, :1])]
        kv = [x.expand(2, 4, 9, -1) for x in leaves[1:]]
        if backend == "ring":
            output = ring_attention(leaves[0], *kv, causal=True, mask=allowed)
        else:
            output = attention(leaves[0], *kv, causal=True, mask=allowed, backend=backend)
        output.backward(grad_output)
        return [output.detach()] + [x.grad for x in leaves]

    for actual, expected in zip(run("ring"), run("explicit"), strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-10, rtol=0)


def test_a_ring_of_one_runs_no_collective(one_rank_group, monkeypatch):
    """One rank has no other to agree with or send to: no collective runs (on NCCL each is a
    host sync), and the output is explicit attention's within 1e-10 (its refusals, still
    naming rank 0: test_local_errors_name_the_rank)."""

    def collective(*args, **kwargs):
        raise AssertionError("a collective in a ring of one")

    for name in ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce"):
        monkeypatch.setattr(dist, name, collective)
    query, key, value, _ = Case().inputs(1)
    want = attention(query, key, value, causal=True, backend="explicit")
    got = ring_attention(query, key, value, causal=True)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", ["chunked", pytest.param("triton", marks=needs_triton)])
def test_the_triton_blocks_read_contiguous_heads_and_chunked_reads_views(
    one_rank_group, monkeypatch, backend
):
    """q, k, v as views of one packed (1, n, 3, H, D) projection (folding B = 1 and H keeps
    their strides), and the output's gradient strided too (the output goes back to
    (1, n, H·Dv) through a transpose). The Triton blocks get every query, key, value and
    output gradient contiguous, forward and backward, a head spanning n·D elements rather
    than n·3·H·D (they address a head in int32); the chunked tiles read the caller's query
    in place, no copy. Output and gradients against explicit attention on the same views:
    1e-10 (chunked, float64), TRITON_TOLERANCE (Triton, float32)."""
    if backend == "triton":
        from selfattn.kernels import triton_attention as kernels

        names, dtype, tolerance = (
            ("block_forward", "block_backward"),
            torch.float32,
            TRITON_TOLERANCE,
        )
    else:
        kernels, names = ring, ("tile_forward", "tile_backward")
        dtype, tolerance = torch.float64, dict(atol=1e-10, rtol=0)
    read = []

    def reading(function, tensors: slice):
        def reader(*args, **kwargs):
            read.extend(args[tensors])
            return function(*args, **kwargs)

        return reader

    for name, tensors in zip(names, (slice(0, 3), slice(0, 4)), strict=True):
        monkeypatch.setattr(kernels, name, reading(getattr(kernels, name), tensors))
    n, heads, d = 9, 4, 5
    packed = torch.randn(1, n, 3, heads, d, dtype=dtype)
    upstream = torch.randn(1, n, heads * d, dtype=dtype)

    def run(attend) -> list[torch.Tensor]:
        leaf = packed.clone().requires_grad_()
        output = attend(*(x.transpose(1, 2) for x in leaf.unbind(2)))
        output.transpose(1, 2).reshape(1, n, heads * d).backward(upstream)
        return [output.detach(), leaf.grad, leaf]

    *got, leaf = run(functools.partial(ring_attention, causal=True, backend=backend))
    *want, _ = run(functools.partial(attention, causal=True, backend="explicit"))
    assert len(read) == 7
    if backend == "triton":
        assert all(x.is_contiguous() for x in read)
    else:
        assert read[0].untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr()
    for actual, expected in zip(got, want, strict=True):
        torch.testing.assert_close(actual, expected, **tolerance)


@needs_triton
def test_triton_is_chosen_by_the_span_the_blocks_read(monkeypatch):
    """q, k, v as views of one packed (1, n, 3, H, D) float16 projection, H·D = 4,096, as fake
    tensors (shapes and strides, no memory), under the interpreter (which takes CPU tensors
    as the kernels'): a head of the caller's query spans (n-1)·3·H·D elements, past 2³¹ from
    n = 174,764 on, and attention's Triton backend, which reads the views in place, refuses
    n = 600,000; but the blocks read contiguous copies, n·D: ring's backend="triton" takes
    n = 600,000 and 2²⁴ (2³¹ - 1, the last that fits), and refuses 2²⁴ + 1 in one line
    naming its chunked backend."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from selfattn.attention import make_call, triton_why_not
    from selfattn.kernels import triton_attention

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_attention, "INTERPRETING", True)

    def views_of_packed(n: int):
        qkv = torch.empty(1, n, 3, 32, 128, dtype=torch.float16)
        return make_call(*(x.transpose(1, 2) for x in qkv.unbind(2)), None, True, "dot", None, 0)

    def ring_backend(call) -> str:
        chosen, inputs = ring._chosen_backend(call, ring._block_inputs(call), "triton")
        assert all(x.is_contiguous() for x in inputs)
        return chosen

    with FakeTensorMode():
        in_place = triton_why_not(views_of_packed(600_000))
        chosen = [ring_backend(views_of_packed(n)) for n in (600_000, 2**24)]
        with pytest.raises(ValueError) as error:
            ring_backend(views_of_packed(2**24 + 1))
    assert in_place is not None and "a head here spans 7,372,787,839 elements" in in_place
    assert chosen == ["triton", "triton"]
    assert str(error.value) == (
        "backend 'triton': the Triton kernels index within a head in int32, and a head here "
        "spans 2,147,483,775 elements (more than 2³¹); use backend='chunked'"
    )


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_and_unshard_are_inverse_and_match_positions(size, layout):
    """Every rank's shard of a (2, 12·size, 3) sequence holds the tokens at ``positions``, in
    that order; unshard puts the shards back (along dim -2, and a mask's dim -1 too). Zig-zag:
    rank r holds chunks r and 2P-1-r of 2P."""
    t = 12 * size
    x = torch.randn(2, t, 3)
    shards = [ring.shard(x, rank, size, layout=layout) for rank in range(size)]
    for rank, held in enumerate(shards):
        torch.testing.assert_close(held, x[:, ring.positions(rank, size, t, layout=layout)])
    assert torch.equal(ring.unshard(shards, layout=layout), x)
    mask = torch.rand(2, 1, t) > 0.5
    mask_shards = [ring.shard(mask, rank, size, layout=layout, dim=-1) for rank in range(size)]
    assert torch.equal(ring.unshard(mask_shards, layout=layout, dim=-1), mask)
    if layout == "zigzag":
        chunk = t // (2 * size)
        first, last = ring.positions(0, size, t, layout=layout).tensor_split(2)
        assert first.tolist() == list(range(chunk))
        assert last.tolist() == list(range(t - chunk, t))


def test_shard_and_unshard_refuse_what_does_not_split():
    x = torch.zeros(1, 10, 2)
    with pytest.raises(ValueError) as error:
        ring.shard(x, 0, 3, layout="zigzag")
    assert str(error.value) == (
        "layout 'zigzag' cuts the sequence into 6 equal chunks, but its length 10 is not a "
        "multiple of 6; pad it at its end (and mask the padding)"
    )
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        ring.shard(x, 2, 2)
    with pytest.raises(ValueError, match=r"shards must have one length along dim -2, got \[4, 6\]"):
        ring.unshard([x[:, :4], x[:, 4:]])


def test_without_a_process_group_it_says_how_to_start_one():
    query, key, value, _ = Case().inputs(1)
    with pytest.raises(ValueError) as error:
        ring_attention(query, key, value)
    assert str(error.value) == (
        "ring_attention needs an initialised process group: launch with torchrun and call "
        "torch.distributed.init_process_group (or selfattn.train.distributed.setup())"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"mask": torch.ones(5, 5, dtype=torch.bool)},
            "ring_attention supports key-padding masks only, shape (n,) or (..., 1, n) for this "
            "rank's n keys, got (5, 5); use causal=True for causal masking, or run "
            "selfattn.attention(..., mask=...) in one process",
        ),
        (
            {"mask": torch.zeros(2, 1, 1, 5, dtype=torch.float64, requires_grad=True)},
            "ring_attention takes no gradient for a float mask; pass mask.detach(), or run "
            "selfattn.attention(..., mask=...) in one process",
        ),
        ({"layout": "striped"}, "unknown layout 'striped'; choose 'contiguous' or 'zigzag'"),
        (
            {"layout": "zigzag"},
            "layout 'zigzag' needs an even number of tokens per rank, got 5; pad the sequence "
            "at its end to a multiple of 2 x 1 ranks = 2 and mask the padding (mask=...)",
        ),
        ({"similarity": "euclid"}, "unknown similarity 'euclid'; choose 'dot' or 'cosine'"),
        ({"backend": "flash"}, "unknown backend 'flash'; choose 'auto', 'chunked' or 'triton'"),
        (
            {"mask": torch.zeros(2, 1, 1, 5, dtype=torch.float64), "backend": "triton"},
            "backend 'triton' takes boolean key masks only (True = may attend), got "
            "torch.float64; use backend='chunked' (or 'auto') for a float mask",
        ),
        (
            {"key": torch.zeros(2, 3, 5, 7, dtype=torch.float32)},
            "query, key and value must share a dtype, got torch.float64, torch.float32, "
            "torch.float64; cast them with .to(dtype)",
        ),
        (
            {"key": torch.zeros(2, 3, 6, 7, dtype=torch.float64)},
            "key and value must have the same length, got 6 and 5",
        ),
        (
            {
                "key": torch.zeros(2, 3, 6, 7, dtype=torch.float64),
                "value": torch.zeros(2, 3, 6, 4, dtype=torch.float64),
            },
            "query and key/value shards must hold the same tokens, got lengths 5 and 6; give "
            "each rank the query, key and value of its own tokens",
        ),
    ],
)
def test_local_errors_name_the_rank(one_rank_group, change, message):
    """Each refused call: one line, prefixed with the rank whose arguments are wrong."""
    query, key, value, _ = Case().inputs(1)
    arguments = {"query": query, "key": key, "value": value} | change
    with pytest.raises(ValueError) as error:
        ring_attention(**arguments)
    assert str(error.value) == "ring_attention, rank 0: " + message


def test_a_float_mask_that_requires_grad_is_taken_under_no_grad(one_rank_group):
    """No gradient is recorded under torch.no_grad, so none would travel: such a mask was
    refused there too. It now gives what its detached copy gives (float64, exactly)."""
    query, key, value, _ = Case().inputs(1)
    mask = torch.zeros(2, 1, 1, 5, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        output = ring_attention(query, key, value, mask=mask)
    assert torch.equal(output, ring_attention(query, key, value, mask=mask.detach()))


def test_a_shard_of_no_ranks_says_so():
    with pytest.raises(ValueError, match=r"size \(the number of ranks\) must be 1 or more, got 0"):
        ring.shard(torch.zeros(4, 2), 0, 0)


def test_auto_runs_chunked_on_cpu_tensors(one_rank_group, monkeypatch):
    """backend="auto" on CPU tensors, without the interpreter: chunked's tiles attend (float32,
    which the Triton blocks would take)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    parts = []
    monkeypatch.setattr(ring, "tile_forward", _logging(ring.tile_forward, parts, query_at=0))
    query, key, value, _ = (x.float() for x in Case().inputs(1))
    want = attention(query, key, value, causal=True, backend="explicit")
    torch.testing.assert_close(ring_attention(query, key, value, causal=True), want)
    assert parts == [(5, 5, True)]


@needs_triton
def test_triton_on_cpu_needs_the_interpreter(one_rank_group, monkeypatch):
    """backend="triton" on CPU tensors without TRITON_INTERPRET=1: one line saying so."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    query, key, value, _ = (x.float() for x in Case().inputs(1))
    with pytest.raises(ValueError) as error:
        ring_attention(query, key, value, backend="triton")
    assert str(error.value) == (
        "ring_attention, rank 0: backend 'triton' runs on CUDA tensors, got cpu (on CPU it "
        "runs only under Triton's interpreter: set TRITON_INTERPRET=1 before importing triton)"
    )


def test_a_nccl_group_needs_cuda_tensors(one_rank_group, monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    query, key, value, _ = Case().inputs(1)
    with pytest.raises(ValueError) as error:
        ring_attention(query, key, value)
    assert str(error.value) == (
        "ring_attention, rank 0: a NCCL group sends CUDA tensors, got cpu; move the shards "
        "with .to('cuda') or use a gloo group for CPU tensors"
    )


def test_double_backward_is_refused(one_rank_group):
    """create_graph=True through the ring's backward raises instead of dropping terms."""
    query, key, value, grad_output = (x.requires_grad_() for x in Case().inputs(1))
    output = ring_attention(query, key, value)
    way_out = "use selfattn.attention(..., backend='explicit') on the whole sequence for"
    with pytest.raises(RuntimeError, match="backend 'ring' has first derivatives only") as error:
        torch.autograd.grad(output, (query,), grad_output, create_graph=True)
    assert way_out in str(error.value)  # ring has no sdpa or explicit backend to name


def test_the_readme_script_runs_under_torchrun(tmp_path):
    # The README's ring attention example, launched as it says (2 ranks), with a check added
    # at its end: the shapes its comments give, and the gathered output equals attention over
    # the whole sequence with the whole mask (float32, 1e-5).
    from test_smoke import is_torchrun_script, readme_python_blocks

    (script,) = [block for block in readme_python_blocks() if is_torchrun_script(block)]
    check = (
        "\nfrom selfattn import attention\n"
        "assert my_keys.shape == (2048,) and out.shape == (1, 8, 2048, 64)\n"
        "assert whole.shape == (1, 8, 4096, 64)\n"
        "want = attention(q, k, v, causal=True, mask=real)\n"
        "torch.testing.assert_close(whole, want, atol=1e-5, rtol=0)\n"
    )
    path = tmp_path / "ring.py"
    path.write_text(script + check)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={free_port()}", str(path)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
