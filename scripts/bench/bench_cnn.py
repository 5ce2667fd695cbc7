"""Where a step of the CNN experiment goes on CPU: each method against the gradients it must compute.

    python -m scripts.bench.bench_cnn [--steps 200] [--methods gluon alg1 ...] [--threads 1]
                                [--widths 16 64 64] [--out results/bench/cnn.md]
    python -m scripts.bench.bench_cnn --paths ...                  # reference vs CPU fast path
    python -m scripts.bench.bench_cnn --chunks 1024 256 --B 64 ... # large-batch gradient by max_chunk

Builds the CIFAR-10 task as ``experiments.cnn`` does at the CPU profile by default (airbench94
with widths 16/64/64, n = 4 workers, batch 16, one thread, LMOs assigned by the Scion rule;
``--widths 64 256 256`` for the paper network) on random uint8 images (the timing does not
depend on the pixels; ``--real`` uses the dataset), runs each method that ``make fig-cost``
re-costs (the Fig. 2 CNN panel's gluon, alg1 RandK 1 %, alg2 TopK 1 %, ef21_muon TopK 1 %, and
the fair panel's large-batch Gluon and Local Gluon, docs/fair.md; q = 0.1, B = 4, lr 0.05,
beta 0.9) for ``--steps`` steps after ``--warmup`` steps, and times, inside every step: the gradient
evaluations (forward + backward, what any implementation must do), minibatch sampling and
augmentation, compression + encoding, the averaging, the LMO update, and the rest (momentum,
bookkeeping). The overhead is everything but the gradients and the sampling: the summary gives
it as a share of the step, the detail tables also as a fraction of the gradient time (target:
under 15%). Times are wall-clock and process CPU time; on a shared machine the CPU time is the
steadier one (shares are of CPU time). Prints and writes (``--out``) a markdown table headed by
the machine line.
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from collections import defaultdict

import torch

from experiments.shared.configs import cnn_widths
from experiments.tasks.cifar10 import Cifar
from experiments.tasks.cnn import build, cpu_has_native_bf16
from experiments.shared.files import atomic_write_text, publish
from experiments.run.config import compose, validate
from experiments.shared.timing import Clock
from experiments.tasks import ResolvedConfig


CPU_WIDTHS = cnn_widths("cpu")
COSTED = ["gluon", "large_batch_gluon", "alg1", "alg2", "local_gluon", "ef21_muon"]  # make fig-cost's
# compressor and the hyperparameters each method takes besides lr and beta
SETTINGS = {
    "gluon": ({"name": "identity"}, {}),
    "large_batch_gluon": ({"name": "identity"}, {"B": True}),
    "local_gluon": ({"name": "zero"}, {"q": True, "B": True}),
    "alg1": ({"name": "randk", "density": 0.01}, {"q": True, "B": True}),
    "alg2": ({"name": "topk", "density": 0.01}, {"q": True, "B": True}),
    "ef21_muon": ({"name": "topk", "density": 0.01}, {}),
    "alg3": ({"name": "randk", "density": 0.01}, {"q": True, "B": True}),
    "alg4": ({"name": "topk", "density": 0.01}, {"q": True, "B": True}),
    "vr_marina": ({"name": "randk", "density": 0.01}, {"q": True}),
}


def has_syncs(method: str) -> bool:
    """Whether the method's steps differ by u (a sync with probability q): those take q."""
    return "q" in SETTINGS[method][1]


def config(method: str, steps: int, threads: int, q: float, B: int, widths=CPU_WIDTHS,
           amp_cpu: bool = False):
    """The config ``python -m experiments.cnn`` would run for ``method`` at these settings, with
    small evaluation sets (the benchmark times steps, not evaluations)."""
    comp, takes = SETTINGS[method]
    overrides = [f"method={method}", f"compressor={comp['name']}", "method.lr=0.05",
                 "method.beta=0.9", f"steps={steps}", f"log_every={steps}", f"eval_every={steps}",
                 "device=cpu", f"threads={threads}", f"task.widths=[{','.join(map(str, widths))}]",
                 "task.eval_train=64", "task.eval_test=64", "task.source=auto",
                 f"task.amp_cpu={str(bool(amp_cpu)).lower()}"]
    overrides += [f"compressor.{k}={v}" for k, v in comp.items() if k != "name"]
    overrides += [f"method.{k}={v}" for k, v in (("q", q), ("B", B)) if k in takes]
    return ResolvedConfig.of(compose("cnn", *overrides)).cfg


