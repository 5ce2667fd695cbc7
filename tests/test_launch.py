"""Sweeps: the launcher config group, submitit locally, the sbatch script for SLURM, failures.

No cluster is needed: the SLURM test builds the sbatch script exactly as
hydra-submitit-launcher would (experiments.run.sweep.sbatch_script) and checks its #SBATCH lines.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.run.record import CHECKPOINT
from experiments.run.runs import read_rows, read_summary
from experiments.run.sweep import sbatch_script, sweep_runs
from tests.conftest import compose_config, metrics_bytes

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "WANDB_SILENT": "true",
       "HYDRA_FULL_ERROR": "1"}


@pytest.fixture(scope="module")
def results(results_with_cache):
    return results_with_cache          # f* computed once, not by every job


def hydra_cfg(*overrides):
    return compose_config("logreg", *overrides, hydra=True)


def sweep(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "experiments.logreg", "-m", *args], cwd=REPO,
                          env={**ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def test_launcher_group_defaults_and_choices(monkeypatch):
    assert hydra_cfg().hydra.launcher._target_.endswith("BasicLauncher")   # the default
    monkeypatch.setenv("GLUON_JOBS", "3")
    local = hydra_cfg("launcher=local").hydra
    assert local.launcher._target_.endswith("submitit_launcher.LocalLauncher")
    assert local.sweeper.max_batch_size == 3                              # jobs at a time
    assert hydra_cfg("launcher=local", "hydra.sweeper.max_batch_size=5").hydra.sweeper.max_batch_size == 5
    gpu = hydra_cfg("launcher=slurm_gpu").hydra.launcher
    assert gpu._target_.endswith("SlurmLauncher") and gpu.gpus_per_node == 1
    # the launcher is not part of a run's identity: same run directory whatever launches it
    assert (str(hydra_cfg("launcher=local", "seed=1").hydra.sweep.subdir)
            == str(hydra_cfg("seed=1").hydra.sweep.subdir))


def _visible_devices():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_local_jobs_see_the_machines_gpus(tmp_path, monkeypatch):
    """submitit's local executor sets every job's CUDA_VISIBLE_DEVICES from gpus_per_node, to
    nothing at 0: launcher=local must default to the GPUs this machine has, or a GPU machine's
    jobs run on its CPU."""
    import submitit
    import torch
    seen = {}
    for gpus in (0, 1):
        ex = submitit.LocalExecutor(folder=tmp_path / f"g{gpus}")
        ex.update_parameters(gpus_per_node=gpus, timeout_min=2)
        seen[gpus] = ex.submit(_visible_devices).result()
    assert seen == {0: "", 1: "0"}
    monkeypatch.delenv("GLUON_LOCAL_GPUS", raising=False)
    for count in (0, 1, 2):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        assert hydra_cfg("launcher=local").hydra.launcher.gpus_per_node == count
    monkeypatch.setenv("GLUON_LOCAL_GPUS", "0")               # asked for explicitly: none
    assert hydra_cfg("launcher=local").hydra.launcher.gpus_per_node == 0


def test_slurm_sbatch_script_from_env_and_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv("GLUON_SLURM_PARTITION", "gpu-long")
    monkeypatch.setenv("GLUON_SLURM_TIME", "300")
    monkeypatch.setenv("GLUON_SLURM_GPUS", "1")
    monkeypatch.setenv("GLUON_SLURM_CPUS", "6")
    monkeypatch.setenv("GLUON_SLURM_MEM_GB", "24")
    monkeypatch.setenv("GLUON_SLURM_ARRAY_PARALLELISM", "4")
    monkeypatch.setenv("GLUON_SLURM_EXTRA", "{constraint: a100, mail-type: FAIL}")
    script = sbatch_script("logreg", ["launcher=slurm", "seed=0,1,2", "method.B=1,4",
                                      "hydra.launcher.account=proj42",        # command line
                                      f"hydra.sweep.dir={tmp_path}"])
    lines = set(script.splitlines())
    for line in ("#SBATCH --partition=gpu-long", "#SBATCH --time=300",
                 "#SBATCH --gpus-per-node=1", "#SBATCH --cpus-per-task=6",
                 "#SBATCH --mem=24GB", "#SBATCH --array=0-5%4",   # 6 jobs, 4 at a time
                 "#SBATCH --account=proj42", "#SBATCH --constraint=a100",
                 "#SBATCH --mail-type=FAIL", "#SBATCH --signal=USR2@120",
                 "source .venv/bin/activate"):
        assert line in lines, f"{line!r} not in\n{script}"
    assert "-m submitit.core._submit" in script and str(tmp_path / ".submitit") in script
    # the command line wins over the environment
    script = sbatch_script("logreg", ["launcher=slurm", "hydra.launcher.partition=debug",
                                      f"hydra.sweep.dir={tmp_path}"])
    assert "#SBATCH --partition=debug" in script and "#SBATCH --array=0-0%1" in script


def test_sbatch_array_covers_an_experiment_grid(tmp_path, monkeypatch):
    """experiment=fig3's grid lives in hydra.sweeper.params, not on the command line."""
    monkeypatch.setenv("GLUON_SLURM_ARRAY_PARALLELISM", "1000")
    grid = OmegaConf.load(REPO / "configs" / "experiment" / "fig3.yaml").hydra.sweeper.params
    n = 1
    for values in grid.values():
        n *= len(str(values).split(","))
    script = sbatch_script("logreg", ["launcher=slurm", "experiment=fig3",
                                      f"hydra.sweep.dir={tmp_path}"])
    assert f"#SBATCH --array=0-{n - 1}%{n}" in script
    script = sbatch_script("logreg", ["launcher=slurm", "experiment=fig3", "seed=5",
                                      f"hydra.sweep.dir={tmp_path}"])   # the command line wins
    n_seeds = len(str(grid["seed"]).split(","))
    assert f"#SBATCH --array=0-{n // n_seeds - 1}%{n // n_seeds}" in script


