"""The explain and compare reports: an Explanation or Comparison as terminal, figure or page."""

from __future__ import annotations

import html
from collections.abc import Sequence
from functools import partial
from itertools import combinations
from pathlib import Path

import torch
from rich.console import Console, Group
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from torch import Tensor

from selfattn.attention import default_scale
from selfattn.errors import worded
from selfattn.explain import (
    AS_ASKED,
    Attended,
    Comparison,
    Explanation,
    RecordedRun,
    Steps,
    adds_bias,
    content_tokens,
    key_labels,
    merge_words,
    stacked_qkv,
    top_keys,
)
from selfattn.recording import Capture
from selfattn.text import is_mark
from selfattn.viz.html import page_payload, render_page
from selfattn.viz.terminal import (
    RowTable,
    as_numpy,
    heatmap,
    printable,
    scale_formula,
    step_table,
    weights_bars,
    written_scale,
)

OUTPUT_DIMS = 8  # how many output dimensions to print


def _where(e: Explanation) -> str:
    head = "mean of heads" if e.head is None else f"head {e.head}"
    return f"layer {e.layer}, {head}"


WHITESPACE_SIGNS = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"})


def shown(tokens: list[str]) -> list[str]:
    """Tokens as printed: one made only of whitespace (character-level models) made visible,
    control characters in the others written out (:func:`printable`)."""
    return [
        token.translate(WHITESPACE_SIGNS) if not token.strip() else printable(token)
        for token in tokens
    ]


def _labels(e: Explanation) -> tuple[list[str], object]:
    """Labels and matrix of the heatmap: tokens, or words when merged, each as the lists of
    keys name it (an unknown one by its text: '🙂' ([UNK]))."""
    if e.groups is None:
        return shown(e.key_names), e.attention
    return shown(e.word_names), merge_words(e.attention, [m for _, m in e.groups])


def _first_tokens(e: Explanation) -> list[int] | None:
    """The token index of each label of :func:`_labels`: None for tokens (their places)."""
    return None if e.groups is None else [members[0] for _, members in e.groups]


HEADLINE_CHARS = 160  # longer texts are cut short in the header (every token is listed below)


def _headline(e: Explanation) -> str:
    """The text for the header, printable: whole, or its start (to a space, or, without one,
    before a character whose combining marks would be cut from it) and how long it is."""
    if len(e.text) <= HEADLINE_CHARS:
        return printable(e.text, keep="\n\t")
    end = HEADLINE_CHARS
    while end > 0 and is_mark(e.text[end]):
        end -= 1
    start = printable(e.text[:end].rsplit(" ", 1)[0], keep="\n\t")
    return f"{start} … ({len(e.text):,} characters, {len(e.tokens)} tokens)"


def print_explanation(console: Console, e: Explanation) -> None:
    """Everything explain shows in the terminal, in the order of the steps."""
    header = Text.assemble(
        ("model ", "dim"), (e.model, "bold"), ("   text ", "dim"), (_headline(e), "bold"), "\n",
        (_where(e), "bold cyan"), (f"   ({printable(e.choice)})", "dim"),
    )  # fmt: skip
    console.print(Panel(header, title="selfattn explain", expand=False))
    labels = shown(e.tokens)
    tokens = Text()
    for i, token in enumerate(labels):
        style = "bold reverse" if i == e.query else ""
        tokens.append(f"{i}:{token}", style=style)
        tokens.append("  ")
    console.print(Text("tokens  ", style="dim") + tokens)
    if e.query is None:
        console.print("[dim]pass --word W or --index I to see one word's steps[/]")
    keys = key_labels(shown(e.key_names))

    if e.steps is not None:
        steps = e.steps
        console.print(
            Text(
                f"\nquery {e.query} {_query_name(e, labels)}{_query_note(e)}: similarity "
                f"({steps.similarity}) with every key, scaled by {_scaled_by(steps)}, "
                f"{'plus the position bias, ' if steps.bias is not None else ''}softmax to weights",
                style="bold",
            )
        )
        scaled = steps.scaled.masked_fill(e.masked[e.query], float("-inf"))
        scale = written_scale(steps.scale, steps.similarity, steps.key_width)
        console.print(_step_table(keys, steps, scaled, scale))
        _print_masked_note(console, e)
        console.print(
            Text.assemble(
                ("top attended: ", "bold"), _listed(top_keys(shown(e.key_names), steps.weights))
            )
        )
        output = steps.output
        own = float(steps.weights[e.query])
        dims = ", ".join(
            f"{x:+.3f}" if round(x, 3) else "+0.000" for x in output[:OUTPUT_DIMS].tolist()
        )
        console.print(
            f"[bold]output[/] = weights @ values: {output.shape[-1]} dims [{dims}, …], "
            f"norm {float(output.norm()):.3f}; it keeps {own:.1%} of the weight on itself "
            "(this head's part, before the output projection joins the heads)"
        )
        if e.recorded_output is not None:
            gap = float((e.recorded_output.double() - output.double()).abs().max())
            console.print(f"[dim]same as the model's own fast path: max difference {gap:.1e}[/]")
        if e.alternative is not None:
            console.print(_alternative_table(e, keys))
    elif e.query is not None:
        console.print(weights_bars(keys, e.weights, f"{_query_name(e, labels)}, {_where(e)}"))
        if _query_note(e):
            console.print(Text(_query_note(e).strip(), style="dim"))
        _print_masked_note(console, e)
        console.print("[dim]the step-by-step needs one head: pass --head N[/]")

    labels, matrix = _labels(e)
    if e.groups is not None and e.query is not None:
        row = _query_row(e)
        word, pieces = e.groups[row]
        named = e.name(shown([word])[0], pieces)
        words = key_labels(labels, _first_tokens(e))
        how = f"; its row the mean of its {len(pieces)} pieces' rows" if len(pieces) > 1 else ""
        title = f"{named} by word (pieces merged: keys summed{how})"
        console.print(weights_bars(words, matrix[row], title))
    title = f"attention, {_where(e)}{_causal_note(e)}"
    more = "a wider terminal, --png, --svg or --html shows them all"
    console.print(heatmap(labels, labels, matrix, title, focus=_query_row(e), more=more))


