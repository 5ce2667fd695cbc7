"""W&B, offline (no network): what a run writes, and how a resumed run continues it.

The offline run directory (<run_dir>/wandb/offline-run-*/run-<id>.wandb) is read back with
scripts.analysis.wandb_offline, W&B's own transaction-log format.
"""
from __future__ import annotations

import json
import random
import shutil
import struct
import time
import zlib
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.run import lifecycle as runner
from experiments.shared.runs import read_rows, read_summary
from experiments.tasks import logreg as task
from experiments.tasks.logreg import build
from experiments.run.lifecycle import execute
from scripts.analysis.wandb_offline import BLOCK, HEADER, read_offline_run, records
from scripts.analysis.wandb_dashboard import DASHBOARDS, recipe
from tests.conftest import compose_config

from experiments.shared.files import REPO
# wandb-workspaces still declares pydantic-v1-style validators (its own business, not ours)
pytestmark = pytest.mark.filterwarnings("ignore:Pydantic V1 style:DeprecationWarning")


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
    # every value against comm by default; no value is logged twice (no by_bytes/ copies):
    # bytes is in every row, so any chart can use it as its x-axis instead
    assert run["metrics"]["*"] == "comm"
    assert not [k for k in run["metrics"] if k.startswith("by_bytes/")]
    rows = read_rows(tmp_path / "run")
    assert len(run["history"]) == len(rows) == 6
    for h, r in zip(run["history"], rows):
        assert {k: h[k] for k in r} == r
        assert {"step", "comm", "bytes"} <= set(h)
        assert {k for k in h if not k.startswith("_")} == set(r)     # the row, once
    assert not [k for h in run["history"] for k in h if k.startswith("by_bytes/")]
    assert [h["_step"] for h in run["history"]] == list(range(6))
    assert [h["bytes"] for h in run["history"]] == [r["bytes"] for r in rows]
    # the fig3 dashboard groups by config keys this run has, and plots values it logs
    for key in DASHBOARDS["fig3"]["groupby"]:
        node = run["config"]
        for part in key.split("."):
            node = node[part]
    assert {p["x"] for p in recipe("fig3")["panels"]} <= set(rows[0])
    assert {y for p in recipe("fig3")["panels"] for y in p["y"]} <= set(rows[0])
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
    rows = read_rows(tmp_path / "run")
    assert sorted(merged) == list(range(len(rows))) and len(rows) == 16
    for i, r in enumerate(rows):
        assert {k: merged[i][k] for k in r} == r
        assert {k for k in merged[i] if not k.startswith("_")} == set(r)   # bytes, no copies


def test_new_start_gets_a_new_wandb_id(tmp_path):
    cfg = config(tmp_path, "steps=20", "log_every=10")
    execute(cfg, tmp_path / "run", task)
    cfg.overwrite = True
    execute(cfg, tmp_path / "run", task)
    a, b = offline_runs(tmp_path / "run")
    assert a["id"] != b["id"]


def write_log(payloads: list[bytes]) -> bytes:
    """A .wandb transaction log by the format's rules (LevelDB's log writer): records never
    cross a 32 KiB block, a payload too long for the rest of its block is cut into first/
    middle/last chunks, and a block's last < 7 bytes are zero padding."""
    out = bytearray(b":W&B" + struct.pack("<HB", 0xBEE1, 0))
    for payload in payloads:
        first = True
        while True:
            left = BLOCK - len(out) % BLOCK
            if left < HEADER:
                out += bytes(left)
                continue
            chunk, payload = payload[:left - HEADER], payload[left - HEADER:]
            kind = (1 if not payload else 2) if first else (4 if not payload else 3)
            crc = zlib.crc32(chunk, zlib.crc32(bytes([kind])))
            out += struct.pack("<IHB", crc, len(chunk), kind) + chunk
            first = False
            if not payload:
                break
    return bytes(out)


def test_offline_log_read_while_written_gives_the_records_already_whole(tmp_path):
    # W&B's service appends the log after finish() returns, so a reader polling it sees every
    # prefix of the final file; each must read as the records whole in it, never an error
    rng = random.Random(0)
    payloads = [bytes(rng.randrange(256) for _ in range(n))
                for n in (40, 0, 32_760, 5, 70_000, 33, 32_750, 12)]   # across blocks, one in 3
    log = write_log(payloads)
    assert len(log) > 4 * BLOCK
    path = tmp_path / "run-x.wandb"
    ends, got = [], None
    for cut in sorted({*range(7, len(log) + 1, 97), *range(len(log) - 300, len(log) + 1),
                       *(b * BLOCK + d for b in range(1, 5) for d in range(-9, 9))}):
        path.write_bytes(log[:cut])
        got = list(records(path))
        assert got == payloads[:len(got)], cut
        ends.append(len(got))
    assert got == payloads and ends == sorted(ends)          # whole at the end, never shrinking
    damaged = bytearray(log)
    damaged[HEADER + 7 + 3] ^= 1                              # a byte of the first record
    path.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="bad checksum"):
        list(records(path))


