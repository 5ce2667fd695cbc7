"""Where a step of the language-model task goes on CPU, and what a run to an uplink budget costs.

    python -m scripts.bench.bench_lm [--steps 40] [--methods gluon alg1 alg2 ef21_muon ...]
                                     [--B 4 16] [--q 0.1] [--threads 1] [--out results/bench/lm.md]

Builds the lm task as ``python -m experiments.lm profile=lm/cpu`` does (the GPT of the CPU
profile on Tiny Shakespeare, n = 4 workers, one thread; ``--set task.n_embd=96 ...`` for another
shape) and times, inside every step: the gradient evaluations (forward + backward, what any
implementation must do), window sampling, compression + encoding, the averaging, the LMO update,
and the rest (momentum, bookkeeping). CPU time of this process (steadier than wall time on a
shared machine).

Steps of Alg. 1 and Alg. 2 come in two kinds, a synchronisation (u = 1: B minibatches a worker,
a dense message) and the others (Delta: two minibatch gradients, a compressed message); each is
timed on its own (the coin is set before the step), and a run's expected cost per unit of uplink
is ``(q t_sync + (1 - q) t_other) / (q c_sync + (1 - q) c_other)``, c the uplink of a step. The
projection adds the evaluation: a row (``loss`` and ``val_loss`` on the fixed windows) every
``--log-comm`` units and the full validation pass at the end. The table of budgets says which
uplink budget an Alg. 1 run at q and B fits in ``--minutes`` of one core.
"""
from __future__ import annotations

import argparse
import os
import platform
import time
import warnings

import itertools
import math

import torch
import yaml

from experiments.run.config import compose
from experiments.shared.files import REPO, publish
from experiments.shared.timing import Clock
from experiments.tasks import ResolvedConfig, lm, settings
from gluon import make_compressor
from gluon.engine import gradients_per_worker

SETTINGS = {            # compressor, and the settings each method takes besides lr and beta
    "gluon": ("identity", {}),
    "alg1": ("randk", {"q": True, "B": True}),
    "alg2": ("topk", {"q": True, "B": True}),
    "ef21_muon": ("topk", {}),
    "large_batch_gluon": ("identity", {"B": True}),
    "local_gluon": ("zero", {"q": True, "B": True}),
}
PARTS = ["gradients (fwd+bwd)", "sampling", "compression + encoding", "averaging", "LMO update",
         "step"]


def config(method: str, args, B: int):
    comp, takes = SETTINGS[method]
    over = [f"profile={args.profile}", f"method={method}", f"compressor={comp}", "method.lr=0.02",
            "method.beta=0.9", "steps=100000", f"threads={args.threads}", *args.set]
    if comp in ("randk", "topk"):
        over.append(f"compressor.density={args.density}")
    over += [f"method.{k}={v}" for k, v in (("q", args.q), ("B", B)) if k in takes]
    return ResolvedConfig.of(compose("lm", *over)).cfg


