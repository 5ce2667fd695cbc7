"""What compression buys (scripts/figures/fair.py, docs/fair.md): the decomposition's arithmetic on
hand-made runs with known answers, the rule fixed before the runs, both readings (uplink and
compute), and the committed tables quoted word for word where the docs show them."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from experiments.shared.statistics import reduction_rows
from experiments.shared import decomposition as dec
from experiments.shared import fair_panels
from experiments.shared.fair_panels import DENSE
from scripts.figures import fair

from experiments.shared.files import REPO
STEPS = list(range(0, 101, 5))      # the rows: 0, 5, ..., 100 (the budget)


def fake(root: Path, method: str, seed: int, gaps: list[float], *, comm: float = 1.0,
         grads: float = 1.0, density: float | None = None) -> None:
    """A finished run with f - f* = ``gaps`` at its rows 0, 5, ..., 100, whose uplink is
    ``comm`` times that and whose gradient evaluations are ``grads`` times that."""
    d = root / f"{method}-{density}-{seed}"
    d.mkdir(parents=True)
    comp = {"name": "randk", "density": density} if density else {"name": "identity"}
    config = {"method": {"name": method}, "compressor": comp, "seed": seed,
              "max_comm": 100 * comm, "max_grads": 100 * grads}
    (d / "summary.json").write_text(json.dumps({"status": "ok", "config": config,
                                                "wall_time": 1.0}))
    (d / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "comm": c * comm, "grads": c * grads, "bytes": 4 * c, "gap": g})
        + "\n" for i, (c, g) in enumerate(zip(STEPS, gaps))))


def drop(at: int, to: float) -> list[float]:
    """A method: f - f* = 1 before row ``at``, then ``to``."""
    return [1.0 if c < at else to for c in STEPS]


def baseline(at: int, level: float) -> list[float]:
    """A baseline that ends at ``level`` and first reaches it at row ``at`` (a tenth below it
    there, so that the level it holds at the end, a geometric mean, is reached at ``at``
    whatever its last bit)."""
    return [1.0 if c < at else (0.9 * level if c == at else level) for c in STEPS]


def make_panel(root: Path, axis: str) -> Path:
    """Three seeds on one axis (``comm`` or ``grads``: the rows' 0..100 are that axis; the other
    is scaled, so a reading of the wrong column gives other numbers). Final levels: Gluon 0.1,
    large-batch Gluon 0.05 (the best dense), Local Gluon 0.2, reached at 80, 80 and 70. Alg. 1
    drops to 0.01 at 35, 40 and 45 (mean 40); Alg. 2 to 0.15 at 20, 30 and 40, no lower."""
    other = "grads" if axis == "comm" else "comm"
    for s in range(3):
        fake(root, "gluon", s, baseline(80, 0.1), **{other: 1.0})
        fake(root, "large_batch_gluon", s, baseline(80, 0.05), **{other: 16.0})
        fake(root, "local_gluon", s, baseline(70, 0.2), **{other: 4.0})
        fake(root, "alg1", s, drop((35, 40, 45)[s], 0.01), density=0.01, **{other: 0.1})
        fake(root, "alg2", s, drop((20, 30, 40)[s], 0.15), **{other: 0.1})
    return root


@pytest.fixture
def panel(tmp_path):
    return make_panel(tmp_path, "comm")


def table(root, x="comm"):
    groups = fair.panel_runs("logreg", "uplink", root)
    rows = reduction_rows(groups, "gap", eps_list=[], baselines=list(DENSE), budget=100,
                          width=1e-9, task="a5a", x=x)        # a window narrower than a row
    return {(r["method"], r["baseline"]): r
            for r in dec.decomposition(rows, "a5a", "uplink" if x == "comm" else "compute")}


def test_decomposition_at_equal_uplink_by_hand(panel):
    d = table(panel)
    mean = (35 + 40 + 45) / 3
    assert d[("alg1", "gluon")]["reduction"] == pytest.approx(1 - mean / 80)
    assert d[("alg1", "large_batch_gluon")]["reduction"] == pytest.approx(1 - mean / 80)
    assert d[("alg1", "local_gluon")]["reduction"] == pytest.approx(1 - mean / 70)
    assert d[("alg1", "gluon")]["level"] == pytest.approx(0.1)
    assert d[("alg1", "local_gluon")]["level"] == pytest.approx(0.2)
    # the best dense baseline: the lowest final level, here large-batch Gluon's 0.05
    assert [b for (m, b), r in d.items() if m == "alg1" and r["best_dense"]] == ["large_batch_gluon"]
    # three seeds: the paired t-interval, which holds the point; it lies above 0
    r = d[("alg1", "gluon")]
    assert r["interval"] == "95% t-interval" and 0 < r["low"] < r["reduction"] < r["high"]
    assert r["verdict"] == "adds"
    # Alg. 2 stops at 0.15: it reaches Local Gluon's 0.2 (at 20, 30, 40), not the others'
    assert d[("alg2", "local_gluon")]["reduction"] == pytest.approx(1 - 30 / 70)
    assert d[("alg2", "gluon")]["verdict"] == "not reached (0/3 seeds)"
    assert math.isnan(d[("alg2", "large_batch_gluon")]["reduction"])


def test_decomposition_at_equal_compute_reads_gradient_evaluations(tmp_path):
    """The same shape against gradients; the uplink columns, scaled differently per method,
    would give other numbers."""
    d = table(make_panel(tmp_path, "grads"), x="grads")
    mean = (35 + 40 + 45) / 3
    assert d[("alg1", "gluon")]["method_x"] == pytest.approx(mean)
    assert d[("alg1", "gluon")]["baseline_x"] == pytest.approx(80)
    assert d[("alg1", "local_gluon")]["reduction"] == pytest.approx(1 - mean / 70)
    assert d[("alg1", "gluon")]["verdict"] == "adds"


def test_a_method_slower_than_the_baseline_costs(tmp_path):
    for s in range(3):
        fake(tmp_path, "gluon", s, baseline(40, 0.1))
        fake(tmp_path, "alg1", s, drop((70, 80, 90)[s], 0.01), density=0.01)
    d = table(tmp_path)
    assert d[("alg1", "gluon")]["reduction"] == pytest.approx(1 - 80 / 40)
    assert d[("alg1", "gluon")]["verdict"] == "costs"


@pytest.mark.parametrize("args,expected", [
    ((0.3, 0.1, 0.5, 10, 10), "adds"), ((-0.3, -0.5, -0.1, 10, 10), "costs"),
    ((0.1, -0.05, 0.2, 10, 10), "not told apart"), ((0.0, 0.0, 0.0, 10, 10), "not told apart"),
    ((math.nan, math.nan, math.nan, 7, 10), "not reached (7/10 seeds)"),
    ((0.5, 0.4, 0.6, 9, 10), "not reached (9/10 seeds)")])
def test_the_rule_fixed_before_the_runs(args, expected):
    assert dec.verdict(*args) == expected


def test_alg1_at_another_density_is_its_own_group(tmp_path):
    for s in range(2):
        fake(tmp_path, "alg1", s, drop(30, 0.01), density=0.01)
        fake(tmp_path, "alg1", s, drop(40, 0.01), density=0.1)
        fake(tmp_path, "gluon", s, baseline(90, 0.1))
    assert list(fair.panel_runs("logreg", "uplink", tmp_path)) == ["gluon", "alg1", "alg1@0.1"]


def test_the_decomposition_reads_alg1_at_each_density(tmp_path):
    """Alg. 1 at 10% gets its own rows, after Alg. 1 at 1%, with its own reduction: reaching
    Gluon's level (0.1, at 90) at 30 and 40 in both seeds, 1 - 30/90 and 1 - 40/90."""
    for s in range(2):
        fake(tmp_path, "alg1", s, drop(30, 0.01), density=0.01)
        fake(tmp_path, "alg1", s, drop(40, 0.01), density=0.1)
        fake(tmp_path, "gluon", s, baseline(90, 0.1))
    d = table(tmp_path)
    assert [m for m, b in d if b == "gluon"] == ["alg1", "alg1@0.1"]
    assert d[("alg1", "gluon")]["reduction"] == pytest.approx(1 - 30 / 90)
    assert d[("alg1@0.1", "gluon")]["reduction"] == pytest.approx(1 - 40 / 90)
    assert "| Alg. 1 (RandK 10%) |" in dec.markdown(list(d.values()))