def random_data(n_train=4096, n_test=256, seed=0) -> Cifar:
    g = torch.Generator().manual_seed(seed)
    return Cifar(torch.randint(0, 256, (n_train, 3, 32, 32), dtype=torch.uint8, generator=g),
                 torch.randint(0, 10, (n_train,), generator=g),
                 torch.randint(0, 256, (n_test, 3, 32, 32), dtype=torch.uint8, generator=g),
                 torch.randint(0, 10, (n_test,), generator=g), [str(i) for i in range(10)],
                 "random", "random uint8 images")


def bench(method_name: str, args, amp_cpu: bool = False) -> dict:
    cfg = config(method_name, args.steps, args.threads, args.q, args.B, args.widths, amp_cpu)
    torch.set_num_threads(args.threads)
    compressor = validate(cfg)
    built = build(cfg, compressor, data=None if args.real else random_data())

    method, extra = built.method, built.summary
    clock = Clock()
    for o in {id(w.oracle): w.oracle for w in method.workers}.values():
        o.grad = clock.wrap("gradients (fwd+bwd)", o.grad)
        o.sample = clock.wrap("sampling + augmentation", o.sample)
    method.send = clock.wrap("compression + encoding", method.send)
    method.comm.average = clock.wrap("averaging", method.comm.average)
    method.update = clock.wrap("LMO update", method.update)
    step = clock.wrap("step", method.step)
    for _ in range(args.warmup):
        step()
    clock.reset()
    k0, syncs = method.k, 0
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        syncs += bool(method.u)
        step()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    n = method.k - k0
    return {"method": method_name, "steps": n, "syncs": syncs, "wall": wall / n, "cpu": cpu / n,
            "n_params": extra["n_params"], "data": extra["data"],
            "parts_wall": {k: v / n for k, v in clock.wall.items()},
            "parts_cpu": {k: v / n for k, v in clock.cpu.items()}}


ORDER = ["gradients (fwd+bwd)", "sampling + augmentation", "compression + encoding", "averaging",
         "LMO update", "step"]


def table(r: dict) -> str:
    """A method's parts per step; the shares of the gradients are "-" where it evaluated none
    (Local Gluon between syncs)."""
    g_w = r["parts_wall"].get("gradients (fwd+bwd)", 0.0)
    g_c = r["parts_cpu"].get("gradients (fwd+bwd)", 0.0)
    pct = lambda x, g: f"{100 * x / g:.1f}%" if g > 0 else "-"
    lines = ["| part | wall ms/step | CPU ms/step | CPU % of gradients |", "|---|---:|---:|---:|"]
    for k in ORDER:
        label = "rest (momentum, bookkeeping)" if k == "step" else k
        w, c = r["parts_wall"].get(k, 0.0), r["parts_cpu"].get(k, 0.0)
        lines.append(f"| {label} | {1e3 * w:.1f} | {1e3 * c:.1f} | {pct(c, g_c)} |")
    lines.append(f"| **whole step** | **{1e3 * r['wall']:.1f}** | **{1e3 * r['cpu']:.1f}** | |")
    over_w = r["wall"] - g_w - r["parts_wall"].get("sampling + augmentation", 0.0)
    over_c = r["cpu"] - g_c - r["parts_cpu"].get("sampling + augmentation", 0.0)
    lines.append(f"| **overhead** (step - gradients - sampling) | {1e3 * over_w:.1f} | "
                 f"{1e3 * over_c:.1f} | **{pct(over_c, g_c)}** (wall {pct(over_w, g_w)}) |")
    return "\n".join(lines)


SHORT = {"gradients (fwd+bwd)": "gradients", "sampling + augmentation": "sampling",
         "compression + encoding": "compression", "averaging": "averaging",
         "LMO update": "LMO", "step": "rest"}


def shares(r: dict) -> dict:
    """Each part's share of the step's CPU time, and the overhead: everything outside the
    gradient evaluations and the sampling (compression, averaging, LMO, rest)."""
    out = {SHORT[k]: r["parts_cpu"].get(k, 0.0) / r["cpu"] for k in ORDER}
    out["overhead"] = sum(out[k] for k in ("compression", "averaging", "LMO", "rest"))
    return out


