"""Checkpoints and the train command under changed files, foreign folders, concurrent readers
and signals: each case one line (or the exact run), never a traceback or a lost folder."""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from selfattn.cli import app
from selfattn.errors import SelfAttnError
from selfattn.train import (
    CharTokenizer,
    load_checkpoint,
    load_model,
    save_checkpoint,
    train_decoder,
)
from selfattn.train import checkpoint as checkpoint_module
from selfattn.train import loop as loop_module
from selfattn.train import run as run_module
from test_train import _error_line

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: fastest on one thread


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A tiny model trained for 4 steps (saved at steps 2 and 4); its --out directory."""
    out = tmp_path_factory.mktemp("run") / "out"
    train_decoder(corpus, out, preset="tiny", overrides={"max_iters": 4, "eval_interval": 2})
    return out


def _copy(trained: Path, out: Path, change=None, name: str = "") -> Path:
    """A copy of ``trained`` in ``out``, its checkpoint file ``name`` put through ``change``
    (a dict for JSON, tensors for safetensors)."""
    save_checkpoint(out, *load_checkpoint(trained))
    if change is not None:
        path = checkpoint_module.checkpoint_dir(out) / name
        if name.endswith(".json"):
            data = json.loads(path.read_text())
            change(data)
            path.write_text(json.dumps(data))
        else:
            safetensors.torch.save_file(change(safetensors.torch.load_file(path)), path)
    return out


def test_a_save_removes_only_the_folders_training_wrote(trained, tmp_path):
    """The user's step-old/, .tmp-mine/ and a backup step-0000004-keep/ survive saves into
    the folder (each save removed every step-* and .tmp-* folder); an interrupted save's
    .tmp- folder and older checkpoints still go."""
    out = _copy(trained, tmp_path / "out")
    mine = [out / "step-old", out / ".tmp-mine", out / "step-0000004-keep"]
    mine[0].mkdir()
    (mine[0] / "data.txt").write_text("keep")
    mine[1].mkdir()
    shutil.copytree(checkpoint_module.checkpoint_dir(out), mine[2])
    left_over = out / ".tmp-abcd1234"
    left_over.mkdir()
    (left_over / "model.safetensors").write_bytes(b"cut short")
    first = checkpoint_module.checkpoint_dir(out)
    for _ in range(2):
        save_checkpoint(out, *load_checkpoint(out))
    assert all(folder.is_dir() for folder in mine)
    assert (mine[0] / "data.txt").read_text() == "keep"
    assert not left_over.exists() and not first.exists()


def test_a_removal_cut_short_is_finished_by_the_next_save(trained, tmp_path, monkeypatch):
    """A stale checkpoint is renamed .trash-… before it is removed, so a removal cut short (a
    kill, EBUSY, an NFS reader's .nfs… file) is finished by a later save; a half-removed step
    folder used to stay for good."""
    out = _copy(trained, tmp_path / "out")
    first = checkpoint_module.checkpoint_dir(out)
    save_checkpoint(out, *load_checkpoint(out))
    real_rmtree = shutil.rmtree

    def cut_short(path, ignore_errors=False):
        (Path(path) / "config.json").unlink()
        (Path(path) / ".nfs0000000000abcd0001").write_bytes(b"held open")

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", cut_short)
    save_checkpoint(out, *load_checkpoint(out))  # removes `first`, cut short
    trash = out / (".trash-" + first.name[-8:])
    assert not first.exists() and trash.is_dir()
    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", real_rmtree)
    save_checkpoint(out, *load_checkpoint(out))
    assert not trash.exists()
    assert len([entry for entry in out.iterdir() if entry.name.startswith("step-")]) == 2


def test_a_reader_whose_checkpoint_a_save_removed_reads_the_next(trained, tmp_path, monkeypatch):
    """A save keeps the checkpoint before it, and a reader that lost its folder all the same
    (two saves while it read) reads the one LATEST names now: generate during training
    failed about one time in ten, saying the checkpoint was damaged."""
    out = _copy(trained, tmp_path / "out")
    first = checkpoint_module.checkpoint_dir(out)
    save_checkpoint(out, *load_checkpoint(out))
    assert first.is_dir()  # kept until the next save
    read = CharTokenizer.load.__func__
    saves = []

    def two_saves_while_reading(cls, path: Path) -> CharTokenizer:
        if not saves:
            saves.append(path)
            checkpoint = load_checkpoint(out)
            save_checkpoint(out, *checkpoint)
            save_checkpoint(out, *checkpoint)
        return read(cls, path)

    monkeypatch.setattr(CharTokenizer, "load", classmethod(two_saves_while_reading))
    reading = checkpoint_module.checkpoint_dir(out)
    model = load_model(out)
    assert not reading.exists() and model.tokenizer is not None


def test_sizes_changed_in_config_json_are_one_line_before_any_allocation(trained, corpus, tmp_path):
    """n_embd 2,000,000 in config.json (16 TB of weights): generate gave torch's allocator
    error with a traceback, and a resume blamed --batch-size; both name config.json now,
    before allocating anything."""
    out = _copy(
        trained,
        tmp_path / "out",
        lambda data: data["model"].update(n_embd=2_000_000),
        "config.json",
    )
    with pytest.raises(
        SelfAttnError, match=re.escape("is unreadable: config.json: its sizes make")
    ):
        load_model(out)
    line = _error_line(["train", "--data", str(corpus), "--out", str(out), "--resume"])
    assert "config.json: its sizes make" in line and "--batch-size" not in line, line


def test_more_layers_in_config_json_than_the_weights_hold_is_one_line_at_once(trained, tmp_path):
    """n_layer 100,000: the size check built every layer (on the meta device, no memory but
    minutes); the layers are now counted against model.safetensors' first."""
    out = _copy(
        trained, tmp_path / "out", lambda data: data["model"].update(n_layer=100_000),
        "config.json",
    )  # fmt: skip
    with pytest.raises(
        SelfAttnError, match=re.escape("config.json: its sizes make 100,000 layers, and model")
    ):
        load_model(out)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"layer_norm_eps": -1}, "GPTConfig.layer_norm_eps must be a positive number, got -1"),
        ({"layer_norm_eps": 0}, "GPTConfig.layer_norm_eps must be a positive number, got 0"),
    ],
    ids=["negative", "zero"],
)
def test_a_norm_epsilon_changed_in_config_json_is_one_line(trained, tmp_path, change, said):
    """layer_norm_eps -1 loaded, and generate died in torch's sampler (NaN probabilities)."""
    out = _copy(trained, tmp_path / "out", lambda data: data["model"].update(change), "config.json")
    with pytest.raises(SelfAttnError, match=re.escape(f"is unreadable: config.json: {said}")):
        load_model(out)


