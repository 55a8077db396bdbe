"""The pre-training loop: model -> DDP -> optimizer -> scheduler, data per DP rank, logs, eval, checkpoints.

One iteration (Megatron's train_step)::

    model.zero_grad_buffer(); optimizer.zero_grad()
    for each of this rank's micro-batches:          # all but the last under model.no_sync()
        loss = mean per-token loss / num_micro_batches
        optimizer.scale_loss(loss).backward()       # with overlap, buckets reduce during backward
    model.finish_grad_sync()                        # main_grad = data-parallel mean
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful: scheduler.step()
"""

import contextlib
import datetime
import json
import os
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..data import build_gpt_datasets, build_tokenizer, ensure_builtin_dataset, get_batch_for_rank
from ..distributed import DistributedDataParallel, DistributedDataParallelConfig
from ..models import GPTConfig, GPTModel, num_floating_point_operations
from ..optimizer import OptimizerConfig, get_megatron_optimizer
from .checkpointing import load_checkpoint, save_checkpoint
from .scheduler import OptimizerParamScheduler

# Dense bf16 peak of common accelerators, for the MFU estimate (FLOP/s).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
ARCHITECTURE_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size",
                     "position_embedding_type", "untie_embeddings_and_output_weights", "max_position_embeddings")


def print_rank_0(*args):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def initialize_distributed(args) -> torch.device:
    """Join (or create) the process group: torchrun's env:// when present, else a 1-rank group."""
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(args.distributed_backend, timeout=timeout)
        else:  # plain `python pretrain_gpt.py`: a world of one
            init_file = tempfile.NamedTemporaryFile(prefix="mlite_init_", delete=False).name
            os.remove(init_file)
            dist.init_process_group(args.distributed_backend, init_method=f"file://{init_file}",
                                    rank=0, world_size=1, timeout=timeout)
    if dist.get_world_size() != args.data_parallel_size:
        raise ValueError(f"arguments were validated for {args.data_parallel_size} ranks, the group has "
                         f"{dist.get_world_size()}")
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def build_model_and_optimizer(args, vocab_size: int, device: torch.device):
    divisor = 128
    args.padded_vocab_size = -(-vocab_size // divisor) * divisor  # Megatron pads the vocab for fast matmuls
    config = GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=args.padded_vocab_size, max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size,
        position_embedding_type="rope" if args.position_embedding_type == "rope" else "learned",
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        params_dtype=args.params_dtype,
    )
    model = GPTModel(config).to(device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
    )
    ddp = DistributedDataParallel(model, ddp_config)
    opt_config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, fp16=args.fp16, bf16=args.bf16, params_dtype=args.params_dtype,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis, use_distributed_optimizer=args.use_distributed_optimizer,
        clip_grad=args.clip_grad,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    scheduler = OptimizerParamScheduler(optimizer, args.lr, args.min_lr, args.lr_warmup_iters,
                                        args.lr_decay_iters, args.lr_decay_style)
    return config, ddp, optimizer, scheduler


def _forward_losses(model, batch, device):
    vocab = model.module.config.vocab_size
    largest = max(int(batch["tokens"].max()), int(batch["labels"].max()))  # CPU copies: no device sync
    if largest >= vocab:
        raise ValueError(f"the dataset holds token id {largest} >= the model's vocabulary "
                         f"({vocab}): was it preprocessed with another --tokenizer-type?")
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    return model(tokens, labels=labels).float().mean()


def train_step(args, model, optimizer, scheduler, dataset, consumed_samples: int, device):
    """One iteration on this rank's share of the global batch starting at `consumed_samples`.

    Returns (lm loss averaged over micro-batches and DP ranks, update_successful, grad_norm).
    """
    rank, dp = dist.get_rank(), dist.get_world_size()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for m in range(args.num_micro_batches):
        batch = get_batch_for_rank(dataset, consumed_samples + m * args.micro_batch_size * dp,
                                   args.micro_batch_size, rank, dp)
        last = m == args.num_micro_batches - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = _forward_losses(model, batch, device) / args.num_micro_batches
            optimizer.scale_loss(loss).backward()
        loss_sum += loss.detach()
    model.finish_grad_sync()
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step()
    dist.all_reduce(loss_sum)
    lm_loss = loss_sum.item() / dp
    if args.check_for_nan_in_loss_and_grad and not torch.isfinite(torch.tensor(lm_loss)):
        raise RuntimeError(f"lm loss is {lm_loss} (averaged over all ranks) at this iteration")
    return lm_loss, update_successful, grad_norm


@torch.no_grad()
def evaluate(args, model, dataset, device) -> float:
    """Mean lm loss over --eval-iters global batches of the validation set (fixed samples)."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    model.eval()
    total = torch.zeros((), dtype=torch.float32, device=device)
    for i in range(args.eval_iters):
        for m in range(args.num_micro_batches):
            start = i * args.global_batch_size + m * args.micro_batch_size * dp
            total += _forward_losses(model, get_batch_for_rank(dataset, start, args.micro_batch_size, rank, dp), device)
    model.train()
    dist.all_reduce(total)
    return total.item() / (dp * args.eval_iters * args.num_micro_batches)


class MetricsWriter:
    """Rank 0: one JSON object per line (always, when a path is given) plus TensorBoard when installed."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str]):
        self.enabled = dist.get_rank() == 0
        self.file = None
        self.tb = None
        if not self.enabled:
            return
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.file = open(path, "a")
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=tensorboard_dir)
            except ImportError:
                print_rank_0("> tensorboard is not installed: writing only the JSONL metrics")

    def write(self, record: dict):
        if not self.enabled:
            return
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb:
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)) and value is not None:
                    self.tb.add_scalar(key, value, record["iteration"])

    def close(self):
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


