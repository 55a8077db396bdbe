"""What the wrapper refuses in a user's model at wrap time, where torch's DistributedDataParallel would accept it
but the gradient buffers cannot give the same result. Every rank wraps the same model (replica_check.py), so
every rank raises the same error at the same point: no rank is left waiting in a collective.

  * sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True): main_grad is a dense view into a
    contiguous buffer; autograd's sparse .grad has no storage to alias or add from, and torch DDP's sparse
    all-reduce has no counterpart in the buckets.
  * two Parameter objects over the same memory (`head.weight.data = embed.weight.data`, the tie made by
    aliasing instead of by sharing the Parameter): the buffers give each parameter its own storage (the
    distributed optimizer's parameter buffer, ZeRO-3's shards, an fp32 main param each), so the tie is
    silently cut under some strategies and kept under others.
"""

from typing import List, Tuple

import torch

__all__ = ["raise_if_unsupported_model", "sparse_grad_error"]

SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def raise_if_unsupported_model(module: torch.nn.Module):
    """Raise TypeError for sparse-gradient modules and ValueError for trainable parameters sharing memory."""
    for name, sub in module.named_modules():
        if isinstance(sub, SPARSE_MODULES) and sub.sparse and sub.weight.requires_grad:
            raise TypeError(
                f"{name or type(module).__name__}: {type(sub).__name__}(sparse=True) gives sparse gradients, which "
                f"DistributedDataParallel's contiguous gradient buffers cannot hold: build it with sparse=False "
                f"(the same gradient values, dense) before wrapping"
            )
    overlaps = _overlapping_params(list(module.named_parameters()))
    if overlaps:
        shown = "; ".join(f"{a} and {b}" for a, b in overlaps[:5])
        raise ValueError(
            f"parameters that are different nn.Parameter objects share memory: {shown}. DistributedDataParallel "
            f"gives every parameter storage of its own (buffers, shards, fp32 main params), which would cut "
            f"this tie silently. Tie weights by sharing the Parameter itself (head.weight = embed.weight, "
            f"as nanoGPT and transformers' tie_weights do), not its data (head.weight.data = embed.weight.data)"
        )


def sparse_grad_error(name: str, grad: torch.Tensor) -> TypeError:
    """The gradient hook's error for a gradient that is not strided (its check, a layout comparison, stays in
    the hook): sparse gradients that no module at wrap time announced (a custom autograd.Function)."""
    return TypeError(f"{name} received a {grad.layout} gradient: DistributedDataParallel's gradient buffers "
                     f"hold dense gradients only; make the operation that produces it return a dense gradient")


def _overlapping_params(named: List[Tuple[str, torch.nn.Parameter]]) -> List[Tuple[str, str]]:
    """Pairs of parameter names whose memory overlaps, one of them trainable (named_parameters() yields a
    shared Parameter once: those are not pairs). Meta tensors have no memory; empty ones hold none."""
    spans = []
    for name, param in named:
        if param.is_meta or param.numel() == 0 or any(st == 0 and n > 1 for n, st in zip(param.shape, param.stride())):
            continue  # no memory, or an expanded placeholder (a ZeRO-3 wrapper's released parameters)
        extent = sum((size - 1) * stride for size, stride in zip(param.shape, param.stride())) + 1
        start = param.data_ptr()
        spans.append((param.device, start, start + extent * param.element_size(), name, param.requires_grad))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    pairs, reach = [], None  # reach: the span reaching furthest so far on this device
    for span in spans:
        device, start, end, name, trainable = span
        if reach is not None and reach[0] == device and start < reach[2] and (trainable or reach[4]):
            pairs.append((reach[3], name))
        if reach is None or reach[0] != device or end > reach[2]:
            reach = span
    return pairs
