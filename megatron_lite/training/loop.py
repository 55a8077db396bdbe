"""The training loop: one iteration's body, the same for pretrain() and for live recovery.

    TrainingLoop.run()
      while iteration < --train-iters:
        train_iteration()
          train_step                  forward/backward, gradient reduction, optimizer.step() (below)
            before_update:            LastWords.stage: the record of the iteration about to complete
                                      -> hooks.before_update(losses)
          (train_step raised)         -> hooks.step_failed()
          iteration += 1              LastWords.commit          -> hooks.iteration_completed(...)
          log_iteration               TrainingLog.training      -> hooks.iteration_logged(iteration)
          evaluate, if due            TrainingLog.validation    -> hooks.iteration_evaluated(iteration)
          save, if due                save_checkpoint (--async-save: in the background)
                                      -> hooks.iteration_ended(iteration)
        --exit-interval: stop
      save the last iteration unless saved

pretrain() (training.py) runs it once; live recovery (fault_tolerance/live_training.py) runs it once per
generation and keeps what is its own (forming, healing, catching up, leaving) outside, reaching the loop
through LoopHooks: the record a survivor snapshots is staged and committed where the last words' is, and
rank 0 notes in the supervisor's store what it logged and evaluated. Writing the last words when the run
dies is the caller's (pretrain's except, pretrain_live's).

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
    before_update(losses)                           # the iteration's records staged
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful: scheduler.step()
"""

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist

from ..checkpointing import LastWords, checkpoint_args, save_checkpoint
from ..data import micro_batch_iterator
from ..distributed import collectives
from .metrics import TrainingLog, print_rank_0


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
    """Whether the loop evaluates after `iteration`: every --eval-interval and after the last iteration, when
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


def _nothing(*args):
    pass


@dataclass
class LoopHooks:
    """Where a run around the loop follows it (live recovery: fault_tolerance/live_training.py); each does
    nothing by default. The loop's own state (iteration, consumed, last_saved, log) is read from the loop."""

    before_update: Callable = _nothing
    """(losses): just before optimizer.step(), after LastWords.stage; the iteration's reduced losses."""
    step_failed: Callable = _nothing
    """(): train_step raised (its update may or may not have been applied)."""
    iteration_completed: Callable = _nothing
    """(losses, grad_norm, update_successful): the iteration counted and committed, before its log line."""
    iteration_logged: Callable = _nothing
    """(iteration): after its log record."""
    iteration_evaluated: Callable = _nothing
    """(iteration): after its validation losses were logged."""
    iteration_ended: Callable = _nothing
    """(iteration): after its periodic save, before --exit-interval."""


@dataclass
class History:
    """What the loop reports: {iteration: reported losses}, {iteration: validation losses}, updates skipped
    (fp16's loss scaler). Live recovery carries one across its generations."""

    losses: Dict[int, Dict[str, float]] = field(default_factory=dict)
    valid_losses: Dict[int, Dict[str, float]] = field(default_factory=dict)
    skipped: int = 0


