"""The per-node agent and the leader (megatron_lite/fault_tolerance/agent.py, cluster.py).

The leader's decisions are tested in-process on an in-memory stand-in of EtcdClient (FakeEtcd: the calls
cluster.py makes, leases included), step by step with the clock given; the agents end to end on loopback
(one etcd member, LocalEtcd) with a small fake worker, and once with pretrain_gpt.py.
"""

import base64
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from live_testing import FLAGS, PROGRESS_BOUNDED, STALL_S, check_exact, logged_losses, uninterrupted
from pretrain_testing import REPO

from megatron_lite.fault_tolerance.cluster import JobKeys, JobSpec, Leader, NotLeader, parse_placement
from megatron_lite.fault_tolerance.etcd import EtcdIndeterminate
from megatron_lite.fault_tolerance.membership import LiveConfig

ROOT = "/megatron_lite/test/store/"


class FakeEtcd:
    """EtcdClient's calls that cluster.py and agent.py make, on a dict (values bytes, keys str)."""

    def __init__(self):
        self.data, self.leases, self.next_lease = {}, {}, 100  # key -> (value, lease); lease -> keys

    def put(self, key, value, lease=0):
        self.data[key] = (value.encode() if isinstance(value, str) else value, lease)

    def get(self, key):
        return self.data[key][0] if key in self.data else None

    def get_prefix(self, prefix):
        return {k: v for k, (v, _) in sorted(self.data.items()) if k.startswith(prefix)}

    def delete(self, key):
        return self.data.pop(key, None) is not None

    def delete_prefix(self, prefix):
        for key in [k for k in self.data if k.startswith(prefix)]:
            del self.data[key]

    def create(self, key, value, lease=0):
        if key in self.data:
            return False
        self.put(key, value, lease)
        return True

    def replace(self, key, expected, value, lease=0):
        if self.get(key) != (None if expected is None else (expected.encode() if isinstance(expected, str)
                                                             else expected)):
            return False
        self.put(key, value, lease)
        return True

    def txn(self, compare, success, failure=()):
        def unb64(text):
            return base64.b64decode(text)
        def holds(c):  # VALUE ==, or CREATE == 0 (absent)
            value = self.get(unb64(c["key"]).decode())
            assert c["result"] == "EQUAL" and (c["target"] == "VALUE" or c.get("create_revision") == "0"), c
            return value == unb64(c["value"]) if c["target"] == "VALUE" else value is None
        ok = all(holds(c) for c in compare)
        for op in success if ok else failure:
            if "request_put" in op:
                self.put(unb64(op["request_put"]["key"]).decode(), unb64(op["request_put"]["value"]))
            else:
                self.delete(unb64(op["request_delete_range"]["key"]).decode())
        return ok, []

    def lease_grant(self, ttl_s):
        self.next_lease += 1
        self.leases[self.next_lease] = ttl_s
        return self.next_lease

    def lease_revoke(self, lease):
        """Also what an expiry does: the lease's keys go."""
        self.leases.pop(lease, None)
        for key in [k for k, (_, owner) in self.data.items() if owner == lease]:
            del self.data[key]


class Job:
    """A leader on a FakeEtcd, with helpers that play the agents' and the workers' parts."""

    def __init__(self, nnodes=2, nproc=2, instances=2, min_instances=None, max_restarts=1, **spec):
        self.etcd = FakeEtcd()
        self.keys = JobKeys(self.etcd, ROOT)
        self.spec = JobSpec(nnodes, nproc, instances, LiveConfig(10.0, 30.0, min_instances), max_restarts,
                            trouble_grace_s=2.0, replacement_timeout_s=5.0, **spec)
        self.node_leases, self.said = {}, []
        self.leader = self.new_leader("a.0")
        self.now = 0.0

    def new_leader(self, incarnation):
        self.etcd.delete(ROOT + "leader")
        self.etcd.put(ROOT + "leader", incarnation)
        leader = Leader(self.keys, incarnation, self.spec, say=self.said.append)
        leader.since = 0.0
        return leader

    def register(self, incarnation, nproc=None):
        lease = self.etcd.lease_grant(3)
        self.node_leases[incarnation] = lease
        seq = len(self.node_leases)
        record = {"name": incarnation.split(".")[0], "address": "127.0.0.1",
                  "nproc": nproc or self.spec.nproc_per_node, "pid": 1, "seq": seq}
        self.etcd.put(ROOT + f"nodes/{incarnation}", json.dumps(record), lease=lease)

    def lose(self, incarnation):
        self.etcd.lease_revoke(self.node_leases[incarnation])

    def step(self, advance=0.1):
        self.now += advance
        return self.leader.step(self.now)

    def get(self, name):
        value = self.etcd.get(ROOT + name)
        return None if value is None else value.decode()

    @property
    def generation(self):
        return int(self.get("generation"))

    def placement(self, generation=None):
        return parse_placement(self.get(f"gen_{self.generation if generation is None else generation}/placement"))

    def exit(self, slot, code, pid=1000):
        inc, since = self.placement()[slot]
        self.etcd.put(ROOT + f"exit/{slot}/{pid}", json.dumps({"code": code, "node": inc, "generation": since}))

    def report_trouble(self, *slots):
        for slot in slots:
            self.etcd.put(ROOT + f"gen_{self.generation}/trouble/{slot}", "1")
            self.etcd.put(ROOT + f"gen_{self.generation}/trouble", str(slot))

    def log(self, count):
        self.etcd.put(ROOT + "logged_count", str(count))
        self.etcd.put(ROOT + "last_logged", str(count))

    def outcome(self):
        text = self.get("job/outcome")
        return None if text is None else json.loads(text)


