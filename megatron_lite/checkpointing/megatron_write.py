"""A megatron-lite checkpoint (the `torch` format's payload) written as a Megatron-LM checkpoint, in either format
Megatron-LM reads, with the keys and layouts megatron-core 0.16 / Megatron-LM write::

    OUT/latest_checkpointed_iteration.txt       "200" (Megatron-LM's tracker)
    OUT/iter_0000200/                           torch_dist (megatron-core dist_checkpointing, the default):
        .metadata, __0_0.distcp                   torch.distributed.checkpoint: one entry per sharded key
        common.pt                                 args, iteration, checkpoint_version, opt_param_scheduler,
                                                  the optimizer's param groups and step, content_metadata
        metadata.json                             {"sharded_backend": "torch_dist", ...}
    OUT/iter_0000200/mp_rank_00/model_optim_rng.pt   legacy torch: GPTModel.state_dict(), optimizer.state_dict()

torch_dist keys are GPTModel.sharded_state_dict()'s: the layers STACKED on a leading layer axis
(`decoder.layers.self_attention.linear_qkv.weight` [L, rows, h]), norms under Transformer Engine's names whatever
the layer spec, `_extra_state` ShardedObjects per layer (stored as bytes `KEY/shard_i_L`), the optimizer's state
keyed by model key (`optimizer.state.exp_avg.KEY`). The QKV rows are regrouped per query group (megatron_lm.py).

Adam's state is keyed by model key, so it does not depend on the data-parallel size (neither does megatron-lite's):
  * torch_dist holds it in both forms megatron-core 0.16 loads, so the export loads with and without
    --use-distributed-optimizer: exp_avg, exp_avg_sq and the fp32 main values ('param', the distributed optimizer's
    'fully_reshardable' form, named in the content metadata its load reads; 'fp32_param' too for the
    non-distributed optimizer of bf16 / fp16 weights), the step as torch's `common_step` and in each param group.
    The distributed optimizer's default 'dp_reshardable' form (and legacy distrib_optim.pt) stores the DP ranks'
    flat bucket shards, tied to megatron-core's bucket layout and DP size: not written.
  * legacy torch holds the non-distributed optimizer's state_dict() (its ids in GPTModel.named_parameters() order):
    it loads without --use-distributed-optimizer.
Megatron's OptimizerParamScheduler counts samples: steps are converted with the global batch size
(consumed_train_samples / iteration). The RNG of the CPU generators is written (python, numpy, torch); megatron-lite
has no model-parallel CUDA RNG tracker state, which Megatron-LM requires to restore RNG: load with --no-load-rng.
"""

import argparse
import io
import json
import os
import shutil
import tempfile
import warnings
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ..optimizer import no_weight_decay
from . import experts, files
from .megatron_lm import LEGACY_FILENAME, TE_NORM_NAMES, is_qkv, name_to_megatron, qkv_to_megatron, state_dict_order

MEGATRON_CHECKPOINT_VERSION = 3.0  # Megatron-LM's state_dict['checkpoint_version']
FORMATS = ("torch_dist", "torch")
TRANSFORMER_IMPLS = ("transformer_engine", "local")
_LOCAL_NORMS = {local: te for te, local in TE_NORM_NAMES.items()}  # input_layernorm.weight -> linear_qkv.layer_...
# Per-layer modules with an `_extra_state` entry: the local spec's linear layers; Transformer Engine's also have
# core_attention's (torch_dist writes both: a missing requested object fails the load, an extra one is ignored).
_EXTRA_STATE_TE = ("self_attention.core_attention", "self_attention.linear_proj", "self_attention.linear_qkv",
                   "mlp.linear_fc1", "mlp.linear_fc2")
_ADAM_GROUP = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None)


