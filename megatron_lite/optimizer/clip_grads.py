"""Global gradient norm, clipping and zero counting, over full gradients or over per-rank shards."""

from typing import List, Optional

import torch
import torch.distributed as dist

from ..distributed import collectives


def _sum_of_squares(grads: List[torch.Tensor], device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack([n.float() for n in torch._foreach_norm(grads, 2)]).square().sum()


def get_grad_norm_fp32(grads: List[torch.Tensor], group: Optional[dist.ProcessGroup] = None,
                       sharded: bool = False, device=None,
                       distinct_grads: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
    """L2 norm of all `grads` as a 0-dim fp32 tensor.

    Full gradients (every rank holds all of them): computed exactly like torch.nn.utils.clip_grad_norm_
    (per-tensor norms, then the norm of those), so the result is bitwise torch's. Sharded gradients
    (`sharded=True`): each rank sums the squares of its shards and the sums are all-reduced over
    `group`, so every rank gets the same global norm.

    `distinct_grads` (full gradients only; a list on every rank of `group`, possibly empty): further
    gradients that differ between the ranks, each counted by exactly one of them (expert gradients, see
    MegatronOptimizer._grads_for_stats); their squares are summed over `group`, `grads`' are not.
    """
    device = grads[0].device if grads else device
    if distinct_grads is not None:
        assert not sharded, "shards are distinct already: pass them all as grads"
        reduced = _sum_of_squares(distinct_grads, device)
        collectives.all_reduce(reduced, group)
        return (_sum_of_squares(grads, device) + reduced).sqrt()
    if not sharded:
        if not grads:
            return torch.zeros((), device=device)
        return torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads, 2)]), 2)
    total_sq = _sum_of_squares(grads, device)
    collectives.all_reduce(total_sq, group)
    return total_sq.sqrt()


def clip_grads_by_total_norm(grads: List[torch.Tensor], max_norm: float, total_norm: torch.Tensor):
    """Scale `grads` in place by max_norm / (total_norm + 1e-6) when that is below 1 (torch's formula)."""
    clip_coeff = max_norm / (total_norm + 1e-6)
    if grads and clip_coeff.item() < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def _zeros(grads: List[torch.Tensor], device) -> torch.Tensor:
    return sum((g.numel() - torch.count_nonzero(g) for g in grads), torch.zeros((), dtype=torch.int64, device=device))


def count_zeros_fp32(grads: List[torch.Tensor], group: Optional[dist.ProcessGroup] = None,
                     sharded: bool = False, device=None,
                     distinct_grads: Optional[List[torch.Tensor]] = None) -> int:
    """Number of zero elements in `grads` (summed over `group` when the grads are shards), plus those of
    `distinct_grads` summed over `group` (see get_grad_norm_fp32)."""
    device = grads[0].device if grads else device
    if distinct_grads is not None:
        assert not sharded, "shards are distinct already: pass them all as grads"
        reduced = _zeros(distinct_grads, device)
        collectives.all_reduce(reduced, group)
        return int((_zeros(grads, device) + reduced).item())
    zeros = _zeros(grads, device)
    if sharded:
        collectives.all_reduce(zeros, group)
    return int(zeros.item())
