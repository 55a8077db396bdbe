"""Bytes per parameter and step time of the optimizer stack, with and without the distributed optimizer.

One model (a stack of residual MLP blocks) is built four times on every rank: bf16 params with fp32
grads (grad_reduce_in_fp32=True, OptimizerConfig(bf16=True)) and fp32 params, each with and without
use_distributed_optimizer (set in both configs). No overlap, so one bucket per buffer.

Memory: the real bytes of this rank's tensors after the last step: params (the DDP param buffer with the
distributed optimizer, else the parameters themselves), grads (the DDP grad buffer), fp32 main params
(the inner optimizer's params, unless they alias storage already counted: FP32Optimizer steps the model
params, and the fp32 DistributedOptimizer steps views into the param buffer) and Adam's exp_avg and
exp_avg_sq (with --optimizer muon: Muon's one momentum_buffer per matrix element, Adam's two moments for the
LayerNorm weights and the biases). Divided by the model's parameter count and compared with the theory for dp = d:
bf16 params + fp32 grads 18 vs 6 + 12/d bytes per parameter, fp32 16 vs 8 + 8/d (Muon: 4 fewer bytes of state per
matrix element, divided by d when sharded).

Time: a full training step (zero_grad_buffer, forward, backward, finish_grad_sync, optimizer.step), and
optimizer.step() alone (with the distributed optimizer it includes the parameter all-gather). Each
repetition runs one step of every configuration, in a rotating order, between barriers; a sample is the
slowest rank's time. Last, the distributed and non-distributed parameters are compared: same start, same
batches, so they agree (bit-exactly while the grad norm stays below clip_grad = 1). Results and
discussion: docs/distributed_optimizer.md::

    torchrun --nproc-per-node 2 -m benchmarks.optimizer_memory
    python -m benchmarks.optimizer_memory            # spawns 2 ranks itself (file:// rendezvous)
    python -m benchmarks.optimizer_memory --optimizer muon --hidden 128 --steps 5 --warmup 1
"""

import argparse
import os

import torch

from benchmarks.counting import held_bytes
from benchmarks.launch import launch, world_size
from benchmarks.mlp_memory import MLPStack, train_step
from benchmarks.timing import alternate
from megatron_lite import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_lite.distributed import collectives
from megatron_lite.optimizer.muon import matrix_specs

CONFIGS = [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False), (torch.float32, True)]
STATE = ("exp_avg", "exp_avg_sq", "momentum_buffer")  # Adam's moments; Muon's momentum (its matrices)


def name(dtype, distributed) -> str:
    return f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} {'distributed' if distributed else 'non-distributed'}"


def build(dtype, distributed, args):
    torch.manual_seed(0)  # identical replicas, and the same initial weights for every configuration
    ddp = DistributedDataParallel(MLPStack(args.hidden, args.layers).to(dtype), DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed))
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer=args.optimizer, lr=1e-4, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=distributed), [ddp])
    return ddp, opt


def memory(ddp, opt) -> dict:
    """This rank's bytes of params, grads, fp32 main params and optimizer state; shared storage counted once
    (the fp32 optimizers' main params are the model's own storage, so they add nothing)."""
    seen = set()
    return dict(
        # params are views into param_data with the distributed optimizer
        params=held_bytes([b.param_data for b in ddp.param_and_grad_buffers if b.param_data is not None]
                          + list(ddp.param_to_name), seen),
        grads=held_bytes([b.grad_data for b in ddp.param_and_grad_buffers], seen),
        main=held_bytes([p for g in opt.optimizer.param_groups for p in g["params"]], seen),
        state=held_bytes([s[k] for s in opt.optimizer.state.values() for k in STATE if k in s], seen))


def theory(dtype, distributed, d, matrix_fraction: float) -> float:
    """Bytes per parameter: params + grads (fp32) + fp32 main params (none for fp32) + optimizer state: Adam's 8,
    or with Muon 4 for the `matrix_fraction` of the parameters it steps and Adam's 8 for the rest."""
    param = 2 if dtype == torch.bfloat16 else 4
    main = 4 if dtype == torch.bfloat16 else 0
    state = 4 * matrix_fraction + 8 * (1 - matrix_fraction)
    return param + 4 + (main + state) / (d if distributed else 1)


