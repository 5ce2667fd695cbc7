"""The CIFAR-10 airbench CNN experiment: model, data, LMOs, BatchNorm handling, short runs.

Everything runs on CPU on tiny synthetic data (no network, no dataset needed).
"""
from __future__ import annotations

import json
import logging
import math
import os
import tarfile
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from experiments import tasks
from experiments.tasks.airbench import (N_PARAMS, Airbench94, GhostBatchNorm, count_params,
                                  init_whitening, patch_second_moment, recalibrate_bn)
from experiments.tasks.cifar10 import Cifar, augment, load_cifar10, normalize
from experiments.tasks import cnn as cnn_task
from experiments.tasks.cnn import CifarOracle, build
from experiments.run.config import validate
from experiments.run.lifecycle import execute
from gluon.lmo import RMS, Sign, Spectral
from tests.conftest import compose_config

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


def cfg_for(*overrides):
    return compose_config("cnn", *overrides)


def synthetic(n_train=64, n_test=32, classes=4, seed=0) -> Cifar:
    """Learnable images: a class-specific colour and stripe pattern plus noise."""
    g = torch.Generator().manual_seed(seed)

    def make(n):
        y = torch.arange(n) % classes
        base = torch.rand(classes, 3, 1, 1, generator=g) * 160 + 40
        stripes = (torch.arange(32) // 4 % 2).float().view(1, 1, 1, 32) * 40
        x = base[y] + stripes * (y.view(-1, 1, 1, 1) % 2) + torch.randn(n, 3, 32, 32, generator=g) * 20
        return x.clamp(0, 255).to(torch.uint8), y

    trx, tr_y = make(n_train)
    tex, te_y = make(n_test)
    return Cifar(trx, tr_y, tex, te_y, [f"c{i}" for i in range(classes)], "synthetic", "test")


def small_model(ghost=8):
    torch.manual_seed(0)
    return Airbench94(ghost_batch=ghost)


# ------------------------------------------------------------------ the network

def test_parameter_count_is_airbench94():
    model = Airbench94()
    counts = count_params(model)
    assert counts["total"] == N_PARAMS == 1_972_792
    # frozen: whitening conv weight (288) + bias (24) and the BN weights (1,152)
    assert counts["frozen"] == 288 + 24 + 2 * (64 + 256 + 256)
    assert counts["trainable"] == 1_971_328
    assert not model.whiten.weight.requires_grad and not model.whiten.bias.requires_grad
    bns = [m for m in model.modules() if isinstance(m, GhostBatchNorm)]
    assert len(bns) == 6 and all(not m.weight.requires_grad and m.bias.requires_grad for m in bns)


def test_forward_backward_on_cpu():
    model = small_model(ghost=4)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(10, (8,))
    out = model(x)
    assert out.shape == (8, 10) and torch.isfinite(out).all()
    F.cross_entropy(out, y).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_whitening_filters_whiten_patches():
    torch.manual_seed(1)
    mix = torch.randn(3, 3)
    imgs = torch.einsum("ij,njhw->nihw", mix, torch.randn(64, 3, 32, 32))  # correlated channels
    imgs = imgs + 0.5 * imgs.roll(1, dims=-1)                                 # and pixels
    conv = torch.nn.Conv2d(3, 24, 2, bias=True)
    evals = init_whitening(conv, imgs, eps=5e-4)
    assert torch.all(evals[:-1] >= evals[1:])                      # largest first
    w = conv.weight.reshape(24, 12).double()
    assert torch.allclose(w[12:], -w[:12])                         # +/- pairs
    cov = patch_second_moment(imgs)
    out_cov = w[:12] @ cov @ w[:12].T                              # = diag(l / (l + eps))
    assert torch.allclose(out_cov, torch.diag(evals / (evals + 5e-4)), atol=1e-4)


# ------------------------------------------------------------------ BatchNorm handling

def test_ghost_batchnorm_equals_separate_minibatches():
    model = small_model(ghost=8).train()
    x = torch.randn(24, 3, 32, 32)
    joint = model(x)
    model.set_ghost_batch(0)
    separate = torch.cat([model(c) for c in x.split(8)])
    assert torch.allclose(joint, separate, atol=1e-5)


def test_gradients_leave_bn_buffers_alone_and_large_batch_is_mean_of_minibatches():
    data = synthetic(n_train=32)
    model = small_model(ghost=8)
    oracle = CifarOracle(model, data.train_x, data.train_y, 8, max_chunk=16)
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    gen = torch.Generator().manual_seed(0)
    x, y = oracle.sample(gen, batches=4)                    # 32 images: 2 chunks of 16
    g_large = oracle.grad(params, (x, y))
    g_small = [oracle.grad(params, (xs, ys)) for xs, ys in zip(x.split(8), y.split(8))]
    for i, g in enumerate(g_large):
        mean = sum(gs[i] for gs in g_small) / 4
        assert torch.allclose(g, mean, atol=1e-5, rtol=1e-4)
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), f"{k} changed during gradient evaluations"


