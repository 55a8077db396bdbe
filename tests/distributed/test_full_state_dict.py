"""Exporting a ZeRO-3 model's full state dict unit by unit (full_state_dict.py,
DistributedDataParallel.iter_full_state_dict and state_dict): the same entries, in the same order and bitwise,
as `module.state_dict()` with every unit gathered, while never more than one unit is gathered at a time."""

import pytest
import torch
from distributed_helper import run_distributed

MODELS = ("gpt_tied", "gpt_untied", "tied_lm", "resnet_bn", "lora_frozen_base")
SETTINGS = ({}, dict(param_persistence_threshold=17), dict(prefetch_bucket_size=0))


def _build(name):
    """(model, a batch, ZeRO-3's fsdp_unit_modules) for one of MODELS, on the same seed on every rank."""
    import third_party_models as tpm

    from megatron_lite.models import GPTConfig, GPTModel

    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    if name.startswith("gpt"):
        model = GPTModel(GPTConfig(num_layers=3, hidden_size=16, num_attention_heads=2, vocab_size=32,
                                   max_position_embeddings=8, share_embeddings_and_output_weights=name == "gpt_tied"))
        return model, (tokens,), ("TransformerLayer",)
    if name == "tied_lm":
        return tpm.TiedLM(), (tokens,), None
    if name == "resnet_bn":
        return tpm.tiny_resnet(), (torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1)),), \
            ("BasicBlock",)
    return tpm.lora_mlp(), (torch.randn(4, 6, generator=torch.Generator().manual_seed(1)),), None


def _export_worker(name, settings):
    """Per setting, after one training step: the gathered-all state dict (module.state_dict() inside
    full_parameters()), iter_full_state_dict's items (default and rank0_only) and state_dict(), each with the
    most units (not the root's, not the persistent buckets) holding gathered storage at any all-gather issued
    while it was read, and the gathers issued."""
    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )
    from megatron_lite.distributed import collectives

    results = []
    for setting in settings:
        model, batch, unit_modules = _build(name)
        ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True, bucket_size=200,
            fsdp_unit_modules=unit_modules, **setting))
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [ddp])
        ddp.zero_grad_buffer()
        ddp(*[x * (1 + dist.get_rank()) if x.is_floating_point() else x for x in batch]).float().pow(2).mean() \
            .backward()
        ddp.finish_grad_sync()
        opt.step()
        units = ddp.param_sync
        unit_buckets = [units.buckets.get(i, []) for i in range(len(units.units))]

        def observed(read):
            """read() with every all-gather counted: the most units allocated at one, and how many."""
            most, gathers = [0], [0]

            def count(op, tensor, size):
                if op == "all_gather":
                    gathers[0] += 1
                    most[0] = max(most[0], sum(any(b.param_data.untyped_storage().nbytes() for b in buckets)
                                               for buckets in unit_buckets))
            with collectives.observe(count):
                value = read()
            return value, most[0], gathers[0]

        def gathered_all():
            with ddp.full_parameters():
                return [(k, v.clone()) for k, v in model.state_dict().items()]

        reference, most_all, _ = observed(gathered_all)
        streamed, most_streamed, gathers = observed(lambda: list(ddp.iter_full_state_dict()))
        rank0, most_rank0, _ = observed(lambda: list(ddp.iter_full_state_dict(rank0_only=True)))
        state, most_state, _ = observed(ddp.state_dict)
        released = all(not b.params_gathered for buckets in unit_buckets for b in buckets) and \
            all(not b.params_gathered for b in units.root)
        results.append(dict(
            reference=reference, streamed=streamed, rank0=rank0, state=list(state.items()),
            most=dict(all=most_all, streamed=most_streamed, rank0=most_rank0, state=most_state),
            gathers=gathers, unit_gathers=sum(map(len, unit_buckets)), units=len(units.units), released=released,
            root_gathers=len(units.root), devices={str(v.device) for _, v in streamed}))
    return results


