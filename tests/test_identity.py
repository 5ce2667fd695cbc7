"""A run is known by its identity: its resolved config less the operational keys, and its data.

* Any spelling of one config names one folder (``seed=0`` typed or left to its default,
  ``0.01`` or ``0.0100000``, a setting from ``tuned=`` or typed), and a sweep computes it once.
* Operational keys (threads, W&B, checkpoints, the data's folder) leave the folder as it is;
  anything a run computes with (the budget, a task setting, the data's content) changes it.
* A folder name is bounded, whatever the overrides.
* A folder that holds another run is refused in two lines, exit 2, and left untouched.
* Folders of earlier versions (real ones, ``tests/data/legacy_runs``) are migrated to the names
  their sweep computes, and the sweep then skips them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from experiments import tasks as paths
from experiments.shared import runs
from experiments.tasks import resolved
from experiments.tasks import cnn
from tests.conftest import REPO, compose_config

ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
LEGACY = REPO / "tests" / "data" / "legacy_runs"


def folder(*overrides: str, primary: str = "logreg") -> str:
    """The run folder ``python -m experiments.<primary> <overrides>`` would write."""
    return str(compose_config(primary, *overrides, hydra=True).hydra.run.dir)


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.logreg", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def test_any_spelling_of_a_config_names_one_folder():
    base = folder()
    assert folder("seed=0") == base                       # the default, typed
    assert folder("method.lr=0.0100000") == base          # the default lr, spelled otherwise
    assert folder("method.lr=1e-2", "method.beta=0.990") == base
    assert folder("compressor=randk", "compressor.density=0.010") == base
    tuned = compose_config("logreg", "tuned=fig2_logreg/alg2", hydra=True)
    typed = [f"method={tuned.method.name}", f"compressor={tuned.compressor.name}",
             *(f"method.{k}={v}" for k, v in tuned.method.items() if k != "name" and v is not None),
             *(f"compressor.{k}={v}" for k, v in tuned.compressor.items()
               if k != "name" and v is not None)]
    assert folder(*typed) == str(tuned.hydra.run.dir)     # tuned= or the same values typed


def test_operational_keys_keep_the_folder_and_the_rest_changes_it():
    base = folder()
    for op in ("threads=2", "wandb.enabled=true", "checkpoint_every=7", "keep_checkpoint=true",
               "progress_s=0", "group=elsewhere", "comm=torchdist", "dense_collective=all_gather",
               "results_dir=/elsewhere", "launcher=local"):
        assert folder(op) == base, op
    changed = {o: folder(o) for o in ("seed=1", "steps=9999", "max_comm=50", "task.l2=0.001",
                                      "batch_size=32", "n_workers=8", "method.B=16",
                                      "task.heterogeneity=label_skew")}
    assert len({base, *changed.values()}) == len(changed) + 1   # every one its own folder
    assert all(Path(f).parent == Path(base).parent for f in changed.values())   # same method


def test_the_data_content_is_part_of_the_identity(tmp_path):
    same, cut = tmp_path / "same", tmp_path / "cut"
    a5a = paths.libsvm_file("a5a", download=False)
    for d in (same, cut):
        (d / "libsvm").mkdir(parents=True)
    shutil.copy(a5a, same / "libsvm" / "a5a")             # another folder, the same bytes
    lines = a5a.read_text().splitlines(keepends=True)
    (cut / "libsvm" / "a5a").write_text("".join(lines[:3000]))   # a truncated copy
    base = folder(f"data_dir={same}")
    assert folder(f"data_dir={same}") == folder() == base
    assert folder(f"data_dir={cut}") != base
    assert Path(folder(f"data_dir={cut}")).name.split(",id=")[0] == Path(base).name.split(",id=")[0]


def test_a_folder_name_is_bounded_whatever_the_overrides():
    many = ["method=vr_marina", "method.lr=0.000123456789012345", "method.beta=0.987654321012345",
            "method.q=0.0123456789012345", "method.B=1234567", "method.full=false",
            "compressor=topk", "compressor.density=0.000123456789012345", "seed=123456789",
            *(f"task.{k}={v}" for k, v in (("l2", 1.234567e-5), ("split_seed", 99999))),
            "steps=123456789", "batch_size=999", "log_every=77", "n_workers=16"]
    name = Path(folder(*many)).name
    assert len(name) <= runs.MAX_NAME and name.endswith(",id=" + name.split(",id=")[1])
    assert len(name.split(",id=")[1]) == runs.ID_LENGTH


def test_a_sweep_computes_one_config_once_under_two_spellings(tmp_path, results_with_cache):
    common = ["steps=40", "log_every=20", f"results_dir={results_with_cache}",
              f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    first = cli("-m", "seed=0,1", *common)
    assert first.returncode == 0, first.stderr
    again = cli("-m", "method.lr=0.0100000", "seed=1,0", "threads=1", *common)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("[skip]") == 2 and "[start]" not in again.stdout + again.stderr
    assert len(list((tmp_path / "sweep").rglob("summary.json"))) == 2


def test_a_folder_holding_another_run_is_refused_and_kept(tmp_path, results_with_cache):
    run = tmp_path / "run"
    common = ["steps=40", "log_every=20", f"results_dir={results_with_cache}",
              f"hydra.run.dir={run}"]
    assert cli(*common).returncode == 0
    files = lambda: {f.name: f.read_bytes() for f in run.iterdir()   # noqa: E731
                     if f.is_file() and f.name != runs.LOCK}   # the lock names its last holder
    before = files()
    p = cli("seed=1", *common)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and 1 <= len(lines) <= 2 and "Traceback" not in p.stderr, p.stderr
    assert lines[0] == f"error: {run} holds another run (ok; seed: 1 here, 0 there)"
    assert "overwrite=true" in lines[1]
    assert files() == before
    replaced = cli("seed=1", "overwrite=true", *common)    # asked for: replaced
    assert replaced.returncode == 0, replaced.stderr
    assert runs.read_summary(run)["config"]["seed"] == 1


def test_a_checkpoint_of_another_run_is_refused(tmp_path, results_with_cache):
    run = tmp_path / "run"
    common = ["log_every=20", f"results_dir={results_with_cache}", f"hydra.run.dir={run}",
              "keep_checkpoint=true"]
    assert cli("steps=40", *common).returncode == 0
    (run / "summary.json").unlink()                       # a preempted run: its checkpoint only
    p = cli("steps=60", *common)
    assert p.returncode == 2 and "holds the checkpoint of another run (steps: 60 here, 40 there)" \
        in p.stderr, p.stderr
    assert (run / "checkpoint.pt").exists()


def _sweep_folder(experiment: str, *point: str) -> Path:
    cfg = compose_config("cnn", f"experiment={experiment}", *point, hydra=True)
    return Path(str(cfg.hydra.sweep.subdir))


def test_real_legacy_run_folders_migrate_to_the_names_their_sweep_finds(tmp_path):
    tree = tmp_path / "cnn_gap"
    shutil.copytree(LEGACY / "cnn_gap", tree)
    old = sorted(p.parent for p in tree.rglob("summary.json"))
    assert len(old) == 2 and all(",id=" not in d.name for d in old)
    before = {d.name: json.loads((d / "summary.json").read_text()) for d in old}
    p = subprocess.run([sys.executable, "-m", "experiments.run.migrate", str(tree)], cwd=REPO,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "2 migrated" in p.stdout, p.stdout + p.stderr
    for seed in (100, 101):
        want = tree / "tune" / _sweep_folder("cnn_gap/tune_gluon", "method.lr=0.1",
                                             "method.beta=0.6", f"seed={seed}")
        s = runs.read_summary(want)                       # where the sweep will look
        assert s is not None and runs.status(want) == "ok"
        legacy = before[f"method.beta=0.6,method.lr=0.1,seed={seed}"]
        assert s["added_keys"] == ["task.amp_cpu"]        # the schema's key since, at its default
        assert s["config"]["task"]["amp_cpu"] is False
        assert s["renamed_task"] == "cifar10" and s["config"]["task"]["name"] == "cnn"
        assert {k: v for k, v in s.items() if k not in ("metrics", "id", "data_id", "added_keys",
                                                        "renamed_task", "config")} == \
            {k: v for k, v in legacy.items() if k != "config"}
        cfg = resolved(compose_config("cnn", "experiment=cnn_gap/tune_gluon", "method.lr=0.1",
                                   "method.beta=0.6", f"seed={seed}"))
        assert runs.is_finished(want, OmegaConf.to_container(cfg), cnn.data_identity(cfg))
    sweep = subprocess.run(
        [sys.executable, "-m", "experiments.cnn", "-m", "experiment=cnn_gap/tune_gluon",
         "method.lr=0.1", "method.beta=0.6", f"hydra.sweep.dir={tree / 'tune'}"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert sweep.returncode == 0, sweep.stderr
    assert sweep.stdout.count("[skip]") == 2 and "2 runs: 2 ok" in sweep.stdout   # nothing run


def test_a_run_of_a_task_under_its_old_name_migrates_to_the_run_of_its_new_name(tmp_path):
    """A run made when logistic regression was named ``a5a`` (its identity and folder computed
    from that name, as the code of then did) is, after ``migrate``, the run that today's
    config names: the same folder, identity and summary, and the sweep skips it."""
    sweep = tmp_path / "sweep"
    args = ["-m", "steps=40", "log_every=20", f"hydra.sweep.dir={sweep}", "checkpoint_every=0"]
    made = subprocess.run([sys.executable, "-m", "experiments.logreg", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    (today,) = [p.parent for p in sweep.rglob("summary.json")]
    summary = json.loads((today / "summary.json").read_text())
    old = json.loads(json.dumps(summary))                 # the run as the old name recorded it
    old["config"]["task"]["name"] = "a5a"
    old["id"] = runs.run_id(old["config"], old["data_id"])
    then = today.parent / runs.folder_name(old["config"], old["data_id"])
    assert then != today and old["id"] != summary["id"]   # the name is part of the identity
    (today / "summary.json").write_text(json.dumps(old, indent=2))
    today.rename(then)
    p = subprocess.run([sys.executable, "-m", "experiments.run.migrate", str(sweep)], cwd=REPO,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "1 migrated" in p.stdout and "task a5a is now logreg" in p.stdout
    assert not then.exists() and today.is_dir()
    after = json.loads((today / "summary.json").read_text())
    assert after.pop("renamed_task") == "a5a" and after == summary
    again = subprocess.run([sys.executable, "-m", "experiments.logreg", *args], cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("[skip]") == 1, again.stdout


def test_a_copy_without_git_records_the_commit_it_was_given(tmp_path, monkeypatch):
    """A run records its commit; a copy of the checkout with no .git (a compute node, a GPU
    machine) records the commit named by GLUON_GIT_COMMIT, and says its cleanliness is unknown."""
    from experiments.run import record
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:                                  # this checkout has its .git
        assert record.git_commit()["git_commit"] == head.stdout.strip()
    monkeypatch.setattr(record, "REPO", tmp_path)             # a folder outside any repository
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("GLUON_GIT_COMMIT", raising=False)
    assert record.git_commit() == {"git_commit": None, "git_dirty": None}
    monkeypatch.setenv("GLUON_GIT_COMMIT", "0123abc")
    assert record.git_commit() == {"git_commit": "0123abc", "git_dirty": None}
