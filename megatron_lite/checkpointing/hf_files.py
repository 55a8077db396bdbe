"""The files of a transformers model directory, read for tools/checkpoint_convert.py --from hf.

    config.json                       a JSON object
    model.safetensors.index.json      {"weight_map": {tensor name: shard file}}: when present, only the shards it
                                      names are read, each tensor from the shard it names (as transformers loads);
                                      other *.safetensors files are left alone (stale shards, stray copies), but
                                      model.safetensors, which transformers would load instead, is refused
    *.safetensors                     without an index: all of them
    tokenizer.json                    checked by the caller (build_tokenizer) before it is copied

A tensor held by two of the files read is refused, whichever the index names: a directory where one file silently
shadows another is not one model. The safetensors headers (names, dtypes, shapes) are read first, so the caller
compares them with config.json before any tensor's data is read. Every problem is a ValueError naming the file.
"""

import json
import os
from typing import Dict, List, NamedTuple, Tuple

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"  # an unsharded save
# The safetensors dtypes imported (as float32): floating point ones. Integers, bool and the float8 formats
# (quantized checkpoints, whose scales live in other tensors) are not weights GPTModel can take as they are.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


class Header(NamedTuple):
    """One tensor of a safetensors file, from its header: no data read."""
    path: str
    dtype: str  # safetensors' name: F32, BF16, I64, BOOL, ...
    shape: Tuple[int, ...]


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ValueError("--to hf / --from hf need the optional 'safetensors' package: pip install -e \".[hf]\" "
                         "(the Hugging Face extra)") from e
    return safe_open


def read_json(path: str, what: str) -> dict:
    """The JSON object in `path`. Raises ValueError naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({what}): {e}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path} holds a JSON {type(content).__name__}, not an object ({what})")
    return content


def headers(directory: str) -> Tuple[Dict[str, Header], List[str]]:
    """The tensors of `directory`'s weights, from the safetensors headers.

    Returns:
        ({tensor name: Header}, the *.safetensors files left unread because the index does not name them).
    Raises:
        ValueError naming the file: an index that is not {"weight_map": {name: file}}, a shard it names that is
        missing or lacks a tensor the index puts there, a file that is not safetensors (truncated, a header or
        offsets out of range), a tensor in two files; or no *.safetensors file at all.
    """
    present = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")
                     and os.path.isfile(os.path.join(directory, f)))
    index_path = os.path.join(directory, INDEX)
    wanted = None  # file -> the tensor names the index puts there
    if os.path.exists(index_path):
        weight_map = read_json(index_path, "the index of the safetensors shards").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index_path} has no \"weight_map\" object of tensor name -> shard file")
        wanted = {}
        for name, file in weight_map.items():
            if os.path.basename(file) != file or file in ("", ".", ".."):
                raise ValueError(f"{index_path} puts {name} in {file!r}, not a file name of {directory}")
            wanted.setdefault(file, set()).add(name)
        files = sorted(wanted)
        for file in files:
            if file not in present:
                raise ValueError(f"{index_path} names the shard {file}, which {directory} does not hold")
        if SINGLE in present and SINGLE not in wanted:  # transformers reads model.safetensors before any index
            raise ValueError(f"{directory} holds both {SINGLE} and {INDEX}, which does not name it: transformers "
                             f"loads {SINGLE} and ignores the index, so which weights are the model is unclear: "
                             f"remove the stale one ({SINGLE}, or the index and its shards)")
    elif not present:
        raise ValueError(f"--input {directory} has no *.safetensors file (pickled pytorch_model.bin is not read: "
                         f"save the model with save_pretrained(..., safe_serialization=True))")
    else:
        files = present
    found: Dict[str, Header] = {}
    for file in files:
        path = os.path.join(directory, file)
        in_file = _file_headers(path)
        for name, header in in_file.items():
            if name in found:
                raise ValueError(f"{found[name].path} and {path} both hold the tensor {name}: remove the stale "
                                 f"file (or give a {INDEX} and shards that name each tensor once)")
            found[name] = header
        lacking = sorted(wanted[file] - set(in_file)) if wanted else []
        if lacking:
            raise ValueError(f"{index_path} puts {lacking[:4]} in {file}, which does not hold "
                             f"{'them' if len(lacking) > 1 else 'it'}: the index and the shards disagree")
    if wanted is not None:  # the index decides which tensors are read; a shard's other tensors are not
        named = {name for names in wanted.values() for name in names}
        found = {name: h for name, h in found.items() if name in named}
    return found, [f for f in present if f not in files]


def _file_headers(path: str) -> Dict[str, Header]:
    safe_open = _safe_open()
    try:
        with safe_open(path, framework="pt") as f:
            out = {}
            for name in f.keys():
                piece = f.get_slice(name)
                out[name] = Header(path, piece.get_dtype(), tuple(piece.get_shape()))
            return out
    except Exception as e:  # SafetensorError (a header or offsets out of range, truncated), OSError
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None


def load(found: Dict[str, Header], names) -> Dict[str, torch.Tensor]:
    """The tensors `names` of `found` (headers()), as stored. Raises ValueError naming the tensor and its file
    for a dtype that is not floating point (checked on the headers, before any data is read), NaN or Inf values,
    or data that cannot be read."""
    for name in names:
        if found[name].dtype not in FLOAT_DTYPES:
            raise ValueError(f"{found[name].path}: the tensor {name} is {found[name].dtype}, not floating point "
                             f"({', '.join(FLOAT_DTYPES)}): it is not a weight this import can take (a quantized "
                             f"or mislabelled checkpoint?)")
    by_file: Dict[str, List[str]] = {}
    for name in names:
        by_file.setdefault(found[name].path, []).append(name)
    safe_open, tensors = _safe_open(), {}
    for path, file_names in by_file.items():
        try:
            with safe_open(path, framework="pt") as f:
                for name in file_names:
                    tensors[name] = f.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
        for name in file_names:
            if not torch.isfinite(tensors[name]).all():
                raise ValueError(f"{path}: the tensor {name} holds NaN or Inf values: training from it would fail "
                                 f"at the first step")
    return tensors
