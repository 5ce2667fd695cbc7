"""The job: what an entry point's ``@hydra.main`` function does once hydra has made the run
folder (:func:`run_hydra_job`). It takes the run's config checked already, joins the process
world and runs :func:`experiments.run.lifecycle.execute`.

* **A single run**: the config the command line resolved and validated before hydra wrote
  anything (:mod:`experiments.run.command_line`), its folder still locked. A problem of the
  environment is one or two lines on stderr and exit status 2; the run folder is removed when
  this invocation made it and nothing in it can be resumed.
* **A job of a sweep** (``-m``, any launcher): validated by the sweeper
  (``hydra_plugins.gluon_sweeper``) before any job was launched, maybe in another process, so
  resolved here, once; its process world alone is checked again (a SLURM launcher starts the
  workers after that check). A failing run is recorded (summary.json, status "failed"),
  reported, and the sweep goes on with the other runs; :func:`experiments.run.sweep.report` then
  lists the failures and makes the sweep exit non-zero.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import traceback
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .config import check_env, checked
from .lifecycle import checkpoint_name, execute
from .record import WandbError
from .world import World, close_world, open_world
from ..tasks import ResolvedConfig
from experiments.shared.errors import ConfigError, EnvironmentProblem
from experiments.shared.lock import RunLock
from experiments.shared.runs import LOCK

log = logging.getLogger("experiments.run")


def run_hydra_job(cfg: DictConfig, task, handed: ResolvedConfig | None = None,
                  held: RunLock | None = None) -> dict:
    """The body of an entry point's ``@hydra.main`` function, given hydra's ``cfg``. ``handed``:
    the config the command line checked (a single run), ``held``: the run folder's lock it took.

    A single run raises on failure. Inside a multirun a failing run is recorded and the sweep
    goes on; re-running the sweep re-runs only the failed and unfinished runs."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    if held is not None and os.path.realpath(held.path.parent) != os.path.realpath(run_dir):
        held.release(clean=held.holds_only_the_lock())    # hydra chose another folder
        held = None
    run = ResolvedConfig.of(cfg, task) if multirun else _single_run_config(cfg, task, handed)
    world = open_world(run.cfg.comm, str(run.cfg.get("device", "cpu")), run.cfg.dense_collective)
    if not world.writer:                      # rank > 0: rank 0 logs for the run
        logging.getLogger("experiments").setLevel(logging.WARNING)
    # A log line that cannot be written (the disk is full) must not print a traceback: the
    # writes that matter (rows, checkpoints) stop the run with one line.
    logging.raiseExceptions = False
    if not multirun:
        with RunLock(run_dir, enabled=world.writer) as lock:   # re-entrant: the command line's
            return _single_run(run, run_dir, task, world, lock, locked_before=held is not None)
    try:
        return execute(_launched(run), run_dir, task, world)
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


def _single_run_config(cfg: DictConfig, task, handed: ResolvedConfig | None) -> ResolvedConfig:
    """The config the command line checked, when hydra composed the same one (the same primary
    config and overrides: always, unless hydra's own flags chose another, ``--config-name``);
    else hydra's, checked here."""
    if handed is not None and _same_composition(handed.composed, cfg):
        return handed
    return checked(cfg, task)


def _same_composition(a: DictConfig, b: DictConfig) -> bool:
    """Whether two composed configs hold the same keys and values, before resolution (hydra's
    node aside). Nothing is resolved: no resolver runs."""
    def plain(c):
        return OmegaConf.to_container(OmegaConf.masked_copy(c, [k for k in c if k != "hydra"]),
                                      resolve=False)
    return plain(a) == plain(b)


def _launched(run: ResolvedConfig) -> ResolvedConfig:
    """A sweep's job, validated by the sweeper before any job was launched. What it may still
    lack is its process world (SLURM starts the workers after the sweeper's check): that alone
    is checked again."""
    problem = check_env(str(run.cfg.get("comm", "sim")), run.cfg.n_workers)
    if problem:
        raise ConfigError(problem)
    return replace(run, validated=True)


def _single_run(run: ResolvedConfig, run_dir: Path, task, world: World, lock: RunLock,
                locked_before: bool) -> dict:
    """A single run, its folder locked (``lock``; ``locked_before``: by the command line, before
    hydra wrote into it): an environment problem is one or two lines and exit status 2, and
    removes the folder if this invocation made it and nothing in it can be resumed. Whether it
    made the folder is decided under the lock, so a run refused after waiting for another never
    removes the other's files."""
    if not world.writer:
        fresh = False
    elif locked_before:
        fresh = lock.made_folder()
    else:
        fresh = _fresh(run_dir)
    try:
        return execute(run, run_dir, task, world)
    except EnvironmentProblem as e:           # a single run: one or two lines, exit status 2
        if fresh and not (run_dir / checkpoint_name(world)).exists():
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
