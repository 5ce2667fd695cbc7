"""Does this machine reproduce Figure 2's a5a panel? ``make verify``.

    python -m scripts.analysis.verify --sweep results/runs/verify/fig2_logreg --out results/runs/verify/fig2
    python -m scripts.analysis.verify --new results/runs/verify/fig2/reduction.csv   # compare only

``make verify`` runs the panel's sweep (experiment ``fig2_logreg``: 7 methods x 10 seeds, about
4 minutes on 2 idle cores) into ``results/runs/verify/`` (ignored by git, removed by ``make
clean``; finished runs there are skipped), then this module aggregates it with the figure's own
code (:func:`scripts.figures.fig2.aggregate`) into ``<out>/``, leaving ``results/fig2/`` as committed, and
compares it with the committed ``results/fig2/reduction.csv``:

* **The check.** Every reduction of the primary statistic (smoothed first hit,
  docs/statistics.md) that the committed table gives with an interval: each method's uplink
  saved to reach each baseline's final level (the README's headline table) and each fixed
  tolerance. The new reduction must lie inside the committed 95% interval (the bootstrap over
  seeds from 10 seeds on, else the paired t-interval, as the README's table), and a reduction
  committed as not reached (censored seeds) must not be reached either.
* **What is reported beside it.** The largest difference of a reduction, and how far the new
  curves (``<out>/logreg_curves.csv``) are from the committed ones. On the machine type that made
  the committed files the runs are bit-identical (the seeds fix every random choice); on another
  CPU the last bits of floating-point sums differ and a long run amplifies them, most where TopK
  makes discrete choices, so points move by a few percent while the reductions stay inside their
  intervals: "my numbers differ as CPUs do", not "something is wrong".

Exit status 0 with ``verdict: reproduced`` (``bit-identical`` when the curves are equal byte for
byte too), 1 with ``verdict: NOT reproduced`` and the rows outside their intervals, 2 for a
missing input.
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

from experiments.shared.files import REPO
from experiments.shared.tables import read_csv

COMMITTED = Path("results/fig2")
TASK = "a5a"                          # the a5a panel's rows in reduction.csv
PRIMARY = "smoothed_first_hit"


def _num(x) -> bool:
    return isinstance(x, float) and not math.isnan(x)


def interval(row: dict) -> tuple[float, float]:
    """The committed 95% interval of a row's reduction: the bootstrap from 10 seeds on, else
    the paired t-interval (which the bootstrap under-covers with few seeds)."""
    lo, hi = ("ci_low", "ci_high") if row["seeds"] >= 10 else ("t_low", "t_high")
    return row[lo], row[hi]


def _key(r: dict) -> tuple:
    return (r["baseline"], r["level"], round(float(r["eps"]), 12) if r["level"] == "eps"
            else None, r["method"])


def compare(committed: list[dict], new: list[dict]) -> tuple[list[dict], bool]:
    """One verdict per checked row (see the module docstring), and whether all hold. A row is
    ``{"method", "baseline", "level", "committed", "low", "high", "new", "ok", "why"}``."""
    mine = {_key(r): r for r in new if r["task"] == TASK and r["metric"] == PRIMARY}
    out = []
    for c in committed:
        if c["task"] != TASK or c["metric"] != PRIMARY or c["method"] == c["baseline"]:
            continue
        n = mine.get(_key(c))
        low, high = interval(c) if _num(c["reduction"]) else (math.nan, math.nan)
        row = {"method": c["method"], "baseline": c["baseline"],
               "level": "final" if c["level"] == "baseline_final" else f"{c['eps']:g}",
               "committed": c["reduction"], "low": low, "high": high,
               "new": n["reduction"] if n is not None else math.nan}
        if n is None:
            row.update(ok=False, why="missing from the new table")
        elif not _num(c["reduction"]):
            reached = f"{int(c['seeds_reached'])} of {int(c['seeds'])} seeds"
            row.update(ok=not _num(n["reduction"]),
                       why=f"not reached (committed: {reached}; new: "
                           f"{int(n['seeds_reached'])} of {int(n['seeds'])})")
        elif not _num(n["reduction"]):
            row.update(ok=False, why=f"not reached now ({int(n['seeds_reached'])} of "
                                     f"{int(n['seeds'])} seeds)")
        elif not (_num(low) and _num(high)):
            continue                   # no interval committed: nothing to check against
        else:
            row.update(ok=low <= n["reduction"] <= high, why="")
        out.append(row)
    return out, bool(out) and all(r["ok"] for r in out)


def curves_difference(committed: Path, new: Path) -> tuple[bool, dict[str, float]]:
    """(whether the two curve files are equal byte for byte, the largest relative difference
    of any value of a method's curves: its mean, band and smoothed points)."""
    a, b = Path(committed), Path(new)
    same = a.read_bytes() == b.read_bytes()
    old = {(r["label"], r["comm"]): r for r in read_csv(a)}
    worst: dict[str, float] = {}
    for r in read_csv(b):
        was = old.get((r["label"], r["comm"]))
        if was is None:
            worst[r["label"]] = math.inf           # a point the committed curve lacks
            continue
        for k, v in r.items():
            u = was.get(k)
            if _num(v) and _num(u) and u != v:
                d = abs(v - u) / max(abs(u), abs(v))
                worst[r["label"]] = max(worst.get(r["label"], 0.0), d)
            else:
                worst.setdefault(r["label"], 0.0)
    return same, worst


def identical_table(committed: list[dict], new: list[dict]) -> bool:
    """Whether the panel's rows of two reduction tables hold the same numbers."""
    def numbers(table):
        return {(_key(r), r["metric"]): {k: v for k, v in r.items() if _num(v)}
                for r in table if r["task"] == TASK}
    return numbers(committed) == numbers(new)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if _num(x) else "-"


def _check(r: dict) -> str:
    if not r["ok"]:
        return "OUTSIDE"
    return "inside" if _num(r["committed"]) else "same"


def report(rows: list[dict], ok: bool, curves: tuple[bool, dict] | None,
           committed: Path = COMMITTED / "reduction.csv", same_table: bool = False) -> str:
    """The comparison as text: the headline rows (each baseline's final level), the count of
    the fixed-tolerance rows, the worst difference, the curves, and the verdict."""
    lines = [f"Fig. 2, a5a panel: reductions (smoothed first hit) against the committed {committed}",
             f"{'method':<10} {'to the final level of':<22} {'committed [95% interval]':<28} "
             f"{'now':>7} {'diff':>7}  check"]
    for r in rows:
        if r["level"] != "final":
            continue
        diff = r["new"] - r["committed"] if _num(r["new"]) and _num(r["committed"]) else math.nan
        committed = (f"{_pct(r['committed'])} [{_pct(r['low'])}, {_pct(r['high'])}]"
                     if _num(r["committed"]) else "not reached")
        lines.append(f"{r['method']:<10} {r['baseline']:<22} {committed:<28} "
                     f"{_pct(r['new']):>7} {_pct(diff) if _num(diff) else '-':>7}  "
                     f"{_check(r)}{': ' + r['why'] if r['why'] else ''}")
    fixed = [r for r in rows if r["level"] != "final"]
    bad = [r for r in fixed if not r["ok"]]
    lines.append(f"fixed tolerances: {len(fixed) - len(bad)} of {len(fixed)} reductions inside "
                 "their intervals" + "".join(
                     f"\n  OUTSIDE: {r['method']} against {r['baseline']} at {r['level']}: "
                     f"{_pct(r['new'])}, committed {_pct(r['committed'])} "
                     f"[{_pct(r['low'])}, {_pct(r['high'])}] {r['why']}" for r in bad))
    diffs = [abs(r["new"] - r["committed"]) for r in rows
             if _num(r["new"]) and _num(r["committed"])]
    if same_table:
        lines.append("reduction table: the panel's rows hold the committed numbers exactly")
    elif diffs:
        lines.append(f"largest difference of a reduction: {100 * max(diffs):.3g} points")
    if curves is not None:
        same, worst = curves
        lines.append("curves: identical to the committed ones, bit for bit" if same else
                     "curves: differ from the committed ones by up to " + ", ".join(
                         f"{m} {d:.2g}" for m, d in sorted(worst.items(), key=lambda kv: -kv[1]))
                     + " (the largest relative difference of a curve's values)")
    if ok:
        bits = curves is not None and curves[0]
        lines.append("verdict: reproduced, bit-identical" if bits else
                     "verdict: reproduced: every reduction inside its committed interval; the "
                     "numbers differ " + ("in their last bits" if same_table else "a little")
                     + ", as between machines")
    else:
        lines.append("verdict: NOT reproduced: a reduction lies outside its committed interval; "
                     "check the data (SHA256SUMS), the configs (git status) and the "
                     "installed versions (make install)")
    return "\n".join(lines)


def aggregate(sweep: Path, out: Path) -> None:
    """The panel's curves and reduction table from the runs in ``sweep``, written into ``out``
    by the figure's own command (its printout held back)."""
    done = subprocess.run([sys.executable, "-m", "scripts.figures.fig2", "aggregate", "--task", "logreg",
                           "--sweep", str(Path(sweep).resolve()), "--out", str(Path(out).resolve())],
                          cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                         f"scripts.figures.fig2 aggregate exited {done.returncode}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.analysis.verify", description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", type=Path, help="the regenerated panel's runs (aggregated first)")
    ap.add_argument("--out", type=Path, default=Path("results/runs/verify/fig2"),
                    help="where the regenerated tables go (default: %(default)s)")
    ap.add_argument("--new", type=Path, help="a reduction.csv to compare, instead of --sweep")
    ap.add_argument("--committed", type=Path, default=COMMITTED,
                    help="the committed tables' folder (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.sweep is not None:
        if not args.sweep.is_dir():
            print(f"error: {args.sweep}: no such folder (make verify runs the panel first)",
                  file=sys.stderr)
            return 2
        aggregate(args.sweep, args.out)
    new = args.new or args.out / "reduction.csv"
    for path in (new, args.committed / "reduction.csv"):
        if not path.is_file():
            print(f"error: {path}: no such file", file=sys.stderr)
            return 2
    rows, ok = compare(read_csv(args.committed / "reduction.csv"), read_csv(new))
    curves = None
    mine, theirs = new.parent / "logreg_curves.csv", args.committed / "logreg_curves.csv"
    if mine.is_file() and theirs.is_file():
        curves = curves_difference(theirs, mine)
    same = identical_table(read_csv(args.committed / "reduction.csv"), read_csv(new))
    print(report(rows, ok, curves, args.committed / "reduction.csv", same))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