def test_the_sentence_and_table_are_written_from_the_rows(panel, tmp_path, monkeypatch):
    monkeypatch.setattr(fair, "OUT", tmp_path / "out")
    (tmp_path / "out").mkdir()
    fair.write_decomposition(list(table(panel).values()), "a5a")
    text = (tmp_path / "out" / "decomposition.md").read_text()
    r = table(panel)[("alg1", "gluon")]
    assert f"{100 * r['reduction']:.0f}% [{100 * r['low']:.0f}, {100 * r['high']:.0f}]" in text
    assert "Against large-batch Gluon, the best dense baseline, it " in text
    assert "Against Local Gluon, which sends only the syncs, it " in text and "(best dense)" in text


def test_writing_one_panel_leaves_the_others_rows_as_they_were(panel, tmp_path):
    """decomposition.csv holds several panels (a5a and the CNN; the LM's two splits): writing one
    keeps the other's cells byte for byte, not re-read as floats ("5" becoming "5.0")."""
    rows = list(table(panel).values())
    dec.write_decomposition(rows, "a5a", tmp_path)
    before = (tmp_path / "decomposition.csv").read_text().splitlines()
    assert any(",95% t-interval,3,3," in line for line in before)          # 3 seeds, as written
    dec.write_decomposition([{**r, "task": "cnn"} for r in rows], "cnn", tmp_path)
    after = (tmp_path / "decomposition.csv").read_text().splitlines()
    assert [line for line in after if line.startswith("a5a,")] == before[1:]
    assert len(after) == 2 * len(before) - 1


