"""Sharded Muon against every rank orthogonalizing everything, side by side in one run.

Three systems train the same GPT (same weights, same batches) on every rank:

  ml-zero1 muon     megatron_lite DDP + DistributedOptimizer(optimizer='muon'): each matrix is orthogonalized by
                    its owner only (layout.compute_matrix_ownership), its u pieces exchanged by two all-to-alls
  ml-ddp muon       megatron_lite DDP + optimizer='muon' without the distributed optimizer: every rank
                    orthogonalizes every matrix
  torch-ddp muon    torch DDP + torch.optim.Muon (matrices) + torch.optim.AdamW (the rest): every rank
                    orthogonalizes every matrix

Muon's settings are the ones where megatron_lite computes what torch.optim.Muon computes: coefficient type
'simple' (torch's), scale mode 'shape_scaling' with extra factor 1 (torch's adjust_lr_fn 'original'), no Nesterov,
and the fused QKV as one matrix (muon_split_qkv=False: torch.optim.Muon cannot split it), no clipping. So every
system runs the same Newton-Schulz work in all, and the parameters after the run agree (printed).

Printed: the step and optimizer.step() medians (slowest rank, alternating rounds), the ratio to torch, the
Newton-Schulz multiply-adds each rank ran in one optimizer.step() (torch's FlopCounterMode: matmuls only; AdamW
has none), and the optimizer state bytes per rank. Results: docs/performance.md, "Muon"::

    python -m benchmarks.muon_step                 # spawns 2 gloo ranks; --quick for a smoke run
    torchrun --nproc-per-node 2 -m benchmarks.muon_step
"""

import argparse
import os
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.counting import held_bytes, tensors_of
from benchmarks.launch import launch, world_size
from benchmarks.sized_args import write_json
from benchmarks.timing import Progress, alternate
from megatron_lite import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_lite.distributed import collectives
from megatron_lite.models import GPTConfig, GPTModel
from megatron_lite.optimizer.muon import uses_muon

SYSTEMS = ("ml-zero1 muon", "ml-ddp muon", "torch-ddp muon")
# Model and timing sizes: (default, default with --quick).
SIZES = dict(num_layers=(2, 1), hidden_size=(128, 32), num_attention_heads=(4, 2), seq_length=(64, 16),
             vocab_size=(1024, 128), micro_batch_size=(2, 2), repeats=(5, 1), steps=(2, 1), warmup=(1, 1))


def optimizer_config(args, distributed: bool) -> OptimizerConfig:
    return OptimizerConfig(optimizer="muon", lr=args.lr, weight_decay=0.1, clip_grad=0.0,
                           use_distributed_optimizer=distributed, muon_momentum=0.95, muon_nesterov=False,
                           muon_split_qkv=False, muon_coefficient_type="simple", muon_num_ns_steps=5,
                           muon_scale_mode="shape_scaling", muon_extra_scale_factor=1.0)


def build_gpt(args) -> GPTModel:
    torch.manual_seed(0)  # the same weights on every rank and in every system
    return GPTModel(GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, vocab_size=args.vocab_size,
                              num_attention_heads=args.num_attention_heads, max_position_embeddings=args.seq_length))


def build_megatron_lite(args, distributed: bool):
    ddp = DistributedDataParallel(build_gpt(args), DistributedDataParallelConfig(use_distributed_optimizer=distributed))
    opt = get_megatron_optimizer(optimizer_config(args, distributed), [ddp])

    def step(tokens):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        ddp.finish_grad_sync()
        start = time.perf_counter()
        opt.step()
        return time.perf_counter() - start

    def state():
        return [t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]

    return ddp.module, step, state, getattr(opt, "matrix_exchange", None)