def bench(method_name: str, args, B: int) -> dict:
    cfg = config(method_name, args, B)
    torch.set_num_threads(args.threads)
    compressor = make_compressor(cfg.compressor.name, **settings(cfg.compressor))
    built = lm.build(cfg, compressor)
    method = built.method
    clock = Clock()
    for o in {id(w.oracle): w.oracle for w in method.workers}.values():
        o.grad = clock.wrap(PARTS[0], o.grad)
        o.sample = clock.wrap(PARTS[1], o.sample)
    method.send = clock.wrap(PARTS[2], method.send)
    method.comm.average = clock.wrap(PARTS[3], method.comm.average)
    method.update = clock.wrap(PARTS[4], method.update)
    step = clock.wrap(PARTS[5], method.step)
    kinds = [True, False] if "q" in SETTINGS[method_name][1] else [None]
    out = {"method": method_name, "B": B if "B" in SETTINGS[method_name][1] else None,
           "n_params": built.summary["n_params"], "kinds": {}}
    for u in kinds:
        n = max(2, args.steps // 4) if u else args.steps
        for i in range(args.warmup + n):
            if i == args.warmup:
                clock.reset()
                c0, cost0, k0 = time.process_time(), method.comm.ledger.cost, method.k
                g0 = gradients_per_worker(method)
            if u is not None:
                method.u = u
            step()
        steps = method.k - k0
        out["kinds"][u] = {"steps": steps, "cpu": (time.process_time() - c0) / steps,
                           "uplink": (method.comm.ledger.cost - cost0) / steps,
                           "grads": (gradients_per_worker(method) - g0) / steps,
                           "parts": {k: v / steps for k, v in clock.cpu.items()}}
    c0 = time.process_time()
    for _ in range(3):
        built.evaluate.loss(*built.evaluate.train)
        built.evaluate.loss(*built.evaluate.val)
    out["row"] = (time.process_time() - c0) / 3
    c0 = time.process_time()
    built.evaluate.loss(*built.evaluate.full)
    out["full"] = time.process_time() - c0
    return out


def workers_batched(args, repeats: int = 10) -> str:
    """A speed idea, probed before building it: the n workers evaluate their gradients at the
    same X, so one vmap over the workers' minibatches (torch.func) could replace n calls. CPU ms
    for the n gradients: one after another (as the study runs), vmapped, and one batch of n
    minibatches (the mean gradient only: the floor any batching could reach)."""
    from torch.func import grad, vmap
    torch.set_num_threads(args.threads)
    built = lm.build(config("gluon", args, None), make_compressor("identity"))
    method = built.method
    oracles = [w.oracle for w in method.workers]
    gen = torch.Generator().manual_seed(0)
    batches = [o.sample(gen) for o in oracles]
    o = oracles[0]
    o.model.train()
    xs, ys = torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches])
    g = grad(lambda p, x, y: o._loss(p, (x, y, None)))
    ways = {"one after another": lambda: [w.grad(method.params, b) for w, b in zip(oracles, batches)],
            "vmap over the workers": lambda: vmap(g, in_dims=(None, 0, 0))(method.params, xs, ys),
            "one batch of all (the floor)": lambda: g(method.params, xs.flatten(0, 1),
                                                       ys.flatten(0, 1))}
    with warnings.catch_warnings():     # torch's note that vmap falls back: what is measured
        warnings.filterwarnings("ignore", message="There is a performance drop")
        one, batched = ways["one after another"](), ways["vmap over the workers"]()
        for i, gi in enumerate(one):        # the batched gradients are the workers' own
            for a, b in zip(gi, batched):
                torch.testing.assert_close(b[i], a, rtol=1e-4, atol=1e-6)
        ms = {}
        for name, f in ways.items():
            f()
            c0 = time.process_time()
            for _ in range(repeats):
                f()
            ms[name] = 1e3 * (time.process_time() - c0) / repeats
    return (f"The {len(oracles)} workers' gradients at one X, CPU ms (mean of {repeats}): "
            + "; ".join(f"{k} {v:.1f}" for k, v in ms.items()) + ".")


def per_step(r: dict, q: float, key: str) -> float:
    """CPU seconds ("cpu"), uplink ("uplink") or gradients per worker ("grads") a step, in
    expectation over the coin."""
    k = r["kinds"]
    if None in k:
        return k[None][key]
    return q * k[True][key] + (1 - q) * k[False][key]


def minutes(r: dict, q: float, budget: float, log_comm: float, cap: dict | None = None) -> float:
    """A run to ``budget`` units of uplink (or, with ``cap``, the result of the run whose
    gradient evaluations per worker stop it: EF21-Muon's at Alg. 1's): its steps, a row every
    ``log_comm`` units, the full validation pass; CPU minutes."""
    steps = budget / per_step(r, q, "uplink")
    if cap is not None:
        steps = budget / per_step(cap, q, "uplink") * per_step(cap, q, "grads") / per_step(r, q, "grads")
    uplink = steps * per_step(r, q, "uplink")
    return (steps * per_step(r, q, "cpu") + (uplink / log_comm + 1) * r["row"] + r["full"]) / 60


