"""Communication between workers: the one place where uplink cost is counted.

A method never talks to other workers directly. It hands the backend one :class:`Message`
per worker it hosts and gets back the average over *all* workers, dense. Two backends
implement this interface:

* :class:`InProcessComm`: every worker lives in this process (the simulation). Averaging is a
  plain mean of what each worker's receiver would reconstruct.
* ``gluon.distributed.TorchDistComm``: one worker per process; packets cross the wire in
  compressed form through torch.distributed collectives.

Cost model (docs/algorithms.md section 1): ``cost`` and ``bytes`` count the uplink, per worker,
cumulative. ``cost`` is normalised so that one dense gradient of the whole model (dimension d)
costs 1.0; ``bytes`` is the wire size of the packets (what one worker uploads to a server).

The network traffic of a round (docs/cost.md): :func:`traffic` says what a message really moves
through the collective that carries it, both ways, in the torch.distributed backend (a ring
all-reduce for dense vectors, a ring all-gather for packets) and in a star with a server; the
ledger adds it up per worker (``up_bytes``, ``down_bytes``, ``star_down_bytes``, ``rounds``,
``hops``). Both backends count with the same function, so a simulation and a multi-process run
of the same config hold the same ledger. The shared coin's byte is not counted in the bytes
(a server would send it with its reply); its broadcast is one latency hop (``hops``).
"""
from __future__ import annotations

import math
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
    packets, values, coordinates = [], [], []
    nbytes = 0
    for i, x in enumerate(blocks):
        p = compressor.compress(x, message_seed(run_seed, worker, step, i))
        packets.append(p)
        values.append(compressor.decompress(p))
        coordinates.append(compressor.cost(x.numel()) * x.numel())   # dense fp32 coordinates
        nbytes += compressor.wire_bytes(x.numel())
    # One division of an exact sum: a dense message costs exactly 1.0 whatever its blocks, so a
    # budget of K units is K dense rounds (summing the blocks' fractions numel/dim instead gave
    # 0.9999999999999999 for some models, and a 501st step under a budget of 500).
    cost = math.fsum(coordinates) / dim
    return Message(worker, compressor, packets, values, cost, nbytes, run_seed=run_seed, step=step)


DENSE_COLLECTIVES = ("all_reduce", "all_gather")
DENSE_COLLECTIVE = "all_reduce"   # the default: less downlink; all_gather: bit-identical to sim


@dataclass(frozen=True)
class Traffic:
    """What one worker's message moves in one round, for that worker (docs/cost.md).

    ``up``/``down``: bytes the worker sends/receives in the torch.distributed backend's
    collective (ring all-reduce or ring all-gather). ``star_down``: bytes a server sends the
    worker in a star (the worker's uplink there is the message, ``Message.nbytes``).
    ``rounds``: message exchanges (a star's round trips). ``hops``: sequential point-to-point
    steps of the backend's collectives (what a latency multiplies)."""
    up: float = 0.0
    down: float = 0.0
    star_down: float = 0.0
    rounds: int = 0
    hops: int = 0


def collectives(msg: Message) -> int:
    """How many collectives the torch.distributed backend uses for a message: one per wire
    tensor kind, (key, dtype), all blocks concatenated (RandK 1, TopK 2: values and indices)."""
    return len({(key, t.dtype) for p in msg.packets for key, t in p.wire.items()})


def traffic(msg: Message, n_workers: int, dense: str = DENSE_COLLECTIVE) -> Traffic:
    """The bytes and latency hops of one worker's message averaged over ``n_workers`` workers.

    Rules (docs/cost.md, checked against the bytes written to the sockets by
    tests/test_wire.py):

    * nothing moves when there is one worker or an empty message (``zero``);
    * a dense message (identity) with ``dense="all_reduce"`` goes through a ring all-reduce
      (gloo's): reduce-scatter then all-gather, 2(n-1) steps of 1/n of the vector each way, so
      ``up = down = 2 (n-1)/n * nbytes`` (the mean over workers: gloo's chunks differ by at most
      an element between ranks) and 2(n-1) hops;
    * every other message (and dense ones with ``dense="all_gather"``) goes through a ring
      all-gather of its packet: each worker forwards the other n-1 packets, so
      ``up = down = (n-1) * nbytes`` and n-1 hops per collective;
    * in a star, the server sends each worker the average in the cheaper of two forms: the other
      n-1 packets as received (the worker averages them with its own, as the backend does) or
      the dense average: ``star_down = min((n-1) * nbytes, dense bytes)``. The average of n
      TopK or RandK packets is not sparse at k: it has up to n k non-zeros.
    """
    if dense not in DENSE_COLLECTIVES:
        raise ValueError(f"dense must be one of {DENSE_COLLECTIVES}, got {dense!r}")
    n, b = n_workers, msg.nbytes
    if n <= 1 or b == 0:
        return Traffic()
    dense_bytes = sum(v.numel() * v.element_size() for v in msg.values)
    star_down = float(min((n - 1) * b, dense_bytes))
    if isinstance(msg.compressor, Identity) and dense == "all_reduce":
        moved = 2.0 * (n - 1) * b / n
        return Traffic(moved, moved, star_down, 1, 2 * (n - 1))
    moved = float((n - 1) * b)
    return Traffic(moved, moved, star_down, 1, (n - 1) * collectives(msg))


