"""Training checkpoints: safetensors and JSON in a directory, written atomically.

Layout of ``OUT/`` (what ``selfattn train --out OUT`` writes)::

    OUT/LATEST                   name of the current checkpoint directory, replaced atomically
    OUT/.lock                    locked by the run writing OUT (see ``lock``), not a checkpoint
    OUT/step-0002000-<id>/
        model.safetensors        weights (GPT's tied embedding / head saved once)
        config.json              model type (gpt or llama) and config, training config,
                                 preset name, data file
        tokenizer.json           the character vocabulary
        optimizer.safetensors    AdamW's per-parameter tensors (moments, step counts)
        rng.safetensors          generator states per rank, for an exact resume
        state.json               step, evaluation history, training losses since the last
                                 evaluation, optimizer hyper-parameters

A checkpoint is written into a temporary directory, synced, renamed into place, and only then
does ``LATEST`` point at it (``os.replace``); an interruption at any moment leaves the previous
checkpoint current and intact. The checkpoint before the new one stays too, until the next save,
so that a reader which found it through ``LATEST`` a moment earlier can finish; a reader that
still lost its folder reads the new one. Only folders named as a save names them and holding
our files are ever removed. Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file, save_model
from torch import Tensor, nn

from selfattn.errors import SelfAttnError, is_integer, is_real
from selfattn.models.gpt import GPT, GPTConfig
from selfattn.models.llama import Llama, LlamaConfig
from selfattn.models.loading import checked_device
from selfattn.models.model import Model, ModelConfig, set_backend
from selfattn.text import Tokenizer
from selfattn.train.data import CharTokenizer
from selfattn.train.loop import TrainConfig
from selfattn.train.presets import DecoderConfig, architecture

FORMAT = "selfattn-train-checkpoint"
LATEST = "LATEST"
# How safetensors names the errno of a failed write: "(os error 28)", or before 0.4.2 or so
# the Rust debug form "Os { code: 28, ... }".
OS_ERROR = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")
FILES = (
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "optimizer.safetensors",
    "rng.safetensors",
    "state.json",
)
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"  # a stale folder is renamed so before it is removed
# what save_checkpoint names its folders: mkdtemp's 8 characters after the prefix or the step
OURS = re.compile(
    rf"(?:{re.escape(TMP_PREFIX)}|{re.escape(TRASH_PREFIX)}|step-\d{{7,}}-)[a-z0-9_]{{8}}"
)
BLOCK = re.compile(r"blocks\.(\d+)\.")  # a transformer block's weights, GPT's and Llama's
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")  # what AdamW keeps per parameter
T = TypeVar("T")  # what a checkpoint file reads as
Network = GPT | Llama


@dataclass(frozen=True)
class RunConfig:
    """What a checkpoint was trained as: model, training settings, preset name, data file."""

    model: DecoderConfig
    train: TrainConfig
    preset: str
    data: str

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "model_type": architecture(self.model),
            "model": dataclasses.asdict(self.model),
            "train": dataclasses.asdict(self.train),
            "preset": self.preset,
            "data": self.data,
        }

    @classmethod
    def from_json(cls, data: dict) -> RunConfig:
        """The configs of ``config.json``; a ``model_type`` other than gpt and llama is a
        ValueError (the file was changed)."""
        model_type, model = data["model_type"], data["model"]
        if model_type == "gpt":
            config: DecoderConfig = GPTConfig(**model)
        elif model_type == "llama":  # JSON's lists back to the tuples a config holds
            config = LlamaConfig(**{**model, "sliding_windows": tuple(model["sliding_windows"])})
        else:
            raise ValueError(f"model_type {model_type!r} is neither 'gpt' nor 'llama'")
        for name in ("preset", "data"):
            if not isinstance(data[name], str):
                raise ValueError(f"{name} is {data[name]!r}, not a name (a str)")
        return cls(config, TrainConfig(**data["train"]), data["preset"], data["data"])


@dataclass
class TrainingState:
    """Everything besides the weights that an exact resume needs."""

    step: int
    history: list[dict[str, float]]
    optimizer: dict  # an optimizer state_dict
    rng: dict[str, Tensor]  # "rank{r}.{name}" -> generator state (uint8)
    losses_since_eval: list[float] | None = None  # training, since history[-1]; None: unknown


def save_checkpoint(
    out_dir: Path,
    model: nn.Module,
    tokenizer: CharTokenizer,
    config: RunConfig,
    state: TrainingState,
) -> Path:
    """Write a checkpoint under ``out_dir`` atomically and make it the latest; return its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = _latest_name(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=out_dir))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0o700 would hide the checkpoint from other users
        _write_tensors(tmp / "model.safetensors", lambda file: save_model(model, file))
        _write_json(tmp / "config.json", config.to_json())
        tokenizer.save(tmp / "tokenizer.json")
        tensors, groups = _split_optimizer_state(state.optimizer)
        _write_tensors(tmp / "optimizer.safetensors", lambda file: save_file(tensors, file))
        rng = {key: value.contiguous() for key, value in state.rng.items()}
        _write_tensors(tmp / "rng.safetensors", lambda file: save_file(rng, file))
        _write_json(
            tmp / "state.json",
            {
                "step": state.step,
                "history": state.history,
                "losses_since_eval": state.losses_since_eval,
                "optimizer_param_groups": groups,
            },
        )
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors writes 0o600: readable like the JSON files
            _fsync(path)
        _fsync(tmp)  # its entries: the files' names are durable only once the folder is synced
        final = out_dir / f"step-{state.step:07d}-{tmp.name.removeprefix(TMP_PREFIX)}"
        os.replace(tmp, final)
        _fsync(out_dir)
        pointer = out_dir / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n", encoding="utf-8")
        _fsync(pointer)
        os.replace(pointer, out_dir / LATEST)
        _fsync(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_stale(out_dir, keep={final.name, previous})
    return final


def load_checkpoint(
    path: str | Path, device: torch.device | str = "cpu"
) -> tuple[Network, CharTokenizer, RunConfig, TrainingState]:
    """The model (eval mode), tokenizer, configs and training state of a checkpoint.

    ``path`` is a training output directory (its latest checkpoint is read) or one checkpoint
    directory. Raises :class:`SelfAttnError` with a one-line message naming the file if there is
    none or one is missing, damaged or does not fit the others, or for a device there is not.
    """
    device = checked_device(device)
    return _read_latest(path, lambda directory: _load_all(directory, device))


def _load_all(
    directory: Path, device: torch.device | str
) -> tuple[Network, CharTokenizer, RunConfig, TrainingState]:
    """What :func:`load_checkpoint` gives, of one checkpoint directory."""
    model, tokenizer, config = _load_trained(directory, device)
    step, history, losses_since_eval, groups = _read(directory, "state.json", _read_state)
    tensors = _read(
        directory, "optimizer.safetensors", lambda file: load_file(str(file), device=str(device))
    )
    _refuse_non_finite(directory, "optimizer.safetensors", tensors)
    optimizer = _read(
        directory, "optimizer.safetensors", lambda _: _join_optimizer_state(tensors, groups)
    )
    rng = _read(directory, "rng.safetensors", lambda file: load_file(str(file)))
    state = TrainingState(step, history, optimizer, rng, losses_since_eval)
    return model, tokenizer, config, state


def build_network(config: DecoderConfig) -> Network:
    """The network of ``config``: a GPT already holds GPT-2's initialisation, a Llama torch's
    default one (training gives it GPT-2's with ``reset_parameters``; loading overwrites it)."""
    return GPT(config) if isinstance(config, GPTConfig) else Llama(config)


def _load_trained(
    directory: Path, device: torch.device | str
) -> tuple[Network, CharTokenizer, RunConfig]:
    """What running the model needs: the network (eval mode), its tokenizer and configs,
    read from config.json, tokenizer.json and model.safetensors only."""
    saved_config = _read(directory, "config.json", _read_json)
    if saved_config.get("format") != FORMAT:
        fix = (
            "it is a Hugging Face model folder: pass it with --model (selfattn.load in Python)"
            if "model_type" in saved_config
            else "pass a folder that `selfattn train --out` wrote"
        )
        raise SelfAttnError(
            f"{directory} is not a `selfattn train` checkpoint (its config.json is not one of "
            f"ours); {fix}"
        )
    config = _read(directory, "config.json", lambda _: RunConfig.from_json(saved_config))
    tokenizer = _read(directory, "tokenizer.json", CharTokenizer.load)
    if tokenizer.vocab_size != config.model.vocab_size:
        raise damaged(
            directory,
            "tokenizer.json",
            f"{tokenizer.vocab_size} characters for a vocabulary of {config.model.vocab_size} "
            "in config.json",
        )
    _check_size(directory, config.model)
    model = build_network(config.model)
    _read(
        directory,
        "model.safetensors",
        lambda file: safetensors.torch.load_model(model, str(file)),
    )
    _refuse_non_finite(directory, "model.safetensors", model.state_dict())
    return model.to(device).eval(), tokenizer, config


def _check_size(directory: Path, config: DecoderConfig) -> None:
    """Refuse sizes in config.json that make a network larger than the weights that
    model.safetensors holds (read from its header) before allocating it: a changed size would
    otherwise fail in the allocator, or be blamed on the batch size."""
    held, blocks = _read(directory, "model.safetensors", _weights_held)
    layers = ModelConfig.for_decoder(config, architecture(config)).n_layers
    if layers > blocks:  # first, as the count below builds every layer (on no memory)
        raise damaged(
            directory,
            "config.json",
            f"its sizes make {layers:,} layers, and model.safetensors holds {blocks:,}",
        )
    wanted = _read(directory, "config.json", lambda _: _network_size(config))
    if wanted > held:
        raise damaged(
            directory,
            "config.json",
            f"its sizes make {wanted:,} weights, and model.safetensors holds {held:,}",
        )


def _network_size(config: DecoderConfig) -> int:
    """How many weights the network of ``config`` has, counted without allocating them (a
    RuntimeError for sizes past what torch can count)."""
    with torch.device("meta"):
        return sum(param.numel() for param in build_network(config).parameters())


def _weights_held(file: Path) -> tuple[int, int]:
    """How many numbers a safetensors file of a network holds, and how many blocks, from its
    header."""
    with safe_open(str(file), "pt") as saved:
        keys = saved.keys()  # (no iterator: safe_open has none)
        numbers = sum(math.prod(saved.get_slice(key).get_shape()) for key in keys)
    indices = [int(found.group(1)) for key in keys if (found := BLOCK.match(key))]
    return numbers, max(indices, default=-1) + 1


def _refuse_non_finite(directory: Path, name: str, tensors: dict[str, Tensor]) -> None:
    """Training never saves a weight that is not finite (it stops instead): one is a changed
    file, which would otherwise generate garbage or look like a diverging resume."""
    for key, value in tensors.items():
        if value.is_floating_point() and not bool(value.isfinite().all()):
            raise damaged(directory, name, f"{key} holds values that are not finite (NaN or inf)")


def _read(directory: Path, name: str, read: Callable[[Path], T]) -> T:
    """``read(directory / name)``, a one-line error naming the file if it is missing or damaged."""
    try:
        return read(directory / name)
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, SafetensorError) as error:
        raise damaged(directory, name, one_line(error)) from None


