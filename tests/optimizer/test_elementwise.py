"""Any elementwise torch.optim class through OptimizerConfig.optimizer_class (optimizer/elementwise.py): the
probe that accepts or refuses a class, each of the eight against its own torch.optim class on the global
batch at every sharding strategy, and bit-exact resume in both checkpoint formats.

Bitwise: clipping is off (clip_grad large), so each rank's shard sees exactly the reference's mean gradient
(the same arithmetic: reference_grads) and an elementwise update of a range equals the same update of the
whole tensor: every parameter equals the single process's, bit for bit, at every strategy.
"""

import os
import re

import pytest
import torch
from distributed_helper import run_distributed

LR, WD, NO_CLIP, STEPS = 1e-2, 0.1, 1e9, 3

# The eight, each with hyperparameters that exercise its state (amsgrad's third moment, RMSprop's three).
CLASSES = [
    (torch.optim.Adam, {"amsgrad": True}), (torch.optim.AdamW, {"betas": (0.8, 0.95)}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}), (torch.optim.Adagrad, {"lr_decay": 0.01}),
    (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}), (torch.optim.Adamax, {}),
    (torch.optim.NAdam, {"momentum_decay": 0.004}), (torch.optim.RAdam, {"decoupled_weight_decay": True}),
]
STRATEGIES = [  # (DDP config, OptimizerConfig extras)
    (dict(use_distributed_optimizer=False), {}),
    (dict(use_distributed_optimizer=True, bucket_size=100), {}),  # ZeRO-1, parameters cut across ranks
    (dict(use_distributed_optimizer=True, bucket_size=100, overlap_grad_reduce=True,
          data_parallel_sharding_strategy="optim_grads"), {}),
    (dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
          data_parallel_sharding_strategy="optim_grads_params", fsdp_unit_modules=("Linear", "LayerNorm")), {}),
    (dict(use_distributed_optimizer=True, bucket_size=100), dict(optimizer_cpu_offload=True)),
    (dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
          data_parallel_sharding_strategy="optim_grads_params", fsdp_unit_modules=("Linear", "LayerNorm")),
     dict(optimizer_cpu_offload=True)),
]


def _config(cls, kwargs, distopt, **extra):
    return dict(optimizer_class=cls, optimizer_kwargs=kwargs, lr=LR, weight_decay=WD, clip_grad=NO_CLIP,
                use_distributed_optimizer=distopt, **extra)


def _reference(cls, kwargs, phases):
    """The class itself on fp32 master weights, Megatron's groups (no decay for biases and 1-D), stepped on
    the global batches of each (dp, steps) phase in turn (a run resharded between them). Returns (master
    weights, the torch optimizer)."""
    from ddp_testing import make_model
    from optim_testing import reference_steps

    master = make_model(dtype=torch.float32)
    decay = [p for n, p in master.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in master.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    inner = cls([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, **kwargs)
    first = 0
    for dp, steps in phases:
        reference_steps(dp, steps, LR, WD, NO_CLIP, first_step=first, master=master, optimizer=inner)
        first += steps
    return master, inner


# ---------------------------------------------------------------------- the probe (one process)
class _Toy(torch.optim.Optimizer):
    """An optimizer with torch's constructor signature (lr, weight_decay) and a step() of the subclass's."""

    def __init__(self, params, lr=1e-2, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))


class _NormalizedSGD(_Toy):
    """Not elementwise: the whole update is scaled to unit norm (what LARS/LAMB-style trust ratios do)."""

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad / p.grad.norm(), alpha=-group["lr"])


class _RowState(_Toy):
    """Elementwise update, but state of its own shape (one value per row): a flat shard cannot hold it."""

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["seen"] = torch.zeros(2)
                p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("cls, kwargs", CLASSES, ids=[c.__name__ for c, _ in CLASSES])
