"""Timing several configurations side by side on every rank: alternating rounds, slowest rank per sample.

Every benchmark here compares configurations measured in one run, so that a slow phase of a shared
machine hits all of them alike: after `warmup` untimed rounds, each of `repeats` rounds runs `steps`
consecutive steps of every configuration, in an order rotated by one per round. Each step starts after a
barrier (and, on CUDA, a synchronize); a sample lasts as long as its slowest rank. `Progress` prints how far a
run is (steps done of all, elapsed, time left) so that a long measurement is never silent.
"""

import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist


@dataclass
class Timings:
    samples: torch.Tensor
    """[configurations, repeats x steps, 1 + extras] seconds, max over ranks: column 0 the whole step, the
    others what the step function returned."""
    peak_rise_bytes: List[int]
    """CUDA: per configuration, the largest rise of allocated memory during its steps (else 0)."""

    def median_ms(self, config: int, column: int = 0) -> float:
        return statistics.median(self.samples[config, :, column].tolist()) * 1e3


class Progress:
    """A `progress` callback for alternate(): on rank 0, one line per configuration measured ("12/588 steps, ..."),
    at most one every `interval` seconds (the first and the last always), with the time left estimated from the
    steps done so far (warm-up steps included: they cost as much). Create it just before alternate(): the clock
    starts then.

    Args:
        what: the line's prefix (the script's name).
        names: the configurations' names, by index.
    """

    def __init__(self, what: str, names: Sequence[str], interval: float = 5.0):
        self.what, self.names, self.interval = what, list(names), interval
        self.start, self.last = time.perf_counter(), None

    def __call__(self, k: int, done: int, total: int):
        now = time.perf_counter()
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        if self.last is not None and now - self.last < self.interval and done < total:
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed / done * (total - done)
        print(f"{self.what}: {done}/{total} steps, last configuration {self.names[k]!r}, {_duration(elapsed)} "
              f"elapsed, about {_duration(left)} left", flush=True)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(step: Callable[..., Optional[Sequence[float]]], num_configs: int, repeats: int, steps: int = 1,
              warmup: int = 0, device: torch.device = torch.device("cpu"),
              prepare: Optional[Callable[[int], tuple]] = None,
              progress: Optional[Callable[[int, int, int], None]] = None) -> Timings:
    """Time `step(k, *prepare(k))` for configurations k = 0 .. num_configs - 1 (see the module docstring).

    Args:
        step: runs one step of configuration k; may return extra durations (seconds) to record with it.
        prepare: untimed, before each step: the step's arguments (e.g. the batch).
        warmup: untimed rounds of one step per configuration, first.
        progress: called as `progress(k, steps done, steps in all)` after each configuration's steps of a round
            (e.g. a `Progress`), on every rank.
    """
    samples, done = [[None] * (repeats * steps) for _ in range(num_configs)], [0] * num_configs
    rise = [0] * num_configs
    rounds = [(1, False)] * warmup + [(steps, True)] * repeats
    total, executed = num_configs * (warmup + steps * repeats), 0
    for r, (count, timed) in enumerate(rounds):
        for k in [(r + i) % num_configs for i in range(num_configs)]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(count):
                inputs = prepare(k) if prepare else ()
                _sync(device)
                dist.barrier()
                start = time.perf_counter()
                extra = step(k, *inputs)
                _sync(device)
                elapsed = time.perf_counter() - start
                if timed:
                    samples[k][done[k]] = [elapsed, *(extra or ())]
                    done[k] += 1
            if device.type == "cuda":
                rise[k] = max(rise[k], torch.cuda.max_memory_allocated(device) - base)
            executed += count
            if progress is not None:
                progress(k, executed, total)
    out = torch.tensor(samples, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return Timings(out.cpu(), rise)
