"""ZeRO-1: each data-parallel rank keeps fp32 main params and optimizer state for its shard only.

Rank r owns shard r of every bucket (buckets are padded to split evenly). A parameter may straddle a
shard boundary; each rank then owns just the overlapping range::

    bucket       | p3 .......... | p2 ...................... | pad |
    dp=2 shards  |<---- rank 0 ---------->|<------- rank 1 -------->|
    rank 0 main: p3[all], p2[0:k]          rank 1 main: p2[k:], (pad skipped)

step(): the DDP reduce-scatter left the mean gradient of shard r in rank r's grad buffer; the shard's main
grads are views (fp32 grads) or fp32 copies of it; norm and clipping are global (sum of squares
all-reduced); the inner optimizer updates the main shards; they are written (cast) into the parameter
buffer and each bucket's param_data is all-gathered, so every rank holds bitwise-identical parameters.
With overlap_param_gather the all-gathers are dispatched by DDP's forward pre-hooks instead.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..distributed import collectives
from ..distributed.layout import shard_range
from .optimizer import STATE_KEYS, MegatronOptimizer, copy_main_to_model, copy_model_to_main, main_param


@dataclass
class ShardRange:
    """The part of one model parameter that this rank owns."""

    model_param: torch.nn.Parameter
    buffer: object  # ParamAndGradBuffer
    buffer_start: int  # [buffer_start, buffer_end) in buffer coordinates
    buffer_end: int
    param_start: int  # the same range in the flattened parameter
    param_end: int
    bucket: object  # Bucket
    shard_start: int  # the same range in the bucket's reduced_grad_shard

    @property
    def params(self) -> torch.Tensor:
        """This rank's part of the model parameters of the range (what the optimizer updates)."""
        return self.bucket.own_params[self.shard_start:self.shard_start + self.buffer_end - self.buffer_start]

    @property
    def grad(self) -> torch.Tensor:
        """This rank's reduced gradient of the range (after finish_grad_sync)."""
        return self.bucket.reduced_grad_shard[self.shard_start:self.shard_start + self.buffer_end - self.buffer_start]


def shard_ranges(model_chunks, rank: Optional[int] = None) -> List[ShardRange]:
    """The owned ranges of every parameter of this rank (or of data-parallel rank `rank`: the layout is
    known everywhere; a rank owns what its position owns, see layout.DataParallelTopology), in buffer order.
    Expert buffers (sharded over the expert data-parallel group) follow the dense ones; they are described
    for this rank only."""
    ranges = []
    for chunk in model_chunks:
        if rank is not None and chunk.expert_parallel_buffers:
            raise ValueError("shard_ranges(rank=...): expert parameters are sharded over the expert data-parallel "
                             "group, not by data-parallel rank")
        for buffer in chunk.param_and_grad_buffers + chunk.expert_parallel_buffers:
            # The buffer shards over its group (this rank's instance, or the expert group): rank = position.
            position = buffer.data_parallel_rank if rank is None else chunk.data_parallel_topology.position(rank)
            for bucket in buffer.buckets:
                lo_shard, hi_shard = shard_range(bucket.offset, bucket.offset + bucket.grad_data.numel(),
                                                 buffer.data_parallel_world_size, position)
                for param in bucket.params_list:
                    start, end, _ = buffer.param_index_map[param]
                    lo, hi = max(start, lo_shard), min(end, hi_shard)
                    if lo < hi:
                        ranges.append(ShardRange(param, buffer, lo, hi, lo - start, hi - start, bucket, lo - lo_shard))
    return ranges


