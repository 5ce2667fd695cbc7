"""Figure 2: aggregate the runs of each panel, write the reduction table, draw the figure.

    python -m scripts.fig2 aggregate --task logreg   # results/sweeps/fig2_logreg -> results/fig2/
    python -m scripts.fig2 aggregate --task cnn      # results/sweeps/fig2_cnn    -> results/fig2/
    python -m scripts.fig2 plot                      # results/fig2/*_curves.csv -> figures/fig2.{png,pdf}

Aggregation writes small CSVs that are committed (per-method curves over seeds), so ``plot``
redraws the figure without any run directory.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.analysis import (curves, group_runs, load_runs, read_csv, reduction_table,
                                  write_csv, write_table)

OUT = Path("results/fig2")
FIG = Path("figures")
# Per panel: sweep folder, tracked metric, tolerances eps of the reduction table, baselines.
TASKS = {
    "logreg": {"sweep": "results/sweeps/fig2_logreg", "metric": "gap", "table_task": "a5a",
               "eps": [3e-2, 1e-2, 5e-3, 3e-3], "baselines": ["gluon", "vr_marina"],
               "ylabel": r"$f(x) - f^*$", "title": "Logistic regression, a5a"},
    "cnn": {"sweep": "results/sweeps/fig2_cnn_cpu", "metric": "loss", "table_task": "cnn",
            "eps": [2.2, 2.1, 2.0, 1.9], "baselines": ["gluon"],
            "ylabel": "training loss", "title": "CNN, {data}, {steps} steps", "xscale": "log"},
}
LABELS = {"gluon": "Gluon, q = 1 (baseline)", "vr_marina": "VR-MARINA (baseline)",
          "alg1": "Alg. 1 (RandK)", "alg2": "Alg. 2 (TopK, EF)", "alg3": "Alg. 3 (RandK, MVR)",
          "alg4": "Alg. 4 (TopK, EF + MVR)", "ef21_muon": "EF21-Muon (TopK)"}
ORDER = ["gluon", "vr_marina", "ef21_muon", "alg1", "alg2", "alg3", "alg4"]


def aggregate(task: str, sweep: str | None = None) -> None:
    spec = TASKS[task]
    runs = load_runs(sweep or spec["sweep"])
    if not runs:
        raise SystemExit(f"no finished runs under {sweep or spec['sweep']}; run `make fig2-{task}`")
    by_method: dict[str, list] = {}
    for group in group_runs(runs).values():
        name = group[0].config["method"]["name"]
        if name in by_method:
            raise SystemExit(f"two different {name} settings under {spec['sweep']}: "
                             "remove the stale runs (make clean) and rerun")
        by_method[name] = group
    # The x range: the common budget when runs stop at one (a5a), else the longest run (each
    # curve ends where its runs end).
    budget = max(r.config.get("max_comm") or r.rows[-1]["comm"] for r in runs)
    write_csv(curves(by_method, spec["metric"], budget), OUT / f"{task}_curves.csv")
    rows = reduction_table(by_method, spec["metric"], spec["eps"], spec["baselines"],
                           spec["table_task"])
    write_table(rows, OUT / "reduction.csv", OUT / "reduction.md", replace_task=spec["table_task"])
    settings = {m: {"method": g[0].config["method"], "compressor": g[0].config["compressor"],
                    "seeds": sorted(r.config["seed"] for r in g),
                    "status": sorted(r.status for r in g),
                    "wall_time_s": sum(r.summary["wall_time"] for r in g),
                    "steps": g[0].config.get("steps"),
                    "data": g[0].summary.get("data", "")}
                for m, g in by_method.items()}
    (OUT / f"{task}_settings.json").write_text(json.dumps(settings, indent=2))
    (OUT / f"{task}_final.md").write_text(final_table(by_method, spec["metric"]))
    print((OUT / "reduction.md").read_text())
    print((OUT / f"{task}_final.md").read_text())


def final_table(by_method: dict, metric: str) -> str:
    """Last logged values per method: mean +- std over seeds (and test accuracy if logged)."""
    import numpy as np
    lines = [f"| method | seeds | final {metric} | final test accuracy | uplink at the end |",
             "|---|---|---|---|---|"]
    for m in sorted(by_method, key=lambda m: ORDER.index(m) if m in ORDER else 99):
        last = [r.rows[-1] for r in by_method[m]]
        acc = [[x for x in r.rows if "test_acc" in x][-1]["test_acc"] for r in by_method[m]
               if any("test_acc" in x for x in r.rows)]
        val = np.array([x[metric] for x in last])
        acc_s = f"{100 * np.mean(acc):.1f}% +- {100 * np.std(acc):.1f}" if acc else "-"
        lines.append(f"| {m} | {len(last)} | {val.mean():.4g} +- {val.std():.2g} | {acc_s} | "
                     f"{np.mean([x['comm'] for x in last]):.1f} |")
    return "\n".join(lines) + "\n"


def plot(out: Path = FIG) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (task, spec) in zip(axes, TASKS.items()):
        path = OUT / f"{task}_curves.csv"
        meta = OUT / f"{task}_settings.json"
        info = next(iter(json.loads(meta.read_text()).values()), {}) if meta.exists() else {}
        ax.set_title(spec["title"].format(data=info.get("data") or "CIFAR-10",
                                          steps=info.get("steps", "?")))
        ax.set_xlabel("uplink communication per worker (dense gradients)")
        ax.set_ylabel(spec["ylabel"])
        if not path.exists():
            ax.text(0.5, 0.5, f"no results yet:\nmake fig2-{task}", ha="center", va="center",
                    transform=ax.transAxes)
            continue
        rows = read_csv(path)
        labels = sorted({r["label"] for r in rows}, key=lambda m: ORDER.index(m) if m in ORDER else 99)
        for m in labels:
            rs = [r for r in rows if r["label"] == m]
            x = [r["comm"] for r in rs]
            ls = "--" if m in spec["baselines"] else "-"
            (line,) = ax.plot(x, [r["mean"] for r in rs], ls, label=f"{LABELS.get(m, m)}")
            ax.fill_between(x, [r["min"] for r in rs], [r["max"] for r in rs],
                            color=line.get_color(), alpha=0.2, lw=0)
        ax.set_yscale("log")
        ax.set_xscale(spec.get("xscale", "linear"))
        ax.grid(True, which="both", alpha=0.3)
        seeds = int(rows[0]["seeds"])
        ax.legend(fontsize=8, title=f"mean, band = min-max over {seeds} seeds", title_fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    for ext in ("png", "pdf"):
        fig.savefig(out / f"fig2.{ext}", dpi=150,   # no timestamps: same results, same files
                    metadata={"CreationDate": None} if ext == "pdf" else {"Software": None})
    print(f"wrote {out / 'fig2.png'} and {out / 'fig2.pdf'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("aggregate")
    a.add_argument("--task", choices=sorted(TASKS), required=True)
    a.add_argument("--sweep", default=None)
    sub.add_parser("plot")
    args = ap.parse_args(argv)
    if args.cmd == "aggregate":
        aggregate(args.task, args.sweep)
    else:
        plot()


if __name__ == "__main__":
    main()
