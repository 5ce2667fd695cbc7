"""A run as readers see it: its identity, its status, its metric rows, and whether its files agree.

Everyone who asks "which run is this?", "is it finished?" or reads its rows uses this module: the
run lifecycle (skip, resume or refuse), the sweeper (launch or not), the sweep report, ``make
summarize``, the migration command and the figures. It imports neither hydra nor torch. It also
holds what keeps parallel writers apart: the folder lock (:class:`RunLock`: one writer per run
folder). The atomic writes of every file that parallel jobs share are
:mod:`experiments.shared.files`'.

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
  are intact (a run of another config is refused such a folder: ``experiments.run.resume.other_run``).
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
