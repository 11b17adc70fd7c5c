"""Train a character-level GPT or Llama on a text file: what ``selfattn train`` runs, on one
process or many.

This is where the pieces meet: presets and overrides, the data, the model, the optimizer, the
checkpoints (with an exact resume) and torch.distributed. The loop itself stays model-agnostic.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from torch import Tensor

from selfattn.errors import SelfAttnError
from selfattn.models.llama import Llama
from selfattn.train import distributed, lock
from selfattn.train.checkpoint import (
    LATEST,
    Network,
    RunConfig,
    TrainingState,
    build_network,
    checkpoint_dir,
    damaged,
    has_checkpoint,
    is_checkpoint_folder,
    load_checkpoint,
    one_line,
    save_checkpoint,
)
from selfattn.train.data import CharTokenizer, RandomBatches, TextData, read_text
from selfattn.train.loop import (
    TrainConfig,
    TrainResult,
    configure_optimizer,
    flag,
    has_work,
    setting,
    train,
)
from selfattn.train.presets import (
    DEFAULT_PRESET,
    DecoderConfig,
    Preset,
    get_preset,
)


@dataclass
class TrainedRun:
    """The trained model (on its device, eval mode), its tokenizer and configs, and the result."""

    model: Network
    tokenizer: CharTokenizer
    config: RunConfig
    result: TrainResult


def train_decoder(
    data: str | Path,
    out: str | Path,
    *,
    preset: str | None = None,
    overrides: Mapping[str, object] | None = None,
    resume: bool = False,
    device: str = "auto",
    console: Console | None = None,
) -> TrainedRun:
    """Train (or with ``resume``, continue) a decoder on ``data``, writing checkpoints to ``out``.

    The settings are the preset's (default ``shakespeare-char-cpu``; when resuming, the
    checkpoint's) with ``overrides`` applied (model fields and :class:`TrainConfig` fields),
    except that a resumed run keeps the checkpoint's seed: its generator states continue.
    ``overrides={"arch": "llama"}`` trains a Llama instead of a GPT (``"n_kv_head"`` sets its
    key/value heads); resuming keeps the checkpoint's architecture and refuses another.
    Under torchrun each rank trains on its own batches; rank 0 writes and prints. ``out`` is
    locked while the run lasts: a second run into it is refused. The caller's torch random
    state is as it was afterwards: the run seeds a fork of it; a process group the caller
    set up is used and left in place.
    """
    context = distributed.setup(device)
    try:
        with ExitStack() as locks:
            locks.enter_context(_own_global_state(context.device))
            return _train_decoder(
                context,
                Path(data),
                Path(out),
                preset,
                overrides or {},
                resume,
                console if context.is_main else None,
                locks,
            )
    except RuntimeError as error:
        if context.world_size > 1 and _lost_a_process(error):
            reason = str(error).strip().splitlines()[0]
            raise SelfAttnError(
                f"this {context.world_size}-process run lost another process ({reason}); the "
                f"checkpoints in {out} are kept: run every process again with --resume"
            ) from None
        if not _out_of_memory(error):
            raise
        raise SelfAttnError(
            f"out of memory on {context.device}: use a smaller --batch-size or --block-size "
            "(or a smaller model: --n-layer, --n-embd)"
        ) from None
    finally:
        if context.joined:  # a group the caller set up is the caller's to leave
            distributed.teardown()


@contextmanager
def _own_global_state(device: torch.device) -> Iterator[None]:
    """The caller's torch random state and float32 matmul precision, put back after the run:
    training seeds the one (and restores a checkpoint's states into it) and sets the other
    on CUDA, which a notebook's own code after the run should not inherit."""
    precision = torch.get_float32_matmul_precision()
    devices = [torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)


def _lost_a_process(error: RuntimeError) -> bool:
    """Whether a collective failed as another process went away (killed, or crashed): gloo
    reads "Connection reset by peer", NCCL reports its own error."""
    return isinstance(error, dist.DistError) or any(name in str(error) for name in ("gloo", "NCCL"))


def _out_of_memory(error: RuntimeError) -> bool:
    """Whether torch ran out of memory: CUDA's OutOfMemoryError, or the CPU allocator's error."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


def _train_decoder(
    context: distributed.Context,
    data_path: Path,
    out: Path,
    preset_name: str | None,
    overrides: Mapping[str, object],
    resume: bool,
    console: Console | None,
    locks: ExitStack,
) -> TrainedRun:
    """The run, with ``out`` locked (held by ``locks``) before its checkpoint is looked at."""
    checkpoint = None
    _refuse_a_step_folder(out)
    _refuse_a_foreign_folder(out)
    if resume:
        if out.is_dir():  # locked first: a run still before its first save holds no checkpoint
            locks.enter_context(_one_run_in(out, context))
        if not has_checkpoint(out):
            raise SelfAttnError(
                f"nothing to resume: {out} holds no checkpoint; drop --resume to start a new run"
            )
        checkpoint = load_checkpoint(out, context.device)

    if checkpoint is not None:
        _, tokenizer, saved, _ = checkpoint
        overrides = _keep_saved_seed(overrides, saved.train.seed, console)
        base = Preset.from_configs(saved.preset, saved.model, saved.train)
        chosen = get_preset(preset_name) if preset_name else base
        _check_same_arch(out, base.arch, overrides.get("arch", chosen.arch))
        preset = chosen.override(**overrides)
        if preset_name:
            _note_preset_settings(preset_name, base.train, preset.train, overrides, console)
        data = _resumed_data(data_path, preset.train.block_size, tokenizer, saved.data)
    else:
        preset = get_preset(preset_name or DEFAULT_PRESET).override(**overrides)
        data = TextData.from_file(data_path, preset.train.block_size)
    config = RunConfig(
        preset.model_config(data.tokenizer.vocab_size), preset.train, preset.name, str(data_path)
    )
    settings = config.train
    _check_activations_fit(preset, data.tokenizer.vocab_size, context.device)
    if checkpoint is None:  # settings checked: now the folder, locked, then what it holds
        _make_out_dir(out)
        locks.enter_context(_one_run_in(out, context))
        if has_checkpoint(out):
            raise SelfAttnError(
                f"{out} already holds a checkpoint; pass --resume to continue it, "
                "or choose another --out"
            )

    if context.device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(settings.seed)  # the same initial weights on every rank
    if checkpoint is not None:
        model, _, saved, state = checkpoint
        _check_same_model(out, saved.model, config.model)
        model.train()
    else:
        model = new_network(config.model).to(context.device)
        state = None
    torch.manual_seed(settings.seed + context.rank)  # distinct dropout per rank
    batches = RandomBatches(
        data, settings.batch_size, settings.block_size, settings.seed, context.rank
    )
    optimizer = configure_optimizer(model, settings)
    if state is not None:
        _load_optimizer_state(optimizer, state.optimizer, out)
        _restore_rng(state.rng, context, batches, console, out)
        if has_work(state.step, state.history, settings):  # it trains and saves: the note holds
            _note_another_file(data_path, saved.data, console)

    def save(
        step: int, history: list[dict[str, float]], losses_since_eval: list[float] | None
    ) -> None:
        states = distributed.gather(_rng_state(batches, context))
        failure: SelfAttnError | None = None
        if context.is_main:
            rng = {
                f"rank{r}.{k}": v for r, per_rank in enumerate(states) for k, v in per_rank.items()
            }
            state = TrainingState(step, history, optimizer.state_dict(), rng, losses_since_eval)
            try:
                save_checkpoint(out, model, data.tokenizer, config, state)
            except OSError as error:
                failure = _cannot_save(out, step, error)
        # every rank stops with rank 0 (the others would wait for it at the next collective)
        if distributed.any_across_ranks(failure is not None, context.device):
            raise failure or SelfAttnError(f"rank 0 could not write the checkpoint of step {step}")

    result = train(
        distributed.wrap(model, context),
        optimizer,
        batches,
        settings,
        start_step=state.step if state else 0,
        history=state.history if state else None,
        losses_since_eval=state.losses_since_eval if state else None,
        save=save,
        console=console,
    )
    return TrainedRun(model.eval(), data.tokenizer, config, result)


def new_network(config: DecoderConfig) -> Network:
    """A network to train from scratch, drawn (from torch's generator) with GPT-2's
    initialisation: GPT draws it on construction, a Llama by its ``reset_parameters``."""
    network = build_network(config)
    if isinstance(network, Llama):
        network.reset_parameters()
    return network


# float32 values a training step keeps for backward per token and layer, in units of n_embd:
# half of the 16 a GPT block keeps at the least (its norms' inputs and outputs, q, k, v, the
# attention's output, the MLP's 4 × n_embd before and after its activation); the presets keep
# 17-31 (GPT, dropout's masks included) and 22-36 (Llama)
KEPT_PER_LAYER = 8


def _check_activations_fit(preset: Preset, vocab_size: int, device: torch.device) -> None:
    """Refuse, before any batch is allocated (and, on a fresh run, any weight), a batch (or
    block) whose activations could not fit in the device's memory even at a lower bound of
    their size: ``KEPT_PER_LAYER`` × n_embd floats per layer, and the logits twice (softmax's
    output, their gradient), per token. Memory is the GPU's, or this machine's RAM (all of
    it, used or not); nothing is refused where the system does not say how much there is."""
    memory = _memory_bytes(device)
    if memory is None:
        return
    per_token = 4 * (KEPT_PER_LAYER * preset.n_layer * preset.n_embd + 2 * vocab_size)
    fitting = memory // per_token  # the most tokens a training step could hold
    batch, block = preset.train.batch_size, preset.train.block_size
    if batch * block <= fitting:
        return
    if block <= fitting:
        too_large, sequences, need = setting("batch_size", batch), f"{batch:,} sequences", batch
        fix = f"use a smaller --batch-size (none above {fitting // block} can fit) or --block-size"
    else:
        too_large, sequences, need = setting("block_size", block), "even one sequence", 1
        fix = (
            f"use a smaller --block-size (no more than {fitting:,} tokens can fit, over the "
            "whole batch) or model (--n-layer, --n-embd)"
        )
    where = "this machine's memory" if device.type == "cpu" else f"the memory of {device}"
    raise SelfAttnError(
        f"{too_large} cannot fit: a training step on {sequences} of {block:,} tokens keeps at "
        f"least {_gib(need * block * per_token)} of activations, and {where} is "
        f"{_gib(memory)}; {fix}"
    )


def _memory_bytes(device: torch.device) -> int | None:
    """The memory of a GPU, or this machine's RAM (None where the system does not say)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None


def _gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB"


def _resumed_data(
    path: Path, block_size: int, tokenizer: CharTokenizer, trained_on: str
) -> TextData:
    """The text of a resumed run in the checkpoint's vocabulary, or why it does not fit (the
    checkpoint was trained on ``trained_on``)."""
    text = read_text(path)
    unknown = tokenizer.unknown_characters(text)
    if unknown:
        raise SelfAttnError(
            f"{path} has characters that the checkpoint's vocabulary lacks ({unknown}); "
            f"resume with the text it was trained on ({trained_on})"
        )
    return TextData.from_text(text, block_size, tokenizer, source=path)


def _note_another_file(path: Path, trained_on: str, console: Console | None) -> None:
    """A note if a resumed run trains on another file than the checkpoint's (``trained_on``)."""
    if not _same_file(path, Path(trained_on)):
        _note(
            console,
            f"--data {path} is not the file the checkpoint was trained on ({trained_on}); its "
            "characters fit the vocabulary, so training goes on with it, and the checkpoint "
            "records it from now on",
        )


def _same_file(path: Path, other: Path) -> bool:
    """Whether two paths name one file (a link, another spelling of the path); True where
    ``other`` cannot be found (moved, or relative to the folder the run started in): the note
    is for a file that is known to be another."""
    try:
        return path.samefile(other)
    except OSError:
        return True


def _note_preset_settings(
    name: str,
    saved: TrainConfig,
    resumed: TrainConfig,
    overrides: Mapping[str, object],
    console: Console | None,
) -> None:
    """A note naming the checkpoint's training settings that ``--preset name`` replaces (those
    no flag of this run set): a resume otherwise continues with the checkpoint's own."""
    replaced = [
        f"{flag(field.name)} {getattr(saved, field.name)} -> {getattr(resumed, field.name)}"
        for field in dataclasses.fields(saved)
        if field.name not in overrides
        and getattr(saved, field.name) != getattr(resumed, field.name)
    ]
    if replaced:
        _note(
            console,
            f"--preset {name} replaces the checkpoint's training settings: "
            f"{', '.join(replaced)}; resume without --preset to keep them",
        )


def _keep_saved_seed(
    overrides: Mapping[str, object], saved_seed: int, console: Console | None
) -> dict[str, object]:
    """``overrides`` with the checkpoint's seed, the one a resumed run's random numbers come
    from (its saved generator states; fresh ones, for ranks it has none for, seeded from it),
    so that the recorded config names no seed that was not used; a note if another was given."""
    seed = overrides.get("seed", saved_seed)
    if seed != saved_seed:
        _note(
            console,
            f"--seed {seed} is ignored: a resumed run continues the checkpoint's random "
            f"generators (seed {saved_seed}); train into a new --out for another seed",
        )
    return {**overrides, "seed": saved_seed}


def _note(console: Console | None, message: str) -> None:
    """One line on stderr, where the CLI's notes go; nothing without a console (no output)."""
    if console is not None:
        print(f"note: {message}", file=sys.stderr)


def _refuse_a_step_folder(out: Path) -> None:
    """--out naming one checkpoint folder (config.json, no LATEST) would nest the next
    checkpoints inside it, where the next save into its parent deletes them."""
    if (out / LATEST).is_file() or not is_checkpoint_folder(out):
        return
    parent = out.resolve().parent
    where = (
        f"pass the folder that holds it, {parent}, as --out"
        if (parent / LATEST).is_file()
        else f"put it in a folder of its own with a {LATEST} file naming it, and pass that"
    )
    raise SelfAttnError(f"--out {out} is one checkpoint folder, not a training folder; {where}")


def _refuse_a_foreign_folder(out: Path) -> None:
    """--out holding another program's config.json (a Hugging Face model folder) is neither a
    checkpoint to resume nor a folder to start one in."""
    if (out / LATEST).is_file() or not (out / "config.json").is_file():
        return
    if not is_checkpoint_folder(out):
        raise SelfAttnError(
            f"--out {out} holds a config.json that is not a selfattn checkpoint (another "
            "program's model folder?); choose another --out"
        )


@contextmanager
def _one_run_in(out: Path, context: distributed.Context) -> Iterator[None]:
    """Hold the lock on ``out`` while the block runs: rank 0 takes it, and every rank stops
    (with rank 0's line) when another run holds it."""
    with ExitStack() as held:
        refused: SelfAttnError | None = None
        if context.is_main:
            try:
                held.enter_context(lock.hold(out))
            except SelfAttnError as error:
                refused = error
        if distributed.any_across_ranks(refused is not None, context.device):
            raise refused or SelfAttnError(f"--out {out} is in use by another run")
        yield


def _make_out_dir(out: Path) -> None:
    """Create the --out folder before any training, or say in one line why it cannot be."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise SelfAttnError(f"--out {out} is a file; give a folder for the checkpoints") from None
    except OSError as error:
        raise SelfAttnError(
            f"cannot create the --out folder {out}: {error.strerror or error}; choose another"
        ) from None


def _cannot_save(out: Path, step: int, error: OSError) -> SelfAttnError:
    """The one line for a checkpoint that could not be written, saying what is left."""
    kept = "the previous checkpoint is kept" if has_checkpoint(out) else "nothing was saved"
    return SelfAttnError(
        f"cannot write the checkpoint of step {step} in {out}: {error.strerror or error}; {kept}"
    )


def _load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict, out: Path) -> None:
    """Restore AdamW's moments; refuse ones that do not fit the parameters (torch's fused
    kernel crashes on them). The hyper-parameters stay this run's (``load_state_dict`` would
    bring back the saved ones: a --weight-decay given on resume did nothing)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    settings = [
        {key: value for key, value in group.items() if key != "params"}
        for group in optimizer.param_groups
    ]
    try:
        for index, tensors in saved["state"].items():
            for name, value in tensors.items():
                if name != "step" and value.shape != params[index].shape:
                    raise ValueError(f"{name} of parameter {index} has shape {list(value.shape)}")
        optimizer.load_state_dict(saved)
        for group, kept in zip(optimizer.param_groups, settings, strict=True):
            group.update(kept)
    except (IndexError, KeyError, ValueError) as error:
        raise SelfAttnError(
            f"the optimizer state in the checkpoint of {out} does not fit the model ({error}); "
            "its optimizer.safetensors or state.json was changed: train again into another --out"
        ) from None


