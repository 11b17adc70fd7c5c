"""Training from scratch: the loop, exact resume, atomic checkpoints, DDP, generation, errors.

Tolerances: resume and seeded generation are bit-exact (same ops, same RNG states on CPU),
as is seeded sampling against torch.multinomial on the tempered softmax of uncached logits;
DDP ranks end bit-identical (DDP averages gradients before the same update on each rank);
DDP against one process with the same global batch agrees to 1e-5 (only the order of float
sums differs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
import typer
from rich.console import Console
from safetensors.torch import load_file, save_model
from torch import Tensor, nn
from typer.testing import CliRunner

import selfattn
from conftest import TRAINING_TEXT, spawn_ranks
from selfattn.cli import TRAIN_HELP, app
from selfattn.errors import SelfAttnError
from selfattn.models.gpt import GPT, MAX_SAMPLING_SEED, GPTConfig, check_sampling, sample
from selfattn.train import (
    PRESETS,
    RandomBatches,
    TextData,
    TrainConfig,
    configure_optimizer,
    distributed,
    get_preset,
    load_checkpoint,
    load_model,
    save_checkpoint,
    train,
    train_decoder,
)
from selfattn.train import checkpoint as checkpoint_module
from selfattn.train import loop as loop_module
from selfattn.train import run as run_module
from selfattn.train.data import batch_seed, read_text
from selfattn.train.run import new_network

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: fastest on one thread


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A tiny model trained for 30 steps; its --out directory."""
    out = tmp_path_factory.mktemp("run") / "out"
    train_decoder(corpus, out, preset="tiny", overrides={"max_iters": 30}, device="cpu")
    return out


def test_loss_falls_on_a_tiny_corpus(corpus, tmp_path):
    """`selfattn train`, 40 steps: the held-out loss drops by at least 1 nat from ~ln(vocab)."""
    out = tmp_path / "out"
    args = ["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny"]
    result = CliRunner().invoke(app, [*args, "--max-iters", "40"])
    assert result.exit_code == 0, result.output
    assert "step 40: val loss" in result.output and "tokens/s" in result.output
    history = load_checkpoint(out)[3].history
    assert history[0]["step"] == 0 and history[-1]["step"] == 40
    assert history[-1]["val"] < history[0]["val"] - 1.0, history


