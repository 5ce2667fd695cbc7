"""A table of every config in a sweep: final and best metric, uplink, status, over seeds.

    python -m scripts.analysis.summarize results/sweeps/fig3
    python -m scripts.analysis.summarize results/sweeps/tune_fig2 --sort comm --out tune.csv
    python -m scripts.analysis.summarize results/sweeps/fig2_cnn_cpu --metric test_acc --per-run

The runs are the sweep's job folders (:func:`experiments.run.sweep.sweep_runs`: every folder
holding ``.hydra/overrides.yaml`` or a summary.json, with its status). Runs whose configs differ only in the seed
or in operational keys (:data:`experiments.shared.runs.OPERATIONAL`) form one config; the
table has a row per config (``--per-run``: a row per run) with

* the config keys that differ between the sweep's configs, one column each (derived from the
  configs: ``method``, ``method.lr``, ``compressor.density``, ...; a ``<group>.name`` key is
  shown as ``<group>``, a key named as one of the table's own columns as ``config:<key>``,
  e.g. ``config:steps``, the iteration cap); the keys shared by every config are named in the
  header line;
* ``n`` (runs), ``status`` (``3 ok``, ``2 ok, 1 diverged``, ...);
* ``final_<metric>`` and ``final_<metric>_std``: mean and sample standard deviation over the
  seeds of the last logged value; ``best_<metric>``: mean over the seeds of each run's best
  logged value (the smallest, or the largest for an accuracy);
* ``comm`` (uplink per worker, in dense gradients), ``steps`` and ``train_s``: means.

The line above the table ends with the compute the sweep spent: its runs' training times summed,
in hours of one core (each run is one process).

The metric is ``gap`` when the runs log it (a5a), else ``loss``, unless ``--metric`` names
another. A diverged run's final value is the worst possible (+inf, -inf for an accuracy), so
its config's mean says so; runs that failed, are damaged (summary.json and metrics.jsonl
disagree: :mod:`experiments.shared.runs`) or have not finished (running, interrupted, missing) are
counted in ``status`` with NaN metrics and are left out of the means; each damaged run is named
with what is wrong, and runs whose summary predates the metrics record are counted (``python -m
experiments.run.migrate`` checks and records them). Rows are
sorted best first by the final metric (``--sort`` names other columns). The table is printed
and written as CSV, by default to ``<sweep>/summary.csv`` (``summary_runs.csv`` with
``--per-run``), atomically. A folder without run folders is an error (exit status 2).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

import pandas as pd

from experiments.shared.files import atomic_write_text
from experiments.shared.runs import DAMAGED, FINISHED, damage, flatten, group_key, read_rows, read_summary
from experiments.run.sweep import sweep_runs

STATUS_ORDER = ("ok", "diverged", "damaged", "failed", "interrupted", "running", "missing")
NUMERIC = ("comm", "steps", "train_s")


class SummaryError(ValueError):
    """Not a sweep, or an option that does not fit it: one line, exit status 2."""


def maximised(metric: str) -> bool:
    """Whether larger is better: accuracies (``test_acc``, ``acc``, ``accuracy``)."""
    return metric.endswith("acc") or metric.endswith("accuracy")


# ---------------------------------------------------------------- one run

def run_config(run_dir: Path, summary: dict | None) -> dict | None:
    """The run's resolved config: from summary.json, else config.json (written when the run
    starts), else hydra's .hydra/config.yaml (written when the job starts)."""
    if summary and isinstance(summary.get("config"), dict):
        return summary["config"]
    try:
        return json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        pass
    try:
        import yaml
        cfg = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
        return cfg if isinstance(cfg, dict) else None
    except (OSError, ImportError, ValueError):
        return None


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def load_run(run_dir: Path, status: str) -> dict:
    """What the table needs from one run folder: its status, summary, config and (finished
    runs only) its logged rows."""
    summary = read_summary(run_dir)
    summary = summary if isinstance(summary, dict) else None
    return {"dir": run_dir, "status": status, "summary": summary,
            "config": run_config(run_dir, summary),
            "rows": read_rows(run_dir, strict=False) if status in FINISHED and summary else [],
            "damage": damage(run_dir, summary) if status == DAMAGED else None,
            "legacy": status in FINISHED and "metrics" not in summary}


