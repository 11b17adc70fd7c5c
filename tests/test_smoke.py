"""The worked example (its numbers, its six steps and its layout), and the README as a newcomer
runs it: its Python examples and what their comments show, its commands and their options.

Tolerances: the trace against the closed form, 1e-12; printed numbers against numpy, half a
unit in their last printed digit (they are rounded to 3 decimals); a number in a README comment,
to the digits it shows.
"""

import ast
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import typer.main
from rich.cells import cell_len
from typer.testing import CliRunner

from selfattn.cli import app
from selfattn.examples import CIAO_EMBEDDINGS, ciao_steps, ciao_trace
from selfattn.viz.terminal import matrix_table

# Ciao (1,0,1,0), gioco (0,2,0,2), a (1,1,0,0), giochi (0,1,0,3), as the guide's example sets them.
HAND_EMBEDDINGS = np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 0, 0], [0, 1, 0, 3]], float)
STEP_HEADINGS = (
    "1. embeddings",
    "2. scores",
    "3. scaled",
    "4. weights",
    "5. output",
    "6. Query, Key, Value",
)


def hand_steps() -> dict[str, np.ndarray]:
    """Steps 2-5 in numpy, independent of the library: Q = K = V = the embeddings."""
    scores = HAND_EMBEDDINGS @ HAND_EMBEDDINGS.T
    scaled = scores / math.sqrt(4)  # d_k = 4
    exp = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    weights = exp / exp.sum(axis=1, keepdims=True)
    return {
        "scores": scores,
        "scaled": scaled,
        "weights": weights,
        "output": weights @ HAND_EMBEDDINGS,
    }


def demo_output() -> str:
    result = CliRunner().invoke(app, ["demo"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def printed_tables(output: str) -> list[np.ndarray]:
    """Every table of the demo as numbers, in print order (rows of the form │ name │ 1.0 │ ...)."""
    tables, rows = [], []
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip("│ ").split("│")]
        if line.startswith("│") and len(cells) > 1:
            rows.append([float(cell) for cell in cells[1:]])
        elif rows:
            tables.append(np.array(rows))
            rows = []
    return tables


def test_ciao_steps_follow_the_formula():
    # Q = K = V = the embeddings. Their dot products, worked out by hand from the four vectors:
    scores = torch.tensor(
        [[2, 0, 1, 0], [0, 8, 2, 8], [1, 2, 2, 1], [0, 8, 1, 10]], dtype=torch.float64
    )
    scaled = scores / math.sqrt(4)  # d_k = 4
    weights = torch.exp(scaled) / torch.exp(scaled).sum(-1, keepdim=True)
    trace = ciao_trace()
    torch.testing.assert_close(trace.scores, scores, atol=1e-12, rtol=0)
    torch.testing.assert_close(trace.weights, weights, atol=1e-12, rtol=0)
    torch.testing.assert_close(trace.output, weights @ CIAO_EMBEDDINGS, atol=1e-12, rtol=0)


def test_the_output_step_names_the_other_word_giochi_weighs_most():
    # Row "giochi" scores 0, 8, 1, 10 by hand (above): after itself, it weighs "gioco" most,
    # and step 5 says the output holds some of that word, not of "giochi" itself.
    meaning = " ".join(ciao_steps()[4].meaning.split())
    assert 'now holding some of "gioco".' in meaning


def test_demo_prints_the_six_steps_of_the_guide_in_order():
    output = demo_output()
    positions = [output.find(heading) for heading in STEP_HEADINGS]
    assert -1 not in positions, dict(zip(STEP_HEADINGS, positions, strict=True))
    assert positions == sorted(positions)


def test_every_printed_number_matches_a_hand_computation():
    embeddings, scores, scaled, weights, output = printed_tables(demo_output())
    hand = hand_steps()
    np.testing.assert_allclose(embeddings, HAND_EMBEDDINGS, atol=0.05)
    for name, printed in zip(hand, (scores, scaled, weights, output), strict=True):
        np.testing.assert_allclose(printed, hand[name], atol=5e-4, err_msg=name)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=4 * 5e-4)


