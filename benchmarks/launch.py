"""Run a benchmark on every rank: under torchrun, by spawning local ranks, or in this process for one rank.

Every benchmark here is written as `benchmark(args, rank, world_size, device)`; `launch` calls it once per
rank inside a process group joined through megatron_lite's `initialize_distributed`, so
`torchrun --nproc-per-node 2 -m benchmarks.X` and `python -m benchmarks.X` behave the same. Ranks use one
GPU each when there are enough GPUs (NCCL), else the CPU (gloo) with the cores split between them.
"""

import os
import tempfile
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lite.training import initialize_distributed, shutdown


def world_size(default: int) -> int:
    """torchrun's WORLD_SIZE when launched by it, else the number of ranks to spawn."""
    return int(os.environ.get("WORLD_SIZE", default))


def _rank(rank: int, benchmark: Callable, args, world: int, init_method: Optional[str], cpu: bool,
          threads_per_rank: Optional[int], own_process: bool = True):
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cuda = not cpu and torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if not cuda:  # ranks on one machine share its cores: more threads per rank only oversubscribe
        torch.set_num_threads(threads_per_rank or max(1, (os.cpu_count() or 1) // local_world))
    device = initialize_distributed(device="cuda" if cuda else "cpu", rank=rank, world_size=world,
                                    init_method=init_method)
    try:
        benchmark(args, rank, world, device)
    except BaseException:
        dist.destroy_process_group()
        raise
    if own_process:
        shutdown()  # exit without the interpreter's finalization, where gloo may abort a finished run
    dist.destroy_process_group()


def launch(benchmark: Callable, args, world: int, cpu: bool = False, threads_per_rank: Optional[int] = None):
    """Call benchmark(args, rank, world, device) on every rank (see the module docstring).

    Args:
        world: ranks to spawn when not under torchrun (torchrun's WORLD_SIZE wins).
        cpu: gloo on the CPU even when GPUs are available.
        threads_per_rank: torch threads of a CPU rank (default: the cores divided among the local ranks).
    """
    if "RANK" in os.environ:  # torchrun: this process is one rank (env:// rendezvous)
        _rank(int(os.environ["RANK"]), benchmark, args, int(os.environ["WORLD_SIZE"]), None, cpu, threads_per_rank)
    elif world == 1:  # no other process needed: a world of one in this process
        _rank(0, benchmark, args, 1, None, cpu, threads_per_rank, own_process=False)
    else:
        with tempfile.TemporaryDirectory(prefix="mlite_bench_") as tmp:  # file:// rendezvous: no port races
            mp.spawn(_rank, args=(benchmark, args, world, f"file://{os.path.join(tmp, 'rendezvous')}", cpu,
                                  threads_per_rank), nprocs=world)
