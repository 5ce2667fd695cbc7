"""docs/architecture.md, checked: the path of one run is the project files a run loads, in the
order it loads them; the layers; where defaults and the workers live; the size of a file."""
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
first = {}                        # file -> when its module's body first ran: the loading order
calls = {"validate": 0, "resolved": 0}    # resolved(): but where the folder's name is computed
def profile(frame, event, arg):   # (no project import here: the trace loads what the run loads)
    if event != "call":
        return
    code = frame.f_code
    if code.co_name == "<module>":
        first.setdefault(code.co_filename, len(first))
    elif code.co_name == "validate" and code.co_filename.endswith("experiments/run/config.py"):
        calls["validate"] += 1
    elif code.co_name == "resolved" and code.co_filename.endswith("experiments/tasks/__init__.py"):
        caller = frame.f_back
        while caller is not None and caller.f_code.co_name != "run_folder":
            caller = caller.f_back
        calls["resolved"] += caller is None
sys.setprofile(profile)
repo = Path.cwd().resolve()
sys.argv = ["experiments.logreg", "method=gluon", "steps=2", "wandb.mode=disabled",
            "hydra.run.dir=" + sys.argv[1]]
try:
    runpy.run_module("experiments.logreg", run_name="__main__", alter_sys=True)
except SystemExit as e:
    assert not e.code, e.code
sys.setprofile(None)
files = []
for f in first:
    p = Path(f)
    if not p.is_absolute() or not p.is_file() or not p.resolve().is_relative_to(repo):
        continue
    p = p.resolve()
    if p.name == "__init__.py" and not p.read_text().strip():
        continue
    files.append(str(p.relative_to(repo)))
print(json.dumps({"files": files, "compositions": len(composed),
                  "validations": calls["validate"], "resolutions": calls["resolved"]}))
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
    loaded = [f for f in trace["files"] if f.split("/")[0] in PROJECT]   # in the order loaded
    listed = documented_path()
    assert len(listed) == len(set(listed)), "a file listed twice"
    assert set(listed) == set(loaded), (
        f"loaded but not documented: {sorted(set(loaded) - set(listed))}; "
        f"documented but not loaded: {sorted(set(listed) - set(loaded))}")
    assert listed == loaded, f"the order the run first loads them: {loaded}"
    assert (tmp_path / "run" / "summary.json").exists()
    # the command line's check composes once, hydra.main once more (its composition only to
    # read hydra.mode is skipped); the config is resolved once and validated once, by the check
    assert trace["compositions"] == 2, trace["compositions"]
    assert trace["resolutions"] == 1, trace["resolutions"]
    assert trace["validations"] == 1, trace["validations"]


MAX_LINES = 450                 # a file of the experiments a reader follows top to bottom


