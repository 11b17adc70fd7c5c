"""Fused attention in Triton, forward and backward, in the FlashAttention-2 way.

The forward pass never forms the (T, S) weights. Each program owns a block of queries and walks
over key tiles with the online softmax: it keeps the running row maximum and row sum, rescales
its output accumulator whenever the maximum grows, and at the end divides by the sum. It saves
one number per query, the log-sum-exp of the scaled scores (in base 2), from which the backward
pass recomputes any tile of weights exactly::

    weights[i, j] = exp2(scaled_log2[i, j] - lse[i])

The backward pass runs these kernels:

- ``_preprocess_kernel``: delta = rowsum(dO ∘ O), the term softmax's derivative subtracts;
- ``_dkdv_kernel``: one program per key block walks over query tiles and accumulates
  dV = Pᵀ dO and dK = scale · dSᵀ Q, where dS = P ∘ (dP - delta) and dP = dO Vᵀ;
- ``_dq_kernel``: one program per query block walks over key tiles and accumulates
  dQ = scale · dS K (the "split" plan), unless the dK/dV kernel already added each tile's
  scale · dS K into a float32 dQ with atomics (the "atomic" plan: fewer products, but dQ's
  rounding depends on the order of the adds). ``_backward_plan`` says which runs when.

Conventions are those of ``selfattn.attention``: a boolean mask's True means "may attend", a
float mask is added to the scaled scores, ``causal`` aligns bottom-right (query i sees keys
``j <= i + (S - T)``; key tiles entirely above that diagonal are never visited), and a fully
masked row gives output 0 and gradients 0 (its log-sum-exp is stored as +inf, so every
recomputed weight of that row is exp2(-inf) = 0).

Inputs are ``(outer, inner, T, D)`` views (the wrapper folds all but the last leading dim
into ``outer``; ``inner`` is usually the heads), with any strides: a (B, H, T, D) view of a
(B, T, H, D) projection is read where it lies, not copied.
The head dim is padded to a power of two (at least 16) with masked loads, so odd sizes such as
59 work. float16 and bfloat16 use tensor cores with float32 accumulation; float32 inputs use
exact (IEEE) float32 products, so they match the reference to rounding.

Each kernel is autotuned over tile shapes, warps and pipeline stages; the forward also over
plain loads or TMA (Hopper's copy engine, through in-kernel tensor descriptors, Triton 3.4+).
On Hopper the forward can instead run ``hopper_forward``, a Gluon kernel that overlaps the
softmax with the tensor cores, where it applies; ``forward_kernel`` says whether. The
backward likewise has ``hopper_backward`` as a third plan (``_backward_plan``).
Measured on an H200 (docs/benchmarks.md): 479 TFLOP/s forward and 378 backward at head dim
128, T = 16,384. ``benchmarks/triton_sm90.py`` compiles every configuration for Hopper on any
machine and reports registers, spills and wgmma use.

Ring attention (``kernels/ring.py``) attends one block of keys at a time and merges the blocks
by log-sum-exp; ``block_forward`` and ``block_backward`` run these kernels on one such block:
its output normalised over the block and its log-sum-exp, and the block's gradients given the
merged output and log-sum-exp of all blocks.

With ``TRITON_INTERPRET=1`` set before triton is imported, the same kernels run on CPU tensors
through Triton's interpreter; autotuning is then reduced to one small configuration so that
tests stay fast.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from functools import cache, partial
from types import ModuleType
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from selfattn.kernels.chunked import LOG2E, finite_bias, refuse_double_backward, unexpanded

MAX_HEAD_DIM = 256
# CUDA caps a grid's second axis at 65,535; the kernels put the heads (outer · inner) there, so
# more heads than that go in several launches (see ``triton_attention``).
MAX_GRID_HEADS = 65_535
MAX_HEAD_OFFSET = 2**31 - 1  # within a head, Q/K/V/O rows are addressed in int32
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OTHER_BACKENDS = "backend='sdpa', 'chunked' or 'explicit'"  # what a refusal points to
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Triton's interpreter holds bfloat16 tiles as the uint16 words of their bits (numpy has no
# bfloat16): its tl.dot multiplies those words as integers, and its casts to bfloat16 truncate.
# Under it, ``_dot`` widens bfloat16 tiles to float32 (exact; a GPU's MMA accumulates in float32
# too) and ``_narrow`` rounds to nearest even before the cast, as a GPU's conversion does, so
# that the interpreter computes what the GPU does. Compiled kernels are unchanged.
INTERPRETER_BFLOAT16 = tl.constexpr(INTERPRETING)

# In-kernel tensor descriptors (TMA) and the allocator they need arrived in Triton 3.4.
HAS_TENSOR_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")

MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2
SHARED_MEMORY_BUDGET = 200 * 1024  # bytes; Hopper has 228 KiB per SM, keep room for the rest


def _config(
    block_m: int,
    block_n: int,
    warps: int,
    stages: int,
    max_registers: int | None = None,
    **switches: bool,
) -> triton.Config:
    """A tiling; ``switches`` are compile-time choices: A_FROM_REGISTERS (every kernel), and
    the forward kernel's USE_TMA and LAZY. ``max_registers`` caps registers per thread, to fit
    one more program on an SM."""
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n, **switches},
        num_warps=warps,
        num_stages=stages,
        maxnreg=max_registers,
    )


def _forward_configs(interpreting: bool = INTERPRETING) -> list[triton.Config]:
    """Query blocks (BLOCK_M) of 64/128 against key tiles (BLOCK_N) of 64, with or without TMA
    loads (Hopper-class GPUs); the pruner drops what a GPU or a layout cannot do. Under the
    interpreter (``interpreting``, which tests may set either way), one small tiling: so too
    in the two backward kernels.

    What an H200 measured (docs/benchmarks.md) decided the tilings: 64 x 64 on 4 warps leads
    at head dim 128, 128 x 64 with TMA at 64. Key tiles of 128, warp specialisation (wrong
    results under Triton 3.6) and a loop that issues the next tile's products early all lost.
    Each tiling also comes with LAZY rescaling, and the TMA ones with both new switches
    (LAZY, A_FROM_REGISTERS), which are yet to be timed on a GPU; so is the last one, which
    caps registers so that three programs share an SM at head dim 128.
    """
    if interpreting:
        return [_config(16, 32, 4, 1, USE_TMA=False, LAZY=True, A_FROM_REGISTERS=True)]
    tilings = ((128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3))
    loads = [(*tiling, tma) for tiling in tilings for tma in (False, True)]
    loads.append((64, 64, 4, 2, False))
    capped = [(*tiling, None) for tiling in tilings]
    capped.append((64, 64, 4, 2, 168))  # 64 KiB, 168 registers: 3 programs per SM, not 2
    return [
        _config(*tiling, USE_TMA=tma, LAZY=lazy, A_FROM_REGISTERS=False)
        for *tiling, tma in loads
        for lazy in (False, True)
    ] + [_config(*tiling, USE_TMA=True, LAZY=True, A_FROM_REGISTERS=True) for tiling in capped]


def _dkdv_configs(interpreting: bool = INTERPRETING) -> list[triton.Config]:
    """Key blocks (BLOCK_N) of 64/128 against narrower query tiles (BLOCK_M) of 32/64.

    64 x 128 on 8 warps won on an H200 at both head dims, but at 128 causal it spills
    registers (benchmarks/triton_sm90.py); the next three do not, and they and the last three
    (keys and values as wgmma A operands from registers) are yet to be timed on a GPU. With
    its operands in registers, 64 x 128 spills hundreds of bytes, so it is not offered so.
    """
    if interpreting:
        return [_config(16, 32, 4, 1, A_FROM_REGISTERS=True)]
    tilings = ((64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 8, 3), (64, 64, 8, 3), (32, 64, 4, 3))
    return [_config(*tiling, A_FROM_REGISTERS=False) for tiling in tilings] + [
        _config(*tiling, A_FROM_REGISTERS=True)
        for tiling in ((32, 128, 8, 3), (64, 64, 8, 3), (32, 64, 4, 3))
    ]


def _dq_configs(interpreting: bool = INTERPRETING) -> list[triton.Config]:
    """Query blocks (BLOCK_M) of 64/128 against narrower key tiles (BLOCK_N) of 32/64; the
    last two with queries and output gradients as wgmma A operands from registers (untimed)."""
    if interpreting:
        return [_config(16, 32, 4, 1, A_FROM_REGISTERS=True)]
    tilings = ((128, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3))
    return [_config(*tiling, A_FROM_REGISTERS=False) for tiling in tilings] + [
        _config(*tiling, A_FROM_REGISTERS=True) for tiling in ((128, 64, 8, 3), (64, 64, 4, 3))
    ]


# Smaller tilings, for when none of a kernel's own fits a GPU's shared memory: head dims past
# 128 (Gemma's 256), float32 at 128, GPUs with 99 KiB per block (sm_86, sm_89, sm_120).
# (BLOCK_M, BLOCK_N, warps, stages); no TMA, no other switch.
SMALL_TILINGS = {
    "forward": ((64, 32, 4, 2), (64, 32, 4, 1), (32, 32, 4, 1)),
    "dk/dv": ((32, 64, 4, 2), (32, 64, 4, 1), (32, 32, 4, 1)),
    "dq": ((64, 32, 4, 2), (64, 32, 4, 1), (32, 32, 4, 1)),
}
SWITCHES_OFF = {
    "forward": {"USE_TMA": False, "LAZY": False, "A_FROM_REGISTERS": False},
    "dk/dv": {"A_FROM_REGISTERS": False},
    "dq": {"A_FROM_REGISTERS": False},
}
# The layout each kernel's shared-memory estimate assumes: (rows it keeps, rows it streams)
ROWS = {
    "forward": ("BLOCK_M", "BLOCK_N"),
    "dk/dv": ("BLOCK_N", "BLOCK_M"),
    "dq": ("BLOCK_M", "BLOCK_N"),
}


def small_configs(kernel: str) -> list[triton.Config]:
    """The kernel's smaller tilings (``SMALL_TILINGS``), as autotuning configurations."""
    return [_config(*tiling, **SWITCHES_OFF[kernel]) for tiling in SMALL_TILINGS[kernel]]


