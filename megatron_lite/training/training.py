"""The generic pre-training loop (Megatron's pretrain): providers in, a trained and checkpointed model out.

    pretrain(args, train_valid_test_datasets_provider, model_provider, forward_step_func)
      initialize_megatron           process group, device, seed, tokenizer      (initialize.py)
      lock_save_directory           --save: this job's alone until the end      (checkpointing/save.py)
      datasets, model               the providers (pretrain_gpt.py)
      setup_model_and_optimizer     DDP(model), get_megatron_optimizer, OptimizerParamScheduler
      load_checkpoint               with --load                                 (checkpointing/load.py)
      loop: train_step -> TrainingLog -> evaluate -> save_checkpoint -> --exit-interval
            (a failure anywhere in it: this rank's last words, checkpointing/last_words.py)

One iteration (train_step)::

    model.zero_grad_buffer(); optimizer.zero_grad()
    data = read_micro_batches(...)                  # on every rank at once: a rank whose data fails (an id
                                                    # out of the vocabulary, the data running out) stops all
    for each of this rank's micro-batches:          # all but the last under model.no_sync()
        output, loss_func = forward_step_func(data, model)
        loss, num_tokens, reported = loss_func(output)   # loss: sum over the unmasked tokens
        loss = loss / num_tokens / num_micro_batches      # (kept a sum with calculate_per_token_loss)
        optimizer.scale_loss(loss).backward()       # with overlap, buckets reduce here
    model.finish_grad_sync()                        # main_grad = data-parallel mean (per-token: sum)
    reported values: summed over micro-batches and data-parallel ranks (one all-reduce, which also carries
                     the token count; with check_for_nan_in_loss a NaN/Inf on any rank stops every rank
                     here, before the update); per-token loss: model.scale_gradients(1 / global tokens)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful: scheduler.step()
"""

import contextlib
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist

from ..checkpointing import (
    LastWords,
    checkpoint_args,
    load_checkpoint,
    lock_save_directory,
    refuse_to_shadow,
    save_checkpoint,
)
from ..checkpointing.files import unlock_save_directory
from ..checkpointing.save import architecture_args
from ..data import micro_batch_iterator
from ..distributed import DistributedDataParallel, collectives
from ..optimizer import get_megatron_optimizer
from .arguments import as_flags, ddp_config_from_args, optimizer_config_from_args
from .initialize import initialize_megatron
from .metrics import TrainingLog, print_rank_0
from .scheduler import OptimizerParamScheduler


def setup_model_and_optimizer(model_provider: Callable, args, device: torch.device):
    """The provider's model on `device`, wrapped in DistributedDataParallel, its optimizer and scheduler. A
    model the provider built on the meta device (--init-model-with-meta-device) is materialized by the wrapper,
    directly on `device` and only what this rank holds."""
    module = model_provider(args)
    on_meta = any(p.is_meta for p in module.parameters())
    model = DistributedDataParallel(module if on_meta else module.to(device), ddp_config_from_args(args),
                                    init_device=device)
    optimizer = get_megatron_optimizer(optimizer_config_from_args(args), [model])
    scheduler = OptimizerParamScheduler(optimizer, args.lr, args.min_lr, args.lr_warmup_iters,
                                        args.lr_decay_iters, args.lr_decay_style)
    return model, optimizer, scheduler


def _accumulate(sums: Dict[str, torch.Tensor], reported: dict, divisor: int = 1):
    """Add one micro-batch's reported values: a pair [sum, count] (Megatron's token-weighted form) is summed
    as it is; a scalar is divided by `divisor` (the mean over micro-batches)."""
    for key, value in reported.items():
        value = value if value.numel() == 2 else value / divisor
        sums[key] = sums.get(key, 0) + value


