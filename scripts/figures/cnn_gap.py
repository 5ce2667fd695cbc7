"""The CNN-gap study (docs/cnn_gap.md): why Figure 2's CNN panel measures a smaller reduction
than the paper's "about 65%", one factor at a time.

    python -m scripts.figures.cnn_gap aggregate            # results/sweeps/cnn_gap/* -> results/cnn_gap/
    python -m scripts.figures.cnn_gap plot                 # results/cnn_gap/*.csv -> figures/cnn_gap.{png,pdf}
    python -m scripts.figures.cnn_gap grads-cap            # Alg. 1's gradient evaluations at the budget
    python -m scripts.figures.cnn_gap budget-rule          # the budget at which Gluon's loss flattens
    python -m scripts.figures.cnn_gap lr-check alg1        # the x0.5 and x2 learning rates of a method
    python -m scripts.figures.cnn_gap finished width64     # exit 0 if every run of a condition has finished

Every condition is measured with Figure 2's statistic (docs/statistics.md): the smoothed first
hit of Gluon's final level, the reduction 1 - mean C_M / mean C_Gluon over the condition's
seeds, with the paired t-interval and the percentile bootstrap.
A condition is read only once every method has finished every seed its experiment config
sweeps; until then it is listed with the seeds each method has finished.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from experiments.shared.configs import CONFIGS, sweep_dir
from experiments.shared.fig2_panels import PAPER_CLAIM as FIG2_CLAIM
from experiments.shared.runs import group_key
from experiments.shared.files import atomic_write_text
from experiments.shared.statistics import by_method as runs_by_method
from experiments.shared.statistics import (Run, final_level, load_runs, log_area, reduction_rows,
                                           reduction_se, t_interval_mean, welch_difference)
from experiments.shared.tables import read_csv, write_csv

SWEEPS = sweep_dir("cnn", "cnn_gap/panel").parent   # each condition's sweep is SWEEPS/<name>
                                                   # (configs/experiment/cnn_gap: group)
OUT = Path("results/cnn_gap")
FIG = Path("figures")
TUNED = Path("configs/tuned/cnn_gap")
EXPERIMENTS = CONFIGS / "experiment" / "cnn_gap"
METHODS = ("gluon", "alg1", "alg2")
WINDOW = 25.0          # smoothing window, units of uplink (the panel's: 5% of 500)
LEVELS_TOP = 2.0       # the reduction-vs-level curve runs from this loss down to Gluon's final level
LEVEL_POINTS = 24
PAPER_CLAIM = FIG2_CLAIM["cnn"]      # "about 65%" (Sec. 6.3)


@dataclass(frozen=True)
class Condition:
    name: str          # the condition's name (and its sweep folder under results/sweeps/cnn_gap/)
    factor: str        # what it changes against the reference (the tuned panel)
    widths: str
    settings: str      # "old" (configs/tuned/fig2_cnn_cpu) or "tuned" (configs/tuned/cnn_gap); where
                       # and in what precision its runs computed is read from them (arithmetic)
    sweep: str = ""    # the sweep it reads, if not its name's
    read_at: float = 0.0   # read its runs up to this budget (0: the shortest of its methods')
    control: bool = False  # a control (it measures the arithmetic): in the decomposition, no curve

    @property
    def folder(self) -> str:
        return self.sweep or self.name

    @property
    def seeds(self) -> list[int]:
        """The seeds its experiment config sweeps, fixed before the runs: the condition is read
        only once every method has finished every one of them."""
        params = yaml.safe_load((EXPERIMENTS / f"{self.folder}.yaml").read_text())["hydra"]["sweeper"]["params"]
        return sorted(int(s) for s in str(params["seed"]).split(","))


CONDITIONS = (
    Condition("panel_old", "settings: the committed panel's (lr tuned on one seed)", "16/64/64", "old"),
    Condition("panel", "reference: re-tuned settings", "16/64/64", "tuned"),
    Condition("budget", "budget: the stopping rule's (<= 2,000 units) instead of 500", "16/64/64",
              "tuned"),
    Condition("budget_at_500", "control: the budget runs read at 500 units (arithmetic alone)",
              "16/64/64", "tuned", sweep="budget", read_at=500.0, control=True),
    Condition("width32", "width: 32/128/128", "32/128/128", "tuned"),
    Condition("width64", "width: 64/256/256 (the paper's network)", "64/256/256", "tuned"),
    Condition("panel_gpu", "control: the reference on a GPU (arithmetic alone)", "16/64/64",
              "tuned", control=True),
)
# The conditions that run after the reference use the CPU fast path (bf16 autocast for gradients
# and evaluation, task.amp_cpu): 1.35x to 1.58x less wall time per Alg. 1 step at B = 64 from
# 16/64/64 to 64/256/256, two runs at once (results/bench/cnn_paths_b64_pair.md).
# `budget_at_500` measures what that changes: the same runs read at the reference's budget,
# against the reference's fp32 runs.


@dataclass(frozen=True)
class Effect:
    """What one factor does to the reduction: a condition's minus its control's, per method."""
    factor: str
    condition: str
    phrase: str                  # the factor in the answer's sentence
    controls: tuple[str, ...]    # the first of them that is read (and, with same_arithmetic,
                                 # computed as the condition was) is the control
    same_arithmetic: bool = True


EFFECTS = (
    Effect("tuning: re-tuned settings against the committed panel's", "panel", "re-tuning",
           ("panel_old",)),
    Effect("budget: 2,000 units against 500 (the same runs)", "budget",
           "a budget of 2,000 units instead of 500", ("budget_at_500",)),
    Effect("width: 32/128/128 against 16/64/64", "width32", "the width 32/128/128",
           ("budget_at_500", "panel_gpu")),
    Effect("width: 64/256/256 against 16/64/64", "width64", "the paper's width 64/256/256",
           ("budget_at_500", "panel_gpu")),
    Effect("arithmetic: the CPU fast path against fp32", "budget_at_500", "the CPU fast path",
           ("panel",), False),
    Effect("arithmetic: a GPU against the CPU", "panel_gpu", "a GPU", ("panel",), False),
)
# The width conditions are compared with the 16/64/64 condition computed the same way (the CPU
# fast path's `budget_at_500`, or `panel_gpu` where the widths ran on a GPU), so that a width's
# effect does not carry the arithmetic's.


def arithmetic(run: Run) -> str:
    """Where a run computed and in what precision, from its summary: "cpu", "cpu+bf16" (the CPU
    fast path), "cuda", ... (with ``device: auto`` a run's config does not say which it got)."""
    s = run.summary
    return f"{str(s.get('device', 'cpu')).split(':')[0]}{'+bf16' if s.get('amp') else ''}"


def one_arithmetic(runs: list[Run]) -> None:
    """Refuse runs that are compared with each other but computed on different devices or in
    different precisions: the comparison would measure the arithmetic with the methods."""
    kinds: dict[str, list[Run]] = {}
    for r in runs:
        kinds.setdefault(arithmetic(r), []).append(r)
    if len(kinds) > 1:
        raise SystemExit(f"error: {runs[0].path.parent.parent.parent} mixes runs computed on "
                         + " and ".join(f"{k} ({len(v)}, e.g. {v[0].path.name})"
                                        for k, v in sorted(kinds.items()))
                         + ": run the condition's methods on one kind of machine (remove the "
                         "runs of the other and run its sweep again there)")


def by_method(runs: list[Run]) -> dict[str, list[Run]]:
    """The runs of a condition per method, on the seeds every method has (sorted). The runs of
    one condition must share their arithmetic: methods compared on different devices or
    precisions would measure the arithmetic with the methods."""
    one_arithmetic(runs)
    groups = runs_by_method(runs, runs[0].path.parent.parent if runs else "", lambda m: 0)
    seeds = sorted(set.intersection(*({r.config["seed"] for r in g} for g in groups.values())))
    return {m: sorted((r for r in g if r.config["seed"] in seeds), key=lambda r: r.config["seed"])
            for m, g in groups.items()}


def condition_rows(cond: Condition, groups: dict[str, list[Run]]) -> tuple[list[dict], list[dict]]:
    """(decomposition rows at Gluon's final level, reduction-vs-level rows) of one condition.

    Its budget is the shortest of its methods' budgets: runs to a longer budget are read up to
    it (their rows up to it are those of a run to it: the lr is constant and the smoothing
    trailing), so Gluon can run to 2,000 units to find the budget at which the stopping rule
    holds, and the other methods only to that budget (``budget_rule``)."""
    budget = cond.read_at or min(float(g[0].config["max_comm"]) for g in groups.values())
    final = final_level(groups["gluon"], "loss", budget, WINDOW)
    # the curve's last point is the decomposition's own row at Gluon's final level (below), where
    # a Gluon seed that never reaches the level (it is the seeds' mean) counts as censored at
    # the budget (docs/statistics.md); at the other levels such a seed leaves no point
    levels = list(np.geomspace(LEVELS_TOP, final, LEVEL_POINTS))[:-1] if final < LEVELS_TOP else []
    rows = reduction_rows(groups, "loss", eps_list=levels, baselines=["gluon"], budget=budget,
                          width=WINDOW, task=cond.name)
    seeds = [r.config["seed"] for r in groups["gluon"]]
    common = {"condition": cond.name, "factor": cond.factor, "widths": cond.widths,
              "settings": cond.settings, "arithmetic": arithmetic(groups["gluon"][0]),
              "budget": budget, "seeds": len(seeds), "seed_list": " ".join(map(str, seeds)),
              "gluon_final_level": final}
    decomposition, curve = [], []
    for r in rows:
        if r["method"] == "gluon":
            continue
        row = {**common, "method": r["method"], "metric": r["metric"], "loss_level": r["eps"],
               "comm": r["comm"], "gluon_comm": r["baseline_comm"],
               "seeds_reached": r["seeds_reached"], "reduction": r["reduction"],
               "t_low": r["t_low"], "t_high": r["t_high"],
               "boot_low": r["ci_low"], "boot_high": r["ci_high"]}
        if r["level"] == "baseline_final":
            decomposition.append(row)
        curve.append(row)
    return decomposition, curve


def effect_rows(decomposition: list[dict]) -> list[dict]:
    """Per factor (EFFECTS) and compressed method: the reduction at Gluon's final level of the
    condition minus its control's, in points of reduction, with a 95% Welch t-interval on the
    two paired t-intervals' standard errors (docs/cnn_gap.md, "What each factor changes").
    Factors whose condition or control is not read yet, or where a method does not reach the
    level, are left out."""
    at = {(r["condition"], r["method"]): r for r in decomposition
          if r["metric"] == "smoothed_first_hit"}
    rows = []
    for e in EFFECTS:
        for m in METHODS[1:]:
            a = at.get((e.condition, m))
            if a is None or _missing(a["reduction"]):
                continue
            b = next((at[(c, m)] for c in e.controls if (c, m) in at and not
                      (e.same_arithmetic and at[(c, m)]["arithmetic"] != a["arithmetic"])), None)
            if b is None or _missing(b["reduction"]):
                continue
            ends = [(r["reduction"], reduction_se(r["t_low"], r["t_high"], r["seeds"]), r["seeds"])
                    for r in (a, b)]
            diff, low, high = welch_difference(*ends)
            rows.append({"factor": e.factor, "phrase": e.phrase, "method": m, "condition": e.condition,
                         "control": b["condition"], "reduction": a["reduction"],
                         "control_reduction": b["reduction"], "seeds": a["seeds"],
                         "control_seeds": b["seeds"], "effect": diff, "low": low, "high": high,
                         "moves": "no" if low <= 0 <= high else "up" if low > 0 else "down"})
    return rows


ANSWER_NEEDS = ("panel_old", "panel", "budget", "budget_at_500", "width32", "width64")
METHOD_NAMES = {"alg1": "Alg. 1", "alg2": "Alg. 2"}


def _interval(lo: float, hi: float, points: bool = False) -> str:
    f = _points if points else (lambda x: f"{100 * x:.0f}")
    return f"[{f(lo)}, {f(hi)}]"


def answer(decomposition: list[dict], effects: list[dict]) -> str:
    """The study's answer in one sentence, from the tables alone: which factors move the
    reduction at Gluon's final level (their change's interval excludes 0), by how much, and
    where the paper's about 65% lies against every condition's t-interval. Pending until every
    condition in ANSWER_NEEDS is read (`panel_gpu` runs only on a GPU and is not needed)."""
    rows = [r for r in decomposition if r["metric"] == "smoothed_first_hit"
            and r["method"] in METHOD_NAMES]
    read = {r["condition"] for r in rows}
    if not set(ANSWER_NEEDS) <= read:
        return ("pending until every condition is read (not yet: "
                + ", ".join(c for c in ANSWER_NEEDS if c not in read) + ")")
    moves, still, mixed = [], [], []
    for phrase in dict.fromkeys(e["phrase"] for e in effects):
        mine = [e for e in effects if e["phrase"] == phrase]
        nums = " and ".join(f"{_points(e['effect'])} {_interval(e['low'], e['high'], True)}"
                            for e in mine)
        moved = [e for e in mine if e["moves"] != "no"]
        if len(moved) == len(mine):
            moves.append(f"{phrase} ({nums})")
        elif not moved:
            still.append(f"{phrase} ({nums})")
        else:
            only = " and ".join(METHOD_NAMES[e["method"]] for e in moved)
            mixed.append(f"{phrase} moves it for {only} only ({nums})")
    sides: dict[str, dict[str, list[str]]] = {"exceeded (below the whole interval)": {},
                                              "inside the interval": {},
                                              "not reached (above the interval)": {}}
    controls = {c.name for c in CONDITIONS if c.control}
    for r in rows:
        if r["condition"] in controls or _missing(r["reduction"]):
            continue
        side = list(sides)[0 if r["t_low"] > PAPER_CLAIM else 2 if r["t_high"] < PAPER_CLAIM else 1]
        sides[side].setdefault(r["condition"], []).append(
            f"{METHOD_NAMES[r['method']]} {_pct(r['reduction'])} {_interval(r['t_low'], r['t_high'])}")
    n = sum(len(v) for by in sides.values() for v in by.values())
    where = "; ".join(f"{side} in {sum(map(len, by.values()))} of {n}: "
                      + _and([f"`{c}` " + " and ".join(v) for c, v in by.items()])
                      for side, by in sides.items() if by)
    parts = []
    if moves:
        parts.append("The reduction at Gluon's final level (Alg. 1 and Alg. 2 in turn, in points, "
                     "95% Welch t-intervals) moves with " + _and(moves))
    if mixed:
        parts.append(_and(mixed))
    if still:
        parts.append(_and(still) + (" do" if len(still) > 1 else " does") + " not move it")
    return "; ".join(parts) + f"; against 95% t-intervals, the paper's about 65% is {where}."


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _missing(x) -> bool:
    return x in ("", None) or (isinstance(x, float) and math.isnan(x))


def _points(x: float) -> str:
    p = round(100 * x)
    return f"{p:+d}" if p else "0"


def effects_markdown(rows: list[dict]) -> str:
    lines = ["| factor | method | condition | its control | reduction | control's | change "
             "(points) | 95% Welch t-interval | moves it? |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['factor']} | {r['method']} | `{r['condition']}` ({r['seeds']}) | "
                     f"`{r['control']}` ({r['control_seeds']}) | {_pct(r['reduction'])} | "
                     f"{_pct(r['control_reduction'])} | {_points(r['effect'])} | "
                     f"[{_points(r['low'])}, {_points(r['high'])}] | {r['moves']} |")
    return "\n".join(lines) + "\n"


RULE_FROM = 500.0      # the rule's first candidate budget: the panel's (the condition runs longer)
RULE_DROP = 0.02       # "falls less than 2% over the last fifth"


def fifth_drop(runs: list[Run], c: float) -> np.ndarray:
    """How much each run's loss falls over [0.8 c, c]: 1 - exp(slope x 0.2 c), the slope a
    least-squares line through log(loss) of every row in that stretch (not two points of a
    smoothed curve: the logged loss wanders by several percent about its trend, as much as the
    threshold)."""
    out = []
    for r in runs:
        x = np.array([row["comm"] for row in r.rows])
        y = np.log(np.array([row["loss"] for row in r.rows]))
        m = (x >= 0.8 * c) & (x <= c)
        out.append(1 - math.exp(np.polyfit(x[m], y[m], 1)[0] * 0.2 * c))
    return np.array(out)


def fifth_drop_upper(runs: list[Run], c: float) -> float:
    """The upper end of the 95% t-interval of the seeds' mean :func:`fifth_drop` (the mean
    itself for one seed, or seeds that agree)."""
    mean, _, high = t_interval_mean(fifth_drop(runs, c))
    return mean if math.isnan(high) else high


def budget_check(groups: dict[str, list[Run]]) -> dict:
    """Gluon's loss: how much it falls over the last fifth of its budget (:func:`fifth_drop`: the
    seeds' mean and the largest), and the stopping rule of the study's budget factor: the first
    budget c (on a 10-unit grid from the panel's 500) at which it has fallen less than 2% over
    [0.8 c, c] with confidence (the upper end of the seeds' 95% t-interval below 2%; NaN if never).
    A rule on the estimate itself would stop on the first stretch where the wandering loss looks
    flat (tests/test_cnn_gap.py)."""
    runs = groups["gluon"]
    budget = float(runs[0].config["max_comm"])
    grid = np.arange(RULE_FROM, budget + 1, 10.0)
    first = next((c for c in grid if fifth_drop_upper(runs, c) < RULE_DROP), math.nan)
    d = fifth_drop(runs, budget)
    return {"budget": budget, "drop_last_fifth": float(d.mean()),
            "drop_last_fifth_max": float(d.max()),
            "drop_last_fifth_upper": fifth_drop_upper(runs, budget),
            "first_budget_below_2pct": first}


def budget_rule(sweep: Path) -> int:
    """The budget condition's budget for the compressed methods (its stopping rule): the first
    budget c >= 500 at which Gluon's loss has fallen less than 2% over [0.8 c, c] with confidence
    (``budget_check``), or Gluon's own budget (2,000 units) if the rule never held."""
    gluon = [r for r in load_runs(sweep) if r.config["method"]["name"] == "gluon"]
    if not gluon:
        raise SystemExit(f"no finished Gluon runs under {sweep}: run them first")
    check = budget_check({"gluon": gluon})
    first = check["first_budget_below_2pct"]
    return int(check["budget"] if math.isnan(first) else first)


BUDGET_KEYS = ("max_comm", "steps", "max_grads")


def _twin_key(run: Run) -> tuple:
    """A run's identity less its budget: runs that share it are one run to two budgets."""
    return tuple(sorted((k, json.dumps(v)) for k, v in group_key(run.config).items()
                        if k not in BUDGET_KEYS)) + (("seed", run.config["seed"]),)


def same_prefix(short: list[Run], long: list[Run], upto: float) -> bool | None:
    """Whether the runs to a longer budget log the same rows as their twins (the same settings
    but the budget) to the shorter budget, up to ``upto``: the trajectories must agree step for
    step. None where no run has a twin (e.g. the arithmetic differs: task.amp_cpu)."""
    pairs = {_twin_key(r): r for r in short}
    checked = 0
    for r in long:
        s = pairs.get(_twin_key(r))
        if s is None:
            continue
        a = [(x["step"], x["loss"]) for x in s.rows if x["comm"] < upto]
        b = [(x["step"], x["loss"]) for x in r.rows if x["comm"] < upto]
        if a != b:
            return False
        checked += 1
    return True if checked else None


def path_agreement(fp32: list[Run], fast: list[Run], upto: float) -> list[dict]:
    """The CPU fast path against the reference (fp32) path, run by run: for each method and seed
    with a run on both (the same settings, `task.amp_cpu` aside), over the rows logged below
    ``upto`` units of uplink: how many rows sit at the same step and uplink (the same coin
    flips), and the relative difference of the logged loss, |fast - fp32| / fp32 (median, 90th
    percentile, largest)."""
    ref = {(r.config["method"]["name"], r.config["seed"]): r for r in fp32}
    out = []
    for r in sorted(fast, key=lambda r: (r.config["method"]["name"], r.config["seed"])):
        key = (r.config["method"]["name"], r.config["seed"])
        if key not in ref:
            continue
        a = [x for x in ref[key].rows if x["comm"] < upto]
        b = [x for x in r.rows if x["comm"] < upto]
        n = min(len(a), len(b))
        diff = np.array([abs(y["loss"] - x["loss"]) / x["loss"] for x, y in zip(a[:n], b[:n])])
        out.append({"method": key[0], "seed": key[1], "rows": n,
                    "rows_same_step_and_uplink": sum(x["step"] == y["step"] and x["comm"] == y["comm"]
                                                     for x, y in zip(a[:n], b[:n])),
                    "loss_rel_diff_median": float(np.median(diff)),
                    "loss_rel_diff_p90": float(np.percentile(diff, 90)),
                    "loss_rel_diff_max": float(diff.max())})
    return out


def lr_transfer() -> list[dict]:
    """At the paper's width, seed 0: the tuning criterion (area under log loss, lower is better)
    at the transferred lr and at x0.5 and x2, and whether the transfer held (``transfer_held``)."""
    width64 = load_runs(SWEEPS / "width64") if (SWEEPS / "width64").exists() else []
    runs = load_runs(SWEEPS / "width64_lr") + [r for r in width64 if r.config["seed"] == 0]
    one_arithmetic(runs)      # the x1 point is width64's seed 0: the same machine as x0.5 and x2
    out = []
    for m in METHODS:
        base = tuned_lr(m)
        for r in runs:
            if r.config["method"]["name"] != m:
                continue
            lr = r.config["method"]["lr"]
            out.append({"method": m, "lr": lr, "times": round(lr / base, 3), "seed": r.config["seed"],
                        "score": log_area([r], "loss", float(r.config["max_comm"])),
                        "final_loss": r.rows[-1]["loss"]})
    x1_scores = {m: [log_area([r], "loss", float(r.config["max_comm"])) for r in width64
                     if r.config["method"]["name"] == m
                     and math.isclose(r.config["method"]["lr"], tuned_lr(m))] for m in METHODS}
    seeds = len(next(c for c in CONDITIONS if c.folder == "width64").seeds)
    return sorted(transfer_held(out, x1_scores, seeds), key=lambda r: (r["method"], r["lr"]))


def transfer_held(rows: list[dict], x1_scores: dict[str, list[float]], seeds: int) -> list[dict]:
    """The rule fixed before the runs (docs/cnn_gap.md): for each method, the transfer held if the
    transferred lr (x1) scores lowest of the three, or if the better neighbour beats it by less
    than the seed-to-seed standard deviation of x1's score over width64's seeds (one seed cannot
    resolve less). ``held`` is empty while x1 has fewer than ``seeds`` seeds or a point is missing; each
    row gains its score minus x1's (``vs_x1``, negative: better than x1) and that deviation."""
    out = []
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == m]
        x1 = next((r["score"] for r in mine if math.isclose(r["times"], 1.0)), math.nan)
        xs = x1_scores.get(m, [])
        sd = float(np.std(xs, ddof=1)) if len(xs) >= max(seeds, 2) else math.nan
        complete = {round(r["times"], 3) for r in mine} >= {0.5, 1.0, 2.0}
        margin = x1 - min(r["score"] for r in mine)        # how much the best of the three beats x1
        held = "" if not complete or math.isnan(sd) else bool(margin <= 0 or margin < sd)
        out += [{**r, "vs_x1": r["score"] - x1, "x1_seeds": len(xs), "x1_seed_sd": sd,
                 "held": held} for r in mine]
    return out