def summary(results: list[dict]) -> str:
    cols = list(SHORT.values())
    lines = ["| method | steps (u = 1) | ms/step (wall) | ms/step (CPU) | "
             + " | ".join(cols) + " | **outside gradients + sampling** |",
             "|---|---:|---:|---:|" + "---:|" * (len(cols) + 1)]
    for r in results:
        sh = shares(r)
        u = f" ({r['syncs']})" if has_syncs(r["method"]) else ""
        lines.append(f"| {r['method']} | {r['steps']}{u} | {1e3 * r['wall']:.1f} | "
                     f"{1e3 * r['cpu']:.1f} | " + " | ".join(f"{100 * sh[c]:.0f}%" for c in cols)
                     + f" | **{100 * sh['overhead']:.1f}%** |")
    return "\n".join(lines)


def cpu_features() -> str:
    """The CPU's vector capability and whether it has native bf16: the fast path depends on it."""
    return (f"{torch.backends.cpu.get_cpu_capability()}, native bf16 "
            f"{'yes' if cpu_has_native_bf16() else 'no'}")


def machine_line(args, n_params: int | None) -> str:
    load = ", load %.1f/%.1f/%.1f" % os.getloadavg() if hasattr(os, "getloadavg") else ""
    w = "/".join(map(str, args.widths))
    profile = "CPU profile" if list(args.widths) == CPU_WIDTHS else "custom widths"
    params = f", {n_params:,} parameters" if n_params else ""
    return (f"CIFAR-10 airbench94 {profile} (widths {w}{params}), n = 4 workers, batch 16, "
            f"q = {args.q}, B = {args.B}, RandK/TopK 1%, lr 0.05, beta 0.9, "
            f"{'CIFAR-10' if args.real else 'random uint8 images'}; {args.steps} steps after "
            f"{args.warmup} warm-up, {args.threads} thread(s); "
            f"{platform.processor() or platform.machine()} ({cpu_features()}), "
            f"{os.cpu_count()} cores{load}, "
            f"torch {torch.__version__}")


PATH_WIDTHS = (cnn_widths("cpu"), cnn_widths("paper"))


def bench_together(name: str, sub, amp: bool, copies: int) -> dict:
    """``bench`` in ``copies`` processes at once (the way a sweep's runs share the cores), means
    of their CPU and wall ms per step; one copy: in this process."""
    if copies == 1:
        return bench(name, sub, amp_cpu=amp)
    from multiprocessing import get_context
    with get_context("spawn").Pool(copies) as pool:
        rs = pool.starmap(bench, [(name, sub, amp)] * copies)     # bench sets its threads
    return {**rs[0], "cpu": sum(r["cpu"] for r in rs) / copies,
            "wall": sum(r["wall"] for r in rs) / copies}


