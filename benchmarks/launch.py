"""Run a benchmark on every rank: under torchrun (env:// rendezvous), or by spawning local gloo ranks.

Every multi-rank benchmark here is written as `run(rank, args, world_size, init_method)`; `launch` calls
it once per rank either way, so `torchrun --nproc-per-node 2 benchmarks/X.py` and `python benchmarks/X.py`
behave the same.
"""

import os
import tempfile

import torch.multiprocessing as mp


def world_size(default: int) -> int:
    """torchrun's WORLD_SIZE when launched by it, else the number of ranks to spawn."""
    return int(os.environ.get("WORLD_SIZE", default))


def launch(run, args, world: int):
    if "RANK" in os.environ:  # torchrun: this process is one rank
        run(int(os.environ["RANK"]), args, world, "env://")
        return
    with tempfile.TemporaryDirectory(prefix="mlite_bench_") as tmp:  # file:// rendezvous: no port races
        mp.spawn(run, args=(args, world, f"file://{os.path.join(tmp, 'rendezvous')}"), nprocs=world)
