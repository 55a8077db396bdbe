"""ZeRO-3's guards: refuse what would compute with, or save, the NaN placeholders of released parameters.

A mixin of ParamUnits (param_units.py): between iterations a rank holds only its shards, and the modules'
parameters are placeholders. The wrapper gathers them around its own forward and state_dict(); these hooks,
registered once at wrap time (param_sync.build_param_sync), make the ways around it raise instead:

    guard_compiled_forward   a torch.compiled forward around the units (their hooks would not run)
    guard_state_dicts        state_dict() of the wrapped model or a submodule while it holds placeholders
                             (reading_placeholders() allows it, for sharded readers)
    guard_inner_forward      a forward of the wrapped module itself (model.module(x)) while the root is released
"""

import contextlib
from typing import Dict, List

import torch

from .bucket import Bucket
from .fsdp_units import modules_around, refuse_compiled_forward


class ParamGuardsMixin:
    """Mixin of ParamUnits: the hooks that refuse released parameters (see module docstring).

    Reads what ParamUnits' constructor built: `units`, `root` (the root unit's buckets) and `_handles`.
    """

    def guard_compiled_forward(self, module: torch.nn.Module):
        """Refuse a torch.compiled forward around the units (fsdp_units.refuse_compiled_forward), now and at
        every forward: the model may be compiled after wrapping."""
        self._around_units = modules_around(module, self.units)
        refuse_compiled_forward(self._around_units)

    def guard_state_dicts(self, module: torch.nn.Module, param_to_bucket: Dict[torch.nn.Parameter, Bucket]):
        """Make `state_dict()` of `module` or any submodule raise while it holds released parameters (the
        NaN placeholders): saving those, e.g. Hugging Face's save_pretrained(model.module), would silently
        write NaN. Inside full_parameters() (and so through the wrapper's own state_dict) it works."""
        self.placeholders_allowed = False  # see reading_placeholders()
        for sub in module.modules():
            own = [param_to_bucket[p] for p in sub.parameters(recurse=False) if p in param_to_bucket]
            if own:
                self._handles.append(sub.register_state_dict_pre_hook(_refuse_released(self, own)))

    def guard_inner_forward(self, module: torch.nn.Module):
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
        self._handles.append(module.register_forward_pre_hook(hook))

    @contextlib.contextmanager
    def reading_placeholders(self):
        """state_dict() of the modules is allowed inside, placeholders and all: for sharded readers that skip
        the trainable entries themselves."""
        self.placeholders_allowed = True
        try:
            yield
        finally:
            self.placeholders_allowed = False


def _refuse_released(units: ParamGuardsMixin, buckets: List[Bucket]):
    def hook(module, prefix, keep_vars):
        if not units.placeholders_allowed and not all(b.params_gathered for b in buckets):
            raise RuntimeError(
                f"state_dict() of {type(module).__name__} {prefix.rstrip('.') or '(the wrapped model)'}: under ZeRO-3 "
                f"its parameters are sharded and this rank holds only placeholders. Use the "
                f"wrapper's state_dict() (DistributedDataParallel.state_dict(), collective: call it on every rank), "
                f"or gather on every rank first: `with model.full_parameters(): model.module.save_pretrained(...)` "
                f"(save on rank 0 only inside the context)."
            )
    return hook
