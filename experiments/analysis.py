"""From run directories to curves, tuning choices and the reduction table.

A run is read from its ``summary.json`` (config, status) and ``metrics.jsonl`` (rows with
``comm``, ``bytes`` and the tracked metric, ``gap`` for a5a or ``loss`` for the CNN). Runs
that differ only in their seed form a group; groups are summarised on a common
communication grid.
"""
from __future__ import annotations

import csv
import json
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .runlog import read_metrics, read_summary

# Config keys that do not change what a run computes (ignored when grouping runs).
NON_SEMANTIC = {"seed", "overwrite", "threads", "wandb", "data_dir", "experiment", "results_dir",
                "checkpoint_every", "launcher"}


@dataclass
class Run:
    path: Path
    summary: dict       # summary.json as written by experiments.runlog
    rows: list[dict]    # metrics.jsonl

    @property
    def config(self) -> dict:
        return self.summary["config"]

    @property
    def status(self) -> str:
        return self.summary["status"]

    def series(self, key: str, x: str = "comm") -> tuple[np.ndarray, np.ndarray]:
        comm = np.array([r[x] for r in self.rows], dtype=float)
        val = np.array([r.get(key, math.nan) for r in self.rows], dtype=float)
        return comm, val


def load_runs(root: str | Path) -> list[Run]:
    """Every finished run (status ok or diverged) below ``root``."""
    runs = []
    for summary in sorted(Path(root).rglob("summary.json")):
        s = read_summary(summary.parent)
        if s and s.get("status") in ("ok", "diverged"):
            runs.append(Run(summary.parent, s, read_metrics(summary.parent)))
    return runs


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def group_key(config: dict) -> tuple:
    flat = flatten({k: v for k, v in config.items() if k not in NON_SEMANTIC})
    return tuple(sorted((k, json.dumps(v)) for k, v in flat.items()))


def group_runs(runs: Iterable[Run]) -> dict[tuple, list[Run]]:
    groups: dict[tuple, list[Run]] = defaultdict(list)
    for r in runs:
        groups[group_key(r.config)].append(r)
    return dict(groups)


def value_at(run: Run, key: str, grid: np.ndarray, x: str = "comm") -> np.ndarray:
    """The metric as a step function of communication (or of ``x``, e.g. "step"): the last
    logged value at comm <= c.

    A diverged run is +inf from the point it stopped; grid points past the run's end
    (budget not reached) are NaN."""
    comm, val = run.series(key, x)
    idx = np.searchsorted(comm, grid, side="right") - 1
    out = np.where(idx >= 0, val[np.clip(idx, 0, None)], np.nan)
    past = grid > comm[-1]
    out[past] = np.inf if run.status == "diverged" else np.nan
    if run.status == "diverged":
        out[~np.isfinite(out)] = np.inf
    return out


def comm_grid(budget: float, points: int = 200) -> np.ndarray:
    return np.linspace(0.0, budget, points + 1)


def log_area(runs: Sequence[Run], key: str, budget: float) -> float:
    """Tuning criterion: mean over seeds of the average of log10(metric) over the comm grid
    [0, budget] (the area under the log curve; rewards speed and the final level alike).
    Diverged runs or runs that stop before the budget score +inf."""
    grid = comm_grid(budget)
    scores = []
    for r in runs:
        v = value_at(r, key, grid)
        if np.isnan(v).any():          # stopped before the budget
            return math.inf
        if not np.all(np.isfinite(v)) or np.any(v <= 0):
            v = np.where(v > 0, v, 1e-16)
            if not np.all(np.isfinite(v)):
                return math.inf
        scores.append(float(np.mean(np.log10(v))))
    return float(np.mean(scores))


def first_hit(run: Run, key: str, eps: float) -> float:
    """Communication at the first logged row with metric <= eps (NaN if never)."""
    comm, val = run.series(key)
    hit = np.nonzero(val <= eps)[0]
    return float(comm[hit[0]]) if hit.size else math.nan


def comm_to_reach(runs: Sequence[Run], key: str, eps: float) -> tuple[float, int]:
    """Mean over seeds of first_hit, and how many seeds reached eps (mean is NaN unless all did)."""
    hits = [first_hit(r, key, eps) for r in runs]
    reached = sum(not math.isnan(h) for h in hits)
    return (float(np.mean(hits)) if reached == len(hits) else math.nan), reached


