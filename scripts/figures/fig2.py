"""Figure 2: aggregate the runs of each panel, write the reduction table, draw the figure.

    python -m scripts.figures.fig2 aggregate --task logreg   # results/sweeps/fig2_logreg  -> results/fig2/
    python -m scripts.figures.fig2 aggregate --task cnn      # results/sweeps/cnn_gap/panel -> results/fig2/
    python -m scripts.figures.fig2 plot                      # results/fig2/*_curves.csv -> figures/fig2.{png,pdf}

Aggregation writes small CSVs that are committed (per-method curves over seeds, the reduction
table), so ``plot`` redraws the figure without any run directory. The statistic (smoothed first
hit of a level, the baseline's final level, paired bootstrap over seeds) is defined in
docs/statistics.md; a panel's aggregation keeps the other panel's rows of reduction.csv.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from experiments.shared.statistics import by_method as runs_by_method
from experiments.shared.statistics import load_runs, reduction_rows, smoothed_curves, window_of
from experiments.shared.tables import read_csv, write_csv, write_table
from experiments.shared.files import atomic_write_text
from experiments.shared.configs import cnn_widths, sweep_dir
from experiments.shared.plotting import band_curve, log_axes, no_runs
from experiments.shared.fig2_panels import LABELS, PAPER_CLAIM, TASKS, budget_of, label, order

OUT = Path("results/fig2")
FIG = Path("figures")
def aggregate(task: str, sweep: str | None = None, experiment: str | None = None,
              out: Path | None = None) -> None:
    """Fig. 2's curves and reduction table for one panel, from the runs of ``sweep`` (a folder)
    or of ``experiment``'s sweep (default: the panel's experiment config), into ``out``."""
    spec = TASKS[task]
    out = OUT if out is None else Path(out)
    primary, default = spec["experiment"]
    root = sweep or sweep_dir(primary, experiment or default)
    runs = load_runs(root)
    if not runs:
        raise SystemExit(f"no finished runs under {root}; run `make fig2-{task}`")
    by_method = runs_by_method(runs, root, order)
    budget = budget_of(runs, root)
    window = window_of(budget)               # smoothing, uplink units: 5% of the budget
    out.mkdir(parents=True, exist_ok=True)
    write_csv(smoothed_curves(by_method, spec["metric"], budget, window),
              out / f"{task}_curves.csv")
    rows = reduction_rows(by_method, spec["metric"], eps_list=spec["eps"],
                          baselines=spec["baselines"], budget=budget, width=window,
                          task=spec["table_task"])
    write_table(rows, out / "reduction.csv", out / "reduction.md", replace_task=spec["table_task"])
    def given(node: dict) -> dict:   # the settings a run was given (null = not set)
        return {k: v for k, v in node.items() if v is not None}

    settings = {m: {"method": given(g[0].config["method"]),
                    "compressor": given(g[0].config["compressor"]),
                    "seeds": [r.config["seed"] for r in g],
                    "status": sorted(r.status for r in g),
                    "steps_cap": g[0].config.get("steps"),
                    **({"max_grads": g[0].config["max_grads"]}
                       if g[0].config.get("max_grads") else {}),
                    "budget": budget, "window": window,
                    "end_comm": round(float(np.mean([r.rows[-1]["comm"] for r in g])), 3),
                    "wall_time_s": round(sum(r.summary["wall_time"] for r in g), 1),
                    "data": g[0].summary.get("data", ""),
                    "widths": (g[0].config.get("task") or {}).get("widths"),
                    "n_params": g[0].summary.get("n_params")}
                for m, g in by_method.items()}
    atomic_write_text(out / f"{task}_settings.json", json.dumps(settings, indent=2) + "\n")
    atomic_write_text(out / f"{task}_final.md", final_table(by_method, spec["metric"]))
    print((out / "reduction.md").read_text())
    print((out / f"{task}_final.md").read_text())


def final_table(by_method: dict, metric: str) -> str:
    """Last logged values per method: mean +- std over seeds (and test accuracy if logged)."""
    lines = [f"| method | seeds | final {metric} | final test accuracy | test images | "
             "uplink at the end | steps |", "|---|---|---|---|---|---|---|"]
    for m in sorted(by_method, key=order):
        last = [r.rows[-1] for r in by_method[m]]
        acc = [r.summary.get("final", {}).get("test_acc") for r in by_method[m]]
        acc = [a for a in acc if a is not None]
        n_test = by_method[m][0].summary.get("eval", {}).get("test_images", "-")
        val = np.array([x[metric] for x in last])
        acc_s = f"{100 * np.mean(acc):.1f}% +- {100 * np.std(acc):.1f}" if acc else "-"
        lines.append(f"| {m} | {len(last)} | {val.mean():.4g} +- {val.std():.2g} | {acc_s} | "
                     f"{n_test if acc else '-'} | {np.mean([x['comm'] for x in last]):.1f} | "
                     f"{np.mean([x['step'] for x in last]):.0f} |")
    return "\n".join(lines) + "\n"


def _paper_widths() -> list[int]:
    """airbench94's widths, the paper's network: configs/task/cnn.yaml's."""
    return cnn_widths("paper")


