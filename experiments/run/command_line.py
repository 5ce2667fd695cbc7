"""The command line: every entry point's ``main`` (:func:`entry_point`), which checks the command
before hydra writes anything, then hands hydra the job (:mod:`experiments.run.job`).

``python -m experiments.logreg ...`` and ``python -m experiments.cnn ...`` are each one line,
``main = entry_point(task, "<name>")``. In reading order:

1. **The check** (:func:`check_run`), before hydra creates a folder: the command's config is
   composed (a sweep's first job), and a single run's is resolved once and validated once
   (:func:`experiments.run.config.checked`); a sweep's jobs are validated by the sweeper
   (``hydra_plugins.gluon_sweeper``), every one, before any is launched or any folder made. A
   bad config prints one or two lines on stderr and exits with status 2::

       $ python -m experiments.logreg steps=abc
       error: steps=abc: Value 'abc' of type 'str' could not be converted to Integer

   So does a broken environment, checked next (:func:`check_environment`): a run or sweep
   folder (or ``results_dir``) that cannot be written, ``launcher=slurm`` where there is no
   SLURM, a CUDA device that is not there, the task's data (``check_data``: missing, not
   matching its ``SHA256SUMS``, unreadable, absurd values), and a folder that holds another run
   or a damaged record whose run cannot be told to be this one
   (:func:`experiments.run.resume.other_run`), checked under the folder's lock.
2. **Hydra** composes the config once more and makes the run folder (its ``.hydra`` and log);
   its composition only to read ``hydra.mode`` is skipped, the check having read it.
3. **The job** (:func:`experiments.run.job.run_hydra_job`) is handed the config checked here.

Concurrency: the command line locks a single run's folder
(:class:`~experiments.shared.lock.RunLock`) before it checks the folder for another run and
before hydra writes into it, and holds the lock until the run ends; a second process given the
same folder waits, then skips the finished run (the same config) or is refused (another config)
without touching the first run's files. Whether this invocation made the folder (and may remove
it on a refusal) is decided under the lock. Under torchrun every rank checks before any
collective; rank 0 alone locks and writes (the other ranks keep hydra from writing into the run
folder and from logging).
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from .config import checked, compose
from .job import run_hydra_job
from .resume import other_run
from ..tasks import ResolvedConfig
from experiments.shared.errors import ConfigError, EnvironmentProblem
from experiments.shared.files import REPO
from experiments.shared.lock import RunLock

INFO_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion")

# What the check hands the job (a single run): the config it resolved and validated, and the run
# folder's lock, taken before hydra writes into the folder and held until the run ends (the job
# takes it again, re-entrant): between the check that the folder holds no other run and the run
# itself, no other process can finish a run there.
_handed: ResolvedConfig | None = None
_held: RunLock | None = None


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
        summary = run_hydra_job(cfg, task, _handed, _held) or {}
        return (summary.get("final") or {}).get(objective, float("nan"))

    def main(argv: list[str] | None = None) -> None:
        command_line(job, config_name, task, argv, config_dir)
    return main


def command_line(hydra_main: Callable, config_name: str, task,
                 argv: list[str] | None = None, config_dir: str | Path | None = None) -> None:
    """Check the command (:func:`check_run`), then run ``hydra_main`` (the entry point's
    ``@hydra.main`` function). ``config_dir``: the folder of ``config_name`` when it is not the
    project's ``configs/``."""
    from hydra._internal.utils import get_args_parser

    global _handed, _held
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = get_args_parser().parse_known_args(argv)
    composed = None
    if not any(getattr(args, f, None) for f in INFO_FLAGS):
        try:
            composed, _handed, _held = check_run(config_name, list(args.overrides),
                                                 bool(args.multirun), task, config_dir)
        except (ConfigError, EnvironmentProblem) as err:
            fail(str(err))
        except KeyboardInterrupt:             # Ctrl-C while checking, or waiting for a folder
            print("stopped: SIGINT (Ctrl-C)", file=sys.stderr, flush=True)
            raise SystemExit(128 + signal.SIGINT) from None
        if os.environ.get("RANK", "0") != "0":   # rank > 0 of a multi-process run: no writing
            sys.argv = [sys.argv[0], *argv, "hydra.output_subdir=null",
                        "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    try:
        with _mode_known(composed):
            hydra_main()
    except KeyboardInterrupt:                 # Ctrl-C outside training (which checkpoints
        print("stopped: SIGINT (Ctrl-C)", file=sys.stderr, flush=True)   # and exits 130)
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        held, _held, _handed = _held, None, None
        if held is not None:                  # nothing in the folder but the lock: removed
            held.release(clean=held.holds_only_the_lock())


@contextmanager
def _mode_known(composed: DictConfig | None):
    """Hydra 1.3's ``hydra.main`` composes the config once only to read ``hydra.mode``
    (``Hydra.get_mode``), then again to run it. The check composed it already: its
    ``hydra.mode`` is handed over, and hydra composes once."""
    from hydra._internal.hydra import Hydra
    if composed is None or not hasattr(Hydra, "get_mode"):
        yield
        return
    mode = OmegaConf.select(composed, "hydra.mode")
    real = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: mode
    try:
        yield
    finally:
        Hydra.get_mode = real


def check_run(config_name: str, overrides: list[str], multirun: bool, task,
              config_dir: str | Path | None = None
              ) -> tuple[DictConfig, ResolvedConfig | None, RunLock | None]:
    """Compose the command's config (a sweep's first job) and check the environment
    (:func:`check_environment`); a single run's config is also resolved and validated (a
    sweep's jobs, by the sweeper). ConfigError or EnvironmentProblem if bad. Returns the
    composed config, a single run's checked config and its folder's lock, held."""
    unquoted(overrides)
    try:
        cfg = compose(config_name, *(first_point(overrides) if multirun else overrides),
                      hydra=True, config_dir=config_dir)
    except Exception as err:  # noqa: BLE001 (hydra's composition errors, reworded)
        raise ConfigError(composition_message(err, overrides)) from None
    run = None if multirun else checked(cfg, task)
    return cfg, run, check_environment(cfg, multirun, run, lock=True)


def check_environment(cfg: DictConfig, multirun: bool, run: ResolvedConfig | None = None,
                      lock: bool = False) -> RunLock | None:
    """What the machine must offer before hydra makes a folder for ``cfg`` (composed, with
    hydra's node): SLURM for a SLURM launcher, the CUDA device asked for, write access where the
    run (or sweep) folder and the caches go, and a single run's data (its task's ``check_data``,
    given ``run``, its checked config; a sweep's, by the sweeper once every job's config is known
    to be good). EnvironmentProblem if not.

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
    check_data = getattr(run.task, "check_data", None) if run is not None else None
    if check_data is not None and not multirun:   # a sweep's: by the sweeper, every job's
        check_data(run.cfg)
    if multirun or folder is None:
        return None
    held = None
    if lock and os.environ.get("RANK", "0") == "0":
        held = RunLock(Path(str(folder)), announce=_waiting).__enter__()
    try:
        if not cfg.overwrite:
            refuse_other_run(Path(str(folder)), run or ResolvedConfig.of(cfg))
    except BaseException:
        if held is not None:
            held.release(clean=True)
        raise
    return held


def _waiting(message: str) -> None:
    """The lock's line while the command line waits (hydra's logging is not set up yet)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def refuse_other_run(run_dir: Path, run: ResolvedConfig) -> None:
    """EnvironmentProblem when ``run_dir`` holds another run than ``run``'s (never replaced
    unless ``overwrite``), before hydra writes anything into it."""
    if not (run_dir / "summary.json").exists() and not (run_dir / "checkpoint.pt").exists():
        return
    problem = other_run(run_dir, run.config, run.data)
    if problem:
        raise EnvironmentProblem(problem)


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
