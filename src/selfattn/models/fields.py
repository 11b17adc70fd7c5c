"""Typed config entries: one check for the config dataclasses and for ``config.json`` alike.

A kind is a name of :data:`KINDS` (``"int"``, ``"float"``, ...), ``" | None"`` after it when
None (JSON's null) may stand in its place: the dataclasses' own annotations (``"int"``,
``"float | None"``), so :func:`check_fields` reads the kinds from the class itself, and the
loader's table of the ``config.json`` entries it reads. ``True`` is never an integer nor a
number here, though Python counts it as 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from selfattn.errors import is_integer, is_real


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


KINDS: dict[str, tuple[Callable[[object], bool], str]] = {  # kind -> (test, in words)
    "int": (is_integer, "an integer"),
    "count": (is_integer, "an integer"),  # and at least 1: a size
    "float": (is_real, "a number"),
    "positive": (lambda value: is_real(value) and 0 < value < math.inf, "a positive number"),
    "str": (lambda value: isinstance(value, str), "a string"),
    "bool": (lambda value: isinstance(value, bool), "true or false"),
    "dict": (lambda value: isinstance(value, dict), "an object"),
    "list[str]": (_strings, "a list of strings"),
}


def problem(
    name: str, value: object, kind: str, shown: Callable[[object], str] = repr, null: str = "None"
) -> str | None:
    """What is wrong with ``value`` as ``name`` of ``kind`` (``"name must be an integer, got
    '12'"``, the value as ``shown`` writes it, None as ``null``), or None if it fits."""
    base = kind.removesuffix(" | None")
    if value is None and base != kind:
        return None
    test, words = KINDS[base]
    if base != kind:  # "an integer or None"; "true, false or null"
        words = f"{words.replace(' or ', ', ')} or {null}"
    if not test(value):
        return f"{name} must be {words}, got {shown(value)}"
    if base == "count" and value < 1:  # type: ignore[operator]  # an int: tested above
        return f"{name} must be at least 1, got {shown(value)}"
    return None


def check_fields(config: object) -> None:
    """A ValueError naming the first field of the dataclass ``config`` whose value is not of the
    kind its annotation names (``BertConfig.n_heads must be an integer, got '12'``); fields of
    other annotations (a tuple, a class) are left to the class's own checks."""
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        kind = field.type if isinstance(field.type, str) else ""
        if kind.removesuffix(" | None") in KINDS:
            wrong = problem(
                f"{type(config).__name__}.{field.name}", getattr(config, field.name), kind
            )
            if wrong:
                raise ValueError(wrong)


def check_positive(config: object, *names: str) -> None:
    """A ValueError naming the first of the fields ``names`` of ``config`` that is not a
    positive finite number: a norm's epsilon of 0 or less (or NaN) makes NaN of every output."""
    for name in names:
        wrong = problem(f"{type(config).__name__}.{name}", getattr(config, name), "positive")
        if wrong:
            raise ValueError(wrong)
