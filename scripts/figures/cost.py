"""Figure 2's runs re-costed for any network (docs/cost.md): crossover tables and figures.

    python -m scripts.figures.cost table    # crossover bandwidths -> results/cost/crossover.{csv,md}
    python -m scripts.figures.cost plot     # figures/fig_cost_{a5a,cnn}.png (a), (b), (c)
    python -m scripts.figures.cost all      # both (make fig-cost)
    python -m scripts.figures.cost readme   # the README's crossover table (a5a), from crossover.csv

The model and its terms: experiments/shared/cost_model.py (docs/cost.md).
"""
from __future__ import annotations

import argparse
import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from experiments.shared.cost_model import (COST_COLUMNS, PANEL_NAMES, TOPOLOGIES, Compute, Network,
                                           bench_compute, columns, measured_network, modelled_time,
                                           split_time)

OUT = Path("results/cost")
FIG = Path("figures")
BANDWIDTHS = (10e6, 1e9, 100e9)                 # bit/s: the three of panel (b)
SWEEP = np.logspace(6, 11, 201)                 # bit/s: 1 Mbit/s to 100 Gbit/s, panel (c)
FIGURE_PANELS = ("logreg", "cnn")                 # the panels fig_cost_*.png draws
COMPRESSED = ("alg1", "alg2", "alg3", "alg4", "ef21_muon", "vr_marina")
RESAMPLES = 2000


# ---------------------------------------------------------------- runs and levels

@dataclass
class Panel:
    task: str
    metric: str
    window: float
    budget: float
    runs: dict            # method -> [Run] sorted by seed
    note: str = ""


def load_panel(task: str, sweep: str | None = None) -> Panel:
    """The runs of a Fig. 2 panel, grouped by method (empty with a note when there are none or
    they lack the cost columns); ``fair_logreg``, ``fair_cnn``: the fair-baseline panels at equal
    uplink."""
    if task.startswith("fair_"):
        return _fair_panel(task[len("fair_"):], sweep)
    if task.startswith("lm_"):
        return _lm_panel(task, sweep)
    from experiments.shared.configs import sweep_dir
    from experiments.shared.fig2_panels import TASKS, budget_of, order
    from experiments.shared.statistics import group_runs, load_runs, window_of
    spec = TASKS[task]
    root = Path(sweep or sweep_dir(*spec["experiment"]))
    runs = load_runs(root) if root.exists() else []
    if not runs:
        return Panel(task, spec["metric"], math.nan, math.nan, {},
                     f"no {PANEL_NAMES[task]} panel runs under {root} (make fig2-{task})")
    old = [r for r in runs if any(c not in r.rows[0] for c in COST_COLUMNS)]
    if old:
        return Panel(task, spec["metric"], math.nan, math.nan, {},
                     f"{len(old)} of the {len(runs)} runs under {root} were written before the "
                     f"cost columns existed (make clean, then make fig2-{task})")
    by = {}
    for group in group_runs(runs).values():
        by[group[0].config["method"]["name"]] = sorted(group, key=lambda r: r.config["seed"])
    budget = budget_of(runs, root)
    return Panel(task, spec["metric"], window_of(budget), budget,
                 dict(sorted(by.items(), key=lambda kv: order(kv[0]))))


def _fair_panel(task: str, sweep: str | None = None) -> Panel:
    """A fair-baseline panel at equal uplink (scripts/figures/fair.py), Alg. 1 at Figure 2's
    density only (its density variants are the study's, not methods to re-cost). As ``make fair``
    does, a baseline whose panel is still running is left out, and the note names it."""
    from experiments.shared.statistics import window_of
    from experiments.shared.fair_panels import (BASELINES, PANELS, READINGS, budget_of, complete,
                                                panel_runs, sweep_of)
    name = f"fair_{task}"
    given = Path(sweep) if sweep else None          # None: the reading's own folder, and SHARED
    root = given or sweep_of(task, "uplink")
    groups = {k: v for k, v in panel_runs(task, "uplink", given).items() if "@" not in k} \
        if root.exists() else {}
    if not groups:
        return Panel(name, PANELS[task].metric, math.nan, math.nan, {},
                     f"no {PANEL_NAMES[name]} panel runs under {root} "
                     f"(make {PANELS[task].runs})")
    budget = budget_of(groups, READINGS["uplink"], root)
    groups = complete(groups, f"[cost] {PANEL_NAMES[name]}")
    running = [b for b in BASELINES if b not in groups]
    note = (f"{PANEL_NAMES[name]}: panel still running, not re-costed yet: {', '.join(running)} "
            f"(make {PANELS[task].runs})") if running else ""
    return Panel(name, PANELS[task].metric, window_of(budget), budget, groups, note)