def test_recalibration_sets_pooled_statistics_and_eval_matches_train_mode():
    model = small_model(ghost=0)
    x = normalize(synthetic(n_train=48).train_x)
    recalibrate_bn(model, x.split(16))
    assert not model.training
    # first BN: its input does not depend on any other BN, so compare with the pooled moments
    with torch.no_grad():
        h = model.group1.pool(model.group1.conv1(model.activ(model.whiten(x))))
    bn = model.group1.norm1
    n = h.numel() // h.shape[1]
    assert torch.allclose(bn.running_mean, h.mean((0, 2, 3)), atol=1e-5)
    assert torch.allclose(bn.running_var, h.var((0, 2, 3)) , rtol=1e-4, atol=1e-6)
    assert int(bn.num_batches_tracked) == 1 and n == 48 * 15 * 15
    # calibrated on exactly one batch, eval mode reproduces train mode on that batch
    recalibrate_bn(model, [x])
    with torch.no_grad():
        eval_out = model(x)
        train_out = model.train()(x)
    assert torch.allclose(eval_out, train_out, atol=2e-3, rtol=1e-2)


def test_evaluator_leaves_model_in_train_mode_and_is_deterministic():
    cfg = cfg_for("profile=cpu", "method=gluon", "batch_size=8", "task.eval_train=32",
                  "task.eval_test=16", "steps=4", "log_every=1", "eval_every=2")
    method, evaluate = build(cfg, validate(cfg), data=synthetic())[:2]
    a, b = evaluate(method), evaluate(method)
    assert a == b and set(a) == {"loss", "test_loss", "test_acc"}
    assert method.workers[0].oracle.model.training
    method.k = 1
    assert set(evaluate(method)) == {"loss"}                # test metrics every eval_every steps
    bad = cfg_for("profile=cpu", "method=gluon", "log_every=10", "eval_every=15")
    with pytest.raises(ValueError, match="multiple of log_every"):
        validate(bad, cnn_task)                             # refused before any data


# ------------------------------------------------------------------ LMOs

def test_lmo_for_every_layer():
    cfg = cfg_for("profile=cpu", "method=alg1", "batch_size=8")
    method, extra = build(cfg, validate(cfg), data=synthetic())[::2]
    model = method.workers[0].oracle.model
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    blocks = method.update.blocks
    assert [b.name for b in blocks] == names and len(names) == 13
    for name, block in zip(names, blocks):
        # Scion's airbench radii: r for the convs and the BN biases, 16 r for the Sign head
        if name == "head.weight":
            assert type(block.lmo) is Sign and block.lmo.scale and block.scale == 16.0
        elif name.endswith("conv1.weight") or name.endswith("conv2.weight"):
            assert type(block.lmo) is Spectral and block.lmo.ns_steps == 5 and block.lmo.scale
            assert block.scale == 1.0
        else:
            assert name.endswith("bias") and "norm" in name and type(block.lmo) is RMS
            assert block.scale == 1.0
    assert "whiten.weight" not in names and "whiten.bias" not in names
    assert extra["lmo"]["head.weight"].startswith("Sign")
    # the parameters the method updates are the module's own (shared storage)
    for p, (_, q) in zip(method.params, [(n, q) for n, q in model.named_parameters() if q.requires_grad]):
        assert p.data_ptr() == q.data_ptr()


# ------------------------------------------------------------------ data

