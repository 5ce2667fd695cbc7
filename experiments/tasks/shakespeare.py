"""Tiny Shakespeare for the character-level language model: finding it, knowing it, cutting it.

The text is the one nanoGPT's ``shakespeare_char`` example and char-rnn use (1,115,394
characters, 65 distinct), ``text/tinyshakespeare.txt`` under a data directory (searched as in
:mod:`experiments.tasks`: ``data_dir``, ``GLUON_DATA_DIR``, ``./data``, ``../shared/data``).
Where it is nowhere and downloading is allowed, it is fetched from :data:`URL` into the first
data directory; the bytes are checked against :data:`SHA256` before anything is written. A file
on disk must match :data:`SHA256` too (and a ``SHA256SUMS`` beside it, where one lists it).

The vocabulary is the sorted set of the text's characters; as in nanoGPT, the first 90% of the
characters train and the last 10% validate (:func:`train_size`). The workers' data
(``task.split``, :func:`shard_ranges`):

* ``iid``: every worker draws its windows from the whole training text;
* ``plays``: worker tau owns the tau-th of ``n_workers`` contiguous, equal parts of the training
  text (the remainder of the division is not used), so each sees other plays and speakers.

A window is ``block_size + 1`` consecutive characters inside one range (input and next-character
targets), so no window crosses from the training text into the validation text or from one
worker's part into another's. :func:`unigram_kl` says how different the parts are.
"""
from __future__ import annotations

import hashlib
import math
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from experiments.shared.files import atomic_write
from . import DataCorruptError, DataNotFoundError, candidate_dirs, verify

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
RELPATH = "text/tinyshakespeare.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
CHARS = 1_115_394              # the text's length, known with its hash (checks before any data)
TRAIN_FRACTION = 0.9           # nanoGPT's: the first 90% train, the rest validates
SPLITS = ("iid", "plays")
LABEL = "Tiny Shakespeare (char-rnn's input.txt)"


def train_size(chars: int = CHARS) -> int:
    """Characters of the training text (nanoGPT's ``int(n * 0.9)``)."""
    return int(chars * TRAIN_FRACTION)


def shard_ranges(n_train: int, n_workers: int, split: str) -> list[tuple[int, int]]:
    """[lo, hi) of the training text each worker draws its windows from (see the module
    docstring)."""
    if split == "iid":
        return [(0, n_train)] * n_workers
    if split == "plays":
        size = n_train // n_workers
        return [(r * size, (r + 1) * size) for r in range(n_workers)]
    raise ValueError(f"task.split={split}: choose one of {', '.join(SPLITS)}")


def window_starts(lo: int, hi: int, block_size: int, count: int, gen: torch.Generator) -> Tensor:
    """``count`` uniform starts of windows of ``block_size + 1`` characters inside [lo, hi)."""
    return lo + torch.randint(hi - lo - block_size, (count,), generator=gen)


