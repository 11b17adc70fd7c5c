"""Ring attention: one sequence split across the ranks of a process group, attended whole.

Rank r of P holds tokens ``[r·n, (r+1)·n)`` of the query, key and value. The key/value blocks
travel around the ring: at step i rank r holds the block of rank ``(r - i) mod P``, computes
with it while sending it on to rank ``r + 1`` and receiving the next from rank ``r - 1``, so
after P steps every query has met every key and no rank ever held more than two blocks.

Each block is attended with the chunked kernel's tiles (kernels/chunked.py), which return a
block output normalised over that block alone and its log-sum-exp (``lse``). Two such partial
results merge exactly as the online softmax merges tiles: with ``lse = log(sum(exp(scaled)))``
over the keys seen so far,

    merged_lse = logaddexp(lse, block_lse)
    output     = output + (block_output - output) * sigmoid(block_lse - lse)

(``sigmoid(block_lse - lse)`` is the block's share of the merged softmax mass). Only
``output`` and ``lse`` are saved. The backward sends the key/value blocks around again and
recomputes each block's weights from the saved lse; the gradients of each block's keys and
values (dK, dV) are summed into accumulators that travel with the block and arrive, after a
last step, at the rank that owns it.

``causal``: query i sees keys ``j <= i`` in global positions (T == S over the whole sequence).
The block on the diagonal is masked; blocks entirely in the future (source rank > r) are not
computed, only passed on. Inputs in float16/bfloat16 travel as they are and are computed in
float32, as the dK/dV accumulators travel. Masks other than causal are refused.

Every send has a matching receive only if all ranks make the same calls in the same order:
each forward, and each backward, runs on every rank of the group together.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from selfattn.kernels.chunked import (
    BLOCK_K,
    REDUCED_PRECISION,
    Masks,
    default_block_q,
    refuse_double_backward,
    tile_backward,
    tile_forward,
)

if TYPE_CHECKING:
    from selfattn.attention import AttentionCall


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = False,
    similarity: str = "dot",
    scale: float | None = None,
    mask: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """This rank's shard of ``attention(query, key, value)`` over the sequence of all ranks.

    Args:
        query, key, value: this rank's shard, ``(..., n, D)``, ``(..., n, D)``, ``(..., n, Dv)``:
            rank r holds tokens ``[r·n, (r+1)·n)``; the same shapes and dtype on every rank.
        causal: query i sees keys ``j <= i`` (global positions).
        similarity: ``"dot"`` or ``"cosine"``, as in :func:`selfattn.attention`.
        scale: multiplies the scores; None means ``default_scale`` (1/sqrt(D) for dot).
        mask: refused unless None (ring attention supports ``causal`` only).
        group: the process group the sequence is split over; None for the default one.

    Returns:
        ``(..., n, Dv)``, this rank's queries attended over the whole sequence.

    Every rank checks its arguments, then all agree: an error on one rank, shards of another
    shape, or other options (``causal``, ``similarity``, ``scale``, whether gradients are
    recorded) are raised, in one line naming the ranks, on every rank (none is left waiting).

    The backward runs on every rank together: each rank must backpropagate through its output
    (a loss that depends on it). One that does not leaves the others waiting for blocks, until
    the group's timeout (``init_process_group(timeout=...)``, 30 minutes by default for gloo).
    """
    # Imported here: attention.py imports the kernels package, which may export this module.
    from selfattn.attention import make_call, normalize_for_similarity

    ring = _Ring.of(group)

    def checked_call() -> AttentionCall:
        if mask is not None:
            raise ValueError(
                "no mask is supported, only causal=True; pad the sequence at its end to "
                "a multiple of the world size and use causal=True, or run "
                "selfattn.attention(..., mask=...) in one process"
            )
        call = make_call(query, key, value, None, causal, similarity, scale, 0.0)
        if query.shape[-2] != key.shape[-2]:
            raise ValueError(
                "query and key/value shards must hold the same tokens, got lengths "
                f"{query.shape[-2]} and {key.shape[-2]}; give each rank the query, key and value "
                "of its own tokens"
            )
        if dist.get_backend(ring.group) == "nccl" and query.device.type != "cuda":
            raise ValueError(
                f"a NCCL group sends CUDA tensors, got {query.device}; move the shards with "
                ".to('cuda') or use a gloo group for CPU tensors"
            )
        return call

    call = ring.agree_on(checked_call)
    query, key = normalize_for_similarity(call)
    lead, n, dv = query.shape[:-2], query.shape[-2], value.shape[-1]
    flat = [x.reshape(math.prod(lead), n, x.shape[-1]) for x in (query, key, value)]
    output = _RingAttention.apply(*flat, _Blocks(lead, causal, call.scale, ring))
    return output.reshape(*lead, n, dv).to(query.dtype)


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

    def agree_on(self, checked_call: Callable[[], AttentionCall]) -> AttentionCall:
        """``checked_call()`` on this rank, once every rank's call passed its checks and all
        hold shards of one shape, dtype and device type, with the same options; otherwise a
        ValueError on every rank."""
        try:
            call, problem = checked_call(), None
        except ValueError as error:
            call, problem = None, str(error)
        shard, options = (None, None) if call is None else (_shard(call), _options(call))
        reports: list[tuple[str | None, ...]] = [(None, None, None)] * self.size
        dist.all_gather_object(reports, (problem, shard, options), group=self.group)
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
                    f"{options}, rank {rank} has {other_options}; pass the same causal, "
                    "similarity and scale on every rank, and record gradients on all or none "
                    "(their backwards run together)"
                )
        return call

    def shift(self, blocks: list[Tensor], into: list[Tensor] | None = None) -> _Transfer:
        """Send ``blocks`` to the next rank and receive the previous rank's (into ``into``);
        in a ring of one, they stay."""
        if self.size == 1:
            return _Transfer([], blocks)
        received = into if into is not None else [torch.empty_like(b) for b in blocks]
        sends = [dist.P2POp(dist.isend, b, self.next_peer, self.group) for b in blocks]
        receives = [dist.P2POp(dist.irecv, b, self.previous_peer, self.group) for b in received]
        return _Transfer(dist.batch_isend_irecv(sends + receives), received)


def _shard(call: AttentionCall) -> str:
    """The shapes, dtype and device type that must match across ranks, as errors show them."""
    tensors = {"query": call.query, "key": call.key, "value": call.value}
    shapes = ", ".join(f"{name} {tuple(x.shape)}" for name, x in tensors.items())
    return f"{shapes} in {call.query.dtype} on {call.query.device.type}"


def _options(call: AttentionCall) -> str:
    """The options that must match across ranks, and whether this one records gradients."""
    records = torch.is_grad_enabled() and any(
        x.requires_grad for x in (call.query, call.key, call.value)
    )
    recording = "recording gradients" if records else "not recording gradients"
    return (
        f"causal={call.causal}, similarity={call.similarity!r}, scale={call.scale!r}, {recording}"
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
class _Blocks:
    """How this rank attends to one block of keys: which blocks it sees, masked how, in tiles."""

    lead: torch.Size
    causal: bool
    scale: float
    ring: _Ring

    def visible(self, source: int) -> bool:
        """Whether this rank's queries see any key of rank ``source``'s block."""
        return not self.causal or source <= self.ring.rank

    def masks(self, source: int) -> Masks:
        """The block's masking: the causal triangle on the diagonal block, nothing elsewhere."""
        diagonal = self.causal and source == self.ring.rank
        return Masks(self.lead, None, diagonal, has_bias=False)

    def block_q(self) -> int:
        """Query rows per tile, by chunked_attention's default rule (a tile of all heads)."""
        return default_block_q(self.lead, BLOCK_K)


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


