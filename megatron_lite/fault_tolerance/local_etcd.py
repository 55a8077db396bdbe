"""A cluster of local etcd processes, for tests and soaks: `LocalEtcd(["127.0.0.1"] * 3)` (each member
optionally inside a network namespace, netns.py's simulated nodes), `etcd_available()`, `etcd_command()`.

The job itself never starts etcd: its agents are given the endpoints of a cluster that runs on the nodes
(docs/fault_tolerance.md "Across nodes"); etcd.py is the client.
"""

import ctypes
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, List, Optional, Sequence, Tuple

from .etcd import EtcdClient, EtcdError

ETCD_FLAGS = ["--heartbeat-interval", "50", "--election-timeout", "500", "--pre-vote"]
"""Fast failover (a lost leader is replaced within ~1 s) and pre-vote (etcd 3.4 has it off: without it a member
that comes back from a partition forces an election)."""


def etcd_available() -> Tuple[bool, str]:
    """Whether the etcd binary can run here: (True, version) or (False, why)."""
    binary = shutil.which("etcd")
    if binary is None:
        return False, "the etcd binary is not on PATH (Debian/Ubuntu: apt-get install etcd-server)"
    try:
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"{binary} --version failed: {error}"
    if version.returncode != 0:
        return False, f"{binary} --version exited {version.returncode}: {version.stderr.strip()[:200]}"
    return True, version.stdout.splitlines()[0] if version.stdout else binary


def etcd_command(name: str, data_dir: str, client_url: str, peer_url: str, initial_cluster: Dict[str, str],
                 cluster_token: str = "megatron-lite") -> List[str]:
    """The command line of one etcd member of a new cluster (urls like "http://10.77.0.2:2379")."""
    return [shutil.which("etcd") or "etcd", "--name", name, "--data-dir", data_dir,
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", ",".join(f"{member}={url}" for member, url in initial_cluster.items()),
            "--initial-cluster-state", "new", "--initial-cluster-token", cluster_token,
            "--log-level", "warn", *ETCD_FLAGS]


def _free_port(host: str) -> int:
    for address in (host, "127.0.0.1"):  # a namespace's address cannot be bound here: any free local port
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((address, 0))
                return probe.getsockname()[1]
        except OSError:
            continue
    raise OSError(f"no free port on {host}")


