"""The command line of every entry point: check every job's config first, then hand over to hydra.

``python -m experiments.logreg [-m] [overrides]`` composes the config of every job it would run
(one, or every point of a sweep's grid, the experiment's grid included) and validates each
(:func:`experiments.run.config.validate`) before hydra creates a run folder or a launcher
submits anything. A bad config prints one or two lines on stderr and exits with status 2::

    $ python -m experiments.logreg steps=abc
    error: steps=abc: Value 'abc' of type 'str' could not be converted to Integer

Under torchrun (or srun) with ``comm=torchdist``, every rank checks before any collective; the
ranks other than 0 keep hydra from writing into the run folder and from logging.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

from .config import ConfigError, validate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
INFO_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion")


def job_overrides(config_name: str, overrides: list[str], multirun: bool) -> list[list[str]]:
    """The overrides of every job hydra's basic sweeper would run (one job without ``-m``)."""
    if not multirun:
        return [overrides]
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
             if o.is_sweep_override() else o.input_line for o in parsed]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name, overrides=first, return_hydra_config=True)
    params = cfg.hydra.sweeper.get("params")
    params = OmegaConf.to_container(params) if OmegaConf.is_config(params) else {}
    given = {o.get_key_element().lstrip("+~") for o in parsed}
    grid = [f"{k}={v}" for k, v in params.items() if k not in given]
    batches = BasicSweeper.split_arguments(parser.parse_overrides(grid + overrides), None)
    return [list(job) for batch in batches for job in batch]


def check_jobs(config_name: str, overrides: list[str], multirun: bool, task) -> int:
    """Compose and validate every job's config; the number of jobs (ConfigError if one is bad)."""
    from hydra import compose, initialize_config_dir

    jobs = job_overrides(config_name, overrides, multirun)
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        for job in jobs:
            try:
                cfg = compose(config_name, overrides=job, return_hydra_config=multirun)
            except Exception as err:  # noqa: BLE001 (hydra's composition errors, reworded)
                raise ConfigError(_composition_message(err)) from None
            # a SLURM launcher starts one task per worker itself: the job checks its world
            spawns = multirun and str(cfg.hydra.launcher.get("_target_", "")).endswith(
                "SlurmLauncher") and int(cfg.hydra.launcher.get("tasks_per_node", 1)) > 1
            try:
                validate(cfg, task, check_world=not spawns)
            except ConfigError as err:
                if len(jobs) > 1:
                    raise ConfigError(f"{err} (in the job {' '.join(job)})") from None
                raise
    return len(jobs)


def _composition_message(err: Exception) -> str:
    """Hydra's message for a bad override, in one or two lines."""
    override = None
    text = str(err).strip()
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


def run(hydra_main: Callable, config_name: str, task, argv: list[str] | None = None) -> None:
    """Check every job, then run ``hydra_main`` (the entry point's ``@hydra.main`` function)."""
    from hydra._internal.utils import get_args_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = get_args_parser().parse_known_args(argv)
    if not any(getattr(args, f, None) for f in INFO_FLAGS):
        try:
            check_jobs(config_name, list(args.overrides), bool(args.multirun), task)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        if os.environ.get("RANK", "0") != "0":   # rank > 0 of a multi-process run: no writing
            sys.argv = [sys.argv[0], *argv, "hydra.output_subdir=null",
                        "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    hydra_main()
