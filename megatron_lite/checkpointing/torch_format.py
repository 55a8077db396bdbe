"""The `torch` checkpoint format: the whole training state in one file, which rank 0 writes.

::

    SAVE/iter_0000200/model_optim_rng.pt   {'checkpoint_version', 'iteration', 'consumed_train_samples',
                                            'model': full tensors, 'optimizer': full fp32 tensors per
                                            parameter name (optimizer/optimizer_state.py), 'opt_param_scheduler',
                                            'rng_state': one per rank, 'args'[, 'expert_parallel']}
    SAVE/iter_0000200/manifest.json        checksums (files.py)

Neither part depends on the data-parallel size, so a run saved on N ranks resumes on M. Saving:
payload() gathers the state to rank 0 (a collective), write() stores it in the directory save.py made.
Loading (load.py reads and checks the file first): check_fits() on every rank before load_tensors() writes
any tensor, as those writes include collectives. Expert parameters: experts.py.
"""

import os
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed import collectives
from . import experts, files
from .rng import get_rng_state

_serialize = torch.save  # module attribute so tests can simulate a crash in the middle of a write

CHECKPOINT_FILENAME = "model_optim_rng.pt"


def payload(iteration: int, model, optimizer, scheduler, consumed_train_samples: int, args: Optional[dict],
            group=None) -> Optional[dict]:
    """Every rank (collective over `group`): the checkpoint's content on the group's rank 0, None elsewhere."""
    # Streamed to the CPU (ZeRO-3: one unit gathered at a time); kept by the rank that writes, and by every rank
    # when the experts' entries are collected from each position (experts.split).
    keep = dist.get_rank(group) == 0 or experts.has_experts(optimizer)
    model_state = {k: v for k, v in model.iter_full_state_dict() if keep}
    optimizer_state = optimizer.state_dict()
    # Expert parameters: every expert-parallel position's, in a section of their own (experts.py).
    expert_section = experts.split(model, optimizer, model_state, optimizer_state, group)
    rng_states = collectives.all_gather_object(get_rng_state(), group)
    if dist.get_rank(group) != 0:
        return None
    return {
        "checkpoint_version": files.CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "model": model_state,
        "optimizer": optimizer_state,
        "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": rng_states,
        "args": args or {},
        **({} if expert_section is None else {experts.SECTION: expert_section}),
    }


def tensors(content: dict) -> dict:
    """The parts of a payload that hold the trained tensors (what must be finite to be saved)."""
    return {"model": content["model"], "optimizer": content["optimizer"], "experts": content.get(experts.SECTION)}


def write(directory: str, content: dict):
    """Rank 0: the payload as the one file of a checkpoint directory being written."""
    files.write_atomically(os.path.join(directory, CHECKPOINT_FILENAME), lambda f: _serialize(content, f))


def check_fits(path: str, model, optimizer, state: dict, load_optim: bool):
    """A loaded payload holds every tensor of this model with the model's shapes (checked before any is
    written: the writes include collectives, which a rank raising half-way would leave waiting). Adds this
    rank's expert-parallel position's experts to `state` (experts.merge), and a tied weight's second name
    where the checkpoint holds it under its parameter's name only (converted from torch_dist)."""
    experts.merge(model, optimizer, state)
    shapes = {name: tuple(p.shape) for p, name in optimizer.param_to_name.items()}
    tied = model.tied_names()  # a tied weight's second name: stored or not (torch_dist keeps it once)
    state["model"] = {**{alias: state["model"][name] for alias, name in tied.items() if name in state["model"]},
                      **state["model"]}
    expected = set(shapes) | set(model.untrained_state_dict())
    missing, unexpected = sorted(expected - set(state["model"])), sorted(set(state["model"]) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} was saved from another model: it lacks {missing[:5]} and holds "
                         f"{unexpected[:5]}, which this model has not")
    for name, shape in shapes.items():
        if tuple(state["model"][name].shape) != shape:
            raise ValueError(f"checkpoint {path} holds {name} of shape {list(state['model'][name].shape)}, the "
                             f"model's is {list(shape)}: it was saved from another model")
    if load_optim:
        lacking = sorted(set(optimizer.param_to_name.values()) - set(state["optimizer"]["state"]))
        if lacking:
            raise ValueError(f"checkpoint {path} lacks the optimizer state of {lacking[:5]}")


def load_tensors(model, optimizer, state: dict, hyperparameters: str, load_optim: bool):
    """Every rank, after check_fits and the small state: the model's and (load_optim) the optimizer's tensors."""
    model.load_state_dict(state["model"])
    if load_optim:
        optimizer.load_state_dict(state["optimizer"], hyperparameters=hyperparameters)
