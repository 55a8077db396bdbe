"""Live recovery: the training loop that survives the loss of a rank without restarting the others.

    python -m megatron_lite.fault_tolerance.launch --nproc-per-node 4 pretrain_gpt.py \\
        --use-distributed-optimizer --num-distributed-optimizer-instances 2 ...

Started by the supervisor (launch.py), pretrain_gpt.py runs pretrain_live() instead of pretrain(). When rank 3
of dp=4, R=2 dies::

    rank 3 killed   supervisor: generation 1, replaced [3]; starts a new rank 3 (only that process)
    ranks 0-2       a collective fails (gloo: at once with the dead rank; behind a survivor that left, once
                    that survivor freed its groups; a hung peer: the collective timeout)
                    -> snapshot: the state of the last iteration this rank completed (healing.take_snapshot)
                    -> last words; this generation's groups freed
                    -> wait for generation 1; join it: a fresh gloo WORLD on the store prefix gen_1
    every rank      build the model, optimizer, scheduler anew (the same construction collectives on every
                    rank), then heal:
                      agree (one all_gather_object): target = the newest iteration a survivor completed
                      survivors load their snapshot; a replica at the target sends its shard to every rank
                      that lacks it (send_shard_state / recv_shard_state); the schedule, the data position,
                      the RNG and the optimizer's common state come from the lowest up-to-date rank
    every rank      redo the interrupted iteration, and on

The processes of the survivors, and their state, never go away: the model, the optimizer state, the data
position and the RNG are carried in memory into the objects of the new generation (their wrappers are
re-created because they hold the old process groups). No update is ever applied without every instance's
gradient: an iteration is either completed by a rank (its update applied) or not, and a rank behind the
target takes the target's state from a replica, so the loss sequence and the weights are the uninterrupted
run's, bit for bit. When a shard has no holder at the target (both holders of a shard lost), the workers
exit with EXIT_FALLBACK after writing their last words, and the supervisor restarts the whole job (--load).
"""

import dataclasses
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from ..checkpointing import lock_save_directory
from ..checkpointing.files import set_commit_guard, unlock_save_directory
from ..checkpointing.rng import get_rng_state
from ..distributed import collectives
from ..training.initialize import initialize_megatron, shutdown
from ..training.loop import History, LoopHooks, TrainingLoop, evaluation_due, save_due
from ..training.metrics import print_rank_0
from ..training.training import check_train_data, resume, setup_model_and_optimizer
from .elastic import check_elastic, generation_args, instance_size
from .healing import LiveRecoveryImpossible, Progress, Snapshot, heal, take_snapshot
from .membership import (
    EXIT_FALLBACK,
    EXIT_FENCED,
    Fenced,
    GenerationEnded,
    GenerationSuperseded,
    JobFinished,
    Membership,
    process_group_backend,
)


@dataclass
class Timings:
    """When the phases of one recovery ended on this rank (time.time()), for the log; the soak lines them up
    across ranks and with the kill."""

    failed_at: float  # a survivor: its collective failed; a replacement: its process started
    role: str = "survivor"
    marks: Dict[str, float] = field(default_factory=dict)

    def mark(self, name: str):
        self.marks[name] = time.time()


def _is_peer_failure(error: BaseException) -> bool:
    """A collective that failed because of another rank (gloo's errors, a timeout), not this rank's bug."""
    text = str(error).lower()  # gloo raises plain RuntimeErrors: "Connection reset/closed by peer", "Timed out
    # waiting 3000ms for recv", "Application timeout caused pair closure" (a peer's timeout closed the pair);
    # a generation abandoned under a save: rank 0's commit guard raised Fenced, the others hear of it by name
    return isinstance(error, (dist.DistError, GenerationSuperseded, GenerationEnded, Fenced)) or (
        isinstance(error, RuntimeError) and any(s in text for s in ("gloo", "connection", "timed out", "timeout",
                                                                    "pair closure", "fenced")))


