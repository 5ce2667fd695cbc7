"""Pick each method's best setting from a tuning sweep and write it as a hydra config.

    python -m scripts.analysis.select_tuned --sweep results/sweeps/tune_fig2 --out configs/tuned/fig2_logreg

Criterion (stated in every file written): the mean over seeds of the average of log10(metric)
over the communication range [0, budget], i.e. the area under the log curve against uplink
cost. It rewards fast early progress and a low final level alike; a diverged run, or one
that stops before the budget (other than by the iteration cap, see :func:`scored_range`),
scores +inf. One config per method name is written to ``--out``
(``tuned=<out's last folder>/<method>`` on the command line selects it), plus a CSV with the
score of every candidate and the mean of its metric's last value.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from omegaconf import OmegaConf

from experiments.shared.statistics import group_runs, line_through, load_runs, log_area
from experiments.shared.tables import write_csv
from experiments.shared.files import atomic_write_text

CRITERION = ("mean over seeds of the mean of log10({metric}) on a uniform grid of {axis} "
             "in [0, {budget:g}] (area under the log curve)")
AXES = {"comm": ("uplink cost", "max_comm"),                   # --x: what the area is taken over,
        "grads": ("gradient evaluations per worker", "max_grads")}   # and the budget's key


def _capped(run) -> bool:
    """Whether a run stopped at its iteration cap (``steps``) or its compute cap (``max_grads``)."""
    last = run.rows[-1]
    return (last["step"] >= (run.config.get("steps") or math.inf)
            or last.get("grads", 0) >= (run.config.get("max_grads") or math.inf))


def scored_range(group, budget: float, x: str = "comm") -> float:
    """The uplink range a group is scored over: the budget, or, when every run finished by
    reaching its iteration or compute cap before the budget (EF21-Muon's tiny messages), the
    uplink the shortest run reached (the same for every candidate of such a method: its cost
    per step is fixed)."""
    capped = all(r.status == "ok" and _capped(r) and r.rows[-1][x] < budget for r in group)
    return min(budget, min(r.rows[-1][x] for r in group)) if capped else budget


def final_value(group, metric: str) -> float:
    """The mean over seeds of ``metric``'s last logged value (nan if a run diverged or logged
    no finite value): beside the score, so that a reader sees where each candidate ended."""
    ends = [next((row[metric] for row in reversed(r.rows) if row.get(metric) is not None), None)
            for r in group]
    if any(r.status != "ok" for r in group) or any(v is None or not math.isfinite(v) for v in ends):
        return math.nan
    return float(f"{sum(ends) / len(ends):.6g}")


def select(runs, metric: str, budget: float, x: str = "comm"):
    """{method name: (score, config, runs)} of the best group per method, and all scores.

    Only a method's candidates with the most seeds compete (a candidate whose second tuning
    seed has not run yet is listed with its score but cannot be chosen)."""
    best, table = {}, []
    groups = list(group_runs(runs).values())
    most = {}
    for group in groups:
        name = group[0].config["method"]["name"]
        most[name] = max(most.get(name, 0), len(group))
    for group in groups:
        cfg = group[0].config
        name = cfg["method"]["name"]
        end = scored_range(group, budget, x)
        score = log_area(group, metric, end, x)
        # 12 significant digits: the last bits of a mean differ between CPUs (SIMD summation order)
        table.append({"method": name, "score": float(f"{score:.12g}"), "range": end,
                      "final": final_value(group, metric), "seeds": len(group),
                      "compressor": cfg["compressor"]["name"],
                      **{f"method.{k}": v for k, v in cfg["method"].items() if k != "name"},
                      **{f"compressor.{k}": v for k, v in cfg["compressor"].items() if k != "name"}})
        if len(group) == most[name] and (name not in best or score < best[name][0]):
            best[name] = (score, cfg, group)
    table.sort(key=lambda r: (r["method"], r["score"]))
    return best, table


LIMITS = {"method.B": (1, None), "method.q": (None, 1), "compressor.density": (None, 1),
          "method.beta": (0, None)}
"""Settings that cannot go past a value (B >= 1 minibatch, q <= 1, density <= 1, beta >= 0: no
momentum): a choice there is not an edge to extend."""


def grid_edges(table: list[dict], name: str, chosen: dict,
               stops: dict[str, float] | None = None) -> list[str]:
    """The numeric settings of ``name``'s grid at which the chosen candidate sits on the lowest
    or the highest value tried along the line through it (the other settings held at the chosen
    ones): a grid to extend, unless the edge is a hard limit (``LIMITS``) or an axis stopped there
    on purpose (``stops``: {key: value}, e.g. B stopped for compute). An axis with one value in the
    whole grid was held fixed, not searched; on a searched axis, a choice that is the only value
    tried along its line is untested on both sides, an edge too."""
    rows = [r for r in table if r["method"] == name]
    most = max((r.get("seeds", 1) for r in rows), default=1)
    rows = [r for r in rows if r.get("seeds", 1) == most]   # a point still missing seeds is untried
    out = []
    numeric = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
    for key, value in chosen.items():
        searched = len({r[key] for r in rows if numeric(r.get(key))}) > 1
        # the values tried for `key` with every other setting at the chosen one: the line through
        # the choice (for a full grid, the grid's values; an extension at one B counts there alone)
        line = line_through(rows, chosen, key)
        values = sorted({r[key] for r in line if numeric(r.get(key))})
        low, high = LIMITS.get(key, (None, None))
        if not searched or not numeric(value) or value not in (values[0], values[-1]) \
                or value in (low, high) \
                or (stops or {}).get(key) == value:
            continue
        if len(values) == 1:
            out.append(f"{key}={value:g} (the only value tried at the chosen point)")
        else:
            out.append(f"{key}={value:g} ({'lowest' if value == values[0] else 'highest'} of "
                       f"{', '.join(f'{v:g}' for v in values)})")
    return out


def tuned_yaml(cfg: dict, score: float, criterion: str, source: str) -> str:
    given = lambda node: {k: v for k, v in node.items() if v is not None}   # unset: the default
    body = OmegaConf.to_yaml(OmegaConf.create({"method": given(cfg["method"]),
                                               "compressor": given(cfg["compressor"])}))
    return (f"# @package _global_\n# Written by scripts/analysis/select_tuned.py from {source}.\n"
            f"# Criterion: {criterion}; score {score:.4f} (lower is better).\n"
            f"defaults:\n  - override /method: {cfg['method']['name']}\n"
            f"  - override /compressor: {cfg['compressor']['name']}\n\n{body}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", required=True, help="folder with the tuning runs")
    ap.add_argument("--out", required=True, help="folder for the tuned configs")
    ap.add_argument("--metric", default="gap")
    ap.add_argument("--x", choices=sorted(AXES), default="comm",
                    help="score against uplink (comm, default) or compute (grads)")
    ap.add_argument("--budget", type=float, default=None,
                    help="the budget on that axis; default: the runs' max_comm (max_grads)")
    ap.add_argument("--table", default=None, help="CSV of every candidate's score")
    ap.add_argument("--stop", action="append", default=[], metavar="KEY=VALUE",
                    help="an axis stopped at VALUE on purpose (say why in the grid's config), "
                         "e.g. method.B=64: a choice there is not an edge")
    ap.add_argument("--only", action="append", default=[], metavar="METHOD[,METHOD]",
                    help="choose (and check, with --strict) only these methods; the others' "
                         "grids may still be running or waiting for an extension. The table "
                         "lists every candidate")
    ap.add_argument("--strict", action="store_true",
                    help="a choice on an edge of its grid is an error: no tuned config is written "
                         "for it, and the exit status is 1 (a pipeline stops before its panel)")
    args = ap.parse_args(argv)
    try:
        stops = {k: float(v) for k, v in (a.split("=", 1) for a in args.stop)}
    except ValueError:
        raise SystemExit(f"error: --stop takes KEY=NUMBER, e.g. method.B=64 (got {args.stop})")
    runs = load_runs(args.sweep)
    if not runs:
        raise SystemExit(f"no finished runs under {args.sweep}: run the tuning sweep first")
    axis, budget_key = AXES[args.x]
    budget = args.budget or runs[0].config.get(budget_key)
    if not budget:
        raise SystemExit(f"no --budget given and the runs have no {budget_key}")
    criterion = CRITERION.format(metric=args.metric, axis=axis, budget=budget)
    best, table = select(runs, args.metric, budget, args.x)
    only = {m for a in args.only for m in a.split(",") if m}
    if only - set(best):
        raise SystemExit(f"error: --only names {', '.join(sorted(only - set(best)))}, with no "
                         f"runs under {args.sweep} (it has: {', '.join(sorted(best))})")
    if only:
        best = {name: b for name, b in best.items() if name in only}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    at_edge: list[str] = []
    for name, (score, cfg, group) in sorted(best.items()):
        if math.isinf(score):
            print(f"warning: every {name} candidate diverged or fell short of the budget")
        end = scored_range(group, budget, args.x)
        crit = criterion if end == budget else CRITERION.format(metric=args.metric, axis=axis,
                                                                budget=end) + \
            f" (its iteration cap stops it at {end:g} of the budget {budget:g})"
        chosen = {f"method.{k}": v for k, v in cfg["method"].items() if k != "name"}
        edges = grid_edges(table, name, chosen, stops)
        if not (args.strict and edges):
            atomic_write_text(out / f"{name}.yaml", tuned_yaml(cfg, score, crit, args.sweep))
        print(f"{name:18s} score {score:8.4f} over {len(group)} seed(s)  method {cfg['method']}  "
              f"compressor {cfg['compressor']}")
        for edge in edges:
            print(f"{'':18s} at the edge of its grid: {edge}")
        if edges:
            at_edge.append(name)
    if args.table:
        write_csv(table, Path(args.table))
    if args.strict and at_edge:
        raise SystemExit(f"error: {', '.join(at_edge)} chose on an edge of its grid: "
                         "extend the grid there and rerun (no tuned config written for it), or "
                         "stop the axis on purpose with --stop KEY=VALUE")


if __name__ == "__main__":
    main()
