"""The worker side of multi-node live recovery (fault_tolerance/membership.py, live_training.py): fencing by
generation and slot (check_fenced, the checkpoint's commit guard), the heartbeat file, and the gen_<g>/abort
watcher that releases a collective blocked on a hung peer without waiting for the collective timeout.

Everything runs on a TCPStore hosted by the test (no etcd needed); processes are real where the behaviour is
about processes (a SIGSTOPped peer, a checkpoint saved by a rank that trains in a generation), and every wait
is bounded by a deadline far below the timeouts it proves are not waited for.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch.distributed as dist
from pretrain_testing import REPO

from megatron_lite.fault_tolerance import membership
from megatron_lite.fault_tolerance.membership import Fenced, LiveConfig, Membership

HERE = os.path.dirname(os.path.abspath(__file__))
COLLECTIVE_TIMEOUT_S = 120.0
"""The children's collective timeout: a release that waited for it would fail the tests' deadlines."""
RELEASE_BOUND_S = 10.0
"""How soon after gen_<g>/abort a blocked collective must have failed (measured: ~0.2 s, one watcher period;
generous for a loaded machine, still 12x below the collective timeout)."""


class _MasterStore(dist.TCPStore):
    """The test's TCPStore server, whose set() returns once the server applied it. TCPStore's set() does not wait
    for an answer, and another connection's request (a member's check right after) may be served first."""

    def set(self, key, value):
        super().set(key, value)
        super().get(key)  # answered after the set: the same connection's requests are served in order


def master_store() -> dist.TCPStore:
    return _MasterStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def client(store: dist.TCPStore) -> dist.TCPStore:
    return membership.connect_store(f"127.0.0.1:{store.port}", 10.0)


def formed_member(store, rank, generation, node=None, started_for=None) -> Membership:
    """A Membership in `generation` as join() leaves it (formed), without a process group: check_fenced reads
    the store only."""
    member = Membership(client(store), rank, 2, started_for if started_for is not None else generation,
                        LiveConfig(30.0, 60.0), node)
    member.generation = member._formed = generation  # what join() sets once the groups are formed
    return member


# ---------------------------------------------------------------------------------------- check_fenced, in process
def test_a_current_process_is_not_fenced():
    """Would catch fencing that refuses the process that holds its slot (every rank exiting 4 at its join)."""
    store = master_store()
    store.set("generation", "2")
    store.set("gen_2/placement", json.dumps({"0": ["nodeA.1", 0], "1": ["nodeB.2", 2]}))
    formed_member(store, 1, 2, node="nodeB.2").check_fenced("saving")
    formed_member(store, 0, 2, node="nodeA.1", started_for=0).check_fenced("saving")
    formed_member(store, 1, 2, node=None).check_fenced("saving")  # one node: the generation only


@pytest.mark.parametrize("case", ["other_node", "restarted_on_this_node"])
def test_a_process_whose_slot_moved_is_fenced(case):
    """The node was replaced (another incarnation holds the slot), or the agent restarted the slot on this node
    for a later generation: the old process must stop. Would catch a cut-off node's rank rejoining or writing."""
    store = master_store()
    store.set("generation", "3")
    holder = ["nodeD.9", 3] if case == "other_node" else ["nodeB.2", 3]
    store.set("gen_3/placement", json.dumps({"1": holder}))
    member = formed_member(store, 1, 3, node="nodeB.2", started_for=1)
    for generation in (True, False):  # last words too: the slot is another process's
        with pytest.raises(Fenced, match="its node was replaced") as raised:
            member.check_fenced("saving", generation=generation)
        assert raised.value.slot_lost


