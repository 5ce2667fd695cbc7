"""One run of any experiment: validate, skip if finished, build, resume, train, record.

An experiment supplies ``build(cfg, compressor) -> (method, evaluate, extra_summary)``;
everything else (the run directory, metrics, summary, W&B, divergence, checkpoints and
preemption) is handled here once. ``build`` may return a fourth item, an object with
``state_dict()``/``load_state_dict()`` holding task state the method does not own (e.g. a
model's BatchNorm buffers); it is checkpointed with the method.

Checkpoints (see :mod:`experiments.checkpoint`): every ``checkpoint_every`` steps (config key,
optional, 0 = only on signals) and when SIGTERM/SIGUSR1/SIGUSR2 arrives, the state is written
to ``<run_dir>/checkpoint.pt`` between two steps. A run that finds a checkpoint written with the
same config resumes from it bit-identically: same parameters, same metric rows, no row missing
or repeated. Statuses in summary.json: "ok" and "diverged" are finished (a re-run skips them);
"failed" (an exception) is re-run from scratch, its checkpoint deleted; a preempted run has no
summary, only its checkpoint, and resumes. A finished run's checkpoint is deleted, unless
``keep_checkpoint`` is set: it then holds the final state.
"""
from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from gluon import train

from . import checkpoint as ckpt
from .common import validate
from .runlog import RunLog, comparable, read_summary


def execute(cfg: DictConfig, run_dir: str | Path, build: Callable) -> dict:
    run_dir = Path(run_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    log = RunLog(run_dir, config, wandb_cfg=config.get("wandb"), figure=cfg.get("experiment"))
    try:
        compressor = validate(cfg)        # bad input fails here, before any compute
    except Exception:
        run_dir.mkdir(parents=True, exist_ok=True)
        log.finish("failed", error=traceback.format_exc())
        raise
    torch.set_num_threads(cfg.threads)
    if log.should_skip(cfg.overwrite):
        print(f"[skip] {run_dir}: already finished with this config")
        return read_summary(run_dir)

    path = run_dir / ckpt.CHECKPOINT
    every = int(cfg.get("checkpoint_every", 0) or 0)
    saved = _resumable(ckpt.load(path), config, cfg.overwrite)
    built = build(cfg, compressor)
    method, evaluate, extra = built[:3]
    state = built[3] if len(built) > 3 else None
    prior_time = 0.0
    if saved is not None:
        method.load_state_dict(saved["method"])
        if state is not None and saved.get("state") is not None:
            state.load_state_dict(saved["state"])
        ckpt.set_rng_state(saved["rng"])
        prior_time = saved.get("train_time", 0.0)
        log.start(resume_rows=saved["rows"], wandb_id=saved.get("wandb_id"))
        print(f"[resume] {run_dir}: from step {method.k} ({saved['rows']} rows)")
    else:
        path.unlink(missing_ok=True)
        log.start()
    t0 = time.perf_counter()

    def save():
        ckpt.save(path, {
            "format": ckpt.FORMAT, "config": comparable(config), "job": ckpt.job_key(),
            "method": method.state_dict(),
            "state": state.state_dict() if state is not None else None,
            "rng": ckpt.rng_state(), "rows": log.rows, "wandb_id": log.wandb_id,
            "train_time": prior_time + time.perf_counter() - t0})

    interrupted = False
    with ckpt.SignalGuard() as guard:
        def on_step(m):
            nonlocal interrupted
            periodic = every and m.k % every == 0 and m.k < cfg.steps
            if periodic or guard.pending is not None:
                save()
            if guard.pending is not None:
                interrupted = True
                guard.forward()           # exits (or requeues through submitit) as asked
                interrupted = False       # the previous handler let the run go on

        try:
            status = train(method, cfg.steps, log_every=cfg.log_every, evaluate=evaluate,
                           on_log=log.log, on_step=on_step, max_comm=cfg.get("max_comm"),
                           log_comm=cfg.get("log_comm"))
        except Exception:
            if interrupted:               # e.g. submitit: "timed-out too many times"
                log.abort()
                raise
            log.finish("failed", error=traceback.format_exc(), **extra)
            path.unlink(missing_ok=True)  # a failure is re-run from scratch
            raise
        except BaseException:             # SystemExit from a signal, KeyboardInterrupt
            log.abort()                   # no summary: the checkpoint resumes the run
            raise
    last = log.last_row or {}
    summary = log.finish(status, **extra, steps_done=method.k,
                         final={k: v for k, v in last.items()},
                         comm=method.comm.ledger.cost, bytes=method.comm.ledger.bytes,
                         train_time=prior_time + time.perf_counter() - t0, dim=method.dim,
                         resumed=saved is not None)
    if cfg.get("keep_checkpoint", False):
        save()                            # the final state (a finished run never resumes)
    else:
        path.unlink(missing_ok=True)
    shown = ", ".join(f"{k} {v:.4g}" for k, v in last.items() if k not in ("step", "bytes")
                      and isinstance(v, float))
    print(f"[{status}] {run_dir}: {method.k} steps, {shown}, {summary['train_time']:.1f} s")
    return summary


def _resumable(saved: dict | None, config: dict, overwrite: bool) -> dict | None:
    """A checkpoint is used when it was written with the same config; with ``overwrite`` only
    when it was written by this very scheduler job (a requeue), not by an earlier run."""
    if saved is None:
        return None
    if saved.get("config") != comparable(config):
        print("[checkpoint] config changed since the checkpoint: starting over")
        return None
    if overwrite and (saved.get("job") is None or saved.get("job") != ckpt.job_key()):
        return None
    return saved


def run_hydra_job(cfg: DictConfig, build: Callable) -> dict:
    """The body of an experiment's ``@hydra.main`` task function.

    A single run raises on failure. Inside a multirun (``-m``, any launcher) a failing run is
    recorded (summary.json, status "failed"), reported, and the sweep goes on with the other
    runs; :class:`experiments.sweep.SweepReport` then lists the failures and makes the sweep
    exit non-zero. Re-running the sweep re-runs only the failed and unfinished runs.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    if hc.mode != RunMode.MULTIRUN:
        return execute(cfg, run_dir, build)
    try:
        return execute(cfg, run_dir, build)
    except Exception as e:  # noqa: BLE001 (recorded in summary.json; the sweep continues)
        print(f"[failed] {run_dir}: {type(e).__name__}: {e}")
        traceback.print_exc()
        return {"status": "failed", "error": repr(e)}