def test_probe_accepts_the_eight_and_finds_their_state(cls, kwargs):
    from megatron_lite import OptimizerConfig
    from megatron_lite.optimizer import optimizer_kind

    kind = optimizer_kind(OptimizerConfig(optimizer_class=cls, optimizer_kwargs=kwargs))
    assert kind.name == f"torch.optim.{cls.__module__.rsplit('.', 1)[1]}.{cls.__name__}"
    expected = {  # what torch 2.13 keeps per parameter, found without a table
        "Adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), "AdamW": ("exp_avg", "exp_avg_sq"),
        "SGD": ("momentum_buffer",), "Adagrad": ("sum",), "RMSprop": ("square_avg", "momentum_buffer", "grad_avg"),
        "Adamax": ("exp_avg", "exp_inf"), "NAdam": ("exp_avg", "exp_avg_sq"), "RAdam": ("exp_avg", "exp_avg_sq"),
    }[cls.__name__]
    assert set(kind.tensor_keys) == set(expected)
    assert kind.scalar_keys == (("mu_product",) if cls is torch.optim.NAdam else ())
    assert kind.keeps_step == (cls is not torch.optim.SGD)
    assert (kind.initial_state is not None) == (cls is torch.optim.Adagrad)  # made by its constructor


@pytest.mark.parametrize("cls, message", [
    (_NormalizedSGD, "is not elementwise: flat pieces of a parameter stepped apart"),
    (_RowState, "is not elementwise: its state 'seen' has shape (2,)"),
    (getattr(torch.optim, "Muon", None), "is not elementwise: it cannot be built on a flat piece"),
], ids=["normalized", "row_state", "muon"])
def test_probe_refuses_an_optimizer_that_is_not_elementwise(cls, message):
    """Would catch a class accepted without looking: sharded, a normalized update uses each rank's norm."""
    from megatron_lite import OptimizerConfig

    if cls is None:
        pytest.skip("torch.optim.Muon is not in this torch")
    with pytest.raises(ValueError, match="OptimizerConfig.optimizer_class .*" + re.escape(message)) as error:
        OptimizerConfig(optimizer_class=cls, weight_decay=0.0)
    assert cls.__name__ in str(error.value) and "use one of those" in str(error.value)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(optimizer_class=torch.optim.NAdam, optimizer_kwargs={"lr": 1.0}), ValueError, "must not hold 'lr'"),
    (dict(optimizer_class=torch.optim.NAdam, optimizer_kwargs={"weight_decay": 1.0}), ValueError,
     "set OptimizerConfig.weight_decay"),
    (dict(optimizer_class=torch.optim.NAdam, optimizer="sgd"), ValueError, "both name the optimizer"),
    (dict(optimizer_kwargs={"momentum": 0.9}), ValueError, "optimizer_kwargs is for optimizer_class"),
    (dict(optimizer_class="NAdam"), TypeError, "must be a torch.optim.Optimizer subclass"),
    (dict(optimizer_class=torch.optim.NAdam, optimizer_kwargs={"betas": 0.9}), ValueError, "cannot be built"),
    (dict(optimizer_class=_NormalizedSGD, weight_decay=0.0, optimizer_kwargs={"momentum": 0.9}), ValueError,
     "cannot be built"),
], ids=["lr", "weight_decay", "two_names", "kwargs_alone", "not_a_class", "bad_kwargs", "unknown_kwarg"])
def test_optimizer_class_errors_name_the_field(kwargs, error, message):
    from megatron_lite import OptimizerConfig

    with pytest.raises(error, match=message):
        OptimizerConfig(**kwargs)


@pytest.mark.parametrize("kernel", [{"capturable": True}, {"foreach": False}, {"differentiable": False}],
                         ids=["capturable", "foreach", "differentiable"])
def test_kernel_options_are_taken_not_probed(kernel):
    """Would catch the probe stepping a kernel option that needs an accelerator (capturable=True wants CUDA
    tensors; the probe's are on the CPU): NAdam refused as 'not elementwise' for a valid CUDA setting. The
    class must still take the option: a kernel option it does not know is refused."""
    from megatron_lite import OptimizerConfig
    from megatron_lite.optimizer import optimizer_kind

    for cls in (torch.optim.AdamW, torch.optim.NAdam):
        kind = optimizer_kind(OptimizerConfig(optimizer_class=cls, optimizer_kwargs=kernel))
        assert dict(kind.kwargs) == kernel  # built with it: the probe steps without it
    with pytest.raises(ValueError, match="cannot be built with optimizer_kwargs .*'fused'"):
        OptimizerConfig(optimizer_class=torch.optim.NAdam, optimizer_kwargs={"fused": True})


def test_a_class_without_weight_decay_needs_weight_decay_zero():
    """Would catch weight decay silently dropped by a class that takes none."""
    from megatron_lite import OptimizerConfig

    class Plain(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-2):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad, alpha=-group["lr"])

    with pytest.raises(ValueError, match="takes no weight_decay.*set weight_decay=0.0"):
        OptimizerConfig(optimizer_class=Plain)
    OptimizerConfig(optimizer_class=Plain, weight_decay=0.0)


