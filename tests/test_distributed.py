"""TorchDistComm on 4 real gloo processes equals the in-process simulation.

One start of 4 processes (``torch.multiprocessing``, fork where available) runs every method in sequence (one process
group, cheaper than a spawn per method); the parent runs the same jobs with InProcessComm and
compares parameters (atol 1e-6; bitwise with dense all_gather), the ledger (exactly), and the
bytes each rank put into the collectives against the ledger's bytes (exactly).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gluon import InProcessComm, encode, make_compressor
from scripts import dist_logreg as dl

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

WORLD, STEPS, SEED, Q = 4, 40, 1, 0.3
COMMON = ["--steps", str(STEPS), "--seed", str(SEED), "--beta", "0.9", "--lr", "0.05"]
SPARSE = ["--density", "0.1"]
CASES = {
    "alg1-randk": ["--method", "alg1", "--compressor", "randk", *SPARSE, "--q", str(Q), "--B", "2"],
    "alg2-topk": ["--method", "alg2", "--compressor", "topk", *SPARSE, "--q", str(Q), "--B", "2"],
    "alg3-randk": ["--method", "alg3", "--compressor", "randk", *SPARSE, "--q", str(Q), "--B", "2"],
    "alg4-topk": ["--method", "alg4", "--compressor", "topk", *SPARSE, "--q", str(Q), "--B", "2"],
    "gluon": ["--method", "gluon"],
    "vr_marina-randk": ["--method", "vr_marina", "--compressor", "randk", *SPARSE, "--q", str(Q)],
    "ef21_muon-topk": ["--method", "ef21_muon", "--compressor", "topk", *SPARSE],
    "local_gluon": ["--method", "local_gluon", "--q", str(Q), "--B", "2"],
    "alg1-natural": ["--method", "alg1", "--compressor", "natural", "--q", str(Q), "--B", "2"],
    "alg3-qsgd": ["--method", "alg3", "--compressor", "qsgd", "--levels", "4", "--q", str(Q)],
    # dense messages through all_gather + the simulation's stack().mean(0): bit-identical
    "alg1-randk-exact": ["--method", "alg1", "--compressor", "randk", *SPARSE, "--q", str(Q),
                         "--B", "2", "--dense", "all_gather"],
}
JOBS = {name: args + COMMON for name, args in CASES.items()}
START = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "results.pt"
    names = list(JOBS)
    for attempt in range(2):   # a port taken between free_port() and bind: try once more
        try:
            # fork: the children inherit the imported modules (torch, sklearn) instead of
            # importing them 4 times over; spawn_entry sets 1 thread first (DataLoader-style)
            mp.start_processes(dl.spawn_entry, args=(WORLD, dl.free_port(),
                                                     [JOBS[n] for n in names], str(out)),
                               nprocs=WORLD, join=True, start_method=START)
            break
        except Exception:
            if attempt:
                raise
    return dict(zip(names, torch.load(out, weights_only=False)))


@pytest.fixture(scope="module")
def sim_results():
    return {n: dl.run_simulated(dl.parse_args(job)) for n, job in JOBS.items()}


def test_both_coin_outcomes_occur():
    rng = random.Random(SEED)
    draws = [rng.random() < Q for _ in range(STEPS)]
    assert any(draws) and not all(draws)


@pytest.mark.parametrize("name", list(JOBS))
def test_parameters_equal_simulation(name, dist_results, sim_results):
    d, s = dist_results[name], sim_results[name]
    assert d["steps"] == s["steps"] == STEPS
    assert d["n_workers"] == s["n_workers"] == WORLD
    assert d["max_rank_diff"] == 0.0, "ranks disagree on the parameters"
    for a, b in zip(d["params"], s["params"]):
        assert torch.isfinite(a).all()
        if name.endswith("-exact"):
            assert torch.equal(a, b)
        else:
            assert torch.allclose(a, b, rtol=0.0, atol=1e-6), float((a - b).abs().max())
    assert not torch.equal(d["params"][0], torch.zeros_like(d["params"][0]))


@pytest.mark.parametrize("name", list(JOBS))
def test_ledger_and_measured_bytes(name, dist_results, sim_results):
    d, s = dist_results[name], sim_results[name]
    assert d["ledger"] == s["ledger"]                      # cost, bytes, messages: exactly
    assert d["measured_bytes_per_worker"] == d["ledger"]["bytes"]
    if name == "local_gluon":   # only the dense syncs send anything
        assert 0 < d["measured_bytes"] < STEPS * 124 * 4


def test_sparse_runs_send_less(dist_results):
    dense = dist_results["gluon"]["measured_bytes"]
    assert dense == STEPS * 124 * 4
    for name in ("alg1-randk", "alg2-topk", "local_gluon"):
        assert dist_results[name]["measured_bytes"] < dense


def test_torchrun_cli_matches_simulate(tmp_path):
    """The real entry point under torchrun (2 processes to keep it quick) vs --simulate."""
    flags = ["--method", "alg1", "--compressor", "randk", "--density", "0.05", "--q", "0.5",
             "--B", "2", "--beta", "0.9", "--lr", "0.05", "--steps", "10", "--seed", "2"]
    out = tmp_path / "dist.json"
    env = dict(os.environ, PYTHONPATH=str(Path(dl.__file__).resolve().parents[1]),
               MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{dl.free_port()}",
           "-m", "scripts.dist_logreg", *flags, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(dl.__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert dl.main(["--simulate", "--n-workers", "2", *flags, "--compare", str(out)]) == 0


# ---------------------------------------------------------------- one process, world size 1

@pytest.fixture
def world1():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dl.free_port()}",
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
