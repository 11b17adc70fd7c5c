"""The ``selfattn`` command line."""

from __future__ import annotations

import errno
import importlib
import inspect
import json
import math
import os
import signal
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from decimal import Decimal, InvalidOperation
from functools import partial
from itertools import combinations, pairwise
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from selfattn.errors import SelfAttnError, SettingsError
from selfattn.examples import CIAO_MEANING, CIAO_TOKENS, ciao_steps
from selfattn.models.gpt import MAX_SAMPLING_SEED
from selfattn.text import check_word
from selfattn.viz.terminal import matrix_table

# The click typer runs on: its own copy (typer._click) in recent typer, click itself before.
_click = getattr(typer.core, "_click", None) or importlib.import_module("click")


class _Plain:
    """Typer's commands with a plain ``--help`` line (no "<bool>": like the flags, it takes no
    value) and a usage mistake (unknown option or command, bad value) as one ``Error:`` line
    instead of a usage box."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    def make_context(self, info_name, args, *rest, **kwargs):
        with _one_line_usage_errors(_flag_given_a_value(self, list(args))):
            return super().make_context(info_name, args, *rest, **kwargs)


class _Group(_Plain, typer.core.TyperGroup):
    def resolve_command(self, *args, **kwargs):
        with _one_line_usage_errors():
            return super().resolve_command(*args, **kwargs)

    def main(self, *args, **kwargs):
        """Every command with its standard output guarded (:class:`_GuardedStdout`): a closed
        pipe stops nothing but the printing, and a full disk is one line at the end."""
        guarded = _GuardedStdout(sys.stdout)
        sys.stdout = guarded
        try:
            super().main(*args, **kwargs)
            code = 0
        except SystemExit as done:
            code = done.code
        finally:
            sys.stdout = guarded.stream
        if guarded.error is not None:
            if guarded.error.errno != errno.EPIPE:  # a reader gone (| head) needs no word
                reason = guarded.error.strerror or guarded.error
                typer.echo(f"Error: cannot write the standard output: {reason}", err=True)
            code = code or 1
        sys.exit(code)


class _GuardedStdout:
    """Standard output that a failed write cannot stop: after a closed pipe (``| head -1``)
    or a full disk, what the command prints goes nowhere, and its other work goes on — the
    files it writes, a training run and its saves (before, the first failed print ended the
    command there, files unwritten and training unsaved)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.error: OSError | None = None

    def write(self, text: str) -> int:
        if self.error is None:
            try:
                return self.stream.write(text)
            except OSError as error:
                self._failed(error)
        return len(text)

    def flush(self) -> None:
        if self.error is None:
            try:
                self.stream.flush()
            except OSError as error:
                self._failed(error)

    def _failed(self, error: OSError) -> None:
        self.error = error
        # what the stream still holds is flushed at exit: into /dev/null, not a traceback
        with suppress(OSError, ValueError):  # ValueError: a stream with no file (a test's)
            nowhere = os.open(os.devnull, os.O_WRONLY)
            os.dup2(nowhere, self.stream.fileno())
            os.close(nowhere)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


class _Command(_Plain, typer.core.TyperCommand):
    pass


def _flag_given_a_value(command, args: list[str]) -> str | None:
    """The flag in ``args`` followed by a word (``--words bank``), if any: the likely cause
    of an unexpected extra argument, as a flag takes no value."""
    flags = {
        name for param in command.params if getattr(param, "is_flag", False) for name in param.opts
    }
    for arg, following in pairwise(args):
        if arg in flags and not following.startswith("-"):
            return arg
    return None


@contextmanager
def _one_line_usage_errors(flag_given_a_value: str | None = None) -> Iterator[None]:
    try:
        yield
    except _click.exceptions.UsageError as error:
        if type(error).__name__ == "NoArgsIsHelpError":  # shows the help, not an error
            raise
        message = error.format_message().rstrip(".")
        if flag_given_a_value and "unexpected extra argument" in message:
            message += f"; {flag_given_a_value} is a flag and takes no value"
        if error.ctx is not None:
            end = " " if message.endswith("?") else ". "
            message += f"{end}See `{error.ctx.command_path} --help`."
        raise _fail(message, error.exit_code) from None


