"""What a run folder holds already, and what a run does with it.

* **Another run** (:func:`other_run`): its summary, its checkpoint or, for a damaged record,
  its config.json records another identity. Such a folder is never overwritten (unless
  ``overwrite``): the command line asks before hydra writes into the folder, the sweeper before
  launching, and the run again before it starts.
* **A checkpoint of this run** (:func:`resumable`): every ``checkpoint_every`` steps and on
  SIGTERM/SIGINT/SIGUSR1/SIGUSR2 the state is written to ``<run_dir>/checkpoint.pt``
  (:mod:`experiments.run.checkpoint`). A run that finds one written with the same config resumes
  from it bit-identically: same parameters, same metric rows, no row missing or repeated, as
  long as metrics.jsonl still starts with the rows the checkpoint was written after.
* **A damaged finished run** (:func:`damaged`): "ok" and "diverged" are finished (a re-run skips
  them) as long as metrics.jsonl is the file the summary describes; else the run is "damaged"
  (:mod:`experiments.shared.runs`) and is done again (resumed from a checkpoint whose rows are
  intact, else recomputed), after a line that says so.
* **A shorter twin elsewhere** (:func:`extension`): with ``extend_from`` (a folder of finished
  runs), a run that has nothing to resume starts from the final state of the same run on a
  smaller budget: a budget only decides when a run stops, so the twin's rows are this run's
  first rows.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from experiments.shared import runs
from experiments.shared.files import atomic_write
from .checkpoint import job_key, load_checkpoint

log = logging.getLogger("experiments.run")
BUDGETS = ("max_comm", "steps", "max_grads")   # the keys an extension may raise


def other_run(run_dir: Path, config: dict, data: str | None, checkpoint: str = runs.CHECKPOINT,
              writer: bool = True) -> str | None:
    """Why ``run_dir`` holds another run than ``config`` on ``data`` (its summary or its
    checkpoint records another identity), in two lines, or None."""
    run_dir = Path(run_dir)
    fix = "choose another folder (hydra.run.dir=PATH), or pass overwrite=true to replace that run"
    s = runs.read_summary(run_dir) if writer else None
    if s is not None and s.get("config") is not None and not runs.same_run(s, config, data):
        why = (runs.difference(config, s["config"])
               if runs.identity(s["config"]) != runs.identity(config)
               else f"the data: {str(data)[:12]} here, {str(s.get('data_id'))[:12]} there")
        return f"{runs.shown(run_dir)} holds another run ({s.get('status')}; {why})\n  {fix}"
    unreadable = None
    if writer and (s is None or s.get("config") is None) and (run_dir / runs.SUMMARY).exists():
        unreadable = runs.SUMMARY + (" records no config" if s is not None else " is unreadable")
    path = run_dir / checkpoint
    saved = load_checkpoint(path, quiet=True) if s is None and path.exists() else None
    if saved is not None and saved.get("config") != runs.identity(config):
        return (f"{runs.shown(run_dir)} holds the checkpoint of another run "
                f"({runs.difference(config, saved.get('config'))})\n  {fix}")
    if saved is None and s is None and path.exists():
        unreadable = unreadable or f"{checkpoint} is unreadable"
    if unreadable and saved is None:
        # A damaged record: the run it belongs to is known from config.json (written when it
        # started); a folder whose run cannot be told is never given to another config.
        started = _started_config(run_dir)
        if started is None or runs.identity(started) != runs.identity(config):
            why = (runs.difference(config, started) if started is not None
                   else "config.json cannot tell which run it was")
            return (f"{runs.shown(run_dir)} holds a damaged run ({unreadable}; {why})\n  {fix}")
    return None


def _started_config(run_dir: Path) -> dict | None:
    """The config that ``run_dir``'s run recorded when it started (config.json), or None."""
    try:
        config = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def resumable(saved: dict | None, config: dict, overwrite: bool,
              run_dir: Path | None = None) -> dict | None:
    """A checkpoint is used when it was written with the same config; with ``overwrite`` only
    when it was written by this very scheduler job (a requeue), not by an earlier run; and,
    given the ``run_dir`` whose metrics.jsonl it continues (the writing process), only when
    that file still starts with the rows the checkpoint was written after."""
    if saved is None:
        return None
    if saved.get("config") != runs.identity(config):
        log.info("[checkpoint] config changed since the checkpoint: starting over")
        return None
    if overwrite and (saved.get("job") is None or saved.get("job") != job_key()):
        return None
    problem = _rows_problem(run_dir, saved) if run_dir is not None else None
    if problem:
        log.info("[checkpoint] %s: %s: starting over", runs.shown(run_dir), problem)
        return None
    return saved


