"""megatron-core writes the Megatron-LM checkpoints that test_megatron_import.py converts (run as a script).

    python tests/support/mcore_save.py OUT

Three runs of megatron-core's GPTModel + DistributedDataParallel + get_megatron_optimizer (Adam, fp32, one rank)
with megatron-core's OptimizerParamScheduler (counted in samples, as Megatron-LM steps it), each trained
SAVE_AT iterations, saved, and continued CONTINUE iterations (the reference losses of a run that did not move):

    OUT/gpt2_dist     GPT-2-class (learned positions, LayerNorm, GELU, biases, tied)  non-distributed optimizer,
    OUT/gpt2_torch      torch_dist and legacy torch (mp_rank_00/model_optim_rng.pt) of the same state
    OUT/llama_dp      Llama-class (rope, RMSNorm, SwiGLU, no biases, untied, 4 heads in 2 query groups),
    OUT/llama_torch     distributed optimizer with 3 buckets (--overlap-grad-reduce --ddp-bucket-size 8000):
                        torch_dist 'dp_reshardable' (Megatron-LM's default) and legacy torch (+ distrib_optim.pt)
    OUT/llama_full_buckets   and torch_dist 'fully_reshardable', which megatron-core 0.16.1 writes wrongly here
    OUT/llama_full    the same model, one bucket: torch_dist 'fully_reshardable'
    OUT/reference.pt  {'batches': ids of every iteration, 'probe': ids, per run: 'config' (GPTConfig fields),
                       'logits' of `probe` at the save, 'losses' of the CONTINUE iterations after it}

The files hold what Megatron-LM's save_checkpoint (megatron/training/checkpointing.py, core_v0.16.1) puts in
them: generate_state_dict's dict (args Namespace, checkpoint_version 3.0, iteration, model, optimizer,
opt_param_scheduler, rng_state, num_floating_point_operations_so_far), written by dist_checkpointing.save
with the content metadata of _build_sharded_state_dict_metadata (torch_dist), or by torch.save under
mp_rank_00 (torch); the tracker latest_checkpointed_iteration.txt beside them. The args Namespace carries the
fields of Megatron-LM's parser that the import reads, with Megatron-LM's values for this run.
"""

import argparse
import os
import random
import sys
import warnings

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

SAVE_AT, CONTINUE = 3, 3
MICRO_BATCH, SEQ, VOCAB = 4, 8, 128  # one micro-batch per iteration: the global batch is MICRO_BATCH
BUCKET_SIZE = 8000
# The save (iteration 3) lies mid-warmup; the continuation ends the warmup and goes on into the cosine decay.
LR, MIN_LR, WARMUP_ITERS, DECAY_ITERS, WEIGHT_DECAY, BETAS, EPS = 1e-3, 1e-4, 4, 8, 0.1, (0.9, 0.95), 1e-8

LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
             max_position_embeddings=16, normalization="RMSNorm", gated_linear_unit=True, activation_func="silu",
             add_bias_linear=False, position_embedding_type="rope", share_embeddings_and_output_weights=False,
             ffn_hidden_size=64)
RUNS = {  # name -> (GPTConfig fields, use_distributed_optimizer, bucket size, {directory: (ckpt_format, sharding)})
    "gpt2": (dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=16),
             False, None, {"gpt2_dist": ("torch_dist", None), "gpt2_torch": ("torch", None)}),
    "llama": (LLAMA, True, BUCKET_SIZE, {"llama_dp": ("torch_dist", "dp_reshardable"), "llama_torch": ("torch", None),
                                         "llama_full_buckets": ("torch_dist", "fully_reshardable")}),
    # One bucket: megatron-core 0.16.1's fully_reshardable save shifts the state of every bucket after the first
    # by the first's end padding (its own warning "param range exceeds unpadded buffer ... data corruption").
    "llama_one_bucket": (LLAMA, True, None, {"llama_full": ("torch_dist", "fully_reshardable")}),
}


def megatron_args(config, use_distributed_optimizer: bool, bucket_size, ckpt_format: str) -> argparse.Namespace:
    """The fields of Megatron-LM's args that describe this run (as its parser and validate_args set them)."""
    return argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads, kv_channels=config.hidden_size // config.num_attention_heads,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        num_query_groups=config.num_query_groups, max_position_embeddings=config.max_position_embeddings,
        position_embedding_type="rope" if config.position_embedding_type == "rope" else "learned_absolute",
        rotary_base=int(config.rotary_base), rotary_percent=1.0, rotary_interleaved=False,
        normalization=config.normalization, norm_epsilon=config.layernorm_epsilon,
        swiglu=config.gated_linear_unit, openai_gelu=False, squared_relu=False, quick_geglu=False,
        bias_gelu_fusion=config.add_bias_linear and not config.gated_linear_unit, use_legacy_models=False,
        add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_bias_linear, qk_layernorm=False,
        untie_embeddings_and_output_weights=not config.share_embeddings_and_output_weights,
        apply_residual_connection_post_layernorm=False, num_experts=None, multi_latent_attention=False,
        padded_vocab_size=config.vocab_size, vocab_size=config.vocab_size - 1,  # --vocab-size: + eod
        make_vocab_size_divisible_by=128,
        tokenizer_type="NullTokenizer", tokenizer_model=None, vocab_file=None, merge_file=None,
        init_method_std=config.init_method_std, hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        global_batch_size=MICRO_BATCH, rampup_batch_size=None, train_iters=DECAY_ITERS, train_samples=None,
        optimizer="adam", lr=LR, min_lr=MIN_LR, lr_decay_style="cosine", lr_decay_iters=DECAY_ITERS,
        lr_decay_samples=None, lr_warmup_iters=WARMUP_ITERS, lr_warmup_samples=0, lr_warmup_fraction=None,
        lr_warmup_init=0.0, weight_decay=WEIGHT_DECAY, start_weight_decay=WEIGHT_DECAY,
        end_weight_decay=WEIGHT_DECAY, weight_decay_incr_style="constant", adam_beta1=BETAS[0],
        adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=0.0, fp16=False, bf16=False, params_dtype=torch.float32,
        use_distributed_optimizer=use_distributed_optimizer, ckpt_format=ckpt_format,
        overlap_grad_reduce=bucket_size is not None, ddp_bucket_size=bucket_size,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
        expert_model_parallel_size=1, data_parallel_size=1, transformer_impl="local", seed=1234,
        data_parallel_random_init=False, iteration=SAVE_AT, consumed_train_samples=SAVE_AT * MICRO_BATCH,
        consumed_valid_samples=0, save="SAVE", load=None)


