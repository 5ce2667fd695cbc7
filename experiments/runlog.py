"""A run's record on disk: metrics.jsonl (a row per logged step) and summary.json.

Everything needed to trust a number later is written with it: the resolved config, the seed,
the git commit (and whether the tree was dirty), the wall time and the status (ok, diverged,
failed). A finished run directory is skipped when the same config is run again, and replaced
when the config differs or ``overwrite`` is set; rows are never appended to an old file.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from .datasets import REPO

FINISHED = ("ok", "diverged")


def git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        return {"git_commit": git("rev-parse", "HEAD") or None,
                "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}


def read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def is_finished(run_dir: Path, config: dict | None = None) -> bool:
    s = read_summary(run_dir)
    if not s or s.get("status") not in FINISHED:
        return False
    return config is None or s.get("config") == config


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunLog:
    """Writes one run. ``config`` must be the resolved config (a plain dict)."""

    def __init__(self, run_dir: str | Path, config: dict, *, wandb_cfg: dict | None = None,
                 figure: str | None = None):
        self.dir = Path(run_dir)
        self.config = config
        self.wandb_cfg = wandb_cfg or {}
        self.figure = figure
        self._wandb = None
        self._t0 = time.time()

    def should_skip(self, overwrite: bool = False) -> bool:
        return not overwrite and is_finished(self.dir, self.config)

    def start(self, *, resume_rows: int | None = None) -> None:
        """Open metrics.jsonl fresh (or truncated to ``resume_rows`` rows when resuming)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "metrics.jsonl"
        if resume_rows is None:
            for stale in ("metrics.jsonl", "summary.json"):
                (self.dir / stale).unlink(missing_ok=True)
            self._fh = open(path, "w")
        else:
            rows = read_metrics(self.dir)[:resume_rows]
            with open(path, "w") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)
            self._fh = open(path, "a")
        (self.dir / "config.json").write_text(json.dumps(self.config, indent=2))
        self._start_wandb()

    def _start_wandb(self):
        if not self.wandb_cfg.get("enabled"):
            return
        import wandb  # imported lazily: optional
        c = self.config
        self._wandb = wandb.init(
            project=self.wandb_cfg.get("project", "gluon-fl"), entity=self.wandb_cfg.get("entity"),
            mode=self.wandb_cfg.get("mode", "offline"), dir=str(self.dir),
            group=self.wandb_cfg.get("group") or c.get("experiment") or c.get("task", {}).get("name"),
            job_type=c.get("method", {}).get("name"),
            name=self.dir.name, tags=list(self.wandb_cfg.get("tags") or [])
            + ([self.figure] if self.figure else []),
            config=c, reinit=True, id=_wandb_id(self.dir), resume="allow")
        # Charts against communication: both cost axes are step metrics.
        for x in ("comm", "bytes", "step"):
            wandb.define_metric(x)
        wandb.define_metric("*", step_metric="comm")

    last_row: dict | None = None

    def log(self, row: dict) -> None:
        self.last_row = row
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        if self._wandb is not None:
            self._wandb.log(row)

    def finish(self, status: str, **extra: Any) -> dict:
        self._fh.close()
        summary = {"status": status, **extra, "seed": self.config.get("seed"),
                   **git_commit(), "wall_time": time.time() - self._t0,
                   "host": socket.gethostname(), "python": platform.python_version(),
                   "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": self.config}
        tmp = self.dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, self.dir / "summary.json")
        if self._wandb is not None:
            self._wandb.summary.update({k: v for k, v in summary.items() if k != "config"})
            self._wandb.finish()
        return summary


def _wandb_id(run_dir: Path) -> str:
    import hashlib
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
