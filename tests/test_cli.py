"""The command line's choices of model, its serve start lines, and the mistakes it refuses
before any work (no model is loaded but MiniLM for compare --truncate: the loads and the
server are replaced, or fail before any weights are read)."""

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, get_args, get_origin, get_type_hints

import pytest
import typer.main
from typer.testing import CliRunner

from conftest import Bound
from selfattn import cli, server
from selfattn.cli import app
from selfattn.errors import SelfAttnError
from selfattn.models.loading import load

LONG_NAME = "a-model-folder-" + "with-a-long-name-" * 16  # wider than any terminal


@pytest.fixture
def fake_model(monkeypatch):
    """``_load`` gives a stand-in with a long name (serve only prints it and hands it on)."""
    stand_in = SimpleNamespace(name=LONG_NAME)
    monkeypatch.setattr(cli, "_load", lambda model, checkpoint: stand_in)
    return stand_in


@pytest.fixture
def served(monkeypatch):
    """`selfattn serve` up to the start line: what it would serve on (the socket is closed)."""
    calls = {}

    def serve(model, host, sock):
        calls.update(model=model, host=host, port=sock.getsockname()[1])
        sock.close()
        return 0

    monkeypatch.setattr(server, "serve", serve)
    return calls


def test_serve_on_port_0_prints_the_port_the_system_chose(fake_model, served):
    result = CliRunner().invoke(app, ["serve", "--port", "0"])
    assert result.exit_code == 0, result.output
    assert served["port"] > 0
    url = f"http://127.0.0.1:{served['port']}/"
    assert result.stdout == f"selfattn explorer on {url} ({LONG_NAME}; Ctrl+C stops it)\n"


def test_serve_start_line_and_warning_are_one_line_each_in_a_log(fake_model, served, monkeypatch):
    """Output that is no terminal (a log, a pipe) is 80 columns to rich: the lines are not
    cut there, a URL cut in two opens nothing."""
    monkeypatch.setenv("COLUMNS", "80")

    monkeypatch.setattr(server, "listen", Bound)  # nothing listens beyond this machine
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "8123"])
    assert result.exit_code == 0, result.output
    url = "http://0.0.0.0:8123/"
    assert result.stdout.splitlines() == [
        f"selfattn explorer on {url} ({LONG_NAME}; Ctrl+C stops it)"
    ]
    assert result.stderr.splitlines() == [
        "warning: listening on 0.0.0.0: the explorer is reachable from the network, by anyone "
        "who can reach this machine (it has no login)"
    ]


def test_serve_closes_its_socket_when_the_model_fails_to_load(monkeypatch):
    """The port is listened on before the model loads (so a taken port fails fast); a load
    that fails closes it again (it stayed bound for as long as the process ran on)."""
    opened, real_listen = [], server.listen

    def listen(host, port):
        opened.append(real_listen(host, port))
        return opened[-1]

    def fails(model, checkpoint):
        raise SelfAttnError("no such model")

    monkeypatch.setattr(server, "listen", listen)
    monkeypatch.setattr(cli, "_load", fails)
    result = CliRunner().invoke(app, ["serve", "--port", "0"])
    assert result.exit_code == 1 and "no such model" in result.output
    assert opened[0].fileno() == -1  # closed


def _never_loaded(model, checkpoint):
    pytest.fail("loaded a model")


