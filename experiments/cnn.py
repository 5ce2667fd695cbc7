"""CIFAR-10 with the airbench94 CNN and n simulated workers: one run per invocation.

    python -m experiments.cnn method=alg1 compressor=randk compressor.density=0.01 \
        method.q=0.1 method.B=4 method.beta=0.9 method.lr=0.05 steps=2000 seed=0
    python -m experiments.cnn profile=cpu method=gluon seed=1        # the small CPU profile

Writes metrics.jsonl and summary.json into hydra's run directory (``hydra.run.dir=PATH``);
the task itself (data, model, oracles, evaluation) lives in :mod:`experiments.cnn_task`.
"""
from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from .cnn_task import build
from .runner import execute, run_hydra_job


def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    return execute(cfg, run_dir, build)


@hydra.main(config_path="../configs", config_name="cnn", version_base="1.3")
def main(cfg: DictConfig) -> float:
    summary = run_hydra_job(cfg, build) or {}
    return (summary.get("final") or {}).get("loss", float("nan"))


if __name__ == "__main__":
    main()
