"""Reading pickles that another program wrote (Megatron-LM's checkpoints) without running any of their code.

Megatron-LM's torch.save'd files (common.pt, model_optim_rng.pt, distrib_optim.pt, the objects in torch_dist's
.distcp files) name classes of their own (an argparse.Namespace of the run's arguments, megatron-core's enums).
torch's weights-only unpickler runs no code, but refuses any class it does not know. Here every global the
pickle names is listed first, read from its opcodes (torch.serialization.get_unsafe_globals_in_checkpoint:
nothing runs), and the weights-only unpickler is given, for each:

  * the real object where it is plain data and its construction runs no code of the file's choosing: ALLOWED
    (argparse.Namespace, numpy's array reconstruction);
  * otherwise a fresh Placeholder subclass named after it: building one stores its arguments and state, nothing
    else, so what the file asked for never runs. Readers look only at the data they expect and refuse the rest.
"""

import argparse
import io
import warnings
from typing import Dict, List, Tuple

import numpy as np
import torch


class Placeholder:
    """An object of a class the pickle named that is not ALLOWED: its arguments and state, kept as data."""

    qualified_name = "?"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{self.qualified_name} (not loaded)>"


def _allowed() -> Dict[str, object]:
    allowed = {"argparse.Namespace": argparse.Namespace, "numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype,
               "torch.Size": torch.Size}
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1 and 2 spell it differently
        allowed[f"{module}._reconstruct"] = multiarray._reconstruct
        allowed[f"{module}.scalar"] = multiarray.scalar
    for code in ("u1", "u4", "i4", "i8", "f4", "f8", "bool"):
        cls = type(np.dtype(code))
        allowed[f"numpy.dtypes.{cls.__name__}"] = cls
    return allowed


ALLOWED = _allowed()


def _safe_globals(names) -> List[Tuple[object, str]]:
    # numpy's dtype classes are never named (np.dtype builds them), only built upon: allowed always.
    entries = [(cls, name) for name, cls in ALLOWED.items() if name.startswith("numpy.dtypes.")]
    for name in sorted(names):
        module, _, attr = name.rpartition(".")
        found = ALLOWED.get(name)
        if found is None:
            found = type(attr or name, (Placeholder,), {"qualified_name": name, "__module__": __name__})
        entries.append((found, name))
    return entries


def load(source, what: str):
    """A torch.save'd file (a path) or bytes, tensors on the CPU; ValueError naming `what` if unreadable."""
    try:
        f = io.BytesIO(source) if isinstance(source, bytes) else source
        names = torch.serialization.get_unsafe_globals_in_checkpoint(f)
        if isinstance(f, io.BytesIO):
            f.seek(0)
        with warnings.catch_warnings(), torch.serialization.safe_globals(_safe_globals(names)):
            warnings.simplefilter("ignore")
            return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{what} cannot be read: {e}") from e