@pytest.mark.parametrize(
    "command",
    [
        ["explain", "the bank"],
        ["compare", "the bank", "a bank", "--word", "bank"],
        ["view", "the bank", "-o", "page.html"],
        ["serve"],
        ["generate", "the bank"],
    ],
)
def test_model_and_checkpoint_together_are_refused_in_one_line(command, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_load", _never_loaded)
    monkeypatch.setattr(server, "listen", lambda *args: pytest.fail("listened"))
    both = ["--model", "minilm", "--checkpoint", str(tmp_path)]
    result = CliRunner().invoke(app, [*command, *both])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "--model" in lines[0] and "--checkpoint" in lines[0]
    if command[0] != "generate":  # generate names its two kinds of model its own way
        assert "not both" in lines[0]


def test_without_model_or_checkpoint_minilm_is_loaded(monkeypatch):
    def load(name):
        return SimpleNamespace(name=name, config=SimpleNamespace(skipped=()))

    monkeypatch.setattr("selfattn.models.loading.load", load)
    assert cli._load(None, None).name == "minilm"
    assert cli._load("folder", None).name == "folder"


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_refused_in_one_line(name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # Path("") is the current folder: no config.json there
    result = CliRunner().invoke(app, ["explain", "the bank", "--model", name])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: the model name is empty ({name!r}); pass 'minilm' or a checkpoint folder "
        "('.' for the current one)"
    ]
    with pytest.raises(SelfAttnError, match="the model name is empty"):
        load(name)


def test_the_current_folder_without_a_checkpoint_is_named(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["explain", "the bank", "--model", "."])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: config.json in the current folder ({tmp_path}) is missing; the folder needs "
        "the checkpoint's config.json"
    ]


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        (["explain", "the bank", "--words", "bank"], "--words"),  # meant --word bank
        (["explain", "--words", "bank", "the bank"], "--words"),  # the text taken for "bank"
        (["explain", "the bank", "--json", "out.json"], "--json"),  # it prints, writes no file
        (["view", "the bank", "-o", "page.html", "--truncate", "more"], "--truncate"),
        # the flag followed by the word, not the flag followed by another flag
        (["explain", "the bank", "--words", "--truncate", "bank"], "--truncate"),
    ],
)
def test_a_value_after_a_flag_is_named_in_the_one_line_error(command, flag, monkeypatch):
    monkeypatch.setattr(cli, "_load", _never_loaded)
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: Got unexpected extra argument"), lines
    assert f"; {flag} is a flag and takes no value. See `" in lines[0]
    assert lines[0].endswith(f" {command[0]} --help`.")


def test_an_extra_argument_after_no_flag_names_no_flag(monkeypatch):
    monkeypatch.setattr(cli, "_load", _never_loaded)
    result = CliRunner().invoke(app, ["view", "the bank", "the river", "-o", "page.html"])
    assert result.exit_code == 2, result.output
    assert "flag" not in result.stderr and "(the river)" in result.stderr


def test_every_argument_is_shown_in_capitals_as_the_help_texts_name_it():
    """``Continue PROMPT ...``: the usage line says [PROMPT], not [prompt]."""
    commands = typer.main.get_command(app).commands
    arguments = [
        (name, param.metavar or param.name)
        for name, command in commands.items()
        for param in command.params
        if param.param_type_name == "argument"
    ]
    assert len(arguments) >= 4  # explain, compare, view, generate
    assert [shown for shown in arguments if not shown[1].isupper()] == []


def test_generate_model_help_names_every_decoder_family_the_command_takes():
    # "--model: ... decoder folder (GPT-2 family)" while the command continues with Llama,
    # Mistral and the rest too (its own description and error say so).
    option = next(
        param
        for param in typer.main.get_command(app).commands["generate"].params
        if param.name == "model"
    )
    for family in ("GPT-2", "GPT-NeoX", "Llama", "Mistral", "Qwen", "Phi-3", "Gemma"):
        assert family in option.help


# --- files and folders: empty paths, outputs checked before the model loads ---------------

MINIMAL_ARGS = {  # each command's required arguments, none of them the option tried
    "explain": ["the bank"],
    "compare": ["the bank", "a bank", "--word", "bank"],
    "view": ["the bank", "-o", "page.html"],
    "serve": [],
    "generate": ["the bank"],
    "train": ["--data", "corpus.txt", "--out", "runs"],
}


def _path_options() -> list[tuple[str, str]]:
    """(command, flag) of every option that takes a file or folder (annotated a Path)."""
    found = []
    commands = typer.main.get_command(app).commands
    for registered in app.registered_commands:
        name = registered.name or registered.callback.__name__
        hints = get_type_hints(registered.callback, include_extras=True)
        for param in commands[name].params:
            hint = hints[param.name]
            base = get_args(hint)[0] if get_origin(hint) is Annotated else hint
            if param.param_type_name == "option" and Path in (base, *get_args(base)):
                found.append((name, param.opts[-1]))
    return found


