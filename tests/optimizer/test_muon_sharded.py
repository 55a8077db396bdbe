"""Muon under the distributed optimizer (ZeRO-1/2/3): the whole-matrix exchange (optimizer/distrib_optimizer.py,
layout.compute_matrix_exchange) and the equivalence matrix of issue 34 against torch.optim.Muon + AdamW.

Several configurations run per process launch (spawning ranks costs seconds on two cores): each worker loops
over its configurations and returns what differed.
"""

import pytest
import torch
from distributed_helper import run_distributed

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

    from megatron_lite.distributed import collectives
    from megatron_lite.optimizer.muon import MatrixSpec

    failures, calls = [], []
    for ddp_config in EXCHANGE_STRATEGIES:
        model, ddp, opt = build({**ddp_config, "num_distributed_optimizer_instances": instances},
                                dict(lr=1e-2, use_distributed_optimizer=True))
        specs = {p: MatrixSpec(*p.shape, (p.shape[0],)) if p.dim() == 2 else None for p in model.parameters()}
        opt._plan_matrix_exchange(specs)
        seen = []

        def stand_in(param, spec, u, seen=seen):
            seen.append(opt.param_to_name[param])
            assert u.shape == (spec.rows, spec.cols)
            assert u.dtype == torch.bfloat16, u.dtype  # it travels in Newton-Schulz's dtype
            return _whole_function(u.float())

        opt._orthogonalize_whole = stand_in
        names = sorted(opt.param_to_name.values())
        full = {p: torch.randn(p.shape, generator=torch.Generator().manual_seed(names.index(name)))
                for p, name in opt.param_to_name.items()}
        updates = {s: full[s.param].reshape(-1)[s.start:s.end].clone() for s in opt.shard_state.main_shards
                   if specs[s.param] is not None}
        wire = []
        with collectives.observe(lambda name, tensor, size: wire.append((name, tensor.dtype, tensor.numel()))):
            results = opt._orthogonalize(updates)
        # Both ways in bf16 (the u pieces too: Newton-Schulz casts to bf16 first), one all-to-all each way.
        plan = opt.matrix_exchange
        expected_wire = [("all_to_all", torch.bfloat16, sum(plan.send_splits)),
                         ("all_to_all", torch.bfloat16, sum(plan.recv_splits))]
        if wire != (expected_wire if dist.get_world_size(opt.grad_stats_group) > 1 else []):
            failures.append(("wire", wire))
        assert results.keys() == updates.keys()
        for shard, result in results.items():
            whole = full[shard.param].bfloat16().float()  # the u the owner gets
            expected = _whole_function(whole).reshape(-1)[shard.start:shard.end].bfloat16()
            if not torch.equal(result, expected):
                failures.append((ddp_config.get("data_parallel_sharding_strategy"), opt.param_to_name[shard.param]))
        calls.append(sorted(seen))
    return dist.get_rank(), failures, calls


@pytest.mark.parametrize("dp, instances", [(1, 1), (2, 1), (4, 2), (4, 1)])
def test_exchange_brings_whole_matrices_to_their_owner_and_back(dp, instances):
    """A stand-in for Newton-Schulz that mixes the whole matrix: every rank's pieces come back equal to the
    function of the whole matrix, at ZeRO-1/2/3 with parameters cut across ranks; each matrix is transformed
    by exactly one rank per instance (its owner); the ranks at one position of two instances do the same work.
    Would catch a piece sent to a rank that does not own it, pieces assembled in the wrong place, results
    returned to the wrong rank or range, an instance that reaches into another's ranks, or u pieces sent in
    fp32 (twice the bytes of the bf16 Newton-Schulz starts from: collectives.observe sees the wire's dtype)."""
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


# ---------------------------------------------------------------------- the equivalence matrix
# A tiny GPT with grouped-query attention (Q 32 rows, K and V 16 each): the position embedding, every layer's
# linear_qkv (split), linear_proj, linear_fc1 and linear_fc2 are Muon's; the word embedding (tied output
# layer), norms and biases AdamW's.
GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
           max_position_embeddings=8, ffn_hidden_size=64)
QKV_ROWS = (32, 16, 16)
LR, WD, CLIP, STEPS, MICRO_BATCHES = 2e-2, 0.1, 0.5, 3, 2
SIMPLE = (3.4445, -4.7750, 2.0315)  # muon_coefficient_type 'simple' = torch.optim.Muon's default


