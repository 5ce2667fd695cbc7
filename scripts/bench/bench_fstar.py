"""How long f* takes on a5a with 1, 2, ... BLAS threads (numpy's, which the solver uses).

    python -m scripts.bench.bench_fstar [--repeats 3] [--out results/bench/fstar.md]

f* is solved once per data version and split, by the first run that needs it
(:func:`experiments.tasks.logreg.solve_f_star`: about 2,300 iterations of two matrix-vector
products with the 6,414 x 124 float64 data). A run limits numpy's BLAS to its ``threads``
setting (1); this script times the solve at each thread count up to the machine's cores, best
of ``--repeats``, and says whether the value is the same to the last bit.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

from threadpoolctl import threadpool_info, threadpool_limits

from experiments.shared.files import publish
from experiments.tasks import libsvm_file
from experiments.tasks.logreg import load_libsvm, solve_f_star

L2 = 1e-4    # a5a's regularisation (configs/task/logreg.yaml)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    A, b = load_libsvm(libsvm_file("a5a", download=False))
    blas = next((p for p in threadpool_info() if p["user_api"] == "blas"), {})
    rows = []
    for threads in range(1, (os.cpu_count() or 1) + 1):
        with threadpool_limits(threads, user_api="blas"):
            best, info = float("inf"), None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                info, _ = solve_f_star(A, b, L2)
                best = min(best, time.perf_counter() - t0)
        rows.append((threads, best, info["iterations"], info["f_star"]))
    lines = [f"f* on a5a ({A.shape[0]} x {A.shape[1]}, l2 = {L2:g}), best of {args.repeats}; "
             f"{platform.machine()}, {os.cpu_count()} cores, {blas.get('internal_api', '?')} "
             f"{blas.get('version', '')}", "",
             "| BLAS threads | seconds | iterations | f* | same bits as 1 thread |",
             "|---|---|---|---|---|"]
    for threads, s, it, f in rows:
        lines.append(f"| {threads} | {s:.2f} | {it} | {f!r} | {'yes' if f == rows[0][3] else 'no'} |")
    publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