def damaged(directory: Path, name: str, problem: str) -> SelfAttnError:
    return SelfAttnError(
        f"checkpoint {directory} is unreadable: {name}: {problem}; it was changed or cut short "
        "after training wrote it: restore it, or train again into another --out"
    )


def one_line(error: Exception) -> str:
    """An exception as one line: a missing key by name, a list of problems by its first."""
    if isinstance(error, KeyError):
        return f"no {error.args[0]!r} entry"
    if isinstance(error, FileNotFoundError):
        return "the file is missing"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if len(lines) > 2 and lines[0].endswith(":"):  # torch's "Error(s) in loading state_dict"
        return f"{lines[1]} (and {len(lines) - 2} more)"
    return " ".join(lines[:2]) or type(error).__name__


def _read_json(path: Path) -> dict:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, found {type(data).__name__}")
    return data


def _read_state(
    path: Path,
) -> tuple[int, list[dict[str, float]], list[float] | None, list[dict]]:
    """The step, evaluation history, training losses since the last evaluation (None in a
    checkpoint saved before they were) and optimizer parameter groups of ``state.json``."""
    saved = _read_json(path)
    step, history, groups = saved["step"], saved["history"], saved["optimizer_param_groups"]
    losses = saved.get("losses_since_eval")
    if not is_integer(step, 0):
        raise ValueError(f"the step is {step!r}, not a count of steps")
    if not isinstance(history, list) or not all(
        isinstance(item, dict) and is_integer(item.get("step"), 0) for item in history
    ):
        raise ValueError("the history is not a list of evaluations")
    steps_since_eval = step - (history[-1]["step"] if history else 0)
    if losses is not None and not (
        isinstance(losses, list)
        and len(losses) == steps_since_eval
        and all(isinstance(loss, float) and math.isfinite(loss) for loss in losses)
    ):
        raise ValueError(
            f"the losses since the last evaluation are not {steps_since_eval} finite numbers"
        )
    if not isinstance(groups, list) or not all(_is_param_group(item) for item in groups):
        raise ValueError(
            "the optimizer parameter groups are not a list of objects with a list of parameter "
            "numbers (params) and a pair of numbers (betas)"
        )
    numbers = sorted(index for group in groups for index in group["params"])
    if numbers != list(range(len(numbers))):  # as torch numbers them
        raise ValueError("the optimizer parameter groups do not number the parameters from 0")
    return step, history, losses, groups


