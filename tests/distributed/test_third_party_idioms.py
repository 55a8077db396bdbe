"""More models nobody here wrote, in the idioms test_third_party_models.py does not cover, trained by megatron_lite
on 2 gloo ranks against torch.nn.parallel.DistributedDataParallel + torch.optim.AdamW (that file's loops, data
and parameter groups), compared after every step. The models the wrapper refuses, and ZeRO-3's inner module
called directly, are in test_model_checks.py.

  * activation checkpointing (torch.utils.checkpoint, reentrant and not): reentrant recomputation runs the
    blocks' forward inside backward, with autograd off in the first forward;
  * one block applied several times per forward (ALBERT's weight sharing), plain and checkpointed, and the same
    sharing by tying distinct blocks' Parameters or by nn.ModuleList([block] * 3);
  * nn.MultiheadAttention (parameters read by F.multi_head_attention_forward, not by submodules), an
    nn.Embedding with padding_idx and a custom autograd.Function;
  * parametrizations (weight_norm: two parameters computing one weight; spectral_norm: buffers updated in
    every training forward);
  * the user's own hooks: a tensor hook on a parameter, full backward hooks and pre-hooks on blocks;
  * ZeRO-3 blocks returning a dataclass instead of a tensor (the output the unit is gathered again from);
  * two backward passes per micro-batch (retain_graph), or fewer in a later iteration than in the first,
    against a single-process reference; no_sync() around the forward only (torch DDP's reading);
  * a branch no rank runs, without overlap; fp32 and bf16 parameters in one model; a zero-size parameter.

Tolerance: none -- bit-exact, for test_third_party_models.py's reasons. The reference is built again from the
same seed rather than deep-copied: deepcopy drops the hooks registered on parameters.
"""

import contextlib
import dataclasses

import pytest
import test_third_party_models as t3
import third_party_models as tpm
import torch
import torch.nn as nn
from distributed_helper import run_distributed
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint


# ------------------------------------------------------------------------------ the models
class CheckpointedStack(nn.Module):
    """Residual blocks each run through torch.utils.checkpoint."""

    def __init__(self, reentrant, dim_in=6, dim=10, depth=3, out=2):
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(dim_in, dim)
        self.blocks = nn.ModuleList([tpm.ResidualMLP(dim, 2 * dim) for _ in range(depth)])
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


class SharedBlockNet(nn.Module):
    """ALBERT-style: one block applied `repeats` times (its gradient sums every application's)."""

    def __init__(self, reentrant=None, dim_in=6, dim=10, repeats=3, out=2):
        super().__init__()
        self.reentrant = reentrant  # None: no checkpointing
        self.stem = nn.Linear(dim_in, dim)
        self.blocks = nn.ModuleList([tpm.ResidualMLP(dim, 2 * dim)])
        self.repeats = repeats
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        h = self.stem(x)
        for _ in range(self.repeats):
            h = self.blocks[0](h) if self.reentrant is None else checkpoint(self.blocks[0], h,
                                                                             use_reentrant=self.reentrant)
        return self.head(h)


class CheckpointedStages(CheckpointedStack):
    """One checkpoint around several blocks (a stage), so a recomputation runs several ZeRO-3 units."""

    def __init__(self, reentrant, dim_in=6, dim=10, depth=4, out=2):
        super().__init__(reentrant, dim_in, dim, depth, out)

    def stage(self, h, first, last):
        for block in self.blocks[first:last]:
            h = block(h)
        return h

    def forward(self, x):
        h = self.stem(x)
        half = len(self.blocks) // 2
        h = checkpoint(self.stage, h, 0, half, use_reentrant=self.reentrant)
        h = checkpoint(self.stage, h, half, len(self.blocks), use_reentrant=self.reentrant)
        return self.head(h)


class CrossLayerTied(SharedBlockNet):
    """ALBERT's sharing done by tying: distinct blocks whose up projections are one Parameter."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([tpm.ResidualMLP(10, 20) for _ in range(3)])
        for block in self.blocks[1:]:
            block.up.weight = self.blocks[0].up.weight

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class RepeatedModuleList(CrossLayerTied):
    """nn.ModuleList([block] * 3): one block object registered three times."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([tpm.ResidualMLP(10, 20)] * 3)