def started(nnodes=2, nproc=2, instances=2, spares=1, **kwargs):
    job = Job(nnodes, nproc, instances, **kwargs)
    for i in range(nnodes + spares):
        job.register(f"n{i}.0")
    assert job.step() is None
    assert job.generation == 0
    return job


# ---------------------------------------------------------------------------------------- the leader's decisions
def test_the_start_waits_for_the_nodes_and_places_whole_instances_per_node():
    """Generation 0 opens once --nnodes nodes registered, in registration order, each holding one instance's
    slots (dp=4, R=2: no node holds two replicas of a shard); a node registering later is a spare. Would catch a
    generation opened with too few nodes or the spare given slots."""
    job = Job()
    job.register("n0.0")
    assert job.step() is None and job.get("generation") is None
    job.register("n1.0")
    job.register("n2.0")
    assert job.step() is None
    assert job.generation == 0
    assert job.placement() == {0: ("n0.0", 0), 1: ("n0.0", 0), 2: ("n1.0", 0), 3: ("n1.0", 0)}
    assert json.loads(job.get("gen_0/members")) == json.loads(job.get("gen_0/replaced")) == [0, 1, 2, 3]
    assert job.get("gen_0/abort") is None


def test_too_few_nodes_within_the_join_timeout_ends_the_job():
    job = Job()
    job.register("n0.0")
    job.step(advance=31.0)
    job.step()
    assert job.outcome()["code"] == 1 and "only 1 of --nnodes 2" in job.outcome()["why"]


def test_a_placement_that_breaks_the_rule_ends_the_job_with_code_2():
    """4 ranks per node, R=4 instances of 1 rank: every node would hold 4 replicas of the one shard. Would catch
    a job started with both holders of a shard on one node (a node's loss then loses the shard)."""
    job = Job(nnodes=1, nproc=4, instances=4)
    job.register("n0.0")
    assert job.step() == 2
    outcome = job.outcome()
    assert outcome["code"] == 2 and "4" in outcome["why"], outcome
    assert job.get("generation") is None


def test_a_dead_rank_is_restarted_on_its_node_and_the_others_keep_their_processes():
    """Rank 1 killed (exit -9): generation 1 has slot 1 restarted on the same node (since 1), every other slot
    keeps since 0 (its process), generation 0 is aborted. Would catch the whole node or job restarted, or the
    survivors left blocked without the abort."""
    job = started()
    job.etcd.put(ROOT + "gen_0/0", b"\x88\x00")  # gloo's rendezvous keys share gen_<g>/: binary
    job.exit(1, -9)
    job.step()
    assert job.generation == 1
    assert job.placement() == {0: ("n0.0", 0), 1: ("n0.0", 1), 2: ("n1.0", 0), 3: ("n1.0", 0)}
    assert json.loads(job.get("gen_1/replaced")) == [1] and job.get("gen_0/abort") == "1"
    assert job.get("job/replacements") == "1"
    job.step()  # the report of the process that was replaced is no longer current: nothing more happens
    assert job.generation == 1


def test_a_lost_node_moves_its_slots_to_the_spare_as_a_whole():
    """n0's lease expires: its slots 0 and 1 go to the spare n2 (since 1), n1's keep theirs. Would catch the
    slots spread over nodes (two replicas of a shard on one node) or the lost node's slots kept."""
    job = started()
    job.lose("n0.0")
    job.step()
    assert job.generation == 1 and job.get("gen_0/abort") == "1"
    assert job.placement() == {0: ("n2.0", 1), 1: ("n2.0", 1), 2: ("n1.0", 0), 3: ("n1.0", 0)}
    assert json.loads(job.get("gen_1/replaced")) == [0, 1]


def test_without_a_spare_the_leader_aborts_and_waits_for_a_node():
    """No spare: generation 0 is aborted at once (its survivors released) and the slots wait for a node to
    register; then they move to it."""
    job = started(spares=0)
    job.lose("n1.0")
    job.step()
    assert job.generation == 0 and job.get("gen_0/abort") == "1"
    job.step(advance=10.0)
    assert job.generation == 0
    job.register("n1.1")
    job.step()
    assert job.generation == 1
    assert job.placement() == {0: ("n0.0", 0), 1: ("n0.0", 0), 2: ("n1.1", 1), 3: ("n1.1", 1)}


def test_a_new_leader_takes_over_from_the_keys_and_the_old_one_is_fenced():
    """The leader's node dies after generation 1; another agent's leader continues from etcd (the generation, the
    replacement counter), and the old leader's writes are refused once the key is not its own. Would catch
    state kept only in the leader's memory, or two leaders writing."""
    job = started()
    job.exit(3, -9)
    job.step()
    old = job.leader
    job.lose("n0.0")
    job.leader = job.new_leader("n1.0")
    job.step()
    assert job.generation == 2 and job.get("job/replacements") == "3"
    assert job.placement() == {0: ("n2.0", 2), 1: ("n2.0", 2), 2: ("n1.0", 0), 3: ("n1.0", 1)}
    job.exit(2, -9)
    with pytest.raises(NotLeader):
        old.step(job.now)
    assert job.generation == 2


