"""A small training loop that knows nothing about the model it trains.

It takes a model whose ``forward(x, y)`` returns an object with a ``.loss``, an optimizer, a
:class:`BatchSource` and a :class:`TrainConfig`, and runs AdamW steps with warm-up and cosine
decay, gradient clipping and periodic evaluation on held-out batches. Under torch.distributed
the model is a DistributedDataParallel wrapper and the loop averages what it reports.
"""

from __future__ import annotations

import math
import numbers
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Protocol, runtime_checkable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import Tensor, nn

from selfattn.errors import SelfAttnError, is_real
from selfattn.models.model import evaluating
from selfattn.train import distributed


@dataclass(frozen=True)
class TrainConfig:
    """How to train: batch shape, step count, learning-rate schedule, AdamW, evaluation."""

    max_iters: int  # total optimizer steps, counted from the first run when resuming
    batch_size: int  # sequences per step and process (global batch = batch_size × world)
    block_size: int  # tokens per sequence
    learning_rate: float  # peak, reached after warm-up
    min_lr: float  # floor of the cosine decay
    warmup_iters: int
    lr_decay_iters: int  # step at which the cosine reaches min_lr (then it stays there)
    weight_decay: float = 0.1  # on tensors of 2+ dims only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    eval_interval: int = 250  # steps between evaluations (and checkpoints)
    eval_iters: int = 20  # held-out batches per evaluation
    log_interval: int = 10  # steps between progress-bar updates
    seed: int = 1337

    def __post_init__(self) -> None:
        counts = ("max_iters", "batch_size", "block_size", "eval_interval", "eval_iters")
        whole = (*counts, "log_interval", "lr_decay_iters", "warmup_iters", "seed")
        for name in whole:  # 5e3 from Python is 5000; 2.5 steps or "100" is no count
            object.__setattr__(self, name, whole_number(name, getattr(self, name)))
        reals = ("learning_rate", "min_lr", "weight_decay", "beta1", "beta2", "grad_clip")
        for name in reals:
            if not is_real(getattr(self, name)):
                raise ValueError(f"{setting(name, repr(getattr(self, name)))} must be a number")
            object.__setattr__(self, name, float(getattr(self, name)))
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{self._setting(name)} must be a finite number")
        for name in (*counts, "log_interval", "lr_decay_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self._setting(name)} must be at least 1")
        if not -SEED_LIMIT < self.seed < SEED_LIMIT:  # torch's generators take 64 bits
            raise ValueError(
                f"{self._setting('seed')} is out of range; choose one between "
                f"-{SEED_LIMIT - 1} and {SEED_LIMIT - 1}"
            )
        for name in ("learning_rate", "min_lr"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self._setting(name)} must be above 0")
        for name in ("warmup_iters", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{self._setting(name)} must be 0 or more")
        if self.min_lr > self.learning_rate:
            raise ValueError(
                f"{self._setting('min_lr')} is above {self._setting('learning_rate')}; lower "
                f"--min-lr to {self.learning_rate} or less, or raise --lr"
            )
        if self.warmup_iters >= self.lr_decay_iters:
            raise ValueError(
                f"{self._setting('warmup_iters')} must be below "
                f"{self._setting('lr_decay_iters')}; raise --lr-decay-iters above "
                f"{self.warmup_iters} or lower --warmup-iters below {self.lr_decay_iters}"
            )
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{self._setting(name)} must be in [0, 1) (AdamW's betas)")

    def _setting(self, name: str) -> str:
        return setting(name, getattr(self, name))


# batch_seed's seed × 1,000,003 + 2·rank + split stays within torch's seeds, [-2⁶³, 2⁶⁴)
SEED_LIMIT = 2**63 // 1_000_003


def whole_number(name: str, value: object) -> int:
    """``value`` as the int it stands for (an integer, or a float like 5e3 with no fraction);
    a ValueError naming the setting for anything else (2.5, "100", True)."""
    if is_real(value):
        if isinstance(value, numbers.Integral):
            return int(value)
        if math.isfinite(value) and float(value).is_integer():
            return int(value)
    raise ValueError(f"{setting(name, repr(value))} must be a whole number")


def setting(name: str, value: object) -> str:
    """A setting as `selfattn train` takes it, then as Python does: "--lr 0.1 (learning_rate=
    in Python)", for messages that Python callers and the command line share."""
    return f"{flag(name)} {value} ({name}= in Python)"


def flag(name: str) -> str:
    """The `selfattn train` flag of a setting: "--lr" for learning_rate, "--n-embd" for n_embd."""
    return "--" + ("lr" if name == "learning_rate" else name.replace("_", "-"))


def learning_rate(step: int, config: TrainConfig) -> float:
    """nanoGPT's schedule for the step about to be taken (0-based): linear warm-up, cosine decay."""
    if step < config.warmup_iters:
        return config.learning_rate * (step + 1) / (config.warmup_iters + 1)
    if step > config.lr_decay_iters:
        return config.min_lr
    ratio = (step - config.warmup_iters) / (config.lr_decay_iters - config.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return config.min_lr + coeff * (config.learning_rate - config.min_lr)


def configure_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only (2+ dims), not biases or norms.

    Uses the fused kernel (CPU and CUDA in recent torch), else the multi-tensor one.
    """
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    options = {"lr": config.learning_rate, "betas": (config.beta1, config.beta2)}
    try:
        return torch.optim.AdamW(groups, fused=True, **options)
    except RuntimeError:
        return torch.optim.AdamW(groups, foreach=True, **options)


class BatchSource(Protocol):
    """Where batches come from: ``batch("train")`` or ``batch("val")`` gives (inputs, targets)."""

    def batch(self, split: str) -> tuple[Tensor, Tensor]: ...


@runtime_checkable
class Rewindable(Protocol):
    """A batch source whose generators can be read and put back (as RandomBatches')."""

    def state_dict(self) -> dict[str, Tensor]: ...

    def load_state_dict(self, state: dict[str, Tensor]) -> None: ...


@runtime_checkable
class StepSeeded(Protocol):
    """A batch source whose validation batches depend on the step evaluated only (as
    RandomBatches'): :func:`train` calls ``start_evaluation(step)`` before each evaluation."""

    def start_evaluation(self, step: int) -> None: ...


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: BatchSource,
    iters: int,
    split: str = "val",
    done: Callable[[int], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> float | None:
    """Mean loss over ``iters`` batches of ``split`` in eval mode, averaged across ranks;
    ``done(n)`` before the first batch (n = 0) and after each batch's forward pass has been
    queued (n batches so far). ``stop()`` is asked before each batch (under DDP it must answer
    alike on every rank): when true the evaluation is abandoned, None is returned and a
    :class:`Rewindable` source is put back where the evaluation found it (so that a resumed
    run draws the same batches)."""
    device = next(model.parameters()).device
    rewinds = stop is not None and isinstance(batches, Rewindable)
    start = batches.state_dict() if rewinds else None
    total = torch.zeros((), device=device)
    if done is not None:
        done(0)
    abandoned = False
    with evaluating(model):
        for index in range(iters):
            abandoned = stop is not None and stop()
            if abandoned:
                break
            x, y = batches.batch(split)
            total += model(x.to(device), y.to(device)).loss
            if done is not None:
                done(index + 1)
    if not abandoned:
        return distributed.mean_across_ranks(total / iters).item()
    if start is not None:
        batches.load_state_dict(start)
    return None


@dataclass
class TrainResult:
    """What one call of :func:`train` did."""

    start_step: int
    step: int  # steps completed in total
    losses: list[float]  # training loss of each step this call took (this rank's batch)
    history: list[dict[str, float]]  # evaluations: step, train (ranks' mean since last), val
    interrupted: bool = False
    signal: int | None = None  # what interrupted this rank: SIGINT, SIGTERM (None: another rank)
    train_seconds: float = 0.0  # time in training steps, without evaluation and checkpoints
    wall_seconds: float = 0.0
    tokens_per_step: int = 0  # global: batch_size × block_size × world size
    evaluations: int = 0  # evaluations this call ran (a resume may run only the one cut short)

    @property
    def ms_per_iter(self) -> float:
        steps = self.step - self.start_step
        return 1000 * self.train_seconds / steps if steps else float("nan")

    @property
    def tokens_per_second(self) -> float:
        steps = self.step - self.start_step
        return steps * self.tokens_per_step / self.train_seconds if steps else float("nan")


SaveFn = Callable[[int, list[dict[str, float]], list[float] | None], None]


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: BatchSource,
    config: TrainConfig,
    *,
    start_step: int = 0,
    history: list[dict[str, float]] | None = None,
    losses_since_eval: list[float] | None = None,
    save: SaveFn | None = None,
    console: Console | None = None,
) -> TrainResult:
    """Train from ``start_step`` up to ``config.max_iters`` steps (none, and no output, when
    ``start_step`` is already there and evaluated: the result then has ``step == start_step``).

    Evaluates at step 0 (fresh runs), every ``eval_interval`` steps and at the end, recording
    the mean training loss since the previous evaluation (over every rank's steps) and the
    validation loss, and calling ``save(step, history, losses_since_eval)`` after each one but
    step 0's; ``save`` runs on every rank (it may gather state) and is expected to write on
    rank 0 only. SIGINT/SIGTERM stop the loop between two steps (on every rank at the same
    step), or abandon an evaluation before its next batch (its loss is not recorded), then
    ``save`` runs for the last step taken (a further signal cannot cut it short; a fresh run
    stopped before its first step saves step 0) and the result says ``interrupted``. A run
    that starts at a step where it evaluates, without that evaluation in ``history``, begins
    with it: a fresh run at step 0, a resumed one whose evaluation a signal abandoned (the
    checkpoint of a step saved after its evaluation holds it). ``losses_since_eval`` are the
    training losses (each step's mean over ranks) of the steps between the last evaluation in
    ``history`` and ``start_step`` (what ``save`` was given), so that a resumed run records the
    same means as a straight one; None when they are unknown: then the next evaluation records
    no training loss, unless ``start_step`` is the last evaluation's step. A non-finite
    validation loss, training loss or weight raises :class:`SelfAttnError` on every rank
    instead of saving, so the last checkpoint stays good. Progress goes to ``console`` (None:
    no output).
    """
    device = next(model.parameters()).device
    history = list(history or [])
    result = TrainResult(
        start_step,
        start_step,
        [],
        history,
        tokens_per_step=config.batch_size * config.block_size * distributed.world_size(),
    )
    if not has_work(start_step, history, config):
        return result  # resumed at or past the target: no bar, no evaluation
    wall_start = time.perf_counter()
    model.train()
    step_losses: list[Tensor] = []
    window = 0  # index in step_losses of the first step since the last evaluation
    saved_step = start_step
    saved = start_step > 0  # a resumed run's start is a checkpoint already; a fresh one's is not
    with ExitStack() as stack:
        progress = stack.enter_context(_progress(console, config, start_step))
        shown = _evaluation_shown(progress, config)
        # steps before start_step since the last evaluation
        carried = _carried_losses(losses_since_eval, start_step, history)
        stop = stack.enter_context(_stop_on_signals())
        stopping = partial(_stop_agreed, stop, device)  # asked before each evaluation batch
        while True:
            if _evaluation_due(result.step, history, config):
                if isinstance(batches, StepSeeded):
                    batches.start_evaluation(result.step)
                val = evaluate(model, batches, config.eval_iters, stop=stopping, **shown)
                if val is None:  # a signal: the step stays unevaluated (a resume evaluates it)
                    result.interrupted, result.signal = True, stop.signal
                    break
                since_eval = _since_eval(carried, step_losses[window:])
                record: dict[str, float] = {"step": result.step}
                if since_eval:  # (none at step 0, or unknown)
                    record["train"] = statistics.fmean(since_eval)
                record["val"] = val
                trained = result.step > 0  # (step 0 trained nothing: nothing to check or save)
                if trained:
                    _check_finite(record, saved_step, config)
                if trained and save is not None:
                    _check_savable(
                        model, step_losses[window:], result.step, saved_step, config, device
                    )
                history.append(record)
                result.evaluations += 1
                window, carried = len(step_losses), []
                _report(console if progress is None else progress.console, history)
                if trained and save is not None:
                    save(result.step, history, carried)
                    saved_step, saved = result.step, True
            if result.step >= config.max_iters:
                break
            if _stop_requested(stop, result.step, config, device):
                result.interrupted, result.signal = True, stop.signal
                break
            tick = time.perf_counter()
            lr = learning_rate(result.step, config)
            loss = _step(model, optimizer, batches.batch("train"), lr, config.grad_clip, device)
            step_losses.append(loss)
            result.step += 1
            step = result.step
            log = step % config.log_interval == 0 or step == config.max_iters
            last = loss.item() if log else None  # the one sync per log interval
            result.train_seconds += time.perf_counter() - tick
            if log:
                _show_step(progress, result, last, lr)
        if result.interrupted and step_losses:  # the bar at the step stopped at, not the last log
            _show_step(progress, result, step_losses[-1].item(), lr)
        # still inside the signal handlers: a second Ctrl-C cannot cut the interrupt's save short
        if result.interrupted and save is not None and not (saved and saved_step == result.step):
            _check_savable(model, step_losses[window:], result.step, saved_step, config, device)
            save(result.step, history, _since_eval(carried, step_losses[window:]))
    result.losses = torch.stack(step_losses).tolist() if step_losses else []
    result.wall_seconds = time.perf_counter() - wall_start
    return result


def _show_step(progress: Progress | None, result: TrainResult, loss: float, lr: float) -> None:
    """The bar at ``result.step``, with that step's loss and learning rate and the tokens/s so
    far."""
    if progress is None:
        return
    steps = result.step - result.start_step
    rate = steps * result.tokens_per_step / result.train_seconds
    progress.update(
        progress.task_ids[0], completed=result.step, loss=f"{loss:.4f}", lr=lr, rate=f"{rate:,.0f}"
    )


def _carried_losses(
    given: list[float] | None, start_step: int, history: list[dict[str, float]]
) -> list[float] | None:
    """The training losses since the last evaluation that precede ``start_step``: ``given``;
    none when ``start_step`` is that evaluation's (or a fresh run's) step; else unknown."""
    if given is not None:
        return list(given)
    last_evaluation = history[-1]["step"] if history else 0
    return [] if start_step == last_evaluation else None


def _since_eval(carried: list[float] | None, recent: list[Tensor]) -> list[float] | None:
    """The training losses since the last evaluation: ``carried`` from before this call, then
    ``recent``, each step's averaged across ranks (one all-reduce and one device sync, at
    evaluations and saves only); None while the carried ones are unknown."""
    if carried is None:
        return None
    recent_means = distributed.mean_across_ranks(torch.stack(recent)).tolist() if recent else []
    return carried + recent_means


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[Tensor, Tensor],
    lr: float,
    grad_clip: float,
    device: torch.device,
) -> Tensor:
    """One optimizer step at learning rate ``lr``; returns the (detached) loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    x, y = (tensor.to(device, non_blocking=True) for tensor in batch)
    loss = model(x, y).loss
    loss.backward()
    if grad_clip:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def has_work(start_step: int, history: list[dict[str, float]], config: TrainConfig) -> bool:
    """Whether :func:`train` from ``start_step`` with ``history`` trains or evaluates at all."""
    return start_step < config.max_iters or _evaluation_due(start_step, history, config)


def _evaluation_due(step: int, history: list[dict[str, float]], config: TrainConfig) -> bool:
    """Whether the run evaluates at ``step`` (each ``eval_interval`` steps, and the last one)
    and ``history`` lacks that evaluation."""
    evaluates = step % config.eval_interval == 0 or step == config.max_iters
    evaluated = bool(history) and history[-1]["step"] == step
    return step <= config.max_iters and evaluates and not evaluated


def _stop_requested(
    stop: _SignalStop, step: int, config: TrainConfig, device: torch.device
) -> bool:
    """Whether a signal asked to stop before the next step; under DDP all ranks decide
    together, at log steps only (no collective and no device sync on the other steps)."""
    if distributed.world_size() > 1 and step % config.log_interval:
        return False
    return _stop_agreed(stop, device)


def _stop_agreed(stop: _SignalStop, device: torch.device) -> bool:
    """Whether a signal asked to stop, on any rank (one collective under DDP, before each
    evaluation batch and at log steps)."""
    return distributed.any_across_ranks(stop.is_set(), device)


def _check_finite(record: dict[str, float], saved_step: int, config: TrainConfig) -> None:
    """Stop a run whose loss is no longer a number, before it overwrites the last checkpoint
    (the validation loss is averaged across ranks, so every rank stops at the same step)."""
    if not math.isfinite(record["val"]):
        problem = f"the validation loss is {record['val']}"
        raise _diverged(problem, record["step"], saved_step, config)


def _check_savable(
    model: nn.Module,
    losses: list[Tensor],
    step: int,
    saved_step: int,
    config: TrainConfig,
    device: torch.device,
) -> None:
    """Refuse to save weights, or the steps since the last save, that are no longer finite: on
    every path to ``save`` (evaluation, interrupt, end of run), with all ranks agreeing."""
    weights_finite = bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())
    losses_finite = not losses or bool(torch.isfinite(torch.stack(losses)).all())
    checks = {"the weights are": weights_finite, "the training loss is": losses_finite}
    for what, finite in checks.items():
        if distributed.any_across_ranks(not finite, device):
            raise _diverged(f"{what} no longer finite", step, saved_step, config)


def _diverged(problem: str, step: int, saved_step: int, config: TrainConfig) -> SelfAttnError:
    """The one line for a run that stopped being a number at ``step``, and what was kept."""
    lower = f"a lower --lr, e.g. {_lower_learning_rate(config)}"
    if saved_step:
        fix = f"the checkpoint of step {saved_step} is kept: resume it with {lower}"
    else:
        fix = f"nothing was saved: start again with {lower}"
    return SelfAttnError(f"training diverged: {problem} at step {step}; {fix}")


def _lower_learning_rate(config: TrainConfig) -> str:
    """Flags for a tenth of the peak learning rate, with a tenth of ``min_lr`` too where the
    floor would otherwise be above the new peak (which TrainConfig refuses)."""
    lower = float(f"{config.learning_rate / 10:.3g}")
    if lower >= config.min_lr:
        return f"--lr {lower}"
    return f"--lr {lower} --min-lr {float(f'{config.min_lr / 10:.3g}')}"


def _report(console: Console | None, history: list[dict[str, float]]) -> None:
    """The last evaluation's line; its train loss is the mean over the training steps since
    the evaluation before (nanoGPT's is a fresh estimate), and says so."""
    if console is None:
        return
    record = history[-1]
    train = ""
    if "train" in record:
        since = history[-2]["step"] if len(history) > 1 else 0
        train = f"train loss {record['train']:.4f} (mean since step {since}), "
    console.print(f"step {record['step']:>6}: {train}val loss {record['val']:.4f}")


def _evaluation_shown(progress: Progress | None, config: TrainConfig) -> dict:
    """``evaluate``'s keyword to show its batches on the bar ("eval 37/200" where "train"
    stands): an evaluation on a CPU can take minutes (shakespeare-char's 200 batches)."""
    if progress is None:
        return {}
    task = progress.task_ids[0]
    width = len(f"eval {config.eval_iters}/{config.eval_iters}")

    def done(count: int) -> None:
        label = "train" if count == config.eval_iters else f"eval {count}/{config.eval_iters}"
        progress.update(task, description=label.ljust(width))

    done(config.eval_iters)  # "train", as wide
    return {"done": done}


@contextmanager
def _progress(
    console: Console | None, config: TrainConfig, start: int
) -> Iterator[Progress | None]:
    """A rich progress bar with loss, learning rate and tokens/s; None without a console."""
    if console is None:
        yield None
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]:.2e}"),
        TextColumn("{task.fields[rate]} tok/s"),
        TimeRemainingColumn(),
        console=console,
    )
    progress.add_task(
        "train",
        total=config.max_iters,
        completed=start,
        loss="-",  # until the first log step ("nan" here read as a diverging run)
        lr=learning_rate(start, config),
        rate="-",
    )
    with progress:
        yield progress


class _SignalStop(threading.Event):
    """Set by a signal; ``signal`` says which (the last one received)."""

    signal: int | None = None

    def receive(self, signum: int, _frame: object = None) -> None:
        self.signal = signum
        self.set()


SIGNALS = (signal.SIGINT, signal.SIGTERM)
# inside signals_held_after_a_stop: a stopped train() leaves SIGNALS ignored
_held_after_a_stop = ContextVar("held_after_a_stop", default=False)


@contextmanager
def signals_held_after_a_stop() -> Iterator[None]:
    """While the block runs, a :func:`train` that a signal stopped leaves SIGINT and SIGTERM
    ignored, instead of putting back the handlers it found, until the block ends: what the
    caller prints about the stop (the CLI's line) cannot be cut short by a repeated signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    token = _held_after_a_stop.set(True)
    try:
        yield
    finally:
        _held_after_a_stop.reset(token)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _stop_on_signals() -> Iterator[_SignalStop]:
    """An event set by Ctrl-C (SIGINT) or SIGTERM while the block runs, so that no step (nor
    evaluation batch) is cut."""
    stop = _SignalStop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in previous:
        signal.signal(sig, stop.receive)
    try:
        yield stop
    finally:
        held = stop.is_set() and _held_after_a_stop.get()
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if held else handler)
