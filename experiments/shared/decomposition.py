"""What compression adds, read off a panel's reduction rows (docs/fair.md): each of Alg. 1, 2
and EF21-Muon against each dense baseline (Gluon at B = 1, large-batch Gluon, Local Gluon) at
that baseline's final level, with its interval and the verdict of the rule fixed before the runs;
the table and the sentence that say it; and the pages that quote them. The fair-baseline panels
(scripts/figures/fair.py) and the LM study (scripts/figures/lm.py) both write theirs with it."""
from __future__ import annotations

import csv
import io
import math
import re
from pathlib import Path

from .fair_panels import DENSE, METHODS, READINGS, SHORT, label_text
from .files import atomic_write_text
from .tables import csv_cell, read_csv


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


LEVERS = DENSE[1:]      # the dense baselines that take Alg. 1's lever: read against Gluon alone
ROWS = LEVERS + METHODS


def method_order(label: str) -> tuple:
    """The decomposition's rows: the levers alone (large-batch Gluon, Local Gluon), then METHODS'
    order, Alg. 1's other densities after Alg. 1."""
    base, _, density = label.partition("@")
    return ROWS.index(base), float(density or 0)


DECOMPOSITION_FIELDS = ["task", "reading", "method", "baseline", "best_dense", "level", "method_x",
                        "baseline_x", "reduction", "low", "high", "interval", "seeds",
                        "seeds_reached", "baseline_censored", "verdict", "baseline_B", "method_B",
                        "raw_reduction", "raw_low", "raw_high", "raw_seeds_reached"]


def decomposition(rows: list[dict], task: str, reading: str,
                  batch: dict[str, int] | None = None) -> list[dict]:
    """From a reading's reduction rows: each method of METHODS (and Alg. 1 at the other RandK
    densities run, ``alg1@<density>``) against each dense baseline at that baseline's final
    level (smoothed first hit), with the interval Figure 2's README uses (the percentile
    bootstrap from 10 seeds on, the paired t-interval below) and its verdict. Large-batch Gluon
    and Local Gluon get a row each against Gluon at B = 1: what the lever alone buys, judged by
    the same rule. ``best_dense`` marks the dense baseline with the lowest final level once
    every dense baseline is read (before that it is undecided, and no row is marked);
    ``baseline_B`` (``method_B``) is large-batch Gluon's B in this reading as the baseline (as
    the lever's row; ``batch``: {label: B}), tuned for it (B = 1 is Gluon itself)."""
    finals = [r for r in rows if r["level"] == "baseline_final"
              and r["metric"] == "smoothed_first_hit"]
    by = {(r["baseline"], r["method"]): r for r in finals}
    raw = {(r["baseline"], r["method"]): r for r in rows if r["level"] == "baseline_final"
           and r["metric"] == "raw_first_hit"}
    levels = {b: by[(b, b)]["eps"] for b in DENSE if (b, b) in by}
    best = min(levels, key=levels.get) if len(levels) == len(DENSE) else ""
    out = []
    for m in sorted({r["method"] for r in finals if r["method"].partition("@")[0] in ROWS},
                    key=method_order):
        for b in DENSE:
            r = by.get((b, m))
            if r is None or (m in LEVERS and b != "gluon"):
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
                        "method_B": (batch or {}).get(m) if m == "large_batch_gluon" else "",
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
    if not rows:
        return "No compressed method's panel is complete yet: no reduction is claimed.\n"
    lines = ["| panel | reading | method | " + " | ".join(
        f"against {SHORT[b]}" for b in DENSE) + " |", "|---|---|---|" + "---|" * len(DENSE)]
    get = {(r["task"], r["reading"], r["method"], r["baseline"]): r for r in rows}
    keys = sorted({(r["task"], r["reading"], r["method"]) for r in rows},
                  key=lambda k: (k[0] != "a5a", k[0], list(READINGS).index(k[1]), method_order(k[2])))
    undecided = {k[:2] for k in keys} - {(r["task"], r["reading"]) for r in rows
                                         if r["best_dense"] in (True, "True")}
    lever_B = {(r["task"], r["reading"]): r["method_B"] for r in rows
               if str(r.get("method_B", "")) not in ("", "None")}
    for task, reading, m in keys:
        cells = []
        for b in DENSE:
            r = get.get((task, reading, m, b))
            if r is None:
                cells.append("panel running" if (task, reading) in undecided
                             and m not in LEVERS else "-")
                continue
            marks = ["best dense"] if r["best_dense"] in (True, "True") else []
            if str(r.get("baseline_B", "")) not in ("", "None"):
                marks.append(f"B = {int(float(r['baseline_B'])):,}")
            best = f" ({', '.join(marks)})" if marks else ""
            cells.append((f"{_pct(r)} {r['verdict']}{best}" if _num(r["reduction"])
                          else f"{r['verdict']}{best}") + _raw(r))
        name = label_text(m) + (f" (B = {int(float(lever_B[task, reading])):,})"
                                if m == "large_batch_gluon" and (task, reading) in lever_B else "")
        lines.append(f"| {task} | {reading} | {name} | " + " | ".join(cells) + " |")
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
        return f"never reaches the baseline's final level (0 of {seeds} seeds)"
    return f"reaches the baseline's final level in only {reached} of {seeds} seeds"