def test_dashboard_recipes_offline(capsys):
    from scripts.analysis.wandb_dashboard import main
    main(["--print", "fig3", "fig7"])
    out = json.loads(capsys.readouterr().out)
    assert out["fig3"]["groupby"] == ["config.method.q", "config.compressor.density"]
    assert "Metric('JobType') == 'vr_marina'" in out["fig7"]["filters"]
    for fig in DASHBOARDS:
        r = recipe(fig)
        assert {p["x"] for p in r["panels"]} == {"comm", "bytes"}
        assert not [y for p in r["panels"] for y in p["y"] if y.startswith("by_bytes/")]


# ------------------------------------------------------------------ the dashboards themselves
# What docs/wandb.md promises for every figure: the experiment whose runs it shows (W&B group,
# and job type = method where one group holds several methods' sweeps), and the panels as
# (x-axis, y metric, log-scale y). Seeds are averaged: the runs are grouped by the keys the
# experiment sweeps (never by seed), each group drawn as its mean with a min-max band.
FIGURES = {   # figure -> (entry point, experiment config, job type filtered on)
    "fig2_logreg": ("logreg", "fig2_logreg", None),
    "fig3": ("logreg", "fig3", None),
    "fig4": ("logreg", "fig4", None),
    "fig5": ("logreg", "tune_fig2/alg1", "alg1"),
    "fig6": ("logreg", "fig6", None),
    "fig7": ("logreg", "tune_fig2/vr_marina", "vr_marina"),
    "fig8": ("cnn", "fig8", None),
}
PROMISED_PANELS = {
    "logreg": [("comm", "gap", True), ("bytes", "gap", True), ("comm", "loss", False)],
    "cnn": [("comm", "loss", True), ("bytes", "loss", True), ("comm", "test_acc", False)],
}
# a swept key that stands for another: each tuned=fig2_logreg/<method> is one method
SWEPT_AS = {"tuned": "method.name"}


def offline_workspaces(monkeypatch) -> list:
    """wandb-workspaces with its one server call (the view upsert in ``save``) and the URL
    lookup stubbed, and every socket connection refused: nothing here reaches W&B. Returns
    the list the views sent to W&B are appended to. Without the package the test fails."""
    try:
        import wandb_workspaces.workspaces as ws
        from wandb_workspaces.workspaces import interface
    except ImportError:
        pytest.fail("the W&B dashboard tests need wandb-workspaces: "
                    "pip install -e '.[dashboards]' (make install installs it)", pytrace=False)
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("the dashboard tests must not open a network connection")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    saved = []

    def upsert_view2(view):
        saved.append(view.model_dump(by_alias=True, exclude_none=True))
        return {"upsertView": {"view": {"name": f"nw{len(saved)}", "id": f"id{len(saved)}"}}}
    monkeypatch.setattr(interface.internal, "upsert_view2", upsert_view2)
    monkeypatch.setattr(ws.Workspace, "url", property(
        lambda self: f"https://wandb.invalid/{self.entity}/{self.project}?nw={self._internal_name}"))
    return saved


