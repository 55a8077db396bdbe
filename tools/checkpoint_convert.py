"""Convert a checkpoint between the two formats, or export plain model weights, in one process.

    python tools/checkpoint_convert.py --input runs/a --output runs/a_dist --to torch_dist
    python tools/checkpoint_convert.py --input runs/a_dist --output runs/a_torch --to torch
    python tools/checkpoint_convert.py --input runs/a --export-weights gpt.pt     # torch.load -> GPTModel

`--input` is a --save directory (its newest complete checkpoint, or `--iteration N`); every file is checked
against the checkpoint's manifest first. The formats (megatron_lite/checkpointing/torch_format.py and
torch_dist.py) hold the same state: `torch` one file with full tensors per parameter name, `torch_dist`
1-D tensors per name written through torch.distributed.checkpoint plus common.pt. The output is a new
--save directory with one checkpoint, written atomically; it resumes with --load at any DP size and
sharding strategy. The exported weights are the model's state_dict (full tensors, CPU).
"""

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from megatron_lite.checkpointing import files, torch_dist, torch_format  # noqa: E402


def read(directory: str) -> dict:
    """Either format -> the `torch` format's payload (full tensors, per parameter name)."""
    files.verify(directory)
    if not torch_dist.is_torch_dist(directory):
        return torch.load(os.path.join(directory, torch_format.CHECKPOINT_FILENAME), map_location="cpu",
                          weights_only=True)
    common = torch_dist.read_common(directory)
    metadata = torch_dist.SafeReader(directory).read_metadata().state_dict_metadata
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in metadata.items()}
    with warnings.catch_warnings():  # one process, no process group: exactly what no_dist is for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=torch_dist.SafeReader(directory), no_dist=True)
    shapes = {name: torch.Size(shape) for name, shape in common["shapes"].items()}
    model, state = {}, {}
    for key, tensor in tensors.items():
        section, rest = key.split(".", 1)
        if section == "model":
            model[rest] = tensor.view(shapes[rest]) if rest in shapes else tensor
        else:
            name, field = rest.rsplit(".", 1)
            state.setdefault(name, {"step": common["optimizer_step"]})[field] = tensor.view(shapes[name])
    return {**{k: common[k] for k in ("iteration", "consumed_train_samples", "opt_param_scheduler", "rng_state",
                                      "args")},
            "checkpoint_version": files.CHECKPOINT_VERSION, "model": model,
            "optimizer": {**common["optimizer"], "state": state}}


def write(root: str, payload: dict, ckpt_format: str):
    """`payload` (the `torch` format's) as a new checkpoint in `root`, sealed as save_checkpoint seals one
    (files.new_directory, the files, files.seal_directory), by this one process."""
    iteration = payload["iteration"]
    directory = files.new_directory(root, iteration)
    try:
        if ckpt_format == "torch":
            torch_format.write(directory, payload)
        else:
            _write_torch_dist(directory, payload)
    except BaseException:
        files.discard_directory(directory)
        raise
    files.seal_directory(root, iteration, directory)


def _write_torch_dist(directory: str, payload: dict):
    state = payload["optimizer"]["state"]
    tensors = {f"model.{k}": (v.reshape(-1) if k in state else v) for k, v in payload["model"].items()}
    tensors.update({f"optimizer.{name}.{field}": value.reshape(-1) for name, entry in state.items()
                    for field, value in entry.items() if field != "step"})
    common = {**{k: payload[k] for k in ("iteration", "consumed_train_samples", "opt_param_scheduler", "rng_state",
                                         "args")},
              "checkpoint_version": files.CHECKPOINT_VERSION, "format": "torch_dist",
              "optimizer": {k: v for k, v in payload["optimizer"].items() if k != "state"},
              "optimizer_step": max([int(e.get("step", 0)) for e in state.values()] + [0]),
              "shapes": {name: list(entry["param"].shape) for name, entry in state.items()}}
    torch.save(common, os.path.join(directory, torch_dist.COMMON_FILENAME))
    with warnings.catch_warnings():  # one process, no process group: exactly what no_dist is for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=directory, no_dist=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="a --save directory")
    p.add_argument("--iteration", type=int, help="which checkpoint (default: the newest complete one)")
    p.add_argument("--output", help="a new --save directory for the converted checkpoint")
    p.add_argument("--to", choices=["torch", "torch_dist"], help="the output format")
    p.add_argument("--export-weights", metavar="FILE", help="write the model's state_dict to FILE (torch.save)")
    args = p.parse_args(argv)
    if bool(args.output) != bool(args.to) or not (args.output or args.export_weights):
        p.error("give --output with --to, and/or --export-weights")
    if args.output and os.path.isdir(args.output) and files.complete_checkpoints(args.output):
        p.error(f"--output {args.output} already holds checkpoints: choose a new directory")
    try:
        if args.iteration is None:
            iteration, directory = files.find_latest(args.input)
        else:
            iteration, directory = args.iteration, files.checkpoint_dir(args.input, args.iteration)
        if iteration is None or not os.path.isdir(directory):
            p.error(f"--input {args.input} holds no such checkpoint")
        payload = read(directory)
    except ValueError as e:
        p.error(str(e))
    if "expert_parallel" in payload:  # per-position experts: not expressible in torch_dist or plain weights yet
        p.error(f"--input {args.input} holds expert parameters (one set per expert-parallel position): converting "
                f"or exporting them is not supported yet")
    if args.output:
        write(args.output, payload, args.to)
        print(f"> wrote iteration {payload['iteration']} as {args.to} to {args.output}")
    if args.export_weights:
        torch.save({k: v.contiguous() for k, v in payload["model"].items()}, args.export_weights)
        print(f"> wrote the model weights of iteration {payload['iteration']} to {args.export_weights}")


if __name__ == "__main__":
    main()