def _lm_panel(task: str, sweep: str | None = None) -> Panel:
    """The LM study's panel of one worker split (docs/lm.md): every method at its tuned
    settings, validation loss against uplink."""
    from experiments.shared.configs import sweep_dir
    from experiments.shared.fair_panels import order
    from experiments.shared.fig2_panels import budget_of
    from experiments.shared.statistics import by_method, load_runs, window_of
    split = task[len("lm_"):]
    root = Path(sweep or sweep_dir("lm", f"lm/panel_{split}"))
    runs = load_runs(root) if root.exists() else []
    if not runs:
        return Panel(task, "val_loss", math.nan, math.nan, {},
                     f"no {PANEL_NAMES[task]} panel runs under {root} (make lm-runs)")
    budget = budget_of(runs, root)
    return Panel(task, "val_loss", window_of(budget), budget, by_method(runs, root, order))


def gluon_level(panel: Panel) -> float:
    """Gluon's final level: the level its smoothed curves hold over the last 10% of the budget
    (docs/statistics.md, the level of Fig. 2's reduction table)."""
    from experiments.shared.statistics import final_level
    return final_level(panel.runs["gluon"], panel.metric, panel.budget, panel.window)


def first_row(run, metric: str, window: float, level: float) -> int | None:
    """The first row where the run's smoothed curve is at or below ``level`` (None: never)."""
    from experiments.shared.statistics import run_curve
    _, sm = run_curve(run, metric, window)
    idx = np.nonzero(sm <= level)[0]
    return int(idx[0]) if idx.size else None


def hits(panel: Panel, level: float) -> dict[str, dict[int, int | None]]:
    """method -> seed -> first row reaching ``level``; Gluon's seeds that never reach it are
    censored at their last row (as the reduction table censors them at the budget)."""
    out = {}
    for m, runs in panel.runs.items():
        out[m] = {}
        for r in runs:
            i = first_row(r, panel.metric, panel.window, level)
            if i is None and m == "gluon":
                i = len(r.rows) - 1
            out[m][r.config["seed"]] = i
    return out


def time_terms(panel: Panel, level: float, net: Network, compute: Compute | None,
               ratio: float = 1.0) -> dict[str, dict]:
    """Per method: seeds, and per seed (A, C) with T(B) = A + C / B at the first row reaching
    ``level``, for an uplink of B bit/s and a downlink of ``ratio`` B. Seeds that never reach
    it are NaN."""
    out = {}
    for m, hm in hits(panel, level).items():
        seeds = sorted(hm)
        A, C = [], []
        for r in panel.runs[m]:
            i = hm[r.config["seed"]]
            if i is None:
                A.append(math.nan)
                C.append(math.nan)
                continue
            cols = {k: v[i:i + 1] for k, v in columns(r.rows).items()}
            a, up, down = (float(x[0]) for x in split_time(cols, m, net, compute))
            A.append(a)
            C.append(up + down / ratio if net.topology == "star" else max(up, down / ratio))
        out[m] = {"seeds": seeds, "A": np.array(A), "C": np.array(C)}
    return out


def crossover(a_m, c_m, a_g, c_g) -> tuple[float, str]:
    """The bandwidth B* where A_m + C_m / B = A_g + C_g / B, and on which side the method is
    first: "below" (first for B < B*), "above", "always" (B* = inf) or "never" (B* = 0)."""
    da, dc = a_m - a_g, c_m - c_g
    if da <= 0 and dc <= 0:
        return (math.inf, "always") if (da < 0 or dc < 0) else (math.nan, "tie")
    if da >= 0 and dc >= 0:
        return 0.0, "never"
    return dc / -da if da > 0 else -dc / da, ("below" if da > 0 else "above")