def test_an_abandoned_or_superseded_generation_fences_checkpoints_not_last_words():
    """gen_<g>/abort, or a newer generation without a planned leave (an elastic grow's leave_at): a checkpoint of
    g must not be committed, but the survivor's last words (written after g failed) must. Would catch a rank 0
    renaming a checkpoint into place after its job moved on, or survivors refusing their own last words."""
    store = master_store()
    store.set("generation", "1")
    member = formed_member(store, 0, 1)
    member.check_fenced("saving")
    store.set("gen_1/abort", "1")
    with pytest.raises(Fenced, match="abandoned") as raised:
        member.check_fenced("saving")
    assert not raised.value.slot_lost
    member.check_fenced("last words", generation=False)
    member.guard_commit("last_words", "last words")

    store.set("generation", "2")
    superseded = formed_member(store, 0, 1)
    store.delete_key("gen_1/abort")
    with pytest.raises(Fenced, match="superseded by generation 2"):
        superseded.guard_commit("checkpoint", "saving")
    store.set("gen_1/leave_at", "7")  # an elastic grow: g trains on until iteration 7
    superseded.guard_commit("checkpoint", "saving")


def test_an_unreadable_store_fences():
    """A process cut off from the store cannot know it still owns its slot: it must not write. Would catch a
    partitioned node's rank 0 committing a checkpoint (or last words) while the job went on without it."""
    store = master_store()
    store.set("generation", "0")
    member = formed_member(store, 0, 0)
    member.store.set_timeout(__import__("datetime").timedelta(seconds=1))
    del store  # the server goes: every request of the client fails
    with pytest.raises(Fenced, match="cannot be read") as raised:
        member.check_fenced("writing last words", generation=False)
    assert raised.value.slot_lost


def test_a_fenced_process_never_arrives_at_the_rendezvous(single_rank_group):
    """join() of a process whose node was replaced raises Fenced before it counts as arrived. Would catch the
    stale process taking the arrival of the slot's new process (the generation then forms with it, or never).
    Run in a process that holds a process group of its own (the suite's): a membership drops only the groups it
    formed, so that group outlives the refused join (it was destroyed, failing every later test of the suite
    that used it)."""
    store = master_store()
    store.set("generation", "1")
    store.set("gen_1/members", "[0, 1]")
    store.set("gen_1/placement", json.dumps({"0": ["nodeA.1", 0], "1": ["nodeC.3", 1]}))
    member = Membership(client(store), 1, 2, 0, LiveConfig(30.0, 60.0), node="nodeB.2")
    with pytest.raises(Fenced) as raised:
        member.join()
    assert raised.value.slot_lost and not store.check(["gen_1/arrived"])
    assert dist.is_initialized() and dist.group.WORLD is single_rank_group


# ---------------------------------------------------------------------------------------- real processes
@pytest.fixture(params=["tcp", "etcd"])
def job_store(request):
    """(the test's client of the job's store, its address for the workers): the single-node supervisor's TCPStore
    (hosted here), or a one-member etcd cluster's EtcdStore (multi-node; skipped without etcd)."""
    if request.param == "tcp":
        store = master_store()
        yield store, f"127.0.0.1:{store.port}"
        return
    from megatron_lite.fault_tolerance import local_etcd as etcd

    available, why = etcd.etcd_available()
    if not available:
        pytest.skip(why)
    with etcd.LocalEtcd(["127.0.0.1"]) as cluster:
        url = cluster.store_url(f"megatron_lite/test_{uuid.uuid4().hex[:8]}/store/")
        yield membership.connect_store(url, 30.0), url


def _env(address, rank, world_size, tmp_path, **extra):
    support = os.path.join(REPO, "tests", "support")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**env, "PYTHONPATH": os.pathsep.join([REPO, support, HERE]), "OMP_NUM_THREADS": "1",
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            membership.ENV_STORE: address,
            membership.ENV_COLLECTIVE_TIMEOUT: str(COLLECTIVE_TIMEOUT_S),
            membership.ENV_JOIN_TIMEOUT: str(COLLECTIVE_TIMEOUT_S + 10),
            membership.ENV_HEARTBEAT_FILE: str(tmp_path / f"heartbeat_{rank}"), **extra}


def _start(function, env, log):
    """python -c 'test_worker_fencing.<function>()' in its own session, output to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-c", f"import test_worker_fencing as t; t.{function}()"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(condition, deadline_s, what, procs=(), logs=()):
    """Wait until condition() is true; fail after deadline_s seconds or when a watched process exits early."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {log}\n{open(log).read()[-3000:]}" for log in logs if os.path.exists(log))
            why = f"process {dead[0].pid} exited with {dead[0].returncode}" if dead else f"{deadline_s:.0f} s passed"
            pytest.fail(f"waiting for {what}: {why}\n{tails}")
        time.sleep(0.02)