def _one_error_line(result) -> str:
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def test_every_file_or_folder_option_is_found():
    assert set(_path_options()) >= {
        ("train", "--data"), ("train", "--out"), ("generate", "--checkpoint"),
        ("generate", "--html"), ("generate", "--json"), ("explain", "--png"),
        ("explain", "--svg"), ("explain", "--html"), ("view", "--output"),
        ("serve", "--checkpoint"), ("compare", "--checkpoint"),
    }  # fmt: skip


@pytest.mark.parametrize(("command", "flag"), _path_options())
@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_path_is_refused_naming_its_option(command, flag, value, monkeypatch, tmp_path):
    """Path("") is the current folder: `train --out ""` trained into it, `generate
    --checkpoint ""` loaded it; now one line, before anything is read or written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_load", _never_loaded)
    monkeypatch.setattr(server, "listen", lambda *args: pytest.fail("listened"))
    result = CliRunner().invoke(app, [command, *MINIMAL_ARGS[command], flag, value])
    assert result.exit_code == 2, result.output
    line = _one_error_line(result)
    assert f"'{flag}'" in line and f"the path is empty ({value!r})" in line, line
    assert list(tmp_path.iterdir()) == []


def test_compare_refuses_a_single_sentence_before_the_model_loads(monkeypatch):
    monkeypatch.setattr(cli, "_load", _never_loaded)
    result = CliRunner().invoke(app, ["compare", "the bank", "--word", "bank"])
    assert result.exit_code == 2, result.output
    assert _one_error_line(result) == "Error: give at least two sentences to compare"


@pytest.mark.parametrize(
    "outputs",
    [
        ["--png", "b.png", "--html", "b.png"],
        ["--svg", "b.svg", "--html", "./b.svg"],
        ["--png", "b.png", "--svg", "b.svg", "--html", "sub/../b.svg"],
    ],
)
def test_two_outputs_naming_one_file_are_refused_before_the_model_loads(
    outputs, monkeypatch, tmp_path
):
    """--png b.png --html b.png wrote the figure, then the page over it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    monkeypatch.setattr(cli, "_load", _never_loaded)
    result = CliRunner().invoke(app, ["explain", "the bank", "--word", "bank", *outputs])
    assert result.exit_code == 2, result.output
    line = _one_error_line(result)
    assert " both name " in line and line.endswith("; give each its own file"), line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["sub"]


