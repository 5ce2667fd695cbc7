"""Compressed Gluon on your own model: 4 simulated workers, a small MLP, synthetic data."""
import torch
from torch import nn

import gluon

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 2))
X = torch.randn(2000, 20)
y = (X[:, 0] * X[:, 1] > 0).long()                      # a non-linear task
shards = torch.arange(2000).chunk(4)                     # worker tau owns shards[tau]
oracles = [gluon.ModuleOracle(model, nn.functional.cross_entropy, X[s], y[s], batch_size=32)
           for s in shards]

# Spectral LMO on the hidden matrix, sign on the head, RMS on biases (the "scion" rule).
opt = gluon.simulate_module("alg1", model, oracles, compressor=gluon.RandK(density=0.05),
                            lr=0.02, beta=0.9, q=0.1, B=4, seed=0)
loss = lambda: nn.functional.cross_entropy(model(X), y).item()
print(f"before: loss {loss():.3f}")
for _ in range(300):
    opt.step()                                            # one iteration of Algorithm 1
print(f"after:  loss {loss():.3f}, uplink per worker {opt.comm.ledger.cost:.1f} dense "
      f"gradients = {opt.comm.ledger.bytes / 1e3:.0f} kB")
