"""One-shot check of the CNN experiment on a GPU (a few minutes at most): run it as is.

    python -m scripts.bench.gpu_check [--out results/gpu_check/gpu_check.json]     # make gpu-check
    python -m scripts.bench.gpu_check --device cpu --tiny                          # the same on CPU, tiny

Without CUDA (and without ``--device``) it prints that no GPU was found, checks and writes
nothing, and exits 0. With CUDA, at the paper profile (airbench94 widths 64/256/256, batch 16,
n = 4 workers, bf16 autocast on):

1. **steps**: ``--steps`` (20) steps of every CNN method (gluon, alg1, alg2, ef21_muon, alg3,
   alg4, vr_marina; the configs' compressors at 1 %, CNN defaults lr 0.05, beta 0.9): the
   training loss must stay finite, the parameters finite and changed.
2. **delta**: at X and X_prev one LMO step apart (gluon's last step), Delta = grad f_xi(X) -
   grad f_xi(X_prev) on one minibatch. The code path the methods use (``CifarOracle.grad_diff``
   with amp on) must equal the IEEE fp32 Delta exactly (no bf16, and no TF32 convolutions, which
   cuDNN otherwise uses for "fp32" on Ampere and later). Reported beside it, as the reason: Delta
   under bf16 autocast against fp32, relative to RandK 1 %'s own relative noise on Delta,
   sqrt(sum_b omega_b ||D_b||^2 / ||D||^2) ~ sqrt(d/k - 1) ~ 10 (Top-K and the identity add no
   such noise to hide it), and default-fp32 (TF32) against IEEE fp32. The gradients themselves do
   run under bf16 autocast: the relative error of one minibatch gradient under bf16 must stay
   below ``GRAD_MARGIN`` (1/2) of the minibatch sampling noise ||g_xi - g_xi'|| / (sqrt(2)
   ||g_xi||), measured on a second minibatch at X.
3. **speed**: steps per second of every method (after ``--warmup`` steps; CUDA synchronised
   before and after the timed steps).
4. **distributed**: alg1 (RandK 1 %, q = 0.3, B = 2) on 2 real gloo processes
   (``gluon.distributed.TorchDistComm``, torch.multiprocessing) against the in-process
   simulation on the same device: parameters within ``--atol`` (1e-6, as in
   tests/test_distributed.py), ledgers equal, bytes each rank put on the wire equal to the
   ledger's; dense messages both through all_reduce (the default) and all_gather (bit-identical
   by design; reported). Uses synthetic images (the check is about the backend, not the data).

5. **lm**: the LM task's paper profile (nanoGPT's shakespeare_char GPT, 6 x 6 x 384, context
   256, 16 windows a worker, bf16 autocast) for ``--steps`` steps of Gluon and of Alg. 1 (RandK
   1 %, q = 0.1, B = 16): steps per second, the validation loss on 64 fixed windows before and
   after (finite), the parameters finite and changed. Tiny Shakespeare where the experiments
   look for it (never downloaded here), else a synthetic text of the same alphabet size.

Data: CIFAR-10 where the experiments look for it (cache, data_dir, $GLUON_DATA_DIR, ./data,
../shared/data; never downloaded here); otherwise synthetic random-colour images, and the JSON
says so. Every number goes to ONE JSON file (``--out``). Any mismatch, non-finite value or error
makes it print a loud FAILED block and exit 1 (the JSON is still written).

``--device cpu --tiny`` runs the same checks on CPU with widths 8/16/16, 3 steps and a small
dataset, to exercise the whole logic without a GPU (tests/test_gpu_check.py). On CPU the steps
run in fp32 (the CNN task enables autocast on CUDA only); the delta check still forces bf16
autocast on CPU so that every comparison is computed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch

from experiments.shared.configs import cnn_widths
from experiments.shared.files import REPO
from experiments.shared.files import atomic_write_text
from experiments.tasks.cnn import ieee_fp32, precision_settings
from gluon.comm import TRAFFIC

DEFAULT_OUT = "results/gpu_check/gpu_check.json"
METHODS = ["gluon", "alg1", "alg2", "ef21_muon", "alg3", "alg4", "vr_marina"]
PAPER_WIDTHS = cnn_widths("paper")
TINY_WIDTHS = [8, 16, 16]
GRAD_MARGIN = 0.5          # bf16's gradient error must stay below this fraction of the minibatch
                           # sampling noise (so it adds at most a quarter of the sampling variance)
DIST_WORLD = 2
DIST_METHOD = ["method=alg1", "compressor=randk", "compressor.density=0.01", "method.q=0.3",
               "method.B=2"]
DIST_DENSE = ["all_reduce", "all_gather"]


# ---------------------------------------------------------------- configuration and data

def compose_cfg(overrides):
    from experiments.run.config import compose
    return compose("cnn", *overrides)


def overrides(spec: dict, method_args, steps: int, n_workers: int) -> list[str]:
    """Hydra overrides of the paper profile at the check's scale (``spec``: plain dict)."""
    widths = ",".join(str(int(w)) for w in spec["widths"])
    return ["profile=paper", *method_args, f"device={spec['device']}", f"steps={steps}",
            f"log_every={max(1, steps)}", "eval_every=0", f"n_workers={n_workers}",
            f"batch_size={spec['batch_size']}", f"task.widths=[{widths}]",
            "task.download=false", f"threads={spec['threads']}",
            f"task.eval_train={spec['eval_train']}", "task.eval_test=64", "seed=0"]


