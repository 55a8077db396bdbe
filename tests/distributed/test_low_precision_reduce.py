"""Lower-precision gradient reduction (megatron-core's two modes), against exact arithmetic and an fp32 reference.

* `param_name_patterns_for_fp32_local_accumulation`: matched parameters accumulate their micro-batch
  gradients in an fp32 main_grad of their own; the bucket still communicates in bf16 (rounded once, at launch)
  and the reduced value is copied back into main_grad.
* `reduce_scatter_with_fp32_accumulation`: the reduce-scatter sends bf16 (an all-to-all) and sums the
  received copies in fp32, in rank order, rounding once.

The probe model's gradient is a chosen bf16 tensor (loss = sum(w * t)), so every rank can replay the exact
arithmetic each mode performs. With S = sum over ranks and micro-batches of |t| / dp (per element) and
u = 2^-8 (bf16's unit roundoff), the documented error bounds against the exact mean are (docs/performance.md):

    grad_reduce_in_fp32                                   |err| <= 2^-20 S
    both modes                                            |err| <= 2.01 u S   (one rounding per rank, one at the end)
    fp32 local accumulation only                          |err| <= 1.01 dp u S  (1 + (dp - 1) bf16 additions)
    reduce-scatter with fp32 accumulation only            |err| <= 1.01 M u S   (M - 1 bf16 accumulations + 1)
    bf16 (neither)                                        |err| <= 1.01 (M + dp - 2) u S

(first-order bounds of recursive summation; 1% covers the second-order terms). The exact tests are bit-exact
on 2 and 4 ranks wherever megatron-lite fixes the order of the additions; gloo's own bf16 all-reduce order is
not ours, so the mode without the fp32 reduce-scatter is checked bit-exactly on 2 ranks only (one addition).
"""

import pytest
import torch
import torch.nn as nn
from distributed_helper import run_distributed

SIZES = (37, 64, 5, 90, 23)  # ragged: buckets and shards cut through parameters
U = 2.0 ** -8


class Leaf(nn.Module):
    def __init__(self, numel):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def forward(self, target):
        return (self.weight.float() * target).sum()  # d loss / d weight = target, exactly when bf16-representable


class Probe(nn.Module):
    """A model whose gradient is whatever it is given (a ModuleList, so ZeRO-3 finds one unit per leaf)."""

    def __init__(self, sizes=SIZES, dtype=torch.bfloat16):
        super().__init__()
        self.layers = nn.ModuleList(Leaf(n) for n in sizes)
        self.to(dtype)

    def forward(self, targets):
        return sum(layer(t) for layer, t in zip(self.layers, targets))


def make_targets(dp, micro_batches, sizes=SIZES, seed=0, spread=6):
    """targets[r][m][i]: rank r's micro-batch m gradient of leaf i, bf16 values (held in fp32) of magnitudes
    2^-spread .. 2^spread, so that bf16 sums round."""
    g = torch.Generator().manual_seed(seed)

    def one(n):
        scale = 2.0 ** torch.randint(-spread, spread + 1, (n,), generator=g).float()
        return (torch.randn(n, generator=g) * scale).bfloat16().float()
    return [[[one(n) for n in sizes] for _ in range(micro_batches)] for _ in range(dp)]


def expected_grads(targets, promoted, fp32_reduce_scatter):
    """Per leaf: the reduced bf16 gradient, replaying each step in the order megatron-lite performs it."""
    dp = len(targets)
    out = []
    for i in range(len(targets[0][0])):
        scaled = []
        for rank_targets in targets:
            if i in promoted:  # fp32 main_grad, rounded once when the bucket is launched
                acc = torch.zeros_like(rank_targets[0][i])
                for mb in rank_targets:
                    acc += mb[i]
                local = acc.bfloat16()
            else:  # bf16 main_grad: main_grad.add_(grad) rounds on every micro-batch
                local = torch.zeros_like(rank_targets[0][i], dtype=torch.bfloat16)
                for mb in rank_targets:
                    local += mb[i].bfloat16()
            scaled.append(local * (1.0 / dp))  # the pre-scale, in bf16 (exact: dp is a power of two)
        if fp32_reduce_scatter:
            total = torch.zeros_like(scaled[0], dtype=torch.float32)
            for s in scaled:  # rank order
                total += s
            out.append(total.bfloat16())
        else:
            assert dp == 2, "gloo's bf16 summation order is only known for one addition"
            out.append(scaled[0] + scaled[1])
    return out


