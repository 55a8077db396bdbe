"""Training loops shared by the optimizer tests: megatron_lite on N ranks vs a single-process reference."""

import copy

import torch
from ddp_testing import loss_fn, make_batches, make_model, reference_grads

STEP_SEED = 100  # batches of step k use seed STEP_SEED + k


def build(dp_config_kwargs, opt_config_kwargs, dtype=torch.float32, model=None):
    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    model = model if model is not None else make_model(dtype=dtype)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(**dp_config_kwargs))
    opt = get_megatron_optimizer(OptimizerConfig(**opt_config_kwargs), [ddp])
    return model, ddp, opt


def megatron_steps(ddp, opt, rank, dp, steps, micro_batches=2, first_step=0, dtype=torch.float32,
                   device=None):
    """Megatron's training step; returns the per-step (update_successful, grad_norm) list. `device`: where
    the batches go (drawn on the CPU, so every device trains on the same data)."""
    out = []
    for k in range(first_step, first_step + steps):
        batches = make_batches(dp, micro_batches, seed=STEP_SEED + k, dtype=dtype)[rank]
        if device is not None:
            batches = [(x.to(device), y.to(device)) for x, y in batches]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for i, (x, y) in enumerate(batches):
            if i < len(batches) - 1:
                with ddp.no_sync():
                    opt.scale_loss(loss_fn(ddp, x, y) / len(batches)).backward()
            else:
                opt.scale_loss(loss_fn(ddp, x, y) / len(batches)).backward()
        ddp.finish_grad_sync()
        ok, norm, _ = opt.step()
        out.append((ok, norm))
    return out


def reference_steps(dp, steps, lr, weight_decay, clip_grad, micro_batches=2, dtype=torch.float32,
                    betas=(0.9, 0.999), eps=1e-8, first_step=0, master=None, optimizer=None, kind="adam",
                    kernel="foreach"):
    """torch.optim.AdamW (`kernel`: foreach or fused) on fp32 master weights with torch's clip_grad_norm_;
    the gradients are the data-parallel mean computed with the ranks' arithmetic. Returns (master model,
    optimizer, norms)."""
    if master is None:
        master = make_model(dtype=torch.float32)
        with torch.no_grad():  # start from the (possibly rounded) low-precision initial weights
            for p, q in zip(master.parameters(), make_model(dtype=dtype).parameters()):
                p.copy_(q.float())
    if optimizer is None:
        decay = [p for n, p in master.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
        no_decay = [p for n, p in master.named_parameters() if n.endswith(".bias") or p.dim() == 1]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if kind == "adam":
            optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **{kernel: True})
        else:
            optimizer = torch.optim.SGD(groups, lr=lr, momentum=0.9, foreach=True)
    norms = []
    for k in range(first_step, first_step + steps):
        batches = make_batches(dp, micro_batches, seed=STEP_SEED + k, dtype=dtype)
        low = copy.deepcopy(master).to(dtype)
        grads = reference_grads(low, batches, torch.float32, average_in_collective=False)
        for n, p in master.named_parameters():
            p.grad = grads[n].float().clone()
        norms.append(torch.nn.utils.clip_grad_norm_(list(master.parameters()), clip_grad, foreach=True).item())
        optimizer.step()
    return master, optimizer, norms


def full_state(opt):
    """Copies of the optimizer's full fp32 state (main params, moments) by parameter name and key."""
    return {name: {k: v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor)}
            for name, entry in opt.state_dict()["state"].items()}


def states_equal(a, b) -> bool:
    """Whether two full_state() results hold the same keys and bitwise-equal tensors."""
    return a.keys() == b.keys() and all(a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n])
                                        for n in a)


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; a step uses one head, so the other gets no gradient on any rank."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(6, 8)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)])

    def forward(self, x, head):
        return self.heads[head](torch.tanh(self.trunk(x)))


# Which head each rank uses at each step of heads_side_by_side. The round trip happens before step 3.
HEADS = {
    # head 1 unused at steps 1-2: its step count lags the optimizer's at the checkpoint
    "lagging": [lambda rank: rank, lambda rank: 0, lambda rank: 0, lambda rank: 1, lambda rank: 1 - rank],
    # head 1 unused at steps 0-2: it has no optimizer state at all at the checkpoint
    "never_stepped": [lambda rank: 0, lambda rank: 0, lambda rank: 0, lambda rank: 1, lambda rank: 1 - rank],
}


def heads_side_by_side(ddp, build_optimizer, reference, torch_opt, heads, resume, rank):
    """Train the wrapped TwoHeads (its optimizer from build_optimizer()) and torch DDP's `reference` (stepped
    by `torch_opt`) side by side on the same batches, each step on the head HEADS[heads][step](rank). Before
    step 3 the optimizer's state makes a round trip into a new one: resume 'torch' through state_dict(), else
    through the rank's own shards (what torch_dist and last words write).

    Returns (the largest parameter difference after each step, the wrapped optimizer)."""
    opt = build_optimizer()
    gen = torch.Generator().manual_seed(10 + rank)
    diffs = []
    for step, head_of in enumerate(HEADS[heads]):
        if step == 3 and resume == "torch":
            state = opt.state_dict()
            opt = build_optimizer()
            opt.load_state_dict(state)
        elif step == 3:
            described = opt.sharded_state()
            shards = {(s.name, s.start): {k: v.clone() for k, v in s.tensors.items()} for s in described.shards}
            common, step_count, lagging = described.common, described.step, described.lagging_steps()
            opt = build_optimizer()
            opt.load_common_state_dict(common)
            opt.load_sharded_state(opt.sharded_state().with_values(shards, step_count, lagging))
        x, y, head = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen), head_of(rank)
        ddp.zero_grad_buffer()
        ((ddp(x, head) - y) ** 2).mean().backward()
        ddp.finish_grad_sync()
        opt.step()
        torch_opt.zero_grad()
        ((reference(x, head) - y) ** 2).mean().backward()
        torch_opt.step()
        with ddp.full_parameters():
            diffs.append(max((p - q).abs().max().item()
                             for p, q in zip(ddp.module.parameters(), reference.module.parameters())))
    return diffs, opt
