"""--deterministic-mode (Megatron's flag): the environment reproducible GPU runs need, and torch's
deterministic kernels, switched on at start-up before any collective or matmul."""

import pytest
import torch
from distributed_helper import run_distributed
from pretrain_testing import pretrain_losses, tiny_pretrain_flags

from megatron_lite.training.initialize import DETERMINISTIC_ENV, apply_deterministic_mode


@pytest.fixture
def restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_fills_the_environment_and_keeps_accepted_values(restore_determinism):
    """Would catch a missing variable, a launcher's accepted choice overwritten, or torch left as it was."""
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    torch.use_deterministic_algorithms(False)
    apply_deterministic_mode(env)
    assert env == {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    assert set(env) == set(DETERMINISTIC_ENV)
    assert torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("name, value", [("NCCL_ALGO", "Tree"), ("CUBLAS_WORKSPACE_CONFIG", ":0:0")])
def test_a_non_reproducible_setting_is_an_error_naming_it(name, value, restore_determinism):
    """Would catch --deterministic-mode running quietly with a setting that breaks reproducibility."""
    torch.use_deterministic_algorithms(False)
    with pytest.raises(ValueError, match=name):
        apply_deterministic_mode({name: value})
    assert not torch.are_deterministic_algorithms_enabled()  # nothing half-applied


def _deterministic_run():
    losses = pretrain_losses(tiny_pretrain_flags(deterministic_mode=True, train_iters="3", log_interval="1"))
    enabled = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)  # the pool's process serves other tests next
    return enabled, losses


def test_pretrain_switches_it_on():
    """Would catch the flag parsed but never applied by pretrain_gpt.py's start-up."""
    results = run_distributed(_deterministic_run, 2)
    assert all(enabled for enabled, _ in results)
    assert results[0][1] == results[1][1] and len(results[0][1]) == 3
