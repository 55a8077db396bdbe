"""The leader of a job across nodes: launch.py's Supervisor's decisions, taken over the job's keys in etcd.

One agent (agent.py) per node; the one holding the `leader` key runs Leader.step() every LEADER_POLL_S. The
leader keeps nothing that is not in etcd but timers it may restart, so when its node dies another agent takes
over where it stood (docs/fault_tolerance.md, "Across nodes"). Keys, under the store prefix P/store/ (the
workers' EtcdStore, membership.py's keys beside them)::

    key                          writer   meaning
    nodes/<incarnation>          agent    JSON {name, address, nproc, pid, seq}, bound to the agent's lease
    leader                       leader   its incarnation, bound to its lease (created: one leader)
    gen_<g>/placement            leader   JSON {"<slot>": [incarnation, since_gen]}: where every placed slot runs
                                          and the generation its process was started for
    gen_<g>/members, /replaced   leader   membership.py's (written with the placement, before `generation`)
    gen_<g>/abort                leader   generation g was abandoned after a failure (its workers interrupt
                                          their collectives); not set on an elastic grow
    generation                   leader   the current generation (one txn with the keys above: atomic)
    exit/<slot>/<pid>            agent    JSON {code, node, generation}: that slot's current process ended
    proc/<slot>                  agent    JSON {pid, node, generation}: the last process started for the slot
    job/outcome                  leader   JSON {code, why}: every agent stops its ranks and exits with code
    job/restarts, /replacements  leader   whole-job restarts and live replacements so far
    job/commit                   leader   a new token at every commit: what the next one compares
    job/logged_at_start          leader   logged_count when this start of the job began (has it trained?)
    job/node_seq                 agent    counter: a node's registration order (the first N train, the
                                          others are hot spares)

Every leader write is one txn guarded by `leader` == its incarnation (a leader that lost its lease, cut
off or frozen, cannot write once another took over) and by job/commit == the token the leader read before
deciding (JobKeys.commit: a late copy of an earlier commit, or a decision on keys another commit changed
since, is refused). Decisions, in order (launch.py's module docstring):

    no generation yet            the first N nodes registered: slots placed (placement.place), generation 0
    a usage error / an error     job/outcome with that code (every start would meet it again)
    before this start trained
    every member exited 0        job/outcome 0
    exit 3, or 1 once trained    the other members' last words awaited, then every slot replaced (a whole-job
                                 restart, --max-restarts): resumes with --load
    a node lost (lease gone)     gen_<g>/abort at once; its slots move to a hot spare (a registered node
                                 without slots) as a whole; elastic without a spare: after
                                 --replacement-timeout, a generation of the complete instances (shrink)
    a rank died (a signal)       a new generation with that slot replaced on the same node
    trouble, nothing lost        after --trouble-grace: members that never report are replaced, else re-form
    elastic, a node registers    the left-out slots placed on it; once their processes are ready, a grow
"""

import base64
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..distributed.layout import DataParallelTopology
from .launch import DEAD, DONE, EXIT_KINDS, FALLBACK, STARTUP_ERROR, USAGE, exit_kind
from .membership import EXIT_FENCED, LiveConfig
from .placement import check_placement, place

LEADER_POLL_S = 0.1
"""How often the leader reads the job's keys."""

Placement = Dict[int, Tuple[str, int]]
"""slot -> (incarnation of its node, the generation its process was started for)."""


class NotLeader(RuntimeError):
    """A guarded write failed: another agent holds the `leader` key now."""


