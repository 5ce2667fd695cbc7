"""Where the checkout is, and how every file that parallel jobs share is written: atomically,
under a unique temporary name, then renamed. Imports neither hydra nor torch."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import IO, Callable

REPO = Path(__file__).resolve().parents[2]     # the checkout: configs/, results/


# ---------------------------------------------------------------- files that parallel jobs share
#
# Atomic file writes for files that parallel jobs share (the caches under ``results/cache``).
#
# Several jobs may build the same file at the same time: ``make fig2-cnn`` starts parallel runs
# that all decode CIFAR-10 on a fresh clone and write ``cifar10-<source>-v1.pt``, and the jobs of
# a SLURM array all compute f* and write ``fstar-*.json``. Writing to one fixed temporary name
# (``path.with_suffix(".tmp")``) races: two writers truncate and fill the same temporary file,
# the first ``replace`` moves it away so the second fails with FileNotFoundError, or a reader
# loads a half-written file.
#
# :func:`atomic_write` gives every writer its own temporary file in the target's directory
# (``.<name>.<pid>.<random>.tmp``: same file system, so the rename is atomic), flushes and fsyncs
# it, then ``os.replace``-s it onto the target. Readers see either no file or a complete one,
# never a partial one. No lock is needed for the caches: their content is a deterministic
# function of the inputs, so when two jobs both write, the last replace wins and both versions
# are identical. On any error the temporary file is removed, so none is left behind.

def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (best effort: not every OS/file system allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)


def _open_unique(path: Path) -> tuple[Path, int]:
    """A new, exclusively created temporary file beside ``path``; mode 0o666 minus the umask
    (unlike mkstemp's 0o600, so a shared cache stays readable by the group as usual)."""
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            return tmp, os.open(tmp, _FLAGS, 0o666)
        except FileExistsError:
            continue


def atomic_write(path: str | Path, write_fn: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` atomically: ``write_fn(fh)`` fills a private temporary file (binary mode)
    in the same directory, which then replaces ``path`` in one step (see the module docstring).
    Parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _open_unique(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            write_fn(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        if isinstance(err, OSError) and err.filename in (None, str(tmp)):
            err.filename = str(path)           # e.g. a full disk: name the file being written
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """:func:`atomic_write` for a text file."""
    data = text.encode(encoding)
    atomic_write(path, lambda fh: fh.write(data))


def publish(text: str, out: str | Path | None) -> None:
    """A bench's report: printed, and written atomically to ``out`` when one is given."""
    print(text)
    if out:
        atomic_write_text(out, text)
        print(f"wrote {out}")
