"""The sweeper of every entry point: hydra's basic sweeper, launching only unfinished runs.

Hydra finds sweepers in the ``hydra_plugins`` namespace; ``configs/hydra/default.yaml`` selects
this one (``hydra.sweeper._target_``).
"""
from __future__ import annotations

from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from omegaconf import OmegaConf


class SkipFinishedSweeper(BasicSweeper):
    """Hydra's basic sweeper that launches only the jobs whose run is not finished yet.

    Every job's config is composed (as the sweeper does anyway to validate a batch) and its run
    folder checked: a finished run with the same config (``experiments.run.record.is_finished``)
    is reported ``[skip]`` here and never handed to the launcher, so re-running a finished sweep
    on SLURM submits nothing. ``overwrite=true`` launches every job."""

    def split_arguments(self, overrides, max_batch_size):  # noqa: D401 (hydra's hook)
        from experiments.run.config import plain
        from experiments.run.record import is_finished, read_summary
        from experiments.run.sweep import SKIPPED
        (jobs,) = BasicSweeper.split_arguments(overrides, None)
        todo = []
        for job in jobs:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
            run_dir = Path(cfg.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir)
            if not cfg.get("overwrite") and is_finished(run_dir, OmegaConf.to_container(plain(cfg))):
                print(f"[skip] {run_dir}: already finished with this config", flush=True)
                SKIPPED[run_dir] = read_summary(run_dir).get("status", "ok")
            else:
                todo.append(job)
        if not todo:
            return []
        return list(BasicSweeper.split_overrides_to_chunks(todo, max_batch_size))
