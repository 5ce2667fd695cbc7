"""a5a logistic regression on real processes (torch.distributed), one worker per process.

    torchrun --standalone --nproc-per-node 4 -m scripts.dist_logreg --method alg1 \
        --compressor randk --density 0.01 --q 0.1 --B 4 --beta 0.99 --lr 0.01 --steps 200 \
        --seed 0 --out dist.pt

builds the task exactly as the simulation (experiments/logreg.py) does: the same shards
(``split(len(b), n, split_seed, b, heterogeneity)``), the same oracles (minibatch 64, l2 1e-4),
x^0 = 0, the same worker seeds (``Worker(rank, oracle, seed)``), and runs the method with
:class:`gluon.distributed.TorchDistComm`. Rank 0 writes the final parameters, the global ledger
and the measured wire bytes to ``--out`` (torch.save; JSON if the name ends in .json).

``--simulate`` runs the same thing in one process with InProcessComm (the reference), and
``--compare FILE`` checks this run's parameters and ledger against another run's output:

    python -m scripts.dist_logreg --simulate <same flags> --compare dist.pt

(exit status 1 when the parameters differ by more than ``--atol`` or the ledgers differ).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from functools import lru_cache

import torch
import torch.distributed as dist

from experiments.datasets import libsvm_file
from experiments.logreg_task import LogRegOracle, load_libsvm, objective, split
from gluon import InProcessComm, Worker, make_compressor, make_method
from gluon.methods import _check_kind, method_spec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts.dist_logreg", description=__doc__.split("\n")[0])
    p.add_argument("--method", required=True)
    p.add_argument("--compressor", default=None,
                   help="default: the method's fixed compressor, else identity")
    p.add_argument("--density", type=float, default=0.01, help="randk / topk density")
    p.add_argument("--levels", type=int, default=1, help="qsgd levels")
    p.add_argument("--q", type=float, default=None)
    p.add_argument("--B", type=int, default=None)
    p.add_argument("--beta", type=float, default=0.99)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="run seed: sampling, compressor, coin")
    p.add_argument("--split-seed", type=int, default=0, help="shards (configs/task/a5a.yaml)")
    p.add_argument("--heterogeneity", default="iid", choices=["iid", "label_skew"])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--l2", type=float, default=1e-4)
    p.add_argument("--dataset", default="a5a")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--n-workers", type=int, default=4, help="--simulate only (else world size)")
    p.add_argument("--simulate", action="store_true", help="one process, InProcessComm")
    p.add_argument("--backend", default=None, help="gloo | nccl (default: by --device)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (cuda: one GPU per rank)")
    p.add_argument("--dense", default="all_reduce", choices=["all_reduce", "all_gather"])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--out", default=None)
    p.add_argument("--compare", default=None, help="an earlier --out file to compare against")
    p.add_argument("--atol", type=float, default=1e-6)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return parser().parse_args(argv)


# ---------------------------------------------------------------- the task, as the simulation

@lru_cache(maxsize=4)
def load_task(dataset: str, data_dir, n_workers: int, split_seed: int, heterogeneity: str):
    A, b = load_libsvm(libsvm_file(dataset, data_dir))
    shards = split(len(b), n_workers, split_seed, b, heterogeneity)
    return A, b, shards


def compressor_for(args):
    _, fixed, _ = method_spec(args.method)
    name = args.compressor or fixed.get("compressor", "identity")
    opts = {"randk": {"density": args.density}, "topk": {"density": args.density},
            "qsgd": {"levels": args.levels}}.get(name, {})
    return make_compressor(name, **opts)


def hparams_for(args) -> dict:
    hp = {"q": args.q, "B": args.B, "beta": args.beta, "lr": args.lr}
    return {k: v for k, v in hp.items() if v is not None}


def build(args, comm):
    """Method over the workers ``comm`` hosts, and f (the global objective, float64)."""
    A, b, shards = load_task(args.dataset, args.data_dir, comm.n_workers, args.split_seed,
                             args.heterogeneity)
    device = torch.device(args.device)
    used = torch.cat(shards)
    f, _ = objective(A[used], b[used], args.l2)
    workers = [Worker(r, LogRegOracle(A[shards[r]].to(device), b[shards[r]].to(device),
                                      args.batch_size, args.l2), args.seed)
               for r in comm.local_workers]
    x = torch.zeros(A.shape[1], device=device)
    method = make_method(args.method, [x], workers, comm, compressor=compressor_for(args),
                         seed=args.seed, **hparams_for(args))
    return method, f


def _timed_steps(method, steps: int, sync=None) -> tuple[float, list[float]]:
    """Run to ``steps``; (total wall seconds, seconds of each step)."""
    if sync:
        sync()
    times = []
    t0 = time.perf_counter()
    while method.k < steps:
        t = time.perf_counter()
        method.step()
        times.append(time.perf_counter() - t)
    if sync:
        sync()
    return time.perf_counter() - t0, times


def run_simulated(args) -> dict:
    torch.set_num_threads(args.threads)
    comm = InProcessComm(args.n_workers, seed=args.seed)
    method, f = build(args, comm)
    wall, times = _timed_steps(method, args.steps)
    led = comm.ledger
    return _result(args, "simulate", method, f, wall, times, led.state_dict(), led.cost,
                   led.bytes, measured=None, max_rank_diff=0.0)


def run_distributed(args, comm=None) -> dict:
    """One rank's part of a distributed run (a collective: every rank calls it)."""
    from gluon.distributed import TorchDistComm
    torch.set_num_threads(args.threads)
    comm = comm or TorchDistComm(args.seed, dense=args.dense)
    method, f = build(args, comm)
    wall, times = _timed_steps(method, args.steps, sync=dist.barrier)
    rep = comm.report()
    # every rank must hold the same parameters: compare them across ranks
    flat = torch.cat([p.detach().reshape(-1) for p in method.params])
    allp = [torch.empty_like(flat) for _ in range(comm.n_workers)]
    dist.all_gather(allp, flat)
    max_rank_diff = max(float((a - allp[0]).abs().max()) for a in allp)
    out = _result(args, "distributed", method, f, wall, times, rep["ledger"], rep["cost"],
                  rep["bytes"],
                  measured=rep["measured_bytes_per_worker"], max_rank_diff=max_rank_diff)
    out.update(collectives=comm.collectives, coin_bytes=comm.coin_bytes, backend=comm.backend)
    return out


