"""Counting bytes: what a rank holds (parameters, gradients, optimizer state) and what it communicates.

Communication is counted per call with the algorithmic bytes per rank of a ring: all-reduce 2(N-1)/N x
size, reduce-scatter / all-gather / broadcast (N-1)/N x the full size. megatron_lite reports its
collectives through `collectives.observe`; torch's systems are counted by wrapping torch.distributed's
Python collectives for the duration (torch DDP's C++ reducer bypasses Python: its all-reduce has to be
computed from its bucket sizes by the caller).
"""

import contextlib
import inspect
from typing import Iterable, List, Tuple

import torch
import torch.distributed as dist

from megatron_lite.distributed import collectives

Call = Tuple[str, int, float]  # (collective, full message bytes, algorithmic bytes per rank)

TORCH_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor",
                     "_all_gather_base", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
                     "_reduce_scatter_base")


def held_bytes(tensors: Iterable, seen: set) -> int:
    """Bytes of the storages behind `tensors` not already in `seen` (DTensors: their local shard)."""
    total = 0
    for t in tensors:
        storage = None if t is None else (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if storage is not None and storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def algorithmic_bytes(name: str, message_bytes: int, world: int) -> float:
    return (2 if name.startswith("all_reduce") else 1) * (world - 1) / world * message_bytes


def _nbytes(t) -> int:
    return sum(x.numel() * x.element_size() for x in (t if isinstance(t, (list, tuple)) else [t]))


@contextlib.contextmanager
def count_megatron_lite() -> List[Call]:
    """Yields the list of megatron_lite's collectives issued inside the context."""
    calls: List[Call] = []

    def record(name, tensor, world):
        calls.append((name, _nbytes(tensor), algorithmic_bytes(name, _nbytes(tensor), world)))

    with collectives.observe(record):
        yield calls


@contextlib.contextmanager
def count_torch(world: int) -> List[Call]:
    """Yields the list of torch.distributed Python collectives called inside the context. (torch's
    deprecated names call the new ones inside distributed_c10d, not through the wrapped attributes, so no
    call is counted twice.)"""
    calls: List[Call] = []
    saved = []

    def wrap(name, fn):
        arg = 1 if "reduce_scatter" in name else 0  # the full-size argument: RS input, AG output (or list)
        keyword = list(inspect.signature(fn).parameters)[arg]

        def wrapped(*a, **kw):
            size = _nbytes(a[arg] if len(a) > arg else kw[keyword])
            calls.append((name, size, algorithmic_bytes(name, size, world)))
            return fn(*a, **kw)
        return wrapped

    for name in TORCH_COLLECTIVES:
        if hasattr(dist, name):
            saved.append((name, getattr(dist, name)))
            setattr(dist, name, wrap(name, getattr(dist, name)))
    try:
        yield calls
    finally:
        for name, fn in reversed(saved):
            setattr(dist, name, fn)


def model_state_bytes(params, grads, state) -> List[int]:
    """[params, grads, optimizer state] bytes this rank holds, storage shared between them counted once."""
    seen: set = set()
    return [held_bytes(params, seen), held_bytes(grads, seen), held_bytes(state, seen)]


def tensors_of(optimizer: torch.optim.Optimizer) -> list:
    """The state tensors of a torch optimizer."""
    return [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