class DistributedOptimizer(MegatronOptimizer):
    """Sharded optimizer over DDP-wrapped chunks built with use_distributed_optimizer=True.

    Args:
        make_inner: callable(list of param-group dicts over main shards) -> inner torch optimizer.
        config: the OptimizerConfig.
        model_chunks: DistributedDataParallel chunks.
        model_param_groups: param-group dicts over *model* params (weight-decay split etc.).
        grad_scaler: loss scaler for fp16, else None.
    """

    sharded = True

    def __init__(self, make_inner, config, model_chunks, model_param_groups, grad_scaler):
        self.shards = shard_ranges(model_chunks)
        group_of = {p: i for i, g in enumerate(model_param_groups) for p in g["params"]}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in model_param_groups]
        self.main_of: Dict[int, torch.Tensor] = {}  # index into self.shards -> main shard
        for i, s in enumerate(self.shards):
            main = main_param(s.params)  # fp32: the model's own storage
            self.main_of[i] = main
            groups[group_of[s.model_param]]["params"].append(main)
        super().__init__(make_inner(groups), config, model_chunks, grad_scaler)

    # ------------------------------------------------------------------ step pieces
    def _prepare_for_step(self):
        # Pending (overlapped) gathers of the previous step must land before new values are written.
        for chunk in self.model_chunks:
            chunk.finish_param_sync()

    def _copy_model_grads_to_main_grads(self):
        grads, skipped = [], self._skipped()
        for i, s in enumerate(self.shards):
            main = self.main_of[i]
            main.grad = None if s.model_param in skipped else s.grad.float()  # a view if fp32 already
            if main.grad is not None:
                grads.append(main.grad)
        return grads

    def _copy_main_params_to_model_params(self):
        for i, s in enumerate(self.shards):
            copy_main_to_model(self.main_of[i], s.params)
        for chunk in self.model_chunks:
            chunk.start_param_sync()

    def _copy_model_params_to_main_params(self):
        # Each rank its own shards: ZeRO-1/2 read the full parameters' ranges, ZeRO-3 the shards it keeps.
        for i, s in enumerate(self.shards):
            copy_model_to_main(s.params, self.main_of[i])

    # ------------------------------------------------------------------ replicas (fault tolerance)
    def holds_same_shards(self, rank: int) -> bool:
        """Whether data-parallel rank `rank` holds the same shards as this rank (a replica in another
        distributed-optimizer instance, or this rank itself)."""
        topology = self.model_chunks[0].data_parallel_topology
        return topology.position(rank) == topology.position(dist.get_rank(self.data_parallel_group))

    def _flat_shard_state(self) -> torch.Tensor:
        """[step, each shard's own step, main params..., then each optimizer-state tensor...] of this rank's
        shards, one fp32 tensor of _flat_numel() elements (state never created yet travels as zeros)."""
        states = [self.chunk_state(main) for main in self.main_of.values()]
        own = [self._state_of(main)["step"].item() if "step" in self._state_of(main) else self.local_step()
               for main in self.main_of.values()]
        parts = [torch.tensor([float(self.local_step())] + [float(s) for s in own], device=self.device)]
        parts += [s["param"] for s in states]
        for key in STATE_KEYS[self.config.optimizer]:
            parts += [s[key] if key in s else torch.zeros_like(s["param"]) for s in states]
        return torch.cat([p.float() for p in parts])

    def _flat_numel(self) -> int:
        return (1 + len(self.main_of)
                + (1 + len(STATE_KEYS[self.config.optimizer])) * sum(m.numel() for m in self.main_of.values()))

    @torch.no_grad()
    def send_shard_state(self, dst: int):
        """Send this rank's main params, optimizer moments and step to data-parallel rank `dst`, which
        must hold the same shards (a replica) and call recv_shard_state(src=this rank). Point to point:
        no other rank takes part."""
        if not self.holds_same_shards(dst):
            raise ValueError(f"send_shard_state(dst={dst}): rank {dst} holds other shards than rank "
                             f"{dist.get_rank(self.data_parallel_group)}; send to a replica (same position in "
                             f"another distributed-optimizer instance)")
        collectives.send(self._flat_shard_state(), dst, self.data_parallel_group)

    @torch.no_grad()
    def recv_shard_state(self, src: int):
        """Replace this rank's main params, optimizer moments and step by those of replica `src` (which
        calls send_shard_state(dst=this rank)) and write the params into the model's shard. What arrives
        is validated first (finite; second moments >= 0): a damaged replica raises ValueError and leaves
        this rank's state untouched."""
        if not self.holds_same_shards(src):
            raise ValueError(f"recv_shard_state(src={src}): rank {src} holds other shards than rank "
                             f"{dist.get_rank(self.data_parallel_group)}; receive from a replica")
        flat = torch.empty(self._flat_numel(), dtype=torch.float32, device=self.device)
        collectives.recv(flat, src, self.data_parallel_group)
        keys = STATE_KEYS[self.config.optimizer]
        step, values = int(flat[0].item()), self._split(flat)
        if not torch.isfinite(flat).all() or any((t < 0).any() for t in values.get("exp_avg_sq", [])):
            raise ValueError(f"recv_shard_state(src={src}): the replica's state is not finite (or has negative "
                             f"second moments); refusing to restore it")
        own_steps = flat[1:1 + len(self.main_of)].tolist()
        for i, main in enumerate(self.main_of.values()):
            main.copy_(values["param"][i])
            if step:
                self._set_state_of(main, int(own_steps[i]), {k: values[k][i] for k in keys})
            else:
                self.optimizer.state.pop(main, None)
        self.update_count = step
        for i, s in enumerate(self.shards):
            copy_main_to_model(self.main_of[i], s.params)

    def _split(self, flat: torch.Tensor) -> Dict[str, List[torch.Tensor]]:
        """The inverse of _flat_shard_state: per key ('param', state keys) the tensors of every shard."""
        out, offset = {}, 1 + len(self.main_of)
        for key in ("param", *STATE_KEYS[self.config.optimizer]):
            out[key] = []
            for m in self.main_of.values():
                out[key].append(flat[offset:offset + m.numel()].view_as(m))
                offset += m.numel()
        return out

    # ------------------------------------------------------------------ checkpointing
    def local_chunks(self, rank: Optional[int] = None):
        """(parameter name, start, end, main tensor) of this rank's part of every parameter, flattened; with
        `rank`, that rank's ranges (main None) -- what a sharded checkpoint describes for every rank."""
        if rank is None:
            return [(self.param_to_name[s.model_param], s.param_start, s.param_end, self.main_of[i])
                    for i, s in enumerate(self.shards)]
        return [(self.param_to_name[s.model_param], s.param_start, s.param_end, None)
                for s in shard_ranges(self.model_chunks, rank)]

    def _gather_full(self, values_of_shard) -> Dict[object, torch.Tensor]:
        """For every buffer, a full fp32 flat tensor assembled from every rank's shards of some value."""
        flats = {}
        for chunk in self.model_chunks:
            for buffer in chunk.param_and_grad_buffers + chunk.expert_parallel_buffers:
                flats[id(buffer)] = torch.zeros(buffer.numel, dtype=torch.float32, device=buffer.device)
        for i, s in enumerate(self.shards):
            value = values_of_shard(i)
            if value is not None:
                flats[id(s.buffer)][s.buffer_start:s.buffer_end].copy_(value)
        for chunk in self.model_chunks:
            for buffer in chunk.param_and_grad_buffers + chunk.expert_parallel_buffers:
                flat = flats[id(buffer)]
                for bucket in buffer.buckets:
                    collectives.all_gather(flat[bucket.offset:bucket.offset + bucket.grad_data.numel()],
                                           group=buffer.data_parallel_group)
        return flats

    def _full_main_state(self):
        keys = ["param"] + list(STATE_KEYS[self.config.optimizer])

        def value(key):
            def of(i):
                main = self.main_of[i]
                return main.detach() if key == "param" else self._state_of(main).get(key)
            return of

        flats = {key: self._gather_full(value(key)) for key in keys}
        steps = self.agreed_param_steps()  # one count, except for parameters that skipped steps
        out = {}
        for chunk in self.model_chunks:
            for buffer in chunk.param_and_grad_buffers + chunk.expert_parallel_buffers:
                for param, (start, end, _) in buffer.param_index_map.items():
                    entry = {k: flats[k][id(buffer)][start:end].view(param.shape).clone().cpu() for k in keys}
                    entry["step"] = steps[self.param_to_name[param]]
                    out[self.param_to_name[param]] = entry
        return out

    def _load_full_main_state(self, state):
        for i, s in enumerate(self.shards):
            name = self.param_to_name[s.model_param]
            entry = state[name]
            if tuple(entry["param"].shape) != tuple(s.model_param.shape):
                raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(entry['param'].shape)}, "
                                 f"model {tuple(s.model_param.shape)}")
            main = self.main_of[i]

            def part(t):
                return t.reshape(-1)[s.param_start:s.param_end]

            main.data.copy_(part(entry["param"]))
            tensors = {k: part(entry[k]) for k in STATE_KEYS[self.config.optimizer] if k in entry}
            self._set_state_of(main, entry.get("step"), tensors)
        self.update_count = max([int(e.get("step", 0)) for e in state.values()] + [0])
        self._copy_main_params_to_model_params()
