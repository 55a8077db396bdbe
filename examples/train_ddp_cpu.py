"""Train a tiny character-level language model with megatron-lite's DistributedDataParallel and optimizer.

    torchrun --nproc-per-node 2 examples/train_ddp_cpu.py --overlap-grad-reduce --use-distributed-optimizer

The data is built in: sequences sampled from a random order-2 Markov chain over 32 symbols, so the loss
falls from ln(32) = 3.47 towards the chain's entropy within seconds on 2 CPU cores. Every rank builds
the same data and model from --seed, reads its own slice of each global batch and runs Megatron's
training step (zero_grad_buffer, no_sync micro-batches, finish_grad_sync, optimizer.step()).
"""

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_lite.optimizer import check_optimizer_matches_ddp
from megatron_lite.training import initialize_distributed, shutdown
from megatron_lite.training.arguments import (
    DDP_FLAGS,
    OPTIMIZER_FLAGS,
    ddp_config_from_args,
    flag_error_message,
    optimizer_config_from_args,
)
from megatron_lite.training.config_flags import add_config_arguments

VOCAB, CONTEXT, SEQ_LEN, NUM_SEQUENCES = 32, 2, 32, 8192


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=16, help="sequences per micro-batch per rank")
    g.add_argument("--global-batch-size", type=int, default=128,
                   help="sequences per iteration over all ranks: a multiple of micro-batch-size x data-parallel "
                        "size (the quotient is the number of micro-batches accumulated per rank)")
    g.add_argument("--train-iters", type=int, default=200, help="iterations to train")
    g.add_argument("--log-interval", type=int, default=20, help="rank 0 prints a log line every this many iterations")
    g.add_argument("--seed", type=int, default=1234, help="seeds data and model, identically on every rank")
    # The configs' own flags, generated from their fields (Megatron's spelling, help = the field's docstring):
    # the same mapping pretrain_gpt.py uses, so every rule is checked once, by the config.
    g = p.add_argument_group("OptimizerConfig (optimizer='adam', i.e. AdamW; constant learning rate)")
    fields = ("lr", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "bf16", "fp16", "loss_scale")
    add_config_arguments(g, OptimizerConfig, {k: OPTIMIZER_FLAGS[k] for k in fields}, defaults=dict(lr=1e-2))
    add_config_arguments(p.add_argument_group("DistributedDataParallelConfig"), DistributedDataParallelConfig,
                         DDP_FLAGS)
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: keep and reduce gradients in bf16 instead of fp32 (as pretrain_gpt.py)")
    g = p.add_argument_group("distributed")
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], help="default: nccl with CUDA, else gloo (CPU)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0, help="timeout of init and of collectives")
    args = p.parse_args()
    for name in ("micro_batch_size", "global_batch_size", "train_iters", "log_interval"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    args.dp = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun; all ranks are data-parallel
    if args.global_batch_size % (args.micro_batch_size * args.dp):
        p.error(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                f"{args.micro_batch_size} x data-parallel size {args.dp}")
    args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * args.dp)
    try:
        args.ddp_config, args.optimizer_config = ddp_config_from_args(args), optimizer_config_from_args(args)
        check_optimizer_matches_ddp(args.optimizer_config, args.ddp_config)
    except ValueError as e:
        p.error(flag_error_message(e))
    return args


def make_dataset(seed: int) -> torch.Tensor:
    """NUM_SEQUENCES x (SEQ_LEN + 1) tokens of an order-2 Markov chain with peaked random transitions."""
    g = torch.Generator().manual_seed(seed)
    probs = (3.0 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g)).softmax(-1)  # P(next | prev2, prev1)
    seqs = torch.empty(NUM_SEQUENCES, SEQ_LEN + 1, dtype=torch.long)
    seqs[:, :2] = torch.randint(VOCAB, (NUM_SEQUENCES, 2), generator=g)
    for t in range(2, SEQ_LEN + 1):
        seqs[:, t] = torch.multinomial(probs[seqs[:, t - 2], seqs[:, t - 1]], 1, generator=g).squeeze(1)
    return seqs


class CharMLP(torch.nn.Module):
    """An n-gram MLP language model: predicts token t+1 from tokens t-CONTEXT+1 .. t. Knows nothing of DDP."""

    def __init__(self, dim: int = 32, hidden: int = 128):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(CONTEXT * dim, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, VOCAB),
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> logits (B, T, VOCAB)
        x = F.pad(self.embedding(tokens), (0, 0, CONTEXT - 1, 0))  # zero "tokens" before the start
        windows = x.unfold(1, CONTEXT, 1)  # (B, T, dim, CONTEXT): the last CONTEXT embeddings
        return self.mlp(windows.flatten(2))


