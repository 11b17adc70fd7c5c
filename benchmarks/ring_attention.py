"""Ring attention on the CPU over gloo: time and peak memory per rank, against torch SDPA.

B=1, H=8, D=64, float32, T = S = 4,096 and 8,192 over the whole sequence; forward, and forward +
backward; causal and not. Three runs, each in freshly spawned processes: torch's fused kernel
(``attention(backend="sdpa")``) on the whole sequence in one process, ``ring_attention`` in a
group of one (P=1: the chunked kernel's tiles and the merges, no transfers) and over two gloo
ranks (P=2, each holding half the sequence). Threads: 2 for the one-process runs, 1 per rank
for P=2, so every run uses the machine's 2 cores; more ranks than cores would only time-share
them.

Time: the fastest of three calls after the first (the warm-up), each between barriers, so for
P=2 the slower rank's (the fastest, since a neighbour's load on the 2 cores only adds). Peak
memory: a process's peak resident size during the first call (Linux VmHWM, reset just before
it) minus its resident size at the reset: inputs excluded; score tiles, received blocks,
outputs and gradients included; for P=2 the larger of the two ranks. Every process runs with
``MALLOC_MMAP_THRESHOLD_=65536``, so that glibc returns a freed tensor's memory at once and an
earlier case's leftovers cannot hide a later case's peak. Inputs: this rank's q, k, v (and
the output's gradient), which a ring splits P ways.

Balance (``--balance``): causal, T = 6,144, each layout (contiguous, zig-zag) over P = 2 and
3 ranks, 1 thread per rank. Per rank, the CPU seconds of its own thread spent in the chunked
tiles (``tile_forward``/``tile_backward``, timed by wrapping them), which counts the work a rank
does whatever else shares its core (P = 3 time-shares 2 cores), the least of three calls;
their max/min over the ranks; and the call's time (the slowest rank's, as above), which for
P = 2 shows what the ring waits.

Agreement (``--agreement``): the step at the start of every call where the ranks check that
they hold shards of one shape and pass the same options (``_Ring.agree_on``), timed alone
(wall time, by wrapping it) and with the whole call, on a shard too small for the
attention to count (B=1, H=8, n=16 tokens per rank, D=64, float32, forward, no gradients), 2
gloo ranks, 1 thread each; the median of ``AGREEMENT_CALLS`` calls after a warm-up, the
slower rank's.

    python benchmarks/ring_attention.py                  # about 3 minutes on 2 cores
    python benchmarks/ring_attention.py --lengths 2048   # a shorter run
    python benchmarks/ring_attention.py --balance        # about 2 minutes on 2 cores
    python benchmarks/ring_attention.py --agreement      # about 10 seconds
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attention import peak_rss, reset_peak_rss
from selfattn.attention import attention
from selfattn.kernels import ring as ring_module
from selfattn.kernels.ring import ring_attention, shard

HEADS, HEAD_DIM = 8, 64
CORES = 2
CASES = [(backward, causal) for backward in (False, True) for causal in (False, True)]
BALANCE_LENGTH = 6144  # splits into 2P chunks for P = 2 and 3
BALANCE_RUNS = [(size, layout) for size in (2, 3) for layout in ring_module.LAYOUTS]


TIMED_CALLS = 3
AGREEMENT_CALLS, AGREEMENT_TOKENS = 1000, 16


class TileClock:
    """CPU seconds this thread spends in the ring's tiles, from when it is made on: the
    work a rank does, whatever else shares its core."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("tile_forward", "tile_backward"):
            setattr(ring_module, name, self._timed(getattr(ring_module, name)))

    def _timed(self, function):
        def timed(*args):
            start = time.thread_time()
            try:
                return function(*args)
            finally:
                self.seconds += time.thread_time() - start

        return timed


def measure(call, synchronise, clock: TileClock | None = None) -> dict:
    """Peak extra bytes of the first call, the least seconds of the next ones (between
    barriers) and, with a clock, the least CPU seconds in the tiles of one of them."""
    synchronise()
    before = reset_peak_rss()
    call()
    synchronise()
    peak = peak_rss() - before
    times, tile_times = [], []
    for _ in range(TIMED_CALLS):
        tiles_before = clock.seconds if clock else 0.0
        start = time.perf_counter()
        call()
        synchronise()
        times.append(time.perf_counter() - start)
        tile_times.append(clock.seconds - tiles_before if clock else 0.0)
    return {"seconds": min(times), "peak_bytes": peak, "tile_seconds": min(tile_times)}


