"""`pretrain_gpt.py --optimizer muon`: Megatron-LM's --muon-* flags reach OptimizerConfig's muon_* fields, what
this project does not offer is a flag error, and a short run at dp=2 trains, checkpoints and resumes bitwise
at every sharding strategy, moves to another strategy, and survives a killed rank under the supervisor.

The parse-time tests need no process; the runs use the tiny GPT on mock data (tests/support/pretrain_testing.py)
in a pool of 2 gloo ranks, the supervisor runs 4 ranks, one per strategy (tests/support/live_testing.py)."""

import os
import re
import sys

import pytest
import torch
from distributed_helper import run_distributed
from live_testing import FLAGS as LIVE_FLAGS
from live_testing import PROGRESS_BOUNDED, check_exact, run_live, uninterrupted
from pretrain_testing import REPO, flag_error, pretrain_losses, pretrain_outcome, tiny_pretrain_flags

from megatron_lite.training import arguments, parse_args

MUON = tiny_pretrain_flags(optimizer="muon", lr="3e-3", lr_warmup_iters="1")
"""The tiny GPT for 6 iterations with Muon (hidden 32, 2 heads: linear_qkv is 96 x 32, split into three 32 x 32
blocks)."""


# ------------------------------------------------------------------------------------------ parse time
def test_muon_flags_reach_the_config_with_megatrons_defaults():
    """Would catch a --muon-* flag parsed but never mapped onto OptimizerConfig (--muon-no-split-qkv is the
    negative of its field), a default that is not Megatron-LM's CLI's (--muon-momentum 0.9, where megatron-core's
    config says 0.95), or a help text that drifted from the field's docstring."""
    defaults = arguments.optimizer_config_from_args(parse_args(["--optimizer", "muon"], world_size=2))
    assert (defaults.optimizer, defaults.muon_momentum, defaults.muon_nesterov, defaults.muon_split_qkv,
            defaults.muon_scale_mode, defaults.muon_coefficient_type, defaults.muon_num_ns_steps,
            defaults.muon_extra_scale_factor, defaults.muon_scalar_optimizer) == (
        "muon", 0.9, False, True, "spectral", "quintic", 5, 1.0, "adam")
    argv = ["--optimizer", "muon", "--muon-momentum", "0.5", "--muon-nesterov", "--muon-no-split-qkv",
            "--muon-scale-mode", "shape_scaling", "--muon-coefficient-type", "simple", "--muon-num-ns-steps", "7",
            "--muon-extra-scale-factor", "0.2", "--muon-scalar-optimizer", "adam"]
    config = arguments.optimizer_config_from_args(parse_args(argv, world_size=2))
    assert (config.muon_momentum, config.muon_nesterov, config.muon_split_qkv, config.muon_scale_mode,
            config.muon_coefficient_type, config.muon_num_ns_steps, config.muon_extra_scale_factor) == (
        0.5, True, False, "shape_scaling", "simple", 7, 0.2)
    help_text = " ".join(arguments.build_parser().format_help().split())
    docs = arguments.field_docs(type(config))
    for field in arguments.MUON_FLAGS:
        assert docs[field][:40] in help_text, (field, docs[field])
    assert "layer-wise distributed optimizer" in help_text  # what differs from Megatron with the flag


@pytest.mark.parametrize("argv, message", [
    # Megatron-LM's flags that mean nothing here, with or without a value: never silently ignored
    (["--optimizer", "muon", "--muon-fp32-matmul-prec", "medium"], "--muon-fp32-matmul-prec is not offered"),
    (["--optimizer", "muon", "--muon-tp-mode", "duplicated"], "--muon-tp-mode is not offered"),
    (["--optimizer", "muon", "--muon-use-syrk"], "--muon-use-syrk is not offered"),
    # Muon's hyperparameters without Muon: an optimizer that would not read them
    (["--muon-nesterov"], "--muon-nesterov set Muon's hyperparameters, which --optimizer adam does not read"),
    (["--optimizer", "sgd", "--muon-no-split-qkv", "--muon-momentum", "0.5"],
     "--muon-momentum, --muon-no-split-qkv set Muon's hyperparameters, which --optimizer sgd"),
    # ... or beside --optimizer-class, which --optimizer muon cannot join: not "add --optimizer muon"
    (["--optimizer-class", "torch.optim.NAdam", "--muon-nesterov"],
     "--muon-nesterov set Muon's hyperparameters, which --optimizer-class torch.optim.NAdam does not read: drop"),
    # values the config refuses, as flag errors
    (["--optimizer", "muon", "--muon-scalar-optimizer", "lion"], "--muon-scalar-optimizer"),
    (["--optimizer", "muon", "--muon-coefficient-type", "cubic"], "--muon-coefficient-type"),
    (["--optimizer", "muon", "--muon-num-ns-steps", "0"], "--muon-num-ns-steps"),
    (["--optimizer", "muon", "--muon-momentum", "1.5"], "--muon-momentum"),
    (["--optimizer", "muon", "--muon-scale-mode", "rms"], "invalid choice"),
    (["--optimizer", "dist_muon"], "invalid choice"),  # Megatron's deprecated spelling
    (["--optimizer", "muon", "--optimizer-cpu-offload"], "--optimizer-cpu-offload"),
])
def test_muon_misuse_is_a_flag_error(argv, message, capsys):
    """Would catch a Megatron flag whose value we cannot honour accepted and ignored (a user comparing with
    Megatron believes it is in effect), --muon-* given to Adam or SGD and dropped, or a value the config
    refuses surfacing as a traceback after start-up instead of a usage message naming the flag."""
    assert message in flag_error(argv, capsys)


