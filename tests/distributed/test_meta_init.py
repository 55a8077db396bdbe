"""Models built on the meta device (meta_init.py), materialized by DistributedDataParallel (materialize.py):
bit-identical to the normal build under every sharding strategy (GPTModel's own init, torch's reset_parameters,
recorded or by the reset_parameters() contract), the default generator left where the normal build leaves it,
one tensor alive at a time while materializing, and a clear error naming a module without a usable
initializer."""

import pytest
import torch
import torch.nn as nn
from distributed_helper import run_distributed

from megatron_lite.distributed.materialize import MetaMaterializer
from megatron_lite.distributed.meta_init import meta_device_init
from megatron_lite.models import GPTConfig, GPTModel

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def tiny_gpt(**overrides):
    config = dict(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=96, max_position_embeddings=16,
                  hidden_dropout=0.1)
    config.update(overrides)
    return GPTModel(GPTConfig(**config))


def sequential():
    """A model nobody here wrote: torch's own modules and their reset_parameters(), a buffer (BatchNorm)."""
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                         nn.Linear(16, 3))


class PaddedEmbedding(nn.Module):
    """nn.Embedding(padding_idx=0) under a head: its initialization draws the whole table, then zeroes row 0
    (a partial write at offset 0 of the parameter, after the draw)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(12, 6, padding_idx=0)
        self.head = nn.Linear(6, 3)

    def forward(self, x):  # x: _batch's (4, 6) floats, read as token ids (some of them the padding id 0)
        ids = (x.abs() * 4).long().clamp(max=11)
        return self.head(self.embedding(ids).mean(1))


MODELS = {"gpt": (tiny_gpt, ("TransformerLayer",)),
          "gpt_untied_rope": (lambda: tiny_gpt(share_embeddings_and_output_weights=False,
                                               position_embedding_type="rope"), ("TransformerLayer",)),
          "gpt_llama": (lambda: tiny_gpt(normalization="RMSNorm", gated_linear_unit=True, activation_func="silu",
                                         num_query_groups=2, add_bias_linear=False, position_embedding_type="rope",
                                         share_embeddings_and_output_weights=False), ("TransformerLayer",)),
          "sequential": (sequential, ("Linear",)),
          "padded_embedding": (PaddedEmbedding, ("Embedding", "Linear"))}


def build(kind, how):
    """`how`: 'normal', 'recorded' (inside meta_device_init) or 'plain' (under torch.device('meta'))."""
    make = MODELS[kind][0]
    torch.manual_seed(1234)
    if how == "normal":
        return make()
    if how == "recorded":
        with meta_device_init():
            model = make()
        torch.rand(3)  # a draw before wrapping: the replay starts from the state recorded at the build anyway
        return model
    with torch.device("meta"):
        return make()


def _batch(kind, rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    if kind.startswith("gpt"):
        tokens = torch.randint(0, 96, (2, 16), generator=gen)
        return (tokens, torch.roll(tokens, -1, 1))
    return torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)


def _loss(kind, ddp, batch):
    if kind.startswith("gpt"):
        return ddp(batch[0], labels=batch[1]).mean()
    x, y = batch
    return ((ddp(x) - y) ** 2).mean()


def _run(kind, how, strategy, steps=2, **config):
    """Wrap, then train `steps` steps: (full parameters and buffers after wrapping, this rank's shards after
    wrapping, the default generator's next draw after wrapping, full parameters after training, losses)."""
    import torch.distributed as dist

    from megatron_lite import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
    )

    model = build(kind, how)
    sharded = strategy != "no_shard"
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, bucket_size=2000,
        use_distributed_optimizer=sharded, fsdp_unit_modules=MODELS[kind][1], **config))
    rng_after_wrap = torch.get_rng_state()
    shards = [b.own_params.clone() if sharded else torch.cat([p.detach().reshape(-1) for p in b.params_list])
              for buffer in ddp.param_and_grad_buffers for b in buffer.buckets]
    with ddp.full_parameters():
        initial = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(not t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=sharded), ddp)
    torch.set_rng_state(rng_after_wrap)
    losses = []
    for step in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = _loss(kind, ddp, _batch(kind, dist.get_rank(), step))
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
    with ddp.full_parameters():
        final = {k: v.clone() for k, v in model.state_dict().items()}
    return initial, shards, rng_after_wrap, final, losses


def _bitwise_worker(kind, how, strategies, **config):
    verdicts = {}
    for strategy in strategies:
        normal, meta = _run(kind, "normal", strategy, **config), _run(kind, how, strategy, **config)
        verdicts[strategy] = {
            "initial": normal[0].keys() == meta[0].keys() and all(torch.equal(normal[0][k], meta[0][k])
                                                                  for k in normal[0]),
            "shards": len(normal[1]) == len(meta[1]) and all(torch.equal(a, b) for a, b in zip(normal[1], meta[1])),
            "rng": torch.equal(normal[2], meta[2]),
            "trained": all(torch.equal(normal[3][k], meta[3][k]) for k in normal[3]),
            "losses": normal[4] == meta[4],
        }
    return verdicts


@pytest.mark.parametrize("kind", ["gpt", "gpt_untied_rope", "sequential"])
def test_meta_built_model_is_bitwise_the_normally_built_one(kind):
    """Would catch: a parameter initialized with other random numbers than the normal build (the replay started
    from another generator state, or in another order, or a value freed before its last op, e.g. GPT's
    _init_weights overwriting nn.Linear's own init, a tied output layer, the BatchNorm buffers), a shard taken
    from the wrong range of a bucket, shard padding left non-zero, or the default generator left elsewhere
    than the normal build leaves it (dropout in training would then differ)."""
    for verdicts in run_distributed(_bitwise_worker, 2, kind, "recorded", STRATEGIES):
        for strategy, verdict in verdicts.items():
            assert all(verdict.values()), (strategy, verdict)


