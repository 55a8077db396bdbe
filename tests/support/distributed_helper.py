"""Run a function on N gloo ranks: the one multi-process helper of the test suite.

`run_distributed(fn, world_size, *args)` calls `fn(*args)` on every rank of a pool of spawned worker
processes and returns the per-rank results. Pools are kept per world size for the whole pytest session
(spawning a process that imports torch costs seconds on 2 cores), with a file-based rendezvous (no port
races) and timeouts everywhere:
  * the process group has a timeout, so a rank stuck in a collective errors out instead of hanging;
  * the parent waits at most `timeout` seconds for results;
  * when a rank fails, the parent gives the others a short grace period, tears the pool down (a peer may
    be stuck in a collective) and re-raises the failing rank's traceback.
`fn` must be a module-level function (it is pickled by reference).
"""

import atexit
import os
import queue
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

PROCESS_GROUP_TIMEOUT_S = 60
DEFAULT_TIMEOUT_S = 180
FAILURE_GRACE_S = 5


def _worker(rank, world_size, init_file, tasks, results):
    import torch.distributed as dist

    from megatron_lite.training import initialize_distributed

    torch.set_num_threads(1)  # 2 cores, up to 4 ranks: oversubscription only slows things down
    initialize_distributed("gloo", "cpu", PROCESS_GROUP_TIMEOUT_S / 60, rank, world_size, f"file://{init_file}")
    serve(rank, tasks, results)
    dist.destroy_process_group()


def serve(rank, tasks, results, after_each=None):
    """A rank's task loop: answer each (fn, args, kwargs) with (rank, ok, value or traceback) until None;
    `after_each()` runs after every task (e.g. a device synchronize)."""
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything, keep serving
            results.put((rank, False, traceback.format_exc()))
        if after_each is not None:
            after_each()


class Pool:
    """`world_size` spawned ranks serving tasks: `target(rank, world_size, init_file, tasks, results, *extra)`
    joins the process group through the rendezvous file and answers each (fn, args, kwargs) task with
    (rank, ok, value). tests/cuda/cuda_ranks.py runs its CUDA ranks on it with a target of its own."""

    def __init__(self, world_size, target=_worker, extra=()):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix="mlite_rdzv_")
        init_file = os.path.join(self._dir.name, "rendezvous")
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=target, args=(r, world_size, init_file, self.tasks[r], self.results, *extra),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, args, kwargs, timeout):
        for q in self.tasks:
            q.put((fn, args, kwargs))
        outputs, failures = {}, {}
        deadline = timeout
        while len(outputs) + len(failures) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=deadline)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(outputs) - set(failures))
                if failures:
                    break
                raise TimeoutError(f"{fn.__name__}: ranks {missing} gave no result within {timeout} s")
            (outputs if ok else failures)[rank] = value
            if failures:
                deadline = FAILURE_GRACE_S
        if failures:
            raise AssertionError(
                "\n".join(f"--- rank {r} of {self.world_size} failed:\n{tb}" for r, tb in sorted(failures.items()))
            )
        return [outputs[r] for r in range(self.world_size)]

    def close(self, wait_s=10):
        """Ask the ranks to stop; kill those still alive after `wait_s` (0 after a failure: a rank stuck in a
        collective would only run out the wait)."""
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=wait_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._dir.cleanup()


_pools = {}


def run_distributed(fn, world_size=2, *args, timeout=DEFAULT_TIMEOUT_S, **kwargs):
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the list of per-rank results."""
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:
        # A failed or hung rank may have left its peers inside a collective: start afresh next time.
        _pools.pop(world_size, None)
        pool.close(wait_s=0)
        raise


@atexit.register
def _close_pools():
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()
