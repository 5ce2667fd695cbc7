"""One run, top to bottom: :func:`execute` locks the run folder, then three steps.

1. :func:`_start`: refuse a folder that holds another run, skip a finished run (its summary),
   build the task's method, and resume it from its checkpoint, or from a shorter twin's final
   state (:mod:`experiments.run.resume`).
2. :func:`_train`: train to the budget, logging rows, checkpointing every ``checkpoint_every``
   steps (0 = only on signals) and when SIGTERM/SIGINT/SIGUSR1/SIGUSR2 arrives
   (:mod:`experiments.run.checkpoint`).
3. :func:`_finish`: summary.json, the checkpoint kept (``keep_checkpoint``: the final state) or
   removed, and what killed checkpoint writes left behind.

The command line (:mod:`experiments.run.command_line`) and the sweeper hand :func:`execute` the
run's config checked already (a :class:`~experiments.tasks.ResolvedConfig`); scripts and tests
hand it a composed config, resolved and validated here before any compute. A task
(:mod:`experiments.tasks`) supplies ``build(cfg, compressor, world) -> Built``; everything else
(the run folder, metrics, summary, logging, W&B, divergence, checkpoints, preemption) is here.

Statuses in summary.json: "ok" and "diverged" are finished (a re-run skips them unless damaged);
"failed" (an exception) is re-run from scratch, its checkpoint deleted; a preempted run has no
summary, only its checkpoint, and resumes.

The environment (a full disk, a folder made read-only, data that went missing) stops a run with
an :class:`~experiments.shared.errors.EnvironmentProblem`, never a "failed" summary: the
checkpoint is kept, and the message says which file could not be written and what to do.
A run whose folder was removed while it ran (a stopped sweep cleaned up) stops at its next write,
a checkpoint or its summary, writing nothing (:class:`~experiments.run.record.RunRemoved`).

Concurrency: a run folder is written by one process at a time
(:class:`~experiments.shared.lock.RunLock`; the command line took it already for a single run,
and it is re-entrant). Under torchrun (or srun) with ``comm=torchdist`` every rank runs this:
each computes, rank 0 alone writes the folder, the logs and W&B; every other rank keeps its own
worker's checkpoint (``checkpoint.rank<r>.pt``). The ranks agree (a collective) on skipping,
resuming and stopping.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig
from threadpoolctl import threadpool_limits

from gluon import train
from .world import World

from .config import build_compressor, checked
from .record import Progress, RunLog, WandbError
from .checkpoint import (CHECKPOINT_FORMAT, SignalGuard, checkpoint_leftovers, job_key,
                         load_checkpoint, rng_state, save_checkpoint, set_rng_state)
from .resume import damaged, extension, other_run, resumable
from ..tasks import Built, ResolvedConfig
from experiments.shared import runs
from experiments.shared.errors import EnvironmentProblem
from experiments.shared.files import REPO
from experiments.shared.lock import RunLock

log = logging.getLogger("experiments.run")
POLL = 10      # steps between the ranks' agreement on a pending signal (comm=torchdist)
# errors of a write that say the machine, not the run, is at fault
FULL = (errno.ENOSPC, errno.EDQUOT)
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def execute(cfg: DictConfig | ResolvedConfig, run_dir: str | Path, task,
            world: World | None = None) -> dict:
    """The run of ``cfg`` in ``run_dir``. ``cfg``: checked already (by the command line or the
    sweeper: :func:`experiments.run.config.checked`), or a composed config (scripts, tests),
    then resolved and validated here, before any compute."""
    run_dir = Path(run_dir)
    run = checked(cfg, task)
    world = world or World(dense=run.cfg.dense_collective)   # the simulation counts its traffic
    torch.set_num_threads(run.cfg.threads)
    try:          # numpy's BLAS (f*) too: its default, a thread per core, spins on the cores
        with threadpool_limits(run.cfg.threads, user_api="blas"), \
                RunLock(run_dir, enabled=world.writer):    # that other runs of a sweep hold
            started = _start(run, run_dir, world)
            if not isinstance(started, StartedRun):      # skipped: the finished run's summary
                return started
            return _finish(started, _train(started))
    except Exception as err:
        cause = environmental(err)
        if cause is None:
            raise
        raise EnvironmentProblem(_stopped(cause, run_dir / checkpoint_name(world))) from None


class StartedRun(NamedTuple):
    """A run between its three steps: what :func:`_start` hands :func:`_train` and
    :func:`_finish`."""
    cfg: DictConfig                 # resolved (ResolvedConfig.cfg)
    config: dict                    # the same, a plain dict (what is recorded)
    where: str                      # the run folder as the logs show it
    world: World
    record: RunLog
    built: Built                    # the task's method, evaluation and summary
    saved: dict | None              # the checkpoint resumed from, or None
    path: Path                      # this rank's checkpoint
    prior_time: float               # training seconds before this invocation (a resume)
    t0: float                       # perf_counter when this invocation started training

    def elapsed(self) -> float:
        return self.prior_time + time.perf_counter() - self.t0

    def save(self) -> None:
        """A checkpoint of the run now (written atomically; the last good one is kept)."""
        self.record.check_intact()           # a folder removed meanwhile is not made again
        method, state = self.built.method, self.built.state
        save_checkpoint(self.path, {
            "format": CHECKPOINT_FORMAT, "config": runs.identity(self.config), "job": job_key(),
            "method": method.state_dict(),
            "state": state.state_dict() if state is not None else None,
            "rng": rng_state(), "rows": self.record.rows,
            "rows_sha256": self.record.rows_sha256(), "wandb_id": self.record.wandb_id,
            "train_time": self.elapsed(),
            "extended_from": (self.saved or {}).get("extended_from")})


def _start(run: ResolvedConfig, run_dir: Path, world: World) -> StartedRun | dict:
    """Refuse a folder holding another run; skip a finished run (its summary); else build the
    task's method and resume it from its checkpoint when one of this config is intact."""
    cfg, config, data = run.cfg, run.config, run.data
    where = runs.shown(run_dir)
    other = (other_run(run_dir, config, data, checkpoint_name(world), world.writer)
             if not cfg.overwrite else None)
    if world.any(other is not None):          # never overwritten: the ranks stop together
        raise EnvironmentProblem(other or "another rank's run folder holds another run")
    record = RunLog(run_dir, config, wandb_cfg=config.get("wandb"), figure=cfg.get("group"),
                    enabled=world.writer, data_id=data)
    if world.all(record.should_skip(cfg.overwrite)):
        log.info("[skip] %s: already finished with this config", where)
        return runs.read_summary(run_dir)

    broken = damaged(run_dir, config) if world.writer and not cfg.overwrite else None
    path = run_dir / checkpoint_name(world)
    saved = resumable(load_checkpoint(path), config, cfg.overwrite,
                      run_dir if world.writer else None)
    if not world.all(saved is not None):
        saved = None                          # resume only when every rank can
    if saved is None and cfg.get("extend_from") and world.size == 1 and not broken:
        saved = extension(Path(REPO, str(cfg.extend_from)), run_dir, config, data)
    if broken:
        log.info("[damaged] %s: %s: %s", where, broken,
                 f"resuming from its checkpoint at step {saved['method']['k']}" if saved
                 else "recomputing it")
    try:
        built = run.task.build(cfg, build_compressor(cfg.compressor), world)
    except EnvironmentProblem:                # e.g. the data went missing: nothing to record
        raise
    except Exception:                         # a bug: recorded
        record.start()
        record.finish("failed", error=traceback.format_exc())
        raise
    prior_time = 0.0
    try:
        if saved is not None:
            built.method.load_state_dict(saved["method"])
            if built.state is not None and saved.get("state") is not None:
                built.state.load_state_dict(saved["state"])
            set_rng_state(saved["rng"])
            prior_time = saved.get("train_time", 0.0)
            record.start(resume_rows=saved["rows"], wandb_id=saved.get("wandb_id"))
            log.info("[resume] %s: from step %d (%d rows)", where, built.method.k, saved["rows"])
        else:
            path.unlink(missing_ok=True)
            record.start()
    except WandbError as err:                 # recorded; a checkpoint is kept (it resumes)
        record.finish("failed", error=str(err))
        raise
    log.info("[start] %s: %s", where, _summary_line(config))
    return StartedRun(cfg, config, where, world, record, built, saved, path, prior_time,
                      time.perf_counter())


