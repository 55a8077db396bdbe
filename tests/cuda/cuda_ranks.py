"""Run a function on N ranks that use the one CUDA device: the launcher of the CUDA tests (tests/cuda).

`run_on_cuda(fn, world_size, *args, backend=...)` calls `fn(*args)` on every rank of a pool of spawned
worker processes and returns the per-rank results, like tests/support/distributed_helper.run_distributed,
but every rank joins the process group with `device='cuda'`:
  * backend 'nccl', world size 1: the real NCCL process group (NCCL needs one GPU per rank, and a machine
    with one GPU has one rank);
  * backend 'gloo', world size 2: two ranks sharing GPU 0, collectives on CUDA tensors through gloo (which
    stages them through host memory), so that the sharded paths really communicate.
Pools are kept per (backend, world size) for the pytest session (a CUDA context costs seconds), with a file
rendezvous, a process-group timeout and a result timeout, as in distributed_helper.py.
`fn` must be a module-level function (pickled by reference).

MLITE_CUDA_TESTS_ON_CPU=1 runs the same tests on the CPU (gloo only, 'nccl' becomes gloo): a check of the
tests' own logic on a machine without a GPU, nothing more.
"""

import atexit
import os
import queue
import tempfile
import traceback

import torch.multiprocessing as mp

PROCESS_GROUP_TIMEOUT_S = 60
DEFAULT_TIMEOUT_S = 120
FAILURE_GRACE_S = 5
ON_CPU = os.environ.get("MLITE_CUDA_TESTS_ON_CPU") == "1"
"""The tests' dry run on the CPU (see the module docstring)."""


def _worker(rank, world_size, backend, init_file, tasks, results):
    import torch
    import torch.distributed as dist

    from megatron_lite.training import initialize_distributed

    torch.set_num_threads(1 if ON_CPU else 2)
    if ON_CPU:
        os.environ["MLITE_CUDA_TESTS_ON_CPU"] = "1"
    initialize_distributed("gloo" if ON_CPU else backend, "cpu" if ON_CPU else "cuda", PROCESS_GROUP_TIMEOUT_S / 60,
                           rank, world_size, f"file://{init_file}")
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
        if not ON_CPU:
            torch.cuda.synchronize()
    dist.destroy_process_group()


class _Pool:
    def __init__(self, backend, world_size):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix="mlite_cuda_rdzv_")
        init_file = os.path.join(self._dir.name, "rendezvous")
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world_size, backend, init_file, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, args, kwargs, timeout):
        for q in self.tasks:
            q.put((fn, args, kwargs))
        outputs, failures, deadline = {}, {}, timeout
        while len(outputs) + len(failures) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=deadline)
            except queue.Empty:
                if failures:
                    break
                missing = sorted(set(range(self.world_size)) - set(outputs))
                raise TimeoutError(f"{fn.__name__}: ranks {missing} gave no result within {timeout} s")
            (outputs if ok else failures)[rank] = value
            if failures:
                deadline = FAILURE_GRACE_S
        if failures:
            raise AssertionError("\n".join(f"--- rank {r} of {self.world_size} failed:\n{tb}"
                                           for r, tb in sorted(failures.items())))
        return [outputs[r] for r in range(self.world_size)]

    def close(self):
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._dir.cleanup()


_pools = {}


def run_on_cuda(fn, world_size, *args, backend="gloo", timeout=DEFAULT_TIMEOUT_S, **kwargs):
    """Run `fn(*args, **kwargs)` on `world_size` ranks on the CUDA device; return the per-rank results."""
    key = (backend, world_size)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = _Pool(backend, world_size)
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
