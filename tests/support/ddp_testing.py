"""Models, data and single-process references shared by the DDP tests (imported inside rank workers).

The reference replays exactly the arithmetic a rank performs, in one process: for every rank r and
micro-batch m it computes the gradient of loss(batch[r][m]) / M on an identical model copy, accumulates it
in the grad dtype like main_grad does, then combines the ranks like the collective does (pre-scale by
1/dp and sum, or sum and divide). For dp=2 that combination is a single commutative addition, so fp32
results are bit-exact; for larger dp gloo's summation order is not ours and we allow 1e-6 relative.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn


class SmallNet(nn.Module):
    """Ragged parameter sizes (so buckets and shards cut through parameters) and a LayerNorm."""

    def __init__(self, width=16):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = self.norm(torch.tanh(self.fc2(h)))
        return self.head(h)


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return SmallNet().to(dtype)


def make_batches(dp, micro_batches, micro_batch_size=4, seed=1, dtype=torch.float32):
    """batches[r][m] = (x, y): identical on every rank, so each rank can pick its own slice."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randn(micro_batch_size, 8, generator=g).to(dtype),
             torch.randn(micro_batch_size, 3, generator=g).to(dtype))
            for _ in range(micro_batches)
        ]
        for _ in range(dp)
    ]


def loss_fn(model, x, y):
    return ((model(x).float() - y.float()) ** 2).mean()


def train_step(ddp, batches, rank):
    """One Megatron-style gradient step on this rank's micro-batches."""
    mbs = batches[rank]
    ddp.zero_grad_buffer()
    for i, (x, y) in enumerate(mbs):
        if i < len(mbs) - 1:
            with ddp.no_sync():
                (loss_fn(ddp, x, y) / len(mbs)).backward()
        else:
            (loss_fn(ddp, x, y) / len(mbs)).backward()
    ddp.finish_grad_sync()


def reference_grads(model, batches, grad_dtype, average_in_collective):
    """Per parameter name: the mean gradient computed with the same arithmetic as the DDP ranks."""
    dp = len(batches)
    per_rank = []
    for rank_batches in batches:
        ref = copy.deepcopy(model)
        acc = {n: torch.zeros_like(p, dtype=grad_dtype) for n, p in ref.named_parameters() if p.requires_grad}
        for x, y in rank_batches:
            ref.zero_grad(set_to_none=True)
            (loss_fn(ref, x, y) / len(rank_batches)).backward()
            for n, p in ref.named_parameters():
                if p.grad is not None:
                    acc[n].add_(p.grad)
        per_rank.append(acc)
    out = {}
    for n in per_rank[0]:
        # Pre-scale by 1/dp then sum, or sum then divide (ReduceOp.AVG).
        parts = [acc[n] if average_in_collective else acc[n] * (1.0 / dp) for acc in per_rank]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        out[n] = total / dp if average_in_collective else total
    return out


def global_batch_grads(model, batches):
    """Gradient of the mean loss over the whole global batch in one pass (the textbook reference)."""
    ref = copy.deepcopy(model)
    x = torch.cat([x for rank_batches in batches for x, _ in rank_batches])
    y = torch.cat([y for rank_batches in batches for _, y in rank_batches])
    loss_fn(ref, x, y).backward()
    return {n: p.grad.float() for n, p in ref.named_parameters() if p.grad is not None}


def own_shard_mask(buffer, rank):
    """Boolean mask over buffer.grad_data: True where this rank's reduce-scatter result is defined."""
    mask = torch.zeros(buffer.numel, dtype=torch.bool)
    for bucket in buffer.buckets:
        shard = bucket.grad_data.numel() // buffer.data_parallel_world_size
        start = bucket.offset + rank * shard
        mask[start:start + shard] = True
    return mask


def reference_in_buffer_layout(buffer, ddp, ref):
    """The reference gradients scattered into a tensor laid out like buffer.grad_data (padding = 0)."""
    flat = torch.zeros(buffer.numel, dtype=buffer.grad_dtype)
    for param, (start, end, _) in buffer.param_index_map.items():
        flat[start:end] = ref[ddp.param_to_name[param]].reshape(-1).to(buffer.grad_dtype)
    return flat


def compare_to_reference(ddp, ref, exact, rtol=1e-6):
    """Compare every buffer's reduced gradients (own shards only with the distributed optimizer)."""
    rank = dist.get_rank(ddp.data_parallel_group)
    for buffer in ddp.param_and_grad_buffers:
        expected = reference_in_buffer_layout(buffer, ddp, ref)
        actual = buffer.grad_data.detach().clone()
        if ddp.ddp_config.use_distributed_optimizer:
            mask = own_shard_mask(buffer, rank)
            expected, actual = expected[mask], actual[mask]
        if exact:
            if not torch.equal(actual, expected):
                diff = (actual.float() - expected.float()).abs().max().item()
                raise AssertionError(f"rank {rank}: not bit-exact, max abs diff {diff:.3e}")
        else:
            scale = expected.float().abs().max().item()
            torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol * scale)


def mean_of_rank_grads(reference, inputs):
    """{name: mean over ranks of d(reference(x).pow(2).mean())/d(param)}, one x per rank (dp=2: exactly the
    arithmetic of pre-scaling by 1/dp and summing)."""
    expected = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for x in inputs:
        reference.zero_grad()
        reference(x).pow(2).mean().backward()
        for n, p in reference.named_parameters():
            expected[n] += p.grad / len(inputs)
    return expected
