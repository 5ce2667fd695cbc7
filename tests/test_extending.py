"""docs/architecture.md's "How to add a method", done by a test: one registry entry and one
config file, outside the project's own files, and the method runs through the command line, a
sweep, the sweep's table and Fig. 2's aggregation and figure."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from experiments.shared.runs import read_rows

from experiments.shared.files import REPO

# The registry entry (gluon/methods.py's METHODS), made where a user's code would make it: a
# method that is Gluon under another name (Alg. 1 with q = B = 1 and the identity compressor).
REGISTRY_ENTRY = """
from gluon.methods import METHODS, Alg1, _spec
METHODS["toy_gluon"] = _spec(Alg1, "identity", "lmo", {"q": 1.0, "B": 1}, {"lr", "beta"}, {},
                             None, "a toy: Gluon under another name")
"""
# The config file (configs/method/<name>.yaml), in a folder hydra is told to search.
CONFIG_FILE = """# @package _global_
defaults:
  - override /compressor: identity

method:
  name: toy_gluon
"""


@pytest.fixture(scope="module")
def extended(tmp_path_factory, results_with_cache):
    root = tmp_path_factory.mktemp("extended")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(REGISTRY_ENTRY)
    (root / "configs" / "method").mkdir(parents=True)
    (root / "configs" / "method" / "toy_gluon.yaml").write_text(CONFIG_FILE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "site"), str(REPO)]),
           "WANDB_MODE": "disabled"}
    return root, env, results_with_cache


def run(cmd, env, cwd=REPO, timeout=300):
    out = subprocess.run([sys.executable, "-m", *cmd], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_a_registered_method_runs_through_the_cli_a_sweep_the_table_and_a_figure(extended):
    root, env, results = extended
    sweep = root / "sweep"
    run(["experiments.logreg", "-m", "method=gluon,toy_gluon", "seed=0,1", "steps=400",
         "max_comm=20", "log_every=0", "log_comm=1", f"results_dir={results}",
         f"hydra.searchpath=[file://{root / 'configs'}]", f"hydra.sweep.dir={sweep}"], env)
    folders = {d.parent.parent.name for d in sweep.glob("*/*/summary.json")}
    assert set(folders) == {"gluon", "toy_gluon"}
    # the toy is Gluon under another name: the same rows, step for step
    for seed in (0, 1):
        toy, = (d.parent for d in sweep.glob(f"toy_gluon/*seed={seed},*/summary.json"))
        ref, = (d.parent for d in sweep.glob(f"gluon/*seed={seed},*/summary.json"))
        strip = lambda rows: [{k: v for k, v in r.items() if k not in ("time", "compute_s")}  # noqa: E731
                              for r in rows]
        assert strip(read_rows(toy)) == strip(read_rows(ref))
        assert json.loads((toy / "summary.json").read_text())["status"] == "ok"

    table = run(["scripts.analysis.summarize", str(sweep)], env)
    assert "toy_gluon" in table.stdout
    csv = pd.read_csv(sweep / "summary.csv")
    assert set(csv["method"]) == {"gluon", "toy_gluon"} and (csv["n"] == 2).all()

    work = root / "figure"                     # Fig. 2's aggregation writes under results/fig2
    work.mkdir()
    run(["scripts.figures.fig2", "aggregate", "--task", "logreg", "--sweep", str(sweep)], env, cwd=work)
    curves = pd.read_csv(work / "results" / "fig2" / "logreg_curves.csv")
    assert set(curves["label"]) == {"gluon", "toy_gluon"}
    run(["scripts.figures.fig2", "plot"], env, cwd=work)
    assert (work / "figures" / "fig2.png").stat().st_size > 0
