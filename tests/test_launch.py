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

from experiments.shared.runs import CHECKPOINT, read_rows, read_summary
from experiments.run.sweep import sbatch_script, sweep_runs
from tests.conftest import compose_config, metrics_bytes

from experiments.shared.files import REPO
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
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")           # GPU 3 of the machine
    with pytest.warns(UserWarning, match="not CUDA_VISIBLE_DEVICES=3"):
        hydra_cfg("launcher=local").hydra.launcher.gpus_per_node
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
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


def test_usr1_to_a_local_sweeps_process_group_stops_every_job_at_a_checkpoint(tmp_path,
                                                                               results):
    """docs/slurm.md's way to stop a local sweep from another shell: USR1 to its process group.
    Every submitit job (a process of its own, which ignores SIGTERM as under SLURM) writes a
    checkpoint and exits, no process of the sweep is left, and no run has a summary."""
    folder = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.logreg", "-m", "launcher=local",
                             "seed=0,1", "steps=1000000", "checkpoint_every=200",
                             f"results_dir={results}", f"hydra.sweep.dir={folder}"], cwd=REPO,
                            env={**ENV, "GLUON_JOBS": "2"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.time()
        while len(list(folder.glob(f"*/*/{CHECKPOINT}"))) < 2:
            assert proc.poll() is None and time.time() - t0 < 120
            time.sleep(0.1)
        assert len(_sweep_processes(folder)) == 2         # the two jobs run apart from it
        os.killpg(proc.pid, signal.SIGUSR1)
        proc.wait(timeout=60)
        t0 = time.time()
        while _sweep_processes(folder) and time.time() - t0 < 30:
            time.sleep(0.1)
        assert _sweep_processes(folder) == []
    finally:                  # whatever failed, no job of a million steps outlives the test
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in _sweep_processes(folder):
            os.kill(pid, signal.SIGKILL)
    runs = list(folder.glob(f"*/*/{CHECKPOINT}"))
    assert len(runs) == 2 and not list(folder.glob("*/*/summary.json"))
    for r in runs:
        assert "[signal] SIGUSR1 at step" in next(r.parent.glob("*.log")).read_text()


def _sweep_processes(folder: Path) -> list[int]:
    """The submitit job processes (``submitit.core._submit``) running from ``folder``."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" in cmd and any(str(folder).encode() in c for c in cmd):
            out.append(int(proc.name))
    return out


def _param(run_dir: Path, sweep_dir: Path, key: str) -> str:
    """A dotted key's value in the config a job directory's run recorded (config.json)."""
    value = json.loads((run_dir / "config.json").read_text())
    for part in key.split("."):
        value = value[part]
    return str(value)


def _job_pid(folder: Path) -> int:
    """The pid of the submitit task process running from ``folder`` (started by this test)."""
    pids = _sweep_processes(folder)
    assert pids, "submitit job process not found"
    return pids[0]


FAKE_MPS = """#!/usr/bin/env bash
# stands in for nvidia-cuda-mps-control: logs what it is asked and at which pipe folder; the
# system's daemon (default folder) 'runs' while $DEFAULT exists, one at another folder while $STATE does
pipe=${CUDA_MPS_PIPE_DIRECTORY:-default}
if [ "${1:-}" = -d ]; then echo "start $pipe" >> "$LOG"; [ "${START_RC:-0}" = 0 ] && touch "$STATE"; exit "${START_RC:-0}"; fi
cmd=$(cat); echo "$cmd $pipe" >> "$LOG"
flag=$STATE; [ "$pipe" = default ] && flag=$DEFAULT
case "$cmd" in get_server_list) [ -e "$flag" ];; quit) rm -f "$flag";; esac
"""


def with_mps(tmp_path, case, cmd, **popen):
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "nvidia-cuda-mps-control").write_text(FAKE_MPS)
    (bin_ / "nvidia-cuda-mps-control").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    env.update({"PATH": f"{bin_}:{os.environ['PATH']}", "LOG": str(tmp_path / "log"),
                "STATE": str(tmp_path / "state"), "DEFAULT": str(tmp_path / "default"),
                "TMPDIR": str(tmp_path), "MPS": "0" if case == "off" else "1",
                "START_RC": "1" if case == "start_fails" else "0"})
    if case == "own_folder_running":
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(tmp_path / "mine")
    return subprocess.Popen([str(REPO / "scripts/cluster/with_mps.sh"), "bash", "-c", cmd], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.parametrize("case", ["starts_and_stops", "system_daemon", "own_folder_running",
                                  "off", "start_fails"])
def test_with_mps_starts_a_daemon_only_if_none_answers_and_stops_only_its_own(tmp_path, case):
    """scripts/cluster/with_mps.sh (make cnn-gap-gpu): the command runs in every case and its exit status
    is the script's; a daemon that answers (the system's, or at the folder the caller names) is
    used and left running; else one is started at the script's own folder and stopped after;
    MPS=0 leaves MPS alone."""
    if case == "system_daemon":
        (tmp_path / "default").touch()
    if case == "own_folder_running":
        (tmp_path / "state").touch()
    cmd = ("echo pipe=${CUDA_MPS_PIPE_DIRECTORY:-none}; "
           "[ -e \"$STATE\" ] || [ -e \"$DEFAULT\" ] && echo mps=on || echo mps=off; exit 3")
    p = with_mps(tmp_path, case, cmd)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    log = tmp_path / "log"
    calls = log.read_text().split("\n")[:-1] if log.exists() else []
    own = f"{tmp_path}/gluon-mps-{os.getuid()}"
    probe = ["get_server_list default", f"get_server_list {own}"]
    expected = {       # calls, what the command saw, the daemon still running after
        "starts_and_stops": (probe + [f"start {own}", f"quit {own}"], f"pipe={own}", False),
        "system_daemon": (probe[:1], "pipe=none", True),
        "own_folder_running": ([f"get_server_list {tmp_path}/mine"], f"pipe={tmp_path}/mine", True),
        "off": ([], "pipe=none", False),
        "start_fails": (probe + [f"start {own}"], "pipe=none", False),
    }[case]
    assert calls == expected[0]
    assert expected[1] in out and ("mps=on" in out) == (case not in ("off", "start_fails"))
    running = (tmp_path / "state").exists() or (tmp_path / "default").exists()
    assert running == expected[2]


def test_with_mps_passes_a_signal_on_and_still_stops_its_daemon(tmp_path):
    """TERM to the script (a timeout, a cancelled job) ends the command at once, not when it
    would have finished, and the daemon the script started is stopped."""
    p = with_mps(tmp_path, "starts_and_stops", "sleep 60")
    deadline = time.time() + 20
    while not (tmp_path / "state").exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    assert time.time() - t0 < 10 and p.returncode != 0
    assert not (tmp_path / "state").exists()                  # stopped
    assert (tmp_path / "log").read_text().split("\n")[-2].startswith("quit")


def test_a_sweep_reports_the_runs_it_launched_not_a_concurrent_sweeps(tmp_path, results):
    """Sweeps that share a folder run at the same time (make cnn-gap-gpu starts one per method
    for the lr check): each one's report and exit status cover the runs it launched. Here a
    sibling's run, interrupted in the same folder, does not fail the sweep that finished its own."""
    from experiments.run.sweep import report
    sibling = tmp_path / "alg2" / "seed=7"
    (sibling / ".hydra").mkdir(parents=True)
    (sibling / ".hydra" / "overrides.yaml").write_text("- seed=7\n")
    (sibling / CHECKPOINT).write_bytes(b"")                   # a checkpoint, no summary
    later = time.time() + 3600                                # as if started during this sweep
    os.utime(sibling / ".hydra" / "overrides.yaml", (later, later))
    out = sweep("seed=0", "steps=100", "log_every=20", f"results_dir={results}",
                f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 runs: 1 ok" in out.stdout
    own = [d for d in sweep_runs(tmp_path) if d != sibling]
    assert sweep_runs(tmp_path)[sibling] == "interrupted" and len(own) == 1
    report(tmp_path, {}, own)                                 # its own run: no exit
    with pytest.raises(SystemExit):
        report(tmp_path, {}, own + [sibling])                 # had it launched the sibling


def test_a_cuda_device_is_checked_where_the_jobs_run(tmp_path, monkeypatch):
    """device=cuda is refused before any folder where the jobs would run on this machine
    without a GPU (a single run, launcher=local), not where a SLURM job runs on a GPU node."""
    import torch
    from experiments.run import command_line
    from experiments.shared.errors import EnvironmentProblem
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(command_line.shutil, "which", lambda name: f"/usr/bin/{name}")   # srun
    paths = (f"hydra.sweep.dir={tmp_path / 'sw'}", f"hydra.run.dir={tmp_path / 'run'}",
             f"results_dir={tmp_path / 'res'}")
    slurm = compose_config("cnn", "device=cuda", "launcher=slurm_gpu", *paths, hydra=True)
    command_line.check_environment(slurm, multirun=True)
    for launcher, multirun in (("local", True), ("basic", False)):
        cfg = compose_config("cnn", "device=cuda:0", f"launcher={launcher}", *paths, hydra=True)
        with pytest.raises(EnvironmentProblem, match="no such CUDA device here"):
            command_line.check_environment(cfg, multirun=multirun)
    assert not list(tmp_path.iterdir())