def run_iteration(ddp, targets, rank):
    """zero_grad_buffer, M backward passes (all but the last under no_sync), finish_grad_sync."""
    micro_batches = targets[rank]
    ddp.zero_grad_buffer()
    for m, mb in enumerate(micro_batches):
        if m < len(micro_batches) - 1:
            with ddp.no_sync():
                ddp(mb).backward()
        else:
            ddp(mb).backward()
    ddp.finish_grad_sync()


def reduced_pieces(ddp):
    """(leaf index, param, start, end, reduced grad values) of what this rank's optimizer reads: main_grad
    whole under no_shard, the rank's reduced shard of each parameter (sharded strategies)."""
    from megatron_lite.distributed.param_and_grad_buffer import shard_ranges

    index = {p: int(name.split(".")[1]) for p, name in ddp.param_to_name.items()}
    if not ddp.ddp_config.use_distributed_optimizer:
        return [(index[p], p, 0, p.numel(), p.main_grad.view(-1)) for p in ddp.param_to_name]
    return [(index[s.model_param], s.model_param, s.param_start, s.param_end, s.grad) for s in shard_ranges([ddp])]


CASES = [  # (DDP config, fp32 local accumulation patterns)
    (dict(data_parallel_sharding_strategy="no_shard"), ("layers.1.*", "layers.3.weight")),
    (dict(data_parallel_sharding_strategy="no_shard", overlap_grad_reduce=True, bucket_size=60), ("all",)),
    (dict(data_parallel_sharding_strategy="optim"), ("layers.1.*", "layers.3.weight")),
    (dict(data_parallel_sharding_strategy="optim", reduce_scatter_with_fp32_accumulation=True), ()),
    (dict(data_parallel_sharding_strategy="optim", reduce_scatter_with_fp32_accumulation=True), ("layers.[02]*",)),
    (dict(data_parallel_sharding_strategy="optim", reduce_scatter_with_fp32_accumulation=True,
          overlap_grad_reduce=True, bucket_size=60), ("all",)),
    (dict(data_parallel_sharding_strategy="optim_grads", overlap_grad_reduce=True, bucket_size=60), ("layers.4.*",)),
    (dict(data_parallel_sharding_strategy="optim_grads", reduce_scatter_with_fp32_accumulation=True,
          overlap_grad_reduce=True, bucket_size=60), ("layers.1.*",)),
    (dict(data_parallel_sharding_strategy="optim_grads_params", reduce_scatter_with_fp32_accumulation=True,
          overlap_grad_reduce=True), ("layers.0.*", "layers.3.*")),
    (dict(data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True), ("all",)),
]


def _exact_worker(dp_kwargs, patterns, iterations=2, micro_batches=3):
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank, dp = dist.get_rank(), dist.get_world_size()
    config = DistributedDataParallelConfig(param_name_patterns_for_fp32_local_accumulation=patterns, **dp_kwargs)
    ddp = DistributedDataParallel(Probe(), config)
    promoted = {i for i in range(len(SIZES)) if config.accumulates_in_fp32(f"layers.{i}.weight")}
    for p, name in ddp.param_to_name.items():  # fp32 exactly where a pattern matched
        assert p.main_grad.dtype == (torch.float32 if int(name.split(".")[1]) in promoted else torch.bfloat16), name
    mismatches = []
    for it in range(iterations):  # the second iteration launches from the hooks (overlap) on re-zeroed grads
        targets = make_targets(dp, micro_batches, seed=10 + it)
        run_iteration(ddp, targets, rank)
        want = expected_grads(targets, promoted, config.reduce_scatter_with_fp32_accumulation)
        for i, p, start, end, got in reduced_pieces(ddp):
            if not torch.equal(got.float(), want[i][start:end].float()):
                mismatches.append(f"iteration {it} leaf {i} [{start}:{end}]: max diff "
                                  f"{(got.float() - want[i][start:end].float()).abs().max().item():.3g}")
            if i in promoted and not torch.equal(p.main_grad.view(-1)[start:end], want[i][start:end].float()):
                mismatches.append(f"iteration {it} leaf {i}: fp32 main_grad is not the reduced value")
    return mismatches


