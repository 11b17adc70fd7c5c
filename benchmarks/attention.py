"""Attention kernels on the CPU: explicit, chunked and torch SDPA, time and peak memory.

B=1, H=8, D=64, float32, T = S from 512 to 65,536 (doubling; forward + backward up to
32,768 by default); forward, and forward + backward; causal and not. Each case runs in a fresh
subprocess. Its peak memory is the peak resident size during the first call (Linux VmHWM,
reset just before it) minus the resident size at the reset: inputs and imports excluded. The
first call is also the warm-up; the time is the median of the calls after it, or the first
call alone where one takes more than a few seconds. Achieved GFLOP/s counts 4·B·H·T²·D for
the forward, 3.5x that for forward + backward, both halved when causal; the fp32 GEMM rate is
the ceiling. Prints a markdown table, with chunked/sdpa, the ratios of their times and of their
peak memory, in the same run.

    python benchmarks/attention.py                 # the full table (~10-15 minutes on 2 cores)
    python benchmarks/attention.py --quick         # T <= 2,048, one timed call per case
    python benchmarks/attention.py --max-t 8192    # a shorter run
    python benchmarks/attention.py --inputs padded --max-t 8192   # other inputs, below
    python benchmarks/attention.py --inputs float-mask --min-t 4096 --max-t 16384

``--inputs``: ``random`` (default: standard normal q, k, v), ``padded`` (the same with a
key-padding mask of shape (S,) hiding the last eighth of the keys), ``peaked`` (q and k times
4: scaled scores with a standard deviation of 16, so most weights underflow), ``float-mask``
(padded's keys hidden by a float (T, S) mask of 0 and float32's lowest value, as Hugging Face
materialises its masks: an input of T·S·4 bytes, made before the peak is reset like q, k, v).
Timings depend on the values only through the exponentials; peaked rows are what trained
models can show.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import subprocess
import sys
import time

import torch

HEADS, HEAD_DIM = 8, 64
BACKENDS = ("explicit", "chunked", "sdpa")
# The explicit path keeps scores, scaled, masked and weights (forward) and about as many
# gradients again (backward); a case is skipped when that estimate exceeds this.
EXPLICIT_LIMIT = 10 * 2**30
TIMED_SECONDS = 6.0  # repeat a case until about this much time is spent, at most `repeats`
LIMITS = {"max_t": 65536, "max_t_backward": 32768, "repeats": 5}  # the defaults
QUICK = {"max_t": 2048, "max_t_backward": 2048, "repeats": 1}  # what --quick sets


def flops(t: int, backward: bool, causal: bool) -> float:
    forward = 4 * HEADS * t * t * HEAD_DIM
    return forward * (3.5 if backward else 1.0) * (0.5 if causal else 1.0)


def explicit_bytes(t: int, backward: bool) -> int:
    weights = HEADS * t * t * 4
    return weights * (8 if backward else 4)


INPUTS = ("random", "padded", "peaked", "float-mask")


def run_case(
    backend: str, t: int, backward: bool, causal: bool, repeats: int, kind: str = "random"
) -> dict:
    """One case in this process: returns seconds (median) and peak extra bytes."""
    from selfattn.attention import attention

    torch.manual_seed(0)
    gain = 4.0 if kind == "peaked" else 1.0
    inputs = [
        (torch.randn(1, HEADS, t, HEAD_DIM) * (gain if i < 2 else 1.0)).requires_grad_(backward)
        for i in range(3)
    ]
    mask = None
    hidden = torch.arange(t) >= t - t // 8  # the last eighth of the keys
    if kind == "padded":
        mask = ~hidden
    elif kind == "float-mask":
        mask = torch.zeros(t, t).masked_fill_(hidden, torch.finfo(torch.float32).min)
    grad_output = torch.randn(1, HEADS, t, HEAD_DIM)

    def call() -> float:
        start = time.perf_counter()
        output = attention(*inputs, mask=mask, causal=causal, backend=backend)
        if backward:
            output.backward(grad_output)
            for tensor in inputs:
                tensor.grad = None
        return time.perf_counter() - start

    before = reset_peak_rss()
    first = call()
    peak = peak_rss() - before
    times = [first]
    if first * 2 < TIMED_SECONDS:
        times = [call() for _ in range(max(1, min(repeats, int(TIMED_SECONDS / first))))]
    return {"seconds": statistics.median(times), "peak_bytes": peak}


def reset_peak_rss() -> int:
    """Reset the process's peak resident size (Linux) to the current one, and return it."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return peak_rss()