def _ring_forward(
    query: Tensor, key: Tensor, value: Tensor, blocks: _Blocks
) -> tuple[Tensor, Tensor]:
    """Output (N, n, Dv) and natural log-sum-exp (N, n, 1), in the compute dtype."""
    compute = torch.float32 if query.dtype in REDUCED_PRECISION else query.dtype
    query = query.to(compute)
    output = lse = None
    for source, (key_block, value_block) in _around_the_ring([key, value], blocks.ring):
        if not blocks.visible(source):
            continue
        masks = blocks.masks(source)
        block_output, block_lse = tile_forward(
            query,
            key_block.to(compute),
            value_block.to(compute),
            None,
            masks,
            blocks.scale,
            blocks.block_q(),
            BLOCK_K,
        )
        block_lse = block_lse / masks.unit  # in base e, whatever the block's base
        if output is None:
            output, lse = block_output, block_lse
        else:
            output, lse = _merge(output, lse, block_output, block_lse)
    return output, lse


def _merge(
    output: Tensor, lse: Tensor, block_output: Tensor, block_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Two partial softmax outputs over disjoint keys as one, with their log-sum-exps."""
    block_share = torch.sigmoid(block_lse - lse)  # exp(block_lse - merged_lse)
    return output.add_((block_output - output).mul_(block_share)), torch.logaddexp(lse, block_lse)


def _ring_backward(
    grad_output: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    output: Tensor,
    lse: Tensor,
    blocks: _Blocks,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of this rank's query, key and value shards, in the compute dtype.

    The dK, dV of the block in hand are added to the sums that arrive with it (sent by the
    rank that had it before) and sent on; the last step sends them home."""
    compute = output.dtype
    query, grad_output = query.to(compute), grad_output.to(compute)
    grad_query = torch.zeros_like(query)
    sums_in_flight = None
    for source, (key_block, value_block) in _around_the_ring([key, value], blocks.ring):
        block_grads = None
        if blocks.visible(source):
            masks = blocks.masks(source)
            block_grad_query, *block_grads, _ = tile_backward(
                grad_output,
                query,
                key_block.to(compute),
                value_block.to(compute),
                None,
                output,
                lse * masks.unit,  # in the block's base
                masks,
                blocks.scale,
                blocks.block_q(),
                BLOCK_K,
                False,
            )
            grad_query += block_grad_query
        sums = block_grads  # at step 0, our own block: always visible
        if sums_in_flight is not None:
            sums = sums_in_flight.wait()
            if block_grads is not None:
                sums = [total + grad for total, grad in zip(sums, block_grads, strict=True)]
        sums_in_flight = blocks.ring.shift(sums)
    grad_key, grad_value = sums_in_flight.wait()  # our own block's, back from the last rank
    return grad_query, grad_key, grad_value


class _RingAttention(torch.autograd.Function):
    """Forward saves (query, key, value, output, lse); backward recomputes the weights."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        blocks: _Blocks,
    ) -> Tensor:
        output, lse = _ring_forward(query, key, value, blocks)
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.blocks = blocks
        return output

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor
    ) -> tuple[Tensor | None, ...]:
        query, key, value, output, lse = ctx.saved_tensors
        refuse_double_backward("ring", grad_output, query, key, value)
        grads = _ring_backward(grad_output, query, key, value, output, lse, ctx.blocks)
        return *(grad.to(x.dtype) for grad, x in zip(grads, (query, key, value), strict=True)), None
