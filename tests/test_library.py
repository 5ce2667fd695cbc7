"""The library on its own: ``gluon`` needs torch and numpy, nothing of the experiment stack."""
from __future__ import annotations

import subprocess
import sys
import textwrap

EXPERIMENT_STACK = ("hydra", "omegaconf", "wandb", "pandas", "submitit", "scipy", "sklearn",
                    "matplotlib", "torchvision", "experiments", "paper")


def test_gluon_imports_and_trains_without_the_experiment_stack():
    """In a fresh interpreter where every experiment package fails to import, ``gluon`` imports,
    builds Alg. 1 on a toy problem and runs it, and none of those packages got loaded."""
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        BLOCKED = {EXPERIMENT_STACK!r}
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked: {{name}}")
        sys.meta_path.insert(0, Block())
        import torch, gluon
        from gluon.worker import Oracle
        class Quadratic(Oracle):
            def sample(self, gen, batches=1):
                return torch.randn(batches, generator=gen)
            def grad(self, params, batch):
                return [params[0] - 1 + 0.1 * batch.mean()]
        x = [torch.zeros(5)]
        m = gluon.simulate("alg1", x, [Quadratic(), Quadratic()],
                           compressor=gluon.make_compressor("randk", density=0.4),
                           lr=0.05, q=0.5, B=2)
        for _ in range(20):
            m.step()
        assert torch.isfinite(x[0]).all() and float((x[0] - 1).norm()) < 5 ** 0.5 - 0.5
        loaded = sorted({{k.split(".")[0] for k in sys.modules}} & set(BLOCKED))
        assert not loaded, loaded
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
