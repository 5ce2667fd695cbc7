"""docs/architecture.md's path of one run is the set of project files a run really loads."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import tasks

from experiments.shared.files import REPO
PROJECT = ("experiments", "hydra_plugins", "scripts")   # all but gluon/
# the run, then the project modules it loaded (package __init__ files that hold nothing excluded)
TRACE = r"""
import json, runpy, sys
from pathlib import Path
from hydra._internal.config_loader_impl import ConfigLoaderImpl
composed = []
load = ConfigLoaderImpl.load_configuration
def counted(self, *a, **k):
    composed.append(1)
    return load(self, *a, **k)
ConfigLoaderImpl.load_configuration = counted
validated = []                    # calls of experiments.run.config.validate (no import here:
def profile(frame, event, arg):   # the trace must load what the run loads, in its order)
    code = frame.f_code
    if event == "call" and code.co_name == "validate" and \
            code.co_filename.endswith("experiments/run/config.py"):
        validated.append(1)
sys.setprofile(profile)
repo = Path.cwd().resolve()
sys.argv = ["experiments.logreg", "method=gluon", "steps=2", "wandb.mode=disabled",
            "hydra.run.dir=" + sys.argv[1]]
try:
    runpy.run_module("experiments.logreg", run_name="__main__", alter_sys=True)
except SystemExit as e:
    assert not e.code, e.code
files = set()
for m in list(sys.modules.values()):
    f = getattr(m, "__file__", None)
    if f and Path(f).resolve().is_relative_to(repo):
        p = Path(f).resolve()
        if p.name == "__init__.py" and not p.read_text().strip():
            continue
        files.add(str(p.relative_to(repo)))
print(json.dumps({"files": sorted(files), "compositions": len(composed),
                  "validations": len(validated)}))
"""


def documented_path() -> list[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("### The path of one run")[1].split("###")[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M)


def test_the_documented_run_path_is_what_a_run_loads(tmp_path):
    tasks.libsvm_file("a5a", download=False)          # the run needs the data
    out = subprocess.run([sys.executable, "-c", TRACE, str(tmp_path / "run")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    trace = json.loads(out.stdout.strip().splitlines()[-1])
    loaded = {f for f in trace["files"] if f.split("/")[0] in PROJECT}
    listed = documented_path()
    assert len(listed) == len(set(listed)), "a file listed twice"
    assert set(listed) == loaded, (f"loaded but not documented: {sorted(loaded - set(listed))}; "
                                   f"documented but not loaded: {sorted(set(listed) - loaded)}")
    assert (tmp_path / "run" / "summary.json").exists()
    # the check before hydra writes anything composes once; hydra.main twice (mode, then run)
    assert trace["compositions"] == 3, trace["compositions"]
    assert trace["validations"] == 1, trace["validations"]      # by the check, not again


def test_the_library_imports_nothing_above_it():
    for f in (REPO / "gluon").glob("*.py"):
        imports = re.findall(r"^\s*(?:from|import) (experiments|analysis|paper|benchmarks|hydra|omegaconf|wandb|pandas|submitit)\b",
                             f.read_text(), flags=re.M)
        assert not imports, f"{f.name} imports {imports}"


def test_tasks_import_nothing_from_the_run_config():
    """A task receives its config and shares helpers through experiments.tasks alone."""
    for f in (REPO / "experiments" / "tasks").glob("*.py"):
        bad = re.findall(r"^\s*from (?:\.\.run\.config|experiments\.run\.config|\.\.run) import .*$",
                         f.read_text(), flags=re.M)
        bad = [b for b in bad if "config" in b]
        assert not bad, f"{f.name}: {bad}"


METHOD_YAMLS = sorted(p.stem for p in (REPO / "configs" / "method").glob("*.yaml"))


@pytest.mark.parametrize("name", METHOD_YAMLS)
def test_a_methods_per_name_defaults_live_in_the_registry_alone(name):
    """configs/method/<name>.yaml writes no value that gluon/methods.py's METHODS holds as the
    method's default (scale_by_B): it refers to it, and the composed config carries that value,
    as the runs recorded before the reference existed did (their identities are unchanged)."""
    from experiments.run.config import compose
    from experiments.tasks import resolved
    from gluon.methods import METHODS
    text = (REPO / "configs" / "method" / f"{name}.yaml").read_text()
    method = resolved(compose("logreg", f"method={name}")).method
    for key, value in METHODS[name].defaults.items():
        assert not re.search(rf"^\s*{key}:\s*(true|false|[0-9.]+)\s*$", text, flags=re.M), key
        if f"{key}:" in text:
            assert f"{key}: ${{gluon_default:{key}}}" in text
            assert method[key] == value


def test_the_lmo_defaults_live_in_the_library_alone():
    """configs/task/cnn.yaml writes no literal for an LMO setting whose default
    gluon.lmo holds (ns_steps, head_scale): it refers to it, and the composed config carries the
    library's value with its type, as the runs recorded before the reference did."""
    from experiments.run.config import compose
    from experiments.tasks import resolved
    from gluon.lmo import LMO_DEFAULTS
    text = (REPO / "configs" / "task" / "cnn.yaml").read_text()
    task = resolved(compose("cnn")).task
    for key, value in LMO_DEFAULTS.items():
        assert re.search(rf"^{key}: \$\{{gluon_lmo_default:{key}\}}", text, flags=re.M), key
        assert task[key] == value and type(task[key]) is type(value), key