def test_no_file_of_the_experiments_is_longer_than_a_reader_follows():
    long = {str(p.relative_to(REPO)): n for p in python_files("experiments")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_a_config_is_resolved_in_one_place():
    """``resolved(`` stands twice outside the tests: its definition and its one call, where a
    ResolvedConfig is made (experiments/tasks/__init__.py); everything else reads that object."""
    found = [f"{p.relative_to(REPO)}:{i}"
             for p in python_files("experiments", "hydra_plugins", "scripts", "gluon", "examples")
             for i, line in enumerate(p.read_text().splitlines(), 1) if "resolved(" in line]
    assert len(found) <= 2, found


def test_the_workers_have_one_home():
    """n_workers is written once, with its unit, in configs/workers.yaml, which both entry
    points name in their defaults; the schema holds no value (a config without it is refused)."""
    from dataclasses import fields

    from omegaconf import MISSING

    from experiments.run.config import RunConf, compose
    assert {f.name: f.default for f in fields(RunConf)}["n_workers"] == MISSING
    assert re.search(r"^n_workers: 4 +# workers\b", (REPO / "configs" / "workers.yaml").read_text(),
                     flags=re.M)
    for primary in ("logreg", "cnn"):
        text = (REPO / "configs" / f"{primary}.yaml").read_text()
        assert re.search(r"^  - workers\b", text, flags=re.M), primary
        assert not re.search(r"^n_workers:", text, flags=re.M), primary
        assert compose(primary).n_workers == 4


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
    gluon.lmo holds (lmo_default, ns_steps, head_scale): it refers to it, and the composed config
    carries the library's value with its type, as the runs recorded before the reference did."""
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
    from tests.conftest import entry_point_of
    for name in EXPERIMENTS:
        primary = entry_point_of(name)
        cfg = compose(primary, f"experiment={name}", hydra=True)
        assert str(sweep_dir(primary, name)) == str(cfg.hydra.sweep.dir), name


# ---------------------------------------------------------------- what the library holds
# gluon/ is what a user's own program imports: the optimisers, the methods and the backends over
# a process group the program started. Starting the processes (torchrun, srun) and joining their
# group is the program's, the project's runs in experiments/run/world.py.

WORLD_NAMES = {"World", "open_world", "close_world", "free_port", "KINDS"}
WORLD_CALLS = {"init_process_group", "destroy_process_group", "getenv", "putenv"}


def process_world_code(source: str) -> list[str]:
    """What in ``source`` starts or joins a process world, or reads the environment (SLURM's
    or any: the library takes its settings as arguments)."""
    import ast
    found = [f"mentions {w}" for w in sorted(set(re.findall(r"scontrol|SLURM_\w*", source)))]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and \
                node.name in WORLD_NAMES:
            found.append(f"defines {node.name}")
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in WORLD_NAMES
                                                  for t in node.targets):
            found.append(f"defines {ast.unparse(node.targets[0])}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in WORLD_CALLS:
            found.append(f"calls {ast.unparse(node.func)}")
        elif isinstance(node, ast.Attribute) and node.attr == "environ":
            found.append(f"reads {ast.unparse(node)}")
    return found


def test_the_library_defines_no_process_world_and_no_slurm_code():
    planted = ("import os, subprocess\nimport torch.distributed as dist\n"
               "def open_world():\n    os.environ['RANK'] = os.environ['SLURM_PROCID']\n"
               "    subprocess.run(['scontrol', 'show', 'hostnames'])\n"
               "    dist.init_process_group('gloo')\n")
    assert {"defines open_world", "mentions scontrol", "mentions SLURM_PROCID",
            "reads os.environ", "calls dist.init_process_group"} <= set(process_world_code(planted))
    found = {str(p.relative_to(REPO)): process_world_code(p.read_text())
             for p in python_files("gluon")}
    assert not {p: f for p, f in found.items() if f}, found


# Keywords whose literal default may stand in several signatures: they are not settings.
NOT_SETTINGS = {
    "seed": "0, the seed when none is given",
    "batches": "1, one minibatch: Oracle.sample's argument, repeated by every oracle",
    "scale": "two LMOs' own switches of Scion's scaling (Sign, Spectral), each its own",
}


def default_homes(sources: dict[str, str]) -> dict[str, list[str]]:
    """Keyword -> where its default is written, for every keyword whose default has more than
    one home in ``sources`` (name -> Python source): a literal default written twice, or one
    written as a literal where another signature names it by a constant (gluon.methods.BETA,
    gluon.lmo.LMO_DEFAULT, ...). Signatures and class fields are read; None is no default."""
    import ast
    literal: dict = {}
    named: dict = {}
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            pairs = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                positional = a.posonlyargs + a.args
                pairs = [(x.arg, d) for x, d in zip(positional[len(positional) - len(a.defaults):],
                                                    a.defaults)]
                pairs += [(x.arg, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            elif isinstance(node, ast.ClassDef):
                pairs = [(s.target.id, s.value) for s in node.body
                         if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                         and s.value is not None]
            for key, d in pairs:
                where = f"{name}:{d.lineno} {key}={ast.unparse(d)}"
                if isinstance(d, ast.Constant):
                    if d.value is not None and key not in NOT_SETTINGS:
                        literal.setdefault(key, []).append(where)
                elif isinstance(d, (ast.Name, ast.Attribute)):
                    named.setdefault(key, []).append(where)
    return {k: v + named.get(k, []) for k, v in literal.items() if len(v) > 1 or k in named}


def test_the_library_writes_each_default_once():
    """A default of gluon/ has one home: a keyword's literal default stands in one signature, or
    a constant holds it and every signature names the constant (beta: gluon.methods.BETA; the
    LMO rule: gluon.lmo.LMO_DEFAULT; dense messages' collective: gluon.comm.DENSE_COLLECTIVE)."""
    planted = {"a.py": "BETA = 0.9\ndef f(beta: float = BETA, q: float = 1.0): ...\n",
               "b.py": "def g(*, beta: float = 0.9, q=1.0): ...\n"
                       "class C:\n    q: float = 1.0\n"}
    assert set(default_homes(planted)) == {"beta", "q"}
    assert len(default_homes(planted)["q"]) == 3
    homes = default_homes({str(p.relative_to(REPO)): p.read_text()
                           for p in python_files("gluon")})
    assert not homes, homes
    from gluon.comm import DENSE_COLLECTIVE, DENSE_COLLECTIVES
    from gluon.lmo import LMO_DEFAULT, LMO_DEFAULTS
    from gluon.methods import BETA
    assert 0 <= BETA < 1 and DENSE_COLLECTIVE in DENSE_COLLECTIVES
    assert LMO_DEFAULTS["lmo_default"] == LMO_DEFAULT
