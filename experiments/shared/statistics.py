"""From run directories to curves, tuning choices and the reduction table.

A run is read from its ``summary.json`` (config, status) and ``metrics.jsonl`` (rows with
``comm``, ``bytes`` and the tracked metric, ``gap`` for a5a or ``loss`` for the CNN). Runs
that differ only in their seed form a group; groups are summarised on a common
communication grid.
"""
from __future__ import annotations

import json
import math
import warnings
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from scipy import stats

from .runs import FINISHED, MetricsError, damage, read_rows, read_summary
from .runs import group_key as run_group_key


@dataclass
class Run:
    path: Path
    summary: dict       # summary.json as written by experiments.run.record
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
    """Every finished run (status ok or diverged) below ``root``. A damaged run (its
    metrics.jsonl is not the file its summary describes, or a summary.json that cannot be read)
    or a garbled row stops the figure with one line naming the run: the sweep's command
    recomputes it."""
    runs = []
    for summary in sorted(Path(root).rglob("summary.json")):
        s = read_summary(summary.parent)
        if s is None:
            raise SystemExit(f"error: {summary.parent} is damaged (its summary.json cannot be "
                             "read): run its sweep again to recompute it")
        if s.get("status") not in FINISHED:
            continue
        problem = damage(summary.parent, s)
        if problem:
            raise SystemExit(f"error: {summary.parent} is damaged ({problem}): run its sweep "
                             "again to recompute it")
        try:
            rows = read_rows(summary.parent)
        except MetricsError as err:
            raise SystemExit(f"error: {err}") from None
        runs.append(Run(summary.parent, s, rows))
    return runs


def group_key(config: dict) -> tuple:
    """Runs that differ only in their seed form one group (:func:`experiments.shared.runs.group_key`),
    as a sortable, hashable key."""
    return tuple(sorted((k, json.dumps(v)) for k, v in run_group_key(config).items()))


def group_runs(runs: Iterable[Run]) -> dict[tuple, list[Run]]:
    groups: dict[tuple, list[Run]] = defaultdict(list)
    for r in runs:
        groups[group_key(r.config)].append(r)
    return dict(groups)


def line_through(rows: list[dict], chosen: dict, key: str) -> list[dict]:
    """The rows of a tuning table along ``key`` through the choice: every other setting at the
    chosen one (where a row has it)."""
    return [r for r in rows if all(r.get(k) == v for k, v in chosen.items() if k != key and k in r)]


def by_method(runs: Iterable[Run], root, order) -> dict[str, list[Run]]:
    """{method name: its runs sorted by seed}, methods sorted by ``order``. Two settings of one
    method under ``root`` are refused (a stale run: remove it and rerun)."""
    out: dict[str, list[Run]] = {}
    for group in group_runs(runs).values():
        name = group[0].config["method"]["name"]
        if name in out:
            raise SystemExit(f"two different {name} settings under {root}: "
                             "remove the stale runs (make clean) and rerun")
        out[name] = sorted(group, key=lambda r: r.config["seed"])
    return dict(sorted(out.items(), key=lambda kv: order(kv[0])))


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


def log_area(runs: Sequence[Run], key: str, budget: float, x: str = "comm") -> float:
    """Tuning criterion: mean over seeds of the average of log10(metric) over the grid of ``x``
    (uplink by default; "grads": compute) on [0, budget] (the area under the log curve; rewards
    speed and the final level alike). Diverged runs or runs that stop before the budget score
    +inf."""
    grid = comm_grid(budget)
    scores = []
    for r in runs:
        v = value_at(r, key, grid, x)
        if np.isnan(v).any():          # stopped before the budget
            return math.inf
        if not np.all(np.isfinite(v)) or np.any(v <= 0):
            v = np.where(v > 0, v, 1e-16)
            if not np.all(np.isfinite(v)):
                return math.inf
        scores.append(float(np.mean(np.log10(v))))
    return float(np.mean(scores))


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


# ------------------------------------------------------------------ Figure 2's statistic
# (docs/statistics.md): trailing geometric-mean smoothing over a window of uplink, first hits of
# a level, the baseline's final level, and a paired bootstrap over seeds.

def window_of(budget: float) -> float:
    """The smoothing window W (uplink units) of a figure whose runs have ``budget``: 5% of it
    (docs/statistics.md); a whole number is returned as an int, as the tables print it."""
    w = budget / 20
    return int(w) if float(w).is_integer() else w


