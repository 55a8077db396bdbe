"""The per-node agent of live recovery across nodes: starts and watches this node's ranks; one agent leads.

    python -m megatron_lite.fault_tolerance.agent --etcd-endpoints h:p,h:p,h:p --job-id ID --nnodes N
        --nproc-per-node K [--node-name NAME] [--node-ttl 3] [--heartbeat-timeout 5] [--spares 1]
        [--collective-timeout 30] [--join-timeout 60] [--max-restarts 1] [--max-replacements 20] [--trouble-grace 2]
        [--min-instances M [--replacement-timeout 10]] pretrain_gpt.py ARGS...

Run one on every node (torchrun's --nnodes / --nproc-per-node); the world size is N x K, and agents beyond the
first N to register are hot spares. Everything the job shares lives in etcd under /megatron_lite/<job id>/
(cluster.py lists the keys); the ranks use it as their store (membership.py on an EtcdStore). An agent:

    registers        nodes/<incarnation> (incarnation = node name + a new random suffix at every start), bound
                     to a lease of --node-ttl seconds that a thread keeps alive every --node-ttl / 4
    leads            if it holds the `leader` key (created with its lease: one at a time): every decision of
                     the single-node supervisor (launch.py), in cluster.Leader; when its node dies the lease
                     expires and another agent takes over from the keys. The start waits --join-timeout for
                     the first N nodes (then exit 1 naming how many came)
    reconciles       to gen_<g>/placement: exactly one process for each slot placed on it, started for the
                     slot's since-generation; a process of a slot moved or replaced is killed (SIGKILL)
    keeps spares     --spares (default 1) warm processes: the training command started ahead (torch imported),
                     waiting in Membership.from_env on spare_<id>/assign (id: incarnation.n); a slot's new
                     process is one of them if one waits (assigned its rank, generation and variables), else
                     started afresh; replenished once training logged past the recovery (a starting process
                     slows a recovery on few cores); one that dies is said and no more are started
    reports          exit/<slot>/<pid> when a current process ends (the leader decides what follows)
    detects hangs    a rank whose heartbeat file (MEGATRON_LITE_LIVE_HEARTBEAT_FILE) is older than
                     --heartbeat-timeout, after its first beat, is killed (SIGKILL): a death like any other
    fences itself    when its lease has not been renewed for --node-ttl seconds (cut off, frozen), it kills
                     every rank at once: the leader moves them to a spare meanwhile. Once etcd answers again it
                     revokes the old lease and registers as a new incarnation (a spare, or a grow candidate)
    ends             on job/outcome (training finished: 0; a usage error, an error at start-up, no restart
                     left, a placement that breaks the rule (exit 2)): stops its ranks and exits with its code;
                     SIGTERM / SIGINT / SIGHUP / SIGQUIT: forwarded to its ranks, exit 1 (as torchrun)

The workers' environment is torchrun's (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK = the
node's index, ROLE_*, TORCHELASTIC_RUN_ID = the job id, ...), this agent's own (GLOO_SOCKET_IFNAME reaches the
ranks), and membership's: the store URL, the generation the process was started for, the timeouts,
MEGATRON_LITE_LIVE_NODE (the incarnation: a fenced process exits) and its heartbeat file.
"""

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from ..distributed.layout import DataParallelTopology
from . import membership
from .cluster import LEADER_POLL_S, JobKeys, JobSpec, Leader, NotLeader, StaleView, parse_placement
from .etcd import EtcdClient, EtcdError
from .launch import (
    FORWARDED_SIGNALS,
    SignalReceived,
    _raise_signal,
    add_live_arguments,
    default_worker_threads,
    live_config,
    run_until_signal,
    stop_processes,
)
from .placement import place

POLL_S = 0.05
"""How often the agent looks at its processes (waitpid, heartbeat files); etcd is read every LEADER_POLL_S."""
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RESTART_COUNT",
                  membership.ENV_GENERATION, membership.ENV_HEARTBEAT_FILE)