def test_a_late_copy_of_a_commit_cannot_roll_the_generation_back():
    """etcd can apply a write sent to a frozen member after it thaws, long after the client timed out and moved
    on (measured). The leader's commit of generation 1 goes unanswered; it decides again (generation 1), the job
    moves on to generation 2, then the first copy lands. Would catch commits guarded by the `leader` key only:
    the copy passed and set generation 1 again (slot 2's replacement undone)."""
    job = started()
    job.exit(1, -9)
    late, txn = [], job.etcd.txn

    def unanswered(*request):
        late.append(request)
        raise EtcdIndeterminate("etcd 127.0.0.1:1 did not answer /v3/kv/txn (timeout)")
    job.etcd.txn = unanswered
    with pytest.raises(EtcdIndeterminate):  # the agent says it and reads again at its next round
        job.step()
    job.etcd.txn = txn
    job.step()
    assert job.generation == 1
    job.exit(2, -9)
    job.step()
    assert job.generation == 2
    assert job.etcd.txn(*late[0])[0] is False  # the frozen member thaws: its copy is refused
    assert job.generation == 2 and job.placement()[2] == ("n1.0", 2) and job.get("job/replacements") == "2"
    job.step()
    assert job.generation == 2


def test_a_report_of_a_replaced_slots_new_process_is_never_deleted():
    """The leader dropped the replaced slots' old exit reports with a delete of exit/<slot>/ after its commit: a
    report of the slot's new process written before that delete landed (the agents act on the commit at once;
    a delete sent to a frozen member lands late) was deleted, its death never seen. Reports are deleted by
    name, in the commit. Would catch the second death of slot 1 lost (generation 1 forever)."""
    job = started()
    job.exit(1, -9)
    late, delete_prefix = [], job.etcd.delete_prefix
    job.etcd.delete_prefix = late.append  # deletes sent but not (yet) applied
    job.step()
    assert job.generation == 1
    job.exit(1, -9, pid=1001)  # the replacement dies at once
    for prefix in late:
        delete_prefix(prefix)
    job.step()
    assert job.generation == 2 and job.placement()[1] == ("n0.0", 2) and job.get("job/replacements") == "2"
    assert not [k for k in job.etcd.data if k.startswith(ROOT + "exit/")]  # both reports gone with gen 2's commit


@pytest.mark.parametrize("code, trained, expected", [(2, True, 2), (1, False, 1), (7, False, 7)])
def test_usage_and_start_up_errors_end_the_job_with_their_code(code, trained, expected):
    """A usage error (2) at any time, any other error of its own before the job logged an iteration: every
    start would meet it again."""
    job = started()
    if trained:
        job.log(1)
    job.exit(0, code)
    assert job.step() == expected
    assert job.outcome()["code"] == expected and f"rank 0 exited with code {code}" in job.outcome()["why"]


def test_every_member_done_ends_the_job_with_0():
    job = started()
    for slot in range(3):
        job.exit(slot, 0, pid=slot)
        assert job.step() is None
    job.exit(3, 0, pid=3)
    assert job.step() == 0 and job.outcome() == {"code": 0, "why": "training finished"}


def test_a_fallback_awaits_last_words_then_restarts_every_slot():
    """Rank 2 exits 3 (its shard has no replica): the leader waits until every other live member reported the
    failed collective (its last words written), then generation 1 has every slot replaced on the same nodes
    and job/restarts 1; a second fallback with --max-restarts 1 ends the job with 1. Would catch survivors
    stopped before their last words, or restarts beyond --max-restarts."""
    job = started()
    job.log(3)
    job.exit(2, 3)
    job.report_trouble(0, 1)
    job.step()
    assert job.generation == 0  # rank 3 has not reported yet
    job.report_trouble(3)
    job.step()
    assert job.generation == 1 and job.get("job/restarts") == "1" and job.get("job/logged_at_start") == "3"
    assert job.placement() == {0: ("n0.0", 1), 1: ("n0.0", 1), 2: ("n1.0", 1), 3: ("n1.0", 1)}
    job.log(4)
    job.exit(1, 1)  # an error of its own, after this start trained: a fallback
    job.step()
    assert job.outcome()["code"] == 1 and "--max-restarts" in job.outcome()["why"]


def test_a_whole_job_restart_short_of_a_node_waits_the_join_timeout_for_one():
    """A node lost while live recovery is impossible (exit 3), no spare: the whole-job restart waits
    --join-timeout for a node from when it found too few, and the node that comes back gets the slots. Would
    catch the wait counted from the start of the leader's term: the job ended at once ('only 1 of --nnodes 2
    ... within --join-timeout') once it had led for longer than that."""
    job = started(spares=0)
    job.log(5)
    job.step(advance=100.0)  # training for a while
    job.exit(0, 3)
    job.lose("n1.0")
    job.step(advance=33.0)  # past --collective-timeout + --trouble-grace without slot 1's last words
    assert job.outcome() is None and job.generation == 0
    job.step(advance=20.0)
    assert job.outcome() is None
    job.register("n1.1")
    job.step()
    assert job.generation == 1 and job.get("job/restarts") == "1"
    assert job.placement() == {0: ("n0.0", 1), 1: ("n0.0", 1), 2: ("n1.1", 1), 3: ("n1.1", 1)}


def test_a_fallback_stops_a_silent_member_after_the_collective_timeout():
    job = started()
    job.log(3)
    job.exit(2, 3)
    job.step()
    job.step(advance=11.0)
    assert job.generation == 0
    job.step(advance=1.5)  # 10 s + 2 s grace
    assert job.generation == 1 and any("stopped without last words" in s for s in job.said)


