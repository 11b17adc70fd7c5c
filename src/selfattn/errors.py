"""The one exception the library raises for problems a user can fix.

Every message is one line: what is wrong, then what to do about it.
"""

from __future__ import annotations


class SelfAttnError(ValueError):
    """A problem with the user's input or files (checkpoint, text, options), and its fix."""