def _stop(procs):
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _blocked_rank():
    """A rank of the abort test: join generation 0, one all_reduce; rank 1 then stops itself (SIGSTOP: a hung
    peer), rank 0 blocks in the next all_reduce, records when it was released and by what, then re-forms in
    generation 1 and checks an all_reduce there."""
    import torch

    member = Membership.from_env()
    member.join()
    rank, store = member.rank, member.store
    if member.generation == 0:
        dist.all_reduce(torch.ones(4))
    if rank == 1 and member.generation == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 0:
        store.set("blocked_at", repr(time.time()))
        try:
            dist.all_reduce(torch.ones(1000))
            store.set("released", json.dumps({"at": time.time(), "error": None}))
        except Exception as e:  # noqa: BLE001 - what released it, for the test to judge
            store.set("released", json.dumps({"at": time.time(), "error": f"{type(e).__name__}: {e}"}))
        member.leave()
        member.wait_for_next_generation()
    if member.generation == 1:
        if member.formed != 1:  # rank 0; its replacement joined generation 1 at its start
            member.join()
        total = torch.full((3,), float(rank + 1))
        dist.all_reduce(total)
        store.set(f"gen1_sum/{rank}", json.dumps(total.tolist()))
        store.wait(["gen1_done"])
    os._exit(0)


def _mtime(path):
    return os.stat(path).st_mtime if os.path.exists(path) else None


