"""What a directory given to --load is when it is another tool's checkpoint, and the command that converts it.

::

    Megatron-LM, torch_dist     ROOT/latest_checkpointed_iteration.txt, ROOT/iter_0000010/metadata.json
                                ({"sharded_backend": "torch_dist", ...}), common.pt, .metadata, __0_0.distcp
    Megatron-LM, legacy torch   ROOT/iter_0000010/mp_rank_00/model_optim_rng.pt (mp_rank_00_000/ with pipeline
                                stages; distrib_optim.pt beside it), ROOT/release/... for a released model
    Hugging Face transformers   DIR/config.json with DIR/*.safetensors or DIR/pytorch_model*.bin
    DeepSpeed                   ROOT/latest ("global_step100"), ROOT/global_step100/mp_rank_00_model_states.pt,
                                *zero_pp_rank_*_optim_states.pt, layer_*-model_states.pt (pipeline stages)

A Megatron-LM root looks like a megatron-lite one (the same tracker and iter_XXXXXXX names); its checkpoints
have no manifest.json, and the loader would call the newest one incomplete. Megatron-LM writes a checkpoint in
place (metadata.json last), so its newest iter_ directory may be a save in progress: the newest one recognised
is named. The directory of one checkpoint (iter_XXXXXXX, global_stepN) is recognised too. A megatron-lite root
whose newest checkpoint is complete is never described here, whatever else lies in it (Megatron-LM checkpoints
newer than it are, naming it). Reads names and small JSON files; nothing communicates.
"""

import json
import os
import re
from typing import Optional

from . import files

_GLOBAL_STEP = re.compile(r"^global_step(\d+)$")
_MP_RANK = re.compile(r"^mp_rank_\d{2}(_\d{3}){0,2}$")  # mp_rank_TP[_PP][_EP]
_DEEPSPEED_FILE = re.compile(r"^(mp_rank_\d+_model_states\.pt|.*zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt"
                             r"|layer_\d+-model_\d+-model_states\.pt)$")
_HF_WEIGHTS = re.compile(r"^(.+\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin|.+\.safetensors\.index\.json"
                         r"|pytorch_model\.bin\.index\.json)$")

CONVERTER = "python tools/checkpoint_convert.py"


def describe_foreign(directory: str) -> Optional[str]:
    """What `directory` is when it is a Megatron-LM, Hugging Face or DeepSpeed checkpoint: a sentence naming the
    kind and the command that converts it (or, for DeepSpeed, what to do); None for anything else (a
    megatron-lite --save directory, an empty or missing one)."""
    if not os.path.isdir(directory):
        return None
    names = set(os.listdir(directory))
    iterations = files.iteration_entries(directory)
    lite = max(files.complete_checkpoints(directory), default=None) if iterations else None
    # Newest first: Megatron-LM writes an iteration in place (metadata.json last), so the newest one may be
    # a save in progress, or a crashed one, beside complete older ones (its tracker names the newest complete).
    for iteration in sorted(iterations, reverse=True):
        if lite is not None and iteration <= lite:
            return None  # megatron-lite's, maybe with something else newer: the loader names it
        kind = _megatron_kind(iterations[iteration])
        if kind:
            return _megatron_root(directory, kind, iteration, lite)
    kind = _megatron_kind(os.path.join(directory, "release"))  # Megatron-LM's tracker can say 'release'
    if kind:
        return _megatron_root(directory, kind, "release")
    kind = _megatron_kind(directory)
    if kind:
        return _megatron_one(directory, kind)
    if "config.json" in names and any(_HF_WEIGHTS.match(name) for name in names):
        return _hugging_face(directory, names)
    return _deepspeed(directory, names)


# ------------------------------------------------------------------------------------------ Megatron-LM
def _megatron_kind(path: str) -> Optional[str]:
    """'torch_dist' (or dist_checkpointing's other backend) / 'legacy torch' for one Megatron-LM checkpoint
    directory, else None."""
    if not os.path.isdir(path):
        return None
    metadata = os.path.join(path, "metadata.json")
    if os.path.isfile(metadata):
        try:
            with open(metadata) as f:
                backend = json.load(f).get("sharded_backend")
        except (OSError, ValueError, AttributeError):
            backend = None
        if isinstance(backend, str):
            return backend
    for name in os.listdir(path):
        if _MP_RANK.match(name) and any(os.path.isfile(os.path.join(path, name, f))
                                        for f in ("model_optim_rng.pt", "distrib_optim.pt")):
            return "legacy torch"
    return None