def _is_param_group(group: object) -> bool:
    """Whether ``group`` is an optimizer parameter group as JSON holds it."""
    if not isinstance(group, dict) or not isinstance(group.get("params"), list):
        return False
    betas = group.get("betas", [])
    return all(is_integer(index, 0) for index in group["params"]) and (
        "betas" not in group
        or (isinstance(betas, list) and len(betas) == 2 and all(map(is_real, betas)))
    )


def load_model(
    path: str | Path, device: torch.device | str = "cpu", backend: str = "auto"
) -> Model:
    """A checkpoint as a :class:`selfattn.models.model.Model`: what explain, generate and the
    viewers use. Reads the model's files only: the optimizer and random state may be absent."""
    device = checked_device(device)
    network, tokenizer, config = _read_latest(
        path, lambda directory: _load_trained(directory, device)
    )
    info = ModelConfig.for_decoder(config.model, architecture(config.model))
    model = Model(network, info, name=str(path), tokenizer=Tokenizer(tokenizer.to_hf()))
    set_backend(model, backend)
    return model.eval()


def _read_latest(path: str | Path, read: Callable[[Path], T]) -> T:
    """``read`` of the checkpoint directory that ``path`` names; once more if that failed and
    ``LATEST`` names another one by now (a run saving into ``path`` removed the folder read)."""
    directory = checkpoint_dir(path)
    try:
        return read(directory)
    except SelfAttnError:
        latest = checkpoint_dir(path)
        if latest == directory:
            raise
        return read(latest)


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory that ``path`` names (directly or through its LATEST file)."""
    path = Path(path)
    if path.is_file():
        raise SelfAttnError(
            f"checkpoint {path} is a file; pass the folder that `selfattn train --out` wrote"
        )
    if not path.is_dir():
        raise SelfAttnError(
            f"checkpoint directory {path} does not exist; train one with "
            f"`selfattn train --data FILE --out {path}`"
        )
    if _has_latest(path) or (has_checkpoint(path) and not (path / "config.json").is_file()):
        return _latest_dir(path)  # or step folders without LATEST: say which to name in it
    if not (path / "config.json").is_file():
        raise SelfAttnError(
            f"{path} holds no checkpoint (no LATEST or config.json); pass the --out directory "
            "of `selfattn train`"
        )
    return path


def _latest_name(out_dir: Path) -> str | None:
    """The folder name in ``out_dir/LATEST``, if it can be read."""
    try:
        return (out_dir / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        return None


def _latest_dir(out_dir: Path) -> Path:
    """The checkpoint directory that ``out_dir/LATEST`` names; a one-line error if it is gone,
    is not a folder inside ``out_dir`` (a hand-edited ``../elsewhere/step-…``), or if there is
    no LATEST beside the step folders, naming one to write into it."""
    latest = out_dir / LATEST
    found = f"{out_dir} holds step folders but no {LATEST} file naming one"
    if _has_latest(out_dir):
        try:
            name = latest.read_text(encoding="utf-8").strip()
        except (OSError, ValueError) as error:
            raise SelfAttnError(f"{latest} is unreadable: {error}") from None
        target = out_dir / name
        if name and not _is_inside(out_dir, target):
            problem = f"is outside {out_dir} (only step folders inside it are read)"
        elif name and (target / "config.json").is_file():
            return target
        elif name and target.is_dir():
            problem = f"holds no checkpoint (no config.json in {target})"
        else:
            problem = f"is missing from {out_dir}"
        found = f"{latest} points at checkpoint folder {name[:80]!r}, which {problem}"
    existing = sorted(
        entry.name
        for entry in out_dir.iterdir()
        if entry.name.startswith("step-")
        and _is_inside(out_dir, entry)
        and (entry / "config.json").is_file()
    )
    fix = (
        f"write the name of an existing step folder (e.g. {existing[-1]}) into {LATEST}"
        if existing
        else "no step folder is left: train again with another --out"
    )
    raise SelfAttnError(f"{found}; {fix}")


def _is_inside(out_dir: Path, folder: Path) -> bool:
    """Whether ``folder``, with its links followed, is an entry of ``out_dir`` itself."""
    try:
        return folder.resolve().parent == out_dir.resolve()
    except (OSError, ValueError, RuntimeError):  # a link loop, a NUL byte in a hand-edited name
        return False


def is_checkpoint_folder(path: Path) -> bool:
    """Whether ``path`` is one checkpoint folder: a config.json of ours (not a training
    folder with LATEST, not a Hugging Face folder)."""
    try:
        return _read_json(Path(path) / "config.json").get("format") == FORMAT
    except (OSError, ValueError):
        return False


def has_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint or what is left of one: a LATEST (whatever it
    is), a config.json, or a step folder a save wrote. A new run may start only where none
    is, since its first save removes the step folders it did not write."""
    path = Path(path)
    if _has_latest(path) or (path / "config.json").is_file():
        return True
    try:
        return any(entry.name.startswith("step-") and _is_ours(entry) for entry in path.iterdir())
    except OSError:
        return False


