"""Configuration of the data-parallel wrapper (field names and meanings follow megatron.core)."""

import fnmatch
from dataclasses import dataclass, fields
from typing import Optional, Tuple

from ..config_checks import Check, check_fields, is_int


@dataclass(frozen=True)
class Sharding:
    """What each data-parallel rank keeps only its shard of: the strategy string, decoded once. Everything
    outside this module asks these flags (each implies the ones before it), never the strategy's name."""

    name: str
    """The data_parallel_sharding_strategy it was decoded from (for messages)."""

    optimizer_state: bool
    """The distributed optimizer's shard of the main parameters and optimizer state (ZeRO-1)."""

    gradients: bool
    """The reduced gradients: the full-size gradients are freed after each bucket's reduction (ZeRO-2)."""

    parameters: bool
    """The parameters: gathered per unit just before its forward and its backward, released after (ZeRO-3)."""


_SHARDINGS = {s.name: s for s in (
    Sharding("no_shard", optimizer_state=False, gradients=False, parameters=False),
    Sharding("optim", optimizer_state=True, gradients=False, parameters=False),
    Sharding("optim_grads", optimizer_state=True, gradients=True, parameters=False),
    Sharding("optim_grads_params", optimizer_state=True, gradients=True, parameters=True),
)}
SHARDING_STRATEGIES = tuple(_SHARDINGS)
UNSHARDED_GRADIENT_STRATEGIES = tuple(name for name, s in _SHARDINGS.items() if not s.gradients)
"""The strategies that keep whole reduced gradients (for messages that suggest one)."""
OPTIMIZER_SHARDING_STRATEGIES = tuple(name for name, s in _SHARDINGS.items() if s.optimizer_state)
"""The strategies that shard the optimizer state, i.e. imply use_distributed_optimizer."""


