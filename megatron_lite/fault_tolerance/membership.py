"""Who is in the job now: generations of the process group over torch.distributed's TCPStore.

The supervisor (launch.py) hosts a c10d TCPStore (the store torchrun's agent hosts) and is the only one
that decides membership: when a worker dies it bumps the generation and starts a replacement for that
rank only. Every rank forms the process group of generation g on its own key space of the store::

    store key                      written by        meaning
    generation                     supervisor        the current generation g (0 at the start)
    gen_<g>/members                supervisor        JSON list of the ranks ("slots") that train in generation g
    gen_<g>/replaced               supervisor        JSON list of the ranks started afresh in generation g
    gen_<g>/arrived                every member      counter; the member that makes it len(members) sets .../ready
    gen_<g>/ready                  last member or    "1": formed; "closed": the supervisor shrank it before it
                                   supervisor        formed (compare_set: the first writer wins)
    gen_<g>/trouble                a rank            "a collective of generation g failed" (see launch.py)
    gen_<g>/trouble/<rank>         that rank         the same, per rank: who has answered (a rank that has not,
                                                     its heartbeat stale, is hung: the supervisor replaces it)
    heartbeat/<rank>               every process     time.time(), every HEARTBEAT_S from a thread of its own
                                                     (a process stopped or wedged stops beating)
    gen_<g>/leave_at               supervisor        elastic grow: the members of g leave after this iteration
    standby/<rank>                 every process     its pid, once it is ready to join (the supervisor's
                                                     "the replacement came back")
    spare_<i>/assign               supervisor        JSON {rank, generation}: warm spare i becomes that rank
    instance_size                  every rank        ranks per distributed-optimizer instance (elastic: the
                                                     supervisor shrinks and grows by whole instances)
    last_logged                    rank 0            the last iteration logged (a new rank 0 logs from there)
    logged_count                   rank 0            counter, +1 per iteration logged (the supervisor: has this
                                                     start of the job trained at all?)
    last_evaluated                 rank 0            the last evaluation logged (an interrupted one is redone)
    finished                       rank 0            training ended at this iteration: ranks waiting to be
                                                     admitted (elastic) exit
    gen_<g>/...                    torch             the gloo rendezvous of generation g (PrefixStore)

A rank keeps its number (its slot) for the whole job; in a generation of fewer members (elastic: an
instance left out) its process-group rank is its index in the members, which keeps every surviving rank's
shard position (instances are whole, and a slot's position is slot % instance size).

A survivor whose collective fails (gloo raises within milliseconds when a peer process dies or frees its
groups, at the collective timeout when a peer hangs) calls wait_for_next_generation();
once the new generation is ready on every rank it calls join(): the old groups are dropped and a fresh
gloo WORLD is created on the new prefix. Every wait has a deadline (--join-timeout) except two that the
supervisor ends: a warm spare waiting for its rank, and (elastic) a rank waiting to be admitted, which exits
when the store says training finished.

A generation forms when its last member arrives and sets gen_<g>/ready to "1"; the supervisor, to shrink a
generation that has not formed, first sets it to "closed". Both use compare_set, so exactly one of them
wins: a generation is either formed (every member trains in it) or closed (every member moves on).
"""

import datetime
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist

ENV_STORE = "MEGATRON_LITE_LIVE_STORE"  # host:port of the supervisor's TCPStore: live recovery is on
ENV_GENERATION = "MEGATRON_LITE_LIVE_GENERATION"
ENV_COLLECTIVE_TIMEOUT = "MEGATRON_LITE_LIVE_COLLECTIVE_TIMEOUT"
ENV_JOIN_TIMEOUT = "MEGATRON_LITE_LIVE_JOIN_TIMEOUT"
ENV_SPARE = "MEGATRON_LITE_LIVE_SPARE"  # a warm spare's id: it waits for the rank it is to replace
ENV_MIN_INSTANCES = "MEGATRON_LITE_LIVE_MIN_INSTANCES"  # elastic mode: the fewest instances to train with
EXIT_FALLBACK = 3  # a worker that cannot recover live: the supervisor restarts the whole job (--load)
HEARTBEAT_S = 1.0  # every process writes heartbeat/<rank> this often, from a thread of its own