@pytest.mark.parametrize(
    ("flag", "name", "problem"),
    [
        ("--png", "b.txt", "does not end in .png"),
        ("--png", ".png", "has no name before .png"),  # it said "needs ... ending in .png"
        ("--svg", "sub/.SVG", "has no name before .svg"),
    ],
)
def test_a_figure_without_its_suffix_is_refused_saying_what_it_lacks(
    flag, name, problem, monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_load", _never_loaded)
    result = CliRunner().invoke(app, ["explain", "the bank", "--word", "bank", flag, name])
    assert result.exit_code == 2, result.output
    suffix = flag.replace("--", ".")
    assert _one_error_line(result) == (
        f"Error: {flag} {name}: the file name {problem}; give one such as bank{suffix}"
    )


def test_an_existing_writable_file_is_taken_whatever_its_folder_allows(monkeypatch, tmp_path):
    """An existing file is written in place: /dev/stdout, /dev/null or a file of a folder that
    takes no new one are writable outputs (the folder check refused them to a non-root user).
    The folder's refusal is played by a TemporaryFile that fails."""

    def no_new_file(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli.tempfile, "TemporaryFile", no_new_file)
    existing = tmp_path / "g.json"
    existing.write_text("")
    cli._check_outputs((existing, "--json"), (Path(os.devnull), "--html"))
    with pytest.raises(typer.Exit):
        cli._check_outputs((tmp_path / "new.json", "--json"))


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    ("command", "outputs", "flag"),
    [
        (["explain", "the bank"], ["--png", "b.png", "--html", "/proc/b.html"], "--html"),
        (["view", "the bank"], ["-o", "/proc/b.html"], "--output"),
        (
            ["generate", "ROMEO", "--model", "m"],
            ["--json", "g.json", "--html", "/proc/g.html"],
            "--html",
        ),
    ],
)
def test_an_output_folder_that_takes_no_file_is_refused_before_the_model_loads(
    command, outputs, flag, monkeypatch, tmp_path
):
    """/proc takes no new file: that was found when writing, after the model had run and the
    other outputs were written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_load", _never_loaded)
    result = CliRunner().invoke(app, [*command, *outputs])
    assert result.exit_code == 2, result.output
    line = _one_error_line(result)
    assert line.startswith(f"Error: cannot write {outputs[-1]}: its folder /proc "), line
    assert line.endswith(f"; give {flag} a file in another folder"), line
    assert list(tmp_path.iterdir()) == []


# --- compare --truncate -----------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    return load("minilm")


def test_compare_notes_each_sentence_truncate_cut(minilm, monkeypatch):
    """explain and view said where --truncate cut the text; compare said nothing, and showed
    (and gave in --json) the whole sentence, of which the model had read only a part."""
    monkeypatch.setattr(cli, "_load", lambda model, checkpoint: minilm)
    long = " ".join(["the bank by the river"] * 110)  # 552 words: past 512 tokens
    args = ["compare", "a bank", long, "--word", "bank", "--truncate", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    short, read = json.loads(result.stdout)["sentences"]
    assert short == "a bank" and long.startswith(read) and len(read) < len(long)
    assert result.stderr.splitlines() == [
        "note: sentence 2 was cut to the model's 512 tokens (--truncate): its first "
        f"{len(read):,} of {len(long):,} characters"
    ]


def test_a_figures_suffix_is_taken_in_any_case(minilm, monkeypatch, tmp_path):
    """--png B.PNG and --svg b.Svg name a PNG and an SVG figure (save_figure reads the
    suffix in any case, and so does the check before the model loads)."""
    monkeypatch.setattr(cli, "_load", lambda model, checkpoint: minilm)
    png, svg = tmp_path / "B.PNG", tmp_path / "b.Svg"
    args = ["explain", "the bank", "--word", "bank", "--png", str(png), "--svg", str(svg)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in svg.read_text()


# --- numbers: train's whole numbers, generate's seed and layer --------------------------


def _integer_train_flags() -> list[str]:
    hints = get_type_hints(cli.train, include_extras=True)
    params = typer.main.get_command(app).commands["train"].params
    return [param.opts[-1] for param in params if int in get_args(get_args(hints[param.name])[0])]


@pytest.fixture
def train_settings(monkeypatch) -> dict:
    """`selfattn train` up to training: the overrides it would train with."""
    given = {}

    def train_decoder(data, out, *, overrides, **rest):
        given.update(overrides)
        raise SelfAttnError("stopped before training")

    monkeypatch.setattr("selfattn.train.train_decoder", train_decoder)
    return given


def test_train_takes_whole_numbers_written_as_floats(train_settings):
    """The README: 5e3 is taken as 5000 (as train_decoder takes max_iters=5e3); the command
    line said "Input should be a valid integer"."""
    flags = _integer_train_flags()
    assert {"--max-iters", "--seed", "--n-layer", "--eval-interval"} <= set(flags)
    args = ["train", "--data", "corpus.txt", "--out", "runs"]
    values = ["5e3", "5000.0", "5000", " 1_000 ", "-0.0", "1E2"]
    expected = [5000, 5000, 5000, 1000, 0, 100]
    for value, number in zip(values, expected, strict=True):
        train_settings.clear()
        result = CliRunner().invoke(app, [*args, "--max-iters", value, "--seed", value])
        assert result.stderr == "Error: stopped before training\n", result.output
        assert train_settings == {"max_iters": number, "seed": number}
        assert type(train_settings["max_iters"]) is int


@pytest.mark.parametrize("flag", _integer_train_flags())
@pytest.mark.parametrize("value", ["2.5", "inf", "ten"])
def test_train_refuses_a_number_that_is_not_whole_naming_the_flag(flag, value, train_settings):
    args = ["train", "--data", "corpus.txt", "--out", "runs", flag, value]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert _one_error_line(result) == (
        f"Error: Invalid value for '{flag}': {value} must be a whole number (5e3 and 5000.0 "
        "are taken as 5000). See `root train --help`."  # root: the test runner's name
    )
    assert train_settings == {}


def test_generate_seeds_are_the_explorers_checked_before_the_model_loads(monkeypatch):
    """--seed 1e23 was "Overflow when unpacking long long" after loading, --seed -1 taken
    (torch wraps it), while the explorer's POST /api/generate takes 0..2**32-1."""
    bound = server.GenerateRequest.model_fields["seed"].metadata  # the API's le=
    assert cli.MAX_SAMPLING_SEED == 2**32 - 1 and any(
        getattr(item, "le", None) == 2**32 - 1 for item in bound
    )
    monkeypatch.setattr(cli, "_load", _never_loaded)
    for seed in ["-1", "4294967296", "99999999999999999999999"]:
        result = CliRunner().invoke(app, ["generate", "ROMEO", "--model", "m", "--seed", seed])
        assert result.exit_code == 2, result.output
        assert _one_error_line(result) == (
            f"Error: --seed {seed} is out of range; choose one between 0 and 4294967295"
        )
    sampled = {}

    def generate(prompt, new_tokens, **sampling):
        sampled.update(sampling)
        return "!"

    stand_in = SimpleNamespace(generate=generate)
    monkeypatch.setattr(cli, "_load", lambda model, checkpoint: stand_in)
    for seed in [0, 2**32 - 1]:
        result = CliRunner().invoke(app, ["generate", "ROMEO", "--model", "m", "--seed", str(seed)])
        assert result.exit_code == 0 and result.stdout == "ROMEO!\n", result.output
        assert sampled["seed"] == seed


