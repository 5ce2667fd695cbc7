"""Results that cannot silently go wrong.

* Data are known by content: the f* and CIFAR-10 caches follow the data file's SHA-256 and row
  count, a file must match the SHA256SUMS beside it, and a file's hash is computed once.
* "Finished" means consistent: summary.json records metrics.jsonl's row count and hash; a run
  whose files disagree is "damaged", shown so by the sweep table, and done again by a re-run
  (resumed when a checkpoint's rows are intact). Folders written before that record stay
  finished, and ``python -m experiments.run.migrate`` checks and records them.
* A broken environment (missing or corrupt data, a mistyped GLUON_DATA_DIR, a read-only or full
  disk, no SLURM, a garbled metrics row) is one or two lines, exit status 2, and leaves no run
  folder; a full disk keeps the last good checkpoint, which resumes.
* Smaller: SIGTERM in the run's log, shards smaller than a minibatch said in one line,
  checkpoint temporaries removed at the end of a run.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from experiments import tasks as paths
from experiments.run.config import validate
from experiments.run.lifecycle import execute
from experiments.shared.errors import ConfigError
from experiments.shared.runs import CHECKPOINT, read_summary
from experiments.shared.runs import is_finished
from experiments.run.sweep import run_status, sweep_runs
from experiments.tasks import cifar10 as cifar
from experiments.tasks import logreg
from experiments.tasks import split
from tests.conftest import REPO, compose_config

ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
ENV.pop("GLUON_DATA_DIR", None)
A5A = paths.libsvm_file("a5a", download=False)
# The tests compute their own hashes and go through the entry points, the sweep report and the
# task modules, so that each fails on its own assertion where a feature is missing.


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


MEASURED = ("compute_s",)   # times a row may carry: they differ between two runs of one config


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows less measured times: what a recomputed run reproduces exactly."""
    return [{k: v for k, v in json.loads(line).items() if k not in MEASURED}
            for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def digest(path: Path) -> dict:
    """What summary.json records of metrics.jsonl: its rows and its SHA-256."""
    return {"rows": Path(path).read_bytes().count(b"\n"), "sha256": sha256(path)}


def cli(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.logreg", *args], cwd=REPO,
                          env={**ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def a5a_copy(root: Path, sums: bool = False) -> Path:
    """``root/libsvm/a5a``, a copy of the real file (with a SHA256SUMS listing it)."""
    (root / "libsvm").mkdir(parents=True)
    shutil.copy(A5A, root / "libsvm" / "a5a")
    if sums:
        digest = sha256(A5A)
        (root / "libsvm" / "SHA256SUMS").write_text(f"{digest}  a5a\n")
    return root / "libsvm" / "a5a"


def one_or_two_lines(p: subprocess.CompletedProcess) -> list[str]:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stdout + p.stderr
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr
    return lines


@pytest.fixture(scope="module")
def results(results_with_cache):
    return results_with_cache


# ---------------------------------------------------------------- 1. data known by content

def test_f_star_follows_the_data_file_not_its_name(tmp_path):
    """A truncated a5a (3,000 rows) ran to "ok" with the full file's cached f*."""
    data = a5a_copy(tmp_path / "data")
    cfg = compose_config("logreg", f"data_dir={tmp_path / 'data'}",
                         f"results_dir={tmp_path / 'res'}")
    full = logreg.build(cfg, validate(cfg)).summary
    data.write_text("".join(data.read_text().splitlines(keepends=True)[:3000]))
    cut = logreg.build(cfg, validate(cfg)).summary
    A, b = logreg.load_libsvm(data)
    used = torch.cat(split(len(b), 4, 0, b, "iid"))
    truth = logreg.solve_f_star(A[used], b[used], 1e-4)[0]["f_star"]
    assert cut["f_star"] == pytest.approx(truth, rel=1e-9)
    assert abs(cut["f_star"] - full["f_star"]) > 1e-3
    assert cut["data_file"]["rows"] == 3000 and full["data_file"]["rows"] == 6414
    assert len(list((tmp_path / "res" / "cache").glob("fstar-*.json"))) == 2


def test_data_must_match_the_sha256sums_beside_it(tmp_path):
    data = a5a_copy(tmp_path / "data", sums=True)
    text = data.read_text()
    data.write_text(text.replace("\n-1 ", "\n+1 ", 1))            # one label flipped
    p = cli(f"data_dir={tmp_path / 'data'}", "steps=5", f"hydra.run.dir={tmp_path / 'run'}",
            f"results_dir={tmp_path / 'res'}")
    lines = one_or_two_lines(p)
    assert str(data) in lines[0] and "SHA256SUMS" in lines[0]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["data"]     # no run, no cache
    data.write_text(text)
    _, _, ident = logreg.load_dataset("a5a", tmp_path / "data")
    assert ident["sha256"] == sha256(A5A) and ident["rows"] == 6414


def test_a_file_is_hashed_once_per_path_size_and_mtime(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(b"x" * 1000)
    cache = tmp_path / "cache"
    real = paths.sha256(f, cache)
    (memo,) = (cache / "sha256").iterdir()
    fake = "0" * 64
    memo.write_text(json.dumps({**json.loads(memo.read_text()), "sha256": fake}))
    assert paths.sha256(f, cache) == fake               # read back, the file not read again
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert paths.sha256(f, cache) == real               # another version of the file: hashed
    assert paths.sha256(f, None) == real


def _export_tarballs(root: Path, shade: int = 0) -> Path:
    """A tiny CIFAR-10 JPEG export as train.tar.gz / test.tar.gz (2 classes, 2 images each)."""
    from torchvision.io import write_jpeg
    src = root.parent / f"src{shade}"
    for split_ in ("train", "test"):
        for c, cls in enumerate(("airplane", "bird")):
            d = src / split_ / cls
            d.mkdir(parents=True)
            for i in range(2):
                img = torch.full((3, 32, 32), 40 * (c + 1) + 20 * i + shade, dtype=torch.uint8)
                write_jpeg(img, str(d / f"{i:04d}.jpg"), quality=95)
    out = root / cifar.JPEG_DIR
    out.mkdir(parents=True, exist_ok=True)
    for split_ in ("train", "test"):
        with tarfile.open(out / f"{split_}.tar.gz", "w:gz") as tar:
            tar.add(src / split_, arcname=split_)
    return out


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # torchvision.io's write_jpeg
def test_cifar_cache_follows_the_source_content(tmp_path):
    data, cache = tmp_path / "data", tmp_path / "cache"
    export = _export_tarballs(data)
    first = cifar.load_cifar10(data, cache, source="jpeg", download=False)
    old_train = sha256(export / "train.tar.gz")
    _export_tarballs(data, shade=60)                    # the same files, other pixels
    second = cifar.load_cifar10(data, cache, source="jpeg", download=False)
    fresh = cifar.load_cifar10(data, None, source="jpeg", download=False)
    assert not torch.equal(second.train_x, first.train_x)
    assert torch.equal(second.train_x, fresh.train_x) and torch.equal(second.test_x, fresh.test_x)
    assert second.sources == {"train.tar.gz": sha256(export / "train.tar.gz"),
                              "test.tar.gz": sha256(export / "test.tar.gz")}
    assert len(list(cache.glob("cifar10-jpeg-*.pt"))) == 2
    (export / "SHA256SUMS").write_text(f"{old_train}  train.tar.gz\n")
    with pytest.raises(paths.DataCorruptError, match="train.tar.gz"):
        cifar.load_cifar10(data, cache, source="jpeg", download=False)


# ---------------------------------------------------------------- 2. finished = consistent

def _sweep(tmp_path, results, *extra):
    return cli("-m", "seed=0,1,2", "steps=60", "log_every=20", f"results_dir={results}",
               f"hydra.sweep.dir={tmp_path / 'sweep'}", *extra)


def test_damaged_runs_are_shown_and_recomputed(tmp_path, results):
    first = _sweep(tmp_path, results)
    assert first.returncode == 0, first.stdout + first.stderr
    found = sweep_runs(tmp_path / "sweep")
    assert sorted(found.values()) == ["ok"] * 3
    dirs = sorted(found)
    original = {d: (d / "metrics.jsonl").read_bytes() for d in dirs}
    recorded = {d: rows(d) for d in dirs}
    for d in dirs:
        assert read_summary(d)["metrics"] == digest(d / "metrics.jsonl")
    lines = original[dirs[0]].decode().splitlines(keepends=True)
    (dirs[0] / "metrics.jsonl").write_text("".join(lines[:2]))          # cut
    (dirs[1] / "metrics.jsonl").unlink()                                # deleted
    garbled = original[dirs[2]].decode().splitlines(keepends=True)
    garbled[1] = garbled[1][:25] + "\n"
    (dirs[2] / "metrics.jsonl").write_text("".join(garbled))            # garbled
    assert list(sweep_runs(tmp_path / "sweep").values()) == ["damaged"] * 3
    assert not any(is_finished(d) for d in dirs)
    table = subprocess.run([sys.executable, "-m", "scripts.analysis.summarize",
                            str(tmp_path / "sweep"), "--per-run"], cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "3 damaged" in table.stdout
    assert "has 2 rows, summary.json says 4" in table.stderr
    assert "metrics.jsonl is missing" in table.stderr and "line 2 is not a row" in table.stderr
    again = _sweep(tmp_path, results)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("[damaged]") == 3 and again.stdout.count("recomputing it") == 3
    assert "[skip]" not in again.stdout
    for d in dirs:
        assert rows(d) == recorded[d]
        assert run_status(d) == "ok"


def test_damaged_run_resumes_from_a_checkpoint_whose_rows_are_intact(tmp_path, results, caplog):
    cfg = compose_config("logreg", "steps=60", "log_every=10", "keep_checkpoint=true",
                         f"results_dir={results}")
    run = tmp_path / "run"
    execute(cfg, run, logreg)
    original = (run / "metrics.jsonl").read_bytes()
    recorded = rows(run)
    with open(run / "metrics.jsonl", "a") as fh:                        # a row too many
        fh.write(json.dumps({"step": 70, "comm": 9.0}) + "\n")
    assert run_status(run) == "damaged"
    caplog.set_level("INFO", logger="experiments")
    execute(cfg, run, logreg)
    assert "resuming from its checkpoint at step 60" in caplog.text
    assert (run / "metrics.jsonl").read_bytes() == original and run_status(run) == "ok"
    caplog.clear()
    lines = original.decode().splitlines(keepends=True)
    lines[2] = lines[2].replace('"step": 20', '"step": 21')             # a row edited
    (run / "metrics.jsonl").write_text("".join(lines))
    execute(cfg, run, logreg)
    assert "not those the checkpoint was written after" in caplog.text
    assert "recomputing it" in caplog.text
    assert rows(run) == recorded and run_status(run) == "ok"


def test_legacy_run_folders_stay_finished_and_migrate(tmp_path, results):
    made = _sweep(tmp_path, results, "keep_checkpoint=true")
    assert made.returncode == 0, made.stderr
    legacy = tmp_path / "legacy"
    shutil.copytree(tmp_path / "sweep", legacy)
    for d in sweep_runs(legacy):                  # as written before the summary held its record
        s = read_summary(d)
        s.pop("metrics")
        (d / "summary.json").write_text(json.dumps(s, indent=2))
    copies = {name: tmp_path / name for name in ("a", "b")}
    for c in copies.values():
        shutil.copytree(legacy, c)
    a, b = copies["a"], copies["b"]
    for d in sweep_runs(a):
        assert run_status(d) == "ok" and is_finished(d, read_summary(d)["config"])

    def migrate(*args):
        return subprocess.run([sys.executable, "-m", "experiments.run.migrate", *map(str, args)],
                              cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)

    before = {d: {f.name: f.read_bytes() for f in d.iterdir() if f.is_file()}
              for d in sweep_runs(a)}
    checked = migrate(a, "--check")
    assert checked.returncode == 0 and "3 agrees" in checked.stdout
    assert all(f.read_bytes() == before[d][f.name] for d in before for f in d.iterdir()
               if f.is_file())                                          # --check writes nothing
    done = migrate(a)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 migrated" in done.stdout
    for d in sweep_runs(a):
        s = read_summary(d)
        assert s.pop("metrics") == digest(d / "metrics.jsonl")
        assert s == json.loads(before[d]["summary.json"])               # nothing else changed
        assert all((d / n).read_bytes() == v for n, v in before[d].items() if n != "summary.json")
    assert "3 recorded" in migrate(a).stdout                            # idempotent
    first = sorted(sweep_runs(a))[0]
    (first / "metrics.jsonl").write_text("")                            # now checked
    assert run_status(first) == "damaged"

    cut = sorted(sweep_runs(b))[1]
    summary_bytes = (cut / "summary.json").read_bytes()
    (cut / "metrics.jsonl").write_text((cut / "metrics.jsonl").read_text().splitlines(True)[0])
    bad = migrate(b)
    assert bad.returncode == 1
    assert f"damaged: {cut}" in bad.stdout and "2 migrated" in bad.stdout
    assert (cut / "summary.json").read_bytes() == summary_bytes         # left as it was
    assert migrate(tmp_path / "nothing_here").returncode == 2


# ---------------------------------------------------------------- 5. a broken environment

def _mount_tmpfs(where: Path, size: str, *options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    opts = ",".join((f"size={size}",) + options)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip()})")


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], capture_output=True)


def _corrupt_a5a(tmp_path: Path) -> Path:
    data = a5a_copy(tmp_path / "in" / "data")
    lines = data.read_text().splitlines(keepends=True)
    lines[56] = "-1 3:1 garbage 7:1\n"
    data.write_text("".join(lines))
    return data


ENVIRONMENT = {
    # case: (prepare(tmp) -> (args, env), words in the message)
    "missing data": (lambda t: ([f"data_dir={(t / 'in' / 'empty').resolve()}", "task.dataset=a0a"],
                                {}), ["'a0a' not found", "libsvm/a0a", "data_dir="]),
    "corrupt a5a": (lambda t: ([f"data_dir={_corrupt_a5a(t).parents[1]}"], {}),
                    ["libsvm/a5a line 57", "get it again"]),
    "mistyped GLUON_DATA_DIR": (lambda t: ([], {"GLUON_DATA_DIR": str(t / "typo" / "data")}),
                                ["GLUON_DATA_DIR=", "no such folder"]),
    "read-only results folder": (None, ["hydra.run.dir=", "read-only file system"]),
    "launcher=slurm without SLURM": (lambda t: (["-m", "launcher=slurm"],
                                                {"PATH": str(t / "in" / "bin")}),
                                     ["launcher=slurm", "no SLURM"]),
}


@pytest.mark.parametrize("case", list(ENVIRONMENT))
def test_broken_environment_is_one_line_exit_2_and_leaves_nothing(tmp_path, case):
    (tmp_path / "in" / "empty").mkdir(parents=True)
    (tmp_path / "in" / "bin").mkdir()
    prepare, words = ENVIRONMENT[case]
    out = tmp_path / "out"
    run_dir = out / "run"
    if prepare is None:                           # the run folder on a read-only file system
        _mount_tmpfs(out, "64k", "ro")
        args, env = [], {}
    else:
        args, env = prepare(tmp_path)
    try:
        p = cli(*args, "steps=5", f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={out / 'sweep'}",
                f"results_dir={out / 'res'}", env=env)
        lines = one_or_two_lines(p)
        for w in words:
            assert w in p.stderr, (w, p.stderr)
        assert not p.stdout.strip()
        assert not out.exists() or not list(out.iterdir())      # no run folder, no cache
        assert sorted(x.name for x in tmp_path.iterdir()) == ["in", "out"][:1 + out.exists()]
        assert not (tmp_path / "typo").exists()                 # nothing made elsewhere either
        assert len(lines) <= 2
    finally:
        if prepare is None:
            _umount(out)


def test_missing_data_in_a_sweep_is_refused_before_any_run(tmp_path, results):
    p = cli("-m", "task.dataset=a5a,a0a", "steps=5", f"results_dir={results}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}")
    lines = one_or_two_lines(p)
    assert "'a0a' not found" in lines[0] and "task.dataset=a0a" in p.stderr
    assert not (tmp_path / "sweep").exists()


def test_full_disk_keeps_the_last_checkpoint_and_resumes(tmp_path, results):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "128k")             # full at about 200 steps: a checkpoint is ~44 kB
    args = ["steps=500", "log_every=1", "checkpoint_every=100", "progress_s=0",
            f"results_dir={results}"]
    try:
        full = cli(*args, f"hydra.run.dir={disk / 'run'}")
        lines = one_or_two_lines(full)
        assert "no space left on the device writing" in lines[0]
        saved = torch.load(disk / "run" / CHECKPOINT, weights_only=False)
        assert f"the last good checkpoint, {disk / 'run' / CHECKPOINT} (step " \
               f"{saved['method']['k']}), is kept" in lines[1]
        assert saved["method"]["k"] >= 100
        assert not [f for f in (disk / "run").iterdir() if "tmp" in f.name]
        assert read_summary(disk / "run") is None                       # not finished, not failed
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        again = cli(*args, f"hydra.run.dir={disk / 'run'}")
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"from step {saved['method']['k']}" in again.stdout
        ref = cli(*args, f"hydra.run.dir={tmp_path / 'ref'}")
        assert ref.returncode == 0
        assert rows(disk / "run") == rows(tmp_path / "ref")
    finally:
        _umount(disk)


def test_garbled_metrics_row(tmp_path, results, caplog):
    """An interrupted run whose kept rows were garbled starts over (saying so) instead of a
    traceback on every re-run; a figure reading a garbled row names the file, the line and the
    fix."""
    cfg = compose_config("logreg", "steps=60", "log_every=10", "checkpoint_every=30",
                         f"results_dir={results}")
    run, ref = tmp_path / "run", tmp_path / "ref"
    execute(cfg, ref, logreg)
    from tests.conftest import stopping_train
    from experiments.run import lifecycle
    from gluon import train
    lifecycle_train = lifecycle.train
    lifecycle.train = stopping_train(train, 40)
    try:
        with pytest.raises(KeyboardInterrupt):
            execute(cfg, run, logreg)
    finally:
        lifecycle.train = lifecycle_train
    assert (run / CHECKPOINT).exists()
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1][:20] + "\n"
    (run / "metrics.jsonl").write_text("".join(lines))
    caplog.set_level("INFO", logger="experiments")
    execute(cfg, run, logreg)
    assert "starting over" in caplog.text
    assert rows(run) == rows(ref)

    # a figure reads a finished run written before summaries recorded their metrics file
    s = read_summary(ref)
    s.pop("metrics")
    (ref / "summary.json").write_text(json.dumps(s))
    lines = (ref / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[3] = "{garbled\n"
    (ref / "metrics.jsonl").write_text("".join(lines))
    from experiments.shared.statistics import load_runs
    with pytest.raises(SystemExit) as err:
        load_runs(tmp_path)
    msg = str(err.value)
    assert f"{ref / 'metrics.jsonl'} line 4" in msg and "overwrite=true" in msg


def test_checkpoint_temporaries_are_removed_at_the_end_of_a_run(tmp_path, results):
    cfg = compose_config("logreg", "steps=40", "log_every=10", f"results_dir={results}")
    run = tmp_path / "run"
    run.mkdir()
    left = [run / f"{CHECKPOINT}.tmp4242", run / f".{CHECKPOINT}.4242.0a1b2c3d.tmp"]
    for f in left:
        f.write_bytes(b"half a checkpoint")
    (run / "notes.txt").write_text("mine")
    assert execute(cfg, run, logreg)["status"] == "ok"
    assert not any(f.exists() for f in left)
    assert (run / "notes.txt").read_text() == "mine"


def removing_train(train, folder: Path, step: int | None):
    """``train`` during which ``folder`` is removed: right after ``step``, or (None) once
    training is done, before the run writes its summary (a stopped sweep cleaned up)."""
    def removing(method, steps, **kw):
        inner = kw["on_step"]

        def on_step(m):
            inner(m)
            if m.k == step:
                shutil.rmtree(folder)
        status = train(method, steps, **{**kw, "on_step": on_step})
        if step is None:
            shutil.rmtree(folder)
        return status
    return removing


@pytest.mark.parametrize("when", ["before the summary", "before a checkpoint"])
def test_a_run_whose_folder_is_removed_while_it_runs_never_makes_it_again(
        tmp_path, results, monkeypatch, when):
    """A sweep stopped and cleaned up while one of its runs went on: the run stops at its next
    write (a checkpoint or its summary) with a two-line EnvironmentProblem, and the folder stays
    gone, not made anew around a summary (or a checkpoint) whose rows no longer exist. W&B
    (offline) writes into the run folder too: it must not make it again either."""
    from experiments.run import lifecycle
    from experiments.run.record import RunRemoved
    from gluon import train
    cfg = compose_config("logreg", "steps=40", "log_every=10", "checkpoint_every=20",
                         "wandb.enabled=true", "wandb.mode=offline",
                         f"results_dir={results}")
    run = tmp_path / "sweep" / "run"
    monkeypatch.setattr(lifecycle, "train",
                        removing_train(train, run, 5 if when == "before a checkpoint" else None))
    with pytest.raises(RunRemoved) as err:
        execute(cfg, run, logreg)
    assert not run.exists(), sorted(p.name for p in run.rglob("*"))
    first, second = str(err.value).splitlines()
    assert first == f"{run} was removed while the run ran (its metrics.jsonl is gone): nothing " \
                    "more is written there"
    assert second == "  run the same command to compute it again"
    monkeypatch.setattr(lifecycle, "train", train)
    assert execute(cfg, run, logreg)["status"] == "ok"          # computed again from scratch
    assert read_summary(run)["metrics"] == digest(run / "metrics.jsonl")


def test_a_sweep_reports_a_removed_run_stopped_not_failed(tmp_path, results, monkeypatch):
    """Inside a sweep the removed run is reported "stopped" (unfinished), not "failed": no
    summary is written for it."""
    from experiments.run import job
    from experiments.run.record import RunRemoved

    def removed(*a, **k):
        raise RunRemoved("x was removed while the run ran\n  run the same command")
    monkeypatch.setattr(job, "execute", removed)
    from hydra.types import RunMode
    from types import SimpleNamespace
    hc = SimpleNamespace(runtime=SimpleNamespace(output_dir=str(tmp_path / "r")),
                         mode=RunMode.MULTIRUN)
    from hydra.core import hydra_config
    monkeypatch.setattr(hydra_config.HydraConfig, "get", staticmethod(lambda: hc))
    cfg = compose_config("logreg", "steps=40", f"results_dir={results}")
    out = job.run_hydra_job(cfg, logreg)
    assert out["status"] == "stopped" and "removed while the run ran" in out["error"]
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- 6. smaller

def test_shards_smaller_than_a_minibatch_are_said_in_one_line(tmp_path, results, caplog):
    caplog.set_level("WARNING", logger="experiments")

    def build(*overrides):
        cfg = compose_config("logreg", f"results_dir={results}", *overrides)
        caplog.clear()
        return logreg.build(cfg, validate(cfg))

    built = build("n_workers=5000")
    (rec,) = caplog.records
    assert "with replacement" in rec.getMessage() and "1414 rows (22%)" in rec.getMessage()
    assert built.summary["data_file"]["used"] == 5000
    assert build("n_workers=4").summary["data_file"]["used"] == 6412 and not caplog.records
    build("batch_size=100000")
    (rec,) = caplog.records
    assert "1603 examples, fewer than batch_size=100000" in rec.getMessage()
    assert "with replacement" in rec.getMessage()
    with pytest.raises(ConfigError, match="at most 6414 workers"):
        logreg.check_data(compose_config("logreg", "n_workers=7000", f"results_dir={results}"))


def test_sigterm_is_written_to_the_run_log(tmp_path, results):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.logreg", "steps=1000000",
                             "log_every=100", "checkpoint_every=0", "progress_s=0",
                             f"results_dir={results}", f"hydra.run.dir={run}"], cwd=REPO,
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").stat().st_size == 0:
        assert proc.poll() is None and time.time() - t0 < 120
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    log = (run / "logreg.log").read_text()
    assert "[signal] SIGTERM at step" in log and "checkpoint written" in log
    assert (run / CHECKPOINT).exists()


@pytest.mark.parametrize("text", ["{truncated", "[1, 2]", ""])
def test_a_figure_refuses_a_run_whose_summary_cannot_be_read(tmp_path, text):
    """A summary.json that does not parse is a damaged run: a figure stops and names it, where
    it used to leave the run out without a word."""
    from experiments.shared.statistics import load_runs
    run = tmp_path / "sweep" / "alg1" / "seed=0"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(text)
    (run / "metrics.jsonl").write_text('{"step": 0, "comm": 0.0}\n')
    with pytest.raises(SystemExit, match="summary.json cannot be read") as err:
        load_runs(tmp_path / "sweep")
    assert str(run) in str(err.value)
