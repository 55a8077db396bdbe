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

megatron_lite/__init__.py (the package's front door) may import any layer. And no class is a mixin, and no
package but distributed/layout.py does arithmetic on ranks (`%`, `//`): who owns what is the topology's to say.
"""

import ast
import os
import re

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


def _parsed():
    """(module name, syntax tree) of every module of megatron_lite."""
    for path, module in _modules():
        with open(path) as f:
            yield module, ast.parse(f.read())


def test_no_mixin():
    """Would catch a class named as a mixin (issue 33: the gradient hooks, ZeRO-3's guards and the optimizer's
    state were each one class spread over two files; they are objects their owners hold now)."""
    mixins = [f"{module}.{node.name}" for module, tree in _parsed() for node in ast.walk(tree)
              if isinstance(node, ast.ClassDef) and "mixin" in node.name.lower()]
    assert mixins == []


RANK_NAMES = re.compile(r"rank|position|instance")
"""Operand names of rank arithmetic: a rank, a data-parallel position, an instance or its size."""


def rank_arithmetic():
    """'module:line expression' for every `%` or `//` with an operand that names a rank, a position or an
    instance, outside distributed/layout.py (the one place that says who owns what). A local rank mapped onto
    the node's devices (`local_rank % torch.cuda.device_count()`, Megatron's rule) is not ownership."""
    found = []
    for module, tree in _parsed():
        if module == "megatron_lite.distributed.layout":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.FloorDiv)):
                if isinstance(node.left, (ast.Constant, ast.JoinedStr)):
                    continue  # string formatting
                right = ast.unparse(node.right)
                if right == "torch.cuda.device_count()":
                    continue
                if RANK_NAMES.search(ast.unparse(node.left).lower()) or RANK_NAMES.search(right.lower()):
                    found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def test_rank_arithmetic_only_in_layout():
    """Would catch a package dividing ranks itself (fault_tolerance/elastic.py's `members // per_instance`
    was the last): shard ranges, instances and positions come from layout.DataParallelTopology."""
    assert rank_arithmetic() == []