def check_exportable(payload: dict):
    """Raise ValueError naming what a Megatron-LM GPT cannot hold: expert parameters, the tanh GELU without biases
    (megatron_flags), a model that is not megatron-lite's GPT (names), a checkpoint without recorded
    architecture."""
    if experts.SECTION in payload:
        raise ValueError("the checkpoint holds expert parameters (param.allreduce = False, one set per "
                         "expert-parallel position): they are no megatron-core MoE layer; Megatron-LM export covers "
                         "megatron-lite's GPTModel without expert parameters")
    args = payload.get("args") or {}
    lacking = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size") if k not in args]
    if lacking:
        raise ValueError(f"the checkpoint's args lack {lacking}: it was not saved by pretrain_gpt.py (a library "
                         f"checkpoint of another model): only megatron-lite's GPTModel maps to megatron-core's")
    if args.get("openai_gelu") and args.get("disable_bias_linear"):
        raise ValueError("args.openai_gelu with disable_bias_linear: Megatron-LM 0.16's core GPT ignores --openai-gelu "
                         "and computes GELU's tanh form only in its bias-GELU fusion, which needs linear biases; "
                         "without them it computes the exact GELU, another MLP. Train with the exact GELU (no "
                         "--openai-gelu) or with biases to move to Megatron-LM, or export with --to hf (gelu_new)")
    layers = int(args["num_layers"])
    for name in payload["model"]:
        parts = name.split(".")
        ok = name.startswith(("word_embeddings.", "position_embeddings.", "final_layernorm.", "output_layer."))
        ok = ok or (parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) < layers)
        if not ok:
            raise ValueError(f"model tensor {name!r} has no megatron-core GPTModel counterpart: only megatron-lite's "
                             f"GPTModel (pretrain_gpt.py) can be exported to Megatron-LM")


def _heads(args: dict):
    heads = int(args["num_attention_heads"])
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    return heads, int(groups or (1 if args.get("group_query_attention") else heads))


def _layer_name(rest: str, transformer_impl: str) -> str:
    return _LOCAL_NORMS.get(rest, rest) if transformer_impl == "transformer_engine" else rest


def model_state(payload: dict, transformer_impl: str) -> Dict[str, torch.Tensor]:
    """GPTModel.state_dict() of megatron-core (per-layer names; `transformer_impl`'s norm names; QKV regrouped)."""
    heads, groups = _heads(payload["args"])
    out = {}
    for name, tensor in payload["model"].items():
        if name == "output_layer.weight" and not payload["args"].get("untie_embeddings_and_output_weights"):
            continue  # a tied output layer has no parameter of its own in megatron-core
        key = name_to_megatron(name)
        if key.startswith("decoder.layers."):
            _, _, index, rest = key.split(".", 3)
            key = f"decoder.layers.{index}.{_layer_name(rest, transformer_impl)}"
        out[key] = qkv_to_megatron(tensor, heads, groups) if is_qkv(name) else tensor
    return out


def _stacked(state: Dict[str, torch.Tensor], layers: int) -> Dict[str, torch.Tensor]:
    """Per-layer megatron-core names -> torch_dist's sharded keys: `decoder.layers.{i}.X` stacked into
    `decoder.layers.X` [L, ...] (the leading axis is the layer index, prepend_axis_num=1)."""
    out, per_layer = {}, {}
    for key, tensor in state.items():
        if key.startswith("decoder.layers."):
            _, _, index, rest = key.split(".", 3)
            per_layer.setdefault(f"decoder.layers.{rest}", {})[int(index)] = tensor
        else:
            out[key] = tensor.contiguous()
    for key, tensors in per_layer.items():
        out[key] = torch.stack([tensors[i] for i in range(layers)])
    return out


# ------------------------------------------------------------------------------------------ optimizer
def has_adam_state(payload: dict) -> bool:
    """Whether the checkpoint carries Adam moments for every parameter (not weights-only, not SGD / Muon)."""
    opt = payload.get("optimizer") or {}
    state = opt.get("state") or {}
    return (opt.get("optimizer", "adam") == "adam" and bool(state)
            and all({"exp_avg", "exp_avg_sq"} <= set(entry) for entry in state.values()))