def main():
    args = parse_args()
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    # torchrun's env:// group, or a world of one for a plain `python examples/train_ddp_cpu.py`.
    device = initialize_distributed(backend, "cuda" if backend == "nccl" else "cpu", args.distributed_timeout_minutes)
    rank, dp = dist.get_rank(), dist.get_world_size()
    assert dp == args.dp, "WORLD_SIZE changed between argument checks and init_process_group"

    # Identical seed on every rank: the same data order, and replicas that start identical.
    data = make_dataset(args.seed).to(device)
    order = torch.randperm(NUM_SEQUENCES, generator=torch.Generator().manual_seed(args.seed)).to(device)
    torch.manual_seed(args.seed)
    ddp_config, opt_config = args.ddp_config, args.optimizer_config
    params_dtype = opt_config.params_dtype
    # The model lives in params_dtype before wrapping: DDP's buffers take the dtypes they find.
    model = DistributedDataParallel(CharMLP().to(device=device, dtype=params_dtype), ddp_config)
    optimizer = get_megatron_optimizer(opt_config, [model])
    if rank == 0:
        num_params = sum(p.numel() for p in model.parameters())
        num_buckets = sum(len(b.buckets) for b in model.param_and_grad_buffers)
        print(f"> data-parallel size {dp} ({backend}), {num_params} {params_dtype} "
              f"parameters in {num_buckets} bucket(s), {type(optimizer).__name__}, "
              f"{args.num_micro_batches} micro-batch(es) of {args.micro_batch_size} per rank per iteration\n"
              f"> {ddp_config}\n> {opt_config}", flush=True)

    local_batch = args.micro_batch_size * args.num_micro_batches
    loss_sum = torch.zeros((), device=device)  # local, over the updated iterations of one log interval
    advanced = skipped = total_skipped = 0  # iterations in this log interval: updated / skipped (fp16 overflow)
    logged_losses = []
    interval_start = time.perf_counter()
    for iteration in range(1, args.train_iters + 1):
        start = (iteration - 1) * args.global_batch_size + rank * local_batch  # this rank's slice of the batch
        batch = data[order[torch.arange(start, start + local_batch, device=device) % NUM_SEQUENCES]]
        micro_batches = batch.split(args.micro_batch_size)

        model.zero_grad_buffer()  # main_grad := 0
        optimizer.zero_grad()  # drop the main params' grads
        iteration_loss = torch.zeros((), device=device)
        for i, mb in enumerate(micro_batches):
            is_last = i == len(micro_batches) - 1  # only the last micro-batch's backward communicates
            with contextlib.nullcontext() if is_last else model.no_sync():
                logits = model(mb[:, :-1]).float()  # the loss in fp32, whatever the params dtype
                loss = F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten()) / args.num_micro_batches
                optimizer.scale_loss(loss).backward()  # x loss scale (fp16), else x 1
            iteration_loss += loss.detach()  # unscaled
        model.finish_grad_sync()  # main_grad: the data-parallel mean (distributed optimizer: in own shard only)
        if ddp_config.check_for_nan_in_grad:  # a collective, so that every rank raises together
            bad = torch.tensor([float(not torch.isfinite(iteration_loss))], device=device)
            dist.all_reduce(bad)
            if bad.item():
                raise RuntimeError(f"NaN/Inf loss on {int(bad.item())} rank(s) at iteration {iteration}")
        update_successful, grad_norm, _ = optimizer.step()  # False: fp16 overflow, step skipped on all ranks
        if update_successful:  # as Megatron, the logged loss is the mean over the iterations that updated
            loss_sum, advanced = loss_sum + iteration_loss, advanced + 1
        else:
            skipped += 1

        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            dist.all_reduce(loss_sum)  # SUM over ranks
            loss_avg = loss_sum.item() / (dp * advanced) if advanced else float("nan")
            elapsed_ms = (time.perf_counter() - interval_start) * 1000 / (advanced + skipped)
            logged_losses += [loss_avg] if advanced else []
            if rank == 0:
                print(f" iteration {iteration:8d}/{args.train_iters:8d} |"
                      f" consumed samples: {iteration * args.global_batch_size:12d} |"
                      f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
                      f" learning rate: {optimizer.param_groups[0]['lr']:.6E} |"
                      f" global batch size: {args.global_batch_size:5d} | lm loss: {loss_avg:.6E} |"
                      f" loss scale: {optimizer.get_loss_scale().item():.1f} |"
                      + (f" grad norm: {grad_norm:.3f} |" if grad_norm is not None else "")
                      + f" number of skipped iterations: {skipped:3d} |", flush=True)
            total_skipped, advanced, skipped = total_skipped + skipped, 0, 0
            loss_sum.zero_()
            interval_start = time.perf_counter()

    if args.use_distributed_optimizer:  # with overlap_param_gather the last step's all-gathers are pending
        model.finish_param_sync()
    # Every rank applied the same averaged gradients, so the replicas must still be bit-identical.
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    max_diff = (flat - reference).abs().max()
    dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
    logged_losses = logged_losses or [float("nan")]  # no iteration updated (all skipped)
    if rank == 0:
        print(f"> lm loss {logged_losses[0]:.4f} (first log) -> {logged_losses[-1]:.4f} (last log); "
              f"{total_skipped} of {args.train_iters} iterations skipped")
        print(f"> parameters identical on all {dp} rank(s): max |param - rank 0's param| = {max_diff.item():.3e} "
              f"({'OK' if max_diff.item() == 0 else 'MISMATCH'})", flush=True)
    shutdown(0 if max_diff.item() == 0 else 1)  # exit without the interpreter's finalization (gloo may abort it)


if __name__ == "__main__":
    main()
