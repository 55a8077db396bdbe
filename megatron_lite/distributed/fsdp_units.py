"""ZeRO-3's units, decided once at wrap time: which modules are gathered and released together, and which
unit each parameter belongs to (param_units.py then gathers them).

    units           the outermost submodules named by fsdp_unit_modules (None: the children of every
                    nn.ModuleList), in registration order: unit ids 0 .. n-1
    ROOT_UNIT       parameters outside every unit, or shared by two units or by a unit and the outside (a
                    tied embedding / output layer): gathered for the whole forward and backward
    PERSISTENT_UNIT parameters below param_persistence_threshold: whole on every rank, in buckets at the
                    end of their buffer (persistent_params_together)

A name in fsdp_unit_modules that matches nothing is an error listing the model's candidate classes: silently
gathering the whole model at once would defeat ZeRO-3. So is a torch.compiled forward around the units (the
model's, or a submodule's that contains a unit): its graph would run the units' gather and release hooks inside
and keep a released parameter's storage. Pure functions of the module tree and the config.
"""

from typing import Dict, List, Optional, Tuple

import torch

from .distributed_data_parallel_config import DistributedDataParallelConfig

ROOT_UNIT = -1
"""The unit id of the root's parameters (a module unit's id is its index, 0 .. n-1: never negative)."""
PERSISTENT_UNIT = -2
"""The unit id of the persistent parameters (below param_persistence_threshold)."""


def units_of(module: torch.nn.Module, config: DistributedDataParallelConfig):
    """(units, parameter -> unit id) for ZeRO-3 (find_units, unit_of_params; parameters with fewer than
    config.param_persistence_threshold elements go to PERSISTENT_UNIT); ([], None) where the strategy keeps
    whole parameters."""
    if not config.sharding.parameters:
        return [], None
    units = find_units(module, config.fsdp_unit_modules)
    refuse_compiled_forward(modules_around(module, units))
    unit_of = unit_of_params(module, units)
    return units, {p: PERSISTENT_UNIT if p.numel() < config.param_persistence_threshold else unit
                   for p, unit in unit_of.items()}


def persistent_params_together(params: List[torch.nn.Parameter],
                               unit_of: Optional[Dict[torch.nn.Parameter, int]]) -> List[torch.nn.Parameter]:
    """`params` (a buffer's, in order) with the persistent ones (PERSISTENT_UNIT) moved, in their order, to
    the end: buckets never span two units, so small parameters scattered between large ones (biases, norms)
    would each close a bucket of their own. Unchanged when there are none."""
    if not unit_of:
        return list(params)
    persistent = [p for p in params if unit_of[p] == PERSISTENT_UNIT]
    return [p for p in params if unit_of[p] != PERSISTENT_UNIT] + persistent


def find_units(module: torch.nn.Module, class_names: Optional[Tuple[str, ...]]) -> List[torch.nn.Module]:
    """The outermost submodules whose class name is in `class_names` (None: the children of every
    nn.ModuleList), in registration order, each once. `()` asks for no units (the whole model is gathered
    at once). A class name that matches nothing, or None on a model without an nn.ModuleList, is a
    ValueError listing the classes the model does contain: silently gathering everything at once would
    defeat ZeRO-3."""
    units: List[torch.nn.Module] = []
    found = set()

    def visit(parent: torch.nn.Module):
        for child in parent.children():
            if any(child is unit for unit in units):
                continue
            if (type(child).__name__ in class_names if class_names is not None
                    else isinstance(parent, torch.nn.ModuleList)):
                units.append(child)  # not descended into: nested matches belong to this unit
                found.add(type(child).__name__)
            else:
                visit(child)

    visit(module)
    missing = [name for name in class_names if name not in found] if class_names is not None else []
    if missing or (class_names is None and not units):
        what = (f"fsdp_unit_modules names {missing}, which no submodule of {type(module).__name__} is" if missing
                else f"fsdp_unit_modules=None takes the children of nn.ModuleLists as units, and "
                     f"{type(module).__name__} has no nn.ModuleList")
        raise ValueError(
            f"ZeRO-3 (sharded parameters): {what}. Candidate unit classes in this model (class: count): "
            f"{_candidate_units(module)}. Pass DistributedDataParallelConfig(fsdp_unit_modules=('ClassName', ...)) "
            f"naming the repeated blocks (e.g. transformer layers, residual blocks), or fsdp_unit_modules=() to "
            f"gather the whole model at once (no memory saved on parameters)."
        )
    return units