def _has_latest(path: Path) -> bool:
    """Whether ``path/LATEST`` is there, as a file or anything else (a folder, a broken link)."""
    latest = path / LATEST
    return latest.exists() or latest.is_symlink()


def _split_optimizer_state(state_dict: dict) -> tuple[dict[str, Tensor], list[dict]]:
    """Optimizer tensors keyed "{param}.{name}" for safetensors; the param groups for JSON."""
    tensors = {
        f"{index}.{name}": torch.as_tensor(value).contiguous()
        for index, param_state in state_dict["state"].items()
        for name, value in param_state.items()
    }
    return tensors, state_dict["param_groups"]


def _join_optimizer_state(tensors: dict[str, Tensor], groups: list[dict]) -> dict:
    """The optimizer state_dict of ``tensors`` and ``groups``; a ValueError unless AdamW's
    state is whole: none yet, or every parameter's, with no negative squared-gradient mean."""
    state: dict[int, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    if state:
        for index in (index for group in groups for index in group["params"]):
            missing = [name for name in ADAM_STATE if name not in state.get(index, {})]
            if missing:
                raise ValueError(f"no {missing[0]} of parameter {index}")
            if bool((state[index]["exp_avg_sq"] < 0).any()):
                raise ValueError(f"exp_avg_sq of parameter {index} is negative")
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}


