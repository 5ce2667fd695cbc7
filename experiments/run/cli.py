"""The command line of every entry point: check every job's config first, then hand over to hydra.

``python -m experiments.logreg [-m] [overrides]`` composes the command's config (a sweep's first
job) and validates it (:func:`experiments.run.config.validate`) before hydra creates a run
folder; in a sweep, the sweeper (``hydra_plugins.gluon_sweeper``) then checks every job, the
experiment's grid included, before any is launched. A bad config prints one or two lines on
stderr and exits with status 2::

    $ python -m experiments.logreg steps=abc
    error: steps=abc: Value 'abc' of type 'str' could not be converted to Integer

So does a broken environment, checked next, still before hydra makes a folder
(:func:`check_environment`): a run or sweep folder (or ``results_dir``) that cannot be written,
``launcher=slurm`` where there is no SLURM, and the task's data (``check_data``: missing, not
matching its ``SHA256SUMS``, unreadable).

Under torchrun (or srun) with ``comm=torchdist``, every rank checks before any collective; the
ranks other than 0 keep hydra from writing into the run folder and from logging.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable

from .config import ConfigError, validate
from .runs import EnvironmentProblem

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
INFO_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion")


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


def check_run(config_name: str, overrides: list[str], multirun: bool, task) -> None:
    """Compose and validate the command's config (a sweep's first job; the sweeper,
    ``hydra_plugins.gluon_sweeper``, checks every job before launching any). ConfigError if bad."""
    from .config import compose
    try:
        cfg = compose(config_name, *(first_point(overrides) if multirun else overrides),
                      hydra=True)
    except Exception as err:  # noqa: BLE001 (hydra's composition errors, reworded)
        raise ConfigError(composition_message(err)) from None
    validate(cfg, task, check_world=not (multirun and launcher_starts_workers(cfg)))
    check_environment(cfg, multirun, task)


def check_environment(cfg, multirun: bool, task=None) -> None:
    """What the machine must offer before hydra makes a folder: SLURM for a SLURM launcher,
    write access where the run (or sweep) folder and the caches go, and the task's data
    (``task.check_data(cfg)``, where the task has one; in a sweep the sweeper checks every job's
    once every job's config is known to be good). EnvironmentProblem if not."""
    from omegaconf import OmegaConf

    from ..datasets import REPO
    if multirun and str(cfg.hydra.launcher.get("_target_", "")).endswith("SlurmLauncher") \
            and shutil.which("srun") is None:
        raise EnvironmentProblem(
            "launcher=slurm: no SLURM here (srun is not on PATH)\n  submit from a machine of "
            "the cluster, or use launcher=local or launcher=basic (make sbatch-preview "
            "EXP=<experiment> prints the job script)")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    folder = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
    for path, name in ((folder, key), (Path(REPO, cfg.results_dir), "results_dir")):
        if path is not None:
            writable(Path(str(path)), name)
    check_data = getattr(task, "check_data", None)
    if check_data is not None and not multirun:   # a sweep's: by the sweeper, every job's
        check_data(cfg)
    if not multirun and folder is not None and not cfg.overwrite:
        refuse_other_run(Path(str(folder)), cfg, task)


def refuse_other_run(run_dir: Path, cfg, task) -> None:
    """EnvironmentProblem when ``run_dir`` holds another run than ``cfg``'s (never replaced
    unless ``overwrite``), before hydra writes anything into it."""
    from omegaconf import OmegaConf

    from .config import resolved
    from .lifecycle import other_run
    if not (run_dir / "summary.json").exists() and not (run_dir / "checkpoint.pt").exists():
        return
    cfg = resolved(cfg)
    data_identity = getattr(task, "data_identity", None)
    data = data_identity(cfg) if data_identity is not None else None
    problem = other_run(run_dir, OmegaConf.to_container(cfg), data)
    if problem:
        raise EnvironmentProblem(problem)


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


def composition_message(err: Exception) -> str:
    """Hydra's message for a bad override, in one or two lines."""
    override = None
    text = str(err).strip()
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


def _missing_option(text: str) -> str | None:
    """``tuned=fig2_logreg/nope``: hydra names no options for a nested group; list them."""
    first = text.splitlines()[0] if text else ""
    if "Could not find '" not in first or "Available options" in text:
        return None
    missing = first.split("Could not find '", 1)[1].split("'", 1)[0]
    group, _, name = missing.partition("/")
    root = CONFIGS / group
    if not name or not root.is_dir():
        return None
    under = (root / name).parent
    under = under if under.is_dir() and under != root else root
    options = sorted(p.relative_to(root).with_suffix("").as_posix() for p in under.rglob("*.yaml")
                     if not any(part.startswith("_") for part in p.relative_to(root).parts))
    return f"{group}={name}: no such config; the options are {', '.join(options)}"


def run(hydra_main: Callable, config_name: str, task, argv: list[str] | None = None) -> None:
    """Check every job, then run ``hydra_main`` (the entry point's ``@hydra.main`` function)."""
    from hydra._internal.utils import get_args_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = get_args_parser().parse_known_args(argv)
    if not any(getattr(args, f, None) for f in INFO_FLAGS):
        try:
            check_run(config_name, list(args.overrides), bool(args.multirun), task)
        except (ConfigError, EnvironmentProblem) as err:
            fail(str(err))
        if os.environ.get("RANK", "0") != "0":   # rank > 0 of a multi-process run: no writing
            sys.argv = [sys.argv[0], *argv, "hydra.output_subdir=null",
                        "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    hydra_main()
