"""Bytes sent and error of the gradient reduction modes: fp32, bf16, and megatron-core's two in between.

A small bf16 GPT takes the same micro-batches on every mode (so every mode reduces the very same bf16
micro-batch gradients); the reference is their exact mean, summed in float64 over micro-batches and ranks.
Each mode wraps a fresh copy with the distributed optimizer ('optim', which every mode supports), runs one
iteration (the first M-1 micro-batches under no_sync) and compares this rank's reduced shard with the
reference. Reported per mode (results: docs/performance.md):

  * bytes per gradient element this rank sent in finish_grad_sync (collectives.observe, ring-algorithmic
    bytes: (N-1)/N x the message for reduce-scatter / all-to-all, 2(N-1)/N for all-reduce, which gloo's
    reduce-scatter is; see collectives.py), and what NCCL's reduce-scatter would send instead;
  * the relative L2 error ||g - ref|| / ||ref||, and the worst elementwise error in units of u S (u = 2^-8,
    S = the element's sum of |micro-batch gradient| over ranks and micro-batches / dp): the unit of the bounds
    in tests/distributed/test_low_precision_reduce.py. ::

    python -m benchmarks.low_precision_reduce --world-size 2
    python -m benchmarks.low_precision_reduce --world-size 4 --micro-batches 8
"""

import argparse
import copy

import torch

from benchmarks.counting import count_megatron_lite
from benchmarks.launch import launch, world_size
from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig
from megatron_lite.distributed import collectives
from megatron_lite.distributed.param_and_grad_buffer import shard_ranges
from megatron_lite.models import GPTConfig, GPTModel

U = 2.0 ** -8  # bf16's unit roundoff
MODES = {  # name -> DDP config fields (on top of data_parallel_sharding_strategy='optim')
    "grad_reduce_in_fp32": dict(grad_reduce_in_fp32=True),
    "bf16 reduce": {},
    "bf16 + fp32 local accumulation ('all')": dict(param_name_patterns_for_fp32_local_accumulation=("all",)),
    "bf16 + reduce_scatter_with_fp32_accumulation": dict(reduce_scatter_with_fp32_accumulation=True),
    "bf16 + both": dict(param_name_patterns_for_fp32_local_accumulation=("all",),
                        reduce_scatter_with_fp32_accumulation=True),
}


# ------------------------------------------------------------------------------------------ building
def build_model(args) -> GPTModel:
    torch.manual_seed(args.seed)
    return GPTModel(GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=4,
                              vocab_size=args.vocab_size, max_position_embeddings=args.seq_length,
                              params_dtype=torch.bfloat16))


def micro_batches(args, rank):
    g = torch.Generator().manual_seed(1000 * args.seed + rank)
    return [torch.randint(args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
            for _ in range(args.micro_batches)]


def loss(model, tokens, num_micro_batches):
    return model(tokens[:, :-1], labels=tokens[:, 1:]).mean() / num_micro_batches


# ------------------------------------------------------------------------------------------ measuring
def reference(model, batches):
    """name -> (exact mean gradient, S) in float64, over every rank's micro-batches."""
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    magnitude = copy.deepcopy(total)
    for tokens in batches:
        model.zero_grad(set_to_none=True)
        loss(model, tokens, len(batches)).backward()
        for n, p in model.named_parameters():
            total[n] += p.grad.double()
            magnitude[n] += p.grad.double().abs()
    dp = torch.distributed.get_world_size()
    for tensors in (total, magnitude):
        for t in tensors.values():
            collectives.all_reduce(t)
            t /= dp
    return {n: (total[n], magnitude[n]) for n in total}


def measure(model, fields, batches, ref):
    """(bytes sent per gradient element, sum err^2, sum ref^2, worst |err| / (u S)) of this rank's shard."""
    ddp = DistributedDataParallel(copy.deepcopy(model), DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim", **fields))
    ddp.zero_grad_buffer()
    for m, tokens in enumerate(batches):
        if m < len(batches) - 1:
            with ddp.no_sync():
                loss(ddp, tokens, len(batches)).backward()
        else:
            loss(ddp, tokens, len(batches)).backward()
    with count_megatron_lite() as calls:
        ddp.finish_grad_sync()
    numel = sum(p.numel() for p in ddp.param_to_name)
    err2 = ref2 = worst = 0.0
    for s in shard_ranges([ddp]):
        exact, magnitude = (t.view(-1)[s.param_start:s.param_end] for t in ref[ddp.param_to_name[s.model_param]])
        err = s.grad.double() - exact
        err2, ref2 = err2 + err.square().sum().item(), ref2 + exact.square().sum().item()
        worst = max(worst, (err.abs() / (U * magnitude).clamp_min(1e-300)).max().item())
    return sum(c[2] for c in calls) / numel, err2, ref2, worst


def benchmark(args, rank, world, device):
    model = build_model(args)
    batches = micro_batches(args, rank)
    ref = reference(model, batches)
    rows = []
    for name, fields in MODES.items():
        sent, err2, ref2, worst = measure(model, fields, batches, ref)
        stats = torch.tensor([err2, ref2], dtype=torch.float64)
        collectives.all_reduce(stats)
        peak = torch.tensor([worst, sent], dtype=torch.float64)
        collectives.all_reduce(peak, op=collectives.MAX)
        grad_bytes = 4 if fields.get("grad_reduce_in_fp32") else 2
        rows.append((name, peak[1].item(), grad_bytes * (world - 1) / world, (stats[0] / stats[1]).sqrt().item(),
                     peak[0].item()))
    if rank == 0:
        report(rows, args, world)


# ------------------------------------------------------------------------------------------ reporting
def report(rows, args, world):
    numel = sum(p.numel() for p in build_model(args).parameters())
    print(f"dp={world}, {args.micro_batches} micro-batches of {args.micro_batch_size} x {args.seq_length} tokens, "
          f"bf16 GPT of {numel} parameters, data_parallel_sharding_strategy='optim', "
          f"backend {torch.distributed.get_backend()}")
    print("| mode | bytes/element sent here | on NCCL | relative L2 error | worst error (u S) |")
    print("|---|---|---|---|---|")
    for name, sent, nccl, rel, worst in rows:
        print(f"| {name} | {sent:.2f} | {nccl:.2f} | {rel:.2e} | {worst:.2f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (torchrun's WORLD_SIZE wins)")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    launch(benchmark, args, world_size(args.world_size), cpu=True)


if __name__ == "__main__":
    main()