def _die_with_parent():
    """In the child, before exec: SIGKILL it when the thread that started it ends (a test process killed without
    its cleanup leaves no etcd behind). Kept across exec, so through `ip netns exec` too."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop() is the only cleanup


_HEALTH_PROBE = ("import sys, urllib.request\n"
                 "try:\n"
                 "    body = urllib.request.urlopen(sys.argv[1] + '/health', timeout=float(sys.argv[2])).read()\n"
                 "except Exception:\n"
                 "    sys.exit(1)\n"
                 "sys.exit(0 if b'true' in body else 1)\n")


class LocalEtcd:
    """A local etcd cluster of len(hosts) members, for tests and soaks (a context manager: started on enter,
    every member stopped and its data removed on exit, also after an error).

    Args:
        hosts: each member's address (e.g. ["127.0.0.1"] * 3, or the simulated nodes' addresses).
        prefix_argvs: per member, an argv prefix to run it with (e.g. ["ip", "netns", "exec", ns]) or None.
        client_ports, peer_ports: per member (default: free ports, picked here).
        data_dir: where the members' data and logs go (default: a new directory on /dev/shm).
        start_timeout_s: the bound on waiting for the cluster to be healthy.

    The members die with the thread that started them (PR_SET_PDEATHSIG): start a LocalEtcd from a thread that
    outlives it (e.g. the main thread).
    """

    def __init__(self, hosts: Sequence[str] = ("127.0.0.1",), prefix_argvs: Optional[Sequence[Optional[List[str]]]]
                 = None, client_ports: Optional[Sequence[int]] = None, peer_ports: Optional[Sequence[int]] = None,
                 data_dir: Optional[str] = None, start_timeout_s: float = 30.0):
        self.hosts = list(hosts)
        size = len(self.hosts)
        if size < 1:
            raise ValueError("LocalEtcd needs at least one host")
        for name, values in (("prefix_argvs", prefix_argvs), ("client_ports", client_ports),
                             ("peer_ports", peer_ports)):
            if values is not None and len(values) != size:
                raise ValueError(f"LocalEtcd: {name} has {len(values)} entries for {size} hosts (one per member)")
        self.prefix_argvs = [list(argv or []) for argv in (prefix_argvs or [None] * size)]
        self.client_ports = list(client_ports) if client_ports else [_free_port(host) for host in self.hosts]
        self.peer_ports = list(peer_ports) if peer_ports else [_free_port(host) for host in self.hosts]
        self.start_timeout_s = start_timeout_s
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="mlite_etcd_",
                                                     dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        token = f"mlite-{uuid.uuid4().hex[:8]}"
        self.names = [f"m{i}" for i in range(size)]
        peers = {name: f"http://{host}:{port}" for name, host, port in zip(self.names, self.hosts, self.peer_ports)}
        self.commands = [self.prefix_argvs[i] + etcd_command(self.names[i], os.path.join(self.data_dir, self.names[i]),
                                                             self.client_url(i), peers[self.names[i]], peers, token)
                         for i in range(size)]
        self.processes: List[Optional[subprocess.Popen]] = [None] * size
        self._reachable: List[Optional[bool]] = [None] * size  # member i's address from this process's network

    @property
    def endpoints(self) -> List[str]:
        return [f"{host}:{port}" for host, port in zip(self.hosts, self.client_ports)]

    def client_url(self, i: int) -> str:
        return f"http://{self.hosts[i]}:{self.client_ports[i]}"

    def store_url(self, prefix: str) -> str:
        """An EtcdStore url on this cluster ("etcd://h:p,.../prefix/")."""
        return f"etcd://{','.join(self.endpoints)}/{prefix.lstrip('/')}"

    def log_path(self, i: int) -> str:
        return os.path.join(self.data_dir, f"{self.names[i]}.log")

    def __enter__(self) -> "LocalEtcd":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        """Starts every member and waits until each says it is healthy (EtcdError past start_timeout_s)."""
        for i in range(len(self.hosts)):
            self._spawn(i)
        self.wait_healthy(range(len(self.hosts)))

    def _spawn(self, i: int):
        with open(self.log_path(i), "ab") as log:
            self.processes[i] = subprocess.Popen(self.commands[i], stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, start_new_session=True,
                                                 preexec_fn=_die_with_parent)

    def healthy(self, i: int, timeout_s: float = 1.0) -> bool:
        """Whether member i answers /health with "true" (it has a leader): asked from here when its address is
        reachable (a simulated node's is, over the bridge), else from its own namespace (a process started with
        its prefix_argv: slower)."""
        if self._reachable[i] is not False:
            connection = http.client.HTTPConnection(self.hosts[i], self.client_ports[i], timeout=timeout_s)
            try:
                connection.request("GET", "/health")
                self._reachable[i] = True
                return b"true" in connection.getresponse().read()
            except ConnectionRefusedError:
                return False  # reachable, not listening yet
            except (OSError, http.client.HTTPException):
                if self._reachable[i] or not self.prefix_argvs[i]:
                    return False
                self._reachable[i] = False
            finally:
                connection.close()
        probe = self.prefix_argvs[i] + [sys.executable, "-c", _HEALTH_PROBE, self.client_url(i), str(timeout_s)]
        try:
            return subprocess.run(probe, capture_output=True, timeout=timeout_s + 10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait_healthy(self, members: Sequence[int], timeout_s: Optional[float] = None):
        """Waits until each of `members` says it is healthy; EtcdError (with their logs' ends) when one exited or
        past timeout_s (default: start_timeout_s)."""
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pending, pause = list(members), 0.02
        while pending:
            for i in list(pending):
                process = self.processes[i]
                if process is None or process.poll() is not None:
                    raise EtcdError(f"etcd member {self.names[i]} ({self.commands[i]}) exited "
                                    f"{None if process is None else process.returncode}:\n{self._log_tail(i)}")
                if self.healthy(i):
                    pending.remove(i)
            if pending and time.monotonic() > deadline:
                raise EtcdError(f"etcd members {[self.names[i] for i in pending]} not healthy within "
                                f"{timeout_s} s:\n" + "\n".join(self._log_tail(i) for i in pending))
            if pending:
                time.sleep(pause)
                pause = min(pause * 2, 0.2)

    def _log_tail(self, i: int, lines: int = 15) -> str:
        try:
            with open(self.log_path(i), errors="replace") as log:
                return "".join(log.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def leader(self, timeout_s: float = 2.0) -> Optional[int]:
        """The index of the raft leader (asked over this process's network: members in other namespaces must be
        reachable from it), None when no live member names one."""
        ids, leader = {}, None
        for i in range(len(self.hosts)):
            if self.processes[i] is None or self.processes[i].poll() is not None:
                continue
            try:
                status = EtcdClient(self.endpoints[i:i + 1], timeout_s).status()
            except EtcdError:
                continue
            ids[status["header"]["member_id"]] = i
            leader = status.get("leader") or leader
        return ids.get(leader)

    def kill(self, i: int):
        """SIGKILLs member i with its process group (a prefix that forks, not execs, leaves etcd below the
        process started: it goes too); its data stays: restart(i) brings it back."""
        process = self.processes[i]
        if process is not None and process.returncode is None:  # not reaped: its pid is still the group's id
            try:
                os.killpg(process.pid, signal.SIGKILL)  # start_new_session: the group is the member's
            except ProcessLookupError:
                pass
            process.wait(timeout=30)

    def restart(self, i: int, wait: bool = True):
        """Starts member i again on its data (after kill(i)); waits until it is healthy unless `wait` is False."""
        self.kill(i)
        self._spawn(i)
        if wait:
            self.wait_healthy([i])

    def stop(self):
        """Kills every member (SIGKILL: a graceful stop moves the leadership first, seconds for nothing here)
        and removes the data directory if it made it."""
        for i in range(len(self.processes)):
            self.kill(i)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
