"""The `torch_dist` checkpoint format: every rank writes what it owns through torch.distributed.checkpoint.

::

    SAVE/iter_0000200/.metadata, __0_0.distcp, __1_0.distcp ...   DCP: model and optimizer tensors
    SAVE/iter_0000200/common.pt                                    iteration, data position, schedule,
                                                                   RNG of every rank, hyperparameters
    SAVE/iter_0000200/manifest.json                                checksums, written last (files.py)

Every tensor is stored flattened to 1-D under its parameter's name (`model.<name>`, `optimizer.<name>.param`,
`optimizer.<name>.exp_avg`, ...). What a rank holds only a range of (the distributed optimizer's shards,
ZeRO-3's parameter shards) is a ShardedTensor whose local shards are exactly those ranges, so the rank
writes just them and never materialises another rank's state; what every rank holds whole (plain DDP's
parameters, the non-sharded optimizers' state) is a plain tensor, which DCP writes once. Loading builds the
same description for the *current* layout and lets DCP read the overlapping pieces: a checkpoint saved at
one data-parallel size and sharding strategy loads at any other. Plain data goes into common.pt, read with
`torch.load(weights_only=True)`. save.py makes, and seals, the directory every rank writes into here.

Several data-parallel groups (DDP's data_parallel_group smaller than the checkpoint's process group, as
under tensor or pipeline parallelism), e.g. groups {0,1} and {2,3} of a save over ranks 0-3::

    replica_id (see replica_id):   rank 0 (0,0)   rank 1 (0,0)   rank 2 (1,0)   rank 3 (1,0)
    writes:                        its shards     its shards     nothing        nothing

megatron-lite splits no tensor over model-parallel ranks, so every data-parallel group holds a replica of
the one model, as megatron-core's layer norms are replicated over tensor-parallel ranks: the group holding
the checkpoint group's rank 0 writes (megatron-core's replica_id 0), and before a save check_replicas
compares every rank's state, bit for bit, with that of the rank at its position in the writing group,
raising on every rank where they differ (a group holding other weights would otherwise resume from the
first group's). Groups that really hold different models save each into a directory of its own, with their
data-parallel group as the checkpoint group. Loading needs no such rule: every rank reads its own pieces.
"""

import concurrent.futures
import contextlib
import os
import warnings
import zlib
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.api import CheckpointException

from ..distributed import collectives
from . import files
from .dcp_metadata import SafeReader  # .metadata is a pickle: read only through it
from .rng import get_rng_state

COMMON_FILENAME = "common.pt"


def common_state(iteration: int, optimizer, scheduler, consumed_train_samples: int, args: Optional[dict] = None,
                 group=None) -> dict:
    """Every rank (collective over `group`: the RNG states): the plain data written to common.pt."""
    return {
        "checkpoint_version": files.CHECKPOINT_VERSION, "format": "torch_dist", "iteration": iteration,
        "consumed_train_samples": consumed_train_samples, "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": collectives.all_gather_object(get_rng_state(), group), "args": args or {},
        "optimizer": optimizer.common_state_dict(), "optimizer_step": optimizer.agreed_step(),
        "optimizer_lagging_steps": optimizer.agreed_lagging_steps(),
        "shapes": {name: list(p.shape) for p, name in optimizer.param_to_name.items()},
    }


def _sharded(numel: int, dtype: torch.dtype, local: List[Tuple[int, torch.Tensor]]) -> ShardedTensor:
    """A 1-D ShardedTensor of `numel` elements holding this rank's pieces `local` = [(offset, tensor)],
    placed at its *global* rank (ShardedTensor's placements are global ranks, whatever the process group).

    DCP reads nothing of a ShardedTensor but its local shards, so no rank needs another's layout: the rest
    of the tensor is described as held by some other rank, as torch's own _flatten_sharded_tensors does
    (ShardedTensor insists that the shards cover the tensor). At a save, DCP's coordinator checks that the
    pieces the ranks actually write tile every tensor exactly once."""
    rank = dist.get_rank()
    device = local[0][1].device
    where = f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu"
    shards = [Shard(t, ShardMetadata([start], [t.numel()], f"rank:{rank}/{where}")) for start, t in local]
    elsewhere, covered = [], 0  # the gaps between this rank's pieces, attributed to another rank
    for start, t in sorted(local, key=lambda piece: piece[0]) + [(numel, None)]:
        if start > covered:
            elsewhere.append(ShardMetadata([covered], [start - covered], f"rank:{int(rank == 0)}/{where}"))
        covered = max(covered, start + (t.numel() if t is not None else 0))
    metadata = ShardedTensorMetadata([s.metadata for s in shards] + elsewhere, torch.Size([numel]),
                                     TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)


