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

import torch
import torch.distributed as dist

from ..distributed import collectives
from ..distributed.layout import DataParallelTopology
from ..distributed.param_and_grad_buffer import gather_full_buffers, shard_ranges
from .main_params import copy_main_to_model, copy_model_to_main, main_params
from .optimizer import MegatronOptimizer
from .optimizer_state import MainShard
from .sharded_state import flat_numel, flatten, unflatten


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
        self.params_sharded = any(chunk.shards_params for chunk in model_chunks)  # ZeRO-3
        group_of = {p: i for i, g in enumerate(model_param_groups) for p in g["params"]}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in model_param_groups]
        # One main shard per range of self.shards, in its order (shard_state.main_shards[i].main: range i's
        # fp32 main values; fp32: the model's own storage, unless offloaded to the host).
        main_shards = [MainShard(s.model_param, s.param_start, s.param_end, main)
                       for s, main in zip(self.shards, main_params([s.params for s in self.shards], config))]
        for shard in main_shards:
            groups[group_of[shard.param]]["params"].append(shard.main)
        super().__init__(make_inner(groups), config, model_chunks, grad_scaler, main_shards)

    # ------------------------------------------------------------------ step pieces
    def _prepare_for_step(self):
        # Pending (overlapped) gathers of the previous step must land before new values are written.
        for chunk in self.model_chunks:
            chunk.finish_param_sync()

    def _copy_model_grads_to_main_grads(self):
        grads, skipped = [], self._skipped()
        for s, shard in zip(self.shards, self.shard_state.main_shards):
            if s.model_param in skipped:
                shard.main.grad = None
            else:  # a view if fp32 already
                grads.append(self._set_main_grad(shard.main, s.grad.float()))
        return grads

    def _copy_main_params_to_model_params(self):
        for s, shard in zip(self.shards, self.shard_state.main_shards):
            copy_main_to_model(shard.main, s.params)
        for chunk in self.model_chunks:
            chunk.start_param_sync()

    def _copy_model_params_to_main_params(self, values=None):
        # Each rank its own shards: ZeRO-1/2 read the full parameters' ranges, ZeRO-3 the shards it keeps;
        # given values, their same ranges (also into an fp32 main param that is the model's own shard).
        for s, shard in zip(self.shards, self.shard_state.main_shards):
            if values is None:
                copy_model_to_main(s.params, shard.main)
            else:
                shard.main.data.copy_(values[s.model_param].reshape(-1)[s.param_start:s.param_end])

    # ------------------------------------------------------------------ state (see optimizer_state.py)
    @property
    def data_parallel_topology(self) -> DataParallelTopology:
        return self.model_chunks[0].data_parallel_topology

    def _model_shards(self):
        return [s.params for s in self.shards] if self.params_sharded else None

    def _gathered(self, state):
        """Each value's whole fp32 parameters: every buffer assembled from the ranks' shards by one all-gather
        per bucket (the step's own collective: every element crosses the network once), cut by name."""
        keys = ["param", *state.state_keys]
        # Aligned with self.shards (the main shards' order); a moment no step created yet is gathered as zeros.
        flats = {key: gather_full_buffers(self.model_chunks, self.shards, [s.tensors.get(key) for s in state.shards])
                 for key in keys}
        steps = self.agreed_param_steps()  # one count, except for parameters that skipped steps
        out = {}
        for chunk in self.model_chunks:
            for buffer in chunk.param_and_grad_buffers + chunk.expert_parallel_buffers:
                for param, (start, end, _) in buffer.param_index_map.items():
                    entry = {k: flats[k][id(buffer)][start:end].view(param.shape).clone().cpu() for k in keys}
                    entry["step"] = steps[self.param_to_name[param]]
                    out[self.param_to_name[param]] = entry
        return out

    # ------------------------------------------------------------------ replicas (fault tolerance)
    def holds_same_shards(self, rank: int) -> bool:
        """Whether data-parallel rank `rank` holds the same shards as this rank (a replica in another
        distributed-optimizer instance, or this rank itself)."""
        topology = self.data_parallel_topology
        return topology.position(rank) == topology.position(dist.get_rank(self.data_parallel_group))

    @torch.no_grad()
    def send_shard_state(self, dst: int):
        """Send this rank's main params, optimizer moments and step to data-parallel rank `dst`, which
        must hold the same shards (a replica) and call recv_shard_state(src=this rank). Point to point:
        no other rank takes part."""
        if not self.holds_same_shards(dst):
            raise ValueError(f"send_shard_state(dst={dst}): rank {dst} holds other shards than rank "
                             f"{dist.get_rank(self.data_parallel_group)}; send to a replica (same position in "
                             f"another distributed-optimizer instance)")
        collectives.send(flatten(self.sharded_state(), self.device), dst, self.data_parallel_group)

    @torch.no_grad()
    def recv_shard_state(self, src: int):
        """Replace this rank's main params, optimizer moments and step by those of replica `src` (which
        calls send_shard_state(dst=this rank)) and write the params into the model's shard. What arrives
        is validated first (finite; moments of squares >= 0, OptimizerKind.nonnegative_keys): a damaged
        replica raises ValueError and leaves this rank's state untouched."""
        if not self.holds_same_shards(src):
            raise ValueError(f"recv_shard_state(src={src}): rank {src} holds other shards than rank "
                             f"{dist.get_rank(self.data_parallel_group)}; receive from a replica")
        layout = self.sharded_state()
        flat = torch.empty(flat_numel(layout), dtype=torch.float32, device=self.device)
        collectives.recv(flat, src, self.data_parallel_group)
        received = unflatten(flat, layout)
        nonnegative = self.shard_state.kind.nonnegative_keys  # e.g. Adam's exp_avg_sq, RMSprop's square_avg
        squares = [s.tensors[k] for s in received.shards for k in nonnegative if k in s.tensors]
        if not torch.isfinite(flat).all() or any((t < 0).any() for t in squares):
            raise ValueError(f"recv_shard_state(src={src}): the replica's state is not finite (or has negative "
                             f"values in {', '.join(nonnegative) or 'no state'}, which cannot be); refusing to "
                             f"restore it")
        if not received.step:  # the replica never stepped: neither has this rank's state now
            self.shard_state.forget_moments()
            received = received.params_only()
        self._load_shards(received)
        for s, shard in zip(self.shards, self.shard_state.main_shards):  # this rank's shard only: no collective
            copy_main_to_model(shard.main, s.params)
