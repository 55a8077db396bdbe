"""The command line of pretrain_gpt.py, spelled like Megatron-LM's, and the one mapping onto the configs.

Flags that set a config field are generated from the config dataclass: the table below names Megatron's
flag for each field, the flag's help text is the field's docstring, and the rules live in the config's
`__post_init__`. `parse_args` builds every config once to validate it, and turns a config's `ValueError`
into argparse's flag error (exit code 2), with field names rewritten as flags. What is not a config field
(batch sizes, intervals, data paths) is checked in `validate_args`.
"""

import argparse
import ast
import dataclasses
import inspect
import os
import re
import textwrap
import typing
from typing import Dict, Optional

import torch

from ..distributed import DistributedDataParallelConfig
from ..models import GPTConfig
from ..optimizer import OptimizerConfig, check_optimizer_matches_ddp
from .scheduler import check_schedule

# Megatron's flag for every config field a flag sets: the one mapping from the command line to the configs.
DDP_FLAGS = {
    "overlap_grad_reduce": "--overlap-grad-reduce",
    "overlap_param_gather": "--overlap-param-gather",
    "use_distributed_optimizer": "--use-distributed-optimizer",  # sets OptimizerConfig's field too
    "bucket_size": "--ddp-bucket-size",
    "average_in_collective": "--ddp-average-in-collective",
    "grad_reduce_in_fp32": "--accumulate-allreduce-grads-in-fp32",  # or --bf16
    "check_for_nan_in_grad": "--check-for-nan-in-loss-and-grad",
}
OPTIMIZER_FLAGS = {  # params_dtype follows from --fp16 / --bf16
    "optimizer": "--optimizer", "lr": "--lr", "min_lr": "--min-lr", "weight_decay": "--weight-decay",
    "clip_grad": "--clip-grad", "adam_beta1": "--adam-beta1", "adam_beta2": "--adam-beta2",
    "adam_eps": "--adam-eps", "sgd_momentum": "--sgd-momentum",
    "fp16": "--fp16", "bf16": "--bf16", "loss_scale": "--loss-scale", "initial_loss_scale": "--initial-loss-scale",
    "min_loss_scale": "--min-loss-scale", "loss_scale_window": "--loss-scale-window", "hysteresis": "--hysteresis",
}
GPT_FLAGS = {  # vocab_size comes from the tokenizer; position type, tying and dtype are mapped by hand below
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "ffn_hidden_size": "--ffn-hidden-size", "max_position_embeddings": "--max-position-embeddings",
    "hidden_dropout": "--hidden-dropout", "attention_dropout": "--attention-dropout",
    "init_method_std": "--init-method-std",
}
SCHEDULE_FLAGS = {"lr_warmup_steps": "--lr-warmup-iters", "lr_decay_steps": "--lr-decay-iters",
                  "lr_decay_style": "--lr-decay-style"}

# pretrain_gpt.py's own defaults where they differ from the configs' (Megatron's); a tiny model trains well.
PRETRAIN_DEFAULTS = {"lr": 3e-3, "min_lr": 3e-4, "weight_decay": 0.1, "adam_beta2": 0.95}

# --model-preset fills the architecture flags the user did not give.
MODEL_PRESETS = {
    "tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128),
    "small": dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256),
    "gpt2-125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024),
}
_PRESET_FIELDS = ("num_layers", "hidden_size", "num_attention_heads")


