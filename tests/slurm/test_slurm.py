"""SLURM for real: what the `launcher=slurm` path promises, checked on a running cluster.

1. a sweep runs as one job array, every run finishes "ok", identical to the same run without
   SLURM;
2. a running job requeued mid-run (``scontrol requeue``: SIGTERM, then SIGKILL, then the job
   starts again) resumes from its checkpoint and ends bit-identical to an uninterrupted run;
3. re-running the finished sweep recomputes nothing (results untouched, every job skips);
4. the multi-process torch.distributed run goes through ``srun`` (scripts/cluster/slurm_dist.sbatch,
   ``comm=torchdist``) and matches the one-process simulation.

`make test-slurm` brings up a one-node cluster here (scripts/cluster/slurm_cluster.sh) and runs these;
without a cluster they fail (tests/slurm/conftest.py). A few minutes on 2 cores.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import metrics_bytes, untimed

pytestmark = pytest.mark.slurm

from experiments.shared.files import REPO
PY = sys.executable
SEEDS = (0, 1, 2)
SWEEP_STEPS = 300


# ---------------------------------------------------------------- helpers

@pytest.fixture(scope="session")
def env(cluster) -> dict:
    """The submitting shell's environment: the jobs inherit it (sbatch --export=ALL)."""
    e = {k: v for k, v in cluster.items() if not k.startswith("GLUON_SLURM_")}
    e.update(PYTHONPATH=str(REPO), WANDB_MODE="disabled", WANDB_SILENT="true",
             HYDRA_FULL_ERROR="1",
             GLUON_SLURM_CPUS="1",        # 2 jobs at once on a 2-core node
             GLUON_SLURM_MEM_GB="1", GLUON_SLURM_TIME="15")
    if not (REPO / ".venv" / "bin" / "activate").exists():
        e["GLUON_SLURM_SETUP"] = "true"   # the default setup line sources .venv/bin/activate
    return e


@pytest.fixture(scope="session")
def results(tmp_path_factory) -> Path:
    """results_dir of every run here, with the repository's f* cache when it has one."""
    out = tmp_path_factory.mktemp("results")
    (out / "cache").mkdir()
    for f in (REPO / "results" / "cache").glob("fstar-*.json"):
        shutil.copy(f, out / "cache" / f.name)
    return out


def logreg(*args: str) -> list[str]:
    return [PY, "-m", "experiments.logreg", *args]


def run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def tail(text: str, n: int = 4000) -> str:
    """The end of a log, without submitit's sacct warnings (no accounting database here)."""
    lines = [ln for ln in text.splitlines()
             if "sacct" not in ln and "accounting storage is disabled" not in ln]
    return "\n".join(lines)[-n:]


def _all_runs(sweep_dir: Path) -> list[Path]:
    """The run directories under a sweep directory (those with a summary)."""
    return [s.parent for s in sweep_dir.rglob("summary.json") if ".submitit" not in s.parts]


def run_dirs(sweep_dir: Path) -> dict[int, Path]:
    """{seed: run directory} of the runs under a sweep directory."""
    return {summary(d)["config"]["seed"]: d for d in _all_runs(sweep_dir)}


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def submitit_jobs(sweep_dir: Path) -> set[str]:
    """SLURM job ids submitit ran: its job folders, <id> for one job, <array>_<task> for each
    task of an array (the folder <array> itself only holds the sbatch script)."""
    folder = sweep_dir / ".submitit"
    return {p.name for p in folder.iterdir()
            if re.fullmatch(r"\d+(_\d+)?", p.name) and (p / f"{p.name}_submitted.pkl").exists()}


def job_logs(sweep_dir: Path, job: str) -> str:
    return "".join(p.read_text(errors="replace")
                   for p in sorted((sweep_dir / ".submitit" / job).glob("*_log.*")))


def scontrol_job(job: str, env: dict) -> dict:
    out = run(["scontrol", "show", "job", "-o", job], env, 30)
    assert out.returncode == 0, out.stderr
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_job(job: str, env: dict, timeout: float) -> dict:
    """Poll until the job has ended (no `sbatch --wait`: it polls slowly); its scontrol record."""
    t0 = time.time()
    while True:
        info = scontrol_job(job, env)
        if info["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING",
                                    "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"):
            return info
        assert time.time() - t0 < timeout, f"job {job} still {info['JobState']}"
        time.sleep(0.5)


