"""Runs on a real shaped network (scripts/cluster/shaped_network.sh) against the cost model's predictions.

    python -m scripts.bench.shaped measure [--task logreg|cnn] [--rates 100kbit 20mbit] [--out CSV]
    python -m scripts.bench.shaped throughput [--bytes 2000000]   # goodput of worker 1 -> worker 0
    python -m scripts.bench.shaped rank ...                       # one worker (started by the above)

The network must be up (``scripts/cluster/shaped_network.sh up``; root). ``measure`` runs, at each rate,
Gluon and Alg. 1 at their Fig. 2 settings (:data:`TASKS`: a5a from configs/tuned/fig2_logreg/,
or the CNN's CPU profile from configs/tuned/fig2_cnn_cpu/) with 2 gloo processes, one in each
worker's namespace (the torch.distributed backend of ``comm=torchdist``:
:class:`gluon.distributed.TorchDistComm`), until the task's metric (a5a: f - f*; CNN: the
training loss on its 512 fixed images) reaches the target (Gluon's final level in Fig. 2) or
``--max-steps``. Every step is timed on the wall clock (f - f* is evaluated every
``--eval-every`` steps outside the timed steps, both ranks, then a barrier). Before the runs it
measures the network's two parameters at each rate with a 1-byte ping-pong between the two
namespaces (a hop's time is latency + frame/rate: two rates give both). The model
(scripts/figures/cost.py, ring topology, docs/cost.md) then predicts each run's time per step and time to
the target from the run's own cost columns (grads, up/down bytes, hops), the compute time and
those two network parameters.

Compute is measured in the same session as the network (``--compute calibrate``, the default):
a short run of each method on the same 2-process backend, its CPU time per step fit as
``grad_s`` per gradient plus a per-step remainder (:func:`calibrate_compute`). This machine's
speed drifts between sessions (``make bench-cnn``'s Gluon step took 30.1 ms when its table was
committed and 54.9 ms on the day the CNN was measured here), so a committed benchmark table
cannot time a run made on another day. ``--compute bench`` uses the committed tables of
``make bench`` / ``make bench-cnn`` instead, as ``make fig-cost`` does.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from experiments.shared.files import REPO
NET_SH = REPO / "scripts" / "cluster" / "shaped_network.sh"
METHODS = ("gluon", "alg1")


class Task(NamedTuple):
    primary: str            # configs/<primary>.yaml: the entry point's config
    overrides: tuple        # what makes it Fig. 2's panel (with tuned=<tuned>/<method>)
    tuned: str
    metric: str             # the row key the target is on
    target: float           # Gluon's final level in the experiment (cnn: the quick B = 4 profile)
    out: str                # the measured table


TASKS = {
    "logreg": Task("logreg", (), "fig2_logreg", "gap", 4.43e-3, "results/cost/shaped.csv"),
    "cnn": Task("cnn", ("profile=cpu", "device=cpu"), "fig2_cnn_cpu", "loss", 1.208,
                "results/cost/shaped_cnn.csv"),
}
WORKERS = 2
SETTLE = 1.0            # s: for the frames still queued in HTB to leave before counters are read


def sh(*args: str, **kw) -> str:
    return subprocess.run([str(NET_SH), *args], check=True, capture_output=True, text=True,
                          **kw).stdout.strip()


def iface(rank: int) -> str:
    return f"{os.environ.get('SHAPED_NAME', 'gfl')}n{rank}"


def counters(rank: int) -> dict:
    """The worker's interface counters (bytes and packets both ways; its own namespace)."""
    base = Path("/sys/class/net") / iface(rank) / "statistics"
    return {k: int((base / k).read_text()) for k in ("tx_bytes", "rx_bytes", "tx_packets",
                                                     "rx_packets")}


# ---------------------------------------------------------------- one worker (in a namespace)

def _join():
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist


def config(task: str, method: str, seed: int = 0, steps: int | None = None, comm: str = "sim"):
    """The config of ``method`` in Fig. 2's panel of ``task``, on :data:`WORKERS` workers."""
    from experiments.run.config import compose
    spec = TASKS[task]
    return compose(spec.primary, *spec.overrides, f"tuned={spec.tuned}/{method}", f"seed={seed}",
                   f"n_workers={WORKERS}", f"comm={comm}",
                   *([f"steps={steps}"] if steps is not None else []))