def _train(run: StartedRun) -> str:
    """Train to the budget, logging rows and checkpointing every ``checkpoint_every`` steps and
    on a signal; returns the status ("ok" or "diverged"). A signal checkpoints and stops (the
    same command resumes); a failure is recorded and re-raised."""
    cfg, method, world = run.cfg, run.built.method, run.world
    every = int(cfg.get("checkpoint_every", 0) or 0)
    progress = Progress(cfg, method)
    interrupted = False
    with SignalGuard() as guard:
        def on_step(m):
            nonlocal interrupted
            progress.tick(run.record.last_row)
            stop = guard.pending is not None
            if world.size > 1:                # the ranks agree (a collective) every POLL steps,
                stop = m.k % POLL == 0 and world.any(stop)   # so all checkpoint at one step
            periodic = every and m.k % every == 0 and m.k < cfg.steps
            if periodic or stop:
                run.save()
            if stop:
                interrupted = True
                log.info("[signal] %s at step %d: checkpoint written, stopping (the same command "
                         "resumes)", _signal_name(guard.pending) if guard.pending is not None
                         else "another rank's signal", m.k)
                if guard.pending is None:     # another rank was signalled: stop with it
                    raise SystemExit(143)
                guard.forward()               # exits (or requeues through submitit) as asked
                interrupted = False           # the previous handler let the run go on

        try:
            return train(method, cfg.steps, log_every=cfg.log_every, evaluate=run.built.evaluate,
                         on_log=run.record.log, on_step=on_step, max_comm=cfg.get("max_comm"),
                         log_comm=cfg.get("log_comm"), max_grads=cfg.get("max_grads"),
                         log_grads=cfg.get("log_grads"))
        except Exception as err:
            if (interrupted or environmental(err) is not None   # e.g. submitit: "timed-out
                    or isinstance(err, EnvironmentProblem)):    # too many times"; a full
                run.record.abort()        # disk: the checkpoint is kept and resumes the run;
                raise                     # the run folder removed: nothing is written
            run.record.finish("failed", error=traceback.format_exc(), **run.built.summary)
            run.path.unlink(missing_ok=True)  # a failure is re-run from scratch
            raise
        except BaseException as err:          # SystemExit from a signal, KeyboardInterrupt
            run.record.abort()                # no summary: the checkpoint resumes the run
            if not interrupted:
                log.info("[stopped] %s at step %d: %s", _stop_reason(err), method.k,
                         "its last checkpoint is kept (the same command resumes)"
                         if run.path.exists() else "no checkpoint written yet")
            raise


