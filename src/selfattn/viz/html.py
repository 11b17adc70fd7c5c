"""One self-contained HTML page to explore attention: offline, no CDN, data embedded.

The page ships the captured query, key and value of every layer and head, not the weights:
its script recomputes scores, scaled scores, weights and outputs for the layer and head on
screen (the same four steps as :func:`selfattn.attention`, in float64, adding a model's
position bias to the scaled scores before the softmax as MPNet does), so a 512-token,
6-layer, 12-head run stays a few megabytes instead of the ~0.9 GB that embedding every weight
as JSON would take. Small per-head thumbnails of the weights are precomputed for the model view.

Payload (a JSON object, the input of the page's ``render(payload)``)::

    version        1
    model, text    strings shown in the header
    tokens         [T] token strings;  words: [T] word index per token (null: special) or null
    names          [T] each token as the lists of keys (attended keys, step table) name it:
                   the token, or '🙂' ([UNK]) by the text it stands for where it does not
                   show it
    note           what the first query is of the word asked for (a phrase's first token, a
                   piece of a word), or null
    layers, heads, length        L, H, T
    scale, similarity, causal    how the scores were made: "dot" or "cosine"; bottom-right mask
    windows        [L] each layer's sliding window w (query i sees keys j with i - w < j <= i;
                   null: every key the causal mask leaves), or null when no layer has one
    dtype          "float32" or "float16" (little-endian), the encoding of the tensors
    query, key, value            {"shape": [L, H, T, d], "data": base64}
    bias           added to the scaled scores before the softmax, null for models without one.
                   MPNet's relative position bias (one number per head and bucket of the key's
                   distance, the same in every layer) as its table: {"buckets": 32,
                   "max_distance": 128, "table": {"shape": [H, 32], "data": base64 float32}},
                   key j's bias for query i in head h being table[h, bucket of j - i] (buckets
                   as :func:`selfattn.models.bert.relative_buckets` makes them; a bucket no pair
                   of this text reaches is 0). Any other bias in full, in ``dtype``:
                   {"shape": [H, T, T], "data": base64} when every layer adds the same (stored
                   once), [L, H, T, T] when layers differ
    thumbnails     {"size": n, "pool": "max", "data": base64 uint8 [L, H, n, n]}, each
                   head's weights max-pooled to n <= 48 and scaled by that head's largest weight
    selection      {"layer": l, "head": h or "mean", "query": i}: what the page shows first
    choice         (where the layer or head was chosen, not given) why they were chosen,
                   as ``selfattn explain`` says it: shown while they are on screen

User text is escaped by construction: the payload sits in a ``<script type="application/json">``
tag with ``<``, ``>`` and ``&`` written as ``\\u003c``-style escapes, and the script builds the
page with ``textContent`` only.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from importlib.resources import files

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from selfattn.attention import SIMILARITIES, attention
from selfattn.errors import OutOfRange
from selfattn.models.bert import RELATIVE_BUCKETS, RELATIVE_MAX_DISTANCE, relative_buckets
from selfattn.models.llama import window_mask

FLOAT32_LIMIT_BYTES = 8 * 2**20  # q, k, v (and a full bias) together; above this, float16
FLOAT16_MAX = 65504.0
THUMBNAIL_SIZE = 48
PAYLOAD_VERSION = 1

# Nothing may be fetched: inline styles and script only, images only from data: URLs.
CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="/*CSP*/">
<title>/*TITLE*/</title>
<link rel="icon" href="data:,">
<style>
/*CSS*/
</style>
</head>
<body>
<main id="app"></main>
<script type="application/json" id="/*PAYLOAD_ID*/">/*PAYLOAD*/</script>
<script>
/*JS*/
</script>
</body>
</html>
"""


