"""Load test of `selfattn serve`: a burst of API requests against a server this script starts.

Starts ``python -m selfattn serve --port 0`` on 127.0.0.1 (the free port it prints), warms it
up, then sends ``--requests`` requests from ``--clients`` concurrent clients (httpx), a mix of
the API's calls (explain, explain with a recomputed head, view, compare), under a ``--timeout``.
A "busy" answer (503) is retried after its Retry-After, as the page does, at most ``RETRIES``
times. Reports errors, busy answers, latency percentiles (retries included), answered requests
per second and the server's resident memory before and after the burst (from /proc: Linux
only), as a markdown table.

Then, per long call (explain and view of a 464-token text), ``--rounds`` bursts of ``--burst``
requests at once, each from a client of its own, and until the first of them is answered one
more every 0.1 s, none retried. A burst is more than the server admits (2 workers + 8 queued):
the rest are refused with 503 "busy", which should come at once, not after a model run, and so
should the refusals sent while the first runs go on, every place taken. (From the first answer
on a place is free, and each request sent then would be admitted: a run more, not a refusal.)
A second table gives the latency of each kind of answer: sent at once or later, 200 or 503.

    python benchmarks/serve_load.py           # 200 requests, 8 clients; 3 bursts of 16 per call
    python benchmarks/serve_load.py --requests 40 --clients 4 --burst 0
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Coroutine
from contextlib import suppress
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
LONG = " ".join([BANK, RIVER] * 21)  # 1,931 characters: 464 tokens of all-MiniLM-L6-v2
LONG_CALLS = [  # (label, path, body): each sent in bursts
    ("explain", "/api/explain", {"text": LONG, "word": "bank"}),
    ("view", "/api/view", {"text": LONG, "word": "bank"}),
]
PROBE_EVERY = 0.1  # seconds between the requests sent until a burst's first answer
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
    # the long bursts: (label, "at once" or "later", status) -> seconds
    bursts: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)

    @property
    def all_latencies(self) -> list[float]:
        return [x for values in self.latencies.values() for x in values]


def memory(pid: int) -> tuple[int, int]:
    """(resident, peak resident) bytes of a process, from /proc/<pid>/status."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


class NotServing(RuntimeError):
    """The server exited, or did not answer in time, before the load began."""


START_LINE = re.compile(r"selfattn explorer on (http://127\.0\.0\.1:\d+)/")  # its address