def _finish(run: StartedRun, status: str) -> dict:
    """Write summary.json (what the run computed and communicated), then keep or delete the
    checkpoint and remove what killed checkpoint writes left behind."""
    method, world = run.built.method, run.world
    last = run.record.last_row or {}
    wire = {}
    if world.size > 1:                        # a collective: what the ranks put on the wire
        rep = method.comm.report()
        wire = {"wire": {"backend": method.comm.backend, "processes": world.size,
                         "measured_bytes_per_worker": rep["measured_bytes_per_worker"],
                         "collectives": method.comm.collectives,
                         "coin_bytes": method.comm.coin_bytes}}
    summary = run.record.finish(status, **run.built.summary, **wire, steps_done=method.k,
                                final={k: v for k, v in last.items()},
                                comm=method.comm.ledger.cost, bytes=method.comm.ledger.bytes,
                                train_time=run.elapsed(), dim=method.dim,
                                resumed=run.saved is not None,
                                extended_from=(run.saved or {}).get("extended_from"))
    if run.cfg.get("keep_checkpoint", False):
        run.save()                            # the final state (a finished run never resumes)
    else:
        run.path.unlink(missing_ok=True)
    for tmp in checkpoint_leftovers(run.path):      # left by a process killed while writing
        tmp.unlink(missing_ok=True)
    world.barrier()
    shown = ", ".join(f"{k} {v:.4g}" for k, v in last.items() if k not in ("step", "bytes")
                      and isinstance(v, float))
    log.info("[%s] %s: %d steps, %s, %.1f s", status, run.where, method.k, shown,
             summary["train_time"])
    return summary