# ------------------------------------------------------------------------------------------ runs at dp=2
STRATEGIES = {
    "no_shard": ["--ckpt-format", "torch"],
    "optim": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
    "optim_grads": ["--data-parallel-sharding-strategy", "optim_grads", "--overlap-grad-reduce",
                    "--ddp-bucket-size", "3000"],
    "optim_grads_params": ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
                           "--init-model-with-meta-device"],
}
"""How each strategy is run: no DDP sharding (the `torch` format), ZeRO-1 with both overlaps, ZeRO-2 with small
buckets (a matrix cut across buckets and ranks), ZeRO-3 built on the meta device."""


def _checkpoint(save_dir, iteration):
    """The checkpoint of `iteration` in `save_dir` in the `torch` format's layout, whichever format wrote it."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import checkpoint_convert

    return checkpoint_convert.read(os.path.join(save_dir, f"iter_{iteration:07d}"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """{strategy: (its 6 iterations' losses, its save directory: checkpoints at 3 and 6)}, each run once, when a
    test first asks."""
    runs = {}

    def run(strategy):
        if strategy not in runs:
            save = str(tmp_path_factory.mktemp(f"straight_{strategy}"))
            losses = run_distributed(pretrain_losses, 2, MUON + STRATEGIES[strategy] + ["--save", save,
                                                                                   "--save-interval", "3"])[0]
            runs[strategy] = losses, save
        return runs[strategy]
    return run


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_muon_trains_and_resumes_bitwise(strategy, straight, tmp_path):
    """6 iterations straight vs 3 + save + load + 3, at dp=2: the same losses and the same final weights and
    optimizer state, bit for bit, and Muon's state where Megatron's rule puts it (a momentum_buffer for every
    2-D weight but the embeddings, AdamW's moments for the rest). Would catch Muon state not checkpointed or
    not restored in a strategy's format, a strategy that silently hands the matrices to AdamW (DeepSpeed's
    ZeRO-3 bug, here with the meta-device build) or steps nothing, or a loss that does not fall."""
    losses, save = straight(strategy)
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1] - 0.05, losses
    resumed = str(tmp_path / "resumed")
    first = run_distributed(pretrain_losses, 2, MUON + STRATEGIES[strategy] + ["--save", resumed,
                                                                                  "--exit-interval", "3"])[0]
    second = run_distributed(pretrain_losses, 2, MUON + STRATEGIES[strategy] + ["--save", resumed,
                                                                                   "--load", resumed])[0]
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]
    assert {**first, **second} == losses
    a, b = _checkpoint(save, 6), _checkpoint(resumed, 6)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys()
    for name, fields in state_a.items():
        assert fields.keys() == state_b[name].keys(), name
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(state_b[name][k])) for k, v in fields.items()), name
        muon = a["model"][name].dim() == 2 and "word_embeddings" not in name and "output_layer" not in name
        assert ("momentum_buffer" in fields, "exp_avg" in fields) == (muon, not muon), (name, sorted(fields))
    # qkv, proj, fc1, fc2 of 2 layers and the learned position embeddings (2-D, not flagged: Megatron's rule)
    assert sum("momentum_buffer" in f for f in state_a.values()) == 9


def test_muon_checkpoint_moves_to_another_strategy(straight, tmp_path):
    """The iteration-3 checkpoint of the run without sharding (`torch` format) resumed under ZeRO-3 (the
    torch_dist format, meta-device build): it continues as ZeRO-3's own straight run does, to float32
    rounding. Would catch Muon's momentum lost, misplaced or refused when the strategy (and with it who owns
    which pieces of a matrix) changes on resume."""
    _, no_shard_save = straight("no_shard")
    zero3_losses, _ = straight("optim_grads_params")
    save = str(tmp_path / "moved")
    os.makedirs(save)
    os.symlink(os.path.join(no_shard_save, "iter_0000003"), os.path.join(save, "iter_0000003"))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    resumed = run_distributed(pretrain_losses, 2, MUON + STRATEGIES["optim_grads_params"] + ["--load", save])[0]
    assert sorted(resumed) == [4, 5, 6]
    for i in (4, 5, 6):
        assert abs(resumed[i] - zero3_losses[i]) <= 1e-5 * zero3_losses[i], (i, resumed[i], zero3_losses[i])


def test_muon_misuse_stops_every_rank():
    """A flag error under torchrun's world of 2: both ranks stop with the message (no rank goes on alone into
    the first collective)."""
    for status, message in run_distributed(pretrain_outcome, 2, MUON + ["--muon-tp-mode", "blockwise"]):
        assert status == "error" and message.startswith("SystemExit: 2"), message


# ------------------------------------------------------------------------------------------ under the supervisor
LIVE_MUON = LIVE_FLAGS + ["--optimizer", "muon"]  # dp=4, R=2, 8 iterations (live_testing.FLAGS)
LIVE_NO_SHARD = list(LIVE_MUON)  # without the distributed optimizer and its 2 instances
LIVE_NO_SHARD.remove("--use-distributed-optimizer")
_at = LIVE_NO_SHARD.index("--num-distributed-optimizer-instances")
del LIVE_NO_SHARD[_at:_at + 2]
LIVE_STRATEGIES = {
    # strategy: (flags, the fault: rank:iteration:phase:started, tests/support/live_worker.py)
    "no_shard": (LIVE_NO_SHARD, "3:2:forward_backward:0"),
    "optim": (LIVE_MUON + ["--overlap-param-gather"], "0:5:update:0"),
    "optim_grads": (LIVE_MUON + ["--data-parallel-sharding-strategy", "optim_grads"], "3:2:forward_backward:0"),
    "optim_grads_params": (LIVE_MUON + ["--data-parallel-sharding-strategy", "optim_grads_params"], "0:5:update:0"),
}
"""dp=4 under the supervisor: no sharding (every rank a replica of every other, R=1), and the three sharded
strategies at R=2 (two instances of 2 ranks, each exchanging its own matrices; ZeRO-1 with both overlaps). One
kill per run: rank 3 in the forward/backward of iteration 2 (its replacement takes Muon's momentum from a
replica), or rank 0 right after its optimizer update of iteration 5 (Muon's momentum and the main params
updated, the parameters not yet gathered: its replica rolls the others forward)."""


@PROGRESS_BOUNDED
@pytest.mark.parametrize("strategy", list(LIVE_STRATEGIES))
def test_muon_survives_a_killed_rank_under_the_supervisor(strategy, tmp_path):
    """The killed rank alone is replaced, live, and the run equals the uninterrupted `torchrun pretrain_gpt.py`
    of the same flags bitwise: every loss, the validation losses and the final checkpoint. Would catch Muon's
    momentum not carried by the replicas into a replacement, a survivor one Muon update ahead or behind, or a
    strategy whose optimizer cannot heal a replacement (a whole-job restart instead)."""
    flags, fault = LIVE_STRATEGIES[strategy]
    reference_dir, live_dir = tmp_path / "reference", tmp_path / "live"
    reference_dir.mkdir()
    live_dir.mkdir()
    reference = uninterrupted(str(reference_dir), flags)
    code, pids, losses, output = run_live(live_dir, fault, flags=flags)
    assert code == 0, output
    rank, _, phase, _ = fault.split(":")
    assert f"killed at {phase}" in output, output
    assert "restarting the whole job" not in output, output
    replaced = re.findall(r"\[supervisor\] generation \d+: replaced (\[.*\])", output)[1:]  # [0]: the start
    assert [r for r in replaced if r != "[]"] == [f"[{rank}]"], output  # "[]": a re-forming
    assert all(len(pids[r]) == 1 + (r == int(rank)) for r in range(4)), output
    check_exact(live_dir, reference, losses, output)
