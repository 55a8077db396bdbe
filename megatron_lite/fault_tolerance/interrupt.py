"""Releasing a rank from the collectives of a generation that was abandoned, from another thread than the one
blocked in them (membership.py's gen_<g>/abort watcher calls interrupt_generation).

gloo cannot abort an operation (measured: `_abort_process_group()` / `pg.abort()` return, but a blocked
all_reduce waits out its timeout); shutting down the process's connected TCP sockets, the job store's
excepted, makes it raise within ~0.1 s. NCCL's communicators are aborted (TORCH_NCCL_ASYNC_ERROR_HANDLING=2
keeps the process alive).
"""

import os
import socket
from typing import Set, Tuple

import torch
import torch.distributed as dist


def store_endpoints(address: str) -> Set[Tuple[str, int]]:
    """The (ip, port) pairs of the store at `address` (connect_store's forms): the connections
    interrupt_generation leaves alone. Host names are resolved as the store's client resolves them."""
    hosts = address[len("etcd://"):].split("/", 1)[0].split(",") if address.startswith("etcd://") else [address]
    endpoints = set()
    for host_port in hosts:
        host, port = host_port.rsplit(":", 1)
        host = host.strip("[]")  # an IPv6 literal
        try:
            infos = socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)
        except socket.gaierror:
            infos = []
        endpoints.add((host, int(port)))
        endpoints.update((_plain_ip(info[4][0]), int(port)) for info in infos)
    return endpoints


def _plain_ip(ip: str) -> str:
    """An IPv4 address seen through an IPv6 socket ("::ffff:10.0.0.1") as the IPv4 address."""
    return ip[len("::ffff:"):] if ip.startswith("::ffff:") and "." in ip else ip


def shutdown_connections(keep: Set[Tuple[str, int]]) -> int:
    """Shut down (SHUT_RDWR) every connected TCP socket of this process whose peer or local address is not in
    `keep`: a gloo collective blocked on one of them raises "Connection closed by peer" at once (gloo has no
    abort; its pairs are plain TCP connections). The process's own descriptors are left open (each socket is
    reached through a duplicate, which is closed). Returns how many were shut down."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed meanwhile (listdir's own descriptor, a socket another thread closed)
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            peer, local = sock.getpeername(), sock.getsockname()  # a listening socket has no peer: OSError
            if (_plain_ip(peer[0]), peer[1]) in keep or (_plain_ip(local[0]), local[1]) in keep:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            continue
        finally:
            sock.close()  # the duplicate only
    return count


def interrupt_generation(keep: Set[Tuple[str, int]]) -> str:
    """Release this process from the collectives of its process groups, from another thread than the one
    blocked in them: NCCL: abort the communicators (the collective raises; TORCH_NCCL_ASYNC_ERROR_HANDLING=2
    keeps the process alive); gloo: shut down its connections (shutdown_connections; the store's, `keep`,
    excepted). Returns what was done, for the log."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return f"aborted the NCCL communicators of {_abort_nccl_groups()} process group(s)"
    return f"shut down {shutdown_connections(keep)} connection(s)"


def _abort_nccl_groups() -> int:
    """Abort every process group's NCCL communicators, leaving torch's bookkeeping of the groups alone (the
    thread that trains drops them: Membership.leave). The aborts go inside one NCCL group call, as
    torch's _abort_process_group does them: separate aborts of communicators with work in flight can wait on
    each other (pytorch/pytorch#119797). Returns how many groups."""
    c10d = dist.distributed_c10d
    groups = sorted(c10d._world.pg_names, key=lambda group: c10d._world.pg_names[group], reverse=True)
    nccl = c10d._get_default_group()._get_backend(torch.device("cuda"))
    nccl._group_start()
    try:
        for group in groups:
            group.abort()
    finally:
        nccl._group_end()
    return len(groups)


def nccl_backends(group) -> list:
    """The NCCL backend of a process group (the one whose error state matters), [] when it has none."""
    try:
        return [group._get_backend(torch.device("cuda"))]
    except (RuntimeError, AttributeError):  # a gloo-only group, a CPU build
        return []