def param_groups(payload: dict, order: List[str], params: Dict[str, torch.Tensor]) -> List[dict]:
    """megatron-core's param groups (get_megatron_optimizer's _get_param_groups: the default group first, then
    wd_mult 0), each {'params': [model keys in `order`], hyperparameters}, from megatron-lite's groups."""
    opt, sched = payload["optimizer"], payload.get("opt_param_scheduler") or {}
    by_mult = {float(g.get("wd_mult", 1.0)): g for g in opt.get("param_groups", [])}
    if any(float(g.get("lr_mult", 1.0)) != 1.0 or g.get("use_muon") for g in by_mult.values()) or not by_mult:
        raise ValueError(f"optimizer.param_groups {opt.get('param_groups')}: only megatron-core's standard groups "
                         f"(wd_mult 1 / 0, lr_mult 1) are exported")
    unusual = sorted({k for g in by_mult.values() for k in ("amsgrad", "maximize") if g.get(k)})
    if unusual:
        raise ValueError(f"optimizer.param_groups set {unusual}: megatron-core's Adam has neither; export a run "
                         f"trained without them")
    groups = []
    for wd_mult in (1.0, 0.0):
        keys = [k for k in order if no_weight_decay(k, params[k]) == (wd_mult == 0.0)]
        if not keys:
            continue
        lite = by_mult.get(wd_mult, by_mult.get(1.0))
        groups.append({"params": keys, "is_expert_parallel": False, "default_config": True, "wd_mult": wd_mult,
                       "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": float(sched.get("max_lr", lite["lr"])),
                       "min_lr": float(sched.get("min_lr", 0.0)), "lr": float(lite["lr"]),
                       "betas": tuple(lite["betas"]), "eps": float(lite["eps"]),
                       "weight_decay": float(lite["weight_decay"]), **_ADAM_GROUP,
                       "decoupled_weight_decay": bool(lite.get("decoupled_weight_decay", True))})
    return groups


def _optimizer_tensors(payload: dict, transformer_impl: str) -> Dict[str, Dict[str, torch.Tensor]]:
    """{'param' | 'exp_avg' | 'exp_avg_sq': megatron-core per-layer state dict} (names and QKV as the model's)."""
    state = payload["optimizer"]["state"]
    fields = {}
    for field in ("param", "exp_avg", "exp_avg_sq"):
        # 'param' (the fp32 main values) is in every state megatron-lite writes; else the weights are the mains.
        lite = {name: entry.get(field, payload["model"][name]).float().reshape(payload["model"][name].shape)
                for name, entry in state.items()}
        fields[field] = model_state({**payload, "model": lite}, transformer_impl)
    return fields


def _step(payload: dict) -> int:
    steps = {int(e.get("step", 0)) for e in payload["optimizer"]["state"].values()}
    if len(steps) != 1:
        raise ValueError(f"optimizer.state holds steps {sorted(steps)}: megatron-core keeps one step shared by "
                         f"every parameter")
    return steps.pop()


def grad_scaler_state(payload: dict) -> Optional[dict]:
    """Megatron's grad scaler state (fp16): DynamicGradScaler's {'scale' (a 1-element tensor), 'growth_tracker',
    'hysteresis_tracker'}, ConstantGradScaler's {}; None without a scaler (fp32, bf16)."""
    lite = payload["optimizer"].get("grad_scaler")
    if not lite:
        return None
    if "growth_tracker" not in lite:
        return {}
    return {"scale": torch.tensor([float(lite["scale"])]), "growth_tracker": int(lite["growth_tracker"]),
            "hysteresis_tracker": int(lite["hysteresis_tracker"])}


def _with_scaler(optimizer_state: dict, payload: dict) -> dict:
    scaler = grad_scaler_state(payload)
    return optimizer_state if scaler is None else {**optimizer_state, "grad_scaler": scaler}


# ------------------------------------------------------------------------------------------ the rest
def global_batch_size(payload: dict) -> int:
    iteration, samples = int(payload["iteration"]), int(payload.get("consumed_train_samples", 0))
    if iteration <= 0 or samples % iteration:
        raise ValueError(f"iteration {iteration}, consumed_train_samples {samples}: the global batch size (Megatron's "
                         f"scheduler counts samples) cannot be derived; export a checkpoint saved after training "
                         f"with a constant global batch size")
    return samples // iteration


def scheduler_state(payload: dict) -> dict:
    """Megatron's OptimizerParamScheduler.state_dict(), in samples (megatron-lite counts iterations)."""
    lite, gbs = payload["opt_param_scheduler"], global_batch_size(payload)
    wd = max([float(g["weight_decay"]) for g in payload["optimizer"].get("param_groups", [])] + [0.0])
    return {"max_lr": float(lite["max_lr"]), "lr_warmup_steps": int(lite["lr_warmup_steps"]) * gbs,
            "num_steps": int(lite["num_steps"]) * gbs, "lr_decay_style": lite["lr_decay_style"],
            "lr_decay_steps": int(lite["lr_decay_steps"]) * gbs, "min_lr": float(lite["min_lr"]),
            "start_wd": wd, "end_wd": wd, "wd_incr_style": "constant",
            "wd_incr_steps": int(lite["lr_decay_steps"]) * gbs}