def rank_main(args) -> None:
    """One rank of a run: build the task as the entry point does, step with wall-clock timing."""
    import torch
    from experiments.run.config import build_compressor
    from experiments.tasks import task_module
    from experiments.run.world import open_world

    rank = int(os.environ["RANK"])
    cfg = config(args.task, args.method, args.seed, args.max_steps, comm="torchdist")
    task = task_module(cfg.task.name)
    world = open_world("torchdist")
    import torch.distributed as dist
    torch.set_num_threads(1)
    built = task.build(cfg, build_compressor(cfg.compressor), world)
    m = built.method
    led = m.comm.ledger
    wall, cpu, rows = [], [], []
    hit = None
    metric = TASKS[args.task].metric

    def row():
        return {"step": m.k, "grads": sum(w.grads for w in m.workers), "bytes": led.bytes,
                **led.totals(), "compute_s": m.compute_s, "time_s": sum(wall),
                metric: built.evaluate(m)[metric]}

    dist.barrier()
    c0 = counters(rank)
    while m.k < args.max_steps:
        t, p = time.perf_counter(), time.process_time()
        m.step()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - p)
        if m.k % args.eval_every == 0:
            c1 = counters(rank)            # untimed from here: evaluation and a barrier
            rows.append({**row(), **{f"wire_{k}": c1[k] - c0[k] for k in c0}})
            if hit is None and rows[-1][metric] <= args.target:
                hit = len(rows) - 1
            stop = torch.tensor([int(hit is not None)])
            dist.all_reduce(stop)          # both ranks stop at the same step
            dist.barrier()
            if stop.item() and m.k >= args.min_steps:
                break
            c0 = {k: c0[k] + counters(rank)[k] - c1[k] for k in c0}   # leave the barrier out
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "task": args.task, "method": args.method, "seed": args.seed, "metric": metric,
            "target": args.target, "hit": hit,
            "rows": rows, "wall_s": wall, "cpu_s": cpu, "config": {
                "method": dict(cfg.method), "compressor": dict(cfg.compressor),
                "n_workers": WORKERS, "batch_size": cfg.batch_size}}, default=str))
    dist.barrier()
    dist.destroy_process_group()


