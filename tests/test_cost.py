"""The network cost model (scripts/figures/cost.py, docs/cost.md): formulas, crossovers, the pipeline."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from experiments.shared import cost_model
from scripts.figures import cost
from tests.conftest import REPO


def cols(**kw):
    base = {"step": 10, "bytes": 1000, "grads": 20, "up_bytes": 2000, "down_bytes": 2000,
            "star_down_bytes": 3000, "rounds": 10, "hops": 30}
    base.update(kw)
    return {k: np.array([float(v)]) for k, v in base.items()}


COMPUTE = cost_model.Compute(grad_s=1e-3, step_s={"gluon": 0.0, "alg1": 5e-4})


def test_star_time_is_compute_latency_and_both_links():
    net = cost_model.Network(8000.0, down_bps=16000.0, latency_s=0.01, frame_bytes=5, header_share=0.1)
    t = cost_model.modelled_time(cols(), "alg1", net, COMPUTE)[0]
    compute = 20 * 1e-3 + 10 * 5e-4
    latency = 2 * 0.01 * 10                                  # up and down, every round
    up = 8 * (1.1 * 1000 + 5 * 10) / 8000
    down = 8 * (1.1 * 3000 + 5 * 10) / 16000
    assert t == pytest.approx(compute + latency + up + down, rel=1e-12)


def test_ring_time_takes_the_slower_direction_and_every_hop():
    net = cost_model.Network(8000.0, down_bps=4000.0, latency_s=0.01, topology="ring")
    t = cost_model.modelled_time(cols(), "alg1", net, COMPUTE)[0]
    assert t == pytest.approx(0.025 + 0.01 * 30 + max(8 * 2000 / 8000, 8 * 2000 / 4000))
    # the rows' own measured compute instead of make bench's
    t2 = cost_model.modelled_time({**cols(), "compute_s": np.array([0.5])}, "alg1", net, None)[0]
    assert t2 == pytest.approx(t - 0.025 + 0.5)


def test_a_bad_network_is_refused():
    with pytest.raises(ValueError, match="topology"):
        cost_model.Network(1.0, topology="mesh")
    with pytest.raises(ValueError, match="bandwidth"):
        cost_model.Network(0.0)


@pytest.mark.parametrize("am,cm,ag,cg,side", [
    (2.0, 10.0, 1.0, 30.0, "below"),     # more compute, fewer bytes: first on slow links
    (1.0, 30.0, 2.0, 10.0, "above"),
    (1.0, 10.0, 2.0, 30.0, "always"),
    (2.0, 30.0, 1.0, 10.0, "never")])
def test_crossover_is_where_the_times_meet(am, cm, ag, cg, side):
    b, got = cost.crossover(am, cm, ag, cg)
    assert got == side
    if side in ("below", "above"):
        assert am + cm / b == pytest.approx(ag + cg / b)
        faster_below = am + cm / (b / 2) < ag + cg / (b / 2)
        assert faster_below == (side == "below")
    else:
        assert b == (math.inf if side == "always" else 0.0)


def fake_run(root: Path, method: str, seed: int, rows: list[dict], n=4, max_comm=10.0):
    d = root / f"{method}-{seed}"
    d.mkdir(parents=True)
    config = {"method": {"name": method}, "compressor": {"name": "randk"}, "seed": seed,
              "max_comm": max_comm, "n_workers": n, "experiment": "t"}
    (d / "summary.json").write_text(json.dumps({"status": "ok", "config": config,
                                                "wall_time": 1.0}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def rows_of(steps, gap, per_step: dict, comm_per_step: float):
    return [{"step": s, "comm": comm_per_step * s, "gap": g, "compute_s": 0.0,
             **{k: v * s for k, v in per_step.items()}} for s, g in zip(steps, gap)]


GLUON = {"bytes": 496, "grads": 1, "up_bytes": 744, "down_bytes": 744, "star_down_bytes": 496,
         "rounds": 1, "hops": 7}
ALG1 = {"bytes": 50, "grads": 3, "up_bytes": 80, "down_bytes": 80, "star_down_bytes": 60,
        "rounds": 1, "hops": 4}


@pytest.fixture
def panel(tmp_path):
    """Gluon reaches 0.1 at step 10 (seeds 0, 1) or 20 (seed 2) and ends at 0.09; Alg. 1
    reaches it at step 30 or 40: the crossover has a closed form."""
    steps = list(range(0, 101, 10))
    for seed, hit in enumerate((10, 10, 20)):
        fake_run(tmp_path, "gluon", seed, rows_of(steps, [1.0 if s < hit else 0.09 for s in steps],
                                                   GLUON, 0.1))
        ahit = 30 + 10 * (seed == 2)
        fake_run(tmp_path, "alg1", seed, rows_of(steps, [1.0 if s < ahit else 0.05 for s in steps],
                                                  ALG1, 0.1))
    p = cost.load_panel("logreg", str(tmp_path))
    p.window = 1e-9                          # narrower than a row: the raw curve
    return p


def test_crossover_rows_match_the_closed_form(panel):
    assert cost.gluon_level(panel) == pytest.approx(0.09)
    net = cost_model.Network(1.0, latency_s=1e-3, frame_bytes=10, topology="star")
    (row,) = cost.crossover_rows(panel, 0.1, net, COMPUTE, "t")
    comp = lambda m, s, per: s * per["grads"] * 1e-3 + s * COMPUTE.step_s.get(m, 0)
    A = lambda m, s, per: comp(m, s, per) + 2e-3 * s * per["rounds"]
    C = lambda s, per: 8 * (s * per["bytes"] + 10 * s + s * per["star_down_bytes"] + 10 * s)
    g_steps, a_steps = [10, 10, 20], [30, 30, 40]
    ag = np.mean([A("gluon", s, GLUON) for s in g_steps])
    cg = np.mean([C(s, GLUON) for s in g_steps])
    am = np.mean([A("alg1", s, ALG1) for s in a_steps])
    cm = np.mean([C(s, ALG1) for s in a_steps])
    assert row["side"] == "below" and row["seeds_reached"] == 3
    assert row["crossover_bps"] == pytest.approx((cg - cm) / (am - ag), rel=1e-9)
    assert row["ci_low_bps"] <= row["crossover_bps"] <= row["ci_high_bps"]
    assert row["time_ratio_at_1e+07"] == pytest.approx((am + cm / 1e7) / (ag + cg / 1e7))


def test_a_method_that_misses_the_level_has_no_crossover(panel, tmp_path):
    panel.runs["alg1"][0].rows = [dict(r, gap=1.0) for r in panel.runs["alg1"][0].rows]
    (row,) = cost.crossover_rows(panel, 0.1, cost_model.Network(1.0), COMPUTE, "t")
    assert row["side"] == "not reached" and row["seeds_reached"] == 2
    assert math.isnan(row["crossover_bps"])


def test_runs_without_the_cost_columns_are_named_not_used(tmp_path):
    fake_run(tmp_path, "gluon", 0, [{"step": 0, "comm": 0.0, "bytes": 0.0, "gap": 1.0}])
    p = cost.load_panel("logreg", str(tmp_path))
    assert not p.runs and "before the cost columns" in p.note
    assert "no a5a panel runs" in cost.load_panel("logreg", str(tmp_path / "none")).note


def test_compute_comes_from_the_committed_benchmarks():
    a5a = cost_model.bench_compute("a5a", REPO / "results" / "bench")
    text = (REPO / "results" / "bench" / "logreg.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| gluon |")).split("|")
    seconds, share = float(row[3]), float(row[4].strip().rstrip("%")) / 100
    assert a5a.grad_s == pytest.approx(seconds * share / (10_000 * 4))
    assert 1e-6 < a5a.grad_s < 1e-3 and set(a5a.step_s) >= {"gluon", "alg1", "alg2", "ef21_muon"}
    cnn = cost_model.bench_compute("cnn", REPO / "results" / "bench")
    assert 1e-4 < cnn.grad_s < 1e-1 and set(cnn.step_s) >= {"gluon", "alg1", "alg2", "ef21_muon"}
    assert all(v > 0 for v in cnn.step_s.values())


def test_a_method_without_a_benchmark_is_an_error_not_a_free_step():
    """A panel's method missing from the bench tables would be priced at its gradients only:
    the cost model refuses it and names the benchmark. An empty step_s (the GPU assumption of
    docs/cost.md) prices every step at 0 on purpose."""
    with pytest.raises(KeyError, match="no step time for alg2"):
        COMPUTE.of("alg2", [1.0], [1.0])
    assert cost_model.Compute(grad_s=1e-3).of("gluon", [2.0], [5.0])[0] == pytest.approx(2e-3)


@pytest.mark.parametrize("task", ["a5a", "cnn"])
def test_every_method_of_a_costed_panel_has_a_committed_benchmark(task):
    """Figure 2's panel and the fair panel of each task: `make bench` (a5a) and `make bench-cnn`
    time every method that `make fig-cost` re-costs."""
    from experiments.shared.fair_panels import BASELINES, METHODS
    compute = cost_model.bench_compute(task, REPO / "results" / "bench")
    assert set(compute.step_s) >= {"gluon", "alg1", "alg2", *BASELINES, *METHODS}
    assert all(v > 0 for v in compute.step_s.values())


def test_a_fair_panel_leaves_out_a_running_baseline_and_names_it(tmp_path):
    """As `make fair` reads it: a baseline with fewer seeds than the panel is not re-costed
    until its last seed lands, and the note names every baseline not re-costed."""
    steps = list(range(0, 101, 10))
    for seed in range(3):
        fake_run(tmp_path, "gluon", seed, rows_of(steps, [1.0] * 10 + [0.09], GLUON, 0.1))
        fake_run(tmp_path, "alg1", seed, rows_of(steps, [1.0] * 5 + [0.05] * 6, ALG1, 0.1))
    fake_run(tmp_path, "large_batch_gluon", 0, rows_of(steps, [0.05] * 11, GLUON, 0.1))
    p = cost.load_panel("fair_cnn", str(tmp_path))
    assert set(p.runs) == {"gluon", "alg1"} and p.budget == 10.0
    assert p.note.startswith("cnn-fair: panel still running, not re-costed yet: "
                             "large_batch_gluon, local_gluon, ef21_muon")
    assert "no cnn-fair panel runs" in cost.load_panel("fair_cnn", str(tmp_path / "none")).note


# ---------------------------------------------------------------- a tiny real CNN sweep

CNN = ["profile=cpu", "batch_size=4", "n_workers=2", "max_comm=3",
       "log_every=0", "log_comm=0.5", "eval_every=0", "steps=60", "task.eval_train=16",
       "task.eval_test=16", "task.whiten_images=32", "checkpoint_every=0", "progress_s=0",
       "method.lr=0.05"]
CNN_METHODS = {"gluon": ["method=gluon"],
               "alg1": ["method=alg1", "compressor=randk", "compressor.density=0.05", "method.q=0.5",
                         "method.B=2"]}


@pytest.fixture(scope="module")
def cnn_sweep(tmp_path_factory):
    from functools import partial
    from types import SimpleNamespace

    from experiments.run.lifecycle import execute
    from experiments.tasks import cnn
    from tests.conftest import compose_config
    from tests.test_cnn import synthetic
    task = SimpleNamespace(check=cnn.check, build=partial(cnn.build, data=synthetic()))
    root = tmp_path_factory.mktemp("fig2_cnn_cpu")
    for name, over in CNN_METHODS.items():
        for seed in (0, 1):
            execute(compose_config("cnn", *CNN, *over, f"seed={seed}",
                                   f"results_dir={root / 'results'}"),
                    root / "runs" / f"{name}-{seed}", task)
    return root / "runs"


def test_the_cnn_panel_is_costed_from_a_real_sweep(cnn_sweep, tmp_path, monkeypatch):
    before = {p: p.stat().st_mtime_ns for p in cnn_sweep.rglob("*") if p.is_file()}
    panel = cost.load_panel("cnn", str(cnn_sweep))
    assert set(panel.runs) == {"gluon", "alg1"} and panel.budget == 3
    for r in panel.runs["alg1"]:
        last = r.rows[-1]
        assert last["down_bytes"] == last["up_bytes"] > 0 and last["star_down_bytes"] > 0
        assert last["grads"] > last["step"]               # Delta costs 2, a sync B
    level = cost.gluon_level(panel)
    assert math.isfinite(level)
    rows = cost.crossover_rows(panel, level, cost_model.Network(1.0), cost_model.bench_compute("cnn"), "t")
    assert [r["method"] for r in rows] == ["alg1"]
    monkeypatch.setattr(cost, "load_panel", lambda task, sweep=None: panel)
    (path,) = cost.plot(("cnn",), out=tmp_path)
    assert path.name == "fig_cost_cnn.png" and path.stat().st_size > 10_000
    after = {p: p.stat().st_mtime_ns for p in cnn_sweep.rglob("*") if p.is_file()}
    assert after == before                                # nothing recomputed or rewritten


def test_recosting_one_panel_keeps_the_other_panels_rows(cnn_sweep, tmp_path, monkeypatch):
    """`scripts.figures.cost all --task cnn` re-costs the CNN panel; the a5a rows and spending table
    already in results/cost stay byte for byte, and a panel without runs drops nothing."""
    from experiments.shared.tables import write_csv
    panel = cost.load_panel("cnn", str(cnn_sweep))
    empty = cost.load_panel("cnn", str(tmp_path / "none"))          # no runs there
    assert not empty.runs
    monkeypatch.setattr(cost, "OUT", tmp_path)
    monkeypatch.setattr(cost, "load_panel", lambda task, sweep=None: panel)
    cnn_rows = cost.table(("cnn",))
    assert cnn_rows and {r["task"] for r in cnn_rows} == {"cnn"}
    a5a = [{**r, "task": "a5a", "crossover_bps": 123.0} for r in cnn_rows]    # a stand-in panel
    write_csv(a5a + cnn_rows, tmp_path / "crossover.csv")
    (tmp_path / "spent_a5a.md").write_text("a5a spending table\n")
    lines = (tmp_path / "crossover.csv").read_text().splitlines()
    a5a_lines = [ln for ln in lines if ln.startswith("a5a,") or ",a5a," in ln]
    assert len(a5a_lines) == len(a5a)
    cost.table(("cnn",))
    after = (tmp_path / "crossover.csv").read_text()
    assert after.splitlines() == lines                     # a5a kept and first, cnn the same again
    text = (tmp_path / "crossover.md").read_text()
    assert "a5a spending table" in text and (tmp_path / "spent_cnn.md").read_text() in text
    monkeypatch.setattr(cost, "load_panel", lambda task, sweep=None: empty)
    cost.table(("cnn",))                                    # no CNN runs here: nothing is dropped
    assert (tmp_path / "crossover.csv").read_text() == after
    note = (tmp_path / "crossover.md").read_text().splitlines()[-1]
    assert note.startswith("no cnn panel runs") and "the cnn rows above are kept" in note


def test_no_cnn_runs_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cost, "_SAID", set())
    panel = cost.load_panel("cnn", str(tmp_path / "none"))
    assert not panel.runs
    monkeypatch.setattr(cost, "load_panel", lambda task, sweep=None: panel)
    assert cost.plot(("cnn",), out=tmp_path) == []          # no figure, one line
    assert capsys.readouterr().out.strip().splitlines() == [panel.note]
    assert panel.note.startswith("no cnn panel runs under") and "make fig2-cnn" in panel.note


@pytest.mark.parametrize("task", ["logreg", "cnn"])
def test_docs_cost_shows_the_crossover_and_shaped_tables(task):
    """docs/cost.md's numbers are the committed results': the crossover table as printed from
    results/cost/crossover.csv, and the shaped-network table as printed from the task's
    measured CSV, where the model is within 25% of every measured time to the target."""
    import csv

    from scripts.bench import shaped
    page = (REPO / "docs" / "cost.md").read_text()
    assert cost.readme_table(cost_model.PANEL_NAMES[task], REPO / "results" / "cost" / "crossover.csv") \
        in page
    assert shaped.readme_table(task) in page
    with open(REPO / shaped.TASKS[task].out) as fh:
        rows = list(csv.DictReader(line for line in fh if not line.startswith("#")))
    assert len(rows) == 4 and {r["method"] for r in rows} == {"gluon", "alg1"}
    for r in rows:
        assert 0.75 <= float(r["model_s_to_target"]) / float(r["measured_s_to_target"]) <= 1.25


def test_docs_cost_shows_the_cnn_fair_crossovers():
    """docs/cost.md's table for the CNN's fair panel is the one printed from crossover.csv, and
    large-batch Gluon, the fair panel's first baseline, is in it."""
    page = (REPO / "docs" / "cost.md").read_text()
    table = cost.readme_table("cnn-fair", REPO / "results" / "cost" / "crossover.csv")
    assert "| large-batch Gluon |" in table and table in page


