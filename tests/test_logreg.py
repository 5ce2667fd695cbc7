"""The a5a task end to end: data loading, f*, the CLI, bad input, determinism, skip/replace."""
from __future__ import annotations

import logging

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from experiments.tasks import DataNotFoundError, libsvm_file
from experiments.logreg import run
from experiments.tasks.logreg import (LogRegOracle, load_libsvm, objective, solve_f_star, split)
from experiments.shared.runs import read_rows
from experiments.shared.errors import EnvironmentProblem
from tests.conftest import compose_config, untimed

from experiments.shared.files import REPO
CONFIGS = str(REPO / "configs")


def _a5a():
    try:
        return libsvm_file("a5a", download=False)
    except DataNotFoundError as err:  # a clear failure, never a silent skip
        pytest.fail(f"a5a is needed for these tests: {err}")


@pytest.fixture(scope="module")
def a5a():
    return load_libsvm(_a5a())


def cfg(*overrides, tmp=None):
    c = compose_config("logreg", *overrides)
    if tmp is not None:
        c.results_dir = str(tmp)
    return c


def test_a5a_shape_and_labels(a5a):
    A, b = a5a
    assert A.shape == (6414, 124)          # 123 features + the bias column
    assert int((b > 0).sum()) == 1569
    assert set(b.unique().tolist()) == {-1.0, 1.0}
    assert torch.all(A[:, -1] == 1)


def test_f_star_matches_an_independent_solver(a5a):
    A, b = a5a
    info, x = solve_f_star(A, b, 1e-4)
    f, grad = objective(A, b, 1e-4)
    ref = minimize(f, np.zeros(A.shape[1]), jac=grad, method="L-BFGS-B",
                   options={"gtol": 1e-10, "ftol": 1e-14, "maxiter": 5000})
    assert abs(info["f_star"] - ref.fun) < 1e-9
    assert info["f_star"] <= ref.fun + 1e-12       # ours is at least as good
    assert info["grad_norm"] < 1e-8


def test_oracle_gradients_match_autograd(a5a):
    A, b = a5a
    o = LogRegOracle(A[:200], b[:200], 16, 1e-4)
    x = torch.randn(124, dtype=torch.float32) * 0.1
    xp = torch.randn(124) * 0.1
    idx = torch.arange(0, 200, 3)
    def f(v):
        z = -b[idx] * (A[idx] @ v)
        return torch.nn.functional.softplus(z).mean() + 0.5e-4 * v.dot(v)
    g = torch.autograd.functional.jacobian(f, x)
    gp = torch.autograd.functional.jacobian(f, xp)
    torch.testing.assert_close(o.grad([x], idx)[0], g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o.grad_diff([x], [xp], idx)[0], g - gp, rtol=1e-4, atol=1e-6)


def test_split_shapes_and_label_skew(a5a):
    A, b = a5a
    iid = split(len(b), 4, 0)
    assert [len(s) for s in iid] == [1603] * 4
    assert len(torch.unique(torch.cat(iid))) == 4 * 1603
    skew = split(len(b), 4, 0, b, "label_skew")
    pos = [float((b[s] > 0).float().mean()) for s in skew]
    assert pos[0] == 0.0 and pos[-1] > 0.9          # workers see different class balances
    with pytest.raises(ValueError, match="heterogeneity"):
        split(len(b), 4, 0, b, "dirichlet")


def test_missing_data_error_names_every_place_looked(tmp_path, monkeypatch):
    (tmp_path / "env").mkdir()
    (tmp_path / "cfg").mkdir()           # (a folder that does not exist is its own error)
    monkeypatch.setenv("GLUON_DATA_DIR", str(tmp_path / "env"))
    with pytest.raises(DataNotFoundError) as err:
        libsvm_file("a0a", data_dir=tmp_path / "cfg", download=False)
    msg = str(err.value)
    assert str(tmp_path / "cfg" / "libsvm" / "a0a") in msg
    assert str(tmp_path / "env" / "libsvm" / "a0a") in msg
    assert "GLUON_DATA_DIR" in msg and "libsvmtools" in msg


def test_run_decreases_gap_and_records_everything(tmp_path):
    _a5a()
    c = cfg("method=alg1", "compressor=randk", "compressor.density=0.01", "method.q=0.1",
            "method.B=4", "method.lr=0.01", "steps=1500", "log_every=50", tmp=tmp_path)
    s = run(c, tmp_path / "run")
    rows = read_rows(tmp_path / "run")
    assert s["status"] == "ok" and s["steps_done"] == 1500
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 1500
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})   # no duplicates
    for key in ("step", "comm", "bytes", "loss", "gap"):
        assert key in rows[-1]
    assert rows[-1]["gap"] < 0.2 * rows[0]["gap"]
    assert all(b["comm"] >= a["comm"] for a, b in zip(rows, rows[1:]))
    for key in ("status", "f_star", "seed", "git_commit", "wall_time", "config"):
        assert key in s
    assert s["config"]["method"]["name"] == "alg1"
    assert abs(rows[-1]["gap"] - (rows[-1]["loss"] - s["f_star"])) < 1e-12