def _gpt():
    from megatron_lite.models import GPTConfig, GPTModel

    torch.manual_seed(1234)
    return GPTModel(GPTConfig(**GPT))


def _batches(dp, step):
    """batches[r][m] = (token ids, labels) of rank r's micro-batch m at `step`: the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(dp):
        tokens = [torch.randint(0, GPT["vocab_size"], (2, GPT["max_position_embeddings"] + 1), generator=gen)
                  for _ in range(MICRO_BATCHES)]
        out.append([(t[:, :-1], t[:, 1:]) for t in tokens])
    return out


def _loss(model, ids, labels):
    return model(ids, labels).mean() / MICRO_BATCHES


def _is_muon(name, param):
    """Megatron's rule: two dimensions, not the word embedding / output layer."""
    return param.dim() == 2 and not name.startswith(("word_embeddings", "output_layer"))


def _reference_grads(master, dp, instances, step):
    """The data-parallel mean gradient with the ranks' arithmetic: each rank accumulates its micro-batches,
    pre-scales by 1/dp; an instance sums its ranks in rank order (reduce-scatter), the instances' sums are then
    added (all-reduce over the holders of a shard: two of them, so the order does not matter)."""
    import copy

    m = dp // instances
    per_rank = []
    for rank_batches in _batches(dp, step):
        model = copy.deepcopy(master)
        acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for ids, labels in rank_batches:
            model.zero_grad(set_to_none=True)
            _loss(model, ids, labels).backward()
            for n, p in model.named_parameters():
                acc[n].add_(p.grad)
        per_rank.append({n: g * (1.0 / dp) for n, g in acc.items()})
    grads = {}
    for n in per_rank[0]:
        sums = []
        for instance in range(instances):
            total = per_rank[instance * m][n].clone()
            for r in range(instance * m + 1, (instance + 1) * m):
                total += per_rank[r][n]
            sums.append(total)
        grads[n] = sums[0] if instances == 1 else sums[0] + sums[1]
    return grads


def _reference(schedule, norms, nesterov=False, split_qkv=True):
    """torch.optim.Muon (the matrices; Q, K and V of each linear_qkv as three parameters) + torch.optim.AdamW
    (the rest; no weight decay on biases and 1-D) on fp32 weights. Clipping by the ranks' gradient norm of each
    step (`norms`: a sharded norm sums squares in another order than torch's; checked close to torch's own):
    torch's formula, clip_grad / (norm + 1e-6) when below 1. `schedule`: per step, the (dp, R) whose batches
    and gradient arithmetic it replays (a resharded run changes them). Returns (master GPT, torch's norms)."""
    master = _gpt()
    muon_params, adam_decay, adam_no_decay, views = [], [], [], []
    for name, p in master.named_parameters():
        if _is_muon(name, p):
            rows = QKV_ROWS if split_qkv and name.endswith("linear_qkv.weight") else (p.shape[0],)
            starts = [sum(rows[:k]) for k in range(len(rows))]
            for start, size in zip(starts, rows):
                piece = torch.nn.Parameter(p.detach()[start:start + size].clone())
                muon_params.append(piece)
                views.append((name, p, start, size, piece))
        elif name.endswith(".bias") or p.dim() == 1:
            adam_no_decay.append(p)
        else:
            adam_decay.append(p)
    muon = torch.optim.Muon(muon_params, lr=LR, weight_decay=WD, momentum=0.95, nesterov=nesterov,
                            ns_coefficients=SIMPLE, ns_steps=5, adjust_lr_fn="original")
    adamw = torch.optim.AdamW([{"params": adam_decay, "weight_decay": WD},
                               {"params": adam_no_decay, "weight_decay": 0.0}], lr=LR, foreach=True)
    torch_norms = []
    for step, (dp, instances) in enumerate(schedule):
        grads = _reference_grads(master, dp, instances, step)
        torch_norms.append(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item())
        coeff = CLIP / (torch.tensor(norms[step], dtype=torch.float32) + 1e-6)
        for name, p in master.named_parameters():
            p.grad = grads[name].clone()
            if coeff.item() < 1.0:
                p.grad.mul_(coeff)
        for name, p, start, size, piece in views:
            piece.grad = p.grad[start:start + size].clone()
        muon.step()
        adamw.step()
        with torch.no_grad():
            for name, p, start, size, piece in views:
                p[start:start + size].copy_(piece)
    return master, torch_norms