def _result(args, mode, method, f, wall, times, ledger, cost, nbytes, measured,
            max_rank_diff) -> dict:
    params = [p.detach().cpu().clone() for p in method.params]
    return {"mode": mode, "config": vars(args).copy(), "n_workers": method.comm.n_workers,
            "steps": method.k, "params": params,
            "loss": f(params[0].double().numpy()),
            "ledger": ledger, "cost": cost, "bytes": nbytes,
            "measured_bytes_per_worker": measured,
            "measured_bytes": None if measured is None else sum(measured) / len(measured),
            "wall_s": wall, "step_s": wall / max(1, len(times)), "step_times": times,
            "max_rank_diff": max_rank_diff}


# ---------------------------------------------------------------- output and comparison

def save(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".json"):
        r = dict(result, params=[p.tolist() for p in result["params"]])
        with open(path, "w") as fh:
            json.dump(r, fh, indent=1)
    else:
        torch.save(result, path)


def load(path: str) -> dict:
    if path.endswith(".json"):
        with open(path) as fh:
            r = json.load(fh)
        r["params"] = [torch.tensor(p, dtype=torch.float32) for p in r["params"]]
        return r
    return torch.load(path, weights_only=False)


def compare(a: dict, b: dict, atol: float) -> dict:
    diff = max(float((x - y).abs().max()) for x, y in zip(a["params"], b["params"]))
    same_ledger = (a["ledger"]["messages"] == b["ledger"]["messages"]
                   and a["ledger"]["bytes"] == b["ledger"]["bytes"]
                   and all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-12)
                           for x, y in zip(a["ledger"]["cost"], b["ledger"]["cost"])))
    measured_ok = all(r["measured_bytes_per_worker"] is None
                      or r["measured_bytes_per_worker"] == r["ledger"]["bytes"] for r in (a, b))
    return {"max_abs_param_diff": diff, "params_close": diff <= atol, "ledgers_equal": same_ledger,
            "measured_bytes_equal_ledger": measured_ok,
            "ok": diff <= atol and same_ledger and measured_ok}


