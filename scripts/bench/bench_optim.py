"""What gluon.optim costs on top of the gradients: DDP + SGD with momentum vs Gluon (q = 1).

    python -m scripts.bench.bench_optim [--world 2] [--steps 100] [--widths 16 64 64] [--batch 64]
                                  [--out results/bench/optim.md]

``--world`` gloo processes (one thread each) train the same model (the airbench CNN of the CPU
profile by default, random images; the timing does not depend on the pixels) with the same
batches, three ways, each in a plain user loop:

* **DDP + SGD momentum**: ``zero_grad``, forward, ``backward`` (DDP all-reduces the gradient
  buckets inside it), ``SGD(momentum=0.9).step()``;
* **Gluon, q = 1**: ``gluon.optim.Gluon.step(closure, batches)``: the closure's forward and
  ``autograd.grad``, the dense all-reduce, the momentum, the LMO step (Newton-Schulz on every
  matrix and conv kernel);
* **Alg. 1, RandK 1%** (q = 0.1, B = 4), for scale: two gradients per ordinary step.

Timed inside every step (process CPU time and wall time): the gradients (forward + backward;
for DDP its all-reduce overlaps them), the averaging of the gradients (Gluon's all-reduce), the
LMO step, and the rest (momentum, encoding, bookkeeping; SGD's update). The optimiser's own
overhead is everything outside the gradients and the averaging. The CPUs may be shared with
other jobs, so the CPU time is the steadier measure, and the header gives the load. Per-rank
numbers are averaged over ranks. Prints and writes (``--out``) a markdown table.
"""
from __future__ import annotations

import argparse
import itertools
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from experiments.shared.configs import cnn_widths
from experiments.shared.files import publish
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import gluon
from experiments.run.world import free_port
from experiments.tasks.airbench import Airbench94
from experiments.shared.timing import Clock

CPU_WIDTHS = cnn_widths("cpu")
PARTS = ["gradients (fwd+bwd)", "averaging", "LMO step", "rest"]
ROWS = {"ddp_sgd": "DDP + SGD momentum", "gluon": "gluon.optim.Gluon (q = 1)",
        "alg1": "gluon.optim.CompressedGluon (Alg. 1, RandK 1%, q = 0.1, B = 4)"}


