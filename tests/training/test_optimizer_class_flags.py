"""--optimizer-class / --optimizer-kwargs (training/optimizer_class_arguments.py): any elementwise torch.optim
class from pretrain_gpt.py's command line, onto OptimizerConfig.optimizer_class / optimizer_kwargs; its refusals
as flag errors; a run that checkpoints and resumes bit-exact; and live recovery under the supervisor with a
rank killed, bitwise the uninterrupted torchrun run of the same flags; tools/checkpoint_convert.py on its
checkpoints."""

import json
import re
import subprocess
import sys

import pytest
import torch
from distributed_helper import run_distributed
from live_testing import FLAGS, PROGRESS_BOUNDED, check_exact, run_live, uninterrupted
from pretrain_testing import REPO, flag_error, pretrain_losses, pretrain_outcome, tiny_pretrain_flags

from megatron_lite.training import parse_args
from megatron_lite.training.arguments import build_parser, optimizer_config_from_args

NADAM = ["--optimizer-class", "torch.optim.NAdam", "--optimizer-kwargs",
         json.dumps({"momentum_decay": 0.004, "betas": [0.9, 0.95]})]


# ------------------------------------------------------------------------------------------- the flags
@pytest.mark.parametrize("argv, cls, kwargs", [
    (NADAM, torch.optim.NAdam, {"momentum_decay": 0.004, "betas": (0.9, 0.95)}),
    (["--optimizer-class", "RMSprop", "--optimizer-kwargs", '{"centered": true, "momentum": 0.5}'],
     torch.optim.RMSprop, {"centered": True, "momentum": 0.5}),
    (["--optimizer-class", "torch.optim.Adagrad"], torch.optim.Adagrad, None),
    ([], None, None),
], ids=["nadam", "bare_name", "no_kwargs", "none"])
def test_the_flags_map_onto_the_config(argv, cls, kwargs):
    """Would catch the class or its JSON kwargs not reaching OptimizerConfig (the run silently AdamW), a JSON
    array left a list (torch writes betas as a tuple; a list is not hashable: the probe ran at every build),
    or the tiny preset's --adam-beta2 taken for the user's (refused beside --optimizer-class)."""
    config = optimizer_config_from_args(parse_args(argv, world_size=2))
    assert config.optimizer_class is cls and config.optimizer_kwargs == kwargs
    assert config.optimizer == "adam"


@pytest.mark.parametrize("argv, message", [
    (["--optimizer-class", "torch.optim.NAdma"], "--optimizer-class torch.optim.NAdma: torch.optim has no 'NAdma' "
                                                 "(did you mean NAdam"),
    (["--optimizer-class", "no_such_package.Lion"], "--optimizer-class no_such_package.Lion: cannot import "
                                                    "'no_such_package'"),
    (["--optimizer-class", "torch.optim.lr_scheduler"], "is a module, not a torch.optim.Optimizer subclass"),
    (["--optimizer-class", "torch.optim.Muon"], "--optimizer-class torch.optim.Muon is not elementwise"),
    (["--optimizer-class", "torch.optim.NAdam", "--optimizer", "sgd"],
     "--optimizer sgd and --optimizer-class torch.optim.NAdam both name the optimizer: drop --optimizer"),
    (["--optimizer-class", "NAdam", "--adam-beta1", "0.8"], "--adam-beta1 set the hyperparameters of --optimizer's "
                                                            "named optimizers, which --optimizer-class NAdam replaces"),
    (["--optimizer-class", "NAdam", "--sgd-momentum", "0.5"], "--sgd-momentum set the hyperparameters"),
    (["--optimizer-kwargs", '{"momentum": 0.9}'], "--optimizer-kwargs is for --optimizer-class"),
    (["--optimizer-class", "NAdam", "--optimizer-kwargs", "{momentum_decay: 1}"], "--optimizer-kwargs "
                                                                                  "'{momentum_decay: 1}' is not JSON"),
    (["--optimizer-class", "NAdam", "--optimizer-kwargs", "[0.9]"], "--optimizer-kwargs must be a JSON object"),
    (["--optimizer-class", "NAdam", "--optimizer-kwargs", '{"lr": 1.0}'], "--optimizer-kwargs must not hold 'lr': "
                                                                          "set --lr"),
    (["--optimizer-class", "NAdam", "--optimizer-kwargs", '{"momentum": 0.9}'],
     "--optimizer-class torch.optim.nadam.NAdam cannot be built with --optimizer-kwargs {'momentum': 0.9}"),
], ids=["unknown", "not_importable", "not_a_class", "probe", "with_optimizer_sgd", "adam_flag", "sgd_flag",
        "kwargs_alone", "not_json", "not_an_object", "lr", "unknown_kwarg"])
def test_refusals_are_flag_errors(argv, message, capsys):
    """Each refusal exits 2 with a usage message naming the flags (no traceback, nothing started): an unknown
    or misspelt class, one that cannot be imported, a module, a class the probe finds not elementwise, the
    named optimizer's flags beside the class (not read: silently ignored before), and bad JSON."""
    assert message in flag_error(argv, capsys)


def test_the_muon_flags_beside_the_class_are_refused_but_not_their_defaults(capsys):
    """A --muon-* flag beside --optimizer-class is refused (not read: silently ignored otherwise), while the
    flags' own defaults are not taken for given: --muon-momentum's CLI default is Megatron-LM's 0.9, not the
    config's 0.95, and reading it against the config's refused every --optimizer-class run once the muon
    flags existed."""
    assert "--muon-momentum" in flag_error(["--optimizer-class", "NAdam", "--muon-momentum", "0.8"], capsys)
    assert "--muon-nesterov" in flag_error(["--optimizer-class", "NAdam", "--muon-nesterov"], capsys)
    config = optimizer_config_from_args(parse_args(["--optimizer-class", "NAdam"], world_size=2))
    assert config.optimizer_class is torch.optim.NAdam