def test_abort_releases_a_collective_blocked_on_a_stopped_peer(tmp_path, job_store):
    """Rank 1 SIGSTOPped (a hung peer); rank 0 blocked in an all_reduce with it. gen_0/abort must release rank 0
    within RELEASE_BOUND_S (gloo would wait COLLECTIVE_TIMEOUT_S), its store connections intact (it reports
    through them, its heartbeat goes on), and the next generation must form and reduce correctly over the new
    connections. The heartbeat files are touched while a rank lives, not while it is stopped. Would catch: the
    watcher missing (120 s), shutting down the store's connection too (no report, no heartbeat), interrupting
    a generation being formed, or sockets left broken for the next generation. On etcd too: its client keeps
    HTTP connections to the endpoints open, which must survive the interrupt."""
    store, address = job_store
    store.set("generation", "0")
    logs = [str(tmp_path / f"rank{r}.log") for r in (0, 1, 2)]
    procs = [_start("_blocked_rank", _env(address, r, 2, tmp_path), logs[r]) for r in (0, 1)]
    try:
        _wait_for(lambda: store.check(["blocked_at"]), 120, "rank 0 to enter its blocking all_reduce", procs, logs)
        stopped = lambda: open(f"/proc/{procs[1].pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T"  # noqa: E731
        _wait_for(stopped, 60, "rank 1 to stop itself", procs[:1], logs)
        files = [tmp_path / f"heartbeat_{r}" for r in (0, 1)]
        _wait_for(lambda: all(f.exists() for f in files), 10, "the heartbeat files", procs[:1], logs)
        beats = [_mtime(f) for f in files]
        time.sleep(2.5 * membership.HEARTBEAT_S)  # a live rank touches its file in this time, a stopped one not
        assert _mtime(files[0]) > beats[0] and _mtime(files[1]) == beats[1]
        assert not store.check(["released"]), "rank 0's all_reduce returned with its peer stopped"

        beat_before = float(store.get("heartbeat/0"))
        aborted_at = time.time()
        store.set("gen_0/abort", "1")
        _wait_for(lambda: store.check(["released"]), RELEASE_BOUND_S * 3, "rank 0 to be released", procs[:1], logs)
        released = json.loads(store.get("released"))
        assert released["error"] is not None and "closed" in released["error"].lower(), released
        assert released["at"] - aborted_at < RELEASE_BOUND_S, (released["at"] - aborted_at, logs)
        _wait_for(lambda: float(store.get("heartbeat/0")) > beat_before + membership.HEARTBEAT_S / 2, 10,
                  "rank 0's heartbeat after the release", procs[:1], logs)

        # The supervisor's part: rank 1 replaced, generation 1 opened; the generations's all_reduce is right.
        _stop(procs[1:])
        store.set("gen_1/members", "[0, 1]")
        store.set("generation", "1")
        procs.append(_start("_blocked_rank", _env(address, 1, 2, tmp_path, **{membership.ENV_GENERATION: "1"}),
                            logs[2]))
        _wait_for(lambda: store.check(["gen1_sum/0", "gen1_sum/1"]), 120, "generation 1's all_reduce",
                  [procs[0], procs[2]], logs)
        assert [json.loads(store.get(f"gen1_sum/{r}")) for r in (0, 1)] == [[3.0] * 3] * 2
        store.set("gen1_done", "1")
        for proc in (procs[0], procs[2]):
            proc.wait(timeout=60)
            assert proc.returncode == 0, open(logs[0]).read()[-3000:]
    finally:
        _stop(procs)
    print(f"released {released['at'] - aborted_at:.2f} s after gen_0/abort (collective timeout "
          f"{COLLECTIVE_TIMEOUT_S:.0f} s)")


def _fenced_saver():
    """One rank (world size 1) trains and saves through pretrain's checkpoint code with live training's commit
    guard installed: a save while current, one after its generation was abandoned, last words then, and last
    words once its slot moved. Reports what each did."""
    from ddp_testing import make_batches, train_step
    from optim_testing import build

    from megatron_lite import checkpointing
    from megatron_lite.checkpointing import LastWords, files
    from megatron_lite.training.scheduler import OptimizerParamScheduler

    member = Membership.from_env()
    member.join()
    files.set_commit_guard(member.guard_commit)  # what live_training installs
    root, store = os.environ["SAVE_DIR"], member.store
    _, ddp, opt = build(dict(use_distributed_optimizer=True), dict(lr=1e-3, use_distributed_optimizer=True))
    sched = OptimizerParamScheduler(opt, 1e-3, 1e-4, 1, 10, "cosine")
    words = LastWords(root, opt, sched, 0, 0)
    train_step(ddp, make_batches(1, 2), 0)
    words.stage(1, 8)
    opt.step()
    words.commit()
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except Fenced as e:
            out[name] = f"fenced (slot_lost={e.slot_lost})"

    attempt("save_current", lambda: checkpointing.save_checkpoint(root, 1, ddp, opt, sched, 8))
    store.set(f"gen_{member.generation}/abort", "1")
    attempt("save_abandoned", lambda: checkpointing.save_checkpoint(root, 2, ddp, opt, sched, 16))
    attempt("last_words_abandoned", lambda: words.write("a peer was lost"))
    words.written = None  # write once more, now as a process whose slot moved
    store.set(f"gen_{member.generation}/placement", json.dumps({"0": ["elsewhere.1", member.generation]}))
    attempt("last_words_slot_lost", lambda: words.write("cut off"))
    store.set("saver_done", json.dumps(out))
    os._exit(0)


def test_commit_guard_keeps_a_fenced_rank_from_committing(tmp_path):
    """A rank 0 whose generation was abandoned saves: nothing is committed (no iteration directory, the tracker
    at the previous checkpoint, no temporary directory left); its last words are still written; once its slot
    moved to another node, its last words are not. Would catch a fenced rank 0 renaming a checkpoint (or moving
    the tracker) with the state of a generation the job has left, or writing last words for a slot it lost."""
    store = master_store()
    store.set("generation", "0")
    save = tmp_path / "save"
    env = _env(f"127.0.0.1:{store.port}", 0, 1, tmp_path, SAVE_DIR=str(save), **{membership.ENV_NODE: "here.1"})
    store.set("gen_0/placement", json.dumps({"0": ["here.1", 0]}))
    log = str(tmp_path / "saver.log")
    proc = _start("_fenced_saver", env, log)
    try:
        _wait_for(lambda: store.check(["saver_done"]), 180, "the saver", [proc], [log])
    finally:
        _stop([proc])
    out = json.loads(store.get("saver_done"))
    assert out == {"save_current": "ok", "save_abandoned": "fenced (slot_lost=False)",
                   "last_words_abandoned": "ok", "last_words_slot_lost": "fenced (slot_lost=True)"}, \
        open(log).read()[-3000:]
    entries = sorted(os.listdir(save))
    assert entries == ["iter_0000001", "last_words", "latest_checkpointed_iteration.txt"], entries
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(os.listdir(save / "last_words" / "iter_0000001")) == ["rank_00000.json", "rank_00000.pt"]


HOLD_LOCK = """
import sys
from megatron_lite.checkpointing import files
files.lock_save_directory(sys.argv[1], job=sys.argv[2])
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_hung_rank_0_of_the_same_job_does_not_lock_its_replacement_out(tmp_path):
    """The rank 0 of generation g holds the --save lock; its node hangs (SIGSTOP: alive, its POSIX lock kept) or
    is cut off, and the leader places slot 0 on a spare. The new rank 0 locking the directory must not be
    refused as 'another job' (ValueError on every rank: not a peer failure, so the job fell back and then
    ended as a start-up error while the old process stayed stopped); a holder of another job still is. Would
    catch a node-hung fault on rank 0's node ending the whole job."""
    from megatron_lite.checkpointing import files

    save = str(tmp_path / "save")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, save, "job-a"], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        os.kill(holder.pid, signal.SIGSTOP)  # the old rank 0's node hangs
        with pytest.warns(UserWarning, match="a process of this job that has not released it"):
            files.lock_save_directory(save, job="job-a")
        assert os.path.realpath(save) not in files._locked  # not held: nothing to release
        for job in ("job-b", None):
            with pytest.raises(ValueError, match="in use by another job"):
                files.lock_save_directory(save, job=job)
    finally:
        holder.kill()
        holder.wait()
        holder.stdin.close()