class Gate(torch.autograd.Function):
    """x * w with a hand-written backward, as custom kernels' Python wrappers are."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class AttentionLM(nn.Module):
    def __init__(self, vocab=t3.VOCAB, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.blocks = nn.ModuleList([nn.MultiheadAttention(dim, 4, batch_first=True) for _ in range(2)])
        self.gate = nn.Parameter(torch.ones(dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for attention in self.blocks:
            h = h + attention(h, h, h, need_weights=False)[0]
        return self.head(Gate.apply(h.reshape(-1, h.shape[-1]), self.gate).reshape(h.shape))


def parametrized_stack():
    """weight_norm on every block's up projection, spectral_norm (power-iteration buffers) on its down one."""
    model = tpm.StackedMLP()
    for block in model.body:
        parametrizations.weight_norm(block.up)
        parametrizations.spectral_norm(block.down)
    return model


def _clamp(grad):
    return grad.clamp(-0.01, 0.01)


def _halve_inputs(module, grad_input, grad_output):
    return tuple(None if g is None else g * 0.5 for g in grad_input)


def _triple_outputs(module, grad_output):
    return tuple(None if g is None else g * 3.0 for g in grad_output)


class HookedStack(nn.Module):
    """The user's own hooks, registered before wrapping: a tensor hook clamping a parameter's gradient, a full
    backward hook and a full backward pre-hook rescaling blocks' gradients."""

    def __init__(self, dim_in=6, dim=10, depth=3, out=2):
        super().__init__()
        self.stem = nn.Linear(dim_in, dim)
        self.blocks = nn.ModuleList([tpm.ResidualMLP(dim, 2 * dim) for _ in range(depth)])
        self.head = nn.Linear(dim, out)
        self.head.weight.register_hook(_clamp)
        self.blocks[1].register_full_backward_hook(_halve_inputs)
        self.blocks[2].register_full_backward_pre_hook(_triple_outputs)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@dataclasses.dataclass
class BlockOutput:
    hidden: torch.Tensor
    note: str = ""


class DataclassBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mlp = tpm.ResidualMLP(dim, 2 * dim)

    def forward(self, h):
        return BlockOutput(self.mlp(h))


