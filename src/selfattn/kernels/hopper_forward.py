"""Attention forward for Hopper (sm_90) in Gluon, overlapping the softmax with the tensor cores.

The Triton forward (``triton_attention``) waits for each tile's QKᵀ before its softmax and for
the softmax before its PV, so within one warpgroup the exponentials (special-function units)
and the matrix products (tensor cores) take turns. Gluon, Triton's lower-level dialect, issues
wgmma asynchronously and says how many may stay in flight, which allows FlashAttention-3's
order within a warpgroup. Iteration j of the loop over key tiles::

    issue  S(j) = Q K(j)ᵀ                         tensor cores
    O *= exp2(m(j-2) - m(j-1))                      while S(j) runs
    issue  O += P(j-1) V(j-1)                       tensor cores, queued behind S(j)
    wait until S(j) is done                         PV(j-1) still runs
    m(j), P(j), row sums from S(j)                  special-function units, beside PV(j-1)
    wait until PV(j-1) is done

P(j-1) goes from float32 to the 16-bit A operand just before its PV is issued. Converting it
at the end of the iteration instead (FlashAttention-3's place) lets ``ptxas`` move the last
wait up above the exponentials, which then no longer overlap anything; with the conversion
where it is, all 32 exp2 per thread and tile sit between PV's issue and its wait in the SASS
(``benchmarks/triton_sm90.py`` reports this as "exp2 under wgmma").

Key and value tiles arrive by TMA into two rings of NUM_STAGES buffers, each with an
mbarrier; a key slot is refilled once its S is done, a value slot once its PV is done. The
output and the base-2 log-sum-exp per query are those of the Triton forward, so the Triton
backward kernels take them as they are.

Causal attention (bottom-right) runs the tiles the diagonal crosses in a second loop, which
masks every tile it visits; tiles wholly above the diagonal are not visited.

The ping-pong kernel (``_pingpong_kernel``) adds the rest of FlashAttention-3's layout, by
``gl.warp_specialize``: a loader partition issues every TMA load, into the rings, as the
warpgroups release slots (mbarriers with two arrivals each), and two warpgroups of 64 rows
each run the loop above, taking turns to issue their wgmma (two more mbarriers), so that
one's softmax runs while the other's matrix products do. ptxas keeps the exp2 under PV in
both warpgroups at D = 128 with 128-key tiles under a cap of 232 registers (with 240 it
moves the wait up), so that is the one ping-pong tiling offered.

Scope: the common cases, where no ragged edge needs masking: CUDA Hopper, float16 or
bfloat16, equal query and value head dims of 64 or 128, T and S multiples of 128, no mask;
causal when T <= S (so that every query sees a key). Inputs are contiguous (..., T, D), or
all three (B, H, T, D) views of contiguous (B, T, H, D) tensors (a layer's projections split
into heads), read in place: a head is then a column block of a (B·T, H·D) matrix. ``applies``
says whether a call is in it; everything else runs the Triton forward. Gluon has no CPU
interpreter, so this kernel is checked on a GPU only (``benchmarks/gpu_attention.py``) and
compiled for sm_90 on any machine (``benchmarks/triton_sm90.py``);
``triton_attention.forward_kernel`` keeps it off until then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Gluon renamed these after Triton 3.6; the GPU machine has 3.6, CI a newer release.
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

TILE_MULTIPLE = 128  # T and S must be multiples of this (every configuration's tiles divide it)
HEAD_DIMS = (64, 128)
# Registers per thread of a ping-pong warpgroup (setmaxnreg); the loader's warps get the rest.
# Not 240, which would spare its few spills: ptxas then moves PV's wait above the exp2.
PINGPONG_REGISTERS = gl.constexpr(232)
DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@dataclass(frozen=True)
class Config:
    """One tiling: query rows per warpgroup, keys per tile, TMA ring depth, whether the query
    block is kept in registers as wgmma's A operand, whether it is the ping-pong kernel (two
    warpgroups and a loader, ``_pingpong_kernel``), and the head dims it is offered for."""

    block_m: int
    block_n: int
    stages: int
    q_in_registers: bool
    pingpong: bool = False
    head_dims: tuple[int, ...] = HEAD_DIMS

    @property
    def rows(self) -> int:
        """Query rows per program."""
        return 2 * self.block_m if self.pingpong else self.block_m

    @property
    def num_warps(self) -> int:
        """The launch's warps: 4 per 64 rows; ping-pong, the loader's (its two warpgroups are
        ``warp_specialize``'s workers)."""
        return 4 if self.pingpong else self.block_m // 16

    def describe(self) -> str:
        rows = f"2x{self.block_m}" if self.pingpong else str(self.block_m)
        text = f"gluon BLOCK_M={rows} BLOCK_N={self.block_n} stages={self.stages}"
        text += " Q-in-registers" if self.q_in_registers else ""
        return text + (" ping-pong" if self.pingpong else "")


# 64 rows on one warpgroup: two programs share an SM and interleave their phases. 128 rows on
# two warpgroups: one program per SM, FlashAttention-3's consumers without its producer warp.
# Ping-pong: FlashAttention-3's whole layout, at D = 128 only: the one tiling in which ptxas
# keeps the exp2 under PV in both warpgroups (at D = 64 and with 64-key tiles it does not).
CONFIGS = (
    Config(64, 64, 2, True),
    Config(64, 64, 3, True),
    Config(128, 128, 2, False),
    Config(128, 64, 3, True),
    Config(64, 128, 2, False, pingpong=True, head_dims=(128,)),
)


def applies(query: Tensor, key: Tensor, value: Tensor, masked: bool, causal: bool) -> bool:
    """Whether this kernel can run the forward of these (..., T|S, D) tensors (see the
    module)."""
    t, s = query.shape[-2], key.shape[-2]
    within = in_scope((query, key, value), masked, causal)
    return within and t % TILE_MULTIPLE == 0 and s % TILE_MULTIPLE == 0


def in_scope(tensors: tuple[Tensor, ...], masked: bool, causal: bool) -> bool:
    """What the Gluon kernels (this and ``hopper_backward``) need of (query, key, value, ...):
    no mask, CUDA sm_90, one 16-bit dtype, head dims of 64 or 128 alike, T <= S when causal
    (else some rows would see no key), one layout of ``_layout``'s, 16-byte aligned."""
    query, key, value = tensors[:3]
    if masked or not query.is_cuda:
        return False
    if causal and query.shape[-2] > key.shape[-2]:
        return False
    if torch.cuda.get_device_capability(query.device) != (9, 0):  # wgmma is sm_90a only
        return False
    if query.dtype not in DTYPES or any(x.dtype != query.dtype for x in tensors):
        return False
    if query.shape[-1] not in HEAD_DIMS or value.shape[-1] != query.shape[-1]:
        return False
    layouts = {_layout(x) for x in tensors}
    aligned = all(x.data_ptr() % 16 == 0 for x in tensors)
    return aligned and len(layouts) == 1 and None not in layouts


def _layout(x: Tensor) -> str | None:
    """The layout name: "heads" for a contiguous (..., T, D) tensor, "interleaved" for a
    (B, H, T, D) view of a contiguous (B, T, H, D) one (a layer's projection split into
    heads), None for any other."""
    if x.is_contiguous():
        return "heads"
    if x.dim() == 4 and x.transpose(1, 2).is_contiguous():
        return "interleaved"
    return None


def _descriptor(tensor: Tensor, rows: int, interleaved: bool) -> TensorDescriptor:
    """A TMA descriptor of (rows, D) blocks over the tensor's memory as a matrix: (N·T, D)
    for the "heads" layout, (B·T, H·D) for "interleaved" (a head is then a column block)."""
    if interleaved:
        b, h, t, d = tensor.shape
        flat = tensor.transpose(1, 2).view(b * t, h * d)
    else:
        flat = tensor.view(-1, tensor.shape[-1])
    block = [rows, tensor.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, DTYPES[tensor.dtype])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout)