def benchmark(args, rank: int, world: int, device):
    runs = [build(dtype, distributed, args) for dtype, distributed in CONFIGS]
    numel = sum(p.numel() for p in runs[0][0].module.parameters())
    specs = matrix_specs([runs[0][0]], runs[0][1].config) if args.optimizer == "muon" else {}
    matrix_fraction = sum(p.numel() for p, spec in specs.items() if spec is not None) / numel
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own micro-batch
    x = torch.randn(args.micro_batch_size, args.hidden, generator=g)
    y = torch.randn(args.micro_batch_size, args.hidden, generator=g)
    timings = alternate(lambda k: [train_step(*runs[k], x, y)], len(runs), args.steps, warmup=args.warmup)
    medians = [[timings.median_ms(k, column) for k in range(len(runs))] for column in (0, 1)]  # step, opt.step
    mems = collectives.all_gather_object([memory(ddp, opt) for ddp, opt in runs])
    # Sanity check: same weights, same batches, same steps. Bit-exact while no clipping happens (the sharded
    # grad norm differs in the last bits, so clipped updates would too).
    flat = [torch.cat([p.detach().float().flatten() for p in ddp.module.parameters()]) for ddp, _ in runs]
    drift = [(flat[k + 1] - flat[k]).abs().max().item() for k in (0, 2)]
    if rank != 0:
        return

    mib = 2**20
    print(f"gloo, {world} ranks, torch {torch.__version__}, 1 thread/rank, {os.cpu_count()} CPUs; MLPStack "
          f"hidden {args.hidden} x {args.layers} layers = {numel:,} parameters; micro-batch {args.micro_batch_size}; "
          f"{args.optimizer} (Muon steps {matrix_fraction:.2%} of the parameters); median of {args.steps} steps "
          f"({args.warmup} warm-up)\n")
    print("Memory per rank, bytes per parameter (component bytes / model parameters):\n")
    print(f"| {'configuration':<20} | rank | params | grads | fp32 main | {args.optimizer + ' state':<10} | total | "
          f"theory | total MiB |")
    print(f"|{'-' * 22}|------|--------|-------|-----------|------------|-------|--------|-----------|")
    for k, (dtype, distributed) in enumerate(CONFIGS):
        for r in range(world):
            m = mems[r][k]
            per = {key: value / numel for key, value in m.items()}
            total = sum(m.values())
            print(f"| {name(dtype, distributed):<20} | {r:>4} | {per['params']:>6.2f} | {per['grads']:>5.2f} | "
                  f"{per['main']:>9.2f} | {per['state']:>10.2f} | {total / numel:>5.2f} | "
                  f"{theory(dtype, distributed, world, matrix_fraction):>6.2f} | {total / mib:>9.2f} |")
    print("\nStep time (zero_grad_buffer, forward, backward, finish_grad_sync, optimizer.step), median ms:\n")
    print(f"| {'configuration':<20} | full step | distributed / non-distributed | optimizer.step() alone |")
    print(f"|{'-' * 22}|-----------|-------------------------------|------------------------|")
    (full, opt_only) = medians
    for k, (dtype, distributed) in enumerate(CONFIGS):
        ratio = f"{full[k] / full[k - 1]:.2f}x" if distributed else ""
        print(f"| {name(dtype, distributed):<20} | {full[k]:>9.1f} | {ratio:>29} | {opt_only[k]:>22.1f} |")
    print(f"\nmax |distributed - non-distributed| parameter after {args.warmup + args.steps} steps: "
          f"bf16 {drift[0]:.2e}, fp32 {drift[1]:.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256, help="model width h (default: 256)")
    parser.add_argument("--layers", type=int, default=6,
                        help="residual MLP blocks of 8h^2 + 7h parameters (default: 6: 3,156,480 parameters at h 256)")
    parser.add_argument("--micro-batch-size", type=int, default=32, help="rows of input per rank (default: 32)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per configuration (default: 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration (default: 3)")
    parser.add_argument("--optimizer", choices=["adam", "muon"], default="adam",
                        help="adam (default), or muon: the Linear weights on Muon, LayerNorms and biases on AdamW")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks to spawn when not launched by torchrun (default: 2)")
    args = parser.parse_args()
    for flag in ("hidden", "layers", "micro_batch_size", "steps", "world_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    launch(benchmark, args, world_size(args.world_size), cpu=True, threads_per_rank=1)


if __name__ == "__main__":
    main()
