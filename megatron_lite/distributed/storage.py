"""Storage freed between uses and grown back before the next: ZeRO-2's full-size gradients (grown when a
bucket's first gradient arrives, freed once its reduced shard is kept) and ZeRO-3's full parameters (grown
for a gather, freed when the unit is released).

Only the storage's bytes come and go: the tensor and every view into it (param.main_grad, param.data)
keep their shape, offsets and identity, so nothing that points into it is rebuilt.
"""

import torch


class ReleasableStorage:
    """The storage under `tensor`, released and regrown as a whole (allocated on construction)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._nbytes = tensor.untyped_storage().nbytes()
        self.allocated = True

    def release(self):
        """Give the memory back (also when released already: a no-op then)."""
        self.tensor.untyped_storage().resize_(0)
        self.allocated = False

    def regrow(self) -> bool:
        """Allocate the memory again, contents undefined; returns whether it had been released."""
        if self.allocated:
            return False
        self.tensor.untyped_storage().resize_(self._nbytes)
        self.allocated = True
        return True
