"""Models built on the meta device, materialized by DistributedDataParallel a tensor at a time.

A model too large for one rank is built without memory (`torch.device("meta")`: shapes and dtypes only)
and wrapped; the wrapper then computes every parameter's initial values, keeps this rank's shard of them
(ZeRO-3; whole parameters for the other strategies) and frees the rest before the next. The result is
bit-identical to building the same model on the CPU with the same seed and wrapping it.

Two ways to say how a meta model is initialized:

1. **Recorded (any model, bitwise):** build it inside `meta_device_init()`::

       torch.manual_seed(seed)
       with meta_device_init():
           model = GPTModel(config)                 # no memory; every init op is recorded
       model = DistributedDataParallel(model, ddp_config)   # materialized here, right after the build

   While the model is built, every operation on a meta tensor is recorded in order (the constructors'
   `reset_parameters()`, a model's own `_init_weights`, in-place fills of views) together with the
   default CPU generator's state at the entry of the context. Materializing replays that program on the
   CPU from that state, so every random draw takes the same numbers as in a normal build, whatever the
   rank and whatever the units. A tensor's storage is allocated when the program first uses it and freed
   as soon as its value is dead: after its final operation (a parameter's value is handed over then), or
   when the next operation overwrites it without reading it (`nn.Linear`'s own init, overwritten by
   GPTModel's `_init_weights`). So at most the tensors one module's init touches together are alive at
   once. Afterwards the default CPU generator is where the normal build leaves it after the constructor:
   as if the model had been built at the wrap (random draws made between building and wrapping are not
   seen by the replay; pretrain_gpt.py wraps right after building).

2. **reset_parameters() contract (Megatron-FSDP's, for a model built under plain `torch.device("meta")`):**
   every module that directly owns a parameter or buffer on the meta device must define `reset_parameters()`
   initializing exactly those (torch's Linear, LayerNorm, Embedding, BatchNorm, Conv do). Modules are reset
   in registration order (`module.modules()`), on the CPU, with the default generator as it is when
   wrapping: bit-identical to the normal build when the constructors created and initialized the modules
   in that order and nothing else consumed random numbers. A module without one, or with an initializer
   of its own that this contract cannot see (`_init_weights`, `init_weights`, `post_init`: build those
   inside `meta_device_init()`), is a ValueError naming it, before anything is allocated.

Replay runs on the CPU (init ops on a CUDA generator draw other numbers) and copies each value to the
wrapper's device. What a user's module must provide: an initialization made of torch operations on its
own tensors during construction (recorded), or `reset_parameters()` (contract); not supported under
recording: random draws into tensors created off the meta device during construction (their values
depend on the meta build's shorter random stream), and reading a tensor's values (`.item()`).

The recording is meta_init.py; this module checks a meta model, gives it storage and computes its values.
"""

from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .meta_init import ALLOCATES, SIDECAR, MetaInitRecord, Ref, storage_key

__all__ = ["has_meta_tensors", "meta_tensors", "MetaMaterializer"]

REPLAY_DEVICE = torch.device("cpu")
"""Where the initialization program runs: the device a normal build initializes on."""


def meta_tensors(module: torch.nn.Module) -> List[Tuple[str, torch.Tensor, torch.nn.Module, bool]]:
    """(qualified name, tensor, owning module, is a parameter) of every meta parameter and buffer, each once."""
    found, seen = [], set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        own = ((True, sub.named_parameters(recurse=False, remove_duplicate=False)),
               (False, sub.named_buffers(recurse=False, remove_duplicate=False)))
        for is_param, items in own:
            for name, t in items:
                if t.is_meta and id(t) not in seen:
                    seen.add(id(t))
                    found.append((f"{prefix}.{name}" if prefix else name, t, sub, is_param))
    return found


def has_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


Sink = Callable[[torch.Tensor, torch.Tensor], None]
"""sink(the model's tensor, its initial value on the CPU, full shape): keep what this rank holds of it."""