class _Bigram(nn.Module):
    """A bigram table: the loop's smallest model (no GPT). ``train_loss_offset`` is added to the
    training loss only: inf makes that loss non-finite while weights and gradients stay finite."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(5, 5)
        self.bias = nn.Parameter(torch.zeros(5))
        self.train_loss_offset = 0.0

    def forward(self, x, y):
        logits = self.table(x) + self.bias
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        return SimpleNamespace(loss=loss + self.train_loss_offset if self.training else loss)


class _Cycle:
    """0 -> 1 -> 2 -> 3 -> 4 -> 0: perfectly predictable; ``at_step[n]()`` runs when the
    batch of step n (1-based) is drawn, ``at_val[n]()`` when the n-th validation batch is."""

    def __init__(self, at_step: dict | None = None, at_val: dict | None = None) -> None:
        self.at_step = at_step or {}
        self.at_val = at_val or {}
        self.steps = 0
        self.vals = 0

    def batch(self, split):
        if split == "train":
            self.steps += 1
            self.at_step.get(self.steps, lambda: None)()
        else:
            self.vals += 1
            self.at_val.get(self.vals, lambda: None)()
        start = torch.randint(5, (4, 1))
        x = (start + torch.arange(8)) % 5
        return x, (x + 1) % 5


def _cycle_config(**changes) -> TrainConfig:
    settings = dict(
        max_iters=60, batch_size=4, block_size=8, learning_rate=0.1, min_lr=0.01,
        warmup_iters=5, lr_decay_iters=60, eval_interval=30, eval_iters=2,
    )  # fmt: skip
    return TrainConfig(**{**settings, **changes})


def test_each_evaluation_line_says_what_its_train_loss_averages(corpus, tmp_path):
    """nanoGPT's "train loss" is a fresh eval-mode estimate; ours is the mean of the steps
    since the previous evaluation (early on above the val loss), and the line now says so."""
    args = ["train", "--data", str(corpus), "--out", str(tmp_path / "o"), "--preset", "tiny"]
    result = CliRunner().invoke(app, [*args, "--max-iters", "10", "--eval-interval", "4"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "val loss" in line][:-1]
    assert [re.sub(r"\d\.\d{4}", "L", line) for line in lines] == [
        "step      0: val loss L",
        "step      4: train loss L (mean since step 0), val loss L",
        "step      8: train loss L (mean since step 4), val loss L",
        "step     10: train loss L (mean since step 8), val loss L",
    ]


def test_loop_is_model_agnostic_and_decays_only_matrices():
    """A bigram table (no GPT) trains through the same loop; biases get no weight decay."""
    torch.manual_seed(0)
    model = _Bigram()
    config = _cycle_config()
    optimizer = configure_optimizer(model, config)
    decays = {len(g["params"][0].shape): g["weight_decay"] for g in optimizer.param_groups}
    assert decays == {2: 0.1, 1: 0.0}
    result = train(model, optimizer, _Cycle(), config)
    assert result.history[-1]["val"] < 0.2 < result.history[0]["val"]


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_its_floor():
    """nanoGPT's schedule, by hand: warm-up (step + 1) / (warmup + 1) of the peak, the peak at
    the end of the warm-up, half-way down the cosine at the middle of the decay (min_lr + half
    the range), (2 + sqrt 2) / 4 of the range at a quarter of it (a straight line gave 3/4),
    min_lr from lr_decay_iters on. Relative 1e-12."""
    config = _cycle_config(
        max_iters=200, learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, lr_decay_iters=110
    )
    expected = {
        0: 1e-3 / 11, 9: 1e-3 * 10 / 11, 10: 1e-3, 35: 1e-4 + 9e-4 * (2 + 2**0.5) / 4,
        60: 5.5e-4, 110: 1e-4, 111: 1e-4, 200: 1e-4,
    }  # fmt: skip
    for step, lr in expected.items():
        assert loop_module.learning_rate(step, config) == pytest.approx(lr, rel=1e-12), step


@pytest.mark.parametrize(("grad_clip", "expected"), [(1.0, [0.6, 0.8]), (0.0, [3.0, 4.0])])
def test_gradients_are_clipped_by_their_norm_before_the_step(grad_clip, expected):
    """A loss 3 a + 4 b has gradient (3, 4), of norm 5: grad_clip 1 scales it to (0.6, 0.8)
    (clipping each value to 1 gave (1, 1)); grad_clip 0 leaves it whole. The gradient the
    optimizer steps with, 1e-6 absolute."""
    weights = nn.Parameter(torch.zeros(2))
    model = nn.Module()
    model.weights = weights
    model.forward = lambda x, y: SimpleNamespace(loss=(torch.tensor([3.0, 4.0]) * weights).sum())
    optimizer = torch.optim.SGD([weights])
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(weights.grad.clone()))
    batch = (torch.zeros(1, 1), torch.zeros(1, 1))
    loop_module._step(model, optimizer, batch, 0.1, grad_clip, torch.device("cpu"))
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], torch.tensor(expected), atol=1e-6, rtol=0)


def _poison(model: _Bigram, what: str) -> None:
    """Make the weights (NaN bias: every later loss and gradient too) or the loss non-finite."""
    if what == "weights":
        with torch.no_grad():
            model.bias.fill_(float("nan"))
    else:
        model.train_loss_offset = float("inf")


def _interrupt() -> None:
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def python_sigint():
    """SIGINT handled as Python handles it in a terminal (KeyboardInterrupt), whatever this
    process started with: a shell starts its background jobs (`make test &`) with SIGINT
    ignored, and train() must be seen to put back the handler it found."""
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, found)


@pytest.mark.usefixtures("python_sigint")
@pytest.mark.parametrize(
    ("poisoned", "problem"), [("weights", "weights are"), ("loss", "training loss is")]
)
def test_ctrl_c_never_saves_non_finite_weights_or_loss(poisoned, problem):
    """Saves at steps 3 and 6; the weights (or the training loss) turn non-finite at step 8 and
    Ctrl-C stops there: one line naming the kept step 6, no save of step 8 (the interrupt used
    to save whatever the weights held over the good checkpoint)."""
    torch.manual_seed(0)
    model = _Bigram()
    config = _cycle_config(max_iters=20, eval_interval=3, eval_iters=1)
    batches = _Cycle({8: lambda: (_poison(model, poisoned), _interrupt())})
    saved = []
    kept = f"the {problem} no longer finite at step 8; the checkpoint of step 6 is kept"
    with pytest.raises(SelfAttnError, match=re.escape(kept)):
        train(
            model, configure_optimizer(model, config), batches, config,
            save=lambda step, *_: saved.append(step),
        )  # fmt: skip
    assert saved == [3, 6]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_run_ending_with_a_non_finite_training_loss_is_not_saved():
    """The training loss turns inf at step 5 while the weights and the validation loss stay
    finite: the end-of-run save of step 6 is refused, naming step 3's (it used to be saved)."""
    torch.manual_seed(0)
    model = _Bigram()
    config = _cycle_config(max_iters=6, eval_interval=3, eval_iters=1)
    batches = _Cycle({5: lambda: _poison(model, "loss")})
    saved = []
    kept = "the training loss is no longer finite at step 6; the checkpoint of step 3 is kept"
    with pytest.raises(SelfAttnError, match=re.escape(kept)):
        train(
            model, configure_optimizer(model, config), batches, config,
            save=lambda step, *_: saved.append(step),
        )  # fmt: skip
    assert saved == [3]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_resume_gives_the_same_losses_as_straight_training(corpus, tmp_path):
    """20 steps + resume to 40 == 40 straight steps: every loss and weight bit-exact."""
    straight = train_decoder(corpus, tmp_path / "a", preset="tiny", overrides={"max_iters": 40})
    first = train_decoder(corpus, tmp_path / "b", preset="tiny", overrides={"max_iters": 20})
    second = train_decoder(corpus, tmp_path / "b", overrides={"max_iters": 40}, resume=True)
    assert second.result.start_step == 20
    assert first.result.losses + second.result.losses == straight.result.losses
    for (name, a), b in zip(
        straight.model.state_dict().items(), second.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_training_leaves_the_callers_random_state_and_a_models_mode_as_they_were(corpus, tmp_path):
    """train_decoder reseeded the caller's torch generator: two notebooks seeded 1 and 9999
    drew the same numbers after it. And a model put back in train() mode ran with dropout:
    two runs of one text differed, a recording's recomputed output was not the model's, a
    seed gave another text each time. run and generate now evaluate, and leave the mode."""
    torch.manual_seed(9999)
    expected = torch.rand(4)
    torch.manual_seed(9999)
    train_decoder(
        corpus, tmp_path / "out", preset="tiny", overrides={"max_iters": 2, "dropout": 0.5}
    )
    assert torch.equal(torch.rand(4), expected)
    model = load_model(tmp_path / "out").train()
    first, second = model.run("First Citizen"), model.run("First Citizen")
    assert torch.equal(first.hidden_states, second.hidden_states)
    capture = first.captures[0]
    torch.testing.assert_close(capture.trace().output, capture.output[0], atol=1e-6, rtol=0)
    assert model.generate("All", 20, seed=3) == model.generate("All", 20, seed=3)
    assert model.generate_recorded("All", 20, seed=3).text == model.generate("All", 20, seed=3)
    assert all(module.training for module in model.modules())


@pytest.mark.parametrize(
    ("setting", "value", "group_key"),
    [("weight_decay", 0.0, "weight_decay"), ("beta1", 0.5, "betas"), ("beta2", 0.9, "betas")],
)
def test_a_resume_trains_with_the_adamw_settings_it_is_given(
    corpus, tmp_path, monkeypatch, setting, value, group_key
):
    """10 steps with the preset's AdamW, resumed to 20 with --weight-decay 0 (or --beta1 0.5,
    --beta2 0.9) == 20 straight steps whose AdamW groups get that setting (torch's own group
    setting) before step 11: weights bit-exact. The resumed optimizer used to take the
    checkpoint's weight decay back (config.json said 0)."""
    out = tmp_path / "out"
    settings = {"max_iters": 20, "eval_interval": 10}
    train_decoder(corpus, out, preset="tiny", overrides={**settings, "max_iters": 10})
    resumed = train_decoder(corpus, out, overrides={**settings, setting: value}, resume=True)

    def change_at_step_eleven(model, config):
        optimizer = configure_optimizer(model, config)
        changed = dataclasses.replace(config, **{setting: value})
        steps = []

        def before_step(optimizer, *_):
            steps.append(len(steps) + 1)
            if steps[-1] == 11:
                for group in optimizer.param_groups:
                    if group_key == "betas":
                        group["betas"] = (changed.beta1, changed.beta2)
                    elif group["weight_decay"]:  # biases and norms keep 0
                        group["weight_decay"] = value

        optimizer.register_step_pre_hook(before_step)
        return optimizer

    monkeypatch.setattr(run_module, "configure_optimizer", change_at_step_eleven)
    straight = train_decoder(corpus, tmp_path / "straight", preset="tiny", overrides=settings)
    assert getattr(load_checkpoint(out)[2].train, setting) == value
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


EVERY_TEN = {"max_iters": 30, "eval_interval": 10}  # evaluations at steps 0, 10, 20 and 30


def _ctrl_c_at_step_15(corpus: Path, out: Path, monkeypatch) -> None:
    """Train EVERY_TEN into ``out`` until Ctrl-C stops it after step 15 (it saves step 15)."""
    with monkeypatch.context() as patch:
        patch.setattr(loop_module, "_stop_requested", lambda stop, step, *_: step == 15)
        run = train_decoder(corpus, out, preset="tiny", overrides=EVERY_TEN)
    assert run.result.interrupted and load_checkpoint(out)[3].step == 15


def test_a_run_interrupted_between_evaluations_resumes_to_the_same_history(
    corpus, tmp_path, monkeypatch
):
    """Ctrl-C at step 15, resume to 30: the evaluation history equals 30 straight steps', float
    for float (CPU, same seed: the same ops on the same values). Step 20's train loss, the mean
    of steps 11-20, used to be the mean of 16-20: the checkpoint now holds steps 11-15's losses."""
    straight = train_decoder(corpus, tmp_path / "straight", preset="tiny", overrides=EVERY_TEN)
    out = tmp_path / "out"
    _ctrl_c_at_step_15(corpus, out, monkeypatch)
    resumed = train_decoder(corpus, out, overrides=EVERY_TEN, resume=True)
    assert [record["step"] for record in resumed.result.history] == [0, 10, 20, 30]
    assert resumed.result.history == straight.result.history
    assert load_checkpoint(out)[3].history == straight.result.history


def test_a_checkpoint_without_its_losses_since_the_last_evaluation_still_resumes(
    corpus, tmp_path, monkeypatch
):
    """A step-15 checkpoint from before state.json held the losses of steps 11-15: the resume
    runs, and step 20's evaluation records its validation loss but no train loss (the mean of
    16-20 would claim to be that of 11-20); step 30's is whole again, equal to a straight run's."""
    straight = train_decoder(corpus, tmp_path / "straight", preset="tiny", overrides=EVERY_TEN)
    out = tmp_path / "out"
    _ctrl_c_at_step_15(corpus, out, monkeypatch)
    state_file = checkpoint_module.checkpoint_dir(out) / "state.json"
    state = json.loads(state_file.read_text())
    state.pop("losses_since_eval", None)
    state_file.write_text(json.dumps(state))
    history = train_decoder(corpus, out, overrides=EVERY_TEN, resume=True).result.history
    expected = straight.result.history
    assert history[2] == {"step": 20, "val": expected[2]["val"]}
    assert history[:2] + history[3:] == expected[:2] + expected[3:]


def test_a_seed_given_on_resume_is_noted_and_not_recorded(corpus, tmp_path):
    """--seed 7 when resuming a seed-1337 run: one note on stderr, and config.json keeps 1337
    (it said 7, a seed that was never used: the saved generator states go on either way, so
    the weights equal those of a resume with the run's own --seed 1337, which gets no note)."""
    noted, same = tmp_path / "noted", tmp_path / "same"
    train_decoder(corpus, noted, preset="tiny", overrides={"max_iters": 10})
    save_checkpoint(same, *load_checkpoint(noted))
    args = ["train", "--data", str(corpus), "--resume", "--max-iters", "20"]
    result = CliRunner().invoke(app, [*args, "--out", str(noted), "--seed", "7"])
    assert result.exit_code == 0, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert (
        result.stderr.startswith("note: --seed 7 is ignored: ") and "(seed 1337)" in result.stderr
    )
    result = CliRunner().invoke(app, [*args, "--out", str(same), "--seed", "1337"])
    assert result.exit_code == 0 and result.stderr == "", result.stderr
    model, _, config, _ = load_checkpoint(noted)
    assert config.train.seed == 1337
    for (name, a), b in zip(
        model.state_dict().items(), load_checkpoint(same)[0].state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("failing_step", ["optimizer tensors", "LATEST pointer"])
def test_a_crash_mid_save_leaves_the_previous_checkpoint(
    trained, tmp_path, monkeypatch, failing_step
):
    """A save that dies part-way changes nothing: the last checkpoint loads, weights exact."""
    out = tmp_path / "out"
    model, tokenizer, config, state = load_checkpoint(trained)
    save_checkpoint(out, model, tokenizer, config, state)
    before = {key: value.clone() for key, value in model.state_dict().items()}

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    if failing_step == "optimizer tensors":
        monkeypatch.setattr(checkpoint_module, "save_file", crash)
    else:
        real_replace = os.replace
        monkeypatch.setattr(
            checkpoint_module.os, "replace",
            lambda src, dst: crash() if Path(dst).name == "LATEST" else real_replace(src, dst),
        )  # fmt: skip
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    state.step += 5
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(out, model, tokenizer, config, state)
    monkeypatch.undo()

    reloaded, _, _, reloaded_state = load_checkpoint(out)
    assert reloaded_state.step == 30
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not any(entry.name.startswith(".tmp-") for entry in out.iterdir())


@pytest.mark.usefixtures("python_sigint")
def test_ctrl_c_stops_between_steps_and_saves(corpus):
    """SIGINT during step 7 lets it finish, then the loop saves step 7 and reports it."""
    data = TextData.from_file(corpus, 16)
    preset = get_preset("tiny")
    torch.manual_seed(0)
    model = GPT(preset.model_config(data.tokenizer.vocab_size))
    batches = RandomBatches(data, 8, 16, seed=0)
    calls = 0

    class InterruptAtSeven:
        def batch(self, split):
            nonlocal calls
            if split == "train":
                calls += 1
                if calls == 7:
                    os.kill(os.getpid(), signal.SIGINT)
            return batches.batch(split)

    saved = []
    result = train(
        model, configure_optimizer(model, preset.train), InterruptAtSeven(), preset.train,
        save=lambda step, *_: saved.append(step),
    )  # fmt: skip
    assert result.interrupted and result.step == 7 and saved == [7]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_before_the_first_step_saves_step_zero_and_resumes_exactly(
    corpus, tmp_path, monkeypatch
):
    """Ctrl-C after the step-0 evaluation, before step 1: `selfattn train` said "checkpoint
    saved" but saved nothing (no --resume possible). Now step 0 is saved, and resuming it to 20
    steps gives the losses, weights and evaluation history of 20 straight steps."""
    args = ["train", "--data", str(corpus), "--preset", "tiny"]
    straight = train_decoder(
        corpus, tmp_path / "straight", preset="tiny", overrides={"max_iters": 20}
    )
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(loop_module, "_stop_requested", lambda stop, step, *_: step == 0)
        result = CliRunner().invoke(app, [*args, "--out", str(out), "--max-iters", "20"])
    assert result.exit_code == 130, result.output
    assert f"Interrupted at step 0: checkpoint saved in {out}" in result.output
    assert load_checkpoint(out)[3].step == 0
    resumed = train_decoder(corpus, out, overrides={"max_iters": 20}, resume=True)
    assert resumed.result.losses == straight.result.losses
    assert resumed.result.history == straight.result.history  # one step-0 evaluation, same val
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_the_progress_bar_shows_no_nan_before_the_first_loss(corpus, monkeypatch):
    """Before its first log step the bar showed "loss nan" and "0 tok/s" (a fresh run stopped
    at step 0 printed that as its last line; every run showed it for --log-interval steps),
    which reads as a diverging run: now "loss -" and "- tok/s"."""
    monkeypatch.setattr(loop_module, "_stop_requested", lambda stop, step, *_: step == 0)
    output = io.StringIO()
    model = _Bigram()
    config = _cycle_config(max_iters=20, eval_interval=10, eval_iters=1)
    console = Console(file=output, width=200)
    train(model, configure_optimizer(model, config), _Cycle(), config, console=console)
    bar = [line for line in output.getvalue().splitlines() if line.startswith("train")]
    assert bar and "loss -  lr" in bar[-1] and "- tok/s" in bar[-1], output.getvalue()
    assert "nan" not in output.getvalue()


@pytest.mark.usefixtures("python_sigint")
def test_a_second_ctrl_c_cannot_cut_the_interrupts_save_short():
    """Ctrl-C at step 2 stops the loop; a second Ctrl-C while step 2 is being saved (an
    impatient user, a large model) is ignored and the save completes (it raised
    KeyboardInterrupt inside the save: the CLI then said "nothing saved", the steps were lost)."""
    torch.manual_seed(0)
    model = _Bigram()
    config = _cycle_config(max_iters=20, eval_interval=10, eval_iters=1)
    saved = []

    def save(step, *_):
        if step == 2:
            _interrupt()  # delivered at once, in the middle of the save
        saved.append(step)

    try:
        result = train(
            model, configure_optimizer(model, config), _Cycle({2: _interrupt}), config, save=save
        )
    except KeyboardInterrupt:  # (not to pytest, which would take it as its own Ctrl-C)
        pytest.fail(f"the second Ctrl-C cut the save short: saved {saved}")
    assert result.interrupted and result.step == 2 and saved == [2]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_an_evaluation_abandons_it_before_its_next_batch(signum):
    """Evaluations of 50 batches at steps 0, 10 and 20; a signal while the 3rd batch of step
    10's is drawn: no 4th is drawn, step 10's loss is not recorded, and step 10 is saved with
    the losses of steps 1-10 (for the next evaluation's train loss). The evaluation used to run
    all its batches first: shakespeare-char's 200 take about 16 minutes on a CPU."""
    torch.manual_seed(0)
    model = _Bigram()
    config = _cycle_config(max_iters=20, eval_interval=10, eval_iters=50)
    batches = _Cycle(at_val={53: lambda: os.kill(os.getpid(), signum)})
    handler = signal.getsignal(signum)
    saved = []

    def save(step, history, losses_since_eval):
        saved.append((step, [record["step"] for record in history], len(losses_since_eval)))

    result = train(model, configure_optimizer(model, config), batches, config, save=save)
    assert result.interrupted and result.step == 10 and batches.vals == 53
    assert result.signal == signum
    assert [record["step"] for record in result.history] == [0]
    assert saved == [(10, [0], 10)]
    assert signal.getsignal(signum) is handler


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["INT", "TERM"]
)
def test_the_command_exits_with_128_plus_the_signal_that_stopped_it(
    corpus, tmp_path, monkeypatch, signum, status
):
    """Ctrl-C exits 130 and SIGTERM 143 (128 + the signal, as shells and `selfattn serve`
    say it), after the step and its save; SIGTERM used to exit 130 as if it were Ctrl-C."""

    class Signalling(RandomBatches):
        drawn = 0

        def batch(self, split):
            if split == "train":
                Signalling.drawn += 1
                if Signalling.drawn == 3:
                    os.kill(os.getpid(), signum)
            return super().batch(split)

    monkeypatch.setattr(run_module, "RandomBatches", Signalling)
    out = tmp_path / "out"
    args = ["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny"]
    result = CliRunner().invoke(app, [*args, "--max-iters", "20"])
    assert result.exit_code == status, result.output
    assert f"Interrupted at step 3: checkpoint saved in {out}" in result.output


def _ctrl_c_at_validation_batch(number: int, drawn: list, ctrl_c: bool = True) -> type:
    """RandomBatches that count the validation batches drawn in ``drawn`` and (if ``ctrl_c``)
    send Ctrl-C to this process while the ``number``-th is drawn."""

    class CtrlC(RandomBatches):
        def batch(self, split):
            if split == "val":
                drawn.append(split)
                if ctrl_c and len(drawn) == number:
                    _interrupt()
            return super().batch(split)

    return CtrlC


@pytest.mark.parametrize(
    ("validation_batch", "step"), [(2, 0), (12, 20), (17, 30)], ids=["step-0", "step-20", "last"]
)
def test_ctrl_c_during_an_evaluation_saves_its_step_and_resumes_to_a_straight_run(
    corpus, tmp_path, monkeypatch, validation_batch, step
):
    """EVERY_TEN (5 batches per evaluation) with Ctrl-C during the 2nd batch of step 0's, step
    20's or the last evaluation: the command exits at once (no 3rd batch) with its one line,
    the checkpoint is that step's without its evaluation, and the resume evaluates it first:
    losses, weights and history equal 30 straight steps' (the abandoned evaluation's batches
    are drawn again). Step 0's used to end in "nothing saved", the others ran to their end."""
    straight = train_decoder(corpus, tmp_path / "straight", preset="tiny", overrides=EVERY_TEN)
    out = tmp_path / "out"
    drawn = []
    with monkeypatch.context() as patch:
        patch.setattr(
            run_module, "RandomBatches", _ctrl_c_at_validation_batch(validation_batch, drawn)
        )
        args = ["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny"]
        result = CliRunner().invoke(app, [*args, "--max-iters", "30", "--eval-interval", "10"])
    assert result.exit_code == 130, result.output
    assert f"Interrupted at step {step}: checkpoint saved in {out}" in result.output
    assert len(drawn) == validation_batch
    state = load_checkpoint(out)[3]
    assert state.step == step and state.history == straight.result.history[: step // 10]
    resumed = train_decoder(corpus, out, overrides=EVERY_TEN, resume=True)
    assert resumed.result.losses == straight.result.losses[step:]
    assert resumed.result.history == straight.result.history
    assert load_checkpoint(out)[3].history == straight.result.history
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_resume_that_only_runs_the_cut_short_last_evaluation_says_so(corpus, tmp_path):
    """Ctrl-C in the last evaluation, then --resume with the same --max-iters: the resume runs
    that evaluation and prints its loss in one line, not "Nothing to do" nor a NaN speed."""
    out = tmp_path / "out"
    args = ["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny"]
    args += ["--max-iters", "30", "--eval-interval", "10"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_module, "RandomBatches", _ctrl_c_at_validation_batch(17, []))
        assert CliRunner().invoke(app, args).exit_code == 130
    result = CliRunner().invoke(app, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "step 30: val loss " in text and "the evaluation an interrupt cut short" in text, text
    assert "Nothing to do" not in text and "nan" not in text, text
    assert load_checkpoint(out)[3].history[-1]["step"] == 30


def _ddp_worker(rank: int, port: int, corpus: Path, out: Path, overrides: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(1)
    run = train_decoder(corpus, out / "ckpt", preset="tiny", overrides=overrides, device="cpu")
    save_model(run.model, str(out / f"rank{rank}.safetensors"))  # tied weight once
    (out / f"rank{rank}.val").write_text(repr(run.result.history[-1]["val"]))


class _GlobalBatch:
    """One process reading what two DDP ranks read: their batches side by side."""

    def __init__(self, data: TextData, seed: int) -> None:
        self.ranks = [RandomBatches(data, 4, 16, seed, rank) for rank in (0, 1)]

    def batch(self, split):
        pairs = [ranks.batch(split) for ranks in self.ranks]
        return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])

    def start_evaluation(self, step: int) -> None:
        for ranks in self.ranks:
            ranks.start_evaluation(step)


@pytest.mark.parametrize(
    "architecture", [{}, {"arch": "llama", "n_head": 4, "n_kv_head": 2}], ids=["gpt", "llama"]
)
def test_two_process_ddp_matches_one_process_with_the_global_batch(corpus, tmp_path, architecture):
    """gloo DDP, 2 ranks × batch 4: identical ranks; = 1 process × batch 8 within 1e-5; for
    the GPT and for a Llama (grouped-query, untied head: both embedding and head saved)."""
    overrides = {**architecture, "max_iters": 8, "batch_size": 4, "eval_interval": 8}
    spawn_ranks(_ddp_worker, 2, corpus, tmp_path, overrides, seconds=120)
    rank0 = load_file(str(tmp_path / "rank0.safetensors"))
    rank1 = load_file(str(tmp_path / "rank1.safetensors"))
    assert rank0.keys() == rank1.keys()
    saved = {"token_embedding.weight", "lm_head.weight"} & rank0.keys()
    assert len(saved) == (2 if architecture else 1)  # GPT's are tied: saved once
    assert all(torch.equal(rank0[key], rank1[key]) for key in rank0)

    data = TextData.from_file(corpus, 16)
    preset = get_preset("tiny").override(**overrides)
    torch.manual_seed(preset.train.seed)
    model = new_network(preset.model_config(data.tokenizer.vocab_size))
    config = preset.train
    result = train(
        model, configure_optimizer(model, config), _GlobalBatch(data, config.seed), config
    )
    single = model.state_dict()
    for key, value in rank0.items():
        torch.testing.assert_close(value, single[key], atol=1e-5, rtol=0, msg=key)
    ddp_val = float((tmp_path / "rank0.val").read_text())
    assert abs(ddp_val - result.history[-1]["val"]) < 1e-5


def _ddp_poison_worker(rank: int, port: int, out: Path) -> None:
    """Rank 1's weights turn NaN after step 4's update (after DDP's gradient average, so rank 0
    stays finite) while rank 0 gets Ctrl-C: each rank writes what its train() call did."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = _Bigram()
    config = _cycle_config(max_iters=20, eval_interval=3, eval_iters=1, log_interval=1)
    optimizer = configure_optimizer(model, config)
    batches = _Cycle({4: _interrupt} if rank == 0 else {})

    def poison_after_step_four(*_) -> None:
        if rank == 1 and batches.steps == 4:
            _poison(model, "weights")

    optimizer.register_step_post_hook(poison_after_step_four)
    saved = []
    try:
        train(
            nn.parallel.DistributedDataParallel(model), optimizer, batches, config,
            save=lambda step, *_: saved.append(step),
        )  # fmt: skip
        outcome = "no error"
    except SelfAttnError as error:
        outcome = str(error)
    finally:
        distributed.teardown()  # as the command does
    (out / f"rank{rank}.txt").write_text(f"{saved} {outcome}")


def test_ddp_ranks_agree_to_refuse_a_save_when_one_rank_is_not_finite(tmp_path):
    """gloo, 2 ranks: NaN weights on rank 1 only, Ctrl-C on rank 0 only: both ranks stop at
    step 4 and refuse its save with the same line (rank 0 used to save rank 0's weights)."""
    spawn_ranks(_ddp_poison_worker, 2, tmp_path, seconds=120)
    kept = (
        "training diverged: the weights are no longer finite at step 4; the checkpoint of "
        "step 3 is kept: resume it with a lower --lr, e.g. --lr 0.01"
    )
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == f"[3] {kept}"


def test_training_leaves_a_process_group_the_caller_set_up(corpus, tmp_path):
    """A caller's own process group (gloo, one rank) is still there after training and after
    a failed run: train_decoder leaves only a group it joined (it destroyed the caller's)."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        train_decoder(corpus, tmp_path / "out", preset="tiny", overrides={"max_iters": 2})
        assert torch.distributed.is_initialized()
        with pytest.raises(SelfAttnError, match="already holds a checkpoint"):
            train_decoder(corpus, tmp_path / "out", preset="tiny", overrides={"max_iters": 2})
        assert torch.distributed.is_initialized()
    finally:
        distributed.teardown()


def _ddp_ctrl_c_in_an_evaluation_worker(rank: int, port: int, corpus: Path, out: Path) -> None:
    """Each rank trains EVERY_TEN straight; then again with Ctrl-C on rank 1 only, during the
    2nd batch of step 20's evaluation; then resumes that run. Each writes what it saw. The
    three runs share one process group (a second on the same port would hang at its start)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    settings = {"preset": "tiny", "overrides": EVERY_TEN, "device": "cpu"}
    drawn = []
    try:
        straight = train_decoder(corpus, out / "straight", **settings)
        run_module.RandomBatches = _ctrl_c_at_validation_batch(12, drawn, ctrl_c=rank == 1)
        stopped = train_decoder(corpus, out / "run", **settings)
        run_module.RandomBatches = RandomBatches
        resumed = train_decoder(corpus, out / "run", **settings, resume=True)
    finally:
        distributed.teardown()  # the group is this worker's: train_decoder leaves it be
    weights = zip(straight.model.parameters(), resumed.model.parameters(), strict=True)
    seen = {
        "stopped": [stopped.result.interrupted, stopped.result.step, len(drawn)],
        "losses": stopped.result.losses + resumed.result.losses == straight.result.losses,
        "history": resumed.result.history == straight.result.history,
        "weights": all(torch.equal(a, b) for a, b in weights),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


def test_ddp_ranks_all_abandon_an_evaluation_that_one_rank_got_ctrl_c_in(corpus, tmp_path):
    """gloo, 2 ranks, Ctrl-C on rank 1 only during step 20's evaluation: both ranks stop
    before its 3rd batch (no rank waits for the other at a collective), save step 20, and
    resume to what 30 straight steps give, bit for bit, on each rank."""
    spawn_ranks(_ddp_ctrl_c_in_an_evaluation_worker, 2, corpus, tmp_path, seconds=180)
    expected = {"stopped": [True, 20, 12], "losses": True, "history": True, "weights": True}
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected, rank


def _lost_rank_worker(rank: int, port: int, corpus: Path, out: Path) -> None:
    """Both ranks train (as torchrun starts them, but by hand); rank 1 vanishes at its 5th
    batch, exit status 0 (so that the spawner waits for rank 0). Rank 0 writes what it says."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(1)

    drawn = []

    class Vanishes(RandomBatches):
        def batch(self, split):
            drawn.append(split)
            if rank == 1 and drawn.count("train") == 5:
                os._exit(0)
            return super().batch(split)

    run_module.RandomBatches = Vanishes
    try:
        train_decoder(corpus, out / "run", preset="tiny", overrides=EVERY_TEN, device="cpu")
        outcome = "no error"
    except SelfAttnError as error:
        outcome = str(error)
    (out / f"rank{rank}.txt").write_text(outcome)


def test_a_rank_that_vanishes_leaves_the_other_one_line(corpus, tmp_path):
    """gloo, 2 ranks started by hand (no torchrun to stop the rest): rank 1 exits mid-run;
    rank 0 said it in a 20-line gloo traceback ("Connection reset by peer"), now in one line
    that keeps the checkpoints and says to resume."""
    spawn_ranks(_lost_rank_worker, 2, corpus, tmp_path, seconds=120)
    said = (tmp_path / "rank0.txt").read_text()
    assert said.startswith("this 2-process run lost another process (") and "\n" not in said
    assert said.endswith(f"the checkpoints in {tmp_path / 'run'} are kept: run every process "
                         "again with --resume"), said  # fmt: skip
    assert not (tmp_path / "rank1.txt").exists()


def _ddp_train_loss_worker(rank: int, port: int, out: Path) -> None:
    """Two ranks train a bigram table on different batches; each writes its step losses and
    the evaluation history."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = _Bigram()
    config = _cycle_config(max_iters=4, eval_interval=2, eval_iters=1)
    torch.manual_seed(rank)  # each rank its own batches
    try:
        model = nn.parallel.DistributedDataParallel(model)
        result = train(model, configure_optimizer(model, config), _Cycle(), config)
    finally:
        distributed.teardown()  # as the command does
    (out / f"rank{rank}.json").write_text(json.dumps([result.losses, result.history]))


def test_ddp_train_loss_is_the_mean_over_every_ranks_steps(tmp_path):
    """gloo, 2 ranks: each evaluation's train loss, on both ranks, is the mean of both ranks'
    steps since the one before, as the val loss is of both ranks' batches (it was rank 0's)."""
    spawn_ranks(_ddp_train_loss_worker, 2, tmp_path, seconds=120)
    (losses0, history0), (losses1, history1) = (
        json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)
    )
    assert losses0 != losses1 and history0 == history1
    assert [record.get("train") for record in history0] == pytest.approx(
        [None, sum(losses0[:2] + losses1[:2]) / 4, sum(losses0[2:] + losses1[2:]) / 4]
    )


def _ddp_locked_out_worker(rank: int, port: int, corpus: Path, out: Path) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    try:
        train_decoder(corpus, out, preset="tiny", overrides={"max_iters": 2}, device="cpu")
        outcome = "trained"
    except SelfAttnError as error:
        outcome = str(error)
    (out / f"rank{rank}.txt").write_text(outcome)


def test_ddp_ranks_all_stop_when_the_out_is_locked(corpus, tmp_path):
    """gloo, 2 ranks, --out held by another run: rank 0 finds the lock and every rank stops
    (rank 1 takes no lock of its own, and must not wait for a rank 0 that never trains)."""
    from selfattn.train.lock import hold

    with hold(tmp_path):
        spawn_ranks(_ddp_locked_out_worker, 2, corpus, tmp_path, seconds=60)
    in_use = f"--out {tmp_path} is in use by another run"
    assert (tmp_path / "rank0.txt").read_text().startswith(f"{in_use} (pid {os.getpid()})")
    assert (tmp_path / "rank1.txt").read_text() == in_use
    assert not (tmp_path / "LATEST").exists()


UTF8_SCRIPT = """
import sys
from pathlib import Path
from selfattn.train import load_checkpoint, train_decoder
corpus, out = Path(sys.argv[1]), Path(sys.argv[2])
train_decoder(corpus, out, preset="tiny", overrides={"max_iters": 2, "eval_iters": 1}, device="cpu")
print(ascii(load_checkpoint(out)[1].chars))
"""


def test_a_non_ascii_vocabulary_trains_and_loads_under_an_ascii_locale(tmp_path):
    """LC_ALL=C without UTF-8 mode (the locale's encoding is ASCII): a corpus with è and 日本
    trains, saves and loads, and the JSON files are UTF-8 (they used to be written in the
    locale's encoding: UnicodeEncodeError here, other bytes under Latin-1)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TRAINING_TEXT.replace("e", "è") + "日本\n", encoding="utf-8")
    out = tmp_path / "out"
    locale = {"LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    result = subprocess.run(
        [sys.executable, "-c", UTF8_SCRIPT, str(corpus), str(out)],
        capture_output=True, text=True, env={**os.environ, **locale}, timeout=120,
    )  # fmt: skip
    chars = "".join(sorted(set(corpus.read_text(encoding="utf-8"))))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == ascii(chars)
    directory = checkpoint_module.checkpoint_dir(out)
    saved = json.loads((directory / "tokenizer.json").read_bytes().decode("utf-8"))
    assert saved["chars"] == chars


def test_generation_is_reproducible_with_a_seed(trained):
    """The same seed gives the same text (exact); another seed gives other text."""
    runner = CliRunner()
    args = ["generate", "--checkpoint", str(trained), "All:", "--max-new-tokens", "40"]
    first = runner.invoke(app, [*args, "--seed", "3"])
    again = runner.invoke(app, [*args, "--seed", "3"])
    other = runner.invoke(app, [*args, "--seed", "4"])
    assert first.exit_code == 0, first.output
    assert first.stdout.startswith("All:") and len(first.stdout.rstrip("\n")) == 44
    assert first.stdout == again.stdout != other.stdout


def _error_line(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (1, 2), result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def test_data_that_is_no_regular_file_is_named_for_what_it_is(tmp_path):
    # /dev/null "did not exist"; a folder, a device and a pipe each say what they are (each
    # process of a distributed run reads the file: a pipe would give its text to one).
    base = ["train", "--preset", "tiny", "--out", str(tmp_path / "out"), "--data"]
    fix = "not a regular file; pass a text file with --data (to train on a command's output, "
    assert _error_line([*base, "/dev/null"]) == (
        f"Error: data file /dev/null is a character device, {fix}save it to a file first)"
    )
    assert _error_line([*base, str(tmp_path)]) == (
        f"Error: data file {tmp_path} is a folder; pass a text file with --data"
    )
    missing = tmp_path / "missing.txt"
    assert _error_line([*base, str(missing)]) == (
        f"Error: data file {missing} does not exist; pass a text file with --data"
    )
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        assert f"data file {fifo} is a pipe (FIFO), {fix}" in _error_line([*base, str(fifo)])


def test_a_byte_order_mark_is_no_character_of_the_vocabulary(tmp_path):
    # Notepad and others start UTF-8 files with U+FEFF; it used to become a vocabulary character.
    text = TRAINING_TEXT * 3
    marked = tmp_path / "marked.txt"
    marked.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert read_text(marked) == text
    only_mark = tmp_path / "only-mark.txt"
    only_mark.write_bytes(b"\xef\xbb\xbf")
    with pytest.raises(SelfAttnError, match="is empty; pass a file with text in it"):
        read_text(only_mark)
    broken = tmp_path / "broken.txt"  # the bad byte is the file's 6th (0-based 5), mark or not
    broken.write_bytes(b"\xef\xbb\xbfab\xffcd")
    with pytest.raises(SelfAttnError, match=r"is not UTF-8 text \(invalid start byte at byte 5\)"):
        read_text(broken)


def test_a_prompt_that_is_not_utf8_is_one_line_naming_the_byte(trained):
    # Bytes of the command line that are not UTF-8 reach Python as lone surrogates: that is
    # what the line says, not "characters not in the model's vocabulary: '\udcff'".
    line = _error_line(["generate", "--checkpoint", str(trained), "All: \udcff"])
    assert line == (
        "Error: the text is not valid UTF-8 (byte 0xff at character 5); re-encode it as UTF-8"
    )


def test_bad_inputs_give_one_clear_line(corpus, trained, tmp_path):
    """Each mistake: exit code 1 or 2, one "Error: ..." line on stderr, no traceback."""
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text("")
    short.write_text("To be or not to be")
    out = str(tmp_path / "out")
    base = ["train", "--preset", "tiny", "--out", out]

    assert "does not exist" in _error_line([*base, "--data", str(tmp_path / "missing.txt")])
    assert "is empty" in _error_line([*base, "--data", str(empty)])
    assert "too short for block size 16" in _error_line([*base, "--data", str(short)])
    line = _error_line(["train", "--data", str(corpus), "--out", out, "--preset", "huge"])
    assert "unknown preset 'huge'" in line and "shakespeare-char-cpu" in line and "tiny" in line
    line = _error_line(["train", "--data", str(corpus), "--out", str(trained), "--resume",
                        "--n-embd", "64", "--max-iters", "40"])  # fmt: skip
    assert "another configuration" in line and "(--n-embd 32 vs 64:" in line
    assert "--resume" in _error_line(["train", "--data", str(corpus), "--out", str(trained)])
    assert "nothing to resume" in _error_line([*base, "--data", str(corpus), "--resume"])
    line = _error_line([*base, "--data", str(corpus), "--n-head", "3"])
    assert "invalid training settings" in line and "a multiple of --n-head 3" in line
    line = _error_line(["generate", "--checkpoint", str(tmp_path / "nowhere"), "hi"])
    assert "does not exist" in line
    assert "not in the model's vocabulary" in _error_line(
        ["generate", "--checkpoint", str(trained), "Zebra"]
    )


@pytest.mark.parametrize(
    ("text", "split"),
    [("a", "0-character training split (the first 90%)"),
     ("ab" * 50, "10-character validation split (the last 10%)")],
)  # fmt: skip
def test_text_too_short_for_the_block_names_the_split_that_is(tmp_path, text, split):
    """One character: 0 train, 1 held out; the message spoke of a 1-character validation
    split, as if the held-out part were the one too short."""
    data = tmp_path / "short.txt"
    data.write_text(text)
    line = _error_line(["train", "--data", str(data), "--out", str(tmp_path / "out"), "--preset",
                        "tiny"])  # fmt: skip
    assert f"characters give a {split}, and each split needs at least 17" in line, line


def test_splits_of_exactly_one_window_and_distinct_batch_seeds():
    """A split needs block_size + 1 tokens, one window and its next token: a validation split
    of exactly that many (5 of 50 characters, block 4) is taken, and every batch drawn from it
    is its one window; one token fewer (4 of 40) is refused as too short. And batch_seed gives
    each (rank, split) its own generator seed, ranks 0 to 3 of both splits distinct."""
    text = "".join(chr(ord("a") + i % 26) for i in range(50))
    data = TextData.from_text(text, 4)
    assert len(data.val) == 5
    inputs, targets = RandomBatches(data, batch_size=3, block_size=4, seed=0).batch("val")
    assert torch.equal(inputs, data.val[:4].expand(3, 4))
    assert torch.equal(targets, data.val[1:].expand(3, 4))
    with pytest.raises(SelfAttnError, match=r"too short for block size 4: .* 4-character valid"):
        TextData.from_text(text[:40], 4)
    seeds = {batch_seed(7, rank, split) for rank in range(4) for split in ("train", "val")}
    assert len(seeds) == 8


def test_out_naming_one_checkpoint_folder_is_refused(corpus, trained):
    """--out runs/x/step-… (a folder `generate --checkpoint` takes) with --resume trained and
    nested step folders inside it, which the next save into runs/x deleted."""
    step_folder = checkpoint_module.checkpoint_dir(trained)
    before = sorted(path.name for path in step_folder.iterdir())
    args = ["train", "--data", str(corpus), "--out", str(step_folder), "--max-iters", "31"]
    for resume in (["--resume"], []):
        line = _error_line([*args, *resume])
        assert "is one checkpoint folder, not a training folder" in line, line
        assert f"pass the folder that holds it, {trained.resolve()}, as --out" in line, line
    assert sorted(path.name for path in step_folder.iterdir()) == before


def test_an_unknown_override_lists_the_valid_names(corpus, tmp_path):
    with pytest.raises(SelfAttnError) as error:
        train_decoder(corpus, tmp_path / "out", preset="tiny", overrides={"max_iter": 3})
    message = str(error.value)
    assert "\n" not in message and "unknown training setting(s) 'max_iter'" in message
    assert "max_iters" in message and "n_embd" in message and "learning_rate" in message
    assert not (tmp_path / "out").exists()


def test_load_points_a_training_folder_to_load_model(trained):
    step = next(trained.glob("step-*"))
    for folder in (trained, step):
        with pytest.raises(SelfAttnError, match="selfattn train` checkpoint") as error:
            selfattn.load(folder)
        assert f"selfattn.train.load_model('{folder}')" in str(error.value)
        assert f"--checkpoint {folder}" in str(error.value)
        assert load_model(folder).config == load_model(trained).config


def test_load_points_a_training_folder_without_its_latest_file_to_load_model(trained, tmp_path):
    """A training folder whose LATEST is lost (its step-* folders kept) is still no Hugging
    Face model: the same pointer to load_model, not a missing config.json."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    (copy / "LATEST").unlink()
    with pytest.raises(SelfAttnError, match="selfattn train` checkpoint") as error:
        selfattn.load(copy)
    assert f"selfattn.train.load_model('{copy}')" in str(error.value)


def test_a_resume_with_nothing_to_do_prints_one_line_and_no_bar(corpus, trained):
    """Resuming a 30-step run with --max-iters 10: only "Nothing to do", no bar, no NaN; the
    line says that --max-iters counts from the first run (it read "(--max-iters)" only, to a
    reader who took --max-iters 10 for 10 more steps)."""
    args = ["train", "--data", str(corpus), "--out", str(trained), "--resume"]
    result = CliRunner().invoke(app, [*args, "--max-iters", "10"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # the console wraps long lines
    assert text.startswith("Nothing to do: ") and text.endswith(
        "--max-iters 10 counts the steps since the first run; pass a larger one to train on."
    ), text
    assert "already at step 30" in text and "nan" not in text and "tok/s" not in text, text
    run = train_decoder(corpus, trained, overrides={"max_iters": 30}, resume=True, device="cpu")
    assert run.result.step == run.result.start_step == 30 and run.result.losses == []
    assert run.result.history[-1]["step"] == 30 and not run.result.interrupted


def test_a_latest_file_naming_a_missing_folder_says_so(trained, tmp_path):
    """LATEST = "garbage": the error names LATEST, its content and an existing step folder."""
    out = tmp_path / "out"
    save_checkpoint(out, *load_checkpoint(trained))
    (out / "LATEST").write_text("garbage\n")
    step_dir = next(out.glob("step-*")).name
    for args in (
        ["generate", "--checkpoint", str(out), "All:"],
        ["train", "--data", str(trained), "--out", str(out), "--resume"],
    ):
        line = _error_line(args)
        assert f"{out / 'LATEST'} points at checkpoint folder 'garbage'" in line, line
        assert "is missing" in line and step_dir in line and "no LATEST" not in line, line


@pytest.mark.parametrize("pointer", ["relative", "absolute", "link"])
def test_a_latest_file_pointing_outside_its_folder_is_refused(trained, corpus, tmp_path, pointer):
    """LATEST naming a checkpoint outside --out (../elsewhere/step-…, an absolute path, or a
    step-… link to it): generate and resume refuse it in one line naming the folder's own
    step folder, as for a LATEST naming a missing one; both used to read the other run."""
    elsewhere = save_checkpoint(tmp_path / "elsewhere", *load_checkpoint(trained))
    out = tmp_path / "out"
    own = save_checkpoint(out, *load_checkpoint(trained)).name
    name = {"relative": f"../elsewhere/{elsewhere.name}", "absolute": str(elsewhere)}.get(
        pointer, "step-9999999-link"
    )
    if pointer == "link":
        (out / name).symlink_to(elsewhere)
    (out / "LATEST").write_text(name + "\n")
    for args in (
        ["generate", "--checkpoint", str(out), "All:"],
        ["train", "--data", str(corpus), "--out", str(out), "--resume", "--max-iters", "31"],
    ):
        line = _error_line(args)
        assert f"points at checkpoint folder {name[:80]!r}, which is outside {out}" in line, line
        assert f"e.g. {own}" in line, line
    assert [entry.name for entry in out.glob("step-*") if entry.name != name] == [own]


def test_an_unusable_out_data_or_device_fails_before_training(corpus, tmp_path):
    """--out a file (or under one), --data a folder, --device cuda without CUDA: one line
    before any step (an --out file used to fail with a traceback after the whole run)."""
    afile = tmp_path / "afile"
    afile.write_text("notes")
    base = ["train", "--data", str(corpus), "--preset", "tiny", "--max-iters", "2"]
    assert f"--out {afile} is a file" in _error_line([*base, "--out", str(afile)])
    line = _error_line([*base, "--out", str(afile / "sub")])
    assert f"cannot create the --out folder {afile / 'sub'}" in line
    line = _error_line(["train", "--data", str(tmp_path), "--out", str(tmp_path / "o")])
    assert f"data file {tmp_path} is a folder" in line
    assert f"checkpoint {afile} is a file" in _error_line(
        ["generate", "--checkpoint", str(afile), "All:"]
    )
    assert afile.read_text() == "notes"
    if not torch.cuda.is_available():
        line = _error_line([*base, "--out", str(tmp_path / "o"), "--device", "cuda"])
        assert "no CUDA device is available" in line
    line = _error_line([*base, "--out", str(tmp_path / "o"), "--device", "cuda:0"])
    assert line == (
        "Error: unknown device 'cuda:0'; choose auto, cpu or cuda (each process then takes the "
        "GPU of its LOCAL_RANK)"
    )


@pytest.mark.parametrize("device", ["cuda:0", "gpu", "CUDA", "mps"])
def test_an_unknown_device_from_python_is_refused_not_run_on_the_cpu(corpus, tmp_path, device):
    # train_decoder trained on the CPU for any device but "cuda" (a GPU's "cuda:0" too), and
    # load_model/load_checkpoint gave torch's "Expected one of cpu, cuda, ..." for "gpu".
    with pytest.raises(SelfAttnError, match=f"^unknown device {device!r}; choose auto, cpu"):
        train_decoder(corpus, tmp_path / "out", preset="tiny", device=device)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("read", [load_model, load_checkpoint])
def test_a_checkpoint_read_onto_an_unknown_device_is_one_line(trained, read):
    with pytest.raises(SelfAttnError, match=r"^unknown device 'gpu'; use 'cpu' or 'cuda'$"):
        read(trained, device="gpu")  # torch's "Expected one of cpu, cuda, ipu, ..."
    if not torch.backends.mps.is_available():
        with pytest.raises(SelfAttnError, match=r"^device 'mps' is not available here; use 'cpu'$"):
            read(trained, device="mps")  # torch's NotImplementedError


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--lr", "inf"),
        ("--min-lr", "nan"),
        ("--grad-clip", "nan"),
        ("--weight-decay", "inf"),
        ("--beta1", "nan"),
    ],
)
def test_non_finite_settings_are_refused(corpus, tmp_path, flag, value):
    """inf/nan settings used to train silently to a NaN loss."""
    args = ["train", "--data", str(corpus), "--out", str(tmp_path / "o"), "--preset", "tiny"]
    line = _error_line([*args, "--max-iters", "2", flag, value])
    assert "must be a finite number" in line and value in line


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--warmup-iters", "200", "--lr-decay-iters", "100"],
      "--warmup-iters 200 (warmup_iters= in Python) must be below --lr-decay-iters 100 "
      "(lr_decay_iters= in Python); raise --lr-decay-iters above 200 or lower --warmup-iters "
      "below 100"),
     (["--lr", "1e-4"],
      "--min-lr 0.0003 (min_lr= in Python) is above --lr 0.0001 (learning_rate= in Python); "
      "lower --min-lr to 0.0001 or less, or raise --lr"),
     (["--min-lr", "0"], "--min-lr 0.0 (min_lr= in Python) must be above 0"),
     (["--eval-iters", "0"], "--eval-iters 0 (eval_iters= in Python) must be at least 1"),
     (["--grad-clip", "-1"], "--grad-clip -1.0 (grad_clip= in Python) must be 0 or more"),
     (["--beta2", "1"], "--beta2 1.0 (beta2= in Python) must be in [0, 1) (AdamW's betas)"),
     (["--beta1", "-0.1"], "--beta1 -0.1 (beta1= in Python) must be in [0, 1) (AdamW's betas)"),
     (["--lr-decay-iters", "0", "--warmup-iters", "0"],
      "--lr-decay-iters 0 (lr_decay_iters= in Python) must be at least 1"),
     (["--seed", "100000000000000"],
      "--seed 100000000000000 (seed= in Python) is out of range; choose one between "
      "-9223344366820 and 9223344366820"),
     (["--n-layer", "0"], "--n-layer 0 (n_layer= in Python) must be at least 1"),
     (["--n-embd", "0"], "--n-embd 0 (n_embd= in Python) must be at least 1"),
     (["--n-head", "3"],
      "--n-embd 32 (n_embd= in Python) must be a multiple of --n-head 3 (n_head= in Python): "
      "each head is n_embd / n_head wide; choose --n-embd 33 or a --n-head that divides it"),
     (["--arch", "llama", "--n-head", "0"], "--n-head 0 (n_head= in Python) must be at least 1"),
     (["--dropout", "1"],
      "--dropout 1.0 (dropout= in Python) must be a probability in [0, 1) (0: no dropout; "
      "nanoGPT's shakespeare_char uses 0.2)")],
)  # fmt: skip
def test_invalid_settings_name_their_flags_and_the_fix(corpus, tmp_path, flags, message):
    """They were named as Python fields with no fix ("need 0 <= warmup_iters < lr_decay_iters,
    got 200 and 100"); every flag named is one of `selfattn train`'s, and nothing is created.
    The model's sizes were named as the configs' fields ("GPTConfig.n_layer must be positive,
    got 0", "LlamaConfig.n_heads ..."), a seed past 64-bit generators was a traceback, and
    --lr-decay-iters 0 advised "lower --warmup-iters below 0"."""
    out = tmp_path / "o"
    line = _error_line(["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny",
                        *flags])  # fmt: skip
    assert line == f"Error: invalid training settings: {message}", line
    train_flags = typer.main.get_command(app).commands["train"].params
    known = {option for param in train_flags for option in param.opts}
    assert set(re.findall(r"--[a-z0-9-]+", line)) <= known, line
    assert not out.exists()


