"""netns.py: simulated nodes. Namespaced tests need root and iproute2 (skipped otherwise, with the reason);
the loopback ones run anywhere. Every wait is bounded by a deadline."""

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from megatron_lite.fault_tolerance import netns
from megatron_lite.fault_tolerance.netns import SimulatedCluster, netns_available

AVAILABLE, WHY = netns_available()
needs_netns = pytest.mark.skipif(not AVAILABLE, reason=WHY)
PORT = 29611  # per namespace: no other test can hold it

SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    connection, _ = server.accept()
    connection.sendall(b"hello")
    connection.close()
"""

CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as connection:
        print(connection.recv(5).decode())
except OSError as error:
    print("failed", type(error).__name__)
"""

TICKER = """
import itertools, sys, time
for count in itertools.count():
    print(count, flush=True)
    time.sleep(0.01)
"""


def _readline(process, timeout=10.0) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no output within {timeout} s"
    return process.stdout.readline().decode().strip()


def _connect(node, address, timeout=1.0) -> str:
    """What a client in `node` (None: the root namespace) gets from the server at `address`."""
    argv = [sys.executable, "-c", CLIENT, address, str(PORT), str(timeout)]
    if node is not None:
        argv = node.prefix_argv + argv
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


def _serve(cluster, node):
    server = cluster.popen(node, [sys.executable, "-c", SERVER, node.address, str(PORT)], stdout=subprocess.PIPE)
    assert _readline(server) == "listening"
    return server


def _leftovers(cluster_id):
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line for line in (names + links).splitlines() if cluster_id in line]


@needs_netns
def test_nodes_reach_each_other_by_address_and_a_cut_isolates_one():
    """A node's server answers another node and the host by address; cut(B) makes a connect from A fail within
    its timeout (not hang), B's server runs on, and mend(B) brings it back. Interface names fit in 15 characters."""
    with SimulatedCluster(3) as cluster:
        a, b, c = cluster.nodes
        assert len({a.address, b.address, c.address, cluster.host_address}) == 4
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert all(len(line.split(":")[1].strip().split("@")[0]) <= 15 for line in links.splitlines())
        server = _serve(cluster, b)
        assert _connect(a, b.address) == "hello"
        assert _connect(None, b.address) == "hello"

        cluster.cut(b)
        started = time.monotonic()
        assert _connect(a, b.address, timeout=1.0).startswith("failed")
        assert time.monotonic() - started < 10
        assert _connect(None, b.address, timeout=1.0).startswith("failed")
        assert server.poll() is None  # the node is cut off, not dead
        assert _connect(b, b.address) == "hello"  # it still talks to itself

        cluster.mend(b)
        deadline = time.monotonic() + 10
        while _connect(a, b.address) != "hello":
            assert time.monotonic() < deadline, "no connection within 10 s of mend"
    assert _leftovers(cluster.id) == []


@needs_netns
def test_kill_leaves_no_process_in_the_namespace():
    """kill(node) ends every process in the namespace: the ones popen started, their children, and one started
    there by other means (as LocalEtcd does with prefix_argv); another node's processes live on."""
    with SimulatedCluster(2) as cluster:
        a, b = cluster.nodes
        cluster.popen(a, ["sh", "-c", "sleep 60 & sleep 60 & wait"])
        outsider = subprocess.Popen(a.prefix_argv + ["sleep", "60"])
        survivor = cluster.popen(b, ["sleep", "60"])
        deadline = time.monotonic() + 10
        while len(cluster.pids(a)) < 4:
            assert time.monotonic() < deadline, cluster.pids(a)
        assert outsider.pid in cluster.pids(a) and survivor.pid not in cluster.pids(a)
        cluster.kill(a)
        assert cluster.pids(a) == []
        assert subprocess.run(["ip", "netns", "pids", a.namespace], capture_output=True, text=True).stdout == ""
        assert outsider.wait(timeout=10) == -signal.SIGKILL
        assert cluster.pids(b) == [survivor.pid]
    assert survivor.wait(timeout=10) == -signal.SIGKILL  # close() kills the rest


