"""torch_dist checkpoints reshard: saved at every DP size x sharding strategy, loaded at every other, the
tiny GPT continues with the losses of an uninterrupted run (bit-exact at the same DP size and strategy); the
same for an --optimizer-class (NAdam)."""

import itertools

import pytest
from distributed_helper import run_distributed
from pretrain_testing import pretrain_losses, tiny_pretrain_flags

TINY = tiny_pretrain_flags(micro_batch_size="1", train_iters="4", log_interval="2", overlap_grad_reduce=True,
                           ddp_bucket_size="2000")
CONFIGS = list(itertools.product([1, 2, 4], ["no_shard", "optim", "optim_grads_params"]))


_main = pretrain_losses  # pretrain_gpt.main on each rank: {iteration: lm loss}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    straight = run_distributed(_main, 2, TINY + ["--data-parallel-sharding-strategy", "optim"])[0]
    dirs = {}
    for dp, strategy in CONFIGS:
        dirs[dp, strategy] = str(root / f"{dp}-{strategy}")
        run_distributed(_main, dp, TINY + ["--data-parallel-sharding-strategy", strategy, "--save", dirs[dp, strategy],
                                           "--exit-interval", "2", "--ckpt-format", "torch_dist"])
    return straight, dirs


@pytest.mark.parametrize("source", CONFIGS, ids=[f"from-dp{d}-{s}" for d, s in CONFIGS])
def test_torch_dist_loads_at_every_other_size_and_strategy(saved, source):
    """Would catch a shard written at the wrong offset, a range read twice or never (the ranks' shards of a
    parameter differ between layouts), optimizer moments or ZeRO-3 parameter shards tied to the layout
    that saved them, or a lost step count / schedule / data position."""
    straight, dirs = saved
    for dp, strategy in CONFIGS:
        if (dp, strategy) == source:
            continue
        resumed = run_distributed(_main, dp, TINY + ["--data-parallel-sharding-strategy", strategy,
                                                     "--load", dirs[source]])[0]
        assert sorted(resumed) == [3, 4], (source, dp, strategy)
        for i in (3, 4):
            assert abs(resumed[i] - straight[i]) <= 1e-5 * straight[i], (source, dp, strategy, i)


@pytest.mark.parametrize("saved_with, loaded_with", [(["--bf16"], []), ([], ["--bf16"])],
                         ids=["bf16-to-fp32", "fp32-to-bf16"])
def test_torch_dist_moves_between_bf16_and_fp32(saved, tmp_path, saved_with, loaded_with):
    """fp32 main params and moments are what the checkpoint keeps, so a bf16 run resumes as fp32 and back
    (ZeRO-3 on both sides: the model's shards change dtype). Would catch model tensors loaded without a
    cast, or fp32 state rounded through the model's dtype."""
    straight, _ = saved
    save = str(tmp_path / "ck")
    run_distributed(_main, 2, TINY + saved_with + ["--data-parallel-sharding-strategy", "optim_grads_params", "--save",
                                                   save, "--exit-interval", "2"])
    resumed = run_distributed(_main, 2, TINY + loaded_with + ["--data-parallel-sharding-strategy",
                                                              "optim_grads_params", "--load", save])[0]
    assert sorted(resumed) == [3, 4]
    for i in (3, 4):
        assert abs(resumed[i] - straight[i]) <= 1e-2 * straight[i], (i, resumed[i], straight[i])


CLASS_FLAGS = ["--optimizer-class", "torch.optim.NAdam", "--optimizer-kwargs", '{"momentum_decay": 0.004}']


@pytest.fixture(scope="module")
def saved_with_a_class(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("nadam"))
    flags = TINY + CLASS_FLAGS + ["--data-parallel-sharding-strategy", "optim"]
    straight = run_distributed(_main, 2, flags)[0]
    run_distributed(_main, 2, flags + ["--save", save, "--exit-interval", "2", "--ckpt-format", "torch_dist"])
    return straight, save


@pytest.mark.parametrize("dp, strategy", [(4, "optim_grads_params"), (1, "no_shard")])
def test_an_optimizer_class_reshards(saved_with_a_class, dp, strategy):
    """pretrain_gpt.py --optimizer-class torch.optim.NAdam saved at dp=2 ZeRO-1 resumes at dp=4 ZeRO-3 and at
    one rank without sharding with the losses of the uninterrupted run (the tiny GPT: tied embeddings, every
    kind of parameter). Would catch NAdam's mu_product or moments tied to the layout that saved them
    (tests/optimizer/test_elementwise.py holds the same bitwise against torch on a small model)."""
    straight, save = saved_with_a_class
    resumed = run_distributed(_main, dp, TINY + CLASS_FLAGS + ["--data-parallel-sharding-strategy", strategy,
                                                               "--load", save])[0]
    assert sorted(resumed) == [3, 4], resumed
    for i in (3, 4):
        assert abs(resumed[i] - straight[i]) <= 1e-5 * straight[i], (dp, strategy, i, resumed[i], straight[i])