def test_each_step_says_what_it_means_with_its_numbers():
    text = " ".join(demo_output().split())  # words as read, whatever the line wrapping
    hand = hand_steps()
    giochi = 3
    unscaled = np.exp(hand["scores"][giochi]) / np.exp(hand["scores"][giochi]).sum()
    meanings = [
        "position information",  # step 1: what a real model adds
        # step 2: what Q and K are before step 6 names them
        "(the query, a row of Q) against every token (the keys, rows of K); here Q = K = X",
        'Row "giochi": 10 with "giochi", 8 with "gioco", 1 with "a", 0 with "Ciao"',
        "selfattn explain --similarity cosine",  # where to try it on a real model
        "√d_k = √4 = 2",  # step 3: why and by how much
        f"keep {unscaled[giochi]:.2f} of its attention for itself after step 4, "
        f"with it {hand['weights'][giochi, giochi]:.2f}",
        "how much the query (row) takes from the key (column)",  # step 4
        'Row "giochi": 0.72 from "giochi", 0.27 from "gioco", 0.01 from "a", 0.00 from "Ciao"',
        '"giochi" (0, 1, 0, 3) becomes (0.01, 1.26, 0.00, 2.70)',  # step 5
        "Q = X W_q, K = X W_k, V = X W_v",  # step 6
        "Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V",
    ]
    missing = [meaning for meaning in meanings if meaning not in text]
    assert not missing


def test_demo_fits_80_columns_and_has_no_colour_codes_in_a_pipe():
    output = demo_output()
    assert "\x1b[" not in output
    assert "…" not in output  # no cell cut short
    assert max(cell_len(line.rstrip()) for line in output.splitlines()) <= 80
    assert output.count("rows: queries, columns: keys") == 3  # scores, scaled, weights


def test_matrix_table_takes_plain_lists_and_checks_the_shape():
    table = matrix_table([[0.25, 0.75], [1.0, 0.0]], ["a", "b"], ["a", "b"], "weights")
    assert [list(column.cells) for column in table.columns[1:]] == [
        ["0.250", "1.000"],
        ["0.750", "0.000"],
    ]
    with pytest.raises(ValueError, match=r"shape \(rows, columns\) = \(2, 3\)"):
        matrix_table(np.zeros((2, 2)), ["a", "b"], ["a", "b", "c"], "weights")


# --- The README, as a newcomer runs it -----------------------------------------------------

