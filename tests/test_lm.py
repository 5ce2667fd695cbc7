"""The character-level language model task (docs/lm.md): the model, its LMOs, the workers' data,
the evaluation, and the run's behaviour (determinism, resume, refusals). A tiny GPT throughout."""
from __future__ import annotations

import io
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from experiments.run import lifecycle as runner
from experiments.run.config import ConfigError, validate
from experiments.run.lifecycle import execute
from experiments.shared.files import REPO
from experiments.shared.runs import read_summary
from experiments.tasks import (DataCorruptError, DataNotFoundError, ResolvedConfig, lm,
                               shakespeare)
from experiments.tasks.gpt import GPT, GPTShape
from experiments.tasks.shakespeare import Text, shard_ranges, unigram_kl
from gluon.lmo import RMS, Sign, Spectral, assign_lmos
from tests.conftest import compose_config, metrics_bytes, stopping_train, untimed

TINY = ["profile=lm/cpu", "task.n_layer=1", "task.n_head=2", "task.n_embd=16",
        "task.block_size=16", "batch_size=4", "task.eval_train=8", "task.eval_val=8",
        "wandb.mode=disabled", "progress_s=0"]


def cfg_for(*overrides):
    return compose_config("lm", *TINY, *overrides)


def resolved(cfg):
    """A composed config as a task receives it: resolved once, read-only."""
    return ResolvedConfig.of(cfg).cfg


def positional_text(n: int = 4000) -> Text:
    """A "text" whose every token is its own position: windows show where they were cut."""
    return Text(torch.arange(n), "".join(chr(0x100 + i) for i in range(n)), "positions", "-")


def built(*overrides, text=None):
    cfg = resolved(cfg_for(*overrides))
    return lm.build(cfg, validate(cfg, lm), text=text)


# ------------------------------------------------------------------ the model

def reference_logits(model: GPT, idx):
    """nanoGPT's forward written out: LayerNorm, per-head causal softmax attention, exact GELU,
    tied head (no dropout)."""
    s, tr = model.shape, model.transformer

    def ln(x, mod):
        mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * mod.weight + (0 if mod.bias is None else mod.bias)

    b, t = idx.shape
    x = tr.wte.weight[idx] + tr.wpe.weight[:t]
    hd = s.n_embd // s.n_head
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    for block in tr.h:
        a, h = block.attn, ln(x, block.ln_1)
        q, k, v = (h @ lin.weight.T for lin in (a.c_q, a.c_k, a.c_v))
        heads = []
        for j in range(s.n_head):
            sl = slice(j * hd, (j + 1) * hd)
            att = (q[..., sl] @ k[..., sl].transpose(1, 2)) / math.sqrt(hd)
            heads.append(torch.softmax(att.masked_fill(mask, -math.inf), -1) @ v[..., sl])
        x = x + torch.cat(heads, -1) @ a.c_proj.weight.T
        u = ln(x, block.ln_2) @ block.mlp.c_fc.weight.T
        x = x + (0.5 * u * (1 + torch.erf(u / math.sqrt(2)))) @ block.mlp.c_proj.weight.T
    return ln(x, tr.ln_f) @ tr.wte.weight.T


def test_the_forward_is_nanogpts_written_out():
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab=11, block_size=8, n_layer=2, n_head=2, n_embd=12)).eval()
    for p in model.parameters():                     # every weight away from its initialisation
        p.data.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(11, (3, 8))
    assert torch.allclose(model(idx), reference_logits(model, idx), atol=1e-5)
    assert model.lm_head.weight is model.transformer.wte.weight      # tied, counted once
    assert sum(p.numel() for p in model.parameters()) == 11 * 12 + 8 * 12 + 2 * (12 * 12 * 12 + 2 * 12) + 12
    with pytest.raises(ValueError, match="context"):
        model(torch.randint(11, (1, 9)))


# ------------------------------------------------------------------ the LMOs

