"""The shape of megatron_lite as a whole, read from its source (no import, no process).

Packages stand in layers and import only downward (issue 33): a lower layer never imports a higher one, and
packages of one layer never import each other. The layers are what the code imports today:

    config_checks.py       validation tables (imports nothing of the project)
    data/, models/         datasets and tokenizers; the GPT (torch only)
    distributed/           DDP, buffers, buckets, collectives, ZeRO-3
    optimizer/             the optimizers over DDP's buffers
    checkpointing/         save/load of model and optimizer state
    training/              the command line and pretrain()
    fault_tolerance/       live recovery around pretrain()

megatron_lite/__init__.py (the package's front door) may import any layer.
"""

import ast
import os

from pretrain_testing import REPO

LAYERS = (("config_checks",), ("data", "models"), ("distributed",), ("optimizer",), ("checkpointing",),
          ("training",), ("fault_tolerance",))
LAYER = {package: i for i, packages in enumerate(LAYERS) for package in packages}
PACKAGE_DIR = os.path.join(REPO, "megatron_lite")


def _modules():
    """(path, dotted module name) of every .py under megatron_lite/."""
    for folder, _, names in os.walk(PACKAGE_DIR):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, REPO)[:-len(".py")].split(os.sep)
                yield path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: str, module: str):
    """Every megatron_lite module `path` imports, relative imports resolved, function-local ones included."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.module


def _package(module: str) -> str:
    """megatron_lite.<package>[...] -> <package> (a top-level module is its own package)."""
    return module.split(".")[1]


def upward_imports():
    """'importer -> imported' for every import of a package from a higher layer or from its own layer."""
    found = []
    for path, module in _modules():
        if module == "megatron_lite":
            continue
        for target in _imported(path, module):
            if not target.startswith("megatron_lite."):
                continue
            mine, theirs = _package(module), _package(target)
            if mine != theirs and LAYER[theirs] >= LAYER[mine]:
                found.append(f"{module} -> {target}")
    return found


def test_every_package_has_a_layer():
    """Would catch a new package (or top-level module) that the layering below silently ignores."""
    packages = {_package(module) for _, module in _modules() if module != "megatron_lite"}
    assert packages == set(LAYER), f"place each package in LAYERS: {sorted(packages ^ set(LAYER))}"


def test_no_import_from_a_higher_package():
    """Would catch an import pointing up (checkpointing/hf_convert.py importing training/ was the last one,
    before it moved beside its one user in tools/) or sideways within a layer (data/ <-> models/)."""
    assert upward_imports() == []