README = Path(__file__).parents[1] / "README.md"
# Flags the README gives to other programs: ruff (make format/lint), pip, torchrun, benchmarks.
NOT_OURS = {"--check", "--fix", "--help", "--no-deps", "--nproc_per_node", "--quick"}
FLAG = r"(?<![\w-])(--?[A-Za-z][\w-]*)"


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def cli_help(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def has_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def cli_commands() -> list[str]:
    return list(typer.main.get_command(app).commands)


def commented_results(block: str, namespace: dict) -> list[tuple[object, str]]:
    """Run a README code block statement by statement; (value, comment) for each expression
    statement whose line ends in a comment, as the README shows it."""
    lines = block.splitlines()
    results = []
    for statement in ast.parse(block).body:
        if isinstance(statement, ast.Expr):
            value = eval(compile(ast.Expression(statement.value), "README.md", "eval"), namespace)
            comment = lines[statement.lineno - 1].partition("  #")[2].strip()
            if comment:
                results.append((value, comment))
        else:
            exec(compile(ast.Module([statement], []), "README.md", "exec"), namespace)
    return results


def check_comment(value: object, comment: str, namespace: dict) -> bool:
    """Whether the comment makes a claim this test checks (a shape, a number, a token list,
    "0.65 on "deposit""); assert it holds."""
    if shape := re.match(r"\((\d+(?:, \d+)*)\)", comment):
        assert tuple(value.shape) == tuple(map(int, shape[1].split(", "))), comment
    elif number := re.fullmatch(r"-?\d+\.(\d+)", comment):
        assert round(float(value), len(number[1])) == float(comment), (float(value), comment)
    elif weight := re.search(r"(\d+\.(\d+)) on \"(\w+)\"", comment):
        got = float(value[namespace["run"].token_index(weight[3])])
        assert round(got, len(weight[2])) == float(weight[1]), (got, comment)
    elif listed := re.match(r"(\[.*), \.\.\.\]", comment):
        prefix = ast.literal_eval(listed[1] + "]")
        assert list(value[: len(prefix)]) == prefix, (value, comment)
    else:
        return False
    return True


def readme_python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", readme_text(), re.S | re.M)


def is_torchrun_script(block: str) -> bool:
    """Whether the block is a script to launch with torchrun (its first line says so)."""
    return "run with: torchrun" in block.split("\n", 1)[0]


def test_readme_python_examples_run_and_show_what_their_comments_say():
    # Every ```python block, in order, in one namespace (the record() block reuses the first's
    # imports), on the real default model; each shape, number and token list in a comment holds.
    # A script for torchrun runs under torchrun instead (tests/test_ring.py).
    blocks = [block for block in readme_python_blocks() if not is_torchrun_script(block)]
    assert len(blocks) >= 3
    namespace: dict = {}
    checked = [
        comment
        for block in blocks
        for value, comment in commented_results(block, namespace)
        if check_comment(value, comment, namespace)
    ]
    assert len(checked) >= 7, checked  # the claims above were found, not silently skipped


def test_readme_documents_every_command_and_only_options_that_exist():
    text = readme_text()
    helps = {name: cli_help(name) for name in cli_commands()}
    undocumented = set(helps) - set(re.findall(r"selfattn (\w+)", text))
    assert not undocumented, "commands the README never shows as `selfattn NAME`"
    assert all(name in cli_help() for name in helps)

    # Every invocation, in shell blocks (continuation lines joined) and in inline code: its
    # command exists and takes each of its flags.
    shell = re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    lines = [ln for block in shell for ln in block.replace("\\\n", " ").splitlines()]
    lines += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    invocations = 0
    for line in lines:
        for call in re.finditer(r"(?:^|\s)selfattn (\w+)([^#]*)", line):
            command, rest = call[1], re.sub(r'"[^"]*"', "", call[2])
            assert command in helps, f"unknown command in the README: {line}"
            for flag in re.findall(FLAG, rest):
                assert has_flag(helps[command], flag), f"selfattn {command} has no {flag}: {line}"
            invocations += 1
    assert invocations >= 15, invocations

    # The explain table: each flag is explain's, and the commands a row names "take it too".
    explain = text.split("## Explain", 1)[1].split("\n## ", 1)[0]
    for row in re.findall(r"^\| `-.*", explain, re.M):
        first, described = row.split(" | ", 1)
        also = re.search(r"\(((?:`\w+`(?:, | and )?)+) take (?:it|them) too\)", described)
        for command in ["explain", *re.findall(r"`(\w+)`", also[1] if also else "")]:
            for flag in re.findall(FLAG, first):
                assert has_flag(helps[command], flag), f"selfattn {command} has no {flag}"

    # Any other flag the README names belongs to some command, or to selfattn itself.
    every_help = [cli_help(), *helps.values()]
    unknown = {
        flag
        for flag in re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", text)
        if flag not in NOT_OURS and not any(has_flag(h, flag) for h in every_help)
    }
    assert not unknown


def printed(*args: str) -> str:
    """What ``selfattn ARGS`` prints, its words as read whatever the line wrapping."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split())


def test_readme_explain_and_compare_numbers_are_what_the_commands_print():
    text = " ".join(readme_text().split())
    explain = text.split("## Explain", 1)[1].split("### View", 1)[0]
    sentence = re.search(r'selfattn explain "([^"]+)" --word bank', explain)[1]
    bank = printed("explain", sentence, "--word", "bank")
    scale = re.search(r"printed as (\d\.\d+)", explain)[1]
    top = re.search(r"top attended words \(`([^`]+)`", explain)[1]
    assert f"scaled by {scale}," in bank and f"top attended: {top}" in bank
    layer, head, content, deposit = re.search(
        r'here layer (\d+), head (\d+), where "bank" puts (\d\.\d+) of its weight on other '
        r'content words, (\d\.\d+) on "deposit"',
        explain,
    ).groups()
    chosen = f"layer {layer}, head {head} (chosen: 'bank' puts the most weight here, "
    assert f"{chosen}{content}, on other content words" in bank
    assert f"deposit {deposit}" in bank
    river_text, river_weight = re.search(
        r'in "([^"]+)" it picks the same head, with (\d\.\d+) on "river"', explain
    ).groups()
    river = printed("explain", river_text, "--word", "bank")
    assert chosen in river and f"river {river_weight}" in river

    command = re.search(r"selfattn compare (.*?) --word bank", explain)[1]
    cosine = json.loads(
        printed("compare", *re.findall(r'"([^"]+)"', command), "--word", "bank", "--json")
    )["layers"][-1]["cosine"]
    quoted = re.search(
        r"stay closer \((\d\.\d+) at the last layer\) than a money bank and a river bank "
        r"\((\d\.\d+) and (\d\.\d+)\)",
        explain,
    ).groups()
    shown = [f"{cosine[0][1]:.2f}", f"{cosine[0][2]:.2f}", f"{cosine[1][2]:.2f}"]
    assert list(quoted) == shown


def test_make_help_and_the_readme_list_every_make_target():
    """Every target the Makefile declares (.PHONY) has its line in `make help` and its row in
    the README's Developing table; `browser` had neither."""
    makefile = (README.parent / "Makefile").read_text(encoding="utf-8")
    targets = set(re.search(r"^\.PHONY: (.*)$", makefile, re.M)[1].split()) - {"help"}
    listed = set(re.findall(r'^\t@echo "  ([\w-]+) ', makefile, re.M))
    documented = set(re.findall(r"^\| `make ([\w-]+)` \|", readme_text(), re.M))
    assert targets == listed == documented, (targets, listed, documented)
