"""A Megatron-LM checkpoint read into the `torch` format's payload (torch_format.py): tools/checkpoint_convert.py
--from megatron. Both formats Megatron-LM writes (megatron/training/checkpointing.py, megatron-core 0.16)::

    SAVE/latest_checkpointed_iteration.txt   the newest iteration
    SAVE/iter_0000100/                        --ckpt-format torch_dist (Megatron-LM's default)
        metadata.json                         {"sharded_backend": "torch_dist", ...}
        .metadata, __*_*.distcp               DCP: model tensors (layers stacked: [num_layers, ...], norms under
                                              Transformer Engine's names), optimizer tensors, pickled objects
                                              (rng_state, Transformer Engine's _extra_state)
        common.pt                             args (an argparse.Namespace), iteration, opt_param_scheduler, the
                                              optimizer's param groups and step
    SAVE/iter_0000100/mp_rank_00/model_optim_rng.pt   --ckpt-format torch: the same dict, one pickle

What moves, and how (megatron_lm.py maps the names and regroups the fused QKV rows, of weights and moments):
  * weights, always; the vocabulary keeps Megatron's padding (args.padded_vocab_size);
  * the Adam state where the checkpoint carries it: exp_avg, exp_avg_sq, the step, fp32 main params if present,
    from the non-distributed optimizer (torch_dist: optimizer.state.<field>.<model key>; torch: torch's state
    dict by parameter index, mapped to names by megatron-core's param-group order) or the distributed
    optimizer's forms: torch_dist 'fully_reshardable' (the same keys) and 'dp_reshardable' (Megatron-LM's
    default: flat per-bucket buffers, cut by distributed/layout.py, whose layout is megatron-core's), legacy
    distrib_optim.pt (the buckets one after the other). Several optimizers (experts), an fp16 loss scaler, an
    unknown bucket layout are refused (OptimizerStateUnreadable) naming the remedy;
  * iteration, consumed samples (args.consumed_train_samples), the learning-rate schedule (Megatron counts it in
    samples: divided by the global batch size into megatron-lite's iterations, refused where that is inexact);
  * the RNG: Python's, numpy's, torch's (and CUDA's) generator states, per data-parallel rank as Megatron
    stored them, as rng.py's {'python', 'numpy', 'torch'[, 'cuda']}. The model-parallel CUDA RNG tracker's
    states have no counterpart in megatron-lite (no tensor parallelism) and are left out;
  * the architecture: Megatron-LM's args -> the args dict save.checkpoint_args records (flags GPTModel cannot
    express are refused by name).

No pickled code runs: every pickle (common.pt, .metadata, the DCP byte objects, model_optim_rng.pt,
distrib_optim.pt) is read by foreign_pickle.py (torch's weights-only unpickler; classes it does not allow become
inert placeholders).
"""

import argparse
import io
import json
import os
import re
import warnings
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..optimizer import no_weight_decay
from . import dcp_metadata, files, foreign_pickle, megatron_lm
from .megatron_lm import LEGACY_FILENAME

FULLY_RESHARDABLE_REMEDY = ("re-save it in Megatron-LM with --ckpt-format torch_dist "
                            "--dist-ckpt-optim-fully-reshardable (load it and save again), or convert the weights "
                            "only (--weights-only) and train on with pretrain_gpt.py --finetune")


class OptimizerStateUnreadable(ValueError):
    """The checkpoint's optimizer state is in a form this reader does not convert (the weights are readable)."""


# ------------------------------------------------------------------------------------------ finding the files
def find_checkpoint(root: str, iteration: Optional[int] = None) -> Tuple[int, str, str]:
    """(iteration, directory, 'torch_dist' | 'torch') of the checkpoint under Megatron-LM's --save `root` (the
    tracker's iteration unless `iteration` is given), or of `root` itself if it is an iter_* directory."""
    if re.fullmatch(r"iter_\d{7}|release", os.path.basename(os.path.normpath(root))) and iteration is None:
        directory = os.path.normpath(root)
        name = os.path.basename(directory)
        iteration = 0 if name == "release" else int(name[len("iter_"):])
    else:
        if iteration is None:
            tracker = os.path.join(root, files.TRACKER_FILENAME)
            if not os.path.isfile(tracker):
                raise ValueError(f"--input {root} has no {files.TRACKER_FILENAME}: give a Megatron-LM --save "
                                 f"directory, an iter_* directory in it, or --iteration N")
            with open(tracker) as f:
                text = f.read().strip()
            if text != "release" and not text.isdigit():
                raise ValueError(f"{tracker} holds {text!r}, not an iteration: give --iteration N")
            iteration = 0 if text == "release" else int(text)
            directory = os.path.join(root, "release" if text == "release" else f"iter_{iteration:07d}")
        else:
            directory = os.path.join(root, f"iter_{iteration:07d}")
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint directory {directory} does not exist: check --input / --iteration")
    if os.path.isfile(os.path.join(directory, "metadata.json")):
        with open(os.path.join(directory, "metadata.json")) as f:
            backend = json.load(f).get("sharded_backend")
        if backend != "torch_dist":
            raise ValueError(f"{directory}/metadata.json: sharded_backend {backend!r} cannot be read, only "
                             f"'torch_dist': re-save it in Megatron-LM with --ckpt-format torch_dist")
        return iteration, directory, "torch_dist"
    entries = sorted(os.listdir(directory))
    parallel = [e for e in entries if e.startswith("mp_rank_") and e != "mp_rank_00"]
    if parallel:
        raise ValueError(f"{directory} holds {parallel[:3]}: a tensor- or pipeline-parallel legacy checkpoint; only "
                         f"mp_rank_00 alone is read. Re-save it in Megatron-LM with --ckpt-format torch_dist "
                         f"(global tensors, any parallelism)")
    if not os.path.isfile(os.path.join(directory, LEGACY_FILENAME)):
        own = os.path.isfile(os.path.join(directory, files.MANIFEST_FILENAME))
        raise ValueError(f"{directory} has neither metadata.json (torch_dist) nor {LEGACY_FILENAME} (torch): not a "
                         f"Megatron-LM checkpoint; " + ("it is megatron-lite's own (manifest.json): give it to "
                         "pretrain_gpt.py --load as it is, or convert it without --from" if own else
                         "give --input a Megatron-LM --save directory"))
    return iteration, directory, "torch"