def _write_folder(root: Path, split: str, colours: dict) -> None:
    from torchvision.io import write_jpeg
    for cls, rgb in colours.items():
        d = root / split / cls
        d.mkdir(parents=True)
        for i in range(3):
            img = torch.tensor(rgb, dtype=torch.uint8).view(3, 1, 1).expand(3, 32, 32).clone()
            img[:, :, :i] = 0   # a different image per file: i black columns
            write_jpeg(img, str(d / f"{i:04d}.jpg"), quality=95)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # torchvision.io's write_jpeg
def test_image_folder_loader_and_uint8_cache(tmp_path, monkeypatch):
    colours = {"bird": (200, 30, 30), "airplane": (30, 200, 30)}   # written in unsorted order
    export = tmp_path / "data" / "cifar10-jpeg"
    for split in ("train", "test"):
        _write_folder(export, split, colours)
    cache = tmp_path / "cache"
    data = load_cifar10(tmp_path / "data", cache, source="jpeg", download=False)
    assert data.classes == ["airplane", "bird"]                     # ImageFolder's order
    assert data.train_x.shape == (6, 3, 32, 32) and data.train_x.dtype == torch.uint8
    assert data.train_y.tolist() == [0, 0, 0, 1, 1, 1] and len(data.test_y) == 6
    centre = data.train_x[:, :, 16, 20].float()
    assert (centre[:3] - torch.tensor([30.0, 200, 30])).abs().max() < 12   # JPEG is lossy
    assert (centre[3:] - torch.tensor([200.0, 30, 30])).abs().max() < 12
    assert data.train_x[2, :, :, 0].float().mean() < 20                    # 2 black columns
    assert data.label == "CIFAR-10 (JPEG export)" and data.info()["data"] == "CIFAR-10 (JPEG export)"
    cached = list(cache.glob("*.pt"))
    assert len(cached) == 1
    # the second load comes from the cache: nothing is decoded
    from experiments.tasks import cifar10
    with monkeypatch.context() as m:
        m.setattr(cifar10, "read_image_folder", lambda *a: pytest.fail("decoded again"))
        again = load_cifar10(tmp_path / "data", cache, source="jpeg", download=False)
    assert torch.equal(again.train_x, data.train_x) and torch.equal(again.test_y, data.test_y)
    for split in ("train", "test"):
        (export / split).rename(tmp_path / f"moved-{split}")
    # the tarball form gives the same tensors
    for split in ("train", "test"):
        with tarfile.open(export / f"{split}.tar.gz", "w:gz") as tar:
            tar.add(tmp_path / f"moved-{split}", arcname=split)
    from_tar = load_cifar10(tmp_path / "data", None, source="jpeg", download=False)
    assert torch.equal(from_tar.train_x, data.train_x) and from_tar.classes == data.classes


def test_missing_dataset_error_lists_every_place(tmp_path, monkeypatch):
    dirs = [tmp_path / "a", tmp_path / "b"]
    monkeypatch.setattr(tasks, "candidate_dirs", lambda data_dir=None: list(dirs))
    with pytest.raises(tasks.DataNotFoundError) as err:
        load_cifar10(None, tmp_path / "cache", source="auto", download=False)
    msg = str(err.value)
    for d in dirs:
        assert str(d / "cifar-10-batches-py") in msg
        assert str(d / "cifar10-jpeg") in msg
    assert "download disabled" in msg and "GLUON_DATA_DIR" in msg and "cifar-10-python.tar.gz" in msg


def test_augmentation_is_reproducible_and_shape_preserving():
    x = normalize(synthetic(n_train=16).train_x)
    a = augment(x, torch.Generator().manual_seed(3))
    b = augment(x, torch.Generator().manual_seed(3))
    c = augment(x, torch.Generator().manual_seed(4))
    assert a.shape == x.shape and torch.equal(a, b) and not torch.equal(a, c)
    # with translate = 0 every image is itself or its mirror image
    f = augment(x, torch.Generator().manual_seed(0), translate=0)
    same = (f == x).flatten(1).all(1) | (f == x.flip(-1)).flatten(1).all(1)
    assert same.all()


# ------------------------------------------------------------------ short runs

