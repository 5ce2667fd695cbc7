"""A run as readers see it: its identity, its status, its metric rows, and whether its files agree.

Everyone who asks "which run is this?", "is it finished?" or reads its rows uses this module: the
run lifecycle (skip, resume or refuse), the sweeper (launch or not), the sweep report, ``make
summarize``, the migration command and the figures. It imports neither hydra nor torch. It also
holds what keeps parallel writers apart: the folder lock (:class:`RunLock`: one writer per run
folder) and the atomic writes of every file that parallel jobs share (:func:`atomic_write`).

Identity (:func:`identity`, :func:`run_id`, :func:`folder_name`): a run is what its resolved
config computes on its data. Its identity is the resolved config less the keys in
:data:`OPERATIONAL` (how a run is executed, not what it computes) and less every key set to
null (a null setting means "not set": adding an optional key to the schema changes no run's
identity), together with the identity of its data (the SHA-256 of the data's files, from the
task). :func:`run_id` hashes it; the run's folder is named by :func:`folder_name`: the method's
settings, the compressor and the seed, readable, then that hash, at most :data:`MAX_NAME`
characters. Any spelling of one config (``seed=0`` typed or left to its default, ``0.01`` or
``0.0100000``) lands in one folder, and two configs never share one by chance: a folder that
holds another run is refused (the run lifecycle), never overwritten. Runs that differ only in
their seed form one group of a table or a figure (:func:`group_key`).

A run folder (written by :class:`experiments.run.record.RunLog`) holds ``metrics.jsonl`` (one
JSON row per logged step) and, once the run ends, ``summary.json``. The summary records how many
rows ``metrics.jsonl`` had and the SHA-256 of its bytes (``summary["metrics"]``), so a finished
run is one whose summary says so *and* whose metrics file is the one the summary describes.

Statuses (:func:`status`):

* ``ok``, ``diverged``: finished (:data:`FINISHED`); a re-run skips them.
* ``damaged``: summary.json says finished, but metrics.jsonl is missing, cut, garbled or edited
  (its row count or hash differ from the summary's), or summary.json itself cannot be read. A
  re-run says so in one line and recomputes the run, or resumes it from a checkpoint whose rows
  are intact (a run of another config is refused such a folder: the lifecycle's ``other_run``).
* ``failed``: the run raised an exception (summary.json has the traceback); a re-run starts over.
* ``running``: another process holds the folder's lock.
* ``interrupted``: a checkpoint and no summary (preempted, killed): a re-run resumes.
* ``missing``: neither.

Folders written before the summary recorded its metrics file ("legacy") are trusted as they
were: finished when their summary says so. ``python -m experiments.run.migrate`` checks each one
(every row parses; the last row is the summary's final row, step and uplink) and records the
count and hash, after which they are checked like any other.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import socket
from pathlib import Path
from typing import IO, Callable

REPO = Path(__file__).resolve().parents[2]     # the checkout: configs/, results/

# Top-level keys that say how a run is executed, not what it computes. ``comm`` runs the same
# workers in one process or in several (bit-identical except the dense all_reduce's summation
# order); ``threads`` sets torch's CPU threads, which may change the last bits of a matmul's
# reduction but not the run's meaning (runs are bit-identical for a seed at one thread count:
# the figures use 1). ``results_dir`` says where caches go, ``data_dir`` where the data is found
# (the data's identity is its content); ``experiment`` is a key of older records.
OPERATIONAL = ("overwrite", "threads", "wandb", "data_dir", "checkpoint_every",
               "keep_checkpoint", "extend_from", "group", "comm", "dense_collective", "experiment", "progress_s",
               "results_dir")
MAX_NAME = 160          # characters of a run folder's name (file systems allow 255)
ID_LENGTH = 10          # hex digits of the identity hash in a folder's name (40 bits)

FINISHED = ("ok", "diverged")
DAMAGED = "damaged"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CHECKPOINT = "checkpoint.pt"
LOCK = ".lock"


class EnvironmentProblem(Exception):
    """The machine, not the config, stops a run: missing or damaged data, a folder that cannot
    be written, a full disk, no SLURM. Reported like a bad config value: one or two lines on
    stderr naming the file or folder and the fix, exit status :attr:`exit_code`."""
    exit_code = 2


class ConfigError(ValueError):
    """A bad config: reported in one line, exit status 2, before any compute."""


class MetricsError(ValueError):
    """A line of metrics.jsonl that is not a row (garbled, or cut by a kill)."""


# ---------------------------------------------------------------- identity

def _drop_nulls(x):
    if isinstance(x, dict):
        return {k: _drop_nulls(v) for k, v in x.items() if v is not None}
    return x


def identity(config: dict | None) -> dict | None:
    """The part of a resolved config (a plain dict) that decides a run's results: without the
    :data:`OPERATIONAL` keys and without keys set to null."""
    if config is None:
        return None
    return _drop_nulls({k: v for k, v in config.items() if k not in OPERATIONAL})


def flatten(d: dict, prefix: str = "") -> dict:
    """``{"method": {"lr": 0.1}}`` as ``{"method.lr": 0.1}``."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def group_key(config: dict) -> dict:
    """The flat identity of a run less its seed: the runs of one group (a table's row, a
    figure's curve) differ only in their seed."""
    flat = flatten(identity(config) or {})
    flat.pop("seed", None)
    return flat