def test_trouble_without_a_loss_reforms_and_a_silent_member_is_replaced():
    """Every member reported a failed collective (a spurious timeout): after --trouble-grace a re-forming, nobody
    replaced. Then rank 3 never reports (hung, its heartbeat file fresh): --collective-timeout + --trouble-grace
    after the first report it is replaced on its node."""
    job = started()
    job.report_trouble(0, 1, 2, 3)
    job.step()
    assert job.generation == 0
    job.step(advance=2.5)
    assert job.generation == 1 and json.loads(job.get("gen_1/replaced")) == [] and job.get("gen_0/abort") == "1"
    assert job.placement(1) == job.placement(0)
    job.report_trouble(0, 1, 2)
    job.step()
    job.step(advance=5.0)
    assert job.generation == 1
    job.step(advance=8.0)
    assert job.generation == 2 and json.loads(job.get("gen_2/replaced")) == [3]
    assert job.placement()[3] == ("n1.0", 2) and job.placement()[0] == ("n0.0", 0)


def test_too_many_replacements_end_the_job():
    job = started(max_replacements=1)
    job.exit(0, -9)
    job.step()
    job.exit(0, -9, pid=2)
    assert job.step() == 1 and "--max-replacements" in job.outcome()["why"]


def test_elastic_shrinks_without_a_spare_and_grows_when_a_node_registers():
    """--min-instances 1, no spare: n1 lost -> after --replacement-timeout generation 1 has instance 0 only (the
    slots of n1 unplaced); n1 registers again as a new incarnation -> its slots are placed on it in generation 1
    (not members); once their processes are ready (standby) -> generation 2 with every slot, leave_at set and no
    abort. Would catch a shrink before the timeout, a grow before the processes are ready, or a grow that
    aborts the members, or leave_at committed apart from its generation (a leader lost between the two: the
    members leave for a generation its successor opens later, with another leave_at)."""
    job = started(spares=0, min_instances=1)
    job.lose("n1.0")
    job.step()
    job.step(advance=3.0)
    assert job.generation == 0
    job.step(advance=3.0)
    assert job.generation == 1 and json.loads(job.get("gen_1/members")) == [0, 1]
    assert job.placement() == {0: ("n0.0", 0), 1: ("n0.0", 0)}
    job.etcd.put(ROOT + "gen_1/ready", "1")
    job.log(5)
    job.register("n1.1")
    job.step()
    assert job.placement() == {0: ("n0.0", 0), 1: ("n0.0", 0), 2: ("n1.1", 1), 3: ("n1.1", 1)}
    job.step()
    assert job.generation == 1
    for slot, pid in ((2, 77), (3, 78)):
        job.etcd.put(ROOT + f"proc/{slot}", json.dumps({"pid": pid, "node": "n1.1", "generation": 1}))
        job.etcd.put(ROOT + f"standby/{slot}", str(pid))
    txn, sent = job.etcd.txn, []

    def second_unanswered(*request):  # the leader's second write of this step is lost (its node dies)
        sent.append(request)
        if len(sent) > 1:
            raise EtcdIndeterminate("etcd 127.0.0.1:1 did not answer /v3/kv/txn (timeout)")
        return txn(*request)
    job.etcd.txn = second_unanswered
    try:
        job.step()
    except EtcdIndeterminate:
        pass
    job.etcd.txn = txn
    assert (job.get("gen_1/leave_at") is None) == (job.generation == 1)  # was: leave_at alone, read by the members
    job.step()
    assert job.generation == 2 and json.loads(job.get("gen_2/members")) == [0, 1, 2, 3]
    assert job.get("gen_1/leave_at") == "7" and job.get("gen_1/abort") is None



def test_an_agent_whose_leader_key_create_went_unconfirmed_leads(tmp_path, monkeypatch):
    """etcd applied the agent's create of the `leader` key but the answer was lost (EtcdUnavailable): the key is
    its own, bound to its live lease. Would catch an agent that then only leads if the key is absent: nobody
    led the job while its lease lived (for ever: the agent keeps it alive)."""
    from megatron_lite.fault_tolerance import agent as agent_module
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    etcd = FakeEtcd()
    args = agent_module.argparse.Namespace(job_id="test", node_name="n0", etcd_endpoints=["127.0.0.1:1"], spares=0,
                                           command=["worker.py"], node_ttl=3.0, heartbeat_timeout=5.0)
    spec = JobSpec(2, 2, 2, LiveConfig(10.0, 30.0, None))
    agent = agent_module.Agent(args, spec, etcd, etcd)
    agent.incarnation, agent.lease = "n0.1", etcd.lease_grant(3)
    etcd.put(ROOT + "leader", "n0.1", lease=agent.lease)  # its create, applied but unanswered
    assert agent.tick() is None
    assert agent.leader is not None


def test_an_agent_counts_its_lease_from_when_it_asked_for_the_renewal(tmp_path, monkeypatch):
    """etcd renews the lease when the keepalive arrives, before its answer comes back: the agent fences itself
    --node-ttl after the renewal was SENT, never later than etcd lets the lease expire (then the leader gives its
    slots away); a new lease counts from its grant. Would catch last_renewed taken at the answer (a slow answer:
    the ranks run on past the lease) or at the end of a slow registration."""
    from megatron_lite.fault_tolerance import agent as agent_module
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = agent_module.argparse.Namespace(job_id="test", node_name="n0", etcd_endpoints=["127.0.0.1:1"], spares=0,
                                           command=["worker.py"], node_ttl=1.0, heartbeat_timeout=5.0)
    sent = []

    class SlowAnswer:
        def lease_keepalive(self, lease):
            sent.append(time.monotonic())
            agent.stopping.set()
            time.sleep(0.3)  # etcd renewed it at once; the answer is slow
            return 1
    class SlowRegistration(FakeEtcd):
        def put(self, key, value, lease=0):
            time.sleep(0.3 if "/nodes/" in key else 0)  # the lease granted, its countdown running
            super().put(key, value, lease)
    agent = agent_module.Agent(args, JobSpec(2, 2, 2, LiveConfig(10.0, 30.0, None)), SlowRegistration(),
                               SlowAnswer())
    before = time.monotonic()
    agent.register()  # the new lease: counted from its grant, not from the end of the registration
    assert before <= agent.last_renewed < before + 0.2
    agent.keep_alive()
    assert sent[0] - 0.1 < agent.last_renewed <= sent[0]