def rng_state(payload: dict) -> list:
    """Megatron-LM's rng_state list (one entry: not --data-parallel-random-init) from rank 0's generators."""
    if not payload.get("rng_state"):
        return []
    lite = payload["rng_state"][0]
    version, internal, gauss = lite["python"]
    numpy_state = tuple(x.numpy().astype(np.uint32) if isinstance(x, torch.Tensor) else x for x in lite["numpy"])
    entry = {"random_rng_state": (version, tuple(internal), gauss), "np_rng_state": numpy_state,
             "torch_rng_state": lite["torch"], "rng_tracker_states": {}}
    if "cuda" in lite:
        entry["cuda_rng_state"] = lite["cuda"]
    return [entry]


def megatron_args(payload: dict, ckpt_format: str, with_optimizer: bool) -> argparse.Namespace:
    """The args Namespace Megatron-LM's load_checkpoint / check_checkpoint_args / --use-checkpoint-args read."""
    a = payload["args"]
    heads, groups = _heads(a)
    rope = a.get("position_embedding_type") == "rope"
    return argparse.Namespace(
        num_layers=int(a["num_layers"]), hidden_size=int(a["hidden_size"]), num_attention_heads=heads,
        ffn_hidden_size=int(payload["model"]["layers.0.mlp.linear_fc2.weight"].shape[1]),  # as built (None: a default)
        kv_channels=int(a["hidden_size"]) // heads,
        group_query_attention=bool(a.get("group_query_attention")), num_query_groups=groups,
        max_position_embeddings=int(a.get("max_position_embeddings", 0)),
        # add_position_embedding: Megatron-LM's --no-position-embedding (default True, also with rope, whose
        # core GPT reads position_embedding_type); check_checkpoint_args compares it with the run's always.
        position_embedding_type="rope" if rope else "learned_absolute", add_position_embedding=True,
        use_rotary_position_embeddings=rope, rotary_base=int(float(a.get("rotary_base", 10000))), rotary_percent=1.0,
        rotary_interleaved=False, add_bias_linear=not a.get("disable_bias_linear"),
        add_qkv_bias=not a.get("disable_bias_linear"), disable_bias_linear=bool(a.get("disable_bias_linear")),
        swiglu=bool(a.get("swiglu")), openai_gelu=bool(a.get("openai_gelu")), squared_relu=False,
        bias_gelu_fusion=bool(a.get("openai_gelu")) and not a.get("disable_bias_linear"),
        untie_embeddings_and_output_weights=bool(a.get("untie_embeddings_and_output_weights")),
        apply_layernorm_1p=False, normalization=a.get("normalization", "LayerNorm"),
        norm_epsilon=float(a.get("norm_epsilon", 1e-5)), apply_query_key_layer_scaling=False,
        attention_dropout=float(a.get("attention_dropout", 0.0)), hidden_dropout=float(a.get("hidden_dropout", 0.0)),
        init_method_std=float(a.get("init_method_std", 0.02)), num_experts=None,
        padded_vocab_size=int(a["padded_vocab_size"]), make_vocab_size_divisible_by=128,
        # The run's tokenizer as recorded (what --from megatron gives back; Megatron-LM reads these only with
        # --use-tokenizer-model-from-checkpoint-args): the printed flags spell it in Megatron-LM's terms, and so
        # does NullTokenizer's vocab_size (the ids before Megatron-LM's eod, as a Megatron-LM run records it).
        tokenizer_type=a.get("tokenizer_type"), tokenizer_model=a.get("tokenizer_model"),
        vocab_file=a.get("vocab_file"), merge_file=a.get("merge_file"),
        vocab_size=_megatron_tokenizer(a)[1] if a.get("tokenizer_type") == "NullTokenizer" else a.get("vocab_size"),
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1, context_parallel_size=1, ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format != "torch",
        global_batch_size=global_batch_size(payload) if with_optimizer else None,
        consumed_train_samples=int(payload.get("consumed_train_samples", 0)), skipped_train_samples=0,
        consumed_valid_samples=0, iteration=int(payload["iteration"]), no_save_optim=not with_optimizer,
        no_save_rng=False, data_parallel_random_init=False, bf16=_dtype(payload) == torch.bfloat16,
        fp16=_dtype(payload) == torch.float16)