class GenerationSuperseded(RuntimeError):
    """A newer generation began while this one was forming (another rank died meanwhile)."""


class GenerationEnded(RuntimeError):
    """Elastic grow: the supervisor admits new members, and this generation's members leave together at an
    iteration boundary (gen_<g>/leave_at) to form the next one with them."""


class JobFinished(Exception):
    """Training ended while this process waited to be admitted (elastic): it has nothing left to do."""


@dataclass(frozen=True)
class LiveConfig:
    """The live-recovery timeouts (launch.py's flags, passed to the workers in their environment)."""

    collective_timeout_s: float = 30.0
    """A collective waiting longer than this fails (every gloo group's timeout): how a peer that hangs without
    dying is detected (a dead one is at once; a survivor that leaves frees its groups, which releases the
    peers blocked on it), and how long a rank may show no sign of life (its heartbeat) before the supervisor
    replaces it. It must exceed the longest gap between two ranks' arrivals at one collective in a healthy
    run (a periodic save, a slow evaluation, a loaded machine); a spurious timeout costs a re-forming. 3 s
    fired 0-4 times per 40 iterations of the tests' tiny GPT with 4 ranks on 2 loaded cores; 30 s keeps a
    hang's detection bounded (torch's own gloo default is 30 minutes)."""
    join_timeout_s: float = 60.0
    """How long a rank waits for a new generation (the supervisor noticing the death) and for every rank of
    it to arrive (the replacement starting). Past it the rank gives up live recovery (EXIT_FALLBACK)."""
    min_instances: Optional[int] = None
    """Elastic mode (torchft's min_replicas, torchrun's --nnodes MIN:MAX, counted in distributed-optimizer
    instances): when a replacement has not come back within the supervisor's --replacement-timeout, train on
    with the complete instances, as long as there are at least this many; grow back when it comes. None: not
    elastic (wait for the replacement)."""

    def __post_init__(self):
        for name in ("collective_timeout_s", "join_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.min_instances is not None and (not isinstance(self.min_instances, int) or self.min_instances < 1):
            raise ValueError(f"min_instances must be an int >= 1 (or None: not elastic), got {self.min_instances!r}")

    @property
    def elastic(self) -> bool:
        return self.min_instances is not None

    @classmethod
    def from_env(cls) -> "LiveConfig":
        minimum = os.environ.get(ENV_MIN_INSTANCES)
        return cls(float(os.environ.get(ENV_COLLECTIVE_TIMEOUT, cls.collective_timeout_s)),
                   float(os.environ.get(ENV_JOIN_TIMEOUT, cls.join_timeout_s)),
                   int(minimum) if minimum else None)


def live_recovery_enabled() -> bool:
    """Whether this process was started by the live-recovery supervisor (launch.py)."""
    return ENV_STORE in os.environ


def _int_key(store: dist.Store, key: str) -> int:
    """An integer the store holds under `key`, 0 before it is first written."""
    return int(store.get(key)) if store.check([key]) else 0


def last_logged(store: dist.Store) -> int:
    """The last iteration rank 0 logged (Membership.note_logged), 0 before the first."""
    return _int_key(store, "last_logged")


def members(store: dist.Store, generation: int, world_size: int) -> List[int]:
    """The ranks that train in `generation` (every rank unless the supervisor recorded fewer)."""
    key = f"gen_{generation}/members"
    return json.loads(store.get(key)) if store.check([key]) else list(range(world_size))


def connect_store(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the supervisor's TCPStore at `address` ("host:port")."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class Membership:
    """This rank's view of the generations: joins the process group of the current one, waits for the next.

    Args:
        store: the supervisor's TCPStore (a client).
        rank, world_size: this rank's slot and the job's size (fixed: a replacement takes the dead rank's
            place; a generation may have fewer members, see members()).
        generation: the generation this process starts in (0, or the one it was started for).
        config: the timeouts.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, generation: int, config: LiveConfig):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.generation, self.config = generation, config
        self._leave_at: Optional[int] = None

    @classmethod
    def from_env(cls) -> "Membership":
        """This process's membership; a warm spare (started with torch imported and the arguments parsed)
        first waits, without a deadline, until the supervisor assigns it a rank (or stops it)."""
        config = LiveConfig.from_env()
        store = connect_store(os.environ[ENV_STORE], config.join_timeout_s)
        if ENV_SPARE in os.environ:
            key, supervisor = f"spare_{os.environ[ENV_SPARE]}/assign", os.getppid()
            while True:
                try:
                    if store.check([key]):
                        break
                except dist.DistError:
                    time.sleep(1.0)  # the store's socket closes before the dying supervisor's children move
                    if os.getppid() == supervisor:
                        raise
                if os.getppid() != supervisor:
                    print(f"[spare {os.environ[ENV_SPARE]}] > the supervisor (pid {supervisor}) is gone: exiting",
                          file=sys.stderr, flush=True)
                    sys.exit(1)
                time.sleep(0.005)
            assignment = json.loads(store.get(key))
            rank = str(assignment["rank"])
            os.environ.update({"RANK": rank, "LOCAL_RANK": rank, "ROLE_RANK": rank,
                               ENV_GENERATION: str(assignment["generation"])})
        rank = int(os.environ["RANK"])
        _watch_supervisor(rank, config)
        return cls(store, rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get(ENV_GENERATION, "0")), config)

    def current_generation(self) -> int:
        return _int_key(self.store, "generation")

    def replaced(self, generation: Optional[int] = None) -> List[int]:
        """The ranks started afresh in `generation` (default: this one)."""
        key = f"gen_{self.generation if generation is None else generation}/replaced"
        return json.loads(self.store.get(key)) if self.store.check([key]) else []

    def members(self, generation: Optional[int] = None) -> List[int]:
        """The ranks that train in `generation` (default: this one)."""
        return members(self.store, self.generation if generation is None else generation, self.world_size)

    def join(self):
        """Form the default process group of this generation (gloo, WORLD = its members, ranked by slot):
        wait until every member has arrived (the replacement may still be importing torch), then rendezvous
        on the generation's prefix. The previous generation's groups (every group: WORLD and the instances')
        are destroyed first. A process that starts late joins the newest generation; one that is not a member
        of it (elastic: its instance is left out) waits, without a deadline, until it is admitted, and raises
        JobFinished if training ends first."""
        self.store.set(f"standby/{self.rank}", str(os.getpid()))
        self.generation = max(self.generation, self.current_generation())
        while self.rank not in self.members():
            self._raise_if_finished("before it was admitted")
            time.sleep(0.01)
            self.generation = self.current_generation()
        prefix, members = f"gen_{self.generation}", self.members()
        if self.store.add(f"{prefix}/arrived", 1) == len(members):
            self.store.compare_set(f"{prefix}/ready", "", "1")
        what = f"every rank of generation {self.generation} to arrive"

        def ready() -> bool:
            if self.store.check([f"{prefix}/ready"]):
                if self.store.get(f"{prefix}/ready") == b"1":
                    return True
                raise GenerationSuperseded(f"generation {self.generation} was closed before it formed (shrink)")
            if self.current_generation() > self.generation:
                raise GenerationSuperseded(f"generation {self.generation} was superseded while waiting for {what}")
            self._raise_if_finished("while waiting for the others to arrive")  # a grow the end overtook
            return False
        self._wait(ready, what)
        if dist.is_initialized():
            dist.destroy_process_group()  # measured: milliseconds, also with an operation pending
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, self.store), rank=members.index(self.rank),
                                world_size=len(members),
                                timeout=datetime.timedelta(seconds=self.config.collective_timeout_s))
        self._leave_at = None

    def leave_due(self, iteration: int) -> bool:
        """Elastic: whether the supervisor asked this generation's members to leave after `iteration` (to admit
        returning ranks). Every member reads the same key at the same iteration boundary, so all leave together.
        One store lookup per iteration until the key appears."""
        if self._leave_at is None and self.store.check([f"gen_{self.generation}/leave_at"]):
            self._leave_at = int(self.store.get(f"gen_{self.generation}/leave_at"))
        return self._leave_at is not None and iteration >= self._leave_at

    def _raise_if_finished(self, when: str):
        if self.store.check(["finished"]):
            ended = self.store.get("finished").decode()
            raise JobFinished(f"rank {self.rank}: training finished at iteration {ended} {when}")

    def note_finished(self, iteration: int):
        """Rank 0, when training ended: ranks still waiting to be admitted exit."""
        self.store.set("finished", str(iteration))

    def publish_instance_size(self, instance_size: int):
        """Ranks per distributed-optimizer instance, for the supervisor's elastic decisions (whole instances)."""
        self.store.set("instance_size", str(instance_size))

    def limit_group_timeouts(self):
        """Give every process group of this generation (WORLD and the ones created since, e.g. the
        distributed-optimizer instances', which torch creates with its 30-minute default) the collective
        timeout. torch has no public setter; `_set_pg_timeout` is the one torch.distributed.elastic uses."""
        timeout = datetime.timedelta(seconds=self.config.collective_timeout_s)
        for group in list(dist.distributed_c10d._world.pg_map):
            dist.distributed_c10d._set_pg_timeout(timeout, group)

    def note_logged(self, iteration: int):
        """Rank 0, after logging an iteration: a replacement of rank 0 then knows what is in the log already
        (and the supervisor that this start of the job trains: an error before it is not retried)."""
        self.store.set("last_logged", str(iteration))
        self.store.add("logged_count", 1)

    def last_logged(self) -> int:
        return last_logged(self.store)

    def note_evaluated(self, iteration: int):
        """Rank 0, after logging an evaluation: whether an interrupted evaluation is redone is decided by what
        the log has, the same on every rank (they read it before the evaluation's collectives, rank 0 writes
        it after them)."""
        self.store.set("last_evaluated", str(iteration))

    def last_evaluated(self) -> int:
        return _int_key(self.store, "last_evaluated")

    def report_trouble(self):
        """Tell the supervisor a collective of this generation failed (it starts a new generation even if no
        process died, e.g. after a spurious timeout). Per rank too: a member that never reports while its
        heartbeat is stale does not answer, and the supervisor replaces it as a dead one."""
        self.store.set(f"gen_{self.generation}/trouble/{self.rank}", "1")
        self.store.set(f"gen_{self.generation}/trouble", str(self.rank))

    def wait_for_next_generation(self, failed: bool = True) -> int:
        """After a failure (or, `failed` False, a planned leave for an elastic grow): wait for the supervisor's
        next generation and adopt it. Returns it."""
        if failed:
            self.report_trouble()
        self._wait(lambda: self.current_generation() > self.generation, "the next generation to start")
        self.generation = self.current_generation()
        return self.generation

    def _wait(self, done, what: str):
        deadline = time.monotonic() + self.config.join_timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: waited {self.config.join_timeout_s} s for {what} "
                                   f"(--join-timeout)")
            time.sleep(0.01)


def _watch_supervisor(rank: int, config: LiveConfig):
    """This worker's side of the supervisor's liveness checks (main thread only; once per process):

    - a heartbeat (heartbeat/<rank>, every HEARTBEAT_S, on a store connection of its own): a process that stops
      beating (SIGSTOP, a wedged interpreter) while its peers report a failed collective is replaced;
    - the supervisor gone without stopping this process (killed with SIGKILL: it had no chance to): this
      process is reparented, says so and exits, instead of training on with no one to record it;
    - SIGTERM (the supervisor stopping the job, e.g. because it got SIGTERM itself, as torchrun forwards it):
      said in this rank's log, then the default action (the process ends with that signal).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    supervisor = os.getppid()

    def on_sigterm(signum, frame):
        print(f"[rank {rank}] > SIGTERM: this rank stops (the supervisor, pid {supervisor}, sends it when it stops "
              "the job)", flush=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    signal.signal(signal.SIGTERM, on_sigterm)
    store = connect_store(os.environ[ENV_STORE], config.join_timeout_s)

    def beat():
        while True:
            if os.getppid() != supervisor:
                print(f"[rank {rank}] > the supervisor (pid {supervisor}) is gone: stopping this rank (nothing is "
                      "left to replace a rank or record the job's progress)", file=sys.stderr, flush=True)
                os._exit(1)
            try:
                store.set(f"heartbeat/{rank}", repr(time.time()))
            except Exception:  # noqa: BLE001 - a busy or vanished store: the parent check above decides
                pass
            time.sleep(HEARTBEAT_S)
    threading.Thread(target=beat, name="megatron_lite_heartbeat", daemon=True).start()