def build_torch(args):
    """torch DDP + torch.optim.Muon on the parameters megatron_lite's rule gives Muon + AdamW on the rest, with
    megatron_lite's weight-decay groups (none for biases and 1-D parameters)."""
    model = build_gpt(args)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    config = optimizer_config(args, False)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for _, p in named if uses_muon(p)]
    rest = [(n, p) for n, p in named if not uses_muon(p)]
    muon = torch.optim.Muon(matrices, lr=config.lr, weight_decay=config.weight_decay, momentum=config.muon_momentum,
                            nesterov=False, ns_steps=config.muon_num_ns_steps, adjust_lr_fn="original")
    decay = [p for n, p in rest if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in rest if n.endswith(".bias") or p.dim() == 1]
    adamw = torch.optim.AdamW([dict(params=decay, weight_decay=config.weight_decay),
                               dict(params=no_decay, weight_decay=0.0)], lr=config.lr,
                              betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, foreach=True)

    def step(tokens):
        muon.zero_grad()
        adamw.zero_grad()
        ddp(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        start = time.perf_counter()
        muon.step()
        adamw.step()
        return time.perf_counter() - start

    return model, step, lambda: tensors_of(muon) + tensors_of(adamw), None


def multiply_adds(step, tokens) -> int:
    """Matmul multiply-adds of one whole step (forward, backward, optimizer) under torch's flop counter."""
    with FlopCounterMode(display=False) as whole:
        step(tokens)
    return whole.get_total_flops() // 2


def benchmark(args, rank: int, world: int, device):
    built = [build_megatron_lite(args, True), build_megatron_lite(args, False), build_torch(args)]
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own micro-batch, the same in every system
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
    # Newton-Schulz work per rank: one optimizer step of each system under the flop counter, less the forward and
    # backward's matmuls (the same model and batch in every system: counted once on a bare copy).
    bare = build_gpt(args)
    with FlopCounterMode(display=False) as fwd_bwd:
        bare(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    counted = [multiply_adds(step, tokens) - fwd_bwd.get_total_flops() // 2 for _, step, _, _ in built]
    timings = alternate(lambda k: [built[k][1](tokens)], len(built), args.repeats, args.steps, warmup=args.warmup,
                        progress=Progress("muon_step", SYSTEMS))
    state = [held_bytes(state(), set()) for _, _, state, _ in built]
    flat = [torch.cat([p.detach().flatten() for p in model.parameters()]) for model, _, _, _ in built]
    drift = [(flat[k] - flat[2]).abs().max().item() for k in (0, 1)]
    exchange = built[0][3]  # ml-zero1's plan: bf16 elements to and from the other ranks of the instance
    moved = [sum(n for q, n in enumerate(splits) if q != exchange.position)
             for splits in (exchange.send_splits, exchange.recv_splits)]
    per_rank = collectives.all_gather_object(dict(counted=counted, state=state, moved=moved))
    if rank != 0:
        return

    numel = sum(p.numel() for p in built[0][0].parameters())
    full = [timings.median_ms(k, 0) for k in range(len(built))]
    opt = [timings.median_ms(k, 1) for k in range(len(built))]
    print(f"\ngloo, {world} ranks, torch {torch.__version__}, {torch.get_num_threads()} thread(s)/rank, "
          f"{os.cpu_count()} CPUs; GPT {args.num_layers} layers x hidden {args.hidden_size} = {numel:,} parameters; "
          f"micro-batch {args.micro_batch_size} x {args.seq_length} tokens; median of {args.repeats} x {args.steps} "
          f"steps ({args.warmup} warm-up rounds)\n")
    print("| system | step ms | / torch-ddp | optimizer.step ms | / torch-ddp | Newton-Schulz M multiply-adds per rank "
          "(rank 0, 1, ...) | optimizer state MiB per rank |")
    print("|---|---|---|---|---|---|---|")
    for k, name in enumerate(SYSTEMS):
        work = ", ".join(f"{r['counted'][k] / 1e6:.1f}" for r in per_rank)
        mib = ", ".join(f"{r['state'][k] / 2**20:.2f}" for r in per_rank)
        print(f"| {name} | {full[k]:.1f} | {full[k] / full[2]:.2f}x | {opt[k]:.1f} | {opt[k] / opt[2]:.2f}x | {work} | "
              f"{mib} |")
    print(f"\nmax |parameter - torch-ddp muon's| after {args.warmup + args.repeats * args.steps + 1} steps: "
          f"ml-zero1 {drift[0]:.2e}, ml-ddp {drift[1]:.2e}")
    print("ml-zero1's exchange per step, elements each rank sends to / receives from the other ranks (u goes out "
          "cast to bf16, Newton-Schulz's first step, and the orthogonalized pieces come back in bf16, the other way "
          "round): "
          + ", ".join(f"rank {r}: {m['moved'][0] / 1e6:.3f}M / {m['moved'][1] / 1e6:.3f}M"
                      for r, m in enumerate(per_rank)))
    write_json(args.out, dict(systems=list(SYSTEMS), step_ms=full, optimizer_step_ms=opt,
                              multiply_adds_per_rank=[r["counted"] for r in per_rank],
                              state_bytes_per_rank=[r["state"] for r in per_rank], drift=drift, parameters=numel,
                              exchange_elements_per_rank=[r["moved"] for r in per_rank],
                              world_size=world))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the small sizes (a CPU smoke run)")
    for name, (default, quick) in SIZES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default {default} ({quick} with --quick)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args()
    for name, (default, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}")
    launch(benchmark, args, world_size(args.world_size), cpu=True, threads_per_rank=args.threads_per_rank)


if __name__ == "__main__":
    main()