def summary(r: dict) -> str:
    keys = ("mode", "n_workers", "steps", "loss", "cost", "bytes", "measured_bytes", "step_s",
            "max_rank_diff")
    return json.dumps({k: r.get(k) for k in keys})


# ---------------------------------------------------------------- entry points

def env_from_slurm(environ=os.environ) -> bool:
    """Under ``srun`` with one task per worker (no torchrun), take RANK, WORLD_SIZE and
    LOCAL_RANK from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID. MASTER_ADDR must be set
    (scripts/slurm_dist.sbatch sets it to the first node); MASTER_PORT defaults to 29500.
    Returns whether a distributed environment is present."""
    if "RANK" not in environ and "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        if "MASTER_ADDR" not in environ:
            raise RuntimeError("under srun without torchrun, set MASTER_ADDR to the first node "
                               "(see scripts/slurm_dist.sbatch)")
        environ["RANK"] = environ["SLURM_PROCID"]
        environ["WORLD_SIZE"] = environ["SLURM_NTASKS"]
        environ["LOCAL_RANK"] = environ.get("SLURM_LOCALID", "0")
        environ.setdefault("MASTER_PORT", "29500")
    return "RANK" in environ


def init_from_env(args) -> None:
    """Process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    backend = args.backend or ("nccl" if args.device.startswith("cuda") else "gloo")
    if args.device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"
    dist.init_process_group(backend)


def validate(args) -> None:
    """Fail on bad input before any process group or data: unknown method or compressor, bad
    density, settings the method does not take."""
    compressor = compressor_for(args)
    cls, fixed, allowed = method_spec(args.method)
    if fixed.get("compressor", compressor.name) != compressor.name:
        raise ValueError(f"method {args.method!r} always uses the {fixed['compressor']!r} "
                         f"compressor; got {compressor.name!r}")
    _check_kind(cls, compressor)
    extra = set(hparams_for(args)) - set(allowed)
    if extra:
        raise ValueError(f"method {args.method!r} does not take {sorted(extra)} "
                         f"(it takes {sorted(allowed)})")
    if args.steps < 0 or args.batch_size < 1 or args.n_workers < 1:
        raise ValueError("steps must be >= 0, batch size and n-workers >= 1")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        validate(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.simulate:
        result = run_simulated(args)
        rank = 0
    else:
        if not env_from_slurm():
            print("no torch.distributed environment: launch with torchrun or srun "
                  "(or use --simulate)", file=sys.stderr)
            return 2
        init_from_env(args)
        try:
            result = run_distributed(args)
            rank = dist.get_rank()
        finally:
            dist.destroy_process_group()
    if rank != 0:
        return 0
    print(summary(result))
    if args.out:
        save(result, args.out)
        print(f"wrote {args.out}")
    if args.compare:
        verdict = compare(result, load(args.compare), args.atol)
        print(json.dumps(verdict))
        return 0 if verdict["ok"] else 1
    return 0


def spawn_entry(rank: int, world: int, port: int, jobs: list[list[str]], out: str,
                backend: str = "gloo", timeout_s: float = 300.0) -> None:
    """For torch.multiprocessing.spawn (tests, benchmarks): one process group, then every job
    (a list of command-line arguments) in sequence; rank 0 saves the list of results.
    Safe under the fork start method: one intra-op thread is set before any torch work."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        results = [run_distributed(parse_args(job)) for job in jobs]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
