"""Our Triton attention kernels against torch SDPA (flash and cuDNN backends) on one GPU.

First checks correctness on a few shapes (bf16, against the explicit path in float64, within
twice SDPA's own error plus a small floor), then prints a markdown table of TFLOP/s, forward
and backward, for head dims 64 and 128, T from 512 to 16,384 with B·T = 16,384 tokens and a
model width of 2,048 (H = 2048 / D), causal and not, with ours over each SDPA backend (the
TFLOP/s ratio: above 1, ours is faster). All timings come from CUDA events in the same run.
On an sm_90 GPU it also checks the Gluon forward (``hopper_forward``) in a child process
first; the tilings that pass are timed against the Triton forward (``forward_kernel =
"auto"``) and "ours" is whichever wins. A last, short table repeats the shortest and longest
T with the heads in a layer's layout (transposed views). Last, ring attention's Triton blocks
(``block_forward``/``block_backward``, one configuration each) are checked against the
explicit path: one GPU cannot run the ring itself over NCCL.

FLOPs counted: forward 4·B·H·T²·D (two matmuls), backward 2.5× that; both halved when causal.

    python benchmarks/gpu_attention.py                   # on a CUDA machine (a few minutes)
    python benchmarks/gpu_attention.py --interpret-smoke # CPU dry run of the same logic, tiny

``--interpret-smoke`` runs everything through Triton's interpreter on CPU float32 tensors
with tiny shapes and a wall-clock timer: it checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from selfattn.attention import attention  # imports triton only when the kernels first run

TOKENS = 16_384  # B·T
WIDTH = 2_048  # H·D
LENGTHS = (512, 1024, 2048, 4096, 8192, 16_384)
HEAD_DIMS = (64, 128)
SMOKE_LENGTHS, SMOKE_HEAD_DIMS = [16, 32], [16]  # --interpret-smoke's, whatever is asked
ABS_FLOOR = 1e-3  # bf16 floor added to twice SDPA's error


def parse_args() -> argparse.Namespace:
    """The command line, its sizes checked (one-line errors) before any device time."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--interpret-smoke",
        action="store_true",
        help=f"dry run on CPU under TRITON_INTERPRET=1 with its own tiny shapes (T in "
        f"{SMOKE_LENGTHS}, D in {SMOKE_HEAD_DIMS}: it ignores --lengths and --head-dims); "
        "checks the script only",
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=LENGTHS, help="sequence lengths T to time"
    )
    parser.add_argument(
        "--head-dims", type=int, nargs="+", default=HEAD_DIMS, help="head dims D to time"
    )
    only.add_argument(
        "--check-hopper",
        type=int,
        nargs="*",
        metavar="INDEX",
        help="only check the Gluon kernels (forward tilings, then the backward), these or all "
        "(the full run does this in child processes)",
    )
    args = parser.parse_args()
    for option, values in (("--lengths", args.lengths), ("--head-dims", args.head_dims)):
        if min(values) < 1:
            parser.error(f"{option} must be at least 1, got {min(values)}")
    if torch.cuda.is_available() and not args.interpret_smoke:  # the smoke run loads triton later
        from selfattn.kernels.triton_attention import MAX_HEAD_DIM

        if max(args.head_dims) > MAX_HEAD_DIM:
            parser.error(
                f"--head-dims {max(args.head_dims)}: the kernels take up to {MAX_HEAD_DIM}"
            )
    return args


@dataclass(frozen=True)
class Setting:
    """Where and how big: the device, the dtype, B·T and H·D; ``smoke`` for the tiny CPU run."""

    device: torch.device
    dtype: torch.dtype
    tokens: int
    width: int
    smoke: bool = False


def elapsed_ms(fn: Callable[[], object], device: torch.device, budget_ms: float = 200.0) -> float:
    """Mean milliseconds per call of ``fn``: CUDA events on a GPU, the wall clock on CPU.

    The first call is a warm-up (it compiles and autotunes); a second, timed alone, sizes the
    repeat count to spend about ``budget_ms``; the repeats then run back to back between two
    events, so launch overhead overlaps with the previous call's work as it does in a model.
    """
    if device.type != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    repeats = max(3, min(200, int(budget_ms / max(begin.elapsed_time(end), 1e-3))))
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeats


def forward_flops(batch: int, heads: int, length: int, head_dim: int, causal: bool) -> float:
    """4·B·H·T²·D: QKᵀ and PV, two multiply-adds per product; causal does half."""
    flops = 4.0 * batch * heads * length * length * head_dim
    return flops / 2 if causal else flops


