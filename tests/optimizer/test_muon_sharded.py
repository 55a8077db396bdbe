"""Muon under the distributed optimizer (ZeRO-1/2/3): the whole-matrix exchange (optimizer/distrib_optimizer.py,
layout.compute_matrix_exchange) and the equivalence matrix of issue 34 against torch.optim.Muon + AdamW.

Several configurations run per process launch (spawning ranks costs seconds on two cores): each worker loops
over its configurations and returns what differed.
"""

from collections import namedtuple

import pytest
import torch
from distributed_helper import run_distributed

Spec = namedtuple("Spec", "rows cols row_splits")  # what the exchange reads of a MatrixSpec

EXCHANGE_STRATEGIES = [  # DDP configs: parameters cut across ranks by small buckets
    dict(use_distributed_optimizer=True, bucket_size=100),
    dict(use_distributed_optimizer=True, bucket_size=100, overlap_grad_reduce=True,
         data_parallel_sharding_strategy="optim_grads"),
    dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
         data_parallel_sharding_strategy="optim_grads_params", fsdp_unit_modules=("Linear", "LayerNorm")),
]


def _whole_function(u):
    """A stand-in for Newton-Schulz: a function of the whole matrix (rows and columns mixed), not elementwise."""
    return u.flip(0) * u.sum(0, keepdim=True) + u.mean()


def _exchange_worker(instances):
    import torch.distributed as dist
    from optim_testing import build

    failures, calls = [], []
    for ddp_config in EXCHANGE_STRATEGIES:
        model, ddp, opt = build({**ddp_config, "num_distributed_optimizer_instances": instances},
                                dict(lr=1e-2, use_distributed_optimizer=True))
        specs = {p: Spec(*p.shape, None) if p.dim() == 2 else None for p in model.parameters()}
        opt._plan_matrix_exchange(specs)
        seen = []

        def stand_in(param, spec, u, seen=seen):
            seen.append(opt.param_to_name[param])
            assert u.shape == (spec.rows, spec.cols)
            return _whole_function(u)

        opt._orthogonalize_whole = stand_in
        names = sorted(opt.param_to_name.values())
        full = {p: torch.randn(p.shape, generator=torch.Generator().manual_seed(names.index(name)))
                for p, name in opt.param_to_name.items()}
        updates = {s: full[s.param].reshape(-1)[s.start:s.end].clone() for s in opt.shard_state.main_shards
                   if specs[s.param] is not None}
        results = opt._orthogonalize(updates)
        assert results.keys() == updates.keys()
        for shard, result in results.items():
            expected = _whole_function(full[shard.param]).reshape(-1)[shard.start:shard.end]
            if not torch.equal(result, expected):
                failures.append((ddp_config.get("data_parallel_sharding_strategy"), opt.param_to_name[shard.param]))
        calls.append(sorted(seen))
    return dist.get_rank(), failures, calls


@pytest.mark.parametrize("dp, instances", [(2, 1), (4, 2), (4, 1)])
def test_exchange_brings_whole_matrices_to_their_owner_and_back(dp, instances):
    """A stand-in for Newton-Schulz that mixes the whole matrix: every rank's pieces come back equal to the
    function of the whole matrix, at ZeRO-1/2/3 with parameters cut across ranks; each matrix is transformed
    by exactly one rank per instance (its owner); the ranks at one position of two instances do the same work.
    Would catch a piece sent to a rank that does not own it, pieces assembled in the wrong place, results
    returned to the wrong rank or range, or an instance that reaches into another's ranks."""
    results = run_distributed(_exchange_worker, dp, instances)
    m = dp // instances
    for rank, failures, _ in results:
        assert not failures, (rank, failures[:5])
    for config_index in range(len(EXCHANGE_STRATEGIES)):
        for instance in range(instances):
            ranks = range(instance * m, (instance + 1) * m)
            done = [name for r in ranks for name in results[r][2][config_index]]
            assert sorted(done) == ["fc1.weight", "fc2.weight", "head.weight"]
        for rank in range(dp):  # replicas: the same matrices as the rank at the same position
            assert results[rank][2][config_index] == results[rank % m][2][config_index]
