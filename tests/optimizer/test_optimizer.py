"""Optimizer stack vs torch.optim.AdamW on the global batch; sharding invariants; fp16 overflow; errors.

Tolerances: fp32 params within 1e-6 relative of the reference after 5 AdamW steps (the non-sharded
optimizer is bit-exact at dp=2: same gradients, torch's norm formula, torch's AdamW kernel; the sharded one
sums squares per shard, so its norm, and with clipping the update, differ in the last bits). bf16 params
with fp32 main params: main params within 1e-5 relative of an fp32-master reference that runs its forward
and backward in bf16, model params within one bf16 rounding (2^-8 relative) of that master.
"""

import itertools

import pytest
import torch
from distributed_helper import run_distributed

LR, WD, CLIP, STEPS = 1e-2, 0.1, 0.05, 5


def _configs():
    for distopt, overlap, bucket_size in itertools.product([False, True], [False, True], [1, 100, None]):
        for gather in ([False, True] if distopt else [False]):
            for strategy in (["optim", "optim_grads", "optim_grads_params"] if distopt else ["no_shard"]):
                if strategy == "optim_grads_params" and not overlap:
                    continue  # ZeRO-3 needs overlap_grad_reduce
                extra = dict(fsdp_unit_modules=("Linear", "LayerNorm")) if strategy == "optim_grads_params" else {}
                yield dict(use_distributed_optimizer=distopt, overlap_grad_reduce=overlap,
                           overlap_param_gather=gather, bucket_size=bucket_size,
                           data_parallel_sharding_strategy=strategy, **extra)


def _equivalence_worker(dtype_name):
    import torch.distributed as dist
    from optim_testing import build, megatron_steps, reference_steps

    rank, dp = dist.get_rank(), dist.get_world_size()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    master, _, ref_norms = reference_steps(dp, STEPS, LR, WD, CLIP, dtype=dtype)
    failures, worst = [], 0.0
    for cfg in _configs():
        model, ddp, opt = build(
            dict(cfg, grad_reduce_in_fp32=dtype != torch.float32),
            dict(lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=cfg["use_distributed_optimizer"],
                 bf16=dtype == torch.bfloat16, params_dtype=dtype),
            dtype=dtype,
        )
        results = megatron_steps(ddp, opt, rank, dp, STEPS, dtype=dtype)
        ddp.finish_param_sync()
        with ddp.full_parameters():  # ZeRO-3: outside forward/backward each rank holds only shards
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert all(ok for ok, _ in results)
        norms = [n for _, n in results]
        assert all(n > CLIP for n in ref_norms), "clipping must be active in this test"
        exact = dtype == torch.float32 and not cfg["use_distributed_optimizer"] and dp == 2
        if exact and norms != ref_norms:
            failures.append((cfg, "grad norms not bit-exact", norms, ref_norms))
        elif not all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, ref_norms)):
            failures.append((cfg, "grad norms differ", norms, ref_norms))
        for (name, p), q in zip(params.items(), master.parameters()):
            if dtype == torch.float32:
                if exact and not torch.equal(p.detach(), q.detach()):
                    failures.append((cfg, name, "not bit-exact"))
                rel = ((p.detach() - q.detach()).abs().max() / q.detach().abs().max()).item()
                worst = max(worst, rel)
                if rel > 1e-6:
                    failures.append((cfg, name, rel))
            else:
                low = q.detach().to(dtype).float()
                if not torch.allclose(p.detach().float(), low, rtol=2**-8, atol=1e-6):
                    failures.append((cfg, name, "bf16 param"))
        if dtype != torch.float32:
            state = opt.state_dict()["state"]  # full fp32 main params, also for the sharded optimizer
            for name, q in master.named_parameters():
                main = state[name]["param"]
                if not torch.allclose(main, q.detach(), rtol=1e-5, atol=1e-7):
                    failures.append((cfg, name, "main param", (main - q.detach()).abs().max().item()))
    assert not failures, failures[:5]
    return worst


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_adamw_matches_single_process_reference(dp, dtype_name):
    """Would catch a wrong shard mapping, a missing all-gather or stale gathered weights, a global norm
    summed wrongly (per rank, or twice), clipping with the wrong coefficient, weight decay on biases,
    and bf16 main params not carrying fp32 precision."""
    worst = run_distributed(_equivalence_worker, dp, dtype_name)
    assert all(w <= 1e-6 for w in worst)