@pytest.mark.parametrize("dp", [2, 4])
def test_reduced_gradients_are_bit_exact(dp):
    """Bit-exact against a replay of each mode's arithmetic, on every strategy, with and without overlap, two
    iterations of three micro-batches. Would catch: the fp32 main_grad not being what the hooks accumulate
    into (or not zeroed by zero_grad_buffer), the bucket slice not filled from it before the collective (or
    filled after the pre-scale), the reduced value not copied back (the optimizer would step on the local
    sum), the fp32 reduce-scatter summing in bf16 or in a backend-dependent order, or landing in the wrong
    shard, and ZeRO-2/3 freeing the bucket before the copy-back."""
    failures = {}
    for dp_kwargs, patterns in CASES:
        if dp == 4 and not dp_kwargs.get("reduce_scatter_with_fp32_accumulation"):
            continue  # gloo's bf16 all-reduce of 4 ranks adds in an order of its own: see the tolerance test
        for rank, mismatches in enumerate(run_distributed(_exact_worker, dp, dp_kwargs, patterns)):
            if mismatches:
                failures[f"{dp_kwargs} {patterns} rank {rank}"] = mismatches[:3]
    assert not failures, failures


# ------------------------------------------------------------------------------------------ error bounds
BIG_SIZES = (1000, 777, 2048)
MODES = {  # name -> (DDP config on 'optim', patterns); 'bound': the documented |err| / (u S), see the docstring
    "fp32": (dict(grad_reduce_in_fp32=True), ()),
    "bf16": ({}, ()),
    "fp32_local_accumulation": ({}, ("all",)),
    "reduce_scatter_fp32": (dict(reduce_scatter_with_fp32_accumulation=True), ()),
    "both": (dict(reduce_scatter_with_fp32_accumulation=True), ("all",)),
}


def error_bound(mode, dp, micro_batches):
    """The documented bound on |reduced - exact mean| in units of u S (module docstring)."""
    return {"fp32": 2.0 ** -20 / U, "both": 2.01, "fp32_local_accumulation": 1.01 * dp,
            "reduce_scatter_fp32": 1.01 * micro_batches, "bf16": 1.01 * (micro_batches + dp - 2)}[mode]


def _error_worker(mode, micro_batches):
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    rank, dp = dist.get_rank(), dist.get_world_size()
    dp_kwargs, patterns = MODES[mode]
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim",
                                           param_name_patterns_for_fp32_local_accumulation=patterns, **dp_kwargs)
    ddp = DistributedDataParallel(Probe(BIG_SIZES), config)
    targets = make_targets(dp, micro_batches, BIG_SIZES, seed=3)
    run_iteration(ddp, targets, rank)
    worst, err_sum, mag_sum = 0.0, 0.0, 0.0
    for i, _, start, end, got in reduced_pieces(ddp):
        per_rank = [sum(mb[i][start:end].double() for mb in rank_targets) for rank_targets in targets]
        exact = sum(per_rank) / dp
        magnitude = sum(sum(mb[i][start:end].double().abs() for mb in rank_targets) for rank_targets in targets) / dp
        err = (got.double() - exact).abs()
        worst = max(worst, (err / (U * magnitude)).max().item())
        err_sum, mag_sum = err_sum + err.sum().item(), mag_sum + magnitude.sum().item()
    return worst, err_sum, mag_sum