def hopper_forward(
    query: Tensor, key: Tensor, value: Tensor, causal: bool, qk_scale: float, config: Config
) -> tuple[Tensor, Tensor]:
    """Output (..., T, D) and base-2 log-sum-exp (N, T), N the leading dims' product, of
    softmax(QKᵀ·scale)V, causal (bottom-right) or not, where ``qk_scale`` is scale·log2(e)
    >= 0; the caller has checked ``applies``."""
    t, s = query.shape[-2], key.shape[-2]
    n = query.numel() // (t * query.shape[-1])
    interleaved = _layout(query) == "interleaved"  # and so are key and value (``applies``)
    out = torch.empty_like(query)  # the same layout, strides and all
    lse = torch.empty((n, t), dtype=torch.float32, device=query.device)
    kernel = _pingpong_kernel if config.pingpong else _forward_kernel
    kernel[(t // config.rows, n)](
        _descriptor(query, config.block_m, interleaved),
        _descriptor(key, config.block_n, interleaved),
        _descriptor(value, config.block_n, interleaved),
        _descriptor(out, config.block_m, interleaved),
        lse,
        t,
        s,
        qk_scale,
        query.shape[1] if interleaved else 1,
        CAUSAL=causal,
        INTERLEAVED=interleaved,
        NUM_STAGES=config.stages,
        Q_IN_REGISTERS=config.q_in_registers,
        num_warps=config.num_warps,
    )
    return out, lse


@gluon.jit
def _fetch(desc, row, col, bar, dest, pred):
    """Start the TMA copy of one tile into ``dest``; ``bar`` completes when its bytes land."""
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    _tma_load(desc, [row, col], bar, dest, pred=pred)


@gluon.jit
def _fetch_two(bar, pred, first_desc, first_at, first_dest, second_desc, second_at, second_dest):
    """Start the TMA copies of two tiles of one size (coordinates ``*_at``) on one barrier,
    which completes when both have landed."""
    mbarrier.expect(bar, 2 * first_desc.block_type.nbytes, pred=pred)
    _tma_load(first_desc, first_at, bar, first_dest, pred=pred)
    _tma_load(second_desc, second_at, bar, second_dest, pred=pred)


@gluon.jit
def _causal_mask(scores, tile, diagonal):
    """Scores of key tile ``tile`` with the keys each query may not see at -inf; ``diagonal``
    is the last key the block's first query sees."""
    BLOCK_M: gl.constexpr = scores.shape[0]
    BLOCK_N: gl.constexpr = scores.shape[1]
    row_layout: gl.constexpr = gl.SliceLayout(1, scores.type.layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, scores.type.layout)
    rows = gl.arange(0, BLOCK_M, layout=row_layout)
    cols = gl.arange(0, BLOCK_N, layout=col_layout)
    visible = tile * BLOCK_N + cols[None, :] <= diagonal + rows[:, None]
    return gl.where(visible, scores, float("-inf"))


@gluon.jit
def _take_turn(turns, turn, PINGPONG: gl.constexpr):
    """Ping-pong: wait until the other warpgroup has issued its wgmma for the turn before.
    ``turns`` is (this warpgroup's barrier, the other's, 1 for the first warpgroup, whose
    first wait, on parity 1 of a fresh barrier, passes at once; 0 for the second)."""
    if PINGPONG:
        mbarrier.wait(turns[0], (turn + turns[2]) & 1)


@gluon.jit
def _pass_turn(turns, PINGPONG: gl.constexpr):
    """Ping-pong: this warpgroup's wgmma for the turn are issued; the other may issue its."""
    if PINGPONG:
        mbarrier.arrive(turns[1])


@gluon.jit
def _release(
    desc, base_row, col, bars, free, ring, used, n_tiles, NUM_STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
):  # fmt: skip
    """Tile ``used`` is consumed. Ping-pong, tell the loader its slot is free; otherwise,
    once every warp is past it, load tile ``used + NUM_STAGES``, if there is one, into it."""
    slot = used % NUM_STAGES
    if PINGPONG:
        mbarrier.arrive(free.index(slot))
    else:
        _barrier()
        tile = used + NUM_STAGES
        row = base_row + tile * desc.block_type.shape[0]
        _fetch(desc, row, col, bars.index(slot), ring.index(slot), tile < n_tiles)


@gluon.jit
def _tiles(
    state,
    operands,
    lo,
    hi,
    n_tiles,
    diagonal,
    qk_scale,
    NUM_STAGES: gl.constexpr,
    MASKED: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """Key tiles ``lo`` to ``hi - 1`` in the overlapped order the module describes, each
    under the causal mask if MASKED (a loop of its own: a branch inside the loop would let
    ptxas undo the overlap). Takes and returns the running state: the output accumulator,
    the previous tile's weights, row maxima and sums, and the rescaling still owed; the
    operands are the query, the key and value rings with their barriers, and, ping-pong,
    the two warpgroups' turn barriers."""
    acc, weights, row_max, row_sum, alpha = state
    q, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_free, v_free, turns, kv_row, col = operands
    dtype: gl.constexpr = k_desc.dtype
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    s_layout: gl.constexpr = weights.type.layout
    no_scores = gl.zeros(weights.shape, gl.float32, s_layout)
    for j in range(lo, hi):
        slot = j % NUM_STAGES
        prev = (j - 1) % NUM_STAGES
        mbarrier.wait(k_bars.index(slot), (j // NUM_STAGES) & 1)
        _take_turn(turns, j, PINGPONG)
        tile_scores = warpgroup_mma(
            q, k_smem.index(slot).permute((1, 0)), no_scores, use_acc=False, is_async=True
        )
        acc = acc * alpha[:, None]  # to tile j-1's shift, while S(j) runs
        mbarrier.wait(v_bars.index(prev), ((j - 1) // NUM_STAGES) & 1)
        p = gl.convert_layout(weights.to(dtype), p_layout)
        acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        _pass_turn(turns, PINGPONG)
        tile_scores = warpgroup_mma_wait(1, deps=(tile_scores,))  # S(j) done; PV(j-1) runs on
        # This TMA issue, here, is what keeps ptxas from moving PV's wait above the exp2 below
        # (with nothing or a plain mbarrier arrive here, it does: docs/benchmarks.md). The
        # ping-pong warpgroups arrive here, and keep the order under a register cap instead.
        _release(k_desc, kv_row, col, k_bars, k_free, k_smem, j, n_tiles, NUM_STAGES, PINGPONG)
        if MASKED:
            tile_scores = _causal_mask(tile_scores, j, diagonal)

        new_max = gl.maximum(row_max, gl.max(tile_scores, axis=1) * qk_scale)
        tile_alpha = gl.exp2(row_max - new_max)
        weights = gl.exp2(tile_scores * qk_scale - new_max[:, None])
        row_sum = row_sum * tile_alpha + gl.sum(weights, axis=1)
        row_max = new_max
        alpha = gl.convert_layout(tile_alpha, o_rows)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        _release(v_desc, kv_row, col, v_bars, v_free, v_smem, j - 1, n_tiles, NUM_STAGES, PINGPONG)
    return acc, weights, row_max, row_sum, alpha


@gluon.constexpr_function
def _mma_layout(columns, num_warps):
    """The wgmma accumulator layout of a (rows, columns) tile, one warp per 16 rows."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, columns, 16]
    )


@gluon.jit
def _program_rows(T, S, H, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                  INTERLEAVED: gl.constexpr):  # fmt: skip
    """This program's first query, and where its rows start: in the log-sum-exp (N, T), in
    the query and output matrix, in the key and value matrix, and the head's first column.
    Causal, the longest rows go first: fewer programs still running at the end."""
    if CAUSAL:
        start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * ROWS
    else:
        start_m = gl.program_id(0) * ROWS
    head = gl.program_id(1)
    lse_row = head * T + start_m
    if INTERLEAVED:  # (B·T, H·D): a batch's rows, a head's columns
        q_row = (head // H) * T + start_m
        kv_row = (head // H) * S
        col = (head % H) * HEAD_DIM
    else:  # (N·T, D)
        q_row = lse_row
        kv_row = head * S
        col = 0
    return start_m, lse_row, q_row, kv_row, col


@gluon.jit
def _key_tiles(diagonal, S, rows, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """How many key tiles ``rows`` queries from ``diagonal`` on visit, and the first that needs
    the mask. Causal, query i sees keys j <= i + S - T, ``diagonal`` being the first query's
    last key; T <= S, so every row sees key 0."""
    if CAUSAL:
        n_tiles = gl.cdiv(gl.minimum(S, diagonal + rows), BLOCK_N)
        free = (diagonal + 1) // BLOCK_N
    else:
        n_tiles = S // BLOCK_N
        free = n_tiles
    return n_tiles, free


@gluon.jit
def _attend(
    q, rings, n_tiles, free, diagonal, qk_scale, turns, NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
):  # fmt: skip
    """One warpgroup's (or two's, in step) rows against key tiles 0 to ``n_tiles - 1``: tile
    0's scores, the loops of ``_tiles``, the last tile's PV. Returns the unnormalised output,
    the row maxima and the row sums."""
    k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_free, v_free, kv_row, col = rings
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = q.shape[0]
    dtype: gl.constexpr = k_desc.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, gl.num_warps())
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, gl.num_warps())
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    # Tile 0: scores, row maxima, weights. Its PV is issued in the loop's first iteration.
    mbarrier.wait(k_bars.index(0), 0)
    _take_turn(turns, 0, PINGPONG)
    no_scores = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    scores = warpgroup_mma(
        q, k_smem.index(0).permute((1, 0)), no_scores, use_acc=False, is_async=True
    )
    _pass_turn(turns, PINGPONG)
    scores = warpgroup_mma_wait(0, deps=(scores,))
    _release(k_desc, kv_row, col, k_bars, k_free, k_smem, 0, n_tiles, NUM_STAGES, PINGPONG)
    if CAUSAL:
        scores = _causal_mask(scores, 0, diagonal)
    row_max = gl.max(scores, axis=1) * qk_scale
    weights = gl.exp2(scores * qk_scale - row_max[:, None])
    row_sum = gl.sum(weights, axis=1)
    alpha = gl.full([BLOCK_M], 1.0, gl.float32, o_rows)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    state = (acc, weights, row_max, row_sum, alpha)
    operands = (q, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_free, v_free, turns,
                kv_row, col)  # fmt: skip
    unmasked = gl.minimum(free, n_tiles)
    state = _tiles(state, operands, 1, unmasked, n_tiles, diagonal, qk_scale, NUM_STAGES,
                   False, PINGPONG)  # fmt: skip
    state = _tiles(state, operands, gl.maximum(free, 1), n_tiles, n_tiles, diagonal, qk_scale,
                   NUM_STAGES, True, PINGPONG)  # fmt: skip
    acc, weights, row_max, row_sum, alpha = state

    acc = acc * alpha[:, None]
    last = (n_tiles - 1) % NUM_STAGES
    mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // NUM_STAGES) & 1)
    _take_turn(turns, n_tiles, PINGPONG)
    p = gl.convert_layout(weights.to(dtype), p_layout)
    acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    _pass_turn(turns, PINGPONG)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    return acc, gl.convert_layout(row_max, o_rows), gl.convert_layout(row_sum, o_rows)


@gluon.jit
def _finish(acc, row_max, row_sum, o_desc, out_smem, Lse, lse_row, q_row, col):
    """Store the normalised output through ``out_smem`` (the query's buffer, free by now) by
    TMA, and the base-2 log-sum-exp per query."""
    BLOCK_M: gl.constexpr = acc.shape[0]
    o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    gl.store(Lse + lse_row + gl.arange(0, BLOCK_M, layout=o_rows), row_max + gl.log2(row_sum))
    out_smem.store((acc / row_sum[:, None]).to(o_desc.dtype))
    fence_async_shared()
    _tma_store(o_desc, [q_row, col], out_smem)
    tma.store_wait(0)


@gluon.jit
def _init_barriers(count: gl.constexpr, bars):
    """Each of a column of mbarriers, expecting ``count`` arrivals per phase."""
    n: gl.constexpr = bars.shape[0]
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)


@gluon.jit
def _invalidate_barriers(bars):
    n: gl.constexpr = bars.shape[0]
    for i in gl.static_range(n):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _forward_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    Lse,
    T,
    S,
    qk_scale,
    H,
    CAUSAL: gl.constexpr,
    INTERLEAVED: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    Q_IN_REGISTERS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """One program: BLOCK_M queries of one head against all S keys, its warps loading the
    key and value tiles themselves (see the module)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, num_warps)
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)

    start_m, lse_row, q_row, kv_row, col = _program_rows(
        T, S, H, BLOCK_M, HEAD_DIM, CAUSAL, INTERLEAVED
    )
    diagonal = start_m + S - T
    n_tiles, free = _key_tiles(diagonal, S, BLOCK_M, BLOCK_N, CAUSAL)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    _init_barriers(1, k_bars)
    _init_barriers(1, v_bars)
    fence_async_shared()  # the barriers' initialisation, seen by the copy engine

    _fetch(q_desc, q_row, col, q_bar, q_smem, True)
    for i in gl.static_range(NUM_STAGES):
        ahead = i < n_tiles
        _fetch(k_desc, kv_row + i * BLOCK_N, col, k_bars.index(i), k_smem.index(i), ahead)
        _fetch(v_desc, kv_row + i * BLOCK_N, col, v_bars.index(i), v_smem.index(i), ahead)

    mbarrier.wait(q_bar, 0)
    q = q_smem.load(q_layout) if Q_IN_REGISTERS else q_smem
    rings = (k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_bars, v_bars, kv_row, col)
    no_turns = (q_bar, q_bar, 0)  # this program's warps refill the slots themselves
    acc, row_max, row_sum = _attend(
        q, rings, n_tiles, free, diagonal, qk_scale, no_turns, NUM_STAGES, CAUSAL, False
    )
    mbarrier.invalidate(q_bar)
    _invalidate_barriers(k_bars)
    _invalidate_barriers(v_bars)
    _finish(acc, row_max, row_sum, o_desc, q_smem, Lse, lse_row, q_row, col)


@gluon.jit
def _pingpong_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    Lse,
    T,
    S,
    qk_scale,
    H,
    CAUSAL: gl.constexpr,
    INTERLEAVED: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    Q_IN_REGISTERS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """One program: 2·BLOCK_M queries of one head, FlashAttention-3's layout: a loader
    partition fills the key and value rings by TMA; two warpgroups of BLOCK_M rows each run
    the overlapped loop, taking turns to issue their wgmma (see the module)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype

    start_m, lse_row, q_row, kv_row, col = _program_rows(
        T, S, H, 2 * BLOCK_M, HEAD_DIM, CAUSAL, INTERLEAVED
    )
    n_tiles, _ = _key_tiles(start_m + S - T, S, 2 * BLOCK_M, BLOCK_N, CAUSAL)

    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    _init_barriers(1, q_bar)
    _init_barriers(1, k_bars)
    _init_barriers(1, v_bars)
    _init_barriers(2, k_free)  # both warpgroups release each slot
    _init_barriers(2, v_free)
    _init_barriers(1, turns)
    fence_async_shared()  # the barriers' initialisation, seen by the copy engine

    rings = (k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_free, v_free, kv_row, col)
    common = (q_smem, q_bar, rings, o_desc, Lse, lse_row, q_row, start_m + S - T, n_tiles, S)
    first = (turns.index(0), turns.index(1), 1)  # (wait on, hand over on, parity shift)
    second = (turns.index(1), turns.index(0), 0)
    gl.warp_specialize(
        [
            (_loader, (q_desc, q_smem, q_bar, rings, q_row, n_tiles, NUM_STAGES)),
            (_warpgroup, (common, first, qk_scale, NUM_STAGES, CAUSAL, Q_IN_REGISTERS, 0)),
            (_warpgroup, (common, second, qk_scale, NUM_STAGES, CAUSAL, Q_IN_REGISTERS, 1)),
        ],
        [4, 4],
        [PINGPONG_REGISTERS, PINGPONG_REGISTERS],
    )
    _invalidate_barriers(q_bar)
    _invalidate_barriers(k_bars)
    _invalidate_barriers(v_bars)
    _invalidate_barriers(k_free)
    _invalidate_barriers(v_free)
    _invalidate_barriers(turns)


@gluon.jit
def _warpgroup(
    common,
    turns,
    qk_scale,
    NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    Q_IN_REGISTERS: gl.constexpr,
    HALF: gl.constexpr,
):
    """A ping-pong warpgroup: rows HALF·BLOCK_M to (HALF + 1)·BLOCK_M of the program's
    queries. Both run ``n_tiles`` turns (the program's; a causal first half masks its extra
    tiles away), so their hand-offs pair up."""
    q_smem, q_bar, rings, o_desc, Lse, lse_row, q_row, diagonal, n_tiles, S = common
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = rings[0].block_type.shape[0]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, gl.num_warps())
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    first_row = HALF * BLOCK_M
    diagonal = diagonal + first_row
    _, free = _key_tiles(diagonal, S, BLOCK_M, BLOCK_N, CAUSAL)
    mbarrier.wait(q_bar.index(0), 0)
    q_half = q_smem.index(HALF)
    q = q_half.load(q_layout) if Q_IN_REGISTERS else q_half
    acc, row_max, row_sum = _attend(
        q, rings, n_tiles, free, diagonal, qk_scale, turns, NUM_STAGES, CAUSAL, True
    )
    lse_row, q_row, col = lse_row + first_row, q_row + first_row, rings[9]
    _finish(acc, row_max, row_sum, o_desc, q_half, Lse, lse_row, q_row, col)


@gluon.jit
def _loader(q_desc, q_smem, q_bar, rings, q_row, n_tiles, NUM_STAGES: gl.constexpr):
    """The loader (four warps, one thread issuing): both query halves, then key tile j and
    value tile j - 1 in turn (a key is needed one iteration before the value of the same
    index), each into its ring slot once both warpgroups have released it."""
    k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_free, v_free, kv_row, col = rings
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    _fetch_two(q_bar.index(0), True, q_desc, [q_row, col], q_smem.index(0),
               q_desc, [q_row + BLOCK_M, col], q_smem.index(1))  # fmt: skip
    _produce(k_desc, kv_row, col, k_bars, k_free, k_smem, 0, NUM_STAGES)
    for j in range(1, n_tiles):
        _produce(k_desc, kv_row, col, k_bars, k_free, k_smem, j, NUM_STAGES)
        _produce(v_desc, kv_row, col, v_bars, v_free, v_smem, j - 1, NUM_STAGES)
    _produce(v_desc, kv_row, col, v_bars, v_free, v_smem, n_tiles - 1, NUM_STAGES)


@gluon.jit
def _produce(desc, base_row, col, bars, free, ring, tile, NUM_STAGES: gl.constexpr):
    """Load ``tile`` into its slot once the slot's previous tile is released (the first
    round's wait, on parity 1 of a fresh barrier, passes at once)."""
    slot = tile % NUM_STAGES
    mbarrier.wait(free.index(slot), ((tile // NUM_STAGES) & 1) ^ 1)
    row = base_row + tile * desc.block_type.shape[0]
    _fetch(desc, row, col, bars.index(slot), ring.index(slot), True)


__all__ = ["CONFIGS", "Config", "applies", "hopper_forward"]
