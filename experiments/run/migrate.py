"""Bring run folders written by earlier versions up to date: their metrics record, their
identity and their folder name.

    python -m experiments.run.migrate results/sweeps/fig3 [more folders ...] [--check]

Every run folder below the given folders (a folder with a summary.json) whose run finished (ok
or diverged) is brought to what a run writes today:

* **Metrics record.** A summary without a ``metrics`` record is checked against its
  metrics.jsonl (:func:`experiments.shared.runs.verify_legacy`: every line is a row, and the last
  row is the summary's final row, with its step and uplink). When they agree, the row count and
  SHA-256 of metrics.jsonl are recorded, and from then on any change to metrics.jsonl makes the
  run "damaged". A folder that does not agree is reported as damaged and left untouched: re-run
  its sweep to recompute it (or the run with ``overwrite=true``).
* **Tasks renamed since.** A run of a task under an earlier name (:data:`RENAMED_TASKS`:
  ``a5a`` is now ``logreg``, ``cifar10`` is now ``cnn``) gets the task's name of today, and
  ``summary["renamed_task"]`` records the old one; the run is the same run, so its identity is
  computed again from the new name.
* **Keys added since.** A key the schema has gained since the run was made is added to its
  config at its default, and named in ``summary["added_keys"]``: a key is added with the
  default that does what the code did before it existed (docs/architecture.md), so the run
  is the run of that config.
* **Identity.** A summary without ``id`` gets its identity hash and its data's identity
  (``data_id``). Runs written before recorded no data identity: the data on disk now is taken as
  theirs, so migrate where the runs were made, or with the same data files (their SHA-256 is
  checked against SHA256SUMS where there is one).
* **Folder name.** A run folder the project named (it sits in a folder named after its method,
  as every run and sweep folder does) is renamed to :func:`experiments.shared.runs.folder_name`, so
  that the sweep that made it finds it again. A folder already holding the same run is left
  alone and reported as a duplicate (the same config, run twice under two spellings).

Summaries are rewritten atomically and folders renamed in one step; nothing else changes.

A checkpoint (an unfinished run's, or a kept one) is not migrated: one written before the
library's state held a count that runs from step 0 (:func:`checkpoint_gap`) is refused when a run
would read it, and the run starts over.
``--check`` reports without writing. One line per run that changes, then a total. Exit status:
0 when every finished run agrees with its summary, 1 when one is damaged (a summary.json that
cannot be read, or a finished one without its config, counts as damaged), 2 for a path that
holds no run folder.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.shared import runs
from experiments.shared.files import atomic_write_text


# A task's earlier name -> its name today (configs/task/<name>.yaml, experiments.tasks.TASKS).
RENAMED_TASKS = {"a5a": "logreg", "cifar10": "cnn"}


def renamed_task(config: dict) -> str | None:
    """Give ``config``'s task (in place) its name of today; return the old name, or None."""
    task = config.get("task") or {}
    old = task.get("name")
    if old not in RENAMED_TASKS:
        return None
    task["name"] = RENAMED_TASKS[old]
    return old


def data_identity(config: dict) -> str | None:
    """The identity of the data on disk now for a run of ``config`` (its task's
    ``data_identity``)."""
    from omegaconf import OmegaConf

    from ..tasks import task_module
    return task_module(config["task"]["name"]).data_identity(OmegaConf.create(config))


def added_keys(config: dict) -> list[str]:
    """Add to ``config`` (in place) the keys its task's schema has and it lacks, at their
    defaults (the schema's; a task's own in ``configs/task/<name>.yaml``); return their dotted
    names."""
    from omegaconf import OmegaConf

    from .config import SCHEMAS
    schema = SCHEMAS.get((config.get("task") or {}).get("name"))
    if schema is None:
        return []
    from experiments.shared.files import REPO
    defaults = OmegaConf.to_container(OmegaConf.structured(schema), enum_to_str=True,
                                      throw_on_missing=False)
    task = REPO / "configs" / "task" / f"{config['task']['name']}.yaml"   # the task's defaults
    defaults["task"] = OmegaConf.to_container(OmegaConf.load(task))
    added = []

    def fill(have: dict, want: dict, prefix: str) -> None:
        for k, v in want.items():
            if k not in have:
                if v is not None and v != "???":     # null: not set; MISSING: set by every config
                    have[k] = v
                    added.append(prefix + k)
            elif isinstance(v, dict) and isinstance(have[k], dict):
                fill(have[k], v, f"{prefix}{k}.")
    fill(config, defaults, "")
    return added


