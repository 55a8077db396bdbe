"""Expert parameters: megatron-core's `param.allreduce = False` marker, and the groups their gradients use.

A mixture-of-experts model with expert parallelism places different experts on different ranks. Dense
parameters are replicated over the whole data-parallel group; an expert parameter only over the ranks
that hold the same experts, its *expert data-parallel group*. With dp=4 and expert-parallel size 2::

    data-parallel group      {0, 1, 2, 3}        dense gradients: mean over 4 ranks
    expert data-parallel     {0, 2}   {1, 3}     expert gradients: reduced over 2 ranks
    expert-parallel rank       0        1        (which experts a rank holds: its group's index)

Megatron-core's scaling for expert gradients (distributed_data_parallel.py): the reduced gradient is the
*sum* over the expert data-parallel group divided by the dense data-parallel size (pre-scale by 1/dp and
sum; or, with average_in_collective, pre-scale by edp/dp and average). With expert parallelism each expert
sees the tokens of every expert-parallel rank (the model's all-to-all), so this is the gradient of the
global mean loss, the same normalisation as the dense parameters'.

`expert_topology` validates the groups once, at wrap time, with one collective over the data-parallel
group, so a misuse raises the same ValueError on every rank instead of hanging one of them.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import collectives


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """megatron-core's marker: an expert-parallel parameter has `allreduce = False`."""
    return not getattr(param, "allreduce", True)


@dataclass(frozen=True)
class ExpertTopology:
    """Where this rank's expert parameters live, agreed by every rank of the data-parallel group."""

    expert_data_parallel_size: int
    """Ranks holding the same experts as this one (the expert data-parallel group's size)."""
    expert_data_parallel_rank: int
    """This rank's index in its expert data-parallel group."""
    expert_parallel_size: int
    """How many different sets of experts the data-parallel group holds (the number of expert groups)."""
    expert_parallel_rank: int
    """Which of those sets this rank holds: its expert group's index, groups ordered by their lowest rank."""
    has_expert_params: bool
    """Whether any rank of the data-parallel group has a parameter marked `allreduce = False`."""


def gradient_scaling_factors(data_parallel_size: int, expert_data_parallel_size: int, average_in_collective: bool,
                             calculate_per_token_loss: bool) -> Tuple[float, float]:
    """(dense, expert) factors applied to a bucket before its collective, megatron-core's rule: both
    reductions end at (sum over the reducing group) / dp. A per-token loss is summed (scaled later)."""
    if calculate_per_token_loss:
        return 1.0, 1.0
    if average_in_collective:  # the collective divides by its own size: dp for dense, edp for experts
        return 1.0, expert_data_parallel_size / data_parallel_size
    return 1.0 / data_parallel_size, 1.0 / data_parallel_size


def _describe_rank(named_params, expert_group) -> dict:
    marked = [name for name, p in named_params if is_expert_param(p)]
    ranks = None if expert_group is None else sorted(dist.get_process_group_ranks(expert_group))
    return {"rank": dist.get_rank(), "marked": marked, "expert_group": ranks}


def _problems(everyone: List[dict], dp_ranks: List[int]) -> List[str]:
    """What is wrong with the ranks' expert groups (the same verdict on every rank: same input)."""
    given = [d for d in everyone if d["expert_group"] is not None]
    marked = [(d["rank"], d["marked"]) for d in everyone if d["marked"]]
    if given and len(given) < len(everyone):
        missing = [d["rank"] for d in everyone if d["expert_group"] is None]
        return [f"expert_data_parallel_group was given on some ranks but is None on rank(s) {missing}: pass it "
                f"on every rank"]
    if marked and not given:
        names = ", ".join(f"rank {r}: {', '.join(m[:5])}" + (f" (and {len(m) - 5} more)" if len(m) > 5 else "")
                          for r, m in marked[:4])
        return [f"parameters are marked as expert parameters (param.allreduce = False) but no "
                f"expert_data_parallel_group was given ({names}). Their gradients must be reduced only over the "
                f"ranks holding the same experts: pass DistributedDataParallel(..., expert_data_parallel_group="
                f"<this rank's group of ranks with the same experts>) on every rank, or remove the marker to "
                f"treat them as dense parameters"]
    problems = []
    groups = {tuple(d["expert_group"]) for d in given}
    for d in given:
        if d["rank"] not in d["expert_group"]:
            problems.append(f"rank {d['rank']}'s expert_data_parallel_group {d['expert_group']} does not contain it")
        outside = sorted(set(d["expert_group"]) - set(dp_ranks))
        if outside:
            problems.append(f"rank {d['rank']}'s expert_data_parallel_group {d['expert_group']} has ranks "
                            f"{outside} outside the data-parallel group {dp_ranks}")
    members = [r for g in groups for r in g]
    if not problems and (len(members) != len(set(members)) or len({len(g) for g in groups}) > 1):
        problems.append(f"the expert data-parallel groups {sorted(groups)} must split the data-parallel group "
                        f"into disjoint groups of one size (ranks holding the same experts)")
    return problems


def expert_topology(named_params: List[Tuple[str, torch.nn.Parameter]], data_parallel_group,
                    expert_data_parallel_group) -> Optional[ExpertTopology]:
    """Validate the expert groups of every rank (one collective over `data_parallel_group`); None when no
    rank gave a group and no parameter is marked. Raises ValueError on every rank for a parameter marked
    `allreduce = False` without a group, or groups that do not split the data-parallel group evenly."""
    everyone = collectives.all_gather_object(_describe_rank(named_params, expert_data_parallel_group),
                                             data_parallel_group)
    dp_ranks = dist.get_process_group_ranks(data_parallel_group or dist.group.WORLD)
    problems = _problems(everyone, dp_ranks)
    if problems:
        raise ValueError("DistributedDataParallel: " + "; ".join(problems))
    if expert_data_parallel_group is None:
        return None
    groups = sorted({tuple(d["expert_group"]) for d in everyone})
    mine = tuple(sorted(dist.get_process_group_ranks(expert_data_parallel_group)))
    return ExpertTopology(
        expert_data_parallel_size=len(mine),
        expert_data_parallel_rank=dist.get_rank(expert_data_parallel_group),
        expert_parallel_size=len(groups),
        expert_parallel_rank=groups.index(mine),
        has_expert_params=any(d["marked"] for d in everyone),
    )