def shared_bytes(kernel: str, config: triton.Config, itemsize: int, width: int) -> int:
    """An estimate of the shared memory one program of ``kernel`` needs: the block it keeps
    (BLOCK_M queries or BLOCK_N keys) plus ``num_stages`` copies of the tile it streams, each
    ``width`` elements wide (the query and value head dims together). Not a bound: compiled
    (benchmarks/triton_sm90.py --capability), what the pruner keeps stays within each GPU's
    limit, in bfloat16 at head dim 256 for sm_80, sm_86 and sm_90 and at 64 and 128 for
    sm_90, though one tiling (dK/dV with atomic dQ on sm_90) takes 209 KiB for 160 estimated."""
    stationary, streamed = ROWS[kernel]
    rows = config.kwargs[stationary] + config.num_stages * config.kwargs[streamed]
    return rows * width * itemsize


def shared_memory_budget(tensor: Tensor) -> int:
    """Bytes of shared memory a program may take on the tensor's GPU: the device's limit per
    block (99 KiB on sm_86, 163 KiB on sm_80, 227 KiB on Hopper), at most
    SHARED_MEMORY_BUDGET; that budget itself under the interpreter."""
    if not tensor.is_cuda:
        return SHARED_MEMORY_BUDGET
    return min(SHARED_MEMORY_BUDGET, _device_shared_memory(tensor.device.index))


@cache
def _device_shared_memory(index: int) -> int:
    """The opt-in maximum of shared memory per block on CUDA device ``index``, in bytes (asked
    once: every call's ``unsupported_reason`` needs it)."""
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def _config_pruner(kernel: str) -> dict:
    """Autotune pruning: drops configurations these inputs, or this GPU, cannot run well.

    Gone are TMA where the layout or GPU does not allow it, 4-warp 128-row blocks for head
    dims of 128 and more (they spill registers), and tiles whose estimate (``shared_bytes``)
    passes the GPU's budget (``shared_memory_budget``, or ``budget`` where given: a GPU
    compiled for ahead of time). If none fits, the kernel's smaller tilings that do take
    their place, and if none of those does either, the smallest of them stays, for the launch
    to refuse (``unsupported_reason`` refuses such inputs first).
    """

    def prune(
        configs: list[triton.Config], named_args: dict, budget: int | None = None, **constexprs
    ) -> list:
        itemsize = named_args["Q"].element_size()
        width = constexprs["BLOCK_D"] + constexprs["BLOCK_DV"]
        budget = budget or shared_memory_budget(named_args["Q"])
        if not constexprs.get("TMA_OK", False):
            configs = [config for config in configs if not config.kwargs.get("USE_TMA")]
        if constexprs["BLOCK_DV"] >= 128:  # 4 warps can't hold 128 x 128 float32 and spill
            configs = [config for config in configs if not _spills(config)]
        size = partial(shared_bytes, kernel, itemsize=itemsize, width=width)
        small = small_configs(kernel)
        for candidates in (configs, small):
            kept = [config for config in candidates if size(config) <= budget]
            if kept:
                return kept
        return [min(small, key=size)]

    return {"early_config_prune": prune}


def _spills(config: triton.Config) -> bool:
    """A 128-query block on one warpgroup of 4 warps (with wide heads, it spills registers)."""
    return config.kwargs["BLOCK_M"] >= 128 and config.num_warps == 4


def _is_hopper(tensor: Tensor) -> bool:
    """Whether the tensor lives on a GPU with Hopper's copy engine (TMA)."""
    return tensor.is_cuda and torch.cuda.get_device_capability(tensor.device)[0] >= 9


def _tma_ok(*tensors: Tensor) -> bool:
    """Whether per-head (S, D) tensor descriptors can address these (N, S, D) tensors.

    The copy engine needs a unit last stride, 16-byte aligned rows and head starts, and rows
    that do not overlap (CUDA's tensor maps step at least a row's length from one row to the
    next: a key expanded along S, with row stride 0, is read without them). Under the
    interpreter (CPU tensors) the same layout rule applies, so tests can take this path.
    """
    if not HAS_TENSOR_DESCRIPTORS or not (INTERPRETING or _is_hopper(tensors[0])):
        return False
    for tensor in tensors:
        itemsize = tensor.element_size()
        if tensor.stride(-1) != 1 or tensor.data_ptr() % 16:
            return False
        if tensor.stride(-2) < tensor.shape[-1]:
            return False
        if any(stride * itemsize % 16 for stride in tensor.stride()[:-1]):
            return False
    return True