"""The per-process variables a warm spare gets with its assignment (spare_<id>/assign), not at its start."""
LEADER_ERRORS = 50
"""Consecutive failed rounds (5 s) after which the leader gives up on the job (Agent.lead)."""


def job_prefix(job_id: str) -> str:
    return f"/megatron_lite/{job_id}/"


def store_url(endpoints, job_id: str) -> str:
    """The workers' EtcdStore (membership.connect_store): etcd://h:p,h:p/megatron_lite/<job>/store/."""
    return f"etcd://{','.join(endpoints)}{job_prefix(job_id)}store/"


def instances_of(command) -> int:
    """R: the training command's --num-distributed-optimizer-instances (1 when absent)."""
    flag = "--num-distributed-optimizer-instances"
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            return int(command[i + 1])
        if arg.startswith(flag + "="):
            return int(arg.split("=", 1)[1])
    return 1


def local_address(endpoint: str) -> str:
    """This node's address as seen by etcd (the route to the first endpoint), for the node's record."""
    host, port = endpoint.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, int(port)))
            return s.getsockname()[0]
        except OSError:
            return "?"


@dataclass
class Rank:
    """One of this node's processes: its slot's process started for generation `since`."""

    proc: subprocess.Popen
    since: int
    heartbeat_file: str


class Agent:
    """One node's agent (see the module docstring)."""

    def __init__(self, args, spec: JobSpec, client: EtcdClient, keepalive_client: EtcdClient):
        self.args, self.spec, self.client = args, spec, client
        self.keepalive_client = keepalive_client  # its own connection: the main loop may be waiting on the other
        self.keys = JobKeys(client, job_prefix(args.job_id) + "store/")
        self.name = args.node_name
        self.address = local_address(args.etcd_endpoints[0])
        self.store_url = store_url(args.etcd_endpoints, args.job_id)
        self.heartbeat_dir = tempfile.mkdtemp(prefix=f"megatron_lite_{args.job_id}_")
        self.ranks: Dict[int, Rank] = {}
        self.ended: Set[Tuple[int, int]] = set()  # (slot, since) whose process ended: not restarted by itself
        self.unreported = []  # (name, value): exit reports and process records etcd did not take yet, in order
        self.leader: Optional[Leader] = None
        self.incarnation, self.lease = None, 0
        self.lock = threading.Lock()
        self.last_renewed = time.monotonic()
        self.fenced = False
        self.stopping = threading.Event()
        self.etcd_down_said = False
        self.leader_errors = 0
        self.starting, self.signalled = False, None  # a rank being started; a signal that came meanwhile
        self.num_spares = args.spares
        self.spares: List[Tuple[str, subprocess.Popen]] = []  # warm processes waiting for a rank, oldest first
        self.spare_count = 0
        self.spare_after_logged: Optional[int] = None  # replenish once training passed this iteration again

    def on_signal(self, signum, frame):
        """FORWARDED_SIGNALS' handler: launch.py's (SignalReceived), deferred while a rank is being started so
        that the process is in self.ranks (stopped by close()) when it is raised, never left running alone."""
        if not self.starting:
            _raise_signal(signum, frame)
        for name in FORWARDED_SIGNALS:  # as _raise_signal: the first one only
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_IGN)
        self.signalled = signum

    def say(self, text: str):
        print(f"[agent {self.incarnation or self.name}] {text}", flush=True)

    # ------------------------------------------------------------------ liveness
    def register(self):
        """A new incarnation of this node: its record bound to a new lease."""
        ttl = max(1, math.ceil(self.args.node_ttl))
        granted = time.monotonic()  # the lease's countdown starts in etcd at the grant: --node-ttl from here
        lease = self.client.lease_grant(ttl)
        incarnation = f"{self.name}.{uuid.uuid4().hex[:8]}"
        while True:  # the registration order (job/node_seq): the first N nodes train, the others are spares
            current = self.keys.get("job/node_seq")
            seq = int(current or 0) + 1
            if self.client.replace(self.keys.root + "job/node_seq", current, str(seq)):
                break
        record = {"name": self.name, "address": self.address, "nproc": self.spec.nproc_per_node, "pid": os.getpid(),
                  "seq": seq}
        self.keys.put(f"nodes/{incarnation}", json.dumps(record), lease=lease)
        with self.lock:
            self.incarnation, self.lease, self.fenced = incarnation, lease, False
            self.last_renewed = granted
        self.say(f"registered (node {seq} of the job, lease {ttl} s)")

    def keep_alive(self):
        """Thread: renew the lease every --node-ttl / 4; a lease etcd says is gone fences at once."""
        while not self.stopping.wait(self.args.node_ttl / 4):
            lease, sent = self.lease, time.monotonic()
            try:
                remaining = self.keepalive_client.lease_keepalive(lease)
            except EtcdError:
                continue
            if remaining > 0:
                with self.lock:
                    if lease == self.lease:  # renewed at most TTL before etcd lets it expire: fence before that
                        self.last_renewed = max(self.last_renewed, sent)
            elif lease == self.lease:
                self.fence(f"etcd says lease {lease:x} is gone")

    def watch_lease(self):
        """Thread: fence when the lease was not renewed for --node-ttl seconds (the keepalive thread may be
        waiting on an etcd that does not answer)."""
        while not self.stopping.wait(POLL_S):
            if time.monotonic() - self.last_renewed > self.args.node_ttl:
                self.fence(f"the lease was not renewed for {self.args.node_ttl:g} s (--node-ttl)")

    def fence(self, why: str):
        """Kill every rank at once: the rest of the job no longer counts this node in (or will not within
        --node-ttl), and its processes must never train or write on."""
        with self.lock:
            if self.fenced:
                return
            self.fenced = True
            for proc in [rank.proc for rank in self.ranks.values()] + [proc for _, proc in self.spares]:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
        self.say(f"fenced: {why}; killed rank(s) {sorted(self.ranks)} and {len(self.spares)} warm spare(s)")

    def rejoin(self):
        """After fencing: the ranks reaped (no exit reports: they were the node's, not deaths to replace), the
        old lease revoked (it may still be alive after a short outage) and a new incarnation registered, once
        etcd answers."""
        with self.lock:
            ranks, self.ranks = self.ranks, {}
            spares, self.spares = self.spares, []
        for proc in [rank.proc for rank in ranks.values()] + [proc for _, proc in spares]:
            proc.wait()
        self.leader, self.unreported = None, []  # the old incarnation's reports: its slots are moved anyway
        said = False
        while not self.stopping.is_set():
            try:
                self.client.lease_revoke(self.lease)
            except EtcdError:
                pass
            try:
                self.register()
                return
            except EtcdError as e:
                if not said:
                    self.say(f"etcd does not answer ({e}): waiting to register again")
                    said = True
                time.sleep(self.args.node_ttl / 4)

    # ------------------------------------------------------------------ processes
    def env(self, slot: int, since: int, local_rank: int, group_rank: int, heartbeat_file: str) -> dict:
        spec, config = self.spec, self.spec.config
        world = str(spec.world_size)
        torchrun = {"RANK": str(slot), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": world,
                    "LOCAL_WORLD_SIZE": str(spec.nproc_per_node), "GROUP_RANK": str(group_rank),
                    "GROUP_WORLD_SIZE": str(spec.nnodes), "ROLE_RANK": str(slot), "ROLE_WORLD_SIZE": world,
                    "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": self.args.job_id,
                    "TORCHELASTIC_RESTART_COUNT": self.keys.get("job/restarts") or "0",
                    "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                                      membership.NCCL_ASYNC_ERROR_HANDLING)}
        live = {membership.ENV_STORE: self.store_url, membership.ENV_GENERATION: str(since),
                membership.ENV_COLLECTIVE_TIMEOUT: str(config.collective_timeout_s),
                membership.ENV_JOIN_TIMEOUT: str(config.join_timeout_s), membership.ENV_NODE: self.incarnation,
                membership.ENV_HEARTBEAT_FILE: heartbeat_file}
        if config.elastic:
            live[membership.ENV_MIN_INSTANCES] = str(config.min_instances)
        return {**os.environ, **torchrun, **live}

    def reconcile(self, placement):
        """Exactly one process per slot placed here, started for the slot's since-generation; none other."""
        mine = {slot: since for slot, (inc, since) in placement.items() if inc == self.incarnation}
        for slot in [s for s, rank in self.ranks.items() if mine.get(s) != rank.since]:
            rank = self.ranks.pop(slot)
            rank.proc.kill()
            rank.proc.wait()
            self.say(f"rank {slot}: pid {rank.proc.pid} stopped (placement moved on)")
        nodes = list(dict.fromkeys(placement[s][0] for s in sorted(placement)))
        for local_rank, (slot, since) in enumerate(sorted(mine.items())):
            if slot in self.ranks or (slot, since) in self.ended:
                continue
            heartbeat_file = os.path.join(self.heartbeat_dir, f"rank_{slot}.{since}.heartbeat")
            env = self.env(slot, since, local_rank, nodes.index(self.incarnation), heartbeat_file)
            proc = self.assign_spare(slot, since, env)  # said there
            warm = proc is not None
            with self.lock:
                if self.fenced:
                    if proc is not None:
                        proc.kill()
                    return
                self.starting = True
                try:
                    if proc is None:
                        proc = subprocess.Popen([sys.executable, *self.args.command], env=env)
                    self.ranks[slot] = Rank(proc, since, heartbeat_file)
                finally:
                    self.starting = False
            if self.signalled is not None:
                raise SignalReceived(self.signalled)
            # queued (sent until etcd takes it): lost, an elastic grow would wait for this process forever
            self.unreported.append((f"proc/{slot}", json.dumps({"pid": proc.pid, "node": self.incarnation,
                                                                "generation": since})))
            if not warm:
                self.say(f"rank {slot}: pid {proc.pid} (generation {since})")
        self.send()

    def spawn_spare(self):
        """A warm spare: the training command started with a rank's environment but the rank's own variables
        (RANK_VARIABLES), torch imported and its arguments parsed, waiting in Membership.from_env on
        spare_<id>/assign (the id names this incarnation: unique across nodes and incarnations)."""
        self.spare_count += 1
        spare = f"{self.incarnation}.{self.spare_count}"
        env = {key: value for key, value in self.env(0, 0, 0, 0, "").items() if key not in RANK_VARIABLES}
        env[membership.ENV_SPARE] = spare
        with self.lock:
            if self.fenced:
                return
            self.starting = True
            try:
                proc = subprocess.Popen([sys.executable, *self.args.command], env=env)
                self.spares.append((spare, proc))
            finally:
                self.starting = False
        self.say(f"spare {spare}: pid {proc.pid}")
        if self.signalled is not None:
            raise SignalReceived(self.signalled)

    def assign_spare(self, slot: int, since: int, env: dict) -> Optional[subprocess.Popen]:
        """The oldest warm spare made the process of `slot` (its assignment carries the rank's variables), or
        None: no spare waits (a new process is started). Replenished once training moved on (tend_spares)."""
        while self.spares:
            spare, proc = self.spares.pop(0)
            if proc.poll() is not None:
                self.say(f"spare {spare} (pid {proc.pid}) died waiting (exit code {proc.returncode}): no more spares")
                self.num_spares = 0
                continue
            assignment = {"rank": slot, "generation": since, "env": {key: env[key] for key in RANK_VARIABLES}}
            try:
                self.keys.put(f"spare_{spare}/assign", json.dumps(assignment))
            except EtcdError:  # it may have been applied: this spare is no longer free for another slot
                proc.kill()
                proc.wait()
                raise
            self.spare_after_logged = int(self.keys.get("last_logged") or 0)
            self.say(f"rank {slot}: pid {proc.pid} (generation {since}, warm spare {spare})")
            return proc
        return None

    def tend_spares(self):
        """Drop spares that died (said; no more are started: one that dies waiting would die again); start
        new ones up to --spares, but not while a recovery is under way (on few cores a starting process slows
        it): only once training logged past the iteration of the last assignment."""
        dead = [(spare, proc) for spare, proc in self.spares if proc.poll() is not None]
        for spare, proc in dead:
            self.say(f"spare {spare} (pid {proc.pid}) died waiting (exit code {proc.returncode}): no more spares")
            self.num_spares = 0
            self.spares.remove((spare, proc))
        if len(self.spares) < self.num_spares and not self.fenced:
            if self.spare_after_logged is None or int(self.keys.get("last_logged") or 0) > self.spare_after_logged:
                self.spare_after_logged = None
                self.spawn_spare()

    def reap(self):
        """Ended processes: reported (exit/<slot>/<pid>), never restarted by the agent itself."""
        for slot, rank in list(self.ranks.items()):
            code = rank.proc.poll()
            if code is None:
                continue
            with self.lock:
                if self.fenced:
                    return
                del self.ranks[slot]
            self.ended.add((slot, rank.since))
            self.say(f"rank {slot} (pid {rank.proc.pid}) exited with code {code}")
            report = {"code": code, "node": self.incarnation, "generation": rank.since}
            self.unreported.append((f"exit/{slot}/{rank.proc.pid}", json.dumps(report)))

    def check_heartbeats(self):
        """A rank whose heartbeat file is older than --heartbeat-timeout (after its first beat) is hung: killed."""
        now = time.time()
        for slot, rank in self.ranks.items():
            try:
                silent = now - os.path.getmtime(rank.heartbeat_file)
            except FileNotFoundError:
                continue
            if silent > self.args.heartbeat_timeout and rank.proc.poll() is None:
                self.say(f"rank {slot} (pid {rank.proc.pid}): no heartbeat for {silent:.1f} s (--heartbeat-timeout "
                         f"{self.args.heartbeat_timeout:g}): killing it (SIGKILL)")
                rank.proc.kill()

    def stop_ranks(self, signum: int = signal.SIGTERM):
        """`signum` to every rank (SIGCONT after it: a stopped one gets it at once), SIGKILL to those left
        STOP_TIMEOUT_S later, as launch.py stops its workers."""
        with self.lock:
            procs = [rank.proc for rank in self.ranks.values()] + [proc for _, proc in self.spares]
            self.ranks, self.spares = {}, []
        stop_processes(procs, signum)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Until job/outcome: returns its code."""
        self.register()
        for target in (self.keep_alive, self.watch_lease):
            threading.Thread(target=target, name=f"megatron_lite_agent_{target.__name__}", daemon=True).start()
        next_read = 0.0
        while True:
            if self.fenced:
                self.rejoin()
            self.reap()
            self.check_heartbeats()
            if time.monotonic() >= next_read:
                next_read = time.monotonic() + LEADER_POLL_S
                try:
                    outcome = self.tick()
                except NotLeader as e:
                    self.say(f"no longer the leader: {e}")
                    self.leader = None
                    continue
                except EtcdError as e:
                    if not self.etcd_down_said:
                        self.say(f"etcd does not answer ({e}); the ranks train on until --node-ttl fences them")
                        self.etcd_down_said = True
                    continue
                self.etcd_down_said = False
                if outcome is not None:
                    return outcome
            time.sleep(POLL_S)

    def tick(self) -> Optional[int]:
        """One read of etcd: the reports out, the outcome, the leadership, the placement."""
        self.send()
        outcome = self.keys.get_json("job/outcome")
        if outcome is not None:
            self.say(f"the job ended: exit code {outcome['code']} ({outcome['why']})")
            return outcome["code"]
        # The key may be this incarnation's already: a create that etcd applied but did not confirm (the agent
        # then leads from the next round on; nobody else can while its lease lives).
        holder = self.keys.get("leader")
        if self.leader is None and (holder == self.incarnation or holder is None and self.client.create(
                self.keys.root + "leader", self.incarnation, lease=self.lease)):
            self.say("leading the job")
            self.leader = Leader(self.keys, self.incarnation, self.spec, say=lambda t: print(f"[leader] {t}",
                                                                                              flush=True))
        if self.leader is not None:
            self.lead()
        generation = self.keys.get("generation")
        if generation is not None:
            self.reconcile(parse_placement(self.keys.get(f"gen_{generation}/placement")))
        self.tend_spares()
        return None

    def send(self):
        """The queued reports and records, in order; an EtcdError leaves the rest queued for the next round."""
        while self.unreported:
            self.keys.put(*self.unreported[0])
            self.unreported.pop(0)

    def lead(self):
        """The leader's round. An error of its own (a bug, a key it cannot parse) is said and retried, not let
        end this agent: its node would be lost with it, and the next leader would meet it too. Past
        LEADER_ERRORS in a row the job ends (job/outcome 1) with it."""
        try:
            self.leader.step()
            self.leader_errors = 0
        except (EtcdError, NotLeader):
            raise
        except Exception as e:  # noqa: BLE001 - see the docstring
            self.leader_errors += 1
            if self.leader_errors == 1:
                traceback.print_exc()
            if self.leader_errors >= LEADER_ERRORS:
                try:
                    self.leader.outcome(1, f"the leader failed {LEADER_ERRORS} times in a row: {type(e).__name__}: "
                                           f"{e}")
                except StaleView:  # its view is older than the last commit: the next round reads it again
                    pass

    def close(self, signum: int = signal.SIGTERM):
        """Stop the ranks and leave: the lease revoked (the others see this node gone at once)."""
        self.stopping.set()
        self.stop_ranks(signum)
        shutil.rmtree(self.heartbeat_dir, ignore_errors=True)
        try:
            self.client.lease_revoke(self.lease)
        except EtcdError:
            pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--etcd-endpoints", required=True, type=lambda s: [e for e in s.split(",") if e],
                        help="host:port of the job's etcd members, comma-separated")
    parser.add_argument("--job-id", required=True, help="the job's name in etcd (/megatron_lite/<job id>/): one job")
    parser.add_argument("--nnodes", type=int, required=True, help="nodes that train (more that register: spares)")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node")
    parser.add_argument("--node-name", default=socket.gethostname(), help="this node's name (default: host name)")
    parser.add_argument("--node-ttl", type=float, default=3.0,
                        help="seconds of the node's lease: a node whose agent has not renewed it for this long is "
                             "lost to the job (and its agent kills its ranks: fencing)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0,
                        help="seconds without a rank's heartbeat (its file) before it is killed as hung")
    add_live_arguments(parser)
    args = parser.parse_args(argv)
    config = live_config(parser, args)
    for flag in ("nnodes", "nproc_per_node"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.node_ttl < 1:
        parser.error(f"--node-ttl must be >= 1 s (etcd's shortest lease), got {args.node_ttl:g}")
    try:
        instances = instances_of(args.command)
    except ValueError:
        parser.error("the training command's --num-distributed-optimizer-instances is not an integer")
    spec = JobSpec(args.nnodes, args.nproc_per_node, instances, config, args.max_restarts, args.max_replacements,
                   args.trouble_grace, args.replacement_timeout)
    try:  # the shape alone decides the placement rule: refused here, before etcd, on every node alike
        topology = DataParallelTopology(spec.world_size, instances)
        place(spec.world_size, topology.intra_distributed_optimizer_instance_size,
              [f"node {i}" for i in range(args.nnodes)], args.nproc_per_node)
    except ValueError as e:
        parser.error(f"{e} (--nnodes {args.nnodes} x --nproc-per-node {args.nproc_per_node}, the training "
                     f"command's --num-distributed-optimizer-instances {instances})")
    default_worker_threads(args.nproc_per_node, "agent")
    agent = Agent(args, spec, EtcdClient(args.etcd_endpoints),
                  EtcdClient(args.etcd_endpoints, timeout_s=min(1.0, args.node_ttl / 4)))
    return run_until_signal(agent.run, agent.on_signal, agent.say, "ranks", agent.close)


if __name__ == "__main__":
    sys.exit(main())