def run_record(run: dict, metric: str) -> dict:
    """One run's row: seed, status, final and best ``metric``, comm, steps, train time.
    Everything but the seed and status is NaN unless the run finished (ok or diverged)."""
    summary, config, status, rows = run["summary"], run["config"], run["status"], run["rows"]
    nan = math.nan
    seed = (summary or {}).get("seed", (config or {}).get("seed"))
    row = {"seed": seed if isinstance(seed, int) else None, "status": status,
           "final": nan, "best": nan, "comm": nan, "steps": nan, "train_s": nan}
    if status not in FINISHED or summary is None:
        return row
    values = [r[metric] for r in rows if metric in r]
    final = (summary.get("final") or {}).get(metric, values[-1] if values else None)
    if _finite(final):
        row["final"] = float(final)
    elif status == "diverged":     # the worst value: the config's mean says it diverged
        row["final"] = -math.inf if maximised(metric) else math.inf
    finite = [float(v) for v in values if _finite(v)]
    if finite:
        row["best"] = max(finite) if maximised(metric) else min(finite)
    last = rows[-1] if rows else {}
    row["comm"] = _number(summary.get("comm", last.get("comm")))
    row["steps"] = _number(summary.get("steps_done", last.get("step")))
    row["train_s"] = _number(summary.get("train_time"))
    return row


def choose_metric(runs: list[dict], metric: str | None) -> str:
    """``metric`` if given (it must be logged by the finished runs, when there are any), else
    gap when logged, else loss."""
    logged: set[str] = set()
    for run in runs:
        row = (run["summary"] or {}).get("final") or (run["rows"][-1] if run["rows"] else {})
        if run["status"] in FINISHED:
            logged |= {k for k in row if k not in ("step", "comm", "bytes")}
    if metric is not None:
        if logged and metric not in logged:
            raise SummaryError(f"--metric {metric}: the runs log {', '.join(sorted(logged))}")
        return metric
    for m in ("gap", "loss"):
        if m in logged or not logged:
            return m
    raise SummaryError(f"no gap or loss logged: choose --metric among {', '.join(sorted(logged))}")


# ---------------------------------------------------------------- the table

def _status_text(statuses) -> str:
    counts = Counter(statuses)
    order = sorted(counts, key=lambda s: (STATUS_ORDER.index(s) if s in STATUS_ORDER
                                          else len(STATUS_ORDER), s))
    return ", ".join(f"{counts[s]} {s}" for s in order)


def _display(value):
    """A config value as a table cell (lists and dicts as JSON)."""
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def schema_order() -> list[str]:
    """Every config key in the order of the typed schemas (method, compressor, ..., task),
    the a5a schema's keys first, then the CNN's."""
    from dataclasses import asdict

    from experiments.run.config import CnnConfig, LogRegConfig
    order: dict[str, None] = {}
    for schema in (LogRegConfig, CnnConfig):
        order.update(dict.fromkeys(flatten(asdict(schema()))))
    return list(order)


def _columns(keys: list[dict | None]) -> tuple[list[str], dict]:
    """(the keys whose values differ between configs, in the schema's order, keys it does not
    know after them; the keys every config shares, with their value)."""
    seen: dict[str, None] = {}
    for k in keys:
        for name in (k or {}):
            seen.setdefault(name, None)
    schema = schema_order()
    order = [n for n in schema if n in seen] + [n for n in seen if n not in set(schema)]
    known = [k for k in keys if k is not None]
    varying, shared = [], {}
    for name in order:
        values = {json.dumps(k.get(name), sort_keys=True, default=str) for k in known}
        if len(values) > 1:
            varying.append(name)
        elif known:
            shared[name] = known[0].get(name)
    return varying, shared