def _freeze_and_thaw(cluster, node):
    ticker = cluster.popen(node, [sys.executable, "-c", TICKER], stdout=subprocess.PIPE)
    _readline(ticker)
    cluster.freeze(node)
    assert [open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] for pid in cluster.pids(node)] == ["T"]
    while select.select([ticker.stdout], [], [], 0)[0]:  # drain what it wrote before it stopped
        if not os.read(ticker.stdout.fileno(), 65536):
            break
    assert select.select([ticker.stdout], [], [], 0.3)[0] == []  # stopped: writes nothing more
    cluster.thaw(node)
    assert open(f"/proc/{ticker.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T"
    assert select.select([ticker.stdout], [], [], 10)[0], "no output within 10 s of thaw"


@needs_netns
def test_freeze_stops_and_thaw_resumes():
    with SimulatedCluster(1) as cluster:
        _freeze_and_thaw(cluster, cluster.nodes[0])


GLOO_RANK = """
import datetime, sys
import torch, torch.distributed as dist
rank, address, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
timeout = datetime.timedelta(seconds=60)
store = dist.TCPStore(address, port, 2, rank == 0, timeout=timeout)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
value = torch.tensor([rank + 1.0])
dist.all_reduce(value)
print(value.item(), flush=True)
dist.destroy_process_group()
"""


@needs_netns
def test_gloo_all_reduce_across_two_nodes():
    """What a rank of the multi-node job does: GLOO_SOCKET_IFNAME = the node's interface, the TCPStore on node
    A's address; two processes in two namespaces all_reduce."""
    with SimulatedCluster(2) as cluster:
        a, b = cluster.nodes
        ranks = []
        for rank, node in enumerate(cluster.nodes):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=node.ifname, OMP_NUM_THREADS="1")
            argv = [sys.executable, "-c", GLOO_RANK, str(rank), a.address, str(PORT)]
            ranks.append(cluster.popen(node, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outputs = [rank.communicate(timeout=120) for rank in ranks]
        assert [rank.returncode for rank in ranks] == [0, 0], [err.decode()[-2000:] for _, err in outputs]
        assert [out.decode().strip() for out, _ in outputs] == ["3.0", "3.0"]


OWNER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("netns", sys.argv[1])  # the file alone: no torch to import
netns = importlib.util.module_from_spec(spec)
spec.loader.exec_module(netns)
with netns.SimulatedCluster(2) as cluster:
    cluster.popen(cluster.nodes[0], ["sleep", "60"])
    print(cluster.id, flush=True)
    time.sleep(60)
"""


@needs_netns
def test_cleanup_after_an_exception_an_interrupt_and_a_killed_owner():
    """An exception inside the context and Ctrl-C (SIGINT) leave nothing; a process SIGKILLed while it held a
    cluster leaves its namespaces and processes behind, which the next cluster made on the machine removes."""
    with pytest.raises(KeyError):
        with SimulatedCluster(2) as cluster:
            sleeper = cluster.popen(cluster.nodes[1], ["sleep", "60"])
            raise KeyError("boom")
    assert _leftovers(cluster.id) == [] and sleeper.wait(timeout=10) == -signal.SIGKILL

    for signum in (signal.SIGINT, signal.SIGKILL):
        owner = subprocess.Popen([sys.executable, "-c", OWNER, netns.__file__], stdout=subprocess.PIPE)
        try:
            owner_id = _readline(owner, timeout=30)
            namespace = f"mlt{owner_id}-node0"
            deadline = time.monotonic() + 10
            while not (orphan := subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                                                text=True).stdout.split()):  # `ip netns exec` is about to setns
                assert time.monotonic() < deadline, "the owner's process never entered its namespace"
            assert len(orphan) == 1 and len(_leftovers(owner_id)) >= 5  # 2 namespaces, 2 veths, the bridge
            owner.send_signal(signum)
            owner.wait(timeout=30)
        finally:
            owner.kill()
        if signum == signal.SIGKILL:
            assert os.path.exists(f"/proc/{orphan[0]}") and _leftovers(owner_id)
            with SimulatedCluster(1):
                pass
        assert _leftovers(owner_id) == []
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{orphan[0]}") and "Z" not in open(f"/proc/{orphan[0]}/stat").read().split()[2]:
            assert time.monotonic() < deadline, f"{orphan[0]} still alive"


def test_loopback_nodes():
    """Without namespaces: nodes on 127.0.0.<k+2>, a server reached by address, kill ends a node's processes and
    their children, freeze/thaw work, and cut says why it cannot."""
    with SimulatedCluster(2, loopback=True) as cluster:
        a, b = cluster.nodes
        assert (a.address, b.address, a.ifname, a.prefix_argv) == ("127.0.0.2", "127.0.0.3", "lo", [])
        _serve(cluster, b)
        assert _connect(a, b.address) == "hello"
        cluster.popen(b, ["sh", "-c", "sleep 60 & sleep 60 & wait"])
        other = cluster.popen(a, ["sleep", "60"])
        deadline = time.monotonic() + 10
        while len(cluster.pids(b)) < 4:
            assert time.monotonic() < deadline, cluster.pids(b)
        cluster.kill(b)
        assert cluster.pids(b) == [] and cluster.pids(a) == [other.pid]
        _freeze_and_thaw(cluster, b)
        with pytest.raises(NotImplementedError, match="network namespaces"):
            cluster.cut(a)
    assert other.wait(timeout=10) == -signal.SIGKILL


def test_refusals():
    with pytest.raises(ValueError, match="num_nodes must be an int"):
        SimulatedCluster(0)
    with pytest.raises(ValueError, match="15 characters"):
        SimulatedCluster(101)


def test_loopback_kill_spares_a_session_whose_id_was_reused():
    """A reaped process's pid can be reused (pid_max is 32768 on small machines) by an unrelated session
    leader; kill(node) must not take that session for the node's: simulated by pointing the reaped tracked
    process at an unrelated session leader's pid."""
    unrelated = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        with SimulatedCluster(1, loopback=True) as cluster:
            node = cluster.nodes[0]
            finished = cluster.popen(node, ["true"])
            assert finished.wait(timeout=10) == 0
            finished.pid = unrelated.pid  # its pid, now someone else's session
            assert unrelated.pid not in cluster.pids(node)
            cluster.kill(node)
        assert unrelated.poll() is None
    finally:
        unrelated.kill()
        unrelated.wait(timeout=10)


def test_loopback_kill_ends_an_orphan_left_in_the_session():
    """A process whose parent exited (re-parented, as a daemonizing child is) is still in the session popen
    gave the node: kill(node) ends it too."""
    with SimulatedCluster(1, loopback=True) as cluster:
        node = cluster.nodes[0]
        parent = cluster.popen(node, ["sh", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE)
        orphan = int(_readline(parent))
        assert parent.wait(timeout=10) == 0
        try:
            assert orphan in cluster.pids(node)
            cluster.kill(node)
            assert not os.path.exists(f"/proc/{orphan}") or "Z" in open(f"/proc/{orphan}/stat").read().split()[2]
        finally:
            if netns._proc_state(orphan) not in (None, "Z"):  # the test failed: not left running
                if b"sleep" in open(f"/proc/{orphan}/cmdline", "rb").read():
                    os.kill(orphan, signal.SIGKILL)


def test_an_adopted_process_is_the_nodes_on_loopback():
    """A process started elsewhere in a session of its own (as LocalEtcd starts a member) and adopted by a loopback
    node is frozen, thawed and killed with it, and no other node's. Would catch the soak's "node killed" leaving
    the etcd member of a loopback node running (on a namespace the member goes with the namespace)."""
    with SimulatedCluster(2, loopback=True) as cluster:
        a, b = cluster.nodes
        member = subprocess.Popen(["sleep", "60"], start_new_session=True)
        try:
            cluster.adopt(a, member)
            assert cluster.pids(a) == [member.pid] and cluster.pids(b) == []
            cluster.freeze(a)
            assert netns._proc_state(member.pid) in ("T", "t")
            cluster.thaw(a)
            cluster.kill(a)
            assert member.wait(timeout=10) == -signal.SIGKILL and cluster.pids(a) == []
        finally:
            member.kill()
            member.wait(timeout=10)


LOCK_OF = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("netns", sys.argv[1])
netns = importlib.util.module_from_spec(spec)
spec.loader.exec_module(netns)
print(netns._LOCK_FILE)
"""


@needs_netns
def test_one_subnet_lock_per_machine_and_a_subnet_in_use_is_refused(tmp_path):
    """Concurrent clusters choose their subnets under one lock whatever TMPDIR their processes have (a
    process with another TMPDIR took another lock: two bridges with one address), and a subnet given
    explicitly that a bridge already uses is refused instead of routed twice."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    lock = subprocess.run([sys.executable, "-c", LOCK_OF, netns.__file__], env=env, capture_output=True, text=True,
                          timeout=30).stdout.strip()
    assert lock == netns._LOCK_FILE
    with SimulatedCluster(1) as cluster:
        subnet = f"{cluster.host_address.rsplit('.', 1)[0]}.0/24"
        clash = SimulatedCluster(1, subnet=subnet)
        with pytest.raises(ValueError, match=f"subnet {subnet} is in use"):
            with clash:
                pass
        assert _leftovers(clash.id) == []