def pretrain_live(args, train_valid_test_datasets_provider: Callable, model_provider: Callable,
                  forward_step_func: Callable, flops_per_iteration: Optional[Callable] = None) -> dict:
    """pretrain() under the live-recovery supervisor (same arguments). Returns {'iteration', 'losses',
    'valid_losses', 'recoveries'} ('iteration' None on a rank that was never admitted back before
    training ended: elastic mode)."""
    run = _LiveRun(args, train_valid_test_datasets_provider, model_provider, forward_step_func, flops_per_iteration)
    while True:
        try:
            return run.train_generation()
        except JobFinished as e:  # elastic: training ended while this rank waited to be admitted
            print(f"[rank {run.membership.rank}] > {e}", flush=True)
            return {"iteration": None, "losses": run.history.losses, "valid_losses": run.history.valid_losses,
                    "recoveries": run.recoveries}
        except (LiveRecoveryImpossible, TimeoutError) as e:
            _fall_back(f"live recovery is impossible: {e}")
        except BaseException as e:
            if isinstance(e, Fenced) and e.slot_lost:  # another process owns this slot now
                _exit_fenced(e)
            # Last words first, as pretrain() leaves them: with replicas the survivors' files of a single
            # failure form a complete set, which the whole-job restart (the fallback) resumes from.
            if run.loop is not None and not isinstance(e, GenerationEnded):
                try:
                    run.loop.write_last_words(e)
                except Fenced as fenced:  # the commit guard: this slot is another process's now
                    _exit_fenced(fenced)
            if not _is_peer_failure(e):
                raise
            run.leave_generation(e)


