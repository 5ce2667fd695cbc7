"""The tables results are kept in: CSVs written atomically and read back with numbers as floats,
and Figure 2's reduction table (CSV and markdown), whose rows of other panels are kept."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from .files import atomic_write_text


TABLE_FIELDS = ["task", "method", "metric", "level", "eps", "comm", "seeds_reached", "seeds",
                "baseline", "baseline_comm", "baseline_censored", "reduction", "ci_low", "ci_high",
                "t_low", "t_high"]


def write_table(rows: list[dict], csv_path: Path, md_path: Path | None = None,
                replace_task: str | None = None) -> None:
    """Write the reduction table; rows of other tasks already in the CSV are kept (a5a and CNN
    share it), so aggregating one panel never drops the other's rows. Both files are replaced
    atomically (parallel aggregations never see half a file)."""
    csv_path = Path(csv_path)
    keep = []
    if replace_task and csv_path.exists():
        with open(csv_path) as fh:
            keep = [r for r in csv.DictReader(fh) if r.get("task") != replace_task]
    all_rows = sorted(keep + rows, key=lambda r: r["task"])   # stable: a5a, then cnn
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=TABLE_FIELDS, extrasaction="ignore", restval="")
    w.writeheader()
    for r in all_rows:
        w.writerow({k: csv_cell(r.get(k, "")) for k in TABLE_FIELDS})
    atomic_write_text(csv_path, buf.getvalue())
    if md_path is not None:
        atomic_write_text(Path(md_path), markdown_table(list(csv.DictReader(io.StringIO(buf.getvalue())))))


# Significant digits of a non-integral float in a results CSV. numpy's exp and log differ in the
# last bit between CPUs (their SIMD paths), so at full precision a redraw on another machine
# rewrote every curve file. At 8 digits a few ulps change a cell only where it straddles a
# rounding boundary (about one cell in ten million), and no table or figure shows more.
# Integral floats (byte and gradient counts) are written exactly.
CSV_DIGITS = 8


def csv_float(v: float) -> str:
    """A float as the results CSVs write it: integral values exactly (``repr``), others to
    ``CSV_DIGITS`` significant digits; 'nan' and 'inf' as Python writes them. Reading a cell
    back and writing it again gives the same cell (kept rows are rewritten by later panels)."""
    v = float(v)
    if not math.isfinite(v) or v.is_integer():
        return repr(v)
    s = f"{v:.{CSV_DIGITS}g}"
    return repr(float(s)) if float(s).is_integer() else s


def csv_cell(v):
    """A value of a table row as its CSV cell: NaN empty, other floats by :func:`csv_float`."""
    if isinstance(v, float):
        return "" if math.isnan(v) else csv_float(v)
    return v


def _fmt(x, pct=False):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x) if x not in ("", None) else "-"
    if math.isnan(v):
        return "-"
    return f"{100 * v:.0f}%" if pct else f"{v:.4g}"


def markdown_table(rows: list[dict]) -> str:
    """The reduction table in markdown: the smoothed statistic first, the raw first hit after."""
    head = ("| task | level | method | metric | uplink to reach (mean) | seeds reached | "
            "best baseline (its uplink) | reduction [95% bootstrap CI] | [95% t-interval] |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in sorted(rows, key=lambda r: (r["task"], r["metric"] != "smoothed_first_hit")):
        level = (f"baseline's final level ({_fmt(r['eps'])})" if r["level"] == "baseline_final"
                 else f"eps = {float(r['eps']):g}")
        comm = _fmt(r["comm"]) if r["comm"] not in ("", None) else "not reached"
        red = t_int = "-"
        if r["method"] != r["baseline"] and r.get("reduction") not in ("", None):
            red = (f"{_fmt(r['reduction'], pct=True)} [{_fmt(r['ci_low'], pct=True)}, "
                   f"{_fmt(r['ci_high'], pct=True)}]")
            if r.get("t_low") not in ("", None):
                t_int = f"[{_fmt(r['t_low'], pct=True)}, {_fmt(r['t_high'], pct=True)}]"
        base = f"{r['baseline']} ({_fmt(r['baseline_comm'])})" if r["baseline"] else "-"
        if r.get("baseline_censored") not in ("", None, "0", 0):
            base += f", {r['baseline_censored']} seeds censored"
        metric = "smoothed" if r["metric"] == "smoothed_first_hit" else "raw"
        lines.append(f"| {r['task']} | {level} | {r['method']} | {metric} | {comm} | "
                     f"{r['seeds_reached']}/{r['seeds']} | {base} | {red} | {t_int} |")
    return head + "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    """Write ``rows`` (the union of their keys as columns), replacing ``path`` atomically; floats
    as :func:`csv_float` writes them."""
    if not rows:
        atomic_write_text(Path(path), "")
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))   # union, in first-seen order
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    w.writerows({k: csv_float(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows)
    atomic_write_text(Path(path), buf.getvalue())


def _num(v: str):
    try:
        return float(v)
    except ValueError:
        return v


def read_csv(path: Path) -> list[dict]:
    """Rows of a CSV written by :func:`write_csv`, numbers as floats, labels as strings."""
    with open(path) as fh:
        return [{k: (v if k in ("label", "task", "method", "baseline", "panel", "xaxis", "metric", "level")
                     else _num(v)) for k, v in r.items()} for r in csv.DictReader(fh)]