def _tensors(model, optimizer, fill=None) -> Dict[str, object]:
    """Every piece of state this rank holds, as the DCP state dict (see the module docstring): replicas
    included, whether or not this rank writes them (see replica_id). A ShardedTensor appears only where the
    rank holds a piece of it. With `fill` = 'zeros' the tensors are empty placeholders for loading, shaped
    for the current layout. The optimizer's part, and ZeRO-3's model shards, come from its sharded_state()."""
    described = optimizer.sharded_state()
    numels = {shard.name: shard.shape.numel() for shard in described.shards}
    state: Dict[str, object] = {}
    for key in ["param", *described.state_keys]:
        pieces: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
        for shard in described.shards:
            if key != "param" and key not in described.keys_of(shard):  # optimizer='muon': Muon's or AdamW's
                continue
            if fill:
                value = torch.zeros(shard.numel, dtype=torch.float32, device=optimizer.device)
            else:
                value = shard.tensors.get(key)
                if value is None:
                    continue
                value = value.float()
            pieces.setdefault(shard.name, []).append((shard.start, value))
        for name, local in pieces.items():
            state[f"optimizer.{name}.{key}"] = (_sharded(numels[name], torch.float32, local)
                                                if optimizer.sharded else local[0][1])
    # The model: ZeRO-3 ranks hold the shards of the parameters (those of the optimizer), others all.
    if described.params_sharded:
        pieces = {}
        for shard in described.shards:
            data = shard.model_data
            value = torch.zeros(shard.numel, dtype=data.dtype, device=optimizer.device) if fill else data.detach()
            pieces.setdefault(shard.name, []).append((shard.start, value))
        for name, local in pieces.items():
            state[f"model.{name}"] = _sharded(numels[name], local[0][1].dtype, local)
        for p, name in optimizer.param_to_name.items():
            if p.numel() == 0:  # a zero-size parameter: no rank holds a shard of it, so none would write it
                state[f"model.{name}"] = torch.zeros(0, dtype=p.dtype, device=optimizer.device)
    else:
        for p, name in optimizer.param_to_name.items():
            state[f"model.{name}"] = torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if fill \
                else p.detach().reshape(-1)
    shapes = {name: p.shape for p, name in optimizer.param_to_name.items()}
    for key, value in _other_entries(model, shapes).items():  # buffers, frozen parameters: whole, as they are
        state[f"model.{key}"] = torch.zeros_like(value) if fill else value.detach()
    return state


def _other_entries(model, trainable) -> Dict[str, torch.Tensor]:
    """Buffers and frozen parameters: the state entries that are neither a trained parameter nor another
    name of one (a tied weight's second name, whose ZeRO-3 placeholder holds no values: it is saved and
    loaded under its parameter's name, model.tied_names())."""
    skip = set(trainable) | set(model.tied_names())
    return {k: v for k, v in model.untrained_state_dict().items() if k not in skip}


def local_tensors(model, optimizer) -> Dict[str, torch.Tensor]:
    """This rank's pieces of every tensor (written if it is replica (0, 0)), by key, for checks such as
    finiteness."""
    out = {}
    for key, value in _tensors(model, optimizer).items():
        pieces = [s.tensor for s in value.local_shards()] if isinstance(value, ShardedTensor) else [value]
        for i, piece in enumerate(pieces):
            out[f"{key}[{i}]"] = piece
    return out


# ------------------------------------------------------------------------------------------ replicas
def replica_id(optimizer, group=None) -> Tuple[int, int]:
    """(data-parallel replica, distributed-optimizer instance) of this rank's state in a save over `group`.

    megatron-core's replica_id, for state that no model-parallel dimension splits: the data-parallel group
    holding `group`'s rank 0 is replica 0 (megatron-core: the lowest tensor/pipeline-parallel rank), every
    other data-parallel group 1; inside a group, instance i of the distributed optimizer holds a copy of
    instance 0's shards. Only (0, 0) writes sharded pieces; whole tensors are written by the ranks of data-
    parallel replica 0 (DCP stores each once)."""
    dp_group = optimizer.data_parallel_group
    first = dist.get_global_rank(group or dist.group.WORLD, 0)
    replica = 0 if first in dist.get_process_group_ranks(dp_group or dist.group.WORLD) else 1
    instance = optimizer.data_parallel_topology.instance(dist.get_rank(dp_group)) if optimizer.sharded else 0
    return replica, instance