def _reduce_over_ranks(sums: Dict[str, torch.Tensor], group, ranks_divisor: int, extra: Optional[torch.Tensor] = None,
                       check_finite: bool = False):
    """One all-reduce over the data-parallel ranks of every reported value (plus `extra`, e.g. a token
    count, and with `check_finite` a flag per rank). Pairs become sum / count, scalars sum / ranks_divisor.
    Every rank raises together on a NaN/Inf and names the ranks it came from.

    Returns:
        ({key: float}, the reduced `extra` or None)
    """
    parts = [value.reshape(-1).float() for value in sums.values()]
    if extra is not None:
        parts.append(extra.reshape(1).float())
    if not parts:
        return {}, None
    values = torch.cat(parts)
    flags = torch.zeros(dist.get_world_size(group), dtype=values.dtype, device=values.device)
    if check_finite:
        flags[dist.get_rank(group)] = float(not torch.isfinite(values).all())
    reduced = torch.cat([values, flags])
    collectives.all_reduce(reduced, group)
    totals = reduced[:len(values)].tolist()
    bad_ranks = [r for r, flag in enumerate(reduced[len(values):].tolist()) if flag]
    averages, i = {}, 0
    for key, value in sums.items():
        if value.numel() == 2:
            averages[key], i = totals[i] / max(totals[i + 1], 1.0), i + 2
        else:
            averages[key], i = totals[i] / ranks_divisor, i + 1
    if bad_ranks:
        local = {key: value.tolist() for key, value in sums.items()}
        raise RuntimeError(f"check_for_nan_in_loss: the loss is not finite on data-parallel rank(s) {bad_ranks} "
                           f"(this rank's micro-batch sums: {local}; over all ranks: {averages})")
    return averages, (totals[-1] if extra is not None else None)


def read_micro_batches(data_iterator, count: int, group) -> Optional[Iterator]:
    """The next `count` micro-batches of `data_iterator` (None: None), read on every rank of `group` at once,
    as an iterator for forward_step: reading past them is a RuntimeError naming forward_step's contract.

    A rank whose read fails (a sample with a token id outside the vocabulary, a damaged file, the data running
    out) raises its error and every other rank a RuntimeError naming it, here, before the iteration's first
    collective: otherwise the others would go on into a gradient reduction and die there seconds later of a
    lost connection. Costs one small all-reduce (collectives.run_collectively); the messages are gathered only
    after a failure.
    """
    if data_iterator is None:
        return None
    batches = collectives.run_collectively(lambda: [next(data_iterator) for _ in range(count)], group=group,
                                           what="reading the data", group_name="data-parallel")
    return _exactly(batches)


def _exactly(batches: list) -> Iterator:
    yield from batches
    # A bare StopIteration out of train_step would name nothing.
    raise RuntimeError(f"forward_step read more than the {len(batches)} micro-batch(es) read for it: it must take "
                       f"one micro-batch per call, as Megatron's forward_step does (one next(data_iterator))")


def train_step(forward_step_func: Callable, data_iterator, model, optimizer, scheduler, num_micro_batches: int,
               check_for_nan_in_loss: bool = False, before_update: Optional[Callable] = None):
    """One iteration on this rank's share of the global batch (see the module docstring).

    The loss function returns (loss, reported) with loss a mean, or Megatron's (loss sum, number of tokens,
    reported). With the latter the loss is divided by the micro-batch's tokens and by the number of
    micro-batches, unless the model was wrapped with calculate_per_token_loss: then the gradients (summed
    over ranks) are divided by the number of tokens in the whole global batch, after the reduction.

    `before_update(losses)`, if given, runs after the gradients and losses are reduced, just before
    optimizer.step(), with the reduced losses (the last-words and live-recovery records of the iteration are
    staged there).

    Returns:
        (reported losses averaged over micro-batches and data-parallel ranks, update_successful, grad_norm)
    """
    per_token = model.ddp_config.calculate_per_token_loss
    group = model.data_parallel_group
    data = read_micro_batches(data_iterator, num_micro_batches, group)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    sums: Dict[str, torch.Tensor] = {}
    tokens = None
    for m in range(num_micro_batches):
        last = m == num_micro_batches - 1
        with contextlib.nullcontext() if last else model.no_sync():  # only the last one communicates
            output, loss_func = forward_step_func(data, model)
            outputs = loss_func(output)
            if len(outputs) == 3:
                loss, num_tokens, reported = outputs
                tokens = num_tokens if tokens is None else tokens + num_tokens
                if not per_token:
                    loss = loss / num_tokens.clamp(min=1) / num_micro_batches
            else:
                if per_token:
                    raise ValueError("calculate_per_token_loss needs a loss function that returns (loss sum, "
                                     "number of tokens, reported values)")
                loss, reported = outputs
                loss = loss / num_micro_batches
            optimizer.scale_loss(loss).backward()
        _accumulate(sums, reported, num_micro_batches)
    model.finish_grad_sync()
    # a NaN loss stops every rank here, before the update
    losses, total_tokens = _reduce_over_ranks(sums, group, dist.get_world_size(group),
                                              tokens if per_token else None, check_for_nan_in_loss)
    if per_token:
        model.scale_gradients(1.0 / max(total_tokens, 1.0))  # the mean over every token of the global batch
    if before_update is not None:
        before_update(losses)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step()
    return losses, update_successful, grad_norm


