"""The figure pipeline: configs compose, selection, reduction arithmetic, plotting, a sweep."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from experiments.shared import statistics, tables
from experiments.shared.statistics import log_area, reduction_rows, value_at
from scripts.analysis import select_tuned
from scripts.figures import fig2
from tests.conftest import compose_config, entry_point_of

from experiments.shared.files import REPO
CONFIGS = REPO / "configs"


def experiment_names():
    return sorted(str(p.relative_to(CONFIGS / "experiment").with_suffix(""))
                  for p in (CONFIGS / "experiment").rglob("*.yaml") if not p.name.startswith("_"))


@pytest.mark.parametrize("name", experiment_names())
def test_every_experiment_config_composes(name):
    primary = entry_point_of(name)
    cfg = compose_config(primary, f"experiment={name}", hydra=True)
    from experiments.run.config import validate
    validate(cfg)  # method, compressor and hyperparameters are valid
    params = cfg.hydra.sweeper.params or {}
    assert params, f"{name} defines no sweep"


def test_tuned_configs_compose_and_fix_the_method():
    tuned = sorted((CONFIGS / "tuned" / "fig2_logreg").glob("*.yaml"))
    assert {p.stem for p in tuned} >= {"gluon", "vr_marina", "alg1", "alg2", "alg3", "alg4"}
    from experiments.run.config import validate
    for p in tuned:
        cfg = compose_config("logreg", f"tuned=fig2_logreg/{p.stem}")
        assert cfg.method.name == p.stem
        validate(cfg)


def fake_run(tmp, name, seed, comm, gap, method="alg1", status="ok", max_comm=40,
             compressor=None, **method_kw):
    d = tmp / f"{name}-{seed}"
    d.mkdir(parents=True)
    config = {"method": {"name": method, **method_kw},
              "compressor": compressor or {"name": "randk"},
              "seed": seed, "max_comm": max_comm, "experiment": "t"}
    (d / "summary.json").write_text(json.dumps({"status": status, "config": config,
                                                "wall_time": 1.0}))
    (d / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "comm": c, "bytes": 4 * c, "gap": g}) + "\n"
        for i, (c, g) in enumerate(zip(comm, gap))))
    return d


def test_reduction_rows_arithmetic(tmp_path):
    comm = [0, 10, 20, 30, 40]
    comm_b = [0, 10, 20, 30, 36, 40]
    fake_run(tmp_path, "base", 0, comm_b, [1, 0.5, 0.2, 0.1, 0.05, 0.045], method="gluon")
    fake_run(tmp_path, "base", 1, comm_b, [1, 0.5, 0.3, 0.1, 0.05, 0.045], method="gluon")
    fake_run(tmp_path, "new", 0, comm, [1, 0.1, 0.05, 0.01, 0.01])
    fake_run(tmp_path, "new", 1, comm, [1, 0.2, 0.09, 0.01, 0.01])
    groups = {}
    for r in statistics.load_runs(tmp_path):
        groups.setdefault(r.config["method"]["name"], []).append(r)
    rows = reduction_rows(groups, "gap", eps_list=[0.11, 1e-3], baselines=["gluon"], budget=40,
                          width=1e-9, task="a5a")   # a window narrower than a row: raw = smoothed
    by = {(r["method"], r["metric"], r["level"], r["eps"]): r for r in rows}
    for metric in ("raw_first_hit", "smoothed_first_hit"):
        new, base = by[("alg1", metric, "eps", 0.11)], by[("gluon", metric, "eps", 0.11)]
        assert (new["comm"], base["comm"]) == (15.0, 30.0)        # mean of 10 and 20; of 30, 30
        assert new["reduction"] == pytest.approx(1 - 15 / 30) and new["baseline"] == "gluon"
        assert new["ci_low"] <= new["reduction"] <= new["ci_high"]
        assert math.isnan(base["reduction"])                      # no reduction against itself
        miss = by[("alg1", metric, "eps", 1e-3)]
        assert math.isnan(miss["comm"]) and miss["seeds_reached"] == 0 and miss["baseline"] == ""
    # the baseline's final level: the geometric mean of its curves over the last 10% of the
    # budget, [36, 40]: 0.05 on all of it but the end point, 0.045 there
    final = [r for r in rows if r["level"] == "baseline_final" and r["method"] == "alg1"]
    assert {r["metric"] for r in final} == {"raw_first_hit", "smoothed_first_hit"}
    for r in final:
        assert 0.045 < r["eps"] < 0.05 and r["baseline_comm"] == 40.0
        assert r["comm"] == 30.0 and r["reduction"] == pytest.approx(1 - 30 / 40)


def test_a_results_csv_is_the_same_file_when_its_floats_differ_by_a_few_ulps(tmp_path):
    """numpy's exp and log differ in the last bit between CPUs: a redraw on another machine
    must not rewrite the committed curves. Integral counts stay exact, and a cell read back
    and written again is unchanged (kept rows of other panels are rewritten)."""
    rng = statistics.np.random.default_rng(0)
    values = 10.0 ** rng.uniform(-6, 9, 20000) * rng.choice([-1, 1], 20000)
    nudged = values * (1 + 4e-16)                      # a few ulps, as between SIMD paths
    same = sum(tables.csv_float(a) == tables.csv_float(b) for a, b in zip(values, nudged))
    assert same >= 0.999 * len(values)
    for v in list(values) + [34510312.4, 0.5, 2.0 ** 53, 1643520000.0, math.inf, -math.inf]:
        cell = tables.csv_float(v)
        assert tables.csv_float(float(cell)) == cell                  # idempotent
        assert float(cell) == pytest.approx(v, rel=1e-7)             # 8 significant digits
    assert tables.csv_float(1643520000.0) == "1643520000.0"          # counts exactly
    assert tables.csv_float(2.0 ** 53 + 2) == repr(2.0 ** 53 + 2)
    rows = [{"label": "a", "comm": 0.5, "raw": float(v), "bytes": 1643520.0} for v in values[:50]]
    tables.write_csv(rows, tmp_path / "a.csv")
    tables.write_csv(tables.read_csv(tmp_path / "a.csv"), tmp_path / "b.csv")
    assert (tmp_path / "b.csv").read_bytes() == (tmp_path / "a.csv").read_bytes()


def test_value_at_is_a_step_function_and_diverged_is_inf(tmp_path):
    fake_run(tmp_path, "a", 0, [0, 10, 20], [1.0, 0.5, 0.25], max_comm=20)
    fake_run(tmp_path, "b", 0, [0, 10], [1.0, 0.5], status="diverged", max_comm=20)
    ok, bad = sorted(statistics.load_runs(tmp_path), key=lambda r: r.status)[::-1]
    v = value_at(ok, "gap", statistics.np.array([0, 5, 10, 19.9, 20, 25]))
    assert v[:5].tolist() == [1.0, 1.0, 0.5, 0.5, 0.25] and math.isnan(v[5])
    assert math.isinf(value_at(bad, "gap", statistics.np.array([15.0]))[0])
    assert math.isinf(log_area([bad], "gap", 20))
    assert math.isfinite(log_area([ok], "gap", 20))
    assert math.isinf(log_area([ok], "gap", 25))       # stopped short of the budget


def test_selection_picks_the_lowest_log_area_and_writes_a_config(tmp_path):
    comm = [0, 10, 20, 30, 40]
    fake_run(tmp_path / "s", "slow", 100, comm, [1, .8, .6, .4, .2], lr=0.01, beta=0.9)
    fake_run(tmp_path / "s", "fast", 100, comm, [1, .1, .05, .02, .01], lr=0.02, beta=0.9)
    fake_run(tmp_path / "s", "boom", 100, [0, 10], [1, .01], status="diverged", lr=0.1, beta=0.9)
    out = tmp_path / "tuned"
    select_tuned.main(["--sweep", str(tmp_path / "s"), "--out", str(out),
                       "--table", str(tmp_path / "scores.csv")])
    text = (out / "alg1.yaml").read_text()
    assert "lr: 0.02" in text and "override /method: alg1" in text and "Criterion" in text
    assert (tmp_path / "scores.csv").read_text().count("\n") == 4   # header + 3 candidates
    final = {r["method.lr"]: r["final"] for r in tables.read_csv(tmp_path / "scores.csv")}
    assert final[0.01] == pytest.approx(0.2) and final[0.02] == pytest.approx(0.01)
    assert math.isnan(float(final[0.1]))               # diverged: no last value to quote


def test_a_choice_on_a_grid_edge_is_flagged_unless_the_edge_is_a_hard_limit():
    """select_tuned names the settings to extend: lr at the top of its grid is one; B = 1 (no
    fewer minibatches), q = 1 and density 1 (no more) and beta = 0 (no momentum) are the limits,
    not edges."""
    table = [{"method": "alg1", "method.lr": lr, "method.B": B, "method.q": q}
             for lr in (0.001, 0.002) for B in (1, 4) for q in (0.1, 1.0)]
    edges = select_tuned.grid_edges(table, "alg1", {"method.lr": 0.002, "method.B": 1,
                                                    "method.q": 1.0})
    assert edges == ["method.lr=0.002 (highest of 0.001, 0.002)"]
    assert select_tuned.grid_edges(table, "alg1", {"method.B": 4, "method.q": 0.1}) == [
        "method.B=4 (highest of 1, 4)", "method.q=0.1 (lowest of 0.1, 1)"]
    # an extension at one B: lr 0.004 was tried at B = 4 only, so at B = 1 the top lr is 0.002
    ext = table + [{"method": "alg1", "method.lr": 0.004, "method.B": 4, "method.q": 1.0}]
    assert select_tuned.grid_edges(ext, "alg1", {"method.lr": 0.002, "method.B": 1,
                                                 "method.q": 1.0}) == [
        "method.lr=0.002 (highest of 0.001, 0.002)"]
    assert select_tuned.grid_edges(ext, "alg1", {"method.lr": 0.002, "method.B": 4,
                                                 "method.q": 1.0}) == [
        "method.B=4 (highest of 1, 4)"]                  # at B = 4, lr 0.002 is inside
    # chosen at B = 16, tried there at lr 0.002 alone: lr is a searched axis, untested at this point
    one = table + [{"method": "alg1", "method.lr": 0.002, "method.B": 16, "method.q": 1.0}]
    assert select_tuned.grid_edges(one, "alg1", {"method.lr": 0.002, "method.B": 16,
                                                 "method.q": 1.0}) == [
        "method.lr=0.002 (the only value tried at the chosen point)",
        "method.B=16 (highest of 1, 4, 16)"]
    # an axis held fixed over the whole grid (beta 0.9 everywhere) was not searched: no edge
    fixed = [dict(r, **{"method.beta": 0.9}) for r in table]
    assert select_tuned.grid_edges(fixed, "alg1", {"method.lr": 0.001, "method.B": 1,
                                                   "method.q": 1.0, "method.beta": 0.9}) == [
        "method.lr=0.001 (lowest of 0.001, 0.002)"]
    # beta = 0 is the lowest momentum there is; beta 0.3, the lowest tried, is an edge
    betas = [dict(r, **{"method.beta": b}) for r in table for b in (0.0, 0.3, 0.6)]
    assert select_tuned.grid_edges(betas, "alg1", {"method.lr": 0.001, "method.B": 4,
                                                   "method.q": 1.0, "method.beta": 0.0}) == [
        "method.lr=0.001 (lowest of 0.001, 0.002)", "method.B=4 (highest of 1, 4)"]
    assert select_tuned.grid_edges([r for r in betas if r["method.beta"]], "alg1", {
        "method.lr": 0.001, "method.B": 4, "method.q": 1.0, "method.beta": 0.3}) == [
        "method.lr=0.001 (lowest of 0.001, 0.002)", "method.B=4 (highest of 1, 4)",
        "method.beta=0.3 (lowest of 0.3, 0.6)"]
    # a point above the choice with one of its two seeds landed is not tried yet: still an edge
    two = [dict(r, seeds=2) for r in table] + [
        {"method": "alg1", "method.lr": 0.004, "method.B": 1, "method.q": 1.0, "seeds": 1}]
    assert select_tuned.grid_edges(two, "alg1", {"method.lr": 0.002, "method.B": 1,
                                                 "method.q": 1.0}) == [
        "method.lr=0.002 (highest of 0.001, 0.002)"]


def test_strict_selection_stops_at_an_edge_unless_the_axis_was_stopped_there(tmp_path):
    """--strict: a choice on the edge of its grid writes no tuned config and exits 1 (so a
    pipeline stops before its panel); --stop KEY=VALUE declares an axis stopped there on purpose."""
    comm = [0, 10, 20, 30, 40]
    for B, tail in ((4, [.3, .2, .1, .05]), (16, [.2, .1, .05, .02])):
        fake_run(tmp_path / "s", f"B{B}", 100, comm, [1] + tail, lr=0.02, beta=0.9, B=B)
    args = ["--sweep", str(tmp_path / "s"), "--strict"]
    with pytest.raises(SystemExit, match="alg1 chose on an edge of its grid"):
        select_tuned.main(args + ["--out", str(tmp_path / "a")])
    assert not (tmp_path / "a" / "alg1.yaml").exists()
    select_tuned.main(args + ["--out", str(tmp_path / "b"), "--stop", "method.B=16"])
    assert "B: 16" in (tmp_path / "b" / "alg1.yaml").read_text()


def test_only_chooses_and_checks_the_named_methods(tmp_path):
    """--only: a pipeline's selection after one stage chooses that stage's methods alone, so
    another method's grid on an edge (its extension runs at a later stage) neither stops it nor
    gets a config; the table still lists every candidate; a name with no runs is refused."""
    comm = [0, 10, 20, 30, 40]
    for B, tail in ((4, [.3, .2, .1, .05]), (16, [.2, .1, .05, .02])):
        fake_run(tmp_path / "s", f"B{B}", 100, comm, [1] + tail, lr=0.02, beta=0.9, B=B)
    fake_run(tmp_path / "s", "g", 100, comm, [1, .5, .3, .2, .1], method="gluon", lr=0.02,
             beta=0.9)
    args = ["--sweep", str(tmp_path / "s"), "--strict", "--table", str(tmp_path / "t.csv")]
    select_tuned.main(args + ["--out", str(tmp_path / "a"), "--only", "gluon"])
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["gluon.yaml"]
    assert (tmp_path / "t.csv").read_text().count("alg1") == 2
    with pytest.raises(SystemExit, match="alg1 chose on an edge"):     # without --only, it stops
        select_tuned.main(args + ["--out", str(tmp_path / "b")])
    with pytest.raises(SystemExit, match="--only names local_gluon, with no runs"):
        select_tuned.main(args + ["--out", str(tmp_path / "c"), "--only", "gluon,local_gluon"])
    assert not (tmp_path / "c").exists()                     # refused before anything is written


def test_a_run_stopped_by_its_compute_cap_is_scored_over_the_uplink_it_reached(tmp_path):
    """EF21-Muon capped at Alg. 1's gradient evaluations (max_grads) stops short of the uplink
    budget by design: it is scored over the range it reaches, as at an iteration cap, while a
    run that stops short for no cap of its own scores +inf."""
    def run(name, grads_end, max_grads):
        d = fake_run(tmp_path / name, name, 100, [0, 5, 10], [1, .5, .25], method="ef21_muon",
                     compressor={"name": "topk"}, max_comm=40)
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        for r, g in zip(rows, (0, grads_end / 2, grads_end)):
            r["grads"] = g
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = json.loads((d / "summary.json").read_text())
        summary["config"].update(steps=10_000, max_grads=max_grads)
        (d / "summary.json").write_text(json.dumps(summary))
        return statistics.load_runs(tmp_path / name)

    capped, short = run("capped", 300, 300), run("short", 200, 300)
    assert select_tuned.scored_range(capped, 40) == 10
    assert math.isfinite(log_area(capped, "gap", select_tuned.scored_range(capped, 40)))
    assert select_tuned.scored_range(short, 40) == 40
    assert math.isinf(log_area(short, "gap", select_tuned.scored_range(short, 40)))


def test_fig2_aggregate_and_plot(tmp_path, monkeypatch):
    comm = [0, 10, 20, 30, 40]
    sweep = tmp_path / "sweep"
    for s in range(2):
        fake_run(sweep, "g", s, comm, [1, .5, .2, .05, .02], method="gluon")
        fake_run(sweep, "a", s, comm, [1, .1, .05, .01, .005])
    monkeypatch.setattr(fig2, "OUT", tmp_path / "results")
    fig2.aggregate("logreg", str(sweep))
    table = (tmp_path / "results" / "reduction.md").read_text()
    assert "| a5a | eps = 0.03 | alg1 | raw | 30 | 2/2 | gluon (40) | 25% [25%, 25%] |" in table
    rows = tables.read_csv(tmp_path / "results" / "reduction.csv")
    assert {r["metric"] for r in rows} == {"raw_first_hit", "smoothed_first_hit"}
    assert {r["level"] for r in rows} == {"eps", "baseline_final"}
    # aggregating the other panel keeps this one's rows
    cnn = tmp_path / "cnn"
    for s in range(2):
        fake_run(cnn, "g", s, comm, [2.5, 2.2, 1.9, 1.5, 1.3], method="gluon")
    monkeypatch.setitem(fig2.TASKS["cnn"], "metric", "gap")
    fig2.aggregate("cnn", str(cnn))
    tasks = [r["task"] for r in tables.read_csv(tmp_path / "results" / "reduction.csv")]
    assert tasks.count("a5a") == len(rows) and "cnn" in tasks
    curves = tables.read_csv(tmp_path / "results" / "logreg_curves.csv")
    assert {r["label"] for r in curves} == {"gluon", "alg1"}
    fig2.plot(tmp_path / "figs")
    assert (tmp_path / "figs" / "fig2.png").stat().st_size > 10_000
    assert (tmp_path / "figs" / "fig2.pdf").exists()


def test_an_ablation_figure_refuses_to_aggregate_without_one_of_its_sweeps(tmp_path, monkeypatch):
    """Fig. 6 draws Alg. 2 (its sweep) against Alg. 1 (Fig. 4's sweep): without Fig. 4's runs
    it must stop and say so, not write a figure without the dashed lines."""
    from scripts.figures import ablation
    monkeypatch.chdir(tmp_path)
    comm = [0, 10, 20, 30, 40]
    for s in range(2):
        fake_run(tmp_path / "results/sweeps/fig6/alg2", "a", s, comm, [1, .5, .2, .1, .05],
                 method="alg2", compressor={"name": "topk", "density": 0.01}, B=4)
    with pytest.raises(SystemExit, match="needs the alg1 runs of results/sweeps/fig4/alg1"):
        ablation.aggregate("fig6")
    assert not (tmp_path / "results/fig6/curves.csv").exists()
    for s in range(2):
        fake_run(tmp_path / "results/sweeps/fig4/alg1", "b", s, comm, [1, .4, .2, .1, .05],
                 compressor={"name": "randk", "density": 0.01}, B=4)
    ablation.aggregate("fig6")
    labels = {r["label"] for r in tables.read_csv(tmp_path / "results/fig6/curves.csv")}
    assert labels == {"alg2, B=4", "alg1, B=4"}


def test_tiny_multirun_sweep_end_to_end(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "experiments.logreg", "-m", "method=gluon,alg1",
           "steps=60", "log_every=20", "seed=0", f"hydra.sweep.dir={tmp_path}",
           f"results_dir={tmp_path}"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = statistics.load_runs(tmp_path)
    assert sorted(r.config["method"]["name"] for r in runs) == ["alg1", "gluon"]
    assert all(r.rows[-1]["step"] == 60 for r in runs)
    p2 = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p2.stdout.count("[skip]") == 2                           # a finished sweep: nothing


@pytest.mark.parametrize("task", ["logreg", "cnn"])
def test_readme_quotes_the_committed_reduction_table(task):
    """The README's Expected results show exactly the rows of results/fig2/reduction.csv (the
    reduction at the best baseline's final level, its interval, the paper's claim against it)."""
    table = fig2.readme_table(task, REPO / "results" / "fig2" / "reduction.csv")
    assert table in (REPO / "README.md").read_text()
    assert "| Alg. 1 (RandK) |" in table


def test_a_panel_takes_its_budget_from_its_runs_and_refuses_mixed_ones():
    from types import SimpleNamespace
    run = lambda budget: SimpleNamespace(config={"max_comm": budget})      # noqa: E731
    assert fig2.budget_of([run(500.0), run(500.0)], "s") == 500.0
    with pytest.raises(SystemExit, match="one"):
        fig2.budget_of([run(500.0), run(1000.0)], "s")
    with pytest.raises(SystemExit, match="max_comm"):
        fig2.budget_of([run(None)], "s")