# ---------------------------------------------------------------------- dp=2: the eight at every strategy
def _equivalence_worker():
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    rank, dp = dist.get_rank(), dist.get_world_size()
    failures = []
    for cls, kwargs in CLASSES:
        master = _reference(cls, kwargs, [(dp, STEPS)])[0]
        for ddp_config, extra in STRATEGIES:
            model, ddp, opt = build(ddp_config, _config(cls, kwargs, ddp_config["use_distributed_optimizer"],
                                                        **extra))
            assert all(ok for ok, _ in megatron_steps(ddp, opt, rank, dp, STEPS))
            ddp.finish_param_sync()
            with ddp.full_parameters():
                for (name, p), q in zip(model.named_parameters(), master.parameters()):
                    if not torch.equal(p.detach(), q.detach()):
                        diff = (p.detach() - q.detach()).abs().max().item()
                        failures.append((cls.__name__, ddp_config.get("data_parallel_sharding_strategy"),
                                         extra, name, diff))
    return failures


def test_each_elementwise_optimizer_matches_its_torch_class_at_every_strategy():
    """dp=2, fp32, no clipping: no_shard, ZeRO-1, ZeRO-2, ZeRO-3 and ZeRO-1 with CPU offload, for each of the
    eight, bitwise equal to the torch.optim class on the global batch. Would catch a state key lost or
    shared between shards, a hyperparameter not handed to the class, kernel options forced on it, and
    a parameter range stepped by the wrong rank."""
    for failures in run_distributed(_equivalence_worker, 2, timeout=600):
        assert not failures, failures[:5]


# ---------------------------------------------------------------------- dp=2: resume in both formats
RESUMED = [(torch.optim.NAdam, {}), (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}),
           (torch.optim.Adagrad, {})]


def _resume_worker(root):
    import torch.distributed as dist
    from optim_testing import build, full_state, megatron_steps, states_equal

    from megatron_lite import checkpointing
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank, dp = dist.get_rank(), dist.get_world_size()
    failures = []
    for cls, kwargs in RESUMED:
        for fmt in ("torch", "torch_dist"):
            for ddp_config, _ in STRATEGIES[1:4:2]:  # ZeRO-1 and ZeRO-3
                where = os.path.join(root, f"{cls.__name__}_{fmt}_{ddp_config.get('data_parallel_sharding_strategy')}")

                def built():
                    model, ddp, opt = build(ddp_config, _config(cls, kwargs, True))
                    return model, ddp, opt, OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")

                model, ddp, opt, sched = built()
                megatron_steps(ddp, opt, rank, dp, 2)
                checkpointing.save_checkpoint(where, 2, ddp, opt, sched, 16, ckpt_format=fmt)
                megatron_steps(ddp, opt, rank, dp, 2, first_step=2)
                straight = full_state(opt)
                model, ddp, opt, sched = built()
                checkpointing.load_checkpoint(where, ddp, opt, sched)
                megatron_steps(ddp, opt, rank, dp, 2, first_step=2)
                resumed = full_state(opt)
                if not states_equal(straight, resumed):
                    failures.append((cls.__name__, fmt, ddp_config.get("data_parallel_sharding_strategy")))
    return failures


def test_resume_is_bit_exact_in_both_formats(tmp_path):
    """NAdam (its per-parameter mu_product), RMSprop centered with momentum (three moments) and Adagrad
    (state made by its constructor), ZeRO-1 and ZeRO-3, saved after 2 steps and resumed for 2: every main
    param, moment and scalar equal to the run that went straight on. Would catch mu_product or a moment
    left out of a format, a scalar restored as another parameter's, and the step count lost."""
    for failures in run_distributed(_resume_worker, 2, str(tmp_path), timeout=600):
        assert not failures, failures


# ---------------------------------------------------------------------- reshard: dp=2 ZeRO-1 -> other dp and strategy
ZERO1, ZERO3, NO_SHARD = STRATEGIES[1][0], STRATEGIES[3][0], STRATEGIES[0][0]
RESHARD_TARGETS = {"dp2-zero3": (2, ZERO3), "dp2-no_shard": (2, NO_SHARD), "dp4-zero1": (4, ZERO1),
                   "dp4-zero3": (4, ZERO3), "dp4-no_shard": (4, NO_SHARD)}


