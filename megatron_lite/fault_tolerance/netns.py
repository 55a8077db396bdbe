"""Nodes on one machine for tests and soaks: Linux network namespaces on a bridge, one address per node.

A lost node is the loss of everything in its namespace, a partition is its link going down::

    root namespace:  bridge mlb<id> (host address .1)
                       |  mlv<id>-0        |  mlv<id>-1        |  mlv<id>-2     (veth, host side: cut/mend)
    namespace        mlt<id>-node0       mlt<id>-node1       mlt<id>-node2
      eth0 (ifname)    10.77.k.2           10.77.k.3           10.77.k.4       (+ lo up)
      processes        popen(node, ...)    ...                 ...              kill / freeze / thaw

<id> = the creating process's pid (hex) + "x" + a counter, so instances never collide (parallel tests,
several engineers); interface names stay within the kernel's 15 characters. Everything created is removed
when the context ends (also after an exception or Ctrl-C), and a later instance removes what an instance
of a dead process left behind (its pid is in the names). Needs root and iproute2 (`netns_available()`);
where namespaces cannot be made, `SimulatedCluster(..., loopback=True)` puts node k on 127.0.0.<k+2> with its
processes tracked by session, and `cut` raises NotImplementedError (tests skip with that reason).
"""

import atexit
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

# One lock per machine, not per TMPDIR: namespaces, bridges and addresses are the machine's (and need root, who
# can write /run, where `ip netns` keeps its names).
_LOCK_FILE = os.path.join("/run" if os.access("/run", os.W_OK) else tempfile.gettempdir(), "megatron_lite_netns.lock")
_OWNED = re.compile(r"^ml[tbv]([0-9a-f]+)x([0-9a-f]+)")
_counter = itertools.count()
_live_ids = set()  # ids of this process's open clusters (never swept)
SETTLE_S = 10.0
"""Bound on kill/freeze waiting for the processes of a node to be gone / stopped."""


def _new_id() -> str:
    """pid (hex) + "x" + a counter below 256 not used by an open cluster of this process: unique on the machine
    while this process lives, and short enough for interface names."""
    while True:
        candidate = f"{os.getpid():x}x{next(_counter) % 256:x}"
        if candidate not in _live_ids:
            return candidate


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def netns_available() -> Tuple[bool, str]:
    """(True, "") when this process can create network namespaces, veth pairs and bridges (root, iproute2),
    else (False, why)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None:
        return False, "no `ip` command (install iproute2)"
    probe_id = _new_id()
    probe, veth = f"mlt{probe_id}-probe", f"mlv{probe_id}-p"
    try:
        _ip("netns", "add", probe)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", probe)
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        return False, f"cannot create a network namespace with a veth pair: {error}"
    finally:
        _ip("link", "del", veth, check=False)
        _ip("netns", "del", probe, check=False)
    return True, ""


@dataclass(frozen=True)
class Node:
    """One simulated node."""

    index: int
    name: str
    """"node<k>" (or name_prefix + k): what a test passes as the agent's --node-name."""
    address: str
    """The node's one address (processes in it listen and connect with this)."""
    ifname: str
    """The interface that carries `address` inside the node: give it as GLOO_SOCKET_IFNAME."""
    namespace: Optional[str]
    """The network namespace's name; None on loopback."""

    @property
    def prefix_argv(self) -> List[str]:
        """Prepended to a command to run it in this node (what `SimulatedCluster.popen` does)."""
        return ["ip", "netns", "exec", self.namespace] if self.namespace else []