class DataclassStack(nn.Module):
    """Blocks that return a dataclass (transformers' ModelOutput is a dict; many codebases use dataclasses)."""

    def __init__(self, dim_in=6, dim=10, depth=3, out=2):
        super().__init__()
        self.stem = nn.Linear(dim_in, dim)
        self.blocks = nn.ModuleList([DataclassBlock(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h).hidden
        return self.head(h)


def _checkpointed(reentrant):
    return lambda: CheckpointedStack(reentrant)


def _shared(reentrant):
    return lambda: SharedBlockNet(reentrant)


CASES = {
    "checkpoint_reentrant": t3.Case(_checkpointed(True), t3.regression_batch, t3.mse),
    "checkpoint_non_reentrant": t3.Case(_checkpointed(False), t3.regression_batch, t3.mse),
    "shared_block": t3.Case(_shared(None), t3.regression_batch, t3.mse),
    "shared_block_checkpointed": t3.Case(_shared(False), t3.regression_batch, t3.mse),
    "checkpoint_around_units": t3.Case(lambda: CheckpointedStages(True), t3.regression_batch, t3.mse),
    "cross_layer_tied": t3.Case(CrossLayerTied, t3.regression_batch, t3.mse),
    "repeated_module_list": t3.Case(RepeatedModuleList, t3.regression_batch, t3.mse),
    "attention_custom_function": t3.Case(AttentionLM, t3.lm_batch, t3.lm_loss, units=("MultiheadAttention",)),
    "parametrizations": t3.Case(parametrized_stack, t3.regression_batch, t3.mse, units=("ResidualMLP",)),
    "user_hooks": t3.Case(HookedStack, t3.regression_batch, t3.mse),
    "dataclass_outputs": t3.Case(DataclassStack, t3.regression_batch, t3.mse),
}

# (case, t3.CONFIGS name): ZeRO-1 with overlapped small buckets and ZeRO-3 for every case, plus the strategies
# where a case's trap lies (reentrant recomputation firing hooks late: no_shard and ZeRO-2 with overlap).
MATRIX = [(case, config) for case in CASES for config in ("optim-overlap", "optim_grads_params")] + [
    ("checkpoint_reentrant", "no_shard-overlap"), ("checkpoint_reentrant", "optim_grads-overlap")]


def build_pair(case, strategy, overlap):
    """t3.build_pair with the torch reference built again from the same seed: deepcopy would drop the hooks
    these models register on parameters."""
    return t3.build_pair(case, strategy, overlap, rebuild_reference=True)


def _train_pair(case, config_name):
    """Train the wrapped model and torch DDP's reference side by side on this rank's micro-batches; yields
    (wrapped, reference) after each of t3.STEPS steps."""
    import torch.distributed as dist

    rank = dist.get_rank()
    ddp, opt, reference, torch_opt = build_pair(case, *t3.CONFIGS[config_name])
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(t3.STEPS):
        micro_batches = [case.batch(gen, rank, step) for _ in range(t3.MICRO_BATCHES)]
        t3.megatron_step(ddp, opt, case.loss, micro_batches)
        t3.torch_step(reference, torch_opt, case.loss, micro_batches)
        yield ddp, reference


def _compare_worker(case_name, config_name):
    return [t3.differences(ddp, reference) for ddp, reference in _train_pair(CASES[case_name], config_name)]


@pytest.mark.parametrize("case,config", MATRIX)
def test_matches_torch_ddp_and_adamw(case, config):
    """Would catch, per model: reentrant checkpointing's recomputed forward re-gathering, releasing or counting a
    ZeRO-3 unit wrongly, or its late gradient hooks missing a launched bucket (checkpoint_*); a block applied
    several times getting one application's gradient, reduced before the last application's backward, or released
    by ZeRO-3 between applications (shared_block*, cross_layer_tied, repeated_module_list); a reentrant
    recomputation running several ZeRO-3 units at once (checkpoint_around_units); nn.MultiheadAttention's
    directly-read parameters, the padding row or a custom Function's gradient lost (attention_custom_function); a
    parametrization's original tensors or spectral_norm's buffers mishandled (parametrizations); the user's
    parameter and module hooks skipped or applied twice (user_hooks); a ZeRO-3 unit whose dataclass output hid its
    tensors from the re-gather hook, its backward then reading released parameters (dataclass_outputs, a storage
    error before the fix)."""
    for rank, per_step in enumerate(run_distributed(_compare_worker, 2, case, config)):
        t3.assert_matches(rank, per_step)


# ------------------------------------------------------------------------------ two backward passes per micro-batch
def _losses(model, args, target):
    out = model(*args)
    return t3.mse(out, target), (out ** 2).mean()


def _backward_passes_worker(config_name, passes):
    """In step i each micro-batch runs passes[i] backward passes: loss_a.backward(retain_graph=True), then
    loss_b.backward(). torch DDP refuses a second pass ("mark a variable ready only once"), so the reference
    is one process fed every rank's batches, the mean formed as the buckets form it."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    case = t3.Case(tpm.StackedMLP, t3.regression_batch, t3.mse)
    ddp, opt, reference, _ = build_pair(case, *t3.CONFIGS[config_name])
    ref = reference.module
    torch_opt = torch.optim.AdamW(t3.torch_param_groups(ref), lr=t3.LR, foreach=True)
    gens = [torch.Generator().manual_seed(1000 + r) for r in range(world)]

    def backward(model, args, target, n):
        losses = _losses(model, args, target)[:n]
        for i, loss in enumerate(losses):
            loss.backward(retain_graph=i < len(losses) - 1)

    per_step = []
    for step, n in enumerate(passes):
        batches = [[case.batch(gens[r], r, step) for _ in range(t3.MICRO_BATCHES)] for r in range(world)]
        ddp.zero_grad_buffer()
        try:
            for i, (args, target) in enumerate(batches[rank]):
                with ddp.no_sync() if i < len(batches[rank]) - 1 else contextlib.nullcontext():
                    backward(ddp, args, target, n)
            ddp.finish_grad_sync()
        except (RuntimeError, ValueError) as e:
            return per_step + [str(e)]
        opt.step()
        grads = []
        for r in range(world):
            torch_opt.zero_grad()
            for args, target in batches[r]:
                backward(ref, args, target, n)
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, *per_rank in zip(ref.parameters(), *grads):
            p.grad = sum(g * (1.0 / world) for g in per_rank)
        torch_opt.step()
        with ddp.full_parameters():
            per_step.append({n: (p - q).abs().max().item() for (n, p), q in
                             zip(ddp.module.named_parameters(), ref.parameters()) if not torch.equal(p, q)})
    return per_step


@pytest.mark.parametrize("config", ["no_shard", "no_shard-overlap", "optim-overlap", "optim_grads",
                                    "optim_grads-overlap"])
def test_two_backward_passes_per_micro_batch(config):
    """Would catch the second backward pass of a micro-batch (retain_graph) dropped, or launched in a second
    collective, when overlap learns each parameter's arrivals per backward (2 here) in the first iteration; under
    ZeRO-2 with overlap (one arrival per parameter expected from the first iteration) a clear error on every
    rank instead of a hang or a half-reduced gradient. Bit-exact against one process (0 + a/2 + b/2 = a/2 + b/2)."""
    for rank, result in enumerate(run_distributed(_backward_passes_worker, 2, config, (2, 2, 2))):
        if config == "optim_grads-overlap":
            assert len(result) == 1 and "second gradient" in result[0], (rank, result)
        else:
            assert result == [{}] * 3, (rank, result)


@pytest.mark.parametrize("config", ["no_shard-overlap", "optim-overlap"])
def test_fewer_backward_passes_than_the_first_iteration(config):
    """Would catch an iteration with fewer backward passes than the first one (an auxiliary loss back-propagated
    on its own, in the first step and every k-th) refused as "22 parameter(s) received no gradient", naming every
    parameter although each got its gradient: overlap learned 2 arrivals per parameter, the buckets wait for a
    second one, and finish_grad_sync must launch them, as it does for the first iteration. More passes than
    learned stay an error on every rank (a launched bucket would miss the extra gradient)."""
    for rank, result in enumerate(run_distributed(_backward_passes_worker, 2, config, (2, 1, 2))):
        assert result == [{}] * 3, (rank, result)
    for rank, result in enumerate(run_distributed(_backward_passes_worker, 2, config, (1, 2))):
        assert len(result) == 2 and result[0] == {} and "second gradient after its bucket" in result[1], result


def _forward_only_no_sync_worker(config_name):
    """torch DDP's reading of no_sync(): only each earlier micro-batch's forward inside it, the backward after."""
    import torch.distributed as dist

    rank = dist.get_rank()
    case = t3.Case(tpm.StackedMLP, t3.regression_batch, t3.mse)
    ddp, opt, reference, torch_opt = build_pair(case, *t3.CONFIGS[config_name])
    gen = torch.Generator().manual_seed(1000 + rank)
    per_step = []
    for step in range(t3.STEPS):
        micro_batches = [case.batch(gen, rank, step) for _ in range(t3.MICRO_BATCHES)]
        ddp.zero_grad_buffer()
        try:
            for i, (args, target) in enumerate(micro_batches):
                with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                    loss = t3.mse(ddp(*args), target) / len(micro_batches)
                loss.backward()
            ddp.finish_grad_sync()
        except RuntimeError as e:
            return per_step + [str(e)]
        opt.step()
        t3.torch_step(reference, torch_opt, case.loss, micro_batches)
        per_step.append(t3.differences(ddp, reference))
    return per_step


@pytest.mark.parametrize("config", ["no_shard", "optim-overlap", "optim_grads-overlap"])
def test_no_sync_around_the_forward_only(config):
    """Would catch torch DDP's way of accumulating (no_sync() around the forward, backward after it) giving other
    numbers than torch: with overlap the first iteration learns one arrival per micro-batch and launches after
    the last; or, under ZeRO-2 with overlap (one arrival expected), an error that does not say to put the
    backward inside no_sync() (it blamed reentrant checkpointing only)."""
    for rank, result in enumerate(run_distributed(_forward_only_no_sync_worker, 2, config)):
        if config == "optim_grads-overlap":
            assert len(result) == 1 and "outside no_sync()" in result[0], result
        else:
            t3.assert_matches(rank, result)


def _unused_without_overlap_worker(strategy):
    """test_third_party_models.py's branch that no rank uses in some steps, without overlap_grad_reduce."""
    import torch.distributed as dist

    rank = dist.get_rank()
    case = t3.CASES["rank_branches"]
    ddp, opt, reference, torch_opt = t3.build_pair(case, strategy, False)
    gen = torch.Generator().manual_seed(1000 + rank)
    per_step = []
    for step, task_of in enumerate(t3.ALL_RANKS_TASKS):
        micro_batches = []
        for _ in range(t3.MICRO_BATCHES):
            (x, _), y = t3.task_batch(gen, rank, step)
            micro_batches.append(((x, task_of(rank)), y))
        t3.megatron_step(ddp, opt, case.loss, micro_batches)
        t3.torch_step(reference, torch_opt, case.loss, micro_batches)
        per_step.append((t3.differences(ddp, reference), sorted(ddp.param_to_name[p] for p in ddp.unused_params)))
    return per_step


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads"])
def test_parameters_no_rank_uses_are_skipped_without_overlap(strategy):
    """Would catch find_unused_parameters=True skipping a branch no rank ran only with overlap_grad_reduce (the
    docs said unused parameters were always stepped on zeros without overlap): Adam moments and weight decay
    moving a branch torch leaves alone."""
    for rank, per_step in enumerate(run_distributed(_unused_without_overlap_worker, 2, strategy)):
        t3.assert_matches(rank, [result for result, _ in per_step])
        assert [bool(unused) for _, unused in per_step] == [False, True, False, True], per_step


class MixedDtypeNet(nn.Module):
    """A bf16 body between an fp32 stem and head: the user cast part of the model (fp32 for the sensitive ends)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 10)
        self.blocks = nn.ModuleList([tpm.ResidualMLP(10, 20) for _ in range(2)]).to(torch.bfloat16)
        self.head = nn.Linear(10, 2)

    def forward(self, x):
        h = self.stem(x).to(torch.bfloat16)
        for block in self.blocks:
            h = block(h)
        return self.head(h.float())


def _mixed_dtype_worker(config_name):
    """megatron_lite vs torch DDP whose AdamW steps fp32 masters of the bf16 parameters (megatron's rule: fp32 main
    params, the bf16 gradient reduced in bf16, cast up, the update cast down); OptimizerConfig.bf16 left False."""
    import torch.distributed as dist

    rank = dist.get_rank()
    case = t3.Case(MixedDtypeNet, t3.regression_batch, t3.mse)
    ddp, opt, reference, _ = build_pair(case, *t3.CONFIGS[config_name])
    masters = {p: p.detach().float().requires_grad_() if p.dtype != torch.float32 else p
               for p in reference.module.parameters()}
    torch_opt = torch.optim.AdamW([{**g, "params": [masters[p] for p in g["params"]]}
                                   for g in t3.torch_param_groups(reference.module)], lr=t3.LR, foreach=True)
    gen = torch.Generator().manual_seed(1000 + rank)
    per_step = []
    for step in range(t3.STEPS):
        micro_batches = [case.batch(gen, rank, step) for _ in range(t3.MICRO_BATCHES)]
        t3.megatron_step(ddp, opt, case.loss, micro_batches)
        for p in reference.module.parameters():
            p.grad = None
        for i, (args, target) in enumerate(micro_batches):
            with reference.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                (case.loss(reference(*args), target) / len(micro_batches)).backward()
        for p, master in masters.items():
            if master is not p:
                master.grad = p.grad.float()
        torch_opt.step()
        with torch.no_grad():
            for p, master in masters.items():
                if master is not p:
                    p.copy_(master)
        per_step.append(t3.differences(ddp, reference))
    return per_step


@pytest.mark.parametrize("config", ["no_shard", "optim-overlap", "optim_grads_params"])
def test_fp32_and_bf16_parameters_in_one_model(config):
    """Would catch a model mixing fp32 and bf16 parameters (one buffer per dtype) reducing a buffer in the other's
    dtype, pairing a bf16 parameter with an fp32 slot, stepping bf16 weights without fp32 main params when
    OptimizerConfig.bf16 is False, or a ZeRO shard of one dtype's buffer applied to the other's."""
    for rank, per_step in enumerate(run_distributed(_mixed_dtype_worker, 2, config)):
        t3.assert_matches(rank, per_step)


class WithEmptyParameter(nn.Module):
    """A trainable zero-size parameter among the others (configurable code with 0 extra tokens / prompts)."""

    def __init__(self):
        super().__init__()
        self.extra_tokens = nn.Parameter(torch.zeros(0, 10))
        self.net = tpm.StackedMLP()

    def forward(self, x):
        return self.net(x) + self.extra_tokens.sum()


def _empty_parameter_worker(config_name):
    case = t3.Case(WithEmptyParameter, t3.regression_batch, t3.mse, units=("ResidualMLP",))
    differing = []
    for ddp, reference in _train_pair(case, config_name):
        ddp.finish_param_sync()
        with ddp.full_parameters():
            differing.append([n for (n, p), q in zip(ddp.module.named_parameters(), reference.module.parameters())
                              if not torch.equal(p, q)])
    return differing


@pytest.mark.parametrize("config", ["no_shard-overlap", "optim", "optim_grads_params"])
def test_zero_size_parameter(config):
    """Would catch a trainable parameter with no elements refused under the distributed optimizer and ZeRO-3 as
    "param.data is not its view into the parameter buffer any more" (an empty tensor's data_ptr() is 0), or
    breaking the layout of the parameters around it."""
    for differing in run_distributed(_empty_parameter_worker, 2, config):
        assert differing == [[]] * t3.STEPS, differing