def test_overrides_compose():
    cfg = cfg_for("method=alg2", "compressor.density=0.05", "method.q=0.2", "method.B=2",
                  "method.beta=0.8", "method.lr=0.03", "steps=7", "seed=3", "n_workers=2",
                  "batch_size=8", "profile=cpu")
    assert cfg.compressor.name == "topk" and cfg.compressor.density == 0.05
    assert (cfg.method.q, cfg.method.B, cfg.method.beta, cfg.method.lr) == (0.2, 2, 0.8, 0.03)
    assert (cfg.steps, cfg.seed, cfg.n_workers, cfg.batch_size) == (7, 3, 2, 8)
    assert cfg.task.name == "cnn" and cfg.device == "cpu"
    assert cfg_for("method=gluon").compressor.name == "identity"
    # the CPU panel: experiment + tuned settings beat the CNN defaults; the command line beats both
    for name, comp in [("gluon", "identity"), ("alg1", "randk"), ("alg2", "topk"),
                       ("ef21_muon", "topk")]:
        cfg = cfg_for("experiment=fig2_cnn_cpu", f"tuned=fig2_cnn_cpu/{name}")
        assert (cfg.method.name, cfg.compressor.name) == (name, comp)
        assert (cfg.max_comm, cfg.steps, cfg.log_every, cfg.log_comm, cfg.eval_every) == \
            (500, 6000, 0, 1.0, 0)
        assert list(cfg.task.widths) == [16, 64, 64] and cfg.task.eval_test is None
        validate(cfg)
    assert cfg_for("tuned=fig2_cnn_cpu/alg1", "method.lr=0.3").method.lr == 0.3


@pytest.mark.parametrize("method,extra", [
    ("gluon", []),
    ("alg1", ["compressor=randk", "compressor.density=0.01", "method.q=0.5", "method.B=2"]),
    ("alg2", ["compressor=topk", "compressor.density=0.01", "method.q=0.5", "method.B=2"]),
])
def test_short_run_loss_falls(method, extra, tmp_path):
    cfg = cfg_for(f"method={method}", *extra, "profile=cpu", "steps=12", "log_every=4",
                  "eval_every=12", "batch_size=4", "method.lr=0.05", "method.beta=0.5",
                  "task.eval_train=16", "task.eval_test=16", "task.whiten_images=64",
                  "checkpoint_every=0", f"results_dir={tmp_path}")
    task = SimpleNamespace(check=cnn_task.check, build=partial(build, data=synthetic()))
    summary = execute(cfg, tmp_path / "run", task)
    assert summary["status"] == "ok" and summary["steps_done"] == 12
    # the cpu profile narrows the widths to 16/64/64: 127,096 parameters
    assert summary["n_params"] == 127_096 == count_params(Airbench94(widths=(16, 64, 64)))["total"]
    assert summary["data"] == "synthetic"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 4, 8, 12]
    assert "test_acc" in rows[0] and "test_acc" in rows[-1] and "test_acc" not in rows[1]
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0], losses
    assert rows[-1]["comm"] > 0


# ------------------------------------------------------------------ the CPU fast path

def test_cpu_fast_path_keeps_delta_exact_and_gradients_and_losses_close():
    """task.amp_cpu (bf16 autocast on CPU, docs/cnn.md) against the fp32 reference: Delta (the
    difference of two gradients, which bf16 rounding would swamp) is computed in fp32 on both
    paths, bit for bit; a minibatch gradient moves by less than a tenth of the distance to
    another minibatch's gradient (bf16 keeps 8 bits of mantissa: about 6% of the gradient's norm
    here); the training loss after 20 Gluon steps, evaluated on each path, by less than 5%."""
    def built(fast):
        cfg = cfg_for("method=gluon", "compressor=identity", "task.widths=[8,16,16]",
                      "n_workers=2", "steps=20", "log_every=20", "eval_every=0",
                      "task.eval_train=32", "task.eval_test=16", "device=cpu",
                      f"task.amp_cpu={fast}")
        return build(cfg, validate(cfg), data=synthetic(n_train=128))

    ref, fast = built(False), built(True)
    assert fast.method.workers[0].oracle.amp and not ref.method.workers[0].oracle.amp
    o_ref, o_fast = ref.method.workers[0].oracle, fast.method.workers[0].oracle
    batch = o_ref.sample(torch.Generator().manual_seed(0))
    params = [p.clone() for p in ref.method.params]
    prev = [p + 1e-3 * torch.randn_like(p) for p in params]
    for a, b in zip(o_ref.grad_diff(params, prev, batch), o_fast.grad_diff(params, prev, batch)):
        assert torch.equal(a, b)
    flat = lambda o, b: torch.cat([g.flatten() for g in o.grad(params, b)])
    g_ref, g_fast = flat(o_ref, batch), flat(o_fast, batch)
    other = flat(o_ref, o_ref.sample(torch.Generator().manual_seed(1)))
    err, noise = float((g_fast - g_ref).norm()), float((other - g_ref).norm())
    assert 0 < err < 0.1 * noise
    for b in (ref, fast):
        for _ in range(20):
            b.method.step()
    l_ref, l_fast = ref.evaluate(ref.method)["loss"], fast.evaluate(fast.method)["loss"]
    assert l_fast != l_ref and abs(l_fast / l_ref - 1) < 0.05