ZERO = dict(use_distributed_optimizer=True, bucket_size=1500)  # small buckets: matrices straddle shards
ZERO3 = dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
             data_parallel_sharding_strategy="optim_grads_params", fsdp_unit_modules=("TransformerLayer",))
MATRIX = {  # name -> (DDP config, meta-device build)
    "no_shard": (dict(use_distributed_optimizer=False), False),
    "optim": (ZERO, False),
    "optim_overlap": ({**ZERO, "overlap_grad_reduce": True, "overlap_param_gather": True}, False),
    "optim_grads": ({**ZERO, "data_parallel_sharding_strategy": "optim_grads"}, False),
    "optim_grads_overlap": ({**ZERO, "data_parallel_sharding_strategy": "optim_grads", "overlap_grad_reduce": True,
                             "overlap_param_gather": True}, False),
    "optim_grads_params": (ZERO3, False),
    "optim_grads_params_overlap": ({**ZERO3, "overlap_param_gather": True}, False),
    "optim_grads_params_meta": ({**ZERO3, "overlap_param_gather": True}, True),
}


def _muon_config(distributed, **extra):
    return dict(optimizer="muon", lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=distributed,
                muon_coefficient_type="simple", muon_scale_mode="shape_scaling", muon_num_ns_steps=5, **extra)


def _build(ddp_config, meta, instances=1, **extra):
    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.distributed.meta_init import meta_device_init

    if meta:
        torch.manual_seed(1234)  # the replay draws from the generator's state where the build starts
        with meta_device_init():
            model = _gpt()
    else:
        model = _gpt()
    config = {**ddp_config, "num_distributed_optimizer_instances": instances} if instances > 1 else ddp_config
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(**config))
    opt = get_megatron_optimizer(OptimizerConfig(**_muon_config(config["use_distributed_optimizer"], **extra)),
                                 [ddp])
    return model, ddp, opt


