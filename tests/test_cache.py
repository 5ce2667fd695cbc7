"""Shared caches under results/cache are safe when parallel jobs build them at once.

On a fresh clone ``make fig2-cnn`` (parallel jobs) and SLURM arrays start several runs that
all miss the cache, build it and write it. These tests start 4 processes (forked from a fresh
forkserver interpreter, or spawned: not forks of this one) that wait on a barrier and then build the same cache
in the same fresh directory, several rounds in a row: every process must succeed and return
the same data, and no temporary file may be left behind. With the old fixed temporary name
(``path.with_suffix(".tmp")``) they fail: a ``replace`` finds its temporary file already moved
away (FileNotFoundError) or a reader loads a half-written file.
"""
from __future__ import annotations

import io
import json
import re
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from experiments.tasks import cifar10 as cifar
from experiments.shared.files import atomic_write, atomic_write_text
from experiments.tasks.logreg import cached_f_star

N_PROC = 4
ROUNDS = 4          # fresh cache directories per collision test
SAVES = 25          # writes per process in the save/load stress test
_BARRIER = None     # set in each pool worker by _init


# ------------------------------------------------------------------ pool workers (module level)

def _init(barrier) -> None:
    global _BARRIER
    _BARRIER = barrier
    torch.set_num_threads(1)


def _wait() -> None:
    _BARRIER.wait(timeout=60)


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _cifar_worker(args) -> list:
    """Each round: wait for the others, then load_cifar10 on a fresh cache directory. Errors
    are returned, not raised, so that every process keeps meeting the others at the barrier."""
    data_dir, cache_root = args
    out = []
    for r in range(ROUNDS):
        _wait()
        try:
            c = cifar.load_cifar10(data_dir, Path(cache_root) / f"round{r}", source="jpeg",
                                   download=False)
            out.append((c.train_x, c.train_y, c.test_x, c.test_y, c.classes, c.source))
        except Exception as err:
            out.append(_error(err))
    return out


def _stress_data() -> cifar.Cifar:
    g = torch.Generator().manual_seed(0)     # identical in every process
    x = torch.randint(0, 256, (400, 3, 32, 32), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (400,), generator=g)
    return cifar.Cifar(x, y, x[:100], y[:100], list(cifar.CLASSES), "jpeg", "stress")


def _save_stress_worker(path) -> int:
    """Every process writes the same cache file over and over while the others read it: every
    read must find a complete file."""
    path = Path(path)
    c = _stress_data()
    bad = []
    _wait()
    try:
        cifar._save(c, path)
    except Exception as err:
        bad.append(_error(err))
    _wait()                                   # from here on the file always exists
    for _ in range(SAVES):
        try:
            cifar._save(c, path)
            got = cifar._load_cache(path)
            if got is None or not torch.equal(got.train_x, c.train_x):
                bad.append("read no complete cache")
        except Exception as err:
            bad.append(_error(err))
    return bad


