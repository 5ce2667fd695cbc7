"""Checkpoints of a run and the signals that ask it to stop (preemption, SLURM time limit).

A checkpoint is ``<run_dir>/checkpoint.pt``: the method's state (parameters, X^{k-1}, g, M, the
coin, every worker's data RNG and error memory, the uplink ledger), an optional task state
(e.g. BatchNorm buffers), the global RNG states, the number of metric rows written and the
W&B run id. It is written at a step boundary only, atomically (:mod:`experiments.shared.runs`:
a private temporary file, fsync, then ``os.replace``), so a run killed at any moment - SIGKILL
included - leaves either the previous checkpoint or the new one, never half of one; a write that
fails (a full disk) removes its temporary file and leaves the previous checkpoint as it was.
Temporary files left by a kill during a write are removed when the run ends
(:func:`checkpoint_leftovers`).

Signals (SIGTERM, SIGINT, SIGUSR1, SIGUSR2 - submitit's preemption and time-limit signal) never
interrupt a step: :class:`SignalGuard` only records them; the runner checks between steps,
writes a checkpoint, then does what the process would have done without it
(:meth:`SignalGuard.forward`): exit for a plain process, or hand over to submitit's own handler,
which resubmits the same job (``launcher.checkpoint()``) and requeues it; the new job finds the
checkpoint and resumes.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import random
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from experiments.shared.files import atomic_write

CHECKPOINT_FORMAT = 1
# SIGINT (Ctrl-C) too: a checkpoint, one line and exit status 130, as SIGTERM (143). A process
# started with SIGINT ignored (a background job of a non-interactive shell) keeps ignoring it.
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
                if hasattr(signal, name))


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def job_key() -> str | None:
    """Identifies the scheduler job across its requeues (SLURM keeps the id), else None."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID"):
        return f"slurm:{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '')}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}"
    if env.get("SUBMITIT_LOCAL_JOB_ID"):
        return f"local:{env['SUBMITIT_LOCAL_JOB_ID']}"
    return None


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """Serialised in memory first, so that a write refused by the disk is a plain OSError
    (torch.save's zip writer turns one into a RuntimeError)."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getbuffer()
    atomic_write(path, lambda fh: fh.write(data))


def checkpoint_leftovers(path: str | Path) -> list[Path]:
    """Temporary files of the checkpoint ``path`` left by a process killed while writing it:
    ``.<name>.<pid>.<random>.tmp`` (:mod:`experiments.shared.runs`) and ``<name>.tmp<pid>``
    (written by earlier versions)."""
    path = Path(path)
    return sorted({*path.parent.glob(f".{path.name}.*.tmp"), *path.parent.glob(f"{path.name}.tmp*")})


def load_checkpoint(path: str | Path, quiet: bool = False) -> dict | None:
    """The checkpoint at ``path``, or None when there is none, it cannot be read, or an earlier
    version wrote it without a count the library loads today
    (:func:`experiments.run.migrate.checkpoint_gap`); said in a log line unless ``quiet``."""
    path = Path(path)
    if not path.exists():
        return None
    say = (lambda *a: None) if quiet else logging.getLogger("experiments.run").warning
    try:
        payload = torch.load(path, weights_only=False)   # our own file: RNG states are pickled
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as e:
        say("[checkpoint] ignoring unreadable %s: %s", path, e)
        return None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        say("[checkpoint] ignoring %s: unknown format", path)
        return None
    from .migrate import checkpoint_gap          # what an earlier version's checkpoint lacks
    gap = checkpoint_gap(payload)
    if gap:
        say("[checkpoint] ignoring %s: written by an earlier version, without %s", path, gap)
        return None
    return payload


class SignalGuard:
    """Defers SIGTERM/SIGINT/SIGUSR1/SIGUSR2 to the next step boundary (see the module
    docstring).

    Only the main thread may install signal handlers; elsewhere the guard does nothing.
    """

    def __init__(self, signals=SIGNALS):
        self.signals = signals
        self.pending: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "SignalGuard":
        self._install()
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            if s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN:
                continue                      # ignored on purpose by whoever started us
            self._previous[s] = signal.signal(s, self._catch)

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _catch(self, signum, frame) -> None:  # noqa: ARG002
        if self.pending is None:
            self.pending = signum
        print(f"[signal] {signal.Signals(signum).name}: checkpoint at the end of this step",
              file=sys.stderr, flush=True)

    def forward(self) -> None:
        """Act on the pending signal as the process would have without the guard.

        The previous handler runs (submitit: resubmit + requeue + exit, or just a log line for
        the SIGTERM it "bypasses"); with the default action the process exits with status
        128 + signum. If the previous handler returns, the guard is installed again.
        """
        signum, self.pending = self.pending, None
        if signum is None:
            return
        previous = self._previous.get(signum, signal.SIG_DFL)
        self._restore()
        if previous is signal.default_int_handler:   # Ctrl-C: exit as SIGTERM does, not
            raise SystemExit(128 + signum)           # with a KeyboardInterrupt's traceback
        if callable(previous):
            previous(signum, None)
        elif previous != signal.SIG_IGN:
            raise SystemExit(128 + signum)
        self._install()