def crossover_rows(panel: Panel, level: float, net: Network, compute: Compute | None,
                   label: str, ratio: float = 1.0, seed: int = 0) -> list[dict]:
    """Per method: the crossover bandwidth against Gluon (means over seeds) with a 95%
    percentile interval from resampling the seeds in pairs (the same seeds for both)."""
    terms = time_terms(panel, level, net, compute, ratio)
    g = terms["gluon"]
    rng = np.random.default_rng(seed)
    out = []
    for m, t in terms.items():
        if m == "gluon":
            continue
        if t["seeds"] != g["seeds"]:
            raise ValueError(f"{m} and gluon need runs for the same seeds: {t['seeds']} vs "
                             f"{g['seeds']}")
        reached = int(np.sum(~np.isnan(t["A"])))
        row = {"task": PANEL_NAMES[panel.task], "model": label, "topology": net.topology,
               "latency_ms": 1e3 * net.latency_s, "frame_bytes": net.frame_bytes,
               "header_share": net.header_share, "down_over_up": ratio, "method": m,
               "level": level, "seeds": len(t["seeds"]), "seeds_reached": reached,
               "crossover_bps": math.nan, "ci_low_bps": math.nan, "ci_high_bps": math.nan,
               "side": "not reached"}
        for b in BANDWIDTHS:
            row[f"time_ratio_at_{b:.0e}"] = math.nan
        if reached == len(t["seeds"]):
            point, side = crossover(t["A"].mean(), t["C"].mean(), g["A"].mean(), g["C"].mean())
            idx = rng.integers(0, len(t["seeds"]), size=(RESAMPLES, len(t["seeds"])))
            boot = np.array([crossover(t["A"][i].mean(), t["C"][i].mean(), g["A"][i].mean(),
                                       g["C"][i].mean())[0] for i in idx])
            boot = boot[~np.isnan(boot)]
            lo, hi = np.quantile(boot, [0.025, 0.975], method="inverted_cdf")
            row.update(crossover_bps=point, side=side, ci_low_bps=float(lo), ci_high_bps=float(hi))
            for b in BANDWIDTHS:
                row[f"time_ratio_at_{b:.0e}"] = float(np.mean(t["A"] + t["C"] / b)
                                                      / np.mean(g["A"] + g["C"] / b))
        out.append(row)
    return out


# ---------------------------------------------------------------- the models the table shows

def models(measured: dict) -> list[tuple[str, Network]]:
    """(label, network at 1 bit/s) of every model the crossover table reports: payload only
    (no latency, no framing), the framing measured on the shaped network, and that plus 1 ms of
    latency a hop; each for the star and the ring."""
    F, h = float(measured.get("frame_bytes", 0.0)), float(measured.get("header_share", 0.0))
    out = []
    for topo in TOPOLOGIES:
        out.append(("payload only", Network(1.0, topology=topo)))
        out.append(("measured framing", Network(1.0, frame_bytes=F, header_share=h, topology=topo)))
        out.append(("measured framing, 1 ms latency",
                    Network(1.0, latency_s=1e-3, frame_bytes=F, header_share=h, topology=topo)))
    return out


_SAID: set[str] = set()


def say(note: str) -> None:
    """Print a note once per process (``all`` makes the table and the figures)."""
    if note not in _SAID:
        _SAID.add(note)
        print(note)


def _bps(x: float) -> str:
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "any"
    if x == 0:
        return "0"
    for unit, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if x >= f:
            return f"{x / f:.3g} {unit}"
    return f"{x:.3g} bit/s"