def _reshard_save_worker(root):
    """dp=2 ZeRO-1: two steps of each class in RESUMED, saved in both formats."""
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    from megatron_lite import checkpointing
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank, dp = dist.get_rank(), dist.get_world_size()
    for cls, kwargs in RESUMED:
        model, ddp, opt = build(ZERO1, _config(cls, kwargs, True))
        sched = OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")
        megatron_steps(ddp, opt, rank, dp, 2)
        for fmt in ("torch", "torch_dist"):
            checkpointing.save_checkpoint(os.path.join(root, f"{cls.__name__}_{fmt}"), 2, ddp, opt, sched, 16,
                                          ckpt_format=fmt)


def _reshard_load_worker(root, target):
    """The checkpoints of _reshard_save_worker loaded at RESHARD_TARGETS[target], two more steps: the largest
    relative difference of the parameters and of each state entry from the torch class's (2 steps at dp=2, then 2 at
    this dp), by class and format."""
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    from megatron_lite import checkpointing
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank, dp = dist.get_rank(), dist.get_world_size()
    ddp_config = RESHARD_TARGETS[target][1]
    out = {}
    for cls, kwargs in RESUMED:
        master, reference = _reference(cls, kwargs, [(2, 2), (dp, 2)])
        expected = {name: {"param": q.detach(), **reference.state[q]} for name, q in master.named_parameters()}
        for fmt in ("torch", "torch_dist"):
            model, ddp, opt = build(ddp_config, _config(cls, kwargs, ddp_config["use_distributed_optimizer"]))
            sched = OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")
            loaded = checkpointing.load_checkpoint(os.path.join(root, f"{cls.__name__}_{fmt}"), ddp, opt, sched)
            assert loaded["iteration"] == 2
            megatron_steps(ddp, opt, rank, dp, 2, first_step=2)
            ddp.finish_param_sync()
            with ddp.full_parameters():
                diffs = {"weights": max(_relative(p.detach(), q.detach())
                                        for p, q in zip(model.parameters(), master.parameters()))}
            for name, entry in opt.state_dict()["state"].items():  # full tensors, also for the sharded ones
                for key, value in entry.items():
                    if torch.is_tensor(value):  # a scalar (NAdam's mu_product) rides as a tensor of the param's shape
                        want = expected[name][key].float().expand_as(value)
                        diffs[key] = max(diffs.get(key, 0.0), _relative(value, want))
                missing = {k for k, v in expected[name].items() if k != "step" and v.dim()} - set(entry)
                assert not missing, (name, missing)
            out[cls.__name__, fmt] = diffs
    return out