def answer(rows: list[dict]) -> str:
    """What the table says, per panel: a line per reading of short sentences, Alg. 1 against
    each dense baseline, what the lever alone buys (large-batch Gluon against Gluon at B = 1),
    then EF21-Muon against Gluon at B = 1 (the README quotes it). A reading whose dense
    baselines are not all read says which panel it waits for: its best dense is undecided."""
    get = {(r["task"], r["reading"], r["method"], r["baseline"]): r for r in rows}
    out = []
    for task in sorted({r["task"] for r in rows}, key=lambda t: (t != "a5a", t)):
        lines = []
        for reading, what in (("uplink", "uplink"), ("compute", "gradient evaluations")):
            here = [r for r in rows if r["task"] == task and r["reading"] == reading]
            if not here or get.get((task, reading, "alg1", "gluon")) is None:
                continue
            best = next((r["baseline"] for r in here if r["best_dense"] in (True, "True")), None)
            B = next((r.get("baseline_B") for r in here if r["baseline"] == "large_batch_gluon"
                      and str(r.get("baseline_B", "")) not in ("", "None")), None)
            tuned = f" (tuned for this reading: B = {int(float(B)):,})" if B else ""
            said = {"large_batch_gluon": "Against large-batch Gluon" + tuned
                                         + (", the best dense baseline," if best ==
                                            "large_batch_gluon" else ","),
                    "local_gluon": "Against Local Gluon, which sends only the syncs,"
                                   + (" the best dense baseline," if best == "local_gluon"
                                      else ""),
                    "gluon": "Against Gluon at B = 1 (the paper's baseline"
                             + (", and here the best dense baseline)," if best == "gluon" else "),")}
            cells = [(b, get[(task, reading, "alg1", b)]) for b in DENSE
                     if (task, reading, "alg1", b) in get]
            words = [f"{said[b]} {'Alg. 1' if i == 0 else 'it'} {_against(c, what)}."
                     for i, (b, c) in enumerate(cells)]
            lever = get.get((task, reading, "large_batch_gluon", "gluon"))
            if lever is not None and _num(lever["reduction"]):
                words.append(f"The lever alone: against Gluon at B = 1, large-batch Gluon "
                             f"{_against(lever, what)}.")
            ef21 = get.get((task, reading, "ef21_muon", "gluon"))
            if ef21 is not None and _num(ef21["reduction"]):
                words.append(f"Against Gluon at B = 1, EF21-Muon (TopK 1% with error feedback, "
                             f"B = 1), re-tuned, {_against(ef21, what)}.")
            if best is None:
                waiting = [SHORT[b] for b in DENSE if (task, reading, "alg1", b) not in get]
                words.append(f"{' and '.join(waiting) or 'A dense baseline'}'s panel is still "
                             "running, so the best dense baseline is undecided.")
            lines.append(f"- Equal {reading}. " + " ".join(words))
        out.append(f"**{task}**:\n\n" + "\n".join(lines) if lines else f"**{task}**: pending.")
    return "\n\n".join(out)


def _amount(r: dict, unit: str = "") -> str:
    """A reduction as an amount: "61% [58, 65] less", "5% [2, 9] more" (``unit`` after the
    word), or the seeds that reach the level when not all do."""
    if not _num(r["reduction"]):
        return f"(reached in {int(float(r['seeds_reached']))} of {int(float(r['seeds']))} seeds)"
    red, low, high = (100 * float(r[k]) for k in ("reduction", "low", "high"))
    said = f"{red:.0f}% [{low:.0f}, {high:.0f}] less" if red >= 0 else \
        f"{-red:.0f}% [{-high:.0f}, {-low:.0f}] more"
    return f"{said} {unit}" if unit else said