def modules_around(module: torch.nn.Module, units: List[torch.nn.Module]) -> List[Tuple[str, torch.nn.Module]]:
    """(name, module) of `module` (named '') and every submodule that contains a unit: the modules whose forward runs
    the units' hooks. Empty without units."""
    unit_ids = {id(unit) for unit in units}
    around: List[Tuple[str, torch.nn.Module]] = []

    def visit(name: str, sub: torch.nn.Module) -> bool:
        if id(sub) in unit_ids:
            return True
        contains = False
        for child_name, child in sub.named_children():
            contains |= visit(f"{name}.{child_name}" if name else child_name, child)
        if contains:
            around.append((name, sub))
        return contains

    visit("", module)
    return around[::-1]  # outermost first


def refuse_compiled_forward(modules: List[Tuple[str, torch.nn.Module]]):
    """Raise if one of `modules` (modules_around) has a torch.compiled forward: GPTModel.compile_forward,
    `module.forward = torch.compile(module.forward)`, or torch.compile(model) (whose forward is compiled). The
    graph would run the units' gather and release hooks inside it and keep the storage of parameters that
    ZeRO-3 releases and gathers again (autograd's in-place error at the first backward). Cheap: a dict lookup
    per module, so the wrapper repeats it at every forward (a compile after wrapping)."""
    for name, sub in modules:
        # torch.compile's result (a function, or a method bound to one) carries its original callable.
        if hasattr(vars(sub).get("forward"), "_torchdynamo_orig_callable"):
            what = f"submodule '{name}'" if name else f"the model ({type(sub).__name__})"
            raise ValueError(
                f"{what} has a torch.compiled forward (GPTModel.compile_forward, or torch.compile of the model), "
                f"which cannot run with data_parallel_sharding_strategy='optim_grads_params': the graph would "
                f"keep parameters that ZeRO-3 releases and gathers between layers. Compile each layer instead "
                f"(GPTModel.compile_layers, or torch.compile each unit's forward), or use optim_grads.")


def _candidate_units(module: torch.nn.Module) -> str:
    """Class names of the submodules that hold parameters and have children of their own, most frequent first."""
    counts: Dict[str, int] = {}
    for sub in module.modules():
        if sub is not module and any(True for _ in sub.children()) and any(True for _ in sub.parameters()):
            counts[type(sub).__name__] = counts.get(type(sub).__name__, 0) + 1
    if not counts:
        for sub in module.modules():
            if sub is not module:
                counts[type(sub).__name__] = counts.get(type(sub).__name__, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name}: {n}" for name, n in ranked[:12]) or "none (a single module)"


def unit_of_params(module: torch.nn.Module, units: List[torch.nn.Module]) -> Dict[torch.nn.Parameter, int]:
    """Parameter -> unit id: its unit's index, or ROOT_UNIT, which also takes every parameter two units
    share or a unit shares with a module outside every unit (a tied embedding / output layer): the root is
    gathered for the whole forward and backward, so each of its users finds the full values."""
    owner: Dict[torch.nn.Parameter, int] = {}
    for index, unit in enumerate(units):
        for p in unit.parameters():
            owner[p] = index if p not in owner else ROOT_UNIT
    in_unit = {id(m) for unit in units for m in unit.modules()}
    for sub in module.modules():
        if id(sub) not in in_unit:
            for p in sub.parameters(recurse=False):
                owner[p] = ROOT_UNIT
    return {p: owner.get(p, ROOT_UNIT) for p in module.parameters()}