def _experiment(figure):
    """The figure's experiment config and, for each key its sweep sets, how many values."""
    primary, experiment, _ = FIGURES[figure]
    cfg = compose_config(primary, f"experiment={experiment}", hydra=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    values = {}
    for key, v in params.items():
        v = str(v)
        values[SWEPT_AS.get(key, key)] = (len(range(*map(int, v[6:-1].split(","))))
                                          if v.startswith("range(") else len(v.split(",")))
    return cfg, values


def _selects(filters, run) -> bool:
    """W&B's flat filter list (filterV2): AND binds tighter than OR."""
    clauses, clause = [], []
    for f in filters["filters"]:
        if f.get("connector") == "OR":
            clauses.append(clause)
            clause = []
        assert f["op"] == "=" and not f["disabled"], f
        clause.append(run[(f["key"]["section"], f["key"]["name"])] == f["value"])
    clauses.append(clause)
    return any(all(c) for c in clauses)


def _check(spec, figure):
    """Every promise of docs/wandb.md about ``figure``'s dashboard, on the view W&B receives."""
    cfg, values = _experiment(figure)
    _, _, job_type = FIGURES[figure]
    section = spec["spec"]["section"]
    (runset,) = section["runSets"]
    # the runs: the figure's experiment (W&B group), of its method where the group is shared
    run = {("run", "group"): cfg.group, ("run", "jobType"): job_type or cfg.method.name}
    assert _selects(runset["filters"], run), (figure, runset["filters"])
    assert not _selects(runset["filters"], {**run, ("run", "group"): cfg.group + "_other"})
    if job_type:
        assert not _selects(runset["filters"], {**run, ("run", "jobType"): "gluon"})
    # grouped by every swept key (config keys the runs have), never by seed: seeds averaged
    grouping = [(g["section"], g["name"].replace(".value.", ".", 1)) for g in runset["grouping"]]
    assert {s for s, _ in grouping} == {"config"}, grouping
    keys = [k for _, k in grouping]
    swept = {k for k, n in values.items() if n > 1 and k != "seed"}
    assert swept <= set(keys), (figure, keys, swept)
    assert "seed" not in keys
    assert all(OmegaConf.select(cfg, k, default=None) is not None for k in keys), keys
    # the panels use that grouping, enough runs are drawn, smoothing is off, comm is the default x
    settings = section["settings"]
    assert settings["useRunsTableGroupingInPanels"] is True and settings["xAxis"] == "comm"
    assert settings["maxRuns"] >= _runs(values) and settings["smoothingWeight"] == 0
    (panels_section,) = section["panelBankConfig"]["sections"]
    panels = [p["config"] for p in panels_section["panels"]]
    assert all(p["viewType"] == "Run History Line Plot" for p in panels_section["panels"])
    promised = PROMISED_PANELS["cnn" if FIGURES[figure][0] == "cnn" else "logreg"]
    assert [(p["xAxis"], p["metrics"], bool(p.get("yLogScale"))) for p in panels] == \
        [(x, [y], log) for x, y, log in promised], figure
    for p in panels:
        assert p["groupAgg"] == "mean" and p["groupArea"] == "minmax", p
        assert p["smoothingWeight"] == 0 and p["smoothingType"] == "none", p
        assert p.get("limit", 10) >= _runs(values) and not p.get("aggregate"), p


def _runs(values) -> int:
    n = 1
    for v in values.values():
        n *= v
    return n


def test_every_figure_has_a_dashboard_to_check():
    assert set(DASHBOARDS) == set(FIGURES)


@pytest.mark.parametrize("figure", sorted(FIGURES))
def test_dashboard_builds_with_the_promised_panels_grouping_and_runs(figure, monkeypatch):
    workspaces = offline_workspaces(monkeypatch)
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws
    from scripts.analysis.wandb_dashboard import build
    w = build(figure, "ME", "gluon-fl")
    assert isinstance(w, ws.Workspace) and (w.entity, w.project) == ("ME", "gluon-fl")
    assert all(isinstance(p, wr.LinePlot) for s in w.sections for p in s.panels)
    assert workspaces == []                                   # building saves nothing
    _check(w._to_model().model_dump(by_alias=True, exclude_none=True), figure)


def test_dashboards_are_saved_by_the_command(monkeypatch, capsys):
    workspaces = offline_workspaces(monkeypatch)
    from scripts.analysis.wandb_dashboard import main
    main(["--entity", "ME", "--project", "P"])                # every figure
    out = capsys.readouterr().out.splitlines()
    assert len(workspaces) == len(DASHBOARDS) == len(out)
    for figure, spec, line in zip(sorted(DASHBOARDS), workspaces, out):
        assert (spec["entity"], spec["project"]) == ("ME", "P")
        assert spec["name"].startswith("nw-") and not spec["id"]   # saved as a new view
        assert spec["displayName"] == DASHBOARDS[figure]["title"]
        assert line.startswith(f"{figure}: https://wandb.invalid/ME/P?nw=")
        _check(spec, figure)


def test_dashboards_without_wandb_workspaces_say_what_to_install(monkeypatch):
    import sys
    from scripts.analysis.wandb_dashboard import build
    for name in [m for m in sys.modules if m.startswith("wandb_workspaces.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "wandb_workspaces", None)   # its import fails
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[dashboards\]'"):
        build("fig3", "ME", "gluon-fl")