def _shard_worker(bucket_size):
    import torch.distributed as dist
    from optim_testing import build

    from megatron_lite.distributed.param_and_grad_buffer import shard_ranges

    model, ddp, opt = build(dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=bucket_size),
                            dict(lr=LR, use_distributed_optimizer=True))
    ranges = [(ddp.param_to_name[s.model_param], s.param_start, s.param_end) for s in shard_ranges([ddp])]
    state_numel = sum(p.numel() for g in opt.param_groups for p in g["params"])
    total = sum(p.numel() for p in model.parameters())
    padded = sum(b.numel for b in ddp.param_and_grad_buffers)
    return dict(ranges=ranges, state_numel=state_numel, total=total, padded=padded,
                rank=dist.get_rank(), dp=dist.get_world_size())


@pytest.mark.parametrize("dp", [2, 4])
def test_shards_cover_every_element_once_and_state_is_one_over_dp(dp):
    """Would catch overlapping or missing shards (elements stepped twice or never) and unsharded state."""
    for bucket_size in (1, 100, None):
        results = run_distributed(_shard_worker, dp, bucket_size)
        names = {name: 0 for r in results for name, _, _ in r["ranges"]}
        covered = {}
        for r in results:
            for name, lo, hi in r["ranges"]:
                covered.setdefault(name, []).extend(range(lo, hi))
        total = results[0]["total"]
        assert sum(len(v) for v in covered.values()) == total
        for name, elements in covered.items():
            assert sorted(elements) == list(range(len(elements))), name  # each element exactly once
        assert len(names) == 8
        for r in results:
            # Each rank's main params are at most its 1/dp share of the padded buffer.
            assert r["state_numel"] <= r["padded"] // dp
        assert sum(r["state_numel"] for r in results) == total


def _overflow_worker(strategy):
    import torch.distributed as dist
    from ddp_testing import loss_fn, make_batches
    from optim_testing import build

    from megatron_lite.distributed.param_and_grad_buffer import shard_ranges

    rank, dp = dist.get_rank(), dist.get_world_size()
    distopt = strategy != "no_shard"
    model, ddp, opt = build(
        dict(data_parallel_sharding_strategy=strategy, grad_reduce_in_fp32=True,
             overlap_grad_reduce=strategy == "optim_grads_params",
             fsdp_unit_modules=("Linear",) if strategy == "optim_grads_params" else None),
        dict(lr=LR, fp16=True, params_dtype=torch.float16, use_distributed_optimizer=distopt,
             initial_loss_scale=2.0**8, min_loss_scale=2.0**6, hysteresis=2, loss_scale_window=2),
        dtype=torch.float16,
    )

    def params():
        with ddp.full_parameters():
            return [p.detach().clone() for p in model.parameters()]

    log = []
    x, y = make_batches(dp, 1, dtype=torch.float16)[rank][0]
    for step in range(8):
        before = params()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        opt.scale_loss(loss_fn(ddp, x, y)).backward()
        ddp.finish_grad_sync()
        if step in (1, 2, 3, 4) and rank == dp - 1:
            # Overflow on the last rank only, after the reduction, in a gradient it owns.
            with torch.no_grad():
                if distopt:
                    shard_ranges([ddp])[0].grad[0] = float("inf")
                else:
                    ddp.param_and_grad_buffers[0].grad_data[0] = float("inf")
        scale = opt.get_loss_scale().item()
        ok, norm, _ = opt.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, params()))
        log.append((ok, norm is None, unchanged, scale))
    return log


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_fp16_overflow_on_one_rank_skips_everywhere(strategy):
    """Would catch ranks taking different skip decisions (divergent params / collective mismatch), an
    update applied despite inf, and loss-scale arithmetic off by a step."""
    logs = run_distributed(_overflow_worker, 2, strategy)
    assert logs[0] == logs[1]
    oks = [entry[0] for entry in logs[0]]
    assert oks == [True, False, False, False, False, True, True, True]
    for ok, norm_none, unchanged, _ in logs[0]:
        assert norm_none == (not ok) and unchanged == (not ok)
    scales = [entry[3] for entry in logs[0]]
    # 2^8, clean; overflow #1 (hysteresis 2 -> 1, keep); #2 halves -> 2^7; #3 -> 2^6; #4 stays at the
    # floor 2^6; then two clean steps double it (window 2) -> 2^7.
    assert scales == [2.0**8, 2.0**8, 2.0**8, 2.0**7, 2.0**6, 2.0**6, 2.0**6, 2.0**7]