def transfer_note(rows: list[dict]) -> str:
    """One line of decomposition.md: the lr check's verdict per method, with its numbers."""
    parts = []
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == m]
        best = min(mine, key=lambda r: r["score"])
        if mine[0]["held"] == "":
            lrs = ", ".join(f"x{r['times']:g}" for r in mine)
            parts.append(f"{m} pending (finished: {lrs}; width64 seeds at x1: {mine[0]['x1_seeds']})")
            continue
        behind = ("" if math.isclose(best["times"], 1.0) else f", x1 behind it by {-best['vs_x1']:.4f}")
        parts.append(f"{m} {'held' if mine[0]['held'] else 'did not hold'}: best x{best['times']:g}"
                     f"{behind}; x1's seed sd {mine[0]['x1_seed_sd']:.4f} (area under log10 loss)")
    return "lr check at 64/256/256, seed 0 (rule: docs/cnn_gap.md): " + "; ".join(parts)


def finished(name: str) -> bool:
    """Whether every run of a condition (every method, every seed its config sweeps) or of the
    lr check (``width64_lr``: every method at x0.5 and x2, seed 0) has finished, on whatever
    machine: ``make cnn-gap`` then skips it, so the CPU does not redo what a GPU finished (a
    run's identity holds its device, so the sweep alone would not skip it)."""
    runs = load_runs(SWEEPS / name) if (SWEEPS / name).exists() else []
    if name == "width64_lr":
        have = [(r.config["method"]["name"], float(r.config["method"]["lr"])) for r in runs
                if r.config["seed"] == 0]
        return all(any(m == hm and math.isclose(lr, hl) for hm, hl in have)
                   for m in METHODS for lr in lr_check(m))
    cond = next(c for c in CONDITIONS if c.folder == name)
    return all(seeds >= set(cond.seeds) for seeds in seeds_done(runs).values())