def _title(spec: dict, settings: dict) -> str:
    info = next(iter(settings.values()), {})
    widths = info.get("widths")
    w = "" if not widths or list(widths) == _paper_widths() else \
        f" at widths {'/'.join(map(str, widths))} (CPU profile)"
    return spec["title"].format(widths=w, data=info.get("data") or "CIFAR-10")


def plot(out: Path = FIG) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, (task, spec) in zip(axes, TASKS.items()):
        path = OUT / f"{task}_curves.csv"
        meta = OUT / f"{task}_settings.json"
        settings = json.loads(meta.read_text()) if meta.exists() else {}
        ax.set_title(_title(spec, settings), fontsize=10)
        ax.set_xlabel("uplink communication per worker (dense gradients)")
        ax.set_ylabel(spec["ylabel"])
        rows = read_csv(path) if path.exists() else []
        if not rows or "smoothed" not in rows[0]:      # none yet, or without the smoothed column
            no_runs(ax, f"make fig2-{task}")
            continue
        for m in sorted({r["label"] for r in rows}, key=order):
            rs = [r for r in rows if r["label"] == m]
            x = [r["comm"] for r in rs]
            ls = "--" if m in spec["baselines"] else "-"
            line = band_curve(ax, rs, "comm", ls, lw=1.6,
                              color=f"C{order(m) % 10}",    # one colour per method, both panels
                              label=label(m, settings.get(m)))
            end = settings.get(m, {})
            if end.get("end_comm", math.inf) < 0.99 * end.get("budget", 0):
                ax.plot([x[-1]], [rs[-1]["smoothed"]], "|", ms=10, color=line.get_color())
        window = next(iter(settings.values()), {}).get("window", "?")
        log_axes(ax, int(rows[0]["seeds"]), window, fontsize=7.5,
                 tail=";\nthin: unsmoothed; | : the run's iteration cap")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    for ext in ("png", "pdf"):
        fig.savefig(out / f"fig2.{ext}", dpi=150,   # no timestamps: same results, same files
                    metadata={"CreationDate": None} if ext == "pdf" else {"Software": None})
    print(f"wrote {out / 'fig2.png'} and {out / 'fig2.pdf'}")