def migrate_run(run_dir: Path, write: bool = True) -> tuple[str, str]:
    """(what happened, why): ``migrated`` / ``agrees`` (with ``write=False``), ``recorded``
    (nothing to do), ``duplicate``, ``skipped`` (not finished, or running), or ``damaged``."""
    if runs.is_locked(run_dir):
        return "skipped", "a process is writing it"
    summary = runs.read_summary(run_dir)
    if summary is None:                   # its run cannot be told: never passed over in silence
        return "damaged", f"{runs.SUMMARY} is unreadable"
    if summary.get("status") not in runs.FINISHED:
        return "skipped", f"status {summary.get('status', 'unknown')}"
    if not isinstance(summary.get("config"), dict):
        return "damaged", f"{runs.SUMMARY} records no config"
    done = []
    if isinstance(summary.get("metrics"), dict):
        why = runs.damage(run_dir, summary)
        if why:
            return "damaged", why
    else:
        why = runs.verify_legacy(run_dir, summary)
        if why:
            return "damaged", why
        summary["metrics"] = runs.digest(run_dir / runs.METRICS)
        done.append(f"{summary['metrics']['rows']} rows recorded")
    config = summary.get("config") or {}
    old_name = renamed_task(config)
    if old_name:
        summary["renamed_task"] = old_name
        summary["id"] = None                          # the identity is computed again below
        done.append(f"task {old_name} is now {config['task']['name']}")
    added = added_keys(config)
    if added:
        summary["added_keys"] = sorted({*summary.get("added_keys", []), *added})
        summary["id"] = None                          # the identity is computed again below
        done.append(f"added {', '.join(added)}")
    if summary.get("id") is None:
        summary["data_id"] = summary.get("data_id") or data_identity(config)
        summary["id"] = runs.run_id(config, summary["data_id"])
        done.append(f"id {summary['id']}")
    target = run_dir
    if run_dir.parent.name == (config.get("method") or {}).get("name"):
        target = run_dir.parent / runs.folder_name(config, summary["data_id"])
    if target != run_dir and target.exists():
        return "duplicate", f"the same run is {target}"
    if target != run_dir:
        done.append(f"renamed {target.name}")
    if not done:
        return "recorded", ""
    if not write:
        return "agrees", "; ".join(done)
    atomic_write_text(run_dir / runs.SUMMARY, json.dumps(summary, indent=2))
    if target != run_dir:
        run_dir.rename(target)
    return "migrated", "; ".join(done)


# ---------------------------------------------------------------- checkpoints

def checkpoint_gap(payload: dict) -> str | None:
    """What a checkpoint written by an earlier version lacks of the state the library loads
    today, in words, or None when it lacks nothing. Each was added as a count from step 0: the
    workers' gradient evaluations (``grads``), the ledger's traffic columns (``up_bytes``, ...)
    and the compute time (``compute_s``). Neither the checkpoint nor the rows written before it
    hold their values at its step, so it cannot be brought up to date; resuming it with the
    counts restarted at 0 would log wrong columns from then on (and stop a ``max_grads`` budget
    late). :func:`experiments.run.checkpoint.load_checkpoint` refuses it (the run starts over)."""
    from gluon.comm import TRAFFIC
    method = payload.get("method") or {}
    lacks = []
    if any("grads" not in w for w in method.get("workers") or []):
        lacks.append("the workers' gradient count (grads)")
    ledger = (method.get("comm") or {}).get("ledger") or {}
    columns = [k for k in TRAFFIC if k not in ledger]
    if columns:
        lacks.append(f"the ledger's traffic columns ({', '.join(columns)})")
    if "compute_s" not in method:
        lacks.append("the compute time (compute_s)")
    return "; ".join(lacks) or None


def run_dirs(root: Path) -> list[Path]:
    root = Path(root)
    if (root / runs.SUMMARY).is_file():
        return [root]
    return sorted(p.parent for p in root.rglob(runs.SUMMARY))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.run.migrate",
        description="Bring run folders of earlier versions up to date: record their metrics "
                    "file (row count, SHA-256) where they agree with their summary, their "
                    "identity, and name their folders by it.")
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