def seeds_done(runs: list[Run]) -> dict[str, set[int]]:
    """The seeds each of the study's methods has finished among ``runs``."""
    return {m: {r.config["seed"] for r in runs if r.config["method"]["name"] == m} for m in METHODS}


def lr_check(method: str) -> tuple[float, float]:
    """The lr check's learning rates of a method: x0.5 and x2 its tuned one."""
    base = tuned_lr(method)
    return base / 2, base * 2


def tuned_lr(method: str) -> float:
    return float(yaml.safe_load((TUNED / f"{method}.yaml").read_text())["method"]["lr"])


FP32_BUDGET = "budget_fp32"   # Gluon's first budget runs, on the reference (fp32) path


def aggregate() -> None:
    decomposition, curve, missing = [], [], []
    found: dict[str, list[Run]] = {}

    def runs_of(folder: str, seeds=None) -> list[Run]:
        """A sweep's finished runs (read once), on the given seeds."""
        if folder not in found:
            found[folder] = load_runs(SWEEPS / folder) if (SWEEPS / folder).exists() else []
        return [r for r in found[folder] if seeds is None or r.config["seed"] in seeds]

    def of(runs: list[Run], method: str) -> list[Run]:
        return [r for r in runs if r.config["method"]["name"] == method]

    for cond in CONDITIONS:
        seeds = cond.seeds
        runs = runs_of(cond.folder, seeds)
        done = {m: len(d) for m, d in seeds_done(runs).items()}
        if min(done.values()) < len(seeds):
            counts = ", ".join(f"{m} {n}/{len(seeds)}" for m, n in done.items())
            missing.append(f"{cond.name} ({counts})")
            continue
        d, c = condition_rows(cond, by_method(runs))
        decomposition += d
        curve += c
    OUT.mkdir(parents=True, exist_ok=True)
    write_csv(decomposition, OUT / "decomposition.csv")
    write_csv(curve, OUT / "levels.csv")
    effects = effect_rows(decomposition)
    write_csv(effects, OUT / "effects.csv")
    table = run_table()
    if len(table):
        write_table(table, OUT / "runs.csv")
        write_table(finals(table), OUT / "finals.csv")
    notes, checks = [], []
    for sweep in ("budget", FP32_BUDGET):       # the rule's input: Gluon's runs alone
        # every seed Gluon has finished, not only those the other methods share
        only_gluon = of(runs_of(sweep), "gluon")
        gluon = by_method(only_gluon)["gluon"] if only_gluon else None
        if not gluon:
            continue
        check = {"sweep": sweep, "fast_path": bool(gluon[0].config.get("task", {}).get("amp_cpu")),
                 "seeds": len(gluon), **budget_check({"gluon": gluon})}
        check["final_level"] = final_level(gluon, "loss", check["budget"], WINDOW)
        checks.append(check)
        notes.append(f"budget ({sweep}): Gluon's loss falls {100 * check['drop_last_fifth']:.1f}% (95% "
                     f"upper end {100 * check['drop_last_fifth_upper']:.1f}%) over the last fifth "
                     f"of {check['budget']:g} units; below 2% with confidence "
                     + (f"never: the rule's budget is {check['budget']:g}"
                        if math.isnan(check["first_budget_below_2pct"])
                        else f"from {check['first_budget_below_2pct']:g}"))
    if checks:
        write_csv(checks, OUT / "budget_check.csv")
    panel_gluon = of(runs_of("panel"), "gluon")
    if runs_of("budget") and panel_gluon:
        ok = same_prefix(runs_of("panel"), runs_of("budget"),
                         float(panel_gluon[0].config["max_comm"]))
        notes.append("budget runs repeat the panel's rows up to its budget: "
                     + ("not comparable (no run has the panel's settings but the budget: the "
                        "arithmetic differs; the `budget_at_500` control measures it)"
                        if ok is None else str(ok)))
        if ok is False:
            raise SystemExit("the budget runs do not repeat the panel's runs up to 500 units")
        upto = float(panel_gluon[0].config["max_comm"])
        write_csv(path_agreement(runs_of("panel"), runs_of("budget"), upto), OUT / "fast_path.csv")
    if (SWEEPS / "width64_lr").exists() and TUNED.exists():
        transfer = lr_transfer()
        write_csv(transfer, OUT / "lr_transfer.csv")
        notes.append(transfer_note(transfer))
    if missing:
        notes.append("conditions not read until every method has finished every seed (seeds "
                     f"finished): {'; '.join(missing)}")
    atomic_write_text(OUT / "decomposition.md", markdown(decomposition) + "\n"
                      + "".join(f"- {n}\n" for n in notes) + "\n"
                      + "What each factor changes (`effects.csv`):\n\n" + effects_markdown(effects)
                      + f"\nAnswer: {answer(decomposition, effects)}\n")
    print((OUT / "decomposition.md").read_text())