def _dtype(payload: dict) -> torch.dtype:
    return next(iter(payload["model"].values())).dtype


# ------------------------------------------------------------------------------------------ writers
class _BytesAsIs(DefaultSavePlanner):
    """megatron-core's planner behaviour for ShardedObjects: the bytes are already torch.save'd; write them as they
    are (the default planner would serialize the BytesIO object a second time)."""

    def transform_object(self, write_item, object):
        return object if isinstance(object, io.BytesIO) else super().transform_object(write_item, object)


def _object_bytes(data) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save([data], buffer)  # megatron-core stores the list of a key's objects (one here)
    buffer.seek(0)
    return buffer


def _write_torch_dist(directory: str, payload: dict, with_optimizer: bool):
    args = payload["args"]
    layers = int(args["num_layers"])
    model = _stacked(model_state(payload, "transformer_engine"), layers)
    entries = dict(model)
    for i in range(layers):  # ShardedObject unique keys: KEY/shard_{offset}_{global shape}
        for module in _EXTRA_STATE_TE:
            entries[f"decoder.layers.{module}._extra_state/shard_{i}_{layers}"] = _object_bytes(None)
    common = {"args": megatron_args(payload, "torch_dist", with_optimizer),
              "checkpoint_version": MEGATRON_CHECKPOINT_VERSION, "iteration": int(payload["iteration"]),
              "num_floating_point_operations_so_far": 0}
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    rng = rng_state(payload)
    if rng:  # ShardedObject 'rng_state' of global shape (PP, TP) = (1, 1)
        entries["rng_state/shard_0.0_1.1"] = _object_bytes(rng)
    if with_optimizer:
        common["optimizer"] = _torch_dist_optimizer(payload, model, layers, entries)
        common["opt_param_scheduler"] = scheduler_state(payload)
        # Read by Megatron-LM's load only with --use-distributed-optimizer: the form of the state below.
        metadata.update(distrib_optim_sharding_type="fully_reshardable",
                        distrib_optim_fully_reshardable_mem_efficient=False)
    common["content_metadata"] = metadata
    torch.save(common, os.path.join(directory, "common.pt"))
    with warnings.catch_warnings():  # one process, no process group: exactly what no_dist is for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(entries, checkpoint_id=directory, planner=_BytesAsIs(flatten_state_dict=False), no_dist=True)
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)


def _torch_dist_optimizer(payload: dict, model: Dict[str, torch.Tensor], layers: int, entries: dict) -> dict:
    """Adam's state in both forms megatron-core loads, so that one export loads with and without
    --use-distributed-optimizer: the tensors (added to `entries`) are exp_avg, exp_avg_sq and 'param' (the
    distributed optimizer's fully_reshardable fp32 main values; 'fp32_param' for the non-distributed optimizer of
    bf16 / fp16 weights); the returned common part holds the param groups and step where each reads them."""
    fields = {k: _stacked(v, layers) for k, v in _optimizer_tensors(payload, "transformer_engine").items()}
    names = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "param": "param"}
    for field, stored in list(names.items()) + ([("param", "fp32_param")] if _dtype(payload) != torch.float32 else []):
        entries.update({f"optimizer.state.{stored}.{key}": t for key, t in fields[field].items()})
    step = _step(payload)
    # The step in each group too: where the distributed optimizer (and Transformer Engine's FusedAdam) reads it.
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": step}
              for g in param_groups(payload, list(model), model)]
    torch_state = {"state": {"common_step": torch.tensor(float(step))}, "param_groups": groups}
    distributed = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}
    if _dtype(payload) == torch.float32:  # FP32Optimizer's state dict is torch's, beside the distributed one's keys
        return {**torch_state, **distributed}
    # Float16OptimizerWithFloat16Params nests torch's under 'optimizer', where the distributed one has its groups.
    return _with_scaler({**distributed, "optimizer": {**torch_state}}, payload)


