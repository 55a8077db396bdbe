"""Expert parameters (`param.allreduce = False`) in a `torch`-format checkpoint: every position's experts.

A rank's model and optimizer states hold only the experts of its expert-parallel position; the other
positions hold other experts, possibly under the same names. Rank 0 alone writes the file, so the dense
entries stay where they always are and the experts go into a section with one entry per position::

    payload["model"], payload["optimizer"]["state"]      dense entries (as without experts)
    payload["expert_parallel"] = {"size": EP,            the expert-parallel size it was saved with
                                  "positions": [{"model": {name: tensor}, "optimizer": {name: entry}},
                                                ...]}    position k's experts (from rank 0 of its group)

Saving gathers the positions' entries to rank 0 (one object gather); loading adds the loading rank's
position's entries back, so the model and the optimizer load exactly the states they saved. Resuming at
another expert-parallel size (experts regrouped) is not supported yet, nor is the `torch_dist` format
(both raise ValueError on every rank).
"""

from typing import Optional, Set, Tuple

from ..distributed import collectives
from ..distributed.expert_parallel import is_expert_param

SECTION = "expert_parallel"


def has_experts(optimizer) -> bool:
    """Whether the model has expert parameters (the same answer on every rank)."""
    return bool(getattr(optimizer, "has_expert_params", False))


def refuse(optimizer, what: str, remedy: str = "save with ckpt_format='torch', which keeps every position's "
                                                  "experts"):
    """Raise ValueError (on every rank: the answer is agreed) when `what` cannot hold expert parameters."""
    if has_experts(optimizer):
        raise ValueError(f"{what} does not support expert parameters (param.allreduce = False) yet: each "
                         f"expert-parallel position holds other experts, possibly under the same names; {remedy}")


def _names(model, optimizer) -> Tuple[Set[str], Set[str]]:
    """The expert entries' keys: in the module's state dict (frozen experts too), in the optimizer's state."""
    module = getattr(model, "module", model)
    model_keys = {name for name, p in module.named_parameters() if is_expert_param(p)}
    return model_keys, {optimizer.param_to_name[p] for p in optimizer.expert_params}


def split(model, optimizer, model_state: dict, optimizer_state: dict, group=None) -> Optional[dict]:
    """Collective over the data-parallel `group` (every rank, when the model has experts): move this rank's
    expert entries out of `model_state` and `optimizer_state['state']` and return the section of every
    position on the group's rank 0 (None on the others, and everywhere without experts)."""
    if not has_experts(optimizer):
        return None
    model_keys, optimizer_names = _names(model, optimizer)
    mine = {"model": {k: model_state.pop(k) for k in model_keys if k in model_state},
            "optimizer": {n: optimizer_state["state"].pop(n) for n in optimizer_names}}
    topology = model.expert_topology
    # Rank 0 of each expert group speaks for its position (its peers hold the same experts).
    speaks = topology.expert_data_parallel_rank == 0
    everyone = collectives.gather_object((topology.expert_parallel_rank, mine) if speaks else None, group)
    if everyone is None:
        return None
    positions = [None] * topology.expert_parallel_size
    for entry in everyone:
        if entry is not None:
            positions[entry[0]] = entry[1]
    return {"size": topology.expert_parallel_size, "positions": positions}


def merge(model, optimizer, state: dict):
    """Give `state` (a loaded payload) this rank's position's expert entries, in place; ValueError when the
    checkpoint and the model disagree on having experts or on the expert-parallel size."""
    section = state.get(SECTION)
    if section is None:
        if has_experts(optimizer):
            raise ValueError("the checkpoint holds no expert section but the model has expert parameters "
                             "(param.allreduce = False): it was saved from a model without them")
        return
    if not has_experts(optimizer):
        raise ValueError("the checkpoint holds expert parameters (one set per expert-parallel position) but the "
                         "model has none marked param.allreduce = False: mark them, and pass "
                         "expert_data_parallel_group to DistributedDataParallel")
    topology = model.expert_topology
    if section["size"] != topology.expert_parallel_size:
        raise ValueError(f"the checkpoint was saved with expert-parallel size {section['size']}, this run has "
                         f"{topology.expert_parallel_size}: resuming with experts regrouped is not supported yet")
    position = section["positions"][topology.expert_parallel_rank]
    state["model"] = {**state["model"], **position["model"]}
    state["optimizer"] = {**state["optimizer"], "state": {**state["optimizer"]["state"], **position["optimizer"]}}