def test_aggregate_plot_and_quote_from_run_folders(tmp_path, monkeypatch):
    """The whole path on hand-made runs: a panel with only its uplink reading is aggregated
    (the compute reading said to be missing), drawn, and quoted into a page's block."""
    sweeps = tmp_path / "sweeps"
    make_panel(sweeps / "logreg" / "uplink", "comm")
    monkeypatch.setattr(fair_panels, "SWEEPS", sweeps)     # where sweep_of looks
    monkeypatch.setattr(fair, "OUT", tmp_path / "out")
    fair.aggregate("logreg")
    rows = {(r["reading"], r["method"], r["baseline"]): r
            for r in fair.read_csv(tmp_path / "out" / "decomposition.csv")}
    assert {k[0] for k in rows} == {"uplink"}
    assert rows[("uplink", "alg1", "local_gluon")]["verdict"] in ("adds", "not told apart")
    settings = json.loads((tmp_path / "out" / "logreg_settings.json").read_text())
    assert settings["uplink"]["alg1"]["seeds"] == [0, 1, 2]
    assert fair.plot(tmp_path / "fig").exists()
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- fair:begin -->\nstale\n<!-- fair:end -->\nafter\n")
    fair.quote_in_docs([page])
    text = page.read_text()
    assert "stale" not in text and fair.readme() in text and text.endswith("after\n")
    front = tmp_path / "front.md"                     # the README: the sentence alone
    front.write_text("<!-- fair-answer:begin -->\nstale\n<!-- fair-answer:end -->\n")
    fair.quote_in_docs([front])
    sentence = fair.quoted()["fair-answer"]
    assert front.read_text() == f"<!-- fair-answer:begin -->\n{sentence}<!-- fair-answer:end -->\n"
    bare = tmp_path / "bare.md"
    bare.write_text("no block here\n")
    with pytest.raises(SystemExit, match="no <!-- fair:begin"):
        fair.quote_in_docs([bare])


def _block(path: Path, name: str) -> str:
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", path.read_text(), re.S)
    assert m, f"{path} has no {name}:begin/{name}:end block"
    return m.group(1)


@pytest.mark.parametrize("doc,name", [("docs/fair.md", "fair"), ("README.md", "fair"),
                                      ("README.md", "fair-headline")])
def test_docs_quote_the_committed_decomposition(doc, name, monkeypatch):
    monkeypatch.chdir(REPO)
    assert _block(REPO / doc, name) == fair.quoted()[name]
    assert fair.quoted()["fair-answer"].strip() in fair.quoted()["fair"]


def test_randk_at_a_tenth_and_one_percent_is_one_compressor_on_a5a():
    """docs/fair.md runs Alg. 1 at RandK 10% on a5a but not at 0.1%: on its 124 coordinates
    (logreg.N_FEATURES weights and a bias) both densities keep k = 1 coordinate, so every
    message, and with it every run, is the same as at Figure 2's 1%."""
    import torch
    from experiments.tasks.logreg import N_FEATURES
    from gluon import make_compressor
    d = N_FEATURES + 1
    x = torch.randn(d, generator=torch.Generator().manual_seed(0))
    tenth, one = make_compressor("randk", density=0.001), make_compressor("randk", density=0.01)
    assert tenth.k(d) == one.k(d) == 1 and make_compressor("randk", density=0.1).k(d) == 12
    for seed in range(20):
        assert torch.equal(tenth.decompress(tenth.compress(x, seed)),
                           one.decompress(one.compress(x, seed)))


