"""The traffic the ledger counts (``up_bytes``, ``down_bytes``: gluon.comm.traffic) against the
bytes 3 gloo processes really write to and read from their sockets, for every compressor.

Measured, per rank, around one ``TorchDistComm.average`` call:

* sent: the bytes the process wrote (``wchar`` of /proc/self/io) and the number of writes
  (``syscw``). gloo's TCP transport frames every write with a fixed header of h bytes, so the
  payload sent is ``wchar - h * syscw``; h is measured on its own, from a write that carries
  no payload (a rank that receives a 1-byte broadcast writes only its ready-to-receive notice);
* received: the bytes TCP delivered to the process's sockets (``tcpi_bytes_received`` of
  TCP_INFO), minus the same framing.

Three processes, so that the ring rules are told apart from the naive ones: an all-gather
moves (n - 1) = 2 packets each way per worker (not 1, not 3), a ring all-reduce 2 (n - 1)/n =
4/3 of the vector (not 1, not 2).
"""
from __future__ import annotations

import os
import socket
import struct
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.run.world import free_port
from gluon import encode, make_compressor
from gluon.comm import traffic

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available() and os.path.exists("/proc/self/io")),
    reason="needs torch.distributed with gloo and Linux's per-process I/O accounting")

WORLD = 3
SHAPES = [(100, 100), (5000,), (7,)]          # 15,007 coordinates; 7 is not divisible by 3
CASES = {                                       # name: (compressor, options, dense collective)
    "identity-all_reduce": ("identity", {}, "all_reduce"),
    "identity-all_gather": ("identity", {}, "all_gather"),
    "randk": ("randk", {"density": 0.1}, "all_reduce"),
    "topk": ("topk", {"density": 0.1}, "all_reduce"),
    "natural": ("natural", {}, "all_reduce"),
    "qsgd": ("qsgd", {"levels": 4}, "all_reduce"),
    "zero": ("zero", {}, "all_reduce"),
}
SETTLE = 0.3      # seconds for the last frames of a collective to arrive before reading counters
START = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _io() -> tuple[int, int]:
    vals = dict(line.split(":") for line in open("/proc/self/io").read().splitlines())
    return int(vals["wchar"]), int(vals["syscw"])