def synthetic(n_train: int, n_test: int, seed: int = 0, classes: int = 10):
    """Learnable stand-in for CIFAR-10: a class colour, stripes for odd classes, noise."""
    from experiments.tasks.cifar10 import Cifar
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(classes, 3, 1, 1, generator=g) * 160 + 40
    stripes = (torch.arange(32) // 4 % 2).float().view(1, 1, 1, 32) * 40

    def make(n):
        y = torch.randint(classes, (n,), generator=g)
        x = base[y] + stripes * (y.view(-1, 1, 1, 1) % 2) + torch.randn(n, 3, 32, 32, generator=g) * 30
        return x.clamp(0, 255).to(torch.uint8), y

    trx, tr_y = make(n_train)
    tex, te_y = make(n_test)
    return Cifar(trx, tr_y, tex, te_y, [f"c{i}" for i in range(classes)], "synthetic",
                 "scripts.bench.gpu_check synthetic images")


def find_data(args) -> tuple:
    """(Cifar, note): CIFAR-10 where the experiments look for it (no download), else synthetic."""
    from experiments.tasks.cifar10 import Cifar, load_cifar10
    n_train, n_test = (512, 128) if args.tiny else (4096, 512)
    if args.synthetic:
        return synthetic(n_train, n_test), "synthetic images (--synthetic)"
    try:
        data = load_cifar10(args.data_dir, REPO / "results" / "cache", "auto", download=False)
    except Exception as err:   # DataNotFoundError, unreadable cache, ...
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return (synthetic(n_train, n_test),
                f"CIFAR-10 not found ({first}; no download attempted): synthetic random-colour "
                f"images, {n_train} train / {n_test} test")
    note = f"{data.label} from {data.origin}"
    if args.tiny:   # a subset: the tiny check must stay quick (vr_marina's full-shard gradients)
        data = Cifar(data.train_x[:n_train], data.train_y[:n_train], data.test_x[:n_test],
                     data.test_y[:n_test], data.classes, data.source, data.origin)
        note += f" (first {n_train} train / {n_test} test images: --tiny)"
    return data, note


def on_device(data, device):
    from experiments.tasks.cifar10 import Cifar
    return Cifar(data.train_x.to(device), data.train_y.to(device), data.test_x.to(device),
                 data.test_y.to(device), data.classes, data.source, data.origin)


# ---------------------------------------------------------------- numerics helpers

def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@contextmanager
def deterministic():
    """cuDNN picks deterministic algorithms (no atomics): repeated gradients are bitwise equal."""
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old


def norm(xs) -> float:
    return math.sqrt(sum(float(x.double().pow(2).sum()) for x in xs))


def rel(a, b) -> float:
    """||a - b|| / ||b|| over all blocks."""
    return norm([x - y for x, y in zip(a, b)]) / max(norm(b), 1e-300)


def finite(xs) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in xs)


class Checks:
    """Collects failures; the script still runs every section and writes every number."""

    def __init__(self):
        self.failures: list[str] = []

    def expect(self, cond, message: str) -> bool:
        if not cond:
            self.failures.append(message)
            print(f"  MISMATCH: {message}", flush=True)
        return bool(cond)

    def error(self, section: str, err: BaseException) -> dict:
        self.failures.append(f"{section}: {type(err).__name__}: {err}")
        print(f"  ERROR in {section}: {type(err).__name__}: {err}", flush=True)
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