def test_a_reading_takes_the_named_groups_from_a_shared_sweep(tmp_path):
    """The CNN's uplink reading reads Gluon, Alg. 1 and 2 from the CNN-gap study's panel: the
    named labels come from there, the others there are left, and a label with runs in both
    places is refused."""
    own, other = tmp_path / "own", tmp_path / "other"
    for s in range(2):
        fake(own, "large_batch_gluon", s, baseline(80, 0.05))
        fake(other, "gluon", s, baseline(80, 0.1))
        fake(other, "ef21_muon", s, baseline(60, 0.1))
    groups = fair.panel_runs("cnn", "uplink", own, shared=(other, ("gluon", "alg1")))
    assert list(groups) == ["gluon", "large_batch_gluon"]
    assert [r.config["seed"] for r in groups["gluon"]] == [0, 1]
    fake(own, "gluon", 0, baseline(80, 0.1))
    with pytest.raises(SystemExit, match="gluon has runs under both"):
        fair.panel_runs("cnn", "uplink", own, shared=(other, ("gluon",)))
    assert fair_panels.SHARED[("cnn", "uplink")][1] == ("gluon", "alg1", "alg2")


@pytest.mark.parametrize("what,reduction,low,high,expected", [
    ("uplink", 0.62, 0.58, 0.66, "needs 62% [58, 66] less uplink (adds)"),
    ("gradient evaluations", 0.5, 0.4, 0.6, "needs 50% [40, 60] fewer gradient evaluations"),
    ("gradient evaluations", -0.99, -1.59, -0.55,
     "needs 99% [55, 159] more gradient evaluations (costs)")])
def test_a_reduction_is_said_in_words_with_its_sign(what, reduction, low, high, expected):
    r = {"reduction": reduction, "low": low, "high": high, "seeds_reached": 10, "seeds": 10,
         "verdict": dec.verdict(reduction, low, high, 10, 10)}
    assert dec._against(r, what).startswith(expected)


def test_large_batch_gluons_tuned_b_is_named_in_each_reading(panel):
    """At equal compute large-batch Gluon may tune to B = 1 (Gluon itself): the table and the
    sentence say which B the reading's large-batch Gluon has."""
    groups = fair.panel_runs("logreg", "uplink", panel)
    rows = reduction_rows(groups, "gap", eps_list=[], baselines=list(DENSE), budget=100,
                          width=1e-9, task="a5a", x="comm")
    d = dec.decomposition(rows, "a5a", "uplink", {"large_batch_gluon": 16, "alg1": 4})
    assert {r["baseline_B"] for r in d if r["baseline"] == "large_batch_gluon"} == {16}
    assert {r["baseline_B"] for r in d if r["baseline"] != "large_batch_gluon"} == {""}
    text = dec.markdown(d)
    assert "(best dense, B = 16)" in text and "large-batch Gluon (tuned for this reading: B = 16)" in text
    said = dec.answer(d).splitlines()                 # a line per reading, short sentences
    assert said[:2] == ["**a5a**:", ""] and said[2].startswith(
        "- Equal uplink. Against Gluon at B = 1 (the paper's baseline), Alg. 1 ")


def test_the_raw_first_hit_stands_beside_the_smoothed_one(panel):
    """Every cell carries the raw first hit's reduction too (docs/statistics.md): the hand-made
    runs hold their levels exactly, so the raw reduction equals the smoothed one here."""
    d = table(panel)
    r = d[("alg1", "gluon")]
    assert r["raw_reduction"] == pytest.approx(r["reduction"])
    assert r["raw_low"] <= r["raw_reduction"] <= r["raw_high"]
    text = dec.markdown(list(d.values()))
    assert f"; raw {100 * r['raw_reduction']:.0f}% [" in text and "then by the raw first hit" in text


