"""The LM study's figure (docs/lm.md): validation loss against uplink, one panel per worker
split, with Figure 2's statistic (docs/statistics.md), and its reduction table.

    python -m scripts.figures.lm aggregate          # each split's panel runs -> results/lm/
                                                    # (and compute.md: what the study's runs took)
    python -m scripts.figures.lm plot               # results/lm/*_curves.csv -> figures/fig_lm.png
    python -m scripts.figures.lm grads-cap --split iid [--from tune]   # EF21-Muon's compute cap
    python -m scripts.figures.lm readme             # the README's block (aggregate writes it there)
    python -m scripts.figures.lm tuning             # docs/lm.md's tuning table (aggregate writes it)

``aggregate`` reads the runs of ``configs/experiment/lm/panel_<split>.yaml``'s sweep (or
``--sweep DIR`` for one ``--split``) and writes, per split, the curves over seeds
(``<split>_curves.csv``: the smoothed statistic with its bootstrap band, the raw mean), the
settings and final values (``<split>_settings.json``, ``<split>_final.md``) and the split's rows
of the reduction table (``reduction.{csv,md}``: every method's uplink to reach each fixed level
and each dense baseline's final level, the reduction with its paired bootstrap and t-intervals).
``plot`` redraws the figure from those files alone. ``grads-cap`` prints the mean gradient
evaluations per worker of Alg. 1's runs (of the panel, or of the tuning grid at Alg. 1's tuned
point): the ``max_grads`` EF21-Muon runs to, so that it costs what Alg. 1 costs.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import yaml

from experiments.shared.configs import CONFIGS, sweep_dir
from experiments.shared.decomposition import decomposition, quote_in_pages, write_decomposition
from experiments.shared.fair_panels import (BASELINES, LABELS, ORDER, complete, dense_waiting,
                                            order)
from experiments.shared.fig2_panels import budget_of
from experiments.shared.files import atomic_write_text
from experiments.shared.plotting import band_curve, log_axes, no_runs
from experiments.shared.statistics import by_method as runs_by_method
from experiments.shared.statistics import (line_through, load_runs, reduction_rows,
                                           smoothed_curves, t_interval_mean, window_of)
from experiments.shared.tables import read_csv, write_csv, write_table

SPLITS = ("iid", "plays")
OUT = Path("results/lm")
FIG = Path("figures/fig_lm.png")
METRIC = "val_loss"
EPS = [2.4, 2.2, 2.0]          # fixed validation-loss levels, beside the baselines' final levels
DOCS = (Path("README.md"), Path("docs/lm.md"))    # both quote the block `lm` (readme())
NANOGPT_CPU = 1.88             # nanoGPT's shakespeare_char CPU example: its reported val loss
SPLIT_TITLE = {"iid": "iid: every worker samples the whole training text",
               "plays": "plays: worker tau owns the tau-th contiguous part"}


def panel(split: str) -> str:
    return f"lm/panel_{split}"


def tuning(split: str) -> str:
    return "lm/tune_gluon" if split == "iid" else f"lm/{split}/tune_gluon"


def aggregate(split: str, sweep: str | None = None, out: Path = OUT) -> bool:
    """One split's curves, settings, final values and reduction rows; False when it has no
    finished runs yet. The reduction rows and the decomposition are read against the dense
    baselines whose panels are complete; until every one is, none is called the best."""
    root = Path(sweep) if sweep else sweep_dir("lm", panel(split))
    runs = load_runs(root) if root.exists() else []
    if not runs:
        print(f"[{split}] no finished runs under {root}: make lm-runs")
        return False
    by_method = complete(runs_by_method(runs, root, order), f"[lm] {split} panel")
    budget = budget_of(runs, root)
    window = window_of(budget)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(smoothed_curves(by_method, METRIC, budget, window), out / f"{split}_curves.csv")
    if dense_waiting(by_method, f"[lm] {split} panel") is None:
        rows = []
    else:
        rows = reduction_rows(by_method, METRIC, eps_list=EPS, budget=budget, width=window,
                              baselines=[b for b in BASELINES if b in by_method],
                              task=f"lm_{split}")
    write_table(rows, out / "reduction.csv", out / "reduction.md", replace_task=f"lm_{split}")
    write_decomposition(decomposition(rows, f"lm_{split}", "uplink",
                                      {m: g[0].config["method"].get("B") for m, g in by_method.items()}),
                        f"lm_{split}", out)
    settings = {}
    for m, g in by_method.items():
        s0 = g[0].summary
        settings[m] = {"method": {k: v for k, v in g[0].config["method"].items() if v is not None},
                       "compressor": {k: v for k, v in g[0].config["compressor"].items()
                                      if v is not None},
                       "seeds": [r.config["seed"] for r in g], "budget": budget, "window": window,
                       "end_comm": round(float(np.mean([r.rows[-1]["comm"] for r in g])), 3),
                       **({"max_grads": g[0].config["max_grads"]}
                          if g[0].config.get("max_grads") else {}),
                       "split": split, "n_params": s0.get("n_params"), "model": s0.get("model"),
                       "data": s0.get("data"), "train_time_s": round(
                           sum(r.summary.get("train_time", 0.0) for r in g), 1)}
    atomic_write_text(out / f"{split}_settings.json", json.dumps(settings, indent=2) + "\n")
    atomic_write_text(out / f"{split}_final.md", final_table(by_method))
    print((out / f"{split}_final.md").read_text())
    return True


def final_table(by_method: dict) -> str:
    """Last values per method: the losses as the mean over seeds and its 95% t-interval, the
    counters as means."""
    lines = ["| method | seeds | final val_loss (fixed windows) | whole validation text | "
             "training loss | uplink at the end | gradients per worker | steps |",
             "|---|---|---|---|---|---|---|---|"]

    def mean_ci(values):
        v = [x for x in values if x is not None]
        if not v:
            return "-"
        mean, low, high = t_interval_mean(v)
        return f"{mean:.3f}" + ("" if math.isnan(low) else f" [{low:.3f}, {high:.3f}]")

    for m, g in by_method.items():
        last = [r.rows[-1] for r in g]
        lines.append(f"| {m} | {len(g)} | {mean_ci([x[METRIC] for x in last])} | "
                     f"{mean_ci([x.get('val_loss_full') for x in last])} | "
                     f"{mean_ci([x.get('loss') for x in last])} | {np.mean([x['comm'] for x in last]):.1f} | "
                     f"{np.mean([x['grads'] for x in last]):.0f} | "
                     f"{np.mean([x['step'] for x in last]):.0f} |")
    return ("\n".join(lines) + "\n\nLosses: the mean over seeds and its 95% t-interval "
            "(`t_interval_mean`); uplink, gradients and steps: means over seeds.\n")


def plot(out: Path = OUT, fig_path: Path = FIG) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SPLITS), figsize=(12, 4.6), sharey=True)
    for ax, split in zip(axes, SPLITS):
        path, meta = out / f"{split}_curves.csv", out / f"{split}_settings.json"
        settings = json.loads(meta.read_text()) if meta.exists() else {}
        info = next(iter(settings.values()), {})
        shape = info.get("model") or {}
        size = (f", GPT {shape.get('n_layer')}x{shape.get('n_embd')}, context "
                f"{shape.get('block_size')}" if shape else "")
        ax.set_title(f"Tiny Shakespeare{size}\n{SPLIT_TITLE[split]}", fontsize=9.5)
        ax.set_xlabel("uplink communication per worker (dense gradients)")
        ax.set_ylabel("validation loss (fixed windows)")
        rows = read_csv(path) if path.exists() else []
        if not rows:
            no_runs(ax, "make lm-runs")
            continue
        drawn = {r["label"] for r in rows}
        for m in sorted(drawn, key=order):
            rs = [r for r in rows if r["label"] == m]
            end = settings.get(m, {})
            text = LABELS.get(m, m) + (f", stopped at {end['max_grads']:,.0f} gradients per "
                                       "worker (Alg. 1's)" if end.get("max_grads") else "")
            line = band_curve(ax, rs, "comm", "--" if m in BASELINES else "-", lw=1.6,
                              color=f"C{ORDER.index(m) if m in ORDER else 9}", label=text)
            if end.get("end_comm", math.inf) < 0.99 * end.get("budget", 0):
                ax.plot([rs[-1]["comm"]], [rs[-1]["smoothed"]], "|", ms=10, color=line.get_color())
        log_axes(ax, int(rows[0]["seeds"]), info.get("window", "?"), fontsize=7,
                 tail=";\nthin: unsmoothed; | : the run's compute cap")
        waiting = [LABELS[m] for m in ORDER if m not in drawn]
        if waiting:
            ax.text(0.98, 0.98, "panel still running:\n" + "\n".join(waiting), ha="right",
                    va="top", fontsize=7, transform=ax.transAxes)
    fig.tight_layout()
    fig_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(fig_path, dpi=150, metadata={"Software": None})   # same results, same file
    print(f"wrote {fig_path}")


def compute_spent(root: Path, out: Path = OUT) -> str:
    """What the study's finished runs took (``compute.md``): per split and part (tuning, panel),
    the runs and the sum of their wall times, in hours of one core (each run is one process of
    one thread); halved, the hours on two cores running two at a time, as make lm-runs does.
    Runs that shared the machine with more than one other report more than their own time, so
    this is an upper bound."""
    lines = ["| split | part | finished runs | hours of one core | hours on 2 cores |",
             "|---|---|---:|---:|---:|"]
    total = 0.0
    for split in SPLITS:
        for part in ("tune", "panel"):
            runs = load_runs(root / split / part) if (root / split / part).exists() else []
            hours = sum(r.summary.get("wall_time", 0.0) for r in runs) / 3600
            total += hours
            lines.append(f"| {split} | {part} | {len(runs)} | {hours:.1f} | {hours / 2:.1f} |")
    text = "\n".join(lines) + (f"\n\nIn all {total:.1f} hours of one core, {total / 2:.1f} on 2 "
                               "cores (the sum of the runs' wall times; an upper bound).\n")
    atomic_write_text(out / "compute.md", text)
    return text


def grads_cap(split: str, source: str = "panel", sweep: str | None = None,
              tuned: Path | None = None) -> float:
    """Mean gradient evaluations per worker of Alg. 1's finished runs: the panel's, or the
    tuning grid's at the point ``configs/tuned/lm_<split>/alg1.yaml`` chose."""
    root = Path(sweep) if sweep else sweep_dir("lm", panel(split) if source == "panel"
                                               else tuning(split))
    runs = [r for r in (load_runs(root) if root.exists() else [])
            if r.config["method"]["name"] == "alg1"]
    if source == "tune":
        path = tuned or CONFIGS / "tuned" / f"lm_{split}" / "alg1.yaml"
        want = (yaml.safe_load(path.read_text()) or {}).get("method", {})
        runs = [r for r in runs if all(r.config["method"].get(k) == v for k, v in want.items())]
    if not runs:
        raise SystemExit(f"error: no finished Alg. 1 runs under {root}"
                         + (" at its tuned point" if source == "tune" else "")
                         + ": run them first (make lm-runs)")
    return float(np.mean([r.rows[-1]["grads"] for r in runs]))