def _format(kind: str) -> str:
    if kind == "legacy torch":
        return "legacy torch format (mp_rank_*/model_optim_rng.pt)"
    if kind == "torch_dist":
        return "torch_dist format, megatron-core dist_checkpointing"
    return f"megatron-core dist_checkpointing, sharded_backend {kind!r}"


def _next_steps(converted: str) -> str:
    return (f"then resume with `pretrain_gpt.py --load {converted}` (with the optimizer state, where the "
            f"checkpoint carries it) or start from its weights with `pretrain_gpt.py --finetune --load {converted}`, "
            f"with the flags the converter prints")


def _megatron_root(directory: str, kind: str, newest, lite: Optional[int] = None) -> str:
    """`lite`: the newest complete megatron-lite checkpoint beside them (older than `newest`), if any."""
    whose = ", not megatron-lite's" if lite is None else ""
    also = "" if lite is None else (f"; it also holds megatron-lite checkpoints (newest: iteration {lite}): to resume "
                                    f"from those, move the newer Megatron-LM ones away")
    return (f"{directory} holds Megatron-LM checkpoints ({_format(kind)}; newest: {newest}){whose}: "
            f"convert with `{CONVERTER} --from megatron --input {directory} --output NEW_DIR`, "
            f"{_next_steps('NEW_DIR')}{also}")


def _megatron_one(directory: str, kind: str) -> str:
    parent = os.path.dirname(os.path.normpath(directory)) or "."
    match = files.ITER_DIR.match(os.path.basename(os.path.normpath(directory)))
    iteration = f" --iteration {int(match.group(1))}" if match else ""
    return (f"{directory} is one Megatron-LM checkpoint ({_format(kind)}), not a megatron-lite --load directory: "
            f"convert the directory that holds it with `{CONVERTER} --from megatron --input {parent}{iteration} "
            f"--output NEW_DIR`, {_next_steps('NEW_DIR')}")


# ------------------------------------------------------------------------------------------ the others
def _hugging_face(directory: str, names: set) -> str:
    try:
        with open(os.path.join(directory, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    kind = f" (model_type {model_type!r})" if isinstance(model_type, str) else ""
    command = (f"convert with `{CONVERTER} --from hf --input {directory} --output NEW_DIR` (GPT-2 and Llama "
               f"classes), then start from its weights with `pretrain_gpt.py --finetune --load NEW_DIR` and the "
               f"flags the tool prints")
    if not any(name.endswith((".safetensors", ".safetensors.index.json")) for name in names):
        command = ("the converter reads safetensors: save it with transformers' save_pretrained() (safetensors by "
                   "default) into a new directory, then " + command)
    return f"{directory} is a Hugging Face transformers model{kind}, not a megatron-lite checkpoint: {command}"


def _deepspeed(directory: str, names: set) -> Optional[str]:
    steps = {int(m.group(1)): name for name in names if (m := _GLOBAL_STEP.match(name))
             and _holds_deepspeed_files(os.path.join(directory, name))}
    if steps:
        where, root = f"newest: {steps[max(steps)]}", directory
    elif any(_DEEPSPEED_FILE.match(name) for name in names):
        where, root = "one step's directory", os.path.dirname(os.path.normpath(directory)) or "."
    else:
        return None
    return (f"{directory} is a DeepSpeed checkpoint ({where}), not a megatron-lite one, and megatron-lite has no "
            f"converter for it: consolidate its weights with the zero_to_fp32.py script DeepSpeed saves in "
            f"{root} (a full fp32 state dict), load them into the transformers model they belong to and "
            f"save_pretrained() it, then convert with `{CONVERTER} --from hf --input HF_DIR --output NEW_DIR` "
            f"(GPT-2 and Llama classes) and start with `pretrain_gpt.py --finetune --load NEW_DIR`")


def _holds_deepspeed_files(path: str) -> bool:
    return os.path.isdir(path) and any(_DEEPSPEED_FILE.match(name) for name in os.listdir(path))