@pytest.mark.parametrize("dp", [2, 4])
def test_error_against_an_fp32_reduction_stays_within_the_documented_bounds(dp):
    """Each mode's reduced gradient vs the exact mean of the same bf16 micro-batch gradients (4 micro-batches,
    magnitudes over 12 binades), elementwise within the bounds of the module docstring, and the modes ordered
    as their arithmetic says (mean error relative to S): fp32 < both < either one alone < bf16, except that at
    dp=2 the fp32 reduce-scatter is one addition like bf16's (identical results). Would catch a mode that rounds
    more often than documented (e.g. the bucket slice filled from main_grad after every micro-batch, or the
    received copies summed in bf16), or one silently doing nothing (the ordering)."""
    micro_batches = 4
    mean_error, worst = {}, {}
    for mode in MODES:
        results = run_distributed(_error_worker, dp, mode, micro_batches)
        worst[mode] = max(r[0] for r in results) / error_bound(mode, dp, micro_batches)
        mean_error[mode] = sum(r[1] for r in results) / sum(r[2] for r in results)
    assert all(ratio <= 1.0 for ratio in worst.values()), worst
    # fp32 local accumulation pays off with micro-batches, the fp32 reduce-scatter from 3 ranks on (with 2 it
    # is one addition, the same arithmetic as bf16's: identical results).
    assert mean_error["fp32"] < mean_error["both"] < mean_error["reduce_scatter_fp32"], mean_error
    assert mean_error["fp32_local_accumulation"] < mean_error["bf16"], mean_error
    if dp == 2:
        assert mean_error["both"] == mean_error["fp32_local_accumulation"], mean_error
        assert mean_error["reduce_scatter_fp32"] == mean_error["bf16"], mean_error
    else:
        assert mean_error["both"] < mean_error["fp32_local_accumulation"], mean_error
        assert mean_error["reduce_scatter_fp32"] < mean_error["bf16"], mean_error


# ------------------------------------------------------------------------------------------ the collective
def _collective_worker(async_op):
    import torch.distributed as dist

    from megatron_lite.distributed import collectives

    rank, dp = dist.get_rank(), dist.get_world_size()
    shard = 6
    # Rank 0 holds 1, the others 2^-9: bf16 adding in turn stays at 1 (1 + 2^-9 rounds back to 1), an fp32
    # sum of 1 + 3 x 2^-9 rounds once, to 1 + 2^-7.
    bucket = torch.full((dp * shard,), 1.0 if rank == 0 else 2.0 ** -9, dtype=torch.bfloat16)
    bucket += torch.arange(dp * shard, dtype=torch.bfloat16) * 0  # same values, an ordinary (non-expanded) tensor
    before = bucket.clone()
    seen = []
    with collectives.observe(lambda name, tensor, size: seen.append((name, tensor.numel(), tensor.dtype, size))):
        handle = collectives.reduce_scatter_with_fp32_accumulation(bucket, async_op=async_op)
    handle.wait()
    handle.wait()  # a second wait changes nothing
    own = slice(rank * shard, (rank + 1) * shard)
    expected = torch.tensor(1.0 + (dp - 1) * 2.0 ** -9).bfloat16()
    others = torch.cat([bucket[:own.start], bucket[own.stop:]])
    return (torch.equal(bucket[own], expected.expand(shard)), torch.equal(others, torch.cat([before[:own.start],
            before[own.stop:]])), seen)


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dp", [2, 4])
def test_reduce_scatter_with_fp32_accumulation_sums_in_fp32_and_sends_bf16(async_op, dp):
    """On 4 ranks: the rank's shard is the fp32 sum rounded once (1 + 3 x 2^-9 -> 1 + 2^-7, where bf16 addition
    in turn gives 1), the other shards keep the rank's own values, and what is sent is one all-to-all of the
    bf16 bucket; on 2 ranks (gloo's two-broadcast path) the same, one reduce-scatter's bytes. Would catch a bf16
    accumulation, a result written to the wrong shard, a collective sending fp32 (twice the bytes), or an
    async handle that returns before the sum."""
    for own_ok, others_ok, seen in run_distributed(_collective_worker, dp, async_op):
        assert own_ok and others_ok
        assert seen == [("all_to_all" if dp > 2 else "reduce_scatter", 6 * dp, torch.bfloat16, dp)]


