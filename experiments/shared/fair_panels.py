"""What the fair-baseline panels are (docs/fair.md): the two readings (equal uplink, equal
compute), each task's panel, the dense baselines, how a run is labelled (Alg. 1 at another
RandK density gets its own label) and where each reading's runs live."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .statistics import group_runs, load_runs

SWEEPS = Path("results/sweeps/fair")


class Reading(NamedTuple):
    """One way to read a panel: the x axis of every curve and the key of its budget."""
    x: str              # the logged column: "comm" (uplink) or "grads" (gradient evaluations)
    budget_key: str     # the config key every run of the reading's sweep stops at
    axis: str           # the axis label


READINGS = {"uplink": Reading("comm", "max_comm", "uplink per worker (dense gradients)"),
            "compute": Reading("grads", "max_grads",
                               "gradient evaluations per worker (minibatches)")}


class Panel(NamedTuple):
    task: str           # the entry point's task
    name: str           # the panel's name in the tables (as Figure 2's: a5a, cnn)
    metric: str         # the tracked metric
    title: str
    runs: str           # the make target that runs its sweeps


PANELS = {"logreg": Panel("logreg", "a5a", "gap", "Logistic regression, a5a", "fair-runs"),
          "cnn": Panel("cnn", "cnn", "loss", "CNN (airbench94 at 16/64/64), CIFAR-10",
                       "fair-cnn-runs")}
DENSE = ("gluon", "large_batch_gluon", "local_gluon")    # the baselines that send no compression
BASELINES = DENSE + ("ef21_muon",)
METHODS = ("alg1", "alg2", "ef21_muon")                     # what the decomposition reads
PANEL_DENSITY = 0.01     # Figure 2's RandK/TopK density; Alg. 1 at others is labelled by it
LABELS = {"gluon": "Gluon, B = 1 (the paper's baseline)", "large_batch_gluon": "large-batch Gluon",
          "local_gluon": "Local Gluon (syncs only)", "ef21_muon": "EF21-Muon, TopK 1%",
          "alg1": "Alg. 1 (RandK 1%)", "alg2": "Alg. 2 (TopK 1%, EF)"}
ORDER = ["gluon", "large_batch_gluon", "local_gluon", "ef21_muon", "alg1", "alg2"]
SHORT = {"gluon": "Gluon (B = 1)", "large_batch_gluon": "large-batch Gluon",
         "local_gluon": "Local Gluon"}


def group_label(config: dict) -> str:
    """A group's name in the tables: the method's, and Alg. 1's RandK density when it is not
    the panel's (``alg1@0.1``)."""
    name = config["method"]["name"]
    density = (config.get("compressor") or {}).get("density")
    if name == "alg1" and density is not None and density != PANEL_DENSITY:
        return f"alg1@{density:g}"
    return name


def label_text(label: str) -> str:
    """A group's name for a reader: ``alg1@0.1`` is "Alg. 1 (RandK 10%)"."""
    base, _, density = label.partition("@")
    if density:
        return f"{LABELS.get(base, base).split(' (')[0]} (RandK {100 * float(density):g}%)"
    return LABELS.get(base, base)


def order(label: str) -> tuple:
    base, _, density = label.partition("@")
    return (ORDER.index(base) if base in ORDER else 99, float(density or 0))


def sweep_of(task: str, reading: str) -> Path:
    return SWEEPS / task / reading


# Runs a reading takes from another study's sweep instead of running them again: the CNN's
# uplink reading reads Gluon, Alg. 1 and Alg. 2 from the CNN-gap study's panel, whose settings,
# budget and seeds it shares (configs/experiment/fair_cnn/uplink.yaml starts from that study's).
SHARED = {("cnn", "uplink"): (Path("results/sweeps/cnn_gap/panel"), ("gluon", "alg1", "alg2"))}


def _labelled(root: Path) -> dict[str, list]:
    groups: dict[str, list] = {}
    for group in group_runs(load_runs(root)).values():
        label = group_label(group[0].config)
        if label in groups:
            raise SystemExit(f"two different {label} settings under {root}: remove the stale "
                             "runs and rerun")
        groups[label] = sorted(group, key=lambda r: r.config["seed"])
    return groups


