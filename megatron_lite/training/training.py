"""The generic pre-training run (Megatron's pretrain): providers in, a trained and checkpointed model out.

    pretrain(args, train_valid_test_datasets_provider, model_provider, forward_step_func)
      initialize_megatron           process group, device, seed, tokenizer      (initialize.py)
      lock_save_directory           --save: this job's alone until the end      (checkpointing/save.py)
      datasets, model               the providers (pretrain_gpt.py)
      setup_model_and_optimizer     DDP(model), get_megatron_optimizer, OptimizerParamScheduler
      resume                        --load and its options                      (checkpointing/load.py)
      TrainingLoop.run              train_step -> last words staged -> TrainingLog -> evaluate ->
                                    save_checkpoint -> --exit-interval          (loop.py)
            (a failure anywhere in it: this rank's last words, checkpointing/last_words.py)

Live recovery (fault_tolerance/live_training.py) starts its first generation with the same pieces
(setup_model_and_optimizer, resume, check_train_data) and runs the same TrainingLoop.
"""

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..checkpointing import load_checkpoint, lock_save_directory, refuse_to_shadow
from ..checkpointing.files import unlock_save_directory
from ..checkpointing.save import architecture_args
from ..data.tokenizer import check_trained_eod
from ..distributed import DistributedDataParallel, collectives
from ..optimizer import get_megatron_optimizer
from .arguments import as_flags, ddp_config_from_args, optimizer_config_from_args
from .initialize import initialize_megatron
from .loop import TrainingLoop
from .metrics import print_rank_0
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
        loaded = collectives.run_collectively(load_checkpoint, directory, model, optimizer, scheduler, None, check,
                                              policy, finetune, not args.no_load_optim, not args.no_load_rng)
        if loaded is not None and not finetune:  # the same args on every rank: all raise
            check_trained_eod(loaded["args"], args.tokenizer_type, args.tokenizer_model, args.eod,
                              f"--load {loaded['path']}", remedy=", or start a new run from its weights with "
                                                                 "--finetune")
        return loaded

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
    if args.save:  # one job per --save directory, from before anything is read or written there
        lock_save_directory(args.save)
    if args.preset_values:
        print_rank_0(f"> --model-preset {args.model_preset} set the flags not given: {as_flags(args.preset_values)}")
    # A failure on any rank (say rank 0 cannot build the data) stops every rank now, not at a timeout.
    train_ds, valid_ds, _ = collectives.run_collectively(train_valid_test_datasets_provider, args, tokenizer)
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, args, device)
    n_params = sum(p.numel() for p in model.module.parameters())
    print_rank_0(f"> {n_params / 1e6:.2f}M parameters | dp={dist.get_world_size()} on {device} "
                 f"({args.distributed_backend}) | {args.num_micro_batches} micro-batches of {args.micro_batch_size}")

    iteration, consumed, loaded = resume(args, model, optimizer, scheduler)
    check_train_data(args, train_ds, iteration, consumed)
    loop = TrainingLoop(args, forward_step_func, model, optimizer, scheduler, train_ds, valid_ds, device,
                        flops_per_iteration, iteration, consumed, last_saved=iteration if loaded else None)
    try:
        loop.run()
    except BaseException as e:  # a lost peer, this rank's own error, SIGTERM: leave the last words
        loop.write_last_words(e)
        raise
    finally:
        loop.drop_last_words()
    loop.log.close()
    history = loop.history
    return {"iteration": loop.iteration, "losses": history.losses, "valid_losses": history.valid_losses,
            "skipped": history.skipped}
