"""Where a run's n workers live: simulated in this process, or one per process.

``comm=sim`` (default): all ``n_workers`` workers in this process (:class:`gluon.InProcessComm`).
``comm=torchdist``: one worker per process over torch.distributed
(:class:`gluon.distributed.TorchDistComm`; gloo on CPU, NCCL on CUDA), the processes started by
``torchrun --nproc-per-node N`` or by ``srun`` with one task per worker (RANK, WORLD_SIZE and
LOCAL_RANK are then taken from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID). The same entry
point, the same config, the same run folder: rank 0 writes it, every rank computes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from gluon import InProcessComm
from gluon.comm import Comm

KINDS = ("sim", "torchdist")


def env_from_slurm(environ=os.environ) -> bool:
    """Under ``srun`` without torchrun (or a SLURM job array task with several tasks, as
    ``launcher=slurm comm=torchdist`` submits), RANK/WORLD_SIZE/LOCAL_RANK from SLURM's
    variables. MASTER_ADDR defaults to the allocation's first node, MASTER_PORT to a port
    derived from the job id (so two jobs on one node do not collide).
    Returns whether a torch.distributed environment is present."""
    if "RANK" not in environ and "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        environ["RANK"] = environ["SLURM_PROCID"]
        environ["WORLD_SIZE"] = environ["SLURM_NTASKS"]
        environ["LOCAL_RANK"] = environ.get("SLURM_LOCALID", "0")
        environ.setdefault("MASTER_ADDR", _first_node(environ))
        job = int(environ.get("SLURM_JOB_ID", "0") or 0)
        environ.setdefault("MASTER_PORT", str(20000 + job % 20000))
    return "RANK" in environ and "WORLD_SIZE" in environ


def _first_node(environ) -> str:
    if int(environ.get("SLURM_NNODES", "1") or 1) <= 1:
        return "127.0.0.1"
    import subprocess
    out = subprocess.run(["scontrol", "show", "hostnames", environ["SLURM_JOB_NODELIST"]],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0]


def check_env(kind: str, n_workers: int, environ=os.environ) -> str | None:
    """Why ``comm=kind`` cannot run with ``n_workers`` workers here (None when it can); checked
    before any process group or data."""
    if kind not in KINDS:
        return f"comm={kind}: choose one of {', '.join(KINDS)}"
    if kind == "sim":
        return None
    if not env_from_slurm(environ):
        return ("comm=torchdist needs one process per worker: start it with "
                "`torchrun --nproc-per-node N -m experiments.<task> comm=torchdist ...` or srun")
    size = int(environ["WORLD_SIZE"])
    if size != n_workers:
        return f"n_workers={n_workers} but {size} processes were started (one per worker)"
    return None


@dataclass
class World:
    kind: str = "sim"
    rank: int = 0
    size: int = 1          # processes
    device: str = "cpu"    # device of the collectives' small tensors (cuda:i under NCCL)
    dense: str = "all_reduce"   # how dense messages travel (all_gather: bit-identical to sim)

    @property
    def writer(self) -> bool:
        """Only rank 0 writes the run folder, W&B and the logs."""
        return self.rank == 0

    def comm(self, n_workers: int, seed: int) -> Comm:
        if self.kind == "sim":   # counts the traffic the same run would move on processes
            return InProcessComm(n_workers, seed=seed, dense=self.dense)
        from gluon.distributed import TorchDistComm
        return TorchDistComm(seed, dense=self.dense)

    # agreement between ranks (no-ops in a simulation)
    def any(self, flag: bool) -> bool:
        if self.size == 1:
            return flag
        import torch.distributed as dist
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all(self, flag: bool) -> bool:
        return not self.any(not flag)

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist
            dist.barrier()


def open_world(kind: str, device: str = "cpu", dense: str = "all_reduce") -> World:
    """Join the process group for ``comm=torchdist`` (after :func:`check_env` said yes)."""
    if kind == "sim":
        return World(dense=dense)
    import torch.distributed as dist
    env_from_slurm()
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return World("torchdist", dist.get_rank(), dist.get_world_size(),
                 f"cuda:{torch.cuda.current_device()}" if cuda else "cpu", dense)


def close_world(world: World) -> None:
    if world.kind == "torchdist":
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on this host now (for a local process group's rendezvous)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
