"""Runs that survive preemption: checkpoint, kill, resume, and get exactly the same run.

The realistic tests start ``python -m experiments.logreg`` as a subprocess, kill it (SIGTERM:
checkpoint at the next step boundary, then exit; SIGKILL: nothing saved beyond the last
periodic checkpoint, rows written after it are dropped) once its first checkpoint exists, start
it again, and compare with an uninterrupted run: metrics.jsonl byte for byte, and the final
parameters, momentum and estimator bit for bit.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from experiments.run import lifecycle as runner
from experiments.run.checkpoint import SignalGuard
from experiments.shared.runs import CHECKPOINT
from experiments.run.config import validate
from experiments.tasks import logreg as task
from experiments.tasks.logreg import build
from experiments.shared.runs import read_summary
from experiments.run.lifecycle import execute
from experiments.shared.errors import EnvironmentProblem
from tests.conftest import compose_config, metrics_bytes, stopping_train, untimed

from experiments.shared.files import REPO
ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "WANDB_SILENT": "true",
       "HYDRA_FULL_ERROR": "1"}
COMMON = ["steps=600", "log_every=10", "checkpoint_every=100", "keep_checkpoint=true"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A results_dir whose f* cache is filled before any run starts (copied from the repo's
    cache when it has the entry, else computed once), so that concurrent runs do not each
    solve for f*."""
    out = tmp_path_factory.mktemp("results")
    (out / "cache").mkdir()
    for f in (REPO / "results" / "cache").glob("fstar-*.json"):
        shutil.copy(f, out / "cache" / f.name)
    cfg = config(f"results_dir={out}")
    build(cfg, validate(cfg))
    return out


def config(*overrides):
    return compose_config("logreg", *overrides)


def final_state(run_dir: Path) -> dict:
    return torch.load(run_dir / CHECKPOINT, weights_only=False)["method"]


def assert_same_run(a: Path, b: Path):
    assert metrics_bytes(a) == metrics_bytes(b)
    sa, sb = read_summary(a), read_summary(b)
    assert sa["status"] == sb["status"] == "ok"
    assert untimed(sa["final"]) == untimed(sb["final"]) and sa["comm"] == sb["comm"]
    ma, mb = final_state(a), final_state(b)
    assert ma["k"] == mb["k"]
    for key in ("params", "prev", "g", "M"):
        for x, y in zip(ma[key], mb[key]):
            assert torch.equal(x, y), key
    for wa, wb in zip(ma["workers"], mb["workers"]):
        assert torch.equal(wa["gen"], wb["gen"])
        for key in wa["state"]:
            assert all(torch.equal(x, y) for x, y in zip(wa["state"][key] or [],
                                                         wb["state"][key] or []))
    assert ma["comm"] == mb["comm"]


