"""Run a function on N ranks that use the one CUDA device: the launcher of the CUDA tests (tests/cuda).

`run_on_cuda(fn, world_size, *args, backend=...)` calls `fn(*args)` on every rank of a pool of spawned
worker processes and returns the per-rank results, like tests/support/distributed_helper.run_distributed,
but every rank joins the process group with `device='cuda'`:
  * backend 'nccl', world size 1: the real NCCL process group (NCCL needs one GPU per rank, and a machine
    with one GPU has one rank);
  * backend 'gloo', world size 2: two ranks sharing GPU 0, collectives on CUDA tensors through gloo (which
    stages them through host memory), so that the sharded paths really communicate.
Pools are kept per (backend, world size) for the pytest session (a CUDA context costs seconds), on
distributed_helper.Pool (a file rendezvous, a process-group timeout and a result timeout).
`fn` must be a module-level function (pickled by reference).

MLITE_CUDA_TESTS_ON_CPU=1 runs the same tests on the CPU (gloo only, 'nccl' becomes gloo): a check of the
tests' own logic on a machine without a GPU, nothing more.
"""

import atexit
import os

from distributed_helper import Pool, serve

PROCESS_GROUP_TIMEOUT_S = 60
DEFAULT_TIMEOUT_S = 120
ON_CPU = os.environ.get("MLITE_CUDA_TESTS_ON_CPU") == "1"
"""The tests' dry run on the CPU (see the module docstring)."""


def _worker(rank, world_size, init_file, tasks, results, backend):
    import torch
    import torch.distributed as dist

    from megatron_lite.training import initialize_distributed

    torch.set_num_threads(1 if ON_CPU else 2)
    if ON_CPU:
        os.environ["MLITE_CUDA_TESTS_ON_CPU"] = "1"
    initialize_distributed("gloo" if ON_CPU else backend, "cpu" if ON_CPU else "cuda", PROCESS_GROUP_TIMEOUT_S / 60,
                           rank, world_size, f"file://{init_file}")
    serve(rank, tasks, results, after_each=None if ON_CPU else torch.cuda.synchronize)
    dist.destroy_process_group()


_pools = {}


def run_on_cuda(fn, world_size, *args, backend="gloo", timeout=DEFAULT_TIMEOUT_S, **kwargs):
    """Run `fn(*args, **kwargs)` on `world_size` ranks on the CUDA device; return the per-rank results."""
    key = (backend, world_size)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = Pool(world_size, _worker, (backend,))
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:
        _pools.pop(key, None)
        pool.close()
        raise


def cuda_or_dry_run() -> bool:
    """Whether the CUDA tests run: a CUDA device, or the dry run on the CPU."""
    import torch

    return torch.cuda.is_available() or ON_CPU


FLAVOURS = [("nccl", 1), ("gloo", 2)]
"""(backend, world size) of the two ways one GPU runs the library: NCCL alone, two gloo ranks sharing it."""


@atexit.register
def _close_pools():
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()
