"""Your own CIFAR-10 training loop with Compressed Gluon (Alg. 1, RandK 1%), one worker per process.

    torchrun --nproc-per-node 2 examples/torchrun_cifar.py --steps 2000
    torchrun --nproc-per-node 2 examples/torchrun_cifar.py --model resnet18
    python examples/torchrun_cifar.py --steps 3 --widths 16 64 64      # one process (n = 1)

Everything but the optimiser is an ordinary PyTorch loop: a Dataset and DataLoader per worker
(its own shard, shuffled, augmented in the data pipeline), a model (the airbench CNN of
experiments/tasks/airbench.py or any torchvision classifier), a cosine LR schedule, and a
checkpoint per rank. The optimiser needs the closure ``loss_on(batch)`` and an endless iterator
of batches; it calls the closure once per batch at X^k, again at X^{k-1} on the same batch for
Alg. 1's Delta, and B times on a synchronisation.

Data: ``--data DIR`` reads an image-folder tree DIR/{train,test}/<class>/*.jpg with torchvision's
ImageFolder. Without it, the repository's decoded CIFAR-10 is used (uint8 tensors cached under
results/cache/, found as ``experiments.tasks`` finds data). Under torchrun with CUDA each process
takes the GPU of its LOCAL_RANK and NCCL; on CPU, gloo.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))            # the airbench model and the cached data live in the repo

import gluon                                                                   # noqa: E402
from gluon.optim import CompressedGluon, forever                               # noqa: E402

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


# ---------------------------------------------------------------- data: a shard per worker

class CachedCifar(Dataset):
    """The repository's uint8 CIFAR-10 tensors as a Dataset of normalised float images."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return (self.images[i].float() / 255 - self.mean) / self.std, self.labels[i]


def datasets(data: str | None):
    if data:
        from torchvision import datasets as tvd, transforms as T
        tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
        return (tvd.ImageFolder(os.path.join(data, "train"), tf),
                tvd.ImageFolder(os.path.join(data, "test"), tf))
    from experiments.tasks.cifar10 import load_cifar10
    c = load_cifar10(cache_dir=REPO / "results" / "cache")
    return CachedCifar(c.train_x, c.train_y), CachedCifar(c.test_x, c.test_y)


class Augment:
    """Batch augmentation in the loader (flip, translate by up to 2 pixels), with the worker's
    own generator: the closure must compute the same function of its batch at X^k and X^{k-1}."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, items):
        x = torch.stack([a for a, _ in items])
        y = torch.tensor([int(b) for _, b in items])
        flip = torch.rand(len(x), generator=self.gen) < 0.5
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
        padded = F.pad(x, (2, 2, 2, 2), mode="reflect")
        shifts = torch.randint(0, 5, (len(x), 2), generator=self.gen).tolist()
        return torch.stack([im[:, r:r + 32, c:c + 32] for im, (r, c) in zip(padded, shifts)]), y


# ---------------------------------------------------------------- the model

def make_model(name: str, widths, batch_size: int, train_set) -> torch.nn.Module:
    if name == "airbench":
        from experiments.tasks.airbench import Airbench94, init_whitening
        model = Airbench94(widths=tuple(widths), ghost_batch=batch_size)
        whiten = torch.stack([train_set[i][0] for i in range(min(5000, len(train_set)))])
        init_whitening(model.whiten, whiten)     # fixed preprocessing from patch statistics
        return model
    import torchvision
    return getattr(torchvision.models, name)(num_classes=10)


@torch.no_grad()
def accuracy(model, test_set, device, n: int, batch_size: int) -> float:
    from experiments.tasks.airbench import Airbench94, recalibrate_bn
    if isinstance(model, Airbench94):    # its BatchNorm keeps no running statistics in training
        recalibrate_bn(model, (x.to(device) for x, _ in DataLoader(Subset(test_set, range(n)),
                                                                    batch_size=batch_size)))
    model.eval()
    right = 0
    for x, y in DataLoader(Subset(test_set, range(n)), batch_size=256):
        right += int((model(x.to(device)).argmax(1).cpu() == y).sum())
    model.train()
    return right / n


# ---------------------------------------------------------------- the loop

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="ImageFolder root with train/ and test/")
    p.add_argument("--model", default="airbench", help="airbench or a torchvision model name")
    p.add_argument("--widths", type=int, nargs=3, default=[64, 256, 256])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05, help="LMO radius (cosine-annealed)")
    p.add_argument("--beta", type=float, default=0.9)
    p.add_argument("--q", type=float, default=0.1, help="probability of a synchronisation")
    p.add_argument("--B", type=int, default=4, help="minibatches in a synchronisation's batch")
    p.add_argument("--density", type=float, default=0.01, help="RandK's k/d")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-images", type=int, default=2000)
    p.add_argument("--checkpoint", default=None, help="folder for per-rank checkpoints (resumes)")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:                                  # torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    train_set, test_set = datasets(args.data)
    shard = Subset(train_set, range(rank, len(train_set), world))          # worker rank's shard
    loader = DataLoader(shard, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed * 1000 + rank),
                        collate_fn=Augment(args.seed * 1000 + rank))
    torch.manual_seed(args.seed)
    model = make_model(args.model, args.widths, args.batch_size, train_set).to(device)

    opt = CompressedGluon(model.named_parameters(), lr=args.lr, beta=args.beta, q=args.q,
                          B=args.B, compressor=gluon.RandK(density=args.density), seed=args.seed)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    def loss_on(batch):                   # the closure: the loss of the model on one batch
        x, y = batch
        return F.cross_entropy(model(x.to(device)), y.to(device), label_smoothing=0.2)

    ckpt = Path(args.checkpoint) / f"rank{rank}.pt" if args.checkpoint else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
    batches = forever(loader)

    if rank == 0:
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"{args.model}: {n:,} parameters, {world} worker(s) on {device}, Alg. 1 with RandK "
              f"{args.density:.0%}, q = {args.q}, B = {args.B}, batch {args.batch_size}", flush=True)
    t0 = time.perf_counter()
    while opt.k < args.steps:
        loss = opt.step(loss_on, batches)
        sched.step()
        if rank == 0 and (opt.k % args.log_every == 0 or opt.k == args.steps):
            print(f"step {opt.k:5d}  loss {loss.item():.3f}  {'sync' if opt.last.sync else '    '}"
                  f"  uplink {opt.ledger.cost:7.1f} dense gradients = {opt.ledger.bytes / 1e6:7.2f}"
                  f" MB  {time.perf_counter() - t0:6.1f} s", flush=True)
    if ckpt is not None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict()}, ckpt)

    report = opt.comm.report() if dist.is_initialized() else None   # a collective: every rank
    if rank == 0:
        acc = accuracy(model, test_set, device, min(args.eval_images, len(test_set)),
                       args.batch_size)
        sent = report["measured_bytes"] if report else opt.ledger.bytes
        print(f"test accuracy {acc:.3f} on {min(args.eval_images, len(test_set))} images; "
              f"uplink per worker {opt.ledger.cost:.1f} dense gradients, {sent / 1e6:.2f} MB sent")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
