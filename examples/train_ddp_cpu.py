"""Train a tiny character-level language model with megatron-lite's DistributedDataParallel.

    torchrun --nproc-per-node 2 examples/train_ddp_cpu.py --overlap-grad-reduce

The data is built in: sequences sampled from a random order-2 Markov chain over 32 symbols, so the loss
falls from ln(32) = 3.47 towards the chain's entropy within seconds on 2 CPU cores. Every rank builds
the same data and model from --seed, reads its own slice of each global batch and runs the training
step of megatron_lite/distributed/distributed_data_parallel.py's module docstring.
"""

import argparse
import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

VOCAB, CONTEXT, SEQ_LEN, NUM_SEQUENCES = 32, 2, 32, 8192


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=16, help="sequences per micro-batch per rank")
    g.add_argument("--global-batch-size", type=int, default=128,
                   help="sequences per iteration over all ranks; must be divisible by micro-batch-size x "
                        "data-parallel size (the quotient is the number of micro-batches accumulated)")
    g.add_argument("--train-iters", type=int, default=200, help="iterations to train")
    g.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (constant)")
    g.add_argument("--log-interval", type=int, default=20, help="rank 0 prints a log line every this many iterations")
    g.add_argument("--seed", type=int, default=1234, help="seeds data and model, identically on every rank")
    g = p.add_argument_group("distributed")
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl when CUDA is available, else gloo (gloo trains on CPU)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="timeout of init_process_group and of every collective")
    g = p.add_argument_group("DistributedDataParallelConfig (Megatron's flag -> config field)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap_grad_reduce: launch each bucket's all-reduce during backward")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="bucket_size in elements (default: max(40M, 1M x dp), i.e. one bucket for this "
                        "model); only used with --overlap-grad-reduce, without it there is always one bucket")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="average_in_collective: ReduceOp.AVG instead of pre-scaling by 1/dp and summing")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="grad_reduce_in_fp32 (a no-op here: this model is fp32 already)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true",
                   help="check_for_nan_in_grad, and check the loss too; all ranks raise together")
    args = p.parse_args()
    for name in ("micro_batch_size", "global_batch_size", "train_iters", "log_interval"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        p.error(f"--ddp-bucket-size must be positive, got {args.ddp_bucket_size}")
    args.dp = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun; all ranks are data-parallel
    if args.global_batch_size % (args.micro_batch_size * args.dp):
        p.error(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                f"{args.micro_batch_size} x data-parallel size {args.dp}")
    args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * args.dp)
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
    if "RANK" not in os.environ:  # plain `python examples/train_ddp_cpu.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    rank, dp = dist.get_rank(), dist.get_world_size()
    assert dp == args.dp, "WORLD_SIZE changed between argument checks and init_process_group"

    # Identical seed on every rank: the same data order, and replicas that start identical.
    data = make_dataset(args.seed).to(device)
    order = torch.randperm(NUM_SEQUENCES, generator=torch.Generator().manual_seed(args.seed)).to(device)
    torch.manual_seed(args.seed)
    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
    )
    model = DistributedDataParallel(CharMLP().to(device), config)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, foreach=True)
    if rank == 0:
        print(f"> data-parallel size {dp} ({backend}), {sum(p.numel() for p in params)} parameters in "
              f"{sum(len(b.buckets) for b in model.buffers)} bucket(s), {args.num_micro_batches} micro-batch(es) "
              f"of {args.micro_batch_size} per rank per iteration\n> {config}", flush=True)

    local_batch = args.micro_batch_size * args.num_micro_batches
    loss_sum = torch.zeros((), device=device)  # local, summed over the iterations of one log interval
    first_loss = last_loss = None
    interval_start = time.perf_counter()
    for iteration in range(1, args.train_iters + 1):
        # This rank's slice of the global batch, in micro-batches.
        start = (iteration - 1) * args.global_batch_size + rank * local_batch
        batch = data[order[torch.arange(start, start + local_batch, device=device) % NUM_SEQUENCES]]
        micro_batches = batch.split(args.micro_batch_size)

        model.zero_grad_buffer()  # main_grad := 0
        iteration_loss = torch.zeros((), device=device)
        for i, mb in enumerate(micro_batches):
            is_last = i == len(micro_batches) - 1  # only the last micro-batch's backward communicates
            with contextlib.nullcontext() if is_last else model.no_sync():
                logits = model(mb[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten()) / args.num_micro_batches
                loss.backward()
            iteration_loss += loss.detach()
        model.finish_grad_sync()  # main_grad now holds the data-parallel mean gradient
        if args.check_for_nan_in_loss_and_grad:  # a collective, so that every rank raises together
            bad = torch.tensor([float(not torch.isfinite(iteration_loss))], device=device)
            dist.all_reduce(bad)
            if bad.item():
                raise RuntimeError(f"NaN/Inf loss on {int(bad.item())} rank(s) at iteration {iteration}")
        for p in params:
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
        optimizer.step()
        # Drop .grad: it aliases main_grad, and autograd would accumulate into it in the next backward.
        optimizer.zero_grad(set_to_none=True)
        loss_sum += iteration_loss

        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            steps = (iteration - 1) % args.log_interval + 1
            dist.all_reduce(loss_sum)  # SUM over ranks, then the mean over ranks and iterations
            loss_avg = loss_sum.item() / (dp * steps)
            elapsed_ms = (time.perf_counter() - interval_start) * 1000 / steps
            first_loss = loss_avg if first_loss is None else first_loss
            last_loss = loss_avg
            if rank == 0:
                print(f" iteration {iteration:8d}/{args.train_iters:8d} |"
                      f" consumed samples: {iteration * args.global_batch_size:12d} |"
                      f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
                      f" learning rate: {optimizer.param_groups[0]['lr']:.6E} |"
                      f" lm loss: {loss_avg:.6E} |", flush=True)
            loss_sum.zero_()
            interval_start = time.perf_counter()

    # Every rank applied the same averaged gradients, so the replicas must still be bit-identical.
    flat = torch.cat([p.detach().flatten() for p in params])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    max_diff = (flat - reference).abs().max()
    dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"> lm loss {first_loss:.4f} (first log) -> {last_loss:.4f} (last log)")
        print(f"> parameters identical on all {dp} rank(s): max |param - rank 0's param| = {max_diff.item():.3e} "
              f"({'OK' if max_diff.item() == 0 else 'MISMATCH'})", flush=True)
    dist.destroy_process_group()
    if max_diff.item() != 0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