def _step_table(keys: list[str], steps: Steps, scaled: Tensor, scale: str) -> RowTable:
    """The query's steps per key; with a position bias (MPNet), a "+ bias" column before the
    weights, which are softmax(scaled + bias)."""
    table = step_table(keys, steps.scores, scaled, steps.weights, scale)
    if steps.bias is None:
        return table
    *before, weights = table.columns.items()
    columns = dict([*before, ("+ bias", as_numpy(steps.bias)), weights])
    caption = (
        table.caption.replace("softmax(scaled)", "softmax(scaled + bias)")
        + "\nbias: the model's relative position bias, learned per head and bucket of distances"
    )
    return RowTable(keys, columns, "score → scaled → + bias → weight", caption)


def _scaled_by(steps: Steps) -> str:
    """The scale as the query line says it: "0.1768, which is 1/√d_k = 1/√32" where it is the
    default for the similarity, else the number alone."""
    formula = scale_formula(steps.scale, steps.similarity, steps.key_width)
    return f"{steps.scale:.5g}" + (f", which is {formula}" if formula else "")


def _print_masked_note(console: Console, e: Explanation) -> None:
    """Say which keys the query may not attend, and why their weight is 0: in a decoder, the
    keys after it (the causal mask) and those before a sliding window (Mistral's)."""
    keys = e.masked_keys
    if not e.causal:
        reasons = [(keys, "masked")]
    else:
        reasons = [
            ([key for key in keys if key < e.query], "before the query's sliding window"),
            (
                [key for key in keys if key > e.query],
                "after the query: a decoder may not look ahead (causal mask)",
            ),
        ]
    for masked, why in reasons:
        if masked:
            console.print(
                f"[dim]masked: {_key_range(masked)}, {why}; scaled set to -inf, so weight 0[/]"
            )


def _key_range(keys: list[int]) -> str:
    """ "key 3", "keys 4..9" for a run, else "keys 1, 5, 7"."""
    if len(keys) == 1:
        return f"key {keys[0]}"
    if keys == list(range(keys[0], keys[-1] + 1)):
        return f"keys {keys[0]}..{keys[-1]}"
    return "keys " + ", ".join(map(str, keys))


def _causal_note(e: Explanation) -> str:
    """The heatmap title's note for a decoder: what its empty upper triangle means, and its
    empty lower corner where a sliding window (Mistral's) masks the keys before it."""
    if not e.causal:
        return ""
    window = ", and those before its sliding window" if e.masked.tril(-1).any() else ""
    return f"; causal: each query sees keys up to itself, later ones masked{window}"


def _listed(attended: list[Attended]) -> str:
    """Attended keys as a line, "deposit 0.68, 9:river 0.07" (an index where a name repeats)."""
    return ", ".join(f"{printable(key.label)} {key.weight:.2f}" for key in attended)


def _query_name(e: Explanation, labels: list[str]) -> str:
    """The query token as quoted: 'bank', or '🙂' ([UNK]) by the text an unknown one stands for."""
    return printable(e.name(labels[e.query], [e.query]))


