"""Which node runs which slot (data-parallel rank): MindIO's rule, no node holds two replicas of one shard.

With R distributed-optimizer instances of m = dp / R ranks, the slots at one position of every instance hold
the same shard (layout.DataParallelTopology: holders(position)). A node that held two of them would take two
copies of that shard with it when it is lost; with at most one per node, losing any one node leaves R - 1
copies of every shard, so its ranks are healed from replicas::

    dp=6, R=3 (m=2), 3 nodes x 2 ranks    node a      node b      node c
    slots (contiguous blocks)             0    1      2    3      4    5
    positions                             0    1      0    1      0    1   every node: each shard once

    dp=6, R=2 (m=3), 3 nodes x 2 ranks    node a      node b      node c
    slots                                 0    1      2    3      4    5
    positions                             0    1      2    0      1    2   still each shard once per node

Contiguous blocks always satisfy the rule when it can be satisfied at all: K consecutive slots have K distinct
positions exactly when K <= m (equivalently R <= number of nodes, since nodes x K = R x m). A lost node's slots
move as a whole to one node holding none (a replacement or hot spare), which keeps the rule (`replace_node`).
Pure functions; nothing here divides ranks (the topology does).
"""

from typing import Dict, Mapping, Sequence

from ..distributed.layout import DataParallelTopology


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def place(world_size: int, instance_size: int, nodes: Sequence[str], ranks_per_node: int) -> Dict[int, str]:
    """Slot -> node: contiguous blocks of `ranks_per_node` slots, node by node in the order given.

    Args:
        world_size: dp, the number of slots (every slot is a data-parallel rank).
        instance_size: m = dp / R, ranks per distributed-optimizer instance.
        nodes: the node names, distinct; each gets `ranks_per_node` slots.
        ranks_per_node: K, slots per node.
    Returns:
        {slot: node} for every slot in range(world_size), satisfying `check_placement`.
    Raises:
        ValueError naming the numbers when the sizes do not fit or the rule cannot hold.
    """
    _positive_int("world_size", world_size)
    _positive_int("instance_size", instance_size)
    _positive_int("ranks_per_node", ranks_per_node)
    nodes = list(nodes)
    if not nodes:
        raise ValueError("place() needs at least one node")
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"node names must be distinct, got {nodes}")
    if len(nodes) * ranks_per_node != world_size:
        raise ValueError(f"{len(nodes)} nodes x {ranks_per_node} ranks per node = {len(nodes) * ranks_per_node} "
                         f"slots for a world size of {world_size}: the nodes must hold every rank exactly once "
                         f"(change --nnodes or --nproc-per-node)")
    topology = DataParallelTopology.from_instance_size(world_size, instance_size)
    instances = topology.num_distributed_optimizer_instances
    if ranks_per_node > instance_size:
        raise ValueError(f"a node of {ranks_per_node} ranks would hold two replicas of one shard: R={instances} "
                         f"instances of {instance_size} rank(s) each (dp={world_size}) on {len(nodes)} nodes; MindIO's "
                         f"rule needs ranks per node <= instance size, i.e. R <= nodes (use fewer "
                         f"--num-distributed-optimizer-instances, or more nodes with fewer ranks each)")
    slots = iter(range(world_size))
    placement = {next(slots): node for node in nodes for _ in range(ranks_per_node)}
    check_placement(placement, instance_size)
    return placement


def check_placement(placement: Mapping[int, str], instance_size: int) -> None:
    """ValueError unless `placement` ({slot: node} for slots 0 .. dp-1) puts no two replicas of one shard on
    the same node; the message names the node, the two slots and their position."""
    slots = sorted(placement)
    if slots != list(range(len(slots))):
        raise ValueError(f"a placement must name every slot 0 .. {len(slots) - 1} once, got slots {slots}")
    topology = DataParallelTopology.from_instance_size(len(slots), instance_size)
    seen = {}  # (node, position) -> the first slot there
    for slot in slots:
        key = (placement[slot], topology.position(slot))
        if key in seen:
            raise ValueError(f"node {key[0]!r} holds slots {seen[key]} and {slot}, two replicas of the shard at "
                             f"position {key[1]} (instances of {instance_size} ranks, dp={len(slots)}): losing that "
                             f"node would lose both; put them on different nodes")
        seen[key] = slot


def replace_node(placement: Mapping[int, str], lost_node: str, new_node: str, instance_size: int) -> Dict[int, str]:
    """The placement with every slot of `lost_node` moved to `new_node`, as a whole (which keeps the rule when
    `new_node` holds no slot: a replacement node or a hot spare); ValueError if `lost_node` holds no slot or
    the result breaks the rule (`new_node` already holds a replica of one of the moved shards)."""
    if lost_node not in placement.values():
        raise ValueError(f"node {lost_node!r} holds no slot of the placement: nothing to replace")
    moved = {slot: new_node if node == lost_node else node for slot, node in placement.items()}
    check_placement(moved, instance_size)
    return moved