def _mfu(flops_per_iteration: float, seconds: float, device: torch.device, dp: int) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None if peak is None else flops_per_iteration / (seconds * peak * dp)


def pretrain(args) -> dict:
    """Train per `args` (from arguments.parse_args); returns {'iteration', 'losses', 'valid_losses'}."""
    device = initialize_distributed(args)
    rank, dp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # identical initial replicas on every rank

    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, vocab_size=args.vocab_size)
    data_prefix = args.data_path
    if not args.mock_data and data_prefix is None:
        if rank == 0:  # build the built-in corpus once, then everyone opens it
            ensure_builtin_dataset(args.data_cache_path, tokenizer)
        dist.barrier()
        data_prefix = ensure_builtin_dataset(args.data_cache_path, tokenizer)
    train_ds, valid_ds = build_gpt_datasets(data_prefix, args.mock_data, args.split, args.seq_length,
                                            args.seed, tokenizer)
    config, model, optimizer, scheduler = build_model_and_optimizer(args, tokenizer.vocab_size, device)
    n_params = sum(p.numel() for p in model.module.parameters())
    print_rank_0(f"> GPT: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, "
                 f"vocab {args.padded_vocab_size}, {n_params / 1e6:.2f}M parameters | dp={dp} on {device} "
                 f"({args.distributed_backend}) | {args.num_micro_batches} micro-batches of {args.micro_batch_size}")

    iteration, consumed = 0, 0
    run_args = {k: getattr(args, k) for k in ARCHITECTURE_ARGS}
    if args.load:
        loaded = load_checkpoint(args.load, model, optimizer, scheduler, check_args=run_args)
        if loaded is None:
            print_rank_0(f"> no checkpoint found in {args.load}: training from scratch")
        else:
            iteration, consumed = loaded["iteration"], loaded["consumed_train_samples"]
            print_rank_0(f"> resumed from {args.load} at iteration {iteration} ({consumed} samples consumed)")

    metrics = MetricsWriter(args.metrics_file, args.tensorboard_dir)
    flops = num_floating_point_operations(config, args.global_batch_size, args.seq_length)
    tokens_per_iteration = args.global_batch_size * args.seq_length
    losses, valid_losses, skipped_total = {}, {}, 0
    interval_losses, interval_start, interval_skipped = [], time.perf_counter(), 0
    last_saved = iteration if args.load else None

    def save():
        save_checkpoint(args.save, iteration, model, optimizer, scheduler, consumed, args=run_args)
        print_rank_0(f"> saved checkpoint at iteration {iteration} to {args.save}")

    while iteration < args.train_iters:
        lm_loss, ok, grad_norm = train_step(args, model, optimizer, scheduler, train_ds, consumed, device)
        iteration += 1
        consumed += args.global_batch_size
        skipped_total += 0 if ok else 1
        interval_skipped += 0 if ok else 1
        losses[iteration] = lm_loss
        interval_losses.append(lm_loss)
        lr = optimizer.param_groups[0]["lr"]
        loss_scale = optimizer.get_loss_scale().item()
        metrics.write({"iteration": iteration, "consumed_samples": consumed, "lm_loss": lm_loss, "lr": lr,
                       "loss_scale": loss_scale, "grad_norm": grad_norm, "skipped": not ok})
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            elapsed = (time.perf_counter() - interval_start) / len(interval_losses)
            mfu = _mfu(flops, elapsed, device, dp)
            line = (f" iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: {consumed:12d} | "
                    f"elapsed time per iteration (ms): {elapsed * 1000:.1f} | "
                    f"throughput (tokens/s): {tokens_per_iteration / elapsed:.0f} | ")
            if mfu is not None:
                line += f"MFU: {mfu * 100:.1f}% | "
            line += (f"learning rate: {lr:.6E} | global batch size: {args.global_batch_size:5d} | "
                     f"lm loss: {sum(interval_losses) / len(interval_losses):.6E} | loss scale: {loss_scale:.1f} | ")
            if grad_norm is not None:
                line += f"grad norm: {grad_norm:.3f} | "
            line += f"number of skipped iterations: {interval_skipped:3d} |"
            print_rank_0(line)
            metrics.write({"iteration": iteration, "elapsed_ms_per_iteration": elapsed * 1000,
                           "tokens_per_s": tokens_per_iteration / elapsed, **({"mfu": mfu} if mfu else {})})
            interval_losses, interval_start, interval_skipped = [], time.perf_counter(), 0
        if valid_ds is not None and args.eval_iters > 0 and (
                iteration % args.eval_interval == 0 or iteration == args.train_iters):
            valid = evaluate(args, model, valid_ds, device)
            valid_losses[iteration] = valid
            ppl = float("inf") if valid > 80 else float(torch.tensor(valid).exp())
            print_rank_0("-" * 100 + f"\n validation loss at iteration {iteration} | lm loss value: {valid:.6E} | "
                         f"lm loss PPL: {ppl:.6E} |\n" + "-" * 100)
            metrics.write({"iteration": iteration, "valid_lm_loss": valid, "valid_ppl": ppl})
            interval_start = time.perf_counter()  # keep evaluation out of the per-iteration time
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save()
            last_saved = iteration
            interval_start = time.perf_counter()
        if args.exit_interval and iteration % args.exit_interval == 0:
            print_rank_0(f"> exiting at iteration {iteration} (--exit-interval {args.exit_interval})")
            break
    if args.save and last_saved != iteration:
        save()
    metrics.close()
    return {"iteration": iteration, "losses": losses, "valid_losses": valid_losses, "skipped": skipped_total}
