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
    spare_<i>/assign               supervisor        JSON {rank, generation[, env]}: warm spare i becomes that
                                                     rank (env: more variables, e.g. the node agent's LOCAL_RANK)
    instance_size                  every rank        ranks per distributed-optimizer instance (elastic: the
                                                     supervisor shrinks and grows by whole instances)
    last_logged                    rank 0            the last iteration logged (a new rank 0 logs from there)
    logged_count                   rank 0            counter, +1 per iteration logged (the supervisor: has this
                                                     start of the job trained at all?)
    last_evaluated                 rank 0            the last evaluation logged (an interrupted one is redone)
    finished                       rank 0            training ended at this iteration: ranks waiting to be
                                                     admitted (elastic) exit
    gen_<g>/abort                  supervisor/leader generation g was abandoned after a failure (not on an elastic
                                                     grow): its members still blocked in a collective are released
                                                     at once (the heartbeat thread interrupts the generation)
    gen_<g>/placement              the agents'       JSON {"<slot>": [node incarnation, generation its process was
                                   leader            started for]} (multi-node, agent.py): a process whose node no
                                                     longer holds its slot is fenced (EXIT_FENCED)
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

A survivor blocked behind a hung or cut-off peer is not left to the collective timeout: once the supervisor
(or the agents' leader) abandons the generation (gen_<g>/abort), this process's heartbeat thread interrupts it
(interrupt.py: gloo cannot abort an operation, but shutting down the process's connected TCP sockets, the
store's excepted, makes a blocked gloo collective raise "Connection closed by peer" at once; NCCL: the
communicators are aborted). A lock keeps it away from a generation being formed or left.

Fencing by generation (check_fenced): a process that no longer owns its slot (its node was replaced: another
incarnation holds the slot in gen_<g>/placement) or whose generation was abandoned must not rendezvous, commit a
checkpoint or (slot lost) write last words with its stale state; join() and the checkpoint's commit guard
(checkpointing.files.set_commit_guard) ask before acting.

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
from typing import Iterator, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from .interrupt import interrupt_generation, nccl_backends, store_endpoints

ENV_STORE = "MEGATRON_LITE_LIVE_STORE"  # host:port of the supervisor's TCPStore: live recovery is on
ENV_GENERATION = "MEGATRON_LITE_LIVE_GENERATION"
ENV_COLLECTIVE_TIMEOUT = "MEGATRON_LITE_LIVE_COLLECTIVE_TIMEOUT"
ENV_JOIN_TIMEOUT = "MEGATRON_LITE_LIVE_JOIN_TIMEOUT"
ENV_SPARE = "MEGATRON_LITE_LIVE_SPARE"  # a warm spare's id: it waits for the rank it is to replace
ENV_MIN_INSTANCES = "MEGATRON_LITE_LIVE_MIN_INSTANCES"  # elastic mode: the fewest instances to train with
ENV_NODE = "MEGATRON_LITE_LIVE_NODE"  # multi-node: the incarnation of this process's node agent (fencing)
ENV_HEARTBEAT_FILE = "MEGATRON_LITE_LIVE_HEARTBEAT_FILE"  # multi-node: a file this process touches every HEARTBEAT_S
EXIT_FALLBACK = 3  # a worker that cannot recover live: the supervisor restarts the whole job (--load)
EXIT_FENCED = 4  # a process whose slot belongs to another process now (its node was replaced): it just ends
HEARTBEAT_S = 1.0  # every process writes heartbeat/<rank> this often, from a thread of its own
SPARE_POLL_MAX_S = 0.05  # a warm spare asks etcd for its assignment every 5 ms at first, backing off to this
ABORT_POLL_S = 0.2  # the heartbeat thread looks for gen_<g>/abort this often while in a formed generation g
LOCAL_POLL_S = 0.01  # a wait on the supervisor's TCPStore (one node) asks it this often
REMOTE_POLL_S = (0.01, 0.1)  # a wait on a coordination service (etcd) backs off from the first to the second:
# each round is several requests, and a few waiting ranks polling every 10 ms kept the 3 etcd members at 50-95 %
# of a core each on 2 loaded cores, starving the replacement they were waiting for (the multi-node soak)
NCCL_ASYNC_ERROR_HANDLING = "2"
"""TORCH_NCCL_ASYNC_ERROR_HANDLING for the workers of a live job on NCCL (the agent sets it): 2 is torch's
CleanUpOnly (ProcessGroupNCCL.hpp's ErrorHandlingMode; docs: torch_nccl_environment_variables): on a collective's
error or timeout the watchdog aborts the NCCL communicators but does not tear the process down, so the survivor
raises, keeps its state and joins the next generation. 1 (TearDown, torch's default) would kill every survivor;
0 (NoHandling) leaves a hung communicator to the collective timeout; 3 (SkipCleanUp) kills without aborting."""


class GenerationSuperseded(RuntimeError):
    """A newer generation began while this one was forming (another rank died meanwhile)."""


class GenerationEnded(RuntimeError):
    """Elastic grow: the supervisor admits new members, and this generation's members leave together at an
    iteration boundary (gen_<g>/leave_at) to form the next one with them."""


class JobFinished(Exception):
    """Training ended while this process waited to be admitted (elastic): it has nothing left to do."""


class Fenced(RuntimeError):
    """This process must not act on the job's behalf any more (check_fenced).

    slot_lost: its slot belongs to another process now (its node was replaced; or the store cannot be read, so
    it cannot know it still owns it): it ends with EXIT_FENCED without writing anything. Otherwise only its
    generation was abandoned or superseded: a peer's failure like any other (the next generation follows)."""

    def __init__(self, message: str, slot_lost: bool):
        super().__init__(message)
        self.slot_lost = slot_lost


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


def connect_store(address: str, timeout_s: float) -> dist.Store:
    """A client of the job's store: the supervisor's TCPStore at `address` ("host:port"), or the job's key space
    in etcd ("etcd://host:port,host:port,.../megatron_lite/<job>/store/", etcd.EtcdStore: multi-node)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if address.startswith("etcd://"):
        from .etcd import EtcdStore  # here: single-node jobs never load the etcd client

        store = EtcdStore.from_url(address)
        store.set_timeout(timeout)
        return store
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


class Membership:
    """This rank's view of the generations: joins the process group of the current one, waits for the next.

    Args:
        store: the supervisor's TCPStore (a client).
        rank, world_size: this rank's slot and the job's size (fixed: a replacement takes the dead rank's
            place; a generation may have fewer members, see members()).
        generation: the generation this process starts in (0, or the one it was started for).
        config: the timeouts.
        node: multi-node: the incarnation of this process's node agent (ENV_NODE), which gen_<g>/placement
            names as the holder of this slot while this process owns it; None: one node, fenced by generation
            only.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, generation: int, config: LiveConfig,
                 node: Optional[str] = None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.generation, self.config, self.node = generation, config, node
        self.started_for = generation  # placement's since_gen while this process holds the slot
        self._leave_at: Optional[int] = None
        self._poll_s = (LOCAL_POLL_S, LOCAL_POLL_S) if isinstance(store, dist.TCPStore) else REMOTE_POLL_S
        # The generation whose process groups this process trains in (None: forming or leaving one). The lock
        # orders it with the heartbeat thread's interrupt: never a generation being formed or torn down.
        self._formed: Optional[int] = None
        self._formed_lock = threading.Lock()
        self.interrupted: Optional[int] = None  # the last generation the heartbeat thread interrupted
        # The last generation the heartbeat thread began to interrupt (set before it acts, never undone): a
        # reduction of that generation may have ended with partial sums (NCCL: check_reductions).
        self._interrupting: Optional[int] = None

    @classmethod
    def from_env(cls) -> "Membership":
        """This process's membership; a warm spare (started with torch imported and the arguments parsed)
        first waits, without a deadline, until the supervisor assigns it a rank (or stops it)."""
        config = LiveConfig.from_env()
        store = connect_store(os.environ[ENV_STORE], config.join_timeout_s)
        if ENV_SPARE in os.environ:
            key, supervisor, wait = f"spare_{os.environ[ENV_SPARE]}/assign", os.getppid(), 0.005
            # on a coordination service (etcd), many idle spares must not load it: backing off to SPARE_POLL_MAX_S
            most = wait if isinstance(store, dist.TCPStore) else SPARE_POLL_MAX_S
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
                time.sleep(wait)
                wait = min(2 * wait, most)
            assignment = json.loads(store.get(key))
            rank = str(assignment["rank"])
            os.environ.update({"RANK": rank, "LOCAL_RANK": rank, "ROLE_RANK": rank,
                               ENV_GENERATION: str(assignment["generation"]), **assignment.get("env", {})})
        membership = cls(store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                         int(os.environ.get(ENV_GENERATION, "0")), config, os.environ.get(ENV_NODE))
        _watch_supervisor(membership, os.environ[ENV_STORE])
        return membership

    def current_generation(self) -> int:
        return _int_key(self.store, "generation")

    def replaced(self, generation: Optional[int] = None) -> List[int]:
        """The ranks started afresh in `generation` (default: this one)."""
        key = f"gen_{self.generation if generation is None else generation}/replaced"
        return json.loads(self.store.get(key)) if self.store.check([key]) else []

    def members(self, generation: Optional[int] = None) -> List[int]:
        """The ranks that train in `generation` (default: this one)."""
        return members(self.store, self.generation if generation is None else generation, self.world_size)

    def join(self, backend: str = "gloo", device_id: Optional[torch.device] = None):
        """Form the default process group of this generation (`backend`, WORLD = its members, ranked by slot;
        NCCL on `device_id`, this rank's GPU, see process_group_backend):
        wait until every member has arrived (the replacement may still be importing torch), then rendezvous
        on the generation's prefix. The previous generation's groups (every group: WORLD and the instances')
        are dropped first (leave). A process that starts late joins the newest generation; one that is not a
        member of it (elastic: its instance is left out) waits, without a deadline, until it is admitted, and
        raises JobFinished if training ends first. A process whose slot is no longer its own raises Fenced
        before it arrives (check_fenced)."""
        self.leave()
        self.store.set(f"standby/{self.rank}", str(os.getpid()))
        self.generation = max(self.generation, self.current_generation())
        pauses = self._pauses()
        while self.rank not in self.members():
            self._raise_if_finished("before it was admitted")
            time.sleep(next(pauses))
            self.generation = self.current_generation()
        # Before arriving: a process whose node was replaced would count as a member (and hold the others'
        # rendezvous) while the slot's new process arrives too.
        self.check_fenced(f"joining generation {self.generation}", generation=False)
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
        if device_id is not None:
            torch.cuda.set_device(device_id)
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, self.store), rank=members.index(self.rank),
                                world_size=len(members), device_id=device_id if backend == "nccl" else None,
                                timeout=datetime.timedelta(seconds=self.config.collective_timeout_s))
        self._leave_at = None
        with self._formed_lock:
            self._formed = self.generation

    def leave(self):
        """Drop the process groups of the generation this process trains in (after its failure, or before
        joining the next): gloo's are destroyed (measured: milliseconds, also with an operation pending, and
        peers blocked on this process then fail at once), NCCL's communicators aborted first (a communicator
        with a failed or pending operation can hang its destruction)."""
        with self._formed_lock:
            formed, self._formed = self._formed, None
        if formed is None or not dist.is_initialized():
            return  # a group this membership did not form (nothing joined yet) is its owner's to destroy
        if dist.get_backend() == "nccl":
            try:
                dist.distributed_c10d._abort_process_group()  # every group, in one NCCL group call; forgotten
                return
            except Exception as e:  # noqa: BLE001 - aborted already (the heartbeat thread): destroy what is left
                print(f"[rank {self.rank}] > aborting the NCCL groups: {type(e).__name__}: {e}", file=sys.stderr,
                      flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def formed(self) -> Optional[int]:
        """The generation whose process groups this process trains in; None while it forms or leaves one."""
        return self._formed

    def check_fenced(self, what: str, generation: bool = True):
        """Raise Fenced unless this process may still act for its slot (`what`: what it is about to do, for the
        message): the store answers, and (multi-node) gen_<current>/placement still gives this slot to this
        process (its node's incarnation, and the generation it was started for); with `generation`, also the
        generation it trains in was neither abandoned (gen_<g>/abort) nor superseded without a planned leave
        (an elastic grow's gen_<g>/leave_at). Last words pass generation=False: they are written after the
        generation failed, and only a process that lost its slot must not write them."""
        formed = self._formed
        try:
            current = self.current_generation()
            holder = self._placement(current) if self.node is not None else None
            aborted = generation and formed is not None and self.store.check([f"gen_{formed}/abort"])
            superseded = generation and formed is not None and current > formed \
                and not self.store.check([f"gen_{formed}/leave_at"])
        except Exception as e:  # noqa: BLE001 - whatever the store's client raises (a timeout, a refused connection)
            raise Fenced(f"rank {self.rank} is fenced: {what} refused, the job's store cannot be read "
                         f"({type(e).__name__}: {e}); this process cannot know it still owns its slot",
                         slot_lost=True) from e
        if holder is not None and holder != [self.node, self.started_for]:
            raise Fenced(f"rank {self.rank} is fenced: {what} refused, generation {current} places its slot on "
                         f"{holder[0]} (a process started for generation {holder[1]}), not on this process "
                         f"({self.node}, started for generation {self.started_for}): its node was replaced",
                         slot_lost=True)
        if aborted or superseded:
            raise Fenced(f"rank {self.rank} is fenced: {what} refused, generation {formed} was "
                         f"{'abandoned after a failure' if aborted else f'superseded by generation {current}'}",
                         slot_lost=False)

    def _placement(self, generation: int) -> Optional[list]:
        """[incarnation, since_gen] of this slot in gen_<generation>/placement, None when it is not placed
        there (a generation without a placement: a job on one node)."""
        key = f"gen_{generation}/placement"
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key)).get(str(self.rank))

    def guard_commit(self, kind: str, what: str):
        """The checkpoint's commit guard (checkpointing.files.set_commit_guard): a checkpoint belongs to the
        generation that agreed on it, last words to the slot (check_fenced)."""
        self.check_fenced(what, generation=kind != "last_words")

    def watch_for_abort(self, store: dist.Store, keep: Set[Tuple[str, int]]) -> bool:
        """Heartbeat thread: interrupt the generation this process trains in if it was abandoned
        (gen_<g>/abort, read on `store`, the thread's own connection). Returns whether it did."""
        generation = self._formed
        if generation is None or generation == self.interrupted or not store.check([f"gen_{generation}/abort"]):
            return False
        with self._formed_lock:
            if self._formed != generation:  # left it meanwhile (and maybe forming the next): nothing to interrupt
                return False
            self._interrupting = generation
            done = interrupt_generation(keep)
            self.interrupted = generation  # only now: an interrupt that raised is tried again at the next poll
        print(f"[rank {self.rank}] > generation {generation} was abandoned (gen_{generation}/abort): {done}",
              file=sys.stderr, flush=True)
        return True

    def check_reductions(self):
        """Before this rank's optimizer update (live_training's before_update hook: the gradients and the losses
        are reduced): raise Fenced (the generation, not the slot) if a collective of this generation may have
        been cut short without an error in this thread. An aborted NCCL communicator ends the reduction in
        flight early, leaving partial sums, and the update would apply them (wrong weights, healed from as a
        completed iteration). Communicators are aborted by the heartbeat thread (gen_<g>/abort; it notes it
        before it acts) and by torch's watchdog (a collective's error or timeout: the group's backend reports
        it). The current CUDA stream is synchronized first, so every reduction queued before it has ended,
        completed or cut short; one aborted after this check had completed. gloo: nothing to do (a gloo
        collective completes or raises)."""
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return
        torch.cuda.current_stream().synchronize()
        why = self.cut_short()
        if why is not None:
            raise Fenced(f"rank {self.rank} is fenced: no update from generation {self._formed}'s reductions, "
                         f"{why}", slot_lost=False)

    def cut_short(self, groups=None) -> Optional[str]:
        """Why a collective of the generation this process trains in may have ended early (check_reductions),
        None if none can have: the heartbeat thread began to interrupt it, or a group's backend (`groups`,
        default: every process group) reports an error (torch's ErrorType: a timeout, a communicator error)."""
        if self._formed is not None and self._interrupting == self._formed:
            return f"it was interrupted (gen_{self._formed}/abort: its communicators aborted)"
        for group in list(dist.distributed_c10d._world.pg_map) if groups is None else groups:
            for backend in nccl_backends(group):
                try:
                    state = backend.get_error().name
                except (AttributeError, RuntimeError):  # a torch or backend without error states: not known
                    continue
                if state != "SUCCESS":
                    return f"a process group's backend reports {state} (torch's watchdog aborted it)"
        return None

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
        pauses = self._pauses()
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: waited {self.config.join_timeout_s} s for {what} "
                                   f"(--join-timeout)")
            time.sleep(next(pauses))

    def _pauses(self) -> Iterator[float]:
        """The pauses between a wait's polls of the store: LOCAL_POLL_S on the supervisor's TCPStore, growing by
        half each round from REMOTE_POLL_S's first to its second on a coordination service."""
        pause, longest = self._poll_s
        while True:
            yield pause
            pause = min(pause * 1.5, longest)


