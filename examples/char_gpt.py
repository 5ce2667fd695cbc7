"""A character-level GPT on Tiny Shakespeare with Compressed Gluon (Alg. 1, RandK): your own loop.

    python examples/char_gpt.py                                   # one process (n = 1), tiny GPT
    torchrun --nproc-per-node 2 examples/char_gpt.py              # 2 workers, one per process
    python examples/char_gpt.py --layers 4 --heads 4 --width 128 --context 64 --steps 1000
                                                                  # nanoGPT's CPU shape

The same code runs both ways. Worker tau (this process's rank) owns the tau-th contiguous part of
the training text (the first 90% of the characters) and draws random windows from it with its
own generator; the optimiser averages the workers' compressed messages through
torch.distributed under torchrun. The model is the project's nanoGPT-shaped GPT
(experiments/tasks/gpt.py), with Scion's nanoGPT LMOs (experiments.tasks.lm.lmo_rules):
spectral on the hidden matrices, sign at 60x the radius on the tied embedding and head, RMS on
the rest. The text is found as the project finds it (``GLUON_DATA_DIR``, ./data, ../shared/data),
or downloaded and checked against its SHA-256.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the model and the text finder

import gluon                                                    # noqa: E402
from experiments.tasks.gpt import GPT, GPTShape                 # noqa: E402
from experiments.tasks.lm import lmo_rules                      # noqa: E402
from experiments.tasks.shakespeare import load_text             # noqa: E402
from gluon.optim import CompressedGluon                         # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--steps", type=int, default=150)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--heads", type=int, default=2)
p.add_argument("--width", type=int, default=64)
p.add_argument("--context", type=int, default=32)
p.add_argument("--batch", type=int, default=12, help="windows per minibatch per worker")
p.add_argument("--lr", type=float, default=0.005, help="the LMO radius (hidden matrices)")
p.add_argument("--q", type=float, default=0.2, help="probability of a synchronisation")
p.add_argument("--B", type=int, default=4, help="minibatches in a synchronisation's batch")
p.add_argument("--density", type=float, default=0.05, help="RandK's fraction of coordinates")
args = p.parse_args()

if "RANK" in os.environ:                                        # started by torchrun
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
torch.set_num_threads(1)

text = load_text()                                              # every rank reads the same text
tokens, n_train, T = text.tokens, text.n_train, args.context
lo, hi = rank * (n_train // world), (rank + 1) * (n_train // world)   # this worker's part


def windows(starts):
    idx = starts[:, None] + torch.arange(T + 1)
    return tokens[idx[:, :-1]], tokens[idx[:, 1:]]


def batches(gen):                                               # endless random minibatches
    while True:
        yield windows(lo + torch.randint(hi - lo - T, (args.batch,), generator=gen))


val = windows(n_train + torch.randint(len(tokens) - n_train - T, (64,),
                                      generator=torch.Generator().manual_seed(1234)))
torch.manual_seed(0)                                            # the same model on every rank
model = GPT(GPTShape(vocab=len(text.vocab), block_size=T, n_layer=args.layers,
                     n_head=args.heads, n_embd=args.width))
opt = CompressedGluon(model.named_parameters(), lr=args.lr, beta=0.9, q=args.q, B=args.B,
                      compressor=gluon.RandK(density=args.density), seed=0,
                      lmo_rules=lmo_rules(embed_scale=60.0))


def loss_on(batch):                                             # the closure: a forward, no backward
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def val_loss() -> float:
    model.eval()
    with torch.no_grad():
        out = loss_on(val).item()
    model.train()
    return out


data = batches(torch.Generator().manual_seed(rank))
if rank == 0:
    print(f"before: val loss {val_loss():.3f} ({world} worker{'s' * (world > 1)})")
for k in range(args.steps):
    opt.step(loss_on, data)                                     # 1 batch, or B on a sync
if rank == 0:
    print(f"after:  val loss {val_loss():.3f}, uplink per worker {opt.ledger.cost:.1f} dense "
          f"gradients = {opt.ledger.bytes / 1e3:.0f} kB")
if dist.is_initialized():
    dist.destroy_process_group()