def _rows_problem(run_dir: Path, saved: dict) -> str | None:
    """Why metrics.jsonl no longer holds the rows a checkpoint was written after, or None."""
    n = int(saved.get("rows", 0))
    try:
        have = runs.digest(run_dir / runs.METRICS, rows=n)
    except FileNotFoundError:
        return f"{runs.METRICS} is missing (the checkpoint was written after {n} rows)"
    if have["rows"] < n:
        return (f"{runs.METRICS} has {have['rows']} complete rows, the checkpoint was written "
                f"after {n}")
    want = saved.get("rows_sha256")
    if want is not None and have["sha256"] != want:
        return f"the first {n} rows of {runs.METRICS} are not those the checkpoint was written after"
    if want is None:                          # a checkpoint of an earlier version
        with open(run_dir / runs.METRICS) as fh:
            for i, (line, _) in enumerate(zip(fh, range(n)), 1):
                try:
                    json.loads(line)
                except ValueError:
                    return f"{runs.METRICS} line {i} is not a row"
    return None


def damaged(run_dir: Path, config: dict) -> str | None:
    """Why a finished run of this config is damaged (it is not skipped), or None."""
    s = runs.read_summary(run_dir)
    if (s is None or s.get("config") is None) and (run_dir / runs.SUMMARY).exists():
        return f"{runs.SUMMARY} is unreadable"     # other_run: config.json says it is this run
    if not s or s.get("status") not in runs.FINISHED or not runs.same_run(s, config, None):
        return None
    return runs.damage(run_dir, s)


def extension(folder: Path, run_dir: Path, config: dict, data: str | None) -> dict | None:
    """Start a run from a shorter twin's final state (``extend_from``: a folder of finished runs,
    such as a sweep's): a run under ``folder`` that finished "ok" with this run's identity except
    a smaller budget (:data:`BUDGETS`) and kept its final checkpoint (``keep_checkpoint``).

    The result is the run this config would compute from step 0: the twin's steps are this run's
    first steps (a budget only decides when a run stops), so its rows are copied and training
    resumes from its final state. That holds only when the twin's last row is one this run logs
    too: the twin stopped on an uplink budget that is a multiple of ``log_comm`` (the step
    crossing it crosses a multiple of ``log_comm``), or at a multiple of ``log_every``. A twin
    that fails a condition is passed over (logged), and the run starts from step 0.

    Returns the checkpoint to resume from (its config made this run's, ``extended_from`` the
    twin's folder), or None. The copied rows are written into ``run_dir`` atomically."""
    mine = {k: v for k, v in (runs.identity(config) or {}).items() if k not in BUDGETS}
    for summary_path in sorted(folder.glob("**/" + runs.SUMMARY)):
        twin = summary_path.parent
        if twin.resolve() == run_dir.resolve():
            continue
        s = runs.read_summary(twin)
        theirs = runs.identity((s or {}).get("config"))
        if not s or theirs is None or {k: v for k, v in theirs.items() if k not in BUDGETS} != mine \
                or (data is not None and s.get("data_id") not in (None, data)):
            continue
        why = _not_a_prefix(twin, s, config)
        saved = load_checkpoint(twin / runs.CHECKPOINT) if why is None else None
        if why is None and (saved is None or saved.get("config") != theirs):
            why = "no final checkpoint of that run (keep_checkpoint was not set)"
        if why is None:
            why = _rows_problem(twin, saved)
        if why is not None:
            log.info("[extend] %s: not from %s: %s", runs.shown(run_dir), runs.shown(twin), why)
            continue
        with open(twin / runs.METRICS, "rb") as fh:
            rows = b"".join(line for line, _ in zip(fh, range(int(saved["rows"]))))
        atomic_write(run_dir / runs.METRICS, lambda fh: fh.write(rows))
        log.info("[extend] %s: from %s at step %d (%d rows copied)", runs.shown(run_dir),
                 runs.shown(twin), saved["method"]["k"], saved["rows"])
        return {**saved, "config": runs.identity(config), "job": None, "wandb_id": None,
                "extended_from": runs.shown(twin)}
    return None


def _not_a_prefix(twin: Path, s: dict, config: dict) -> str | None:
    """Why the finished run ``twin`` (summary ``s``) is not the beginning of ``config``'s run,
    or None: it must have finished "ok" on a smaller budget, with a last row this run logs too."""
    if runs.status(twin, s) != "ok":
        return f"its status is {runs.status(twin, s)}, not ok"
    theirs = s["config"]
    for key in BUDGETS:
        a, b = theirs.get(key), config.get(key)
        if a is not None and (b is None or b < a):
            return f"its {key} {a} is not below this run's {b}"
    k, last = int(s.get("steps_done", -1)), s.get("final") or {}
    log_comm, log_every, max_comm = config.get("log_comm"), config.get("log_every"), theirs.get("max_comm")
    on_comm = (max_comm is not None and log_comm and last.get("comm", -1) >= max_comm
               and abs(max_comm / log_comm - round(max_comm / log_comm)) < 1e-9)
    on_steps = bool(log_every) and k % int(log_every) == 0
    if not (on_comm or on_steps):
        return (f"its last row (step {k}) is not one this run logs (it stopped neither on an "
                "uplink budget that is a multiple of log_comm nor at a multiple of log_every)")
    return None