def test_a_lone_surrogate_in_the_vocabulary_is_one_line(trained, tmp_path):
    out = _copy(
        trained, tmp_path / "out", lambda data: data.update(chars=data["chars"] + "\ud800"),
        "tokenizer.json",
    )  # fmt: skip
    with pytest.raises(
        SelfAttnError, match=re.escape("tokenizer.json: the vocabulary holds a lone")
    ):
        load_model(out)


def _no_moments_of_parameter_zero(tensors: dict) -> dict:
    return {key: value for key, value in tensors.items() if not key.startswith("0.")}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            lambda tensors: {**tensors, "0.exp_avg_sq": tensors["0.exp_avg_sq"] * float("nan")},
            "0.exp_avg_sq holds values that are not finite",
        ),
        (
            lambda tensors: {**tensors, "1.exp_avg_sq": -tensors["1.exp_avg_sq"] - 1},
            "exp_avg_sq of parameter 1 is negative",
        ),
        (_no_moments_of_parameter_zero, "no step of parameter 0"),
    ],
)
def test_a_changed_optimizer_state_is_refused_as_damaged(trained, tmp_path, change, problem):
    """A NaN or negative squared-gradient mean resumed into "training diverged: ... resume it
    with a lower --lr" (which reloads it), a parameter without moments restarted them silently."""
    out = _copy(trained, tmp_path / "out", change, "optimizer.safetensors")
    with pytest.raises(SelfAttnError, match=re.escape(f"optimizer.safetensors: {problem}")):
        load_checkpoint(out)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda tensors: {"foo": torch.zeros(1)}, "its generator states are of foo"),
        (
            lambda tensors: {key.replace("rank0", "rank1"): v for key, v in tensors.items()},
            "its generator states are of rank1, not of rank0 onwards",
        ),
    ],
)
def test_generator_states_of_no_rank_zero_are_refused(trained, corpus, tmp_path, change, problem):
    """rng.safetensors without rank0's states resumed with fresh generators, unsaid."""
    out = _copy(trained, tmp_path / "out", change, "rng.safetensors")
    with pytest.raises(SelfAttnError, match=re.escape(f"rng.safetensors: {problem}")):
        train_decoder(corpus, out, overrides={"max_iters": 6}, resume=True)


