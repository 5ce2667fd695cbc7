"""Compressed Gluon in your own training loop: a small MLP, synthetic data, your DataLoader.

    python examples/own_model.py                                   # one process: n = 1
    torchrun --nproc-per-node 4 examples/own_model.py              # 4 workers, one per process

The same code runs both ways. Under torchrun each process is one worker on its own shard, and
the optimiser averages the workers' compressed messages through torch.distributed.
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gluon
from gluon.optim import CompressedGluon, forever

if "RANK" in os.environ:                                  # started by torchrun
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 2))
X = torch.randn(2000, 20)
y = (X[:, 0] * X[:, 1] > 0).long()                      # a non-linear task
shard = TensorDataset(X[rank::world], y[rank::world])     # worker tau owns one shard
loader = DataLoader(shard, batch_size=32, shuffle=True, drop_last=True,
                    generator=torch.Generator().manual_seed(rank))

# Spectral LMO on the hidden matrix, sign on the head, RMS on biases (Scion's rule, by name and
# shape); lr is the LMO radius and the scheduler anneals it.
opt = CompressedGluon(model.named_parameters(), lr=0.02, beta=0.9, q=0.1, B=4,
                      compressor=gluon.RandK(density=0.05), seed=0)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=300)


def loss_on(batch):                                       # the closure: the loss on one batch
    x, target = batch
    return F.cross_entropy(model(x), target)


def full_loss():
    with torch.no_grad():
        return F.cross_entropy(model(X), y).item()


batches = forever(loader)
if rank == 0:
    print(f"before: loss {full_loss():.3f} ({world} worker{'s' * (world > 1)})")
for k in range(300):
    opt.step(loss_on, batches)                            # 1 batch, or B = 4 on a sync
    sched.step()
if rank == 0:
    print(f"after:  loss {full_loss():.3f}, uplink per worker {opt.ledger.cost:.1f} dense "
          f"gradients = {opt.ledger.bytes / 1e3:.0f} kB")
if dist.is_initialized():
    dist.destroy_process_group()