def windows(tokens: Tensor, starts: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Inputs ``tokens[s:s+T]`` and targets ``tokens[s+1:s+T+1]`` for every start s."""
    idx = starts.to(tokens.device)[:, None] + torch.arange(block_size + 1, device=tokens.device)
    w = tokens[idx]
    return w[:, :-1], w[:, 1:]


def unigram(tokens: Tensor, vocab: int) -> Tensor:
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    return counts / counts.sum()


def unigram_kl(tokens: Tensor, ranges: list[tuple[int, int]], vocab: int) -> list[float]:
    """KL(p_tau || p) in nats for every range tau: p_tau its characters' unigram distribution,
    p that of the union of the ranges (the whole training text that the workers share)."""
    whole = torch.cat([tokens[lo:hi] for lo, hi in dict.fromkeys(ranges)])
    p = unigram(whole, vocab)
    out = []
    for lo, hi in ranges:
        q = unigram(tokens[lo:hi], vocab)
        m = q > 0
        out.append(float((q[m] * (q[m] / p[m]).log()).sum()))
    return out


@dataclass
class Text:
    tokens: Tensor         # int64 (N,): every character, encoded by its index in ``vocab``
    vocab: str             # the sorted distinct characters
    origin: str            # the file read (or the URL it came from)
    sha256: str

    @property
    def n_train(self) -> int:
        return train_size(len(self.tokens))

    def info(self) -> dict:
        origin = self.origin if "://" in self.origin else os.path.relpath(self.origin)
        return {"data": LABEL, "data_origin": origin, "data_sha256": self.sha256,
                "chars": len(self.tokens), "vocab": len(self.vocab),
                "train_chars": self.n_train, "val_chars": len(self.tokens) - self.n_train}


def encode(text: str) -> tuple[Tensor, str]:
    """(every character's index in the vocabulary, the vocabulary: the sorted distinct
    characters)."""
    vocab = "".join(sorted(set(text)))
    if not text.isascii():
        index = {c: i for i, c in enumerate(vocab)}
        return torch.tensor([index[c] for c in text], dtype=torch.int64), vocab
    table = torch.zeros(128, dtype=torch.int64)          # ASCII (the known text): by lookup
    table[torch.tensor([ord(c) for c in vocab], dtype=torch.int64)] = torch.arange(len(vocab))
    return table[torch.frombuffer(bytearray(text, "ascii"), dtype=torch.uint8).long()], vocab


def locate(data_dir=None) -> tuple[Path | None, list[Path]]:
    """(the text file or None, every place looked). Never downloads."""
    looked = [d / RELPATH for d in candidate_dirs(data_dir)]
    return next((p for p in looked if p.is_file()), None), looked


def _fix() -> str:
    return f"get it again from {URL} (nanoGPT's shakespeare_char source)"


def check_file(path: Path, cache_dir=None, remember: bool = True) -> str:
    """The file's SHA-256: checked against SHA256SUMS beside it (where one lists it) and
    against the known text's; DataCorruptError in two lines otherwise."""
    digest = verify(path, cache_dir, _fix(), remember)
    if digest != SHA256:
        raise DataCorruptError(f"{path}: its SHA-256 {digest[:12]}... is not Tiny Shakespeare's "
                               f"{SHA256[:12]}...: the file is damaged or another text\n  {_fix()}")
    return digest


def text_file(data_dir=None, cache_dir=None, download: bool = True,
              remember: bool = True) -> tuple[Path, str]:
    """(the text file, its SHA-256): found and checked, or downloaded into the first data
    directory when it is nowhere and ``download`` (nothing is written unless the bytes are the
    known text); otherwise DataNotFoundError in two lines: where it looked, how to get it."""
    hit, looked = locate(data_dir)
    if hit is not None:
        return hit, check_file(hit, cache_dir, remember)
    reason = "download disabled (task.download=false)"
    if download:
        target = candidate_dirs(data_dir)[0] / RELPATH
        try:
            with urllib.request.urlopen(URL, timeout=30) as resp:  # noqa: S310 (fixed https URL)
                data = resp.read()
        except OSError as err:
            reason = f"download from {URL} failed ({err})"
        else:
            digest = hashlib.sha256(data).hexdigest()
            if digest != SHA256:
                raise DataCorruptError(f"{URL}: the download's SHA-256 {digest[:12]}... is not "
                                       f"Tiny Shakespeare's {SHA256[:12]}...; nothing was written"
                                       f"\n  put the text at <dir>/{RELPATH} yourself")
            atomic_write(target, lambda fh: fh.write(data))
            return target, digest
    raise DataNotFoundError(
        f"Tiny Shakespeare not found (looked in {', '.join(map(str, looked))}; {reason})\n  "
        f"get {URL}, put it at <dir>/{RELPATH}, then pass data_dir=<dir> or set "
        "GLUON_DATA_DIR=<dir>")


def load_text(data_dir=None, cache_dir=None, download: bool = True) -> Text:
    """The text, found (or downloaded), checked and encoded."""
    path, digest = text_file(data_dir, cache_dir, download)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:          # unreachable for the known bytes
        raise DataCorruptError(f"{path} is not UTF-8 text ({err})\n  {_fix()}") from None
    tokens, vocab = encode(text)
    return Text(tokens, vocab, str(path), digest)


def kl_table(text: Text, n_workers: int, split: str) -> list[dict]:
    """One row per worker: its range, characters and KL(shard || whole training text)."""
    ranges = shard_ranges(text.n_train, n_workers, split)
    kls = unigram_kl(text.tokens, ranges, len(text.vocab))
    return [{"split": split, "worker": r, "start": lo, "end": hi, "chars": hi - lo,
             "kl_nats": round(kl, 6), "kl_bits": round(kl / math.log(2), 6)}
            for r, ((lo, hi), kl) in enumerate(zip(ranges, kls))]
