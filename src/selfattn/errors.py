"""The exception the library raises for problems a user can fix, and the wording of messages
that name options.

:class:`SelfAttnError` is a ValueError, as are the attention core's and the layers' refusals
of wrong arguments (shapes, dtypes, options), so ``except ValueError`` catches every one;
:class:`OutOfRange`, one of them, is also the IndexError of an index a model or run lacks;
:class:`SettingsError`, one of them, marks a setting wrong in itself (the command line's exit
status 2).
Every message is one line: what is wrong, then what to do about it. A message that names the
options to change (``--word; word= in Python``) can be a :class:`Message`: a str worded for the
command line and Python, whose option names another front end (the web explorer's form fields)
words its own way with :meth:`Message.worded`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


def is_integer(value: object, least: int | None = None) -> bool:
    """An integer (Python's, NumPy's, or a compiled graph's symbolic size), at least ``least``
    where given; never a bool (True would read as 1) nor a float (2.0 fails later, deep in
    torch): the test behind each "must be a whole number" message."""
    # A tuple, not numbers.Integral | torch.SymInt: torch 2.4's compiler cannot trace an
    # isinstance of a union type (fullgraph=True failed on every layer; 2.13 can).
    whole = isinstance(value, (numbers.Integral, torch.SymInt)) and not isinstance(value, bool)
    return whole and (least is None or value >= least)


def is_real(value: object) -> bool:
    """A real number (Python's or NumPy's), not a bool (a setting of True would read as 1)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class SelfAttnError(ValueError):
    """A problem with the user's input or files (checkpoint, text, options), and its fix."""


class OutOfRange(SelfAttnError, IndexError):
    """An index (layer, head, token, step, call) outside what a model or run has: a
    SelfAttnError, and an IndexError as Python's own sequences raise."""


class SettingsError(SelfAttnError):
    """A setting wrong in itself, whatever the files and the machine (an unknown preset, a
    learning rate of NaN): the command line's usage error, exit status 2, as for an option's
    bad value; a problem found in the work (a missing file, a layer the model lacks) is 1."""


@dataclass(frozen=True)
class Options:
    """Where a message names options: ``text`` as the command line and Python name them,
    ``names`` the options by their Python names (``("word", "index")``)."""

    text: str
    names: tuple[str, ...]


Part = str | Options
Naming = Callable[[tuple[str, ...]], str]  # options by their Python names -> a front end's words


class Message(str):
    """A message as the command line and Python word it (the str), made of ``parts`` whose
    :class:`Options` another front end names its own way (:meth:`worded`)."""

    parts: tuple[Part, ...]

    def __new__(cls, *parts: Part) -> Message:
        message = super().__new__(cls, "".join(_text(part) for part in parts))
        message.parts = parts
        return message

    def worded(self, naming: Naming) -> str:
        """The message with each option named by ``naming``."""
        return "".join(part if isinstance(part, str) else naming(part.names) for part in self.parts)

    @classmethod
    def joined(cls, separator: str, messages: Iterable[str]) -> Message:
        """``separator.join(messages)``, keeping their options."""
        parts: list[Part] = []
        for message in messages:
            parts += [separator] if parts else []
            parts += parts_of(message)
        return cls(*parts)


def parts_of(message: str) -> tuple[Part, ...]:
    """A message's parts: a :class:`Message`'s own, a plain str whole."""
    return message.parts if isinstance(message, Message) else (message,)


def message_of(error: BaseException) -> str:
    """The error's message: the :class:`Message` it was raised with, else its str."""
    given = error.args[0] if len(error.args) == 1 else None
    return given if isinstance(given, Message) else str(error)


def worded(message: str, naming: Naming) -> str:
    """``message`` with its options named by ``naming``; a plain str as it is."""
    return message.worded(naming) if isinstance(message, Message) else message


def _text(part: Part) -> str:
    return part if isinstance(part, str) else part.text