@dataclass
class DistributedDataParallelConfig:
    """What `DistributedDataParallel` does with gradients; validated on construction."""

    grad_reduce_in_fp32: bool = False
    """Keep gradients (main_grad) and reduce them in fp32, whatever the parameter dtype.
    Megatron's `--accumulate-allreduce-grads-in-fp32`; implied by `--bf16` in pretrain_gpt.py."""

    overlap_grad_reduce: bool = False
    """Launch each bucket's collective from the grad hooks as soon as the bucket is complete, so the
    communication overlaps the rest of backward. Off: everything is reduced in `finish_grad_sync()`."""

    overlap_param_gather: bool = False
    """Defer the distributed optimizer's parameter all-gather and overlap it with the next forward.
    Requires `use_distributed_optimizer`."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (ZeRO-1): buckets are padded so that they split
    into equal shards, gradients are reduce-scattered, and parameters live in a contiguous buffer."""

    data_parallel_sharding_strategy: Optional[str] = None
    """What each data-parallel rank keeps only a shard of (Megatron-FSDP's names): 'no_shard' (plain DDP),
    'optim' (optimizer state: ZeRO-1, the distributed optimizer), 'optim_grads' (and the reduced
    gradients: ZeRO-2), 'optim_grads_params' (and the parameters, gathered per unit just before its
    forward and its backward: ZeRO-3; needs overlap_grad_reduce). None: 'optim' with
    use_distributed_optimizer, else 'no_shard'. A sharded strategy implies use_distributed_optimizer."""

    fsdp_unit_modules: Optional[Tuple[str, ...]] = None
    """ZeRO-3's units of gathering: class names of the modules whose parameters are gathered and released
    together (Megatron-FSDP's fsdp_unit_modules, e.g. ('TransformerLayer',)). None: every child of an
    nn.ModuleList. `()`: no units, the whole model gathered at once. Parameters outside any unit form the
    root unit, gathered for the whole forward and backward. A name matching no submodule, or None on a
    model without an nn.ModuleList, is an error at wrap time listing the model's candidate classes."""

    prefetch_bucket_size: Optional[int] = None
    """ZeRO-3: how far ahead units are gathered, in parameter elements (DeepSpeed's stage3_prefetch_bucket_size;
    Megatron-FSDP derives its prefetch from suggested_communication_unit_size). When a unit is needed, the next
    units of the phase's fixed order are dispatched while the elements already dispatched past it are below
    this, so the last one may overshoot (DeepSpeed's and Megatron-FSDP's rule). 0: no prefetch, each unit is
    gathered when needed; None: exactly one unit ahead. A rank holds at most the root, the persistent
    parameters, the unit in use, the units in the window and, in backward, one unit still receiving
    gradients. Only with data_parallel_sharding_strategy='optim_grads_params'."""

    max_reuse_distance: Optional[int] = None
    """ZeRO-3: a unit is kept gathered from its forward to its backward, instead of released and gathered
    again, when the parameter elements gathered in between (the units after it, in forward and again in
    backward) are at most this (DeepSpeed's stage3_max_reuse_distance; FSDP2's reshard_after_forward=False
    keeps every unit). 0: the last unit only, reused at once; a value >= twice the units' elements: every
    unit, one gather per unit and step instead of two (ZeRO-2's parameter memory at the end of forward).
    None: every unit released after its forward. Only with data_parallel_sharding_strategy='optim_grads_params'."""

    param_persistence_threshold: int = 0
    """ZeRO-3: parameters with fewer elements than this are kept whole on every rank (DeepSpeed's
    stage3_param_persistence_threshold): gathered at the first forward, gathered again in place after each
    optimizer step, never released, and never gathered in forward or backward. Their gradients and optimizer
    state stay sharded; they cost their full size in memory. 0: none. Only with
    data_parallel_sharding_strategy='optim_grads_params'."""

    reduce_scatter_with_fp32_accumulation: bool = False
    """megatron-core's reduce-scatter that sends gradients in their own (low) precision but sums them in fp32:
    an all-to-all hands every rank the other ranks' copies of its shard, which it adds up in fp32, in rank
    order, and rounds once to the grad dtype (a ring reduce-scatter rounds after every hop). Same bytes as a
    ring reduce-scatter, plus one bucket-sized scratch per bucket in flight; the same on gloo and NCCL. Needs a
    sharded strategy (no_shard all-reduces), SUM (not average_in_collective), one distributed-optimizer
    instance, and low-precision gradients (not grad_reduce_in_fp32). docs/performance.md has bytes and error."""

    param_name_patterns_for_fp32_local_accumulation: Tuple[str, ...] = ()
    """Parameters (fnmatch patterns on their names, 'all' for every one) whose main_grad is a separate fp32
    tensor that gradients accumulate into over the micro-batches (megatron-core's field), while their bucket
    still communicates in the grad dtype: the fp32 sum is rounded into the bucket when it is launched, and the
    reduced value copied back into main_grad (fp32) when it is done. Costs 4 bytes per matched element. Not
    with grad_reduce_in_fp32 (main_grad is fp32 already); a pattern matching no trainable parameter is an
    error at wrap time."""

    num_distributed_optimizer_instances: int = 1
    """Split the data-parallel ranks into this many instances of the distributed optimizer (contiguous
    blocks of dp/R ranks, as megatron-core). Gradients are reduce-scattered inside an instance and the
    shards all-reduced across instances; each instance shards the optimizer state and gathers the
    parameters among its own ranks, so every shard is held by R ranks (a replica survives the loss of a
    rank: docs/fault_tolerance.md). 1: one instance over all ranks. Needs a sharded strategy and dp
    divisible by R."""

    check_for_nan_in_grad: bool = False
    """Check every bucket for NaN/Inf before communicating it; raise naming rank, bucket and parameter."""

    bucket_size: Optional[int] = None
    """Elements per bucket (a bucket closes at the first parameter that reaches this size). Only used with
    `overlap_grad_reduce`: without overlap there is always one bucket. None: Megatron's default,
    max(40M, 1M x dp)."""

    num_buckets: Optional[int] = None
    """Megatron's alternative to bucket_size (`--ddp-num-buckets`): aim for this many buckets, i.e. a bucket
    size of (number of elements of the model's parameters) // num_buckets. Only one of the two may be set.
    Like bucket_size, only used with `overlap_grad_reduce`."""

    average_in_collective: bool = False
    """Average with ReduceOp.AVG inside the collective instead of pre-scaling by 1/dp and summing."""

    calculate_per_token_loss: bool = False
    """The loss function returns a sum over tokens and their count (Megatron's --calculate-per-token-loss):
    gradients are summed over ranks, not averaged, and the training loop divides them by the number of
    tokens in the whole global batch. Off: each rank's gradient is pre-scaled by 1/dp (a mean over ranks)."""

    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad bucket ends to lcm(dp, 128, 2^16) instead of lcm(dp, 128) (NCCL bus bandwidth is higher for
    message sizes divisible by large powers of two). Requires `use_distributed_optimizer`."""

    find_unused_parameters: bool = False
    """megatron-lite extension (cf. torch DDP). With `overlap_grad_reduce`, parameters that get no gradient
    in an iteration are normally an error (their bucket could never be launched). When True they are
    treated as having a zero local gradient and the result is exact. A bucket's completion in backward then
    depends on the branches a rank ran: with several model chunks (wrappers with overlap_grad_reduce) on one
    process group the ranks' launch orders would differ (a deadlock), so there every bucket is launched in
    finish_grad_sync, none during backward; a lone wrapper keeps the overlap (ZeRO-3: launched, not waited
    for, in backward). Give all chunks one data-parallel group object."""

    gradient_as_bucket_view: bool = False
    """megatron-lite extension (torch DDP's flag of that name): each parameter's .grad is its main_grad view,
    so autograd accumulates straight into the buffer instead of allocating a fresh gradient that the hook
    then adds. Under no_shard .grad then holds the reduced gradient after finish_grad_sync, so torch's own
    tools (clip_grad_norm_, a torch optimizer) see it; with the distributed optimizer .grad is None after
    finish_grad_sync (only the rank's shard is reduced). Without it .grad is always None after the hooks.
    Only where the grad dtype is the parameter's and the full-size buffer persists (not with
    grad_reduce_in_fp32 on low-precision params, nor ZeRO-2/3). Incompatible with fused weight-gradient
    layers that add into main_grad themselves (an error says so)."""

    broadcast_buffers: bool = True
    """torch DDP's flag of that name and default: before a forward, copy the module's buffers (BatchNorm's
    running statistics, say) from data-parallel rank 0 to the others, so that every rank's replica stays the
    same. As in torch, the copy is skipped on a forward that follows one run under no_sync() or without
    autograd (e.g. evaluation after the first eval forward). Models without buffers (the GPT) send nothing.
    False: each rank keeps its own buffers (Megatron's behaviour; then save or evaluate with care)."""

    def __post_init__(self):
        if self.data_parallel_sharding_strategy is None:
            self.data_parallel_sharding_strategy = "optim" if self.use_distributed_optimizer else "no_shard"
        check_fields(self, _STRATEGY_RULES)
        self.use_distributed_optimizer = self.sharding.optimizer_state
        check_fields(self, _NAME_LIST_RULES)
        patterns = self.param_name_patterns_for_fp32_local_accumulation
        self.param_name_patterns_for_fp32_local_accumulation = tuple(patterns)
        if self.fsdp_unit_modules is not None:
            self.fsdp_unit_modules = tuple(self.fsdp_unit_modules)
        check_fields(self, _FIELD_RULES)
        check_fields(self, _COMBINATION_RULES)

    @property
    def sharding(self) -> Sharding:
        """What data_parallel_sharding_strategy shards (optimizer state, gradients, parameters)."""
        return _SHARDINGS[self.data_parallel_sharding_strategy]

    def accumulates_in_fp32(self, param_name: str) -> bool:
        """Whether `param_name` matches param_name_patterns_for_fp32_local_accumulation."""
        return any(pattern_matches(p, param_name) for p in self.param_name_patterns_for_fp32_local_accumulation)


def pattern_matches(pattern: str, param_name: str) -> bool:
    """megatron-core's rule for param_name_patterns_for_fp32_local_accumulation: fnmatch (case-sensitive on
    every OS here), and the special pattern 'all'."""
    return pattern == "all" or fnmatch.fnmatchcase(param_name, pattern)


# ------------------------------------------------------------------------------------------ validation
# __post_init__ walks these tables in this order (config_checks.py): the strategy first (the other rules read
# config.sharding), then every field's own type and range in declaration order, then the combinations.
_STRATEGY_RULES = ((None, (
    Check(lambda c: c.data_parallel_sharding_strategy in SHARDING_STRATEGIES,
          f"data_parallel_sharding_strategy must be one of {', '.join(SHARDING_STRATEGIES)}, "
          "got {config.data_parallel_sharding_strategy!r}"),
    Check(lambda c: c.sharding.optimizer_state or not c.use_distributed_optimizer,
          "data_parallel_sharding_strategy={config.data_parallel_sharding_strategy!r} contradicts "
          "use_distributed_optimizer=True (which shards the optimizer state): drop one of them"),
    Check(lambda c: not c.sharding.parameters or c.overlap_grad_reduce,
          "data_parallel_sharding_strategy={config.data_parallel_sharding_strategy!r} needs "
          "overlap_grad_reduce=True: a unit's gradients are reduced, and its parameters released, as soon as its "
          "backward is done"),
)),)


def _names(value) -> bool:
    return not isinstance(value, str) and all(isinstance(n, str) for n in value)


_NAME_LIST_RULES = (
    ("param_name_patterns_for_fp32_local_accumulation", (Check(
        _names, "{name} must be a sequence of fnmatch patterns (e.g. ('*.router.weight',) or ('all',)), "
                "got {value!r}", TypeError),)),
    ("fsdp_unit_modules", (Check(
        lambda v: v is None or _names(v), "{name} must be a sequence of module class names, got {value!r}",
        TypeError),)),
)

_BOOL = (Check(lambda v: isinstance(v, bool), "{name} must be a bool, got {value!r}", TypeError),)
_ZERO3_TUNING = (
    Check(lambda v: v is None or is_int(v), "{name} must be an int >= 0, got {value!r}", TypeError),
    Check(lambda v: v is None or v >= 0, "{name} must be >= 0, got {value}"),
)
_POSITIVE_OR_NONE = (
    Check(lambda v: v is None or is_int(v), "{name} must be a positive int or None, got {value!r}", TypeError),
    Check(lambda v: v is None or v > 0, "{name} must be a positive int or None, got {value}"),
)
# Every field not named here (nor checked above) is a bool.
_FIELD_CHECKS = {
    "num_distributed_optimizer_instances": (
        Check(is_int, "{name} must be a positive int, got {value!r}", TypeError),
        Check(lambda v: v >= 1, "{name} must be >= 1, got {value}"),
    ),
    "prefetch_bucket_size": _ZERO3_TUNING,
    "max_reuse_distance": _ZERO3_TUNING,
    "param_persistence_threshold": (
        _ZERO3_TUNING[0],
        Check(lambda v: v is not None, "{name} must be an int >= 0 (0: none), got None", TypeError),
        _ZERO3_TUNING[1],
    ),
    "bucket_size": _POSITIVE_OR_NONE,
    "num_buckets": _POSITIVE_OR_NONE,
}


def _only_with_zero3(name: str, default) -> Check:
    """A ZeRO-3 tuning field left at its default unless the strategy shards parameters."""
    return Check(lambda c: getattr(c, name) == default or c.sharding.parameters,
                 f"{name}={{config.{name}}} tunes ZeRO-3's parameter gathers: it needs "
                 "data_parallel_sharding_strategy='optim_grads_params', got {config.data_parallel_sharding_strategy!r}")


_ZERO3_TUNING_FIELDS = ("prefetch_bucket_size", "max_reuse_distance", "param_persistence_threshold")


def _field_rules():
    """Each field's own checks, in declaration order; after a ZeRO-3 tuning field, that ZeRO-3 is on."""
    for f in fields(DistributedDataParallelConfig):
        if f.name in ("data_parallel_sharding_strategy", "fsdp_unit_modules",
                      "param_name_patterns_for_fp32_local_accumulation"):  # checked first
            continue
        yield f.name, _FIELD_CHECKS.get(f.name, _BOOL)
        if f.name in _ZERO3_TUNING_FIELDS:
            yield None, (_only_with_zero3(f.name, f.default),)


_FIELD_RULES = tuple(_field_rules())

# The combinations: the first five megatron-lite's own, then those megatron-core refuses (asserts) or ignores.
_COMBINATION_RULES = ((None, (
    Check(lambda c: c.num_buckets is None or c.bucket_size is None,
          "bucket_size={config.bucket_size} and num_buckets={config.num_buckets}: set only one (num_buckets derives "
          "the bucket size from the model's size)"),
    Check(lambda c: not (c.calculate_per_token_loss and c.average_in_collective),
          "calculate_per_token_loss=True sums gradients over ranks; average_in_collective=True would average them: "
          "use one or the other"),
    Check(lambda c: not c.overlap_param_gather or c.use_distributed_optimizer,
          "overlap_param_gather=True requires use_distributed_optimizer=True: only the distributed optimizer "
          "all-gathers parameters"),
    Check(lambda c: c.num_distributed_optimizer_instances == 1 or c.use_distributed_optimizer,
          "num_distributed_optimizer_instances > 1 requires use_distributed_optimizer=True (a sharded "
          "data_parallel_sharding_strategy): without sharding every rank already holds all the state"),
    Check(lambda c: not c.pad_buckets_for_high_nccl_busbw or c.use_distributed_optimizer,
          "pad_buckets_for_high_nccl_busbw=True requires use_distributed_optimizer=True: buckets are only padded "
          "for the distributed optimizer"),
    Check(lambda c: not (c.param_name_patterns_for_fp32_local_accumulation and c.grad_reduce_in_fp32),
          "param_name_patterns_for_fp32_local_accumulation with grad_reduce_in_fp32=True: every main_grad is fp32 "
          "already; drop the patterns, or reduce in the parameter dtype"),
    Check(lambda c: not (c.reduce_scatter_with_fp32_accumulation and c.grad_reduce_in_fp32),
          "reduce_scatter_with_fp32_accumulation=True with grad_reduce_in_fp32=True: the gradients already travel "
          "and add up in fp32; drop one of them"),
    Check(lambda c: not c.reduce_scatter_with_fp32_accumulation or c.use_distributed_optimizer,
          "reduce_scatter_with_fp32_accumulation=True needs a sharded data_parallel_sharding_strategy "
          "(use_distributed_optimizer=True): under 'no_shard' gradients are all-reduced, never reduce-scattered"),
    Check(lambda c: not (c.reduce_scatter_with_fp32_accumulation and c.average_in_collective),
          "reduce_scatter_with_fp32_accumulation=True sums in its own fp32 accumulation: average_in_collective=True "
          "(ReduceOp.AVG) is not supported with it; drop it (gradients are then pre-scaled by 1/dp)"),
    Check(lambda c: not c.reduce_scatter_with_fp32_accumulation or c.num_distributed_optimizer_instances == 1,
          "reduce_scatter_with_fp32_accumulation=True with num_distributed_optimizer_instances > 1: the all-reduce "
          "across instances would sum in the low precision again; use one instance"),
)),)