def _train(ddp, opt, rank, dp, steps, first_step=0):
    norms = []
    for step in range(first_step, first_step + steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        batches = _batches(dp, step)[rank]
        for i, (ids, labels) in enumerate(batches):
            if i < len(batches) - 1:
                with ddp.no_sync():
                    _loss(ddp, ids, labels).backward()
            else:
                _loss(ddp, ids, labels).backward()
        ddp.finish_grad_sync()
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
    return norms


def _params(model, ddp):
    ddp.finish_param_sync()
    with ddp.full_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _equivalence_worker(names, instances, nesterov, bound=None):
    import torch.distributed as dist

    rank, dp = dist.get_rank(), dist.get_world_size()
    failures, references = [], {}
    for name in names:
        ddp_config, meta = MATRIX[name]
        model, ddp, opt = _build(ddp_config, meta, instances, muon_nesterov=nesterov)
        norms = _train(ddp, opt, rank, dp, STEPS)
        params = _params(model, ddp)
        key = tuple(norms)
        if key not in references:
            references[key] = _reference([(dp, instances)] * STEPS, norms, nesterov)
        master, torch_norms = references[key]
        if not all(abs(a - b) <= 1e-6 * b for a, b in zip(norms, torch_norms)):
            failures.append((name, "grad norms", norms, torch_norms))
        for n, q in master.named_parameters():
            differ = (params[n] - q.detach()).abs().max().item()
            if (differ > bound) if bound is not None else not torch.equal(params[n], q.detach()):
                failures.append((name, n, differ))
    return failures


# no_shard at dp=4 is not bitwise (below): the gradients differ from the reference's by fp32 rounding of another
# addition order. Newton-Schulz rounds its input to bf16 and iterates in bf16 with slopes up to a = 3.4 (quintic
# coefficients), so an input element one bf16 step (2^-8 relative) away can move the output by several steps:
# measured 1.35e-3 after 3 steps, i.e. STEPS * LR * sqrt(2) (the largest shape scale here) * 2^-6. Bound: twice
# that. A matrix orthogonalized in pieces, or stepped by AdamW, moves parameters by about LR (0.02) per step.
NO_SHARD_DP4_BOUND = STEPS * LR * 2 ** 0.5 * 2 ** -5

EQUIVALENCE = [  # (dp, R, configurations, nesterov)
    pytest.param(2, 1, list(MATRIX), False, id="dp2"),
    pytest.param(2, 1, ["optim", "optim_grads_params_overlap"], True, id="dp2-nesterov"),
    # no_shard at dp=4: gloo's all-reduce adds the four ranks' gradients in an order of its own (at dp=2 the one
    # addition commutes), so it is bitwise at dp=2 only; the distributed optimizer's reduce-scatter adds in rank
    # order (collectives.py), which the reference replays.
    pytest.param(4, 1, [name for name in MATRIX if name != "no_shard"], False, id="dp4"),
    pytest.param(4, 1, ["no_shard"], False, id="dp4-no_shard-bounded"),
    pytest.param(4, 2, ["optim", "optim_grads_overlap", "optim_grads_params_overlap", "optim_grads_params_meta"],
                 False, id="dp4-R2"),
]


@pytest.mark.parametrize("dp, instances, names, nesterov", EQUIVALENCE)
def test_muon_matches_torch_at_every_strategy(dp, instances, names, nesterov):
    """The issue's equivalence matrix, fp32: no_shard and ZeRO-1/2/3 with and without overlapped gradient
    reduction and parameter gathering, the meta-device build, R=2 instances, clipping active at every step:
    every parameter bitwise equal to torch.optim.Muon (matrices, Q, K, V as three) + torch.optim.AdamW (the
    word embedding, norms, biases) on the same global batches. Would catch a matrix orthogonalized in pieces
    (each rank its flat shard), the fused QKV orthogonalized whole, a matrix silently stepped by AdamW (the
    position embedding, a meta-device placeholder taken for 1-D), a piece returned to the wrong place, or
    momentum kept per rank differently from torch."""
    bound = NO_SHARD_DP4_BOUND if dp == 4 and names == ["no_shard"] else None
    for failures in run_distributed(_equivalence_worker, dp, names, instances, nesterov, bound, timeout=900):
        assert not failures, failures[:6]


# ---------------------------------------------------------------------- Newton-Schulz work per rank
def _count_worker(ddp_config, instances):
    import torch.distributed as dist

    from megatron_lite.distributed.layout import newton_schulz_cost
    from megatron_lite.optimizer import muon

    rank, dp = dist.get_rank(), dist.get_world_size()
    model, ddp, opt = _build(ddp_config, False, instances)
    calls, real = [], muon.newton_schulz

    def counted(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    muon.newton_schulz = counted
    try:
        _train(ddp, opt, rank, dp, 1)
    finally:
        muon.newton_schulz = real
    return sorted(calls), sum(newton_schulz_cost(*shape) for shape in calls)


# Every Newton-Schulz matrix of the tiny GPT: the position embedding; per layer Q, K, V, linear_proj, fc1, fc2.
GPT_NS_SHAPES = sorted([(8, 32)] + 2 * [(32, 32), (16, 32), (16, 32), (32, 32), (64, 32), (32, 64)])


@pytest.mark.parametrize("dp, instances, ddp_config", [
    (2, 1, ZERO), (4, 1, ZERO3), (4, 2, ZERO), (2, 1, dict(use_distributed_optimizer=False)),
], ids=["dp2-zero1", "dp4-zero3", "dp4-R2-zero1", "dp2-no_shard"])
def test_each_rank_orthogonalizes_only_its_matrices(dp, instances, ddp_config):
    """Newton-Schulz calls counted on every rank (muon.newton_schulz patched) over one step: under the distributed
    optimizer the ranks of an instance together orthogonalize every matrix exactly once (Q, K and V as three),
    each rank about 1/(dp/R) of the work (the highest load within list scheduling's bound, total/m + the largest
    matrix), the two instances' ranks at one position the same; no_shard orthogonalizes everything everywhere.
    Would catch every rank orthogonalizing every matrix (no saving), a matrix done by two ranks of an instance
    or by none, the work piled on one rank, Newton-Schulz run per micro-batch (the step has two; DeepSpeed's
    ZeRO-3 issue 8443), or none at all without sharding (its issue 8441: Muon training as SGD)."""
    from megatron_lite.distributed.layout import newton_schulz_cost

    results = run_distributed(_count_worker, dp, ddp_config, instances)
    if not ddp_config["use_distributed_optimizer"]:
        assert all(calls == GPT_NS_SHAPES for calls, _ in results)
        return
    m = dp // instances
    total = sum(newton_schulz_cost(*shape) for shape in GPT_NS_SHAPES)
    largest = max(newton_schulz_cost(*shape) for shape in GPT_NS_SHAPES)
    for instance in range(instances):
        ranks = range(instance * m, (instance + 1) * m)
        assert sorted(shape for r in ranks for shape in results[r][0]) == GPT_NS_SHAPES
        assert sum(results[r][1] for r in ranks) == total
        assert max(results[r][1] for r in ranks) <= total / m + largest
        assert all(results[r][0] for r in ranks), "every rank has matrices to orthogonalize"
    assert all(results[r] == results[r % m] for r in range(dp))


# ---------------------------------------------------------------------- resume, reshard, replicas, last words
def _scheduled(ddp_config, meta=False, instances=1):
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    model, ddp, opt = _build(ddp_config, meta, instances)
    return model, ddp, opt, OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")


def _resume_worker(root):
    import os

    import torch.distributed as dist
    from optim_testing import full_state, states_equal

    from megatron_lite import checkpointing

    rank, dp = dist.get_rank(), dist.get_world_size()
    failures = []
    for fmt in ("torch", "torch_dist"):
        for name in ("optim", "optim_grads_params_overlap"):
            where = os.path.join(root, f"{fmt}_{name}")
            model, ddp, opt, sched = _scheduled(MATRIX[name][0])
            _train(ddp, opt, rank, dp, 2)
            checkpointing.save_checkpoint(where, 2, ddp, opt, sched, 16, ckpt_format=fmt)
            _train(ddp, opt, rank, dp, 2, first_step=2)
            straight, straight_params = full_state(opt), _params(model, ddp)
            model, ddp, opt, sched = _scheduled(MATRIX[name][0])
            checkpointing.load_checkpoint(where, ddp, opt, sched)
            _train(ddp, opt, rank, dp, 2, first_step=2)
            resumed = full_state(opt)
            if "momentum_buffer" not in next(iter(v for k, v in resumed.items() if "linear_fc1.weight" in k)):
                failures.append((fmt, name, "no momentum_buffer in the state"))
            if not states_equal(straight, resumed):
                failures.append((fmt, name, "state"))
            params = _params(model, ddp)
            if any(not torch.equal(params[n], straight_params[n]) for n in params):
                failures.append((fmt, name, "params"))
    return failures


def test_resume_is_bit_exact_in_both_formats(tmp_path):
    """dp=2, ZeRO-1 and ZeRO-3 (overlapped gather), saved after 2 steps in the torch and torch_dist formats and
    resumed for 2: every main param, Muon momentum, AdamW moment and step count, and every parameter, equal to
    the run that went straight on. Would catch the momentum buffer left out of a format, or restored to
    another matrix's range."""
    for failures in run_distributed(_resume_worker, 2, str(tmp_path), timeout=600):
        assert not failures, failures


def _reshard_save_worker(where, name):
    import torch.distributed as dist

    from megatron_lite import checkpointing

    model, ddp, opt, sched = _scheduled(MATRIX[name][0])
    norms = _train(ddp, opt, dist.get_rank(), dist.get_world_size(), 2)
    checkpointing.save_checkpoint(where, 2, ddp, opt, sched, 16, ckpt_format="torch_dist")
    return norms


def _reshard_load_worker(where, name, instances):
    import torch.distributed as dist

    from megatron_lite import checkpointing

    model, ddp, opt, sched = _scheduled(MATRIX[name][0], instances=instances)
    checkpointing.load_checkpoint(where, ddp, opt, sched)
    norms = _train(ddp, opt, dist.get_rank(), dist.get_world_size(), 2, first_step=2)
    return norms, _params(model, ddp)


@pytest.mark.parametrize("saved_as, loaded_as, instances", [
    ("optim", "optim_grads_params_overlap", 1), ("optim_grads_params_overlap", "optim", 2),
], ids=["dp2-zero1-to-dp4-zero3", "dp2-zero3-to-dp4-R2-zero1"])
def test_reshard_dp2_to_dp4_continues_like_torch(tmp_path, saved_as, loaded_as, instances):
    """Saved (torch_dist) at dp=2 after 2 steps, loaded at dp=4 with another strategy (and R=2), 2 more steps:
    every parameter bitwise equal to torch.optim.Muon + AdamW run on dp=2's batches for 2 steps and dp=4's
    for 2. Would catch the Muon momentum tied to the layout that saved it (a matrix's pieces are other ranges
    at dp=4), lost, or reset by the load."""
    where = str(tmp_path / "ck")
    norms = run_distributed(_reshard_save_worker, 2, where, saved_as)[0]
    results = run_distributed(_reshard_load_worker, 4, where, loaded_as, instances)
    later, params = results[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks: the matmuls' (and so the bf16 Newton-Schulz's) bits depend on it
    try:
        master, torch_norms = _reference([(2, 1)] * 2 + [(4, instances)] * 2, norms + later)
    finally:
        torch.set_num_threads(threads)
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(norms + later, torch_norms))
    for _, rank_params in results:
        for n, q in master.named_parameters():
            assert torch.equal(rank_params[n], q.detach()), n


def _replicas_worker(root):
    import os

    import torch.distributed as dist
    from optim_testing import full_state, states_equal

    from megatron_lite import checkpointing
    from megatron_lite.checkpointing import last_words

    rank, dp = dist.get_rank(), dist.get_world_size()
    config = MATRIX["optim_grads_params_overlap"][0]
    model, ddp, opt, _ = _scheduled(config, instances=2)
    _train(ddp, opt, rank, dp, STEPS)
    straight = full_state(opt)

    # A wiped shard on rank 1 rebuilt from its replica (rank 3) after step 1; then the rest of the steps.
    model, ddp, opt, sched = _scheduled(config, instances=2)
    _train(ddp, opt, rank, dp, 1)
    if rank == 1:
        for shard in opt.shard_state.main_shards:
            shard.main.data.fill_(float("nan"))
            opt.optimizer.state.pop(shard.main, None)
        opt.recv_shard_state(src=3)
    elif rank == 3:
        opt.send_shard_state(dst=1)
    _train(ddp, opt, rank, dp, STEPS - 1, first_step=1)
    rebuilt = states_equal(full_state(opt), straight)

    # Last words after step 1 (written as a failing step would), loaded by a fresh run that goes on.
    where = os.path.join(root, "words")
    model, ddp, opt, sched = _scheduled(config, instances=2)
    words = last_words.LastWords(where, opt, sched, 0, 0)
    words.stage(1, 16)
    _train(ddp, opt, rank, dp, 1)
    sched.step()
    words.commit()
    written = words.write("test: after iteration 1") is not None
    dist.barrier()
    model, ddp, opt, sched = _scheduled(config, instances=2)
    loaded = checkpointing.load_checkpoint(where, ddp, opt, sched)
    _train(ddp, opt, rank, dp, STEPS - 1, first_step=1)
    return dict(rebuilt=rebuilt, written=written, from_words=bool(loaded.get("last_words")),
                resumed=states_equal(full_state(opt), straight))


def test_replica_rebuild_and_last_words_carry_the_momentum(tmp_path):
    """dp=4, R=2, ZeRO-3: a shard wiped on rank 1 after step 1 and rebuilt from its replica (rank 3), and last
    words written after step 1 and loaded by a fresh run, both continue bitwise as the uninterrupted run
    (main params, Muon momentum, AdamW moments). Would catch the momentum left out of the replica transfer or
    the last words."""
    for r in run_distributed(_replicas_worker, 4, str(tmp_path), timeout=600):
        assert r["rebuilt"] and r["written"] and r["from_words"] and r["resumed"], r


# ---------------------------------------------------------------------- a matrix no rank used
class _Both:
    """torch.optim.Muon and AdamW stepped as one optimizer (the reference of heads_side_by_side)."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def zero_grad(self):
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()


def _unused_worker(heads, resume):
    import copy

    import torch.distributed as dist
    from optim_testing import TwoHeads, heads_side_by_side
    from torch import nn

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    torch.manual_seed(0)
    model = TwoHeads()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        use_distributed_optimizer=True, find_unused_parameters=True, overlap_grad_reduce=True, bucket_size=30))
    matrices = [p for p in reference.parameters() if p.dim() == 2]
    biases = [p for p in reference.parameters() if p.dim() == 1]
    torch_opt = _Both(torch.optim.Muon(matrices, lr=LR, weight_decay=WD, momentum=0.95, nesterov=False,
                                       ns_coefficients=SIMPLE, adjust_lr_fn="original"),
                      torch.optim.AdamW([{"params": biases, "weight_decay": 0.0}], lr=LR))

    def built():
        return get_megatron_optimizer(OptimizerConfig(**{**_muon_config(True), "clip_grad": 0.0}), ddp)

    return heads_side_by_side(ddp, built, reference, torch_opt, heads, resume, dist.get_rank())[0]


@pytest.mark.parametrize("heads", ["lagging", "never_stepped"])
@pytest.mark.parametrize("resume", ["torch", "shards"])
def test_a_matrix_no_rank_used_is_left_as_torch_leaves_it(heads, resume):
    """dp=2, ZeRO-1, a head (a Muon matrix, cut across the ranks by the small buckets) that no rank uses for some
    steps, and a round trip of the state before step 3: every parameter equal to torch DDP + torch.optim.Muon
    after every step. Would catch the exchange or the step waiting for, or stepping, a matrix no rank has a
    gradient for (torch leaves it: no weight decay, momentum kept), or its missing momentum restored as zeros
    after the round trip."""
    for diffs in run_distributed(_unused_worker, 2, heads, resume):
        assert diffs == [0.0] * 5, diffs


# ---------------------------------------------------------------------- bf16 parameters
def _bf16_worker(names):
    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    rank, dp = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in names:
        ddp_config, _ = MATRIX[name]
        model = _gpt().to(torch.bfloat16)
        ddp = DistributedDataParallel(model, DistributedDataParallelConfig(**ddp_config, grad_reduce_in_fp32=True))
        config = {**_muon_config(ddp_config["use_distributed_optimizer"]), "clip_grad": 0.0, "bf16": True}
        opt = get_megatron_optimizer(OptimizerConfig(**config), [ddp])
        _train(ddp, opt, rank, dp, STEPS)
        main = {n: entry["param"] for n, entry in opt.state_dict()["state"].items()}
        out[name] = (_params(model, ddp), main)
    return out


def test_bf16_parameters_shard_like_no_shard():
    """bf16 parameters with fp32 main params (and gradients reduced in fp32), dp=2, no clipping: ZeRO-1/2/3 (with
    overlap) give the bf16 parameters and fp32 main params of no_shard bit for bit (at dp=2 both reduce with one
    commutative addition; every rank of no_shard orthogonalizes each whole matrix itself). Would catch the sharded
    path stepping a bf16 model otherwise than no_shard: the update pieces taken from anything but the fp32 main
    shards, updated main shards not cast back into the bf16 buffer before its all-gather, or a piece returned
    to another range."""
    names = ["no_shard", "optim", "optim_grads_overlap", "optim_grads_params_overlap"]
    for per_rank in run_distributed(_bf16_worker, 2, names):
        params, main = per_rank["no_shard"]
        assert all(p.dtype == torch.bfloat16 for p in params.values())
        for name in names[1:]:
            assert all(torch.equal(per_rank[name][0][n], params[n]) for n in params), name
            assert all(torch.equal(per_rank[name][1][n], main[n]) for n in main), name


# ---------------------------------------------------------------------- chunks, dtypes, unused matrices, fp16 skips
class _Mixed(torch.nn.Module):
    """fp32 `a` (16 -> 24), `b` (24 -> 16) in the low-precision dtype, fp32 `side` (16 x 16, no bias) used only at
    some steps: a chunk of this has two buffers (one per parameter dtype), three matrices and two biases."""

    def __init__(self, dtype):
        super().__init__()
        self.a = torch.nn.Linear(16, 24)
        self.b = torch.nn.Linear(24, 16).to(dtype)
        self.side = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x, use_side):
        y = self.b(torch.tanh(self.a(x)).to(self.b.weight.dtype)).float()
        return y + self.side(x) if use_side else y


SIDE_USED = (True, False, False, True)  # no rank uses `side` at steps 1 and 2 (the same on every rank: see below)
CHUNK_STRATEGIES = {
    "no_shard": dict(use_distributed_optimizer=False),
    "optim": dict(use_distributed_optimizer=True, bucket_size=200),
    "optim_grads_overlap": dict(use_distributed_optimizer=True, bucket_size=200, overlap_grad_reduce=True,
                                data_parallel_sharding_strategy="optim_grads"),
    "optim_grads_params_overlap": dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                       overlap_param_gather=True, data_parallel_sharding_strategy="optim_grads_params",
                                       fsdp_unit_modules=("Linear",)),
}


def _chunks_worker(names, instances, fp16):
    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    rank = dist.get_rank()
    dtype = torch.float16 if fp16 else torch.bfloat16
    precision = dict(fp16=True, initial_loss_scale=2.0**15, hysteresis=1) if fp16 else dict(bf16=True)
    out = {}
    for name in names:
        torch.manual_seed(7)
        chunks = [_Mixed(dtype), _Mixed(dtype)]
        config = {**CHUNK_STRATEGIES[name], "find_unused_parameters": True, "grad_reduce_in_fp32": True}
        if instances > 1:
            config["num_distributed_optimizer_instances"] = instances
        ddps = [DistributedDataParallel(chunk, DistributedDataParallelConfig(**config)) for chunk in chunks]
        opt = get_megatron_optimizer(OptimizerConfig(**{**_muon_config(config["use_distributed_optimizer"]),
                                                        **precision}), ddps)
        assert len(ddps[0].param_and_grad_buffers) == 2
        outcomes = []
        for step, used in enumerate(SIDE_USED):
            for ddp in ddps:
                ddp.zero_grad_buffer()
            opt.zero_grad()
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            if fp16 and step == 0 and rank == 1:
                x = x * 1e5  # only rank 1's gradients overflow: every rank must skip (and skip the exchange)
            opt.scale_loss(ddps[1](ddps[0](x, used), used).pow(2).mean()).backward()
            for ddp in ddps:
                ddp.finish_grad_sync()
            outcomes.append(opt.step()[0])
        params = {}
        for i, (chunk, ddp) in enumerate(zip(chunks, ddps)):
            ddp.finish_param_sync()
            with ddp.full_parameters():
                params.update({f"chunk{i}.{n}": p.detach().clone() for n, p in chunk.named_parameters()})
        out[name] = (outcomes, params)
    return out


@pytest.mark.parametrize("dp, instances, fp16", [(2, 1, False), (2, 1, True), (4, 2, True)],
                         ids=["dp2-bf16", "dp2-fp16", "dp4-R2-fp16"])
def test_chunks_dtypes_unused_matrices_and_overflow_skips(dp, instances, fp16):
    """Two model chunks, each with an fp32 and a low-precision buffer (four buffers, indexed concatenated by the
    exchange plan), a matrix no rank uses at two of the four steps, and with fp16 an overflow on rank 1 only at
    step 0: every rank skips that step (no exchange anywhere: a rank that went on would wait in it forever) and
    ZeRO-1/2/3 give the parameters of no_shard (dp=2, one commutative addition) bit for bit; at dp=4 R=2 the
    sharded strategies agree with each other and replicas with their position's rank. Would catch a second
    chunk's or buffer's matrices mapped onto the first's pieces, an unused matrix stepped (weight decay) or
    waited for, or the overflow skip not agreed before the exchange.
    (The use of `side` is the same on every rank; two chunks with a parameter used on some ranks only are
    test_ddp_errors.py's test_chunks_with_a_parameter_some_ranks_use_match_torch.)"""
    names = list(CHUNK_STRATEGIES) if dp == 2 else [n for n in CHUNK_STRATEGIES if n != "no_shard"]
    results = run_distributed(_chunks_worker, dp, names, instances, fp16, timeout=300)
    m = dp // instances
    for rank, per_name in enumerate(results):
        baseline_outcomes, baseline = per_name[names[0]]
        assert baseline_outcomes == [not fp16, True, True, True], baseline_outcomes
        for name in names[1:]:
            outcomes, params = per_name[name]
            assert outcomes == baseline_outcomes, (rank, name)
            differ = [n for n in baseline if not torch.equal(params[n], baseline[n])]
            assert not differ, (rank, name, differ)
        for name in names:
            assert all(torch.equal(per_name[name][1][n], results[rank % m][name][1][n]) for n in baseline)