def _quick_bench(fn, quantiles):
    """Autotuning timer: shorter than Triton's default, enough to rank a handful of configs."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


TUNE_KEY = ["t_bucket", "s_bucket", "gpu", "HEAD_DIM", "VALUE_DIM", "CAUSAL", "MASK_KIND"]
# Integers Triton need not specialise on (by divisibility by 16): autotuning keys, and the head
# count that only indexes the mask. Otherwise 8 heads and 16 compile twice.
KEY_ONLY_INTS = ["inner", "t_bucket", "s_bucket", "gpu"]


def _length_bucket(length: int) -> int:
    """Lengths that share one autotuning result: up to 1,024, up to 4,096, and longer.

    Keying on exact lengths would re-tune at every step of a decode loop (S grows by one),
    and each bucket costs a few dozen timed launches; the buckets part short sequences, where
    the grid is small, from long ones, where the loop over tiles dominates.
    """
    return 1024 if length <= 1024 else 4096 if length <= 4096 else 16384


def _tuning_args(query: Tensor, key: Tensor) -> tuple[int, int, int]:
    """The launch arguments that only key the autotuner (``t_bucket``, ``s_bucket``, ``gpu``):
    the query and key lengths' buckets, and the GPU's index (-1 off CUDA). Each GPU tunes for
    itself: a tiling picked on one with 227 KiB of shared memory fails to launch on one with
    99, and the fastest differs between GPUs."""
    gpu = query.device.index if query.is_cuda else -1
    return _length_bucket(query.shape[-2]), _length_bucket(key.shape[-2]), gpu


# The kernels below keep their arguments grouped by tensor (pointer, then its strides) on shared
# lines, as Triton code usually is; one argument per line would triple their length.
# fmt: off


@triton.jit
def _head_start(base, head, inner, stride_outer, stride_inner):
    """Where head ``head`` starts in a tensor laid out (outer, inner, ...) with any strides:
    Q, K and V as the caller's (B, H, T, D) views (no copy for a transposed (B, T, H, D)), and
    the mask with its broadcast dims at stride 0."""
    return base + (head // inner) * stride_outer + (head % inner) * stride_inner


@triton.jit
def _computed(tile):
    """The tile, exactly (bar a zero's sign), but as a computed value.

    Triton stages a tile loaded straight from memory in shared memory and feeds it to wgmma
    from there; a computed one it keeps in registers as wgmma's A operand. A block a program
    loads once and multiplies with every tile it streams then costs registers instead of
    shared-memory bandwidth on every product (the A_FROM_REGISTERS switch).
    """
    return tile + 0.0


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """``tl.dot(a, b, acc)`` with float32 accumulation (see INTERPRETER_BFLOAT16)."""
    if INTERPRETER_BFLOAT16 and a.dtype == tl.bfloat16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _narrow(x, dtype: tl.constexpr):
    """The float32 tile ``x`` as ``dtype``, rounded to nearest even (INTERPRETER_BFLOAT16)."""
    if INTERPRETER_BFLOAT16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)  # round off the 16 bits the cast then drops
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _load(ptrs, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2-D tile, masking (with 0) only the axes that can run past the tensor."""
    if CHECK_ROWS and CHECK_COLS:
        return tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    elif CHECK_ROWS:
        return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    elif CHECK_COLS:
        return tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _mask_scores(s, mask_base, stride_mt, stride_ms, rows, cols, T, S,
                 CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK: tl.constexpr):
    """Apply the user mask, and on boundary tiles the causal and length limits, to base-2 scores.

    ``rows`` (query indices) and ``cols`` (key indices) are 2-D and broadcast against ``s``,
    so the same code serves scores laid out (queries, keys) and (keys, queries). Mask reads
    clamp their indices into range: rows or columns past the end only feed outputs that are
    never stored, or are set to -inf below.
    """
    if MASK_KIND != 0:
        # In int64: a (T, S) mask passes 2³¹ elements from T = S = 46,341 on.
        user = tl.load(mask_base + tl.minimum(rows, T - 1).to(tl.int64) * stride_mt
                       + tl.minimum(cols, S - 1).to(tl.int64) * stride_ms)
        if MASK_KIND == 1:
            s = tl.where(user != 0, s, float("-inf"))
        else:
            s = s + user.to(tl.float32) * 1.4426950408889634  # to base 2, like the scores
    if CHECK:
        keep = (rows < T) & (cols < S)
        if CAUSAL:
            keep = keep & (cols <= rows + (S - T))
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def _key_range(start_m, T, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr):
    """Key tiles a query block needs: [0, free) with no masking, [free, hi) with masking.

    Causal: the block's first query sees keys up to ``start_m + S - T``, so every query of
    the block sees the keys below that; its last query sees keys below
    ``start_m + BLOCK_M + S - T``, so tiles from there on are skipped.
    """
    if CAUSAL:
        hi = tl.minimum(S, start_m + BLOCK_M + S - T)
        free = tl.minimum(tl.maximum(start_m + 1 + S - T, 0), S)
    else:
        hi = S
        free = S
    return free // BLOCK_N * BLOCK_N, hi


@triton.jit
def _query_range(start_n, T, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr):
    """Query tiles a key block needs: [lo, mid) masked, [mid, full) unmasked, [tail, T) masked.

    Causal: key j is seen by queries ``i >= j - (S - T)``; queries from
    ``start_n + BLOCK_N - 1 - (S - T)`` on see every key of the block. Rows past the last full
    tile need the length check.
    """
    full = T // BLOCK_M * BLOCK_M
    if CAUSAL:
        lo = tl.maximum(start_n - (S - T), 0) // BLOCK_M * BLOCK_M
        seen_by_all = tl.maximum(start_n + BLOCK_N - 1 - (S - T), lo)
        mid = tl.minimum((seen_by_all + BLOCK_M - 1) // BLOCK_M * BLOCK_M, T)
    else:
        lo = 0
        mid = 0
    return lo, mid, full, tl.maximum(mid, full)


@triton.jit
def _key_tile(k_src, start_n, stride_ks, stride_kd, S,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              CHECK: tl.constexpr, USE_TMA: tl.constexpr):
    """Keys [start_n, start_n + BLOCK_N) as a (D, N) tile; rows past S read as 0."""
    if USE_TMA:
        return tl.trans(k_src.load([start_n, 0]))
    else:
        cols = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        return _load(k_src + offs_d[:, None] * stride_kd + cols[None, :] * stride_ks,
                     offs_d < HEAD_DIM, cols < S, BLOCK_D != HEAD_DIM, CHECK)


@triton.jit
def _value_tile(v_src, start_n, stride_vs, stride_vd, S,
                VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                CHECK: tl.constexpr, USE_TMA: tl.constexpr):
    """Values [start_n, start_n + BLOCK_N) as an (N, Dv) tile; rows past S read as 0."""
    if USE_TMA:
        return v_src.load([start_n, 0])
    else:
        cols = start_n + tl.arange(0, BLOCK_N)
        offs_dv = tl.arange(0, BLOCK_DV)
        return _load(v_src + cols[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                     cols < S, offs_dv < VALUE_DIM, CHECK, BLOCK_DV != VALUE_DIM)


@triton.jit
def _rescale(acc, row_sum, old_shift, shift):
    """Output accumulator and row sums, kept relative to ``old_shift``, moved to ``shift``."""
    correction = tl.math.exp2(old_shift - shift)
    return acc * correction[:, None], row_sum * correction


@triton.jit
def _absorb(acc, row_max, row_sum, scores, v, qk_scale,
            MASKED: tl.constexpr, LAZY: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one tile into the online softmax: new shift, rescaled sum and output, plus P V.

    ``scores`` are raw products q·k, scaled here, unless MASKED: then they are scaled, masked
    base-2 scores that may hold -inf. Unmasked, the row maximum is taken on the raw products
    and scaled once (``qk_scale`` >= 0, the wrapper sees to it), so scaling and shifting fuse
    into one multiply-add per score.

    ``row_max`` is the shift the weights are taken against: the row maximum so far, or with
    LAZY (unmasked tiles only) a stale one. The shift then moves only when some row of the
    block has outgrown it by more than 8 (weights up to 2⁸, harmless in float32 and in the
    half-precision P); otherwise the tile skips rescaling the output accumulator, a multiply
    per output element and most of the softmax's work besides exp2 (FlashAttention-4's trick).
    """
    if MASKED:
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row with nothing visible yet keeps max -inf; subtract 0 to avoid inf - inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        acc, row_sum = _rescale(acc, row_sum, row_max, shift)
        p = tl.math.exp2(scores - shift[:, None])
    else:
        tile_max = tl.max(scores, 1) * qk_scale
        new_max = tl.maximum(row_max, tile_max)
        if LAZY:
            if tl.max(tile_max - row_max, 0) > 8.0:
                acc, row_sum = _rescale(acc, row_sum, row_max, new_max)
            else:
                new_max = row_max
        else:
            acc, row_sum = _rescale(acc, row_sum, row_max, new_max)
        p = tl.math.exp2(scores * qk_scale - new_max[:, None])
    row_sum += tl.sum(p, 1)
    acc = _dot(_narrow(p, v.dtype), v, acc, PRECISION)
    return acc, new_max, row_sum


@triton.jit
def _forward_tiles(acc, row_max, row_sum, q, k_src, v_src, mask_base, rows, lo, hi,
                   stride_ks, stride_kd, stride_vs, stride_vd, stride_mt, stride_ms,
                   T, S, qk_scale,
                   HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK: tl.constexpr,
                   PRECISION: tl.constexpr, USE_TMA: tl.constexpr, LAZY: tl.constexpr):
    """Online softmax over the key tiles starting in [lo, hi); returns the updated state.

    ``k_src``/``v_src`` are per-head tensor descriptors with USE_TMA, else base pointers.
    """
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k_t = _key_tile(k_src, start_n, stride_ks, stride_kd, S,
                        HEAD_DIM, BLOCK_D, BLOCK_N, CHECK, USE_TMA)
        qk = _dot(q, k_t, None, PRECISION)  # (M, N)
        masked = CHECK or MASK_KIND != 0
        if masked:
            cols = start_n + tl.arange(0, BLOCK_N)
            qk = _mask_scores(qk * qk_scale, mask_base, stride_mt, stride_ms, rows[:, None],
                              cols[None, :], T, S, CAUSAL, MASK_KIND, CHECK)  # base 2
        v = _value_tile(v_src, start_n, stride_vs, stride_vd, S,
                        VALUE_DIM, BLOCK_DV, BLOCK_N, CHECK, USE_TMA)
        acc, row_max, row_sum = _absorb(acc, row_max, row_sum, qk, v, qk_scale, masked, LAZY,
                                        PRECISION)
    return acc, row_max, row_sum


# TMA_OK keys the tuning too: a TMA tiling tuned for one layout must not serve one without.
@triton.autotune(configs=_forward_configs(), key=[*TUNE_KEY, "TMA_OK"],
                 prune_configs_by=_config_pruner("forward"),
                 do_bench=_quick_bench)
@triton.jit(do_not_specialize=KEY_ONLY_INTS)
def _forward_kernel(Q, K, V, Mask, Out, Lse,
                    stride_qo, stride_qi, stride_qt, stride_qd,
                    stride_ko, stride_ki, stride_ks, stride_kd,
                    stride_vo, stride_vi, stride_vs, stride_vd,
                    stride_mo, stride_mi, stride_mt, stride_ms,
                    stride_oo, stride_oi, stride_ot, stride_od,
                    inner, T, S, qk_scale, t_bucket, s_bucket, gpu,
                    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, PRECISION: tl.constexpr,
                    TMA_OK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    USE_TMA: tl.constexpr, LAZY: tl.constexpr, A_FROM_REGISTERS: tl.constexpr):
    """One program: BLOCK_M queries of one head, all their keys; writes output and LSE.

    ``qk_scale`` is the scale times log2(e); ``t_bucket``, ``s_bucket`` and ``gpu`` only key
    the autotuner (``_tuning_args``).
    Key tiles that need no mask run first, in a loop of their own; the rest (the causal
    diagonal, the ragged end, or all of them under a user mask) follow with masking. The
    tuning switch USE_TMA (only where TMA_OK: unit last stride, 16-byte aligned rows, a
    Hopper-class GPU) reads query, key and value tiles through per-head tensor descriptors,
    i.e. the copy engine. The tuning switch LAZY lets unmasked tiles keep a stale shift
    (see ``_absorb``). A_FROM_REGISTERS keeps the query block in registers as the A operand
    of every QKᵀ wgmma, so each reads only the key tile from shared memory (half the bytes of
    a 64 x 64 x 16 step, which otherwise runs at shared memory's bandwidth limit); it costs 32
    registers a thread at head dim 128.
    """
    tl.static_assert(TMA_OK or not USE_TMA)
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_base = _head_start(Q, head, inner, stride_qo, stride_qi)
    k_src = _head_start(K, head, inner, stride_ko, stride_ki)
    v_src = _head_start(V, head, inner, stride_vo, stride_vi)
    if USE_TMA:  # rows past T or S, and columns past the head dims, read as 0
        q = tl.make_tensor_descriptor(q_base, shape=[T, HEAD_DIM], strides=[stride_qt, 1],
                                      block_shape=[BLOCK_M, BLOCK_D]).load([start_m, 0])
        k_src = tl.make_tensor_descriptor(k_src, shape=[S, HEAD_DIM], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_src, shape=[S, VALUE_DIM], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, BLOCK_DV])
    else:
        q = _load(q_base + rows[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                  rows < T, offs_d < HEAD_DIM, True, BLOCK_D != HEAD_DIM)  # (M, D)
    mask_base = _head_start(Mask, head, inner, stride_mo, stride_mi)
    if A_FROM_REGISTERS:
        q = _computed(q)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    free, hi = _key_range(start_m, T, S, BLOCK_M, BLOCK_N, CAUSAL)
    acc, row_max, row_sum = _forward_tiles(
        acc, row_max, row_sum, q, k_src, v_src, mask_base, rows, 0, free,
        stride_ks, stride_kd, stride_vs, stride_vd, stride_mt, stride_ms, T, S, qk_scale,
        HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV, BLOCK_N, CAUSAL, MASK_KIND, False,
        PRECISION, USE_TMA, LAZY)
    acc, row_max, row_sum = _forward_tiles(
        acc, row_max, row_sum, q, k_src, v_src, mask_base, rows, free, hi,
        stride_ks, stride_kd, stride_vs, stride_vd, stride_mt, stride_ms, T, S, qk_scale,
        HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV, BLOCK_N, CAUSAL, MASK_KIND, True,
        PRECISION, USE_TMA, LAZY)

    empty = row_sum == 0.0  # nothing visible: output 0, and +inf makes every weight exp2(-inf)
    row_sum = tl.where(empty, 1.0, row_sum)
    lse = tl.where(empty, float("inf"), row_max + tl.math.log2(row_sum))
    tl.store(Lse + head * T + rows, lse, mask=rows < T)
    out_base = _head_start(Out, head, inner, stride_oo, stride_oi)
    tl.store(out_base + rows[:, None] * stride_ot + offs_dv[None, :] * stride_od,
             _narrow(acc / row_sum[:, None], Out.dtype.element_ty),
             mask=(rows < T)[:, None] & (offs_dv < VALUE_DIM)[None, :])


@triton.jit
def _preprocess_kernel(Out, DOut, Delta,
                       stride_oo, stride_oi, stride_ot, stride_od,
                       stride_do, stride_di, stride_dt, stride_dd,
                       inner, T, VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
                       BLOCK_M: tl.constexpr):
    """delta[i] = sum_d O[i, d] * dO[i, d], in float32, for BLOCK_M queries of one head."""
    head = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    ok = (rows < T)[:, None] & (offs_dv < VALUE_DIM)[None, :]
    o = tl.load(_head_start(Out, head, inner, stride_oo, stride_oi)
                + rows[:, None] * stride_ot + offs_dv[None, :] * stride_od,
                mask=ok, other=0.0)
    do = tl.load(_head_start(DOut, head, inner, stride_do, stride_di) + rows[:, None] * stride_dt
                 + offs_dv[None, :] * stride_dd, mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + head * T + rows, delta, mask=rows < T)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, dq_base,
                cols, lo, hi,
                stride_qt, stride_qd, stride_dt, stride_dd, stride_mt, stride_ms,
                T, S, qk_scale, scale,
                HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK: tl.constexpr,
                PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """Accumulate dK, dV of one key block over the query tiles starting in [lo, hi).

    Scores are laid out (keys, queries), so the recomputed weights Pᵀ feed dV = Pᵀ dO directly.
    With ATOMIC_DQ, each tile's share of dQ, scale · dS K, is also added into the float32
    (T, BLOCK_D) rows at ``dq_base``, which other key blocks add to at the same time.
    """
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        q_t = _load(q_base + offs_d[:, None] * stride_qd + rows[None, :] * stride_qt,
                    offs_d < HEAD_DIM, rows < T, BLOCK_D != HEAD_DIM, CHECK)  # (D, M)
        if CHECK:
            lse = tl.load(lse_base + rows, mask=rows < T, other=0.0)
            delta = tl.load(delta_base + rows, mask=rows < T, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        s_t = _dot(k, q_t, None, PRECISION) * qk_scale  # (N, M), base 2
        s_t = _mask_scores(s_t, mask_base, stride_mt, stride_ms, rows[None, :], cols[:, None],
                           T, S, CAUSAL, MASK_KIND, CHECK)
        p_t = tl.math.exp2(s_t - lse[None, :])
        do = _load(do_base + rows[:, None] * stride_dt + offs_dv[None, :] * stride_dd,
                   rows < T, offs_dv < VALUE_DIM, CHECK, BLOCK_DV != VALUE_DIM)  # (M, Dv)
        dv = _dot(_narrow(p_t, do.dtype), do, dv, PRECISION)
        dp_t = _dot(v, tl.trans(do), None, PRECISION)  # (N, M)
        ds_t = _narrow(p_t * (dp_t - delta[None, :]), q_t.dtype)
        dk = _dot(ds_t, tl.trans(q_t), dk, PRECISION)
        if ATOMIC_DQ:
            # A partial block's keys past S read as 0, so their scores are 0 and, unmasked in
            # the middle tiles, their weight exp2(-lse) overflows for a row of low scores;
            # their dS rows would add inf · 0 = NaN to dQ (dK and dV never store them).
            ds_t = tl.where((cols < S)[:, None], ds_t, 0.0)
            dq = _dot(tl.trans(ds_t), k, None, PRECISION) * scale  # (M, D)
            dq_ptrs = dq_base + rows[:, None] * BLOCK_D + offs_d[None, :]
            if CHECK:
                tl.atomic_add(dq_ptrs, dq, mask=(rows < T)[:, None], sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.autotune(configs=_dkdv_configs(), key=[*TUNE_KEY, "ATOMIC_DQ"],
                 prune_configs_by=_config_pruner("dk/dv"),
                 reset_to_zero=["DQAcc"], do_bench=_quick_bench)
@triton.jit(do_not_specialize=KEY_ONLY_INTS)
def _dkdv_kernel(Q, K, V, Mask, DOut, Lse, Delta, DK, DV, DQAcc,
                 stride_gko, stride_gki, stride_gks, stride_gvo, stride_gvi, stride_gvs,
                 stride_qo, stride_qi, stride_qt, stride_qd,
                 stride_ko, stride_ki, stride_ks, stride_kd,
                 stride_vo, stride_vi, stride_vs, stride_vd,
                 stride_mo, stride_mi, stride_mt, stride_ms,
                 stride_do, stride_di, stride_dt, stride_dd,
                 inner, T, S, qk_scale, scale, t_bucket, s_bucket, gpu,
                 HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, PRECISION: tl.constexpr,
                 ATOMIC_DQ: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, A_FROM_REGISTERS: tl.constexpr):
    """One program: BLOCK_N keys of one head, all the queries that see them; writes dK, dV.

    With ATOMIC_DQ it also adds its share of dQ into DQAcc, float32 (N, T, BLOCK_D), zeroed
    by the caller; without, DQAcc is unused and the dQ kernel computes dQ on its own.
    A_FROM_REGISTERS: the key and value blocks, the A operands of Sᵀ = K Qᵀ and dPᵀ = V dOᵀ,
    stay in registers.
    """
    start_n = tl.program_id(0) * BLOCK_N
    head = tl.program_id(1).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    k_base = _head_start(K, head, inner, stride_ko, stride_ki)
    v_base = _head_start(V, head, inner, stride_vo, stride_vi)
    k = _load(k_base + cols[:, None] * stride_ks + offs_d[None, :] * stride_kd,
              cols < S, offs_d < HEAD_DIM, True, BLOCK_D != HEAD_DIM)  # (N, D)
    v = _load(v_base + cols[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
              cols < S, offs_dv < VALUE_DIM, True, BLOCK_DV != VALUE_DIM)  # (N, Dv)
    if A_FROM_REGISTERS:
        k = _computed(k)
        v = _computed(v)
    q_base = _head_start(Q, head, inner, stride_qo, stride_qi)
    do_base = _head_start(DOut, head, inner, stride_do, stride_di)
    mask_base = _head_start(Mask, head, inner, stride_mo, stride_mi)
    lse_base = Lse + head * T
    delta_base = Delta + head * T
    dq_base = DQAcc + head * T * BLOCK_D

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, mid, full, tail = _query_range(start_n, T, S, BLOCK_M, BLOCK_N, CAUSAL)
    dk, dv = _dkdv_tiles(
        dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, dq_base, cols, lo, mid,
        stride_qt, stride_qd, stride_dt, stride_dd, stride_mt, stride_ms, T, S, qk_scale, scale,
        HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV, BLOCK_M, CAUSAL, MASK_KIND, True, PRECISION,
        ATOMIC_DQ)
    dk, dv = _dkdv_tiles(
        dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, dq_base, cols, mid, full,
        stride_qt, stride_qd, stride_dt, stride_dd, stride_mt, stride_ms, T, S, qk_scale, scale,
        HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV, BLOCK_M, CAUSAL, MASK_KIND, False, PRECISION,
        ATOMIC_DQ)
    dk, dv = _dkdv_tiles(
        dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, dq_base, cols, tail, T,
        stride_qt, stride_qd, stride_dt, stride_dd, stride_mt, stride_ms, T, S, qk_scale, scale,
        HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV, BLOCK_M, CAUSAL, MASK_KIND, True, PRECISION,
        ATOMIC_DQ)

    # dK and dV are written in the layout of K and V (unit last stride).
    key_ok = (cols < S)[:, None]
    dk_base = _head_start(DK, head, inner, stride_gko, stride_gki)
    dv_base = _head_start(DV, head, inner, stride_gvo, stride_gvi)
    tl.store(dk_base + cols[:, None] * stride_gks + offs_d[None, :],
             _narrow(dk * scale, DK.dtype.element_ty), mask=key_ok & (offs_d < HEAD_DIM)[None, :])
    tl.store(dv_base + cols[:, None] * stride_gvs + offs_dv[None, :],
             _narrow(dv, DV.dtype.element_ty), mask=key_ok & (offs_dv < VALUE_DIM)[None, :])


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_base, v_base, mask_base, rows, lo, hi,
              stride_ks, stride_kd, stride_vs, stride_vd, stride_mt, stride_ms,
              T, S, qk_scale,
              HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK: tl.constexpr,
              PRECISION: tl.constexpr):
    """Accumulate dQ of one query block over the key tiles starting in [lo, hi)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k_t = _load(k_base + offs_d[:, None] * stride_kd + cols[None, :] * stride_ks,
                    offs_d < HEAD_DIM, cols < S, BLOCK_D != HEAD_DIM, CHECK)  # (D, N)
        v_t = _load(v_base + offs_dv[:, None] * stride_vd + cols[None, :] * stride_vs,
                    offs_dv < VALUE_DIM, cols < S, BLOCK_DV != VALUE_DIM, CHECK)  # (Dv, N)
        s = _dot(q, k_t, None, PRECISION) * qk_scale  # (M, N), base 2
        s = _mask_scores(s, mask_base, stride_mt, stride_ms, rows[:, None], cols[None, :],
                         T, S, CAUSAL, MASK_KIND, CHECK)
        p = tl.math.exp2(s - lse[:, None])
        dp = _dot(do, v_t, None, PRECISION)  # (M, N)
        ds = p * (dp - delta[:, None])
        dq = _dot(_narrow(ds, k_t.dtype), tl.trans(k_t), dq, PRECISION)
    return dq


@triton.autotune(configs=_dq_configs(), key=TUNE_KEY,
                 prune_configs_by=_config_pruner("dq"),
                 do_bench=_quick_bench)
@triton.jit(do_not_specialize=KEY_ONLY_INTS)
def _dq_kernel(Q, K, V, Mask, DOut, Lse, Delta, DQ,
               stride_gqo, stride_gqi, stride_gqt,
               stride_qo, stride_qi, stride_qt, stride_qd,
               stride_ko, stride_ki, stride_ks, stride_kd,
               stride_vo, stride_vi, stride_vs, stride_vd,
               stride_mo, stride_mi, stride_mt, stride_ms,
               stride_do, stride_di, stride_dt, stride_dd,
               inner, T, S, qk_scale, scale, t_bucket, s_bucket, gpu,
               HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, A_FROM_REGISTERS: tl.constexpr):
    """One program: BLOCK_M queries of one head, all the keys they see; writes dQ.

    A_FROM_REGISTERS: the query and output-gradient blocks, the A operands of S = Q Kᵀ and
    dP = dO Vᵀ, stay in registers.
    """
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_base = _head_start(Q, head, inner, stride_qo, stride_qi)
    q = _load(q_base + rows[:, None] * stride_qt + offs_d[None, :] * stride_qd,
              rows < T, offs_d < HEAD_DIM, True, BLOCK_D != HEAD_DIM)  # (M, D)
    do = _load(_head_start(DOut, head, inner, stride_do, stride_di) + rows[:, None] * stride_dt
               + offs_dv[None, :] * stride_dd,
               rows < T, offs_dv < VALUE_DIM, True, BLOCK_DV != VALUE_DIM)  # (M, Dv)
    if A_FROM_REGISTERS:
        q = _computed(q)
        do = _computed(do)
    lse = tl.load(Lse + head * T + rows, mask=rows < T, other=float("inf"))
    delta = tl.load(Delta + head * T + rows, mask=rows < T, other=0.0)
    k_base = _head_start(K, head, inner, stride_ko, stride_ki)
    v_base = _head_start(V, head, inner, stride_vo, stride_vi)
    mask_base = _head_start(Mask, head, inner, stride_mo, stride_mi)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    free, hi = _key_range(start_m, T, S, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_tiles(
        dq, q, do, lse, delta, k_base, v_base, mask_base, rows, 0, free,
        stride_ks, stride_kd, stride_vs, stride_vd, stride_mt, stride_ms, T, S, qk_scale,
        HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV, BLOCK_N, CAUSAL, MASK_KIND, False, PRECISION)
    dq = _dq_tiles(
        dq, q, do, lse, delta, k_base, v_base, mask_base, rows, free, hi,
        stride_ks, stride_kd, stride_vs, stride_vd, stride_mt, stride_ms, T, S, qk_scale,
        HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV, BLOCK_N, CAUSAL, MASK_KIND, True, PRECISION)

    # dQ is written in the layout of Q (unit last stride).
    dq_base = _head_start(DQ, head, inner, stride_gqo, stride_gqi)
    tl.store(dq_base + rows[:, None] * stride_gqt + offs_d[None, :],
             _narrow(dq * scale, DQ.dtype.element_ty),
             mask=(rows < T)[:, None] & (offs_d < HEAD_DIM)[None, :])


# fmt: on


def _block_dim(size: int) -> int:
    """The tile width for a head dim: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(size))


def _shape_args(query: Tensor, value: Tensor, causal: bool, mask_kind: int) -> dict:
    """The compile-time arguments every kernel shares."""
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    return {
        "HEAD_DIM": head_dim,
        "VALUE_DIM": value_dim,
        "BLOCK_D": _block_dim(head_dim),
        "BLOCK_DV": _block_dim(value_dim),
        "CAUSAL": causal,
        "MASK_KIND": mask_kind,
        "PRECISION": "ieee" if query.dtype == torch.float32 else "tf32",
    }


def _mask_strides(mask: Tensor | None) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0) if mask is None else tuple(mask.stride())


def _forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    inner: int,
    mask_kind: int,
    causal: bool,
    scale: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the Triton forward kernel (autotuned) on (outer, inner, T, D) inputs; returns
    the output (outer, inner, T, Dv), laid out as the query, in ``out_dtype`` (by default the
    input's; the kernel rounds its float32 result to it), and the LSE (outer · inner, T)."""
    n, t = query.shape[0] * query.shape[1], query.shape[2]
    s, value_dim = key.shape[2], value.shape[3]
    out = _empty_heads(query, value_dim, out_dtype)
    lse = torch.empty((n, t), dtype=torch.float32, device=query.device)
    tma_ok = _tma_ok(query, key, value)
    if tma_ok and not INTERPRETING:
        _ensure_allocator()
    grid = lambda meta: (triton.cdiv(t, meta["BLOCK_M"]), n)  # noqa: E731
    _forward_kernel[grid](
        query,
        key,
        value,
        query if mask is None else mask,
        out,
        lse,
        *query.stride(),
        *key.stride(),
        *value.stride(),
        *_mask_strides(mask),
        *out.stride(),
        inner,
        t,
        s,
        scale * LOG2E,
        *_tuning_args(query, key),
        TMA_OK=tma_ok,
        **_shape_args(query, value, causal, mask_kind),
    )
    return out, lse


def _chosen_forward(
    triton_forward: Callable[[], tuple[Tensor, Tensor]],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    mask_kind: int,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Run the forward kernel ``forward_kernel`` picks: ``triton_forward`` (``_forward`` with
    its arguments bound) or a Gluon tiling; returns what ``_forward`` does."""
    kernels = {"triton": triton_forward}
    if forward_kernel != "triton":
        kernels.update(_gluon_forwards(query, key, value, mask, causal, scale))
    tuning = _tuning_args(query, key)
    shape_key = ("forward", query.dtype, *tuning, query.shape[-1], causal, mask_kind)
    return kernels[_forward_choice(shape_key, kernels)]()


def _gluon_module(name: str, tensor: Tensor) -> ModuleType | None:
    """A module of Gluon kernels for Hopper (``hopper_forward``, ``hopper_backward``) if a call
    on ``tensor`` may use it: on CUDA, not under the interpreter, with a Triton that has
    Gluon's Hopper support."""
    if INTERPRETING or not tensor.is_cuda:
        return None
    try:
        return importlib.import_module(f"selfattn.kernels.{name}")
    except ImportError:
        return None


def _gluon_forwards(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> dict[str, Callable[[], tuple[Tensor, Tensor]]]:
    """Hopper's Gluon forward (``hopper_forward``), one entry per tiling, where it applies."""
    hopper_forward = _gluon_module("hopper_forward", query)
    if hopper_forward is None or not hopper_forward.applies(
        query, key, value, mask is not None, causal
    ):
        return {}
    return {
        config.describe(): partial(
            hopper_forward.hopper_forward, query, key, value, causal, scale * LOG2E, config
        )
        for config in hopper_forward.CONFIGS
        if query.shape[-1] in config.head_dims
    }


def _empty_heads(like: Tensor, last_dim: int, dtype: torch.dtype | None = None) -> Tensor:
    """An empty (outer, inner, T, last_dim) tensor laid out as ``like`` is: T outside the heads
    when ``like`` is a (B, T, H, D) projection seen as (B, H, T, D), so that the caller's
    transpose back to (B, T, H·D) is a view, as it is with torch's SDPA; contiguous otherwise.
    In ``dtype``, by default ``like``'s."""
    outer, inner, t, _ = like.shape
    if _interleaved(like):
        return like.new_empty((outer, t, inner, last_dim), dtype=dtype).transpose(1, 2)
    return like.new_empty((outer, inner, t, last_dim), dtype=dtype)


def _interleaved(heads: Tensor) -> bool:
    """Whether (..., H, T, D) heads are a (..., T, H, D) projection seen through a transpose."""
    return heads.dim() > 2 and heads.shape[-3] > 1 and heads.stride(-3) < heads.stride(-2)


def _span(heads: Tensor) -> int:
    """The farthest element of one head of (..., T, D) ``heads`` from the head's first one:
    the kernels address rows within a head in int32."""
    rows, width = heads.shape[-2:]
    return (rows - 1) * abs(heads.stride(-2)) + (width - 1) * abs(heads.stride(-1))


def _largest_offset(heads: Tensor, written_width: int) -> int:
    """The span of one head (``_span``) of ``heads`` and of an output or gradient
    ``written_width`` wide laid out like it (``_empty_heads``), whichever is larger."""
    rows = heads.shape[-2]
    written_row = heads.shape[-3] * written_width if _interleaved(heads) else written_width
    return max(_span(heads), (rows - 1) * written_row + written_width - 1)


def _device_scratch(size: int, alignment: int, stream: int | None) -> Tensor:
    """Global memory Triton asks for at launch: here, room for in-kernel tensor descriptors."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Give Triton an allocator for in-kernel tensor descriptors, unless the user set one.
    Triton holds it in a ContextVar, or in earlier releases a plain module variable."""
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    if isinstance(current, ContextVar):
        current = current.get()
    if current is None or isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_device_scratch)


def _backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    inner: int,
    mask_kind: int,
    causal: bool,
    scale: float,
    grad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward kernels of the chosen plan; returns dQ, dK, dV shaped like the inputs
    (outer, inner, T|S, D), in ``grad_dtype`` (by default the inputs'; the kernels round their
    float32 sums to it). ``out`` may be in any float dtype (only Δ reads it); ``grad_out`` must
    be in the inputs' (it multiplies them)."""
    grad_dtype = query.dtype if grad_dtype is None else grad_dtype
    n, t = query.shape[0] * query.shape[1], query.shape[2]
    s, value_dim = key.shape[2], value.shape[3]
    shape_args = _shape_args(query, value, causal, mask_kind)
    tuning = _tuning_args(query, key)
    mask_arg = query if mask is None else mask

    delta = torch.empty((n, t), dtype=torch.float32, device=query.device)
    block_rows = 16 if INTERPRETING else 64
    _preprocess_kernel[(triton.cdiv(t, block_rows), n)](
        out,
        grad_out,
        delta,
        *out.stride(),
        *grad_out.stride(),
        inner,
        t,
        VALUE_DIM=value_dim,
        BLOCK_DV=shape_args["BLOCK_DV"],
        BLOCK_M=block_rows,
    )

    common = (
        *query.stride(),
        *key.stride(),
        *value.stride(),
        *_mask_strides(mask),
        *grad_out.stride(),
        inner,
        t,
        s,
        scale * LOG2E,
        scale,
        *tuning,
    )
    tensors = (query, key, value, mask_arg, grad_out, lse, delta)

    gluon = {}  # Hopper's Gluon kernel, by tiling, where it may run and applies
    # It writes dK and dV in the inputs' dtype only (through TMA descriptors of that type).
    if (backward_plan == "gluon" or gluon_backward) and grad_dtype == query.dtype:
        hopper_backward = _gluon_module("hopper_backward", query)
        if hopper_backward is not None and hopper_backward.applies(
            query, key, value, grad_out, mask is not None, causal
        ):
            gluon = {config.describe(): config for config in hopper_backward.CONFIGS}

    def run(plan: str) -> tuple[Tensor, Tensor, Tensor]:
        grad_key = _empty_heads(key, key.shape[-1], grad_dtype)
        grad_value = _empty_heads(value, value_dim, grad_dtype)
        grad_query = _empty_heads(query, query.shape[-1], grad_dtype)
        grad_strides = (*grad_key.stride()[:3], *grad_value.stride()[:3])
        if plan in gluon:
            dq = hopper_backward.hopper_backward(
                grad_out, query, key, value, lse, delta, grad_key, grad_value, causal, scale,
                scale * LOG2E, gluon[plan],
            )  # fmt: skip
        else:
            atomic = plan == "atomic"
            dq_shape = (n, t, shape_args["BLOCK_D"]) if atomic else (0,)  # unused when split
            dq = torch.zeros(dq_shape, dtype=torch.float32, device=query.device)
            _dkdv_kernel[lambda meta: (triton.cdiv(s, meta["BLOCK_N"]), n)](
                *tensors, grad_key, grad_value, dq, *grad_strides, *common, ATOMIC_DQ=atomic,
                **shape_args,
            )  # fmt: skip
            if not atomic:
                _dq_kernel[lambda meta: (triton.cdiv(t, meta["BLOCK_M"]), n)](
                    *tensors, grad_query, *grad_query.stride()[:3], *common, **shape_args
                )
                return grad_query, grad_key, grad_value
        grad_query.copy_(dq[..., : query.shape[-1]].view(query.shape))
        return grad_query, grad_key, grad_value

    tune_key = ("backward", query.dtype, *tuning, *shape_args.values())
    return run(_backward_plan(tune_key, run, tuple(gluon)))


FORWARD_KERNELS = ("triton", "gluon", "auto")
forward_kernel = "triton"  # see _forward_choice
BACKWARD_PLANS = ("split", "atomic")  # the Triton kernels' plans; "gluon" is Hopper's kernel
backward_plan = "auto"  # or "split", "atomic", "gluon", to force it (benchmarks, tests)
gluon_backward = False  # whether "auto" also times the Gluon backward (see _backward_plan)
# The timed choices' measurements, ms per candidate, by ("forward" or "backward", dtype,
# *_tuning_args, *shape args).
plan_timings: dict[tuple, dict[str, float]] = {}


def _fastest(tune_key: tuple, runs: dict[str, Callable[[], object]]) -> str:
    """The name of the fastest of ``runs``: each is timed on the first call for ``tune_key``
    (a shape bucket), and the timings are kept in ``plan_timings`` for the next calls."""
    if tune_key not in plan_timings:
        plan_timings[tune_key] = {name: _quick_bench(run, None) for name, run in runs.items()}
    timings = plan_timings[tune_key]
    return min(timings, key=timings.get)


def _forward_choice(shape_key: tuple, kernels: dict[str, Callable[[], object]]) -> str:
    """Which forward kernel runs: "triton", or a tiling of the Gluon kernel for Hopper.

    ``forward_kernel`` decides: "triton" (the default) always runs the Triton kernel; "gluon"
    runs the Gluon kernel's first tiling wherever it applies (``hopper_forward.applies``);
    "auto" times the Triton kernel and every Gluon tiling on the first call of each shape
    bucket (``shape_key``) with the same candidates and keeps the fastest. The Gluon kernel
    has no CPU interpreter, so it stays off by default until it has been checked on a GPU
    (``benchmarks/gpu_attention.py`` does that, then times it under "auto").
    """
    if forward_kernel not in FORWARD_KERNELS:
        choices = ", ".join(FORWARD_KERNELS)
        raise ValueError(f"forward_kernel is one of {choices}, not {forward_kernel!r}")
    gluon = [name for name in kernels if name != "triton"]
    if forward_kernel == "triton" or not gluon:
        return "triton"
    if forward_kernel == "gluon":
        return gluon[0]
    return _fastest((*shape_key, *kernels), kernels)


def _backward_plan(tune_key: tuple, run, gluon: tuple[str, ...] = ()) -> str:
    """Which backward plan to run: "split" (a dK/dV kernel, then a dQ kernel), "atomic" or
    a tiling of the Gluon kernel, named in ``gluon``.

    "split" recomputes the weights and dP in both kernels: 7 matrix products per pair of
    tiles. "atomic" computes dQ in the dK/dV kernel and adds it into a float32 buffer with
    atomics: 5 products, but the order of the adds varies, so dQ's last bits vary from run to
    run. Hopper's Gluon kernel (``hopper_backward``) does the same with asynchronous wgmma;
    ``gluon`` lists its tilings where it applies. ``torch.use_deterministic_algorithms(True)``
    therefore always gets "split". Otherwise ``backward_plan`` decides: a forced "gluon"
    runs its first tiling, or "split" where it does not apply; "auto" times "split" and
    "atomic" on the first backward of each shape bucket (on a GPU; the interpreter takes
    "split") and keeps the faster, and the Gluon tilings too when ``gluon_backward`` is set:
    the Gluon kernel has no CPU interpreter, so it stays out until checked on a GPU
    (``benchmarks/gpu_attention.py`` checks it, then sets it).
    """
    choices = ("auto", *BACKWARD_PLANS, "gluon")
    if backward_plan not in choices:
        raise ValueError(f"backward_plan is one of {', '.join(choices)}, not {backward_plan!r}")
    if torch.are_deterministic_algorithms_enabled():
        return "split"
    if backward_plan == "gluon":
        return gluon[0] if gluon else "split"
    if backward_plan != "auto":
        return backward_plan
    if INTERPRETING:
        return "split"
    plans = [*BACKWARD_PLANS, *(gluon if gluon_backward else ())]
    return _fastest((*tune_key, *plans), {plan: partial(run, plan) for plan in plans})


class _FusedAttention(torch.autograd.Function):
    """Autograd wrapper: the forward saves Q, K, V, O and the LSE; the backward recomputes.

    A backward asked for a graph (``create_graph=True``) raises (``refuse_double_backward``)
    rather than silently return gradients without one."""

    @staticmethod
    def forward(
        ctx,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        inner: int,
        mask_kind: int,
        causal: bool,
        scale: float,
    ) -> Tensor:
        launch = partial(_forward, query, key, value, mask, inner, mask_kind, causal, scale)
        out, lse = _chosen_forward(launch, query, key, value, mask, mask_kind, causal, scale)
        ctx.save_for_backward(query, key, value, out, lse, mask)
        ctx.settings = (inner, mask_kind, causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        query, key, value, out, lse, mask = ctx.saved_tensors
        refuse_double_backward("triton", grad_out, query, key, value)
        if _span(grad_out) > MAX_HEAD_OFFSET:  # packed, it spans no more than the output did
            grad_out = grad_out.contiguous()
        grads = _backward(grad_out, query, key, value, out, lse, mask, *ctx.settings)
        return (*grads, None, None, None, None, None)


def _kernel_mask(
    mask: Tensor | None, lead: torch.Size, t: int, s: int, device: torch.device
) -> tuple[Tensor | None, int, int]:
    """The mask as a (outer, inner, T, S) view with broadcast dims at stride 0, and its kind.

    ``inner`` is the last leading dim (heads, usually; 1 if there are more than one launch
    takes); a key-padding mask of shape (B, 1, 1, S), or one expanded from it to (B, H, T, S),
    thus stays (B, 1, 1, S) in memory, read with strides (S, 0, 0, 1). Only merging the outer
    leading dims (of 5-D inputs and up) may copy, and then only at the mask's own size in the
    other three.
    """
    inner = lead[-1] if len(lead) > 0 and lead[-1] <= MAX_GRID_HEADS else 1
    if mask is None:
        return None, inner, MASK_NONE
    outer_dims = lead[:-1] if inner > 1 else lead
    outer = math.prod(outer_dims)
    mask = unexpanded(mask).to(device)
    if mask.dtype != torch.bool:  # the kernels add it in base 2, in float32
        mask = finite_bias(mask, torch.float32, LOG2E)
    mask = mask.reshape((1,) * (len(lead) + 2 - mask.dim()) + mask.shape)
    own = mask.shape[len(outer_dims) :]  # (inner?, T, S), 1 where the mask broadcasts
    merged = mask.expand(*outer_dims, *own).reshape(outer, math.prod(own[:-2]), *own[-2:])
    view = merged.expand(outer, inner, t, s)
    if mask.dtype == torch.bool:
        return view.view(torch.uint8), inner, MASK_BOOL
    return view, inner, MASK_FLOAT


def _needs_mask_gradient(mask: Tensor | None) -> bool:
    """Whether autograd would ask for the gradient of this float mask: it requires grad and
    grad mode is on (under torch.no_grad or inference_mode the kernels serve it)."""
    is_float = mask is not None and mask.dtype != torch.bool
    return is_float and mask.requires_grad and torch.is_grad_enabled()


def unsupported_reason(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    instead: str = OTHER_BACKENDS,
) -> str | None:
    """Why these tensors cannot go through the kernels (device, dtype, head dim, a float mask
    that would need a gradient), or None; each reason names a way out, ``instead`` (the
    backends the caller has besides Triton)."""
    if not (query.is_cuda or (INTERPRETING and query.device.type == "cpu")):
        return (
            f"the Triton kernels run on CUDA tensors (or on CPU with TRITON_INTERPRET=1 set "
            f"before triton is imported); got a tensor on {query.device}"
        )
    if query.dtype not in SUPPORTED_DTYPES:
        return (
            f"the Triton kernels take float16, bfloat16 or float32, got {query.dtype}; "
            f"cast the inputs to one of them, or use {instead}"
        )
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return (
            f"the Triton kernels support head dims up to {MAX_HEAD_DIM}, got "
            f"{query.shape[-1]} (query/key) and {value.shape[-1]} (value); use {instead}"
        )
    shortfall = _shared_memory_shortfall(query, value)
    if shortfall:
        return f"{shortfall}; use float16 or bfloat16, or {instead}"
    if _needs_mask_gradient(mask):
        return (
            "the Triton kernels do not compute gradients for a float mask; detach the mask, "
            f"run under torch.no_grad(), or use {instead}, which differentiate it"
        )
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    farthest = max(  # the output is laid out like the query, value_dim wide
        _largest_offset(query, max(head_dim, value_dim)),
        _largest_offset(key, head_dim),
        _largest_offset(value, value_dim),
    )
    if farthest > MAX_HEAD_OFFSET:
        return (
            f"the Triton kernels index within a head in int32, and a head here spans "
            f"{farthest:,} elements (more than 2³¹); use {instead}"
        )
    return None


def _shared_memory_shortfall(query: Tensor, value: Tensor) -> str | None:
    """What the smallest tilings of some kernel lack in this GPU's shared memory, or None."""
    width = _block_dim(query.shape[-1]) + _block_dim(value.shape[-1])
    need = max(
        min(
            shared_bytes(kernel, config, query.element_size(), width)
            for config in small_configs(kernel)
        )
        for kernel in SMALL_TILINGS
    )
    budget = shared_memory_budget(query)
    if need <= budget:
        return None
    return (
        f"the Triton kernels need {need // 1024} KiB of shared memory per program for head "
        f"dims {query.shape[-1]} (query/key) and {value.shape[-1]} (value) in "
        f"{str(query.dtype).removeprefix('torch.')}, and this GPU offers {budget // 1024} KiB"
    )


def triton_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float,
) -> Tensor:
    """softmax(query @ keyᵀ * scale + mask) @ value with the fused kernels, differentiable.

    Args:
        query, key, value: ``(..., T, D)``, ``(..., S, D)``, ``(..., S, Dv)`` with the same
            leading dims, float16/bfloat16/float32, CUDA (or CPU under TRITON_INTERPRET=1).
        mask: boolean (True = may attend) or float (added to the scaled scores),
            broadcastable to ``(..., T, S)``; broadcast dims are read with stride 0.
        causal: bottom-right alignment, query i sees keys ``j <= i + (S - T)``.
        scale: multiplies the dot products.

    Returns ``(..., T, Dv)`` in the input dtype. Validation of shapes and options is
    ``selfattn.attention``'s job; this checks only what the kernels themselves need.
    """
    reason = unsupported_reason(query, key, value, mask)
    if reason is not None:
        raise ValueError(reason)
    lead = query.shape[:-2]
    t, s, value_dim = query.shape[-2], key.shape[-2], value.shape[-1]
    if t == 0 or s == 0 or math.prod(lead) == 0:
        # Nothing to attend to (or nobody asking): zeros, still connected to the graph (through
        # empty sums: 0 * query.sum() would be NaN for a query holding inf).
        connected = sum(x[..., :0].sum() for x in (query, key, value))
        return connected + query.new_zeros(*lead, t, value_dim)
    if scale < 0:  # the kernels scale after taking row maxima, which needs scale >= 0
        key, scale = -key, -scale
    kernel_mask, inner, mask_kind = _kernel_mask(mask, lead, t, s, query.device)
    # (outer, inner, T|S, D): a view for 4-D inputs whatever their strides, so a transposed
    # (B, T, H, D) projection goes to the kernels as it is.
    heads = [x.reshape(-1, inner, *x.shape[-2:]) for x in (query, key, value)]
    settings = (inner, mask_kind, causal, float(scale))
    out = _in_launches(
        lambda *piece: _FusedAttention.apply(*piece, *settings), inner, *heads, kernel_mask
    )
    return out.reshape(*lead, t, value_dim)


def _in_launches(
    launch: Callable[..., Tensor | tuple[Tensor, ...]], inner: int, *tensors: Tensor | None
) -> Tensor | tuple[Tensor, ...]:
    """``launch(*tensors)`` on (outer, inner, ...) tensors (None passes as it is), cut along
    outer into launches of at most ``MAX_GRID_HEADS`` heads, the grid axis's cap; a tensor
    result, or each of a tuple's, is joined along its first dim again (outer, or the
    outer · inner rows of an LSE). Sliced only when over the cap (a slice's autograd backward
    would hand back contiguous gradients)."""
    step = MAX_GRID_HEADS // inner  # outer rows per launch
    outer = tensors[0].shape[0]
    with _on_device(tensors[0]):
        if outer <= step:
            return launch(*tensors)
        parts = [
            launch(*(None if x is None else x[start : start + step] for x in tensors))
            for start in range(0, outer, step)
        ]
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))


def _on_device(tensor: Tensor) -> AbstractContextManager:
    """The tensor's GPU as the current one while kernels launch: Triton launches on the
    current device (and allocates its scratch there), wherever the tensors are."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else nullcontext()


def block_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool,
    scale: float,
    key_allowed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The queries attended over one block of keys, for ring attention to merge by lse.

    Args:
        query, key, value: ``(N, T, D)``, ``(N, S, D)``, ``(N, S, Dv)`` (N: batch and heads
            folded), one dtype of float16, bfloat16 and float32, any strides.
        causal: query i sees keys ``j <= i + S - T`` of the block (bottom-right alignment).
        scale: multiplies the dot products (any sign).
        key_allowed: boolean key padding, True = may attend, ``(N, S)`` or broadcastable to it;
            the kernels read it with stride 0 along T (no ``(T, S)`` mask is formed).

    Returns:
        The output normalised over this block's keys, ``(N, T, Dv)`` float32 (the kernel
        writes its float32 result, not rounded to the input dtype), and the log-sum-exp
        ``(N, T, 1)`` float32 in base 2: ``log2(sum_j exp2(scores_ij · log2(e)))`` of the
        scaled (masked) scores, i.e. the natural lse · ``LOG2E``, the convention of chunked's
        ``tile_forward`` under ``Masks.unit == LOG2E`` (a masked or causal call; its unmasked
        calls return the natural lse). A row with no visible key: output 0, lse +inf.

    Runs the autotuned Triton kernel, never Hopper's Gluon forward: that one writes its output
    in the input dtype only.
    """
    call = _block_call(query, key, value, key_allowed, causal, scale)
    n, t = query.shape[:2]

    def launch(
        query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        return _forward(query, key, value, mask, *call.settings, out_dtype=torch.float32)

    out, lse = _in_launches(launch, call.settings[0], *call.heads, call.mask)
    return out.reshape(n, t, value.shape[-1]), lse.view(n, t, 1)


def block_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    key_allowed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """This block's share of the gradients of ring attention's merged output.

    The weights are recomputed from the merged ``lse`` (``exp2(scores · log2(e) - lse)``: each
    key's weight in the softmax over all blocks) and Δ = rowsum(dO ∘ O) is taken from the
    merged ``out``, so dK, dV are this block's keys' gradients and dQ summed over all blocks
    is the queries'.

    Args:
        grad_out: dO, ``(N, T, Dv)``; rounded to the inputs' dtype (the kernels multiply it
            with the values and weights in that dtype; nothing is lost for float32 inputs).
        query, key, value, causal, scale, key_allowed: as for :func:`block_forward`.
        out: the merged output ``(N, T, Dv)``, any float dtype (Δ is summed in float32).
        lse: the merged log-sum-exp ``(N, T, 1)`` in :func:`block_forward`'s convention
            (base 2; +inf for a row that sees no key in any block: its gradients are 0).

    Returns:
        dQ ``(N, T, D)``, dK ``(N, S, D)``, dV ``(N, S, Dv)``, float32 (the kernels' float32
        sums, not rounded to the input dtype). The plan is ``_backward_plan``'s, bar Hopper's
        Gluon kernel, which writes dK and dV in the input dtype only.
    """
    call = _block_call(query, key, value, key_allowed, causal, scale)
    (n, t), dv, inner = query.shape[:2], value.shape[-1], call.settings[0]
    if grad_out.shape != (n, t, dv) or out.shape != (n, t, dv) or lse.shape != (n, t, 1):
        raise ValueError(
            f"block_backward takes grad_out and out of shape {(n, t, dv)} and lse of "
            f"{(n, t, 1)} for these queries and values, got {tuple(grad_out.shape)}, "
            f"{tuple(out.shape)} and {tuple(lse.shape)}"
        )
    rows = [x.reshape(-1, inner, t, dv) for x in (grad_out.to(query.dtype), out)]
    lse = lse.to(torch.float32).reshape(-1, inner, t).contiguous()  # the kernels' (N, T) rows

    def launch(
        grad_out: Tensor,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        out: Tensor,
        lse: Tensor,
        mask: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        lse = lse.view(-1, t)  # the kernels' (N, T) rows
        return _backward(
            grad_out, query, key, value, out, lse, mask, *call.settings, grad_dtype=torch.float32
        )

    grads = _in_launches(launch, inner, rows[0], *call.heads, rows[1], lse, call.mask)
    grad_query, grad_key, grad_value = (x.reshape(n, *x.shape[2:]) for x in grads)
    return grad_query, grad_key.neg_() if call.key_negated else grad_key, grad_value


class _BlockCall(NamedTuple):
    """A block call in the kernels' terms."""

    heads: list[Tensor]  # query, key, value as (outer, inner, T|S, D) views
    mask: Tensor | None  # key_allowed as _kernel_mask gives it: (outer, inner, T, S), stride 0 on T
    settings: tuple[int, int, bool, float]  # inner, mask kind, causal, scale >= 0
    key_negated: bool  # a negative scale went onto the key: dK changes sign back


def _block_call(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_allowed: Tensor | None,
    causal: bool,
    scale: float,
) -> _BlockCall:
    """Check a block call (one-line ValueErrors) and put it in the kernels' terms; a negative
    scale moves onto the key, as in :func:`triton_attention` (the kernels need scale >= 0)."""
    reason = _block_problem(query, key, value, key_allowed) or unsupported_reason(
        query, key, value, None
    )
    if reason is not None:
        raise ValueError(reason)
    n, t, s = query.shape[0], query.shape[1], key.shape[1]
    if scale < 0:
        key = -key
    allowed = None if key_allowed is None else key_allowed.unsqueeze(-2)  # one row for all T
    mask, inner, mask_kind = _kernel_mask(allowed, torch.Size((n,)), t, s, query.device)
    heads = [x.reshape(-1, inner, *x.shape[1:]) for x in (query, key, value)]
    return _BlockCall(heads, mask, (inner, mask_kind, causal, abs(float(scale))), scale < 0)


def _block_problem(
    query: Tensor, key: Tensor, value: Tensor, key_allowed: Tensor | None
) -> str | None:
    """What the block functions cannot take in these shapes and dtypes, in one line, or None."""
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        return f"the block functions take (N, T, D), (N, S, D), (N, S, Dv) tensors, got {shapes}"
    (n, _, d), s = query.shape, key.shape[1]
    if key.shape[0] != n or key.shape[2] != d or value.shape[:2] != key.shape[:2]:
        return f"query, key and value must be (N, T, D), (N, S, D), (N, S, Dv), got {shapes}"
    if 0 in (n, query.shape[1], s):
        return (
            f"the block functions take non-empty blocks (N, T, S > 0), got {shapes}; an empty "
            "block adds nothing to the merge: skip it"
        )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return (
            f"query, key and value must share one dtype, got {query.dtype}, {key.dtype} and "
            f"{value.dtype}; cast them to one"
        )
    if key_allowed is None:
        return None
    if key_allowed.dtype != torch.bool:
        return f"key_allowed is boolean (True = may attend), got {key_allowed.dtype}"
    fits = 1 <= key_allowed.dim() <= 2 and all(
        size in (1, full) for size, full in zip(reversed(key_allowed.shape), (s, n), strict=False)
    )
    if not fits:
        return (
            f"key_allowed must be (N, S) = ({n}, {s}) or broadcastable to it, got "
            f"{tuple(key_allowed.shape)}"
        )
    return None


def describe_config(config: triton.Config) -> str:
    """A tuning choice in one line, e.g. ``BLOCK_M=64 BLOCK_N=64 warps=4 stages=3 TMA``."""
    kwargs = config.kwargs
    text = (
        f"BLOCK_M={kwargs['BLOCK_M']} BLOCK_N={kwargs['BLOCK_N']} "
        f"warps={config.num_warps} stages={config.num_stages}"
    )
    if kwargs.get("USE_TMA"):
        text += " TMA"
    if kwargs.get("LAZY"):
        text += " lazy"
    if kwargs.get("A_FROM_REGISTERS"):
        text += " A-from-registers"
    if config.maxnreg:
        text += f" maxnreg={config.maxnreg}"
    return text


AUTOTUNED = {"forward": _forward_kernel, "dk/dv": _dkdv_kernel, "dq": _dq_kernel}


def tuned_configs() -> dict[str, str]:
    """The configuration each autotuned kernel picked on its latest call (for reports)."""
    picked = {}
    for name, kernel in AUTOTUNED.items():
        config = getattr(kernel, "best_config", None)
        picked[name] = "not run" if config is None else describe_config(config)
    return picked


def autotune_timings(name: str) -> list[str]:
    """Each configuration of one kernel ("forward", "dk/dv", "dq") the autotuner timed on its
    latest tuning run, fastest first (for reports)."""
    timings = getattr(AUTOTUNED[name], "configs_timings", None) or {}
    ranked = sorted(timings.items(), key=lambda item: _first(item[1]))
    return [f"{_first(ms):.3f} ms  {describe_config(config)}" for config, ms in ranked]


def _first(timing: float | list[float]) -> float:
    """do_bench answers a number, or a list when asked for quantiles."""
    return timing[0] if isinstance(timing, list | tuple) else timing