def peak_rss() -> int:
    """Peak resident bytes since the last reset (VmHWM)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def measure(backend: str, t: int, backward: bool, causal: bool, repeats: int, kind: str) -> dict:
    """Run one case in a fresh subprocess (its own peak memory)."""
    command = [sys.executable, __file__, "--case", backend, str(t), str(int(backward))]
    command += [str(int(causal)), str(repeats), kind]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": failure(result)}
    return json.loads(result.stdout)


def failure(result: subprocess.CompletedProcess) -> str:
    """Why a case failed: the last line of its stderr, else its exit code (and the signal that
    killed it, e.g. SIGKILL from the out-of-memory killer, which leaves stderr empty)."""
    lines = result.stderr.strip().splitlines()
    if lines:
        return lines[-1]
    killed_by = signal.strsignal(-result.returncode) if result.returncode < 0 else None
    return f"exit code {result.returncode}" + (f" ({killed_by})" if killed_by else "")


def gemm_gflops() -> float:
    """fp32 matrix product rate, 2048 x 2048 (the ceiling for attention's two products)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    times = []
    for _ in range(10):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * 2048**3 / min(times) / 1e9


def describe(result: dict | None, t: int, backward: bool, causal: bool) -> tuple[str, str, str]:
    """(seconds, GFLOP/s, peak MiB) cells."""
    if result is None:
        need = explicit_bytes(t, backward) / 2**30
        return f"skipped (would need ~{need:.0f} GiB)", "", ""
    if "error" in result:
        return f"failed: {result['error'][:40]}", "", ""
    seconds = result["seconds"]
    rate = flops(t, backward, causal) / seconds / 1e9
    return f"{seconds:.3f}", f"{rate:.0f}", f"{result['peak_bytes'] / 2**20:.0f}"


def option(name: str) -> str:
    """The command-line option of an argument's name: max_t -> --max-t."""
    return "--" + name.replace("_", "-")


def parse_args() -> argparse.Namespace:
    """The command line, its limits checked (one-line errors) before any work."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-t", type=int, default=512, help="shortest sequence")
    parser.add_argument(
        "--max-t", type=int, help=f"longest sequence, forward (default {LIMITS['max_t']})"
    )
    parser.add_argument(
        "--max-t-backward",
        type=int,
        help=f"longest sequence, forward + backward (default {LIMITS['max_t_backward']})",
    )
    parser.add_argument(
        "--repeats", type=int, help=f"timed calls per case, at most (default {LIMITS['repeats']})"
    )
    quick = ", ".join(f"{option(name)} {value}" for name, value in QUICK.items())
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run: {quick} (those options are then refused)",
    )
    parser.add_argument("--inputs", choices=INPUTS, default="random", help="see the module doc")
    parser.add_argument("--case", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        return args
    given = [option(name) for name in QUICK if getattr(args, name) is not None]
    if args.quick and given:
        parser.error(f"--quick sets {', '.join(given)}: give one or the other")
    for name, value in (QUICK if args.quick else LIMITS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("min_t", *LIMITS):
        if getattr(args, name) < 1:
            parser.error(f"{option(name)} must be at least 1, got {getattr(args, name)}")
    if args.min_t > args.max_t:
        parser.error(f"--min-t {args.min_t} is above --max-t {args.max_t}: no sequence to time")
    return args


def main() -> None:
    args = parse_args()
    if args.case:
        backend, t, backward, causal, repeats, *kind = args.case
        flags = bool(int(backward)), bool(int(causal))
        print(json.dumps(run_case(backend, int(t), *flags, int(repeats), *kind)))
        return

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, inputs: {args.inputs}"
    )
    print(f"fp32 GEMM (2048^3): {gemm_gflops():.0f} GFLOP/s\n")
    header = ["T", "pass", "causal"]
    header += [f"{name} s" for name in BACKENDS] + [f"{name} GFLOP/s" for name in BACKENDS]
    header += [f"{name} peak MiB" for name in BACKENDS] + ["chunked/sdpa s", "chunked/sdpa MiB"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    t = args.min_t
    while t <= args.max_t:
        for backward in (False, True):
            if backward and t > args.max_t_backward:
                continue
            for causal in (False, True):
                cells = {}
                for backend in BACKENDS:
                    fits = backend != "explicit" or explicit_bytes(t, backward) <= EXPLICIT_LIMIT
                    result = (
                        measure(backend, t, backward, causal, args.repeats, args.inputs)
                        if fits
                        else None
                    )
                    cells[backend] = (result, describe(result, t, backward, causal))
                ratios = ["", ""]
                chunked, sdpa = cells["chunked"][0], cells["sdpa"][0]
                if chunked and sdpa and "seconds" in chunked and "seconds" in sdpa:
                    ratios = [
                        f"{chunked['seconds'] / sdpa['seconds']:.2f}",
                        f"{chunked['peak_bytes'] / max(sdpa['peak_bytes'], 1):.2f}",
                    ]
                row = [str(t), "fwd+bwd" if backward else "fwd", "yes" if causal else "no"]
                for column in range(3):
                    row += [cells[name][1][column] for name in BACKENDS]
                print("| " + " | ".join([*row, *ratios]) + " |", flush=True)
        t *= 2


if __name__ == "__main__":
    main()
