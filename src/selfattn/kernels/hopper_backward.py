"""Attention backward for Hopper (sm_90) in Gluon: dK, dV and, by atomic adds, dQ in one kernel.

The Triton backward either recomputes the weights in a second kernel for dQ (7 matrix
products per pair of tiles where 5 are counted) or adds dQ with atomics from its dK/dV
kernel, where Triton waits for each wgmma before the next instruction. This kernel issues
them asynchronously. One program holds BLOCK_N keys of one head (K and V in shared memory,
64 keys per warpgroup, dK and dV accumulated in registers) and walks the query tiles that
see them, BLOCK_M = 32 queries at a time, Q and dO arriving by TMA into a ring. Per query
tile, with Sᵀ laid out (keys, queries)::

    issue  Sᵀ = K Qᵀ,  dPᵀ = V dOᵀ
    wait for Sᵀ        Pᵀ = exp2(Sᵀ·scale·log2(e) - LSE)       dPᵀ still runs
    issue  dV += Pᵀ dO
    wait for dPᵀ       dSᵀ = Pᵀ ∘ (dPᵀ - Δ), to shared memory   dV still runs
    issue  dK += dSᵀ Q
    wait for dV        issue dQᵀ = Kᵀ dSᵀ (over the block's keys: every warpgroup's dSᵀ)
    wait for both      add scale · dQᵀ into a float32 dQ with atomics

dQ is computed transposed (FlashAttention-3's "swap AB") so that a 32-query tile fills the
wgmma's 64-row M with head-dim rows; 64-query tiles need more than 255 registers at D = 128.
Δ = rowsum(dO ∘ O) and the base-2 log-sum-exp are the Triton backward's (its preprocess
kernel and the forward), and so is the float32 dQ buffer, whose adds in a varying order make
dQ's last bits vary from run to run: ``torch.use_deterministic_algorithms(True)`` never runs
this kernel.

Causal attention (bottom-right) runs the query tiles the diagonal crosses in a first loop,
which masks each, and skips the tiles that see none of the block's keys.

Scope: CUDA Hopper, float16 or bfloat16, head dims 64 or 128 (equal for values), T a
multiple of 32 and S of 128, no mask, causal when T <= S; query, key, value and output
gradient all contiguous (..., T, D) or all (B, H, T, D) views of contiguous (B, T, H, D)
tensors (``hopper_forward``'s layouts). ``applies`` says whether a call is in it. Gluon has
no CPU interpreter: this kernel is checked on a GPU (``benchmarks/gpu_attention.py``),
which then lets ``triton_attention``'s "auto" backward plan time it against the others
(``triton_attention.gluon_backward``), and compiled for sm_90 anywhere
(``benchmarks/triton_sm90.py``).
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

from selfattn.kernels.hopper_forward import (
    _barrier,
    _descriptor,
    _fetch_two,
    _init_barriers,
    _invalidate_barriers,
    _layout,
    _mma_layout,
    _tma_store,
    in_scope,
)

BLOCK_M = 32  # queries per tile
KEY_MULTIPLE = 128  # S must be a multiple of this (every tiling's key block divides it)


@dataclass(frozen=True)
class Config:
    """One tiling: keys per program (64 per warpgroup of 4 warps), queries per tile, and how
    many query tiles are in flight."""

    block_n: int
    block_m: int = BLOCK_M
    stages: int = 2

    @property
    def num_warps(self) -> int:
        return self.block_n // 16

    def describe(self) -> str:
        return f"gluon backward BLOCK_N={self.block_n} BLOCK_M={self.block_m} stages={self.stages}"


# 128 keys on two warpgroups: one program per SM (registers), dQ summed over 128 keys before
# its atomic adds, two CTA barriers per tile between the warpgroups. 64 keys on one: two
# programs per SM that run unsynchronised, twice the atomic adds.
CONFIGS = (Config(128), Config(64))


def applies(
    query: Tensor, key: Tensor, value: Tensor, grad_out: Tensor, masked: bool, causal: bool
) -> bool:
    """Whether this kernel can run the backward of these (B, H, T|S, D) tensors (see the
    module)."""
    t, s = query.shape[-2], key.shape[-2]
    within = query.dim() == 4 and in_scope((query, key, value, grad_out), masked, causal)
    return within and t % BLOCK_M == 0 and s % KEY_MULTIPLE == 0


def hopper_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    lse: Tensor,
    delta: Tensor,
    grad_key: Tensor,
    grad_value: Tensor,
    causal: bool,
    scale: float,
    qk_scale: float,
    config: Config,
) -> Tensor:
    """Write dK and dV into ``grad_key`` and ``grad_value`` (laid out as key and value are)
    and return dQ as float32 (N, T, D), from the base-2 log-sum-exp and Δ (both (N, T)
    float32); ``qk_scale`` is scale·log2(e). The caller has checked ``applies``."""
    (batch, heads, t, head_dim), s = query.shape, key.shape[-2]
    interleaved = _layout(query) == "interleaved"  # and so are the others (``applies``)
    grad_query = torch.zeros((batch * heads, t, head_dim), dtype=torch.float32,
                             device=query.device)  # fmt: skip
    _backward_kernel[(s // config.block_n, batch * heads)](
        _descriptor(query, config.block_m, interleaved),
        _descriptor(key, config.block_n, interleaved),
        _descriptor(value, config.block_n, interleaved),
        _descriptor(grad_out, config.block_m, interleaved),
        _descriptor(grad_key, config.block_n, interleaved),
        _descriptor(grad_value, config.block_n, interleaved),
        lse,
        delta,
        grad_query,
        t,
        s,
        qk_scale,
        scale,
        heads,
        CAUSAL=causal,
        INTERLEAVED=interleaved,
        NUM_STAGES=config.stages,
        num_warps=config.num_warps,
    )
    return grad_query


@gluon.constexpr_function
def _dq_layout(head_dim, queries, num_warps):
    """The accumulator layout of a (D, queries) tile of dQᵀ: warps along D where D has 16 rows
    for each, else four along D and the rest along the queries."""
    if head_dim >= 16 * num_warps:
        return _mma_layout(queries, num_warps)
    across = num_warps // 4
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, across], instr_shape=[16, queries // across, 16]
    )


@gluon.jit
def _query_tiles(
    state, operands, lo, hi, n_tiles, first, diagonal, qk_scale, scale,
    NUM_STAGES: gl.constexpr, MASKED: gl.constexpr,
):  # fmt: skip
    """Query tiles ``lo`` to ``hi - 1`` in the order the module describes, each under the
    causal mask if MASKED (``diagonal``: key ``k`` of the block is visible to query ``i`` when
    k <= i + diagonal). Takes and returns dK and dV; the operands are the shared-memory
    blocks and the query ring (its slot counted from tile ``first``), the descriptors to
    refill it, the head's log-sum-exp, Δ and float32 dQ rows, the head's first row in the
    query matrix and its first column."""
    dk, dv = state
    (k_smem, v_smem, q_smem, do_smem, ds_smem, bars, q_desc, do_desc, lse_ptr, delta_ptr,
     dq_ptr, q_row, col) = operands  # fmt: skip
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.shape[1]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    dtype: gl.constexpr = k_smem.dtype
    num_warps: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, num_warps)  # (keys, queries)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    dq_layout: gl.constexpr = _dq_layout(HEAD_DIM, BLOCK_M, num_warps)  # dQᵀ: (D, queries)
    columns: gl.constexpr = gl.SliceLayout(0, s_layout)
    no_scores = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    no_dq = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, dq_layout)
    dq_dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, dq_layout))
    dq_queries = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, dq_layout))
    dq_offsets = dq_queries[None, :] * HEAD_DIM + dq_dims[:, None]
    for i in range(lo, hi):
        slot = (i - first) % NUM_STAGES
        mbarrier.wait(bars.index(slot), ((i - first) // NUM_STAGES) & 1)
        q_tile = q_smem.index(slot)
        do_tile = do_smem.index(slot)
        s_t = warpgroup_mma(k_smem, q_tile.permute((1, 0)), no_scores, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(
            v_smem, do_tile.permute((1, 0)), no_scores, use_acc=False, is_async=True
        )
        queries = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=columns)
        s_t = warpgroup_mma_wait(1, deps=(s_t,))
        p_t = gl.exp2(s_t * qk_scale - gl.load(lse_ptr + queries)[None, :])
        if MASKED:
            keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
            p_t = gl.where(keys[:, None] <= diagonal + queries[None, :], p_t, 0.0)
        p_a = gl.convert_layout(p_t.to(dtype), a_layout)
        dv = warpgroup_mma(p_a, do_tile, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t,))
        ds_t = (p_t * (dp_t - gl.load(delta_ptr + queries)[None, :])).to(dtype)
        ds_a = gl.convert_layout(ds_t, a_layout)
        dk = warpgroup_mma(ds_a, q_tile, dk, is_async=True)
        ds_smem.store(ds_t)
        fence_async_shared()
        _barrier()  # both warpgroups' dSᵀ, for dQᵀ over all the block's keys
        dv, p_a = warpgroup_mma_wait(1, deps=(dv, p_a))
        dq = warpgroup_mma(k_smem.permute((1, 0)), ds_smem, no_dq, use_acc=False, is_async=True)
        dk, dq, ds_a = warpgroup_mma_wait(0, deps=(dk, dq, ds_a))
        gl.atomic_add(dq_ptr + i * BLOCK_M * HEAD_DIM + dq_offsets, dq * scale, sem="relaxed")
        _barrier()  # every wgmma on this slot and on dSᵀ is done: refill, rewrite
        ahead = i + NUM_STAGES
        at = [q_row + ahead * BLOCK_M, col]
        _fetch_two(bars.index(slot), ahead < n_tiles, q_desc, at, q_smem.index(slot),
                   do_desc, at, do_smem.index(slot))  # fmt: skip
    return dk, dv


@gluon.jit
def _backward_kernel(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, DQ, T, S, qk_scale, scale, H,
    CAUSAL: gl.constexpr, INTERLEAVED: gl.constexpr, NUM_STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """One program: BLOCK_N keys of one head, every query tile that sees them (see the
    module)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype

    start_n = gl.program_id(0) * BLOCK_N
    head = gl.program_id(1)
    if INTERLEAVED:  # (B·T, H·D): a batch's rows, a head's columns
        q_row = (head // H) * T
        kv_row = (head // H) * S + start_n
        col = (head % H) * HEAD_DIM
    else:  # (N·T, D)
        q_row = head * T
        kv_row = head * S + start_n
        col = 0
    # Causal (bottom-right), query i sees key start_n + k when k <= i + diagonal: tiles from
    # `first` see some of the block's keys, those from `free` on all of them.
    diagonal = S - T - start_n
    n_tiles = T // BLOCK_M
    if CAUSAL:
        first = gl.maximum(-diagonal, 0) // BLOCK_M
        free = gl.cdiv(gl.minimum(gl.maximum(BLOCK_N - 1 - diagonal, 0), T), BLOCK_M)
    else:
        first = 0
        free = 0

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    _init_barriers(1, kv_bar)
    _init_barriers(1, bars)
    fence_async_shared()  # the barriers' initialisation, seen by the copy engine

    _fetch_two(kv_bar.index(0), True, k_desc, [kv_row, col], k_smem, v_desc, [kv_row, col],
               v_smem)  # fmt: skip
    for stage in gl.static_range(NUM_STAGES):
        tile = first + stage
        at = [q_row + tile * BLOCK_M, col]
        _fetch_two(bars.index(stage), tile < n_tiles, q_desc, at, q_smem.index(stage),
                   do_desc, at, do_smem.index(stage))  # fmt: skip
    mbarrier.wait(kv_bar.index(0), 0)

    kv_layout: gl.constexpr = _mma_layout(HEAD_DIM, num_warps)
    state = (
        gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout),
        gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout),
    )
    # DQ's offset in int64: N·T·D passes 2³¹ within an H200's memory (B 16, H 32, T 32,768).
    operands = (k_smem, v_smem, q_smem, do_smem, ds_smem, bars, q_desc, do_desc, Lse + head * T,
                Delta + head * T, DQ + head.to(gl.int64) * T * HEAD_DIM, q_row, col)  # fmt: skip
    unmasked = gl.maximum(free, first)
    state = _query_tiles(state, operands, first, unmasked, n_tiles, first, diagonal, qk_scale,
                         scale, NUM_STAGES, True)  # fmt: skip
    state = _query_tiles(state, operands, unmasked, n_tiles, n_tiles, first, diagonal, qk_scale,
                         scale, NUM_STAGES, False)  # fmt: skip
    dk, dv = state
    _invalidate_barriers(kv_bar)
    _invalidate_barriers(bars)

    k_smem.store((dk * scale).to(dtype))  # K and V's buffers, free by now
    v_smem.store(dv.to(dtype))
    fence_async_shared()
    _tma_store(dk_desc, [kv_row, col], k_smem)
    _tma_store(dv_desc, [kv_row, col], v_smem)
    tma.store_wait(0)


__all__ = ["CONFIGS", "Config", "applies", "hopper_backward"]