# ---------------------------------------------------------------- what the steps share

def checkpoint_name(world: World) -> str:
    """This rank's checkpoint in the run folder: rank 0's is the run's."""
    return runs.CHECKPOINT if world.rank == 0 else f"checkpoint.rank{world.rank}.pt"


def environmental(err: BaseException | None) -> OSError | None:
    """The write refused by the machine (full disk, read-only folder) behind ``err``, if that
    is what ``err`` is or was raised while handling, else None (a bug of the run)."""
    for _ in range(8):
        if err is None:
            return None
        if isinstance(err, OSError) and err.errno in FULL + READ_ONLY:
            return err
        err = err.__cause__ or err.__context__
    return None


def _stopped(err: OSError, checkpoint: Path) -> str:
    """What stopped the run and what is kept, in two lines."""
    what = runs.shown(Path(err.filename)) if err.filename else "a file"
    if err.errno in FULL:
        first, fix = f"no space left on the device writing {what}", "free space"
    else:
        first = f"cannot write {what} ({os.strerror(err.errno)})"
        fix = "make the folder writable (or choose another: hydra.run.dir=PATH, results_dir=PATH)"
    saved = load_checkpoint(checkpoint) if checkpoint.exists() else None
    if saved is not None:
        kept = (f"the last good checkpoint, {runs.shown(checkpoint)} "
                f"(step {saved['method']['k']}), is kept: {fix}, then run the same command to "
                "resume from it")
    else:
        kept = f"no checkpoint was written yet: {fix}, then run the same command to start over"
    return f"{first}\n  {kept}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _stop_reason(err: BaseException) -> str:
    if isinstance(err, KeyboardInterrupt):
        return "SIGINT (KeyboardInterrupt)"
    if isinstance(err, SystemExit) and isinstance(err.code, int) and err.code > 128:
        return _signal_name(err.code - 128)
    return type(err).__name__


def _summary_line(config: dict) -> str:
    m, c, t = config.get("method", {}), config.get("compressor", {}), config.get("task", {})
    hp = " ".join(f"{k}={v}" for k, v in m.items() if k != "name" and v is not None)
    comp = " ".join(f"{k}={v}" for k, v in c.items() if k != "name" and v is not None)
    budget = (f"{config['steps']} steps" if config.get("max_comm") is None
              else f"{config['max_comm']:g} units of uplink (at most {config['steps']} steps)")
    if config.get("max_grads") is not None:
        budget += f", at most {config['max_grads']:g} gradient evaluations per worker"
    task = f"{t.get('name')} ({t['dataset']})" if t.get("dataset") else t.get("name")
    return (f"{m.get('name')} ({hp}) {c.get('name')} ({comp}) on {task}, "
            f"{config.get('n_workers')} workers ({config.get('comm', 'sim')}), seed "
            f"{config.get('seed')}, {budget}")
