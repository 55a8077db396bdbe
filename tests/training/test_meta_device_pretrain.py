"""pretrain_gpt.py --init-model-with-meta-device: trains, saves and resumes bit for bit like the normal build
(ZeRO-3 on 2 ranks, dropout on, torch_dist checkpoints)."""

import os
import sys

import torch
from distributed_helper import run_distributed
from pretrain_testing import REPO, pretrain_losses, tiny_pretrain_flags

ZERO3 = tiny_pretrain_flags(overlap_grad_reduce=True, ddp_bucket_size="2000", hidden_dropout="0.1",
                            data_parallel_sharding_strategy="optim_grads_params", num_layers="3")


def _checkpoint(save_dir):
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import checkpoint_convert

    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    return checkpoint_convert.read(os.path.join(save_dir, f"iter_{iteration:07d}"))


def test_meta_built_zero3_trains_saves_and_resumes_like_the_normal_build(tmp_path):
    """Would catch a meta-built model that starts from other weights or another generator state (dropout), a
    checkpoint of a meta-built model that differs from the normal one, or a torch_dist resume into a meta-built
    model that is not the normal resume (weights, moments, RNG) bit for bit."""
    normal, meta = str(tmp_path / "normal"), str(tmp_path / "meta")
    first = {how: run_distributed(pretrain_losses, 2, ZERO3 + flags + ["--save", save, "--exit-interval", "3"])[0]
             for how, save, flags in (("normal", normal, []), ("meta", meta, ["--init-model-with-meta-device"]))}
    assert sorted(first["normal"]) == [1, 2, 3] and first["normal"] == first["meta"]
    a, b = _checkpoint(normal), _checkpoint(meta)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["optimizer"]["state"][n]["exp_avg"], b["optimizer"]["state"][n]["exp_avg"])
               for n in a["optimizer"]["state"])
    resumed_normal = run_distributed(pretrain_losses, 2, ZERO3 + ["--save", normal, "--load", normal])[0]
    resumed_meta = run_distributed(pretrain_losses, 2, ZERO3 + ["--init-model-with-meta-device", "--save", meta,
                                                                "--load", meta])[0]
    assert sorted(resumed_normal) == [4, 5, 6] and resumed_normal == resumed_meta
    a, b = _checkpoint(normal), _checkpoint(meta)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
