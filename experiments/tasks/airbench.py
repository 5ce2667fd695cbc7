"""The airbench94 network (Jordan 2024, KellerJordan/cifar10-airbench), written for this project.

Architecture, as in airbench94 (and its parameter count, 1,972,792 in all):

    whiten   Conv2d(3 -> 24, 2x2, no padding, bias)   frozen: weights from patch statistics
    GELU
    group1   conv 24->64, maxpool 2, BN, GELU, conv 64->64, BN, GELU
    group2   conv 64->256, maxpool 2, BN, GELU, conv 256->256, BN, GELU
    group3   conv 256->256, maxpool 2, BN, GELU, conv 256->256, BN, GELU
    maxpool 3, flatten, Linear(256 -> 10, no bias), multiply by 1/9

3x3 convs have no bias, "same" padding and a partial identity (Dirac) initialisation of their
first ``in_channels`` filters. BatchNorm has eps = 1e-12 and, as in airbench, only its bias is
trainable: its weight stays at 1 (``requires_grad = False``, but counted). The whitening conv's
24 filters are the 12 eigenvectors of the (uncentred) 2x2x3 patch second-moment matrix of
normalised training images, scaled by 1/sqrt(eigenvalue + 5e-4), and their negatives. Airbench
trains the whitening bias for its first 3 epochs; here it is frozen at 0 by default
(``whiten_bias_trainable``) so that the layer is fixed data preprocessing.

BatchNorm in the federated simulation (see docs/cnn.md). Training-mode forwards normalise with
the statistics of the current batch, computed over "ghost" groups of ``ghost_batch`` images
(the per-worker minibatch size), and never touch the running statistics. So a large batch of
B minibatches gives exactly the mean of the B minibatch gradients, a gradient evaluation at X and
at X_prev has no side effect, and nothing depends on the order workers are evaluated in. The
running statistics used in eval mode are set only by :func:`recalibrate_bn` ("precise BN"):
pooled mean and variance of every BN input over a fixed set of training images at the current
parameters.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Channel statistics of the CIFAR-10 training set (airbench's constants).
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
N_PARAMS = 1_972_792  # the airbench94 count, frozen weights included


class GhostBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training forward uses per-ghost-batch statistics and no running update.

    * train mode: batch statistics over groups of ``ghost_batch`` consecutive images (the whole
      batch when it is not a multiple of ``ghost_batch`` larger than it); running stats untouched.
    * eval mode: the running statistics, which :func:`recalibrate_bn` sets.
    * while ``calibrating``: as train mode, and the pooled per-channel sums of x and x^2 of the
      layer's input are accumulated.
    """

    def __init__(self, num_features: int, eps: float = 1e-12, weight_trainable: bool = False,
                 ghost_batch: int = 0):
        super().__init__(num_features, eps=eps)
        self.weight.requires_grad_(weight_trainable)
        self.ghost_batch = ghost_batch
        self.calibrating = False
        self._sums: list[Tensor] | None = None

    def _ghost_groups(self, n: int) -> int:
        g = self.ghost_batch
        return n // g if g and n > g and n % g == 0 else 1

    def forward(self, x: Tensor) -> Tensor:
        if not self.training and not self.calibrating:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if self.calibrating:
            xd = x.detach().float()
            s1 = xd.sum((0, 2, 3))
            s2 = xd.pow(2).sum((0, 2, 3))
            cnt = xd.numel() // xd.shape[1]
            if self._sums is None:
                self._sums = [s1, s2, torch.tensor(float(cnt))]
            else:
                self._sums[0] += s1
                self._sums[1] += s2
                self._sums[2] += cnt
        groups = self._ghost_groups(x.shape[0])
        if groups == 1:
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        n, c, h, w = x.shape
        # (G*m, C, H, W) -> (m, G*C, H, W): one batch_norm call normalises each group separately
        xg = x.reshape(groups, n // groups, c, h, w).transpose(0, 1).reshape(n // groups, groups * c, h, w)
        y = F.batch_norm(xg, None, None, self.weight.repeat(groups), self.bias.repeat(groups),
                         True, 0.0, self.eps)
        return y.reshape(n // groups, groups, c, h, w).transpose(0, 1).reshape(n, c, h, w)

    def _finish_calibration(self) -> None:
        if self._sums is not None:
            s1, s2, cnt = self._sums
            mean = s1 / cnt
            var = (s2 / cnt - mean.pow(2)).clamp_min(0.0)
            self.running_mean.copy_(mean)
            self.running_var.copy_(var * cnt / (cnt - 1).clamp_min(1.0))
            self.num_batches_tracked.add_(1)
        self._sums = None


class Conv(nn.Conv2d):
    """3x3 (by default) "same" conv without bias; the first in_channels filters start as identity."""

    def __init__(self, cin: int, cout: int, kernel_size: int = 3, padding="same", bias: bool = False):
        super().__init__(cin, cout, kernel_size=kernel_size, padding=padding, bias=bias)

    def reset_parameters(self):
        super().reset_parameters()
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        w = self.weight.data
        nn.init.dirac_(w[: min(w.shape[0], w.shape[1])])


class ConvGroup(nn.Module):
    def __init__(self, cin: int, cout: int, **bn):
        super().__init__()
        self.conv1 = Conv(cin, cout)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = GhostBatchNorm(cout, **bn)
        self.conv2 = Conv(cout, cout)
        self.norm2 = GhostBatchNorm(cout, **bn)
        self.activ = nn.GELU()

    def forward(self, x):
        x = self.activ(self.norm1(self.pool(self.conv1(x))))
        return self.activ(self.norm2(self.conv2(x)))


class Airbench94(nn.Module):
    """airbench94: 1,972,792 parameters, 1,971,328 of them trainable with the default flags."""

    def __init__(self, widths=(64, 256, 256), whiten_kernel: int = 2, num_classes: int = 10,
                 scale: float = 1 / 9, ghost_batch: int = 0, bn_weight_trainable: bool = False,
                 whiten_bias_trainable: bool = False):
        super().__init__()
        wcin = 2 * 3 * whiten_kernel**2
        self.whiten = nn.Conv2d(3, wcin, whiten_kernel, padding=0, bias=True)
        self.whiten.weight.requires_grad_(False)
        nn.init.zeros_(self.whiten.bias)
        self.whiten.bias.requires_grad_(whiten_bias_trainable)
        bn = {"ghost_batch": ghost_batch, "weight_trainable": bn_weight_trainable}
        self.group1 = ConvGroup(wcin, widths[0], **bn)
        self.group2 = ConvGroup(widths[0], widths[1], **bn)
        self.group3 = ConvGroup(widths[1], widths[2], **bn)
        self.pool = nn.MaxPool2d(3)
        self.head = nn.Linear(widths[2], num_classes, bias=False)
        self.scale = scale
        self.activ = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        x = self.activ(self.whiten(x))
        x = self.group3(self.group2(self.group1(x)))
        x = self.pool(x).flatten(1)
        return self.head(x) * self.scale

    def set_ghost_batch(self, n: int) -> None:
        for m in self.modules():
            if isinstance(m, GhostBatchNorm):
                m.ghost_batch = n


def count_params(model: nn.Module) -> dict:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "frozen": total - trainable}


# ------------------------------------------------------------------ whitening initialisation

def patch_second_moment(images: Tensor, k: int = 2, chunk: int = 500) -> Tensor:
    """(c*k*k)^2 uncentred second moment of all k x k patches of float images (N, C, H, W),
    accumulated in float64 over chunks of images."""
    c = images.shape[1]
    total, count = torch.zeros(c * k * k, c * k * k, dtype=torch.float64), 0
    for x in images.split(chunk):
        patches = x.float().cpu().unfold(2, k, 1).unfold(3, k, 1)      # N, C, H', W', k, k
        flat = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * k * k).double()
        total += flat.T @ flat
        count += flat.shape[0]
    return total / count