# ------------------------------------------------------------------------------------------ torch_dist
class _Reader(dcp.FileSystemReader):
    """DCP's file reader with .metadata read without running code (dcp_metadata.py, byte entries allowed: the
    planner below keeps them as bytes for foreign_pickle)."""

    def read_metadata(self, *args, **kwargs):
        metadata = dcp_metadata.read_metadata(os.path.join(self.path, ".metadata"), allow_bytes=True)
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class _RawBytesPlanner(DefaultLoadPlanner):
    """DCP's planner keeping byte objects as bytes (DCP's own would torch.load them unrestricted)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value):
        self.state_dict[read_item.dest_index.fqn] = value.read()


def read_torch_dist(directory: str, want) -> Tuple[dict, Dict[str, torch.Tensor], Dict[str, object]]:
    """(common.pt, {key: tensor} of every tensor for which want(key) holds, {key: unpickled object} of the byte
    objects for which want(key) holds)."""
    common = foreign_pickle.load(os.path.join(directory, "common.pt"), f"{directory}/common.pt")
    reader = _Reader(directory)
    metadata = reader.read_metadata().state_dict_metadata
    request = {}
    for key, meta in metadata.items():
        if want(key):
            tensor_like = isinstance(meta, TensorStorageMetadata)
            request[key] = torch.empty(meta.size, dtype=meta.properties.dtype) if tensor_like else io.BytesIO()
    with warnings.catch_warnings():  # one process, no process group: exactly what no_dist is for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(request, storage_reader=reader, planner=_RawBytesPlanner(), no_dist=True)
    tensors = {k: v for k, v in request.items() if isinstance(v, torch.Tensor)}
    objects = {k: foreign_pickle.load(v, f"{directory}: {k}") for k, v in request.items() if isinstance(v, bytes)}
    return common, tensors, objects


def _unstack(tensors: Dict[str, torch.Tensor], num_layers: int, where: str) -> Dict[str, torch.Tensor]:
    """megatron-core's stacked layer tensors `decoder.layers.<rest>` [L, ...] -> `decoder.layers.<i>.<rest>`."""
    out = {}
    for key, tensor in tensors.items():
        if key.startswith("decoder.layers.") and not key[len("decoder.layers."):].split(".")[0].isdigit():
            if tensor.dim() == 0 or tensor.shape[0] != num_layers:
                raise ValueError(f"{where}: {key} of shape {list(tensor.shape)} does not stack num_layers="
                                 f"{num_layers} layers: the checkpoint's args do not describe its tensors")
            rest = key[len("decoder.layers."):]
            out.update({f"decoder.layers.{i}.{rest}": tensor[i].clone() for i in range(num_layers)})
        else:
            out[key] = tensor
    return out


