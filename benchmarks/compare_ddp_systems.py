"""The five systems benchmarks/compare_ddp.py compares, built from one GPT with the same weights.

  ml-ddp          megatron_lite DDP (overlap_grad_reduce, --bucket-size) + FP32Optimizer
  ml-ddp+distopt  the same with the distributed optimizer and overlap_param_gather (ZeRO-1)
  ml-zero2        the same with data_parallel_sharding_strategy='optim_grads' (ZeRO-2)
  ml-zero3        'optim_grads_params' (ZeRO-3, one unit per transformer layer)
  torch-ddp       torch DDP (bucket_cap_mb 25, gradient_as_bucket_view) + AdamW
  torch-ddp+zero  torch DDP + ZeroRedundancyOptimizer(AdamW, parameters_as_bucket_view)
  fsdp2           fully_shard on every transformer layer, then on the root + AdamW
All use AdamW with the same hyperparameters and weight-decay groups and no clipping.
"""

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from benchmarks.counting import count_megatron_lite, count_torch, tensors_of
from megatron_lite import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_lite.models import GPTConfig, GPTModel


@dataclass
class System:
    name: str
    step: Callable  # (x, y) -> this rank's loss: one full training step
    tensors: Callable  # () -> (params, grads, optimizer state) this rank holds
    count_collectives: Callable[[], contextlib.AbstractContextManager]  # yields the list of calls made inside
    flush: Callable = lambda: None  # finish deferred communication (distopt's parameter all-gathers)
    torch_ddp: Optional[torch.nn.Module] = None  # torch DDP, whose C++ reducer all-reduces unseen by Python
    wrapper: Optional[DistributedDataParallel] = None  # megatron_lite's systems: the wrapper (its buckets)


def make_model(args, device):
    torch.manual_seed(0)  # the same initial weights on every rank and for every system
    return GPTModel(GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                              num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                              max_position_embeddings=args.seq_length)).to(device)


def batch(args, step, rank, device):
    """This rank's rows of step `step`'s global batch of random tokens (the same for every system)."""
    g = torch.Generator().manual_seed(1000 + step)
    mbs = args.micro_batch_size
    tokens = torch.randint(args.vocab_size, (dist.get_world_size() * mbs, args.seq_length + 1), generator=g)
    mine = tokens[rank * mbs:(rank + 1) * mbs].to(device)
    return mine[:, :-1], mine[:, 1:]


def param_groups(model):
    """get_megatron_optimizer's rule, for the torch systems too: no weight decay on biases and 1-D params."""
    no_wd = {p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1}
    return [{"params": [p for p in model.parameters() if p not in no_wd]},
            {"params": [p for p in model.parameters() if p in no_wd], "weight_decay": 0.0}]


def adamw(args, device):
    kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}  # what megatron_lite picks too
    return dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay, **kernel)


def build_ml(args, device, distopt=False, overlap=True, group=None, name="ml-ddp", strategy=None,
             bucket_view=True, grad_norm=False, **config):
    """megatron_lite with `bucket_view` (gradient_as_bucket_view, as torch-ddp) and, unless `grad_norm`, no
    gradient norm (clip_grad=0 and log_grad_norm=False: torch computes none either). `config`: more
    DistributedDataParallelConfig fields (ZeRO-3's prefetch_bucket_size, say)."""
    distopt = distopt or strategy not in (None, "no_shard")
    ddp = DistributedDataParallel(make_model(args, device), DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, bucket_size=args.bucket_size, use_distributed_optimizer=distopt,
        overlap_param_gather=distopt and strategy != "optim_grads_params", data_parallel_sharding_strategy=strategy,
        gradient_as_bucket_view=bucket_view, **config), data_parallel_group=group)
    opt = get_megatron_optimizer(OptimizerConfig(
        lr=args.lr, weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        clip_grad=0.0, log_grad_norm=grad_norm, use_distributed_optimizer=distopt), [ddp])

    def step(x, y):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(x, y).mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        return loss.detach()

    params = list(ddp.module.parameters())
    main = [p for g in opt.param_groups for p in g["params"]]  # distopt: views into the param buffer
    buckets = [b for buffer in ddp.param_and_grad_buffers for b in buffer.buckets]
    shards = [b.param_shard for b in buckets if b.param_shard is not None]  # ZeRO-3's persistent params
    grads = [p.main_grad for p in params] + [b.grad_shard for b in buckets if b.grad_shard is not None]
    return System(name, step, lambda: (params + shards + main, grads, tensors_of(opt.optimizer)),
                  count_megatron_lite, flush=ddp.finish_param_sync, wrapper=ddp)


def plain_step(model, opt):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y).mean()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def build_torch(args, device, zero=False):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = make_model(args, device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if zero:
        opt = ZeroRedundancyOptimizer(param_groups(model), optimizer_class=torch.optim.AdamW,
                                      parameters_as_bucket_view=True, **adamw(args, device))
    else:
        opt = torch.optim.AdamW(param_groups(model), **adamw(args, device))
    params = list(model.parameters())
    return System("torch-ddp+zero" if zero else "torch-ddp", plain_step(ddp, opt),
                  lambda: (params, [p.grad for p in params], tensors_of(opt.optim if zero else opt)),
                  functools.partial(count_torch, dist.get_world_size()), torch_ddp=ddp)


def build_fsdp2(args, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = make_model(args, device)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(param_groups(model), **adamw(args, device))
    params = list(model.parameters())  # DTensors: the rank holds .to_local()
    return System("fsdp2", plain_step(model, opt), lambda: (params, [p.grad for p in params], tensors_of(opt)),
                  functools.partial(count_torch, dist.get_world_size()))


def build_candidates(args, device):
    """ml-ddp without each of issue 13's step savings, to measure what each one removed."""
    return [build_ml(args, device, bucket_view=False, grad_norm=True, name="ml-ddp-before"),
            build_ml(args, device, bucket_view=False, name="ml-ddp-no-bucket-view"),
            build_ml(args, device, grad_norm=True, name="ml-ddp-with-norm"),
            build_ml(args, device, distopt=True, bucket_view=False, grad_norm=True, name="ml-distopt-before")]


def build_all(args, device):
    return [build_ml(args, device), build_ml(args, device, distopt=True, name="ml-ddp+distopt"),
            build_ml(args, device, strategy="optim_grads", name="ml-zero2"),
            build_ml(args, device, strategy="optim_grads_params", name="ml-zero3"),
            build_torch(args, device), build_torch(args, device, zero=True), build_fsdp2(args, device)]