def panel_runs(task: str, reading: str, root: Path | None = None,
               shared: tuple[Path, tuple[str, ...]] | None = None) -> dict[str, list]:
    """{label: runs sorted by seed} of one reading's sweep, with the groups it takes from
    another sweep (``shared``: that folder and the labels taken; by default SHARED's, when
    ``root`` is the reading's own folder); {} when it has no finished runs. Two settings under
    one label are refused (a stale run: remove it and rerun)."""
    if root is None:
        root, shared = sweep_of(task, reading), shared or SHARED.get((task, reading))
    groups = _labelled(root)
    if shared:
        other, labels = shared
        for label, runs in _labelled(other).items():
            if label not in labels:
                continue
            if label in groups:
                raise SystemExit(f"{label} has runs under both {root} and {other}, which it "
                                 f"takes from there: remove those under {root}")
            groups[label] = runs
    return dict(sorted(groups.items(), key=lambda kv: order(kv[0])))


def budget_of(groups: dict, reading: Reading, root) -> float:
    budgets = {r.config.get(reading.budget_key) for g in groups.values() for r in g}
    if len(budgets) != 1 or None in budgets:
        raise SystemExit(f"the runs under {root} have budgets ({reading.budget_key}) "
                         f"{sorted(budgets, key=str)}: a reading needs one")
    return float(budgets.pop())


# Methods a reading reads off another reading's runs, which cover its budget, instead of running
# them again: the CNN's compute reading takes Alg. 1, Alg. 2, EF21-Muon and Local Gluon from its
# uplink reading (their runs spend more than its gradient budget; a run is the same up to any
# point whatever stops it), and runs only the baselines whose uplink runs stop short of it.
READ_OFF = {("cnn", "compute"): ("uplink", ("local_gluon", "ef21_muon", "alg1", "alg2"))}


def reading_runs(task: str, reading: str) -> tuple[dict[str, list], float]:
    """({label: runs}, budget) of one reading: its own sweep's runs, whose budget key sets the
    budget, and the groups READ_OFF takes from another reading, every run of which must reach
    the budget on the reading's axis (else SystemExit naming it). ({}, nan) without own runs."""
    spec = READINGS[reading]
    groups = panel_runs(task, reading)
    if not groups:
        return {}, float("nan")
    budget = budget_of(groups, spec, sweep_of(task, reading))
    source, labels = READ_OFF.get((task, reading), (None, ()))
    if source:
        for label, runs in panel_runs(task, source).items():
            if label not in labels:
                continue
            if label in groups:
                raise SystemExit(f"{label} has runs in both the {reading} and the {source} "
                                 f"readings of {task}, which reads it off the {source} runs: "
                                 f"remove those under {sweep_of(task, reading)}")
            short = [r for r in runs if r.rows[-1][spec.x] < budget]
            if short:
                raise SystemExit(f"{len(short)} {label} run(s) of the {source} reading stop "
                                 f"before {budget:g} ({spec.x}), the {reading} reading's budget: "
                                 f"{short[0].path}")
            groups[label] = runs
    return dict(sorted(complete(groups, f"[fair] {task} {reading}").items(),
                       key=lambda kv: order(kv[0]))), budget


def complete(groups: dict[str, list], where: str) -> dict[str, list]:
    """The groups that have every seed of the reading (the union over its groups): a baseline
    whose panel is still running is left out, and said so, until its last seed lands (the
    reduction pairs methods by seed)."""
    seeds = set().union(*({r.config["seed"] for r in g} for g in groups.values()))
    for label, runs in groups.items():
        if len(runs) < len(seeds):
            print(f"{where}: {label} has {len(runs)} of {len(seeds)} seeds; "
                  "left out until its panel finishes")
    return {label: runs for label, runs in groups.items() if len(runs) == len(seeds)}


def dense_waiting(groups: dict, where: str) -> list[str] | None:
    """The dense baselines whose panels ``groups`` lacks, said at ``where``: each reduction stands
    against its own baseline, and which one is best waits for them all. None (said) when no
    dense baseline's panel is complete: there is nothing to read a reduction against."""
    waiting = [b for b in DENSE if b not in groups]
    if len(waiting) == len(DENSE):
        print(f"{where}: no dense baseline's panel is complete yet; no reduction is read")
        return None
    if waiting:
        print(f"{where}: the best dense baseline is undecided until {', '.join(waiting)} has its "
              "panel; read against the others")
    return waiting