def case_call(
    t: int,
    backward: bool,
    causal: bool,
    rank: int,
    size: int,
    ring: bool,
    layout: str = "contiguous",
):
    """A call of this rank's attention on its shard of a seeded (1, H, T, D) sequence."""
    torch.manual_seed(0)
    inputs = [
        shard(torch.randn(1, HEADS, t, HEAD_DIM), rank, size, layout=layout) for _ in range(4)
    ]
    leaves = [x.requires_grad_(backward) for x in inputs[:3]]
    input_bytes = sum(x.nbytes for x in inputs[: 4 if backward else 3])

    def call() -> None:
        if ring:
            output = ring_attention(*leaves, causal=causal, layout=layout)
        else:
            output = attention(*leaves, causal=causal, backend="sdpa")
        if backward:
            output.backward(inputs[3])
            for leaf in leaves:
                leaf.grad = None

    return call, input_bytes


def worker(rank: int, port: int, size: int, ring: bool, lengths: list[int], out: Path) -> None:
    """Every case on this rank; results to ``out/rank{rank}.json``."""
    torch.set_num_threads(CORES // size)
    if ring:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=size)
    synchronise = dist.barrier if ring else lambda: None
    results = {}
    for t in lengths:
        for backward, causal in CASES:
            call, input_bytes = case_call(t, backward, causal, rank, size, ring)
            results[f"{t} {backward} {causal}"] = measure(call, synchronise) | {
                "input_bytes": input_bytes
            }
    if ring:
        dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def balance_worker(rank: int, port: int, size: int, layout: str, out: Path) -> None:
    """Causal ring attention in ``layout``, forward and forward + backward, on this rank: its
    measurements, with the CPU seconds in its tiles, to ``out/rank{rank}.json``."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    clock = TileClock()
    results = {}
    for backward in (False, True):
        call, _ = case_call(BALANCE_LENGTH, backward, True, rank, size, True, layout)
        results[str(backward)] = measure(call, dist.barrier, clock)
    dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def agreement_worker(rank: int, port: int, size: int, out: Path) -> None:
    """Wall seconds of each call's agreement step and of the whole call, ``AGREEMENT_CALLS``
    calls after a warm-up, to ``out/rank{rank}.json``."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    agreements, calls = [], []
    agree_on = ring_module._Ring.agree_on

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return agree_on(*args, **kwargs)
        finally:
            agreements.append(time.perf_counter() - start)

    ring_module._Ring.agree_on = timed
    torch.manual_seed(rank)
    query, key, value = torch.randn(3, 1, HEADS, AGREEMENT_TOKENS, HEAD_DIM).unbind(0)
    for _ in range(2 * AGREEMENT_CALLS):  # the first half warms up
        start = time.perf_counter()
        ring_attention(query, key, value, causal=True)
        calls.append(time.perf_counter() - start)
    dist.destroy_process_group()
    timings = {"agreement": agreements, "call": calls}
    results = {name: statistics.median(x[AGREEMENT_CALLS:]) for name, x in timings.items()}
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def agreement() -> None:
    """Print the median agreement and call time per call, the slower rank's."""
    ranks = spawn(agreement_worker, 2)
    print(f"torch {torch.__version__}, gloo, 2 ranks, 1 thread each, B=1 H={HEADS} "
          f"n={AGREEMENT_TOKENS} D={HEAD_DIM} float32, causal, forward\n")  # fmt: skip
    agreed, called = (max(r[name] for r in ranks) * 1e6 for name in ("agreement", "call"))
    print("| agreement µs | whole call µs | agreement share |")
    print("|---|---|---|")
    print(f"| {agreed:.0f} | {called:.0f} | {agreed / called:.0%} |")


