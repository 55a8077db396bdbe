"""Pre-training (mirrors megatron.training): the generic loop that pretrain_gpt.py hands its providers to.

    arguments.py      the command line and the one mapping from flags to the configs (the data,
                      torch.compile and checkpoint flags: data_, compile_, checkpoint_arguments.py;
                      config_flags.py: flags generated from the config dataclasses)
    initialize.py     process group and device (initialize_distributed), seed, tokenizer
    training.py       pretrain(), setup_model_and_optimizer, resume
    loop.py           TrainingLoop (the iteration body pretrain() and live recovery share), train_step, evaluate
    metrics.py        the log line, JSONL / TensorBoard records, MFU
    scheduler.py      OptimizerParamScheduler

save_checkpoint / load_checkpoint: megatron_lite.checkpointing (megatron.training.checkpointing's counterpart).
"""

from .arguments import (
    build_parser,
    ddp_config_from_args,
    gpt_config_from_args,
    optimizer_config_from_args,
    parse_args,
    validate_args,
)
from .initialize import initialize_distributed, initialize_megatron, shutdown
from .loop import evaluate, train_step
from .metrics import print_rank_0
from .scheduler import OptimizerParamScheduler
from .training import pretrain, setup_model_and_optimizer

__all__ = [
    "build_parser", "parse_args", "validate_args", "ddp_config_from_args", "optimizer_config_from_args",
    "gpt_config_from_args", "initialize_distributed", "initialize_megatron", "shutdown", "pretrain",
    "setup_model_and_optimizer",
    "train_step", "evaluate", "print_rank_0", "OptimizerParamScheduler",
]