def _query_note(e: Explanation) -> str:
    """What the query token is of the text asked for: the first token of a phrase (the model
    reads several words), and the piece of its word when the tokenizer split the word."""
    notes = [e.phrase_note] if e.phrase_note is not None else []
    if e.piece_note is not None:
        merged = "merged by word below" if e.groups is not None else "--words merges them"
        notes.append(f"{e.piece_note}; {merged}")
    return printable(f" ({'; '.join(notes)})") if notes else ""


def _alternative_table(e: Explanation, keys: list[str]) -> Table:
    own, alt = e.steps, e.alternative
    table = Table(
        title="the same head, recomputed",
        caption="entropy: 0 bits = all weight on one key; higher = spread out",
    )
    table.add_column("key", style="bold")
    for whose, steps in (("model", own), ("yours", alt)):
        scale = written_scale(steps.scale, steps.similarity, steps.key_width)
        table.add_column(f"{whose}: {steps.similarity}, scale {scale}", justify="right")
    for key, a, b in zip(keys, own.weights.tolist(), alt.weights.tolist(), strict=True):
        table.add_row(Text(key), f"{a:.3f}", f"{b:.3f}")
    table.add_section()
    own_bits, alt_bits = f"{own.entropy:.3f}", f"{alt.entropy:.3f}"
    table.add_row("entropy (bits)", own_bits, f"{alt_bits} ({_verdict(own_bits, alt_bits)})")
    return table


def _verdict(own_bits: str, alt_bits: str) -> str:
    """The recomputed weights against the model's, by their entropies as printed: sharper
    (lower), flatter (higher), or the same where the printed digits are."""
    if alt_bits == own_bits:
        return "the same"
    return "sharper" if float(alt_bits) < float(own_bits) else "flatter"


def save_heatmap(e: Explanation, path: Path) -> Path:
    """The explained layer/head as a paper-ready PNG or SVG heatmap; each token or word
    labelled as the lists of keys name it (an unknown one by its text: '🙂' ([UNK]))."""
    from selfattn.viz.figures import heatmap_figure, save_figure  # matplotlib: 0.3 s to import

    labels, matrix = _labels(e)
    labels = key_labels(labels, _first_tokens(e))  # 3:to and 6:to, as the tables list them
    figure = heatmap_figure(matrix, labels, labels, f"{e.model}: {_where(e)}", _query_row(e))
    return save_figure(figure, path, close=True)


def _query_row(e: Explanation) -> int | None:
    """The heatmap row of the query: its token, or with words merged its word."""
    if e.query is None or e.groups is None:
        return e.query
    return next(i for i, (_, members) in enumerate(e.groups) if e.query in members)


def page(run: RecordedRun, e: Explanation) -> str:
    """The interactive offline page of the whole run, opened on the explained layer/head."""
    return render_page(page_data(run, e))


def notebook_html(run: RecordedRun, e: Explanation, height: int = 900) -> str:
    """The page inside a sandboxed iframe, as a notebook's ``_repr_html_`` wants it."""
    source = html.escape(page(run, e), quote=True)
    return (
        f'<iframe srcdoc="{source}" sandbox="allow-scripts" '
        f'style="width:100%;height:{height}px;border:0"></iframe>'
    )


def page_data(run: RecordedRun, e: Explanation) -> dict:
    """The page's payload (see :mod:`selfattn.viz.html`) for a run and its explanation."""
    query, key, value = stacked_qkv(run)
    capture = run.captures[0]
    scale = capture.scale or default_scale(capture.similarity, query.shape[-1])
    head = "mean" if e.head is None else e.head
    calls = [run.captures.layer(index)[0] for index in range(run.captures.n_layers)]
    # Without a query: the first content word of an encoder (not [CLS]); a causal model's last,
    # which sees the whole text (its first sees only itself).
    content = content_tokens(e.tokens, run.word_ids)
    opening = (content[-1:] or [len(e.tokens) - 1]) if capture.causal else (content[:1] or [0])
    payload = page_payload(
        tokens=e.tokens, query=query, key=key, value=value, scale=scale,
        similarity=capture.similarity, model_name=e.model, text=e.text, layer=e.layer,
        head=head, query_index=opening[0] if e.query is None else e.query,
        words=run.word_ids, causal=capture.causal, windows=run.sliding_windows,
        names=e.key_names, note=e.query_note, bias=page_bias(calls),
    )  # fmt: skip
    if e.choice != AS_ASKED:  # the layer or head was chosen: the page says why
        payload["choice"] = worded(e.choice, menu_naming)
    return payload


MENU_NAMES = {"layer": "the layer menu", "head": "the head menu"}


