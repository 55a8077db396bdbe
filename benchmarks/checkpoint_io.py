"""Checkpoint formats side by side: extra host memory per rank during save and load, and the time training
is blocked, for `torch` (optimizer state gathered, one file by rank 0) and `torch_dist` (every rank writes
its own part through torch.distributed.checkpoint; also asynchronously).

The small preset's GPT (4 layers, hidden 256, seq 256) with the distributed optimizer (ZeRO-1) takes one
training step (so the Adam moments exist), then saves or loads. Every measurement runs in fresh processes
(a new launch): a sampler thread reads the resident set size from /proc/self/statm every millisecond, and
"extra" is its peak during the save (or load) minus its value just before, per rank, the largest rank
reported. "own state" is the rank's model parameters, fp32 main params and moments (what it must hold
anyway). Times are the slowest rank's.::

    python -m benchmarks.checkpoint_io [--world-size 4]
"""

import argparse
import json
import os
import shutil
import tempfile
import threading
import time

import torch

from benchmarks.launch import launch, world_size
from megatron_lite import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_lite.checkpointing import load_checkpoint, save_checkpoint
from megatron_lite.distributed import collectives
from megatron_lite.models import GPTConfig, GPTModel
from megatron_lite.training.scheduler import OptimizerParamScheduler

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakSampler:
    """Peak resident set size while the context is open, sampled every millisecond."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def build():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=384,
                               max_position_embeddings=256))
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(use_distributed_optimizer=True))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp])
    sched = OptimizerParamScheduler(opt, 1e-3, 0.0, 0, 10, "constant")
    tokens = torch.randint(0, 384, (2, 257), generator=torch.Generator().manual_seed(1))
    ddp.zero_grad_buffer()
    ddp(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    ddp.finish_grad_sync()
    opt.step()
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    own += sum(t.numel() * t.element_size() for g in opt.param_groups for p in g["params"]
               for t in [p, *[v for v in opt.optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.dim()]])
    return ddp, opt, sched, own


def run(args, rank, world, device):
    ddp, opt, sched, own = build()
    fmt, phase, root = args.case
    async_group = torch.distributed.new_group(backend="gloo") if fmt == "async" else None
    torch.distributed.barrier()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        if phase == "save":
            pending = save_checkpoint(root, 1, ddp, opt, sched, 8, async_group=async_group,
                                      ckpt_format="torch" if fmt == "torch" else "torch_dist")
            blocked = time.perf_counter() - start
            if pending is not None:
                pending.wait()
        else:
            load_checkpoint(root, ddp, opt, sched)
            blocked = time.perf_counter() - start
    total = time.perf_counter() - start
    results = collectives.all_gather_object((sampler.extra, own, blocked, total))
    if rank == 0:
        with open(os.path.join(root, f"result_{phase}_{fmt}.json"), "w") as f:
            json.dump(results, f)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default: 2)")
    args = p.parse_args()
    world = world_size(args.world_size)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckpt_io_") as tmp:
        for fmt in ("torch", "torch_dist", "async"):
            root = os.path.join(tmp, fmt)
            for phase in ("save", "load"):
                if phase == "load" and fmt == "async":
                    continue  # the same files as torch_dist
                args.case = (fmt, phase, root)
                launch(run, args, world, cpu=True, threads_per_rank=1)
                with open(os.path.join(root, f"result_{phase}_{fmt}.json")) as f:
                    results = json.load(f)
                rows.append((fmt, phase, max(r[0] for r in results), max(r[1] for r in results),
                             max(r[2] for r in results), max(r[3] for r in results)))
            shutil.rmtree(root, ignore_errors=True)
    print(f"GPT small preset (4 layers, hidden 256), ZeRO-1, {world} gloo ranks, torch {torch.__version__}\n")
    print("| format | phase | peak extra MiB/rank | own state MiB/rank | blocked s | total s |")
    print("|---|---|---|---|---|---|")
    for fmt, phase, extra, own, blocked, total in rows:
        print(f"| {fmt if fmt != 'async' else 'torch_dist --async-save'} | {phase} | {extra / MIB:.1f} | "
              f"{own / MIB:.1f} | {blocked:.3f} | {total:.3f} |")


if __name__ == "__main__":
    main()
