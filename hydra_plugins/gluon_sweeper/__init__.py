"""The project's two hydra plugins: the sweeper of every entry point (hydra's basic sweeper,
launching only unfinished runs) and the project's config folder on every hydra app's search path.

Hydra finds plugins in the ``hydra_plugins`` namespace; ``configs/hydra/default.yaml`` selects
the sweeper (``hydra.sweeper._target_``); the search path plugin applies to every app, so an
entry point of your own (a task of your own, docs/architecture.md) with its own config folder
reuses the project's groups (``hydra: default``, ``method/``, ``compressor/``, ``launcher/``...).
"""
from __future__ import annotations

from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from experiments.shared.configs import CONFIGS


class ProjectConfigs(SearchPathPlugin):
    """``configs/`` of this checkout, last on the search path of any hydra app that does not
    have it already: the project's config groups for entry points outside the project."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        def folder(entry) -> Path | None:
            path = entry.path or ""
            if path.startswith("file://"):
                path = path[len("file://"):]
            elif "://" in path:                      # pkg://, structured://: not a folder
                return None
            return Path(path).resolve()
        if CONFIGS not in {folder(e) for e in search_path.get_path()}:
            search_path.append(provider="gluon-fl", path=f"file://{CONFIGS}")


class SkipFinishedSweeper(BasicSweeper):
    """Hydra's basic sweeper that checks every job first and launches only unfinished runs.

    Before anything is launched or any folder made, every job's config is composed, resolved
    and validated once (:func:`experiments.run.config.checked` with the entry point's task), and
    its data checked (``check_data``): one bad job stops the sweep with one line and exit status
    2 (the command line validated none: this is where a sweep's jobs are validated). Then each
    job's run folder is looked at: a finished run with the same config whose files agree
    (``experiments.shared.runs.is_finished``: the same identity, data included) is reported ``[skip]`` here and never handed to
    the launcher, so re-running a finished sweep on SLURM submits nothing; a damaged one is
    launched again. ``overwrite=true`` launches every job."""

    def setup(self, *, hydra_context, task_function, config) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        from experiments.tasks import task_module
        self.task = task_module(config.task.name)        # the registered task (experiments.tasks)
        self.skipped: dict[Path, str] = {}               # runs found finished, not launched
        self.launched: list[Path] = []                   # the run folders of the jobs launched

    def sweep(self, arguments):                          # noqa: D401 (hydra's hook)
        """Hydra's sweep, then the report of every run (:func:`experiments.run.sweep.report`):
        a sweep with runs that did not finish exits with status 1."""
        from experiments.run.sweep import report
        results = super().sweep(arguments)
        report(Path(self.config.hydra.sweep.dir), self.skipped, self.launched)
        return results

    def split_arguments(self, overrides, max_batch_size):  # noqa: D401 (hydra's hook)
        from experiments.run.command_line import (composition_message, fail,
                                                  launcher_starts_workers, refuse_other_run)
        from experiments.run.config import checked
        from experiments.shared.errors import ConfigError, EnvironmentProblem
        from experiments.shared.runs import is_finished, read_summary
        (jobs,) = BasicSweeper.split_arguments(overrides, None)
        check_world = not launcher_starts_workers(self.config)
        check_data = getattr(self.task, "check_data", None)
        runs = []
        for job in jobs:                       # every job checked before any is launched:
            try:                               # resolved once, validated once
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
                runs.append(checked(cfg, self.task, check_world))
            except ConfigError as err:
                fail(f"{err} (in the job {' '.join(job)})")
            except Exception as err:  # noqa: BLE001 (hydra's composition errors, reworded)
                fail(f"{composition_message(err)} (in the job {' '.join(job)})")
        for job, run in zip(jobs, runs):       # then the data (its hashes are cached), and
            try:                               # that no job's folder holds another run
                if check_data is not None:
                    check_data(run.cfg)
                if not run.cfg.overwrite:
                    refuse_other_run(_run_dir(run), run)
            except (ConfigError, EnvironmentProblem) as err:
                fail(f"{err} (in the job {' '.join(job)})")
        todo = []
        for job, run in zip(jobs, runs):
            run_dir = _run_dir(run)
            if not run.cfg.overwrite and is_finished(run_dir, run.config, run.data):
                print(f"[skip] {run_dir}: already finished with this config", flush=True)
                self.skipped[run_dir] = read_summary(run_dir).get("status", "ok")
            else:
                todo.append(job)
                self.launched.append(run_dir)
        if not todo:
            return []
        return list(BasicSweeper.split_overrides_to_chunks(todo, max_batch_size))

    def validate_batch_is_legal(self, batch) -> None:  # noqa: D401 (hydra's hook)
        """Nothing: hydra's check composes every job of the batch once more, and
        :meth:`split_arguments` composed and validated each already."""


def _run_dir(run) -> Path:
    """A sweep job's run folder (a ResolvedConfig of a job composed with hydra's node)."""
    sweep = run.composed.hydra.sweep
    return Path(sweep.dir) / str(sweep.subdir)
