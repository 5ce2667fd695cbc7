"""W&B, offline (no network): what a run writes, and how a resumed run continues it.

The offline run directory (<run_dir>/wandb/offline-run-*/run-<id>.wandb) is read back with
experiments.run.wandb_offline, W&B's own transaction-log format.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from experiments.run import lifecycle as runner
from experiments.run.record import read_metrics, read_summary
from experiments.tasks import logreg as task
from experiments.tasks.logreg import build
from experiments.run.lifecycle import execute
from experiments.run.wandb_offline import read_offline_run
from paper.wandb_dashboard import DASHBOARDS, recipe
from tests.conftest import compose_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)   # the config's mode decides


def config(tmp, *overrides):
    (tmp / "results" / "cache").mkdir(parents=True, exist_ok=True)
    for f in (REPO / "results" / "cache").glob("fstar-*.json"):
        shutil.copy(f, tmp / "results" / "cache" / f.name)
    return compose_config("logreg", "wandb.enabled=true", "wandb.mode=offline",
                          f"results_dir={tmp / 'results'}", *overrides)


def offline_runs(run_dir: Path, timeout: float = 20.0):
    """The offline runs in ``run_dir``, once W&B's service has flushed them (it writes the
    transaction log asynchronously: finish() can return before the last records are on disk)."""
    t0 = time.time()
    while True:
        runs = [read_offline_run(d) for d in sorted((run_dir / "wandb").glob("offline-run-*"))]
        if runs and all(r["exit_code"] is not None for r in runs):
            return runs
        if time.time() - t0 > timeout:
            raise AssertionError(f"offline runs in {run_dir} incomplete after {timeout} s")
        if time.time() - t0 > timeout / 2:
            import wandb
            wandb.teardown()              # stops the service, which flushes everything
        time.sleep(0.05)


def test_offline_run_has_config_step_metrics_groups_and_summary(tmp_path):
    cfg = config(tmp_path, "experiment=fig3", "steps=100", "max_comm=null", "log_every=20")
    execute(cfg, tmp_path / "run", task)
    (run,) = offline_runs(tmp_path / "run")
    # resolved config, grouped by experiment then method, tagged by figure
    given = {k: v for k, v in run["config"]["method"].items() if v is not None}
    assert given == {"name": "alg1", "q": 0.1, "B": 4, "beta": 0.99, "lr": 0.01,
                     "scale_by_B": True}
    assert run["config"]["compressor"]["name"] == "randk" and run["config"]["steps"] == 100
    assert run["group"] == "fig3" and run["job_type"] == "alg1"
    assert {"fig3", "alg1", "randk", "a5a"} <= set(run["tags"])
    # every value against comm; the by_bytes/ copies against bytes
    assert run["metrics"]["*"] == "comm" and run["metrics"]["by_bytes/*"] == "bytes"
    rows = read_metrics(tmp_path / "run")
    assert len(run["history"]) == len(rows) == 6
    for h, r in zip(run["history"], rows):
        assert {k: h[k] for k in r} == r
        assert h["by_bytes/gap"] == r["gap"] and h["by_bytes/loss"] == r["loss"]
    assert [h["_step"] for h in run["history"]] == list(range(6))
    assert run["summary"]["status"] == "ok" and run["exit_code"] == 0
    assert run["summary"]["final"]["gap"] == read_summary(tmp_path / "run")["final"]["gap"]


def test_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    cfg = config(tmp_path, "steps=300", "log_every=20", "checkpoint_every=100")
    real = runner.train

    def train(method, steps, **kw):                     # killed after step 150
        inner = kw["on_step"]

        def on_step(m):
            inner(m)
            if m.k == 150:
                raise KeyboardInterrupt
        return real(method, steps, **{**kw, "on_step": on_step})
    monkeypatch.setattr(runner, "train", train)
    with pytest.raises(KeyboardInterrupt):
        execute(cfg, tmp_path / "run", task)
    monkeypatch.setattr(runner, "train", real)
    execute(cfg, tmp_path / "run", task)

    first, second = offline_runs(tmp_path / "run")
    assert first["id"] == second["id"]                  # one W&B run, two offline segments
    assert first["exit_code"] != 0 and second["exit_code"] == 0
    assert second["summary"]["resumed_at_row"] == 6     # the checkpoint at step 100
    # W&B step = row index: the rows logged twice (steps 120, 140) carry the same step and
    # the same values, so `wandb sync` keeps one curve; together they are metrics.jsonl
    merged = {h["_step"]: h for h in first["history"] + second["history"]}
    rows = read_metrics(tmp_path / "run")
    assert sorted(merged) == list(range(len(rows))) and len(rows) == 16
    for i, r in enumerate(rows):
        assert {k: merged[i][k] for k in r} == r


def test_new_start_gets_a_new_wandb_id(tmp_path):
    cfg = config(tmp_path, "steps=20", "log_every=10")
    execute(cfg, tmp_path / "run", task)
    cfg.overwrite = True
    execute(cfg, tmp_path / "run", task)
    a, b = offline_runs(tmp_path / "run")
    assert a["id"] != b["id"]


def test_dashboard_recipes_offline(capsys):
    from paper.wandb_dashboard import main
    main(["--print", "fig3", "fig7"])
    out = json.loads(capsys.readouterr().out)
    assert out["fig3"]["groupby"] == ["config.method.q", "config.compressor.density"]
    assert "Metric('JobType') == 'vr_marina'" in out["fig7"]["filters"]
    for fig in DASHBOARDS:
        r = recipe(fig)
        assert {p["x"] for p in r["panels"]} == {"comm", "bytes"}
