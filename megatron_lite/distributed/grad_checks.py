"""finish_grad_sync()'s verdicts on a finished iteration: parameters that got no gradient, NaN/Inf gradients
on any rank (both raised on every rank that can know, after the collectives ran: a peer waiting in them
must never hang), and parameters frozen or unfrozen since the model was wrapped."""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import collectives
from .bucket import Bucket


def unused_parameters_message(launch_order: List[Bucket], pending: List[Bucket],
                              param_to_name: Dict[torch.nn.Parameter, str]) -> Optional[str]:
    """With overlap_grad_reduce: why `pending` buckets were never launched from the hooks, or None when
    that is expected (the first iteration launches every bucket in finish_grad_sync)."""
    if not any(b.params_with_grad for b in launch_order):
        return ("finish_grad_sync() found no gradient registered for communication: the last micro-batch's "
                "backward must run outside no_sync()")
    missing = [param_to_name[p] for b in pending for p in b.params_without_gradients()]
    if not missing:
        return None
    shown = ", ".join(missing[:20]) + (f" (and {len(missing) - 20} more)" if len(missing) > 20 else "")
    return (
        f"{len(missing)} parameter(s) received no gradient in this iteration: {shown}. With "
        f"overlap_grad_reduce their buckets can never be communicated. Either make every trainable "
        f"parameter take part in the loss, freeze the unused ones (requires_grad=False) before "
        f"wrapping, or set DistributedDataParallelConfig(find_unused_parameters=True)."
    )


def globally_unused_params(launch_order: List[Bucket], group) -> frozenset:
    """find_unused_parameters: the parameters no rank of `group` got a gradient for in this iteration (any
    micro-batch), from one small all-reduce of per-parameter flags, as torch DDP does. The optimizer leaves
    them alone, as torch's optimizers skip a parameter whose .grad is None."""
    params = [p for bucket in launch_order for p in bucket.params_list]
    if not params:
        return frozenset()
    seen = torch.tensor([s for bucket in launch_order for s in bucket.grad_seen], dtype=torch.int32,
                        device=params[0].device)
    collectives.all_reduce(seen, group, op=collectives.MAX)
    return frozenset(p for p, s in zip(params, seen.tolist()) if not s)


def raise_if_any_rank_found_nonfinite(buffers, group):
    """One small all-reduce of a flag per rank (every rank takes part), then every rank raises together,
    naming the bad ranks and, on them, the bucket and parameter of each NaN/Inf local gradient."""
    if not buffers:
        return  # nothing trainable anywhere (same model on every rank): nothing to check
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.float32, device=buffers[0].device)
    local = [(f"buffer {i} ({buf.grad_dtype}) bucket {b.bucket_id}", name)
             for i, buf in enumerate(buffers) for b in buf.buckets for name in b.nonfinite_params]
    flags[dist.get_rank(group)] = float(bool(local))
    collectives.all_reduce(flags, group)
    bad_ranks = [r for r, f in enumerate(flags.tolist()) if f]
    if not bad_ranks:
        return
    global_rank = dist.get_rank()
    if local:
        where = "; ".join(f"{bucket}: {name}" for bucket, name in local)
        detail = f"rank {global_rank} found NaN/Inf in its local gradients before communication: {where}"
    else:
        detail = f"rank {global_rank}'s local gradients were finite"
    raise RuntimeError(f"check_for_nan_in_grad: NaN/Inf gradients on data-parallel rank(s) {bad_ranks}; {detail}")


def raise_if_requires_grad_changed(named_params: List[Tuple[str, torch.nn.Parameter, bool]]):
    """`named_params`: (name, param, requires_grad at wrap time). The buffers are laid out once, at wrap time:
    a parameter frozen or unfrozen since then is an error naming it."""
    changed = [f"{name} ({'unfrozen' if p.requires_grad else 'frozen'})"
               for name, p, trainable in named_params if p.requires_grad != trainable]
    if changed:
        raise ValueError(
            f"requires_grad changed after the model was wrapped: {', '.join(changed)}. "
            f"DistributedDataParallel lays out its gradient buffers once, at construction: set requires_grad "
            f"before wrapping (or wrap the model again, with a new optimizer)."
        )


def raise_if_params_replaced(module: torch.nn.Module, named_params: List[Tuple[str, torch.nn.Parameter, bool]]):
    """`named_params`: the model's parameters at wrap time. A module assigned after wrapping (a new task head,
    adapters injected into the wrapped model) has parameters in no buffer, hook or optimizer: they would never
    be reduced nor trained, while the ones it replaced are stepped on zeros. An error naming both sides.
    Frozen parameters are in no buffer either way: one re-created in the forward (a position table grown for
    a longer input) is fine, until it is made trainable. One pass over module.parameters() (identity only),
    once per iteration."""
    wrapped = [p for _, p, _ in named_params]
    current = list(module.parameters())
    if len(current) == len(wrapped) and all(a is b for a, b in zip(current, wrapped)):
        return
    known, now = set(wrapped), set(current)
    new = [n for n, p in module.named_parameters() if p not in known and p.requires_grad]
    gone = [n for n, p, trainable in named_params if p not in now and trainable]
    if not new and not gone:
        return  # the same parameters, registered in another order: the buffers do not depend on it
    raise ValueError(
        f"the model's parameters changed since the model was wrapped: new {new or 'none'} (in no gradient buffer "
        f"or optimizer: never reduced nor trained), gone {gone or 'none'} (still stepped). Assign or inject "
        f"modules (a new head, adapters) before wrapping, then build the optimizer (or wrap the model again, "
        f"with a new optimizer); load weights in place (load_state_dict without assign=True)."
    )
