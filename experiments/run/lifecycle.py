"""One run, top to bottom: the command line's checks, then start or resume, train, finish.

Every entry point (``python -m experiments.logreg``, ``python -m experiments.cnn``) is made by
:func:`entry_point`: :func:`command_line` around a ``@hydra.main`` job that calls
:func:`run_hydra_job`. In reading order:

1. **The command line** (:func:`command_line`, :func:`check_run`). Before hydra creates a run
   folder, the command's config (a sweep's first job) is composed and validated
   (:func:`experiments.run.config.validate`); in a sweep the sweeper
   (``hydra_plugins.gluon_sweeper``) then checks every job, the experiment's grid included,
   before any is launched. A bad config prints one or two lines on stderr and exits with
   status 2::

       $ python -m experiments.logreg steps=abc
       error: steps=abc: Value 'abc' of type 'str' could not be converted to Integer

   So does a broken environment, checked next (:func:`check_environment`): a run or sweep
   folder (or ``results_dir``) that cannot be written, ``launcher=slurm`` where there is no
   SLURM, the task's data (``check_data``: missing, not matching its ``SHA256SUMS``,
   unreadable, absurd values), and a folder that holds another run or a damaged record whose
   run cannot be told to be this one (:func:`other_run`), checked under the folder's lock.
2. **The job** (:func:`run_hydra_job`): joins the process world, runs :func:`execute`; inside a
   multirun a failing run is recorded and the sweep goes on.
3. **The run** (:func:`execute`): locks the folder (and validates the config when it was not
   checked already: scripts and tests), then three steps:
   :func:`_start` (refuse another run's folder, skip a finished run, build the task, resume),
   :func:`_train` (rows, checkpoints, signals) and :func:`_finish` (summary, checkpoint kept or
   removed).

A task (:mod:`experiments.tasks.logreg`, :mod:`experiments.tasks.cnn`) supplies ``check(cfg)``,
``check_data(cfg)``, ``data_identity(cfg)`` and ``build(cfg, compressor, world) -> Built``;
everything else (the run folder, metrics, summary, logging, W&B, divergence, checkpoints,
preemption and the process world) is here once.

Checkpoints (:mod:`experiments.run.record`): every ``checkpoint_every`` steps (0 = only on
signals) and when SIGTERM/SIGINT/SIGUSR1/SIGUSR2 arrives, the state is written to
``<run_dir>/checkpoint.pt`` between two steps. A run that finds a checkpoint written with the
same config resumes from it bit-identically: same parameters, same metric rows, no row missing
or repeated. Statuses in summary.json: "ok" and "diverged" are finished (a re-run skips them)
as long as metrics.jsonl is the file the summary describes, else the run is "damaged"
(:mod:`experiments.shared.runs`) and is done again (resumed from a checkpoint whose rows are
intact, else recomputed), after a line that says so; "failed" (an exception) is re-run from
scratch, its checkpoint deleted; a preempted run has no summary, only its checkpoint, and
resumes. A finished run's checkpoint is deleted, unless ``keep_checkpoint`` is set: it then
holds the final state. Temporary files left by killed checkpoint writes are removed at the end.
With ``extend_from`` (a folder of finished runs), a run that has nothing to resume starts from
the final state of its shorter twin there, the same run on a smaller budget (:func:`_extension`):
a budget only decides when a run stops, so the twin's rows are this run's first rows.

The environment (a full disk, a folder made read-only, data that went missing) stops a run with
an :class:`~experiments.shared.runs.EnvironmentProblem`, never a "failed" summary: the checkpoint
is kept, and the message says which file could not be written and what to do. A single run then
prints it in one or two lines and exits with status 2, removing its run folder if this
invocation created it and nothing in it can be resumed; in a sweep the run is logged and left
unfinished, so the sweep report lists it.

Concurrency: a run folder is written by one process at a time
(:class:`~experiments.shared.lock.RunLock`). The command line locks a single run's folder before
it checks the folder for another run and before hydra writes into it, and holds the lock until
the run ends; a second process given the same folder waits, then skips the finished run (the
same config) or is refused (another config) without touching the first run's files. Whether
this invocation made the folder (and may remove it on a refusal) is decided under the lock.

Under torchrun (or srun) with ``comm=torchdist`` every rank checks before any collective and
runs this lifecycle: each computes, rank 0 alone writes the folder, the logs and W&B (the
other ranks keep hydra from writing into the run folder and from logging); every other rank
keeps its own worker's checkpoint (``checkpoint.rank<r>.pt``). The ranks agree (a collective)
on skipping, resuming and stopping.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf

from gluon import train
from gluon.distributed import World, close_world, open_world

from experiments.shared import runs
from .config import ConfigError, build_compressor, check_env, resolved, validate
from .record import (CHECKPOINT, CHECKPOINT_FORMAT, Progress, RunLog, SignalGuard, WandbError,
                     checkpoint_leftovers, job_key, load_checkpoint, rng_state, save_checkpoint,
                     set_rng_state)
from experiments.shared.lock import RunLock
from experiments.shared.runs import LOCK, is_locked, read_summary  # noqa: F401
from experiments.shared.files import REPO, atomic_write  # noqa: F401
from experiments.shared.errors import EnvironmentProblem  # noqa: F401
from experiments.shared.runs import identity as comparable
from ..tasks import Built

log = logging.getLogger("experiments.run")
INFO_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion")
POLL = 10      # steps between the ranks' agreement on a pending signal (comm=torchdist)
# errors of a write that say the machine, not the run, is at fault
FULL = (errno.ENOSPC, errno.EDQUOT)
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


# -------------------------------- 1. the command line: every check before hydra writes

def entry_point(task, config_name: str, config_dir: str | Path | None = None,
                objective: str = "loss") -> Callable[[], None]:
    """A task's command line: ``main = entry_point(task, "cnn")`` in the entry module, and
    ``main()`` under ``__main__``. ``config_name``: the primary config (``configs/<name>.yaml``,
    or in ``config_dir``); ``objective``: the key of the summary's ``final`` row that the
    hydra job returns (what a sweeper plugin that optimises would read). Hydra names the job
    ``task.name`` (``configs/hydra/default.yaml``), whatever file this is called from."""
    import hydra
    folder = Path(config_dir) if config_dir is not None else REPO / "configs"

    @hydra.main(config_path=str(folder.resolve()), config_name=config_name, version_base="1.3")
    def job(cfg: DictConfig) -> float:
        summary = run_hydra_job(cfg, task) or {}
        return (summary.get("final") or {}).get(objective, float("nan"))

    def main(argv: list[str] | None = None) -> None:
        command_line(job, config_name, task, argv, config_dir)
    return main


def command_line(hydra_main: Callable, config_name: str, task,
                 argv: list[str] | None = None, config_dir: str | Path | None = None) -> None:
    """Check every job, then run ``hydra_main`` (the entry point's ``@hydra.main`` function).
    ``config_dir``: the folder of ``config_name`` when it is not the project's ``configs/``."""
    from hydra._internal.utils import get_args_parser

    global _held
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = get_args_parser().parse_known_args(argv)
    if not any(getattr(args, f, None) for f in INFO_FLAGS):
        try:
            _held = check_run(config_name, list(args.overrides), bool(args.multirun), task,
                              config_dir)
        except (ConfigError, EnvironmentProblem) as err:
            fail(str(err))
        except KeyboardInterrupt:             # Ctrl-C while checking, or waiting for a folder
            print("stopped: SIGINT (Ctrl-C)", file=sys.stderr, flush=True)
            raise SystemExit(128 + signal.SIGINT) from None
        if os.environ.get("RANK", "0") != "0":   # rank > 0 of a multi-process run: no writing
            sys.argv = [sys.argv[0], *argv, "hydra.output_subdir=null",
                        "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    try:
        hydra_main()
    except KeyboardInterrupt:                 # Ctrl-C outside training (which checkpoints
        print("stopped: SIGINT (Ctrl-C)", file=sys.stderr, flush=True)   # and exits 130)
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        held, _held = _held, None
        if held is not None:                  # nothing in the folder but the lock: removed
            held.release(clean=held.holds_only_the_lock())


# The run folder's lock, taken by the command line before hydra writes into the folder and held
# until the run ends (a single run; the run takes it again, re-entrant): between the check that
# the folder holds no other run and the run itself, no other process can finish a run there.
_held: RunLock | None = None


def check_run(config_name: str, overrides: list[str], multirun: bool, task,
              config_dir: str | Path | None = None) -> RunLock | None:
    """Compose and validate the command's config (a sweep's first job; the sweeper,
    ``hydra_plugins.gluon_sweeper``, checks every job before launching any). ConfigError if bad.
    A single run's folder is then locked (:func:`check_environment`): the lock is returned."""
    from .config import compose
    unquoted(overrides)
    try:
        cfg = compose(config_name, *(first_point(overrides) if multirun else overrides),
                      hydra=True, config_dir=config_dir)
    except Exception as err:  # noqa: BLE001 (hydra's composition errors, reworded)
        raise ConfigError(composition_message(err, overrides)) from None
    validate(cfg, task, check_world=not (multirun and launcher_starts_workers(cfg)))
    return check_environment(cfg, multirun, task, lock=True)


def check_environment(cfg, multirun: bool, task=None, lock: bool = False) -> RunLock | None:
    """What the machine must offer before hydra makes a folder: SLURM for a SLURM launcher,
    write access where the run (or sweep) folder and the caches go, and the task's data
    (``task.check_data(cfg)``, where the task has one; in a sweep the sweeper checks every job's
    once every job's config is known to be good). EnvironmentProblem if not.

    With ``lock``, a single run's folder is locked (rank 0 of a multi-process run) before it is
    checked for another run, and the lock is returned, held: another process given the same
    folder waits until this run ends, and then finds its summary. A refused run releases it and
    removes what taking it created."""
    on_slurm = multirun and str(cfg.hydra.launcher.get("_target_", "")).endswith("SlurmLauncher")
    if on_slurm and shutil.which("srun") is None:
        raise EnvironmentProblem(
            "launcher=slurm: no SLURM here (srun is not on PATH)\n  submit from a machine of "
            "the cluster, or use launcher=local or launcher=basic (make sbatch-preview "
            "EXP=<experiment> prints the job script)")
    device = str(cfg.get("device") or "auto")
    if device.startswith("cuda") and not on_slurm:     # SLURM jobs run where the GPUs are
        import torch
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise EnvironmentProblem(
                f"device={device}: no such CUDA device here ({torch.cuda.device_count()} visible)"
                "\n  device=auto picks a GPU when there is one; launcher=slurm_gpu runs on a "
                "cluster's GPUs")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    folder = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
    for path, name in ((folder, key), (Path(REPO, cfg.results_dir), "results_dir")):
        if path is not None:
            writable(Path(str(path)), name)
    check_data = getattr(task, "check_data", None)
    if check_data is not None and not multirun:   # a sweep's: by the sweeper, every job's
        check_data(cfg)
    if multirun or folder is None:
        return None
    held = None
    if lock and os.environ.get("RANK", "0") == "0":
        held = RunLock(Path(str(folder)), announce=_waiting).__enter__()
    try:
        if not cfg.overwrite:
            refuse_other_run(Path(str(folder)), cfg, task)
    except BaseException:
        if held is not None:
            held.release(clean=True)
        raise
    return held


def _waiting(message: str) -> None:
    """The lock's line while the command line waits (hydra's logging is not set up yet)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def refuse_other_run(run_dir: Path, cfg, task) -> None:
    """EnvironmentProblem when ``run_dir`` holds another run than ``cfg``'s (never replaced
    unless ``overwrite``), before hydra writes anything into it."""
    if not (run_dir / "summary.json").exists() and not (run_dir / "checkpoint.pt").exists():
        return
    cfg = resolved(cfg)
    data_identity = getattr(task, "data_identity", None)
    data = data_identity(cfg) if data_identity is not None else None
    problem = other_run(run_dir, OmegaConf.to_container(cfg), data)
    if problem:
        raise EnvironmentProblem(problem)


# -------------------------------- 2. the job: the body of an entry point's @hydra.main

def run_hydra_job(cfg: DictConfig, task) -> dict:
    """The body of an entry point's ``@hydra.main`` task function.

    A single run raises on failure. Inside a multirun (``-m``, any launcher) a failing run is
    recorded (summary.json, status "failed"), reported, and the sweep goes on with the other
    runs; :func:`experiments.run.sweep.report` then lists the failures and makes the sweep
    exit non-zero. Re-running the sweep re-runs only the failed and unfinished runs.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode


    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    if _held is not None and os.path.realpath(_held.path.parent) != os.path.realpath(run_dir):
        _held.release(clean=_held.holds_only_the_lock())   # hydra chose another folder
    plain_cfg = resolved(cfg)
    world = open_world(plain_cfg.comm, str(plain_cfg.get("device", "cpu")),
                       plain_cfg.dense_collective)
    if not world.writer:                      # rank > 0: rank 0 logs for the run
        logging.getLogger("experiments").setLevel(logging.WARNING)
    # A log line that cannot be written (the disk is full) must not print a traceback: the
    # writes that matter (rows, checkpoints) stop the run with one line.
    logging.raiseExceptions = False
    if not multirun:
        with RunLock(run_dir, enabled=world.writer) as held:   # re-entrant: the command line's
            return _single_run(cfg, run_dir, task, world, plain_cfg, held)
    try:
        return execute(cfg, run_dir, task, world, _checked(plain_cfg))
    except EnvironmentProblem as e:           # left unfinished: the sweep report lists it
        log.error("[stopped] %s: %s", run_dir, str(e).replace("\n ", ""))
        return {"status": "stopped", "error": str(e)}
    except WandbError as e:                   # recorded in summary.json, said in one line
        log.error("[failed] %s: %s", run_dir, str(e).replace("\n ", ""))
        return {"status": "failed", "error": str(e)}
    except Exception as e:  # noqa: BLE001 (recorded in summary.json; the sweep continues)
        log.error("[failed] %s: %s: %s", run_dir, type(e).__name__, e)
        traceback.print_exc()
        return {"status": "failed", "error": repr(e)}


def _single_run(cfg, run_dir: Path, task, world: World, plain_cfg, held: RunLock) -> dict:
    """A single run, its folder locked (``held``): an environment problem is one or two lines
    and exit status 2, and removes the folder if this invocation made it and nothing in it can
    be resumed. Whether it made the folder is decided under the lock, so a run refused after
    waiting for another never removes the other's files."""
    if not world.writer:
        fresh = False
    elif _held is not None:                   # locked by the command line before hydra wrote
        fresh = held.made_folder()
    else:
        fresh = _fresh(run_dir)
    try:
        return execute(cfg, run_dir, task, world, _checked(plain_cfg))
    except EnvironmentProblem as e:           # a single run: one or two lines, exit status 2
        if fresh and not (run_dir / _checkpoint_name(world)).exists():
            _close_file_logs()
            shutil.rmtree(run_dir, ignore_errors=True)   # made by this invocation
        else:
            _to_file_logs(f"error: {e}")
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(e.exit_code) from None
    except WandbError as e:                   # recorded as failed: exit status 1, two lines
        _to_file_logs(f"error: {e}")
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        close_world(world)


def _checked(cfg: DictConfig):
    """The compressor of a job's config, validated before hydra wrote anything: by the command
    line's check (one run) or by the sweeper (every job of a sweep). What a launcher's job may
    still lack is its process world (SLURM starts the workers after that check): that alone is
    checked again here."""
    problem = check_env(str(cfg.get("comm", "sim")), cfg.n_workers)
    if problem:
        raise ConfigError(problem)
    return build_compressor(cfg.compressor)


def _fresh(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds nothing but what hydra wrote when this job started (its
    ``.hydra`` folder, the log) and the lock: nothing of an earlier run."""
    try:
        names = [p.name for p in Path(run_dir).iterdir()]
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return all(n in (".hydra", LOCK) or n.endswith(".log") for n in names)


def _file_handlers() -> list[logging.FileHandler]:
    return [h for h in logging.getLogger("experiments").handlers
            if isinstance(h, logging.FileHandler)]


def _close_file_logs() -> None:
    """Stop logging into the run folder (about to be removed)."""
    root = logging.getLogger("experiments")
    for h in _file_handlers():
        root.removeHandler(h)
        h.close()


def _to_file_logs(message: str) -> None:
    """``message`` into the run's log file only (the console gets it on stderr)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for h in _file_handlers():
        try:
            h.handle(record)
        except OSError:
            pass


# -------------------------------- 3. the run: start (or skip, or resume), train, finish

def execute(cfg: DictConfig, run_dir: str | Path, task, world: World | None = None,
            compressor=None) -> dict:
    """The run of ``cfg`` in ``run_dir``. ``compressor``: the one built from a config already
    validated (by the command line or the sweeper); without it (scripts, tests) ``cfg`` is
    validated here, before any compute."""
    run_dir = Path(run_dir)
    if compressor is None:
        compressor = validate(cfg, task)
    cfg = resolved(cfg)                          # resolved, enums as strings
    world = world or World(dense=cfg.dense_collective)   # the simulation counts its traffic
    config = OmegaConf.to_container(cfg)
    data_identity = getattr(task, "data_identity", None)
    data = data_identity(cfg) if data_identity is not None else None
    torch.set_num_threads(cfg.threads)
    try:
        with RunLock(run_dir, enabled=world.writer):
            return _execute(cfg, config, data, run_dir, task, world, compressor)
    except Exception as err:
        cause = environmental(err)
        if cause is None:
            raise
        raise EnvironmentProblem(_stopped(cause, run_dir / _checkpoint_name(world))) from None


class Active(NamedTuple):
    """A run between its three steps: what :func:`_start` hands :func:`_train` and
    :func:`_finish`."""
    cfg: DictConfig                 # resolved
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
        method, state = self.built.method, self.built.state
        save_checkpoint(self.path, {
            "format": CHECKPOINT_FORMAT, "config": comparable(self.config), "job": job_key(),
            "method": method.state_dict(),
            "state": state.state_dict() if state is not None else None,
            "rng": rng_state(), "rows": self.record.rows,
            "rows_sha256": self.record.rows_sha256(), "wandb_id": self.record.wandb_id,
            "train_time": self.elapsed(),
            "extended_from": (self.saved or {}).get("extended_from")})


def _execute(cfg, config, data, run_dir, task, world, compressor) -> dict:
    """Start (or skip, or resume), train with checkpoints, finish."""
    run = _start(cfg, config, data, run_dir, task, world, compressor)
    if not isinstance(run, Active):           # skipped: the finished run's summary
        return run
    status = _train(run)
    return _finish(run, status)


def _start(cfg, config, data, run_dir, task, world, compressor) -> Active | dict:
    """Refuse a folder holding another run; skip a finished run (its summary); else build the
    task's method and resume it from its checkpoint when one of this config is intact."""
    where = runs.shown(run_dir)
    other = (other_run(run_dir, config, data, _checkpoint_name(world), world.writer)
             if not cfg.overwrite else None)
    if world.any(other is not None):          # never overwritten: the ranks stop together
        raise EnvironmentProblem(other or "another rank's run folder holds another run")
    record = RunLog(run_dir, config, wandb_cfg=config.get("wandb"), figure=cfg.get("group"),
                    enabled=world.writer, data_id=data)
    if world.all(record.should_skip(cfg.overwrite)):
        log.info("[skip] %s: already finished with this config", where)
        return read_summary(run_dir)

    damaged = _damaged(run_dir, config) if world.writer and not cfg.overwrite else None
    path = run_dir / _checkpoint_name(world)
    saved = _resumable(load_checkpoint(path), config, cfg.overwrite,
                       run_dir if world.writer else None)
    if not world.all(saved is not None):
        saved = None                          # resume only when every rank can
    if saved is None and cfg.get("extend_from") and world.size == 1 and not damaged:
        saved = _extension(Path(REPO, str(cfg.extend_from)), run_dir, config, data, cfg)
    if damaged:
        log.info("[damaged] %s: %s: %s", where, damaged,
                 f"resuming from its checkpoint at step {saved['method']['k']}" if saved
                 else "recomputing it")
    try:
        built = task.build(cfg, compressor, world)
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
    return Active(cfg, config, where, world, record, built, saved, path, prior_time,
                  time.perf_counter())


def _train(run: Active) -> str:
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
            if interrupted or environmental(err) is not None:   # e.g. submitit: "timed-out
                run.record.abort()        # too many times"; a full disk: the checkpoint
                raise                     # is kept and resumes the run
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


def _finish(run: Active, status: str) -> dict:
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


def other_run(run_dir: Path, config: dict, data: str | None, checkpoint: str = CHECKPOINT,
              writer: bool = True) -> str | None:
    """Why ``run_dir`` holds another run than ``config`` on ``data`` (its summary or its
    checkpoint records another identity), in two lines, or None. Such a folder is never
    overwritten: the command line asks this before hydra writes into the folder, the sweeper
    before launching, and the lifecycle again before a run starts."""
    run_dir = Path(run_dir)
    fix = "choose another folder (hydra.run.dir=PATH), or pass overwrite=true to replace that run"
    s = read_summary(run_dir) if writer else None
    if s is not None and s.get("config") is not None and not runs.same_run(s, config, data):
        why = (runs.difference(config, s["config"]) if comparable(s["config"]) != comparable(config)
               else f"the data: {str(data)[:12]} here, {str(s.get('data_id'))[:12]} there")
        return f"{runs.shown(run_dir)} holds another run ({s.get('status')}; {why})\n  {fix}"
    unreadable = None
    if writer and (s is None or s.get("config") is None) and (run_dir / runs.SUMMARY).exists():
        unreadable = runs.SUMMARY + (" records no config" if s is not None else " is unreadable")
    path = run_dir / checkpoint
    saved = load_checkpoint(path, quiet=True) if s is None and path.exists() else None
    if saved is not None and saved.get("config") != comparable(config):
        return (f"{runs.shown(run_dir)} holds the checkpoint of another run "
                f"({runs.difference(config, saved.get('config'))})\n  {fix}")
    if saved is None and s is None and path.exists():
        unreadable = unreadable or f"{checkpoint} is unreadable"
    if unreadable and saved is None:
        # A damaged record: the run it belongs to is known from config.json (written when it
        # started); a folder whose run cannot be told is never given to another config.
        started = _started_config(run_dir)
        if started is None or comparable(started) != comparable(config):
            why = (runs.difference(config, started) if started is not None
                   else "config.json cannot tell which run it was")
            return (f"{runs.shown(run_dir)} holds a damaged run ({unreadable}; {why})\n  {fix}")
    return None


def _started_config(run_dir: Path) -> dict | None:
    """The config that ``run_dir``'s run recorded when it started (config.json), or None."""
    try:
        config = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


# ---------------------------------------------------------------- what the steps share

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


def _checkpoint_name(world: World) -> str:
    return CHECKPOINT if world.rank == 0 else f"checkpoint.rank{world.rank}.pt"


BUDGETS = ("max_comm", "steps", "max_grads")   # the keys an extension may raise


def _extension(folder: Path, run_dir: Path, config: dict, data: str | None, cfg) -> dict | None:
    """Start a run from a shorter twin's final state (``extend_from``: a folder of finished runs,
    such as a sweep's): a run under ``folder`` that finished "ok" with this run's identity except
    a smaller budget (:data:`BUDGETS`) and kept its final checkpoint (``keep_checkpoint``).

    The result is the run this config would compute from step 0: the twin's steps are this run's
    first steps (a budget only decides when a run stops), so its rows are copied and training
    resumes from its final state. That holds only when the twin's last row is one this run logs
    too: the twin stopped on an uplink budget that is a multiple of ``log_comm`` (the step
    crossing it crosses a multiple of ``log_comm``), or at a multiple of ``log_every``. A twin
    that fails a condition is passed over (logged), and the run starts from step 0.

    Returns the checkpoint to resume from (its config made this run's, ``extended_from`` the
    twin's folder), or None. The copied rows are written into ``run_dir`` atomically."""
    mine = {k: v for k, v in (comparable(config) or {}).items() if k not in BUDGETS}
    for summary_path in sorted(folder.glob("**/" + runs.SUMMARY)):
        twin = summary_path.parent
        if twin.resolve() == run_dir.resolve():
            continue
        s = read_summary(twin)
        theirs = comparable((s or {}).get("config"))
        if not s or theirs is None or {k: v for k, v in theirs.items() if k not in BUDGETS} != mine \
                or (data is not None and s.get("data_id") not in (None, data)):
            continue
        why = _not_a_prefix(twin, s, config)
        saved = load_checkpoint(twin / CHECKPOINT) if why is None else None
        if why is None and (saved is None or saved.get("config") != theirs):
            why = "no final checkpoint of that run (keep_checkpoint was not set)"
        if why is None:
            why = _rows_problem(twin, saved)
        if why is not None:
            log.info("[extend] %s: not from %s: %s", runs.shown(run_dir), runs.shown(twin), why)
            continue
        with open(twin / runs.METRICS, "rb") as fh:
            rows = b"".join(line for line, _ in zip(fh, range(int(saved["rows"]))))
        atomic_write(run_dir / runs.METRICS, lambda fh: fh.write(rows))
        log.info("[extend] %s: from %s at step %d (%d rows copied)", runs.shown(run_dir),
                 runs.shown(twin), saved["method"]["k"], saved["rows"])
        return {**saved, "config": comparable(config), "job": None, "wandb_id": None,
                "extended_from": runs.shown(twin)}
    return None


def _not_a_prefix(twin: Path, s: dict, config: dict) -> str | None:
    """Why the finished run ``twin`` (summary ``s``) is not the beginning of ``config``'s run,
    or None: it must have finished "ok" on a smaller budget, with a last row this run logs too."""
    if runs.status(twin, s) != "ok":
        return f"its status is {runs.status(twin, s)}, not ok"
    theirs = s["config"]
    for key in BUDGETS:
        a, b = theirs.get(key), config.get(key)
        if a is not None and (b is None or b < a):
            return f"its {key} {a} is not below this run's {b}"
    k, last = int(s.get("steps_done", -1)), s.get("final") or {}
    log_comm, log_every, max_comm = config.get("log_comm"), config.get("log_every"), theirs.get("max_comm")
    on_comm = (max_comm is not None and log_comm and last.get("comm", -1) >= max_comm
               and abs(max_comm / log_comm - round(max_comm / log_comm)) < 1e-9)
    on_steps = bool(log_every) and k % int(log_every) == 0
    if not (on_comm or on_steps):
        return (f"its last row (step {k}) is not one this run logs (it stopped neither on an "
                "uplink budget that is a multiple of log_comm nor at a multiple of log_every)")
    return None


def _resumable(saved: dict | None, config: dict, overwrite: bool,
               run_dir: Path | None = None) -> dict | None:
    """A checkpoint is used when it was written with the same config; with ``overwrite`` only
    when it was written by this very scheduler job (a requeue), not by an earlier run; and,
    given the ``run_dir`` whose metrics.jsonl it continues (the writing process), only when
    that file still starts with the rows the checkpoint was written after."""
    if saved is None:
        return None
    if saved.get("config") != comparable(config):
        log.info("[checkpoint] config changed since the checkpoint: starting over")
        return None
    if overwrite and (saved.get("job") is None or saved.get("job") != job_key()):
        return None
    problem = _rows_problem(run_dir, saved) if run_dir is not None else None
    if problem:
        log.info("[checkpoint] %s: %s: starting over", runs.shown(run_dir), problem)
        return None
    return saved


def _rows_problem(run_dir: Path, saved: dict) -> str | None:
    """Why metrics.jsonl no longer holds the rows a checkpoint was written after, or None."""
    n = int(saved.get("rows", 0))
    try:
        have = runs.digest(run_dir / runs.METRICS, rows=n)
    except FileNotFoundError:
        return f"{runs.METRICS} is missing (the checkpoint was written after {n} rows)"
    if have["rows"] < n:
        return (f"{runs.METRICS} has {have['rows']} complete rows, the checkpoint was written "
                f"after {n}")
    want = saved.get("rows_sha256")
    if want is not None and have["sha256"] != want:
        return f"the first {n} rows of {runs.METRICS} are not those the checkpoint was written after"
    if want is None:                          # a checkpoint of an earlier version
        with open(run_dir / runs.METRICS) as fh:
            for i, (line, _) in enumerate(zip(fh, range(n)), 1):
                try:
                    json.loads(line)
                except ValueError:
                    return f"{runs.METRICS} line {i} is not a row"
    return None


def _damaged(run_dir: Path, config: dict) -> str | None:
    """Why a finished run of this config is damaged (it is not skipped), or None."""
    s = read_summary(run_dir)
    if (s is None or s.get("config") is None) and (run_dir / runs.SUMMARY).exists():
        return f"{runs.SUMMARY} is unreadable"     # other_run: config.json says it is this run
    if not s or s.get("status") not in runs.FINISHED or not runs.same_run(s, config, None):
        return None
    return runs.damage(run_dir, s)


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


# ---------------------------------------------------------------- the command line's helpers

def first_point(overrides: list[str]) -> list[str]:
    """The overrides of a sweep's first job: each swept key at its first value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    return [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
            if o.is_sweep_override() else o.input_line
            for o in OverridesParser.create().parse_overrides(overrides)]


def launcher_starts_workers(cfg) -> bool:
    """Whether the sweep's launcher starts the worker processes itself (SLURM with one task per
    worker): the job, not the submitting command, then checks its process world."""
    launcher = cfg.hydra.launcher
    return (str(launcher.get("_target_", "")).endswith("SlurmLauncher")
            and int(launcher.get("tasks_per_node", 1) or 1) > 1)


def writable(path: Path, key: str) -> None:
    """EnvironmentProblem unless ``path`` can be made and written: its nearest existing folder
    must be a writable folder. Nothing is created."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise EnvironmentProblem(f"{key}={path}: {probe} is a file, not a folder\n  choose "
                                 f"another folder with {key}=PATH")
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "a read-only file system" if _read_only_fs(probe) else "not writable"
        raise EnvironmentProblem(f"{key}={path}: cannot write there ({probe} is {why})\n  "
                                 f"make it writable, or choose another folder with {key}=PATH")


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def fail(message: str) -> None:
    """A bad config: one or two lines on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


QUOTE_HINT = ("quote a value with a space for the shell: 'key=my dir'; one with a quote or "
              "bracket in it for hydra too: \"key='my dir(1)'\"")


def unquoted(overrides: list[str]) -> None:
    """ConfigError for a word that is not ``key=value`` (nor ``~key``): a value with a space
    typed without quotes reaches hydra as two overrides (``hydra.run.dir=my dir``)."""
    for i, o in enumerate(overrides):
        if "=" in o or o.startswith("~"):
            continue
        before = overrides[i - 1] if i and "=" in overrides[i - 1] else None
        guess = f": if it belongs to the value before it, write '{before} {o}'" if before else ""
        raise ConfigError(f"'{o}' is not key=value{guess}\n  {QUOTE_HINT}")


def composition_message(err: Exception, overrides: list[str] = ()) -> str:
    """Hydra's message for a bad override, in one or two lines."""
    override = None
    text = str(err).strip()
    if "LexerNoViableAltException" in text or "mismatched input" in text:
        bad = _unparsable(overrides)
        if bad is not None:
            return f"{bad}: hydra cannot read this value (a quote or bracket in it?)\n  {QUOTE_HINT}"
    missing = _missing_option(text)
    if missing:
        return missing
    if text.startswith("Error merging override "):
        override = text[len("Error merging override "):].splitlines()[0]
    cause = err.__cause__ or err.__context__
    if override and cause is not None:
        return f"{override}: {str(cause).strip().splitlines()[0]}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if lines and "Available options" in text:          # an unknown config group option
        i = next(i for i, ln in enumerate(lines) if ln.startswith("Available options"))
        options = []
        for ln in lines[i + 1:]:
            if ln.startswith("Config search path"):
                break
            options.append(ln)
        return f"{lines[0]}\n{lines[i]} {', '.join(options)}"
    return "\n".join(lines[:2]) if lines else type(err).__name__


def _unparsable(overrides) -> str | None:
    """The first override hydra's grammar cannot parse, or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_overrides([o])
        except Exception:  # noqa: BLE001 (hydra's grammar errors)
            return o
    return None


def _missing_option(text: str) -> str | None:
    """``tuned=fig2_logreg/nope``: hydra names no options for a nested group; list them."""
    first = text.splitlines()[0] if text else ""
    if "Could not find '" not in first or "Available options" in text:
        return None
    missing = first.split("Could not find '", 1)[1].split("'", 1)[0]
    group, _, name = missing.partition("/")
    root = REPO / "configs" / group
    if not name or not root.is_dir():
        return None
    under = (root / name).parent
    under = under if under.is_dir() and under != root else root
    options = sorted(p.relative_to(root).with_suffix("").as_posix() for p in under.rglob("*.yaml")
                     if not any(part.startswith("_") for part in p.relative_to(root).parts))
    return f"{group}={name}: no such config; the options are {', '.join(options)}"
