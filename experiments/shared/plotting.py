"""How the figures draw a panel's curves (no import of matplotlib here: the figure passes its
axes): the smoothed statistic as a line, its 95% bootstrap band, the unsmoothed curve thin
beside it (docs/statistics.md), and the axes they sit on."""
from __future__ import annotations


def band_curve(ax, rows: list[dict], x: str, style: str, *, lw: float, color=None, label=None,
               band_alpha: float = 0.2, raw_alpha: float = 0.35):
    """One method's curve from its rows of a ``*_curves.csv`` (columns ``x``, ``smoothed``,
    ``ci_low``, ``ci_high``, ``raw``); returns the smoothed line."""
    xs = [r[x] for r in rows]
    (line,) = ax.plot(xs, [r["smoothed"] for r in rows], style, lw=lw, color=color, label=label)
    ax.fill_between(xs, [r["ci_low"] for r in rows], [r["ci_high"] for r in rows],
                    color=line.get_color(), alpha=band_alpha, lw=0)
    ax.plot(xs, [r["raw"] for r in rows], "-", lw=0.5, alpha=raw_alpha, color=line.get_color())
    return line


def log_axes(ax, seeds: int, window, *, fontsize: float, tail: str = "; thin: unsmoothed",
             below: bool = False) -> None:
    """A log-scale metric axis with its grid, and the legend titled by the statistic (``below``:
    under the axes, in two columns, where the curves fill the panel)."""
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    place = dict(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2) if below else {}
    ax.legend(fontsize=fontsize, title_fontsize=7, **place,
              title=f"geometric mean of {seeds} seeds, trailing {window}-unit window; band: "
                    f"95% bootstrap CI{tail}")


def no_runs(ax, hint: str) -> None:
    """An empty panel that says what to run to fill it."""
    ax.text(0.5, 0.5, f"no results yet:\n{hint}", ha="center", va="center", transform=ax.transAxes)
