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
import csv
import io
import json
import math
import re
from pathlib import Path

import numpy as np

from experiments.shared.statistics import reduction_rows, smoothed_curves, window_of
from experiments.shared.tables import read_csv, write_csv
from experiments.shared.fair_panels import (BASELINES, DENSE, METHODS, PANELS, READINGS,
                                            SHORT, SWEEPS, label_text, order, panel_runs,
                                            reading_runs, sweep_of)
from experiments.shared.files import atomic_write_text
from experiments.shared.plotting import band_curve, log_axes, no_runs

OUT = Path("results/fair")
FIG = Path("figures")
# ---------------------------------------------------------------- the decomposition

def verdict(reduction: float, low: float, high: float, reached: int, seeds: int) -> str:
    """The rule fixed before the runs (docs/fair.md): a gain is told apart from zero when its
    95% interval lies wholly above 0 ("adds"), a loss when wholly below ("costs"); otherwise
    the two are not told apart. A method that misses the baseline's final level in a seed has
    no reduction: "not reached"."""
    if reached < seeds or math.isnan(reduction):
        return f"not reached ({reached}/{seeds} seeds)"
    if low > 0:
        return "adds"
    if high < 0:
        return "costs"
    return "not told apart"


def method_order(label: str) -> tuple:
    """The decomposition's rows: METHODS' order, Alg. 1's other densities after it."""
    base, _, density = label.partition("@")
    return METHODS.index(base), float(density or 0)


DECOMPOSITION_FIELDS = ["task", "reading", "method", "baseline", "best_dense", "level", "method_x",
                        "baseline_x", "reduction", "low", "high", "interval", "seeds",
                        "seeds_reached", "baseline_censored", "verdict", "baseline_B",
                        "raw_reduction", "raw_low", "raw_high", "raw_seeds_reached"]


def decomposition(rows: list[dict], task: str, reading: str,
                  batch: dict[str, int] | None = None) -> list[dict]:
    """From a reading's reduction rows: each method of METHODS (and Alg. 1 at the other RandK
    densities run, ``alg1@<density>``) against each dense baseline at that baseline's final
    level (smoothed first hit), with the interval Figure 2's README uses (the percentile
    bootstrap from 10 seeds on, the paired t-interval below) and its verdict. ``best_dense``
    marks the dense baseline with the lowest final level; ``baseline_B`` is large-batch Gluon's B
    in this reading (``batch``: {label: B}), tuned for it (B = 1 is Gluon itself)."""
    finals = [r for r in rows if r["level"] == "baseline_final"
              and r["metric"] == "smoothed_first_hit"]
    by = {(r["baseline"], r["method"]): r for r in finals}
    raw = {(r["baseline"], r["method"]): r for r in rows if r["level"] == "baseline_final"
           and r["metric"] == "raw_first_hit"}
    levels = {b: by[(b, b)]["eps"] for b in DENSE if (b, b) in by}
    best = min(levels, key=levels.get) if levels else ""
    out = []
    for m in sorted({r["method"] for r in finals if r["method"].partition("@")[0] in METHODS},
                    key=method_order):
        for b in DENSE:
            r = by.get((b, m))
            if r is None:
                continue
            t = r["seeds"] < 10
            low, high = (r["t_low"], r["t_high"]) if t else (r["ci_low"], r["ci_high"])
            w = raw.get((b, m), {})
            w_low, w_high = (w.get("t_low"), w.get("t_high")) if t else (w.get("ci_low"),
                                                                      w.get("ci_high"))
            out.append({"task": task, "reading": reading, "method": m, "baseline": b,
                        "best_dense": b == best, "level": r["eps"], "method_x": r["comm"],
                        "baseline_x": r["baseline_comm"], "reduction": r["reduction"],
                        "low": low, "high": high,
                        "interval": "95% t-interval" if t else "95% bootstrap CI",
                        "seeds": r["seeds"], "seeds_reached": r["seeds_reached"],
                        "baseline_censored": r["baseline_censored"],
                        "verdict": verdict(r["reduction"], low, high, r["seeds_reached"],
                                           r["seeds"]),
                        "baseline_B": (batch or {}).get(b) if b == "large_batch_gluon" else "",
                        "raw_reduction": w.get("reduction", math.nan), "raw_low": w_low,
                        "raw_high": w_high, "raw_seeds_reached": w.get("seeds_reached")})
    return out


