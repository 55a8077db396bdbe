"""The command line shared by the one-rank GPT benchmarks that run on a GPU or a CPU (ddp_overhead_gpt.py,
optimizer_offload.py): model and timing sizes with full and --quick defaults, --dtype, --device, --out."""

import argparse
import json
import os
from typing import Dict, Tuple

import torch


def sized_parser(doc: str, sizes: Dict[str, Tuple[int, int]]) -> argparse.ArgumentParser:
    """A parser with one integer flag per entry of `sizes` (name: (default, default with --quick)), plus
    --quick, --dtype, --device and --out. Read it with parse_sized."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small defaults (a CPU smoke run)")
    for name, (default, quick) in sizes.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"default {default} ({quick} with --quick)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    return p


def parse_sized(p: argparse.ArgumentParser, sizes: Dict[str, Tuple[int, int]]) -> Tuple[argparse.Namespace, bool]:
    """(args with every size filled in, whether to run on the CPU)."""
    args = p.parse_args()
    for name, (default, quick) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    return args, args.device == "cpu" or not torch.cuda.is_available()


def write_json(path, result: dict):
    """`result` as JSON at `path` (its folder made), when a path is given."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
