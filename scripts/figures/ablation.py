"""Appendix G's ablation figures (Figs. 3-7) from their sweeps.

    python -m scripts.figures.ablation aggregate fig3   # results/sweeps/... -> results/fig3/curves.csv
    python -m scripts.figures.ablation plot fig3        # results/fig3/curves.csv -> figures/fig3.{png,pdf}

Figs. 5 and 7 are drawn from the tuning sweeps of Fig. 2 (Alg. 1's and VR-MARINA's learning
rate / momentum grids, seed 100), as in the paper where the baselines are "tuned in Fig. 7".
"""
from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np

from experiments.shared.runs import flatten
from experiments.shared.statistics import curves, group_runs, load_runs
from experiments.shared.tables import read_csv, write_csv
from experiments.shared.files import atomic_write_text
from experiments.shared.configs import sweep_dir

# For each figure: the sweeps it reads, as (entry point, experiment config, method: the runs of
# that method in the experiment's sweep folder), the panel key, the line key(s), the x axes and
# an optional overlay (another sweep's runs drawn dashed for comparison).
FIGS = {
    "fig3": {"sweeps": [("logreg", "fig3", "alg1")], "panel": None,
             "lines": ["method.q", "compressor.density"], "x": ["step", "comm"],
             "title": "Alg. 1: sync probability q and RandK density (B = 4)"},
    "fig4": {"sweeps": [("logreg", "fig4", "alg1")], "panel": "compressor.density",
             "lines": ["method.B"], "x": ["comm"],
             "title": "Alg. 1: large batch B at each RandK density (q = 0.1)"},
    "fig5": {"sweeps": [("logreg", "tune_fig2/alg1", "alg1")],
             "panel": ["method.q", "method.B"], "lines": ["method.beta", "method.lr"],
             "x": ["comm"], "title": "Alg. 1: learning rate and momentum (RandK 1%)"},
    "fig6": {"sweeps": [("logreg", "fig6", "alg2"), ("logreg", "fig4", "alg1")],
             "panel": "compressor.density", "lines": ["method.name", "method.B"],
             "x": ["comm"], "title": "Alg. 2 with TopK (solid) against Alg. 1 with RandK (dashed)"},
    "fig7": {"sweeps": [("logreg", "tune_fig2/vr_marina", "vr_marina")],
             "panel": ["method.q"], "lines": ["method.beta", "method.lr"], "x": ["comm"],
             "title": "VR-MARINA with momentum: tuning (RandK 1%)"},
    "fig8": {"sweeps": [("cnn", "fig8", "alg1")], "panel": ["method.q"],
             "lines": ["method.lr"], "x": ["comm"], "metric": "loss",
             # the q = 1 baseline, drawn dashed in every panel: Gluon at its tuned setting
             "baseline": ("cnn", "fig2_cnn_cpu", "gluon", "Gluon, q = 1 (Fig. 2)"),
             "task": "CIFAR-10 CNN, airbench94 at widths 16/64/64",
             "title": "Alg. 1 on the CNN: q and lr (RandK 1%, B = 4, beta = 0.9)"},
}
SHORT = {"method.q": "q", "compressor.density": "density", "method.B": "B", "method.beta": "beta",
         "method.lr": "lr", "method.name": ""}


def _keys(k):
    return [] if k is None else [k] if isinstance(k, str) else list(k)


def _label(flat: dict, keys) -> str:
    return ", ".join(f"{SHORT.get(k, k)}={flat[k]}".lstrip("=") for k in keys)


def aggregate(fig: str) -> Path:
    spec = FIGS[fig]
    runs = []
    for primary, experiment, method in spec["sweeps"]:
        folder = sweep_dir(primary, experiment) / method        # hydra.sweep.subdir: <method>/...
        found = [r for r in load_runs(folder) if r.config["method"]["name"] == method]
        if not found:   # a figure without one of its sweeps would be another figure
            raise SystemExit(f"{fig} needs the {method} runs of {folder}, and it has none "
                             f"finished; run `make {fig}`")
        runs += found
    rows = []
    for x in spec["x"]:
        budget = min(max(row[x] for row in r.rows) for r in runs) if x == "step" else \
            min(r.config.get("max_comm") or r.rows[-1]["comm"] for r in runs)
        for group in group_runs(runs).values():
            flat = flatten(group[0].config)
            panel = _label(flat, _keys(spec["panel"])) or "all"
            label = _label(flat, spec["lines"])
            for row in curves({label: group}, spec.get("metric", "gap"), budget, points=200, x=x):
                rows.append({"panel": panel, "xaxis": x, "x": row[x], "label": label,
                             "mean": row["mean"], "min": row["min"], "max": row["max"],
                             "seeds": row["seeds"]})
    if spec.get("baseline"):
        primary, experiment, method, text = spec["baseline"]
        folder = sweep_dir(primary, experiment) / method
        base = [r for r in load_runs(folder) if r.config["method"]["name"] == method]
        if not base:
            raise SystemExit(f"{fig} draws the baseline from {folder}: run `make fig2-cnn` first")
        budget = min(r.config.get("max_comm") or r.rows[-1]["comm"] for r in runs)
        for row in curves({text: base}, spec.get("metric", "gap"), budget, points=200):
            rows.append({"panel": "*", "xaxis": "comm", "x": row["comm"], "label": text,
                         "mean": row["mean"], "min": row["min"], "max": row["max"],
                         "seeds": row["seeds"]})
        write_csv(competitiveness(runs, base, spec.get("metric", "gap")),
                  Path("results") / fig / "check.csv")
    out = Path("results") / fig / "curves.csv"
    write_csv(rows, out)
    wall = sum(r.summary.get("wall_time", 0.0) for r in runs)
    atomic_write_text(out.parent / "runtime.json", json.dumps(
        {"runs": len(runs), "wall_time_s_sum": round(wall, 1),
         "statuses": dict(Counter(r.status for r in runs))}, indent=2))
    print(f"wrote {out} ({len(rows)} rows); {len(runs)} runs, {wall:.0f} s of run time in all")
    return out


