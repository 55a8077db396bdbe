"""ZeRO-3's full state dict, read unit by unit: never more than one unit gathered at a time.

Exporting the weights of a model that does not fit on one rank must not gather it whole. The entries are
read in `module.state_dict()`'s order, each unit gathered just before its first entry and released before
the next unit is gathered::

    keys:     embed.weight  layers.0.w  layers.0.b  layers.1.w  layers.1.b  norm.weight  running_mean
    unit:     root          0           0           1           1           root         (a buffer: whole)
    gathered: [the root and the persistent parameters, throughout ---------------------------------------]
                            [unit 0 --------------] [unit 1 -------------------------------------------]
                            gather 0                release 0, gather 1             at the end: release all

The keys, their order and what the state-dict hooks do come from one `module.state_dict(keep_vars=True)` read
over the placeholders (no values touched): its values are the Parameter objects, whose `.data` points into the
bucket's storage once their unit is gathered (bucket.py), so each value is read then. Entries that are not
sharded parameters (buffers, frozen parameters, extra state) are whole on every rank and read as they are.
A tied parameter is one Parameter under two keys; it lives in the root unit (fsdp_units.unit_of_params), so
both keys read it while the root is gathered. (A state-dict hook that computes new tensors from sharded
parameters would compute them from placeholders: such a model reads `module.state_dict()` inside
`full_parameters()` instead.)

Collective: every rank issues the same gathers in the same sequence (the same model, the same key order).
"""

from typing import Iterator, Tuple

import torch

from .fsdp_units import PERSISTENT_UNIT, ROOT_UNIT


def iter_state_dict(units, module: torch.nn.Module, prefix: str = "",
                    keep_vars: bool = False) -> Iterator[Tuple[str, object]]:
    """`module.state_dict(prefix=prefix, keep_vars=keep_vars)`'s items, in its order, each valid until the next
    item is requested (the value is a view into its unit's gathered storage: copy it to keep it).

    Args:
        units: the model's ParamUnits (param_units.py).
        module: the wrapped module.

    Stopping early (break, an exception in the consumer, close()) still issues the gathers that are left,
    without reading them: the other ranks wait in them.
    """
    units.release_all()  # whatever a rank still holds: every rank then issues every gather
    with units.reading_placeholders():
        entries = module.state_dict(prefix=prefix, keep_vars=True)
    unit_of = {p: index for index in range(len(units.units)) for bucket in units.buckets.get(index, [])
               for p in bucket.params_list}
    plan = [unit_of.get(value) if isinstance(value, torch.nn.Parameter) else None for value in entries.values()]
    # Where a gather starts: at the first key of each run of one unit's keys (whole entries between them, e.g.
    # a unit's own buffers, do not end the run). The same sequence on every rank.
    starts, current = [], None
    for index in plan:
        starts.append(index is not None and index != current)
        current = index if index is not None else current
    sequence = [index for index, start in zip(plan, starts) if start]
    for index in (PERSISTENT_UNIT, ROOT_UNIT):  # kept throughout
        units.gather_unit(index)
    issued, current = 0, None
    try:
        for (key, value), index, start in zip(entries.items(), plan, starts):
            if start:
                units.release_unit(current)  # the previous unit, before this one is gathered
                units.gather_unit(index)
                issued, current = issued + 1, index
            yield key, value.detach() if isinstance(value, torch.Tensor) and not keep_vars else value
    except GeneratorExit:
        # Communicate even when stopping early: the other ranks may be waiting in the gathers that are left.
        for index in sequence[issued:]:
            units.release_unit(current)
            units.gather_unit(index)
            current = index
        raise
    finally:
        units.release_all()