def run_table() -> pd.DataFrame:
    """One row per finished run of the study (every sweep under SWEEPS, tuning included): its
    settings, its final values and its times, as its summary.json records them."""
    rows = []
    sweeps = sorted(p.name for p in SWEEPS.iterdir() if p.is_dir()) if SWEEPS.exists() else []
    for sweep in sweeps:
        for r in load_runs(SWEEPS / sweep):
            c, m = r.config, r.config["method"]
            f = r.summary.get("final") or r.rows[-1]          # the last row where no summary has it
            widths = c.get("task", {}).get("widths")
            rows.append({"sweep": sweep, "method": m["name"], "lr": m.get("lr"),
                         "beta": m.get("beta"), "q": m.get("q"), "B": m.get("B"),
                         "widths": "/".join(str(w) for w in widths) if widths else "",
                         "fast_path": bool(c.get("task", {}).get("amp_cpu")), "seed": c["seed"],
                         "status": r.status, "steps": r.summary.get("steps_done", r.rows[-1]["step"]),
                         "uplink": f["comm"], "grads": f.get("grads"), "loss": f.get("loss"),
                         "test_acc": f.get("test_acc"), "train_time_s": r.summary.get("train_time"),
                         "wall_time_s": r.summary.get("wall_time")})
    return pd.DataFrame(rows)