def test_help_documents_the_flags():
    text = build_parser().format_help()
    assert "--optimizer-class CLASS" in text and "--optimizer-kwargs JSON" in text
    assert "torch.optim.NAdam" in text and "probe" in text


# ------------------------------------------------------------------------------------------- pretrain_gpt.py
TINY = tiny_pretrain_flags(train_iters="4", log_interval="1", use_distributed_optimizer=True,
                           ddp_bucket_size="2000") + NADAM


def test_a_run_resumes_bit_exact_and_only_with_its_class(tmp_path):
    """dp=2 ZeRO-1, NAdam with JSON kwargs: saved after iteration 2 and resumed, iterations 3-4 bitwise those
    of the run that went straight on (torch_dist; mu_product and the moments in the checkpoint), and the
    checkpoint resumed with another class, or without --optimizer-class, refused naming --optimizer-class.
    Would catch the class dropped on the way (the adam run's losses), or a resume that silently takes
    NAdam's moments into another optimizer."""
    straight = run_distributed(pretrain_losses, 2, TINY)[0]
    run_distributed(pretrain_losses, 2, TINY + ["--save", str(tmp_path), "--exit-interval", "2"])
    resumed = run_distributed(pretrain_losses, 2, TINY + ["--load", str(tmp_path)])[0]
    assert sorted(resumed) == [3, 4] and all(resumed[i] == straight[i] for i in (3, 4)), (resumed, straight)
    adam = run_distributed(pretrain_losses, 2, tiny_pretrain_flags(train_iters="2", log_interval="1",
                                                                   use_distributed_optimizer=True))[0]
    assert adam[2] != straight[2]  # the class is what trained
    other = tiny_pretrain_flags(train_iters="4", log_interval="1", use_distributed_optimizer=True,
                                ddp_bucket_size="2000", load=str(tmp_path))
    for flags in (other, other + ["--optimizer-class", "torch.optim.RAdam"]):
        for outcome, message in run_distributed(pretrain_outcome, 2, flags):
            assert outcome == "error" and "written by optimizer 'torch.optim.nadam.NAdam'" in message, message
            assert "--optimizer-class" in message, message


def test_a_checkpoint_converted_both_ways_resumes_bit_exact(tmp_path):
    """tools/checkpoint_convert.py on a NAdam checkpoint (torch_dist -> torch -> torch_dist): each resumes with
    the losses of the run that went straight on, bit for bit. Would catch the tool keeping Adam's keys only
    (mu_product dropped: a KeyError or other numbers) or the class's name lost (resume refused)."""
    tool = [sys.executable, f"{REPO}/tools/checkpoint_convert.py"]
    straight = run_distributed(pretrain_losses, 2, TINY)[0]
    dist_dir, torch_dir, back_dir = (str(tmp_path / n) for n in ("dist", "torch", "back"))
    run_distributed(pretrain_losses, 2, TINY + ["--save", dist_dir, "--exit-interval", "2", "--ckpt-format",
                                                "torch_dist"])
    for source, target, fmt in ((dist_dir, torch_dir, "torch"), (torch_dir, back_dir, "torch_dist")):
        out = subprocess.run(tool + ["--input", source, "--output", target, "--to", fmt], capture_output=True,
                             text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0, out.stdout + out.stderr
    for directory in (torch_dir, back_dir):
        resumed = run_distributed(pretrain_losses, 2, TINY + ["--load", directory])[0]
        assert sorted(resumed) == [3, 4] and all(resumed[i] == straight[i] for i in (3, 4)), (directory, resumed)


# ------------------------------------------------------------------------------------------- live recovery
LIVE_NADAM = FLAGS + NADAM  # dp=4, R=2, 8 iterations (live_testing.FLAGS)


@PROGRESS_BOUNDED
def test_a_killed_rank_is_recovered_live_with_an_optimizer_class(tmp_path_factory):
    """Under the supervisor with --optimizer-class torch.optim.NAdam: rank 3 killed during the forward/backward
    of iteration 2 (its replacement takes its shard, mu_product and the moments, from its replica) and rank 0
    right after its optimizer update of iteration 5 (the replica rolls the others forward): only those two
    ranks get new processes, and every loss, validation loss and the final checkpoint are bitwise those of
    the uninterrupted `torchrun pretrain_gpt.py` of the same flags. Would catch a replacement built with
    another optimizer than the job's, or a state entry of the class left out of the replica transfer."""
    reference = uninterrupted(str(tmp_path_factory.mktemp("nadam_reference")), LIVE_NADAM)
    directory = tmp_path_factory.mktemp("nadam_live")
    code, pids, losses, output = run_live(directory, "3:2:forward_backward:0;0:5:update:0", flags=LIVE_NADAM)
    assert code == 0, output
    assert "killed at forward_backward" in output and "killed at update" in output, output
    replaced = re.findall(r"\[supervisor\] generation \d+: replaced (\[.*\])", output)[1:]  # [0]: the start
    assert [r for r in replaced if r != "[]"] == ["[3]", "[0]"], output
    assert len(pids[1]) == 1 and len(pids[2]) == 1, output
    check_exact(directory, reference, losses, output)
