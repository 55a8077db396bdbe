"""etcd as the job's coordination engine: a client, a torch.distributed Store on it, and a local cluster runner.

Everything a multi-node job shares (membership.py's generations, the agents' registrations and leader) lives in
a 3-member etcd cluster, which survives the loss of any one node. The client speaks etcd's v3 JSON gateway
(POST /v3/kv/..., /v3/lease/...; keys and values base64) with the standard library only::

    EtcdClient(["10.77.0.2:2379", "10.77.0.3:2379", "10.77.0.4:2379"], timeout_s=2.0)
        one keep-alive HTTP connection per endpoint per thread; requests go to the last endpoint that answered
        (sticky) and on to the next one when it refuses, resets or times out; each call is bounded by timeout_s
        (EtcdUnavailable past it), so a client cut off from the quorum fails instead of hanging
    EtcdStore(endpoints, "/megatron_lite/<job>/store/")
        torch.distributed.Store with TCPStore's semantics on the keys under the prefix: membership.py and
        init_process_group("gloo", store=PrefixStore(...)) run on it unchanged
    LocalEtcd(["127.0.0.1"] * 3)
        a cluster of local etcd processes (optionally each inside a network namespace) for tests and soaks

A request that may have reached etcd but got no answer (a timeout after sending it) is retried on another
endpoint only when repeating it is harmless (reads, puts, deletes, lease keepalives). A transaction is not
repeated blindly: the client raises EtcdIndeterminate, and the operations built on transactions (create,
replace, EtcdStore.add / compare_set) find out what happened from a receipt written by the same transaction.
"""

import base64
import ctypes
import datetime
import http.client
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch.distributed as dist

Data = Union[str, bytes]

ETCD_FLAGS = ["--heartbeat-interval", "50", "--election-timeout", "500", "--pre-vote"]
"""Fast failover (a lost leader is replaced within ~1 s) and pre-vote (etcd 3.4 has it off: without it a member
that comes back from a partition forces an election)."""

RECEIPTS = "/megatron_lite/.receipts/"
"""Where EtcdClient keeps one receipt key per client, process and thread (see EtcdClient._txn_resolved)."""

_UNAVAILABLE = 14  # gRPC's code for "not served now" (no leader, leader changed, request timed out, stopping)


class EtcdError(RuntimeError):
    """etcd refused a request (a bad argument, a lease that is gone, ...)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the client's timeout (members dead, cut off, or without a quorum)."""


class EtcdIndeterminate(EtcdUnavailable):
    """A transaction was sent but no answer came: it may or may not have been applied."""


def _bytes(data: Data) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode()
    raise TypeError(f"etcd keys and values are str or bytes, got {type(data).__name__}")


def _b64(data: Data) -> str:
    return base64.b64encode(_bytes(data)).decode()


def _unb64(text: Optional[str]) -> bytes:
    return base64.b64decode(text) if text else b""


def _prefix_range(prefix: Data) -> dict:
    """etcd's key range of every key starting with `prefix` (range_end: the smallest key greater than all of them;
    "\0" both ways: the whole key space)."""
    start = _bytes(prefix)
    stripped = start.rstrip(b"\xff")
    end = stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b"\0"
    return {"key": _b64(start or b"\0"), "range_end": _b64(end)}


# Builders of the raw transaction dicts EtcdClient.txn takes (the gateway's JSON form of etcd's TxnRequest).
def compare_value(key: Data, value: Data, result: str = "EQUAL") -> dict:
    return {"target": "VALUE", "key": _b64(key), "result": result, "value": _b64(value)}


def compare_create_revision(key: Data, revision: int, result: str = "EQUAL") -> dict:
    """revision 0 with EQUAL: the key does not exist."""
    return {"target": "CREATE", "key": _b64(key), "result": result, "create_revision": str(revision)}


def compare_mod_revision(key: Data, revision: int, result: str = "EQUAL") -> dict:
    return {"target": "MOD", "key": _b64(key), "result": result, "mod_revision": str(revision)}


def put_op(key: Data, value: Data, lease: int = 0) -> dict:
    request = {"key": _b64(key), "value": _b64(value)}
    if lease:
        request["lease"] = str(lease)
    return {"request_put": request}


def range_op(key: Data) -> dict:
    return {"request_range": {"key": _b64(key)}}


def delete_op(key: Data) -> dict:
    return {"request_delete_range": {"key": _b64(key)}}