def start_server() -> tuple[subprocess.Popen, str]:
    """`selfattn serve --port 0` on 127.0.0.1, once it answers /api/models: the process and its
    address. The port is the free one it prints (none picked here and bound again there, which
    another process could take in between); it listens from then on, so the first request waits
    for its answer instead of being given up and sent again (a request given up still runs)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "selfattn", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    addresses: queue.Queue[str] = queue.Queue()

    def read() -> None:  # the start line, then the access log: read to its end, not kept
        for line in process.stdout:
            if match := START_LINE.match(line):
                addresses.put(match[1])

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT
    try:
        base = None
        while base is None:
            if process.poll() is not None:
                raise NotServing(f"selfattn serve exited with {process.returncode}")
            if time.monotonic() > deadline:
                raise NotServing(f"selfattn serve did not start within {START_TIMEOUT:.0f} s")
            with suppress(queue.Empty):
                base = addresses.get(timeout=0.25)
        try:  # listening already: the request waits in the backlog until uvicorn takes it
            left = max(deadline - time.monotonic(), 1.0)
            response = httpx.get(f"{base}/api/models", timeout=left)
        except httpx.HTTPError as error:
            raise NotServing(f"selfattn serve did not answer: {type(error).__name__}") from None
        if response.status_code != 200:
            raise NotServing(f"selfattn serve answered /api/models with {response.status_code}")
        return process, base
    except BaseException:
        process.kill()
        process.wait()
        raise


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


async def long_bursts(base: str, size: int, rounds: int, result: Result) -> None:
    """``rounds`` bursts of each long call: ``size`` requests at once, each from a client of
    its own (made beforehand: not timed), and until the burst's first 200 one more request every
    ``PROBE_EVERY`` seconds (sent while runs go on, every place taken: from that answer on, a
    place is free and the next request sent would be admitted, one more run). None is retried;
    the latency of a 200 or 503 goes to ``result.bursts``, anything else to its errors. No
    request has a timeout of its own: :func:`within` bounds the whole."""

    async def send(
        http: httpx.AsyncClient,
        label: str,
        sent: str,
        path: str,
        body: dict,
        ran: asyncio.Event | None = None,
    ) -> None:
        start = time.perf_counter()
        try:
            response = await http.post(path, json=body)
        except httpx.HTTPError as error:
            result.errors[f"{type(error).__name__} {path}"] += 1
            return
        if ran is not None and response.status_code == 200:
            ran.set()
        if response.status_code in (200, 503):
            latency = time.perf_counter() - start
            result.bursts.setdefault((label, sent, response.status_code), []).append(latency)
        else:
            result.errors[f"{response.status_code} {path}"] += 1

    for label, path, body in LONG_CALLS:
        for _ in range(rounds):
            # new clients every round: an idle connection kept from the last round may be one
            # the server is closing (uvicorn closes them after 5 s)
            *clients, prober = [
                httpx.AsyncClient(base_url=base, timeout=None) for _ in range(size + 1)
            ]
            ran = asyncio.Event()  # the burst's first 200: a place is free from then on
            first = asyncio.ensure_future(ran.wait())
            try:
                burst = asyncio.gather(
                    *(send(c, label, "at once", path, body, ran) for c in clients)
                )
                probes = []  # one every PROBE_EVERY s until the first run answers (or none does)
                while not (
                    await asyncio.wait(
                        {burst, first}, timeout=PROBE_EVERY, return_when=asyncio.FIRST_COMPLETED
                    )
                )[0]:
                    probes.append(asyncio.create_task(send(prober, label, "later", path, body)))
                await asyncio.gather(burst, *probes)
            finally:
                first.cancel()
                await asyncio.gather(*(http.aclose() for http in (*clients, prober)))


def within(part: str, work: Coroutine, timeout: float) -> None:
    """Run ``work`` to its end, or raise a TimeoutError that names ``part`` and the limit."""
    try:
        asyncio.run(asyncio.wait_for(work, timeout))
    except TimeoutError:
        raise TimeoutError(f"the {part} did not finish within --timeout {timeout:g} s") from None


def measure(
    requests: int = 200,
    clients: int = 8,
    timeout: float = 300.0,
    at_once: int = 16,
    rounds: int = 3,
) -> Result:
    """Start a server, warm it up (one round of every call per client), then the burst, then
    ``rounds`` bursts of ``at_once`` long requests per long call (none if ``at_once`` is 0)."""
    process, base = start_server()
    try:
        warm = Result(len(CALLS) * clients, clients, 0.0)
        within("warm-up", burst(base, warm.requests, clients, warm), timeout)
        result = Result(requests, clients, 0.0, errors=Counter(warm.errors), busy=warm.busy)
        result.rss_before = memory(process.pid)[0]
        start = time.perf_counter()
        within("burst", burst(base, requests, clients, result), timeout)
        result.seconds = time.perf_counter() - start
        result.rss_after, result.rss_peak = memory(process.pid)
        if at_once:
            within("bursts of long requests", long_bursts(base, at_once, rounds, result), timeout)
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
    lines += [f"| {label} | {milliseconds(values)} |" for label, values in rows if values]
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
    if result.bursts:
        lines += [
            "",
            f"Bursts of long requests ({len(LONG):,} characters, 464 tokens), sent at once or "
            "later, until the first answer (every place taken), none retried:",
            "",
            "| calls | sent | answer | requests | p50 ms | p90 ms | p99 ms | max ms |",
            "|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for (label, sent, status), values in sorted(result.bursts.items()):
            lines.append(f"| {label} | {sent} | {status} | {milliseconds(values)} |")
    return "\n".join(lines)


def milliseconds(values: list[float]) -> str:
    """A table's cells for ``values`` (seconds): their count, then p50, p90, p99 and max in ms."""
    p50, p90, p99, top = (1000 * percentile(values, q) for q in (50, 90, 99, 100))
    return f"{len(values)} | {p50:.0f} | {p90:.0f} | {p99:.0f} | {top:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests in the burst")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds for each part: the warm-up, the burst, the bursts of long requests",
    )
    parser.add_argument(
        "--burst", type=int, default=16, help="long requests sent at once (0: no bursts)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="bursts per long call")
    args = parser.parse_args()
    if min(args.requests, args.clients, args.rounds) < 1 or args.burst < 0 or args.timeout <= 0:
        parser.error(
            "--requests, --clients and --rounds must be at least 1, --burst at least 0, "
            "--timeout above 0"
        )
    try:
        result = measure(args.requests, args.clients, args.timeout, args.burst, args.rounds)
    except (TimeoutError, NotServing) as error:
        sys.exit(f"serve_load.py: {error}")
    print(table(result))
    if result.errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