def test_plain_meta_with_reset_parameters_is_bitwise_the_normal_build():
    """torch.device('meta') without meta_device_init: torch's modules reset in registration order (Megatron-FSDP's
    reset_parameters() contract). Would catch modules reset in another order, a module's tensors materialized
    but not reset, or a reset value written into a temporary instead of the shard."""
    for verdicts in run_distributed(_bitwise_worker, 2, "sequential", "plain", ("optim", "optim_grads_params")):
        for strategy, verdict in verdicts.items():
            assert all(verdict.values()), (strategy, verdict)


def test_meta_built_zero3_with_persistent_small_parameters_and_no_prefetch():
    """Would catch initial values that miss the buckets the ZeRO-3 gather settings add: small parameters kept whole in
    a persistent bucket (param_persistence_threshold), or a prefetch window of zero."""
    for verdicts in run_distributed(_bitwise_worker, 2, "gpt", "recorded", ("optim_grads_params",),
                                    param_persistence_threshold=100, prefetch_bucket_size=0):
        assert all(verdicts["optim_grads_params"].values()), verdicts


def test_meta_built_llama_is_bitwise_the_normal_build_under_zero3():
    """The Llama-class GPT (RMSNorm, SwiGLU, grouped-query attention, no linear biases, untied output). Would catch
    a parameter of its modules (nn.RMSNorm, the narrower k/v rows, the doubled fc1) replayed with other random
    numbers or sharded from another range than the normal build's, or the generator left elsewhere after it."""
    for verdicts in run_distributed(_bitwise_worker, 2, "gpt_llama", "recorded", ("optim_grads_params",)):
        assert all(verdicts["optim_grads_params"].values()), verdicts


@pytest.mark.parametrize("how", ["recorded", "plain"])
def test_meta_built_embedding_with_padding_idx_is_bitwise_the_normal_build(how):
    """nn.Embedding(padding_idx=0), built inside meta_device_init or under torch.device('meta') (reset_parameters),
    under every strategy. Would catch a partial in-place write during initialization (the padding row zeroed
    after the draw, at offset 0) replayed into the wrong place or lost: row 0 left random, or written over the
    start of another parameter's range in the bucket."""
    for verdicts in run_distributed(_bitwise_worker, 2, "padded_embedding", how, STRATEGIES):
        for strategy, verdict in verdicts.items():
            assert all(verdict.values()), (strategy, verdict)


class NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))

    def forward(self, x):
        return x @ self.weight


def test_module_without_an_initializer_is_named():
    """Would catch a meta tensor silently left uninitialized (or on the meta device), or an error that does not
    say which module to fix; GPTModel's own _init_weights must not be silently replaced by its submodules'
    reset_parameters() under plain torch.device('meta')."""
    with torch.device("meta"):
        plain = nn.Sequential(nn.Linear(4, 4), NoInit())
    with pytest.raises(ValueError, match=r"1 \(NoInit\) owns meta tensors but has no reset_parameters\(\)"):
        MetaMaterializer(plain)
    with meta_device_init():
        recorded = nn.Sequential(nn.Linear(4, 4), NoInit())
    with pytest.raises(ValueError, match=r"1\.weight \(of NoInit\) never initialized"):
        MetaMaterializer(recorded)
    with torch.device("meta"):
        gpt = tiny_gpt()
    with pytest.raises(ValueError, match=r"GPTModel\) initializes with its own _init_weights\(\)"):
        MetaMaterializer(gpt)


def _error_worker():
    from megatron_lite import DistributedDataParallel, DistributedDataParallelConfig

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), NoInit())
    try:
        DistributedDataParallel(model, DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
            use_distributed_optimizer=True, fsdp_unit_modules=("Linear",)))
    except ValueError as e:
        return str(e), model[0].weight.is_meta
    return None, None


def test_wrapping_a_meta_model_without_initializer_raises_before_allocating():
    """Would catch the colleague's report: wrapping a meta model silently left buffers and parameters on meta."""
    for message, still_meta in run_distributed(_error_worker, 2):
        assert message is not None and "NoInit" in message and still_meta


def test_materializing_holds_one_tensor_at_a_time():
    """Would catch a replay that keeps every tensor until the end (the whole model in memory at once): the
    largest set of storages alive together is the largest single parameter (GPT: nn.Linear's own init is dead
    once _init_weights overwrites it, so it is freed in between)."""
    torch.manual_seed(0)
    with meta_device_init():
        model = tiny_gpt(num_layers=4, hidden_size=64, vocab_size=512)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    materializer = MetaMaterializer(model)
    materializer.placeholders(torch.device("cpu"), whole=lambda t: False)
    seen = []
    materializer.run(lambda t, value: seen.append(value.shape == t.shape))
    assert all(seen) and len(seen) == len(list(model.parameters()))
    assert materializer.peak_live_bytes == largest < total / 4


class NoisyBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("noise", torch.randn(3, device="cpu"))  # explicit device: not on meta


def test_random_draw_off_the_meta_device_is_refused():
    """Would catch a silently different model: a tensor drawn from the default generator on the CPU during the
    meta build takes other numbers than in a normal build (the meta ops before it drew none)."""
    with pytest.raises(ValueError, match="draws from the default generator"):
        with meta_device_init():
            NoisyBuffer()