def compare_paths(args) -> str:
    """CPU and wall ms per step of each method on the reference path (fp32) and on the fast path
    (``task.amp_cpu``: bf16 autocast for gradients and evaluation, Delta in fp32), at the CPU
    profile's widths and at the paper's (``--path-widths``). The two paths alternate per width
    so that a change in the machine's load hits both; ``--concurrent 2`` runs two copies of
    each measurement at once, as two runs of a sweep share a 2-core machine (the wall time is
    then what a run sees)."""
    lines = ["| widths | method | syncs in steps | reference ms/step (CPU) | fast ms/step (CPU) | "
             "speed-up (CPU) | reference ms/step (wall) | fast ms/step (wall) | speed-up (wall) | "
             "gradients' share (reference) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for widths in args.path_widths or PATH_WIDTHS:
        sub = argparse.Namespace(**{**vars(args), "widths": widths,
                                    "steps": args.path_steps or (60 if widths == CPU_WIDTHS else 12)})
        for name in args.methods:
            ref = bench_together(name, sub, False, args.concurrent)
            fast = bench_together(name, sub, True, args.concurrent)
            share = ref["parts_cpu"]["gradients (fwd+bwd)"] / ref["cpu"]
            lines.append(f"| {'/'.join(map(str, widths))} | {name} | {ref['syncs']} in {ref['steps']} | "
                         f"{1e3 * ref['cpu']:.1f} | {1e3 * fast['cpu']:.1f} | "
                         f"{ref['cpu'] / fast['cpu']:.2f}x | {1e3 * ref['wall']:.1f} | "
                         f"{1e3 * fast['wall']:.1f} | {ref['wall'] / fast['wall']:.2f}x | "
                         f"{100 * share:.0f}% |")
            print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def compare_chunks(args) -> str:
    """CPU seconds of one large-batch gradient (Alg. 1/2's g on a sync: ``--B`` minibatches of
    16 at one point) by ``task.max_chunk``, the most images per forward pass, at ``--widths``.
    The chunk sizes alternate over ``--rounds`` rounds so that a change in the machine's load
    hits all of them; the median round is reported. With ghost-batch BN every chunking computes
    the same mean gradient (to float rounding)."""
    cfg = config("alg1", 1, args.threads, args.q, args.B, args.widths)
    torch.set_num_threads(args.threads)
    built = build(cfg, validate(cfg), data=None if args.real else random_data())
    method = built.method
    oracle = method.workers[0].oracle
    batch = oracle.sample(torch.Generator().manual_seed(0), args.B)
    times: dict[int, list[float]] = defaultdict(list)
    oracle.grad(method.params, batch)                       # warm-up
    for _ in range(args.rounds):
        for chunk in args.chunks:
            oracle.max_chunk = max(16, chunk // 16 * 16)
            c0 = time.process_time()
            oracle.grad(method.params, batch)
            times[chunk].append(time.process_time() - c0)
    med = {c: sorted(v)[len(v) // 2] for c, v in times.items()}
    ref = med[args.chunks[0]]
    lines = [f"| widths | B (images) | max_chunk | CPU s per large-batch gradient (median of "
             f"{args.rounds}) | vs {args.chunks[0]} |", "|---|---|---:|---:|---:|"]
    for c in args.chunks:
        lines.append(f"| {'/'.join(map(str, args.widths))} | {args.B} ({16 * args.B}) | {c} | "
                     f"{med[c]:.2f} | {ref / med[c]:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=COSTED, choices=list(SETTINGS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--widths", type=int, nargs=3, default=CPU_WIDTHS,
                   help="channel widths of the three conv groups (paper network: 64 256 256)")
    p.add_argument("--q", type=float, default=0.1)
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--real", action="store_true", help="use CIFAR-10 instead of random images")
    p.add_argument("--out", default="results/bench/cnn.md", help="the markdown table ('' : none)")
    p.add_argument("--paths", action="store_true",
                   help="instead: reference vs fast path (task.amp_cpu), ms per step at both widths")
    p.add_argument("--path-steps", type=int, default=0, help="steps per path (0: 60 / 12 by width)")
    p.add_argument("--path-widths", type=int, nargs=3, action="append", default=None,
                   help="--paths at these widths (repeatable; default: 16 64 64 and 64 256 256)")
    p.add_argument("--concurrent", type=int, default=1,
                   help="--paths: copies of each measurement run at once (2: as a sweep's two "
                        "runs share 2 cores)")
    p.add_argument("--chunks", type=int, nargs="+", default=None,
                   help="instead: CPU time of one large-batch gradient (--B minibatches) by "
                        "task.max_chunk, e.g. --chunks 1024 512 256 128")
    p.add_argument("--rounds", type=int, default=5, help="rounds of --chunks")
    args = p.parse_args(argv)
    if args.chunks or args.paths:
        machine = (f"{args.threads} thread(s), random uint8 images; "
                   f"{platform.processor() or platform.machine()} ({cpu_features()}), "
                   f"{os.cpu_count()} cores, load %.1f/%.1f/%.1f, torch {torch.__version__}"
                   % os.getloadavg())
        if args.chunks:
            text = (f"One large-batch gradient by `task.max_chunk` (images per forward pass), "
                    f"{machine}\n\n" + compare_chunks(args))
        else:
            together = (f"; {args.concurrent} copies of each measurement at once (means)"
                        if args.concurrent > 1 else "")
            text = (f"Reference (fp32) vs fast path (`task.amp_cpu=true`: bf16 autocast on CPU "
                    f"for gradients and evaluation; Delta stays fp32), n = 4, batch 16, "
                    f"q = {args.q}, B = {args.B}, RandK/TopK 1%, {machine}{together}\n\n"
                    + compare_paths(args))
        publish(text, args.out)
        return
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU, airbench94 widths "
          f"{args.widths}, n = 4, batch 16, q = {args.q}, B = {args.B}, density 1%\n")
    results, details = [], []
    for name in args.methods:
        r = bench(name, args)
        results.append(r)
        u = f" ({r['syncs']} with u = 1)" if has_syncs(name) else ""
        details.append(f"### {name}: {r['steps']} steps{u}\n\n{table(r)}\n")
        print(details[-1], flush=True)
    n_params = results[0]["n_params"] if results else None
    head = (machine_line(args, n_params) + "\n\nShares are of the step's CPU time; "
            "**outside gradients + sampling** = compression + averaging + LMO + rest.\n\n"
            + summary(results) + "\n")
    print(head)
    text = head + "\n" + "\n".join(details)
    if args.out:
        atomic_write_text(args.out, text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
