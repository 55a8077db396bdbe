"""meta_device_init(): the initialization of a model built on the meta device, recorded as a program.

Inside the context, parameters and buffers are created on the meta device, and a TorchDispatchMode sees every
operation that touches a meta tensor (constructors' `reset_parameters()`, a model's own `_init_weights`,
in-place fills of views). Each is kept as an `_Op` over `Ref`s (views of recorded storages) with what it does
to them, for the replay to know when a value is dead:

    reads    storages whose values the op reads      kills   storages it overwrites whole without reading
    writes   storages it writes (mutated arguments, storages a factory creates with values)

The record also keeps the default CPU generator's state at the entry of the context, and that of every
explicit generator at its first use, so that the replay (materialize.py) draws the same numbers. Each
recorded parameter and buffer carries its record in an attribute (SIDECAR): MetaMaterializer finds it there.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# In-place operations whose result does not depend on what the tensor held: the value before them is dead.
_OVERWRITES = {"uniform_", "normal_", "fill_", "zero_", "random_", "exponential_", "geometric_", "log_normal_",
               "cauchy_", "copy_"}
# Factories of uninitialized storage: the replay allocates it at its first real use instead.
ALLOCATES = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
SIDECAR = "_megatron_lite_meta_init"  # the tensor attribute that links a parameter to its record


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@dataclass(frozen=True)
class Ref:
    """A meta tensor in the program: a view (size, stride, offset) of a recorded storage."""

    key: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    numel: int


@dataclass
class _Op:
    func: object
    args: tuple
    kwargs: dict
    reads: Tuple[int, ...]   # storages whose values the op reads (every tensor argument, unless overwritten)
    kills: Tuple[int, ...]   # storages the op overwrites whole without reading them
    writes: Tuple[int, ...]  # storages the op writes: mutated arguments, storages a factory creates with values
    outputs: object          # the outputs with meta tensors as Ref (new storages are born here)


@dataclass
class MetaInitRecord:
    """The initialization program of the models built inside one `meta_device_init()` context."""

    rng_state: torch.Tensor
    """The default CPU generator's state when the context was entered."""
    ops: List[_Op] = field(default_factory=list)
    storage: Dict[int, Tuple[int, torch.dtype]] = field(default_factory=dict)
    """key -> (elements, dtype) of every meta storage seen."""
    generators: Dict[int, Tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)
    """Explicit generators the program used: (generator, its state when first used)."""
    keep_alive: List[torch.Tensor] = field(default_factory=list)
    """One tensor per recorded storage, so that no storage address is reused while the record lives."""


class _Recorder(TorchDispatchMode):
    def __init__(self, record: MetaInitRecord):
        super().__init__()
        self.record = record

    def _ref(self, t: torch.Tensor) -> Ref:
        key = storage_key(t)
        if key not in self.record.storage:
            self.record.storage[key] = (t.untyped_storage().nbytes() // t.element_size(), t.dtype)
            self.record.keep_alive.append(t)
        elif self.record.storage[key][1] != t.dtype:
            raise ValueError(f"meta_device_init: a storage viewed as {t.dtype} and {self.record.storage[key][1]} "
                             f"(Tensor.view(dtype)) cannot be replayed; initialize it without reinterpreting")
        return Ref(key, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.numel())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, torch.Generator) and id(leaf) not in self.record.generators:
                self.record.generators[id(leaf)] = (leaf, leaf.get_state())
        out = func(*args, **kwargs)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if not any(t.is_meta for t in tensors + [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]):
            if _draws_from_default_generator(func, args, kwargs):
                raise ValueError(f"meta_device_init: {func} draws from the default generator into a tensor that is "
                                 f"not on the meta device; under the meta build it would take other numbers than in "
                                 f"a normal build. Create that tensor without an explicit device")
            return out
        name = func.overloadpacket.__name__
        known = set(self.record.storage)
        rargs = tree_map(lambda x: self._ref(x) if isinstance(x, torch.Tensor) and x.is_meta else x, args)
        rkwargs = tree_map(lambda x: self._ref(x) if isinstance(x, torch.Tensor) and x.is_meta else x, kwargs)
        outputs = tree_map(lambda x: self._ref(x) if isinstance(x, torch.Tensor) and x.is_meta else x, out)
        refs = [r for r in tree_flatten((rargs, rkwargs))[0] if isinstance(r, Ref)]
        kills = ()
        if refs and name in _OVERWRITES and isinstance(rargs[0], Ref):
            target = rargs[0]
            whole = target.offset == 0 and target.numel == self.record.storage[target.key][0]
            if whole and sum(r.key == target.key for r in refs) == 1:
                kills = (target.key,)
        reads = tuple(dict.fromkeys(r.key for r in refs if r.key not in kills))
        writes = [r.key for i, r in enumerate(rargs) if isinstance(r, Ref) and _writes(func, i)]
        if name not in ALLOCATES:
            writes += [r.key for r in tree_flatten(outputs)[0] if isinstance(r, Ref) and r.key not in known]
        self.record.ops.append(_Op(func, rargs, rkwargs, reads, kills, tuple(writes), outputs))
        return out


_RANDOM = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal", "bernoulli",
           "multinomial", "poisson", "uniform_", "normal_", "random_", "exponential_", "geometric_", "log_normal_",
           "cauchy_", "bernoulli_"}


def _draws_from_default_generator(func, args, kwargs) -> bool:
    """Whether `func` draws random numbers from the default generator (no explicit generator given)."""
    if func.overloadpacket.__name__ not in _RANDOM:
        return False
    for index, argument in enumerate(func._schema.arguments):
        if "Generator" in str(argument.type):
            return (args[index] if index < len(args) else kwargs.get(argument.name)) is None
    return True  # an overload without a generator argument (torch.randn(size)) uses the default one


def _writes(func, index: int) -> bool:
    arguments = func._schema.arguments
    return index < len(arguments) and arguments[index].alias_info is not None and arguments[index].alias_info.is_write


@contextlib.contextmanager
def meta_device_init():
    """Build models on the meta device inside this context, recording their initialization (see the module
    docstring); DistributedDataParallel materializes them. Yields the MetaInitRecord."""
    record = MetaInitRecord(torch.random.get_rng_state())

    def tag(module, name, tensor):
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            setattr(tensor, SIDECAR, record)
        return None

    hooks = [torch.nn.modules.module.register_module_parameter_registration_hook(tag),
             torch.nn.modules.module.register_module_buffer_registration_hook(tag)]
    try:
        with torch.device("meta"), _Recorder(record):
            yield record
    finally:
        for hook in hooks:
            hook.remove()

