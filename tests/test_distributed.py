"""``comm=torchdist``: the same run on real gloo processes equals the in-process simulation.

One start of 4 processes (``torch.multiprocessing``, fork where available) runs every case of
:data:`CASES` through the run lifecycle (:func:`experiments.run.lifecycle.execute`, as the
entry point does under torchrun) in one process group; the parent runs the same configs
simulated. Compared: metrics.jsonl row by row (bitwise for compressed messages and for dense
ones gathered with ``dense_collective=all_gather``; within 1e-6 for the dense all_reduce), the
final parameters, the ledger, and the bytes each rank put into the collectives. A last test
starts ``torchrun -m experiments.logreg comm=torchdist`` itself.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.run.lifecycle import execute
from experiments.shared.runs import CHECKPOINT, read_rows, read_summary
from experiments.run.world import free_port, open_world
from experiments.tasks import logreg as task
from gluon import InProcessComm, encode, make_compressor
from tests.conftest import REPO, compose_config, metrics_bytes, stopping_train, untimed

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

WORLD, STEPS, SEED, Q = 4, 40, 1, 0.3
COMMON = [f"steps={STEPS}", f"seed={SEED}", "method.beta=0.9", "method.lr=0.05", "log_every=5",
          "checkpoint_every=0", "keep_checkpoint=true", f"n_workers={WORLD}", "progress_s=0"]
SPARSE = ["compressor.density=0.1"]
CASES = {
    "alg1-randk": ["method=alg1", "compressor=randk", *SPARSE, f"method.q={Q}", "method.B=2"],
    "alg2-topk": ["method=alg2", "compressor=topk", *SPARSE, f"method.q={Q}", "method.B=2"],
    "alg3-randk": ["method=alg3", "compressor=randk", *SPARSE, f"method.q={Q}", "method.B=2"],
    "alg4-topk": ["method=alg4", "compressor=topk", *SPARSE, f"method.q={Q}", "method.B=2"],
    "gluon": ["method=gluon"],
    "vr_marina-randk": ["method=vr_marina", "compressor=randk", *SPARSE, f"method.q={Q}"],
    "ef21_muon-topk": ["method=ef21_muon", "compressor=topk", *SPARSE],
    "local_gluon": ["method=local_gluon", f"method.q={Q}", "method.B=2"],
    "alg1-natural": ["method=alg1", "compressor=natural", f"method.q={Q}", "method.B=2"],
    "alg3-qsgd": ["method=alg3", "compressor=qsgd", "compressor.levels=4", f"method.q={Q}"],
    # dense messages (Gluon's, and Alg. 1's at a synchronisation) gathered and averaged as the
    # simulation does: bit-identical; the others sum dense messages in the all_reduce's order
    "gluon-exact": ["method=gluon", "dense_collective=all_gather"],
    "alg1-randk-exact": ["method=alg1", "compressor=randk", *SPARSE, f"method.q={Q}", "method.B=2",
                         "dense_collective=all_gather"],
}
START = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _rank_entry(rank: int, world: int, port: int, results: str, out: str) -> None:
    """One rank: join the group, run every case through the lifecycle (rank 0 writes)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    w = open_world("torchdist", "cpu")
    try:
        for name, overrides in CASES.items():
            cfg = compose_config("logreg", *overrides, *COMMON, f"results_dir={results}",
                                 "comm=torchdist")
            w.dense = str(cfg.dense_collective.value)
            execute(cfg, Path(out) / name, task, w)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A results folder holding the f* cache (computed once, not by every process)."""
    out = tmp_path_factory.mktemp("results")
    (out / "cache").mkdir()
    for f in (REPO / "results" / "cache").glob("fstar-*.json"):
        shutil.copy(f, out / "cache" / f.name)
    cfg = compose_config("logreg", f"results_dir={out}")
    task.build(cfg, make_compressor("identity"))
    return out


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory, results):
    out = tmp_path_factory.mktemp("dist")
    for attempt in range(2):   # a port taken between free_port() and bind: try once more
        try:
            mp.start_processes(_rank_entry, args=(WORLD, free_port(), str(results), str(out)),
                               nprocs=WORLD, join=True, start_method=START)
            break
        except Exception:
            if attempt:
                raise
    return out


@pytest.fixture(scope="module")
def sim_runs(tmp_path_factory, results):
    out = tmp_path_factory.mktemp("sim")
    for name, overrides in CASES.items():
        execute(compose_config("logreg", *overrides, *COMMON, f"results_dir={results}"),
                out / name, task)
    return out


def _params(run_dir: Path) -> list[torch.Tensor]:
    return torch.load(run_dir / CHECKPOINT, weights_only=False)["method"]["params"]


def test_both_coin_outcomes_occur():
    rng = random.Random(SEED)
    draws = [rng.random() < Q for _ in range(STEPS)]
    assert any(draws) and not all(draws)


@pytest.mark.parametrize("name", list(CASES))
def test_metrics_and_parameters_equal_simulation(name, dist_runs, sim_runs):
    d, s = dist_runs / name, sim_runs / name
    rows_d, rows_s = read_rows(d), read_rows(s)
    assert len(rows_d) == len(rows_s) == STEPS // 5 + 1
    pd, ps = _params(d), _params(s)
    assert not torch.equal(pd[0], torch.zeros_like(pd[0]))
    if not name.endswith("-exact"):
        for a, b in zip(pd, ps):
            assert torch.allclose(a, b, rtol=0.0, atol=1e-6), float((a - b).abs().max())
        for a, b in zip(rows_d, rows_s):
            assert a["comm"] == b["comm"] and a["bytes"] == b["bytes"]
            assert abs(a["gap"] - b["gap"]) <= 1e-6
    else:
        assert all(torch.equal(a, b) for a, b in zip(pd, ps))
        assert metrics_bytes(d) == metrics_bytes(s)


COSTS = ("grads", "up_bytes", "down_bytes", "star_down_bytes", "rounds", "hops")


@pytest.mark.parametrize("name", list(CASES))
def test_cost_columns_equal_simulation(name, dist_runs, sim_runs):
    """Every row's compute and traffic columns are the simulation's, exactly (docs/cost.md)."""
    rows_d, rows_s = read_rows(dist_runs / name), read_rows(sim_runs / name)
    for a, b in zip(rows_d, rows_s):
        assert {k: a[k] for k in COSTS} == {k: b[k] for k in COSTS}
        assert a["compute_s"] >= 0 and b["compute_s"] >= 0
    last = rows_d[-1]
    assert last["grads"] > 0 and last["hops"] > 0
    if name == "gluon":          # ring all-reduce of the dense gradient, plus the coin, per step
        assert last["up_bytes"] == last["down_bytes"] == STEPS * 2 * (WORLD - 1) / WORLD * 124 * 4
        assert last["star_down_bytes"] == STEPS * 124 * 4 and last["rounds"] == STEPS
        assert last["hops"] == STEPS * (2 * (WORLD - 1) + 1)
    if name == "gluon-exact":    # all-gather: the other n - 1 dense gradients
        assert last["up_bytes"] == last["down_bytes"] == STEPS * (WORLD - 1) * 124 * 4
        assert last["hops"] == STEPS * WORLD
    if name == "ef21_muon-topk":  # TopK's average is not sparse at k: n - 1 packets come down
        dense = 124 * 4           # step 0 sends M^0 uncompressed (a ring all-reduce)
        assert last["down_bytes"] == (2 * (WORLD - 1) / WORLD * dense
                                      + (WORLD - 1) * (last["bytes"] - dense))


@pytest.mark.parametrize("name", list(CASES))
def test_ledger_and_measured_bytes(name, dist_runs, sim_runs):
    d, s = read_summary(dist_runs / name), read_summary(sim_runs / name)
    assert d["status"] == s["status"] == "ok"
    assert d["comm"] == s["comm"] and d["bytes"] == s["bytes"]       # the library's accounting
    sent = d["wire"]["measured_bytes_per_worker"]                      # what went on the wire
    assert len(sent) == WORLD and all(b == d["bytes"] for b in sent)
    assert d["wire"]["processes"] == WORLD and "wire" not in s
    if name == "local_gluon":   # only the dense syncs send anything
        assert 0 < d["bytes"] < STEPS * 124 * 4


def test_sparse_runs_send_less(dist_runs):
    dense = read_summary(dist_runs / "gluon")["bytes"]
    assert dense == STEPS * 124 * 4
    for name in ("alg1-randk", "alg2-topk", "local_gluon"):
        assert read_summary(dist_runs / name)["bytes"] < dense


def test_only_rank_0_writes_the_run_folder(dist_runs):
    files = {p.name for p in (dist_runs / "alg1-randk").iterdir()}
    assert {"metrics.jsonl", "summary.json", "config.json", CHECKPOINT} <= files
    assert not [f for f in files if f.endswith(".tmp")]


def test_torchrun_entry_point_writes_the_simulations_metrics(tmp_path, results):
    """`torchrun -m experiments.logreg comm=torchdist` (2 processes, to keep it quick) writes
    the run folder the simulation writes, byte for byte (dense messages gathered: bit-identical)."""
    overrides = ["method=alg1", "compressor=randk", "compressor.density=0.05", "method.q=0.5",
                 "method.B=2", "method.beta=0.9", "method.lr=0.05", "steps=30", "log_every=5",
                 "seed=2", "n_workers=2", f"results_dir={results}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "-m", "experiments.logreg", "comm=torchdist", "dense_collective=all_gather", *overrides,
           f"hydra.run.dir={tmp_path / 'dist'}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    sim = subprocess.run([sys.executable, "-m", "experiments.logreg", *overrides,
                          "dense_collective=all_gather",     # the traffic it counts: docs/cost.md
                          f"hydra.run.dir={tmp_path / 'sim'}"], env=env, capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert sim.returncode == 0, sim.stderr[-2000:]
    d, s = tmp_path / "dist", tmp_path / "sim"
    assert metrics_bytes(d) == metrics_bytes(s)
    sd, ss = read_summary(d), read_summary(s)
    assert sd["config"]["comm"] == "torchdist" and ss["config"]["comm"] == "sim"
    assert untimed(sd["final"]) == untimed(ss["final"]) and sd["wire"]["processes"] == 2
    assert "[start]" in (d / "logreg.log").read_text()           # rank 0 logs, once
    assert (d / "logreg.log").read_text().count("[start]") == 1
    # the same config was already finished by the simulation: torchrun into its folder skips
    again = subprocess.run([*cmd[:-1], f"hydra.run.dir={s}"], env=env, capture_output=True,
                           text=True, timeout=180, cwd=REPO)
    assert again.returncode == 0 and "[skip]" in again.stdout + again.stderr
    assert json.loads((s / "summary.json").read_text()) == ss


def test_torchdist_without_processes_is_a_config_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run([sys.executable, "-m", "experiments.logreg", "comm=torchdist",
                        f"hydra.run.dir={tmp_path / 'r'}"], env=env, capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2 and "torchrun" in p.stderr and len(p.stderr.splitlines()) <= 2
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- one process, world size 1

@pytest.fixture
def world1():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_world1_coin_state_and_errors(world1):
    from gluon.distributed import TorchDistComm
    comm, ref = TorchDistComm(seed=7), InProcessComm(1, seed=7)
    assert comm.n_workers == 1 and comm.local_workers == [0]
    assert [comm.coin(0.4) for _ in range(50)] == [ref.coin(0.4) for _ in range(50)]
    c = make_compressor("randk", density=0.5)
    msg = encode(c, [torch.arange(8.0)], run_seed=3, worker=0, step=5, dim=8)
    out = comm.average([msg])
    assert torch.equal(out[0], msg.values[0]) and out[0] is not msg.values[0]
    assert comm.ledger.bytes == msg.nbytes and comm.ledger.cost == msg.cost
    assert comm.global_ledger().state_dict() == comm.ledger.state_dict()
    state = comm.state_dict()
    other = TorchDistComm(seed=0)
    other.load_state_dict(state)
    assert other.state_dict() == state and other.coin(0.5) == comm.coin(0.5)
    with pytest.raises(ValueError, match="one worker per process"):
        comm.average([msg, msg])
    with pytest.raises(ValueError, match="worker 1"):
        comm.average([encode(c, [torch.ones(4)], run_seed=3, worker=1, step=0, dim=4)])
    # a receiver can rebuild any rank's RandK seed from the message coordinates only
    from gluon.compressors import message_seed
    assert comm._seed_of(msg, 2, 0) == message_seed(3, 2, 5, 0)
    msg.run_seed = None
    with pytest.raises(ValueError, match="run_seed and step"):
        comm._seed_of(msg, 2, 0)


def test_needs_process_group():
    from gluon.distributed import TorchDistComm
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchDistComm()


def test_destroy_process_group_frees_the_group_after_an_optimiser_was_built():
    """With gluon imported before init_process_group (as every entry point and the README's
    example do), building an optimiser does not pin the world group: destroy_process_group stops
    its gloo threads. A group that outlived it could abort the process at exit (a gloo thread
    releasing the last collective's tensors while the interpreter shuts down)."""
    code = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        import gluon
        from gluon.optim import CompressedGluon
        def threads():
            return len(os.listdir("/proc/self/task"))
        before = threads()
        dist.init_process_group("gloo", rank=0, world_size=1,
                                init_method="tcp://127.0.0.1:{free_port()}")
        during = threads()
        model = torch.nn.Linear(4, 2)
        opt = CompressedGluon(model.named_parameters(), lr=0.1, q=0.5, B=1,
                              compressor=gluon.RandK(density=0.5))
        t = torch.ones(2)
        dist.all_reduce(t)
        dist.destroy_process_group()
        print(before, during, threads())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    before, during, after = map(int, out.stdout.split())
    assert during > before          # the group's threads ran
    assert after == before          # and are gone once it is destroyed


# ---------------------------------------------------------------- the CNN task, the same way

CNN = ["profile=cpu", "method=alg2", "compressor=topk", "compressor.density=0.05", "method.q=0.5",
       "method.B=2", "steps=6", "log_every=2", "eval_every=6", "batch_size=4", "n_workers=2",
       "task.eval_train=16", "task.eval_test=16", "task.whiten_images=32", "checkpoint_every=0",
       "keep_checkpoint=true", "progress_s=0", "dense_collective=all_gather"]


def _cnn_task():
    from functools import partial
    from types import SimpleNamespace

    from experiments.tasks import cnn
    from tests.test_cnn import synthetic
    return SimpleNamespace(check=cnn.check, build=partial(cnn.build, data=synthetic()))


def _cnn_rank(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    w = open_world("torchdist", "cpu", "all_gather")
    try:
        execute(compose_config("cnn", *CNN, f"results_dir={out}", "comm=torchdist"),
                Path(out) / "run", _cnn_task(), w)
    finally:
        dist.destroy_process_group()


def test_cnn_on_two_processes_writes_the_simulations_run(tmp_path):
    mp.start_processes(_cnn_rank, args=(2, free_port(), str(tmp_path / "dist")), nprocs=2,
                       join=True, start_method=START)
    execute(compose_config("cnn", *CNN, f"results_dir={tmp_path / 'sim'}"), tmp_path / "sim" / "run",
            _cnn_task())
    d, s = tmp_path / "dist" / "run", tmp_path / "sim" / "run"
    assert metrics_bytes(d) == metrics_bytes(s)
    assert len(read_rows(d)) == 4 and "test_acc" in read_rows(d)[-1]
    assert all(torch.equal(a, b) for a, b in zip(_params(d), _params(s)))
    assert read_summary(d)["wire"]["measured_bytes_per_worker"] == [read_summary(s)["bytes"]] * 2


# ---------------------------------------------------------------- checkpoints that resume

RESUME = ["method=alg2", "compressor=topk", "compressor.density=0.1", f"method.q={Q}", "method.B=2",
          "steps=60", "log_every=5", "checkpoint_every=20", f"n_workers={WORLD}", "seed=3",
          "progress_s=0", "dense_collective=all_gather"]


def _resume_rank(rank: int, world: int, port: int, results: str, out: str, stop_at: int) -> None:
    """One rank of a torchdist run that is killed right after step ``stop_at`` (every rank at
    once, as a preemption does) when ``stop_at`` > 0, else runs to the end."""
    from experiments.run import lifecycle
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    lifecycle.train = stopping_train(lifecycle.train, stop_at)
    w = open_world("torchdist", "cpu", "all_gather")
    try:
        execute(compose_config("logreg", *RESUME, f"results_dir={results}", "comm=torchdist"),
                Path(out), task, w)
    except KeyboardInterrupt:
        pass
    finally:
        dist.destroy_process_group()


def test_a_killed_torchdist_run_resumes_bit_identically(tmp_path, results):
    run_dir = tmp_path / "run"
    for stop_at in (47, 0):     # killed after step 47 (checkpoint at 40), then run again
        mp.start_processes(_resume_rank, args=(WORLD, free_port(), str(results), str(run_dir),
                                               stop_at), nprocs=WORLD, join=True,
                           start_method=START)
        if stop_at:
            assert read_summary(run_dir) is None            # preempted: no summary ...
            for r in range(WORLD):                           # ... a checkpoint per rank
                name = CHECKPOINT if r == 0 else f"checkpoint.rank{r}.pt"
                assert torch.load(run_dir / name, weights_only=False)["method"]["k"] == 40
    s = read_summary(run_dir)
    assert s["status"] == "ok" and s["resumed"] is True
    ref = tmp_path / "sim"
    execute(compose_config("logreg", *RESUME, f"results_dir={results}"), ref, task)
    assert metrics_bytes(run_dir) == metrics_bytes(ref)
    assert untimed(s["final"]) == untimed(read_summary(ref)["final"])
    assert not list(run_dir.glob("checkpoint*.pt"))          # a finished run keeps none