def test_every_parameter_gets_scions_nanogpt_lmo_and_radius():
    """Spectral (1x) on every hidden matrix, sign (1/d_in) at 60x on the tied embedding and head,
    RMS (1x) on the position embedding, the LayerNorm gains and biases and the Linear biases."""
    b = built("task.n_layer=2", "task.bias=true")
    expect = {"transformer.wte.weight": "Sign() x60", "transformer.wpe.weight": "RMS() x1",
              "transformer.ln_f.weight": "RMS() x1", "transformer.ln_f.bias": "RMS() x1"}
    for i in range(2):
        h = f"transformer.h.{i}."
        for m in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            expect[h + m + ".weight"] = "Spectral(ns_steps=5, scale=True) x1"
            expect[h + m + ".bias"] = "RMS() x1"
        for ln in ("ln_1", "ln_2"):
            expect[h + ln + ".weight"] = expect[h + ln + ".bias"] = "RMS() x1"
    assert b.summary["lmo"] == expect
    # the embedding's step is Scion's Sign: (1/d_in) sign(g), d_in the width (g: vocab x width)
    blocks = b.method.update.blocks
    g = torch.randn(65, 16)
    assert isinstance(blocks[0].lmo, Sign)
    assert torch.equal(blocks[0].lmo(g), -torch.sign(g) / 16)
    # the radius scale is a setting; the config's own rules come first
    cfg = resolved(cfg_for())
    named = [(n, p.shape) for n, p in lm.make_model(cfg.task, 65).named_parameters()]
    rules = lm.lmo_rules(30.0, first=[("wpe", "sign", 2.0)])
    got = {bl.name: (type(bl.lmo), bl.scale) for bl in assign_lmos(named, rules)}
    assert got["transformer.wte.weight"] == (Sign, 30.0)
    assert got["transformer.wpe.weight"] == (Sign, 2.0)
    assert got["transformer.h.0.mlp.c_fc.weight"] == (Spectral, 1.0)
    assert got["transformer.ln_f.weight"] == (RMS, 1.0)


# ------------------------------------------------------------------ the workers' data

