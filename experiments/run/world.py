"""The process world of a run: where its n workers live, and how the processes agree.

``kind="sim"``: all ``n_workers`` workers in this process (:class:`gluon.InProcessComm`).
``kind="torchdist"``: one worker per process over torch.distributed
(:class:`gluon.distributed.TorchDistComm`; gloo on CPU, NCCL on CUDA), the processes started by
``torchrun --nproc-per-node N`` or by ``srun`` with one task per worker (RANK, WORLD_SIZE and
LOCAL_RANK are then taken from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID). The same entry
point, the same config, the same run folder: rank 0 writes it, every rank computes.

The library (:mod:`gluon.distributed`) holds the backend a training loop of one's own uses under
torchrun; joining the process group, SLURM's environment and the ranks' agreement on what the
run does (skip, resume, stop) are the run's, here.
"""
from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gluon.comm import DENSE_COLLECTIVE, Comm, InProcessComm
from gluon.distributed import TorchDistComm

KINDS = ("sim", "torchdist")


def export_torch_env_from_slurm(environ=os.environ) -> bool:
    """Sets torch.distributed's variables in ``environ`` from SLURM's, under ``srun`` without
    torchrun (or a SLURM job array task with several tasks, as ``launcher=slurm
    comm=torchdist`` submits): RANK/WORLD_SIZE/LOCAL_RANK from SLURM_PROCID/SLURM_NTASKS/
    SLURM_LOCALID, MASTER_ADDR (unless set) the allocation's first node, MASTER_PORT (unless
    set) a port derived from the job id (so two jobs on one node do not collide). Changes
    nothing when RANK is set already (torchrun) or SLURM started no tasks.
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
    out = subprocess.run(["scontrol", "show", "hostnames", environ["SLURM_JOB_NODELIST"]],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0]


@dataclass
class World:
    """The processes of a run and how they agree: ``kind`` "sim" (one process, every worker)
    or "torchdist" (one worker per process)."""
    kind: str = "sim"
    rank: int = 0
    size: int = 1          # processes
    device: str = "cpu"    # device of the collectives' small tensors (cuda:i under NCCL)
    dense: str = DENSE_COLLECTIVE     # how dense messages travel (all_gather: bit-identical to sim)

    @property
    def writer(self) -> bool:
        """Only rank 0 writes the run folder, W&B and the logs."""
        return self.rank == 0

    def comm(self, n_workers: int, seed: int) -> Comm:
        if self.kind == "sim":   # counts the traffic the same run would move on processes
            return InProcessComm(n_workers, seed=seed, dense=self.dense)
        return TorchDistComm(seed, dense=self.dense)

    # agreement between ranks (no-ops in a simulation)
    def any(self, flag: bool) -> bool:
        if self.size == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all(self, flag: bool) -> bool:
        return not self.any(not flag)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def open_world(kind: str, device: str = "cpu", dense: str = DENSE_COLLECTIVE) -> World:
    """Join the process group for ``comm=torchdist`` (torchrun or srun started the processes)."""
    if kind == "sim":
        return World(dense=dense)
    export_torch_env_from_slurm()
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return World("torchdist", dist.get_rank(), dist.get_world_size(),
                 f"cuda:{torch.cuda.current_device()}" if cuda else "cpu", dense)


def close_world(world: World) -> None:
    if world.kind == "torchdist" and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on this host now (for a local process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