def batches(rank: int, batch: int, seed: int = 0, pool: int = 8):
    """An endless cycle over ``pool`` batches of random normalised images and labels (made
    before the timing, so no step pays for data), different per rank."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return itertools.cycle([(torch.randn(batch, 3, 32, 32, generator=g),
                             torch.randint(0, 10, (batch,), generator=g)) for _ in range(pool)])


def model_of(widths, batch: int) -> Airbench94:
    torch.manual_seed(0)
    return Airbench94(widths=tuple(widths), ghost_batch=batch)


def run_ddp(args, rank: int) -> dict:
    model = model_of(args.widths, args.batch)
    ddp = DistributedDataParallel(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    clock, data = Clock(), batches(rank, args.batch)

    def fwd_bwd(x, y):
        sgd.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
    fwd_bwd = clock.wrap("gradients (fwd+bwd)", fwd_bwd)
    update = clock.wrap("rest", sgd.step)

    def step():
        fwd_bwd(*next(data))
        update()
    return timed(step, clock, args)


def run_gluon(args, rank: int, method: str) -> dict:
    model = model_of(args.widths, args.batch)
    named = model.named_parameters()
    if method == "gluon":
        opt = gluon.optim.Gluon(named, lr=0.05, beta=0.9)
    else:
        opt = gluon.optim.CompressedGluon(named, lr=0.05, beta=0.9, q=0.1, B=4,
                                          compressor=gluon.RandK(density=0.01))
    clock, data = Clock(), batches(rank, args.batch)
    oracle = opt._oracle
    oracle._grad_at = clock.wrap("gradients (fwd+bwd)", oracle._grad_at)
    opt.comm.average = clock.wrap("averaging", opt.comm.average)
    opt.algorithm.update = clock.wrap("LMO step", opt.algorithm.update)
    whole = clock.wrap("rest", opt.step)

    def loss_on(batch):
        x, y = batch
        return F.cross_entropy(model(x), y)
    return timed(lambda: whole(loss_on, data), clock, args)


def timed(step, clock: Clock, args) -> dict:
    for _ in range(args.warmup):
        step()
    dist.barrier()
    clock.reset()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    n = args.steps
    return {"wall": wall / n, "cpu": cpu / n,
            "parts_wall": {k: v / n for k, v in clock.wall.items()},
            "parts_cpu": {k: v / n for k, v in clock.cpu.items()}}


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        res = {}
        for name in args.methods:
            res[name] = run_ddp(args, rank) if name == "ddp_sgd" else run_gluon(args, rank, name)
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def mean_over_ranks(per_rank: list[dict]) -> dict:
    out = {}
    for name in per_rank[0]:
        rs = [r[name] for r in per_rank]
        avg = lambda get: sum(get(r) for r in rs) / len(rs)
        out[name] = {"wall": avg(lambda r: r["wall"]), "cpu": avg(lambda r: r["cpu"]),
                     "parts_wall": {k: avg(lambda r: r["parts_wall"].get(k, 0.0)) for k in PARTS},
                     "parts_cpu": {k: avg(lambda r: r["parts_cpu"].get(k, 0.0)) for k in PARTS}}
    return out


def table(res: dict) -> str:
    ms = lambda s: f"{1e3 * s:.1f}"
    lines = ["| step | ms/step (wall) | ms/step (CPU) | gradients (fwd+bwd) | averaging | LMO step "
             "| rest | **optimiser's own (CPU ms)** | share of the step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in res.items():
        c = r["parts_cpu"]
        own = c["LMO step"] + c["rest"]
        lines.append(f"| {ROWS[name]} | {ms(r['wall'])} | {ms(r['cpu'])} | "
                     + " | ".join(ms(c[k]) for k in PARTS)
                     + f" | **{ms(own)}** | {100 * own / r['cpu']:.1f}% |")
    return "\n".join(lines)


def machine_line(args) -> str:
    load = ", load %.1f/%.1f/%.1f" % os.getloadavg() if hasattr(os, "getloadavg") else ""
    w = "/".join(map(str, args.widths))
    profile = "CPU profile" if list(args.widths) == CPU_WIDTHS else "custom widths"
    n = sum(p.numel() for p in model_of(args.widths, args.batch).parameters() if p.requires_grad)
    return (f"airbench94 {profile} (widths {w}, {n:,} trainable parameters), batch {args.batch} "
            f"random images per process, {args.world} gloo process(es) x {args.threads} "
            f"thread(s), {args.steps} steps after {args.warmup} warm-up; "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores{load}, "
            f"torch {torch.__version__}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--widths", type=int, nargs=3, default=CPU_WIDTHS)
    p.add_argument("--methods", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--out", default="results/bench/optim.md", help="the markdown table ('': none)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(args.world, free_port(), args, tmp), nprocs=args.world,
                           join=True, start_method="fork" if "fork" in mp.get_all_start_methods()
                           else "spawn")
        res = mean_over_ranks([torch.load(Path(tmp) / f"rank{r}.pt") for r in range(args.world)])
    head = machine_line(args)
    own_g = res.get("gluon")
    notes = ["", "Times per step, mean over ranks. **Optimiser's own** = the LMO step + the rest "
             "(momentum, encoding, bookkeeping; for DDP + SGD: SGD's update), i.e. everything "
             "outside the gradients and their averaging. DDP's all-reduce runs inside its "
             "backward, so it is counted with its gradients."]
    if own_g and "ddp_sgd" in res:
        g, d = own_g["parts_cpu"], res["ddp_sgd"]["parts_cpu"]
        notes.append(f"\nGluon's own overhead: {1e3 * (g['LMO step'] + g['rest']):.1f} CPU ms per "
                     f"step, {100 * (g['LMO step'] + g['rest']) / g['gradients (fwd+bwd)']:.1f}% of "
                     f"its gradients, of which the LMO step {1e3 * g['LMO step']:.1f} ms; "
                     f"SGD's update: {1e3 * d['rest']:.1f} ms. Whole step: Gluon "
                     f"{1e3 * own_g['cpu']:.1f} vs DDP + SGD {1e3 * res['ddp_sgd']['cpu']:.1f} "
                     f"CPU ms ({own_g['cpu'] / res['ddp_sgd']['cpu']:.2f}x).")
    text = head + "\n" + "\n".join(notes) + "\n\n" + table(res) + "\n"
    publish(text, args.out)


if __name__ == "__main__":
    main()