def _num(v) -> bool:
    return not isinstance(v, str) and v is not None and not math.isnan(v)


def _pct(r: dict) -> str:
    if not _num(r["reduction"]):
        return r["verdict"]
    return f"{100 * r['reduction']:.0f}% [{100 * r['low']:.0f}, {100 * r['high']:.0f}]"


def _raw(r: dict) -> str:
    """The raw first hit beside the smoothed one (docs/statistics.md): "; raw 38% [34, 42]"."""
    red = r.get("raw_reduction")
    if red in (None, "") or not _num(float(red)):
        reached = r.get("raw_seeds_reached")
        return "" if reached in (None, "") else \
            f"; raw: not reached ({int(float(reached))}/{int(float(r['seeds']))})"
    return (f"; raw {100 * float(red):.0f}% [{100 * float(r['raw_low']):.0f}, "
            f"{100 * float(r['raw_high']):.0f}]")


def markdown(rows: list[dict]) -> str:
    """decomposition.md: per panel and reading, Alg. 1 and 2's reduction against each dense
    baseline at that baseline's final level, its interval and verdict."""
    lines = ["| panel | reading | method | " + " | ".join(
        f"against {SHORT[b]}" for b in DENSE) + " |", "|---|---|---|" + "---|" * len(DENSE)]
    get = {(r["task"], r["reading"], r["method"], r["baseline"]): r for r in rows}
    keys = sorted({(r["task"], r["reading"], r["method"]) for r in rows},
                  key=lambda k: (k[0] != "a5a", list(READINGS).index(k[1]), method_order(k[2])))
    for task, reading, m in keys:
        cells = []
        for b in DENSE:
            r = get.get((task, reading, m, b))
            if r is None:
                cells.append("-")
                continue
            marks = ["best dense"] if r["best_dense"] in (True, "True") else []
            if str(r.get("baseline_B", "")) not in ("", "None"):
                marks.append(f"B = {int(float(r['baseline_B'])):,}")
            best = f" ({', '.join(marks)})" if marks else ""
            cells.append((f"{_pct(r)} {r['verdict']}{best}" if _num(r["reduction"])
                          else f"{r['verdict']}{best}") + _raw(r))
        lines.append(f"| {task} | {reading} | {label_text(m)} | " + " | ".join(cells) + " |")
    notes = sorted({(r["task"], r["reading"], r["interval"], int(r["seeds"])) for r in rows})
    text = "\n".join(lines) + "\n\n" + "Each cell: the reduction in uplink (or in gradient " \
        "evaluations) to reach that baseline's final level by the smoothed first hit (the rule's " \
        "statistic, fixed before the runs), then by the raw first hit. Intervals: " + "; ".join(
            f"{t} {rd}: {iv} over {n} seeds" for t, rd, iv, n in notes) + ".\n"
    return text + "\n" + answer(rows) + "\n"


LESS = {"uplink": ("less", "more"), "gradient evaluations": ("fewer", "more")}


def _against(r: dict, what: str) -> str:
    """A method's result against one baseline, in words (numbers from the row): a negative
    reduction is said as "more"."""
    if _num(r["reduction"]):
        less, more = LESS[what]
        red, low, high = (100 * float(r[k]) for k in ("reduction", "low", "high"))
        if red >= 0:
            return f"needs {red:.0f}% [{low:.0f}, {high:.0f}] {less} {what} ({r['verdict']})"
        return f"needs {-red:.0f}% [{-high:.0f}, {-low:.0f}] {more} {what} ({r['verdict']})"
    reached, seeds = int(r["seeds_reached"]), int(r["seeds"])
    if reached == 0:
        return f"never reaches its final level (0 of {seeds} seeds)"
    return f"reaches its final level in only {reached} of {seeds} seeds"