# ---------------------------------------------------------------- 1 + 3: steps and speed

def run_method(name: str, spec: dict, data, checks: Checks) -> dict:
    from experiments.tasks.cnn import build
    from experiments.run.config import validate
    from gluon import EF21Muon
    cfg = compose_cfg(overrides(spec, [f"method={name}"], spec["steps"], spec["n_workers"]))
    compressor = validate(cfg)
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    method, evaluate, extra = build(cfg, compressor, data=data)[:3]
    start = [p.detach().clone() for p in method.params]
    loss0 = evaluate.train_loss()
    syncs, timed = 0, 0
    t0 = None
    for k in range(spec["steps"]):
        if k == spec["warmup"]:
            sync(device)
            t0 = time.perf_counter()
        syncs += bool(method.u)
        method.step()
        timed += k >= spec["warmup"]
    sync(device)
    elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    loss1 = evaluate.train_loss()
    changes = [float((p - s).abs().max()) for p, s in zip(method.params, start)]
    out = {"compressor": plain(cfg.compressor), "hparams": plain(cfg.method),
           "n_params": extra["n_params"], "amp": extra["amp"], "device": extra["device"],
           "steps": method.k, "syncs": syncs, "warmup_steps": spec["warmup"],
           "timed_steps": timed, "timed_s": elapsed,
           "steps_per_s": timed / elapsed if timed and elapsed > 0 else float("nan"),
           "ms_per_step": 1e3 * elapsed / timed if timed else float("nan"),
           "loss_start": loss0, "loss_end": loss1,
           "params_finite": finite(method.params),
           "blocks_changed": sum(c > 0 for c in changes), "blocks": len(changes),
           "max_abs_change": max(changes), "uplink_cost": method.comm.ledger.cost}
    if device.type == "cuda":
        out["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
    if isinstance(method, EF21Muon):   # no shared coin: every step sends the same way
        out["syncs"] = None
    ok = checks.expect(math.isfinite(loss0) and math.isfinite(loss1),
                       f"{name}: training loss not finite ({loss0} -> {loss1})")
    ok &= checks.expect(out["params_finite"], f"{name}: parameters not finite")
    ok &= checks.expect(out["max_abs_change"] > 0 and math.isfinite(out["max_abs_change"]),
                        f"{name}: parameters did not change")
    ok &= checks.expect(math.isfinite(out["steps_per_s"]) and out["steps_per_s"] > 0,
                        f"{name}: steps/s not finite ({out['steps_per_s']})")
    if device.type == "cuda":
        ok &= checks.expect(extra["amp"], f"{name}: bf16 autocast is off on CUDA")
    out["ok"] = ok
    return out


def plain(node) -> dict:
    from omegaconf import OmegaConf
    return OmegaConf.to_container(node, resolve=True)


# ---------------------------------------------------------------- 5: the LM task's GPT

LM_METHODS = {"gluon": ["method=gluon", "compressor=identity"],
              "alg1": ["method=alg1", "compressor=randk", "compressor.density=0.01",
                       "method.q=0.1", "method.B=16", "method.lr=0.001"]}
LM_TINY = ["task.n_layer=1", "task.n_head=2", "task.n_embd=16", "task.block_size=16",
           "batch_size=4"]


def lm_text(args) -> tuple:
    """(Text, note): Tiny Shakespeare where the experiments look for it (no download), else a
    synthetic text: 65 symbols with a repeating structure a GPT can learn."""
    from experiments.tasks.shakespeare import Text, encode, load_text
    try:
        return load_text(args.data_dir, REPO / "results" / "cache", False), "Tiny Shakespeare"
    except Exception as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        g = torch.Generator().manual_seed(0)
        words = ["".join(chr(48 + int(c)) for c in torch.randint(65, (5,), generator=g))
                 for _ in range(200)]
        order = torch.randint(200, (60_000,), generator=g).tolist()
        tokens, vocab = encode(" ".join(words[i] for i in order))
        return (Text(tokens, vocab, "synthetic", "-"),
                f"Tiny Shakespeare not found ({first}; no download attempted): a synthetic text")


def lm_check(spec: dict, args, checks: Checks) -> dict:
    """Gluon and Alg. 1 on the LM task's paper profile (``--tiny``: a 1-layer GPT of width 16)."""
    from experiments.run.config import compose, validate
    from experiments.tasks import lm
    text, note = lm_text(args)
    out = {"data": note, "methods": {}}
    for name, method_args in LM_METHODS.items():
        if args.tiny:
            method_args = [a.replace("method.B=16", "method.B=2") for a in method_args]
        try:
            cfg = compose("lm", "profile=lm/paper", *method_args, f"device={spec['device']}",
                          f"steps={spec['steps']}", "seed=0", "task.download=false",
                          "task.eval_val=64", "task.eval_train=64",
                          *(LM_TINY if args.tiny else []))
            built = lm.build(cfg, validate(cfg), text=text)
            method, ev = built.method, built.evaluate
            start = [p.detach().clone() for p in method.params]
            loss0 = ev.loss(*ev.val)
            t0 = None
            for k in range(spec["steps"]):
                if k == spec["warmup"]:
                    sync(spec["device"])
                    t0 = time.perf_counter()
                method.step()
            sync(spec["device"])
            timed = spec["steps"] - spec["warmup"]
            elapsed = time.perf_counter() - t0
            loss1 = ev.loss(*ev.val)
            r = {"n_params": built.summary["n_params"], "model": built.summary["model"],
                 "steps": method.k, "steps_per_s": timed / elapsed, "val_loss_start": loss0,
                 "val_loss_end": loss1, "params_finite": finite(method.params),
                 "max_abs_change": max(float((p - s0).abs().max())
                                       for p, s0 in zip(method.params, start)),
                 "uplink_cost": method.comm.ledger.cost}
            r["ok"] = checks.expect(math.isfinite(loss0) and math.isfinite(loss1),
                                    f"lm {name}: validation loss not finite ({loss0} -> {loss1})")
            r["ok"] &= checks.expect(r["params_finite"] and r["max_abs_change"] > 0,
                                     f"lm {name}: parameters not finite or unchanged")
            print(f"  lm {name:6s} {r['steps_per_s']:8.2f} steps/s  val_loss {loss0:.4f} -> "
                  f"{loss1:.4f}  ok {r['ok']}", flush=True)
        except Exception as err:
            r = checks.error(f"lm {name}", err)
        out["methods"][name] = r
    return out


# ---------------------------------------------------------------- 2: bf16 vs fp32 Delta

def delta_check(spec: dict, data, checks: Checks) -> dict:
    from experiments.tasks.cnn import build
    from experiments.run.config import validate
    from gluon import encode, make_compressor
    from gluon.worker import Oracle
    steps = spec["delta_steps"]
    cfg = compose_cfg(overrides(spec, ["method=gluon"], steps, spec["n_workers"]))
    method = build(cfg, validate(cfg), data=data).method
    for _ in range(steps):
        method.step()
    X, X_prev = [p.detach().clone() for p in method.params], [p.clone() for p in method.prev]
    oracle = method.workers[0].oracle
    batch = oracle.sample(torch.Generator().manual_seed(12345))

    @contextmanager
    def autocast_set(amp: bool):   # the oracle's bf16 autocast switched for the block, then restored
        amp0, oracle.amp = oracle.amp, amp
        try:
            yield
        finally:
            oracle.amp = amp0

    def base_delta(amp: bool):   # grad - grad through the oracle's gradients, autocast as given
        with autocast_set(amp):
            return Oracle.grad_diff(oracle, X, X_prev, batch)

    with deterministic():
        fp32 = base_delta(False)
        fp32_again = base_delta(False)
        bf16 = base_delta(True)
        with autocast_set(True):          # as the methods run it on CUDA (amp on)
            path = oracle.grad_diff(X, X_prev, batch)
        with ieee_fp32():
            ieee = base_delta(False)
        grads = {}
        for amp in (False, True):
            with autocast_set(amp):
                grads[amp] = oracle.grad(X, batch)
        grad = grads[False]
        other = oracle.sample(torch.Generator().manual_seed(54321))   # a second minibatch
        with autocast_set(False):
            grad_other = oracle.grad(X, other)

    d = sum(x.numel() for x in fp32)
    comp = make_compressor("randk", density=0.01)
    omega = [comp.omega(x.numel()) for x in fp32]
    theory = math.sqrt(sum(o * norm([x]) ** 2 for o, x in zip(omega, fp32)) / norm(fp32) ** 2)
    draws = []
    for s in range(8):
        msg = encode(comp, fp32, run_seed=1000 + s, worker=0, step=s, dim=d)
        draws.append(rel(msg.values, fp32) ** 2)
    empirical = math.sqrt(sum(draws) / len(draws))
    names = oracle.names
    per_block = {n: rel([a], [b]) for n, a, b in zip(names, bf16, fp32)}
    worst = max(per_block, key=per_block.get)
    out = {
        "X_minus_X_prev_norm": norm([a - b for a, b in zip(X, X_prev)]),
        "after_gluon_steps": steps, "minibatch": len(batch[1]), "dim": d,
        "autocast_device": batch[0].device.type, "precision_settings": precision_settings(),
        "grad_norm_fp32": norm(grad), "delta_norm_fp32": norm(fp32),
        "delta_over_grad": norm(fp32) / max(norm(grad), 1e-300),
        "rel_err_bf16_grad": rel(grads[True], grad),   # one gradient's own bf16 error
        # sampling noise of one minibatch gradient: ||g_xi - g_xi'|| / (sqrt(2) ||g_xi||)
        "rel_sampling_noise_grad": norm([a - b for a, b in zip(grad, grad_other)])
        / (math.sqrt(2) * max(norm(grad), 1e-300)),
        "rel_err_bf16_vs_fp32": rel(bf16, fp32),
        "rel_err_bf16_vs_ieee_fp32": rel(bf16, ieee),
        "rel_err_default_fp32_vs_ieee_fp32": rel(fp32, ieee),
        "rel_err_bf16_worst_block": {"block": worst, "rel_err": per_block[worst]},
        "randk_density": 0.01,
        "randk_rel_noise_theory": theory,
        "randk_rel_noise_sqrt_d_over_k_minus_1": math.sqrt(1 / 0.01 - 1),
        "randk_rel_noise_empirical": empirical, "randk_draws": len(draws),
        "bf16_delta_err_over_randk_noise": rel(bf16, fp32) / theory,
        "grad_margin": GRAD_MARGIN,
        "method_path_equals_fp32": all(torch.equal(a, b) for a, b in zip(path, ieee)),
        "method_path_equals_bf16": all(torch.equal(a, b) for a, b in zip(path, bf16)),
        "fp32_repeat_bitwise_equal": all(torch.equal(a, b) for a, b in zip(fp32, fp32_again)),
        "all_finite": all(finite(v) for v in (fp32, bf16, path, ieee, grad, grads[True])),
    }
    checks.expect(out["all_finite"], "delta: a Delta or gradient is not finite")
    checks.expect(out["fp32_repeat_bitwise_equal"],
                  "delta: the fp32 Delta is not bitwise repeatable (nondeterministic kernels)")
    checks.expect(out["method_path_equals_fp32"],
                  "delta: CifarOracle.grad_diff (the methods' path, amp on) differs from the "
                  "fp32 Delta")
    out["bf16_grad_err_over_sampling_noise"] = (out["rel_err_bf16_grad"]
                                                 / max(out["rel_sampling_noise_grad"], 1e-300))
    checks.expect(out["bf16_grad_err_over_sampling_noise"] < GRAD_MARGIN,
                  f"delta: the bf16 gradient's relative error {out['rel_err_bf16_grad']:.3g} is "
                  f"not below {GRAD_MARGIN} x the minibatch sampling noise "
                  f"{out['rel_sampling_noise_grad']:.3g}")
    checks.expect(math.isfinite(out["rel_err_bf16_vs_fp32"]) and math.isfinite(empirical),
                  "delta: a relative error is not finite")
    return out


# ---------------------------------------------------------------- 4: gloo processes vs simulation

def _dist_run(spec: dict, rank: int, dense: str) -> dict:
    """One rank's alg1 run on TorchDistComm, built exactly as gluon.simulate builds worker rank."""
    import torch.distributed as dist
    from experiments.tasks.cnn import build
    from experiments.run.config import validate
    from experiments.tasks import settings
    from gluon import Worker, make_method
    from gluon.distributed import TorchDistComm
    cfg = compose_cfg(overrides(spec, DIST_METHOD, spec["dist_steps"], DIST_WORLD))
    compressor = validate(cfg)
    data = on_device(synthetic(*spec["dist_data"]), spec["device"])
    sim = build(cfg, compressor, data=data).method   # every shard and oracle, as the simulation
    comm = TorchDistComm(cfg.seed, dense=dense)
    worker = Worker(rank, sim.workers[rank].oracle, cfg.seed)
    method = make_method(cfg.method.name, sim.params, [worker], comm, compressor=compressor,
                         blocks=sim.update.blocks, seed=cfg.seed, **settings(cfg.method))
    syncs = 0
    while method.k < spec["dist_steps"]:
        syncs += bool(method.u)
        method.step()
    sync(spec["device"])
    rep = comm.report()
    flat = torch.cat([p.detach().reshape(-1) for p in method.params]).cpu()
    allp = [torch.empty_like(flat) for _ in range(comm.n_workers)]
    dist.all_gather(allp, flat)
    return {"dense": dense, "params": [p.detach().cpu().clone() for p in method.params],
            "ledger": rep["ledger"], "measured_bytes_per_worker": rep["measured_bytes_per_worker"],
            "syncs": syncs, "collectives": comm.collectives, "backend": comm.backend,
            "max_rank_diff": max(float((a - allp[0]).abs().max()) for a in allp)}


def dist_entry(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    """torch.multiprocessing entry: one gloo group, alg1 once per dense mode; rank 0 saves."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    if torch.device(spec["device"]).type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=spec["dist_timeout"]))
    try:
        results = [_dist_run(spec, rank, dense) for dense in DIST_DENSE]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


def _simulate_reference(spec: dict, dense: str = "all_reduce") -> dict:
    """The simulation of the distributed check; ``dense`` only changes the traffic its ledger
    counts (how the backend would move dense messages), not the iterates."""
    from experiments.tasks.cnn import build
    from experiments.run.config import validate
    from experiments.run.world import World
    cfg = compose_cfg(overrides(spec, DIST_METHOD, spec["dist_steps"], DIST_WORLD))
    data = on_device(synthetic(*spec["dist_data"]), spec["device"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # as the processes: CPU results can depend on the threads
    try:
        method = build(cfg, validate(cfg), World(dense=dense), data=data).method
        syncs = 0
        with deterministic():
            while method.k < spec["dist_steps"]:
                syncs += bool(method.u)
                method.step()
        sync(spec["device"])
    finally:
        torch.set_num_threads(threads)
    return {"params": [p.detach().cpu().clone() for p in method.params],
            "ledger": method.comm.ledger.state_dict(), "measured_bytes_per_worker": None,
            "syncs": syncs}


def _spawn(spec: dict, out: str) -> str:
    import torch.multiprocessing as mp
    from experiments.run.world import free_port
    cuda = torch.device(spec["device"]).type == "cuda"
    # CUDA cannot be used in a forked child once the parent has initialised it: spawn there
    start = spec.get("start_method") or "auto"
    if start == "auto":
        start = "fork" if not cuda and "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.start_processes(dist_entry, args=(DIST_WORLD, free_port(), spec, out),
                             nprocs=DIST_WORLD, join=False, start_method=start)
    deadline = time.monotonic() + spec["dist_timeout"] + 60
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {DIST_WORLD} gloo processes did not finish in "
                                   f"{spec['dist_timeout'] + 60} s")
    finally:
        for p in ctx.processes:     # only ours, and only if still alive
            if p.is_alive():
                p.terminate()
                p.join(5)
    return start


def compare(a: dict, b: dict, atol: float) -> dict:
    """Parameters within ``atol``, ledgers equal, measured bytes equal to the ledger's."""
    import math
    diff = max(float((x - y).abs().max()) for x, y in zip(a["params"], b["params"]))
    same_ledger = (a["ledger"]["messages"] == b["ledger"]["messages"]
                   and a["ledger"]["bytes"] == b["ledger"]["bytes"]
                   and all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-12)
                           for x, y in zip(a["ledger"]["cost"], b["ledger"]["cost"]))
                   and all(a["ledger"].get(k) == b["ledger"].get(k) for k in TRAFFIC))
    measured_ok = all(r.get("measured_bytes_per_worker") is None
                      or r["measured_bytes_per_worker"] == r["ledger"]["bytes"] for r in (a, b))
    return {"max_abs_param_diff": diff, "params_close": diff <= atol, "ledgers_equal": same_ledger,
            "measured_bytes_equal_ledger": measured_ok,
            "ok": diff <= atol and same_ledger and measured_ok}