def _check_same_arch(out: Path, saved: str, wanted: object) -> None:
    """Refuse to resume a checkpoint of one architecture as another, before any setting of
    the other is checked."""
    if wanted != saved:
        raise SelfAttnError(
            f"the checkpoint in {out} is a {saved} model and this run a {wanted} one (--arch, "
            f"arch= in Python); resume with --arch {saved} or train into a new --out"
        )


def _check_same_model(out: Path, saved: DecoderConfig, wanted: DecoderConfig) -> None:
    """Refuse to resume a checkpoint into a model of another shape (of the same
    architecture, which ``_check_same_arch`` made sure of), naming what differs."""
    if saved == wanted:
        return
    diffs: dict[str, str] = {}  # by setting: a Llama's three biases are one
    derived: list[str] = []  # sizes no setting names: said only when no setting differs
    for field in dataclasses.fields(saved):
        was, now = getattr(saved, field.name), getattr(wanted, field.name)
        name = LLAMA_SETTINGS.get(field.name, field.name)
        if was != now and name:
            diffs.setdefault(name, f"{_flag(name)} {was} vs {now}")
        elif was != now:
            derived.append(f"{field.name} {was} vs {now}")
    raise SelfAttnError(
        f"the checkpoint in {out} is from another configuration "
        f"({', '.join([*diffs.values()] or derived)}: "
        "checkpoint vs this run); resume with its settings or train into a new --out"
    )