@pytest.mark.parametrize(
    ("min_lr", "advice"), [(0.01, "--lr 0.01"), (0.05, "--lr 0.01 --min-lr 0.005")]
)
def test_the_divergence_advice_is_a_learning_rate_that_can_be_set(min_lr, advice):
    """A tenth of --lr 0.1, with --min-lr lowered too when it would be above that: the advice
    was a bare "a lower --lr", and one below --min-lr was refused as an invalid setting."""
    torch.manual_seed(0)
    model = _Bigram()
    config = _cycle_config(learning_rate=0.1, min_lr=min_lr, max_iters=4, eval_interval=2)
    batches = _Cycle({2: lambda: _poison(model, "weights")})
    with pytest.raises(SelfAttnError) as error:
        train(model, configure_optimizer(model, config), batches, config)
    assert str(error.value).endswith(f"start again with a lower --lr, e.g. {advice}"), error.value
    flags = dict(zip(advice.split()[::2], map(float, advice.split()[1::2]), strict=True))
    _cycle_config(learning_rate=flags["--lr"], min_lr=flags.get("--min-lr", min_lr))


def test_a_diverging_run_stops_before_overwriting_its_checkpoint(corpus, tmp_path):
    """Resuming at lr 1e6 makes the loss NaN: one line naming the kept step; the checkpoint
    of step 6 is untouched (it used to be overwritten by NaN weights). The flags it advises
    are accepted (a bare lower --lr, below --min-lr, was refused as an invalid setting)."""
    out = tmp_path / "out"
    overrides = {"max_iters": 6, "eval_interval": 3, "eval_iters": 1}
    train_decoder(corpus, out, preset="tiny", overrides=overrides, device="cpu")
    args = ["train", "--data", str(corpus), "--out", str(out), "--resume", "--max-iters", "12"]
    line = _error_line([*args, "--lr", "1e6", "--min-lr", "1e6"])
    kept = "checkpoint of step 6 is kept: resume it with a lower --lr, e.g. "
    assert "training diverged" in line and kept in line, line
    advice = line.split(kept)[1].split()
    assert advice == ["--lr", "100000.0", "--min-lr", "100000.0"], line
    assert "training diverged" in _error_line([*args, *advice])  # diverges again, but runs
    model, _, _, state = load_checkpoint(out)
    assert state.step == 6
    assert all(torch.isfinite(value).all() for value in model.state_dict().values())