def test_bad_betas_in_state_json_name_state_json(trained, tmp_path):
    """It said "optimizer.safetensors: 'int' object is not iterable"."""

    def betas_five(data: dict) -> None:
        data["optimizer_param_groups"][0]["betas"] = 5

    out = _copy(trained, tmp_path / "out", betas_five, "state.json")
    with pytest.raises(
        SelfAttnError, match=re.escape("state.json: the optimizer parameter groups")
    ):
        load_checkpoint(out)


def _interrupt_import(monkeypatch, name: str) -> None:
    """Ctrl-C while ``name`` is imported."""
    real_import = builtins.__import__

    def interrupted(module: str, *args, **kwargs):
        if module == name:
            raise KeyboardInterrupt
        return real_import(module, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)


def test_ctrl_c_while_train_imports_torch_is_one_line(corpus, tmp_path, monkeypatch):
    _interrupt_import(monkeypatch, "selfattn.train")
    args = ["train", "--data", str(corpus), "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130 and "Traceback" not in result.output, result.output
    assert result.output == "Interrupted before training started; nothing saved.\n"


def test_a_repeated_sigterm_after_the_stop_cannot_cut_the_last_line(corpus, tmp_path, monkeypatch):
    """SIGTERM stops the run at step 2; another, sent after train() returned, used to meet the
    handler train() had put back (the default one: the process died without its line)."""
    real_train, real_stop_requested = run_module.train, loop_module._stop_requested

    def sigterm_at_step_two(stop, step, *rest) -> bool:
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_stop_requested(stop, step, *rest)

    def stopped_then_signalled_again(*args, **kwargs):
        result = real_train(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(loop_module, "_stop_requested", sigterm_at_step_two)

    def terminated(*_) -> None:  # stands for the default handler, which would end pytest
        raise RuntimeError("terminated before the last line")

    monkeypatch.setattr(run_module, "train", stopped_then_signalled_again)
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        args = ["train", "--data", str(corpus), "--out", str(tmp_path / "out"), "--preset"]
        result = CliRunner().invoke(app, [*args, "tiny", "--max-iters", "10"])
        assert signal.getsignal(signal.SIGTERM) is terminated  # back once the line is out
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code == 143, result.output
    assert f"Interrupted at step 2: checkpoint saved in {tmp_path / 'out'}" in result.output


def test_an_out_with_another_programs_config_json_says_so(corpus, tmp_path):
    """A new run said "pass --resume to continue it", and --resume "pass it with --model"."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "gpt2"}')
    args = ["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny"]
    for extra in ([], ["--resume"]):
        line = _error_line([*args, *extra])
        assert line == (
            f"Error: --out {out} holds a config.json that is not a selfattn checkpoint (another "
            "program's model folder?); choose another --out"
        )


def test_a_resume_with_nothing_to_do_notes_no_other_data_file(trained, corpus, tmp_path):
    """Nothing trained, nothing recorded: the note that the other file is recorded from now
    on was false."""
    out = _copy(trained, tmp_path / "out")
    other = tmp_path / "other.txt"
    shutil.copy(corpus, other)
    args = ["train", "--data", str(other), "--out", str(out), "--resume", "--max-iters", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and result.stdout.startswith("Nothing to do"), result.output
    assert result.stderr == ""


def test_a_preset_given_on_resume_names_the_settings_it_replaces(trained, corpus, tmp_path):
    """--preset tiny when resuming a run saved with --eval-interval 2: the run went back to
    tiny's 25 without a word (flags set by this run are not listed); without --preset, no
    note."""
    out = _copy(trained, tmp_path / "out")
    args = ["train", "--data", str(corpus), "--out", str(out), "--resume", "--max-iters"]
    result = CliRunner().invoke(app, [*args, "6", "--preset", "tiny"])
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "note: --preset tiny replaces the checkpoint's training settings: --eval-interval 2 -> "
        "25; resume without --preset to keep them\n"
    )
    result = CliRunner().invoke(app, [*args, "8"])
    assert result.exit_code == 0 and result.stderr == "", result.output


def test_a_resume_evaluates_on_the_batches_a_straight_run_does(corpus, tmp_path):
    """20 steps + resume to 40 == 40 straight steps, validation losses included: the first
    run's evaluation at its end drew validation batches that a straight run does not, and
    moved the resumed run's onto other ones (its step-40 loss differed)."""
    straight = train_decoder(corpus, tmp_path / "a", preset="tiny", overrides={"max_iters": 40})
    train_decoder(corpus, tmp_path / "b", preset="tiny", overrides={"max_iters": 20})
    resumed = train_decoder(corpus, tmp_path / "b", overrides={"max_iters": 40}, resume=True)
    assert resumed.result.history[-1] == straight.result.history[-1]


def test_step_folders_without_latest_are_never_removed_by_a_new_run(trained, corpus, tmp_path):
    """With LATEST deleted (or step folders copied in to fork a run), a new run trained from
    scratch and its first save removed every step folder; --resume said "drop --resume". Now
    a new run is refused, and --resume and generate name the folder to write into LATEST."""
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    steps = sorted(entry.name for entry in out.iterdir() if entry.name.startswith("step-"))
    (out / "LATEST").unlink()
    args = ["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny"]
    assert "already holds a checkpoint; pass --resume" in _error_line([*args, "--max-iters", "2"])
    fix = (
        f"holds step folders but no LATEST file naming one; write the name of an existing step "
        f"folder (e.g. {steps[-1]}) into LATEST"
    )
    assert fix in _error_line([*args, "--resume"])
    assert fix in _error_line(["generate", "--checkpoint", str(out), "To"])
    left = sorted(entry.name for entry in out.iterdir() if entry.name != ".lock")
    assert left == steps  # nothing written or removed


def test_a_latest_that_is_a_folder_is_refused_before_any_training(trained, corpus, tmp_path):
    # A new run trained a whole evaluation interval, then could not save ("Is a directory")
    out = tmp_path / "out"
    out.mkdir()
    (out / "LATEST").mkdir()
    line = _error_line(["train", "--data", str(corpus), "--out", str(out), "--preset", "tiny"])
    assert "already holds a checkpoint" in line
    assert [entry.name for entry in out.iterdir() if entry.name != ".lock"] == ["LATEST"]


def test_a_data_path_that_is_no_str_in_config_json_is_one_line(trained, corpus, tmp_path):
    # {"data": 5}: a TypeError from Path(5) when the resume compared data files
    out = _copy(trained, tmp_path / "out", lambda data: data.update(data=5), "config.json")
    line = _error_line(["train", "--data", str(corpus), "--out", str(out), "--resume"])
    assert "config.json: data is 5, not a name (a str)" in line