def _written(state: Dict[str, object], replica: Tuple[int, int]) -> Dict[str, object]:
    """The part of this rank's `state` that it writes (see replica_id)."""
    if replica[0]:
        return {}
    if replica[1]:
        return {k: v for k, v in state.items() if not isinstance(v, ShardedTensor)}
    return state


def _fingerprint(value) -> Tuple[tuple, ...]:
    """(offset, shape, dtype, CRC-32 of the bytes) of every local piece of a DCP value."""
    pieces = [(s.metadata.shard_offsets[0], s.tensor) for s in value.local_shards()] \
        if isinstance(value, ShardedTensor) else [(None, value)]
    return tuple((offset, tuple(t.shape), str(t.dtype),
                  zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()))
                 for offset, t in pieces)


def _describe(model, optimizer) -> dict:
    """This rank's place (global rank, its data-parallel group's global ranks, its rank there) and the
    fingerprints of the state it holds."""
    dp_group = optimizer.data_parallel_group
    return {"rank": dist.get_rank(), "group": tuple(dist.get_process_group_ranks(dp_group or dist.group.WORLD)),
            "position": dist.get_rank(dp_group),
            "tensors": {key: _fingerprint(value) for key, value in _tensors(model, optimizer).items()}}


def disagreement(everyone: List[dict]) -> Optional[str]:
    """Why the data-parallel groups of a checkpoint group cannot be saved as replicas of one state, or None.

    Args:
        everyone: _describe() of every rank, indexed by rank in the checkpoint group (entry 0 is in
            data-parallel replica 0). Pure: every rank computes the same verdict from the same list.
    """
    by_rank = {e["rank"]: e for e in everyone}
    for e in everyone:
        if any(by_rank.get(m, {}).get("group") != e["group"] for m in e["group"]):
            return (f"global rank {e['rank']} names its data-parallel group {list(e['group'])}, which its members "
                    f"do not all name: every rank of a data-parallel group must pass the same group to DDP")
    groups = sorted({e["group"] for e in everyone})
    if len({len(g) for g in groups}) > 1:
        return (f"the data-parallel groups differ in size ({', '.join(str(list(g)) for g in groups)}): their "
                f"replicas are compared rank by rank with the writing group's, so all must be the same size")
    reference = {by_rank[r]["position"]: by_rank[r] for r in everyone[0]["group"]}
    for e in everyone:
        ref = reference[e["position"]]
        for key in sorted(set(ref["tensors"]) | set(e["tensors"])):
            if ref["tensors"].get(key) != e["tensors"].get(key):
                return (f"data-parallel group {list(e['group'])} holds another {key} than group {list(ref['group'])} "
                        f"(global ranks {e['rank']} and {ref['rank']}, both data-parallel rank {e['position']}): "
                        f"megatron-lite has no tensor/pipeline-parallel sharding, so a torch_dist checkpoint over "
                        f"several data-parallel groups keeps one replica of the state, and the groups must hold the "
                        f"same model and optimizer state. Keep them in sync (same weights, data and steps), or save "
                        f"each group into a directory of its own (save_checkpoint(..., group=its data-parallel "
                        f"group) and load_checkpoint(..., group=...) alike)")
    return None


def check_replicas(model, optimizer, group=None):
    """Before a save over `group` (every rank): when `group` holds several data-parallel groups, raise
    ValueError on every rank unless they hold bitwise-identical state, position by position (see
    disagreement). Nothing to do (no collective) when the data-parallel group is `group` itself."""
    if dist.get_world_size(optimizer.data_parallel_group) == dist.get_world_size(group):
        return
    mine = collectives.run_collectively(_describe, model, optimizer, group=group)  # a local failure: every rank
    problem = disagreement(collectives.all_gather_object(mine, group))
    if problem is not None:
        raise ValueError(f"cannot save a torch_dist checkpoint: {problem}")


