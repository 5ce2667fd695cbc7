"""The network cost model (docs/cost.md): a finished run re-costed for any network.

Every logged row carries what a worker has spent so far (``gluon.engine.train``): ``grads``
(minibatch gradients), ``bytes`` (its uplink messages), ``up_bytes``/``down_bytes`` (what the
torch.distributed backend's ring collectives move), ``star_down_bytes`` (what a server sends it
in a star), ``rounds`` (message exchanges), ``hops`` (sequential point-to-point steps of the
backend's collectives, the coin's broadcast included) and ``compute_s``. The modelled wall time
at a row is a function of those columns and of the network (bandwidth both ways, latency, the
bytes each message costs beyond its payload) and of the compute time per gradient measured by
``make bench``/``make bench-cnn`` (results/bench/), so runs are never recomputed:

    star (a server; federated):  T = compute + 2 L rounds
                                     + 8 ((1 + h) bytes + F rounds) / U
                                     + 8 ((1 + h) star_down_bytes + F rounds) / D
    ring (the backend):          T = compute + L hops
                                     + max(8 ((1 + h) up_bytes + F hops) / U,
                                           8 ((1 + h) down_bytes + F hops) / D)
    compute = grads t_grad + steps t_step(method)

with U, D the uplink and downlink bandwidth (bit/s), L the latency of a hop (s), F the bytes a
message costs on the wire beyond its payload and h the header share of a full TCP segment
(both measured on the shaped network, results/cost/network.json). Communication and compute do
not overlap. The time to a level is the modelled time at the first row where the run's smoothed
curve (docs/statistics.md) reaches it; with U = B and D = r B that time is A + C / B, so the
bandwidth below which a method reaches Gluon's final level first is (C_gluon - C_m) / (A_m -
A_gluon) for the means over seeds, and its interval comes from resampling the seeds in pairs.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BENCH = Path("results/bench")                   # make bench, make bench-cnn: compute per gradient
NETWORK = Path("results/cost/network.json")     # make shaped: framing and latency measured
COST_COLUMNS = ("grads", "up_bytes", "down_bytes", "star_down_bytes", "rounds", "hops")
TOPOLOGIES = ("star", "ring")
# a panel's name in the results tables (a5a: its dataset; a5a-fair, cnn-fair: the fair-baseline
# panels at equal uplink, docs/fair.md, whose large-batch Gluon and Local Gluon are re-costed too)
PANEL_NAMES = {"logreg": "a5a", "cnn": "cnn", "fair_logreg": "a5a-fair", "fair_cnn": "cnn-fair",
               "lm_iid": "lm-iid", "lm_plays": "lm-plays"}


# ---------------------------------------------------------------- the model

@dataclass(frozen=True)
class Network:
    """A network: uplink ``up_bps`` and downlink ``down_bps`` per worker (bit/s; None: the
    uplink's), ``latency_s`` per hop, ``frame_bytes`` F per message and hop beyond the payload,
    ``header_share`` h of the payload (TCP/IP headers of full segments), and the topology."""
    up_bps: float
    down_bps: float | None = None
    latency_s: float = 0.0
    frame_bytes: float = 0.0
    header_share: float = 0.0
    topology: str = "star"

    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if not self.up_bps > 0 or (self.down_bps is not None and not self.down_bps > 0):
            raise ValueError("bandwidths must be > 0 bit/s")
        if self.latency_s < 0 or self.frame_bytes < 0 or self.header_share < 0:
            raise ValueError("latency, frame bytes and header share must be >= 0")

    @property
    def down(self) -> float:
        return self.up_bps if self.down_bps is None else self.down_bps


@dataclass(frozen=True)
class Compute:
    """Compute time per worker: ``grad_s`` per minibatch gradient, ``step_s[method]`` for the
    rest of a step (compression, averaging, LMO, bookkeeping); ``source`` says where from."""
    grad_s: float
    step_s: dict = field(default_factory=dict)
    source: str = ""

    def of(self, method: str, grads, steps):
        """Compute time after ``grads`` gradients and ``steps`` steps; a method missing from a
        non-empty ``step_s`` is an error (its benchmark was not run), never a free step."""
        if self.step_s and method not in self.step_s:
            raise KeyError(f"no step time for {method} in {self.source or 'step_s'}: "
                           "rerun its benchmark with it")
        return np.asarray(grads, float) * self.grad_s + \
            np.asarray(steps, float) * self.step_s.get(method, 0.0)


def columns(rows: list[dict]) -> dict[str, np.ndarray]:
    """The cost columns of a run's rows as arrays (KeyError names a missing column)."""
    missing = [c for c in ("step", "bytes", *COST_COLUMNS) if c not in rows[0]]
    if missing:
        raise KeyError(f"rows without {missing}: written before the cost columns existed")
    return {k: np.array([r[k] for r in rows], float)
            for k in ("step", "bytes", *COST_COLUMNS, "compute_s") if k in rows[0]}


def split_time(cols: dict, method: str, net: Network, compute: Compute | None):
    """(A, C_up, C_down) at every row: the modelled time is A + C_up / U + C_down / D for the
    star and A + max(C_up / U, C_down / D) for the ring. ``compute`` None: the rows' own
    measured ``compute_s``."""
    comp = cols["compute_s"] if compute is None else compute.of(method, cols["grads"], cols["step"])
    h, F = net.header_share, net.frame_bytes
    if net.topology == "star":
        lat = 2 * net.latency_s * cols["rounds"]
        up = 8 * ((1 + h) * cols["bytes"] + F * cols["rounds"])
        down = 8 * ((1 + h) * cols["star_down_bytes"] + F * cols["rounds"])
    else:
        lat = net.latency_s * cols["hops"]
        up = 8 * ((1 + h) * cols["up_bytes"] + F * cols["hops"])
        down = 8 * ((1 + h) * cols["down_bytes"] + F * cols["hops"])
    return comp + lat, up, down


def modelled_time(cols: dict, method: str, net: Network, compute: Compute | None) -> np.ndarray:
    """Modelled wall time (s) at every row of a run (docs/cost.md)."""
    a, up, down = split_time(cols, method, net, compute)
    if net.topology == "star":
        return a + up / net.up_bps + down / net.down
    return a + np.maximum(up / net.up_bps, down / net.down)


# ---------------------------------------------------------------- compute from make bench

def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip().strip("*") for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|") and "---" not in line]


def bench_compute(task: str, bench: Path = BENCH) -> Compute:
    """Compute time per worker from the committed benchmark tables.

    a5a (results/bench/logreg.md, ``make bench``: n = 4 simulated workers, best of 3 timings):
    t_grad = Gluon's time x its gradient share / (steps n), Gluon taking one minibatch gradient
    per worker and step; t_step(method) = the method's time x (1 - its gradient share) /
    (steps n). CNN (results/bench/cnn.md, ``make bench-cnn``): the CPU ms per step of the
    gradients and of the whole step, per method, the same way."""
    if PANEL_NAMES.get(task, task).startswith("a5a"):
        text = (bench / "logreg.md").read_text()
        head = re.search(r"n = (\d+) workers, (\d+) steps", text)
        n, steps = int(head[1]), int(head[2])
        rows = {r[0]: r for r in _table_rows(text)[1:]}
        pct = lambda s: float(s.rstrip("%")) / 100
        g = rows["gluon"]
        grad_s = float(g[2]) * pct(g[3]) / (steps * n)
        step_s = {m: float(r[2]) * (1 - pct(r[3])) / (steps * n) for m, r in rows.items()}
        return Compute(grad_s, step_s, f"{bench / 'logreg.md'} (make bench)")
    if task.startswith("lm"):
        return _lm_compute(bench / "lm.md")
    text = (bench / "cnn.md").read_text()
    n = int(re.search(r"n = (\d+) workers", text)[1])
    step_s, grads = {}, {}
    for sec in re.split(r"^### ", text, flags=re.M)[1:]:
        method = sec.split(":")[0].strip()
        rows = {r[0]: r for r in _table_rows(sec)}
        g, whole = float(rows["gradients (fwd+bwd)"][2]), float(rows["whole step"][2])
        grads[method] = g
        step_s[method] = (whole - g) / 1e3 / n
    return Compute(grads["gluon"] / 1e3 / n, step_s, f"{bench / 'cnn.md'} (make bench-cnn)")


def _lm_compute(path: Path) -> Compute:
    """The LM (results/bench/lm.md, ``make bench-lm``): CPU ms per step of the gradients and of
    the whole step, per method and step kind. t_grad is Gluon's gradient time per worker (one
    minibatch each); t_step(method) its time outside the gradients per worker and step, the
    kinds weighted by the bench's q (a sync with probability q), at the smallest B timed (the
    time outside the gradients hardly depends on B)."""
    text = path.read_text()
    n = int(re.search(r"n = (\d+) workers", text)[1])
    q = float(re.search(r"q = ([0-9.]+)", text)[1])
    first: dict[str, str] = {}                     # method -> the first (smallest) B's row name
    grad = None
    outside: dict[str, dict[str, float]] = {}       # method -> step kind -> s per worker and step
    for row in _table_rows(text.split("\n\nEvaluation")[0])[1:]:
        name, kind, ms, g = row[0], row[1], float(row[3]), float(row[5])
        method = name.split(",")[0]
        if first.setdefault(method, name) == name:
            outside.setdefault(method, {})[kind] = (ms - g) / 1e3 / n
        if name == "gluon":
            grad = g / 1e3 / n
    step_s = {}
    for m, kinds in outside.items():
        if "every step" in kinds:
            step_s[m] = kinds["every step"]
        else:
            step_s[m] = q * kinds["sync (u = 1)"] + (1 - q) * kinds["other (u = 0)"]
    if grad is None:
        raise ValueError(f"{path} has no 'gluon' row: rerun `make bench-lm` to rewrite it")
    return Compute(grad, step_s, f"{path} (make bench-lm)")


def measured_network(path: Path = NETWORK) -> dict:
    """Frame bytes, header share and latency measured on the shaped network (scripts/bench/shaped.py),
    or zeros (payload only) when it has not been measured."""
    if path.exists():
        return json.loads(path.read_text())
    return {"frame_bytes": 0.0, "header_share": 0.0, "latency_s": 0.0, "source": "not measured"}


# ---------------------------------------------------------------- the shaped network

def fit_network(low: dict, high: dict) -> dict:
    """Frame bytes F, header share h and hop latency L from the calibration loops of
    scripts/bench/shaped.py at a low and a high rate (each: bytes and seconds per loop, the payload
    and hops of a loop, the rate, and the big all-reduce's bytes and payload)."""
    F = (low["tx_per_loop"] - low["payload_per_loop"]) / low["hops_per_loop"]
    h = max(0.0, (high["big_tx"] - high["big_payload"] - F * high["big_hops"]) / high["big_payload"])
    wire = low["payload_per_loop"] * (1 + h) + F * low["hops_per_loop"]
    L = max(0.0, (high["s_per_loop"] - 8 * wire / high["rate_bps"]) / high["hops_per_loop"])
    return {"frame_bytes": F, "header_share": h, "latency_s": L}


def predict_run(res: dict, rate_bps: float, network: dict, compute: Compute) -> dict:
    """The model's time per step and time to the target for a shaped-network run of
    scripts/bench/shaped.py (ring topology: the backend), from the run's own cost columns."""
    net = Network(rate_bps, latency_s=network["latency_s"], frame_bytes=network["frame_bytes"],
                  header_share=network["header_share"], topology="ring")
    rows = res["rows"]
    cols = columns(rows)
    T = modelled_time(cols, res["method"], net, compute)
    wall = np.cumsum(res["wall_s"])
    last = len(rows) - 1 if res["hit"] is None else res["hit"]
    steps = int(cols["step"][last])
    wire = 8 * ((1 + net.header_share) * cols["up_bytes"][last] + net.frame_bytes * cols["hops"][last])
    return {"steps_to_target": steps if res["hit"] is not None else None,
            "measured_ms_per_step": 1e3 * wall[steps - 1] / steps,
            "model_ms_per_step": 1e3 * T[last] / steps,
            "measured_s_to_target": float(wall[steps - 1]) if res["hit"] is not None else None,
            "model_s_to_target": float(T[last]) if res["hit"] is not None else None,
            "measured_wire_bytes_per_step": rows[last]["wire_tx_bytes"] / steps,
            "model_wire_bytes_per_step": wire / 8 / steps,
            "payload_up_bytes_per_step": cols["up_bytes"][last] / steps,
            "payload_only_model_s_to_target": float(modelled_time(
                {k: v[last:last + 1] for k, v in cols.items()}, res["method"],
                Network(rate_bps, topology="ring"), compute)[0])}
