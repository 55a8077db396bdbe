"""The multi-node live soak (`python examples/fault_tolerance_soak.py --live --nodes 3 --kills 10`): one job on a
simulated cluster whose nodes are killed, hung and cut off one at a time, and which trains on, exact.

    node0 (netns)        node1              node2              node3 (the hot spare)
    etcd member          etcd member        etcd member        -
    agent                agent              agent              agent: registered, no slots
      rank 0, rank 1       rank 2, rank 3     rank 4, rank 5
      instance 0           instance 1         instance 2       R=3: every node holds one whole replica

megatron_lite/fault_tolerance/netns.py's SimulatedCluster (one network namespace per node on a bridge, the
ranks' GLOO_SOCKET_IFNAME its interface) with --nodes + 1 nodes, a LocalEtcd of 3 members on the first 3, one
agent per node (`python -m megatron_lite.fault_tolerance.agent`), the soak's GPT at dp = 2 x --nodes and R =
--nodes (instances of 2 ranks: each node is one instance, MindIO's layout, so every shard has a replica on each
node and a node lost leaves R - 1 of each; at 3 nodes R=2 would satisfy the placement rule too, with instances
of 3 ranks across 2 nodes and a single copy left of the lost node's shards). Faults, one at a time, cycled
over --kills (a node picked at random among those training), each once the job has recovered from the
previous one and trained a few iterations; a node fault also waits for the previous node fault's node to be
back as the spare (a rank hung or an etcd member killed comes meanwhile):

    node killed          SIGKILL to everything in the node's namespace (agent, ranks, etcd member); then the
                         node "reboots": its etcd member restarts from its data directory, a fresh agent
                         registers (the new spare)
    node hung            SIGSTOP to everything in it; SIGCONT once the job recovered: its agent fences itself
                         (kills its ranks) and registers again, as a spare
    partition            the node's link cut; mended once the job recovered: fenced and back as above, and no
                         process of it writes a checkpoint or last words after the cut
    rank hung            SIGSTOP to one rank: its agent finds its heartbeat file stale and replaces it
    etcd member killed   one etcd member SIGKILLed alone (every other time the raft leader: an election), restarted
                         a few iterations later: nothing changes (no new generation, no process restarted)

Per fault: detection (the fault -> the first agent line opening a new generation: the leader's decision), the
fault -> the interrupted iteration completed again on every rank (the ranks' recovery records; for the etcd
member, the next iteration logged), the iterations lost, whether every rank outside the fault kept its process,
and the faulted node's fencing. A few iterations after the last fault the job is stopped (or it ends by itself
at --iters) and every loss is compared with an uninterrupted `torchrun` run of the same flags stopped at the
same iteration (--exit-interval): bit-identical. Beside it, once (--restart-kills), the restart-everything
path on the same model: `torchrun --nproc-per-node 6 --max-restarts 1`, one rank killed, every process
restarted from the last words.

Every line of a node's output (its agent's and its ranks', one pipe) reaches OUT/<node>.log prefixed with the
time it arrived: the agents' lines are timed on the soak's clock.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

from fault_tolerance_soak import MODEL, REPO, launch, records, reference_losses, trial, wait_for
from live_soak import recoveries

if REPO not in sys.path:  # megatron_lite from this checkout when it is not installed (pip install -e .)
    sys.path.insert(0, REPO)

RANKS_PER_NODE = 2


def instances(nodes: int) -> int:
    """R = the number of nodes that train: instances of RANKS_PER_NODE ranks, one per node (see the module
    docstring), which the placement rule allows at any number of nodes (R <= nodes)."""
    return nodes
ETCD_MEMBERS = 3
KINDS = ("node killed", "rank hung", "node hung", "etcd member killed", "partition")
"""The soak's cycle: a node fault, then one that needs no spare while the node comes back."""
NODE_FAULTS = ("node killed", "node hung", "partition")
SETTLE_ITERATIONS = 5
"""Iterations trained between a fault's repair and the next fault (and, for an etcd member, while it is down)."""
NODE_TTL_S, HEARTBEAT_TIMEOUT_S = 3, 5
AGENT_FLAGS = ["--node-ttl", str(NODE_TTL_S), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]
DETECTION_BOUND_S = {"node": NODE_TTL_S + 0.5 + 1.0 + 0.1 + 2.0, "rank hung": HEARTBEAT_TIMEOUT_S + 1.0 + 0.15 + 2.0}
"""The detection bounds a fault must meet (docs/fault_tolerance.md): a node's lease TTL + etcd's expiry
granularity + an etcd election + the leader's poll; the heartbeat timeout + one heartbeat period + the agent's and
leader's polls; each + 2 s for a loaded machine (the soak measured up to 4.5 s and 4.75 s). Detected only at
--collective-timeout would fail here."""
ETCD_FAULT_BOUND_S = 5.0
"""An etcd member's loss alone: the next iteration on every rank within this (clients fail over; measured
0.1-0.3 s)."""
"""The agents' liveness flags (the contract's defaults, given explicitly: the detection bounds of the docs)."""
CHECKPOINT_LINES = ("wrote last words", "saved checkpoint")
"""What a rank prints when it has committed a checkpoint or its last words (a fenced node must print neither)."""
GENERATION_LINE = re.compile(r"\[leader\] generation (\d+): replaced")
"""The leading agent's line opening a generation (cluster.Leader.open_generation)."""
REGISTERED_LINE = re.compile(r"\[agent [^\]]+\] registered")
"""An agent's line: it registered its node (a new incarnation) in etcd."""
LAST_WORDS_LINE = re.compile(r"\] > wrote last words at iteration (\d+)")
"""A rank's line: the iteration it had completed when its generation failed (its snapshot's)."""


