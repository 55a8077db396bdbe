"""The random number generators' state of this process, as a checkpoint stores it.

get_rng_state() captures Python's, numpy's, torch's (and CUDA's, once initialised) generators as plain
data that `torch.load(weights_only=True)` reads back; set_rng_state() restores exactly that state, so a
resumed run draws the numbers the uninterrupted one would. Both formats store every rank's state
(save.py, torch_dist.py), last words this rank's (last_words.py). Local: no collective.
"""

import random

import numpy as np
import torch


def get_rng_state() -> dict:
    """This process's generators: {'python', 'numpy', 'torch'[, 'cuda']}."""
    state = {
        "python": random.getstate(),
        # numpy's MT19937 key is uint32; stored as int64 (torch serializes uint32 storages poorly).
        "numpy": [torch.from_numpy(x.astype(np.int64)) if isinstance(x, np.ndarray) else x
                  for x in np.random.get_state()],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict):
    """Restore what get_rng_state() returned (a loaded copy: lists where it had tuples)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = [x.numpy().astype(np.uint32) if isinstance(x, torch.Tensor) else x for x in state["numpy"]]
    np.random.set_state(tuple(np_state))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