# the table's own columns: a config key of the same name (``steps``, the iteration cap that a
# sweep may vary) is shown as ``config:<key>``
RESULT_COLUMNS = ("n", "status", "seed", "run", "final", "best", *NUMERIC)


def _label(key: str) -> str:
    label = key[:-len(".name")] if key.endswith(".name") else key
    return f"config:{label}" if label in RESULT_COLUMNS else label


def summarize(sweep_dir: str | Path, metric: str | None = None,
              per_run: bool = False) -> tuple[pd.DataFrame, dict]:
    """The table (unsorted) and what it was built from: ``{"metric", "runs", "configs",
    "shared", "statuses"}``. Raises :class:`SummaryError` for a folder with no run folders."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise SummaryError(f"{sweep_dir}: no such folder")
    runs = sweep_runs(sweep_dir)
    if not runs:
        raise SummaryError(f"{sweep_dir} is not a sweep: no run folders (with .hydra/"
                           "overrides.yaml or summary.json) under it")
    loaded = [load_run(d, s) for d, s in runs.items()]
    metric = choose_metric(loaded, metric)
    records = [run_record(r, metric) | {"run": r["dir"].relative_to(sweep_dir).as_posix()}
               for r in loaded]
    keys = [None if r["config"] is None else group_key(r["config"]) for r in loaded]
    varying, shared = _columns(keys)
    if not varying and any(k is None for k in keys) and shared:
        varying = [next(iter(shared))]    # unknown configs beside known ones: show something
    for r, k in zip(records, keys):
        r["_key"] = (json.dumps(k, sort_keys=True, default=str) if k is not None
                     else f"run:{r['run']}")
        for name in varying:
            r[_label(name)] = _display(k.get(name)) if k is not None else None
    cols = [_label(v) for v in varying]
    runs_df = pd.DataFrame.from_records(records, columns=list(records[0]))
    runs_df["seed"] = runs_df["seed"].astype("Int64")
    for name in varying:      # integer settings stay integers where a config lacks them
        given = [k[name] for k in keys if k is not None and k.get(name) is not None]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in given):
            runs_df[_label(name)] = runs_df[_label(name)].astype("Int64")
    final, best = f"final_{metric}", f"best_{metric}"
    info = {"metric": metric, "runs": len(records), "configs": runs_df["_key"].nunique(),
            "shared": {_label(k): v for k, v in shared.items()},
            "named": {_label(k): v for k, v in shared.items() if k.endswith(".name")},
            "statuses": _status_text(runs_df["status"]), "sweep": str(sweep_dir),
            "columns": cols,
            "damaged": {r["dir"].relative_to(sweep_dir).as_posix(): r["damage"]
                        for r in loaded if r["damage"]},
            "legacy": sum(r["legacy"] for r in loaded),
            "train_hours": float(pd.to_numeric(runs_df["train_s"], errors="coerce").sum()) / 3600}
    if per_run:
        table = runs_df.rename(columns={"final": final, "best": best})
        table = table[cols + ["seed", "status", final, best, *NUMERIC, "run"]]
        return table.reset_index(drop=True), info
    grouped = runs_df.groupby("_key", sort=False, dropna=False)
    table = grouped.agg(**{c: (c, "first") for c in cols},
                        n=("status", "size"), status=("status", _status_text),
                        **{final: ("final", "mean"), f"{final}_std": ("final", "std"),
                           best: ("best", "mean")},
                        **{c: (c, "mean") for c in NUMERIC})
    return table.reset_index(drop=True), info


def sort_table(table: pd.DataFrame, metric: str, by: str | None = None,
               reverse: bool = False) -> pd.DataFrame:
    """Rows sorted by ``by`` (comma-separated column names; ``final`` and ``best`` name the
    metric's columns), default the final metric. Metric columns sort best first, others
    ascending; ``reverse`` flips; NaN rows always last."""
    names = [c.strip() for c in (by or "final").split(",") if c.strip()]
    names = [f"{c}_{metric}" if c in ("final", "best") else c for c in names]
    unknown = [c for c in names if c not in table.columns]
    if unknown:
        raise SummaryError(f"--sort {','.join(unknown)}: no such column; the columns are "
                           f"{', '.join(table.columns)}")
    best_first = {f"final_{metric}", f"best_{metric}"}
    ascending = [(not maximised(metric) if c in best_first else True) != reverse
                 for c in names]
    return table.sort_values(names, ascending=ascending, na_position="last",
                             kind="stable").reset_index(drop=True)


def _cells(table: pd.DataFrame, blank: list[str]) -> pd.DataFrame:
    """The table as strings: 4 significant digits; NaN for a missing number, an empty cell in
    the ``blank`` columns (a config key that a config does not set)."""
    def cell(v):
        if v is None or (not isinstance(v, (list, dict)) and pd.isna(v)):
            return "NaN"
        if isinstance(v, float):
            return str(int(v)) if v.is_integer() and abs(v) < 1e12 else f"{v:.4g}"
        return str(v)
    out = table.astype(object).map(cell)
    for c in blank:
        if c in out.columns:
            out[c] = out[c].replace("NaN", "")
    return out


def render(table: pd.DataFrame, markdown: bool = False, blank: list[str] = ()) -> str:
    """The table as text: aligned columns (pandas' to_string), or a Markdown table."""
    cells = _cells(table, list(blank))
    if not markdown:
        return cells.to_string(index=False)
    lines = ["| " + " | ".join(cells.columns) + " |",
             "|" + "|".join("---" for _ in cells.columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells.itertuples(index=False)]
    return "\n".join(lines)


def header(info: dict) -> str:
    """The line above the table: the sweep, its runs and configs, the metric, and the names
    (method, compressor, task) that every config shares."""
    best = "largest" if maximised(info["metric"]) else "smallest"
    text = (f"{info['sweep']}: {info['runs']} runs in {info['configs']} configs "
            f"({info['statuses']}); metric {info['metric']} ({best} is best)")
    if info["named"]:
        text += "; every config: " + ", ".join(f"{k}={v}" for k, v in info["named"].items())
    if info.get("train_hours"):
        text += f"; training took {info['train_hours']:.2f} hours of one core (all runs)"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m scripts.analysis.summarize",
        description="A table of every config in a sweep (final and best metric, uplink, "
                    "status, mean and spread over seeds), printed and written as CSV.")
    p.add_argument("sweep", help="a sweep folder, e.g. results/sweeps/fig3")
    p.add_argument("--metric", help="the metric (default: gap when logged, else loss)")
    p.add_argument("--sort", help="column(s) to sort by, comma-separated (default: final, "
                                  "the final metric, best first)")
    p.add_argument("--reverse", action="store_true", help="reverse the sort order")
    p.add_argument("--out", help="CSV file to write (default: <sweep>/summary.csv, "
                                 "<sweep>/summary_runs.csv with --per-run)")
    p.add_argument("--per-run", action="store_true", help="one row per run, not per config")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = p.parse_args(argv)
    try:
        table, info = summarize(args.sweep, args.metric, args.per_run)
        table = sort_table(table, info["metric"], args.sort, args.reverse)
    except SummaryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.sweep) / (
        "summary_runs.csv" if args.per_run else "summary.csv")
    atomic_write_text(out, table.to_csv(index=False))
    try:
        print(header(info))
        print(render(table, args.markdown, info["columns"]), flush=True)
    except BrokenPipeError:           # e.g. | head: the CSV is written, the rest not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    for run, why in info["damaged"].items():
        print(f"damaged: {run}: {why} (re-run the sweep to recompute it)", file=sys.stderr)
    if info["legacy"]:
        print(f"{info['legacy']} finished runs predate the record of their metrics file: "
              f"python -m experiments.run.migrate {args.sweep} checks and records them",
              file=sys.stderr)
    print(f"wrote {out} ({len(table)} rows)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