def finals(table: pd.DataFrame) -> pd.DataFrame:
    """Per sweep and setting: final training loss and test accuracy, mean and std over seeds
    (population std, ddof = 0, as in Figure 2's tables), gradients per worker, and the range of
    training and wall times."""
    keys = ["sweep", "method", "widths", "lr", "beta", "q", "B", "fast_path"]
    values = ["loss", "test_acc", "grads", "train_time_s", "wall_time_s"]
    table = table.assign(**{k: pd.to_numeric(table[k], errors="coerce") for k in values})
    pop_std = lambda x: x.std(ddof=0)                                   # noqa: E731
    return (table.groupby(keys, dropna=False, sort=True)
            .agg(seeds=("seed", "nunique"), loss_mean=("loss", "mean"), loss_std=("loss", pop_std),
                 test_acc_mean=("test_acc", "mean"), test_acc_std=("test_acc", pop_std),
                 grads_mean=("grads", "mean"), train_time_min_s=("train_time_s", "min"),
                 train_time_max_s=("train_time_s", "max"), wall_time_min_s=("wall_time_s", "min"),
                 wall_time_max_s=("wall_time_s", "max"))
            .reset_index())


def write_table(df: pd.DataFrame, path: Path) -> None:
    """``write_csv`` for a DataFrame: the same atomic replace, floats to 6 significant digits."""
    atomic_write_text(path, df.to_csv(index=False, float_format="%.6g"))