def test_docs_performance_shows_the_cnn_bench_summary():
    """docs/performance.md's CNN table is results/bench/cnn.md's summary, every method that
    `make fig-cost` re-costs included."""
    from scripts.bench.bench_cnn import COSTED
    bench = (REPO / "results" / "bench" / "cnn.md").read_text().splitlines()
    start = next(i for i, line in enumerate(bench) if line.startswith("| method | steps"))
    end = next(i for i in range(start, len(bench)) if not bench[i].startswith("|"))
    summary = bench[start:end]
    assert [row.split("|")[1].strip() for row in summary[2:]] == COSTED
    assert "\n".join(summary) in (REPO / "docs" / "performance.md").read_text()


# ---------------------------------------------------------------- the LM task

def test_lm_compute_from_its_bench_table(tmp_path):
    """make bench-lm's table: t_grad is Gluon's gradient time per worker; a method's time
    outside the gradients is its sync and other steps weighted by q, at the smallest B."""
    (tmp_path / "lm.md").write_text(
        "LM task, profile lm/cpu (1 parameters), n = 4 workers, q = 0.1, RandK/TopK density 0.01\n\n"
        "| method | step kind | steps timed | CPU ms/step | uplink/step | gradients | rest |\n"
        "|---|---|---:|---:|---:|---:|---:|\n"
        "| gluon | every step | 40 | 100.0 | 1.0000 | 80.0 | 1 |\n"
        "| alg1, B = 4 | sync (u = 1) | 10 | 340.0 | 1.0000 | 320.0 | 1 |\n"
        "| alg1, B = 4 | other (u = 0) | 40 | 200.0 | 0.0100 | 160.0 | 1 |\n"
        "| alg1, B = 16 | sync (u = 1) | 10 | 1400.0 | 1.0000 | 1300.0 | 1 |\n"
        "| alg1, B = 16 | other (u = 0) | 40 | 900.0 | 0.0100 | 160.0 | 1 |\n"
        "\nEvaluation: one row 71 ms of CPU, the full validation pass 1.2 s.\n")
    c = cost_model._lm_compute(tmp_path / "lm.md")
    assert c.grad_s == pytest.approx(0.080 / 4)
    assert c.step_s["gluon"] == pytest.approx(0.020 / 4)
    assert c.step_s["alg1"] == pytest.approx((0.1 * 0.020 + 0.9 * 0.040) / 4)
    no_gluon = tmp_path / "no_gluon" / "lm.md"
    no_gluon.parent.mkdir()
    no_gluon.write_text("\n".join(l for l in (tmp_path / "lm.md").read_text().splitlines()
                                  if not l.startswith("| gluon ")))
    with pytest.raises(ValueError, match="no 'gluon' row"):
        cost_model._lm_compute(no_gluon)
    committed = cost_model.bench_compute("lm_iid", REPO / "results" / "bench")
    assert 1e-3 < committed.grad_s < 1.0 and set(committed.step_s) >= {"gluon", "alg1", "alg2",
                                                                        "ef21_muon"}


