"""ZeRO-3 (parameters sharded, Sharding.parameters): parameters gathered per unit, just in time.

Each rank keeps only its shard of every bucket's parameters (Bucket.param_shard). A unit is a module whose
parameters are gathered and released together (a transformer layer, say); its buckets never hold another
unit's parameters (layout.py). Per iteration::

    forward:   root gathered | unit 0: gather (unit 1's already in flight), forward, release | unit 1 ...
    backward:  ... unit 1: gather (unit 0's in flight), backward, gradients reduce-scattered, release
               | unit 0 ... | finish_grad_sync: everything released

Gathers are dispatched in one fixed order per phase (units in registration order for forward, the
reverse for backward), up to a window past the one needed (prefetch.py): a prefetch that every rank
issues in the same sequence, whatever order its autograd happens to reach the units in. They run on a process group of
their own, so their order never interleaves with the gradient reduce-scatters'. A unit is gathered again
before its backward by a hook on its forward outputs, and released once all its parameters received
their expected number of gradients (learned in the first iteration, see Bucket.expected_counts; one each
until then, so the first iteration releases units as it goes too). Parameters outside every unit form the root
unit (embeddings, final norm, a tied output layer): gathered at the start of the forward and released with
the others.

Tunables (DistributedDataParallelConfig, DeepSpeed's ZeRO-3 knobs; the defaults are the behaviour above):
prefetch_bucket_size (how many elements of units are dispatched ahead: the window), max_reuse_distance (the
last units of forward kept gathered for their backward instead of gathered again), param_persistence_threshold
(parameters below it in a persistent bucket: whole on every rank, gathered once per optimizer step).

Which modules are units, and which unit each parameter belongs to, is decided once at wrap time
(fsdp_units.py). `ParamUnits` answers the same calls from DistributedDataParallel as `ParamGather`
(param_gather.py) does for the strategies that keep whole parameters; the hooks that refuse the released
parameters' placeholders (state_dict(), model.module(x), a compiled forward) are an object it holds,
`ParamGuards` (param_guards.py), given the module, the units and the buckets they watch.
"""

import contextlib
import dataclasses
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import collectives
from .bucket import Bucket
from .fsdp_units import PERSISTENT_UNIT, ROOT_UNIT
from .full_state_dict import iter_state_dict
from .param_guards import ParamGuards
from .prefetch import PrefetchSchedule

__all__ = ["ParamUnits"]  # the units themselves are found in fsdp_units.py