def _relative(value, want):
    return ((value - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def saved_at_dp2_zero1(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    run_distributed(_reshard_save_worker, 2, root, timeout=300)
    return root


@pytest.mark.parametrize("target", list(RESHARD_TARGETS))
def test_a_checkpoint_reshards_to_another_size_and_strategy(saved_at_dp2_zero1, target):
    """NAdam (mu_product), RMSprop centered with momentum and Adagrad (its constructor state), saved at dp=2
    ZeRO-1 after 2 steps in both formats, resumed at dp=2 ZeRO-3 / no_shard and dp=4 ZeRO-1 / ZeRO-3 /
    no_shard for 2 more: weights and every state entry equal to the torch class's on the same global
    batches (2 steps at dp=2, then 2 at the new dp), bit for bit. Would catch a shard of a moment or of
    mu_product read at the old layout's offsets, Adagrad's 'sum' rebuilt from its constructor value instead
    of loaded, the step count lost in the reshard, or a scalar restored as another parameter's."""
    dp = RESHARD_TARGETS[target][0]
    # gloo's all-reduce over 4 ranks adds the ranks' gradients in another order than the reference's (its
    # reduce-scatter, the distributed optimizer's, in the same): no_shard at dp=4 within fp32 rounding.
    bound = 1e-6 if target == "dp4-no_shard" else 0.0
    for per_rank in run_distributed(_reshard_load_worker, dp, saved_at_dp2_zero1, target, timeout=300):
        for (name, fmt), diffs in per_rank.items():
            pass
            assert all(d <= bound for d in diffs.values()), (name, fmt, diffs)


# ---------------------------------------------------------------------- dp=4, R=2: replicas and last words
REPLICA_CONFIGS = {  # dp=4, two distributed-optimizer instances: (DDP config, OptimizerConfig extras)
    "zero1": (dict(ZERO1, bucket_size=40, num_distributed_optimizer_instances=2), {}),
    "zero1-offload": (dict(ZERO1, bucket_size=40, num_distributed_optimizer_instances=2),
                      dict(optimizer_cpu_offload=True)),
    "zero3-offload": (dict(ZERO3, num_distributed_optimizer_instances=2), dict(optimizer_cpu_offload=True)),
}


def _replicas_worker(root, config):
    import torch.distributed as dist
    from optim_testing import build, full_state, megatron_steps, states_equal

    from megatron_lite import checkpointing
    from megatron_lite.checkpointing import last_words
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank, dp = dist.get_rank(), dist.get_world_size()
    ddp_config, extra = REPLICA_CONFIGS[config]
    out = {}
    for cls, kwargs in RESUMED[:2]:
        def built(extra=extra):
            model, ddp, opt = build(ddp_config, _config(cls, kwargs, True, **extra))
            return model, ddp, opt, OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")

        master = _reference(cls, kwargs, [(dp, STEPS)])[0]
        model, ddp, opt, _ = built()
        megatron_steps(ddp, opt, rank, dp, STEPS)
        straight = full_state(opt)  # after STEPS steps, uninterrupted
        ddp.finish_param_sync()
        # R=2 sums a gradient in another order (reduce-scatter over 2 ranks, all-reduce over 2): fp32 bound.
        with ddp.full_parameters():
            worst = max(((p - q).abs().max() / q.abs().max()).item()
                        for p, q in zip(model.parameters(), master.parameters()))
        # Offloaded, the same class steps the same shards on the host: bitwise the run that keeps them in place.
        _, ddp, opt, _ = built(extra={})
        megatron_steps(ddp, opt, rank, dp, STEPS)
        as_in_place = states_equal(full_state(opt), straight)

        # A wiped shard on rank 1 (main params and state, and the model's own range: a new process's) rebuilt
        # from its replica (rank 3) after step 1; then the rest of the steps.
        model, ddp, opt, sched = built()
        megatron_steps(ddp, opt, rank, dp, 1)
        if rank == 1:
            for s, shard in zip(opt.shards, opt.shard_state.main_shards):
                shard.main.data.fill_(float("nan"))
                s.params.fill_(float("nan"))
                opt.optimizer.state.pop(shard.main, None)
            opt.recv_shard_state(src=3)
        elif rank == 3:
            opt.send_shard_state(dst=1)
        megatron_steps(ddp, opt, rank, dp, STEPS - 1, first_step=1)
        rebuilt = states_equal(full_state(opt), straight)

        # Last words after step 1 (written as a failing step would), loaded by a fresh run that goes on.
        where = os.path.join(root, cls.__name__)
        model, ddp, opt, sched = built()
        words = last_words.LastWords(where, opt, sched, 0, 0)
        words.stage(1, 16)
        megatron_steps(ddp, opt, rank, dp, 1)
        sched.step()
        words.commit()
        written = words.write("test: after iteration 1") is not None
        dist.barrier()
        model, ddp, opt, sched = built()
        loaded = checkpointing.load_checkpoint(where, ddp, opt, sched)
        megatron_steps(ddp, opt, rank, dp, STEPS - 1, first_step=1)
        out[cls.__name__] = dict(worst=worst, as_in_place=as_in_place, rebuilt=rebuilt, written=written,
                                 from_words=bool(loaded.get("last_words")),
                                 resumed=states_equal(full_state(opt), straight))
    return out


@pytest.mark.parametrize("config", list(REPLICA_CONFIGS))
def test_replicas_and_last_words_carry_every_state(tmp_path, config):
    """dp=4 with two distributed-optimizer instances (ZeRO-1; ZeRO-1 and ZeRO-3 with CPU offload), NAdam and
    RMSprop (centered, momentum): the result within an fp32 bound of the torch class (and, offloaded,
    bitwise the run without offload), a shard wiped on one rank rebuilt from its replica, and last words
    loaded by a fresh run, both continuing bitwise as the uninterrupted run. Would catch mu_product or a
    moment left out of the replica transfer or the last words, or left on the device's side of an
    offloaded shard."""
    for per_rank in run_distributed(_replicas_worker, 4, str(tmp_path), config, timeout=600):
        for name, r in per_rank.items():
            assert r["worst"] <= 1e-6, (name, r)
            assert r["as_in_place"] and r["rebuilt"] and r["written"] and r["from_words"] and r["resumed"], (name, r)


TAKEN_FROM_CHECKPOINT = {  # saved with, resumed with (hyperparameters='checkpoint'): whether it must be refused
    "centered_on": (torch.optim.RMSprop, {"centered": True}, {"centered": False}, True),
    "centered_off": (torch.optim.RMSprop, {"centered": False}, {"centered": True}, True),
    "amsgrad_on": (torch.optim.Adam, {"amsgrad": True}, {}, True),
    "alpha": (torch.optim.RMSprop, {"alpha": 0.9}, {"alpha": 0.99}, False),
}


def _taken_from_checkpoint_worker(root):
    import torch.distributed as dist
    from optim_testing import build, megatron_steps

    from megatron_lite import checkpointing
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    rank, dp = dist.get_rank(), dist.get_world_size()
    out = {}
    for case, (cls, saved_with, resumed_with, _) in TAKEN_FROM_CHECKPOINT.items():
        def built(kwargs):
            model, ddp, opt = build(ZERO1, _config(cls, kwargs, True))
            return ddp, opt, OptimizerParamScheduler(opt, LR, 0.0, 0, 10, "constant")

        where = os.path.join(root, case)
        ddp, opt, sched = built(saved_with)
        megatron_steps(ddp, opt, rank, dp, 1)
        checkpointing.save_checkpoint(where, 1, ddp, opt, sched, 16, ckpt_format="torch_dist")
        ddp, opt, sched = built(resumed_with)
        try:
            checkpointing.load_checkpoint(where, ddp, opt, sched, hyperparameters="checkpoint")
            megatron_steps(ddp, opt, rank, dp, 1, first_step=1)
            out[case] = {k: opt.param_groups[0][k] for k in saved_with}
        except ValueError as error:
            out[case] = str(error)
    return out


def test_a_hyperparameter_taken_from_the_checkpoint_must_not_change_the_state(tmp_path):
    """hyperparameters='checkpoint' (--use-checkpoint-opt_param-scheduler) may take a checkpoint's value that
    changes what the class keeps (RMSprop's centered: grad_avg; Adam's amsgrad: max_exp_avg_sq): refused on
    every rank, naming the values and --optimizer-kwargs, instead of a KeyError at the next step (or a state
    the probe never saw, saved without it). A value that changes no state (RMSprop's alpha) is taken."""
    for per_rank in run_distributed(_taken_from_checkpoint_worker, 2, str(tmp_path)):
        for case, (_, saved_with, _, refused) in TAKEN_FROM_CHECKPOINT.items():
            got = per_rank[case]
            if refused:
                assert isinstance(got, str) and "change the state" in got and "--optimizer-kwargs" in got, (case, got)
                assert all(repr(key) in got for key in saved_with), (case, got)
            else:
                assert got == saved_with, (case, got)


SQUARES = {torch.optim.Adam: ("exp_avg_sq", "max_exp_avg_sq"), torch.optim.RMSprop: ("square_avg",),
           torch.optim.Adagrad: ("sum",), torch.optim.Adamax: ("exp_inf",)}
SQUARES_KWARGS = {torch.optim.Adam: {"amsgrad": True}, torch.optim.RMSprop: {"centered": True}}


def _negative_replica_worker():
    """dp=4, R=2: after one step rank 3 (rank 1's replica) sends its state with one element of each moment of
    squares negated; rank 1 must refuse it and keep its own."""
    import torch.distributed as dist
    from optim_testing import build, full_state, megatron_steps, states_equal

    rank, dp = dist.get_rank(), dist.get_world_size()
    out = {}
    for cls, keys in SQUARES.items():
        _, ddp, opt = build(dict(use_distributed_optimizer=True, bucket_size=40, num_distributed_optimizer_instances=2),
                            _config(cls, SQUARES_KWARGS.get(cls, {}), True))
        megatron_steps(ddp, opt, rank, dp, 1)
        before, error = full_state(opt), None
        if rank == 3:
            for shard in opt.shard_state.main_shards:
                for key in keys:
                    opt.optimizer.state[shard.main][key].view(-1)[0] = -1.0
            opt.send_shard_state(dst=1)
        elif rank == 1:
            try:
                opt.recv_shard_state(src=3)
            except ValueError as e:
                error = str(e)
        out[cls.__name__] = dict(error=error, kept=states_equal(full_state(opt), before))
    return out


def test_a_replica_with_a_negative_moment_of_squares_is_refused():
    """Would catch the receive check looking at Adam's exp_avg_sq alone: a damaged RMSprop square_avg,
    Adagrad sum, Adamax exp_inf or amsgrad max_exp_avg_sq restored (its square root: NaN parameters). The
    signed moments (exp_avg, grad_avg, momentum_buffer) are not checked: they are negative in every transfer."""
    from megatron_lite import OptimizerConfig
    from megatron_lite.optimizer import optimizer_kind

    for cls, keys in SQUARES.items():
        kind = optimizer_kind(OptimizerConfig(optimizer_class=cls, optimizer_kwargs=SQUARES_KWARGS.get(cls)))
        assert set(kind.nonnegative_keys) == set(keys), cls
    results = run_distributed(_negative_replica_worker, 4, timeout=300)
    assert all(results[1][cls.__name__]["error"] for cls in SQUARES), results[1]
    for cls, keys in SQUARES.items():
        got = results[1][cls.__name__]
        assert "recv_shard_state(src=3)" in got["error"] and keys[0] in got["error"] and got["kept"], (cls, got)


# ---------------------------------------------------------------------- a parameter that never stepped
def _never_stepped_worker(resume, optimizer):
    """Head 1 unused at steps 0-2 (no state at the checkpoint), a round trip before step 3, then used: the
    parameters against torch's class on torch DDP after each step."""
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

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TwoHeads()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        use_distributed_optimizer=True, find_unused_parameters=True, overlap_grad_reduce=True, bucket_size=30))
    kind = (dict(optimizer="sgd", sgd_momentum=0.9) if optimizer == "sgd" else
            dict(optimizer_class=torch.optim.SGD, optimizer_kwargs=dict(momentum=0.9, dampening=0.5)))
    decay = [p for n, p in reference.named_parameters() if not n.endswith(".bias")]
    no_decay = [p for n, p in reference.named_parameters() if n.endswith(".bias")]
    torch_opt = torch.optim.SGD([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-2, momentum=0.9, dampening=0.0 if optimizer == "sgd" else 0.5)

    def built():
        return get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0,
                                                      use_distributed_optimizer=True, **kind), ddp)

    return heads_side_by_side(ddp, built, reference, torch_opt, "never_stepped", resume, rank)[0]


