"""A run folder as readers see it: its status, its metric rows, and whether its files agree.

Everyone who asks "is this run finished?" or reads its rows uses this module: the run lifecycle
(skip or redo), the sweeper (launch or not), the sweep report, ``make summarize``, the
migration command and the figures. It imports neither hydra nor torch.

A run folder (written by :class:`experiments.run.record.RunLog`) holds ``metrics.jsonl`` (one
JSON row per logged step) and, once the run ends, ``summary.json``. The summary records how many
rows ``metrics.jsonl`` had and the SHA-256 of its bytes (``summary["metrics"]``), so a finished
run is one whose summary says so *and* whose metrics file is the one the summary describes.

Statuses (:func:`status`):

* ``ok``, ``diverged``: finished (:data:`FINISHED`); a re-run skips them.
* ``damaged``: summary.json says finished, but metrics.jsonl is missing, cut, garbled or edited
  (its row count or hash differ from the summary's). A re-run says so in one line and recomputes
  the run, or resumes it from a checkpoint whose rows are intact.
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
from pathlib import Path

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


class MetricsError(ValueError):
    """A line of metrics.jsonl that is not a row (garbled, or cut by a kill)."""


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


def damage(run_dir: str | Path, summary: dict) -> str | None:
    """Why ``run_dir``'s metrics.jsonl is not the file ``summary`` describes, or None when it
    is (or when the summary predates that record: see the module docstring)."""
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
    if is_locked(run_dir):
        return "running"
    return "interrupted" if (run_dir / CHECKPOINT).exists() else "missing"


def is_finished(run_dir: str | Path) -> bool:
    """A finished run whose files agree (status ok or diverged)."""
    return status(run_dir) in FINISHED