def markdown(rows: list[dict]) -> str:
    lines = ["| task | topology | model | method | reaches Gluon's level (seeds) | first below "
             "(bandwidth) [95% CI over seeds] | time / Gluon's at 10 Mbit/s | at 1 Gbit/s | "
             "at 100 Gbit/s |", "|---|---|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        if r["side"] == "not reached":
            cross = "-"
        elif r["side"] == "never":
            cross = "never (at no bandwidth)"
        elif r["side"] in ("below", "always"):
            cross = (f"{_bps(r['crossover_bps'])} [{_bps(r['ci_low_bps'])}, "
                     f"{_bps(r['ci_high_bps'])}]")
        else:
            cross = f"first *above* {_bps(r['crossover_bps'])} [{_bps(r['ci_low_bps'])}, " \
                    f"{_bps(r['ci_high_bps'])}]"
        ratios = " | ".join("-" if math.isnan(r[f"time_ratio_at_{b:.0e}"]) else
                            f"{r[f'time_ratio_at_{b:.0e}']:.2f}" for b in BANDWIDTHS)
        lines.append(f"| {r['task']} | {r['topology']} | {r['model']} | {r['method']} | "
                     f"{r['seeds_reached']}/{r['seeds']} | {cross} | {ratios} |")
    return "\n".join(lines) + "\n"


def spend(panel: Panel, level: float) -> str:
    """What each method has spent, per worker, when its smoothed curve first reaches ``level``:
    means over the seeds that reach it (markdown)."""
    keys = ("step", "grads", "comm", "bytes", "star_down_bytes", "up_bytes", "rounds")
    lines = [f"| {PANEL_NAMES[panel.task]}: at Gluon's final level ({level:.3g}) | seeds | steps | "
             "gradients | uplink (dense units) | uplink bytes | star downlink bytes | ring bytes "
             "each way | messages |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, hm in hits(panel, level).items():
        got = [r.rows[hm[r.config["seed"]]] for r in panel.runs[m] if hm[r.config["seed"]] is not None]
        if not got:
            continue
        mean = {k: float(np.mean([g[k] for g in got])) for k in keys}
        lines.append(f"| {m} | {len(got)}/{len(hm)} | {mean['step']:,.0f} | {mean['grads']:,.0f} | "
                     f"{mean['comm']:,.1f} | {mean['bytes']:,.0f} | {mean['star_down_bytes']:,.0f} | "
                     f"{mean['up_bytes']:,.0f} | {mean['rounds']:,.0f} |")
    return "\n".join(lines) + "\n"


def table(tasks=tuple(PANEL_NAMES), compute_source: str = "bench") -> list[dict]:
    """crossover.csv and crossover.md for ``tasks``; the rows (and the spending table,
    ``spent_<panel>.md``) of a panel not among them, or without runs here, are kept as they
    are, so re-costing one panel never drops the other's results."""
    from experiments.shared.files import atomic_write_text
    from experiments.shared.tables import read_csv, write_csv
    measured = measured_network()
    rows, notes, done = [], [], set()
    OUT.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        panel = load_panel(task)
        if panel.note:                  # no runs, or baselines still running
            notes.append((panel.note, PANEL_NAMES[task]))
            say(panel.note)
        if not panel.runs:
            continue
        compute = None if compute_source == "measured" else bench_compute(task)
        level = gluon_level(panel)
        for label, net in models(measured):
            rows += crossover_rows(panel, level, net, compute, label)
        atomic_write_text(OUT / f"spent_{PANEL_NAMES[task]}.md", spend(panel, level))
        done.add(PANEL_NAMES[task])
    old = read_csv(OUT / "crossover.csv") if (OUT / "crossover.csv").exists() else []
    kept = [{**r, "seeds": int(r["seeds"]), "seeds_reached": int(r["seeds_reached"])}
            for r in old if r["task"] not in done]        # counts read back as numbers
    rows = kept + rows
    held = {r["task"] for r in kept}       # a panel without runs here keeps its rows: say so
    notes = [f"{n} (the {name} rows above are kept from the last re-costing)" if name in held
             else n for n, name in notes]
    order = list(PANEL_NAMES.values())
    rows.sort(key=lambda r: order.index(r["task"]) if r["task"] in order else len(order))
    write_csv(rows, OUT / "crossover.csv")
    text = markdown(rows) if rows else ""
    src = measured.get("source", "not measured")
    text += (f"\nFraming measured on the shaped network ({src}): F = "
             f"{measured.get('frame_bytes', 0):.0f} bytes a message and hop, h = "
             f"{100 * measured.get('header_share', 0):.1f}% of the payload. Compute: "
             f"{compute_source}. Uplink = downlink.\n")
    text += "".join(f"\n{(OUT / f'spent_{name}.md').read_text()}" for name in order
                    if (OUT / f"spent_{name}.md").exists())
    print(text)
    atomic_write_text(OUT / "crossover.md", text + "".join(f"\n{n}\n" for n in notes))
    return rows


# ---------------------------------------------------------------- the figures

def _grid_curve(runs, metric, window, x_of, grid):
    """Per grid point: geometric mean over seeds of the smoothed metric as a step function of
    x (the last row with x <= grid point; NaN past a run's end), and a 95% bootstrap band."""
    from experiments.shared.statistics import run_curve
    vals = []
    for r in runs:
        _, sm = run_curve(r, metric, window)
        x = x_of(r)
        idx = np.searchsorted(x, grid, side="right") - 1
        v = np.where(idx >= 0, sm[np.clip(idx, 0, None)], np.nan)
        v[grid > x[-1] * (1 + 1e-12)] = np.nan
        vals.append(v)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lv = np.log(np.clip(np.array(vals), 1e-300, None))
        mean = np.exp(lv.mean(0))
        boot = np.random.default_rng(0).integers(0, len(runs), size=(RESAMPLES, len(runs)))
        lo, hi = np.exp(np.quantile(lv[boot].mean(1), [0.025, 0.975], axis=0))
    return mean, lo, hi


def plot(tasks=FIGURE_PANELS, out: Path = FIG) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from experiments.shared.fig2_panels import LABELS, TASKS, order

    measured = measured_network()
    net0 = Network(1.0, frame_bytes=float(measured.get("frame_bytes", 0.0)),
                   header_share=float(measured.get("header_share", 0.0)), topology="star")
    ideal = Network(1.0, topology="star")
    written = []
    for task in tasks:
        panel = load_panel(task)
        if not panel.runs:                  # one line, no figure
            say(panel.note)
            continue
        fig, grid_axes = plt.subplots(2, 3, figsize=(17, 9.5))
        axes = [grid_axes[0, 0], grid_axes[0, 1], grid_axes[0, 2], grid_axes[1, 0],
                grid_axes[1, 1]]
        legend_ax = grid_axes[1, 2]
        legend_ax.axis("off")
        name = PANEL_NAMES[task]
        path = out / f"fig_cost_{name}.png"
        compute = bench_compute(task)
        level = gluon_level(panel)
        ylabel = TASKS[task]["ylabel"]
        color = {m: f"C{order(m) % 10}" for m in panel.runs}
        # (a) against gradient evaluations
        ax = axes[0]
        gmax = max(max(r.rows[-1]["grads"] for r in rs) for rs in panel.runs.values())
        grid = np.geomspace(1.0, gmax, 400)
        for m, runs in panel.runs.items():
            mean, lo, hi = _grid_curve(runs, panel.metric, panel.window,
                                       lambda r: columns(r.rows)["grads"], grid)
            ax.plot(grid, mean, color=color[m], lw=1.5, label=LABELS.get(m, m))
            ax.fill_between(grid, lo, hi, color=color[m], alpha=0.2, lw=0)
        ax.set_xlabel("gradient evaluations per worker (minibatches)")
        ax.set_title(f"(a) {name}: against compute", fontsize=10)
        # (b) against modelled wall-clock at three bandwidths
        for ax, bw in zip(axes[1:4], BANDWIDTHS):
            net = replace(net0, up_bps=bw)
            ends = {m: [modelled_time(columns(r.rows), m, net, compute)[-1] for r in rs]
                    for m, rs in panel.runs.items()}
            tmax = max(max(v) for v in ends.values())
            tmin = min(min(modelled_time(columns(r.rows), m, net, compute)[1] for r in rs)
                       for m, rs in panel.runs.items())
            grid = np.geomspace(max(tmin, tmax * 1e-5), tmax, 400)
            for m, runs in panel.runs.items():
                mean, lo, hi = _grid_curve(
                    runs, panel.metric, panel.window,
                    lambda r, m=m: modelled_time(columns(r.rows), m, net, compute), grid)
                ax.plot(grid, mean, color=color[m], lw=1.5)
                ax.fill_between(grid, lo, hi, color=color[m], alpha=0.2, lw=0)
            ax.set_xlabel("modelled wall-clock (s)")
            ax.set_title(f"(b) {_bps(bw)} up and down, star", fontsize=10)
        for ax in axes[:4]:
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            ax.axhline(level, color="k", lw=0.6, ls=":")
            ax.grid(True, which="both", alpha=0.3)
        handles, labels = axes[0].get_legend_handles_labels()
        # (c) time to Gluon's final level against bandwidth
        ax = axes[4]
        for netc, ls, alpha in ((net0, "-", 0.2), (ideal, "--", 0.0)):
            terms = time_terms(panel, level, netc, compute)
            g = terms["gluon"]
            gmean = np.mean(g["A"][:, None] + g["C"][:, None] / SWEEP, 0)
            for m, t in terms.items():
                if np.isnan(t["A"]).any():
                    continue
                T = t["A"][:, None] + t["C"][:, None] / SWEEP          # seeds x bandwidths
                ax.plot(SWEEP, T.mean(0), ls, color=color[m], lw=1.5 if ls == "-" else 0.9)
                if alpha:
                    boot = np.random.default_rng(0).integers(0, len(T), (RESAMPLES, len(T)))
                    lo, hi = np.quantile(T[boot].mean(1), [0.025, 0.975], axis=0)
                    ax.fill_between(SWEEP, lo, hi, color=color[m], alpha=alpha, lw=0)
                if m != "gluon":
                    point, side = crossover(t["A"].mean(), t["C"].mean(), g["A"].mean(),
                                            g["C"].mean())
                    if side in ("below", "above") and SWEEP[0] <= point <= SWEEP[-1]:
                        y = float(np.interp(point, SWEEP, gmean))
                        ax.plot([point], [y], "o" if ls == "-" else "x", color=color[m], ms=7,
                                mfc="none" if ls == "--" else color[m])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bandwidth, up = down (bit/s)")
        ax.set_ylabel(f"modelled time to Gluon's final level ({level:.3g}) (s)")
        ax.set_title("(c) time to the level; o: where a method stops beating Gluon", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        solid = ax.plot([], [], "k-", label=f"(c) star, framing F = {net0.frame_bytes:.0f} B a "
                        f"message, h = {100 * net0.header_share:.1f}%; band: 95% over seeds")
        dashed = ax.plot([], [], "k--", lw=0.9, label="(c) payload only (x: its crossover)")
        legend_ax.legend(handles + solid + dashed, labels + [solid[0].get_label(),
                         dashed[0].get_label()], loc="center", fontsize=9,
                         title=f"dotted: Gluon's final level, {level:.3g}")
        fig.suptitle(f"{name}: compute from {compute.source}; latency 0; star topology "
                     f"(a server, n = {panel.runs['gluon'][0].config['n_workers']} workers); "
                     "geometric mean over seeds of the smoothed curves, 95% bootstrap band",
                     fontsize=10)
        fig.tight_layout()
        out.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, metadata={"Software": None})
        plt.close(fig)
        print(f"wrote {path}")
        written.append(path)
    return written


README_METHODS = {"large_batch_gluon": "large-batch Gluon", "local_gluon": "Local Gluon (syncs only)",
                  "alg1": "Alg. 1 (RandK 1%)", "alg2": "Alg. 2 (TopK 1%, EF)",
                  "ef21_muon": "EF21-Muon (TopK 1%)", "alg4": "Alg. 4 (TopK 1%, EF + MVR)"}


def _cell(r: dict) -> str:
    if r["side"] == "never":
        return "never"
    if r["side"] != "below":
        return r["side"]
    point = r["crossover_bps"]
    unit, f = next((u, f) for u, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3))
                   if point >= f)
    num = lambda x: "0" if x == 0 else f"{x / f:.3g}"
    return f"{num(point)} {unit} [{num(r['ci_low_bps'])}, {num(r['ci_high_bps'])}]"


