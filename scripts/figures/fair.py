"""What compression buys: Figure 2's methods against fair dense baselines (docs/fair.md).

    python -m scripts.figures.fair aggregate              # results/sweeps/fair/<task>/* -> results/fair/
    python -m scripts.figures.fair plot                   # results/fair/*_curves.csv -> figures/fig2_fair.png
    python -m scripts.figures.fair grads-cap --task logreg    # Alg. 1's gradient evaluations at the budget
    python -m scripts.figures.fair readme                 # the README's sentence and table, from the CSV

Figure 2 compares Alg. 1 and 2 with Gluon at B = 1, the paper's baseline. Alg. 1's syncs average
B minibatches per worker, a lever the baseline never gets. Two dense baselines take it away:
large-batch Gluon (B minibatches on every step) and Local Gluon (Alg. 2 with C = 0: the syncs
alone). Every method is read twice with Figure 2's statistic (docs/statistics.md), once against
uplink and once against gradient evaluations per worker (equal compute), each at the final level
of each dense baseline. The decomposition says, per reading, what Alg. 1 and 2 gain against each
baseline, and whether that gain is told apart from zero by the rule fixed before the runs.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from experiments.shared.decomposition import answer, decomposition, headline, quote_in_pages
from experiments.shared.decomposition import write_decomposition as _write_decomposition
from experiments.shared.statistics import reduction_rows, smoothed_curves, window_of
from experiments.shared.tables import read_csv, write_csv
from experiments.shared.fair_panels import (BASELINES, PANELS, READINGS, SWEEPS, dense_waiting,
                                            label_text, order, panel_runs, reading_runs, sweep_of)
from experiments.shared.files import atomic_write_text
from experiments.shared.plotting import band_curve, log_axes, no_runs

OUT = Path("results/fair")
FIG = Path("figures")
def write_decomposition(rows: list[dict], task_name: str) -> None:
    """Replace one panel's rows of results/fair/decomposition.{csv,md}."""
    _write_decomposition(rows, task_name, OUT)


# ---------------------------------------------------------------- aggregation

def aggregate(task: str) -> None:
    """Curves, reduction rows and the decomposition of one task's fair panel, from its sweeps
    (each reading that has finished runs; a reading without any is skipped and said so)."""
    panel = PANELS[task]
    decomposed, reductions, settings = [], [], {}
    for name, reading in READINGS.items():
        root = sweep_of(task, name)
        groups, budget = reading_runs(task, name)
        if not groups:
            print(f"[fair] {root}: no finished runs yet; skipped")
            continue
        if dense_waiting(groups, f"[fair] {root}") is None:
            continue
        window = window_of(budget)
        write_csv(smoothed_curves(groups, panel.metric, budget, window, x=reading.x),
                  OUT / f"{task}_{name}_curves.csv")
        rows = reduction_rows(groups, panel.metric, eps_list=[],
                              baselines=[b for b in BASELINES if b in groups], budget=budget,
                              width=window, task=panel.name, x=reading.x)
        for r in rows:
            r["reading"] = name
        reductions += rows
        decomposed += decomposition(rows, panel.name, name,
                                    {label: g[0].config["method"].get("B") for label, g in groups.items()})
        settings[name] = {label: {"method": {k: v for k, v in g[0].config["method"].items()
                                             if v is not None},
                                  "compressor": {k: v for k, v in g[0].config["compressor"].items()
                                                 if v is not None},
                                  "seeds": [r.config["seed"] for r in g],
                                  "status": sorted(r.status for r in g),
                                  "budget": budget, "window": window,
                                  "end": round(float(np.mean([r.rows[-1][reading.x] for r in g])), 3),
                                  "end_comm": round(float(np.mean([r.rows[-1]["comm"] for r in g])), 3),
                                  "end_grads": round(float(np.mean([r.rows[-1]["grads"] for r in g])), 1),
                                  "wall_time_s": round(sum(r.summary["wall_time"] for r in g), 1)}
                          for label, g in groups.items()}
    if not settings:
        print(f"[fair] {task}: no reading ready yet (`make {panel.runs}`); its rows wait")
        return
    write_csv(reductions, OUT / f"{task}_reduction.csv")
    atomic_write_text(OUT / f"{task}_settings.json", json.dumps(settings, indent=2) + "\n")
    write_decomposition(decomposed, panel.name)
    print((OUT / "decomposition.md").read_text())