# ------------------------------------------------------------------------------------------ misuse
def test_config_refuses_what_megatron_core_refuses():
    """Would catch a combination megatron-core asserts against or ignores (fp32 patterns with fp32 grads,
    the fp32 reduce-scatter without a reduce-scatter, with AVG, with several optimizer instances or with fp32
    grads) being accepted silently, and a bare string taken as a sequence of one-letter patterns."""
    from megatron_lite import DistributedDataParallelConfig as Config

    rs = dict(reduce_scatter_with_fp32_accumulation=True)
    cases = [
        (dict(param_name_patterns_for_fp32_local_accumulation=("all",), grad_reduce_in_fp32=True),
         ("param_name_patterns_for_fp32_local_accumulation", "grad_reduce_in_fp32")),
        (dict(rs, grad_reduce_in_fp32=True, use_distributed_optimizer=True),
         ("reduce_scatter_with_fp32_accumulation", "grad_reduce_in_fp32")),
        (rs, ("reduce_scatter_with_fp32_accumulation", "data_parallel_sharding_strategy")),
        (dict(rs, use_distributed_optimizer=True, average_in_collective=True),
         ("reduce_scatter_with_fp32_accumulation", "average_in_collective")),
        (dict(rs, use_distributed_optimizer=True, num_distributed_optimizer_instances=2),
         ("reduce_scatter_with_fp32_accumulation", "num_distributed_optimizer_instances")),
    ]
    for kwargs, names in cases:
        with pytest.raises(ValueError) as error:
            Config(**kwargs)
        assert all(name in str(error.value) for name in names), (kwargs, str(error.value))
    with pytest.raises(TypeError, match="param_name_patterns_for_fp32_local_accumulation"):
        Config(param_name_patterns_for_fp32_local_accumulation="all")
    listed = Config(param_name_patterns_for_fp32_local_accumulation=["a.*"])
    assert listed.param_name_patterns_for_fp32_local_accumulation == ("a.*",)
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        Config(data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, **rs)


def _unmatched_pattern_worker():
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    config = DistributedDataParallelConfig(param_name_patterns_for_fp32_local_accumulation=("layers.1.*", "layer.*"))
    try:
        DistributedDataParallel(Probe(), config)
    except ValueError as error:
        return str(error)
    return None


def test_a_pattern_matching_no_parameter_raises_on_every_rank():
    """Would catch a typo in a pattern silently turning fp32 accumulation off (megatron-core matches nothing
    and says nothing), or the error raised on some ranks only (the others would hang in their next collective)."""
    for message in run_distributed(_unmatched_pattern_worker, 2):
        assert message is not None and "'layer.*'" in message and "layers.1.*" not in message.split("]")[0], message


def _overflow_worker():
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    config = DistributedDataParallelConfig(param_name_patterns_for_fp32_local_accumulation=("layers.2.*",),
                                           check_for_nan_in_grad=True)
    ddp = DistributedDataParallel(Probe(dtype=torch.float16), config)
    # Two micro-batches of 40000: finite in the fp32 main_grad, infinite once rounded into the fp16 bucket.
    targets = [[[torch.full((n,), 40000.0 if i == 2 and r == 0 else 0.0) for i, n in enumerate(SIZES)]
                for _ in range(2)] for r in range(dist.get_world_size())]
    try:
        run_iteration(ddp, targets, dist.get_rank())
    except RuntimeError as error:
        return str(error)
    return None


def test_nan_check_sees_what_is_sent_not_the_fp32_accumulation():
    """fp16 parameters, fp32 local accumulation of 2 x 40000 (fp16's largest is 65504). Would catch the NaN/Inf
    check reading the finite fp32 main_grad instead of the bucket slice that overflowed (an inf sent unnoticed)."""
    messages = run_distributed(_overflow_worker, 2)
    assert all(m is not None and "layers.2.weight" in m.split("finite")[0] for m in messages[:1]), messages
    assert all(m is not None and "rank(s) [0]" in m for m in messages), messages