class StaleView(RuntimeError):
    """A guarded write failed: another commit happened since the view was read (Leader.step decides again)."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class JobKeys:
    """The job's keys (names relative to P/store/) on an EtcdClient: reads, and the leader's guarded txn."""

    def __init__(self, client, root: str):
        self.client, self.root = client, root

    def get(self, name: str) -> Optional[str]:
        value = self.client.get(self.root + name)
        return None if value is None else value.decode()

    def get_json(self, name: str, default=None):
        value = self.get(name)
        return default if value is None else json.loads(value)

    def get_prefix(self, name: str) -> Dict[str, str]:
        """Every key under `name`; values decoded leniently: gen_<g>/ holds the gloo rendezvous' binary keys too."""
        n = len(self.root)
        return {key[n:]: value.decode(errors="replace")
                for key, value in self.client.get_prefix(self.root + name).items()}

    def put(self, name: str, value: str, lease: int = 0):
        self.client.put(self.root + name, value, lease=lease)

    def commit(self, leader: str, puts: Dict[str, str], deletes=(), seen: Optional[str] = None) -> str:
        """`puts` and `deletes` at once, if `leader` still holds the `leader` key (NotLeader otherwise) and
        `job/commit` still holds `seen` (None: absent), the token of the last commit as read before the decision
        was made (StaleView otherwise). Every commit writes a new token there: a copy of a commit that an etcd
        member applies late (it was frozen while the leader timed out, decided again elsewhere and moved on)
        fails its compare instead of rolling the job back. Returns the new token."""
        token = uuid.uuid4().hex
        compare = [{"key": _b64(self.root + "leader"), "target": "VALUE", "result": "EQUAL", "value": _b64(leader)},
                   {"key": _b64(self.root + "job/commit"), "target": "CREATE", "result": "EQUAL",
                    "create_revision": "0"} if seen is None else
                   {"key": _b64(self.root + "job/commit"), "target": "VALUE", "result": "EQUAL", "value": _b64(seen)}]
        ops = [{"request_put": {"key": _b64(self.root + k), "value": _b64(v)}}
               for k, v in {**puts, "job/commit": token}.items()]
        ops += [{"request_delete_range": {"key": _b64(self.root + k)}} for k in deletes]
        succeeded, _ = self.client.txn(compare, ops)
        if not succeeded:
            if self.get("leader") != leader:
                raise NotLeader(f"{leader} no longer holds the leader key")
            raise StaleView("the job's keys changed since they were read (job/commit): deciding again")
        return token


def parse_placement(text: Optional[str]) -> Placement:
    return {int(slot): (inc, since) for slot, (inc, since) in json.loads(text or "{}").items()}


def dump_placement(placement: Placement) -> str:
    return json.dumps({str(slot): list(placement[slot]) for slot in sorted(placement)})


@dataclass(frozen=True)
class JobSpec:
    """What every agent knows from its command line (the leader's too)."""

    nnodes: int
    nproc_per_node: int
    instances: int  # R, the training command's --num-distributed-optimizer-instances
    config: LiveConfig
    max_restarts: int = 1
    max_replacements: int = 20
    trouble_grace_s: float = 2.0
    replacement_timeout_s: float = 10.0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@dataclass
class View:
    """One read of what the leader decides on."""

    nodes: Dict[str, dict]
    generation: Optional[int]
    placement: Placement = field(default_factory=dict)
    members: List[int] = field(default_factory=list)
    gen: Dict[str, str] = field(default_factory=dict)  # gen_<g>/... without the prefix
    ends: Dict[int, int] = field(default_factory=dict)  # slot -> exit code of its current process
    ends_at: Dict[int, List[str]] = field(default_factory=dict)  # slot -> the names of its current reports
    stale_exits: List[str] = field(default_factory=list)
    job: Dict[str, str] = field(default_factory=dict)
    logged_count: int = 0
    last_logged: int = 0

    def counter(self, name: str) -> int:
        return int(self.job.get(name, 0))

    @property
    def trained(self) -> bool:
        return self.logged_count > self.counter("logged_at_start")

    def reported(self, slot: int) -> bool:
        return f"trouble/{slot}" in self.gen

    def placed_nodes(self) -> List[str]:
        """The nodes of the placement, ordered by their lowest slot."""
        first = {}
        for slot in sorted(self.placement):
            first.setdefault(self.placement[slot][0], slot)
        return sorted(first, key=first.get)

    def spares(self, nproc: int) -> List[str]:
        """Registered nodes without a slot, in registration order."""
        busy = {inc for inc, _ in self.placement.values()}
        return sorted((inc for inc, info in self.nodes.items() if inc not in busy and info.get("nproc") == nproc),
                      key=lambda inc: self.nodes[inc].get("seq", 0))