STUDY = REPO / "configs" / "experiment" / "lm"


def grid(method: str) -> list[dict]:
    """The runs of configs/experiment/lm/tune_<method>.yaml on one split, and of the grids that
    extend it at its edges (tune_<method>_*.yaml, whose defaults name it and whose swept keys
    replace its own): one dict of the swept keys per run (comma lists expanded, as hydra's basic
    sweeper does)."""
    def load(path) -> dict:
        return yaml.safe_load(path.read_text())

    base = load(STUDY / f"tune_{method}.yaml")["hydra"]["sweeper"]["params"]
    extensions = (load(p) for p in sorted(STUDY.glob(f"tune_{method}_*.yaml")))
    grids = [base] + [{**base, **y["hydra"]["sweeper"]["params"]} for y in extensions
                      if f"/experiment/lm/tune_{method}" in (y.get("defaults") or [])]
    runs = []
    for params in grids:
        keys = list(params)
        values = [str(params[k]).split(",") for k in keys]
        runs += [dict(zip(keys, combo)) for combo in itertools.product(*values)]
    return runs


def study(results: list[dict], q: float, log_comm: float) -> str:
    """The whole LM study from scratch (make lm-runs: every tuning grid and the 5-seed panel, on
    each split) priced by this bench's CPU costs: CPU hours of one core, and hours on the 2-core
    machine running two runs at a time. A B the bench did not time is priced at the nearest B it
    did; the panel takes each method at the largest B of its grid (an upper bound, the tuned B
    being unknown before the tuning); EF21-Muon runs to Alg. 1's gradient evaluations at that B."""
    budget = yaml.safe_load((STUDY / "_budget.yaml").read_text())["max_comm"]
    panel = yaml.safe_load((STUDY / "panel_iid.yaml").read_text())["hydra"]["sweeper"]["params"]
    seeds = len(str(panel["seed"]).split(","))
    at = {(r["method"], r["B"]): r for r in results}
    timed = sorted({r["B"] for r in results if r["B"]})

    def cost(method: str, B) -> float:
        B = None if method not in ("alg1", "alg2", "large_batch_gluon", "local_gluon") else \
            min(timed, key=lambda b: abs(math.log(int(B) / b)))
        cap = at[("alg1", max(timed))] if method == "ef21_muon" else None
        return minutes(at[(method, B)], q, budget, log_comm, cap)

    rows, total = [], 0.0
    for m in SETTINGS:
        runs = grid(m)
        Bs = [r.get("method.B") for r in runs]
        tune = sum(cost(m, B or max(timed)) for B in Bs)
        pan = seeds * cost(m, max((int(B) for B in Bs if B), default=max(timed)))
        total += tune + pan
        rows.append(f"| {m} | {len(runs)} | {tune / 60:.1f} | {seeds} | {pan / 60:.1f} |")
    splits = 2
    return ("\nThe study from scratch (`make lm-runs`, the grids of configs/experiment/lm/ on each of "
            f"{splits} splits, a budget of {budget:g} units; the panel at each grid's largest B, an upper "
            "bound; the grids extended at their edges included):\n\n| method | tuning runs per split | tuning, CPU hours | panel seeds | "
            "panel, CPU hours |\n|---|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
            f"Per split {total / 60:.1f} CPU hours; both splits {splits * total / 60:.1f} hours of "
            f"one core, **{splits * total / 120:.1f} hours on 2 cores** (two runs at a time).\n")


def name(r: dict) -> str:
    return r["method"] + (f", B = {r['B']}" if r["B"] else "")


