"""Run a benchmark on every rank: under torchrun (env:// rendezvous), or by spawning local gloo ranks.

Every multi-rank benchmark here is written as `run(rank, args, world_size, init_method)`; `launch` calls
it once per rank either way, so `torchrun --nproc-per-node 2 benchmarks/X.py` and `python benchmarks/X.py`
behave the same. CPU-only benchmarks just write `benchmark(args, world, rank)` and call `launch_gloo`.
"""

import os
import tempfile

import torch
import torch.distributed as dist
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


def _gloo_rank(rank: int, benchmark_and_args, world: int, init_method: str):
    benchmark, args = benchmark_and_args
    torch.set_num_threads(1)  # 2 cores, 2 ranks: more threads per rank only oversubscribe
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        benchmark(args, world, rank)
    finally:
        dist.destroy_process_group()


def launch_gloo(benchmark, args, world: int):
    """launch() for CPU benchmarks: a gloo group, one thread per rank, around benchmark(args, world, rank)."""
    launch(_gloo_rank, (benchmark, args), world)