def test_cpu_fast_path_large_batch_gradient_in_chunks_stays_within_sampling_noise():
    """The study's use of the fast path: Alg. 1's large-batch gradient (B minibatches in one
    sample, evaluated in chunks of task.max_chunk images). In fp32, chunking changes it only by
    float rounding (ghost-batch BN: the mean over ghost batches either way). Under bf16 autocast,
    in chunks, it moves from the fp32 one-pass gradient by less than a quarter of the distance to
    another large batch's gradient: bf16 adds at most 2 x 0.25^2 = 1/8 to its sampling variance."""
    def built(fast, chunk):
        cfg = cfg_for("method=alg1", "compressor=randk", "method.B=8", "task.widths=[8,16,16]",
                      "n_workers=2", "steps=1", "log_every=1", "eval_every=0",
                      "task.eval_train=32", "task.eval_test=16", "device=cpu",
                      f"task.amp_cpu={fast}", f"task.max_chunk={chunk}")
        return build(cfg, validate(cfg), data=synthetic(n_train=256))

    ref, chunked, fast = built(False, 1024), built(False, 32), built(True, 32)
    o_ref, o_chunked, o_fast = (b.method.workers[0].oracle for b in (ref, chunked, fast))
    assert (o_ref.max_chunk, o_chunked.max_chunk, o_fast.max_chunk) == (1024, 32, 32)
    assert o_fast.amp and not o_chunked.amp
    params = [p.clone() for p in ref.method.params]
    batch = o_ref.sample(torch.Generator().manual_seed(0), batches=8)       # 128 images: 4 chunks
    flat = lambda o, b: torch.cat([g.flatten() for g in o.grad(params, b)])
    g_ref, g_chunked, g_fast = flat(o_ref, batch), flat(o_chunked, batch), flat(o_fast, batch)
    other = flat(o_ref, o_ref.sample(torch.Generator().manual_seed(1), batches=8))
    assert float((g_chunked - g_ref).norm()) < 1e-5 * float(g_ref.norm())
    err, noise = float((g_fast - g_ref).norm()), float((other - g_ref).norm())
    assert 0 < err < 0.25 * noise


@pytest.mark.parametrize("native", [True, False])
def test_the_cpu_fast_path_warns_where_bf16_is_emulated(native, monkeypatch, caplog):
    """On a CPU without native bf16 (AVX2 only) the fast path is emulated and several times
    slower than fp32: the run says so when it starts, and only there."""
    monkeypatch.setattr(cnn_task, "cpu_has_native_bf16", lambda: native)
    cfg = cfg_for("method=gluon", "compressor=identity", "task.widths=[8,16,16]", "n_workers=2",
                  "steps=1", "eval_every=0", "task.eval_train=32", "task.eval_test=16",
                  "device=cpu", "task.amp_cpu=true")
    with caplog.at_level(logging.WARNING, logger="experiments.run"):
        build(cfg, validate(cfg), data=synthetic(n_train=64))
    warned = [r for r in caplog.records if "without native bf16" in r.getMessage()]
    assert len(warned) == (0 if native else 1)


def test_a_runs_record_names_its_data_folder_relative_to_the_repository_not_the_machine(tmp_path, monkeypatch):
    from experiments.tasks import cifar10
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    origin = str(tmp_path / "shared" / "data" / "cifar10-jpeg")      # an absolute GLUON_DATA_DIR
    assert cifar10._shown(origin) == os.path.join("..", "shared", "data", "cifar10-jpeg")
    assert cifar10._shown("https://example.org/cifar.tar.gz") == "https://example.org/cifar.tar.gz"
