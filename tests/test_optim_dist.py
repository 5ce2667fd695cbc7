"""gluon.optim under torch.distributed: 2 gloo processes, each one worker, the same user code.

One start of 2 processes runs every optimiser of ``tests.test_optim.CASES`` three ways on its
own shard, driven by a plain loop:

* against the library's engine on the torchdist backend in the same processes
  (``simulate_module(..., comm=TorchDistComm)``, same shard and data order): parameters
  compared with ``torch.equal`` after every step, and the ledgers and measured wire bytes;
* with dense rounds gathered (``dense_collective="all_gather"``): the parameters after every
  step go to the parent, which compares them bit for bit with the in-process simulation of
  the 2 workers;
* checkpointed after 5 steps, rebuilt from another initialisation, reloaded, finished: equal
  to the uninterrupted run at every step.

Each process also starts from its own random initialisation (the optimiser broadcasts rank 0's,
as DDP does), and a seed that differs between ranks is refused on both.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.run.world import free_port
from gluon.distributed import TorchDistComm
from tests.test_optim import (BATCH, BETA, CASES, LR, SEED, STEPS, ShardBatches, closure_of,
                              engine, equal, make_data, make_model, params_of)

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

WORLD, STOP = 2, 5
START = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def shard(rank: int):
    X, y = make_data()
    idx = torch.arange(len(X)).chunk(WORLD)[rank]
    return X[idx], y[idx]


def _against_engine(name: str, rank: int) -> dict:
    cls, settings = CASES[name]
    X, y = shard(rank)
    ma, mb = make_model(0), make_model(0 if rank == 0 else 100 + rank)   # rank's own init
    eng = engine(name, ma, X, y, rank=rank, comm=TorchDistComm(SEED), **settings)
    opt = cls(mb.named_parameters(), lr=LR, beta=BETA, seed=SEED, **settings)
    start_equal = equal(params_of(ma), params_of(mb))       # rank 0's X^0 everywhere
    batches, loss_on = ShardBatches(X, y, BATCH, SEED, rank), closure_of(mb)
    same, syncs = [], []
    for _ in range(STEPS):
        eng.step()
        opt.step(loss_on, batches)
        same.append(equal(params_of(ma), params_of(mb)))
        syncs.append(opt.last.sync)
    return {"start_equal": start_equal, "same": same, "syncs": syncs,
            "comm": type(opt.comm).__name__, "report": opt.comm.report(),
            "engine_report": eng.comm.report()}


def _gathered(name: str, rank: int, *, stop: int | None = None) -> list:
    cls, settings = CASES[name]
    X, y = shard(rank)

    def build(init):
        model = make_model(init)
        opt = cls(model.named_parameters(), lr=LR, beta=BETA, seed=SEED,
                  dense_collective="all_gather", **settings)
        return model, opt, ShardBatches(X, y, BATCH, SEED, rank)

    model, opt, data = build(0)
    traj = []
    for k in range(STEPS):
        if k == stop:
            ck = {"model": model.state_dict(), "opt": opt.state_dict(), "data": data.gen.get_state()}
            model, opt, data = build(7)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            data.gen.set_state(ck["data"])
        opt.step(closure_of(model), data)
        traj.append(params_of(model))
    return traj


def _rank_entry(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        res = {}
        for name in CASES:
            res[name] = _against_engine(name, rank)
            res[name]["traj"] = _gathered(name, rank)
            res[name]["resumed"] = _gathered(name, rank, stop=STOP)
        cls, settings = CASES["alg1"]
        try:
            cls(make_model().named_parameters(), lr=LR, seed=rank, **settings)
            res["seed_mismatch"] = None
        except ValueError as e:
            res["seed_mismatch"] = str(e)
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("optim_dist")
    for attempt in range(2):   # a port taken between free_port() and bind: try once more
        try:
            mp.start_processes(_rank_entry, args=(WORLD, free_port(), str(out)), nprocs=WORLD,
                               join=True, start_method=START)
            break
        except Exception:
            if attempt:
                raise
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _simulation(name: str):
    """The engine's in-process simulation of the 2 workers: parameters after every step."""
    cls, settings = CASES[name]
    from tests.test_optim import MinibatchOracle
    import torch.nn.functional as F
    model = make_model(0)
    oracles = {r: MinibatchOracle(model, F.cross_entropy, *shard(r), batch_size=BATCH)
               for r in range(WORLD)}
    eng = engine(name, model, None, None, oracles=oracles, **settings)
    traj = []
    for _ in range(STEPS):
        eng.step()
        traj.append(params_of(model))
    return traj, eng.comm.ledger


@pytest.mark.parametrize("name", list(CASES))
def test_each_process_is_one_worker_equal_to_the_torchdist_engine(name, ranks):
    for rank, res in enumerate(ranks):
        r = res[name]
        assert r["comm"] == "TorchDistComm"
        assert r["start_equal"], f"rank {rank}: X^0 not broadcast from rank 0"
        assert all(r["same"]), f"rank {rank}: first differing step {r['same'].index(False)}"
        assert r["report"] == r["engine_report"]                       # ledger and wire bytes
        assert r["report"]["measured_bytes"] == r["report"]["bytes"] > 0
    if "q" in CASES[name][1]:
        assert ranks[0][name]["syncs"] == ranks[1][name]["syncs"]     # the shared coin
        assert any(ranks[0][name]["syncs"][1:]) and not all(ranks[0][name]["syncs"])


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_equal_the_simulation_of_two_workers(name, ranks):
    sim, ledger = _simulation(name)
    for rank, res in enumerate(ranks):
        for k, (a, b) in enumerate(zip(res[name]["traj"], sim)):
            assert equal(a, b), f"rank {rank}, step {k}"
        assert len(res[name]["traj"]) == STEPS
    assert ranks[0][name]["report"]["ledger"] == ledger.state_dict()


@pytest.mark.parametrize("name", list(CASES))
def test_resume_on_each_rank_is_bit_identical(name, ranks):
    for rank, res in enumerate(ranks):
        for k, (a, b) in enumerate(zip(res[name]["traj"], res[name]["resumed"])):
            assert equal(a, b), f"rank {rank}, step {k}"


def test_ranks_that_disagree_are_refused_on_every_rank(ranks):
    for res in ranks:
        assert res["seed_mismatch"] and "ranks disagree" in res["seed_mismatch"]