@pytest.mark.parametrize("optimizer", ["sgd", "sgd_dampening"])
@pytest.mark.parametrize("resume", ["torch", "shards"])
def test_a_parameter_that_never_stepped_resumes_like_torch(resume, optimizer):
    """SGD keeps no 'step', and its first step starts the momentum from the gradient, (1 - dampening) x the
    gradient from a zero buffer: a parameter no rank used before the checkpoint must come back without a
    buffer. Would catch its zeros restored as a buffer (dampening=0.5 diverged after the resume; --optimizer
    sgd, dampening 0, is bitwise either way)."""
    for diffs in run_distributed(_never_stepped_worker, 2, resume, optimizer):
        assert diffs == [0.0] * 5, diffs


def _inner_worker():
    from ddp_testing import make_model

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    out = {}
    for name, kind in [("adam", {}), ("sgd", dict(optimizer="sgd")), ("offload", dict(optimizer_cpu_offload=True)),
                       ("NAdam", dict(optimizer_class=torch.optim.NAdam))]:
        ddp = DistributedDataParallel(make_model(), DistributedDataParallelConfig(use_distributed_optimizer=True))
        inner = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1, use_distributed_optimizer=True,
                                                       **kind), ddp).optimizer
        out[name] = (type(inner).__name__, inner.defaults["weight_decay"], inner.defaults.get("foreach"),
                     inner.defaults.get("fused"))
    return out


def test_the_inner_optimizer_is_built_as_before_optimizer_class():
    """--optimizer adam / sgd build the inner optimizer as they did before optimizer_class existed: the class,
    its kernel (foreach on CPU, fused for CPU offload) and weight_decay as its default too. Would catch the
    default left at torch's (AdamW 0.01, SGD 0): a param group added later would get it."""
    got = run_distributed(_inner_worker, 1)[0]
    assert got == {"adam": ("AdamW", 0.1, True, None), "sgd": ("SGD", 0.1, True, None),
                   "offload": ("AdamW", 0.1, None, True), "NAdam": ("NAdam", 0.1, None, None)}, got
