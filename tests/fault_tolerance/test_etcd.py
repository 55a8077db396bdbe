"""megatron_lite/fault_tolerance/etcd.py: the etcd client, EtcdStore (TCPStore's semantics) and LocalEtcd.

Real etcd processes on free local ports (skipped without the etcd binary: `apt-get install etcd-server`); every
wait is bounded by a deadline and every cluster is stopped by LocalEtcd's context manager, also on failure.
"""

import ctypes
import datetime
import http.server
import json
import multiprocessing
import os
import signal
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from megatron_lite.fault_tolerance.etcd import (
    EtcdClient,
    EtcdError,
    EtcdIndeterminate,
    EtcdStore,
    EtcdUnavailable,
    compare_value,
    put_op,
    range_op,
)
from megatron_lite.fault_tolerance.local_etcd import LocalEtcd, etcd_available, etcd_command
from megatron_lite.fault_tolerance.netns import SimulatedCluster, netns_available

AVAILABLE, WHY = etcd_available()
NETNS, NETNS_WHY = netns_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"etcd is not available: {WHY}")


@pytest.fixture(scope="module")
def etcd():
    """One single-member cluster for the tests that need no failover (each uses a prefix of its own)."""
    with LocalEtcd(["127.0.0.1"]) as cluster:
        yield cluster


def _prefix() -> str:
    return f"/test_etcd/{uuid.uuid4().hex[:8]}/"


def _wait_until(condition, timeout_s: float, what: str):
    deadline, pause = time.monotonic() + timeout_s, 0.01
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def test_client_key_operations(etcd):
    """put/get/get_prefix/delete/delete_prefix, str and bytes alike (values come back as bytes)."""
    client, p = EtcdClient(etcd.endpoints), _prefix()
    assert client.get(p + "a") is None and client.get_with_revision(p + "a") is None
    before = client.revision()
    client.put(p + "a", "1")
    client.put((p + "b").encode(), b"\xff\x00")
    client.put(p + "c/d", "")
    value, revision = client.get_with_revision(p + "a")
    assert value == b"1" and revision > before and client.revision() >= revision
    assert client.get(p + "b") == b"\xff\x00" and client.get(p + "c/d") == b""
    assert client.get_prefix(p) == {p + "a": b"1", p + "b": b"\xff\x00", p + "c/d": b""}
    assert client.count_prefix(p + "c/") == 1
    assert client.delete(p + "a") and not client.delete(p + "a")
    assert client.delete_prefix(p) == 2 and client.get_prefix(p) == {}
    with pytest.raises(TypeError, match="str or bytes"):
        client.put(p + "x", 1)
    with pytest.raises(ValueError, match="host:port"):
        EtcdClient(["localhost"])


def test_client_in_a_process_with_many_files(etcd):
    """The client works when its sockets' descriptors are above 1024 (a trainer with many files, shared-memory
    handles and sockets open): select() refused them ("filedescriptor out of range") on every request that
    reused a kept-alive connection."""
    import resource
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("the open-files limit is below 1200")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        client, key = EtcdClient(etcd.endpoints), _prefix() + "k"
        client.put(key, "1")
        assert client.get(key) == b"1" and client.get(key) == b"1"
    finally:
        for fd in held:
            os.close(fd)


def test_create_replace_txn(etcd):
    """create only when absent, replace only on the expected value (None: absent), txn's branches."""
    client, p = EtcdClient(etcd.endpoints), _prefix()
    assert client.create(p + "k", "first") and not client.create(p + "k", "second")
    assert client.get(p + "k") == b"first"
    assert not client.replace(p + "k", "wrong", "x") and client.get(p + "k") == b"first"
    assert client.replace(p + "k", b"first", "third") and client.get(p + "k") == b"third"
    assert not client.replace(p + "k", None, "x") and client.replace(p + "new", None, "y")
    ok, responses = client.txn([compare_value(p + "k", "nope")], [put_op(p + "k", "z")], [range_op(p + "k")])
    assert not ok and responses[0]["response_range"]["kvs"][0]["mod_revision"]
    ok, _ = client.txn([compare_value(p + "k", "third")], [put_op(p + "k", "z")])
    assert ok and client.get(p + "k") == b"z"


