"""a5a logistic regression with n workers: one run per invocation, a sweep with ``-m``.

    python -m experiments.logreg method=alg1 compressor=randk compressor.density=0.01 \
        method.q=0.1 method.B=4 method.beta=0.99 method.lr=0.01 steps=10000 seed=0
    python -m experiments.logreg -m experiment=fig3                # a figure's sweep
    torchrun --nproc-per-node 4 -m experiments.logreg comm=torchdist method=alg1 steps=200
                                                                   # one worker per process

Writes metrics.jsonl, summary.json and logreg.log into hydra's run folder
(results/runs/logreg/<method>/<overrides>, or ``hydra.run.dir=PATH``). The task itself lives in
:mod:`experiments.tasks.logreg`, the command line in :mod:`experiments.run.command_line`.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from .run.command_line import entry_point
from .run.lifecycle import execute
from .tasks import logreg as task

main = entry_point(task, "logreg", objective="gap")  # hydra's job returns the final gap


def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    """One simulated run of ``cfg`` (a composed config) into ``run_dir``, without hydra's
    command line: for scripts and tests."""
    return execute(cfg, run_dir, task)


if __name__ == "__main__":
    main()
