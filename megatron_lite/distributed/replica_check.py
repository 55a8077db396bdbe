"""Wrap-time check that every data-parallel rank wraps the same model with the same configuration.

Ranks that differ in parameter names, shapes, dtypes, registration order or DDP config would lay out
different buffers and buckets; their collectives would then pair up unrelated data (silent divergence)
or mismatch in size (a backend abort). One small collective compares a digest of each rank's
description; only when the digests differ are the descriptions themselves gathered, to name the first
difference and the ranks involved, on every rank.

Expert parameters (`allreduce = False`, see expert_parallel.py) are compared only over the expert
data-parallel group: ranks holding other experts may name or shape theirs differently, and never reduce
them together.
"""

import dataclasses
import hashlib
from typing import List

import torch

from . import collectives
from .expert_parallel import is_expert_param


def describe(module: torch.nn.Module, config, experts: bool = False) -> List[str]:
    """One line per dense parameter in registration order, then one per config field; with `experts`,
    one line per expert parameter only."""
    lines = [f"parameter {name}: shape {tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}"
             for name, p in module.named_parameters() if is_expert_param(p) == experts]
    if not experts:
        lines += [f"{type(config).__name__}.{f.name} = {getattr(config, f.name)!r}" for f in dataclasses.fields(config)]
    return lines


def _first_difference(mine: List[str], theirs: List[str]) -> str:
    for index, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"line {index}: {b!r} where rank 0 has {a!r}"
    longer, shorter = (mine, "rank 0") if len(mine) > len(theirs) else (theirs, "this rank")
    return f"line {min(len(mine), len(theirs))}: {longer[min(len(mine), len(theirs))]!r} missing on {shorter}"


def check_replicas_agree(module: torch.nn.Module, config, group=None, expert_group=None):
    """Raise ValueError on every rank of `group` when the ranks' dense parameters or configs differ; with
    `expert_group` (this rank's expert data-parallel group), then on every rank of it when its ranks'
    expert parameters differ."""
    _compare(describe(module, config), group, "data-parallel ranks wrap different models or configs (ranks are "
             "numbered in the data-parallel group; each has to build the same model, in the same order and dtypes, "
             "with the same DistributedDataParallelConfig)")
    if expert_group is not None:
        # Compared within each expert group, the verdict shared over `group`: a group that agrees must not
        # go on into collectives that the ranks of a disagreeing group will never join.
        collectives.run_collectively(
            _compare, describe(module, config, experts=True), expert_group, "expert data-parallel ranks hold "
            "different expert parameters (ranks are numbered in the expert data-parallel group; ranks of one group "
            "must hold the same experts, in the same order and dtypes)", group=group)


def _compare(lines: List[str], group, what: str):
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    digests = collectives.all_gather_object(digest, group)
    if len(set(digests)) == 1:
        return
    everyone = collectives.all_gather_object(lines, group)
    reasons = [f"rank {r}: {_first_difference(everyone[0], theirs)}"
               for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    raise ValueError(f"{what}: " + "; ".join(reasons))
