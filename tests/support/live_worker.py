"""pretrain_gpt.py with faults injected, for tests/training/test_live_recovery.py (run by the live supervisor).

LIVE_FAULTS="rank:iteration:phase:started;..." kills (SIGKILL, no clean-up) the process of `rank` that was
`started` for a generation (0: the first processes, survivors included) or as warm spare i (`spare<i>`, whatever
generation it is assigned to: a spurious re-forming shifts the numbers) when it reaches `phase` of `iteration`:

    forward_backward   the forward of the second micro-batch of the iteration (one backward done)
    stop               not a kill: SIGSTOP there instead (a hung process; the supervisor must replace it)
    raise              not a kill: a RuntimeError there instead (this rank's own error: exit 1)
    delay              not a fault: DELAY_S seconds of sleep there (a rank slowed down by a loaded machine)
    wait               not a fault: the rank sleeps there (at most 120 s) until the job is stopped (the test sends
                       the supervisor SIGTERM once it reads the line this prints)
    update             right after the local optimizer update, before the parameter all-gather
    save               the periodic checkpoint saved after the iteration
    evaluate           the evaluation after the iteration
    log                the iteration's log record, after the iteration (the others complete it and go on)
    send / recv        healing: sending / receiving a shard to / from a replica (iteration ignored)
    hold               not a kill: the process waits, before it starts training, until rank 0 has logged
                       `iteration` (a replacement that comes back late, for elastic mode)
    grow               not a kill: after `iteration`, the rank waits until the supervisor asks its generation
                       to leave for a grow (elastic mode: the held replacement is then surely back in time)

`started` may also be "new": any process but the first ones (a replacement, a warm spare or not). The
stop and raise faults happen once per job (a marker file in LIVE_FAULTS_DIR): the processes that redo the
iteration after them, "new" too, go on.
"""

import os
import signal
import sys
import time

from pretrain_testing import REPO

sys.path.insert(0, REPO)

import pretrain_gpt  # noqa: E402
from megatron_lite.fault_tolerance import live_training, membership  # noqa: E402
from megatron_lite.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402
from megatron_lite.optimizer.full_param_optimizer import _FullParamOptimizer  # noqa: E402
from megatron_lite.optimizer.optimizer import MegatronOptimizer  # noqa: E402
from megatron_lite.training import loop  # noqa: E402


def fault(phase: str):
    """The iteration at which this process dies in `phase`, or None. Read when asked: a warm spare learns its
    rank and generation only once assigned."""
    spare = os.environ.get(membership.ENV_SPARE)
    started = f"spare{spare}" if spare else os.environ.get(membership.ENV_GENERATION, "0")
    for spec in filter(None, os.environ.get("LIVE_FAULTS", "").split(";")):
        fault_rank, iteration, fault_phase, fault_started = spec.split(":")
        if fault_started == "new" and started != "0":
            fault_started = started
        if (fault_rank, fault_phase, fault_started) == (os.environ.get("RANK"), phase, started):
            return int(iteration)
    return None


def first_time(spec: str) -> bool:
    """Whether this is the first time `spec` fires in the job (creates its marker in LIVE_FAULTS_DIR)."""
    try:
        os.close(os.open(os.path.join(os.environ["LIVE_FAULTS_DIR"], f"fired_{spec}"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def wait_for(store, done, what: str):
    deadline = time.monotonic() + 120
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {os.environ['RANK']}: {what} did not happen within 120 s")
        time.sleep(0.01)


original_leave_due = membership.Membership.leave_due


def leave_due(self, iteration):
    if fault("grow") == iteration:
        wait_for(self.store, lambda: self.store.check([f"gen_{self.generation}/leave_at"]), "the grow")
        print(f"[rank {self.rank}] > injected fault: waited for the grow after iteration {iteration}", flush=True)
    return original_leave_due(self, iteration)


membership.Membership.leave_due = leave_due


def hold():
    """The "hold" fault: wait (polling the supervisor's store, with a deadline) until rank 0 logged the
    iteration."""
    iteration = fault("hold")
    if iteration is None:
        return
    store = membership.connect_store(os.environ[membership.ENV_STORE], 60)
    wait_for(store, lambda: membership.last_logged(store) >= iteration, f"iteration {iteration} logged")
    print(f"[rank {os.environ['RANK']}] > injected fault: held until iteration {iteration} was logged", flush=True)


completed = {"steps": 0, "micro_batches": 0, "iteration": 0}
original_forward_step = pretrain_gpt.forward_step
DELAY_S = 5.0


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
    at = completed["iteration"] if completed["micro_batches"] == 2 else None  # stop, raise, delay: the iteration
    if at is not None and fault("stop") == at and first_time(f"{os.environ['RANK']}_{at}_stop"):
        print(f"[rank {os.environ['RANK']}] > injected fault: stopped (SIGSTOP) at forward_backward", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    if at is not None and fault("raise") == at and first_time(f"{os.environ['RANK']}_{at}_raise"):
        raise RuntimeError(f"injected exception on rank {os.environ['RANK']} at iteration {at}")
    if at is not None and fault("delay") == at:
        print(f"[rank {os.environ['RANK']}] > injected delay: {DELAY_S} s at forward_backward", flush=True)
        time.sleep(DELAY_S)
    if at is not None and fault("wait") == at:
        print(f"[rank {os.environ['RANK']}] > injected wait for SIGTERM at forward_backward", flush=True)
        time.sleep(120)
    return original_forward_step(data_iterator, model)


def count_step(optimizer):
    completed["micro_batches"] = 0


original_step = MegatronOptimizer.step


def step(self):
    result = original_step(self)
    completed["steps"] = self.steps_taken
    return result


# Every optimizer: the distributed one and the non-sharded ones (--data-parallel-sharding-strategy no_shard)
MegatronOptimizer.step = step
patch(MegatronOptimizer, "zero_grad", count_step)
for optimizer_class in (DistributedOptimizer, _FullParamOptimizer):
    patch(optimizer_class, "_copy_main_params_to_model_params",
          lambda self: fault("update") == self.steps_taken and die("update"))
patch(loop, "save_checkpoint",
      lambda root, iteration, *args, **kwargs: fault("save") == iteration and die("save"))
patch(loop, "evaluate_validation",
      lambda *args, **kwargs: fault("evaluate") == completed["steps"] and die("evaluate"))
patch(loop.TrainingLoop, "log_iteration",  # not the catch-up's record (untimed), which a replacement writes
      lambda self, *args, **kwargs: kwargs.get("timed", True) and fault("log") == self.iteration and die("log"))
patch(loop.TrainingLoop, "train_iteration",  # the iteration it runs (steps_taken may differ after --load)
      lambda self: completed.update(iteration=self.iteration + 1))
for optimizer_class in (DistributedOptimizer, MegatronOptimizer):
    patch(optimizer_class, "send_shard_state", lambda self, dst: fault("send") is not None and die("send"))
    patch(optimizer_class, "recv_shard_state", lambda self, src: fault("recv") is not None and die("recv"))
pretrain_gpt.forward_step = forward_step

if __name__ == "__main__":
    args = pretrain_gpt.parse_args()
    hold()
    live_training.pretrain_live(args, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                                forward_step)
    pretrain_gpt.shutdown()