def headline(rows: list[dict]) -> str:
    """The README's first results sentences: at equal uplink, on each panel that has them, Alg. 1
    and the lever alone (large-batch Gluon) against Gluon at B = 1, side by side, then Alg. 1
    against large-batch Gluon, and what the compressed messages add by the rule."""
    get = {(r["task"], r["method"], r["baseline"]): r for r in rows if r["reading"] == "uplink"}
    need = (("alg1", "gluon"), ("large_batch_gluon", "gluon"), ("alg1", "large_batch_gluon"))
    tasks = [t for t in sorted({r["task"] for r in rows}, key=lambda t: (t != "a5a", t))
             if all((t, *k) in get for k in need)]
    if not tasks:
        return "The fair-baseline panels are still running: no headline is claimed yet.\n"
    on = {t: "on " + {"a5a": "a5a", "cnn": "the CNN"}.get(t, t) for t in tasks}

    def both(m: str) -> str:
        return " and ".join(f"{_amount(get[(t, m, 'gluon')], 'uplink' if i == 0 else '')} {on[t]}"
                            for i, t in enumerate(tasks))
    versus = {t: get[(t, "alg1", "large_batch_gluon")] for t in tasks}
    Bs = {t: str(r.get("baseline_B", "")) for t, r in versus.items()}
    batch = ", ".join(f"{int(float(B)):,} {on[t]}" for t, B in Bs.items() if B not in ("", "None"))
    never = [t for t, r in versus.items() if int(float(r["seeds_reached"])) == 0]
    words = ["never reaches the large batch's final level (" + ", ".join(
        f"0 of {int(float(versus[t]['seeds']))} seeds {on[t]}" for t in never) + ")"] \
        if never else []
    words += [f"{_against(versus[t], 'uplink')} {on[t]}" for t in tasks if t not in never]
    lose = all(not _num(r["reduction"]) or r["verdict"] == "costs" for r in versus.values())
    return (f"At equal uplink, Alg. 1 reaches the final level of the paper's baseline (Gluon at "
            f"B = 1) with {both('alg1')}. Gluon given the same large batch and no compression"
            + (f" (B = {batch})" if batch else "")
            + f" gets there with {both('large_batch_gluon')}, and Alg. 1 " + "; it ".join(words)
            + "." + (" The large batch, not the compressed messages, makes the gain."
                     if lose else "")
            + " Intervals: 95% over seeds (" + ", ".join(
                f"{int(float(versus[t]['seeds']))} {on[t]}" for t in tasks) + ").\n")


def write_decomposition(rows: list[dict], task_name: str, out: Path) -> None:
    """Replace one panel's rows of ``out``/decomposition.csv (the other panels' are kept) and
    rewrite decomposition.md from the whole CSV."""
    path = out / "decomposition.csv"
    keep = []
    if path.exists():           # the other panels' rows as their cells were written, unparsed
        with open(path) as fh:
            keep = [r for r in csv.DictReader(fh) if r["task"] != task_name]
    all_rows = sorted(keep + rows, key=lambda r: (r["task"] != "a5a", r["task"]))   # a5a first
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=DECOMPOSITION_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in all_rows:
        w.writerow({k: csv_cell(r.get(k, "")) for k in DECOMPOSITION_FIELDS})   # a column added later: empty
    atomic_write_text(path, buf.getvalue())
    atomic_write_text(out / "decomposition.md", markdown(read_csv(path)))


# ---------------------------------------------------------------- pages that quote the tables

def block(name: str) -> re.Pattern:
    """The ``<!-- name:begin -->`` ... ``<!-- name:end -->`` block of a page."""
    return re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)


def quote_in_pages(pages, texts: dict[str, str]) -> None:
    """Write into each page the blocks it has (``texts``: {block name: what it holds}), so the
    pages quote the tables as the code wrote them (tests check they do). A page with none of
    the blocks is an error."""
    for page in map(Path, pages):
        text = page.read_text()
        if not any(block(name).search(text) for name in texts):
            raise SystemExit(f"{page} has no " + " or ".join(
                f"<!-- {name}:begin -->" for name in texts) + " block")
        new = text
        for name, body in texts.items():
            new = block(name).sub(lambda m: m.group(1) + body + m.group(2), new)
        if new != text:
            atomic_write_text(page, new)
