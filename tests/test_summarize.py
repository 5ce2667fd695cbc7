"""The sweep table (scripts.analysis.summarize): grouping over seeds, the numbers, sorting, runs
that failed or never finished, the CSV; on run folders written here as the runner writes them,
and on a tiny real sweep run through the entry point."""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from scripts.analysis import summarize as S

from experiments.shared.files import REPO
ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}


def config(method="gluon", lr=0.1, seed=0, q=None, threads=1):
    return {"method": {"name": method, "lr": lr, "beta": 0.9, "q": q},
            "compressor": {"name": "randk", "density": 0.01, "levels": None},
            "wandb": {"enabled": False, "tags": []}, "seed": seed, "steps": 100,
            "threads": threads, "results_dir": f"elsewhere{seed}", "checkpoint_every": 10 * seed,
            "task": {"name": "a5a", "l2": 0.0001}}


def run_folder(root, cfg, status="ok", gaps=None, metric="gap", extra_metrics=None):
    """A run folder as the runner leaves it: .hydra/ (hydra, when the job starts), config.json
    and metrics.jsonl (the run, when it starts and as it logs), summary.json (when it ends)."""
    overrides = [f"method.lr={cfg['method']['lr']}", f"seed={cfg['seed']}"]
    d = Path(root) / cfg["method"]["name"] / ",".join(sorted(overrides))
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (d / ".hydra" / "config.yaml").write_text(json.dumps(cfg))       # JSON is YAML
    if status == "missing":                                           # killed before it started
        return d
    (d / "config.json").write_text(json.dumps(cfg))
    rows = [{"step": 10 * i, "comm": 2.0 * i, "bytes": 8.0 * i, metric: g,
             **(extra_metrics[i] if extra_metrics else {})} for i, g in enumerate(gaps or [])]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if status == "interrupted":                                       # a checkpoint, no summary
        (d / "checkpoint.pt").write_bytes(b"x")
        with open(d / "metrics.jsonl", "a") as fh:
            fh.write('{"step": 99, "gap"')                             # a line cut by the kill
        return d
    summary = {"status": status, "seed": cfg["seed"], "config": cfg}
    if status == "failed":
        summary["error"] = "Traceback ...: RuntimeError: boom"
    else:
        summary.update(final=rows[-1], comm=rows[-1]["comm"], bytes=rows[-1]["bytes"],
                       steps_done=rows[-1]["step"], train_time=0.5 + cfg["seed"])
    (d / "summary.json").write_text(json.dumps(summary))
    return d


GAPS = {  # (method, lr, seed): logged gaps
    ("gluon", 0.1, 0): [0.5, 0.1, 0.04, 0.05],
    ("gluon", 0.1, 1): [0.5, 0.2, 0.03],
    ("gluon", 0.1, 2): [0.5, 0.06, 0.07, 0.02, 0.08],
    ("gluon", 0.2, 0): [0.5, 0.01, 0.009],
    ("gluon", 0.2, 1): [0.5, 0.3, float("nan")],          # diverged at its last row
    ("alg1", 0.1, 0): [0.5, 0.011],
}


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    for (m, lr, s), gaps in GAPS.items():
        status = "diverged" if math.isnan(gaps[-1]) else "ok"
        run_folder(root, config(m, lr, s, q=0.5 if m == "alg1" else None, threads=1 + s),
                   status, gaps)
    run_folder(root, config("gluon", 0.3, 0), "failed", [0.5])
    run_folder(root, config("gluon", 0.3, 1), "missing")
    run_folder(root, config("gluon", 0.3, 2), "interrupted", [0.5, 0.4])
    return root


def by_lr(table, method="gluon"):
    return {r["method.lr"]: r for r in table.to_dict("records") if r["method"] == method}


