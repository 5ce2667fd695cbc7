"""How different the LM task's worker shards are (docs/lm.md): each worker's character-unigram
KL divergence to the whole training text, for every split.

    python -m scripts.analysis.lm_shards [--workers 4] [--out results/lm/shards.md]

KL(p_tau || p) = sum_c p_tau(c) log(p_tau(c) / p(c)), p_tau the characters' frequencies in the
text worker tau draws its windows from, p those of the whole training text
(:func:`experiments.tasks.shakespeare.unigram_kl`; every run records the same numbers in its
summary, ``shards``). For scale, the table adds the validation text's KL to the training text,
and the largest and smallest characters' frequency ratios of each shard.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from experiments.shared.files import atomic_write_text
from experiments.tasks.shakespeare import SPLITS, kl_table, load_text, unigram


def ratios(text, lo: int, hi: int, top: int = 3) -> str:
    """The characters whose frequency in [lo, hi) differs most from the training text's."""
    v = len(text.vocab)
    p, q = unigram(text.tokens[:text.n_train], v), unigram(text.tokens[lo:hi], v)
    common = [i for i in range(v) if p[i] > 1e-3]          # ratios of frequent characters only
    r = sorted(common, key=lambda i: float(q[i] / p[i]))
    show = lambda i: f"{text.vocab[i]!r} x{float(q[i] / p[i]):.2f}"
    return ", ".join(show(i) for i in r[-top:][::-1]) + "; " + ", ".join(show(i) for i in r[:top])


def report(workers: int) -> str:
    text = load_text()
    lines = [f"Character-unigram KL of each worker's text to the whole training text "
             f"({text.n_train:,} characters, the first 90% of Tiny Shakespeare), {workers} workers.",
             "", "| split | worker | characters [start, end) | KL (nats) | KL (bits) | "
             "most over-represented; most under-represented (frequency ratio) |",
             "|---|---:|---|---:|---:|---|"]
    for split in SPLITS:
        for r in kl_table(text, workers, split):
            lines.append(f"| {split} | {r['worker']} | {r['chars']:,} [{r['start']:,}, "
                         f"{r['end']:,}) | {r['kl_nats']:.4f} | {r['kl_bits']:.4f} | "
                         f"{ratios(text, r['start'], r['end']) if split != 'iid' else '-'} |")
    n = len(text.tokens)
    lines += ["", f"For scale: the validation text (the last 10%, {n - text.n_train:,} characters) "
              f"against the training text: {kl_val_to(text):.4f} nats. With iid every worker "
              "draws from the whole training text, so its KL is 0."]
    return "\n".join(lines) + "\n"


def kl_val_to(text) -> float:
    """KL(validation text's unigram || training text's), in nats."""
    v = len(text.vocab)
    p, q = unigram(text.tokens[:text.n_train], v), unigram(text.tokens[text.n_train:], v)
    m = q > 0
    return float((q[m] * (q[m] / p[m].clamp_min(1e-300)).log()).sum())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default="results/lm/shards.md")
    args = ap.parse_args(argv)
    text = report(args.workers)
    print(text)
    if args.out:
        atomic_write_text(Path(args.out), text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
