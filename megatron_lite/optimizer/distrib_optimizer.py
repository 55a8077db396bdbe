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

Muon's unit is a whole matrix, its momentum still a flat shard (layout.py's two kinds of ownership). Its update
pieces go to the matrix's owner and come back orthogonalized (_orthogonalize), over this rank's instance::

    rank (position) p: u pieces of its shard --all_to_all_single--> owner q: whole u of each matrix it owns
                       (bf16: Newton-Schulz's first step is that cast)
                                                                     O = orthogonalize(u, spec), per sub-matrix
    rank p: O pieces of its shard      <--all_to_all_single--        owner q: O (bf16) cut as the pieces came
"""

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..distributed import collectives
from ..distributed.layout import DataParallelTopology, MatrixExchange, compute_matrix_exchange, compute_matrix_ownership
from ..distributed.param_and_grad_buffer import gather_full_buffers, shard_ranges
from . import muon
from .main_params import copy_main_to_model, copy_model_to_main, main_params
from .muon import MatrixSpec
from .optimizer import MegatronOptimizer
from .optimizer_state import MainShard


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
        if self.matrix_specs:  # optimizer='muon': who orthogonalizes which matrix, what travels where, decided once
            self._plan_matrix_exchange(self.matrix_specs)

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

    # ------------------------------------------------------------------ whole matrices (Muon)
    def _plan_matrix_exchange(self, specs: Dict[torch.nn.Parameter, Optional[MatrixSpec]]):
        """Decide once who orthogonalizes which matrix and what travels where (layout.compute_matrix_ownership and
        compute_matrix_exchange over the dense buffers, sharded over this rank's instance). `specs`: per model
        parameter its MatrixSpec (rows, cols, row_splits) or None (not a matrix: AdamW's)."""
        # The dense buffers only: muon.matrix_specs leaves expert parameters to AdamW or refuses them.
        buffers = [buffer for chunk in self.model_chunks for buffer in chunk.param_and_grad_buffers]
        params = [p for buffer in buffers for p in buffer.params]
        spec_list = [specs.get(p) for p in params]
        shapes = [(spec.rows, spec.cols) if spec is not None else tuple(p.shape) for p, spec in zip(params, spec_list)]
        splits = [None if spec is None else tuple(spec.row_splits) for spec in spec_list]
        topology = self.data_parallel_topology
        self.matrix_ownership = compute_matrix_ownership(shapes, [spec is not None for spec in spec_list], topology,
                                                         row_splits=splits)
        position = topology.position(dist.get_rank(self.data_parallel_group))
        self.matrix_exchange = compute_matrix_exchange([buffer.layout for buffer in buffers], self.matrix_ownership,
                                                       position)
        self._matrix_params = params  # the plan's parameter indices
        self._matrix_specs = spec_list
        self._matrix_index = {p: i for i, p in enumerate(params)}

    def _orthogonalize(self, updates: Dict[MainShard, torch.Tensor]) -> Dict[MainShard, torch.Tensor]:
        """Muon's orthogonalized update of each of `updates`' flat pieces (fp32 u, one per matrix main shard):
        the pieces go to their matrices' owners, which orthogonalize whole matrices (_orthogonalize_whole), and
        come back (exchange_whole_matrices). Collective over this rank's instance, even with nothing to send."""
        index_of = self._matrix_index
        pieces = {(index_of[shard.param], shard.start): u for shard, u in updates.items()}
        skipped = {index_of[p] for p in self._skipped() if p in index_of}

        def orthogonalize(index: int, whole: torch.Tensor) -> Optional[torch.Tensor]:
            if index in skipped:  # no rank has its gradient (agreed): nothing to orthogonalize, nothing asks back
                return None
            param = self._matrix_params[index]
            spec = self._matrix_specs[index]
            return self._orthogonalize_whole(param, spec, whole.view(spec.rows, spec.cols))

        results = exchange_whole_matrices(self.matrix_exchange, pieces, [p.numel() for p in self._matrix_params],
                                          orthogonalize, self.grad_stats_group, self.device, torch.bfloat16,
                                          send_dtype=torch.bfloat16)
        return {shard: results[(index_of[shard.param], shard.start)] for shard in updates}

    def _orthogonalize_whole(self, param: torch.nn.Parameter, spec: MatrixSpec, u: torch.Tensor) -> torch.Tensor:
        """The orthogonalized update of one whole matrix (u: rows x cols, in bfloat16, the dtype it travels in:
        Newton-Schulz's first step is that cast; each of spec's row blocks on its own), flat, in bfloat16 (the
        dtype the pieces travel back in): muon.orthogonalize. Runs only on the matrix's owner."""
        return muon.orthogonalize(u, spec, self.config)

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
                    entry = {k: flats[k][id(buffer)][start:end].view(param.shape).clone().cpu()
                             for k in ("param", *self.state_keys_of(param))}  # optimizer='muon': its part's
                    entry["step"] = steps[self.param_to_name[param]]
                    out[self.param_to_name[param]] = entry
        return out

    # ------------------------------------------------------------------ replicas (fault tolerance)
    def _write_received_state(self):
        """After recv_shard_state (optimizer.py): this rank's shards into the model, locally (no all-gather: the
        other ranks of its instance are healed the same way, or already hold their own)."""
        for s, shard in zip(self.shards, self.shard_state.main_shards):
            copy_main_to_model(shard.main, s.params)


def exchange_whole_matrices(plan: MatrixExchange, pieces: Dict[Tuple[int, int], torch.Tensor], numels,
                            orthogonalize: Callable[[int, torch.Tensor], Optional[torch.Tensor]], group,
                            device, result_dtype: torch.dtype = torch.float32,
                            send_dtype: torch.dtype = torch.float32) -> Dict[Tuple[int, int], torch.Tensor]:
    """Bring matrices whole to their owners, transform them there, and bring the pieces back (module docstring).

    Args:
        plan: this rank's layout.MatrixExchange.
        pieces: this rank's flat pieces, by (parameter index, param_start); a piece of the plan that is missing
            (a parameter no rank has a gradient for) travels as zeros.
        numels: each parameter's element count, by index.
        orthogonalize: (index, the whole parameter flat, in send_dtype) -> its transform (any shape of that many
            elements), or None to leave it (its pieces come back as zeros); called at the owner for plan.owned,
            by index.
        group: the instance's process group (plan's positions are its ranks).
        result_dtype: the dtype the results travel back in (cast to it at the owner): the dtype `orthogonalize`
            returns, Newton-Schulz's bfloat16 for Muon (half the bytes of fp32, and no rounding).
        send_dtype: the dtype the pieces travel to the owners in (cast to it here): bfloat16 for Muon, whose
            Newton-Schulz casts its input to bfloat16 first (the same result, half the bytes of fp32).
    Returns:
        Per (parameter index, param_start) of plan.sends: the transformed flat piece, in result_dtype.

    Each buffer is dropped as soon as it has been used: by the second all-to-all this rank holds only what it
    sends back and what comes back.
    """
    send_pieces = [piece for pieces_to in plan.sends for piece in pieces_to]
    send, offset = torch.empty(sum(plan.send_splits), dtype=send_dtype, device=device), 0
    for p in send_pieces:
        u = pieces.get((p.param_index, p.param_start))
        if u is None:
            send[offset:offset + p.numel].zero_()
        else:
            send[offset:offset + p.numel].copy_(u.reshape(-1))  # cast to send_dtype
        offset += p.numel
    received = torch.empty(sum(plan.recv_splits), dtype=send_dtype, device=device)
    collectives.all_to_all_single(received, send, plan.recv_splits, plan.send_splits, group)
    del send
    wholes, offset = {i: torch.empty(numels[i], dtype=send_dtype, device=device) for i in plan.owned}, 0
    for pieces_from in plan.receives:
        for p in pieces_from:
            wholes[p.param_index][p.param_start:p.param_end].copy_(received[offset:offset + p.numel])
            offset += p.numel
    del received
    for i in plan.owned:  # the pieces tile each matrix exactly once (test_matrix_exchange)
        result = orthogonalize(i, wholes[i])
        wholes[i] = torch.zeros(numels[i], dtype=result_dtype, device=device) if result is None \
            else result.reshape(-1).to(result_dtype)
    # The way back mirrors the way there: each piece returns to where it came from, in the same order.
    back = torch.cat([wholes[p.param_index][p.param_start:p.param_end] for pieces_from in plan.receives
                      for p in pieces_from] + [torch.zeros(0, dtype=result_dtype, device=device)])
    del wholes
    returned = torch.empty(sum(plan.send_splits), dtype=result_dtype, device=device)
    collectives.all_to_all_single(returned, back, plan.send_splits, plan.recv_splits, group)
    del back
    out, offset = {}, 0
    for p in send_pieces:
        out[(p.param_index, p.param_start)] = returned[offset:offset + p.numel]
        offset += p.numel
    return out