class ParamUnits:
    """Gathers and releases the units' parameters around their forward and backward (see module docstring).

    Args:
        module: the wrapped model (its guards' hooks are registered on it and its submodules).
        units: the unit modules, in forward (registration) order.
        buckets_of_unit: per unit id (the unit's index; fsdp_units.ROOT_UNIT, fsdp_units.PERSISTENT_UNIT for
            the root's and the persistent parameters, see fsdp_units.units_of), its buckets.
        group: the group the parameters are sharded over; gathers run on a group of their own with the same ranks.
            An expert bucket (expert_parallel.py) is sharded over its own group, bucket.data_parallel_group:
            its gathers, too, get a group of their own, and their sequence is checked over that group.
        prefetch_bucket_size: DistributedDataParallelConfig.prefetch_bucket_size (None: one unit ahead).
        max_reuse_distance: DistributedDataParallelConfig.max_reuse_distance (None: release every unit after
            its forward).
    """

    def __init__(self, module: torch.nn.Module, units: List[torch.nn.Module],
                 buckets_of_unit: Dict[int, List[Bucket]], group, prefetch_bucket_size: Optional[int] = None,
                 max_reuse_distance: Optional[int] = None):
        self.units = units
        self.buckets = buckets_of_unit
        # Every unit id, in the one order full gathers are issued in (gather_all): the units, the root, the
        # persistent parameters.
        self.unit_ids = list(range(len(units))) + [ROOT_UNIT, PERSISTENT_UNIT]
        self.root = buckets_of_unit.get(ROOT_UNIT, [])
        # Persistent parameters (param_persistence_threshold): gathered at the first forward, then kept
        # whole; after each optimizer step gathered again in place (start()), never released.
        self.persistent = buckets_of_unit.get(PERSISTENT_UNIT, [])
        self._root_ids = {id(b) for b in self.root}
        self._kept_ids = self._root_ids | {id(b) for b in self.persistent}  # never released by a grad hook
        self._persistent_ids = {id(b) for b in self.persistent}
        self._uid = {id(b): i for i, b in enumerate(self.all_buckets())}
        self.check_group = group
        # A group of their own: the order of gathers never mixes with the order of gradient collectives.
        self.group = dist.new_group(dist.get_process_group_ranks(group or dist.group.WORLD),
                                    use_local_synchronization=True)
        # Per sharding group (the dense one first): (its gather group, the buckets' group to check over).
        self._gather_groups = {id(group): (self.group, group)}
        for bucket in self.all_buckets():
            if id(bucket.data_parallel_group) not in self._gather_groups:
                ranks = dist.get_process_group_ranks(bucket.data_parallel_group)
                self._gather_groups[id(bucket.data_parallel_group)] = (
                    dist.new_group(ranks, use_local_synchronization=True), bucket.data_parallel_group)
        forward = list(range(len(units)))
        sizes = [sum(b.param_data.numel() for b in buckets_of_unit.get(i, [])) for i in forward]
        # Units kept gathered from their forward to their backward: the elements gathered in between (the
        # later units, in forward and again in backward) are within max_reuse_distance. Decided once, from the
        # sizes: the same units on every rank, so whether a gather is issued never depends on the rank.
        self.kept_for_backward = frozenset(
            i for i in forward if max_reuse_distance is not None and 2 * sum(sizes[i + 1:]) <= max_reuse_distance)
        self._schedules = {
            "forward": PrefetchSchedule(forward, self._dispatch_unit, sizes, prefetch_bucket_size),
            "backward": PrefetchSchedule(forward[::-1], self._dispatch_unit, sizes[::-1], prefetch_bucket_size)}
        for schedule in self._schedules.values():
            schedule.restart()
        self._open = set()  # phases begun and not yet completed (see _complete)
        self._full_depth = 0  # nesting depth of full_parameters() (see holding_all)
        # Per sharding group, gathers issued this iteration: count and a rolling digest of their order.
        self._signature = {key: [0, 0] for key in self._gather_groups}
        self.hook_handles = []
        for index, unit in enumerate(units):
            self.hook_handles.append(unit.register_forward_pre_hook(self._pre_forward_hook(index)))
            self.hook_handles.append(unit.register_forward_hook(self._post_forward_hook(index)))
        # The hooks that refuse the released parameters' placeholders (param_guards.py).
        self.guards = ParamGuards(module, units, self.root, self.all_buckets())

    # ---------------------------------------------------------------- gathering in a fixed order
    def _gather(self, bucket: Bucket, async_op: bool = True):
        """Gather a released bucket (no-op when gathered or in flight), remembering the collective."""
        if bucket.params_gathered or bucket.param_gather_handle is not None:
            return
        self._issue(bucket, async_op)

    def _issue(self, bucket: Bucket, async_op: bool):
        """All-gather `bucket`'s shards into its full storage (grown if released), remembering the collective."""
        key = id(bucket.data_parallel_group)
        bucket.start_param_sync(async_op, group=self._gather_groups[key][0])
        count, digest = self._signature[key]
        self._signature[key] = [count + 1, (digest * 1_000_003 + self._uid[id(bucket)] + 1) % (1 << 61)]

    def _dispatch_unit(self, index: int):
        for bucket in self.buckets.get(index, []):
            self._gather(bucket)

    def _need(self, phase: str, index: int):
        """Unit `index` must be gathered now: dispatch up to one unit past it in this phase's order."""
        self._schedules[phase].need(index)
        for bucket in self.buckets.get(index, []):
            self._gather(bucket)  # no-op once dispatched; a unit used twice is gathered again
            bucket.wait_params()

    def _complete(self, phase: str, keep=frozenset()):
        """End an open phase: dispatch the units this rank did not reach (a rank that skipped a unit, e.g. a
        branch another rank took, still issues its gather, so every rank issues every phase's gathers in the
        same sequence), then release every unit but those in `keep` (the root stays)."""
        if phase not in self._open:
            return
        self._schedules[phase].dispatch_all()
        for index in range(len(self.units)):
            if index not in keep:
                self.release_unit(index)
        self._open.discard(phase)

    def begin_forward(self):
        """Start of a forward (DistributedDataParallel.forward): a new forward and backward sequence."""
        self.guards.check_not_compiled()
        self._complete("forward")  # a forward that raised half-way
        self._complete("backward")  # the previous micro-batch's
        for schedule in self._schedules.values():
            schedule.restart()
        self._open.add("forward")
        for bucket in self.persistent + self.root:  # the same fixed order on every rank
            self._gather(bucket)
        self._prefetch_first("forward")  # the first units' gathers run while the root's first layers compute
        for bucket in self.persistent + self.root:
            bucket.wait_params()
            bucket.finish_param_sync()  # a persistent bucket's refresh after the optimizer step

    def end_forward(self):
        """End of DistributedDataParallel.forward: complete the forward phase; with autograd recording, the
        backward phase begins (completed by the next forward or by end_iteration), and the units kept for
        backward (max_reuse_distance) stay gathered on every rank, whether it ran them or not."""
        backward = torch.is_grad_enabled()
        self._complete("forward", keep=self.kept_for_backward if backward else frozenset())
        if backward:
            self._open.add("backward")
            self._prefetch_first("backward")  # the last units' gathers run while the loss is computed

    def _prefetch_first(self, phase: str):
        """Dispatch the window of the phase's first unit before any unit is needed (the next items of the
        same fixed order: the sequence of gathers is unchanged, they only start earlier)."""
        schedule = self._schedules[phase]
        if schedule.order:
            schedule.dispatch(schedule.window_end(0))

    def _pre_forward_hook(self, index):
        def hook(module, args):
            if not self.holding_all:
                self._need("forward", index)
        return hook

    def _post_forward_hook(self, index):
        def hook(module, args, output):
            if not (index in self.kept_for_backward and torch.is_grad_enabled()):
                self.release_unit(index)  # (inside full_parameters(): nothing is released)
            if torch.is_grad_enabled():  # gather again just before this unit's backward (unless kept)
                # (inside full_parameters() too: the backward may run after it ended and released the units)
                opaque = []
                tensors = [t for t in _tensors(output, opaque) if t.requires_grad]
                refused = opaque and not tensors and index not in self.kept_for_backward and not self.holding_all
                if refused and self.buckets.get(index):
                    raise TypeError(
                        f"ZeRO-3 unit {type(module).__name__} returned a {type(opaque[0]).__name__}: the wrapper "
                        f"gathers a unit again before its backward from a hook on the tensors of its output, found "
                        f"in tensors, lists, tuples, dicts and dataclasses only. Return one of those (e.g. make "
                        f"{type(opaque[0]).__name__} a dataclass)")
                for tensor in tensors:
                    tensor.register_hook(lambda grad: self._need("backward", index))
            return output
        return hook

    def grad_arrived(self, bucket: Bucket, index: int):
        """A gradient of bucket.params_list[index] arrived (grad hook): release the unit's bucket once its
        backward is done. The root is released by end_iteration only, so that whether it is gathered never
        depends on the rank (its gather at the next forward is then issued by every rank or by none)."""
        if id(bucket) in self._kept_ids:
            if id(bucket) in self._root_ids:
                bucket.count_backward_arrival(index)  # reset when end_iteration releases the root
            return
        if bucket.count_backward_arrival(index) and not self.holding_all:
            bucket.release_params()

    # ---------------------------------------------------------------- releasing
    def all_buckets(self) -> List[Bucket]:
        return [b for buckets in self.buckets.values() for b in buckets]

    def release_all(self):
        """Release every bucket but the persistent ones (inside full_parameters(): none, until it ends)."""
        if self.holding_all:
            return
        for bucket in self.all_buckets():
            if id(bucket) not in self._persistent_ids:
                bucket.release_params()

    def end_backward(self):
        """finish_grad_sync, before it waits for any gradient collective: complete the open phases, so that this
        rank issues the gathers it skipped (a branch it did not run, units past its prefetch window). A peer
        that did run that branch waits for one of those gathers in its backward, before it issues the gradient
        collectives this rank is about to wait for: deferred to end_iteration, both would wait forever."""
        self._complete("forward")
        self._complete("backward")

    def end_iteration(self, check: bool = True):
        """finish_grad_sync: complete the open phases and release everything. With `check`, compare the
        gathers every rank issued in this iteration (one small all-reduce) and raise on every rank if they
        differ: a unit run more than once by some ranks only (gathered again out of the fixed order) pairs
        unrelated gathers across ranks, which must never reach the optimizer."""
        self._complete("forward")
        self._complete("backward")
        self.release_all()
        signatures, self._signature = self._signature, {key: [0, 0] for key in self._gather_groups}
        if not check or not self.all_buckets():  # the same model everywhere: every rank returns here or none
            return
        device = self.all_buckets()[0].param_shard.device
        for key, signature in signatures.items():  # the dense group's first, on every rank
            self._check_sequence(signature, self._gather_groups[key][1], device)

    def _check_sequence(self, signature, group, device):
        values = torch.tensor(signature + [-v for v in signature], dtype=torch.int64, device=device)
        collectives.all_reduce(values, group, op=collectives.MAX)
        high, low = values[:2].tolist(), [-v for v in values[2:].tolist()]
        if high != low:
            raise RuntimeError(
                f"ZeRO-3 (sharded parameters): the data-parallel ranks gathered parameters in different sequences "
                f"this iteration ({low[0]} to {high[0]} gathers): some ranks ran a unit more than once in one "
                f"forward or backward, or ran a unit's forward again after it was released, while others did "
                f"not. Run the same modules the same number of times on every rank (unused branches are fine), "
                f"or make the repeated module part of a larger unit (fsdp_unit_modules)."
            )

    def gather_all(self):
        """Every unit gathered, synchronously, in the fixed order (for full_parameters and the like)."""
        self.release_all()  # whatever a rank still holds: every rank then issues every gather
        for index in self.unit_ids:
            self.gather_unit(index)

    def gather_unit(self, index: int):
        """Unit `index`'s buckets gathered, synchronously (ROOT_UNIT, PERSISTENT_UNIT too; collective: every
        rank gathers the same units in the same sequence)."""
        for bucket in self.buckets.get(index, []):
            self._gather(bucket, async_op=False)
            bucket.wait_params()
            bucket.finish_param_sync()  # a persistent bucket's refresh in flight

    def release_unit(self, index: Optional[int]):
        """Release unit `index`'s buckets (None: nothing; the persistent ones are never released; inside
        full_parameters() nothing is released until it ends)."""
        if index is not None and index != PERSISTENT_UNIT and not self.holding_all:
            for bucket in self.buckets.get(index, []):
                bucket.release_params()

    def wait_all(self):
        for bucket in self.all_buckets():
            bucket.finish_param_sync()

    # ---------------------------------------------------------------- DistributedDataParallel's calls
    def start(self, force_sync: bool = False):
        """After the optimizer's step: the full parameters are stale; units gather the new shards on demand,
        persistent parameters are gathered again in place now (waited for by the next forward). Inside
        full_parameters() nothing is released and the units' hooks gather nothing: every bucket is gathered
        again in place, now (the step is collective, so every rank is here)."""
        if self.holding_all:  # in gather_all()'s order: the same on every rank
            self._refresh([b for index in self.unit_ids for b in self.buckets.get(index, [])], async_op=False)
            return
        self.release_all()
        self._refresh_persistent(async_op=not force_sync)

    def _refresh_persistent(self, async_op: bool):
        """All-gather the persistent buckets' shards into their (kept) full storage; skipped before their first
        gather (every rank is at the same point: the first forward gathers them)."""
        self._refresh(self.persistent, async_op)

    def _refresh(self, buckets: List[Bucket], async_op: bool):
        """All-gather the shards of those of `buckets` that are gathered into their full storage, in place."""
        for bucket in buckets:
            if bucket.params_gathered:
                bucket.finish_param_sync()
                self._issue(bucket, async_op)
                if not async_op:
                    bucket.finish_param_sync()

    def finish(self):
        """Complete the gathers in flight."""
        self.wait_all()

    def reading_placeholders(self):
        """state_dict() of the modules is allowed inside, placeholders and all (ParamGuards.reading_placeholders)."""
        return self.guards.reading_placeholders()

    def iter_state_dict(self, module: torch.nn.Module, prefix: str = "", keep_vars: bool = False):
        """`module.state_dict()`'s items, one unit gathered at a time, each valid until the next is requested
        (full_state_dict.py; collective: iterate to the end on every rank)."""
        return iter_state_dict(self, module, prefix, keep_vars)

    def state_dict(self, module: torch.nn.Module, destination=None, prefix: str = "", keep_vars: bool = False):
        """`module.state_dict()`, read unit by unit (never more than one unit gathered at a time): copies, as
        the gathered storage is released after each unit."""
        state = {} if destination is None else destination
        for key, value in self.iter_state_dict(module, prefix, keep_vars):
            state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return state

    @property
    def holding_all(self) -> bool:
        """Inside full_parameters(): everything stays gathered, whatever runs (no gather, no release)."""
        return self._full_depth > 0

    @contextlib.contextmanager
    def full_parameters(self, write_back: bool = False):
        """Every unit gathered inside the context, released after it; with `write_back` what was written
        into the parameters becomes the new shards."""
        self.gather_all()
        self._full_depth += 1  # the units' forward hooks leave them gathered: one rank may run the model alone
        try:
            yield
            if write_back:
                with torch.no_grad():
                    for bucket in self.all_buckets():
                        bucket.param_shard.copy_(bucket.my_shard_of(bucket.param_data))
                self._refresh_persistent(async_op=False)  # whole again from the shards, as every rank has them
        finally:
            self._full_depth -= 1
            self.release_all()  # only once the outermost full_parameters() ends


def _tensors(output, opaque: List[object]) -> List[torch.Tensor]:
    """The tensors in a unit's output: in tensors, lists, tuples (named too), dicts and dataclasses (a block
    returning `BlockOutput(hidden=...)`): a tensor hidden anywhere else gets no re-gather hook, and its unit's
    backward would read released parameters. Other objects found (not None, numbers, strings) go to `opaque`."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item, opaque)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item, opaque)]
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [t for field in dataclasses.fields(output) for t in _tensors(getattr(output, field.name), opaque)]
    if output is not None and not isinstance(output, (bool, int, float, str)):
        opaque.append(output)
    return []
