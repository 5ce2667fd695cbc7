"""Finding (and where possible downloading) the datasets. File paths live here, not in gluon/.

Search order for a data directory: an explicit ``data_dir`` (config key), the environment
variable ``GLUON_DATA_DIR``, ``./data`` in the checkout, and a shared ``data`` folder beside
the checkout (``../shared/data``). Files keep their upstream layout below it:
``libsvm/a5a`` and ``cifar10-jpeg/{train,test}.tar.gz`` (or ``cifar10-jpeg/{train,test}/``).
"""
from __future__ import annotations

import os
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBSVM_URL = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/binary/{name}"


class DataNotFoundError(FileNotFoundError):
    pass


def candidate_dirs(data_dir: str | os.PathLike | None = None) -> list[Path]:
    dirs = []
    if data_dir:
        dirs.append(Path(data_dir).expanduser())
    if os.environ.get("GLUON_DATA_DIR"):
        dirs.append(Path(os.environ["GLUON_DATA_DIR"]).expanduser())
    dirs += [REPO / "data", REPO.parent / "shared" / "data"]
    seen, out = set(), []
    for d in dirs:
        r = d.resolve()
        if r not in seen:
            seen.add(r)
            out.append(d)
    return out


def find(relpath: str, data_dir=None) -> Path | None:
    for d in candidate_dirs(data_dir):
        if (d / relpath).exists():
            return d / relpath
    return None


def libsvm_file(name: str = "a5a", data_dir=None, download: bool = True) -> Path:
    """Path of LIBSVM binary dataset ``name``; downloads it into the first candidate directory
    when it is nowhere and the internet is reachable; otherwise a clear error."""
    rel = f"libsvm/{name}"
    hit = find(rel, data_dir)
    if hit is not None:
        return hit
    looked = [str(d / rel) for d in candidate_dirs(data_dir)]
    url = LIBSVM_URL.format(name=name)
    if download:
        target = candidate_dirs(data_dir)[0] / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".part")
            urllib.request.urlretrieve(url, tmp)  # noqa: S310 (fixed https URL)
            tmp.rename(target)
            return target
        except OSError as err:
            reason = f"download from {url} failed ({err})"
    else:
        reason = "download disabled"
    raise DataNotFoundError(
        f"LIBSVM dataset {name!r} not found; looked in:\n  " + "\n  ".join(looked)
        + f"\n{reason}.\nGet it from {url} and put it at <data_dir>/{rel}, then pass "
        "data_dir=<data_dir> or set GLUON_DATA_DIR.")
