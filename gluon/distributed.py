"""Real multi-process training: the :class:`~gluon.comm.Comm` interface on torch.distributed,
over a process group the program has initialised (torchrun sets the environment,
``torch.distributed.init_process_group`` joins it). Starting the processes and joining the group
is the program's: a training loop of one's own does it as examples/torchrun_cifar.py does, the
project's runs in experiments/run/world.py (torchrun's or srun's environment).

One worker per process (``local_workers == [rank]``, ``n_workers == world size``); gloo on CPU,
NCCL on GPU. The methods in :mod:`gluon.methods` run unchanged: they hand :meth:`average` the
one local :class:`~gluon.comm.Message` and get back the mean over all workers, dense.

What crosses the wire is the packets in **compressed** form, one collective per wire tensor
kind (all blocks of a message are concatenated into one buffer per (key, dtype)):

==================  =============================================================================
compressor          collective(s) and what this rank contributes
==================  =============================================================================
identity (dense)    ``all_reduce`` (sum, then / n) of the fp32 values
randk               ``all_gather`` of the k values only; every rank regenerates every other rank's
                    indices from ``message_seed(run_seed, that_rank, step, block)``
topk                ``all_gather`` of the values and of the int32 indices
natural, qsgd       ``all_gather`` of their packed wire tensors (int8 / uint8, plus qsgd's norm)
zero                nothing
==================  =============================================================================

Every rank then decodes every rank's packets and averages them in rank order with the same
``torch.stack(values).mean(0)`` as :class:`~gluon.comm.InProcessComm`, so compressed steps are
bit-identical to the simulation; only the dense ``all_reduce`` sums in the collective's own
order (a last-bit difference; ``dense="all_gather"`` makes those bit-identical too, at n times
the downlink).

Accounting. Each process records its own message in its ledger exactly as InProcessComm records
it (same cost, same bytes, the same traffic both ways from :func:`gluon.comm.traffic`, one
message per call); :meth:`TorchDistComm.global_ledger` all-reduces the per-worker entries into
the ledger the simulation would hold. Independently, the backend counts ``sent_bytes``: the
nbytes of the tensors this rank contributes to the message collectives, which a test compares
with the ledger's library accounting (and tests/test_wire.py compares the ledger's up/down
traffic with the bytes the process writes to its sockets). The shared coin's broadcast (one
byte, not counted in the bytes; one latency hop in ``hops``) is counted apart in ``coin_bytes``.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import DENSE_COLLECTIVE, DENSE_COLLECTIVES, TRAFFIC, Comm, Ledger, Message
from .compressors import Identity, Packet, message_seed


class RankLedger(Ledger):
    """This process's ledger: only its own worker's entries are ever non-zero.

    ``cost`` and ``bytes`` report this worker's cumulative uplink (the simulation reports the
    mean over workers; the two agree whenever all workers send the same shapes each step, as in
    every method of :mod:`gluon.methods`). For the exact mean use
    :meth:`TorchDistComm.global_ledger`.
    """

    def __init__(self, n_workers: int, rank: int, dense: str = DENSE_COLLECTIVE):
        super().__init__(n_workers, dense=dense)
        self.rank = rank

    @property
    def cost(self) -> float:
        return self.cost_per_worker[self.rank]

    @property
    def bytes(self) -> float:
        return float(self.bytes_per_worker[self.rank])

    def _mean(self, key: str) -> float:
        return self.traffic_per_worker[key][self.rank]


class TorchDistComm(Comm):
    """One worker per process over an initialised torch.distributed process group.

    Args:
        seed: the run seed; rank 0 draws the shared coin from ``random.Random(seed)`` exactly
            as InProcessComm does and broadcasts it.
        group: process group (default: the world).
        device: device of the small coin tensor; default ``cuda`` (current device) under NCCL,
            else ``cpu``. Message collectives use the device of the message tensors.
        dense: ``"all_reduce"`` (default) or ``"all_gather"`` for dense (identity) messages.
    """

    def __init__(self, seed: int = 0, *, group=None, device=None, dense: str = DENSE_COLLECTIVE):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchDistComm needs an initialised process group: call "
                               "torch.distributed.init_process_group first (torchrun sets "
                               "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
        if dense not in DENSE_COLLECTIVES:
            raise ValueError(f"dense must be one of {DENSE_COLLECTIVES}, got {dense!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.n_workers = dist.get_world_size(group)
        self.local_workers = [self.rank]
        self.ledger = RankLedger(self.n_workers, self.rank, dense)
        self.dense = dense
        self.backend = dist.get_backend(group)
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if self.backend == "nccl" else torch.device("cpu"))
        self.device = torch.device(device)
        self._src = 0 if group is None else dist.get_global_rank(group, 0)
        self._coin_rng = random.Random(seed)
        self.sent_bytes = 0      # nbytes this rank contributed to message collectives
        self.collectives = 0     # message collectives this rank took part in
        self.coin_bytes = 0      # the coin broadcasts (not uplink; counted apart)

    # ------------------------------------------------------------------ the Comm interface
    def average(self, messages: Sequence[Message]) -> list[Tensor]:
        if len(messages) != 1:
            raise ValueError(f"TorchDistComm hosts one worker per process; expected 1 message, "
                             f"got {len(messages)}")
        msg = messages[0]
        if msg.worker != self.rank:
            raise ValueError(f"message of worker {msg.worker} handed to rank {self.rank}")
        self.ledger.record(msg)
        if self.n_workers == 1:
            return [v.clone() for v in msg.values]
        if isinstance(msg.compressor, Identity) and self.dense == "all_reduce":
            return self._all_reduce_mean(msg)
        return self._gather_mean(msg)

    def coin(self, q: float) -> bool:
        # Every rank advances its stream identically (so checkpoints do not depend on the rank);
        # rank 0's draw is the one everybody uses.
        draw = self._coin_rng.random() < q
        self.ledger.record_coin([self.rank])
        bit = torch.tensor([int(draw)], dtype=torch.uint8, device=self.device)
        dist.broadcast(bit, src=self._src, group=self.group)
        self.coin_bytes += bit.numel() * bit.element_size() if self.rank == 0 else 0
        return bool(bit.item())

    def state_dict(self) -> dict:
        return {"ledger": self.ledger.state_dict(), "coin_rng": self._coin_rng.getstate(),
                "sent_bytes": self.sent_bytes, "collectives": self.collectives,
                "coin_bytes": self.coin_bytes, "rank": self.rank, "n_workers": self.n_workers}

    def load_state_dict(self, s: dict) -> None:
        if s["n_workers"] != self.n_workers:
            raise ValueError(f"state of a {s['n_workers']}-worker run loaded into "
                             f"{self.n_workers} workers")
        self.ledger.load_state_dict(s["ledger"])
        self._coin_rng.setstate(s["coin_rng"])
        self.sent_bytes = s["sent_bytes"]
        self.collectives = s["collectives"]
        self.coin_bytes = s["coin_bytes"]

    # ------------------------------------------------------------------ reporting (collective)
    def global_ledger(self) -> Ledger:
        """The ledger the simulation would hold: per-worker entries all-reduced over ranks.

        A collective: every rank must call it."""
        dev = self.device
        cost = torch.tensor(self.ledger.cost_per_worker, dtype=torch.float64, device=dev)
        nbytes = torch.tensor(self.ledger.bytes_per_worker + [self.ledger.messages],
                              dtype=torch.int64, device=dev)
        moved = torch.tensor([self.ledger.traffic_per_worker[k] for k in TRAFFIC],
                             dtype=torch.float64, device=dev)
        dist.all_reduce(cost, group=self.group)
        dist.all_reduce(nbytes, group=self.group)
        dist.all_reduce(moved, group=self.group)     # x + 0 + ... + 0: exact
        out = Ledger(self.n_workers, dense=self.dense)
        out.load_state_dict({"cost": cost.tolist(), "bytes": nbytes[:-1].tolist(),
                             "messages": int(nbytes[-1]),
                             **dict(zip(TRAFFIC, moved.tolist()))})
        return out

    def measured_bytes(self) -> list[int]:
        """``sent_bytes`` of every rank, in rank order (a collective)."""
        t = torch.zeros(self.n_workers, dtype=torch.int64, device=self.device)
        t[self.rank] = self.sent_bytes
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def report(self) -> dict:
        """Global ledger and measured bytes in one dict (a collective)."""
        led = self.global_ledger()
        measured = self.measured_bytes()
        return {"ledger": led.state_dict(), "cost": led.cost, "bytes": led.bytes,
                "measured_bytes_per_worker": measured,
                "measured_bytes": sum(measured) / self.n_workers}

    # ------------------------------------------------------------------ the two paths
    def _contribute(self, t: Tensor) -> None:
        self.sent_bytes += t.numel() * t.element_size()
        self.collectives += 1

    def _all_reduce_mean(self, msg: Message) -> list[Tensor]:
        packets = msg.packets
        out: list[Tensor | None] = [None] * len(packets)
        for items in _groups(packets).values():
            buf = torch.cat([t.reshape(-1) for _, t in items])   # a copy: safe to reduce in place
            self._contribute(buf)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
            buf /= self.n_workers
            for i, t, piece in _split(buf, items):
                out[i] = piece.reshape(packets[i].shape)
        return out

    def _gather_mean(self, msg: Message) -> list[Tensor]:
        n, packets = self.n_workers, msg.packets
        # received[r][i] = wire dict of rank r's packet for block i
        received = [[{} for _ in packets] for _ in range(n)]
        for (key, _), items in _groups(packets).items():
            buf = torch.cat([t.reshape(-1) for _, t in items])
            bufs = [torch.empty_like(buf) for _ in range(n)]
            self._contribute(buf)
            dist.all_gather(bufs, buf, group=self.group)
            for r in range(n):
                for i, t, piece in _split(bufs[r], items):
                    received[r][i][key] = piece.reshape(t.shape)
        out = []
        for i, p in enumerate(packets):
            vals = []
            for r in range(n):
                if r == self.rank:   # the sender's own reconstruction, as in the simulation
                    vals.append(msg.values[i])
                    continue
                q = Packet(received[r][i], p.shape, seed=self._seed_of(msg, r, i),
                           meta=_shared_meta(p))
                vals.append(msg.compressor.decompress(q))
            out.append(torch.stack(vals).mean(0))
        return out

    def _seed_of(self, msg: Message, r: int, block: int) -> int:
        """Rank r's packet seed for ``block``: message_seed(run_seed, r, step, block) when the
        compressor seeds its packets with the message seed (RandK), else the packet's seed."""
        p = msg.packets[block]
        if p.seed == 0:
            return 0
        if msg.run_seed is None or msg.step is None:
            raise ValueError("a seeded packet (RandK) needs the message's run_seed and step to "
                             "regenerate other ranks' indices; build messages with "
                             "gluon.comm.encode")
        if p.seed != message_seed(msg.run_seed, msg.worker, msg.step, block):
            raise ValueError(f"packet seed of block {block} is not message_seed(run_seed, "
                             f"worker, step, block); cannot regenerate other ranks' seeds")
        return message_seed(msg.run_seed, r, msg.step, block)


def _shared_meta(p: Packet) -> dict:
    """What a receiver knows of a packet besides its wire tensors and seed: the scalar meta
    (k, dtype, device). Tensor-valued meta (RandK's indices, kept by the sender to skip
    regenerating them) is the sender's private cache and never reaches a receiver, which
    regenerates it from the seed instead."""
    return {k: v for k, v in p.meta.items() if not isinstance(v, Tensor)}


def _groups(packets: Sequence[Packet]) -> dict:
    """(wire key, dtype) -> [(block, tensor)], in block order: one buffer per group."""
    groups: dict = {}
    for i, p in enumerate(packets):
        for key, t in p.wire.items():
            groups.setdefault((key, t.dtype), []).append((i, t))
    return groups


def _split(buf: Tensor, items):
    off = 0
    for i, t in items:
        yield i, t, buf[off:off + t.numel()]
        off += t.numel()