def run_id(config: dict, data: str | None) -> str:
    """The hash of a run's identity: its config's :func:`identity` and its data's identity
    (``data``: a task's ``data_identity``; None for a task without data files)."""
    text = json.dumps({"config": identity(config), "data": data}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:ID_LENGTH]


def _value(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return repr(v) if isinstance(v, float) else str(v)


def folder_name(config: dict, data: str | None) -> str:
    """A run folder's name: what a reader scans for (the compressor, the method's settings in
    the schema's order, the seed), then ``id=`` and :func:`run_id`, which tells apart runs that
    differ in anything else (the budget, the task's settings, the data). A method's name is the
    folder above. At most :data:`MAX_NAME` characters: a longer name drops whole settings from
    the last method setting backwards (``...`` marks where), keeping the seed; a value is never
    cut (a name that fits is as it always was)."""
    c = identity(config)
    comp, method = c.get("compressor") or {}, c.get("method") or {}
    parts = []
    if comp.get("name"):
        parts.append(f"compressor={comp['name']}")
    parts += [f"{k}={_value(v)}" for k, v in comp.items() if k != "name"]
    parts += [f"{k}={_value(v)}" for k, v in method.items() if k != "name"]
    seed = [f"seed={c['seed']}"] if "seed" in c else []
    tag = f"id={run_id(config, data)}"
    room = MAX_NAME - len(tag) - 1
    shown = parts + seed
    if len(",".join(shown)) > room:           # drop the last settings, whole, before the seed
        kept = list(parts)
        while kept and len(",".join(kept + ["..."] + seed)) > room:
            kept.pop()
        shown = kept + ["..."] + seed
        if len(",".join(shown)) > room:        # a seed too long to show: the hash alone
            shown = []
    name = ",".join(shown).replace("/", "-")
    return f"{name},{tag}" if name else tag


# ---------------------------------------------------------------- reading

def read_summary(run_dir: str | Path) -> dict | None:
    """summary.json as a dict, or None (no summary, or one that does not parse)."""
    try:
        s = json.loads((Path(run_dir) / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    return s if isinstance(s, dict) else None


def _row(line: str):
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def read_rows(run_dir: str | Path, *, strict: bool = True) -> list[dict]:
    """metrics.jsonl's rows (an empty list when there is no file). A line that is not a JSON
    row raises :class:`MetricsError` naming the file and the line (``strict``), or is skipped
    (``strict=False``: a table of a sweep shows what it can)."""
    path = Path(run_dir) / METRICS
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = _row(line)
        if row is None:
            if strict:
                raise MetricsError(f"{path} line {i} is not a metrics row ({line[:40]!r}): the "
                                   "run is damaged; run it again with overwrite=true")
            continue
        rows.append(row)
    return rows


def digest(path: str | Path, rows: int | None = None) -> dict:
    """``{"rows": complete lines, "sha256": hash of their bytes}`` of a metrics file, or of its
    first ``rows`` lines only (what a checkpoint vouches for). FileNotFoundError if absent."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for line in fh:
            if rows is not None and n == rows:
                break
            if not line.endswith(b"\n"):
                break                      # a line cut by a kill is not a row
            h.update(line)
            n += 1
    return {"rows": n, "sha256": h.hexdigest()}


# ---------------------------------------------------------------- consistency

def _first_garbled(path: Path) -> str | None:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for i, line in enumerate(fh, 1):
            if line.strip() and _row(line) is None:
                return f"line {i} is not a row"
    return None


def damage(run_dir: str | Path, summary: dict | None) -> str | None:
    """Why ``run_dir``'s metrics.jsonl is not the file ``summary`` describes, or None when it
    is (or when the summary predates that record: see the module docstring). ``summary``
    None: summary.json cannot be read."""
    if summary is None:
        return f"{SUMMARY} is unreadable"
    want = summary.get("metrics")
    if not isinstance(want, dict):
        return None
    path = Path(run_dir) / METRICS
    try:
        have = digest(path)
    except FileNotFoundError:
        return f"{METRICS} is missing"
    if have == {"rows": want.get("rows"), "sha256": want.get("sha256")}:
        return None
    garbled = _first_garbled(path)
    if garbled:
        return f"{METRICS} {garbled}"
    if have["rows"] != want.get("rows"):
        return f"{METRICS} has {have['rows']} rows, {SUMMARY} says {want.get('rows')}"
    return f"{METRICS} differs from the file {SUMMARY} describes (sha256)"


def _same(a, b) -> bool:
    """Equal as JSON (NaN equals NaN: a diverged run's last row holds NaN)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def verify_legacy(run_dir: str | Path, summary: dict) -> str | None:
    """Why a summary without the metrics record does not match its metrics.jsonl, or None:
    every line is a row, the last row is the summary's ``final`` row, and its step and uplink
    are the summary's ``steps_done`` and ``comm``."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return f"{METRICS} is missing"
    try:
        rows = read_rows(run_dir)
    except MetricsError:
        return f"{METRICS} {_first_garbled(path)}"
    last = rows[-1] if rows else {}
    if "final" in summary and not _same(last, summary["final"] or {}):
        return (f"the last of {METRICS}'s {len(rows)} rows (step {last.get('step')}) is not the "
                f"final row of {SUMMARY} (step {(summary['final'] or {}).get('step')})")
    for key, col in (("steps_done", "step"), ("comm", "comm")):
        if key in summary and col in last and not _same(summary[key], last[col]):
            return f"{SUMMARY} says {key} {summary[key]}, the last row of {METRICS} {last[col]}"
    return None


# ---------------------------------------------------------------- status

def is_locked(run_dir: str | Path) -> bool:
    """Whether a live process holds ``run_dir``'s lock (a run in progress elsewhere)."""
    path = Path(run_dir) / LOCK
    try:
        fh = open(path)
    except OSError:
        return False
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def status(run_dir: str | Path, summary: dict | None = None) -> str:
    """ok | diverged | damaged | failed | running | interrupted | missing (module docstring).
    ``summary``: summary.json already read by the caller."""
    run_dir = Path(run_dir)
    s = summary if summary is not None else read_summary(run_dir)
    if s is not None:
        st = s.get("status", "unknown")
        if st in FINISHED and damage(run_dir, s) is not None:
            return DAMAGED
        return st
    if (run_dir / SUMMARY).exists():         # written atomically: unreadable means damaged
        return DAMAGED
    if is_locked(run_dir):
        return "running"
    return "interrupted" if (run_dir / CHECKPOINT).exists() else "missing"


def same_run(summary: dict | None, config: dict, data: str | None) -> bool:
    """Whether ``summary`` records the run of ``config`` on ``data``: the same identity, and the
    same data where the summary recorded its data (runs written before did not)."""
    if not summary or identity(summary.get("config")) != identity(config):
        return False
    return summary.get("data_id") is None or data is None or summary["data_id"] == data


def is_finished(run_dir: str | Path, config: dict | None = None, data: str | None = None) -> bool:
    """A finished run whose files agree (status ok or diverged) and, when ``config`` is
    given, the run of that config (on ``data``)."""
    s = read_summary(run_dir)
    if not s or status(run_dir, s) not in FINISHED:
        return False
    return config is None or same_run(s, config, data)


def difference(a: dict | None, b: dict | None) -> str:
    """The first key in which two configs' identities differ, as ``key: A here, B there``."""
    fa, fb = flatten(identity(a) or {}), flatten(identity(b) or {})
    for k in sorted(set(fa) | set(fb)):
        if fa.get(k) != fb.get(k):
            return f"{k}: {fa.get(k)} here, {fb.get(k)} there"
    return "the data"


def shown(run_dir: Path) -> str:
    """The run folder as the logs show it: relative to the working directory when inside it, so
    a run's log, committed with its results, holds no path of the machine that wrote it."""
    try:
        return str(Path(run_dir).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(run_dir)


# ---------------------------------------------------------------- one writer per folder

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