def test_the_makefile_takes_sweep_folders_from_the_experiment_configs(capsys):
    """No recipe names a sweep's folder (results/sweeps/<name>): it asks the experiment's config
    (`python -m experiments.run.sweep dir`), which prints the folder hydra's sweep writes."""
    from experiments.run.config import compose
    from experiments.run.sweep import main
    recipes = [line for line in (REPO / "Makefile").read_text().splitlines()
               if line.startswith("\t") and "results/sweeps/" in line]
    assert all("rm -rf" in line or "usage:" in line for line in recipes), recipes
    main(["dir", "cnn", "cnn_gap/tune_alg2"])
    cfg = compose("cnn", "experiment=cnn_gap/tune_alg2", hydra=True)
    assert capsys.readouterr().out.strip() == str(cfg.hydra.sweep.dir) == "results/sweeps/cnn_gap/tune"


# ---------------------------------------------------------------- the house and its layering
# gluon <- experiments <- scripts (docs/architecture.md, "Layers"). Imports are read from the
# source (every import statement, those inside functions included), so a lazy import that breaks
# a rule fails here as a top-level one does.

TOP_LEVEL = {".ci", ".gitignore", "Makefile", "README.md", "pyproject.toml", "configs", "docs",
             "examples", "experiments", "figures", "gluon", "hydra_plugins", "results", "scripts",
             "tests"}
SHARED_MAY_IMPORT = {"numpy", "scipy", "yaml"}        # beyond the standard library and itself


def imports_of(path: Path) -> list[str]:
    """Every module ``path`` imports, relative imports resolved to absolute names."""
    import ast
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.append(module)
            names += [f"{module}.{a.name}" for a in node.names]   # `from pkg import module`
    return names


def python_files(*folders: str) -> list[Path]:
    return [p for f in folders for p in sorted((REPO / f).rglob("*.py"))]


def breaks(files, rule) -> list[str]:
    return [f"{p.relative_to(REPO)} imports {name}" for p in files for name in imports_of(p)
            if rule(p, name)]


def top(name: str) -> str:
    return name.split(".")[0]


def test_the_top_level_is_the_design_cards():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    assert {p.split("/")[0] for p in tracked} == TOP_LEVEL


def test_only_the_library_the_experiments_and_the_hydra_plugin_are_installed():
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == \
        ["gluon*", "experiments*", "hydra_plugins*"]


def test_nothing_imports_from_scripts():
    """Scripts are run by hand; the library, the experiments, the hydra plugin and the examples
    never import them, and scripts share code through experiments/shared, never each other."""
    below = breaks(python_files("gluon", "experiments", "hydra_plugins", "examples"),
                   lambda p, n: top(n) == "scripts")
    assert not below, below
    across = breaks(python_files("scripts"), lambda p, n: top(n) == "scripts")
    assert not across, across


def test_the_library_imports_only_itself_torch_and_numpy():
    import sys as _sys
    allowed = set(_sys.stdlib_module_names) | {"gluon", "torch", "numpy"}
    bad = breaks(python_files("gluon"), lambda p, n: top(n) not in allowed)
    assert not bad, bad


def test_the_shared_layer_imports_neither_hydra_nor_torch_nor_the_run_wing():
    import sys as _sys
    allowed = set(_sys.stdlib_module_names) | SHARED_MAY_IMPORT | {"experiments"}
    bad = breaks(python_files("experiments/shared"),
                 lambda p, n: top(n) not in allowed or
                 (top(n) == "experiments" and not n.startswith("experiments.shared")))
    assert not bad, bad


def test_the_shared_layer_and_every_figure_load_without_hydra_or_torch():
    """What the figures import, transitively: no hydra, no omegaconf composition, no torch."""
    modules = sorted({f"experiments.shared.{p.stem}" for p in python_files("experiments/shared")} |
                     {f"scripts.figures.{p.stem}" for p in python_files("scripts/figures")})
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'hydra', 'torch', 'omegaconf', 'gluon'})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


EXPERIMENTS = sorted(str(p.relative_to(REPO / "configs" / "experiment").with_suffix(""))
                     for p in (REPO / "configs" / "experiment").rglob("*.yaml")
                     if not p.name.startswith("_"))


def test_a_sweeps_folder_read_without_hydra_is_the_one_hydra_composes():
    """experiments.shared.configs.sweep_dir (plain YAML) equals hydra.sweep.dir as composed, for
    every experiment config of both entry points."""
    from experiments.run.config import compose
    from experiments.shared.configs import sweep_dir
    for name in EXPERIMENTS:
        primary = "cnn" if "cnn" in name or name == "fig8" else "logreg"
        cfg = compose(primary, f"experiment={name}", hydra=True)
        assert str(sweep_dir(primary, name)) == str(cfg.hydra.sweep.dir), name