def menu_naming(options: tuple[str, ...]) -> str:
    """Options as a page's menus name them: "the layer menu or the head menu"."""
    return " or ".join(MENU_NAMES.get(name, name) for name in options)


def page_bias(calls: Sequence[Capture]) -> Tensor | None:
    """What each layer's call (first item of the batch) added to its scaled scores, for the
    page: ``(H, T, S)`` once where every layer added an equal one (MPNet's position bias, one
    tensor shared by all layers; each capture holds its own detached view of it, so equality
    is what tells), ``(L, H, T, S)`` where they differ, None where none did."""
    if not any(adds_bias(capture) for capture in calls):
        return None
    biases = [_added_bias(capture) for capture in calls]
    if all(torch.equal(bias, biases[0]) for bias in biases[1:]):
        return biases[0]
    return torch.stack(biases)


def _added_bias(capture: Capture) -> Tensor:
    """(H, T, S): the float mask a call added to its scaled scores, zeros if it added none."""
    query, key = capture.query, capture.key
    if not adds_bias(capture):
        return query.new_zeros(*query.shape[1:3], key.shape[2])
    return capture.mask.expand(*query.shape[:2], *capture.mask.shape[-2:])[0]


def _similarity_table(c: Comparison, layers_as_rows: bool) -> Table:
    """The word's cosine similarity for each layer and sentence pair: layers as rows, or, for
    many pairs in a narrow terminal, pairs as rows. A pair's name may wrap ("S1 vs" over
    "S2"), so that a tight fit cuts no number."""
    pairs = list(combinations(range(len(c.sentences)), 2))
    cells = [[f"{float(matrix[a, b]):.3f}" for a, b in pairs] for matrix in c.similarity]
    pair_names = [f"S{a + 1} vs S{b + 1}" for a, b in pairs]
    layer_names = [str(layer) for layer in range(len(cells))]
    if layers_as_rows:
        corner, columns, rows = "layer", pair_names, zip(layer_names, cells, strict=True)
    else:
        corner, columns, rows = (
            "layer:",
            layer_names,
            zip(pair_names, zip(*cells, strict=True), strict=True),
        )
    table = Table()
    for name in (corner, *columns):
        table.add_column(name, justify="right")
    for name, values in rows:
        table.add_row(name, *values)
    return table


def _width(console: Console, table: Table) -> int:
    """The cells ``table`` takes when nothing in it wraps."""
    return Measurement.get(console, console.options.update_width(10_000), table).maximum


def _followed(c: Comparison) -> str:
    """The compared word, with the occurrence followed when it is not the first."""
    return f"'{printable(c.word)}'" + (f" (--occurrence {c.occurrence})" if c.occurrence else "")


def print_comparison(console: Console, c: Comparison, model: str) -> None:
    """The word's cosine similarity between sentence pairs, layer by layer, and what it attends."""
    table = _similarity_table(c, layers_as_rows=True)
    if _width(console, table) > console.width:
        pairs_as_rows = _similarity_table(c, layers_as_rows=False)
        table = min(table, pairs_as_rows, key=partial(_width, console))
    sentences = Table.grid(padding=(0, 2))
    for i, (sentence, attended) in enumerate(zip(c.sentences, c.attended, strict=True)):
        sentences.add_row(f"S{i + 1}", Text(printable(sentence, keep="\n\t")))
        listed = _listed(attended) or ("no word before it" if c.causal else "no other word")
        sentences.add_row("", Text(f"attends to: {listed}", style="cyan"))
    title = f"{_followed(c)} across sentences ({model}): cosine similarity of its vectors"
    console.print(
        Group(
            sentences,
            Text(_attention_note(c), style="dim"),
            Text(f"\n{title}", style="bold"),
            table,
            Text("layer 0 = the embedding output; 1.000 = the same direction", style="dim"),
            *([Text(printable(c.tokens_note), style="yellow")] if c.tokens_note else []),
        )
    )


def _attention_note(c: Comparison) -> str:
    """Which attention "attends to" reads, in explain's terms (--layer counts attention
    layers from 0) and in the table's (its layer n is the output of the n-th block)."""
    layer = c.attended_layer
    note = (
        f"attends to: attention layer {layer} (explain --layer {layer}), mean of heads, "
        f"this '{printable(c.word)}' itself and the special tokens left out (so the weights sum to "
        f"less than 1); its block's output is layer {layer + 1} in the table"
    )
    if any(key.repeated for row in c.attended for key in row):
        note += "; n:word = the word at token n, where a sentence has it more than once"
    if c.causal:
        note += (
            "; a decoder: the word's vectors and attention see only the text up to it, "
            "so words after it change nothing"
        )
    return f"({note})"