def rng_state() -> dict:
    """get_rng_state's dict (megatron/training/checkpointing.py); on this CPU run the CUDA generator and the
    model-parallel tracker are stood in for by byte tensors of their shape."""
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
            "rng_tracker_states": {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)}}


def save(directory, fmt, sharding, args, model, optimizer, scheduler):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    root = os.path.join(directory, f"iter_{SAVE_AT:07d}")
    state = {"args": args, "checkpoint_version": 3.0, "iteration": SAVE_AT,
             "opt_param_scheduler": scheduler.state_dict(), "num_floating_point_operations_so_far": 0}
    if fmt == "torch":
        state.update(model=model.state_dict_for_save_checkpoint(), optimizer=optimizer.state_dict(),
                     rng_state=[rng_state()])
        os.makedirs(os.path.join(root, "mp_rank_00"))
        torch.save(state, os.path.join(root, "mp_rank_00", "model_optim_rng.pt"))
        if args.use_distributed_optimizer:  # its parameter state: a file of its own
            optimizer.save_parameter_state(os.path.join(root, "mp_rank_00", "distrib_optim.pt"))
    else:
        metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if sharding:
            metadata["distrib_optim_sharding_type"] = sharding
        model_state = model.sharded_state_dict(metadata=metadata)
        state.update(model=model_state, optimizer=optimizer.sharded_state_dict(model_state, metadata=metadata),
                     rng_state=ShardedObject("rng_state", [rng_state()], (1, 1), (0, 0), replica_id=0))
        os.makedirs(root)
        dist_checkpointing.save(state, root, content_metadata=metadata)
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(SAVE_AT))


def run(name, out, batches, probe):
    import mcore_reference as mr
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_lite.models import GPTConfig

    fields, distributed, bucket_size, saves = RUNS[name]
    config = GPTConfig(**fields)
    torch.manual_seed(1)
    # Megatron-LM's default --bias-gelu-fusion: a GELU MLP with biases computes megatron-core's bias_gelu_impl,
    # GELU's tanh approximation (imported as --openai-gelu), as Megatron-LM builds it.
    gelu_fusion = config.add_bias_linear and not config.gated_linear_unit
    model = mr.build_gpt(config, bias_activation_fusion=gelu_fusion)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size)
    ddp = DistributedDataParallel(mr.transformer_config(config, bias_activation_fusion=gelu_fusion), ddp_config, model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
        adam_eps=EPS, clip_grad=0.0, use_distributed_optimizer=distributed, bf16=False), [ddp])
    scheduler = OptimizerParamScheduler(  # Megatron-LM's: steps in samples
        optimizer, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP_ITERS * MICRO_BATCH,
        lr_decay_steps=DECAY_ITERS * MICRO_BATCH, lr_decay_style="cosine", start_wd=WEIGHT_DECAY,
        end_wd=WEIGHT_DECAY, wd_incr_steps=DECAY_ITERS * MICRO_BATCH, wd_incr_style="constant")
    result = {"config": fields, "losses": []}
    for iteration in range(SAVE_AT + CONTINUE):
        if iteration == SAVE_AT:
            model.eval()
            with torch.no_grad():
                result["logits"] = mr.forward(model, probe).detach().clone()
            model.train()
            for directory, (fmt, sharding) in saves.items():
                args = megatron_args(config, distributed, bucket_size, fmt)
                save(os.path.join(out, directory), fmt, sharding, args, model, optimizer, scheduler)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = mr.forward(ddp, batches[iteration][:, :-1], batches[iteration][:, 1:]).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        scheduler.step(increment=MICRO_BATCH)
        if iteration >= SAVE_AT:
            result["losses"].append(loss.item())
    return result


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    import mcore_reference

    mcore_reference.init_world()
    out = sys.argv[1]
    generator = torch.Generator().manual_seed(0)
    batches = torch.randint(0, VOCAB, (SAVE_AT + CONTINUE, MICRO_BATCH, SEQ + 1), generator=generator)
    probe = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    reference = {"batches": batches, "probe": probe, "save_at": SAVE_AT, "micro_batch": MICRO_BATCH}
    for run_name in RUNS:
        reference[run_name] = run(run_name, out, batches, probe)
    torch.save(reference, os.path.join(out, "reference.pt"))
