"""What only a GPU shows: ZeRO-2/3 give their full-size storages back to the CUDA caching allocator (and the
results stay right while they come and go), NCCL itself runs the ops and dtypes the library issues, a model
built on the meta device and materialized on the GPU wraps and trains, and pretrain_gpt.py trains on CUDA
(bf16, overlap, checkpoint and resume). Skipped without a GPU."""

import pytest
import torch
from cuda_ranks import ON_CPU, cuda_or_dry_run, run_on_cuda

pytestmark = pytest.mark.skipif(not cuda_or_dry_run(), reason="needs a CUDA device")

WIDTH = 1024  # 4 Linear(1024, 1024): ~16.8 MB of fp32 parameters, as many bytes of gradients


def _memory_worker(steps=2):
    import torch.distributed as dist
    import torch.nn as nn
    from cuda_testing import device

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    dp, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        if not ON_CPU:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        before = 0 if ON_CPU else torch.cuda.memory_allocated()
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]).to(device())
        n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
            data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, bucket_size=WIDTH * WIDTH,
            fsdp_unit_modules=("Linear",) if strategy == "optim_grads_params" else None))
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, use_distributed_optimizer=True), [ddp])
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randn(8, WIDTH, generator=g).to(device())
            ddp.zero_grad_buffer()
            ddp(x).square().mean().backward()
            ddp.finish_grad_sync()
            opt.step()
            del x
        buckets = ddp.param_and_grad_buffers[0].buckets
        freed = [b.grad_data.untyped_storage().nbytes() == 0 for b in buckets]
        if not ON_CPU:
            torch.cuda.synchronize()
        held = 0 if ON_CPU else torch.cuda.memory_allocated() - before
        with torch.no_grad():
            probe = ddp(torch.ones(2, WIDTH, device=device())).float().sum().item()
        out[strategy] = dict(held=held, freed=freed, n_bytes=n_bytes, probe=probe)
        del ddp, opt, model, buckets
    return dp, out


def test_zero2_zero3_give_memory_back_to_the_allocator():
    """Between iterations ZeRO-2 holds 1/dp of the gradients and ZeRO-3 1/dp of the parameters as well, as
    measured by torch.cuda.memory_allocated on 2 gloo ranks sharing the GPU: the bytes ZeRO-1 holds minus
    ZeRO-2's are at least 80% of (1 - 1/dp) of the gradient bytes, and the same for ZeRO-3 and the parameter
    bytes; every bucket's full gradient storage is empty after the step; all three still compute the same
    forward. Would catch a resize_(0) that the caching allocator never sees (a view or a record keeping the
    block), a regrow that leaks the old block, or a stream-ordering fault in the release (an all-gather or
    reduce-scatter still reading a block already handed back shows up as a wrong probe value)."""
    for dp, out in run_on_cuda(_memory_worker, 2, backend="gloo"):
        for strategy in ("optim_grads", "optim_grads_params"):
            assert all(out[strategy]["freed"]), (strategy, out[strategy]["freed"])
        probes = {s: out[s]["probe"] for s in out}
        assert probes["optim"] == probes["optim_grads"] == probes["optim_grads_params"], probes
        if ON_CPU:
            continue
        n_bytes = out["optim"]["n_bytes"]
        saved_by_zero2 = out["optim"]["held"] - out["optim_grads"]["held"]
        saved_by_zero3 = out["optim_grads"]["held"] - out["optim_grads_params"]["held"]
        want = 0.8 * n_bytes * (1 - 1 / dp)
        assert saved_by_zero2 >= want, ({s: out[s]["held"] for s in out}, n_bytes)
        assert saved_by_zero3 >= want, ({s: out[s]["held"] for s in out}, n_bytes)


def _nccl_ops_worker():
    import torch.distributed as dist
    from cuda_testing import device

    dev = device()
    seen = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32):
        t = torch.arange(8, device=dev).to(dtype)
        for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("avg", dist.ReduceOp.AVG)):
            if name == "avg" and not dtype.is_floating_point:
                continue
            x = t.clone()
            dist.all_reduce(x, op=op, async_op=True).wait()
            seen[f"all_reduce {name} {dtype}"] = torch.equal(x, t)
        out = torch.empty_like(t)
        dist.reduce_scatter_tensor(out, t.clone())
        seen[f"reduce_scatter {dtype}"] = torch.equal(out, t)
        gathered = torch.zeros_like(t)
        dist.all_gather_into_tensor(gathered, t.clone(), async_op=True).wait()
        seen[f"all_gather {dtype}"] = torch.equal(gathered, t)
        received = torch.zeros_like(t)
        dist.all_to_all_single(received, t.clone())
        seen[f"all_to_all {dtype}"] = torch.equal(received, t)
        b = t.clone()
        dist.broadcast(b, src=0)
        seen[f"broadcast {dtype}"] = torch.equal(b, t)
    objects = [None]
    dist.all_gather_object(objects, {"rank": dist.get_rank()})
    seen["all_gather_object"] = objects == [{"rank": 0}]
    sub = dist.new_group([0], use_local_synchronization=True)
    x = torch.ones(4, device=dev)
    dist.all_reduce(x, group=sub)
    seen["new_group all_reduce"] = torch.equal(x, torch.ones(4, device=dev))
    dist.barrier()
    return dist.get_backend(), seen


