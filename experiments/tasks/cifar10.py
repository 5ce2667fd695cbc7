"""CIFAR-10 for the CNN experiment: finding it, decoding it once, augmenting it on tensors.

Two sources, both ending as uint8 tensors (N, 3, 32, 32) plus int64 labels, cached in one ``.pt``
file under ``<results_dir>/cache/`` so that a later run loads them in about a second:

* ``torchvision``: the official binary release, ``cifar-10-batches-py`` under a data directory,
  or downloaded there by ``torchvision.datasets.CIFAR10(download=True)`` when the internet is
  reachable. Figures say "CIFAR-10".
* ``jpeg``: the image-folder export ``cifar10-jpeg/{train,test}/<class>/NNNN.jpg`` (the layout
  ``torchvision.datasets.ImageFolder`` reads), either unpacked or as ``{train,test}.tar.gz``
  (read member by member, nothing written but the cache). Decoded with
  ``torchvision.io.decode_jpeg``; an image that does not decode or is not 32x32, and a class
  folder that is not one of CIFAR-10's classes, stop the run in two lines naming the file. JPEG at quality ~75: pixels differ slightly from the official
  release, so figures made from it must say "CIFAR-10 (JPEG export)".

``source="auto"`` takes the official release if it is on disk, else the JPEG export if it is on
disk, else tries the download; if all fail, :class:`~experiments.tasks.DataNotFoundError`
lists every place it looked. Data directories are searched as in :mod:`experiments.tasks`.

The cache is keyed by the source's content: the SHA-256 of each source file (the tarballs, the
official batch files; checked against ``SHA256SUMS`` beside them where there is one, and hashed
once per file version, :func:`experiments.tasks.sha256`), or for an unpacked image folder the
names, sizes and modification times of its images. The cache records the row counts it decoded
and is used only when they and the source's identity match, so a changed or truncated source is
decoded again, never served from an older cache.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import tasks
from experiments.shared.files import atomic_write
from . import DataCorruptError, DataNotFoundError

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
JPEG_DIR = "cifar10-jpeg"
OFFICIAL_DIR = "cifar-10-batches-py"
LABELS = {"torchvision": "CIFAR-10", "jpeg": "CIFAR-10 (JPEG export)"}
CACHE_VERSION = 2
OFFICIAL_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
                  "test_batch", "batches.meta")
URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
_IMAGE_EXT = (".jpg", ".jpeg", ".png")


@dataclass
class Cifar:
    train_x: Tensor      # uint8 (N, 3, 32, 32)
    train_y: Tensor      # int64 (N,)
    test_x: Tensor
    test_y: Tensor
    classes: list[str]
    source: str          # "torchvision" or "jpeg"
    origin: str          # where the pixels came from (path or URL)
    sources: dict = field(default_factory=dict)   # the source's identity: {name: sha256, ...}

    @property
    def label(self) -> str:
        """What figures and summaries must call the data."""
        return LABELS.get(self.source, self.source)

    def info(self) -> dict:
        return {"data": self.label, "data_source": self.source, "data_origin": _shown(self.origin),
                "n_train": len(self.train_y), "n_test": len(self.test_y),
                **({"data_sha256": self.sources} if self.sources else {})}


def _shown(origin: str) -> str:
    """A local origin as a path relative to the working directory (the repository root a run
    starts in), so that a run's record names the data folder the same way on every machine."""
    return origin if "://" in origin else os.path.relpath(origin)


# ------------------------------------------------------------------ decoding

