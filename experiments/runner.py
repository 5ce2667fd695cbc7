"""One run of any experiment: validate, skip if finished, build, train, record.

An experiment supplies ``build(cfg, compressor) -> (method, evaluate, extra_summary)``;
everything else (the run directory, metrics, summary, W&B, divergence) is handled here once.
"""
from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from gluon import train

from .common import validate
from .runlog import RunLog, read_summary


def execute(cfg: DictConfig, run_dir: str | Path, build: Callable) -> dict:
    compressor = validate(cfg)            # bad input fails here, before any compute
    torch.set_num_threads(cfg.threads)
    config = OmegaConf.to_container(cfg, resolve=True)
    log = RunLog(run_dir, config, wandb_cfg=config.get("wandb"), figure=cfg.get("experiment"))
    if log.should_skip(cfg.overwrite):
        print(f"[skip] {run_dir}: already finished with this config")
        return read_summary(run_dir)
    method, evaluate, extra = build(cfg, compressor)
    log.start()
    t0 = time.perf_counter()
    try:
        status = train(method, cfg.steps, log_every=cfg.log_every, evaluate=evaluate,
                       on_log=log.log)
    except Exception:
        log.finish("failed", error=traceback.format_exc(), **extra)
        raise
    last = log.last_row or {}
    summary = log.finish(status, **extra, steps_done=method.k,
                         final={k: v for k, v in last.items()},
                         comm=method.comm.ledger.cost, bytes=method.comm.ledger.bytes,
                         train_time=time.perf_counter() - t0, dim=method.dim)
    shown = ", ".join(f"{k} {v:.4g}" for k, v in last.items() if k not in ("step", "bytes")
                      and isinstance(v, float))
    print(f"[{status}] {run_dir}: {method.k} steps, {shown}, {summary['train_time']:.1f} s")
    return summary
