"""scripts/bench/gpu_check.py: the GPU check's whole logic on CPU (``--device cpu --tiny``), its
failure path, and its behaviour on a machine without a GPU (nothing checked, exit 0)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from scripts.bench import gpu_check

from experiments.shared.files import REPO


def run_script(*args, timeout=180):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "scripts.bench.gpu_check", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "check.json"
    proc = run_script("--device", "cpu", "--tiny", "--out", str(out))
    return proc, out


def test_tiny_cpu_run_passes_and_writes_every_number(tiny):
    proc, out = tiny
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "GPU check passed" in proc.stdout
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and r["failures"] == []
    assert r["device"] == "cpu" and r["tiny"] and r["profile"]["widths"] == [8, 16, 16]
    assert r["data"]["note"]
    assert set(r["methods"]) == set(gpu_check.METHODS)
    for name, m in r["methods"].items():
        assert m["ok"], name
        assert math.isfinite(m["steps_per_s"]) and m["steps_per_s"] > 0, name
        assert r["steps_per_s"][name] == m["steps_per_s"]
        assert math.isfinite(m["loss_start"]) and math.isfinite(m["loss_end"]), name
        assert m["params_finite"] and m["max_abs_change"] > 0 and m["steps"] == 3, name


def test_tiny_cpu_delta_comparison(tiny):
    d = json.loads(tiny[1].read_text())["delta"]
    for key in ("rel_err_bf16_vs_fp32", "rel_err_bf16_vs_ieee_fp32",
                "rel_err_default_fp32_vs_ieee_fp32", "rel_err_bf16_grad", "rel_sampling_noise_grad",
                "randk_rel_noise_theory", "randk_rel_noise_empirical", "delta_norm_fp32"):
        assert math.isfinite(d[key]), key
    assert d["method_path_equals_fp32"] and d["fp32_repeat_bitwise_equal"]
    assert not d["method_path_equals_bf16"]           # bf16 really was computed, and differs
    assert d["rel_err_bf16_vs_fp32"] > 0                # reported, not a gate: grad_diff is fp32
    assert 0 < d["rel_err_bf16_grad"] < gpu_check.GRAD_MARGIN * d["rel_sampling_noise_grad"]
    assert d["bf16_grad_err_over_sampling_noise"] < gpu_check.GRAD_MARGIN
    # RandK 1%: relative noise sqrt(d/k - 1) ~ 10 (per-block k, so close to, not exactly, sqrt(99))
    assert 8 < d["randk_rel_noise_theory"] < 11
    theory = d["randk_rel_noise_theory"]
    assert 0.5 * theory < d["randk_rel_noise_empirical"] < 2 * theory


def test_tiny_cpu_distributed_equals_simulation(tiny):
    dist = json.loads(tiny[1].read_text())["distributed"]
    assert dist["ok"] and dist["world"] == 2 and dist["backend"] == "gloo"
    assert 0 < dist["simulation_syncs"] < dist["steps"]       # both coin outcomes
    assert set(dist["runs"]) == set(gpu_check.DIST_DENSE)
    for mode, run in dist["runs"].items():
        assert run["ok"] and run["params_close"] and run["ledgers_equal"], mode
        assert run["max_abs_param_diff"] <= dist["atol"], mode
        assert run["measured_bytes_per_worker"] == run["ledger"]["bytes"], mode
        assert run["ledger"] == run["simulation_ledger"], mode


def test_a_mismatch_fails_loudly_and_still_writes_the_json(tmp_path):
    out = tmp_path / "check.json"
    # atol < 0: no parameter difference can pass, so the distributed comparison must fail
    proc = run_script("--device", "cpu", "--tiny", "--synthetic", "--methods", "gluon",
                      "--atol", "-1", "--out", str(out))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "GPU CHECK FAILED" in proc.stderr
    r = json.loads(out.read_text())
    assert r["status"] == "failed" and any("distributed" in f for f in r["failures"])
    assert r["methods"]["gluon"]["ok"]


def test_without_cuda_nothing_is_checked_and_exit_is_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "check.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "no GPU found" in said and "nothing was checked" in said
    assert not out.exists()
    assert gpu_check.main(["--device", "cuda", "--out", str(out)]) == 2   # asked for, absent
    assert not out.exists()


def test_without_cuda_as_a_process(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.gpu_check", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "no GPU found" in proc.stdout
    assert not out.exists()


def test_tiny_cpu_lm_section(tiny):
    """The LM task's GPT: Gluon and Alg. 1 step, their validation loss stays finite, the
    parameters change, and Alg. 1 (RandK 1%, q = 0.1) sends less than Gluon's one unit a step."""
    lm = json.loads(tiny[1].read_text())["lm"]
    assert set(lm["methods"]) == set(gpu_check.LM_METHODS) and lm["data"]
    for name, m in lm["methods"].items():
        assert m["ok"] and m["params_finite"] and m["max_abs_change"] > 0, name
        assert math.isfinite(m["val_loss_start"]) and math.isfinite(m["val_loss_end"]), name
        assert m["steps"] == 3 and m["steps_per_s"] > 0 and m["model"]["n_embd"] == 16, name
    assert lm["methods"]["gluon"]["uplink_cost"] == 3
    assert lm["methods"]["alg1"]["uplink_cost"] < 3