def reduction_table(groups: dict[str, Sequence[Run]], key: str, eps_list: Sequence[float],
                    baselines: Sequence[str], task: str) -> list[dict]:
    """For every method and eps: comm to reach eps, and 1 - comm / (best baseline's comm)."""
    rows = []
    for eps in eps_list:
        reach = {m: comm_to_reach(rs, key, eps) for m, rs in groups.items()}
        base = [reach[b][0] for b in baselines if b in reach and not math.isnan(reach[b][0])]
        best = min(base) if base else math.nan
        best_name = next((b for b in baselines if b in reach and reach[b][0] == best), "")
        for m, (c, n) in reach.items():
            rows.append({"task": task, "method": m, "eps": eps, "comm": c,
                         "seeds_reached": n, "seeds": len(groups[m]),
                         "baseline": best_name, "baseline_comm": best,
                         "reduction": 1.0 - c / best if best > 0 and not math.isnan(c) else math.nan})
    return rows


def write_table(rows: list[dict], csv_path: Path, md_path: Path | None = None,
                replace_task: str | None = None) -> None:
    """Write the table; rows of other tasks already in the CSV are kept (a5a and CNN share it)."""
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    keep = []
    if replace_task and csv_path.exists():
        with open(csv_path) as fh:
            keep = [r for r in csv.DictReader(fh) if r["task"] != replace_task]
    fields = ["task", "method", "eps", "comm", "seeds_reached", "seeds", "baseline",
              "baseline_comm", "reduction"]
    with open(csv_path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in sorted(keep + rows, key=lambda r: r["task"]):   # stable: a5a, then cnn
            w.writerow({k: r[k] for k in fields})
    if md_path is not None:
        with open(csv_path) as fh:
            all_rows = list(csv.DictReader(fh))
        md_path.write_text(markdown_table(all_rows))


def _fmt(x, pct=False):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(v):
        return "not reached"
    return f"{100 * v:.0f}%" if pct else f"{v:.4g}"


def markdown_table(rows: list[dict]) -> str:
    head = "| task | method | eps | comm to reach eps | seeds reached | best baseline | reduction |\n"
    head += "|---|---|---|---|---|---|---|\n"
    lines = [f"| {r['task']} | {r['method']} | {float(r['eps']):g} | {_fmt(r['comm'])} | "
             f"{r['seeds_reached']}/{r['seeds']} | {r['baseline']} ({_fmt(r['baseline_comm'])}) | "
             f"{_fmt(r['reduction'], pct=True) if r['method'] != r['baseline'] else '-'} |"
             for r in rows]
    return head + "\n".join(lines) + "\n"


def curves(groups: dict[str, Sequence[Run]], key: str, budget: float,
           points: int = 400, x: str = "comm") -> list[dict]:
    """Per label and grid point of ``x`` in [0, budget]: mean, min and max over seeds of the
    metric, and the mean wire bytes (column ``x`` holds the grid)."""
    grid = comm_grid(budget, points)
    out = []
    for label, runs in groups.items():
        vals = np.stack([value_at(r, key, grid, x) for r in runs])
        byts = np.stack([_bytes_at(r, grid, x) for r in runs])
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # grid points no seed reached
            mean, lo, hi = np.nanmean(vals, 0), np.nanmin(vals, 0), np.nanmax(vals, 0)
            bmean = np.nanmean(byts, 0)
        for c, m, a, b, by in zip(grid, mean, lo, hi, bmean):
            if math.isnan(m):
                continue
            out.append({"label": label, x: float(c), "mean": float(m), "min": float(a),
                        "max": float(b), "bytes": float(by), "seeds": len(runs)})
    return out


def _bytes_at(run: Run, grid: np.ndarray, x: str = "comm") -> np.ndarray:
    comm, byts = run.series("bytes", x)
    return np.interp(grid, comm, byts, right=np.nan)


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        path.write_text("")
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))   # union, in first-seen order
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def _num(v: str):
    try:
        return float(v)
    except ValueError:
        return v


def read_csv(path: Path) -> list[dict]:
    """Rows of a CSV written by :func:`write_csv`, numbers as floats, labels as strings."""
    with open(path) as fh:
        return [{k: (v if k in ("label", "task", "method", "baseline", "panel", "xaxis")
                     else _num(v)) for k, v in r.items()} for r in csv.DictReader(fh)]