def test_a_second_run_into_a_locked_out_is_refused(trained, corpus, tmp_path):
    """Two runs writing one --out replaced each other's checkpoints. While one holds it (here
    this test, for the other process) another is refused in one line naming the folder and
    the holder's pid, resumed or fresh, and leaves the folder as it was; the lock goes with
    the run, on an error too, and its file is no checkpoint (resume and generate read on)."""
    from selfattn.train.lock import hold  # (a module the code before the lock lacked)

    out = tmp_path / "out"
    save_checkpoint(out, *load_checkpoint(trained))
    base = ["train", "--data", str(corpus), "--out", str(out), "--max-iters", "31"]
    with hold(out):
        before = sorted(path.name for path in out.iterdir())
        for resume in (["--resume"], []):
            line = _error_line([*base, *resume])
            assert line == (
                f"Error: --out {out} is in use by another run (pid {os.getpid()}); wait for it "
                "to end or choose another --out"
            ), line
        assert sorted(path.name for path in out.iterdir()) == before
    result = CliRunner().invoke(app, [*base, "--resume"])
    assert result.exit_code == 0 and load_checkpoint(out)[3].step == 31, result.output
    assert "already holds a checkpoint" in _error_line(base)  # raised while holding the lock
    with hold(out):
        result = CliRunner().invoke(app, ["generate", "--checkpoint", str(out), "All:"])
    assert result.exit_code == 0 and (out / ".lock").is_file(), result.output
    # after four holders the file names the last alone (appended pids read as no pid)
    assert (out / ".lock").read_text() == f"{os.getpid()}\n"


