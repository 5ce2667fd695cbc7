"""What a hostile tester tries: races between runs, damaged files, absurd data, a fresh machine
without data or network, signals, and optimiser states that do not fit. Every case is listed,
with the test that tries it, in docs/reliability.md (the last test here checks that list).

The command-line cases start ``python -m experiments.logreg`` as a user would and check what is
left on disk afterwards, not only the exit status.
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

from experiments.run.runs import read_rows, read_summary, status as run_status
from tests.conftest import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
ENV.pop("GLUON_DATA_DIR", None)


def cli(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.logreg", *args], cwd=REPO,
                          env={**ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def refused(p: subprocess.CompletedProcess, code: int = 2) -> list[str]:
    """The lines of a refusal: exit status ``code``, one or two lines on stderr, the first
    ``error: ...``, no traceback."""
    lines = p.stderr.strip().splitlines()
    assert p.returncode == code, p.stdout + p.stderr
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    return lines


def tree(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` with its bytes (what "intact" compares), less the lock file,
    which names the last process that held it."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(Path(folder).rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def results(results_with_cache):
    return results_with_cache


# ---------------------------------------------------------------- 1. two runs, one folder

def _lock_holder(run_dir: Path, procs, timeout: float = 60.0) -> int:
    """The pid that holds ``run_dir``'s lock, stopped (SIGSTOP) the moment it is seen to hold it."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            text = (run_dir / ".lock").read_text()
        except OSError:
            text = ""
        if text.startswith("pid "):
            pid = int(text.split()[1])
            os.kill(pid, signal.SIGSTOP)
            return pid
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.001)
    raise AssertionError("no process took the run folder's lock")


def test_two_configs_started_together_in_one_folder_never_delete_the_finished_run(tmp_path,
                                                                                 results):
    """Two runs of different configs given one hydra.run.dir, started together: the one that
    gets the folder first runs; the other waits, then is refused in one or two lines and
    removes nothing. The first holder is stopped while it holds the lock (before it has written
    a row), so the second reaches the folder while it looks new: the race of issue 50."""
    run_dir = tmp_path / "run"
    procs = {seed: subprocess.Popen(
        [sys.executable, "-m", "experiments.logreg", "steps=2000", f"seed={seed}",
         "log_every=100", "checkpoint_every=0", f"results_dir={results}",
         f"hydra.run.dir={run_dir}"], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for seed in (51, 52)}
    holder = _lock_holder(run_dir, procs.values())
    try:
        time.sleep(6)                       # the other one starts and reaches the folder
    finally:
        os.kill(holder, signal.SIGCONT)
    out = {seed: p.communicate(timeout=300) for seed, p in procs.items()}
    (winner,) = [s for s, p in procs.items() if p.pid == holder]
    (loser,) = [s for s in procs if s != winner]
    assert procs[winner].returncode == 0, out[winner]
    loss = subprocess.CompletedProcess([], procs[loser].returncode, *out[loser])
    lines = refused(loss)
    assert "holds another run" in lines[0] and f"seed: {loser} here, {winner} there" in lines[0]
    assert run_dir.is_dir(), "the finished run's folder was deleted"
    summary = read_summary(run_dir)
    assert summary["status"] == "ok" and summary["seed"] == winner
    assert run_status(run_dir) == "ok"            # metrics.jsonl is the file the summary describes
    assert [r["step"] for r in read_rows(run_dir)] == list(range(0, 2001, 100))
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert f"seed={winner}" in overrides and f"seed={loser}" not in overrides
    assert f"seed {loser}" not in (run_dir / "logreg.log").read_text()


# ---------------------------------------------------------------- 4. a damaged summary

@pytest.mark.parametrize("damage", ["truncated", "not json", "no config"])
def test_a_damaged_summary_is_never_overwritten_by_another_config(tmp_path, results, damage):
    run_dir = tmp_path / "run"
    common = ["steps=200", "log_every=50", "checkpoint_every=0", f"results_dir={results}",
              f"hydra.run.dir={run_dir}"]
    assert cli(*common, "seed=21").returncode == 0
    summary = run_dir / "summary.json"
    text = summary.read_text()
    summary.write_text({"truncated": text[:len(text) // 2], "not json": "\x00\x01garbage",
                        "no config": json.dumps({"status": "ok"})}[damage])
    before = tree(run_dir)
    lines = refused(cli(*common, "seed=22"))
    assert "damaged" in lines[0] and "summary.json" in lines[0], lines
    assert "overwrite=true" in lines[-1]
    assert tree(run_dir) == before                 # not a byte changed, nothing added
    again = cli(*common, "seed=21")                # the run's own config: recomputed
    assert again.returncode == 0, again.stderr
    assert read_summary(run_dir)["seed"] == 21 and run_status(run_dir) == "ok"
