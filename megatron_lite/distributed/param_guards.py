"""ZeRO-3's guards: refuse what would compute with, or save, the NaN placeholders of released parameters.

Between iterations a rank holds only its shards, and the modules' parameters are placeholders. The wrapper
gathers them around its own forward and state_dict(); `ParamGuards`, an object that ParamUnits (param_units.py)
holds, registers hooks at wrap time that make the ways around it raise instead:

    a torch.compiled forward around the units   their hooks would not run (checked now and at every forward)
    state_dict() of the wrapped model or of a   while it holds placeholders (reading_placeholders() allows it,
    submodule                                   for sharded readers)
    a forward of the wrapped module itself      while the root unit is released (model.module(x))

What the guards need is handed to them: the wrapped module, its units, the root unit's buckets and every
bucket; they read nothing else of ParamUnits.
"""

import contextlib
from typing import List

import torch

from .bucket import Bucket
from .fsdp_units import modules_around, refuse_compiled_forward


class ParamGuards:
    """The hooks that refuse released parameters (see module docstring), registered on construction.

    Args:
        module: the wrapped model.
        units: ZeRO-3's unit modules (fsdp_units.find_units).
        root: the root unit's buckets (gathered by the wrapper's forward and by full_parameters()).
        buckets: every bucket whose parameters are sharded.
    """

    def __init__(self, module: torch.nn.Module, units: List[torch.nn.Module], root: List[Bucket],
                 buckets: List[Bucket]):
        self.root = root
        self.placeholders_allowed = False  # see reading_placeholders()
        self.hook_handles = []
        # The model may be compiled after wrapping: begin_forward checks again (check_not_compiled).
        self.around_units = modules_around(module, units)  # modules whose forward runs the units' hooks
        self.check_not_compiled()
        self._guard_state_dicts(module, {p: bucket for bucket in buckets for p in bucket.params_list})
        self._guard_inner_forward(module)

    def check_not_compiled(self):
        """Refuse a torch.compiled forward around the units (fsdp_units.refuse_compiled_forward)."""
        refuse_compiled_forward(self.around_units)

    @contextlib.contextmanager
    def reading_placeholders(self):
        """state_dict() of the modules is allowed inside, placeholders and all: for sharded readers that skip
        the trainable entries themselves."""
        self.placeholders_allowed = True
        try:
            yield
        finally:
            self.placeholders_allowed = False

    def _guard_state_dicts(self, module: torch.nn.Module, param_to_bucket):
        """Make `state_dict()` of `module` or any submodule raise while it holds released parameters (the
        NaN placeholders): saving those, e.g. Hugging Face's save_pretrained(model.module), would silently
        write NaN. Inside full_parameters() (and so through the wrapper's own state_dict) it works."""
        for sub in module.modules():
            own = [param_to_bucket[p] for p in sub.parameters(recurse=False) if p in param_to_bucket]
            if own:
                self.hook_handles.append(sub.register_state_dict_pre_hook(self._refuse_released(own)))

    def _refuse_released(self, buckets: List[Bucket]):
        def hook(module, prefix, keep_vars):
            if not self.placeholders_allowed and not all(b.params_gathered for b in buckets):
                raise RuntimeError(
                    f"state_dict() of {type(module).__name__} {prefix.rstrip('.') or '(the wrapped model)'}: under "
                    f"ZeRO-3 its parameters are sharded and this rank holds only placeholders. Use the "
                    f"wrapper's state_dict() (DistributedDataParallel.state_dict(), collective: call it on every "
                    f"rank), or gather on every rank first: `with model.full_parameters(): "
                    f"model.module.save_pretrained(...)` (save on rank 0 only inside the context)."
                )
        return hook

    def _guard_inner_forward(self, module: torch.nn.Module):
        """Make a forward of the wrapped `module` itself (`model.module(x)`: evaluation code or Hugging Face's
        generate holding the inner model) raise while the root's parameters are released: it would compute
        with the NaN placeholders. The wrapper's forward gathers the root first, and so does full_parameters()."""
        def hook(_module, _args):
            if not all(b.params_gathered for b in self.root):
                raise RuntimeError(
                    f"forward of the wrapped {type(module).__name__} itself (model.module(...)) under ZeRO-3: its "
                    f"parameters are sharded and this rank holds only placeholders between iterations. Call the "
                    f"wrapper, model(...), which gathers them, or on every rank `with model.full_parameters(): "
                    f"model.module(...)` (e.g. for generate)."
                )
        self.hook_handles.append(module.register_forward_pre_hook(hook))