def test_lease_keepalive_expiry_revoke(etcd):
    """A key bound to a lease lives while the lease is kept alive (past its TTL), goes when it expires, and at
    once when it is revoked; keepalive of a gone lease answers 0 and a put with it is refused."""
    client, p = EtcdClient(etcd.endpoints), _prefix()
    lease = client.lease_grant(1)
    client.put(p + "alive", "1", lease=lease)
    kept_until = time.monotonic() + 2.5  # 2.5 TTLs
    while time.monotonic() < kept_until:
        assert client.lease_keepalive(lease) >= 1
        assert client.get(p + "alive") == b"1"
        time.sleep(0.25)
    _wait_until(lambda: client.get(p + "alive") is None, 6.0, "the lease's expiry")
    assert client.lease_keepalive(lease) == 0
    with pytest.raises(EtcdError, match="lease not found"):
        client.put(p + "late", "1", lease=lease)
    lease = client.lease_grant(30)
    assert client.create(p + "leader", "me", lease=lease)
    client.lease_revoke(lease)
    assert client.get(p + "leader") is None and client.lease_keepalive(lease) == 0
    client.lease_revoke(lease)  # already gone: fine
    with pytest.raises(ValueError, match="ttl_s"):
        client.lease_grant(0)


def _fake_member(status: int, body: bytes):
    """An HTTP server answering every POST with `status` and `body` (a member in a bad state); its endpoint."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize("status, body", [
    (503, json.dumps({"error": {"grpc_code": 14, "http_code": 503, "message": "etcdserver: no leader",
                                "http_status": "Service Unavailable"}}).encode()),
    (200, b""),  # a keepalive stream that ended without its response
])
def test_bad_keepalive_answers_fail_over(etcd, status, body):
    """A member without a leader answers a lease keepalive (a gRPC stream on the gateway) with its error nested
    as {"error": {"grpc_code": 14, ...}} (unary calls: {"code": 14, ...}); a stream may also end without its
    {"result": ...}. Either way the client tries the next member, as for any unavailable member. (The nested
    error raised EtcdError at once and the client stayed sticky on that member: every keepalive of an agent
    failed there until its node fenced itself, with a quorum a failover away; the empty answer read as TTL 0,
    'the lease is gone': the agent fenced its node at once.)"""
    server, bad = _fake_member(status, body)
    try:
        client = EtcdClient([bad] + etcd.endpoints, timeout_s=5.0)
        client._preferred = 1
        lease = client.lease_grant(5)
        client._preferred = 0
        assert client.lease_keepalive(lease) >= 1
        with pytest.raises(EtcdUnavailable):
            EtcdClient([bad], timeout_s=0.5).lease_keepalive(lease)
    finally:
        server.shutdown()
        server.server_close()


class _UnansweredOnce(EtcdClient):
    """The first transaction goes unanswered: applied ("applied") or not ("lost"), as after a member froze."""

    def __init__(self, endpoints, mode):
        super().__init__(endpoints)
        self.mode = mode

    def txn(self, compare, success, failure=()):
        mode, self.mode = self.mode, None
        if mode == "applied":
            super().txn(compare, success, failure)
        if mode is not None:
            raise EtcdIndeterminate("injected: sent, no answer")
        return super().txn(compare, success, failure)


@pytest.mark.parametrize("mode", ["applied", "lost"])
def test_unanswered_transactions_resolved(etcd, mode):
    """A transaction that got no answer is neither lost nor applied twice: create/replace/compare_set/add read the
    key back and send it again only while it can still apply (an add counted twice, or a create that won but
    answered False, would make two agents leaders or a generation never form)."""
    p = _prefix()
    client = _UnansweredOnce(etcd.endpoints, mode)
    assert client.create(p + "leader", "me", lease=0) and client.get(p + "leader") == b"me"
    client.mode = mode
    assert client.replace(p + "leader", "me", "you") and client.get(p + "leader") == b"you"
    client.mode = mode
    assert not client.create(p + "leader", "other")
    store = EtcdStore(_UnansweredOnce(etcd.endpoints, mode), p + "store/")
    assert store.add("n", 5) == 5
    store.client.mode = mode
    assert store.add("n", 2) == 7 and store.get("n") == b"7"
    store.client.mode = mode
    assert store.compare_set("ready", "", "1") == b"1"
    store.client.mode = mode
    assert store.compare_set("ready", "", "closed") == b"1"
    store.client.mode = mode
    assert store.compare_set("ready", "1", "2") == b"2" and store.get("ready") == b"2"


class _UnansweredWhileOthersWrite(EtcdClient):
    """The first transaction goes unanswered (applied or not) while another process changes the same key with the
    same operation, as the 6 ranks of a generation each add 1 to gen_<g>/arrived."""

    def __init__(self, endpoints, mode, other):
        super().__init__(endpoints)
        self.mode, self.other = mode, other

    def txn(self, compare, success, failure=()):
        mode, self.mode = self.mode, None
        if mode is None:
            return super().txn(compare, success, failure)
        if mode == "applied":
            super().txn(compare, success, failure)
        self.other()
        raise EtcdIndeterminate("injected: sent, no answer")


@pytest.mark.parametrize("mode", ["applied", "lost"])
def test_unanswered_transaction_beside_an_equal_one(etcd, mode):
    """An unanswered add / replace is resolved by what happened, not by the value the key holds: another rank's
    add of the same amount from the same value (or another agent's equal replace) leaves the same value whether
    ours applied or not (read back by value, a lost add counted as done left gen_<g>/arrived one short: the
    generation never formed; an applied one sent again counted twice)."""
    p = _prefix()
    other = EtcdStore(etcd.endpoints, p + "store/")
    other.add("arrived", 2)
    store = EtcdStore(_UnansweredWhileOthersWrite(etcd.endpoints, mode, lambda: other.add("arrived", 1)),
                      p + "store/")
    store.add("arrived", 1)
    assert store.get("arrived") == b"4"
    rival = EtcdClient(etcd.endpoints)
    rival.put(p + "seq", "3")
    client = _UnansweredWhileOthersWrite(etcd.endpoints, mode, lambda: rival.replace(p + "seq", "3", "4"))
    assert client.replace(p + "seq", "3", "4") is (mode == "applied")  # the rival's equal one won when ours was lost


def _store_calls(store):
    """The TCPStore calls membership.py and launch.py make, with their results."""
    short = datetime.timedelta(seconds=0.3)
    out = [store.add("n", 3), store.add("n", -1), store.get("n"), store.add("n", 0)]
    store.set("s", "v")
    store.set("b", b"\xff")
    out += [store.get("s"), store.get("b"), store.check(["s"]), store.check(["s", "missing"]), store.num_keys()]
    out += [store.compare_set("cs", "", "1"), store.compare_set("cs", "", "2"), store.compare_set("cs", "1", "3"),
            store.compare_set("cs", "1", "4"), store.compare_set("absent", "x", "y"), store.check(["absent"])]
    store.set("empty", "")
    out += [store.compare_set("empty", "", "filled")]
    out += [store.delete_key("s"), store.delete_key("s"), store.check(["s"]), store.num_keys()]
    store.wait(["n", "b"])
    store.wait(["n"], short)
    store.append("ap", "x")
    store.append("ap", "y")
    out += [store.get("ap"), store.multi_get(["n", "ap"])]
    for call in (lambda: store.wait(["never"], short), lambda: store.get("never")):
        store.set_timeout(short)
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="timeout"):
            call()
        out.append(time.monotonic() - started < 5.0)
    return out


def test_store_matches_tcpstore(etcd):
    """EtcdStore answers every call membership.py and launch.py make exactly as TCPStore does: add returns the
    new value, compare_set the stored value ("" = absent; an absent key answers `expected`), get/wait raise
    DistStoreError past the timeout."""
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    expected = _store_calls(tcp)
    store = EtcdStore(etcd.endpoints, _prefix())
    assert _store_calls(store) == expected
    assert EtcdStore.from_url(store.url).get("n") == b"2"
    assert store.raw_key("n") == store.prefix + "n" and store.client.get(store.raw_key("n")) == b"2"
    with pytest.raises(ValueError, match="etcd://"):
        EtcdStore.from_url("tcp://127.0.0.1:1/x")
    with pytest.raises(ValueError, match="starting with '/'"):
        EtcdStore(etcd.endpoints, "job/store/")


def test_store_add_is_atomic(etcd):
    """Concurrent adds from several threads (each its own connection) lose nothing and return distinct values."""
    store, results = EtcdStore(etcd.endpoints, _prefix()), []

    def adder():
        results.extend(store.add("counter", 1) for _ in range(15))
    threads = [threading.Thread(target=adder) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(results) == list(range(1, 61)) and store.get("counter") == b"60"


def _gloo_rank(url: str, rank: int, results):
    store = EtcdStore.from_url(url, timeout_s=60)
    dist.init_process_group("gloo", store=dist.PrefixStore("gen_0", store), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    world = torch.tensor([rank + 1.0])
    dist.all_reduce(world)
    group = dist.new_group([0, 1])
    sub = torch.tensor([10.0 * (rank + 1)])
    dist.all_reduce(sub, group=group)
    dist.destroy_process_group()
    results.put((rank, world.item(), sub.item()))


def test_gloo_process_group_over_etcd_store(etcd):
    """Two processes form a gloo WORLD on PrefixStore(EtcdStore) (membership.py's scheme), all_reduce on it and
    on a dist.new_group. (Spawned, not forked: in the whole suite the pytest process holds other tests' threads
    (gloo's among them), and a child forked while one of them held a lock hung until the 120 s deadline in CI.)"""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    url = etcd.store_url(_prefix())
    ranks = [context.Process(target=_gloo_rank, args=(url, rank, results), daemon=True) for rank in range(2)]
    for rank in ranks:
        rank.start()
    try:
        got = sorted(results.get(timeout=120) for _ in ranks)
    finally:
        for rank in ranks:
            rank.join(timeout=30)
            if rank.is_alive():
                rank.kill()
                rank.join()
    assert got == [(0, 3.0, 30.0), (1, 3.0, 30.0)]
    assert [rank.exitcode for rank in ranks] == [0, 0]


def test_three_members_one_lost(tmp_path):
    """A 3-member cluster with its raft leader killed: the store keeps working through the others (sticky
    failover: the dead endpoint costs no timeout per request), a lease kept alive across the loss (and the
    election) still holds its key, the member comes back; a frozen member (SIGSTOP) is failed over within the
    timeout; with two members gone the last one has no quorum and requests fail within the client's timeout
    instead of hanging."""
    with LocalEtcd(["127.0.0.1"] * 3, data_dir=str(tmp_path)) as cluster:
        assert len(cluster.endpoints) == 3 and etcd_command("a", "d", "http://h:1", "http://h:2", {"a": "http://h:2"})
        store = EtcdStore(cluster.endpoints, _prefix(), timeout_s=30, request_timeout_s=2.0)
        client = store.client
        lease = client.lease_grant(3)
        client.put(store.raw_key("node"), "A", lease=lease)
        store.set("before", "1")
        lost = cluster.leader()
        assert lost is not None
        client._preferred = lost  # the client's sticky endpoint is the one lost
        cluster.kill(lost)
        started = time.monotonic()
        for i in range(20):
            assert store.add("count", 1) == i + 1
            assert client.lease_keepalive(lease) >= 1
        assert store.get("before") == b"1"
        assert time.monotonic() - started < 15.0, "the dead endpoint cost a timeout on many requests"
        fresh = EtcdClient(cluster.endpoints, timeout_s=2.0)  # refused at once, then sticky on a live member
        started = time.monotonic()
        for _ in range(10):
            assert fresh.get(store.raw_key("before")) == b"1"
        assert time.monotonic() - started < 5.0
        survived_until = time.monotonic() + 4.0  # past the lease's 3 s TTL
        while time.monotonic() < survived_until:
            assert client.lease_keepalive(lease) >= 1 and client.get(store.raw_key("node")) == b"A"
            time.sleep(0.3)
        cluster.restart(lost)
        assert EtcdClient(cluster.endpoints[lost:lost + 1]).get(store.raw_key("before")) == b"1"

        frozen = cluster.processes[1].pid
        client._preferred = 1
        os.kill(frozen, signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert store.get("before") == b"1"  # times out on the frozen member, then another answers
            assert time.monotonic() - started < 2.5
            assert store.add("count", 1) == 21
        finally:
            os.kill(frozen, signal.SIGCONT)

        cluster.kill(1)
        cluster.kill(2)
        alone = EtcdClient(cluster.endpoints[:1], timeout_s=1.5)
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable):
            alone.get(store.raw_key("before"))
        assert time.monotonic() - started < 4.0
        stranded = EtcdStore(cluster.endpoints[:1], store.prefix, request_timeout_s=0.5)
        with pytest.raises(dist.DistStoreError, match="wait timeout.*etcd"):  # TCPStore's error, etcd's reason
            stranded.wait(["never"], datetime.timedelta(seconds=1))


def _in_namespace(namespace: str, fn):
    """fn() on a thread of this process moved into the network namespace (setns: per thread), e.g. a client on
    a simulated node; its sockets live there."""
    outcome = {}

    def run():
        try:
            with open(f"/run/netns/{namespace}") as handle:
                if ctypes.CDLL(None, use_errno=True).setns(handle.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
                    raise OSError(ctypes.get_errno(), f"setns into {namespace}")
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            outcome["error"] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), f"a call in namespace {namespace} did not return within 60 s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.mark.skipif(not NETNS, reason=NETNS_WHY)
def test_partitioned_member():
    """3 members on simulated nodes (started through LocalEtcd's prefix_argvs = ip netns exec), one node's link
    cut: a client outside fails over from the unreachable member within one attempt; a client on the cut node
    reaches only its own member, which has no quorum, and fails within its timeout instead of hanging; after
    the link is mended that client reads again."""
    with SimulatedCluster(3) as nodes, LocalEtcd([node.address for node in nodes.nodes],
                                                 prefix_argvs=[node.prefix_argv for node in nodes.nodes]) as cluster:
        client, key = EtcdClient(cluster.endpoints, timeout_s=2.0), _prefix() + "k"
        client.put(key, "v")
        leader = cluster.leader()
        cut = next(i for i in range(3) if i != leader)  # a follower: no election on top of the partition
        nodes.cut(nodes.nodes[cut])
        client._preferred = cut
        started = time.monotonic()
        assert client.get(key) == b"v" and time.monotonic() - started < 2.0
        assert client.get(key) == b"v"  # sticky on a member that answers now

        def stranded_read():
            started = time.monotonic()
            with pytest.raises(EtcdUnavailable):
                EtcdClient(cluster.endpoints, timeout_s=1.5).get(key)
            return time.monotonic() - started
        assert _in_namespace(nodes.nodes[cut].namespace, stranded_read) < 3.0
        nodes.mend(nodes.nodes[cut])

        def reads_again():
            try:
                return EtcdClient(cluster.endpoints[cut:cut + 1], timeout_s=1.0).get(key) == b"v"
            except EtcdUnavailable:
                return False
        _wait_until(lambda: _in_namespace(nodes.nodes[cut].namespace, reads_again), 20.0, "the mended member's read")


def _processes_mentioning(text: str):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if text.encode() in handle.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_members_behind_a_forking_prefix_are_stopped(tmp_path):
    """A member started through a prefix that forks instead of exec'ing (a shell, sudo) is stopped with its
    starter: LocalEtcd kills the member's whole process group (it SIGKILLed the starter only, and the etcd
    below it ran on after stop(), holding its ports)."""
    data_dir = str(tmp_path / f"forking_{uuid.uuid4().hex[:6]}")
    os.makedirs(data_dir)
    with LocalEtcd(["127.0.0.1"], prefix_argvs=[["sh", "-c", '"$@"; exit $?', "sh"]], data_dir=data_dir) as cluster:
        assert EtcdClient(cluster.endpoints).revision() >= 1
        assert len(_processes_mentioning(data_dir)) >= 2  # the shell and etcd
    _wait_until(lambda: not _processes_mentioning(data_dir + "/m0"), 10.0, "the member's exit")

