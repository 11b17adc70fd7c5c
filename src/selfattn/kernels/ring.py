"""Ring attention: one sequence split across the ranks of a process group, attended whole.

Each of the P ranks holds n tokens of the query, key and value. The key/value blocks travel
around the ring: at step i rank r holds the block of rank ``(r - i) mod P``, computes with it
while sending it on to rank ``r + 1`` and receiving the next from rank ``r - 1``, so after P
steps every query has met every key and no rank ever held more than two blocks.

Layouts (which tokens rank r holds; :func:`shard` cuts them out, :func:`unshard` puts the
gathered shards back in order, :func:`positions` gives their global positions):

- ``"contiguous"``: tokens ``[r·n, (r+1)·n)``. With ``causal``, rank r computes r + 1 blocks
  (the diagonal one half), so rank P-1 does 2P-1 times the work of rank 0 and the ring waits
  for it.
- ``"zigzag"``: the sequence cut into 2P chunks of n/2 tokens, rank r holding chunks r and
  2P-1-r (in that order). With ``causal`` every rank does the same work: its own block under
  the causal triangle, and from each other rank half a block, all of its queries against
  the earlier chunk of a rank before it (source < r), its later chunk's queries against all
  of a rank after it (source > r); the rest lies in the future and is not computed.

Each block is attended by one of two kernels (``backend``), chosen once per call: the fused
Triton kernels' ``block_forward``/``block_backward`` (kernels/triton_attention.py; on CUDA, or
on CPU under ``TRITON_INTERPRET=1``; boolean key masks only), or the chunked kernel's torch
tiles (kernels/chunked.py; any device, float masks too). Both return a block output normalised
over that block alone and its log-sum-exp (``lse``), each in its own base (the Triton lse is
in base 2, chunked's in its ``Masks``' base): the ring converts it to base e as it merges
(``_Block.unit``), and back for the backward. Two such partial results merge exactly as the
online softmax merges tiles: with ``lse = log(sum(exp(scaled)))`` over the keys seen so far
(-inf while none is),

    merged_lse = logaddexp(lse, block_lse)
    output     = output + (block_output - output) * sigmoid(block_lse - lse)

(``sigmoid(block_lse - lse)`` is the block's share of the merged softmax mass, 0 for a block
with no visible key). Only ``output`` and ``lse`` are saved. The backward sends the key/value
blocks around again and recomputes each block's weights from the saved lse; the gradients of
each block's keys and values (dK, dV) are summed into accumulators that travel with the block
and arrive, after a last step, at the rank that owns it.

``causal``: query i sees keys ``j <= i`` in global positions (T == S over the whole sequence);
blocks, and tiles within them, entirely in the future are not computed, only passed on.
``mask``: a key-padding mask of this rank's keys, shape ``(..., 1, n)`` or ``(n,)``,
broadcastable to the scores: boolean (True = may attend) or float (added to the scaled scores,
no gradient). It travels with its key/value block. A query with no key to attend gets output
0 and zero gradients, as in :func:`selfattn.attention`. Inputs in float16/bfloat16 travel as
they are; each block's output is merged in float32 (the Triton kernels multiply in the input
dtype and accumulate in float32, chunked's tiles compute in float32), and the dK/dV
accumulators travel in float32.

Every send has a matching receive only if all ranks make the same calls in the same order:
each forward, and each backward, runs on every rank of the group together.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from selfattn.kernels.chunked import (
    BLOCK_K,
    LOG2E,
    REDUCED_PRECISION,
    Masks,
    at_least_2d,
    default_block_q,
    refuse_double_backward,
    tile_backward,
    tile_forward,
)

if TYPE_CHECKING:
    from selfattn.attention import AttentionCall

LAYOUTS = ("contiguous", "zigzag")  # which tokens each rank holds (module docstring)


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = False,
    similarity: str = "dot",
    scale: float | None = None,
    mask: Tensor | None = None,
    layout: str = "contiguous",
    backend: str = "auto",
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """This rank's shard of ``attention(query, key, value)`` over the sequence of all ranks.

    Args:
        query, key, value: this rank's shard, ``(..., n, D)``, ``(..., n, D)``, ``(..., n, Dv)``,
            as :func:`shard` cuts it for ``layout``; the same shapes and dtype on every rank.
        causal: query i sees keys ``j <= i`` (global positions).
        similarity: ``"dot"`` or ``"cosine"``, as in :func:`selfattn.attention`.
        scale: multiplies the scores; None means ``default_scale`` (1/sqrt(D) for dot).
        mask: a key-padding mask of this rank's n keys, ``(n,)`` or ``(..., 1, n)``
            broadcastable to the scores (a padding mask ``(B, n)`` for ``(B, H, n, D)``
            shards: ``mask[:, None, None, :]``); boolean (True = may attend) or float (added
            to the scaled scores, without gradient). Cut it with :func:`shard` as the keys.
        layout: which tokens each rank holds: ``"contiguous"`` or ``"zigzag"`` (even work
            per rank under ``causal``; n must be even); see :func:`shard`.
        backend: what attends each block: ``"triton"``, the fused kernels (CUDA tensors, or
            CPU ones under ``TRITON_INTERPRET=1``; float16/bfloat16/float32; boolean masks
            only), ``"chunked"``, chunked's torch tiles (any device and dtype, float masks
            too), or ``"auto"``: Triton for CUDA tensors where it applies (as
            :func:`selfattn.attention` decides for ``backend="triton"``), chunked otherwise.
        group: the process group the sequence is split over; None for the default one.

    Returns:
        ``(..., n, Dv)``, this rank's queries attended over the whole sequence.

    Every rank checks its arguments, then all agree: an error on one rank, shards of another
    shape, or other options (``causal``, ``layout``, the mask's presence, shape and dtype,
    ``similarity``, ``scale``, the backend ``auto`` chose, whether gradients are recorded) are
    raised, in one line naming the ranks, on every rank (none is left waiting). Agreeing
    costs one ``all_gather`` of three int64 per rank (none in a group of one).

    The backward runs on every rank together: each rank must backpropagate through its output
    (a loss that depends on it). One that does not leaves the others waiting for blocks, until
    the group's timeout (``init_process_group(timeout=...)``, 30 minutes by default for gloo).
    """
    # Imported here: attention.py imports the kernels package, which may export this module.
    from selfattn.attention import make_call

    ring = _Ring.of(group)

    def checked_call() -> tuple[AttentionCall, str, list[Tensor]]:
        _check_layout(layout)
        call = make_call(query, key, value, mask, causal, similarity, scale, 0.0)
        if query.shape[-2] != key.shape[-2]:
            raise ValueError(
                "query and key/value shards must hold the same tokens, got lengths "
                f"{query.shape[-2]} and {key.shape[-2]}; give each rank the query, key and value "
                "of its own tokens"
            )
        _check_key_mask(call.mask)
        if call.mask is not None:  # as it travels: in the shape given, alike on every rank
            # (make_call narrowed the axes this rank's mask broadcasts), with all n keys
            shape = at_least_2d(mask).shape
            call = replace(call, mask=call.mask.expand(*shape[:-2], 1, query.shape[-2]))
        if layout == "zigzag" and query.shape[-2] % 2:
            raise ValueError(
                f"layout 'zigzag' needs an even number of tokens per rank, got "
                f"{query.shape[-2]}; pad the sequence at its end to a multiple of "
                f"2 x {ring.size} ranks = {2 * ring.size} and mask the padding (mask=...)"
            )
        if dist.get_backend(ring.group) == "nccl" and query.device.type != "cuda":
            raise ValueError(
                f"a NCCL group sends CUDA tensors, got {query.device}; move the shards with "
                ".to('cuda') or use a gloo group for CPU tensors"
            )
        chosen, inputs = _chosen_backend(call, _block_inputs(call), backend)
        return call, chosen, inputs

    call, chosen, inputs = ring.agree_on(checked_call, layout, query)
    lead, n, dv = query.shape[:-2], query.shape[-2], value.shape[-1]
    blocks = _Blocks(lead, n, causal, layout, call.scale, ring, _KERNELS[chosen])
    output = _RingAttention.apply(*inputs, call.mask, blocks)
    return output.reshape(*lead, n, dv).to(query.dtype)


def positions(rank: int, size: int, length: int, *, layout: str = "contiguous") -> Tensor:
    """The global positions (int64, on the CPU) of the tokens rank ``rank`` of ``size`` holds,
    in order, out of a sequence of ``length``: e.g. for position embeddings of its shard."""
    count, chunks = _chunks(rank, size, length, layout)
    chunk = length // count
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def shard(x: Tensor, rank: int, size: int, *, layout: str = "contiguous", dim: int = -2) -> Tensor:
    """Rank ``rank``'s shard of the whole sequence ``x`` (tokens along ``dim``) for ``layout``,
    as a new tensor: what it passes to :func:`ring_attention` (queries, keys and values; a key
    mask with ``dim=-1``)."""
    count, chunks = _chunks(rank, size, x.shape[dim], layout)
    pieces = x.tensor_split(count, dim)
    return torch.cat([pieces[c] for c in chunks], dim)


def unshard(shards: Sequence[Tensor], *, layout: str = "contiguous", dim: int = -2) -> Tensor:
    """The whole sequence from every rank's shard, in rank order (e.g. from ``all_gather``):
    the inverse of :func:`shard`."""
    lengths = {x.shape[dim] for x in shards}
    if len(lengths) != 1:
        raise ValueError(f"shards must have one length along dim {dim}, got {sorted(lengths)}")
    size, length = len(shards), lengths.pop() * len(shards)
    ordered: dict[int, Tensor] = {}
    for rank, x in enumerate(shards):
        _, chunks = _chunks(rank, size, length, layout)
        ordered |= zip(chunks, x.tensor_split(len(chunks), dim), strict=True)
    return torch.cat([ordered[c] for c in sorted(ordered)], dim)


def _check_layout(layout: str) -> None:
    """Refuse a layout this module does not know."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose 'contiguous' or 'zigzag'")


