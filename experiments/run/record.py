"""A run's record on disk as it goes: metrics.jsonl (a row per logged step), summary.json, the
progress lines of its log and W&B (its checkpoints: :mod:`experiments.run.checkpoint`).

Everything needed to trust a number later is written with it: the resolved config, the seed,
the git commit (and whether the tree was dirty), the wall time and the status (ok, diverged,
failed). A finished run directory is skipped when the same config is run again, and replaced
when the config differs or ``overwrite`` is set; rows are never appended to an old file, except
when a preempted run resumes from its checkpoint (``start(resume_rows=N)`` keeps exactly the N
rows written before the checkpoint).

"The same config" is the same identity (:mod:`experiments.shared.runs`: the config less the
operational keys, and the data): switching W&B on, changing the checkpoint interval or the data
directory does not re-run finished work. The summary records the identity's hash (``id``) and
the data's identity (``data_id``).

summary.json records the row count and SHA-256 of metrics.jsonl as it was when the run ended
(``"metrics": {"rows", "sha256"}``), and a checkpoint the hash of the rows written before it
(:meth:`RunLog.rows_sha256`): a run whose files no longer agree is "damaged"
(:mod:`experiments.shared.runs`) and is done again, never skipped.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from gluon.engine import gradients_per_worker

from experiments.shared import runs
from experiments.shared.errors import EnvironmentProblem
from experiments.shared.runs import FINISHED
from experiments.shared.files import REPO, atomic_write, atomic_write_text


def git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        if commit:
            return {"git_commit": commit,
                    "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        pass
    # a copy of the checkout without its .git (a compute node, a GPU machine) is named by whoever
    # copied it; whether that copy was clean is then unknown
    return {"git_commit": os.environ.get("GLUON_GIT_COMMIT") or None, "git_dirty": None}


class RunRemoved(EnvironmentProblem):
    """The run folder was removed while the run ran (a stopped sweep was cleaned up): the run
    stops without writing there again, so the folder is not made anew around a summary or a
    checkpoint whose rows are gone. Said in two lines, like the other environment problems."""


class WandbError(RuntimeError):
    """W&B was asked for (``wandb.enabled``) and did not start: the run is recorded as failed
    and said in two lines (exit status 1), without W&B's traceback."""