def model_flags(dp: int) -> list:
    """The soak's GPT (fault_tolerance_soak.MODEL) at data-parallel size `dp`: one micro-batch of 2 per rank, a
    10-iteration warmup whatever --train-iters is."""
    flags = list(MODEL)
    flags[flags.index("--global-batch-size") + 1] = str(2 * dp)
    return flags + ["--lr-warmup-iters", "10"]


# ------------------------------------------------------------------------------------ reading the logs
def read_log(path: str) -> list:
    """[(arrival time, text)] of a node log; a line without the time prefix (cut by a crash) is left out."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            stamp, sep, text = line.rstrip("\n").partition(" | ")
            try:
                out.append((float(stamp), text))
            except ValueError:
                continue
    return out


def generations_opened(lines: list) -> dict:
    """generation -> the earliest time an agent's line opened it, over the lines of every node. The lines may
    hold other output too (a rank's record glued to an agent's line): the pattern is searched, not anchored."""
    out = {}
    for t, text in lines:
        for match in GENERATION_LINE.finditer(text):
            g = int(match.group(1))
            out[g] = min(t, out.get(g, t))
    return out


def healed_generation(text: str, after: int, world: int):
    """The newest generation after `after` whose recovery records (live_training._report) came from all `world`
    ranks, or None."""
    found = recoveries(text)
    complete = [g for g, records_ in found.items() if g > after and len({r["rank"] for r in records_}) == world]
    return max(complete, default=None)


def recovered_at(records_of_generation: list) -> float:
    """When the interrupted iteration had completed again on every rank ('redone'; a rank's record without it,
    the last mark it has)."""
    return max(r.get("redone") or max(v for k, v in r.items() if isinstance(v, float)) for r in records_of_generation)


def phases(at: float, detected, records_of_generation: list) -> dict:
    """Where a recovery's time went, in seconds: detection (the fault -> the leader's new generation), start
    (-> the last replacement process ready: torch imported, arguments parsed), join (-> every rank arrived and
    the groups formed), heal (-> state rebuilt and shards sent), redo (-> the interrupted iteration completed
    on every rank). A phase is None when a mark is missing (no replacement: no start)."""
    def last(key, records):
        values = [r.get(key) for r in records]
        return max(values) if values and None not in values else None
    replacements = [r for r in records_of_generation if r.get("role") == "replacement"]
    ends = [at, detected, last("failed", replacements) if replacements else None,
            *(last(key, records_of_generation) for key in ("joined", "healed", "redone"))]
    out, start = {}, at
    for name, end in zip(("detection", "start", "join", "heal", "redo"), ends[1:]):
        out[name] = None if start is None or end is None else round(end - start, 2)
        start = end if end is not None else start
    return out


def resumed_from(first: int, target) -> int:
    """The iteration the job went on from after a fault: `first`, the first iteration logged after it, less one,
    or `target`, the newest iteration a survivor had completed (its last words), when the first record is of
    that iteration or later: a record of the target itself is rank 0's catch-up (a new rank 0 logs the
    iteration its predecessor completed but did not log, or logged but did not note in the store: then it
    appears twice, with the same values), not a redone iteration."""
    return target if target is not None and first >= target else first - 1


def committed_between(lines: list, start: float, end: float) -> list:
    """The lines from `start` to `end` in which a rank says it committed a checkpoint or last words."""
    return [text for when, text in lines if start < when <= end and any(what in text for what in CHECKPOINT_LINES)]


def registered_at(lines: list, after: float):
    """When an agent's line first said it registered after `after` (a node's log), or None."""
    return next((when for when, text in lines if when > after and REGISTERED_LINE.search(text)), None)


# ------------------------------------------------------------------------------------ the job's processes
def job_ranks(job_id: str) -> dict:
    """slot -> [(pid, incarnation, state)] of the job's training processes, read from /proc (the environment the
    agent gave them: TORCHELASTIC_RUN_ID, RANK, MEGATRON_LITE_LIVE_NODE); state is /proc's letter (T: stopped,
    Z: dead, not reaped)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            if env.get(b"TORCHELASTIC_RUN_ID") != job_id.encode():
                continue
            rank = int(env[b"RANK"]) if b"RANK" in env else assigned_rank(env)
            if rank is None:  # a warm spare still waiting for its rank
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pretrain_gpt.py" not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError):
            continue
        node = env.get(b"MEGATRON_LITE_LIVE_NODE", b"?").decode()
        out.setdefault(rank, []).append((int(pid), node, state))
    return out


