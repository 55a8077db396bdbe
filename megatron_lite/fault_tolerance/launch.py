"""The live-recovery supervisor: starts the ranks, and when one dies restarts that rank only.

    python -m megatron_lite.fault_tolerance.launch --nproc-per-node 4 [--max-replacements 20]
        [--collective-timeout 30] [--join-timeout 60] [--max-restarts 1]
        [--min-instances 1 [--replacement-timeout 10]] pretrain_gpt.py ARGS...

torchrun's agent cannot do this: on a worker's failure it stops every local worker and restarts them all
(torch.distributed.elastic's LocalElasticAgent; `--max-restarts` counts those whole-group restarts), which
is the restart-everything path (docs/fault_tolerance.md). This supervisor keeps torchrun's conventions: the
workers' environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ROLE_NAME,
MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID / _RESTART_COUNT / _MAX_RESTARTS / _USE_AGENT_STORE; OMP_NUM_THREADS=1,
said once, when it is unset and there are several ranks: the thread count changes a run's bits), a c10d
TCPStore it hosts, and SIGTERM / SIGINT / SIGHUP / SIGQUIT forwarded to the workers (SIGKILL 30 s later),
then exit code 1; and it adds the generation keys of membership.py:

    a worker exits 0            done (the job ends when every rank is done)
    a worker dies (a signal)    generation += 1, gen_<g>/replaced = [rank]; a process for that rank only: a
                                warm spare (--spares, started ahead with torch imported) or a new one
    a rank reports trouble      (a collective failed, no process died within --trouble-grace seconds):
                                a member that has not reported and whose heartbeat is older than
                                --collective-timeout, or that has not reported --collective-timeout +
                                --trouble-grace after the first report, does not answer (SIGSTOP, a
                                deadlock): it is killed (SIGKILL) and replaced as a dead one; once every
                                member has reported, generation += 1 with no replacement, every rank
                                re-forms the groups
    elastic (--min-instances)   a replacement not back (its process not ready to join) --replacement-timeout
                                seconds after the death: generation += 1 with the complete instances only
                                (shrink; its instance partners wait, alive, to be admitted); once every rank
                                of a left-out instance is ready: gen_<g>/leave_at = an iteration all members
                                have yet to pass, generation += 1 with them all (grow)
    a left-out rank dies        (elastic) only a new process for it, waiting to be admitted like the others
    training finished           ranks not training exit by themselves ('finished'); any left after 30 s are
                                stopped
    a worker exits 3            live recovery is impossible (both holders of a shard lost), or a worker
    (EXIT_FALLBACK) or 1        raised an error of its own (a bug, a NaN: a new process would meet it again):
                                once every other member has written its last words (reported the failed
                                collective) or exited, every worker is stopped and the whole job restarted,
                                which resumes with --load from those last words, up to --max-restarts times
                                (torchrun's behaviour)
    a worker exits 1 (or any    a deterministic refusal at start-up (a ValueError in the set-up: every
    code < 128 but 3 and 4)     start would meet it again): the supervisor stops the others and exits
    before this start of the    with that code
    job logged an iteration
    a worker exits 2            a usage error (argparse: the command line is wrong): every process started
    (EXIT_USAGE)                with it would fail alike, so the supervisor stops the others and exits 2
    a worker exits 4            it could not read the store (its fencing, membership.check_fenced): replaced
    (EXIT_FENCED)               like a dead one
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import torch.distributed as dist

from ..distributed.layout import DataParallelTopology
from . import membership
from .membership import EXIT_FALLBACK, EXIT_FENCED, LiveConfig

EXIT_USAGE = 2
"""argparse's exit code for a bad command line (also Python's for a script it cannot open): not replaced."""

FINISH_GRACE_S = 30.0
"""Seconds the supervisor waits, after training finished, for the ranks that were not training to exit."""

STOP_TIMEOUT_S = 30.0
"""Seconds between the signal that stops the workers and SIGKILL (torchrun's agent waits as long)."""

FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
"""What torchrun's agent forwards to its workers before it exits (TORCHELASTIC_SIGNALS_TO_HANDLE's default)."""


DONE, USAGE, STARTUP_ERROR, FALLBACK, DEAD = "done", "usage", "startup_error", "fallback", "dead"
EXIT_KINDS = {
    USAGE: "(a usage error: the command line is wrong, see its message above)",
    STARTUP_ERROR: "before the job logged an iteration (an error at start-up, see its message above)",
}
"""What the supervisor (and the cluster leader, cluster.py) says of an exit that ends the job."""


def exit_kind(code: int, trained: bool) -> str:
    """What a worker's exit `code` means to the supervisor (the module docstring's table), `trained` whether this
    start of the job logged an iteration: DONE (0), USAGE (2: every process started with this command line
    would fail alike), STARTUP_ERROR (an error of its own, not a signal nor a failed live recovery, before this
    start trained at all: a refusal of the arguments, the data, the checkpoint, which every start would meet
    again), FALLBACK (3, or 1 once trained: a whole-job restart), DEAD (a signal, or EXIT_FENCED: replaced live).
    A fenced process (4) could not read the store or lost its slot: nothing every start would meet again, so
    never a start-up error; one whose slot is still its own is a death (the cluster leader reports only the
    exits of its slots' current processes)."""
    if code == 0:
        return DONE
    if code == EXIT_FENCED:
        return DEAD
    if code == EXIT_USAGE:
        return USAGE
    if 0 < code < 128 and code != EXIT_FALLBACK and not trained:
        return STARTUP_ERROR
    if code in (EXIT_FALLBACK, 1):  # 1: this rank's own error (a Python exception), not a loss
        return FALLBACK
    return DEAD


def stop_processes(procs, signum: int = signal.SIGTERM):
    """Stop `procs` (subprocess.Popen) with `signum`, SIGCONT after it (a stopped process gets the signal at
    once), and with SIGKILL those still there STOP_TIMEOUT_S later, as torchrun's agent stops its workers."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signum)
            proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class SignalReceived(Exception):
    """The supervisor got one of FORWARDED_SIGNALS: stop the workers with it, then exit 1 (as torchrun)."""

    def __init__(self, signum: int):
        super().__init__(f"got {signal.Signals(signum).name}")
        self.signum = signum


def _raise_signal(signum, frame):
    for name in FORWARDED_SIGNALS:  # the first one only: the stop that follows must not be interrupted
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    raise SignalReceived(signum)


class Supervisor:
    """The workers of one job and the store of their generations (see the module docstring)."""

    def __init__(self, command, world_size: int, config: LiveConfig, max_replacements: int, max_restarts: int,
                 trouble_grace_s: float, spares: int = 1, replacement_timeout_s: float = 10.0):
        self.command, self.world_size, self.config = command, world_size, config
        self.max_replacements, self.max_restarts, self.trouble_grace_s = max_replacements, max_restarts, trouble_grace_s
        self.replacement_timeout_s = replacement_timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.run_id = uuid.uuid4().hex[:12]
        self.restarts = 0  # whole-job restarts so far (TORCHELASTIC_RESTART_COUNT)
        self.logged_at_start = 0  # the store's logged_count when this start of the job began
        self.generation = -1  # the first is 0
        self.members = list(range(world_size))  # the ranks training in the current generation
        self.workers = {}  # rank -> Popen
        self.pending = {}  # rank -> pid: replacement processes not yet ready to join (no standby/<rank>)
        self.pending_since = {}  # rank -> when it first needed a replacement (kept across failed replacements)
        self.done = set()
        self.num_spares = spares
        self.spares = []  # [(id, Popen)] warm processes waiting for a rank, oldest first
        self.spare_count = 0
        self.spare_after_logged = None  # replenish the spares once training passed this iteration again

    def say(self, text: str):
        print(f"[supervisor] {text}", flush=True)

    def _env(self, **extra) -> dict:
        """A worker's environment: torchrun's variables (one node, one role; torch.distributed.elastic's
        LocalElasticAgent sets the same names) and the live-recovery ones of membership.py."""
        elastic = {} if self.config.min_instances is None else {
            membership.ENV_MIN_INSTANCES: str(self.config.min_instances)}
        size = str(self.world_size)
        torchrun = {"WORLD_SIZE": size, "LOCAL_WORLD_SIZE": size, "ROLE_WORLD_SIZE": size, "GROUP_RANK": "0",
                    "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(self.store.port), "TORCHELASTIC_RUN_ID": self.run_id,
                    "TORCHELASTIC_RESTART_COUNT": str(self.restarts),
                    "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
                    # The store at MASTER_ADDR/PORT is the supervisor's: an env:// rendezvous connects to it.
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    # torchrun's default (1) tears the survivors down on a peer's NCCL error: 2 aborts the
                    # communicators only, and the survivor recovers live (membership.NCCL_ASYNC_ERROR_HANDLING).
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                                      membership.NCCL_ASYNC_ERROR_HANDLING)}
        return {**os.environ, **torchrun, membership.ENV_STORE: f"127.0.0.1:{self.store.port}",
                membership.ENV_COLLECTIVE_TIMEOUT: str(self.config.collective_timeout_s),
                membership.ENV_JOIN_TIMEOUT: str(self.config.join_timeout_s), **elastic, **extra}

    def spawn(self, rank: int):
        """A process for `rank` in the current generation: a warm spare if one is waiting, else a new one."""
        if self.spares:
            spare, proc = self.spares.pop(0)
            self.store.set(f"spare_{spare}/assign", json.dumps({"rank": rank, "generation": self.generation}))
            self.workers[rank] = proc
            self.say(f"rank {rank}: pid {proc.pid} (generation {self.generation}, warm spare {spare})")
        else:
            env = self._env(RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank),
                            **{membership.ENV_GENERATION: str(self.generation)})
            self.workers[rank] = subprocess.Popen([sys.executable, *self.command], env=env)
            self.say(f"rank {rank}: pid {self.workers[rank].pid} (generation {self.generation})")
        self.pending[rank] = self.workers[rank].pid
        self.pending_since.setdefault(rank, time.monotonic())

    def spawn_spare(self):
        """A warm spare: the training script started (torch imported, arguments parsed) and waiting in
        Membership.from_env for the rank it is to replace."""
        self.spare_count += 1
        env = self._env(**{membership.ENV_SPARE: str(self.spare_count)})
        proc = subprocess.Popen([sys.executable, *self.command], env=env)
        self.spares.append((self.spare_count, proc))
        self.say(f"spare {self.spare_count}: pid {proc.pid}")

    def tend_spares(self):
        """Drop spares that died; start new ones, but not while a recovery is under way (on few cores a
        starting process slows the recovery down): only once an iteration after the last death was logged."""
        alive = [(i, p) for i, p in self.spares if p.poll() is None]
        if len(alive) < len(self.spares):
            self.say(f"spare(s) {[i for i, p in self.spares if p.poll() is not None]} died: no more spares")
            self.num_spares = 0  # a spare that dies waiting would die again: start replacements afresh
        self.spares = alive
        if len(self.spares) < self.num_spares:
            if self.spare_after_logged is None or membership.last_logged(self.store) > self.spare_after_logged:
                self.spare_after_logged = None
                self.spawn_spare()

    def open_generation(self, replaced, members=None, why="", abort=True):
        """Generation += 1: its members (default: the current ones), the ranks started afresh
        for it, their processes; the `generation` key last, since the new processes' environment says it.
        `abort` (all but a grow): the old generation is abandoned, its members blocked in a collective (behind
        a hung peer) are released at once (gen_<g>/abort, membership.Membership.watch_for_abort)."""
        if abort and self.generation >= 0:
            self.store.set(f"gen_{self.generation}/abort", "1")
        self.generation += 1
        self.members = sorted(self.members if members is None else members)
        self.store.set(f"gen_{self.generation}/members", json.dumps(self.members))
        self.store.set(f"gen_{self.generation}/replaced", json.dumps(sorted(replaced)))
        for rank in replaced:
            self.spawn(rank)
        self.store.set("generation", str(self.generation))
        self.say(f"generation {self.generation}: replaced {sorted(replaced)}"
                 + (f", members {self.members}" if len(self.members) < self.world_size else "") + why)

    def start_all(self):
        """Every rank afresh, in a new generation (the first, or the whole-job restart of the fallback)."""
        self.done.clear()
        self.stop_all()
        self.workers, self.pending = {}, {}
        self.store.delete_key("finished")  # a restarted job trains anew
        self.logged_at_start = self.logged_count()
        self.open_generation(range(self.world_size), range(self.world_size))
        # A starting job waits for every rank (--join-timeout): only a rank lost while training can be late.
        self.pending_since = {}

    def stop_all(self, signum: int = signal.SIGTERM):
        """Stop every process (spares too) with `signum`, and with SIGKILL those still there STOP_TIMEOUT_S
        later (torchrun's agent does the same). SIGCONT after it: a stopped process gets the signal at once."""
        procs = [proc for _, proc in self.spares] + list(self.workers.values())
        self.spares = []
        stop_processes(procs, signum)

    def logged_count(self) -> int:
        """Iterations logged since the supervisor started (membership.note_logged)."""
        return int(self.store.get("logged_count")) if self.store.check(["logged_count"]) else 0

    def reported(self, rank: int) -> bool:
        """Whether `rank` reported a failed collective in the current generation (membership.report_trouble)."""
        return self.store.check([f"gen_{self.generation}/trouble/{rank}"])

    def silent_for(self, rank: int) -> float:
        """Seconds since `rank`'s last heartbeat (0 when it has none yet: nothing to judge by)."""
        key = f"heartbeat/{rank}"
        return time.time() - float(self.store.get(key)) if self.store.check([key]) else 0.0

    def live_members(self):
        """The members of the current generation whose processes are running and ready (not done, not still
        starting)."""
        return [r for r in self.members if r not in self.done and r not in self.pending
                and self.workers[r].poll() is None]

    def unresponsive(self, trouble_for_s: float):
        """The live members that have not reported the failed collective, `trouble_for_s` seconds after the
        first report, and either show no sign of life (no heartbeat for --collective-timeout seconds: stopped,
        wedged) or have had --collective-timeout + --trouble-grace to report: a healthy rank reaches a collective
        within the collective timeout, and one with the reporters fails at once (they freed their groups), so
        such a rank is hung though its heartbeat thread still beats (a deadlock in Python, a wait that never
        ends). Their peers wait for them in vain."""
        late = trouble_for_s > self.config.collective_timeout_s + self.trouble_grace_s
        return [r for r in self.live_members()
                if not self.reported(r) and (late or self.silent_for(r) > self.config.collective_timeout_s)]

    def all_reported(self) -> bool:
        """Every live member reported the failed collective of the current generation."""
        return all(self.reported(r) for r in self.live_members())

    def await_last_words(self, failed):
        """Before a whole-job restart: let every other live member finish its failure path (last words, then
        the report of the failed collective) or exit, as torchrun's SIGTERM lets pretrain()'s ranks write
        theirs. A rank's collective fails at once when the failed rank's process is gone, at the collective
        timeout when it waits on a hung one; a rank that reports nothing by then is stopped without."""
        deadline = time.monotonic() + self.config.collective_timeout_s + self.trouble_grace_s
        waiting = [r for r in self.live_members() if r not in failed]
        while waiting and time.monotonic() < deadline:
            time.sleep(0.02)
            waiting = [r for r in waiting if not self.reported(r) and self.workers[r].poll() is None]
        if waiting:
            self.say(f"rank(s) {waiting} did not report a failed collective within "
                     f"{self.config.collective_timeout_s + self.trouble_grace_s:.0f} s: stopped without last words")

    def note_standby(self):
        """Replacements that are ready to join (their pid in standby/<rank>) are no longer pending."""
        for rank, pid in list(self.pending.items()):
            key = f"standby/{rank}"
            if self.store.check([key]) and self.store.get(key).decode() == str(pid):
                del self.pending[rank]
                self.pending_since.pop(rank, None)

    def tend_elastic(self):
        """Elastic mode: shrink to the complete instances when a replacement is late, grow back when it is
        ready (see the module docstring). Instances are whole: their ranks' shard positions stay the same."""
        if self.config.min_instances is None or not self.store.check(["instance_size"]):
            return
        topology = DataParallelTopology.from_instance_size(self.world_size, int(self.store.get("instance_size")))
        broken = {topology.instance(r) for r in range(self.world_size)
                  if r in self.pending or self.workers[r].poll() is not None}
        wanted = [r for r in range(self.world_size) if topology.instance(r) not in broken]
        complete = topology.num_distributed_optimizer_instances - len(broken)
        if self.store.check([f"gen_{self.generation}/ready"]):  # formed (or closed: then a newer one is open)
            if set(wanted) > set(self.members) and not self.store.check(["finished"]):
                self.grow(wanted)
            return
        late = sorted(r for r in self.pending.keys() & set(self.members) & set(self.pending_since)
                      if time.monotonic() - self.pending_since[r] > self.replacement_timeout_s)
        if late and complete >= self.config.min_instances and set(wanted) < set(self.members):
            # Close the generation unless its last member arrived meanwhile (compare_set: one of us wins).
            if self.store.compare_set(f"gen_{self.generation}/ready", "", "closed") == b"closed":
                self.open_generation([], wanted, f" (shrink: rank(s) {late} not back within "
                                                 f"{self.replacement_timeout_s} s)")

    def grow(self, members):
        """Admit the ranks of the instances that are whole again: the current members leave together after an
        iteration none of them can have completed yet. Rank 0 logs iteration L + 1 before it takes part in
        L + 2, and no rank completes L + 2 without it, so when L is read no rank has passed L + 2; a member
        that missed the key (the supervisor delayed between reading L and writing it) fails in its next
        collective and recovers exactly (docs/fault_tolerance.md, "Elastic mode")."""
        leave_at = membership.last_logged(self.store) + 2
        self.store.set(f"gen_{self.generation}/leave_at", str(leave_at))
        self.open_generation([], members, f" (grow: instance(s) back; the members leave after iteration {leave_at})",
                             abort=False)

    def finished(self) -> bool:
        """Every rank exited 0: training ended (the ranks waiting to be admitted exit once it has)."""
        return len(self.done) == self.world_size

    def run(self) -> int:
        replacements = 0
        self.start_all()
        trouble_since = finished_since = None
        while not self.finished():
            time.sleep(0.02)
            self.tend_spares()
            self.note_standby()
            if self.store.check(["finished"]) and set(self.members) <= self.done:
                # Training ended: ranks waiting to be admitted exit by themselves; one that cannot (a
                # replacement still starting, stuck) is stopped after a grace period.
                finished_since = finished_since or time.monotonic()
                if time.monotonic() - finished_since > FINISH_GRACE_S:
                    self.say(f"training finished; stopping rank(s) {sorted(set(self.workers) - self.done)}")
                    self.stop_all()
                    return 0
            dead, failed = [], []
            trained = self.logged_count() > self.logged_at_start
            for rank, proc in self.workers.items():
                code = proc.poll()
                if code is None or rank in self.done:
                    continue
                kind = exit_kind(code, trained)
                if kind in (USAGE, STARTUP_ERROR):  # every process started with this command line would fail alike
                    self.say(f"rank {rank} exited with code {code} {EXIT_KINDS[kind]}: giving up")
                    self.stop_all()
                    return code
                if kind == DONE:
                    self.done.add(rank)
                elif kind == FALLBACK:
                    failed.append(rank)
                else:
                    dead.append(rank)
            if failed:
                if self.restarts >= self.max_restarts:
                    self.say("live recovery is impossible and no restart is left (--max-restarts): giving up")
                    self.stop_all()
                    return 1
                self.await_last_words(failed)
                self.restarts += 1
                self.say(f"live recovery is impossible: restarting the whole job ({self.restarts}/{self.max_restarts})")
                self.start_all()
                continue
            if dead:
                self.say(f"rank(s) {dead} died (exit codes {[self.workers[r].returncode for r in dead]})")
                replacements += len(dead)
                self.spare_after_logged = membership.last_logged(self.store)
                if replacements > self.max_replacements:
                    self.say(f"more than {self.max_replacements} replacements (--max-replacements): giving up")
                    self.stop_all()
                    return 1
                if set(dead) & set(self.members):
                    self.open_generation(dead)
                else:  # elastic: ranks waiting to be admitted; their replacements wait in their place
                    for rank in dead:
                        self.spawn(rank)
                trouble_since = None
            elif self.store.check([f"gen_{self.generation}/trouble"]):
                trouble_since = trouble_since or time.monotonic()
                trouble_for = time.monotonic() - trouble_since
                if trouble_for > self.trouble_grace_s:  # no process died
                    hung = self.unresponsive(trouble_for)
                    for rank in hung:  # replaced as dead ones: the next round sees them killed
                        self.say(f"rank {rank} (pid {self.workers[rank].pid}) does not answer: no failed collective "
                                 f"reported {trouble_for:.0f} s after the first, its last heartbeat "
                                 f"{self.silent_for(rank):.0f} s ago (--collective-timeout "
                                 f"{self.config.collective_timeout_s:g}): killing it (SIGKILL) to replace it")
                        self.workers[rank].kill()
                        self.workers[rank].wait()
                    if hung:
                        trouble_since = None
                    elif self.all_reported():  # every member answers: re-form only
                        self.open_generation([])
                        trouble_since = None
            else:
                self.tend_elastic()
        return 0


def add_live_arguments(parser: argparse.ArgumentParser):
    """The flags of live recovery that the single-node supervisor and the per-node agent (agent.py) share,
    and the training command."""
    parser.add_argument("--spares", type=int, default=1,
                        help="warm spare processes on this node (torch imported, waiting for a rank): a replacement "
                             "here then skips the start-up of a Python process; 0: start replacements afresh")
    parser.add_argument("--collective-timeout", type=float, default=LiveConfig.collective_timeout_s,
                        help="seconds before a collective fails, and without a heartbeat before a rank that does "
                             "not answer (SIGSTOP, a hang) is replaced; above the longest wait at a collective of a "
                             "healthy run on a loaded machine (see membership.LiveConfig)")
    parser.add_argument("--join-timeout", type=float, default=LiveConfig.join_timeout_s,
                        help="seconds a rank waits for the next generation and its ranks")
    parser.add_argument("--max-replacements", type=int, default=20, help="ranks replaced live, in all")
    parser.add_argument("--max-restarts", type=int, default=1,
                        help="whole-job restarts when live recovery is impossible")
    parser.add_argument("--trouble-grace", type=float, default=2.0,
                        help="seconds between a rank's failed collective and a re-forming without a death (or the "
                             "replacement of a member that does not answer)")
    parser.add_argument("--min-instances", type=int, default=None,
                        help="elastic mode (torchft's min_replicas, torchrun's --nnodes MIN:MAX, in distributed-"
                             "optimizer instances): when a replacement is not back within --replacement-timeout, "
                             "train on with the complete instances if there are at least this many, and admit the "
                             "missing one at an iteration boundary once it is back (default: not elastic, wait for "
                             "the replacement)")
    parser.add_argument("--replacement-timeout", type=float, default=10.0,
                        help="elastic mode: seconds after a rank's death (while training) before the job shrinks "
                             "without its instance, unless the replacement is ready to join; shorter than "
                             "--join-timeout (torchft Lighthouse's join_timeout)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training script and its arguments")


def live_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> LiveConfig:
    """add_live_arguments' flags checked together (parser.error, exit 2, naming the flags) as a LiveConfig."""
    if not args.command:
        parser.error("give the training script, e.g. pretrain_gpt.py ARGS")
    if args.spares < 0:
        parser.error(f"--spares must be >= 0, got {args.spares}")
    if not 0 < args.replacement_timeout < args.join_timeout:
        parser.error(f"--replacement-timeout ({args.replacement_timeout} s) must be > 0 and shorter than "
                     f"--join-timeout ({args.join_timeout} s): the survivors give up waiting at the join timeout")
    if args.join_timeout <= args.collective_timeout + args.trouble_grace:
        # A rank that does not answer is replaced only --collective-timeout + --trouble-grace after the first
        # report: with a shorter join timeout the survivors give up first and every hang restarts the whole job.
        parser.error(f"--join-timeout ({args.join_timeout:g} s) must be longer than --collective-timeout + "
                     f"--trouble-grace ({args.collective_timeout:g} + {args.trouble_grace:g} s): the survivors wait "
                     "that long for a rank that does not answer to be replaced; raise --join-timeout")
    try:
        return LiveConfig(args.collective_timeout, args.join_timeout, args.min_instances)
    except ValueError as e:  # its message names the field: say it with the flag's name
        parser.error(str(e).replace("min_instances", "--min-instances").replace("collective_timeout_s",
                     "--collective-timeout").replace("join_timeout_s", "--join-timeout"))


def default_worker_threads(nproc_per_node: int, who: str = "supervisor"):
    """OMP_NUM_THREADS=1 for the workers when it is unset and there are several per node, said once."""
    if "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1:
        # torchrun's default: several ranks with a thread per core each would oversubscribe the cores (and the
        # thread count changes a run's bits: the same flags under torchrun and here must give the same losses).
        os.environ["OMP_NUM_THREADS"] = "1"
        print(f"[{who}] OMP_NUM_THREADS is not set: each of the {nproc_per_node} workers gets "
              "OMP_NUM_THREADS=1, as under torchrun (set it yourself to tune the threads per worker)", flush=True)


def run_until_signal(run, handler, say, whom: str, stop, how: str = "") -> int:
    """run() with FORWARDED_SIGNALS sent to `handler` (which raises SignalReceived); on one, say so and exit 1.
    `stop(signum)` ends the processes this launcher started, in every case: with the signal received, else with
    SIGTERM (SIGKILL after STOP_TIMEOUT_S). The previous handlers are put back. Returns run()'s exit code."""
    handled = {getattr(signal, name): signal.signal(getattr(signal, name), handler)
               for name in FORWARDED_SIGNALS if hasattr(signal, name)}
    stop_with = signal.SIGTERM
    try:
        return run()
    except SignalReceived as e:
        say(f"{e}: forwarding it to the {whom} (SIGKILL after {STOP_TIMEOUT_S:.0f} s), then exiting 1{how}")
        stop_with = e.signum
        return 1
    finally:
        stop(stop_with)
        for signum, previous in handled.items():
            signal.signal(signum, previous)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks (one node)")
    add_live_arguments(parser)
    args = parser.parse_args(argv)
    config = live_config(parser, args)
    default_worker_threads(args.nproc_per_node)
    supervisor = Supervisor(args.command, args.nproc_per_node, config, args.max_replacements, args.max_restarts,
                            args.trouble_grace, args.spares, args.replacement_timeout)
    return run_until_signal(supervisor.run, _raise_signal, supervisor.say, "workers", supervisor.stop_all,
                            " as torchrun does")


if __name__ == "__main__":
    sys.exit(main())
