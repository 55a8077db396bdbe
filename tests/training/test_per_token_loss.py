"""Megatron's loss semantics: a loss function returning (sum over unmasked tokens, number of tokens), with
and without --calculate-per-token-loss, against a single-process reference with uneven masks."""

import torch
from distributed_helper import run_distributed

MICRO_BATCHES, DP = 2, 2


def _data(rank, m):
    """Micro-batch m of rank r: inputs, targets and a mask whose token count differs per rank and step."""
    g = torch.Generator().manual_seed(100 * rank + m)
    x, y = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 2, generator=g)
    mask = (torch.rand(3, 5, generator=g) < [0.9, 0.3][m] - 0.2 * rank).float()
    mask[0, 0] = 1.0  # never empty
    return x, y, mask


def _token_losses(model, x, y):
    return (model(x) - y).pow(2).mean(-1)  # one loss per token


def _reference(per_token):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    total, sums, counts = 0.0, 0.0, 0.0
    for r in range(DP):
        for m in range(MICRO_BATCHES):
            x, y, mask = _data(r, m)
            s, n = (_token_losses(model, x, y) * mask).sum(), mask.sum()
            sums, counts = sums + s.detach(), counts + n
            total = total + (s if per_token else s / n / MICRO_BATCHES / DP)
    if per_token:
        total = total / counts  # every token of the global batch weighs the same
    total.backward()
    return {n: p.grad for n, p in model.named_parameters()}, (sums / counts).item()


def _worker(per_token, strategy):
    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.training import train_step
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    distributed = strategy != "no_shard"
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=40, calculate_per_token_loss=per_token,
        data_parallel_sharding_strategy=strategy, fsdp_unit_modules=() if strategy == "optim_grads_params" else None))
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.0, clip_grad=0.0, use_distributed_optimizer=distributed), [ddp])
    sched = OptimizerParamScheduler(opt, 0.0, 0.0, 0, 1, "constant")
    batches = iter([_data(rank, m) for m in range(MICRO_BATCHES)])

    def forward_step(data_iterator, model):
        x, y, mask = next(data_iterator)

        def loss_func(output):
            loss = (output * mask).sum()
            return loss, mask.sum().to(torch.int64), {"lm loss": torch.stack([loss.detach(), mask.sum()])}
        return _token_losses(model, x, y), loss_func

    losses, ok, _ = train_step(forward_step, batches, ddp, opt, sched, MICRO_BATCHES, check_for_nan_in_loss=True)
    expected, expected_loss = _reference(per_token)
    if distributed:  # only this rank's shard is reduced (and kept, with ZeRO-2/3): compare bucket by bucket
        buffer = ddp.param_and_grad_buffers[0]
        flat = torch.zeros(buffer.numel)
        for p, (start, end, _) in buffer.param_index_map.items():
            flat[start:end] = expected[ddp.param_to_name[p]].reshape(-1)
        close = all(torch.allclose(b.reduced_grad_shard,
                                   flat[b.offset + b.shard_offset:b.offset + b.shard_offset + b.shard_size],
                                   rtol=1e-5, atol=1e-7) for b in buffer.buckets)
    else:
        close = all(torch.allclose(p.main_grad, expected[n], rtol=1e-5, atol=1e-7) for n, p in model.named_parameters())
    return ok, close, abs(losses["lm loss"] - expected_loss) <= 1e-6 * abs(expected_loss)


def test_loss_sum_and_token_count_match_a_single_process_reference():
    """Would catch per-token losses averaged per micro-batch or per rank (ranks with fewer unmasked tokens
    would weigh as much as the others), gradients pre-scaled by 1/dp and then divided again, a token count
    not summed over ranks, or a reported loss that is not sum / count over the global batch."""
    for per_token in (False, True):
        for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
            for ok, close, loss_ok in run_distributed(_worker, DP, per_token, strategy):
                assert ok and close and loss_ok, (per_token, strategy, close, loss_ok)
