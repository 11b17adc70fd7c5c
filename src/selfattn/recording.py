"""Fast by default, weights on demand: capture each attention call's q, k, v while a model runs.

Inside ``with record() as rec:`` every attention module built from :mod:`selfattn.layers`
reports the query, key and value it hands to :func:`selfattn.attention` (after the head split),
its mask and options. The run itself stays on the fast backend and its outputs are unchanged;
weights and full traces are recomputed afterwards with the explicit path, only for the
layers and heads someone looks at.

Only eager calls are recorded: a graph made by ``torch.compile`` runs no Python, so the layers
do not look for a recording while it is traced (which keeps ``fullgraph=True`` possible), and
``record()`` refuses a compiled model instead of handing back an empty recording.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, overload

import torch
from torch import Tensor, nn

from selfattn.attention import AttentionTrace, attention
from selfattn.errors import OutOfRange, SelfAttnError


@dataclass(frozen=True, repr=False, eq=False)  # tensors: compared by identity
class Capture:
    """One attention call: q/k/v as ``(B, H, T, D)`` plus what is needed to recompute it."""

    name: str  # the module's qualified name when known, else its class name
    layer: int  # order of the module's first call in this recording
    query: Tensor  # (B, H, T, D)
    key: Tensor  # (B, H, S, D)
    value: Tensor  # (B, H, S, Dv)
    mask: Tensor | None
    causal: bool
    similarity: str
    scale: float | None
    output: Tensor  # (B, H, T, Dv) what the fast backend computed

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{name}={tuple(getattr(self, name).shape)}" for name in ("query", "key", "value")
        )
        mask = None if self.mask is None else tuple(self.mask.shape)
        return (
            f"Capture({self.name!r}, layer={self.layer}, {shapes}, mask={mask}, "
            f"causal={self.causal}, similarity={self.similarity!r})"
        )

    @property
    def n_heads(self) -> int:
        return self.query.shape[1]

    def to(self, device: torch.device | str) -> Capture:
        """This capture with its tensors on ``device``."""
        tensors = ("query", "key", "value", "mask", "output")
        moved = {name: getattr(self, name) for name in tensors if getattr(self, name) is not None}
        return replace(self, **{name: tensor.to(device) for name, tensor in moved.items()})

    def trace(
        self,
        head: int | None = None,
        batch: int = 0,
        *,
        similarity: str | None = None,
        scale: float | None = None,
    ) -> AttentionTrace:
        """Recompute this call with the explicit path; one head, or all heads if None.

        Negative ``head`` and ``batch`` count from the end, like list indices.
        ``similarity``/``scale`` recompute it as if the model had used another one (an
        experiment: the model itself ran with ``self.similarity`` and ``self.scale``).
        """
        batch = in_range(batch, self.query.shape[0], "batch", "this call had batch items")
        if head is None:
            heads = slice(None)
        else:
            every_head = "or None for every head (then .mean(0) for their mean)"
            head = in_range(head, self.n_heads, "head", "this layer has heads", every_head)
            heads = slice(head, head + 1)
        mask = self.mask
        if mask is not None:
            mask = mask.expand(*self.query.shape[:2], *mask.shape[-2:])[batch : batch + 1, heads]
        _, trace = attention(
            self.query[batch : batch + 1, heads],
            self.key[batch : batch + 1, heads],
            self.value[batch : batch + 1, heads],
            mask=mask,
            causal=self.causal,
            similarity=similarity or self.similarity,
            scale=scale if scale is not None or similarity is not None else self.scale,
            backend="explicit",
            return_trace=True,
        )
        return _squeeze_trace(trace, head is not None)

    def weights(self, head: int | None = None, batch: int = 0) -> Tensor:
        """Attention weights ``(T, S)`` for one head, or ``(H, T, S)`` for all."""
        return self.trace(head, batch).weights


def in_range(
    index: int,
    size: int,
    name: str,
    what: str,
    instead: str = "",
    counts_back: bool = True,
    empty: str = "",
) -> int:
    """``index`` as a non-negative index below ``size``; an OutOfRange error naming the range (and
    the negative indices that count back from the end, unless ``counts_back`` is False: a
    command line that refuses them), or with ``size`` 0 saying so (``empty``: why, if known),
    a TypeError for what is no integer (saying what to pass ``instead``, if anything)."""
    try:
        index = operator.index(index)
    except TypeError:
        alternative = f", {instead}" if instead else ""
        raise TypeError(f"{name} must be an integer{alternative}; got {index!r}") from None
    if size == 0:
        raise OutOfRange(f"{name} {index} out of range: {empty or 'there is none'}")
    if not -size <= index < size:
        back = f" (or -{size}..-1)" if counts_back else ""
        raise OutOfRange(f"{name} {index} out of range: {what} 0..{size - 1}{back}")
    return index % size


def _squeeze_trace(trace: AttentionTrace, one_head: bool) -> AttentionTrace:
    dims = (0, 1) if one_head else (0,)
    fields = {
        name: getattr(trace, name).squeeze(dims)
        for name in ("query", "key", "value", "scores", "scaled", "masked", "weights", "output")
    }
    return AttentionTrace(**fields, scale=trace.scale, similarity=trace.similarity)


# Why a recording can be empty: no attention call ran eagerly inside its block.
NO_CALLS = (
    "this recording holds no attention calls; run the model inside the record() block (a "
    "torch.compile'd model runs none of its Python: record the eager model)"
)


@dataclass(repr=False, eq=False)  # tensors: compared by identity
class Recording:
    """The captures of one ``record()`` block, in call order; ``rec[i]`` is the i-th call."""

    names: dict[int, str] = field(default_factory=dict)
    captures: list[Capture] = field(default_factory=list)
    _layers: dict[int, int] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Recording({len(self)} calls of {self.n_layers} attention layers)"

    def __len__(self) -> int:
        return len(self.captures)

    @overload
    def __getitem__(self, index: int) -> Capture: ...
    @overload
    def __getitem__(self, index: slice) -> list[Capture]: ...
    def __getitem__(self, index: int | slice) -> Capture | list[Capture]:
        if isinstance(index, slice):
            return self.captures[index]
        at = in_range(index, len(self), "call", "this recording has calls", empty=NO_CALLS)
        return self.captures[at]

    def __iter__(self) -> Iterator[Capture]:
        return iter(self.captures)

    @property
    def n_layers(self) -> int:
        """How many distinct attention modules were called."""
        return len(self._layers)

    def to(self, device: torch.device | str) -> Recording:
        """The same captures, their tensors on ``device`` (a run's go to the CPU)."""
        return Recording(self.names, [capture.to(device) for capture in self], self._layers)

    def layer(self, layer: int) -> list[Capture]:
        """Every capture of one layer (several when a key/value cache calls it per step);
        negative ``layer`` counts from the end."""
        what = "this recording has attention layers"
        layer = in_range(layer, self.n_layers, "layer", what, empty=NO_CALLS)
        return [capture for capture in self.captures if capture.layer == layer]

    def add(self, module: nn.Module, **tensors: Any) -> None:
        """One attention call of ``module``: its tensors (detached) and settings, as a capture."""
        layer = self._layers.setdefault(id(module), len(self._layers))
        name = self.names.get(id(module), type(module).__name__)
        detached = {
            key: value.detach() if isinstance(value, Tensor) else value
            for key, value in tensors.items()
        }
        self.captures.append(Capture(name=name, layer=layer, **detached))


_ACTIVE: ContextVar[tuple[Recording, ...]] = ContextVar("selfattn_recordings", default=())


@contextmanager
def record(*models: nn.Module) -> Iterator[Recording]:
    """Capture every attention call made inside the block.

    Pass the model(s) to name each capture by its qualified module name
    (``encoder.layers.3.attention``); layers are numbered by order of first call. Blocks
    nest: each gets every call made inside it (an inner block, or a ``model.run`` inside
    yours, no longer keeps them from the outer one), and may end in any order (two
    generators that each hold one open). A block records the calls of its own context (its
    thread, its asyncio task), not a model run in another thread meanwhile. Calls inside a
    ``torch.compile`` graph are not recorded; a compiled model passed here is a
    :class:`SelfAttnError`.
    """
    recording = Recording()
    for model in models:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"record() takes the models to name the captures by (torch.nn.Module), got "
                f"{type(model).__name__}; pass none to record every attention call"
            )
        for name, module in model.named_modules():
            _refuse_compiled(module, name)
            recording.names[id(module)] = name or type(module).__name__
    _ACTIVE.set((*_ACTIVE.get(), recording))
    try:
        yield recording
    finally:  # this recording only: restoring the tuple from before would revive one that
        # ended meanwhile (out of order) and, in another context, fails (a ContextVar token)
        _ACTIVE.set(tuple(other for other in _ACTIVE.get() if other is not recording))


def _refuse_compiled(module: nn.Module, name: str) -> None:
    """A one-line error for a module compiled by ``torch.compile(module)`` or ``.compile()``."""
    original = getattr(module, "_orig_mod", module)  # what torch.compile(module) wraps
    if original is module and getattr(module, "_compiled_call_impl", None) is None:
        return
    where = f" {name!r}" if name else ""
    raise SelfAttnError(
        f"record() cannot see inside the compiled {type(original).__name__}{where}: a "
        "torch.compile graph runs no Python; record and run the uncompiled module"
        + (" (its ._orig_mod)" if original is not module else "")
    )


def active_recordings() -> tuple[Recording, ...]:
    """The recordings of the ``record()`` blocks around this call, outermost first; none
    while torch.compile traces (a compiled graph cannot report its calls)."""
    return () if torch.compiler.is_compiling() else _ACTIVE.get()
