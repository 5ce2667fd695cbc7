"""Tests against a real SLURM cluster: marker `slurm`, deselected unless asked for.

`make test-slurm` brings up a one-node cluster on this machine (scripts/cluster/slurm_cluster.sh),
runs ``pytest -m slurm tests/slurm`` and brings it down. Any other pytest run (``make test``,
``make test-slow``) deselects these tests and says so in its summary; they run when the marker
expression names `slurm` (``-m slurm``) or when tests/slurm is given on the command line.
Where no cluster answers, the tests FAIL (they never skip): a CI that asks for them must get
them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments.shared.files import REPO
HERE = Path(__file__).resolve().parent
_deselected: list = []


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slurm: needs a running SLURM cluster (`make test-slurm` starts one here)")


def _asked_for(config) -> bool:
    if "slurm" in (config.getoption("markexpr") or ""):
        return True
    for arg in config.args:
        path = Path(arg.split("::")[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    if _asked_for(config):
        return
    keep = [it for it in items if it.get_closest_marker("slurm") is None]
    dropped = [it for it in items if it.get_closest_marker("slurm") is not None]
    if dropped:
        _deselected.extend(dropped)
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_terminal_summary(terminalreporter):
    if _deselected:
        terminalreporter.write_line(
            f"{len(_deselected)} SLURM tests (tests/slurm) not run: `make test-slurm` runs them "
            "on a one-node cluster it starts here (needs root)")


def _conf() -> str | None:
    if os.environ.get("SLURM_CONF"):
        return os.environ["SLURM_CONF"]
    local = REPO / ".slurm" / "slurm.conf"           # scripts/cluster/slurm_cluster.sh up
    return str(local) if local.exists() else None


@pytest.fixture(scope="session")
def cluster() -> dict:
    """The cluster's environment (SLURM_CONF); FAILS (never skips) when no cluster answers."""
    env = dict(os.environ)
    conf = _conf()
    if conf:
        env["SLURM_CONF"] = conf
    why = None
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        why = "the SLURM client commands (sinfo, sbatch) are not installed"
    else:
        ping = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True)
        nodes = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                               text=True)
        states = set(nodes.stdout.split())
        if "UP" not in ping.stdout:
            why = f"slurmctld does not answer: {(ping.stdout + ping.stderr).strip()}"
        elif not states & {"idle", "mixed", "allocated", "completing"}:
            why = f"no usable node (sinfo: {sorted(states)})"
    if why:
        pytest.fail(f"SLURM cluster not available: {why}. `make test-slurm` brings up a "
                    "one-node cluster (scripts/cluster/slurm_cluster.sh up, as root) and runs these "
                    "tests.", pytrace=False)
    return env