def _same(a, b):
    """Same keys in the same order, bitwise equal tensors (NaN placeholders would not compare equal)."""
    return [k for k, _ in a] == [k for k, _ in b] and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


@pytest.mark.parametrize("name", MODELS)
def test_streamed_export_is_the_gathered_state_dict_one_unit_at_a_time(name):
    """Would catch a streamed export that gathers more than one unit at a time (gather_all, a unit not released
    before the next is gathered, a prefetch), that differs from the gathered-all state dict (a value read before
    its unit's gather or after its release: NaN placeholders or another unit's values; a key missing, e.g. the
    second name of a tied weight, a buffer or a frozen parameter; another order), a rank0_only that gives
    entries to other ranks or skips their gathers (a hang), or units left gathered after the export: for the
    tied and untied GPT, a tied third-party LM, a BatchNorm CNN (buffers inside the units) and a frozen base,
    with the default tunables, persistent small parameters and no prefetch."""
    for rank, results in enumerate(run_distributed(_export_worker, 2, name, SETTINGS)):
        for setting, r in zip(SETTINGS, results):
            where = f"rank {rank} {setting}"
            assert r["units"] >= 2 and r["most"]["all"] == r["units"], where  # the instrument sees gathers
            assert _same(r["streamed"], r["reference"]), where
            assert _same(r["state"], r["reference"]), where
            assert r["devices"] == {"cpu"}, where
            assert r["most"]["streamed"] == r["most"]["state"] == r["most"]["rank0"] == 1, (where, r["most"])
            # each unit's buckets once (their keys are consecutive), the root's once; persistent ones stay whole
            assert r["gathers"] == r["unit_gathers"] + r["root_gathers"], where
            assert _same(r["rank0"], r["reference"]) if rank == 0 else r["rank0"] == [], where
            assert r["released"], where


def _early_stop_worker():
    """Rank 0 stops iterating after the first entry of the first unit, rank 1 reads everything; then both export
    again. Returns rank 1's first export, the second export and the gathered-all state dict."""
    import torch.distributed as dist

    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    model, _, unit_modules = _build("gpt_untied")
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
        fsdp_unit_modules=unit_modules))
    first = []
    for key, value in ddp.iter_full_state_dict():
        first.append((key, value))
        if dist.get_rank() == 0 and key.startswith("layers.0."):
            break  # the generator is closed here: it issues the gathers left
    again = list(ddp.iter_full_state_dict())
    with ddp.full_parameters():
        reference = [(k, v.clone()) for k, v in model.state_dict().items()]
    return first, again, reference


def test_stopping_early_on_one_rank_leaves_no_rank_waiting():
    """Would catch a consumer that stops iterating on one rank (a break, an exception while writing) leaving the
    other ranks waiting in the gathers it did not issue: a hang, or the next export's gathers paired with the
    rest of the first one's (wrong values or a size mismatch)."""
    (first0, again0, reference0), (first1, again1, reference1) = run_distributed(_early_stop_worker, 2)
    assert first0[-1][0].startswith("layers.0.") and len(first0) < len(reference0)
    assert _same(first1, reference1) and _same(again0, reference0) and _same(again1, reference1)


def _other_strategies_worker(strategy):
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    model, _, _ = _build("resnet_bn")
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy,
                                                                       overlap_grad_reduce=True))
    live = model.state_dict()
    streamed = list(ddp.iter_full_state_dict(rank0_only=True))
    shared = any(v.untyped_storage().data_ptr() == live[k].untyped_storage().data_ptr() for k, v in streamed)
    return list(live.items()), streamed, shared


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_streamed_export_of_whole_parameters_copies_the_state_dict(strategy):
    """Would catch iter_full_state_dict failing or differing where parameters are whole (no ZeRO-3), or yielding
    the live tensors instead of copies (a consumer keeping them would see training change them)."""
    for rank, (live, streamed, shared) in enumerate(run_distributed(_other_strategies_worker, 2, strategy)):
        assert (_same(streamed, live) and not shared) if rank == 0 else streamed == []