def calibrate_main(args) -> None:
    """The network's parameters, measured with collectives alone (no training): ``--n`` loops
    of what a step sends (a 124-float all-reduce, a 1-float all-gather, two 1-byte broadcasts
    from rank 0: 5 hops and 500 payload bytes a rank), timed, with the interface counters;
    with ``--big``, also a 127,096-float all-reduce 3 times (the header share of full segments)."""
    import torch
    dist = _join()
    rank = dist.get_rank()
    dense, one, bit = torch.ones(124), torch.ones(1), torch.zeros(1, dtype=torch.uint8)
    out = [torch.empty(1), torch.empty(1)]

    def loop():
        dist.all_reduce(dense)
        dist.broadcast(bit, src=0)
        dist.all_gather(out, one)
        dist.broadcast(bit, src=0)

    for _ in range(5):                      # warm: connect the pair
        loop()
    dist.barrier()
    c0, t = counters(rank), time.perf_counter()
    for _ in range(args.n):
        loop()
    s_per_loop = (time.perf_counter() - t) / args.n
    time.sleep(SETTLE)                      # the last frames leave the shaped queue
    c1 = counters(rank)
    res = {"s_per_loop": s_per_loop, "tx_per_loop": (c1["tx_bytes"] - c0["tx_bytes"]) / args.n,
           "payload_per_loop": 496 + 4, "hops_per_loop": 5, "loops": args.n}
    if args.big:
        big = torch.ones(127_096)
        dist.all_reduce(big)
        dist.barrier()
        c0 = counters(rank)
        for _ in range(3):
            dist.all_reduce(big)
        time.sleep(SETTLE)
        c1 = counters(rank)
        res.update(big_tx=(c1["tx_bytes"] - c0["tx_bytes"]) / 3, big_payload=4 * 127_096,
                   big_hops=2)
    tx = torch.tensor([v for k, v in sorted(res.items()) if k.endswith("tx") or
                       k.endswith("per_loop")], dtype=torch.float64)
    dist.all_reduce(tx)                     # the two ranks' mean
    keys = [k for k in sorted(res) if k.endswith("tx") or k.endswith("per_loop")]
    res.update({k: float(v) / WORKERS for k, v in zip(keys, tx)})
    if rank == 0:
        Path(args.out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the parent (root)

def launch(sub: list[str], timeout: float) -> None:
    """Start rank 0 and rank 1 of ``python -m scripts.bench.shaped SUB`` in their namespaces."""
    port = 29000 + os.getpid() % 1000
    procs = []
    for r in range(WORKERS):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORKERS), LOCAL_RANK=str(r),
                   MASTER_ADDR=sh("addr", "0"), MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME=iface(r), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([str(NET_SH), "exec", str(r), sys.executable, "-m",
                                       "scripts.bench.shaped", *sub], env=env, cwd=REPO))
    try:
        for p in procs:
            if p.wait(timeout=timeout) != 0:
                raise RuntimeError(f"scripts.bench.shaped {' '.join(sub)}: a rank failed")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def calibrate(n: int, big: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cal.json"
        launch(["calibrate", "--n", str(n), "--out", str(out), *(["--big"] if big else [])],
               timeout=1800)
        return json.loads(out.read_text())


def run(method: str, seed: int, max_steps: int, eval_every: int, target: float,
        min_steps: int = 0, task: str = "logreg") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        launch(["rank", "--task", task, "--method", method, "--seed", str(seed), "--max-steps", str(max_steps),
                "--eval-every", str(eval_every), "--target", str(target), "--min-steps",
                str(min_steps), "--out", str(out)], timeout=3600)
        return json.loads(out.read_text())


def throughput(nbytes: int = 2_000_000) -> float:
    """Goodput (bit/s of TCP payload) from worker 1 to worker 0 through the shaped uplink: the
    least-squares slope of bytes received against time over the receiver's reads. Left out: the
    reads of the first 64 KiB (a GSO super-packet of up to 64 KiB passes the shaper at once and
    its tokens are repaid after, so a short transfer's start runs above the rate) and the last
    read (the final short segment waits for a delayed ACK). A slope over many reads, not two end
    points, so a receiver scheduled late now and then (a loaded machine) barely moves it."""
    import numpy as np
    recv = ("import socket,sys,time,json\n"
            "s=socket.socket();s.bind((sys.argv[1],0));s.listen(1);print(s.getsockname()[1],flush=True)\n"
            "c,_=s.accept();n=0;log=[]\n"
            "while True:\n b=c.recv(1<<16)\n if not b: break\n"
            " n+=len(b);log.append((n,time.perf_counter()))\n"
            "print(json.dumps(log), flush=True)\n")
    send = ("import socket,sys\nc=socket.create_connection((sys.argv[1],int(sys.argv[2])))\n"
            "c.sendall(b'x'*int(sys.argv[3]));c.close()\n")
    addr = sh("addr", "0")
    r = subprocess.Popen([str(NET_SH), "exec", "0", sys.executable, "-c", recv, addr],
                         stdout=subprocess.PIPE, text=True)
    port = r.stdout.readline().strip()
    subprocess.run([str(NET_SH), "exec", "1", sys.executable, "-c", send, addr, port,
                    str(nbytes)], check=True, timeout=600)
    log = np.array(json.loads(r.stdout.readline()), dtype=float)
    r.wait(timeout=60)
    log = log[(log[:, 0] > 65536) & (np.arange(len(log)) < len(log) - 1)]
    if len(log) < 3:
        raise RuntimeError(f"{len(log)} reads past 64 KiB of {nbytes} bytes: too few to time; "
                           "send more")
    return 8 * float(np.polyfit(log[:, 1] - log[0, 1], log[:, 0], 1)[0])


def rate_bps(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for u, f in units.items():
        if rate.lower().endswith(u):
            return float(rate[: -len(u)]) * f
    return float(rate)


def prepare(task: str) -> None:
    """What the ranks would otherwise both build at once, built once before they start (they
    then read the cache): a5a's f* of the 2-worker problem, the CNN's decoded CIFAR-10."""
    from experiments.run.config import build_compressor
    from experiments.tasks import task_module
    cfg = config(task, "gluon", steps=0)
    task_module(cfg.task.name).build(cfg, build_compressor(cfg.compressor))


def calibrate_compute(task: str, steps: int, warmup: int = 20):
    """Compute per worker on the real backend now: each of :data:`METHODS` runs ``steps`` steps
    (the target out of reach) and its mean CPU time per step after ``warmup`` is fit as
    ``grad_s`` x its gradients per step + a remainder that every method shares (two methods,
    two unknowns: exact). Returns a ``scripts.figures.cost.Compute`` and what was measured."""
    import numpy as np

    from experiments.shared import cost_model as cost
    seen = {}
    for method in METHODS:
        res = run(method, 0, steps, 10, 0.0, task=task)
        rows = res["rows"]
        grads = (rows[-1]["grads"] - rows[0]["grads"]) / (rows[-1]["step"] - rows[0]["step"])
        seen[method] = {"cpu_ms_per_step": 1e3 * float(np.mean(res["cpu_s"][warmup:])),
                        "grads_per_step": grads}
    a = np.array([[seen[m]["grads_per_step"], 1.0] for m in METHODS])
    b = np.array([seen[m]["cpu_ms_per_step"] / 1e3 for m in METHODS])
    (grad_s, rest_s), *_ = np.linalg.lstsq(a, b, rcond=None)
    source = (f"CPU time per step of {', '.join(METHODS)} on the real backend ({WORKERS} gloo "
              f"processes, {steps} steps each, python -m scripts.bench.shaped measure): "
              f"{1e3 * grad_s:.2f} ms per gradient + {1e3 * rest_s:.2f} ms per step")
    return cost.Compute(float(grad_s), {m: float(rest_s) for m in METHODS}, source), seen


def measure(args) -> None:
    """Calibrate the network at the lowest and highest rate, then run both methods at every
    rate; write the table beside the model's predictions and the network's parameters."""
    from experiments.shared import cost_model as cost
    spec = TASKS[args.task]
    target = spec.target if args.target is None else args.target
    out = Path(args.out or spec.out)
    prepare(args.task)
    low, high = min(args.rates, key=rate_bps), max(args.rates, key=rate_bps)
    cal = {}
    for rate, big in ((low, False), (high, True)):
        sh("rate", rate)
        cal[rate] = {**calibrate(args.loops, big), "rate_bps": rate_bps(rate)}
        print(f"calibration at {rate}: {json.dumps(cal[rate])}", flush=True)
    network = cost.fit_network(cal[low], cal[high])
    load = os.getloadavg()
    network.update(source=f"python -m scripts.bench.shaped measure (calibration loops of collectives, "
                          f"2 gloo processes, HTB at {low} and {high}; load {load[0]:.1f})",
                   calibration=cal)
    print(f"network: {json.dumps({k: v for k, v in network.items() if k != 'calibration'})}",
          flush=True)
    if args.compute == "calibrate":
        compute, seen = calibrate_compute(args.task, args.compute_steps)
        network.update(compute=compute.source, compute_calibration=seen)
    else:
        compute = cost.bench_compute(cost.PANEL_NAMES[args.task])
        network.update(compute=compute.source)
    print(f"compute: {compute.source}", flush=True)
    out_rows = []
    for rate in args.rates:
        sh("rate", rate)
        goodput = throughput(args.tput_bytes)
        for method in METHODS:
            t0 = time.time()
            res = run(method, args.seed, args.max_steps, args.eval_every, target,
                      task=args.task)
            pred = cost.predict_run(res, rate_bps(rate), network, compute)
            row = {"rate": rate, "rate_bps": rate_bps(rate), "goodput_bps": round(goodput),
                   "method": method, "seed": args.seed, **pred, "run_s": round(time.time() - t0)}
            out_rows.append(row)
            print(json.dumps(row), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    what = {"logreg": "a5a", "cnn": "CIFAR-10 airbench94, CPU profile"}[args.task]
    metric = {"gap": "f - f*", "loss": "training loss (512 fixed images)"}[spec.metric]
    from experiments.shared.files import atomic_write_text
    fh = io.StringIO(newline="")
    fh.write(f"# {what}, n = 2 gloo processes in 2 network namespaces, each uplink HTB-shaped; "
             f"seed {args.seed}; target {metric} <= {target:g} (evaluated every "
             f"{args.eval_every} steps); {os.cpu_count()} cores, load {load[0]:.1f}/"
             f"{load[1]:.1f}/{load[2]:.1f} after the runs; compute: {compute.source}; "
             f"python -m scripts.bench.shaped measure\n")
    w = csv.DictWriter(fh, fieldnames=list(out_rows[0]))
    w.writeheader()
    w.writerows(out_rows)
    atomic_write_text(out, fh.getvalue())
    net_out = out.parent / ("network.json" if args.task == "logreg" else f"{out.stem}_network.json")
    atomic_write_text(net_out, json.dumps(network, indent=2) + "\n")
    print(f"wrote {out} and {net_out}")


def _num(x: float) -> str:
    return f"{x:.1f}" if x > 10 else f"{x:.2f}"


def readme_table(task: str = "logreg", path: Path | None = None) -> str:
    """The README's table of a task's shaped-network measurements beside the model's
    predictions, from the committed CSV (``TASKS[task].out``)."""
    path = Path(path or REPO / TASKS[task].out)
    with open(path) as fh:
        rows = list(csv.DictReader(line for line in fh if not line.startswith("#")))
    names = {"gluon": "Gluon", "alg1": "Alg. 1"}
    units = {"kbit": "kbit/s", "mbit": "Mbit/s", "gbit": "Gbit/s"}
    lines = ["| rate | method | s to target, measured | model | model / measured | "
             "payload-only model | ms/step measured | model |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        unit = next(u for u in units if r["rate"].lower().endswith(u))
        rate = f"{r['rate'][:-len(unit)]} {units[unit]}"
        meas, model = float(r["measured_s_to_target"]), float(r["model_s_to_target"])
        lines.append(f"| {rate} | {names.get(r['method'], r['method'])} | {_num(meas)} | "
                     f"{_num(model)} | {model / meas:.2f} | "
                     f"{_num(float(r['payload_only_model_s_to_target']))} | "
                     f"{_num(float(r['measured_ms_per_step']))} | "
                     f"{_num(float(r['model_ms_per_step']))} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--task", choices=sorted(TASKS), default="logreg")
    m.add_argument("--rates", nargs="+", default=["100kbit", "20mbit"])
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--max-steps", type=int, default=6000)
    m.add_argument("--eval-every", type=int, default=10)
    m.add_argument("--target", type=float, default=None, help="default: the task's (TASKS)")
    m.add_argument("--loops", type=int, default=200)
    m.add_argument("--tput-bytes", type=int, default=1_000_000)
    m.add_argument("--out", default=None, help="default: the task's (TASKS)")
    m.add_argument("--compute", choices=["calibrate", "bench"], default="calibrate",
                   help="the model's compute: measured now on the backend, or the committed "
                        "make bench tables")
    m.add_argument("--compute-steps", type=int, default=300)
    t = sub.add_parser("throughput")
    t.add_argument("--bytes", type=int, default=2_000_000)
    r = sub.add_parser("rank")
    r.add_argument("--task", choices=sorted(TASKS), default="logreg")
    r.add_argument("--method", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-steps", type=int, default=6000)
    r.add_argument("--min-steps", type=int, default=0)
    r.add_argument("--eval-every", type=int, default=10)
    r.add_argument("--target", type=float, required=True)
    r.add_argument("--out", required=True)
    tb = sub.add_parser("table", help="print the README's table from the committed CSV")
    tb.add_argument("--task", choices=sorted(TASKS), default="logreg")
    c = sub.add_parser("calibrate")
    c.add_argument("--n", type=int, default=200)
    c.add_argument("--big", action="store_true")
    c.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "measure":
        measure(args)
    elif args.cmd == "throughput":
        print(f"{throughput(args.bytes) / 1e6:.3f} Mbit/s")
    elif args.cmd == "rank":
        rank_main(args)
    elif args.cmd == "table":
        print(readme_table(args.task), end="")
    else:
        calibrate_main(args)


if __name__ == "__main__":
    main()