def _fstar_worker(args) -> list:
    cache, rounds = args
    g = torch.Generator().manual_seed(1)
    A = torch.randn(40, 5, generator=g)
    b = torch.where(torch.rand(40, generator=g) < 0.5, -1.0, 1.0)
    out = []
    for r in range(rounds):
        _wait()
        try:
            out.append(cached_f_star(A, b, 1e-2, Path(cache), {"data": "toy", "round": r}))
        except Exception as err:
            out.append(_error(err))
    return out


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def pool():
    """One pool of fresh processes for all tests. ``forkserver`` where there is one: a fresh
    interpreter that imports torch and this module once, then forks the workers (as spawn, but
    about 4x cheaper on 2 cores); else spawn. With N_PROC tasks and a barrier of N_PROC parties
    each worker takes exactly one task: a worker holding a task blocks at the barrier until
    every other task is held too."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__, "torchvision.io"])
    else:
        ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(N_PROC)
    with ctx.Pool(N_PROC, initializer=_init, initargs=(barrier,)) as p:
        yield p


def _run(pool, fn, args):
    return pool.map_async(fn, [args] * N_PROC, chunksize=1).get(timeout=300)


def _tmp_files(d: Path) -> list[Path]:
    return [p for p in Path(d).rglob("*") if p.is_file() and "tmp" in p.name]


def _jpeg_export(root: Path, per_class: int = 2) -> Path:
    """A tiny cifar10-jpeg/{train,test}/<class>/NNNN.jpg export."""
    from PIL import Image
    g = torch.Generator().manual_seed(2)
    for split in ("train", "test"):
        for cls in cifar.CLASSES:
            d = root / cifar.JPEG_DIR / split / cls
            d.mkdir(parents=True)
            for i in range(per_class):
                px = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8, generator=g)
                Image.fromarray(px.numpy()).save(d / f"{i:04d}.jpg", quality=75)
    return root


# ------------------------------------------------------------------ the tests

def test_cifar_cache_parallel_build(pool, tmp_path):
    data = _jpeg_export(tmp_path / "data")
    ref = cifar.load_cifar10(data, None, source="jpeg", download=False)   # no cache
    cache = tmp_path / "cache"
    results = _run(pool, _cifar_worker, (str(data), str(cache)))
    errors = [x for per_proc in results for x in per_proc if isinstance(x, str)]
    assert errors == []
    for per_proc in results:
        assert len(per_proc) == ROUNDS
        for trx, try_, tex, tey, classes, source in per_proc:
            assert torch.equal(trx, ref.train_x) and torch.equal(try_, ref.train_y)
            assert torch.equal(tex, ref.test_x) and torch.equal(tey, ref.test_y)
            assert classes == list(cifar.CLASSES) and source == "jpeg"
    for r in range(ROUNDS):
        (only,) = (cache / f"round{r}").iterdir()           # one cache file, named by content
        assert re.fullmatch(r"cifar10-jpeg-[0-9a-f]{16}-v%d\.pt" % cifar.CACHE_VERSION, only.name)
        hit = cifar._load_cache(only)
        assert hit is not None and torch.equal(hit.train_x, ref.train_x)
    assert _tmp_files(cache) == []


def test_cifar_cache_concurrent_save_and_load(pool, tmp_path):
    path = tmp_path / "cache" / "cifar10-jpeg-v1.pt"
    bad = [x for per_proc in _run(pool, _save_stress_worker, str(path)) for x in per_proc]
    assert bad == []
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_f_star_cache_parallel_build(pool, tmp_path):
    cache = tmp_path / "cache"
    rounds = 50
    results = _run(pool, _fstar_worker, (str(cache), rounds))
    assert [x for per_proc in results for x in per_proc if isinstance(x, str)] == []
    for r in range(rounds):
        infos = [per_proc[r] for per_proc in results]
        assert all(i == infos[0] for i in infos)
        assert infos[0]["round"] == r and "f_star" in infos[0]
        (f,) = cache.glob(f"fstar-*round={r}.json")
        assert json.loads(f.read_text()) == infos[0]
    assert len(list(cache.iterdir())) == rounds
    assert _tmp_files(cache) == []


# ------------------------------------------------------------------ in-process checks

def test_atomic_write_cleans_up_on_error(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    atomic_write_text(path, "old")

    def boom(fh):
        fh.write(b"half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        atomic_write(path, boom)
    assert path.read_text() == "old"
    assert [p.name for p in path.parent.iterdir()] == ["f.txt"]


def test_unreadable_caches_are_misses(tmp_path):
    # a truncated CIFAR cache (as an old non-atomic write could leave) is rebuilt, with a warning
    data = _jpeg_export(tmp_path / "data", per_class=1)
    cache = tmp_path / "cache"
    good = cifar.load_cifar10(data, cache, source="jpeg", download=False)
    (path,) = cache.glob("cifar10-jpeg-*.pt")
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.warns(RuntimeWarning, match="unreadable CIFAR-10 cache"):
        again = cifar.load_cifar10(data, cache, source="jpeg", download=False)
    assert torch.equal(again.train_x, good.train_x)
    buf = io.BytesIO(path.read_bytes())
    assert torch.load(buf, weights_only=True)["version"] == cifar.CACHE_VERSION
    # a truncated f* cache is recomputed
    A, b = torch.randn(20, 3), torch.ones(20)
    info = cached_f_star(A, b, 1e-2, cache, {"data": "toy"})
    (f,) = cache.glob("fstar-*.json")
    f.write_text(f.read_text()[:10])
    with pytest.warns(RuntimeWarning, match="unreadable f"):
        assert cached_f_star(A, b, 1e-2, cache, {"data": "toy"}) == info
    assert json.loads(f.read_text()) == info