_OWN_INITIALIZERS = ("_init_weights", "init_weights", "post_init")


class MetaMaterializer:
    """The initial values of a meta model's tensors, computed one at a time (see the module docstring).

    Construction checks that every meta tensor has an initializer (a ValueError naming the modules that do
    not), before anything is allocated. `placeholders(device, whole)` then gives every meta tensor real
    storage on `device` without its values (a stride-0 scalar for the tensors in `whole`'s complement, to be
    sharded; full storage for the others); `run(sink)` computes the values and hands each to `sink`.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.tensors = meta_tensors(module)
        records = {id(getattr(t, SIDECAR, None)): getattr(t, SIDECAR, None) for _, t, _, _ in self.tensors}
        if len(records) > 1:
            if None in records.values():
                unrecorded = [n for n, t, _, _ in self.tensors if getattr(t, SIDECAR, None) is None][:5]
                raise ValueError(f"the model's meta tensors were built partly inside meta_device_init() and partly "
                                 f"outside it ({unrecorded} outside): build the whole model inside one context")
            raise ValueError("the model's meta tensors come from several meta_device_init() contexts: build the "
                             "whole model inside one context")
        self.record: Optional[MetaInitRecord] = next(iter(records.values())) if records else None
        # Where each tensor is in its recorded storage, taken before placeholders replace the storages.
        self._key = {id(t): storage_key(t) for _, t, _, _ in self.tensors}
        self._view = {id(t): (tuple(t.stride()), t.storage_offset()) for _, t, _, _ in self.tensors}
        if self.record is not None:
            self._check_recorded()
        else:
            self._check_contract()

    # ---------------------------------------------------------------- checks
    def _check_recorded(self):
        written = {k for op in self.record.ops for k in op.writes}
        missing = [f"{name} (of {type(owner).__name__})" for name, t, owner, _ in self.tensors
                   if self._key[id(t)] not in written]
        if missing:
            raise ValueError(f"meta_device_init: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                             f"never initialized while the model was built (created with torch.empty and not "
                             f"written): a normal build would hold uninitialized memory there; initialize it in "
                             f"the module's constructor")

    def _check_contract(self):
        owners = {id(owner): (name.rsplit(".", 1)[0] if "." in name else "", owner)
                  for name, _, owner, _ in self.tensors}
        problems = []
        for prefix, sub in self.module.named_modules():
            label = f"{prefix or '(the model)'} ({type(sub).__name__})"
            if id(sub) in owners and not callable(getattr(sub, "reset_parameters", None)):
                problems.append(f"{label} owns meta tensors but has no reset_parameters()")
            own = [n for n in _OWN_INITIALIZERS if callable(getattr(sub, n, None))]
            if own:
                problems.append(f"{label} initializes with its own {own[0]}(), which reset_parameters() calls "
                                f"would not replay")
        if problems:
            raise ValueError(
                "cannot materialize the model built on the meta device: " + "; ".join(problems[:6])
                + ("; ..." if len(problems) > 6 else "") + ". Build it inside megatron_lite's meta_device_init() "
                "(records its initialization, whatever it is, and replays it bit for bit), or give each module "
                "that owns parameters a reset_parameters() that initializes them (Megatron-FSDP's contract)")

    # ---------------------------------------------------------------- storage
    def placeholders(self, device: torch.device, whole: Callable[[torch.Tensor], bool]):
        """Swap every meta tensor (keeping the Python object: hooks, ties and optimizer references hold) for
        one on `device`: full, uninitialized storage where `whole(tensor)`, else a stride-0 zero scalar of
        the same shape (the wrapper points it at its buffers; the values arrive through the sink)."""
        for _, t, _, is_param in self.tensors:
            data = torch.empty(t.shape, dtype=t.dtype, device=device) if whole(t) \
                else torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)
            new = torch.nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data
            for attr, value in vars(t).items():  # swap_tensors swaps __dict__ too: keep the markers
                if attr != SIDECAR:
                    setattr(new, attr, value)
            torch.utils.swap_tensors(t, new)

    # ---------------------------------------------------------------- values
    def run(self, sink: Sink):
        """Compute every tensor's initial value (CPU, full shape) and hand it to `sink`, one at a time."""
        if self.record is not None:
            self._replay(sink)
        else:
            self._reset_modules(sink)

    @torch.no_grad()
    def _reset_modules(self, sink: Sink):
        by_owner: Dict[int, List[torch.Tensor]] = {}
        for _, t, owner, _ in self.tensors:
            by_owner.setdefault(id(owner), []).append(t)
        for sub in self.module.modules():
            own = by_owner.pop(id(sub), None)
            if not own:
                continue
            saved = [t.data for t in own]
            for t in own:
                t.data = torch.empty(t.shape, dtype=t.dtype, device=REPLAY_DEVICE)
            sub.reset_parameters()
            values = [t.data for t in own]
            for t, data, value in zip(own, saved, values):
                t.data = data  # the sink writes into the tensor's own storage
                sink(t, value)

    @torch.no_grad()
    def _replay(self, sink: Sink):
        record = self.record
        targets: Dict[int, List[torch.Tensor]] = {}
        for _, t, _, _ in self.tensors:
            targets.setdefault(self._key[id(t)], []).append(t)
        # Per storage, the ops using it; freed after an op when no later op reads it before overwriting it.
        uses: Dict[int, List[int]] = {}
        for i, op in enumerate(record.ops):
            for k in dict.fromkeys(op.kills + op.reads + op.writes):
                uses.setdefault(k, []).append(i)
        live: Dict[int, torch.Tensor] = {}
        pending: Set[int] = set(targets)
        self.peak_live_bytes = live_bytes = 0

        def hold(key: int, value: Optional[torch.Tensor] = None) -> torch.Tensor:
            nonlocal live_bytes
            if key not in live:  # first use: a partial write of an empty tensor reads it uninitialized
                numel, dtype = record.storage[key]
                live[key] = torch.empty(numel, dtype=dtype, device=REPLAY_DEVICE) if value is None else value
                live_bytes += numel * live[key].element_size()
                self.peak_live_bytes = max(self.peak_live_bytes, live_bytes)
            return live[key]

        def drop(key: int):
            nonlocal live_bytes
            value = live.pop(key, None)
            if value is not None:
                live_bytes -= record.storage[key][0] * value.element_size()

        def resolve(x):
            if isinstance(x, Ref):
                return hold(x.key).as_strided(x.size, x.stride, x.offset)
            if isinstance(x, torch.device) and x.type == "meta":
                return REPLAY_DEVICE
            return x

        position = {k: 0 for k in uses}
        saved_rng = torch.random.get_rng_state()
        torch.random.set_rng_state(record.rng_state)
        for generator, state in record.generators.values():
            generator.set_state(state)
        try:
            for i, op in enumerate(record.ops):
                if op.func.overloadpacket.__name__ in ALLOCATES:
                    continue  # allocated lazily, on its first real use
                out = op.func(*tree_map(resolve, op.args), **tree_map(resolve, op.kwargs))
                for ref, value in zip(tree_flatten(op.outputs)[0], tree_flatten(out)[0]):
                    if isinstance(ref, Ref) and ref.key not in live:
                        hold(ref.key, value)  # a storage born here (a factory such as torch.randn)
                for k in dict.fromkeys(op.kills + op.reads + op.writes):
                    position[k] += 1
                    later = uses[k][position[k]:]
                    if later and k not in record.ops[later[0]].kills:
                        continue  # read again: keep it
                    if not later and k in pending:
                        for t in targets[k]:
                            stride, offset = self._view[id(t)]
                            sink(t, live[k].as_strided(t.shape, stride, offset))
                        pending.discard(k)
                    drop(k)  # dead: its next use overwrites it, or it has none
        except BaseException:
            torch.random.set_rng_state(saved_rng)
            raise
        assert not pending, "every target storage is written (checked at construction)"