def _pct(x) -> str:
    return "-" if _missing(x) else f"{100 * x:.0f}%"


def markdown(rows: list[dict]) -> str:
    lines = ["| condition | widths | budget | settings | computed on | seeds | Gluon's final level | "
             "method | uplink to reach it | Gluon's | reduction | 95% t-interval | 95% bootstrap | "
             "~65% inside (t)? |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["metric"] != "smoothed_first_hit":
            continue
        red = r["reduction"]
        reached = not (isinstance(red, float) and math.isnan(red)) and red != ""
        inside = "-" if not reached else ("yes" if r["t_low"] <= PAPER_CLAIM <= r["t_high"] else
                                          "no (above)" if r["t_low"] > PAPER_CLAIM else "no (below)")
        comm = f"{r['comm']:.0f}" if reached else f"not reached ({r['seeds_reached']}/{r['seeds']})"
        lines.append(
            f"| {r['factor']} | {r['widths']} | {r['budget']:g} | {r['settings']} | "
            f"{r['arithmetic']} | {r['seeds']} | "
            f"{r['gluon_final_level']:.3f} | {r['method']} | {comm} | {r['gluon_comm']:.0f} | "
            f"{_pct(red)} | [{_pct(r['t_low'])}, {_pct(r['t_high'])}] | "
            f"[{_pct(r['boot_low'])}, {_pct(r['boot_high'])}] | {inside} |")
    return "\n".join(lines) + "\n"


def plot(out: Path = FIG) -> None:
    """figures/cnn_gap.png: the reduction against the target level, one panel per compressed
    method and one line (with its 95% t-band) per condition, EF21-Muon beside them as the
    equal-compute baseline; the reduction at Gluon's final level per condition and method; and
    what each factor changes (effects.csv)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = [r for r in read_csv(OUT / "levels.csv") if r["metric"] == "smoothed_first_hit"] \
        if (OUT / "levels.csv").exists() else []
    dec = [r for r in read_csv(OUT / "decomposition.csv") if r["metric"] == "smoothed_first_hit"] \
        if (OUT / "decomposition.csv").exists() else []
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
    eff = read_csv(OUT / "effects.csv") if (OUT / "effects.csv").exists() \
        and (OUT / "effects.csv").stat().st_size else []
    fig = plt.figure(figsize=(13, 13))
    grid = fig.add_gridspec(3, 2, height_ratios=[1, 0.9, 0.55])
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :]),
            fig.add_subplot(grid[2, :])]
    methods = {"alg1": "Alg. 1 (RandK 1%)", "alg2": "Alg. 2 (TopK 1%, EF)",
               "ef21_muon": "EF21-Muon (TopK 1%, at Alg. 1's gradients)"}
    colors = {"panel_old": "0.55", "panel": "k", "budget": "C0", "budget_at_500": "C9",
              "width32": "C1", "width64": "C3", "panel_gpu": "C4"}   # one colour per condition

    def line(ax, cond, m, **style):
        rs = sorted((r for r in curve if r["condition"] == cond and r["method"] == m
                     and not math.isnan(r["reduction"])), key=lambda r: -r["loss_level"])
        if rs:
            x = [r["loss_level"] for r in rs]
            ax.plot(x, [100 * r["reduction"] for r in rs], lw=1.6, **style)
            ax.fill_between(x, [100 * r["t_low"] for r in rs], [100 * r["t_high"] for r in rs],
                            color=style["color"], alpha=0.12, lw=0)

    computed_on = {r["condition"]: r["arithmetic"] for r in curve}
    for ax, m in zip(axes[:2], ("alg1", "alg2")):
        for cond in CONDITIONS:
            if not cond.control:     # a control: in the decomposition only
                line(ax, cond.name, m, color=colors[cond.name], label=cond.factor.split(":")[0]
                     + f" ({cond.widths}, {cond.settings}, {computed_on.get(cond.name, '')})")
        line(ax, "panel", "ef21_muon", color="C2", ls="--", label=methods["ef21_muon"] + ": reference")
        ax.axhline(100 * PAPER_CLAIM, color="k", lw=0.8, ls=":")
        ax.text(0.01, 100 * PAPER_CLAIM + 1, "paper: about 65%", fontsize=8,
                transform=ax.get_yaxis_transform())
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator([2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.9, 0.8, 0.7]))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.invert_xaxis()
        ax.set_ylim(-5, 100)
        ax.set_xlabel("target level: smoothed training loss (lower: later in training)")
        ax.set_title(f"{methods[m]}: reduction vs target level\n(band: 95% t-interval over seeds)",
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("uplink reduction against Gluon (%)")
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        axes[1].legend(handles, names, loc="lower right", fontsize=8, framealpha=0.9)

    bx = axes[2]
    marker = {"alg1": "o", "alg2": "s", "ef21_muon": "^"}
    labels = []
    for i, r in enumerate(dec):
        color, y = colors.get(r["condition"], "k"), len(dec) - i
        if not math.isnan(r["reduction"]):
            bx.errorbar(100 * r["reduction"], y, xerr=[[100 * (r["reduction"] - r["t_low"])],
                                                       [100 * (r["t_high"] - r["reduction"])]],
                        fmt=marker.get(r["method"], "o"), color=color, capsize=3)
        else:
            bx.text(0.5, y, f"not reached in {int(r['seeds'] - r['seeds_reached'])} of "
                    f"{int(r['seeds'])} seeds", color=color, fontsize=8, va="center", ha="center",
                    transform=bx.get_yaxis_transform())
        labels.append((y, f"{r['factor'].split(':')[0]} ({r['widths']}, {r['budget']:g} units, "
                          f"{int(r['seeds'])} seeds, {r['arithmetic']}): "
                          f"{methods[r['method']].split(' (')[0]}"))
    bx.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=8)
    bx.set_ylim(0.4, len(dec) + 0.6)
    bx.axvline(100 * PAPER_CLAIM, color="k", lw=0.8, ls=":")
    bx.text(100 * PAPER_CLAIM + 0.5, 0.99, "paper: about 65%", fontsize=8, va="top",
            transform=bx.get_xaxis_transform())
    bx.set_xlim(0, 100)
    bx.set_xlabel("reduction at Gluon's final level (%), 95% t-interval")
    bx.set_title("One factor at a time", fontsize=10)
    bx.grid(True, axis="x", alpha=0.3)

    cx = axes[3]               # what each factor changes: condition minus control, Welch interval
    for i, r in enumerate(eff):
        y = len(eff) - i
        cx.errorbar(100 * r["effect"], y, xerr=[[100 * (r["effect"] - r["low"])],
                                                [100 * (r["high"] - r["effect"])]],
                    fmt=marker[r["method"]], color=colors.get(r["condition"], "k"), capsize=3)
    cx.set_yticks(range(len(eff), 0, -1),
                  [f"{r['phrase']} ({r['condition']} - {r['control']}): "
                   f"{methods[r['method']].split(' (')[0]}" for r in eff], fontsize=8)
    cx.set_ylim(0.4, len(eff) + 0.6)
    cx.axvline(0, color="k", lw=0.8)
    cx.set_xlabel("change in the reduction at Gluon's final level (points), 95% Welch t-interval")
    cx.set_title("What each factor changes", fontsize=10)
    cx.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    for ext in ("png", "pdf"):
        fig.savefig(out / f"cnn_gap.{ext}", dpi=150,
                    metadata={"CreationDate": None} if ext == "pdf" else {"Software": None})
    print(f"wrote {out / 'cnn_gap.png'}")


def grads_cap(sweep: Path, method: str = "alg1") -> int:
    """Mean over seeds of ``method``'s gradient evaluations per worker at the end of its runs
    (the budget): EF21-Muon's compute cap, so the two compare at equal compute and uplink."""
    runs = [r for r in load_runs(sweep) if r.config["method"]["name"] == method]
    if not runs or any("grads" not in r.rows[-1] for r in runs):
        raise SystemExit(f"no finished {method} runs with a gradient count under {sweep}")
    return int(round(np.mean([r.rows[-1]["grads"] for r in runs])))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("aggregate")
    sub.add_parser("plot")
    g = sub.add_parser("grads-cap")
    g.add_argument("--sweep", default=str(SWEEPS / "panel"))
    g.add_argument("--method", default="alg1")
    b = sub.add_parser("budget-rule")
    b.add_argument("--sweep", default=str(SWEEPS / "budget"))
    lr = sub.add_parser("lr-check")
    lr.add_argument("method", choices=METHODS)
    f = sub.add_parser("finished")
    f.add_argument("sweep", choices=sorted({c.folder for c in CONDITIONS} | {"width64_lr"}))
    args = ap.parse_args(argv)
    if args.cmd == "aggregate":
        aggregate()
    elif args.cmd == "plot":
        plot()
    elif args.cmd == "grads-cap":
        print(grads_cap(Path(args.sweep), args.method))
    elif args.cmd == "budget-rule":
        print(budget_rule(Path(args.sweep)))
    elif args.cmd == "finished":
        done = finished(args.sweep)
        print(f"{args.sweep}: {'finished' if done else 'not finished'}")
        raise SystemExit(0 if done else 1)
    else:
        print(",".join(f"{lr:g}" for lr in lr_check(args.method)))


if __name__ == "__main__":
    main()