class Scrambled(torch.nn.Module):
    """Registration order (head, fc2, fc1) differs from forward order (fc1, fc2, head)."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 3)
        self.fc2 = torch.nn.Linear(16, 16)
        self.fc1 = torch.nn.Linear(8, 16)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _gather_order_worker():
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    rank, dp = dist.get_rank(), dist.get_world_size()
    params, saved = [], []
    for gather in (False, True):
        torch.manual_seed(0)
        model, ddp, opt = build(
            dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=gather, bucket_size=40),
            dict(lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=True), model=Scrambled(),
        )
        megatron_steps(ddp, opt, rank, dp, 4)
        pending = ddp.param_sync.pending
        saved.append((pending, {k: v.clone() for k, v in ddp.state_dict().items()}))  # must force the gathers
        params.append([p.detach().clone() for p in model.parameters()])
    (pending_off, state_off), (pending_on, state_on) = saved
    assert not pending_off and pending_on
    same_state = all(torch.equal(state_off[k], state_on[k]) for k in state_off)
    return all(torch.equal(a, b) for a, b in zip(*params)) and same_state


def test_overlap_param_gather_is_never_stale_when_forward_order_differs():
    """Would catch a forward pre-hook that dispatches/waits the wrong bucket (stale weights in forward) or
    a checkpoint saved before the deferred gathers landed: results must equal the non-overlapped run."""
    assert run_distributed(_gather_order_worker, 2) == [True, True]


def _sgd_and_zeros_worker():
    import torch.distributed as dist
    from optim_testing import build, megatron_steps, reference_steps

    rank, dp = dist.get_rank(), dist.get_world_size()
    master, _, ref_norms = reference_steps(dp, 3, LR, WD, CLIP, kind="sgd")
    out = []
    for distopt in (False, True):
        torch.manual_seed(0)
        model, ddp, opt = build(dict(use_distributed_optimizer=distopt, overlap_grad_reduce=True, bucket_size=100),
                                dict(optimizer="sgd", lr=LR, weight_decay=WD, clip_grad=CLIP,
                                     use_distributed_optimizer=distopt, log_num_zeros_in_grad=True))
        norms = [n for _, n in megatron_steps(ddp, opt, rank, dp, 3)]
        rel = max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(model.parameters(), master.parameters()))
        # A known number of zero gradients: zero a slice of every main_grad after the reduction.
        ddp.zero_grad_buffer()
        opt.zero_grad()
        from ddp_testing import loss_fn, make_batches

        x, y = make_batches(dp, 1)[rank][0]
        loss_fn(ddp, x, y).backward()
        ddp.finish_grad_sync()
        for p in model.parameters():
            p.main_grad.view(-1)[:2] = 0.0
        _, _, zeros = opt.step()
        out.append((rel, max(abs(a - b) / b for a, b in zip(norms, ref_norms)), zeros))
    return out


def test_sgd_matches_torch_and_zero_counting():
    """SGD with momentum through both paths vs torch.optim.SGD; num_zeros_in_grad counts every rank's
    shard exactly once (8 parameters x 2 zeroed elements)."""
    for per_rank in run_distributed(_sgd_and_zeros_worker, 2):
        for rel, norm_rel, zeros in per_rank:
            assert rel <= 1e-6 and norm_rel <= 1e-6
            assert zeros == 16


def _lr_worker():
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    rank, dp = dist.get_rank(), dist.get_world_size()
    out = []
    for distopt in (False, True):
        model, ddp, opt = build(dict(use_distributed_optimizer=distopt), dict(lr=LR, use_distributed_optimizer=distopt))
        for group in opt.param_groups:
            group["lr"] = 0.0  # what a scheduler does
        before = [p.detach().clone() for p in model.parameters()]
        megatron_steps(ddp, opt, rank, dp, 1)
        out.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
        assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]  # biases / 1-D: no decay
    return out


def test_param_groups_drive_the_update():
    assert run_distributed(_lr_worker, 2) == [[True, True]] * 2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(lr="0.1"), "lr"),
        (dict(lr=-1.0), "lr"),
        (dict(lr=1.0, optimizer="lamb"), "optimizer"),
        (dict(lr=1.0, min_lr=2.0), "min_lr"),
        (dict(lr=1.0, adam_beta2=1.0), "adam_beta2"),
        (dict(lr=1.0, fp16=True, bf16=True, params_dtype=torch.float16), "mutually exclusive"),
        (dict(lr=1.0, bf16=True, params_dtype=torch.float16), "params_dtype"),
        (dict(lr=float("nan")), "lr"),
        (dict(lr=1.0, weight_decay=float("inf")), "weight_decay"),
        (dict(lr=1.0, loss_scale=128.0), "loss_scale"),
        (dict(lr=1.0, fp16=True, params_dtype=torch.float16, hysteresis=0), "hysteresis"),
        (dict(lr=1.0, clip_grad=-1.0), "clip_grad"),
        (dict(lr=1.0, fp16=True, params_dtype=torch.float16, min_loss_scale=8.0, initial_loss_scale=4.0),
         "min_loss_scale"),
    ],
)
def test_optimizer_config_validation(kwargs, field):
    from megatron_lite import OptimizerConfig

    with pytest.raises(ValueError, match=field):
        OptimizerConfig(**kwargs)


def test_get_megatron_optimizer_rejects_inconsistent_setups(single_rank_group):
    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    ddp = DistributedDataParallel(torch.nn.Linear(2, 2), DistributedDataParallelConfig())
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0, use_distributed_optimizer=True), ddp)
    with pytest.raises(ValueError, match="fp16=True"):
        fp16 = DistributedDataParallel(torch.nn.Linear(2, 2).half(), DistributedDataParallelConfig())
        get_megatron_optimizer(OptimizerConfig(lr=1.0, bf16=True), fp16)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0), torch.nn.Linear(2, 2))


class MixedNet(torch.nn.Module):
    """bf16 Linears around an fp32 LayerNorm: a model with two parameter dtypes (two DDP buffers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 16).bfloat16()
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 3).bfloat16()

    def forward(self, x):
        h = torch.tanh(self.fc1(x.bfloat16()))
        return self.head(self.norm(h.float()).bfloat16())


