"""Shared pieces for tests that run pretrain_gpt.py, tools/ or benchmarks/: the repository root and the tiny
training configuration, defined once.

`TINY_PRETRAIN_FLAGS` is the tiny GPT on mock data that the end-to-end tests train (a few iterations, seconds on
2 cores). A test that needs other values says so with `tiny_pretrain_flags(**overrides)`, so the difference from
the shared configuration is visible at the call site instead of hidden in a copied list.
"""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository root (pretrain_gpt.py, tools/, benchmarks/, examples/ live there)."""

TINY_PRETRAIN_FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
                       "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                       "--train-iters", "6", "--log-interval", "3", "--eval-iters", "0"]
"""pretrain_gpt.py flags of the tiny GPT: 2 layers, hidden 32, 6 iterations of a global batch of 8 on mock data."""


def tiny_pretrain_flags(**overrides):
    """`TINY_PRETRAIN_FLAGS` with some flags changed, as a new list.

    A keyword names a flag with `_` for `-` (`num_layers="1"` is `--num-layers 1`). A string value replaces
    the flag's value where the flag is in the base (keeping its place) or is appended with it; `True` appends
    a switch (`overlap_grad_reduce=True`); `None` drops the flag and its value (`mock_data=None`).
    """
    flags = list(TINY_PRETRAIN_FLAGS)
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        has_value = flag in flags and flag != "--mock-data"
        if flag in flags:
            at = flags.index(flag)
            if value is None:
                del flags[at:at + (2 if has_value else 1)]
            elif value is True:
                pass
            elif has_value:
                flags[at + 1] = str(value)
            else:
                raise TypeError(f"tiny_pretrain_flags: {flag} is a switch; pass True or None, not {value!r}")
        elif value is True:
            flags.append(flag)
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def pretrain_losses(argv):
    """Run pretrain_gpt.main(argv) on this rank (a `run_distributed` worker); return {iteration: lm loss}."""
    import sys

    import torch.distributed as dist

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt

    result = pretrain_gpt.main(argv, world_size=dist.get_world_size())
    return {i: r["lm loss"] for i, r in result["losses"].items()}


def pretrain_outcome(argv):
    """Run pretrain_gpt.main(argv) on this rank (a `run_distributed` worker); return ('ok', {iteration: lm
    loss}) or ('error', "<exception type>: <message>") for a ValueError, RuntimeError or SystemExit."""
    import sys

    import torch.distributed as dist

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt

    try:
        result = pretrain_gpt.main(argv, world_size=dist.get_world_size())
    except (ValueError, RuntimeError, SystemExit) as e:
        return "error", f"{type(e).__name__}: {e}"
    return "ok", {i: r["lm loss"] for i, r in result["losses"].items()}


def flag_error(argv, capsys, world_size=2) -> str:
    """parse_args(argv)'s usage error (it must exit 2, without a traceback); returns its last line."""
    import pytest

    from megatron_lite.training import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=world_size)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]
