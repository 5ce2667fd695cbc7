"""A sweep: what it did, reported at its end, and what a SLURM sweep would submit.

Runs inside a multirun do not stop the sweep when they fail (:func:`experiments.run.job.
run_hydra_job`). Once every job has returned, the sweeper (:mod:`hydra_plugins.gluon_sweeper`,
any launcher) calls :func:`report`: it lists each run this sweep launched that is not finished -
failed, damaged, interrupted (a checkpoint but no summary) or missing: the statuses of
:mod:`experiments.shared.runs` - and exits with status 1 so that the command (and ``make``) fails.
Re-running the same command re-runs only those (finished runs are skipped).
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from experiments.shared.runs import FINISHED, SUMMARY
from experiments.shared.runs import status as run_status


def sweep_runs(sweep_dir: Path) -> dict[Path, str]:
    """Every job directory under ``sweep_dir`` with its status: each folder where hydra started
    a job (it writes ``.hydra/overrides.yaml`` there first) or that holds a run's summary.json
    (run folders committed without hydra's ``.hydra``, such as ``results/sweeps/cnn_gap``)."""
    root = Path(sweep_dir)
    found = {o.parent.parent for o in root.glob("**/.hydra/overrides.yaml")}
    found |= {s.parent for s in root.glob(f"**/{SUMMARY}")}
    return {d: run_status(d) for d in sorted(found)}


def report(sweep_dir: Path, skipped: dict[Path, str], launched: list[Path]) -> None:
    """Print what the sweep in ``sweep_dir`` did: the runs found finished before launch
    (``skipped``) and the run folders it launched (``launched``), by status; exit with status 1
    when any launched run did not finish. Runs of another sweep in the same folder, running at
    the same time (another method's sweep, say), are not this sweep's to report."""
    runs = {**skipped, **{Path(d): run_status(d) for d in launched}}
    counts = Counter(runs.values())
    print(f"[sweep] {sweep_dir}: {len(runs)} runs: "
          + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())), flush=True)
    bad = {d: s for d, s in runs.items() if s not in FINISHED}
    for d, s in bad.items():
        print(f"[sweep]   {s}: {d}", flush=True)
    if bad:
        print(f"[sweep] {len(bad)} of {len(runs)} runs did not finish; re-run the same "
              "command to re-run only those", file=sys.stderr, flush=True)
        raise SystemExit(1)


# ---------------------------------------------------------------- what a SLURM sweep submits

def _grid_size(sweeper_params: dict, overrides: list[str]) -> int:
    """Jobs in the grid of ``hydra.sweeper.params`` (e.g. from experiment=fig3) combined with
    the command line's sweeps, the command line winning for a key given in both."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parser = OverridesParser.create()
    given = {o.get_key_element().lstrip("+~"): o for o in parser.parse_overrides(overrides)}
    grid = {k: parser.parse_overrides([f"{k}={v}"])[0] for k, v in sweeper_params.items()}
    grid.update(given)
    n = 1
    for o in grid.values():
        if o.is_sweep_override():
            n *= len(list(o.sweep_string_iterator()))
    return n


def sbatch_script(config_name: str, overrides: list[str], n_jobs: int | None = None) -> str:
    """The sbatch script ``python -m experiments.<config_name> -m <overrides>`` would submit,
    built exactly as hydra-submitit-launcher does, without a cluster (nothing is submitted)."""
    from unittest import mock

    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    from .command_line import first_point
    from .config import compose

    cfg = compose(config_name, *first_point(overrides), hydra=True)
    params = cfg.hydra.sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=True) if params is not None else {}
    size = _grid_size({k: str(v) for k, v in params.items()}, overrides)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    target = launcher.pop("_target_", "")
    if not target.endswith("SlurmLauncher"):
        raise ValueError(f"hydra.launcher is {target or 'not a submitit launcher'}; "
                         "add launcher=slurm")
    # hydra_plugins.hydra_submitit_launcher.submitit_launcher.BaseSubmititLauncher.launch:
    folder = launcher.pop("submitit_folder")
    # SlurmExecutor refuses to exist where there is no srun; a preview submits nothing.
    with mock.patch.object(submitit.SlurmExecutor, "affinity", return_value=1):
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm",
                                         slurm_max_num_timeout=launcher.pop("max_num_timeout"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v
                                  for k, v in launcher.items()})
    slurm = executor._executor
    slurm.parameters["map_count"] = n_jobs or size   # the sweep is one job array
    return slurm._make_submission_file_text(slurm._submitit_command_str, "preview")


USAGE = """usage: python -m experiments.run.sweep sbatch CONFIG [OVERRIDES...]
         print the sbatch script, e.g. sbatch logreg launcher=slurm seed=0,1,2
       python -m experiments.run.sweep dir CONFIG EXPERIMENT
         print the folder an experiment's sweep writes, e.g. dir logreg tune_fig2/gluon"""


def main(argv: list[str] | None = None) -> None:
    """The sbatch script of a sweep, or the folder an experiment's sweep writes (from its
    config, so that the Makefile names no sweep folder of its own)."""
    import sys
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 2 and args[0] == "sbatch":
        print(sbatch_script(args[1], args[2:]))
    elif len(args) == 3 and args[0] == "dir":
        from experiments.shared.configs import sweep_dir
        print(sweep_dir(args[1], args[2]))
    else:
        raise SystemExit(USAGE)


if __name__ == "__main__":
    main()