def test_an_agent_sends_a_process_record_that_etcd_did_not_take_again(tmp_path, monkeypatch):
    """proc/<slot> (what an elastic grow waits for) was put once right after the start: an etcd error there left
    the process running without its record for ever (the agent does not start a slot twice). Would catch the
    record lost."""
    from megatron_lite.fault_tolerance import agent as agent_module
    from megatron_lite.fault_tolerance.etcd import EtcdUnavailable
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    class Flaky(FakeEtcd):
        failed = False

        def put(self, key, value, lease=0):
            if "/proc/" in key and not self.failed:
                self.failed = True
                raise EtcdUnavailable("no etcd endpoint answered /v3/kv/put within 2.0 s")
            super().put(key, value, lease)
    etcd = Flaky()
    args = agent_module.argparse.Namespace(job_id="test", node_name="n0", etcd_endpoints=["127.0.0.1:1"], spares=0,
                                           command=["-c", "import time; time.sleep(60)"], node_ttl=3.0,
                                           heartbeat_timeout=5.0)
    agent = agent_module.Agent(args, JobSpec(1, 1, 1, LiveConfig(10.0, 30.0, None)), etcd, etcd)
    agent.incarnation, agent.lease = "n0.1", etcd.lease_grant(3)
    etcd.put(ROOT + "leader", "n9.1")
    etcd.put(ROOT + "gen_0/placement", json.dumps({"0": ["n0.1", 0]}))
    etcd.put(ROOT + "generation", "0")
    try:
        with pytest.raises(EtcdUnavailable):
            agent.tick()
        assert sorted(agent.ranks) == [0]
        agent.tick()
        record = etcd.get(ROOT + "proc/0")
        assert record is not None
        assert json.loads(record) == {"pid": agent.ranks[0].proc.pid, "node": "n0.1", "generation": 0}
    finally:
        agent.stop_ranks(signal.SIGKILL)


def test_a_signal_while_a_rank_starts_leaves_no_process_behind(tmp_path, monkeypatch):
    """SIGTERM arriving while the agent starts a rank (inside Popen: after the fork) raised out of Popen, the
    process running but not among the agent's ranks, so its stop on the way out missed it: left running alone.
    The signal is raised once the rank is recorded. Would catch the process not in agent.ranks."""
    from megatron_lite.fault_tolerance import agent as agent_module
    from megatron_lite.fault_tolerance.launch import SignalReceived
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    started_procs, popen = [], subprocess.Popen

    def signalled_popen(*args, **kwargs):
        started_procs.append(popen(*args, **kwargs))
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs in this thread, at the next bytecode
        for _ in range(1000):
            pass
        return started_procs[-1]
    etcd = FakeEtcd()
    args = agent_module.argparse.Namespace(job_id="test", node_name="n0", etcd_endpoints=["127.0.0.1:1"], spares=0,
                                           command=["-c", "import time; time.sleep(60)"], node_ttl=3.0,
                                           heartbeat_timeout=5.0)
    agent = agent_module.Agent(args, JobSpec(1, 1, 1, LiveConfig(10.0, 30.0, None)), etcd, etcd)
    agent.incarnation = "n0.1"
    monkeypatch.setattr(agent_module.subprocess, "Popen", signalled_popen)
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                                 signal.SIGQUIT)}  # on_signal ignores the others
    signal.signal(signal.SIGTERM, agent.on_signal)
    try:
        with pytest.raises(SignalReceived):
            agent.reconcile({0: ("n0.1", 0)})
        assert [rank.proc for rank in agent.ranks.values()] == started_procs
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for proc in started_procs:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flags, message", [
    (["--node-ttl", "0.5"], "--node-ttl must be >= 1 s"),
    (["--nnodes", "0"], "--nnodes must be >= 1"),
    (["--join-timeout", "31"], "--collective-timeout + --trouble-grace"),
    (["x.py", "--num-distributed-optimizer-instances", "two"], "--num-distributed-optimizer-instances is not"),
    # R=4 instances of one rank on 2 nodes of 2 ranks: a node would hold two replicas of one shard
    (["x.py", "--num-distributed-optimizer-instances", "4"],
     "a node of 2 ranks would hold two replicas of one shard: R=4 instances of 1 rank(s)"),
])
def test_the_agents_command_line_is_checked_before_it_starts(flags, message, capsys):
    """Refused at parse time (exit 2, naming the flag), before any etcd is contacted: launch.py's checks of the
    shared flags, and the agent's own."""
    from megatron_lite.fault_tolerance import agent

    base = ["--etcd-endpoints", "127.0.0.1:1", "--job-id", "j", "--nnodes", "2", "--nproc-per-node", "2"]
    with pytest.raises(SystemExit) as e:
        agent.main(base + flags + ([] if "x.py" in flags else ["x.py"]))
    assert e.value.code == 2
    assert message in capsys.readouterr().err