def save_torch_dist(directory: str, model, optimizer, common: dict, group=None, async_group=None):
    """Every rank: what it writes of its tensors (see replica_id) into `directory` through DCP; `group`'s
    rank 0: the plain data (common.pt). Call check_replicas first when `group` holds several data-parallel
    groups: only replica 0's state is written.

    With `async_group` (a process group of its own, so that the background writer's collectives never
    interleave with training's) the tensors are copied to host memory now and written by a background
    thread: returns the future of that write (None when synchronous)."""
    with torch.no_grad():
        model.finish_param_sync()
        state = _written(_tensors(model, optimizer), replica_id(optimizer, group))
    if dist.get_rank(optimizer.data_parallel_group) != 0:
        # Buffers may differ between the ranks (BatchNorm's running statistics, updated from each rank's
        # batches): data-parallel rank 0's are the model's, which DDP broadcasts before the next forward and
        # the 'torch' format saves. DCP would keep any one rank's copy of a whole tensor.
        whole = {f"model.{k}" for k in _other_entries(model, set(optimizer.param_to_name.values()))}
        state = {k: v for k, v in state.items() if k not in whole}
    if dist.get_rank(group) == 0:
        torch.save(common, os.path.join(directory, COMMON_FILENAME))
    if async_group is None:
        dcp.save(state, checkpoint_id=directory, process_group=group)
        return None
    # DCP's own async_save cannot stage ShardedTensors: stage (copy) here, write in a thread, as it would.
    staged = {k: _copy(v) for k, v in state.items()}
    writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatron_lite_ckpt")
    future = writer.submit(dcp.save, staged, checkpoint_id=directory, process_group=async_group)
    writer.shutdown(wait=False)  # the thread ends with the write; the future stays valid
    return future


def _copy(value):
    """A host copy that training may not modify while the background thread writes it."""
    if isinstance(value, ShardedTensor):
        shards = [Shard(s.tensor.detach().to("cpu", copy=True), s.metadata) for s in value.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, value.metadata())
    return value.detach().to("cpu", copy=True)


def is_torch_dist(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, COMMON_FILENAME))


def read_common(directory: str) -> dict:
    return torch.load(os.path.join(directory, COMMON_FILENAME), map_location="cpu", weights_only=True)


@torch.no_grad()
def load_torch_dist(directory: str, model, optimizer, common: dict, group=None, load_optim: bool = True):
    """Read this rank's part of every tensor for the current layout (any DP size and strategy) and load
    it into the model and the optimizer (with `load_optim` False the model only: the caller refreshes the
    main params, optimizer.reload_model_params()). The optimizer's hyperparameters and loss scale are the
    caller's (optimizer.load_common_state_dict(common['optimizer'])). A model the checkpoint does not fit,
    or a read failing on any rank, raises on every rank of `group`, before any tensor is written."""
    state = collectives.run_collectively(_placeholders, directory, model, optimizer, common, load_optim, group=group)
    if not load_optim:  # every rank drops the same keys: DCP reads only what is asked for
        state = {k: v for k, v in state.items() if not k.startswith("optimizer.")}
    try:  # DCP agrees on the success of its read steps itself: a failure on any rank raises on every rank
        with _sharded_tensor_deprecation_silenced():
            dcp.load(state, storage_reader=SafeReader(directory), process_group=group)
    except CheckpointException as e:
        raise ValueError(f"reading torch_dist checkpoint {directory} failed: {e}") from e
    described = optimizer.sharded_state()  # this rank's layout
    values = collectives.run_collectively(_optimizer_values, state, described, group=group)
    if load_optim:
        lagging = common.get("optimizer_lagging_steps")
        # The moments read are the state's own now (adopted, not copied: the pieces are this load's alone).
        optimizer.load_sharded_state(described.with_values(values, common["optimizer_step"], lagging), adopt=True)
    # The model: whole parameters, or (ZeRO-3) the rank's shards, written through the description's views.
    shapes = {name: p.shape for p, name in optimizer.param_to_name.items()}  # the model's (see _placeholders)
    others = {k: state[f"model.{k}"].view(v.shape) for k, v in _other_entries(model, shapes).items()}
    if described.params_sharded:
        for shard in described.shards:
            shard.model_data.copy_(_local_pieces(state[f"model.{shard.name}"])[shard.start])
        model.module.load_state_dict(others, strict=False)
    else:
        tied = {alias: state[f"model.{name}"].view(shapes[name]) for alias, name in model.tied_names().items()}
        model.load_state_dict({**{name: state[f"model.{name}"].view(shapes[name]) for name in shapes}, **others,
                               **tied})