# ------------------------------------------------------------------------------------------ the whole read
def read_megatron(root: str, iteration: Optional[int] = None,
                  weights_only: bool = False) -> Tuple[dict, argparse.Namespace]:
    """Megatron-LM's checkpoint (see the module docstring) -> (the `torch` format's payload, Megatron-LM's args).
    With `weights_only`, a weights-only checkpoint at iteration 0 (files.WEIGHTS_ONLY_KEY), for pretrain_gpt.py
    --finetune.

    Raises:
        ValueError naming the file, field or key, and the remedy; OptimizerStateUnreadable (a ValueError) when
        the weights are readable but the optimizer state's form is not (convert with weights_only then).
    """
    iteration, directory, fmt = find_checkpoint(root, iteration)
    if fmt == "torch_dist":
        common, tensors, objects = read_torch_dist(directory, lambda k: "_extra_state" not in k and not (
            weights_only and k.startswith("optimizer.")))
        args = _namespace(common.get("args"), f"{directory}/common.pt")
        model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
        model = _unstack(model, args.num_layers, directory)
        rng = next((v for k, v in objects.items() if k.startswith("rng_state/")), None)
        state = dict(common, rng_state=rng)
    else:
        state = foreign_pickle.load(os.path.join(directory, LEGACY_FILENAME), os.path.join(directory, LEGACY_FILENAME))
        if not isinstance(state, dict) or "model" not in state:
            raise ValueError(f"{directory}/{LEGACY_FILENAME} holds no 'model': not a Megatron-LM checkpoint")
        args = _namespace(state.get("args"), f"{directory}/{LEGACY_FILENAME}")
        model = {k: v for k, v in state["model"].items()
                 if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
        tensors, objects = {}, {}
    lite_args = megatron_args_to_lite(args)
    heads, groups = args.num_attention_heads, lite_args["num_query_groups"] or args.num_attention_heads
    weights = megatron_lm.state_from_megatron(model, heads, groups)
    _check_model(weights, lite_args, directory)
    if weights_only:
        return {"checkpoint_version": files.CHECKPOINT_VERSION, "iteration": 0, "consumed_train_samples": 0,
                "model": weights, "optimizer": {"state": {}}, "opt_param_scheduler": {}, "rng_state": [],
                "args": lite_args, files.WEIGHTS_ONLY_KEY: f"imported from {os.path.abspath(directory)} by "
                                                           f"tools/checkpoint_convert.py --from megatron --weights-only"
                }, args
    if "optimizer" not in state:
        raise OptimizerStateUnreadable(f"{directory} holds no optimizer state (saved with --no-save-optim): "
                                       f"convert the weights only (--weights-only) and train with --finetune")
    if fmt == "torch_dist":
        optimizer = _optimizer_torch_dist(state["optimizer"], tensors, objects, model, args, directory)
    elif isinstance(state["optimizer"], dict) and set(state["optimizer"]) <= {"optimizer", "grad_scaler"}:
        _refuse_loss_scaler(state["optimizer"], directory)  # the distributed optimizer: distrib_optim.pt
        optimizer = _optimizer_distrib_optim_pt(state["optimizer"], model, args, directory)
    else:
        optimizer = _optimizer_legacy(state["optimizer"], model, directory)
    optimizer = _to_lite_optimizer(optimizer, model, heads, groups, directory)
    return {"checkpoint_version": files.CHECKPOINT_VERSION, "iteration": int(state.get("iteration", iteration)),
            "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0), "model": weights,
            "optimizer": optimizer, "opt_param_scheduler": scheduler_to_lite(state.get("opt_param_scheduler"), args,
                                                                      int(state.get("iteration", iteration))),
            "rng_state": rng_to_lite(state.get("rng_state"), state), "args": lite_args}, args


def _namespace(args, where: str) -> argparse.Namespace:
    if not isinstance(args, argparse.Namespace):
        raise ValueError(f"{where}: 'args' is a {type(args).__name__}, not Megatron-LM's argparse.Namespace: "
                         f"the architecture is unknown, not a Megatron-LM checkpoint")
    return args


def gpt_config(lite_args: dict):
    """The GPTConfig of megatron_args_to_lite's args (pretrain_gpt.py's mapping of those flags, fp32)."""
    from ..models import GPTConfig

    activation = "openai_gelu" if lite_args.get("openai_gelu") else "gelu"
    return GPTConfig(
        num_layers=lite_args["num_layers"], hidden_size=lite_args["hidden_size"],
        num_attention_heads=lite_args["num_attention_heads"], vocab_size=lite_args["padded_vocab_size"],
        max_position_embeddings=lite_args["max_position_embeddings"], ffn_hidden_size=lite_args["ffn_hidden_size"],
        normalization=lite_args["normalization"], gated_linear_unit=lite_args["swiglu"],
        activation_func="silu" if lite_args["swiglu"] else activation,
        num_query_groups=lite_args["num_query_groups"] or lite_args["num_attention_heads"],
        add_bias_linear=not lite_args["disable_bias_linear"],
        position_embedding_type="rope" if lite_args["position_embedding_type"] == "rope" else "learned",
        rotary_base=lite_args["rotary_base"], layernorm_epsilon=lite_args["norm_epsilon"],
        share_embeddings_and_output_weights=not lite_args["untie_embeddings_and_output_weights"])


def _check_model(weights: Dict[str, torch.Tensor], lite_args: dict, where: str):
    """The weights are exactly GPTModel's of `lite_args`: names and shapes."""
    from ..models import GPTModel

    with torch.device("meta"):
        model = GPTModel(gpt_config(lite_args))
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.config.share_embeddings_and_output_weights:  # the embedding's second name: Megatron stores it once
        expected.pop("output_layer.weight", None)
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{where}: the weights do not match the checkpoint's args: missing "
                         f"{[megatron_lm.name_to_megatron(k) for k in missing[:4]]}, unexpected {unexpected[:4]}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != tuple(shape):
            raise ValueError(f"{where}: {megatron_lm.name_to_megatron(name)} has shape {list(weights[name].shape)}, "
                             f"the checkpoint's args make {list(shape)}")


# ------------------------------------------------------------------------------------------ optimizer
def _adam_entry(fields: Dict[str, torch.Tensor], step, where: str) -> Dict[str, torch.Tensor]:
    if not {"exp_avg", "exp_avg_sq"} <= set(fields):
        raise OptimizerStateUnreadable(f"{where}: optimizer state with fields {sorted(fields)}, not Adam's "
                                       f"exp_avg / exp_avg_sq: convert the weights only (--weights-only)")
    other = sorted(set(fields) - {"exp_avg", "exp_avg_sq", "param"})
    if other:  # e.g. FusedAdam's 'master_param' (--use-precision-aware-optimizer), amsgrad's max_exp_avg_sq
        raise OptimizerStateUnreadable(f"{where}: optimizer state field(s) {other} are not converted (only "
                                       f"exp_avg, exp_avg_sq, the step and the fp32 main params): convert the "
                                       f"weights only (--weights-only)")
    return {**fields, "step": step}


def _param_groups(groups, where: str) -> List[dict]:
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise OptimizerStateUnreadable(f"{where}: the optimizer's param_groups cannot be read (a "
                                       f"{type(groups).__name__}): convert the weights only (--weights-only)")
    return groups


def _optimizer_torch_dist(saved, tensors: Dict[str, torch.Tensor], objects: Dict[str, object],
                          model: Dict[str, torch.Tensor], args, where: str) -> dict:
    """torch_dist: the non-distributed optimizer (optimizer.state.<field>.<key>, the step in common.pt), the
    distributed one's fully_reshardable form (the same keys, 'param' too, the step in each param group) or its
    dp_reshardable form (_optimizer_dp_reshardable)."""
    if isinstance(saved, dict) and "param_state_sharding_type" in saved:
        form = saved["param_state_sharding_type"]
        if form == "dp_reshardable":
            return _optimizer_dp_reshardable(tensors, objects, model, args, where)
        if form != "fully_reshardable":
            raise OptimizerStateUnreadable(
                f"{where}: the distributed optimizer's state is stored as {form!r}, a form not converted (only "
                f"dp_reshardable and fully_reshardable are): {FULLY_RESHARDABLE_REMEDY}")
        groups = _param_groups(saved.get("optimizer", {}).get("param_groups"), where)
        step = groups[0].get("step") if groups else None
    elif isinstance(saved, dict) and "state" in saved and "param_groups" in saved:  # FP32Optimizer
        groups, step = _param_groups(saved["param_groups"], where), saved["state"].get("common_step")
    elif isinstance(saved, dict) and isinstance(saved.get("optimizer"), dict):  # Float16OptimizerWithFloat16Params
        inner = saved["optimizer"]
        groups, step = _param_groups(inner.get("param_groups"), where), inner.get("state", {}).get("common_step")
        _refuse_loss_scaler(saved, where)
    else:
        raise OptimizerStateUnreadable(f"{where}: the optimizer state's form ({type(saved).__name__} with "
                                       f"{sorted(saved)[:4] if isinstance(saved, dict) else ''}) is not one this "
                                       f"reader knows (a chained optimizer of several?): convert the weights only "
                                       f"(--weights-only)")
    if step is None and groups:  # FusedAdam (Transformer Engine's, apex's) counts it per group, not per parameter
        step = groups[0].get("step")
    per_key: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if key.startswith("optimizer.state."):
            field, model_key = key[len("optimizer.state."):].split(".", 1)
            per_key.setdefault(model_key, {})["param" if field == "fp32_param" else field] = tensor
    if not per_key:
        raise OptimizerStateUnreadable(f"{where}: no optimizer.state.* tensors: convert the weights only "
                                       f"(--weights-only)")
    state = _unstack_state(per_key, args.num_layers, where)
    return {"groups": groups, "state": {k: _adam_entry(v, step, f"{where}: {k}") for k, v in state.items()}}


def _object(objects: Dict[str, object], key: str, where: str):
    """A ShardedObject of one shard (torch_dist stores it wrapped in a list)."""
    found = [v for k, v in objects.items() if k.split("/")[0] == key]
    if len(found) != 1:
        raise OptimizerStateUnreadable(f"{where}: {key} is {'missing' if not found else 'stored in several shards'}: "
                                       f"{FULLY_RESHARDABLE_REMEDY}")
    value = found[0]
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def registration_order(names) -> List[str]:
    """megatron-core GPTModel's parameter registration order from its unstacked names in the order torch_dist's
    index lists them (every per-layer name of layer 0, then of layer 1, ...: the stacked keys in module order):
    embeddings, layer by layer, then the final norm and the output layer."""
    layer = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
    per_layer, layers, before, after = [], set(), [], []
    for name in names:
        found = layer.fullmatch(name)
        if found:
            layers.add(int(found.group(1)))
            if found.group(2) not in per_layer:
                per_layer.append(found.group(2))
        else:
            (before if name.startswith("embedding.") else after).append(name)
    return before + [f"decoder.layers.{i}.{rest}" for i in sorted(layers) for rest in per_layer] + after


def _bucket_layouts(order: List[str], model: Dict[str, torch.Tensor], args):
    """The candidate layouts of megatron-core's ParamAndGradBuffer for the distributed optimizer (reverse
    registration order, each parameter at a multiple of 64 elements: distributed/layout.py computes it). Neither
    the bucket size (--ddp-bucket-size, or megatron-core's default with --overlap-grad-reduce) nor whether the
    embedding has a bucket of its own is recorded with certainty: the caller checks each candidate against the
    stored sizes. (The data-parallel size moves only the buckets' end padding, which is never stored.)"""
    from ..distributed.layout import compute_buffer_layout, default_bucket_size

    numels = [model[n].numel() for n in order]
    sizes = (None, getattr(args, "ddp_bucket_size", None), default_bucket_size(getattr(args, "data_parallel_size", 1)))
    embedding = [n == "embedding.word_embeddings.weight" for n in order]
    return [compute_buffer_layout(numels, bucket_size=size, data_parallel_world_size=1,
                                  use_distributed_optimizer=True, shared_embedding=shared)
            for size in dict.fromkeys(sizes) for shared in (None, embedding)]


def _cut_buckets(buckets: List[Dict[str, torch.Tensor]], layout, order, model, where: str):
    """{name: {field: tensor}} from each bucket's flat unpadded tensors {field: [numel_unpadded]}."""
    state = {name: {} for name in order}
    for bucket, fields in zip(layout.buckets, buckets):
        for field, flat in fields.items():
            if flat.numel() != bucket.numel_unpadded:
                raise OptimizerStateUnreadable(f"{where}: a bucket's {field} has {flat.numel()} elements, the layout "
                                               f"{bucket.numel_unpadded}: {FULLY_RESHARDABLE_REMEDY}")
            for index in bucket.param_indices:
                start, end, _ = layout.param_ranges[index]
                name = order[index]
                state[name][field] = flat[start - bucket.start:end - bucket.start].view(model[name].shape)
    return state


def _optimizer_dp_reshardable(tensors, objects, model: Dict[str, torch.Tensor], args, where: str) -> dict:
    """The distributed optimizer's dp_reshardable form: per bucket, flat 'param' / 'exp_avg' / 'exp_avg_sq' of
    the bucket's unpadded elements; the buckets' sizes stored beside them must be a candidate layout's."""
    prefix = "optimizer.distributed.dp_group_idx_0."
    if any(k.startswith("optimizer.distributed.") and not k.startswith(prefix) for k in (*tensors, *objects)):
        raise OptimizerStateUnreadable(f"{where}: the distributed optimizer's state spans several data-parallel "
                                       f"groups (tensor or pipeline parallelism): {FULLY_RESHARDABLE_REMEDY}")
    unpadded = _object(objects, prefix + "per_bucket_numel_unpadded", where)
    if not (isinstance(unpadded, list) and len(unpadded) == 1 and isinstance(unpadded[0], dict)
            and len(unpadded[0]) == 1):
        raise OptimizerStateUnreadable(f"{where}: the distributed optimizer has several grad buffers (mixed dtypes "
                                       f"or experts): {FULLY_RESHARDABLE_REMEDY}")
    (dtypes, bucket_numels), = unpadded[0].items()
    order = registration_order(model)
    layouts = _bucket_layouts(order, model, args)
    layout = next((lay for lay in layouts if [b.numel_unpadded for b in lay.buckets] == list(bucket_numels)), None)
    if layout is None:
        raise OptimizerStateUnreadable(
            f"{where}: the distributed optimizer's buckets hold {list(bucket_numels)} elements, megatron-core's "
            f"layout of this model gives {[b.numel_unpadded for b in layouts[0].buckets]} (a --ddp-bucket-size or "
            f"parameter order this reader does not reproduce): {FULLY_RESHARDABLE_REMEDY}")
    buckets = []
    for b in range(len(layout.buckets)):
        key = f"{prefix}gbuf_idx_0.dtype_{dtypes}.bucket_idx_{b}."
        buckets.append({k[len(key):]: v for k, v in tensors.items() if k.startswith(key)})
    groups = _param_groups(_object(objects, prefix + "optimizer", where).get("param_groups"), where)
    step = groups[0].get("step") if groups else None
    state = _cut_buckets(buckets, layout, order, model, where)
    return {"groups": groups, "state": {k: _adam_entry(v, step, f"{where}: {k}") for k, v in state.items()}}


def _world_ranges(layout):
    """Each parameter's [start, end) with the buckets' unpadded elements one after the other."""
    before, offset = [], 0
    for bucket in layout.buckets:
        before.append(offset - bucket.start)
        offset += bucket.numel_unpadded
    return [(start + before[b], end + before[b]) for start, end, b in layout.param_ranges]


def _optimizer_distrib_optim_pt(saved: dict, model: Dict[str, torch.Tensor], args, directory: str) -> dict:
    """The legacy format's distributed optimizer: the param groups (and step) in model_optim_rng.pt, the tensors
    in distrib_optim.pt: per field one tensor of every bucket's unpadded elements, one bucket after the other
    (DistributedOptimizer.save_parameter_state). Bucket sizes are not stored: exactly one candidate layout must
    give the stored total."""
    path = os.path.join(directory, "mp_rank_00", "distrib_optim.pt")
    if not os.path.isfile(path):
        raise OptimizerStateUnreadable(f"{directory}: the distributed optimizer's state lacks {path}: copy it "
                                       f"from the run, or convert the weights only (--weights-only)")
    flat = foreign_pickle.load(path, path)
    if not (isinstance(flat, dict) and flat.get("buckets_coalesced") and set(flat) == {"buckets_coalesced", 0}
            and len(flat[0]) == 1):
        raise OptimizerStateUnreadable(f"{path}: not one coalesced buffer of one dtype (mixed dtypes, experts, or "
                                       f"an older layout): {FULLY_RESHARDABLE_REMEDY}")
    (world,) = flat[0].values()
    total = world.pop("numel_unpadded", None)
    # Candidates that give the stored total must agree on where each parameter lies in it (they do where the
    # buckets differ only in padding that is not stored).
    by_offsets = {}
    for lay in _bucket_layouts(list(model), model, args):
        if sum(b.numel_unpadded for b in lay.buckets) == total:
            by_offsets.setdefault(tuple(_world_ranges(lay)), lay)
    if len(by_offsets) != 1:
        raise OptimizerStateUnreadable(f"{path}: {len(by_offsets)} layouts of megatron-core's buckets hold its "
                                       f"{total} elements, one must: {FULLY_RESHARDABLE_REMEDY}")
    (layout,) = by_offsets.values()
    bounds = [0]
    for bucket in layout.buckets:
        bounds.append(bounds[-1] + bucket.numel_unpadded)
    buckets = [{field: tensor[lo:hi] for field, tensor in world.items()} for lo, hi in zip(bounds, bounds[1:])]
    groups = _param_groups(saved["optimizer"].get("param_groups"), directory)
    step = groups[0].get("step") if groups else None
    state = _cut_buckets(buckets, layout, list(model), model, path)
    return {"groups": groups, "state": {k: _adam_entry(v, step, f"{path}: {k}") for k, v in state.items()}}


def _unstack_state(per_key, num_layers, where):
    fields = sorted({f for v in per_key.values() for f in v})
    out = {}
    for field in fields:
        stacked = _unstack({k: v[field] for k, v in per_key.items() if field in v}, num_layers, where)
        for k, v in stacked.items():
            out.setdefault(k, {})[field] = v
    return out


def _refuse_loss_scaler(saved: dict, where: str):
    if saved.get("grad_scaler"):
        raise OptimizerStateUnreadable(f"{where}: an fp16 run's loss scaler state (grad_scaler) is not converted: "
                                       f"convert the weights only (--weights-only)")


def _optimizer_legacy(saved, model: Dict[str, torch.Tensor], where: str) -> dict:
    """Legacy torch: torch's optimizer state dict, by parameter index. megatron-core numbers the parameters as
    its param groups list them (optimizer/__init__.py _get_param_groups): the group without overrides first
    (weight decay), then the one for biases and 1-D parameters (wd_mult 0), each in registration order,
    which the model state dict's order is."""
    if isinstance(saved, list):
        raise OptimizerStateUnreadable(f"{where}: a chained optimizer of {len(saved)} (expert or decoupled "
                                       f"parameters) is not converted: convert the weights only (--weights-only)")
    if isinstance(saved, dict) and "param_state_sharding_type" not in saved and "fp32_from_fp16_params" in saved:
        _refuse_loss_scaler(saved, where)
        torch_state, mains = saved["optimizer"], saved["fp32_from_fp16_params"]
    elif isinstance(saved, dict) and "state" in saved and "param_groups" in saved:
        torch_state, mains = saved, None
    else:
        raise OptimizerStateUnreadable(f"{where}: the optimizer state's form ({type(saved).__name__} with "
                                       f"{sorted(saved)[:4] if isinstance(saved, dict) else ''}) is not one this "
                                       f"reader knows: convert the weights only (--weights-only)")
    groups = _param_groups(torch_state["param_groups"], where)
    names = legacy_registration_order(list(model))
    no_decay = {n: no_weight_decay(n, model[n]) for n in names}
    state, index_to_name = {}, {}
    for g, group in enumerate(groups):
        members = [n for n in names if no_decay[n] == (group.get("wd_mult", 1.0) == 0.0)]
        if len(members) != len(group["params"]):
            raise OptimizerStateUnreadable(
                f"{where}: param group {g} (wd_mult {group.get('wd_mult')}) holds {len(group['params'])} parameters, "
                f"megatron-core's default grouping gives {len(members)}: the run used param-group overrides "
                f"(--decoupled-lr, ...), whose order is not reproduced: {FULLY_RESHARDABLE_REMEDY}")
        index_to_name.update(zip(group["params"], members))
        for position, (index, name) in enumerate(zip(group["params"], members)):
            entry = torch_state["state"].get(index)
            if entry is None:
                continue
            fields = {k: v for k, v in entry.items() if k != "step"}
            if mains is not None:
                fields["param"] = mains[g][position]
            for field, value in fields.items():
                if tuple(value.shape) != tuple(model[name].shape):
                    raise OptimizerStateUnreadable(
                        f"{where}: optimizer state {index} {field} has shape {list(value.shape)}, the parameter it "
                        f"maps to ({name}) {list(model[name].shape)}: the param-group order is not megatron-core's "
                        f"default: {FULLY_RESHARDABLE_REMEDY}")
            state[name] = _adam_entry(fields, entry.get("step", group.get("step")),  # FusedAdam: the group's
                                      f"{where}: optimizer state {index}")
    return {"groups": groups, "state": state}


def legacy_registration_order(names: List[str]) -> List[str]:
    """megatron-core GPTModel.named_parameters() order of a legacy model state dict's parameter names (what the
    optimizer's indices follow): embeddings; per layer megatron_lm.LAYER_STATE_DICT_ORDER of the local spec or,
    where the norms carry Transformer Engine's names, of Transformer Engine's; the final norm; the output layer.
    Megatron-LM's own files list them so; a name outside these keeps its place after them."""
    layer = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
    te = any(n.endswith("linear_qkv.layer_norm_weight") for n in names)
    per_layer = megatron_lm.LAYER_STATE_DICT_ORDER["transformer_engine" if te else "local"]

    def rank(item):
        position, name = item
        found = layer.fullmatch(name)
        if name.startswith("embedding."):
            return (0, 0, 0, position)
        if found is None:
            return (2 if name.startswith(("decoder.final_layernorm", "output_layer")) else 3, 0, 0, position)
        if found.group(2) not in per_layer:
            return (3, 0, 0, position)
        return (1, int(found.group(1)), per_layer.index(found.group(2)), position)

    return [name for _, name in sorted(enumerate(names), key=rank)]


def _to_lite_optimizer(saved: dict, model: Dict[str, torch.Tensor], heads: int, groups: int, where: str) -> dict:
    """{'groups': Megatron's param groups, 'state': {megatron name: fields}} -> optimizer_state.py's state dict:
    megatron-lite names, QKV rows regrouped, 'param' (the fp32 main values: the weight itself for fp32 runs)."""
    missing = sorted(set(model) - set(saved["state"]))
    if missing:
        raise OptimizerStateUnreadable(f"{where}: no optimizer state for {missing[:4]}: convert the weights only "
                                       f"(--weights-only)")
    state = {}
    for name, fields in saved["state"].items():
        step = fields.pop("step")
        if step is None:  # 0 would restart Adam's bias correction: updates several times too large
            raise OptimizerStateUnreadable(f"{where}: the optimizer state of {name} has no step (neither per "
                                           f"parameter nor in its param group): convert the weights only "
                                           f"(--weights-only)")
        fields.setdefault("param", model[name])
        # The main params are what the weights were cast from: a mismatch means the state sits at other
        # parameters' positions (megatron-core 0.16.1's fully_reshardable save of several buckets does that).
        if not torch.equal(fields["param"].to(model[name].dtype), model[name]):
            raise OptimizerStateUnreadable(
                f"{where}: the optimizer's main params of {name} differ from the weights: its state is misplaced. "
                f"megatron-core 0.16.1 saves the fully_reshardable form so for a distributed optimizer of several "
                f"buckets (its warning: 'param range exceeds unpadded buffer'); re-save it with Megatron-LM's "
                f"default dp_reshardable form (without --dist-ckpt-optim-fully-reshardable), or convert the weights "
                f"only (--weights-only)")
        entry = {f: (megatron_lm.qkv_from_megatron(v, heads, groups) if megatron_lm.is_qkv(name) else v).to(
            torch.float32, copy=True) for f, v in fields.items()}
        entry["step"] = int(step.item() if isinstance(step, torch.Tensor) else step)
        state[megatron_lm.name_from_megatron(name)] = entry
    schedules = {(g.get("max_lr"), g.get("min_lr")) for g in saved["groups"]}
    if len(schedules) > 1:  # megatron-core's scheduler follows each group's own; megatron-lite's one times lr_mult
        raise OptimizerStateUnreadable(f"{where}: the param groups have learning rates of their own (max_lr, min_lr: "
                                       f"{sorted(schedules, key=str)}; --decoupled-lr or param-group overrides), "
                                       f"which megatron-lite's one schedule does not continue: convert the weights "
                                       f"only (--weights-only)")
    lite_groups = []
    for group in saved["groups"]:
        lite_groups.append({"wd_mult": float(group.get("wd_mult", 1.0)), "lr_mult": float(group.get("lr_mult", 1.0)),
                            "weight_decay": float(group["weight_decay"]), "lr": float(group["lr"]),
                            "betas": tuple(group["betas"]), "eps": float(group["eps"]),
                            "amsgrad": bool(group.get("amsgrad", False)), "maximize": False,
                            "decoupled_weight_decay": bool(group.get("decoupled_weight_decay", True))})
    return {"optimizer": "adam", "param_groups": lite_groups, "grad_scaler": None, "state": state}


# ------------------------------------------------------------------------------------------ the small state
def global_batch_size(args, iteration: int) -> int:
    """args.global_batch_size, or (a checkpoint without it) the consumed samples per iteration."""
    gbs = getattr(args, "global_batch_size", None)
    consumed = getattr(args, "consumed_train_samples", None)
    if gbs is None and iteration and consumed and consumed % iteration == 0:
        gbs = consumed // iteration
    if not isinstance(gbs, int) or gbs <= 0:
        raise ValueError(f"the checkpoint's args.global_batch_size is {gbs!r} (consumed_train_samples {consumed} at "
                         f"iteration {iteration}): the schedule's samples cannot be turned into iterations: convert "
                         f"the weights only (--weights-only)")
    return gbs


def scheduler_to_lite(saved, args, iteration: int) -> dict:
    """Megatron's OptimizerParamScheduler state (steps in samples) -> training/scheduler.py's (iterations)."""
    if not saved:
        return {}
    gbs = global_batch_size(args, iteration)
    if getattr(args, "rampup_batch_size", None):
        raise ValueError(f"args.rampup_batch_size={args.rampup_batch_size}: the schedule's samples do not map to "
                         f"iterations of one batch size: convert the weights only (--weights-only)")
    if saved.get("lr_decay_style") not in ("constant", "linear", "cosine"):
        raise ValueError(f"opt_param_scheduler lr_decay_style={saved.get('lr_decay_style')!r}: megatron-lite has "
                         f"constant, linear and cosine: convert the weights only (--weights-only)")
    if saved.get("start_wd") != saved.get("end_wd"):
        raise ValueError(f"opt_param_scheduler start_wd={saved.get('start_wd')} != end_wd={saved.get('end_wd')}: "
                         f"megatron-lite's weight decay is constant: convert the weights only (--weights-only)")
    if getattr(args, "lr_warmup_init", 0.0):
        raise ValueError(f"args.lr_warmup_init={args.lr_warmup_init}: megatron-lite's warmup starts at 0: convert "
                         f"the weights only (--weights-only)")
    steps = {}
    for key in ("lr_warmup_steps", "lr_decay_steps", "num_steps"):
        if saved[key] % gbs:
            raise ValueError(f"opt_param_scheduler {key}={saved[key]} samples is not a whole number of iterations "
                             f"of global_batch_size={gbs}: convert the weights only (--weights-only)")
        steps[key] = saved[key] // gbs
    return {"max_lr": float(saved["max_lr"]), "min_lr": float(saved["min_lr"]), **steps,
            "lr_decay_style": saved["lr_decay_style"]}


def rng_to_lite(saved, state: dict) -> list:
    """Megatron's per-data-parallel-rank RNG dicts -> rng.py's. Checkpoints older than Megatron's rng_state
    list keep one set at the top level."""
    if saved is None and "random_rng_state" in state:
        saved = [state]
    if not saved:
        return []
    if isinstance(saved, list) and all(isinstance(x, list) for x in saved):  # torch_dist's ShardedObject: nested
        saved = [entry for inner in saved for entry in inner]
    out = []
    for entry in saved:
        if not isinstance(entry, dict) or not {"random_rng_state", "np_rng_state", "torch_rng_state"} <= set(entry):
            raise ValueError(f"rng_state holds {type(entry).__name__} entries, not Megatron's generator states: "
                             f"convert the weights only (--weights-only), or train on without them (--no-load-rng)")
        version, internal, gauss = entry["random_rng_state"]
        lite = {"python": (version, tuple(internal), gauss),
                "numpy": [torch.from_numpy(np.asarray(x).astype(np.int64)) if isinstance(x, np.ndarray) else x
                          for x in entry["np_rng_state"]],
                "torch": entry["torch_rng_state"].clone()}
        if isinstance(entry.get("cuda_rng_state"), torch.Tensor):
            lite["cuda"] = entry["cuda_rng_state"].clone()
        out.append(lite)
    return out


# ------------------------------------------------------------------------------------------ arguments
_REFUSED = {  # Megatron-LM arg -> (the value GPTModel expresses, why)
    "squared_relu": (False, "GPTModel's MLP activations are GELU and SwiGLU"),
    "qk_layernorm": (False, "GPTModel has no query/key norm"),
    "rotary_interleaved": (False, "GPTModel rotates the halves (non-interleaved rope)"),
    "apply_residual_connection_post_layernorm": (False, "GPTModel adds the residual before the norm"),
    "multi_latent_attention": (False, "GPTModel has standard attention"),
    "num_experts": (None, "GPTModel's MLP is dense (megatron-lite's experts are not a Megatron-LM MoE layout)"),
    "use_rope_scaling": (False, "GPTModel's rope is unscaled"),
    "mtp_num_layers": (None, "GPTModel has no multi-token prediction layers"),
    "fp8": (None, "an fp8 run's Transformer Engine state is not converted"),
    "quick_geglu": (False, "GPTModel's MLP activations are GELU and SwiGLU"),
    "use_legacy_models": (False, "the legacy models' layout is not megatron-core's: re-save with the core models"),
    # megatron-core TransformerConfig fields (Megatron-LM's args carry them by name) that change the forward pass.
    "layernorm_zero_centered_gamma": (False, "GPTModel's norms multiply by their weight (--apply-layernorm-1p "
                                             "stores the weight minus one)"),
    "apply_layernorm_1p": (False, "GPTModel's norms multiply by their weight (--apply-layernorm-1p stores the "
                                  "weight minus one)"),
    "softmax_type": ("vanilla", "GPTModel's attention takes the plain softmax"),
    "window_size": (None, "GPTModel's attention is fully causal (no sliding window)"),
    "qk_l2_norm": (False, "GPTModel has no query/key norm"),
    "attention_output_gate": (False, "GPTModel's attention has no output gate"),
    "no_rope_freq": (None, "GPTModel applies rope in every layer"),
    "rotary_seq_len_interpolation_factor": (None, "GPTModel's rope is not interpolated"),
    "experimental_attention_variant": (None, "GPTModel has standard attention"),
    "is_hybrid_model": (False, "GPTModel is a transformer, not a hybrid Mamba model"),
    "heterogeneous_layers_config_path": (None, "GPTModel's layers are all alike"),
    "activation_func_clamp_value": (None, "GPTModel's activations are not clamped"),
    "glu_linear_offset": (0.0, "GPTModel's SwiGLU adds no offset"),
}


def megatron_args_to_lite(a: argparse.Namespace) -> dict:
    """Megatron-LM's args -> the args dict a megatron-lite checkpoint records (save.checkpoint_args's keys).
    Raises ValueError naming the Megatron-LM arg GPTModel cannot express."""
    for key in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size", "max_position_embeddings"):
        if not isinstance(getattr(a, key, None), int):
            raise ValueError(f"the checkpoint's args lack {key}: not a Megatron-LM GPT checkpoint")
    for key, (value, why) in _REFUSED.items():
        if getattr(a, key, value) not in (value, None, False):
            raise ValueError(f"the checkpoint's args.{key}={getattr(a, key)!r} cannot be converted: {why}")
    position = getattr(a, "position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope"):
        raise ValueError(f"the checkpoint's args.position_embedding_type={position!r} cannot be converted: "
                         f"GPTModel has learned_absolute and rope")
    if position == "rope" and getattr(a, "rotary_percent", 1.0) != 1.0:
        raise ValueError(f"the checkpoint's args.rotary_percent={a.rotary_percent} cannot be converted: GPTModel "
                         f"rotates the whole head")
    scale = getattr(a, "softmax_scale", None)
    if scale is not None and abs(scale - (a.hidden_size // a.num_attention_heads) ** -0.5) > 1e-12 * scale:
        raise ValueError(f"the checkpoint's args.softmax_scale={scale} cannot be converted: GPTModel's attention "
                         f"scales by 1/sqrt(head dim)")
    kv = getattr(a, "kv_channels", None)
    if kv is not None and kv * a.num_attention_heads != a.hidden_size:
        raise ValueError(f"the checkpoint's args.kv_channels={kv} cannot be converted: GPTModel's head dim is "
                         f"hidden_size / num_attention_heads = {a.hidden_size // a.num_attention_heads}")
    bias = getattr(a, "add_bias_linear", True)
    if getattr(a, "add_qkv_bias", bias) != bias:
        raise ValueError(f"the checkpoint's args.add_qkv_bias={a.add_qkv_bias} with add_bias_linear={bias} cannot be "
                         f"converted: GPTModel has biases in every linear layer or in none")
    gqa = bool(getattr(a, "group_query_attention", False))
    groups = getattr(a, "num_query_groups", None) if gqa else None
    args = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                ffn_hidden_size=getattr(a, "ffn_hidden_size", None), padded_vocab_size=a.padded_vocab_size,
                position_embedding_type=position,
                untie_embeddings_and_output_weights=bool(getattr(a, "untie_embeddings_and_output_weights", False)),
                max_position_embeddings=a.max_position_embeddings,
                normalization=getattr(a, "normalization", "LayerNorm"), swiglu=bool(getattr(a, "swiglu", False)),
                group_query_attention=gqa and groups != a.num_attention_heads,
                num_query_groups=groups if gqa and groups != a.num_attention_heads else None,
                disable_bias_linear=not bias, norm_epsilon=float(getattr(a, "norm_epsilon", 1e-5)),
                rotary_base=float(getattr(a, "rotary_base", 10000)),
                tokenizer_type=getattr(a, "tokenizer_type", None),
                tokenizer_model=getattr(a, "tokenizer_model", None),
                vocab_file=getattr(a, "vocab_file", None), merge_file=getattr(a, "merge_file", None),
                vocab_size=getattr(a, "vocab_size", None), init_method_std=getattr(a, "init_method_std", 0.02),
                hidden_dropout=getattr(a, "hidden_dropout", 0.1),
                attention_dropout=getattr(a, "attention_dropout", 0.1))
    # Megatron-LM's NullTokenizer puts its eod AFTER --vocab-size N ids (vocab N+1, eod N); megatron-lite's counts
    # it among them (eod = vocab_size - 1): record the size that gives Megatron-LM's ids, eod and padded rows.
    if args["tokenizer_type"] == "NullTokenizer" and args["vocab_size"] is not None:
        args["vocab_size"], args["eod"] = args["vocab_size"] + 1, args["vocab_size"]
    if args["normalization"] not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"the checkpoint's args.normalization={args['normalization']!r} cannot be converted: "
                         f"GPTModel has LayerNorm and RMSNorm")
    # The GELU Megatron-LM 0.16's core GPT computed (arguments.py core_transformer_config_from_args; its
    # --openai-gelu reaches only the legacy models): the bias-GELU fusion, GELU's tanh approximation, where
    # bias_gelu_fusion (its default) meets linear biases, else the exact GELU (docs/pretrain_gpt.md section 9).
    args["openai_gelu"] = not args["swiglu"] and bias and bool(getattr(a, "bias_gelu_fusion", True))
    return args