@pytest.mark.parametrize(
    ("command", "option", "message"),
    [
        (["explain", "the bank"], ["--layer", "-1"], "--layer must be 0 or more"),
        (["generate", "ROMEO", "--html", "g.html"], ["--layer", "-1"], "--layer must be 0 or more"),
        (["explain", "the bank"], ["--head", "-2"], "heads are numbered from 0"),
        (["generate", "ROMEO", "--html", "g.html"], ["--head", "-1"], "heads are numbered from 0"),
        (["explain", "the bank"], ["--index", "-1"], "--index must be 0 or more"),
    ],
)
def test_layers_and_heads_count_from_0_on_every_command(
    command, option, message, monkeypatch, tmp_path
):
    """explain refused --layer -1 (once the model had run), generate read it from the end:
    both refuse it now, before the model loads, as the help's "(0 = first)" says; so is
    explain's --index -1 (it was status 1, after the model had loaded and run)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_load", _never_loaded)
    result = CliRunner().invoke(app, [*command, "--model", "m", *option])
    assert result.exit_code == 2, result.output
    assert message in _one_error_line(result)


def test_version_prints_the_installed_packages_version():
    """`selfattn --version` (and `selfattn.__version__`) say the installed distribution's
    version, as pip lists it; it used to be "No such option: --version"."""
    import importlib.metadata

    import selfattn

    installed = importlib.metadata.version("selfattn")
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"selfattn {installed}\n"
    assert selfattn.__version__ == installed


@pytest.mark.parametrize("args", [["-h"], ["explain", "-h"], ["train", "-h"]])
def test_minus_h_is_help_as_in_most_commands(args):
    # It was "No such option: -h" (exit 2).
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == CliRunner().invoke(app, [*args[:-1], "--help"]).stdout


def test_a_write_that_fails_midway_leaves_the_file_that_was_there(tmp_path):
    """A full disk (or Ctrl-C) halfway through --html replaced a good page with half of one;
    the output is now written beside it and renamed over it once whole."""
    page = tmp_path / "bank.html"
    page.write_text("the page from before")

    def half_then_full(path: Path) -> None:
        path.write_text("<!doctype html><html><head>")
        raise OSError(28, "No space left on device")

    with pytest.raises(typer.Exit):
        cli._write(page, half_then_full)
    assert page.read_text() == "the page from before"
    cli._write(page, lambda path: path.write_text("the new page"))
    assert page.read_text() == "the new page"
    assert [entry.name for entry in tmp_path.iterdir()] == ["bank.html"]  # no half file left


def test_a_file_in_a_folder_that_takes_no_new_one_is_still_written_in_place(monkeypatch, tmp_path):
    """_check_outputs lets such a file through (test above); its write then cannot go beside
    it, and goes in place. The folder's refusal is played by a touch that fails."""
    page = tmp_path / "bank.html"
    page.write_text("the page from before")

    def no_new_file(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "touch", no_new_file)
    cli._write(page, lambda path: path.write_text("the new page"))
    assert page.read_text() == "the new page"


