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
package but distributed/layout.py does arithmetic on ranks (`%`, `//`, divmod): who owns what is the topology's
to say.
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
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            if source == "megatron_lite":  # `from .. import training`: the names are the packages
                yield from (f"{source}.{alias.name}" for alias in node.names)
            else:
                yield source


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


def _division(node):
    """(left, right) operands of a `%` or `//` (`a % b`, `a %= b`, `divmod(a, b)`), or None."""
    if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, (ast.Mod, ast.FloorDiv)):
        if isinstance(node, ast.AugAssign):
            return node.target, node.value
        return node.left, node.right
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "divmod" and len(node.args) == 2:
        return tuple(node.args)
    return None


def _rank_arithmetic_in(tree):
    """The `%`, `//` and divmod() of `tree` with an operand that names a rank, a position or an instance. A
    local rank mapped onto the node's devices (`local_rank % torch.cuda.device_count()`, Megatron's rule) is
    not ownership, nor is string formatting."""
    found = []
    for node in ast.walk(tree):
        operands = _division(node)
        if operands is None:
            continue
        left, right = operands
        if isinstance(left, ast.JoinedStr) or isinstance(left, ast.Constant) and isinstance(left.value, str):
            continue  # string formatting
        if ast.unparse(right) == "torch.cuda.device_count()":
            continue
        if any(RANK_NAMES.search(ast.unparse(operand).lower()) for operand in operands):
            found.append(node)
    return found


def rank_arithmetic():
    """'module:line expression' for every rank arithmetic outside distributed/layout.py (the one place that
    says who owns what)."""
    return [f"{module}:{node.lineno} {ast.unparse(node)}" for module, tree in _parsed()
            if module != "megatron_lite.distributed.layout" for node in _rank_arithmetic_in(tree)]


def test_rank_arithmetic_only_in_layout():
    """Would catch a package dividing ranks itself (fault_tolerance/elastic.py's `members // per_instance`
    was the last): shard ranges, instances and positions come from layout.DataParallelTopology."""
    assert rank_arithmetic() == []


def test_the_import_walk_sees_a_package_imported_by_name(tmp_path):
    """`from .. import training` (or `from megatron_lite import training`) imports a package as a name of the
    root: the walk must name the package, not the root it skips."""
    path = tmp_path / "save.py"
    path.write_text("from .. import training\nfrom megatron_lite import fault_tolerance\nfrom . import files\n")
    assert sorted(_imported(str(path), "megatron_lite.checkpointing.save")) == [
        "megatron_lite.checkpointing", "megatron_lite.fault_tolerance", "megatron_lite.training"]


def test_the_rank_check_sees_every_spelling():
    """Augmented assignment, divmod() and a number on the left are rank arithmetic too; string formatting and
    the device rule are not."""
    found = ["r %= dp_rank", "per_instance //= 2", "start, rest = divmod(rank, size)", "x = 1024 // num_instances",
             "y = (rank + 1) // 2"]
    ignored = ["s = '%d' % rank", "s = f'{rank}' % ()", "d = local_rank % torch.cuda.device_count()",
               "n = divmod(numel, size)", "z = members // size"]
    assert [bool(_rank_arithmetic_in(ast.parse(line))) for line in found] == [True] * len(found)
    assert [bool(_rank_arithmetic_in(ast.parse(line))) for line in ignored] == [False] * len(ignored)
