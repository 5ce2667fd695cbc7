"""A dense AdamW reference for the LM task (docs/lm.md): does the model train well?

    python -m scripts.analysis.lm_reference [--preset budget|nanogpt] [--seed 0] [--lr 1e-3]

Not a baseline of the paper: one process, plain AdamW with nanoGPT's shakespeare_char recipe
(betas 0.9/0.99, weight decay 0.1 on the matrices and embeddings, gradient clipping at 1, linear
warm-up then cosine decay to a tenth of the peak lr), on the GPT of the study's CPU profile, from
the same initialisation (the run seed), evaluated on the study's fixed windows
(:mod:`experiments.tasks.lm`: ``loss``, ``val_loss``, and ``val_loss_full`` on the whole
validation text at the end). Windows are drawn from the whole training text.

* ``budget``: the tokens of the study's uplink budget for Gluon: ``max_comm`` dense steps of
  n_workers x batch_size windows (configs/experiment/lm/_budget.yaml), as ``max_comm`` steps of
  one batch of that size; warm-up a twentieth of the steps.
* ``nanogpt``: nanoGPT's CPU example (its shape, 4 x 4 x 128 at context 64, twice the study's
  width; batch 12, 2,000 iterations, warm-up 100; it reports a validation loss of about 1.88).

Each lr given (``budget``: 1e-3, nanoGPT's, and 3e-3 and 1e-2, since its batch and step count are
not nanoGPT's) is a run from the same initialisation and windows. Writes
``results/lm/adamw_<preset>.json``: the settings, seed, git commit, machine, every run's rows,
final values, wall and CPU time, and the best lr's final values.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from experiments.run.config import compose
from experiments.shared.files import REPO, atomic_write_text
from experiments.tasks import ResolvedConfig, lm
from experiments.tasks.shakespeare import window_starts, windows
from gluon import make_compressor


# nanoGPT's shakespeare_char CPU example's model (the study's CPU profile halves the width)
NANOGPT_CPU = ["task.n_layer=4", "task.n_head=4", "task.n_embd=128", "task.block_size=64",
               "task.dropout=0.0"]


def git_commit() -> dict:
    def run(*cmd):
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain",
                                                                  "--untracked-files=no"))}


def lr_at(step: int, steps: int, warmup: int, lr: float) -> float:
    """nanoGPT's schedule: linear warm-up, then cosine from lr down to lr / 10 at the end."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    frac = (step - warmup) / max(1, steps - warmup)
    return lr / 10 + 0.5 * (1 + math.cos(math.pi * frac)) * (lr - lr / 10)


def train(cfg, lr: float, batch: int, steps: int, warmup: int, seed: int, n_rows: int) -> dict:
    """One AdamW run from the study's initialisation (the run seed): its rows and final values."""
    built = lm.build(cfg, make_compressor("identity"))   # the model, its data and evaluation
    oracle, ev = built.method.workers[0].oracle, built.evaluate   # worker 0: the whole text (iid)
    model, T = oracle.model, cfg.task.block_size
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(seed)
    rows, every = [], max(1, steps // n_rows)
    w0, c0 = time.perf_counter(), time.process_time()

    def log(k: int) -> None:
        rows.append({"step": k, "tokens": k * batch * T, "loss": ev.loss(*ev.train),
                     "val_loss": ev.loss(*ev.val)})

    log(0)
    for k in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(k, steps, warmup, lr)
        x, y = windows(oracle.inputs, window_starts(oracle.lo, oracle.hi, T, batch, gen), T)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (k + 1) % every == 0 or k + 1 == steps:
            log(k + 1)
    return {"lr": lr, "final": {**rows[-1], "val_loss_full": ev.loss(*ev.full)},
            "wall_time_s": round(time.perf_counter() - w0, 1),
            "cpu_time_s": round(time.process_time() - c0, 1), "rows": rows,
            "n_params": built.summary["n_params"], "model": built.summary["model"],
            "eval": built.summary["eval"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=["budget", "nanogpt"], default="budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, nargs="+", default=None,
                   help="peak lrs, each a run (default: budget 1e-3 3e-3 1e-2; nanogpt 1e-3)")
    p.add_argument("--rows", type=int, default=40, help="logged rows over a run")
    p.add_argument("--out", default=None, help="default: results/lm/adamw_<preset>.json")
    args = p.parse_args(argv)

    shape = NANOGPT_CPU if args.preset == "nanogpt" else []
    cfg = ResolvedConfig.of(compose("lm", "experiment=lm/panel_iid", f"seed={args.seed}",
                                    "method=gluon", *shape)).cfg
    torch.set_num_threads(1)
    if args.preset == "budget":
        batch, steps = cfg.n_workers * cfg.batch_size, int(cfg.max_comm)
        warmup, lrs = max(1, steps // 20), args.lr or [1e-3, 3e-3, 1e-2]
    else:
        batch, steps, warmup, lrs = 12, 2000, 100, args.lr or [1e-3]
    runs = [train(cfg, lr, batch, steps, warmup, args.seed, args.rows) for lr in lrs]
    best = min(runs, key=lambda r: r["final"]["val_loss"])
    T = cfg.task.block_size
    out = Path(args.out or REPO / "results" / "lm" / f"adamw_{args.preset}.json")
    record = {"preset": args.preset, "seed": args.seed, "git": git_commit(),
              "settings": {"optimizer": "AdamW", "lr": lrs, "betas": [0.9, 0.99],
                           "weight_decay": 0.1, "grad_clip": 1.0, "warmup": warmup,
                           "schedule": "cosine to lr/10", "batch_windows": batch, "steps": steps,
                           "tokens": steps * batch * T, "model": best["model"],
                           "n_params": best["n_params"], "eval": best["eval"]},
              "machine": f"{platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), "
                         f"{os.cpu_count()} cores, torch {torch.__version__}, 1 thread",
              "best_lr": best["lr"], "final": best["final"],
              "runs": [{k: v for k, v in r.items() if k not in ("model", "n_params", "eval")}
                       for r in runs]}
    atomic_write_text(out, json.dumps(record, indent=1) + "\n")
    for r in runs:
        print(f"{args.preset}, lr {r['lr']:g}: {steps} steps of {batch} windows "
              f"({steps * batch * T:,} characters), val_loss {r['final']['val_loss']:.4f}, whole "
              f"validation text {r['final']['val_loss_full']:.4f}, {r['wall_time_s']} s")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
