"""Expert parameters (megatron-core's `param.allreduce = False`): reduced over the expert data-parallel group.

Setup, as with expert parallelism: dense parameters are data-parallel over every rank; each expert-parallel
position k (rank r holds position r % ep) holds experts of its own, replicated over its expert data-parallel
group {r : r % ep == k}. The single-process reference builds every position's model (the dense part shared)
and replays each rank's micro-batches: dense gradients are the mean over all ranks, expert gradients
megatron-core's (sum over the expert group) / dp. Bit-exact where one addition per element is involved (two
ranks reduce), else to 1e-6 relative (gloo's summation order over four ranks is not ours).
"""

import pytest
import torch
import torch.nn as nn
from distributed_helper import run_distributed

MICRO_BATCHES = 2
WIDTH = 12
EXPERTS = 2  # per position


class Expert(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc_in = nn.Linear(width, 2 * width)
        self.fc_out = nn.Linear(2 * width, width)

    def forward(self, h):
        return self.fc_out(torch.tanh(self.fc_in(h)))


def without_first_feature(h):
    """Feature 0 zeroed: the weights reading it get exact-zero gradients (something for num_zeros to count)."""
    return torch.cat([torch.zeros_like(h[:, :1]), h[:, 1:]], dim=1)


class MoEBlock(nn.Module):
    """A dense layer, a dense router and this position's experts (soft routing: every token to every expert)."""

    def __init__(self, width, expert_names):
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.router = nn.Linear(width, len(expert_names), bias=False)
        self.experts = nn.ModuleDict({name: Expert(width) for name in expert_names})
        self.use_experts = True

    def forward(self, h):
        h = h + torch.tanh(self.dense(h))
        if not self.use_experts:  # a position whose experts of this block sit out (find_unused_parameters)
            return h
        weights = torch.softmax(self.router(h), dim=-1)
        routed = without_first_feature(h)
        return h + sum(weights[:, i:i + 1] * expert(routed) for i, expert in enumerate(self.experts.values()))


class MoENet(nn.Module):
    def __init__(self, expert_names, width=WIDTH):
        super().__init__()
        self.fc_in = nn.Linear(8, width)
        self.blocks = nn.ModuleList([MoEBlock(width, expert_names) for _ in range(2)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = torch.tanh(self.fc_in(without_first_feature(x)))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_moe(position, global_names=False, seed=0):
    """The model of expert-parallel position `position`: dense parameters the same everywhere, experts of
    its own (named by global expert index with `global_names`, else 0..EXPERTS-1 on every position) and
    marked allreduce=False."""
    names = [str(position * EXPERTS + i if global_names else i) for i in range(EXPERTS)]
    torch.manual_seed(seed)
    model = MoENet(names)
    g = torch.Generator().manual_seed(1000 + 17 * seed + position)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                p.allreduce = False
    return model


_groups = {}


def expert_group(ep):
    """This rank's expert data-parallel group with `ep` expert-parallel positions: {r : r % ep == rank % ep}
    (every rank creates every group, once per world)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    key = (dist.group.WORLD, ep)
    if key not in _groups:
        groups = [dist.new_group([r for r in range(world) if r % ep == k]) for k in range(ep)]
        _groups[key] = groups[rank % ep]
    return _groups[key]


def batches_for(dp, step=0):
    from ddp_testing import make_batches
    return make_batches(dp, MICRO_BATCHES, seed=50 + step)


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def rank_grads(model, rank_batches):
    """Gradients of one rank's micro-batches, accumulated in fp32 like main_grad."""
    model.zero_grad(set_to_none=True)
    acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for x, y in rank_batches:
        model.zero_grad(set_to_none=True)
        (loss_fn(model, x, y) / len(rank_batches)).backward()
        for n, p in model.named_parameters():
            acc[n].add_(p.grad)
    return acc


def reference_grads(models, batches, ep, average=False):
    """Per position k: {name: reduced gradient} as DDP must produce it (the ranks' arithmetic, in rank order):
    dense = mean over all ranks, experts of k = sum over the ranks of k's group / dp."""
    dp = len(batches)
    per_rank = [rank_grads(models[r % ep], batches[r]) for r in range(dp)]
    out = []
    for k in range(ep):
        members = [r for r in range(dp) if r % ep == k]
        edp = len(members)
        ref = {}
        for n, p in models[k].named_parameters():
            expert = not getattr(p, "allreduce", True)
            ranks = members if expert else range(dp)
            if average:  # pre-scale (experts: edp/dp), then ReduceOp.AVG = sum / group size
                pre = edp / dp if expert else 1.0
                total = sum_in_order([per_rank[r][n] * pre if pre != 1.0 else per_rank[r][n] for r in ranks])
                ref[n] = total / (edp if expert else dp)
            else:
                ref[n] = sum_in_order([per_rank[r][n] * (1.0 / dp) for r in ranks])
        out.append(ref)
    return out


def sum_in_order(tensors):
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


def ddp_config(strategy, **kwargs):
    from megatron_lite import DistributedDataParallelConfig
    return DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy,
                                         use_distributed_optimizer=strategy != "no_shard", **kwargs)


def train_step(ddp, rank_batches):
    ddp.zero_grad_buffer()
    for i, (x, y) in enumerate(rank_batches):
        if i < len(rank_batches) - 1:
            with ddp.no_sync():
                (loss_fn(ddp, x, y) / len(rank_batches)).backward()
        else:
            (loss_fn(ddp, x, y) / len(rank_batches)).backward()
    ddp.finish_grad_sync()


def reduced_vs_expected(ddp, ref, buffers):
    """(actual, expected) flat tensors of what this rank holds reduced in `buffers`: whole buffers (no_shard),
    else the rank's shard of every bucket (expert buckets: its shard in the expert group)."""
    actual, expected = [], []
    for buffer in buffers:
        flat = torch.zeros(buffer.numel, dtype=buffer.grad_dtype)
        for param, (start, end, _) in buffer.param_index_map.items():
            flat[start:end] = ref[ddp.param_to_name[param]].reshape(-1)
        for bucket in buffer.buckets:
            if ddp.ddp_config.use_distributed_optimizer:
                lo = bucket.offset + bucket.shard_offset
                actual.append(bucket.reduced_grad_shard.detach().clone())
                expected.append(flat[lo:lo + bucket.shard_size])
            else:
                actual.append(bucket.grad_data.detach().clone())
                expected.append(flat[bucket.offset:bucket.offset + bucket.grad_data.numel()])
    return torch.cat(actual), torch.cat(expected)


def _grads_worker(cases):
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel

    rank, dp = dist.get_rank(), dist.get_world_size()
    batches = batches_for(dp)
    results = []
    for strategy, ep, overlap, average, bucket_size, global_names in cases:
        models = [make_moe(k, global_names) for k in range(ep)]
        model = make_moe(rank % ep, global_names)  # (deepcopy would drop the allreduce marker)
        ddp = DistributedDataParallel(model, ddp_config(strategy, overlap_grad_reduce=overlap, bucket_size=bucket_size,
                                                        average_in_collective=average),
                                      expert_data_parallel_group=expert_group(ep))
        assert ddp.expert_parallel_buffers and ddp.param_and_grad_buffers
        for _ in range(2):  # the second iteration: hooks launch the buckets (overlap), buffers were reset
            train_step(ddp, batches[rank])
        ref = reference_grads(models, batches, ep, average)[rank % ep]
        # Exact where at most two ranks reduce (dense: dp, experts: the expert group's size).
        for kind, buffers, exact in (("dense", ddp.param_and_grad_buffers, dp == 2),
                                     ("expert", ddp.expert_parallel_buffers, dp // ep <= 2)):
            actual, expected = reduced_vs_expected(ddp, ref, buffers)
            if exact:
                ok = torch.equal(actual, expected)
            else:
                ok = torch.allclose(actual, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())
            results.append((f"{strategy} {kind}", ep, overlap, average, bool(ok),
                            (actual - expected).abs().max().item()))
        # Expert buckets reduce over the expert group only: its rank within it, not the data-parallel rank.
        assert all(b.data_parallel_world_size == dp // ep for b in ddp.expert_parallel_buffers)
    return results


CASES_4 = [  # (strategy, ep, overlap, average, bucket_size, global expert names)
    ("no_shard", 2, False, False, None, False),
    ("no_shard", 2, True, False, 60, True),
    ("no_shard", 1, True, True, 60, False),
    ("optim", 2, True, False, 60, False),
    ("optim", 2, False, True, None, True),
    ("optim", 4, True, False, 60, False),
    ("optim_grads", 2, True, False, 60, True),
    ("optim_grads", 2, False, True, 60, False),
    ("optim_grads_params", 2, True, False, 60, True),
    ("optim_grads_params", 4, True, True, None, False),
]
CASES_2 = [
    ("no_shard", 2, True, False, 60, True),
    ("optim", 2, True, True, 60, False),
    ("optim", 1, False, False, None, False),
    ("optim_grads", 2, True, False, 60, False),
    ("optim_grads_params", 2, True, False, 60, True),
]


@pytest.mark.parametrize("world,cases", [(4, CASES_4), (2, CASES_2)], ids=["dp4", "dp2"])
def test_expert_grads_reduced_over_expert_group(world, cases):
    """Would catch expert gradients all-reduced over the whole data-parallel group (other positions' experts
    summed in), megatron-core's expert scaling got wrong (edp/dp with average_in_collective, 1/dp without),
    expert buckets sharded by data-parallel rank instead of expert-group rank, and dense gradients disturbed
    by the split into two kinds of buffers -- on every sharding strategy, with and without overlap."""
    for per_rank in run_distributed(_grads_worker, world, cases):
        for strategy, ep, overlap, average, ok, diff in per_rank:
            assert ok, f"{strategy} ep={ep} overlap={overlap} average={average}: max diff {diff:.3e}"


# ------------------------------------------------------------------------------------------ optimizer steps
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 0.05


def reference_training(models, dp, ep, steps):
    """torch's AdamW + clip_grad_norm_ over every element once (the dense parameters of models[0], every
    position's experts); returns the per-step (norm, zero count)."""
    dense = [p for p in models[0].parameters() if getattr(p, "allreduce", True)]
    experts = [p for m in models for p in m.parameters() if not getattr(p, "allreduce", True)]
    params = dense + experts
    names = {p: n for m in models for n, p in m.named_parameters()}
    decay = [p for p in params if not (names[p].endswith(".bias") or p.dim() == 1)]
    no_decay = [p for p in params if names[p].endswith(".bias") or p.dim() == 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR, foreach=True)
    stats = []
    for step in range(steps):
        for m in models[1:]:  # the dense part is one set of parameters
            with torch.no_grad():
                for (n, p), q in zip(m.named_parameters(), models[0].parameters()):
                    if getattr(p, "allreduce", True):
                        p.copy_(q)
        refs = reference_grads(models, batches_for(dp, step), ep)
        for k, m in enumerate(models):
            for n, p in m.named_parameters():
                p.grad = refs[k][n].clone()
        zeros = sum(int((p.grad == 0).sum()) for p in params)
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True).item()
        optimizer.step()
        stats.append((norm, zeros))
    for m in models[1:]:
        with torch.no_grad():
            for p, q in zip(m.parameters(), models[0].parameters()):
                if getattr(p, "allreduce", True):
                    p.copy_(q)
    return stats


def _steps_worker(cases, steps=3):
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, OptimizerConfig, get_megatron_optimizer

    rank, dp = dist.get_rank(), dist.get_world_size()
    results = []
    for strategy, ep in cases:
        models = [make_moe(k) for k in range(ep)]
        ddp = DistributedDataParallel(make_moe(rank % ep), ddp_config(strategy, overlap_grad_reduce=True,
                                                                      bucket_size=60),
                                      expert_data_parallel_group=expert_group(ep))
        opt = get_megatron_optimizer(OptimizerConfig(
            lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP, log_num_zeros_in_grad=True,
            use_distributed_optimizer=strategy != "no_shard"), ddp)
        stats = []
        for step in range(steps):
            opt.zero_grad()
            train_step(ddp, batches_for(dp, step)[rank])
            ok, norm, zeros = opt.step()
            assert ok
            stats.append((norm, zeros))
        expected_stats = reference_training(models, dp, ep, steps)
        ddp.finish_param_sync()
        with ddp.full_parameters():
            params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        reference = dict(models[rank % ep].named_parameters())
        worst = max((params[n] - reference[n]).abs().max().item() for n in params)
        close = all(torch.allclose(params[n], reference[n].detach(), rtol=1e-5, atol=1e-6) for n in params)
        results.append((strategy, ep, close, worst, stats, expected_stats))
    return results


@pytest.mark.parametrize("world,cases", [
    (4, [("no_shard", 2), ("optim", 2), ("optim_grads", 2), ("optim_grads_params", 2), ("no_shard", 4),
         ("optim", 1)]),
    (2, [("no_shard", 2), ("optim_grads", 2)]),
], ids=["dp4", "dp2"])
def test_expert_training_matches_reference_with_clipping(world, cases):
    """Would catch a grad norm that counts expert elements once per replica (or only this position's
    experts), or dense elements once per rank; a zero count doing the same; clipping with a rank-dependent
    coefficient; and the optimizer stepping expert shards laid out by data-parallel rank -- three AdamW steps
    with clipping active, every strategy, against torch on every element once."""
    for per_rank in run_distributed(_steps_worker, world, cases):
        for strategy, ep, close, worst, stats, expected in per_rank:
            assert close, f"{strategy} ep={ep}: parameters differ from the reference by up to {worst:.3e}"
            for (norm, zeros), (ref_norm, ref_zeros) in zip(stats, expected):
                assert ref_norm > CLIP  # clipping active
                assert norm == pytest.approx(ref_norm, rel=1e-5), f"{strategy} ep={ep}"
                assert zeros == ref_zeros, f"{strategy} ep={ep}: {zeros} zeros, reference {ref_zeros}"


# ------------------------------------------------------------------------------------------ misuse
def _misuse_worker(scenario):
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel

    rank = dist.get_rank()
    model, group, config = make_moe(rank % 2), expert_group(2), ddp_config("no_shard")
    if scenario == "no_group":
        group = None
    elif scenario == "marked_on_one_rank":  # the others hold the same parameters unmarked
        group = None
        for p in model.parameters():
            if rank != 1:
                p.allreduce = True
    elif scenario == "group_on_some_ranks":
        group = group if rank % 2 == 0 else None
    elif scenario == "uneven_groups":
        uneven = [dist.new_group([0, 1, 2]), dist.new_group([3])]
        group = uneven[0] if rank < 3 else uneven[1]
    elif scenario == "instances":
        config = ddp_config("optim", num_distributed_optimizer_instances=2)
    elif scenario == "experts_differ_within_group":  # rank 3 names its experts differently from rank 1
        model = make_moe(rank % 2, global_names=rank == 3)
    try:
        DistributedDataParallel(model, config, expert_data_parallel_group=group)
    except (ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("scenario,expected", [pytest.param(scenario, expected, id=scenario) for scenario, expected in [
    ("no_group", "pass DistributedDataParallel(..., expert_data_parallel_group="),
    ("marked_on_one_rank", "rank 1: blocks.0.experts.0.fc_in.weight"),
    ("group_on_some_ranks", "is None on rank(s) [1, 3]"),
    ("uneven_groups", "disjoint groups of one size"),
    ("instances", "num_distributed_optimizer_instances > 1 is not supported with expert parameters"),
    ("experts_differ_within_group", "blocks.0.experts.2.fc_in.weight"),
]])
def test_expert_misuse_raises_on_every_rank(scenario, expected):
    """Would catch marked parameters silently all-reduced over the data-parallel group when no expert group
    is given (the issue this feature fixes), groups that cannot be reduced over consistently, and a wrap-time
    error raised on some ranks only (the others would walk into a collective and hang)."""
    outcomes = run_distributed(_misuse_worker, 4, scenario)
    assert all(outcome is not None for outcome in outcomes), outcomes
    assert any(expected in message for _, message in outcomes), outcomes
    if scenario != "experts_differ_within_group":  # the same verdict everywhere
        assert all(name == "ValueError" and expected in message for name, message in outcomes), outcomes


# ------------------------------------------------------------------------------------------ checkpoints
def _checkpoint_worker(root, save_strategy, load_strategy, ep=2):
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, OptimizerConfig, checkpointing, get_megatron_optimizer
    from megatron_lite.checkpointing.last_words import LastWords
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank, dp = dist.get_rank(), dist.get_world_size()

    def build(strategy, seed):
        ddp = DistributedDataParallel(make_moe(rank % ep, seed=seed),
                                      ddp_config(strategy, overlap_grad_reduce=True, bucket_size=60),
                                      expert_data_parallel_group=expert_group(ep))
        opt = get_megatron_optimizer(OptimizerConfig(lr=None, weight_decay=WEIGHT_DECAY, clip_grad=CLIP,
                                                     use_distributed_optimizer=strategy != "no_shard"), ddp)
        return ddp, opt, OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")

    def step(ddp, opt, sched, k):
        opt.zero_grad()
        train_step(ddp, batches_for(dp, k)[rank])
        assert opt.step()[0]
        sched.step(1)

    def params(ddp):
        ddp.finish_param_sync()
        with ddp.full_parameters():
            return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}

    ddp, opt, sched = build(save_strategy, seed=0)
    for k in range(2):
        step(ddp, opt, sched, k)
    checkpointing.save_checkpoint(root, 2, ddp, opt, sched, consumed_train_samples=2 * dp)
    saved = params(ddp)
    step(ddp, opt, sched, 2)
    continued = params(ddp)
    errors = []
    for attempt in (lambda: checkpointing.save_checkpoint(root, 3, ddp, opt, sched, 3 * dp, ckpt_format="torch_dist"),
                    lambda: LastWords(root, opt, sched, 3, 3 * dp)):
        try:
            attempt()
        except ValueError as e:
            errors.append(str(e))

    ddp, opt, sched = build(load_strategy, seed=1)  # other weights everywhere: all must come from the file
    loaded = checkpointing.load_checkpoint(root, ddp, opt, sched)
    restored = params(ddp)
    step(ddp, opt, sched, 2)
    resumed = params(ddp)
    exact = save_strategy == load_strategy
    return dict(iteration=loaded["iteration"], errors=errors,
                restored=all(torch.equal(restored[n], saved[n]) for n in saved),
                resumed=all(torch.equal(resumed[n], continued[n]) if exact else
                            torch.allclose(resumed[n], continued[n], rtol=1e-5, atol=1e-7) for n in continued))


@pytest.mark.parametrize("save_strategy,load_strategy", [
    ("no_shard", "no_shard"), ("optim", "optim"), ("optim_grads_params", "optim_grads_params"),
    ("optim_grads", "no_shard"),
])
def test_expert_checkpoint_round_trip(tmp_path, save_strategy, load_strategy):
    """Would catch a torch-format checkpoint that keeps only rank 0's experts (ranks of the other expert-
    parallel position would resume with them, or with their own fresh weights), loses their optimizer state
    (the resumed step would differ), and torch_dist saves or last words that silently mix positions up
    instead of refusing."""
    for result in run_distributed(_checkpoint_worker, 4, str(tmp_path), save_strategy, load_strategy):
        assert result["iteration"] == 2
        assert result["restored"] and result["resumed"], result
        assert len(result["errors"]) == 2 and all("expert parameters" in e for e in result["errors"]), result


# ------------------------------------------------------------------------------------------ the rest of the protocol
def _protocol_worker(strategy):
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, OptimizerConfig, get_megatron_optimizer

    rank, dp = dist.get_rank(), dist.get_world_size()
    out = {}
    # broadcast_params: dense parameters from rank 0, experts from rank 0 of each expert group.
    ddp = DistributedDataParallel(make_moe(rank % 2, seed=rank), ddp_config(strategy, overlap_grad_reduce=True),
                                  expert_data_parallel_group=expert_group(2))
    ddp.broadcast_params()
    with ddp.full_parameters():
        out["broadcast"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    out["source"] = {n: p.detach() for n, p in make_moe(rank % 2, seed=rank % 2).named_parameters()}

    # An overflow in one rank's expert gradients skips the step on every rank.
    ddp = DistributedDataParallel(make_moe(rank % 2), ddp_config(strategy, overlap_grad_reduce=True),
                                  expert_data_parallel_group=expert_group(2))
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, bf16=True, loss_scale=1.0,
                                                 use_distributed_optimizer=strategy != "no_shard"), ddp)
    train_step(ddp, batches_for(dp)[rank])
    if rank == 3:
        bucket = ddp.expert_parallel_buffers[0].buckets[0]
        (bucket.reduced_grad_shard if ddp.ddp_config.use_distributed_optimizer else bucket.grad_data)[0] = float("inf")
    out["overflow_step"] = opt.step()[0]

    # find_unused_parameters: position 1's experts of block 1 sit out; no rank of their expert group got a
    # gradient, so the optimizer leaves them alone (weight decay included), whatever position 0 did.
    model = make_moe(rank % 2)
    model.blocks[1].use_experts = rank % 2 == 0
    ddp = DistributedDataParallel(model, ddp_config(strategy, overlap_grad_reduce=True, find_unused_parameters=True),
                                  expert_data_parallel_group=expert_group(2))
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY,
                                                 use_distributed_optimizer=strategy != "no_shard"), ddp)
    with ddp.full_parameters():
        before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    opt.zero_grad()
    train_step(ddp, batches_for(dp)[rank])
    opt.step()
    ddp.finish_param_sync()
    with ddp.full_parameters():
        out["unchanged"] = sorted(n for n, p in ddp.module.named_parameters() if torch.equal(p, before[n]))
    return out


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads"])
def test_expert_broadcast_overflow_and_unused(strategy):
    """Would catch broadcast_params copying rank 0's experts onto the other expert-parallel position, an
    overflow in one position's expert gradients skipping the step on some ranks only (divergence), and
    find_unused_parameters agreeing on expert parameters over the data-parallel group (a parameter unused
    by its own expert group would be stepped because the other position used its namesake)."""
    results = run_distributed(_protocol_worker, 4, strategy)
    for rank, result in enumerate(results):
        source = results[rank % 2]["source"]
        dense_source = results[0]["source"]
        for n, p in result["broadcast"].items():
            expected = source[n] if ".experts." in n else dense_source[n]
            assert torch.equal(p, expected), f"rank {rank}: {n} not broadcast from its group's rank 0"
        assert result["overflow_step"] is False
        sat_out = sorted(n for n in result["broadcast"] if n.startswith("blocks.1.experts."))
        assert result["unchanged"] == (sat_out if rank % 2 else []), f"rank {rank}: {result['unchanged']}"