def page_payload(
    *,
    tokens: Sequence[str],
    query: Tensor | np.ndarray,
    key: Tensor | np.ndarray,
    value: Tensor | np.ndarray,
    scale: float,
    similarity: str,
    model_name: str,
    text: str,
    layer: int,
    head: int | str,
    query_index: int | None = None,
    words: Sequence[int | None] | None = None,
    causal: bool = False,
    windows: Sequence[int | None] = (),
    names: Sequence[str] | None = None,
    note: str | None = None,
    bias: Tensor | np.ndarray | None = None,
) -> dict:
    """The page's data: q, k, v of every layer and head ``(L, H, T, d)``, encoded compactly.

    Args:
        tokens: the T token strings, as the tokenizer wrote them.
        query, key, value: per-layer, per-head tensors ``(L, H, T, d)`` (value may have its own d).
        scale: multiplies the scores (1/sqrt(d) for dot products).
        similarity: ``"dot"`` or ``"cosine"`` (the page normalises q and k first).
        model_name, text: shown in the header.
        layer, head, query_index: the first selection (head ``"mean"``: the mean of heads;
            query 0 when None).
        words: per token, the index of the word it belongs to (None for special tokens);
            the page groups the tokens of one word together.
        causal: bottom-right causal masking, as in :func:`selfattn.attention` (decoders).
        windows: each layer's sliding window (None: full), () for none (Mistral's, Qwen's):
            masked too, so that the page's weights are the model's.
        names: each token as the lists of keys name it (the tokens when None).
        note: said under the first query, when it is only a part of the word asked for.
        bias: added to the scaled scores before the softmax (MPNet's position bias): ``(H, T,
            T)`` for every layer, or ``(L, H, T, T)`` per layer; None for none. One that is
            MPNet's travels as its small table (see the payload above).
    """
    q, k, v = (
        _as_tensor(x, name) for x, name in ((query, "query"), (key, "key"), (value, "value"))
    )
    n_layers, n_heads, length, _ = q.shape
    _check(tokens, q, k, v, similarity, layer, head, query_index, words, names, windows)
    bias = None if bias is None else _as_bias(bias, q.shape)
    table = None if bias is None else _relative_table(bias)
    full_bias = bias if table is None else None
    dtype = wire_dtype(*(x for x in (q, k, v, full_bias) if x is not None))
    return {
        "version": PAYLOAD_VERSION,
        "model": model_name,
        "text": text,
        "tokens": list(tokens),
        "words": None if words is None else list(words),
        "names": list(tokens if names is None else names),
        "note": note,
        "layers": n_layers,
        "heads": n_heads,
        "length": length,
        "scale": float(scale),
        "similarity": similarity,
        "causal": causal,
        "windows": list(windows) or None,
        "dtype": dtype,
        "query": encode_tensor(q, dtype),
        "key": encode_tensor(k, dtype),
        "value": encode_tensor(v, dtype),
        "bias": _bias_payload(full_bias, table, dtype),
        "thumbnails": _thumbnails(q, k, v, scale, similarity, causal, windows, bias),
        "selection": {"layer": layer, "head": head, "query": query_index or 0},
    }


def render_page(payload: dict) -> str:
    """The whole page as one HTML string: styles, script and data inline, nothing fetched."""
    return inline_page(
        payload,
        title="selfattn: attention explorer",
        styles=("view.css",),
        scripts=("view.js",),
        payload_id="selfattn-payload",
    )


def inline_page(
    payload: dict,
    *,
    title: str,
    styles: Sequence[str],
    scripts: Sequence[str],
    payload_id: str,
) -> str:
    """A page of this package's static ``styles`` and ``scripts`` (in order) with ``payload``
    as JSON in the ``<script>`` of id ``payload_id``; all inline, nothing fetched."""
    static = files("selfattn.viz") / "static"
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    css = "\n".join((static / name).read_text(encoding="utf-8") for name in styles)
    js = "\n".join((static / name).read_text(encoding="utf-8") for name in scripts)
    page = PAGE.replace("/*CSP*/", CSP).replace("/*TITLE*/", title).replace("/*CSS*/", css)
    page = page.replace("/*JS*/", js).replace("/*PAYLOAD_ID*/", payload_id)
    return page.replace("/*PAYLOAD*/", data)


def _as_tensor(x: Tensor | np.ndarray, name: str) -> Tensor:
    tensor = torch.as_tensor(x).detach().cpu().float()
    if tensor.dim() != 4:
        raise ValueError(
            f"{name} must have shape (layers, heads, tokens, dim), got {tuple(tensor.shape)}"
        )
    return tensor


def _as_bias(bias: Tensor | np.ndarray, shape: torch.Size) -> Tensor:
    """The bias as a float tensor, checked against q's ``(L, H, T, d)``."""
    tensor = torch.as_tensor(bias).detach().cpu().float()
    n_layers, n_heads, length, _ = shape
    if tuple(tensor.shape) not in ((n_heads, length, length), (n_layers, n_heads, length, length)):
        raise ValueError(
            f"bias must have shape (heads, tokens, tokens) = {(n_heads, length, length)} or "
            f"(layers, heads, tokens, tokens), got {tuple(tensor.shape)}"
        )
    return tensor


def _relative_table(bias: Tensor) -> Tensor | None:
    """The ``(H, 32)`` table of an ``(H, T, T)`` bias that is one number per head and bucket of
    key-minus-query distance (MPNet's), such that ``table[:, relative_buckets(T)]`` equals it
    exactly; None for any other bias. A bucket no pair of the T tokens reaches is 0."""
    if bias.dim() != 3:
        return None
    buckets = relative_buckets(bias.shape[-1])
    table = bias.new_zeros(bias.shape[0], RELATIVE_BUCKETS)
    table[:, buckets] = bias
    return table if torch.equal(table[:, buckets], bias) else None