def dist_check(spec: dict, checks: Checks, tmpdir: Path) -> dict:
    out = tmpdir / "dist_results.pt"
    t0 = time.perf_counter()
    for attempt in range(2):   # a port taken between free_port() and bind: once more
        try:
            start = _spawn(spec, str(out))
            break
        except TimeoutError:
            raise
        except Exception:
            if attempt:
                raise
    dist_wall = time.perf_counter() - t0
    results = torch.load(out, weights_only=False)
    refs = {d: _simulate_reference(spec, d) for d in DIST_DENSE}
    ref = refs[DIST_DENSE[0]]
    ref_again = _simulate_reference(spec)
    repeat_diff = max(float((a - b).abs().max()) for a, b in zip(ref["params"], ref_again["params"]))
    summary = {"method": "alg1", "settings": " ".join(DIST_METHOD), "world": DIST_WORLD,
               "backend": "gloo", "device": spec["device"], "steps": spec["dist_steps"],
               "data": f"synthetic, {spec['dist_data'][0]} train images",
               "atol": spec["atol"], "simulation_syncs": ref["syncs"],
               "simulation_repeat_max_abs_diff": repeat_diff,
               "start_method": start, "processes_wall_s": dist_wall, "runs": {}}
    checks.expect(0 < ref["syncs"] < spec["dist_steps"],
                  f"distributed: the {spec['dist_steps']} steps did not see both coin outcomes "
                  f"({ref['syncs']} syncs)")
    ok = True
    for r in results:
        ref = refs[r["dense"]]
        verdict = compare(r, ref, spec["atol"])
        bitwise = all(torch.equal(a, b) for a, b in zip(r["params"], ref["params"]))
        finite_params = finite(r["params"])
        entry = {**verdict, "bitwise_equal": bitwise, "params_finite": finite_params,
                 "max_rank_diff": r["max_rank_diff"], "syncs": r["syncs"],
                 "collectives": r["collectives"], "backend": r["backend"],
                 "ledger": r["ledger"], "simulation_ledger": ref["ledger"],
                 "measured_bytes_per_worker": r["measured_bytes_per_worker"]}
        entry["ok"] = bool(verdict["ok"] and finite_params and r["max_rank_diff"] == 0.0
                           and r["syncs"] == ref["syncs"])
        ok &= checks.expect(entry["ok"],
                            f"distributed alg1 (dense {r['dense']}): max |param diff| "
                            f"{verdict['max_abs_param_diff']:.3g} (atol {spec['atol']}), ledgers "
                            f"equal {verdict['ledgers_equal']}, measured bytes = ledger "
                            f"{verdict['measured_bytes_equal_ledger']}, ranks agree "
                            f"{r['max_rank_diff'] == 0.0}, syncs {r['syncs']} vs {ref['syncs']}")
        summary["runs"][r["dense"]] = entry
    summary["ok"] = ok
    return summary