# ---------------------------------------------------------------------------------------- agents on loopback
FAKE_WORKER = """import json, os, sys, time
out, mode = sys.argv[1], sys.argv[2]
if "MEGATRON_LITE_LIVE_SPARE" in os.environ:  # a warm spare: waits for its rank and its variables
    from megatron_lite.fault_tolerance.membership import Membership
    Membership.from_env()
rank, parent = os.environ["RANK"], os.getppid()
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MEGATRON_LITE_LIVE_STORE",
         "MEGATRON_LITE_LIVE_GENERATION", "MEGATRON_LITE_LIVE_NODE", "MEGATRON_LITE_LIVE_HEARTBEAT_FILE")
start = os.path.join(out, "start_%s_%d.json" % (rank, os.getpid()))
with open(start + ".tmp", "w") as f:  # whole or absent: the test reads these files while workers start
    json.dump({n: os.environ.get(n) for n in names}, f)
os.replace(start + ".tmp", start)
if mode == "usage":
    sys.exit(2)
heartbeat = os.environ["MEGATRON_LITE_LIVE_HEARTBEAT_FILE"]
while os.getppid() == parent:
    with open(heartbeat, "w"):
        pass
    if os.path.exists(os.path.join(out, "finish")):
        sys.exit(0)
    time.sleep(0.1)
sys.exit(1)
"""


@pytest.fixture(scope="module")
def etcd():
    from megatron_lite.fault_tolerance.local_etcd import LocalEtcd, etcd_available

    available, why = etcd_available()
    if not available:
        pytest.skip(why)
    with LocalEtcd(["127.0.0.1"]) as cluster:
        yield cluster