def _proc_state(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _all_pids() -> List[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _signal(pids: Sequence[int], signum: int):
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SimulatedCluster:
    """`num_nodes` nodes, each a network namespace with one address on a shared bridge (see the module
    docstring); a context manager: everything is created on entry and removed on exit.

    Args:
        num_nodes: how many nodes.
        name_prefix: node names are name_prefix + index (default "node").
        subnet: an IPv4 network such as "10.77.5.0/24" (host address = its first address, node k = the
            (k+2)-th); default: the first 10.77.<k>.0/24 that no interface of the machine uses. A subnet given
            that an interface of the machine already has an address in is refused (ValueError).
        loopback: no namespaces: node k is 127.0.0.<k+2> (ifname "lo"); `cut` / `mend` raise NotImplementedError.
    """

    def __init__(self, num_nodes: int, name_prefix: Optional[str] = None, subnet: Optional[str] = None,
                 loopback: bool = False):
        if not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
        self.num_nodes, self.loopback = num_nodes, loopback
        self.name_prefix = name_prefix or "node"
        self._subnet = subnet
        self.id = _new_id()
        self.bridge = f"mlb{self.id}"
        if num_nodes > 100:  # mlv + pid (<= 6 hex) + x + counter (<= 2 hex) + "-" + index (<= 2 digits)
            raise ValueError(f"num_nodes={num_nodes}: at most 100 nodes, so that interface names stay within the "
                             f"kernel's 15 characters")
        self.nodes: List[Node] = []
        self.host_address: Optional[str] = None
        self._procs: Dict[int, List[subprocess.Popen]] = {}
        self._created: List[Tuple[str, ...]] = []  # `ip` arguments that undo each step, in creation order

    def _veth(self, index: int) -> str:
        return f"mlv{self.id}-{index}"

    # ------------------------------------------------------------------------------------- set up, tear down
    def __enter__(self) -> "SimulatedCluster":
        _live_ids.add(self.id)
        atexit.register(self.close)
        try:
            if self.loopback:
                self.host_address = "127.0.0.1"
                self.nodes = [Node(k, f"{self.name_prefix}{k}", f"127.0.0.{k + 2}", "lo", None)
                              for k in range(self.num_nodes)]
            else:
                self._create()
        except BaseException:
            self.close(raise_errors=False)
            raise
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self.close(raise_errors=exc_type is None)

    def _create(self):
        with open(_LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # sweep + subnet choice + bridge address: one instance at a time
            sweep_stale()
            network = ipaddress.IPv4Network(self._subnet or _free_subnet())
            if self._subnet is not None:
                used = [address for address in _addresses() if ipaddress.IPv4Address(address) in network]
                if used:
                    raise ValueError(f"subnet {network} is in use on this machine ({', '.join(used)}): give "
                                     f"another one, or none to get a free 10.77.<k>.0/24")
            hosts = list(itertools.islice(network.hosts(), self.num_nodes + 1))
            if len(hosts) < self.num_nodes + 1:
                raise ValueError(f"subnet {network} has too few addresses for {self.num_nodes} nodes and the host")
            _ip("link", "add", self.bridge, "type", "bridge")
            self._created.append(("link", "del", self.bridge))
            _ip("addr", "add", f"{hosts[0]}/{network.prefixlen}", "dev", self.bridge)
        self.host_address = str(hosts[0])
        _ip("link", "set", self.bridge, "up")
        for k in range(self.num_nodes):
            namespace, veth = f"mlt{self.id}-{self.name_prefix}{k}", self._veth(k)
            _ip("netns", "add", namespace)
            self._created.append(("netns", "del", namespace))
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            self._created.append(("link", "del", veth))
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{hosts[k + 1]}/{network.prefixlen}", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            self.nodes.append(Node(k, f"{self.name_prefix}{k}", str(hosts[k + 1]), "eth0", namespace))

    def close(self, raise_errors: bool = True):
        """Kill every process of every node, then remove the links, namespaces and bridge (idempotent).
        RuntimeError naming what could not be removed, after trying everything (unless raise_errors=False:
        an exception is already on its way)."""
        atexit.unregister(self.close)
        problems = []
        for node in self.nodes:
            try:
                self.kill(node)
            except RuntimeError as error:
                problems.append(str(error))
        for step in reversed(self._created):  # veths first: deleting a namespace frees its veth only later
            result = _ip(*step, check=False)
            if result.returncode and "Cannot find device" not in result.stderr:
                problems.append(f"`ip {' '.join(step)}`: {result.stderr.strip()}")
        self._created.clear()
        _live_ids.discard(self.id)
        if problems and raise_errors:
            raise RuntimeError("SimulatedCluster could not clean up: " + "; ".join(problems))

    # ------------------------------------------------------------------------------------------- processes
    def popen(self, node: Node, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start `argv` in `node` (its own session unless start_new_session is given); tracked for kill/close."""
        popen_kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen([*node.prefix_argv, *argv], **popen_kwargs)
        self._procs.setdefault(node.index, []).append(process)
        return process

    def adopt(self, node: Node, process: subprocess.Popen):
        """Count `process`, started elsewhere (a LocalEtcd member, with its own session), as one of the node's:
        kill, freeze and thaw reach it on loopback too (in a namespace they reach it anyway)."""
        self._procs.setdefault(node.index, []).append(process)

    def pids(self, node: Node) -> List[int]:
        """Every live process of the node: in its namespace, or (loopback) in the sessions of the processes
        started there and their descendants. Zombies are not counted."""
        # Our own children, reaped so that a killed one is gone (not a zombie), count even before `ip netns
        # exec` has moved them into the namespace: a kill right after popen must not miss them.
        started = {process.pid for process in self._procs.get(node.index, []) if process.poll() is None}
        if node.namespace is None:
            return self._loopback_pids(node)
        try:
            target = f"net:[{os.stat(f'/run/netns/{node.namespace}').st_ino}]"
        except FileNotFoundError:  # removed by someone else: nothing can be in it any more
            return sorted(started)
        for pid in _all_pids():
            try:
                if os.readlink(f"/proc/{pid}/ns/net") == target and _proc_state(pid) not in (None, "Z"):
                    started.add(pid)
            except OSError:
                continue
        return sorted(started)

    def _loopback_pids(self, node: Node) -> List[int]:
        processes = self._procs.get(node.index, [])
        parent, session, present = {}, {}, set()
        for pid in _all_pids():
            try:
                with open(f"/proc/{pid}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
            except (OSError, IndexError):
                continue
            present.add(pid)
            if fields[0] != "Z":
                parent[pid], session[pid] = int(fields[1]), int(fields[3])
        roots = {process.pid for process in processes if process.returncode is None}  # a reaped pid may be reused
        # start_new_session: session id = the first pid. A session's id is not given to a new process while any
        # member of it lives, so a reaped process's pid found on a live process is a reuse: not our session.
        sessions = {process.pid for process in processes if process.pid in roots or process.pid not in present}
        found = {pid for pid in parent if pid in roots or session[pid] in sessions}
        grew = True
        while grew:  # descendants that left the session
            more = {pid for pid in parent if parent[pid] in found} - found
            found |= more
            grew = bool(more)
        return sorted(found)

    def _settle(self, node: Node, signum: int, done, what: str):
        deadline = time.monotonic() + SETTLE_S
        while True:
            pending = [pid for pid in self.pids(node) if not done(pid)]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node.name}: processes {pending} still not {what} after {SETTLE_S} s")
            _signal(pending, signum)
            time.sleep(0.01)

    def kill(self, node: Node):
        """SIGKILL every process of the node (the node is lost); returns once none is left."""
        self._settle(node, signal.SIGKILL, lambda pid: False, "gone")

    def freeze(self, node: Node):
        """SIGSTOP every process of the node (the node hangs); returns once every one is stopped."""
        self._settle(node, signal.SIGSTOP, lambda pid: _proc_state(pid) in ("T", "t"), "stopped")

    def thaw(self, node: Node):
        """SIGCONT every process of the node."""
        _signal(self.pids(node), signal.SIGCONT)

    # ---------------------------------------------------------------------------------------------- network
    def _link(self, node: Node, state: str):
        if node.namespace is None:
            raise NotImplementedError("a partition needs network namespaces (loopback nodes share one network): "
                                      + netns_available()[1])
        _ip("link", "set", self._veth(node.index), state)

    def cut(self, node: Node):
        """Take the node's link down (its cable pulled): nothing reaches it or leaves it; its processes run on."""
        self._link(node, "down")

    def mend(self, node: Node):
        """Bring the node's link back up."""
        self._link(node, "up")


def _addresses() -> List[str]:
    """Every IPv4 address of the root namespace's interfaces."""
    return re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)", _ip("-o", "-4", "addr", "show").stdout)


def _free_subnet() -> str:
    used = {address.split(".")[2] for address in _addresses() if address.startswith("10.77.")}
    for k in range(256):
        if str(k) not in used:
            return f"10.77.{k}.0/24"
    raise RuntimeError("every 10.77.<k>.0/24 is in use: give SimulatedCluster a subnet")


def sweep_stale():
    """Remove namespaces, veths and bridges that a SimulatedCluster of a process that no longer exists left
    behind (killed before it could clean up), with every process still in those namespaces."""
    def stale(name):
        match = _OWNED.match(name)
        if not match:
            return False
        pid = int(match.group(1), 16)
        if pid == os.getpid():
            return f"{match.group(1)}x{match.group(2)}" not in _live_ids
        return not _pid_alive(pid)

    namespaces = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show").stdout.splitlines()]
    for link in links:
        if link.startswith("mlv") and stale(link):
            _ip("link", "del", link, check=False)
    for namespace in namespaces:
        if stale(namespace):
            inode = os.stat(f"/run/netns/{namespace}").st_ino
            for pid in _all_pids():
                try:
                    if os.readlink(f"/proc/{pid}/ns/net") == f"net:[{inode}]":
                        os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
            _ip("netns", "del", namespace, check=False)
    for link in links:
        if link.startswith("mlb") and stale(link):
            _ip("link", "del", link, check=False)
