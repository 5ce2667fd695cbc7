"""The command line as a user meets it: one-line errors before any folder, the per-run log with
its progress lines, one writer per run folder, --help, and experiment=NAME without a '+'."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.shared.runs import LOCK, is_locked
from experiments.shared.runs import read_rows, read_summary, shown
from experiments.run.sweep import run_status, sbatch_script
from tests.conftest import CONFIGS, REPO, compose_config, entry_point_of

ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}


def cli(entry: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"experiments.{entry}", *args], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- one-line errors

BAD = [
    ("logreg", ["steps=abc"], "steps=abc", "Integer"),
    ("logreg", ["task.heterogeneity=dirichlet"], "dirichlet", "iid, label_skew"),
    ("cnn", ["task.heterogeneity=dirichlet"], "dirichlet", "iid, label_skew"),
    ("logreg", ["method.lr=-1"], "method=alg1", "lr must be > 0"),
    ("logreg", ["compressor.density=2"], "compressor=randk", "(0, 1]"),
    ("logreg", ["n_workers=0"], "n_workers=0", ">= 1"),
    ("logreg", ["method=alg9"], "method/alg9", "alg1, alg2"),
    ("logreg", ["stepz=3"], "stepz", ""),
    ("cnn", ["task.widths=[16,64]"], "task.widths", "three positive"),
    ("cnn", ["eval_every=15", "log_every=10"], "eval_every", "multiple of log_every"),
    ("cnn", ["device=gpu"], "device=gpu", "auto, cpu, cuda or cuda:<index>"),
    ("cnn", ["device=cuda:"], "device=cuda:", "auto, cpu, cuda or cuda:<index>"),
    ("cnn", ["device=cuda:99"], "device=cuda:99", "no such CUDA device"),
    ("logreg", ["-m", "method.lr=0.01,-1"], "lr must be > 0", "method.lr=-1"),   # one bad job
    ("logreg", ["method.lr=inf"], "method=alg1", "lr must be > 0 and finite"),
    ("logreg", ["method.lr=nan"], "method=alg1", "lr must be > 0 and finite"),
    ("logreg", ["+stpes=500"], "+stpes", "did you mean steps?"),       # hydra's own advice
    ("logreg", ["+task.l3=0.1"], "+task.l3", "no such key"),
    ("cnn", ["+task.widht=3"], "+task.widht", "did you mean task.width"),
    ("logreg", ["-m", "seed=0,1", "+stpes=5"], "+stpes", "no such key"),
    ("logreg", ["tuned=fig2_logreg/nope"], "tuned=fig2_logreg/nope", "fig2_logreg/alg1, "),
]


# Most cases are refused by the command's check, before hydra starts: in this process, through
# the entry point's main(argv). Those in PROCESS start python as a user does: two of the check's
# cases, and the sweeps, whose bad job or key only hydra's sweeper sees.
PROCESS = {"steps=abc", "device=gpu", "-m method.lr=0.01,-1", "-m seed=0,1 +stpes=5"}


def refusal(entry: str, args: list[str], tmp_path: Path, capsys,
            monkeypatch) -> subprocess.CompletedProcess:
    """The command ``entry args`` into folders under ``tmp_path``: exit status, stdout, stderr."""
    args = [*args, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sw'}",
            f"results_dir={tmp_path / 'res'}"]
    if " ".join(args[:-3]) in PROCESS:
        return cli(entry, *args)
    import importlib

    from experiments.run import command_line

    def hydra_starts(composed):
        raise AssertionError(f"{args}: the check let it through to hydra")
    monkeypatch.setattr(command_line, "_mode_known", hydra_starts)
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(f"experiments.{entry}").main(args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, stop.value.code, out, err)


@pytest.mark.parametrize("entry,args,names,allowed", BAD,
                         ids=[" ".join(a) for _, a, _, _ in BAD])
def test_bad_config_is_one_line_exit_2_and_leaves_no_folder(tmp_path, capsys, monkeypatch,
                                                            entry, args, names, allowed):
    p = refusal(entry, args, tmp_path, capsys, monkeypatch)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), p.stderr
    assert names in p.stderr and allowed in p.stderr
    assert "Traceback" not in p.stderr and not p.stdout.strip()
    assert not list(tmp_path.iterdir())                  # no run folder, no sweep, no cache


def test_help_lists_the_groups_and_keys():
    p = cli("logreg", "--help")
    assert p.returncode == 0
    for text in ("method: ", "alg1", "compressor: ", "experiment: ", "fig3", "max_comm",
                 "log_comm", "comm: sim"):
        assert text in p.stdout, text


# ---------------------------------------------------------------- experiment=NAME, folder names

def test_experiment_is_selected_without_plus_and_names_the_sweep():
    cfg = compose_config("logreg", "experiment=fig3", hydra=True)
    assert cfg.group == "fig3" and cfg.hydra.sweep.dir == "results/sweeps/fig3"
    assert cfg.hydra.sweeper.params["method.q"] == "1.0,0.1,0.01"


@pytest.mark.parametrize("name", sorted(str(p.relative_to(CONFIGS / "experiment").with_suffix(""))
                                        for p in (CONFIGS / "experiment").rglob("*.yaml")
                                        if not p.name.startswith("_")))
def test_sbatch_preview_works_for_every_experiment(name):
    primary = entry_point_of(name)
    cnn = primary == "cnn"
    script = sbatch_script(primary,
                           ["launcher=slurm_gpu" if cnn else "launcher=slurm", f"experiment={name}"])
    assert "#SBATCH --array=0-" in script
    assert ("#SBATCH --gpus-per-node=1" in script) == cnn


# ---------------------------------------------------------------- logging and progress

def test_run_logs_start_progress_and_end_into_its_log_file(tmp_path, results_with_cache):
    run_dir = tmp_path / "run"
    p = cli("logreg", "steps=4000", "log_every=500", "progress_s=0.05", "checkpoint_every=0",
            f"results_dir={results_with_cache}", f"hydra.run.dir={run_dir}")
    assert p.returncode == 0, p.stderr
    log = (run_dir / "logreg.log").read_text()
    lines = log.splitlines()
    assert lines[0].split("] ", 1)[1].startswith(f"[start] {run_dir}: alg1 (")
    assert "randk (density=0.01) on logreg (a5a), 4 workers (sim), seed 0, 4000 steps" in lines[0]
    progress = [ln for ln in lines if "steps/s" in ln]
    assert progress, log
    for ln in progress:                                   # step, uplink, f - f*, rate, time left
        assert "/4000 | uplink " in ln and " | f - f* " in ln and " left" in ln
    assert lines[-1].split("] ", 1)[1].startswith(f"[ok] {run_dir}: 4000 steps")
    assert "\r" not in log and "\x1b" not in log          # plain lines, no bar characters
    assert "[start]" in p.stdout                           # and the console has the same lines


def test_a_progress_line_shows_a_slow_rate_not_zero_or_one():
    """The paper's CNN on a CPU makes about half a step a second: '%.0f' printed 0 or 1."""
    from experiments.run.record import _rate
    assert [_rate(r) for r in (0.0042, 0.47, 3.14, 17.3, 250.4)] == \
        ["0.0042", "0.47", "3.1", "17", "250"]


