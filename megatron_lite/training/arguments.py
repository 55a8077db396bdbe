"""Command-line arguments of pretrain_gpt.py, spelled like Megatron-LM's, and their validation."""

import argparse
import os

import torch

# --model-preset fills the architecture flags the user did not give.
MODEL_PRESETS = {
    "tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128),
    "small": dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256),
    "gpt2-125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Megatron-style GPT pre-training with megatron_lite (launch with torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model-preset", choices=sorted(MODEL_PRESETS), default="tiny",
                   help="architecture defaults; explicit flags below override them")
    g.add_argument("--num-layers", type=int, help="transformer layers (preset)")
    g.add_argument("--hidden-size", type=int, help="hidden size (preset)")
    g.add_argument("--num-attention-heads", type=int, help="attention heads (preset)")
    g.add_argument("--ffn-hidden-size", type=int, help="MLP hidden size (default 4 x hidden)")
    g.add_argument("--seq-length", type=int, help="tokens per sample (preset)")
    g.add_argument("--max-position-embeddings", type=int, help="maximum sequence length (default: seq length)")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer instead of reusing the word embeddings")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4, help="samples per rank per micro-batch")
    g.add_argument("--global-batch-size", type=int, default=16,
                   help="samples per iteration; gradient accumulation = global / (micro x dp)")
    g.add_argument("--train-iters", type=int, default=200)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--fp16", action="store_true", help="fp16 params, fp32 main params, loss scaling")
    g.add_argument("--bf16", action="store_true", help="bf16 params, fp32 main params and fp32 grad reduction")
    g.add_argument("--loss-scale", type=float, help="constant loss scale for --fp16 (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=int, help="linear warmup iterations (default: 10%% of decay iters)")
    g.add_argument("--lr-decay-iters", type=int, help="iteration where decay reaches --min-lr (default: train iters)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip (0: off)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)

    g = p.add_argument_group("data parallelism")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="overlap bucket reduction with backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the distributed optimizer's all-gather with the next forward")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="ZeRO-1 sharded optimizer state")
    g.add_argument("--ddp-bucket-size", type=int, help="elements per bucket (default: Megatron's)")
    g.add_argument("--ddp-average-in-collective", action="store_true", help="average with ReduceOp.AVG")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", help="fp32 main_grad (implied by --bf16)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], help="default: nccl on CUDA, else gloo")
    g.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens instead of a dataset")
    g.add_argument("--data-path", help="prefix of a dataset made by tools/preprocess_data.py "
                                       "(default: the built-in corpus, built on first use)")
    g.add_argument("--data-cache-path", default=os.path.join("data", "cache"),
                   help="where the built-in corpus dataset is built")
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer",
                   choices=["ByteLevelTokenizer", "HuggingFaceTokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", help="tokenizer.json for HuggingFaceTokenizer")
    g.add_argument("--vocab-size", type=int, default=512,
                   help="vocabulary of --tokenizer-type NullTokenizer (use it with --mock-data for a custom size)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test document split weights")

    g = p.add_argument_group("logging, evaluation and checkpoints")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=5)
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
        parser.error(str(e))
    return args


def validate_args(args, world_size: int):
    """Fill defaults and check consistency; raises ValueError naming the flag."""
    for key, value in MODEL_PRESETS[args.model_preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = args.lr_decay_iters // 10
    positive = ["num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "global_batch_size", "train_iters", "log_interval", "eval_interval", "max_position_embeddings"]
    for name in positive:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                         f"{args.num_attention_heads}")
    if args.seq_length > args.max_position_embeddings:
        raise ValueError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    per_step = args.micro_batch_size * world_size
    if args.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {world_size} = {per_step}")
    args.data_parallel_size = world_size
    args.num_micro_batches = args.global_batch_size // per_step
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are mutually exclusive")
    if args.loss_scale is not None and not args.fp16:
        raise ValueError("--loss-scale only applies with --fp16")
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True  # as in Megatron
    if args.fp16 and args.check_for_nan_in_loss_and_grad:
        raise ValueError("--check-for-nan-in-loss-and-grad rejects Inf gradients, which --fp16 loss scaling "
                         "produces on purpose (and then skips the step): use one or the other")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ValueError("--overlap-param-gather requires --use-distributed-optimizer")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        raise ValueError(f"--ddp-bucket-size must be > 0, got {args.ddp_bucket_size}")
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path are mutually exclusive")
    if args.lr < 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise ValueError(f"need 0 <= --min-lr ({args.min_lr}) <= --lr ({args.lr})")
    if args.lr_warmup_iters < 0 or args.lr_warmup_iters > args.lr_decay_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --lr-decay-iters "
                         f"{args.lr_decay_iters}]")
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
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    return args
