"""The checkpoint flags of pretrain_gpt.py (Megatron-LM's names) and the combinations they refuse.

    --save, --save-interval, --ckpt-format, --async-save    what is written, when and how
    --last-words                                            what the survivors of a failure write
    --load, --exit-on-missing-checkpoint, --finetune,       what a resume takes from the checkpoint
    --pretrained-checkpoint, --no-load-optim, --no-load-rng,
    --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler
    --exit-interval                                         stop, after saving, at a multiple of N

`add_checkpoint_arguments` adds them to the "logging, evaluation and checkpoints" group (after the logging
flags, where --help lists them); `check_checkpoint_args` is called by validate_args. The checkpoints
themselves are megatron_lite.checkpointing's.
"""

import argparse
import os

from ..checkpointing.files import MANIFEST_FILENAME, TRACKER_FILENAME
from ..checkpointing.foreign import describe_foreign


def add_checkpoint_arguments(g: argparse._ArgumentGroup) -> None:
    """Adds the flags to `g`, the "logging, evaluation and checkpoints" group."""
    g.add_argument("--save", help="checkpoint directory")
    g.add_argument("--save-interval", type=int, help="iterations between checkpoints (and one at the end)")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default="torch_dist",
                   help="torch_dist: every rank writes only what it owns through torch.distributed.checkpoint; "
                        "torch: the optimizer state gathered and one file written by rank 0 (small runs). Both "
                        "reshard across DP sizes and strategies; loading reads either")
    g.add_argument("--async-save", action="store_true",
                   help="with --ckpt-format torch_dist: write checkpoints in the background while training goes "
                        "on (the next save and the end of training wait for it; a checkpoint exists only once "
                        "complete)")
    g.add_argument("--last-words", action=argparse.BooleanOptionalAction, default=True,
                   help="with --save: when a rank dies (an error, a lost peer, torchrun's SIGTERM), every survivor "
                        "writes its part of the last completed iteration to SAVE/last_words/ without any collective; "
                        "--load takes that set when it is complete (with --num-distributed-optimizer-instances > 1 "
                        "every shard survives a single failure) and newer than the periodic checkpoints "
                        "(docs/fault_tolerance.md)")
    g.add_argument("--load", help="resume from the newest complete checkpoint in this directory (if any)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop with an error when the directory holds no checkpoint, instead of "
                        "training from scratch")
    g.add_argument("--finetune", action="store_true",
                   help="with --load: load the model weights only (not the optimizer state, the learning-rate "
                        "schedule or the RNG state) and start a new run at iteration 0, with the data from the "
                        "beginning (Megatron's --finetune); save into another directory than the checkpoint's")
    g.add_argument("--pretrained-checkpoint",
                   help="fine-tune from the newest checkpoint in this directory (weights only, from iteration 0, "
                        "as --finetune) while --load holds no checkpoint yet; once it holds one (the fine-tuning's "
                        "own, after a restart) resume from that as usual. With --load and --save the same "
                        "directory, a fine-tuning job can be restarted (Megatron's --pretrained-checkpoint)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="with --load: do not load the optimizer state (moments, step counts, loss scale) nor, as "
                        "in Megatron, the learning-rate schedule's position: both start fresh (its warmup "
                        "included) while the iteration count and the data position continue")
    g.add_argument("--no-load-rng", action="store_true",
                   help="with --load: do not restore the RNG state (dropout and other random draws go on as in a "
                        "fresh start from --seed)")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on resume, use this run's learning-rate schedule and optimizer hyperparameters where "
                        "the checkpoint's differ (default: a difference is an error)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on resume, take the learning-rate schedule and optimizer hyperparameters from the "
                        "checkpoint where they differ from this run's")
    g.add_argument("--exit-interval", type=int, help="stop (after saving) once iteration %% N == 0")


def check_checkpoint_args(args):
    """The checkpoint flags' own rules: what needs --save or --load, what excludes what. Raises ValueError
    naming the flag."""
    if args.save_interval is not None and (args.save_interval <= 0 or not args.save):
        raise ValueError("--save-interval must be > 0 and needs --save")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually "
                         "exclusive")
    if args.async_save and args.ckpt_format != "torch_dist":
        raise ValueError("--async-save needs --ckpt-format torch_dist")
    if args.async_save and not args.save:  # a flag that would silently do nothing
        raise ValueError("--async-save needs --save (the directory to write the checkpoints to)")
    for flag in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        if getattr(args, flag) and not args.load:
            raise ValueError(f"--{flag.replace('_', '-').replace('opt-param', 'opt_param')} says how to resume: it "
                             "needs --load (the checkpoint directory to resume from)")
    if args.exit_on_missing_checkpoint and not args.load:
        raise ValueError("--exit-on-missing-checkpoint needs --load")
    if args.pretrained_checkpoint and args.finetune:
        raise ValueError("--pretrained-checkpoint fine-tunes from it by itself; --finetune would also start a "
                         "resumed fine-tuning in --load over at iteration 0: drop --finetune")
    if args.pretrained_checkpoint and args.exit_on_missing_checkpoint:
        raise ValueError("--exit-on-missing-checkpoint and --pretrained-checkpoint: an empty --load is expected "
                         "before the fine-tuning's first save (it starts from --pretrained-checkpoint): drop one")
    if args.pretrained_checkpoint and os.path.exists(args.pretrained_checkpoint) \
            and not os.path.isdir(args.pretrained_checkpoint):
        raise ValueError(f"--pretrained-checkpoint {args.pretrained_checkpoint} is not a directory: give the "
                         "directory that holds the iter_* checkpoints")
    for flag in ("finetune", "no_load_optim", "no_load_rng"):
        if getattr(args, flag) and not args.load:
            raise ValueError(f"--{flag.replace('_', '-')} needs --load (the checkpoint directory to load from)")
    if args.use_checkpoint_opt_param_scheduler and (args.finetune or args.no_load_optim):
        raise ValueError("--use-checkpoint-opt_param-scheduler takes the schedule from the checkpoint, which "
                         f"--{'finetune' if args.finetune else 'no-load-optim'} does not load: drop one of them")
    if args.exit_interval is not None and args.exit_interval <= 0:
        raise ValueError("--exit-interval must be > 0")
    check_checkpoint_paths(args)


def check_checkpoint_paths(args):
    """--save and --load name directories that hold checkpoints (they need not exist yet: a first run with
    --save DIR --load DIR starts from scratch). A file, or one checkpoint's own directory, would otherwise be
    read as an empty directory (a resume silently training from scratch) or fail on rank 0 only."""
    for flag, path in (("--save", args.save), ("--load", args.load)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path} is not a directory: give the directory that holds (or will hold) the "
                             "iter_* checkpoints")
    for flag, path in (("--load", args.load), ("--pretrained-checkpoint", args.pretrained_checkpoint)):
        foreign_kind = describe_foreign(path) if path else None
        if foreign_kind:  # Megatron-LM's would read as incomplete, the others as no checkpoint (from scratch)
            raise ValueError(f"{flag} {foreign_kind}")
    if args.load and os.path.isfile(os.path.join(args.load, MANIFEST_FILENAME)) and not _holds_checkpoints(args.load):
        parent = os.path.dirname(os.path.normpath(args.load)) or "."
        raise ValueError(f"--load {args.load} is one checkpoint, not the directory that holds them: give "
                         f"--load {parent} (the newest complete checkpoint there is loaded)")


def _holds_checkpoints(path: str) -> bool:
    """A directory of checkpoints (a manifest.json of some other tool beside them is no reason to refuse it)."""
    return any(name.startswith("iter_") or name == TRACKER_FILENAME for name in os.listdir(path))
