"""a5a logistic regression with n simulated workers: one run per invocation.

    python -m experiments.logreg method=alg1 compressor=randk compressor.density=0.01 \
        method.q=0.1 method.B=4 method.beta=0.99 method.lr=0.01 steps=10000 seed=0

Writes metrics.jsonl and summary.json into hydra's run directory (``hydra.run.dir=PATH``).
"""
from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from gluon import simulate

from .common import method_hparams
from .datasets import REPO, libsvm_file
from .logreg_task import LogRegOracle, cached_f_star, load_libsvm, objective, split
from .runner import execute, run_hydra_job


def build(cfg: DictConfig, compressor):
    """The simulated method, the evaluation closure and what the summary records for a5a."""
    A, b = load_libsvm(libsvm_file(cfg.task.dataset, cfg.data_dir))
    shards = split(len(b), cfg.n_workers, cfg.task.split_seed, b, cfg.task.heterogeneity)
    used = torch.cat(shards)
    f, _ = objective(A[used], b[used], cfg.task.l2)
    fstar = cached_f_star(A[used], b[used], cfg.task.l2, Path(REPO, cfg.results_dir, "cache"),
                          {"dataset": cfg.task.dataset, "n_workers": cfg.n_workers,
                           "split_seed": cfg.task.split_seed, "heterogeneity": cfg.task.heterogeneity,
                           "l2": cfg.task.l2})
    oracles = [LogRegOracle(A[s], b[s], cfg.batch_size, cfg.task.l2) for s in shards]
    x = torch.zeros(A.shape[1])
    method = simulate(cfg.method.name, [x], oracles, compressor=compressor, seed=cfg.seed,
                      **method_hparams(cfg.method))

    def evaluate(m):
        loss = f(m.params[0].double().numpy())
        return {"loss": loss, "gap": loss - fstar["f_star"]}

    return method, evaluate, {"f_star": fstar["f_star"], "f_star_info": fstar}


def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    return execute(cfg, run_dir, build)


@hydra.main(config_path="../configs", config_name="logreg", version_base="1.3")
def main(cfg: DictConfig) -> float:
    summary = run_hydra_job(cfg, build) or {}
    return (summary.get("final") or {}).get("gap", float("nan"))


if __name__ == "__main__":
    main()