class TrainingLoop:
    """The iterations from `iteration` to --train-iters (see the module docstring).

    Making it makes the train iterator (--num-workers: its DataLoader processes start), then opens the
    TrainingLog (collective; its timer starts) and, with --save and --last-words, this rank's LastWords with
    its SIGTERM watcher (LastWords.install).

    Args:
        args: from arguments.parse_args (a live generation's: fault_tolerance.elastic.generation_args).
        forward_step_func: as pretrain()'s.
        model, optimizer, scheduler: from setup_model_and_optimizer, at `iteration`.
        train_ds, valid_ds: the datasets (valid_ds None: no evaluation).
        device, flops_per_iteration: for the log's MFU ((args) -> FLOPs, or None).
        iteration, consumed, last_saved: where training stands (last_saved: the iteration of the checkpoint
            it was loaded from or saved last, None if none).
        hooks: LoopHooks (default: none).
        history: where the losses go (default: a new History).
    """

    def __init__(self, args, forward_step_func: Callable, model, optimizer, scheduler, train_ds, valid_ds,
                 device: torch.device, flops_per_iteration: Optional[Callable], iteration: int, consumed: int,
                 last_saved: Optional[int], hooks: Optional[LoopHooks] = None, history: Optional[History] = None):
        self.args, self.forward_step_func = args, forward_step_func
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.valid_ds = valid_ds
        self.iteration, self.consumed, self.last_saved = iteration, consumed, last_saved
        self.hooks = hooks or LoopHooks()
        self.history = history if history is not None else History()
        # --async-save: DCP writes in a background thread, with a process group of its own (its collectives
        # must not interleave with training's); the next save, or the end of training, waits for it.
        self.async_group = dist.new_group(backend="gloo") if args.async_save else None
        self.pending = []  # the asynchronous save in flight, if any
        # This rank's micro-batches from the consumed samples, made before the log starts its timer: with
        # --num-workers the DataLoader's worker processes start here, which is not training time.
        self.train_iterator = micro_batch_iterator(train_ds, consumed, args.micro_batch_size, dist.get_rank(),
                                                   dist.get_world_size(), getattr(args, "num_workers", 0))
        self.log = open_training_log(args, device, dist.get_world_size(),
                                     flops_per_iteration(args) if flops_per_iteration else None)
        # If this job dies, each survivor writes its part of the last completed iteration (checkpointing/last_words.py).
        self.words = LastWords(args.save, optimizer, scheduler, iteration, consumed, checkpoint_args(args)) \
            if args.save and args.last_words else None
        if self.words is not None:
            # SIGTERM (torchrun or the live supervisor stopping the job): this rank's last words, written from
            # LastWords' watcher wherever the loop is (a collective included).
            self.words.install()

    def run(self):
        """Train to --train-iters (or --exit-interval), then save the last iteration unless it is saved."""
        args = self.args
        while self.iteration < args.train_iters:
            self.train_iteration()
            if args.exit_interval and self.iteration % args.exit_interval == 0:
                print_rank_0(f"> exiting at iteration {self.iteration} (--exit-interval {args.exit_interval})")
                break
        if args.save and self.last_saved != self.iteration:
            self.save()
        self.wait_for_pending_save()

    def train_iteration(self):
        """One iteration: train_step, its records staged and committed, its log line, its evaluation and its
        periodic save."""
        args, words = self.args, self.words

        def before_update(losses):
            if words is not None:
                words.stage(self.iteration + 1, self.consumed + args.global_batch_size)
            self.hooks.before_update(losses)
        try:
            reported, ok, grad_norm = train_step(self.forward_step_func, self.train_iterator, self.model,
                                                 self.optimizer, self.scheduler, args.num_micro_batches,
                                                 args.check_for_nan_in_loss_and_grad, before_update)
        except BaseException:
            self.hooks.step_failed()
            raise
        self.iteration += 1
        self.consumed += args.global_batch_size
        if words is not None:
            words.commit()
        self.history.skipped += 0 if ok else 1
        self.hooks.iteration_completed(reported, grad_norm, ok)
        self.log_iteration(reported, grad_norm, ok)
        self.hooks.iteration_logged(self.iteration)
        if evaluation_due(args, self.iteration, self.valid_ds):
            self.evaluate()
            self.hooks.iteration_evaluated(self.iteration)
        if save_due(args, self.iteration):
            self.save()
            self.log.restart_timer()  # the save's time is not training time
        self.hooks.iteration_ended(self.iteration)

    def log_iteration(self, losses: Dict[str, float], grad_norm: Optional[float], update_successful: bool,
                      timed: bool = True, write: bool = True):
        """The current iteration's losses into the history and its record into the log (TrainingLog.training:
        `timed`, `write`)."""
        self.history.losses[self.iteration] = losses
        self.log.training(self.iteration, self.consumed, losses, self.optimizer.param_groups[0]["lr"],
                          self.optimizer.get_loss_scale().item(), grad_norm, update_successful, timed, write)

    def evaluate(self):
        """The validation losses at the current iteration, into the history and the log."""
        losses = evaluate_validation(self.forward_step_func, self.valid_ds, self.model, self.args)
        self.history.valid_losses[self.iteration] = losses
        self.log.validation(self.iteration, losses)

    def save(self):
        """A checkpoint of the current iteration in --save (--async-save: written in the background)."""
        args = self.args
        self.wait_for_pending_save()
        saving = save_checkpoint(args.save, self.iteration, self.model, self.optimizer, self.scheduler, self.consumed,
                                 args=checkpoint_args(args), ckpt_format=args.ckpt_format, async_group=self.async_group)
        self.last_saved = self.iteration
        if saving is None:
            print_rank_0(f"> saved checkpoint at iteration {self.iteration} to {args.save}")
        else:
            self.pending.append(saving)
            print_rank_0(f"> saving checkpoint at iteration {self.iteration} to {args.save} in the background")

    def wait_for_pending_save(self):
        for saving in self.pending:
            saving.wait()
            print_rank_0(f"> checkpoint at iteration {saving.iteration} complete in {self.args.save}")
        self.pending.clear()

    def write_last_words(self, error: BaseException):
        """This rank's last words after `error` (a lost peer, its own error, SIGTERM), with --last-words."""
        if self.words is not None:
            self.words.write(f"{type(error).__name__}: {error}")

    def drop_last_words(self):
        """No last words wanted any more (write_last_words then writes none): SIGTERM goes back to the
        process's own handler."""
        if self.words is not None:
            self.words.uninstall()
        self.words = None