def test_slurm_defaults_need_no_environment(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith("GLUON_SLURM_"):
            monkeypatch.delenv(k)
    script = sbatch_script("logreg", ["launcher=slurm", f"hydra.sweep.dir={tmp_path}"])
    assert "--partition" not in script and "--gpus-per-node" not in script
    assert "#SBATCH --time=240" in script and "#SBATCH --cpus-per-task=2" in script


def test_local_submitit_sweep_runs_end_to_end(tmp_path, results):
    out = sweep("launcher=local", "seed=0,1", "steps=100", "log_every=20",
                f"results_dir={results}", f"hydra.sweep.dir={tmp_path}",
                env={"GLUON_JOBS": "2"})
    assert out.returncode == 0, out.stdout + out.stderr
    runs = sweep_runs(tmp_path)
    assert sorted(_param(d, tmp_path, "seed") for d in runs) == ["0", "1"]
    assert list(runs.values()) == ["ok", "ok"]
    for d in runs:
        assert [r["step"] for r in read_rows(d)] == [0, 20, 40, 60, 80, 100]
        assert not (d / CHECKPOINT).exists()              # deleted once finished
    assert len(list((tmp_path / ".submitit").glob("*/*_result.pkl"))) == 2   # two submitit jobs
    assert "[sweep]" in out.stdout and "2 ok" in out.stdout


# A run that raises (a bug) while the sweep goes on: every config and data set is checked
# before launch, so the failure is injected into the jobs of one config (task.l2=0.001).
FAILING_RUN = """
import os
if os.environ.get("GLUON_TEST_FAIL_L2"):
    import experiments.tasks.logreg as task
    build = task.build
    def failing(cfg, *args, **kw):
        if float(cfg.task.l2) == float(os.environ["GLUON_TEST_FAIL_L2"]):
            raise RuntimeError("injected failure of this run")
        return build(cfg, *args, **kw)
    task.build = failing
"""


def test_failed_run_does_not_stop_the_sweep_and_rerun_redoes_only_it(tmp_path, results):
    # a valid config whose run fails at run time, beside a good one
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FAILING_RUN)
    env = {"GLUON_TEST_FAIL_L2": "0.001",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    args = ["task.l2=0.0001,0.001", "steps=60", "log_every=20", f"results_dir={results}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    first = sweep(*args, env=env)
    assert first.returncode == 1                          # the sweep reports the failure ...
    runs = {_param(d, tmp_path / "sweep", "task.l2"): s
            for d, s in sweep_runs(tmp_path / "sweep").items()}
    assert runs == {"0.001": "failed", "0.0001": "ok"}                 # ... after every job
    assert "1 failed, 1 ok" in first.stdout
    again = sweep(*args, env=env)
    assert again.returncode != 0
    assert "[skip]" in again.stdout and again.stdout.count("[skip]") == 1   # only ok skipped
    failed = next(d for d in sweep_runs(tmp_path / "sweep")
                  if _param(d, tmp_path / "sweep", "task.l2") == "0.001")
    assert "injected failure" in read_summary(failed)["error"]


@pytest.mark.slow
def test_local_submitit_preemption_requeues_and_resumes(tmp_path, results):
    """USR2 (submitit's preemption/timeout signal) -> checkpoint -> requeue -> resume."""
    args = ["launcher=local", "method=alg2", "compressor=topk", "steps=1500", "log_every=10",
            "checkpoint_every=100", f"results_dir={results}"]
    ref = sweep(*args, f"hydra.sweep.dir={tmp_path / 'ref'}", env={"GLUON_JOBS": "1"})
    assert ref.returncode == 0, ref.stderr
    proc = subprocess.Popen([sys.executable, "-m", "experiments.logreg", "-m", *args,
                             f"hydra.sweep.dir={tmp_path / 'pre'}"], cwd=REPO,
                            env={**ENV, "GLUON_JOBS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while not list((tmp_path / "pre").glob(f"**/{CHECKPOINT}")):
        assert proc.poll() is None and time.time() - t0 < 120
        time.sleep(0.02)
    job = _job_pid(tmp_path / "pre" / ".submitit")
    os.kill(job, signal.SIGUSR2)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    (run,) = sweep_runs(tmp_path / "pre")
    (ref_run,) = sweep_runs(tmp_path / "ref")
    logs = "".join(p.read_text() for p in (tmp_path / "pre" / ".submitit").glob("*/*_log.*"))
    assert "Requeued job" in logs and "[resume]" in logs
    assert metrics_bytes(run) == metrics_bytes(ref_run)


def _param(run_dir: Path, sweep_dir: Path, key: str) -> str:
    """A dotted key's value in the config a job directory's run recorded (config.json)."""
    value = json.loads((run_dir / "config.json").read_text())
    for part in key.split("."):
        value = value[part]
    return str(value)


def _job_pid(folder: Path) -> int:
    """The pid of the submitit task process running from ``folder`` (started by this test)."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" in cmd and any(str(folder).encode() in c for c in cmd):
            return int(proc.name)
    raise AssertionError("submitit job process not found")


FAKE_MPS = """#!/usr/bin/env bash
# stands in for nvidia-cuda-mps-control: logs what it is asked; the daemon 'runs' while $STATE exists
if [ "${1:-}" = -d ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >> "$LOG"; [ "${START_RC:-0}" = 0 ] && touch "$STATE"; exit "${START_RC:-0}"; fi
cmd=$(cat); echo "$cmd" >> "$LOG"
case "$cmd" in get_server_list) [ -e "$STATE" ];; quit) rm -f "$STATE";; esac
"""


@pytest.mark.parametrize("case", ["starts_and_stops", "already_running", "off", "start_fails"])
def test_with_mps_starts_the_daemon_only_if_needed_and_stops_only_its_own(tmp_path, case):
    """infra/with_mps.sh (make cnn-gap-gpu): the command runs in every case and its exit status
    is the script's; a daemon is started only where none answers, and only one it started is
    stopped; MPS=0 leaves MPS alone."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-cuda-mps-control").write_text(FAKE_MPS)
    (bin_ / "nvidia-cuda-mps-control").chmod(0o755)
    log, state = tmp_path / "log", tmp_path / "state"
    if case == "already_running":
        state.touch()
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "LOG": str(log),
           "STATE": str(state), "TMPDIR": str(tmp_path),
           "MPS": "0" if case == "off" else "1", "START_RC": "1" if case == "start_fails" else "0"}
    cmd = "echo pipe=${CUDA_MPS_PIPE_DIRECTORY:-none}; [ -e \"$STATE\" ] && echo mps=on || echo mps=off; exit 3"
    out = subprocess.run([str(REPO / "infra/with_mps.sh"), "bash", "-c", cmd], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    calls = log.read_text().split("\n")[:-1] if log.exists() else []
    pipe = f"{tmp_path}/gluon-mps-{os.getuid()}"
    expected = {
        "starts_and_stops": (["get_server_list", f"start {pipe}", "quit"], "mps=on", False),
        "already_running": (["get_server_list"], "mps=on", True),
        "off": ([], "mps=off", False),
        "start_fails": (["get_server_list", f"start {pipe}"], "mps=off", False),
    }[case]
    assert calls == expected[0]
    assert expected[1] in out.stdout
    assert state.exists() == expected[2]          # a daemon it did not start keeps running