class Agents:
    """Agents of one job on loopback (one etcd member), each in a process group of its own with its ranks (a
    node: killed whole), over FAKE_WORKER in `mode`; every wait bounded by a deadline."""

    def __init__(self, etcd, directory, nnodes, nproc, mode="run", flags=(), command=None):
        from megatron_lite.fault_tolerance.cluster import JobKeys
        from megatron_lite.fault_tolerance.etcd import EtcdClient

        self.directory, self.job_id = str(directory), f"test_{os.getpid()}_{time.monotonic_ns()}"
        script = os.path.join(self.directory, "worker.py")
        with open(script, "w") as f:
            f.write(FAKE_WORKER)
        self.command = [sys.executable, "-m", "megatron_lite.fault_tolerance.agent", "--etcd-endpoints",
                        ",".join(etcd.endpoints), "--job-id", self.job_id, "--nnodes", str(nnodes), "--nproc-per-node",
                        str(nproc), "--node-ttl", "2", "--heartbeat-timeout", "2", "--collective-timeout", "5",
                        "--join-timeout", "30", "--trouble-grace", "1", "--spares", "0", *flags]
        self.worker = command or [script, self.directory, mode]
        self.keys = JobKeys(EtcdClient(etcd.endpoints), f"/megatron_lite/{self.job_id}/store/")
        self.agents = {}

    def start(self, name, wait=True):
        log = open(os.path.join(self.directory, f"agent_{name}.log"), "w")
        env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "PYTHONPATH": REPO}
        self.agents[name] = subprocess.Popen([*self.command, "--node-name", name, *self.worker], stdout=log,
                                             stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        if wait:
            self.wait(lambda: "registered" in self.log(name), f"agent {name} did not register")

    def log(self, name):
        with open(os.path.join(self.directory, f"agent_{name}.log"), errors="replace") as f:
            return f.read()

    def logs(self):
        return "\n".join(f"--- agent {name}\n{self.log(name)[-3000:]}" for name in self.agents)

    def wait(self, done, what, bound_s=30.0):
        deadline = time.monotonic() + bound_s
        while not done():
            if time.monotonic() > deadline:
                pytest.fail(f"{what} within {bound_s:g} s\n{self.logs()}")
            time.sleep(0.05)

    def wait_making_progress(self, done, what, watched=()):
        """Wait until `done()`, as long as the agents' logs (or the `watched` files) keep growing: fail when
        none grew for live_testing.STALL_S seconds."""
        paths = [os.path.join(self.directory, f"agent_{name}.log") for name in self.agents] + list(watched)
        sizes, last = None, time.monotonic()
        while not done():
            now = [os.path.getsize(p) if os.path.exists(p) else -1 for p in paths]
            if now != sizes:
                sizes, last = now, time.monotonic()
            elif time.monotonic() - last > STALL_S:
                pytest.fail(f"{what}: no progress for {STALL_S:g} s\n{self.logs()}")
            time.sleep(0.2)

    def kill(self, name):
        """The node lost: its agent and ranks (SIGKILL)."""
        os.killpg(self.agents[name].pid, signal.SIGKILL)
        self.agents[name].wait()

    def exit_codes(self, bound_s=30.0):
        self.wait(lambda: all(p.poll() is not None for p in self.agents.values()), "the agents did not exit",
                  bound_s)
        return {name: p.returncode for name, p in self.agents.items()}

    def close(self):
        for proc in self.agents.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        self.keys.client.delete_prefix(f"/megatron_lite/{self.job_id}/")

    def generation(self):
        value = self.keys.get("generation")
        return -1 if value is None else int(value)

    def placement(self):
        return parse_placement(self.keys.get(f"gen_{self.generation()}/placement"))

    def node(self, name):
        """The incarnations of agent `name` (its node name) in the placement."""
        return {inc for inc, _ in self.placement().values() if inc.split(".")[0] == name}

    def starts(self):
        """{pid: environment} of every process the fake worker started."""
        found = {}
        for path in glob.glob(os.path.join(self.directory, "start_*_*.json")):
            with open(path) as f:
                found[int(path.rsplit("_", 1)[1][:-len(".json")])] = json.load(f)
        return found

    def running(self):
        """{slot: pid} of the current processes: the newest start of each slot, per the placement."""
        placement, current = self.placement(), {}
        for pid, env in self.starts().items():
            slot = int(env["RANK"])
            if placement.get(slot) == (env["MEGATRON_LITE_LIVE_NODE"], int(env["MEGATRON_LITE_LIVE_GENERATION"])):
                current[slot] = pid
        return current

    def settled(self, world_size):
        """Every slot of the current generation has its process (started by its agent)."""
        return len(self.running()) == world_size


@pytest.fixture
def agents(etcd, tmp_path):
    made = []

    def make(*args, directory=None, **kwargs):
        made.append(Agents(etcd, directory or tmp_path, *args, **kwargs))
        return made[-1]
    yield make
    for job in made:
        job.close()


def test_agents_replace_a_rank_on_its_node_and_a_lost_node_on_the_spare_and_the_leader_fails_over(agents):
    """Agents a, b (2 ranks each) and c (a spare, registered last). A rank of the node that does not lead is
    killed -> a new process for that slot on the same node, every other slot keeps its process; its other rank
    stopped (SIGSTOP: hung) -> its agent kills it at --heartbeat-timeout -> replaced the same way. The leader's
    node killed with its ranks -> another agent leads, and the lost node's slots move to c as a whole. The other
    training node's agent frozen past its lease (no spare left) fences itself when thawed and comes back as a
    spare, which takes its old slots. Then the ranks finish: every agent left exits 0. Would catch a rank's
    death restarting its node or the job, a hung rank never detected, state only in the dead leader's memory,
    slots of a lost node left unplaced while a spare waits, or a node that lost its lease training on (or
    rejoining with its old processes)."""
    job = agents(2, 2)
    job.start("a", wait=False)
    job.start("b")
    job.wait(lambda: "registered" in job.log("a"), "agent a did not register")
    job.start("c")
    job.wait(lambda: job.settled(4), "the ranks did not start")
    leader, other = ("a", "b") if "leading the job" in job.log("a") else ("b", "a")
    first = job.running()
    nodes = {slot: job.placement()[slot][0].split(".")[0] for slot in first}
    assert sorted(nodes.values()) == ["a", "a", "b", "b"] and nodes[0] == nodes[1], nodes
    victim, hung = sorted(slot for slot in nodes if nodes[slot] == other)
    env = job.starts()[first[hung]]
    assert (env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("1", "4", "2"), env
    assert env["GROUP_RANK"] == str(hung // 2) and env["MEGATRON_LITE_LIVE_GENERATION"] == "0", env
    assert env["MEGATRON_LITE_LIVE_STORE"].endswith(f"/megatron_lite/{job.job_id}/store/"), env

    os.kill(first[victim], signal.SIGKILL)
    job.wait(lambda: job.generation() == 1 and job.settled(4), f"rank {victim} was not replaced")
    second = job.running()
    assert second[victim] != first[victim], (first, second)
    assert {s: p for s, p in second.items() if s != victim} == {s: p for s, p in first.items() if s != victim}
    assert job.node(other) == {job.placement()[victim][0]}

    os.kill(first[hung], signal.SIGSTOP)
    job.wait(lambda: job.generation() == 2 and job.settled(4), f"the hung rank {hung} was not replaced")
    assert f"rank {hung} (pid {first[hung]}): no heartbeat" in job.log(other), job.logs()
    third = job.running()
    assert third[hung] != first[hung] and {s: p for s, p in third.items() if s != hung} == \
        {s: p for s, p in second.items() if s != hung}

    job.kill(leader)
    job.wait(lambda: job.generation() == 3 and job.settled(4), f"node {leader}'s slots did not move to the spare")
    fourth = job.running()
    moved = {slot for slot in nodes if nodes[slot] == leader}
    assert {slot: job.placement()[slot][0].split(".")[0] for slot in moved} == {slot: "c" for slot in moved}
    assert {s: p for s, p in fourth.items() if s not in moved} == {s: p for s, p in third.items() if s not in moved}
    assert "leading the job" in job.log(other) + job.log("c"), job.logs()

    # Agent `other` frozen (SIGSTOP) past its lease: no spare is left, so its slots wait; thawed, it finds its
    # lease gone, kills its ranks (fencing) and registers anew: a spare, which takes its old slots.
    fenced = {s: p for s, p in fourth.items() if nodes[s] == other}
    incarnation = job.placement()[min(fenced)][0]
    os.kill(job.agents[other].pid, signal.SIGSTOP)
    job.wait(lambda: job.keys.get(f"nodes/{incarnation}") is None, f"agent {other}'s lease did not expire")
    os.kill(job.agents[other].pid, signal.SIGCONT)
    job.wait(lambda: job.generation() == 4 and job.settled(4), f"node {other}'s slots did not come back to it")
    assert "fenced:" in job.log(other) and len(job.node(other)) == 1 and job.node(other) != {incarnation}
    fifth = job.running()
    assert all(fifth[s] != p for s, p in fenced.items())
    assert not any(os.path.exists(f"/proc/{p}") for p in fenced.values())  # killed by the fencing, reaped

    open(os.path.join(job.directory, "finish"), "w").close()
    assert job.exit_codes() == {leader: -signal.SIGKILL, other: 0, "c": 0}, job.logs()


def test_a_dead_rank_is_replaced_by_its_nodes_warm_spare(agents):
    """One node of 2 ranks with a warm spare (--spares 1, waiting in Membership.from_env): rank 1 killed -> the
    spare's process becomes it, with the rank's variables from its assignment (LOCAL_RANK, the generation, its
    heartbeat file), and rank 0 keeps its process. Would catch a replacement started cold while a spare waits,
    or a spare that takes its rank without the variables the agent gives a rank."""
    job = agents(1, 2, flags=["--spares", "1"])
    job.start("a")
    job.wait(lambda: job.settled(2) and "spare " in job.log("a"), "the ranks and the spare did not start")
    spare_pid = int(re.search(r"spare a\.\w+\.1: pid (\d+)", job.log("a")).group(1))
    first = job.running()
    os.kill(first[1], signal.SIGKILL)
    job.wait(lambda: job.generation() == 1 and job.settled(2), "rank 1 was not replaced", bound_s=60.0)
    second = job.running()
    assert second == {0: first[0], 1: spare_pid}, (first, second, job.logs())
    env = job.starts()[spare_pid]
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["MEGATRON_LITE_LIVE_GENERATION"]) == \
        ("1", "1", "0", "1"), env
    assert env["MEGATRON_LITE_LIVE_HEARTBEAT_FILE"].endswith("rank_1.1.heartbeat"), env
    open(os.path.join(job.directory, "finish"), "w").close()
    assert job.exit_codes() == {"a": 0}, job.logs()


@pytest.mark.parametrize("case", ["usage", "placement"])
def test_a_usage_error_or_an_impossible_placement_ends_every_agent_with_2(agents, case):
    """A worker exiting 2 (argparse: the command line is wrong) ends the job: every agent stops its ranks and
    exits 2. R=4 instances of one rank on 2 nodes of 2 ranks: a node would hold two replicas of one shard, so
    every agent refuses at parse time, naming the numbers, and exits 2 without starting anything (the
    leader's own check, for shapes it learns later, is test_a_placement_that_breaks_the_rule_ends_the_job_with_
    code_2). Would catch usage errors retried as deaths, or a job started with a placement that loses a shard
    with a node."""
    if case == "usage":
        job = agents(2, 1, mode="usage")
    else:
        job = agents(2, 2)
        job.worker += ["--num-distributed-optimizer-instances", "4"]
    job.start("a", wait=False)
    job.start("b", wait=False)
    assert job.exit_codes(bound_s=60.0) == {"a": 2, "b": 2}, job.logs()
    for name in "ab":
        log = job.log(name)
        if case == "usage":
            assert "the job ended: exit code 2" in log, log
            assert "rank 0 exited with code 2 (a usage error" in log or "rank 1 exited with code 2" in log, log
        else:
            assert "a node of 2 ranks would hold two replicas of one shard: R=4 instances of 1 rank(s)" in log, log
    assert (case == "placement") == (job.generation() == -1)


@PROGRESS_BOUNDED
def test_a_node_lost_while_training_is_recovered_live_and_exactly(agents, tmp_path):
    """pretrain_gpt.py (the tiny GPT, dp=4, R=2: one instance per node) on agents a and b with c a spare; after
    iteration 2 the node holding slots 2 and 3 is killed with its agent. Its slots move to c, whose new ranks
    heal from the replicas on the other node, and the job ends with every loss, the validation losses and the
    final checkpoint bitwise those of an uninterrupted torchrun run; the surviving node's ranks keep their
    processes. Would catch the workers not following the agents (their store, placement, generation), a
    survivor left blocked behind the lost node, or state lost with it."""
    reference_dir, live = tmp_path / "reference", tmp_path / "live"
    reference_dir.mkdir()
    live.mkdir()
    reference = uninterrupted(str(reference_dir))
    command = [os.path.join(REPO, "pretrain_gpt.py"), *FLAGS, "--save", str(live), "--load", str(live)]
    job = agents(2, 2, directory=live, command=command,
                 flags=["--heartbeat-timeout", "20", "--collective-timeout", "10", "--join-timeout", "60",
                        "--trouble-grace", "5"])
    metrics = os.path.join(job.directory, "metrics.jsonl")
    job.start("a", wait=False)
    job.start("b")
    job.wait(lambda: "registered" in job.log("a"), "agent a did not register")
    job.start("c")
    job.wait_making_progress(lambda: os.path.exists(metrics) and 2 in logged_losses(job.directory),
                             "iteration 2 was not logged", [metrics])
    victim = job.placement()[2][0].split(".")[0]
    survivor = "ab".replace(victim, "")
    job.kill(victim)
    job.wait_making_progress(lambda: all(p.poll() is not None for n, p in job.agents.items() if n != victim),
                             "the job did not end", [metrics])
    output = job.logs()
    assert {name: p.returncode for name, p in job.agents.items()} == {victim: -signal.SIGKILL, survivor: 0,
                                                                      "c": 0}, output
    survivor_pids = re.findall(r"rank (\d+): pid (\d+) \(generation", job.log(survivor))
    assert sorted(slot for slot, _ in survivor_pids) == ["0", "1"], output  # started once each: never replaced
    assert sorted(re.findall(r"rank (\d+): pid \d+ \(generation", job.log("c"))) == ["2", "3"], output
    check_exact(job.directory, reference, logged_losses(job.directory), output)