def test_a_reading_reads_methods_off_runs_that_cover_its_budget(tmp_path, monkeypatch):
    """The CNN's compute reading runs only its dense B = 1 baselines to the gradient budget and
    reads Alg. 1 (and the others READ_OFF names) off the uplink runs, which spend more; a run
    that stops before the budget is refused by name."""
    sweeps = tmp_path / "sweeps"
    monkeypatch.setattr(fair_panels, "SWEEPS", sweeps)
    monkeypatch.setattr(fair_panels, "SHARED", {})
    for s in range(2):
        fake(sweeps / "cnn" / "compute", "gluon", s, baseline(80, 0.1), grads=1.0)  # budget 100
        fake(sweeps / "cnn" / "uplink", "alg1", s, drop(30, 0.01), grads=2.0, density=0.01)
        fake(sweeps / "cnn" / "uplink", "large_batch_gluon", s, baseline(80, 0.05), grads=0.5)
    groups, budget = fair_panels.reading_runs("cnn", "compute")
    assert budget == 100 and list(groups) == ["gluon", "alg1"]      # not the uplink's LB Gluon
    assert fair_panels.READ_OFF[("cnn", "compute")][1] == ("local_gluon", "ef21_muon", "alg1",
                                                            "alg2")
    fake(sweeps / "cnn" / "uplink", "alg2", 0, drop(30, 0.1), grads=0.5)   # ends at 50 < 100
    with pytest.raises(SystemExit, match="1 alg2 run.* stop before 100"):
        fair_panels.reading_runs("cnn", "compute")


def make_recipe(text: str, target: str) -> str:
    """A make target's recipe, with its stages' (prerequisites named in a ``FAIR_*_STAGES``
    variable) in order."""
    head, body = text.split(f"\n{target}:")[1].split("\n", 1)
    stages = re.match(r"\s*\$\((\w+_STAGES)\)", head)
    if not stages:
        return body.split("\n\n")[0]
    names = re.search(rf"\n{stages.group(1)} = (.*)", text).group(1).split()
    return "\n".join(make_recipe(text, name) for name in names)


@pytest.mark.parametrize("target, folder", [("fair-runs", "fair_logreg"),
                                            ("fair-cnn-runs", "fair_cnn")])
def test_make_runs_every_tuning_grid_before_its_strict_selection(target, folder):
    """Each grid of configs/experiment/<folder>/ (an edge extension included) is run by its make
    target, and the target's selection is strict: a grid added for an edge but left out of the
    recipe would leave the choice on that edge, and a non-strict selection would go on to the
    panel with it."""
    text = (REPO / "Makefile").read_text()
    recipe = make_recipe(text, target)
    grids = {p.stem for p in (REPO / "configs" / "experiment" / folder).glob("tune_*.yaml")}
    named = set(re.findall(r"\btune_\w+", recipe.replace("tune_$$m", "")))
    loops = re.findall(r"for [mg] in ([^;]+); do", recipe)
    named |= {w if w.startswith("tune_") else f"tune_{w}"
              for loop in loops for w in loop.replace("\\", " ").split()}
    assert grids <= named, f"not run by make {target}: {sorted(grids - named)}"
    var = re.search(r"\$\((FAIR_SELECT_\w+)\)", recipe).group(1)
    definition = re.search(rf"\n{var} = ((?:.*\\\n)*.*)", text).group(1)
    assert "--strict" in definition, f"{var} is not strict"


def test_local_gluons_q_line_runs_through_its_grids_choice(tmp_path, compose_cfg):
    """make fair-cnn-runs searches Local Gluon's q once its lr x beta grid has chosen: the line
    takes lr, beta and B from the config the selection wrote (tuned=fair_cnn/local_gluon) and
    only q from its own grid, its step cap lets 500 syncs land at its smallest q, and a strict
    selection reads it before the panel runs."""
    import shutil

    from omegaconf import OmegaConf
    from scripts.analysis.select_tuned import tuned_yaml
    recipe = make_recipe((REPO / "Makefile").read_text(), "fair-cnn-runs")
    lines = recipe.splitlines()
    at = next(i for i, line in enumerate(lines) if "experiment=fair_cnn/tune_local_gluon_q" in line)
    assert "tuned=fair_cnn/local_gluon" in lines[at]
    assert "--only local_gluon" in lines[at - 1] and "--only local_gluon" in lines[at + 1]
    panel = next(i for i, line in enumerate(lines) if "tuned=fair_cnn/local_gluon" in line
                 and "experiment=fair_cnn/uplink" in line)
    assert panel == at + 2
    chosen = {"method": {"name": "local_gluon", "q": 0.1, "B": 64, "lr": 0.0125, "beta": 0.9},
              "compressor": {"name": "zero"}}
    (tmp_path / "tuned" / "fair_cnn").mkdir(parents=True)
    (tmp_path / "tuned" / "fair_cnn" / "local_gluon.yaml").write_text(
        tuned_yaml(chosen, -0.1, "a test", "a test"))
    shutil.copy(REPO / "configs" / "cnn.yaml", tmp_path / "cnn.yaml")
    grid = OmegaConf.load(REPO / "configs" / "experiment" / "fair_cnn" / "tune_local_gluon_q.yaml")
    qs = [float(q) for q in str(grid.hydra.sweeper.params["method.q"]).split(",")]
    assert min(qs) < 0.1 < max(qs)                     # both sides of the grid's q
    for q in qs:
        cfg = compose_cfg("cnn", "experiment=fair_cnn/tune_local_gluon_q",
                          "tuned=fair_cnn/local_gluon", f"method.q={q}", config_dir=tmp_path)
        assert (cfg.method.name, cfg.method.q, cfg.method.B, cfg.method.lr, cfg.method.beta) == \
            ("local_gluon", q, 64, 0.0125, 0.9)
        assert cfg.compressor.name == "zero" and cfg.max_comm == 500
        steps_needed = cfg.max_comm / q + 5 * math.sqrt(cfg.max_comm * (1 - q)) / q  # 5 sd
        assert cfg.steps >= steps_needed, (q, cfg.steps, steps_needed)


