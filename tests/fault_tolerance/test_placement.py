"""placement.py: MindIO's rule (no node holds two replicas of one shard), golden tables and brute force."""

import itertools

import pytest

from megatron_lite.fault_tolerance.placement import check_placement, place, replace_node


def test_golden_tables():
    """The soak's layouts (3 nodes x 2 ranks at R=3 and R=2) and a one-instance job: contiguous blocks."""
    nodes = ["a", "b", "c"]
    blocks = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    assert place(6, 2, nodes, 2) == blocks  # R=3
    assert place(6, 3, nodes, 2) == blocks  # R=2: positions 0 1 | 2 0 | 1 2
    assert place(6, 6, nodes, 2) == blocks  # R=1
    assert place(4, 2, ["x", "y"], 2) == {0: "x", 1: "x", 2: "y", 3: "y"}
    assert place(3, 1, ["x", "y", "z"], 1) == {0: "x", 1: "y", 2: "z"}


def _valid(placement, instance_size):
    try:
        check_placement(placement, instance_size)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("world_size", range(1, 7))
def test_place_succeeds_exactly_when_some_placement_exists(world_size):
    """Brute force over every assignment of slots to nodes with K slots each: place() refuses exactly the
    shapes no placement satisfies, and what it returns satisfies the rule. Would catch a rule on instances
    (slot // m) instead of positions, or a refusal of a shape a non-contiguous layout could serve."""
    for instance_size in [m for m in range(1, world_size + 1) if world_size % m == 0]:
        for ranks_per_node in [k for k in range(1, world_size + 1) if world_size % k == 0]:
            nodes = [f"n{i}" for i in range(world_size // ranks_per_node)]
            exists = any(
                all(assignment.count(node) == ranks_per_node for node in nodes)
                and _valid(dict(enumerate(assignment)), instance_size)
                for assignment in itertools.product(nodes, repeat=world_size))
            if exists:
                placement = place(world_size, instance_size, nodes, ranks_per_node)
                check_placement(placement, instance_size)
                assert sorted(placement) == list(range(world_size))
                assert all(list(placement.values()).count(node) == ranks_per_node for node in nodes)
            else:
                with pytest.raises(ValueError, match="two replicas of one shard"):
                    place(world_size, instance_size, nodes, ranks_per_node)


def test_impossible_layout_names_the_numbers():
    """R=6 instances of 1 rank on 3 nodes of 2 ranks: every message part a user needs to change something."""
    with pytest.raises(ValueError) as error:
        place(6, 1, ["a", "b", "c"], 2)
    message = str(error.value)
    for part in ["2 ranks", "R=6", "of 1 rank", "dp=6", "3 nodes", "R <= nodes", "--num-distributed-optimizer"]:
        assert part in message, (part, message)


@pytest.mark.parametrize("args, match", [
    ((6, 2, ["a", "b"], 2), r"2 nodes x 2 ranks per node = 4 slots for a world size of 6"),
    ((6, 4, ["a", "b", "c"], 2), r"instance size of 4 ranks does not divide the data-parallel size 6"),
    ((4, 2, ["a", "a"], 2), r"distinct"),
    ((4, 2, [], 2), r"at least one node"),
    ((4, 0, ["a", "b"], 2), r"instance_size must be >= 1"),
])
def test_refusals(args, match):
    with pytest.raises(ValueError, match=match):
        place(*args)
    with pytest.raises(TypeError, match="ranks_per_node must be an int"):
        place(4, 2, ["a", "b"], 2.0)


def test_check_names_the_node_and_the_two_slots():
    """dp=4, R=2: slots 0 and 2 hold the same shard (position 0); a node with both is refused, by name."""
    with pytest.raises(ValueError, match=r"node 'a' holds slots 0 and 2, two replicas of the shard at position 0"):
        check_placement({0: "a", 1: "b", 2: "a", 3: "b"}, 2)
    check_placement({0: "a", 1: "a", 2: "b", 3: "b"}, 2)
    with pytest.raises(ValueError, match="every slot 0 .. 2 once"):
        check_placement({0: "a", 1: "a", 3: "b"}, 1)


def test_replace_node_moves_the_lost_slots_as_a_whole():
    """A spare takes the lost node's slots and the rule holds; a node already holding a replica of a moved
    shard is refused, and so is a node that holds nothing to replace."""
    placement = place(6, 2, ["a", "b", "c"], 2)
    assert replace_node(placement, "b", "spare", 2) == {0: "a", 1: "a", 2: "spare", 3: "spare", 4: "c", 5: "c"}
    with pytest.raises(ValueError, match=r"node 'a' holds slots 0 and 2"):
        replace_node(placement, "b", "a", 2)
    with pytest.raises(ValueError, match="'spare' holds no slot"):
        replace_node(placement, "spare", "d", 2)
    assert placement[2] == "b"  # the argument is left as it was