@pytest.mark.parametrize("threads", [1, 2])
def test_a_run_solves_f_star_on_its_own_threads_and_gives_the_process_back(tmp_path,
                                                                            monkeypatch, threads):
    """numpy's BLAS, which solves f*, runs on the run's ``threads``, as torch does, whatever the
    process had (here 3); the process has its own back after the run."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from experiments.tasks import logreg as task

    def blas_threads() -> set[int]:
        return {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}
    seen = []

    def solving(*args, **kw):
        seen.append(blas_threads())
        return solve_f_star(*args, **kw)
    monkeypatch.setattr(task, "solve_f_star", solving)
    _a5a()
    with threadpool_limits(3, user_api="blas"):
        s = run(cfg("steps=10", "log_every=10", f"threads={threads}", tmp=tmp_path),
                tmp_path / "run")
        assert blas_threads() == {3}
    assert s["status"] == "ok" and seen == [{threads}]      # f* was solved, on ``threads``


def test_same_seed_same_run_and_rerun_skips(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="experiments")
    _a5a()
    c = cfg("method=alg2", "steps=300", "log_every=20", tmp=tmp_path)
    run(c, tmp_path / "a")
    run(c, tmp_path / "b")
    assert untimed(read_rows(tmp_path / "a")) == untimed(read_rows(tmp_path / "b"))
    c2 = cfg("method=alg2", "steps=300", "log_every=20", "seed=1", tmp=tmp_path)
    run(c2, tmp_path / "c")
    assert untimed(read_rows(tmp_path / "a")) != untimed(read_rows(tmp_path / "c"))
    before = (tmp_path / "a" / "metrics.jsonl").read_text()
    caplog.clear()
    run(c, tmp_path / "a")                                      # finished: skipped
    assert "[skip]" in caplog.text
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == before
    c3 = cfg("method=alg2", "steps=200", "log_every=20", tmp=tmp_path)
    with pytest.raises(EnvironmentProblem, match="holds another run .ok; steps: 200 here, 300 there"):
        run(c3, tmp_path / "a")                                 # another run's folder: refused
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == before
    c3.overwrite = True
    run(c3, tmp_path / "a")                                     # asked for: replaced
    rows = read_rows(tmp_path / "a")
    assert rows[-1]["step"] == 200 and len(rows) == len({r["step"] for r in rows})


def test_max_comm_budget_stops_the_run(tmp_path):
    _a5a()
    c = cfg("method=gluon", "steps=100000", "max_comm=30", "log_every=10", tmp=tmp_path)
    s = run(c, tmp_path / "r")
    assert s["steps_done"] == 30 and abs(s["comm"] - 30.0) < 1e-9


BAD_INPUT = [
    ("method=alg9", "unknown method 'alg9'"),
    ("method.q=1.5", "q must lie in \\[0, 1\\]"),
    ("method.q=-0.1", "q must lie in \\[0, 1\\]"),
    ("compressor.density=1.5", "density must lie in \\(0, 1\\]"),
    ("compressor.density=0", "density must lie in \\(0, 1\\]"),
    ("method.beta=1.0", "beta must lie in \\[0, 1\\)"),
    ("method.lr=0", "lr must be > 0"),
    ("method.B=0", "B must be a positive integer"),
    ("n_workers=0", "n_workers=0: must be >= 1"),
]


@pytest.mark.parametrize("override,message", BAD_INPUT)
def test_bad_input_is_rejected_before_compute(override, message, tmp_path, monkeypatch):
    import experiments.tasks.logreg as lr
    def no_data(*a, **k):
        raise AssertionError("data was looked up before the input was checked")
    monkeypatch.setattr(lr, "libsvm_file", no_data)
    c = cfg("steps=10", override, tmp=tmp_path) if not override.startswith("method=alg9") \
        else cfg("steps=10", tmp=tmp_path)
    if override.startswith("method=alg9"):
        c.method.name = "alg9"
    with pytest.raises(ValueError, match=message):
        run(c, tmp_path / "r")


def test_cli_reports_bad_input_and_unknown_group_option():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for override, message in [("compressor.density=1.5", "density must lie in (0, 1]"),
                              ("compressor=bogus", "compressor")]:
        p = subprocess.run([sys.executable, "-m", "experiments.logreg", override, "steps=10",
                            "hydra.run.dir=" + str(REPO / "results" / "runs" / "_bad_input")],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and message in p.stdout + p.stderr


def test_method_with_fixed_compressor_rejects_another():
    from experiments.run.config import validate
    with pytest.raises(ValueError, match="identity"):
        validate(cfg("method=gluon", "compressor=randk"))
    assert validate(cfg("method=gluon")).name == "identity"
    assert validate(cfg("method=local_gluon")).name == "zero"
    assert validate(cfg("method=alg2")).name == "topk"