# ---------------------------------------------------------------- main

def machine(device: str) -> dict:
    info = {"host": platform.node(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads()}
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                    gpu_memory_gib=p.total_memory / 2**30, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), gpu_count=torch.cuda.device_count())
    return info


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when available, else report that no GPU was found and exit 0")
    p.add_argument("--tiny", action="store_true",
                   help="widths 8/16/16, 3 steps (1 warm-up), 6 distributed steps, a small dataset")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--steps", type=int, default=None, help="steps per method (20; --tiny: 3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed first steps of each method (5; --tiny: 1)")
    p.add_argument("--dist-steps", type=int, default=None, help="distributed steps (20; --tiny: 6)")
    p.add_argument("--widths", type=int, nargs=3, default=None,
                   help="channel widths (64 256 256; --tiny: 8 16 16)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (cuda: 4, cpu: 1)")
    p.add_argument("--synthetic", action="store_true", help="synthetic images even if CIFAR-10 is there")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--atol", type=float, default=1e-6, help="distributed vs simulation (as the tests)")
    p.add_argument("--dist-timeout", type=int, default=120, help="seconds for the gloo processes")
    p.add_argument("--no-dist", action="store_true", help="skip the distributed comparison")
    p.add_argument("--no-lm", action="store_true", help="skip the LM task's GPT")
    p.add_argument("--start-method", choices=["auto", "fork", "spawn"], default="auto",
                   help="how the gloo processes start (auto: fork on CPU, spawn with CUDA)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.device is None:
        if not torch.cuda.is_available():
            print("gpu_check: no GPU found (torch.cuda.is_available() is False): nothing was "
                  "checked, nothing written. Use --device cpu --tiny to exercise the checks on CPU.")
            return 0
        args.device = "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    spec = {"device": args.device,
            "widths": list(args.widths or (TINY_WIDTHS if args.tiny else PAPER_WIDTHS)),
            "batch_size": 16, "n_workers": 4,
            "steps": args.steps if args.steps is not None else (3 if args.tiny else 20),
            "warmup": args.warmup if args.warmup is not None else (1 if args.tiny else 5),
            "dist_steps": args.dist_steps if args.dist_steps is not None else (6 if args.tiny else 20),
            "delta_steps": 2 if args.tiny else 3,
            "threads": args.threads or (4 if args.device == "cuda" else 1),
            "eval_train": 64 if args.tiny else 2048,
            "dist_data": (256, 64) if args.tiny else (2048, 256),
            "dist_timeout": args.dist_timeout, "atol": args.atol,
            "start_method": args.start_method}
    spec["warmup"] = min(spec["warmup"], max(0, spec["steps"] - 1))
    torch.set_num_threads(spec["threads"])
    checks = Checks()
    report = {"status": "running", "device": args.device, "tiny": args.tiny,
              "machine": machine(args.device),
              "profile": {"name": "paper", "widths": spec["widths"], "batch_size": 16,
                          "n_workers": 4, "steps": spec["steps"], "warmup": spec["warmup"],
                          "amp": "bf16 autocast on CUDA (task.amp); CPU runs fp32"},
              "precision_settings": precision_settings()}
    print(f"gpu_check on {args.device}: widths {spec['widths']}, n = 4, batch 16, "
          f"{spec['steps']} steps per method", flush=True)

    data, note = find_data(args)
    data = on_device(data, args.device)
    report["data"] = {**data.info(), "note": note, "synthetic": data.source == "synthetic"}
    print(f"data: {note}", flush=True)

    report["methods"] = {}
    for name in args.methods:
        try:
            r = run_method(name, spec, data, checks)
        except Exception as err:
            r = checks.error(f"method {name}", err)
        report["methods"][name] = r
        if "steps_per_s" in r:
            print(f"  {name:10s} {r['steps_per_s']:8.2f} steps/s  loss {r['loss_start']:.4f} -> "
                  f"{r['loss_end']:.4f}  u=1 steps {r['syncs']}  ok {r['ok']}", flush=True)
    report["steps_per_s"] = {n: r.get("steps_per_s") for n, r in report["methods"].items()}

    try:
        report["delta"] = delta_check(spec, data, checks)
        d = report["delta"]
        print(f"  delta: bf16 rel err {d['rel_err_bf16_vs_fp32']:.3g} (RandK 1% noise "
              f"{d['randk_rel_noise_theory']:.3g}); methods' path == IEEE fp32: "
              f"{d['method_path_equals_fp32']}; gradient: bf16 rel err "
              f"{d['rel_err_bf16_grad']:.3g} vs sampling noise "
              f"{d['rel_sampling_noise_grad']:.3g}", flush=True)
    except Exception as err:
        report["delta"] = checks.error("delta", err)

    if args.no_dist:
        report["distributed"] = {"skipped": "--no-dist"}
    else:
        import tempfile
        try:
            with tempfile.TemporaryDirectory() as tmp:
                report["distributed"] = dist_check(spec, checks, Path(tmp))
            runs = report["distributed"]["runs"]
            print("  distributed alg1: " + ", ".join(
                f"{k}: max diff {v['max_abs_param_diff']:.2g}, ok {v['ok']}" for k, v in runs.items()),
                flush=True)
        except Exception as err:
            report["distributed"] = checks.error("distributed", err)

    if args.no_lm:
        report["lm"] = {"skipped": "--no-lm"}
    else:
        try:
            report["lm"] = lm_check(spec, args, checks)
        except Exception as err:
            report["lm"] = checks.error("lm", err)

    report["wall_s"] = time.perf_counter() - t_start
    report["failures"] = checks.failures
    report["status"] = "failed" if checks.failures else "ok"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {out} ({report['wall_s']:.0f} s)")
    if checks.failures:
        bar = "!" * 78
        print(f"\n{bar}\nGPU CHECK FAILED: {len(checks.failures)} problem(s)\n"
              + "\n".join(f"  - {f}" for f in checks.failures) + f"\n{bar}", file=sys.stderr)
        return 1
    print("GPU check passed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