@contextlib.contextmanager
def _sharded_tensor_deprecation_silenced():
    """torch marks ShardedTensor's __torch_function__ deprecated (in favour of DTensor), so DCP's load warns
    "we are deprecating ShardedTensor" once per torch call on one: the same FutureWarning at every resume, about
    a choice of ours the user can do nothing about. A ShardedTensor is how a rank describes only its pieces of a
    1-D tensor without a device mesh (see _sharded), so the load keeps it and silences exactly that warning,
    only for the duration of our DCP call (a ShardedTensor of the user's still warns; the save emits none)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def _local_pieces(value) -> Dict[int, torch.Tensor]:
    """offset -> tensor of this rank's pieces of a DCP value."""
    if isinstance(value, ShardedTensor):
        return {s.metadata.shard_offsets[0]: s.tensor for s in value.local_shards()}
    return {0: value}


def _optimizer_values(state: Dict[str, object], described) -> Dict[Tuple[str, int], Dict[str, torch.Tensor]]:
    """(name, offset) -> {'param', moments...} of the optimizer entries read, checked to cover every shard
    of this rank's layout `described` (load_sharded_state writes, and gathers, only after every rank found
    all of its own)."""
    values: Dict[Tuple[str, int], Dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith("optimizer."):
            name, field = key[len("optimizer."):].rsplit(".", 1)
            for start, tensor in _local_pieces(value).items():
                values.setdefault((name, start), {})[field] = tensor
    fields = {field for entry in values.values() for field in entry}
    for shard in described.shards:  # a zero-size parameter: a sharded optimizer wrote no piece of it
        if values and shard.numel == 0:
            values.setdefault((shard.name, shard.start), {field: torch.zeros(0) for field in fields})
    for shard in described.shards:
        entry = values.get((shard.name, shard.start), {})
        if values and ("param" not in entry or any(t.numel() != shard.numel for t in entry.values())):
            raise ValueError(f"the checkpoint's optimizer state does not cover "
                             f"{shard.name}[{shard.start}:{shard.end}] (frozen when saved? then load without "
                             f"the optimizer state: --finetune or --no-load-optim)")
    return values


def _placeholders(directory: str, model, optimizer, common: dict, load_optim: bool = True) -> Dict[str, object]:
    """The zero-filled pieces this rank reads, after checking that the checkpoint holds every tensor of
    the model (whatever this rank's layout) with the model's shapes, and with `load_optim` that it keeps no
    parameter's state as the other part's (optimizer='muon', MegatronOptimizer.check_state_parts)."""
    stored = SafeReader(directory).read_metadata().state_dict_metadata
    available = set(stored)
    if load_optim:
        fields: Dict[str, set] = {}
        for key in available:
            if key.startswith("optimizer."):
                name, field = key[len("optimizer."):].rsplit(".", 1)
                fields.setdefault(name, set()).add(field)
        optimizer.check_state_parts(fields, common.get("optimizer_lagging_steps"))
    trainable = {name: list(p.shape) for p, name in optimizer.param_to_name.items()}
    for name in [*trainable, *_other_entries(model, trainable)]:
        if f"model.{name}" not in available:
            raise ValueError(f"checkpoint {directory} has no model.{name}: it was saved from another model")
    for name, shape in trainable.items():
        if list(common["shapes"].get(name, shape)) != shape:
            raise ValueError(f"checkpoint {directory} holds {name} of shape {common['shapes'][name]}, the model's "
                             f"is {shape}: it was saved from another model")
    state = {k: v for k, v in _tensors(model, optimizer, fill="zeros").items()
             if k in available}  # moments exist only after a first step
    for key, value in state.items():
        # A trained parameter is stored flat, a frozen one whole: read it as stored when its requires_grad
        # changed since the save (fine-tuning with the base frozen, or unfrozen); load_torch_dist reshapes.
        size = stored[key].size
        if isinstance(value, ShardedTensor):
            if len(size) != 1:
                raise ValueError(f"checkpoint {directory} holds {key[len('model.'):]} whole (it was frozen when "
                                 f"saved), which ZeRO-3 cannot read as shards: load it under another sharding "
                                 f"strategy, or convert it to the 'torch' format (tools/checkpoint_convert.py)")
        elif key.startswith("model.") and tuple(size) != tuple(value.shape):
            name = key[len("model."):]
            trained_then = len(size) == 1 and common["shapes"].get(name) == list(value.shape)
            trained_now = value.dim() == 1 and trainable.get(name) == list(size)
            if trained_then or trained_now:  # any other difference: DCP refuses the sizes
                state[key] = value.new_zeros(size)
    return state