def assigned_rank(env: dict):
    """A warm spare's rank (its agent's spare_<id>/assign: /proc keeps the environment it started with, without
    RANK), or None: not a spare, or not assigned yet."""
    from megatron_lite.fault_tolerance.etcd import EtcdClient, EtcdError

    spare, url = env.get(b"MEGATRON_LITE_LIVE_SPARE"), env.get(b"MEGATRON_LITE_LIVE_STORE", b"").decode()
    if spare is None or not url.startswith("etcd://"):
        return None
    endpoints, prefix = url[len("etcd://"):].split("/", 1)
    try:
        value = EtcdClient(endpoints.split(","), timeout_s=1.0).get(f"/{prefix}spare_{spare.decode()}/assign")
    except EtcdError:
        return None
    return None if value is None else int(json.loads(value)["rank"])


def running(job_id: str, world: int):
    """slot -> (pid, node name) when every slot has exactly one running process (not stopped, not dead), else
    None (a recovery or a repair is under way)."""
    ranks = {slot: [p for p in procs if p[2] not in "TtZX"] for slot, procs in job_ranks(job_id).items()}
    if sorted(ranks) != list(range(world)) or any(len(p) != 1 for p in ranks.values()):
        return None
    return {slot: (procs[0][0], procs[0][1].rsplit(".", 1)[0]) for slot, procs in ranks.items()}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


class NodeLog:
    """A node's output (its agent's and its ranks', one pipe) appended to `path`, each line prefixed with the
    time it arrived; ends when every process holding the pipe is gone."""

    def __init__(self, path: str, pipe):
        self.thread = threading.Thread(target=self._copy, args=(path, pipe), daemon=True)
        self.thread.start()

    @staticmethod
    def _copy(path, pipe):
        with open(path, "a") as out, pipe:
            for line in iter(pipe.readline, b""):
                out.write(f"{time.time():.3f} | {line.decode(errors='replace').rstrip()}\n")
                out.flush()