def test_without_fcntl_runs_are_not_locked(tmp_path, monkeypatch):
    """Windows has no fcntl: the lock module still imports, and holds nothing."""
    from selfattn.train import lock

    monkeypatch.setitem(sys.modules, "fcntl", None)
    try:
        importlib.reload(lock)
        with lock.hold(tmp_path), lock.hold(tmp_path):
            assert not (tmp_path / ".lock").exists()
    finally:
        monkeypatch.undo()
        importlib.reload(lock)


def test_a_failed_save_is_one_line(corpus, tmp_path, monkeypatch):
    """A full disk while saving: one line naming the step and the folder, no traceback."""

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_module, "save_checkpoint", full)
    out = tmp_path / "out"
    args = ["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny"]
    line = _error_line([*args, "--max-iters", "2"])
    assert f"cannot write the checkpoint of step 2 in {out}: No space left on device" in line


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file-size limits")
def test_a_write_the_system_refuses_in_safetensors_is_one_line(corpus, tmp_path):
    """A real refused write (a 32 KiB file-size limit, EFBIG, as a full disk gives ENOSPC)
    inside safetensors' writer: it raises a SafetensorError, not an OSError, so `selfattn
    train` printed a traceback; now the same one line as any failed save (seen on a full tmpfs),
    which no longer says "the previous checkpoint is kept" when there is none."""
    import resource

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, resource.RLIM_INFINITY))

    out = tmp_path / "out"
    args = ["--data", str(corpus), "--out", str(out), "--preset", "tiny", "--device", "cpu"]
    result = subprocess.run(
        [sys.executable, "-m", "selfattn", "train", *args, "--max-iters", "2"],
        capture_output=True, text=True, timeout=120, preexec_fn=limit_file_size,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr == (
        f"Error: cannot write the checkpoint of step 2 in {out}: File too large; "
        "nothing was saved\n"
    )
    assert not (out / "LATEST").exists()
    assert [entry.name for entry in out.iterdir()] == [".lock"]  # no temporary folder left


def _ddp_full_disk_worker(rank: int, port: int, corpus: Path, out: Path) -> None:
    """Rank 0's save fails (a full disk); each rank writes how its run ended."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(1)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    run_module.save_checkpoint = full  # (a spawned process of its own)
    try:
        train_decoder(corpus, out / "ckpt", preset="tiny", overrides={"max_iters": 4}, device="cpu")
        outcome = "trained"
    except SelfAttnError as error:
        outcome = str(error)
    (out / f"rank{rank}.txt").write_text(outcome)


def test_ddp_ranks_all_stop_when_rank_zero_cannot_save(corpus, tmp_path):
    """gloo, 2 ranks, rank 0's save at step 4 (the last) fails: every rank stops with a
    one-line error. Rank 1 carried on as if it had saved: here it ended "trained"; with steps
    left it died at its next collective with gloo's "Connection closed by peer" traceback
    (under torchrun on a full tmpfs)."""
    spawn_ranks(_ddp_full_disk_worker, 2, corpus, tmp_path, seconds=60)
    assert (tmp_path / "rank0.txt").read_text() == (
        f"cannot write the checkpoint of step 4 in {tmp_path / 'ckpt'}: No space left on "
        "device; nothing was saved"
    )
    assert (tmp_path / "rank1.txt").read_text() == "rank 0 could not write the checkpoint of step 4"


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
     RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 13600000000 bytes.")],
)  # fmt: skip
def test_running_out_of_memory_is_one_line_naming_smaller_sizes(
    corpus, tmp_path, monkeypatch, error
):
    """A batch too big for the GPU (or the CPU's memory) used to end in torch's traceback."""

    def out_of_memory(*args, **kwargs):
        raise error

    monkeypatch.setattr(GPT, "forward", out_of_memory)
    args = ["train", "--data", str(corpus), "--out", str(tmp_path / "o"), "--preset", "tiny"]
    line = _error_line([*args, "--max-iters", "2"])
    assert "out of memory on cpu" in line and "smaller --batch-size or --block-size" in line


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_anything_is_made(
    corpus, trained, tmp_path, monkeypatch
):
    """--batch-size 100000000 went on to allocate: for tiny, 13.6 GB of 17-token windows (many
    seconds of filling memory, on a machine other jobs share), then the embedding's 204 GB.
    Now one line naming the flag and the largest batch that could fit, before --out is made
    (and on --resume); at 64 KiB of memory (28 tokens of tiny), --batch-size 1 still trains,
    2 does not, and a block of 32 tokens names --block-size."""
    out = tmp_path / "out"
    base = ["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny", "--device",
            "cpu"]  # fmt: skip
    line = _error_line([*base, "--batch-size", "100000000"])
    assert line.startswith(
        "Error: --batch-size 100000000 (batch_size= in Python) cannot fit: a training step on "
        "100,000,000 sequences of 16 tokens keeps at least "
    ), line
    assert re.search(
        r"and this machine's memory is [\d,.]+ GiB; use a smaller --batch-size \(none above \d+ "
        r"can fit\) or --block-size$",
        line,
    ), line
    assert not out.exists()
    resume = ["train", "--data", str(corpus), "--out", str(trained), "--resume"]
    line = _error_line([*resume, "--max-iters", "31", "--batch-size", "100000000"])
    assert line.startswith("Error: --batch-size 100000000 (batch_size= in Python) cannot fit")

    monkeypatch.setattr(run_module, "_memory_bytes", lambda device: 2**30)
    assert _error_line([*base, "--batch-size", "100000000"]) == (
        "Error: --batch-size 100000000 (batch_size= in Python) cannot fit: a training step on "
        "100,000,000 sequences of 16 tokens keeps at least 3,457.1 GiB of activations, and this "
        "machine's memory is 1.0 GiB; use a smaller --batch-size (none above 28926 can fit) or "
        "--block-size"
    )  # 4 bytes × (8 × 2 layers × 32 wide + 2 × 34 characters) per token
    monkeypatch.setattr(run_module, "_memory_bytes", lambda device: 64 * 2**10)
    assert "(none above 1 can fit)" in _error_line([*base, "--batch-size", "2"])
    line = _error_line([*base, "--block-size", "32"])
    assert line.startswith(
        "Error: --block-size 32 (block_size= in Python) cannot fit: a training step on even one "
        "sequence of 32 tokens keeps at least "
    ), line
    assert line.endswith(
        "use a smaller --block-size (no more than 28 tokens can fit, over the whole batch) or "
        "model (--n-layer, --n-embd)"
    ), line
    assert not out.exists()
    result = CliRunner().invoke(app, [*base, "--batch-size", "1", "--max-iters", "1"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_every_preset_fits_a_machine_of_8_gib(monkeypatch, arch):
    """The rule refuses only what cannot fit: each preset's batch, on shakespeare's 65
    characters, passes on 8 GiB (shakespeare-char's lower bound is 1.1 GiB)."""
    monkeypatch.setattr(run_module, "_memory_bytes", lambda device: 8 * 2**30)
    for preset in PRESETS.values():
        run_module._check_activations_fit(preset.override(arch=arch), 65, torch.device("cpu"))


def _kept_for_backward(model: nn.Module, x: Tensor) -> int:
    """Bytes of the tensors that a training step's forward pass keeps for backward (each
    storage once, the weights aside): a lower bound of the memory the step takes."""
    weights = {param.untyped_storage().data_ptr() for param in model.parameters()}
    kept = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x, x)
    return sum(kept.values())


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_the_memory_rule_is_below_what_a_step_keeps_for_backward(monkeypatch, arch):
    """Each preset: a machine with just the memory that its batch's forward pass keeps for
    backward (17-31 floats per token, layer and unit of width for the GPT, 22-36 for a Llama)
    is not refused; one with a fifth of it is (the rule's 8 stays below them, and within 5×)."""
    for preset in PRESETS.values():
        preset = preset.override(arch=arch)
        model = new_network(preset.model_config(65))
        x = torch.randint(65, (1, preset.train.block_size))
        kept = _kept_for_backward(model, x) * preset.train.batch_size
        monkeypatch.setattr(run_module, "_memory_bytes", lambda device, kept=kept: kept)
        run_module._check_activations_fit(preset, 65, torch.device("cpu"))
        monkeypatch.setattr(run_module, "_memory_bytes", lambda device, kept=kept: kept // 5)
        with pytest.raises(SelfAttnError, match="none above"):
            run_module._check_activations_fit(preset, 65, torch.device("cpu"))


def test_a_text_that_is_not_utf8_names_the_conversion(tmp_path):
    """A Latin-1 file: one line saying where decoding failed and how to convert it."""
    data = tmp_path / "latin.txt"
    data.write_bytes("café au lait\n".encode("latin-1") * 40)
    line = _error_line(["train", "--data", str(data), "--out", str(tmp_path / "o")])
    assert f"{data} is not UTF-8 text (invalid continuation byte at byte 3)" in line, line
    assert f"iconv -f latin1 -t utf-8 {data} > {tmp_path / 'latin-utf8.txt'}" in line, line


def test_the_benchmarks_quick_check_leaves_the_recorded_figure_alone(monkeypatch):
    """`train_shakespeare.py --max-iters 100` (its docstring's quick check) overwrote
    docs/train_head.png, the recorded run's figure; now it draws next to its checkpoint."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "train_shakespeare.py"
    spec = importlib.util.spec_from_file_location("benchmark_train_shakespeare", path)
    benchmark = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, benchmark)  # its dataclasses look it up
    spec.loader.exec_module(benchmark)
    assert benchmark.parse_args(["--max-iters", "100"]).figure is None


TRAINING_STATE = ("state.json", "optimizer.safetensors", "rng.safetensors")  # resume's only


def _damage(trained: Path, tmp_path: Path, name: str, change) -> Path:
    """A copy of the trained folder whose checkpoint file ``name`` went through ``change``."""
    out = tmp_path / "damaged"
    save_checkpoint(out, *load_checkpoint(trained))
    path = checkpoint_module.checkpoint_dir(out) / name
    if name.endswith(".json"):
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
    else:
        path.write_bytes(change(path.read_bytes()))
    return out


@pytest.mark.parametrize(
    ("name", "change", "problem"),
    [
        ("state.json", lambda data: data.pop("history"), "state.json: no 'history' entry"),
        ("state.json", lambda data: data.update(step="x"), "state.json: the step is 'x'"),
        (
            "state.json",
            lambda data: data.update(losses_since_eval=[2.5]),
            "state.json: the losses since the last evaluation are not 0 finite numbers",
        ),
        ("tokenizer.json", lambda data: data.update(chars="abc"), "tokenizer.json: 3 characters"),
        ("config.json", lambda data: data["model"].update(n_embd=64), "config.json: its sizes"),
        ("model.safetensors", lambda data: data[:1000], "model.safetensors: Error while"),
        ("rng.safetensors", lambda data: b"", "rng.safetensors: "),
        (
            "model.safetensors",
            lambda data: _change_tensor(data, "final_norm.weight", float("nan")),
            "model.safetensors: final_norm.weight holds values that are not finite",
        ),
    ],
)
def test_a_damaged_checkpoint_names_the_file(trained, corpus, tmp_path, name, change, problem):
    """resume, and generate where it reads the file: one line naming the damaged file (a
    KeyError, TypeError or IndexError traceback, or torch's 20-line size-mismatch list,
    before; a NaN weight, which training never saves, generated garbage and made the resume
    say "training diverged"). generate reads the model's files only, not the training state."""
    out = _damage(trained, tmp_path, name, change)
    generate = ["generate", "--checkpoint", str(out), "All:", "--max-new-tokens", "5"]
    resume = ["train", "--data", str(corpus), "--out", str(out), "--resume", "--max-iters", "31"]
    reads = [resume] if name in TRAINING_STATE else [generate, resume]
    for args in reads:
        line = _error_line(args)
        assert "is unreadable: " + problem in line and "another --out" in line, line
    if name in TRAINING_STATE:
        assert CliRunner().invoke(app, generate).exit_code == 0


def _change_tensor(data: bytes, key: str, value: Tensor | float | None) -> bytes:
    """A safetensors file with tensor ``key`` removed (None), replaced, or filled with a value."""
    tensors = safetensors.torch.load(data)
    if value is None:
        del tensors[key]
    elif isinstance(value, float):
        tensors[key] = torch.full_like(tensors[key], value)
    else:
        tensors[key] = value
    return safetensors.torch.save(tensors)


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("rank0.torch", None, "no 'rank0.torch' entry"),
        ("rank0.batches.val", None, "no 'rank0.batches.val' entry"),
        # torch's words: "Expected a CPUGeneratorImplState", or before 2.5 "Expected either ..."
        ("rank0.torch", torch.zeros(3, dtype=torch.uint8), "Expected "),
        ("rank0.batches.train", torch.zeros(3), "RNG state must be a torch.ByteTensor"),
    ],
)
def test_damaged_generator_states_are_one_line_on_resume(
    trained, corpus, tmp_path, key, value, problem
):
    """rng.safetensors read but missing an entry, or holding a tensor that is no generator
    state: one line naming the file (a KeyError, RuntimeError or TypeError traceback, before)."""
    out = _damage(
        trained, tmp_path, "rng.safetensors", lambda data: _change_tensor(data, key, value)
    )
    args = ["train", "--data", str(corpus), "--out", str(out), "--resume", "--max-iters", "31"]
    line = _error_line(args)
    assert "is unreadable: rng.safetensors: " + problem in line and "another --out" in line, line
    assert value is None or value.dtype != torch.uint8 or "CPUGeneratorImplState" in line


def test_an_optimizer_state_of_another_shape_is_refused(trained, corpus, tmp_path):
    """AdamW moments of the wrong shape: one line (torch's fused AdamW segfaulted on them).
    In a subprocess, so that the old crash cannot take pytest down."""

    def shrink(data: bytes) -> bytes:  # the last dimension of each moment to 3 (steps: as is)
        tensors = safetensors.torch.load(data)
        shrunk = {
            key: value[..., :3].contiguous() if value.dim() else value
            for key, value in tensors.items()
        }
        return safetensors.torch.save(shrunk)

    out = _damage(trained, tmp_path, "optimizer.safetensors", shrink)
    command = [sys.executable, "-m", "selfattn", "train", "--data", str(corpus), "--out",
               str(out), "--resume", "--max-iters", "31"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result
    line = result.stderr.strip()
    assert line.startswith("Error: the optimizer state in the checkpoint") and "\n" not in line
    assert "exp_avg of parameter 0 has shape" in line, line


def test_a_model_folder_of_another_program_is_not_a_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_embd": 32}')
    line = _error_line(["generate", "--checkpoint", str(tmp_path), "All:"])
    assert f"{tmp_path} is not a `selfattn train` checkpoint" in line, line
    assert line.endswith(
        "it is a Hugging Face model folder: pass it with --model (selfattn.load in Python)"
    )
    (tmp_path / "config.json").write_text('{"something": "else"}')
    line = _error_line(["generate", "--checkpoint", str(tmp_path), "All:"])
    assert line.endswith("pass a folder that `selfattn train --out` wrote"), line


def test_checkpoint_files_are_readable_by_others_like_their_folder(trained):
    """The step folder is 0o755 on purpose; its weights were 0o600 (safetensors' default)."""
    folder = checkpoint_module.checkpoint_dir(trained)
    assert folder.stat().st_mode & 0o777 == 0o755
    modes = {path.name: path.stat().st_mode & 0o777 for path in folder.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_whatever_a_save_renames_into_place_is_synced_before_and_its_folder_after(
    trained, tmp_path, monkeypatch
):
    """POSIX durability: a file's name is data of its folder, so a folder renamed into place
    must be fsynced itself, its files too, before the rename, and the folder it lands in after.
    The step folder's own entries were not synced: after a power cut it could come back
    without its files, with LATEST already naming it."""
    events: list[tuple[str, Path, Path | None]] = []
    real_fsync, real_replace = checkpoint_module._fsync, os.replace

    def fsync(path):
        events.append(("sync", Path(path), None))
        real_fsync(path)

    def replace(src, dst):
        events.append(("rename", Path(src), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint_module, "_fsync", fsync)
    monkeypatch.setattr(checkpoint_module.os, "replace", replace)
    save_checkpoint(tmp_path / "out", *load_checkpoint(trained))
    renames = [index for index, (kind, *_) in enumerate(events) if kind == "rename"]
    assert len(renames) == 2  # the step folder, then LATEST
    for index in renames:
        _, source, target = events[index]
        moved = [source / entry.name for entry in target.iterdir()] if target.is_dir() else []
        synced_before = {path for kind, path, _ in events[:index] if kind == "sync"}
        synced_after = {path for kind, path, _ in events[index + 1 :] if kind == "sync"}
        assert {source, *moved} <= synced_before, (source, synced_before)
        assert target.parent in synced_after, target


def test_characters_outside_the_vocabulary_are_named_briefly(corpus, trained, tmp_path):
    """A prompt of 300 unknown characters: the first 20 and a count (it listed all 300); a
    resume on another text: names that text and the one the checkpoint was trained on."""
    prompt = "".join(chr(0x4E00 + i) for i in range(300))
    line = _error_line(["generate", "--checkpoint", str(trained), prompt])
    assert "not in the model's vocabulary: '一丁" in line and "and 280 more" in line
    assert len(line) < 200, line
    other = tmp_path / "other.txt"
    other.write_text(TRAINING_TEXT.replace("Citizen", "Bürger"))
    args = ["train", "--data", str(other), "--out", str(trained), "--resume", "--max-iters", "31"]
    line = _error_line(args)
    assert f"{other} has characters that the checkpoint's vocabulary lacks ('gü')" in line
    assert f"resume with the text it was trained on ({corpus})" in line, line


def test_help_lists_every_preset():
    assert all(name in TRAIN_HELP["preset"] for name in PRESETS)


def test_ctrl_c_before_training_prints_on_rank_zero_only(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(selfattn.train, "train_decoder", interrupted)
    args = ["train", "--data", "x.txt", "--out", "o"]
    monkeypatch.setenv("RANK", "1")
    assert CliRunner().invoke(app, args).output == ""
    monkeypatch.setenv("RANK", "0")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130 and "nothing saved" in result.output


@pytest.fixture(scope="module")
def wandering():
    """A random GPT (vocab 40, block 16) whose continuations wander, and 8 prompts of 5 ids.

    GPT-2's init repeats one token; weights drawn with std 0.5 do not. Random weights also
    make ties between logits unlikely (the tests below check the gaps they rely on).
    """
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.5)
    prompt = torch.randint(40, (8, 5), generator=torch.Generator().manual_seed(0))
    return model, prompt


def test_top_k_one_or_a_tiny_temperature_samples_the_greedy_continuation(wandering):
    """top_k=1 at any temperature, and temperatures down to the smallest double with or
    without top-k, give the temperature-0 tokens exactly (no NaN); a huge one still samples."""
    model, prompt = wandering
    greedy = model.generate(prompt, 24, temperature=0.0)
    assert len(set(greedy[0, 5:].tolist())) > 1  # a continuation worth comparing
    for temperature in (1.0, 3.0, 1e300):
        tokens = model.generate(prompt, 24, temperature=temperature, top_k=1, seed=1)
        assert torch.equal(tokens, greedy), temperature
    for temperature in (1e-30, 1e-300, 5e-324):
        for top_k in (None, 1, 5):
            tokens = model.generate(prompt, 24, temperature=temperature, top_k=top_k, seed=1)
            assert torch.equal(tokens, greedy), (temperature, top_k)
    logits = torch.tensor([[0.5, 1.0, 1.001, -3.0]], dtype=torch.float16)
    assert sample(logits, 1e-300, None, None).item() == 2  # half precision: no 0 / 0 either
    hot = model.generate(prompt, 24, temperature=1e300, top_k=5, seed=1)
    assert hot.shape == greedy.shape and not torch.equal(hot, greedy)


def test_top_k_of_the_whole_vocabulary_and_a_temperature_past_float32(wandering):
    """top_k of the vocabulary size or more masks nothing: the same draws as top_k=None with
    the same seed (1,000 rows of logits [0, 0, -1], so the lowest logit, token 2, is drawn
    too), where a top_k past the vocabulary raised or the k-th logit was masked. A temperature
    of 1e-300 (float32's smallest normal number instead) on logits up to 50, whose quotients
    overflow float32 unless each row's maximum is taken off first, gives the argmax: no NaN."""
    logits = torch.tensor([[0.0, 0.0, -1.0]]).expand(1_000, 3)
    unrestricted = sample(logits, 1.0, None, torch.Generator().manual_seed(3))
    assert (unrestricted == 2).any()
    for top_k in (3, 4):
        drawn = sample(logits, 1.0, top_k, torch.Generator().manual_seed(3))
        assert torch.equal(drawn, unrestricted), top_k
    peaked = torch.tensor([[1.0, 50.0, 10.0], [40.0, -5.0, 0.0]])
    for top_k in (None, 2):
        assert sample(peaked, 1e-300, top_k, None).flatten().tolist() == [1, 0], top_k


def test_the_largest_sampling_seed_is_taken(wandering):
    """Seeds run from 0 to MAX_SAMPLING_SEED (2³² - 1, the command line's and explorer's
    bound) inclusive: the largest passes the check and seeds a real generation, the same
    tokens twice; one more is refused."""
    model, prompt = wandering
    check_sampling(4, 1.0, None, MAX_SAMPLING_SEED)
    first = model.generate(prompt, 4, temperature=1.0, seed=MAX_SAMPLING_SEED)
    assert torch.equal(model.generate(prompt, 4, temperature=1.0, seed=MAX_SAMPLING_SEED), first)
    with pytest.raises(SelfAttnError, match="seed must be a whole number from 0 to 4294967295"):
        check_sampling(4, 1.0, None, MAX_SAMPLING_SEED + 1)


@pytest.mark.parametrize("top_k", [2, 7])
def test_top_k_sampling_never_leaves_the_top_k_logits(wandering, top_k):
    """8 rows x 40 steps at temperature 2 (the window slides at 16): each sampled token ranks
    among its step's top k logits, recomputed by an uncached forward of that step's window.
    A logit beats the sampled one only by more than 1e-5, ten times the ~1e-6 that cached and
    uncached logits differ by. Every rank < k is drawn (the sampler is not just the argmax);
    without top-k, tokens rank far lower."""
    model, prompt = wandering
    window = model.config.block_size

    def ranks(ids: Tensor) -> Tensor:  # (B, steps): how many logits beat the sampled token
        with torch.no_grad():
            logits = torch.stack(
                [model(ids[:, :t][:, -window:]).logits[:, -1] for t in range(5, ids.shape[1])],
                dim=1,
            )  # (B, steps, vocab)
        return (logits > logits.gather(-1, ids[:, 5:, None]) + 1e-5).sum(-1)

    sampled = ranks(model.generate(prompt, 40, temperature=2.0, top_k=top_k, seed=3))
    assert sampled.max() < top_k
    assert set(sampled.flatten().tolist()) == set(range(top_k))
    unrestricted = ranks(model.generate(prompt, 40, temperature=2.0, seed=3))
    assert unrestricted.max() >= 2 * top_k


@pytest.mark.parametrize(("temperature", "top_k"), [(0.7, None), (1.5, None), (1.0, 5)])
def test_seeded_sampling_is_multinomial_on_the_tempered_softmax(wandering, temperature, top_k):
    """generate(seed=s) draws, step by step, exactly torch.multinomial(softmax(logits / T))
    with a generator seeded s, the logits of an uncached forward of the last block_size ids,
    and those outside the top k set to -inf. 40 steps, so the window slides; ids exact."""
    model, prompt = wandering
    tokens = model.generate(prompt, 40, temperature=temperature, top_k=top_k, seed=4)
    generator = torch.Generator().manual_seed(4)
    expected = prompt
    for _ in range(40):
        with torch.no_grad():
            logits = model(expected[:, -model.config.block_size :]).logits[:, -1]
        if top_k is not None:
            kth = logits.topk(top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / temperature, dim=-1)
        expected = torch.cat([expected, torch.multinomial(probs, 1, generator=generator)], 1)
    assert torch.equal(tokens, expected)
    assert len(set(tokens[0, 5:].tolist())) > 5  # really sampled, not one repeated token


def test_the_default_prompt_is_refused_in_one_line_by_a_model_without_new_lines(tmp_path):
    # A corpus without line breaks gives a vocabulary without "\n", generate's default prompt.
    # Before: "characters not in the model's vocabulary: '\n'", a character never typed. Now
    # the line names the default PROMPT and asks for one; a prompt given still works.
    corpus = tmp_path / "one_line.txt"
    corpus.write_text("to be or not to be, that is the question " * 40)
    out = tmp_path / "out"
    train_decoder(corpus, out, preset="tiny", overrides={"max_iters": 2}, device="cpu")
    line = _error_line(["generate", "--checkpoint", str(out)])
    assert "the default PROMPT, a new line, is not in this model's vocabulary" in line
    result = CliRunner().invoke(app, ["generate", "--checkpoint", str(out), "to ", "--seed", "0",
                                      "--max-new-tokens", "5"])  # fmt: skip
    assert result.exit_code == 0 and result.stdout.startswith("to ") and len(result.stdout) == 9


def test_a_model_copied_without_its_training_state_still_generates(trained, tmp_path):
    # Sampling needs config.json, tokenizer.json and model.safetensors only. Before, generate
    # and explain refused a checkpoint without optimizer.safetensors and rng.safetensors
    # (which are 2x the model and only resume needs); now they run, and resume still refuses.
    copy = tmp_path / "model-only"
    copy.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        shutil.copy(checkpoint_module.checkpoint_dir(trained) / name, copy / name)
    args = ["generate", "All:", "--max-new-tokens", "20", "--seed", "1"]
    full = CliRunner().invoke(app, [*args, "--checkpoint", str(trained)])
    bare = CliRunner().invoke(app, [*args, "--checkpoint", str(copy)])
    assert bare.exit_code == 0, bare.output
    assert bare.stdout == full.stdout  # the same weights, the same seed: the same text
    with pytest.raises(SelfAttnError, match=r"state\.json"):
        load_checkpoint(copy)


def test_ctrl_c_outside_the_steps_says_what_is_left(trained, corpus, tmp_path, monkeypatch):
    # A Ctrl-C that reaches the command outside the training loop (before it, or in the
    # moment after it while processes shut down) used to say "Interrupted before training
    # started; nothing saved" even when a checkpoint had been saved; it now says which.
    import selfattn.train

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(selfattn.train, "train_decoder", interrupted)
    for out, said in ((trained, "the last checkpoint in"), (tmp_path / "new", "nothing saved")):
        result = CliRunner().invoke(app, ["train", "--data", str(corpus), "--out", str(out)])
        assert result.exit_code == 130 and said in result.output, result.output


def test_adamw_betas_from_the_command_line_reach_the_optimizer(corpus, tmp_path, monkeypatch):
    """--beta1/--beta2 (nanoGPT's beta1/beta2) are the betas of the AdamW that trains, and are
    saved with the checkpoint."""
    seen = []

    def configure(model, config):
        optimizer = configure_optimizer(model, config)
        seen.extend(group["betas"] for group in optimizer.param_groups)
        return optimizer

    monkeypatch.setattr(run_module, "configure_optimizer", configure)
    out = tmp_path / "o"
    args = ["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny"]
    result = CliRunner().invoke(
        app, [*args, "--max-iters", "2", "--beta1", "0.8", "--beta2", "0.9"]
    )
    assert result.exit_code == 0, result.output
    assert seen == [(0.8, 0.9), (0.8, 0.9)]
    saved = load_checkpoint(out)[2].train
    assert (saved.beta1, saved.beta2) == (0.8, 0.9)


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"max_iters": 2.5}, "--max-iters 2.5 (max_iters= in Python) must be a whole number"),
     ({"block_size": 8.5}, "--block-size 8.5 (block_size= in Python) must be a whole number"),
     ({"max_iters": True}, "--max-iters True (max_iters= in Python) must be a whole number"),
     ({"seed": 1.5}, "--seed 1.5 (seed= in Python) must be a whole number"),
     ({"eval_interval": "10"}, "--eval-interval '10' (eval_interval= in Python) must be a whole"),
     ({"learning_rate": "0.1"}, "--lr '0.1' (learning_rate= in Python) must be a number"),
     ({"n_layer": 1.5}, "--n-layer 1.5 (n_layer= in Python) must be a whole number"),
     ({"dropout": "0.1"}, "--dropout '0.1' (dropout= in Python) must be a probability in [0, 1)")],
)  # fmt: skip
def test_settings_of_the_wrong_type_are_one_line_naming_the_setting(
    corpus, tmp_path, changes, message
):
    """From Python, 2.5 steps trained 3 (and saved step 3 of --max-iters 2.5), a float block
    size, layer count or seed was a TypeError from torch deep inside, a string a bare "must be
    real number, not str"."""
    out = tmp_path / "out"
    with pytest.raises(SelfAttnError) as error:
        train_decoder(corpus, out, preset="tiny", overrides=changes, device="cpu")
    assert str(error.value) == f"invalid training settings: {message}" or message in str(
        error.value
    ), error.value
    assert not out.exists()


