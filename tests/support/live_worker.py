"""pretrain_gpt.py with faults injected, for tests/training/test_live_recovery.py (run by the live supervisor).

LIVE_FAULTS="rank:iteration:phase:started;..." kills (SIGKILL, no clean-up) the process of `rank` that was
`started` for a generation (0: the first processes, survivors included) or as warm spare i (`spare<i>`, whatever
generation it is assigned to: a spurious re-forming shifts the numbers) when it reaches `phase` of `iteration`:

    forward_backward   the forward of the second micro-batch of the iteration (one backward done)
    update             right after the local optimizer update, before the parameter all-gather
    save               the periodic checkpoint saved after the iteration
    send / recv        healing: sending / receiving a shard to / from a replica (iteration ignored)
"""

import os
import signal
import sys

from pretrain_testing import REPO

sys.path.insert(0, REPO)

import pretrain_gpt  # noqa: E402
from megatron_lite.fault_tolerance import live_training, membership  # noqa: E402
from megatron_lite.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402


def fault(phase: str):
    """The iteration at which this process dies in `phase`, or None. Read when asked: a warm spare learns its
    rank and generation only once assigned."""
    spare = os.environ.get(membership.ENV_SPARE)
    started = f"spare{spare}" if spare else os.environ.get(membership.ENV_GENERATION, "0")
    for spec in filter(None, os.environ.get("LIVE_FAULTS", "").split(";")):
        fault_rank, iteration, fault_phase, fault_started = spec.split(":")
        if (fault_rank, fault_phase, fault_started) == (os.environ.get("RANK"), phase, started):
            return int(iteration)
    return None


completed = {"steps": 0, "micro_batches": 0}
original_forward_step = pretrain_gpt.forward_step


def die(phase: str):
    print(f"[rank {os.environ['RANK']}] > injected fault: killed at {phase}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def patch(owner, name, before):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        before(*args, **kwargs)
        return original(*args, **kwargs)
    setattr(owner, name, wrapper)


def forward_step(data_iterator, model):
    completed["micro_batches"] += 1
    if fault("forward_backward") == completed["steps"] + 1 and completed["micro_batches"] == 2:
        die("forward_backward")
    return original_forward_step(data_iterator, model)


def count_step(optimizer):
    completed["micro_batches"] = 0


original_step = DistributedOptimizer.step


def step(self):
    result = original_step(self)
    completed["steps"] = self.steps_taken
    return result


DistributedOptimizer.step = step
patch(DistributedOptimizer, "zero_grad", count_step)
patch(DistributedOptimizer, "_copy_main_params_to_model_params",
      lambda self: fault("update") == self.steps_taken and die("update"))
patch(live_training, "save_checkpoint",
      lambda root, iteration, *args, **kwargs: fault("save") == iteration and die("save"))
patch(DistributedOptimizer, "send_shard_state", lambda self, dst: fault("send") is not None and die("send"))
patch(DistributedOptimizer, "recv_shard_state", lambda self, src: fault("recv") is not None and die("recv"))
pretrain_gpt.forward_step = forward_step

if __name__ == "__main__":
    args = pretrain_gpt.parse_args()
    live_training.pretrain_live(args, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                                forward_step)
    pretrain_gpt.shutdown()