def test_one_row_per_config_with_the_numbers_by_hand(sweep):
    table, info = S.summarize(sweep)
    assert info["metric"] == "gap" and info["runs"] == 9 and info["configs"] == 4
    # the compute spent: the finished runs' training times (0.5 + seed s each), summed
    assert info["train_hours"] == pytest.approx((0.5 + 1.5 + 2.5 + 0.5 + 1.5 + 0.5) / 3600)
    assert S.header(info).endswith("; training took 0.00 hours of one core (all runs)")
    # the columns that differ between configs, in the schema's order; not the seed, not the
    # operational keys that differ between seeds (threads, results_dir, checkpoint_every)
    assert list(table.columns[:3]) == ["method", "method.lr", "method.q"]
    assert "seed" not in table.columns and "threads" not in table.columns
    assert info["named"]["compressor"] == "randk" and info["named"]["task"] == "a5a"
    rows = by_lr(table)
    ok = rows[0.1]
    finals = [GAPS["gluon", 0.1, s][-1] for s in range(3)]
    assert ok["n"] == 3 and ok["status"] == "3 ok"
    assert ok["final_gap"] == pytest.approx(statistics.mean(finals), rel=1e-12)
    assert ok["final_gap_std"] == pytest.approx(statistics.stdev(finals), rel=1e-12)
    assert ok["best_gap"] == pytest.approx(statistics.mean([0.04, 0.03, 0.02]), rel=1e-12)
    assert ok["comm"] == pytest.approx(statistics.mean([6.0, 4.0, 8.0]))
    assert ok["steps"] == pytest.approx(statistics.mean([30, 20, 40]))
    assert ok["train_s"] == pytest.approx(statistics.mean([0.5, 1.5, 2.5]))
    # a diverged seed: the config's final mean is +inf, its best the finite rows' best
    div = rows[0.2]
    assert div["n"] == 2 and div["status"] == "1 ok, 1 diverged"
    assert div["final_gap"] == math.inf
    assert div["best_gap"] == pytest.approx(statistics.mean([0.009, 0.3]))
    # failed, never started, interrupted: counted, NaN metrics, no crash
    bad = rows[0.3]
    assert bad["n"] == 3 and bad["status"] == "1 failed, 1 interrupted, 1 missing"
    assert all(math.isnan(bad[c]) for c in ("final_gap", "best_gap", "comm", "steps"))
    # a single seed: no spread
    (alg1,) = [r for r in table.to_dict("records") if r["method"] == "alg1"]
    assert alg1["n"] == 1 and alg1["final_gap"] == 0.011 and math.isnan(alg1["final_gap_std"])
    assert pd.isna(by_lr(table)[0.1]["method.q"]) and alg1["method.q"] == 0.5


def test_sorting_best_first_nan_last_and_by_any_column(sweep):
    table, info = S.summarize(sweep)
    t = S.sort_table(table, "gap")
    assert [(r["method"], r["method.lr"]) for r in t.to_dict("records")] == [
        ("alg1", 0.1), ("gluon", 0.1), ("gluon", 0.2), ("gluon", 0.3)]   # 0.011, 0.053, inf, NaN
    t = S.sort_table(table, "gap", "method.lr,final", reverse=True)
    assert [r["method.lr"] for r in t.to_dict("records")] == [0.3, 0.2, 0.1, 0.1]
    assert list(t["method"][2:]) == ["gluon", "alg1"]         # final reversed too: worst first
    t = S.sort_table(table, "gap", "best")
    assert list(t["best_gap"][:2]) == sorted(t["best_gap"][:2])
    with pytest.raises(S.SummaryError, match="no such column"):
        S.sort_table(table, "gap", "nope")


def test_per_run_rows(sweep):
    table, _ = S.summarize(sweep, per_run=True)
    assert len(table) == 9
    assert list(table.columns) == ["method", "method.lr", "method.q", "seed", "status",
                                   "final_gap", "best_gap", "comm", "steps", "train_s", "run"]
    r = table.set_index("run").loc["gluon/method.lr=0.1,seed=2"]
    assert r["seed"] == 2 and r["final_gap"] == 0.08 and r["best_gap"] == 0.02
    statuses = table.set_index("run")["status"]
    assert statuses["gluon/method.lr=0.3,seed=0"] == "failed"
    assert statuses["gluon/method.lr=0.3,seed=1"] == "missing"
    assert statuses["gluon/method.lr=0.3,seed=2"] == "interrupted"
    assert statuses["gluon/method.lr=0.2,seed=1"] == "diverged"


def test_accuracy_is_maximised_and_loss_is_the_default_without_gap(tmp_path):
    root = tmp_path / "cnn"
    accs = {0.1: ([0.3, 0.6, 0.5], [0.2, 0.7]), 0.2: ([0.4, 0.45], [0.1, 0.5])}
    for lr, per_seed in accs.items():
        for s, acc in enumerate(per_seed):
            run_folder(root, config("gluon", lr, s), "ok", [2.0 - a for a in acc], "loss",
                       [{"test_acc": a} for a in acc])
    table, info = S.summarize(root)
    assert info["metric"] == "loss"
    table, info = S.summarize(root, "test_acc")
    t = S.sort_table(table, "test_acc")
    assert list(t["method.lr"]) == [0.1, 0.2]             # 0.6 and 0.475 final: largest first
    assert t["final_test_acc"][0] == pytest.approx(statistics.mean([0.5, 0.7]))
    assert t["best_test_acc"][0] == pytest.approx(statistics.mean([0.6, 0.7]))
    with pytest.raises(S.SummaryError, match="the runs log"):
        S.summarize(root, "gap")