def test_whole_floats_and_numpy_numbers_are_taken_as_the_numbers_they_are(corpus, tmp_path):
    """nanoGPT-style configs write 5e3 for a step count: it is 5000 (an int where one goes)."""
    numpy = pytest.importorskip("numpy")
    config = _cycle_config(max_iters=6e1, eval_iters=numpy.int64(2), learning_rate=numpy.float32(1))
    assert config.max_iters == 60 and type(config.max_iters) is int
    assert type(config.eval_iters) is int and type(config.learning_rate) is float
    run = train_decoder(
        corpus, tmp_path / "out", preset="tiny", overrides={"max_iters": 2e0, "n_layer": 1.0},
        device="cpu",
    )  # fmt: skip
    assert run.result.step == 2 and run.config.model.n_layer == 1
    assert json.loads((checkpoint_module.checkpoint_dir(tmp_path / "out") / "config.json")
                      .read_text())["train"]["max_iters"] == 2  # fmt: skip


def test_bias_takes_what_python_reads_as_a_bool():
    """bias=1 or numpy's True (a config read from elsewhere) is True; "yes" or 2 is refused."""
    numpy = pytest.importorskip("numpy")
    for value in (1, numpy.True_, True):
        assert get_preset("tiny").override(bias=value).bias is True
    for value in ("yes", 2):
        with pytest.raises(SelfAttnError, match=rf"bias={value!r} \(Python only\) must be True"):
            get_preset("tiny").override(bias=value)


