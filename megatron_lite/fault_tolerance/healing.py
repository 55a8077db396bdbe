"""Healing: the state a survivor keeps when its generation fails, and how every rank of the next generation
is brought to the newest iteration a survivor completed (live_training.py runs it; docs/fault_tolerance.md,
"Live recovery", steps 2 and 4).

A survivor's snapshot is the state of the last iteration it completed (settled_progress: the optimizer's
update is local, so it was either applied or not), copied out of the objects, which hold the failed
generation's process groups and are rebuilt. heal() agrees on the target iteration, lets survivors at the
target load their snapshot and has a replica at the target send its shard to every rank behind it.
"""

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..checkpointing.last_words import persistent_buffers
from ..checkpointing.rng import set_rng_state
from ..distributed import collectives
from ..optimizer.sharded_state import flatten, unflatten


class LiveRecoveryImpossible(RuntimeError):
    """No replica holds some shard at the iteration to resume from (or this rank's update was torn)."""


@dataclass
class Progress:
    """Where training stands: what an iteration boundary records (and a snapshot carries)."""

    iteration: int
    consumed: int
    rng: dict
    scheduler: dict
    steps_taken: int  # the optimizer's step() count matching this record
    losses: Optional[Dict[str, float]] = None  # the iteration's reported losses, when known
    last_saved: Optional[int] = None
    # The rest of the iteration's log record, for a replacement rank 0 that logs it (the catch-up): the step's
    # outcome is not in the optimizer's state, so it travels with the record.
    grad_norm: Optional[float] = None
    update_successful: bool = True  # False: fp16's loss scaler skipped the update ("skipped" in the record)
    log_interval: Optional[dict] = None  # the log interval's sums before this iteration (TrainingLog.interval_state)


@dataclass
class Snapshot:
    """A survivor's state, taken when its iteration was interrupted: a copy, independent of the objects
    (which hold the old process groups and are rebuilt)."""

    progress: Progress
    flat: torch.Tensor  # optimizer.sharded_state() flattened (sharded_state.flatten: the replica wire format)
    common: dict  # optimizer.common_state_dict()


def take_snapshot(progress: Progress, staged: Optional[Progress], optimizer, scheduler) -> Snapshot:
    """This rank's consistent state after an interrupted iteration (see settled_progress), copied."""
    return Snapshot(settled_progress(progress, staged, optimizer, scheduler),
                    flatten(optimizer.sharded_state(), torch.device("cpu")).clone(), optimizer.common_state_dict())


def settled_progress(progress: Progress, staged: Optional[Progress], optimizer, scheduler) -> Progress:
    """The progress the optimizer's state belongs to after an interrupted iteration: the staged one if the
    update was applied (optimizer.steps_taken says so; the update is local, so it is either done or not),
    else the last committed one. The scheduler is brought to match: train_step steps it after a successful
    update, and the failure may have come in between (in the parameter all-gather); an update that fp16's
    loss scaler skipped leaves it where it was, as train_step does (the iteration still counts as done: its
    loss scale was lowered and its samples consumed). The step's outcome (skipped or not, the gradient norm) is
    taken from the optimizer: the failure came before train_step returned it."""
    if optimizer.updating:
        raise LiveRecoveryImpossible("the optimizer update was torn (it raised half-way)")
    if staged is None or optimizer.steps_taken != staged.steps_taken:
        return progress
    if optimizer.last_step_successful and scheduler.num_steps < staged.scheduler["num_steps"]:
        scheduler.step()
    norm = optimizer.last_grad_norm  # this rank's step() was cut short before returning it
    return dataclasses.replace(staged, scheduler=scheduler.state_dict(),
                               grad_norm=None if norm is None else float(norm),
                               update_successful=optimizer.last_step_successful)


def heal(snapshot: Optional[Snapshot], model, optimizer, scheduler) -> Optional[Progress]:
    """Every rank of the new generation: agree on the iteration to resume from and bring every rank's state
    to it (see the module docstring). Returns the progress to continue from, or None on every rank when no
    rank holds any state (nothing to heal: the caller starts as a fresh job does)."""
    buffers = persistent_buffers(optimizer)
    if buffers:  # every rank holds the same model: all raise alike, before any collective
        raise ValueError(
            f"live recovery rebuilds a replacement from the optimizer's shards and the model provider; this model "
            f"has persistent buffers ({', '.join(buffers[:5])}), which training may change (BatchNorm's running "
            f"statistics) and a replacement would silently reset: run it under torchrun instead")
    everyone = collectives.all_gather_object(None if snapshot is None else snapshot.progress.iteration, None)
    target = max((s for s in everyone if s is not None), default=None)
    if target is None:
        return None
    rank, topology = dist.get_rank(), optimizer.data_parallel_topology
    current = [s == target for s in everyone]
    donors = {}
    for position in range(topology.intra_distributed_optimizer_instance_size):
        holders = topology.holders(position)
        up_to_date = [r for r in holders if current[r]]
        if not up_to_date:
            raise LiveRecoveryImpossible(
                f"shard position {position} (held by rank(s) {list(holders)}) has no replica at iteration "
                f"{target}: both holders were lost; falling back to the last words / the periodic checkpoint")
        for r in holders:
            if not current[r]:
                donors[r] = up_to_date[0]
    reference = current.index(True)
    progress, common = collectives.broadcast_object((snapshot.progress, snapshot.common) if current[rank] else None,
                                                    None, reference)
    # The snapshot is this run's own state: its hyperparameters are the ones it trains with (a resume with
    # --use-checkpoint-opt_param-scheduler may have taken them from a checkpoint), whatever the flags say.
    optimizer.load_common_state_dict(common, "checkpoint")
    scheduler.load_state_dict(progress.scheduler, "checkpoint")
    # Survivors at the target load their own copy; the others load the fresh state for now (the same
    # parameter all-gather on every rank), then receive theirs from a replica.
    described = optimizer.sharded_state()
    optimizer.load_sharded_state(unflatten(snapshot.flat, described) if current[rank] else described)
    model.finish_param_sync()
    for dst in sorted(donors):
        if donors[dst] == rank:
            optimizer.send_shard_state(dst)
        elif dst == rank:
            optimizer.recv_shard_state(donors[dst])
    model.start_param_sync(force_sync=True)  # the received shards reach the other ranks of their instance
    model.finish_param_sync()
    set_rng_state(progress.rng)
    optimizer.steps_taken = progress.steps_taken
    return progress