def test_the_a5a_tuning_table_names_the_committed_choices():
    """docs/fair.md's "Where the a5a tuning ended" gives each method's chosen settings: they are the
    ones `select_tuned` wrote (configs/tuned/fair_logreg*/), so a re-selection that moves a choice
    and leaves the page behind fails here."""
    from omegaconf import OmegaConf
    text = (REPO / "docs" / "fair.md").read_text()
    table = text.split("**Where the a5a tuning ended**")[1].split("\n\n")[1]
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]
    names = {"large-batch Gluon": "fair_logreg/large_batch_gluon", "Local Gluon": "fair_logreg/local_gluon",
             "Alg. 1": "fair_logreg/alg1", "Alg. 2": "fair_logreg/alg2",
             "EF21-Muon (TopK 1%)": "fair_logreg/ef21_muon",
             "large-batch Gluon, for equal compute": "fair_logreg_compute/large_batch_gluon"}
    assert sorted(label.strip() for label, _ in rows) == sorted(names)
    for label, chosen in rows:
        method = OmegaConf.load(REPO / "configs" / "tuned" / f"{names[label.strip()]}.yaml").method
        said = {k: float(v.replace(",", "")) for k, v in
                re.findall(r"\b(q|B|lr|beta)(?: =)? ([\d.,]*\d)", chosen)}
        assert said == {k: float(method[k]) for k in ("q", "B", "lr", "beta") if k in method}, label


def test_the_readme_prices_the_lever_from_the_committed_panel():
    """The README's paragraph on what the large batch costs quotes the panels' settings
    (results/fair/{logreg,cnn}_settings.json, written by `make fair`): on a5a, gradients per unit
    of uplink at equal uplink and what each method sends at equal compute; on the CNN, the
    gradients large-batch Gluon and Alg. 1 spend over the uplink budget."""
    s = json.loads((REPO / "results" / "fair" / "logreg_settings.json").read_text())
    text = (REPO / "README.md").read_text()
    para = " ".join(text.split("The price of that lever is compute:")[1].split("\n\n")[0].split())
    lb, compute = s["uplink"]["large_batch_gluon"], s["compute"]
    assert f"evaluates {lb['end_grads'] / lb['end_comm']:,.0f} minibatch gradients" in para
    assert f"({compute['alg1']['budget']:,.0f} gradients per worker)" in para
    dense = compute["large_batch_gluon"]
    assert f"sends {dense['end_comm']:,.0f} dense gradients where Alg. 1 sends " \
           f"{compute['alg1']['end_comm']:,.0f}" in para
    cnn = json.loads((REPO / "results" / "fair" / "cnn_settings.json").read_text())["uplink"]
    lb = cnn["large_batch_gluon"]
    assert f"large-batch Gluon (B = {lb['method']['B']}) evaluates {lb['end_grads']:,.0f} " \
           f"minibatch gradients per worker, Alg. 1 {cnn['alg1']['end_grads']:,.0f}" in para
    assert lb["end_grads"] < cnn["alg1"]["end_grads"]      # "not even dearer"


def test_a_baseline_whose_panel_is_still_running_is_left_out_and_said(tmp_path, monkeypatch, capsys):
    """`make fair` reads a reading while a baseline's seeds are still landing (the CNN fills
    baseline by baseline): that baseline waits, named, instead of stopping the whole reading."""
    sweeps = tmp_path / "sweeps"
    monkeypatch.setattr(fair_panels, "SWEEPS", sweeps)
    monkeypatch.setattr(fair_panels, "SHARED", {})
    for s in range(3):
        fake(sweeps / "cnn" / "uplink", "gluon", s, baseline(80, 0.1))
        fake(sweeps / "cnn" / "uplink", "alg1", s, drop(30, 0.01), density=0.01)
    fake(sweeps / "cnn" / "uplink", "large_batch_gluon", 0, baseline(80, 0.05))
    groups, _ = fair_panels.reading_runs("cnn", "uplink")
    assert list(groups) == ["gluon", "alg1"]
    assert "large_batch_gluon has 1 of 3 seeds; left out" in capsys.readouterr().out