class _LiveRun:
    """pretrain_live's state: what this process carries from one generation to the next (the snapshot, the
    history of losses, the recovery timings) and the objects of the current generation (the model, optimizer,
    scheduler and its TrainingLoop), which hold its process groups and are dropped when it fails.

    One generation: train_generation() (join and build, start or heal, catch up, then the shared
    TrainingLoop, which reaches this run through LoopHooks: the progress record staged and committed with
    the last words', the snapshot when train_step fails, rank 0's notes in the store, the elastic leave); a
    peer's failure: leave_generation() (snapshot, free the groups, wait for the next generation)."""

    def __init__(self, args, train_valid_test_datasets_provider: Callable, model_provider: Callable,
                 forward_step_func: Callable, flops_per_iteration: Optional[Callable]):
        if args.async_save:
            # pretrain()'s background save runs DCP's collectives on a process group of its own; a peer's
            # death during it would leave that thread inside a group the failed generation has torn down.
            raise ValueError("--async-save is not supported under live recovery (fault_tolerance.launch): drop "
                             "it (the live loop saves synchronously), or run under torchrun")
        self.job_args = self.args = args  # the job's arguments; self.args: the current generation's (elastic)
        self.train_valid_test_datasets_provider = train_valid_test_datasets_provider
        self.model_provider, self.forward_step_func = model_provider, forward_step_func
        self.flops_per_iteration = flops_per_iteration
        self.membership = Membership.from_env()
        # Checkpoints and last words are committed only while this process still owns its slot (and, for a
        # checkpoint, trains in a generation nobody abandoned): a process cut off from the job writes nothing.
        set_commit_guard(self.membership.guard_commit)
        if self.membership.config.elastic:
            check_elastic(args, self.membership.config.min_instances)
            # Before joining: the supervisor can then shrink a job whose rank is late from the start.
            self.membership.publish_instance_size(instance_size(args))
        self.snapshot: Optional[Snapshot] = None
        self.model = self.optimizer = self.scheduler = None
        self.loop: Optional[TrainingLoop] = None
        self.progress: Optional[Progress] = None  # the last completed iteration's record, once consistent
        self.staged: Optional[Progress] = None  # the record of the iteration about to complete
        self.history, self.recoveries = History(), []
        self.hooks = LoopHooks(before_update=self._stage, step_failed=self._snapshot_interrupted_step,
                               iteration_completed=self._commit, iteration_logged=self._logged,
                               iteration_evaluated=self._note_evaluated, iteration_ended=self._leave_if_due)
        # A replacement (a process started for a generation after a fresh start of every rank) times its own
        # start (process start -> first iteration) as a recovery of its own.
        fresh_job = set(self.membership.replaced()) == set(range(self.membership.world_size))
        self.timings: Optional[Timings] = None if fresh_job else Timings(time.time(), role="replacement")

    def train_generation(self) -> dict:
        """Join the current generation and train in it to the end. Returns pretrain_live's summary; raises
        whatever interrupted the generation."""
        device, train_ds, valid_ds = self._form_generation()
        args = self.args
        if args.save:  # the generation's rank 0 holds it: a replaced rank 0 takes it once the dead one is gone,
            # or goes on without it while a rank 0 of this job's earlier generation (hung, cut off) still holds it
            lock_save_directory(args.save, job=os.environ.get("TORCHELASTIC_RUN_ID"))
        progress = self._resume(train_ds)
        self.loop = TrainingLoop(args, self.forward_step_func, self.model, self.optimizer, self.scheduler, train_ds,
                                 valid_ds, device, self.flops_per_iteration, progress.iteration, progress.consumed,
                                 progress.last_saved, self.hooks, self.history)
        self._catch_up(progress)
        self.loop.run()
        self.loop.log.close()
        self.loop.drop_last_words()
        if args.save:  # the job's saves are over (agreed by the last one): rank 0 releases it, as pretrain() does
            unlock_save_directory(args.save)
        if dist.get_rank() == 0:
            self.membership.note_finished(self.loop.iteration)
        return {"iteration": self.loop.iteration, "losses": self.history.losses,
                "valid_losses": self.history.valid_losses, "recoveries": self.recoveries}

    def _form_generation(self):
        """Join the generation's process group and build the model, optimizer and scheduler anew (the same
        construction collectives on every rank). Returns (device, training dataset, validation dataset)."""
        self.membership.join(*process_group_backend(self.job_args.distributed_backend, self.job_args.device))
        if self.timings is not None:
            self.timings.mark("joined")
        self.args = args = generation_args(self.job_args, len(self.membership.members()))
        if args is not self.job_args:
            print_rank_0(f"> generation {self.membership.generation}: ranks {self.membership.members()} of "
                         f"{self.job_args.data_parallel_size} (elastic): dp={args.data_parallel_size}, "
                         f"{args.num_distributed_optimizer_instances} instance(s), {args.num_micro_batches} "
                         f"micro-batches of {args.micro_batch_size} per rank")
        device, tokenizer = initialize_megatron(args)
        train_ds, valid_ds, _ = collectives.run_collectively(self.train_valid_test_datasets_provider, args, tokenizer)
        if getattr(args, "torch_compile", False):
            # Dynamo reuses code compiled for the previous generation's model and does not guard on module
            # hooks, which hold that generation's process groups: compile this generation's model afresh.
            torch._dynamo.reset()
        self.model, self.optimizer, self.scheduler = setup_model_and_optimizer(self.model_provider, args, device)
        self.membership.limit_group_timeouts()  # the groups the model just created, too
        return device, train_ds, valid_ds

    def _resume(self, train_ds) -> Progress:
        """Bring the new objects to where training stands: healed from the survivors' snapshots and the
        replicas, or, when no rank of the generation holds any state (the job starting, or restarted whole,
        also if a rank died or the job shrank while it started), from scratch or --load as pretrain() starts.
        All ranks decide together (heal's first collective). Returns the progress every rank continues from."""
        progress = heal(self.snapshot, self.model, self.optimizer, self.scheduler)
        if progress is None:
            progress = _start(self.args, self.model, self.optimizer, self.scheduler, train_ds)
        elif self.timings is not None:
            self.timings.mark("healed")
        self.snapshot, self.progress = None, progress
        return progress

    def _catch_up(self, progress: Progress):
        """What the failure interrupted after an iteration completed: its log line (when the survivors
        completed it but it was never logged), its evaluation and its periodic save."""
        args, loop = self.args, self.loop
        if progress.losses is not None:  # healed: the log takes up the interval where the healed state left it
            if progress.log_interval is not None:
                loop.log.load_interval_state(progress.log_interval)
            # The iteration joins the interval's sums; written only if rank 0 never wrote it (its survivors
            # completed it, and rank 0 is new or failed first): then with its carried grad norm and skip.
            write = progress.iteration > self.membership.last_logged()
            loop.log_iteration(progress.losses, progress.grad_norm, progress.update_successful, timed=False,
                               write=write)
            if write:
                self._note_logged(progress.iteration)
            if evaluation_due(args, progress.iteration, loop.valid_ds) \
                    and progress.iteration > self.membership.last_evaluated():  # its evaluation not logged
                loop.evaluate()
                self._note_evaluated(progress.iteration)
        if save_due(args, progress.iteration) and progress.last_saved != progress.iteration and progress.iteration > 0:
            loop.save()  # interrupted by the failure: again
        loop.log.restart_timer()  # the recovery is not training time

    # ------------------------------------------------------------------ the loop's hooks (LoopHooks)
    def _stage(self, losses: Dict[str, float]):
        """Just before optimizer.step(): the record of the iteration about to complete (as LastWords.stage's:
        the RNG after backward, the scheduler as it will be after its step; and the log interval's sums).
        NCCL: first, no update from reductions an abort may have cut short (Membership.check_reductions)."""
        self.membership.check_reductions()
        loop, scheduler = self.loop, self.scheduler
        scheduled = {**scheduler.state_dict(), "num_steps": scheduler.num_steps + 1}
        self.staged = Progress(loop.iteration + 1, loop.consumed + self.args.global_batch_size, get_rng_state(),
                               scheduled, self.optimizer.steps_taken + 1, losses, loop.last_saved,
                               log_interval=loop.log.interval_state())

    def _snapshot_interrupted_step(self):
        """train_step raised: this rank's consistent state (its update may or may not have been applied)."""
        self.snapshot = take_snapshot(self._completed(), self.staged, self.optimizer, self.scheduler)

    def _commit(self, losses: Dict[str, float], grad_norm: Optional[float], update_successful: bool):
        """The iteration completed: its record is what a failure from now on snapshots."""
        self.progress = dataclasses.replace(self.staged, scheduler=self.scheduler.state_dict(),
                                            steps_taken=self.optimizer.steps_taken, losses=losses,
                                            grad_norm=grad_norm, update_successful=update_successful)
        self.staged = None

    def _completed(self) -> Progress:
        """The last completed iteration's record, with the loop's last save (a save after it completed)."""
        if self.loop is None:
            return self.progress
        return dataclasses.replace(self.progress, last_saved=self.loop.last_saved)

    def _logged(self, iteration: int):
        """After an iteration's log record: rank 0 notes it in the store (a replacement rank 0 logs from
        there); the first iteration after a recovery reports the recovery's timings."""
        self._note_logged(iteration)
        if self.timings is not None:
            self.timings.mark("redone")
            self.recoveries.append(_report(self.timings, self.membership.generation))
            self.timings = None

    def _note_logged(self, iteration: int):
        if dist.get_rank() == 0:
            self.membership.note_logged(iteration)

    def _note_evaluated(self, iteration: int):
        if dist.get_rank() == 0:
            self.membership.note_evaluated(iteration)

    def _leave_if_due(self, iteration: int):
        """Elastic: leave the generation after `iteration` when the supervisor asks, to admit the ranks that
        are back (GenerationEnded: leave_generation, then the next generation)."""
        if self.membership.config.elastic and iteration < self.args.train_iters \
                and self.membership.leave_due(iteration):
            raise GenerationEnded(f"leaving generation {self.membership.generation} after iteration "
                                  f"{iteration} to admit the ranks that are back")

    # ------------------------------------------------------------------ a peer's failure
    def leave_generation(self, error: BaseException):
        """After a peer's failure interrupted this generation: keep this rank's consistent state (the
        snapshot), free the generation's process groups and wait for the supervisor's next generation."""
        if self.snapshot is None and self.progress is not None:  # a failure outside train_step (a save, the log)
            self.snapshot = take_snapshot(self._completed(), None, self.optimizer, self.scheduler)
        self.progress = self.staged = None
        # Free this generation's process groups now: gloo cannot abort an operation, but a group that is freed
        # closes its connections, so a survivor blocked in a collective with this rank fails at once instead of
        # at the collective timeout. Everything that refers to a group goes: the model (and the hooks its
        # parameters hold), the optimizer, the loop with its last words, the traceback's frames.
        traceback.clear_frames(error.__traceback__)
        if self.model is not None:
            self.model.remove_grad_hooks()
        if self.loop is not None:
            self.loop.drop_last_words()  # its SIGTERM watcher holds the optimizer, and with it the groups
        self.loop = self.model = self.optimizer = self.scheduler = None
        collectives.forget_instance_groups()  # the instance groups every wrapper shared
        self.membership.leave()  # gloo: destroyed; NCCL: the communicators aborted first
        gc.collect()
        membership = self.membership
        if isinstance(error, GenerationEnded):  # elastic grow: not a failure
            self.timings = Timings(time.time(), role="grow")
            print(f"[rank {membership.rank}] > {error}", flush=True)
        else:
            self.timings = self.timings or Timings(time.time())
            print(f"[rank {membership.rank}] > generation {membership.generation} failed ({type(error).__name__}: "
                  f"{str(error).splitlines()[0][:160]}); waiting for the next one", flush=True)
        try:
            membership.wait_for_next_generation(failed=not isinstance(error, GenerationEnded))
        except TimeoutError as timeout:
            _fall_back(str(timeout))
        self.timings.mark("next_generation")
        if membership.rank not in membership.members():
            self.timings.role = "parked"  # elastic shrink: this rank's instance is left out until it is whole
        print(f"[rank {membership.rank}] > joining generation {membership.generation} (replaced: "
              f"{membership.replaced()}, members: {membership.members()})", flush=True)