def _decode(blobs: list[bytes], names: list[str] | None = None) -> Tensor:
    """JPEG/PNG byte strings -> uint8 (N, 3, 32, 32): torchvision.io (about 2x faster than
    Pillow here; it warns that it is deprecated in favour of TorchCodec), else Pillow. An image
    that neither decodes, or that is not 32x32, is a DataCorruptError naming it (``names``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from torchvision.io import ImageReadMode, decode_image
    except ImportError:
        decode_image = None
    out = []
    for i, b in enumerate(blobs):
        name = names[i] if names is not None else f"image {i}"
        img = None
        if decode_image is not None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    img = decode_image(torch.frombuffer(bytearray(b), dtype=torch.uint8),
                                       mode=ImageReadMode.RGB)
            except (AttributeError, RuntimeError):
                img = None
        if img is None:
            img = _decode_with_pillow(b, name)
        if tuple(img.shape[1:]) != (32, 32):
            raise DataCorruptError(f"{name}: an image of {img.shape[2]}x{img.shape[1]} pixels, "
                                   f"CIFAR-10's are 32x32\n  {_EXPORT_FIX}")
        out.append(img)
    return torch.stack(out) if out else torch.empty(0, 3, 32, 32, dtype=torch.uint8)


def _decode_with_pillow(b: bytes, name: str) -> Tensor:
    import numpy as np
    from PIL import Image, UnidentifiedImageError
    try:
        rgb = Image.open(io.BytesIO(b)).convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise DataCorruptError(f"{name} cannot be decoded as an image ({type(err).__name__})"
                               f"\n  {_EXPORT_FIX}") from None
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1)


_EXPORT_FIX = "the export is damaged: get it again, or remove the file"


def _labelled(items: list[tuple[str, str, bytes]], origin: str = "") -> tuple[Tensor, Tensor, list[str]]:
    """(class, file name, bytes) -> images, labels, classes; classes sorted as ImageFolder does,
    files sorted by name within a class, so the order never depends on the file system. A
    class that is not one of CIFAR-10's (:data:`CLASSES`) is a DataCorruptError naming its
    folder below ``origin``."""
    classes = sorted({c for c, _, _ in items})
    odd = [c for c in classes if c not in CLASSES]
    if odd:
        raise DataCorruptError(f"{origin}/{odd[0]}: {odd[0]!r} is not a CIFAR-10 class "
                               f"({', '.join(CLASSES)})\n  {_EXPORT_FIX.replace('file', 'folder')}")
    index = {c: i for i, c in enumerate(classes)}
    items = sorted(items, key=lambda t: (index[t[0]], t[1]))
    x = _decode([b for _, _, b in items], [f"{origin}/{c}/{f}" for c, f, _ in items])
    y = torch.tensor([index[c] for c, _, _ in items], dtype=torch.int64)
    return x, y, classes


def read_image_folder(root: str | Path) -> tuple[Tensor, Tensor, list[str]]:
    """``root/<class>/<image>`` as ImageFolder reads it -> (uint8 images, labels, classes)."""
    root = Path(root)
    items = [(d.name, f.name, f.read_bytes()) for d in root.iterdir() if d.is_dir()
             for f in d.iterdir() if f.suffix.lower() in _IMAGE_EXT]
    if not items:
        raise DataNotFoundError(f"no images under {root}/<class>/")
    return _labelled(items, str(root))


def read_image_tar(path: str | Path, split: str) -> tuple[Tensor, Tensor, list[str]]:
    """The same from ``<split>.tar.gz`` holding ``<split>/<class>/<image>``, without unpacking
    it to disk."""
    items = []
    with tarfile.open(path, "r:*") as tar:
        for m in tar:
            parts = Path(m.name).parts
            if not m.isfile() or Path(m.name).suffix.lower() not in _IMAGE_EXT or len(parts) < 2:
                continue
            if split in parts[:-2] or len(parts) == 2:
                items.append((parts[-2], parts[-1], tar.extractfile(m).read()))
    if not items:
        raise DataNotFoundError(f"no images in {path} (expected {split}/<class>/<image>)")
    return _labelled(items, f"{path}:{split}")


def read_jpeg_export(root: Path) -> dict:
    """Both splits of an image-folder export directory (folders first, else tarballs)."""
    out = {}
    for split in ("train", "test"):
        if (root / split).is_dir():
            out[split] = read_image_folder(root / split)
        elif (root / f"{split}.tar.gz").is_file():
            out[split] = read_image_tar(root / f"{split}.tar.gz", split)
        else:
            raise DataNotFoundError(f"{root} has neither {split}/ nor {split}.tar.gz")
    if out["train"][2] != out["test"][2]:
        raise ValueError(f"train and test classes differ in {root}")
    return out


def _jpeg_export_dir(data_dir) -> Path | None:
    hit = tasks.find(JPEG_DIR, data_dir)
    if hit is None:
        return None
    ok = all((hit / s).is_dir() or (hit / f"{s}.tar.gz").is_file() for s in ("train", "test"))
    return hit if ok else None


# ------------------------------------------------------------------ the official release

def _official_root(data_dir) -> Path | None:
    hit = tasks.find(OFFICIAL_DIR, data_dir)
    return None if hit is None else hit.parent


def _read_official(root: Path, download: bool) -> dict:
    from torchvision.datasets import CIFAR10
    out = {}
    for split in ("train", "test"):
        ds = CIFAR10(str(root), train=split == "train", download=download)
        x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
        out[split] = (x, torch.tensor(ds.targets, dtype=torch.int64), list(ds.classes))
    return out


# ------------------------------------------------------------------ the cache and the front door

def _on_disk(source: str, data_dir) -> Path | None:
    """The folder of ``source`` ("torchvision": cifar-10-batches-py, "jpeg": the export) when
    it is on disk, else None."""
    if source == "torchvision":
        root = _official_root(data_dir)
        return None if root is None else root / OFFICIAL_DIR
    return _jpeg_export_dir(data_dir)


def _folder_identity(folder: Path) -> str:
    """An unpacked image folder, by the names, sizes and modification times of its images."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.suffix.lower() in _IMAGE_EXT):
        st = f.stat()
        h.update(f"{f.relative_to(folder).as_posix()}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return "files:" + h.hexdigest()


def identity(source: str, where: Path, cache_dir=None, remember: bool = True) -> dict:
    """``{name: sha256}`` of what ``source`` is decoded from at ``where`` (see the module
    docstring); each file checked against SHA256SUMS beside it. DataCorruptError if one differs."""
    fix = f"get it again ({URL})" if source == "torchvision" else "get the export again"
    out = {}
    if source == "torchvision":
        for name in OFFICIAL_FILES:
            if (where / name).is_file():
                out[name] = tasks.verify(where / name, cache_dir, fix, remember)
        return out
    for split in ("train", "test"):
        if (where / split).is_dir():
            out[f"{split}/"] = _folder_identity(where / split)
        else:
            out[f"{split}.tar.gz"] = tasks.verify(where / f"{split}.tar.gz", cache_dir, fix,
                                                     remember)
    return out


def _cache_path(cache_dir: Path, source: str, sources: dict) -> Path:
    key = hashlib.sha256(json.dumps(sources, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"cifar10-{source}-{key}-v{CACHE_VERSION}.pt"


def _from_splits(splits: dict, source: str, origin: str, sources: dict | None = None) -> Cifar:
    (trx, try_, classes), (tex, tey, _) = splits["train"], splits["test"]
    return Cifar(trx, try_, tex, tey, list(classes), source, origin, dict(sources or {}))


def _save(c: Cifar, path: Path) -> None:
    """Write the cache atomically: parallel runs on a fresh clone (``make fig2-cnn``, SLURM
    arrays) all build it at once; each writes a private temporary file (experiments.shared.runs)."""
    payload = {"train_x": c.train_x, "train_y": c.train_y, "test_x": c.test_x,
               "test_y": c.test_y, "classes": c.classes, "source": c.source,
               "origin": c.origin, "version": CACHE_VERSION, "sources": c.sources,
               "n_train": len(c.train_y), "n_test": len(c.test_y)}
    atomic_write(path, lambda fh: torch.save(payload, fh))


def _load_cache(path: Path, sources: dict | None = None) -> Cifar | None:
    """The cached tensors, or None (a miss: the caller rebuilds and rewrites the cache) when
    there is no cache, it is from another version or another source (``sources``, when given),
    its row counts are not those it recorded, or it cannot be read (foreign, or truncated)."""
    if not path.is_file():
        return None
    try:
        d = torch.load(path, weights_only=True)
        if not isinstance(d, dict) or d.get("version") != CACHE_VERSION:
            return None
        if sources is not None and d.get("sources") != sources:
            return None
        if (len(d["train_y"]), len(d["test_y"])) != (d.get("n_train"), d.get("n_test")):
            raise ValueError(f"{len(d['train_y'])}/{len(d['test_y'])} rows, recorded "
                             f"{d.get('n_train')}/{d.get('n_test')}")
        return Cifar(d["train_x"], d["train_y"], d["test_x"], d["test_y"], list(d["classes"]),
                     d["source"], d["origin"], dict(d.get("sources") or {}))
    except FileNotFoundError:  # removed between the check and the read
        return None
    except Exception as err:
        warnings.warn(f"ignoring unreadable CIFAR-10 cache {path} ({type(err).__name__}: {err}); "
                      "rebuilding it", RuntimeWarning, stacklevel=2)
        return None


def _order(source: str) -> list[str]:
    if source not in ("auto", "torchvision", "jpeg"):
        raise ValueError(f"unknown CIFAR-10 source {source!r}; use auto, torchvision or jpeg")
    return {"auto": ["torchvision", "jpeg"], "torchvision": ["torchvision"], "jpeg": ["jpeg"]}[source]


def _not_found(data_dir, order: list[str], errors: list[str]) -> DataNotFoundError:
    looked = []
    for d in tasks.candidate_dirs(data_dir):
        if "torchvision" in order:
            looked.append(str(d / OFFICIAL_DIR))
        if "jpeg" in order:
            looked.append(str(d / JPEG_DIR))
    return DataNotFoundError(
        f"CIFAR-10 not found (looked in {', '.join(looked)}"
        + (f"; {'; '.join(errors)}" if errors else "") + ")"
        "\n  get it, then pass data_dir=<dir> or set GLUON_DATA_DIR=<dir>: run once where the "
        f"internet is reachable (torchvision downloads {URL} into <dir>/{OFFICIAL_DIR}), unpack "
        f"that file at <dir>/{OFFICIAL_DIR}, or put an image-folder export at <dir>/{JPEG_DIR}/"
        "{train,test}/<class>/*.jpg (or train.tar.gz and test.tar.gz there)")


def data_identity(data_dir, cache_dir, source: str = "auto") -> str | None:
    """The SHA-256 of the identity (:func:`identity`) of the source a run would decode, or
    None while no source is on disk."""
    for s in _order(source):
        where = _on_disk(s, data_dir)
        if where is not None:
            text = json.dumps({s: identity(s, where, cache_dir)}, sort_keys=True)
            return hashlib.sha256(text.encode()).hexdigest()
    return None


def check_data(cfg) -> None:
    """Before hydra makes a folder: the CIFAR-10 source a run of ``cfg`` would use is on disk
    and matches its SHA256SUMS, or may still be downloaded (``task.download``)."""
    from experiments.shared.files import REPO
    order = _order(cfg.task.source)
    for s in order:
        where = _on_disk(s, cfg.data_dir)
        if where is not None:
            identity(s, where, Path(REPO, cfg.results_dir, "cache"), remember=False)
            return
    if not ("torchvision" in order and cfg.task.download):
        raise _not_found(cfg.data_dir, order, ["download disabled"])


def load_cifar10(data_dir=None, cache_dir: str | Path | None = None, source: str = "auto",
                 download: bool = True) -> Cifar:
    """CIFAR-10 as uint8 tensors, from the cache when there is one for this source's content
    (see the module docstring).

    ``source``: ``auto``, ``torchvision`` (official only; downloaded if missing and allowed) or
    ``jpeg`` (the image-folder export only). ``cache_dir=None`` disables the cache.
    """
    order = _order(source)
    # 1. data on disk: its cache when there is one, else decoded (and cached)
    for s in order:
        where = _on_disk(s, data_dir)
        if where is None:
            continue
        sources = identity(s, where, cache_dir)
        path = _cache_path(cache_dir, s, sources) if cache_dir is not None else None
        hit = _load_cache(path, sources) if path is not None else None
        if hit is not None:
            return hit
        splits = (_read_official(where.parent, download=False) if s == "torchvision"
                  else read_jpeg_export(where))
        data = _from_splits(splits, s, str(where), sources)
        if path is not None:
            _save(data, path)
        return data
    # 2. the download
    errors = []
    if "torchvision" in order and download:
        target = tasks.candidate_dirs(data_dir)[0]
        made = [p for p in (target, target / URL.rsplit("/", 1)[1], target / OFFICIAL_DIR)
                if not p.exists()]
        try:
            splits = _read_official(target, download=True)
        except Exception as err:  # no internet, no write access, ...
            errors.append(f"download into {target} failed ({type(err).__name__}: {err})")
            for p in made:        # a failed download leaves nothing behind
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        else:
            sources = identity("torchvision", target / OFFICIAL_DIR, cache_dir)
            data = _from_splits(splits, "torchvision", URL, sources)
            if cache_dir is not None:
                _save(data, _cache_path(cache_dir, "torchvision", sources))
            return data
    elif "torchvision" in order:
        errors.append("download disabled")
    raise _not_found(data_dir, order, errors)


# ------------------------------------------------------------------ tensors in, tensors out

def normalize(x: Tensor) -> Tensor:
    """uint8 (N, 3, H, W) -> float32, scaled to [0, 1] and standardised per channel (airbench)."""
    from .airbench import CIFAR_MEAN, CIFAR_STD
    mean = torch.tensor(CIFAR_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD, device=x.device).view(1, 3, 1, 1)
    return (x.float() / 255.0 - mean) / std


def augment(x: Tensor, gen: torch.Generator, flip: bool = True, translate: int = 2) -> Tensor:
    """airbench's training augmentation on a float batch: a random left-right flip per image and a
    random translation by up to ``translate`` pixels in each direction (a crop of the
    reflect-padded image). All randomness comes from ``gen`` (the worker's generator)."""
    n, c, h, w = x.shape
    if flip:
        mask = torch.rand(n, generator=gen) < 0.5
        x = torch.where(mask.view(n, 1, 1, 1).to(x.device), x.flip(-1), x)
    if translate > 0:
        r = translate
        padded = F.pad(x, (r, r, r, r), mode="reflect")
        shifts = torch.randint(0, 2 * r + 1, (n, 2), generator=gen).to(x.device)
        rows = (shifts[:, 0:1] + torch.arange(h, device=x.device)).view(n, 1, h, 1)
        cols = (shifts[:, 1:2] + torch.arange(w, device=x.device)).view(n, 1, 1, w)
        b = torch.arange(n, device=x.device).view(n, 1, 1, 1)
        ch = torch.arange(c, device=x.device).view(1, c, 1, 1)
        x = padded[b, ch, rows, cols]
    return x
