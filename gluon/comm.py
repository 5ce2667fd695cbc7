"""Communication between workers: the one place where uplink cost is counted.

A method never talks to other workers directly. It hands the backend one :class:`Message`
per worker it hosts and gets back the average over *all* workers, dense. Two backends
implement this interface:

* :class:`InProcessComm`: every worker lives in this process (the simulation). Averaging is a
  plain mean of what each worker's receiver would reconstruct.
* ``gluon.distributed.TorchDistComm``: one worker per process; packets cross the wire in
  compressed form through torch.distributed collectives.

Cost model (docs/algorithms.md section 1): only the uplink is counted, per worker, cumulative. ``cost`` is
normalised so that one dense gradient of the whole model (dimension d) costs 1.0; ``bytes`` is
the wire size of the packets. The shared coin is downlink-like (one bit from worker 1) and is
not counted.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from .compressors import Compressor, Identity, Packet, message_seed

DENSE = Identity()


@dataclass
class Message:
    """One worker's message for one step: a packet per block plus the values it decodes to."""
    worker: int
    compressor: Compressor
    packets: list[Packet]
    values: list[Tensor]  # what every receiver reconstructs (the sender knows it too: EF needs it)
    cost: float           # normalised cost (fraction of one dense model-sized vector)
    nbytes: int           # wire bytes
    # Coordinates of the message, so that a receiver can rebuild message_seed(run_seed, worker,
    # step, block) for any worker (RandK's indices are never sent). Not sent: shared by all.
    run_seed: int | None = None
    step: int | None = None


def encode(compressor: Compressor, blocks: Sequence[Tensor], *, run_seed: int, worker: int,
           step: int, dim: int) -> Message:
    """Compress every block of one worker's vector with per-(worker, step, block) seeds."""
    packets, values = [], []
    cost, nbytes = 0.0, 0
    for i, x in enumerate(blocks):
        p = compressor.compress(x, message_seed(run_seed, worker, step, i))
        packets.append(p)
        values.append(compressor.decompress(p))
        cost += compressor.cost(x.numel()) * x.numel() / dim
        nbytes += compressor.wire_bytes(x.numel())
    return Message(worker, compressor, packets, values, cost, nbytes, run_seed=run_seed, step=step)


@dataclass
class Ledger:
    """Cumulative uplink per worker. Methods read ``cost`` and ``bytes`` (means over workers)."""
    n_workers: int
    cost_per_worker: list[float] = field(default_factory=list)
    bytes_per_worker: list[int] = field(default_factory=list)
    messages: int = 0

    def __post_init__(self):
        self.cost_per_worker = [0.0] * self.n_workers
        self.bytes_per_worker = [0] * self.n_workers

    def record(self, msg: Message) -> None:
        self.cost_per_worker[msg.worker] += msg.cost
        self.bytes_per_worker[msg.worker] += msg.nbytes
        self.messages += 1

    @property
    def cost(self) -> float:
        return sum(self.cost_per_worker) / self.n_workers

    @property
    def bytes(self) -> float:
        return sum(self.bytes_per_worker) / self.n_workers

    def state_dict(self):
        return {"cost": list(self.cost_per_worker), "bytes": list(self.bytes_per_worker),
                "messages": self.messages}

    def load_state_dict(self, s):
        self.cost_per_worker = list(s["cost"])
        self.bytes_per_worker = list(s["bytes"])
        self.messages = s["messages"]


class Comm:
    """Interface shared by the simulation and the torch.distributed backend."""

    n_workers: int
    local_workers: list[int]  # ranks of the workers this process hosts
    ledger: Ledger

    def average(self, messages: Sequence[Message]) -> list[Tensor]:
        """Mean over all n workers of the decoded messages (one per local worker)."""
        raise NotImplementedError

    def coin(self, q: float) -> bool:
        """Worker 1's Bernoulli(q) draw, shared by every worker."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


class InProcessComm(Comm):
    """All n workers in one process; the coin comes from a stream seeded by the run seed."""

    def __init__(self, n_workers: int, seed: int = 0):
        if n_workers < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        self.n_workers = n_workers
        self.local_workers = list(range(n_workers))
        self.ledger = Ledger(n_workers)
        self._coin_rng = random.Random(seed)

    def average(self, messages):
        if len(messages) != self.n_workers:
            raise ValueError(f"expected {self.n_workers} messages, got {len(messages)}")
        for m in messages:
            self.ledger.record(m)
        if len(messages) == 1:
            return [v.clone() for v in messages[0].values]
        out = []
        for vals in zip(*(m.values for m in messages)):
            out.append(torch.stack(vals).mean(0))
        return out

    def coin(self, q):
        return self._coin_rng.random() < q

    def state_dict(self):
        return {"ledger": self.ledger.state_dict(), "coin_rng": self._coin_rng.getstate()}

    def load_state_dict(self, s):
        self.ledger.load_state_dict(s["ledger"])
        self._coin_rng.setstate(s["coin_rng"])
