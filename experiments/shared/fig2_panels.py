"""What Figure 2's panels are: each panel's sweep, metric, levels and baselines, the methods'
legend names and order, the uplink budget its runs share, and the paper's claimed reductions.
Shared by the figure scripts that read the panels (Figure 2, its costs, the reproduction check)."""
from __future__ import annotations

# Per task: the experiment whose sweep it reads (entry point, experiment config), the panel's
# name in the results tables (a5a, cnn: the dataset of the a5a panel, the CNN's task), tracked metric,
# the fixed tolerances and the baselines (docs/statistics.md). The uplink budget is the one the
# runs recorded (max_comm, set once in configs/experiment/), see :func:`budget_of`.
TASKS = {
    "logreg": {"experiment": ("logreg", "fig2_logreg"), "metric": "gap", "table_task": "a5a",
               "eps": [3e-2, 1e-2, 5e-3, 3e-3],
               "baselines": ["gluon", "vr_marina", "ef21_muon"],
               "ylabel": r"$f(x) - f^*$", "title": "Logistic regression, a5a"},
    "cnn": {"experiment": ("cnn", "cnn_gap/panel"), "metric": "loss", "table_task": "cnn",
            "eps": [2.0, 1.6, 1.4, 1.2],
            "baselines": ["gluon", "ef21_muon"],
            "ylabel": "training loss (512 fixed training images)",
            "title": "CNN: airbench94{widths}, {data}"},
}
LABELS = {"gluon": "Gluon, q = 1 (baseline)", "vr_marina": "VR-MARINA (baseline)",
          "ef21_muon": "EF21-Muon, TopK (baseline)",
          "alg1": "Alg. 1 (RandK)", "alg2": "Alg. 2 (TopK, EF)", "alg3": "Alg. 3 (RandK, MVR)",
          "alg4": "Alg. 4 (TopK, EF + MVR)"}
ORDER = ["gluon", "vr_marina", "ef21_muon", "alg1", "alg2", "alg3", "alg4"]
PAPER_1B = {"alg1", "alg2"}   # the methods the paper applies the 1/B trick to (Sec. 6.1)


def order(m: str) -> int:
    return ORDER.index(m) if m in ORDER else 99


def label(method: str, settings: dict | None = None) -> str:
    """Legend text; a use of the 1/B trick beyond the paper's Alg. 1-2 is marked an extension."""
    text = LABELS.get(method, method)
    cfg = (settings or {}).get("method", {})
    if cfg.get("scale_by_B") and method not in PAPER_1B:
        text += " [1/B trick: extension]"
    if (settings or {}).get("max_grads"):
        text += f", stopped at {settings['max_grads']:,.0f} gradients per worker (Alg. 1's)"
    return text


def budget_of(runs, root) -> float:
    """The uplink budget (dense gradients per worker) every run of a panel recorded
    (``max_comm``, from the experiment config); SystemExit when they lack one or differ."""
    budgets = {r.config.get("max_comm") for r in runs}
    if len(budgets) != 1 or None in budgets:
        raise SystemExit(f"the runs under {root} have uplink budgets (max_comm) {sorted(budgets, key=str)}: "
                         "a panel needs one; remove the stale runs (make clean) and rerun")
    return float(budgets.pop())


PAPER_CLAIM = {"logreg": 0.60, "cnn": 0.65}   # "about 60%" (Sec. 6.2), "about 65%" (Sec. 6.3)
