"""Lower-precision gradient reduction (megatron-core's two modes), against exact arithmetic and an fp32 reference.

* `param_name_patterns_for_fp32_local_accumulation`: matched parameters accumulate their micro-batch
  gradients in an fp32 main_grad of their own; the bucket still communicates in bf16 (rounded once, at launch)
  and the reduced value is copied back into main_grad.
* `reduce_scatter_with_fp32_accumulation`: the reduce-scatter sends bf16 (an all-to-all) and sums the
  received copies in fp32, in rank order, rounding once.

The probe model's gradient is a chosen bf16 tensor (loss = sum(w * t)), so every rank can replay the exact
arithmetic each mode performs. With S = sum over ranks and micro-batches of |t| / dp (per element) and
u = 2^-8 (bf16's unit roundoff), the documented error bounds against the exact mean are (docs/performance.md):

    grad_reduce_in_fp32                                   |err| <= 2^-20 S
    both modes                                            |err| <= 2.01 u S   (one rounding per rank, one at the end)
    fp32 local accumulation only                          |err| <= 1.01 dp u S  (1 + (dp - 1) bf16 additions)
    reduce-scatter with fp32 accumulation only            |err| <= 1.01 M u S   (M - 1 bf16 accumulations + 1)
    bf16 (neither)                                        |err| <= 1.01 (M + dp - 2) u S

(first-order bounds of recursive summation; 1% covers the second-order terms). The exact tests are bit-exact
on 2 and 4 ranks wherever megatron-lite fixes the order of the additions; gloo's own bf16 all-reduce order is
not ours, so the mode without the fp32 reduce-scatter is checked bit-exactly on 2 ranks only (one addition).
"""

import pytest
import torch
import torch.nn as nn

from distributed_helper import run_distributed

SIZES = (37, 64, 5, 90, 23)  # ragged: buckets and shards cut through parameters
U = 2.0 ** -8


class Leaf(nn.Module):
    def __init__(self, numel):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def forward(self, target):
        return (self.weight.float() * target).sum()  # d loss / d weight = target, exactly when bf16-representable


class Probe(nn.Module):
    """A model whose gradient is whatever it is given (a ModuleList, so ZeRO-3 finds one unit per leaf)."""

    def __init__(self, sizes=SIZES, dtype=torch.bfloat16):
        super().__init__()
        self.layers = nn.ModuleList(Leaf(n) for n in sizes)
        self.to(dtype)

    def forward(self, targets):
        return sum(layer(t) for layer, t in zip(self.layers, targets))


def make_targets(dp, micro_batches, sizes=SIZES, seed=0, spread=6):
    """targets[r][m][i]: rank r's micro-batch m gradient of leaf i, bf16 values (held in fp32) of magnitudes
    2^-spread .. 2^spread, so that bf16 sums round."""
    g = torch.Generator().manual_seed(seed)

    def one(n):
        scale = 2.0 ** torch.randint(-spread, spread + 1, (n,), generator=g).float()
        return (torch.randn(n, generator=g) * scale).bfloat16().float()
    return [[[one(n) for n in sizes] for _ in range(micro_batches)] for _ in range(dp)]


def expected_grads(targets, promoted, fp32_reduce_scatter):
    """Per leaf: the reduced bf16 gradient, replaying each step in the order megatron-lite performs it."""
    dp = len(targets)
    out = []
    for i in range(len(targets[0][0])):
        scaled = []
        for rank_targets in targets:
            if i in promoted:  # fp32 main_grad, rounded once when the bucket is launched
                acc = torch.zeros_like(rank_targets[0][i])
                for mb in rank_targets:
                    acc += mb[i]
                local = acc.bfloat16()
            else:  # bf16 main_grad: main_grad.add_(grad) rounds on every micro-batch
                local = torch.zeros_like(rank_targets[0][i], dtype=torch.bfloat16)
                for mb in rank_targets:
                    local += mb[i].bfloat16()
            scaled.append(local * (1.0 / dp))  # the pre-scale, in bf16 (exact: dp is a power of two)
        if fp32_reduce_scatter:
            total = torch.zeros_like(scaled[0], dtype=torch.float32)
            for s in scaled:  # rank order
                total += s
            out.append(total.bfloat16())
        else:
            assert dp == 2, "gloo's bf16 summation order is only known for one addition"
            out.append(scaled[0] + scaled[1])
    return out


def run_iteration(ddp, targets, rank):
    """zero_grad_buffer, M backward passes (all but the last under no_sync), finish_grad_sync."""
    micro_batches = targets[rank]
    ddp.zero_grad_buffer()
    for m, mb in enumerate(micro_batches):
        if m < len(micro_batches) - 1:
            with ddp.no_sync():
                ddp(mb).backward()
        else:
            ddp(mb).backward()
    ddp.finish_grad_sync()