def test_cli_prints_and_writes_the_csv_atomically(sweep, capsys):
    assert S.main([str(sweep)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"{sweep}: 9 runs in 4 configs (5 ok, 1 diverged, 1 failed, "
                               "1 interrupted, 1 missing); metric gap")
    assert lines[1].split()[:5] == ["method", "method.lr", "method.q", "n", "status"]
    assert lines[2].split()[:2] == ["alg1", "0.1"] and "1 failed, 1 interrupted" in lines[-1]
    csv = pd.read_csv(sweep / "summary.csv")
    assert list(csv["method"]) == ["alg1", "gluon", "gluon", "gluon"]
    assert list(csv["method.lr"]) == [0.1, 0.1, 0.2, 0.3]
    assert csv["final_gap"][1] == pytest.approx(statistics.mean([0.05, 0.03, 0.08]), rel=1e-12)
    assert csv["final_gap"][2] == math.inf and math.isnan(csv["final_gap"][3])
    assert list(csv["n"]) == [1, 3, 2, 3]
    assert [p.name for p in sweep.iterdir() if p.is_file()] == ["summary.csv"]   # no temp file
    # --per-run, --out, --sort, --markdown
    out_csv = sweep / "t" / "runs.csv"
    assert S.main([str(sweep), "--per-run", "--out", str(out_csv), "--sort", "seed,run",
                   "--markdown"]) == 0
    md = capsys.readouterr().out.splitlines()
    assert md[1].startswith("| method | method.lr | method.q | seed | status |")
    assert md[3].startswith("| alg1 | 0.1 | 0.5 | 0 | ok | 0.011 |")
    assert "| gluon | 0.3 |  | 1 | missing | NaN | NaN |" in "\n".join(md)
    assert list(pd.read_csv(out_csv)["seed"]) == [0, 0, 0, 0, 1, 1, 1, 2, 2]


def test_not_a_sweep_is_one_line_and_status_2(tmp_path, capsys):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert S.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a sweep" in err and err.count("\n") == 1
    assert not (tmp_path / "empty" / "summary.csv").exists()
    assert S.main([str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_a_real_sweep_through_the_entry_points(tmp_path):
    """python -m experiments.logreg -m over 2 learning rates x 2 seeds, then the table."""
    results = tmp_path / "results"
    (results / "cache").mkdir(parents=True)
    for f in (REPO / "results" / "cache").glob("fstar-*.json"):   # f* once, not per job
        shutil.copy(f, results / "cache" / f.name)
    sweep = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "experiments.logreg", "-m", "method.lr=0.01,0.02",
                        "seed=0,1", "steps=40", "log_every=20", f"hydra.sweep.dir={sweep}",
                        f"results_dir={results}"], cwd=REPO, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = sorted(sweep.glob("*/*/summary.json"))
    assert len(runs) == 4
    finals, bests = {}, {}
    for s in runs:
        cfg = json.loads(s.read_text())["config"]
        gaps = [json.loads(line)["gap"] for line in (s.parent / "metrics.jsonl").open()]
        finals.setdefault(cfg["method"]["lr"], []).append(gaps[-1])
        bests.setdefault(cfg["method"]["lr"], []).append(min(gaps))
    # the same grouping as the paper's figures use
    from experiments.shared.statistics import group_runs, load_runs
    table, _ = S.summarize(sweep)
    assert sorted(table["n"]) == sorted(len(g) for g in group_runs(load_runs(sweep)).values())
    # one run killed before its end: no summary, listed as missing, left out of the means
    folder = {(json.loads(s.read_text())["config"]["method"]["lr"],
               json.loads(s.read_text())["config"]["seed"]): s.parent for s in runs}
    killed = folder[0.02, 1]
    (killed / "summary.json").unlink()

    p = subprocess.run([sys.executable, "-m", "scripts.analysis.summarize", str(sweep)],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0].startswith(f"{sweep}: 4 runs in 2 configs (3 ok, 1 missing)")
    csv = pd.read_csv(sweep / "summary.csv")
    assert list(csv.columns[:3]) == ["method.lr", "n", "status"]
    assert list(csv["n"]) == [2, 2]
    rows = {r["method.lr"]: r for r in csv.to_dict("records")}
    assert rows[0.01]["status"] == "2 ok" and rows[0.02]["status"] == "1 ok, 1 missing"
    assert rows[0.01]["final_gap"] == pytest.approx(statistics.mean(finals[0.01]), rel=1e-12)
    assert rows[0.01]["final_gap_std"] == pytest.approx(statistics.stdev(finals[0.01]), rel=1e-12)
    assert rows[0.01]["best_gap"] == pytest.approx(statistics.mean(bests[0.01]), rel=1e-12)
    seed0 = json.loads((folder[0.02, 0] / "summary.json").read_text())
    assert rows[0.02]["final_gap"] == pytest.approx(seed0["final"]["gap"], rel=1e-12)
    assert rows[0.01]["steps"] == 40 and rows[0.01]["comm"] > 0
    # sorted best first by the final gap
    assert list(csv["final_gap"]) == sorted(csv["final_gap"])
