"""The self-contained page: one offline file, payload that round-trips, user text escaped."""

import base64
import json
import re
from importlib.resources import files

import numpy as np
import pytest
import torch

from selfattn import attention
from selfattn.models.bert import RelativePositionBias
from selfattn.viz import html
from selfattn.viz.html import page_payload, render_page

L, H, T, D = 2, 3, 5, 7
TOKENS = [
    "Ciao",
    "</script><script>alert(1)</script>",
    "a",
    "<img src=x onerror=alert(1)>",
    "&amp;",
]


def qkv(seed: int = 0, shape=(L, H, T, D)):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) for _ in range(3))


def payload(**overrides):
    q, k, v = qkv()
    args = dict(
        tokens=TOKENS,
        query=q,
        key=k,
        value=v,
        scale=D**-0.5,
        similarity="dot",
        model_name="tiny </script> model",
        text=" ".join(TOKENS),
        layer=1,
        head=2,
    )
    return page_payload(**(args | overrides))


def decode(tensor: dict, dtype: str) -> np.ndarray:
    raw = base64.b64decode(tensor["data"])
    return np.frombuffer(raw, dtype="<f4" if dtype == "float32" else "<f2").reshape(tensor["shape"])


def embedded_payload(page: str) -> dict:
    match = re.search(
        r'<script type="application/json" id="selfattn-payload">(.*?)</script>', page, re.S
    )
    assert match, "payload tag missing"
    return json.loads(match.group(1))


def test_page_is_one_offline_file():
    page = render_page(payload(tokens=list("abcde"), text="abcde", model_name="m"))
    assert "http://" not in page and "https://" not in page
    for attribute, value in re.findall(r'\b(src|href)\s*=\s*["\']?([^"\'\s>]*)', page):
        assert not re.match(r"^([a-z]+:)?//", value), f"{attribute}={value} points outside the page"
        assert value.startswith("data:"), f"unexpected {attribute}={value}"
    assert "<script src" not in page and 'rel="stylesheet"' not in page
    assert "function render(" in page and ".token" in page  # script and styles are inline
    assert "default-src 'none'" in page  # the browser refuses any fetch


def test_tensors_round_trip_exactly_as_float32():
    q, k, v = qkv()
    data = payload()
    assert data["dtype"] == "float32"
    assert (data["layers"], data["heads"], data["length"]) == (L, H, T)
    for name, tensor in (("query", q), ("key", k), ("value", v)):
        np.testing.assert_array_equal(decode(data[name], "float32"), tensor.numpy())


def test_large_runs_travel_as_float16(monkeypatch):
    monkeypatch.setattr(html, "FLOAT32_LIMIT_BYTES", 100)
    q, _, _ = qkv()
    data = payload()
    assert data["dtype"] == "float16"
    np.testing.assert_array_equal(decode(data["query"], "float16"), q.half().numpy())


def test_values_beyond_float16_stay_float32(monkeypatch):
    monkeypatch.setattr(html, "FLOAT32_LIMIT_BYTES", 100)
    v = qkv()[2]
    assert payload(value=v * 1e5)["dtype"] == "float32"


def thumbnail_grid(data: dict) -> np.ndarray:
    """The payload's thumbnails as (L, H, T, T) uint8."""
    grid = np.frombuffer(base64.b64decode(data["thumbnails"]["data"]), dtype=np.uint8)
    return grid.reshape(L, H, T, T)


def assert_head_0_thumbnail(grid: np.ndarray, layer: int, mask=None, causal=False) -> None:
    """Head 0 of ``layer`` is attention's weights for qkv(), scaled to the head's largest
    = 255, within one step of rounding."""
    q, k, v = qkv()
    _, trace = attention(
        q[layer, 0], k[layer, 0], v[layer, 0], mask=mask, causal=causal, scale=D**-0.5,
        return_trace=True,
    )  # fmt: skip
    expected = np.round(trace.weights.numpy() / trace.weights.max().item() * 255)
    np.testing.assert_allclose(grid[layer, 0], expected, atol=1)