def same(a, b) -> bool:
    """Deep, exact equality of nested state (tensors: same dtype, shape and bits), less the
    measured ``compute_s`` (a clock reading, not the algorithm's state)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(same(a[k], b[k]) for k in a if k != "compute_s"))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def snapshot(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Every result file of a run, bytes and mtime: not the bookkeeping a skipping job
    rewrites (hydra's .hydra/ and job log, the run folder's .lock)."""
    out = {}
    for p in sorted(run_dir.rglob("*")):
        rel = p.relative_to(run_dir)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts) \
                and p.suffix != ".log":
            out[str(rel)] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


# ---------------------------------------------------------------- 1. a sweep as a job array

SWEEP_ARGS = ("launcher=slurm", "method=alg1", f"steps={SWEEP_STEPS}",
              "seed=" + ",".join(map(str, SEEDS)))


@pytest.fixture(scope="module")
def sweep(env, results, tmp_path_factory) -> dict:
    """The 3-seed sweep through hydra-submitit-launcher, once (tests 1 and 3 use it); seed 0
    also runs without SLURM (a plain single run) at the same time, for comparison."""
    tmp = tmp_path_factory.mktemp("sweep")
    args = [*SWEEP_ARGS, f"results_dir={results}", f"hydra.sweep.dir={tmp / 'sweep'}"]
    plain = subprocess.Popen(
        logreg("method=alg1", f"steps={SWEEP_STEPS}", "seed=0", f"results_dir={results}",
               f"hydra.run.dir={tmp / 'plain'}"),
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    out = run(logreg("-m", *args), env, timeout=300)
    wall = time.time() - t0
    plain_out, _ = plain.communicate(timeout=120)
    print(f"\n[slurm] sweep of {len(SEEDS)} runs: {wall:.1f} s")
    return {"args": args, "out": out, "dir": tmp / "sweep", "plain": tmp / "plain",
            "plain_rc": plain.returncode, "plain_out": plain_out, "wall": wall}


def test_sweep_runs_as_a_job_array_and_every_run_is_ok(sweep):
    out = sweep["out"]
    assert out.returncode == 0, tail(out.stdout + out.stderr)
    assert f"{len(SEEDS)} runs: {len(SEEDS)} ok" in out.stdout, tail(out.stdout)
    d = sweep["dir"]
    runs = run_dirs(d)
    assert sorted(runs) == list(SEEDS)
    for seed, r in runs.items():
        s = summary(r)
        assert s["status"] == "ok", s
        assert s["config"]["seed"] == seed and s["config"]["steps"] == SWEEP_STEPS
        assert s["config"]["method"]["name"] == "alg1"
        assert s["steps_done"] == SWEEP_STEPS and s["resumed"] is False
        rows = metrics(r)
        log_every = s["config"]["log_every"]
        assert [row["step"] for row in rows] == list(range(0, SWEEP_STEPS + 1, log_every))
        assert rows[-1] == s["final"]
        assert not (r / "checkpoint.pt").exists()              # deleted once finished
    # one job array, one task per run, each ran (and returned) under SLURM
    jobs = submitit_jobs(d)
    arrays = {j.split("_")[0] for j in jobs if "_" in j}
    assert len(arrays) == 1, jobs
    (array,) = arrays
    tasks = sorted(j for j in jobs if j.startswith(array + "_"))
    assert tasks == [f"{array}_{i}" for i in range(len(SEEDS))]
    for t in tasks:
        assert (d / ".submitit" / t / f"{t}_0_result.pkl").exists()
        assert f"JobEnvironment(job_id={t}," in job_logs(d, t)
    # the launcher is not part of a run's identity: the same run without SLURM is identical
    assert sweep["plain_rc"] == 0, sweep["plain_out"][-3000:]
    plain = sweep["plain"]
    assert metrics_bytes(plain) == metrics_bytes(runs[0])
    assert untimed(summary(plain)["final"]) == untimed(summary(runs[0])["final"])


# ---------------------------------------------------------------- 2. requeue mid-run

REQUEUE_STEPS = 15000     # the requeued run; ~20 s here, far longer than KillWait (5 s)
SHORT_STEPS = 300         # its neighbour in the same job array, left alone


def _overrides(run_dir: Path) -> str:
    """The command-line overrides hydra recorded for a job (the folder's name does not carry
    ``steps``: it is named by the run's identity)."""
    try:
        return (run_dir / ".hydra" / "overrides.yaml").read_text()
    except OSError:
        return ""


def test_requeued_array_task_resumes_and_ends_bit_identical(env, results, tmp_path):
    """`scontrol requeue` on a running task of a submitit job array: SLURM sends SIGTERM (the
    run checkpoints at the end of the step), SIGKILL KillWait later, then starts the task again
    under the same id; it resumes from checkpoint.pt and ends exactly as a run never stopped."""
    common = ["method=alg1", "log_every=50", "checkpoint_every=500", "keep_checkpoint=true",
              "seed=7", f"results_dir={results}"]
    name = f"gluon-requeue-{os.getpid()}"
    ref = subprocess.Popen(logreg(*common, f"steps={REQUEUE_STEPS}",
                                  f"hydra.run.dir={tmp_path / 'ref'}"),
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    sweep_dir = tmp_path / "sweep"
    with open(tmp_path / "sweep.log", "w") as log:       # task 0: the long run, task 1: short
        proc = subprocess.Popen(
            logreg("-m", "launcher=slurm", *common, f"steps={REQUEUE_STEPS},{SHORT_STEPS}",
                   f"hydra.launcher.name={name}", f"hydra.sweep.dir={sweep_dir}"),
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    job = "?"
    try:
        # wait until the long run is running under SLURM and has written a few metric rows
        t0 = time.time()
        rows_file = None
        while True:
            assert proc.poll() is None, tail((tmp_path / "sweep.log").read_text())
            assert time.time() - t0 < 180, "the SLURM job wrote no metrics in 180 s"
            rows_file = rows_file or next(
                (m for m in sweep_dir.rglob("metrics.jsonl")
                 if f"steps={REQUEUE_STEPS}" in _overrides(m.parent)), None)   # the long run
            if rows_file and len(rows_file.read_text().splitlines()) >= 5:
                break
            time.sleep(0.05)
        q = run(["squeue", "-h", "-n", name, "-t", "RUNNING", "-o", "%F_%K"], env, 30)
        job = next(j for j in q.stdout.split() if j.endswith("_0"))      # array task 0
        rows_before = len(rows_file.read_text().splitlines())
        req = run(["scontrol", "requeue", job], env, 30)
        assert req.returncode == 0, req.stderr
        t_requeue = time.time()
        proc.wait(timeout=300)
        t_end = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            run(["scancel", "-n", name], env, 30)
    ref_out, _ = ref.communicate(timeout=300)
    sweep_log = (tmp_path / "sweep.log").read_text()
    print(f"\n[slurm] requeued array task {job} at metric row {rows_before}; the sweep ended "
          f"{t_end - t_requeue:.1f} s later")
    assert proc.returncode == 0, tail(sweep_log)
    assert "2 runs: 2 ok" in sweep_log, tail(sweep_log)
    assert ref.returncode == 0, ref_out[-3000:]

    # SLURM requeued that task exactly once and it completed; its neighbour ran once
    info = scontrol_job(job, env)
    assert info["Restarts"] == "1" and info["JobState"] == "COMPLETED", info
    other = job[:-1] + "1"
    assert scontrol_job(other, env)["Restarts"] == "0"
    logs = job_logs(sweep_dir, job)
    assert logs.count("Starting with JobEnvironment") == 2, logs[-3000:]
    assert "[signal] SIGTERM" in logs                     # checkpointed on SLURM's SIGTERM
    resumed = re.findall(r"\[resume\] .*: from step (\d+) \((\d+) rows\)", logs)
    assert len(resumed) == 1, logs[-3000:]
    step, rows = map(int, resumed[0])
    assert 0 < step < REQUEUE_STEPS and 0 < rows          # mid-run

    runs = {summary(d)["config"]["steps"]: d for d in _all_runs(sweep_dir)}
    assert sorted(runs) == [SHORT_STEPS, REQUEUE_STEPS]
    short = summary(runs[SHORT_STEPS])
    assert short["status"] == "ok" and short["resumed"] is False
    run_dir = runs[REQUEUE_STEPS]
    s, r = summary(run_dir), summary(tmp_path / "ref")
    assert s["status"] == r["status"] == "ok"
    assert s["resumed"] is True and r["resumed"] is False
    assert rows_before < len(metrics(run_dir))
    # bit-identical to the uninterrupted run: every metric row, the final state
    assert metrics_bytes(run_dir) == metrics_bytes(tmp_path / "ref")
    for key in ("steps_done", "comm", "bytes"):
        assert s[key] == r[key], key
    assert untimed(s["final"]) == untimed(r["final"])
    a = torch.load(run_dir / "checkpoint.pt", weights_only=False)          # keep_checkpoint
    b = torch.load(tmp_path / "ref" / "checkpoint.pt", weights_only=False)
    assert same(a["method"], b["method"]) and a["rows"] == b["rows"]


# ---------------------------------------------------------------- 3. re-running a finished sweep

def test_rerun_of_finished_sweep_submits_and_recomputes_nothing(sweep, env):
    assert sweep["out"].returncode == 0, tail(sweep["out"].stdout)
    d = sweep["dir"]
    runs = run_dirs(d)
    before = {seed: snapshot(r) for seed, r in runs.items()}
    assert all({"summary.json", "metrics.jsonl"} <= set(s) for s in before.values())
    jobs_before = submitit_jobs(d)
    t0 = time.time()
    out = run(logreg("-m", *sweep["args"]), env, timeout=300)
    wall = time.time() - t0
    assert out.returncode == 0, tail(out.stdout + out.stderr)
    assert f"{len(SEEDS)} runs: {len(SEEDS)} ok" in out.stdout, tail(out.stdout)
    # no run recomputed: every result file byte-identical and not rewritten (same mtime)
    assert run_dirs(d) == runs
    assert {seed: snapshot(r) for seed, r in runs.items()} == before
    # nothing submitted: the sweeper found every run finished before launching
    assert submitit_jobs(d) == jobs_before
    assert out.stdout.count("already finished with this config") == len(SEEDS), tail(out.stdout)
    print(f"\n[slurm] re-run: {wall:.1f} s, nothing submitted")


# ---------------------------------------------------------------- 4. torch.distributed via srun

DIST_OVERRIDES = ["method=alg1", "compressor=randk", "compressor.density=0.01", "method.q=0.3",
                  "method.B=4", "steps=200", "seed=0"]


def test_torch_distributed_job_through_srun(env, results, tmp_path):
    """scripts/cluster/slurm_dist.sbatch on 2 tasks: SLURM starts the 2 ranks itself (srun, one task per
    worker, no torchrun) running `python -m experiments.logreg comm=torchdist`; the run equals
    the 2-worker simulation of the same config (with 2 workers even the dense all_reduce rounds
    are exact: every metric row is identical)."""
    dist, sim = tmp_path / "dist", tmp_path / "sim"
    common = [*DIST_OVERRIDES, f"results_dir={results}"]
    sub = run(["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
               "--cpus-per-task=1", "--time=10", f"--output={tmp_path / 'dist-%j.out'}",
               "scripts/cluster/slurm_dist.sbatch", *common, f"hydra.run.dir={dist}"],
              {**env, "PY": PY}, 60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    info = wait_job(job, env, timeout=240)
    log = (tmp_path / f"dist-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log[-3000:])
    assert info["NumTasks"] == "2", info
    ref = run(logreg("n_workers=2", *common, f"hydra.run.dir={sim}"), env, 120)
    assert ref.returncode == 0, tail(ref.stdout + ref.stderr)
    d, s = summary(dist), summary(sim)
    assert d["status"] == s["status"] == "ok"
    wire = d["wire"]                                      # what went over the processes' wire
    assert wire["processes"] == 2 and wire["backend"] == "gloo", wire
    assert wire["measured_bytes_per_worker"] == [s["bytes"]] * 2        # measured == ledger
    for key in ("steps_done", "comm", "bytes"):
        assert d[key] == s[key], key
    assert untimed(d["final"]) == untimed(s["final"])
    assert metrics_bytes(dist) == metrics_bytes(sim)


# ---------------------------------------------------------------- 5. the launcher, one task per worker

def test_sweep_with_torchdist_runs_one_slurm_task_per_worker(env, results, tmp_path):
    """`-m launcher=slurm comm=torchdist n_workers=2`: the launcher config asks for one SLURM
    task per worker (tasks_per_node = n_workers), each task is one rank, and every run of the
    sweep equals its 2-worker simulation row for row."""
    common = ["method=alg2", "compressor=topk", "compressor.density=0.05", "method.q=0.5",
              "method.B=2", "steps=120", "log_every=20", "n_workers=2",
              "dense_collective=all_gather", f"results_dir={results}"]
    out = run(logreg("-m", "launcher=slurm", "comm=torchdist", *common, "seed=0,1",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}"), env, timeout=300)
    assert out.returncode == 0, tail(out.stdout + out.stderr)
    assert "2 runs: 2 ok" in out.stdout, tail(out.stdout)
    for seed, run_dir in run_dirs(tmp_path / "sweep").items():
        d = summary(run_dir)
        assert d["config"]["comm"] == "torchdist" and d["wire"]["processes"] == 2, d.get("wire")
        sim = tmp_path / f"sim{seed}"
        ref = run(logreg(*common, f"seed={seed}", f"hydra.run.dir={sim}"), env, 120)
        assert ref.returncode == 0, tail(ref.stdout + ref.stderr)
        assert metrics_bytes(run_dir) == metrics_bytes(sim)
        assert (run_dir / "logreg.log").read_text().count("[start]") == 1   # rank 0 logs
