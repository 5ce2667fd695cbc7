"""a5a logistic regression with n simulated workers: one run per invocation.

    python -m experiments.logreg method=alg1 compressor=randk compressor.density=0.01 \
        method.q=0.1 method.B=4 method.beta=0.99 method.lr=0.01 steps=10000 seed=0

Writes metrics.jsonl and summary.json into hydra's run directory (``hydra.run.dir=PATH``).
"""
from __future__ import annotations

import time
import traceback
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from gluon import simulate, train

from .common import method_hparams, validate
from .datasets import REPO, libsvm_file
from .logreg_task import LogRegOracle, cached_f_star, load_libsvm, objective, split
from .runlog import RunLog, read_summary


def build(cfg: DictConfig, compressor):
    """The simulated method and the evaluation closure for a5a."""
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

    return method, evaluate, fstar


def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    compressor = validate(cfg)            # bad input fails here, before any compute
    torch.set_num_threads(cfg.threads)
    config = OmegaConf.to_container(cfg, resolve=True)
    log = RunLog(run_dir, config, wandb_cfg=config["wandb"], figure=cfg.experiment)
    if log.should_skip(cfg.overwrite):
        print(f"[skip] {run_dir}: already finished with this config")
        return read_summary(run_dir)
    method, evaluate, fstar = build(cfg, compressor)
    log.start()
    t0 = time.perf_counter()
    try:
        status = train(method, cfg.steps, log_every=cfg.log_every, evaluate=evaluate,
                       on_log=log.log)
    except Exception:
        log.finish("failed", error=traceback.format_exc(), f_star=fstar["f_star"])
        raise
    last = evaluate(method) if status == "ok" else {"loss": float("nan"), "gap": float("nan")}
    summary = log.finish(status, f_star=fstar["f_star"], f_star_info=fstar, steps_done=method.k,
                         final_loss=last["loss"], final_gap=last["gap"],
                         comm=method.comm.ledger.cost, bytes=method.comm.ledger.bytes,
                         train_time=time.perf_counter() - t0, dim=method.dim)
    print(f"[{status}] {run_dir}: gap {summary['final_gap']:.3e} after {method.k} steps, "
          f"comm {summary['comm']:.1f}, {summary['train_time']:.1f} s")
    return summary


@hydra.main(config_path="../configs", config_name="logreg", version_base="1.3")
def main(cfg: DictConfig) -> float:
    summary = run(cfg, HydraConfig.get().runtime.output_dir)
    return summary.get("final_gap", float("nan"))


if __name__ == "__main__":
    main()