def _write_legacy(directory: str, payload: dict, transformer_impl: str, with_optimizer: bool):
    layers = int(payload["args"]["num_layers"])
    weights = model_state(payload, transformer_impl)
    # GPTModel.state_dict()'s order (readers take the parameters' order from it), `_extra_state` entries included.
    model = {k: weights.get(k) for k in state_dict_order(layers, transformer_impl) if k in weights or
             k.endswith("._extra_state")}
    state = {"args": megatron_args(payload, "torch", with_optimizer),
             "checkpoint_version": MEGATRON_CHECKPOINT_VERSION, "iteration": int(payload["iteration"]),
             "model": model, "num_floating_point_operations_so_far": 0}
    rng = rng_state(payload)
    if rng:
        state["rng_state"] = rng
    if with_optimizer:
        order = [k for k in model if not k.endswith("._extra_state")]  # named_parameters(): the optimizer's ids
        groups = param_groups(payload, order, weights)
        fields = _optimizer_tensors(payload, transformer_impl)
        step = torch.tensor(float(_step(payload)))
        ids = {key: i for i, key in enumerate(k for g in groups for k in g["params"])}
        per_param = {ids[key]: {"step": step.clone(), "exp_avg": fields["exp_avg"][key],
                                "exp_avg_sq": fields["exp_avg_sq"][key]} for key in ids}
        inner = {"state": per_param, "param_groups": [{**g, "params": [ids[k] for k in g["params"]],
                                                       "step": int(step.item())} for g in groups]}
        if _dtype(payload) != torch.float32:  # Float16OptimizerWithFloat16Params: the fp32 main params by group
            inner = _with_scaler({"optimizer": inner, "fp32_from_fp16_params": [
                [fields["param"][k] for k in g["params"]] for g in groups]}, payload)
        state["optimizer"] = inner
        state["opt_param_scheduler"] = scheduler_state(payload)
    os.makedirs(os.path.join(directory, "mp_rank_00"))
    torch.save(state, os.path.join(directory, LEGACY_FILENAME))


def export(output: str, payload: dict, ckpt_format: str = "torch_dist",
           transformer_impl: str = "transformer_engine") -> dict:
    """Write `payload` (the `torch` format's) as a Megatron-LM checkpoint in the new directory `output`, atomically
    (a temporary sibling renamed into place once complete). Returns {'optimizer': whether Adam's state was written,
    'global_batch_size'}. Raises ValueError naming what cannot be exported."""
    if ckpt_format not in FORMATS:
        raise ValueError(f"megatron_format must be one of {FORMATS}, got {ckpt_format!r}")
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, got {transformer_impl!r}")
    if os.path.lexists(output):
        raise ValueError(f"--output {output} exists: choose a new directory")
    check_exportable(payload)
    with_optimizer = has_adam_state(payload) and files.WEIGHTS_ONLY_KEY not in payload
    gbs = global_batch_size(payload) if with_optimizer else None
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp_{os.path.basename(output)}_", dir=parent)
    try:
        iteration = int(payload["iteration"])
        directory = os.path.join(tmp, f"iter_{iteration:07d}")
        os.makedirs(directory)
        if ckpt_format == "torch_dist":
            _write_torch_dist(directory, payload, with_optimizer)
        else:
            _write_legacy(directory, payload, transformer_impl, with_optimizer)
        with open(os.path.join(tmp, files.TRACKER_FILENAME), "w") as f:
            f.write(str(iteration))
        os.chmod(tmp, 0o777 & ~files._umask())  # mkdtemp makes it 0700; the other outputs follow the umask
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"optimizer": with_optimizer, "global_batch_size": gbs}


def _megatron_tokenizer(args: dict):
    """(Megatron-LM's --tokenizer-type, its --vocab-size) for the run's ids: Megatron's NullTokenizer adds the
    end-of-document id after --vocab-size ids (megatron-lite's counts it among them); ByteLevelTokenizer has no
    Megatron-LM type, its ids (bytes, eod 256) are NullTokenizer's of 256."""
    kind = args.get("tokenizer_type")
    if kind == "NullTokenizer" and args.get("vocab_size"):
        return kind, int(args["vocab_size"]) - 1
    if kind == "ByteLevelTokenizer":
        return "NullTokenizer", 256
    return kind, args.get("vocab_size")