def readme_table(task: str, path: Path | None = None) -> str:
    """The README's Expected-results table of a task's panel (``logreg`` or ``cnn``), from
    reduction.csv, whose rows name the panel ``a5a`` or ``cnn``: for every baseline
    that runs to the budget (the best, lowest final level, first), every method's uplink to
    reach that baseline's final level, the reduction with its 95% interval, whether the paper's
    claim lies inside the interval, and the raw-first-hit reduction beside it. The interval is
    the percentile bootstrap from 10 seeds on, below that the paired t-interval, which the
    bootstrap under-covers (docs/statistics.md)."""
    panel = TASKS[task]["table_task"]
    rows = [r for r in read_csv(path or OUT / "reduction.csv")
            if r["task"] == panel and r["level"] == "baseline_final"]
    if not rows:
        raise SystemExit(f"no {panel} rows in reduction.csv: run make fig2-{task}")
    claim = PAPER_CLAIM[task]
    bases = list(dict.fromkeys(r["baseline"] for r in rows))       # best first, as written
    get = {(r["baseline"], r["method"], r["metric"]): r for r in rows}
    lo, hi, name = (("t_low", "t_high", "95% t-interval") if max(r["seeds"] for r in rows) < 10
                    else ("ci_low", "ci_high", "95% CI"))

    def num(x):
        return not isinstance(x, str) and not math.isnan(x)

    def red(r):
        if r["method"] == r["baseline"]:
            return "(baseline)"
        if not num(r["reduction"]):
            return f"not reached ({int(r['seeds_reached'])}/{int(r['seeds'])} seeds)"
        return f"{100 * r['reduction']:.0f}% [{100 * r[lo]:.0f}, {100 * r[hi]:.0f}]"

    def inside(r):
        if r["method"] == r["baseline"] or not num(r["reduction"]):
            return "-"
        return "yes" if r[lo] <= claim <= r[hi] else \
            ("no (above)" if r[lo] > claim else "no (below)")

    head = ["| method |"]
    rule = ["|---|"]
    lines = []
    for b in bases:
        r0 = get[(b, b, "smoothed_first_hit")]
        head.append(f" {LABELS.get(b, b).split(' (')[0]}'s final level, {task_metric(task)} = "
                    f"{r0['eps']:.3g}: uplink | reduction [{name}] | ~{100 * claim:.0f}% inside? | "
                    "raw first hit: reduction |")
        rule.append("---|---|---|---|")
    methods = sorted({r["method"] for r in rows}, key=order)
    for m in methods:
        cells = [f"| {label(m)} |"]
        for b in bases:
            sm, raw = get[(b, m, "smoothed_first_hit")], get[(b, m, "raw_first_hit")]
            comm = f"{sm['comm']:.0f}" if num(sm["comm"]) else "-"
            cells.append(f" {comm} | {red(sm)} | {inside(sm)} | {red(raw)} |")
        lines.append("".join(cells))
    notes = [f"{LABELS.get(b, b).split(' (')[0]}: {int(get[(b, b, 'smoothed_first_hit')]['baseline_censored'])}"
             f" of {int(get[(b, b, 'smoothed_first_hit')]['seeds'])} seeds censored at the budget"
             for b in bases]
    return ("".join(head) + "\n" + "".join(rule) + "\n" + "\n".join(lines) + "\n\n"
            + "Censoring (docs/statistics.md): " + "; ".join(notes) + ".\n")


def task_metric(task: str) -> str:
    return "f - f*" if task == "logreg" else "training loss"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("aggregate")
    a.add_argument("--task", choices=sorted(TASKS), required=True)
    a.add_argument("--sweep", default=None, help="a folder of runs (default: the experiment's)")
    a.add_argument("--experiment", default=None,
                   help="the experiment config whose sweep to read (e.g. fig2_cnn_paper)")
    a.add_argument("--out", type=Path, default=None, help=f"where the tables go (default: {OUT})")
    sub.add_parser("plot")
    r = sub.add_parser("readme", help="print a panel's README table (from reduction.csv)")
    r.add_argument("--task", choices=sorted(PAPER_CLAIM), required=True)
    args = ap.parse_args(argv)
    if args.cmd == "aggregate":
        aggregate(args.task, args.sweep, args.experiment, args.out)
    elif args.cmd == "readme":
        print(readme_table(args.task), end="")
    else:
        plot()


if __name__ == "__main__":
    main()