def test_thumbnails_are_each_heads_weights_scaled_to_255():
    data = payload()
    assert data["thumbnails"]["size"] == T  # T <= 48: no pooling needed
    grid = thumbnail_grid(data)
    assert_head_0_thumbnail(grid, 1)
    assert (grid.reshape(L * H, -1).max(axis=1) == 255).all()


def test_thumbnails_mask_keys_before_each_layers_sliding_window():
    """A window of 2 in layer 1 (none in layer 0): the thumbnails are the weights of causal
    attention under that window's mask, within one step of 255 as above."""
    data = payload(causal=True, windows=[None, 2])
    assert data["windows"] == [None, 2] and payload()["windows"] is None
    grid = thumbnail_grid(data)
    allowed = torch.arange(T) > torch.arange(T)[:, None] - 2  # key j > query i - 2
    for layer, mask in ((0, None), (1, allowed)):
        assert_head_0_thumbnail(grid, layer, mask, causal=True)
    assert (grid[1, :, 4, :3] == 0).all() and (grid[0, :, 4, :3] > 0).any()


def bias(shape=(H, T, T)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def test_a_bias_travels_once_or_per_layer_and_round_trips():
    """(H, T, T): every layer's, stored once; (L, H, T, T): one per layer; float32 exactly."""
    assert payload()["bias"] is None
    for added in (bias(), bias((L, H, T, T))):
        data = payload(bias=added)
        assert data["bias"]["shape"] == list(added.shape) and data["dtype"] == "float32"
        np.testing.assert_array_equal(decode(data["bias"], "float32"), added.numpy())


def test_a_bias_travels_as_float16_with_q_k_v(monkeypatch):
    monkeypatch.setattr(html, "FLOAT32_LIMIT_BYTES", 100)
    data = payload(bias=bias())
    assert data["dtype"] == "float16"
    np.testing.assert_array_equal(decode(data["bias"], "float16"), bias().half().numpy())


def mpnet_bias() -> tuple[torch.Tensor, torch.Tensor]:
    """MPNet's bias for T tokens, (H, T, T), as the model's own module makes it, and the
    module's (32, H) weight."""
    torch.manual_seed(2)
    module = RelativePositionBias(32, H)
    return module(T)[0].detach(), module.embedding.weight.detach()


def test_mpnets_bias_travels_as_its_table_in_float32(monkeypatch):
    """A bias of one number per head and bucket of distance (MPNet's) travels as its (H, 32)
    table: the weights of the buckets T tokens reach, 0 for the others, exactly, float32 on
    a float16 page too; q, k and v alone make the page float16."""
    monkeypatch.setattr(html, "FLOAT32_LIMIT_BYTES", 100)
    added, weight = mpnet_bias()
    data = payload(bias=added)
    assert data["dtype"] == "float16"
    assert data["bias"].keys() == {"buckets", "max_distance", "table"}
    assert (data["bias"]["buckets"], data["bias"]["max_distance"]) == (32, 128)
    reached = [0, 1, 2, 3, 4, 17, 18, 19, 20]  # keys 0..4 before the query, 1..4 after it
    expected = np.zeros((H, 32), np.float32)
    expected[:, reached] = weight.T[:, reached].numpy()
    np.testing.assert_array_equal(decode(data["bias"]["table"], "float32"), expected)


def test_a_bias_that_is_not_one_number_per_bucket_travels_in_full():
    """One pair of a shared bucket changed, or a bias per layer: the full tensor, exactly."""
    added, _ = mpnet_bias()
    changed = added.clone()
    changed[1, 0, 3] += 1e-3  # key 3 after query 0: the bucket of key 4 after query 1 too
    for other in (changed, added.expand(L, H, T, T).clone()):
        data = payload(bias=other)
        assert data["bias"]["shape"] == list(other.shape)
        np.testing.assert_array_equal(decode(data["bias"], "float32"), other.numpy())


@pytest.mark.parametrize("per_layer", [False, True])
def test_thumbnails_add_the_bias_before_the_softmax(per_layer):
    """Each layer's thumbnails are the weights of softmax(scaled + that layer's bias), within
    one step of 255 as above; with a window too, keys outside it stay 0."""
    added = bias((L, H, T, T)) * 3 if per_layer else bias() * 3
    data = payload(bias=added, causal=True, windows=[None, 2])
    grid = thumbnail_grid(data)
    allowed = torch.arange(T) > torch.arange(T)[:, None] - 2  # key j > query i - 2
    for layer, window in ((0, None), (1, allowed)):
        layer_bias = added[layer, 0] if per_layer else added[0]
        mask = layer_bias if window is None else layer_bias.masked_fill(~window, float("-inf"))
        assert_head_0_thumbnail(grid, layer, mask, causal=True)
    assert (grid[1, :, 4, :3] == 0).all()
    unbiased = thumbnail_grid(payload(causal=True, windows=[None, 2]))
    assert np.abs(grid.astype(int) - unbiased).max() > 20


def test_thumbnails_pool_long_runs_to_48():
    q, k, v = qkv(shape=(1, 2, 100, 4))
    data = payload(tokens=[f"t{i}" for i in range(100)], query=q, key=k, value=v, layer=0, head=1)
    assert data["thumbnails"]["size"] == 48
    assert len(base64.b64decode(data["thumbnails"]["data"])) == 1 * 2 * 48 * 48


def test_user_text_cannot_close_the_script_tag():
    data = payload()
    page = render_page(data)
    assert page.count("</script>") == 2  # the JSON tag's and the app script's own
    assert "<img" not in page
    assert embedded_payload(page) == json.loads(json.dumps(data))


def test_selection_defaults_and_words_travel():
    data = payload(words=[0, 1, 1, 2, None])
    assert data["selection"] == {"layer": 1, "head": 2, "query": 0}
    assert data["words"] == [0, 1, 1, 2, None]
    assert payload(query_index=3)["selection"]["query"] == 3
    assert payload(head="mean")["selection"]["head"] == "mean"  # the page's mean of heads


def test_names_and_the_query_note_travel():
    # names: how the page's list of attended keys names each token; the tokens by default.
    assert payload()["names"] == TOKENS and payload()["note"] is None
    names = ["Ciao", "x", "'🙂' ([UNK])", "y", "z"]
    data = payload(names=names, note="piece 1 of 2 of 'giochi'", query_index=2)
    assert data["names"] == names and data["note"] == "piece 1 of 2 of 'giochi'"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokens": TOKENS[:4]}, "4 tokens"),
        ({"layer": 2}, r"layer 2 out of range: the run has layers 0..1"),
        ({"head": -1}, "head -1 out of range"),
        ({"head": "all"}, "head 'all' out of range: the run has heads 0..2, or 'mean'"),
        ({"query_index": 5}, "query_index 5 out of range"),
        ({"similarity": "euclid"}, "unknown similarity"),
        ({"words": [0]}, "one word index per token"),
        ({"names": ["a"]}, "one name per token"),
        ({"windows": [4]}, r"one sliding window \(a positive int, or None\) per layer \(2\)"),
        ({"windows": [4, 0]}, r"per layer \(2\), got \[4, 0\]"),
        ({"key": torch.zeros(L, H, T, D + 1)}, "same shape"),
        ({"query": torch.zeros(H, T, D)}, r"\(layers, heads, tokens, dim\)"),
        ({"bias": torch.zeros(H, T, T + 1)}, r"bias must have shape \(heads, tokens, tokens\)"),
        ({"bias": torch.zeros(L + 1, H, T, T)}, r"= \(3, 5, 5\) or \(layers, heads, tokens"),
    ],
)
def test_bad_inputs_get_one_line_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        payload(**overrides)


def test_static_assets_ship_inside_the_package():
    static = files("selfattn.viz") / "static"
    assert "</script" not in (static / "view.js").read_text()
    assert (static / "view.css").read_text().strip()