def smooth(comm: np.ndarray, val: np.ndarray, width: float) -> np.ndarray:
    """At every logged row i, the geometric mean of ``val`` over the rows whose uplink lies in
    the trailing window (comm[i] - width, comm[i]]. Non-positive values count as 1e-300 (a
    metric at or below zero is "arrived"); a non-finite value makes every window holding it
    +inf (a diverged run never arrives)."""
    if not width > 0:
        raise ValueError(f"the smoothing window must be > 0, got {width}")
    comm = np.asarray(comm, dtype=float)
    val = np.asarray(val, dtype=float)
    if np.any(np.diff(comm) < 0):
        raise ValueError("uplink must not decrease along a run's rows")
    logv = np.log(np.where(val > 0, val, 1e-300))
    logv = np.where(np.isfinite(val), logv, np.inf)
    csum = np.concatenate([[0.0], np.cumsum(np.where(np.isfinite(logv), logv, 0.0))])
    cinf = np.concatenate([[0], np.cumsum(~np.isfinite(logv))])
    start = np.searchsorted(comm, comm - width, side="right")   # first row inside the window
    end = np.arange(1, len(comm) + 1)
    n = end - start
    with np.errstate(invalid="ignore"):
        mean = (csum[end] - csum[start]) / n
    return np.where(cinf[end] - cinf[start] > 0, np.inf, np.exp(mean))


def hit(comm: np.ndarray, val: np.ndarray, level: float, budget: float = math.inf) -> float:
    """Uplink at the first row with val <= level and uplink <= budget (NaN if none)."""
    idx = np.nonzero((np.asarray(val) <= level) & (np.asarray(comm) <= budget * (1 + 1e-9)))[0]
    return float(comm[idx[0]]) if idx.size else math.nan


def run_curve(run: Run, key: str, width: float | None,
              x: str = "comm") -> tuple[np.ndarray, np.ndarray]:
    """(comm, metric) of a run, smoothed with a window of ``width`` uplink (None: raw); with
    ``x`` = "grads", against gradient evaluations per worker instead of uplink."""
    comm, val = run.series(key, x)
    if run.status == "diverged":
        val = np.where(np.isfinite(val), val, np.inf)
    return comm, (val if width is None else smooth(comm, val, width))


def final_level(runs: Sequence[Run], key: str, budget: float, width: float,
                tail: float = 0.1, points: int = 400, x: str = "comm") -> float:
    """The level the smoothed curves hold over the last ``tail`` of the budget: exp of the mean
    of log(smoothed metric) over seeds and over the grid points in [(1 - tail) budget, budget].
    NaN if a run stops before the budget."""
    grid = np.linspace((1 - tail) * budget, budget, points + 1)
    logs = []
    for r in runs:
        comm, sm = run_curve(r, key, width, x)
        if comm[-1] < budget * (1 - 1e-9):
            return math.nan
        idx = np.searchsorted(comm, grid, side="right") - 1
        logs.append(np.log(sm[idx]))
    return float(np.exp(np.mean(logs)))