def reduced_pieces(ddp):
    """(leaf index, param, start, end, reduced grad values) of what this rank's optimizer reads: main_grad
    whole under no_shard, the rank's reduced shard of each parameter (sharded strategies)."""
    from megatron_lite.optimizer.distrib_optimizer import shard_ranges

    index = {p: int(name.split(".")[1]) for p, name in ddp.param_to_name.items()}
    if not ddp.ddp_config.use_distributed_optimizer:
        return [(index[p], p, 0, p.numel(), p.main_grad.view(-1)) for p in ddp.param_to_name]
    return [(index[s.model_param], s.model_param, s.param_start, s.param_end, s.grad) for s in shard_ranges([ddp])]


CASES = [  # (DDP config, fp32 local accumulation patterns)
    (dict(data_parallel_sharding_strategy="no_shard"), ("layers.1.*", "layers.3.weight")),
    (dict(data_parallel_sharding_strategy="no_shard", overlap_grad_reduce=True, bucket_size=60), ("all",)),
    (dict(data_parallel_sharding_strategy="optim"), ("layers.1.*", "layers.3.weight")),
    (dict(data_parallel_sharding_strategy="optim", reduce_scatter_with_fp32_accumulation=True), ()),
    (dict(data_parallel_sharding_strategy="optim", reduce_scatter_with_fp32_accumulation=True), ("layers.[02]*",)),
    (dict(data_parallel_sharding_strategy="optim", reduce_scatter_with_fp32_accumulation=True,
          overlap_grad_reduce=True, bucket_size=60), ("all",)),
    (dict(data_parallel_sharding_strategy="optim_grads", overlap_grad_reduce=True, bucket_size=60), ("layers.4.*",)),
    (dict(data_parallel_sharding_strategy="optim_grads", reduce_scatter_with_fp32_accumulation=True,
          overlap_grad_reduce=True, bucket_size=60), ("layers.1.*",)),
    (dict(data_parallel_sharding_strategy="optim_grads_params", reduce_scatter_with_fp32_accumulation=True,
          overlap_grad_reduce=True), ("layers.0.*", "layers.3.*")),
    (dict(data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True), ("all",)),
]


def _exact_worker(dp_kwargs, patterns, iterations=2, micro_batches=3):
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank, dp = dist.get_rank(), dist.get_world_size()
    config = DistributedDataParallelConfig(param_name_patterns_for_fp32_local_accumulation=patterns, **dp_kwargs)
    ddp = DistributedDataParallel(Probe(), config)
    promoted = {i for i in range(len(SIZES)) if config.accumulates_in_fp32(f"layers.{i}.weight")}
    for p, name in ddp.param_to_name.items():  # fp32 exactly where a pattern matched
        assert p.main_grad.dtype == (torch.float32 if int(name.split(".")[1]) in promoted else torch.bfloat16), name
    mismatches = []
    for it in range(iterations):  # the second iteration launches from the hooks (overlap) on re-zeroed grads
        targets = make_targets(dp, micro_batches, seed=10 + it)
        run_iteration(ddp, targets, rank)
        want = expected_grads(targets, promoted, config.reduce_scatter_with_fp32_accumulation)
        for i, p, start, end, got in reduced_pieces(ddp):
            if not torch.equal(got.float(), want[i][start:end].float()):
                mismatches.append(f"iteration {it} leaf {i} [{start}:{end}]: max diff "
                                  f"{(got.float() - want[i][start:end].float()).abs().max().item():.3g}")
            if i in promoted and not torch.equal(p.main_grad.view(-1)[start:end], want[i][start:end].float()):
                mismatches.append(f"iteration {it} leaf {i}: fp32 main_grad is not the reduced value")
    return mismatches


@pytest.mark.parametrize("dp", [2, 4])
def test_reduced_gradients_are_bit_exact(dp):
    """Bit-exact against a replay of each mode's arithmetic, on every strategy, with and without overlap, two
    iterations of three micro-batches. Would catch: the fp32 main_grad not being what the hooks accumulate
    into (or not zeroed by zero_grad_buffer), the bucket slice not filled from it before the collective (or
    filled after the pre-scale), the reduced value not copied back (the optimizer would step on the local
    sum), the fp32 reduce-scatter summing in bf16 or in a backend-dependent order, or landing in the wrong
    shard, and ZeRO-2/3 freeing the bucket before the copy-back."""
    failures = {}
    for dp_kwargs, patterns in CASES:
        if dp == 4 and not dp_kwargs.get("reduce_scatter_with_fp32_accumulation"):
            continue  # gloo's bf16 all-reduce of 4 ranks adds in an order of its own: see the tolerance test
        for rank, mismatches in enumerate(run_distributed(_exact_worker, dp, dp_kwargs, patterns)):
            if mismatches:
                failures[f"{dp_kwargs} {patterns} rank {rank}"] = mismatches[:3]
    assert not failures, failures