def _mixed_dtype_worker():
    import copy

    import torch.distributed as dist
    from ddp_testing import reference_grads
    from optim_testing import STEP_SEED, make_batches, megatron_steps

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    rank, dp = dist.get_rank(), dist.get_world_size()
    master = copy.deepcopy(MixedNet()).float()
    decay = [p for n, p in master.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in master.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    reference = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2, foreach=True)
    for k in range(3):
        low = copy.deepcopy(master)
        low.fc1.bfloat16(), low.head.bfloat16()
        grads = reference_grads(low, make_batches(dp, 2, seed=STEP_SEED + k), torch.float32, False)
        for n, p in master.named_parameters():
            p.grad = grads[n].float()
        reference.step()
    results = {}
    for name, distributed, loss_scale in [("bf16", False, None), ("bf16 distributed", True, None),
                                          ("bf16 distributed, loss scale 1024", True, 1024.0)]:
        model = MixedNet()
        ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=40, use_distributed_optimizer=distributed))
        opt = get_megatron_optimizer(OptimizerConfig(  # no params_dtype: derived from bf16=True
            lr=1e-2, bf16=True, clip_grad=0.0, loss_scale=loss_scale, use_distributed_optimizer=distributed), [ddp])
        assert all(ok for ok, _ in megatron_steps(ddp, opt, rank, dp, 3))
        ddp.finish_param_sync()
        results[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert model.norm.weight.dtype == torch.float32 and model.fc1.weight.dtype == torch.bfloat16
    failures = []
    for name, params in results.items():
        for (n, p), q in zip(params.items(), master.parameters()):
            close = (torch.allclose(p, q, rtol=1e-5, atol=1e-7) if p.dtype == torch.float32 else
                     torch.allclose(p.float(), q.detach().bfloat16().float(), rtol=2**-8, atol=1e-6))
            if not close:
                failures.append((name, n))
    scaled_is_exact = all(torch.equal(results["bf16 distributed"][n], results["bf16 distributed, loss scale 1024"][n])
                          for n in results["bf16 distributed"])
    return failures, scaled_is_exact


def test_mixed_param_dtypes_bf16_without_params_dtype_and_constant_loss_scale_with_bf16():
    """fp32 norm weights in a bf16 model, with the fp16/bf16 and the distributed optimizer, OptimizerConfig
    (bf16=True) without params_dtype, and a constant loss scale with bf16 (as megatron-core allows). Would
    catch a refused setup, fp32 params not stepped (or stepped through a lossy copy), or a loss scale that is
    not undone exactly (a power of two must give bit-identical updates)."""
    for failures, scaled_is_exact in run_distributed(_mixed_dtype_worker, 2):
        assert not failures and scaled_is_exact, failures