def adamw_line(out: Path = OUT) -> str:
    """The dense AdamW reference in one sentence, from results/lm/adamw_<preset>.json
    (``make lm-reference``), beside nanoGPT's number."""
    found = {p: json.loads((out / f"adamw_{p}.json").read_text())
             for p in ("nanogpt", "budget") if (out / f"adamw_{p}.json").exists()}
    if not found:
        return "The dense AdamW reference has not run (`make lm-reference`)."
    said = []
    if "nanogpt" in found:
        n = found["nanogpt"]
        f, st = n["final"], n["settings"]
        said.append(f"at nanoGPT's CPU example (width {st['model']['n_embd']}, {st['steps']:,} "
                    f"steps of {st['batch_windows']} windows) {f['val_loss_full']:.2f} on the whole "
                    f"validation text, where nanoGPT reports about {NANOGPT_CPU}")
    if "budget" in found:
        b = found["budget"]
        said.append(f"at this study's profile and Gluon's token budget "
                    f"{b['final']['val_loss']:.2f} on the fixed windows (its best of lr "
                    + ", ".join(f"{lr:g}" for lr in b["settings"]["lr"]) + ")")
    return ("Dense AdamW, one process (a reference that the model trains well, not a baseline "
            "of the paper): " + "; ".join(said) + ".")