def test_nccl_runs_the_ops_and_dtypes_the_library_issues():
    """NCCL at world size 1 runs every collective megatron-lite issues (all-reduce SUM/MAX/AVG, reduce-scatter,
    all-gather, all-to-all, broadcast; async and not; fp32, bf16, fp16, int64, int32; objects; a subgroup as
    the distributed-optimizer instances make). The library skips tensor collectives on one-rank groups, so
    this is the only place a single GPU exercises NCCL itself. Would catch a CUDA torch without a working
    NCCL, or an op or dtype (ReduceOp.AVG, int64 counters) that this NCCL refuses."""
    backend, seen = run_on_cuda(_nccl_ops_worker, 1, backend="nccl")[0]
    if not ON_CPU:
        assert backend == "nccl"
    failed = [k for k, ok in seen.items() if not ok]
    assert not failed, failed


def _meta_worker(strategy):
    import copy

    import torch.distributed as dist
    from cuda_testing import device

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig
    from megatron_lite.models import GPTConfig, GPTModel

    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, max_position_embeddings=32)
    torch.manual_seed(0)
    reference = GPTModel(config)  # on the CPU: the weights both models get
    with torch.device("meta"):
        built = GPTModel(config)
    assert all(p.is_meta for p in built.parameters())
    built.to_empty(device=device())
    built.load_state_dict(reference.state_dict())
    wrapped = {}
    for name, module in (("meta", built), ("direct", copy.deepcopy(reference).to(device()))):
        ddp = DistributedDataParallel(module, DistributedDataParallelConfig(
            data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, bucket_size=5000))
        tokens = torch.randint(128, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank())).to(device())
        losses = []
        for _ in range(2):
            ddp.zero_grad_buffer()
            loss = ddp(tokens[:, :-1], labels=tokens[:, 1:]).mean()
            loss.backward()
            ddp.finish_grad_sync()
            losses.append(loss.item())
        grads = [b.reduced_grad_shard.float().cpu() if ddp.ddp_config.use_distributed_optimizer
                 else b.grad_data.float().cpu() for b in ddp.param_and_grad_buffers[0].buckets]
        devices = {t.device.type for buffer in ddp.param_and_grad_buffers for b in buffer.buckets
                   for t in (b.grad_data, b.param_data, b.grad_shard, b.param_shard) if t is not None}
        wrapped[name] = dict(losses=losses, grads=grads, devices=devices)
    same = wrapped["meta"]["losses"] == wrapped["direct"]["losses"] and all(
        torch.equal(a, b) for a, b in zip(wrapped["meta"]["grads"], wrapped["direct"]["grads"]))
    return same, wrapped["meta"]["devices"]


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_a_model_built_on_the_meta_device_wraps_and_trains_on_the_gpu(strategy):
    """The GPT built under torch.device('meta'), materialized with to_empty(device=cuda) and loaded, wraps
    (plain DDP and ZeRO-3) and trains exactly like the same weights built directly (2 gloo ranks on the GPU).
    The wrapper has no meta-specific code: it must be given materialized parameters (wrapping a meta model
    itself is not supported). Would catch a buffer, placeholder or shard allocated on another device than
    the parameters' once they are materialized, or state (rotary tables, masks) left on the meta device."""
    for same, devices in run_on_cuda(_meta_worker, 2, strategy, backend="gloo"):
        assert same
        assert devices == {"cpu" if ON_CPU else "cuda"}, devices


def _pretrain_worker(argv):
    from pretrain_testing import pretrain_losses

    return pretrain_losses(argv)


@pytest.mark.parametrize("backend, world", [("nccl", 1), ("gloo", 2)])
def test_pretrain_gpt_trains_and_resumes_on_cuda(tmp_path, backend, world):
    """pretrain_gpt.py on the GPU (tiny GPT, mock data, bf16, distributed optimizer, overlap of the gradient
    reduction and of the parameter gather, torch_dist checkpoint at iteration 3 and resume): finite losses,
    and the resumed run repeats the uninterrupted one's losses to 1e-3. Would catch a training loop, metrics
    or checkpoint path that assumes CPU tensors (a save that does not move shards to the host, a load that
    puts state on the wrong device, RNG state of CUDA not restored)."""
    from pretrain_testing import tiny_pretrain_flags

    flags = tiny_pretrain_flags(bf16=True, use_distributed_optimizer=True, overlap_grad_reduce=True,
                                overlap_param_gather=True, ddp_bucket_size="2000", ckpt_format="torch_dist",
                                device="cpu" if ON_CPU else "cuda", distributed_backend="gloo" if ON_CPU else backend)
    whole = run_on_cuda(_pretrain_worker, world, flags, backend=backend)[0]
    assert sorted(whole) == [1, 2, 3, 4, 5, 6] and all(v == v and abs(v) < 1e4 for v in whole.values()), whole
    save = str(tmp_path / "ck")
    run_on_cuda(_pretrain_worker, world, flags + ["--save", save, "--exit-interval", "3"], backend=backend)
    resumed = run_on_cuda(_pretrain_worker, world, flags + ["--load", save], backend=backend)[0]
    assert sorted(resumed) == [4, 5, 6], resumed
    for i in (4, 5, 6):
        assert abs(resumed[i] - whole[i]) <= 1e-3 * abs(whole[i]), (i, resumed[i], whole[i])