@pytest.mark.parametrize("split", ["iid", "plays"])
def test_windows_stay_in_their_range_and_never_touch_the_validation_text(split):
    text = positional_text()
    b = built(f"task.split={split}", text=text)
    n_train, T = text.n_train, 16
    ranges = shard_ranges(n_train, 4, split)
    seen = []
    for w in b.method.workers:
        x, y, seed = w.oracle.sample(w.gen, batches=50)
        lo, hi = ranges[w.rank]
        assert seed is None and x.shape == y.shape == (200, T)
        assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, 0], x[:, 0] + 1)
        assert int(x.min()) >= lo and int(y.max()) < hi <= n_train
        seen.append(set(x[:, 0].tolist()))
    if split == "plays":                   # contiguous, equal, disjoint quarters of the training text
        assert ranges == [(i * (n_train // 4), (i + 1) * (n_train // 4)) for i in range(4)]
        assert all(not (seen[i] & seen[j]) for i in range(4) for j in range(i))
    else:
        assert ranges == [(0, n_train)] * 4
    ev = b.evaluate
    assert int(ev.train[1].max()) < n_train                       # training windows: train text
    assert int(ev.val[0].min()) >= n_train and int(ev.full[0].min()) >= n_train
    full = ev.full[1].flatten()                    # every validation target once, in order
    assert torch.equal(full, torch.arange(n_train + 1, n_train + 1 + len(full)))
    assert len(text.tokens) - (n_train + 1 + len(full)) < T


def test_shard_kl_is_the_unigram_kl_to_the_whole():
    tokens = torch.tensor([0, 0, 1, 2, 1, 1, 2, 2])
    ranges = [(0, 4), (4, 8)]
    p = torch.tensor([2, 3, 3]) / 8.0
    q0 = torch.tensor([2, 1, 1]) / 4.0
    q1 = torch.tensor([0, 2, 2]) / 4.0
    want = [float((q0 * (q0 / p).log()).sum()), float((q1[1:] * (q1[1:] / p[1:]).log()).sum())]
    assert unigram_kl(tokens, ranges, 3) == pytest.approx(want)
    assert unigram_kl(tokens, [(0, 8)] * 2, 3) == [0.0, 0.0]


# ------------------------------------------------------------------ evaluation and determinism

def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_is_deterministic_for_its_seed_and_logs_the_validation_loss(tmp_path):
    over = ["method=alg1", "compressor.density=0.05", "method.B=2", "method.q=0.5", "steps=6",
            "method.lr=0.005",
            "log_every=3", "checkpoint_every=0", f"results_dir={tmp_path}"]
    a = execute(cfg_for(*over), tmp_path / "a", lm)
    b = execute(cfg_for(*over), tmp_path / "b", lm)
    c = execute(cfg_for(*over, "seed=1"), tmp_path / "c", lm)
    assert a["status"] == "ok" and metrics_bytes(tmp_path / "a") == metrics_bytes(tmp_path / "b")
    assert metrics_bytes(tmp_path / "a") != metrics_bytes(tmp_path / "c")
    rows = rows_of(tmp_path / "a")
    assert [r["step"] for r in rows] == [0, 3, 6]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["val_loss"]) for r in rows)
    assert "val_loss_full" not in rows[1] and untimed(a["final"]) == untimed(rows[-1])
    full = a["final"]["val_loss_full"]          # the whole validation text: near the 8 windows'
    assert 0 < full < math.log(65) + 0.5 and abs(full - rows[-1]["val_loss"]) < 0.2, rows[-1]
    assert a["eval"]["val_full_targets"] == (111_540 - 1) // 16 * 16
    assert a["shards"][0]["kl_nats"] == 0.0 and a["data_sha256"] == shakespeare.SHA256


def test_plays_shards_differ_from_the_whole_and_a_dropout_minibatch_is_one_function():
    b = built("task.split=plays", "task.dropout=0.5")
    kls = [s["kl_nats"] for s in b.summary["shards"]]
    assert all(k > 1e-3 for k in kls) and b.summary["shards"][3]["end"] <= 1_003_854
    w = b.method.workers[0]
    batch = w.oracle.sample(w.gen)
    assert batch[2] is not None
    params = b.method.params
    moved = [p + 0.01 for p in params]
    same = w.oracle.grad_diff(params, [p.clone() for p in params], batch)   # same point, same masks
    assert all(float(d.abs().max()) == 0.0 for d in same)
    d1, d2 = (w.oracle.grad_diff(params, moved, batch) for _ in range(2))
    assert all(torch.equal(a, c) for a, c in zip(d1, d2))


# ------------------------------------------------------------------ the run folder

def test_an_interrupted_run_resumes_bit_identically(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="experiments")
    over = ["method=alg2", "compressor=topk", "compressor.density=0.05", "method.B=2",
            "method.q=0.3", "steps=12", "log_every=2", "checkpoint_every=4",
            "keep_checkpoint=true", f"results_dir={tmp_path}"]
    execute(cfg_for(*over), tmp_path / "ref", lm)
    real = runner.train
    monkeypatch.setattr(runner, "train", stopping_train(real, 6))     # after the checkpoint at 4
    with pytest.raises(KeyboardInterrupt):
        execute(cfg_for(*over), tmp_path / "run", lm)
    assert read_summary(tmp_path / "run") is None
    monkeypatch.setattr(runner, "train", real)
    execute(cfg_for(*over), tmp_path / "run", lm)
    assert "[resume]" in caplog.text
    assert metrics_bytes(tmp_path / "ref") == metrics_bytes(tmp_path / "run")
    ref, run = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=False)["method"]
                for d in ("ref", "run"))
    for key in ("params", "prev", "g", "M"):
        assert all(torch.equal(x, y) for x, y in zip(ref[key], run[key])), key
    # a damaged record is found and recomputed
    with open(tmp_path / "run" / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 99}\n')
    execute(cfg_for(*over), tmp_path / "run", lm)
    assert "[damaged]" in caplog.text
    assert metrics_bytes(tmp_path / "ref") == metrics_bytes(tmp_path / "run")


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("override,message", [
    ("task.split=dirichlet", "task.split=dirichlet: choose one of iid, plays"),
    ("task.n_head=3", "task.n_embd=16: must be a multiple of task.n_head=3"),
    ("task.dropout=1.5", "task.dropout=1.5: must be in [0, 1)"),
    ("task.block_size=0", "task.block_size=0: must be >= 1"),
    ("task.embed_scale=0", "task.embed_scale=0.0: must be > 0"),
    ("task.lmo_rules=[[wpe,nuclear,1.0]]", "task.lmo_rules: ['wpe', 'nuclear', 1.0] is not"),
    ("+task.vocab=100", "+task.vocab: no such key"),
    ("device=gpu", "device=gpu: must be auto, cpu, cuda"),
])
def test_bad_settings_are_refused_before_any_data(override, message):
    with pytest.raises(ConfigError) as err:
        validate(cfg_for(override), lm)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_too_many_workers_for_the_plays_split_is_refused():
    validate(cfg_for("task.split=iid", "n_workers=100000"), lm)
    with pytest.raises(ConfigError, match="too few for windows"):
        validate(cfg_for("task.split=plays", "n_workers=100000"), lm)