def test_a_reading_without_every_dense_baseline_names_no_best(tmp_path, monkeypatch, capsys):
    """Without one dense baseline's panel the best dense baseline is undecided: the reading is
    read against the baselines it has (each reduction stands against its own baseline), no row
    is marked best, the missing column says its panel is running, and the sentence says which
    panel the reading waits for."""
    import shutil
    sweeps = tmp_path / "sweeps"
    make_panel(sweeps / "logreg" / "uplink", "comm")
    for run in (sweeps / "logreg" / "uplink").glob("local_gluon-*"):
        shutil.rmtree(run)
    monkeypatch.setattr(fair_panels, "SWEEPS", sweeps)
    monkeypatch.setattr(fair, "OUT", tmp_path / "out")
    fair.aggregate("logreg")
    assert "undecided until local_gluon has its panel" in capsys.readouterr().out
    rows = fair.read_csv(tmp_path / "out" / "decomposition.csv")
    assert {(r["method"], r["baseline"]) for r in rows if r["method"] == "alg1"} == \
        {("alg1", "gluon"), ("alg1", "large_batch_gluon")}
    assert not any(r["best_dense"] == "True" for r in rows)
    text = (tmp_path / "out" / "decomposition.md").read_text()
    assert "best dense)" not in text and "the best dense baseline," not in text
    assert "| a5a | uplink | Alg. 1 (RandK 1%) |" in text and "| panel running |" in text
    assert "Local Gluon's panel is still running, so the best dense baseline is undecided." in text


def test_no_dense_baseline_no_reading(tmp_path, monkeypatch, capsys):
    """A reading with none of its dense baselines' panels has nothing to be read against."""
    sweeps = tmp_path / "sweeps"
    for s in range(2):
        fake(sweeps / "logreg" / "uplink", "alg1", s, drop(30, 0.01), density=0.01)
    monkeypatch.setattr(fair_panels, "SWEEPS", sweeps)
    monkeypatch.setattr(fair, "OUT", tmp_path / "out")
    fair.aggregate("logreg")
    assert "no dense baseline's panel is complete yet; no reduction is read" in capsys.readouterr().out
    assert not (tmp_path / "out" / "decomposition.csv").exists()


def test_the_lever_alone_is_read_against_gluon(tmp_path):
    """Large-batch Gluon and Local Gluon get a row each against Gluon at B = 1 alone (what the
    lever buys without compression), judged by the same rule: Gluon ends at 0.1, first reached
    at 80; large-batch Gluon reaches it at 20, 30, 40 (mean 30), Local Gluon at 60 in every
    seed."""
    for s in range(3):
        fake(tmp_path, "gluon", s, baseline(80, 0.1))
        fake(tmp_path, "large_batch_gluon", s, drop((20, 30, 40)[s], 0.05))
        fake(tmp_path, "local_gluon", s, drop(60, 0.08))
        fake(tmp_path, "alg1", s, drop(50, 0.09), density=0.01)
    d = table(tmp_path)
    assert d[("large_batch_gluon", "gluon")]["reduction"] == pytest.approx(1 - 30 / 80)
    assert d[("large_batch_gluon", "gluon")]["verdict"] == "adds"
    assert d[("local_gluon", "gluon")]["reduction"] == pytest.approx(1 - 60 / 80)
    assert {b for m, b in d if m in ("large_batch_gluon", "local_gluon")} == {"gluon"}
    text = dec.markdown(list(d.values()))
    lines = [line for line in text.splitlines() if line.startswith("| a5a")]
    assert [line.split(" | ")[2] for line in lines] == \
        ["large-batch Gluon", "Local Gluon (syncs only)", "Alg. 1 (RandK 1%)"]
    assert lines[0].endswith(" | - | - |")
    r = d[("large_batch_gluon", "gluon")]
    assert (f"The lever alone: against Gluon at B = 1, large-batch Gluon needs "
            f"{100 * r['reduction']:.0f}% [{100 * r['low']:.0f}, {100 * r['high']:.0f}] less "
            "uplink (adds).") in text


