"""docs/architecture.md's "How to add a task", done by a test: a task of one's own in one module
outside the project (the task, its registry entry, its typed settings and its entry point) and
one config file in the module's own config folder (the project's config groups are on every
hydra app's search path). It runs through the command line, a
sweep, the sweep's table and Fig. 2's aggregation and figure."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd

from experiments.shared.runs import read_rows

from experiments.shared.files import REPO

# The task's module, as a user would write it in a package of their own: least squares on
# random data (f* known in closed form), registered in experiments.tasks.TASKS as itself.
TASK_MODULE = '''
"""Least squares on random data, split over the workers."""
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from experiments.run.config import RunConf
from experiments.run.command_line import entry_point
from experiments.tasks import TASKS, Built, settings, split
from gluon import simulate
from gluon.worker import Oracle


@dataclass
class LsqTask:                 # the task's keys, typed; their values are in configs/lsq.yaml
    name: str = MISSING
    rows: int = MISSING
    dim: int = MISSING
    noise: float = MISSING
    data_seed: int = MISSING


@dataclass
class LsqConfig(RunConf):
    task: LsqTask = field(default_factory=LsqTask)


ConfigStore.instance().store(name="lsq_schema", node=LsqConfig)
TASKS["lsq"] = sys.modules[__name__]          # the registry entry: this module is the task


class LsqOracle(Oracle):
    def __init__(self, A, b, batch_size):
        self.A, self.b, self.batch_size = A, b, batch_size

    def sample(self, gen, batches=1):
        return torch.randint(len(self.b), (self.batch_size * batches,), generator=gen)

    def grad(self, params, idx):
        A, b = self.A[idx], self.b[idx]
        return [A.T @ (A @ params[0] - b) / len(b)]

    def loss(self, params, idx=None):
        return 0.5 * float(((self.A @ params[0] - self.b) ** 2).mean())


def check(cfg):
    if cfg.task.rows < cfg.n_workers:
        raise ValueError(f"task.rows={cfg.task.rows}: fewer rows than the {cfg.n_workers} workers")


def check_data(cfg):
    pass                       # generated from the config: nothing on disk


def data_identity(cfg):
    return None                # the config (data_seed, rows, dim, noise) is the data's identity


def build(cfg, compressor, world=None):
    t = cfg.task
    g = torch.Generator().manual_seed(t.data_seed)
    A = torch.randn(t.rows, t.dim, generator=g)
    b = A @ torch.randn(t.dim, generator=g) + t.noise * torch.randn(t.rows, generator=g)
    shards = split(t.rows, cfg.n_workers, t.data_seed)
    used = torch.cat(shards)
    Au, bu = A[used].double(), b[used].double()
    f_star = 0.5 * float(((Au @ torch.linalg.lstsq(Au, bu[:, None]).solution[:, 0] - bu) ** 2).mean())
    comm = world.comm(cfg.n_workers, cfg.seed) if world is not None else None
    ranks = comm.local_workers if comm is not None else range(cfg.n_workers)
    oracles = {r: LsqOracle(A[shards[r]], b[shards[r]], cfg.batch_size) for r in ranks}
    method = simulate(cfg.method.name, [torch.zeros(t.dim)], oracles, compressor=compressor,
                      seed=cfg.seed, comm=comm, **settings(cfg.method))

    def evaluate(m):
        loss = 0.5 * float(((Au @ m.params[0].double() - bu) ** 2).mean())
        return {"loss": loss, "gap": loss - f_star}

    return Built(method, evaluate, {"f_star": f_star})


main = entry_point(sys.modules[__name__], "lsq", config_dir=Path(__file__).parent / "configs")

if __name__ == "__main__":
    main()
'''
# The config file, beside the module: the entry point's primary config (configs/lsq.yaml), the
# task's settings included, as configs/logreg.yaml and configs/task/logreg.yaml are for logreg.
PRIMARY_CONFIG = """defaults:
  - lsq_schema
  - hydra: default
  - workers          # n_workers: the project's (configs/workers.yaml)
  - _self_
  - compressor: identity
  - method: gluon
  - tuned: null
  - launcher: basic
  - experiment: null

steps: 300          # iterations
batch_size: 16      # examples per minibatch per worker
log_every: 20       # steps between logged rows
checkpoint_every: 0
task:
  name: lsq
  rows: 512         # examples
  dim: 20           # features
  noise: 0.1        # standard deviation of the labels' noise
  data_seed: 0      # the data and the shards
method:
  lr: 0.02          # radius of the LMO step
  beta: 0.9         # momentum decay
"""


def run(cmd, env, cwd=REPO, timeout=300):
    out = subprocess.run([sys.executable, "-m", *cmd], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_a_registered_task_runs_through_the_cli_a_sweep_the_table_and_a_figure(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "lsq.py").write_text(TASK_MODULE)
    (tmp_path / "pkg" / "configs").mkdir()
    (tmp_path / "pkg" / "configs" / "lsq.yaml").write_text(PRIMARY_CONFIG)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "pkg"), str(REPO)]),
           "WANDB_MODE": "disabled"}

    # the command line: one run, its folder named by its identity, the gap going down
    single = tmp_path / "single"
    run(["lsq", f"hydra.run.dir={single}", f"results_dir={tmp_path / 'results'}"], env)
    rows = read_rows(single)
    assert json.loads((single / "summary.json").read_text())["status"] == "ok"
    assert rows[-1]["step"] == 300 and rows[-1]["gap"] < 0.1 * rows[0]["gap"]
    bad = subprocess.run([sys.executable, "-m", "lsq", "task.rows=2", "n_workers=4"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "task.rows=2" in bad.stderr     # the task's own check

    # a sweep of two methods and two seeds, skipped when run again
    sweep = tmp_path / "sweep"
    common = [f"hydra.sweep.dir={sweep}", f"results_dir={tmp_path / 'results'}",
              "max_comm=40", "log_every=0", "log_comm=2", "steps=2000", "seed=0,1"]
    run(["lsq", "-m", "method=gluon", *common], env)
    run(["lsq", "-m", "method=alg1", "compressor=randk", "compressor.density=0.25",
         "method.q=0.2", "method.B=2", *common], env)
    again = run(["lsq", "-m", "method=gluon", *common], env)
    assert (again.stdout + again.stderr).count("[skip]") == 2
    assert {d.parent.parent.name for d in sweep.glob("*/*/summary.json")} == {"gluon", "alg1"}
    assert len(list(sweep.glob("*/*/summary.json"))) == 4

    table = run(["scripts.analysis.summarize", str(sweep)], env)
    assert "alg1" in table.stdout and "gluon" in table.stdout
    csv = pd.read_csv(sweep / "summary.csv")
    assert set(csv["method"]) == {"gluon", "alg1"} and (csv["n"] == 2).all()

    work = tmp_path / "figure"                   # Fig. 2's aggregation writes under results/fig2
    work.mkdir()
    run(["scripts.figures.fig2", "aggregate", "--task", "logreg", "--sweep", str(sweep)], env, cwd=work)
    curves = pd.read_csv(work / "results" / "fig2" / "logreg_curves.csv")
    assert set(curves["label"]) == {"gluon", "alg1"}
    run(["scripts.figures.fig2", "plot"], env, cwd=work)
    assert (work / "figures" / "fig2.png").stat().st_size > 0
