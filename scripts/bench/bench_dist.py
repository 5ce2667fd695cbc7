"""Per-step wall time and uplink bytes: in-process simulation vs n gloo processes (a5a).

    PYTHONPATH=. python -m scripts.bench.bench_dist [--steps 300] [--world 4]

Builds the a5a task as ``python -m experiments.logreg`` does (``comm=sim`` and
``comm=torchdist``) for alg1 with RandK 1% (q = 0.1, B = 4) and gluon (dense, q = 1), runs
``--steps`` steps both ways and prints a markdown table: wall time per step (the timed loop
only, not process start or data loading; median and mean over steps), uplink bytes per step per
worker from the ledger (the library's accounting) and measured (nbytes of what the rank put into
the collectives), collectives per step, and the largest parameter difference between the two.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.run.config import build_compressor
from experiments.run.world import World, free_port, open_world
from experiments.tasks import logreg as task
from experiments.run.config import compose as compose_config

CONFIGS = {
    "alg1 randk 1%": ["method=alg1", "compressor=randk", "compressor.density=0.01",
                      "method.q=0.1", "method.B=4"],
    "gluon (dense)": ["method=gluon"],
}


def _steps(cfg, world: World) -> dict:
    method = task.build(cfg, build_compressor(cfg.compressor), world).method
    times = []
    world.barrier()
    while method.k < cfg.steps:
        t = time.perf_counter()
        method.step()
        times.append(time.perf_counter() - t)
    out = {"params": [p.detach().clone() for p in method.params], "times": times,
           "bytes": method.comm.ledger.bytes}
    if world.size > 1:
        rep = method.comm.report()
        out.update(measured=rep["measured_bytes"], collectives=method.comm.collectives)
    return out


def _rank(rank: int, world: int, port: int, jobs: dict, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    w = open_world("torchdist")
    try:
        res = {name: _steps(compose_config("logreg", *o), w) for name, o in jobs.items()}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(res, out)


def _ms(times: list[float], how: str) -> str:
    t = torch.tensor(times, dtype=torch.float64)
    return f"{1e3 * float(t.median() if how == 'median' else t.mean()):.3f}"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common = [f"steps={args.steps}", f"seed={args.seed}", f"n_workers={args.world}"]
    jobs = {name: o + common for name, o in CONFIGS.items()}
    torch.set_num_threads(1)
    sim = {name: _steps(compose_config("logreg", *o), World()) for name, o in jobs.items()}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.pt")
        mp.spawn(_rank, args=(args.world, free_port(), jobs, out), nprocs=args.world, join=True)
        dist_res = torch.load(out, weights_only=False)

    rows = ["| run | backend | ms / step, median | ms / step, mean "
            "| uplink bytes / step / worker (ledger) | measured bytes / step / worker "
            "| message collectives / step / worker | max abs param diff vs sim |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name in jobs:
        s, d = sim[name], dist_res[name]
        diff = max(float((a - b).abs().max()) for a, b in zip(s["params"], d["params"]))
        rows.append(f"| {name} | simulation, {args.world} workers in 1 process "
                    f"| {_ms(s['times'], 'median')} | {_ms(s['times'], 'mean')} "
                    f"| {s['bytes'] / args.steps:.1f} | - | - | - |")
        rows.append(f"| {name} | {args.world} gloo processes "
                    f"| {_ms(d['times'], 'median')} | {_ms(d['times'], 'mean')} "
                    f"| {d['bytes'] / args.steps:.1f} | {d['measured'] / args.steps:.1f} "
                    f"| {d['collectives'] / args.steps:.2f} | {diff:.1e} |")
    table = "\n".join(rows)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"a5a logistic regression (d = 124), {args.steps} steps, seed {args.seed}, "
          f"{os.cpu_count()} CPU cores (1-min load average {load:.1f} after the runs), "
          f"torch {torch.__version__}, 1 thread per process; each distributed step also "
          f"broadcasts the 1-byte coin\n")
    print(table)
    return table


if __name__ == "__main__":
    main()
