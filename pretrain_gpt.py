"""Megatron-style GPT pre-training with megatron_lite.

    torchrun --nproc-per-node 2 pretrain_gpt.py --overlap-grad-reduce --use-distributed-optimizer

With no data flags it trains a tiny GPT on the built-in corpus (documentation text of the Python standard
library, tokenized byte-level and cached under data/cache on first use). `--help` lists every flag.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run from a checkout without installing

from megatron_lite.training import parse_args, pretrain  # noqa: E402


def main(argv=None):
    args = parse_args(argv)
    try:
        pretrain(args)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
