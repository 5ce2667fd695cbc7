"""One writer per run folder: an exclusive lock (flock) on ``<run_dir>/.lock`` that dies with its
process, so a killed run never leaves a stale lock."""
from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import Callable

from .runs import LOCK, shown


class RunLock:
    """An exclusive lock on a run folder (``<run_dir>/.lock``, flock): one writer at a time.

    A second process asking for the same folder says who holds it (``announce``: a log line by
    default) and waits; the lock dies with its process (a killed run never leaves a stale lock).
    Within one process the lock is re-entrant: the command line takes it before hydra writes
    into the folder (so a refused run never touches another run's files), and the run takes it
    again. :meth:`release` with ``clean=True`` removes the lock file and the folders that this
    lock created, when nothing else is in them: a refused run leaves nothing behind. A process
    that waited on a lock file removed meanwhile takes the lock again on the new file."""

    _held: dict[str, list] = {}      # folder (resolved) -> [file, depth, made]: this process's locks

    def __init__(self, run_dir: Path, enabled: bool = True,
                 announce: Callable[[str], object] | None = None):
        self.path, self.enabled, self._fh = Path(run_dir) / LOCK, enabled, None
        self.announce = announce or logging.getLogger("experiments.run").info
        self.made: list[Path] = []   # what taking the lock created: folders, then the lock file

    @property
    def _key(self) -> str:
        return os.path.realpath(self.path.parent)

    def __enter__(self) -> "RunLock":
        if not self.enabled:
            return self
        held = RunLock._held.get(self._key)
        if held is not None:         # this process holds it already (the command line)
            held[1] += 1
            self._fh = held[0]
            return self
        while True:
            made = _missing_parents(self.path.parent)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fh = open(self.path, "x+")
                created = True
            except FileExistsError:
                fh, created = open(self.path, "a+"), False
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                holder = fh.read().strip() or "another process"
                self.announce(f"{shown(self.path.parent)} is being written by {holder}: "
                              "waiting for it")
                fcntl.flock(fh, fcntl.LOCK_EX)
            if _same_file(fh, self.path):
                break
            fh.close()               # removed while waiting (a refused run cleaned up): again
        self.made = made + ([self.path] if created else [])
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        fh.flush()
        self._fh = fh
        RunLock._held[self._key] = [fh, 1, self.made]
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self, clean: bool = False) -> None:
        """Give the lock up (the outermost holder closes the file). ``clean`` (heeded by the
        outermost holder): also remove the lock file, if taking the lock created it, and then
        the folders it created, those that are empty (a refused run leaves nothing behind; the
        lock is still held while they are removed)."""
        if self._fh is None:
            return
        held = RunLock._held.get(self._key)
        self._fh = None
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:              # an outer holder goes on
            return
        RunLock._held.pop(self._key, None)
        if clean:
            for p in reversed(held[2]):
                try:
                    p.rmdir() if p.is_dir() else p.unlink()
                except OSError:      # not empty (another run's files, hydra's), or gone
                    break
        held[0].close()              # releases the lock

    def made_folder(self) -> bool:
        """Whether this process created the run folder when it took the lock."""
        held = RunLock._held.get(self._key)
        return held is not None and self._key in {os.path.realpath(p) for p in held[2]}

    def holds_only_the_lock(self) -> bool:
        """Whether the run folder holds nothing but the lock file."""
        try:
            return all(p.name == LOCK for p in self.path.parent.iterdir())
        except OSError:
            return False


def _missing_parents(folder: Path) -> list[Path]:
    """The folders that ``folder.mkdir(parents=True)`` would create, outermost first."""
    out, p = [], Path(folder).absolute()
    while not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out[::-1]


def _same_file(fh, path: Path) -> bool:
    try:
        a, b = os.fstat(fh.fileno()), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
