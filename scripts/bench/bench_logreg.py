"""Throughput of every method on a5a (n = 4 simulated workers), and where the time goes.

    python -m scripts.bench.bench_logreg [--steps 10000] [--repeats 3] [--out results/bench/logreg.md]

Each method runs ``--steps`` iterations at Fig. 2-like settings (RandK/TopK 1%, q = 0.1,
B = 4) with one torch thread, without evaluation or logging; the best of ``--repeats`` timings
is reported. A second, instrumented pass splits the time into: gradient oracle calls,
compression (encode), aggregation (comm.average), the update (LMO step), and the rest
(momentum, bookkeeping, coin).
"""
from __future__ import annotations

import argparse
import platform
import time
from collections import defaultdict

import torch

import gluon
import gluon.methods as gm
from experiments.tasks import libsvm_file, split
from experiments.shared.files import publish
from experiments.tasks.logreg import LogRegOracle, load_libsvm

# row label -> (method name, compressor, hyperparameters). "alg2 with C = 0" is Local Gluon as
# it was before it skipped the Delta that C = 0 discards: the same iterates, two more gradients
# per worker on every step without a sync.
SETTINGS = {
    "gluon": ("identity", {}), "large_batch_gluon": ("identity", dict(B=4)),
    "alg1": ("randk", dict(q=0.1, B=4)), "alg2": ("topk", dict(q=0.1, B=4)),
    "alg3": ("randk", dict(q=0.1, B=4)), "alg4": ("topk", dict(q=0.1, B=4)),
    "vr_marina": ("randk", dict(q=0.1)), "ef21_muon": ("topk", {}),
    "local_gluon": ("zero", dict(q=0.1, B=4)), "alg2 with C = 0": ("zero", dict(q=0.1, B=4)),
    "local_gluon_ecmvr": ("zero", dict(q=0.1, B=4)),
    "vr_gluon": ("identity", dict(q=0.25)),
}


def make(label, oracles, seed=0):
    comp, hp = SETTINGS[label]
    name = label.split()[0]
    c = gluon.make_compressor(comp, **({"density": 0.01} if comp in ("randk", "topk") else {}))
    lr = 0.1 if name == "vr_marina" else 0.01
    return gluon.simulate(name, [torch.zeros(oracles[0].A.shape[1])], oracles, compressor=c,
                          seed=seed, lr=lr, beta=0.99, **hp)


def timed(fn, bucket, acc):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[bucket] += time.perf_counter() - t
    return wrapper


def breakdown(name, oracles, steps):
    acc = defaultdict(float)
    m = make(name, oracles)
    for o in oracles:
        o.grad = timed(o.grad, "gradients", acc)
        o.grad_diff = timed(o.grad_diff, "gradients", acc)
    m.comm.average = timed(m.comm.average, "aggregation", acc)
    m.update = timed(m.update, "update (LMO)", acc)
    orig = gm.encode
    gm.encode = timed(orig, "compression", acc)
    try:
        t = time.perf_counter()
        for _ in range(steps):
            m.step()
        total = time.perf_counter() - t
    finally:
        gm.encode = orig
        for o in oracles:
            del o.grad, o.grad_diff
    acc["other"] = total - sum(acc.values())
    return {k: v / total for k, v in acc.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=",".join(SETTINGS))
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    A, b = load_libsvm(libsvm_file("a5a"))
    oracles = [LogRegOracle(A[s], b[s], 64, 1e-4) for s in split(len(b), 4, 0)]
    cols = ["gradients", "compression", "aggregation", "update (LMO)", "other"]
    lines = [f"a5a, n = 4 workers, {args.steps} steps, 1 thread, best of {args.repeats}; "
             f"{platform.processor() or platform.machine()}, torch {torch.__version__}", "",
             "| method | steps/s | time for the steps (s) | " + " | ".join(cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for name in args.methods.split(","):
        best = float("inf")
        for r in range(args.repeats):
            m = make(name, oracles, seed=r)
            t = time.perf_counter()
            for _ in range(args.steps):
                m.step()
            best = min(best, time.perf_counter() - t)
        share = breakdown(name, oracles, min(args.steps, 3000))
        lines.append(f"| {name} | {args.steps / best:,.0f} | {best:.2f} | "
                     + " | ".join(f"{100 * share.get(c, 0):.0f}%" for c in cols) + " |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print()
    publish(text, args.out)


if __name__ == "__main__":
    main()