class RunLog:
    """Writes one run. ``config`` must be the resolved config (a plain dict)."""

    def __init__(self, run_dir: str | Path, config: dict, *, wandb_cfg: dict | None = None,
                 figure: str | None = None, enabled: bool = True, data_id: str | None = None):
        self.enabled = enabled       # False on the ranks > 0 of a multi-process run: no writes
        self.dir = Path(run_dir)
        self.config = config
        self.data_id = data_id
        self.wandb_cfg = wandb_cfg or {}
        self.figure = figure
        self._wandb = None
        self._t0 = time.time()

    def should_skip(self, overwrite: bool = False) -> bool:
        return not overwrite and runs.is_finished(self.dir, self.config, self.data_id)

    def start(self, *, resume_rows: int | None = None, wandb_id: str | None = None) -> None:
        """Open metrics.jsonl fresh, or truncated to its first ``resume_rows`` rows when resuming
        from a checkpoint (rows logged after the checkpoint are dropped: they will be logged
        again). ``wandb_id`` continues that W&B run; a fresh start gets a new id."""
        self._hash = hashlib.sha256()
        if not self.enabled:
            self.rows, self.last_row, self.wandb_id = resume_rows or 0, None, wandb_id
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / runs.METRICS
        (self.dir / runs.SUMMARY).unlink(missing_ok=True)
        if resume_rows is None:
            self._fh = open(path, "w")
            self.rows, self.last_row = 0, None
        else:
            # only the first rows are parsed: a line cut by SIGKILL after them does not matter
            with open(path) as fh:
                lines = [line for line, _ in zip(fh, range(resume_rows))]
            rows = [json.loads(line) for line in lines]     # the exact bytes are kept
            if len(rows) != resume_rows or (lines and not lines[-1].endswith("\n")):
                raise RuntimeError(f"{path} has {len(rows)} complete rows, the checkpoint "
                                   f"expects {resume_rows}: cannot resume")
            data = "".join(lines).encode()
            atomic_write(path, lambda fh: fh.write(data))
            self._hash.update(data)
            self._fh = open(path, "a")
            self.rows, self.last_row = len(rows), (rows[-1] if rows else None)
        st = os.fstat(self._fh.fileno())
        self._metrics_file = (st.st_dev, st.st_ino)      # what intact() compares
        atomic_write_text(self.dir / "config.json", json.dumps(self.config, indent=2))
        self.wandb_id = wandb_id or _new_wandb_id(self.dir)
        self._start_wandb(resumed=resume_rows is not None)

    def intact(self) -> bool:
        """Whether the run folder still holds the metrics.jsonl this run writes. False once the
        folder was removed (or the file replaced) while the run ran: a stopped sweep cleaned it
        up, or a user did. Every other process (and rank) is True."""
        if not self.enabled or self._metrics_file is None:
            return True
        try:
            b = os.stat(self.dir / runs.METRICS)
        except OSError:                         # gone (with its folder, or alone)
            return False
        return (b.st_dev, b.st_ino) == self._metrics_file

    def check_intact(self) -> None:
        """Refuse to write into a run folder removed while the run ran: the write would make
        the folder again, holding a summary (or checkpoint) of rows that no longer exist."""
        if not self.intact():
            self.abort()
            raise RunRemoved(f"{runs.shown(self.dir)} was removed while the run ran (its "
                             f"{runs.METRICS} is gone): nothing more is written there\n  "
                             "run the same command to compute it again")

    def rows_sha256(self) -> str:
        """SHA-256 of the rows written so far (a checkpoint records it: resuming needs them)."""
        return self._hash.hexdigest()

    def _start_wandb(self, resumed: bool = False):
        if not self.wandb_cfg.get("enabled"):
            return
        import wandb  # imported lazily: optional
        c = self.config
        method = (c.get("method") or {}).get("name")
        compressor = (c.get("compressor") or {}).get("name")
        task = (c.get("task") or {}).get("name")
        dataset = (c.get("task") or {}).get("dataset")       # logreg's: a5a or a9a
        tags = list(self.wandb_cfg.get("tags") or [])
        tags += [t for t in (self.figure, method, compressor, task, dataset) if t and t not in tags]
        settings = {"silent": True, "console": "off", "x_disable_stats": True,
                    **(self.wandb_cfg.get("settings") or {})}
        try:
            self._wandb = wandb.init(
                project=self.wandb_cfg.get("project", "gluon-fl"),
                entity=self.wandb_cfg.get("entity"), mode=self.wandb_cfg.get("mode", "offline"), dir=str(self.dir),
                # grouped by experiment (figure), then by method (job_type): the UI's two levels
                group=self.wandb_cfg.get("group") or self.figure or task,
                job_type=method, name=_run_name(self.dir, method), tags=tags,
                notes=str(self.dir), config=c, id=self.wandb_id, resume="allow",
                reinit="finish_previous", settings=wandb.Settings(**settings))
        except Exception as err:  # noqa: BLE001 (W&B's own errors: no key, no network, ...)
            mode = self.wandb_cfg.get("mode", "offline")
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise WandbError(f"W&B did not start (wandb.mode={mode}): {first[:160]}\n  log in "
                             "(wandb login, or WANDB_API_KEY) and check the network, or run with "
                             "wandb.mode=offline (make wandb-sync uploads later)") from None
        run = self._wandb
        # Communication is the x-axis of every figure: "comm" (normalised: one dense gradient
        # = 1) is the default step metric of every logged value. Every row also carries the
        # wire "bytes" (and the iteration "step"): a chart's x-axis can be any logged metric,
        # so the same values are plotted against bytes without logging them twice.
        run.define_metric("comm")
        run.define_metric("bytes")
        run.define_metric("step")
        run.define_metric("*", step_metric="comm")
        if resumed:
            run.summary["resumed_at_row"] = self.rows

    last_row: dict | None = None
    rows: int = 0
    _metrics_file: tuple[int, int] | None = None
    wandb_id: str | None = None

    def log(self, row: dict) -> None:
        self.last_row = row
        if not self.enabled:
            self.rows += 1
            return
        line = json.dumps(row) + "\n"
        try:
            self._fh.write(line)
            self._fh.flush()
        except OSError as err:         # e.g. a full disk: say which file
            err.filename = err.filename or str(self.dir / runs.METRICS)
            raise
        self._hash.update(line.encode())
        if self._wandb is not None:
            # W&B's step is the row index: monotonic across a resume, so rows logged again
            # after a requeue (identical values) do not become a second curve.
            self._wandb.log(dict(row), step=self.rows)
        self.rows += 1

    def finish(self, status: str, **extra: Any) -> dict:
        self.check_intact()
        if getattr(self, "_fh", None) is not None:
            self._fh.close()
        if self.enabled:               # what metrics.jsonl holds now: a later change is damage
            try:
                extra["metrics"] = runs.digest(self.dir / runs.METRICS)
            except FileNotFoundError:  # failed before the first row
                pass
        summary = {"status": status, **extra, "seed": self.config.get("seed"),
                   "id": runs.run_id(self.config, self.data_id), "data_id": self.data_id,
                   **git_commit(), "wall_time": time.time() - self._t0,
                   "host": socket.gethostname(), "python": platform.python_version(),
                   "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": self.config}
        if not self.enabled:
            return summary
        atomic_write_text(self.dir / runs.SUMMARY, json.dumps(summary, indent=2))
        if self._wandb is not None:
            self._wandb.summary.update({k: v for k, v in summary.items() if k != "config"})
            self._wandb.finish(exit_code=0 if status in FINISHED else 1)
            self._wandb = None
        return summary

    def abort(self) -> None:
        """Stop writing without a summary (preempted: the run resumes from its checkpoint)."""
        if getattr(self, "_fh", None) is not None and not self._fh.closed:
            try:
                self._fh.close()
            except OSError:            # a full disk: the rows after the checkpoint are dropped
                pass                   # when the run resumes
        if self._wandb is not None:
            try:
                self._wandb.mark_preempting()
                self._wandb.finish(exit_code=1)
            except Exception:  # noqa: BLE001 (never mask the signal being handled)
                pass
            self._wandb = None