def readme(out: Path = OUT) -> str:
    """The LM's block of the README and docs/lm.md: the decomposition of each split's panel
    (Alg. 1, 2 and EF21-Muon against Gluon, large-batch Gluon and Local Gluon at each one's
    final level, with intervals and the rule's verdict) and the AdamW reference."""
    path = out / "decomposition.md"
    table = path.read_text() if path.exists() else \
        "No panel has run yet (`make lm-runs`): no reduction is claimed.\n"
    return table + "\n" + adamw_line(out) + "\n"


SEARCHED = {"method.B": "B", "method.q": "q", "method.lr": "lr", "method.beta": "beta"}


def tuning_table(out: Path = OUT, tuned: Path = CONFIGS / "tuned") -> str:
    """docs/lm.md's block ``lm-tuned``: per split, from ``tune_scores_<split>.csv`` (written by
    ``make lm-runs``' selection), each method's tuning runs, its chosen settings and score, and
    the scores along every searched axis through the choice: the lines on which the strict
    selection looks for an edge. The tuned config is named when it holds the choice."""
    numeric = lambda x: isinstance(x, float) and math.isfinite(x)
    parts = []
    for split in SPLITS:
        path = out / f"tune_scores_{split}.csv"
        if not path.exists():
            parts.append(f"{split}: no selection yet (`make lm-runs`).\n")
            continue
        table = read_csv(path)
        lines = [f"{split} ({len(table)} runs, one tuning seed; `{path.as_posix()}`):", "",
                 "| method | runs | chosen | score | final val_loss | along each searched axis "
                 "(value: score; the choice in bold) | tuned config |",
                 "|---|---:|---|---:|---:|---|---|"]
        for name in sorted({r["method"] for r in table}, key=order):
            rows = [r for r in table if r["method"] == name]
            rows = [r for r in rows if r["seeds"] == max(q["seeds"] for q in rows)]
            best = min(rows, key=lambda r: r["score"])
            chosen = {k: best[k] for k in SEARCHED if numeric(best.get(k))}
            axes = []
            for key in chosen:
                if len({r[key] for r in rows if numeric(r.get(key))}) < 2:
                    continue                                  # held fixed, not searched
                line = sorted(line_through(rows, chosen, key), key=lambda r: r[key])
                axes.append(f"{SEARCHED[key]} " + ", ".join(
                    ("**{}**" if r is best else "{}").format(f"{r[key]:g}: {r['score']:.4f}")
                    for r in line))
            config = tuned / f"lm_{split}" / f"{name}.yaml"
            held = (yaml.safe_load(config.read_text()) or {}).get("method", {}) \
                if config.exists() else None
            holds = held is not None and all(
                held.get(k.removeprefix("method.")) == v for k, v in chosen.items())
            lines.append(
                f"| {LABELS.get(name, name)} | {len(rows)} | "
                + ", ".join(f"{SEARCHED[k]} {v:g}" for k, v in chosen.items())
                + f" | {best['score']:.4f} | {best['final']:.3f} | {'; '.join(axes) or '-'} | "
                + (f"`{config.relative_to(tuned.parent.parent).as_posix()}`" if holds
                   else "none: on an edge, or not selected" if held is None
                   else "differs: rerun the selection") + " |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def quoted(out: Path = OUT) -> dict[str, str]:
    return {"lm": readme(out), "lm-tuned": tuning_table(out)}


def quote_in_docs(pages=DOCS, out: Path = OUT) -> None:
    """Write the block ``lm`` of each page from the committed tables (a test checks they match)."""
    quote_in_pages(pages, quoted(out))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["aggregate", "plot", "grads-cap", "readme", "tuning"])
    p.add_argument("--split", nargs="+", default=list(SPLITS), choices=SPLITS)
    p.add_argument("--sweep", default=None, help="the runs' folder (with one --split)")
    p.add_argument("--from", dest="source", choices=["panel", "tune"], default="panel")
    p.add_argument("--tuned", default=None, help="grads-cap --from tune: Alg. 1's tuned config")
    p.add_argument("--out", default=str(OUT), help="the tables' folder")
    p.add_argument("--fig", default=str(FIG))
    args = p.parse_args(argv)
    if args.sweep and len(args.split) != 1:
        raise SystemExit("error: --sweep reads one split's runs: give one --split")
    if args.command == "aggregate":
        done = [s for s in args.split if aggregate(s, args.sweep, Path(args.out))]
        if not args.sweep:
            print(compute_spent(sweep_dir("lm", panel("iid")).parent.parent, Path(args.out)))
        if done and (Path(args.out) / "reduction.md").exists():
            print((Path(args.out) / "reduction.md").read_text())
        if not args.sweep and Path(args.out) == OUT:
            quote_in_docs()
    elif args.command == "readme":
        print(readme(Path(args.out)), end="")
    elif args.command == "tuning":
        print(tuning_table(Path(args.out)), end="")
    elif args.command == "plot":
        plot(Path(args.out), Path(args.fig))
    else:
        if len(args.split) != 1:
            raise SystemExit("error: grads-cap is one split's: give one --split")
        cap = grads_cap(args.split[0], args.source, args.sweep,
                        Path(args.tuned) if args.tuned else None)
        print(f"{cap:.0f}")


if __name__ == "__main__":
    main()