class TextsRun:
    """A stand-in model that keeps the texts it is asked to run, and stops the command at the
    first but compare's first sentence."""

    name = "stand-in"

    def __init__(self) -> None:
        self.texts: list[str] = []

    def run(self, text: str, truncate: bool = False):
        self.texts.append(text)
        if text != "I sat on the bank.":
            raise SelfAttnError("stand-in stops here")


@pytest.mark.parametrize(
    "command",
    [
        ["explain", "-", "--word", "bank"],
        ["view", "-", "-o", "page.html"],
        ["compare", "I sat on the bank.", "-", "--word", "bank"],
    ],
)
def test_a_text_given_as_dash_is_read_from_the_standard_input(command, monkeypatch, tmp_path):
    """`echo … | selfattn explain - …`: the text comes from the pipe, whole (more than a
    command line takes, and one that starts with "-"), its final line break dropped."""
    monkeypatch.chdir(tmp_path)
    stand_in = TextsRun()
    monkeypatch.setattr(cli, "_load", lambda model, checkpoint: stand_in)
    piped = "-the bank of the river " * 20_000  # 460 KB, past a command line's 128 KB per word
    result = CliRunner().invoke(app, command, input=piped.encode() + b"\r\n")
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: ") and "stand-in stops here" in result.output
    assert stand_in.texts[-1] == piped


def test_generate_takes_its_prompt_from_the_standard_input(monkeypatch):
    prompts = []
    stand_in = SimpleNamespace(
        generate=lambda prompt, max_new_tokens, **sampling: prompts.append(prompt) or " more"
    )
    monkeypatch.setattr(cli, "_load", lambda model, checkpoint: stand_in)
    result = CliRunner().invoke(
        app,
        ["generate", "--checkpoint", "run", "-", "--max-new-tokens", "2"],
        input="\ufeffTo be\n",
    )
    assert result.exit_code == 0, result.output
    assert (prompts, result.output) == (["To be"], "To be more\n")  # the byte-order mark dropped


@pytest.mark.parametrize(
    ("command", "given", "message"),
    [
        (["compare", "-", "-", "--word", "bank"], b"a bank", 'only one text can be "-"'),
        (["explain", "-", "--word", "bank"], b"the bank \xff", "is not UTF-8 text (byte 9)"),
    ],
)
def test_the_standard_input_read_twice_or_not_text_is_one_line(
    command, given, message, monkeypatch
):
    monkeypatch.setattr(cli, "_load", lambda model, checkpoint: TextsRun())
    result = CliRunner().invoke(app, command, input=given)
    assert result.exit_code in (1, 2)
    assert result.output.startswith("Error: ") and message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_ctrl_c_while_the_command_exits_is_no_traceback():
    """The command's work done and said, a Ctrl-C as the interpreter exits (a repeated one
    after training's "Interrupted at step …" line) met torch's exit handlers: a traceback
    and the status -2. Here the signal comes from an exit handler, as late as it can."""
    import subprocess
    import sys

    script = (
        "import atexit, os, signal, sys\n"
        "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
        "sys.argv = ['selfattn', '--version']\n"
        "from selfattn.cli import main\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("selfattn ")