def grads_cap(task: str, method: str = "alg1") -> int:
    """Mean over seeds of ``method``'s gradient evaluations per worker at the end of its runs in
    the uplink reading (at Figure 2's density): the compute budget of the compute reading and
    EF21-Muon's cap."""
    runs = panel_runs(task, "uplink").get(method, [])
    if not runs:
        raise SystemExit(f"no finished {method} runs under {sweep_of(task, 'uplink')}")
    return int(round(np.mean([r.rows[-1]["grads"] for r in runs])))


# ---------------------------------------------------------------- the figure

def batch_of(info: dict, label: str) -> str:
    """Large-batch Gluon's B in a reading's legend (its tuned B differs by reading)."""
    B = info.get(label, {}).get("method", {}).get("B") if label == "large_batch_gluon" else None
    return f" (B = {B:,})" if B else ""


def plot(out: Path = FIG) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), len(READINGS), figsize=(12, 5.6 * len(PANELS)),
                             squeeze=False)
    for row, (task, panel) in zip(axes, PANELS.items()):
        meta = OUT / f"{task}_settings.json"
        settings = json.loads(meta.read_text()) if meta.exists() else {}
        for ax, (name, reading) in zip(row, READINGS.items()):
            ax.set_title(f"{panel.title}: equal {name}", fontsize=10)
            ax.set_xlabel(reading.axis)
            ax.set_ylabel(r"$f(x) - f^*$" if panel.metric == "gap" else "training loss")
            path = OUT / f"{task}_{name}_curves.csv"
            rows = read_csv(path) if path.exists() else []
            if not rows:
                no_runs(ax, f"make {panel.runs} (docs/fair.md)")
                continue
            for label in sorted({r["label"] for r in rows}, key=order):
                rs = [r for r in rows if r["label"] == label]
                base, _, density = label.partition("@")
                ls = "--" if base in BASELINES else ("-" if not density else ":")
                band_curve(ax, rs, "comm", ls, lw=1.5, color=f"C{order(label)[0] % 10}",
                           label=label_text(label) + batch_of(settings.get(name, {}), label),
                           band_alpha=0.18, raw_alpha=0.3)
            info = settings.get(name, {})
            running = [label_text(b) for b in BASELINES if b not in info]
            if running:     # a reading is drawn while its last baselines' panels still run
                ax.text(0.98, 0.98, "panel still running:\n" + "\n".join(running),
                        ha="right", va="top", fontsize=7, transform=ax.transAxes)
            window = next(iter(info.values()), {}).get("window", "?")
            log_axes(ax, int(rows[0]['seeds']), window, fontsize=7, below=True)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "fig2_fair.png"
    fig.savefig(path, dpi=130, metadata={"Software": None})
    print(f"wrote {path}")
    return path


def readme() -> str:
    """The README's fair-baseline block: the sentences and the decomposition table."""
    return (OUT / "decomposition.md").read_text()


DOCS = (Path("README.md"), Path("docs/fair.md"))   # both quote the whole block (fair)


def quoted() -> dict[str, str]:
    """What each block holds: ``fair`` the whole decomposition.md, ``fair-answer`` its sentences,
    ``fair-headline`` the README's first results sentence."""
    rows = read_csv(OUT / "decomposition.csv")
    return {"fair": readme(), "fair-answer": answer(rows) + "\n", "fair-headline": headline(rows)}


def quote_in_docs(pages=DOCS) -> None:
    """Write the blocks each page has (``fair``, ``fair-answer``, ``fair-headline``)."""
    quote_in_pages(pages, quoted())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("aggregate")
    a.add_argument("--task", choices=sorted(PANELS), action="append")
    sub.add_parser("plot")
    g = sub.add_parser("grads-cap")
    g.add_argument("--task", choices=sorted(PANELS), required=True)
    sub.add_parser("readme")
    args = ap.parse_args(argv)
    if args.cmd == "aggregate":
        for task in args.task or [t for t in PANELS
                                  if any(sweep_of(t, r).exists() for r in READINGS)]:
            aggregate(task)
        quote_in_docs()
    elif args.cmd == "grads-cap":
        print(grads_cap(args.task))
    elif args.cmd == "readme":
        print(readme(), end="")
    else:
        plot()


if __name__ == "__main__":
    main()