@torch.no_grad()
def evaluate(forward_step_func: Callable, data_iterator, model, num_micro_batches: int,
             read_ahead: int = 1) -> Dict[str, float]:
    """Mean of the reported losses over `num_micro_batches` micro-batches per rank and over all ranks
    (token-weighted for reported [sum, count] pairs). The micro-batches are read `read_ahead` at a time on
    every rank at once (read_micro_batches)."""
    model.eval()
    group = model.data_parallel_group
    sums: Dict[str, torch.Tensor] = {}
    for start in range(0, num_micro_batches, read_ahead):
        count = min(read_ahead, num_micro_batches - start)
        data = read_micro_batches(data_iterator, count, group)
        for _ in range(count):
            output, loss_func = forward_step_func(data, model)
            _accumulate(sums, loss_func(output)[-1])
    model.train()
    return _reduce_over_ranks(sums, group, dist.get_world_size(group) * num_micro_batches)[0]


def evaluation_due(args, iteration: int, valid_ds) -> bool:
    """Whether pretrain() evaluates after `iteration`: every --eval-interval and after the last iteration, when
    there is a validation set and --eval-iters > 0."""
    return valid_ds is not None and args.eval_iters > 0 and (
        iteration % args.eval_interval == 0 or iteration == args.train_iters)