app = typer.Typer(
    cls=_Group,
    help="Self-attention, step by step: explain it on real models, view it, run it, train it.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()


def _flag(name: str, text: str) -> typer.models.OptionInfo:
    """A boolean flag's option, its help without typer's "<bool>" (it takes no value)."""
    return typer.Option(name, help=text, metavar="")


def _given_path(value: str | Path) -> Path:
    """Every path option's value (see :func:`_path_option`): an empty one, which ``Path`` reads
    as the current folder (``--out ""`` trained into it), is refused naming the flag."""
    if isinstance(value, str) and not value.strip():
        raise _click.exceptions.BadParameter(
            f"the path is empty ({value!r}); name a file or folder ('.' for the current one)"
        )
    return Path(value)


def _path_option(*names: str, **settings) -> typer.models.OptionInfo:
    """An option that takes a file or folder: its value a Path, never an empty one (shown as
    `<path>` in the help, as typer shows a Path option)."""
    return typer.Option(*names, parser=_given_path, metavar="<path>", **settings)


STDIN_HELP = ' ("-" reads it from the standard input)'


def _standard_input_for_dash(*texts: str) -> list[str]:
    """The texts as given, but "-" replaced by the standard input, read once (its final line
    breaks dropped, as `echo` adds one): a pipe can feed a text longer than a command line
    takes, or one that starts with "-"."""
    if texts.count("-") > 1:
        raise _fail('only one text can be "-": the standard input is read once', 2)
    if "-" not in texts:
        return list(texts)
    if sys.stdin is None:
        raise _fail('"-" reads the text from the standard input, and there is none', 2)
    if sys.stdin.isatty():
        typer.echo("Reading the text from the standard input; end it with Ctrl-D.", err=True)
    stream = getattr(sys.stdin, "buffer", None)
    try:
        given = stream.read().decode("utf-8-sig") if stream is not None else sys.stdin.read()
    except UnicodeDecodeError as error:
        raise _fail(
            f"the standard input is not UTF-8 text (byte {error.start}); give it as UTF-8"
        ) from None
    given = given.rstrip("\r\n")
    return [given if text == "-" else text for text in texts]


def _whole_number(value: str) -> int:
    """An integer setting of `selfattn train` as written: 5000, or a whole number written as a
    float (5e3, 5000.0), as the presets take it from Python; 2.5 is refused, in a usage
    error that click gives the flag's name."""
    text = value.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = Decimal(text)
    except InvalidOperation:
        number = None
    if number is None or not number.is_finite() or number != number.to_integral_value():
        raise _click.exceptions.BadParameter(
            f"{text} must be a whole number (5e3 and 5000.0 are taken as 5000)"
        )
    if number.adjusted() > 100:  # int() of 1e999999999 would take minutes
        raise _click.exceptions.BadParameter(f"{text} is too large")
    return int(number)


def _whole_option(name: str) -> typer.models.OptionInfo:
    """The option of an integer training setting, with its help (``TRAIN_HELP[name]``)."""
    return typer.Option(help=TRAIN_HELP[name], parser=_whole_number)


def _print_version(asked: bool) -> None:
    """``--version``: the installed package's version, before any command runs."""
    if asked:
        from selfattn import __version__

        console.print(f"selfattn {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print selfattn's version and exit.",
        metavar="",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    """Self-attention, step by step: explain it on real models, view it, run it, train it."""


@app.command()
def demo() -> None:
    """The guide's worked example: "Ciao gioco a giochi" with small fixed vectors, step by step."""
    console.print(
        f'[bold]Self-attention on "{" ".join(CIAO_TOKENS)}"[/] ("{CIAO_MEANING}"), in six steps'
    )
    for step in ciao_steps():
        console.print(f"\n[bold]{step.heading}[/]")
        console.print(step.meaning, markup=False, highlight=False)
        if step.matrix is not None:
            table = matrix_table(
                step.matrix, CIAO_TOKENS, step.columns, step.formula, step.digits, step.vectors
            )
            console.print(table)


TRAIN_HELP = {
    "data": "Text file to train on (UTF-8); the first 90% trains, the last 10% is held out.",
    "out": "Directory for checkpoints (safetensors + JSON); `generate --checkpoint` reads it.",
    "preset": "Model sizes and training settings by name: shakespeare-char-cpu (the default), "
    "shakespeare-char (GPU) or tiny; with --resume, the checkpoint's. Other flags override "
    "single settings.",
    "resume": "Continue the checkpoint in --out up to --max-iters, exactly where it stopped.",
    "max_iters": "Total optimizer steps (counted from the first run when resuming). The "
    "learning-rate schedule follows --lr-decay-iters, not this: past that step it stays at "
    "--min-lr.",
    "batch_size": "Sequences per step and process (global batch = this × processes).",
    "block_size": "Characters per training sequence; also the model's context length.",
    "lr": "Peak learning rate, reached after the warm-up.",
    "min_lr": "Learning rate at the end of the cosine decay.",
    "warmup_iters": "Steps of linear learning-rate warm-up.",
    "lr_decay_iters": "Step at which the cosine decay reaches --min-lr (and stays there); the "
    "presets set it to their --max-iters, as nanoGPT does.",
    "weight_decay": "AdamW weight decay (on matrices and embeddings only).",
    "beta1": "AdamW's decay rate of its gradient mean, in [0, 1).",
    "beta2": "AdamW's decay rate of its squared-gradient mean, in [0, 1) (0.99 in the presets, "
    "as nanoGPT's shakespeare_char).",
    "grad_clip": "Clip the global gradient norm to this (0: no clipping).",
    "eval_interval": "Steps between evaluations on the held-out split (and checkpoints).",
    "eval_iters": "Held-out batches per evaluation.",
    "log_interval": "Steps between progress-bar updates (under torchrun, also between checks "
    "for Ctrl-C).",
    "seed": "Seed of the initial weights and the batch order (each process offsets it); a "
    "resumed run keeps its checkpoint's.",
    "arch": "gpt (the default: nanoGPT's GPT, learned positions, LayerNorm, GELU, tied head) or "
    "llama (RoPE, RMSNorm, SwiGLU, untied head); with --resume, the checkpoint's.",
    "n_layer": "Transformer blocks.",
    "n_head": "Attention heads per block.",
    "n_kv_head": "Key/value heads shared by the query heads (grouped-query attention, --arch "
    "llama only; a divisor of --n-head, which it is unless given).",
    "n_embd": "Embedding width (a multiple of --n-head; of 2 × --n-head with --arch llama).",
    "dropout": "Dropout probability during training.",
    "device": "auto (CUDA when present), cpu or cuda.",
}


def _is_main_process() -> bool:
    """False on the ranks other than 0 under torchrun: only rank 0 prints."""
    import os

    return os.environ.get("RANK", "0") == "0"


def _fail(message: str, code: int = 1) -> typer.Exit:
    """Print typer-style one-line "Error: ..." to stderr (on rank 0 under torchrun)."""
    if _is_main_process():
        typer.echo(f"Error: {message}", err=True)
    return typer.Exit(code)


@app.command()
def train(
    data: Annotated[Path, _path_option(help=TRAIN_HELP["data"])],
    out: Annotated[Path, _path_option(help=TRAIN_HELP["out"])],
    preset: Annotated[str | None, typer.Option(help=TRAIN_HELP["preset"])] = None,
    resume: Annotated[bool, _flag("--resume", TRAIN_HELP["resume"])] = False,
    max_iters: Annotated[int | None, _whole_option("max_iters")] = None,
    batch_size: Annotated[int | None, _whole_option("batch_size")] = None,
    block_size: Annotated[int | None, _whole_option("block_size")] = None,
    lr: Annotated[float | None, typer.Option(help=TRAIN_HELP["lr"])] = None,
    min_lr: Annotated[float | None, typer.Option(help=TRAIN_HELP["min_lr"])] = None,
    warmup_iters: Annotated[int | None, _whole_option("warmup_iters")] = None,
    lr_decay_iters: Annotated[int | None, _whole_option("lr_decay_iters")] = None,
    weight_decay: Annotated[float | None, typer.Option(help=TRAIN_HELP["weight_decay"])] = None,
    beta1: Annotated[float | None, typer.Option(help=TRAIN_HELP["beta1"])] = None,
    beta2: Annotated[float | None, typer.Option(help=TRAIN_HELP["beta2"])] = None,
    grad_clip: Annotated[float | None, typer.Option(help=TRAIN_HELP["grad_clip"])] = None,
    eval_interval: Annotated[int | None, _whole_option("eval_interval")] = None,
    eval_iters: Annotated[int | None, _whole_option("eval_iters")] = None,
    log_interval: Annotated[int | None, _whole_option("log_interval")] = None,
    seed: Annotated[int | None, _whole_option("seed")] = None,
    arch: Annotated[str | None, typer.Option(help=TRAIN_HELP["arch"])] = None,
    n_layer: Annotated[int | None, _whole_option("n_layer")] = None,
    n_head: Annotated[int | None, _whole_option("n_head")] = None,
    n_kv_head: Annotated[int | None, _whole_option("n_kv_head")] = None,
    n_embd: Annotated[int | None, _whole_option("n_embd")] = None,
    dropout: Annotated[float | None, typer.Option(help=TRAIN_HELP["dropout"])] = None,
    device: Annotated[str, typer.Option(help=TRAIN_HELP["device"])] = "auto",
) -> None:
    """Train a character-level GPT (or with --arch llama, a Llama) on a text file; `torchrun
    --nproc_per_node=N -m selfattn train ...` trains on N processes with DistributedDataParallel."""
    given = {
        "max_iters": max_iters, "batch_size": batch_size, "block_size": block_size,
        "learning_rate": lr, "min_lr": min_lr, "warmup_iters": warmup_iters,
        "lr_decay_iters": lr_decay_iters, "weight_decay": weight_decay, "beta1": beta1,
        "beta2": beta2, "grad_clip": grad_clip,
        "eval_interval": eval_interval, "eval_iters": eval_iters, "log_interval": log_interval,
        "seed": seed, "arch": arch, "n_layer": n_layer, "n_head": n_head, "n_kv_head": n_kv_head,
        "n_embd": n_embd, "dropout": dropout,
    }  # fmt: skip
    overrides = {key: value for key, value in given.items() if value is not None}
    try:  # the imports too: Ctrl-C while they load is the handling below
        from selfattn.train import train_decoder
        from selfattn.train.distributed import check_device
        from selfattn.train.loop import signals_held_after_a_stop

        check_device(device)
        with signals_held_after_a_stop():  # a repeated signal cannot cut the last line short
            run = train_decoder(
                data, out, preset=preset, overrides=overrides, resume=resume, device=device,
                console=console,
            )  # fmt: skip
            _report_training(run, out)
    except SelfAttnError as error:
        raise _fail(str(error), _status(error)) from None
    except KeyboardInterrupt:  # outside the loop, which saves on Ctrl-C: before it or after
        if _is_main_process():
            console.print(_interrupted_outside_the_loop(out), soft_wrap=True)
        raise typer.Exit(130) from None


def _report_training(run, out: Path) -> None:
    """The line that ends `selfattn train`: what was trained and saved, or why not."""
    result = run.result
    if result.interrupted:
        if _is_main_process():
            console.print(
                f"Interrupted at step {result.step}: checkpoint saved in {out} (--resume).",
                soft_wrap=True,
            )
        raise typer.Exit(128 + (result.signal or signal.SIGINT))  # 130 for Ctrl-C, 143 TERM
    if not _is_main_process():
        return
    if result.step == result.start_step and not result.evaluations:
        console.print(
            f"Nothing to do: {out} is already at step {result.step}, and --max-iters "
            f"{run.config.train.max_iters} counts the steps since the first run; pass a larger "
            "one to train on.",
            soft_wrap=True,
        )
        return
    last = result.history[-1]
    speed = (
        f"{result.ms_per_iter:.1f} ms/iter, {result.tokens_per_second:,.0f} tokens/s"
        if result.step > result.start_step
        else "the evaluation an interrupt cut short, now done"
    )
    console.print(
        f"step {result.step}: val loss {last['val']:.4f}; {speed}; checkpoint in {out}",
        soft_wrap=True,
    )


def _interrupted_outside_the_loop(out: Path) -> str:
    """What a Ctrl-C outside the training steps left: the last checkpoint, or nothing."""
    from selfattn.train.checkpoint import has_checkpoint

    if has_checkpoint(out):
        return f"Interrupted outside the training steps; the last checkpoint in {out} is kept."
    return "Interrupted before training started; nothing saved."


DEFAULT_PROMPT = "\n"  # where nanoGPT's sampling starts too


@app.command()
def generate(
    checkpoint: Annotated[
        Path | None, _path_option(help="A `selfattn train --out` directory.")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="A Hugging Face-style decoder folder instead (GPT-2, GPT-NeoX, Llama, Mistral, "
            "Qwen, Phi-3 or Gemma)."
        ),
    ] = None,
    prompt: Annotated[
        str | None,
        typer.Argument(
            metavar="PROMPT",
            help="Text to continue (for a model trained here, in characters of its text)"
            + STDIN_HELP
            + ".",
            show_default="a new line",
        ),
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option(min=0, help="Tokens to generate (characters, for a model trained here).")
    ] = 500,
    temperature: Annotated[
        float, typer.Option(min=0.0, help="Sampling temperature; 0 is greedy.")
    ] = 0.8,
    top_k: Annotated[
        int | None, typer.Option(min=1, help="Sample among the k likeliest only.")
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(help=f"Seed for reproducible sampling, 0 to {MAX_SAMPLING_SEED:,}."),
    ] = None,
    html: Annotated[
        Path | None,
        _path_option(
            help="Also write an offline HTML page: one strip per new token, the attention that "
            "chose it over the prompt and the tokens before it."
        ),
    ] = None,
    json_file: Annotated[
        Path | None,
        _path_option("--json", help="Also write that attention, every layer and head, as JSON."),
    ] = None,
    layer: Annotated[
        int | None,
        typer.Option(help="The layer the --html page opens on (0 = first); default: the last."),
    ] = None,
    head: Annotated[
        str | None,
        typer.Option(help="The head the --html page opens on: a number or 'mean' (the default)."),
    ] = None,
) -> None:
    """Continue PROMPT with a decoder: one trained by `selfattn train`, or a GPT-2,
    GPT-NeoX (Pythia), Llama, Mistral, Qwen, Phi-3 or Gemma folder."""
    if (checkpoint is None) == (model is None):
        raise _fail(
            "give one model to continue with: --checkpoint DIR (trained by `selfattn train`) "
            "or --model FOLDER (a GPT-2, GPT-NeoX, Llama, Mistral, Qwen, Phi-3 or Gemma one)",
            2,
        )
    if seed is not None and not 0 <= seed <= MAX_SAMPLING_SEED:
        raise _fail(
            f"--seed {seed} is out of range; choose one between 0 and {MAX_SAMPLING_SEED}", 2
        )
    _check_layer(layer)
    _check_outputs((html, "--html"), (json_file, "--json"))
    if html is not None and max_new_tokens == 0:
        raise _fail("--html shows the attention of new tokens; give --max-new-tokens 1 or more", 2)
    if html is None and (layer is not None or head is not None):
        raise _fail("--layer and --head choose what the --html page opens on; add --html FILE", 2)
    view = {"layer": -1 if layer is None else layer, "head": _parse_head(head or "mean")}
    if prompt is not None:
        (prompt,) = _standard_input_for_dash(prompt)
    sampling = {"temperature": temperature, "top_k": top_k, "seed": seed}
    with _user_errors():
        network = _load(model, checkpoint)
        prompt = _default_prompt(network) if prompt is None else prompt
        if html is None and json_file is None:
            typer.echo(prompt + network.generate(prompt, max_new_tokens, **sampling))
            return
        _check_view(network, view)
        generation = network.generate_recorded(prompt, max_new_tokens, **sampling)
        typer.echo(prompt + generation.text)
        _write_generation(generation, html, json_file, view, network.config.sliding_windows)


def _check_view(network, view: dict) -> None:
    """An OutOfRange error, before generating, for a --layer or --head the model has not (the
    flags take no negative index, so the error names none)."""
    from selfattn.viz.generation import opening_view

    opening_view(network.config.n_layers, network.config.n_heads, **view, counts_back=False)


def _write_generation(
    generation,
    html: Path | None,
    json_file: Path | None,
    view: dict,
    windows: tuple[int | None, ...],
) -> None:
    """Write the page (opened on ``view``'s layer and head, the keys before each layer's
    sliding window ``windows`` masked) and the JSON of a recorded generation, where asked."""
    from selfattn.viz.generation import generation_page

    if html is not None:
        _write(html, partial(_save_text, generation_page(generation, windows=windows, **view)))
    if json_file is not None:
        _write(json_file, partial(_save_text, json.dumps(generation.to_json())))


def _default_prompt(network) -> str:
    """A new line, where nanoGPT's sampling starts too; refused in one line by a model whose
    vocabulary lacks it (trained on a text without line breaks)."""
    if network.tokenizer is not None:
        try:
            network.tokenizer.encode_ids([DEFAULT_PROMPT])
        except SelfAttnError:
            raise SelfAttnError(
                "the default PROMPT, a new line, is not in this model's vocabulary (its "
                "training text has none); give a PROMPT in characters of that text"
            ) from None
    return DEFAULT_PROMPT


# ---------------------------------------------------------------------------------------------
# explain, compare, view: the main job

MODEL_HELP = "Model: 'minilm' (all-MiniLM-L6-v2, the default) or a Hugging Face-style folder."
DEFAULT_MODEL = "minilm"
CHECKPOINT_HELP = "A `selfattn train --out` directory, instead of --model."
TRUNCATE_HELP = "Cut text longer than the model's positions."
JSON_HELP = "Print one JSON object with every number."
EXPLAIN_EPILOG = 'Example: selfattn explain "I went to the bank to deposit money." --word bank'


def _one_model(model: str | None, checkpoint: Path | None) -> None:
    """Refuse --model and --checkpoint together (which one was meant is not ours to guess)."""
    if model is not None and checkpoint is not None:
        raise _fail(
            "give --model or --checkpoint, not both: --model for a pretrained model ('minilm' "
            "or a Hugging Face folder), --checkpoint for a `selfattn train --out` directory",
            2,
        )


def _load(model: str | None, checkpoint: Path | None):
    """The model to look into (pretrained, or trained here; 'minilm' when neither is given),
    with a status line on stderr, and a note there naming the task heads a fine-tuned
    checkpoint had that were left out."""
    if model is None and checkpoint is None:
        model = DEFAULT_MODEL
    label = str(checkpoint) if checkpoint is not None else model
    stderr = Console(stderr=True)
    with stderr.status(f"Loading {label}…"):
        if checkpoint is not None:
            from selfattn.train import load_model

            return load_model(checkpoint)
        from selfattn.models.loading import load, skipped_note

        loaded = load(model)
    note = skipped_note(loaded)
    if note is not None:
        stderr.print(f"note: {note}", soft_wrap=True, markup=False)
    return loaded


@contextmanager
def _user_errors() -> Iterator[None]:
    """Turn a user's mistake (bad text, word, layer, file) into one 'Error: ...' line."""
    try:
        yield
    except ValueError as error:  # SelfAttnError and OutOfRange among them
        message = str(error).strip().splitlines()
        raise _fail(message[0] if message else type(error).__name__, _status(error)) from None


def _status(error: Exception) -> int:
    """The exit status of a user's mistake: 2 for a setting wrong in itself (a usage error, as
    click's are), 1 for a problem met in the work (the text, the model, a file)."""
    return 2 if isinstance(error, SettingsError) else 1


def _check_outputs(*outputs: tuple[Path | None, str]) -> None:
    """Fail before any work (the model not yet loaded) if an output, ``(path, option)``, cannot
    be written: a folder, in a folder that is missing or takes no new file, a file that may
    not be written, or a file another output names too (the second write replaced the first)."""
    given = [(path, option) for path, option in outputs if path is not None]
    for path, option in given:
        if path.is_dir():
            raise _fail(f"{option} {path} is a folder; give a file name", 2)
        if not path.parent.is_dir():
            file = next((above for above in path.parents if above.exists()), None)
            if file is not None and not file.is_dir():  # out/x.html where out is a file
                raise _fail(
                    f"{option} {path}: {file} is a file, not a folder; give {option} a file in a "
                    "folder",
                    2,
                )
            raise _fail(
                f"{option} {path}: the folder {path.parent} does not exist; create it first", 2
            )
    for (path, option), (other, other_option) in combinations(given, 2):
        if path.resolve() == other.resolve():
            raise _fail(f"{option} and {other_option} both name {path}; give each its own file", 2)
    for path, option in given:
        _check_writable(path, option)


def _check_writable(path: Path, option: str) -> None:
    """Refuse ``path`` where it is a file that may not be written, or (a new file) where its
    folder takes no new file (read-only, /proc: tried with a temporary file, removed at once).
    A file that exists is written in place, so its folder's rights do not matter (/dev/stdout)."""
    if path.exists():
        if not os.access(path, os.W_OK):
            raise _fail(
                f"cannot write {path}: the file is read-only; give {option} another file", 2
            )
        return
    try:
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        raise _fail(
            f"cannot write {path}: its folder {path.parent} takes no new file "
            f"({error.strerror or error}); give {option} a file in another folder",
            2,
        ) from None


def _write(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` with ``write`` and say so on stderr; a failure (permissions, a full
    disk) is one line, and so is each warning (a figure's characters no font has). A file
    is written beside it and renamed over it once whole, so that a failure or Ctrl-C midway
    leaves the file that was there, not half a new one; what is no file (/dev/stdout, a
    pipe), or a file in a folder that takes no new one, is written in place."""
    final = path.resolve() if path.is_symlink() else path  # the file a link names, the link kept
    written = final.with_name(f".{final.stem}-{os.getpid()}{final.suffix}")
    in_place = path.exists() and not path.is_file()
    if not in_place and final.is_file():
        try:
            written.touch(exist_ok=False)
        except OSError:  # the folder takes no new file (_check_writable let its file through)
            in_place = True
    written = path if in_place else written
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            write(written)
        if not in_place:
            os.replace(written, final)
    except OSError as error:
        raise _fail(f"cannot write {path}: {error.strerror or error}") from None
    finally:
        if not in_place:
            written.unlink(missing_ok=True)
    stderr = Console(stderr=True)
    for warning in caught:
        stderr.print(f"note: {path.name}: {warning.message}", soft_wrap=True, markup=False)
    page = " (open it in a browser; it needs no network)" if path.suffix == ".html" else ""
    stderr.print(f"wrote {path}{page}", soft_wrap=True)  # a path, uncut


def _save_text(text: str, path: Path) -> None:
    path.write_text(text, encoding="utf-8")


def _note_truncation(run, name: str = "the text") -> None:
    """Say on stderr when ``--truncate`` cut the text (``name``: which text), and where."""
    if run.read_text != run.text:
        Console(stderr=True).print(
            f"note: {name} was cut to the model's {len(run.tokens)} tokens (--truncate): "
            f"its first {len(run.read_text):,} of {len(run.text):,} characters",
            soft_wrap=True,
        )


def _check_layer(layer: int | None) -> None:
    """Layers are numbered from 0 on every command: a negative one is refused (not read from
    the end) before the model loads; one past the model's last, once it has loaded."""
    if layer is not None and layer < 0:
        raise _fail(f"--layer must be 0 or more (0 is the first layer), got {layer}", 2)


def _parse_head(head: str | None) -> int | str | None:
    """--head as a number (from 0, as --layer) or 'mean'."""
    if head is None or head == "mean":
        return head
    try:
        number = int(head)
    except ValueError:
        raise _fail(f"--head must be a head number or 'mean', got {head!r}", 2) from None
    if number < 0:
        raise _fail(
            f"--head must be a head number or 'mean', got {head!r}: heads are numbered from 0",
            2,
        )
    return number


@app.command(epilog=EXPLAIN_EPILOG)
def explain(
    text: Annotated[
        str, typer.Argument(metavar="TEXT", help="The sentence to look into" + STDIN_HELP + ".")
    ],
    word: Annotated[
        str | None, typer.Option(help="The word to explain as a query (whole word, any case).")
    ] = None,
    index: Annotated[
        int | None, typer.Option(help="The token index to explain instead of --word.")
    ] = None,
    occurrence: Annotated[
        int, typer.Option(help="Which occurrence of --word (0 = first, -1 = last).")
    ] = 0,
    layer: Annotated[
        int | None, typer.Option(help="Layer (0 = first); default: the most telling one.")
    ] = None,
    head: Annotated[
        str | None, typer.Option(help="Head number or 'mean'; default: the most telling one.")
    ] = None,
    model: Annotated[str | None, typer.Option(help=MODEL_HELP, show_default=False)] = None,
    checkpoint: Annotated[Path | None, _path_option(help=CHECKPOINT_HELP)] = None,
    words: Annotated[
        bool, _flag("--words", "Merge word pieces: keys summed, queries averaged.")
    ] = False,
    similarity: Annotated[
        str | None,
        typer.Option(help="Recompute the head with 'dot' or 'cosine' similarity, side by side."),
    ] = None,
    scale: Annotated[
        float | None, typer.Option(help="Recompute the head with this scale (1 = no scaling).")
    ] = None,
    truncate: Annotated[bool, _flag("--truncate", TRUNCATE_HELP)] = False,
    as_json: Annotated[bool, _flag("--json", JSON_HELP)] = False,
    png: Annotated[Path | None, _path_option(help="Write the heatmap as a PNG figure.")] = None,
    svg: Annotated[Path | None, _path_option(help="Write the heatmap as an SVG figure.")] = None,
    html: Annotated[
        Path | None, _path_option(help="Write the interactive, offline HTML page.")
    ] = None,
) -> None:
    """Show step by step what self-attention did to one word of TEXT on a real model.

    For the query word: raw similarity scores against every key, the scaled scores, the
    softmax weights (summing to 1), the top attended words and the output vector; then the
    whole layer/head as a heatmap (rows: queries, columns: keys). Every number is recomputed
    from the query, key and value the model computed on its fast path.
    """
    from selfattn import explain as explaining
    from selfattn.viz import report

    _one_model(model, checkpoint)
    if word is not None and index is not None:
        raise _fail("give either --word or --index, not both", 2)
    if index is not None and index < 0:
        raise _fail(f"--index must be 0 or more (0 is the first token), got {index}", 2)
    if similarity is not None and similarity not in ("dot", "cosine"):
        raise _fail(f"--similarity must be 'dot' or 'cosine', got {similarity!r}", 2)
    if scale is not None and not math.isfinite(scale):
        raise _fail(f"--scale must be a finite number, got {scale}", 2)
    for path, suffix in ((png, ".png"), (svg, ".svg")):
        if path is not None and path.suffix.lower() != suffix:  # ".png" alone has no suffix
            problem = "has no name before" if path.name.lower() == suffix else "does not end in"
            raise _fail(
                f"--{suffix[1:]} {path}: the file name {problem} {suffix}; give one such as "
                f"bank{suffix}",
                2,
            )
    head_choice = _parse_head(head)
    _check_layer(layer)
    _check_outputs((png, "--png"), (svg, "--svg"), (html, "--html"))
    with _user_errors():
        if word is not None:
            check_word(word)  # before the model loads
    (text,) = _standard_input_for_dash(text)
    with _user_errors():
        network = _load(model, checkpoint)
        run, explanation = explaining.explain_text(
            network, text, word=word, index=index, occurrence=occurrence, truncate=truncate,
            layer=layer, head=head_choice, similarity=similarity, scale=scale, words=words,
        )  # fmt: skip
        if as_json:
            typer.echo(json.dumps(explanation.to_json()))
        else:
            report.print_explanation(console, explanation)
        _note_truncation(run)
        for path in (png, svg):
            if path is not None:
                _write(path, partial(report.save_heatmap, explanation))
        if html is not None:
            _write(html, partial(_save_text, report.page(run, explanation)))
        _note_what_files_leave_out(similarity, scale, words, html, (png, svg))


def _note_what_files_leave_out(
    similarity: str | None,
    scale: float | None,
    words: bool,
    html: Path | None,
    pictures: tuple[Path | None, ...],
) -> None:
    """Say on stderr which options shaped the printed steps but not a file written: the
    files show the model's own weights; the page, token by token."""
    options = (("--similarity", similarity), ("--scale", scale))
    recomputed = [flag for flag, value in options if value is not None]
    written = [str(path) for path in (html, *pictures) if path is not None]
    lines = []
    if recomputed and written:
        lines.append(
            f"{' and '.join(recomputed)} recompute{'' if len(recomputed) > 1 else 's'} the "
            f"steps printed here, not {', '.join(written)}: they show the model's own weights "
            "(selfattn serve recomputes a head in its Similarity & scale view)"
        )
    if words and html is not None:
        lines.append(f"--words merges word pieces here and in pictures, not in {html}: its map is "
                     "token by token")  # fmt: skip
    for line in lines:
        Console(stderr=True).print(f"note: {line}", soft_wrap=True)


@app.command(epilog='Example: selfattn compare "I went to the bank to deposit money." '
             '"I sat on the bank of the river." --word bank')  # fmt: skip
def compare(
    sentences: Annotated[
        list[str],
        typer.Argument(
            metavar="SENTENCE",
            help='Two or more sentences with the word; one may be "-", the standard input.',
        ),
    ],
    word: Annotated[str, typer.Option(help="The word to follow across the sentences.")],
    occurrence: Annotated[
        int,
        typer.Option(help="Which occurrence of --word in each sentence (0 = first, -1 = last)."),
    ] = 0,
    model: Annotated[str | None, typer.Option(help=MODEL_HELP, show_default=False)] = None,
    checkpoint: Annotated[Path | None, _path_option(help=CHECKPOINT_HELP)] = None,
    truncate: Annotated[bool, _flag("--truncate", TRUNCATE_HELP)] = False,
    as_json: Annotated[bool, _flag("--json", JSON_HELP)] = False,
) -> None:
    """Follow one word across sentences: how alike its vectors are, layer by layer.

    Layer 0 is the embedding output: the same token differs there only by its position
    (BERT, GPT-2) or not at all (rotary models: 1.000), while a word read as other tokens
    (another case, a leading space) differs from the start; the layers above mix in context,
    so "bank" beside "money" drifts away from "bank" beside "river".
    """
    from selfattn import explain as explaining
    from selfattn.viz import report

    _one_model(model, checkpoint)
    if len(sentences) < 2:
        raise _fail("give at least two sentences to compare", 2)
    with _user_errors():
        check_word(word)  # before the model loads
    sentences = _standard_input_for_dash(*sentences)
    with _user_errors():
        network = _load(model, checkpoint)
        runs = explaining.run_sentences(network, sentences, word, truncate=truncate)
        comparison = explaining.compare(runs, word, occurrence=occurrence)
        if as_json:
            typer.echo(json.dumps(comparison.to_json() | {"model": network.name}))
        else:
            report.print_comparison(console, comparison, network.name)
        for number, run in enumerate(runs, 1):
            _note_truncation(run, f"sentence {number}")


@app.command()
def view(
    text: Annotated[
        str, typer.Argument(metavar="TEXT", help="The sentence to explore" + STDIN_HELP + ".")
    ],
    output: Annotated[Path, _path_option("-o", "--output", help="The HTML file to write.")],
    model: Annotated[str | None, typer.Option(help=MODEL_HELP, show_default=False)] = None,
    checkpoint: Annotated[Path | None, _path_option(help=CHECKPOINT_HELP)] = None,
    truncate: Annotated[bool, _flag("--truncate", TRUNCATE_HELP)] = False,
) -> None:
    """Write one self-contained, offline HTML page to explore every layer and head of TEXT."""
    from selfattn import explain as explaining
    from selfattn.viz import report

    _one_model(model, checkpoint)
    _check_outputs((output, "--output"))
    (text,) = _standard_input_for_dash(text)
    with _user_errors():
        network = _load(model, checkpoint)
        run = network.run(text, truncate=truncate)
        explanation = explaining.explain(run, model_name=network.name)
        _note_truncation(run)
        _write(output, partial(_save_text, report.page(run, explanation)))


@app.command(epilog="Example: selfattn serve, then open http://127.0.0.1:8000/")
def serve(
    model: Annotated[str | None, typer.Option(help=MODEL_HELP, show_default=False)] = None,
    checkpoint: Annotated[Path | None, _path_option(help=CHECKPOINT_HELP)] = None,
    host: Annotated[
        str, typer.Option(help="Address to listen on; other than 127.0.0.1, the network sees it.")
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port to listen on; 0: a free one (printed).")
    ] = 8000,
) -> None:
    """Explore self-attention in the browser: a local web app over one model.

    Explore a text (every layer and head, step by step), follow a word across
    sentences, recompute a head with another similarity or scale; the address
    bar keeps the view. The JSON API is described at /openapi.json;
    /api/explain returns what `explain --json` prints.
    """
    from selfattn import server

    _one_model(model, checkpoint)
    with _user_errors():
        sock = server.listen(host, port)
        port = sock.getsockname()[1]  # the one chosen by the system for --port 0
        if not server.is_local(host):  # once it listens there
            Console(stderr=True).print(
                f"[bold yellow]warning:[/] listening on {host}: the explorer is reachable from "
                "the network, by anyone who can reach this machine (it has no login)",
                soft_wrap=True,  # one line in a log too (a console that is no terminal is 80 wide)
            )
        try:
            network = _load(model, checkpoint)
        except BaseException:  # no server will take the socket over
            sock.close()
            raise
    console.print(  # one line: a URL cut in two in a log opens nothing
        f"selfattn explorer on {server.url(host, port)} ({network.name}; Ctrl+C stops it)",
        soft_wrap=True,
    )
    raise typer.Exit(server.serve(network, host, sock))  # 130 after Ctrl+C


def _one_line_paragraphs(doc: str) -> str:
    """A docstring with each paragraph on one line: typer's help keeps single line breaks."""
    return "\n\n".join(" ".join(part.split()) for part in inspect.cleandoc(doc).split("\n\n"))


for _command in app.registered_commands:
    _command.help = _one_line_paragraphs(_command.help or inspect.getdoc(_command.callback))
    _command.cls = _Command


def main() -> None:
    """The ``selfattn`` command: the app, then Ctrl-C and SIGTERM ignored while the process
    exits, its work done and said (a repeated Ctrl-C after a stopped training's last line
    was a traceback from torch's exit handlers, and the exit status -2, not 130)."""
    try:
        app()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    main()