class ClusterJob:
    """One job on a simulated cluster: the nodes, the etcd members, an agent per node, their logs.

    Args:
        directory: its --save (and metrics) directory; the node logs are written there too.
        nodes: nodes that train (one more is started as the hot spare).
        iters: the job's --train-iters.
        save_interval: its --save-interval.
        loopback: nodes on 127.0.0.<k+2> instead of network namespaces (where namespaces cannot be made): a node's
            etcd member is adopted by its node so that the node's faults reach it; no partition.
    """

    def __init__(self, directory: str, nodes: int, iters: int, save_interval: int, agent_flags=AGENT_FLAGS,
                 loopback: bool = False):
        from megatron_lite.fault_tolerance.etcd import EtcdClient
        from megatron_lite.fault_tolerance.local_etcd import LocalEtcd
        from megatron_lite.fault_tolerance.netns import SimulatedCluster

        self.directory, self.num_nodes, self.iters = directory, nodes, iters
        self.world = nodes * RANKS_PER_NODE
        self.job_id = f"soak{uuid.uuid4().hex[:8]}"
        self.command = [os.path.join(REPO, "pretrain_gpt.py"), *model_flags(self.world), "--train-iters", str(iters),
                        "--num-distributed-optimizer-instances", str(instances(nodes)), "--save", directory,
                        "--load", directory, "--save-interval", str(save_interval)]
        self.agent_flags = list(agent_flags)
        self.agents = {}  # node name -> Popen of its latest agent
        self.cluster = SimulatedCluster(nodes + 1, loopback=loopback)
        self.cluster.__enter__()
        try:
            self.nodes = {node.name: node for node in self.cluster.nodes}
            self.order = [node.name for node in self.cluster.nodes]
            self.etcd_nodes = self.order[:ETCD_MEMBERS]
            self.etcd = LocalEtcd([self.nodes[name].address for name in self.etcd_nodes],
                                  prefix_argvs=[self.nodes[name].prefix_argv for name in self.etcd_nodes])
            self.etcd.__enter__()
            for i in range(ETCD_MEMBERS):
                self.cluster.adopt(self.nodes[self.etcd_nodes[i]], self.etcd.processes[i])
            self.client = EtcdClient(self.etcd.endpoints, timeout_s=1.0)
            for name in self.order[:nodes]:  # the first --nodes to register train
                self.start_agent(name)
            wait_for(lambda: len(self.registered()) == nodes, self, self.watched(), "the agents to register")
            self.start_agent(self.order[nodes])  # the last: the hot spare
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ processes
    def restart_etcd(self, name: str):
        """Restart node `name`'s etcd member from its data directory (after a kill), still one of the node's."""
        i = self.etcd_nodes.index(name)
        self.etcd.restart(i)
        self.cluster.adopt(self.nodes[name], self.etcd.processes[i])

    def start_agent(self, name: str):
        """A fresh agent on node `name` (a new incarnation: it trains if a slot needs a node, else it is a spare)."""
        node = self.nodes[name]
        argv = [sys.executable, "-m", "megatron_lite.fault_tolerance.agent", "--etcd-endpoints",
                ",".join(self.etcd.endpoints), "--job-id", self.job_id, "--nnodes", str(self.num_nodes),
                "--nproc-per-node", str(RANKS_PER_NODE), "--node-name", name, *self.agent_flags, *self.command]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "GLOO_SOCKET_IFNAME": node.ifname}
        proc = self.cluster.popen(node, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        NodeLog(self.log_path(name), proc.stdout)
        self.agents[name] = proc

    def poll(self):
        """None while an agent runs; once every one has exited (the job ended), the highest exit code."""
        codes = [proc.poll() for proc in self.agents.values()]
        return None if None in codes else max(codes)

    @property
    def returncode(self):
        return self.poll()

    def close(self):
        """Stop everything: every process of every node, the etcd members, the namespaces."""
        for closing in (self.cluster, getattr(self, "etcd", None)):  # the ranks and agents first, etcd last
            if closing is not None:
                try:
                    closing.__exit__(None, None, None)
                except Exception as e:  # noqa: BLE001 - clean up the rest whatever one part says
                    print(f"cluster soak: clean-up: {e!r}", file=sys.stderr)

    # ------------------------------------------------------------------ what the job shows
    def log_path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.log")

    def metrics(self) -> list:
        return records_tolerant(os.path.join(self.directory, "metrics.jsonl"))

    def watched(self) -> list:
        """What grows while the job makes progress (wait_for's stall bound)."""
        return [self.log_path(name) for name in self.order] + [os.path.join(self.directory, "metrics.jsonl")]

    def lines(self, name: str = None) -> list:
        """The timed lines of one node's log, or of every node's (by time)."""
        names = self.order if name is None else [name]
        return sorted((line for n in names for line in read_log(self.log_path(n))), key=lambda line: line[0])

    def text(self) -> str:
        return "\n".join(text for _, text in self.lines())

    def generation(self) -> int:
        """The newest generation the agents opened or the ranks recovered into (-1 before the first)."""
        return max([*generations_opened(self.lines()), *recoveries(self.text())], default=-1)

    def registered(self) -> set:
        """Names of the nodes with a live registration in etcd (P/store/nodes/<incarnation>)."""
        try:
            entries = self.client.get_prefix(f"/megatron_lite/{self.job_id}/store/nodes/")
        except Exception:  # noqa: BLE001 - etcd without quorum for a moment (a member restarting)
            return set()
        return {json.loads(value)["name"] for value in entries.values()}

    def ranks(self):
        return running(self.job_id, self.world)

    def wait_steady(self, what: str, every_node: bool = True, etcd: bool = True) -> dict:
        """Wait until every slot has one running process, with `every_node` every node is registered (the spare
        back), with `etcd` every etcd member healthy; returns the ranks."""
        ranks = wait_for(lambda: (not every_node or len(self.registered()) == len(self.order)) and self.ranks(),
                         self, self.watched(), what)
        if etcd:
            self.etcd.wait_healthy(range(ETCD_MEMBERS))
        return ranks


def records_tolerant(path: str) -> list:
    """fault_tolerance_soak.records, leaving out a last line cut by the job's stop."""
    try:
        return records(path)
    except ValueError:
        with open(path) as f:
            lines = f.read().splitlines()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return [r for r in out if "lm_loss" in r]


# ------------------------------------------------------------------------------------ faults
def inject(job: ClusterJob, kind: str, target: str, rng: random.Random) -> dict:
    """Cause one fault; `target` a node name, "rank0" (the node holding rank 0), "leader" (an etcd member
    killed: the raft leader's, a new election) or None (at random). Returns the fault's record (what was hit
    and when)."""
    trained = len(job.metrics()) + SETTLE_ITERATIONS  # the job trains between faults (and before the first)
    wait_for(lambda: len(job.metrics()) >= trained, job, job.watched(), f"{SETTLE_ITERATIONS} iterations")
    # A node fault needs the spare back (the previous node fault's node); an etcd member's, every member up.
    ranks = job.wait_steady(f"the job to be steady before a {kind}", every_node=kind in NODE_FAULTS,
                            etcd=kind != "rank hung")
    training = sorted({node for _, node in ranks.values()})
    metrics = job.metrics()
    fault = {"kind": kind, "resumed": None, "lost": None, "new_generations": [], "kept": None,
             "pids_before": {slot: pid for slot, (pid, _) in ranks.items()}, "generation_before": job.generation(),
             "completed": (metrics or [{"iteration": 0}])[-1]["iteration"], "metrics_before": len(metrics)}
    if kind == "rank hung":
        slot = rng.randrange(job.world)
        fault.update(node=ranks[slot][1], hit=[slot], what=f"rank {slot}")
        os.kill(ranks[slot][0], signal.SIGSTOP)
    elif kind == "etcd member killed":
        leader = job.etcd.leader() if target == "leader" else None  # None: no member names one now
        if leader is not None:
            node = job.etcd_nodes[leader]
        else:
            node = target if target in job.etcd_nodes else rng.choice(job.etcd_nodes)
        fault.update(node=node, hit=[], what=f"etcd {'leader' if leader is not None else 'member'} on {node}")
        job.etcd.kill(job.etcd_nodes.index(node))
    else:
        node = ranks[0][1] if target == "rank0" else target or rng.choice(training)
        fault.update(node=node, hit=sorted(s for s, (_, n) in ranks.items() if n == node), what=node)
        {"node killed": job.cluster.kill, "node hung": job.cluster.freeze, "partition": job.cluster.cut}[kind](
            job.nodes[node])
    fault["at"] = time.time()
    return fault


def recover(job: ClusterJob, fault: dict):
    """Wait for the job to recover from `fault` and repair its node (not waiting for it to be back: see
    came_back); fills in the fault's measurements."""
    kind, t0, before, node = fault["kind"], fault["at"], fault["metrics_before"], fault["node"]
    if kind == "etcd member killed":
        wait_for(lambda: len(job.metrics()) > before, job, job.watched(), "an iteration with an etcd member down")
        fault["next_iteration_s"] = time.time() - t0  # the soak's polling (20 ms) sees the record
        wait_for(lambda: len(job.metrics()) >= before + SETTLE_ITERATIONS, job, job.watched(),
                 "iterations with an etcd member down")
        job.restart_etcd(node)
    else:
        generation = wait_for(lambda: healed_generation(job.text(), fault["generation_before"], job.world), job,
                              job.watched(), f"the recovery from the {kind} of {fault['what']}")
        fault["generation"] = generation
        recovered = recovered_at(recoveries(job.text())[generation])
        fault["next_iteration_s"] = recovered - t0
        wait_for(lambda: len(job.metrics()) > before, job, job.watched(), "an iteration after the recovery")
        fault["target"] = max((int(m.group(1)) for when, text in job.lines() if t0 < when <= recovered
                               for m in LAST_WORDS_LINE.finditer(text)), default=None)
    fault["resumed"] = resumed_from(job.metrics()[before]["iteration"], fault.get("target"))
    fault["lost"] = max(0, fault["completed"] - fault["resumed"])
    if kind in NODE_FAULTS:
        if kind == "node killed":  # the node reboots: its etcd member from its data directory, a fresh agent
            if node in job.etcd_nodes:
                job.restart_etcd(node)
            job.start_agent(node)
        else:
            (job.cluster.thaw if kind == "node hung" else job.cluster.mend)(job.nodes[node])
    settled = len(job.metrics()) + SETTLE_ITERATIONS
    wait_for(lambda: len(job.metrics()) >= settled, job, job.watched(), f"{SETTLE_ITERATIONS} iterations more")
    opened = {g: t for g, t in generations_opened(job.lines()).items() if g > fault["generation_before"]}
    fault["detection_s"] = min(opened.values()) - t0 if opened else None
    if fault.get("generation") is not None:
        fault["phases"] = phases(t0, min(opened.values(), default=None),
                                 recoveries(job.text())[fault["generation"]])
    fault["new_generations"] = sorted(set(opened) | {g for g in recoveries(job.text())
                                                      if g > fault["generation_before"]})


def came_back(job: ClusterJob, fault: dict):
    """A node fault, once every node is registered again: when its node came back (its agent's registration),
    whether every process it trained with is gone (fenced), and what it committed from the fault until it
    came back (it must be nothing: its old processes are the only ones that could)."""
    back = registered_at(job.lines(fault["node"]), fault["at"])
    fault["back_s"] = None if back is None else back - fault["at"]
    fault["fenced"] = back is not None and not any(alive(fault["pids_before"][slot]) for slot in fault["hit"])
    fault["committed_after"] = committed_between(job.lines(fault["node"]), fault["at"], back or time.time())


def kept(fault: dict, pids_after: dict) -> bool:
    """Whether every rank outside the fault kept its process until `pids_after` (the next fault's or the end's)."""
    return all(pids_after.get(slot) == pid for slot, pid in fault["pids_before"].items() if slot not in fault["hit"])


def verdict(fault: dict) -> list:
    """What is wrong with a fault's outcome (empty: passed)."""
    wrong = [f"not recovered: {fault['error']}"] if "error" in fault else []
    if fault.get("lost"):
        wrong.append(f"{fault['lost']} iteration(s) lost")
    if not fault.get("kept"):
        wrong.append("a healthy rank got a new process")
    if fault["kind"] == "etcd member killed":
        if fault["new_generations"]:
            wrong.append(f"new generation(s) {fault['new_generations']}")
        if (fault.get("next_iteration_s") or 0) > ETCD_FAULT_BOUND_S:
            wrong.append(f"the next iteration came {fault['next_iteration_s']:.1f} s after (> {ETCD_FAULT_BOUND_S} s)")
    elif not fault["new_generations"] and "error" not in fault:
        wrong.append("no new generation")
    if fault["kind"] in NODE_FAULTS and "error" not in fault:
        if fault.get("back_s") is None:
            wrong.append("the node did not come back as the spare")
        elif not fault.get("fenced"):
            wrong.append("a process of the faulted node outlived the fault")
    bound = DETECTION_BOUND_S.get("node" if fault["kind"] in NODE_FAULTS else fault["kind"])
    if bound is not None and fault.get("detection_s") is not None and fault["detection_s"] > bound:
        wrong.append(f"detected after {fault['detection_s']:.1f} s (bound {bound:.1f} s)")
    if fault.get("committed_after"):
        wrong.append(f"the faulted node committed after the fault: {fault['committed_after'][0]!r}")
    return wrong


# ------------------------------------------------------------------------------------ the soak
def run(out: str, nodes: int, faults: list, iters: int, save_interval: int, rng: random.Random,
        agent_flags=AGENT_FLAGS, loopback: bool = False) -> tuple:
    """One job on `nodes` nodes + the spare, `faults` = [(kind, target)] (target: see inject) one after the
    other; the job is stopped SETTLE_ITERATIONS after the last one (unless it ended first), and its losses
    compared with an uninterrupted run's. Returns (faults' records, {iteration: [its logged losses]}, the last
    iteration logged with all before it, the job's exit code or None when stopped, the job's directory).
    `loopback`: nodes on 127.0.0.x (see ClusterJob); a partition among `faults` is refused (ValueError)."""
    directory = os.path.join(out, "cluster")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    if loopback and any(kind == "partition" for kind, _ in faults):
        raise ValueError("a partition needs network namespaces: loopback nodes share one network")
    job = ClusterJob(directory, nodes, iters, save_interval, agent_flags, loopback)
    done = []
    code = None
    try:
        for kind, target in faults:
            if (job.metrics() or [{"iteration": 0}])[-1]["iteration"] > iters - 4 * SETTLE_ITERATIONS:
                print(f"cluster soak: the job is near its end (--iters {iters}): {kind} not injected", flush=True)
                break
            fault = inject(job, kind, target, rng)
            if done:
                done[-1]["kept"] = kept(done[-1], fault["pids_before"])
            back_again(job, done, every_node=kind in NODE_FAULTS)
            done.append(fault)
            try:
                recover(job, fault)
            except (TimeoutError, RuntimeError) as e:  # the job did not recover: the soak fails, saying where
                fault["error"] = str(e)
                print(f"cluster soak: {kind} ({fault['what']}): {e}", flush=True)
                break
            print(f"cluster soak: {summary(fault)}", flush=True)
        code = job.poll()
        if done and code is None and "error" not in done[-1]:
            done[-1]["kept"] = kept(done[-1], {slot: pid for slot, (pid, _) in job.wait_steady("the end").items()})
            back_again(job, done, every_node=True)
    finally:
        job.close()
    seen = {}
    for r in job.metrics():
        seen.setdefault(r["iteration"], []).append(r["lm_loss"])
    last = max(i for i in seen if all(j in seen for j in range(1, i + 1))) if 1 in seen else 0
    return done, seen, last, code, directory


def back_again(job: ClusterJob, faults: list, every_node: bool):
    """came_back() for the node faults not yet checked, once the job was steady with every node registered."""
    if every_node:
        for fault in faults:
            if fault["kind"] in NODE_FAULTS and "back_s" not in fault and "error" not in fault:
                came_back(job, fault)


def reference(out: str, nodes: int, iters: int, last: int) -> dict:
    """The uninterrupted run of the job's flags (torchrun, one node), stopped at `last` (--exit-interval)."""
    directory = os.path.join(out, f"reference_dp{nodes * RANKS_PER_NODE}_to{last}")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    world = nodes * RANKS_PER_NODE
    job = launch(directory, iters, instances(nodes), iters, os.path.join(directory, "log.txt"), nproc=world,
                 model=model_flags(world) + ["--exit-interval", str(last)])
    if wait_for(None, job, [os.path.join(directory, f) for f in ("log.txt", "metrics.jsonl")],
                "the reference run") != 0:
        raise RuntimeError(f"the reference run failed: see {directory}/log.txt")
    return {r["iteration"]: r["lm_loss"] for r in records(os.path.join(directory, "metrics.jsonl"))}


def identical(seen: dict, expected: dict, last: int) -> bool:
    """Every iteration 1..last logged, each only with the uninterrupted run's loss."""
    return last > 0 and all(set(seen.get(i, ())) == {expected.get(i)} for i in range(1, last + 1))


def summary(fault: dict) -> str:
    def s(value):
        return "-" if value is None else f"{value:.2f}"
    return (f"{fault['kind']} ({fault['what']}): completed {fault['completed']}, resumed from {fault['resumed']}, "
            f"detection {s(fault.get('detection_s'))} s, next iteration on every rank "
            f"{s(fault.get('next_iteration_s'))} s, generations {fault['new_generations']}"
            + (f", back as the spare {s(fault['back_s'])} s after the fault" if "back_s" in fault else ""))


def table(faults: list, restart: dict = None) -> str:
    """The report: one row per fault, then per kind the mean and max beside the restart-everything path."""
    def s(value):
        return "-" if value is None else f"{value:.2f}"

    def fenced(f):
        return f"{'yes' if f.get('fenced') else 'NO'}; {s(f.get('back_s'))}" if f["kind"] in NODE_FAULTS else "-"
    def split(f):
        return " / ".join(s(v) for v in f["phases"].values()) if f.get("phases") else "-"
    rows = ["| # | fault | hit | completed | resumed from | lost | detection (s) | fault -> next iteration, every "
            "rank (s) | detection / start / join / heal / redo (s) | healthy PIDs kept | new generations | fenced; "
            "back as the spare after (s) | checkpoint after the fault | verdict |", "|" + "---|" * 14]
    for k, f in enumerate(faults):
        rows.append(f"| {k} | {f['kind']} | {f['what']} (ranks {f['hit']}) | {f['completed']} | {f['resumed']} | "
                    f"{f['lost']} | {s(f.get('detection_s'))} | {s(f.get('next_iteration_s'))} | {split(f)} | "
                    f"{'yes' if f.get('kept') else 'NO'} | {f['new_generations'] or 'none'} | {fenced(f)} | "
                    f"{'YES' if f.get('committed_after') else 'none'} | {'; '.join(verdict(f)) or 'ok'} |")
    rows += ["", "| fault | n | lost | detection mean / max (s) | fault -> next iteration mean / max (s) |",
             "|---|---|---|---|---|"]
    for kind in KINDS:
        of = [f for f in faults if f["kind"] == kind]
        if not of:
            continue
        cells = []
        for key in ("detection_s", "next_iteration_s"):
            values = [f[key] for f in of if f.get(key) is not None]
            cells.append(f"{sum(values) / len(values):.2f} / {max(values):.2f}" if values else "-")
        rows.append(f"| {kind} | {len(of)} | {sum(f['lost'] or 0 for f in of)} | {cells[0]} | {cells[1]} |")
    if restart:
        rows.append(f"| restart everything (torchrun, last words) | 1 | {restart['lost']} | - | "
                    f"{restart['recovery_s']:.2f} (kill -> first iteration) |")
    return "\n".join(rows)


def schedule(kills: int, loopback: bool = False) -> list:
    """--kills faults cycling over KINDS (without the partition on loopback nodes), at random nodes; every other
    etcd member killed is the raft leader (the first one included)."""
    kinds = [kind for kind in KINDS if not (loopback and kind == "partition")]
    faults = [(kinds[k % len(kinds)], None) for k in range(kills)]
    etcd = [k for k, (kind, _) in enumerate(faults) if kind == "etcd member killed"]
    return [("etcd member killed", "leader") if k in etcd[::2] else fault for k, fault in enumerate(faults)]


def main(args, rng: random.Random) -> bool:
    """`fault_tolerance_soak.py --live --nodes N`: the soak above, then its report; True when it passed."""
    from megatron_lite.fault_tolerance.local_etcd import etcd_available
    from megatron_lite.fault_tolerance.netns import netns_available

    ok, reason = etcd_available()
    if not ok:
        print(f"cluster soak: cannot run: {reason}")
        return False
    namespaces, why = (False, "--loopback-nodes") if args.loopback_nodes else netns_available()
    if not namespaces:
        print(f"cluster soak: nodes on 127.0.0.x, no partition faults ({why})", flush=True)
    # SIGTERM (timeout, a scheduler) ends the soak through its clean-up: every process, member and namespace
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    iters = args.iters
    faults, seen, last, code, directory = run(args.out, args.nodes, schedule(args.kills, not namespaces), iters,
                                              args.save_interval, rng, loopback=not namespaces)
    expected = reference(args.out, args.nodes, iters, last)
    exact = identical(seen, expected, last)
    restart = None
    world, R = args.nodes * RANKS_PER_NODE, instances(args.nodes)
    if args.restart_kills:
        restart_iters = 60
        restart_reference = reference_losses(args.out, restart_iters, R, nproc=world, model=model_flags(world))
        restart = trial(args.out, "restart_everything", restart_iters, R, args.save_interval, 30,
                        [rng.randrange(world)], restart_reference, nproc=world, model=model_flags(world))
        print(json.dumps(restart), flush=True)
    print(f"\n### live recovery across nodes ({args.nodes} {'loopback ' if not namespaces else ''}nodes x "
          f"{RANKS_PER_NODE} ranks + 1 spare, dp={world}, "
          f"R={R}, etcd x {ETCD_MEMBERS}, agents {' '.join(AGENT_FLAGS)})\n")
    print(table(faults, restart))
    missing = args.kills - len(faults)
    gap = max(seen, default=0) > last  # an iteration missing: the ones after it were never compared
    ok = not missing and exact and not gap and all(not verdict(f) for f in faults) and code in (None, 0)
    ok = ok and (restart is None or restart["identical"])
    twice = sorted(i for i, losses in seen.items() if len(losses) > 1)
    print(f"\n{len(faults)} faults, iterations 1-{last} logged (logged more than once, a new rank 0 catching up: "
          f"{twice or 'none'}), every loss bit-identical to the uninterrupted run: {'yes' if exact else 'NO'}"
          + (f"; {missing} fault(s) not injected (raise --iters)" if missing else "")
          + (f"; iteration {last + 1} missing, {max(seen)} logged" if gap else "")
          + ("" if code in (None, 0) else f"; the job ended with code {code}"))
    print(f"logs: {directory}/<node>.log")
    print("cluster soak:", "PASSED" if ok else "FAILED")
    return ok
