"""The project's layout: which modules may import which, read from the source (ast), without importing anything.

Every project .py file is parsed and every import in it (at module level and inside functions, where the lazy ones
are) becomes an edge between files; `from pkg import name` points to pkg/name.py when that file exists, else to
pkg/__init__.py. The rules:
- no cycle between files (two modules that need each other cannot be read, or tested, one at a time);
- packages in tiers (TIERS): a package imports only packages of lower tiers, none of its own tier and no training
  script, so that no two packages need each other; loaders/common.py, which every loader imports, imports no
  other loader module;
- no `from X import _name` of a project module: a name used by another module is public.
A failure names the cycle or the offending import (file:line); each check has a twin on a small tree or graph that
breaks the rule, so a checker that stopped looking would fail there.
"""
import ast
import os

from tests.conftest import REPO_ROOT

TRAINING_SCRIPTS = ("train.py", "train_graph.py", "train_mp.py", "train_mp_graphs.py")
SKIPPED_DIRS = {"data", "logs", "__pycache__"}  # at any depth also .venv*, .git and other hidden folders


def project_files(root):
    """Every .py file under `root`, relative and with '/' separators, outside virtual environments and data."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders
                               if not name.startswith(".") and not (folder == root and name in SKIPPED_DIRS)
                               and name != "__pycache__")
        found += [os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                  for name in sorted(files) if name.endswith(".py")]
    return found


def module_file(root, dotted):
    """The file of module `dotted` ('a.b' -> a/b.py or a/b/__init__.py) under `root`, or None (not the project's)."""
    path = dotted.replace(".", "/")
    for candidate in (f"{path}.py", f"{path}/__init__.py"):
        if os.path.isfile(os.path.join(root, candidate)):
            return candidate
    return None


def imports_of(root, relpath):
    """[(line, module or None, imported names, file it resolves to)] of every import in a file, at any depth."""
    with open(os.path.join(root, relpath), encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=relpath)
    package = relpath.rsplit("/", 1)[0].replace("/", ".") if "/" in relpath else ""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, alias.name, [], module_file(root, alias.name)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, up level - 1 packages
                parts = package.split(".") if package else []
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            names = [alias.name for alias in node.names]
            for name in names:
                target = module_file(root, f"{base}.{name}") if base else module_file(root, name)
                found.append((node.lineno, base, [name], target or module_file(root, base)))
    return found


def import_graph(root):
    """{file: {file it imports: first line that does}} over the project's files (imports of itself left out)."""
    graph = {}
    for relpath in project_files(root):
        edges = graph.setdefault(relpath, {})
        for line, _, _, target in imports_of(root, relpath):
            if target and target != relpath:
                edges.setdefault(target, line)
    return graph


def find_cycle(graph):
    """One cycle of `graph` ({node: iterable of nodes}) as [a, b, ..., a], or None."""
    state, stack = {}, []  # state: 1 on the current path, 2 done

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def in_any(relpath, places):
    """Whether `relpath` is one of `places` (files) or lies under one of them (folders, 'pkg/')."""
    return any(relpath == place or relpath.startswith(place.rstrip("/") + "/") for place in places)


def forbidden_imports(graph, importers, imported):
    """'a.py:12 imports b.py' for every edge from a file under `importers` to one under `imported`."""
    return [f"{source}:{line} imports {target}" for source, edges in sorted(graph.items()) if in_any(source, importers)
            for target, line in sorted(edges.items()) if in_any(target, imported)]


def private_imports(root):
    """'file:line: from X import _name' for every import of a private name from a project module."""
    found = []
    for relpath in project_files(root):
        for line, module, names, target in imports_of(root, relpath):
            private = [name for name in names if name.startswith("_") and not name.endswith("__")]
            if private and target:
                found.append(f"{relpath}:{line}: from {module} import {', '.join(private)}")
    return found


# The packages from the bottom up: a package imports only packages of lower tiers (never one of its own tier, never a
# training script); the scripts and tests/ sit on top. A new package must be placed here.
TIERS = [
    ("utils",),  # the foundation: errors and files, the config file, the process grid and its layout
    ("resilience",),  # job health: rank 0's heartbeat and posts, the one line when a rank fails (watches utils/)
    ("lifecycle", "task"),  # a run's life (flags, signals, checkpoints); the loss, metrics and optimizers
    ("distributed",),  # the tensor- and context-parallel layers and what wraps a model for parallelism
    ("networks", "loaders"),  # the models; the data loaders
    ("sample_data", "loop"),  # the sample data sets; what the training loops share
    ("planning",),  # the performance model, the planner and the dry run (train_mp.py uses them at run time)
    ("exercises", "benchmarks"),  # the exercise; the benchmarks (measurements)
]
TOP = ("tests",)  # may import anything
# a package may import a training script only here, each with its reason
SCRIPT_IMPORTS = {
    ("benchmarks/gpu_wfm.py", "train.py"): "its rank processes share one GPU: each joins the process group itself, "
                                           "then runs the script's main() (the scripts refuse a shared GPU at start)",
    ("benchmarks/gpu_wfm.py", "train_mp.py"): "the same",
}
FILE_RULES = [  # (importers, what they must not import, why)
    (("loaders/common.py",), ("loaders/",), "loaders/common.py is what every loader imports; it imports none"),
]


def package_of(relpath):
    return relpath.split("/", 1)[0] if "/" in relpath else None  # None: a top-level script


def tier_of(package):
    return next((rank for rank, tier in enumerate(TIERS) if package in tier), None)


def layer_violations(graph):
    """Every import that points up or sideways between packages, every package not placed in TIERS, and every import
    that breaks FILE_RULES; each names the file and line."""
    found = []
    for source, edges in sorted(graph.items()):
        package = package_of(source)
        if package is None or package in TOP:
            continue
        if tier_of(package) is None:
            found.append(f"package {package}/ is not placed in TIERS (tests/rules/test_layout.py): {source}")
            continue
        for target, line in sorted(edges.items()):
            other = package_of(target)
            if other == package:
                continue
            if other is None and (source, target) not in SCRIPT_IMPORTS:
                found.append(f"a package must not import a training script: {source}:{line} imports {target}")
            elif other is None:
                continue
            elif tier_of(other) is None or tier_of(other) >= tier_of(package):
                found.append(f"imports must point down (TIERS): {source}:{line} imports {target}")
    return found + [f"{why}: {edge}" for importers, imported, why in FILE_RULES
                    for edge in forbidden_imports(graph, importers, imported)]


def test_the_project_is_parsed_and_its_imports_resolved():
    """The checks below see the project: its packages, their lazy imports (inside functions) and `from pkg import
    module` resolved to the module's file."""
    graph = import_graph(REPO_ROOT)
    for path in ("train.py", "loaders/common.py", "sample_data/__main__.py", "distributed/mappings.py",
                 "tests/rules/test_layout.py"):
        assert path in graph, path
    assert not any(path.startswith((".venv", "data/")) for path in graph)
    assert "loaders/images.py" in graph["sample_data/images.py"]  # a lazy import, inside a function
    assert "loaders/dali_era5.py" in graph["loaders/__init__.py"]  # `from loaders import dali_era5`, lazily
    assert "utils/comm.py" in graph["distributed/helpers.py"]  # `from utils import comm`
    assert "loaders/__init__.py" in graph["benchmarks/bench_loader.py"]  # `from loaders import get_data_loader`


def test_no_import_cycle_between_files():
    cycle = find_cycle(import_graph(REPO_ROOT))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_reports_two_files_importing_each_other(tmp_path):
    """Twin: a tree where a lazy import closes a cycle (as utils/data_loader.py and utils/data_loader_cosmo.py once
    did) is reported, with the files of the cycle."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "base.py").write_text("def make():\n    from pkg.special import Special\n    return Special\n")
    (tmp_path / "pkg" / "special.py").write_text("from pkg import base\n\n\nclass Special:\n    pass\n")
    (tmp_path / "other.py").write_text("import pkg.base\n")
    cycle = find_cycle(import_graph(str(tmp_path)))
    assert cycle is not None and cycle[0] == cycle[-1], cycle
    assert set(cycle) == {"pkg/base.py", "pkg/special.py"}
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": ["c"], "d": ["a", "c"]}) is None


def test_lower_layers_do_not_import_upward():
    violations = layer_violations(import_graph(REPO_ROOT))
    assert not violations, "\n".join(violations)


def test_layer_check_reports_imports_that_do_not_point_down(tmp_path):
    """Twin: utils/ importing the UNet's loss from networks/ (as utils/loss.py once did), utils/ and loaders/ importing
    each other (as utils/__init__.py's loader dispatch once did: a cycle of packages, not of files), a loader
    importing a benchmark, a package importing a training script, an unplaced package, and loaders/common.py
    importing a loader are each reported, with file and line."""
    for folder in ("utils", "networks", "loaders", "benchmarks", "extras"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "networks" / "UNet.py").write_text("def loss_func():\n    pass\n")
    (tmp_path / "utils" / "loss.py").write_text("def get_loss():\n    from networks.UNet import loss_func\n")
    (tmp_path / "utils" / "data.py").write_text("def loader():\n    from loaders import era5\n")
    (tmp_path / "benchmarks" / "common.py").write_text("")
    (tmp_path / "loaders" / "era5.py").write_text("from benchmarks.common import *  # noqa\nfrom utils import data\n")
    (tmp_path / "loaders" / "common.py").write_text("\n\nfrom loaders import era5\n")
    (tmp_path / "networks" / "vit.py").write_text("import train\n")
    (tmp_path / "train.py").write_text("from utils.loss import get_loss\n")
    violations = layer_violations(import_graph(str(tmp_path)))
    for expected in ("utils/loss.py:2 imports networks/UNet.py", "utils/data.py:2 imports loaders/era5.py",
                     "loaders/era5.py:1 imports benchmarks/common.py", "networks/vit.py:1 imports train.py",
                     "package extras/ is not placed", "loaders/common.py:3 imports loaders/era5.py"):
        assert any(expected in v for v in violations), (expected, violations)
    assert len(violations) == 6, violations  # train.py importing utils/, loaders/ importing utils/: the right way
    assert not any("era5.py:2" in v for v in violations)


def test_the_project_follows_its_tiers():
    """Every package of the project is placed, and no tier is empty."""
    packages = {package_of(path) for path in import_graph(REPO_ROOT)} - {None, *TOP}
    placed = {package for tier in TIERS for package in tier}
    assert packages == placed, (packages - placed, placed - packages)


def constant_definitions(root, name):
    """'file:line' of every module-level assignment to `name` in the project."""
    found = []
    for relpath in project_files(root):
        with open(os.path.join(root, relpath), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=relpath)
        found += [f"{relpath}:{node.lineno}" for node in tree.body if isinstance(node, ast.Assign)
                  and any(isinstance(target, ast.Name) and target.id == name for target in node.targets)]
    return found


def test_the_mlp_ratio_is_defined_once(tmp_path):
    """MLP_RATIO lives in networks/vit.py only (the performance model asks the ViT); the twin: a second definition,
    as utils/perf_model.py once had, is found."""
    (found,) = constant_definitions(REPO_ROOT, "MLP_RATIO")
    assert found.startswith("networks/vit.py:"), found
    (tmp_path / "a.py").write_text("MLP_RATIO = 4.0\n")
    (tmp_path / "b.py").write_text("import a\n\nMLP_RATIO = 4.0  # a copy\n")
    assert constant_definitions(str(tmp_path), "MLP_RATIO") == ["a.py:1", "b.py:3"]


def test_no_private_name_is_imported_from_another_module():
    found = private_imports(REPO_ROOT)
    assert not found, "private names imported across modules (make them public):\n" + "\n".join(found)


def test_private_import_check_reports_one(tmp_path):
    """Twin: `from distributed.helpers import _gather` (as distributed/mappings.py once did) is reported; dunder
    names and other packages' private names are not the project's business."""
    (tmp_path / "distributed").mkdir()
    (tmp_path / "distributed" / "__init__.py").write_text("__version__ = '1'\n")
    (tmp_path / "distributed" / "helpers.py").write_text("def _gather():\n    pass\n")
    (tmp_path / "distributed" / "mappings.py").write_text(
        "from distributed import __version__\nfrom os import _exit\n\n\ndef f():\n"
        "    from distributed.helpers import _gather, compute\n")
    assert private_imports(str(tmp_path)) == ["distributed/mappings.py:6: from distributed.helpers import _gather"]