def _write_tensors(path: Path, write: Callable[[str], None]) -> None:
    """``write(str(path))`` with a safetensors writer; a write the system refused (a full disk,
    a file-size limit) is raised as the OSError it is, as Python's own writes raise it
    (safetensors raises a SafetensorError saying "I/O error: ... (os error 28)")."""
    try:
        write(str(path))
    except SafetensorError as error:
        code = OS_ERROR.search(str(error))
        if code is None:
            raise
        number = int(code.group(1) or code.group(2))
        raise OSError(number, os.strerror(number), str(path)) from error


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync(path: Path) -> None:
    """Flush a file's or directory's contents to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(out_dir: Path, keep: set[str | None]) -> None:
    """Remove older checkpoints and temporary directories left by interrupted saves: only
    folders named as a save names them, holding nothing but a checkpoint's files (a step
    folder: a config.json of ours); any other folder is the user's. Each is first renamed
    ``.trash-…`` (one atomic step), so that a removal cut short is finished by a later save."""
    for entry in out_dir.iterdir():
        if entry.name not in keep and _is_ours(entry):
            trash = entry
            if not entry.name.startswith(TRASH_PREFIX):
                trash = out_dir / (TRASH_PREFIX + entry.name[-8:])
                try:
                    os.replace(entry, trash)
                except OSError:
                    continue
            shutil.rmtree(trash, ignore_errors=True)


def _is_ours(entry: Path) -> bool:
    """Whether ``entry`` is a folder that ``save_checkpoint`` wrote."""
    if not OURS.fullmatch(entry.name) or entry.is_symlink() or not entry.is_dir():
        return False
    try:
        names = {path.name for path in entry.iterdir()}
    except OSError:
        return False
    if entry.name.startswith(TRASH_PREFIX):  # what a cut-short removal left (NFS: .nfs…)
        return all(name in FILES or name.startswith(".nfs") for name in names)
    if entry.name.startswith(TMP_PREFIX):
        return names <= set(FILES)
    return names == set(FILES) and is_checkpoint_folder(entry)
