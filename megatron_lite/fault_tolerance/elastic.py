"""Elastic mode's arguments: what a job may shrink to, and the arguments of a smaller generation
(launch.py --min-instances; docs/fault_tolerance.md, "Elastic mode"). How ranks form instances is the
data-parallel topology's to say (layout.DataParallelTopology); nothing here divides ranks."""

import copy

from ..distributed.layout import DataParallelTopology, default_bucket_size


def instance_size(args) -> int:
    """Ranks per distributed-optimizer instance: what stays the same when the job shrinks or grows."""
    topology = DataParallelTopology(args.data_parallel_size, args.num_distributed_optimizer_instances)
    return topology.intra_distributed_optimizer_instance_size


def check_elastic(args, min_instances: int):
    """ValueError unless the run can train on `min_instances` .. R instances (elastic mode): R >= 2, and the
    global batch splits into whole micro-batches at every data-parallel size it may shrink to."""
    instances = args.num_distributed_optimizer_instances
    if instances < 2:
        raise ValueError(f"elastic mode (--min-instances {min_instances}) needs --num-distributed-optimizer-instances "
                         f">= 2 (got {instances}): a left-out instance's shards must live on in another")
    if min_instances > instances:
        raise ValueError(f"--min-instances {min_instances} exceeds --num-distributed-optimizer-instances {instances}")
    for count in range(min_instances, instances):
        data_parallel_size = instance_size(args) * count
        if args.global_batch_size % (args.micro_batch_size * data_parallel_size):
            raise ValueError(f"elastic mode: with {count} of {instances} instances the data-parallel size is "
                             f"{data_parallel_size}, and --global-batch-size {args.global_batch_size} "
                             f"is not divisible by --micro-batch-size {args.micro_batch_size} x that: choose a global "
                             f"batch size that is, or a larger --min-instances")


def generation_args(args, members: int):
    """The arguments of a generation of `members` ranks: `args` itself with every rank, else a copy with the
    data-parallel size, the instances and the micro-batches per rank of the smaller job (elastic shrink: the
    instances are whole, so the same global batch of samples, more micro-batches per rank). The bucket size
    stays the whole job's: Megatron's default grows with the data-parallel size (default_bucket_size), and
    the buckets must be cut the same for the shards to carry over."""
    if members == args.data_parallel_size:
        return args
    per_instance = instance_size(args)
    try:
        topology = DataParallelTopology.from_instance_size(members, per_instance)
    except ValueError:
        raise ValueError(f"a generation of {members} ranks is not made of whole instances of {per_instance}") from None
    smaller = copy.copy(args)
    smaller.data_parallel_size = topology.data_parallel_size
    smaller.num_distributed_optimizer_instances = topology.num_distributed_optimizer_instances
    smaller.num_micro_batches = args.global_batch_size // (args.micro_batch_size * members)
    if args.ddp_bucket_size is None and not args.ddp_num_buckets:
        smaller.ddp_bucket_size = default_bucket_size(args.data_parallel_size)
    return smaller
