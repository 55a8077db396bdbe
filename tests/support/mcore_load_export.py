"""megatron-core 0.16.1 loads Megatron-LM checkpoints exported by tools/checkpoint_convert.py --to megatron, as
Megatron-LM's load_checkpoint does, and trains on from them (test_megatron_export.py runs it: one process, every
case).

    python tests/support/mcore_load_export.py SPEC.pt RESULT.pt

SPEC.pt: {'cases': [{'name', 'config': GPTConfig fields, 'checkpoint': an export's iter_* directory, 'format':
'torch_dist' | 'torch', 'distributed_optimizer', 'lr', 'weight_decay', 'betas', 'eps', 'probe': ids [b, s],
'batches': [(ids, labels)] to train on, 'optimizer': whether the export carries Adam's state, 'bf16'}]}.
RESULT.pt, per case name: {'weights' and 'optimizer_state' (per parameter name: 'param' the fp32 main values,
'exp_avg', 'exp_avg_sq', 'step') as loaded, 'logits' of the probe after the load, 'losses' over the batches
with the loaded optimizer state, 'fresh_losses' with a new optimizer (the same loaded weights), 'common'
(torch_dist: the common.pt megatron-core reads; legacy: the file's non-tensor entries), 'expected_keys' /
'written_keys' (torch_dist: the sharded keys megatron-core would save for this model and optimizer vs. the
export's, sorted; legacy: state_dict() keys in order), 'rng' (the loaded rng_state)}.
"""

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_reference as mr  # noqa: E402


def _build(case, weights=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_lite.models import GPTConfig

    bf16 = case.get("bf16", False)
    overrides = {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
    config = dict(case["config"])
    if config["activation_func"] == "openai_gelu":  # what Megatron-LM's flags give: F.gelu in the bias-GELU fusion
        config["activation_func"], overrides["bias_activation_fusion"] = "gelu", True
    model = mr.build_gpt(GPTConfig(**config), **overrides)
    if bf16:  # what Megatron-LM's Float16Module does: every parameter bf16 (the local spec makes norms in fp32)
        model = model.bfloat16()
    if weights is not None:  # before DDP and the optimizer take their views / main copies
        model.load_state_dict(weights, strict=False)
    use_do = case["distributed_optimizer"]
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=use_do, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=case["lr"], min_lr=case["lr"], weight_decay=case["weight_decay"],
        adam_beta1=case["betas"][0], adam_beta2=case["betas"][1], adam_eps=case["eps"], clip_grad=0.0,
        use_distributed_optimizer=use_do, bf16=bf16, fp16=False), [ddp])
    return model, ddp, opt


def _sharded_keys(state):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    keys = set()
    for v in nested_values(state):
        if isinstance(v, ShardedObject):
            keys.add(v.unique_key)
        elif isinstance(v, (ShardedTensor, ShardedTensorFactory)):  # a factory (SwiGLU's fc1) saves under its key
            keys.add(v.key)
    return keys