def _chunks(rank: int, size: int, length: int, layout: str) -> tuple[int, list[int]]:
    """How many equal chunks ``layout`` cuts a sequence of ``length`` into, and which of them,
    in order, rank ``rank`` of ``size`` holds."""
    _check_layout(layout)
    if size < 1:
        raise ValueError(f"size (the number of ranks) must be 1 or more, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    count = size if layout == "contiguous" else 2 * size
    if length % count:
        raise ValueError(
            f"layout {layout!r} cuts the sequence into {count} equal chunks, but its length "
            f"{length} is not a multiple of {count}; pad it at its end (and mask the padding)"
        )
    return count, [rank] if layout == "contiguous" else [rank, count - 1 - rank]


def _block_inputs(call: AttentionCall) -> list[Tensor]:
    """Query, key and value as the blocks read them: L2-normalised for cosine, the leading
    dims folded into one, ``(N, n, D)`` (a view where the strides allow)."""
    from selfattn.attention import normalize_for_similarity

    query, key = normalize_for_similarity(call)
    lead = math.prod(query.shape[:-2])
    return [x.reshape(lead, *x.shape[-2:]) for x in (query, key, call.value)]


def _chosen_backend(
    call: AttentionCall, inputs: list[Tensor], backend: str
) -> tuple[str, list[Tensor]]:
    """The kernel this rank's blocks run on for ``backend`` (module docstring) and the
    query, key and value it reads (:func:`_block_inputs`), or a one-line ValueError: an
    unknown name, or ``"triton"`` where it does not apply. The Triton blocks read them
    contiguous, so that a head spans n·D elements whatever the caller's strides (a copy only
    of strided shards, such as views of one packed qkv projection); chunked reads views."""
    if backend not in ("auto", *_KERNELS):
        raise ValueError(f"unknown backend {backend!r}; choose 'auto', 'chunked' or 'triton'")
    if backend == "chunked" or (backend == "auto" and not call.query.is_cuda):
        return "chunked", inputs
    contiguous = [x.contiguous() for x in inputs]
    reason = _triton_why_not(call, contiguous)
    if reason is None:
        return "triton", contiguous
    if backend == "triton":
        raise ValueError(reason)
    return "chunked", inputs


def _triton_why_not(call: AttentionCall, inputs: Sequence[Tensor]) -> str | None:
    """Why the Triton blocks cannot attend this call, or None: a float key mask (they read
    boolean ones only), or what makes ``selfattn.attention`` refuse ``backend="triton"`` for
    ``inputs`` (the query, key and value the blocks read, whose strides, not the caller's,
    decide whether a head fits the kernels' int32 offsets), pointing to chunked (ring's
    other backend) instead of attention's."""
    from selfattn.attention import triton_why_not

    if call.mask is not None and call.mask.dtype != torch.bool:
        return (
            f"backend 'triton' takes boolean key masks only (True = may attend), got "
            f"{call.mask.dtype}; use backend='chunked' (or 'auto') for a float mask"
        )
    query, key, value = inputs
    read = replace(call, query=query, key=key, value=value)
    return triton_why_not(read, instead="backend='chunked'")


def _check_key_mask(mask: Tensor | None) -> None:
    """Refuse masks other than key padding (one row for every query) and float masks that
    need a gradient (it would have to travel back around the ring)."""
    if mask is None:
        return
    if mask.shape[-2] != 1:
        raise ValueError(
            f"ring_attention supports key-padding masks only, shape (n,) or (..., 1, n) for this "
            f"rank's n keys, got {tuple(mask.shape)}; use causal=True for causal masking, or "
            "run selfattn.attention(..., mask=...) in one process"
        )
    if mask.requires_grad and torch.is_grad_enabled():  # under no_grad, none is recorded
        raise ValueError(
            "ring_attention takes no gradient for a float mask; pass mask.detach(), or run "
            "selfattn.attention(..., mask=...) in one process"
        )


@dataclass(frozen=True)
class _Ring:
    """This rank's place in the group's ring, and the exchange of blocks with its neighbours."""

    group: dist.ProcessGroup
    rank: int  # in the group
    size: int
    # The neighbours' global ranks, as P2POp addresses them (torch < 2.6 has no group_peer).
    next_peer: int
    previous_peer: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> _Ring:
        """The ring of ``group`` (None: the default group), which must be initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "ring_attention needs an initialised process group: launch with torchrun and "
                "call torch.distributed.init_process_group (or selfattn.train.distributed.setup())"
            )
        group = dist.group.WORLD if group is None else group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError(
                f"ring_attention: this process (global rank {dist.get_rank()}) is not in the "
                "group; call it only on the ranks given to torch.distributed.new_group"
            )
        peer = functools.partial(dist.get_global_rank, group)
        return cls(group, rank, size, peer((rank + 1) % size), peer((rank - 1) % size))

    def agree_on(
        self,
        checked_call: Callable[[], tuple[AttentionCall, str, list[Tensor]]],
        layout: str,
        shards: object,
    ) -> tuple[AttentionCall, str, list[Tensor]]:
        """``checked_call()`` on this rank (the call, its chosen backend and the blocks'
        inputs), once every rank's call passed its checks and all hold shards of one shape,
        dtype and device type, with the same options, backend and ``layout``; otherwise a
        ValueError on every rank. ``shards``: this rank's query (where the collective runs)."""
        try:
            (call, backend, inputs), problem = checked_call(), None
        except ValueError as error:
            call, backend, inputs, problem = None, None, None, str(error)
        shard, options = (
            (None, None) if call is None else (_shard(call), _options(call, layout, backend))
        )
        reports = self._reports((problem, shard, options), shards)
        for rank, (other_problem, _, _) in enumerate(reports):
            if other_problem is not None:
                raise ValueError(f"ring_attention, rank {rank}: {other_problem}")
        for rank, (_, other_shard, other_options) in enumerate(reports):
            if other_shard != shard:
                raise ValueError(
                    f"ring_attention needs equal shards on every rank: rank {self.rank} holds "
                    f"{shard}, rank {rank} holds {other_shard}; split the sequence into equal "
                    "parts (pad it at its end to a multiple of the world size)"
                )
            if other_options != options:
                raise ValueError(
                    f"ring_attention needs one call on every rank: rank {self.rank} has "
                    f"{options}, rank {rank} has {other_options}; pass the same causal, layout, "
                    "mask (or none), similarity, scale and backend on every rank ('auto' "
                    "chooses on each: name one), and record gradients on all or none (their "
                    "backwards run together)"
                )
        return call, backend, inputs

    def _reports(
        self, report: tuple[str | None, str | None, str | None], shards: object
    ) -> list[tuple[str | None, ...]]:
        """Every rank's ``(problem, shard, options)``, in rank order. One all_gather of a
        fixed-size digest per rank (:func:`_digest`, no pickling) shows whether all equal
        this rank's and none holds a problem, as in every call that goes on; only otherwise
        are the reports themselves gathered, pickled, for the error to name what differs. A
        ring of one has nothing to agree with."""
        if self.size == 1:
            return [report]
        mine = _digest(report, self._device(shards))
        digests = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(digests, mine, group=self.group)
        rows = torch.stack(digests).tolist()  # one copy to the host
        if rows[0][0] == 0 and all(row == rows[0] for row in rows):
            return [report] * self.size
        reports: list[tuple[str | None, ...]] = [(None, None, None)] * self.size
        dist.all_gather_object(reports, report, group=self.group)
        return reports

    def _device(self, shards: object) -> torch.device:
        """Where the group's collectives take tensors: in a NCCL group a CUDA device (the
        shards', else the current one, as ``all_gather_object`` takes), elsewhere the CPU."""
        if dist.get_backend(self.group) != "nccl":
            return torch.device("cpu")
        if isinstance(shards, Tensor) and shards.is_cuda:
            return shards.device
        return torch.device("cuda", torch.cuda.current_device())

    def shift(self, blocks: list[Tensor], into: list[Tensor] | None = None) -> _Transfer:
        """Send ``blocks`` to the next rank and receive the previous rank's (into ``into``);
        in a ring of one, they stay."""
        if self.size == 1:
            return _Transfer([], blocks)
        received = into if into is not None else [torch.empty_like(b) for b in blocks]
        sends = [dist.P2POp(dist.isend, b, self.next_peer, self.group) for b in blocks]
        receives = [dist.P2POp(dist.irecv, b, self.previous_peer, self.group) for b in received]
        return _Transfer(dist.batch_isend_irecv(sends + receives), received)


def _digest(report: tuple[str | None, str | None, str | None], device: torch.device) -> Tensor:
    """A rank's ``(problem, shard, options)`` as three int64 words on ``device``: 1, 0, 0
    for a problem; else 0 and the 128 bits of a BLAKE2b hash of the shard and options text
    (equal texts give equal words, and unequal ones with probability 2⁻¹²⁸)."""
    problem, shard, options = report
    words = [1, 0, 0]
    if problem is None:
        hashed = hashlib.blake2b(f"{shard}; {options}".encode(), digest_size=16).digest()
        words = [0, *(int.from_bytes(hashed[i : i + 8], "little", signed=True) for i in (0, 8))]
    return torch.tensor(words, dtype=torch.int64, device=device)


def _shard(call: AttentionCall) -> str:
    """The shapes, dtype and device type that must match across ranks, as errors show them."""
    tensors = {"query": call.query, "key": call.key, "value": call.value}
    shapes = ", ".join(f"{name} {tuple(x.shape)}" for name, x in tensors.items())
    return f"{shapes} in {call.query.dtype} on {call.query.device.type}"


def _options(call: AttentionCall, layout: str, backend: str) -> str:
    """The options that must match across ranks, and whether this one records gradients."""
    records = torch.is_grad_enabled() and any(
        x.requires_grad for x in (call.query, call.key, call.value)
    )
    recording = "recording gradients" if records else "not recording gradients"
    mask = "None" if call.mask is None else f"{call.mask.dtype} {tuple(call.mask.shape)}"
    return (
        f"causal={call.causal}, layout={layout!r}, mask={mask}, similarity={call.similarity!r}, "
        f"scale={call.scale!r}, backend={backend!r}, {recording}"
    )


@dataclass
class _Transfer:
    """Blocks on their way from the previous rank."""

    works: list[dist.Work]
    received: list[Tensor]

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        return self.received


@dataclass(frozen=True)
class _Part:
    """Which of this rank's queries (rows) see which keys of a block (cols), and whether the
    causal diagonal crosses them (else every key in cols is visible to every row)."""

    rows: slice
    cols: slice
    diagonal: bool


@dataclass(frozen=True)
class _ChunkedBlock:
    """One block part on chunked's torch tiles (kernels/chunked.py), computed in float32 for
    float16/bfloat16 inputs; its lse is in the ``Masks``' base."""

    masks: Masks
    bias: Tensor | None  # a float key mask's columns, as given
    scale: float
    block_q: int  # query rows per tile, by chunked_attention's rule (a tile of all heads)

    @classmethod
    def of(
        cls, lead: torch.Size, key_mask: Tensor | None, causal: bool, scale: float
    ) -> _ChunkedBlock:
        """The part whose columns ``key_mask`` (boolean or float, ``(..., 1, cols)``) masks;
        ``causal``: the causal diagonal crosses it."""
        is_bias = key_mask is not None and key_mask.dtype != torch.bool
        masks = Masks(lead, None if is_bias else key_mask, causal, has_bias=is_bias)
        return cls(masks, key_mask if is_bias else None, scale, default_block_q(lead, BLOCK_K))

    @property
    def unit(self) -> float:
        """log_base(e) of the lse's base: it is the natural lse times this."""
        return self.masks.unit

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """The output normalised over this part's keys and its lse (+inf: no visible key)."""
        query, key, value = (x.to(_compute_dtype(x.dtype)) for x in (query, key, value))
        return tile_forward(
            query, key, value, self.bias, self.masks, self.scale, self.block_q, BLOCK_K
        )

    def backward(
        self,
        grad_output: Tensor,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        output: Tensor,
        lse: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """dQ, dK, dV of this part, from the merged ``output`` and ``lse`` (in ``unit``'s
        base), in ``output``'s dtype."""
        query, key, value = (x.to(output.dtype) for x in (query, key, value))
        grads = tile_backward(
            grad_output.to(output.dtype),
            query,
            key,
            value,
            self.bias,
            output,
            lse,
            self.masks,
            self.scale,
            self.block_q,
            BLOCK_K,
            False,
        )
        return grads[:3]


@dataclass(frozen=True)
class _TritonBlock:
    """One block part on the fused Triton kernels (kernels/triton_attention.py), given the
    inputs in their own dtype; its output is float32 and its lse in base 2."""

    key_allowed: Tensor | None  # (N, cols) boolean
    causal: bool
    scale: float
    unit: ClassVar[float] = LOG2E  # as _ChunkedBlock.unit: block_forward's lse is in base 2

    @classmethod
    def of(
        cls, lead: torch.Size, key_mask: Tensor | None, causal: bool, scale: float
    ) -> _TritonBlock:
        """As :meth:`_ChunkedBlock.of`, for a boolean ``key_mask``: folded to the kernels'
        ``(N, cols)`` rows (a copy of N·cols booleans where it broadcasts over heads)."""
        if key_mask is None:
            return cls(None, causal, scale)
        cols = key_mask.shape[-1]
        allowed = key_mask[..., 0, :].expand(*lead, cols).reshape(math.prod(lead), cols)
        return cls(allowed, causal, scale)

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """As :meth:`_ChunkedBlock.forward`; triton is imported only here and below."""
        from selfattn.kernels.triton_attention import block_forward

        return block_forward(
            query, key, value, causal=self.causal, scale=self.scale, key_allowed=self.key_allowed
        )

    def backward(
        self,
        grad_output: Tensor,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        output: Tensor,
        lse: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """As :meth:`_ChunkedBlock.backward`, in float32."""
        from selfattn.kernels.triton_attention import block_backward

        return block_backward(
            grad_output,
            query,
            key,
            value,
            output,
            lse,
            causal=self.causal,
            scale=self.scale,
            key_allowed=self.key_allowed,
        )


_Block = _ChunkedBlock | _TritonBlock
_KERNELS: dict[str, type[_Block]] = {"chunked": _ChunkedBlock, "triton": _TritonBlock}


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What outputs merge and gradients sum in: float32 for float16/bfloat16 inputs."""
    return torch.float32 if dtype in REDUCED_PRECISION else dtype


@dataclass(frozen=True)
class _Blocks:
    """How this rank attends to one block of keys: which part it sees, masked how, by which
    kernel."""

    lead: torch.Size
    n: int  # tokens per rank
    causal: bool
    layout: str
    scale: float
    ring: _Ring
    kernel: type[_Block]

    def part(self, source: int) -> _Part | None:
        """The part of rank ``source``'s block this rank's queries see (None: all in the
        future, or an empty shard), from the global positions of both (module docstring)."""
        if self.n == 0 or math.prod(self.lead) == 0:
            return None
        whole, first, second = slice(0, self.n), slice(0, self.n // 2), slice(self.n // 2, self.n)
        zigzag = self.layout == "zigzag"
        if not self.causal:
            return _Part(whole, whole, diagonal=False)
        if source == self.ring.rank:  # the causal triangle: local order is global order
            return _Part(whole, whole, diagonal=True)
        if source < self.ring.rank:
            return _Part(whole, first if zigzag else whole, diagonal=False)
        return _Part(second, whole, diagonal=False) if zigzag else None

    def block(self, part: _Part, key_mask: Tensor | None) -> _Block:
        """The kernel's view of ``part`` of a block whose keys ``key_mask`` masks (or None)."""
        cols_mask = None if key_mask is None else key_mask[..., part.cols]
        return self.kernel.of(self.lead, cols_mask, part.diagonal, self.scale)


def _around_the_ring(blocks: list[Tensor], ring: _Ring) -> Iterator[tuple[int, list[Tensor]]]:
    """Yield ``(source rank, blocks)`` for every rank's blocks in turn, starting with ours.

    While the caller computes with the blocks in hand they are already travelling to the next
    rank, and the following ones arriving; the buffers of a block done with receive the next
    but one (never the caller's own tensors, sent at step 0)."""
    blocks = [block.contiguous() for block in blocks]
    spare = None
    for step in range(ring.size):
        transfer = ring.shift(blocks, into=spare) if step < ring.size - 1 else None
        yield (ring.rank - step) % ring.size, blocks
        if transfer is not None:
            spare = blocks if step > 0 else None
            blocks = transfer.wait()


def _key_blocks(
    key: Tensor, value: Tensor, key_mask: Tensor | None, ring: _Ring
) -> Iterator[tuple[int, Tensor, Tensor, Tensor | None]]:
    """Yield ``(source rank, key, value, key mask or None)`` of every rank's block in turn,
    starting with ours: the key mask travels with its keys."""
    travelling = [key, value] if key_mask is None else [key, value, key_mask]
    for source, (key_block, value_block, *mask_block) in _around_the_ring(travelling, ring):
        yield source, key_block, value_block, mask_block[0] if mask_block else None


def _ring_forward(
    query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None, blocks: _Blocks
) -> tuple[Tensor, Tensor]:
    """Output (N, n, Dv) in the compute dtype and natural log-sum-exp (N, n, 1) in float64;
    +inf where a query sees no key (both kernels' backward convention: its weights are all 0).

    The lse is float64 because it goes from each block's base to e and back: in float32 the
    round trip moves an lse of 10⁴ by 5e-4, and with it every weight by that share."""
    output = query.new_zeros(*query.shape[:-1], value.shape[-1], dtype=_compute_dtype(query.dtype))
    lse = output.new_full((*query.shape[:-1], 1), -math.inf, dtype=torch.float64)
    for source, key_block, value_block, mask_block in _key_blocks(
        key, value, key_mask, blocks.ring
    ):
        part = blocks.part(source)
        if part is None:
            continue
        block, rows, cols = blocks.block(part, mask_block), part.rows, part.cols
        # The block's output and lse, unnamed: freed once merged, not held through the next.
        _merge(
            output[:, rows],
            lse[:, rows],
            *block.forward(query[:, rows], key_block[:, cols], value_block[:, cols]),
            block.unit,
        )
    return output, lse.masked_fill_(lse == -math.inf, math.inf)


def _merge(
    output: Tensor, lse: Tensor, block_output: Tensor, block_lse: Tensor, unit: float
) -> None:
    """Merge a block's partial softmax output over other keys into ``output`` and ``lse``
    (natural, float64, -inf while no key is visible), in place; ``block_lse`` is in the base
    whose log of e is ``unit``, +inf where the block has no visible key."""
    block_lse = (block_lse.double() / unit).masked_fill_(block_lse == math.inf, -math.inf)
    block_share = torch.sigmoid(block_lse - lse).masked_fill_(block_lse == -math.inf, 0.0)
    output.add_((block_output - output).mul_(block_share.to(output.dtype)))
    lse.copy_(torch.logaddexp(lse, block_lse))


def _ring_backward(
    grad_output: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_mask: Tensor | None,
    output: Tensor,
    lse: Tensor,
    blocks: _Blocks,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of this rank's query, key and value shards, in the compute dtype.

    The dK, dV of the block in hand are added to the sums that arrive with it (sent by the
    rank that had it before) and sent on; the last step sends them home."""
    compute = output.dtype
    grad_query = torch.zeros_like(query, dtype=compute)
    sums_in_flight = None
    for source, key_block, value_block, mask_block in _key_blocks(
        key, value, key_mask, blocks.ring
    ):
        if sums_in_flight is None:  # step 0: our own block, whose sums start here
            sums = [torch.zeros_like(x, dtype=compute) for x in (key, value)]
        else:
            sums = sums_in_flight.wait()
        part = blocks.part(source)
        if part is not None:
            rows, cols = part.rows, part.cols
            block = blocks.block(part, mask_block)
            # The block's dQ, dK, dV, unnamed: freed once added, not held through the next.
            _add(
                (grad_query[:, rows], sums[0][:, cols], sums[1][:, cols]),
                block.backward(
                    grad_output[:, rows],
                    query[:, rows],
                    key_block[:, cols],
                    value_block[:, cols],
                    output[:, rows],
                    (lse[:, rows] * block.unit).to(compute),  # in the block's base
                ),
            )
        sums_in_flight = blocks.ring.shift(sums)
    grad_key, grad_value = sums_in_flight.wait()  # our own block's, back from the last rank
    return grad_query, grad_key, grad_value


def _add(totals: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """Add each block gradient into its total, in place."""
    for total, grad in zip(totals, grads, strict=True):
        total += grad


class _RingAttention(torch.autograd.Function):
    """Forward saves (query, key, value, key mask, output, lse); backward recomputes the
    weights."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_mask: Tensor | None,
        blocks: _Blocks,
    ) -> Tensor:
        output, lse = _ring_forward(query, key, value, key_mask, blocks)
        ctx.save_for_backward(query, key, value, key_mask, output, lse)
        ctx.blocks = blocks
        return output

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor
    ) -> tuple[Tensor | None, ...]:
        query, key, value, key_mask, output, lse = ctx.saved_tensors
        refuse_double_backward(
            "ring", grad_output, query, key, value,
            instead="selfattn.attention(..., backend='explicit') on the whole sequence",
        )  # fmt: skip
        if ctx.blocks.kernel is _TritonBlock:  # contiguous, as its inputs: strided (an output
            # transposed back to (B, n, H, Dv)), a head could pass the int32 offsets' reach
            grad_output = grad_output.contiguous()
        grads = _ring_backward(grad_output, query, key, value, key_mask, output, lse, ctx.blocks)
        return (
            *(grad.to(x.dtype) for grad, x in zip(grads, (query, key, value), strict=True)),
            None,
            None,
        )
