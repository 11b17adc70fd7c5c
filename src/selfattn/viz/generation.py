"""One self-contained HTML page of attention during generation: one strip per new token.

Each strip is one generation step: the query row of the forward pass that chose a new token
(its query is the token before it) over its keys, the prompt and the tokens generated so far.
Rows are queries, columns are keys. The page reuses the explorer's page template, colours and
helpers (``view.css``, ``view.js``) and adds ``generation.css`` and ``generation.js``.

Payload (a JSON object, the input of the page's script)::

    version         1
    model, prompt   strings shown in the header
    text            the continuation as text (the page's plain copy of prompt + text)
    tokens          [N] token strings, the prompt's first;  n_prompt: P
    layers, heads   L, H
    queries         [M] per step, the position of its query (its new token is the next one)
    starts          [M] per step, the position of its first key (> 0 once the window slid)
    windows         [L] each layer's sliding window w (a step's query q sees keys from
                    q - w + 1 on: the earlier ones, at weight 0, are masked; null: all of
                    its keys), or null when no layer has one (Mistral's, Qwen's)
    dtype           "float32" or "float16" (little-endian)
    weights         {"shape": [L, H, K], "data": base64}: the steps' weights one after the
                    other along the last axis, step s's queries[s] - starts[s] + 1 of them
    selection       {"layer": l, "head": h or "mean", "step": s}: what the page shows first,
                    unless its address asks for other ones (#layer=l&head=h&step=s, kept
                    up to date as the reader chooses)

User text is escaped as in :mod:`selfattn.viz.html` and reaches the page as text only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfattn.models.model import Generation
from selfattn.recording import in_range
from selfattn.viz.html import check_windows, encode_tensor, inline_page, wire_dtype

PAYLOAD_VERSION = 1


def generation_payload(
    generation: Generation,
    *,
    windows: Sequence[int | None] = (),
    layer: int = -1,
    head: int | str = "mean",
    step: int = 0,
) -> dict:
    """The page's data: every step's weights for every layer and head, encoded compactly.

    ``windows``: the model's sliding window per layer (None: full), () for none
    (``model.config.sliding_windows``), so that the page shows the keys before a window as
    masked, not as weighed and found unimportant. ``layer`` (negative counts from the end),
    ``head`` (or ``"mean"``) and ``step`` are what the page shows first.
    """
    if not generation.steps:
        raise ValueError("nothing was generated: a page of attention needs at least one new token")
    check_windows(windows, generation.n_layers)
    layer, head = opening_view(generation.n_layers, generation.n_heads, layer, head)
    weights = torch.cat([s.weights for s in generation.steps], dim=-1).float()  # (L, H, K)
    dtype = wire_dtype(weights)
    return {
        "version": PAYLOAD_VERSION,
        "model": generation.model_name,
        "prompt": generation.prompt,
        "text": generation.text,
        "tokens": list(generation.tokens),
        "n_prompt": generation.n_prompt,
        "layers": generation.n_layers,
        "heads": generation.n_heads,
        "queries": [s.query for s in generation.steps],
        "starts": [s.start for s in generation.steps],
        "windows": list(windows) or None,
        "dtype": dtype,
        "weights": encode_tensor(weights, dtype),
        "selection": {
            "layer": layer,
            "head": head,
            "step": in_range(step, len(generation.steps), "step", "the generation has steps"),
        },
    }


def opening_view(
    n_layers: int, n_heads: int, layer: int = -1, head: int | str = "mean", counts_back: bool = True
) -> tuple[int, int | str]:
    """``layer`` (negative counts from the end) and ``head`` (or ``"mean"``) as the page opens
    on them; an OutOfRange error naming the range where a model of that size has no such one (and
    the negative indices too, unless ``counts_back`` is False)."""
    layer = in_range(layer, n_layers, "layer", "the model has layers", counts_back=counts_back)
    if head != "mean":
        head = in_range(
            head, n_heads, "head", "each layer has heads", "or 'mean'", counts_back=counts_back
        )
    return layer, head


def generation_page(
    generation: Generation, *, windows: Sequence[int | None] = (), **selection: int | str
) -> str:
    """The whole page as one HTML string, nothing fetched; ``windows`` and ``selection`` as
    for the payload."""
    return inline_page(
        generation_payload(generation, windows=windows, **selection),
        title="selfattn: attention during generation",
        styles=("view.css", "generation.css"),
        scripts=("view.js", "generation.js"),
        payload_id="selfattn-generation",
    )