class Leader:
    """The decisions of one leader's term (see the module docstring). step() is called every LEADER_POLL_S."""

    def __init__(self, keys: JobKeys, incarnation: str, spec: JobSpec, say=print):
        self.keys, self.incarnation, self.spec, self.say = keys, incarnation, spec, say
        try:
            self.topology = DataParallelTopology(spec.world_size, spec.instances)
        except ValueError:  # said as the placement's error at the start (job/outcome 2)
            self.topology = None
        self.since = time.monotonic()  # this term began: the start waits --join-timeout for the nodes
        self.short_since = None  # a whole-job restart found too few nodes (it waits --join-timeout from then)
        self.trouble_since = self.fallback_since = self.lost_since = None
        self.waiting_said = None
        self.seen: Optional[str] = None  # job/commit as read before this step's decision (JobKeys.commit)

    # ------------------------------------------------------------------ reading
    def read(self) -> View:
        k = self.keys
        job = {name[len("job/"):]: v for name, v in k.get_prefix("job/").items()}  # first: job/commit fences
        self.seen = job.get("commit")  # every decision on what is read below
        nodes = {name[len("nodes/"):]: json.loads(v) for name, v in k.get_prefix("nodes/").items()}
        generation = k.get("generation")
        view = View(nodes, None if generation is None else int(generation), job=job)
        view.logged_count = int(k.get("logged_count") or 0)
        if view.generation is None:
            return view
        prefix = f"gen_{view.generation}/"
        view.gen = {name[len(prefix):]: v for name, v in k.get_prefix(prefix).items()}
        view.placement = parse_placement(view.gen.get("placement"))
        view.members = json.loads(view.gen.get("members", "[]"))
        for name, text in k.get_prefix("exit/").items():
            report, slot = json.loads(text), int(name.split("/")[1])
            if view.placement.get(slot) == (report["node"], report["generation"]):
                view.ends[slot] = report["code"]
                view.ends_at.setdefault(slot, []).append(name)
            else:
                view.stale_exits.append(name)
        if self.spec.config.elastic:
            view.last_logged = int(k.get("last_logged") or 0)
        return view

    # ------------------------------------------------------------------ writing
    def commit(self, puts: Dict[str, str], deletes=()):
        """JobKeys.commit guarded by this leader's incarnation and the job/commit token its view was read with."""
        self.seen = self.keys.commit(self.incarnation, puts, deletes, seen=self.seen)

    def outcome(self, code: int, why: str) -> int:
        self.say(f"job outcome: exit code {code}: {why}")
        self.commit({"job/outcome": json.dumps({"code": code, "why": why})})
        return code

    def open_generation(self, view: View, placement: Placement, members, replaced, abort: bool, why: str,
                        deletes=(), puts=None, **job_counters):
        """Generation += 1 in one txn: its placement, members and replaced slots, `gen_<old>/abort` (a failure),
        the job's counters, `puts` (a grow's leave_at: never seen without its generation), then `generation`;
        `deletes` and the exit reports this view read of processes no longer current go in the same txn (by
        name: a report of a replaced slot's new process is never lost)."""
        new = 0 if view.generation is None else view.generation + 1
        puts = {**(puts or {}), f"gen_{new}/members": json.dumps(sorted(members)),
                f"gen_{new}/replaced": json.dumps(sorted(replaced)),
                f"gen_{new}/placement": dump_placement(placement),
                **{f"job/{name}": str(value) for name, value in job_counters.items()}}
        if abort and view.generation is not None:
            puts[f"gen_{view.generation}/abort"] = "1"
        puts["generation"] = str(new)
        stale = view.stale_exits + [name for slot in replaced for name in view.ends_at.get(slot, ())]
        # tidiness only (a report of a process that is no longer current is ignored): within etcd's 128 ops
        self.commit(puts, list(deletes) + stale[:100])
        self.trouble_since = self.fallback_since = self.lost_since = self.short_since = None
        nodes = {inc: [s for s in sorted(placement) if placement[s][0] == inc] for inc in dict.fromkeys(
            placement[s][0] for s in sorted(placement))}
        self.say(f"generation {new}: replaced {sorted(replaced)}"
                 + (f", members {sorted(members)}" if len(members) < self.spec.world_size else "")
                 + f"{why}; placement {nodes}")

    # ------------------------------------------------------------------ deciding
    def step(self, now: Optional[float] = None) -> Optional[int]:
        """One round of decisions. Returns the job's exit code once job/outcome is set (by this leader or
        an earlier one), else None. NotLeader when another agent leads now."""
        try:
            return self.decide(time.monotonic() if now is None else now)
        except StaleView as e:
            self.say(str(e))
            return None

    def decide(self, now: float) -> Optional[int]:
        outcome = self.keys.get_json("job/outcome")
        if outcome is not None:
            return outcome["code"]
        view = self.read()
        if view.generation is None:
            return self.start(view, now)
        # EXIT_FENCED from a process whose slot is still its own (it could not read the store): a death.
        kinds = {slot: exit_kind(code, view.trained) if code != EXIT_FENCED else DEAD
                 for slot, code in view.ends.items()}
        for slot, kind in sorted(kinds.items()):
            if kind in (USAGE, STARTUP_ERROR):
                return self.outcome(view.ends[slot], f"rank {slot} exited with code {view.ends[slot]} "
                                                     f"{EXIT_KINDS[kind]}")
        if view.members and all(kinds.get(slot) == DONE for slot in view.members):
            return self.outcome(0, "training finished")
        failed = sorted(slot for slot, kind in kinds.items() if kind == FALLBACK)
        if failed:
            return self.fall_back(view, failed, now)
        lost = {inc for inc, _ in view.placement.values()} - set(view.nodes)
        dead = sorted(slot for slot, kind in kinds.items() if kind == DEAD and view.placement[slot][0] in view.nodes)
        if lost or dead:
            return self.replace(view, lost, dead, now)
        if "trouble" in view.gen:
            return self.trouble(view, now)
        self.trouble_since = None
        if self.spec.config.elastic:
            self.grow(view)
        return None

    def place_job(self, view: View, now: float) -> Optional[Placement]:
        """Every slot placed on N live nodes (the placement's own first, then spares, in registration order),
        for generation view.generation + 1; None while too few nodes are registered (outcome after
        --join-timeout). placement.place's ValueError (the rule cannot hold) goes to the caller."""
        spec = self.spec
        live = [inc for inc in view.placed_nodes() if inc in view.nodes] + view.spares(spec.nproc_per_node)
        if len(live) < spec.nnodes:
            if self.short_since is None:  # the start: since this term began; a restart: since it found too few
                self.short_since = self.since if view.generation is None else now
            if now - self.short_since > spec.config.join_timeout_s:
                self.outcome(1, f"only {len(live)} of --nnodes {spec.nnodes} nodes (with --nproc-per-node "
                                f"{spec.nproc_per_node}) registered within --join-timeout "
                                f"{spec.config.join_timeout_s:g} s")
            elif self.waiting_said != len(live):
                self.waiting_said = len(live)
                self.say(f"waiting for nodes: {len(live)} of {spec.nnodes} registered")
            return None
        if self.topology is None:
            raise ValueError(f"--num-distributed-optimizer-instances {spec.instances} does not divide the world size "
                             f"{spec.world_size} (--nnodes {spec.nnodes} x --nproc-per-node {spec.nproc_per_node})")
        slots = place(spec.world_size, self.topology.intra_distributed_optimizer_instance_size, live[:spec.nnodes],
                      spec.nproc_per_node)
        new = 0 if view.generation is None else view.generation + 1
        return {slot: (inc, new) for slot, inc in slots.items()}

    def start(self, view: View, now: float) -> Optional[int]:
        try:
            placement = self.place_job(view, now)
        except ValueError as e:
            return self.outcome(2, str(e))
        if placement is None:  # too few nodes yet (or the outcome saying so, read by the next step)
            return None
        world = range(self.spec.world_size)
        self.open_generation(view, placement, world, world, False, " (the start)",
                             logged_at_start=view.logged_count, restarts=0, replacements=0)
        return None

    def fall_back(self, view: View, failed: List[int], now: float) -> Optional[int]:
        """Live recovery is impossible (exit 3) or a rank raised an error of its own once trained (exit 1): once
        every other live member wrote its last words (reported the failed collective) or ended, or
        --collective-timeout + --trouble-grace passed, restart the whole job (launch.py's await_last_words)."""
        restarts = view.counter("restarts")
        if restarts >= self.spec.max_restarts:
            return self.outcome(1, f"rank(s) {failed} exited with code(s) {[view.ends[s] for s in failed]}: live "
                                   "recovery is impossible and no restart is left (--max-restarts)")
        self.fallback_since = self.fallback_since or now
        bound = self.spec.config.collective_timeout_s + self.spec.trouble_grace_s
        waiting = [s for s in view.members if s not in view.ends and not view.reported(s)
                   and view.placement[s][0] in view.nodes]
        if waiting and now - self.fallback_since < bound:
            return None
        if waiting:
            self.say(f"rank(s) {waiting} did not report a failed collective within {bound:g} s: stopped without "
                     "last words")
        try:
            placement = self.place_job(view, now)
        except ValueError as e:
            return self.outcome(2, str(e))
        if placement is None:
            return None
        world = range(self.spec.world_size)
        self.open_generation(view, placement, world, world, True,
                             f" (live recovery is impossible: restarting the whole job, {restarts + 1}/"
                             f"{self.spec.max_restarts})", deletes=["finished"],  # a restarted job trains anew
                             restarts=restarts + 1, logged_at_start=view.logged_count)
        return None

    def replace(self, view: View, lost, dead: List[int], now: float) -> Optional[int]:
        """Lost nodes' slots to hot spares (each node's as a whole), dead slots restarted on their node."""
        g = view.generation
        if lost and "abort" not in view.gen:  # release the survivors blocked behind the lost node now
            self.commit({f"gen_{g}/abort": "1"})
            view.gen["abort"] = "1"
            self.say(f"node(s) {sorted(lost)} lost (lease expired): generation {g} aborted")
        spares = view.spares(self.spec.nproc_per_node)
        moves = {inc: spares.pop(0) for inc in sorted(lost) if spares}
        unplaced = sorted(set(lost) - set(moves))
        members = view.members
        placement = {}
        for slot, (inc, since) in view.placement.items():
            if inc in moves:
                placement[slot] = (moves[inc], g + 1)
            elif inc not in unplaced:
                placement[slot] = (inc, g + 1) if slot in dead else (inc, since)
        if unplaced:
            if not self.spec.config.elastic:
                if self.lost_since is None:
                    self.lost_since = now
                    self.say(f"no hot spare for node(s) {unplaced}: waiting for one to register")
                return None
            self.lost_since = self.lost_since or now
            if now - self.lost_since < self.spec.replacement_timeout_s:
                return None
            members = self.complete_instances(placement, members)
            if not members or DataParallelTopology.from_instance_size(
                    len(members), self.topology.intra_distributed_optimizer_instance_size
            ).num_distributed_optimizer_instances < self.spec.config.min_instances:
                return None  # too few complete instances to train on: the survivors fall back at --join-timeout
        replaced = sorted(s for s in placement if placement[s][1] == g + 1)
        replacements = view.counter("replacements") + len(replaced)
        if replacements > self.spec.max_replacements:
            return self.outcome(1, f"more than {self.spec.max_replacements} replacements (--max-replacements)")
        why = "".join([f", rank(s) {dead} died" if dead else "",
                       f", node(s) {sorted(moves)} lost: their slots moved to {[moves[i] for i in sorted(moves)]}"
                       if moves else "",
                       f", node(s) {unplaced} lost and no spare within --replacement-timeout: shrink" if unplaced
                       else ""])
        self.open_generation(view, placement, members, replaced, True, why, replacements=replacements)
        return None

    def complete_instances(self, placement: Placement, members) -> List[int]:
        """The members whose instance has every slot placed (elastic: instances are whole)."""
        topology = self.topology
        broken = {topology.instance(s) for s in range(self.spec.world_size) if s not in placement}
        return [s for s in members if topology.instance(s) not in broken]

    def trouble(self, view: View, now: float) -> Optional[int]:
        """A member reported a failed collective and nothing was lost: after --trouble-grace, members that never
        report (--collective-timeout + --trouble-grace after the first report: hung though their heartbeat file
        is fresh, e.g. a deadlock) are replaced on their node, else, once every live member reported, re-form."""
        self.trouble_since = self.trouble_since or now
        trouble_for = now - self.trouble_since
        if trouble_for <= self.spec.trouble_grace_s:
            return None
        live = [s for s in view.members if s not in view.ends]
        silent = [s for s in live if not view.reported(s)]
        if silent and trouble_for > self.spec.config.collective_timeout_s + self.spec.trouble_grace_s:
            placement = {s: (inc, view.generation + 1 if s in silent else since)
                         for s, (inc, since) in view.placement.items()}
            replacements = view.counter("replacements") + len(silent)
            if replacements > self.spec.max_replacements:
                return self.outcome(1, f"more than {self.spec.max_replacements} replacements (--max-replacements)")
            self.open_generation(view, placement, view.members, silent, True,
                                 f", rank(s) {silent} do not answer (no failed collective reported {trouble_for:.0f} "
                                 "s after the first)", replacements=replacements)
        elif not silent:
            self.open_generation(view, view.placement, view.members, [], True, " (re-form: every member reported "
                                 "a failed collective, nothing lost)")
        return None

    def grow(self, view: View):
        """Elastic: slots left out by a shrink go to a node that registered (in the current generation's
        placement: their processes wait to be admitted); once every slot of a left-out instance is ready to join,
        the members leave after an iteration none of them can have completed (launch.py's grow) and the next
        generation has them all."""
        if view.gen.get("ready") != "1" or self.keys.get("finished") is not None:
            return
        k, g = self.spec.nproc_per_node, view.generation
        unplaced = [s for s in range(self.spec.world_size) if s not in view.placement]
        spares = view.spares(k)
        if unplaced and spares:
            placement = dict(view.placement)
            for i in range(0, len(unplaced), k):
                if spares:
                    placement.update({s: (spares[0], g) for s in unplaced[i:i + k]})
                    spares.pop(0)
            if len(placement) == self.spec.world_size:
                try:
                    check_placement({s: inc for s, (inc, _) in placement.items()},
                                    self.topology.intra_distributed_optimizer_instance_size)
                except ValueError as e:
                    self.say(f"not growing: {e}")
                    return
            self.commit({f"gen_{g}/placement": dump_placement(placement)})
            self.say(f"generation {g}: slot(s) {sorted(set(placement) - set(view.placement))} placed on spare "
                     "node(s) to be admitted (elastic grow)")
            return
        standby, procs = self.keys.get_prefix("standby/"), self.keys.get_prefix("proc/")

        def ready(slot: int) -> bool:
            proc = json.loads(procs.get(f"proc/{slot}", "null"))
            return slot in view.members or (proc is not None and standby.get(f"standby/{slot}") == str(proc["pid"])
                                            and (proc["node"], proc["generation"]) == view.placement.get(slot))
        wanted = [s for s in self.complete_instances(view.placement, range(self.spec.world_size))
                  if all(ready(r) for r in self.topology.instance_ranks(self.topology.instance(s)))]
        if set(wanted) > set(view.members):
            leave_at = view.last_logged + 2
            self.open_generation(view, view.placement, wanted, [], False,
                                 f" (grow: instance(s) back; the members leave after iteration {leave_at})",
                                 puts={f"gen_{g}/leave_at": str(leave_at)})
