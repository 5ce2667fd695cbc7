"""What a hostile tester tries: races between runs, damaged files, absurd data, a fresh machine
without data or network, signals, and optimiser states that do not fit. Every case is listed,
with the test that tries it, in docs/reliability.md (the last test here checks that list).

The command-line cases start ``python -m experiments.logreg`` as a user would and check what is
left on disk afterwards, not only the exit status.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from experiments.shared.runs import read_rows, read_summary, status as run_status
from tests.conftest import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
ENV.pop("GLUON_DATA_DIR", None)


def cli(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.logreg", *args], cwd=REPO,
                          env={**ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def refused(p: subprocess.CompletedProcess, code: int = 2) -> list[str]:
    """The lines of a refusal: exit status ``code``, one or two lines on stderr, the first
    ``error: ...``, no traceback."""
    lines = p.stderr.strip().splitlines()
    assert p.returncode == code, p.stdout + p.stderr
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    return lines


def tree(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` with its bytes (what "intact" compares), less the lock file,
    which names the last process that held it."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(Path(folder).rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def results(results_with_cache):
    return results_with_cache


# ---------------------------------------------------------------- 1. two runs, one folder

def _lock_holder(run_dir: Path, procs, timeout: float = 60.0) -> int:
    """The pid that holds ``run_dir``'s lock, stopped (SIGSTOP) the moment it is seen to hold it."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            text = (run_dir / ".lock").read_text()
        except OSError:
            text = ""
        if text.startswith("pid "):
            pid = int(text.split()[1])
            os.kill(pid, signal.SIGSTOP)
            return pid
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.001)
    raise AssertionError("no process took the run folder's lock")