@torch.no_grad()
def init_whitening(conv: nn.Conv2d, images: Tensor, eps: float = 5e-4) -> Tensor:
    """Set the whitening conv's filters from normalised training images; returns the eigenvalues.

    Filters: eigenvectors of the patch second moment (largest eigenvalue first), each divided by
    sqrt(eigenvalue + eps), then the same filters negated: 2 * c * k * k output channels.
    """
    cout, c, k, _ = conv.weight.shape
    if cout != 2 * c * k * k:
        raise ValueError(f"whitening conv needs {2 * c * k * k} output channels, has {cout}")
    evals, evecs = torch.linalg.eigh(patch_second_moment(images, k))   # ascending
    evals, evecs = evals.flip(0), evecs.flip(1)
    filters = (evecs.T / torch.sqrt(evals.clamp_min(0) + eps)[:, None]).reshape(c * k * k, c, k, k)
    conv.weight.copy_(torch.cat([filters, -filters]).to(conv.weight.dtype))
    return evals


# ------------------------------------------------------------------ BatchNorm recalibration

@torch.no_grad()
def recalibrate_bn(model: nn.Module, batches: Iterable[Tensor]) -> None:
    """Precise BN: set every GhostBatchNorm's running statistics to the pooled mean and variance
    of its input over ``batches`` (normalised images), at the model's current parameters.
    Forwards run as in training (ghost-batch statistics), so later layers see what they see in
    training. The model is left in eval mode."""
    bns = [m for m in model.modules() if isinstance(m, GhostBatchNorm)]
    for m in bns:
        m.calibrating, m._sums = True, None
    model.eval()
    try:
        for x in batches:
            model(x)
    finally:
        for m in bns:
            m.calibrating = False
    for m in bns:
        m._finish_calibration()
