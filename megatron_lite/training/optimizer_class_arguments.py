"""--optimizer-class and --optimizer-kwargs: any elementwise torch.optim class from the command line (a
megatron-lite extension; Megatron-LM's --optimizer knows its own names only).

    --optimizer-class torch.optim.NAdam   -> OptimizerConfig.optimizer_class  (a bare name: torch.optim's)
    --optimizer-kwargs '{"momentum_decay": 0.004, "betas": [0.9, 0.95]}'
                                          -> OptimizerConfig.optimizer_kwargs (JSON arrays become tuples)

The class is imported here; whether it can step flat shards is the config's probe's to say
(optimizer/elementwise.py), and its refusal comes back as a flag error like every config error. What this
module checks itself is what only the command line has: an import path, JSON, --optimizer given beside it,
and the named optimizers' flags (--adam-*, --sgd-momentum, --muon-*), which the class does not read.
"""

import argparse
import dataclasses
import difflib
import importlib
import inspect
import json

import torch

from ..optimizer import OptimizerConfig

FLAGS = {"optimizer_class": "--optimizer-class", "optimizer_kwargs": "--optimizer-kwargs"}
# The named optimizers' own hyperparameters (adam_*, sgd_*: whatever OptimizerConfig has), not read with
# --optimizer-class (its own go in --optimizer-kwargs), and their defaults: what "not given" reads as. The --muon-*
# flags are refused without --optimizer muon by arguments.check_muon_args, against their CLI defaults (Megatron's
# --muon-momentum default, 0.9, is not megatron-core's config default, 0.95).
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OptimizerConfig) if f.name.startswith(("adam_", "sgd_"))}


def add_optimizer_class_arguments(g: argparse._ArgumentGroup) -> None:
    """Adds the two flags to `g`, the optimizer's argument group."""
    g.add_argument("--optimizer-class", metavar="CLASS",
                   help="megatron-lite extension: instead of --optimizer, any elementwise torch.optim.Optimizer "
                        "subclass by its import path (torch.optim.NAdam, or a bare torch.optim name: NAdam; "
                        "mypackage.optim.MyAdam), stepped on the flat shards of every sharding strategy, "
                        "with its state in both checkpoint formats, last words, replicas and live recovery. A "
                        "probe at start-up refuses a class whose update is not elementwise (torch.optim.Muon, "
                        "LAMB-style trust ratios). --lr, --weight-decay (the class must take it; 0 if it does "
                        "not) and the schedule apply; --optimizer stays adam; the --adam-*, --sgd-momentum and "
                        "--muon-* flags are refused beside it")
    g.add_argument("--optimizer-kwargs", metavar="JSON",
                   help="with --optimizer-class: its other hyperparameters as a JSON object, e.g. "
                        "'{\"momentum_decay\": 0.004, \"betas\": [0.9, 0.95]}' (arrays become tuples; not lr or "
                        "weight_decay: --lr and --weight-decay set those). A resume checks them against the "
                        "checkpoint's, as the other optimizer hyperparameters")


def optimizer_class_from_args(args) -> dict:
    """OptimizerConfig's optimizer_class and optimizer_kwargs from the flags ({} when neither is given: the
    config's defaults). Raises ValueError naming the flag."""
    path, text = getattr(args, "optimizer_class", None), getattr(args, "optimizer_kwargs", None)
    if path is None:
        # --optimizer-kwargs alone: the config refuses it ("--optimizer-kwargs is for --optimizer-class").
        return {} if text is None else {"optimizer_kwargs": _kwargs(text)}
    if getattr(args, "optimizer", "adam") != "adam":  # the config's rule too; here in the flags' words
        raise ValueError(f"--optimizer {args.optimizer} and --optimizer-class {path} both name the optimizer: "
                         f"drop --optimizer (--optimizer-class replaces it)")
    preset = getattr(args, "preset_values", {})
    given = ["--" + key.replace("_", "-") for key, default in _DEFAULTS.items()
             if getattr(args, key, None) not in (None, default) and key not in preset]
    if given:
        raise ValueError(f"{', '.join(given)} set the hyperparameters of --optimizer's named optimizers, which "
                         f"--optimizer-class {path} replaces: give the class's own in --optimizer-kwargs "
                         f"(e.g. '{{\"betas\": [0.9, 0.95]}}')")
    return {"optimizer_class": _import_class(path),
            "optimizer_kwargs": None if text is None else _kwargs(text)}


def _import_class(path: str) -> type:
    module_name, _, name = path.rpartition(".")
    module_name = module_name or "torch.optim"
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--optimizer-class {path}: cannot import {module_name!r} ({type(error).__name__}: "
                         f"{error}): give the class's import path, e.g. torch.optim.NAdam, with its package "
                         f"installed") from None
    cls = getattr(module, name, None)
    if cls is None:
        known = [n for n, v in vars(module).items() if inspect.isclass(v) and issubclass(v, torch.optim.Optimizer)]
        close = difflib.get_close_matches(name, known, n=3)
        raise ValueError(f"--optimizer-class {path}: {module_name} has no {name!r}"
                         + (f" (did you mean {', '.join(close)}?)" if close else ""))
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"--optimizer-class {path} is a {type(cls).__name__}, not a torch.optim.Optimizer "
                         f"subclass")
    return cls


def _kwargs(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--optimizer-kwargs {text!r} is not JSON ({error}): give an object, e.g. "
                         f"'{{\"momentum_decay\": 0.004}}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"--optimizer-kwargs must be a JSON object ({{\"name\": value, ...}}), got {text!r}")
    return {key: _tuples(v) for key, v in value.items()}


def _tuples(value):
    """JSON arrays as tuples, as torch.optim's hyperparameters are written (betas=(0.9, 0.95))."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value

