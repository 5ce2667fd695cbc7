"""CIFAR-10 with the airbench94 CNN and n workers: one run per invocation, a sweep with ``-m``.

    python -m experiments.cnn method=alg1 compressor=randk compressor.density=0.01 \
        method.q=0.1 method.B=4 method.beta=0.9 method.lr=0.05 steps=2000 seed=0
    python -m experiments.cnn profile=cpu method=gluon seed=1        # the small CPU profile
    torchrun --nproc-per-node 4 -m experiments.cnn comm=torchdist profile=cpu steps=50

Writes metrics.jsonl, summary.json and cnn.log into hydra's run folder (``hydra.run.dir=PATH``);
the task itself (data, model, oracles, evaluation) lives in :mod:`experiments.tasks.cnn`.
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from .run.lifecycle import command_line, run_hydra_job
from .tasks import cnn as task


@hydra.main(config_path="../configs", config_name="cnn", version_base="1.3")
def main(cfg: DictConfig) -> float:
    summary = run_hydra_job(cfg, task) or {}
    return (summary.get("final") or {}).get("loss", float("nan"))


if __name__ == "__main__":
    command_line(main, "cnn", task)
