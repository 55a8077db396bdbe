"""The `torch_dist` checkpoint format: every rank writes what it owns through torch.distributed.checkpoint.

::

    SAVE/iter_0000200/.metadata, __0_0.distcp, __1_0.distcp ...   DCP: model and optimizer tensors
    SAVE/iter_0000200/common.pt                                    iteration, data position, schedule,
                                                                   RNG of every rank, hyperparameters
    SAVE/iter_0000200/manifest.json                                checksums, written last (checkpoint_files)

Every tensor is stored flattened to 1-D under its parameter's name (`model.<name>`, `optimizer.<name>.param`,
`optimizer.<name>.exp_avg`, ...). What a rank holds only a range of (the distributed optimizer's shards,
ZeRO-3's parameter shards) is a ShardedTensor whose local shards are exactly those ranges, so the rank
writes just them and never materialises another rank's state; what every rank holds whole (plain DDP's
parameters, the non-sharded optimizers' state) is a plain tensor, which DCP writes once. Loading builds the
same description for the *current* layout and lets DCP read the overlapping pieces: a checkpoint saved at
one data-parallel size and sharding strategy loads at any other. Plain data goes into common.pt, read with
`torch.load(weights_only=True)`.
"""

import concurrent.futures
import os
import pickle
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

from ..distributed import collectives
from ..optimizer.optimizer import STATE_KEYS

COMMON_FILENAME = "common.pt"
# What DCP's .metadata (a pickle) may contain: its own metadata classes and torch's plain value types.
_SAFE_TORCH_TYPES = (torch.Size, torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata without running arbitrary code: only DCP's metadata classes, torch's
    Size / dtype / layout / memory_format and plain builtin containers are allowed (the weights_only idea)."""

    def find_class(self, module, name):
        if module.startswith("torch.distributed.checkpoint."):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, _SAFE_TORCH_TYPES) or value is torch.Size:
                return value
        if (module, name) in (("torch.serialization", "_get_layout"),  # a layout's name -> the layout
                              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")):  # the checkpoint id
            return super().find_class(module, name)
        if module in ("builtins", "collections") and name in ("set", "frozenset", "OrderedDict", "slice"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata unpickled by _MetadataUnpickler (tensor data is raw storage)."""

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(self.path, ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
            raise ValueError(f"checkpoint metadata {path} cannot be read safely: {e}") from e
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _sharded(numel: int, dtype: torch.dtype, local: List[Tuple[int, torch.Tensor]],
             ranges_of_rank: List[List[Tuple[int, int]]]) -> ShardedTensor:
    """A 1-D ShardedTensor of `numel` elements: this rank's pieces `local` = [(offset, tensor)], every
    rank's ranges `ranges_of_rank[r]` (all ranks know the layout, so no collective is needed)."""
    rank = dist.get_rank()
    device = local[0][1].device if local else torch.device("cpu")
    where = "cuda" if device.type == "cuda" else "cpu"

    def meta(r, start, end):
        return ShardMetadata([start], [end - start], f"rank:{r}/{where}:{device.index or 0}" if where == "cuda"
                             else f"rank:{r}/cpu")
    shards = [Shard(t, meta(rank, start, start + t.numel())) for start, t in local]
    everyone = [meta(r, s, e) for r, ranges in enumerate(ranges_of_rank) for s, e in ranges]
    properties = TensorProperties(dtype=dtype)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(everyone, torch.Size([numel]), properties))


def _ranges_of_every_rank(optimizer, world: int, per_instance: int, instance: int
                          ) -> Dict[str, List[List[Tuple[int, int]]]]:
    """name -> per data-parallel rank, the ranges of the parameter it holds, for the ranks of distributed-
    optimizer instance `instance` (rank r holds the shards of position r % per_instance): the ranks of one
    instance cover every parameter exactly once (a ShardedTensor's shards must not overlap). A save
    describes, and writes, the first instance's; a load describes the loading rank's own instance."""
    out: Dict[str, List[List[Tuple[int, int]]]] = {}
    for r in range(instance * per_instance, (instance + 1) * per_instance):
        for name, start, end, _ in optimizer.local_chunks(rank=r % per_instance):
            out.setdefault(name, [[] for _ in range(world)])[r].append((start, end))
    return out


def _tensors(model, optimizer, fill=None) -> Dict[str, object]:
    """The DCP state dict of this rank (see the module docstring). With `fill` = 'zeros' the tensors are
    empty placeholders for loading, shaped for the current layout."""
    world = dist.get_world_size(optimizer.data_parallel_group)
    per_instance = dist.get_world_size(optimizer.grad_stats_group)
    sharded = optimizer.sharded
    instance = dist.get_rank(optimizer.data_parallel_group) // per_instance
    ranges = _ranges_of_every_rank(optimizer, world, per_instance, instance if fill else 0) if sharded else {}
    replica = sharded and not fill and instance > 0  # writes nothing: the first instance writes it all
    shapes = {name: p.shape for p, name in optimizer.param_to_name.items()}
    dtypes = {name: p.dtype for p, name in optimizer.param_to_name.items()}
    keys = ["param", *STATE_KEYS[optimizer.config.optimizer]]
    state: Dict[str, object] = {}
    chunks = [] if replica else optimizer.local_chunks()
    for key in keys:
        pieces: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
        for name, start, end, main in chunks:
            if fill:
                value = torch.zeros(end - start, dtype=torch.float32, device=optimizer.device)
            else:
                value = optimizer.chunk_state(main).get(key)
                if value is None:
                    continue
                value = value.float()
            pieces.setdefault(name, []).append((start, value))
        for name, local in pieces.items():
            numel = shapes[name].numel()
            state[f"optimizer.{name}.{key}"] = (_sharded(numel, torch.float32, local, ranges[name]) if sharded
                                                else local[0][1])
    # The model: ZeRO-3 ranks hold ranges of the parameters (those of the optimizer's shards), others all.
    zero3 = any(getattr(chunk, "zero3", False) for chunk in optimizer.model_chunks)
    if zero3:
        from ..optimizer.distrib_optimizer import shard_ranges
        pieces = {}
        for s in [] if replica else shard_ranges(optimizer.model_chunks):
            name = optimizer.param_to_name[s.model_param]
            value = torch.zeros(s.param_end - s.param_start, dtype=dtypes[name], device=optimizer.device) \
                if fill else s.params.detach()
            pieces.setdefault(name, []).append((s.param_start, value))
        for name in shapes:
            state[f"model.{name}"] = _sharded(shapes[name].numel(), dtypes[name], pieces.get(name, []), ranges[name])
    else:
        for p, name in optimizer.param_to_name.items():
            state[f"model.{name}"] = torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if fill \
                else p.detach().reshape(-1)
    for key, value in _other_entries(model, shapes).items():  # buffers, frozen parameters: whole, as they are
        state[f"model.{key}"] = torch.zeros_like(value) if fill else value.detach()
    return state


def _other_entries(model, trainable) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in model.untrained_state_dict().items() if k not in trainable}


