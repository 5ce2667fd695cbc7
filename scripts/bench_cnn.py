"""Where a step of the CNN experiment goes on CPU: Alg. 1 against the gradients it must compute.

    PYTHONPATH=. python -m scripts.bench_cnn [--steps 20] [--methods alg1 gluon alg2] [--threads 1]

Builds the CIFAR-10 task as ``experiments.cnn`` does (airbench94, n = 4 workers, batch 16, LMOs
assigned by the Scion rule) on random uint8 images (the timing does not depend on the pixels;
``--real`` uses the dataset), runs each method for ``--steps`` steps after ``--warmup`` steps,
and times, inside every step: the gradient evaluations (forward + backward, what any
implementation must do), minibatch sampling and augmentation, compression + encoding, the
averaging, the LMO update, and the rest (momentum, bookkeeping). The overhead is everything but
the gradients and the sampling, as a fraction of the gradient time (target: under 15%). Times
are wall-clock and process CPU time; on a shared machine the CPU time is the steadier one.
Prints a markdown table.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from omegaconf import OmegaConf

from experiments.cifar import Cifar
from experiments.cnn_task import build
from experiments.common import validate


class Clock:
    """Accumulates wall and CPU time per label; nested labels are subtracted from the outer."""

    def __init__(self):
        self.wall = defaultdict(float)
        self.cpu = defaultdict(float)
        self.stack: list[list] = []

    def wrap(self, label, fn):
        def timed(*a, **k):
            w0, c0 = time.perf_counter(), time.process_time()
            self.stack.append([0.0, 0.0])
            try:
                return fn(*a, **k)
            finally:
                inner_w, inner_c = self.stack.pop()
                dw, dc = time.perf_counter() - w0, time.process_time() - c0
                self.wall[label] += dw - inner_w
                self.cpu[label] += dc - inner_c
                if self.stack:
                    self.stack[-1][0] += dw
                    self.stack[-1][1] += dc
        return timed

    def reset(self):
        self.wall.clear()
        self.cpu.clear()


def config(method: str, steps: int, threads: int, q: float, B: int):
    base = OmegaConf.load("configs/cnn.yaml")
    task = OmegaConf.load("configs/task/cifar10.yaml")
    comp = {"alg1": {"name": "randk", "density": 0.01}, "alg2": {"name": "topk", "density": 0.01},
            "gluon": {"name": "identity"}}[method]
    m = {"name": method, "lr": 0.05, "beta": 0.9}
    if method != "gluon":
        m.update(q=q, B=B, scale_by_B=True)
    return OmegaConf.create({
        "seed": 0, "steps": steps, "n_workers": 4, "batch_size": base.batch_size,
        "log_every": steps, "eval_every": steps, "device": "cpu", "data_dir": None,
        "results_dir": "results", "threads": threads,
        "task": {**OmegaConf.to_container(task), "eval_train": 64, "eval_test": 64,
                 "source": "auto"},
        "method": m, "compressor": comp})


def random_data(n_train=4096, n_test=256, seed=0) -> Cifar:
    g = torch.Generator().manual_seed(seed)
    return Cifar(torch.randint(0, 256, (n_train, 3, 32, 32), dtype=torch.uint8, generator=g),
                 torch.randint(0, 10, (n_train,), generator=g),
                 torch.randint(0, 256, (n_test, 3, 32, 32), dtype=torch.uint8, generator=g),
                 torch.randint(0, 10, (n_test,), generator=g), [str(i) for i in range(10)],
                 "random", "random uint8 images")


def bench(method_name: str, args) -> dict:
    cfg = config(method_name, args.steps, args.threads, args.q, args.B)
    torch.set_num_threads(args.threads)
    compressor = validate(cfg)
    method, _, _ = build(cfg, compressor, data=None if args.real else random_data())
    clock = Clock()
    for o in {id(w.oracle): w.oracle for w in method.workers}.values():
        o.grad = clock.wrap("gradients (fwd+bwd)", o.grad)
        o.sample = clock.wrap("sampling + augmentation", o.sample)
    method.send = clock.wrap("compression + encoding", method.send)
    method.comm.average = clock.wrap("averaging", method.comm.average)
    method.update = clock.wrap("LMO update", method.update)
    step = clock.wrap("step", method.step)
    for _ in range(args.warmup):
        step()
    clock.reset()
    k0, syncs = method.k, 0
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        syncs += bool(method.u)
        step()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    n = method.k - k0
    return {"method": method_name, "steps": n, "syncs": syncs, "wall": wall / n, "cpu": cpu / n,
            "parts_wall": {k: v / n for k, v in clock.wall.items()},
            "parts_cpu": {k: v / n for k, v in clock.cpu.items()}}


ORDER = ["gradients (fwd+bwd)", "sampling + augmentation", "compression + encoding", "averaging",
         "LMO update", "step"]


def table(r: dict) -> str:
    g_w = r["parts_wall"]["gradients (fwd+bwd)"]
    g_c = r["parts_cpu"]["gradients (fwd+bwd)"]
    lines = ["| part | wall ms/step | CPU ms/step | CPU % of gradients |", "|---|---:|---:|---:|"]
    for k in ORDER:
        label = "rest (momentum, bookkeeping)" if k == "step" else k
        w, c = r["parts_wall"].get(k, 0.0), r["parts_cpu"].get(k, 0.0)
        lines.append(f"| {label} | {1e3 * w:.1f} | {1e3 * c:.1f} | {100 * c / g_c:.1f}% |")
    lines.append(f"| **whole step** | **{1e3 * r['wall']:.1f}** | **{1e3 * r['cpu']:.1f}** | |")
    over_w = r["wall"] - g_w - r["parts_wall"].get("sampling + augmentation", 0.0)
    over_c = r["cpu"] - g_c - r["parts_cpu"].get("sampling + augmentation", 0.0)
    lines.append(f"| **overhead** (step - gradients - sampling) | {1e3 * over_w:.1f} | "
                 f"{1e3 * over_c:.1f} | **{100 * over_c / g_c:.1f}%** (wall {100 * over_w / g_w:.1f}%) |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["alg1"], choices=["alg1", "alg2", "gluon"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--q", type=float, default=0.1)
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--real", action="store_true", help="use CIFAR-10 instead of random images")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU, airbench94, n = 4, batch 16, "
          f"q = {args.q}, B = {args.B}, density 1%\n")
    for name in args.methods:
        r = bench(name, args)
        print(f"### {name}: {r['steps']} steps ({r['syncs']} with u = 1)\n")
        print(table(r) + "\n", flush=True)


if __name__ == "__main__":
    main()