def rows(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count("\n")
    except OSError:
        return 0


def _start(run_dir: Path, overrides):
    cmd = [sys.executable, "-m", "experiments.logreg", *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _interrupt(proc, run_dir: Path, sig, timeout=90.0):
    """Wait for the first checkpoint (and, for SIGKILL, rows logged after it), then signal."""
    t0 = time.time()
    while not (run_dir / CHECKPOINT).exists():
        assert proc.poll() is None, f"run ended before its first checkpoint:\n{proc.stdout.read()}"
        assert time.time() - t0 < timeout, "no checkpoint appeared"
        time.sleep(0.01)
    if sig == signal.SIGKILL:
        first = rows(run_dir)
        while rows(run_dir) < first + 2 and proc.poll() is None:
            time.sleep(0.005)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


@pytest.mark.parametrize("algorithm,sig", [
    (["method=alg2", "compressor=topk"], signal.SIGTERM),
    (["method=alg1", "compressor=randk"], signal.SIGKILL),
], ids=["alg2-topk-SIGTERM", "alg1-randk-SIGKILL"])
def test_killed_run_resumes_bit_identically(tmp_path, results, algorithm, sig):
    overrides = [*algorithm, *COMMON, f"results_dir={results}"]
    ref = tmp_path / "ref"
    run_dir = tmp_path / "interrupted"
    proc = _start(run_dir, overrides)                 # the interrupted run starts first ...
    execute(config(*overrides), ref, task)           # ... while the reference runs here
    code, out = _interrupt(proc, run_dir, sig)
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig), out
    assert read_summary(run_dir) is None              # not finished: no summary
    k = torch.load(run_dir / CHECKPOINT, weights_only=False)["method"]["k"]
    assert 0 < k < 600

    done = subprocess.run([sys.executable, "-m", "experiments.logreg", *overrides,
                           f"hydra.run.dir={run_dir}"], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"[resume] {run_dir}: from step {k} " in done.stdout
    assert_same_run(ref, run_dir)
    assert read_summary(run_dir)["resumed"] is True


def _interrupt_at(monkeypatch, step):
    """Make train() raise KeyboardInterrupt right after ``step`` (an in-process kill)."""
    real = runner.train
    monkeypatch.setattr(runner, "train", stopping_train(real, step))
    return real


def test_in_process_interrupt_resume_and_config_change(tmp_path, results, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="experiments")
    overrides = ["method=alg1", "steps=400", "log_every=10", "checkpoint_every=100",
                 "keep_checkpoint=true", f"results_dir={results}"]
    execute(config(*overrides), tmp_path / "ref", task)
    real = _interrupt_at(monkeypatch, 250)           # after the checkpoint at 200
    with pytest.raises(KeyboardInterrupt):
        execute(config(*overrides), tmp_path / "run", task)
    assert read_summary(tmp_path / "run") is None and rows(tmp_path / "run") == 26
    monkeypatch.setattr(runner, "train", real)
    execute(config(*overrides), tmp_path / "run", task)
    assert "[resume]" in caplog.text
    assert_same_run(tmp_path / "ref", tmp_path / "run")
    # a finished run is skipped, whatever the checkpoint interval
    execute(config(*overrides[:-3], "checkpoint_every=7", f"results_dir={results}"),
            tmp_path / "run", task)
    assert "[skip]" in caplog.text

    # a checkpoint written with another config is refused, and with overwrite=true not used
    _interrupt_at(monkeypatch, 250)
    with pytest.raises(KeyboardInterrupt):
        execute(config(*overrides), tmp_path / "other", task)
    caplog.clear()
    monkeypatch.setattr(runner, "train", real)
    with pytest.raises(EnvironmentProblem, match=r"holds the checkpoint of another run "
                       r"\(method.lr: 0.02 here, 0.01 there\)"):
        execute(config(*overrides, "method.lr=0.02"), tmp_path / "other", task)
    assert rows(tmp_path / "other") == 26
    execute(config(*overrides, "method.lr=0.02", "overwrite=true"), tmp_path / "other", task)
    out = caplog.text
    assert "[resume]" not in out and "starting over" in out
    assert json.loads((tmp_path / "other" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 400


def test_failed_run_is_recorded_and_rerun_from_scratch(tmp_path, results):
    overrides = ["method=alg1", "steps=300", "log_every=10", "checkpoint_every=100",
                 f"results_dir={results}"]

    def broken(cfg, compressor, world=None):
        built = build(cfg, compressor, world)

        def bad(m):
            if m.k >= 150:
                raise RuntimeError("boom")
            return built.evaluate(m)
        return built._replace(evaluate=bad)

    with pytest.raises(RuntimeError, match="boom"):
        execute(config(*overrides), tmp_path, SimpleNamespace(check=task.check, build=broken))
    s = read_summary(tmp_path)
    assert s["status"] == "failed" and "boom" in s["error"]
    assert not (tmp_path / CHECKPOINT).exists()      # a failure starts over
    summary = execute(config(*overrides), tmp_path, task)
    assert summary["status"] == "ok" and summary["resumed"] is False


def test_signal_guard_defers_and_forwards(monkeypatch):
    calls = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: calls.append(s))
    try:
        with SignalGuard() as guard:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert guard.pending == signal.SIGUSR1 and calls == []   # deferred
            guard.forward()                                          # the old handler runs
            assert calls == [signal.SIGUSR1] and guard.pending is None
            os.kill(os.getpid(), signal.SIGUSR1)                     # guard installed again
            assert guard.pending == signal.SIGUSR1
            guard.pending = None
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        with SignalGuard() as guard:                                 # default action: exit
            os.kill(os.getpid(), signal.SIGUSR1)
            with pytest.raises(SystemExit) as exit_:
                guard.forward()
            assert exit_.value.code == 128 + signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_resume_with_rows_aligned_on_uplink_is_bit_identical(tmp_path, results, monkeypatch):
    """log_comm rows (Fig. 2's logging) survive an interruption: the resumed run writes the
    same rows as an uninterrupted one, none missing, none twice."""
    overrides = ["method=alg1", "steps=400", "log_every=0", "log_comm=0.5", "checkpoint_every=100",
                 "keep_checkpoint=true", f"results_dir={results}"]
    execute(config(*overrides), tmp_path / "ref", task)
    real = _interrupt_at(monkeypatch, 250)
    with pytest.raises(KeyboardInterrupt):
        execute(config(*overrides), tmp_path / "run", task)
    monkeypatch.setattr(runner, "train", real)
    execute(config(*overrides), tmp_path / "run", task)
    assert_same_run(tmp_path / "ref", tmp_path / "run")
    assert rows(tmp_path / "ref") > 20


# ---------------------------------------------------------------- extending a finished run

EXTEND = ["steps=2000", "log_every=0", "log_comm=0.5", "checkpoint_every=0"]


@pytest.mark.parametrize("algorithm", [["method=alg2", "compressor=topk"],
                                       ["method=alg1", "compressor=randk"]], ids=["alg2", "alg1"])
def test_a_run_extended_from_its_shorter_twin_equals_the_run_made_in_one_go(
        tmp_path, results, algorithm, caplog):
    """extend_from: a run on a larger uplink budget starts from the final state of the same run
    on a smaller one (its rows copied) and ends bit for bit where the run made from step 0 ends;
    its summary names the twin. The budget is the only key allowed to differ."""
    base = [*algorithm, *EXTEND, f"results_dir={results}"]
    short = tmp_path / "sweep" / "short"
    execute(config(*base, "max_comm=10", "keep_checkpoint=true"), short, task)
    execute(config(*base, "max_comm=25", "keep_checkpoint=true"), tmp_path / "ref", task)
    # another run in the folder (another seed) is not this run's twin
    execute(config(*base, "max_comm=10", "keep_checkpoint=true", "seed=7"),
            tmp_path / "sweep" / "other", task)
    caplog.set_level(logging.INFO, logger="experiments.run")
    execute(config(*base, "max_comm=25", "keep_checkpoint=true",
                   f"extend_from={tmp_path / 'sweep'}"), tmp_path / "long", task)
    assert_same_run(tmp_path / "ref", tmp_path / "long")
    s = read_summary(tmp_path / "long")
    assert s["extended_from"] == str(short) and s["resumed"] is True
    k_short = read_summary(short)["steps_done"]
    assert 0 < k_short < s["steps_done"]
    assert f"from {short} at step {k_short}" in caplog.text
    assert (tmp_path / "long" / "metrics.jsonl").read_bytes().startswith(
        (short / "metrics.jsonl").read_bytes())


def test_a_twin_that_is_not_a_prefix_is_passed_over_and_the_run_starts_from_step_0(
        tmp_path, results, caplog):
    """No final checkpoint, a budget that is not a multiple of log_comm (its last row is one the
    longer run does not log), or another setting: the run starts from step 0, says why, and is
    still the run made in one go."""
    base = ["method=alg1", "compressor=randk", *EXTEND, f"results_dir={results}"]
    sweep = tmp_path / "sweep"
    execute(config(*base, "max_comm=10"), sweep / "no_checkpoint", task)
    execute(config(*base, "max_comm=10.3", "keep_checkpoint=true"), sweep / "off_grid", task)
    execute(config(*base, "max_comm=10", "keep_checkpoint=true", "method.lr=0.5"),
            sweep / "other_lr", task)
    execute(config(*base, "max_comm=20"), tmp_path / "ref", task)
    caplog.set_level(logging.INFO, logger="experiments.run")
    execute(config(*base, "max_comm=20", f"extend_from={sweep}"), tmp_path / "long", task)
    assert metrics_bytes(tmp_path / "ref") == metrics_bytes(tmp_path / "long")
    s = read_summary(tmp_path / "long")
    assert s["extended_from"] is None and s["resumed"] is False
    assert "no final checkpoint" in caplog.text
    assert "not one this run logs" in caplog.text
    assert "other_lr" not in caplog.text          # another run: not a candidate at all


# A checkpoint an earlier version wrote before the library's state held a count from step 0
# (experiments.run.migrate.checkpoint_gap): each written as it would have been.
def _without_grads(m):
    for w in m["workers"]:
        del w["grads"]


def _without_traffic(m):
    from gluon.comm import TRAFFIC
    for key in TRAFFIC:
        del m["comm"]["ledger"][key]


def _without_compute_s(m):
    del m["compute_s"]


EARLIER = {"grads": _without_grads, "up_bytes": _without_traffic, "compute_s": _without_compute_s}


def test_a_checkpoint_of_an_earlier_version_is_refused_never_resumed_with_counts_from_zero(
        tmp_path, results, monkeypatch, caplog):
    """Resuming such a checkpoint would restart its counts at 0 at its step (the rows would log
    them wrong from then on): the run wing says what the checkpoint lacks and the run starts over,
    equal to the run made in one go; the library, handed such a state, refuses it."""
    from experiments.run.migrate import checkpoint_gap
    from experiments.run.checkpoint import load_checkpoint
    from gluon import make_compressor, simulate
    from gluon.worker import Worker
    overrides = ["method=alg1", "steps=300", "log_every=10", "checkpoint_every=100",
                 "keep_checkpoint=true", f"results_dir={results}"]
    execute(config(*overrides), tmp_path / "ref", task)
    current = torch.load(tmp_path / "ref" / CHECKPOINT, weights_only=False)
    assert checkpoint_gap(current) is None
    for key, strip in EARLIER.items():
        old = torch.load(tmp_path / "ref" / CHECKPOINT, weights_only=False)
        strip(old["method"])
        assert key in checkpoint_gap(old), key

    real = _interrupt_at(monkeypatch, 150)           # after the checkpoint at 100
    with pytest.raises(KeyboardInterrupt):
        execute(config(*overrides), tmp_path / "run", task)
    path = tmp_path / "run" / CHECKPOINT
    saved = torch.load(path, weights_only=False)
    assert saved["method"]["k"] == 100
    _without_grads(saved["method"])
    torch.save(saved, path)
    caplog.set_level(logging.INFO, logger="experiments")
    assert load_checkpoint(path) is None
    assert "written by an earlier version, without the workers' gradient count" in caplog.text
    monkeypatch.setattr(runner, "train", real)
    summary = execute(config(*overrides), tmp_path / "run", task)
    assert "[resume]" not in caplog.text and summary["resumed"] is False
    assert_same_run(tmp_path / "ref", tmp_path / "run")

    # the library loads only what it writes: a worker's state without its count is refused
    worker = Worker(0, None, seed=0)
    with pytest.raises(KeyError, match="grads"):
        worker.load_state_dict({k: v for k, v in worker.state_dict().items() if k != "grads"})
    method = simulate("gluon", [torch.zeros(3)], [None], compressor=make_compressor("identity"),
                      lr=0.1)
    state = method.state_dict()
    _without_traffic(state)
    with pytest.raises(KeyError, match="up_bytes"):
        method.load_state_dict(state)