# ------------------------------------------------------------------------------------------ config flags
def field_docs(config_cls) -> Dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field), one line each."""
    body = ast.parse(textwrap.dedent(inspect.getsource(config_cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")  # argparse's attribute name: Megatron's args.<name>


def add_config_arguments(group, config_cls, flags: Dict[str, str], defaults: Optional[dict] = None,
                         **extra: dict):
    """One argparse flag per entry of `flags` (field -> flag), typed after the field, with the field's
    docstring as help. `defaults` overrides the dataclass defaults; `extra[field]` adds argparse kwargs."""
    docs, hints = field_docs(config_cls), typing.get_type_hints(config_cls)
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for name, flag in flags.items():
        kind = hints[name]
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
        default = (defaults or {}).get(name, fields[name].default)
        default = None if default is dataclasses.MISSING else default
        kwargs = dict(action="store_true") if kind is bool else dict(type=kind, default=default)
        kwargs["help"] = docs.get(name, "").replace("%", "%%")
        group.add_argument(flag, **{**kwargs, **extra.get(name, {})})


def config_from_args(config_cls, flags: Dict[str, str], args, **fields):
    """Build `config_cls` from the parsed flags (fields whose flag this parser lacks keep their default)."""
    values = {name: getattr(args, _dest(flag)) for name, flag in flags.items() if hasattr(args, _dest(flag))}
    return config_cls(**{**values, **fields})


def params_dtype_from_args(args) -> torch.dtype:
    return torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32


def ddp_config_from_args(args) -> DistributedDataParallelConfig:
    # --bf16 implies fp32 gradient accumulation and reduction, as in Megatron.
    return config_from_args(DistributedDataParallelConfig, DDP_FLAGS, args,
                            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 or args.bf16)


def optimizer_config_from_args(args) -> OptimizerConfig:
    return config_from_args(OptimizerConfig, OPTIMIZER_FLAGS, args, params_dtype=params_dtype_from_args(args),
                            use_distributed_optimizer=args.use_distributed_optimizer)


def gpt_config_from_args(args, vocab_size: int) -> GPTConfig:
    return config_from_args(
        GPTConfig, GPT_FLAGS, args, vocab_size=vocab_size, params_dtype=params_dtype_from_args(args),
        position_embedding_type="rope" if args.position_embedding_type == "rope" else "learned",
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def flag_error_message(error: ValueError) -> str:
    """A config's message with its field names replaced by the flags that set them ('overlap_param_gather
    =True requires use_distributed_optimizer=True' -> '--overlap-param-gather requires ...')."""
    table = {**GPT_FLAGS, **OPTIMIZER_FLAGS, **SCHEDULE_FLAGS, **DDP_FLAGS}
    table.pop("optimizer")  # also an English word in messages; argparse's choices guard its values
    names = "|".join(sorted(table, key=len, reverse=True))
    return re.sub(rf"(?<![-\w])({names})(?![-\w])(=True\b)?", lambda m: table[m.group(1)], str(error))


def check_configs(args):
    """Build every config from `args` (raises the configs' ValueError); the vocabulary is not known before
    the tokenizer is built, so the model config is checked with a placeholder vocabulary."""
    check_optimizer_matches_ddp(optimizer_config_from_args(args), ddp_config_from_args(args))
    gpt_config_from_args(args, vocab_size=1)
    check_schedule(args.lr_warmup_iters, args.lr_decay_iters, args.lr_decay_style)