def test_the_cnn_status_quotes_the_committed_reading():
    """docs/fair.md's CNN status says the reading so far in words: its numbers are the committed
    decomposition's (results/fair/decomposition.csv), the lever's and Alg. 1's against Gluon."""
    rows = {(r["method"], r["baseline"]): r for r in fair.read_csv(REPO / "results" / "fair" /
                                                                   "decomposition.csv")
            if r["task"] == "cnn" and r["reading"] == "uplink"}
    text = " ".join((REPO / "docs" / "fair.md").read_text().split("- So far (large-batch")[1]
                    .split("\n- ")[0].split())

    def pct(r):
        return f"{100 * float(r['reduction']):.0f}% [{100 * float(r['low']):.0f}, " \
               f"{100 * float(r['high']):.0f}]"
    assert f"large-batch Gluon at B = 64 reaches Gluon's final level with " \
           f"{pct(rows[('large_batch_gluon', 'gluon')])} less uplink" in text
    assert f"where Alg. 1 needs {pct(rows[('alg1', 'gluon')])} less" in text
    cnn = json.loads((REPO / "results" / "fair" / "cnn_settings.json").read_text())["uplink"]
    assert f"large-batch Gluon evaluates {cnn['large_batch_gluon']['end_grads']:,.0f} minibatch " \
           f"gradients per worker, Alg. 1 {cnn['alg1']['end_grads']:,.0f}" in text
    assert rows[("alg1", "large_batch_gluon")]["seeds_reached"] == 0
    assert rows[("alg2", "large_batch_gluon")]["seeds_reached"] == 0


def test_each_cnn_stage_tunes_one_baseline_and_every_selection_is_strict():
    """A strict selection that stops on a grid edge stops its own stage only (`make -k
    fair-cnn-runs` goes on with the others): each stage selects at most one baseline, and every
    selection of the CNN half, the equal-compute one included, is strict."""
    text = (REPO / "Makefile").read_text()
    stages = re.search(r"\nFAIR_CNN_STAGES = (.*)", text).group(1).split()
    assert re.search(r"\nfair-cnn-runs: \$\(FAIR_CNN_STAGES\)", text)
    strict_var = "--strict" in re.search(r"\nFAIR_SELECT_CNN = ((?:.*\\\n)*.*)", text).group(1)
    for stage in stages:
        recipe = make_recipe(text, stage)
        assert len(set(re.findall(r"--only (\w+)", recipe))) <= 1, stage
        for call in recipe.replace("\\\n", " ").splitlines():
            if "select_tuned" in call or "FAIR_SELECT_CNN" in call:
                assert "--strict" in call or ("FAIR_SELECT_CNN" in call and strict_var), call


def test_the_headline_sets_the_lever_beside_alg1(tmp_path):
    """The README's first sentences, from the rows: Alg. 1 and large-batch Gluon against Gluon
    side by side, then Alg. 1 against large-batch Gluon. On the lever test's panel Alg. 1 never
    reaches large-batch Gluon's 0.05, so the large batch makes the gain; on the ``panel``
    fixture's it does (by 1 - 40/80), and the headline does not say so."""
    for s in range(3):
        fake(tmp_path / "lever", "gluon", s, baseline(80, 0.1))
        fake(tmp_path / "lever", "large_batch_gluon", s, drop((20, 30, 40)[s], 0.05))
        fake(tmp_path / "lever", "alg1", s, drop(50, 0.09), density=0.01)
    d = table(tmp_path / "lever")
    for r in d.values():
        r["baseline_B"] = 16 if r["baseline"] == "large_batch_gluon" else ""
    text = dec.headline(list(d.values()))
    lever = d[("large_batch_gluon", "gluon")]
    assert f"(Gluon at B = 1) with {100 * (1 - 50 / 80):.0f}% [" in text
    assert "] less uplink on a5a" in text
    assert f"(B = 16 on a5a) gets there with {100 * lever['reduction']:.0f}% [" in text
    assert "never reaches the large batch's final level (0 of 3 seeds on a5a)" in text
    assert text.endswith("The large batch, not the compressed messages, makes the gain. "
                         "Intervals: 95% over seeds (3 on a5a).\n")
    rows = list(table(make_panel(tmp_path / "panel", "comm")).values())
    for r in rows:
        r["baseline_B"] = 16 if r["baseline"] == "large_batch_gluon" else ""
    other = dec.headline(rows)
    assert "makes the gain" not in other and "Alg. 1 needs 50% [" in other
    assert dec.headline([]) == "The fair-baseline panels are still running: no headline is " \
        "claimed yet.\n"
