"""Megatron-style GPT pre-training with megatron_lite.

    torchrun --nproc-per-node 2 pretrain_gpt.py --overlap-grad-reduce --use-distributed-optimizer

With no data flags it trains a tiny GPT on the built-in corpus (documentation text of the Python standard
library, tokenized byte-level and cached under data/cache on first use). `--help` lists every flag.

This file holds what is GPT-specific, as Megatron-LM's pretrain_gpt.py does: the model, the datasets and
the forward step with its loss. The generic loop (initialisation, DDP and the optimizer, logging,
evaluation, checkpoints) is megatron_lite.training.pretrain.
"""

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run from a checkout without installing

import torch  # noqa: E402

from megatron_lite.data import BlendedDataset, MockGPTDataset, build_datasets, ensure_builtin_dataset  # noqa: E402
from megatron_lite.distributed import collectives, meta_device_init  # noqa: E402
from megatron_lite.fault_tolerance import live_recovery_enabled, pretrain_live  # noqa: E402
from megatron_lite.models import GPTModel, num_floating_point_operations  # noqa: E402
from megatron_lite.training import gpt_config_from_args, parse_args, pretrain, print_rank_0, shutdown  # noqa: E402
from megatron_lite.training.data_arguments import (  # noqa: E402
    gpt_dataset_config_from_args,
    train_valid_test_num_samples,
    uses_dataset_files,
)


def model_provider(args) -> GPTModel:
    """The GPT of the architecture flags, created in the params dtype (DDP's buffers take that dtype). With
    --init-model-with-meta-device it is built on the meta device, its initialization recorded for the wrapper
    to replay shard by shard."""
    config = gpt_config_from_args(args, args.padded_vocab_size)
    llama = [config.normalization if config.normalization != "LayerNorm" else "",  # only what differs from GPT-2
             f"{'SwiGLU' if config.activation_func == 'silu' else 'gated ' + config.activation_func} ffn "
             f"{config.ffn_hidden_size}" if config.gated_linear_unit else "",
             "tanh-approximated GELU (--openai-gelu)" if config.activation_func == "openai_gelu" else "",
             f"{config.num_query_groups} query groups" if config.num_query_groups != config.num_attention_heads
             else "", "" if config.add_bias_linear else "no linear biases"]
    print_rank_0(f"> building GPT model: {config.num_layers} layers, hidden {config.hidden_size}, "
                 f"{config.num_attention_heads} heads, vocab {config.vocab_size}"
                 + "".join(f", {x}" for x in llama if x)
                 + (" (on the meta device)" if args.init_model_with_meta_device else ""))
    if args.init_model_with_meta_device:
        with meta_device_init():
            model = GPTModel(config)
    else:
        model = GPTModel(config)
    if not args.torch_compile:
        return model
    options = {"mode": args.torch_compile_mode} if args.torch_compile_mode else {}
    print_rank_0(f"> torch.compile: {'the whole forward' if args.torch_compile_scope == 'model' else 'per layer'}"
                 + (f", mode {args.torch_compile_mode}" if options else ""))
    if args.torch_compile_scope == "model":
        return model.compile_forward(**options)
    return model.compile_layers(**options)


def describe_dataset(dataset) -> str:
    """'GPTDataset', or a blend with its normalized weights: 'BlendedDataset of 0.3 A, 0.7 B' (an unweighted
    blend's weights are its datasets' sample counts)."""
    if not isinstance(dataset, BlendedDataset):
        return type(dataset).__name__
    total = sum(dataset.weights)
    return (f"BlendedDataset{' weighted by size' if dataset.size is None else ''} of "
            + ", ".join(f"{w / total:.4g} {d.indexed.prefix}" for w, d in zip(dataset.weights, dataset.datasets)))


def train_valid_test_datasets_provider(args, tokenizer):
    """--mock-data, or megatron-core's GPT datasets of --data-path / --train-data-path ... (the built-in corpus
    when no data flag is given), as many samples as Megatron-LM asks for. Rank 0 builds first (the corpus,
    the index caches) while the others wait, then they load its caches; a failure stops every rank at once."""
    if args.mock_data:
        return (MockGPTDataset(tokenizer.vocab_size, args.seq_length, args.seed),
                MockGPTDataset(tokenizer.vocab_size, args.seq_length, args.seed + 1), None)
    builtin = None
    if not uses_dataset_files(args):  # rank 0 says so before the first build, which takes some seconds
        builtin = collectives.rank_zero_first(ensure_builtin_dataset, args.data_cache_path, tokenizer, print_rank_0)
    sizes, left_out = train_valid_test_num_samples(args), {}
    datasets = collectives.rank_zero_first(build_datasets, gpt_dataset_config_from_args(args, tokenizer, builtin),
                                           sizes, left_out)
    for name, dataset, needed in zip(("train", "valid", "test"), datasets, sizes):
        if dataset is None:
            if name == "train":
                raise ValueError(f"the train split holds no samples ({left_out['train']}): give --split a larger "
                                 "train weight or --train-data-path a dataset")
            # Say why a split is left out; for validation asked for, also that no evaluation happens.
            print_rank_0(f"> {name}: none ({left_out[name]})" + (
                f": no evaluation despite --eval-iters {args.eval_iters}" if name == "valid" and args.eval_iters > 0
                else ""))
            continue
        print_rank_0(f"> {name}: {len(dataset)} samples ({describe_dataset(dataset)}, index "
                     f"{'loaded from' if dataset.cache_hit else 'built into'} {args.data_cache_path})")
        # Megatron's unweighted blend stops at one epoch of each dataset; say so instead of running dry.
        used = needed if name == "train" else min(needed, args.eval_iters * args.global_batch_size)
        if len(dataset) < used:
            raise ValueError(f"the {name} data holds {len(dataset)} samples, the run needs {used}: give the "
                             "datasets weights ('--data-path 0.5 A 0.5 B'), which repeat them as needed")
    return datasets


def get_batch(data_iterator, model):
    """The next micro-batch on the model's device. Its token ids were checked as the dataset read them (whole
    numbers in [0, the tokenizer's vocabulary), GPTDatasetConfig.vocab_size), on every rank at once."""
    batch = next(data_iterator)
    device = model.module.word_embeddings.weight.device
    return [batch[key].to(device, non_blocking=True) for key in ("tokens", "labels", "loss_mask")]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's form: the sum of the per-token losses (fp32) over the unmasked tokens, their number, and
    both to report as 'lm loss' (logged as sum / count over the micro-batches and ranks)."""
    losses, mask = output_tensor.float().reshape(-1), loss_mask.reshape(-1)
    loss = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int64)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), mask.sum()])}


def forward_step(data_iterator, model):
    """Forward one micro-batch; the model returns per-token losses when given labels."""
    tokens, labels, loss_mask = get_batch(data_iterator, model)
    return model(tokens, labels=labels), functools.partial(loss_func, loss_mask)


def flops_per_iteration(args) -> float:
    return num_floating_point_operations(gpt_config_from_args(args, args.padded_vocab_size),
                                         args.global_batch_size, args.seq_length)


def main(argv=None, world_size=None) -> dict:
    """Parse `argv` (default: the command line) and train; returns pretrain()'s summary."""
    args = parse_args(argv, world_size)
    # Started by megatron_lite.fault_tolerance.launch: a lost rank is replaced without restarting the others.
    train = pretrain_live if live_recovery_enabled() else pretrain
    return train(args, train_valid_test_datasets_provider, model_provider, forward_step, flops_per_iteration)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        raise
    shutdown()  # a clean run: exit without the interpreter's finalization (see shutdown's docstring)