def test_missing_or_other_data_is_refused_naming_where_it_looked(tmp_path, monkeypatch):
    real = shakespeare.locate()[0]
    monkeypatch.delenv("GLUON_DATA_DIR", raising=False)      # data_dir is the only place looked
    cfg = resolved(cfg_for(f"data_dir={tmp_path}", "task.download=false"))
    with pytest.raises(DataNotFoundError) as err:
        lm.check_data(cfg)
    first, fix = str(err.value).split("\n")
    assert str(tmp_path / "text" / "tinyshakespeare.txt") in first and "download disabled" in first
    assert shakespeare.URL in fix
    assert lm.data_identity(cfg) is None
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "tinyshakespeare.txt").write_text("To be, or not to be\n")
    with pytest.raises(DataCorruptError, match="is not Tiny Shakespeare's"):
        lm.check_data(cfg)
    # a download is checked before it is written
    cfg = resolved(cfg_for(f"data_dir={tmp_path / 'fresh'}"))
    (tmp_path / "fresh").mkdir()
    for payload, ok in ((b"not the text", False), (real.read_bytes() if real else None, True)):
        if payload is None:
            continue
        monkeypatch.setattr(shakespeare.urllib.request, "urlopen",
                            lambda url, timeout: io.BytesIO(payload))
        if ok:
            lm.check_data(cfg)
            assert lm.data_identity(cfg) == shakespeare.SHA256
        else:
            with pytest.raises(DataCorruptError, match="nothing was written"):
                lm.check_data(cfg)
            assert not (tmp_path / "fresh" / "text").exists()


def test_the_command_line_refuses_in_one_line():
    env = {**os.environ, "WANDB_MODE": "disabled"}
    out = subprocess.run([sys.executable, "-m", "experiments.lm", *TINY, "task.split=speakers"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: task.split=speakers: choose one of iid, plays"


# ------------------------------------------------------------------ the figure's script

def fake_panel_run(root: Path, method: str, seed: int, losses, grads_per_row: float, **method_kw):
    d = root / method / f"seed={seed},{'-'.join(map(str, method_kw.values()))}"
    d.mkdir(parents=True)
    config = {"method": {"name": method, **method_kw}, "compressor": {"name": "randk"},
              "seed": seed, "max_comm": float(len(losses) - 1), "task": {"name": "lm"}}
    (d / "summary.json").write_text(json.dumps({"status": "ok", "config": config,
                                                "train_time": 1.0, "n_params": 10}))
    (d / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "comm": float(i), "bytes": 4.0 * i, "grads": grads_per_row * i,
                    "loss": v, "val_loss": v}) + "\n" for i, v in enumerate(losses)))