def tokenizer_flags(args: dict) -> List[str]:
    """Megatron-LM's tokenizer flags giving the run's ids (_megatron_tokenizer, the recorded files); [] where
    nothing is recorded."""
    kind, vocab_size = _megatron_tokenizer(args)
    if kind == "NullTokenizer" and vocab_size:
        return ["--tokenizer-type", kind, "--vocab-size", str(vocab_size)]
    if kind == "GPT2BPETokenizer" and args.get("vocab_file") and args.get("merge_file"):
        return ["--tokenizer-type", kind, "--vocab-file", args["vocab_file"], "--merge-file", args["merge_file"]]
    model = args.get("tokenizer_model")
    if kind == "HuggingFaceTokenizer" and model and not os.path.isdir(model) and os.path.basename(model) == \
            "tokenizer.json":  # megatron-core's AutoTokenizer.from_pretrained takes the directory, not the file
        model = os.path.dirname(model) or "."
    if kind and model:
        return ["--tokenizer-type", kind, "--tokenizer-model", model]
    return []


def megatron_flags(payload: dict, output: str, ckpt_format: str, transformer_impl: str,
                   with_optimizer: bool) -> List[str]:
    """Megatron-LM pretrain_gpt.py flags that build this model and load the export (a torch_dist export loads with
    --use-distributed-optimizer too; a legacy one only without)."""
    a = megatron_args(payload, ckpt_format, with_optimizer)
    flags = ["--load", output, "--ckpt-format", ckpt_format, "--transformer-impl", transformer_impl,
             "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
             "--num-attention-heads", str(a.num_attention_heads), "--ffn-hidden-size", str(a.ffn_hidden_size),
             "--max-position-embeddings", str(a.max_position_embeddings),
             "--position-embedding-type", a.position_embedding_type, "--normalization", a.normalization,
             "--norm-epsilon", str(a.norm_epsilon), "--attention-dropout", str(a.attention_dropout),
             "--hidden-dropout", str(a.hidden_dropout)]
    if a.position_embedding_type == "rope":
        flags += ["--rotary-base", str(a.rotary_base)]
    if a.group_query_attention:
        flags += ["--group-query-attention", "--num-query-groups", str(a.num_query_groups)]
    # Megatron-LM's core GPT ignores --openai-gelu: with linear biases its default bias-GELU fusion computes GELU's
    # tanh form (megatron-core's bias_gelu_impl), --no-bias-gelu-fusion the exact one; without biases, the exact one.
    if not a.swiglu and a.add_bias_linear and not a.openai_gelu:
        flags += ["--no-bias-gelu-fusion"]
    flags += [f for f, on in (("--swiglu", a.swiglu),
                              ("--disable-bias-linear", not a.add_bias_linear),
                              ("--untie-embeddings-and-output-weights", a.untie_embeddings_and_output_weights),
                              ("--bf16", a.bf16), ("--fp16", a.fp16)) if on]
    flags += tokenizer_flags(payload["args"])
    if not with_optimizer:
        return flags + ["--finetune"]  # weights only: iteration 0, no optimizer, no RNG
    groups = payload["optimizer"]["param_groups"]
    g = next((x for x in groups if float(x.get("wd_mult", 1.0)) == 1.0), groups[0])
    flags += ["--optimizer", "adam", "--adam-beta1", str(g["betas"][0]), "--adam-beta2", str(g["betas"][1]),
              "--adam-eps", str(g["eps"]), "--weight-decay", str(g["weight_decay"]),
              "--lr", str(payload["opt_param_scheduler"]["max_lr"]),
              "--min-lr", str(payload["opt_param_scheduler"]["min_lr"]),
              "--global-batch-size", str(global_batch_size(payload)),
              "--use-checkpoint-opt_param-scheduler", "--no-load-rng"]
    scaler = payload["optimizer"].get("grad_scaler")
    if scaler and "growth_tracker" not in scaler:  # Megatron's ConstantGradScaler: built from --loss-scale alone
        flags += ["--loss-scale", str(float(scaler["scale"]))]
    return flags
