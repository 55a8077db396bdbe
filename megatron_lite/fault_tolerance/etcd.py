"""etcd as the job's coordination engine: a client and a torch.distributed Store on it.

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

A request that may have reached etcd but got no answer (a timeout after sending it) is retried on another
endpoint only when repeating it is harmless (reads, puts, deletes, lease keepalives). A transaction is not
repeated blindly: the client raises EtcdIndeterminate, and the operations built on transactions (create,
replace, EtcdStore.add / compare_set) find out what happened from a receipt written by the same transaction.
"""

import base64
import datetime
import http.client
import json
import os
import select
import socket
import threading
import time
import uuid
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch.distributed as dist

Data = Union[str, bytes]

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