def test_the_study_says_what_its_runs_took(tmp_path):
    """compute.md: per split and part, the finished runs and their summed wall time, in hours
    of one core and, halved, on two."""
    from scripts.figures import lm as fig
    for part, seconds in (("tune", [1800.0, 3600.0]), ("panel", [7200.0])):
        for seed, wall in enumerate(seconds):
            fake_panel_run(tmp_path / "iid" / part, "gluon", seed, [3.0, 2.0], 1.0, lr=0.02)
            summary = next((tmp_path / "iid" / part / "gluon").glob(f"seed={seed},*/summary.json"))
            s = json.loads(summary.read_text())
            summary.write_text(json.dumps({**s, "wall_time": wall}))
    text = fig.compute_spent(tmp_path, tmp_path / "out")
    assert "| iid | tune | 2 | 1.5 | 0.8 |" in text and "| iid | panel | 1 | 2.0 | 1.0 |" in text
    assert "| plays | tune | 0 | 0.0 | 0.0 |" in text and "In all 3.5 hours of one core, 1.8 on 2" in text
    assert (tmp_path / "out" / "compute.md").read_text() == text


def test_the_figure_script_reads_a_panel_and_caps_ef21_muon_at_alg1s_gradients(tmp_path):
    from scripts.figures import lm as fig
    panel, tune = tmp_path / "panel", tmp_path / "tune"
    for seed in (0, 1, 2):
        fake_panel_run(panel, "gluon", seed, [4.0 - 0.1 * i for i in range(21)], 1.0, lr=0.02)
        fake_panel_run(panel, "alg1", seed, [4.0 - 0.2 * i for i in range(11)] + [2.0] * 10,
                       30.0 + seed, lr=0.001, B=16)
        fake_panel_run(panel, "large_batch_gluon", seed, [4.0 - 0.09 * i for i in range(21)],
                       16.0, lr=0.04, B=16)
        fake_panel_run(panel, "local_gluon", seed, [4.0 - 0.05 * i for i in range(21)], 16.0,
                       lr=0.0005, B=16)
    out = tmp_path / "out"
    assert fig.aggregate("iid", str(panel), out)
    rows = [r for r in fig.read_csv(out / "reduction.csv") if r["level"] == "baseline_final"
            and r["metric"] == "smoothed_first_hit" and r["method"] == "alg1"
            and r["baseline"] == "gluon"]
    assert rows and rows[0]["task"] == "lm_iid"
    assert rows[0]["reduction"] > 0.4                  # Alg. 1 reaches Gluon's level in half
    assert fig.grads_cap("iid", sweep=str(panel)) == pytest.approx(20 * 31.0)
    dec = {(r["method"], r["baseline"]): r for r in fig.read_csv(out / "decomposition.csv")}
    assert dec[("alg1", "gluon")]["task"] == "lm_iid" and dec[("alg1", "gluon")]["reading"] == "uplink"
    assert dec[("alg1", "gluon")]["reduction"] == pytest.approx(rows[0]["reduction"])
    assert dec[("alg1", "gluon")]["interval"] == "95% t-interval"          # 3 seeds
    block = fig.readme(out)
    assert block.startswith((out / "decomposition.md").read_text())
    assert "| lm_iid | uplink | Alg. 1 (RandK 1%) |" in block and "AdamW" in block
    for B, g in ((4, 10.0), (16, 40.0)):
        fake_panel_run(tune, "alg1", 100, [3.0] * 21, g, lr=0.001, B=B)
    tuned = tmp_path / "alg1.yaml"
    tuned.write_text("method:\n  name: alg1\n  lr: 0.001\n  B: 16\n")
    assert fig.grads_cap("iid", "tune", str(tune), tuned) == pytest.approx(20 * 40.0)
    fig.plot(out, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 10_000
    final = (out / "iid_final.md").read_text()        # the same last value in every seed
    assert "| gluon | 3 | 2.000 [2.000, 2.000] |" in final and "95% t-interval" in final


def test_the_final_table_gives_each_loss_with_its_t_interval(tmp_path):
    from statistics import stdev
    from experiments.shared.statistics import load_runs
    from scripts.figures import lm as fig
    for seed, end in enumerate((2.0, 2.1, 2.3)):
        fake_panel_run(tmp_path, "alg1", seed, [3.0, end], 10.0, lr=0.001)
    text = fig.final_table({"alg1": load_runs(tmp_path)})
    half = 4.3026527 * stdev([2.0, 2.1, 2.3]) / math.sqrt(3)
    assert f"| alg1 | 3 | 2.133 [{2.1333333 - half:.3f}, {2.1333333 + half:.3f}] |" in text
    assert text.splitlines()[2].endswith("| 1.0 | 10 | 1 |")   # uplink, gradients, steps


def test_a_method_whose_panel_is_still_running_is_left_out_and_said(tmp_path, capsys):
    """While the panel runs, a method short of the panel's seeds is left out by name (the
    reduction pairs seeds), and with no compressed method complete the block claims nothing.
    While a dense baseline waits, the others are read and none is called the best."""
    from scripts.figures import lm as fig
    panel, out = tmp_path / "panel", tmp_path / "out"
    for seed in (0, 1, 2):
        fake_panel_run(panel, "gluon", seed, [4.0 - 0.1 * i for i in range(21)], 1.0, lr=0.02)
        fake_panel_run(panel, "large_batch_gluon", seed, [4.0 - 0.09 * i for i in range(21)],
                       16.0, lr=0.04, B=16)
    fake_panel_run(panel, "alg1", 0, [4.0 - 0.2 * i for i in range(11)] + [2.0] * 10, 30.0,
                   lr=0.001, B=16)
    assert fig.aggregate("iid", str(panel), out)
    said = capsys.readouterr().out
    assert "[lm] iid panel: alg1 has 1 of 3 seeds; left out" in said
    assert "[lm] iid panel: the best dense baseline is undecided until local_gluon" in said
    assert {r["method"] for r in fig.read_csv(out / "reduction.csv")} <= {"gluon",
                                                                        "large_batch_gluon"}
    assert "alg1" not in (out / "iid_final.md").read_text()
    block = fig.readme(out)        # the lever alone is read; no compressed method is yet
    assert [line.split(" | ")[2] for line in block.splitlines() if line.startswith("| lm_iid")] \
        == ["large-batch Gluon (B = 16)"]
    assert "**lm_iid**: pending." in block and "best dense" not in block
    for seed in (1, 2):
        fake_panel_run(panel, "alg1", seed, [4.0 - 0.2 * i for i in range(11)] + [2.0] * 10,
                       30.0, lr=0.001, B=16)
    assert fig.aggregate("iid", str(panel), out)
    assert "| alg1 | 3 |" in (out / "iid_final.md").read_text()   # its final values are facts
    assert "| panel running |" in fig.readme(out)           # against Local Gluon: not yet
    assert "(best dense" not in fig.readme(out) and "undecided" in fig.readme(out)
    for seed in (0, 1, 2):
        fake_panel_run(panel, "local_gluon", seed, [4.0 - 0.05 * i for i in range(21)], 16.0,
                       lr=0.0005, B=16)
    assert fig.aggregate("iid", str(panel), out)
    assert "| lm_iid | uplink | Alg. 1 (RandK 1%) |" in fig.readme(out)
    assert {r["baseline"] for r in fig.read_csv(out / "reduction.csv")} >= {
        "gluon", "large_batch_gluon", "local_gluon"}


@pytest.mark.parametrize("page", ["README.md", "docs/lm.md"])
def test_the_pages_quote_the_committed_lm_tables(page, monkeypatch):
    """The README's and docs/lm.md's block `lm` is what `make fig-lm` writes from results/lm/."""
    import re
    from scripts.figures import lm as fig
    monkeypatch.chdir(REPO)
    m = re.search(r"<!-- lm:begin -->\n(.*?)<!-- lm:end -->", (REPO / page).read_text(), re.S)
    assert m, f"{page} has no lm:begin/lm:end block"
    assert m.group(1) == fig.quoted()["lm"]
    assert "1.88" in m.group(1)                           # AdamW beside nanoGPT's number


def test_docs_lm_quotes_the_committed_tuning_scores(monkeypatch):
    """docs/lm.md's block `lm-tuned` is what `make fig-lm` writes from results/lm/tune_scores_*.csv."""
    import re
    from scripts.figures import lm as fig
    monkeypatch.chdir(REPO)
    text = (REPO / "docs" / "lm.md").read_text()
    m = re.search(r"<!-- lm-tuned:begin -->\n(.*?)<!-- lm-tuned:end -->", text, re.S)
    assert m and m.group(1) == fig.tuning_table()
    assert "`configs/tuned/lm_iid/alg1.yaml`" in m.group(1)


def test_the_tuning_table_reads_each_axis_through_the_choice(tmp_path):
    """Each searched axis lists the points on the line through the choice (every other setting at
    the chosen one), the choice in bold; an axis held fixed is not listed; a point still missing
    a tuning seed cannot be chosen; the tuned config is named only where it holds the choice."""
    from experiments.shared.tables import write_csv
    from scripts.figures import lm as fig
    row = lambda lr, B, score, seeds=2: {"method": "alg1", "score": score, "range": 200.0,
                                         "final": 2.0 + score, "seeds": seeds, "method.lr": lr,
                                         "method.beta": 0.9, "method.q": 0.1, "method.B": B}
    write_csv([row(0.001, 4, 0.50), row(0.002, 4, 0.40), row(0.004, 4, 0.45),
               row(0.002, 16, 0.42), row(0.001, 16, 0.30),      # off the lr line of B = 4
               row(0.002, 1, 0.10, seeds=1)],                   # the best, one seed short
              tmp_path / "tune_scores_iid.csv")
    tuned = tmp_path / "configs" / "tuned"
    (tuned / "lm_iid").mkdir(parents=True)
    (tuned / "lm_iid" / "alg1.yaml").write_text("method:\n  lr: 0.001\n  B: 16\n  beta: 0.9\n  q: 0.1\n")
    table = fig.tuning_table(tmp_path, tuned)
    line = next(l for l in table.splitlines() if l.startswith("| Alg. 1"))
    assert "| 5 | B 16, q 0.1, lr 0.001, beta 0.9 | 0.3000 | 2.300 |" in line
    assert "B 4: 0.5000, **16: 0.3000**; lr **0.001: 0.3000**, 0.002: 0.4200 |" in line
    assert "beta" not in line.split("|")[6] and "`configs/tuned/lm_iid/alg1.yaml`" in line
    assert "plays: no selection yet" in table
    (tuned / "lm_iid" / "alg1.yaml").write_text("method:\n  lr: 0.002\n  B: 4\n  beta: 0.9\n  q: 0.1\n")
    assert "differs: rerun the selection" in fig.tuning_table(tmp_path, tuned)
    (tuned / "lm_iid" / "alg1.yaml").unlink()
    assert "none: on an edge, or not selected" in fig.tuning_table(tmp_path, tuned)


def test_the_vmap_probe_times_the_workers_own_gradients():
    """bench-lm --probe-vmap: the vmapped gradients equal the one-by-one ones (checked inside),
    and the three ways are timed."""
    import re
    from types import SimpleNamespace
    from scripts.bench import bench_lm
    args = SimpleNamespace(profile="lm/cpu", threads=1, density=0.01, q=0.1, set=[
        "task.n_layer=1", "task.n_head=2", "task.n_embd=16", "task.block_size=16", "batch_size=4",
        "task.eval_train=8", "task.eval_val=8"])
    line = bench_lm.workers_batched(args, repeats=1)
    times = re.findall(r"(one after another|vmap over the workers|one batch of all \(the floor\)) "
                       r"([0-9]+\.[0-9])", line)
    assert len(times) == 3 and all(float(t) > 0 for _, t in times)


def test_the_bench_prices_the_whole_study_from_its_grids():
    """make bench-lm's study price: every run of every tuning grid and of the 5-seed panel, on
    both splits. With every step costing 1 s of CPU for one unit of uplink and one gradient (and
    evaluation free), every run to the budget of 200 units, EF21-Muon's capped one included,
    costs 200 s."""
    from scripts.bench import bench_lm
    step = {"cpu": 1.0, "uplink": 1.0, "grads": 1.0}
    results = [{"method": m, "B": B, "kinds": {None: step}, "row": 0.0, "full": 0.0}
               for m, (_, takes) in bench_lm.SETTINGS.items()
               for B in ([4, 16] if "B" in takes else [None])]
    runs = sum(len(bench_lm.grid(m)) for m in bench_lm.SETTINGS) + 5 * len(bench_lm.SETTINGS)
    assert len(bench_lm.grid("gluon")) >= 16 and len(bench_lm.grid("alg1")) >= 6
    base = [r for r in bench_lm.grid("gluon")][:16]            # tune_gluon.yaml: 4 lr x 4 beta
    assert {r["method.lr"] for r in base} == {"0.005", "0.01", "0.02", "0.04"}
    edges = bench_lm.grid("gluon")[16:]                        # tune_gluon_edges.yaml: its keys win
    assert edges and {r["method.lr"] for r in edges} == {"0.04", "0.08"} \
        and all(r["seed"] == "100" for r in edges)
    assert not any(r.get("method.B") for r in bench_lm.grid("gluon"))   # large_batch_gluon apart
    text = bench_lm.study(results, q=0.1, log_comm=2.0)
    assert f"both splits {2 * runs * 200 / 3600:.1f} hours of one core" in text
    assert f"**{runs * 200 / 3600:.1f} hours on 2 cores**" in text


def test_make_lm_runs_runs_every_tuning_grid_on_both_splits():
    """Each grid of configs/experiment/lm/ (an edge extension included) is in `make lm-runs`'s loop,
    EF21-Muon's in a loop of their own (after the selection, capped), and has its mirror for the plays split
    that sets the split and the group: a grid added for iid alone would leave plays untuned."""
    import re
    folder = REPO / "configs" / "experiment" / "lm"
    every = {p.stem.removeprefix("tune_") for p in folder.glob("tune_*.yaml")}
    capped = {g for g in every if g.startswith("ef21_muon")}
    recipe = (REPO / "Makefile").read_text().split("\nlm-runs:")[1].split("\n\n")[0]
    loop = set(re.search(r"for m in ([\w ]+); do", recipe).group(1).split())
    assert loop == every - capped
    capped_loop = re.search(r"for e in ([\w ]+) \$\$own; do\s*\\\s*.*max_grads=\$\$cap", recipe)
    assert set(capped_loop.group(1).split()) == capped and "ef21_muon" in capped
    for name in every:
        mirror = (folder / "plays" / f"tune_{name}.yaml").read_text()
        assert f"- /experiment/lm/tune_{name}\n" in mirror
        assert "split: plays" in mirror and "group: lm/plays/tune" in mirror
    # plays' own extensions (an edge that chose on plays alone) run in its capped loop, after
    # the grid they extend, and build on that grid's plays mirror
    own = re.search(r"own=\$\$\(\[ \$\$s != plays \] \|\| echo ([\w ]+)\)", recipe)
    plays_only = {p.stem.removeprefix("tune_") for p in (folder / "plays").glob("tune_*.yaml")} - every
    assert own and set(own.group(1).split()) == plays_only
    for name in plays_only:
        assert name.startswith("ef21_muon") and "- /experiment/lm/plays/tune_ef21_muon\n" in \
            (folder / "plays" / f"tune_{name}.yaml").read_text()