def _bias_payload(full: Tensor | None, table: Tensor | None, dtype: str) -> dict | None:
    """The payload's bias: MPNet's table with its bucketing, float32 (it is small), or a full
    bias in the wire ``dtype``; None for none."""
    if table is not None:
        return {
            "buckets": RELATIVE_BUCKETS,
            "max_distance": RELATIVE_MAX_DISTANCE,
            "table": encode_tensor(table, "float32"),
        }
    return None if full is None else encode_tensor(full, dtype)


def _check(tokens, q, k, v, similarity, layer, head, query_index, words, names, windows) -> None:
    """One-line errors for inputs that would give a wrong or broken page."""
    if similarity not in SIMILARITIES:
        raise ValueError(f"unknown similarity {similarity!r}; choose 'dot' or 'cosine'")
    if q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError(
            "query and key must have the same shape (L, H, T, d) and value the same (L, H, T), "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    n_layers, n_heads, length, _ = q.shape
    if len(tokens) != length:
        raise ValueError(f"got {len(tokens)} tokens for tensors of {length} positions")
    if words is not None and len(words) != length:
        raise ValueError(f"words must give one word index per token ({length}), got {len(words)}")
    if names is not None and len(names) != length:
        raise ValueError(f"names must give one name per token ({length}), got {len(names)}")
    check_windows(windows, n_layers)
    if not 0 <= layer < n_layers:
        raise OutOfRange(f"layer {layer} out of range: the run has layers 0..{n_layers - 1}")
    if head != "mean" and not (isinstance(head, int) and 0 <= head < n_heads):
        raise OutOfRange(
            f"head {head!r} out of range: the run has heads 0..{n_heads - 1}, or 'mean'"
        )
    if query_index is not None and not 0 <= query_index < length:
        raise OutOfRange(f"query_index {query_index} out of range: tokens are 0..{length - 1}")


def check_windows(windows: Sequence[int | None], n_layers: int) -> None:
    """A one-line ValueError unless ``windows`` is () or one sliding window (a positive int,
    or None for none) per layer."""
    if windows and (len(windows) != n_layers or any(w is not None and w < 1 for w in windows)):
        raise ValueError(
            "windows must give one sliding window (a positive int, or None) per layer "
            f"({n_layers}), got {list(windows)}"
        )


def wire_dtype(*tensors: Tensor) -> str:
    """float32 while the tensors fit the budget, float16 beyond (if no value overflows)."""
    nbytes = sum(t.numel() * 4 for t in tensors)
    if nbytes <= FLOAT32_LIMIT_BYTES:
        return "float32"
    if max(float(t.abs().max()) for t in tensors) >= FLOAT16_MAX:
        return "float32"
    return "float16"


def encode_tensor(tensor: Tensor, dtype: str) -> dict:
    array = tensor.numpy().astype("<f4" if dtype == "float32" else "<f2")
    return {"shape": list(tensor.shape), "data": base64.b64encode(array.tobytes()).decode("ascii")}


def _thumbnails(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    similarity: str,
    causal: bool,
    windows: Sequence[int | None],
    bias: Tensor | None,
) -> dict:
    """Every head's weights (masked and biased as the page masks and biases them), max-pooled
    to at most 48x48 and scaled to 0..255 per head.

    Max pooling keeps a single strong link visible after downsampling; scaling per head
    shows each head's pattern even where its weights are spread thin.
    """
    size = min(THUMBNAIL_SIZE, q.shape[2])
    pooled = []
    for layer in range(q.shape[0]):  # one layer at a time: (H, T, T) at most in memory
        mask = window_mask(windows[layer] if windows else None, q.shape[2], k.shape[2])
        if bias is not None:  # a float mask is added; keys outside a window go to -inf
            added = bias if bias.dim() == 3 else bias[layer]
            mask = added if mask is None else added.masked_fill(~mask, float("-inf"))
        _, trace = attention(
            q[layer],
            k[layer],
            v[layer],
            mask=mask,
            causal=causal,
            similarity=similarity,
            scale=scale,
            backend="explicit",
            return_trace=True,
        )
        small = F.adaptive_max_pool2d(trace.weights.unsqueeze(0), size).squeeze(0)  # (H, n, n)
        peak = small.amax(dim=(-2, -1), keepdim=True).clamp_min(1e-12)
        pooled.append((small / peak * 255).round().to(torch.uint8))
    data = torch.stack(pooled).numpy().tobytes()  # (L, H, n, n)
    return {"size": size, "pool": "max", "data": base64.b64encode(data).decode("ascii")}