def spawn(worker, size: int, *args) -> list[dict]:
    """``worker(rank, port, size, *args, out)`` in ``size`` spawned processes; each rank's
    results."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        mp.start_processes(worker, args=(port, size, *args, out), nprocs=size, start_method="spawn")
        return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(size)]


def run(size: int, ring: bool, lengths: list[int]) -> dict[str, dict]:
    """Spawn ``size`` workers; per case, the slowest rank's seconds and largest peak."""
    ranks = spawn(worker, size, ring, lengths)
    return {
        case: {
            "seconds": max(r[case]["seconds"] for r in ranks),
            "peak_bytes": max(r[case]["peak_bytes"] for r in ranks),
            "input_bytes": max(r[case]["input_bytes"] for r in ranks),
        }
        for case in ranks[0]
    }


def balance() -> None:
    """Print, per P, layout and pass, each rank's CPU seconds in the tiles and the call's."""
    print(f"torch {torch.__version__}, {CORES} cores, B=1 H={HEADS} D={HEAD_DIM} float32, gloo, "
          f"causal, T={BALANCE_LENGTH}, 1 thread per rank\n")  # fmt: skip
    header = ["P", "layout", "pass", "tile CPU s per rank", "max / min", "call s"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for size, layout in BALANCE_RUNS:
        ranks = spawn(balance_worker, size, layout)
        for backward in ("False", "True"):
            tiles = [r[backward]["tile_seconds"] for r in ranks]
            row = [str(size), layout, "fwd+bwd" if backward == "True" else "fwd"]
            row += [", ".join(f"{x:.3f}" for x in tiles), f"{max(tiles) / min(tiles):.2f}"]
            row += [f"{max(r[backward]['seconds'] for r in ranks):.3f}"]
            print("| " + " | ".join(row) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    only = parser.add_mutually_exclusive_group()  # three runs with their own fixed sizes
    only.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[4096, 8192],
        help="sequence lengths T of the main table, even: the P=2 ring splits each in 2 "
        "(default 4096 8192)",
    )
    only.add_argument(
        "--balance",
        action="store_true",
        help=f"the causal work per rank of each layout instead (T={BALANCE_LENGTH})",
    )
    only.add_argument(
        "--agreement",
        action="store_true",
        help=f"the time of the ranks' agreement step instead (n={AGREEMENT_TOKENS} per rank)",
    )
    args = parser.parse_args()
    uneven = " ".join(str(t) for t in args.lengths if t < 2 or t % 2)
    if uneven:  # here, not in the P=2 ranks after the other runs
        parser.error(f"--lengths must be even, at least 2 (the P=2 ring holds halves): {uneven}")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each spawned process's glibc
    if args.balance:
        balance()
        return
    if args.agreement:
        agreement()
        return
    runs = {
        "sdpa": run(1, False, args.lengths),
        "ring P=1": run(1, True, args.lengths),
        "ring P=2": run(2, True, args.lengths),
    }
    print(f"torch {torch.__version__}, {CORES} cores, B=1 H={HEADS} D={HEAD_DIM} float32, gloo\n")
    header = ["T", "pass", "causal"] + [f"{name} s" for name in runs]
    header += [f"{name} peak MiB" + (" per rank" if "P=2" in name else "") for name in runs]
    header += ["inputs MiB, P=1", "per rank, P=2", "ring P=2 / sdpa time", "peak per rank / sdpa"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for t in args.lengths:
        for backward, causal in CASES:
            case = f"{t} {backward} {causal}"
            row = [str(t), "fwd+bwd" if backward else "fwd", "yes" if causal else "no"]
            row += [f"{runs[name][case]['seconds']:.3f}" for name in runs]
            row += [f"{runs[name][case]['peak_bytes'] / 2**20:.0f}" for name in runs]
            row += [
                f"{runs[name][case]['input_bytes'] / 2**20:.0f}" for name in runs if "ring" in name
            ]
            ring, sdpa = runs["ring P=2"][case], runs["sdpa"][case]
            row += [f"{ring['seconds'] / sdpa['seconds']:.2f}"]
            # "—": sdpa's peak too small to measure (short sequences)
            row += [f"{ring['peak_bytes'] / sdpa['peak_bytes']:.2f}" if sdpa["peak_bytes"] else "—"]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