def local_tensors(model, optimizer) -> Dict[str, torch.Tensor]:
    """This rank's tensors to be written, by key (for checks such as finiteness)."""
    out = {}
    for key, value in _tensors(model, optimizer).items():
        pieces = [s.tensor for s in value.local_shards()] if isinstance(value, ShardedTensor) else [value]
        for i, piece in enumerate(pieces):
            out[f"{key}[{i}]"] = piece
    return out


def save_torch_dist(directory: str, model, optimizer, common: dict, group=None, async_group=None):
    """Every rank: its tensors into `directory` through DCP; rank 0: the plain data (common.pt).

    With `async_group` (a process group of its own, so that the background writer's collectives never
    interleave with training's) the tensors are copied to host memory now and written by a background
    thread: returns the future of that write (None when synchronous)."""
    with torch.no_grad():
        model.finish_param_sync()
        state = _tensors(model, optimizer)
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
def load_torch_dist(directory: str, model, optimizer, common: dict, hyperparameters: str = "check", group=None):
    """Read this rank's part of every tensor for the current layout (any DP size and strategy) and load
    it into the model and the optimizer."""
    state = _tensors(model, optimizer, fill="zeros")
    available = set(SafeReader(directory).read_metadata().state_dict_metadata)
    missing = [k for k in state if k.startswith("model.") and k not in available]
    if missing:
        raise ValueError(f"checkpoint {directory} has no {missing[0]}: it was saved from another model")
    state = {k: v for k, v in state.items() if k in available}  # moments exist only after a first step
    dcp.load(state, storage_reader=SafeReader(directory), process_group=group)
    shapes = common["shapes"]

    def local_pieces(value) -> Dict[int, torch.Tensor]:
        if isinstance(value, ShardedTensor):
            return {s.metadata.shard_offsets[0]: s.tensor for s in value.local_shards()}
        return {0: value}

    # The optimizer: main params and moments of this rank's chunks.
    values: Dict[Tuple[str, int], Dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith("optimizer."):
            name, field = key[len("optimizer."):].rsplit(".", 1)
            for start, tensor in local_pieces(value).items():
                values.setdefault((name, start), {})[field] = tensor
    optimizer.load_common_state_dict(common["optimizer"], hyperparameters)
    optimizer.load_chunks(values, common["optimizer_step"], common.get("optimizer_lagging_steps"))
    # The model: whole parameters, or (ZeRO-3) the rank's ranges, written through the optimizer's views.
    zero3 = any(getattr(chunk, "zero3", False) for chunk in optimizer.model_chunks)
    others = {k: state[f"model.{k}"] for k in _other_entries(model, shapes)}
    if zero3:
        from ..optimizer.distrib_optimizer import shard_ranges
        for s in shard_ranges(optimizer.model_chunks):
            pieces = local_pieces(state[f"model.{optimizer.param_to_name[s.model_param]}"])
            s.params.copy_(pieces[s.param_start])
        model.module.load_state_dict(others, strict=False)
    else:
        model.load_state_dict({**{name: state[f"model.{name}"].view(shapes[name]) for name in shapes}, **others})
    collectives.barrier(group)