def bootstrap_reduction(c_method: np.ndarray, c_base: np.ndarray, *, resamples: int = 10_000,
                        confidence: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """1 - mean(c_method) / mean(c_base) and its percentile bootstrap interval; the two arrays
    are paired by seed (the same resampled indices for both)."""
    cm, cb = np.asarray(c_method, float), np.asarray(c_base, float)
    if cm.shape != cb.shape or cm.size == 0:
        raise ValueError("paired samples of equal, non-zero length needed")
    point = 1.0 - cm.mean() / cb.mean()
    idx = np.random.default_rng(seed).integers(0, cm.size, size=(resamples, cm.size))
    boot = 1.0 - cm[idx].mean(1) / cb[idx].mean(1)
    a = (1 - confidence) / 2
    lo, hi = np.quantile(boot, [a, 1 - a])
    return float(point), float(lo), float(hi)


def t_interval_reduction(c_method: np.ndarray, c_base: np.ndarray, *,
                         confidence: float = 0.95) -> tuple[float, float, float]:
    """1 - R with R = mean(c_method) / mean(c_base), and a t-interval from the paired,
    linearised ratio (the delta method): with d_s = c_method(s) - R c_base(s), the standard
    error of R is sd(d) / (sqrt(n) mean(c_base)), and the interval is 1 - (R +- t_{n-1} se).
    Valid for small n when the per-seed differences are roughly normal; unlike a percentile
    bootstrap it widens with the t quantile as n falls (docs/statistics.md)."""
    cm, cb = np.asarray(c_method, float), np.asarray(c_base, float)
    if cm.shape != cb.shape or cm.size < 2:
        raise ValueError("paired samples of equal length >= 2 needed")
    r = cm.mean() / cb.mean()
    se = np.std(cm - r * cb, ddof=1) / (math.sqrt(cm.size) * cb.mean())
    t = stats.t.ppf(0.5 + confidence / 2, cm.size - 1)
    return float(1 - r), float(1 - r - t * se), float(1 - r + t * se)


def t_interval_mean(values, *, confidence: float = 0.95) -> tuple[float, float, float]:
    """The mean over seeds and its t-interval, mean +- t_{n-1} sd / sqrt(n) (sd with n - 1);
    one seed gives no interval (nan)."""
    v = np.asarray(values, float)
    if v.size == 0:
        raise ValueError("no values")
    if v.size == 1:
        return float(v[0]), math.nan, math.nan
    half = stats.t.ppf(0.5 + confidence / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
    return float(v.mean()), float(v.mean() - half), float(v.mean() + half)


def reduction_se(t_low: float, t_high: float, n: int, confidence: float = 0.95) -> float:
    """The standard error behind a ``t_interval_reduction`` interval over ``n`` seeds: its
    half-width over t_{n-1}."""
    return (t_high - t_low) / (2 * stats.t.ppf(0.5 + confidence / 2, n - 1))


def welch_difference(a: tuple[float, float, int], b: tuple[float, float, int], *,
                     confidence: float = 0.95) -> tuple[float, float, float]:
    """The difference a - b of two reductions, each given as (reduction, standard error, seeds),
    and its Welch t-interval: se = sqrt(se_a^2 + se_b^2) on the Welch-Satterthwaite degrees of
    freedom (each reduction's on n - 1). It takes the two as independent; where they are read
    from the same runs or seeds and so correlate positively, the interval is conservative."""
    (ra, sa, na), (rb, sb, nb) = a, b
    var = sa ** 2 + sb ** 2
    if var == 0:
        return ra - rb, ra - rb, ra - rb
    df = var ** 2 / (sa ** 4 / (na - 1) + sb ** 4 / (nb - 1))
    half = stats.t.ppf(0.5 + confidence / 2, df) * math.sqrt(var)
    return ra - rb, ra - rb - half, ra - rb + half


@dataclass
class Level:
    kind: str               # "eps" | "baseline_final"
    value: float
    base: str | None = None  # for "baseline_final": whose final level it is


def reduction_rows(groups: dict[str, Sequence[Run]], key: str, *, eps_list: Sequence[float],
                   baselines: Sequence[str], budget: float, width: float, task: str,
                   x: str = "comm") -> list[dict]:
    """The rows of reduction.csv for one panel (docs/statistics.md): every method, both metrics
    (smoothed and raw first hit), every eps, and the final level of every baseline that runs to
    the budget (the best baseline's, the lowest level, first), each against that baseline.
    With ``x`` = "grads" everything is read against gradient evaluations per worker (equal
    compute) instead of uplink: the column ``comm`` then holds gradient evaluations."""
    seeds = {m: sorted(r.config["seed"] for r in rs) for m, rs in groups.items()}
    if len({tuple(v) for v in seeds.values()}) > 1:
        raise ValueError("every method needs runs for the same seeds (the reduction pairs them); "
                         f"got {seeds}: re-run the sweep to finish the missing runs")
    finals = {b: final_level(groups[b], key, budget, width, x=x) for b in baselines if b in groups}
    finals = {b: v for b, v in finals.items() if not math.isnan(v)}
    levels = [Level("eps", float(e)) for e in eps_list]
    levels += [Level("baseline_final", finals[b], b) for b in sorted(finals, key=finals.get)]
    rows = []
    for metric, w in (("smoothed_first_hit", width), ("raw_first_hit", None)):
        curves_ = {m: {r.config["seed"]: run_curve(r, key, w, x) for r in rs}
                   for m, rs in groups.items()}
        for level in levels:
            hits = {m: {s: hit(c, v, level.value, budget) for s, (c, v) in cs.items()}
                    for m, cs in curves_.items()}
            reached = {m: sum(not math.isnan(h) for h in hm.values()) for m, hm in hits.items()}
            censored = 0
            if level.kind == "baseline_final":
                base = level.base
                for s, h in hits[base].items():     # censor the baseline at the budget
                    if math.isnan(h):
                        hits[base][s] = float(budget)
                        censored += 1
            else:
                reach = {b: np.mean(list(hits[b].values())) for b in baselines if b in hits
                         and not any(math.isnan(h) for h in hits[b].values())}
                base = min(reach, key=reach.get) if reach else None
            for m in groups:
                hm = hits[m]
                complete = not any(math.isnan(h) for h in hm.values())   # (censored: complete)
                comm = float(np.mean(list(hm.values()))) if complete else math.nan
                row = {"task": task, "method": m, "metric": metric, "level": level.kind,
                       "eps": level.value, "comm": comm, "seeds_reached": reached[m],
                       "seeds": len(hm), "baseline": base or "",
                       "baseline_comm": math.nan, "baseline_censored": censored,
                       "reduction": math.nan, "ci_low": math.nan, "ci_high": math.nan,
                       "t_low": math.nan, "t_high": math.nan}
                if base is not None:
                    hb = hits[base]
                    row["baseline_comm"] = float(np.mean(list(hb.values())))
                    common = sorted(hm)                      # the same seeds (checked above)
                    cm = np.array([hm[s] for s in common])
                    cb = np.array([hb[s] for s in common])
                    if m != base and not np.isnan(cm).any():
                        row["reduction"], row["ci_low"], row["ci_high"] = bootstrap_reduction(cm, cb)
                        if cm.size >= 2:
                            _, row["t_low"], row["t_high"] = t_interval_reduction(cm, cb)
                rows.append(row)
    return rows


def smoothed_curves(groups: dict[str, Sequence[Run]], key: str, budget: float, width: float,
                    points: int = 400, resamples: int = 2000, x: str = "comm") -> list[dict]:
    """Per label and grid point of uplink in [0, budget]: the geometric mean over seeds of the
    raw metric (``raw``) and of the smoothed curves (``smoothed``), a 95% bootstrap band of the
    latter over seeds (``ci_low``, ``ci_high``), min and max of the raw metric over seeds, and
    the mean wire bytes. Grid points past the end of a label's runs are left out."""
    grid = comm_grid(budget, points)
    out = []
    for label, runs in groups.items():
        rng = np.random.default_rng(zlib.crc32(label.encode()))   # per label: stable bands
        raw, sm = [], []
        for r in runs:
            comm, val = run_curve(r, key, None, x)
            idx = np.searchsorted(comm, grid, side="right") - 1
            past = grid > comm[-1] * (1 + 1e-12)
            smv = smooth(comm, val, width)
            raw.append(np.where(past, np.nan, val[np.clip(idx, 0, None)]))
            sm.append(np.where(past, np.nan, smv[np.clip(idx, 0, None)]))
        with np.errstate(all="ignore"):     # NaN (past a run's end) stays NaN
            lraw = np.log(np.clip(np.array(raw), 1e-300, None))
            lsm = np.log(np.clip(np.array(sm), 1e-300, None))
        byts = np.stack([_bytes_at(r, grid, x) for r in runs])
        boot = rng.integers(0, len(runs), size=(resamples, len(runs)))
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            bands = np.quantile(lsm[boot].mean(1), [0.025, 0.975], axis=0)
            rmean, smean = lraw.mean(0), lsm.mean(0)
            rmin, rmax = np.min(raw, 0), np.max(raw, 0)
            bmean = np.nanmean(byts, 0)
        for i, c in enumerate(grid):
            if math.isnan(rmean[i]):
                continue
            out.append({"label": label, "comm": float(c), "raw": float(np.exp(rmean[i])),
                        "raw_min": float(rmin[i]), "raw_max": float(rmax[i]),
                        "smoothed": float(np.exp(smean[i])),
                        "ci_low": float(np.exp(bands[0, i])), "ci_high": float(np.exp(bands[1, i])),
                        "bytes": float(bmean[i]), "seeds": len(runs)})
    return out