def _readable(sock: socket.socket) -> bool:
    """Whether `sock` has something to read now (poll: select() refuses descriptors above 1024)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _parse_endpoint(endpoint: str) -> Tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} is not host:port (e.g. 127.0.0.1:2379)")
    return host.strip("[]"), int(port)


class EtcdClient:
    """A client of an etcd cluster over its v3 JSON gateway (standard library only).

    Args:
        endpoints: the members' client addresses, "host:port" (a list, or one comma-separated string).
        timeout_s: the bound on each call, whichever endpoints it tries (EtcdUnavailable past it).
        attempt_timeout_s: how long one endpoint may take before the next is tried (default: half of timeout_s,
            at most 2 s, with several endpoints): a frozen or cut-off member costs this once, then the client
            sticks to a member that answers.

    Every read is linearizable (etcd's default): a member cut off from the quorum cannot answer it, so a client
    that reaches only such a member fails within timeout_s instead of reading stale data.
    Thread-safe: each thread has its own connections (and a forked child opens new ones).
    """

    def __init__(self, endpoints: Union[str, Sequence[str]], timeout_s: float = 2.0,
                 attempt_timeout_s: Optional[float] = None):
        if isinstance(endpoints, str):
            endpoints = endpoints.split(",")
        self.endpoints = [endpoint.strip() for endpoint in endpoints if endpoint.strip()]
        if not self.endpoints:
            raise ValueError("EtcdClient needs at least one endpoint (host:port)")
        self._addresses = [_parse_endpoint(endpoint) for endpoint in self.endpoints]
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        if attempt_timeout_s is None:
            attempt_timeout_s = min(self.timeout_s / 2, 2.0) if len(self.endpoints) > 1 else self.timeout_s
        if not isinstance(attempt_timeout_s, (int, float)) or not attempt_timeout_s > 0:
            raise ValueError(f"attempt_timeout_s must be a positive number of seconds, got {attempt_timeout_s!r}")
        self.attempt_timeout_s = float(attempt_timeout_s)
        self._preferred = 0  # the endpoint that answered last (shared by the threads)
        self._id = uuid.uuid4().hex[:12]  # names this client's receipt keys
        self._local = threading.local()

    def __repr__(self):
        return f"EtcdClient({','.join(self.endpoints)!r}, timeout_s={self.timeout_s})"

    # ---- transport ----
    def _connections(self) -> Dict[int, http.client.HTTPConnection]:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():  # a forked child must not share its parent's sockets
            local.pid, local.connections = os.getpid(), {}
        return local.connections

    def close(self):
        """Closes this thread's connections (they reopen on the next request)."""
        for connection in self._connections().values():
            connection.close()
        self._connections().clear()

    def _post(self, path: str, body: dict, repeatable: bool = True, field: Optional[str] = None) -> dict:
        """POSTs `body` to `path` on the preferred endpoint, then on the others in turn until one answers or
        timeout_s has passed. `repeatable`: sending the request twice is harmless (not a transaction). `field`:
        an answer without it is no answer (a stream that ended without its response)."""
        payload = json.dumps(body).encode()
        deadline = time.monotonic() + self.timeout_s
        errors: Dict[str, str] = {}
        count, backoff = len(self.endpoints), 0.01
        index = self._preferred % count
        tried_in_round = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EtcdUnavailable(f"no etcd endpoint answered {path} within {self.timeout_s} s: "
                                      + "; ".join(f"{e}: {why}" for e, why in errors.items()))
            # Leave time for the other endpoints when this one hangs (frozen, or cut off from the network).
            outcome = self._attempt(index, path, payload, min(remaining, self.attempt_timeout_s), repeatable, field)
            if isinstance(outcome, dict):
                self._preferred = index
                return outcome
            errors[self.endpoints[index]] = outcome
            if self._preferred == index:
                self._preferred = (index + 1) % count  # the next call starts at another endpoint
            index, tried_in_round = (index + 1) % count, tried_in_round + 1
            if tried_in_round >= count:  # every endpoint failed: an election, or all down; back off a little
                time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                backoff, tried_in_round = min(backoff * 2, 0.2), 0

    def _attempt(self, index: int, path: str, payload: bytes, timeout: float, repeatable: bool,
                 field: Optional[str] = None):
        """One request to one endpoint: the response dict, or why it failed (str) when another endpoint may be
        tried. Raises EtcdError for etcd's own refusals, EtcdIndeterminate for an unanswered transaction."""
        connections = self._connections()
        connection = connections.get(index)
        if connection is None:
            host, port = self._addresses[index]
            connection = connections[index] = http.client.HTTPConnection(host, port, timeout=timeout)
        connection.timeout = timeout
        if connection.sock is not None and _readable(connection.sock):
            connection.close()  # readable while idle: the member closed it (it died or restarted): a new one
        sent = False
        try:
            if connection.sock is None:
                connection.connect()
            connection.sock.settimeout(timeout)
            connection.request("POST", path, payload, {"Content-Type": "application/json"})
            sent = True  # (a failed send delivered nothing: the request is one small write)
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as error:
            connection.close()
            if not sent or repeatable:
                return f"{type(error).__name__}: {error}"
            raise EtcdIndeterminate(f"etcd {self.endpoints[index]} did not answer {path} ({type(error).__name__}: "
                                    f"{error}): it may or may not have been applied") from error
        try:
            answer = json.loads(data) if data else {}
        except ValueError:
            answer = {"message": data[:200].decode(errors="replace")}
        if isinstance(answer.get("error"), dict):  # a streamed call's error (lease keepalive): nested
            answer = {**answer["error"], "code": answer["error"].get("grpc_code")}
        elif response.status == 200 and field is not None and field not in answer:
            return f"an answer without {field!r}: {data[:200]!r}"
        elif response.status == 200:
            return answer
        code, message = answer.get("code"), answer.get("message") or answer.get("error") or str(response.status)
        if code == _UNAVAILABLE and (repeatable or "no leader" in message):
            return f"{message} (code {code})"
        if code == _UNAVAILABLE:
            raise EtcdIndeterminate(f"etcd {self.endpoints[index]}: {message} on {path}: it may or may not have "
                                    "been applied")
        raise EtcdError(f"etcd {self.endpoints[index]} refused {path}: {message} (code {code})")

    # ---- keys ----
    def put(self, key: Data, value: Data, lease: int = 0):
        self._post("/v3/kv/put", put_op(key, value, lease)["request_put"])

    def _range(self, key: Data) -> Optional[dict]:
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs")
        return kvs[0] if kvs else None

    def get(self, key: Data) -> Optional[bytes]:
        kv = self._range(key)
        return None if kv is None else _unb64(kv.get("value"))

    def get_with_revision(self, key: Data) -> Optional[Tuple[bytes, int]]:
        """(value, mod_revision), None if absent."""
        kv = self._range(key)
        return None if kv is None else (_unb64(kv.get("value")), int(kv["mod_revision"]))

    def get_prefix(self, prefix: Data) -> Dict[str, bytes]:
        answer = self._post("/v3/kv/range", _prefix_range(prefix))
        return {_unb64(kv["key"]).decode(errors="replace"): _unb64(kv.get("value")) for kv in answer.get("kvs", [])}

    def count_prefix(self, prefix: Data) -> int:
        answer = self._post("/v3/kv/range", {**_prefix_range(prefix), "count_only": True})
        return int(answer.get("count", 0))

    def delete(self, key: Data) -> bool:
        """Whether the key existed."""
        return int(self._post("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0)) > 0

    def delete_prefix(self, prefix: Data) -> int:
        """How many keys were deleted."""
        answer = self._post("/v3/kv/deleterange", _prefix_range(prefix))
        return int(answer.get("deleted", 0))

    def txn(self, compare: list, success: list, failure: list = ()) -> Tuple[bool, list]:
        """etcd's transaction on raw gateway dicts (see compare_value, put_op, ...): (succeeded, responses).
        Raises EtcdIndeterminate when it was sent but not answered."""
        answer = self._post("/v3/kv/txn", {"compare": list(compare), "success": list(success),
                                           "failure": list(failure)}, repeatable=False)
        return bool(answer.get("succeeded", False)), answer.get("responses", [])

    def _receipt_key(self) -> str:
        """This thread's receipt key (one per client, process and thread, overwritten by each resolved txn)."""
        return f"{RECEIPTS}{self._id}.{os.getpid()}.{threading.get_ident()}"

    def _txn_resolved(self, compare: list, success: list, failure: list = ()) -> Tuple[bool, list]:
        """txn() whose outcome is known even when a copy goes unanswered: `success` also writes a token unique to
        this call under the thread's receipt key, so an unanswered copy was applied iff the receipt holds the token
        (the key's value cannot tell: another process's equal add or replace leaves the same value). Otherwise
        the same transaction is sent again: of its copies at most one passes `compare` while the key moves on,
        and a failed answer is checked against the receipt too (an earlier copy may have won). (succeeded,
        responses: [] when only the receipt answered)."""
        receipt, token = self._receipt_key(), uuid.uuid4().hex.encode()
        ops, unanswered = list(success) + [put_op(receipt, token)], False
        deadline = time.monotonic() + 3 * self.timeout_s
        while True:
            try:
                succeeded, responses = self.txn(compare, ops, failure)
            except EtcdIndeterminate:
                if self.get(receipt) == token:
                    return True, []
                if time.monotonic() > deadline:
                    raise
                unanswered = True
                continue
            if succeeded or not unanswered:
                return succeeded, responses
            return self.get(receipt) == token, responses

    def _put_if(self, key: Data, expected: Optional[Data], value: Data, lease: int) -> bool:
        """txn(key holds `expected` (None: absent) -> put value), its outcome known (_txn_resolved)."""
        compare = compare_create_revision(key, 0) if expected is None else compare_value(key, expected)
        return self._txn_resolved([compare], [put_op(key, value, lease)])[0]

    def create(self, key: Data, value: Data, lease: int = 0) -> bool:
        """Puts `value` only if `key` does not exist. Whether it did."""
        return self._put_if(key, None, value, lease)

    def replace(self, key: Data, expected: Optional[Data], value: Data, lease: int = 0) -> bool:
        """Compare-and-swap: puts `value` only if the key holds `expected` (None: only if it is absent)."""
        return self._put_if(key, expected, value, lease)

    def revision(self) -> int:
        """The cluster's current revision (a linearizable read)."""
        return int(self._post("/v3/kv/range", {"key": _b64(b"\0"), "count_only": True})["header"]["revision"])

    def status(self) -> dict:
        """The answering member's status (etcd's maintenance Status, raw: header.member_id, leader, version...)."""
        return self._post("/v3/maintenance/status", {})

    # ---- leases ----
    def lease_grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds (an int >= 1: etcd's granularity); its id."""
        if not isinstance(ttl_s, int) or ttl_s < 1:
            raise ValueError(f"lease ttl_s must be an int >= 1 (seconds), got {ttl_s!r}")
        return int(self._post("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def lease_keepalive(self, lease: int) -> int:
        """Renews the lease: its remaining TTL in seconds, 0 when it is gone (expired or revoked)."""
        answer = self._post("/v3/lease/keepalive", {"ID": str(lease)}, field="result")
        return int(answer["result"].get("TTL", 0))

    def lease_revoke(self, lease: int):
        """Revokes the lease (its keys are deleted); a lease already gone is fine."""
        try:
            self._post("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as error:
            if "not found" not in str(error):
                raise


class EtcdStore(dist.Store):
    """A torch.distributed.Store on etcd with TCPStore's semantics, on the keys under `prefix`.

    Works as the store of init_process_group("gloo", store=PrefixStore(p, store)) and dist.new_group, and of
    membership.Membership. get / wait block until the keys exist, polling with backoff (1 ms .. 20 ms), and raise
    DistStoreError ("wait timeout ...") past the store's timeout.

    Args:
        endpoints: the cluster's client addresses ("host:port" list or comma-separated), or an EtcdClient.
        prefix: the key space (e.g. "/megatron_lite/<job>/store/"); keys are prefix + name.
        timeout_s: the blocking waits' default timeout (set_timeout changes it).
        request_timeout_s: the bound on each etcd request (the client's timeout_s): long enough to ride out an
            etcd election on a loaded machine (a lost member costs no generation); a process cut off from the
            quorum is stopped by its agent (the node's lease) well before.
    """

    def __init__(self, endpoints: Union[str, Sequence[str], EtcdClient], prefix: str, timeout_s: float = 300.0,
                 request_timeout_s: float = 10.0):
        super().__init__()
        if not isinstance(prefix, str) or not prefix.startswith("/"):
            raise ValueError(f"EtcdStore prefix must be a str starting with '/' (e.g. '/megatron_lite/job/store/'), "
                             f"got {prefix!r}")
        self.client = endpoints if isinstance(endpoints, EtcdClient) else EtcdClient(endpoints, request_timeout_s)
        self.prefix = prefix
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    @classmethod
    def from_url(cls, url: str, timeout_s: float = 300.0, request_timeout_s: float = 10.0) -> "EtcdStore":
        """From "etcd://h1:2379,h2:2379,h3:2379/megatron_lite/job/store/" (the prefix is the path, with its /)."""
        if not url.startswith("etcd://") or "/" not in url[len("etcd://"):]:
            raise ValueError(f"etcd store url {url!r} is not etcd://host:port[,host:port...]/prefix/")
        hosts, path = url[len("etcd://"):].split("/", 1)
        return cls(hosts, "/" + path, timeout_s, request_timeout_s)

    @property
    def url(self) -> str:
        """etcd://h1:2379,h2:2379/prefix/: what from_url takes (MEGATRON_LITE_LIVE_STORE)."""
        return f"etcd://{','.join(self.client.endpoints)}{self.prefix}"

    def raw_key(self, name: str) -> str:
        """The etcd key of the store's key `name` (for a lease-bound put with the client)."""
        return self.prefix + name

    def set_timeout(self, timeout: datetime.timedelta):
        self._timeout_s = timeout.total_seconds()
        dist.Store.set_timeout(self, timeout)

    def set(self, key: str, value: Data):
        self.client.put(self.raw_key(key), value)

    def get(self, key: str) -> bytes:
        while True:
            self.wait([key])
            value = self.client.get(self.raw_key(key))
            if value is not None:  # else deleted in between: wait again (TCPStore's get waits for the key too)
                return value

    def add(self, key: str, amount: int) -> int:
        """Adds `amount` to the integer under `key` (absent: 0) atomically; returns the new value."""
        raw = self.raw_key(key)
        while True:
            current = self.client.get_with_revision(raw)
            if current is None:
                new, compare = int(amount), compare_create_revision(raw, 0)
            else:
                new, compare = int(current[0] or b"0") + int(amount), compare_mod_revision(raw, current[1])
            if self.client._txn_resolved([compare], [put_op(raw, str(new))])[0]:
                return new

    def compare_set(self, key: str, expected: Data, desired: Data) -> bytes:
        """TCPStore's compare_set: puts `desired` if the key holds `expected` ("" = absent); returns the value
        stored afterwards (`expected` itself when the key is absent and `expected` is not "")."""
        raw, expected = self.raw_key(key), _bytes(expected)
        compare = compare_create_revision(raw, 0) if not expected else compare_value(raw, expected)
        succeeded, responses = self.client._txn_resolved([compare], [put_op(raw, desired)], [range_op(raw)])
        if succeeded:
            return _bytes(desired)
        kvs = responses[0].get("response_range", {}).get("kvs") if responses else None
        if not kvs:
            return expected
        stored = _unb64(kvs[0].get("value"))
        if not expected and stored == b"":  # TCPStore: an existing empty value also matches ""
            return self._replace_empty(raw, desired)
        return stored

    def _replace_empty(self, raw: str, desired: Data) -> bytes:
        if self.client.replace(raw, b"", desired):
            return _bytes(desired)
        stored = self.client.get(raw)
        return b"" if stored is None else stored

    def check(self, keys: List[str]) -> bool:
        return all(self.client.get(self.raw_key(key)) is not None for key in keys)

    def wait(self, keys: List[str], timeout: Optional[datetime.timedelta] = None):
        timeout_s = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline, pause = time.monotonic() + timeout_s, 0.001
        pending, unavailable = list(keys), ""
        while True:
            try:
                pending = [key for key in pending if self.client.get(self.raw_key(key)) is None]
                unavailable = ""
            except EtcdUnavailable as error:  # an election, a member lost: the wait's own deadline decides
                unavailable = f"; etcd: {error}"
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"wait timeout after {timeout_s * 1000:.0f}ms, keys: {pending} "
                                          f"(etcd store {self.url}){unavailable}")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.02)

    def delete_key(self, key: str) -> bool:
        return self.client.delete(self.raw_key(key))

    def num_keys(self) -> int:
        return self.client.count_prefix(self.prefix)

    def append(self, key: str, value: Data):
        raw = self.raw_key(key)
        while True:
            current = self.client.get_with_revision(raw)
            if current is None:
                compare, new = compare_create_revision(raw, 0), _bytes(value)
            else:
                compare, new = compare_mod_revision(raw, current[1]), current[0] + _bytes(value)
            if self.client._txn_resolved([compare], [put_op(raw, new)])[0]:
                return

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: List[str], values: List[Data]):
        for key, value in zip(keys, values):
            self.set(key, value)


# ---- running etcd ----
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