def sdpa_backends() -> dict[str, Callable | None]:
    """torch SDPA restricted to one backend each, or None where this torch has no such switch."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {"flash": None, "cudnn": None}
    found = {}
    for name, member in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
        backend = getattr(SDPBackend, member, None)
        found[name] = None if backend is None else _pinned_sdpa(sdpa_kernel, backend)
    return found


def _pinned_sdpa(sdpa_kernel, backend) -> Callable:
    def run(q, k, v, causal: bool):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def ours(q, k, v, causal: bool):
    return attention(q, k, v, causal=causal, backend="triton")


def correctness_cases(setting: Setting) -> list[tuple[int, int, int, int, int, bool, bool]]:
    """(B, H, T, S, D, causal, key-padding mask) for ``check_correctness``: lengths that are
    no multiple of 16, so that the kernels' checks at ragged edges run as compiled for them."""
    if setting.smoke:
        return [(1, 2, 33, 33, 16, False, False), (1, 2, 7, 40, 16, True, True)]
    return [
        (2, 4, 1000, 1000, 128, False, False),
        (2, 4, 1000, 1000, 128, True, False),
        (2, 4, 300, 1000, 64, True, True),
    ]


def correctness_inputs(case: tuple, device: torch.device) -> tuple:
    """A correctness case's float64 q, k, v, output gradient and mask (or None), on the CPU;
    ``device`` only names where the mask will go."""
    batch, heads, t, s, d, causal, padded = case
    generator = torch.Generator(device="cpu").manual_seed(t * s + d)
    q, k, v = (
        torch.randn(batch, heads, n, d, generator=generator, dtype=torch.float64) for n in (t, s, s)
    )
    grad = torch.randn(batch, heads, t, d, generator=generator, dtype=torch.float64)
    mask = None
    if padded:
        lengths = torch.tensor([s, s * 2 // 3])[:batch]
        mask = (torch.arange(s) < lengths[:, None])[:, None, None, :]
    return q, k, v, grad, mask, causal, device


def check_correctness(setting: Setting) -> bool:
    """Ours within twice SDPA's error (same dtype) of the float64 explicit path, with grads,
    under each backward plan (split dQ kernel, or dQ added with atomics)."""
    from selfattn.kernels import triton_attention

    print("## Correctness (max abs error against float64; ours / torch SDPA, same dtype)\n")
    print("| B | H | T | S | D | causal | mask | backward | output | dQ | dK | dV | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    all_ok = True
    for case in correctness_cases(setting):
        batch, heads, t, s, d, causal, padded = case
        inputs = correctness_inputs(case, setting.device)
        want = output_and_grads("explicit", torch.float64, *inputs)
        base = output_and_grads("sdpa", setting.dtype, *inputs)
        for plan in triton_attention.BACKWARD_PLANS:
            triton_attention.backward_plan = plan
            try:
                got = output_and_grads("triton", setting.dtype, *inputs)
            finally:
                triton_attention.backward_plan = "auto"
            measured = errors(got, base, want)
            cells = [f"{error:.1e} / {base_error:.1e}" for error, base_error, _ in measured]
            ok = all(within for _, _, within in measured)
            all_ok = all_ok and ok
            row = [batch, heads, t, s, d, causal, padded, plan, *cells, "yes" if ok else "**NO**"]
            print("| " + " | ".join(str(cell) for cell in row) + " |")
    print()
    return all_ok


def check_ring_blocks(setting: Setting) -> bool:
    """Ring attention's Triton blocks: queries against an earlier key block and the diagonal
    one, each by ``block_forward``, merged by log-sum-exp as ring.py merges them, then
    ``block_backward`` of each from the merged output, against attention over all the keys
    (float64); within twice SDPA's error, output and gradients."""
    from selfattn.kernels.chunked import LOG2E
    from selfattn.kernels.ring import _merge
    from selfattn.kernels.triton_attention import block_backward, block_forward

    n, t, d = (8, 1024, 128) if not setting.smoke else (2, 16, 16)
    print("## Ring attention's blocks (max abs error against float64; ours / torch SDPA)\n")
    print("| N | T | S | D | causal | output | dQ | dK | dV | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    all_ok = True
    for causal in (False, True):
        generator = torch.Generator(device="cpu").manual_seed(7)
        q, k, v, grad = (
            torch.randn(n, length, d, generator=generator, dtype=torch.float64)
            for length in (t, 2 * t, 2 * t, t)
        )
        want = output_and_grads(
            "explicit", torch.float64, q, k, v, grad, None, causal, setting.device
        )
        base = output_and_grads("sdpa", setting.dtype, q, k, v, grad, None, causal, setting.device)
        query, key, value, grad_out = (x.to(setting.device, setting.dtype) for x in (q, k, v, grad))
        blocks = [(slice(0, t), False), (slice(t, 2 * t), causal)]  # earlier keys, diagonal
        output = torch.zeros(n, t, d, device=setting.device)  # merged as ring.py merges
        lse = torch.full((n, t, 1), -math.inf, device=setting.device)  # natural; -inf: no key
        for cols, block_causal in blocks:
            block_out, block_lse = block_forward(
                query, key[:, cols], value[:, cols], causal=block_causal, scale=d**-0.5
            )
            _merge(output, lse, block_out, block_lse, LOG2E)  # block_lse is in base 2
        grads = [
            block_backward(
                grad_out, query, key[:, cols], value[:, cols], output, lse * LOG2E,
                causal=block_causal, scale=d**-0.5,
            )
            for cols, block_causal in blocks
        ]  # fmt: skip
        got = [
            output.double(),
            sum(dq for dq, _, _ in grads).double(),
            torch.cat([dk for _, dk, _ in grads], dim=1).double(),
            torch.cat([dv for _, _, dv in grads], dim=1).double(),
        ]
        measured = errors(got, base, want)
        ok = all(within for _, _, within in measured)
        all_ok = all_ok and ok
        cells = [f"{error:.1e} / {base_error:.1e}" for error, base_error, _ in measured]
        row = [n, t, 2 * t, d, causal, *cells, "yes" if ok else "**NO**"]
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    print()
    return all_ok


def output_and_grads(
    backend: str, dtype: torch.dtype, q, k, v, grad, mask, causal: bool, device: torch.device
) -> list[torch.Tensor]:
    """Output, dQ, dK, dV of one backend in one dtype, as float64."""
    leaves = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
    mask = None if mask is None else mask.to(device)
    out = attention(*leaves, mask=mask, causal=causal, backend=backend)
    grads = torch.autograd.grad(out, leaves, grad.to(device, dtype))
    return [x.detach().double() for x in (out, *grads)]


def check_every_config(setting: Setting, kernel: str) -> bool:
    """Each tuning choice of one autotuned kernel ("forward", "dk/dv", "dq") forced in turn,
    checked: the output for the forward, the gradients (under each backward plan that runs
    the kernel) for the others.

    The autotuner picks one configuration per shape, so the correctness check below sees only
    the winners; this runs every configuration on a ragged causal case and on even unmasked
    ones. A configuration that fails is dropped from the autotuner for the rest of the run,
    and reported.
    """
    from selfattn.kernels import triton_attention

    autotuned = triton_attention.AUTOTUNED[kernel]
    plans = {"forward": ["-"], "dk/dv": list(triton_attention.BACKWARD_PLANS)}
    plans = plans.get(kernel, ["split"])
    checked = slice(0, 1) if kernel == "forward" else slice(1, 4)  # output, or dQ dK dV
    cases = config_check_cases(setting)
    what = "the output" if kernel == "forward" else "the worst of dQ, dK, dV"
    print(f"## Every {kernel} configuration (max abs error of {what} against float64; ours / "
          "torch SDPA)\n")  # fmt: skip
    print(
        "| configuration | backward | "
        + " | ".join(f"T={t} D={d} causal={c}" for _, _, t, d, c in cases)
        + " | ok |"
    )
    print("|---|---|" + "---|" * (len(cases) + 1))  # fmt: skip
    inputs = []
    for batch, heads, t, d, causal in cases:
        generator = torch.Generator(device="cpu").manual_seed(t + d)
        q, k, v, grad = (torch.randn(batch, heads, t, d, generator=generator,
                                     dtype=torch.float64) for _ in range(4))  # fmt: skip
        case = (q, k, v, grad, None, causal, setting.device)
        want = output_and_grads("explicit", torch.float64, *case)[checked]
        base = output_and_grads("sdpa", setting.dtype, *case)[checked]
        inputs.append((case, want, base))
    all_configs, failed = list(autotuned.configs), []
    for config in all_configs:
        autotuned.configs = [config]
        for plan in plans:
            triton_attention.backward_plan = "auto" if plan == "-" else plan
            cells, ok = [], True
            for case, want, base in inputs:
                try:
                    got = output_and_grads("triton", setting.dtype, *case)[checked]
                except Exception as error:  # report, drop, go on
                    cells.append(f"failed: {first_line(error, 60)}")
                    ok = False
                    continue
                measured = errors(got, base, want)
                error, base_error, _ = max(measured, key=lambda row: row[0] / bound(row[1]))
                cells.append(f"{error:.1e} / {base_error:.1e}")
                ok = ok and all(within for _, _, within in measured)
            triton_attention.backward_plan = "auto"
            if not ok and config not in failed:
                failed.append(config)
            print(f"| {triton_attention.describe_config(config)} | {plan} | " + " | ".join(cells)
                  + f" | {'yes' if ok else '**NO**'} |", flush=True)  # fmt: skip
    autotuned.configs = [config for config in all_configs if config not in failed]
    autotuned.cache.clear()  # what it tuned meanwhile (a backward for a forward's check) may
    triton_attention.plan_timings.clear()  # be a dropped configuration, or timed with one
    print()
    if failed:
        print(f"Dropped from the autotuner for this run: {len(failed)} failing configuration(s).\n")
    return not failed


HOPPER_STALL_SECONDS = 60  # the check silent this long: the kernel it is on hangs
HOPPER_CHECK_SECONDS = 240  # all of the Gluon check; kernels not reached by then are left out
CHECKING = "Checking Gluon kernel"
PASSED = "Gluon kernel passed:"
CHECK_DONE = "Gluon check done."


def check_hopper_kernels(setting: Setting) -> None:
    """Check the Gluon kernels for Hopper in child processes; time only those that pass.

    Gluon has no CPU interpreter, so this is the kernels' first run anywhere, and a kernel
    that waits on a wrong barrier phase hangs: the child (``--check-hopper``) says which
    kernel it is on, and if it falls silent for HOPPER_STALL_SECONDS it is killed and a new
    one checks the kernels after that one. The forward tilings that pass join the timed run,
    where ``forward_kernel = "auto"`` times them against the Triton forward on each shape's
    first call and keeps the fastest; the backward, if it passes, joins the backward plans
    that "auto" times (``gluon_backward``).
    """
    from selfattn.kernels import hopper_backward, hopper_forward, triton_attention

    if setting.smoke or torch.cuda.get_device_capability() != (9, 0):
        print("## Gluon kernels (Hopper): skipped, they run on an sm_90 GPU only.\n")
        return
    every = gluon_candidates()
    passed = set()
    todo = list(range(len(every)))
    deadline = time.monotonic() + HOPPER_CHECK_SECONDS
    while todo:
        lines, stopped_at, why = run_check_child(todo, deadline)
        print("".join(lines))
        passed |= {line.removeprefix(PASSED).strip() for line in lines if line.startswith(PASSED)}
        if stopped_at is None:
            break
        if time.monotonic() >= deadline:
            left = ", ".join(every[i] for i in todo[todo.index(stopped_at) :])
            print(f"Gluon check out of its {HOPPER_CHECK_SECONDS} s: left out {left}.\n")
            break
        print(f"{every[stopped_at]}: {why}; left out, the rest checked anew.\n")
        todo = todo[todo.index(stopped_at) + 1 :]
    for module in (hopper_forward, hopper_backward):
        module.CONFIGS = tuple(c for c in module.CONFIGS if c.describe() in passed)
    if hopper_forward.CONFIGS:
        triton_attention.forward_kernel = "auto"
    triton_attention.gluon_backward = bool(hopper_backward.CONFIGS)
    print(f"Gluon tilings in the timed run: {len(hopper_forward.CONFIGS)} forward, "
          f"{len(hopper_backward.CONFIGS)} backward.\n")  # fmt: skip


def check_command(indices: list[int]) -> list[str]:
    """The child that checks the Gluon kernels at these indices of ``gluon_candidates()``."""
    return [sys.executable, __file__, "--check-hopper", *map(str, indices)]


def run_check_child(indices: list[int], deadline: float) -> tuple[list[str], int | None, str]:
    """Run the check child on these kernels: its output lines, and None if it finished, or
    the index of the kernel it was on when it stopped, and why: killed, silent for
    HOPPER_STALL_SECONDS (a hang) or past ``deadline`` (``time.monotonic``), or dead before
    the end (a kernel that broke the CUDA context, after which nothing runs there)."""
    child = subprocess.Popen(
        check_command(indices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    arriving: queue.Queue[str | None] = queue.Queue()

    def forward_lines() -> None:
        for line in child.stdout:
            arriving.put(line)
        arriving.put(None)

    threading.Thread(target=forward_lines, daemon=True).start()
    lines, current = [], indices[0]
    while True:
        wait = min(HOPPER_STALL_SECONDS, deadline - time.monotonic())
        try:
            line = arriving.get(timeout=max(wait, 0))
        except queue.Empty:
            child.kill()
            child.wait()
            return lines, current, f"silent for {HOPPER_STALL_SECONDS} s, killed (a hang)"
        if line is None:
            code = child.wait()
            if lines and lines[-1].startswith(CHECK_DONE):
                return lines, None, ""
            return lines, current, f"its process ended before the check did (exit {code})"
        lines.append(line)
        if line.startswith(CHECKING):  # "Checking Gluon kernel 3: ..."
            current = int(line.removeprefix(CHECKING).split(":")[0])


HOPPER_CHECK_CASES = [  # (B, H, T, S, D, causal, dtype, layout)
    (1, 4, 1024, 1024, 128, False, torch.bfloat16, "heads"),
    (2, 3, 256, 640, 64, False, torch.bfloat16, "heads"),
    (1, 2, 128, 128, 128, False, torch.bfloat16, "heads"),
    (1, 2, 384, 256, 64, False, torch.float16, "heads"),
    (1, 4, 1024, 1024, 128, True, torch.bfloat16, "heads"),
    (2, 3, 256, 640, 64, True, torch.bfloat16, "heads"),
    (2, 4, 512, 512, 128, False, torch.bfloat16, "interleaved"),  # a layer's (B, T, H, D)
    (2, 3, 256, 384, 64, True, torch.bfloat16, "interleaved"),
    (1, 2, 256, 640, 128, True, torch.float16, "interleaved"),
]


def gluon_candidates() -> list[str]:
    """What the Gluon check covers, by name: each tiling of the forward, then the backward's."""
    from selfattn.kernels import hopper_backward, hopper_forward

    configs = (*hopper_forward.CONFIGS, *hopper_backward.CONFIGS)
    return [config.describe() for config in configs]


def hopper_check_main(device: torch.device, indices: list[int] | None = None) -> int:
    """The child of ``check_hopper_kernels``: the Gluon kernels at these indices of
    ``gluon_candidates()`` (all if none) against float64, as the rest of this script checks
    ours: the output within twice SDPA's error (same dtype) and the gradients; for a forward
    tiling also its base-2 log-sum-exp within 1e-3 (the gradients then come from the Triton
    backward), for the backward the Triton forward's output. A case a kernel does not run
    for is not counted, and a kernel with no case counted does not pass."""
    from selfattn.kernels import hopper_backward, hopper_forward, triton_attention

    pin_plain_configs()
    print("## Gluon kernels for Hopper (max abs error against float64; ours / torch SDPA; "
          "LSE: ours)\n")  # fmt: skip
    print("| kernel | B, H, T, S, D, causal, dtype, layout | output | LSE | dQ | dK | dV | ok |")
    print("|---|---|---|---|---|---|---|---|")
    prepared = [hopper_check_inputs(*case, device) for case in HOPPER_CHECK_CASES]
    forwards = {config.describe(): config for config in hopper_forward.CONFIGS}
    backwards = {config.describe(): config for config in hopper_backward.CONFIGS}
    names = gluon_candidates()
    indices = indices or range(len(names))
    backward_runs = []
    run_backward = hopper_backward.hopper_backward

    def counted_backward(*args):
        backward_runs.append(args[1].shape)
        return run_backward(*args)

    hopper_backward.hopper_backward = counted_backward
    passed = []
    for index in indices:
        name, config = names[index], forwards.get(names[index])
        print(f"{CHECKING} {index}: {name}", flush=True)
        if config is None:  # a backward tiling, after the Triton forward
            triton_attention.forward_kernel, triton_attention.backward_plan = "triton", "gluon"
            hopper_backward.CONFIGS = (backwards[name],)
        else:
            triton_attention.forward_kernel, triton_attention.backward_plan = "gluon", "auto"
            hopper_forward.CONFIGS = (config,)
        cases_run, kernel_ok, notes = 0, True, []
        for (*shape, causal, dtype, layout), prepared_case in zip(
            HOPPER_CHECK_CASES, prepared, strict=True
        ):
            if config is not None and shape[-1] not in config.head_dims:
                continue
            runs_before, raised = len(backward_runs), False
            try:
                cells, note = check_case(config, shape, causal, dtype, prepared_case)
            except Exception as error:  # report it and go on with the next kernel
                note = f"failed: {first_line(error, 80)}"
                cells, raised = [note, "", "", "", ""], True
                if cuda_context_lost(device):  # nothing more runs in this process
                    print(f"| {name} | {shape} | " + " | ".join(cells) + " | **NO** |")
                    return 3
            if config is None and len(backward_runs) == runs_before and not raised:
                continue  # the Gluon backward does not apply to this case
            cases_run += 1
            kernel_ok = kernel_ok and note is None
            if note is not None:
                notes.append(f"{name}, {shape}, causal={causal}: {note}")
            label = ", ".join(
                str(x) for x in (*shape, causal, str(dtype).removeprefix("torch."), layout)
            )
            row = [name, label, *cells, "yes" if note is None else "**NO**"]
            print("| " + " | ".join(row) + " |", flush=True)
        if not cases_run:
            kernel_ok = False
            notes.append(f"{name}: no check case it runs for")
        for note in notes:
            print(f"- {note}")
        if kernel_ok:  # said at once: a later kernel that hangs must not cost this one
            passed.append(name)
            print(f"{PASSED} {name}", flush=True)
    hopper_backward.hopper_backward = run_backward
    triton_attention.backward_plan = "auto"
    print(CHECK_DONE, flush=True)
    return 0 if len(passed) == len(indices) else 1


def check_case(config, shape: list[int], causal: bool, dtype: torch.dtype, prepared: tuple):
    """One case of the Gluon check: the table cells (output, LSE, dQ, dK, dV) and None if it
    passes, else a note on where it goes wrong (which part, which rows). ``config`` is a
    forward tiling, whose base-2 log-sum-exp is checked too, or None for the backward."""
    from selfattn.kernels import hopper_forward, triton_attention

    case, inputs, want_lse, base, want = prepared
    lse_cell, lse_ok = "-", True
    if config is not None:
        qk_scale = shape[-1] ** -0.5 * triton_attention.LOG2E
        _, lse = hopper_forward.hopper_forward(*inputs, causal, qk_scale, config)
        lse_error = (lse.double() - want_lse).abs().max().item()
        lse_cell, lse_ok = f"{lse_error:.1e}", lse_error <= 1e-3
    got = output_and_grads("triton", dtype, *case)
    measured = errors(got, base, want)
    cells = [f"{error:.1e} / {base_error:.1e}" for error, base_error, _ in measured]
    cells.insert(1, lse_cell)
    if lse_ok and all(within for *_, within in measured):
        return cells, None
    # Where it goes wrong says which part of the kernel to look at.
    first = next((i for i in range(4) if not measured[i][2]), 0)  # or only the LSE
    part = ("output", "dQ", "dK", "dV")[first]
    rows = "key" if part in ("dK", "dV") else "query"
    return cells, f"{part}: " + misses(got[first], want[first], bound(measured[first][1]), rows)


def cuda_context_lost(device: torch.device) -> bool:
    """Whether an error on ``device`` was a sticky one (an illegal address, say), which
    leaves its CUDA context unusable for the rest of the process."""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
    except Exception:
        return True
    return False


def pin_plain_configs() -> None:
    """Leave each Triton kernel's autotuner one plain configuration (no TMA, none of the
    switches, no register cap; the smallest tiles), for a check that needs a right Triton
    kernel beside a Gluon one, not a fast one: tuning would compile every configuration for
    each new dtype, head dim and causal setting, minutes that the stall timer would take
    for a hang."""
    from selfattn.kernels.triton_attention import AUTOTUNED

    for autotuned in AUTOTUNED.values():
        plain = [
            config
            for config in autotuned.configs
            if config.maxnreg is None and not any(value is True for value in config.kwargs.values())
        ]
        autotuned.configs = plain[-1:] or autotuned.configs[-1:]  # (the interpreter has one)


def misses(got: torch.Tensor, want: torch.Tensor, limit: float, rows: str = "query") -> str:
    """Where an output or gradient (B, H, T|S, D) is off: how many of its (query or key) rows
    exceed ``limit`` (or are not finite), and the first few of their positions."""
    row_error = (got - want).abs().amax(dim=-1)
    bad = (row_error > limit) | ~torch.isfinite(row_error)
    positions = bad.nonzero()[:, -1].unique()[:8].tolist()
    return f"{int(bad.sum())} of {bad.numel()} {rows} rows off; first at {positions}"


def hopper_check_inputs(batch, heads, t, s, d, causal, dtype, layout, device) -> tuple:
    """One case of the Gluon check, and what it must give: the inputs for
    ``output_and_grads``, the same in ``dtype`` on the device, the base-2 log-sum-exp of their
    scaled scores in float64 as (B·H, T), SDPA's output and gradients in ``dtype``, and
    float64's. Layout "interleaved" makes each input, and the output's gradient, a
    (B, H, T, D) view of a (B, T, H, D) tensor, as a layer splitting heads does; "heads"
    makes them contiguous."""
    generator = torch.Generator(device="cpu").manual_seed(t + s + d)

    def sample(length: int) -> torch.Tensor:
        if layout == "interleaved":
            shape = (batch, length, heads, d)
            return torch.randn(*shape, generator=generator, dtype=torch.float64).transpose(1, 2)
        return torch.randn(batch, heads, length, d, generator=generator, dtype=torch.float64)

    q, k, v, grad = sample(t), sample(s), sample(s), sample(t)
    case = (q, k, v, grad, None, causal, device)
    inputs = [x.to(device, dtype) for x in (q, k, v)]  # .to keeps the layout
    scores = inputs[0].double() @ inputs[1].double().transpose(-1, -2) * d**-0.5
    if causal:  # bottom-right: query i sees keys j <= i + S - T
        hidden = torch.ones(t, s, dtype=torch.bool, device=device).triu(s - t + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    want_lse = (torch.logsumexp(scores, dim=-1) / math.log(2)).reshape(-1, t)
    base = output_and_grads("sdpa", dtype, *case)
    want = output_and_grads("explicit", torch.float64, *case)
    return case, inputs, want_lse, base, want


def config_check_cases(setting: Setting) -> list[tuple[int, int, int, int, bool]]:
    """(B, H, T, D, causal) for the per-configuration checks: a ragged causal case and even
    unmasked ones. The ragged length, 1,008, is a multiple of 16 (not of any tile), so Triton
    compiles the specialisation the timed lengths use: the check compiles nothing more."""
    if setting.smoke:
        return [(1, 2, 33, 16, True), (1, 2, 64, 16, False)]
    return [(2, 4, 1008, 128, True), (1, 8, 1024, 128, False), (1, 8, 1024, 64, False)]


def bound(base_error: float) -> float:
    """The most error ours may have: twice SDPA's, plus the bf16 floor."""
    return 2 * base_error + ABS_FLOOR


def errors(got, base, want) -> list[tuple[float, float, bool]]:
    """Per tensor: our max abs error, SDPA's, and whether ours is finite and within bound."""
    rows = []
    for ours_x, base_x, want_x in zip(got, base, want, strict=True):
        error = (ours_x - want_x).abs().max().item()
        base_error = (base_x - want_x).abs().max().item()
        rows.append(
            (error, base_error, bool(torch.isfinite(ours_x).all()) and error <= bound(base_error))
        )
    return rows


def precompile(setting: Setting, head_dims: list[int]) -> None:
    """Compile every kernel configuration the run will need, on all CPU cores, up front.

    The autotuner compiles its configurations one at a time as each shape first comes up;
    with about 150 of them that took minutes of device time. Triton's AsyncCompileMode
    compiles launches made with ``warmup=True`` on a thread pool (its compiler releases the
    GIL: two threads compile twice as fast on 2 cores) and files them in the cache the real
    launches read. A failure costs only the time this would have saved: the run then compiles
    as it goes.
    """
    import triton

    from selfattn.kernels import triton_attention as kernels

    started = time.perf_counter()
    threads = os.cpu_count() or 1
    count = 0
    try:
        launches = record_launches(setting, head_dims)
        # ignore_errors: a configuration that fails to compile fails again, reported, when
        # the autotuner gets to it; and the async mode always ends, even after an error here.
        with ThreadPoolExecutor(threads) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
            for name, args, kwargs in launches:
                autotuned = kernels.AUTOTUNED[name]
                named = dict(zip(autotuned.arg_names, args, strict=False))
                for config in autotuned.early_config_prune(autotuned.configs, named, **kwargs):
                    autotuned.fn.run(*args, **{**kwargs, "warmup": True}, **config.all_kwargs())
                    count += 1
    except Exception as error:  # the run still works, compiling as it goes
        print(f"Precompiling stopped ({first_line(error)}); the autotuner compiles the rest.\n")
        return
    seconds = time.perf_counter() - started
    print(f"Precompiled {count} kernel launches on {threads} threads in {seconds:.0f} s.\n")


def record_launches(setting: Setting, head_dims: list[int]) -> list[tuple[str, tuple, dict]]:
    """The autotuned kernels' launches (name, args, kwargs) for every head dim and causal
    setting the run uses, under each backward plan: recorded, not made.

    The timed lengths and the configuration checks' are multiples of 16, so one length stands
    for all of them: Triton compiles one specialisation per head dim, causality and
    configuration. The correctness cases' lengths are not (nor is their mask), so each of
    them is replayed as it is.
    """
    from selfattn.kernels import triton_attention as kernels

    launches = []

    def recorder(name: str) -> Callable:
        return lambda *args, **kwargs: launches.append((name, args, kwargs))

    cases = {(head_dim, causal) for *_, head_dim, causal in config_check_cases(setting)}
    cases |= {(head_dim, causal) for head_dim in head_dims for causal in (False, True)}
    length = 32 if setting.smoke else 1024
    for name, autotuned in kernels.AUTOTUNED.items():
        autotuned.run = recorder(name)
    try:
        for head_dim, causal in sorted(cases):
            heads = max(1, setting.width // head_dim)
            q, k, v = (
                torch.randn(1, heads, length, head_dim, device=setting.device,
                            dtype=setting.dtype, requires_grad=True)
                for _ in range(3)
            )  # fmt: skip
            for plan in kernels.BACKWARD_PLANS:
                kernels.backward_plan = plan
                out = attention(q, k, v, causal=causal, backend="triton")
                torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        for case in correctness_cases(setting):
            for plan in kernels.BACKWARD_PLANS:
                kernels.backward_plan = plan
                output_and_grads("triton", setting.dtype, *correctness_inputs(case, setting.device))
    finally:
        kernels.backward_plan = "auto"
        for autotuned in kernels.AUTOTUNED.values():
            vars(autotuned).pop("run", None)  # the autotuner's own method again
    return launches


def first_line(error: Exception, width: int = 100) -> str:
    """An error's first line, cut to ``width`` characters, for a table cell or a note."""
    return (str(error).splitlines() or [type(error).__name__])[0][:width]


def time_one(run: Callable, q, k, v, causal: bool, device: torch.device) -> tuple[float, float]:
    """Milliseconds for the forward pass and for the backward pass alone."""
    forward_ms = elapsed_ms(lambda: run(q, k, v, causal), device)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = run(*leaves, causal)
    grad = torch.randn_like(out)
    backward_ms = elapsed_ms(
        lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True), device
    )
    return forward_ms, backward_ms


def throughput_header(names: list[str]) -> list[str]:
    """The timed columns of both tables: TFLOP/s per backend, forward then backward, then
    ours over each other backend (a TFLOP/s ratio: above 1, ours is faster)."""
    header = [f"{name} {part}" for part in ("fwd", "bwd") for name in names]
    return header + [f"ours/{name} {part}" for part in ("fwd", "bwd") for name in names[1:]]


def throughput_table(setting: Setting, lengths: list[int], head_dims: list[int]) -> None:
    """One row per (D, causal, T): TFLOP/s forward and backward for ours and SDPA's backends,
    and ours over each of them."""
    from selfattn.kernels.triton_attention import (
        AUTOTUNED,
        autotune_timings,
        plan_timings,
        tuned_configs,
    )

    backends = {"ours": ours, **sdpa_backends()}
    names = list(backends)
    print("## Throughput (TFLOP/s; fwd = 4·B·H·T²·D, bwd = 2.5× fwd, halved when causal)\n")
    header = ["D", "causal", "T", "B", "H", *throughput_header(names)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    notes, noted = [], set()  # noted: plan timings already in the notes
    for head_dim in head_dims:
        heads = max(1, setting.width // head_dim)
        for causal in (False, True):
            for length in lengths:
                batch = max(1, setting.tokens // length)
                q, k, v = (
                    torch.randn(batch, heads, length, head_dim, device=setting.device,
                                dtype=setting.dtype)
                    for _ in range(3)
                )  # fmt: skip
                flops = forward_flops(batch, heads, length, head_dim, causal)
                cells = timed_cells(backends, (q, k, v), causal, flops, setting.device, notes)
                row = [head_dim, causal, length, batch, heads, *cells]
                print("| " + " | ".join(str(cell) for cell in row) + " |", flush=True)
            notes.append(f"ours, D={head_dim}, causal={causal}, T={length}: {tuned_configs()}")
            for kernel in AUTOTUNED:
                notes.extend(f"  {kernel}: {line}" for line in autotune_timings(kernel))
            notes.extend(f"  {key[0]} choices, T and S buckets {key[2:4]}: " + ", ".join(
                f"{plan} {ms:.3f} ms" for plan, ms in timings.items())
                for key, timings in plan_timings.items() if key not in noted)  # fmt: skip
            noted.update(plan_timings)
    print()
    for note in notes:
        print(f"- {note}")
    print()


def timed_cells(backends: dict, inputs, causal: bool, flops: float, device, notes: list) -> list:
    """The cells of ``throughput_header`` for one input: TFLOP/s of each backend ("n/a" where
    it is missing or fails, with the failure added to ``notes``), then ours over the others
    ("—" where either is n/a)."""
    forward, backward = {}, {}
    for name, run in backends.items():
        forward[name] = backward[name] = None
        if run is not None:
            try:
                forward_ms, backward_ms = time_one(run, *inputs, causal, device)
            except Exception as error:  # a backend that refuses or fails here
                shape = "x".join(str(size) for size in inputs[0].shape)
                notes.append(f"{name}, {shape}: {first_line(error)}")
                continue
            forward[name] = flops / forward_ms / 1e9
            backward[name] = 2.5 * flops / backward_ms / 1e9
    rates = [*forward.values(), *backward.values()]
    cells = ["n/a" if rate is None else f"{rate:.4g}" for rate in rates]
    for part in (forward, backward):
        ours_rate, others = part["ours"], list(part.values())[1:]
        cells += [
            "—" if None in (ours_rate, rate) else f"{ours_rate / rate:.2f}" for rate in others
        ]
    return cells


def layout_table(setting: Setting, lengths: list[int], head_dim: int) -> None:
    """The shortest and longest T again, with the heads as a model's layer hands them over: a
    (B, H, T, D) view of a (B, T, H, D) projection. Ours reads and writes that layout in
    place, as torch's SDPA does; this shows what it costs against contiguous inputs."""
    backends = {"ours": ours, **sdpa_backends()}
    heads = max(1, setting.width // head_dim)
    print("## Layer layout: (B, H, T, D) views of (B, T, H, D) tensors (TFLOP/s, not causal)\n")
    header = ["D", "T", "B", "H", *throughput_header(list(backends))]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    notes = []
    for length in sorted({lengths[0], lengths[-1]}):
        batch = max(1, setting.tokens // length)
        inputs = [
            torch.randn(batch, length, heads, head_dim, device=setting.device,
                        dtype=setting.dtype).transpose(1, 2)
            for _ in range(3)
        ]  # fmt: skip
        flops = forward_flops(batch, heads, length, head_dim, False)
        cells = timed_cells(backends, inputs, False, flops, setting.device, notes)
        print("| " + " | ".join(str(x) for x in [head_dim, length, batch, heads, *cells]) + " |")
    print()
    for note in notes:
        print(f"- {note}")


def describe(setting: Setting) -> None:
    import triton  # here, not at the top: --interpret-smoke sets TRITON_INTERPRET first

    name = torch.cuda.get_device_name() if setting.device.type == "cuda" else "CPU interpreter"
    print(f"# GPU attention: {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{str(setting.dtype).removeprefix('torch.')}\n")  # fmt: skip


def main() -> int:
    args = parse_args()
    if not (args.interpret_smoke or torch.cuda.is_available()):
        print("No CUDA device: this benchmark needs a GPU (try --interpret-smoke on CPU).")
        return 1
    if args.check_hopper is not None:
        return hopper_check_main(torch.device("cuda"), args.check_hopper)
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        setting = Setting(torch.device("cpu"), torch.float32, tokens=64, width=32, smoke=True)
        lengths, head_dims = SMOKE_LENGTHS, SMOKE_HEAD_DIMS
    else:
        setting = Setting(torch.device("cuda"), torch.bfloat16, TOKENS, WIDTH)
        lengths, head_dims = args.lengths, args.head_dims
    started = time.perf_counter()
    describe(setting)
    precompile(setting, head_dims)
    correct = all([check_every_config(setting, kernel) for kernel in ("forward", "dk/dv", "dq")])
    correct = check_correctness(setting) and correct
    check_hopper_kernels(setting)
    throughput_table(setting, lengths, head_dims)
    layout_table(setting, lengths, head_dims[-1])
    pin_plain_configs()  # last: a right kernel for the blocks' float32 outputs, not a fast one
    correct = check_ring_blocks(setting) and correct
    print(f"Total time: {time.perf_counter() - started:.0f} s")
    if not correct:
        print("Correctness check FAILED: the throughput above is for a wrong kernel.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
