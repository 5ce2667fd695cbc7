"""Per-step wall time and uplink bytes: in-process simulation vs n gloo processes (a5a).

    PYTHONPATH=. python -m scripts.bench_dist [--steps 300] [--world 4]

Runs alg1 with RandK 1% (q = 0.1, B = 4) and gluon (dense, q = 1) for ``--steps`` steps both
ways and prints a markdown table: mean wall time per step (the timed loop only, not process
start or data loading; median and mean over steps), uplink bytes per step per worker from the ledger (the library's
accounting) and measured (nbytes of what the rank put into the collectives), collectives per
step, and the largest parameter difference between the two runs.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.multiprocessing as mp

from scripts import dist_logreg as dl

CONFIGS = {
    "alg1 randk 1%": ["--method", "alg1", "--compressor", "randk", "--density", "0.01",
                      "--q", "0.1", "--B", "4"],
    "gluon (dense)": ["--method", "gluon"],
}


def _ms(r: dict, how: str) -> str:
    t = torch.tensor(r["step_times"], dtype=torch.float64)
    return f"{1e3 * float(t.median() if how == 'median' else t.mean()):.3f}"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common = ["--steps", str(args.steps), "--seed", str(args.seed), "--beta", "0.99",
              "--lr", "0.01", "--n-workers", str(args.world)]
    jobs = {name: flags + common for name, flags in CONFIGS.items()}

    sim = {name: dl.run_simulated(dl.parse_args(job)) for name, job in jobs.items()}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.pt")
        mp.spawn(dl.spawn_entry, args=(args.world, dl.free_port(), list(jobs.values()), out),
                 nprocs=args.world, join=True)
        dist_res = dict(zip(jobs, torch.load(out, weights_only=False)))

    rows = ["| run | backend | ms / step, median | ms / step, mean "
            "| uplink bytes / step / worker (ledger) | measured bytes / step / worker "
            "| message collectives / step / worker | max abs param diff vs sim |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name in jobs:
        s, d = sim[name], dist_res[name]
        diff = max(float((a - b).abs().max()) for a, b in zip(s["params"], d["params"]))
        rows.append(f"| {name} | simulation, {args.world} workers in 1 process "
                    f"| {_ms(s, 'median')} | {_ms(s, 'mean')} | {s['bytes'] / args.steps:.1f} "
                    f"| - | - | - |")
        rows.append(f"| {name} | {args.world} gloo processes "
                    f"| {_ms(d, 'median')} | {_ms(d, 'mean')} | {d['bytes'] / args.steps:.1f} "
                    f"| {d['measured_bytes'] / args.steps:.1f} "
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
