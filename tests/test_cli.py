"""The command line's choices of model and its serve start lines (no model is loaded: the
loads and the server are replaced, or fail before any weights are read)."""

from types import SimpleNamespace

import pytest
import typer.main
from typer.testing import CliRunner

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


class Bound:
    """What `server.listen` returns, without binding anything: the address asked for."""

    def __init__(self, host: str, port: int) -> None:
        self.address = (host, port)

    def getsockname(self) -> tuple[str, int]:
        return self.address

    def close(self) -> None:
        pass


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