def report(results: list[dict], args) -> str:
    load = "load %.1f/%.1f/%.1f" % os.getloadavg()
    head = (f"LM task, profile {' '.join([args.profile, *args.set])} ({results[0]['n_params']:,} "
            f"parameters), n = 4 workers, q = {args.q}, RandK/TopK density {args.density}, "
            f"{args.threads} thread(s); {platform.processor() or platform.machine()} "
            f"({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores, {load}, "
            f"torch {torch.__version__}. CPU time of this process.\n")
    lines = ["| method | step kind | steps timed | CPU ms/step | uplink/step | gradients | "
             "sampling | compression | averaging | LMO | rest |", "|---|---|---:|---:|---:|"
             + "---:|" * 6]
    for r in results:
        for u, k in r["kinds"].items():
            kind = {True: "sync (u = 1)", False: "other (u = 0)", None: "every step"}[u]
            parts = [1e3 * k["parts"].get(p, 0.0) for p in PARTS]
            lines.append(f"| {name(r)} | {kind} | {k['steps']} | {1e3 * k['cpu']:.1f} | "
                         f"{k['uplink']:.4f} | " + " | ".join(f"{p:.1f}" for p in parts) + " |")
    r0 = results[0]
    ev = (f"\nEvaluation: one row (loss and val_loss on the fixed windows) {1e3 * r0['row']:.0f} ms "
          f"of CPU, the full validation pass {r0['full']:.1f} s.\n")
    budgets = list(range(200, 501, 50))
    proj = ["| method | CPU s per unit of uplink | gradients per worker per unit | "
            + " | ".join(f"{b} units" for b in budgets) + " |",
            "|---|---:|---:|" + "---:|" * len(budgets)]
    fits = [r for r in results if r["method"] == "alg1" and r["B"] == max(args.B)]
    for r in results:
        cap = fits[0] if r["method"] == "ef21_muon" and fits else None
        c = per_step(r, args.q, "uplink")
        proj.append(f"| {name(r)}{' (*)' if cap else ''} | {per_step(r, args.q, 'cpu') / c:.2f} | "
                    f"{per_step(r, args.q, 'grads') / c:.1f} | " + " | ".join(
                        f"{minutes(r, args.q, b, args.log_comm, cap):.1f}" for b in budgets) + " |")
    if fits and "ef21_muon" in [r["method"] for r in results]:
        proj.append(f"\n(*) EF21-Muon sends 1% a step, so it runs, as in the study, to Alg. 1's "
                    f"(B = {max(args.B)}) gradient evaluations per worker at each budget, not to the "
                    "budget's uplink.")
    verdict = ""
    if fits:
        ok = [b for b in budgets if minutes(fits[0], args.q, b, args.log_comm) <= args.minutes]
        verdict = (f"\nAn Alg. 1 run at q = {args.q}, B = {max(args.B)} fits in {args.minutes:g} "
                   f"minutes of one core up to a budget of "
                   f"{max(ok) if ok else 'none of these'} units (of {', '.join(map(str, budgets))}).\n")
    return (head + "\n" + "\n".join(lines) + "\n" + ev + f"\nProjected CPU minutes of one run to "
            f"each uplink budget (q = {args.q}; a row every {args.log_comm:g} units, the full "
            "validation pass at the end):\n\n" + "\n".join(proj) + "\n" + verdict
            + (study(results, args.q, args.log_comm) if set(SETTINGS) <= {r["method"] for r in
                                                                           results} else ""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--B", type=int, nargs="+", default=[4, 16],
                   help="B of the methods that take one (each value a row)")
    p.add_argument("--q", type=float, default=0.1)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=40, help="steps timed per kind (syncs: a quarter)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", default="lm/cpu")
    p.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. task.n_embd=96")
    p.add_argument("--log-comm", type=float, default=2.0, help="units of uplink between rows")
    p.add_argument("--minutes", type=float, default=30.0, help="the time a run may take")
    p.add_argument("--out", default="results/bench/lm.md", help="the markdown report ('': none)")
    p.add_argument("--probe-vmap", action="store_true",
                   help="only time the workers' gradients batched with vmap against one by one")
    args = p.parse_args(argv)
    if args.probe_vmap:
        print(workers_batched(args))
        return
    results = []
    for m in args.methods:
        for B in (args.B if "B" in SETTINGS[m][1] else [None]):
            results.append(bench(m, args, B))
            print(f"{name(results[-1])}: done", flush=True)
    text = report(results, args)
    publish(text, args.out)


if __name__ == "__main__":
    main()