def readme_table(task: str = "a5a", path: Path | None = None) -> str:
    """The README's crossover table, from results/cost/crossover.csv (latency 0)."""
    from experiments.shared.tables import read_csv
    rows = [r for r in read_csv(path or OUT / "crossover.csv") if r["task"] == task]
    get = {(r["topology"], r["model"], r["method"]): r for r in rows}
    cols = [("star", "payload only"), ("ring", "payload only"), ("star", "measured framing"),
            ("ring", "measured framing")]
    lines = ["| method | star (a server), payload only | ring, payload only | star, with the "
             "measured framing | ring, with the measured framing |", "|---|---|---|---|---|"]
    for m, name in README_METHODS.items():
        if all((t, mo, m) in get for t, mo in cols):        # the methods of the task's panel
            lines.append(f"| {name} | " + " | ".join(_cell(get[(t, mo, m)]) for t, mo in cols)
                         + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["table", "plot", "all", "readme"])
    ap.add_argument("--task", choices=list(PANEL_NAMES), nargs="+", default=list(PANEL_NAMES))
    ap.add_argument("--compute", choices=["bench", "measured"], default="bench",
                    help="compute time: make bench's per-gradient time, or the rows' compute_s")
    args = ap.parse_args(argv)
    if args.cmd == "readme":
        for task in args.task:
            print(f"{PANEL_NAMES[task]}:\n{readme_table(PANEL_NAMES[task])}")
        return
    if args.cmd in ("table", "all"):
        table(args.task, args.compute)
    if args.cmd in ("plot", "all"):
        plot([t for t in args.task if t in FIGURE_PANELS])


if __name__ == "__main__":
    main()