# LlamaConfig's fields as the settings that make them ("": derived, from n_embd and n_head)
LLAMA_SETTINGS = {
    "max_positions": "block_size",
    "d_model": "n_embd",
    "n_layers": "n_layer",
    "n_heads": "n_head",
    "n_kv_heads": "n_kv_head",
    "head_dim": "",
    "d_ff": "",
    "qkv_bias": "bias",
    "out_bias": "bias",
    "mlp_bias": "bias",
}


# the model's settings that `selfattn train` has a flag for (bias and activation: Python only)
MODEL_FLAGS = ("block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "dropout")


def _flag(name: str) -> str:
    """A model setting as its `selfattn train` flag, where it has one."""
    return flag(name) if name in MODEL_FLAGS else name


def _rng_state(batches: RandomBatches, context: distributed.Context) -> dict[str, Tensor]:
    """This rank's generator states: batch streams, torch's CPU generator, its CUDA one."""
    state = {f"batches.{split}": value for split, value in batches.state_dict().items()}
    state["torch"] = torch.get_rng_state()
    if context.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(context.device)
    return state


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


def _rank_streams(saved: int, running: int) -> str:
    """What happens to the batch streams when a checkpoint is resumed on another count of
    processes: ranks beyond the saved ones start fresh, the saved ones beyond this run end."""
    if running > saved:
        if running == saved + 1:
            return f"rank {saved} draws batches from a fresh seed, the others continue theirs"
        return f"ranks {saved}-{running - 1} draw batches from fresh seeds, the others go on"
    if saved == running + 1:
        return f"rank {running}'s batch stream ends (the global batch is smaller)"
    return f"the batch streams of ranks {running}-{saved - 1} end (the global batch is smaller)"


def _restore_rng(
    rng: dict[str, Tensor],
    context: distributed.Context,
    batches: RandomBatches,
    console: Console | None,
    out: Path,
) -> None:
    """Put this rank's saved generator states back; one line naming rng.safetensors if its
    entries are missing or are not generator states (the file was changed)."""
    saved = _saved_ranks(rng, out)
    if saved != context.world_size:
        _note(
            console,
            f"the checkpoint was written by {_processes(saved)}, this run has "
            f"{context.world_size}; {_rank_streams(saved, context.world_size)}",
        )
    prefix = f"rank{context.rank}."
    mine = {key.removeprefix(prefix): value for key, value in rng.items() if key.startswith(prefix)}
    if not mine:  # a rank beyond the saved ones: its fresh generators stay
        return
    missing = [name for name in ("batches.train", "batches.val", "torch") if name not in mine]
    try:
        if missing:
            raise KeyError(prefix + missing[0])
        batches.load_state_dict(
            {
                key.removeprefix("batches."): value
                for key, value in mine.items()
                if "batches." in key
            }
        )
        torch.set_rng_state(mine["torch"])
        if "cuda" in mine and context.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"], context.device)
    except (KeyError, TypeError, RuntimeError) as error:
        raise damaged(checkpoint_dir(out), "rng.safetensors", one_line(error)) from None


def _saved_ranks(rng: dict[str, Tensor], out: Path) -> int:
    """How many processes wrote ``rng``; one line naming rng.safetensors unless its entries
    are those of rank0 onwards (a resume would otherwise start fresh generators unsaid)."""
    saved = {key.split(".", 1)[0] for key in rng}
    if saved and saved == {f"rank{rank}" for rank in range(len(saved))}:
        return len(saved)
    problem = (
        f"its generator states are of {', '.join(sorted(saved))}, not of rank0 onwards"
        if saved
        else "it holds no generator states"
    )
    raise damaged(checkpoint_dir(out), "rng.safetensors", problem)
