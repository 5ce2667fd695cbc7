"""The README's own-loop example runs as written, in one process and under torchrun."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from experiments.shared.files import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(out: str) -> tuple[float, float]:
    before = float(re.search(r"before: loss ([0-9.]+)", out).group(1))
    after = float(re.search(r"after:  loss ([0-9.]+)", out).group(1))
    return before, after


def run_example(name: str, procs: int) -> subprocess.CompletedProcess:
    """examples/<name>, unchanged: as a plain script for one process, under torchrun for more;
    it must exit 0 (a rank's own error comes first in the message, torchrun's summary last)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = str(REPO / "examples" / name)
    cmd = [sys.executable, script] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
        "--master-port", str(free_port()), script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[:1500] + "\n...\n" + out.stderr[-1500:]
    return out


@pytest.mark.parametrize("procs", [1, 2])
def test_own_model_example_trains_in_one_process_and_under_torchrun(procs):
    """examples/own_model.py, unchanged, with 1 process (n = 1) and with torchrun on 2: the
    full-data loss falls by more than a third, and the uplink line is printed."""
    out = run_example("own_model.py", procs)
    before, after = losses(out.stdout)
    assert f"({procs} worker" in out.stdout
    assert after < 0.66 * before
    assert "uplink per worker" in out.stdout


@pytest.mark.parametrize("procs", [1, 2])
def test_char_gpt_example_trains_in_one_process_and_under_torchrun(procs):
    """examples/char_gpt.py, unchanged, with 1 process (n = 1) and with torchrun on 2 (each on
    its own part of the text): a tiny GPT's validation loss falls by more than a fifth in 150
    steps of Alg. 1, and the uplink line is printed."""
    out = run_example("char_gpt.py", procs)
    before = float(re.search(r"before: val loss ([0-9.]+)", out.stdout).group(1))
    after = float(re.search(r"after:  val loss ([0-9.]+)", out.stdout).group(1))
    assert f"({procs} worker" in out.stdout
    assert after < 0.8 * before
    assert "uplink per worker" in out.stdout