def test_two_configs_started_together_in_one_folder_never_delete_the_finished_run(tmp_path,
                                                                                 results):
    """Two runs of different configs given one hydra.run.dir, started together: the one that
    gets the folder first runs; the other waits, then is refused in one or two lines and
    removes nothing. The first holder is stopped while it holds the lock (before it has written
    a row), so the second reaches the folder while it looks new: the race that deleted the
    finished run (the refused run had judged the folder its own before waiting for it)."""
    run_dir = tmp_path / "run"
    procs = {seed: subprocess.Popen(
        [sys.executable, "-m", "experiments.logreg", "steps=2000", f"seed={seed}",
         "log_every=100", "checkpoint_every=0", f"results_dir={results}",
         f"hydra.run.dir={run_dir}"], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for seed in (51, 52)}
    holder = _lock_holder(run_dir, procs.values())
    try:
        time.sleep(6)                       # the other one starts and reaches the folder
    finally:
        os.kill(holder, signal.SIGCONT)
    out = {seed: p.communicate(timeout=300) for seed, p in procs.items()}
    (winner,) = [s for s, p in procs.items() if p.pid == holder]
    (loser,) = [s for s in procs if s != winner]
    assert procs[winner].returncode == 0, out[winner]
    loss = subprocess.CompletedProcess([], procs[loser].returncode, *out[loser])
    lines = refused(loss)
    assert "holds another run" in lines[0] and f"seed: {loser} here, {winner} there" in lines[0]
    assert run_dir.is_dir(), "the finished run's folder was deleted"
    summary = read_summary(run_dir)
    assert summary["status"] == "ok" and summary["seed"] == winner
    assert run_status(run_dir) == "ok"            # metrics.jsonl is the file the summary describes
    assert [r["step"] for r in read_rows(run_dir)] == list(range(0, 2001, 100))
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert f"seed={winner}" in overrides and f"seed={loser}" not in overrides
    assert f"seed {loser}" not in (run_dir / "logreg.log").read_text()


# ---------------------------------------------------------------- 4. a damaged summary

DAMAGED_RUN = ["steps=200", "log_every=50", "checkpoint_every=0"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, results) -> Path:
    """One finished run (seed 21), which each case below copies and damages."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    done = cli(*DAMAGED_RUN, f"results_dir={results}", f"hydra.run.dir={run_dir}", "seed=21")
    assert done.returncode == 0, done.stderr
    return run_dir


@pytest.mark.parametrize("damage", ["truncated", "not json", "no config"])
def test_a_damaged_summary_is_never_overwritten_by_another_config(tmp_path, results,
                                                                  finished_run, damage):
    import shutil
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    common = [*DAMAGED_RUN, f"results_dir={results}", f"hydra.run.dir={run_dir}"]
    summary = run_dir / "summary.json"
    text = summary.read_text()
    summary.write_text({"truncated": text[:len(text) // 2], "not json": "\x00\x01garbage",
                        "no config": json.dumps({"status": "ok"})}[damage])
    before = tree(run_dir)
    lines = refused(cli(*common, "seed=22"))
    assert "damaged" in lines[0] and "summary.json" in lines[0], lines
    assert "overwrite=true" in lines[-1]
    assert tree(run_dir) == before                 # not a byte changed, nothing added
    again = cli(*common, "seed=21")                # the run's own config: recomputed
    assert again.returncode == 0, again.stderr
    assert read_summary(run_dir)["seed"] == 21 and run_status(run_dir) == "ok"


# ---------------------------------------------------------------- 2. absurd values in the data

A5A = Path(__import__("experiments.tasks", fromlist=["libsvm_file"]).libsvm_file(
    "a5a", download=False))

BAD_ROWS = {   # case: (line 57 of a5a made into, words of the message)
    "value 1e300": ("-1 3:1e300 7:1", "feature 3 is 1e+300, beyond float32's range"),
    "value nan": ("-1 5:nan 7:1", "feature 5 is nan, not a finite number"),
    "value -inf": ("+1 2:1 9:-inf", "feature 9 is -inf, not a finite number"),
    "value 1e39": ("+1 4:1e39", "beyond float32's range"),
    "label 7": ("7 3:1 7:1", "label 7 is not a binary label"),
    "label 2": ("2 3:1", "label 2 is not a binary label"),
}


def _a5a_with(tmp_path: Path, line: str) -> Path:
    """A copy of a5a whose line 57 is ``line``, in ``tmp_path/in/libsvm/a5a``."""
    data = tmp_path / "in" / "libsvm" / "a5a"
    data.parent.mkdir(parents=True)
    lines = A5A.read_text().splitlines(keepends=True)
    lines[56] = line + "\n"
    data.write_text("".join(lines))
    return data


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_absurd_data_values_and_labels_are_named_with_their_line(tmp_path, case):
    """A value that is not finite or not a float32, or a label that is not binary, in an a5a
    file: the loader's error names the file's line, what is wrong and the fix."""
    from experiments.tasks import DataCorruptError
    from experiments.tasks.logreg import load_libsvm
    line, words = BAD_ROWS[case]
    data = _a5a_with(tmp_path, line)
    with pytest.raises(DataCorruptError) as err:
        load_libsvm(data)
    first, fix = str(err.value).splitlines()
    assert first.startswith(f"{data} line 57: ") and words in first, first
    assert "get it again" in fix


def test_absurd_data_is_refused_before_any_compute(tmp_path):
    """Such a file given to a run and to a sweep: exit 2 in one or two lines naming the line,
    before f* or any step is computed, no run folder (every case reaches the command line
    through the one loader checked above)."""
    line, words = BAD_ROWS["value nan"]
    data = _a5a_with(tmp_path, line)
    out = tmp_path / "out"
    t0 = time.time()
    p = cli("steps=5", f"data_dir={data.parents[1]}", f"hydra.run.dir={out / 'run'}",
            f"results_dir={out / 'res'}")
    said = refused(p)
    assert f"{data} line 57: " in said[0] and words in said[0], said
    assert not out.exists()                   # no run folder, no f* (nothing computed)
    assert time.time() - t0 < 60
    sweep = cli("-m", "seed=0,1", "steps=5", f"data_dir={data.parents[1]}",
                f"hydra.sweep.dir={out / 'sweep'}", f"results_dir={out / 'res'}")
    assert f"{data} line 57: " in refused(sweep)[0] and not out.exists()


def test_binary_labels_written_0_and_1_are_read_as_minus_and_plus_one(tmp_path):
    from experiments.tasks.logreg import load_libsvm
    path = tmp_path / "zero_one"
    path.write_text("0 1:1\n1 2:0.5\n# a comment\n\n+1 3:1\n-1 4:1\n")
    A, b = load_libsvm(path)
    assert b.tolist() == [-1.0, 1.0, 1.0, -1.0] and A.shape == (4, 124)


def _export(root: Path, odd: str | None) -> Path:
    """A tiny CIFAR-10 JPEG export (two classes, two images each per split) with one odd
    thing in its train split: a 16x16 image, a class folder that is not CIFAR-10's, or a file
    that is not an image."""
    from torchvision.io import write_jpeg
    from experiments.tasks import cifar10
    out = root / cifar10.JPEG_DIR
    for split in ("train", "test"):
        for c, cls in enumerate(("airplane", "bird")):
            (out / split / cls).mkdir(parents=True)
            for i in range(2):
                img = torch.full((3, 32, 32), 40 * (c + 1) + 20 * i, dtype=torch.uint8)
                write_jpeg(img, str(out / split / cls / f"{i:04d}.jpg"), quality=95)
    if odd == "16x16 image":
        write_jpeg(torch.zeros(3, 16, 16, dtype=torch.uint8), str(out / "train/bird/0001.jpg"))
    elif odd == "class junk":
        (out / "train" / "junk").mkdir()
        write_jpeg(torch.zeros(3, 32, 32, dtype=torch.uint8), str(out / "train/junk/0000.jpg"))
    elif odd == "not an image":
        (out / "train/bird/0001.jpg").write_bytes(b"\x00garbage, not a JPEG")
    return out


CIFAR_ODD = {"16x16 image": ("train/bird/0001.jpg", "16x16"),
             "class junk": ("train/junk", "not a CIFAR-10 class"),
             "not an image": ("train/bird/0001.jpg", "cannot be decoded")}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # torchvision.io's write_jpeg
@pytest.mark.parametrize("odd", list(CIFAR_ODD))
def test_a_cifar_export_with_an_odd_image_or_class_is_refused_naming_it(tmp_path, odd):
    from experiments.tasks import DataCorruptError, cifar10
    export = _export(tmp_path / "data", odd)
    where, words = CIFAR_ODD[odd]
    with pytest.raises(DataCorruptError) as err:
        cifar10.load_cifar10(tmp_path / "data", tmp_path / "cache", source="jpeg",
                             download=False)
    message = str(err.value)
    assert str(export / where) in message and words in message and len(message.splitlines()) <= 2
    assert not (tmp_path / "cache").exists()        # nothing cached from it


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_sound_cifar_export_loads(tmp_path):
    from experiments.tasks import cifar10
    _export(tmp_path / "data", None)
    data = cifar10.load_cifar10(tmp_path / "data", None, source="jpeg", download=False)
    assert data.classes == ["airplane", "bird"] and data.train_x.shape == (4, 3, 32, 32)


# ---------------------------------------------------------------- 3, 8. where the data is looked for

# No network: the download goes through a proxy on a local port where nothing listens, so it
# fails at once, as on a machine without internet.
OFFLINE = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
           "no_proxy": "", "NO_PROXY": ""}


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory):
    """The tracked files of this checkout (as they are now) in a folder with no data beside it
    (no ``../shared/data``, no ``./data``), sharing this checkout's virtual environment, whose
    install stamp is newer than the clone's pyproject.toml (make installs nothing). The f*
    cache is copied, so that a run there does not solve for f* again."""
    import shutil
    root = tmp_path_factory.mktemp("fresh") / "gluon-fl"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in files:
        if not name or name.startswith("results/sweeps/") or not (REPO / name).is_file():
            continue
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    (root / ".venv").symlink_to(REPO / ".venv")
    stamp = (REPO / ".venv" / ".installed").stat().st_mtime
    os.utime(root / "pyproject.toml", (stamp - 60, stamp - 60))
    (root / "results" / "cache").mkdir(parents=True, exist_ok=True)
    for f in (REPO / "results" / "cache").glob("fstar-*.json"):
        shutil.copy(f, root / "results" / "cache" / f.name)
    assert not (root.parent / "shared").exists() and not (root / "data").exists()
    return root


def make(clone: Path, *args: str, env: dict | None = None, timeout: float = 300):
    environ = {k: v for k, v in ENV.items() if k not in ("MAKEFLAGS", "MFLAGS", "PYTHONPATH")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=clone,
                          env={**environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def test_make_logreg_on_a_fresh_machine_without_data_or_network_says_where_it_looked(
        fresh_clone):
    """No data anywhere, no network: ``make logreg`` tries the download (the Makefile no
    longer sets a GLUON_DATA_DIR of its own, which stopped it), then exits 2 with three lines:
    where it looked and that the download failed, how to get the file, make's own line."""
    p = make(fresh_clone, "logreg", env=OFFLINE)
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(lines) <= 3 and "Traceback" not in p.stderr, lines
    first = lines[0]
    assert first.startswith("error: LIBSVM dataset 'a5a' not found"), lines
    assert str(fresh_clone / "data" / "libsvm" / "a5a") in first
    assert str(fresh_clone.parent / "shared" / "data" / "libsvm" / "a5a") in first
    assert "download from https://www.csie.ntu.edu.tw" in first and "failed" in first
    assert "GLUON_DATA_DIR=" not in first                # a variable the user never set
    assert "put it at <dir>/libsvm/a5a" in lines[1] and "GLUON_DATA_DIR=<dir>" in lines[1]
    assert not (fresh_clone / "data").exists() and not (fresh_clone / "results" / "runs").exists()


def test_make_logreg_on_a_fresh_machine_runs_with_gluon_data_dir_set(fresh_clone):
    data = Path(__import__("experiments.tasks", fromlist=["x"]).libsvm_file("a5a", download=False))
    p = make(fresh_clone, "logreg", env={**OFFLINE, "GLUON_DATA_DIR": str(data.parents[1])})
    assert p.returncode == 0, p.stdout + p.stderr
    run = fresh_clone / "results" / "runs" / "example"
    assert read_summary(run)["status"] == "ok" and read_summary(run)["steps_done"] == 10000


def test_two_make_targets_started_at_once_in_a_fresh_clone_set_up_the_venv_once(tmp_path):
    """A fresh clone, no .venv, and two targets started together (a sweep and a figure): both
    need the set-up. A stand-in for ``python3 -m venv`` fails as the real one did when a second
    creation races the first (the folder exists), and records each creation and install. Under
    the lock one set-up runs; the second target finds it done, and both succeed."""
    import shutil
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    log = tmp_path / "calls.log"
    fake = tmp_path / "fake-python3"
    fake.write_text(f"""#!/bin/sh
# stands in for python3 -m venv DIR: creating a folder that exists fails, as in the race
[ "$1 $2" = "-m venv" ] || exit 9
mkdir "$3" || exit 1
echo venv >> {log}
sleep 1
mkdir "$3/bin"
printf '#!/bin/sh\necho "pip $*" >> {log}\nsleep 0.5\n' > "$3/bin/python"
chmod +x "$3/bin/python"
""")
    fake.chmod(0o755)
    env = {k: v for k, v in ENV.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    start = [subprocess.Popen(["make", "--no-print-directory", "install", f"PY_SYS={fake}"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=60)[0] for p in start]
    assert [p.returncode for p in start] == [0, 0], outputs
    calls = log.read_text().splitlines()
    assert calls.count("venv") == 1, calls
    assert sum("install -q -e" in c for c in calls) == 1, calls
    assert (tmp_path / ".venv" / ".installed").exists()


def test_a_set_data_folder_is_never_a_fall_back(tmp_path):
    """GLUON_DATA_DIR (or data_dir) naming an empty folder: the data is looked for there only
    (with a download into it), never in ./data or ../shared/data; a variable set to nothing
    is an error too. One or two lines, exit 2, no run folder."""
    (tmp_path / "empty").mkdir()
    for args, env, words in (
            ([], {"GLUON_DATA_DIR": str(tmp_path / "empty")}, str(tmp_path / "empty/libsvm/a5a")),
            ([f"data_dir={tmp_path / 'empty'}"], {}, str(tmp_path / "empty/libsvm/a5a")),
            ([], {"GLUON_DATA_DIR": ""}, "GLUON_DATA_DIR is set to nothing")):
        p = cli("steps=5", f"hydra.run.dir={tmp_path / 'run'}", f"results_dir={tmp_path / 'res'}",
                *args, env={**OFFLINE, **env})
        first = refused(p)[0]
        assert words in first, first
        assert "shared/data" not in first and str(REPO / "data") not in first, first
        assert not (tmp_path / "run").exists() and list((tmp_path / "empty").iterdir()) == []


# ---------------------------------------------------------------- 9. folder names

def test_a_long_folder_name_drops_whole_settings_never_cuts_a_value():
    """A name over MAX_NAME characters drops whole ``key=value`` parts (the seed is kept, a
    ``...`` says parts were dropped); before, ``seed=123456789012`` was shown as ``seed=12345``."""
    from experiments.shared import runs
    config = {"method": {"name": "alg1", **{f"setting_{i}": 0.123456789 + i for i in range(12)}},
              "compressor": {"name": "randk", "density": 0.01}, "seed": 123456789012,
              "task": {"name": "logreg"}, "steps": 10}
    name = runs.folder_name(config, "data")
    full = ["compressor=randk", "density=0.01",
            *[f"setting_{i}={0.123456789 + i!r}" for i in range(12)], "seed=123456789012"]
    assert len(name) <= runs.MAX_NAME and len(",".join(full)) > runs.MAX_NAME
    *parts, tag = name.split(",")
    assert tag == f"id={runs.run_id(config, 'data')}"
    assert "seed=123456789012" in parts and "..." in parts
    assert all(p in full for p in parts if p != "..."), parts      # no value cut
    assert parts[:2] == full[:2]                                    # the compressor first
    short = {**config, "method": {"name": "alg1", "lr": 0.01}}      # a name that fits: as before
    assert runs.folder_name(short, "d") == (f"compressor=randk,density=0.01,lr=0.01,"
                                            f"seed=123456789012,id={runs.run_id(short, 'd')}")


def _committed_summaries() -> list[Path]:
    """The summary.json of every run committed under results/sweeps (in a copy of the checkout
    without its .git: every one there)."""
    p = subprocess.run(["git", "ls-files", "-z", "results/sweeps"], cwd=REPO,
                       capture_output=True)
    if p.returncode != 0:
        return sorted((REPO / "results" / "sweeps").rglob("summary.json"))
    return sorted(REPO / f for f in p.stdout.decode().split("\0")
                  if f.endswith("/summary.json"))


def test_every_committed_run_keeps_its_folder_name():
    """The run folders committed under results/sweeps are where their sweeps look for them:
    their names are what folder_name gives their recorded config and data today."""
    from experiments.shared import runs
    found = _committed_summaries()
    assert found
    for path in found:
        s = json.loads(path.read_text())
        assert runs.folder_name(s["config"], s["data_id"]) == path.parent.name, path


def test_ctrl_c_while_waiting_for_another_runs_folder_is_one_line_and_130(tmp_path, results):
    from experiments.shared.lock import RunLock
    run_dir = tmp_path / "run"
    with RunLock(run_dir):                             # another process writes the folder
        proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.logreg", "steps=50", f"results_dir={results}",
             f"hydra.run.dir={run_dir}"], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        said = proc.stdout.readline()
        assert "is being written by pid" in said and "waiting" in said, said
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "stopped: SIGINT (Ctrl-C)", out + err
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]    # nothing else touched


# ---------------------------------------------------------------- 7. migrate and unreadable summaries

def test_migrate_exits_non_zero_when_a_summary_is_unreadable(tmp_path, results):
    sweep = tmp_path / "sweep"
    made = subprocess.run([sys.executable, "-m", "experiments.logreg", "-m", "seed=0,1",
                           "steps=40", "log_every=20", "checkpoint_every=0",
                           f"results_dir={results}", f"hydra.sweep.dir={sweep}"], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    good, bad = sorted(p.parent for p in sweep.rglob("summary.json"))
    (bad / "summary.json").write_text('{"status": "ok", "conf')
    before = tree(sweep)
    for check in (["--check"], []):
        p = subprocess.run([sys.executable, "-m", "experiments.run.migrate", str(sweep), *check],
                           cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
        assert p.returncode == 1, p.stdout + p.stderr
        assert f"damaged: {bad}: summary.json is unreadable" in p.stdout, p.stdout
        assert "1 damaged" in p.stderr and "Traceback" not in p.stderr
        assert tree(sweep) == before                # nothing written, nothing renamed
    assert run_status(bad) == "damaged" and run_status(good) == "ok"
    table = subprocess.run([sys.executable, "-m", "scripts.analysis.summarize", str(sweep), "--per-run",
                            "--out", str(tmp_path / "t.csv")], cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=300)
    assert table.returncode == 0 and "summary.json is unreadable" in table.stdout + table.stderr


# ---------------------------------------------------------------- 5. W&B that does not start

def test_wandb_that_cannot_start_is_a_failed_run_in_two_lines(tmp_path, results):
    """wandb.mode=online with no API key and W&B's server out of reach (its address a local
    port where nothing listens): exit 1, "failed" recorded with the reason, two lines on
    stderr and no traceback. The same command runs once W&B is offline."""
    run_dir = tmp_path / "run"
    home = tmp_path / "home"                        # no ~/.netrc with a key in it
    home.mkdir()
    env = {k: v for k, v in ENV.items() if not k.startswith("WANDB_")}
    env.update(OFFLINE, HOME=str(home), WANDB_MODE="online", WANDB_SILENT="true",
               WANDB_BASE_URL="http://127.0.0.1:9", WANDB_DIR=str(tmp_path / "wandb"))
    args = ["steps=50", "log_every=10", f"results_dir={results}", f"hydra.run.dir={run_dir}",
            "wandb.enabled=true"]
    p = subprocess.run([sys.executable, "-m", "experiments.logreg", *args, "wandb.mode=online"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    lines = refused(p, code=1)
    assert "W&B did not start" in lines[0] and "wandb.mode=online" in lines[0], lines
    assert "wandb.mode=offline" in lines[-1]
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and "W&B did not start" in summary["error"]
    assert run_status(run_dir) == "failed"
    again = subprocess.run([sys.executable, "-m", "experiments.logreg", *args,
                            "wandb.mode=disabled"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=180)
    assert again.returncode == 0, again.stderr
    assert read_summary(run_dir)["status"] == "ok"


# ---------------------------------------------------------------- 6. Ctrl-C

def test_ctrl_c_checkpoints_says_one_line_and_exits_130_then_resumes(tmp_path, results):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "experiments.logreg", "steps=8000", "log_every=100",
            "checkpoint_every=0", "progress_s=0", f"results_dir={results}",
            f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,    # SIGINT as in a terminal
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    t0 = time.time()
    while not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").stat().st_size == 0:
        assert proc.poll() is None and time.time() - t0 < 120, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    assert len(err.strip().splitlines()) == 1 and "SIGINT" in err, err
    assert "[signal] SIGINT at step" in out and "checkpoint written" in out
    assert (run_dir / "checkpoint.pt").exists() and read_summary(run_dir) is None
    assert run_status(run_dir) == "interrupted"
    k = torch.load(run_dir / "checkpoint.pt", weights_only=False)["method"]["k"]
    assert 0 < k < 8000
    done = subprocess.run(args, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and f"[resume] {run_dir}: from step {k} " in done.stdout, done
    assert read_summary(run_dir)["status"] == "ok" and read_summary(run_dir)["resumed"]


# ---------------------------------------------------------------- 11. what a newcomer meets

def _committed_sweeps() -> list[Path]:
    """Every committed sweep: each folder under results/sweeps whose runs sit in method folders."""
    return sorted({p.parents[2] for p in _committed_summaries()})


@pytest.mark.parametrize("sweep", _committed_sweeps(),
                         ids=lambda p: p.relative_to(REPO / "results" / "sweeps").as_posix())
def test_summarize_reads_every_committed_sweep(sweep, tmp_path, capsys):
    """The CNN-gap study's sweeps are committed without hydra's .hydra folders; summarize found
    no run in them ("not a sweep"), although migrate --check reads them. (In this process: the
    command line's own start is tested in tests/test_summarize.py.)"""
    from scripts.analysis import summarize
    assert summarize.main([str(sweep), "--out", str(tmp_path / "table.csv")]) == 0
    out, err = capsys.readouterr()
    n = len(list(sweep.rglob("config.json")))      # every run folder, a run in flight included
    assert f": {n} runs in " in out.splitlines()[0], out
    assert "damaged" not in out + err and (tmp_path / "table.csv").is_file()


def test_an_unquoted_space_in_a_value_gets_a_hint_to_quote_it(tmp_path):
    """``hydra.run.dir=my dir`` typed unquoted reaches hydra as two overrides (``dir`` has no
    ``=``); a stray quote is a grammar error (LexerNoViableAltException). Both: one or two
    lines that say to quote the value, exit 2, no folder."""
    p = cli("steps=5", f"hydra.run.dir={tmp_path / 'my'}", "dir")
    lines = refused(p)
    assert "'dir' is not key=value" in lines[0] and "quote" in p.stderr, lines
    assert f"'hydra.run.dir={tmp_path / 'my'} dir'" in p.stderr, lines
    p = cli("steps=5", f"hydra.run.dir={tmp_path / 'my'}'s run")
    lines = refused(p)
    assert "hydra.run.dir=" in lines[0] and "quote" in p.stderr, lines
    assert "LexerNoViableAltException" not in p.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_key_table_names_every_key_a_run_has():
    """Every key of the run schema shared by the entry points (max_grads was missing) is in the
    first column of docs/running.md's table of keys (``wandb.*`` stands for the W&B keys)."""
    import re
    from dataclasses import fields
    from experiments.run.config import RunConf
    listed = set()
    for line in (REPO / "docs" / "running.md").read_text().splitlines():
        if line.startswith("| `"):
            listed |= {k.split(".")[0] for k in re.findall(r"`([a-z_.]+)", line.split("|")[1])}
    assert [f.name for f in fields(RunConf) if f.name not in listed] == []


# ---------------------------------------------------------------- 12. make verify

def _fake_panel(sweep: Path, shift: float = 0.0) -> None:
    """Two methods of a5a's panel, three seeds each: Gluon and Alg. 1, Alg. 1's curve
    ``shift`` lower in log10 (a larger reduction)."""
    comm = [0, 10, 20, 30, 40]
    for seed in range(3):
        for name, method, gap in (("g", "gluon", [1, .5, .2, .05, .02]),
                                  ("a", "alg1", [1, .1, .05, .01, .005])):
            d = sweep / f"{name}-{seed}"
            d.mkdir(parents=True)
            gap = [g * (1 + 0.1 * seed) * (10 ** -shift if method == "alg1" and i else 1)
                   for i, g in enumerate(gap)]
            config = {"method": {"name": method}, "compressor": {"name": "randk"},
                      "seed": seed, "max_comm": 40}
            (d / "summary.json").write_text(json.dumps({"status": "ok", "config": config,
                                                        "wall_time": 1.0}))
            (d / "metrics.jsonl").write_text("".join(
                json.dumps({"step": i, "comm": c, "bytes": 4 * c, "gap": g}) + "\n"
                for i, (c, g) in enumerate(zip(comm, gap))))


def _verify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.analysis.verify", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)


def test_verify_accepts_the_committed_table_and_regenerates_into_a_scratch_folder(tmp_path):
    """The committed reduction table against itself: reproduced, bit-identical. A regenerated
    panel (here a small fake one) is aggregated by the figure's code into --out, and
    results/fig2 is left as committed."""
    p = _verify("--new", str(REPO / "results" / "fig2" / "reduction.csv"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1] == "verdict: reproduced, bit-identical"
    assert "alg4       gluon                  77.0% [75.2%, 78.7%]           77.0%" in p.stdout
    committed = tree(REPO / "results" / "fig2")
    _fake_panel(tmp_path / "made")                  # the panel that was committed ...
    assert _verify("--sweep", str(tmp_path / "made"), "--out", str(tmp_path / "ref"),
                   "--committed", str(tmp_path / "ref")).returncode == 0
    _fake_panel(tmp_path / "again")                 # ... and made again on the same machine
    p = _verify("--sweep", str(tmp_path / "again"), "--out", str(tmp_path / "new"),
                "--committed", str(tmp_path / "ref"))
    assert p.returncode == 0 and "verdict: reproduced, bit-identical" in p.stdout, p
    assert (tmp_path / "new" / "reduction.csv").read_bytes() == \
        (tmp_path / "ref" / "reduction.csv").read_bytes()
    assert tree(REPO / "results" / "fig2") == committed
    missing = _verify("--sweep", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no such folder" in missing.stderr


def test_verify_refuses_a_reduction_outside_its_committed_interval(tmp_path):
    """A regenerated panel whose Alg. 1 saves far more uplink than the committed one (its
    curve lower): NOT reproduced, the row named, exit 1. A smaller move that stays inside the
    interval: reproduced, with the curves' difference reported."""
    for name, shift in (("ref", 0.0), ("near", 0.01), ("far", 0.6)):
        _fake_panel(tmp_path / name / "sweep", shift)
        p = _verify("--sweep", str(tmp_path / name / "sweep"), "--out",
                    str(tmp_path / name / "fig2"), "--committed", str(tmp_path / "ref" / "fig2"))
        if name == "ref":                     # the committed panel (against itself)
            assert p.returncode == 0, p.stdout + p.stderr
        elif name == "near":
            assert p.returncode == 0, p.stdout + p.stderr
            assert "verdict: reproduced: every reduction inside" in p.stdout
            assert "curves: differ from the committed ones by up to alg1" in p.stdout
        else:
            assert p.returncode == 1, p.stdout + p.stderr
            assert "verdict: NOT reproduced" in p.stdout and "OUTSIDE" in p.stdout


# ---------------------------------------------------------------- the table of what is tried

def test_every_test_docs_reliability_names_exists_and_this_files_are_all_named():
    """docs/reliability.md names tests as ``tests/<file>.py::<test>``: each must be a test
    function of that file; and every test of this file must be in the table."""
    import re
    text = (REPO / "docs" / "reliability.md").read_text()
    named = re.findall(r"`(tests/[a-z0-9_/]+\.py)::(test_[a-z0-9_]+)`", text)
    assert len(named) >= 50
    for path, name in named:
        source = (REPO / path).read_text()
        assert re.search(rf"^def {name}\(", source, flags=re.M), f"{path}::{name} does not exist"
    here = re.findall(r"^def (test_[a-z0-9_]+)\(", Path(__file__).read_text(), flags=re.M)
    here.remove("test_every_test_docs_reliability_names_exists_and_this_files_are_all_named")
    assert sorted(set(here) - {n for _, n in named}) == []
    assert "docs/reliability.md" in (REPO / "README.md").read_text()