def test_the_lm_panel_is_costed_from_a_real_sweep(tmp_path):
    from experiments.run.lifecycle import execute
    from experiments.tasks import lm
    from tests.conftest import compose_config
    tiny = ["profile=lm/cpu", "task.n_layer=1", "task.n_head=2", "task.n_embd=16",
            "task.block_size=16", "batch_size=4", "task.eval_train=8", "task.eval_val=8",
            "wandb.mode=disabled", "progress_s=0", "max_comm=3", "log_every=0", "log_comm=0.5",
            "steps=200", "checkpoint_every=0", f"results_dir={tmp_path}"]
    methods = {"gluon": ["method=gluon", "method.lr=0.02"],
               "alg1": ["method=alg1", "compressor.density=0.05", "method.q=0.5", "method.B=2",
                        "method.lr=0.005"]}
    for name, over in methods.items():
        for seed in (0, 1):
            execute(compose_config("lm", *tiny, *over, f"seed={seed}"),
                    tmp_path / "runs" / f"{name}-{seed}", lm)
    panel = cost.load_panel("lm_iid", str(tmp_path / "runs"))
    assert set(panel.runs) == {"gluon", "alg1"} and panel.budget == 3
    assert panel.metric == "val_loss"
    level = cost.gluon_level(panel)
    rows = cost.crossover_rows(panel, level, cost_model.Network(1e6), cost_model.bench_compute(
        "lm_iid"), "t")
    assert [r["method"] for r in rows] == ["alg1"] and rows[0]["task"] == "lm-iid"
    assert "no lm-plays panel runs" in cost.load_panel("lm_plays", str(tmp_path / "none")).note
