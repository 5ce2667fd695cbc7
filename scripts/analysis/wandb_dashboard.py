"""W&B dashboards for the figures: one saved workspace view per figure (docs/wandb.md).

Every run logs each metrics.jsonl row once (``step``, ``comm``, ``bytes``, ``loss``, ``gap``,
...), with ``comm`` (normalised uplink, the paper's x-axis) as default step metric; a line
plot's x-axis can be any logged metric, so the same values are also drawn against the wire
``bytes``. A run is grouped by experiment (W&B group = the figure's experiment name), then by
method (job type), and tagged with the figure, method, compressor and task
(experiments/run/record.py). A dashboard is therefore: the runs of one experiment (and method),
grouped by the swept keys (seeds averaged, min-max band), with the suboptimality (or loss) on a
log scale against communication and against bytes.

    python -m scripts.analysis.wandb_dashboard --print fig3          # the recipe, offline (JSON)
    python -m scripts.analysis.wandb_dashboard --entity ME --project gluon-fl fig3 fig4   # create them

Creating needs network, ``WANDB_API_KEY`` and the ``dashboards`` extra
(``pip install -e '.[dashboards]'``: W&B's workspace API, wandb-workspaces); the recipe printed
by ``--print`` is the same thing to click together by hand in the UI.
"""
from __future__ import annotations

import argparse
import json
import os

LOGREG_PANELS = [
    {"title": "f(x) - f* vs communication", "x": "comm", "y": ["gap"], "log_y": True},
    {"title": "f(x) - f* vs bytes sent", "x": "bytes", "y": ["gap"], "log_y": True},
    {"title": "f(x) vs communication", "x": "comm", "y": ["loss"], "log_y": False},
]
CNN_PANELS = [
    {"title": "training loss vs communication", "x": "comm", "y": ["loss"], "log_y": True},
    {"title": "training loss vs bytes sent", "x": "bytes", "y": ["loss"], "log_y": True},
    {"title": "test accuracy vs communication", "x": "comm", "y": ["test_acc"], "log_y": False},
]

# figure -> which runs (W&B group = experiment, job type = method) and how to group them
DASHBOARDS = {
    "fig2_logreg": {"title": "Fig. 2 (a5a): tuned methods, 10 seeds", "group": "fig2_logreg",
                    "groupby": ["method.name"], "panels": LOGREG_PANELS},
    "fig3": {"title": "Fig. 3: Alg. 1, q x RandK density", "group": "fig3",
             "groupby": ["method.q", "compressor.density"], "panels": LOGREG_PANELS},
    "fig4": {"title": "Fig. 4: Alg. 1, B x RandK density", "group": "fig4",
             "groupby": ["method.B", "compressor.density"], "panels": LOGREG_PANELS},
    "fig5": {"title": "Fig. 5: Alg. 1, learning rate x momentum", "group": "tune_fig2",
             "job_type": "alg1", "groupby": ["method.lr", "method.beta", "method.B"],
             "panels": LOGREG_PANELS},
    "fig6": {"title": "Fig. 6: Alg. 2 (EF, TopK), B x density", "group": "fig6",
             "groupby": ["method.B", "compressor.density"], "panels": LOGREG_PANELS},
    "fig7": {"title": "Fig. 7: VR-MARINA tuning", "group": "tune_fig2", "job_type": "vr_marina",
             "groupby": ["method.lr", "method.beta"], "panels": LOGREG_PANELS},
    "fig8": {"title": "Fig. 8: CNN (CIFAR-10) grid", "group": "fig8",
             "groupby": ["method.name", "method.q", "method.lr"], "panels": CNN_PANELS},
}

# the runs of a group are drawn as their mean over seeds with a min-max band
AGGREGATION = {"aggfunc": "mean", "rangefunc": "minmax"}
# runs (or groups) drawn per panel: more than any sweep has (Fig. 2: 7 methods x 10 seeds)
MAX_RUNS = 100


def recipe(figure: str) -> dict:
    """The dashboard of ``figure`` as plain data (what to filter, group and plot)."""
    if figure not in DASHBOARDS:
        raise SystemExit(f"unknown figure {figure!r}; choose from {sorted(DASHBOARDS)}")
    d = DASHBOARDS[figure]
    filters = [f"Metric('Group') == '{d['group']}'"]
    if d.get("job_type"):
        filters.append(f"Metric('JobType') == '{d['job_type']}'")
    return {"name": d["title"], "filters": filters,
            "groupby": [f"config.{k}" for k in d["groupby"]],
            "aggregation": dict(AGGREGATION), "max_runs": MAX_RUNS,
            "panels": [{**p, "smoothing": 0} for p in d["panels"]]}


def _api():
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as e:  # optional dependency, only for building dashboards
        raise SystemExit("building W&B dashboards needs the wandb-workspaces package: "
                         "pip install -e '.[dashboards]' (or use --print for the offline "
                         "recipe)") from e
    return ws, wr


def build(figure: str, entity: str, project: str):
    """``figure``'s dashboard as a wandb-workspaces ``Workspace`` (not saved; no network)."""
    ws, wr = _api()
    r = recipe(figure)
    panels = [wr.LinePlot(title=p["title"], x=p["x"], y=list(p["y"]), log_y=p["log_y"],
                          groupby_aggfunc=r["aggregation"]["aggfunc"],
                          groupby_rangefunc=r["aggregation"]["rangefunc"],
                          smoothing_factor=float(p["smoothing"]), smoothing_type="none",
                          max_runs_to_show=r["max_runs"])
              for p in r["panels"]]
    return ws.Workspace(
        entity=entity, project=project, name=r["name"],
        sections=[ws.Section(name=r["name"], panels=panels, is_open=True)],
        # comm is the default x-axis of the view (each panel names its own x-axis anyway)
        settings=ws.WorkspaceSettings(x_axis="comm", smoothing_type="none", smoothing_weight=0,
                                      max_runs=r["max_runs"]),
        # the string filter syntax of wandb_workspaces.expr: Metric('Group') is the run's
        # group, Metric('JobType') its job type; the runs table's grouping is what the
        # panels aggregate over (seeds are not a grouping key, so they are averaged)
        runset_settings=ws.RunsetSettings(
            filters=" and ".join(r["filters"]),
            groupby=[ws.Config(k.removeprefix("config.")) for k in r["groupby"]]))


def create(figure: str, entity: str, project: str) -> str:
    """Save ``figure``'s dashboard as a workspace view; returns its URL (needs network)."""
    workspace = build(figure, entity, project).save()
    try:
        return workspace.url
    except Exception:  # noqa: BLE001 (the view is saved; only its address is unknown)
        return f"{entity}/{project}: {workspace.name}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("figures", nargs="*", default=sorted(DASHBOARDS))
    ap.add_argument("--print", "--dry-run", dest="print", action="store_true",
                    help="print the recipes, create nothing (offline)")
    ap.add_argument("--entity", default=os.environ.get("WANDB_ENTITY"),
                    help="W&B entity (user or team; default $WANDB_ENTITY)")
    ap.add_argument("--project", default=os.environ.get("WANDB_PROJECT", "gluon-fl"))
    args = ap.parse_args(argv)
    if args.print or not args.entity:
        print(json.dumps({f: recipe(f) for f in args.figures}, indent=2))
        if not args.print:
            print("(no --entity: printed the recipes only)")
        return
    for f in args.figures:
        recipe(f)                           # an unknown figure stops before anything is saved
    for f in args.figures:
        print(f"{f}: {create(f, args.entity, args.project)}")


if __name__ == "__main__":
    main()