def evaluate_validation(forward_step_func: Callable, valid_ds, model, args) -> Dict[str, float]:
    """The validation losses: always the first --eval-iters global batches, so that successive evaluations
    measure the same text."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    valid_iterator = micro_batch_iterator(valid_ds, 0, args.micro_batch_size, rank, dp, getattr(args, "num_workers", 0))
    return evaluate(forward_step_func, valid_iterator, model, args.eval_iters * args.num_micro_batches,
                    read_ahead=args.num_micro_batches)


def save_due(args, iteration: int) -> bool:
    """Whether --save-interval asks for a periodic checkpoint at `iteration`."""
    return bool(args.save and args.save_interval and iteration % args.save_interval == 0)


def open_training_log(args, device, dp: int, flops: Optional[float]) -> TrainingLog:
    """The TrainingLog, made on every rank at once (collective): outputs rank 0 (their writer) cannot open
    stop every rank with a ValueError naming the flags, not rank 0 alone."""
    def make():
        try:
            return TrainingLog(args, device, dp, flops)
        except OSError as e:
            raise ValueError(f"the metrics outputs (--metrics-file {args.metrics_file}, --tensorboard-dir "
                             f"{args.tensorboard_dir}) cannot be written: {type(e).__name__}: {e}") from e
    return collectives.run_collectively(make)


def check_train_data(args, train_ds, iteration: int, consumed: int):
    """The data is sized for a fresh run (--train-iters x --global-batch-size samples, Megatron's count): a resume
    with a smaller global batch than the checkpoint's run would end past it. A ValueError now (the same on every
    rank), not a StopIteration in the middle of an iteration. A run with nothing left to train needs no data."""
    if iteration >= args.train_iters:
        return
    needed = consumed + (args.train_iters - iteration) * args.global_batch_size
    if len(train_ds) < needed:
        raise ValueError(f"the train data holds {len(train_ds)} samples, but resuming at {consumed} consumed samples "
                         f"the iterations {iteration + 1}..{args.train_iters} of --global-batch-size "
                         f"{args.global_batch_size} need {needed} (the data holds about --train-iters x "
                         f"--global-batch-size samples, Megatron's count): resume with the checkpoint's "
                         f"--global-batch-size ({consumed // iteration if iteration else '?'} if it never changed)")


def resume(args, model, optimizer, scheduler):
    """--load and its options (--finetune, --no-load-optim, --no-load-rng, --override-opt_param-scheduler,
    --use-checkpoint-opt-param-scheduler, --exit-on-missing-checkpoint), --pretrained-checkpoint where --load
    holds no checkpoint (fine-tuned from, as --finetune), then the --save directory checked
    against what was loaded (refuse_to_shadow): the start of pretrain() and of the live loop. Collective.

    Returns:
        (iteration, consumed samples, the load's record or None)
    """
    iteration, consumed = 0, 0
    loaded = None
    policy = ("override" if args.override_opt_param_scheduler else
              "checkpoint" if args.use_checkpoint_opt_param_scheduler else "check")

    def load(directory, finetune):
        check = architecture_args(args)
        if not finetune:  # the embedding rows mean the checkpoint's tokens (Megatron compares it too);
            check["tokenizer_type"] = args.tokenizer_type  # a fine-tuning may bring another tokenizer on purpose
        return collectives.run_collectively(load_checkpoint, directory, model, optimizer, scheduler, None, check,
                                            policy, finetune, not args.no_load_optim, not args.no_load_rng)

    if args.load:
        loaded = load(args.load, args.finetune)
        if loaded is None and args.exit_on_missing_checkpoint:
            raise SystemExit(f"--exit-on-missing-checkpoint: no checkpoint in {args.load}")
        if loaded is None and args.finetune:  # every rank found the same (load_checkpoint agrees): all raise
            raise ValueError(f"--finetune: no checkpoint in --load {args.load} to fine-tune from (it would train "
                             "randomly initialised weights): give the directory of the pretrained checkpoints")
        if loaded is None and not args.pretrained_checkpoint:
            print_rank_0(f"> no checkpoint found in {args.load}: training from scratch")
    if loaded is None and args.pretrained_checkpoint:  # the fine-tuning's start (no checkpoint of its own yet)
        loaded = load(args.pretrained_checkpoint, True)
        if loaded is None:
            raise ValueError(f"--pretrained-checkpoint {args.pretrained_checkpoint} holds no checkpoint (nor does "
                             f"--load {args.load}): nothing to fine-tune from")
    if loaded is not None and loaded["finetune"]:
        print_rank_0(f"> {'--finetune' if args.finetune else '--pretrained-checkpoint'}: model weights from "
                     f"{loaded['path']} (iteration {loaded['checkpoint_iteration']}); fresh optimizer, schedule and "
                     "RNG, from iteration 0")
    elif loaded is not None:
        iteration, consumed = loaded["iteration"], loaded["consumed_train_samples"]
        if iteration > args.train_iters:  # nothing to train: the run would exit 0 without a word
            raise ValueError(f"--train-iters {args.train_iters} is below the checkpoint's iteration {iteration} "
                             f"({loaded['path']}): --train-iters counts from the start of training; give a "
                             f"larger one to continue (or --finetune to start a new run from its weights)")
        fresh = [what for what, flag in (("optimizer and schedule", args.no_load_optim),
                                         ("RNG", args.no_load_rng)) if flag]
        print_rank_0(f"> resumed from {loaded['path']} at iteration {iteration} ({consumed} samples consumed)"
                     + (f"; fresh {' and '.join(fresh)} (--no-load-*)" if fresh else "")
                     + ("; nothing left to train (--train-iters)" if iteration == args.train_iters else ""))
    if args.save:  # every rank stops, also where only rank 0 (the writer) can see the directory
        collectives.run_collectively(refuse_to_shadow, args.save, loaded)
    return iteration, consumed, loaded


def pretrain(args, train_valid_test_datasets_provider: Callable, model_provider: Callable,
             forward_step_func: Callable, flops_per_iteration: Optional[Callable] = None) -> dict:
    """Train per `args` (from arguments.parse_args) with Megatron's providers.

    Args:
        train_valid_test_datasets_provider: (args, tokenizer) -> (train, valid or None, test or None),
            datasets indexable by global sample index.
        model_provider: (args) -> the model (an nn.Module in its params dtype; pretrain moves and wraps it).
        forward_step_func: (data_iterator, model) -> (output, loss_func); loss_func(output) -> (loss sum,
            number of tokens, {name: [sum, count] to report}) as in Megatron, or (mean loss, {name: value}).
        flops_per_iteration: (args) -> model FLOPs of one iteration, for MFU (optional).
    Returns:
        {'iteration', 'losses': {iteration: reported losses}, 'valid_losses', 'skipped'}
    Raises:
        ValueError (RuntimeError on the other ranks) when another job holds the --save directory: rank 0
        locks it from the start to the end of the run (checkpointing.lock_save_directory).
    """
    try:
        return _pretrain(args, train_valid_test_datasets_provider, model_provider, forward_step_func,
                         flops_per_iteration)
    finally:
        if args.save:  # held by rank 0 (a no-op on the others); a process that dies releases it too
            unlock_save_directory(args.save)


def _pretrain(args, train_valid_test_datasets_provider: Callable, model_provider: Callable,
              forward_step_func: Callable, flops_per_iteration: Optional[Callable]) -> dict:
    """pretrain()'s run, inside the --save directory's lock."""
    device, tokenizer = initialize_megatron(args)
    rank, dp = dist.get_rank(), dist.get_world_size()
    if args.save:  # one job per --save directory, from before anything is read or written there
        lock_save_directory(args.save)
    if args.preset_values:
        print_rank_0(f"> --model-preset {args.model_preset} set the flags not given: {as_flags(args.preset_values)}")
    # A failure on any rank (say rank 0 cannot build the data) stops every rank now, not at a timeout.
    train_ds, valid_ds, _ = collectives.run_collectively(train_valid_test_datasets_provider, args, tokenizer)
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, args, device)
    n_params = sum(p.numel() for p in model.module.parameters())
    print_rank_0(f"> {n_params / 1e6:.2f}M parameters | dp={dp} on {device} ({args.distributed_backend}) | "
                 f"{args.num_micro_batches} micro-batches of {args.micro_batch_size}")

    iteration, consumed, loaded = resume(args, model, optimizer, scheduler)
    last_saved = iteration if loaded else None
    check_train_data(args, train_ds, iteration, consumed)

    # --async-save: DCP writes in a background thread, with a process group of its own (its collectives
    # must not interleave with training's); the next save, or the end of training, waits for it.
    async_group = dist.new_group(backend="gloo") if args.async_save else None
    pending = []  # the asynchronous save in flight, if any

    def wait_for_pending_save():
        for saving in pending:
            saving.wait()
            print_rank_0(f"> checkpoint at iteration {saving.iteration} complete in {args.save}")
        pending.clear()

    def save():
        wait_for_pending_save()
        saving = save_checkpoint(args.save, iteration, model, optimizer, scheduler, consumed,
                                 args=checkpoint_args(args), ckpt_format=args.ckpt_format, async_group=async_group)
        if saving is None:
            print_rank_0(f"> saved checkpoint at iteration {iteration} to {args.save}")
        else:
            pending.append(saving)
            print_rank_0(f"> saving checkpoint at iteration {iteration} to {args.save} in the background")

    workers = getattr(args, "num_workers", 0)  # DataLoader worker processes (--num-workers)
    train_iterator = micro_batch_iterator(train_ds, consumed, args.micro_batch_size, rank, dp, workers)
    log = open_training_log(args, device, dp, flops_per_iteration(args) if flops_per_iteration else None)
    losses, valid_losses, skipped = {}, {}, 0
    # If this job dies, each survivor writes its part of the last completed iteration (checkpointing/last_words.py).
    words = LastWords(args.save, optimizer, scheduler, iteration, consumed, checkpoint_args(args)) \
        if args.save and args.last_words else None
    if words is not None:
        words.install()
    try:
        while iteration < args.train_iters:
            stage = (lambda _: words.stage(iteration + 1, consumed + args.global_batch_size)) if words else None
            reported, ok, grad_norm = train_step(forward_step_func, train_iterator, model, optimizer, scheduler,
                                                 args.num_micro_batches, args.check_for_nan_in_loss_and_grad, stage)
            iteration += 1
            consumed += args.global_batch_size
            if words is not None:
                words.commit()
            skipped += 0 if ok else 1
            losses[iteration] = reported
            log.training(iteration, consumed, reported, optimizer.param_groups[0]["lr"],
                         optimizer.get_loss_scale().item(), grad_norm, ok)
            if evaluation_due(args, iteration, valid_ds):
                valid_losses[iteration] = evaluate_validation(forward_step_func, valid_ds, model, args)
                log.validation(iteration, valid_losses[iteration])
            if save_due(args, iteration):
                save()
                last_saved = iteration
                log.restart_timer()
            if args.exit_interval and iteration % args.exit_interval == 0:
                print_rank_0(f"> exiting at iteration {iteration} (--exit-interval {args.exit_interval})")
                break
        if args.save and last_saved != iteration:
            save()
        wait_for_pending_save()
    except BaseException as e:  # a lost peer, this rank's own error, SIGTERM: leave the last words
        if words is not None:
            words.write(f"{type(e).__name__}: {e}")
        raise
    finally:
        if words is not None:
            words.uninstall()
    log.close()
    return {"iteration": iteration, "losses": losses, "valid_losses": valid_losses, "skipped": skipped}