def _step_worker(dp_kwargs, patterns):
    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    rank, dp = dist.get_rank(), dist.get_world_size()
    config = DistributedDataParallelConfig(param_name_patterns_for_fp32_local_accumulation=patterns, **dp_kwargs)
    ddp = DistributedDataParallel(Probe(), config)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0, bf16=True,
        params_dtype=torch.bfloat16, use_distributed_optimizer=config.use_distributed_optimizer), [ddp])
    promoted = {i for i in range(len(SIZES)) if config.accumulates_in_fp32(f"layers.{i}.weight")}
    targets = make_targets(dp, 3, seed=7)
    want = [w.float() * (1.0 / 3) for w in expected_grads(targets, promoted,
                                                         config.reduce_scatter_with_fp32_accumulation)]
    opt.zero_grad()
    run_iteration(ddp, targets, rank)
    ddp.scale_gradients(1.0 / 3)  # as the per-token loss does: megatron-core scales the fp32 main_grads too
    problems = [f"leaf {i}: fp32 main_grad not scaled in fp32" for i, p, start, end, _ in reduced_pieces(ddp)
                if i in promoted and not torch.equal(p.main_grad.view(-1)[start:end], want[i][start:end])]
    opt.step()
    ddp.finish_param_sync()
    with ddp.full_parameters():  # SGD from zero with lr 1: the parameters are minus the gradient, rounded
        problems += [f"leaf {i}: parameter after the step" for i, layer in enumerate(ddp.module.layers)
                     if not torch.equal(layer.weight.view(-1), (-want[i]).bfloat16())]
    return problems


@pytest.mark.parametrize("dp_kwargs, patterns", [
    (dict(data_parallel_sharding_strategy="no_shard"), ("layers.1.*", "layers.3.weight")),
    (dict(data_parallel_sharding_strategy="optim", reduce_scatter_with_fp32_accumulation=True), ("all",)),
    (dict(data_parallel_sharding_strategy="optim_grads", reduce_scatter_with_fp32_accumulation=True,
          overlap_grad_reduce=True, bucket_size=60), ("layers.1.*",)),
    (dict(data_parallel_sharding_strategy="optim_grads_params", reduce_scatter_with_fp32_accumulation=True,
          overlap_grad_reduce=True), ("layers.0.*", "layers.3.*")),
])
def test_optimizer_steps_on_the_reduced_gradient(dp_kwargs, patterns):
    """One SGD step (lr 1, from zero) through get_megatron_optimizer after scale_gradients(1/3), on 2 ranks.
    Would catch scale_gradients missing the separate fp32 main_grads, or an optimizer (full or distributed,
    every strategy) stepping on anything but the reduced gradient."""
    for problems in run_distributed(_step_worker, 2, dp_kwargs, patterns):
        assert not problems, problems


# ------------------------------------------------------------------------------------------ command line, benchmark
def test_pretrain_flags_set_both_modes():
    """Would catch Megatron's flags not reaching the config (or the patterns arriving as one string), and
    --bf16 (which reduces in fp32, Megatron's rule) combined with them failing with a message that does not say
    to add --grad-reduce-in-bf16."""
    from megatron_lite.training.arguments import ddp_config_from_args, parse_args

    args = parse_args(["--bf16", "--grad-reduce-in-bf16", "--use-distributed-optimizer",
                       "--ddp-reduce-scatter-with-fp32-accumulation",
                       "--ddp-param-name-patterns-for-fp32-local-accumulation", "*.bias", "layers.0.*"], world_size=2)
    config = ddp_config_from_args(args)
    assert not config.grad_reduce_in_fp32 and config.reduce_scatter_with_fp32_accumulation
    assert config.param_name_patterns_for_fp32_local_accumulation == ("*.bias", "layers.0.*")
    assert ddp_config_from_args(parse_args(["--bf16"], world_size=2)).grad_reduce_in_fp32
    args = parse_args(["--bf16", "--use-distributed-optimizer"], world_size=2)
    args.ddp_reduce_scatter_with_fp32_accumulation = True  # what parse_args itself turns into a usage error
    with pytest.raises(ValueError, match="add --grad-reduce-in-bf16"):
        ddp_config_from_args(args)


def test_benchmark_prints_every_mode(tmp_path):
    """Smoke test of the command docs/performance.md quotes: would catch the benchmark failing to run, or a
    mode missing from its table."""
    import subprocess
    import sys

    from pretrain_testing import REPO as repo

    out = subprocess.run([sys.executable, "-m", "benchmarks.low_precision_reduce",
                          "--world-size", "2", "--micro-batches", "2", "--num-layers", "1", "--hidden-size", "32",
                          "--vocab-size", "64", "--seq-length", "8"], capture_output=True, text=True, timeout=120,
                         cwd=repo)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "mode" not in line]
    assert len(rows) == 5, out.stdout
