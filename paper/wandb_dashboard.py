"""W&B dashboards for the figures: one saved workspace view per figure (docs/wandb.md).

Every run logs its rows with ``comm`` (normalised uplink, the paper's x-axis) as step metric and
a ``by_bytes/`` copy with the wire ``bytes`` as step metric; it is grouped by experiment (W&B
group = the figure's experiment name), then by method (job type), and tagged with the figure,
method, compressor and task (experiments/run/record.py). A dashboard is therefore: the runs of one
experiment (and method), grouped by the swept keys (seeds averaged, min-max band), with the
suboptimality (or loss) on a log scale against communication and against bytes.

    python -m paper.wandb_dashboard --print fig3          # the recipe, offline (JSON)
    python -m paper.wandb_dashboard --entity ME --project gluon-fl fig3 fig4   # create them

Creating needs network, ``WANDB_API_KEY`` and ``pip install wandb-workspaces`` (W&B's
workspace API, in public preview); the recipe printed by ``--print`` is the same thing to click
together by hand in the UI.
"""
from __future__ import annotations

import argparse
import json

LOGREG_PANELS = [
    {"title": "f(x) - f* vs communication", "x": "comm", "y": ["gap"], "log_y": True},
    {"title": "f(x) - f* vs bytes sent", "x": "bytes", "y": ["by_bytes/gap"], "log_y": True},
    {"title": "f(x) vs communication", "x": "comm", "y": ["loss"], "log_y": False},
]
CNN_PANELS = [
    {"title": "training loss vs communication", "x": "comm", "y": ["loss"], "log_y": True},
    {"title": "training loss vs bytes sent", "x": "bytes", "y": ["by_bytes/loss"], "log_y": True},
    {"title": "test accuracy vs communication", "x": "comm", "y": ["test_acc"], "log_y": False},
]

# figure -> which runs (W&B group = experiment, job type = method) and how to group them
DASHBOARDS = {
    "fig2_logreg": {"title": "Fig. 2 (a5a): tuned methods, 3 seeds", "group": "fig2_logreg",
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
            "aggregation": "mean over seeds, min-max band",
            "panels": [{**p, "smoothing": 0} for p in d["panels"]]}


def create(figure: str, entity: str, project: str) -> str:
    """Save ``figure``'s dashboard as a workspace view; returns its URL (needs network)."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as e:  # optional dependency, only for this command
        raise SystemExit("creating dashboards needs `pip install wandb-workspaces` "
                         "(use --print for the offline recipe)") from e
    r = recipe(figure)
    d = DASHBOARDS[figure]
    # the string filter syntax of wandb_workspaces.expr: Metric('Group') is the run's group
    filters = " and ".join(f"Metric('{k}') == '{v}'" for k, v in
                           (("Group", d["group"]), ("JobType", d.get("job_type"))) if v)
    panels = [wr.LinePlot(title=p["title"], x=p["x"], y=p["y"], log_y=p["log_y"],
                          smoothing_factor=0.0) for p in r["panels"]]
    workspace = ws.Workspace(
        entity=entity, project=project, name=r["name"],
        sections=[ws.Section(name=r["name"], panels=panels, is_open=True)],
        runset_settings=ws.RunsetSettings(
            filters=filters, groupby=[ws.Config(k) for k in d["groupby"]]))
    workspace.save()
    return getattr(workspace, "url", "") or f"{entity}/{project}: {r['name']}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("figures", nargs="*", default=sorted(DASHBOARDS))
    ap.add_argument("--print", action="store_true", help="print the recipes (offline)")
    ap.add_argument("--entity")
    ap.add_argument("--project", default="gluon-fl")
    args = ap.parse_args(argv)
    if args.print or not args.entity:
        print(json.dumps({f: recipe(f) for f in args.figures}, indent=2))
        if not args.print:
            print("(no --entity: printed the recipes only)")
        return
    for f in args.figures:
        print(f"{f}: {create(f, args.entity, args.project)}")


if __name__ == "__main__":
    main()
