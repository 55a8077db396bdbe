"""Optimizer state in host memory (Megatron's --optimizer-cpu-offload): the fp32 main params, and with them
the optimizer's moments, of the offloaded parameters live on the CPU, so the accelerator keeps only the
model's parameters and gradients.

    step():  device grads --D2H (pinned, async)--> host grads    after unscale / norm / clip, on the device
             inner optimizer step on the CPU (torch's fused CPU kernels)
             host main params --H2D (pinned, async)--> model params (cast), then the parameter all-gather

The norm, the zero count and the overflow check still read the device gradients (the collectives stay on
the device); only the update moves. `optimizer_offload_fraction` offloads whole main params, in the inner
optimizer's order, until that fraction of the elements is on the host (Megatron's rule); the rest are
stepped on the device by the same inner optimizer (torch's kernels group tensors by device).
"""

from typing import Dict, List, Tuple

import torch


def offload_plan(model_datas: List[torch.Tensor], fraction: float) -> List[bool]:
    """For each tensor the inner optimizer will step (in its order), whether its main param lives on the
    host: whole tensors, taken in order while the host holds less than `fraction` of all elements."""
    threshold = fraction * sum(t.numel() for t in model_datas)
    plan, on_host = [], 0
    for t in model_datas:
        plan.append(on_host < threshold)
        on_host += t.numel() if plan[-1] else 0
    return plan


def host_main_param(model_data: torch.Tensor) -> torch.nn.Parameter:
    """An fp32 copy of `model_data` in host memory, pinned when the model is on an accelerator (so the
    copies to and from it can run asynchronously)."""
    pin = model_data.device.type != "cpu"
    host = torch.empty(model_data.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
    host.copy_(model_data.detach())
    return torch.nn.Parameter(host)


class GradStaging:
    """The host gradients of the offloaded main params: one pinned buffer per main param, kept across
    steps. add() collects (main, device grad) pairs during a step; to_host() copies them all and returns
    once they have landed, with each main's .grad set to its host buffer."""

    def __init__(self):
        self._buffers: Dict[int, torch.Tensor] = {}
        self._pending: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, main: torch.Tensor, grad: torch.Tensor):
        self._pending.append((main, grad))

    def to_host(self):
        pending, self._pending = self._pending, []
        for main, grad in pending:
            buffer = self._buffers.get(id(main))
            if buffer is None:
                buffer = torch.empty(main.shape, dtype=torch.float32, device="cpu",
                                     pin_memory=grad.device.type != "cpu")
                self._buffers[id(main)] = buffer
            buffer.copy_(grad.view(main.shape), non_blocking=True)
            main.grad = buffer
        if any(grad.is_cuda for _, grad in pending):
            torch.cuda.current_stream().synchronize()  # the copies were queued behind the unscale / clip

    def clear(self):
        self._pending = []