def _load_torch_dist(case, model, opt):
    """Megatron-LM's load_checkpoint for ckpt_format torch_dist: the content metadata from common.pt, the model's
    and (unless weights only) the optimizer's sharded_state_dict, the rng_state object; strict: every requested
    key must be in the checkpoint."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from torch.distributed.checkpoint import FileSystemReader

    directory = case["checkpoint"]
    common = dist_checkpointing.load_common_state_dict(directory)
    metadata = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    state = {"model": model.sharded_state_dict(metadata=metadata)}
    if case["optimizer"] and case["distributed_optimizer"]:
        _give_fresh_state_a_step(opt)
    if case["optimizer"]:
        state["optimizer"] = opt.sharded_state_dict(state, is_loading=True, metadata=metadata)
    state["rng_state"] = ShardedObject("rng_state", None, (1, 1), (0, 0), replica_id=0)
    # What megatron-core itself would write for this model (and optimizer), to compare with the export's keys.
    save_metadata = {k: v for k, v in metadata.items()}
    expected = {"model": model.sharded_state_dict(metadata=save_metadata)}
    if case["optimizer"]:
        expected["optimizer"] = opt.sharded_state_dict(expected, metadata=save_metadata)
    expected_keys = sorted(_sharded_keys(expected) | {"rng_state/shard_0.0_1.1"})
    loaded = dist_checkpointing.load(state, directory, strict="raise_unexpected")
    model.load_state_dict(loaded["model"], strict=True)
    if case["optimizer"]:
        opt.load_state_dict(loaded["optimizer"])
        if case["distributed_optimizer"]:
            _unshare_steps(opt)
    written = sorted(FileSystemReader(directory).read_metadata().state_dict_metadata)
    return common, loaded.get("rng_state"), expected_keys, written


def _give_fresh_state_a_step(opt):
    """CPU only (torch's Adam, no Transformer Engine / Apex), two gaps of megatron-core's DistributedOptimizer that
    its own fully_reshardable checkpoints hit too: state_dict() reads the shared step from the per-parameter state,
    which a new optimizer lacks; and the fully_reshardable load copies every per-parameter state key from the file,
    where 'step' is not (it is restored from the param groups just before). With TE's FusedAdam (Megatron-LM on
    GPUs) the step lives in the param groups and neither arises. Here: the fresh state gets a step 0 (the load
    replaces it) and the copy skips the keys the file does not hold."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in opt.chained_optimizers:
        inner.init_state_fn(inner.optimizer, inner.config)
        for state in inner.optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))
    copy = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(copy, "stubbed", False):
        return

    def held_keys_only(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        kept = {k: v for k, v in self.optimizer.state[main_param].items() if k not in tensors}
        copy(self, model_param, {**kept, **tensors})

    held_keys_only.stubbed = True
    DistributedOptimizer._set_main_param_and_optimizer_states = held_keys_only


def _unshare_steps(opt):
    """CPU only, the third gap: DistributedOptimizer.load_state_dict gives every parameter's torch Adam state ONE
    step tensor (from the param groups), which torch's Adam then increments once per parameter per step: bias
    correction runs ahead. Each parameter gets its own copy, as a first step would have made."""
    for inner in opt.chained_optimizers:
        for state in inner.optimizer.state.values():
            state["step"] = state["step"].clone()


def _load_legacy(case, model, opt):
    """Megatron-LM's load_checkpoint for the legacy format: torch.load, GPTModel.load_state_dict(strict),
    optimizer.load_state_dict."""
    path = os.path.join(case["checkpoint"], "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, map_location="cpu")  # megatron.core registered its safe globals (Namespace, ndarray)
    expected = list(model.state_dict())  # in order: readers take the parameters' order from it
    model.load_state_dict(state["model"], strict=True)
    if case["optimizer"]:
        opt.load_state_dict(state["optimizer"])
    common = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    return common, state.get("rng_state"), expected, list(state["model"])


def _optimizer_state(model, opt):
    """{megatron-core parameter name: {'param' (the fp32 main values), 'exp_avg', 'exp_avg_sq', 'step'}} as the
    loaded optimizer holds them (flat)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = opt.chained_optimizers[0]
    mains = {}
    if hasattr(inner, "float16_groups"):  # Float16OptimizerWithFloat16Params: model param -> its fp32 main
        for model_group, main_group in zip(inner.float16_groups, inner.fp32_from_float16_groups):
            mains.update({id(p): m for p, m in zip(model_group, main_group)})
    out = {}
    for name, param in model.named_parameters():
        if isinstance(inner, DistributedOptimizer):
            tensors = inner._get_main_param_and_optimizer_states(param)
        else:
            main = mains.get(id(param), param)
            tensors = {"param": main, **inner.optimizer.state[main]}
        out[name] = {k: v.detach().reshape(-1).clone() for k, v in tensors.items()}
    return out


def _train(ddp, opt, batches):
    losses = []
    for ids, labels in batches:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = mr.forward(ddp, ids, labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
    return losses


def run_case(case):
    model, ddp, opt = _build(case)
    load = _load_torch_dist if case["format"] == "torch_dist" else _load_legacy
    common, rng, expected, written = load(case, model, opt)
    optimizer_state = _optimizer_state(model, opt) if case["optimizer"] else {}
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    model.eval()
    with torch.no_grad():
        logits = mr.forward(model, case["probe"])
    model.train()
    losses = _train(ddp, opt, case["batches"])
    fresh_losses = []
    if case["batches"]:  # the same weights, a new optimizer: what dropping Adam's state gives
        _, fresh_ddp, fresh_opt = _build(case, weights)
        fresh_losses = _train(fresh_ddp, fresh_opt, case["batches"])
    return {"logits": logits, "losses": losses, "optimizer_state": optimizer_state, "weights": weights,
            "fresh_losses": fresh_losses, "common": common, "rng": rng, "expected_keys": expected,
            "written_keys": written}


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    spec_path, result_path = sys.argv[1], sys.argv[2]
    mr.init_world()
    spec = torch.load(spec_path, weights_only=False)
    results = {}
    for case in spec["cases"]:
        results[case["name"]] = run_case(case)
    torch.save(results, result_path)