@pytest.mark.parametrize("seed", [2**40, -(2**40), loop_module.SEED_LIMIT - 1])
def test_large_seeds_that_torchs_generators_take_are_kept(seed):
    """The seed bound is torch's (64 bits, after batch_seed's arithmetic), not 2³²: seeds up
    to ~9.2e12 either way make every generator the run makes."""
    config = _cycle_config(seed=seed)
    for rank, split in ((0, "train"), (1, "val")):
        torch.Generator().manual_seed(batch_seed(config.seed, rank, split))
    torch.Generator().manual_seed(config.seed + 1)  # the model's, offset by rank


def test_a_resume_into_a_folder_whose_run_has_not_saved_yet_says_it_is_in_use(corpus, tmp_path):
    """A run still before its first checkpoint holds its --out: a --resume into it said
    "nothing to resume ... drop --resume", and doing so then said the folder was in use."""
    from selfattn.train.lock import hold

    out = tmp_path / "out"
    out.mkdir()
    with hold(out):
        line = _error_line(["train", "--data", str(corpus), "--out", str(out), "--resume"])
    assert line.startswith(f"Error: --out {out} is in use by another run (pid "), line
    line = _error_line(["train", "--data", str(corpus), "--out", str(out), "--resume"])
    assert "nothing to resume" in line, line