def competitiveness(runs, base, metric: str, points=(25, 50, 100, 150, 250, 500)) -> list[dict]:
    """Per q: the best lr's training loss (smoothed over the trailing 5% of the budget, as in
    docs/statistics.md) at fixed amounts of uplink, beside the q = 1 baseline's (mean over its
    seeds). A q is competitive at an uplink if its best loss there is at or below Gluon's."""
    from experiments.shared.statistics import run_curve

    def at(run, c):
        comm, sm = run_curve(run, metric, 25.0)
        return float(sm[np.searchsorted(comm, c, side="right") - 1]) if comm[-1] >= c else math.nan

    out = []
    for c in points:
        gluon = float(np.mean([at(r, c) for r in base]))
        by_q: dict = {}
        for r in runs:
            q, v = r.config["method"]["q"], at(r, c)
            if not math.isnan(v) and (q not in by_q or v < by_q[q][0]):
                by_q[q] = (v, r.config["method"]["lr"])
        for q in sorted({r.config["method"]["q"] for r in runs}, reverse=True):
            v, lr = by_q.get(q, (math.nan, math.nan))
            out.append({"uplink": c, "q": q, "best_lr": lr, "loss": v, "gluon_loss": gluon,
                        "competitive": (v <= gluon) if not math.isnan(v) else "not reached"})
    return out


def plot(fig: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = FIGS[fig]
    path = Path("results") / fig / "curves.csv"
    if not path.exists():
        raise SystemExit(f"{path} missing: run `make {fig}`")
    rows = read_csv(path)
    shared = [r for r in rows if r["panel"] == "*"]          # drawn in every panel (a baseline)
    rows = [r for r in rows if r["panel"] != "*"]
    panels = sorted({(r["xaxis"], r["panel"]) for r in rows},
                    key=lambda p: (spec["x"].index(p[0]), p[1]))
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig_, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.6 * nrows), squeeze=False)
    for ax, (xaxis, panel) in zip(axes.flat, panels):
        sel = [r for r in rows if r["xaxis"] == xaxis and r["panel"] == panel]
        base = {r["label"] for r in shared}
        sel += [r for r in shared if r["xaxis"] == xaxis]
        for label in sorted({r["label"] for r in sel}):
            rs = [r for r in sel if r["label"] == label]
            ls = "--" if (label.startswith("alg1") and fig == "fig6") or label in base else "-"
            (line,) = ax.plot([r["x"] for r in rs], [r["mean"] for r in rs], ls, lw=1.2,
                              label=label)
            ax.fill_between([r["x"] for r in rs], [r["min"] for r in rs], [r["max"] for r in rs],
                            color=line.get_color(), alpha=0.15, lw=0)
        ax.set_yscale("log")
        ax.set_title(panel if panel != "all" else "", fontsize=9)
        ax.set_xlabel("iterations" if xaxis == "step" else "uplink communication per worker")
        ax.set_ylabel("training loss" if spec.get("metric") == "loss" else r"$f(x) - f^*$")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig_.suptitle(f"{fig}: {spec['title']} ({spec.get('task', 'a5a')}, mean and min-max over seeds)",
                  fontsize=10)
    fig_.tight_layout()
    out = Path("figures")
    out.mkdir(exist_ok=True)
    for ext in ("png", "pdf"):
        fig_.savefig(out / f"{fig}.{ext}", dpi=130,  # no timestamps: same results, same files
                     metadata={"CreationDate": None} if ext == "pdf" else {"Software": None})
    print(f"wrote figures/{fig}.png")
    return out / f"{fig}.png"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["aggregate", "plot"])
    ap.add_argument("figure", choices=sorted(FIGS))
    args = ap.parse_args(argv)
    (aggregate if args.cmd == "aggregate" else plot)(args.figure)


if __name__ == "__main__":
    main()