def _start(args, model, optimizer, scheduler, train_ds) -> Progress:
    """The first generation: from scratch or --load with its options, as pretrain() starts (the data checked
    to last to --train-iters from the loaded position)."""
    iteration, consumed, loaded = resume(args, model, optimizer, scheduler)
    check_train_data(args, train_ds, iteration, consumed)
    return Progress(iteration, consumed, get_rng_state(), scheduler.state_dict(), optimizer.steps_taken,
                    last_saved=iteration if loaded else None)


def _report(timings: Timings, generation: int) -> dict:
    """The recovery's phases on this rank: when it failed (or started), when the supervisor's new generation
    came, when every rank had arrived and the groups were formed, when the state was healed and when the
    redone iteration completed (epoch seconds, one JSON line; the soak subtracts them)."""
    out = {"rank": dist.get_rank(), "generation": generation, "role": timings.role, "failed": timings.failed_at,
           **timings.marks}
    _write_line(f"[rank {out['rank']}] > recovered into generation {generation}: {json.dumps(out)}")
    return out


def _write_line(text: str):
    """`text` as one line of standard output in a single write(): the ranks share the supervisor's output, and
    a line written in pieces (print() writes the text and the newline apart when Python's output is unbuffered)
    can be cut by another rank's, which breaks a record that tools parse."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (captured): nothing shares it
        print(text, flush=True)
        return
    sys.stdout.flush()  # what was printed before comes first
    data = (text + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _exit_fenced(error: Fenced):
    """End this process at once (EXIT_FENCED) without writing anything: its slot belongs to another process
    now (its node was replaced while it was cut off or frozen), whose state is the job's. Its agent ignores the
    exit; the job goes on without it."""
    print(f"[rank {os.environ.get('RANK', '?')}] > {error}: exiting with code {EXIT_FENCED}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_FENCED)


def _fall_back(reason: str):
    """Give up live recovery (the supervisor then restarts the whole job, which resumes with --load from the
    newest complete last words, written at the first failure, or the periodic checkpoint).

    The process ends at once, without the interpreter's finalization (training.shutdown): finalizing with
    live gloo groups took about 2 s per rank here, which delays the restart, and gloo's threads can abort
    it (SIGABRT), which the supervisor would take for a death to replace rather than a fallback. Everything
    worth keeping is written already (the last words; the metrics file is flushed line by line)."""
    print(f"[rank {dist.get_rank() if dist.is_initialized() else '?'}] > {reason}", flush=True)
    shutdown(EXIT_FALLBACK)