def _run_name(run_dir: Path, method: str | None) -> str:
    name = Path(run_dir).name
    return name if not method or name.startswith(method) or method in name else f"{method}:{name}"


def _new_wandb_id(run_dir: Path) -> str:
    """A new W&B run id per fresh start (a re-run after overwrite is a new W&B run); the
    checkpoint stores it, so a resumed run continues the same W&B run."""
    import uuid
    return (hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
            + uuid.uuid4().hex[:8])


# ---------------------------------------------------------------- progress lines

class Progress:
    """A log line every ``progress_s`` seconds of wall time: step, uplink, the last logged
    metric, steps/s and the time left (by steps, or by uplink when a budget stops the run)."""

    def __init__(self, cfg, method):
        self.every = float(cfg.get("progress_s", 10.0) or 0.0)
        self.steps, self.max_comm, self.max_grads = cfg.steps, cfg.get("max_comm"), cfg.get("max_grads")
        self.method = method
        self.t0 = time.monotonic()
        self.k0, self.done0 = method.k, self.done()
        self.next = self.t0 + self.every

    def done(self) -> float:
        """The fraction of the run done: of its steps, or of its uplink budget when that is
        reached first."""
        m = self.method
        done = m.k / self.steps if self.steps else 1.0
        if self.max_comm:
            done = max(done, m.comm.ledger.cost / self.max_comm)
        if self.max_grads:
            done = max(done, gradients_per_worker(m) / self.max_grads)
        return min(done, 1.0)

    def tick(self, row: dict | None) -> None:
        if not self.every:
            return
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + self.every
        m = self.method
        rate = (m.k - self.k0) / max(now - self.t0, 1e-9)
        comm = m.comm.ledger.cost
        done = self.done()
        left = (now - self.t0) * (1 - done) / (done - self.done0) if done > self.done0 \
            else float("nan")
        metric = ""
        if row:
            key = "gap" if "gap" in row else "loss" if "loss" in row else None
            metric = f" | {'f - f*' if key == 'gap' else key} {row[key]:.4g}" if key else ""
        logging.getLogger("experiments.run").info(
            "step %d/%d | uplink %.4g%s%s | %s steps/s | %.0f%% | %s left",
            m.k, self.steps, comm, f"/{self.max_comm:g}" if self.max_comm else "", metric,
            _rate(rate), 100 * done, _duration(left))


def _rate(r: float) -> str:
    """Steps a second: whole above 10, two significant digits below (0.47, not 0)."""
    return f"{r:.0f}" if r >= 10 else f"{r:.2g}"


def _duration(s: float) -> str:
    if s != s:
        return "?"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
