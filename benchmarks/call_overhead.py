"""What ``attention(backend="sdpa")`` adds to torch's own kernel per call, forward + backward.

Our sdpa path wraps torch's ``scaled_dot_product_attention`` in our conventions (bottom-right
causal, 0 for fully masked rows) and, where gradients are on, in a pass-through
``autograd.Function`` that gives it second derivatives. Both cost a fixed time per call, which
shows at small sizes only. float32, B=4, H=4, causal, T = S; each timing is the best of 7
rounds of calls (one thread, so the figures are steady on a busy machine). Prints a markdown
table with the ratio to torch in the same run and the difference in microseconds.

    python benchmarks/call_overhead.py
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F

from selfattn import attention

SHAPES = ((16, 16), (64, 32), (256, 64), (1024, 64))  # (T, head dim)


def best_seconds(step, rounds: int = 7, calls: int = 50) -> float:
    for _ in range(5):
        step()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def forward_backward(run, inputs) -> None:
    run(*inputs).sum().backward()


def torch_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def ours(q, k, v):
    return attention(q, k, v, causal=True, backend="sdpa")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, float32, B=4, H=4, causal, forward + backward, 1 thread\n")
    print("| T | head dim | torch SDPA | ours (sdpa) | ours / torch | added per call |")
    print("|---|---|---|---|---|---|")
    for t, head_dim in SHAPES:
        inputs = [torch.randn(4, 4, t, head_dim, requires_grad=True) for _ in range(3)]
        calls = max(2, 50 * 256 // t)
        reference = best_seconds(partial(forward_backward, torch_sdpa, inputs), calls=calls)
        measured = best_seconds(partial(forward_backward, ours, inputs), calls=calls)
        print(
            f"| {t:,} | {head_dim} | {reference * 1e6:,.0f} µs | {measured * 1e6:,.0f} µs "
            f"| {measured / reference:.2f}x | {(measured - reference) * 1e6:+,.0f} µs |"
        )


if __name__ == "__main__":
    main()
