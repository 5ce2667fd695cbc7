"""Record the metrics file in the summaries of run folders written before summary.json did.

    python -m experiments.run.migrate results/sweeps/fig3 [more folders ...] [--check]

Every run folder below the given folders (a folder with a summary.json) whose run finished (ok
or diverged) and whose summary has no ``metrics`` record is checked against its metrics.jsonl
(:func:`experiments.run.runs.verify_legacy`: every line is a row, and the last row is the
summary's final row, with its step and uplink). When they agree, the row count and SHA-256 of
metrics.jsonl are written into summary.json (atomically; nothing else in the folder changes), and
from then on the run is checked like a new one: any later change to metrics.jsonl makes it
"damaged". A folder that does not agree is reported as damaged and left untouched: re-run its
sweep to recompute it (or the run with ``overwrite=true``).

``--check`` reports without writing. One line per run that is not already recorded, then a
total. Exit status: 0 when every finished run agrees with its summary, 1 when one is damaged, 2
for a path that holds no run folder.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import runs
from .atomic import atomic_write_text


def migrate_run(run_dir: Path, write: bool = True) -> tuple[str, str]:
    """(what happened, why): ``migrated`` / ``agrees`` (with ``write=False``), ``recorded``
    (nothing to do), ``skipped`` (not finished, or running), or ``damaged``."""
    if runs.is_locked(run_dir):
        return "skipped", "a process is writing it"
    summary = runs.read_summary(run_dir)
    if summary is None or summary.get("status") not in runs.FINISHED:
        return "skipped", f"status {(summary or {}).get('status', 'unreadable')}"
    if isinstance(summary.get("metrics"), dict):
        why = runs.damage(run_dir, summary)
        return ("damaged", why) if why else ("recorded", "")
    why = runs.verify_legacy(run_dir, summary)
    if why:
        return "damaged", why
    digest = runs.digest(run_dir / runs.METRICS)
    if not write:
        return "agrees", f"{digest['rows']} rows"
    summary["metrics"] = digest
    atomic_write_text(run_dir / runs.SUMMARY, json.dumps(summary, indent=2))
    return "migrated", f"{digest['rows']} rows"


def run_dirs(root: Path) -> list[Path]:
    root = Path(root)
    if (root / runs.SUMMARY).is_file():
        return [root]
    return sorted(p.parent for p in root.rglob(runs.SUMMARY))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.run.migrate",
        description="Check run folders written before summary.json recorded its metrics file, "
                    "and record it (row count, SHA-256) where they agree.")
    p.add_argument("paths", nargs="+", help="run folders or folders holding them "
                                            "(e.g. results/sweeps/fig3)")
    p.add_argument("--check", action="store_true", help="report only; write nothing")
    args = p.parse_args(argv)
    counts: dict[str, int] = {}
    for root in map(Path, args.paths):
        found = run_dirs(root)
        if not found:
            print(f"error: {root}: no run folder (with {runs.SUMMARY}) under it", file=sys.stderr)
            return 2
        for d in found:
            what, why = migrate_run(d, write=not args.check)
            counts[what] = counts.get(what, 0) + 1
            if what != "recorded":
                print(f"{what}: {d}" + (f": {why}" if why else ""), flush=True)
    print(", ".join(f"{n} {w}" for w, n in sorted(counts.items())), flush=True)
    if counts.get("damaged"):
        print(f"{counts['damaged']} damaged: re-run their sweeps to recompute them (or a run "
              "with overwrite=true)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
