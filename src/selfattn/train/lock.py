"""One run at a time in a --out folder: an exclusive lock on ``OUT/.lock`` while a run lasts.

A ``fcntl.flock`` lock belongs to the open file, so it goes with its process however that ends
(an error, Ctrl-C, kill -9); the file stays behind, holding the last holder's pid, and is no
checkpoint (those are ``LATEST`` and ``step-*`` folders). Without fcntl (Windows) nothing is
locked.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selfattn.errors import SelfAttnError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK = ".lock"


@contextmanager
def hold(out: Path) -> Iterator[None]:
    """Hold the lock on the folder ``out`` while the block runs; a one-line error naming the
    folder and the holder's pid when another run holds it."""
    if fcntl is None:
        yield
        return
    try:
        file = (out / LOCK).open("a+", encoding="utf-8")  # "a+": no truncation before the lock
    except OSError as error:
        raise SelfAttnError(
            f"cannot write in the --out folder {out}: {error.strerror or error}; choose another"
        ) from None
    with file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            raise _in_use(out, file.read().strip()) from None
        file.truncate(0)
        file.write(f"{os.getpid()}\n")
        file.flush()
        yield


def _in_use(out: Path, holder: str) -> SelfAttnError:
    pid = f" (pid {holder})" if holder.isdigit() else ""
    return SelfAttnError(
        f"--out {out} is in use by another run{pid}; wait for it to end or choose another --out"
    )