def test_a_fenced_exit_is_replaced_never_a_start_up_error():
    """EXIT_FENCED (the store could not be read at a join or a commit) says nothing about the command line: the
    supervisor (and the cluster leader, which shares exit_kind) replaces the process. Would catch a single-node
    job given up as 'an error at start-up' because one rank lost its store connection before the first
    iteration was logged."""
    from megatron_lite.fault_tolerance.launch import DEAD, exit_kind

    assert exit_kind(membership.EXIT_FENCED, trained=False) == DEAD
    assert exit_kind(membership.EXIT_FENCED, trained=True) == DEAD


def test_an_interrupt_that_raised_is_tried_again(monkeypatch):
    """The heartbeat thread's interrupt can raise (a descriptor closed under it, NCCL groups created meanwhile);
    the thread swallows it, and the next poll must try again. Would catch the generation marked interrupted
    before anything was done: the blocked collective then waits for the collective timeout."""
    store = master_store()
    store.set("generation", "0")
    member = formed_member(store, 0, 0)
    store.set("gen_0/abort", "1")
    calls = []

    def interrupt(keep):
        calls.append(keep)
        if len(calls) == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return "done"
    monkeypatch.setattr(membership, "interrupt_generation", interrupt)
    with pytest.raises(RuntimeError):
        member.watch_for_abort(member.store, set())
    assert member.watch_for_abort(member.store, set()) and member.interrupted == 0 and len(calls) == 2
    assert not member.watch_for_abort(member.store, set()) and len(calls) == 2  # once done, never again


class _Backend:
    def __init__(self, state):
        self.state = state

    def get_error(self):
        return type("ErrorType", (), {"name": self.state})()


class _Group:
    def __init__(self, state):
        self.backend = _Backend(state)

    def _get_backend(self, device):
        return self.backend