TRAFFIC = ("up_bytes", "down_bytes", "star_down_bytes", "rounds", "hops")


@dataclass
class Ledger:
    """Cumulative communication per worker. Methods read ``cost`` and ``bytes`` (the uplink
    of the messages); :meth:`totals` adds the traffic both ways (all means over workers)."""
    n_workers: int
    cost_per_worker: list[float] = field(default_factory=list)
    bytes_per_worker: list[int] = field(default_factory=list)
    messages: int = 0
    dense: str = DENSE_COLLECTIVE      # how the backend moves dense messages (see traffic())
    traffic_per_worker: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        self.cost_per_worker = [0.0] * self.n_workers
        self.bytes_per_worker = [0] * self.n_workers
        self.traffic_per_worker = {k: [0.0] * self.n_workers for k in TRAFFIC}

    def record(self, msg: Message) -> None:
        self.cost_per_worker[msg.worker] += msg.cost
        self.bytes_per_worker[msg.worker] += msg.nbytes
        self.messages += 1
        t = traffic(msg, self.n_workers, self.dense)
        for key, v in zip(TRAFFIC, (t.up, t.down, t.star_down, t.rounds, t.hops)):
            self.traffic_per_worker[key][msg.worker] += v

    def record_coin(self, workers) -> None:
        """The shared coin's broadcast: one latency hop for each of ``workers`` (no bytes)."""
        if self.n_workers > 1:
            for w in workers:
                self.traffic_per_worker["hops"][w] += 1

    @property
    def cost(self) -> float:
        return sum(self.cost_per_worker) / self.n_workers

    @property
    def bytes(self) -> float:
        return sum(self.bytes_per_worker) / self.n_workers

    def _mean(self, key: str) -> float:
        return sum(self.traffic_per_worker[key]) / self.n_workers

    def totals(self) -> dict[str, float]:
        """{up_bytes, down_bytes, star_down_bytes, rounds, hops}: the columns of a logged row."""
        return {k: self._mean(k) for k in TRAFFIC}

    def state_dict(self):
        return {"cost": list(self.cost_per_worker), "bytes": list(self.bytes_per_worker),
                "messages": self.messages,
                **{k: list(v) for k, v in self.traffic_per_worker.items()}}

    def load_state_dict(self, s):
        self.cost_per_worker = list(s["cost"])
        self.bytes_per_worker = list(s["bytes"])
        self.messages = s["messages"]
        self.traffic_per_worker = {k: list(s[k]) for k in TRAFFIC}


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
    """All n workers in one process; the coin comes from a stream seeded by the run seed.

    ``dense`` names the collective the torch.distributed backend would use for dense messages
    (``"all_reduce"`` or ``"all_gather"``), so that the ledger counts the traffic of the same
    run on real processes (:func:`traffic`)."""

    def __init__(self, n_workers: int, seed: int = 0, dense: str = DENSE_COLLECTIVE):
        if n_workers < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        if dense not in DENSE_COLLECTIVES:
            raise ValueError(f"dense must be one of {DENSE_COLLECTIVES}, got {dense!r}")
        self.n_workers = n_workers
        self.local_workers = list(range(n_workers))
        self.ledger = Ledger(n_workers, dense=dense)
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
        self.ledger.record_coin(self.local_workers)
        return self._coin_rng.random() < q

    def state_dict(self):
        return {"ledger": self.ledger.state_dict(), "coin_rng": self._coin_rng.getstate()}

    def load_state_dict(self, s):
        self.ledger.load_state_dict(s["ledger"])
        self._coin_rng.setstate(s["coin_rng"])