# ------------------------------------------------------------------------------------------ the parser
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default, unless its help already says what the default is."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Megatron-style GPT pre-training with megatron_lite (launch with torchrun).",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("model (GPTConfig)")
    g.add_argument("--model-preset", choices=sorted(MODEL_PRESETS), default="tiny",
                   help="sets the architecture flags you do not give: " + "; ".join(
                       f"{k}: {v['num_layers']} layers, hidden {v['hidden_size']}, {v['num_attention_heads']} "
                       f"heads, seq {v['seq_length']}" for k, v in MODEL_PRESETS.items())
                   )
    docs = field_docs(GPTConfig)
    add_config_arguments(g, GPTConfig, GPT_FLAGS, defaults=dict.fromkeys(_PRESET_FIELDS),
                         max_position_embeddings=dict(help=docs["max_position_embeddings"] + " (default: --seq-length)"),
                         **{f: dict(help=docs[f] + " (default: from --model-preset)") for f in _PRESET_FIELDS})
    g.add_argument("--seq-length", type=int, help="tokens per sample (default: from --model-preset)")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute",
                   help="learned absolute position embeddings added to the input, or rotary embeddings in attention")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output layer instead of reusing the word-embedding matrix")

    g = p.add_argument_group("training and mixed precision (OptimizerConfig)")
    g.add_argument("--micro-batch-size", type=int, default=4, help="samples per rank per micro-batch")
    g.add_argument("--global-batch-size", type=int, default=16,
                   help="samples per iteration; each rank accumulates global / (micro x data-parallel size) "
                        "micro-batches")
    g.add_argument("--train-iters", type=int, default=200, help="iterations to train for")
    g.add_argument("--seed", type=int, default=1234, help="seeds the model init (identical on every rank), "
                                                          "data shuffling and dropout")
    precision = ("fp16", "bf16", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
                 "hysteresis")
    add_config_arguments(g, OptimizerConfig, {k: OPTIMIZER_FLAGS[k] for k in precision})

    g = p.add_argument_group("optimizer (OptimizerConfig) and learning-rate schedule")
    add_config_arguments(g, OptimizerConfig, {k: v for k, v in OPTIMIZER_FLAGS.items() if k not in precision},
                         defaults=PRETRAIN_DEFAULTS, optimizer=dict(choices=["adam", "sgd"]))
    g.add_argument("--lr-warmup-iters", type=int, help="iterations of linear warmup from 0 to --lr (default: 10%% "
                                                       "of --lr-decay-iters)")
    g.add_argument("--lr-decay-iters", type=int, help="iteration at which the decay reaches --min-lr (default: "
                                                      "--train-iters)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine",
                   help="shape of the decay after warmup")

    g = p.add_argument_group("data parallelism (DistributedDataParallelConfig)")
    add_config_arguments(g, DistributedDataParallelConfig, DDP_FLAGS)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], help="default: nccl on CUDA, else gloo")
    g.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a collective that waits longer than this fails instead of hanging")

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="synthetic, learnable sequences instead of a dataset")
    g.add_argument("--data-path", help="prefix of a dataset made by tools/preprocess_data.py "
                                       "(default: the built-in corpus, built on first use)")
    g.add_argument("--data-cache-path", default=os.path.join("data", "cache"),
                   help="where the built-in corpus dataset is built")
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer",
                   choices=["ByteLevelTokenizer", "HuggingFaceTokenizer", "NullTokenizer"],
                   help="how text was turned into token ids (must match tools/preprocess_data.py)")
    g.add_argument("--tokenizer-model", help="tokenizer.json for HuggingFaceTokenizer")
    g.add_argument("--vocab-size", type=int, default=512,
                   help="vocabulary of --tokenizer-type NullTokenizer (use it with --mock-data for a custom size)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test document split weights")

    g = p.add_argument_group("logging, evaluation and checkpoints")
    g.add_argument("--log-interval", type=int, default=10, help="iterations between log lines")
    g.add_argument("--eval-interval", type=int, default=100, help="iterations between evaluations (and one at the end)")
    g.add_argument("--eval-iters", type=int, default=5, help="global batches of validation data per evaluation")
    g.add_argument("--tensorboard-dir", help="TensorBoard event files (when tensorboard is installed)")
    g.add_argument("--metrics-file", help="JSONL metrics (default: TENSORBOARD_DIR or SAVE /metrics.jsonl)")
    g.add_argument("--save", help="checkpoint directory")
    g.add_argument("--save-interval", type=int, help="iterations between checkpoints (and one at the end)")
    g.add_argument("--load", help="resume from the latest checkpoint in this directory (if any)")
    g.add_argument("--exit-interval", type=int, help="stop (after saving) once iteration %% N == 0")
    return p


def parse_args(argv=None, world_size=None) -> argparse.Namespace:
    """Parse and validate; errors exit with argparse's usage message naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args, world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        parser.error(flag_error_message(e))
    return args


def validate_args(args, world_size: int):
    """Fill the defaults that depend on other flags, check what is not a config field, then build the
    configs (their ValueError names the field). Raises ValueError."""
    for key, value in MODEL_PRESETS[args.model_preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = args.lr_decay_iters // 10
    for name in ("seq_length", "micro_batch_size", "global_batch_size", "train_iters", "log_interval",
                 "eval_interval"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.seq_length > args.max_position_embeddings:
        raise ValueError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    per_step = args.micro_batch_size * world_size
    if args.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {world_size} = {per_step}")
    args.data_parallel_size = world_size
    args.num_micro_batches = args.global_batch_size // per_step
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path are mutually exclusive")
    if args.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.save_interval is not None and (args.save_interval <= 0 or not args.save):
        raise ValueError("--save-interval must be > 0 and needs --save")
    if args.exit_interval is not None and args.exit_interval <= 0:
        raise ValueError("--exit-interval must be > 0")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model path/to/tokenizer.json")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    if args.distributed_backend == "nccl" and (args.device == "cpu" or not torch.cuda.is_available()):
        raise ValueError("--distributed-backend nccl needs CUDA tensors: use gloo on CPU")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if args.device == "cuda" else "gloo"
    if args.metrics_file is None and (args.tensorboard_dir or args.save):
        args.metrics_file = os.path.join(args.tensorboard_dir or args.save, "metrics.jsonl")
    check_configs(args)
    return args