def test_no_update_from_reductions_an_abort_may_have_cut_short(monkeypatch):
    """NCCL: an aborted communicator ends the reduction in flight with partial sums and no error in the training
    thread; check_reductions (before the optimizer update) must see it: the heartbeat thread began to
    interrupt the generation (noted before it acts, so an abort racing the check is seen or came after the
    reductions completed), or torch's watchdog left a group in an error state. Would catch an update applied
    to partial gradients (the weights silently wrong, then healed from as a completed iteration). The logic
    here; tests/cuda/test_cuda_live.py runs it on NCCL."""
    store = master_store()
    store.set("generation", "1")
    member = formed_member(store, 0, 1)
    assert member.cut_short([_Group("SUCCESS")]) is None
    assert "TIMEOUT" in member.cut_short([_Group("SUCCESS"), _Group("TIMEOUT")])
    member._interrupting = 0  # an earlier generation's interrupt says nothing about this one
    assert member.cut_short([]) is None
    store.set("gen_1/abort", "1")
    seen = []
    monkeypatch.setattr(membership, "interrupt_generation", lambda keep: seen.append(member.cut_short([])) or "")
    member.watch_for_abort(member.store, set())
    assert seen == [member.cut_short([])] and "interrupted" in seen[0]  # seen already while the abort acts


SLOW_STORE_S = 4.0 * membership.HEARTBEAT_S
"""How long each heartbeat request to the store takes in _slow_store_rank (an etcd member lost, an election)."""


class _SlowHeartbeats:
    """The heartbeat thread's store connection, whose writes take SLOW_STORE_S."""

    def __init__(self, store):
        self.store = store

    def set(self, key, value):
        time.sleep(SLOW_STORE_S)
        self.store.set(key, value)

    def check(self, keys):
        return self.store.check(keys)


def _slow_store_rank():
    """A rank whose heartbeat thread's store requests are slow: it only beats until the test stops it."""
    real, made = membership.connect_store, []

    def connect(address, timeout_s):
        made.append(real(address, timeout_s))
        return _SlowHeartbeats(made[-1]) if len(made) == 2 else made[-1]  # the second: the heartbeat thread's
    membership.connect_store = connect
    member = Membership.from_env()
    member.store.set("slow_started", "1")
    time.sleep(120)  # the test kills it long before
    os._exit(0)


def test_the_heartbeat_file_is_not_held_up_by_a_slow_store(tmp_path):
    """The agent kills a rank whose heartbeat file is older than --heartbeat-timeout (5 s). A store request that
    takes seconds (an etcd member lost or cut off: its attempt timeout, then an election) must not delay the
    file: it is touched every HEARTBEAT_S whatever the store does. Would catch healthy ranks killed as hung
    when an etcd member is lost (the file was touched by the thread that then waited for the store)."""
    store = master_store()
    store.set("generation", "0")
    log = str(tmp_path / "slow.log")
    proc = _start("_slow_store_rank", _env(f"127.0.0.1:{store.port}", 0, 1, tmp_path), log)
    path = tmp_path / "heartbeat_0"
    try:
        _wait_for(lambda: store.check(["slow_started"]) and path.exists(), 120, "the rank to start", [proc], [log])
        touches, start = {_mtime(path)}, time.monotonic()
        while time.monotonic() - start < 2 * SLOW_STORE_S:  # a file touched once per slow request: 2 touches
            touches.add(_mtime(path))
            time.sleep(0.05)
    finally:
        _stop([proc])
    assert len(touches) >= 2 * SLOW_STORE_S / membership.HEARTBEAT_S - 2, sorted(touches)


def test_waits_on_a_coordination_service_back_off_and_on_the_tcpstore_do_not():
    """A wait polls the supervisor's TCPStore every LOCAL_POLL_S (recoveries on one node stay as fast), but
    backs off on etcd: each round is several requests, and ranks polling it every 10 ms starved the
    replacement they waited for on 2 cores."""
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    local = Membership(tcp, 0, 2, 0, LiveConfig())._pauses()
    assert [next(local) for _ in range(20)] == [membership.LOCAL_POLL_S] * 20
    remote = Membership(dist.HashStore(), 0, 2, 0, LiveConfig())._pauses()
    pauses = [next(remote) for _ in range(20)]
    first, longest = membership.REMOTE_POLL_S
    assert pauses[0] == first and pauses[-1] == longest and pauses == sorted(pauses)
    assert sum(pauses[:10]) < 1.0  # the first second still polls often: a generation that comes soon is seen soon