def answer(rows: list[dict]) -> str:
    """The one-sentence mechanism per panel, written from the table (the README quotes it)."""
    get = {(r["task"], r["reading"], r["method"], r["baseline"]): r for r in rows}
    out = []
    for task in sorted({r["task"] for r in rows}, key=lambda t: t != "a5a"):
        parts = []
        for reading, what in (("uplink", "uplink"), ("compute", "gradient evaluations")):
            here = [r for r in rows if r["task"] == task and r["reading"] == reading]
            best = next((r["baseline"] for r in here if r["best_dense"] in (True, "True")), None)
            if not here or best is None:
                continue
            B = next((r.get("baseline_B") for r in here if r["baseline"] == best
                      and str(r.get("baseline_B", "")) not in ("", "None")), None)
            said = {best: f"against the best dense baseline, {SHORT[best]}"
                          + (f" (tuned for this reading: B = {int(float(B)):,})" if B else "") + ",",
                    "local_gluon": "against Local Gluon, which sends only the syncs,",
                    "gluon": "against Gluon at B = 1 (the paper's baseline"
                             + (" and here the best dense baseline)" if best == "gluon" else ")")}
            cells = [(b, get.get((task, reading, "alg1", b)))
                     for b in dict.fromkeys(("gluon", best, "local_gluon"))]
            if any(c is None for _, c in cells):
                continue
            words = [f"{said[b]} it {_against(c, what)}" if b != "gluon" else
                     f"Alg. 1 {_against(c, what)} {said[b]}" for b, c in cells]
            parts.append(f"at equal {reading}, " + "; ".join(words))
            ef21 = get.get((task, reading, "ef21_muon", "gluon"))
            if ef21 is not None and _num(ef21["reduction"]):
                parts[-1] += (f"; EF21-Muon (TopK 1% with error feedback, B = 1), re-tuned, "
                              f"{_against(ef21, what)} than Gluon at B = 1")
        out.append(f"**{task}**: " + ("; ".join(parts) + "." if parts else "pending."))
    return "\n\n".join(out)


def write_decomposition(rows: list[dict], task_name: str) -> None:
    """Replace one panel's rows of decomposition.csv (the other panel's are kept) and rewrite
    decomposition.md from the whole CSV."""
    path = OUT / "decomposition.csv"
    keep = [r for r in read_csv(path) if r["task"] != task_name] if path.exists() else []
    all_rows = sorted(keep + rows, key=lambda r: r["task"] != "a5a")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=DECOMPOSITION_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in all_rows:
        w.writerow({k: ("" if isinstance(r[k], float) and math.isnan(r[k]) else r[k])
                    for k in DECOMPOSITION_FIELDS})
    atomic_write_text(path, buf.getvalue())
    atomic_write_text(OUT / "decomposition.md", markdown(read_csv(path)))


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
        raise SystemExit(f"no finished runs under {SWEEPS / task}: run `make fair-runs`")
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
                no_runs(ax, "make fair-cnn-runs (docs/fair.md)")
                continue
            for label in sorted({r["label"] for r in rows}, key=order):
                rs = [r for r in rows if r["label"] == label]
                base, _, density = label.partition("@")
                ls = "--" if base in BASELINES else ("-" if not density else ":")
                band_curve(ax, rs, "comm", ls, lw=1.5, color=f"C{order(label)[0] % 10}",
                           label=label_text(label) + batch_of(settings.get(name, {}), label),
                           band_alpha=0.18, raw_alpha=0.3)
            info = settings.get(name, {})
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


def block(name: str) -> re.Pattern:
    """The ``<!-- name:begin -->`` ... ``<!-- name:end -->`` block of a page."""
    return re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)


def quoted() -> dict[str, str]:
    """What each block holds: ``fair`` the whole decomposition.md, ``fair-answer`` its sentences."""
    return {"fair": readme(), "fair-answer": answer(read_csv(OUT / "decomposition.csv")) + "\n"}


def quote_in_docs(pages=DOCS) -> None:
    """Write the blocks each page has (``fair``, ``fair-answer`` or both), so the pages quote the
    tables as the code wrote them (a test checks they do). A page with neither is an error."""
    texts = quoted()
    for page in pages:
        text = page.read_text()
        if not any(block(name).search(text) for name in texts):
            raise SystemExit(f"{page} has no <!-- fair:begin --> or <!-- fair-answer:begin --> block")
        new = text
        for name, body in texts.items():
            new = block(name).sub(lambda m: m.group(1) + body + m.group(2), new)
        if new != text:
            atomic_write_text(page, new)


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