def _tcp_received() -> int | None:
    """Bytes received by every TCP socket of this process (None: no tcpi_bytes_received)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.fromfd(int(fd), socket.AF_INET, socket.SOCK_STREAM)   # a duplicate
        except OSError:
            continue
        try:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            continue
        finally:
            s.close()
        if len(info) < 136:
            return None
        total += struct.unpack_from("Q", info, 128)[0]     # tcpi_bytes_received
    return total


def _snapshot():
    time.sleep(SETTLE)
    return (*_io(), _tcp_received())


def _delta(a, b):
    return tuple(None if x is None or y is None else y - x for x, y in zip(a, b))


def _rank(rank: int, port: int, queue) -> None:
    from gluon.distributed import TorchDistComm
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        out = {}
        bit = torch.zeros(1, dtype=torch.uint8)        # the framing alone: h
        dist.broadcast(bit, src=0)                      # (connects the pairs too)
        a = _snapshot()
        dist.broadcast(bit, src=0)
        out["broadcast"] = _delta(a, _snapshot())
        gen = torch.Generator().manual_seed(rank)
        for name, (comp, opts, dense) in CASES.items():
            comm = TorchDistComm(seed=0, dense=dense)
            c = make_compressor(comp, **opts)
            blocks = [torch.randn(s, generator=gen) for s in SHAPES]
            dim = sum(b.numel() for b in blocks)
            comm.average([encode(c, blocks, run_seed=0, worker=rank, step=0, dim=dim)])  # warm
            msg = encode(c, blocks, run_seed=0, worker=rank, step=1, dim=dim)
            before = dict(comm.ledger.totals())
            a = _snapshot()
            comm.average([msg])
            moved = _delta(a, _snapshot())
            after = comm.ledger.totals()
            counted = {k: after[k] - before[k] for k in after}
            out[name] = {"moved": moved, "counted": counted, "nbytes": msg.nbytes,
                         "rule": traffic(msg, WORLD, dense)}
            dist.barrier()
        queue.put((rank, out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured():
    ctx = mp.get_context(START)
    for attempt in range(2):      # a port taken between free_port() and bind: once more
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        try:
            res = dict(queue.get(timeout=300) for _ in procs)
        except Exception:
            res = None
        for p in procs:
            p.join(timeout=60)
        if res is not None and all(p.exitcode == 0 for p in procs):
            return res
        if attempt:
            raise RuntimeError("the 3 gloo processes did not finish")


def _framing(measured) -> int:
    """h: bytes a write carries without payload (a receiving rank's notice in a broadcast)."""
    hs = set()
    for r in range(1, WORLD):
        wchar, syscw, _ = measured[r]["broadcast"]
        assert syscw >= 1
        hs.add(wchar / syscw)
    assert len(hs) == 1, hs
    h = hs.pop()
    assert h == int(h) and 0 < h <= 128
    return int(h)


def test_the_framing_is_one_fixed_header_per_write(measured):
    h = _framing(measured)
    wchar, syscw, _ = measured[0]["broadcast"]           # the root sends 1 byte to each other
    assert wchar - h * syscw == WORLD - 1


@pytest.mark.parametrize("name", [n for n in CASES if n != "zero"])
def test_bytes_sent_on_the_wire_equal_the_counted_uplink(name, measured):
    h = _framing(measured)
    b = measured[0][name]["nbytes"]
    counted = [measured[r][name]["counted"]["up_bytes"] for r in range(WORLD)]
    assert len(set(counted)) == 1                        # every rank counts the same
    sent = [measured[r][name]["moved"][0] - h * measured[r][name]["moved"][1]
            for r in range(WORLD)]
    if name == "identity-all_reduce":
        # ring all-reduce: 2 (n-1)/n of the vector on average; a rank's share differs from the
        # mean by gloo's rounding of the vector into n chunks (at most an element per chunk)
        assert counted[0] == pytest.approx(2 * (WORLD - 1) * b / WORLD, rel=1e-12)
        assert sum(sent) == pytest.approx(WORLD * counted[0], abs=1e-6)
        assert all(abs(s - counted[0]) <= 4 * 2 * (WORLD - 1) for s in sent), sent
    else:
        # ring all-gather: every rank forwards the other n - 1 packets, exactly
        assert counted[0] == (WORLD - 1) * b
        assert sent == counted, (sent, counted)


@pytest.mark.parametrize("name", [n for n in CASES if n != "zero"])
def test_bytes_received_on_the_wire_equal_the_counted_downlink(name, measured):
    if any(measured[r][name]["moved"][2] is None for r in range(WORLD)):
        pytest.skip("this kernel's TCP_INFO has no tcpi_bytes_received")
    h = _framing(measured)
    for r in range(WORLD):
        wchar, syscw, received = measured[r][name]["moved"]
        down = measured[r][name]["counted"]["down_bytes"]
        assert down == measured[r][name]["counted"]["up_bytes"]       # a ring: both ways
        # the payload received; the notices a rank receives need not match its own writes
        # one for one (a few frames either way), hence the slack of 8 frames
        assert abs(received - h * syscw - down) <= 8 * h, (r, received - h * syscw, down)
        assert 8 * h < 0.05 * down                       # the slack tells n - 1 from n or 1


def test_nothing_crosses_the_wire_for_zero(measured):
    for r in range(WORLD):
        wchar, syscw, received = measured[r]["zero"]["moved"]
        assert wchar == syscw == 0
        assert measured[r]["zero"]["counted"] == {k: 0.0 for k in measured[r]["zero"]["counted"]}


def test_the_ledger_uses_the_rule_it_states(measured):
    for name in CASES:
        rule, counted = measured[0][name]["rule"], measured[0][name]["counted"]
        assert (counted["up_bytes"], counted["down_bytes"], counted["star_down_bytes"],
                counted["rounds"], counted["hops"]) == (rule.up, rule.down, rule.star_down,
                                                        rule.rounds, rule.hops)