def process_group_backend(backend: Optional[str] = None,
                          device: Optional[str] = None) -> Tuple[str, Optional[torch.device]]:
    """(backend, device) of a generation's process group, by training.initialize_distributed's rule (the
    --distributed-backend and --device flags, None: their defaults): NCCL on this rank's GPU (LOCAL_RANK) when
    training on CUDA, else gloo (device None)."""
    device_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type != "cuda":
        return backend or "gloo", None
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return backend or "nccl", torch.device("cuda", local_rank)


def _watch_supervisor(membership: Membership, address: str):
    """This worker's side of the supervisor's liveness checks (main thread only; once per process):

    - a heartbeat (heartbeat/<rank>, every HEARTBEAT_S, on a store connection of its own): a process that stops
      beating (SIGSTOP, a wedged interpreter) while its peers report a failed collective is replaced; the
      file ENV_HEARTBEAT_FILE names, if set, is touched as often (the node agent's check, without the store)
      from a thread of its own, which no store request can delay (an etcd member lost or an election stalls
      a request for seconds: the agent would kill a healthy rank as hung). What the file says is only that
      the process runs and its interpreter is not wedged holding the GIL: a main thread blocked in a
      collective or looping forever in Python still beats (the abort and the collective timeout see those);
    - gen_<g>/abort, every ABORT_POLL_S while the process trains in generation g: the generation is
      interrupted (Membership.watch_for_abort), so a collective blocked on a hung or cut-off peer fails now,
      not at the collective timeout;
    - the supervisor gone without stopping this process (killed with SIGKILL: it had no chance to): this
      process is reparented, says so and exits, instead of training on with no one to record it;
    - SIGTERM (the supervisor stopping the job, e.g. because it got SIGTERM itself, as torchrun forwards it):
      said in this rank's log, then the default action (the process ends with that signal).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    rank, supervisor = membership.rank, os.getppid()

    def on_sigterm(signum, frame):
        print(f"[rank {rank}] > SIGTERM: this rank stops (the supervisor, pid {supervisor}, sends it when it stops "
              "the job)", flush=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    signal.signal(signal.SIGTERM, on_sigterm)
    store = connect_store(address, membership.config.join_timeout_s)
    keep, heartbeat_file = store_endpoints(address), os.environ.get(ENV_HEARTBEAT_FILE)

    def touch():
        while True:
            try:
                _touch(heartbeat_file)
            except OSError:  # the agent's directory gone (it is stopping): nothing to tell it
                pass
            time.sleep(HEARTBEAT_S)

    def beat():
        next_beat = 0.0
        while True:
            if os.getppid() != supervisor:
                print(f"[rank {rank}] > the supervisor (pid {supervisor}) is gone: stopping this rank (nothing is "
                      "left to replace a rank or record the job's progress)", file=sys.stderr, flush=True)
                os._exit(1)
            try:
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + HEARTBEAT_S
                    store.set(f"heartbeat/{rank}", repr(time.time()))
                membership.watch_for_abort(store, keep)
            except Exception:  # noqa: BLE001 - a busy or vanished store: the parent check above decides
                pass
            time.sleep(ABORT_POLL_S)
    threading.Thread(target=beat, name="megatron_lite_heartbeat", daemon=True).start()
    if heartbeat_file:
        threading.Thread(target=touch, name="megatron_lite_heartbeat_file", daemon=True).start()


def _touch(path: str):
    """Set `path`'s modification time to now (the file made, with this process's pid, at the first beat)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        with open(path, "w") as f:
            f.write(f"{os.getpid()}\n")
