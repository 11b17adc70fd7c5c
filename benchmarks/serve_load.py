"""Load test of `selfattn serve`: a burst of API requests against a server this script starts.

Starts ``python -m selfattn serve --port <free>`` on 127.0.0.1, warms it up, then sends
``--requests`` requests from ``--clients`` concurrent clients (httpx), a mix of the API's
calls (explain, explain with a recomputed head, view, compare), all under one overall timeout.
A "busy" answer (503) is retried after its Retry-After, as the page does, at most ``RETRIES``
times. Reports errors, busy answers, latency percentiles (retries included), answered requests
per second and the server's resident memory before and after the burst (from /proc: Linux
only), as a markdown table.

    python benchmarks/serve_load.py                          # 200 requests, 8 clients
    python benchmarks/serve_load.py --requests 40 --clients 4
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BANK = "I went to the bank to deposit money."
RIVER = "We sat on the bank of the river and watched the water."
CALLS = [  # (label, path, body), sent in turn
    ("explain", "/api/explain", {"text": BANK, "word": "bank"}),
    ("explain", "/api/explain", {"text": RIVER, "word": "river", "layer": 3, "head": 5}),
    ("explain cosine", "/api/explain", {"text": BANK, "word": "money", "similarity": "cosine"}),
    ("view", "/api/view", {"text": RIVER, "word": "bank"}),
    ("compare", "/api/compare", {"sentences": [BANK, RIVER], "word": "bank"}),
]
START_TIMEOUT = 90.0  # seconds for the server to load the model and answer
RETRIES = 3  # on 503 "busy", after the server's Retry-After (as serve.js does)


@dataclass
class Result:
    requests: int
    clients: int
    seconds: float  # wall time of the burst
    latencies: dict[str, list[float]] = field(default_factory=dict)  # label -> seconds
    errors: Counter[str] = field(default_factory=Counter)  # "503 /api/view" -> count
    busy: int = 0  # 503 answers that were retried
    rss_before: int = 0  # bytes, after the warm-up
    rss_after: int = 0
    rss_peak: int = 0  # the process's high-water mark

    @property
    def all_latencies(self) -> list[float]:
        return [x for values in self.latencies.values() for x in values]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def memory(pid: int) -> tuple[int, int]:
    """(resident, peak resident) bytes of a process, from /proc/<pid>/status."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def start_server(port: int) -> subprocess.Popen:
    """`selfattn serve` on 127.0.0.1:port, once it answers /api/models."""
    process = subprocess.Popen(
        [sys.executable, "-m", "selfattn", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"selfattn serve exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/models", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.25)
    process.kill()
    raise RuntimeError(f"selfattn serve did not answer within {START_TIMEOUT:.0f} s")


async def post(http: httpx.AsyncClient, path: str, body: dict, result: Result) -> httpx.Response:
    """POST ``body``; a 503 "busy" is retried after its Retry-After, at most RETRIES times."""
    response = await http.post(path, json=body)
    for _ in range(RETRIES):
        if response.status_code != 503:
            break
        result.busy += 1
        await asyncio.sleep(float(response.headers.get("retry-after", 1)))
        response = await http.post(path, json=body)
    return response


async def burst(base: str, requests: int, clients: int, result: Result) -> None:
    """``requests`` calls from ``clients`` concurrent connections, each taking the next call."""
    jobs = iter(range(requests))

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            for n in jobs:
                label, path, body = CALLS[n % len(CALLS)]
                start = time.perf_counter()
                try:
                    response = await post(http, path, body, result)
                    response.raise_for_status()
                    response.json()
                except httpx.HTTPStatusError as error:
                    result.errors[f"{error.response.status_code} {path}"] += 1
                    continue
                except httpx.HTTPError as error:
                    result.errors[f"{type(error).__name__} {path}"] += 1
                    continue
                result.latencies.setdefault(label, []).append(time.perf_counter() - start)

    await asyncio.gather(*(client() for _ in range(clients)))


def measure(requests: int = 200, clients: int = 8, timeout: float = 300.0) -> Result:
    """Start a server, warm it up (one round of every call per client), then the burst."""
    port = free_port()
    process = start_server(port)
    base = f"http://127.0.0.1:{port}"
    try:
        warm = Result(len(CALLS) * clients, clients, 0.0)
        asyncio.run(asyncio.wait_for(burst(base, warm.requests, clients, warm), timeout))
        result = Result(requests, clients, 0.0, errors=Counter(warm.errors), busy=warm.busy)
        result.rss_before = memory(process.pid)[0]
        start = time.perf_counter()
        asyncio.run(asyncio.wait_for(burst(base, requests, clients, result), timeout))
        result.seconds = time.perf_counter() - start
        result.rss_after, result.rss_peak = memory(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=30)
    return result


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (1..100), interpolated between the nearest ranks."""
    if q == 100 or len(values) == 1:
        return max(values)
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def table(result: Result) -> str:
    """Markdown: latency percentiles per call and overall, throughput and memory."""
    mib = 2**20
    lines = [
        "| calls | requests | p50 ms | p90 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = [*sorted(result.latencies.items()), ("all", result.all_latencies)]
    for label, values in rows:
        if not values:  # every request failed
            continue
        p50, p90, p99, top = (1000 * percentile(values, q) for q in (50, 90, 99, 100))
        lines.append(f"| {label} | {len(values)} | {p50:.0f} | {p90:.0f} | {p99:.0f} | {top:.0f} |")
    errors = ", ".join(f"{k}: {v}" for k, v in result.errors.items()) or "none"
    answered = len(result.all_latencies)
    lines += [
        "",
        f"{result.requests} requests from {result.clients} clients in {result.seconds:.1f} s: "
        f"**{answered / result.seconds:.1f} answered/s**; errors: {errors}; "
        f"busy answers retried: {result.busy}.",
        f"Server RSS: {result.rss_before / mib:.0f} MiB after the warm-up, "
        f"{result.rss_after / mib:.0f} MiB after the burst "
        f"({(result.rss_after - result.rss_before) / mib:+.0f} MiB); "
        f"peak {result.rss_peak / mib:.0f} MiB.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests in the burst")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the burst")
    args = parser.parse_args()
    if min(args.requests, args.clients) < 1 or args.timeout <= 0:
        parser.error("--requests and --clients must be at least 1, --timeout above 0")
    result = measure(args.requests, args.clients, args.timeout)
    print(table(result))
    if result.errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