# ---------------------------------------------------------------- one writer per run folder

def test_a_second_writer_waits_then_skips(tmp_path, results_with_cache):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "experiments.logreg", "method=alg2", "steps=6000",
            "log_every=100", "checkpoint_every=0", f"results_dir={results_with_cache}",
            f"hydra.run.dir={run_dir}"]
    first = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while not (run_dir / "metrics.jsonl").exists():
        assert first.poll() is None and time.time() - t0 < 60
        time.sleep(0.02)
    assert is_locked(run_dir) and run_status(run_dir) == "running"
    first.send_signal(signal.SIGSTOP)                     # hold the lock while the second starts
    try:
        second = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        said = ""
        while "waiting" not in said:                      # the second writer waits ...
            line = second.stdout.readline()
            assert line, said
            said += line
    finally:
        first.send_signal(signal.SIGCONT)                 # ... until the first one is done
    out_first, _ = first.communicate(timeout=300)
    said += second.communicate(timeout=300)[0]
    assert first.returncode == 0 and second.returncode == 0, out_first + said
    assert f"{run_dir} is being written by pid" in said and "waiting" in said and "[skip]" in said
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(0, 6001, 100))   # one writer: no row twice
    assert read_summary(run_dir)["status"] == "ok"
    assert not is_locked(run_dir) and (run_dir / LOCK).exists()
    assert run_status(run_dir) == "ok"


def test_a_log_names_a_run_folder_inside_the_working_directory_relative_to_it(tmp_path,
                                                                             monkeypatch):
    """A run's log is committed with its results: it must not hold the writing machine's paths."""
    monkeypatch.chdir(tmp_path)
    assert shown(tmp_path / "results" / "sweeps" / "run") == "results/sweeps/run"
    assert shown(Path("results/run")) == "results/run"
    outside = tmp_path.parent / "elsewhere"
    assert shown(outside) == str(outside)         # outside it, the whole path says where


def test_two_submissions_of_one_sweep_run_each_config_once(tmp_path, results_with_cache):
    """The same sweep started twice at once: every run folder has one writer; both commands
    end with every run finished, and each run's rows are written once."""
    args = [sys.executable, "-m", "experiments.logreg", "-m", "method=alg1,alg2", "steps=3000",
            "log_every=100", "checkpoint_every=0", f"results_dir={results_with_cache}",
            f"hydra.sweep.dir={tmp_path}"]
    procs = [subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        assert "[sweep] " in out and "2 runs: 2 ok" in out
    said = "".join(outs)
    assert said.count("[start]") == 2          # each config computed once, by one of the two
    assert said.count("[skip]") == 2           # ... and skipped by the other
    for run_dir in (tmp_path / "alg1", tmp_path / "alg2"):
        (run,) = [d for d in run_dir.iterdir() if d.is_dir()]
        assert [r["step"] for r in read_rows(run)] == list(range(0, 3001, 100))
        assert read_summary(run)["status"] == "ok"


def test_a_sweep_launches_only_the_runs_not_finished(tmp_path, results_with_cache):
    """The sweeper composes every job and hands the launcher only the unfinished ones: a
    re-run launches nothing, a grown grid launches only its new points."""
    def sweep(*grid):
        return subprocess.run([sys.executable, "-m", "experiments.logreg", "-m", *grid,
                               "steps=200", "log_every=100", f"results_dir={results_with_cache}",
                               f"hydra.sweep.dir={tmp_path}"], cwd=REPO, env=ENV,
                              capture_output=True, text=True, timeout=300)
    first = sweep("seed=0,1")
    assert first.returncode == 0 and first.stdout.count("[start]") == 2, first.stdout
    again = sweep("seed=0,1")
    assert again.returncode == 0 and "Launching" not in again.stdout + again.stderr
    assert again.stdout.count("[skip]") == 2 and "2 runs: 2 ok" in again.stdout, again.stdout
    grown = sweep("seed=0,1,2")
    assert grown.stdout.count("[skip]") == 2 and grown.stdout.count("[start]") == 1
    assert "#0 : seed=2" in grown.stdout + grown.stderr            # the only job launched
    assert "3 runs: 3 ok" in grown.stdout