def test_a_large_text_is_encoded_without_a_python_int_per_character(monkeypatch):
    """A 200 MB text took 23 s and 3.5 GB to start (a list of ids, then torch.tensor of it);
    encoded in chunks through a code-point table it takes 7 s and 2.3 GB, to the same ids."""
    from selfattn.train import data as data_module

    text = "Zwölf Boxkämpfer 🥊 jagen Viktor\nquer über den großen Sylter Deich.\x00\t" * 40
    tokenizer = data_module.CharTokenizer.from_text(text)
    expected = tokenizer.encode(text)
    monkeypatch.setattr(data_module, "ENCODE_CHUNK", 7)  # chunk edges inside the text
    monkeypatch.setattr(data_module.CharTokenizer, "encode", None)  # no list of ids
    data = TextData.from_text(text, block_size=8)
    assert torch.cat([data.train, data.val]).tolist() == expected
    assert data.train.dtype == torch.long
    with pytest.raises(SelfAttnError, match="characters not in the model's vocabulary: '🎉'"):
        tokenizer.encode_tensor("Boxkämpfer 🎉")


def test_evaluations_show_their_batches_on_the_bar(corpus, monkeypatch):
    """An evaluation of shakespeare-char on a CPU (200 batches of 64 × 256) takes about 16
    minutes, and step 0's ran before the bar existed: nothing on the screen at all. The bar
    now reads "eval 37/200" where it says "train" while one runs."""
    labels = []
    real_evaluate = loop_module.evaluate

    def evaluate(*args, done=None, **kwargs):
        def seen(count):
            done(count)
            labels.append(progress_label())

        return real_evaluate(*args, done=seen, **kwargs)

    bars = []
    real_progress = loop_module._progress

    @contextlib.contextmanager
    def progress(*args):
        with real_progress(*args) as bar:
            bars.append(bar)
            yield bar

    def progress_label():
        return bars[-1].tasks[0].description.strip()

    monkeypatch.setattr(loop_module, "evaluate", evaluate)
    monkeypatch.setattr(loop_module, "_progress", progress)
    model = _Bigram()
    config = _cycle_config(max_iters=4, eval_interval=2, eval_iters=3)
    console = Console(file=io.StringIO(), width=120)
    train(model, configure_optimizer(model, config), _Cycle(), config, console=console)
    assert labels == ["eval 0/3", "eval 1/3", "eval 2/3", "train"] * 3, labels
    counts = []
    real_evaluate(model, _Cycle(), 2, done=counts.append)
    assert counts == [0, 1, 2]


def test_an_evaluation_that_raises_puts_the_training_mode_back():
    """A batch that raises mid-evaluation (an out-of-memory, say) leaves the model in training
    mode for a caller that catches it: it stayed in eval mode, dropout silently off."""

    def fail():
        raise RuntimeError("out of memory")

    model = _Bigram().train()
    with pytest.raises(RuntimeError, match="out of memory"):
        loop_module.evaluate(model, _Cycle(at_val={2: fail}), 3)
    assert model.training and model.table.training


def test_an_interrupted_runs_bar_ends_at_the_step_it_stopped_at(monkeypatch):
    """Stopped at step 7 with --log-interval 5, the bar (in a log file, its only line) ended at
    "5/20" above "Interrupted at step 7"; now at 7/20 with step 7's loss."""
    monkeypatch.setattr(loop_module, "_stop_requested", lambda stop, step, *_: step == 7)
    output = io.StringIO()
    model = _Bigram()
    config = _cycle_config(max_iters=20, eval_interval=10, eval_iters=1, log_interval=5)
    console = Console(file=output, width=200)
    result = train(model, configure_optimizer(model, config), _Cycle(), config, console=console)
    bar = [line for line in output.getvalue().splitlines() if line.startswith("train")]
    assert result.interrupted and result.step == 7
    assert bar and " 7/20 loss " in bar[-1], output.getvalue()
    assert f"loss {result.losses[-1]:.4f}" in bar[-1], bar[-1]


@pytest.mark.parametrize(
    ("saved", "running", "note"),
    [(1, 2, "written by 1 process, this run has 2; rank 1 draws batches from a fresh seed, "
            "the others continue theirs"),
     (2, 1, "written by 2 processes, this run has 1; rank 1's batch stream ends (the global "
            "batch is smaller)")],
)  # fmt: skip
def test_a_resume_on_another_count_of_processes_says_what_its_batches_do(
    trained, capsys, saved, running, note
):
    """It said "written by 1 processes" and, resumed on fewer processes, that batches "continue
    from fresh seeds where states are missing" when none were."""
    state = load_checkpoint(trained)[3]
    rng = {
        f"rank{r}.{key.split('.', 1)[1]}": v for key, v in state.rng.items() for r in range(saved)
    }
    data = TextData.from_text(TRAINING_TEXT, 16)
    batches = RandomBatches(data, 2, 16, 1337)
    context = distributed.Context(0, running, 0, torch.device("cpu"))
    run_module._restore_rng(rng, context, batches, Console(file=io.StringIO()), trained)
    assert capsys.readouterr().err == f"note: the checkpoint was {note}\n"


def test_a_resume_on_another_data_file_is_noted(trained, corpus, tmp_path):
    """--resume with another text of the same characters went on silently, and the checkpoint
    then named the new file as its data: one note on stderr now; the same file, however
    spelled (here a link to it), gets none, nor does any file once the recorded one is gone."""
    out = tmp_path / "out"
    save_checkpoint(out, *load_checkpoint(trained))
    link, other = tmp_path / "link.txt", tmp_path / "other.txt"
    link.symlink_to(corpus)
    shutil.copy(corpus, other)
    args = ["train", "--out", str(out), "--resume"]
    result = CliRunner().invoke(app, [*args, "--data", str(link), "--max-iters", "31"])
    assert result.exit_code == 0 and result.stderr == "", result.output
    result = CliRunner().invoke(app, [*args, "--data", str(other), "--max-iters", "32"])
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        f"note: --data {other} is not the file the checkpoint was trained on ({link}); its "
        "characters fit the vocabulary, so training goes on with it, and the checkpoint records "
        "it from now on\n"
    )
    assert load_checkpoint(out)[2].data == str(other)
    # The recorded file gone (moved, or named relative to another folder): not known to be
    # another file, so no note.
    other.unlink()
    result = CliRunner().invoke(app, [*args, "--data", str(link), "--max-iters", "33"])
    assert result.exit_code == 0 and result.stderr == "", result.output


def _selfattn(*args: str, stdout) -> subprocess.CompletedProcess:
    """The command line in its own process, its standard output ``stdout``."""
    command = [sys.executable, "-m", "selfattn", *args]
    return subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300)


def _closed_pipe() -> int:
    """The write end of a pipe whose reader is gone, as `| head -1` leaves it."""
    read, write = os.pipe()
    os.close(read)
    return write


@pytest.mark.slow
def test_a_closed_or_full_standard_output_stops_the_printing_only(corpus, tmp_path):
    """`explain … --html x.html | head -1` ended at its first printed line, the page never
    written, and exit 1 with no word; training into a closed pipe ended without a save, its
    steps lost; `> /dev/full` was a traceback. Now the work goes on: the files, the saves; a
    closed pipe says nothing (exit 1), a full disk one line."""
    page = tmp_path / "bank.html"
    pipe = _closed_pipe()
    explained = _selfattn("explain", "the bank of the river", "--word", "bank", "--html",
                          str(page), stdout=pipe)  # fmt: skip
    trained = _selfattn("train", "--data", str(corpus), "--out", str(tmp_path / "run"),
                        "--preset", "tiny", "--max-iters", "4", "--eval-interval", "2",
                        stdout=pipe)  # fmt: skip
    os.close(pipe)
    assert explained.returncode == 1 and "Traceback" not in explained.stderr
    assert page.stat().st_size > 0 and explained.stderr.startswith("wrote ")
    assert trained.returncode == 1 and "Traceback" not in trained.stderr, trained.stderr
    assert load_checkpoint(tmp_path / "run")[3].step == 4
    if Path("/dev/full").exists():
        with open("/dev/full", "w") as full:
            version = _selfattn("--version", stdout=full)
        assert version.returncode == 1
        assert (
            version.stderr == "Error: cannot write the standard output: No space left on device\n"
        )


def test_a_tokenizer_saves_and_loads_at_a_str_path_and_a_split_is_named(corpus, tmp_path):
    """save/load took only a Path (a str gave an AttributeError), and batch("test") a bare
    KeyError."""
    data = TextData.from_file(corpus, 16)
    path = str(tmp_path / "chars.json")
    data.tokenizer.save(path)
    assert type(data.tokenizer).load(path) == data.tokenizer
    with pytest.raises(ValueError, match="unknown split 'test'; choose one of train, val"):
        RandomBatches(data, 8, 16, seed=0).batch("test")
    # batch_size 0 drew empty batches, a block past the data torch's unfold error
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1, got 0"):
        RandomBatches(data, 0, 16, seed=0)
    with pytest.raises(ValueError, match=r"the val split holds \d+ tokens, too few for one window"):
        RandomBatches(data, 8, len(data.val), seed=0)
