"""What a run reports: Megatron's log line on rank 0, and the same numbers as JSONL / TensorBoard records.

Per iteration a record {iteration, consumed_samples, <loss keys>, lr, loss_scale, grad_norm, skipped};
every --log-interval iterations the log line and a record {iteration, elapsed_ms_per_iteration,
tokens_per_s[, mfu]}; per evaluation the validation line and {iteration, valid_<loss key>, ..._ppl}.
Loss keys come from the loss function's reporting dict ('lm loss' -> 'lm_loss').
"""

import datetime
import json
import math
import os
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

# Dense bf16 peak of common accelerators, for the MFU estimate (FLOP/s).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def print_rank_0(*args):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def mfu(flops_per_iteration: Optional[float], seconds: float, device: torch.device, dp: int) -> Optional[float]:
    """Model FLOPs utilization against the GPU's dense bf16 peak; None off CUDA or for an unknown GPU."""
    if device.type != "cuda" or flops_per_iteration is None:
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None if peak is None else flops_per_iteration / (seconds * peak * dp)


def _record_key(name: str) -> str:
    return name.replace(" ", "_")


class MetricsWriter:
    """Rank 0: one JSON object per line (always, when a path is given) plus TensorBoard when installed."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str]):
        self.enabled = dist.get_rank() == 0
        self.file = None
        self.tb = None
        if not self.enabled:
            return
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.file = open(path, "a")
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=tensorboard_dir)
            except ImportError:
                print_rank_0("> tensorboard is not installed: writing only the JSONL metrics")

    def write(self, record: dict):
        if not self.enabled:
            return
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb:
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)) and value is not None:
                    self.tb.add_scalar(key, value, record["iteration"])

    def close(self):
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


class TrainingLog:
    """Collects each iteration's numbers; prints Megatron's log line every `log_interval` iterations.

    Args:
        args: train_iters, log_interval, global_batch_size, seq_length, metrics_file, tensorboard_dir.
        device, dp: where and on how many ranks the run trains (for MFU).
        flops_per_iteration: model FLOPs of one iteration, or None (no MFU).
    """

    def __init__(self, args, device: torch.device, dp: int, flops_per_iteration: Optional[float]):
        self.train_iters, self.log_interval = args.train_iters, args.log_interval
        self.global_batch_size = args.global_batch_size
        self.tokens_per_iteration = args.global_batch_size * args.seq_length
        self.device, self.dp, self.flops = device, dp, flops_per_iteration
        self.metrics = MetricsWriter(args.metrics_file, args.tensorboard_dir)
        self._losses, self._iterations, self._skipped, self._nan = [], 0, 0, 0
        self._trained = 0.0  # seconds of training in this log interval (what the line divides by its iterations)
        self.restart_timer()

    def restart_timer(self):
        """Leave the time since the last recorded iteration (an evaluation, a checkpoint) out of the iteration
        time. Like Megatron's paused 'interval-time' timer: the interval's iterations and training time so far
        are kept, so a save in the middle of a log interval does not shrink ms/iteration."""
        self._start = time.perf_counter()

    def interval_state(self) -> dict:
        """The current log interval's sums (plain data): live recovery carries them across a re-forming, so that
        the next line covers the whole interval, as the uninterrupted run's does."""
        return {"losses": list(self._losses), "iterations": self._iterations, "skipped": self._skipped,
                "nan": self._nan, "trained": self._trained}

    def load_interval_state(self, state: dict):
        """Continue the interval that interval_state() described (another log's, of the same run)."""
        self._losses, self._iterations = list(state["losses"]), state["iterations"]
        self._skipped, self._nan, self._trained = state["skipped"], state["nan"], state["trained"]

    def training(self, iteration: int, consumed: int, losses: Dict[str, float], lr: float, loss_scale: float,
                 grad_norm: Optional[float], update_successful: bool, timed: bool = True, write: bool = True):
        """Record one iteration; at a log interval (and the last iteration) print Megatron's line. As in
        Megatron, the losses are averaged over the iterations that updated the model and whose loss was
        finite; skipped (fp16 overflow) and NaN iterations are counted instead. `timed` False: an iteration
        computed before this log existed (live recovery's catch-up), logged but left out of ms/iteration (a line
        with no timed iteration has no time, throughput or MFU). `write` False: an iteration another log wrote
        already (live recovery: a rank 0 that is gone): it only joins the interval's sums."""
        if write:
            self.metrics.write({"iteration": iteration, "consumed_samples": consumed,
                                **{_record_key(k): v for k, v in losses.items()}, "lr": lr,
                                "loss_scale": loss_scale, "grad_norm": grad_norm, "skipped": not update_successful})
        now = time.perf_counter()
        if timed:
            self._trained, self._iterations = self._trained + now - self._start, self._iterations + 1
        self._start = now
        if not update_successful:
            self._skipped += 1
        elif not all(math.isfinite(v) for v in losses.values()):
            self._nan += 1
        else:
            self._losses.append(losses)
        if iteration % self.log_interval and iteration != self.train_iters:
            return
        if write:
            self._write_line(iteration, consumed, lr, loss_scale, grad_norm)
        self._losses, self._iterations, self._skipped, self._nan = [], 0, 0, 0
        self._trained = 0.0
        self.restart_timer()

    def _write_line(self, iteration: int, consumed: int, lr: float, loss_scale: float, grad_norm: Optional[float]):
        """Megatron's line for the interval ending at `iteration`, and its timing record."""
        elapsed = self._trained / self._iterations if self._iterations else None
        utilization = mfu(self.flops, elapsed, self.device, self.dp) if elapsed is not None else None
        line = (f" [{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
                f" iteration {iteration:8d}/{self.train_iters:8d} | consumed samples: {consumed:12d} | ")
        if elapsed is not None:
            line += (f"elapsed time per iteration (ms): {elapsed * 1000:.1f} | "
                     f"throughput (tokens/s): {self.tokens_per_iteration / elapsed:.0f} | ")
        if utilization is not None:
            line += f"MFU: {utilization * 100:.1f}% | "
        line += f"learning rate: {lr:.6E} | global batch size: {self.global_batch_size:5d} | "
        for key in (self._losses[-1] if self._losses else {}):
            line += f"{key}: {sum(d[key] for d in self._losses) / len(self._losses):.6E} | "
        line += f"loss scale: {loss_scale:.1f} | "
        if grad_norm is not None:
            line += f"grad norm: {grad_norm:.3f} | "
        line += f"number of skipped iterations: {self._skipped:3d} | number of nan iterations: {self._nan:3d} |"
        print_rank_0(line)
        if elapsed is not None:
            self.metrics.write({"iteration": iteration, "elapsed_ms_per_iteration": elapsed * 1000,
                                "tokens_per_s": self.tokens_per_iteration / elapsed,
                                **({"mfu": utilization} if utilization else {})})

    def validation(self, iteration: int, losses: Dict[str, float]):
        """Print the validation losses and their perplexities between dashed lines."""
        record, line = {"iteration": iteration}, f" validation loss at iteration {iteration} | "
        for key, value in losses.items():
            ppl = float("inf") if value > 80 else float(torch.tensor(value).exp())
            line += f"{key} value: {value:.6E} | {key} PPL: {ppl:.6E} | "
            record.update({f"valid_{_record_key(key)}": value, f"valid_{_record_key(key)}_ppl": ppl})
        print_rank_0("-" * 100 + "\n" + line.rstrip() + "\n" + "-" * 100)
        self.metrics.write(record)
        self.restart_timer()

    def close(self):
        self.metrics.close()
